//! The conformance kit behind `suanli plugin check LIB`.
//!
//! The library runs in a `suanli plugin-host` child under a [`PluginProcess`], exactly as the agent
//! runs it, so a plugin that crashes or hangs makes a check fail instead of killing the checker.
//!
//! ```text
//!  load (symbol, version, table) ─ table size vs minor ─ exported symbols ─ init
//!   ─ fingerprint (valid Inventory) ─ fingerprint is stable ─ reserve each device
//!   ─ reserve of an unknown id ─ reserve empty ─ reserve several ─ reserve and release (1.2)
//!   ─ stats ─ stats of an unknown id ─ health_events (1.1) ─ repeated calls ─ resources (RSS,
//!   descriptors) ─ concurrent calls ─ health scenario ─ stdout ─ deadlines ─ no crashes
//!   ─ host restart ─ shutdown
//! ```
//!
//! Each check yields a [`CheckResult`] (pass, fail, warn or skip, with a reason and its time); the caller
//! prints them as they come. The validators ([`validate_inventory`], [`validate_reservation`],
//! [`validate_stats`]) are public so plugin authors can use them in their own tests.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::supervisor::{HostError, Options, PluginProcess};
use crate::{ABI_MAJOR, ABI_MINOR, Code, pb};

/// The longest device id accepted, in bytes.
pub const MAX_DEVICE_ID_LEN: usize = 128;
/// The longest model name accepted, in bytes.
pub const MAX_MODEL_LEN: usize = 128;
/// The most devices one inventory may list.
pub const MAX_DEVICES: usize = 4096;
/// The device id used to probe `reserve` with an id the plugin cannot know.
pub const UNKNOWN_DEVICE_ID: &str = "suanli-check-no-such-device";

/// How to run the checks.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// How the child is started and the deadlines of the calls.
    pub host: Options,
    /// What init receives.
    pub config: pb::PluginConfig,
    /// How many times the repeated-calls check calls each method.
    pub repeats: usize,
    /// How many concurrent callers the concurrency check runs.
    pub threads: usize,
}

impl CheckOptions {
    /// The defaults: the agent's deadlines, 100 repeats, 8 concurrent callers, quick restarts.
    pub fn new(host_cmd: Vec<std::ffi::OsString>, config: pb::PluginConfig) -> Self {
        let host = Options {
            host_cmd,
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_millis(500),
            retry_unavailable_init: false,
            ..Options::default()
        };
        CheckOptions { host, config, repeats: 100, threads: 8 }
    }
}

/// A check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// It passed.
    Pass,
    /// It failed: the plugin does not conform.
    Fail,
    /// It does not apply (e.g. health_events of an ABI 1.0 plugin).
    Skip,
    /// It works, but not as a plugin should (e.g. it writes to stdout); not a failure.
    Warn,
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct CheckResult {
    /// The check, e.g. `fingerprint`.
    pub name: String,
    /// Pass, fail or skip.
    pub outcome: Outcome,
    /// What was seen (pass), what is wrong (fail) or why it does not apply (skip).
    pub detail: String,
    /// How long the check took, in milliseconds.
    pub elapsed_ms: f64,
}

impl fmt::Display for CheckResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.outcome {
            Outcome::Pass => {
                write!(f, "PASS {} ({})", self.name, fmt_ms(self.elapsed_ms))?;
                if !self.detail.is_empty() {
                    write!(f, ": {}", self.detail)?;
                }
                Ok(())
            }
            Outcome::Fail => write!(f, "FAIL {}: {} ({})", self.name, self.detail, fmt_ms(self.elapsed_ms)),
            Outcome::Skip => write!(f, "SKIP {}: {}", self.name, self.detail),
            Outcome::Warn => write!(f, "WARN {}: {} ({})", self.name, self.detail, fmt_ms(self.elapsed_ms)),
        }
    }
}

fn fmt_ms(ms: f64) -> String {
    if ms >= 1000.0 { format!("{:.2}s", ms / 1000.0) } else { format!("{ms:.1}ms") }
}

/// What the plugin said about itself.
#[derive(Debug, Clone, Serialize)]
pub struct PluginSummary {
    /// Its name.
    pub name: String,
    /// Its version.
    pub version: String,
    /// The ABI it implements, e.g. "1.1".
    pub abi: String,
    /// The calls it offers.
    pub calls: Vec<String>,
}

/// All results of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The library checked.
    pub library: String,
    /// The ABI of this agent, e.g. "1.1".
    pub agent_abi: String,
    /// The plugin, once loaded.
    pub plugin: Option<PluginSummary>,
    /// Every check, in order.
    pub checks: Vec<CheckResult>,
    /// Checks passed.
    pub passed: usize,
    /// Checks failed.
    pub failed: usize,
    /// Checks skipped.
    pub skipped: usize,
    /// Checks that passed with a warning.
    pub warned: usize,
}

impl Report {
    /// True when no check failed.
    pub fn ok(&self) -> bool {
        self.failed == 0 && self.passed > 0
    }
    /// "N passed, M failed" (and ", K skipped" when some were).
    pub fn summary(&self) -> String {
        let mut s = format!("{} passed, {} failed", self.passed, self.failed);
        if self.warned > 0 {
            s.push_str(&format!(", {} warned", self.warned));
        }
        if self.skipped > 0 {
            s.push_str(&format!(", {} skipped", self.skipped));
        }
        s
    }
}

/// Latency and failure bookkeeping shared by every call of a run.
#[derive(Default)]
struct Calls {
    /// Slowest call per method.
    slowest: BTreeMap<&'static str, Duration>,
    /// Calls that ran past their deadline (they fail with Timeout).
    timeouts: Vec<String>,
    /// Calls during which the child died.
    crashes: Vec<String>,
    count: u64,
}

#[derive(Clone)]
struct Caller {
    p: PluginProcess,
    calls: Arc<Mutex<Calls>>,
    /// The latest health each device's events reported (true: healthy), with the reason.
    health: Arc<Mutex<BTreeMap<String, (bool, String)>>>,
}

