//! Device-error remediation end to end (docs/agent.md, "Device errors"; issue 22, "What it must
//! show" 4): each class of health event, injected through the real fake plugin's fault file into
//! a real agent, ends as the table says. One `suanli server`, one agent with three fake GPUs, and
//! `examples/trainer/trainer.py` (checkpointing) on one of them.
//!
//! 1. application (XID 13): the device stays in service, the trainer keeps running in the same
//!    attempt and finds the event in `$SUANLI_DEVICE_EVENTS`;
//! 2. recoverable (XID 79): the device leaves service, the trainer checkpoints and resumes (at
//!    most one interval lost), the agent resets the device once nothing holds it and the device
//!    is back in service although the fault is still listed (only the reset cleared it);
//! 3. fatal (XID 64) on an idle device: quarantined, in `quarantine.json`;
//! 4. a recoverable error whose resets fail: quarantined after three resets;
//! 5. the faults removed and the agent restarted: the quarantined devices stay out of service,
//!    the recovered one stays in, and the control plane lists why (`quarantined: …`);
//! 6. `suanli node clear-quarantine` on the fatal device: the agent resets and checks it, and it
//!    is back in service (gone from `quarantine.json`); the other stays quarantined; an unknown
//!    device is refused, naming it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_tests as support;
use support::{CkptCluster, NodeSpec, Trainer, attempts, wait_nodes};

/// The device's health on node `n1` ("healthy" | "unhealthy"), if it is listed.
fn health(n: &[pb::NodeInfo], device: &str) -> Option<String> {
    n.iter().find(|x| x.id == "n1")?.devices.iter().find(|d| d.id == device).map(|d| d.health.clone())
}

/// The running allocation of job `j` (one replica).
fn running(j: &pb::JobInfo) -> Option<&pb::AllocInfo> {
    j.allocs.iter().find(|a| a.state == "running")
}

