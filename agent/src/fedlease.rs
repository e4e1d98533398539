//! Federation leases: a federated task (its allocation carries `global_job_id`, `fed_epoch`,
//! `lease_until_ms`, `fed_stop_before_ms`) runs only while its region holds the job's lease, and
//! is gone by `lease_until - max_clock_drift` on this node's clock (docs/federation.md, "Leases,
//! epochs and fencing").
//!
//! ```text
//!  agent:  AllocInfo / HeartbeatResponse.leases ─▶ <alloc dir>/fed-lease {until_ms, stop_before_ms, …}
//!          (rewritten atomically, only ever later)
//!  shim:   at start: now ≥ D = until - stop_before ─▶ not started
//!          every 200 ms: now ≥ D ─▶ checkpoint signal (when the job has one and a grace)
//!                        D + grace ─▶ SIGTERM the task's group
//!                        D + grace + LEASE_KILL_GRACE_MS ─▶ SIGKILL it
//! ```
//!
//! `stop_before_ms` is `max_clock_drift_ms + grace + LEASE_KILL_GRACE_MS` (the region computes
//! it), so the SIGKILL falls at `until - drift`. The shim enforces this from the file, so the
//! stop happens even when the agent is dead or cut off: the last lease it heard of counts.
//!
//! The clock is the wall clock (`SystemTime`, ms since the Unix epoch), not `CLOCK_BOOTTIME` as
//! for the node lease: `until_ms` is a time of the federation's clock, and only the wall clocks
//! of the federation, the regions and the agents are kept within `max_clock_drift_ms` of each
//! other (NTP). A boot-time reading has no relation to another machine's clock.
//!
//! Everything here is pure but [`FedLease::read`] and [`FedLease::write`]: clock readings are
//! arguments, so the decisions are tested with made-up times.

use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

/// The federation lease's file name in a federated task's allocation directory.
pub const FED_LEASE_FILE: &str = "fed-lease";

/// Between SIGTERM and SIGKILL of a task whose federation lease ended.
pub const LEASE_KILL_GRACE_MS: u64 = 1_000;

/// How often a shim checks the federation lease.
pub const CHECK_EVERY: Duration = crate::lease::CHECK_EVERY;

/// `<alloc dir>/fed-lease`: the federation lease of a federated task, as last heard of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedLease {
    /// The lease's end, wall clock, ms since the Unix epoch (the federation's time).
    pub until_ms: u64,
    /// The task is stopped from `until_ms - stop_before_ms` on.
    pub stop_before_ms: u64,
    /// The job's global id (`g-<n>`).
    #[serde(default)]
    pub global_id: String,
    /// The federation epoch the task runs under.
    #[serde(default)]
    pub fed_epoch: u64,
    /// The job's checkpoint signal (`SIGUSR1`, …), sent first at the deadline; empty: none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub checkpoint_signal: String,
    /// Between the checkpoint signal and SIGTERM, ms (the job's checkpoint `grace_s`).
    #[serde(default)]
    pub grace_ms: u64,
}

/// Why a federation lease file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FedLeaseError {
    /// The file could not be read.
    #[error("reading the federation lease {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a federation lease.
    #[error("the federation lease {path} is malformed: {message}")]
    Malformed {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
}

impl FedLease {
    /// Reads `path`: `Ok(None)` when there is no such file (a region-local task).
    pub fn read(path: &Path) -> Result<Option<FedLease>, FedLeaseError> {
        let p = || path.display().to_string();
        let data = match std::fs::read(path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(FedLeaseError::Read { path: p(), source }),
        };
        serde_json::from_slice(&data)
            .map(Some)
            .map_err(|e| FedLeaseError::Malformed { path: p(), message: e.to_string() })
    }

    /// Writes `path` atomically (a temporary file renamed over it): a shim reads the old lease
    /// or the new one, never a mix.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let data = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        crate::sys::write_atomic(path, &data)
    }

    /// D: from when (wall clock, ms) the task must not run any more, `until - stop_before`.
    pub fn deadline_ms(&self) -> u64 {
        self.until_ms.saturating_sub(self.stop_before_ms)
    }

    /// The lease renewed to `until_ms`: later only, never earlier.
    pub fn renewed(&self, until_ms: u64) -> FedLease {
        FedLease { until_ms: self.until_ms.max(until_ms), ..self.clone() }
    }

    /// Whether the task may start at `now_ms` (wall clock): `Err(message)` from D on.
    pub fn may_start(&self, now_ms: u64) -> Result<(), String> {
        if now_ms >= self.deadline_ms() {
            return Err(self.not_started_message());
        }
        Ok(())
    }

    /// The report of a task not started because its lease ends too soon.
    pub fn not_started_message(&self) -> String {
        format!(
            "federation lease of {} epoch {} ends at {}: not started",
            self.global_id, self.fed_epoch, self.until_ms
        )
    }

    /// The report of a task stopped because its lease ended.
    pub fn ended_message(&self) -> String {
        format!("federation lease ended at {} ({} epoch {})", self.until_ms, self.global_id, self.fed_epoch)
    }

    /// The journal's reason of such a stop.
    pub fn journal_reason(&self) -> String {
        format!("federation lease of {} epoch {} ended at {}", self.global_id, self.fed_epoch, self.until_ms)
    }

    /// The checkpoint signal's number, when the job has one and a grace to use it in.
    pub fn checkpoint_signo(&self) -> Option<i32> {
        if self.grace_ms == 0 {
            return None;
        }
        signal_number(&self.checkpoint_signal)
    }
}