impl Caller {
    async fn timed<T>(
        &self,
        method: &'static str,
        fut: impl Future<Output = Result<T, HostError>>,
    ) -> Result<T, HostError> {
        let t = Instant::now();
        let res = fut.await;
        let el = t.elapsed();
        let mut c = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        c.count += 1;
        let slot = c.slowest.entry(method).or_default();
        *slot = (*slot).max(el);
        match &res {
            Err(e @ HostError::Timeout { .. }) => c.timeouts.push(e.to_string()),
            Err(e @ HostError::Crashed { .. }) => c.crashes.push(e.to_string()),
            _ => {}
        }
        res
    }
    async fn fingerprint(&self) -> Result<pb::Inventory, HostError> {
        self.timed("fingerprint", self.p.fingerprint()).await
    }
    async fn reserve(&self, ids: &[&str]) -> Result<pb::Reservation, HostError> {
        let req = pb::ReserveRequest {
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
            alloc_id: 1,
            ..Default::default()
        };
        self.timed("reserve", self.p.reserve(req)).await
    }
    /// A 1.2 reserve: `reservation_id` and one share per device.
    async fn reserve_share(&self, id: &str, devices: &[&str], milli: u32) -> Result<pb::Reservation, HostError> {
        let req = pb::ReserveRequest {
            device_ids: devices.iter().map(|s| s.to_string()).collect(),
            alloc_id: 1,
            reservation_id: id.to_string(),
            shares: devices
                .iter()
                .map(|d| pb::ReserveShare { device_id: d.to_string(), milli, memory_mib: 0 })
                .collect(),
        };
        self.timed("reserve", self.p.reserve(req)).await
    }
    async fn release(&self, id: &str, devices: &[&str]) -> Result<pb::ReleaseResponse, HostError> {
        let req = pb::ReleaseRequest {
            reservation_id: id.to_string(),
            device_ids: devices.iter().map(|s| s.to_string()).collect(),
            alloc_id: 1,
        };
        self.timed("release", self.p.release(req)).await
    }
    async fn reset(&self, id: &str) -> Result<pb::ResetResponse, HostError> {
        self.timed("reset", self.p.reset(pb::ResetRequest { device_id: id.to_string() })).await
    }
    async fn stats(&self, ids: &[String]) -> Result<pb::StatsResponse, HostError> {
        self.timed("stats", self.p.stats(pb::StatsRequest { device_ids: ids.to_vec() })).await
    }
    async fn health_events(&self) -> Result<pb::HealthEvents, HostError> {
        let res = self.timed("health_events", self.p.health_events()).await;
        if let Ok(ev) = &res {
            let mut h = self.health.lock().unwrap_or_else(|e| e.into_inner());
            for e in ev.events.iter().take(4096) {
                h.insert(e.device.clone(), (e.healthy, e.reason.clone()));
            }
        }
        res
    }
}

struct Run<'a> {
    report: Report,
    on_result: &'a mut dyn FnMut(&CheckResult),
}

impl Run<'_> {
    fn push(&mut self, name: &str, outcome: Outcome, detail: String, elapsed: Duration) {
        let r = CheckResult { name: name.to_string(), outcome, detail, elapsed_ms: elapsed.as_secs_f64() * 1000.0 };
        match outcome {
            Outcome::Pass => self.report.passed += 1,
            Outcome::Fail => self.report.failed += 1,
            Outcome::Skip => self.report.skipped += 1,
            Outcome::Warn => self.report.warned += 1,
        }
        (self.on_result)(&r);
        self.report.checks.push(r);
    }
    fn result(&mut self, name: &str, start: Instant, res: Result<String, String>) {
        match res {
            Ok(d) => self.push(name, Outcome::Pass, d, start.elapsed()),
            Err(d) => self.push(name, Outcome::Fail, d, start.elapsed()),
        }
    }
    fn skip(&mut self, name: &str, why: &str) {
        self.push(name, Outcome::Skip, why.to_string(), Duration::ZERO);
    }
}

