//! Faults injected at run time through the fault file, and the deterministic stats curve.
//!
//! The fault file is TOML, re-read whenever its modification time, size or inode changes
//! (checked on every call: one `stat`):
//!
//! ```toml
//! unhealthy = ["gpu3"]                        # these report unhealthy (and an event on change)
//! xid = [{ device = "gpu1", code = 79 }]      # one HealthEvent each, device unhealthy while listed
//! # ABI 1.3 remediation: a class on the event (absent: 0, the 1.2 meaning)
//! # application: the device stays healthy; recoverable: unhealthy until `reset`; fatal: unhealthy
//! xid = [{ device = "gpu2", code = 13, class = "application" }]
//! reset_fails = ["gpu2"]                      # reset of these fails (FAILED_PRECONDITION)
//! utilization = { gpu0 = 90.0 }               # fixed utilization instead of the curve
//! memory_used_mib = { gpu0 = 40000 }          # fixed memory use instead of the curve's share
//! curve = { period_s = 300.0, min_pct = 5.0, max_pct = 95.0 }
//! crash = "panic"          # panic | hang | segfault | abort   (test/demo misbehaviour)
//! crash_on = "stats"       # init | fingerprint | reserve | stats | health_events | any (default any)
//! crash_once = true        # crash once, leaving <fault file>.crashed; delete it to arm again
//! ```

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use suanli_device_abi::EventClass;

/// How the plugin misbehaves on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crash {
    /// `panic!` (caught at the ABI boundary: the call fails).
    Panic,
    /// Sleep forever (the host's deadline must kill the process).
    Hang,
    /// A write near address zero: SIGSEGV.
    Segfault,
    /// `std::process::abort()`: SIGABRT.
    Abort,
}

/// Which call misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `init`.
    Init,
    /// `fingerprint`.
    Fingerprint,
    /// `reserve`.
    Reserve,
    /// `stats`.
    Stats,
    /// `health_events`.
    HealthEvents,
    /// `release` (ABI 1.2).
    Release,
    /// `reset` (ABI 1.3).
    Reset,
}

impl Call {
    /// The call's name as written in `crash_on`.
    pub fn as_str(self) -> &'static str {
        match self {
            Call::Init => "init",
            Call::Fingerprint => "fingerprint",
            Call::Reserve => "reserve",
            Call::Stats => "stats",
            Call::HealthEvents => "health_events",
            Call::Release => "release",
            Call::Reset => "reset",
        }
    }
}

/// The stats curve: utilization follows a sine between `min_pct` and `max_pct`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Curve {
    /// Period in seconds.
    #[serde(default = "default_period")]
    pub period_s: f64,
    /// Lowest utilization.
    #[serde(default = "default_min")]
    pub min_pct: f64,
    /// Highest utilization.
    #[serde(default = "default_max")]
    pub max_pct: f64,
}

fn default_period() -> f64 {
    300.0
}
fn default_min() -> f64 {
    5.0
}
fn default_max() -> f64 {
    95.0
}

impl Default for Curve {
    fn default() -> Self {
        Curve { period_s: default_period(), min_pct: default_min(), max_pct: default_max() }
    }
}

impl Curve {
    /// Utilization at `t_s` seconds for device number `ordinal` (each device is phase-shifted so
    /// that they do not move in lockstep).
    pub fn at(&self, t_s: f64, ordinal: usize) -> f64 {
        let phase = ordinal as f64 * 0.7;
        let x = std::f64::consts::TAU * (t_s / self.period_s) + phase;
        let v = self.min_pct + (self.max_pct - self.min_pct) * 0.5 * (1.0 + x.sin());
        v.clamp(0.0, 100.0)
    }
}

/// One injected XID-like error.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Xid {
    /// The device id.
    pub device: String,
    /// The vendor code (e.g. 79: "GPU has fallen off the bus").
    pub code: u64,
    /// The event's class (ABI 1.3): application, recoverable or fatal; absent: unspecified.
    #[serde(default)]
    pub class: Option<String>,
}

impl Xid {
    /// The event class it is reported with (validated by [`parse_faults`]).
    pub fn class(&self) -> EventClass {
        self.class.as_deref().and_then(EventClass::parse).unwrap_or(EventClass::Unspecified)
    }
}

/// A validated fault file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Faults {
    /// Devices forced unhealthy.
    pub unhealthy: BTreeSet<String>,
    /// XID-like errors (each device listed is unhealthy while listed).
    pub xid: BTreeSet<Xid>,
    /// Fixed utilization per device.
    pub utilization: BTreeMap<String, f64>,
    /// Fixed memory use per device.
    pub memory_used_mib: BTreeMap<String, u64>,
    /// The curve for the others.
    pub curve: Curve,
    /// Misbehaviour, and on which call (`None` = any call).
    pub crash: Option<(Crash, Option<Call>)>,
    /// Crash only when the `.crashed` marker next to the fault file is absent.
    pub crash_once: bool,
    /// Devices whose `reset` fails.
    pub reset_fails: BTreeSet<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFaults {
    #[serde(default)]
    unhealthy: Vec<String>,
    #[serde(default)]
    xid: Vec<Xid>,
    #[serde(default)]
    utilization: BTreeMap<String, f64>,
    #[serde(default)]
    memory_used_mib: BTreeMap<String, u64>,
    curve: Option<Curve>,
    crash: Option<String>,
    crash_on: Option<String>,
    #[serde(default)]
    crash_once: bool,
    #[serde(default)]
    reset_fails: Vec<String>,
}

