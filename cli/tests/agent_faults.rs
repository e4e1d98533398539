//! Device plugins that misbehave must not take the agent down. For each fault the fake plugin
//! injects (a panic inside a call, a call that hangs past its deadline, a segfault that kills
//! the plugin host): the agent process stays up, the node's devices turn unhealthy at the
//! control plane, the job running on them is stopped and rescheduled on the other agent's
//! healthy devices; once the fault is gone the devices are healthy again.

#![allow(clippy::unwrap_used)]

#[path = "../../agent/e2e-support/mod.rs"]
mod support;

use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::nodes_client::NodesClient;
use support::{AgentProc, channel, cluster, fake_config, read_lines, ready_healthy, record_job, submit, wait_nodes};

async fn set_mode(addr: &str, id: &str, mode: pb::NodeMode) {
    NodesClient::new(channel(addr).await.unwrap())
        .set_mode(pb::SetNodeModeRequest { id: id.into(), mode: mode as i32 })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plugins_that_panic_hang_and_segfault() {
    let (c, addr) = cluster(1).await;
    // Short plugin deadlines, fast health polling and restarts: the whole test stays small.
    let quick = "plugin_call_timeout_ms = 400\nplugin_fingerprint_timeout_ms = 1000\nplugin_backoff_min_ms = 100\n\
                 plugin_backoff_max_ms = 400\nhealth_poll_interval_ms = 100\n";
    let mut a = AgentProc::new("node-a", std::slice::from_ref(&addr), &fake_config(2, 0, 0), quick);
    let mut b = AgentProc::new("node-b", std::slice::from_ref(&addr), &fake_config(2, 0, 0), quick);
    a.start();
    b.start();
    wait_nodes(&addr, Duration::from_secs(30), "both agents registered", |n| {
        ready_healthy(n, "node-a", 2) && ready_healthy(n, "node-b", 2)
    })
    .await;
    let rec_dir = tempfile::tempdir().unwrap();
    let rec = rec_dir.path().join("record.txt");
    for (k, crash) in ["panic", "hang", "segfault"].into_iter().enumerate() {
        let t0 = Instant::now();
        // The job lands on node-a: node-b is cordoned while it is placed.
        set_mode(&addr, "node-b", pb::NodeMode::Cordoned).await;
        let spec = record_job(&format!("victim-{crash}"), &rec, 60.0, 1, false, Some(("gpu", 1, 1000)));
        let id = submit(&addr, &format!("victim-{crash}"), &spec).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !read_lines(&rec).iter().any(|l| l.start && l.job == id && l.node == "node-a") {
            assert!(Instant::now() < deadline, "{crash}: job {id} never started on node-a:\n{}", a.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        set_mode(&addr, "node-b", pb::NodeMode::Schedulable).await;
        a.set_faults(&format!("crash = \"{crash}\"\ncrash_on = \"any\"\n"));
        // The devices turn unhealthy at the control plane, naming the plugin.
        wait_nodes(&addr, Duration::from_secs(20), &format!("{crash}: node-a's devices unhealthy"), |n| {
            n.iter()
                .any(|x| x.id == "node-a" && !x.devices.is_empty() && x.devices.iter().all(|d| d.health == "unhealthy"))
        })
        .await;
        // The job is stopped on node-a and runs again on node-b.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !read_lines(&rec).iter().any(|l| l.start && l.job == id && l.node == "node-b") {
            assert!(
                Instant::now() < deadline,
                "{crash}: job {id} was not rescheduled onto node-b\n--- node-a:\n{}\n--- node-b:\n{}\n--- server:\n{}",
                a.log(),
                b.log(),
                c.log(0)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let moved = read_lines(&rec).iter().filter(|l| l.start && l.job == id).map(|l| l.attempt).collect::<Vec<_>>();
        assert_eq!(moved.len(), 2, "{crash}: job {id} ran {moved:?}");
        assert!(moved[1] > moved[0], "{crash}: the second run is a new attempt: {moved:?}");
        assert!(a.alive(), "{crash}: the agent died:\n{}", a.log());
        // The fault goes away: the plugin host restarts and the devices are healthy again.
        a.clear_faults();
        wait_nodes(&addr, Duration::from_secs(20), &format!("{crash}: node-a healthy again"), |n| {
            ready_healthy(n, "node-a", 2)
        })
        .await;
        assert!(a.alive(), "{crash}: the agent died:\n{}", a.log());
        JobsClient::new(channel(&addr).await.unwrap())
            .cancel(pb::CancelJobRequest { job_id: id, reason: "test done".into() })
            .await
            .unwrap();
        eprintln!("{crash}: {} ms (round {k})", t0.elapsed().as_millis());
    }
    let log = a.log();
    assert!(log.contains("device plugin down"), "{log}");
    drop((a, b));
}
