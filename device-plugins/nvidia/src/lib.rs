//! suanli's NVIDIA plugin: GPUs through NVML (`nvml-wrapper`, which dlopens
//! `libnvidia-ml.so.1` at run time, so this library builds and loads on machines without a driver).
//!
//! ```text
//!  init ──▶ Nvml::init ──┬─ fails ─▶ "absent": zero devices, message "NVML not available: <cause>"
//!                        └─ ok ────▶ XID watcher thread (event set, 500 ms waits) ─▶ bounded queue
//!  fingerprint ─▶ per GPU: index, UUID, name, memory, NUMA, MIG devices (partition_of), NVLink
//!                 peers (links + peer_group islands); unhealthy after a device XID
//!  stats ───────▶ utilization, memory used, power, temperature, volatile uncorrected ECC, XIDs seen
//!  reserve ─────▶ CUDA_VISIBLE_DEVICES=<UUIDs>, /dev/nvidia<minor>, /dev/nvidiactl, /dev/nvidia-uvm,
//!                 and for a MIG device its GI and CI access files /dev/nvidia-caps/nvidia-cap<N>
//!                 (minors from /proc/driver/nvidia-caps/mig-minors)
//!  health_events ▶ drains the queue
//! ```
//!
//! Device ids are `gpu<index>` for GPUs and `gpu<index>-mig<n>` for MIG devices.
//! Where NVML is absent every call still succeeds (with zero devices) except reserve and stats of
//! a named device, which fail with NotFound and the NVML error. The code paths that need a GPU
//! cannot run on machines without one; they are kept straightforward (one NVML query per field,
//! each failure reported rather than fatal).
//!
//! Plugin options: `nvml_lib` (a path to load instead of `libnvidia-ml.so.1`), `mig_minors_file`
//! (a path to read instead of `/proc/driver/nvidia-caps/mig-minors`), and `rack`, `block`,
//! `nvlink_domain`: the node's place in the datacenter network, passed through into every
//! inventory's `topology` (each 1 to 63 bytes of ASCII letters, digits, '.', '_' and '-'; a bad
//! value fails init and names the option). NVML does not tell a node's rack or block.
//! `reset_command` (ABI 1.3 `reset`): the command that resets one GPU after a recoverable XID,
//! split on whitespace, `{index}` and `{uuid}` replaced, e.g. `nvidia-smi --gpu-reset -i {index}`
//! (NVML has no reset call). It runs for at most 25 s; exit status 0 clears the GPU's XID mark, so
//! the next fingerprint says healthy. Without it `reset` is UNIMPLEMENTED and a GPU marked by an
//! XID stays unhealthy until the plugin restarts.

pub mod mps;
pub mod topo;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nvml_wrapper::Device;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use suanli_device_abi::{Code, DevicePlugin, PluginError, pb};

/// The most health events kept between two health_events calls; older ones are dropped (and
/// counted in the next event batch's message).
pub const MAX_QUEUED_EVENTS: usize = 1024;
/// How long the XID watcher waits for an event before checking whether to stop.
pub const EVENT_WAIT_MS: u32 = 500;
/// The most GPUs enumerated.
pub const MAX_GPUS: u32 = 64;
/// NVML's maximum NVLinks per GPU (NVML_NVLINK_MAX_LINKS).
pub const MAX_NVLINKS: u32 = 18;

const MIB: u64 = 1024 * 1024;

/// The longest `rack`, `block` or `nvlink_domain` option (a short label value).
pub const MAX_TOPOLOGY_LEN: usize = 63;

/// The NVIDIA plugin instance.
pub struct NvidiaPlugin {
    backend: Backend,
    /// The options `rack`, `block` and `nvlink_domain`, reported in every inventory.
    topology: Option<pb::NodeTopology>,
    /// The option `reset_command`, split (empty: reset is unimplemented).
    reset_command: Vec<String>,
    /// MPS isolation of fractional shares (options `mps`, `mps_control`, `mps_dir`).
    mps: mps::Setup,
}

/// The most arguments and bytes of the `reset_command` option.
pub const MAX_RESET_ARGS: usize = 32;
/// How long a reset command may run before it is killed.
pub const RESET_TIMEOUT: Duration = Duration::from_secs(25);

/// The option `reset_command`, split on whitespace; names the limit it breaks.
fn reset_command_option(options: &BTreeMap<String, String>) -> Result<Vec<String>, PluginError> {
    let Some(v) = options.get("reset_command") else {
        return Ok(Vec::new());
    };
    let args: Vec<String> = v.split_whitespace().map(str::to_owned).collect();
    if args.is_empty() || args.len() > MAX_RESET_ARGS || v.len() > 1024 {
        return Err(PluginError::invalid(format!(
            "option reset_command must be 1 to {MAX_RESET_ARGS} words and at most 1024 bytes, e.g. \"nvidia-smi --gpu-reset -i {{index}}\""
        )));
    }
    Ok(args)
}

/// Runs `cmd` (its stdio as the caller set it) for at most `timeout`, writing `input` to its
/// stdin when given; `Ok` on exit status 0, else why not, named `what`, with the first 512
/// bytes of its stderr when the caller piped it. Used for `reset_command` and the MPS control
/// program.
pub(crate) fn run_bounded(
    cmd: &mut std::process::Command,
    what: &str,
    input: Option<&str>,
    timeout: Duration,
) -> Result<(), String> {
    use std::io::{Read as _, Write as _};
    if input.is_some() {
        cmd.stdin(std::process::Stdio::piped());
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot run {}: {e}", cmd.get_program().to_string_lossy()))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        let _ = stdin.write_all(text.as_bytes());
    }
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => {
                let mut err = String::new();
                if let Some(e) = child.stderr.take() {
                    let _ = e.take(512).read_to_string(&mut err);
                }
                let err = err.trim();
                return Err(if err.is_empty() {
                    format!("{what} exited with {st}")
                } else {
                    format!("{what} exited with {st}: {err}")
                });
            }
            Ok(None) if std::time::Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{what} ran past {timeout:?} and was killed"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(format!("waiting for {what}: {e}")),
        }
    }
}

/// The node topology from the plugin options `rack`, `block` and `nvlink_domain` (`None` when
/// none is set); a value that is not 1 to [`MAX_TOPOLOGY_LEN`] bytes of ASCII letters, digits,
/// '.', '_' and '-' is an error naming the option.
fn topology_options(options: &BTreeMap<String, String>) -> Result<Option<pb::NodeTopology>, PluginError> {
    let mut t = pb::NodeTopology::default();
    for (key, slot) in [("rack", &mut t.rack), ("block", &mut t.block), ("nvlink_domain", &mut t.nvlink_domain)] {
        let Some(v) = options.get(key) else {
            continue;
        };
        if v.is_empty()
            || v.len() > MAX_TOPOLOGY_LEN
            || !v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            let shown: String = v.chars().take(80).collect();
            return Err(PluginError::invalid(format!(
                "option {key} is {shown:?}; expected 1 to {MAX_TOPOLOGY_LEN} ASCII letters, digits, '-', '_' or '.'"
            )));
        }
        slot.clone_from(v);
    }
    Ok(if t == pb::NodeTopology::default() { None } else { Some(t) })
}

