//! Autoscaling end to end (docs/services.md, "Autoscaling"), with real processes: one
//! `suanli server`, two `suanli agent`s of one (fake) GPU each, a low-priority batch job on
//! one GPU, and a service of one replica on the other whose replicas report their load in
//! `$SUANLI_ALLOC_DIR/load` (each a Python HTTP server with an HTTP readiness check).
//!
//! - The load rises above the target: the leader's autoscaler scales the service out to its
//!   maximum of 2, the batch job is preempted for the second replica's GPU, and both
//!   replicas become ready; the scale-out time is exported in `/metrics`.
//! - The load falls: after the scale-down window the service is back at one replica, and the
//!   batch job runs again on the freed GPU.

#![allow(clippy::unwrap_used)]

use suanli_tests as support;

use std::path::PathBuf;
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use support::{AgentProc, LocalPki, cluster, fake_config, job, start_agents, submit, wait_job};

fn batch_spec() -> serde_json::Value {
    serde_json::json!({
        "name": "fill",
        "queue": "default",
        "kind": "batch",
        "priority": 0,
        "preemptible": true,
        "groups": [{
            "name": "w",
            "replicas": 1,
            "resources": {"cpu_milli": 100, "memory_mib": 16, "devices": {"kind": "gpu", "count": 1}},
            "task": {"command": "/bin/sh", "args": ["-c", "exec sleep 600"]},
        }],
    })
}

fn service_spec() -> serde_json::Value {
    serde_json::json!({
        "name": "api",
        "queue": "default",
        "kind": "inference",
        "priority": 10,
        "preemptible": false,
        "groups": [{
            "name": "server",
            "replicas": 1,
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1}},
            "task": {
                "command": "/bin/sh",
                "args": ["-c", "echo 1 > \"$SUANLI_ALLOC_DIR/load\"; exec python3 -m http.server \"$SUANLI_PORT\" --bind 127.0.0.1"],
            },
        }],
        "service": {
            "readiness": {"kind": "http", "path": "/", "period_ms": 200, "timeout_ms": 1000},
            "autoscale": {
                "min_replicas": 1, "max_replicas": 2, "target": 10, "period_s": 1,
                "scale_up_window_s": 0, "scale_down_window_s": 3,
            },
        },
    })
}

/// Running replicas that pass their readiness check.
fn ready(j: &pb::JobInfo) -> usize {
    j.allocs.iter().filter(|a| a.state == "running" && a.ready).count()
}

/// The allocation directory of `alloc` on any of the agents.
fn alloc_dir(agents: &[AgentProc], alloc: u64) -> PathBuf {
    agents
        .iter()
        .flat_map(|a| std::fs::read_dir(a.data_dir().join("allocs")).unwrap().filter_map(Result::ok))
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{alloc}-"))))
        .unwrap_or_else(|| panic!("no directory for allocation {alloc}"))
}

fn set_load(agents: &[AgentProc], j: &pb::JobInfo, load: &str) {
    for a in j.allocs.iter().filter(|a| a.state == "running") {
        std::fs::write(alloc_dir(agents, a.id).join("load"), load).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_scales_out_over_batch_work_and_gives_the_gpu_back() {
    let (c, addr) = cluster(1).await;
    let agents = start_agents(&addr, &["node-a", "node-b"], &fake_config(1, 0, 0)).await;
    let batch = submit(&addr, "fill", &batch_spec()).await;
    wait_job(&addr, batch, Duration::from_secs(30), "the batch job running", |j| j.state == "running").await;
    let svc = submit(&addr, "api", &service_spec()).await;
    let j = wait_job(&addr, svc, Duration::from_secs(30), "one ready replica", |j| ready(j) == 1).await;

    // Load 50 against a target of 10: the autoscaler wants 5, bounded by max_replicas = 2.
    let t0 = Instant::now();
    set_load(&agents, &j, "50");
    let j = wait_job(&addr, svc, Duration::from_secs(60), "scaled out to 2 ready replicas", |j| ready(j) == 2).await;
    let scale_out = t0.elapsed();
    assert!(j.reason.contains("scaled to 2") || j.reason.is_empty(), "{}", j.reason);
    let b = job(&addr, batch).await;
    assert!(
        b.attempts.iter().any(|a| a.message.contains("preempted") || a.end == "preempted"),
        "the batch job was not preempted for the second replica: {b:?}"
    );
    assert_ne!(b.state, "running", "{b:?}");

    // The scale-out time, from the replicated state, in /metrics.
    let tls = LocalPki::get().admin_tls();
    let m = support::http::Http::with(&c.http_addrs[0], &tls).get("/metrics", None).await;
    assert_eq!(m.status, 200, "{}", m.body);
    let count = m
        .body
        .lines()
        .find(|l| l.starts_with("suanli_inference_scale_out_seconds_count{queue=\"default\"}"))
        .unwrap_or_else(|| panic!("no scale-out series: {}", m.body));
    assert!(count.ends_with(" 1"), "{count}");
    assert!(m.body.contains("suanli_inference_load{queue=\"default\",service=\"api\"}"), "{}", m.body);

    // The load falls: back to one replica after the 3 s window; the batch job runs again.
    set_load(&agents, &j, "1");
    let t1 = Instant::now();
    let j = wait_job(&addr, svc, Duration::from_secs(60), "scaled in to 1 replica", |j| {
        ready(j) == 1 && j.allocs.iter().filter(|a| a.state == "running" || a.state == "pending").count() == 1
    })
    .await;
    let scale_in = t1.elapsed();
    assert!(scale_in >= Duration::from_secs(3), "scaled in after {scale_in:?}, inside the 3 s window");
    wait_job(&addr, batch, Duration::from_secs(60), "the batch job back on the freed GPU", |b| b.state == "running")
        .await;
    eprintln!("scale-out (load written to 2 ready) {scale_out:?}; scale-in {scale_in:?}; restarts {}", j.restarts);
    drop(agents);
    drop(c);
}
