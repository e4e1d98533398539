//! The engine's view of node capacity, indexed for fast placement.
//!
//! Nodes whose placement-relevant state is identical (same static hardware and attributes, same
//! free CPU and memory, same multiset of free device shares within each interchangeable device
//! run) fall into one *class*. A policy's verdict for a task shape depends only on the class, so
//! it is computed once per (class, shape) and cached; placing a task scans the active classes,
//! not the nodes. A 10,000-node cluster typically has a few hundred active classes.
//!
//! ```text
//!  Node ──(static attrs)──▶ StaticGroup ──┐
//!  Node ──(free cpu/mem/devices)──────────┴─▶ Class{key, members, evals[shape]} ◀── place(shape)
//! ```
//!
//! Ties between equally good nodes are broken uniformly at random with the caller's
//! [`DetRng`], so a seed replays exactly.

use crate::policy::{Eval, Pick, Policy, TieBreak};
use crate::rng::DetRng;
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use suanli_model::{
    Constraints, DeviceKind, DeviceShare, Health, Limits, Node, NodeId, PoolId, ShareIsolation, TaskResources,
    WHOLE_DEVICE_MILLI,
};
use thiserror::Error;

/// A set of device models, as a bitset over the cluster's interned model ids.
pub type ModelSet = u128;
/// Every model.
pub const ALL_MODELS: ModelSet = u128::MAX;
/// Most distinct device models one cluster view can hold.
pub const MAX_MODELS: usize = 128;
/// Most devices on one node the engine schedules (device choices are 64-bit masks).
pub const MAX_NODE_DEVICES: usize = 64;

/// Errors building a cluster view.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ClusterError {
    /// Invalid node description.
    #[error("node {node}: {source}")]
    Node {
        /// The node.
        node: String,
        /// What is wrong.
        source: suanli_model::ValidationError,
    },
    /// Too many devices on one node for the engine.
    #[error("node {node}: {count} devices; the engine schedules at most {MAX_NODE_DEVICES} per node")]
    TooManyDevices {
        /// The node.
        node: String,
        /// Its device count.
        count: usize,
    },
    /// Too many distinct device models.
    #[error("more than {MAX_MODELS} distinct device models in one cluster")]
    TooManyModels,
    /// The same node twice.
    #[error("duplicate node id {0}")]
    DuplicateNode(String),
}

/// Static description of one device slot of a [`StaticGroup`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DevStatic {
    /// GPU or NPU.
    pub kind: DeviceKind,
    /// Interned model id.
    pub model: u8,
    /// Device memory, MiB.
    pub memory_mib: u64,
    /// Topology block: devices in one block share NUMA node and NVLink/HCCS island.
    pub block: u16,
    /// A MIG (or vNPU) partition whose physical device is also a device of the node. Such a
    /// slice serves only single-device requests (CUDA shows a process one MIG instance), and
    /// adds no capacity of its own: the physical device is counted once, as the parent.
    pub partition: bool,
    /// Its plugin limits fractional shares (`ShareIsolation::Enforced`): the only devices a
    /// share that requires isolation may use.
    pub isolated: bool,
}

/// Nodes that are identical in everything but their current usage.
#[derive(Debug, Clone)]
pub struct StaticGroup {
    /// Pool.
    pub pool: PoolId,
    /// Region.
    pub region: String,
    /// Datacenter.
    pub datacenter: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// CPU capacity.
    pub cpu_milli: u64,
    /// Memory capacity.
    pub memory_mib: u64,
    /// Accepts new work.
    pub schedulable: bool,
    /// Device slots, ordered by (block, kind, model, memory).
    pub devs: Vec<DevStatic>,
    /// Runs of interchangeable slots `[start, end)`: same block, kind, model and memory.
    pub runs: Vec<(u16, u16)>,
    /// Topology blocks: (numa, peer group) per block id.
    pub blocks: Vec<(u32, Option<u32>)>,
    /// True when the node has fast peer links (several blocks with NVLink ids).
    pub has_topology: bool,
}

/// Current state of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DevState {
    /// Usable at all.
    pub healthy: bool,
    /// Free milli-units (0..=1000).
    pub free_milli: u16,
    /// Free device memory, MiB.
    pub free_mem_mib: u64,
}

impl DevState {
    /// Free milli-units counted as available (0 when unhealthy).
    pub fn avail(&self) -> u32 {
        if self.healthy { u32::from(self.free_milli) } else { 0 }
    }
    fn pack(&self) -> u64 {
        (u64::from(self.healthy) << 63) | (u64::from(self.free_milli) << 48) | (self.free_mem_mib & 0xFFFF_FFFF_FFFF)
    }
}

/// The placement-relevant state of one node (or class), in canonical slot order.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    /// Free CPU.
    pub cpu_free: u64,
    /// Free memory.
    pub mem_free: u64,
    /// Device states aligned with [`StaticGroup::devs`].
    pub devs: &'a [DevState],
    /// Bitmask of GPU job tags present (GpuClustering), 0 when not tracked.
    pub tags: u16,
}

/// Device part of a task shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevReq {
    /// Kind.
    pub kind: DeviceKind,
    /// Number of devices.
    pub count: u32,
    /// Milli per device.
    pub milli: u16,
    /// Memory slice per device, MiB.
    pub memory_mib: u64,
    /// A share that needs a device whose plugin limits shares (`constraints.share_isolation =
    /// "enforced"`); always false for whole devices.
    pub isolated: bool,
}

impl DevReq {
    /// Total milli.
    pub fn total_milli(&self) -> u64 {
        u64::from(self.count) * u64::from(self.milli)
    }
    /// Fractional (sharing) request.
    pub fn is_share(&self) -> bool {
        u32::from(self.milli) < WHOLE_DEVICE_MILLI
    }
    /// GpuClustering tag: bit 0 = sharing, bit n = n whole devices (capped at 15).
    pub fn tag_bit(&self) -> u16 {
        if self.is_share() { 1 } else { 1 << self.count.clamp(1, 15) }
    }
}

/// An interned task shape: what one replica needs plus where it may go.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    /// CPU.
    pub cpu_milli: u64,
    /// Memory.
    pub memory_mib: u64,
    /// Devices.
    pub dev: Option<DevReq>,
    /// Allowed device models.
    pub models: ModelSet,
    /// The model names as requested (for messages; may name models no node has).
    pub model_names: Option<Arc<[String]>>,
    /// Allowed static groups (bitset), `None` = all.
    pub groups: Option<Arc<[u64]>>,
    /// Allowed nodes (bitset over dense node indices) from `constraints.nodes` less
    /// `constraints.avoid_nodes`; `None` = all.
    pub nodes: Option<Arc<[u64]>>,
}

fn bit(bits: &Option<Arc<[u64]>>, i: u32) -> bool {
    match bits {
        None => true,
        Some(bits) => bits.get((i / 64) as usize).is_some_and(|w| w & (1 << (i % 64)) != 0),
    }
}

impl Shape {
    fn allows_group(&self, g: u32) -> bool {
        bit(&self.groups, g)
    }
    /// Whether the node constraints (`nodes`, `avoid_nodes`) allow the dense node `n`.
    pub fn allows_node(&self, n: u32) -> bool {
        bit(&self.nodes, n)
    }
}

/// Index of an interned shape.
pub type ShapeId = u32;

