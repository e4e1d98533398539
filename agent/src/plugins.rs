//! Device plugins: loading (permission check, then a supervised `plugin-host` child each), the
//! node's device table built from their inventories, device health, stats, and reservations.
//!
//! ```text
//!  plugin_dir/*.so ─check_file_permissions─▶ plugin_sha256 (when set) ─▶ PluginProcess::start ─▶ fingerprint ─▶ devices
//!        monitor (per plugin): state changes, health events ~1/s, stats, fingerprint ~30 s
//!        Down ─▶ its devices unhealthy ("plugin X is down: …") ─▶ heartbeat now
//!        Up again + fingerprint ok ─▶ healthy again (re-register if the inventory changed)
//!  inventories' topology (rack, block, NVLink domain) ─▶ topology.suanli.io/* node labels
//!  health event classes (ABI 1.3) ─▶ remediation: tell the task, reset, quarantine ([`remedy`])
//! ```
//!
//! A plugin must never take the agent down: every call goes through the supervisor, which
//! runs the library in a child process with deadlines and restarts it with backoff.

mod remedy;

use crate::config::AgentConfig;
pub(crate) use remedy::DEVICE_EVENTS_FILE;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use suanli_device_host::supervisor::{HostError, Options, PluginProcess, PluginState};
use suanli_device_host::{Code, pb};
use suanli_model::{Device, DeviceKind, Health, ShareIsolation};
use tokio::sync::{Notify, watch};

/// What the agent knows about one plugin right now.
#[derive(Debug, Default)]
struct View {
    /// The latest successful fingerprint.
    inventory: Option<pb::Inventory>,
    /// Up and fingerprinted since its last (re)start.
    up: bool,
    /// Why it is not up (empty before the first fingerprint).
    down_reason: String,
    /// Devices a health event marked unhealthy since the last fingerprint, with the reason.
    events: BTreeMap<String, String>,
    /// Latest stats.
    stats: Vec<pb::DeviceStats>,
}

/// One loaded plugin.
pub(crate) struct Plugin {
    /// The library's file stem, e.g. `libsuanli_plugin_fake`.
    pub stem: String,
    proc: PluginProcess,
    view: Mutex<View>,
}

impl Plugin {
    fn view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The node labels of an inventory's `topology`, in the order of [`pb::NodeTopology`]'s fields
/// (rack, block, nvlink_domain): where the node sits in the datacenter network. The scheduler
/// keeps a multi-node gang in the fewest blocks and NVLink domains; the rack is for operators
/// and job constraints.
pub(crate) const TOPOLOGY_LABELS: [&str; 3] =
    ["topology.suanli.io/rack", "topology.suanli.io/block", "topology.suanli.io/nvlink-domain"];

// The longest topology value taken from a plugin (the agent config's label value limit; `suanli
// plugin check` holds plugins to it).
use suanli_device_host::check::MAX_TOPOLOGY_VALUE;

/// The longest reason string (characters) the agent keeps for a plugin that is down or a
/// device that is quarantined or recovering.
const MAX_REASON_CHARS: usize = 512;

/// `reason` cut to [`MAX_REASON_CHARS`].
fn cut_reason(reason: &str) -> String {
    reason.chars().take(MAX_REASON_CHARS).collect()
}

/// Adds `t`'s values to `labels` under [`TOPOLOGY_LABELS`], keeping a value already there (an
/// earlier plugin's); an empty value is unknown and adds nothing. A value that is not 1 to
/// [`MAX_TOPOLOGY_VALUE`] bytes of printable ASCII without spaces (what every label check
/// accepts) is not added: it is returned with its label, for a warning.
fn merge_topology(labels: &mut BTreeMap<String, String>, t: &pb::NodeTopology) -> Vec<(&'static str, String)> {
    let mut refused = Vec::new();
    for (label, value) in TOPOLOGY_LABELS.into_iter().zip([&t.rack, &t.block, &t.nvlink_domain]) {
        if value.is_empty() || labels.contains_key(label) {
            continue;
        }
        if value.len() > MAX_TOPOLOGY_VALUE || !value.bytes().all(|b| b.is_ascii_graphic()) {
            refused.push((label, value.clone()));
            continue;
        }
        labels.insert(label.to_owned(), value.clone());
    }
    refused
}

/// A device of this node and where it comes from.
#[derive(Debug, Clone)]
pub(crate) struct LocalDevice {
    /// As registered (health included).
    pub device: Device,
    /// Why it is unhealthy (empty when healthy).
    pub reason: String,
    /// Index of the owning plugin.
    pub owner: usize,
}

/// A plugin library the agent did not load, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The library's file stem.
    pub stem: String,
    /// The library.
    pub path: PathBuf,
    /// Why (names the file and the check it failed).
    pub reason: String,
}

