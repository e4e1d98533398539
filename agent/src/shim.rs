//! `suanli task-shim`: the small parent of every task. The agent starts it in a new session;
//! it joins the task's cgroup (when there is one), starts the command, copies its stdout and
//! stderr into size-bounded log files, forwards SIGTERM/SIGINT/SIGHUP to it, waits, and writes
//! `exit.json` atomically before it exits. Because the shim, not the agent, is the task's
//! parent, the agent can be restarted while tasks run and learn afterwards how each one ended.
//!
//! With `--journal` it appends a start and a stop line to the node's task journal (identity
//! from `D/alloc.json`, see [`crate::journal`]); with `--lease` it fences the task: it does not
//! start it without a fresh lease, and signals it when the lease expires (see [`crate::lease`]).
//! A federated task's directory holds its federation lease (`D/fed-lease`): the shim does not
//! start it from the lease's deadline on, and stops it at that deadline (see [`crate::fedlease`]).
//!
//! ```text
//!  agent ──spawn (setsid)──▶ task-shim --dir D [--journal J] [--lease L] ──spawn──▶ command args…
//!                               │  lease L stale? ──▶ not started: exit.json "fenced before start: …"
//!                               │  started ──▶ J += start line
//!                               │  stdout/stderr pipes ──▶ D/stdout.log, D/stderr.log (rotated)
//!                               │  every 200 ms: L older than F ──▶ SIGTERM group; F + G ──▶ SIGKILL
//!                               │  every 200 ms: D/fed-lease past its deadline ──▶ checkpoint signal, SIGTERM, SIGKILL
//!                               └─ on exit ──▶ J += stop line ──▶ D/exit.json {exit_code, signal, fenced, …}
//! ```

use crate::fedlease::{FedAction, FedFence, FedLease};
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

/// The space of `exit.json`, reserved by the shim when it starts (see [`EXIT_FILE_BYTES`]).
pub const EXIT_RESERVED_FILE: &str = ".exit.json.reserved";
/// Bytes reserved for `exit.json`; a longer record (a very long error) needs free space.
pub const EXIT_FILE_BYTES: usize = 16 * 1024;
/// The task's log files, which [`ShimArgs::max_log_bytes`] bounds and the disk quota does not
/// count.
pub const LOG_FILES: [&str; 4] = ["stdout.log", "stdout.log.1", "stderr.log", "stderr.log.1"];
/// How often the task's directory is measured against its disk quota.
pub const DISK_CHECK_EVERY: Duration = Duration::from_secs(2);
/// Entries looked at per measure (a task with more is measured in part).
pub const DISK_MAX_ENTRIES: usize = 100_000;
/// Grace between SIGTERM and SIGKILL of a task over its disk quota.
pub const DISK_KILL_GRACE: Duration = Duration::from_secs(5);

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
    /// fenced before start), or was killed for exceeding its disk quota.
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
    /// The task cgroup's `oom_kill` count (memory.events) when the task ended: above 0, the
    /// kernel's OOM killer killed a process of the task (none: no cgroup, or unreadable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kills: Option<u64>,
    /// How the end is classified when the agent knows better than the exit status (e.g.
    /// `node_lost` when the node could not fetch the checkpoint to restore); none: from the
    /// exit status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<String>,
    /// The task's federation lease ran out: the shim did not start it, or stopped it; the
    /// report's message ("federation lease ended at …"). The task is reported STOPPED.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fed_stop: Option<String>,
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
    /// Working directory of the command (default: `dir`); made when it lies inside `dir`.
    pub workdir: Option<PathBuf>,
    /// The node's task journal: append a start and a stop line (identity from `dir/alloc.json`).
    pub journal: Option<PathBuf>,
    /// The agent's lease file: fence the task by it (none: never fenced).
    pub lease: Option<PathBuf>,
    /// Disk quota of the task's files in `dir` (its logs not counted), bytes; 0: none.
    pub disk_max_bytes: u64,
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
    /// A federated job's global id (absent in files of older agents).
    #[serde(default)]
    global_id: String,
    /// Its federation epoch.
    #[serde(default)]
    fed_epoch: u64,
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
            global_id: self.global_id.clone(),
            fed_epoch: self.fed_epoch,
            reason: String::new(),
        }
    }
}

