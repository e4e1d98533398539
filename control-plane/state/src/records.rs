//! The records the state machine keeps: jobs, allocations, nodes.

use crate::command::NodeMode;
use crate::config::RetryPolicy;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{AllocId, Allocation, JobId, JobSpec, Node, NodeId};

/// Where a job is in its life cycle.
///
/// ```text
///  Pending ──ApplyPlan──▶ Placed ──alloc running──▶ Running ──all succeeded──▶ Succeeded
///     ▲                     │  \__________________________│__ alloc failed, retries left ─▶ Requeuing ─┐
///     │                     │   preempted                 │__ node lost / drained / device ─▶ Requeuing ─┤
///     │                     └──────────────▶ Preempted ◀──┘                                             │
///     └───────────── every allocation ended (requeued; after backoff for failures) ◀────────────────────┘
///  failures exhausted ─▶ Failed        CancelJob (any live state) ─▶ Cancelled
/// ```
///
/// "Admitted" and "placed" are one step here: the engine admits a job against quota and places
/// it in the same plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for a placement (possibly in backoff until `not_before`).
    Pending,
    /// Allocations created; none reported running yet.
    Placed,
    /// At least one allocation runs.
    Running,
    /// Preempted: allocations are stopping; requeued once all have ended.
    Preempted,
    /// Stopping after a failure, a lost node, a drain or an unhealthy device; requeued once all
    /// allocations have ended.
    Requeuing,
    /// Finished successfully.
    Succeeded,
    /// Finished: failed more often than its retry policy allows.
    Failed,
    /// Cancelled by a user.
    Cancelled,
}

impl JobState {
    /// True for succeeded, failed and cancelled.
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }

    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Placed => "placed",
            JobState::Running => "running",
            JobState::Preempted => "preempted",
            JobState::Requeuing => "requeuing",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// The latest completed checkpoint of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    /// Where it is stored.
    pub uri: String,
    /// Progress marker.
    pub step: u64,
    /// Size in bytes.
    pub size_bytes: u64,
    /// When it completed (seconds).
    pub at: u64,
    /// The allocation that wrote it.
    pub alloc: AllocId,
    /// That allocation's epoch.
    pub epoch: u64,
    /// When the task wrote it (its manifest's `wall_time`; 0 when not reported).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub wall_time: u64,
    /// Set when it restores only onto this hardware (a hardware-bound checkpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<suanli_model::CheckpointHardware>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// Capacity held for a job that preempted others: the next attempt waits until these
/// victims have ended, then is considered first in the pass (`PendingJob::nominated`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nomination {
    /// The allocations stopped for it.
    pub victims: BTreeSet<AllocId>,
    /// When the preemption committed (seconds).
    pub since: u64,
}

/// Where an operator asked a job to move (`job migrate`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MigrationTarget {
    /// Only this pool (none: any allowed pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<suanli_model::PoolId>,
    /// Only this node (none: any allowed node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeId>,
}

/// A node the next attempt avoids, because the last one failed there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AvoidNode {
    /// The node.
    pub node: NodeId,
    /// Until when (seconds); after it the node may be used again.
    pub until: u64,
}

/// How an attempt's allocation ended. Infrastructure ends ([`EndClass::is_infrastructure`])
/// do not use up the job's `max_attempts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndClass {
    /// Exited with code 0.
    Succeeded,
    /// The application exited non-zero or died of a signal it was not sent by suanli.
    Exit,
    /// Killed by the out-of-memory killer.
    Oom,
    /// The task could not be started (bad command, workdir).
    StartFailed,
    /// A device it used failed.
    DeviceError,
    /// Its node was lost (declared down, or the agent fenced it).
    NodeLost,
    /// Preempted for another job.
    Preempted,
    /// The job was cancelled.
    Cancelled,
    /// Its node was drained.
    Drained,
    /// Moved by `job migrate`.
    Migrated,
    /// Stopped because another allocation of the job ended (requeue, job failed).
    Stopped,
}

impl EndClass {
    /// True for ends that are not the application's doing.
    pub fn is_infrastructure(self) -> bool {
        matches!(
            self,
            EndClass::DeviceError | EndClass::NodeLost | EndClass::Preempted | EndClass::Drained | EndClass::Migrated
        )
    }

    /// True for ends that make the job's next attempt avoid the node for a while
    /// (`StateConfig::avoid_failed_node_s`): the task failed there, or the node or a device did.
    pub fn avoids_node(self) -> bool {
        matches!(
            self,
            EndClass::Exit | EndClass::Oom | EndClass::StartFailed | EndClass::DeviceError | EndClass::NodeLost
        )
    }

