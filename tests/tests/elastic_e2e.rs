//! Elastic training end to end (issue 22, "What it must show" 3; docs/job-spec.md, "Elastic
//! jobs"), with real processes: one `suanli server`, two `suanli agent`s of two fake GPUs
//! each, and `examples/trainer/trainer.py` as the elastic trainer (3 replicas wanted, at
//! least 1), which journals its world size at start and each new membership generation it
//! reads in `$SUANLI_WORLD_FILE`.
//!
//! - A sleeper of priority 5 holds 2 GPUs and a low-priority batch job 1: the trainer starts
//!   with its minimum of 1 replica (world size 1).
//! - The sleeper is cancelled: the trainer grows to 3 replicas into the freed GPUs; the new
//!   replicas start with world size 3 and the first one reads the new generation.
//! - A priority-10 job needs 3 GPUs: the trainer's two newest replicas checkpoint first and
//!   stop, the low-priority job gives way for the third GPU, and the trainer keeps running
//!   with its first replica (never below its minimum while lower-priority work could go),
//!   which reads world size 1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_tests as support;
use support::{CkptCluster, NodeSpec, Trainer, channel};

/// The journal's lines as JSON (the "world" events carry fields the shared parser drops).
fn lines(c: &CkptCluster, name: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(c.journal_path(name))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn of(lines: &[serde_json::Value], alloc: u64, event: &str) -> Vec<serde_json::Value> {
    lines
        .iter()
        .filter(|l| l["alloc"].as_str() == Some(alloc.to_string().as_str()) && l["event"] == event)
        .cloned()
        .collect()
}

async fn wait_lines(
    c: &CkptCluster,
    name: &str,
    what: &str,
    f: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let l = lines(c, name);
        if f(&l) {
            return l;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: not within 60 s; journal: {l:#?}\n{}", c.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn running(j: &pb::JobInfo) -> Vec<&pb::AllocInfo> {
    j.allocs.iter().filter(|a| a.state == "running" && a.desired == "run").collect()
}

fn gpu_batch(name: &str, replicas: u32, priority: i64, preemptible: bool) -> serde_json::Value {
    serde_json::json!({
        "name": name, "queue": "default", "priority": priority, "preemptible": preemptible, "gang": true,
        "groups": [{"name": "main", "replicas": replicas,
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": 1000}},
            "task": {"command": "/bin/sh", "args": ["-c", "exec sleep 600"]}}]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_elastic_trainer_grows_into_freed_gpus_and_shrinks_checkpoint_first() {
    let c = CkptCluster::start(&[NodeSpec::new("n1", "p", 2), NodeSpec::new("n2", "p", 2)]).await;
    let sleeper = support::submit(&c.addr, "sleeper", &support::sleeper("sleeper", 2, 5)).await;
    let low = support::submit(&c.addr, "low", &gpu_batch("low", 1, 0, true)).await;
    for id in [sleeper, low] {
        c.wait_job(id, Duration::from_secs(30), "the fillers run", |j| j.state == "running").await;
    }

    let t = Trainer { steps: 100_000, step_s: 0.1, every: 0, grace_s: 20, priority: 5, ..Trainer::new("elastic") };
    let mut spec = t.spec(&c.journal_path("elastic"));
    spec["gang"] = serde_json::json!(false);
    spec["groups"][0]["replicas"] = serde_json::json!(3);
    spec["groups"][0]["min_replicas"] = serde_json::json!(1);
    let e = support::submit(&c.addr, "elastic", &spec).await;
    let j = c.wait_job(e, Duration::from_secs(30), "the minimum runs", |j| running(j).len() == 1).await;
    let first = running(&j)[0].id;
    assert_eq!(running(&j)[0].world_size, 1);
    wait_lines(&c, "elastic", "the first replica started with world size 1", |l| {
        of(l, first, "start").first().is_some_and(|s| s["world_size"] == 1)
    })
    .await;

    // The sleeper ends: the trainer grows into its two GPUs.
    let mut jobs = JobsClient::new(channel(&c.addr).await.unwrap());
    jobs.cancel(pb::CancelJobRequest { job_id: sleeper, reason: "done".into() }).await.unwrap();
    let j = c.wait_job(e, Duration::from_secs(30), "grown to 3 replicas", |j| running(j).len() == 3).await;
    assert_eq!(j.attempt, 1, "growing is not a new attempt");
    let grown: Vec<u64> = running(&j).iter().map(|a| a.id).filter(|&a| a != first).collect();
    assert!(running(&j).iter().all(|a| a.world_size == 3), "{j:#?}");
    let l = wait_lines(&c, "elastic", "every replica knows world size 3", |l| {
        of(l, first, "world").iter().any(|w| w["world_size"] == 3)
            && grown.iter().all(|&a| of(l, a, "start").first().is_some_and(|s| s["world_size"] == 3))
    })
    .await;
    eprintln!("grown: {:?}", of(&l, first, "world"));

    // A priority-10 job needs 3 GPUs: the two newest replicas (checkpoint first) and the
    // low-priority job give way; the first replica keeps the trainer at its minimum.
    let high = support::submit(&c.addr, "high", &gpu_batch("high", 3, 10, false)).await;
    c.wait_job(high, Duration::from_secs(60), "the priority-10 job runs", |j| j.state == "running").await;
    let j = support::job(&c.addr, e).await;
    assert_eq!(j.state, "running", "{j:#?}");
    assert_eq!(running(&j).iter().map(|a| a.id).collect::<Vec<_>>(), [first], "{j:#?}");
    assert_eq!(j.attempt, 1, "a shrink is not a new attempt");
    assert!(j.reason.contains("shrank to 1 replicas") || j.reason.starts_with("1 of 3 replicas run"), "{}", j.reason);
    let lj = support::job(&c.addr, low).await;
    assert_ne!(lj.state, "running", "the low-priority job gave way: {lj:#?}");
    let l = wait_lines(&c, "elastic", "the shrunk replicas checkpointed and the first one knows world size 1", |l| {
        grown.iter().all(|&a| !of(l, a, "checkpoint").is_empty() && !of(l, a, "exit").is_empty())
            && of(l, first, "world").last().is_some_and(|w| w["world_size"] == 1)
    })
    .await;
    for a in &grown {
        let ck = of(&l, *a, "checkpoint");
        let ex = of(&l, *a, "exit");
        assert_eq!(ex.last().unwrap()["code"], 143, "{ex:?}");
        assert!(ck.last().unwrap()["t"].as_f64() <= ex.last().unwrap()["t"].as_f64(), "checkpoint before the exit");
    }
    assert!(of(&l, first, "exit").is_empty(), "the first replica never stopped");
    let h = support::job(&c.addr, high).await;
    let ends: Vec<&str> = j.attempts.iter().map(|a| a.end.as_str()).collect();
    assert_eq!(ends, ["preempted", "preempted"], "only the two shrunk replicas ended: {j:#?}");
    eprintln!("trainer reason {:?}; attempts ended {ends:?}; high on {:?}", j.reason, support::nodes_of(&h));
}