/// Appends to the journal when there is one, with `reason` (empty: none); a failure is logged
/// (to `shim.log`), the task goes on.
fn journal(path: Option<&PathBuf>, id: Option<&Identity>, event: JournalEvent, at_ms: u64, reason: String) {
    if let (Some(p), Some(id)) = (path, id)
        && let Err(e) = crate::journal::append(p, &JournalEntry { reason, ..id.entry(event, at_ms) })
    {
        say(format_args!("appending to the journal {}: {e}", p.display()));
    }
}

/// Writes one line to the shim's stderr (`shim.log`, in the allocation directory). A failed
/// write (a full disk) is ignored: `eprintln!` would panic there and take the task's
/// supervision down with it.
fn say(msg: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "suanli task-shim: {msg}");
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

extern "C" fn on_checkpoint_signal(_sig: libc::c_int) {}

/// Signals a task may be asked to checkpoint with, that the shim does not forward: the agent
/// sends them to the whole process group (the task's processes get them directly), and the
/// shim must not die of them. Caught by a no-op handler, not ignored: an ignored signal stays
/// ignored in the child across exec, a caught one is reset to its default.
const CHECKPOINT_SIGNALS: [libc::c_int; 2] = [libc::SIGUSR1, libc::SIGUSR2];

#[allow(unsafe_code)]
fn install_forwarding() -> std::io::Result<()> {
    for sig in CHECKPOINT_SIGNALS {
        // SAFETY: as below; the handler does nothing.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_checkpoint_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
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

/// A log file that rotates to `<name>.1` when it would grow past its limit. A write that fails
/// (a full disk) never stalls or kills the task: on ENOSPC the older half (`<name>.1`) is given
/// up to keep the newest output; what still cannot be written is dropped, and the next write
/// that succeeds is preceded by a marker line saying how much was lost and why.
struct RotatingLog {
    path: PathBuf,
    file: Option<std::fs::File>,
    size: u64,
    max: u64,
    /// Bytes dropped since the last successful write, and the first error.
    dropped: u64,
    dropped_why: String,
}

impl RotatingLog {
    fn open(path: PathBuf, max: u64) -> RotatingLog {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path).ok();
        let size = file.as_ref().and_then(|f| f.metadata().ok()).map_or(0, |m| m.len());
        RotatingLog { path, file, size, max, dropped: 0, dropped_why: String::new() }
    }

    fn rotated(&self) -> PathBuf {
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        PathBuf::from(old)
    }

    fn rotate(&mut self) {
        let _ = std::fs::rename(&self.path, self.rotated());
        self.file = std::fs::OpenOptions::new().create(true).append(true).truncate(false).open(&self.path).ok();
        self.size = 0;
    }

    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        let Some(f) = self.file.as_mut() else {
            return Err(std::io::Error::other("the log file could not be opened"));
        };
        let r = f.write_all(data);
        // A failed write may have written part: count what the file holds.
        self.size = if r.is_ok() { self.size + data.len() as u64 } else { f.metadata().map_or(self.size, |m| m.len()) };
        r
    }

    fn write(&mut self, data: &[u8]) {
        let marker = (self.dropped > 0)
            .then(|| format!("\n[suanli task-shim: {} bytes of output dropped: {}]\n", self.dropped, self.dropped_why));
        let need = data.len() as u64 + marker.as_ref().map_or(0, |m| m.len() as u64);
        if self.size > 0 && self.size + need > self.max {
            self.rotate();
        }
        if self.file.is_none() {
            // Opening failed earlier (a full disk): try again.
            self.file = std::fs::OpenOptions::new().create(true).append(true).open(&self.path).ok();
            self.size = self.file.as_ref().and_then(|f| f.metadata().ok()).map_or(0, |m| m.len());
        }
        let mut r = match &marker {
            Some(m) => self.append(m.as_bytes()).and_then(|()| self.append(data)),
            None => self.append(data),
        };
        if matches!(&r, Err(e) if e.raw_os_error() == Some(libc::ENOSPC)) && self.rotated().exists() {
            // Keep the newest output: the older half goes.
            let _ = std::fs::remove_file(self.rotated());
            r = self.append(data);
        }
        match r {
            Ok(()) => {
                self.dropped = 0;
                self.dropped_why.clear();
            }
            Err(e) => {
                if self.dropped == 0 {
                    say(format_args!(
                        "writing {}: {e}; output is dropped until it can be written",
                        self.path.display()
                    ));
                    self.dropped_why = e.to_string();
                }
                self.dropped = self.dropped.saturating_add(data.len() as u64);
            }
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

/// Reserves the space of `exit.json` while the disk has room: `.exit.json.reserved`, written at
/// full size when the shim starts, is rewritten in place and renamed to `exit.json` at the end,
/// so a task that filled the disk still leaves its exit status.
fn reserve_exit(dir: &Path) {
    let p = dir.join(EXIT_RESERVED_FILE);
    if let Err(e) = sys::write_padded(&p, b"{}", EXIT_FILE_BYTES).and_then(|()| std::fs::File::open(&p)?.sync_all()) {
        say(format_args!("reserving {}: {e}; exit.json will need free space", p.display()));
    }
}

fn write_exit(dir: &Path, data: &[u8]) -> std::io::Result<()> {
    sys::write_reserved(&dir.join(EXIT_FILE), &dir.join(EXIT_RESERVED_FILE), data, EXIT_FILE_BYTES)
}

fn finish(dir: &Path, rec: &ExitRecord) -> ExitCode {
    let data = serde_json::to_vec(rec).unwrap_or_default();
    if let Err(e) = write_exit(dir, &data) {
        say(format_args!("writing {}: {e}", dir.join(EXIT_FILE).display()));
    }
    let c = rec.code().clamp(0, 255);
    ExitCode::from(u8::try_from(c).unwrap_or(255))
}

fn fail(dir: &Path, msg: String) -> ExitCode {
    fail_as(dir, msg, false)
}

fn fail_as(dir: &Path, msg: String, fenced: bool) -> ExitCode {
    say(format_args!("{msg}"));
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
        say(format_args!("--dir {}: not a directory", dir.display()));
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
                say(format_args!("{} stayed locked for 10 s; not starting", dir.join(LOCK_FILE).display()));
                return ExitCode::from(3);
            }
            Err(e) => {
                say(format_args!("locking {}: {e}", dir.join(LOCK_FILE).display()));
                return ExitCode::from(3);
            }
        }
    };
    if dir.join(ABANDONED_FILE).exists() || dir.join(EXIT_FILE).exists() {
        say(format_args!("the agent declared this task lost before it started; not starting it"));
        return ExitCode::from(3);
    }
    reserve_exit(&dir);
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
    let fed_path = dir.join(crate::fedlease::FED_LEASE_FILE);
    let mut fed = match FedLease::read(&fed_path) {
        Ok(None) => None,
        Ok(Some(l)) => match l.may_start(sys::now_ms()) {
            Ok(()) => Some(FedFence::new(l)),
            Err(why) => {
                say(format_args!("{why}"));
                return finish(
                    &dir,
                    &ExitRecord {
                        exit_code: Some(127),
                        finished_at: sys::now_s(),
                        error: Some(why.clone()),
                        finished_at_ms: Some(sys::now_ms()),
                        fenced: true,
                        fed_stop: Some(why),
                        ..ExitRecord::default()
                    },
                );
            }
        },
        // Unreadable: the task cannot be fenced by it, so it does not start.
        Err(e) => return fail_as(&dir, format!("not started: {e}"), true),
    };
    let workdir = a.workdir.clone().unwrap_or_else(|| dir.clone());
    // A relative `workdir` of the job spec lands inside the allocation directory: it is the
    // task's own, so it is made here. An absolute one must exist on the node.
    if workdir.starts_with(&dir)
        && !workdir.is_dir()
        && let Err(e) = std::fs::create_dir_all(&workdir)
    {
        return fail(&dir, format!("creating the workdir {}: {e}", workdir.display()));
    }
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
    journal(a.journal.as_ref(), identity.as_ref(), JournalEvent::Start { pid }, started_at_ms, String::new());
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
    let mut quota = (a.disk_max_bytes > 0).then(|| Quota::new(a.disk_max_bytes));
    let waited = match (fence.as_mut(), quota.as_mut(), fed.as_mut()) {
        (None, None, None) => child.wait(),
        (fence, quota, fed) => supervise(&mut child, pid, &dir, Guards { fence, quota, fed }, &mut fenced_at_ms),
    };
    let status = match waited {
        Ok(s) => s,
        Err(e) => return fail(&dir, format!("waiting for the task: {e}")),
    };
    let finished_at_ms = sys::now_ms();
    let fenced = fenced_at_ms.is_some();
    // Stopped for its federation lease (and not fenced for the node's lease before).
    let fed_stopped = fed.as_ref().filter(|f| f.stopping()).map(FedFence::lease);
    let over_quota = quota.and_then(|q| q.exceeded);
    if fenced || over_quota.is_some() {
        // No agent may be there to clean up: what the task left in its group goes now.
        sys::signal_group_but_self(0, libc::SIGKILL);
    }
    journal(
        a.journal.as_ref(),
        identity.as_ref(),
        JournalEvent::Stop { exit_code: status.code(), signal: status.signal(), fenced },
        finished_at_ms,
        fed_stopped.map(FedLease::journal_reason).unwrap_or_default(),
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
            error: over_quota,
            started_at_ms: Some(started_at_ms),
            finished_at_ms: Some(finished_at_ms),
            fenced,
            fenced_at_ms,
            oom_kills: a.cgroup.as_deref().and_then(oom_kills),
            end: None,
            fed_stop: fed_stopped.map(FedLease::ended_message),
        },
    )
}

