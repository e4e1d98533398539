//! `/metrics` and the alert rules against a real Prometheus (docs/metrics.md): `promtool`
//! checks deploy/prometheus/, and a Prometheus (Debian's, /usr/bin/prometheus) scrapes a TLS
//! cluster and an agent with a viewer certificate, answers one series of each family, and
//! fires `SuanliNodeLost` once the agent is killed.
//!
//! The alert rules run from a copy of deploy/prometheus/alerts.yml whose `for:` durations are
//! all shortened to 1s (the test cannot wait minutes); the expressions are the file's.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use suanli_security::Role;
use suanli_tests::{AgentProc, LocalPki, cluster_with, fake_config, ready_healthy, submit, wait_nodes};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn have(bin: &str) -> bool {
    Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

/// A Prometheus process, killed on drop.
struct Prom {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Prom {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `curl` with `args`; (status code, body).
fn curl(args: &[&str]) -> (u16, String) {
    let out =
        Command::new("curl").args(["-sS", "--max-time", "5", "-w", "\n%{http_code}"]).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Prometheus's answer to an instant query: the result vector.
fn query(port: u16, q: &str) -> Vec<serde_json::Value> {
    let url = format!("http://127.0.0.1:{port}/api/v1/query");
    let (code, body) = curl(&["--data-urlencode", &format!("query={q}"), &url]);
    if code != 200 {
        return Vec::new();
    }
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// Checks OpenMetrics text line by line: metadata, `name{labels} value`, `# EOF` last.
fn check_exposition(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last().copied(), Some("# EOF"), "the text must end with # EOF");
    for line in &lines {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line.starts_with("# UNIT ") || *line == "# EOF"
        {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample line: {line:?}"));
        assert!(value.parse::<f64>().is_ok() || value == "NaN" || value.ends_with("Inf"), "bad value: {line:?}");
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
            "bad metric name: {line:?}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "unterminated labels: {line:?}");
        }
    }
}

#[test]
fn promtool_checks_the_rules_and_a_rendered_config() {
    assert!(have("promtool"), "promtool is not installed: scripts/setup.sh installs Debian's prometheus");
    let rules = repo().join("deploy/prometheus/alerts.yml");
    let out = Command::new("promtool").arg("check").arg("rules").arg(&rules).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("8 rules found"), "{text}");
    // The shipped config, its certificate paths pointed at a real PKI.
    let dir = tempfile::tempdir().unwrap();
    let pki = LocalPki::get();
    let viewer = pki.user("prometheus", Role::Viewer, None);
    let cfg = std::fs::read_to_string(repo().join("deploy/prometheus/prometheus.yml"))
        .unwrap()
        .replace("/etc/suanli/tls/ca.pem", &viewer.ca.display().to_string())
        .replace("/etc/suanli/tls/prometheus.pem", &viewer.cert.display().to_string())
        .replace("/etc/suanli/tls/prometheus.key", &viewer.key.display().to_string());
    std::fs::write(dir.path().join("prometheus.yml"), cfg).unwrap();
    std::fs::copy(&rules, dir.path().join("alerts.yml")).unwrap();
    let out =
        Command::new("promtool").arg("check").arg("config").arg(dir.path().join("prometheus.yml")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr));
    // The Grafana dashboard is valid JSON with panels on suanli_ series.
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/suanli.json")).unwrap()).unwrap();
    let panels = g["panels"].as_array().unwrap();
    assert!(panels.len() >= 5, "{} panels", panels.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prometheus_scrapes_servers_and_agent_and_node_lost_fires() {
    assert!(
        have("prometheus") && have("curl"),
        "prometheus or curl is not installed: scripts/setup.sh installs them (this test never skips)"
    );
    let t0 = Instant::now();
    let cfg_dir = tempfile::tempdir().unwrap();
    let server_cfg = cfg_dir.path().join("server.toml");
    std::fs::write(&server_cfg, "heartbeat_interval_ms = 200\nheartbeat_ttl_ms = 2000\n").unwrap();
    let (c, addr) = cluster_with(3, &["--config", server_cfg.to_str().unwrap()]).await;
    assert!(c.tls_dir().is_some(), "the cluster runs TLS");
    let mut a = AgentProc::new("node-m", c.addrs.as_slice(), &fake_config(2, 0, 0), "http_listen = \"127.0.0.1:0\"\n");
    a.start();
    wait_nodes(&addr, Duration::from_secs(20), "the agent registered", |n| ready_healthy(n, "node-m", 2)).await;
    let agent_http = {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = a.log();
            if let Some(line) = log.lines().find(|l| l.contains("agent running"))
                && let Some(h) = line.split("http=").nth(1)
            {
                break h.split_whitespace().next().unwrap().trim_matches('"').to_owned();
            }
            assert!(Instant::now() < deadline, "no `agent running ... http=` line:\n{log}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // A fractional job that keeps running, a whole-device one that succeeds, an inference one.
    let job = |name: &str, kind: &str, milli: u32, cmd: &str| {
        serde_json::json!({"name": name, "queue": "default", "kind": kind, "groups": [{"name": "main", "replicas": 1,
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": milli}},
            "task": {"command": "/bin/sh", "args": ["-c", cmd]}}]})
    };
    submit(&addr, "m-frac", &job("frac", "training", 500, "sleep 600")).await;
    submit(&addr, "m-done", &job("done", "batch", 1000, "exit 0")).await;
    submit(&addr, "m-infer", &job("infer", "inference", 250, "sleep 600")).await;

    // /metrics: anonymous is 401, a viewer certificate 200 with valid text.
    let pki = LocalPki::get();
    let viewer = pki.user("prometheus", Role::Viewer, None);
    let (ca, cert, key) =
        (viewer.ca.display().to_string(), viewer.cert.display().to_string(), viewer.key.display().to_string());
    let server_url = format!("https://{}/metrics", c.http_addrs[0]);
    let (code, _) = curl(&["--cacert", &ca, &server_url]);
    assert_eq!(code, 401, "anonymous /metrics on a server");
    let (code, body) = curl(&["--cacert", &ca, "--cert", &cert, "--key", &key, &server_url]);
    assert_eq!(code, 200, "{body}");
    check_exposition(&body);
    assert!(body.contains("suanli_raft_is_leader"), "{body}");
    let agent_url = format!("https://{agent_http}/metrics");
    let (code, _) = curl(&["--cacert", &ca, &agent_url]);
    assert_eq!(code, 401, "anonymous /metrics on the agent");
    let (code, body) = curl(&["--cacert", &ca, "--cert", &cert, "--key", &key, &agent_url]);
    assert_eq!(code, 200, "{body}");
    check_exposition(&body);

    // A Prometheus scraping every server and the agent over TLS, every second.
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let targets = |v: &[String]| v.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ");
    let tls = format!(
        "    scheme: https\n    tls_config:\n      ca_file: {ca}\n      cert_file: {cert}\n      key_file: {key}\n"
    );
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - alerts.yml\nscrape_configs:\n  \
         - job_name: suanli-server\n{tls}    static_configs:\n      - targets: [{}]\n  \
         - job_name: suanli-agent\n{tls}    static_configs:\n      - targets: [\"{agent_http}\"]\n",
        targets(&c.http_addrs)
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    // The shipped rules with every `for:` shortened to 1s.
    let rules = std::fs::read_to_string(repo().join("deploy/prometheus/alerts.yml")).unwrap();
    let rules: String = rules
        .lines()
        .map(|l| if l.trim_start().starts_with("for:") { "        for: 1s".to_owned() } else { l.to_owned() })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(dir.path().join("alerts.yml"), rules).unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let prom = Prom { child, port, _dir: dir };
    let prom_log = || std::fs::read_to_string(prom._dir.path().join("prometheus.log")).unwrap_or_default();

    // One series of each family, with a value.
    let wanted = [
        ("efficiency", "suanli_device_allocated_ratio{job=\"suanli-server\"} > 0"),
        ("delivery", "suanli_queue_wait_seconds_count{queue=\"default\"} > 0"),
        ("time to start", "suanli_job_time_to_start_seconds_count{queue=\"default\"} > 0"),
        ("governance", "suanli_queue_quota_used{queue=\"default\",resource=\"gpu\"} > 0"),
        ("inference", "suanli_inference_replicas_wanted{queue=\"default\"} > 0"),
        ("raft", "sum(suanli_raft_is_leader) == 1"),
        ("leader stats", "suanli_device_utilization_ratio"),
        ("tie rule", "suanli_scheduler_tie_rule == 1"),
        ("agent", "suanli_agent_device_healthy{node=\"node-m\"} == 1"),
    ];
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut missing: Vec<&str> = wanted.iter().map(|w| w.0).collect();
    while !missing.is_empty() {
        missing.retain(|fam| {
            let q = wanted.iter().find(|w| w.0 == *fam).unwrap().1;
            query(prom.port, q).is_empty()
        });
        if missing.is_empty() {
            break;
        }
        let up = query(prom.port, "up");
        assert!(
            Instant::now() < deadline,
            "families without a value after 20 s: {missing:?}\nup: {up:?}\nprometheus log:\n{}",
            prom_log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let scraped = t0.elapsed();

    // Kill the agent: the leader declares the node down, SuanliNodeLost fires.
    a.kill();
    let killed = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, body) = curl(&[&format!("http://127.0.0.1:{}/api/v1/alerts", prom.port)]);
        if code == 200 {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let firing = v["data"]["alerts"].as_array().into_iter().flatten().any(|x| {
                x["labels"]["alertname"] == "SuanliNodeLost"
                    && x["labels"]["node"] == "node-m"
                    && x["state"] == "firing"
            });
            if firing {
                break;
            }
        }
        assert!(Instant::now() < deadline, "SuanliNodeLost never fired: {body}\nprometheus log:\n{}", prom_log());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!(
        "metrics: every family in Prometheus {:.1} s after start; SuanliNodeLost firing {:.1} s after the kill",
        scraped.as_secs_f64(),
        killed.elapsed().as_secs_f64()
    );
    drop(prom);
    drop(a);
    drop(c);
}
