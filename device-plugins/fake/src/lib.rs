//! suanli's fake device plugin: GPUs and NPUs described in a config file, for development, demos,
//! the simulator's twin and CI. It always says it is fake (`Inventory.fake = true`, vendor `fake`).
//!
//! ```text
//!  init ──▶ read + validate the config (PluginConfig.config_path) ──▶ [FakeDevice]
//!  every call ──▶ stat the fault file; re-read it when it changed ──▶ Faults
//!             ──▶ misbehave if the fault file says so (test/demo faults: panic, hang, segfault, abort)
//!  fingerprint ─▶ devices, health from the faults, the config's [topology] (rack, block, NVLink domain)
//!  health_events ─▶ new XIDs (with their class, ABI 1.3), health transitions since the previous call
//!  reset ─▶ clears the device's recoverable XIDs (unless the fault file says its reset fails)
//!  stats ─▶ fixed values from the faults, else a deterministic sine of wall time
//!  reserve ─▶ CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES (indexes) + SUANLI_FAKE_DEVICES
//! ```
//!
//! The fault file is `fault_file` from the config, overridden by the plugin option `fault_file`;
//! by default it is `<config stem>.faults.toml` next to the config. See [`faults`] for its format.
//! A fault file that does not parse keeps the previous faults in force and the error is shown in
//! the inventory's message.
//!
//! Never use this plugin for real work: its devices do not exist.

pub mod config;
pub mod faults;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use suanli_device_abi::{Code, DevicePlugin, EventClass, PluginError, pb};

use config::{FakeDevice, Kind, MAX_FILE_BYTES};
use faults::{Call, Crash, Faults};

/// The fake plugin instance.
pub struct FakePlugin {
    config_path: PathBuf,
    devices: Vec<FakeDevice>,
    /// Device id → position in `devices`.
    by_id: BTreeMap<String, usize>,
    /// The config's `[topology]`, reported in every inventory.
    topology: Option<pb::NodeTopology>,
    fault_path: PathBuf,
    state: Mutex<State>,
    /// Plugin option `enforce_shares=true`: every device says its shares are enforced
    /// (`share_isolation` 1), reserve refuses a share that would take a device's reservations
    /// past 1000 milli and gives a GPU share the MPS limit variables the NVIDIA plugin sets (what
    /// MPS limits or a vNPU would enforce on real hardware).
    enforce_shares: bool,
    /// Plugin option `journal=PATH`: every reserve with a reservation id and every release is
    /// appended there as a JSON line (tests read it).
    journal: Option<PathBuf>,
}

/// What changes at run time.
struct State {
    /// (mtime, size, inode) of the fault file when last read; `None` when it did not exist.
    stamp: Option<(SystemTime, u64, u64)>,
    /// Whether the fault file has been looked at yet.
    loaded: bool,
    faults: Faults,
    /// The last fault file error (cleared by a good read).
    fault_error: Option<String>,
    /// Health as last reported by health_events (all healthy at start).
    reported: BTreeMap<String, bool>,
    /// XIDs already emitted (forgotten when removed from the file, so re-adding one re-emits it).
    xid_emitted: BTreeSet<faults::Xid>,
    /// XIDs a reset cleared (forgotten when removed from the file).
    cleared: BTreeSet<faults::Xid>,
    /// Reservations held (ABI 1.2): reservation id → (device, milli) per device.
    held: BTreeMap<String, Vec<(String, u32)>>,
}

/// The most reservations the fake plugin holds at once (a node runs far fewer tasks).
pub const MAX_HELD: usize = 4096;

/// Reads a small file, refusing one over [`MAX_FILE_BYTES`].
fn read_small(path: &Path) -> Result<String, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut buf = String::new();
    f.take(MAX_FILE_BYTES + 1).read_to_string(&mut buf).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("{} is larger than the limit of {MAX_FILE_BYTES} bytes", path.display()));
    }
    Ok(buf)
}

/// The default fault file of a config: `dir/fake-8gpu.toml` → `dir/fake-8gpu.faults.toml`.
pub fn default_fault_path(config: &Path) -> PathBuf {
    let stem = config.file_stem().map_or_else(|| "fake".into(), |s| s.to_string_lossy().into_owned());
    config.with_file_name(format!("{stem}.faults.toml"))
}

/// Seconds since the Unix epoch, as the curve's clock.
fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Misbehaves on purpose (test/demo faults, requested by the fault file).
fn misbehave(crash: Crash, call: Call) -> ! {
    eprintln!("suanli fake plugin: injected fault: {crash:?} in {}", call.as_str());
    match crash {
        Crash::Panic => panic!("injected fault: panic in {} (fake plugin fault file)", call.as_str()),
        Crash::Hang => loop {
            // Deliberately never returns: the host's call deadline must end this process.
            std::thread::sleep(Duration::from_secs(3600));
        },
        Crash::Segfault => segfault(),
        Crash::Abort => std::process::abort(),
    }
}