/// The `oom_kill` count of a cgroup v2 directory's `memory.events`.
pub fn oom_kills(cgroup: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(cgroup.join("memory.events")).ok()?;
    parse_oom_kills(&text)
}

/// The `oom_kill` line of a `memory.events` text.
pub fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("oom_kill ").and_then(|v| v.trim().parse().ok()))
}

/// The task's disk quota: its directory (logs not counted) is measured every
/// [`DISK_CHECK_EVERY`]; over the limit, SIGTERM to its group, SIGKILL [`DISK_KILL_GRACE`] later.
struct Quota {
    max: u64,
    next_at: std::time::Instant,
    kill_at: Option<std::time::Instant>,
    killed: bool,
    /// Why the task was stopped: "disk quota exceeded: …".
    exceeded: Option<String>,
}

impl Quota {
    fn new(max: u64) -> Quota {
        Quota { max, next_at: std::time::Instant::now(), kill_at: None, killed: false, exceeded: None }
    }

    fn step(&mut self, dir: &Path, pid: i32) {
        let now = std::time::Instant::now();
        match self.kill_at {
            Some(k) if !self.killed && now >= k => {
                say(format_args!("the task over its disk quota outlived its grace: SIGKILL"));
                sys::signal_group_but_self(pid, libc::SIGKILL);
                self.killed = true;
            }
            Some(_) => {}
            None if now >= self.next_at => {
                self.next_at = now + DISK_CHECK_EVERY;
                let used = sys::dir_usage(dir, &LOG_FILES, DISK_MAX_ENTRIES);
                if used > self.max {
                    let why = format!("disk quota exceeded: {used} bytes > task_disk_max_bytes = {}", self.max);
                    say(format_args!("{why}: SIGTERM"));
                    sys::signal_group_but_self(pid, libc::SIGTERM);
                    self.exceeded = Some(why);
                    self.kill_at = Some(now + DISK_KILL_GRACE);
                }
            }
            None => {}
        }
    }