enum Backend {
    /// NVML could not be loaded or initialized.
    Absent {
        message: String,
    },
    Live(Live),
}

struct Live {
    nvml: Arc<Nvml>,
    /// The driver's MIG capability minors (`/proc/driver/nvidia-caps/mig-minors`; option
    /// `mig_minors_file`).
    mig_minors_file: std::path::PathBuf,
    driver_version: String,
    health: Arc<Mutex<Health>>,
    stop: Arc<AtomicBool>,
    watcher: Mutex<Option<JoinHandle<()>>>,
}

/// XID state shared with the watcher thread.
#[derive(Default)]
struct Health {
    /// Devices made unhealthy by an XID, and the last such XID (sticky until the plugin restarts).
    bad: BTreeMap<String, u64>,
    /// XIDs seen per device since init.
    xid_count: BTreeMap<String, u64>,
    /// Events not yet returned by health_events (at most MAX_QUEUED_EVENTS).
    queue: VecDeque<pb::HealthEvent>,
    /// Events dropped because the queue was full.
    dropped: u64,
    /// Why XID events are not (or not fully) watched, if so.
    watch_error: Option<String>,
}

fn nvml_err(what: &str, e: &NvmlError) -> PluginError {
    let code = match e {
        NvmlError::GpuLost | NvmlError::DriverNotLoaded | NvmlError::Uninitialized => Code::Unavailable,
        NvmlError::NotFound | NvmlError::InvalidArg => Code::NotFound,
        _ => Code::Internal,
    };
    PluginError::new(code, format!("{what}: {}", topo::error_chain(e)))
}

/// NUMA node of a GPU: NVML when it knows, else sysfs, else 0.
fn numa_of(dev: &Device<'_>, bus_id: Option<&str>) -> u32 {
    if let Ok(n) = dev.numa_node_id() {
        return n;
    }
    bus_id
        .and_then(topo::sysfs_pci_dir)
        .and_then(|d| std::fs::read_to_string(d.join("numa_node")).ok())
        .and_then(|t| topo::parse_numa_node(&t))
        .unwrap_or(0)
}

impl Live {
    fn device_count(&self) -> Result<u32, PluginError> {
        let n = self.nvml.device_count().map_err(|e| nvml_err("nvmlDeviceGetCount", &e))?;
        if n > MAX_GPUS {
            return Err(PluginError::internal(format!("NVML reports {n} GPUs, more than the limit of {MAX_GPUS}")));
        }
        Ok(n)
    }

