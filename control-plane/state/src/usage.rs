//! Resource usage derived from live allocations: per node, per device, per queue.

use crate::records::{Alloc, Job, JobState, NodeRecord};
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{AllocId, DeviceKind, JobId, NodeId, QueueId, ResVec};

/// CPU and memory in use on one node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NodeUse {
    pub cpu_milli: u64,
    pub memory_mib: u64,
}

/// Share and memory slice in use on one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DevUse {
    pub milli: u64,
    pub memory_mib: u64,
}

/// Usage of every node and device by live allocations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub nodes: BTreeMap<NodeId, NodeUse>,
    pub devices: BTreeMap<NodeId, BTreeMap<String, DevUse>>,
}

impl Usage {
    pub fn of<'a>(allocs: impl Iterator<Item = &'a Alloc>) -> Self {
        let mut u = Usage::default();
        for a in allocs.filter(|a| a.is_live()) {
            u.add(&a.alloc.node, a.alloc.cpu_milli, a.alloc.memory_mib, &a.alloc.devices, 1);
        }
        u
    }

    /// Adds (`sign` = 1) or removes (`sign` = -1) one allocation's resources.
    pub fn add(
        &mut self,
        node: &NodeId,
        cpu_milli: u64,
        memory_mib: u64,
        devices: &[suanli_model::DeviceShare],
        sign: i8,
    ) {
        // Look up before inserting: the key is cloned only the first time a node is seen.
        if !self.nodes.contains_key(node) {
            self.nodes.insert(node.clone(), NodeUse::default());
        }
        let Some(n) = self.nodes.get_mut(node) else {
            return;
        };
        if sign > 0 {
            n.cpu_milli = n.cpu_milli.saturating_add(cpu_milli);
            n.memory_mib = n.memory_mib.saturating_add(memory_mib);
        } else {
            n.cpu_milli = n.cpu_milli.saturating_sub(cpu_milli);
            n.memory_mib = n.memory_mib.saturating_sub(memory_mib);
        }
        if devices.is_empty() {
            return;
        }
        if !self.devices.contains_key(node) {
            self.devices.insert(node.clone(), BTreeMap::new());
        }
        let Some(devs) = self.devices.get_mut(node) else {
            return;
        };
        for s in devices {
            if !devs.contains_key(&s.device) {
                devs.insert(s.device.clone(), DevUse::default());
            }
            let Some(d) = devs.get_mut(&s.device) else {
                continue;
            };
            if sign > 0 {
                d.milli = d.milli.saturating_add(u64::from(s.milli));
                d.memory_mib = d.memory_mib.saturating_add(s.memory_mib);
            } else {
                d.milli = d.milli.saturating_sub(u64::from(s.milli));
                d.memory_mib = d.memory_mib.saturating_sub(s.memory_mib);
            }
        }
    }

    /// The same usage with nodes and devices that use nothing left out (an index that saw
    /// allocations come and go keeps zero entries a fresh count never creates).
    pub fn nonzero(&self) -> Usage {
        let nodes =
            self.nodes.iter().filter(|(_, u)| **u != NodeUse::default()).map(|(k, u)| (k.clone(), *u)).collect();
        let devices = self
            .devices
            .iter()
            .map(|(k, d)| {
                let d: BTreeMap<String, DevUse> =
                    d.iter().filter(|(_, u)| **u != DevUse::default()).map(|(k, u)| (k.clone(), *u)).collect();
                (k.clone(), d)
            })
            .filter(|(_, d)| !d.is_empty())
            .collect();
        Usage { nodes, devices }
    }

    pub fn node(&self, node: &NodeId) -> NodeUse {
        self.nodes.get(node).copied().unwrap_or_default()
    }

    pub fn device(&self, node: &NodeId, device: &str) -> DevUse {
        self.devices.get(node).and_then(|d| d.get(device)).copied().unwrap_or_default()
    }
}

/// The quota vector of an allocation: CPU, memory, and device shares by the kind the node
/// reports for each device (an unknown device counts as a GPU share).
pub(crate) fn alloc_resvec(a: &Alloc, nodes: &BTreeMap<NodeId, NodeRecord>) -> ResVec {
    let mut v = ResVec { cpu_milli: a.alloc.cpu_milli, memory_mib: a.alloc.memory_mib, ..ResVec::ZERO };
    let rec = nodes.get(&a.alloc.node);
    for s in &a.alloc.devices {
        let kind =
            rec.and_then(|r| r.node.devices.iter().find(|d| d.id == s.device)).map_or(DeviceKind::Gpu, |d| d.kind);
        match kind {
            DeviceKind::Gpu => v.gpu_milli += u64::from(s.milli),
            DeviceKind::Npu => v.npu_milli += u64::from(s.milli),
        }
    }
    v
}