    fn next_check(&self) -> Option<Duration> {
        let now = std::time::Instant::now();
        match self.kill_at {
            Some(_) if self.killed => None,
            Some(k) => Some(k.saturating_duration_since(now) + Duration::from_millis(1)),
            None => Some(self.next_at.saturating_duration_since(now) + Duration::from_millis(1)),
        }
    }
}

/// What [`supervise`] watches besides the command.
struct Guards<'a> {
    /// The node lease, and its file.
    fence: Option<&'a mut (Fence, PathBuf)>,
    /// The task's disk quota.
    quota: Option<&'a mut Quota>,
    /// The task's federation lease (its file is `dir/fed-lease`).
    fed: Option<&'a mut FedFence>,
}

/// Waits for the command while reading the lease every [`crate::lease::CHECK_EVERY`] (SIGTERM
/// to the task's group once the lease is older than F, SIGKILL once older than F + G),
/// measuring its disk use against its quota, and stopping it when its federation lease ends.
fn supervise(
    child: &mut std::process::Child,
    pid: i32,
    dir: &Path,
    guards: Guards<'_>,
    fenced_at_ms: &mut Option<u64>,
) -> std::io::Result<std::process::ExitStatus> {
    let Guards { mut fence, mut quota, mut fed } = guards;
    let fed_path = dir.join(crate::fedlease::FED_LEASE_FILE);
    let pidfd = sys::pidfd_open(pid);
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        let mut next: Option<Duration> = None;
        if let Some((fence, lease)) = fence.as_deref_mut() {
            let now = sys::boottime_ms();
            match fence.step(Lease::read(lease), now) {
                FenceAction::Nothing => {}
                FenceAction::Term => {
                    say(format_args!("fencing the task: {}: SIGTERM", fence.why().unwrap_or("lease expired")));
                    *fenced_at_ms = Some(sys::now_ms());
                    sys::signal_group_but_self(pid, libc::SIGTERM);
                }
                FenceAction::Kill => {
                    say(format_args!("the fenced task outlived its kill grace: SIGKILL"));
                    sys::signal_group_but_self(pid, libc::SIGKILL);
                }
            }
            next = fence.next_check(sys::boottime_ms());
        }
        if let Some(f) = fed.as_deref_mut() {
            // The wall clock, as the lease's end is a time of the federation's clock (see
            // crate::fedlease); a renewal that cannot be read keeps the last lease.
            let renewal = match FedLease::read(&fed_path) {
                Ok(l) => l,
                Err(e) => {
                    say(format_args!("{e}; keeping the last federation lease"));
                    None
                }
            };
            let now = sys::now_ms();
            match f.step(renewal, now) {
                FedAction::Nothing => {}
                FedAction::Checkpoint(sig) => {
                    say(format_args!("{}: checkpoint signal {sig}", f.lease().journal_reason()));
                    fenced_at_ms.get_or_insert(now);
                    sys::signal_group_but_self(pid, sig);
                }
                FedAction::Term => {
                    say(format_args!("{}: SIGTERM", f.lease().journal_reason()));
                    fenced_at_ms.get_or_insert(now);
                    sys::signal_group_but_self(pid, libc::SIGTERM);
                }
                FedAction::Kill => {
                    say(format_args!("the task outlived its federation lease's kill grace: SIGKILL"));
                    sys::signal_group_but_self(pid, libc::SIGKILL);
                }
            }
            let n = f.next_check(sys::now_ms());
            next = match (next, n) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        if let Some(q) = quota.as_deref_mut() {
            q.step(dir, pid);
            next = match (next, q.next_check()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        sys::wait_exit(pidfd.as_ref(), next);
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
    fn log_drops_output_it_cannot_write_and_says_so() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("stdout.log");
        let mut l = RotatingLog::open(p.clone(), 1 << 20);
        l.write(b"kept\n");
        // Every write fails with ENOSPC, as on a full disk: dropped, no panic, no stall.
        l.file = std::fs::OpenOptions::new().append(true).open("/dev/full").ok();
        l.write(b"lost 1\n");
        l.write(b"lost 22\n");
        assert_eq!(l.dropped, 15);
        // Space again: the marker line comes first.
        l.file = std::fs::OpenOptions::new().append(true).open(&p).ok();
        l.write(b"back\n");
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(
            text,
            "kept\n\n[suanli task-shim: 15 bytes of output dropped: No space left on device (os error 28)]\nback\n"
        );
    }

    #[test]
    fn log_gives_up_its_older_half_on_a_full_disk() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("stdout.log");
        std::fs::write(d.path().join("stdout.log.1"), b"old").unwrap();
        let mut l = RotatingLog::open(p, 1 << 20);
        l.file = std::fs::OpenOptions::new().append(true).open("/dev/full").ok();
        l.write(b"x");
        assert!(!d.path().join("stdout.log.1").exists(), "the older half went to make room");
    }

    #[test]
    fn exit_codes() {
        let r = ExitRecord { signal: Some(9), ..ExitRecord::default() };
        assert_eq!(r.code(), 137);
    }

    #[test]
    fn oom_kills_come_from_memory_events() {
        let text = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kills(text), Some(2));
        assert_eq!(parse_oom_kills("low 0\n"), None);
    }
}
