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
/// Most replicas a rolling update may take down or add beyond `replicas` at once.
pub const MAX_UPDATE_STEP: u32 = 10_000;

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
    /// Place a group's replicas on different nodes where the cluster allows (the default),
    /// preferring nodes none of them runs on; `false`: placed like any task (packed).
    #[serde(default = "yes")]
    pub spread: bool,
    /// How `suanli service update` replaces the replicas of the previous spec.
    #[serde(default)]
    pub update: UpdateStrategy,
    /// Scale the (one) task group's `replicas` on a load signal the replicas report
    /// (absent: `replicas` stays as the spec says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscale: Option<Autoscale>,
    /// The request latency and success rate each replica measures, read by its agent and
    /// exported per service (absent: neither is read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<ServiceReport>,
}

/// Where the numbers a replica reports (its load; its latency and success rate) come from,
/// read by its agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LoadSource {
    /// One number per file in `$SUANLI_ALLOC_DIR`, which the replica rewrites: `load`;
    /// `latency_ms` and `success_ratio`.
    #[default]
    File,
    /// Samples of `GET http://127.0.0.1:$SUANLI_PORT/metrics`, the Prometheus text format:
    /// the load is `metric` (without labels, or the sum of its labelled samples); the latency
    /// and success ratio are `latency_metric` and `success_metric` (the mean of their samples).
    Prometheus,
}

/// Longest request latency a replica may report, in ms (an hour); the agent caps larger
/// values, and the control plane refuses them.
pub const MAX_REPORTED_LATENCY_MS: u64 = 3_600_000;

/// What a replica reports besides its load (docs/services.md, "Latency and success rate"):
/// its request latency in ms (p99, mean: the replica's choice) and the fraction of its
/// requests that succeeded (0 to 1), both as the replica measures them. The agent reads them
/// once a period; the control plane keeps the latest of each per replica and exports, per
/// service, the mean over its ready replicas that reported within three periods.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ServiceReport {
    /// Where they are read (default `file`: `$SUANLI_ALLOC_DIR/latency_ms` and
    /// `$SUANLI_ALLOC_DIR/success_ratio`).
    #[serde(default)]
    pub source: LoadSource,
    /// The Prometheus sample of the latency, in ms (`source = "prometheus"`).
    #[serde(default = "latency_metric")]
    pub latency_metric: String,
    /// The Prometheus sample of the success ratio, 0 to 1 (`source = "prometheus"`).
    #[serde(default = "success_metric")]
    pub success_metric: String,
    /// How often the agent reads and reports them, in seconds (default 15, 1 .. 86,400).
    #[serde(default = "fifteen")]
    pub period_s: u64,
}

fn latency_metric() -> String {
    "suanli_latency_ms".into()
}
fn success_metric() -> String {
    "suanli_success_ratio".into()
}

impl Default for ServiceReport {
    fn default() -> Self {
        ServiceReport {
            source: LoadSource::File,
            latency_metric: latency_metric(),
            success_metric: success_metric(),
            period_s: fifteen(),
        }
    }
}

impl ServiceReport {
    fn validate(&self) -> Result<(), ValidationError> {
        check_range(|| "service.report.period_s".into(), self.period_s, 1, MAX_AUTOSCALE_WINDOW_S)?;
        check_metric_name("service.report.latency_metric", &self.latency_metric)?;
        check_metric_name("service.report.success_metric", &self.success_metric)
    }
}

/// A Prometheus metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`, at most 200 bytes), or an error
/// naming `field`.
fn check_metric_name(field: &str, name: &str) -> Result<(), ValidationError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    if ok {
        return Ok(());
    }
    Err(ValidationError::Invalid {
        field: field.into(),
        message: "must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*, at most 200 bytes)".into(),
    })
}

/// Autoscaling on a per-replica load signal, as the Kubernetes HPA computes it:
/// `wanted = ceil(replicas × average load / target)` outside a tolerance, held by a
/// stabilization window in each direction, bounded in step and by `min..max_replicas`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Autoscale {
    /// Fewest replicas (≥ 1).
    pub min_replicas: u32,
    /// Most replicas.
    pub max_replicas: u32,
    /// Where the load is read.
    #[serde(default)]
    pub source: LoadSource,
    /// The Prometheus sample to read (`source = "prometheus"`).
    #[serde(default = "load_metric")]
    pub metric: String,
    /// The load one replica should carry, in the metric's units (requests/s, queue
    /// length, milliseconds of latency): ≥ 1.
    pub target: u64,
    /// Changes of the load within this percentage of the target do not scale (default 10).
    #[serde(default = "ten")]
    pub tolerance_pct: u32,
    /// How often the leader decides, in seconds (default 15).
    #[serde(default = "fifteen")]
    pub period_s: u64,
    /// Scale up to the lowest recommendation of this window, in seconds (default 0).
    #[serde(default)]
    pub scale_up_window_s: u64,
    /// Scale down to the highest recommendation of this window, in seconds (default 300).
    #[serde(default = "three_hundred")]
    pub scale_down_window_s: u64,
    /// Most replicas added per decision (default 4; 0: no bound).
    #[serde(default = "four")]
    pub scale_up_step: u32,
    /// Most replicas removed per decision (default 0: no bound).
    #[serde(default)]
    pub scale_down_step: u32,
}