/// What loading the configured plugins gave ([`check_plugins`]).
#[derive(Debug, Clone, Default)]
pub struct PluginCheck {
    /// File stems of the plugins whose plugin-host child loaded the library and said hello, in
    /// load order.
    pub loaded: Vec<String>,
    /// The libraries refused (permissions, `plugin_sha256`, a failed start).
    pub refused: Vec<Refused>,
}

/// Loads the plugins `cfg` names exactly as `suanli agent` does at start (permission and
/// `plugin_sha256` checks, a supervised plugin-host child each, one fingerprint), says which
/// loaded and which were refused, and stops them again.
pub async fn check_plugins(cfg: &AgentConfig) -> PluginCheck {
    let p = Plugins::load(cfg, &cfg.node_id).await;
    let check = PluginCheck { loaded: p.names(), refused: p.refused.clone() };
    p.shutdown().await;
    check
}

/// The SHA-256 of a file as 64 lowercase hex digits, read in 64 KiB chunks.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => ctx.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(ctx.finish().as_ref().iter().map(|b| format!("{b:02x}")).collect())
}

/// Refuses a library whose SHA-256 is not in `allowed` (the `plugin_sha256` allow-list;
/// compared without regard to case). Checked before the library is loaded anywhere.
fn check_sha256(path: &Path, allowed: &[String]) -> Result<(), String> {
    let digest = file_sha256(path).map_err(|e| {
        format!("{}: cannot read it to check its SHA-256 against the agent config's plugin_sha256: {e}", path.display())
    })?;
    if allowed.iter().any(|a| a.eq_ignore_ascii_case(&digest)) {
        Ok(())
    } else {
        Err(format!(
            "{}: its SHA-256 {digest} is not listed in the agent config's plugin_sha256 ({} digests); \
             add it there to allow this library",
            path.display(),
            allowed.len()
        ))
    }
}

/// The loaded plugins and the node's devices.
pub(crate) struct Plugins {
    list: Vec<Arc<Plugin>>,
    /// The libraries refused at load.
    refused: Vec<Refused>,
    /// Health or inventory changed: heartbeat (or re-register) now.
    pub changed: Arc<Notify>,
    /// Set when an inventory changed shape (devices added, removed or changed).
    pub inventory_changed: Arc<AtomicBool>,
    /// How often to collect stats (the heartbeat interval).
    pub stats_every_ms: Arc<AtomicU64>,
    warned: Mutex<BTreeSet<String>>,
    /// Reservations granted and not yet released (ABI 1.2), by reservation id: what a restarted
    /// plugin host is told again, and what `release` undoes. One per live task at most.
    held: Mutex<BTreeMap<String, Held>>,
    /// Device remediation: recoveries, quarantine, counters.
    remedy: Mutex<remedy::Remedies>,
    /// Where the quarantine is kept.
    quarantine_path: PathBuf,
    /// Allocation directories (`<data_dir>/allocs`), where tasks are told of device events.
    allocs_dir: PathBuf,
}

/// A reservation the agent holds on its plugins.
#[derive(Debug, Clone)]
struct Held {
    alloc_id: u64,
    shares: Vec<pb::ReserveShare>,
}

/// The reservation id of a task (ABI 1.2): unique on the node, the same for every reserve of
/// the task (a repeat after a restart is recognized by it).
pub(crate) fn reservation_id(alloc_id: u64, epoch: u64) -> String {
    format!("{alloc_id}-{epoch}")
}

/// The short name of a plugin file stem: `libsuanli_plugin_fake` → `fake`.
pub(crate) fn short_name(stem: &str) -> &str {
    stem.strip_prefix("libsuanli_plugin_").or_else(|| stem.strip_prefix("lib")).unwrap_or(stem)
}

fn matches(stem: &str, wanted: &str) -> bool {
    stem == wanted || short_name(stem) == wanted
}

