//! Devices (GPUs, NPUs) with model, memory, health and topology.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The kind of an accelerator. CPU and memory are node resources, not devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// A GPU (NVIDIA, AMD, ...), or a MIG partition of one.
    Gpu,
    /// An NPU (Ascend, ...), or a vNPU partition of one.
    Npu,
}

impl DeviceKind {
    /// The lowercase name used in specs and messages.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeviceKind::Gpu => "gpu",
            DeviceKind::Npu => "npu",
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a device may receive new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Usable.
    #[default]
    Healthy,
    /// Reported broken (XID error, ECC, plugin down): no new placements; its work is moved.
    Unhealthy,
}

/// How far a fractional share of a device is limited by the node, not only accounted by the
/// scheduler (docs/services.md, "Isolation of shared GPUs").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ShareIsolation {
    /// The task is told its share (`SUANLI_GPU_MILLI`) and nothing on the node holds it to it:
    /// co-located shares rely on the scheduler's accounting and the tasks' restraint. What a
    /// device is unless its plugin says otherwise.
    #[default]
    Advisory,
    /// The plugin limits each share (an MPS control daemon with per-client active-thread and
    /// pinned-memory limits, a vNPU): a task cannot take more compute threads or device memory
    /// than it was given.
    Enforced,
}

impl ShareIsolation {
    /// The lowercase name used in specs and listings.
    pub fn as_str(&self) -> &'static str {
        match self {
            ShareIsolation::Advisory => "advisory",
            ShareIsolation::Enforced => "enforced",
        }
    }
    /// True for the default ([`ShareIsolation::Advisory`]).
    pub fn is_advisory(&self) -> bool {
        *self == ShareIsolation::Advisory
    }
}

impl fmt::Display for ShareIsolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One schedulable device on a node. A MIG or vNPU partition is a device of its own whose
/// `partition_of` names the physical device.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Device {
    /// Id unique on the node (the plugin's id: index, UUID or MIG UUID).
    pub id: String,
    /// GPU or NPU.
    pub kind: DeviceKind,
    /// Model name, matched against `constraints.device_models` (e.g. `A100-80G`, `V100M32`).
    pub model: String,
    /// Device memory in MiB (0 when unknown).
    #[serde(default)]
    pub memory_mib: u64,
    /// Health as last reported.
    #[serde(default)]
    pub health: Health,
    /// NUMA node the device is attached to.
    #[serde(default)]
    pub numa: u32,
    /// NVLink / HCCS island: devices with the same value are linked peer-to-peer. `None` when
    /// the device has no fast peer links.
    #[serde(default)]
    pub peer_group: Option<u32>,
    /// For a partition (MIG, vNPU), the id of the physical device it is carved from.
    #[serde(default)]
    pub partition_of: Option<String>,
    /// Whether fractional shares of it are limited on the node (its plugin's report).
    #[serde(default, skip_serializing_if = "ShareIsolation::is_advisory")]
    pub share_isolation: ShareIsolation,
}

impl Device {
    /// A healthy device with no topology information, handy for tests and traces.
    pub fn simple(id: impl Into<String>, kind: DeviceKind, model: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            kind,
            model: model.into(),
            memory_mib: 0,
            health: Health::Healthy,
            numa: 0,
            peer_group: None,
            partition_of: None,
            share_isolation: ShareIsolation::Advisory,
        }
    }
}
