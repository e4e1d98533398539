//! suanli's CPU plugin: the host's schedulable CPU and memory, its sockets, cores and NUMA nodes,
//! and its CPU utilization. It has no devices (`Inventory.devices` is empty, vendor `cpu`).
//!
//! ```text
//!  fingerprint ─▶ /proc/cpuinfo ............ sockets, cores, logical CPUs
//!                 /proc/meminfo ............ MemTotal
//!                 /sys/devices/system/node . NUMA nodes (cpulist, meminfo)
//!                 /proc/self/status ........ affinity mask (Cpus_allowed_list)
//!                 /proc/self/cgroup + /sys/fs/cgroup/... cpu.max / cfs quota, memory.max / limit
//!  stats       ─▶ /proc/stat ............... busy share since the previous stats call
//! ```
//!
//! What it reports as schedulable: `cpu_milli` is 1000 × the CPUs in the process's affinity mask,
//! lowered to the cgroup CPU quota when one is set (the agent, and with it this plugin-host,
//! runs inside the slice its tasks get); `memory_mib` is MemTotal lowered to the cgroup memory
//! limit when one is set. Both cgroup v2 and v1 are read, walking from the process's cgroup up
//! to the mount root and taking the smallest limit.
//!
//! Every file is parsed by a pure function in [`parse`] that takes the text; odd content is an
//! error naming the file and the line, never a panic. The plugin option `root` (default `/`)
//! prefixes every path, for tests (fixture trees) and for agents that see the host's /proc and
//! /sys under another directory.

pub mod parse;

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use suanli_device_abi::{Code, DevicePlugin, PluginError, pb};

use parse::{CpuTimes, ParseError};

/// The largest /proc or sysfs file read (cpuinfo on a 1024-CPU host is about 1.5 MiB).
pub const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// The most NUMA nodes reported.
pub const MAX_NUMA_NODES: usize = 4096;

/// The CPU plugin instance.
pub struct CpuPlugin {
    /// Prefix of every path read (`/` in production).
    root: PathBuf,
    /// The /proc/stat sample of the previous stats call (zero before the first: "since boot").
    prev: Mutex<CpuTimes>,
}

impl CpuPlugin {
    /// An instance reading under `root` (normally `/`).
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into(), prev: Mutex::new(CpuTimes::default()) }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }
}

fn to_plugin(e: ParseError) -> PluginError {
    PluginError::new(Code::Unavailable, e.to_string())
}

/// Reads a whole (small) file as text, refusing files over [`MAX_FILE_BYTES`].
fn read_text(path: &Path) -> Result<String, ParseError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| ParseError {
        file: name.clone(),
        line: 0,
        message: format!("cannot open: {e}"),
    })?;
    let mut buf = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut buf).map_err(|e| ParseError {
        file: name.clone(),
        line: 0,
        message: format!("cannot read: {e}"),
    })?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        return Err(ParseError {
            file: name,
            line: 0,
            message: format!("larger than the limit of {MAX_FILE_BYTES} bytes"),
        });
    }
    String::from_utf8(buf).map_err(|e| ParseError { file: name, line: 0, message: format!("not UTF-8: {e}") })
}

/// Reads a file, or `None` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, ParseError> {
    if !path.exists() {
        return Ok(None);
    }
    read_text(path).map(Some)
}

/// The directories of a cgroup and its ancestors under `mount`, leaf first, that exist. When the
/// leaf does not exist under the mount (a cgroup namespace shows `/` as a deeper path), the
/// mount root itself stands for it.
fn cgroup_dirs(mount: &Path, path: &str) -> Vec<PathBuf> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty() && *p != "." && *p != "..").collect();
    let mut dirs = Vec::new();
    for k in (0..=parts.len()).rev() {
        let mut d = mount.to_path_buf();
        d.extend(&parts[..k]);
        if d.is_dir() {
            dirs.push(d);
        }
    }
    dirs
}