/// Live usage per queue, split into what runs on the queue's own quota and what is borrowed.
pub(crate) fn queue_usage(
    allocs: &BTreeMap<AllocId, Alloc>,
    nodes: &BTreeMap<NodeId, NodeRecord>,
) -> BTreeMap<QueueId, (ResVec, ResVec)> {
    let mut out: BTreeMap<QueueId, (ResVec, ResVec)> = BTreeMap::new();
    for a in allocs.values().filter(|a| a.is_live()) {
        let v = alloc_resvec(a, nodes);
        let e = out.entry(a.alloc.queue.clone()).or_default();
        if a.alloc.borrowed {
            e.1 += v;
        } else {
            e.0 += v;
        }
    }
    out
}

/// What live allocations use, maintained as allocations start ([`LiveIndex::add`] with sign 1)
/// and end (sign -1), so applying a plan costs O(plan) instead of O(live allocations). It is
/// derived state: never serialized, rebuilt by [`LiveIndex::build`] after a restore and after
/// a node's inventory changes (device kinds decide the quota vector), and checked against a
/// fresh count by the `live-index` invariant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LiveIndex {
    /// Node and device usage.
    pub usage: Usage,
    /// Per queue: live allocations and their summed quota vector (borrowed or not).
    pub queues: BTreeMap<QueueId, (usize, ResVec)>,
    /// Live allocations.
    pub count: usize,
    /// Every retained allocation (live or ended) by node, for agents' watches and node and
    /// pool listings.
    pub by_node: BTreeMap<NodeId, BTreeSet<AllocId>>,
    /// Jobs in the pending state (the scheduler's candidates), so a pass does not walk every
    /// live job.
    pub pending: BTreeSet<JobId>,
}

impl LiveIndex {
    /// Counts every live allocation afresh.
    pub fn build(
        allocs: &BTreeMap<AllocId, Alloc>,
        nodes: &BTreeMap<NodeId, NodeRecord>,
        jobs: &BTreeMap<JobId, Job>,
    ) -> Self {
        let mut x = LiveIndex {
            pending: jobs.values().filter(|j| j.state == JobState::Pending).map(|j| j.id).collect(),
            ..LiveIndex::default()
        };
        for a in allocs.values() {
            x.retain(a);
            if a.is_live() {
                x.add(a, nodes, 1);
            }
        }
        x
    }

    /// Adds (`sign` = 1) or removes (`sign` = -1) one live allocation.
    pub fn add(&mut self, a: &Alloc, nodes: &BTreeMap<NodeId, NodeRecord>, sign: i8) {
        self.usage.add(&a.alloc.node, a.alloc.cpu_milli, a.alloc.memory_mib, &a.alloc.devices, sign);
        self.account(a, nodes, sign);
    }

    /// Like [`LiveIndex::add`] without node and device usage (a plan being applied reserves
    /// that itself while it re-checks placements).
    pub fn account(&mut self, a: &Alloc, nodes: &BTreeMap<NodeId, NodeRecord>, sign: i8) {
        let v = alloc_resvec(a, nodes);
        let q = &a.alloc.queue;
        if sign > 0 {
            self.count += 1;
            match self.queues.get_mut(q) {
                Some(e) => {
                    e.0 += 1;
                    e.1 += v;
                }
                None => {
                    self.queues.insert(q.clone(), (1, v));
                }
            }
        } else {
            self.count = self.count.saturating_sub(1);
            if let Some(e) = self.queues.get_mut(q) {
                e.0 = e.0.saturating_sub(1);
                e.1 = e.1.saturating_sub(&v);
                if e.0 == 0 {
                    self.queues.remove(q);
                }
            }
        }
    }

    /// Records a new allocation (live or not) under its node.
    pub fn retain(&mut self, a: &Alloc) {
        match self.by_node.get_mut(&a.alloc.node) {
            Some(set) => {
                set.insert(a.alloc.id);
            }
            None => {
                self.by_node.insert(a.alloc.node.clone(), BTreeSet::from([a.alloc.id]));
            }
        }
    }

    /// Forgets an allocation removed from the state.
    pub fn forget(&mut self, a: &Alloc) {
        if let Some(set) = self.by_node.get_mut(&a.alloc.node) {
            set.remove(&a.alloc.id);
            if set.is_empty() {
                self.by_node.remove(&a.alloc.node);
            }
        }
    }

    /// Which part differs from `other` (zero entries left out), if any.
    pub fn differs_from(&self, other: &LiveIndex) -> Option<&'static str> {
        if self.count != other.count {
            Some("live allocation count")
        } else if self.queues != other.queues {
            Some("per-queue usage")
        } else if self.by_node != other.by_node {
            Some("allocations by node")
        } else if self.pending != other.pending {
            Some("pending jobs")
        } else if self.usage.nonzero() != other.usage.nonzero() {
            Some("node and device usage")
        } else {
            None
        }
    }
}
