//! The fake plugin's device file: `[[devices]]` entries and `[[groups]]` shorthands, validated
//! into a flat, ordered list of [`FakeDevice`]s, and an optional `[topology]` table (the node's
//! rack, network block and NVLink domain). Pure: [`parse_config`] takes the text.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use suanli_device_abi::pb;

/// The most devices one config may describe.
pub const MAX_DEVICES: usize = 256;
/// The longest device id.
pub const MAX_ID_LEN: usize = 64;
/// The longest model, vendor or uuid string.
pub const MAX_NAME_LEN: usize = 128;
/// The largest device memory (16 TiB).
pub const MAX_MEMORY_MIB: u64 = 16 * 1024 * 1024;
/// The highest NUMA node id.
pub const MAX_NUMA: u32 = 4095;
/// The most links one device may list.
pub const MAX_LINKS: usize = 256;
/// The largest link bandwidth (100 TB/s).
pub const MAX_BANDWIDTH_MBPS: u64 = 100_000_000;
/// The most MIG-style partitions one GPU may be split into (an A100/H100 has 7 slices).
pub const MAX_MIG_SLICES: u32 = 7;
/// The largest config or fault file.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
/// The longest `[topology]` value (`rack`, `block`, `nvlink_domain`): a short label value.
pub const MAX_TOPOLOGY_LEN: usize = 63;

/// What a fake device pretends to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A GPU: reserve sets `CUDA_VISIBLE_DEVICES`; links default to `nvlink`.
    Gpu,
    /// An NPU: reserve sets `ASCEND_RT_VISIBLE_DEVICES`; links default to `hccs`.
    Npu,
}

impl Kind {
    fn parse(s: &str, field: &str) -> Result<Kind, String> {
        match s {
            "gpu" => Ok(Kind::Gpu),
            "npu" => Ok(Kind::Npu),
            _ => Err(format!("{field} is {s:?}, expected \"gpu\" or \"npu\"")),
        }
    }

    /// `gpu` or `npu`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Gpu => "gpu",
            Kind::Npu => "npu",
        }
    }

    fn default_link(self) -> &'static str {
        match self {
            Kind::Gpu => "nvlink",
            Kind::Npu => "hccs",
        }
    }
}

/// One validated fake device.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeDevice {
    /// Unique id (what the scheduler places on).
    pub id: String,
    /// GPU or NPU.
    pub kind: Kind,
    /// Model name, e.g. `A100-80G`.
    pub model: String,
    /// The vendor field of the device (`fake` unless the config's `vendor` says otherwise).
    pub vendor: String,
    /// Device memory.
    pub memory_mib: u64,
    /// NUMA node.
    pub numa: u32,
    /// NVLink / HCCS island.
    pub peer_group: Option<u32>,
    /// The index reserve puts in `CUDA_VISIBLE_DEVICES` / `ASCEND_RT_VISIBLE_DEVICES`.
    pub index: u32,
    /// A fake UUID.
    pub uuid: String,
    /// Fast links to peers.
    pub links: Vec<pb::PeerLink>,
    /// The parent GPU of a MIG-style partition (`[[mig]]`); none for a whole device.
    pub partition_of: Option<String>,
}

/// A validated config.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeConfig {
    /// Devices in config order (explicit `[[devices]]` first, then each group's).
    pub devices: Vec<FakeDevice>,
    /// The `fault_file` entry as written (relative paths are relative to the config's directory).
    pub fault_file: Option<String>,
    /// The `[topology]` table: where the node sits in the datacenter network (reported in the
    /// inventory's `topology`); `None` when the file has no such table or it names nothing.
    pub topology: Option<pb::NodeTopology>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    vendor: Option<String>,
    fault_file: Option<String>,
    #[serde(default)]
    devices: Vec<RawDevice>,
    #[serde(default)]
    groups: Vec<RawGroup>,
    #[serde(default)]
    mig: Vec<RawMig>,
    topology: Option<RawTopology>,
}

