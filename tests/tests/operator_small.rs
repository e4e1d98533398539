//! Small operator-facing behaviours of the `suanli` binary, each over a real process: strict
//! server configuration files, log formats when stderr is not a terminal, and a closed stdout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use suanli_tests as common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The binary under test, with the local PKI's admin credentials for its client commands.
fn bin() -> Command {
    let mut c = suanli_tests::cli();
    c.env_remove("SUANLI_ADDR").env_remove("SUANLI_LOG_FORMAT").env_remove("SUANLI_CONFIG");
    c
}

/// An unknown key under `[raft]` (or anywhere else in the file) stops the server before it
/// binds anything, naming the key's dotted path; a known key is accepted.
#[test]
fn unknown_config_keys_are_refused_with_their_path() {
    let dir = tempfile::tempdir().unwrap();
    for (text, path) in [
        ("[raft]\nheartbeat_ms = 100\n", "raft.heartbeat_ms"),
        ("listen_addr = \"127.0.0.1:1\"\n", "listen_addr"),
        ("[[peers]]\nid = 1\naddr = \"127.0.0.1:7400\"\nport = 3\n", "peers[0].port"),
        ("[raft.dial]\n\"a:1\" = \"b:1\"\n[raft]\ngroup = \"g\"\nsnapshot_every = 3\n", "raft.snapshot_every"),
    ] {
        let f = dir.path().join("server.toml");
        std::fs::write(&f, text).unwrap();
        let o = bin().args(["server", "--config"]).arg(&f).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{text:?} was accepted: {err}");
        assert!(err.contains(&format!("{path}: unknown key")), "{text:?}: the error must name {path}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Lines a server wrote to its log file (stderr redirected) until it elected itself.
fn server_log(extra: &[&str]) -> String {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let c = common::start(1, extra);
    rt.block_on(c.wait_leader(Duration::from_secs(30))).unwrap();
    let log = c.log(0);
    drop(c);
    log
}

/// Redirected to a file, text logs carry no ANSI escape; `--log-format json` writes one JSON
/// object per line.
#[test]
fn logs_are_plain_when_redirected_and_json_on_request() {
    let text = server_log(&[]);
    assert!(text.lines().count() >= 2, "the server logged nothing: {text}");
    assert!(!text.contains("\u{1b}["), "colour codes in a redirected log:\n{text}");
    let json = server_log(&["--log-format", "json"]);
    assert!(json.lines().count() >= 2, "the server logged nothing: {json}");
    for line in json.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}\n{json}"));
        assert!(v["level"].is_string() && v["timestamp"].is_string(), "{line}");
    }
}

/// A CLI whose stdout closes early (`| head -1`) ends quietly: no panic, no error message.
#[test]
fn a_closed_stdout_ends_the_cli_quietly() {
    let mut child = bin()
        .args(["sim", "fill", "--synthetic", "200", "--policy", "all", "--format", "csv"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the pipe before the command has computed anything to print (as `| head -0`, or a
    // reader that went away, would): its first write meets a closed pipe.
    drop(child.stdout.take());
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{status:?}: {err}");
    assert!(status.code().is_none_or(|c| c == 0), "exit {status:?}: {err}");
}

fn example(rel: &str) -> String {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join(rel).display().to_string()
}

/// Runs `suanli args` until it succeeds or `within` passes; its stdout.
fn ok_within(args: &[&str], within: Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let o = bin().args(args).output().unwrap();
        if o.status.success() {
            return String::from_utf8_lossy(&o.stdout).into_owned();
        }
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(std::time::Instant::now() < deadline, "suanli {args:?} still failing after {within:?}: {err}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `cluster check` on a 3-server cluster: every server reports the same digest at the
/// leader's commit index, also after a follower took a snapshot and restarted from it; a
/// server that does not answer makes the check fail (exit 2, its row says why).
#[test]
fn cluster_check_compares_every_server() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut c = common::start(3, &[]);
    let leader = rt.block_on(c.wait_leader(Duration::from_secs(30))).unwrap();
    let follower = (leader + 1) % 3;
    let all = c.addrs.join(",");
    ok_within(&["queue", "apply", &example("queues/team-vision.toml"), "--server", &all], Duration::from_secs(30));

    let check = |servers: &str| bin().args(["cluster", "check", "--server", servers, "--output", "json"]).output();
    let o = check(&all).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert!(o.status.success(), "{v:#} {}", String::from_utf8_lossy(&o.stderr));
    let servers = v["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 3, "{v:#}");
    assert!(servers.iter().all(|s| s["result"] == "OK"), "{v:#}");
    let first = v["index"].as_u64().unwrap();
    assert!(first > 0, "{v:#}");
    let d0 = servers[0]["digest"].clone();

    // The follower snapshots and restarts: it restores its digest from the snapshot.
    ok_within(&["cluster", "snapshot", "--server", &c.addrs[follower]], Duration::from_secs(10));
    c.kill(follower);
    c.spawn(follower).unwrap();
    ok_within(&["queue", "apply", &example("queues/team-nlp.toml"), "--server", &all], Duration::from_secs(30));
    rt.block_on(c.wait_caught_up(follower, Duration::from_secs(30))).unwrap();
    let out = ok_within(&["cluster", "check", "--server", &c.addrs[follower]], Duration::from_secs(10));
    assert_eq!(out.lines().filter(|l| l.ends_with(" OK")).count(), 3, "{out}");
    assert!(out.contains("all 3 servers agree at log index"), "{out}");
    // An older index (still kept) gives the first answer's digest again, on every server.
    let o = bin()
        .args(["cluster", "check", "--index", &first.to_string(), "--server", &all, "--output", "json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert!(o.status.success(), "{v:#}");
    assert!(v["servers"].as_array().unwrap().iter().all(|s| s["digest"] == d0), "{v:#} vs {d0}");

    // A member down: the check fails and says which.
    c.kill(follower);
    let o = bin().args(["cluster", "check", "--server", &c.addrs[leader]]).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{out}{err}");
    let row = out.lines().find(|l| l.contains(&c.addrs[follower])).unwrap_or_default();
    assert!(row.contains("ERROR"), "{out}");
    assert!(err.contains("1 of 3 servers do not agree"), "{err}");
}