/// Runs every check on `lib`, calling `on_result` after each one.
pub async fn run(lib: &Path, opts: CheckOptions, on_result: &mut dyn FnMut(&CheckResult)) -> Report {
    let report = Report {
        library: lib.display().to_string(),
        agent_abi: format!("{ABI_MAJOR}.{ABI_MINOR}"),
        plugin: None,
        checks: Vec::new(),
        passed: 0,
        failed: 0,
        skipped: 0,
        warned: 0,
    };
    let mut run = Run { report, on_result };
    let mut hello_ok: Option<pb::HostHello> = None;
    let t = Instant::now();
    let (started, times) = PluginProcess::start_timed(lib.to_path_buf(), opts.config.clone(), opts.host.clone()).await;
    match &times.hello {
        Some((h, el)) if h.error.is_empty() => {
            hello_ok = Some(h.clone());
            let newer = if h.abi_minor > ABI_MINOR {
                format!(" (newer minor than this agent's {ABI_MAJOR}.{ABI_MINOR}: its additions go unused)")
            } else {
                String::new()
            };
            run.report.plugin = Some(PluginSummary {
                name: h.plugin_name.clone(),
                version: h.plugin_version.clone(),
                abi: format!("{}.{}", h.abi_major, h.abi_minor),
                calls: h.calls.clone(),
            });
            let detail = format!(
                "plugin {} {}, ABI {}.{}{newer}; calls: {}",
                h.plugin_name,
                h.plugin_version,
                h.abi_major,
                h.abi_minor,
                h.calls.join(", ")
            );
            run.push("load", Outcome::Pass, detail, *el);
        }
        Some((h, el)) => run.push("load", Outcome::Fail, h.error.clone(), *el),
        None => match &started {
            Err(e) => run.push("load", Outcome::Fail, e.to_string(), t.elapsed()),
            Ok(_) => run.push("load", Outcome::Fail, "no Hello from the plugin host".into(), t.elapsed()),
        },
    }
    if let Some(h) = &hello_ok {
        let t = Instant::now();
        run.result("table size", t, table_size(h));
        let t = Instant::now();
        match exported_symbols(lib) {
            Ok(extra) if extra.is_empty() => {
                run.push("exported symbols", Outcome::Pass, "only suanli_device_plugin_entry".into(), t.elapsed())
            }
            Ok(extra) => run.push(
                "exported symbols",
                Outcome::Warn,
                format!(
                    "{} more than the entry point: {}; build with -fvisibility=hidden (C) or keep them private (Rust), so that they cannot clash with the vendor libraries the plugin loads",
                    extra.len(),
                    summarize(extra.into_iter().take(20).collect())
                ),
                t.elapsed(),
            ),
            Err(e) => run.push("exported symbols", Outcome::Skip, e, Duration::ZERO),
        }
    }
    let p = match started {
        Ok(p) => {
            run.push("init", Outcome::Pass, String::new(), times.init.unwrap_or_default());
            p
        }
        Err(e) => {
            if times.hello.as_ref().is_some_and(|(h, _)| h.error.is_empty()) {
                let mut why = e.to_string();
                if matches!(&e, HostError::Plugin(pe) if pe.code == Code::Unavailable) {
                    why.push_str(" (the agent retries an UNAVAILABLE init with backoff, the plugin's devices unknown meanwhile; the kit needs it to succeed)");
                }
                run.push("init", Outcome::Fail, why, t.elapsed());
            }
            return run.report;
        }
    };
    let caller = Caller { p: p.clone(), calls: Arc::new(Mutex::new(Calls::default())), health: Arc::default() };
    let wait_up = opts.host.call_timeout;

    // fingerprint
    let t = Instant::now();
    let mut fingerprint_ok = false;
    // Why later checks have no devices to work on, when fingerprint failed.
    let mut no_inventory = String::new();
    let inventory = match caller.fingerprint().await {
        Ok(inv) => {
            fingerprint_ok = true;
            let problems = validate_inventory(&inv);
            let res = if problems.is_empty() { Ok(describe_inventory(&inv)) } else { Err(problems.join("; ")) };
            run.result("fingerprint", t, res);
            inv
        }
        Err(e) => {
            no_inventory = format!("fingerprint failed ({e}), so there are no devices to use");
            run.result("fingerprint", t, Err(e.to_string()));
            pb::Inventory::default()
        }
    };
    let ids: Vec<String> = inventory.devices.iter().map(|d| d.id.clone()).collect();
    // Without an inventory (fingerprint failed), ids in other replies cannot be checked.
    let known_set: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    let known = fingerprint_ok.then_some(&known_set);

    // fingerprint is stable
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let mut res = Ok("3 more calls, same devices".to_string());
    for i in 0..3 {
        match caller.fingerprint().await {
            Ok(again) => {
                if let Some(diff) = inventory_diff(&inventory, &again) {
                    res = Err(format!("call {} differs from the first: {diff}", i + 2));
                    break;
                }
            }
            Err(e) => {
                res = Err(e.to_string());
                break;
            }
        }
    }
    run.result("fingerprint stable", t, res);

    // reserve each device
    p.wait_up(wait_up).await;
    if inventory.devices.is_empty() {
        let why =
            if no_inventory.is_empty() { "the inventory has no devices".to_string() } else { no_inventory.clone() };
        run.skip("reserve", &why);
    } else {
        let t = Instant::now();
        let mut problems = Vec::new();
        for d in &inventory.devices {
            match caller.reserve(&[d.id.as_str()]).await {
                Ok(r) => {
                    problems.extend(validate_reservation(d, &r).into_iter().map(|m| format!("device {}: {m}", d.id)))
                }
                Err(HostError::Plugin(e)) if !d.healthy && e.code == Code::FailedPrecondition => {}
                Err(e) => problems.push(format!("device {}: {e}", d.id)),
            }
        }
        let res = if problems.is_empty() {
            Ok(format!("{} devices", inventory.devices.len()))
        } else {
            Err(problems.join("; "))
        };
        run.result("reserve", t, res);
    }

    // reserve of an unknown id
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let res = match caller.reserve(&[UNKNOWN_DEVICE_ID]).await {
        Ok(_) => Err(format!("returned a Reservation for the unknown device {UNKNOWN_DEVICE_ID:?}")),
        Err(HostError::Plugin(e)) if matches!(e.code, Code::NotFound | Code::InvalidArgument) => {
            Ok(format!("refused with {}", e.code))
        }
        Err(HostError::Plugin(e)) => Err(format!("expected not_found or invalid_argument, got {e}")),
        Err(e) => Err(e.to_string()),
    };
    run.result("reserve unknown device", t, res);

    // reserve of no device, and of several at once
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let res = match caller.reserve(&[]).await {
        Ok(r) => {
            let problems = validate_reservation(&pb::PluginDevice::default(), &r);
            if problems.is_empty() { Ok("an empty request is granted".to_string()) } else { Err(problems.join("; ")) }
        }
        Err(e) => Err(format!("a reserve with no device ids must succeed (a task given none): {e}")),
    };
    run.result("reserve empty", t, res);
    let healthy: Vec<&pb::PluginDevice> =
        inventory.devices.iter().filter(|d| d.healthy && d.partition_of.is_empty()).collect();
    if healthy.len() < 2 {
        let why = if !no_inventory.is_empty() {
            no_inventory.clone()
        } else {
            format!("{} healthy whole devices (2 needed)", healthy.len())
        };
        run.skip("reserve several", &why);
    } else {
        p.wait_up(wait_up).await;
        let t = Instant::now();
        let ids: Vec<&str> = healthy.iter().map(|d| d.id.as_str()).collect();
        let res = match caller.reserve(&ids).await {
            Ok(r) => {
                let problems = validate_reservation(healthy[0], &r);
                if problems.is_empty() {
                    Ok(format!("{} devices in one request", ids.len()))
                } else {
                    Err(problems.join("; "))
                }
            }
            Err(e) => Err(format!("reserve of {} healthy devices at once: {e}", ids.len())),
        };
        run.result("reserve several", t, res);
    }

    // reserve with a reservation id and shares, release (ABI 1.2)
    p.wait_up(wait_up).await;
    if !p.offers("release") {
        let abi = run.report.plugin.as_ref().map(|s| s.abi.clone()).unwrap_or_default();
        run.skip(
            "reserve and release",
            &format!("release not offered (an ABI {abi} plugin: its reserve is stateless)"),
        );
    } else if let Some(d) = healthy.first() {
        let t = Instant::now();
        let res = reserve_release(&caller, &d.id).await;
        run.result("reserve and release", t, res);
    } else {
        let why = if no_inventory.is_empty() { "no healthy whole device".to_string() } else { no_inventory.clone() };
        run.skip("reserve and release", &why);
    }

    // reset (ABI 1.3): an unknown id is refused; an idle healthy device stays healthy after it
    p.wait_up(wait_up).await;
    if !p.offers("reset") {
        let abi = run.report.plugin.as_ref().map(|s| s.abi.clone()).unwrap_or_default();
        run.skip(
            "reset",
            &format!("reset not offered (an ABI {abi} plugin: recoverable device errors wait for the device to heal)"),
        );
    } else if let Some(d) = healthy.first() {
        let t = Instant::now();
        let res = reset_check(&caller, &d.id).await;
        run.result("reset", t, res);
    } else {
        let why = if no_inventory.is_empty() { "no healthy whole device".to_string() } else { no_inventory.clone() };
        run.skip("reset", &why);
    }

    // stats
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let mut res = match caller.stats(&[]).await {
        Ok(s) => {
            let problems = validate_stats(known, &[], &s);
            if problems.is_empty() { Ok(format!("{} devices", s.devices.len())) } else { Err(problems.join("; ")) }
        }
        Err(e) => Err(e.to_string()),
    };
    if res.is_ok()
        && let Some(first) = ids.first()
    {
        let one = vec![first.clone()];
        match caller.stats(&one).await {
            Ok(s) => {
                let problems = validate_stats(known, &one, &s);
                if !problems.is_empty() {
                    res = Err(format!("stats for [{first}]: {}", problems.join("; ")));
                }
            }
            Err(e) => res = Err(format!("stats for [{first}]: {e}")),
        }
    }
    run.result("stats", t, res);

    // stats of an unknown id
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let unknown = vec![UNKNOWN_DEVICE_ID.to_string()];
    let res = match caller.stats(&unknown).await {
        Ok(s) if s.devices.iter().any(|d| d.id == UNKNOWN_DEVICE_ID) => {
            Err(format!("returned stats for the unknown device {UNKNOWN_DEVICE_ID:?}"))
        }
        Ok(s) if !s.devices.is_empty() => Err(format!(
            "asked only for the unknown device {UNKNOWN_DEVICE_ID:?}, got {} other devices",
            s.devices.len()
        )),
        Ok(_) => Ok("left out".to_string()),
        Err(HostError::Plugin(e)) if matches!(e.code, Code::NotFound | Code::InvalidArgument) => {
            Ok(format!("refused with {}", e.code))
        }
        Err(HostError::Plugin(e)) => Err(format!("expected not_found (or the id left out), got {e}")),
        Err(e) => Err(e.to_string()),
    };
    run.result("stats unknown device", t, res);

    // health_events
    p.wait_up(wait_up).await;
    let offers_health = p.offers("health_events");
    if offers_health {
        let t = Instant::now();
        let mut res = Ok(String::new());
        let mut events = 0;
        for _ in 0..2 {
            match caller.health_events().await {
                Ok(ev) => {
                    events += ev.events.len();
                    let problems = validate_health(known, &ev);
                    if !problems.is_empty() {
                        res = Err(problems.join("; "));
                        break;
                    }
                }
                Err(e) => {
                    res = Err(e.to_string());
                    break;
                }
            }
        }
        run.result("health_events", t, res.map(|_| format!("{events} events")));
    } else {
        let abi = run.report.plugin.as_ref().map(|s| s.abi.clone()).unwrap_or_default();
        let why = match &hello_ok {
            Some(h) if h.table_minor < h.abi_minor => {
                format!(
                    "not offered (struct_size covers only the ABI {}.{} table; see table size)",
                    h.abi_major, h.table_minor
                )
            }
            _ => format!("not offered (an ABI {abi} plugin)"),
        };
        run.skip("health_events", &why);
    }

    // repeated calls, and what they cost the host process
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let before = p.pid().and_then(usage);
    let res = repeated(&caller, &ids, known, offers_health, opts.repeats).await;
    let after = p.pid().and_then(usage);
    run.result("repeated calls", t, res);
    let t = Instant::now();
    match (before, after) {
        (Some(b), Some(a)) => {
            let (outcome, detail) = judge_usage(b, a, opts.repeats);
            run.push("resources", outcome, detail, t.elapsed());
        }
        _ => run.skip("resources", "the plugin host's /proc entries could not be read (not Linux, or it restarted)"),
    }

    // concurrent calls
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let res = concurrent(&caller, &ids, offers_health, opts.threads, opts.repeats).await;
    run.result("concurrent calls", t, res);

    // a device that health_events turned unhealthy: fingerprint shows it, reserve refuses it
    p.wait_up(wait_up).await;
    let unhealthy: Vec<(String, String)> = caller
        .health
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(_, (ok, _))| !ok)
        .map(|(d, (_, r))| (d.clone(), r.clone()))
        .collect();
    if let Some((dev, reason)) = unhealthy.first() {
        let t = Instant::now();
        let res = health_scenario(&caller, dev, reason).await;
        run.result("health scenario", t, res);
    } else {
        run.skip(
            "health scenario",
            "no health event turned a device unhealthy during the run (the plugin's own fault injection exercises it)",
        );
    }

    // stdout
    let t = Instant::now();
    let _ = caller.stats(&[]).await;
    match p.stdout_bytes() {
        0 => run.push("stdout", Outcome::Pass, "nothing written".into(), t.elapsed()),
        n => run.push(
            "stdout",
            Outcome::Warn,
            format!("the plugin wrote {n} bytes to stdout; the host forwards them to stderr, but a plugin must write nothing there (log to stderr)"),
            t.elapsed(),
        ),
    }

    // every call within its deadline
    let t = Instant::now();
    let res = {
        let c = caller.calls.lock().unwrap_or_else(|e| e.into_inner());
        let deadline =
            |m: &str| if m == "fingerprint" { opts.host.fingerprint_timeout } else { opts.host.call_timeout };
        let slowest: Vec<String> =
            c.slowest.iter().map(|(m, d)| format!("{m} {d:.1?} (deadline {:?})", deadline(m))).collect();
        if c.timeouts.is_empty() {
            Ok(format!("{} calls; slowest: {}", c.count, slowest.join(", ")))
        } else {
            Err(format!("{} calls ran past their deadline: {}", c.timeouts.len(), summarize(c.timeouts.clone())))
        }
    };
    run.result("deadlines", t, res);

    // the host never crashed
    let t = Instant::now();
    let res = {
        let c = caller.calls.lock().unwrap_or_else(|e| e.into_inner());
        let restarts = p.restarts();
        if c.crashes.is_empty() && restarts == 0 && p.is_up() {
            Ok("no crash, no restart".to_string())
        } else {
            let mut why = Vec::new();
            if !c.crashes.is_empty() {
                why.push(summarize(c.crashes.clone()));
            }
            if restarts > 0 {
                why.push(format!("the plugin host was restarted {restarts} times"));
            }
            if !p.is_up() {
                why.push("the plugin host is down".into());
            }
            Err(why.join("; "))
        }
    };
    run.result("no crashes", t, res);

    // the host killed mid-run: restarted, init again, the same devices
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let res =
        host_restart(&caller, &inventory, fingerprint_ok, opts.host.backoff_max + opts.host.fingerprint_timeout * 2)
            .await;
    run.result("host restart", t, res);

    // shutdown (of a live host, if a restart brings it back)
    p.wait_up(wait_up).await;
    let t = Instant::now();
    let res = match p.shutdown_detailed().await {
        Ok(d) if d == "exited with status 0" => Ok(String::new()),
        Ok(d) => Err(format!("the plugin host {d} after shutdown (expected exit status 0)")),
        Err(e) => Err(e.to_string()),
    };
    run.result("shutdown", t, res);
    run.report
}