/// Writes near address zero (unmapped on every Linux): the process dies of SIGSEGV.
#[allow(unsafe_code)]
fn segfault() -> ! {
    let p = std::ptr::without_provenance_mut::<u8>(16);
    // SAFETY: none; this is the requested fault. The page at address 0 is never mapped
    // (vm.mmap_min_addr), so the write raises SIGSEGV and the process dies. Address 16 rather
    // than 0 keeps Rust's debug null-pointer check (which would abort instead) out of the way.
    unsafe { std::ptr::write_volatile(p, 1) };
    // SAFETY: raise is async-signal-safe and takes no pointers; reached only if the write above
    // somehow did not fault.
    unsafe { libc::raise(libc::SIGSEGV) };
    std::process::abort()
}

impl FakePlugin {
    /// Loads a config file; `fault_override` replaces its `fault_file`.
    pub fn load(config_path: &Path, fault_override: Option<&str>) -> Result<Self, PluginError> {
        if config_path.as_os_str().is_empty() {
            return Err(PluginError::invalid(
                "config_path is empty: the fake plugin needs a device file (e.g. examples/plugins/fake-8gpu.toml)",
            ));
        }
        let text = read_small(config_path).map_err(PluginError::invalid)?;
        let cfg = config::parse_config(&text)
            .map_err(|e| PluginError::invalid(format!("fake config {}: {e}", config_path.display())))?;
        let dir = config_path.parent().unwrap_or(Path::new("."));
        let fault_path = match fault_override.map(str::to_string).or(cfg.fault_file) {
            Some(f) if Path::new(&f).is_absolute() => PathBuf::from(f),
            Some(f) => dir.join(f),
            None => default_fault_path(config_path),
        };
        let by_id = cfg.devices.iter().enumerate().map(|(i, d)| (d.id.clone(), i)).collect();
        let reported = cfg.devices.iter().map(|d| (d.id.clone(), true)).collect();
        Ok(FakePlugin {
            config_path: config_path.to_path_buf(),
            devices: cfg.devices,
            by_id,
            topology: cfg.topology,
            fault_path,
            state: Mutex::new(State {
                stamp: None,
                loaded: false,
                faults: Faults::default(),
                fault_error: None,
                reported,
                xid_emitted: BTreeSet::new(),
                cleared: BTreeSet::new(),
                held: BTreeMap::new(),
            }),
            enforce_shares: false,
            journal: None,
        })
    }

    /// The fault file this instance watches.
    pub fn fault_path(&self) -> &Path {
        &self.fault_path
    }

    /// The devices of the config.
    pub fn devices(&self) -> &[FakeDevice] {
        &self.devices
    }

    /// The config's `[topology]` (rack, block, NVLink domain), if it has one.
    pub fn topology(&self) -> Option<&pb::NodeTopology> {
        self.topology.as_ref()
    }

