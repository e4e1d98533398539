//! Device-error remediation (ABI 1.3): what the agent does with a health event's class.
//!
//! ```text
//!  application (healthy = true, class 1) ─▶ the device stays in service; every task holding it
//!                                           gets a JSON line in <alloc dir>/device-events
//!  recoverable (class 2, or unknown)      ─▶ Recovering: the device is reported unhealthy, so the
//!        control plane stops its tasks (checkpoint first) and places nothing on it
//!        ─▶ once no reservation holds it: plugin `reset`, then a fingerprint
//!             healthy ─▶ back in service          not healthy / reset failed ─▶ retry with backoff
//!        ─▶ MAX_RESET_ATTEMPTS resets that did not help, or a device recovered
//!           MAX_RECOVERIES_PER_HOUR times within the hour ─▶ quarantined
//!  fatal (class 3)                        ─▶ quarantined: unhealthy until an operator clears it,
//!        kept in <data_dir>/quarantine.json across agent restarts (a different UUID under the same
//!        id, i.e. a replaced card, clears it), `suanli_agent_device_quarantined` = 1 (alert on it)
//!  quarantined, and `suanli node clear-quarantine` raised the device's count of clears past the
//!  one the agent knew when it quarantined it (heartbeat answers carry the counts)
//!                                         ─▶ Recovering, from no attempts: reset, fingerprint,
//!        back in service when healthy, quarantined again when the resets do not help
//!  unspecified (class 0, a 1.2 plugin)    ─▶ as in 1.2: unhealthy until an event or a fingerprint
//!        says healthy
//! ```

use super::{Plugin, Plugins, cut_reason, fingerprint};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use suanli_device_host::supervisor::HostError;
use suanli_device_host::{Code, EventClass, pb};

/// Resets of one recovery that did not bring the device back before it is quarantined.
pub(crate) const MAX_RESET_ATTEMPTS: u32 = 3;
/// Recoveries of one device within an hour past which the next recoverable error quarantines it
/// (a device that keeps failing is not worth the tasks it breaks).
pub(crate) const MAX_RECOVERIES_PER_HOUR: usize = 3;
/// The first retry of a failed reset; each next one waits twice as long, up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);
/// The most devices in recovery or quarantine the agent tracks (a node has far fewer).
const MAX_TRACKED: usize = 4096;
/// The file in an allocation's directory where device events for the task are appended.
pub(crate) const DEVICE_EVENTS_FILE: &str = "device-events";
/// The most bytes of device events kept for one task (older lines are not rotated: the file
/// stops growing, and the agent's log keeps the rest).
const MAX_EVENTS_FILE: u64 = 1 << 20;
/// The quarantine file in the agent's data directory.
pub(crate) const QUARANTINE_FILE: &str = "quarantine.json";

/// A device being recovered.
#[derive(Debug, Clone)]
pub(crate) struct Recovery {
    /// Why it left service.
    pub reason: String,
    /// Resets tried that did not bring it back.
    pub attempts: u32,
    /// Not before this is the next reset tried.
    pub next_try: Instant,
    /// The last reset's error, if any.
    pub last_error: String,
}

/// A quarantined device, as kept in [`QUARANTINE_FILE`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Quarantine {
    /// Why.
    pub reason: String,
    /// The device's UUID when it was quarantined (empty when the plugin reports none): another
    /// UUID under the same id is another card, which the quarantine does not cover.
    #[serde(default)]
    pub uuid: String,
    /// When, in Unix seconds.
    pub since_unix_s: u64,
    /// The control plane's count of operator clears for this device when it was quarantined
    /// (`None`: no heartbeat answer had said it yet; the first one sets it). A higher count in
    /// a heartbeat answer ends the quarantine; a lower one (a restored cluster) becomes the
    /// new baseline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clears_seen: Option<u64>,
}

/// Remediation state of the node's devices.
#[derive(Debug, Default)]
pub(crate) struct Remedies {
    /// Devices in recovery, by id.
    pub recovering: BTreeMap<String, Recovery>,
    /// Quarantined devices, by id (persisted).
    pub quarantined: BTreeMap<String, Quarantine>,
    /// When each device last came back from a recovery (within the last hour).
    pub recovered: BTreeMap<String, VecDeque<Instant>>,
    /// Events seen, by class (unspecified, application, recoverable, fatal).
    pub events: [u64; 4],
    /// Resets that brought a device back, and those that did not.
    pub resets_ok: u64,
    /// Resets that failed or did not bring the device back.
    pub resets_failed: u64,
    /// The control plane's counts of operator clears by device, as the last heartbeat answer
    /// said (`None` before the first answer).
    pub clears: Option<BTreeMap<String, u64>>,
}