    /// Lowercase name (as on the wire).
    pub fn as_str(self) -> &'static str {
        match self {
            EndClass::Succeeded => "succeeded",
            EndClass::Exit => "exit",
            EndClass::Oom => "oom",
            EndClass::StartFailed => "start_failed",
            EndClass::DeviceError => "device_error",
            EndClass::NodeLost => "node_lost",
            EndClass::Preempted => "preempted",
            EndClass::Cancelled => "cancelled",
            EndClass::Drained => "drained",
            EndClass::Migrated => "migrated",
            EndClass::Stopped => "stopped",
        }
    }

    /// The class named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        use EndClass::*;
        [Succeeded, Exit, Oom, StartFailed, DeviceError, NodeLost, Preempted, Cancelled, Drained, Migrated, Stopped]
            .into_iter()
            .find(|c| c.as_str() == s)
    }
}

/// A job and its life cycle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// Id, assigned in submission order.
    pub id: JobId,
    /// The submitter's de-duplication key.
    pub client_request_id: String,
    /// The spec as submitted.
    pub spec: JobSpec,
    /// Its retry policy.
    pub retry: RetryPolicy,
    /// Life-cycle state.
    pub state: JobState,
    /// Submission time (seconds).
    pub submitted_at: u64,
    /// Time of the last change (seconds).
    pub updated_at: u64,
    /// State revision of the last change (see [`crate::State::revision`]).
    pub revision: u64,
    /// The current attempt; allocations of this attempt carry it as their epoch. 0 until the
    /// first placement.
    pub attempt: u64,
    /// Attempts that failed.
    pub failures: u32,
    /// Requeues from any cause (failures, preemptions, lost nodes, drains).
    pub requeues: u32,
    /// Not placeable before this time (retry backoff), seconds.
    pub not_before: u64,
    /// Last reason worth showing: why it waits, failed or was stopped.
    pub reason: String,
    /// Allocations of the current attempt.
    pub allocs: Vec<AllocId>,
    /// Latest completed checkpoint.
    pub latest_checkpoint: Option<CheckpointRecord>,
    /// Allocations of ended attempts, oldest first, the last [`MAX_ATTEMPT_HISTORY`] kept:
    /// what `job status` shows once an attempt's allocations are gone. Absent in snapshots
    /// of earlier builds (empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<AttemptRecord>,
    /// Capacity held for it after it preempted others (none in earlier snapshots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nomination: Option<Nomination>,
    /// Where `job migrate` asked it to go; cleared once it is placed there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationTarget>,
    /// The node its last attempt failed on, avoided for a while.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avoid: Option<AvoidNode>,
    /// Requeues for infrastructure causes (not counted in `failures`).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub infra_requeues: u32,
    /// Work lost over all its attempts: device-seconds since the last committed checkpoint
    /// (or the start) at each end that was not a success (whole devices; shares weighted).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost_device_s: u64,
    /// Set for a federated job (docs/federation.md): its global id, epoch and lease. Absent
    /// for a region-local job and in snapshots of earlier builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub federation: Option<crate::federated::FedBinding>,
    /// The job's root span as a W3C `traceparent`, from its submission (docs/tracing.md).
    /// Absent when none was given and in snapshots of earlier builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// When it was first placed (the replicated clock): its queue wait ends there. Absent
    /// until then and in snapshots of earlier builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_placed_at: Option<u64>,
    /// When one of its tasks first reported running: its time to start ends there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_running_at: Option<u64>,
    /// A service's replicas replaced after they ended (docs/services.md); 0 for other jobs.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub restarts: u32,
    /// A service's replicas that ended by themselves since one was last ready: the restart
    /// backoff doubles with each.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub restart_streak: u32,
    /// A service's spec version: 0 as submitted, one more per `update_service`
    /// (docs/services.md, "Rolling update"). New replicas run this version.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub version: u32,
    /// The specs of earlier versions that still have live replicas (what those replicas run),
    /// dropped when their last replica ends; at most [`MAX_LIVE_VERSIONS`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub old_specs: BTreeMap<u32, JobSpec>,
    /// A scale-up under way: since when (seconds) and to how many replicas; it ends when as
    /// many replicas are ready (its time goes into [`Job::scale_outs`]) or a scale-down
    /// below the replicas ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_out: Option<(u64, u32)>,
    /// The latest scale-up times (seconds from the scale-up to the replicas all ready), at
    /// most [`MAX_SCALE_OUTS`], oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scale_outs: Vec<u64>,
    /// An elastic job's membership generation: one more each time it grows or shrinks
    /// (docs/job-spec.md, "Elastic jobs"); its tasks see it in `$SUANLI_WORLD_FILE`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub world_gen: u64,
}