    /// Locks the state after re-reading the fault file if it changed.
    fn refreshed(&self) -> Result<MutexGuard<'_, State>, PluginError> {
        let mut st = self.state.lock().map_err(|_| PluginError::internal("fake plugin state lock poisoned"))?;
        let stamp =
            std::fs::metadata(&self.fault_path).ok().map(|m| (m.modified().unwrap_or(UNIX_EPOCH), m.len(), m.ino()));
        if st.loaded && stamp == st.stamp {
            return Ok(st);
        }
        st.loaded = true;
        st.stamp = stamp;
        let known: BTreeSet<String> = self.by_id.keys().cloned().collect();
        let parsed = match stamp {
            None => Ok(Faults::default()),
            Some(_) => read_small(&self.fault_path).and_then(|t| faults::parse_faults(&t, &known)),
        };
        match parsed {
            Ok(f) => {
                st.faults = f;
                st.fault_error = None;
            }
            Err(e) => {
                let msg = format!("fault file {}: {e} (previous faults stay in force)", self.fault_path.display());
                eprintln!("suanli fake plugin: {msg}");
                st.fault_error = Some(msg);
            }
        }
        Ok(st)
    }

    /// Refreshes the faults and misbehaves if they ask for it on `call`.
    fn enter(&self, call: Call) -> Result<MutexGuard<'_, State>, PluginError> {
        let st = self.refreshed()?;
        if let Some(crash) = st.faults.crash_for(call) {
            if st.faults.crash_once {
                let marker = PathBuf::from(format!("{}.crashed", self.fault_path.display()));
                if marker.exists() {
                    return Ok(st);
                }
                std::fs::write(&marker, format!("crashed once in {}\n", call.as_str()))
                    .map_err(|e| PluginError::internal(format!("cannot write {}: {e}", marker.display())))?;
            }
            drop(st);
            misbehave(crash, call);
        }
        Ok(st)
    }

    fn device(&self, id: &str) -> Result<&FakeDevice, PluginError> {
        self.by_id
            .get(id)
            .map(|&i| &self.devices[i])
            .ok_or_else(|| PluginError::not_found(format!("device {id:?} is not in {}", self.config_path.display())))
    }

    fn inventory(&self, st: &State) -> pb::Inventory {
        let mut message = format!("fake devices from {}", self.config_path.display());
        if let Some(e) = &st.fault_error {
            message.push_str("; ");
            message.push_str(e);
        }
        let devices = self
            .devices
            .iter()
            .map(|d| {
                let reason = st.faults.health_reason(&d.id, &st.cleared);
                pb::PluginDevice {
                    id: d.id.clone(),
                    kind: d.kind.as_str().into(),
                    vendor: d.vendor.clone(),
                    model: d.model.clone(),
                    memory_mib: d.memory_mib,
                    healthy: reason.is_none(),
                    health_reason: reason.unwrap_or_default(),
                    numa_node: d.numa,
                    links: d.links.clone(),
                    partition_of: d.partition_of.clone().unwrap_or_default(),
                    uuid: d.uuid.clone(),
                    index: d.index,
                    peer_group: d.peer_group,
                    share_isolation: u32::from(self.enforce_shares),
                }
            })
            .collect();
        pb::Inventory {
            vendor: "fake".into(),
            fake: true,
            message,
            devices,
            driver_version: format!("fake-{}", env!("CARGO_PKG_VERSION")),
            topology: self.topology.clone(),
            ..Default::default()
        }
    }

    /// Health events since the previous call: each newly listed XID once, then every device whose
    /// health differs from what was last reported.
    fn take_events(&self, st: &mut State) -> pb::HealthEvents {
        let mut events = Vec::new();
        let current: BTreeSet<faults::Xid> = st.faults.xid.clone();
        for x in current.difference(&st.xid_emitted) {
            let class = x.class();
            let what = if class == EventClass::Unspecified { String::new() } else { format!(", {}", class.as_str()) };
            events.push(pb::HealthEvent {
                device: x.device.clone(),
                // An application error leaves the device healthy (ABI 1.3).
                healthy: class == EventClass::Application,
                reason: format!("injected XID {}{what} (fake fault)", x.code),
                code: x.code,
                event_class: class.raw(),
            });
            if class != EventClass::Application {
                st.reported.insert(x.device.clone(), false);
            }
        }
        st.cleared.retain(|x| current.contains(x));
        st.xid_emitted = current;
        for d in &self.devices {
            let reason = st.faults.health_reason(&d.id, &st.cleared);
            let healthy = reason.is_none();
            if st.reported.get(&d.id) != Some(&healthy) {
                st.reported.insert(d.id.clone(), healthy);
                events.push(pb::HealthEvent {
                    device: d.id.clone(),
                    healthy,
                    reason: reason.unwrap_or_else(|| "fault cleared (fake fault)".into()),
                    code: 0,
                    event_class: 0,
                });
            }
        }
        pb::HealthEvents { events }
    }

    fn device_stats(&self, st: &State, d: &FakeDevice, ordinal: usize, t_s: f64) -> pb::DeviceStats {
        let util = st.faults.utilization.get(&d.id).copied().unwrap_or_else(|| st.faults.curve.at(t_s, ordinal));
        let mem = st
            .faults
            .memory_used_mib
            .get(&d.id)
            .copied()
            .unwrap_or_else(|| (d.memory_mib as f64 * util / 100.0) as u64)
            .min(d.memory_mib);
        pb::DeviceStats {
            id: d.id.clone(),
            utilization_pct: util,
            memory_used_mib: mem,
            power_w: 50.0 + 3.5 * util,
            temperature_c: 30.0 + 0.5 * util,
            ecc_errors: 0,
            xid_errors: st.faults.xid.iter().filter(|x| x.device == d.id).count() as u64,
        }
    }

    /// Stats at an explicit time (the curve's clock), for tests.
    pub fn stats_at(&self, req: &pb::StatsRequest, t_s: f64) -> Result<pb::StatsResponse, PluginError> {
        let st = self.enter(Call::Stats)?;
        self.stats_locked(&st, req, t_s)
    }

    fn stats_locked(&self, st: &State, req: &pb::StatsRequest, t_s: f64) -> Result<pb::StatsResponse, PluginError> {
        let mut out = Vec::new();
        if req.device_ids.is_empty() {
            for (i, d) in self.devices.iter().enumerate() {
                out.push(self.device_stats(st, d, i, t_s));
            }
        } else {
            for id in &req.device_ids {
                self.device(id)?;
                let i = self.by_id[id];
                out.push(self.device_stats(st, &self.devices[i], i, t_s));
            }
        }
        Ok(pb::StatsResponse { devices: out, cpu_utilization_pct: 0.0 })
    }
}

/// The most device ids one reserve may name.
pub const MAX_RESERVE_IDS: usize = config::MAX_DEVICES;

