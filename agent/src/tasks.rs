//! Running allocations as OS processes, and never running one twice.
//!
//! Each allocation `(id, epoch)` gets the directory `<data_dir>/allocs/<id>-<epoch>/`. Its
//! existence means "started once": the agent never starts an allocation whose directory
//! exists. Inside it:
//!
//! | file | written by | meaning |
//! | --- | --- | --- |
//! | `alloc.json` | agent, before it spawns the shim | the allocation, the node, the task (the journal's identity) |
//! | `fed-lease` | agent, before it spawns the shim and on every renewal | a federated task's lease (see [`crate::fedlease`]) |
//! | `task.json` | agent, before it reports RUNNING | the shim's pid and start time, the job, when |
//! | `shim.lock` | shim | locked for the shim's whole life: held means the task runs |
//! | `shim.json` | shim, before the command starts | the shim's pid and start time |
//! | `abandoned` | agent | declared lost: a shim that starts late must not run the command |
//! | `stdout.log`, `stderr.log` (+ `.1`) | shim | the task's output, rotated at `max_log_bytes` |
//! | `shim.log` | shim | the shim's own errors |
//! | `stop.json` | agent, before it signals the task | a stop was asked for, and why |
//! | `.stop.json.reserved` | agent, with `alloc.json` | the space of `stop.json`, renamed into it (a full disk cannot lose a stop) |
//! | `exit.json` | shim (or agent, when it could not start) | how the task ended |
//! | `.exit.json.reserved` | shim, when it starts | the space of `exit.json`, renamed into it |
//! | `reported` | agent | the final status was acknowledged by the control plane |
//!
//! ```text
//!  set from the watch ─▶ reconcile ─┬─ new, desired run ─▶ reserve ─▶ mkdir ─▶ fresh lease? ─▶ spawn shim ─▶ task.json ─▶ RUNNING
//!                                   ├─ desired stop / gone ─▶ stop.json ─▶ SIGTERM group ─▶ grace ─▶ SIGKILL
//!                                   └─ dir exists, not ours in memory ─▶ recover (below)
//!  shim exits ─▶ exit.json ─▶ SUCCEEDED | FAILED (exit code N / killed by signal N / fenced: …) | STOPPED
//!  after a restart: exit.json ─▶ report it; shim.lock held ─▶ adopt; else `abandoned` + FAILED "lost: …"
//! ```

use crate::Agent;
use crate::config::AgentConfig;
use crate::control::Report;
use crate::shim::ExitRecord;
use crate::sys::{self, ProcId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use suanli_model::{DeviceKind, ShareIsolation};
use suanli_proto::v1 as pb;
use tokio::sync::watch;
use tracing::Instrument as _;

/// An allocation attempt: (allocation id, epoch).
pub(crate) type Key = (u64, u64);

/// The directory name of an allocation attempt.
pub fn dir_name(k: Key) -> String {
    format!("{}-{}", k.0, k.1)
}

/// Parses a directory name made by [`dir_name`].
pub fn parse_dir_name(s: &str) -> Option<Key> {
    let (a, e) = s.split_once('-')?;
    Some((a.parse().ok()?, e.parse().ok()?))
}

/// `task.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskRecord {
    /// Allocation id.
    pub alloc_id: u64,
    /// Epoch (the job's attempt).
    pub epoch: u64,
    /// Job id.
    pub job_id: u64,
    /// `<group>-<replica>`.
    pub task: String,
    /// The shim.
    pub shim: ProcId,
    /// Seconds since the Unix epoch.
    pub started_at: u64,
    /// The task's cgroup, when limits are enforced.
    #[serde(default)]
    pub cgroup: Option<String>,
    /// The team of the job's queue: whose members may read the task's logs (empty: none
    /// known; only admins and operators may).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub team: String,
}

/// `stop.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StopRecord {
    reason: String,
    /// Seconds since the Unix epoch.
    at: u64,
    /// Milliseconds since the Unix epoch (0 in records of older agents).
    #[serde(default)]
    at_ms: u64,
    /// A checkpoint-first stop: what came of asking for the checkpoint ("checkpoint at step
    /// 40", "no checkpoint within 30 s"); none: no checkpoint was asked for, or not yet known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checkpoint: Option<String>,
}

/// A request to stop a task.
#[derive(Debug, Clone)]
struct Stop {
    reason: String,
    /// Between SIGTERM and SIGKILL.
    grace: Duration,
    /// Ask for a checkpoint first.
    checkpoint: Option<CheckpointAsk>,
}

/// The checkpoint-first part of a stop: send `signal` to the task's process group, and wait up
/// to `wait` for a new checkpoint to be reported before the SIGTERM.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CheckpointAsk {
    signal: i32,
    name: &'static str,
    wait: Duration,
}

/// The checkpoint-first part of a stop the control plane asks for, when the allocation has a
/// checkpoint signal, a grace and `checkpoint_first` (the wait is bounded by
/// `stop_grace_max_ms`).
fn checkpoint_ask(cfg: &AgentConfig, a: &pb::AllocInfo) -> Option<CheckpointAsk> {
    if !a.checkpoint_first || a.grace_s == 0 {
        return None;
    }
    let sig = suanli_model::CheckpointSignal::parse(&a.checkpoint_signal)?;
    let signal = match sig {
        suanli_model::CheckpointSignal::Usr1 => libc::SIGUSR1,
        suanli_model::CheckpointSignal::Usr2 => libc::SIGUSR2,
        suanli_model::CheckpointSignal::Int => libc::SIGINT,
        suanli_model::CheckpointSignal::Term => libc::SIGTERM,
        suanli_model::CheckpointSignal::Hup => libc::SIGHUP,
    };
    let wait = Duration::from_millis(a.grace_s.saturating_mul(1000).min(cfg.stop_grace_max_ms));
    Some(CheckpointAsk { signal, name: sig.as_str(), wait })
}

/// What the manager remembers about an allocation it handles.
struct Entry {
    stop: watch::Sender<Option<Stop>>,
    ended: bool,
}

/// The task table.
#[derive(Default)]
pub(crate) struct Tasks {
    map: BTreeMap<Key, Entry>,
    /// Highest set revision applied (persisted in `<data_dir>/watch-revision`).
    max_rev: u64,
    /// Since when only sets older than `max_rev` arrive.
    stale_since: Option<Instant>,
    /// The cluster this node runs work for (persisted in `<data_dir>/cluster-id`; `None`
    /// before the first set that names one).
    cluster_id: Option<String>,
    /// Set while switching to another cluster: its id, and its latest set (applied once the
    /// old cluster's tasks have stopped and their directories are moved aside).
    switching: Option<(String, Option<pb::AllocationsUpdate>)>,
    /// The latest federation lease end heard of per allocation id (heartbeats, allocation
    /// sets): a task that starts after a renewal starts under it.
    fed_until: BTreeMap<u64, u64>,
}

impl Tasks {
    /// Allocations managed now (the agent's `/metrics`).
    pub(crate) fn count(&self) -> usize {
        self.map.len()
    }
}

fn lock(agent: &Agent) -> std::sync::MutexGuard<'_, Tasks> {
    agent.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn alloc_dir(agent: &Agent, k: Key) -> PathBuf {
    agent.cfg.allocs_dir().join(dir_name(k))
}

const REV_FILE: &str = "watch-revision";
/// The id of the cluster this node runs work for.
pub const CLUSTER_FILE: &str = "cluster-id";
/// Where the work of earlier clusters is moved: `<data_dir>/old-clusters/<id>-<unix s>/`.
pub const OLD_CLUSTERS_DIR: &str = "old-clusters";
/// The space of `stop.json`, reserved when the allocation directory is made.
const STOP_RESERVED_FILE: &str = ".stop.json.reserved";
/// Bytes reserved for `stop.json` (a reason is at most a few hundred bytes).
const STOP_FILE_BYTES: usize = 4096;

/// Loads the persisted revision and every allocation directory not yet finally reported:
/// running shims are adopted, ended ones get their final report queued, the rest are lost.
pub(crate) fn recover(agent: &Arc<Agent>) -> std::io::Result<()> {
    let rev = std::fs::read_to_string(agent.cfg.data_dir.join(REV_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    lock(agent).max_rev = rev;
    let cluster = std::fs::read_to_string(agent.cfg.data_dir.join(CLUSTER_FILE)).ok().map(|s| s.trim().to_owned());
    lock(agent).cluster_id = cluster.filter(|c| !c.is_empty());
    let mut keys = Vec::new();
    for e in std::fs::read_dir(agent.cfg.allocs_dir())? {
        let e = e?;
        if let Some(k) = e.file_name().to_str().and_then(parse_dir_name) {
            keys.push(k);
        }
    }
    keys.sort();
    for k in keys {
        let dir = alloc_dir(agent, k);
        if dir.join("reported").exists() {
            continue;
        }
        let entry = recover_one(agent, k, &dir);
        lock(agent).map.insert(k, entry);
    }
    Ok(())
}

fn ended_entry() -> Entry {
    Entry { stop: watch::channel(None).0, ended: true }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok())
}

/// Decides what to do with an allocation directory the agent has no task for in memory.
///
/// A live shim holds `shim.lock` for its whole life, so the lock (not a pid) says whether the
/// task still runs, even when the agent that spawned the shim died before writing `task.json`.
/// Without a live shim and without `exit.json` the task is lost; `abandoned` is written while
/// the lock is held so a shim that starts late never runs the command.
fn recover_one(agent: &Arc<Agent>, k: Key, dir: &Path) -> Entry {
    if dir.join("reported").exists() {
        return ended_entry();
    }
    let away = |r: Report| {
        tracing::info!(alloc = k.0, epoch = k.1, status = ?r.status, message = %r.message, "task ended while the agent was away");
        agent.reporter.enqueue(r);
        ended_entry()
    };
    if let Some(exit) = ExitRecord::read(dir) {
        return away(final_report(k, dir, Some(&exit), ""));
    }
    let rec: Option<TaskRecord> = read_json(&dir.join("task.json"));
    let job_id = rec.as_ref().map_or(0, |r| r.job_id);
    let lock = match sys::try_lock(&dir.join(crate::shim::LOCK_FILE)) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(alloc = k.0, epoch = k.1, error = %e, "cannot check the task's shim lock; reporting it lost");
            return away(final_report(k, dir, None, &format!("lost: cannot check whether its shim runs: {e}")));
        }
    };
    let Some(guard) = lock else {
        // A shim lives. It records its identity right after taking the lock.
        let mut shim: Option<ProcId> = None;
        for _ in 0..100 {
            shim = read_json(&dir.join(crate::shim::SHIM_FILE));
            if shim.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let Some(shim) = shim.or(rec.as_ref().map(|r| r.shim)) else {
            tracing::error!(
                alloc = k.0,
                epoch = k.1,
                "a shim holds the lock but recorded no identity; it cannot be watched"
            );
            return away(final_report(k, dir, None, "lost: its shim runs but recorded no identity"));
        };
        tracing::info!(alloc = k.0, epoch = k.1, job_id, pid = shim.pid, "adopting a running task");
        let (tx, rx) = watch::channel(None);
        agent.reporter.enqueue(Report::running(k.0, k.1, "adopted after an agent restart".into()));
        let a = agent.clone();
        let dir = dir.to_owned();
        let span = tracing::info_span!("task", alloc = k.0, epoch = k.1, job_id);
        tokio::spawn(
            async move {
                // The plugin hosts started with this agent: tell them the running task's
                // reservation again (a plugin enforcing shares must count it).
                rereserve_adopted(&a, k, &dir).await;
                supervise(a, k, dir, Waiter::Adopted(shim), shim.pid, rx).await
            }
            .instrument(span),
        );
        return Entry { stop: tx, ended: false };
    };
    // No shim lives: it may have finished just before we looked.
    if let Some(exit) = ExitRecord::read(dir) {
        return away(final_report(k, dir, Some(&exit), ""));
    }
    if let Err(e) = sys::write_atomic(&dir.join(crate::shim::ABANDONED_FILE), b"lost\n") {
        tracing::warn!(alloc = k.0, epoch = k.1, error = %e, "writing the abandoned marker");
    }
    drop(guard);
    let shim: Option<ProcId> = read_json(&dir.join(crate::shim::SHIM_FILE));
    let lost = match shim {
        Some(p) => {
            format!("lost: its shim (pid {}) is gone and recorded no exit status; it is not started again", p.pid)
        }
        None => "lost: the agent stopped while starting the task, before its command started; it is not started again"
            .into(),
    };
    tracing::warn!(alloc = k.0, epoch = k.1, "{lost}");
    agent.reporter.enqueue(final_report(k, dir, None, &lost));
    ended_entry()
}