/// The table's size against the minor version it claims.
fn table_size(h: &pb::HostHello) -> Result<String, String> {
    use suanli_device_abi::ffi::API_SIZES;
    let need = |minor: u32| API_SIZES.iter().find(|(m, _)| *m == minor).map(|(_, s)| *s);
    if h.table_minor >= h.abi_minor || h.abi_minor > ABI_MINOR && h.table_minor == ABI_MINOR {
        return Ok(format!("struct_size {} covers ABI {}.{}", h.api_struct_size, h.abi_major, h.table_minor));
    }
    let claimed = need(h.abi_minor).map(|s| format!(" ({s} bytes)")).unwrap_or_default();
    Err(format!(
        "abi_minor says {}.{} but struct_size {} covers only the ABI {}.{} table{}: the calls added since are never made. Set struct_size = sizeof(SuanliDpApi) from the header of the version you claim{}",
        h.abi_major,
        h.abi_minor,
        h.api_struct_size,
        h.abi_major,
        h.table_minor,
        if h.table_minor == 0 { " (health_events is not offered)" } else { "" },
        claimed.replace(" (", ", ").replace(')', "")
    ))
}

/// Defined global symbols of the library's dynamic symbol table other than the entry point.
fn exported_symbols(lib: &Path) -> Result<Vec<String>, String> {
    use object::{Object as _, ObjectSymbol as _};
    let data = std::fs::read(lib).map_err(|e| format!("cannot read {}: {e}", lib.display()))?;
    let file = object::File::parse(&*data).map_err(|e| format!("not an object file the kit can read: {e}"))?;
    let entry =
        std::str::from_utf8(&suanli_device_abi::ffi::ENTRY_SYMBOL[..suanli_device_abi::ffi::ENTRY_SYMBOL.len() - 1])
            .unwrap_or("suanli_device_plugin_entry");
    let mut out: Vec<String> = file
        .dynamic_symbols()
        .filter(|s| s.is_global() && s.is_definition())
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .filter(|n| n != entry && n != "_init" && n != "_fini" && !n.is_empty())
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// A 1.2 reservation's life: reserve with an id, repeat it, release it twice; a half share.
async fn reserve_release(c: &Caller, dev: &str) -> Result<String, String> {
    const ID: &str = "suanli-check-1";
    c.reserve_share(ID, &[dev], 1000).await.map_err(|e| format!("reserve of {dev} with reservation_id {ID:?}: {e}"))?;
    c.reserve_share(ID, &[dev], 1000).await.map_err(|e| {
        format!("a repeated reserve of {ID:?} (as after an agent restart) must be answered as the first: {e}")
    })?;
    c.release(ID, &[dev]).await.map_err(|e| format!("release of {ID:?}: {e}"))?;
    c.release(ID, &[dev])
        .await
        .map_err(|e| format!("a second release of {ID:?} must succeed (it holds nothing): {e}"))?;
    const HALF: &str = "suanli-check-2";
    let half = match c.reserve_share(HALF, &[dev], 500).await {
        Ok(r) => {
            c.release(HALF, &[dev]).await.map_err(|e| format!("release of {HALF:?}: {e}"))?;
            if r.env.is_empty() {
                "a 500-milli share granted".to_string()
            } else {
                format!("a 500-milli share granted ({} env)", r.env.len())
            }
        }
        Err(HostError::Plugin(e)) if matches!(e.code, Code::FailedPrecondition | Code::InvalidArgument) => {
            format!("a 500-milli share refused ({})", e.code)
        }
        Err(e) => return Err(format!("reserve of a 500-milli share: {e}")),
    };
    Ok(format!("reserve, repeat, release, release again; {half}"))
}

/// reset (ABI 1.3): of an unknown id, NOT_FOUND or INVALID_ARGUMENT; of an idle healthy device,
/// success or UNIMPLEMENTED, and the next fingerprint still reports it healthy.
async fn reset_check(c: &Caller, dev: &str) -> Result<String, String> {
    match c.reset(UNKNOWN_DEVICE_ID).await {
        Err(HostError::Plugin(e)) if matches!(e.code, Code::NotFound | Code::InvalidArgument | Code::Unimplemented) => {
        }
        Ok(_) => {
            return Err(format!("reset of the unknown device {UNKNOWN_DEVICE_ID:?} succeeded (expected not_found)"));
        }
        Err(e) => {
            return Err(format!("reset of the unknown device {UNKNOWN_DEVICE_ID:?}: expected not_found, got {e}"));
        }
    }
    let what = match c.reset(dev).await {
        Ok(_) => "reset",
        Err(HostError::Plugin(e)) if e.code == Code::Unimplemented => "unimplemented",
        Err(e) => return Err(format!("reset of the idle healthy device {dev}: {e}")),
    };
    let inv = c.fingerprint().await.map_err(|e| format!("fingerprint after the reset of {dev}: {e}"))?;
    match inv.devices.iter().find(|d| d.id == dev) {
        Some(d) if d.healthy => Ok(format!("{dev}: {what}, healthy after it; unknown id refused")),
        Some(d) => Err(format!("{dev} is unhealthy after its reset: {}", d.health_reason)),
        None => Err(format!("{dev} is gone from the inventory after its reset")),
    }
}

/// After a health event marked `dev` unhealthy: fingerprint says so, reserve is refused.
async fn health_scenario(c: &Caller, dev: &str, reason: &str) -> Result<String, String> {
    let inv = c.fingerprint().await.map_err(|e| format!("fingerprint: {e}"))?;
    let Some(d) = inv.devices.iter().find(|d| d.id == dev) else {
        return Err(format!("health_events reported {dev:?} unhealthy ({reason}); fingerprint no longer lists it"));
    };
    if d.healthy {
        return Err(format!(
            "health_events reported {dev:?} unhealthy ({reason}) and no event since made it healthy, but fingerprint shows it healthy"
        ));
    }
    match c.reserve(&[dev]).await {
        Err(HostError::Plugin(e)) if e.code == Code::FailedPrecondition => {
            Ok(format!("{dev} unhealthy ({reason}): fingerprint shows it, reserve refused with failed_precondition"))
        }
        Ok(_) => Err(format!(
            "reserve of the unhealthy device {dev:?} ({reason}) was granted (expected failed_precondition)"
        )),
        Err(e) => Err(format!("reserve of the unhealthy device {dev:?}: expected failed_precondition, got {e}")),
    }
}

/// Kills the plugin host and waits for the supervisor's restart: init again, same devices.
async fn host_restart(c: &Caller, inv: &pb::Inventory, have_inventory: bool, wait: Duration) -> Result<String, String> {
    let restarts = c.p.restarts();
    let t = Instant::now();
    if !c.p.kill_host("killed by the conformance kit's restart check") {
        return Err("the plugin host is not running".into());
    }
    let deadline = Instant::now() + wait;
    while c.p.restarts() == restarts || !c.p.is_up() {
        if Instant::now() >= deadline {
            return Err(format!("not restarted within {wait:?} of a SIGKILL (init again failed?)"));
        }
        c.p.wait_up(Duration::from_millis(100)).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let up_after = t.elapsed();
    let again = c.fingerprint().await.map_err(|e| format!("fingerprint after the restart: {e}"))?;
    if have_inventory && let Some(diff) = inventory_diff(inv, &again) {
        return Err(format!("after the restart the inventory differs: {diff}"));
    }
    Ok(format!("up again {up_after:.1?} after a SIGKILL, {} devices as before", again.devices.len()))
}

/// Resident memory (bytes) and open descriptors of a process.
fn usage(pid: u32) -> Option<(u64, usize)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((kb * 1024, fds))
}

/// Growth of the plugin host's memory and descriptors across the repeated calls.
pub(crate) fn judge_usage(before: (u64, usize), after: (u64, usize), rounds: usize) -> (Outcome, String) {
    const MIB: u64 = 1 << 20;
    let rss = after.0.saturating_sub(before.0);
    let fds = after.1.saturating_sub(before.1);
    let detail = format!(
        "host RSS {:.1} -> {:.1} MiB, open descriptors {} -> {} over {rounds} rounds",
        before.0 as f64 / MIB as f64,
        after.0 as f64 / MIB as f64,
        before.1,
        after.1
    );
    let fd_fail = rounds >= 10 && fds >= rounds / 2;
    if rss >= RSS_FAIL_BYTES || fd_fail {
        let what =
            if fd_fail { "descriptors leak (one per round or so)" } else { "memory grows with every call (a leak?)" };
        (
            Outcome::Fail,
            format!("{detail}: {what}; limits: {} MiB growth, {} descriptors", RSS_FAIL_BYTES / MIB, rounds / 2),
        )
    } else if rss >= RSS_WARN_BYTES || fds > 2 {
        (Outcome::Warn, format!("{detail}: grew more than {} MiB or 2 descriptors", RSS_WARN_BYTES / MIB))
    } else {
        (Outcome::Pass, detail)
    }
}

/// Host memory growth over the repeated calls that fails the `resources` check.
pub const RSS_FAIL_BYTES: u64 = 32 << 20;
/// Host memory growth that warns.
pub const RSS_WARN_BYTES: u64 = 8 << 20;

async fn repeated(
    c: &Caller,
    ids: &[String],
    known: Option<&BTreeSet<&str>>,
    health: bool,
    repeats: usize,
) -> Result<String, String> {
    let mut calls = 0;
    for i in 0..repeats {
        let s = c.stats(&[]).await.map_err(|e| format!("stats #{}: {e}", i + 1))?;
        let problems = validate_stats(known, &[], &s);
        if !problems.is_empty() {
            return Err(format!("stats #{}: {}", i + 1, problems.join("; ")));
        }
        calls += 1;
        if let Some(id) = ids.get(i % ids.len().max(1)) {
            match c.reserve(&[id.as_str()]).await {
                Ok(_) | Err(HostError::Plugin(_)) => {}
                Err(e) => return Err(format!("reserve #{}: {e}", i + 1)),
            }
            calls += 1;
        }
        if health {
            c.health_events().await.map_err(|e| format!("health_events #{}: {e}", i + 1))?;
            calls += 1;
        }
    }
    Ok(format!("{calls} calls"))
}

async fn concurrent(
    c: &Caller,
    ids: &[String],
    health: bool,
    threads: usize,
    repeats: usize,
) -> Result<String, String> {
    let per_task = (repeats / threads.max(1)).max(1);
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..threads {
        let (c, ids) = (c.clone(), ids.to_vec());
        tasks.spawn(async move {
            let mut calls = 0usize;
            if n == 0 {
                c.fingerprint().await.map_err(|e| format!("caller {n}: fingerprint: {e}"))?;
                calls += 1;
            }
            for i in 0..per_task {
                c.stats(&[]).await.map_err(|e| format!("caller {n}: stats: {e}"))?;
                calls += 1;
                if let Some(id) = ids.get((n + i) % ids.len().max(1)) {
                    match c.reserve(&[id.as_str()]).await {
                        Ok(_) | Err(HostError::Plugin(_)) => {}
                        Err(e) => return Err(format!("caller {n}: reserve: {e}")),
                    }
                    calls += 1;
                }
                if health {
                    c.health_events().await.map_err(|e| format!("caller {n}: health_events: {e}"))?;
                    calls += 1;
                }
            }
            Ok::<usize, String>(calls)
        });
    }
    let mut total = 0;
    let mut errors = Vec::new();
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(n)) => total += n,
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(format!("a caller task failed: {e}")),
        }
    }
    if errors.is_empty() { Ok(format!("{threads} callers, {total} calls")) } else { Err(summarize(errors)) }
}