fn xid(device: &str, code: u64, class: &str) -> String {
    format!("{{ device = \"{device}\", code = {code}, class = \"{class}\" }}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_device_error_class_ends_as_the_table_says() {
    let mut c = CkptCluster::start(&[NodeSpec::new("n1", "p", 3)]).await;
    let addr = c.addr.clone();
    let t = Trainer::new("t");
    let tid = c.submit(&t).await;
    let j = c.wait_job(tid, Duration::from_secs(30), "the trainer runs", |j| j.state == "running").await;
    c.wait_job(tid, Duration::from_secs(30), "a first checkpoint", |j| j.latest_checkpoint_step > 0).await;
    let a = running(&j).unwrap().clone();
    let dev = a.devices[0].device.clone();
    let data = c.agent("n1").data_dir();

    // 1. An application error: the device stays, the task is told, nothing restarts.
    let app = xid(&dev, 13, "application");
    c.agent("n1").set_faults(&format!("xid = [{app}]\n"));
    let events: PathBuf = data.join("allocs").join(format!("{}-{}", a.id, a.epoch)).join("device-events");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let told = loop {
        let text = std::fs::read_to_string(&events).unwrap_or_default();
        if text.contains("\"code\":13") {
            break text;
        }
        assert!(std::time::Instant::now() < deadline, "the task was not told of the application error\n{}", c.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let line: serde_json::Value = serde_json::from_str(told.lines().next().unwrap()).unwrap();
    assert_eq!((line["device"].as_str(), line["class"].as_str()), (Some(dev.as_str()), Some("application")));
    let n = support::nodes(&addr).await;
    assert_eq!(health(&n, &dev).as_deref(), Some("healthy"), "an application error leaves the device in service");
    let j = support::job(&addr, tid).await;
    assert_eq!((j.state.as_str(), j.attempt), ("running", a.epoch), "the trainer kept running: {j:#?}");

    // 2. A recoverable error on the trainer's GPU: out of service, the trainer checkpoints and
    //    moves, the device is reset and comes back while the fault is still listed.
    let rec = xid(&dev, 79, "recoverable");
    c.agent("n1").set_faults(&format!("xid = [{app}, {rec}]\n"));
    wait_nodes(&addr, Duration::from_secs(20), "the device out of service", |n| {
        health(n, &dev).as_deref() == Some("unhealthy")
    })
    .await;
    let r = c
        .wait_job(tid, Duration::from_secs(60), "the trainer resumes", |j| j.state == "running" && j.attempt > a.epoch)
        .await;
    let first = r.attempts.iter().find(|x| x.attempt == a.epoch).map(|x| x.message.clone()).unwrap_or_default();
    assert!(
        first.contains("device_unhealthy") && first.contains("checkpoint at step"),
        "the first attempt stopped for the device, checkpointing first: {first:?}; {r:#?}"
    );
    let attempt = r.attempt;
    let lines = c
        .wait_journal("t", Duration::from_secs(20), "the resumed trainer steps", |l| {
            l.iter().any(|x| x.job == tid && x.attempt == attempt && x.event == "step")
        })
        .await;
    let runs = attempts(&lines, tid);
    let (old, new) = (&runs[0], runs.last().unwrap());
    assert!(new.restored, "the new attempt restored from a checkpoint: {runs:#?}");
    let lost = old.max_step.saturating_sub(new.start_step);
    assert!(lost <= t.every, "{lost} steps lost, more than one checkpoint interval ({})", t.every);
    wait_nodes(&addr, Duration::from_secs(30), "the device back after its reset", |n| {
        health(n, &dev).as_deref() == Some("healthy")
    })
    .await;
    assert!(c.agent("n1").log().contains("device recovered"), "{}", c.logs());

    // 3. A fatal error on an idle GPU: quarantined.
    let now = support::job(&addr, tid).await;
    let used = running(&now).map(|a| a.devices[0].device.clone()).unwrap_or_default();
    let idle: Vec<String> = ["gpu0", "gpu1", "gpu2"].iter().map(|s| s.to_string()).filter(|d| *d != used).collect();
    let (fatal_dev, flaky_dev) = (idle[0].clone(), idle[1].clone());
    let fatal = xid(&fatal_dev, 64, "fatal");
    c.agent("n1").set_faults(&format!("xid = [{app}, {rec}, {fatal}]\n"));
    wait_nodes(&addr, Duration::from_secs(20), "the fatal device out of service", |n| {
        health(n, &fatal_dev).as_deref() == Some("unhealthy")
    })
    .await;
    let q = std::fs::read_to_string(data.join("quarantine.json")).unwrap();
    assert!(q.contains(&format!("\"{fatal_dev}\"")), "{q}");

    // 4. A recoverable error whose resets fail: quarantined after three.
    let flaky = xid(&flaky_dev, 48, "recoverable");
    c.agent("n1").set_faults(&format!("xid = [{app}, {rec}, {fatal}, {flaky}]\nreset_fails = [\"{flaky_dev}\"]\n"));
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let q = std::fs::read_to_string(data.join("quarantine.json")).unwrap_or_default();
        if q.contains(&format!("\"{flaky_dev}\"")) {
            assert!(q.contains("3 resets did not bring it back"), "{q}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the flaky device was not quarantined: {q}\n{}", c.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let n = support::nodes(&addr).await;
    assert_eq!(health(&n, &flaky_dev).as_deref(), Some("unhealthy"));

    // 5. Every fault removed, the agent restarted: the quarantine holds, the rest is in service.
    c.agent("n1").clear_faults();
    c.agent("n1").kill();
    c.agent("n1").start();
    let n = wait_nodes(&addr, Duration::from_secs(30), "the restarted agent reports its devices", |n| {
        n.iter().any(|x| x.id == "n1" && x.status == "ready") && health(n, &used).as_deref() == Some("healthy")
    })
    .await;
    for d in [&fatal_dev, &flaky_dev] {
        assert_eq!(health(&n, d).as_deref(), Some("unhealthy"), "{d} left its quarantine on restart: {n:#?}");
    }

    // The control plane knows why (the restarted agent's first heartbeat says it again).
    let reason = |n: &[pb::NodeInfo], device: &str| {
        n.iter().find(|x| x.id == "n1")?.devices.iter().find(|d| d.id == device).map(|d| d.health_reason.clone())
    };
    wait_nodes(&addr, Duration::from_secs(20), "the quarantine's reason in the node's devices", |n| {
        reason(n, &fatal_dev).is_some_and(|r| r.starts_with("quarantined:"))
            && reason(n, &flaky_dev).is_some_and(|r| r.starts_with("quarantined:"))
    })
    .await;

    // 6. An operator clears the fatal device's quarantine: reset, checked, back in service.
    let cli =
        |args: &[&str]| support::cli().args(args).args(["--server", &addr]).env_remove("SUANLI_ADDR").output().unwrap();
    let o = cli(&["node", "clear-quarantine", "n1", &fatal_dev]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("quarantine cleared"), "{o:?}");
    let n = wait_nodes(&addr, Duration::from_secs(30), "the cleared device back in service", |n| {
        health(n, &fatal_dev).as_deref() == Some("healthy")
    })
    .await;
    assert_eq!(health(&n, &flaky_dev).as_deref(), Some("unhealthy"), "only the cleared device left quarantine");
    assert_eq!(reason(&n, &fatal_dev).as_deref(), Some(""), "a healthy device has no reason");
    let q = std::fs::read_to_string(data.join("quarantine.json")).unwrap();
    assert!(!q.contains(&format!("\"{fatal_dev}\"")) && q.contains(&format!("\"{flaky_dev}\"")), "{q}");
    let o = cli(&["node", "clear-quarantine", "n1", "gpu99"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("gpu99"), "{err}");
    eprintln!(
        "remediation: application told, recoverable reset and back, fatal and failing-reset quarantined, cleared by an operator"
    );
}
