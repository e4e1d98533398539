//! Services end to end (docs/services.md), with real processes: one `suanli server`, two
//! `suanli agent`s, and a service of 3 replicas, each a Python HTTP server on the port its
//! agent picked (`SUANLI_PORT`) with an HTTP readiness check.
//!
//! - All 3 replicas become ready, and `suanli service endpoints` lists exactly their
//!   `host:port`s, each of which answers HTTP.
//! - A replica's process is killed: that replica alone is replaced (after the restart
//!   backoff), the other two keep their allocations, and the endpoints follow.
//! - A rolling update (`suanli service update web FILE`, a new environment): the replicas are
//!   replaced one at a time by the new version (max_surge 1, max_unavailable 0); sampled
//!   throughout, never fewer than 3 are ready, and the endpoints follow.
//! - An agent is SIGKILLed: once its node is declared down, its replicas are replaced on the
//!   other node, the replicas there keep running, and the endpoints follow again.

#![allow(clippy::unwrap_used)]

use suanli_tests as support;

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use support::{cluster, fake_config, job, start_agents, submit, wait_job};

fn service_spec() -> serde_json::Value {
    serde_json::json!({
        "name": "web",
        "queue": "default",
        "kind": "inference",
        "groups": [{
            "name": "server",
            "replicas": 3,
            "resources": {"cpu_milli": 500, "memory_mib": 64},
            "task": {
                "command": "/bin/sh",
                "args": ["-c", "echo $$ > \"$SUANLI_ALLOC_DIR/pid\"; exec python3 -m http.server \"$SUANLI_PORT\" --bind 127.0.0.1"],
            },
        }],
        "service": {
            "readiness": {"kind": "http", "path": "/", "period_ms": 200, "timeout_ms": 1000},
            "restart_backoff_s": 1,
        },
    })
}

/// `suanli service endpoints web`, one endpoint a line.
fn endpoints(addr: &str) -> BTreeSet<String> {
    let o = support::cli().args(["service", "endpoints", "web", "--server", addr]).output().unwrap();
    assert!(o.status.success(), "service endpoints: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect()
}

/// Ready replicas of the job as (alloc id, node, endpoint).
fn ready(j: &pb::JobInfo) -> BTreeSet<(u64, String, String)> {
    j.allocs
        .iter()
        .filter(|a| a.state == "running" && a.ready)
        .map(|a| (a.id, a.node.clone(), a.endpoint.clone()))
        .collect()
}

/// GET / from `endpoint` answers 200.
fn answers(endpoint: &str) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(endpoint) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n").is_err() {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.0 200") || buf.starts_with("HTTP/1.1 200")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_stays_at_three_ready_through_a_crash_and_an_agent_kill() {
    let (c, addr) = cluster(1).await;
    let mut agents = start_agents(&addr, &["node-a", "node-b"], &fake_config(1, 0, 0)).await;
    let id = submit(&addr, "web", &service_spec()).await;
    let three = |j: &pb::JobInfo| ready(j).len() == 3;
    let j = wait_job(&addr, id, Duration::from_secs(40), "3 ready replicas", three).await;
    assert!(j.service && j.state == "running", "{j:?}");
    let first = ready(&j);
    let eps: BTreeSet<String> = first.iter().map(|x| x.2.clone()).collect();
    assert_eq!(endpoints(&addr), eps);
    for e in &eps {
        assert!(answers(e), "{e} does not answer");
    }

    // A replica's process dies: that replica alone is replaced.
    let (victim, _, victim_ep) = first.iter().next().cloned().unwrap();
    let pid_file = agents
        .iter()
        .flat_map(|a| std::fs::read_dir(a.data_dir().join("allocs")).unwrap().filter_map(Result::ok))
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{victim}-"))))
        .map(|p| p.join("pid"))
        .unwrap();
    let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    assert!(std::process::Command::new("kill").arg("-KILL").arg(pid.to_string()).status().unwrap().success());
    let j = wait_job(&addr, id, Duration::from_secs(40), "the crashed replica replaced and ready", |j| {
        three(j) && !ready(j).iter().any(|x| x.0 == victim)
    })
    .await;
    assert!(j.restarts >= 1, "{j:?}");
    let second = ready(&j);
    for kept in first.iter().filter(|x| x.0 != victim) {
        assert!(second.contains(kept), "replica {kept:?} was restarted too: {second:?}");
    }
    let ended = j.attempts.iter().find(|a| a.alloc_id == victim).expect("the crashed replica in the history");
    assert!(ended.message.contains("signal 9"), "{ended:?}");
    let eps: BTreeSet<String> = second.iter().map(|x| x.2.clone()).collect();
    assert_eq!(endpoints(&addr), eps);
    assert!(!eps.contains(&victim_ep) || answers(&victim_ep));

    // A rolling update to a new environment: one replica at a time, never fewer than 3 ready.
    let restarts_before = j.restarts;
    let mut v1 = service_spec();
    v1["groups"][0]["task"]["env"] = serde_json::json!({"WEB_VERSION": "1"});
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("web-v1.json");
    std::fs::write(&file, v1.to_string()).unwrap();
    let o = support::cli().args(["service", "update", "web"]).arg(&file).args(["--server", &addr]).output().unwrap();
    assert!(o.status.success(), "service update: {}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("version 1"), "{}", String::from_utf8_lossy(&o.stdout));
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut fewest, mut most_live) = (usize::MAX, 0);
    let j = loop {
        let j = job(&addr, id).await;
        fewest = fewest.min(ready(&j).len());
        most_live = most_live.max(j.allocs.iter().filter(|a| a.state == "pending" || a.state == "running").count());
        let updated = j.allocs.iter().filter(|a| a.state == "running" && a.ready && a.version == 1).count();
        if updated == 3 && j.allocs.iter().all(|a| a.version == 1) {
            break j;
        }
        assert!(Instant::now() < deadline, "the rolling update did not finish: {j:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(j.version, 1);
    assert!(fewest >= 3, "only {fewest} replicas were ready at one point of the update");
    assert!(most_live <= 4, "{most_live} replicas ran at once (3 + max_surge 1 at most)");
    assert_eq!(j.restarts, restarts_before, "replicas replaced by the update are not restarts: {j:?}");
    let second = ready(&j);
    let eps: BTreeSet<String> = second.iter().map(|x| x.2.clone()).collect();
    assert_eq!(endpoints(&addr), eps);
    for e in &eps {
        assert!(answers(e), "{e} does not answer");
    }

    // An agent dies: its replicas move to the other node once it is declared down.
    let (gone, stays) =
        if second.iter().filter(|x| x.1 == "node-a").count() > 0 { (0, "node-b") } else { (1, "node-a") };
    let on_stays: BTreeSet<(u64, String, String)> = second.iter().filter(|x| x.1 == stays).cloned().collect();
    agents[gone].kill();
    let j = wait_job(&addr, id, Duration::from_secs(60), "3 ready replicas on the surviving node", |j| {
        three(j) && ready(j).iter().all(|x| x.1 == stays)
    })
    .await;
    let third = ready(&j);
    for kept in &on_stays {
        assert!(third.contains(kept), "replica {kept:?} on the surviving node was restarted: {third:?}");
    }
    let eps: BTreeSet<String> = third.iter().map(|x| x.2.clone()).collect();
    assert_eq!(endpoints(&addr), eps);
    for e in &eps {
        assert!(answers(e), "{e} does not answer");
    }
    let o = support::cli().args(["service", "status", "web", "--server", &addr]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("3 wanted, 3 running, 3 ready"), "{text}\n{}", String::from_utf8_lossy(&o.stderr));
    drop(agents);
    drop(c);
}
