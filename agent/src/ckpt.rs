//! The task side of the checkpoint protocol (docs/checkpoints.md): each running task's
//! `SUANLI_CHECKPOINT_DIR` is polled for a new commit, which is uploaded to the checkpoint
//! store and reported to the control plane; and a checkpoint to restore from is fetched before
//! the task starts.
//!
//! ```text
//!  every 200 ms (and once more after the task ended):
//!    read_committed(<alloc dir>/checkpoint) ─┬─ none, or step ≤ last reported ─▶ nothing
//!                                            ├─ refused ─▶ warn once per distinct reason
//!                                            └─ new step ─▶ Store::put ─▶ ReportCheckpoint ─▶ `checkpoint-reported`
//!                                                                                         └─▶ reported step (watch) ─▶ stop protocol
//!    a device of the allocation unhealthy ─▶ `device-error` (the end is classified device_error)
//! ```
//!
//! The last reported step is kept in `<alloc dir>/checkpoint-reported`, so an agent that adopts
//! a running task after a restart does not report a checkpoint twice. A refused manifest, a
//! failed upload or a refused report never ends the task or the watcher.

use crate::Agent;
use crate::checkpoint::{Committed, ManifestLimits, Store};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use suanli_proto::v1 as pb;
use tokio::sync::watch;
use tonic::Code;

/// The checkpoint directory inside an allocation directory (`SUANLI_CHECKPOINT_DIR`).
pub const CHECKPOINT_DIR: &str = "checkpoint";
/// Where a checkpoint to restore from is downloaded, inside an allocation directory.
pub const RESTORE_DIR: &str = "restore";
/// The last step reported, inside an allocation directory.
pub const REPORTED_FILE: &str = "checkpoint-reported";
/// Written when a device of the allocation turned unhealthy while the task ran.
pub const DEVICE_ERROR_FILE: &str = "device-error";
/// How often the checkpoint directory is polled (the protocol's promise to tasks).
pub const POLL_EVERY: Duration = Duration::from_millis(200);
/// Tries of one ReportCheckpoint that fails for a transient reason (a refusal is not retried).
pub const REPORT_TRIES: u32 = 8;

/// The hardware a hardware-bound checkpoint of this allocation needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Hardware {
    /// Device kind (`gpu`, `npu`).
    pub kind: String,
    /// Device model as the plugin reports it.
    pub model: String,
    /// Devices of the allocation.
    pub count: u32,
}

/// The part of `alloc.json` the watcher needs (written by the agent before the shim starts).
#[derive(Debug, Clone, Deserialize)]
pub struct Watched {
    /// Allocation id.
    pub id: u64,
    /// The attempt (epoch).
    pub epoch: u64,
    /// Job id.
    pub job_id: u64,
    /// The checkpoint store's URL (empty: the agent's own).
    #[serde(default)]
    pub checkpoint_store: String,
    /// The step the attempt restored from (0: none).
    #[serde(default)]
    pub restore_step: u64,
    /// The allocation's devices' hardware (none: no devices).
    #[serde(default)]
    pub hardware: Option<Hardware>,
    /// Device ids of the allocation.
    #[serde(default)]
    pub devices: Vec<DeviceRef>,
}

/// A device of `alloc.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct DeviceRef {
    /// Device id.
    pub device: String,
}

impl Watched {
    /// Reads it from an allocation directory's `alloc.json`.
    pub fn read(dir: &Path) -> Option<Watched> {
        let b = std::fs::read(dir.join(crate::shim::ALLOC_FILE)).ok()?;
        serde_json::from_slice(&b).ok()
    }
}

/// The hardware of the devices `ids` as the agent's inventory knows them.
pub(crate) fn hardware_of(agent: &Agent, ids: &[String]) -> Option<Hardware> {
    let first = ids.first()?;
    let devs = agent.plugins.devices();
    let d = devs.iter().find(|d| &d.device.id == first)?;
    Some(Hardware {
        kind: d.device.kind.as_str().to_owned(),
        model: d.device.model.clone(),
        count: u32::try_from(ids.len()).unwrap_or(u32::MAX),
    })
}

/// Opens the store named by a checkpoint store URL (empty: `<data_dir>/checkpoints`).
pub(crate) fn open_store(agent: &Agent, url: &str) -> Result<Store, String> {
    let local = agent.cfg.data_dir.join("checkpoints");
    Store::open(url, &local).map_err(|e| format!("checkpoint store {url:?}: {e}"))
}

/// Downloads the checkpoint at `uri` into `<dir>/restore`: the local path to restore from and
/// its step.
pub(crate) async fn fetch(agent: &Agent, store_url: &str, uri: &str, dir: &Path) -> Result<(PathBuf, u64), String> {
    let store = open_store(agent, store_url)?;
    let (path, m) = store
        .get(uri, &dir.join(RESTORE_DIR))
        .await
        .map_err(|e| format!("fetching the checkpoint {uri} to restore from: {e}"))?;
    Ok((path, m.step))
}