/// The number of a checkpoint signal name (`SIGUSR1`, `USR1`, …) a job may name.
pub fn signal_number(name: &str) -> Option<i32> {
    let sig = suanli_model::CheckpointSignal::parse(name)?;
    Some(match sig {
        suanli_model::CheckpointSignal::Usr1 => libc::SIGUSR1,
        suanli_model::CheckpointSignal::Usr2 => libc::SIGUSR2,
        suanli_model::CheckpointSignal::Int => libc::SIGINT,
        suanli_model::CheckpointSignal::Term => libc::SIGTERM,
        suanli_model::CheckpointSignal::Hup => libc::SIGHUP,
    })
}

/// What a shim must do to a federated task now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FedAction {
    /// Let it run.
    Nothing,
    /// Send the job's checkpoint signal (this number) to its group (once).
    Checkpoint(i32),
    /// Send SIGTERM to its group (once).
    Term,
    /// Send SIGKILL to its group (once).
    Kill,
}

/// A shim's view of the federation lease while its task runs.
#[derive(Debug, Clone)]
pub struct FedFence {
    lease: FedLease,
    /// Once the stop began: (SIGTERM at, SIGKILL at), wall clock ms. Fixed from then on: a
    /// renewal heard afterwards does not save the task (the federation may already count on
    /// its end).
    stop: Option<(u64, u64)>,
    termed: bool,
    killed: bool,
}

impl FedFence {
    /// A fence under `lease` (the one the task started under).
    pub fn new(lease: FedLease) -> FedFence {
        FedFence { lease, stop: None, termed: false, killed: false }
    }

    /// The newest lease heard of.
    pub fn lease(&self) -> &FedLease {
        &self.lease
    }

    /// Whether the stop began (the lease ran out).
    pub fn stopping(&self) -> bool {
        self.stop.is_some()
    }

    /// Takes the lease read at `now_ms` (wall clock; a failed or missing read keeps the last
    /// one: a lease is only ever moved later by a successful read) and says what to do.
    pub fn step(&mut self, read: Option<FedLease>, now_ms: u64) -> FedAction {
        let Some((term_at, kill_at)) = self.stop else {
            if let Some(l) = read
                && l.until_ms > self.lease.until_ms
            {
                self.lease = self.lease.renewed(l.until_ms);
            }
            let d = self.lease.deadline_ms();
            if now_ms < d {
                return FedAction::Nothing;
            }
            // Times from D, not from now: a shim that checks late still has the task gone by
            // `until - drift`.
            let ck = self.lease.checkpoint_signo();
            let term_at = d.saturating_add(if ck.is_some() { self.lease.grace_ms } else { 0 });
            self.stop = Some((term_at, term_at.saturating_add(LEASE_KILL_GRACE_MS)));
            return match ck {
                Some(sig) if now_ms < term_at => FedAction::Checkpoint(sig),
                _ => {
                    self.termed = true;
                    FedAction::Term
                }
            };
        };
        if !self.termed && now_ms >= term_at {
            self.termed = true;
            return FedAction::Term;
        }
        if self.termed && !self.killed && now_ms >= kill_at {
            self.killed = true;
            return FedAction::Kill;
        }
        FedAction::Nothing
    }

