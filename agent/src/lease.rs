//! Lease fencing: a task must not keep running once the control plane may have given its
//! allocation to another node.
//!
//! ```text
//!  agent:  s = CLOCK_BOOTTIME ─▶ Heartbeat ─▶ known = true ─▶ <data_dir>/lease {s, F, G}
//!  shim:   every 200 ms:  now > s + F ─▶ SIGTERM the task's group
//!                         now > s + F + G ─▶ SIGKILL it (a lease renewed meanwhile does not save it)
//!  leader: saw that heartbeat at h ≥ s ─▶ nothing more until h + TTL ─▶ node down ─▶ reschedule
//! ```
//!
//! The leader saw the heartbeat after the agent sent it, so its TTL clock starts no earlier than
//! `s`: with `F + G < TTL` the task is dead before the leader can declare the node down, let
//! alone start the allocation's next attempt elsewhere (assuming the two machines' clocks run
//! at about the same rate over a TTL, and the shim itself is not frozen).
//!
//! Everything here is pure but [`Lease::read`] and [`Lease::write`]: clock readings are
//! arguments, so the decisions are tested with made-up times.

use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

/// The lease's file name in the agent's data directory.
pub const LEASE_FILE: &str = "lease";

/// How often a shim reads the lease.
pub const CHECK_EVERY: Duration = Duration::from_millis(200);

/// A lease `sent_boottime_ms` this far ahead of the reader's clock is not trusted (it cannot
/// come from this boot's agent).
const FUTURE_SLACK_MS: u64 = 1_000;

/// F and G when the server gives no TTL (an older server): those of its default TTL, 10 s.
const FALLBACK_TTL_MS: u64 = 10_000;

/// Why a lease could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// There is no lease file: the agent never heard back from the control plane.
    #[error("no lease at {path}")]
    Missing {
        /// The file.
        path: String,
    },
    /// The file exists but could not be read.
    #[error("reading the lease {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a lease.
    #[error("the lease {path} is malformed: {message}")]
    Malformed {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
}

/// `<data_dir>/lease`: rewritten in place (see [`Lease::write`]) by the agent after every heartbeat the control plane
/// answered `known = true`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// `CLOCK_BOOTTIME` in ms taken before that heartbeat was sent.
    pub sent_boottime_ms: u64,
    /// F: the task is sent SIGTERM when the lease is older than this.
    pub fence_after_ms: u64,
    /// G: and SIGKILL this long after that.
    pub kill_grace_ms: u64,
    /// The boot the reading belongs to (`/proc/sys/kernel/random/boot_id`); a lease of another
    /// boot is worthless. Empty: not checked.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
    /// FNV-1a (64 bits, hex) of this record serialized without `check`: the file is rewritten
    /// in place, so a reader racing the writer can see a mix of two records, which this tells
    /// apart. Empty (a lease of an older agent): not checked.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub check: String,
}

/// Bytes reserved for the lease file: the agent rewrites exactly this many in place.
pub const LEASE_FILE_BYTES: usize = 512;

/// FNV-1a, 64 bits: a torn-read detector, not a defence against anyone.
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

impl Lease {
    /// Reads a lease file.
    pub fn read(path: &Path) -> Result<Lease, LeaseError> {
        let p = || path.display().to_string();
        let data = match std::fs::read(path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(LeaseError::Missing { path: p() }),
            Err(source) => return Err(LeaseError::Read { path: p(), source }),
        };
        let l: Lease =
            serde_json::from_slice(&data).map_err(|e| LeaseError::Malformed { path: p(), message: e.to_string() })?;
        if !l.check.is_empty() && l.check != l.checksum() {
            return Err(LeaseError::Malformed {
                path: p(),
                message: "its check does not match (read while being rewritten)".into(),
            });
        }
        Ok(l)
    }

    /// The check of this record (its serialization without `check`).
    fn checksum(&self) -> String {
        let bare = Lease { check: String::new(), ..self.clone() };
        format!("{:016x}", fnv1a(&serde_json::to_vec(&bare).unwrap_or_default()))
    }

