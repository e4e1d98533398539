//! Device plugins that misbehave must not take the agent down. For each fault the fake plugin
//! injects (a panic inside a call, a call that hangs past its deadline, a segfault that kills
//! the plugin host): the agent process stays up, the node's devices turn unhealthy at the
//! control plane, the job running on them is stopped and rescheduled on the other agent's
//! healthy devices; once the fault is gone the devices are healthy again.
//!
//! An agent frozen (SIGSTOP) while its task runs: the task's shim kills it once the lease
//! expires, before the control plane could declare the node down, and the agent, once
//! resumed, reports the allocation FAILED `fenced: ...`.

#![allow(clippy::unwrap_used)]

use suanli_tests as support;

use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::nodes_client::NodesClient;
use support::{
    AgentProc, channel, cluster, cluster_with, fake_config, job, read_lines, ready_healthy, record_job, submit,
    wait_nodes,
};

async fn set_mode(addr: &str, id: &str, mode: pb::NodeMode) {
    NodesClient::new(channel(addr).await.unwrap())
        .set_mode(pb::SetNodeModeRequest { id: id.into(), mode: mode as i32, ..Default::default() })
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_agent_has_its_tasks_fenced() {
    use suanli_agent::sys::{boottime_ms, now_ms, proc_stat};
    const TTL_MS: u64 = 4_000;
    const F_MS: u64 = 1_000;
    const G_MS: u64 = 500;
    let cfg_dir = tempfile::tempdir().unwrap();
    let server_cfg = cfg_dir.path().join("server.toml");
    std::fs::write(&server_cfg, format!("heartbeat_interval_ms = 200\nheartbeat_ttl_ms = {TTL_MS}\n")).unwrap();
    let (c, addr) = cluster_with(1, &["--config", server_cfg.to_str().unwrap()]).await;
    let fence = format!("fence_after_ms = {F_MS}\nfence_kill_grace_ms = {G_MS}\n");
    let mut a = AgentProc::new("node-a", std::slice::from_ref(&addr), &fake_config(2, 0, 0), &fence);
    a.start();
    wait_nodes(&addr, Duration::from_secs(30), "the agent registered", |n| ready_healthy(n, "node-a", 2)).await;
    let spec = serde_json::json!({"name": "long", "queue": "default", "groups": [{"name": "main", "replicas": 1,
        "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": 1000}},
        "task": {"command": "/bin/sh", "args": ["-c", "sleep 600"]}}]});
    let req = pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: "long".into(),
        spec_json: spec.to_string(),
        retry: Some(pb::RetryPolicy { max_attempts: 1, backoff_base_s: 0, backoff_max_s: 0 }),
    };
    let id = JobsClient::new(channel(&addr).await.unwrap()).submit(req).await.unwrap().into_inner().job_id;
    let deadline = Instant::now() + Duration::from_secs(20);
    let start = loop {
        if let Some(e) = a.journal().into_iter().find(|e| e.job_id == id && e.is_start()) {
            break e;
        }
        assert!(Instant::now() < deadline, "job {id} never started:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Freeze the agent; once it is stopped its lease no longer changes.
    a.signal("STOP");
    let deadline = Instant::now() + Duration::from_secs(5);
    while proc_stat(a.pid()).is_none_or(|(_, s)| s != 'T') {
        assert!(Instant::now() < deadline, "the agent did not stop");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let lease = a.lease().expect("a lease");
    assert_eq!((lease.fence_after_ms, lease.kill_grace_ms), (F_MS, G_MS));
    let lease_wall_ms = now_ms() - (boottime_ms() - lease.sent_boottime_ms);
    let deadline = Instant::now() + Duration::from_secs(15);
    let stop = loop {
        if let Some(e) = a.journal().into_iter().find(|e| e.alloc_id == start.alloc_id && !e.is_start()) {
            break e;
        }
        assert!(Instant::now() < deadline, "the task was not fenced:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    a.signal("CONT");
    let after = stop.at_ms.saturating_sub(lease_wall_ms);
    eprintln!("fenced {after} ms after the lease was sent (F {F_MS}, F + G {}, TTL {TTL_MS})", F_MS + G_MS);
    assert!(stop.fenced(), "{stop:?}");
    assert!(stop.at_ms + 50 >= lease_wall_ms + F_MS, "fenced before the lease expired: {after} ms");
    assert!(stop.at_ms < lease_wall_ms + TTL_MS, "the task outlived the TTL: {after} ms");
    // The shim journals the stop first, then writes exit.json.
    let dir = a.data_dir().join("allocs").join(format!("{}-{}", start.alloc_id, start.epoch));
    let deadline = Instant::now() + Duration::from_secs(5);
    let exit: suanli_agent::ExitRecord = loop {
        if let Some(e) = std::fs::read(dir.join("exit.json")).ok().and_then(|b| serde_json::from_slice(&b).ok()) {
            break e;
        }
        assert!(Instant::now() < deadline, "no exit.json after the journaled stop:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(exit.fenced, "{exit:?}");
    // Back, the agent reports the fence as end `node_lost`: an infrastructure end, so the job
    // (no retries left for failures of its own) is requeued rather than failed.
    let deadline = Instant::now() + Duration::from_secs(20);
    let j = loop {
        let j = job(&addr, id).await;
        if j.attempts.iter().any(|h| h.alloc_id == start.alloc_id) {
            break j;
        }
        assert!(Instant::now() < deadline, "the fenced attempt never ended: {j:#?}\n--- agent:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let h = j.attempts.iter().find(|h| h.alloc_id == start.alloc_id).unwrap();
    assert_eq!(
        (h.state.as_str(), h.end.as_str(), j.failures, j.infra_requeues),
        ("failed", "node_lost", 0, 1),
        "{j:#?}\n--- agent:\n{}\n--- server:\n{}",
        a.log(),
        c.log(0)
    );
    assert!(h.message.contains("fenced"), "{}", h.message);
    let lines: Vec<_> = a.journal().into_iter().filter(|e| e.alloc_id == start.alloc_id).collect();
    assert_eq!(lines.len(), 2, "one start and one stop of the fenced allocation: {lines:#?}");
    assert!(a.alive());
}