    /// How long to wait before the next [`FedFence::step`] at `now_ms`: [`CHECK_EVERY`], or
    /// less when an action is due sooner; `None` when nothing is left to do.
    pub fn next_check(&self, now_ms: u64) -> Option<Duration> {
        let due = match self.stop {
            None => self.lease.deadline_ms(),
            Some(_) if self.killed => return None,
            Some((term_at, _)) if !self.termed => term_at,
            Some((_, kill_at)) => kill_at,
        };
        Some(Duration::from_millis(due.saturating_sub(now_ms)).min(CHECK_EVERY))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn lease(until: u64) -> FedLease {
        FedLease {
            until_ms: until,
            stop_before_ms: 2_500,
            global_id: "g-7".into(),
            fed_epoch: 3,
            checkpoint_signal: String::new(),
            grace_ms: 0,
        }
    }

    #[test]
    fn file_round_trips_and_a_missing_file_is_no_lease() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(FED_LEASE_FILE);
        assert!(FedLease::read(&p).unwrap().is_none());
        let l = FedLease { checkpoint_signal: "SIGUSR1".into(), grace_ms: 1000, ..lease(10_000) };
        l.write(&p).unwrap();
        assert_eq!(FedLease::read(&p).unwrap(), Some(l));
        std::fs::write(&p, br#"{"until_ms": 5, "stop_before_ms": 1}"#).unwrap();
        let old = FedLease::read(&p).unwrap().unwrap();
        assert_eq!((old.until_ms, old.stop_before_ms, old.fed_epoch, old.global_id.as_str()), (5, 1, 0, ""));
        std::fs::write(&p, b"{\"until_ms\": ").unwrap();
        assert!(matches!(FedLease::read(&p), Err(FedLeaseError::Malformed { .. })));
    }

    #[test]
    fn start_only_before_the_deadline() {
        let l = lease(10_000);
        assert_eq!(l.deadline_ms(), 7_500);
        assert!(l.may_start(7_499).is_ok());
        let e = l.may_start(7_500).unwrap_err();
        assert_eq!(e, "federation lease of g-7 epoch 3 ends at 10000: not started");
        assert!(lease(1_000).may_start(0).is_err(), "a lease shorter than its stop budget never starts");
        assert_eq!(lease(10_000).ended_message(), "federation lease ended at 10000 (g-7 epoch 3)");
    }

    #[test]
    fn renewals_move_the_deadline_later_never_earlier() {
        let l = lease(10_000);
        assert_eq!(l.renewed(12_000).until_ms, 12_000);
        assert_eq!(l.renewed(9_000).until_ms, 10_000);
        let mut f = FedFence::new(l);
        assert_eq!(f.step(Some(lease(12_000)), 7_000), FedAction::Nothing);
        // An older lease read later (a stale write) and a failed read keep the newest.
        assert_eq!(f.step(Some(lease(9_000)), 7_600), FedAction::Nothing);
        assert_eq!(f.step(None, 9_000), FedAction::Nothing);
        assert_eq!(f.lease().until_ms, 12_000);
        assert_eq!(f.next_check(9_400), Some(Duration::from_millis(100)), "due before the next period");
        assert_eq!(f.step(None, 9_500), FedAction::Term, "at D = 12000 - 2500");
        assert!(f.stopping());
        // A renewal after the stop began does not save the task.
        assert_eq!(f.step(Some(lease(20_000)), 9_600), FedAction::Nothing);
        assert_eq!(f.next_check(10_000), Some(Duration::from_millis(200)));
        assert_eq!(f.next_check(10_400), Some(Duration::from_millis(100)));
        assert_eq!(f.step(None, 10_499), FedAction::Nothing);
        assert_eq!(f.step(None, 10_500), FedAction::Kill, "LEASE_KILL_GRACE_MS after SIGTERM");
        assert_eq!(f.step(None, 10_600), FedAction::Nothing, "SIGKILL once");
        assert_eq!(f.next_check(10_600), None);
    }

    #[test]
    fn a_checkpoint_policy_signals_first_then_terms_after_its_grace() {
        let l =
            FedLease { checkpoint_signal: "SIGUSR1".into(), grace_ms: 3_000, stop_before_ms: 4_500, ..lease(10_000) };
        let mut f = FedFence::new(l.clone());
        assert_eq!(f.step(None, 5_499), FedAction::Nothing);
        assert_eq!(f.step(None, 5_500), FedAction::Checkpoint(libc::SIGUSR1));
        assert_eq!(f.step(None, 8_499), FedAction::Nothing);
        assert_eq!(f.step(None, 8_500), FedAction::Term);
        assert_eq!(f.step(None, 9_499), FedAction::Nothing);
        assert_eq!(f.step(None, 9_500), FedAction::Kill, "gone by until - 500 ms of drift");
        // No grace: no checkpoint signal; an unknown signal name neither.
        assert_eq!(FedLease { grace_ms: 0, ..l.clone() }.checkpoint_signo(), None);
        assert_eq!(FedLease { checkpoint_signal: "SIGKILL".into(), ..l.clone() }.checkpoint_signo(), None);
    }

    #[test]
    fn a_late_check_goes_straight_to_what_is_due() {
        let l =
            FedLease { checkpoint_signal: "SIGUSR2".into(), grace_ms: 3_000, stop_before_ms: 4_500, ..lease(10_000) };
        // The shim was frozen past D + grace: no checkpoint signal, SIGTERM now, SIGKILL at D + grace + 1 s.
        let mut f = FedFence::new(l.clone());
        assert_eq!(f.step(None, 9_000), FedAction::Term);
        assert_eq!(f.step(None, 9_500), FedAction::Kill);
        // Frozen past everything: SIGTERM, then SIGKILL at the next step.
        let mut f = FedFence::new(l);
        assert_eq!(f.step(None, 30_000), FedAction::Term);
        assert_eq!(f.next_check(30_000), Some(Duration::ZERO));
        assert_eq!(f.step(None, 30_000), FedAction::Kill);
    }
}
