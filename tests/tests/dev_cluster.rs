//! The README's first command: `suanli dev` starts a server and two agents with fake devices,
//! and an example job from `examples/dev/` runs as a real process on "GPUs" right away; its
//! output comes back through `suanli job logs`. Every link is mutual TLS with the certificates
//! `suanli dev` made on its first run; the CLI, run from the same directory with no credential
//! given, finds them in `./.suanli/dev/tls`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use suanli_tests::dev::{DevProc, json, suanli_in, wait_for};

fn bin() -> PathBuf {
    suanli_tests::bin()
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/dev")
}

#[test]
fn dev_runs_an_example_job_on_fake_gpus() {
    // Port 0: `suanli dev` prints the address it bound on stdout. As from the repository
    // root: the default data directory, ./.suanli/dev.
    let dev = DevProc::start();
    let addr = dev.addr();
    let dev_log = || dev.log();
    let suanli = |_addr: &str, args: &[&str]| dev.cli(args);
    let tls = dev.tls_dir();
    for f in ["ca.pem", "server.pem", "admin.pem", "node-dev-gpu.pem", "node-dev-npu-key.pem"] {
        assert!(tls.join(f).is_file(), "suanli dev made {f} in {}: {}", tls.display(), dev_log());
    }
    // Elsewhere, with no credential, the CLI says what to pass; with SUANLI_TLS_DIR it works.
    let elsewhere = tempfile::tempdir().unwrap();
    let o = suanli_in(elsewhere.path(), &addr, &["node", "list"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no credentials") && err.contains("SUANLI_TLS_DIR"), "{err}");
    let o = Command::new(bin())
        .current_dir(elsewhere.path())
        .env("SUANLI_TLS_DIR", &tls)
        .env_remove("SUANLI_CA")
        .env_remove("SUANLI_CERT")
        .env_remove("SUANLI_KEY")
        .args(["cluster", "leader", "--server", &addr])
        .output()
        .unwrap();
    assert!(o.status.success(), "SUANLI_TLS_DIR: {}", String::from_utf8_lossy(&o.stderr));
    // Plaintext is refused by a TLS server, with an error rather than a hang.
    let o = dev.cli(&["cluster", "leader", "--insecure"]);
    assert!(!o.status.success(), "a plaintext client reached the TLS dev server");

    // Both agents register their fake devices.
    let nodes = wait_for(Duration::from_secs(60), "two dev nodes", || {
        let o = suanli(&addr, &["node", "list", "--output", "json"]);
        if !o.status.success() {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        let n = v.as_array()?.clone();
        (n.len() == 2).then_some(n)
    });
    let gpus: usize = nodes.iter().map(|n| n["devices"].as_array().map_or(0, |d| d.len())).sum();
    assert_eq!(gpus, 12, "8 fake GPUs + 4 fake NPUs: {nodes:?}\n{}", dev_log());

    let f = examples().join("hello-gpu.toml");
    let v = json(&suanli(&addr, &["job", "submit", &f.display().to_string(), "--output", "json"]));
    let id = v["job_id"].as_u64().unwrap().to_string();
    let state = wait_for(Duration::from_secs(60), "the job to end", || {
        let v = json(&suanli(&addr, &["job", "status", &id, "--output", "json"]));
        let s = v["state"].as_str()?.to_owned();
        ["succeeded", "failed", "cancelled"].contains(&s.as_str()).then_some(s)
    });
    assert_eq!(state, "succeeded", "{}", dev_log());

    let o = suanli(&addr, &["job", "logs", &id]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "job logs: {}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains(&format!("job {id} task main-0 attempt")), "logs: {out}");
    assert!(out.contains("CUDA_VISIBLE_DEVICES="), "logs: {out}");
    assert!(out.contains("on dev-gpu"), "the GPU job ran on the GPU node: {out}");

    // Device statistics from the agents' heartbeats reach the leader and `node get`.
    let stats = wait_for(Duration::from_secs(30), "device stats of dev-gpu", || {
        let v = json(&suanli(&addr, &["node", "get", "dev-gpu", "--output", "json"]));
        let s = v["stats"].as_array()?.clone();
        (s.len() == 8).then_some(s)
    });
    for st in &stats {
        let u = st["utilization_pct"].as_f64().unwrap();
        assert!((0.0..=100.0).contains(&u), "{st}");
    }
}
