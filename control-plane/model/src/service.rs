//! Long-running services (docs/services.md): a job whose replicas are kept running. A replica
//! that ends, whatever its exit code, is replaced one by one (the rest keep serving), after a
//! backoff that doubles while replicas keep failing; the agent runs the readiness and liveness
//! checks and reports each replica's endpoint once it is ready.

use crate::Limits;
use crate::error::{ValidationError, check_range, check_value};
use serde::{Deserialize, Serialize};

/// Shortest probe period, in ms (a probe is a connection or a process on the node).
pub const MIN_PROBE_PERIOD_MS: u64 = 100;
/// Longest probe period or timeout, in ms.
pub const MAX_PROBE_MS: u64 = 3_600_000;
/// Most consecutive results a probe threshold may ask for.
pub const MAX_PROBE_THRESHOLD: u32 = 100;
/// Longest restart backoff, in seconds.
pub const MAX_RESTART_BACKOFF_S: u64 = 3600;

/// The `service` section of a job (implied, with its defaults, by `kind = "inference"`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ServiceSpec {
    /// The port each replica serves on. 0 (the default): the agent picks a free port for each
    /// replica and passes it as `SUANLI_PORT` (replicas on one node do not collide). Another
    /// value is passed as it is; two replicas on one node then collide, so give the group
    /// `replicas` no more than the nodes it may use.
    #[serde(default)]
    pub port: u16,
    /// When a replica is ready for traffic (absent: as soon as it runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<Probe>,
    /// When a replica must be restarted (absent: only when it exits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<Probe>,
    /// The first wait before a replica that ended is replaced, in seconds; it doubles with each
    /// further end until a replica is ready again.
    #[serde(default = "one_s")]
    pub restart_backoff_s: u64,
    /// The longest wait before a replacement, in seconds.
    #[serde(default = "sixty_s")]
    pub max_restart_backoff_s: u64,
}

fn one_s() -> u64 {
    1
}
fn sixty_s() -> u64 {
    60
}

impl Default for ServiceSpec {
    fn default() -> Self {
        ServiceSpec { port: 0, readiness: None, liveness: None, restart_backoff_s: 1, max_restart_backoff_s: 60 }
    }
}

/// What a probe checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// `GET http://127.0.0.1:PORT{path}` answers 2xx or 3xx.
    Http,
    /// A TCP connection to `127.0.0.1:PORT` opens.
    Tcp,
    /// `command` with `args` exits 0 (run in the replica's directory with its environment).
    Command,
}

/// A readiness or liveness check, run by the agent on the replica's node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Probe {
    /// HTTP, TCP or a command.
    pub kind: ProbeKind,
    /// The HTTP path (`kind = "http"`), default `/`.
    #[serde(default = "root")]
    pub path: String,
    /// The program (`kind = "command"`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub command: String,
    /// Its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Time between checks, in ms.
    #[serde(default = "period")]
    pub period_ms: u64,
    /// How long one check may take, in ms.
    #[serde(default = "period")]
    pub timeout_ms: u64,
    /// Consecutive failures that make a ready replica not ready (readiness) or restart it
    /// (liveness).
    #[serde(default = "three")]
    pub failure_threshold: u32,
    /// Time after the start before the first check counts against the replica, in ms.
    #[serde(default)]
    pub initial_delay_ms: u64,
}

fn root() -> String {
    "/".into()
}
fn period() -> u64 {
    1000
}
fn three() -> u32 {
    3
}

