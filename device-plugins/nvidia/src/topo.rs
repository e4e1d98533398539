//! Pure helpers of the NVIDIA plugin: device ids, PCI bus ids, the NVLink graph (links and
//! islands), XID classes and error chains. No NVML here, so all of it is unit-tested without a GPU.

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;

use suanli_device_abi::{EventClass, pb};

/// The id of physical GPU `index`: `gpu0`.
pub fn gpu_id(index: u32) -> String {
    format!("gpu{index}")
}

/// The id of MIG device `mig` of GPU `index`: `gpu0-mig1`.
pub fn mig_id(index: u32, mig: u32) -> String {
    format!("gpu{index}-mig{mig}")
}

/// Parses an id made by [`gpu_id`] or [`mig_id`]: (GPU index, MIG index).
pub fn parse_id(id: &str) -> Option<(u32, Option<u32>)> {
    let rest = id.strip_prefix("gpu")?;
    let (gpu, mig) = match rest.split_once("-mig") {
        Some((g, m)) => (g, Some(m)),
        None => (rest, None),
    };
    let num = |s: &str| -> Option<u32> {
        // Canonical decimal only ("gpu01" is not gpu1), so ids round-trip.
        if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    Some((
        num(gpu)?,
        match mig {
            Some(m) => Some(num(m)?),
            None => None,
        },
    ))
}

/// Normalizes a PCI bus id (`00000000:3B:00.0` from NVML, `0000:3b:00.0` from sysfs) to the
/// sysfs form; `None` when it does not parse.
pub fn normalize_bus_id(s: &str) -> Option<String> {
    let s = s.trim().trim_end_matches('\0');
    let mut parts = s.split(':');
    let (domain, bus, devfn) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(d), Some(b), Some(df), None) => (d, b, df),
        (Some(b), Some(df), None, None) => ("0", b, df),
        _ => return None,
    };
    let (dev, func) = devfn.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if domain > 0xffff || dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// Bidirectional bandwidth of one NVLink of a given version, in MB/s (0 when unknown):
/// NVLink 1 20 GB/s per direction; 2, 3 and 4 25 GB/s; 5 50 GB/s.
pub fn nvlink_bandwidth_mbps(version: u32) -> u64 {
    match version {
        1 => 40_000,
        2..=4 => 50_000,
        5 => 100_000,
        _ => 0,
    }
}

/// One GPU's active NVLinks, as NVML reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLinks {
    /// The GPU's id.
    pub id: String,
    /// Its PCI bus id (normalized).
    pub bus_id: String,
    /// Each active link: the remote end's PCI bus id (normalized) and the link's NVLink version.
    pub links: Vec<(String, u32)>,
}

/// The NVLink topology of the node: per GPU id, its peer links and its island.
///
/// A link's remote end is either another GPU (direct NVLink) or something else, in practice an
/// NVSwitch: GPUs reach every GPU connected to the same switch fabric. Islands are the connected
/// components of the graph of GPUs and remote ends; each island with at least two GPUs gets a
/// `peer_group` number, in the order of its first GPU. The bandwidth to a direct peer is the sum
/// of the links to it; to a peer through switches it is the sum of the GPU's own switch links.
pub fn nvlink_topology(gpus: &[GpuLinks]) -> BTreeMap<String, (Vec<pb::PeerLink>, Option<u32>)> {
    let by_bus: BTreeMap<&str, usize> = gpus.iter().enumerate().map(|(i, g)| (g.bus_id.as_str(), i)).collect();
    // Union-find over GPUs (0..n) and non-GPU remote ends (n..).
    let mut others: BTreeMap<&str, usize> = BTreeMap::new();
    for g in gpus {
        for (remote, _) in &g.links {
            if !by_bus.contains_key(remote.as_str()) {
                let n = gpus.len() + others.len();
                others.entry(remote.as_str()).or_insert(n);
            }
        }
    }
    let mut parent: Vec<usize> = (0..gpus.len() + others.len()).collect();
    fn find(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    for (i, g) in gpus.iter().enumerate() {
        for (remote, _) in &g.links {
            let j = by_bus.get(remote.as_str()).copied().or_else(|| others.get(remote.as_str()).copied());
            if let Some(j) = j {
                let (a, b) = (find(&mut parent, i), find(&mut parent, j));
                if a != b {
                    parent[a] = b;
                }
            }
        }
    }
    let roots: Vec<usize> = (0..gpus.len()).map(|i| find(&mut parent, i)).collect();
    let mut members: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, r) in roots.iter().enumerate() {
        members.entry(*r).or_default().push(i);
    }
    // Number the islands of two or more GPUs by their first GPU's position.
    let mut firsts: Vec<(usize, usize)> =
        members.iter().filter(|(_, m)| m.len() > 1).map(|(r, m)| (m[0], *r)).collect();
    firsts.sort();
    let group_of: BTreeMap<usize, u32> =
        firsts.iter().enumerate().map(|(n, (_, r))| (*r, u32::try_from(n).unwrap_or(u32::MAX))).collect();

    let mut out = BTreeMap::new();
    for (i, g) in gpus.iter().enumerate() {
        let mut direct: BTreeMap<usize, u64> = BTreeMap::new();
        let mut switched_bw = 0u64;
        let mut uses_switch = false;
        for (remote, version) in &g.links {
            let bw = nvlink_bandwidth_mbps(*version);
            match by_bus.get(remote.as_str()) {
                Some(&j) if j != i => *direct.entry(j).or_default() += bw,
                Some(_) => {}
                None => {
                    uses_switch = true;
                    switched_bw += bw;
                }
            }
        }
        let mut peers: BTreeSet<usize> = direct.keys().copied().collect();
        if uses_switch {
            // Every GPU in the same island that also reaches a switch.
            for &j in &members[&roots[i]] {
                if j != i && gpus[j].links.iter().any(|(r, _)| !by_bus.contains_key(r.as_str())) {
                    peers.insert(j);
                }
            }
        }
        let links = peers
            .into_iter()
            .map(|j| pb::PeerLink {
                peer: gpus[j].id.clone(),
                kind: "nvlink".into(),
                bandwidth_mbps: direct.get(&j).copied().unwrap_or(0).max(if uses_switch { switched_bw } else { 0 }),
            })
            .collect();
        out.insert(g.id.clone(), (links, group_of.get(&roots[i]).copied()));
    }
    out
}