/// The smallest of the optional limits found in `dirs`.
fn min_limit(
    dirs: &[PathBuf],
    mut read: impl FnMut(&Path) -> Result<Option<u64>, ParseError>,
) -> Result<Option<u64>, ParseError> {
    let mut best: Option<u64> = None;
    for d in dirs {
        if let Some(v) = read(d)? {
            best = Some(best.map_or(v, |b| b.min(v)));
        }
    }
    Ok(best)
}

/// Host limits from the cgroups: (CPU millicores, memory MiB), `None` where unlimited.
fn cgroup_limits(root: &Path) -> Result<(Option<u64>, Option<u64>), ParseError> {
    let Some(text) = read_optional(&root.join("proc/self/cgroup"))? else { return Ok((None, None)) };
    let paths = parse::parse_proc_cgroup(&text, &root.join("proc/self/cgroup").display().to_string())?;
    let mut cpu: Option<u64> = None;
    let mut mem: Option<u64> = None;
    let fs = root.join("sys/fs/cgroup");
    let merge = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if let Some(p) = &paths.unified {
        // On a v1 host the unified hierarchy is mounted at /sys/fs/cgroup/unified without controllers.
        let mount = if fs.join("cgroup.controllers").exists() { fs.clone() } else { fs.join("unified") };
        let dirs = cgroup_dirs(&mount, p);
        cpu = merge(
            cpu,
            min_limit(&dirs, |d| {
                let f = d.join("cpu.max");
                read_optional(&f)?.map_or(Ok(None), |t| parse::parse_cpu_max(&t, &f.display().to_string()))
            })?,
        );
        mem = merge(
            mem,
            min_limit(&dirs, |d| {
                let f = d.join("memory.max");
                read_optional(&f)?.map_or(Ok(None), |t| parse::parse_memory_limit(&t, &f.display().to_string()))
            })?,
        );
    }
    if let Some(p) = &paths.cpu_v1 {
        let dirs = cgroup_dirs(&fs.join("cpu"), p);
        cpu = merge(
            cpu,
            min_limit(&dirs, |d| {
                let q = d.join("cpu.cfs_quota_us");
                let per = d.join("cpu.cfs_period_us");
                match (read_optional(&q)?, read_optional(&per)?) {
                    (Some(q_text), Some(p_text)) => parse::parse_cfs_quota(&q_text, &p_text, &q.display().to_string()),
                    _ => Ok(None),
                }
            })?,
        );
    }
    if let Some(p) = &paths.memory_v1 {
        let dirs = cgroup_dirs(&fs.join("memory"), p);
        mem = merge(
            mem,
            min_limit(&dirs, |d| {
                let f = d.join("memory.limit_in_bytes");
                read_optional(&f)?.map_or(Ok(None), |t| parse::parse_memory_limit(&t, &f.display().to_string()))
            })?,
        );
    }
    Ok((cpu, mem))
}

/// NUMA nodes from /sys/devices/system/node/node*/{cpulist,meminfo}; `None` when the directory
/// does not exist (a kernel without NUMA).
fn numa_nodes(root: &Path) -> Result<Option<Vec<pb::NumaNode>>, ParseError> {
    let dir = root.join("sys/devices/system/node");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(None) };
    let mut ids = BTreeSet::new();
    for e in entries {
        let e = e.map_err(|e| ParseError {
            file: dir.display().to_string(),
            line: 0,
            message: format!("cannot list: {e}"),
        })?;
        let name = e.file_name();
        let Some(id) = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        ids.insert(id);
        if ids.len() > MAX_NUMA_NODES {
            return Err(ParseError {
                file: dir.display().to_string(),
                line: 0,
                message: format!("more than the limit of {MAX_NUMA_NODES} NUMA nodes"),
            });
        }
    }
    if ids.is_empty() {
        return Ok(None);
    }
    let mut nodes = Vec::with_capacity(ids.len());
    for id in ids {
        let node = dir.join(format!("node{id}"));
        let cl = node.join("cpulist");
        let cpus = parse::parse_cpulist(&read_text(&cl)?, &cl.display().to_string())?;
        let mi = node.join("meminfo");
        let kib = parse::parse_meminfo_total_kib(&read_text(&mi)?, &mi.display().to_string())?;
        nodes.push(pb::NumaNode { id, cpus: parse::format_cpulist(&cpus), memory_mib: kib / 1024 });
    }
    Ok(Some(nodes))
}