/// How many scale-up times a service keeps ([`Job::scale_outs`]).
pub const MAX_SCALE_OUTS: usize = 32;

/// Most earlier spec versions of a service that may still run during rolling updates (an
/// update beyond it is refused until older replicas are gone).
pub const MAX_LIVE_VERSIONS: usize = 4;

/// How many ended allocations a job's [`Job::history`] keeps (the oldest go first).
pub const MAX_ATTEMPT_HISTORY: usize = 20;

/// One allocation of an ended attempt, as it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// The attempt (the allocation's epoch).
    pub attempt: u64,
    /// The allocation.
    pub alloc: AllocId,
    /// Task group index and replica.
    pub group: u32,
    /// Replica within the group.
    pub replica: u32,
    /// The node it ran on.
    pub node: NodeId,
    /// When it was placed (seconds).
    pub started_at: u64,
    /// When it ended (seconds).
    pub ended_at: u64,
    /// How it ended.
    pub state: AllocState,
    /// The last message about it (exit status, failure, why it stopped).
    pub message: String,
    /// How it ended (none in earlier snapshots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<EndClass>,
    /// The task's exit code, when it exited by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Device-seconds of work lost at this end (see [`Job::lost_device_s`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost_device_s: u64,
    /// The checkpoint step it was started from (none: from the start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_step: Option<u64>,
}

/// Where an allocation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocState {
    /// Created; the agent has not started it yet.
    Pending,
    /// Running.
    Running,
    /// Exited successfully.
    Succeeded,
    /// Exited with an error.
    Failed,
    /// Stopped.
    Stopped,
    /// Its node went down or lost the resources it used.
    Lost,
}

impl AllocState {
    /// True while it holds resources.
    pub fn is_live(self) -> bool {
        matches!(self, AllocState::Pending | AllocState::Running)
    }
}

/// Why an allocation is asked to stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Preempted for another job.
    Preempted {
        /// The job the capacity goes to.
        for_job: JobId,
    },
    /// The job was cancelled.
    Cancelled,
    /// Another allocation of the job failed, or the job failed.
    JobFailed,
    /// The job is being requeued (another allocation ended unexpectedly).
    Requeue,
    /// Its node is draining.
    Drain,
    /// A device it uses became unhealthy.
    DeviceUnhealthy,
    /// Moved by `job migrate`.
    Migrate,
    /// A service replica replaced by a rolling update, or beyond its group's `replicas`
    /// after a scale-down (docs/services.md).
    Update,
}

/// What the agent should do with an allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Desired {
    /// Keep it running.
    Run,
    /// Stop it.
    Stop {
        /// Why.
        reason: StopReason,
        /// Ask the task to checkpoint first.
        checkpoint_first: bool,
        /// How long to wait for that checkpoint (seconds).
        grace_s: u64,
        /// When the stop was decided (seconds).
        since: u64,
    },
}

/// One task replica placed on a node for one attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alloc {
    /// The placement as the scheduler sees it (id, job, task, epoch, node, resources, ...).
    /// Shared with the scheduler's views (a pass takes a reference, not a copy); changed
    /// copy-on-write through `Arc::make_mut`.
    pub alloc: std::sync::Arc<Allocation>,
    /// Reported state.
    pub state: AllocState,
    /// What the agent should do.
    pub desired: Desired,
    /// Time of the last change (seconds).
    pub updated_at: u64,
    /// Last message from the agent or the state machine.
    pub message: String,
    /// How it ended, once it has (none while live, and in snapshots of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<EndClass>,
    /// The task's exit code, when it exited by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Device-seconds of work lost at its end (see [`Job::lost_device_s`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost_device_s: u64,
    /// The checkpoint step its attempt was started from (none: from the start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_step: Option<u64>,
    /// A service replica that passes its readiness check, as its agent last reported.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ready: bool,
    /// Where a service replica serves (`host:port`), as its agent reported; empty until then.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub endpoint: String,
    /// The service spec version it runs ([`Job::version`] when it was placed).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub version: u32,
    /// Its last reported load (thousandths of the autoscaling metric's unit) and when
    /// (seconds); absent until its agent reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<(u64, u64)>,
    /// Its last reported request latency (microseconds) and when (seconds); absent until its
    /// agent reports one (`service.report`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<(u64, u64)>,
    /// Its last reported success ratio (parts per million) and when (seconds); absent until
    /// its agent reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success_ppm: Option<(u32, u64)>,
}

