//! The web dashboard (docs/dashboard.md) of a real `suanli dev`: its fake-GPU agents, a few
//! jobs, then the read-only `/api/` gateway over TLS (a write method is 404, an anonymous
//! caller 401, the viewer token `suanli dev` prints gets data) and headless Chromium loading
//! the page with that token: live data in the DOM (job ids, node ids, the pool, the device
//! heatmap's cells, a job's timeline) and a screenshot under target/test-output/dashboard/.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use suanli_tests::dev::{DevProc, json, suanli_in, wait_for};
use suanli_tests::http::Http;

/// Headless Chromium on `url`: `--dump-dom` (the DOM once the page's fetches settled), or a
/// screenshot into `shot`.
fn chromium(url: &str, shot: Option<&Path>, profile: &Path) -> String {
    let mut c = Command::new("/usr/bin/chromium-headless-shell");
    c.args([
        "--no-sandbox",
        "--headless",
        "--disable-gpu",
        "--ignore-certificate-errors",
        "--no-first-run",
        "--virtual-time-budget=8000",
        "--run-all-compositor-stages-before-draw",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    match shot {
        Some(p) => c.arg(format!("--screenshot={}", p.display())).arg("--window-size=1400,1000"),
        None => c.arg("--dump-dom"),
    };
    let o = c.arg(url).stdin(Stdio::null()).output().unwrap();
    assert!(o.status.success(), "chromium on {url}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const LONG_JOB: &str = r#"
name = "dash-long"
queue = "default"
[[groups]]
name = "main"
[groups.resources]
cpu_milli = 500
memory_mib = 256
[groups.resources.devices]
kind = "gpu"
count = 2
[groups.task]
command = "/bin/sh"
args = ["-c", "sleep 60"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_live_dev_cluster() {
    let t0 = Instant::now();
    let chrome = Path::new("/usr/bin/chromium-headless-shell");
    assert!(chrome.exists(), "{} is missing: scripts/setup.sh installs it", chrome.display());
    let dev = DevProc::start();
    let dir = &dev.dir;
    let addr = dev.addr();
    let http = dev.bound.http.expect("suanli dev serves HTTP").to_string();
    let dev_log = || dev.log();

    // `suanli dev` prints the dashboard's address with a viewer token in the fragment.
    let line = wait_for(Duration::from_secs(30), "the dashboard line", || {
        dev_log().lines().find(|l| l.contains("suanli dev: dashboard https://")).map(str::to_owned)
    });
    let url = line.split_whitespace().find(|w| w.starts_with("https://")).unwrap().to_owned();
    assert!(url.starts_with(&format!("https://{http}/#token=")), "{line}");
    let token = url.split_once("#token=").unwrap().1.to_owned();

    let nodes = wait_for(Duration::from_secs(30), "two dev nodes", || {
        let o = suanli_in(dir.path(), &addr, &["node", "list", "--output", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        let n = v.as_array()?.clone();
        (n.len() == 2).then_some(n)
    });
    let pool = nodes.iter().find(|n| n["id"] == "dev-gpu").unwrap()["pool"].as_str().unwrap().to_owned();

    // The example price catalog (it prices the dev nodes' A100-80G and Ascend910B).
    let prices = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/prices.toml");
    let o = suanli_in(dir.path(), &addr, &["cost", "prices", "set", "--file", &prices.display().to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // A few jobs: a long one on two GPUs, a short one, four half-GPU replicas.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/dev");
    let long = dir.path().join("long.toml");
    std::fs::write(&long, LONG_JOB).unwrap();
    let mut ids = Vec::new();
    for f in [long, examples.join("hello-gpu.toml"), examples.join("fractional-gpu.toml")] {
        let v = json(&suanli_in(dir.path(), &addr, &["job", "submit", &f.display().to_string(), "--output", "json"]));
        ids.push(v["job_id"].as_u64().unwrap());
    }
    let long_id = ids[0];
    wait_for(Duration::from_secs(30), "the long job to run", || {
        let v = json(&suanli_in(dir.path(), &addr, &["job", "status", &long_id.to_string(), "--output", "json"]));
        (v["state"] == "running").then_some(())
    });

    // The gateway: same API, same authorization.
    let client = Http::new(&http, dir.path().join(".suanli/dev/tls/ca.pem"));
    let page = client.get("/", None).await;
    assert_eq!(page.status, 200);
    assert!(page.content_type.starts_with("text/html"), "{}", page.content_type);
    assert!(page.csp.contains("default-src 'none'") && page.csp.contains("script-src 'self'"), "{}", page.csp);
    let js = client.get("/assets/app.js", None).await;
    assert!(js.status == 200 && js.content_type.starts_with("text/javascript"), "{}", js.content_type);
    let css = client.get("/assets/style.css", None).await;
    assert!(css.status == 200 && css.content_type.starts_with("text/css"), "{}", css.content_type);
    for write in ["/api/Jobs/Submit", "/api/Jobs/Cancel?job_id=1", "/api/Queues/Upsert", "/api/Nodes/SetMode"] {
        let a = client.get(write, Some(&token)).await;
        assert_eq!(a.status, 404, "{write}: {}", a.body);
    }
    let anon = client.get("/api/Nodes/List", None).await;
    assert_eq!(anon.status, 401, "anonymous: {}", anon.body);
    assert!(anon.body.contains("UNAUTHENTICATED"), "{}", anon.body);
    let bad = client.get("/api/Jobs/List", Some("not-a-token")).await;
    assert_eq!(bad.status, 401, "a bad token: {}", bad.body);
    let bad_arg = client.get("/api/Jobs/Get?job_id=x", Some(&token)).await;
    assert!(bad_arg.status == 400 && bad_arg.body.contains("job_id"), "{}", bad_arg.body);
    let listed = client.get("/api/Nodes/List", Some(&token)).await;
    assert_eq!(listed.status, 200, "{}", listed.body);
    let v: serde_json::Value = serde_json::from_str(&listed.body).unwrap();
    assert_eq!(v["nodes"].as_array().unwrap().len(), 2, "{v}");
    let got = client.get(&format!("/api/Jobs/Get?job_id={long_id}"), Some(&token)).await;
    let v: serde_json::Value = serde_json::from_str(&got.body).unwrap();
    assert_eq!(v["state"], "running", "{v}");
    let missing = client.get("/api/Jobs/Get?job_id=999999", Some(&token)).await;
    assert_eq!(missing.status, 404, "{}", missing.body);
    let cost = client.get("/api/Cost/Report?by=team", Some(&token)).await;
    assert_eq!(cost.status, 200, "{}", cost.body);
    let v: serde_json::Value = serde_json::from_str(&cost.body).unwrap();
    assert_eq!(v["currency"], "USD", "{v}");
    assert_eq!(v["conserved"], true, "{v}");
    assert!(!v["rows"].as_array().unwrap().is_empty(), "{v}");
    let bad_by = client.get("/api/Cost/Report?by=color", Some(&token)).await;
    assert_eq!(bad_by.status, 400, "{}", bad_by.body);

    // Wait until the leader holds the GPU node's device statistics (the heatmap's colors).
    wait_for(Duration::from_secs(30), "device stats of dev-gpu", || {
        let v = json(&suanli_in(dir.path(), &addr, &["node", "get", "dev-gpu", "--output", "json"]));
        (v["stats"].as_array()?.len() == 8).then_some(())
    });

    // Headless Chromium: the overview with live data.
    let profile = dir.path().join("chromium");
    let dom = chromium(&url, None, &profile);
    assert!(dom.contains("data-loaded=\"/overview\""), "the overview did not load: {dom}\n{}", dev_log());
    for id in &ids {
        assert!(dom.contains(&format!("href=\"#/job/{id}\"")), "job {id} in the DOM: {dom}");
    }
    for want in ["dev-gpu", "dev-npu", pool.as_str(), "Device heatmap", "leader s1"] {
        assert!(dom.contains(want), "{want:?} in the DOM: {dom}");
    }
    let cells = dom.matches("data-device=").count();
    assert_eq!(cells, 12, "one heatmap cell per device (8 GPUs + 4 NPUs): {dom}");
    assert!(dom.contains("class=\"cell\""), "a cell colored by utilization (stats present): {dom}");
    assert!(!dom.contains("token="), "the token left the URL");

    // A job's timeline, and the queues page.
    let dom = chromium(&format!("https://{http}/#/job/{long_id}&token={token}"), None, &profile);
    assert!(dom.contains(&format!("job {long_id} · dash-long")), "{dom}");
    assert!(dom.contains("Timeline") && dom.contains("tl-seg"), "{dom}");
    assert!(dom.contains("attempt 1 · dev-gpu"), "{dom}");
    let dom = chromium(&format!("https://{http}/#/queues&token={token}"), None, &profile);
    assert!(dom.contains("data-loaded=\"/queues\"") && dom.contains("default"), "{dom}");

    let dom = chromium(&format!("https://{http}/#/cost&token={token}"), None, &profile);
    assert!(dom.contains("data-loaded=\"/cost\"") && dom.contains("Cost by team"), "{dom}");
    assert!(dom.contains("id=\"cost-summary\"") && dom.contains("categories add up"), "{dom}");
    assert!(dom.contains("Lost (preemption)") && dom.contains("USD"), "{dom}");

    // Without a token the page says why and how to get one.
    let fresh = dir.path().join("chromium-anon");
    let dom = chromium(&format!("https://{http}/"), None, &fresh);
    assert!(dom.contains("Not signed in") && dom.contains("suanli token create"), "{dom}");

    // The screenshot, for a human to look at.
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("../test-output/dashboard");
    std::fs::create_dir_all(&out).unwrap();
    let shot = out.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    chromium(&url, Some(&shot), &profile);
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(size > 10_000, "a screenshot was written to {}", shot.display());
    let shot_job = out.join("dashboard-job.png");
    chromium(&format!("https://{http}/#/job/{long_id}&token={token}"), Some(&shot_job), &profile);
    println!("dashboard screenshots: {} {} ({:?})", shot.display(), shot_job.display(), t0.elapsed());
}