/// Distinct messages with their counts, at most 5 of them: "2× a; b; (and 3 more)".
fn summarize(msgs: Vec<String>) -> String {
    const SHOWN: usize = 5;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for m in msgs {
        match counts.iter_mut().find(|(x, _)| *x == m) {
            Some((_, n)) => *n += 1,
            None => counts.push((m, 1)),
        }
    }
    let mut parts: Vec<String> =
        counts.iter().take(SHOWN).map(|(m, n)| if *n > 1 { format!("{n}× {m}") } else { m.clone() }).collect();
    if counts.len() > SHOWN {
        parts.push(format!("(and {} more)", counts.len() - SHOWN));
    }
    parts.join("; ")
}

fn describe_inventory(inv: &pb::Inventory) -> String {
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for d in &inv.devices {
        *kinds.entry(d.kind.as_str()).or_default() += 1;
    }
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
    let mut s = format!("vendor {:?}, {} devices", inv.vendor, inv.devices.len());
    if !kinds.is_empty() {
        s.push_str(&format!(" ({})", kinds.join(", ")));
    }
    if inv.fake {
        s.push_str(", fake");
    }
    if inv.cpu_milli > 0 {
        s.push_str(&format!(", {} cpu_milli, {} MiB", inv.cpu_milli, inv.memory_mib));
    }
    if inv.devices.is_empty() && !inv.message.is_empty() {
        s.push_str(&format!(" ({})", inv.message));
    }
    s
}

