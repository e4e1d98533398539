//! Allocations: a task replica running (or starting) on a node.

use crate::{AllocId, DeviceShare, JobId, NodeId, QueueId, ResVec};
use serde::{Deserialize, Serialize};

/// One task replica placed on a node, as the scheduler sees it when deciding preemptions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Unique id.
    pub id: AllocId,
    /// The job it belongs to.
    pub job: JobId,
    /// Index of the task group in the job spec.
    pub group: u32,
    /// Replica index within the group.
    pub replica: u32,
    /// Attempt number; bumped when the task is restarted elsewhere (the epoch).
    #[serde(default)]
    pub epoch: u64,
    /// Node it runs on.
    pub node: NodeId,
    /// Queue charged.
    pub queue: QueueId,
    /// Priority of the job.
    pub priority: i32,
    /// Whether it may be preempted at all.
    pub preemptible: bool,
    /// CPU milli-cores reserved.
    pub cpu_milli: u64,
    /// Memory MiB reserved.
    pub memory_mib: u64,
    /// Device shares reserved.
    pub devices: Vec<DeviceShare>,
    /// Start time (seconds, the caller's clock).
    pub started_at: u64,
    /// Time of the last completed checkpoint, if any.
    #[serde(default)]
    pub last_checkpoint_at: Option<u64>,
    /// Grace period to write a checkpoint before stopping; `None` when it cannot checkpoint.
    #[serde(default)]
    pub checkpoint_grace_s: Option<u64>,
    /// Estimated time to restore from a checkpoint (or restart from scratch).
    #[serde(default)]
    pub restore_s: u64,
    /// Runtime estimate from the spec, for backfill's view of when capacity frees up.
    #[serde(default)]
    pub runtime_estimate_s: Option<u64>,
    /// Admitted on quota borrowed from the cohort: the lender may reclaim it.
    #[serde(default)]
    pub borrowed: bool,
    /// Part of a gang: stopping one replica stops the whole job.
    #[serde(default)]
    pub gang: bool,
    /// Its place in an elastic job (the scheduling view sets it; stored records keep the
    /// default): preemption takes an elastic job's surplus replicas before other work, and
    /// its minimum only after every other acceptable victim.
    #[serde(default, skip_serializing_if = "ElasticRole::is_none")]
    pub elastic: ElasticRole,
}

/// How an allocation of an elastic job ([`crate::JobSpec::is_elastic`]) counts when victims
/// are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ElasticRole {
    /// Not part of an elastic job (or not known to be).
    #[default]
    None,
    /// One of the replicas its group needs (`min_replicas`): stopping it stops the whole job.
    Minimum,
    /// A replica beyond its group's minimum: stopping it shrinks the job, which keeps running.
    Surplus,
}

impl ElasticRole {
    /// True for [`ElasticRole::None`].
    pub fn is_none(&self) -> bool {
        *self == ElasticRole::None
    }
}

impl Allocation {
    /// Quota vector of this allocation. Device kinds come from the caller (the node knows them);
    /// `gpu_milli`/`npu_milli` given here are the sums of the shares by kind.
    pub fn resvec(&self, gpu_milli: u64, npu_milli: u64) -> ResVec {
        ResVec { cpu_milli: self.cpu_milli, memory_mib: self.memory_mib, gpu_milli, npu_milli }
    }

    /// Device-milli-seconds of work lost if stopped at `now` without a new checkpoint: time
    /// since the last checkpoint (or start) times the device share, plus the restore estimate.
    pub fn lost_work(&self, now: u64) -> u128 {
        let since = self.last_checkpoint_at.unwrap_or(self.started_at).max(self.started_at);
        let secs = now.saturating_sub(since) + self.restore_s;
        let dev: u64 = self.devices.iter().map(|d| u64::from(d.milli)).sum();
        // CPU-only work counts its cores, so it is not "free" to preempt.
        let weight = dev.max(self.cpu_milli / 8).max(1);
        u128::from(secs) * u128::from(weight)
    }
}