/// The remediation class of an XID, from the "Resolution Bucket (Immediate Action)" column of
/// NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, Ampere and newer):
/// - RESTART_APP: an application's fault, the device stays in service: 8 GPU stopped processing
///   (idle timeout), 11 invalid push buffer, 13 graphics engine exception, 31 GPU memory page
///   fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor exception,
///   69 graphics engine class error, 94 contained ECC error, 109 context switch timeout;
/// - a failure the device cannot recover from by a reset: 64 (the row remapper or page
///   retirement failed to record: the memory is no longer protected): fatal, quarantined;
/// - everything else (RESET_GPU, RESTART_BM and codes this table does not know, e.g. 48 double-bit
///   ECC, 63 row remap pending, 74 NVLink, 79 fallen off the bus, 95 uncontained ECC, 119/120
///   GSP): recoverable. The agent resets the device once nothing holds it and quarantines it when
///   resets keep failing (a 79 whose reset cannot reach the device ends there).
pub fn xid_class(code: u64) -> EventClass {
    match code {
        8 | 11 | 13 | 31 | 43 | 45 | 68 | 69 | 94 | 109 => EventClass::Application,
        64 => EventClass::Fatal,
        _ => EventClass::Recoverable,
    }
}

/// Whether an XID is an application's fault (the device stays healthy).
pub fn xid_is_application_error(code: u64) -> bool {
    xid_class(code) == EventClass::Application
}

/// An error and its whole `source()` chain: `a: b: c` (libloading's Display alone hides the
/// dlopen message).
pub fn error_chain(e: &dyn Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    let mut depth = 0;
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
        depth += 1;
        if depth > 16 {
            break;
        }
    }
    s
}

/// The sysfs directory of a PCI device (`/sys/bus/pci/devices/0000:3b:00.0`), whose `numa_node`
/// file gives the NUMA node when NVML cannot.
pub fn sysfs_pci_dir(bus_id: &str) -> Option<std::path::PathBuf> {
    normalize_bus_id(bus_id).map(|b| std::path::Path::new("/sys/bus/pci/devices").join(b))
}

/// Parses sysfs `numa_node` (`-1` when the platform has no NUMA information: node 0).
pub fn parse_numa_node(text: &str) -> Option<u32> {
    let v: i64 = text.trim().parse().ok()?;
    Some(u32::try_from(v).unwrap_or(0))
}

/// Where the driver lists the minor numbers of the MIG capability device files.
pub const MIG_MINORS_FILE: &str = "/proc/driver/nvidia-caps/mig-minors";
/// The directory of the MIG capability device files (`nvidia-cap<minor>`).
pub const CAPS_DIR: &str = "/dev/nvidia-caps";

/// Parses `/proc/driver/nvidia-caps/mig-minors`: lines `<capability> <minor>` such as
/// `gpu0/gi1/access 12` and `gpu0/gi1/ci0/access 13` (`gpu<N>` is the GPU's device minor).
/// Lines that do not parse are skipped.
pub fn parse_mig_minors(text: &str) -> BTreeMap<String, u32> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (cap, minor) = (it.next()?, it.next()?);
            Some((cap.to_owned(), minor.parse().ok()?))
        })
        .collect()
}