/// What the metrics page shows of remediation.
#[derive(Debug, Clone, Default)]
pub(crate) struct RemedyView {
    /// Quarantined device ids.
    pub quarantined: Vec<String>,
    /// Device ids in recovery.
    pub recovering: Vec<String>,
    /// Events by class name.
    pub events: Vec<(&'static str, u64)>,
    /// Resets that brought a device back.
    pub resets_ok: u64,
    /// Resets that did not.
    pub resets_failed: u64,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Reads the quarantine file; a missing file is an empty quarantine, a damaged one is logged
/// and kept aside (renamed `.bad`) so that the operator sees it, and the agent starts empty.
pub(crate) fn load_quarantine(path: &Path) -> BTreeMap<String, Quarantine> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "cannot read the device quarantine file; no device is quarantined");
            return BTreeMap::new();
        }
    };
    match serde_json::from_str::<BTreeMap<String, Quarantine>>(&text) {
        Ok(q) => q.into_iter().take(MAX_TRACKED).collect(),
        Err(e) => {
            let bad = path.with_extension("json.bad");
            let _ = std::fs::rename(path, &bad);
            tracing::error!(path = %path.display(), kept = %bad.display(), error = %e,
                "the device quarantine file does not parse; it was set aside and no device is quarantined");
            BTreeMap::new()
        }
    }
}

fn save_quarantine(path: &Path, q: &BTreeMap<String, Quarantine>) {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(q).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text)?;
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        tracing::error!(path = %path.display(), error = %e, "cannot write the device quarantine file (the quarantine holds until the agent restarts)");
    }
}

impl Plugins {
    pub(super) fn lock_remedy(&self) -> std::sync::MutexGuard<'_, Remedies> {
        self.remedy.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Why `device` is out of service by remediation (quarantine first), or `None`.
    pub(super) fn remedy_reason(r: &Remedies, device: &str) -> Option<String> {
        if let Some(q) = r.quarantined.get(device) {
            return Some(format!("quarantined: {}", q.reason));
        }
        r.recovering.get(device).map(|rec| format!("recovering: {}", rec.reason))
    }

    /// Forgets quarantines of devices whose UUID changed (the card was replaced); called after a
    /// fingerprint.
    pub(super) fn forget_replaced(&self, inv: &pb::Inventory) {
        let mut r = self.lock_remedy();
        let replaced: Vec<String> = r
            .quarantined
            .iter()
            .filter(|(id, q)| {
                !q.uuid.is_empty() && inv.devices.iter().any(|d| &d.id == *id && !d.uuid.is_empty() && d.uuid != q.uuid)
            })
            .map(|(id, _)| id.clone())
            .collect();
        if replaced.is_empty() {
            return;
        }
        for id in &replaced {
            r.quarantined.remove(id);
            tracing::warn!(device = %id, "a quarantined device id now has another UUID (the card was replaced): back in service");
        }
        save_quarantine(&self.quarantine_path, &r.quarantined);
        drop(r);
        self.changed.notify_one();
    }

    /// Handles one health event's class; `true` when the event is fully handled here (an
    /// application error, a recoverable or fatal error), `false` when the 1.2 rules apply.
    pub(super) fn remedy_event(&self, p: &Plugin, e: &pb::HealthEvent) -> bool {
        let class = EventClass::from_raw(e.event_class);
        let reason = if e.reason.is_empty() {
            format!("health event from plugin {} (code {})", p.stem, e.code)
        } else {
            e.reason.clone()
        };
        let mut r = self.lock_remedy();
        let slot = match class {
            EventClass::Unspecified => 0,
            EventClass::Application => 1,
            EventClass::Recoverable => 2,
            EventClass::Fatal => 3,
        };
        r.events[slot] = r.events[slot].saturating_add(1);
        match class {
            EventClass::Unspecified => false,
            EventClass::Application => {
                drop(r);
                tracing::warn!(plugin = %p.stem, device = %e.device, code = e.code, reason = %reason,
                    "application error on a device: it stays in service, the tasks on it are told");
                self.tell_tasks(&e.device, e.code, &reason);
                true
            }
            _ if e.healthy => false,
            EventClass::Recoverable => {
                if r.quarantined.contains_key(&e.device) || r.recovering.contains_key(&e.device) {
                    return true;
                }
                let hour_ago = Instant::now().checked_sub(Duration::from_secs(3600));
                let recent = r.recovered.get_mut(&e.device).map_or(0, |q| {
                    q.retain(|t| hour_ago.is_none_or(|h| *t > h));
                    q.len()
                });
                if recent >= MAX_RECOVERIES_PER_HOUR {
                    let why = format!("{reason}; recovered {recent} times within the hour, and failing again");
                    self.quarantine_locked(&mut r, p, &e.device, &why);
                } else if r.recovering.len() < MAX_TRACKED {
                    tracing::warn!(plugin = %p.stem, device = %e.device, code = e.code, reason = %reason,
                        "recoverable device error: the device leaves service, its tasks move, then it is reset");
                    r.recovering.insert(
                        e.device.clone(),
                        Recovery { reason, attempts: 0, next_try: Instant::now(), last_error: String::new() },
                    );
                }
                drop(r);
                self.changed.notify_one();
                true
            }
            EventClass::Fatal => {
                self.quarantine_locked(&mut r, p, &e.device, &reason);
                drop(r);
                self.changed.notify_one();
                true
            }
        }
    }