impl DevicePlugin for FakePlugin {
    const NAME: &'static str = "fake";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: pb::PluginConfig) -> Result<Self, PluginError> {
        let mut p =
            FakePlugin::load(Path::new(&config.config_path), config.options.get("fault_file").map(String::as_str))?;
        p.enforce_shares = match config.options.get("enforce_shares").map(String::as_str) {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(PluginError::invalid(format!(
                    "option enforce_shares is {other:?}; expected true or false"
                )));
            }
        };
        p.journal = config.options.get("journal").filter(|j| !j.is_empty()).map(PathBuf::from);
        drop(p.enter(Call::Init)?);
        Ok(p)
    }

    fn fingerprint(&self) -> Result<pb::Inventory, PluginError> {
        let st = self.enter(Call::Fingerprint)?;
        Ok(self.inventory(&st))
    }

    fn reserve(&self, req: pb::ReserveRequest) -> Result<pb::Reservation, PluginError> {
        let mut st = self.enter(Call::Reserve)?;
        if req.device_ids.len() > MAX_RESERVE_IDS {
            return Err(PluginError::invalid(format!(
                "device_ids has {} entries, the limit is {MAX_RESERVE_IDS}",
                req.device_ids.len()
            )));
        }
        let mut seen = BTreeSet::new();
        let mut gpus = Vec::new();
        let mut npus = Vec::new();
        let mut migs = Vec::new();
        for id in &req.device_ids {
            let d = self.device(id)?;
            if !seen.insert(id.as_str()) {
                return Err(PluginError::invalid(format!("device_ids names {id:?} twice")));
            }
            if let Some(reason) = st.faults.health_reason(id, &st.cleared) {
                return Err(PluginError::new(
                    Code::FailedPrecondition,
                    format!("device {id:?} is unhealthy: {reason}"),
                ));
            }
            match (d.kind, &d.partition_of) {
                // A partition is named by its UUID, as CUDA names MIG devices.
                (Kind::Gpu, Some(_)) => gpus.push(d.uuid.clone()),
                (Kind::Gpu, None) => gpus.push(d.index.to_string()),
                (Kind::Npu, _) => npus.push(d.index.to_string()),
            }
            if d.partition_of.is_some() {
                migs.push(d.id.clone());
            }
        }
        if !req.reservation_id.is_empty() {
            self.hold(&mut st, &req)?;
        }
        let mut res = pb::Reservation::default();
        // A stand-in for the NVIDIA plugin's /dev/nvidia-caps files: names only, no such files.
        for id in migs {
            let p = format!("/dev/fake-mig/{id}");
            res.device_files.push(pb::DeviceFile { host_path: p.clone(), container_path: p, permissions: "rw".into() });
        }
        if !gpus.is_empty() {
            res.env.insert("CUDA_VISIBLE_DEVICES".into(), gpus.join(","));
        }
        if !npus.is_empty() {
            res.env.insert("ASCEND_RT_VISIBLE_DEVICES".into(), npus.join(","));
        }
        if !req.device_ids.is_empty() {
            res.env.insert("SUANLI_FAKE_DEVICES".into(), req.device_ids.join(","));
        }
        // With enforce_shares, a GPU share gets the limits the NVIDIA plugin's MPS daemon would
        // enforce (nothing here enforces them: there is no GPU).
        if self.enforce_shares {
            let gpu_share = req.shares.iter().find(|s| {
                s.milli > 0 && s.milli < 1000 && self.device(&s.device_id).is_ok_and(|d| d.kind == Kind::Gpu)
            });
            if let Some(s) = gpu_share {
                res.env
                    .insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), s.milli.div_ceil(10).clamp(1, 100).to_string());
                if s.memory_mib > 0 {
                    res.env.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("0={}M", s.memory_mib));
                }
            }
        }
        Ok(res)
    }

    fn stats(&self, req: pb::StatsRequest) -> Result<pb::StatsResponse, PluginError> {
        let st = self.enter(Call::Stats)?;
        self.stats_locked(&st, &req, now_s())
    }

    fn health_events(&self) -> Result<pb::HealthEvents, PluginError> {
        let mut st = self.enter(Call::HealthEvents)?;
        Ok(self.take_events(&mut st))
    }

    fn release(&self, req: pb::ReleaseRequest) -> Result<(), PluginError> {
        let mut st = self.enter(Call::Release)?;
        let held = st.held.remove(&req.reservation_id);
        self.log(&serde_json::json!({
            "call": "release", "reservation_id": req.reservation_id, "alloc_id": req.alloc_id,
            "device_ids": req.device_ids, "held": held.is_some(),
        }));
        Ok(())
    }

    fn reset(&self, req: pb::ResetRequest) -> Result<(), PluginError> {
        let mut st = self.enter(Call::Reset)?;
        self.device(&req.device_id)?;
        let fails = st.faults.reset_fails.contains(&req.device_id);
        let cleared: Vec<faults::Xid> = if fails {
            Vec::new()
        } else {
            st.faults
                .xid
                .iter()
                .filter(|x| x.device == req.device_id && x.class() != EventClass::Fatal)
                .cloned()
                .collect()
        };
        let codes: Vec<u64> = cleared.iter().map(|x| x.code).collect();
        st.cleared.extend(cleared);
        self.log(&serde_json::json!({
            "call": "reset", "device_id": req.device_id, "ok": !fails, "cleared_xids": codes,
        }));
        if fails {
            return Err(PluginError::new(
                Code::FailedPrecondition,
                format!("device {:?} did not come back from its reset (fault file: reset_fails)", req.device_id),
            ));
        }
        Ok(())
    }
}