    fn health(&self) -> Result<std::sync::MutexGuard<'_, Health>, PluginError> {
        self.health.lock().map_err(|_| PluginError::internal("nvidia health lock poisoned"))
    }

    /// `mps`: whether shares of whole GPUs outside MIG mode are limited (MPS).
    fn fingerprint(&self, mps: bool) -> Result<pb::Inventory, PluginError> {
        let count = self.device_count()?;
        let bad = self.health()?.bad.clone();
        let mut devices = Vec::new();
        let mut link_info = Vec::new();
        let mut notes = Vec::new();
        for i in 0..count {
            let id = topo::gpu_id(i);
            let dev = match self.nvml.device_by_index(i) {
                Ok(d) => d,
                Err(e) => {
                    devices.push(pb::PluginDevice {
                        id,
                        kind: "gpu".into(),
                        vendor: "nvidia".into(),
                        model: "unknown".into(),
                        healthy: false,
                        health_reason: format!("nvmlDeviceGetHandleByIndex: {}", topo::error_chain(&e)),
                        index: i,
                        ..Default::default()
                    });
                    continue;
                }
            };
            let mut problems = Vec::new();
            let uuid = dev.uuid().unwrap_or_else(|e| {
                problems.push(format!("uuid: {}", topo::error_chain(&e)));
                String::new()
            });
            let model = dev.name().unwrap_or_else(|e| {
                problems.push(format!("name: {}", topo::error_chain(&e)));
                "unknown".into()
            });
            let memory_mib = dev.memory_info().map(|m| m.total / MIB).unwrap_or_else(|e| {
                problems.push(format!("memory: {}", topo::error_chain(&e)));
                0
            });
            let bus_id = dev.pci_info().ok().and_then(|p| topo::normalize_bus_id(&p.bus_id));
            let numa_node = numa_of(&dev, bus_id.as_deref());
            if let Some(bus) = &bus_id {
                let mut links = Vec::new();
                for l in 0..MAX_NVLINKS {
                    let link = dev.link_wrapper_for(l);
                    if !matches!(link.is_active(), Ok(true)) {
                        continue;
                    }
                    let Some(remote) = link.remote_pci_info().ok().and_then(|p| topo::normalize_bus_id(&p.bus_id))
                    else {
                        continue;
                    };
                    links.push((remote, link.version().unwrap_or(0)));
                }
                link_info.push(topo::GpuLinks { id: id.clone(), bus_id: bus.clone(), links });
            }
            let (healthy, health_reason) = match (bad.get(&id), problems.is_empty()) {
                (Some(code), _) => (false, format!("XID {code}")),
                (None, false) => (false, problems.join("; ")),
                (None, true) => (true, String::new()),
            };
            let mig_mode = dev.mig_mode().map(|m| m.current == 1).unwrap_or(false);
            devices.push(pb::PluginDevice {
                id: id.clone(),
                kind: "gpu".into(),
                vendor: "nvidia".into(),
                model: model.clone(),
                memory_mib,
                healthy,
                health_reason: health_reason.clone(),
                numa_node,
                uuid,
                index: i,
                // MPS limits shares of a whole GPU; a GPU in MIG mode is shared through its MIG
                // devices, whose own fractions are advisory.
                share_isolation: u32::from(mps && !mig_mode),
                ..Default::default()
            });
            // MIG devices, when MIG mode is on.
            if mig_mode {
                let max = dev.mig_device_count().unwrap_or(0).min(MAX_GPUS);
                for m in 0..max {
                    let mig = match dev.mig_device_by_index(m) {
                        Ok(d) => d,
                        Err(NvmlError::NotFound) => continue,
                        Err(e) => {
                            notes.push(format!("{}: {}", topo::mig_id(i, m), topo::error_chain(&e)));
                            continue;
                        }
                    };
                    devices.push(pb::PluginDevice {
                        id: topo::mig_id(i, m),
                        kind: "gpu".into(),
                        vendor: "nvidia".into(),
                        model: mig.name().unwrap_or_else(|_| model.clone()),
                        memory_mib: mig.memory_info().map(|mm| mm.total / MIB).unwrap_or(0),
                        healthy,
                        health_reason: health_reason.clone(),
                        numa_node,
                        partition_of: id.clone(),
                        uuid: mig.uuid().unwrap_or_default(),
                        index: i,
                        ..Default::default()
                    });
                }
            }
        }
        let topology = topo::nvlink_topology(&link_info);
        for d in devices.iter_mut().filter(|d| d.partition_of.is_empty()) {
            if let Some((links, group)) = topology.get(&d.id) {
                d.links = links.clone();
                d.peer_group = *group;
            }
        }
        let mut message = format!("{count} NVIDIA GPU(s) through NVML");
        if let Some(w) = &self.health()?.watch_error {
            message.push_str("; XID events: ");
            message.push_str(w);
        }
        for n in notes {
            message.push_str("; ");
            message.push_str(&n);
        }
        Ok(pb::Inventory {
            vendor: "nvidia".into(),
            message,
            devices,
            driver_version: self.driver_version.clone(),
            ..Default::default()
        })
    }

    /// The NVML handle of an id (a GPU or one of its MIG devices).
    fn resolve(&self, id: &str) -> Result<(Device<'_>, u32, bool), PluginError> {
        let Some((index, mig)) = topo::parse_id(id) else {
            return Err(PluginError::not_found(format!(
                "device {id:?} is not an NVIDIA plugin id (gpuN or gpuN-migM)"
            )));
        };
        if index >= self.device_count()? {
            return Err(PluginError::not_found(format!("device {id:?}: no GPU {index} on this node")));
        }
        let dev = self.nvml.device_by_index(index).map_err(|e| nvml_err(&format!("device {id:?}"), &e))?;
        match mig {
            None => Ok((dev, index, false)),
            Some(m) => {
                let md = dev.mig_device_by_index(m).map_err(|e| nvml_err(&format!("device {id:?}"), &e))?;
                Ok((md, index, true))
            }
        }
    }

    /// The GPU instance and compute instance ids of a MIG device handle.
    #[allow(unsafe_code)]
    fn mig_instance_ids(&self, id: &str, dev: &Device<'_>) -> Result<(u32, u32), PluginError> {
        let lib = self.nvml.lib();
        let (Ok(gi_fn), Ok(ci_fn)) = (&lib.nvmlDeviceGetGpuInstanceId, &lib.nvmlDeviceGetComputeInstanceId) else {
            return Err(PluginError::new(
                Code::FailedPrecondition,
                format!("device {id:?}: this NVML has no nvmlDeviceGetGpuInstanceId/ComputeInstanceId"),
            ));
        };
        let (mut gi, mut ci) = (0u32, 0u32);
        // SAFETY: the handle is a live MIG device handle of this NVML (Device borrows it), the
        // out-pointers are valid u32s, and the functions take nothing else.
        let (r1, r2) = unsafe { (gi_fn(dev.handle(), &mut gi), ci_fn(dev.handle(), &mut ci)) };
        if r1 != 0 || r2 != 0 {
            return Err(PluginError::new(
                Code::FailedPrecondition,
                format!("device {id:?}: NVML could not name its GPU/compute instance (codes {r1}, {r2})"),
            ));
        }
        Ok((gi, ci))
    }

    fn reserve(&self, req: &pb::ReserveRequest, mps: Option<&mps::Mps>) -> Result<pb::Reservation, PluginError> {
        let bad = self.health()?.bad.clone();
        let mut mps_shares = Vec::new();
        let mut uuids = Vec::new();
        let mut minors = std::collections::BTreeSet::new();
        let mut caps = Vec::new();
        let mut mig_minors: Option<BTreeMap<String, u32>> = None;
        for id in &req.device_ids {
            let (dev, index, is_mig) = self.resolve(id)?;
            if let Some(code) = bad.get(&topo::gpu_id(index)) {
                return Err(PluginError::new(
                    Code::FailedPrecondition,
                    format!("device {id:?} is unhealthy: XID {code}"),
                ));
            }
            let uuid = dev.uuid().map_err(|e| nvml_err(&format!("device {id:?} uuid"), &e))?;
            let share = req.shares.iter().find(|s| &s.device_id == id).filter(|s| s.milli > 0 && s.milli < 1000);
            if let Some(s) = share
                && !is_mig
                && !dev.mig_mode().map(|m| m.current == 1).unwrap_or(false)
            {
                mps_shares.push((id.clone(), uuid.clone(), s.milli, s.memory_mib));
            }
            uuids.push(uuid);
            let parent = self.nvml.device_by_index(index).map_err(|e| nvml_err(&format!("device {id:?}"), &e))?;
            let minor = parent.minor_number().unwrap_or(index);
            minors.insert(minor);
            if is_mig {
                // A MIG device is opened through its GPU and compute instances' capability
                // files (/dev/nvidia-caps/nvidia-cap<N>), which a container runtime must bind.
                let (gi, ci) = self.mig_instance_ids(id, &dev)?;
                if mig_minors.is_none() {
                    let text = std::fs::read_to_string(&self.mig_minors_file).map_err(|e| {
                        PluginError::new(
                            Code::FailedPrecondition,
                            format!("device {id:?}: reading {}: {e}", self.mig_minors_file.display()),
                        )
                    })?;
                    mig_minors = Some(topo::parse_mig_minors(&text));
                }
                let table = mig_minors.as_ref().map_or_else(BTreeMap::new, Clone::clone);
                let files = topo::mig_cap_files(&table, minor, gi, ci)
                    .map_err(|e| PluginError::new(Code::FailedPrecondition, format!("device {id:?}: {e}")))?;
                caps.extend(files);
            }
        }
        let mut res = pb::Reservation::default();
        if req.device_ids.is_empty() {
            return Ok(res);
        }
        res.env.insert("CUDA_VISIBLE_DEVICES".into(), uuids.join(","));
        let file = |p: String| pb::DeviceFile { host_path: p.clone(), container_path: p, permissions: "rw".into() };
        for m in minors {
            res.device_files.push(file(format!("/dev/nvidia{m}")));
        }
        for f in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
            res.device_files.push(file(f.into()));
        }
        for c in caps {
            res.device_files.push(file(c));
        }
        if let Some(mps) = mps {
            if mps_shares.len() > 1 {
                return Err(PluginError::new(
                    Code::FailedPrecondition,
                    "a CUDA process talks to one MPS daemon, and each shared GPU has its own: a reservation may hold a share of one GPU only",
                ));
            }
            if let Some((gpu, uuid, milli, memory_mib)) = mps_shares.first() {
                let share = mps::Share { gpu, uuid, milli: *milli, memory_mib: *memory_mib };
                let part = mps.reserve(&req.reservation_id, &share)?;
                res.env.extend(part.env);
                res.mounts.extend(part.mounts);
            }
        }
        Ok(res)
    }

    fn one_stats(&self, id: &str, dev: &Device<'_>, xids: u64) -> pb::DeviceStats {
        pb::DeviceStats {
            id: id.to_string(),
            utilization_pct: dev.utilization_rates().map(|u| f64::from(u.gpu)).unwrap_or(0.0),
            memory_used_mib: dev.memory_info().map(|m| m.used / MIB).unwrap_or(0),
            power_w: dev.power_usage().map(|mw| f64::from(mw) / 1000.0).unwrap_or(0.0),
            temperature_c: dev.temperature(TemperatureSensor::Gpu).map(f64::from).unwrap_or(0.0),
            ecc_errors: dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).unwrap_or(0),
            xid_errors: xids,
        }
    }

    fn stats(&self, req: &pb::StatsRequest) -> Result<pb::StatsResponse, PluginError> {
        let counts = self.health()?.xid_count.clone();
        let mut out = Vec::new();
        if req.device_ids.is_empty() {
            for i in 0..self.device_count()? {
                let id = topo::gpu_id(i);
                if let Ok(dev) = self.nvml.device_by_index(i) {
                    out.push(self.one_stats(&id, &dev, counts.get(&id).copied().unwrap_or(0)));
                }
            }
        } else {
            for id in &req.device_ids {
                let (dev, index, _) = self.resolve(id)?;
                out.push(self.one_stats(id, &dev, counts.get(&topo::gpu_id(index)).copied().unwrap_or(0)));
            }
        }
        Ok(pb::StatsResponse { devices: out, cpu_utilization_pct: 0.0 })
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.watcher.lock().ok().and_then(|mut w| w.take()) {
            // The watcher checks `stop` at least every EVENT_WAIT_MS.
            let _ = h.join();
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.stop();
    }
}