fn check_id(what: &str, id: &str, out: &mut Vec<String>) {
    if id.is_empty() {
        out.push(format!("{what} is empty"));
    } else if id.len() > MAX_DEVICE_ID_LEN {
        out.push(format!("{what} {id:?} is longer than {MAX_DEVICE_ID_LEN} bytes"));
    } else if id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        out.push(format!("{what} {id:?} contains whitespace or control characters"));
    }
}

/// What is wrong with an inventory: unique, well-formed ids; kind `gpu` or `npu`; a model; links
/// and partitions that name devices of the same inventory; unique NUMA node ids; topology values
/// (rack, block, NVLink domain) the agent can turn into node labels.
pub fn validate_inventory(inv: &pb::Inventory) -> Vec<String> {
    let mut out = Vec::new();
    if inv.devices.len() > MAX_DEVICES {
        out.push(format!("{} devices, more than the limit of {MAX_DEVICES}", inv.devices.len()));
        return out;
    }
    let mut ids = BTreeSet::new();
    for (i, d) in inv.devices.iter().enumerate() {
        check_id(&format!("devices[{i}].id"), &d.id, &mut out);
        if !d.id.is_empty() && !ids.insert(d.id.as_str()) {
            out.push(format!("devices[{i}].id {:?} is not unique", d.id));
        }
    }
    for d in &inv.devices {
        let at = format!("device {:?}", d.id);
        if d.kind != "gpu" && d.kind != "npu" {
            out.push(format!("{at}: kind {:?} is not gpu or npu", d.kind));
        }
        if d.model.is_empty() {
            out.push(format!("{at}: model is empty"));
        } else if d.model.len() > MAX_MODEL_LEN {
            out.push(format!("{at}: model is longer than {MAX_MODEL_LEN} bytes"));
        }
        for l in &d.links {
            if l.peer == d.id {
                out.push(format!("{at}: links to itself"));
            } else if !ids.contains(l.peer.as_str()) {
                out.push(format!("{at}: link to {:?}, which is not in the inventory", l.peer));
            }
        }
        if !d.partition_of.is_empty() {
            if d.partition_of == d.id {
                out.push(format!("{at}: partition_of names itself"));
            } else if !ids.contains(d.partition_of.as_str()) {
                out.push(format!("{at}: partition_of {:?} is not in the inventory", d.partition_of));
            }
        }
        if d.share_isolation > 1 {
            out.push(format!("{at}: share_isolation is {}; expected 0 (advisory) or 1 (enforced)", d.share_isolation));
        }
    }
    let mut numa = BTreeSet::new();
    for n in &inv.numa_nodes {
        if !numa.insert(n.id) {
            out.push(format!("numa_nodes: id {} is not unique", n.id));
        }
    }
    if let Some(t) = &inv.topology {
        for (field, value) in [("rack", &t.rack), ("block", &t.block), ("nvlink_domain", &t.nvlink_domain)] {
            if value.len() > MAX_TOPOLOGY_VALUE {
                out.push(format!("topology.{field} is longer than {MAX_TOPOLOGY_VALUE} bytes"));
            } else if !value.bytes().all(|b| b.is_ascii_graphic()) {
                out.push(format!(
                    "topology.{field} {value:?} is not printable ASCII without spaces (the agent would drop it)"
                ));
            }
        }
    }
    out
}

