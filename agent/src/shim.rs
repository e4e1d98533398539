//! `suanli task-shim`: the small parent of every task. The agent starts it in a new session;
//! it joins the task's cgroup (when there is one), starts the command, copies its stdout and
//! stderr into size-bounded log files, forwards SIGTERM/SIGINT/SIGHUP to it, waits, and writes
//! `exit.json` atomically before it exits. Because the shim, not the agent, is the task's
//! parent, the agent can be restarted while tasks run and learn afterwards how each one ended.
//!
//! With `--journal` it appends a start and a stop line to the node's task journal (identity
//! from `D/alloc.json`, see [`crate::journal`]); with `--lease` it fences the task: it does not
//! start it without a fresh lease, and signals it when the lease expires (see [`crate::lease`]).
//!
//! ```text
//!  agent ──spawn (setsid)──▶ task-shim --dir D [--journal J] [--lease L] ──spawn──▶ command args…
//!                               │  lease L stale? ──▶ not started: exit.json "fenced before start: …"
//!                               │  started ──▶ J += start line
//!                               │  stdout/stderr pipes ──▶ D/stdout.log, D/stderr.log (rotated)
//!                               │  every 200 ms: L older than F ──▶ SIGTERM group; F + G ──▶ SIGKILL
//!                               └─ on exit ──▶ J += stop line ──▶ D/exit.json {exit_code, signal, fenced, …}
//! ```

use crate::journal::{JournalDevice, JournalEntry, JournalEvent};
use crate::lease::{Fence, FenceAction, Lease};
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

/// The allocation file the agent writes before it spawns the shim (the task's identity).
pub const ALLOC_FILE: &str = "alloc.json";

/// How the task ended (`exit.json`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    /// The command's exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// Seconds since the Unix epoch.
    pub finished_at: u64,
    /// Set when the command could not be started at all (not found, bad workdir, cgroup,
    /// fenced before start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the command was spawned, milliseconds since the Unix epoch (none: never started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// When it ended (or the start failed), milliseconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// The shim fenced the task: it did not start it, or signalled it, because the agent's
    /// lease had expired.
    #[serde(default)]
    pub fenced: bool,
    /// When the shim decided to fence a running task (its SIGTERM), ms since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced_at_ms: Option<u64>,
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
    /// The node's task journal: append a start and a stop line (identity from `dir/alloc.json`).
    pub journal: Option<PathBuf>,
    /// The agent's lease file: fence the task by it (none: never fenced).
    pub lease: Option<PathBuf>,
    /// The program.
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
}

/// The part of `alloc.json` the journal needs.
#[derive(Debug, Clone, Deserialize)]
struct Identity {
    id: u64,
    epoch: u64,
    job_id: u64,
    node: String,
    task: String,
    devices: Vec<JournalDevice>,
}

impl Identity {
    fn read(dir: &Path) -> Result<Identity, String> {
        let p = dir.join(ALLOC_FILE);
        let data = std::fs::read(&p).map_err(|e| format!("reading {}: {e}", p.display()))?;
        serde_json::from_slice(&data).map_err(|e| format!("{}: {e}", p.display()))
    }

    fn entry(&self, event: JournalEvent, at_ms: u64) -> JournalEntry {
        JournalEntry {
            event,
            node: self.node.clone(),
            alloc_id: self.id,
            epoch: self.epoch,
            job_id: self.job_id,
            task: self.task.clone(),
            devices: self.devices.clone(),
            at_ms,
        }
    }
}

/// Appends to the journal when there is one; a failure is logged (to `shim.log`), the task
/// goes on.
fn journal(path: Option<&PathBuf>, id: Option<&Identity>, event: JournalEvent, at_ms: u64) {
    if let (Some(p), Some(id)) = (path, id)
        && let Err(e) = crate::journal::append(p, &id.entry(event, at_ms))
    {
        eprintln!("suanli task-shim: appending to the journal {}: {e}", p.display());
    }
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
    fail_as(dir, msg, false)
}