fn push_event(h: &mut Health, ev: pb::HealthEvent) {
    if h.queue.len() >= MAX_QUEUED_EVENTS {
        h.queue.pop_front();
        h.dropped += 1;
    }
    h.queue.push_back(ev);
}

/// The XID watcher: registers every GPU that supports it for critical XID events and waits on
/// the event set until told to stop.
fn watch_xids(
    nvml: Arc<Nvml>,
    ids_by_uuid: BTreeMap<String, String>,
    count: u32,
    health: Arc<Mutex<Health>>,
    stop: Arc<AtomicBool>,
) {
    let note = |msg: String| {
        if let Ok(mut h) = health.lock() {
            h.watch_error = Some(match h.watch_error.take() {
                Some(prev) if prev != msg => format!("{prev}; {msg}"),
                _ => msg,
            });
        }
    };
    // Registering a device that fails releases the set, so on failure start over without it.
    let mut skip = std::collections::BTreeSet::new();
    let set = 'build: loop {
        let mut set = match nvml.create_event_set() {
            Ok(s) => s,
            Err(e) => {
                note(format!("nvmlEventSetCreate: {}", topo::error_chain(&e)));
                return;
            }
        };
        let mut registered = 0;
        for i in 0..count {
            if skip.contains(&i) {
                continue;
            }
            let Ok(dev) = nvml.device_by_index(i) else { continue };
            match dev.supported_event_types() {
                Ok(t) if t.contains(EventTypes::CRITICAL_XID_ERROR) => {}
                _ => continue,
            }
            match dev.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                Ok(s) => {
                    set = s;
                    registered += 1;
                }
                Err(e) => {
                    note(format!("gpu{i}: nvmlDeviceRegisterEvents: {}", topo::error_chain(&e)));
                    skip.insert(i);
                    continue 'build;
                }
            }
        }
        if registered == 0 {
            note("no GPU supports XID events".into());
            return;
        }
        break set;
    };
    while !stop.load(Ordering::SeqCst) {
        match set.wait(EVENT_WAIT_MS) {
            Ok(ev) => {
                let code = match ev.event_data {
                    Some(XidError::Value(v)) => v,
                    Some(XidError::Unknown) | None => 999,
                };
                let id = ev
                    .device
                    .uuid()
                    .ok()
                    .and_then(|u| ids_by_uuid.get(&u).cloned())
                    .unwrap_or_else(|| "unknown".into());
                let app = topo::xid_is_application_error(code);
                let Ok(mut h) = health.lock() else { return };
                *h.xid_count.entry(id.clone()).or_default() += 1;
                if !app {
                    h.bad.insert(id.clone(), code);
                }
                let reason = if app {
                    format!("XID {code} (an application error; the device stays healthy)")
                } else {
                    format!("XID {code}")
                };
                let event_class = topo::xid_class(code).raw();
                push_event(&mut h, pb::HealthEvent { device: id, healthy: app, reason, code, event_class });
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                note(format!("nvmlEventSetWait: {}", topo::error_chain(&e)));
                // Do not spin on a persistent error.
                std::thread::sleep(Duration::from_millis(u64::from(EVENT_WAIT_MS)));
            }
        }
    }
}

impl NvidiaPlugin {
    /// Whether NVML was loaded.
    pub fn nvml_loaded(&self) -> bool {
        matches!(self.backend, Backend::Live(_))
    }

    fn absent_not_found(message: &str, ids: &[String]) -> Result<(), PluginError> {
        match ids.first() {
            None => Ok(()),
            Some(id) => Err(PluginError::not_found(format!("device {id:?}: no NVIDIA devices ({message})"))),
        }
    }
}