/// The capability device files a task needs to use the MIG device of GPU instance `gi` and
/// compute instance `ci` on the GPU with device minor `gpu_minor`: its GI and CI access files.
pub fn mig_cap_files(minors: &BTreeMap<String, u32>, gpu_minor: u32, gi: u32, ci: u32) -> Result<[String; 2], String> {
    let get = |cap: String| {
        minors
            .get(&cap)
            .map(|m| format!("{CAPS_DIR}/nvidia-cap{m}"))
            .ok_or_else(|| format!("{MIG_MINORS_FILE} has no {cap:?}"))
    };
    Ok([get(format!("gpu{gpu_minor}/gi{gi}/access"))?, get(format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"))?])
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_nvidia_topo_tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        assert_eq!(parse_id(&gpu_id(3)), Some((3, None)));
        assert_eq!(parse_id(&mig_id(7, 2)), Some((7, Some(2))));
        for bad in ["gpu", "gpu-1", "gpu01", "gpux", "cpu0", "gpu0-mig", "gpu0-migx", "gpu0-mig01", "gpu99999999999"] {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn bus_ids() {
        assert_eq!(normalize_bus_id("00000000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(normalize_bus_id("0000:3b:00.0\0\0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(normalize_bus_id("3B:00.1").as_deref(), Some("0000:3b:00.1"));
        assert_eq!(normalize_bus_id("zz"), None);
        assert_eq!(normalize_bus_id("0000:3b:40.0"), None);
        assert_eq!(
            sysfs_pci_dir("00000000:18:00.0").unwrap(),
            std::path::Path::new("/sys/bus/pci/devices/0000:18:00.0")
        );
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node("-1\n"), Some(0));
        assert_eq!(parse_numa_node("x"), None);
    }

    fn gpu(i: u32, links: &[(&str, u32)]) -> GpuLinks {
        GpuLinks {
            id: gpu_id(i),
            bus_id: format!("0000:{:02x}:00.0", 0x10 + i),
            links: links.iter().map(|(r, v)| (r.to_string(), *v)).collect(),
        }
    }

    #[test]
    fn direct_nvlink_pairs_make_islands() {
        // gpu0 <-> gpu1 with 2 NVLink-3 links, gpu2 <-> gpu3 with 1, gpu4 alone.
        let gpus = vec![
            gpu(0, &[("0000:11:00.0", 3), ("0000:11:00.0", 3)]),
            gpu(1, &[("0000:10:00.0", 3), ("0000:10:00.0", 3)]),
            gpu(2, &[("0000:13:00.0", 2)]),
            gpu(3, &[("0000:12:00.0", 2)]),
            gpu(4, &[]),
        ];
        let t = nvlink_topology(&gpus);
        assert_eq!(
            t["gpu0"].0,
            vec![pb::PeerLink { peer: "gpu1".into(), kind: "nvlink".into(), bandwidth_mbps: 100_000 }]
        );
        assert_eq!(t["gpu0"].1, Some(0));
        assert_eq!(t["gpu1"].1, Some(0));
        assert_eq!(t["gpu2"].1, Some(1));
        assert_eq!(t["gpu3"].0[0].bandwidth_mbps, 50_000);
        assert_eq!(t["gpu4"], (vec![], None));
    }

    #[test]
    fn nvswitch_fabric_is_one_island() {
        // 4 GPUs, each with one link to each of 2 switches (bus ids that are not GPUs).
        let sw = [("0000:a0:00.0", 4), ("0000:a1:00.0", 4)];
        let gpus: Vec<_> = (0..4).map(|i| gpu(i, &sw)).collect();
        let t = nvlink_topology(&gpus);
        for i in 0..4 {
            let (links, group) = &t[&gpu_id(i)];
            assert_eq!(*group, Some(0));
            assert_eq!(links.len(), 3);
            assert!(links.iter().all(|l| l.bandwidth_mbps == 100_000));
        }
    }

    #[test]
    fn xid_classes() {
        assert!(xid_is_application_error(13));
        assert!(xid_is_application_error(43));
        assert!(!xid_is_application_error(79));
        assert!(!xid_is_application_error(48));
    }

    #[test]
    fn error_chains_show_the_cause() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("dlopen failed")
            }
        }
        impl Error for Outer {
            fn source(&self) -> Option<&(dyn Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::other("libnvidia-ml.so.1: cannot open shared object file"));
        assert_eq!(error_chain(&e), "dlopen failed: libnvidia-ml.so.1: cannot open shared object file");
    }

    #[test]
    fn mig_minors_name_the_capability_files() {
        let text = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu1/gi2/access 66\ngpu1/gi2/ci0/access 67\ngpu1/gi2/ci1/access 68\nbroken line\n";
        let m = parse_mig_minors(text);
        assert_eq!(m.len(), 7);
        assert_eq!(
            mig_cap_files(&m, 1, 2, 1).unwrap(),
            ["/dev/nvidia-caps/nvidia-cap66".to_owned(), "/dev/nvidia-caps/nvidia-cap68".to_owned()]
        );
        let e = mig_cap_files(&m, 1, 3, 0).unwrap_err();
        assert!(e.contains("gpu1/gi3/access"), "{e}");
    }
}