/// The libraries to load: `*.so` in the plugin directory (sorted), filtered by `plugins`.
fn candidates(cfg: &AgentConfig) -> Vec<(String, PathBuf)> {
    let dir = &cfg.plugin_dir;
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) => {
            tracing::warn!(plugin_dir = %dir.display(), error = %e, "cannot read the plugin directory: no device plugins");
            return Vec::new();
        }
    };
    let mut found: Vec<(String, PathBuf)> = rd
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "so"))
        .filter_map(|p| Some((p.file_stem()?.to_string_lossy().into_owned(), p)))
        .collect();
    found.sort();
    if let Some(list) = &cfg.plugins {
        for w in list {
            if !found.iter().any(|(s, _)| matches(s, w)) {
                tracing::error!(plugin = %w, plugin_dir = %dir.display(), "configured plugin not found in the plugin directory");
            }
        }
        found.retain(|(s, _)| list.iter().any(|w| matches(s, w)));
    }
    found
}

fn settings<'a>(cfg: &'a AgentConfig, stem: &str) -> Option<&'a crate::config::PluginSettings> {
    cfg.plugin_config.get(stem).or_else(|| cfg.plugin_config.get(short_name(stem)))
}

/// The supervisor's options from the agent's configuration.
pub(crate) fn options(cfg: &AgentConfig) -> Options {
    let mut o = Options {
        call_timeout: AgentConfig::ms(cfg.plugin_call_timeout_ms),
        fingerprint_timeout: AgentConfig::ms(cfg.plugin_fingerprint_timeout_ms),
        backoff_min: AgentConfig::ms(cfg.plugin_backoff_min_ms),
        backoff_max: AgentConfig::ms(cfg.plugin_backoff_max_ms),
        ..Options::default()
    };
    if !cfg.host_cmd.is_empty() {
        o.host_cmd = cfg.host_cmd.iter().map(Into::into).collect();
    }
    o
}

/// Whether an error means the plugin is broken (its devices cannot be trusted): a crash, a
/// deadline, a protocol error, a panic caught at the boundary (INTERNAL) or UNAVAILABLE.
fn broken(e: &HostError) -> bool {
    match e {
        HostError::Plugin(pe) => matches!(pe.code, Code::Internal | Code::Unavailable),
        _ => true,
    }
}

fn parse_kind(k: &str) -> Option<DeviceKind> {
    match k.to_ascii_lowercase().as_str() {
        "gpu" => Some(DeviceKind::Gpu),
        "npu" => Some(DeviceKind::Npu),
        _ => None,
    }
}

/// What the plugins returned for a task's devices.
#[derive(Debug, Clone, Default)]
pub(crate) struct Reserved {
    /// Environment for the task.
    pub env: BTreeMap<String, String>,
    /// Device files (host paths) a container runtime would bind into the task, in order,
    /// without repeats.
    pub device_files: Vec<String>,
}

impl Plugins {
    /// Loads every candidate library; one that is refused (permissions, load error, ABI
    /// mismatch, init failure) is logged and skipped. Each loaded plugin is fingerprinted once.
    pub async fn load(cfg: &AgentConfig, node_id: &str) -> Plugins {
        let opts = options(cfg);
        let mut list = Vec::new();
        let mut refused = Vec::new();
        for (stem, path) in candidates(cfg) {
            if let Err(e) = suanli_device_host::host::check_file_permissions(&path) {
                tracing::error!(plugin = %stem, path = %path.display(), error = %e, "REFUSING device plugin: unsafe file permissions");
                refused.push(Refused { stem, path, reason: e.to_string() });
                continue;
            }
            if let Some(allowed) = &cfg.plugin_sha256
                && let Err(reason) = check_sha256(&path, allowed)
            {
                tracing::error!(plugin = %stem, path = %path.display(), error = %reason, "REFUSING device plugin: not in plugin_sha256");
                refused.push(Refused { stem, path, reason });
                continue;
            }
            let s = settings(cfg, &stem);
            let pc = pb::PluginConfig {
                node_id: node_id.to_owned(),
                config_path: s
                    .and_then(|s| s.config_path.as_ref())
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                options: s.map(|s| s.options.clone().into_iter().collect()).unwrap_or_default(),
            };
            match PluginProcess::start(path.clone(), pc, opts.clone()).await {
                Ok(proc) => {
                    let h = proc.hello();
                    tracing::info!(plugin = %stem, name = %h.plugin_name, version = %h.plugin_version,
                        abi = %format!("{}.{}", h.abi_major, h.abi_minor), "device plugin loaded");
                    list.push(Arc::new(Plugin { stem, proc, view: Mutex::new(View::default()) }));
                }
                Err(e) => {
                    tracing::error!(plugin = %stem, path = %path.display(), error = %e, "REFUSING device plugin: it did not start");
                    refused.push(Refused { stem, path, reason: e.to_string() });
                }
            }
        }
        let p = Plugins {
            list,
            refused,
            changed: Arc::new(Notify::new()),
            inventory_changed: Arc::new(AtomicBool::new(false)),
            stats_every_ms: Arc::new(AtomicU64::new(1000)),
            warned: Mutex::new(BTreeSet::new()),
            held: Mutex::new(BTreeMap::new()),
            remedy: Mutex::new(remedy::Remedies {
                quarantined: remedy::load_quarantine(&remedy::quarantine_path(&cfg.data_dir)),
                ..Default::default()
            }),
            quarantine_path: remedy::quarantine_path(&cfg.data_dir),
            allocs_dir: cfg.allocs_dir(),
        };
        let q = p.lock_remedy().quarantined.clone();
        for (device, q) in q {
            tracing::error!(device = %device, reason = %q.reason, since_unix_s = q.since_unix_s,
                "device quarantined (from quarantine.json): out of service until an operator clears it");
        }
        for pl in &p.list {
            match fingerprint(pl, &p.inventory_changed).await {
                Ok(()) if pl.view().inventory.is_some() => {
                    let v = pl.view();
                    let n = v.inventory.as_ref().map_or(0, |i| i.devices.len());
                    let fake = v.inventory.as_ref().is_some_and(|i| i.fake);
                    let inv = v.inventory.clone();
                    drop(v);
                    if let Some(inv) = inv {
                        p.forget_replaced(&inv);
                    }
                    pl.view().up = true;
                    tracing::info!(plugin = %pl.stem, devices = n, fake, "device plugin fingerprinted");
                }
                Ok(()) => {}
                Err(e) => p.mark_down(pl, &e),
            }
        }
        p
    }