impl DevicePlugin for NvidiaPlugin {
    const NAME: &'static str = "nvidia";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: pb::PluginConfig) -> Result<Self, PluginError> {
        let topology = topology_options(&config.options)?;
        let reset_command = reset_command_option(&config.options)?;
        let mps_setup = mps::setup(&config.options)?;
        let lib = config.options.get("nvml_lib").cloned();
        let loaded = match &lib {
            Some(path) => Nvml::builder().lib_path(std::ffi::OsStr::new(path)).init(),
            None => Nvml::init(),
        };
        let nvml = match loaded {
            Ok(n) => Arc::new(n),
            Err(e) => {
                let what = lib.as_deref().unwrap_or("libnvidia-ml.so.1");
                let message = format!("NVML not available: {what}: {}", topo::error_chain(&e));
                eprintln!("suanli nvidia plugin: {message}");
                return Ok(NvidiaPlugin {
                    backend: Backend::Absent { message },
                    topology,
                    reset_command,
                    mps: mps_setup,
                });
            }
        };
        let driver_version = nvml.sys_driver_version().unwrap_or_default();
        let mig_minors_file = config
            .options
            .get("mig_minors_file")
            .map_or_else(|| std::path::PathBuf::from(topo::MIG_MINORS_FILE), std::path::PathBuf::from);
        let live = Live {
            nvml: Arc::clone(&nvml),
            mig_minors_file,
            driver_version,
            health: Arc::new(Mutex::new(Health::default())),
            stop: Arc::new(AtomicBool::new(false)),
            watcher: Mutex::new(None),
        };
        let count = live.device_count().unwrap_or(0);
        let mut ids_by_uuid = BTreeMap::new();
        for i in 0..count {
            if let Ok(u) = nvml.device_by_index(i).and_then(|d| d.uuid()) {
                ids_by_uuid.insert(u, topo::gpu_id(i));
            }
        }
        if count > 0 {
            let (health, stop) = (Arc::clone(&live.health), Arc::clone(&live.stop));
            let spawned = std::thread::Builder::new()
                .name("suanli-nvidia-xid".into())
                .spawn(move || watch_xids(nvml, ids_by_uuid, count, health, stop));
            match spawned {
                Ok(h) => {
                    if let Ok(mut w) = live.watcher.lock() {
                        *w = Some(h);
                    }
                }
                Err(e) => {
                    if let Ok(mut h) = live.health.lock() {
                        h.watch_error = Some(format!("cannot start the XID watcher thread: {e}"));
                    }
                }
            }
        }
        Ok(NvidiaPlugin { backend: Backend::Live(live), topology, reset_command, mps: mps_setup })
    }

    fn fingerprint(&self) -> Result<pb::Inventory, PluginError> {
        let mut inv = match &self.backend {
            Backend::Absent { message } => {
                pb::Inventory { vendor: "nvidia".into(), message: message.clone(), ..Default::default() }
            }
            Backend::Live(l) => {
                let mut inv = l.fingerprint(self.mps.enforcing().is_some())?;
                inv.message.push_str("; ");
                inv.message.push_str(&self.mps.describe());
                inv
            }
        };
        inv.topology.clone_from(&self.topology);
        Ok(inv)
    }

    fn reserve(&self, req: pb::ReserveRequest) -> Result<pb::Reservation, PluginError> {
        match &self.backend {
            Backend::Absent { message } => {
                Self::absent_not_found(message, &req.device_ids)?;
                Ok(pb::Reservation::default())
            }
            Backend::Live(l) => l.reserve(&req, self.mps.enforcing()),
        }
    }

    fn release(&self, req: pb::ReleaseRequest) -> Result<(), PluginError> {
        self.mps.enforcing().map_or(Ok(()), |m| m.release(&req.reservation_id))
    }

    fn stats(&self, req: pb::StatsRequest) -> Result<pb::StatsResponse, PluginError> {
        match &self.backend {
            Backend::Absent { message } => {
                Self::absent_not_found(message, &req.device_ids)?;
                Ok(pb::StatsResponse::default())
            }
            Backend::Live(l) => l.stats(&req),
        }
    }

    fn reset(&self, req: pb::ResetRequest) -> Result<(), PluginError> {
        let Backend::Live(l) = &self.backend else {
            return Err(PluginError::not_found(format!("no GPU {:?}: NVML is not available", req.device_id)));
        };
        let index: u32 = req
            .device_id
            .strip_prefix("gpu")
            .and_then(|n| n.parse().ok())
            .filter(|i| *i < l.device_count().unwrap_or(0))
            .ok_or_else(|| {
                PluginError::not_found(format!(
                    "{:?} is not a whole GPU of this node (a MIG instance is reset with its GPU)",
                    req.device_id
                ))
            })?;
        if self.reset_command.is_empty() {
            return Err(PluginError::new(
                Code::Unimplemented,
                "no reset_command option (e.g. \"nvidia-smi --gpu-reset -i {index}\"): the GPU stays out of service until the plugin restarts",
            ));
        }
        let uuid = l.nvml.device_by_index(index).and_then(|d| d.uuid()).unwrap_or_default();
        let argv: Vec<String> = self
            .reset_command
            .iter()
            .map(|a| a.replace("{index}", &index.to_string()).replace("{uuid}", &uuid))
            .collect();
        let (program, args) = argv.split_first().ok_or_else(|| PluginError::internal("an empty reset_command"))?;
        let mut cmd = std::process::Command::new(program);
        cmd.args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        run_bounded(&mut cmd, &argv.join(" "), None, RESET_TIMEOUT)
            .map_err(|e| PluginError::new(Code::FailedPrecondition, format!("reset of {}: {e}", req.device_id)))?;
        l.health()?.bad.remove(&req.device_id);
        Ok(())
    }

    fn health_events(&self) -> Result<pb::HealthEvents, PluginError> {
        match &self.backend {
            Backend::Absent { .. } => Ok(pb::HealthEvents::default()),
            Backend::Live(l) => {
                let mut h = l.health()?;
                let mut events: Vec<pb::HealthEvent> = h.queue.drain(..).collect();
                if h.dropped > 0 {
                    if let Some(first) = events.first_mut() {
                        first.reason.push_str(&format!(
                            " ({} older events dropped: queue limit {MAX_QUEUED_EVENTS})",
                            h.dropped
                        ));
                    }
                    h.dropped = 0;
                }
                Ok(pb::HealthEvents { events })
            }
        }
    }

    fn shutdown(&self) {
        if let Backend::Live(l) = &self.backend {
            l.stop();
        }
    }
}

suanli_device_abi::export_plugin!(NvidiaPlugin);

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_nvidia_tests {
    use super::*;

    /// This machine has no NVIDIA driver: init succeeds, and every call reports zero devices and why.
    #[test]
    fn without_nvml_zero_devices_and_a_clear_message() {
        let mut cfg = pb::PluginConfig::default();
        cfg.options.insert("nvml_lib".into(), "/nonexistent/libnvidia-ml.so.1".into());
        let p = NvidiaPlugin::init(cfg).unwrap();
        assert!(!p.nvml_loaded());
        let inv = p.fingerprint().unwrap();
        assert_eq!(inv.vendor, "nvidia");
        assert!(inv.devices.is_empty());
        assert!(inv.message.starts_with("NVML not available: /nonexistent/libnvidia-ml.so.1"), "{}", inv.message);
        // The dlopen cause is in the message, not just "dlopen failed".
        assert!(inv.message.contains("No such file or directory"), "{}", inv.message);
        assert!(p.stats(pb::StatsRequest::default()).unwrap().devices.is_empty());
        assert!(p.health_events().unwrap().events.is_empty());
        assert_eq!(p.reserve(pb::ReserveRequest::default()).unwrap(), pb::Reservation::default());
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["gpu0".into()], alloc_id: 1, ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code, Code::NotFound);
        assert!(e.message.contains("NVML not available"), "{}", e.message);
        p.shutdown();
    }

    /// The options rack, block and nvlink_domain pass through into the inventory (NVML or not);
    /// a bad value fails init and names the option.
    #[test]
    fn topology_options_pass_through() {
        let mut cfg = pb::PluginConfig::default();
        cfg.options.insert("nvml_lib".into(), "/nonexistent/libnvidia-ml.so.1".into());
        let p = NvidiaPlugin::init(cfg.clone()).unwrap();
        assert_eq!(p.fingerprint().unwrap().topology, None);
        cfg.options.insert("rack".into(), "r07".into());
        cfg.options.insert("nvlink_domain".into(), "nvl72-r07".into());
        let p = NvidiaPlugin::init(cfg.clone()).unwrap();
        let want = pb::NodeTopology { rack: "r07".into(), block: String::new(), nvlink_domain: "nvl72-r07".into() };
        assert_eq!(p.fingerprint().unwrap().topology, Some(want));
        cfg.options.insert("block".into(), "su 2".into());
        let e = NvidiaPlugin::init(cfg).err().unwrap();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("option block is \"su 2\""), "{}", e.message);
    }

    /// The default library name, as production uses it. Where a driver is installed this takes
    /// the live path, which must still answer every call.
    #[test]
    fn default_library() {
        let p = NvidiaPlugin::init(pb::PluginConfig::default()).unwrap();
        let inv = p.fingerprint().unwrap();
        if p.nvml_loaded() {
            assert!(inv.message.contains("NVIDIA GPU"), "{}", inv.message);
            let s = p.stats(pb::StatsRequest::default()).unwrap();
            assert_eq!(s.devices.len(), inv.devices.iter().filter(|d| d.partition_of.is_empty()).count());
        } else {
            assert!(inv.message.contains("NVML not available: libnvidia-ml.so.1"), "{}", inv.message);
            assert!(inv.devices.is_empty());
        }
        p.health_events().unwrap();
        p.shutdown();
    }
    /// A stub libnvidia-ml.so (there is no GPU here): 4 GPUs; gpu0 and gpu1 joined by two direct
    /// NVLink-4 links; gpu2 and gpu3 each with one link to each of two NVSwitches; gpu1 in MIG
    /// mode with MIG devices 0 and 2 (index 1 empty); minor numbers 100 + index; an XID event is
    /// delivered when the file XID_FILE (replaced by a path at build time) holds "GPU CODE".
    const NVML_STUB: &str = r#"