    /// Rewrites the lease file in place: [`LEASE_FILE_BYTES`] bytes at offset 0, the record
    /// with its check, padded. No temporary file and no new blocks, so a full filesystem
    /// (a task's output filled it) cannot stop the renewal and fence every task of the node.
    /// Not fsynced: a lease is worthless after a reboot anyway.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let rec = Lease { check: self.checksum(), ..self.clone() };
        let data = serde_json::to_vec(&rec).map_err(std::io::Error::other)?;
        crate::sys::write_padded(path, &data, LEASE_FILE_BYTES)
    }

    /// When (boot time, ms) the task must be sent SIGTERM: `sent + F`.
    pub fn term_at_ms(&self) -> u64 {
        self.sent_boottime_ms.saturating_add(self.fence_after_ms)
    }

    /// When (boot time, ms) the task must be SIGKILLed: `sent + F + G`.
    pub fn kill_at_ms(&self) -> u64 {
        self.term_at_ms().saturating_add(self.kill_grace_ms)
    }

    /// The milliseconds this lease is still good for at `now_ms` (boot time) on boot `boot_id`,
    /// or why it is not good (expired, another boot, from the future).
    pub fn left_ms(&self, now_ms: u64, boot_id: &str) -> Result<u64, String> {
        if !self.boot_id.is_empty() && !boot_id.is_empty() && self.boot_id != boot_id {
            return Err(format!("the lease is from another boot ({})", self.boot_id));
        }
        if self.sent_boottime_ms > now_ms.saturating_add(FUTURE_SLACK_MS) {
            return Err(format!(
                "the lease was sent at boot time {} ms, after now ({now_ms} ms)",
                self.sent_boottime_ms
            ));
        }
        if now_ms > self.term_at_ms() {
            return Err(format!(
                "the lease is {} ms old, beyond fence_after_ms = {} (no heartbeat acknowledged since)",
                now_ms - self.sent_boottime_ms,
                self.fence_after_ms
            ));
        }
        Ok(self.term_at_ms() - now_ms)
    }
}

/// F and G from the agent's `fence_after_ms` and `fence_kill_grace_ms` (0: automatic) and the
/// server's heartbeat TTL: automatic F is TTL / 2, automatic G is TTL / 5.
pub fn timing(fence_after_ms: u64, fence_kill_grace_ms: u64, ttl_ms: u64) -> (u64, u64) {
    let ttl = if ttl_ms == 0 { FALLBACK_TTL_MS } else { ttl_ms };
    let f = if fence_after_ms > 0 { fence_after_ms } else { ttl / 2 };
    let g = if fence_kill_grace_ms > 0 { fence_kill_grace_ms } else { ttl / 5 };
    (f, g)
}

/// Why F and G do not keep the promise "dead before declared down" for this TTL, if they do not.
pub fn timing_problem(f: u64, g: u64, ttl_ms: u64) -> Option<String> {
    (ttl_ms > 0 && f.saturating_add(g) >= ttl_ms).then(|| {
        format!(
            "fence_after_ms + fence_kill_grace_ms = {f} + {g} ms is not below the control plane's heartbeat TTL \
             ({ttl_ms} ms): a task cut off from the control plane may still run when its allocation is given to \
             another node"
        )
    })
}

/// What a shim must do to its task now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceAction {
    /// Let it run.
    Nothing,
    /// Send SIGTERM to its group (once).
    Term,
    /// Send SIGKILL to its group (once).
    Kill,
}

/// A shim's view of the lease while its task runs.
#[derive(Debug, Clone)]
pub struct Fence {
    boot_id: String,
    last: Option<Lease>,
    /// Set once SIGTERM was decided: the boot time of SIGKILL. A lease renewed afterwards does
    /// not move it.
    kill_at_ms: Option<u64>,
    killed: bool,
    why: Option<String>,
}

impl Fence {
    /// A fence for this boot.
    pub fn new(boot_id: impl Into<String>) -> Fence {
        Fence { boot_id: boot_id.into(), last: None, kill_at_ms: None, killed: false, why: None }
    }