#[derive(Debug, Clone, Copy)]
enum Slot {
    Unknown,
    Infeasible,
    Fit(Eval),
}

#[derive(Debug, Clone)]
struct Class {
    group: u32,
    cpu_free: u64,
    mem_free: u64,
    tags: u16,
    devs: Box<[DevState]>,
    members: Vec<u32>,
    /// (rank, node) of the members, kept only for fixed-order tie-breaking.
    ordered: BTreeSet<(u32, u32)>,
    active_pos: u32,
    evals: Vec<Slot>,
}

#[derive(Debug, Clone)]
struct NodeRt {
    id: NodeId,
    group: u32,
    class: u32,
    pos: u32,
    cpu_free: u64,
    mem_free: u64,
    /// Actual device states, in the node's own device order.
    devs: Vec<DevState>,
    /// Static slot i -> index of the node's device.
    slot_dev: Vec<u16>,
    /// Device ids in the node's own order.
    dev_ids: Vec<String>,
    /// Count of running tasks per GpuClustering tag bit.
    tag_counts: [u16; 16],
    /// Why it is held out of placement: a bit per [`Hold`] (0: it takes work).
    held: u8,
    /// Whether the node is listed in its class's members.
    listed: bool,
    /// MIG links, for nodes that report partitions of their own devices.
    mig: Option<Box<MigLinks>>,
}

/// Which devices of a node are partitions of which (device indices in the node's order).
#[derive(Debug, Clone)]
struct MigLinks {
    /// Device -> its physical parent, when the parent is a device of the node.
    parent: Vec<Option<u16>>,
    /// Device -> its partitions.
    children: Vec<Vec<u16>>,
}

impl NodeRt {
    /// The device's state as placement sees it: a MIG parent while any of its partitions is
    /// used, and a partition while any share of its parent is used, have nothing free.
    fn effective(&self, i: usize) -> DevState {
        let st = self.devs[i];
        let Some(m) = &self.mig else { return st };
        let used = |d: u16| self.devs[d as usize].free_milli < WHOLE_DEVICE_MILLI as u16;
        if m.parent[i].is_some_and(used) || m.children[i].iter().copied().any(used) {
            DevState { free_milli: 0, free_mem_mib: 0, ..st }
        } else {
            st
        }
    }
}

/// Where a task goes: node index and the devices (node's own order) with shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Dense node index.
    pub node: u32,
    /// (device index on the node, milli, memory MiB).
    pub devices: Vec<(u16, u16, u64)>,
}

/// Counts of why nodes did not fit, for "0/N nodes fit: ..." messages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MisfitTally {
    /// Nodes examined.
    pub nodes: u64,
    /// Nodes that fit.
    pub fit: u64,
    /// reason -> node count, sorted by reason.
    pub reasons: BTreeMap<String, u64>,
}

impl MisfitTally {
    /// "0/1213 nodes fit: 800 insufficient gpu, 300 gpu model not in [V100M32], 113 unhealthy".
    pub fn message(&self) -> String {
        let mut parts: Vec<(&String, &u64)> = self.reasons.iter().collect();
        parts.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let list: Vec<String> = parts.iter().map(|(r, n)| format!("{n} {r}")).collect();
        format!("{}/{} nodes fit: {}", self.fit, self.nodes, list.join(", "))
    }
}

/// Why a node is held out of placement for the rest of a scheduling pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Reserved for a blocked head job (backfill): work that may still run at the reserved
    /// start stays off it.
    Reserved,
    /// Work on it was preempted in this pass and runs until it has stopped: what the victims
    /// free belongs to the job they make room for, whose placement follows in a later pass. No
    /// other job may be placed there now (apply would refuse it while the victims still run),
    /// though a later preemption in the same pass may still hold capacity there.
    Draining,
}

impl Hold {
    fn bit(self) -> u8 {
        match self {
            Hold::Reserved => 1,
            Hold::Draining => 2,
        }
    }
}

/// The indexed cluster.
#[derive(Debug, Clone)]
pub struct Cluster {
    groups: Vec<StaticGroup>,
    nodes: Vec<NodeRt>,
    node_index: HashMap<NodeId, u32>,
    classes: Vec<Class>,
    class_index: HashMap<Box<[u64]>, u32>,
    active: Vec<u32>,
    shapes: Vec<Shape>,
    shape_index: HashMap<Shape, ShapeId>,
    models: Vec<String>,
    model_index: HashMap<String, u8>,
    track_tags: bool,
    ties: TieBreak,
    /// Position of each node in the fixed tie-break order.
    rank: Vec<u32>,
    total_gpu_milli: u64,
    /// Why nodes that take no new work take none, by node index (see
    /// [`crate::ClusterView::unschedulable`]); only for pending reasons.
    unschedulable: BTreeMap<u32, String>,
    /// Nodes held only as [`Hold::Draining`] (for pending reasons).
    draining_only: u64,
    scratch_key: Vec<u64>,
    scratch_devs: Vec<DevState>,
    /// Network topology units across nodes (see [`TopoLevel`]): per level, the unit names and
    /// their nodes as a bitset over dense node indices; per node, its unit at each level.
    topo: [TopoUnits; 2],
    /// Per node, its `topology.suanli.io/*` labels (for constraints on them).
    topo_labels: Vec<BTreeMap<String, String>>,
    /// Per shape, the shape whose class evaluations it shares: a shape restricted to a unit
    /// (see [`Cluster::restrict`]) scores every class as the shape it came from.
    eval_of: Vec<ShapeId>,
    /// Restricted shapes already interned: (shape, level, unit) → shape.
    restricted: HashMap<(ShapeId, u8, u32), ShapeId>,
    /// For a restricted shape, its allowed nodes (a unit is small: [`Cluster::choose`] walks
    /// these instead of every class's members).
    restricted_nodes: HashMap<ShapeId, Arc<[u32]>>,
    /// Free device milli per node (healthy, physical devices), and per unit at each level.
    node_free: Vec<u64>,
    unit_free: [Vec<u64>; 2],
}

/// Node labels that place a node in the datacenter network (set by the agent's config or a
/// device plugin). They are not part of a node's static class: nodes differing only in them
/// share evaluations.
pub const TOPOLOGY_LABEL_PREFIX: &str = "topology.suanli.io/";
/// The rack label (reported; usable in constraints).
pub const RACK_LABEL: &str = "topology.suanli.io/rack";
/// The network block (leaf switch / scalable unit) label.
pub const BLOCK_LABEL: &str = "topology.suanli.io/block";
/// The multi-node NVLink domain label (e.g. an NVL72 rack).
pub const NVLINK_DOMAIN_LABEL: &str = "topology.suanli.io/nvlink-domain";

/// A level of the cross-node topology that gang placement packs into, innermost first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopoLevel {
    /// A multi-node NVLink domain.
    NvlinkDomain = 0,
    /// A network block.
    Block = 1,
}