#include <stdio.h>
#include <string.h>
#include <unistd.h>
typedef struct { int index; int mig; } stub_dev;
static stub_dev gpus[4] = {{0, -1}, {1, -1}, {2, -1}, {3, -1}};
static stub_dev migs[3] = {{1, 0}, {1, 1}, {1, 2}};
typedef struct { char busIdLegacy[16]; unsigned domain, bus, device, pciDeviceId, pciSubSystemId; char busId[32]; } pci_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } mem2_t;
typedef struct { unsigned gpu, memory; } util_t;
typedef struct { void *device; unsigned long long eventType, eventData; unsigned gpuInstanceId, computeInstanceId; } event_t;
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlSystemGetDriverVersion(char *v, unsigned n) { snprintf(v, n, "550.54.15"); return 0; }
int nvmlDeviceGetCount_v2(unsigned *c) { *c = 4; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **d) { if (i >= 4) return 2; *d = &gpus[i]; return 0; }
int nvmlDeviceGetUUID(void *d, char *u, unsigned n) { stub_dev *x = d;
  if (x->mig >= 0) snprintf(u, n, "MIG-stub-%d-%d", x->index, x->mig); else snprintf(u, n, "GPU-stub-%d", x->index); return 0; }
int nvmlDeviceGetName(void *d, char *s, unsigned n) { stub_dev *x = d;
  snprintf(s, n, x->mig >= 0 ? "NVIDIA A100-SXM4-80GB MIG 3g.40gb" : "NVIDIA A100-SXM4-80GB"); return 0; }
int nvmlDeviceGetMemoryInfo_v2(void *d, mem2_t *m) { stub_dev *x = d; unsigned long long mib = 1024ULL * 1024;
  m->total = (x->mig >= 0 ? 40960ULL : 81920ULL) * mib; m->used = (1000ULL + x->index) * mib; m->free = m->total - m->used; m->reserved = 0; return 0; }
int nvmlDeviceGetPciInfo_v3(void *d, pci_t *p) { stub_dev *x = d; memset(p, 0, sizeof *p); p->bus = 0x10 + x->index;
  snprintf(p->busId, 32, "00000000:%02X:00.0", 0x10 + x->index); snprintf(p->busIdLegacy, 16, "0000:%02X:00.0", 0x10 + x->index); return 0; }
int nvmlDeviceGetNumaNodeId(void *d, unsigned *n) { *n = ((stub_dev *)d)->index / 2; return 0; }
static int remote(stub_dev *x, unsigned link, char *bus) { if (x->mig >= 0 || link > 1) return 0;
  if (x->index == 0) strcpy(bus, "00000000:11:00.0"); else if (x->index == 1) strcpy(bus, "00000000:10:00.0");
  else sprintf(bus, "00000000:A%u:00.0", link); return 1; }
int nvmlDeviceGetNvLinkState(void *d, unsigned link, int *active) { char b[32]; if (link >= 18) return 2; *active = remote(d, link, b); return 0; }
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void *d, unsigned link, pci_t *p) { memset(p, 0, sizeof *p); return remote(d, link, p->busId) ? 0 : 3; }
int nvmlDeviceGetNvLinkVersion(void *d, unsigned link, unsigned *v) { *v = 4; return 0; }
int nvmlDeviceGetMigMode(void *d, unsigned *cur, unsigned *pend) { stub_dev *x = d; if (x->mig >= 0) return 3; *cur = *pend = (x->index == 1); return 0; }
int nvmlDeviceGetMaxMigDeviceCount(void *d, unsigned *c) { *c = 3; return 0; }
int nvmlDeviceGetMigDeviceHandleByIndex(void *d, unsigned i, void **m) { stub_dev *x = d;
  if (x->index != 1 || i >= 3) return 2; if (i == 1) return 6; *m = &migs[i]; return 0; }