/// The longest topology value (rack, block, NVLink domain) an agent takes as a node label.
pub const MAX_TOPOLOGY_VALUE: usize = 253;

/// What is wrong with a reservation for `device`: a GPU or NPU must set at least one environment
/// variable; names must be valid; device files and mounts need absolute paths.
pub fn validate_reservation(device: &pb::PluginDevice, r: &pb::Reservation) -> Vec<String> {
    let mut out = Vec::new();
    if (device.kind == "gpu" || device.kind == "npu") && r.env.is_empty() {
        out.push(format!("reservation of a {} sets no environment variable", device.kind));
    }
    for (k, v) in &r.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            out.push(format!("env name {k:?} is empty or contains '=' or NUL"));
        }
        if v.contains('\0') {
            out.push(format!("env {k} contains NUL"));
        }
    }
    for f in &r.device_files {
        if !f.host_path.starts_with('/') {
            out.push(format!("device file host_path {:?} is not absolute", f.host_path));
        }
        if !f.container_path.is_empty() && !f.container_path.starts_with('/') {
            out.push(format!("device file container_path {:?} is not absolute", f.container_path));
        }
    }
    for m in &r.mounts {
        if !m.host_path.starts_with('/') {
            out.push(format!("mount host_path {:?} is not absolute", m.host_path));
        }
        if !m.container_path.starts_with('/') {
            out.push(format!("mount container_path {:?} is not absolute", m.container_path));
        }
    }
    out
}

fn pct(what: &str, v: f64, out: &mut Vec<String>) {
    if !v.is_finite() || !(0.0..=100.0).contains(&v) {
        out.push(format!("{what} is {v}, not within 0..=100"));
    }
}