/// The devices of an adopted task, from its `alloc.json`, reserved again under its reservation id.
async fn rereserve_adopted(agent: &Agent, k: Key, dir: &Path) {
    #[derive(serde::Deserialize)]
    struct Dev {
        device: String,
        #[serde(default)]
        milli: u32,
        #[serde(default)]
        memory_mib: u64,
    }
    #[derive(serde::Deserialize)]
    struct AllocFile {
        #[serde(default)]
        devices: Vec<Dev>,
    }
    let Some(f) = read_json::<AllocFile>(&dir.join(crate::shim::ALLOC_FILE)) else { return };
    if f.devices.is_empty() {
        return;
    }
    let shares: Vec<_> = f
        .devices
        .into_iter()
        .map(|d| suanli_device_host::pb::ReserveShare { device_id: d.device, milli: d.milli, memory_mib: d.memory_mib })
        .collect();
    if let Err(e) = agent.plugins.reserve(&crate::plugins::reservation_id(k.0, k.1), k.0, &shares).await {
        tracing::warn!(alloc = k.0, epoch = k.1, error = %e, "the adopted task's devices could not be reserved again");
    }
}

/// The report message of a fenced task.
fn fenced_message(e: &ExitRecord) -> String {
    if let Some(err) = &e.error {
        let why = err.strip_prefix("fenced before start: ").unwrap_or(err);
        return format!("fenced: not started: {why}");
    }
    let how = match (e.exit_code, e.signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        (None, None) => "ended".to_owned(),
    };
    format!("fenced: the node lost its lease (no heartbeat acknowledged by the control plane in time); {how}")
}

/// The final report for an ended task: a requested stop wins (unless the task was fenced
/// before the stop was asked for), then a fence, then how it exited; `lost` is the message when
/// nothing is known. Its end class is [`end_class`]'s.
fn final_report(k: Key, dir: &Path, exit: Option<&ExitRecord>, lost: &str) -> Report {
    let stop: Option<StopRecord> =
        std::fs::read(dir.join("stop.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let device_error = dir.join(crate::ckpt::DEVICE_ERROR_FILE).exists();
    // Stopped (or not started) for its federation lease, unless the control plane asked for a
    // stop first: STOPPED, the federation re-dispatches it.
    if let Some(e) = exit
        && let Some(msg) = &e.fed_stop
    {
        let fenced_at = e.fenced_at_ms.or(e.finished_at_ms).unwrap_or(e.finished_at.saturating_mul(1000));
        let stop_first = stop.as_ref().is_some_and(|s| {
            let at = if s.at_ms > 0 { s.at_ms } else { s.at.saturating_mul(1000) };
            at <= fenced_at
        });
        if !stop_first {
            return Report {
                alloc: k.0,
                epoch: k.1,
                status: pb::AllocReport::Stopped,
                message: msg.clone(),
                exit_code: e.code(),
                end: "stopped",
                exit_code_set: false,
            };
        }
    }
    if let Some(e) = exit.filter(|e| e.fenced) {
        let fenced_at = e.fenced_at_ms.or(e.finished_at_ms).unwrap_or(e.finished_at.saturating_mul(1000));
        let stop_first = stop.as_ref().is_some_and(|s| {
            let at = if s.at_ms > 0 { s.at_ms } else { s.at.saturating_mul(1000) };
            e.error.is_none() && at <= fenced_at
        });
        if !stop_first {
            return Report {
                alloc: k.0,
                epoch: k.1,
                status: pb::AllocReport::Failed,
                message: fenced_message(e),
                exit_code: e.code(),
                end: "node_lost",
                exit_code_set: false,
            };
        }
    }
    let (end, exit_code_set) = end_class(stop.as_ref().map(|s| s.reason.as_str()), exit, device_error);
    let (status, message, exit_code) = match (stop, exit) {
        (Some(s), e) => {
            let how = match e {
                Some(ExitRecord { exit_code: Some(c), .. }) => format!(" (exit code {c})"),
                Some(ExitRecord { signal: Some(s), .. }) => format!(" (killed by signal {s})"),
                _ => String::new(),
            };
            let ck = s.checkpoint.map(|c| format!("; {c}")).unwrap_or_default();
            (pb::AllocReport::Stopped, format!("stopped: {}{how}{ck}", s.reason), e.map_or(0, ExitRecord::code))
        }
        (None, Some(e)) if e.error.is_some() => {
            (pb::AllocReport::Failed, e.error.clone().unwrap_or_default(), e.code())
        }
        (None, Some(e)) => match (e.exit_code, e.signal) {
            (Some(0), _) => (pb::AllocReport::Succeeded, "exit code 0".into(), 0),
            (Some(c), _) => (pb::AllocReport::Failed, format!("exit code {c}"), c),
            (None, Some(s)) if end == "oom" => {
                (pb::AllocReport::Failed, format!("killed by signal {s} (out of memory)"), 128 + s)
            }
            (None, Some(s)) => (pb::AllocReport::Failed, format!("killed by signal {s}"), 128 + s),
            (None, None) => (pb::AllocReport::Failed, "ended without an exit status".into(), e.code()),
        },
        (None, None) => (pb::AllocReport::Failed, lost.to_owned(), -1),
    };
    let liveness = std::fs::read_to_string(dir.join(crate::probe::LIVENESS_FILE)).ok();
    let message = if end == "device_error" && status == pb::AllocReport::Failed {
        let which = std::fs::read_to_string(dir.join(crate::ckpt::DEVICE_ERROR_FILE)).unwrap_or_default();
        format!("{message}; a device turned unhealthy while it ran: {}", which.trim())
    } else if let Some(why) = liveness.filter(|_| status == pb::AllocReport::Failed) {
        format!("liveness check failed ({}): {message}", why.trim())
    } else {
        message
    };
    Report { alloc: k.0, epoch: k.1, status, message, exit_code, end, exit_code_set }
}

/// How a task's end is classified (pure; fences are decided before): the end class, and
/// whether its exit code is the task's own.
///
/// - stopped as asked: `stopped`, or `device_error` when the control plane stopped it because
///   a device turned unhealthy;
/// - not started: `start_failed` (or the class the agent recorded, e.g. `node_lost` when the
///   checkpoint to restore from could not be fetched);
/// - exit code 0: `succeeded` (even when a device turned unhealthy meanwhile);
/// - a device of the allocation turned unhealthy while it ran: `device_error`;
/// - killed by a signal while its cgroup counted an OOM kill: `oom`;
/// - any other exit code or signal the agent did not send: `exit`;
/// - nothing recorded (the shim is gone): `node_lost`.
fn end_class(stop_reason: Option<&str>, exit: Option<&ExitRecord>, device_error: bool) -> (&'static str, bool) {
    let own_code = exit.is_some_and(|e| e.exit_code.is_some() && e.error.is_none());
    if let Some(reason) = stop_reason {
        let end = if reason == "device_unhealthy" { "device_error" } else { "stopped" };
        return (end, own_code);
    }
    let Some(e) = exit else { return ("node_lost", false) };
    if let Some(end) = e.end.as_deref().and_then(known_end) {
        return (end, false);
    }
    if e.error.is_some() {
        // Killed by the shim for its disk quota after it started; else it never started.
        return if e.started_at_ms.is_some() { ("exit", false) } else { ("start_failed", false) };
    }
    match (e.exit_code, e.signal) {
        (Some(0), _) => ("succeeded", true),
        _ if device_error => ("device_error", own_code),
        (Some(_), _) => ("exit", true),
        (None, Some(_)) if e.oom_kills.is_some_and(|n| n > 0) => ("oom", false),
        _ => ("exit", false),
    }
}

/// The end class named `s`, if the agent may report it.
fn known_end(s: &str) -> Option<&'static str> {
    ["succeeded", "exit", "oom", "start_failed", "device_error", "node_lost", "stopped"].into_iter().find(|x| *x == s)
}

/// Called by the reporter once a final report is acknowledged (or refused for good).
pub(crate) fn mark_reported(agent: &Agent, k: Key, r: &Report) {
    let dir = alloc_dir(agent, k);
    if dir.is_dir() {
        let text = format!("{:?} {}\n", r.status, r.message);
        if let Err(e) = sys::write_atomic(&dir.join("reported"), text.as_bytes()) {
            // A full disk: an empty marker needs no data block, and says the same.
            if let Err(e2) = std::fs::File::create(dir.join("reported")) {
                tracing::warn!(alloc = k.0, epoch = k.1, error = %e, again = %e2, "writing the reported marker");
            }
        }
    }
}

fn persist_rev(agent: &Agent, rev: u64) {
    if let Err(e) = sys::write_atomic(&agent.cfg.data_dir.join(REV_FILE), rev.to_string().as_bytes()) {
        tracing::warn!(error = %e, "persisting the watch revision");
    }
}

fn grace(cfg: &AgentConfig, grace_s: u64) -> Duration {
    let ms = grace_s.saturating_mul(1000).max(cfg.stop_grace_min_ms).min(cfg.stop_grace_max_ms);
    Duration::from_millis(ms)
}

fn request_stop(e: &Entry, reason: String, grace: Duration, checkpoint: Option<CheckpointAsk>) {
    if e.ended || e.stop.borrow().is_some() {
        return;
    }
    e.stop.send_replace(Some(Stop { reason, grace, checkpoint }));
}

/// Applies every new allocation set, forever.
pub(crate) async fn manage(agent: Arc<Agent>, mut rx: watch::Receiver<Option<pb::AllocationsUpdate>>) {
    let mut stop = agent.stop.clone();
    loop {
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            _ = stop.changed() => return,
        }
        let update = rx.borrow_and_update().clone();
        if let Some(u) = update {
            reconcile(&agent, u);
        }
    }
}