fn load_metric() -> String {
    "suanli_load".into()
}
fn ten() -> u32 {
    10
}
fn fifteen() -> u64 {
    15
}
fn three_hundred() -> u64 {
    300
}
fn four() -> u32 {
    4
}

/// Longest autoscaling period or window, in seconds.
pub const MAX_AUTOSCALE_WINDOW_S: u64 = 86_400;

impl Autoscale {
    fn validate(&self, limits: &Limits) -> Result<(), ValidationError> {
        check_range(|| "service.autoscale.min_replicas".into(), self.min_replicas, 1, limits.max_replicas)?;
        check_range(
            || "service.autoscale.max_replicas".into(),
            self.max_replicas,
            self.min_replicas,
            limits.max_replicas,
        )?;
        check_range(|| "service.autoscale.target".into(), self.target, 1, u64::MAX / 1_000_000)?;
        check_range(|| "service.autoscale.tolerance_pct".into(), self.tolerance_pct, 0, 100)?;
        check_range(|| "service.autoscale.period_s".into(), self.period_s, 1, MAX_AUTOSCALE_WINDOW_S)?;
        check_range(
            || "service.autoscale.scale_up_window_s".into(),
            self.scale_up_window_s,
            0,
            MAX_AUTOSCALE_WINDOW_S,
        )?;
        check_range(
            || "service.autoscale.scale_down_window_s".into(),
            self.scale_down_window_s,
            0,
            MAX_AUTOSCALE_WINDOW_S,
        )?;
        check_range(|| "service.autoscale.scale_up_step".into(), self.scale_up_step, 0, limits.max_replicas)?;
        check_range(|| "service.autoscale.scale_down_step".into(), self.scale_down_step, 0, limits.max_replicas)?;
        check_metric_name("service.autoscale.metric", &self.metric)
    }

    /// The replicas wanted for `current` replicas whose reported loads (in thousandths of
    /// the metric's unit) average `avg_milli`: `ceil(current × avg / target)`, or `current`
    /// within the tolerance, bounded by `min..max_replicas`. Integer arithmetic: the same
    /// inputs give the same answer everywhere.
    pub fn recommend(&self, current: u32, avg_milli: u64) -> u32 {
        let target_milli = u128::from(self.target) * 1000;
        let avg = u128::from(avg_milli);
        let off = avg.abs_diff(target_milli) * 100;
        let raw = if current == 0 || off <= target_milli * u128::from(self.tolerance_pct) {
            u128::from(current.max(1))
        } else {
            (u128::from(current) * avg).div_ceil(target_milli)
        };
        let raw = u32::try_from(raw).unwrap_or(u32::MAX);
        raw.clamp(self.min_replicas, self.max_replicas)
    }
}

/// A rolling update's pace, as a Kubernetes Deployment's `RollingUpdate` strategy (in
/// replicas, not percentages): the service keeps at least `replicas - max_unavailable` ready
/// replicas and runs at most `replicas + max_surge` at once while old ones are replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UpdateStrategy {
    /// Ready replicas the update may take away below `replicas` (default 0).
    #[serde(default)]
    pub max_unavailable: u32,
    /// Replicas the update may start beyond `replicas` (default 1).
    #[serde(default = "one")]
    pub max_surge: u32,
}

impl Default for UpdateStrategy {
    fn default() -> Self {
        UpdateStrategy { max_unavailable: 0, max_surge: 1 }
    }
}

fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}

fn one_s() -> u64 {
    1
}
fn sixty_s() -> u64 {
    60
}