impl FakePlugin {
    /// Records a 1.2 reservation: a repeat of a held id holds nothing more; with `enforce_shares`,
    /// a share that would take a device past 1000 milli is refused.
    fn hold(&self, st: &mut State, req: &pb::ReserveRequest) -> Result<(), PluginError> {
        let shares: Vec<(String, u32)> = req
            .device_ids
            .iter()
            .map(|id| {
                let milli = req.shares.iter().find(|s| &s.device_id == id).map_or(1000, |s| s.milli);
                (id.clone(), if milli == 0 { 1000 } else { milli.min(1000) })
            })
            .collect();
        let repeat = st.held.contains_key(&req.reservation_id);
        if !repeat {
            if self.enforce_shares {
                for (dev, milli) in &shares {
                    let used: u32 = st.held.values().flatten().filter(|(d, _)| d == dev).map(|(_, m)| *m).sum();
                    if used + milli > 1000 {
                        return Err(PluginError::new(
                            Code::FailedPrecondition,
                            format!(
                                "device {dev:?}: {used} milli already held by other reservations, {milli} asked by {:?}; 1000 is the whole device",
                                req.reservation_id
                            ),
                        ));
                    }
                }
            }
            if st.held.len() >= MAX_HELD {
                return Err(PluginError::new(
                    Code::FailedPrecondition,
                    format!("{MAX_HELD} reservations held, the limit; release some first"),
                ));
            }
            st.held.insert(req.reservation_id.clone(), shares.clone());
        }
        self.log(&serde_json::json!({
            "call": "reserve", "reservation_id": req.reservation_id, "alloc_id": req.alloc_id, "repeat": repeat,
            "shares": shares.iter().map(|(d, m)| serde_json::json!({"device": d, "milli": m})).collect::<Vec<_>>(),
        }));
        Ok(())
    }

    /// Appends a line to the journal, when one is configured (best effort).
    fn log(&self, v: &serde_json::Value) {
        let Some(path) = &self.journal else { return };
        use std::io::Write as _;
        let res = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(format!("{v}\n").as_bytes()));
        if let Err(e) = res {
            eprintln!("suanli fake plugin: journal {}: {e}", path.display());
        }
    }
}