impl Probe {
    fn validate(&self, at: &str, limits: &Limits) -> Result<(), ValidationError> {
        let bad = |field: String, message: String| ValidationError::Invalid { field, message };
        check_range(|| format!("{at}.period_ms"), self.period_ms, MIN_PROBE_PERIOD_MS, MAX_PROBE_MS)?;
        check_range(|| format!("{at}.timeout_ms"), self.timeout_ms, MIN_PROBE_PERIOD_MS, MAX_PROBE_MS)?;
        check_range(|| format!("{at}.initial_delay_ms"), self.initial_delay_ms, 0, MAX_PROBE_MS)?;
        check_range(|| format!("{at}.failure_threshold"), self.failure_threshold, 1, MAX_PROBE_THRESHOLD)?;
        match self.kind {
            ProbeKind::Http => {
                check_value(|| format!("{at}.path"), &self.path, limits.max_task_bytes)?;
                if !self.path.starts_with('/') || self.path.chars().any(|c| c.is_whitespace()) {
                    return Err(bad(format!("{at}.path"), "must start with '/' and hold no whitespace".into()));
                }
            }
            ProbeKind::Tcp => {}
            ProbeKind::Command => {
                if self.command.is_empty() {
                    return Err(ValidationError::Empty { field: format!("{at}.command") });
                }
                check_range(|| format!("{at}.args"), self.args.len(), 0, limits.max_task_entries)?;
                let bytes = self.command.len() + self.args.iter().map(String::len).sum::<usize>();
                check_range(|| at.to_owned(), bytes, 1, limits.max_task_bytes)?;
                if self.command.contains('\0') || self.args.iter().any(|a| a.contains('\0')) {
                    return Err(bad(format!("{at}.command"), "contains a NUL byte".into()));
                }
            }
        }
        Ok(())
    }
}

impl ServiceSpec {
    /// Checks every field against `limits`, naming the first bad one.
    pub fn validate(&self, limits: &Limits) -> Result<(), ValidationError> {
        check_range(|| "service.restart_backoff_s".into(), self.restart_backoff_s, 0, MAX_RESTART_BACKOFF_S)?;
        check_range(
            || "service.max_restart_backoff_s".into(),
            self.max_restart_backoff_s,
            self.restart_backoff_s,
            MAX_RESTART_BACKOFF_S,
        )?;
        if let Some(p) = &self.readiness {
            p.validate("service.readiness", limits)?;
        }
        if let Some(p) = &self.liveness {
            p.validate("service.liveness", limits)?;
        }
        Ok(())
    }

    /// The wait before the next replacement after `streak` replica ends in a row (1 for the
    /// first): `restart_backoff_s` doubled per further end, at most `max_restart_backoff_s`.
    pub fn backoff_s(&self, streak: u32) -> u64 {
        let doublings = streak.saturating_sub(1).min(20);
        self.restart_backoff_s.saturating_mul(1u64 << doublings).min(self.max_restart_backoff_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let s = ServiceSpec { restart_backoff_s: 2, max_restart_backoff_s: 10, ..ServiceSpec::default() };
        assert_eq!([1, 2, 3, 4, 40].map(|n| s.backoff_s(n)), [2, 4, 8, 10, 10]);
        let zero = ServiceSpec { restart_backoff_s: 0, ..ServiceSpec::default() };
        assert_eq!(zero.backoff_s(9), 0);
    }

    #[test]
    fn bad_probes_name_their_field() {
        let l = Limits::default();
        let p = |kind| Probe {
            kind,
            path: "/".into(),
            command: String::new(),
            args: Vec::new(),
            period_ms: 1000,
            timeout_ms: 1000,
            failure_threshold: 3,
            initial_delay_ms: 0,
        };
        let mut s = ServiceSpec { readiness: Some(p(ProbeKind::Command)), ..ServiceSpec::default() };
        assert_eq!(s.validate(&l).map_err(|e| e.field().to_owned()), Err("service.readiness.command".into()));
        s.readiness = Some(Probe { period_ms: 5, ..p(ProbeKind::Tcp) });
        let e = s.validate(&l).expect_err("a 5 ms period is refused");
        assert_eq!(e.field(), "service.readiness.period_ms");
        assert!(e.to_string().contains("between 100 and 3600000"), "{e}");
        s.readiness = None;
        s.liveness = Some(Probe { path: "healthz".into(), ..p(ProbeKind::Http) });
        assert_eq!(s.validate(&l).map_err(|e| e.field().to_owned()), Err("service.liveness.path".into()));
        let s = ServiceSpec { restart_backoff_s: 30, max_restart_backoff_s: 10, ..ServiceSpec::default() };
        assert_eq!(s.validate(&l).map_err(|e| e.field().to_owned()), Err("service.max_restart_backoff_s".into()));
    }
}