    /// Names of the loaded plugins.
    pub fn names(&self) -> Vec<String> {
        self.list.iter().map(|p| p.stem.clone()).collect()
    }

    fn warn_once(&self, key: String, f: impl FnOnce()) {
        let mut w = self.warned.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if w.len() < 10_000 && w.insert(key) {
            f();
        }
    }

    /// Every device of the node with its current health. Ids are unique: a device id offered
    /// by a second plugin is refused (logged once).
    pub fn devices(&self) -> Vec<LocalDevice> {
        let mut out: Vec<LocalDevice> = Vec::new();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let remedy = self.lock_remedy();
        for (i, p) in self.list.iter().enumerate() {
            let v = p.view();
            let Some(inv) = &v.inventory else {
                continue;
            };
            for d in &inv.devices {
                if let Some(&owner) = seen.get(&d.id) {
                    if owner != i {
                        let other = self.list[owner].stem.clone();
                        self.warn_once(format!("dup:{}:{}", p.stem, d.id), || {
                            tracing::error!(plugin = %p.stem, device = %d.id, owner = %other,
                                "refusing a device: another plugin already offers this device id");
                        });
                    }
                    continue;
                }
                let Some(kind) = parse_kind(&d.kind) else {
                    self.warn_once(format!("kind:{}:{}", p.stem, d.id), || {
                        tracing::warn!(plugin = %p.stem, device = %d.id, kind = %d.kind, "ignoring a device of a kind other than gpu or npu");
                    });
                    continue;
                };
                seen.insert(d.id.clone(), i);
                let reason = if let Some(r) = Self::remedy_reason(&remedy, &d.id) {
                    r
                } else if !v.up {
                    if v.down_reason.is_empty() {
                        format!("plugin {} is down", p.stem)
                    } else {
                        format!("plugin {} is down: {}", p.stem, v.down_reason)
                    }
                } else if !d.healthy {
                    if d.health_reason.is_empty() {
                        "reported unhealthy by its plugin".into()
                    } else {
                        d.health_reason.clone()
                    }
                } else if let Some(r) = v.events.get(&d.id) {
                    r.clone()
                } else {
                    String::new()
                };
                let device = Device {
                    id: d.id.clone(),
                    kind,
                    model: d.model.clone(),
                    memory_mib: d.memory_mib,
                    health: if reason.is_empty() { Health::Healthy } else { Health::Unhealthy },
                    numa: d.numa_node,
                    peer_group: d.peer_group,
                    partition_of: if d.partition_of.is_empty() { None } else { Some(d.partition_of.clone()) },
                    share_isolation: if d.share_isolation == 1 {
                        ShareIsolation::Enforced
                    } else {
                        ShareIsolation::Advisory
                    },
                };
                out.push(LocalDevice { device, reason, owner: i });
            }
        }
        out
    }