    fn quarantine_locked(&self, r: &mut Remedies, p: &Plugin, device: &str, reason: &str) {
        r.recovering.remove(device);
        if r.quarantined.contains_key(device) || r.quarantined.len() >= MAX_TRACKED {
            return;
        }
        let uuid = p
            .view()
            .inventory
            .as_ref()
            .and_then(|i| i.devices.iter().find(|d| d.id == device).map(|d| d.uuid.clone()))
            .unwrap_or_default();
        let reason = cut_reason(reason);
        tracing::error!(plugin = %p.stem, device = %device, reason = %reason,
            "DEVICE QUARANTINED: out of service until an operator clears it (see docs/agent.md, Device errors)");
        let clears_seen = r.clears.as_ref().map(|m| m.get(device).copied().unwrap_or(0));
        r.quarantined.insert(device.to_owned(), Quarantine { reason, uuid, since_unix_s: unix_now(), clears_seen });
        save_quarantine(&self.quarantine_path, &r.quarantined);
    }

    /// Takes the control plane's counts of operator clears (a heartbeat answer): a quarantined
    /// device whose count went past the one it was quarantined under leaves quarantine for a
    /// recovery from the start (reset, fingerprint; quarantined again if that fails), and its
    /// recent recoveries are forgotten (the operator vouched for it).
    pub(crate) fn apply_clears(&self, clears: &BTreeMap<String, u64>) {
        let mut r = self.lock_remedy();
        let counts: BTreeMap<String, u64> = clears.iter().take(MAX_TRACKED).map(|(d, c)| (d.clone(), *c)).collect();
        let mut cleared = Vec::new();
        let mut dirty = false;
        for (id, q) in r.quarantined.iter_mut() {
            let now = counts.get(id).copied().unwrap_or(0);
            match q.clears_seen {
                Some(seen) if now > seen => cleared.push(id.clone()),
                Some(seen) if now == seen => {}
                // First heartbeat answer since it was quarantined, or a lower count.
                _ => {
                    q.clears_seen = Some(now);
                    dirty = true;
                }
            }
        }
        for id in &cleared {
            let Some(q) = r.quarantined.remove(id) else { continue };
            r.recovered.remove(id);
            tracing::warn!(device = %id, reason = %q.reason,
                "an operator cleared the device's quarantine: it is reset and checked before it returns to service");
            let reason = cut_reason(&format!("quarantine cleared by an operator (was: {})", q.reason));
            r.recovering.insert(
                id.clone(),
                Recovery { reason, attempts: 0, next_try: Instant::now(), last_error: String::new() },
            );
        }
        r.clears = Some(counts);
        if dirty || !cleared.is_empty() {
            save_quarantine(&self.quarantine_path, &r.quarantined);
        }
        drop(r);
        if !cleared.is_empty() {
            self.changed.notify_one();
        }
    }

    /// Appends an application-error line to the device-events file of every task holding
    /// `device`.
    fn tell_tasks(&self, device: &str, code: u64, reason: &str) {
        let holders: Vec<String> = self
            .lock_held()
            .iter()
            .filter(|(_, h)| h.shares.iter().any(|s| s.device_id == device))
            .map(|(id, _)| id.clone())
            .collect();
        let line = serde_json::json!({
            "time_unix_s": unix_now(), "device": device, "class": "application", "code": code, "reason": reason,
        })
        .to_string();
        for id in holders {
            let path = self.allocs_dir.join(&id).join(DEVICE_EVENTS_FILE);
            let append = || -> std::io::Result<()> {
                use std::io::Write;
                if std::fs::metadata(&path).is_ok_and(|m| m.len() >= MAX_EVENTS_FILE) {
                    return Ok(());
                }
                let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
                writeln!(f, "{line}")
            };
            if let Err(e) = append() {
                tracing::warn!(reservation = %id, path = %path.display(), error = %e, "cannot tell a task of a device event");
            }
        }
    }