/// Everything fingerprint reports, read under `root`.
pub fn read_inventory(root: &Path) -> Result<pb::Inventory, PluginError> {
    let ci = root.join("proc/cpuinfo");
    let topo =
        parse::parse_cpuinfo(&read_text(&ci).map_err(to_plugin)?, &ci.display().to_string()).map_err(to_plugin)?;
    let mi = root.join("proc/meminfo");
    let mem_kib = parse::parse_meminfo_total_kib(&read_text(&mi).map_err(to_plugin)?, &mi.display().to_string())
        .map_err(to_plugin)?;
    let total_mib = mem_kib / 1024;

    let st = root.join("proc/self/status");
    let allowed = match read_optional(&st).map_err(to_plugin)? {
        Some(t) => Some(parse::parse_status_cpus_allowed(&t, &st.display().to_string()).map_err(to_plugin)?),
        None => None,
    };
    let (cg_cpu, cg_mem) = cgroup_limits(root).map_err(to_plugin)?;

    let logical_allowed = allowed.as_ref().map_or(u64::from(topo.logical), |a| a.len() as u64);
    let mut cpu_milli = logical_allowed * 1000;
    if let Some(q) = cg_cpu {
        cpu_milli = cpu_milli.min(q);
    }
    let memory_mib = cg_mem.map_or(total_mib, |m| m.min(total_mib));

    let numa = match numa_nodes(root).map_err(to_plugin)? {
        Some(n) => n,
        None => {
            let all: BTreeSet<u32> = (0..topo.logical).collect();
            vec![pb::NumaNode { id: 0, cpus: parse::format_cpulist(&all), memory_mib: total_mib }]
        }
    };

    let mut message = format!(
        "{} logical CPUs, {} cores, {} socket(s), {} NUMA node(s), {total_mib} MiB",
        topo.logical,
        topo.cores,
        topo.sockets,
        numa.len()
    );
    if let Some(a) = &allowed {
        message.push_str(&format!("; affinity {}", parse::format_cpulist(a)));
    }
    if let Some(q) = cg_cpu {
        message.push_str(&format!("; cgroup cpu limit {q}m"));
    }
    if let Some(m) = cg_mem {
        message.push_str(&format!("; cgroup memory limit {m} MiB"));
    }

    Ok(pb::Inventory {
        vendor: "cpu".into(),
        fake: false,
        message,
        cpu_milli,
        memory_mib,
        devices: Vec::new(),
        numa_nodes: numa,
        sockets: topo.sockets,
        cores: topo.cores,
        driver_version: String::new(),
        topology: None,
    })
}

fn no_devices(ids: &[String]) -> Result<(), PluginError> {
    match ids.first() {
        None => Ok(()),
        Some(id) => Err(PluginError::not_found(format!("device {id:?}: the cpu plugin has no devices"))),
    }
}

impl DevicePlugin for CpuPlugin {
    const NAME: &'static str = "cpu";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: pb::PluginConfig) -> Result<Self, PluginError> {
        let root = config.options.get("root").map_or_else(|| PathBuf::from("/"), PathBuf::from);
        if !root.is_dir() {
            return Err(PluginError::invalid(format!("option root: {} is not a directory", root.display())));
        }
        Ok(Self::with_root(root))
    }

    fn fingerprint(&self) -> Result<pb::Inventory, PluginError> {
        read_inventory(&self.root)
    }

    fn reserve(&self, req: pb::ReserveRequest) -> Result<pb::Reservation, PluginError> {
        no_devices(&req.device_ids)?;
        Ok(pb::Reservation::default())
    }

    fn stats(&self, req: pb::StatsRequest) -> Result<pb::StatsResponse, PluginError> {
        no_devices(&req.device_ids)?;
        let f = self.path("proc/stat");
        let cur =
            parse::parse_proc_stat(&read_text(&f).map_err(to_plugin)?, &f.display().to_string()).map_err(to_plugin)?;
        let mut prev = self.prev.lock().map_err(|_| PluginError::internal("cpu stats lock poisoned"))?;
        let pct = parse::utilization_pct(*prev, cur);
        *prev = cur;
        Ok(pb::StatsResponse { devices: Vec::new(), cpu_utilization_pct: pct })
    }
}