    /// Whether a command may start at `now_ms` under `lease` (read just before): `Err(why)`
    /// when the lease is missing, unreadable or expired. Remembers a good lease.
    pub fn may_start(&mut self, lease: Result<Lease, LeaseError>, now_ms: u64) -> Result<(), String> {
        let l = lease.map_err(|e| e.to_string())?;
        l.left_ms(now_ms, &self.boot_id)?;
        self.last = Some(l);
        Ok(())
    }

    /// Takes the lease read at `now_ms` (a failed read keeps the last good one) and says what
    /// to do. SIGTERM comes once the newest lease is older than its F; SIGKILL once it is older
    /// than F + G, whatever is read after SIGTERM.
    pub fn step(&mut self, read: Result<Lease, LeaseError>, now_ms: u64) -> FenceAction {
        if let Some(kill_at) = self.kill_at_ms {
            if !self.killed && now_ms > kill_at {
                self.killed = true;
                return FenceAction::Kill;
            }
            return FenceAction::Nothing;
        }
        if let Ok(l) = read
            && l.left_ms(now_ms, &self.boot_id).is_ok()
            && self.last.as_ref().is_none_or(|old| l.sent_boottime_ms >= old.sent_boottime_ms)
        {
            self.last = Some(l);
        }
        let why = match &self.last {
            None => Some("no valid lease".to_owned()),
            Some(l) => l.left_ms(now_ms, &self.boot_id).err(),
        };
        let Some(why) = why else {
            return FenceAction::Nothing;
        };
        self.kill_at_ms = Some(self.last.as_ref().map_or(now_ms, Lease::kill_at_ms));
        self.why = Some(why);
        FenceAction::Term
    }

    /// Whether the task was fenced (SIGTERM decided).
    pub fn fenced(&self) -> bool {
        self.kill_at_ms.is_some()
    }

    /// Why it was fenced.
    pub fn why(&self) -> Option<&str> {
        self.why.as_deref()
    }

