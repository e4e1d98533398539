//! A federated task under a real task shim, with no agent at all (as if it died or was cut
//! off): the shim alone stops the task at its federation lease's deadline, checkpoint signal
//! first, and journals the stop with the task's global id and federation epoch.
//!
//! The shim is this test binary run again (`SUANLI_TEST_AS_SHIM`), in its own session as the
//! agent starts it, so that its group signals reach only the task.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;
use suanli_agent::fedlease::{FED_LEASE_FILE, FedLease, LEASE_KILL_GRACE_MS};
use suanli_agent::journal::{JOURNAL_FILE, JournalEvent, read_journal};
use suanli_agent::shim::{ALLOC_FILE, ExitRecord, ShimArgs};

const AS_SHIM: &str = "SUANLI_TEST_AS_SHIM";
const DRIFT_MS: u64 = 500;

/// When this process was started as a shim: runs it and exits.
fn maybe_be_shim() {
    let Ok(dir) = std::env::var(AS_SHIM) else { return };
    let dir = PathBuf::from(dir);
    let journal = dir.parent().unwrap().join(JOURNAL_FILE);
    let _code = suanli_agent::shim::run(ShimArgs {
        dir: dir.clone(),
        max_log_bytes: 1 << 20,
        cgroup: None,
        workdir: None,
        journal: Some(journal),
        lease: None,
        disk_max_bytes: 0,
        command: "/bin/sh".into(),
        args: vec!["-c".into(), std::env::var("SUANLI_TEST_SCRIPT").unwrap()],
    });
    std::process::exit(0);
}

fn now_ms() -> u64 {
    suanli_agent::sys::now_ms()
}

/// An allocation directory as the agent leaves it before spawning the shim.
fn alloc_dir(root: &Path, lease: &FedLease) -> PathBuf {
    let dir = root.join("1-1");
    std::fs::create_dir_all(&dir).unwrap();
    let alloc = serde_json::json!({"id": 1, "epoch": 1, "job_id": 9, "node": "n1", "task": "main-0", "devices": [],
        "global_id": lease.global_id, "fed_epoch": lease.fed_epoch});
    std::fs::write(dir.join(ALLOC_FILE), alloc.to_string()).unwrap();
    lease.write(&dir.join(FED_LEASE_FILE)).unwrap();
    dir
}

async fn run_shim(test: &str, dir: &Path, script: &str) -> tokio::process::Child {
    let mut cmd = tokio::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(AS_SHIM, dir)
        .env("SUANLI_TEST_SCRIPT", script)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("shim.log")).unwrap());
    suanli_agent::sys::new_session(&mut cmd);
    cmd.spawn().unwrap()
}

#[tokio::test]
async fn a_federated_task_is_stopped_by_its_shim_before_the_lease_ends() {
    maybe_be_shim();
    let root = tempfile::tempdir().unwrap();
    let grace_ms = 1_000;
    let t0 = now_ms();
    let lease = FedLease {
        until_ms: t0 + 4_000,
        stop_before_ms: DRIFT_MS + grace_ms + LEASE_KILL_GRACE_MS,
        global_id: "g-5".into(),
        fed_epoch: 2,
        checkpoint_signal: "SIGUSR1".into(),
        grace_ms,
    };
    let dir = alloc_dir(root.path(), &lease);
    // Records the checkpoint signal; exits on SIGTERM.
    let script = "trap 'echo ckpt >> ckpt.txt' USR1; trap 'exit 143' TERM; while :; do sleep 0.05; done";
    let mut shim = run_shim("a_federated_task_is_stopped_by_its_shim_before_the_lease_ends", &dir, script).await;
    // A renewal (the agent's rewrite) before the deadline moves it later.
    let renewed = lease.renewed(t0 + 5_000);
    tokio::time::sleep(Duration::from_millis(500)).await;
    renewed.write(&dir.join(FED_LEASE_FILE)).unwrap();
    tokio::time::timeout(Duration::from_secs(20), shim.wait()).await.unwrap().unwrap();
    let log = std::fs::read_to_string(dir.join("shim.log")).unwrap_or_default();

    let lines = read_journal(&root.path().join(JOURNAL_FILE)).unwrap();
    assert_eq!(lines.len(), 2, "{lines:?}\n{log}");
    let stop = &lines[1];
    assert!(matches!(stop.event, JournalEvent::Stop { fenced: true, exit_code: Some(143), .. }), "{stop:?}\n{log}");
    assert_eq!((stop.global_id.as_str(), stop.fed_epoch), ("g-5", 2));
    assert_eq!((lines[0].global_id.as_str(), lines[0].fed_epoch), ("g-5", 2), "the start line too");
    assert_eq!(stop.reason, format!("federation lease of g-5 epoch 2 ended at {}", renewed.until_ms));
    assert!(
        stop.at_ms >= renewed.deadline_ms() + grace_ms,
        "not before the renewed deadline and the checkpoint grace: stopped at {}, deadline {}",
        stop.at_ms,
        renewed.deadline_ms()
    );
    assert!(
        stop.at_ms < renewed.until_ms - DRIFT_MS,
        "gone before until - drift: stopped at {}, until {}",
        stop.at_ms,
        renewed.until_ms
    );
    let ck = std::fs::read_to_string(dir.join("ckpt.txt")).unwrap_or_default();
    assert!(ck.contains("ckpt"), "the checkpoint signal came first\n{log}");
    let exit = ExitRecord::read(&dir).unwrap();
    assert_eq!(exit.fed_stop, Some(format!("federation lease ended at {} (g-5 epoch 2)", renewed.until_ms)));
    assert!(exit.fenced);
}