/// `[topology]`: the node's rack, network block and multi-node NVLink domain, each optional.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTopology {
    rack: Option<String>,
    block: Option<String>,
    nvlink_domain: Option<String>,
}

/// `[[mig]]`: GPU `gpu` (an id defined above) is also offered as `slices` partitions
/// `<gpu>-mig0`… (`partition_of` = `gpu`), as the NVIDIA plugin reports a GPU in MIG mode.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMig {
    gpu: String,
    slices: u32,
    model: Option<String>,
    memory_mib: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    id: String,
    kind: String,
    model: String,
    memory_mib: u64,
    #[serde(default)]
    numa: u32,
    peer_group: Option<u32>,
    index: Option<u32>,
    uuid: Option<String>,
    #[serde(default)]
    links: Vec<RawLink>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    peer: String,
    kind: Option<String>,
    #[serde(default)]
    bandwidth_mbps: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    count: u32,
    kind: String,
    model: String,
    memory_mib: u64,
    id_prefix: Option<String>,
    numa: Option<u32>,
    numa_nodes: Option<u32>,
    peer_group: Option<u32>,
    island_size: Option<u32>,
    link_kind: Option<String>,
    #[serde(default)]
    link_bandwidth_mbps: u64,
}

fn check_id(id: &str, field: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(format!("{field} {id:?} must be 1 to {MAX_ID_LEN} characters"));
    }
    if !id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
        return Err(format!("{field} {id:?} may contain only ASCII letters, digits, '-', '_' and '.'"));
    }
    Ok(())
}

/// A `[topology]` value: 1 to [`MAX_TOPOLOGY_LEN`] bytes of ASCII letters, digits, '.', '_' and
/// '-' (a valid node label value everywhere).
fn check_topology_value(v: &str, field: &str) -> Result<(), String> {
    if v.is_empty() || v.len() > MAX_TOPOLOGY_LEN {
        return Err(format!(
            "{field} {v:?} must be 1 to {MAX_TOPOLOGY_LEN} characters (leave the key out when it is unknown)"
        ));
    }
    if !v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
        return Err(format!("{field} {v:?} may contain only ASCII letters, digits, '-', '_' and '.'"));
    }
    Ok(())
}

/// Validates `[topology]`; `None` when it names nothing.
fn parse_topology(raw: Option<RawTopology>) -> Result<Option<pb::NodeTopology>, String> {
    let Some(t) = raw else {
        return Ok(None);
    };
    let mut out = pb::NodeTopology::default();
    for (value, field, slot) in [
        (t.rack, "topology.rack", &mut out.rack),
        (t.block, "topology.block", &mut out.block),
        (t.nvlink_domain, "topology.nvlink_domain", &mut out.nvlink_domain),
    ] {
        if let Some(v) = value {
            check_topology_value(&v, field)?;
            *slot = v;
        }
    }
    if out == pb::NodeTopology::default() { Ok(None) } else { Ok(Some(out)) }
}

fn check_name(s: &str, field: &str) -> Result<(), String> {
    if s.trim().is_empty() || s.len() > MAX_NAME_LEN || s.chars().any(char::is_control) {
        return Err(format!("{field} {s:?} must be 1 to {MAX_NAME_LEN} printable characters"));
    }
    Ok(())
}

fn check_memory(m: u64, field: &str) -> Result<(), String> {
    if m == 0 || m > MAX_MEMORY_MIB {
        return Err(format!("{field} is {m}, expected 1 to {MAX_MEMORY_MIB}"));
    }
    Ok(())
}

fn check_numa(n: u32, field: &str) -> Result<(), String> {
    if n > MAX_NUMA {
        return Err(format!("{field} is {n}, the limit is {MAX_NUMA}"));
    }
    Ok(())
}

fn check_bandwidth(b: u64, field: &str) -> Result<(), String> {
    if b > MAX_BANDWIDTH_MBPS {
        return Err(format!("{field} is {b}, the limit is {MAX_BANDWIDTH_MBPS}"));
    }
    Ok(())
}