    /// How long to wait before the next [`Fence::step`] at `now_ms`: [`CHECK_EVERY`], or less
    /// when SIGKILL is due sooner; `None` when nothing is left to do.
    pub fn next_check(&self, now_ms: u64) -> Option<Duration> {
        match self.kill_at_ms {
            Some(_) if self.killed => None,
            Some(k) => Some(Duration::from_millis(k.saturating_sub(now_ms).saturating_add(1)).min(CHECK_EVERY)),
            None => Some(CHECK_EVERY),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn lease(sent: u64) -> Lease {
        Lease {
            sent_boottime_ms: sent,
            fence_after_ms: 1000,
            kill_grace_ms: 500,
            boot_id: "b1".into(),
            check: String::new(),
        }
    }

    fn missing() -> Result<Lease, LeaseError> {
        Err(LeaseError::Missing { path: "x".into() })
    }

    #[test]
    fn lease_parses_and_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(LEASE_FILE);
        assert!(matches!(Lease::read(&p), Err(LeaseError::Missing { .. })));
        std::fs::write(&p, br#"{"sent_boottime_ms": 5, "fence_after_ms": 6, "kill_grace_ms": 7}"#).unwrap();
        let l = Lease::read(&p).unwrap();
        assert_eq!((l.sent_boottime_ms, l.fence_after_ms, l.kill_grace_ms, l.boot_id.as_str()), (5, 6, 7, ""));
        lease(9).write(&p).unwrap();
        let back = Lease::read(&p).unwrap();
        assert_eq!(Lease { check: String::new(), ..back.clone() }, lease(9));
        assert_eq!(std::fs::metadata(&p).unwrap().len(), LEASE_FILE_BYTES as u64, "rewritten in place, fixed size");
        // A record mixed from two writes (a racing reader) is refused, not trusted.
        let text = std::fs::read_to_string(&p).unwrap().replace("\"sent_boottime_ms\":9", "\"sent_boottime_ms\":99");
        std::fs::write(&p, text).unwrap();
        let e = Lease::read(&p).unwrap_err();
        assert!(e.to_string().contains("check does not match"), "{e}");
        std::fs::write(&p, b"{\"sent_boottime_ms\": ").unwrap();
        let e = Lease::read(&p).unwrap_err();
        assert!(matches!(e, LeaseError::Malformed { .. }), "{e}");
    }

    #[test]
    fn fresh_and_stale() {
        let l = lease(10_000);
        assert_eq!(l.left_ms(10_000, "b1"), Ok(1000));
        assert_eq!(l.left_ms(11_000, "b1"), Ok(0));
        let e = l.left_ms(11_001, "b1").unwrap_err();
        assert!(e.contains("1001 ms old") && e.contains("fence_after_ms = 1000"), "{e}");
        assert!(l.left_ms(10_500, "b2").unwrap_err().contains("another boot"));
        assert!(l.left_ms(8_000, "b1").unwrap_err().contains("after now"), "a lease from the future");
        assert_eq!(l.left_ms(9_500, "b1"), Ok(1500), "a little ahead is clock granularity");
        assert_eq!(Lease { boot_id: String::new(), ..l }.left_ms(10_500, "b2"), Ok(500));
    }

    #[test]
    fn may_start_only_under_a_fresh_lease() {
        let mut f = Fence::new("b1");
        assert!(f.may_start(missing(), 10_000).unwrap_err().contains("no lease"));
        assert!(f.may_start(Ok(lease(10_000)), 11_001).is_err());
        assert!(f.may_start(Ok(lease(10_000)), 10_999).is_ok());
    }

    #[test]
    fn term_then_kill_and_renewal_after_term_does_not_save_it() {
        let mut f = Fence::new("b1");
        f.may_start(Ok(lease(10_000)), 10_100).unwrap();
        // Renewed in time: nothing happens.
        assert_eq!(f.step(Ok(lease(10_800)), 10_900), FenceAction::Nothing);
        // The file goes missing: the last good lease still counts.
        assert_eq!(f.step(missing(), 11_700), FenceAction::Nothing);
        // An older lease read later does not replace a newer one.
        assert_eq!(f.step(Ok(lease(10_700)), 11_750), FenceAction::Nothing);
        assert_eq!(f.next_check(11_750), Some(CHECK_EVERY));
        assert_eq!(f.step(missing(), 11_801), FenceAction::Term);
        assert!(f.fenced());
        assert!(f.why().unwrap().contains("beyond fence_after_ms"), "{:?}", f.why());
        // A lease renewed after SIGTERM does not cancel the kill at 10_800 + 1500.
        assert_eq!(f.step(Ok(lease(12_000)), 12_100), FenceAction::Nothing);
        assert_eq!(f.next_check(12_250), Some(Duration::from_millis(51)));
        assert_eq!(f.step(Ok(lease(12_200)), 12_300), FenceAction::Nothing);
        assert_eq!(f.step(Ok(lease(12_200)), 12_301), FenceAction::Kill);
        assert_eq!(f.step(Ok(lease(12_200)), 12_500), FenceAction::Nothing, "SIGKILL once");
        assert_eq!(f.next_check(12_500), None);
    }

    #[test]
    fn a_late_check_terms_and_kills_at_once() {
        let mut f = Fence::new("b1");
        f.may_start(Ok(lease(10_000)), 10_000).unwrap();
        // The shim was frozen past F + G: SIGTERM now, SIGKILL at the next step.
        assert_eq!(f.step(missing(), 20_000), FenceAction::Term);
        assert_eq!(f.next_check(20_000), Some(Duration::from_millis(1)));
        assert_eq!(f.step(missing(), 20_001), FenceAction::Kill);
    }

    #[test]
    fn automatic_timing() {
        assert_eq!(timing(0, 0, 10_000), (5_000, 2_000));
        assert_eq!(timing(3_000, 0, 10_000), (3_000, 2_000));
        assert_eq!(timing(0, 700, 4_000), (2_000, 700));
        assert_eq!(timing(0, 0, 0), (5_000, 2_000), "no TTL from the server: that of its default");
        assert!(timing_problem(5_000, 2_000, 10_000).is_none());
        let e = timing_problem(8_000, 2_000, 10_000).unwrap();
        assert!(e.contains("8000 + 2000") && e.contains("10000"), "{e}");
        assert!(timing_problem(8_000, 2_000, 0).is_none(), "TTL unknown");
    }
}