    /// Whether a reservation holds `device`.
    fn held_device(&self, device: &str) -> bool {
        self.lock_held().values().any(|h| h.shares.iter().any(|s| s.device_id == device))
    }

    /// Moves the recoveries of `p`'s devices along: a device nothing holds any more and whose
    /// retry time has come is reset and fingerprinted.
    pub(super) async fn advance_recoveries(&self, p: &Plugin) {
        // Lock order: remediation before a plugin's view (as in `devices`), never both here.
        let ids: Vec<String> =
            p.view().inventory.as_ref().map(|i| i.devices.iter().map(|d| d.id.clone()).collect()).unwrap_or_default();
        let owned: Vec<String> = {
            let r = self.lock_remedy();
            let now = Instant::now();
            r.recovering
                .iter()
                .filter(|(id, rec)| rec.next_try <= now && ids.contains(id))
                .map(|(id, _)| id.clone())
                .collect()
        };
        for device in owned {
            if self.held_device(&device) {
                continue;
            }
            let res = p.proc.reset(pb::ResetRequest { device_id: device.clone() }).await;
            let (counts, error) = match &res {
                Ok(_) => (true, String::new()),
                // The plugin cannot reset: wait for the device to say it is healthy by itself.
                Err(HostError::Plugin(pe)) if pe.code == Code::Unimplemented => (false, pe.to_string()),
                Err(e) => (true, e.to_string()),
            };
            // A fresh fingerprint says whether the device is back.
            if let Err(e) = fingerprint(p, &self.inventory_changed).await {
                tracing::warn!(plugin = %p.stem, device = %device, error = %e, "fingerprint after a reset failed");
            }
            let healthy = (res.is_ok() || !counts)
                && p.view().inventory.as_ref().is_some_and(|i| i.devices.iter().any(|d| d.id == device && d.healthy));
            let mut r = self.lock_remedy();
            if healthy {
                if res.is_ok() {
                    r.resets_ok = r.resets_ok.saturating_add(1);
                }
                r.recovering.remove(&device);
                let q = r.recovered.entry(device.clone()).or_default();
                q.push_back(Instant::now());
                while q.len() > MAX_RECOVERIES_PER_HOUR + 1 {
                    q.pop_front();
                }
                drop(r);
                p.view().events.remove(&device);
                tracing::info!(plugin = %p.stem, device = %device, reset = res.is_ok(), "device recovered: back in service");
                self.changed.notify_one();
                continue;
            }
            if counts {
                r.resets_failed = r.resets_failed.saturating_add(1);
            }
            let Some(rec) = r.recovering.get_mut(&device) else { continue };
            if counts {
                rec.attempts += 1;
            }
            rec.last_error =
                if error.is_empty() { "the device is still unhealthy after its reset".into() } else { error };
            let shift = rec.attempts.min(6);
            rec.next_try = Instant::now() + (RETRY_MIN * (1u32 << shift)).min(RETRY_MAX);
            tracing::warn!(plugin = %p.stem, device = %device, attempts = rec.attempts, error = %rec.last_error,
                "device reset did not bring it back");
            if rec.attempts >= MAX_RESET_ATTEMPTS {
                let why = format!("{}; {} resets did not bring it back: {}", rec.reason, rec.attempts, rec.last_error);
                self.quarantine_locked(&mut r, p, &device, &why);
                drop(r);
                self.changed.notify_one();
            }
        }
    }

    /// What the metrics page shows.
    pub(crate) fn remedy_view(&self) -> RemedyView {
        let r = self.lock_remedy();
        RemedyView {
            quarantined: r.quarantined.keys().cloned().collect(),
            recovering: r.recovering.keys().cloned().collect(),
            events: ["unspecified", "application", "recoverable", "fatal"].into_iter().zip(r.events).collect(),
            resets_ok: r.resets_ok,
            resets_failed: r.resets_failed,
        }
    }
}

/// The quarantine file of an agent whose data directory is `data_dir`.
pub(crate) fn quarantine_path(data_dir: &Path) -> PathBuf {
    data_dir.join(QUARANTINE_FILE)
}
