//! Why apply refused part of a plan: one variant per re-check, so refusals can be counted by
//! kind ([`RefusalReason::kind`]); the Display text is the operator-facing message a pending
//! job shows as its reason.

use crate::command::NodeMode;
use crate::records::NodeStatus;
use serde::{Deserialize, Serialize};
use suanli_model::{AllocId, DeviceKind, JobId, NodeId};
use suanli_scheduler::QuotaError;
use thiserror::Error;

/// A placement or preemption of a plan that no longer holds at the log index it is applied at.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RefusalReason {
    // ---- preemptions -------------------------------------------------------------------
    /// The victim allocation is not in the state.
    #[error("allocation {alloc} is gone")]
    AllocGone {
        /// The victim.
        alloc: AllocId,
    },
    /// The victim already ended.
    #[error("allocation {alloc} already ended")]
    AllocEnded {
        /// The victim.
        alloc: AllocId,
    },
    /// The victim is already being stopped.
    #[error("allocation {alloc} is already stopping")]
    AllocStopping {
        /// The victim.
        alloc: AllocId,
    },
    /// The plan names the victim with another job or node.
    #[error("allocation {alloc} belongs to job {job} on {node}")]
    AllocMismatch {
        /// The victim.
        alloc: AllocId,
        /// Its actual job.
        job: JobId,
        /// Its actual node.
        node: NodeId,
    },
    /// The victim's job is not preemptible.
    #[error("allocation {alloc} is not preemptible")]
    NotPreemptible {
        /// The victim.
        alloc: AllocId,
    },
    /// The job the capacity is freed for left the pending state.
    #[error("job {job} is no longer pending")]
    BeneficiaryNotPending {
        /// The job the preemption was for.
        job: JobId,
    },
    /// Neither outranked nor borrowed from another queue.
    #[error(
        "allocation {alloc} (priority {priority}, borrowed {borrowed}) may not be preempted for job {for_job} (priority {for_priority})"
    )]
    NotOutranked {
        /// The victim.
        alloc: AllocId,
        /// Its priority.
        priority: i32,
        /// Whether it runs on borrowed quota.
        borrowed: bool,
        /// The job the preemption was for.
        for_job: JobId,
        /// That job's priority.
        for_priority: i32,
    },

    // ---- a job's placements ------------------------------------------------------------
    /// The job is not in the state.
    #[error("job {job} is gone")]
    JobGone {
        /// The job.
        job: JobId,
    },
    /// The job is not pending any more.
    #[error("job {job} is {state}, not pending")]
    JobNotPending {
        /// The job.
        job: JobId,
        /// Its state's name.
        state: String,
    },
    /// The job waits out its retry backoff.
    #[error("job {job} is in retry backoff until t={until}")]
    InBackoff {
        /// The job.
        job: JobId,
        /// End of the backoff (seconds).
        until: u64,
    },
    /// An earlier attempt of the job still has live allocations.
    #[error("job {job} still has live allocations")]
    StillLive {
        /// The job.
        job: JobId,
    },
    /// The cluster-wide bound on live allocations (`StateConfig::max_live_allocs`).
    #[error("too many live allocations: the limit is {limit}")]
    TooManyLiveAllocs {
        /// The bound.
        limit: usize,
    },
    /// A placement names a task group the job does not have.
    #[error("job {job} has no task group {group}")]
    NoSuchGroup {
        /// The job.
        job: JobId,
        /// The group index.
        group: u32,
    },
    /// A placement names a replica index beyond the group's count.
    #[error("group {group} has {replicas} replicas; replica {replica} is out of range")]
    ReplicaOutOfRange {
        /// The group's name.
        group: String,
        /// Its replica count.
        replicas: u32,
        /// The index placed.
        replica: u32,
    },
    /// The same replica appears twice in the plan.
    #[error("replica {group}/{replica} is placed twice")]
    ReplicaTwice {
        /// The group's name.
        group: String,
        /// The replica index.
        replica: u32,
    },
    /// Fewer replicas than a gang (all) or an elastic group (its minimum) needs still fit.
    #[error("group {group}: {fit} of {need} required replicas still fit")]
    GroupShort {
        /// The group's name.
        group: String,
        /// Replicas that fit.
        fit: u32,
        /// Replicas required.
        need: u32,
    },
    /// The queue's quota no longer admits the job.
    #[error("{quota}")]
    Quota {
        /// The quota rule that refused.
        quota: QuotaError,
    },

    // ---- one replica on its node -------------------------------------------------------
    /// The node is not in the state.
    #[error("node {node} is gone")]
    NodeGone {
        /// The node.
        node: NodeId,
    },
    /// The node reports resource pressure.
    #[error("node {node} is under {pressure}")]
    NodePressure {
        /// The node.
        node: NodeId,
        /// The conditions reported.
        pressure: String,
    },
    /// The node is down, draining or cordoned.
    #[error("node {node} is {status:?}/{mode:?}")]
    NodeNotAccepting {
        /// The node.
        node: NodeId,
        /// Reachability.
        status: NodeStatus,
        /// Operator mode.
        mode: NodeMode,
    },
    /// The node is outside the job's pools.
    #[error("node {node} is in pool {pool}, not in the job's pools")]
    OutsidePools {
        /// The node.
        node: NodeId,
        /// Its pool.
        pool: String,
    },
    /// The node is outside the job's regions.
    #[error("node {node} is in region {region:?}, not in the job's regions")]
    OutsideRegions {
        /// The node.
        node: NodeId,
        /// Its region.
        region: String,
    },
    /// The node lacks a label the job requires.
    #[error("node {node} lacks label {key}={value}")]
    MissingLabel {
        /// The node.
        node: NodeId,
        /// The label key.
        key: String,
        /// The value required.
        value: String,
    },
    /// The node is not among the job's allowed nodes (`constraints.nodes`).
    #[error("node {node} is not among the job's node constraints")]
    NodeNotAllowed {
        /// The node.
        node: NodeId,
    },
    /// The job must avoid the node (`constraints.avoid_nodes`, e.g. it just failed there).
    #[error("node {node} is one the job must avoid")]
    NodeAvoided {
        /// The node.
        node: NodeId,
    },
    /// A MIG partition and its physical parent device would be in use at once.
    #[error("device {device} on {node} shares its physical GPU with {other}, which is in use")]
    MigConflict {
        /// The device asked for.
        device: String,
        /// The node.
        node: NodeId,
        /// The parent or partition of it that is in use (or asked for by the same placement).
        other: String,
    },
    /// The placement reserves less CPU or memory than the task asks.
    #[error("placement on {node} reserves less cpu or memory than the task asks")]
    ReservesLess {
        /// The node.
        node: NodeId,
    },
    /// The node's CPU is full.
    #[error("node {node}: cpu_milli {used} + {asked} > {capacity}")]
    CpuFull {
        /// The node.
        node: NodeId,
        /// In use.
        used: u64,
        /// Asked by the placement.
        asked: u64,
        /// The node's capacity.
        capacity: u64,
    },
    /// The node's memory is full.
    #[error("node {node}: memory_mib {used} + {asked} > {capacity}")]
    MemoryFull {
        /// The node.
        node: NodeId,
        /// In use.
        used: u64,
        /// Asked by the placement.
        asked: u64,
        /// The node's capacity.
        capacity: u64,
    },
    /// A CPU-only task's placement holds devices.
    #[error("group {group} asks for no devices but the placement holds some")]
    UnexpectedDevices {
        /// The group's name.
        group: String,
    },
    /// The placement holds another number of devices than the task asks.
    #[error("group {group} asks for {asked} devices; the placement holds {held}")]
    DeviceCount {
        /// The group's name.
        group: String,
        /// Devices asked.
        asked: u32,
        /// Devices held.
        held: usize,
    },
    /// One device appears twice in a replica.
    #[error("device {device} is placed twice in one replica")]
    DeviceTwice {
        /// The device.
        device: String,
    },
    /// The node has no such device.
    #[error("node {node} has no device {device}")]
    NoSuchDevice {
        /// The node.
        node: NodeId,
        /// The device.
        device: String,
    },
    /// The device is of another kind than the task asks.
    #[error("device {device} on {node} is a {found}, the task asks for {asked}")]
    WrongKind {
        /// The device.
        device: String,
        /// Its node.
        node: NodeId,
        /// Its kind.
        found: DeviceKind,
        /// The kind asked.
        asked: DeviceKind,
    },
    /// The device is unhealthy.
    #[error("device {device} on {node} is unhealthy")]
    UnhealthyDevice {
        /// The device.
        device: String,
        /// Its node.
        node: NodeId,
    },
    /// The device's model is not among the job's allowed models.
    #[error("device {device} on {node} is a {model}, not an allowed model")]
    ModelNotAllowed {
        /// The device.
        device: String,
        /// Its node.
        node: NodeId,
        /// Its model.
        model: String,
    },
    /// The share differs from the task's request (or is 0 or over a whole device).
    #[error("device {device} share is {milli} milli; the task asks for {asked}")]
    ShareMismatch {
        /// The device.
        device: String,
        /// The share placed.
        milli: u32,
        /// The share asked.
        asked: u32,
    },
    /// The device memory slice is smaller than asked.
    #[error("device {device} memory slice {slice} MiB < {asked} MiB asked")]
    MemorySliceShort {
        /// The device.
        device: String,
        /// The slice placed.
        slice: u64,
        /// The slice asked.
        asked: u64,
    },
    /// The device's shares would pass a whole device.
    #[error("device {device} on {node}: {used} + {asked} milli > 1000")]
    DeviceFull {
        /// The device.
        device: String,
        /// Its node.
        node: NodeId,
        /// Milli in use.
        used: u64,
        /// Milli asked.
        asked: u32,
    },
    /// The device's memory slices would pass its memory.
    #[error("device {device} on {node}: memory {used} + {asked} MiB > {capacity} MiB")]
    DeviceMemoryFull {
        /// The device.
        device: String,
        /// Its node.
        node: NodeId,
        /// MiB in use.
        used: u64,
        /// MiB asked.
        asked: u64,
        /// The device's memory.
        capacity: u64,
    },
}

