//! `suanli task-shim`: the small parent of every task. The agent starts it in a new session;
//! it joins the task's cgroup (when there is one), starts the command, copies its stdout and
//! stderr into size-bounded log files, forwards SIGTERM/SIGINT/SIGHUP to it, waits, and writes
//! `exit.json` atomically before it exits. Because the shim, not the agent, is the task's
//! parent, the agent can be restarted while tasks run and learn afterwards how each one ended.
//!
//! ```text
//!  agent ──spawn (setsid)──▶ task-shim --dir D ──spawn──▶ command args…
//!                               │  stdout/stderr pipes ──▶ D/stdout.log, D/stderr.log (rotated)
//!                               └─ on exit ──▶ D/exit.json {exit_code, signal, finished_at}
//! ```

use crate::sys;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

/// The file the shim writes when the task has ended.
pub const EXIT_FILE: &str = "exit.json";
/// Locked by the shim for its whole life: held means a shim is alive for this directory.
pub const LOCK_FILE: &str = "shim.lock";
/// The shim's identity (pid and start time), written before the command starts.
pub const SHIM_FILE: &str = "shim.json";
/// Written by an agent that found no live shim and declared the task lost: a shim that starts
/// afterwards (spawned by an agent that died right after) must not run the command.
pub const ABANDONED_FILE: &str = "abandoned";

/// How the task ended (`exit.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    /// The command's exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// Seconds since the Unix epoch.
    pub finished_at: u64,
    /// Set when the command could not be started at all (not found, bad workdir, cgroup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ExitRecord {
    /// Reads `dir/exit.json`; `None` when absent or unreadable.
    pub fn read(dir: &Path) -> Option<ExitRecord> {
        let text = std::fs::read(dir.join(EXIT_FILE)).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// The exit code a shell would show (128 + signal for a signal).
    pub fn code(&self) -> i32 {
        match (self.exit_code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 127,
        }
    }
}

/// What the shim is told to run.
#[derive(Debug, Clone)]
pub struct ShimArgs {
    /// The allocation directory (logs and `exit.json` go here).
    pub dir: PathBuf,
    /// Rotate a log file at this size.
    pub max_log_bytes: u64,
    /// A cgroup v2 directory to join before starting the command.
    pub cgroup: Option<PathBuf>,
    /// Working directory of the command (default: `dir`).
    pub workdir: Option<PathBuf>,
    /// The program.
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
}

static CHILD: AtomicI32 = AtomicI32::new(0);
static PENDING: AtomicI32 = AtomicI32::new(0);

#[allow(unsafe_code)]
extern "C" fn on_signal(sig: libc::c_int) {
    let child = CHILD.load(Ordering::SeqCst);
    if child > 0 {
        // SAFETY: kill(2) is async-signal-safe and takes plain integers.
        unsafe {
            libc::kill(child, sig);
        }
    } else {
        PENDING.store(sig, Ordering::SeqCst);
    }
}

#[allow(unsafe_code)]
fn install_forwarding() -> std::io::Result<()> {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; the handler is an
        // extern "C" fn that only touches atomics and calls kill(2), both async-signal-safe.
        // A caught (not ignored) signal is reset to its default in the child at exec.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// A log file that rotates to `<name>.1` when it would grow past its limit.
struct RotatingLog {
    path: PathBuf,
    file: Option<std::fs::File>,
    size: u64,
    max: u64,
}

impl RotatingLog {
    fn open(path: PathBuf, max: u64) -> RotatingLog {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path).ok();
        let size = file.as_ref().and_then(|f| f.metadata().ok()).map_or(0, |m| m.len());
        RotatingLog { path, file, size, max }
    }

    fn write(&mut self, data: &[u8]) {
        if self.size > 0 && self.size + data.len() as u64 > self.max {
            let mut old = self.path.clone().into_os_string();
            old.push(".1");
            let _ = std::fs::rename(&self.path, &old);
            self.file = std::fs::OpenOptions::new().create(true).append(true).truncate(false).open(&self.path).ok();
            self.size = 0;
        }
        // A full disk must not stall the task: the output is dropped and the pipe drained.
        if let Some(f) = self.file.as_mut()
            && f.write_all(data).is_ok()
        {
            self.size += data.len() as u64;
        }
    }
}

fn copy_thread(
    mut from: impl Read + Send + 'static,
    mut to: RotatingLog,
    done: std::sync::mpsc::Sender<()>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("shim-log".into()).spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => to.write(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = done.send(());
    })
}

