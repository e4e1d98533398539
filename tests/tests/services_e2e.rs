//! Services end to end (docs/services.md), with real processes: one `suanli server`, two
//! `suanli agent`s, and a service of 3 replicas, each the example model server
//! (`examples/server/server.py`) on the port its agent picked (`SUANLI_PORT`) with an HTTP
//! readiness check.
//!
//! - All 3 replicas become ready, and `suanli service endpoints` lists exactly their
//!   `host:port`s, each of which answers HTTP.
//! - Requests to each replica (one failing, four of 20 ms) are measured by the replica and
//!   reported (`service.report`, read from its Prometheus `/metrics`): `suanli service status`
//!   shows each replica's success ratio of 0.8 and latency of at least 20 ms, and the
//!   server's `/metrics` exports their means (`suanli_inference_latency_ms`,
//!   `suanli_inference_success_ratio`).
//! - A replica's process is killed: that replica alone is replaced (after the restart
//!   backoff), the other two keep their allocations, and the endpoints follow.
//! - A rolling update (`suanli service update web FILE`, a new environment): the replicas are
//!   replaced one at a time by the new version (max_surge 1, max_unavailable 0); sampled
//!   throughout, never fewer than 3 are ready, and the endpoints follow. The new version reads
//!   its reports from the files the server writes (`source = "file"`), measured again.
//! - An agent is SIGKILLed: once its node is declared down, its replicas are replaced on the
//!   other node, the replicas there keep running, and the endpoints follow again.

#![allow(clippy::unwrap_used)]

use suanli_tests as support;

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use support::{LocalPki, cluster, fake_config, job, start_agents, submit, wait_job};

/// The example model server (`examples/server/server.py`).
const SERVER_PY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/server/server.py");

fn service_spec() -> serde_json::Value {
    let run = format!("echo $$ > \"$SUANLI_ALLOC_DIR/pid\"; exec python3 {SERVER_PY}");
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
                "args": ["-c", run],
            },
        }],
        "service": {
            "readiness": {"kind": "http", "path": "/healthz", "period_ms": 200, "timeout_ms": 1000},
            "restart_backoff_s": 1,
            "report": {"source": "prometheus", "period_s": 1},
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

/// The HTTP status `GET path` from `endpoint` answers (`None`: no answer).
fn get(endpoint: &str, path: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect(endpoint).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let status = buf.strip_prefix("HTTP/1.0 ").or_else(|| buf.strip_prefix("HTTP/1.1 "))?;
    status.get(..3)?.parse().ok()
}

/// GET / from `endpoint` answers 200.
fn answers(endpoint: &str) -> bool {
    get(endpoint, "/") == Some(200)
}

/// Each endpoint serves one failing request and four of 20 ms; waits until every ready
/// replica reports a success ratio of 0.8 and a latency of at least 20 ms (`suanli service
/// status --output json`) and the server's `/metrics` exports their means. Returns how long
/// the reports took to arrive.
async fn requests_are_measured_and_reported(http_addr: &str, addr: &str, eps: &BTreeSet<String>) -> Duration {
    for e in eps {
        assert_eq!(get(e, "/infer?fail=1"), Some(500), "{e}");
        for _ in 0..4 {
            assert_eq!(get(e, "/infer?ms=20"), Some(200), "{e}");
        }
    }
    let t0 = Instant::now();
    let http = support::http::Http::with(http_addr, &LocalPki::get().admin_tls());
    let mut last_metrics = String::new();
    loop {
        // `service status` first, `/metrics` after it: a replica's report can move (0.75 after
        // three of its four good requests, 0.8 after the fourth) between two reads, so the
        // gauges are only judged once every replica's report has been seen final, and a mean
        // that is not yet 0.8 is read again until the deadline.
        let o =
            support::cli().args(["service", "status", "web", "--server", addr, "--output", "json"]).output().unwrap();
        assert!(o.status.success(), "service status: {}", String::from_utf8_lossy(&o.stderr));
        let st: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let serving: Vec<&serde_json::Value> = st["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["state"] == "running" && r["ready"] == true)
            .collect();
        let all_reported = serving.len() == eps.len()
            && serving.iter().all(|r| r["success_ratio"].as_f64().is_some_and(|x| (x - 0.8).abs() < 1e-9));
        if all_reported {
            let m = http.get("/metrics", None).await;
            assert_eq!(m.status, 200, "{}", m.body);
            let sample = |name: &str| {
                let series = format!("{name}{{queue=\"default\",service=\"web\"}} ");
                m.body.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.parse::<f64>().ok())
            };
            if let (Some(latency), Some(success)) =
                (sample("suanli_inference_latency_ms"), sample("suanli_inference_success_ratio"))
                && (success - 0.8).abs() < 1e-9
            {
                assert!((20.0..5000.0).contains(&latency), "mean latency {latency} ms");
                for r in &serving {
                    let ms = r["latency_ms"].as_f64().unwrap();
                    assert!((20.0..5000.0).contains(&ms), "{r}");
                }
                return t0.elapsed();
            }
            last_metrics = m.body;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not reported within 30 s (every ready replica at success 0.8, /metrics mean 0.8): {st}\n{last_metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
    let reported = requests_are_measured_and_reported(&c.http_addrs[0], &addr, &eps).await;

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
    v1["service"]["report"]["source"] = "file".into();
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
    let reported_from_files = requests_are_measured_and_reported(&c.http_addrs[0], &addr, &eps).await;
    eprintln!("reports in /metrics after the requests: {reported:?} (prometheus), {reported_from_files:?} (files)");

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
