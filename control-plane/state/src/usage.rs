//! Resource usage derived from live allocations: per node, per device, per queue.

use crate::records::{Alloc, NodeRecord};
use std::collections::BTreeMap;
use suanli_model::{AllocId, DeviceKind, NodeId, QueueId, ResVec};

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
#[derive(Debug, Clone, Default)]
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
        let n = self.nodes.entry(node.clone()).or_default();
        if sign > 0 {
            n.cpu_milli = n.cpu_milli.saturating_add(cpu_milli);
            n.memory_mib = n.memory_mib.saturating_add(memory_mib);
        } else {
            n.cpu_milli = n.cpu_milli.saturating_sub(cpu_milli);
            n.memory_mib = n.memory_mib.saturating_sub(memory_mib);
        }
        let devs = self.devices.entry(node.clone()).or_default();
        for s in devices {
            let d = devs.entry(s.device.clone()).or_default();
            if sign > 0 {
                d.milli = d.milli.saturating_add(u64::from(s.milli));
                d.memory_mib = d.memory_mib.saturating_add(s.memory_mib);
            } else {
                d.milli = d.milli.saturating_sub(u64::from(s.milli));
                d.memory_mib = d.memory_mib.saturating_sub(s.memory_mib);
            }
        }
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