fn finish(dir: &Path, rec: &ExitRecord) -> ExitCode {
    let data = serde_json::to_vec(rec).unwrap_or_default();
    if let Err(e) = sys::write_atomic(&dir.join(EXIT_FILE), &data) {
        eprintln!("suanli task-shim: writing {}: {e}", dir.join(EXIT_FILE).display());
    }
    let c = rec.code().clamp(0, 255);
    ExitCode::from(u8::try_from(c).unwrap_or(255))
}

fn fail(dir: &Path, msg: String) -> ExitCode {
    eprintln!("suanli task-shim: {msg}");
    finish(dir, &ExitRecord { exit_code: Some(127), signal: None, finished_at: sys::now_s(), error: Some(msg) })
}

/// The shim's `main`.
pub fn run(a: ShimArgs) -> ExitCode {
    let dir = a.dir.clone();
    if !dir.is_dir() {
        eprintln!("suanli task-shim: --dir {}: not a directory", dir.display());
        return ExitCode::from(2);
    }
    // The lock proves to a restarted agent that this shim lives, whether or not the agent
    // that spawned it lived long enough to record it; an agent that took the lock first and
    // declared the task lost wins, and the command never runs.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let _lock = loop {
        match sys::try_lock(&dir.join(LOCK_FILE)) {
            Ok(Some(f)) => break f,
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                eprintln!("suanli task-shim: {} stayed locked for 10 s; not starting", dir.join(LOCK_FILE).display());
                return ExitCode::from(3);
            }
            Err(e) => {
                eprintln!("suanli task-shim: locking {}: {e}", dir.join(LOCK_FILE).display());
                return ExitCode::from(3);
            }
        }
    };
    if dir.join(ABANDONED_FILE).exists() || dir.join(EXIT_FILE).exists() {
        eprintln!("suanli task-shim: the agent declared this task lost before it started; not starting it");
        return ExitCode::from(3);
    }
    let me = i32::try_from(std::process::id()).ok().and_then(sys::ProcId::of);
    let written = me.map(|p| sys::write_atomic(&dir.join(SHIM_FILE), &serde_json::to_vec(&p).unwrap_or_default()));
    if !matches!(written, Some(Ok(()))) {
        return fail(&dir, format!("recording the shim's identity in {}: {written:?}", dir.join(SHIM_FILE).display()));
    }
    if let Err(e) = install_forwarding() {
        return fail(&dir, format!("installing signal handlers: {e}"));
    }
    if let Some(cg) = &a.cgroup {
        let procs = cg.join("cgroup.procs");
        if let Err(e) = std::fs::write(&procs, std::process::id().to_string()) {
            return fail(&dir, format!("joining cgroup {}: {e}", procs.display()));
        }
    }
    let workdir = a.workdir.clone().unwrap_or_else(|| dir.clone());
    let mut cmd = std::process::Command::new(&a.command);
    cmd.args(&a.args)
        .current_dir(&workdir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return fail(&dir, format!("cannot start {:?} in {}: {e}", a.command, workdir.display())),
    };
    CHILD.store(i32::try_from(child.id()).unwrap_or(0), Ordering::SeqCst);
    let pending = PENDING.swap(0, Ordering::SeqCst);
    if pending != 0 {
        on_signal(pending);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let mut copiers = 0;
    if let Some(out) = child.stdout.take()
        && copy_thread(out, RotatingLog::open(dir.join("stdout.log"), a.max_log_bytes), tx.clone()).is_ok()
    {
        copiers += 1;
    }
    if let Some(err) = child.stderr.take()
        && copy_thread(err, RotatingLog::open(dir.join("stderr.log"), a.max_log_bytes), tx.clone()).is_ok()
    {
        copiers += 1;
    }
    drop(tx);
    let status = match child.wait() {
        Ok(s) => s,
        Err(e) => return fail(&dir, format!("waiting for the task: {e}")),
    };
    // A background process of the task may keep a pipe open: give the copiers a moment to
    // drain what was written, not forever.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    for _ in 0..copiers {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if rx.recv_timeout(left).is_err() {
            break;
        }
    }
    finish(
        &dir,
        &ExitRecord { exit_code: status.code(), signal: status.signal(), finished_at: sys::now_s(), error: None },
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn log_rotates_at_its_limit() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("stdout.log");
        let mut l = RotatingLog::open(p.clone(), 10);
        l.write(b"12345678");
        l.write(b"abcdef");
        assert_eq!(std::fs::read(&p).unwrap(), b"abcdef");
        assert_eq!(std::fs::read(d.path().join("stdout.log.1")).unwrap(), b"12345678");
    }

    #[test]
    fn exit_codes() {
        let r = ExitRecord { exit_code: None, signal: Some(9), finished_at: 0, error: None };
        assert_eq!(r.code(), 137);
    }
}