/// The last step reported for an allocation directory (0: none).
pub fn reported_step(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join(REPORTED_FILE)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// A task's checkpoints as the watcher knows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// The step of the newest valid commit seen (being stored, or stored).
    pub seen: u64,
    /// The step of the newest checkpoint stored and reported.
    pub reported: u64,
}

/// What one poll of the checkpoint directory found.
#[derive(Debug)]
pub(crate) enum Poll {
    /// No manifest, or none newer than `last`.
    Nothing,
    /// A new commit.
    New(Committed),
    /// A refused manifest, with the reason.
    Refused(String),
}

/// Reads the checkpoint directory once: a commit is new when its step is above `last`.
pub(crate) fn poll(dir: &Path, last: u64, limits: &ManifestLimits) -> Poll {
    // The manifest alone first (cheap): the files are walked only for a new step.
    match crate::checkpoint::read_manifest(dir, limits) {
        Ok(None) => return Poll::Nothing,
        Ok(Some(m)) if m.step <= last => return Poll::Nothing,
        Ok(Some(_)) => {}
        Err(e) => return Poll::Refused(e.to_string()),
    }
    match crate::checkpoint::read_committed(dir, limits) {
        Ok(None) => Poll::Nothing,
        Ok(Some(c)) if c.manifest.step <= last => Poll::Nothing,
        Ok(Some(c)) => Poll::New(c),
        Err(e) => Poll::Refused(e.to_string()),
    }
}

/// Watches one task's checkpoint directory until `ended` turns true, then looks once more (a
/// task often commits right before it exits) and returns. `progress` says what it has seen and
/// reported.
pub(crate) async fn watch(
    agent: Arc<Agent>,
    dir: PathBuf,
    progress: watch::Sender<Progress>,
    mut ended: watch::Receiver<bool>,
) {
    let Some(w) = Watched::read(&dir) else {
        tracing::warn!(dir = %dir.display(), "no readable alloc.json: checkpoints of this task are not watched");
        return;
    };
    let store = match open_store(&agent, &w.checkpoint_store) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(error = %e, "checkpoints of this task cannot be stored");
            None
        }
    };
    let ckpt_dir = dir.join(CHECKPOINT_DIR);
    let mut last = reported_step(&dir).max(w.restore_step);
    progress.send_replace(Progress { seen: last, reported: last });
    let mut said = String::new();
    let mut device_error = dir.join(DEVICE_ERROR_FILE).exists();
    let mut tick = tokio::time::interval(POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut open = true;
    loop {
        let last_pass = tokio::select! {
            _ = tick.tick() => false,
            r = ended.changed(), if open => {
                if r.is_err() { open = false; }
                *ended.borrow() || r.is_err()
            }
        };
        if !device_error {
            device_error = check_devices(&agent, &w, &dir);
        }
        let d = ckpt_dir.clone();
        let limits = ManifestLimits::default();
        let found = tokio::task::spawn_blocking(move || poll(&d, last, &limits))
            .await
            .unwrap_or_else(|e| Poll::Refused(format!("reading the manifest: {e}")));
        match found {
            Poll::Nothing => {}
            Poll::Refused(why) => {
                if why != said {
                    tracing::warn!(dir = %ckpt_dir.display(), reason = %why, "checkpoint manifest refused; keeping the last good checkpoint");
                    said = why;
                }
            }
            Poll::New(c) => {
                progress.send_modify(|p| p.seen = p.seen.max(c.manifest.step));
                if let Some(store) = &store {
                    match commit(&agent, &w, store, &ckpt_dir, &c).await {
                        Ok(()) => {
                            last = c.manifest.step;
                            if let Err(e) =
                                crate::sys::write_atomic(&dir.join(REPORTED_FILE), last.to_string().as_bytes())
                            {
                                tracing::warn!(error = %e, "recording the reported checkpoint step");
                            }
                            progress.send_modify(|p| p.reported = last);
                        }
                        Err(why) => {
                            if why != said {
                                tracing::warn!(step = c.manifest.step, error = %why, "checkpoint not stored; trying again at the next poll");
                                said = why;
                            }
                        }
                    }
                }
            }
        }
        if last_pass {
            return;
        }
    }
}

/// Marks the allocation when one of its devices is unhealthy now; true when marked.
fn check_devices(agent: &Agent, w: &Watched, dir: &Path) -> bool {
    if w.devices.is_empty() {
        return false;
    }
    let devs = agent.plugins.devices();
    let Some(bad) = devs.iter().find(|d| {
        w.devices.iter().any(|x| x.device == d.device.id) && d.device.health != suanli_model::Health::Healthy
    }) else {
        return false;
    };
    let text = format!("{}: {}\n", bad.device.id, bad.reason);
    tracing::warn!(device = %bad.device.id, reason = %bad.reason, "a device of the task turned unhealthy while it ran");
    if let Err(e) = crate::sys::write_atomic(&dir.join(DEVICE_ERROR_FILE), text.as_bytes()) {
        tracing::warn!(error = %e, "writing the device-error marker");
    }
    true
}