int nvmlDeviceGetMinorNumber(void *d, unsigned *m) { *m = ((stub_dev *)d)->index + 100; return 0; }
int nvmlDeviceGetGpuInstanceId(void *d, unsigned *id) { stub_dev *x = d; if (x->mig < 0) return 3; *id = x->mig + 1; return 0; }
int nvmlDeviceGetComputeInstanceId(void *d, unsigned *id) { stub_dev *x = d; if (x->mig < 0) return 3; *id = 0; return 0; }
int nvmlDeviceGetUtilizationRates(void *d, util_t *u) { stub_dev *x = d; if (x->mig >= 0) return 3; u->gpu = 10 * (x->index + 1); u->memory = 5; return 0; }
int nvmlDeviceGetPowerUsage(void *d, unsigned *p) { *p = 123456; return 0; }
int nvmlDeviceGetTemperature(void *d, int sensor, unsigned *t) { *t = 40 + ((stub_dev *)d)->index; return 0; }
int nvmlDeviceGetTotalEccErrors(void *d, int type, int counter, unsigned long long *c) { *c = ((stub_dev *)d)->index == 2 ? 7 : 0; return 0; }
int nvmlDeviceGetSupportedEventTypes(void *d, unsigned long long *t) { *t = 8; return 0; }
static int the_set;
int nvmlEventSetCreate(void **s) { *s = &the_set; return 0; }
int nvmlDeviceRegisterEvents(void *d, unsigned long long t, void *s) { return 0; }
int nvmlEventSetFree(void *s) { return 0; }
int nvmlEventSetWait_v2(void *s, event_t *e, unsigned timeout) {
  FILE *f = fopen("XID_FILE", "r");
  if (f) { unsigned idx = 0; unsigned long long code = 0; int ok = fscanf(f, "%u %llu", &idx, &code) == 2; fclose(f); unlink("XID_FILE");
    if (ok && idx < 4) { memset(e, 0, sizeof *e); e->device = &gpus[idx]; e->eventType = 8; e->eventData = code; return 0; } }
  usleep((timeout < 20 ? timeout : 20) * 1000); return 10;
}
"#;

    struct Stub(std::path::PathBuf);

    impl Drop for Stub {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn build_stub(name: &str) -> Stub {
        let dir = std::env::temp_dir().join(format!("suanli-nvml-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = dir.join("nvml_stub.c");
        std::fs::write(&c, NVML_STUB.replace("XID_FILE", &dir.join("xid").display().to_string())).unwrap();
        let out = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
            .args(["-shared", "-fPIC", "-O1", "-o"])
            .arg(dir.join("libnvidia-ml.so.1"))
            .arg(&c)
            .output()
            .expect("a C compiler (cc) is needed to build the stub NVML library");
        assert!(out.status.success(), "cc failed: {}", String::from_utf8_lossy(&out.stderr));
        Stub(dir)
    }

    fn xid(stub: &Stub, gpu: u32, code: u64) {
        let tmp = stub.0.join("xid.tmp");
        std::fs::write(&tmp, format!("{gpu} {code}\n")).unwrap();
        std::fs::rename(tmp, stub.0.join("xid")).unwrap();
    }

    /// Polls health_events until an event arrives (the watcher waits in 20 ms slices here).
    fn next_events(p: &NvidiaPlugin) -> Vec<pb::HealthEvent> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let ev = p.health_events().unwrap().events;
            if !ev.is_empty() {
                return ev;
            }
            assert!(std::time::Instant::now() < deadline, "no health event within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn with_a_stub_nvml_library() {
        let stub = build_stub("stub");
        let mut cfg = pb::PluginConfig::default();
        cfg.options.insert("mps".into(), "off".into());
        cfg.options.insert("nvml_lib".into(), stub.0.join("libnvidia-ml.so.1").display().to_string());
        let minors = stub.0.join("mig-minors");
        std::fs::write(&minors, "config 1\nmonitor 2\ngpu101/gi3/access 30\ngpu101/gi3/ci0/access 31\n").unwrap();
        cfg.options.insert("mig_minors_file".into(), minors.display().to_string());
        let p = NvidiaPlugin::init(cfg).unwrap();
        assert!(p.nvml_loaded());

        let inv = p.fingerprint().unwrap();
        assert_eq!(inv.driver_version, "550.54.15");
        assert!(inv.message.starts_with("4 NVIDIA GPU(s)"), "{}", inv.message);
        let ids: Vec<_> = inv.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["gpu0", "gpu1", "gpu1-mig0", "gpu1-mig2", "gpu2", "gpu3"]);
        let d = |id: &str| inv.devices.iter().find(|d| d.id == id).unwrap();
        assert_eq!(
            (d("gpu0").model.as_str(), d("gpu0").memory_mib, d("gpu0").uuid.as_str()),
            ("NVIDIA A100-SXM4-80GB", 81920, "GPU-stub-0")
        );
        assert_eq!((d("gpu2").numa_node, d("gpu3").index), (1, 3));
        assert!(inv.devices.iter().all(|d| d.healthy && d.vendor == "nvidia" && d.kind == "gpu"));
        // Direct NVLink pair: two links of 50 GB/s.
        assert_eq!(
            d("gpu0").links,
            vec![pb::PeerLink { peer: "gpu1".into(), kind: "nvlink".into(), bandwidth_mbps: 100_000 }]
        );
        assert_eq!((d("gpu0").peer_group, d("gpu1").peer_group), (Some(0), Some(0)));
        // Through the NVSwitches.
        assert_eq!(d("gpu2").links.iter().map(|l| l.peer.as_str()).collect::<Vec<_>>(), ["gpu3"]);
        assert_eq!((d("gpu2").peer_group, d("gpu3").peer_group), (Some(1), Some(1)));
        // MIG devices.
        let m = d("gpu1-mig2");
        assert_eq!((m.partition_of.as_str(), m.memory_mib, m.uuid.as_str()), ("gpu1", 40960, "MIG-stub-1-2"));
        assert!(m.links.is_empty() && m.peer_group.is_none());

        let r = p
            .reserve(pb::ReserveRequest {
                device_ids: vec!["gpu1-mig2".into(), "gpu3".into()],
                alloc_id: 1,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.env["CUDA_VISIBLE_DEVICES"], "MIG-stub-1-2,GPU-stub-3");
        let files: Vec<_> = r.device_files.iter().map(|f| f.host_path.as_str()).collect();
        assert_eq!(
            files,
            [
                "/dev/nvidia101",
                "/dev/nvidia103",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia-caps/nvidia-cap30",
                "/dev/nvidia-caps/nvidia-cap31"
            ]
        );
        // MIG device 0 (GPU instance 1) is not in the minors file: refused with the reason.
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["gpu1-mig0".into()], alloc_id: 1, ..Default::default() })
            .unwrap_err();
        assert!(e.message.contains("gpu101/gi1/access"), "{e}");
        for bad in ["gpu4", "gpu1-mig1", "cpu0"] {
            let e = p
                .reserve(pb::ReserveRequest { device_ids: vec![bad.into()], alloc_id: 1, ..Default::default() })
                .unwrap_err();
            assert_eq!(e.code, Code::NotFound, "{bad}: {e}");
        }

        let s = p.stats(pb::StatsRequest::default()).unwrap();
        assert_eq!(s.devices.len(), 4);
        let s2 = &s.devices[2];
        assert_eq!((s2.id.as_str(), s2.utilization_pct, s2.memory_used_mib, s2.ecc_errors), ("gpu2", 30.0, 1002, 7));
        assert!((s2.power_w - 123.456).abs() < 1e-9 && s2.temperature_c == 42.0);
        let s = p.stats(pb::StatsRequest { device_ids: vec!["gpu1-mig0".into()] }).unwrap();
        assert_eq!((s.devices[0].utilization_pct, s.devices[0].memory_used_mib), (0.0, 1001));

        // A device XID: an event, then unhealthy in fingerprint and refused by reserve.
        assert!(p.health_events().unwrap().events.is_empty());
        xid(&stub, 2, 79);
        let ev = next_events(&p);
        assert_eq!(ev.len(), 1);
        assert_eq!(
            (ev[0].device.as_str(), ev[0].healthy, ev[0].code, ev[0].reason.as_str(), ev[0].event_class),
            ("gpu2", false, 79, "XID 79", 2)
        );
        let inv = p.fingerprint().unwrap();
        let g2 = inv.devices.iter().find(|d| d.id == "gpu2").unwrap();
        assert_eq!((g2.healthy, g2.health_reason.as_str()), (false, "XID 79"));
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["gpu2".into()], alloc_id: 2, ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition);
        assert_eq!(p.stats(pb::StatsRequest { device_ids: vec!["gpu2".into()] }).unwrap().devices[0].xid_errors, 1);

        // reset (ABI 1.3): unimplemented without reset_command; with one, exit 0 clears the mark.
        let e = p.reset(pb::ResetRequest { device_id: "gpu2".into() }).unwrap_err();
        assert_eq!(e.code, Code::Unimplemented, "{e}");
        let failing = NvidiaPlugin { reset_command: vec!["/bin/false".into(), "{index}".into()], ..p };
        let e = failing.reset(pb::ResetRequest { device_id: "gpu2".into() }).unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition, "{e}");
        assert!(e.message.contains("/bin/false 2 exited"), "{e}");
        let e = failing.reset(pb::ResetRequest { device_id: "gpu1-mig0".into() }).unwrap_err();
        assert_eq!(e.code, Code::NotFound, "{e}");
        let p = NvidiaPlugin { reset_command: vec!["/bin/true".into(), "-i".into(), "{index}".into()], ..failing };
        p.reset(pb::ResetRequest { device_id: "gpu2".into() }).unwrap();
        assert!(p.fingerprint().unwrap().devices.iter().find(|d| d.id == "gpu2").unwrap().healthy);

        // An application XID leaves the device healthy.
        xid(&stub, 0, 13);
        let ev = next_events(&p);
        assert_eq!((ev[0].device.as_str(), ev[0].healthy, ev[0].code, ev[0].event_class), ("gpu0", true, 13, 1));
        assert!(p.fingerprint().unwrap().devices[0].healthy);

        // shutdown stops the watcher within one wait slice.
        let t = std::time::Instant::now();
        p.shutdown();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    /// A stand-in for `nvidia-cuda-mps-control`: `-d` makes the pipe directory's `control`
    /// file (as the daemon makes its pipe), a command on stdin fails without it (as the real
    /// client does when no daemon runs), and `quit` removes it. Every run is logged with its
    /// environment.
    const MPS_STUB: &str = r#"#!/bin/sh