/// What is wrong with a stats response: every id known (when the inventory is; and among
/// `requested` when that is not empty), no id twice, percentages within 0..=100, other figures
/// finite and not negative.
pub fn validate_stats(known: Option<&BTreeSet<&str>>, requested: &[String], s: &pb::StatsResponse) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    pct("cpu_utilization_pct", s.cpu_utilization_pct, &mut out);
    for d in &s.devices {
        let at = format!("device {:?}", d.id);
        if known.is_some_and(|k| !k.contains(d.id.as_str())) {
            out.push(format!("{at} is not in the inventory"));
        } else if !requested.is_empty() && !requested.contains(&d.id) {
            out.push(format!("{at} was not requested"));
        }
        if !seen.insert(d.id.as_str()) {
            out.push(format!("{at} is listed twice"));
        }
        pct(&format!("{at}: utilization_pct"), d.utilization_pct, &mut out);
        if !d.power_w.is_finite() || d.power_w < 0.0 {
            out.push(format!("{at}: power_w is {}", d.power_w));
        }
        if !d.temperature_c.is_finite() {
            out.push(format!("{at}: temperature_c is {}", d.temperature_c));
        }
    }
    out
}

/// What is wrong with health events: each names a device of the inventory (when it is known).
pub fn validate_health(known: Option<&BTreeSet<&str>>, ev: &pb::HealthEvents) -> Vec<String> {
    let Some(known) = known else { return Vec::new() };
    ev.events
        .iter()
        .filter(|e| !known.contains(e.device.as_str()))
        .map(|e| format!("event for device {:?}, which is not in the inventory", e.device))
        .collect()
}

/// The first difference in identity (ids, kinds, models, memory, partitions, links) between two
/// inventories; health may change between calls.
fn inventory_diff(a: &pb::Inventory, b: &pb::Inventory) -> Option<String> {
    let (ka, kb) = (inv_keys(a), inv_keys(b));
    for (id, x) in &ka {
        match kb.get(id) {
            None => return Some(format!("device {id:?} is missing")),
            Some(y) if x != y => return Some(format!("device {id:?} changed from {x:?} to {y:?}")),
            _ => {}
        }
    }
    if let Some(id) = kb.keys().find(|id| !ka.contains_key(*id)) {
        return Some(format!("device {id:?} appeared"));
    }
    None
}

#[allow(clippy::type_complexity)]
fn inv_keys(inv: &pb::Inventory) -> BTreeMap<&str, (&str, &str, &str, u64, &str, Vec<&str>)> {
    inv.devices
        .iter()
        .map(|d| {
            let mut links: Vec<&str> = d.links.iter().map(|l| l.peer.as_str()).collect();
            links.sort_unstable();
            (
                d.id.as_str(),
                (d.kind.as_str(), d.vendor.as_str(), d.model.as_str(), d.memory_mib, d.partition_of.as_str(), links),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, kind: &str) -> pb::PluginDevice {
        pb::PluginDevice { id: id.into(), kind: kind.into(), model: "M".into(), healthy: true, ..Default::default() }
    }

    #[test]
    fn inventory_rules() {
        let mut inv =
            pb::Inventory { vendor: "x".into(), devices: vec![dev("a", "gpu"), dev("b", "npu")], ..Default::default() };
        assert!(validate_inventory(&inv).is_empty());
        inv.devices[1].links.push(pb::PeerLink { peer: "a".into(), kind: "nvlink".into(), bandwidth_mbps: 1 });
        assert!(validate_inventory(&inv).is_empty());
        inv.devices.push(dev("a", "tpu"));
        inv.devices[0].links.push(pb::PeerLink { peer: "zz".into(), ..Default::default() });
        inv.devices[1].partition_of = "nope".into();
        inv.devices.push(dev("", "gpu"));
        inv.devices[0].share_isolation = 2;
        inv.topology = Some(pb::NodeTopology { rack: "rack 1".into(), block: "b".repeat(254), ..Default::default() });
        let p = validate_inventory(&inv).join("\n");
        for want in [
            "not unique",
            "\"tpu\" is not gpu or npu",
            "\"zz\", which is not",
            "partition_of \"nope\"",
            "id is empty",
            "share_isolation is 2; expected 0 (advisory) or 1 (enforced)",
            "topology.rack \"rack 1\" is not printable ASCII",
            "topology.block is longer than 253 bytes",
        ] {
            assert!(p.contains(want), "{want} missing in:\n{p}");
        }
    }

    #[test]
    fn reservation_and_stats_rules() {
        let d = dev("a", "gpu");
        let mut r = pb::Reservation::default();
        assert_eq!(validate_reservation(&d, &r).len(), 1);
        r.env.insert("CUDA_VISIBLE_DEVICES".into(), "0".into());
        r.mounts.push(pb::Mount { host_path: "rel".into(), container_path: "/x".into(), read_only: true });
        assert_eq!(validate_reservation(&d, &r), vec!["mount host_path \"rel\" is not absolute".to_string()]);

        let known: BTreeSet<&str> = ["a", "b"].into_iter().collect();
        let s = pb::StatsResponse {
            devices: vec![
                pb::DeviceStats { id: "a".into(), utilization_pct: 101.0, ..Default::default() },
                pb::DeviceStats { id: "c".into(), ..Default::default() },
                pb::DeviceStats { id: "a".into(), utilization_pct: f64::NAN, ..Default::default() },
            ],
            cpu_utilization_pct: 0.0,
        };
        let p = validate_stats(Some(&known), &[], &s).join("\n");
        assert!(p.contains("utilization_pct is 101"), "{p}");
        assert!(p.contains("\"c\" is not in the inventory"), "{p}");
        assert!(p.contains("listed twice"), "{p}");
        assert!(p.contains("NaN"), "{p}");
        let only_b = validate_stats(
            Some(&known),
            &["b".to_string()],
            &pb::StatsResponse { devices: vec![s.devices[0].clone()], ..Default::default() },
        );
        assert!(only_b.iter().any(|m| m.contains("not requested")), "{only_b:?}");
    }

    #[test]
    fn stable_inventory_ignores_health() {
        let a = pb::Inventory { devices: vec![dev("a", "gpu")], ..Default::default() };
        let mut b = a.clone();
        b.devices[0].healthy = false;
        assert_eq!(inventory_diff(&a, &b), None);
        b.devices[0].model = "N".into();
        assert!(inventory_diff(&a, &b).is_some_and(|d| d.contains("changed")));
        b.devices.clear();
        assert!(inventory_diff(&a, &b).is_some_and(|d| d.contains("missing")));
    }
}