impl Alloc {
    /// True while it holds resources.
    pub fn is_live(&self) -> bool {
        self.state.is_live()
    }
}

/// Whether a node is reachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    /// Heartbeating.
    Ready,
    /// Declared down by the leader.
    Down,
}

/// A registered node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Inventory as last registered (device health as last reported).
    pub node: Node,
    /// Reachability.
    pub status: NodeStatus,
    /// Operator's mode.
    pub mode: NodeMode,
    /// Time of the last change (seconds).
    pub updated_at: u64,
    /// Why it is down, if it is.
    pub reason: String,
    /// A condition its agent reported that keeps new work off the node ("disk pressure: …");
    /// empty when none. Survives re-registration; only the agent's heartbeats clear it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pressure: String,
    /// The drain in progress while the mode is draining (none in snapshots of earlier
    /// builds: their drains evicted everything at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainPlan>,
    /// The agent's fence as it last registered (absent: it reported none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<AgentFence>,
    /// By device id: how many times an operator cleared the device's quarantine
    /// ([`ClearQuarantine`](crate::ClearQuarantine)); heartbeats carry it to the agent.
    /// Survives re-registration; an entry goes with its device.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub quarantine_clears: BTreeMap<String, u64>,
    /// By device id: why an unhealthy device is unhealthy, as its agent last said (cut to
    /// `max_message_len`). Only unhealthy devices the node has are listed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub device_reasons: BTreeMap<String, String>,
}

/// A drain in progress on one node.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DrainPlan {
    /// Replicated time (seconds) from which running work is evicted; before it, nothing new
    /// is placed and running work may finish by itself.
    pub deadline: u64,
    /// Jobs this drain may have away at once (0: no limit).
    pub max_unavailable: u32,
    /// Jobs this drain evicted that are not yet running again (nor finished).
    pub moving: BTreeSet<JobId>,
}

/// How long an agent lets its tasks run without a renewed lease (docs/agent.md, "The lease"):
/// F then G, in the agent's own clock. The leader's liveness never declares the node down
/// sooner (docs/control-plane.md, "Clocks").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentFence {
    /// `fence_after_ms` (F); 0: automatic, half the heartbeat TTL.
    pub after_ms: u64,
    /// `fence_kill_grace_ms` (G); 0: automatic, a fifth of the heartbeat TTL.
    pub kill_grace_ms: u64,
}

impl AgentFence {
    /// F + G for a heartbeat TTL (the automatic values resolve as the agent resolves them).
    pub fn total_ms(&self, ttl_ms: u64) -> u64 {
        let f = if self.after_ms > 0 { self.after_ms } else { ttl_ms / 2 };
        let g = if self.kill_grace_ms > 0 { self.kill_grace_ms } else { ttl_ms / 5 };
        f.saturating_add(g)
    }
}

impl NodeRecord {
    /// True when new work may be placed on it.
    pub fn accepts_work(&self) -> bool {
        self.status == NodeStatus::Ready && self.mode == NodeMode::Schedulable && self.pressure.is_empty()
    }

    /// Why it takes no new work, in the word pending reasons count it under (`down` before
    /// the operator's mode: a down node would not take work even if uncordoned); `None` when
    /// it accepts work.
    /// Another condition that stops placements reads `not schedulable: <why>`.
    pub fn unschedulable_reason(&self) -> Option<String> {
        let word = match (&self.status, &self.mode) {
            (NodeStatus::Down, _) => "down",
            (NodeStatus::Ready, NodeMode::Draining) => "draining",
            (NodeStatus::Ready, NodeMode::Cordoned) => "cordoned",
            (NodeStatus::Ready, NodeMode::Schedulable) if self.pressure.is_empty() => return None,
            // A condition its agent reported: counted under its kind ("disk pressure"), not
            // under the changing numbers of the message.
            (NodeStatus::Ready, NodeMode::Schedulable) => {
                let kind = self.pressure.split(':').next().unwrap_or_default().trim();
                return Some(format!("not schedulable: {kind}"));
            }
        };
        Some(word.to_owned())
    }
}