impl Default for ServiceSpec {
    fn default() -> Self {
        ServiceSpec {
            port: 0,
            readiness: None,
            liveness: None,
            restart_backoff_s: 1,
            max_restart_backoff_s: 60,
            spread: true,
            update: UpdateStrategy::default(),
            autoscale: None,
            report: None,
        }
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
        if let Some(a) = &self.autoscale {
            a.validate(limits)?;
        }
        if let Some(r) = &self.report {
            r.validate()?;
        }
        check_range(|| "service.update.max_unavailable".into(), self.update.max_unavailable, 0, MAX_UPDATE_STEP)?;
        check_range(|| "service.update.max_surge".into(), self.update.max_surge, 0, MAX_UPDATE_STEP)?;
        if self.update.max_unavailable == 0 && self.update.max_surge == 0 {
            return Err(ValidationError::Invalid {
                field: "service.update".into(),
                message: "max_unavailable and max_surge are both 0: a rolling update could never replace a replica"
                    .into(),
            });
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

    fn autoscale() -> Autoscale {
        Autoscale {
            min_replicas: 1,
            max_replicas: 10,
            source: LoadSource::File,
            metric: load_metric(),
            target: 10,
            tolerance_pct: 10,
            period_s: 15,
            scale_up_window_s: 0,
            scale_down_window_s: 300,
            scale_up_step: 4,
            scale_down_step: 0,
        }
    }

    #[test]
    fn recommendations_follow_the_hpa_formula_within_bounds() {
        let a = autoscale();
        // 2 replicas at 30 each against a target of 10: 6.
        assert_eq!(a.recommend(2, 30_000), 6);
        // Within 10% of the target: unchanged.
        assert_eq!(a.recommend(3, 10_900), 3);
        assert_eq!(a.recommend(3, 9_100), 3);
        // 3 at 4 each: ceil(1.2) = 2; nothing at all: the minimum.
        assert_eq!(a.recommend(3, 4_000), 2);
        assert_eq!(a.recommend(3, 0), 1);
        // The maximum holds.
        assert_eq!(a.recommend(8, 1_000_000), 10);
    }

    #[test]
    fn bad_autoscale_fields_are_named() {
        let l = Limits::default();
        let with = |a: Autoscale| ServiceSpec { autoscale: Some(a), ..ServiceSpec::default() };
        let field = |s: ServiceSpec| s.validate(&l).map_err(|e| e.field().to_owned());
        assert_eq!(field(with(autoscale())), Ok(()));
        assert_eq!(
            field(with(Autoscale { min_replicas: 0, ..autoscale() })),
            Err("service.autoscale.min_replicas".into())
        );
        assert_eq!(
            field(with(Autoscale { max_replicas: 0, ..autoscale() })),
            Err("service.autoscale.max_replicas".into())
        );
        assert_eq!(field(with(Autoscale { target: 0, ..autoscale() })), Err("service.autoscale.target".into()));
        assert_eq!(field(with(Autoscale { period_s: 0, ..autoscale() })), Err("service.autoscale.period_s".into()));
        let bad_metric = Autoscale { metric: "http requests".into(), ..autoscale() };
        assert_eq!(field(with(bad_metric)), Err("service.autoscale.metric".into()));
    }

    #[test]
    fn bad_report_fields_are_named_with_their_limit() {
        let l = Limits::default();
        let with = |r: ServiceReport| ServiceSpec { report: Some(r), ..ServiceSpec::default() };
        assert_eq!(with(ServiceReport::default()).validate(&l), Ok(()));
        let e = with(ServiceReport { period_s: 0, ..ServiceReport::default() }).validate(&l).expect_err("period 0");
        assert_eq!(e.field(), "service.report.period_s");
        assert!(e.to_string().contains("between 1 and 86400"), "{e}");
        let e = with(ServiceReport { latency_metric: "9lives".into(), ..ServiceReport::default() })
            .validate(&l)
            .expect_err("a digit first");
        assert_eq!(e.field(), "service.report.latency_metric");
        let e = with(ServiceReport { success_metric: String::new(), ..ServiceReport::default() })
            .validate(&l)
            .expect_err("empty");
        assert_eq!(e.field(), "service.report.success_metric");
        // Absent fields take their defaults.
        let r: ServiceReport = serde_json::from_value(serde_json::json!({"source": "prometheus"})).expect("decodes");
        assert_eq!(r, ServiceReport { source: LoadSource::Prometheus, ..ServiceReport::default() });
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
        let stuck = UpdateStrategy { max_unavailable: 0, max_surge: 0 };
        let s = ServiceSpec { update: stuck, ..ServiceSpec::default() };
        assert_eq!(s.validate(&l).map_err(|e| e.field().to_owned()), Err("service.update".into()));
        let wide = UpdateStrategy { max_unavailable: MAX_UPDATE_STEP + 1, max_surge: 1 };
        let s = ServiceSpec { update: wide, ..ServiceSpec::default() };
        assert_eq!(s.validate(&l).map_err(|e| e.field().to_owned()), Err("service.update.max_unavailable".into()));
    }
}
