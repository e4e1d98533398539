//! The client commands of the `suanli` binary against a real cluster: three `suanli server`
//! processes on loopback ports (RocksDB in temp dirs). Queues, nodes, jobs (submission with a
//! request id twice, status, list, watch, cancel), pools and membership, each through the CLI;
//! a dead address before a live one, writes sent to a follower, `SUANLI_ADDR`, and how errors
//! are printed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use suanli_tests as common;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;

fn example(rel: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join(rel).display().to_string()
}

fn cmd(args: &[&str]) -> Command {
    let mut c = suanli_tests::cli();
    c.args(args).env_remove("SUANLI_ADDR");
    c
}

fn run(args: &[&str]) -> Output {
    cmd(args).output().expect("run suanli")
}

/// Runs a command that must succeed; its stdout.
fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        o.status.success(),
        "suanli {args:?} failed ({:?}): {}{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs a command that must succeed and print JSON; the parsed document.
fn json(args: &[&str]) -> Value {
    let out = ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("suanli {args:?} printed no JSON ({e}): {out}"))
}

/// Runs `args` until it succeeds (the cluster has just elected a leader that may not yet have
/// confirmed its lease); its stdout.
fn ok_within(args: &[&str], within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let o = run(args);
        if o.status.success() {
            return String::from_utf8_lossy(&o.stdout).into_owned();
        }
        assert!(
            Instant::now() < deadline,
            "suanli {args:?} still failing after {within:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls `job status id --output json` until `pred` holds; the last answer.
fn job_until(servers: &str, id: u64, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    let id = id.to_string();
    loop {
        let j = json(&["job", "status", &id, "--server", servers, "--output", "json"]);
        if pred(&j) {
            return j;
        }
        assert!(Instant::now() < deadline, "job {id} not {what} within 30 s: {j:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn client_commands_against_a_real_cluster() {
    let t0 = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let c = common::start(3, &["--heartbeat-ttl-ms", "600000"]);
    let leader = rt.block_on(c.wait_leader(Duration::from_secs(30))).unwrap();
    let follower = (leader + 1) % 3;
    let all = c.addrs.join(",");
    let (lead_addr, fol) = (c.addrs[leader].clone(), c.addrs[follower].clone());
    // Nobody listens there: a socket bound (so the port is nobody else's) that never listens,
    // so connections are refused at once.
    let (_held, dead) = rt.block_on(async {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = s.local_addr().unwrap().to_string();
        (s, addr)
    });
    let dead_then_follower = format!("{dead},{fol}");

    // Queues. The first write retries while the new leader settles.
    let out =
        ok_within(&["queue", "apply", &example("queues/team-vision.toml"), "--server", &all], Duration::from_secs(30));
    assert_eq!(out.trim(), "queue team-vision applied");
    // Sent to a follower, which forwards the write to the leader.
    let out = ok(&["queue", "apply", &example("queues/team-nlp.toml"), "--server", &fol]);
    assert_eq!(out.trim(), "queue team-nlp applied");
    let out = ok(&["queue", "list", "--server", &all]);
    assert!(out.starts_with("ID "), "{out}");
    assert!(out.contains("team-vision") && out.contains("team-nlp") && out.contains("research"), "{out}");
    let q = json(&["queue", "get", "team-vision", "--server", &fol, "--output", "json"]);
    assert_eq!(q["id"], "team-vision");
    assert_eq!(q["cohort"], "research");
    assert_eq!(q["nominal"]["gpu_milli"], 32000);
    assert_eq!(q["borrowing_limit"]["gpu_milli"], 16000);
    let out = ok(&["queue", "get", "team-nlp", "--server", &all]);
    assert!(out.contains("weight:") && out.contains("gpu=64"), "{out}");

    // Nodes, registered through a follower.
    let node_file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/gpu-node.toml").display().to_string();
    // Registering is the node's own call: with its certificate (docs/security.md).
    let node = common::LocalPki::get().node("gpu-a-001");
    let o = cmd(&["node", "register", &node_file, "--server", &fol])
        .env("SUANLI_CERT", &node.cert)
        .env("SUANLI_KEY", &node.key)
        .output()
        .expect("run suanli");
    assert!(o.status.success(), "node register: {}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.starts_with("node gpu-a-001 registered"), "{out}");
    assert!(out.contains("down after 600000 ms"), "{out}");
    let out = ok(&["node", "list", "--server", &all]);
    assert!(out.starts_with("NODE "), "{out}");
    assert!(out.contains("gpu-a-001") && out.contains("train-h100"), "{out}");
    let n = json(&["node", "get", "gpu-a-001", "--server", &all, "--output", "json"]);
    assert_eq!(n["pool"], "train-h100");
    assert_eq!(n["mode"], "schedulable");
    assert_eq!(n["devices"].as_array().map(Vec::len), Some(8), "{n:#}");
    assert_eq!(n["labels"]["rack"], "r12");
    let out = ok(&["node", "get", "gpu-a-001", "--server", &lead_addr]);
    assert!(out.contains("devices:") && out.contains("GPU-7") && out.contains("H100-80G"), "{out}");
    let out = ok(&["node", "cordon", "gpu-a-001", "--server", &fol]);
    assert_eq!(out.trim(), "node gpu-a-001 cordoned");
    let n = json(&["node", "get", "gpu-a-001", "--server", &fol, "--output", "json"]);
    assert_eq!(n["mode"], "cordoned");
    let out = ok(&["node", "uncordon", "gpu-a-001", "--server", &all]);
    assert_eq!(out.trim(), "node gpu-a-001 schedulable");
    let n = json(&["node", "get", "gpu-a-001", "--server", &fol, "--output", "json"]);
    assert_eq!(n["mode"], "schedulable");

    // Pools.
    let out = ok(&["pool", "list", "--server", &all]);
    assert!(out.starts_with("POOL "), "{out}");
    assert!(out.contains("train-h100") && out.contains("1/1"), "{out}");
    let p = json(&["pool", "list", "--server", &fol, "--output", "json"]);
    let h100 = p.as_array().unwrap().iter().find(|p| p["name"] == "train-h100").expect("pool train-h100");
    assert_eq!(h100["capacity"]["gpu_milli"], 8000, "{p:#}");

    // Job submission with one request id, twice, through a follower: one job.
    let spec = example("jobs/single-gpu-train.toml");
    let s = json(&["job", "submit", &spec, "--request-id", "cli-r1", "--server", &fol, "--output", "json"]);
    assert_eq!(s["created"], true, "{s:#}");
    assert_eq!(s["client_request_id"], "cli-r1");
    let id = s["job_id"].as_u64().expect("job_id");
    let ids = id.to_string();
    let out = ok(&["job", "submit", &spec, "--request-id", "cli-r1", "--server", &all]);
    assert_eq!(out.trim(), format!("job {id} already submitted with request id cli-r1 (not created again)"));
    // A dead address first: skipped.
    let out = ok(&["job", "submit", &example("jobs/cpu-batch.toml"), "--server", &dead_then_follower]);
    let other: u64 = out
        .strip_prefix("job ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert_ne!(other, id);
    assert!(out.contains(" submitted (request id cli-"), "{out}");

    // The GPU job is placed on the only node that fits.
    let j = job_until(&all, id, "placed", |j| j["allocs"].as_array().is_some_and(|a| !a.is_empty()));
    assert_eq!(j["name"], "resnet50-finetune");
    assert_eq!(j["queue"], "team-vision");
    assert_eq!(j["client_request_id"], "cli-r1");
    assert_eq!(j["allocs"][0]["node"], "gpu-a-001", "{j:#}");
    let out = ok(&["job", "status", &ids, "--server", &dead_then_follower]);
    assert!(out.contains("resnet50-finetune") && out.contains("request id:") && out.contains("cli-r1"), "{out}");
    assert!(out.contains("allocations:") && out.contains("gpu-a-001") && out.contains("1Gi"), "{out}");
    let out = ok(&["job", "status", &ids, "--stale", "--server", &lead_addr]);
    assert!(out.contains("resnet50-finetune"), "{out}");

    // SUANLI_ADDR when --server is absent.
    let o = cmd(&["job", "status", &ids]).env("SUANLI_ADDR", &dead_then_follower).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("resnet50-finetune"));

    // Lists.
    let l = json(&["job", "list", "--server", &fol, "--output", "json"]);
    let l = l.as_array().expect("array");
    let mut listed: Vec<u64> = l.iter().map(|j| j["id"].as_u64().unwrap()).collect();
    listed.sort_unstable();
    assert_eq!(listed, [id.min(other), id.max(other)], "{l:?}");
    let l = json(&["job", "list", "--queue", "team-nlp", "--server", &all, "--output", "json"]);
    assert_eq!(l.as_array().map(|a| a.iter().map(|j| j["id"].as_u64()).collect()), Some(vec![Some(other)]));
    let out = ok(&["job", "list", "--limit", "1", "--server", &all]);
    assert_eq!(out.lines().count(), 2, "header + 1 row: {out}");
    assert!(out.starts_with("ID "), "{out}");

    // Watch one job: the first event is its current state; then the process is killed.
    let mut w = cmd(&["job", "watch", &ids, "--server", &fol])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn watch");
    let stdout = w.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let first = rx.recv_timeout(Duration::from_secs(20));
    let _ = w.kill();
    let _ = w.wait();
    let first = first.expect("no watch event within 20 s");
    assert!(first.starts_with("rev ") && first.contains(&format!(" job {id} resnet50-finetune queue=team-vision")));
    assert!(first.contains("allocs=1"), "{first}");

    // Cancel, through a follower.
    let out = ok(&["job", "cancel", &ids, "--reason", "test over", "--server", &fol]);
    assert_eq!(out.trim(), format!("job {id} cancelled"));
    job_until(&all, id, "cancelled", |j| j["state"] == "cancelled");

    // Membership.
    let out = ok(&["cluster", "members", "--server", &all]);
    assert_eq!(out.lines().count(), 5, "header + 3 members + term line: {out}");
    assert_eq!(out.lines().filter(|l| l.contains(" leader ")).count(), 1, "{out}");
    assert!(out.contains(&lead_addr), "{out}");
    let m = json(&["cluster", "members", "--server", &fol, "--output", "json"]);
    assert_eq!(m["members"].as_array().map(Vec::len), Some(3), "{m:#}");
    // Asked through a follower, replication progress is the leader's: every healthy voter has
    // matched some of the log (a follower alone knows none of it).
    for member in m["members"].as_array().unwrap() {
        assert!(member["matched_index"].as_u64().unwrap_or(0) > 0, "matched 0 through a follower: {m:#}");
    }
    let out = ok(&["cluster", "leader", "--server", &fol]);
    assert!(out.starts_with(&format!("leader {} at {lead_addr} (term ", leader + 1)), "{out}");
    let out = ok(&["cluster", "snapshot", "--server", &all]);
    assert!(out.starts_with("snapshot built up to log index "), "{out}");

    // Errors: `error: <CODE>: <message>` on stderr, exit code 2.
    let o = run(&["job", "status", "999999", "--server", &all]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("error: NOT_FOUND: ") && err.contains("999999"), "{err}");
    assert!(o.stdout.is_empty());
    let o = run(&["node", "cordon", "no-such-node", "--server", &fol]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("error: NOT_FOUND: "));
    let o = run(&["job", "status", "1", "--server", &dead]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("error: UNAVAILABLE: no server answered") && err.contains(&dead), "{err}");

    // A group commit through a follower: the follower proposes its queued submissions to the
    // leader as one batch command and answers each job from the leader's batch answer (which
    // once failed to encode, so every batched submission through a follower was refused).
    let results = rt.block_on(async {
        let ch = common::channel(&fol).await.unwrap();
        let jobs = (0..20)
            .map(|i| pb::SubmitJobRequest {
                global: false,
                team: String::new(),
                client_request_id: format!("fwd-{i}"),
                spec_json: common::cpu_job(&format!("fwd-{i}"), "team-nlp", 100),
                retry: None,
            })
            .collect();
        JobsClient::new(ch).submit_many(pb::SubmitJobsRequest { jobs }).await.unwrap().into_inner().results
    });
    assert_eq!(results.len(), 20);
    assert!(results.iter().all(|r| r.code == 0 && r.created), "{results:?}");

    // Several files in one `job submit`: all validated first, sent together, each answered.
    let batch = example("jobs/cpu-batch.toml");
    let s = json(&["job", "submit", &batch, &batch, "--request-id", "cli-m", "--server", &fol, "--output", "json"]);
    let rows = s.as_array().unwrap_or_else(|| panic!("one result per file: {s:#}"));
    assert_eq!(rows.len(), 2, "{s:#}");
    assert!(rows.iter().all(|r| r["created"] == true), "{s:#}");
    assert_eq!(rows[0]["client_request_id"], "cli-m-1");
    assert_eq!(rows[1]["client_request_id"], "cli-m-2");
    assert_ne!(rows[0]["job_id"], rows[1]["job_id"], "{s:#}");
    let out = ok(&["job", "submit", &batch, &batch, "--request-id", "cli-m", "--server", &all]);
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(out.lines().all(|l| l.contains("already submitted with request id cli-m-")), "{out}");
    // A bad file among good ones: the error names it and nothing is sent (the good file's
    // request id is still unused afterwards).
    let tmp = tempfile::tempdir().expect("temp dir");
    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "name = \"x\"\nqueue = \"team-nlp\"\n[[groups]]\nname = \"g\"\nreplicas = -1\n")
        .expect("write");
    let bad = bad.display().to_string();
    let o = run(&["job", "submit", &batch, &bad, "--request-id", "cli-bad", "--server", &fol]);
    assert_ne!(o.status.code(), Some(0));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bad.toml"), "{err}");
    let s = json(&["job", "submit", &batch, "--request-id", "cli-bad-1", "--server", &fol, "--output", "json"]);
    assert_eq!(s["created"], true, "{s:#}");

    eprintln!("client commands against 3 servers: {:?}", t0.elapsed());
}