suanli_device_abi::export_plugin!(FakePlugin);

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_fake_tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    struct Dir(PathBuf);

    impl Dir {
        fn new() -> Self {
            static N: AtomicU32 = AtomicU32::new(0);
            let d = std::env::temp_dir().join(format!(
                "suanli-fake-test-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn example(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/plugins").join(name)
    }

    /// A copy of an example config in a fresh directory (so fault files stay out of the repo).
    fn setup(name: &str) -> (Dir, FakePlugin) {
        let dir = Dir::new();
        let cfg = dir.0.join(name);
        std::fs::copy(example(name), &cfg).unwrap();
        let p = FakePlugin::init(pb::PluginConfig { config_path: cfg.display().to_string(), ..Default::default() })
            .unwrap();
        (dir, p)
    }

    #[test]
    fn shares_are_enforced_repeats_hold_nothing_and_release_frees() {
        let dir = Dir::new();
        let cfg = dir.0.join("fake-8gpu.toml");
        std::fs::copy(example("fake-8gpu.toml"), &cfg).unwrap();
        let journal = dir.0.join("calls.jsonl");
        let mut pc = pb::PluginConfig { config_path: cfg.display().to_string(), ..Default::default() };
        pc.options.insert("enforce_shares".into(), "true".into());
        pc.options.insert("journal".into(), journal.display().to_string());
        let p = FakePlugin::init(pc.clone()).unwrap();
        let req = |id: &str, milli: u32| pb::ReserveRequest {
            device_ids: vec!["gpu0".into()],
            alloc_id: 1,
            reservation_id: id.into(),
            shares: vec![pb::ReserveShare { device_id: "gpu0".into(), milli, memory_mib: 0 }],
        };
        assert!(p.fingerprint().unwrap().devices.iter().all(|d| d.share_isolation == 1));
        let r = p.reserve(req("r1", 600)).unwrap();
        assert_eq!(r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "60");
        let e = p.reserve(req("r2", 500)).unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition);
        assert!(e.message.contains("600 milli already held") && e.message.contains("500 asked"), "{}", e.message);
        p.reserve(req("r1", 600)).unwrap(); // a repeat holds nothing more
        p.reserve(req("r3", 400)).unwrap();
        p.release(pb::ReleaseRequest { reservation_id: "r1".into(), ..Default::default() }).unwrap();
        p.release(pb::ReleaseRequest { reservation_id: "r1".into(), ..Default::default() }).unwrap();
        p.reserve(req("r2", 500)).unwrap();
        // No reservation id (a 1.1 agent): nothing held, nothing refused.
        p.reserve(pb::ReserveRequest { device_ids: vec!["gpu0".into()], ..Default::default() }).unwrap();
        let lines = std::fs::read_to_string(&journal).unwrap();
        assert_eq!(lines.lines().count(), 6, "{lines}");
        assert!(lines.lines().nth(1).unwrap().contains("\"repeat\":true"), "{lines}");

        pc.options.insert("enforce_shares".into(), "false".into());
        let p = FakePlugin::init(pc.clone()).unwrap();
        assert!(p.fingerprint().unwrap().devices.iter().all(|d| d.share_isolation == 0));
        assert!(!p.reserve(req("r9", 600)).unwrap().env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
        pc.options.insert("enforce_shares".into(), "maybe".into());
        let e = FakePlugin::init(pc).err().unwrap();
        assert!(e.message.contains("enforce_shares") && e.message.contains("true or false"), "{}", e.message);
    }

    /// Writes the fault file; a fresh file (new inode) so a same-size rewrite is still noticed.
    fn faults(p: &FakePlugin, text: &str) {
        let tmp = p.fault_path().with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, p.fault_path()).unwrap();
    }

    #[test]
    fn eight_gpu_example() {
        let (_d, p) = setup("fake-8gpu.toml");
        assert_eq!(p.fault_path().file_name().unwrap(), "fake-8gpu.faults.toml");
        let inv = p.fingerprint().unwrap();
        assert!(inv.fake);
        assert_eq!(inv.vendor, "fake");
        assert!(inv.message.starts_with("fake devices from "), "{}", inv.message);
        assert_eq!(inv.devices.len(), 8);
        assert!(
            inv.devices.iter().all(|d| d.model == "A100-80G" && d.memory_mib == 81920 && d.kind == "gpu" && d.healthy)
        );
        let islands: BTreeSet<_> = inv.devices.iter().map(|d| d.peer_group).collect();
        assert_eq!(islands, [Some(0), Some(1)].into());
        assert!(inv.devices.iter().all(|d| d.links.len() == 3 && d.links.iter().all(|l| l.kind == "nvlink")));
    }

    #[test]
    fn four_npu_example() {
        let (_d, p) = setup("fake-4npu.toml");
        let inv = p.fingerprint().unwrap();
        assert_eq!(inv.devices.len(), 4);
        assert!(inv.devices.iter().all(|d| d.model == "Ascend910B" && d.memory_mib == 65536 && d.kind == "npu"));
        assert!(inv.devices.iter().all(|d| d.links.len() == 3 && d.links.iter().all(|l| l.kind == "hccs")));
        let r = p
            .reserve(pb::ReserveRequest {
                device_ids: vec!["npu2".into(), "npu0".into()],
                alloc_id: 7,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.env["ASCEND_RT_VISIBLE_DEVICES"], "2,0");
        assert_eq!(r.env["SUANLI_FAKE_DEVICES"], "npu2,npu0");
        assert!(!r.env.contains_key("CUDA_VISIBLE_DEVICES"));
    }

    #[test]
    fn mig_slices_reserve_by_uuid_with_their_device_files() {
        let (_d, p) = setup("fake-mig.toml");
        let inv = p.fingerprint().unwrap();
        let m = inv.devices.iter().find(|d| d.id == "gpu0-mig3").unwrap();
        assert_eq!((m.partition_of.as_str(), m.memory_mib), ("gpu0", 10240));
        assert!(inv.devices.iter().filter(|d| d.partition_of.is_empty()).count() == 2);
        let r = p
            .reserve(pb::ReserveRequest {
                device_ids: vec!["gpu0-mig3".into(), "gpu1".into()],
                alloc_id: 1,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.env["CUDA_VISIBLE_DEVICES"], "MIG-FAKE-gpu0-mig3,1");
        let files: Vec<_> = r.device_files.iter().map(|f| f.host_path.as_str()).collect();
        assert_eq!(files, ["/dev/fake-mig/gpu0-mig3"]);
    }

    #[test]
    fn reserve_checks_ids_and_health() {
        let (_d, p) = setup("fake-8gpu.toml");
        let r = p
            .reserve(pb::ReserveRequest {
                device_ids: vec!["gpu1".into(), "gpu5".into()],
                alloc_id: 1,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.env["CUDA_VISIBLE_DEVICES"], "1,5");
        assert!(r.device_files.is_empty());
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["gpu9".into()], alloc_id: 1, ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code, Code::NotFound);
        let e = p
            .reserve(pb::ReserveRequest {
                device_ids: vec!["gpu1".into(), "gpu1".into()],
                alloc_id: 1,
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        faults(&p, "unhealthy = [\"gpu5\"]\n");
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["gpu5".into()], alloc_id: 1, ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition);
        assert!(e.message.contains("unhealthy"), "{}", e.message);
        assert_eq!(p.reserve(pb::ReserveRequest::default()).unwrap(), pb::Reservation::default());
    }

    #[test]
    fn faults_at_run_time_give_health_and_events() {
        let (_d, p) = setup("fake-8gpu.toml");
        assert!(p.health_events().unwrap().events.is_empty());

        faults(&p, "unhealthy = [\"gpu3\"]\nxid = [{ device = \"gpu1\", code = 79 }]\n");
        let inv = p.fingerprint().unwrap();
        let bad: Vec<_> =
            inv.devices.iter().filter(|d| !d.healthy).map(|d| (d.id.as_str(), d.health_reason.as_str())).collect();
        assert_eq!(bad, [("gpu1", "injected XID 79 (fake fault)"), ("gpu3", "injected unhealthy (fake fault)")]);
        let ev = p.health_events().unwrap().events;
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert_eq!((ev[0].device.as_str(), ev[0].healthy, ev[0].code), ("gpu1", false, 79));
        assert_eq!((ev[1].device.as_str(), ev[1].healthy, ev[1].code), ("gpu3", false, 0));
        // Emitted once.
        assert!(p.health_events().unwrap().events.is_empty());
        let s = p.stats(pb::StatsRequest { device_ids: vec!["gpu1".into()] }).unwrap();
        assert_eq!(s.devices[0].xid_errors, 1);

        // Clearing the file brings both back, with one event each.
        faults(&p, "");
        let ev = p.health_events().unwrap().events;
        let back: Vec<_> = ev.iter().map(|e| (e.device.as_str(), e.healthy)).collect();
        assert_eq!(back, [("gpu1", true), ("gpu3", true)]);
        assert!(p.fingerprint().unwrap().devices.iter().all(|d| d.healthy));

        // Re-adding an XID emits it again.
        faults(&p, "xid = [{ device = \"gpu1\", code = 79 }]\n");
        assert_eq!(p.health_events().unwrap().events.len(), 1);
    }

    #[test]
    fn a_broken_fault_file_keeps_the_previous_faults() {
        let (_d, p) = setup("fake-8gpu.toml");
        faults(&p, "unhealthy = [\"gpu2\"]\n");
        assert!(!p.fingerprint().unwrap().devices[2].healthy);
        faults(&p, "unhealthy = [\"gpu42\"]\n");
        let inv = p.fingerprint().unwrap();
        assert!(!inv.devices[2].healthy);
        assert!(inv.message.contains("unhealthy names \"gpu42\""), "{}", inv.message);
        assert!(inv.message.contains("previous faults stay in force"), "{}", inv.message);
    }

    #[test]
    fn stats_follow_the_curve_or_the_overrides() {
        let (_d, p) = setup("fake-8gpu.toml");
        let a = p.stats_at(&pb::StatsRequest::default(), 1000.0).unwrap();
        let b = p.stats_at(&pb::StatsRequest::default(), 1000.0).unwrap();
        assert_eq!(a, b, "deterministic for a given time");
        assert_eq!(a.devices.len(), 8);
        for s in &a.devices {
            assert!((5.0..=95.0).contains(&s.utilization_pct));
            assert!(s.memory_used_mib <= 81920);
        }
        faults(&p, "utilization = { gpu0 = 90.0 }\nmemory_used_mib = { gpu0 = 1234 }\n");
        let s = p.stats_at(&pb::StatsRequest { device_ids: vec!["gpu0".into()] }, 5.0).unwrap();
        assert_eq!(s.devices.len(), 1);
        assert_eq!((s.devices[0].utilization_pct, s.devices[0].memory_used_mib), (90.0, 1234));
        assert_eq!(p.stats(pb::StatsRequest { device_ids: vec!["nope".into()] }).unwrap_err().code, Code::NotFound);
    }

    #[test]
    fn injected_panic_and_crash_once() {
        let (_d, p) = setup("fake-8gpu.toml");
        faults(&p, "crash = \"panic\"\ncrash_on = \"stats\"\n");
        // Other calls are unaffected.
        p.fingerprint().unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.stats(pb::StatsRequest::default())));
        let msg = r.unwrap_err().downcast::<String>().unwrap();
        assert!(msg.contains("injected fault: panic in stats"), "{msg}");

        faults(&p, "crash = \"panic\"\ncrash_on = \"reserve\"\ncrash_once = true\n");
        let marker = PathBuf::from(format!("{}.crashed", p.fault_path().display()));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.reserve(pb::ReserveRequest::default())));
        assert!(r.is_err());
        assert!(marker.exists());
        // The marker disarms it.
        p.reserve(pb::ReserveRequest::default()).unwrap();
    }

    #[test]
    fn init_errors_name_the_file_and_field() {
        let d = Dir::new();
        let e = FakePlugin::init(pb::PluginConfig::default()).err().unwrap();
        assert!(e.message.contains("config_path is empty"), "{}", e.message);
        let missing = d.0.join("none.toml");
        let e = FakePlugin::init(pb::PluginConfig { config_path: missing.display().to_string(), ..Default::default() })
            .err()
            .unwrap();
        assert!(e.message.contains("cannot open") && e.message.contains("none.toml"), "{}", e.message);
        let bad = d.0.join("bad.toml");
        std::fs::write(&bad, "[[groups]]\ncount = 1000\nkind = \"gpu\"\nmodel = \"m\"\nmemory_mib = 1\n").unwrap();
        let e = FakePlugin::init(pb::PluginConfig { config_path: bad.display().to_string(), ..Default::default() })
            .err()
            .unwrap();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("bad.toml") && e.message.contains("groups[0].count is 1000"), "{}", e.message);
    }

    #[test]
    fn the_topology_table_is_in_the_inventory() {
        let d = Dir::new();
        let cfg = d.0.join("rack.toml");
        std::fs::write(
            &cfg,
            "[[groups]]\ncount = 2\nkind = \"gpu\"\nmodel = \"GB200\"\nmemory_mib = 1\n\
             [topology]\nrack = \"r07\"\nblock = \"su-2\"\nnvlink_domain = \"nvl72-r07\"\n",
        )
        .unwrap();
        let p = FakePlugin::init(pb::PluginConfig { config_path: cfg.display().to_string(), ..Default::default() })
            .unwrap();
        let inv = p.fingerprint().unwrap();
        assert_eq!(
            inv.topology,
            Some(pb::NodeTopology { rack: "r07".into(), block: "su-2".into(), nvlink_domain: "nvl72-r07".into() })
        );
        assert_eq!(p.topology(), inv.topology.as_ref());
        // Without the table: no topology.
        let (_d8, p8) = setup("fake-8gpu.toml");
        assert_eq!(p8.fingerprint().unwrap().topology, None);
    }

    #[test]
    fn a_bad_topology_value_refuses_init_and_names_the_field() {
        let d = Dir::new();
        let cfg = d.0.join("bad-rack.toml");
        std::fs::write(
            &cfg,
            "[[groups]]\ncount = 1\nkind = \"gpu\"\nmodel = \"m\"\nmemory_mib = 1\n[topology]\nrack = \"r/7\"\n",
        )
        .unwrap();
        let e = FakePlugin::init(pb::PluginConfig { config_path: cfg.display().to_string(), ..Default::default() })
            .err()
            .unwrap();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("bad-rack.toml") && e.message.contains("topology.rack \"r/7\""), "{}", e.message);
    }

    #[test]
    fn the_fault_file_option_overrides_the_config() {
        let d = Dir::new();
        let f = d.0.join("elsewhere.toml");
        std::fs::write(&f, "unhealthy = [\"gpu0\"]\n").unwrap();
        let mut cfg =
            pb::PluginConfig { config_path: example("fake-8gpu.toml").display().to_string(), ..Default::default() };
        cfg.options.insert("fault_file".into(), f.display().to_string());
        let p = FakePlugin::init(cfg).unwrap();
        assert_eq!(p.fault_path(), f);
        assert!(!p.fingerprint().unwrap().devices[0].healthy);
    }

    /// Runs in a child copy of this test binary (see `segfault_abort_and_hang_really_happen`).
    #[test]
    fn crash_child() {
        let (Ok(kind), Ok(dir)) = (std::env::var("SUANLI_FAKE_CRASH_CHILD"), std::env::var("SUANLI_FAKE_CRASH_DIR"))
        else {
            return;
        };
        // No core dumps from the deliberate crashes.
        let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        #[allow(unsafe_code)]
        // SAFETY: setrlimit reads the struct it is given and nothing else.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
        assert_eq!(rc, 0);
        let dir = PathBuf::from(dir);
        let cfg = dir.join("fake-8gpu.toml");
        std::fs::copy(example("fake-8gpu.toml"), &cfg).unwrap();
        std::fs::write(dir.join("fake-8gpu.faults.toml"), format!("crash = \"{kind}\"\ncrash_on = \"stats\"\n"))
            .unwrap();
        let p = FakePlugin::init(pb::PluginConfig { config_path: cfg.display().to_string(), ..Default::default() })
            .unwrap();
        p.fingerprint().unwrap();
        let _ = p.stats(pb::StatsRequest::default());
        panic!("stats returned despite crash = {kind:?}");
    }

    #[test]
    fn segfault_abort_and_hang_really_happen() {
        use std::io::{BufRead, BufReader};
        use std::os::unix::process::ExitStatusExt;
        use std::process::{Command, Stdio};
        use std::time::Instant;

        for (kind, signal) in [("segfault", Some(libc::SIGSEGV)), ("abort", Some(libc::SIGABRT)), ("hang", None)] {
            let d = Dir::new();
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "plugin_fake_tests::crash_child", "--test-threads=1", "--nocapture"])
                .env("SUANLI_FAKE_CRASH_CHILD", kind)
                .env("SUANLI_FAKE_CRASH_DIR", &d.0)
                .current_dir(&d.0)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            // Wait for the plugin to announce the fault on stderr.
            let stderr = child.stderr.take().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if line.contains("injected fault") {
                        let _ = tx.send(());
                    }
                }
            });
            rx.recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("{kind}: the child never reached the fault"));
            match signal {
                Some(sig) => {
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let status = loop {
                        if let Some(st) = child.try_wait().unwrap() {
                            break st;
                        }
                        assert!(Instant::now() < deadline, "{kind}: the child did not die within 30 s");
                        std::thread::sleep(Duration::from_millis(20));
                    };
                    assert_eq!(status.signal(), Some(sig), "{kind}: {status:?}");
                }
                None => {
                    // Still inside the call a while after entering it.
                    std::thread::sleep(Duration::from_millis(300));
                    assert!(child.try_wait().unwrap().is_none(), "hang: the child exited");
                    child.kill().unwrap();
                    child.wait().unwrap();
                }
            }
        }
    }
}