#[tokio::test]
async fn a_federated_task_that_ignores_sigterm_is_killed_by_until_minus_drift() {
    maybe_be_shim();
    let root = tempfile::tempdir().unwrap();
    let t0 = now_ms();
    let lease = FedLease {
        until_ms: t0 + 2_500,
        stop_before_ms: DRIFT_MS + LEASE_KILL_GRACE_MS,
        global_id: "g-6".into(),
        fed_epoch: 1,
        checkpoint_signal: String::new(),
        grace_ms: 0,
    };
    let dir = alloc_dir(root.path(), &lease);
    let script = "trap '' TERM; while :; do sleep 0.05; done";
    let mut shim = run_shim("a_federated_task_that_ignores_sigterm_is_killed_by_until_minus_drift", &dir, script).await;
    tokio::time::timeout(Duration::from_secs(20), shim.wait()).await.unwrap().unwrap();
    let log = std::fs::read_to_string(dir.join("shim.log")).unwrap_or_default();
    let lines = read_journal(&root.path().join(JOURNAL_FILE)).unwrap();
    let stop = lines.last().unwrap();
    assert!(matches!(stop.event, JournalEvent::Stop { signal: Some(9), fenced: true, .. }), "{stop:?}\n{log}");
    assert!(stop.at_ms >= lease.deadline_ms() + LEASE_KILL_GRACE_MS, "{} vs {}", stop.at_ms, lease.deadline_ms());
    // SIGKILL is due at exactly until - drift; its delivery and the wait take a few ms.
    assert!(stop.at_ms <= lease.until_ms - DRIFT_MS + 100, "killed at {}, until {}", stop.at_ms, lease.until_ms);
}

#[tokio::test]
async fn a_federated_task_is_not_started_past_its_deadline() {
    maybe_be_shim();
    let root = tempfile::tempdir().unwrap();
    let lease = FedLease {
        until_ms: now_ms() + 1_000,
        stop_before_ms: 1_500,
        global_id: "g-8".into(),
        fed_epoch: 4,
        checkpoint_signal: String::new(),
        grace_ms: 0,
    };
    let dir = alloc_dir(root.path(), &lease);
    let mut shim = run_shim("a_federated_task_is_not_started_past_its_deadline", &dir, "echo ran > ran.txt").await;
    tokio::time::timeout(Duration::from_secs(20), shim.wait()).await.unwrap().unwrap();
    assert!(!dir.join("ran.txt").exists(), "not started");
    assert!(read_journal(&root.path().join(JOURNAL_FILE)).unwrap().is_empty());
    let exit = ExitRecord::read(&dir).unwrap();
    let want = format!("federation lease of g-8 epoch 4 ends at {}: not started", lease.until_ms);
    assert_eq!(exit.fed_stop.as_deref(), Some(want.as_str()));
}
