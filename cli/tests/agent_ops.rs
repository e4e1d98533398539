//! Operator commands against real processes with a real agent: `job status` shows the
//! attempt history after failed attempts, `job logs` reads across the rotated log file, and
//! `node drain --wait` moves work off a node and reports when it is empty.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../agent/e2e-support/mod.rs"]
mod support;

use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use support::*;

fn suanli(addr: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(bin()).args(args).args(["--server", addr]).env_remove("SUANLI_ADDR").output().unwrap()
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

/// A task printing 1,000 numbered 20-byte lines (20,000 bytes) to stdout, then failing.
const NOISY: &str = r#"i=0; while [ $i -lt 1000 ]; do printf 'line %04d abcdefghi\n' $i; i=$((i+1)); done; exit 3"#;

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
    let rotated = std::fs::read(dir.join("stdout.log.1")).unwrap();
    let current = std::fs::read(dir.join("stdout.log")).unwrap();
    assert!(!rotated.is_empty() && !current.is_empty());
    let full: Vec<u8> = (0..1000).flat_map(|i| format!("line {i:04} abcdefghi\n").into_bytes()).collect();
    let both = [rotated.as_slice(), current.as_slice()].concat();
    assert!(full.ends_with(&both), "the two files are not the output's end");
    let o = suanli(&addr, &["job", "logs", &id.to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout.len(), both.len(), "job logs must print both files");
    assert!(o.stdout == both, "job logs printed something else than rotated + current");
    // --tail reaches back into the rotated file.
    let n = current.len() + 100;
    let o = suanli(&addr, &["job", "logs", &id.to_string(), "--tail", &n.to_string()]);
    assert!(o.stdout == both[both.len() - n..], "--tail {n}: {}", String::from_utf8_lossy(&o.stdout));
    drop(a);
}