impl TopoLevel {
    /// The node label that names a node's unit at this level.
    pub fn label(self) -> &'static str {
        match self {
            TopoLevel::NvlinkDomain => NVLINK_DOMAIN_LABEL,
            TopoLevel::Block => BLOCK_LABEL,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct TopoUnits {
    names: Vec<String>,
    index: HashMap<String, u32>,
    members: Vec<Vec<u32>>,
    bits: Vec<Arc<[u64]>>,
    /// Unit per node, `u32::MAX` when the node has no label at this level.
    of_node: Vec<u32>,
}

fn block_of(blocks: &mut Vec<(u32, Option<u32>)>, numa: u32, peer: Option<u32>) -> u16 {
    if let Some(i) = blocks.iter().position(|b| *b == (numa, peer)) {
        return i as u16;
    }
    blocks.push((numa, peer));
    (blocks.len() - 1) as u16
}

impl Cluster {
    /// Builds the view from nodes. `track_tags` keeps per-node job-shape tags (needed only by
    /// the GpuClustering baseline); `ties` says how equal scores are broken (node order is
    /// the input order until [`Cluster::set_order`]). Devices start free; use [`Cluster::occupy`] to add running
    /// work.
    pub fn new(nodes: &[Node], limits: &Limits, track_tags: bool, ties: TieBreak) -> Result<Self, ClusterError> {
        let mut c = Cluster {
            groups: Vec::new(),
            nodes: Vec::with_capacity(nodes.len()),
            node_index: HashMap::with_capacity_and_hasher(nodes.len(), Default::default()),
            classes: Vec::new(),
            class_index: HashMap::default(),
            active: Vec::new(),
            shapes: Vec::new(),
            shape_index: HashMap::default(),
            models: Vec::new(),
            model_index: HashMap::default(),
            track_tags,
            ties,
            rank: (0..nodes.len() as u32).collect(),
            total_gpu_milli: 0,
            unschedulable: BTreeMap::new(),
            draining_only: 0,
            scratch_key: Vec::new(),
            scratch_devs: Vec::new(),
            topo: Default::default(),
            topo_labels: Vec::with_capacity(nodes.len()),
            eval_of: Vec::new(),
            restricted: HashMap::default(),
            restricted_nodes: HashMap::default(),
            node_free: Vec::with_capacity(nodes.len()),
            unit_free: Default::default(),
        };
        let mut group_index: HashMap<u64, Vec<u32>> = HashMap::default();
        for n in nodes {
            n.validate(limits).map_err(|source| ClusterError::Node { node: n.id.0.clone(), source })?;
            if n.devices.len() > MAX_NODE_DEVICES {
                return Err(ClusterError::TooManyDevices { node: n.id.0.clone(), count: n.devices.len() });
            }
            // Static slots sorted by (block, kind, model, memory), remembering device indices.
            let mut blocks = Vec::new();
            let mut slots: Vec<(DevStatic, u16)> = Vec::with_capacity(n.devices.len());
            let parent: Vec<Option<u16>> = n
                .devices
                .iter()
                .map(|d| {
                    let p = d.partition_of.as_deref()?;
                    n.devices.iter().position(|x| x.id == p && x.id != d.id).map(|i| i as u16)
                })
                .collect();
            for (i, d) in n.devices.iter().enumerate() {
                let model = c.intern_model(&d.model)?;
                let block = block_of(&mut blocks, d.numa, d.peer_group);
                let partition = parent[i].is_some();
                let isolated = d.share_isolation == ShareIsolation::Enforced;
                slots.push((
                    DevStatic { kind: d.kind, model, memory_mib: d.memory_mib, block, partition, isolated },
                    i as u16,
                ));
            }
            let mig = parent.iter().any(Option::is_some).then(|| {
                let mut children = vec![Vec::new(); n.devices.len()];
                for (i, p) in parent.iter().enumerate() {
                    if let Some(p) = p {
                        children[*p as usize].push(i as u16);
                    }
                }
                Box::new(MigLinks { parent: parent.clone(), children })
            });
            slots.sort_by(|a, b| {
                (a.0.block, a.0.kind, a.0.model, a.0.memory_mib, a.0.partition, a.0.isolated).cmp(&(
                    b.0.block,
                    b.0.kind,
                    b.0.model,
                    b.0.memory_mib,
                    b.0.partition,
                    b.0.isolated,
                ))
            });
            let devs: Vec<DevStatic> = slots.iter().map(|s| s.0.clone()).collect();
            let mut runs = Vec::new();
            let mut start = 0usize;
            for i in 1..=devs.len() {
                if i == devs.len() || devs[i] != devs[start] {
                    runs.push((start as u16, i as u16));
                    start = i;
                }
            }
            let has_topology = blocks.len() > 1 || blocks.iter().any(|b| b.1.is_some());
            let labels: BTreeMap<String, String> = if n.labels.keys().any(|k| k.starts_with(TOPOLOGY_LABEL_PREFIX)) {
                n.labels
                    .iter()
                    .filter(|(k, _)| !k.starts_with(TOPOLOGY_LABEL_PREFIX))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            } else {
                n.labels.clone()
            };
            let group = {
                let same = |g: &StaticGroup| {
                    g.pool == n.pool
                        && g.region == n.region
                        && g.datacenter == n.datacenter
                        && g.labels == labels
                        && g.cpu_milli == n.cpu_milli
                        && g.memory_mib == n.memory_mib
                        && g.schedulable == n.schedulable
                        && g.devs == devs
                        && g.blocks == blocks
                };
                let mut h = rustc_hash::FxHasher::default();
                (&n.pool, &n.region, &n.datacenter, &labels, n.cpu_milli, n.memory_mib, n.schedulable, &devs, &blocks)
                    .hash(&mut h);
                let bucket = group_index.entry(h.finish()).or_default();
                match bucket.iter().copied().find(|&g| same(&c.groups[g as usize])) {
                    Some(g) => g,
                    None => {
                        let g = c.groups.len() as u32;
                        c.groups.push(StaticGroup {
                            pool: n.pool.clone(),
                            region: n.region.clone(),
                            datacenter: n.datacenter.clone(),
                            labels: labels.clone(),
                            cpu_milli: n.cpu_milli,
                            memory_mib: n.memory_mib,
                            schedulable: n.schedulable,
                            devs,
                            runs,
                            blocks,
                            has_topology,
                        });
                        bucket.push(g);
                        g
                    }
                }
            };
            let idx = c.nodes.len() as u32;
            if c.node_index.insert(n.id.clone(), idx).is_some() {
                return Err(ClusterError::DuplicateNode(n.id.0.clone()));
            }
            let dev_states = n
                .devices
                .iter()
                .map(|d| DevState {
                    healthy: d.health == Health::Healthy,
                    free_milli: WHOLE_DEVICE_MILLI as u16,
                    free_mem_mib: d.memory_mib,
                })
                .collect();
            // A MIG parent counts once; its partitions add no capacity.
            c.total_gpu_milli += (0..n.devices.len())
                .filter(|&i| n.devices[i].kind == DeviceKind::Gpu && parent[i].is_none())
                .count() as u64
                * u64::from(WHOLE_DEVICE_MILLI);
            c.nodes.push(NodeRt {
                id: n.id.clone(),
                group,
                class: u32::MAX,
                pos: 0,
                cpu_free: n.cpu_milli,
                mem_free: n.memory_mib,
                devs: dev_states,
                slot_dev: slots.iter().map(|s| s.1).collect(),
                dev_ids: n.devices.iter().map(|d| d.id.clone()).collect(),
                tag_counts: [0; 16],
                held: 0,
                listed: false,
                mig,
            });
            c.topo_labels.push(
                n.labels
                    .iter()
                    .filter(|(k, _)| k.starts_with(TOPOLOGY_LABEL_PREFIX))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            );
            for level in [TopoLevel::NvlinkDomain, TopoLevel::Block] {
                let units = &mut c.topo[level as usize];
                let unit = match n.labels.get(level.label()) {
                    Some(name) => match units.index.get(name) {
                        Some(&u) => u,
                        None => {
                            let u = units.names.len() as u32;
                            units.names.push(name.clone());
                            units.index.insert(name.clone(), u);
                            units.members.push(Vec::new());
                            c.unit_free[level as usize].push(0);
                            u
                        }
                    },
                    None => u32::MAX,
                };
                if unit != u32::MAX {
                    units.members[unit as usize].push(idx);
                }
                units.of_node.push(unit);
            }
            c.node_free.push(0);
            c.reclass(idx);
        }
        let words = c.nodes.len().div_ceil(64).max(1);
        for units in &mut c.topo {
            units.bits = units
                .members
                .iter()
                .map(|m| {
                    let mut b = vec![0u64; words];
                    for &i in m {
                        b[i as usize / 64] |= 1 << (i % 64);
                    }
                    Arc::from(b)
                })
                .collect();
        }
        Ok(c)
    }

    /// How many units the cluster has at a topology level (0: no node carries its label).
    pub fn topo_units(&self, level: TopoLevel) -> usize {
        self.topo[level as usize].names.len()
    }

    /// The node's unit at a level, if it carries the label.
    pub fn topo_unit_of(&self, level: TopoLevel, node: u32) -> Option<u32> {
        self.topo[level as usize].of_node.get(node as usize).copied().filter(|&u| u != u32::MAX)
    }

    /// A unit's name.
    pub fn topo_unit_name(&self, level: TopoLevel, unit: u32) -> &str {
        &self.topo[level as usize].names[unit as usize]
    }

    /// Free device milli per unit at a level: healthy physical devices of any kind on nodes that
    /// take work (held and unschedulable nodes count nothing); an ordering hint, kept current on
    /// every change.
    pub fn topo_free(&self, level: TopoLevel) -> &[u64] {
        &self.unit_free[level as usize]
    }

    fn refresh_free(&mut self, node: u32) {
        let i = node as usize;
        let n = &self.nodes[i];
        let g = &self.groups[n.group as usize];
        let takes_work = n.held == 0 && g.schedulable;
        let free: u64 = g
            .devs
            .iter()
            .zip(&n.slot_dev)
            .filter(|(d, _)| !d.partition)
            .map(|(_, &d)| n.devs[d as usize])
            .filter(|st| st.healthy)
            .map(|st| u64::from(st.free_milli))
            .sum::<u64>()
            * u64::from(takes_work);
        let old = std::mem::replace(&mut self.node_free[i], free);
        for level in 0..2 {
            let u = self.topo[level].of_node[i];
            if u != u32::MAX {
                let t = &mut self.unit_free[level][u as usize];
                *t = (*t + free).saturating_sub(old);
            }
        }
    }

    /// The shape limited to the nodes of one unit (interned; the unit's bitset intersected with
    /// the shape's own node constraints).
    pub fn restrict(&mut self, shape: ShapeId, level: TopoLevel, unit: u32) -> ShapeId {
        if let Some(&id) = self.restricted.get(&(shape, level as u8, unit)) {
            return id;
        }
        let unit_bits = self.topo[level as usize].bits[unit as usize].clone();
        let mut s = self.shapes[shape as usize].clone();
        let bits: Vec<u64> = match &s.nodes {
            None => unit_bits.to_vec(),
            Some(b) => b.iter().zip(unit_bits.iter()).map(|(a, u)| a & u).collect(),
        };
        s.nodes = Some(Arc::from(bits));
        let list: Arc<[u32]> =
            self.topo[level as usize].members[unit as usize].iter().copied().filter(|&n| bit(&s.nodes, n)).collect();
        let id = self.intern(s);
        let base = self.eval_of[shape as usize];
        self.eval_of[id as usize] = base;
        self.restricted_nodes.insert(id, list);
        self.restricted.insert((shape, level as u8, unit), id);
        id
    }

    fn intern_model(&mut self, m: &str) -> Result<u8, ClusterError> {
        if let Some(&id) = self.model_index.get(m) {
            return Ok(id);
        }
        if self.models.len() >= MAX_MODELS {
            return Err(ClusterError::TooManyModels);
        }
        let id = self.models.len() as u8;
        self.models.push(m.to_owned());
        self.model_index.insert(m.to_owned(), id);
        Ok(id)
    }

    /// The model set for a list of names; unknown names match nothing. Empty list = all.
    pub fn model_set(&self, names: &[String]) -> ModelSet {
        if names.is_empty() {
            return ALL_MODELS;
        }
        names.iter().filter_map(|n| self.model_index.get(n)).fold(0, |acc, &id| acc | (1u128 << id))
    }

    /// Interns the shape of one replica with `resources` under `constraints`.
    pub fn shape(&mut self, resources: &TaskResources, constraints: &Constraints) -> ShapeId {
        let models = self.model_set(&constraints.device_models);
        let is_topo = |k: &String| k.starts_with(TOPOLOGY_LABEL_PREFIX);
        let group_labels = constraints.labels.iter().filter(|(k, _)| !is_topo(k)).count();
        let groups = if constraints.pools.is_empty() && constraints.regions.is_empty() && group_labels == 0 {
            None
        } else {
            let mut bits = vec![0u64; self.groups.len().div_ceil(64).max(1)];
            for (i, g) in self.groups.iter().enumerate() {
                let ok = (constraints.pools.is_empty() || constraints.pools.contains(&g.pool))
                    && (constraints.regions.is_empty() || constraints.regions.contains(&g.region))
                    && constraints.labels.iter().filter(|(k, _)| !is_topo(k)).all(|(k, v)| g.labels.get(k) == Some(v));
                if ok {
                    bits[i / 64] |= 1 << (i % 64);
                }
            }
            Some(Arc::from(bits))
        };
        let dev = resources.devices.as_ref().map(|d| DevReq {
            kind: d.kind,
            count: d.count,
            milli: d.milli.min(WHOLE_DEVICE_MILLI) as u16,
            memory_mib: d.memory_mib,
            isolated: d.milli < WHOLE_DEVICE_MILLI && constraints.share_isolation == ShareIsolation::Enforced,
        });
        let model_names = (!constraints.device_models.is_empty()).then(|| Arc::from(constraints.device_models.clone()));
        let topo_cons: Vec<(&String, &String)> = constraints.labels.iter().filter(|(k, _)| is_topo(k)).collect();
        let nodes = if constraints.nodes.is_empty() && constraints.avoid_nodes.is_empty() && topo_cons.is_empty() {
            None
        } else {
            let words = self.nodes.len().div_ceil(64).max(1);
            let mut bits = vec![0u64; words];
            if constraints.nodes.is_empty() {
                for i in 0..self.nodes.len() {
                    bits[i / 64] |= 1 << (i % 64);
                }
            } else {
                for id in &constraints.nodes {
                    if let Some(&i) = self.node_index.get(id) {
                        bits[i as usize / 64] |= 1 << (i % 64);
                    }
                }
            }
            for id in &constraints.avoid_nodes {
                if let Some(&i) = self.node_index.get(id) {
                    bits[i as usize / 64] &= !(1 << (i % 64));
                }
            }
            for (i, l) in self.topo_labels.iter().enumerate() {
                if !topo_cons.iter().all(|(k, v)| l.get(*k) == Some(*v)) {
                    bits[i / 64] &= !(1 << (i % 64));
                }
            }
            Some(Arc::from(bits))
        };
        self.intern(Shape {
            cpu_milli: resources.cpu_milli,
            memory_mib: resources.memory_mib,
            dev,
            models,
            model_names,
            groups,
            nodes,
        })
    }

    /// `shape` without the nodes `avoid` (dense indices): how a service's replicas are spread
    /// (the engine tries it first and falls back to `shape`).
    pub fn exclude(&mut self, shape: ShapeId, avoid: &[u32]) -> ShapeId {
        if avoid.is_empty() {
            return shape;
        }
        let mut s = self.shapes[shape as usize].clone();
        let mut bits: Vec<u64> = match &s.nodes {
            Some(b) => b.to_vec(),
            None => {
                let mut all = vec![0u64; self.nodes.len().div_ceil(64).max(1)];
                for i in 0..self.nodes.len() {
                    all[i / 64] |= 1 << (i % 64);
                }
                all
            }
        };
        for &i in avoid {
            if let Some(w) = bits.get_mut(i as usize / 64) {
                *w &= !(1 << (i % 64));
            }
        }
        s.nodes = Some(Arc::from(bits));
        self.intern(s)
    }

    /// Every node (dense indices) in a pool that one of `nodes` is in: what a service spreading
    /// across pools avoids first.
    pub fn pool_mates(&self, nodes: &[u32]) -> Vec<u32> {
        let pools: BTreeSet<&PoolId> = nodes
            .iter()
            .filter_map(|&i| self.nodes.get(i as usize))
            .filter_map(|n| self.groups.get(n.group as usize))
            .map(|g| &g.pool)
            .collect();
        (0..self.nodes.len() as u32)
            .filter(|&i| {
                self.groups.get(self.nodes[i as usize].group as usize).is_some_and(|g| pools.contains(&g.pool))
            })
            .collect()
    }

    /// The dense index of a node.
    pub fn index_of(&self, id: &NodeId) -> Option<u32> {
        self.node_index.get(id).copied()
    }

    /// Interns a prepared shape.
    pub fn intern(&mut self, s: Shape) -> ShapeId {
        if let Some(&id) = self.shape_index.get(&s) {
            return id;
        }
        let id = self.shapes.len() as ShapeId;
        self.eval_of.push(id);
        self.shapes.push(s.clone());
        self.shape_index.insert(s, id);
        id
    }

    /// The shape behind an id.
    pub fn shape_of(&self, id: ShapeId) -> &Shape {
        &self.shapes[id as usize]
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    /// True without nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
    /// Number of active (non-empty) classes.
    pub fn active_classes(&self) -> usize {
        self.active.len()
    }
    /// Static groups.
    pub fn groups(&self) -> &[StaticGroup] {
        &self.groups
    }
    /// Interned model names.
    pub fn models(&self) -> &[String] {
        &self.models
    }
    /// Dense index of a node.
    pub fn node_index(&self, id: &NodeId) -> Option<u32> {
        self.node_index.get(id).copied()
    }
    /// Id of a dense node index.
    pub fn node_id(&self, idx: u32) -> &NodeId {
        &self.nodes[idx as usize].id
    }
    /// Total GPU milli in the cluster.
    pub fn total_gpu_milli(&self) -> u64 {
        self.total_gpu_milli
    }

    /// Free GPU milli summed over healthy GPUs.
    pub fn free_gpu_milli(&self) -> u64 {
        self.nodes
            .iter()
            .map(|n| {
                let g = &self.groups[n.group as usize];
                n.slot_dev
                    .iter()
                    .enumerate()
                    .filter(|(s, _)| g.devs[*s].kind == DeviceKind::Gpu && !g.devs[*s].partition)
                    .map(|(_, &d)| u64::from(n.effective(d as usize).free_milli))
                    .sum::<u64>()
            })
            .sum()
    }

    /// Calls `f(group, view)` for every node, in canonical slot order.
    pub fn for_each_node(&self, mut f: impl FnMut(&StaticGroup, NodeView<'_>)) {
        for n in &self.nodes {
            let c = &self.classes[n.class as usize];
            f(
                &self.groups[n.group as usize],
                NodeView { cpu_free: c.cpu_free, mem_free: c.mem_free, devs: &c.devs, tags: c.tags },
            );
        }
    }

    /// The canonical view of one node.
    pub fn view(&self, node: u32) -> (&StaticGroup, NodeView<'_>) {
        let n = &self.nodes[node as usize];
        let c = &self.classes[n.class as usize];
        (
            &self.groups[n.group as usize],
            NodeView { cpu_free: c.cpu_free, mem_free: c.mem_free, devs: &c.devs, tags: c.tags },
        )
    }

    /// Marks a node's device (by id) healthy or not.
    pub fn set_device_health(&mut self, node: u32, device: &str, health: Health) -> bool {
        let n = &mut self.nodes[node as usize];
        let Some(i) = n.dev_ids.iter().position(|d| d == device) else { return false };
        n.devs[i].healthy = health == Health::Healthy;
        self.reclass(node);
        true
    }

    /// Canonical device states of a node: for each run, the states sorted descending; and the
    /// permutation canonical slot -> device index.
    fn canonical(&self, node: u32, out: &mut Vec<DevState>, perm: Option<&mut Vec<u16>>) {
        let n = &self.nodes[node as usize];
        let g = &self.groups[n.group as usize];
        out.clear();
        let mut p = Vec::new();
        for &(s, e) in &g.runs {
            let mut idx: Vec<u16> = n.slot_dev[s as usize..e as usize].to_vec();
            idx.sort_by(|&a, &b| n.effective(b as usize).cmp(&n.effective(a as usize)).then(a.cmp(&b)));
            for &i in &idx {
                out.push(n.effective(i as usize));
            }
            p.extend_from_slice(&idx);
        }
        if let Some(perm) = perm {
            *perm = p;
        }
    }

    fn node_tags(&self, node: u32) -> u16 {
        if !self.track_tags {
            return 0;
        }
        let n = &self.nodes[node as usize];
        (0..16).filter(|&b| n.tag_counts[b] > 0).fold(0u16, |acc, b| acc | (1 << b))
    }

    /// Moves a node into the class matching its current state.
    fn reclass(&mut self, node: u32) {
        self.refresh_free(node);
        let mut devs = std::mem::take(&mut self.scratch_devs);
        self.canonical(node, &mut devs, None);
        let tags = self.node_tags(node);
        let (group, cpu_free, mem_free) = {
            let n = &self.nodes[node as usize];
            (n.group, n.cpu_free, n.mem_free)
        };
        let mut key = std::mem::take(&mut self.scratch_key);
        key.clear();
        key.extend_from_slice(&[u64::from(group), cpu_free, mem_free, u64::from(tags)]);
        key.extend(devs.iter().map(DevState::pack));
        let class = match self.class_index.get(key.as_slice()) {
            Some(&c) => c,
            None => {
                let c = self.classes.len() as u32;
                self.classes.push(Class {
                    group,
                    cpu_free,
                    mem_free,
                    tags,
                    devs: devs.clone().into_boxed_slice(),
                    members: Vec::new(),
                    ordered: BTreeSet::new(),
                    active_pos: u32::MAX,
                    evals: Vec::new(),
                });
                self.class_index.insert(key.clone().into_boxed_slice(), c);
                c
            }
        };
        self.scratch_key = key;
        self.scratch_devs = devs;
        self.relist(node, class);
    }

    fn unlist(&mut self, node: u32) {
        let (old, pos, listed) = {
            let n = &self.nodes[node as usize];
            (n.class, n.pos as usize, n.listed)
        };
        if !listed || old == u32::MAX {
            return;
        }
        let oc = &mut self.classes[old as usize];
        oc.members.swap_remove(pos);
        if self.ties == TieBreak::FixedOrder {
            oc.ordered.remove(&(self.rank[node as usize], node));
        }
        if let Some(&moved) = oc.members.get(pos) {
            self.nodes[moved as usize].pos = pos as u32;
        }
        if oc.members.is_empty() {
            let ap = oc.active_pos as usize;
            oc.active_pos = u32::MAX;
            self.active.swap_remove(ap);
            if let Some(&m) = self.active.get(ap) {
                self.classes[m as usize].active_pos = ap as u32;
            }
        }
        self.nodes[node as usize].listed = false;
    }

    fn relist(&mut self, node: u32, class: u32) {
        let n = &self.nodes[node as usize];
        if n.class == class && n.listed != (n.held != 0) {
            return;
        }
        self.unlist(node);
        self.nodes[node as usize].class = class;
        if self.nodes[node as usize].held != 0 {
            return;
        }
        let nc = &mut self.classes[class as usize];
        if nc.members.is_empty() {
            nc.active_pos = self.active.len() as u32;
            self.active.push(class);
        }
        nc.members.push(node);
        if self.ties == TieBreak::FixedOrder {
            nc.ordered.insert((self.rank[node as usize], node));
        }
        let pos = (nc.members.len() - 1) as u32;
        let n = &mut self.nodes[node as usize];
        n.pos = pos;
        n.listed = true;
    }

    /// Sets the fixed tie-break order: `order[k]` is the node placed k-th (a permutation of
    /// `0..len`). Ignored unless the index is missing a node.
    pub fn set_order(&mut self, order: &[u32]) {
        if order.len() != self.nodes.len() {
            return;
        }
        for (k, &n) in order.iter().enumerate() {
            if let Some(r) = self.rank.get_mut(n as usize) {
                *r = k as u32;
            }
        }
        for c in &mut self.classes {
            c.ordered = c.members.iter().map(|&m| (self.rank[m as usize], m)).collect();
        }
    }

    /// Takes a node out of placement until [`Cluster::unhold`] with the same reason (holds
    /// for different reasons add up: the node takes work again when none is left).
    pub fn hold(&mut self, node: u32, why: Hold) {
        self.unlist(node);
        let held = self.nodes[node as usize].held | why.bit();
        self.set_held(node, held);
        self.refresh_free(node);
    }

    /// Lifts one reason a node was held for; it returns to placement when no reason is left.
    pub fn unhold(&mut self, node: u32, why: Hold) {
        let held = self.nodes[node as usize].held & !why.bit();
        self.set_held(node, held);
        self.refresh_free(node);
        let class = self.nodes[node as usize].class;
        self.relist(node, class);
    }

    fn set_held(&mut self, node: u32, held: u8) {
        let n = &mut self.nodes[node as usize];
        let draining = Hold::Draining.bit();
        if n.held == draining {
            self.draining_only -= 1;
        }
        if held == draining {
            self.draining_only += 1;
        }
        n.held = held;
    }

    /// Drops cached classes that hold no node (bounds memory in long simulations).
    pub fn compact(&mut self) {
        if self.classes.len() < 4 * self.nodes.len().max(64) {
            return;
        }
        self.classes.clear();
        self.class_index.clear();
        self.active.clear();
        for n in &mut self.nodes {
            n.class = u32::MAX;
            n.listed = false;
        }
        for i in 0..self.nodes.len() as u32 {
            self.reclass(i);
        }
    }

    fn eval_class(&mut self, class: u32, shape: ShapeId, policy: &dyn Policy) -> Slot {
        let c = &mut self.classes[class as usize];
        if let Some(Slot::Unknown) | None = c.evals.get(shape as usize) {
            let g = &self.groups[c.group as usize];
            let s = &self.shapes[shape as usize];
            let view = NodeView { cpu_free: c.cpu_free, mem_free: c.mem_free, devs: &c.devs, tags: c.tags };
            let slot = match policy.eval(g, &view, s) {
                Some(e) => Slot::Fit(e),
                None => Slot::Infeasible,
            };
            if c.evals.len() <= shape as usize {
                c.evals.resize(shape as usize + 1, Slot::Unknown);
            }
            c.evals[shape as usize] = slot;
        }
        c.evals[shape as usize]
    }

    /// Chooses the best node for one replica of `shape` under `policy`, without committing.
    /// Equal best scores are broken uniformly at random over nodes.
    pub fn choose(&mut self, shape: ShapeId, policy: &dyn Policy, rng: &mut DetRng) -> Option<Choice> {
        if let Some(list) = self.restricted_nodes.get(&shape).cloned() {
            return self.choose_among(shape, &list, policy, rng);
        }
        let mut best = i64::MIN;
        let mut ties: Vec<(u32, Eval, u64)> = Vec::new();
        let mut total = 0u64;
        // Node constraints split classes: only the allowed members count.
        let allowed = self.shapes[shape as usize].nodes.clone();
        let allowed_members = |c: &Class| -> u64 {
            match &allowed {
                None => c.members.len() as u64,
                Some(_) => c.members.iter().filter(|&&m| bit(&allowed, m)).count() as u64,
            }
        };
        for i in 0..self.active.len() {
            let class = self.active[i];
            let group = self.classes[class as usize].group;
            if !self.shapes[shape as usize].allows_group(group) || !self.groups[group as usize].schedulable {
                continue;
            }
            let members = allowed_members(&self.classes[class as usize]);
            if members == 0 {
                continue;
            }
            if let Slot::Fit(e) = self.eval_class(class, self.eval_of[shape as usize], policy) {
                if e.score > best {
                    best = e.score;
                    ties.clear();
                    total = 0;
                }
                if e.score == best {
                    ties.push((class, e, members));
                    total += members;
                }
            }
        }
        if ties.is_empty() {
            return None;
        }
        if self.ties == TieBreak::FixedOrder {
            let (rank_node, e) = ties
                .iter()
                .filter_map(|(c, e, _)| {
                    self.classes[*c as usize].ordered.iter().find(|(_, m)| bit(&allowed, *m)).map(|f| (*f, *e))
                })
                .min_by_key(|(f, _)| *f)?;
            return Some(self.resolve(rank_node.1, &e, shape, rng));
        }
        let mut r = rng.below(total);
        for (class, e, n) in ties {
            if r < n {
                let members = &self.classes[class as usize].members;
                let node = match &allowed {
                    None => members[r as usize],
                    Some(_) => *members.iter().filter(|&&m| bit(&allowed, m)).nth(r as usize)?,
                };
                return Some(self.resolve(node, &e, shape, rng));
            }
            r -= n;
        }
        None
    }

    /// [`Cluster::choose`] over an explicit, small node list (a restricted shape's unit): the
    /// same scores (class evaluations are shared) and the same tie-break rules.
    fn choose_among(&mut self, shape: ShapeId, list: &[u32], policy: &dyn Policy, rng: &mut DetRng) -> Option<Choice> {
        let base = self.eval_of[shape as usize];
        let mut best: Option<(i64, Eval)> = None;
        let mut ties: Vec<u32> = Vec::new();
        for &node in list {
            let n = &self.nodes[node as usize];
            if n.held != 0 || n.class == u32::MAX {
                continue;
            }
            let (class, group) = (n.class, n.group);
            if !self.shapes[shape as usize].allows_group(group) || !self.groups[group as usize].schedulable {
                continue;
            }
            let Slot::Fit(e) = self.eval_class(class, base, policy) else { continue };
            match best {
                Some((b, _)) if e.score < b => continue,
                Some((b, _)) if e.score == b => ties.push(node),
                _ => {
                    best = Some((e.score, e));
                    ties.clear();
                    ties.push(node);
                }
            }
        }
        let (_, e) = best?;
        let node = match self.ties {
            TieBreak::FixedOrder => *ties.iter().min_by_key(|&&n| self.rank[n as usize])?,
            TieBreak::Random => ties[rng.below(ties.len() as u64) as usize],
        };
        // Equal scores within one class share an evaluation; across classes the mask differs.
        let class = self.nodes[node as usize].class;
        let e = match self.eval_class(class, base, policy) {
            Slot::Fit(x) => x,
            _ => e,
        };
        Some(self.resolve(node, &e, shape, rng))
    }

    /// The naive baseline: evaluates every node afresh (no classes, no cache). Same decisions
    /// as [`Cluster::choose`] in distribution; used to measure what the index buys.
    pub fn choose_naive(&mut self, shape: ShapeId, policy: &dyn Policy, rng: &mut DetRng) -> Option<Choice> {
        let mut best = i64::MIN;
        let mut ties: Vec<(u32, Eval)> = Vec::new();
        let mut devs = Vec::new();
        for node in 0..self.nodes.len() as u32 {
            let n = &self.nodes[node as usize];
            let g = &self.groups[n.group as usize];
            let s = &self.shapes[shape as usize];
            if !s.allows_group(n.group) || !s.allows_node(node) || !g.schedulable {
                continue;
            }
            self.canonical(node, &mut devs, None);
            let n = &self.nodes[node as usize];
            let view = NodeView { cpu_free: n.cpu_free, mem_free: n.mem_free, devs: &devs, tags: self.node_tags(node) };
            if let Some(e) = policy.eval(g, &view, &self.shapes[shape as usize]) {
                if e.score > best {
                    best = e.score;
                    ties.clear();
                }
                if e.score == best {
                    ties.push((node, e));
                }
            }
        }
        if ties.is_empty() {
            return None;
        }
        let (node, e) = if self.ties == TieBreak::FixedOrder {
            ties.iter().copied().min_by_key(|(n, _)| self.rank[*n as usize])?
        } else {
            ties[rng.below(ties.len() as u64) as usize]
        };
        Some(self.resolve(node, &e, shape, rng))
    }

    /// Turns a class-level verdict (canonical slots) into the node's actual devices.
    fn resolve(&self, node: u32, e: &Eval, shape: ShapeId, rng: &mut DetRng) -> Choice {
        let s = &self.shapes[shape as usize];
        let Some(req) = s.dev else { return Choice { node, devices: Vec::new() } };
        let mut canon = Vec::new();
        let mut perm = Vec::new();
        self.canonical(node, &mut canon, Some(&mut perm));
        let mut mask = e.mask;
        let mut slots: Vec<u16> = (0..64u16).filter(|b| mask & (1u64 << b) != 0).collect();
        match e.pick {
            Pick::Exact => {}
            Pick::RandomOne => {
                let k = rng.below(slots.len() as u64) as usize;
                slots = slots.get(k).map(|&s| vec![s]).unwrap_or_default();
            }
            Pick::Lowest(n) => {
                slots.sort_by_key(|&s| perm[s as usize]);
                slots.truncate(usize::from(n));
            }
        }
        mask = 0;
        for s in &slots {
            mask |= 1 << s;
        }
        let devices = (0..64u16)
            .filter(|b| mask & (1u64 << b) != 0)
            .map(|slot| (perm[slot as usize], req.milli, req.memory_mib))
            .collect();
        Choice { node, devices }
    }

    /// Reserves what `shape` needs on the chosen node.
    pub fn commit(&mut self, shape: ShapeId, choice: &Choice) {
        self.apply(shape, choice.node, &choice.devices, true);
    }

    /// Returns what `shape` held on a node.
    pub fn release(&mut self, shape: ShapeId, choice: &Choice) {
        self.apply(shape, choice.node, &choice.devices, false);
    }

    fn apply(&mut self, shape: ShapeId, node: u32, devices: &[(u16, u16, u64)], take: bool) {
        let s = &self.shapes[shape as usize];
        let (cpu, mem, tag) = (s.cpu_milli, s.memory_mib, s.dev.map(|d| d.tag_bit()));
        let n = &mut self.nodes[node as usize];
        if take {
            n.cpu_free = n.cpu_free.saturating_sub(cpu);
            n.mem_free = n.mem_free.saturating_sub(mem);
        } else {
            n.cpu_free = n.cpu_free.saturating_add(cpu);
            n.mem_free = n.mem_free.saturating_add(mem);
        }
        for &(d, milli, m) in devices {
            let st = &mut n.devs[d as usize];
            if take {
                st.free_milli = st.free_milli.saturating_sub(milli);
                st.free_mem_mib = st.free_mem_mib.saturating_sub(m);
            } else {
                st.free_milli = (st.free_milli + milli).min(WHOLE_DEVICE_MILLI as u16);
                st.free_mem_mib = st.free_mem_mib.saturating_add(m);
            }
        }
        if let Some(t) = tag {
            let b = t.trailing_zeros() as usize;
            if take {
                n.tag_counts[b] = n.tag_counts[b].saturating_add(1);
            } else {
                n.tag_counts[b] = n.tag_counts[b].saturating_sub(1);
            }
        }
        self.reclass(node);
    }

    /// Reserves running work on a node by device id (from the committed state). Returns false
    /// when the node or a device is unknown or over-committed; the shares are clamped.
    pub fn occupy(
        &mut self,
        node: &NodeId,
        cpu_milli: u64,
        memory_mib: u64,
        shares: &[DeviceShare],
        dev: Option<DevReq>,
    ) -> bool {
        let Some(idx) = self.node_index(node) else { return false };
        let ok = self.take_running(idx, cpu_milli, memory_mib, shares, dev);
        self.reclass(idx);
        ok
    }

    /// [`Cluster::occupy`] for every running allocation of a pass at once: each touched node is
    /// moved to its class once at the end instead of once per allocation (a pass starts from
    /// tens of thousands of allocations on a few hundred nodes). The classes end up the same;
    /// only the order of a class's members can differ, which the fixed-order tie-break ignores.
    pub fn occupy_all<'x>(
        &mut self,
        allocs: impl IntoIterator<Item = (&'x NodeId, u64, u64, &'x [DeviceShare], Option<DevReq>)>,
    ) {
        let mut touched = vec![false; self.nodes.len()];
        for (node, cpu_milli, memory_mib, shares, dev) in allocs {
            if let Some(idx) = self.node_index(node) {
                self.take_running(idx, cpu_milli, memory_mib, shares, dev);
                touched[idx as usize] = true;
            }
        }
        for (idx, t) in touched.into_iter().enumerate() {
            if t {
                self.reclass(idx as u32);
            }
        }
    }

    /// The bookkeeping of [`Cluster::occupy`] without the class move.
    fn take_running(
        &mut self,
        idx: u32,
        cpu_milli: u64,
        memory_mib: u64,
        shares: &[DeviceShare],
        dev: Option<DevReq>,
    ) -> bool {
        let n = &mut self.nodes[idx as usize];
        let mut ok = n.cpu_free >= cpu_milli && n.mem_free >= memory_mib;
        n.cpu_free = n.cpu_free.saturating_sub(cpu_milli);
        n.mem_free = n.mem_free.saturating_sub(memory_mib);
        for sh in shares {
            match n.dev_ids.iter().position(|d| d == &sh.device) {
                Some(i) => {
                    let st = &mut n.devs[i];
                    ok &= u32::from(st.free_milli) >= sh.milli;
                    st.free_milli = st.free_milli.saturating_sub(sh.milli.min(1000) as u16);
                    st.free_mem_mib = st.free_mem_mib.saturating_sub(sh.memory_mib);
                }
                None => ok = false,
            }
        }
        if let Some(t) = dev.map(|d| d.tag_bit()) {
            let b = t.trailing_zeros() as usize;
            n.tag_counts[b] = n.tag_counts[b].saturating_add(1);
        }
        ok
    }

    /// Inverse of [`Cluster::occupy`]: returns a running allocation's resources.
    pub fn vacate(
        &mut self,
        node: &NodeId,
        cpu_milli: u64,
        memory_mib: u64,
        shares: &[DeviceShare],
        dev: Option<DevReq>,
    ) {
        let Some(idx) = self.node_index(node) else { return };
        let n = &mut self.nodes[idx as usize];
        n.cpu_free = n.cpu_free.saturating_add(cpu_milli);
        n.mem_free = n.mem_free.saturating_add(memory_mib);
        for sh in shares {
            if let Some(i) = n.dev_ids.iter().position(|d| d == &sh.device) {
                let st = &mut n.devs[i];
                st.free_milli = (u32::from(st.free_milli) + sh.milli).min(WHOLE_DEVICE_MILLI) as u16;
                st.free_mem_mib = st.free_mem_mib.saturating_add(sh.memory_mib);
            }
        }
        if let Some(t) = dev.map(|d| d.tag_bit()) {
            let b = t.trailing_zeros() as usize;
            n.tag_counts[b] = n.tag_counts[b].saturating_sub(1);
        }
        self.reclass(idx);
    }

    /// True when the node could ever host `shape`: allowed by its constraints, schedulable,
    /// big enough and carrying enough devices of an allowed model (current usage ignored).
    pub fn node_usable(&self, node: u32, shape: ShapeId) -> bool {
        let n = &self.nodes[node as usize];
        let s = &self.shapes[shape as usize];
        let g = &self.groups[n.group as usize];
        s.allows_group(n.group)
            && s.allows_node(node)
            && g.schedulable
            && g.cpu_milli >= s.cpu_milli
            && g.memory_mib >= s.memory_mib
            // Healthy devices only, as the plan checker's `usable_by` counts them: a node whose
            // matching devices are partly unhealthy must not have work stopped for a job that
            // cannot run there.
            && s.dev.is_none_or(|r| {
                g.devs
                    .iter()
                    .enumerate()
                    .filter(|(slot, d)| {
                        d.kind == r.kind
                            && s.models & (1u128 << d.model) != 0
                            && (!r.isolated || d.isolated)
                            && n.slot_dev.get(*slot).and_then(|&i| n.devs.get(usize::from(i))).is_some_and(|x| x.healthy)
                    })
                    .count()
                    >= r.count as usize
            })
    }

    /// Evaluates `shape` on one node only (used by preemption); held nodes never fit.
    pub fn choose_on(&mut self, node: u32, shape: ShapeId, policy: &dyn Policy, rng: &mut DetRng) -> Option<Choice> {
        let n = &self.nodes[node as usize];
        let s = &self.shapes[shape as usize];
        if n.held != 0 || !s.allows_group(n.group) || !s.allows_node(node) || !self.groups[n.group as usize].schedulable
        {
            return None;
        }
        let class = n.class;
        match self.eval_class(class, shape, policy) {
            Slot::Fit(e) => Some(self.resolve(node, &e, shape, rng)),
            _ => None,
        }
    }

    /// Device shares of a choice, with device ids.
    pub fn shares(&self, choice: &Choice) -> Vec<DeviceShare> {
        let n = &self.nodes[choice.node as usize];
        choice
            .devices
            .iter()
            .map(|&(d, milli, m)| DeviceShare {
                device: n.dev_ids[d as usize].clone(),
                milli: u32::from(milli),
                memory_mib: m,
            })
            .collect()
    }

    /// Records why nodes with `schedulable = false` take no new work (node ids not in this
    /// cluster are ignored). Used by [`Cluster::explain`] only: placement never reads it.
    pub fn set_unschedulable_reasons(&mut self, reasons: &BTreeMap<NodeId, String>) {
        self.unschedulable =
            reasons.iter().filter_map(|(id, why)| self.node_index.get(id).map(|&i| (i, why.clone()))).collect();
    }

    /// Tallies why each node cannot host `shape` (for operator-facing reasons). Works per
    /// class, so it costs O(active classes), not O(nodes).
    pub fn explain(&self, shape: ShapeId) -> MisfitTally {
        let s = &self.shapes[shape as usize];
        let mut t = MisfitTally { nodes: self.nodes.len() as u64, ..Default::default() };
        let mut listed = 0u64;
        for &ci in &self.active {
            let c = &self.classes[ci as usize];
            let g = &self.groups[c.group as usize];
            let mut n = c.members.len() as u64;
            listed += n;
            if s.nodes.is_some() {
                let excluded = c.members.iter().filter(|&&m| !s.allows_node(m)).count() as u64;
                if excluded > 0 {
                    *t.reasons.entry("excluded by node constraints".to_owned()).or_default() += excluded;
                    n -= excluded;
                    if n == 0 {
                        continue;
                    }
                }
            }
            let reason = if !s.allows_group(c.group) {
                Some("excluded by pool/region/label constraints".to_owned())
            } else if !g.schedulable {
                // Each node its own word: down, draining, cordoned, not schedulable: <why>.
                for m in c.members.iter().filter(|&&m| s.allows_node(m)) {
                    let why = self.unschedulable.get(m).map_or("cordoned", String::as_str);
                    *t.reasons.entry(why.to_owned()).or_default() += 1;
                }
                continue;
            } else {
                crate::policy::misfit(
                    g,
                    &NodeView { cpu_free: c.cpu_free, mem_free: c.mem_free, devs: &c.devs, tags: 0 },
                    s,
                    &self.models,
                )
            };
            match reason {
                None => t.fit += n,
                Some(r) => *t.reasons.entry(r).or_default() += n,
            }
        }
        let held = t.nodes.saturating_sub(listed);
        let draining = self.draining_only.min(held);
        if held > draining {
            *t.reasons.entry("reserved for a blocked higher-priority job".to_owned()).or_default() += held - draining;
        }
        if draining > 0 {
            *t.reasons
                .entry("freed by preemption in this pass for another job (in use until its victims stop)".to_owned())
                .or_default() += draining;
        }
        t
    }
}
