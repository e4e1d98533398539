//! Operator commands against real processes with a real agent: `job status` shows the
//! attempt history after failed attempts, `job logs` reads across the rotated log file, and
//! `node drain --wait` moves work off a node and reports when it is empty.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use suanli_tests as support;

use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use support::*;

fn suanli(addr: &str, args: &[&str]) -> std::process::Output {
    suanli_tests::cli().args(args).args(["--server", addr]).env_remove("SUANLI_ADDR").output().unwrap()
}

fn ok(addr: &str, args: &[&str]) -> String {
    let o = suanli(addr, args);
    assert!(
        o.status.success(),
        "suanli {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A task printing 1,000 numbered 20-byte lines (20,000 bytes) to stdout in four bursts (so
/// the shim writes several chunks and rotates), then failing.
const NOISY: &str = r#"i=0; while [ $i -lt 1000 ]; do printf 'line %04d abcdefghi\n' $i; i=$((i+1)); [ $((i % 250)) -eq 0 ] && sleep 0.2; done; exit 3"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_attempts_are_listed_and_rotated_logs_are_read() {
    let (_c, addr) = cluster(1).await;
    // Logs rotate at 4 KiB: most of the output is gone, the last 4-8 KiB stay in two files.
    let mut a = AgentProc::new("node-a", std::slice::from_ref(&addr), &fake_config(1, 0, 0), "max_log_bytes = 4096\n");
    a.start();
    wait_nodes(&addr, Duration::from_secs(30), "the agent registered", |n| ready_healthy(n, "node-a", 1)).await;
    let spec = serde_json::json!({
        "name": "noisy", "queue": "default",
        "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 100, "memory_mib": 64},
                    "task": {"command": "/bin/sh", "args": ["-c", NOISY]}}]
    });
    let mut jc = pb::jobs_client::JobsClient::new(channel(&addr).await.unwrap());
    let req = pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: "noisy".into(),
        spec_json: spec.to_string(),
        retry: Some(pb::RetryPolicy { max_attempts: 2, backoff_base_s: 1, backoff_max_s: 1 }),
    };
    let id = jc.submit(req).await.unwrap().into_inner().job_id;
    let j = wait_terminal(&addr, &[id], Duration::from_secs(60)).await.remove(&id).unwrap();
    assert_eq!((j.state.as_str(), j.attempt), ("failed", 2), "{j:?}\n{}", a.log());

    // The first attempt's allocation is gone from the state; the job remembers it.
    let out = ok(&addr, &["job", "status", &id.to_string()]);
    assert!(out.contains("past attempts:"), "{out}");
    let past = out.lines().skip_while(|l| !l.starts_with("past attempts:")).nth(2).unwrap_or_default();
    let cols: Vec<&str> = past.split_whitespace().collect();
    assert_eq!((cols.first(), cols.get(3)), (Some(&"1"), Some(&"node-a")), "{out}");
    assert!(past.contains("failed"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&ok(&addr, &["job", "status", &id.to_string(), "--output", "json"])).unwrap();
    assert_eq!(v["attempts"].as_array().map(Vec::len), Some(1), "{v:#}");
    assert_eq!(v["attempts"][0]["state"], "failed", "{v:#}");

    // `job logs` reads the rotated file, then the current one: exactly what the two files hold.
    let alloc = &j.allocs[0];
    let dir = a.data_dir().join("allocs").join(format!("{}-{}", alloc.id, alloc.epoch));
    let rotated =
        std::fs::read(dir.join("stdout.log.1")).unwrap_or_else(|e| panic!("{}: no rotated log: {e}", dir.display()));
    let current = std::fs::read(dir.join("stdout.log")).unwrap();
    assert!(!rotated.is_empty() && !current.is_empty());
    let full: Vec<u8> = (0..1000).flat_map(|i| format!("line {i:04} abcdefghi\n").into_bytes()).collect();
    let both = [rotated.as_slice(), current.as_slice()].concat();
    assert!(full.ends_with(&both), "the two files are not the output's end");
    let o = suanli(&addr, &["job", "logs", &id.to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout.len(), both.len(), "job logs must print both files");
    assert!(o.stdout == both, "job logs printed something else than rotated + current");
    // --tail reaches back into the rotated file (which may hold less than 100 bytes: a large
    // read right after a small one rotates the small one away).
    let n = current.len() + rotated.len().min(100);
    let o = suanli(&addr, &["job", "logs", &id.to_string(), "--tail", &n.to_string()]);
    assert!(o.stdout == both[both.len() - n..], "--tail {n}: {}", String::from_utf8_lossy(&o.stdout));
    drop(a);
}

/// `node drain --grace 2s --max-unavailable 1 --wait`: the node's three jobs keep running
/// through the grace period, then move to the other node one at a time (the next only once
/// the previous runs again), and the command returns when the node is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_grace_and_budget_then_reports_done() {
    let (_c, addr) = cluster(1).await;
    let servers = std::slice::from_ref(&addr);
    let mut a = AgentProc::new("node-a", servers, &fake_config(1, 0, 0), "");
    let mut b = AgentProc::new("node-b", servers, &fake_config(1, 0, 0), "");
    a.start();
    b.start();
    wait_nodes(&addr, Duration::from_secs(30), "both agents registered", |n| {
        ready_healthy(n, "node-a", 1) && ready_healthy(n, "node-b", 1)
    })
    .await;
    ok(&addr, &["node", "cordon", "node-b"]);
    let spec = |i: u32| {
        serde_json::json!({
            "name": format!("long-{i}"), "queue": "default",
            "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 100, "memory_mib": 64},
                        "task": {"command": "/bin/sh", "args": ["-c", "sleep 60"]}}]
        })
    };
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(submit(&addr, &format!("long-{i}"), &spec(i)).await);
    }
    let running_on = |j: &pb::JobInfo, node: &str| j.state == "running" && j.allocs.iter().all(|x| x.node == node);
    let deadline = Instant::now() + Duration::from_secs(30);
    for &id in &ids {
        while !running_on(&job(&addr, id).await, "node-a") {
            assert!(Instant::now() < deadline, "job {id} not running on node-a:\n{}", a.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    ok(&addr, &["node", "uncordon", "node-b"]);

    let t0 = Instant::now();
    let out = ok(
        &addr,
        &["node", "drain", "node-a", "--grace", "2s", "--max-unavailable", "1", "--wait", "--timeout", "90s"],
    );
    let took = t0.elapsed();
    assert!(out.starts_with("node node-a draining"), "{out}");
    assert!(out.contains("node node-a: 3 allocations left"), "no progress shown: {out}");
    assert!(out.contains("running work evicted in"), "the grace period is not shown: {out}");
    assert!(out.trim_end().ends_with("node node-a drained: no allocations left"), "{out}");
    assert!(took >= Duration::from_secs(2), "returned within the grace period ({took:?}): {out}");
    // Every job runs on node-b now; each was moved once, through the drain.
    for &id in &ids {
        let j = job(&addr, id).await;
        assert!(running_on(&j, "node-b") || j.state == "placed", "job {id}: {j:?}");
        assert_eq!(j.attempts.len(), 1, "job {id} moved once: {:?}", j.attempts);
        assert_eq!(j.attempts[0].node, "node-a");
        assert_eq!(j.attempts[0].state, "stopped", "{:?}", j.attempts);
    }
    // The budget held: a job was evicted only after the one before ran again. Evictions
    // end attempts; starts on node-b are the next attempts' allocations.
    let mut ends: Vec<u64> = Vec::new();
    let mut starts: Vec<u64> = Vec::new();
    for &id in &ids {
        let j = job(&addr, id).await;
        ends.push(j.attempts[0].ended_at);
        starts.push(j.allocs[0].started_at);
    }
    let mut order: Vec<usize> = (0..3).collect();
    order.sort_by_key(|&i| ends[i]);
    for w in order.windows(2) {
        assert!(
            ends[w[1]] >= starts[w[0]],
            "job {} evicted before job {} ran again: {ends:?} {starts:?}",
            ids[w[1]],
            ids[w[0]]
        );
    }
    let n = ok(&addr, &["node", "get", "node-a"]);
    assert!(n.contains("allocations") && n.contains("drain"), "{n}");

    // A job that fits nowhere: its pending reason counts node-a as draining, not cordoned.
    let mut big = spec(9);
    big["groups"][0]["resources"]["cpu_milli"] = serde_json::json!(1_000_000);
    let id = submit(&addr, "big", &big).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = ok(&addr, &["job", "status", &id.to_string()]);
        if out.contains("nodes fit") {
            assert!(out.contains("1 draining") && !out.contains("cordoned"), "{out}");
            break;
        }
        assert!(Instant::now() < deadline, "no pending reason within 20 s: {out}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop((a, b));
}