/// Checks the set's cluster id against the one this node ran work for. `true`: go on with
/// the set. `false`: a switch to another cluster is under way (the set waits for it).
fn same_cluster(agent: &Arc<Agent>, t: &mut Tasks, u: &pb::AllocationsUpdate) -> bool {
    if let Some((_, latest)) = &mut t.switching {
        *latest = Some(u.clone());
        return false;
    }
    if u.cluster_id.is_empty() || t.cluster_id.as_deref() == Some(u.cluster_id.as_str()) {
        return true;
    }
    let Some(old) = t.cluster_id.clone() else {
        // The first cluster named: this node's work is for it.
        if let Err(e) = sys::write_atomic(&agent.cfg.data_dir.join(CLUSTER_FILE), u.cluster_id.as_bytes()) {
            tracing::warn!(error = %e, "persisting the cluster id");
        }
        t.cluster_id = Some(u.cluster_id.clone());
        tracing::info!(cluster_id = %u.cluster_id, "running work for this cluster");
        return true;
    };
    tracing::error!(
        was = %old,
        now = %u.cluster_id,
        tasks = t.map.values().filter(|e| !e.ended).count(),
        "THE CONTROL PLANE IS ANOTHER CLUSTER (restored from a backup, or rebuilt): stopping every task of the old cluster, moving its allocation directories aside, then running the new cluster's work"
    );
    agent.reporter.hold(true);
    for e in t.map.values() {
        request_stop(e, format!("the control plane is now cluster {} (was {old})", u.cluster_id), Duration::ZERO, None);
    }
    t.switching = Some((u.cluster_id.clone(), Some(u.clone())));
    let a = agent.clone();
    tokio::spawn(switch_cluster(a, old));
    false
}

/// Waits for the old cluster's tasks to end (at most the longest stop grace plus 30 s), moves
/// its allocation directories, journal and watch revision to `old-clusters/`, adopts the new
/// cluster id, registers again and applies the new cluster's latest set.
async fn switch_cluster(agent: Arc<Agent>, old: String) {
    let deadline = Instant::now() + Duration::from_millis(agent.cfg.stop_grace_max_ms) + Duration::from_secs(30);
    while lock(&agent).map.values().any(|e| !e.ended) && Instant::now() < deadline {
        if !crate::control::pause(&agent, Duration::from_millis(50)).await {
            return;
        }
    }
    let data = agent.cfg.data_dir.clone();
    let aside = data.join(OLD_CLUSTERS_DIR).join(format!("{old}-{}", sys::now_s()));
    let update = {
        let mut t = lock(&agent);
        if t.map.values().any(|e| !e.ended) {
            tracing::error!("tasks of the old cluster did not stop in time; moving their directories anyway");
        }
        let moved = std::fs::create_dir_all(&aside)
            .and_then(|()| std::fs::rename(agent.cfg.allocs_dir(), aside.join("allocs")))
            .and_then(|()| std::fs::create_dir_all(agent.cfg.allocs_dir()));
        if let Err(e) = moved {
            tracing::error!(error = %e, to = %aside.display(), "moving the old cluster's allocation directories aside failed; removing them");
            let _ = std::fs::remove_dir_all(agent.cfg.allocs_dir());
            let _ = std::fs::create_dir_all(agent.cfg.allocs_dir());
        }
        for f in [crate::journal::JOURNAL_FILE, REV_FILE] {
            let _ = std::fs::rename(data.join(f), aside.join(f));
        }
        let Some((new, update)) = t.switching.take() else { return };
        if let Err(e) = sys::write_atomic(&data.join(CLUSTER_FILE), new.as_bytes()) {
            tracing::warn!(error = %e, "persisting the cluster id");
        }
        t.map.clear();
        t.max_rev = 0;
        t.stale_since = None;
        t.cluster_id = Some(new.clone());
        tracing::warn!(cluster_id = %new, old_work = %aside.display(), "now running work for the new cluster; the old cluster's directories are kept aside");
        update
    };
    agent.reporter.hold(false);
    agent.reregister.notify_one();
    if let Some(u) = update {
        reconcile(&agent, u);
    }
}

/// How a set compares with the newest one applied (pure: [`freshness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freshness {
    /// As new as any applied, or newer: it may start and stop tasks.
    Fresh,
    /// Older than one applied (a lagging server after a reconnect): it may lack allocations
    /// placed since, so it may start tasks but must not stop any.
    StartOnly,
    /// Older, but only older ones arrived for [`STALE_ACCEPTED_AFTER`] (a new cluster?): the
    /// revision is reset and the set applies in full.
    Reset,
}

/// How long only older sets may arrive before their revision is accepted.
const STALE_ACCEPTED_AFTER: Duration = Duration::from_secs(120);

/// A set of `revision` against the newest `applied`, older sets having arrived (only) for
/// `stale_for`.
fn freshness(revision: u64, applied: u64, stale_for: Duration) -> Freshness {
    if revision >= applied {
        Freshness::Fresh
    } else if stale_for > STALE_ACCEPTED_AFTER {
        Freshness::Reset
    } else {
        Freshness::StartOnly
    }
}

/// What reconcile does with one allocation of a set (pure: [`alloc_action`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum AllocAction {
    /// Handled here already; nothing to do.
    Keep,
    /// Handled here already, and the control plane wants it stopped (why).
    Stop(String),
    /// Not in memory but its directory exists (the agent restarted): recover it, and stop it
    /// when asked (why).
    Recover(Option<String>),
    /// Not started: report this status and message.
    Refuse(pb::AllocReport, String),
    /// Start the task.
    Start,
}

/// Desired (`a`) against actual: whether this agent already handles it (`handled`), whether
/// its directory exists (`has_dir`), and how many tasks run (`running`, of `max_tasks`).
fn alloc_action(a: &pb::AllocInfo, handled: bool, has_dir: bool, running: usize, max_tasks: usize) -> AllocAction {
    let stop_wanted = a.desired == "stop";
    if handled {
        if !stop_wanted {
            return AllocAction::Keep;
        }
        let why =
            if a.stop_reason.is_empty() { "asked by the control plane".to_owned() } else { a.stop_reason.clone() };
        return AllocAction::Stop(why);
    }
    if has_dir {
        return AllocAction::Recover(stop_wanted.then(|| a.stop_reason.clone()));
    }
    if stop_wanted {
        return AllocAction::Refuse(pb::AllocReport::Stopped, "stopped before it started".into());
    }
    if a.state == "running" {
        return AllocAction::Refuse(
            pb::AllocReport::Failed,
            "lost: the control plane has it running but this node has no record of it (its data directory is gone); not starting it again".into(),
        );
    }
    if a.command.is_empty() {
        return AllocAction::Refuse(pb::AllocReport::Failed, "no task: the job spec's group has no `task`".into());
    }
    if running >= max_tasks {
        return AllocAction::Refuse(
            pb::AllocReport::Failed,
            format!("the node runs max_tasks = {max_tasks} tasks already"),
        );
    }
    AllocAction::Start
}

/// The handled tasks a fresh set no longer lists: `true` to forget (it ended; its directory
/// remembers it), `false` to stop (still running).
fn unlisted(handled: impl Iterator<Item = (Key, bool)>, in_set: &BTreeSet<Key>) -> Vec<(Key, bool)> {
    handled.filter(|(k, _)| !in_set.contains(k)).collect()
}

fn reconcile(agent: &Arc<Agent>, u: pb::AllocationsUpdate) {
    let cfg = &agent.cfg;
    let mut t = lock(agent);
    if !same_cluster(agent, &mut t, &u) {
        return;
    }
    let now = Instant::now();
    let stale_for = if u.revision >= t.max_rev { Duration::ZERO } else { now - *t.stale_since.get_or_insert(now) };
    let fresh = match freshness(u.revision, t.max_rev, stale_for) {
        Freshness::Fresh => {
            t.stale_since = None;
            if u.revision > t.max_rev {
                t.max_rev = u.revision;
                persist_rev(agent, u.revision);
            }
            true
        }
        Freshness::Reset => {
            tracing::warn!(
                revision = u.revision,
                applied = t.max_rev,
                "the control plane's revision went backwards for 2 minutes (a new cluster?): accepting its sets"
            );
            t.max_rev = u.revision;
            t.stale_since = None;
            persist_rev(agent, u.revision);
            true
        }
        Freshness::StartOnly => {
            tracing::debug!(revision = u.revision, applied = t.max_rev, "a set older than one applied: starting only");
            false
        }
    };
    let in_set: BTreeSet<Key> = u.allocs.iter().map(|a| (a.id, a.epoch)).collect();
    let mut running = t.map.values().filter(|e| !e.ended).count();
    for a in u.allocs {
        let k = (a.id, a.epoch);
        let dir = alloc_dir(agent, k);
        let handled = t.map.contains_key(&k);
        if a.lease_until_ms > 0 {
            renew_fed_locked(agent, &mut t, a.id, a.lease_until_ms);
        }
        match alloc_action(&a, handled, !handled && dir.exists(), running, cfg.max_tasks) {
            AllocAction::Keep => {
                // An elastic job grew or shrank: its running tasks see the new membership.
                if a.desired == "run"
                    && t.map.get(&k).is_some_and(|e| !e.ended)
                    && dir.join(WORLD_FILE).exists()
                    && let Err(e) = write_world(&dir, &a)
                {
                    tracing::warn!(alloc = k.0, error = %e, "updating {WORLD_FILE}");
                }
            }
            AllocAction::Stop(why) => {
                if let Some(e) = t.map.get(&k) {
                    request_stop(e, why, grace(cfg, a.grace_s), checkpoint_ask(cfg, &a));
                }
            }
            AllocAction::Recover(stop) => {
                let e = recover_one(agent, k, &dir);
                if let Some(why) = stop {
                    request_stop(&e, why, grace(cfg, a.grace_s), checkpoint_ask(cfg, &a));
                }
                running += usize::from(!e.ended);
                t.map.insert(k, e);
            }
            AllocAction::Refuse(status, message) => {
                tracing::warn!(alloc = k.0, epoch = k.1, job_id = a.job_id, %message, "not starting the task");
                let end = refused_end(status, &message);
                agent.reporter.enqueue(Report {
                    alloc: k.0,
                    epoch: k.1,
                    status,
                    message,
                    exit_code: 0,
                    end,
                    exit_code_set: false,
                });
            }
            AllocAction::Start => {
                let (tx, rx) = watch::channel(None);
                t.map.insert(k, Entry { stop: tx, ended: false });
                running += 1;
                let a2 = agent.clone();
                let span =
                    tracing::info_span!("task", alloc = k.0, epoch = k.1, job_id = a.job_id, node_id = %agent.node_id);
                tokio::spawn(async move { start(a2, a, rx).await }.instrument(span));
            }
        }
    }
    if fresh {
        t.fed_until.retain(|id, _| in_set.iter().any(|k| k.0 == *id));
        for (k, forget) in unlisted(t.map.iter().map(|(k, e)| (*k, e.ended)), &in_set) {
            if forget {
                // Finished and no longer listed: the directory remembers it from now on.
                t.map.remove(&k);
            } else if let Some(e) = t.map.get(&k) {
                request_stop(e, "no longer assigned to this node".into(), grace(cfg, 0), None);
            }
        }
    }
}