suanli_device_abi::export_plugin!(CpuPlugin);

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_cpu_tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fixture tree under the system temp dir, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new() -> Self {
            static N: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "suanli-cpu-test-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Tree(dir)
        }
        fn file(&self, rel: &str, text: &str) -> &Self {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
            self
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn cpuinfo(sockets: u32, cores_per: u32, threads: u32) -> String {
        let mut s = String::new();
        let mut p = 0;
        for t in 0..threads {
            for sock in 0..sockets {
                for c in 0..cores_per {
                    let _ = t;
                    s.push_str(&format!("processor\t: {p}\nphysical id\t: {sock}\ncore id\t\t: {c}\n\n"));
                    p += 1;
                }
            }
        }
        s
    }

    fn plugin(tree: &Tree) -> CpuPlugin {
        let mut options = HashMap::new();
        options.insert("root".to_string(), tree.0.display().to_string());
        CpuPlugin::init(pb::PluginConfig {
            node_id: "n1".into(),
            config_path: String::new(),
            options: options.into_iter().collect(),
        })
        .unwrap()
    }

    fn two_socket_host() -> Tree {
        let t = Tree::new();
        t.file("proc/cpuinfo", &cpuinfo(2, 4, 2))
            .file("proc/meminfo", "MemTotal:       65536000 kB\nMemFree: 1 kB\n")
            .file("proc/self/status", "Name:\tx\nCpus_allowed_list:\t0-11\n")
            .file("proc/self/cgroup", "0::/agent.slice/agent\n")
            .file("sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
            .file("sys/fs/cgroup/agent.slice/cpu.max", "800000 100000\n")
            .file("sys/fs/cgroup/agent.slice/memory.max", "max\n")
            .file("sys/fs/cgroup/agent.slice/agent/cpu.max", "max 100000\n")
            .file("sys/fs/cgroup/agent.slice/agent/memory.max", "34359738368\n")
            .file("sys/devices/system/node/node0/cpulist", "0-3,8-11\n")
            .file("sys/devices/system/node/node0/meminfo", "Node 0 MemTotal:       32768000 kB\n")
            .file("sys/devices/system/node/node1/cpulist", "4-7,12-15\n")
            .file("sys/devices/system/node/node1/meminfo", "Node 1 MemTotal:       32768000 kB\n")
            .file("sys/devices/system/node/possible", "0-1\n")
            .file("proc/stat", "cpu  100 0 100 700 100 0 0 0 0 0\n");
        t
    }

    #[test]
    fn fingerprint_of_a_two_socket_numa_host_with_cgroup_v2_limits() {
        let t = two_socket_host();
        let inv = plugin(&t).fingerprint().unwrap();
        assert_eq!(inv.vendor, "cpu");
        assert!(!inv.fake);
        assert!(inv.devices.is_empty());
        assert_eq!((inv.sockets, inv.cores), (2, 8));
        // 12 CPUs in the affinity mask, lowered to the parent slice's 8-CPU quota.
        assert_eq!(inv.cpu_milli, 8000);
        // 64000 MiB of RAM, lowered to the 32 GiB memory.max of the leaf cgroup.
        assert_eq!(inv.memory_mib, 32768);
        assert_eq!(inv.numa_nodes.len(), 2);
        assert_eq!(inv.numa_nodes[1], pb::NumaNode { id: 1, cpus: "4-7,12-15".into(), memory_mib: 32000 });
        assert!(inv.message.contains("16 logical CPUs"), "{}", inv.message);
        assert!(inv.message.contains("cgroup cpu limit 8000m"), "{}", inv.message);
    }

    #[test]
    fn cgroup_v1_and_no_numa_directory() {
        let t = Tree::new();
        t.file("proc/cpuinfo", &cpuinfo(1, 2, 1))
            .file("proc/meminfo", "MemTotal: 2048000 kB\n")
            .file("proc/self/cgroup", "4:memory:/job\n2:cpu,cpuacct:/job\n0::/\n")
            .file("sys/fs/cgroup/cpu/job/cpu.cfs_quota_us", "150000\n")
            .file("sys/fs/cgroup/cpu/job/cpu.cfs_period_us", "100000\n")
            .file("sys/fs/cgroup/memory/job/memory.limit_in_bytes", "9223372036854771712\n")
            .file("sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n");
        let inv = plugin(&t).fingerprint().unwrap();
        // No status file: all logical CPUs; the v1 quota is 1.5 CPUs.
        assert_eq!(inv.cpu_milli, 1500);
        // The root memory cgroup's 1 GiB limit is the smallest on the path.
        assert_eq!(inv.memory_mib, 1024);
        assert_eq!(inv.numa_nodes, vec![pb::NumaNode { id: 0, cpus: "0-1".into(), memory_mib: 2000 }]);
    }

    #[test]
    fn odd_files_are_errors_naming_file_and_line() {
        let t = two_socket_host();
        t.file("proc/meminfo", "MemFree: 1 kB\nMemTotal: many kB\n");
        let e = plugin(&t).fingerprint().unwrap_err();
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("proc/meminfo line 2"), "{}", e.message);

        let t = two_socket_host();
        t.file("sys/devices/system/node/node1/cpulist", "4-x\n");
        let e = plugin(&t).fingerprint().unwrap_err();
        assert!(e.message.contains("node1/cpulist"), "{}", e.message);

        let t = Tree::new();
        let e = plugin(&t).fingerprint().unwrap_err();
        assert!(e.message.contains("proc/cpuinfo") && e.message.contains("cannot open"), "{}", e.message);
    }

    #[test]
    fn stats_report_the_busy_share_between_calls() {
        let t = two_socket_host();
        let p = plugin(&t);
        let s = p.stats(pb::StatsRequest::default()).unwrap();
        assert!((s.cpu_utilization_pct - 20.0).abs() < 1e-9, "since boot: {}", s.cpu_utilization_pct);
        t.file("proc/stat", "cpu  250 0 150 750 100 0 0 0 0 0\n");
        let s = p.stats(pb::StatsRequest::default()).unwrap();
        assert!((s.cpu_utilization_pct - 80.0).abs() < 1e-9, "delta: {}", s.cpu_utilization_pct);
        let e = p.stats(pb::StatsRequest { device_ids: vec!["gpu0".into()] }).unwrap_err();
        assert_eq!(e.code, Code::NotFound);
    }

    #[test]
    fn reserve_has_nothing_to_inject() {
        let t = two_socket_host();
        let p = plugin(&t);
        assert_eq!(p.reserve(pb::ReserveRequest::default()).unwrap(), pb::Reservation::default());
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["x".into()], alloc_id: 1, ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code, Code::NotFound);
    }

    #[test]
    fn init_refuses_a_missing_root() {
        let mut options = std::collections::HashMap::new();
        options.insert("root".to_string(), "/nonexistent/suanli".to_string());
        let e = CpuPlugin::init(pb::PluginConfig { options: options.into_iter().collect(), ..Default::default() })
            .err()
            .unwrap();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("option root"));
    }

    #[test]
    fn this_machine() {
        let p = CpuPlugin::with_root("/");
        let inv = p.fingerprint().unwrap();
        assert!(inv.cpu_milli >= 1 && inv.memory_mib > 0 && inv.sockets >= 1 && inv.cores >= 1, "{inv:?}");
        let s = p.stats(pb::StatsRequest::default()).unwrap();
        assert!((0.0..=100.0).contains(&s.cpu_utilization_pct));
    }
}