log=LOG_FILE
if [ "$1" = "-d" ]; then
  echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY gpu=$CUDA_VISIBLE_DEVICES" >> "$log"
  [ -d "$CUDA_MPS_LOG_DIRECTORY" ] || exit 3
  : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read -r cmd
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
echo "$cmd pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$log"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"#;

    /// MPS isolation against the stub NVML and the stub control program: whole GPUs say their
    /// shares are enforced (the MIG-mode GPU does not), a share starts its GPU's daemon once,
    /// limits the task, and the last release stops it; without the program, shares are advisory.
    #[test]
    fn mps_daemon_per_shared_gpu() {
        use std::os::unix::fs::PermissionsExt as _;
        let stub = build_stub("mps");
        let control = stub.0.join("nvidia-cuda-mps-control");
        let log = stub.0.join("mps.log");
        std::fs::write(&control, MPS_STUB.replace("LOG_FILE", &log.display().to_string())).unwrap();
        std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir = stub.0.join("mps");
        let mut cfg = pb::PluginConfig::default();
        cfg.options.insert("nvml_lib".into(), stub.0.join("libnvidia-ml.so.1").display().to_string());
        cfg.options.insert("mps".into(), "on".into());
        cfg.options.insert("mps_control".into(), control.display().to_string());
        cfg.options.insert("mps_dir".into(), dir.display().to_string());
        let p = NvidiaPlugin::init(cfg.clone()).unwrap();
        let inv = p.fingerprint().unwrap();
        let iso: Vec<(&str, u32)> = inv.devices.iter().map(|d| (d.id.as_str(), d.share_isolation)).collect();
        assert_eq!(
            iso,
            [("gpu0", 1), ("gpu1", 0), ("gpu1-mig0", 0), ("gpu1-mig2", 0), ("gpu2", 1), ("gpu3", 1)],
            "{}",
            inv.message
        );
        assert!(inv.message.contains("enforced through MPS"), "{}", inv.message);
        let share = |rid: &str, dev: &str, milli: u32, memory_mib: u64| pb::ReserveRequest {
            device_ids: vec![dev.into()],
            alloc_id: 1,
            reservation_id: rid.into(),
            shares: vec![pb::ReserveShare { device_id: dev.into(), milli, memory_mib }],
        };
        let log_lines =
            || std::fs::read_to_string(&log).unwrap_or_default().lines().map(str::to_owned).collect::<Vec<_>>();
        let pipe0 = dir.join("gpu0/pipe").display().to_string();

        // The first share of gpu0 starts its daemon, on that GPU only, and limits the task.
        let r = p.reserve(share("a-1", "gpu0", 300, 20480)).unwrap();
        assert_eq!(r.env["CUDA_VISIBLE_DEVICES"], "GPU-stub-0");
        assert_eq!(r.env["CUDA_MPS_PIPE_DIRECTORY"], pipe0);
        assert_eq!(r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
        assert_eq!(r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=20480M");
        assert_eq!(
            r.mounts,
            vec![pb::Mount { host_path: pipe0.clone(), container_path: pipe0.clone(), read_only: false }]
        );
        let started = |l: &Vec<String>| l.iter().filter(|l| l.starts_with("start")).count();
        let l = log_lines();
        assert_eq!(started(&l), 1, "{l:?}");
        assert!(l[0].contains(&format!("pipe={pipe0}")) && l[0].ends_with("gpu=GPU-stub-0"), "{l:?}");
        // A second share of the same GPU and a repeat of the first: no new daemon.
        let r = p.reserve(share("b-1", "gpu0", 451, 0)).unwrap();
        assert_eq!(r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "46");
        assert!(!r.env.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
        p.reserve(share("a-1", "gpu0", 300, 20480)).unwrap();
        assert_eq!(started(&log_lines()), 1);
        let m = p.mps.enforcing().expect("MPS is on");
        assert_eq!(m.holders(), BTreeMap::from([("gpu0".to_owned(), 2)]));
        // A whole GPU and a MIG device get no MPS; a share of another GPU gets its own daemon.
        let r = p.reserve(share("c-1", "gpu3", 1000, 0)).unwrap();
        assert!(!r.env.contains_key("CUDA_MPS_PIPE_DIRECTORY"), "{:?}", r.env);
        p.reserve(share("d-1", "gpu2", 500, 0)).unwrap();
        assert_eq!(started(&log_lines()), 2);
        // Releasing one of gpu0's two holders keeps its daemon; the last stops it; an unknown id
        // changes nothing.
        p.release(pb::ReleaseRequest { reservation_id: "a-1".into(), ..Default::default() }).unwrap();
        assert!(!log_lines().iter().any(|l| l.starts_with("quit")));
        p.release(pb::ReleaseRequest { reservation_id: "b-1".into(), ..Default::default() }).unwrap();
        p.release(pb::ReleaseRequest { reservation_id: "zz".into(), device_ids: vec!["gpu2".into()], alloc_id: 9 })
            .unwrap();
        let quits: Vec<String> = log_lines().into_iter().filter(|l| l.starts_with("quit")).collect();
        assert_eq!(quits, [format!("quit pipe={pipe0}")]);
        assert_eq!(m.holders(), BTreeMap::from([("gpu2".to_owned(), 1)]));
        // A daemon that died is started again by the next share (a client finding no daemon
        // would run unlimited).
        std::fs::remove_file(dir.join("gpu2/pipe/control")).unwrap();
        p.reserve(share("e-1", "gpu2", 200, 0)).unwrap();
        assert_eq!(started(&log_lines()), 3, "gpu0 once, gpu2 twice: {:?}", log_lines());

        // A plugin restart finds gpu2's daemon running and adopts it when the agent repeats the
        // held reservations.
        drop(p);
        let p = NvidiaPlugin::init(cfg.clone()).unwrap();
        p.reserve(share("d-1", "gpu2", 500, 0)).unwrap();
        assert_eq!(started(&log_lines()), 3);

        // mps = on without the program fails init; auto says why shares are advisory; bad values
        // are named.
        let mut bad = cfg.clone();
        bad.options.insert("mps_control".into(), stub.0.join("missing").display().to_string());
        let e = NvidiaPlugin::init(bad.clone()).err().unwrap();
        assert!(e.message.contains("mps = on") && e.message.contains("not an executable file"), "{e}");
        bad.options.insert("mps".into(), "auto".into());
        let p = NvidiaPlugin::init(bad.clone()).unwrap();
        let inv = p.fingerprint().unwrap();
        assert!(inv.devices.iter().all(|d| d.share_isolation == 0));
        assert!(inv.message.contains("GPU shares are advisory"), "{}", inv.message);
        let r = p.reserve(share("f-1", "gpu0", 500, 0)).unwrap();
        assert!(!r.env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
        for (k, v, want) in [("mps", "yes", "expected auto, on or off"), ("mps_dir", "relative/dir", "absolute path")] {
            let mut c = cfg.clone();
            c.options.insert(k.into(), v.into());
            let e = NvidiaPlugin::init(c).err().unwrap();
            assert!(e.message.contains(&format!("option {k}")) && e.message.contains(want), "{e}");
        }
    }
}
