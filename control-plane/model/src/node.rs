//! Nodes: capacity, devices, placement attributes.

use crate::error::{ValidationError, check_name, check_optional_name, check_range, check_value};
use crate::{Device, DeviceKind, Limits, NodeId, PoolId, ResVec, WHOLE_DEVICE_MILLI};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A machine that runs tasks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// Unique name.
    pub id: NodeId,
    /// The pool it belongs to.
    pub pool: PoolId,
    /// Datacenter (availability zone).
    #[serde(default)]
    pub datacenter: String,
    /// Region.
    #[serde(default)]
    pub region: String,
    /// Free-form labels matched by `constraints.labels`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Allocatable CPU in milli-cores.
    pub cpu_milli: u64,
    /// Allocatable memory in MiB.
    pub memory_mib: u64,
    /// Accelerators.
    #[serde(default)]
    pub devices: Vec<Device>,
    /// False when cordoned or draining: no new placements.
    #[serde(default = "yes")]
    pub schedulable: bool,
    /// Where the node's agent serves task logs (`host:port`); empty when unknown.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agent_addr: String,
}

fn yes() -> bool {
    true
}

impl Node {
    /// Total capacity as a resource vector (healthy and unhealthy devices alike).
    pub fn capacity(&self) -> ResVec {
        let mut v = ResVec { cpu_milli: self.cpu_milli, memory_mib: self.memory_mib, ..ResVec::ZERO };
        for d in &self.devices {
            match d.kind {
                DeviceKind::Gpu => v.gpu_milli += u64::from(WHOLE_DEVICE_MILLI),
                DeviceKind::Npu => v.npu_milli += u64::from(WHOLE_DEVICE_MILLI),
            }
        }
        v
    }

    /// Checks names, bounds and device id uniqueness.
    pub fn validate(&self, limits: &Limits) -> Result<(), ValidationError> {
        check_name(|| "node.id".into(), self.id.as_str(), limits.max_name_len)?;
        check_name(|| "node.pool".into(), self.pool.as_str(), limits.max_name_len)?;
        check_optional_name(|| "node.datacenter".into(), &self.datacenter, limits.max_name_len)?;
        check_optional_name(|| "node.region".into(), &self.region, limits.max_name_len)?;
        check_labels("node.labels", &self.labels, limits)?;
        check_value(|| "node.agent_addr".into(), &self.agent_addr, limits.max_name_len)?;
        check_range(|| "node.cpu_milli".into(), self.cpu_milli, 0, u64::MAX / 4)?;
        check_range(|| "node.memory_mib".into(), self.memory_mib, 0, u64::MAX / 4)?;
        if self.devices.len() > limits.max_devices_per_node {
            return Err(ValidationError::OutOfRange {
                field: "node.devices".into(),
                value: self.devices.len().to_string(),
                limit: format!("at most {} devices per node", limits.max_devices_per_node),
            });
        }
        let mut seen = BTreeSet::new();
        for (i, d) in self.devices.iter().enumerate() {
            check_name(|| format!("node.devices[{i}].id"), &d.id, limits.max_name_len)?;
            if d.model.is_empty() {
                return Err(ValidationError::Empty { field: format!("node.devices[{i}].model") });
            }
            check_value(|| format!("node.devices[{i}].model"), &d.model, limits.max_name_len)?;
            if let Some(p) = &d.partition_of {
                check_name(|| format!("node.devices[{i}].partition_of"), p, limits.max_name_len)?;
            }
            if !seen.insert(d.id.as_str()) {
                return Err(ValidationError::Invalid {
                    field: format!("node.devices[{i}].id"),
                    message: format!("duplicate device id {:?}", d.id),
                });
            }
        }
        Ok(())
    }
}

/// Checks a label map (a node's labels, a job's `constraints.labels`): keys are names, values
/// are short values (possibly empty). `at` is the map's field path.
pub(crate) fn check_labels(
    at: &str,
    labels: &BTreeMap<String, String>,
    limits: &Limits,
) -> Result<(), ValidationError> {
    for (k, v) in labels {
        let field = || crate::error::key_path(at, k);
        check_name(field, k, limits.max_name_len)?;
        check_value(field, v, limits.max_label_value_len)?;
    }
    Ok(())
}