/// Renews the federation leases of allocation `alloc_id` (a heartbeat's `leases`): the
/// `fed-lease` file of each of its running tasks moves to `until_ms` if that is later.
pub(crate) fn renew_fed(agent: &Agent, alloc_id: u64, until_ms: u64) {
    let mut t = lock(agent);
    renew_fed_locked(agent, &mut t, alloc_id, until_ms);
}

fn renew_fed_locked(agent: &Agent, t: &mut Tasks, alloc_id: u64, until_ms: u64) {
    let latest = t.fed_until.entry(alloc_id).or_insert(0);
    if until_ms <= *latest {
        return;
    }
    *latest = until_ms;
    let keys: Vec<Key> = t.map.iter().filter(|(k, e)| k.0 == alloc_id && !e.ended).map(|(k, _)| *k).collect();
    for k in keys {
        let path = alloc_dir(agent, k).join(crate::fedlease::FED_LEASE_FILE);
        match crate::fedlease::FedLease::read(&path) {
            Ok(Some(l)) if until_ms > l.until_ms => {
                if let Err(e) = l.renewed(until_ms).write(&path) {
                    // The task stops at the lease it has: safe, only early.
                    tracing::warn!(alloc = k.0, epoch = k.1, error = %e, "renewing the federation lease");
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(alloc = k.0, epoch = k.1, error = %e, "renewing the federation lease"),
        }
    }
}

/// A federated allocation's lease as its task starts: the allocation's, renewed by what
/// heartbeats brought meanwhile; `None` for a region-local allocation.
fn fed_lease_of(agent: &Agent, a: &pb::AllocInfo) -> Option<crate::fedlease::FedLease> {
    if a.lease_until_ms == 0 && a.global_job_id.is_empty() {
        return None;
    }
    let latest = lock(agent).fed_until.get(&a.id).copied().unwrap_or(0);
    let ck = !a.checkpoint_signal.is_empty() && crate::fedlease::signal_number(&a.checkpoint_signal).is_some();
    Some(crate::fedlease::FedLease {
        until_ms: a.lease_until_ms.max(latest),
        stop_before_ms: a.fed_stop_before_ms,
        global_id: a.global_job_id.clone(),
        fed_epoch: a.fed_epoch,
        checkpoint_signal: if ck { a.checkpoint_signal.clone() } else { String::new() },
        grace_ms: if ck { a.grace_s.saturating_mul(1000) } else { 0 },
    })
}

/// The end class of an allocation the agent refused to start.
fn refused_end(status: pb::AllocReport, message: &str) -> &'static str {
    if status == pb::AllocReport::Stopped {
        "stopped"
    } else if message.starts_with("lost:") {
        "node_lost"
    } else {
        "start_failed"
    }
}

/// A task's share of each of its devices, as `reserve` tells its plugins.
fn shares_of(devices: &[pb::DeviceShare]) -> Vec<suanli_device_host::pb::ReserveShare> {
    devices
        .iter()
        .map(|d| suanli_device_host::pb::ReserveShare {
            device_id: d.device.clone(),
            milli: d.milli,
            memory_mib: d.memory_mib,
        })
        .collect()
}

/// Marks the task ended and releases its device reservation (if still held: the normal end
/// releases it before its report).
fn set_ended(agent: &Agent, k: Key) {
    if let Some(e) = lock(agent).map.get_mut(&k) {
        e.ended = true;
    }
    let plugins = agent.plugins.clone();
    tokio::spawn(async move { plugins.release(&crate::plugins::reservation_id(k.0, k.1)).await });
}

/// Records that the task could not start (as its exit record) and reports it.
fn fail_start(agent: &Agent, k: Key, dir: &Path, msg: String) {
    fail_start_as(agent, k, dir, msg, None);
}

/// [`fail_start`], with the end class when it is not `start_failed`.
fn fail_start_as(agent: &Agent, k: Key, dir: &Path, msg: String, end: Option<&str>) {
    tracing::warn!(alloc = k.0, epoch = k.1, error = %msg, "task could not start");
    let rec = ExitRecord {
        finished_at: sys::now_s(),
        finished_at_ms: Some(sys::now_ms()),
        error: Some(msg),
        end: end.map(str::to_owned),
        ..ExitRecord::default()
    };
    if let Err(e) = sys::write_atomic(&dir.join(crate::shim::EXIT_FILE), &serde_json::to_vec(&rec).unwrap_or_default())
    {
        tracing::warn!(error = %e, "writing exit.json");
    }
    agent.reporter.enqueue(final_report(k, dir, Some(&rec), ""));
    set_ended(agent, k);
}

/// Records that a federated task was not started because its lease ends too soon, and reports
/// it STOPPED.
fn fail_start_fed(agent: &Agent, k: Key, dir: &Path, msg: String) {
    tracing::warn!(alloc = k.0, epoch = k.1, "{msg}");
    let rec = ExitRecord {
        finished_at: sys::now_s(),
        finished_at_ms: Some(sys::now_ms()),
        error: Some(msg.clone()),
        fenced: true,
        fed_stop: Some(msg),
        ..ExitRecord::default()
    };
    if let Err(e) = sys::write_atomic(&dir.join(crate::shim::EXIT_FILE), &serde_json::to_vec(&rec).unwrap_or_default())
    {
        tracing::warn!(error = %e, "writing exit.json");
    }
    agent.reporter.enqueue(final_report(k, dir, Some(&rec), ""));
    set_ended(agent, k);
}

/// The task's environment.
fn task_env(
    agent: &Agent,
    a: &pb::AllocInfo,
    dir: &Path,
    plugin_env: BTreeMap<String, String>,
    restore: Option<&(PathBuf, u64)>,
    device_files: &[String],
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for name in &agent.cfg.inherit_env {
        if let Ok(v) = std::env::var(name) {
            env.insert(name.clone(), v);
        }
    }
    if !env.contains_key("PATH") {
        env.insert("PATH".into(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    }
    env.extend(a.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(plugin_env);
    let group = if a.group_name.is_empty() { a.group.to_string() } else { a.group_name.clone() };
    let devices: Vec<String> = a.devices.iter().map(|d| format!("{}:{}", d.device, d.milli)).collect();
    let kinds: BTreeMap<String, (DeviceKind, ShareIsolation)> = agent
        .plugins
        .devices()
        .into_iter()
        .map(|d| (d.device.id.clone(), (d.device.kind, d.device.share_isolation)))
        .collect();
    let ours = [
        ("SUANLI_JOB_ID", a.job_id.to_string()),
        ("SUANLI_JOB_NAME", a.job_name.clone()),
        ("SUANLI_TASK", format!("{group}-{}", a.replica)),
        ("SUANLI_ATTEMPT", a.epoch.to_string()),
        ("SUANLI_ALLOC_ID", a.id.to_string()),
        ("SUANLI_NODE", agent.node_id.clone()),
        ("SUANLI_DEVICES", devices.join(",")),
        ("SUANLI_ALLOC_DIR", dir.display().to_string()),
        ("SUANLI_DEVICE_EVENTS", dir.join(crate::plugins::DEVICE_EVENTS_FILE).display().to_string()),
        ("SUANLI_CPU_MILLI", a.cpu_milli.to_string()),
        ("SUANLI_WORLD_SIZE", a.world_size.to_string()),
        ("SUANLI_WORLD_FILE", dir.join(WORLD_FILE).display().to_string()),
        ("SUANLI_MEMORY_MIB", a.memory_mib.to_string()),
    ];
    env.extend(ours.into_iter().map(|(k, v)| (k.to_owned(), v)));
    env.insert("SUANLI_CHECKPOINT_DIR".into(), dir.join(crate::ckpt::CHECKPOINT_DIR).display().to_string());
    if !a.checkpoint_signal.is_empty() {
        env.insert("SUANLI_CHECKPOINT_SIGNAL".into(), a.checkpoint_signal.clone());
    }
    if let Some((path, step)) = restore {
        env.insert("SUANLI_RESTORE_FROM".into(), path.display().to_string());
        env.insert("SUANLI_RESTORE_STEP".into(), step.to_string());
    }
    if !device_files.is_empty() {
        env.insert("SUANLI_DEVICE_FILES".into(), device_files.join(":"));
    }
    // A fractional share: tell the task how much of the device is its own, and whether the
    // node holds it to that (the plugin's reserve set the limits: MPS variables for an NVIDIA
    // GPU) or only tells it.
    for d in a.devices.iter().filter(|d| d.milli < 1000) {
        let (kind, isolation) = kinds.get(&d.device).copied().unwrap_or((DeviceKind::Gpu, ShareIsolation::Advisory));
        let p = kind.as_str().to_ascii_uppercase();
        env.insert(format!("SUANLI_{p}_MILLI"), d.milli.to_string());
        if d.memory_mib > 0 {
            env.insert(format!("SUANLI_{p}_MEMORY_MIB"), d.memory_mib.to_string());
        }
        env.insert(format!("SUANLI_{p}_SHARE_ISOLATION"), isolation.as_str().into());
    }
    env
}

/// Waits until the agent holds a lease good for at least half of F more (so the shim, which
/// checks it again, finds it fresh), or a stop. `Err(why)` when the task must not start.
async fn await_lease(agent: &Agent, stop: &mut watch::Receiver<Option<Stop>>) -> Result<(), String> {
    let mut lease = agent.lease.subscribe();
    let mut agent_stop = agent.stop.clone();
    let mut stop_open = true;
    let mut logged = false;
    loop {
        if let Some(s) = stop.borrow().clone() {
            return Err(s.reason);
        }
        if *agent_stop.borrow() {
            return Err("the agent stopped before it had a fresh lease".into());
        }
        let left = lease
            .borrow_and_update()
            .as_ref()
            .map(|l| (l.left_ms(sys::boottime_ms(), &agent.boot_id), l.fence_after_ms / 2));
        match left {
            Some((Ok(ms), min)) if ms >= min => return Ok(()),
            _ if !logged => {
                tracing::info!(
                    "waiting for a fresh lease (a heartbeat acknowledged by the control plane) to start the task"
                );
                logged = true;
            }
            _ => {}
        }
        tokio::select! {
            r = lease.changed() => if r.is_err() { return Err("the agent is stopping".into()) },
            r = stop.changed(), if stop_open => if r.is_err() { stop_open = false },
            _ = agent_stop.changed() => {}
        }
    }
}

/// Starts one allocation: reservation, directory, cgroup, lease, shim, `task.json`, RUNNING.
async fn start(agent: Arc<Agent>, a: pb::AllocInfo, mut stop: watch::Receiver<Option<Stop>>) {
    let k = (a.id, a.epoch);
    crate::telemetry::alloc_seen(&agent.cfg.node_id, &a);
    let dir = alloc_dir(&agent, k);
    // Reserve first: it has no effect on the node beyond the environment it returns, so an
    // agent dying during it leaves nothing behind and the allocation simply starts later.
    let ids: Vec<String> = a.devices.iter().map(|d| d.device.clone()).collect();
    let reserved = if ids.is_empty() {
        Ok(crate::plugins::Reserved::default())
    } else {
        let id = crate::plugins::reservation_id(k.0, k.1);
        agent.plugins.reserve(&id, a.id, &shares_of(&a.devices)).await
    };
    // The directory is the "started once" mark: create it exclusively, and durably.
    if let Err(e) = std::fs::create_dir(&dir) {
        tracing::error!(dir = %dir.display(), error = %e, "cannot create the allocation directory; not starting");
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            agent.reporter.enqueue(Report {
                status: pb::AllocReport::Failed,
                end: "start_failed",
                ..Report::running(k.0, k.1, format!("agent: creating {}: {e}", dir.display()))
            });
        }
        set_ended(&agent, k);
        return;
    }
    if let Err(e) = sys::sync_dir(&agent.cfg.allocs_dir()) {
        tracing::warn!(error = %e, "fsync of the allocs directory");
    }
    let device_files = reserved.as_ref().map(|r| r.device_files.clone()).unwrap_or_default();
    let hardware = crate::ckpt::hardware_of(&agent, &ids);
    let alloc_file = serde_json::to_vec_pretty(&alloc_json(&a, &agent.node_id, hardware.as_ref(), &device_files))
        .unwrap_or_default();
    if let Err(e) = sys::write_atomic(&dir.join(crate::shim::ALLOC_FILE), &alloc_file) {
        return fail_start(&agent, k, &dir, format!("agent: writing {}: {e}", crate::shim::ALLOC_FILE));
    }
    // The space of stop.json, reserved now: a cancel must be recorded as a stop even once a
    // task has filled the disk.
    if let Err(e) = sys::write_padded(&dir.join(STOP_RESERVED_FILE), b"{}", STOP_FILE_BYTES) {
        tracing::warn!(error = %e, "reserving the space of stop.json");
    }
    let plugin_env = match reserved {
        Ok(r) => r.env,
        Err(e) => return fail_start(&agent, k, &dir, format!("cannot reserve its devices: {e}")),
    };
    if let Err(e) = std::fs::create_dir(dir.join(crate::ckpt::CHECKPOINT_DIR)) {
        return fail_start(&agent, k, &dir, format!("agent: creating the checkpoint directory: {e}"));
    }
    if let Err(e) = write_world(&dir, &a) {
        return fail_start(&agent, k, &dir, format!("agent: writing {WORLD_FILE}: {e}"));
    }
    let cg_name = dir_name(k);
    let cgroup = match &agent.cgroups {
        Some(c) => match c.create(&cg_name, a.cpu_milli, a.memory_mib) {
            Ok(p) => Some(p),
            Err(e) => return fail_start(&agent, k, &dir, format!("cannot create its cgroup: {e}")),
        },
        None => None,
    };
    // The checkpoint to restore from is fetched before the task starts; a fetch that fails is
    // the node's or the store's fault, not the application's: `node_lost` (infrastructure,
    // the next attempt avoids this node).
    let restore = if a.restore_from.is_empty() {
        None
    } else {
        match crate::ckpt::fetch(&agent, &a.checkpoint_store, &a.restore_from, &dir).await {
            Ok(r) => {
                tracing::info!(from = %a.restore_from, step = r.1, path = %r.0.display(), "checkpoint fetched to restore from");
                Some(r)
            }
            Err(e) => return fail_start_as(&agent, k, &dir, format!("not started: {e}"), Some("node_lost")),
        }
    };
    if agent.cfg.fence
        && let Err(why) = await_lease(&agent, &mut stop).await
        && stop.borrow().is_none()
    {
        return fail_start(&agent, k, &dir, format!("not started: {why}"));
    }
    if let Some(s) = stop.borrow().clone() {
        write_stop(&dir, &s.reason, None);
        return fail_start(&agent, k, &dir, "stopped before it started".into());
    }
    // A federated task starts only before its lease's deadline, and its shim stops it there
    // (from `fed-lease`, which renewals rewrite).
    if let Some(l) = fed_lease_of(&agent, &a) {
        if let Err(why) = l.may_start(sys::now_ms()) {
            return fail_start_fed(&agent, k, &dir, why);
        }
        if let Err(e) = l.write(&dir.join(crate::fedlease::FED_LEASE_FILE)) {
            return fail_start(&agent, k, &dir, format!("agent: writing the federation lease: {e}"));
        }
    }
    let mut env = task_env(&agent, &a, &dir, plugin_env, restore.as_ref(), &device_files);
    // A service replica: its port (docs/services.md), kept for an agent that adopts it.
    match crate::probe::ServiceRun::of(&a) {
        Ok(Some(run)) => {
            if let Err(e) = run.write(&dir) {
                return fail_start(&agent, k, &dir, format!("agent: writing {}: {e}", crate::probe::SERVICE_FILE));
            }
            env.insert("SUANLI_PORT".into(), run.port.to_string());
        }
        Ok(None) => {}
        Err(e) => return fail_start(&agent, k, &dir, format!("agent: {e}")),
    }
    let shim = agent.shim_cmd();
    let mut cmd = tokio::process::Command::new(&shim[0]);
    cmd.args(&shim[1..]).arg("--dir").arg(&dir).arg("--max-log-bytes").arg(agent.cfg.max_log_bytes.to_string());
    if let Some(cg) = &cgroup {
        cmd.arg("--cgroup").arg(cg);
    }
    if !a.workdir.is_empty() {
        cmd.arg("--workdir").arg(dir.join(&a.workdir));
    }
    cmd.arg("--journal").arg(agent.cfg.data_dir.join(crate::journal::JOURNAL_FILE));
    if agent.cfg.task_disk_max_bytes > 0 {
        cmd.arg("--disk-max-bytes").arg(agent.cfg.task_disk_max_bytes.to_string());
    }
    if agent.cfg.fence {
        cmd.arg("--lease").arg(agent.cfg.data_dir.join(crate::lease::LEASE_FILE));
    }
    cmd.arg("--").arg(&a.command).args(&a.args);
    cmd.env_clear().envs(&env).current_dir(&dir).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null());
    match std::fs::OpenOptions::new().create(true).append(true).open(dir.join("shim.log")) {
        Ok(f) => cmd.stderr(f),
        Err(_) => cmd.stderr(std::process::Stdio::null()),
    };
    cmd.kill_on_drop(false);
    sys::new_session(&mut cmd);
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return fail_start(&agent, k, &dir, format!("cannot start the task shim {:?}: {e}", shim[0])),
    };
    let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    let Some(proc_id) = ProcId::of(pid) else {
        // It exited at once: its exit record (if any) tells why.
        let a2 = agent.clone();
        return supervise(a2, k, dir, Waiter::Child(child), pid, stop).await;
    };
    let rec = TaskRecord {
        alloc_id: a.id,
        epoch: a.epoch,
        job_id: a.job_id,
        task: env.get("SUANLI_TASK").cloned().unwrap_or_default(),
        shim: proc_id,
        started_at: sys::now_s(),
        cgroup: cgroup.as_ref().map(|p| p.display().to_string()),
        team: a.team.clone(),
    };
    if let Err(e) = sys::write_atomic(&dir.join("task.json"), &serde_json::to_vec_pretty(&rec).unwrap_or_default()) {
        tracing::error!(error = %e, "writing task.json; the task runs but cannot be adopted after an agent restart");
    }
    tracing::info!(pid, command = %a.command, devices = %env.get("SUANLI_DEVICES").map_or("", String::as_str), "task started");
    agent.reporter.enqueue(Report::running(k.0, k.1, String::new()));
    supervise(agent, k, dir, Waiter::Child(child), pid, stop).await;
}

/// The file in an allocation directory that holds the job's membership
/// (`$SUANLI_WORLD_FILE`): `{"world_size": N, "generation": G, "attempt": A}`, rewritten
/// (atomically) when an elastic job grows or shrinks.
pub(crate) const WORLD_FILE: &str = "world.json";

/// Writes [`WORLD_FILE`] for `a` when it says something else than it holds now.
fn write_world(dir: &Path, a: &pb::AllocInfo) -> std::io::Result<()> {
    let body = serde_json::json!({"world_size": a.world_size, "generation": a.world_gen, "attempt": a.epoch});
    let mut bytes = serde_json::to_vec(&body).unwrap_or_default();
    bytes.push(b'\n');
    let path = dir.join(WORLD_FILE);
    if std::fs::read(&path).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    sys::write_atomic(&path, &bytes)
}

/// `alloc.json`: the allocation as received, with the node and the task name (the shim reads
/// its identity for the journal from it).
fn alloc_json(
    a: &pb::AllocInfo,
    node: &str,
    hardware: Option<&crate::ckpt::Hardware>,
    device_files: &[String],
) -> serde_json::Value {
    let group = if a.group_name.is_empty() { a.group.to_string() } else { a.group_name.clone() };
    serde_json::json!({
        "id": a.id, "job_id": a.job_id, "job_name": a.job_name, "group": a.group_name, "replica": a.replica,
        "epoch": a.epoch, "node": node, "task": format!("{group}-{}", a.replica),
        "cpu_milli": a.cpu_milli, "memory_mib": a.memory_mib,
        "devices": a.devices.iter().map(|d| serde_json::json!({"device": d.device, "milli": d.milli, "memory_mib": d.memory_mib})).collect::<Vec<_>>(),
        "command": a.command, "args": a.args, "workdir": a.workdir,
        "checkpoint_store": a.checkpoint_store, "checkpoint_signal": a.checkpoint_signal,
        "restore_from": a.restore_from, "restore_step": a.restore_step,
        "hardware": hardware, "device_files": device_files,
        "global_id": a.global_job_id, "fed_epoch": a.fed_epoch,
    })
}

/// Writes `stop.json`; again with the checkpoint's `outcome` once it is known (keeping the
/// first record's time, which orders the stop against a fence).
fn write_stop(dir: &Path, reason: &str, outcome: Option<String>) {
    let path = dir.join("stop.json");
    let first: Option<StopRecord> = outcome.as_ref().and_then(|_| read_json(&path));
    let rec = match first {
        Some(f) => StopRecord { checkpoint: outcome, ..f },
        None => StopRecord { reason: reason.to_owned(), at: sys::now_s(), at_ms: sys::now_ms(), checkpoint: outcome },
    };
    let data = serde_json::to_vec(&rec).unwrap_or_default();
    let r = if path.exists() {
        sys::write_atomic(&path, &data)
    } else {
        sys::write_reserved(&path, &dir.join(STOP_RESERVED_FILE), &data, STOP_FILE_BYTES)
    };
    if let Err(e) = r {
        tracing::warn!(error = %e, "writing stop.json");
    }
}

/// How the end of a task is noticed.
enum Waiter {
    /// Our own child: wait(2) on it.
    Child(tokio::process::Child),
    /// A shim started by an earlier agent: poll /proc.
    Adopted(ProcId),
}

impl Waiter {
    /// Waits until the shim is gone; its wait status when it was our child.
    async fn wait(&mut self) -> Option<std::process::ExitStatus> {
        match self {
            Waiter::Child(c) => c.wait().await.ok(),
            Waiter::Adopted(p) => {
                while p.alive() {
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                None
            }
        }
    }
}

/// Watches a running task until it ends, stopping it when asked; then reports how it ended.
///
/// Its checkpoint directory is watched meanwhile ([`crate::ckpt::watch`]). A checkpoint-first
/// stop sends the checkpoint signal to the task's group and waits until a checkpoint newer than
/// any seen at the stop has been stored and reported, or the wait ends, whichever comes first; then SIGTERM, and SIGKILL
/// after the stop's grace. The final report waits for the watcher's last look (bounded by
/// `checkpoint_final_wait_ms`), so the control plane learns of a checkpoint committed at the
/// end before it learns of the end.
async fn supervise(
    agent: Arc<Agent>,
    k: Key,
    dir: PathBuf,
    mut waiter: Waiter,
    pgid: i32,
    mut stop: watch::Receiver<Option<Stop>>,
) {
    let (reported_tx, mut reported) = watch::channel(crate::ckpt::Progress::default());
    let (ended_tx, ended_rx) = watch::channel(false);
    if let Some(run) = crate::probe::ServiceRun::read(&dir) {
        let probe = crate::probe::watch(agent.clone(), k, dir.clone(), run, pgid, ended_rx.clone());
        tokio::spawn(probe.in_current_span());
    }
    let watcher = tokio::spawn(crate::ckpt::watch(agent.clone(), dir.clone(), reported_tx, ended_rx).in_current_span());
    let mut term_at: Option<(tokio::time::Instant, Duration)> = None;
    let mut ckpt: Option<(u64, Stop, CheckpointAsk)> = None;
    let mut kill_at: Option<tokio::time::Instant> = None;
    let mut killed = false;
    let mut stop_open = true;
    let until = |t: Option<tokio::time::Instant>| async move {
        match t {
            Some(t) => tokio::time::sleep_until(t).await,
            None => std::future::pending().await,
        }
    };
    let status = loop {
        tokio::select! {
            s = waiter.wait() => break s,
            r = stop.changed(), if stop_open && kill_at.is_none() && term_at.is_none() => {
                if r.is_err() {
                    stop_open = false;
                    continue;
                }
                let Some(s) = stop.borrow_and_update().clone() else { continue };
                write_stop(&dir, &s.reason, None);
                match s.checkpoint.clone() {
                    Some(ask) => {
                        // A checkpoint committed before the signal (being stored now) is not new.
                        let p = *reported.borrow_and_update();
                        let from = p.seen.max(p.reported);
                        tracing::info!(reason = %s.reason, signal = ask.name, wait_ms = ask.wait.as_millis() as u64, step = from,
                            "stopping the task: asking for a checkpoint first");
                        if let Err(e) = sys::kill_group(pgid, ask.signal) {
                            tracing::warn!(error = %e, signal = ask.name, "sending the checkpoint signal");
                        }
                        term_at = Some((tokio::time::Instant::now() + ask.wait, s.grace));
                        ckpt = Some((from, s, ask));
                    }
                    None => {
                        tracing::info!(reason = %s.reason, grace_ms = s.grace.as_millis() as u64, "stopping the task: SIGTERM");
                        if let Err(e) = sys::kill_group(pgid, libc::SIGTERM) {
                            tracing::warn!(error = %e, "SIGTERM");
                        }
                        kill_at = Some(tokio::time::Instant::now() + s.grace);
                    }
                }
            }
            r = reported.changed(), if ckpt.is_some() && kill_at.is_none() => {
                let step = reported.borrow_and_update().reported;
                if r.is_err() {
                    // The watcher is gone: nothing more will be reported.
                    if let Some((_, s, ask)) = ckpt.take() {
                        kill_at = Some(terminate(&dir, pgid, &s, format!("no checkpoint: the checkpoint watcher ended ({} asked)", ask.name)));
                    }
                    continue;
                }
                if let Some((from, s, _)) = ckpt.as_ref().filter(|(from, _, _)| step > *from) {
                    tracing::info!(step, was = *from, "the task committed a checkpoint within its grace");
                    kill_at = Some(terminate(&dir, pgid, s, format!("checkpoint at step {step} within the grace")));
                    ckpt = None;
                }
            }
            () = until(term_at.map(|t| t.0)), if kill_at.is_none() && ckpt.is_some() => {
                if let Some((from, s, ask)) = ckpt.take() {
                    tracing::warn!(step = from, wait_ms = ask.wait.as_millis() as u64, "no new checkpoint within the grace");
                    kill_at = Some(terminate(&dir, pgid, &s, format!("no checkpoint within {} s (last step {from})", ask.wait.as_secs())));
                }
            }
            () = until(kill_at), if !killed => {
                tracing::warn!("the task outlived its grace period: SIGKILL");
                killed = true;
                if let Err(e) = sys::kill_group(pgid, libc::SIGKILL) {
                    tracing::warn!(error = %e, "SIGKILL");
                }
            }
        }
    };
    // Whatever the task left behind in its process group goes with it.
    let _ = sys::kill_group(pgid, libc::SIGKILL);
    if let Some(c) = &agent.cgroups {
        c.remove(&dir_name(k));
    }
    // The watcher's last look: a checkpoint committed at the end is reported before the end.
    ended_tx.send_replace(true);
    let wait = Duration::from_millis(agent.cfg.checkpoint_final_wait_ms);
    let mut watcher = watcher;
    if tokio::time::timeout(wait, &mut watcher).await.is_err() {
        tracing::warn!(
            wait_ms = agent.cfg.checkpoint_final_wait_ms,
            "the last checkpoint upload took too long; reporting the end without it"
        );
        watcher.abort();
    }
    let exit = ExitRecord::read(&dir);
    let lost = match status {
        Some(s) => format!("lost: the task shim ended ({s}) without recording an exit status"),
        None => "lost: the task shim is gone and recorded no exit status".to_owned(),
    };
    let r = final_report(k, &dir, exit.as_ref(), &lost);
    tracing::info!(status = ?r.status, end = r.end, message = %r.message, "task ended");
    // Released before the end is reported: the control plane may give the devices to the next
    // task as soon as it hears of the end, and a plugin enforcing shares must not see both.
    agent.plugins.release(&crate::plugins::reservation_id(k.0, k.1)).await;
    agent.reporter.enqueue(r);
    set_ended(&agent, k);
}

/// The SIGTERM of a checkpoint-first stop, recording what came of the checkpoint; the SIGKILL
/// deadline.
fn terminate(dir: &Path, pgid: i32, s: &Stop, outcome: String) -> tokio::time::Instant {
    write_stop(dir, &s.reason, Some(outcome));
    tracing::info!(reason = %s.reason, grace_ms = s.grace.as_millis() as u64, "stopping the task: SIGTERM");
    if let Err(e) = sys::kill_group(pgid, libc::SIGTERM) {
        tracing::warn!(error = %e, "SIGTERM");
    }
    tokio::time::Instant::now() + s.grace
}

/// Deletes finished allocation directories older than the retention, forever.
pub(crate) async fn gc(agent: Arc<Agent>) {
    loop {
        let retention = Duration::from_secs(agent.cfg.alloc_retention_s);
        let a = agent.clone();
        let _ = tokio::task::spawn_blocking(move || gc_pass(&a, retention)).await;
        if !crate::control::pause(&agent, Duration::from_secs(600).min(retention.max(Duration::from_secs(1)))).await {
            return;
        }
    }
}

/// Deletes the allocation directories whose final status was acknowledged at least
/// `retention` ago and whose task has ended; returns how many went.
pub(crate) fn gc_pass(agent: &Agent, retention: Duration) -> usize {
    let mut removed = 0;
    let Ok(rd) = std::fs::read_dir(agent.cfg.allocs_dir()) else {
        return 0;
    };
    for e in rd.filter_map(Result::ok).take(100_000) {
        let marker = e.path().join("reported");
        let old = std::fs::metadata(&marker)
            .and_then(|m| m.modified())
            .ok()
            .is_some_and(|t| t.elapsed().unwrap_or_default() >= retention);
        let Some(k) = e.file_name().to_str().and_then(parse_dir_name) else {
            continue;
        };
        // An ended task keeps its entry until its allocation leaves the node's set: the entry,
        // not the directory, then stops a stale set from starting it again.
        if old && lock(agent).map.get(&k).is_none_or(|e| e.ended) {
            match std::fs::remove_dir_all(e.path()) {
                Ok(()) => removed += 1,
                Err(err) => {
                    tracing::warn!(dir = %e.path().display(), error = %err, "removing a finished allocation directory");
                }
            }
            if let Some(c) = &agent.cgroups {
                c.remove(&dir_name(k));
            }
        }
    }
    removed
}

/// Whether the task of an allocation directory has ended (for log following): it has an exit
/// record, or no shim holds its lock.
pub(crate) fn finished(dir: &Path) -> bool {
    if dir.join(crate::shim::EXIT_FILE).exists() || dir.join("reported").exists() {
        return true;
    }
    !dir.join(crate::shim::SHIM_FILE).exists() && !dir.join("task.json").exists()
        || matches!(sys::try_lock(&dir.join(crate::shim::LOCK_FILE)), Ok(Some(_)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn alloc(desired: &str, state: &str, command: &[&str]) -> pb::AllocInfo {
        pb::AllocInfo {
            id: 7,
            epoch: 1,
            desired: desired.into(),
            state: state.into(),
            command: command.iter().map(|c| (*c).to_owned()).collect(),
            ..pb::AllocInfo::default()
        }
    }

    #[test]
    fn reconcile_starts_what_is_wanted_and_refuses_what_cannot_run() {
        let run = alloc("run", "pending", &["sleep", "1"]);
        assert_eq!(alloc_action(&run, false, false, 0, 4), AllocAction::Start);
        assert_eq!(alloc_action(&run, true, false, 0, 4), AllocAction::Keep, "already handled");
        assert_eq!(alloc_action(&run, false, true, 0, 4), AllocAction::Recover(None), "restarted agent");
        let AllocAction::Refuse(st, msg) = alloc_action(&run, false, false, 4, 4) else { panic!("node full") };
        assert_eq!((st, msg.as_str()), (pb::AllocReport::Failed, "the node runs max_tasks = 4 tasks already"));
        let lost = alloc("run", "running", &["sleep", "1"]);
        assert!(
            matches!(alloc_action(&lost, false, false, 0, 4), AllocAction::Refuse(pb::AllocReport::Failed, m) if m.starts_with("lost:"))
        );
        let none = alloc("run", "pending", &[]);
        assert!(
            matches!(alloc_action(&none, false, false, 0, 4), AllocAction::Refuse(_, m) if m.starts_with("no task"))
        );
    }

    #[test]
    fn reconcile_stops_what_is_no_longer_wanted() {
        let mut stop = alloc("stop", "running", &["x"]);
        assert_eq!(alloc_action(&stop, true, false, 1, 4), AllocAction::Stop("asked by the control plane".into()));
        assert_eq!(
            alloc_action(&stop, false, false, 0, 4),
            AllocAction::Refuse(pb::AllocReport::Stopped, "stopped before it started".into())
        );
        stop.stop_reason = "preempted".into();
        assert_eq!(alloc_action(&stop, true, false, 1, 4), AllocAction::Stop("preempted".into()));
        assert_eq!(alloc_action(&stop, false, true, 0, 4), AllocAction::Recover(Some("preempted".into())));
        // Only a fresh set stops what it does not list; ended tasks are forgotten instead.
        let handled = [((1, 1), false), ((2, 1), true), ((3, 1), false)];
        let in_set: BTreeSet<Key> = [(1, 1)].into();
        assert_eq!(unlisted(handled.into_iter(), &in_set), [((2, 1), true), ((3, 1), false)]);
    }

    #[test]
    fn an_older_set_only_starts_until_it_has_been_older_for_two_minutes() {
        assert_eq!(freshness(5, 5, Duration::ZERO), Freshness::Fresh);
        assert_eq!(freshness(6, 5, Duration::ZERO), Freshness::Fresh);
        assert_eq!(freshness(4, 5, Duration::ZERO), Freshness::StartOnly);
        assert_eq!(freshness(4, 5, STALE_ACCEPTED_AFTER), Freshness::StartOnly);
        assert_eq!(freshness(4, 5, STALE_ACCEPTED_AFTER + Duration::from_millis(1)), Freshness::Reset);
    }

    #[test]
    fn dir_names_round_trip() {
        assert_eq!(parse_dir_name(&dir_name((12, 3))), Some((12, 3)));
        assert_eq!(parse_dir_name("x-1"), None);
        assert_eq!(parse_dir_name("12"), None);
    }

    #[test]
    fn final_reports() {
        let d = tempfile::tempdir().unwrap();
        let ok = ExitRecord { exit_code: Some(0), ..ExitRecord::default() };
        let r = final_report((1, 1), d.path(), Some(&ok), "");
        assert_eq!((r.status, r.exit_code), (pb::AllocReport::Succeeded, 0));
        let bad = ExitRecord { exit_code: Some(3), ..ok.clone() };
        let r = final_report((1, 1), d.path(), Some(&bad), "");
        assert_eq!((r.status, r.message.as_str(), r.exit_code), (pb::AllocReport::Failed, "exit code 3", 3));
        let sig = ExitRecord { exit_code: None, signal: Some(9), ..ok.clone() };
        let r = final_report((1, 1), d.path(), Some(&sig), "");
        assert_eq!((r.status, r.message.as_str(), r.exit_code), (pb::AllocReport::Failed, "killed by signal 9", 137));
        let r = final_report((1, 1), d.path(), None, "lost: x");
        assert_eq!((r.status, r.message.as_str()), (pb::AllocReport::Failed, "lost: x"));
        write_stop(d.path(), "preempted", None);
        let r = final_report((1, 1), d.path(), Some(&sig), "");
        assert_eq!(r.status, pb::AllocReport::Stopped);
        assert!(r.message.starts_with("stopped: preempted"), "{}", r.message);
    }

    #[test]
    fn fenced_reports() {
        let d = tempfile::tempdir().unwrap();
        let now = sys::now_ms();
        let fenced =
            ExitRecord { signal: Some(15), fenced: true, fenced_at_ms: Some(now - 1000), ..ExitRecord::default() };
        let r = final_report((1, 1), d.path(), Some(&fenced), "");
        assert_eq!((r.status, r.exit_code), (pb::AllocReport::Failed, 143));
        assert!(r.message.starts_with("fenced: ") && r.message.ends_with("killed by signal 15"), "{}", r.message);
        let early = ExitRecord {
            exit_code: Some(127),
            error: Some("fenced before start: no lease at /x".into()),
            fenced: true,
            ..ExitRecord::default()
        };
        let r = final_report((1, 1), d.path(), Some(&early), "");
        assert_eq!((r.status, r.message.as_str()), (pb::AllocReport::Failed, "fenced: not started: no lease at /x"));
        // A stop asked for after the fence (the agent came back and found the allocation
        // gone) does not hide the fence; one asked for before it wins.
        write_stop(d.path(), "no longer assigned", None);
        let r = final_report((1, 1), d.path(), Some(&fenced), "");
        assert!(r.message.starts_with("fenced: "), "{}", r.message);
        let later = ExitRecord { fenced_at_ms: Some(now + 60_000), ..fenced.clone() };
        let r = final_report((1, 1), d.path(), Some(&later), "");
        assert_eq!(r.status, pb::AllocReport::Stopped, "{}", r.message);
    }

    #[test]
    fn federation_lease_stops_are_reported_stopped() {
        let d = tempfile::tempdir().unwrap();
        let now = sys::now_ms();
        let msg = "federation lease ended at 5000 (g-3 epoch 2)";
        let fed = ExitRecord {
            signal: Some(15),
            fenced: true,
            fenced_at_ms: Some(now - 1000),
            fed_stop: Some(msg.into()),
            ..ExitRecord::default()
        };
        let r = final_report((1, 1), d.path(), Some(&fed), "");
        assert_eq!((r.status, r.message.as_str(), r.end), (pb::AllocReport::Stopped, msg, "stopped"));
        let not_started = "federation lease of g-3 epoch 2 ends at 5000: not started";
        let early = ExitRecord {
            exit_code: Some(127),
            error: Some(not_started.into()),
            fenced: true,
            fed_stop: Some(not_started.into()),
            ..ExitRecord::default()
        };
        let r = final_report((1, 1), d.path(), Some(&early), "");
        assert_eq!((r.status, r.message.as_str()), (pb::AllocReport::Stopped, not_started));
        // A stop the control plane asked for before the lease ran out wins.
        write_stop(d.path(), "cancelled", None);
        let later = ExitRecord { fenced_at_ms: Some(now + 60_000), ..fed };
        let r = final_report((1, 1), d.path(), Some(&later), "");
        assert!(r.message.starts_with("stopped: cancelled"), "{}", r.message);
    }

    #[test]
    fn a_federated_alloc_carries_its_identity_to_the_journal() {
        let a =
            pb::AllocInfo { id: 4, epoch: 1, global_job_id: "g-9".into(), fed_epoch: 3, ..pb::AllocInfo::default() };
        let v = alloc_json(&a, "n1", None, &[]);
        assert_eq!((v["global_id"].as_str(), v["fed_epoch"].as_u64()), (Some("g-9"), Some(3)));
    }

    #[test]
    fn ends_are_classified() {
        let code = |c: i32| ExitRecord { exit_code: Some(c), started_at_ms: Some(1), ..ExitRecord::default() };
        let sig = |s: i32| ExitRecord { signal: Some(s), started_at_ms: Some(1), ..ExitRecord::default() };
        assert_eq!(end_class(None, Some(&code(0)), false), ("succeeded", true));
        assert_eq!(end_class(None, Some(&code(0)), true), ("succeeded", true), "it finished anyway");
        assert_eq!(end_class(None, Some(&code(3)), false), ("exit", true));
        assert_eq!(end_class(None, Some(&sig(9)), false), ("exit", false), "a SIGKILL the agent did not send");
        let oom = ExitRecord { oom_kills: Some(1), ..sig(9) };
        assert_eq!(end_class(None, Some(&oom), false), ("oom", false));
        assert_eq!(end_class(None, Some(&ExitRecord { oom_kills: Some(0), ..sig(9) }), false), ("exit", false));
        assert_eq!(end_class(None, Some(&code(1)), true), ("device_error", true));
        assert_eq!(end_class(Some("preempted"), Some(&code(143)), false), ("stopped", true));
        assert_eq!(end_class(Some("preempted"), Some(&sig(9)), false), ("stopped", false));
        assert_eq!(end_class(Some("device_unhealthy"), Some(&sig(15)), false), ("device_error", false));
        let not_started =
            ExitRecord { exit_code: Some(127), error: Some("cannot start".into()), ..ExitRecord::default() };
        assert_eq!(end_class(None, Some(&not_started), false), ("start_failed", false));
        let quota = ExitRecord { started_at_ms: Some(1), ..not_started.clone() };
        assert_eq!(end_class(None, Some(&quota), false), ("exit", false), "killed for its disk quota");
        let no_restore = ExitRecord { end: Some("node_lost".into()), ..not_started.clone() };
        assert_eq!(end_class(None, Some(&no_restore), false), ("node_lost", false));
        assert_eq!(end_class(None, None, false), ("node_lost", false), "the shim is gone");
        // Through final_report: a fence is node_lost; refusals are classified too.
        let d = tempfile::tempdir().unwrap();
        let fenced = ExitRecord { signal: Some(15), fenced: true, fenced_at_ms: Some(1), ..ExitRecord::default() };
        let r = final_report((1, 1), d.path(), Some(&fenced), "");
        assert_eq!((r.end, r.exit_code_set), ("node_lost", false));
        std::fs::write(d.path().join(crate::ckpt::DEVICE_ERROR_FILE), "gpu0: XID 79\n").unwrap();
        let r = final_report((1, 1), d.path(), Some(&code(1)), "");
        assert_eq!(r.end, "device_error");
        assert!(r.message.ends_with("gpu0: XID 79"), "{}", r.message);
        assert_eq!(refused_end(pb::AllocReport::Stopped, "stopped before it started"), "stopped");
        assert_eq!(refused_end(pb::AllocReport::Failed, "lost: x"), "node_lost");
        assert_eq!(refused_end(pb::AllocReport::Failed, "no task"), "start_failed");
    }

    #[test]
    fn a_checkpoint_first_stop_needs_a_signal_a_grace_and_the_flag() {
        let cfg = AgentConfig { stop_grace_max_ms: 20_000, ..AgentConfig::default() };
        let mut a = pb::AllocInfo {
            checkpoint_first: true,
            grace_s: 30,
            checkpoint_signal: "SIGUSR1".into(),
            ..pb::AllocInfo::default()
        };
        assert_eq!(
            checkpoint_ask(&cfg, &a),
            Some(CheckpointAsk { signal: libc::SIGUSR1, name: "SIGUSR1", wait: Duration::from_secs(20) }),
            "bounded by stop_grace_max_ms"
        );
        a.checkpoint_signal = "SIGUSR2".into();
        a.grace_s = 5;
        assert_eq!(checkpoint_ask(&cfg, &a).map(|c| (c.signal, c.wait)), Some((libc::SIGUSR2, Duration::from_secs(5))));
        for bad in [
            pb::AllocInfo { checkpoint_first: false, ..a.clone() },
            pb::AllocInfo { grace_s: 0, ..a.clone() },
            pb::AllocInfo { checkpoint_signal: String::new(), ..a.clone() },
            pb::AllocInfo { checkpoint_signal: "SIGKILL".into(), ..a.clone() },
        ] {
            assert_eq!(checkpoint_ask(&cfg, &bad), None, "{bad:?}");
        }
    }

    #[test]
    fn grace_is_bounded() {
        let c = AgentConfig { stop_grace_min_ms: 500, stop_grace_max_ms: 5000, ..AgentConfig::default() };
        assert_eq!(grace(&c, 0), Duration::from_millis(500));
        assert_eq!(grace(&c, 2), Duration::from_millis(2000));
        assert_eq!(grace(&c, 1000), Duration::from_millis(5000));
    }
}

/// The checkpoint protocol against a real trainer process and a fake control plane that
/// records what it is told.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod protocol_tests {
    use super::*;
    use std::sync::Mutex;
    use tonic::{Request, Response, Status};

    #[derive(Default, Clone)]
    struct FakeControlPlane {
        checkpoints: Arc<Mutex<Vec<pb::ReportCheckpointRequest>>>,
        /// Reports of this epoch are refused as stale.
        stale_epoch: u64,
    }

    #[tonic::async_trait]
    impl pb::agent_server::Agent for FakeControlPlane {
        async fn register(
            &self,
            _: Request<pb::RegisterNodeRequest>,
        ) -> Result<Response<pb::RegisterNodeResponse>, Status> {
            Err(Status::unimplemented("test"))
        }
        async fn heartbeat(&self, _: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatResponse>, Status> {
            Err(Status::unimplemented("test"))
        }
        type WatchAllocationsStream = tokio_stream::Pending<Result<pb::AllocationsUpdate, Status>>;
        async fn watch_allocations(
            &self,
            _: Request<pb::WatchAllocationsRequest>,
        ) -> Result<Response<Self::WatchAllocationsStream>, Status> {
            Err(Status::unimplemented("test"))
        }
        async fn report_status(
            &self,
            _: Request<pb::ReportStatusRequest>,
        ) -> Result<Response<pb::ReportStatusResponse>, Status> {
            Ok(Response::new(pb::ReportStatusResponse {}))
        }
        async fn report_checkpoint(
            &self,
            r: Request<pb::ReportCheckpointRequest>,
        ) -> Result<Response<pb::ReportCheckpointResponse>, Status> {
            let r = r.into_inner();
            let stale = r.epoch == self.stale_epoch;
            self.checkpoints.lock().unwrap().push(r);
            if stale {
                return Err(Status::failed_precondition("stale epoch"));
            }
            Ok(Response::new(pb::ReportCheckpointResponse {}))
        }
    }

    async fn serve(cp: FakeControlPlane) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(pb::agent_server::AgentServer::new(cp))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        addr
    }

    fn trainer() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/trainer/trainer.py")
    }

    /// An allocation directory as `start` leaves it, and a process started in its own session.
    fn spawn(agent: &Agent, k: Key, program: &str, args: &[String]) -> (PathBuf, tokio::process::Child, PathBuf) {
        let dir = alloc_dir(agent, k);
        std::fs::create_dir_all(dir.join(crate::ckpt::CHECKPOINT_DIR)).unwrap();
        let a = pb::AllocInfo { id: k.0, epoch: k.1, job_id: 9, ..pb::AllocInfo::default() };
        std::fs::write(dir.join(crate::shim::ALLOC_FILE), alloc_json(&a, "n1", None, &[]).to_string()).unwrap();
        let journal = dir.join("trainer.jsonl");
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .env("SUANLI_CHECKPOINT_DIR", dir.join(crate::ckpt::CHECKPOINT_DIR))
            .env("SUANLI_JOB_ID", "9")
            .env("SUANLI_ATTEMPT", k.1.to_string())
            .env("TRAINER_JOURNAL", &journal);
        sys::new_session(&mut cmd);
        (dir, cmd.spawn().unwrap(), journal)
    }

    /// Waits (bounded) until the trainer's journal has an event `ev`.
    async fn journal_has(path: &Path, ev: &str) -> Vec<serde_json::Value> {
        for _ in 0..200 {
            let lines: Vec<serde_json::Value> = std::fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            if lines.iter().any(|l| l["event"] == ev) {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("no {ev} event in {}", path.display());
    }

    fn stop_record(dir: &Path) -> StopRecord {
        read_json(&dir.join("stop.json")).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_first_stop_gets_a_new_checkpoint_reported_before_the_sigterm() {
        let cp = FakeControlPlane::default();
        let data = tempfile::tempdir().unwrap();
        let cfg = AgentConfig {
            servers: vec![serve(cp.clone()).await],
            data_dir: data.path().to_owned(),
            ..AgentConfig::default()
        };
        let agent = crate::test_agent(cfg).await;
        let k = (1, 3);
        let args: Vec<String> =
            ["--steps", "100000", "--step-s", "0.02", "--checkpoint-every", "25"].map(String::from).into();
        let (dir, child, journal) = spawn(&agent, k, &trainer().display().to_string(), &args);
        let pid = i32::try_from(child.id().unwrap()).unwrap();
        let (tx, rx) = watch::channel(None);
        let sup = tokio::spawn(supervise(agent.clone(), k, dir.clone(), Waiter::Child(child), pid, rx));
        // A periodic checkpoint is stored and reported while it runs.
        journal_has(&journal, "checkpoint").await;
        for _ in 0..200 {
            if !cp.checkpoints.lock().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let ask = CheckpointAsk { signal: libc::SIGUSR1, name: "SIGUSR1", wait: Duration::from_secs(20) };
        tx.send_replace(Some(Stop {
            reason: "preempted".into(),
            grace: Duration::from_secs(5),
            checkpoint: Some(ask),
        }));
        tokio::time::timeout(Duration::from_secs(30), sup).await.unwrap().unwrap();
        let lines = journal_has(&journal, "exit").await;
        let last = lines.last().unwrap();
        assert_eq!((last["event"].as_str(), last["code"].as_u64()), (Some("exit"), Some(143)), "{last}");
        let final_ckpt = lines.iter().rev().find(|l| l["event"] == "checkpoint").unwrap()["step"].as_u64().unwrap();
        let reported = cp.checkpoints.lock().unwrap().clone();
        assert!(reported.len() >= 2, "a periodic and the asked-for checkpoint: {reported:?}");
        let r = reported.last().unwrap();
        assert_eq!((r.alloc_id, r.epoch, r.step), (1, 3, final_ckpt), "the stop's checkpoint was the last reported");
        assert!(r.uri.contains(&format!("jobs/9/a3-s{final_ckpt}")), "{}", r.uri);
        assert!(reported.windows(2).all(|w| w[0].step < w[1].step), "steps only grow");
        let s = stop_record(&dir);
        assert_eq!(s.checkpoint, Some(format!("checkpoint at step {final_ckpt} within the grace")));
        assert_eq!(crate::ckpt::reported_step(&dir), final_ckpt);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_that_does_not_checkpoint_is_terminated_after_the_wait() {
        let cp = FakeControlPlane::default();
        let data = tempfile::tempdir().unwrap();
        let cfg = AgentConfig {
            servers: vec![serve(cp.clone()).await],
            data_dir: data.path().to_owned(),
            ..AgentConfig::default()
        };
        let agent = crate::test_agent(cfg).await;
        let k = (2, 1);
        // Ignores the checkpoint signal; exits 143 on SIGTERM.
        let script = "trap '' USR1; trap 'exit 143' TERM; echo '{\"event\":\"start\"}' >> \"$TRAINER_JOURNAL\"; while :; do sleep 0.05; done";
        let (dir, child, journal) = spawn(&agent, k, "/bin/sh", &["-c".into(), script.into()]);
        let pid = i32::try_from(child.id().unwrap()).unwrap();
        let (tx, rx) = watch::channel(None);
        let sup = tokio::spawn(supervise(agent.clone(), k, dir.clone(), Waiter::Child(child), pid, rx));
        journal_has(&journal, "start").await;
        let t0 = Instant::now();
        let ask = CheckpointAsk { signal: libc::SIGUSR1, name: "SIGUSR1", wait: Duration::from_millis(600) };
        tx.send_replace(Some(Stop { reason: "drain".into(), grace: Duration::from_secs(5), checkpoint: Some(ask) }));
        tokio::time::timeout(Duration::from_secs(30), sup).await.unwrap().unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(600), "waited for the checkpoint");
        assert!(t0.elapsed() < Duration::from_secs(5), "SIGTERM ended it, not SIGKILL: {:?}", t0.elapsed());
        assert_eq!(stop_record(&dir).checkpoint, Some("no checkpoint within 0 s (last step 0)".into()));
        assert!(cp.checkpoints.lock().unwrap().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_report_and_a_bad_manifest_do_not_stop_the_watcher() {
        let cp = FakeControlPlane { stale_epoch: 4, ..FakeControlPlane::default() };
        let data = tempfile::tempdir().unwrap();
        let cfg = AgentConfig {
            servers: vec![serve(cp.clone()).await],
            data_dir: data.path().to_owned(),
            ..AgentConfig::default()
        };
        let agent = crate::test_agent(cfg).await;
        let k = (3, 4);
        // Commits step 5, then a manifest that lies about its size, then exits 0.
        let script = r#"d="$SUANLI_CHECKPOINT_DIR"; mkdir "$d/c5"; printf 12345 > "$d/c5/s";
            printf '{"step":5,"wall_time":1,"path":"c5","bytes":5}' > "$d/.m"; mv "$d/.m" "$d/suanli-checkpoint.json";
            sleep 0.6; printf '{"step":6,"wall_time":1,"path":"c5","bytes":999}' > "$d/.m"; mv "$d/.m" "$d/suanli-checkpoint.json";
            sleep 0.6"#;
        let (dir, child, _journal) = spawn(&agent, k, "/bin/sh", &["-c".into(), script.into()]);
        let pid = i32::try_from(child.id().unwrap()).unwrap();
        let (_tx, rx) = watch::channel(None);
        tokio::time::timeout(
            Duration::from_secs(30),
            supervise(agent.clone(), k, dir.clone(), Waiter::Child(child), pid, rx),
        )
        .await
        .unwrap();
        let reported = cp.checkpoints.lock().unwrap().clone();
        assert_eq!(reported.iter().map(|r| r.step).collect::<Vec<_>>(), [5], "refused once, not retried; step 6 lies");
        assert_eq!(crate::ckpt::reported_step(&dir), 5);
    }
}