fn fail_as(dir: &Path, msg: String, fenced: bool) -> ExitCode {
    eprintln!("suanli task-shim: {msg}");
    finish(
        dir,
        &ExitRecord {
            exit_code: Some(127),
            finished_at: sys::now_s(),
            error: Some(msg),
            finished_at_ms: Some(sys::now_ms()),
            fenced,
            ..ExitRecord::default()
        },
    )
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
    let identity = match &a.journal {
        Some(_) => match Identity::read(&dir) {
            Ok(i) => Some(i),
            Err(e) => return fail(&dir, format!("the task's identity for the journal: {e}")),
        },
        None => None,
    };
    let mut fence = None;
    if let Some(path) = &a.lease {
        let mut f = Fence::new(sys::boot_id());
        if let Err(why) = f.may_start(Lease::read(path), sys::boottime_ms()) {
            return fail_as(&dir, format!("fenced before start: {why}"), true);
        }
        fence = Some((f, path.clone()));
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
    let started_at_ms = sys::now_ms();
    let pid = i32::try_from(child.id()).unwrap_or(0);
    CHILD.store(pid, Ordering::SeqCst);
    let pending = PENDING.swap(0, Ordering::SeqCst);
    if pending != 0 {
        on_signal(pending);
    }
    journal(a.journal.as_ref(), identity.as_ref(), JournalEvent::Start { pid }, started_at_ms);
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
    let mut fenced_at_ms = None;
    let waited = match fence.as_mut() {
        None => child.wait(),
        Some((f, path)) => wait_fenced(&mut child, pid, f, path, &mut fenced_at_ms),
    };
    let status = match waited {
        Ok(s) => s,
        Err(e) => return fail(&dir, format!("waiting for the task: {e}")),
    };
    let finished_at_ms = sys::now_ms();
    let fenced = fenced_at_ms.is_some();
    if fenced {
        // No agent may be there to clean up: what the task left in its group goes now.
        sys::signal_group_but_self(0, libc::SIGKILL);
    }
    journal(
        a.journal.as_ref(),
        identity.as_ref(),
        JournalEvent::Stop { exit_code: status.code(), signal: status.signal(), fenced },
        finished_at_ms,
    );
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
        &ExitRecord {
            exit_code: status.code(),
            signal: status.signal(),
            finished_at: sys::now_s(),
            error: None,
            started_at_ms: Some(started_at_ms),
            finished_at_ms: Some(finished_at_ms),
            fenced,
            fenced_at_ms,
        },
    )
}

/// Waits for the command while reading the lease every [`crate::lease::CHECK_EVERY`]: SIGTERM
/// to the task's group once the lease is older than F, SIGKILL once older than F + G.
fn wait_fenced(
    child: &mut std::process::Child,
    pid: i32,
    fence: &mut Fence,
    lease: &Path,
    fenced_at_ms: &mut Option<u64>,
) -> std::io::Result<std::process::ExitStatus> {
    let pidfd = sys::pidfd_open(pid);
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        let now = sys::boottime_ms();
        match fence.step(Lease::read(lease), now) {
            FenceAction::Nothing => {}
            FenceAction::Term => {
                eprintln!("suanli task-shim: fencing the task: {}: SIGTERM", fence.why().unwrap_or("lease expired"));
                *fenced_at_ms = Some(sys::now_ms());
                sys::signal_group_but_self(pid, libc::SIGTERM);
            }
            FenceAction::Kill => {
                eprintln!("suanli task-shim: the fenced task outlived its kill grace: SIGKILL");
                sys::signal_group_but_self(pid, libc::SIGKILL);
            }
        }
        sys::wait_exit(pidfd.as_ref(), fence.next_check(sys::boottime_ms()));
    }
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
        let r = ExitRecord { signal: Some(9), ..ExitRecord::default() };
        assert_eq!(r.code(), 137);
    }
}