impl From<QuotaError> for RefusalReason {
    fn from(quota: QuotaError) -> Self {
        RefusalReason::Quota { quota }
    }
}

impl RefusalReason {
    /// The kind, in snake case (as serialized in `kind`): a label for counting refusals.
    pub fn kind(&self) -> &'static str {
        use RefusalReason as R;
        match self {
            R::AllocGone { .. } => "alloc_gone",
            R::AllocEnded { .. } => "alloc_ended",
            R::AllocStopping { .. } => "alloc_stopping",
            R::AllocMismatch { .. } => "alloc_mismatch",
            R::NotPreemptible { .. } => "not_preemptible",
            R::BeneficiaryNotPending { .. } => "beneficiary_not_pending",
            R::NotOutranked { .. } => "not_outranked",
            R::JobGone { .. } => "job_gone",
            R::JobNotPending { .. } => "job_not_pending",
            R::InBackoff { .. } => "in_backoff",
            R::StillLive { .. } => "still_live",
            R::TooManyLiveAllocs { .. } => "too_many_live_allocs",
            R::NoSuchGroup { .. } => "no_such_group",
            R::ReplicaOutOfRange { .. } => "replica_out_of_range",
            R::ReplicaTwice { .. } => "replica_twice",
            R::GroupShort { .. } => "group_short",
            R::Quota { .. } => "quota",
            R::NodeGone { .. } => "node_gone",
            R::NodePressure { .. } => "node_pressure",
            R::NodeNotAccepting { .. } => "node_not_accepting",
            R::OutsidePools { .. } => "outside_pools",
            R::OutsideRegions { .. } => "outside_regions",
            R::MissingLabel { .. } => "missing_label",
            R::NodeNotAllowed { .. } => "node_not_allowed",
            R::NodeAvoided { .. } => "node_avoided",
            R::MigConflict { .. } => "mig_conflict",
            R::ReservesLess { .. } => "reserves_less",
            R::CpuFull { .. } => "cpu_full",
            R::MemoryFull { .. } => "memory_full",
            R::UnexpectedDevices { .. } => "unexpected_devices",
            R::DeviceCount { .. } => "device_count",
            R::DeviceTwice { .. } => "device_twice",
            R::NoSuchDevice { .. } => "no_such_device",
            R::WrongKind { .. } => "wrong_kind",
            R::UnhealthyDevice { .. } => "unhealthy_device",
            R::ModelNotAllowed { .. } => "model_not_allowed",
            R::ShareMismatch { .. } => "share_mismatch",
            R::MemorySliceShort { .. } => "memory_slice_short",
            R::DeviceFull { .. } => "device_full",
            R::DeviceMemoryFull { .. } => "device_memory_full",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `kind()` is the serialized tag, so a count by kind reads the same in logs and JSON.
    #[test]
    fn kind_is_the_serialized_tag() {
        let node = NodeId::from("n1");
        let all = [
            RefusalReason::AllocGone { alloc: AllocId(1) },
            RefusalReason::NotOutranked {
                alloc: AllocId(1),
                priority: 0,
                borrowed: false,
                for_job: JobId(2),
                for_priority: 0,
            },
            RefusalReason::GroupShort { group: "w".into(), fit: 1, need: 2 },
            RefusalReason::Quota { quota: QuotaError::UnknownQueue { queue: "q".into() } },
            RefusalReason::NodeNotAccepting {
                node: node.clone(),
                status: NodeStatus::Down,
                mode: NodeMode::Schedulable,
            },
            RefusalReason::WrongKind {
                device: "d".into(),
                node: node.clone(),
                found: DeviceKind::Npu,
                asked: DeviceKind::Gpu,
            },
            RefusalReason::DeviceMemoryFull { device: "d".into(), node, used: 1, asked: 2, capacity: 2 },
        ];
        for r in all {
            let v = serde_json::to_value(&r).expect("serializes");
            assert_eq!(v["kind"], r.kind(), "{v}");
            let back: RefusalReason = serde_json::from_value(v).expect("and back");
            assert_eq!(back, r);
        }
    }

    #[test]
    fn messages_name_the_numbers() {
        let r = RefusalReason::DeviceFull { device: "gpu0".into(), node: NodeId::from("n1"), used: 1000, asked: 500 };
        assert_eq!(r.to_string(), "device gpu0 on n1: 1000 + 500 milli > 1000");
        let q =
            QuotaError::BorrowingLimit { queue: "a".into(), dim: "gpu_milli".into(), would_borrow: 3000, limit: 2000 };
        assert_eq!(
            RefusalReason::from(q).to_string(),
            "queue a quota: gpu_milli would borrow 3000 > borrowing limit 2000"
        );
    }
}