/// The most entries of any one list or table in a fault file.
pub const MAX_FAULT_ENTRIES: usize = 1024;

/// Parses a fault file; every device it names must be one of `known`.
pub fn parse_faults(text: &str, known: &BTreeSet<String>) -> Result<Faults, String> {
    let raw: RawFaults = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
    let check = |id: &str, field: &str| -> Result<(), String> {
        if known.contains(id) {
            Ok(())
        } else {
            Err(format!("{field} names {id:?}, which is not a device of this config"))
        }
    };
    for (name, n) in [
        ("unhealthy", raw.unhealthy.len()),
        ("xid", raw.xid.len()),
        ("utilization", raw.utilization.len()),
        ("memory_used_mib", raw.memory_used_mib.len()),
        ("reset_fails", raw.reset_fails.len()),
    ] {
        if n > MAX_FAULT_ENTRIES {
            return Err(format!("{name} has {n} entries, the limit is {MAX_FAULT_ENTRIES}"));
        }
    }
    for id in &raw.unhealthy {
        check(id, "unhealthy")?;
    }
    for (i, x) in raw.xid.iter().enumerate() {
        check(&x.device, &format!("xid[{i}].device"))?;
        if let Some(c) = &x.class
            && !matches!(
                EventClass::parse(c),
                Some(EventClass::Application | EventClass::Recoverable | EventClass::Fatal)
            )
        {
            return Err(format!("xid[{i}].class is {c:?}, expected application, recoverable or fatal"));
        }
    }
    for id in &raw.reset_fails {
        check(id, "reset_fails")?;
    }
    for (id, v) in &raw.utilization {
        check(id, "utilization")?;
        if !(0.0..=100.0).contains(v) {
            return Err(format!("utilization.{id} is {v}, expected 0 to 100"));
        }
    }
    for id in raw.memory_used_mib.keys() {
        check(id, "memory_used_mib")?;
    }
    let curve = raw.curve.unwrap_or_default();
    if !(curve.period_s.is_finite() && curve.period_s >= 1.0) {
        return Err(format!("curve.period_s is {}, expected at least 1", curve.period_s));
    }
    if !(0.0..=100.0).contains(&curve.min_pct)
        || !(0.0..=100.0).contains(&curve.max_pct)
        || curve.min_pct > curve.max_pct
    {
        return Err(format!(
            "curve.min_pct {} and curve.max_pct {} must lie in 0 to 100 with min <= max",
            curve.min_pct, curve.max_pct
        ));
    }
    let crash = match raw.crash.as_deref() {
        None => {
            if raw.crash_on.is_some() {
                return Err("crash_on is set without crash".into());
            }
            None
        }
        Some(c) => {
            let kind = match c {
                "panic" => Crash::Panic,
                "hang" => Crash::Hang,
                "segfault" => Crash::Segfault,
                "abort" => Crash::Abort,
                _ => return Err(format!("crash is {c:?}, expected panic, hang, segfault or abort")),
            };
            let on = match raw.crash_on.as_deref() {
                None | Some("any") => None,
                Some("init") => Some(Call::Init),
                Some("fingerprint") => Some(Call::Fingerprint),
                Some("reserve") => Some(Call::Reserve),
                Some("stats") => Some(Call::Stats),
                Some("health_events") => Some(Call::HealthEvents),
                Some("release") => Some(Call::Release),
                Some("reset") => Some(Call::Reset),
                Some(o) => {
                    return Err(format!(
                        "crash_on is {o:?}, expected init, fingerprint, reserve, stats, health_events, release, reset or any"
                    ));
                }
            };
            Some((kind, on))
        }
    };
    Ok(Faults {
        unhealthy: raw.unhealthy.into_iter().collect(),
        xid: raw.xid.into_iter().collect(),
        utilization: raw.utilization,
        memory_used_mib: raw.memory_used_mib,
        curve,
        crash,
        crash_once: raw.crash_once,
        reset_fails: raw.reset_fails.into_iter().collect(),
    })
}