/// Stores a new commit and reports it. A report the control plane refuses (a stale attempt)
/// counts as done: it will never be accepted.
async fn commit(agent: &Agent, w: &Watched, store: &Store, ckpt_dir: &Path, c: &Committed) -> Result<(), String> {
    let seen = std::time::SystemTime::now();
    let uri = store.put(w.job_id, w.epoch, ckpt_dir, c).await.map_err(|e| format!("uploading: {e}"))?;
    let m = &c.manifest;
    let hw = if m.hardware_bound { w.hardware.clone().unwrap_or_default() } else { Hardware::default() };
    let req = pb::ReportCheckpointRequest {
        alloc_id: w.id,
        epoch: w.epoch,
        uri: uri.clone(),
        step: m.step,
        size_bytes: m.bytes,
        wall_time: m.wall_time,
        hardware_bound: m.hardware_bound,
        device_kind: hw.kind,
        device_model: hw.model,
        device_count: hw.count,
    };
    let mut backoff = crate::control::retry_delays(&agent.cfg);
    for attempt in 1..=REPORT_TRIES {
        let r = agent
            .servers
            .call(|mut cl| {
                let req = req.clone();
                async move { cl.report_checkpoint(req).await }
            })
            .await;
        match r {
            Ok(_) => {
                crate::telemetry::checkpoint(w.id, w.epoch, m.step, m.bytes, seen);
                tracing::info!(step = m.step, bytes = m.bytes, uri = %uri, "checkpoint stored and reported");
                return Ok(());
            }
            Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::NotFound | Code::InvalidArgument) => {
                tracing::warn!(step = m.step, code = ?s.code(), error = %s.message(),
                    "checkpoint report refused by the control plane (a stale attempt?); not retried");
                return Ok(());
            }
            Err(s) if attempt == REPORT_TRIES => {
                return Err(format!("reporting step {} failed {REPORT_TRIES} times: {}", m.step, s.message()));
            }
            Err(s) => {
                tracing::debug!(code = ?s.code(), error = %s.message(), attempt, "checkpoint report failed; retrying");
                if !crate::control::pause(agent, backoff.next_or_max()).await {
                    return Err("the agent is stopping".into());
                }
            }
        }
    }
    Err(format!("reporting step {} failed", m.step))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn commit_manifest(dir: &Path, step: u64, bytes: u64) {
        let ck = dir.join(format!("ckpt-{step}"));
        std::fs::create_dir_all(&ck).unwrap();
        std::fs::write(ck.join("state.json"), vec![b'x'; usize::try_from(bytes).unwrap()]).unwrap();
        let m = serde_json::json!({"step": step, "wall_time": 1, "path": format!("ckpt-{step}"), "bytes": bytes});
        let tmp = dir.join(".m.tmp");
        std::fs::write(&tmp, m.to_string()).unwrap();
        std::fs::rename(tmp, dir.join(suanli_model::MANIFEST_FILE)).unwrap();
    }

    #[test]
    fn a_commit_is_new_only_above_the_last_step_and_a_bad_manifest_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let l = ManifestLimits::default();
        assert!(matches!(poll(d.path(), 0, &l), Poll::Nothing), "no manifest yet");
        commit_manifest(d.path(), 5, 10);
        assert!(matches!(poll(d.path(), 0, &l), Poll::New(c) if c.manifest.step == 5));
        assert!(matches!(poll(d.path(), 5, &l), Poll::Nothing), "already reported");
        assert!(matches!(poll(d.path(), 9, &l), Poll::Nothing), "older than the restored step");
        std::fs::write(d.path().join(suanli_model::MANIFEST_FILE), b"{\"step\": 7, \"wall").unwrap();
        assert!(matches!(poll(d.path(), 5, &l), Poll::Refused(_)), "truncated");
    }

    #[test]
    fn the_reported_step_survives_in_the_allocation_directory() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(reported_step(d.path()), 0);
        crate::sys::write_atomic(&d.path().join(REPORTED_FILE), b"42").unwrap();
        assert_eq!(reported_step(d.path()), 42);
    }

    #[tokio::test]
    async fn a_stored_checkpoint_is_fetched_on_another_node() {
        let store_dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", store_dir.path().display());
        let a = tempfile::tempdir().unwrap();
        commit_manifest(a.path(), 12, 7);
        let Poll::New(c) = poll(a.path(), 0, &ManifestLimits::default()) else { panic!("no commit") };
        let store = Store::open(&url, a.path()).unwrap();
        let uri = store.put(5, 2, a.path(), &c).await.unwrap();
        assert!(uri.ends_with("jobs/5/a2-s12"), "{uri}");
        let b = tempfile::tempdir().unwrap();
        let (path, m) = Store::open(&url, b.path()).unwrap().get(&uri, &b.path().join(RESTORE_DIR)).await.unwrap();
        assert_eq!(m.step, 12);
        assert_eq!(std::fs::read(path.join("state.json")).unwrap(), vec![b'x'; 7]);
    }
}