    /// CPU and memory from a host-resource plugin (the first inventory that has them).
    pub fn host_resources(&self) -> (Option<u64>, Option<u64>) {
        let mut cpu = None;
        let mut mem = None;
        for p in &self.list {
            if let Some(inv) = &p.view().inventory {
                if cpu.is_none() && inv.cpu_milli > 0 {
                    cpu = Some(inv.cpu_milli);
                }
                if mem.is_none() && inv.memory_mib > 0 {
                    mem = Some(inv.memory_mib);
                }
            }
        }
        (cpu, mem)
    }

    /// The node's place in the datacenter network as its plugins report it: the labels
    /// `TOPOLOGY_LABELS`, each with the first non-empty value across the loaded plugins (in
    /// load order, from each one's latest inventory). A value that is not a safe label value is
    /// passed over (logged once). The agent config's own `labels` override these.
    pub fn topology(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for p in &self.list {
            let v = p.view();
            let Some(t) = v.inventory.as_ref().and_then(|i| i.topology.as_ref()) else {
                continue;
            };
            for (label, value) in merge_topology(&mut out, t) {
                self.warn_once(format!("topology:{}:{label}", p.stem), || {
                    let shown: String = value.chars().take(80).collect();
                    tracing::warn!(plugin = %p.stem, label, value = ?shown,
                        "ignoring a topology value: a label value must be 1 to 253 bytes of printable ASCII without spaces");
                });
            }
        }
        out
    }

    /// Latest stats of every device this node registered.
    pub fn stats(&self) -> Vec<pb::DeviceStats> {
        let owned: BTreeMap<String, usize> = self.devices().into_iter().map(|d| (d.device.id, d.owner)).collect();
        let mut out = Vec::new();
        for (i, p) in self.list.iter().enumerate() {
            for s in &p.view().stats {
                if owned.get(&s.id) == Some(&i) {
                    out.push(s.clone());
                }
            }
        }
        out
    }

    /// Asks the plugins owning the devices of `shares` what a task using them needs (the merged
    /// env), telling each its share and the reservation id. The reservation is held (told again
    /// to a restarted plugin host) until [`release`](Self::release), whether or not every plugin
    /// granted it: releasing what a plugin never granted is harmless by contract.
    pub async fn reserve(
        &self,
        reservation_id: &str,
        alloc_id: u64,
        shares: &[pb::ReserveShare],
    ) -> Result<Reserved, String> {
        let devs = self.devices();
        let mut by_owner: BTreeMap<usize, Vec<pb::ReserveShare>> = BTreeMap::new();
        {
            let r = self.lock_remedy();
            if let Some((id, why)) =
                shares.iter().find_map(|s| Self::remedy_reason(&r, &s.device_id).map(|w| (&s.device_id, w)))
            {
                return Err(format!("device {id:?} is out of service: {why}"));
            }
        }
        for s in shares {
            let d = devs
                .iter()
                .find(|d| d.device.id == s.device_id)
                .ok_or_else(|| format!("device {:?} is not on this node", s.device_id))?;
            by_owner.entry(d.owner).or_default().push(s.clone());
        }
        self.lock_held().insert(reservation_id.to_owned(), Held { alloc_id, shares: shares.to_vec() });
        let mut env = BTreeMap::new();
        let mut device_files = Vec::new();
        for (owner, shares) in by_owner {
            let p = &self.list[owner];
            let ids: Vec<String> = shares.iter().map(|s| s.device_id.clone()).collect();
            let req = pb::ReserveRequest {
                device_ids: ids.clone(),
                alloc_id,
                reservation_id: reservation_id.to_owned(),
                shares,
            };
            let r = p.proc.reserve(req).await.map_err(|e| format!("reserve of {ids:?} by plugin {}: {e}", p.stem))?;
            if !r.mounts.is_empty() {
                tracing::debug!(plugin = %p.stem, alloc = alloc_id, "mounts are for container runtimes; a plain process sees the host's");
            }
            for f in r.device_files {
                if !device_files.contains(&f.host_path) {
                    device_files.push(f.host_path);
                }
            }
            for (k, v) in r.env {
                if let Some(old) = env.insert(k.clone(), v.clone())
                    && old != v
                {
                    tracing::warn!(alloc = alloc_id, var = %k, "two plugins set the same variable; the later one wins");
                }
            }
        }
        Ok(Reserved { env, device_files })
    }

