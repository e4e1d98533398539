//! Explicit, configurable limits for everything a user can send.

use serde::{Deserialize, Serialize};

/// Bounds applied when validating specs, nodes and queues. Every limit is configurable; the
/// defaults are generous for real clusters and small enough that one bad request cannot
/// exhaust a server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Limits {
    /// Longest name or id (job, group, queue, team, cohort, node, pool, region, datacenter,
    /// device id and model, label key), in bytes.
    pub max_name_len: usize,
    /// Longest label value (in a node's labels or a job's `constraints.labels`), in bytes.
    pub max_label_value_len: usize,
    /// Most task groups in one job.
    pub max_groups: usize,
    /// Most replicas in one task group.
    pub max_replicas: u32,
    /// Most devices one task may ask for.
    pub max_devices_per_task: u32,
    /// Largest CPU request of one task, in milli-cores (default: 1,024 cores).
    pub max_cpu_milli: u64,
    /// Largest memory request of one task, in MiB (default: 16 TiB).
    pub max_memory_mib: u64,
    /// Largest device memory slice, in MiB (default: 1 TiB).
    pub max_device_memory_mib: u64,
    /// Largest absolute priority.
    pub max_priority: i32,
    /// Most constraint entries (pools, regions, models, labels) of each kind.
    pub max_constraints: usize,
    /// Most devices on one node.
    pub max_devices_per_node: usize,
    /// Longest runtime estimate or grace period, in seconds (default: 1 year).
    pub max_duration_s: u64,
    /// Most bytes in one task's command, args, env and workdir together (default: 64 KiB).
    pub max_task_bytes: usize,
    /// Most args or env entries of one task.
    pub max_task_entries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_name_len: 253,
            max_label_value_len: 256,
            max_groups: 64,
            max_replicas: 10_000,
            max_devices_per_task: 64,
            max_cpu_milli: 1024 * 1000,
            max_memory_mib: 16 * 1024 * 1024,
            max_device_memory_mib: 1024 * 1024,
            max_priority: 1_000_000,
            max_constraints: 64,
            max_devices_per_node: 256,
            max_duration_s: 365 * 24 * 3600,
            max_task_bytes: 64 * 1024,
            max_task_entries: 1024,
        }
    }
}