impl Faults {
    /// Why a device is unhealthy, or `None` when it is healthy. Application-class XIDs leave the
    /// device healthy; those in `cleared` (a reset took them away) no longer count.
    pub fn health_reason(&self, id: &str, cleared: &BTreeSet<Xid>) -> Option<String> {
        let xids: Vec<String> = self
            .xid
            .iter()
            .filter(|x| x.device == id && x.class() != EventClass::Application && !cleared.contains(x))
            .map(|x| x.code.to_string())
            .collect();
        if !xids.is_empty() {
            return Some(format!("injected XID {} (fake fault)", xids.join(", ")));
        }
        if self.unhealthy.contains(id) {
            return Some("injected unhealthy (fake fault)".into());
        }
        None
    }

    /// The misbehaviour due on `call`, if any.
    pub fn crash_for(&self, call: Call) -> Option<Crash> {
        match self.crash {
            Some((c, None)) => Some(c),
            Some((c, Some(on))) if on == call => Some(c),
            _ => None,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_fake_faults_tests {
    use super::*;

    fn known() -> BTreeSet<String> {
        (0..4).map(|i| format!("gpu{i}")).collect()
    }

    #[test]
    fn a_full_fault_file() {
        let text = r#"
unhealthy = ["gpu3"]
xid = [{ device = "gpu1", code = 79 }, { device = "gpu1", code = 48 }]
utilization = { gpu0 = 90.0 }
memory_used_mib = { gpu0 = 1000 }
curve = { period_s = 60.0, min_pct = 10.0, max_pct = 20.0 }
crash = "segfault"
crash_on = "stats"
crash_once = true
"#;
        let f = parse_faults(text, &known()).unwrap();
        let none = BTreeSet::new();
        assert_eq!(f.health_reason("gpu3", &none).unwrap(), "injected unhealthy (fake fault)");
        assert_eq!(f.health_reason("gpu1", &none).unwrap(), "injected XID 48, 79 (fake fault)");
        assert_eq!(f.health_reason("gpu0", &none), None);
        let classes = parse_faults(
            "xid = [{ device = \"gpu0\", code = 13, class = \"application\" }, { device = \"gpu1\", code = 79, class = \"recoverable\" }]\nreset_fails = [\"gpu1\"]",
            &known(),
        )
        .unwrap();
        assert_eq!(classes.health_reason("gpu0", &none), None, "an application error leaves the device healthy");
        let cleared: BTreeSet<Xid> = classes.xid.iter().filter(|x| x.device == "gpu1").cloned().collect();
        assert!(classes.health_reason("gpu1", &none).is_some());
        assert_eq!(classes.health_reason("gpu1", &cleared), None, "a reset clears it");
        assert!(classes.reset_fails.contains("gpu1"));
        assert_eq!(f.crash_for(Call::Stats), Some(Crash::Segfault));
        assert_eq!(f.crash_for(Call::Reserve), None);
        assert!(f.crash_once);
        assert_eq!(f.curve, Curve { period_s: 60.0, min_pct: 10.0, max_pct: 20.0 });
        let any = parse_faults("crash = \"hang\"", &known()).unwrap();
        assert_eq!(any.crash_for(Call::Init), Some(Crash::Hang));
        assert_eq!(parse_faults("", &known()).unwrap(), Faults::default());
    }

    #[test]
    fn bad_fault_files_name_the_field() {
        let e = |t: &str| parse_faults(t, &known()).unwrap_err();
        assert!(e("unhealthy = [\"gpu9\"]").contains("unhealthy names \"gpu9\""));
        assert!(e("xid = [{ device = \"x\", code = 1 }]").contains("xid[0].device"));
        assert!(e("utilization = { gpu0 = 120.0 }").contains("utilization.gpu0 is 120"));
        assert!(e("crash = \"explode\"").contains("crash is \"explode\""));
        assert!(e("crash = \"panic\"\ncrash_on = \"lunch\"").contains("crash_on is \"lunch\""));
        assert!(e("crash_on = \"stats\"").contains("without crash"));
        assert!(e("curve = { period_s = 0.0 }").contains("curve.period_s"));
        assert!(e("curve = { min_pct = 50.0, max_pct = 10.0 }").contains("min <= max"));
        assert!(e("surprise = 1").contains("surprise"));
        assert!(e("xid = [{ device = \"gpu0\", code = 1, class = \"meh\" }]").contains("xid[0].class"));
        assert!(e("reset_fails = [\"gpu9\"]").contains("reset_fails names"));
    }

    #[test]
    fn the_curve_is_deterministic_and_bounded() {
        let c = Curve { period_s: 100.0, min_pct: 10.0, max_pct: 30.0 };
        assert!((c.at(0.0, 0) - 20.0).abs() < 1e-9);
        assert!((c.at(25.0, 0) - 30.0).abs() < 1e-9);
        assert!((c.at(75.0, 0) - 10.0).abs() < 1e-9);
        assert_eq!(c.at(1234.5, 3), c.at(1234.5, 3));
        assert_ne!(c.at(10.0, 0), c.at(10.0, 1));
        for t in 0..1000 {
            let v = c.at(f64::from(t) * 0.37, t as usize % 8);
            assert!((10.0..=30.0).contains(&v), "{v}");
        }
    }
}