    fn lock_held(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Held>> {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Releases a reservation on every plugin that owns one of its devices (ABI 1.2 plugins; a
    /// 1.1 plugin has nothing to release) and forgets it. Nothing happens for an id not held.
    /// Failures are logged: the task is gone whatever the plugin says.
    pub async fn release(&self, reservation_id: &str) {
        let Some(h) = self.lock_held().remove(reservation_id) else { return };
        let devs = self.devices();
        let mut by_owner: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for s in &h.shares {
            if let Some(d) = devs.iter().find(|d| d.device.id == s.device_id) {
                by_owner.entry(d.owner).or_default().push(s.device_id.clone());
            }
        }
        for (owner, device_ids) in by_owner {
            let p = &self.list[owner];
            let req =
                pb::ReleaseRequest { reservation_id: reservation_id.to_owned(), device_ids, alloc_id: h.alloc_id };
            if let Err(e) = p.proc.release(req).await {
                tracing::warn!(plugin = %p.stem, reservation = reservation_id, error = %e, "release of a reservation failed");
            }
        }
    }

    /// Tells a plugin whose host (re)started every reservation still held on its devices (a
    /// repeat of the same reservation id, which the plugin answers as the first time).
    async fn rereserve(&self, p: &Plugin, owner: usize) {
        if !p.proc.offers("release") {
            return; // a 1.1 plugin holds nothing to restore
        }
        let devs = self.devices();
        let held: Vec<(String, Held)> = self.lock_held().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (id, h) in held {
            let shares: Vec<pb::ReserveShare> = h
                .shares
                .iter()
                .filter(|s| devs.iter().any(|d| d.device.id == s.device_id && d.owner == owner))
                .cloned()
                .collect();
            if shares.is_empty() {
                continue;
            }
            let req = pb::ReserveRequest {
                device_ids: shares.iter().map(|s| s.device_id.clone()).collect(),
                alloc_id: h.alloc_id,
                reservation_id: id.clone(),
                shares,
            };
            match p.proc.reserve(req).await {
                Ok(_) => {
                    tracing::info!(plugin = %p.stem, reservation = %id, "reservation told again to the restarted plugin")
                }
                Err(e) => {
                    tracing::warn!(plugin = %p.stem, reservation = %id, error = %e, "a restarted plugin refused a held reservation")
                }
            }
        }
    }

    /// Starts one monitor per plugin; they end when `stop` turns true.
    pub fn spawn_monitors(self: &Arc<Self>, cfg: &AgentConfig, stop: watch::Receiver<bool>) {
        for p in &self.list {
            let me = self.clone();
            let p = p.clone();
            let poll = AgentConfig::ms(cfg.health_poll_interval_ms);
            let refp = AgentConfig::ms(cfg.fingerprint_interval_ms);
            let stop = stop.clone();
            tokio::spawn(async move { me.monitor(p, poll, refp, stop).await });
        }
    }

    async fn monitor(&self, p: Arc<Plugin>, poll: Duration, refingerprint: Duration, mut stop: watch::Receiver<bool>) {
        let mut states = p.proc.subscribe();
        let mut tick = tokio::time::interval(poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_fp = Instant::now();
        let mut last_stats: Option<Instant> = None;
        loop {
            tokio::select! {
                r = stop.changed() => if r.is_err() || *stop.borrow() { return },
                r = states.changed() => {
                    if r.is_err() {
                        return;
                    }
                    let down = match &*states.borrow_and_update() {
                        PluginState::Down { reason } => Some(reason.clone()),
                        PluginState::Up => None,
                    };
                    if let Some(reason) = down {
                        self.mark_down(&p, &reason);
                    }
                    continue;
                }
                _ = tick.tick() => {}
            }
            if !p.proc.is_up() {
                if p.view().up {
                    self.mark_down(&p, "its host process is restarting");
                }
                continue;
            }
            // One probe per tick: a plugin that is not up becomes up only when a fresh
            // fingerprint, its health events and its stats all succeed in the same probe, so a
            // plugin failing on some call does not flap between healthy and unhealthy.
            let was_up = p.view().up;
            let mut failure: Option<String> = None;
            if !was_up || last_fp.elapsed() >= refingerprint {
                last_fp = Instant::now();
                if let Err(e) = fingerprint(&p, &self.inventory_changed).await {
                    failure = Some(e);
                }
            }
            if failure.is_none() && last_fp.elapsed() < poll {
                // Just fingerprinted: a card replaced under a quarantined id is back.
                let inv = p.view().inventory.clone();
                if let Some(inv) = inv {
                    self.forget_replaced(&inv);
                }
            }
            if failure.is_none() {
                match p.proc.health_events().await {
                    Ok(ev) => self.apply_events(&p, ev),
                    Err(e) if broken(&e) => failure = Some(e.to_string()),
                    Err(e) => tracing::debug!(plugin = %p.stem, error = %e, "health events"),
                }
            }
            if failure.is_none() && was_up {
                self.advance_recoveries(&p).await;
            }
            let every = Duration::from_millis(self.stats_every_ms.load(Ordering::Relaxed));
            if failure.is_none() && (!was_up || last_stats.is_none_or(|t| t.elapsed() >= every)) {
                last_stats = Some(Instant::now());
                match p.proc.stats(pb::StatsRequest { device_ids: Vec::new() }).await {
                    Ok(s) => p.view().stats = s.devices.into_iter().take(4096).collect(),
                    // Telemetry that is not ready (UNAVAILABLE) says nothing of the devices'
                    // health: their stats are stale for this probe, the devices stay as they are.
                    Err(HostError::Plugin(pe)) if pe.code == Code::Unavailable => {
                        tracing::debug!(plugin = %p.stem, error = %pe, "stats unavailable; devices unchanged");
                        p.view().stats.clear();
                    }
                    Err(e) if broken(&e) => failure = Some(e.to_string()),
                    Err(e) => tracing::debug!(plugin = %p.stem, error = %e, "stats"),
                }
            }
            match failure {
                Some(reason) => self.mark_down(&p, &reason),
                None if !was_up => {
                    if let Some(owner) = self.list.iter().position(|x| Arc::ptr_eq(x, &p)) {
                        self.rereserve(&p, owner).await;
                    }
                    p.view().up = true;
                    tracing::info!(plugin = %p.stem, restarts = p.proc.restarts(), "device plugin healthy again");
                    self.changed.notify_one();
                }
                None => {}
            }
        }
    }

    fn apply_events(&self, p: &Plugin, ev: pb::HealthEvents) {
        if ev.events.is_empty() {
            return;
        }
        let ev: Vec<pb::HealthEvent> = ev.events.into_iter().filter(|e| !self.remedy_event(p, e)).collect();
        let mut v = p.view();
        for e in ev {
            if e.healthy {
                v.events.remove(&e.device);
            } else if v.events.len() < 4096 {
                let reason = if e.reason.is_empty() {
                    format!("health event from plugin {} (code {})", p.stem, e.code)
                } else {
                    e.reason
                };
                v.events.insert(e.device, reason);
            }
        }
        drop(v);
        self.changed.notify_one();
    }

    fn mark_down(&self, p: &Plugin, reason: &str) {
        let mut v = p.view();
        let first = v.up || v.down_reason.is_empty();
        v.up = false;
        v.down_reason = cut_reason(reason);
        v.stats.clear();
        drop(v);
        if first {
            tracing::error!(plugin = %p.stem, reason = %reason, restarts = p.proc.restarts(),
                "device plugin down: its devices are reported unhealthy");
            self.changed.notify_one();
        }
    }

    /// Stops every plugin host.
    pub async fn shutdown(&self) {
        for p in &self.list {
            p.proc.shutdown().await;
        }
    }
}

/// A device's id, kind, model, memory, NUMA node, island and parent: what registration
/// depends on (not health).
type Shape = (String, String, String, u64, u32, Option<u32>, String);

/// The parts of an inventory registration depends on (not health).
fn shape(inv: &pb::Inventory) -> Vec<Shape> {
    inv.devices
        .iter()
        .map(|d| {
            (
                d.id.clone(),
                d.kind.clone(),
                d.model.clone(),
                d.memory_mib,
                d.numa_node,
                d.peer_group,
                d.partition_of.clone(),
            )
        })
        .collect()
}

/// Fingerprints `p` and keeps the new inventory (health events reset); the error says why it
/// failed when the plugin is broken (crash, deadline, internal error, vendor library gone).
async fn fingerprint(p: &Plugin, inventory_changed: &AtomicBool) -> Result<(), String> {
    match p.proc.fingerprint().await {
        Ok(mut inv) => {
            inv.devices.truncate(1024);
            let mut v = p.view();
            let changed = v.inventory.as_ref().is_none_or(|old| {
                shape(old) != shape(&inv)
                    || old.cpu_milli != inv.cpu_milli
                    || old.memory_mib != inv.memory_mib
                    || old.topology != inv.topology
            });
            v.inventory = Some(inv);
            v.events.clear();
            if changed {
                inventory_changed.store(true, Ordering::SeqCst);
            }
            Ok(())
        }
        Err(e) => {
            tracing::warn!(plugin = %p.stem, error = %e, "fingerprint failed");
            if broken(&e) { Err(e.to_string()) } else { Ok(()) }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Reservations across a plugin-host restart, with the real fake plugin library (enforcing
    //! shares) under the real `suanli-plugin-host` (both built by `cargo build --workspace`).

    use super::*;

    fn target_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug")
    }

    fn share(milli: u32) -> Vec<pb::ReserveShare> {
        vec![pb::ReserveShare { device_id: "gpu0".into(), milli, memory_mib: 0 }]
    }

    #[test]
    fn topology_labels_take_the_first_plugin_value_of_each() {
        let t = |rack: &str, block: &str, nvlink_domain: &str| pb::NodeTopology {
            rack: rack.into(),
            block: block.into(),
            nvlink_domain: nvlink_domain.into(),
        };
        let mut labels = BTreeMap::new();
        assert!(merge_topology(&mut labels, &t("", "su-1", "")).is_empty());
        // A later plugin fills what the first left unknown, and changes nothing it set.
        let refused = merge_topology(&mut labels, &t("r 7", "su-9", "nvl72-a"));
        assert_eq!(refused, [("topology.suanli.io/rack", "r 7".to_owned())]);
        assert!(merge_topology(&mut labels, &t("r7", "", "")).is_empty());
        let want: BTreeMap<String, String> = [
            ("topology.suanli.io/block", "su-1"),
            ("topology.suanli.io/nvlink-domain", "nvl72-a"),
            ("topology.suanli.io/rack", "r7"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(labels, want);
        let mut long = BTreeMap::new();
        assert_eq!(merge_topology(&mut long, &t(&"r".repeat(254), "", "")).len(), 1);
        assert!(long.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_reservations_are_told_again_to_a_restarted_plugin_host() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let plugins = dir.path().join("plugins");
        std::fs::create_dir(&plugins).expect("mkdir");
        let so = plugins.join("libsuanli_plugin_fake.so");
        let built = target_dir().join("libsuanli_plugin_fake.so");
        let built = if built.exists() { built } else { target_dir().join("deps/libsuanli_plugin_fake.so") };
        std::fs::copy(&built, &so).expect("the fake plugin (cargo build --workspace)");
        std::fs::set_permissions(&so, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::set_permissions(&plugins, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let host = target_dir().join("suanli-plugin-host");
        let fake_cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/plugins/fake-8gpu.toml");
        let journal = dir.path().join("calls.jsonl");
        let toml = format!(
            "insecure = true\nnode_id = \"n1\"\nplugin_dir = {plugins:?}\nplugins = [\"fake\"]\nhost_cmd = [{host:?}]\n\
             health_poll_interval_ms = 50\nplugin_backoff_min_ms = 20\nplugin_backoff_max_ms = 200\n\
             [plugin_config.fake]\nconfig_path = {cfg:?}\n[plugin_config.fake.options]\nenforce_shares = \"true\"\njournal = {journal:?}\n",
            plugins = plugins.display().to_string(),
            host = host.display().to_string(),
            cfg = fake_cfg.display().to_string(),
            journal = journal.display().to_string(),
        );
        let cfg = AgentConfig::from_toml(&toml).expect("config");
        let p = Arc::new(Plugins::load(&cfg, "n1").await);
        assert_eq!(p.names(), ["libsuanli_plugin_fake"]);
        let (stop_tx, stop_rx) = watch::channel(false);
        p.spawn_monitors(&cfg, stop_rx);

        p.reserve("7-1", 7, &share(600)).await.expect("a 600-milli share");
        let e = p.reserve("8-1", 8, &share(500)).await.expect_err("past the device");
        assert!(e.contains("600 milli already held"), "{e}");
        p.release("8-1").await;

        // The host dies; the restarted one starts with nothing held, and is told 7-1 again.
        let proc = p.list[0].proc.clone();
        assert!(proc.kill_host("test"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while proc.restarts() == 0 || !p.list[0].view().up {
            assert!(Instant::now() < deadline, "the plugin did not come back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let e = p.reserve("9-1", 9, &share(500)).await.expect_err("7-1 is held again after the restart");
        assert!(e.contains("600 milli already held"), "{e}");
        p.release("9-1").await;
        p.release("7-1").await;
        p.reserve("9-1", 9, &share(500)).await.expect("free once 7-1 is released");
        let calls = std::fs::read_to_string(&journal).expect("journal");
        let again = calls
            .lines()
            .filter(|l| l.contains("\"reservation_id\":\"7-1\"") && l.contains("\"call\":\"reserve\""))
            .count();
        assert_eq!(again, 2, "7-1 reserved, then told again after the restart:\n{calls}");
        stop_tx.send_replace(true);
        p.shutdown().await;
    }
}