fn link_kind(k: &str, field: &str) -> Result<String, String> {
    match k {
        "nvlink" | "hccs" | "pcie" | "xgmi" => Ok(k.to_string()),
        _ => Err(format!("{field} is {k:?}, expected nvlink, hccs, pcie or xgmi")),
    }
}

/// Parses and validates a config; errors name the field (`groups[1].island_size`) and the limit.
pub fn parse_config(text: &str) -> Result<FakeConfig, String> {
    let raw: RawConfig = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
    let vendor = raw.vendor.unwrap_or_else(|| "fake".to_string());
    check_name(&vendor, "vendor")?;
    let topology = parse_topology(raw.topology)?;
    if raw.devices.is_empty() && raw.groups.is_empty() {
        return Err("no devices: add [[devices]] or [[groups]] entries".into());
    }

    // Islands from `island_size` get ids after every explicit peer_group.
    let mut next_island = raw
        .devices
        .iter()
        .filter_map(|d| d.peer_group)
        .chain(raw.groups.iter().filter_map(|g| g.peer_group))
        .max()
        .map_or(0, |m| m.saturating_add(1));

    let mut devices: Vec<FakeDevice> = Vec::new();
    let mut next_index: BTreeMap<Kind, u32> = BTreeMap::new();
    // Links named in [[devices]] entries, resolved once every id is known.
    let mut pending_links: Vec<(usize, String, Vec<RawLink>)> = Vec::new();

    for (i, d) in raw.devices.into_iter().enumerate() {
        let f = |name: &str| format!("devices[{i}].{name}");
        check_id(&d.id, &f("id"))?;
        let kind = Kind::parse(&d.kind, &f("kind"))?;
        check_name(&d.model, &f("model"))?;
        check_memory(d.memory_mib, &f("memory_mib"))?;
        check_numa(d.numa, &f("numa"))?;
        if d.links.len() > MAX_LINKS {
            return Err(format!("{} has {} entries, the limit is {MAX_LINKS}", f("links"), d.links.len()));
        }
        let index = match d.index {
            Some(x) => x,
            None => *next_index.get(&kind).unwrap_or(&0),
        };
        next_index.insert(kind, index.saturating_add(1).max(*next_index.get(&kind).unwrap_or(&0)));
        let uuid = match d.uuid {
            Some(u) => {
                check_name(&u, &f("uuid"))?;
                u
            }
            None => format!("FAKE-{}", d.id),
        };
        pending_links.push((devices.len(), f("links"), d.links));
        devices.push(FakeDevice {
            id: d.id,
            kind,
            model: d.model,
            vendor: vendor.clone(),
            memory_mib: d.memory_mib,
            numa: d.numa,
            peer_group: d.peer_group,
            index,
            uuid,
            links: Vec::new(),
            partition_of: None,
        });
        if devices.len() > MAX_DEVICES {
            return Err(format!("more than the limit of {MAX_DEVICES} devices"));
        }
    }

    let mut next_suffix: BTreeMap<String, u32> = BTreeMap::new();
    for (g, grp) in raw.groups.into_iter().enumerate() {
        let f = |name: &str| format!("groups[{g}].{name}");
        let kind = Kind::parse(&grp.kind, &f("kind"))?;
        if grp.count == 0 || grp.count as usize > MAX_DEVICES {
            return Err(format!("{} is {}, expected 1 to {MAX_DEVICES}", f("count"), grp.count));
        }
        if devices.len() + grp.count as usize > MAX_DEVICES {
            return Err(format!(
                "{} brings the total to {}, the limit is {MAX_DEVICES} devices",
                f("count"),
                devices.len() + grp.count as usize
            ));
        }
        check_name(&grp.model, &f("model"))?;
        check_memory(grp.memory_mib, &f("memory_mib"))?;
        check_bandwidth(grp.link_bandwidth_mbps, &f("link_bandwidth_mbps"))?;
        let lk = match &grp.link_kind {
            Some(k) => link_kind(k, &f("link_kind"))?,
            None => kind.default_link().to_string(),
        };
        let prefix = grp.id_prefix.clone().unwrap_or_else(|| kind.as_str().to_string());
        check_id(&format!("{prefix}0"), &f("id_prefix"))?;
        if grp.numa.is_some() && grp.numa_nodes.is_some() {
            return Err(format!("{} and {} are exclusive: give one", f("numa"), f("numa_nodes")));
        }
        if let Some(n) = grp.numa {
            check_numa(n, &f("numa"))?;
        }
        if let Some(n) = grp.numa_nodes
            && (n == 0 || n > grp.count || n > MAX_NUMA + 1)
        {
            return Err(format!("{} is {n}, expected 1 to count ({})", f("numa_nodes"), grp.count));
        }
        if grp.peer_group.is_some() && grp.island_size.is_some() {
            return Err(format!("{} and {} are exclusive: give one", f("peer_group"), f("island_size")));
        }
        if let Some(s) = grp.island_size {
            if s == 0 || s > grp.count {
                return Err(format!("{} is {s}, expected 1 to count ({})", f("island_size"), grp.count));
            }
            if grp.count % s != 0 {
                return Err(format!("{} is {s}, which does not divide count ({})", f("island_size"), grp.count));
            }
        }
        let first = devices.len();
        let islands_base = next_island;
        for k in 0..grp.count {
            let suffix = next_suffix.entry(prefix.clone()).or_insert(0);
            let id = format!("{prefix}{suffix}");
            *suffix += 1;
            let index = *next_index.get(&kind).unwrap_or(&0);
            next_index.insert(kind, index.saturating_add(1));
            let numa = match (grp.numa, grp.numa_nodes) {
                (Some(n), _) => n,
                // Spread evenly in order: with 8 devices on 2 nodes, 0-3 on node 0 and 4-7 on node 1.
                (None, Some(n)) => k * n / grp.count,
                (None, None) => 0,
            };
            let peer_group = match (grp.peer_group, grp.island_size) {
                (Some(p), _) => Some(p),
                (None, Some(s)) => {
                    let island = islands_base.saturating_add(k / s);
                    next_island = next_island.max(island.saturating_add(1));
                    Some(island)
                }
                (None, None) => None,
            };
            devices.push(FakeDevice {
                uuid: format!("FAKE-{id}"),
                id,
                kind,
                model: grp.model.clone(),
                vendor: vendor.clone(),
                memory_mib: grp.memory_mib,
                numa,
                peer_group,
                index,
                links: Vec::new(),
                partition_of: None,
            });
        }
        // Full mesh inside each island of this group.
        if grp.peer_group.is_some() || grp.island_size.is_some() {
            let members = first..devices.len();
            for a in members.clone() {
                let links: Vec<pb::PeerLink> = members
                    .clone()
                    .filter(|&b| b != a && devices[b].peer_group == devices[a].peer_group)
                    .map(|b| pb::PeerLink {
                        peer: devices[b].id.clone(),
                        kind: lk.clone(),
                        bandwidth_mbps: grp.link_bandwidth_mbps,
                    })
                    .collect();
                devices[a].links = links;
            }
        }
    }

    let mut parents = BTreeSet::new();
    for (m, mig) in raw.mig.into_iter().enumerate() {
        let f = |name: &str| format!("mig[{m}].{name}");
        let Some(parent) = devices.iter().find(|d| d.id == mig.gpu && d.partition_of.is_none()).cloned() else {
            return Err(format!("{} {:?} is not a device id defined above", f("gpu"), mig.gpu));
        };
        if parent.kind != Kind::Gpu {
            return Err(format!("{} {:?} is an {}, expected a gpu", f("gpu"), mig.gpu, parent.kind.as_str()));
        }
        if !parents.insert(parent.id.clone()) {
            return Err(format!("{} {:?} is partitioned twice", f("gpu"), mig.gpu));
        }
        if mig.slices == 0 || mig.slices > MAX_MIG_SLICES {
            return Err(format!("{} is {}, expected 1 to {MAX_MIG_SLICES}", f("slices"), mig.slices));
        }
        if devices.len() + mig.slices as usize > MAX_DEVICES {
            return Err(format!("{} brings the total past the limit of {MAX_DEVICES} devices", f("slices")));
        }
        let model = mig.model.unwrap_or_else(|| format!("{} MIG 1/{}", parent.model, mig.slices));
        check_name(&model, &f("model"))?;
        let memory_mib = mig.memory_mib.unwrap_or(parent.memory_mib / u64::from(mig.slices)).max(1);
        check_memory(memory_mib, &f("memory_mib"))?;
        for n in 0..mig.slices {
            let id = format!("{}-mig{n}", parent.id);
            check_id(&id, &f("gpu"))?;
            devices.push(FakeDevice {
                uuid: format!("MIG-FAKE-{id}"),
                id,
                kind: Kind::Gpu,
                model: model.clone(),
                vendor: parent.vendor.clone(),
                memory_mib,
                numa: parent.numa,
                peer_group: None,
                index: parent.index,
                links: Vec::new(),
                partition_of: Some(parent.id.clone()),
            });
        }
    }

    let mut ids = BTreeSet::new();
    let mut indexes = BTreeSet::new();
    for d in &devices {
        if !ids.insert(d.id.clone()) {
            return Err(format!("device id {:?} is defined twice", d.id));
        }
        if d.partition_of.is_none() && !indexes.insert((d.kind, d.index)) {
            return Err(format!("device {:?}: {} index {} is used twice", d.id, d.kind.as_str(), d.index));
        }
    }
    for (at, field, links) in pending_links {
        let mut out = Vec::with_capacity(links.len());
        for (j, l) in links.into_iter().enumerate() {
            let lf = format!("{field}[{j}]");
            if !ids.contains(&l.peer) {
                return Err(format!("{lf}.peer {:?} is not a device id", l.peer));
            }
            if l.peer == devices[at].id {
                return Err(format!("{lf}.peer {:?} links the device to itself", l.peer));
            }
            check_bandwidth(l.bandwidth_mbps, &format!("{lf}.bandwidth_mbps"))?;
            let kind = match &l.kind {
                Some(k) => link_kind(k, &format!("{lf}.kind"))?,
                None => devices[at].kind.default_link().to_string(),
            };
            out.push(pb::PeerLink { peer: l.peer, kind, bandwidth_mbps: l.bandwidth_mbps });
        }
        devices[at].links = out;
    }
    Ok(FakeConfig { devices, fault_file: raw.fault_file, topology })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_fake_config_tests {
    use super::*;

    const EIGHT: &str = r#"
[[groups]]
count = 8
kind = "gpu"
model = "A100-80G"
memory_mib = 81920
numa_nodes = 2
island_size = 4
link_bandwidth_mbps = 600000
"#;

    #[test]
    fn mig_slices_are_partitions_of_their_gpu() {
        let text = "[[groups]]\ncount = 2\nkind = \"gpu\"\nmodel = \"A100\"\nmemory_mib = 81920\n[[mig]]\ngpu = \"gpu1\"\nslices = 7\n";
        let c = parse_config(text).unwrap();
        assert_eq!(c.devices.len(), 9);
        let m = &c.devices[8];
        assert_eq!(
            (m.id.as_str(), m.partition_of.as_deref(), m.index, m.memory_mib, m.model.as_str()),
            ("gpu1-mig6", Some("gpu1"), 1, 11702, "A100 MIG 1/7")
        );
        for (bad, why) in [
            ("gpu = \"gpu9\"\nslices = 2", "mig[0].gpu \"gpu9\" is not a device id"),
            ("gpu = \"gpu0\"\nslices = 8", "mig[0].slices is 8, expected 1 to 7"),
            ("gpu = \"gpu0\"\nslices = 0", "mig[0].slices is 0"),
        ] {
            let e = parse_config(&format!(
                "[[groups]]\ncount = 1\nkind = \"gpu\"\nmodel = \"A\"\nmemory_mib = 1\n[[mig]]\n{bad}\n"
            ))
            .unwrap_err();
            assert!(e.starts_with(why), "{e}");
        }
        let twice = format!("{text}[[mig]]\ngpu = \"gpu1\"\nslices = 2\n");
        assert!(parse_config(&twice).unwrap_err().contains("partitioned twice"));
    }

    #[test]
    fn a_group_split_into_two_islands() {
        let c = parse_config(EIGHT).unwrap();
        assert_eq!(c.devices.len(), 8);
        let ids: Vec<_> = c.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6", "gpu7"]);
        let groups: Vec<_> = c.devices.iter().map(|d| d.peer_group).collect();
        assert_eq!(groups, [Some(0), Some(0), Some(0), Some(0), Some(1), Some(1), Some(1), Some(1)]);
        let numa: Vec<_> = c.devices.iter().map(|d| d.numa).collect();
        assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);
        let d5 = &c.devices[5];
        assert_eq!((d5.index, d5.vendor.as_str(), d5.uuid.as_str()), (5, "fake", "FAKE-gpu5"));
        let peers: Vec<_> = d5.links.iter().map(|l| l.peer.as_str()).collect();
        assert_eq!(peers, ["gpu4", "gpu6", "gpu7"]);
        assert!(d5.links.iter().all(|l| l.kind == "nvlink" && l.bandwidth_mbps == 600000));
    }

    #[test]
    fn explicit_devices_and_groups_mix() {
        let text = r#"
vendor = "huawei"
fault_file = "faults.toml"
[[devices]]
id = "npu-a"
kind = "npu"
model = "Ascend910B"
memory_mib = 65536
numa = 1
peer_group = 3
links = [{ peer = "npu-b", bandwidth_mbps = 56000 }]
[[devices]]
id = "npu-b"
kind = "npu"
model = "Ascend910B"
memory_mib = 65536
peer_group = 3
[[groups]]
count = 4
kind = "npu"
model = "Ascend910B"
memory_mib = 65536
island_size = 2
"#;
        let c = parse_config(text).unwrap();
        assert_eq!(c.fault_file.as_deref(), Some("faults.toml"));
        assert_eq!(c.devices.len(), 6);
        assert_eq!(
            c.devices[0].links,
            vec![pb::PeerLink { peer: "npu-b".into(), kind: "hccs".into(), bandwidth_mbps: 56000 }]
        );
        assert!(c.devices[1].links.is_empty());
        // Islands from island_size come after the explicit peer_group 3.
        let groups: Vec<_> = c.devices[2..].iter().map(|d| d.peer_group.unwrap()).collect();
        assert_eq!(groups, [4, 4, 5, 5]);
        let idx: Vec<_> = c.devices.iter().map(|d| d.index).collect();
        assert_eq!(idx, [0, 1, 2, 3, 4, 5]);
        assert!(c.devices.iter().all(|d| d.vendor == "huawei"));
    }

    fn err(text: &str) -> String {
        parse_config(text).unwrap_err()
    }

    #[test]
    fn topology_is_optional_and_validated() {
        assert_eq!(parse_config(EIGHT).unwrap().topology, None);
        let text = format!("{EIGHT}[topology]\nrack = \"r12\"\nblock = \"su-3\"\nnvlink_domain = \"nvl72.a_1\"\n");
        let t = parse_config(&text).unwrap().topology.unwrap();
        assert_eq!((t.rack.as_str(), t.block.as_str(), t.nvlink_domain.as_str()), ("r12", "su-3", "nvl72.a_1"));
        // Keys left out are unknown (empty); a table naming nothing is no topology.
        let t = parse_config(&format!("{EIGHT}[topology]\nblock = \"b0\"\n")).unwrap().topology.unwrap();
        assert_eq!(t, pb::NodeTopology { block: "b0".into(), ..Default::default() });
        assert_eq!(parse_config(&format!("{EIGHT}[topology]\n")).unwrap().topology, None);

        let bad = |body: &str| err(&format!("{EIGHT}[topology]\n{body}\n"));
        let e = bad("rack = \"rack 1\"");
        assert!(e.starts_with("topology.rack \"rack 1\" may contain only ASCII letters"), "{e}");
        let e = bad("block = \"\"");
        assert!(e.starts_with("topology.block \"\" must be 1 to 63 characters"), "{e}");
        let e = bad(&format!("nvlink_domain = \"{}\"", "n".repeat(64)));
        assert!(e.starts_with("topology.nvlink_domain"), "{e}");
        assert!(parse_config(&format!("{EIGHT}[topology]\nrack = \"{}\"\n", "r".repeat(63))).is_ok());
        let e = bad("row = \"r1\"");
        assert!(e.contains("unknown field") && e.contains("row"), "{e}");
        let e = bad("rack = 7");
        assert!(e.contains("rack"), "{e}");
    }

    #[test]
    fn errors_name_the_field_and_the_limit() {
        let g = |extra: &str| format!("[[groups]]\nkind = \"gpu\"\nmodel = \"m\"\nmemory_mib = 1\n{extra}");
        assert!(err(&g("count = 300")).contains("groups[0].count is 300, expected 1 to 256"));
        assert!(err(&format!("{}\n{}", g("count = 200"), g("count = 100"))).contains("the limit is 256 devices"));
        assert!(err(&g("count = 8\nisland_size = 3")).contains("groups[0].island_size is 3, which does not divide"));
        assert!(err(&g("count = 8\nisland_size = 4\npeer_group = 1")).contains("exclusive"));
        assert!(err(&g("count = 2\nnuma = 0\nnuma_nodes = 2")).contains("exclusive"));
        assert!(err(&g("count = 2\nlink_kind = \"wire\"")).contains("groups[0].link_kind"));
        assert!(err(&g("count = 2\nid_prefix = \"a b\"")).contains("groups[0].id_prefix"));
        assert!(err(&g("count = 2\ncolour = 1")).contains("colour"));
        assert!(
            err("[[groups]]\ncount = 1\nkind = \"tpu\"\nmodel = \"m\"\nmemory_mib = 1\n")
                .contains("groups[0].kind is \"tpu\"")
        );
        assert!(
            err("[[groups]]\ncount = 1\nkind = \"gpu\"\nmodel = \"m\"\nmemory_mib = 0\n").contains("memory_mib is 0")
        );
        assert!(err("").contains("no devices"));
        assert!(err("vendor = 3").contains("vendor"));

        let d = |id: &str, extra: &str| {
            format!("[[devices]]\nid = \"{id}\"\nkind = \"gpu\"\nmodel = \"m\"\nmemory_mib = 1\n{extra}\n")
        };
        assert!(err(&format!("{}{}", d("a", ""), d("a", ""))).contains("\"a\" is defined twice"));
        assert!(err(&format!("{}{}", d("a", "index = 0"), d("b", "index = 0"))).contains("index 0 is used twice"));
        assert!(
            err(&d("a", "links = [{ peer = \"zz\" }]")).contains("devices[0].links[0].peer \"zz\" is not a device id")
        );
        assert!(err(&d("a", "links = [{ peer = \"a\" }]")).contains("itself"));
        assert!(err(&d("a", "numa = 5000")).contains("devices[0].numa is 5000, the limit is 4095"));
        assert!(err(&d("", "")).contains("devices[0].id"));
        let many: String = (0..257).map(|i| d(&format!("g{i}"), "")).collect();
        assert!(err(&many).contains("limit of 256 devices"));
    }
}
