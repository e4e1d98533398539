//! The scheduling plan: the engine's output, committed through Raft and re-checked at apply.

use crate::{AllocId, JobId, NodeId};
use serde::{Deserialize, Serialize};

/// A share of one device given to a task.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceShare {
    /// Device id on the node.
    pub device: String,
    /// Milli-units of the device (1000 = whole).
    pub milli: u32,
    /// Device memory slice, MiB (0 = none reserved).
    #[serde(default)]
    pub memory_mib: u64,
}

/// One task replica placed on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The job.
    pub job: JobId,
    /// Task group index.
    pub group: u32,
    /// Replica index.
    pub replica: u32,
    /// Chosen node.
    pub node: NodeId,
    /// CPU reserved.
    pub cpu_milli: u64,
    /// Memory reserved.
    pub memory_mib: u64,
    /// Device shares reserved.
    pub devices: Vec<DeviceShare>,
    /// True when the job was admitted on quota borrowed from the cohort (preemptible by the
    /// lender).
    pub borrowed: bool,
}

/// Why a preemption was planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreemptionReason {
    /// A higher-priority job needs the capacity.
    HigherPriority,
    /// The victim runs on borrowed quota that its lender now claims.
    ReclaimBorrowed,
}

/// An allocation to stop so that a waiting job can run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preemption {
    /// The victim allocation.
    pub alloc: AllocId,
    /// Its job.
    pub job: JobId,
    /// Its node.
    pub node: NodeId,
    /// The job the capacity is freed for.
    pub for_job: JobId,
    /// Why.
    pub reason: PreemptionReason,
    /// Ask the task to checkpoint before stopping.
    pub checkpoint_first: bool,
    /// How long to wait for that checkpoint, in seconds.
    pub grace_s: u64,
}

/// A job left waiting, with a reason an operator can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unplaced {
    /// The job.
    pub job: JobId,
    /// E.g. "0/1213 nodes fit: 800 insufficient gpu, 300 gpu model not in [V100M32], 113 unhealthy".
    pub reason: String,
}

/// Capacity held for a blocked high-priority job: backfill may not delay it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// The head job being protected.
    pub job: JobId,
    /// When it is expected to start (seconds), given running jobs' estimates.
    pub start_at: u64,
    /// Nodes reserved for it.
    pub nodes: Vec<NodeId>,
}

/// Everything one scheduling pass decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Plan {
    /// New placements.
    pub placements: Vec<Placement>,
    /// Allocations to stop first.
    pub preemptions: Vec<Preemption>,
    /// Jobs that stay pending, with reasons.
    pub unplaced: Vec<Unplaced>,
    /// Reservations for blocked head jobs (backfill respected them).
    pub reservations: Vec<Reservation>,
}
