//! The federation's records: regions, federated jobs, quotas, and the replicated configuration.
//! Pure data (serde), no I/O. Times are wall-clock milliseconds since the Unix epoch, read by
//! the federation leader and carried inside each command (apply never reads a clock).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use suanli_model::JobSpec;

/// A federated job's id: `g-<n>`, `n` from 1, assigned in commit order.
pub type GlobalId = String;

/// The federation's replicated configuration (set at bootstrap by [`crate::FedCommand::Init`],
/// changed by [`crate::FedCommand::SetConfig`]). Every limit the federation enforces is here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedConfig {
    /// How long a lease granted (or renewed) to a region lasts.
    pub lease_ms: u64,
    /// How often a region leader syncs (renews); at most `lease_ms / 3`.
    pub sync_interval_ms: u64,
    /// The assumed bound on the difference between any two clocks (federation servers,
    /// region servers, agents). docs/federation.md, "Clocks".
    pub max_clock_drift_ms: u64,
    /// A job whose lease ended is re-dispatched no earlier than `lease_until + margin`; the
    /// margin must cover twice the drift bound.
    pub redispatch_margin_ms: u64,
    /// A region that has not synced for this long is unhealthy: nothing is dispatched to it.
    pub region_unhealthy_after_ms: u64,
    /// At most this many regions.
    pub max_regions: usize,
    /// At most this many federated jobs not yet ended, and ended ones kept (the oldest ended
    /// are dropped first).
    pub max_jobs: usize,
    /// At most this many ended jobs kept for `federation jobs`.
    pub max_ended_jobs: usize,
    /// At most this many pools a region may own.
    pub max_pools_per_region: usize,
    /// At most this many capacity entries in one sync.
    pub max_capacity_entries: usize,
    /// At most this many held jobs (and usage entries) in one sync.
    pub max_held_per_sync: usize,
    /// At most this many placements kept in a job's history.
    pub max_history: usize,
    /// At most this many global quotas.
    pub max_quotas: usize,
    /// At most this many jobs considered by one dispatch pass.
    pub max_dispatch_per_pass: usize,
}

impl Default for FedConfig {
    fn default() -> Self {
        FedConfig {
            lease_ms: 15_000,
            sync_interval_ms: 3_000,
            max_clock_drift_ms: 500,
            redispatch_margin_ms: 2_000,
            region_unhealthy_after_ms: 9_000,
            max_regions: 64,
            max_jobs: 100_000,
            max_ended_jobs: 10_000,
            max_pools_per_region: 256,
            max_capacity_entries: 1_024,
            max_held_per_sync: 10_000,
            max_history: 32,
            max_quotas: 10_000,
            max_dispatch_per_pass: 1_000,
        }
    }
}

impl FedConfig {
    /// `Err("field: why, with the limit")` when the terms are unsafe or out of range
    /// (`sync_interval_ms` > `lease_ms / 3`, `redispatch_margin_ms` < 2 × drift, a zero limit).
    pub fn validate(&self) -> Result<(), String> {
        let limits: [(&str, u64); 14] = [
            ("lease_ms", self.lease_ms),
            ("sync_interval_ms", self.sync_interval_ms),
            ("max_clock_drift_ms", self.max_clock_drift_ms),
            ("redispatch_margin_ms", self.redispatch_margin_ms),
            ("region_unhealthy_after_ms", self.region_unhealthy_after_ms),
            ("max_regions", self.max_regions as u64),
            ("max_jobs", self.max_jobs as u64),
            ("max_ended_jobs", self.max_ended_jobs as u64),
            ("max_pools_per_region", self.max_pools_per_region as u64),
            ("max_capacity_entries", self.max_capacity_entries as u64),
            ("max_held_per_sync", self.max_held_per_sync as u64),
            ("max_history", self.max_history as u64),
            ("max_quotas", self.max_quotas as u64),
            ("max_dispatch_per_pass", self.max_dispatch_per_pass as u64),
        ];
        for (field, value) in limits {
            if value == 0 {
                return Err(format!("{field}: 0, every limit must be positive; must be at least 1"));
            }
        }
        let third = self.lease_ms / 3;
        if self.sync_interval_ms > third {
            return Err(format!(
                "sync_interval_ms: {}, a region must renew at least three times per lease; must be at most \
                 lease_ms / 3 = {third}",
                self.sync_interval_ms
            ));
        }
        let twice_drift = self.max_clock_drift_ms.saturating_mul(2);
        if self.redispatch_margin_ms < twice_drift {
            return Err(format!(
                "redispatch_margin_ms: {}, the margin must cover the clock drift both ways; must be at least \
                 2 * max_clock_drift_ms = {twice_drift}",
                self.redispatch_margin_ms
            ));
        }
        let twice_sync = self.sync_interval_ms.saturating_mul(2);
        if self.region_unhealthy_after_ms < twice_sync {
            return Err(format!(
                "region_unhealthy_after_ms: {}, one late sync must not mark a region unhealthy; must be at least \
                 2 * sync_interval_ms = {twice_sync}",
                self.region_unhealthy_after_ms
            ));
        }
        Ok(())
    }

    /// The field a [`FedConfig::validate`] message names (the text before its first colon).
    pub fn error_field(message: &str) -> &str {
        message.split(':').next().unwrap_or(message)
    }

    /// How long before its lease ends a region must have a job's tasks gone: the drift bound,
    /// plus the job's checkpoint grace (when it has a policy), plus `kill_grace_ms`.
    pub fn stop_before_ms(&self, spec: &JobSpec, kill_grace_ms: u64) -> u64 {
        let grace = spec.checkpoint.map_or(0, |c| c.grace_s.saturating_mul(1000));
        self.max_clock_drift_ms.saturating_add(grace).saturating_add(kill_grace_ms)
    }
}

/// The kill grace a region's agents give a task between SIGTERM and SIGKILL when a lease ends
/// (the stop budget counts it; agents use at most this).
pub const LEASE_KILL_GRACE_MS: u64 = 1_000;

/// A region in the directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionRecord {
    /// Its name (`[federation] region` of its servers).
    pub name: String,
    /// Its servers' client addresses.
    pub endpoints: Vec<String>,
    /// Its labels (data locality).
    pub labels: BTreeMap<String, String>,
    /// The pools it owns (a pool belongs to one region; claimed at its first sync).
    pub pools: Vec<String>,
    /// Its latest capacity report.
    pub capacity: Vec<CapacityEntry>,
    /// Jobs pending in its queues at the latest sync.
    pub backlog: u32,
    /// Its teams' local use at the latest sync (region-local jobs only).
    pub usage: Vec<TeamUsage>,
    /// When it first synced (federation clock).
    pub first_seen_ms: u64,
    /// When it last synced (federation clock).
    pub last_sync_ms: u64,
    /// Its leader's clock at the latest sync.
    pub sent_at_ms: u64,
    /// Its cost ledger's totals at the latest sync that carried them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<RegionCost>,
    /// Its leases of the global quotas, sorted by (team, device model).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quota_leases: Vec<GrantedLease>,
}

/// A region's cost ledger totals (docs/cost.md), exact base units, from its start (or horizon)
/// to `until`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RegionCost {
    /// The currency of its price catalog.
    pub currency: String,
    /// The region ledger's clock (seconds since the epoch).
    pub until: u64,
    /// Capacity x time x price.
    pub capacity: Base,
    /// Per team (the idle capacity: "(idle)"): useful, lost to preemption, lost to failure,
    /// running, idle.
    pub teams: BTreeMap<String, [Base; 5]>,
}

/// An amount in base units, kept as a decimal string in commands and snapshots: the log's
/// internally tagged commands are decoded through serde's buffered content, which has no
/// 128-bit integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Base(pub i128);

impl Serialize for Base {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0.to_string())
    }
}

impl<'de> Deserialize<'de> for Base {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Base, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map(Base).map_err(|_| serde::de::Error::custom(format!("{s:?} is not an integer amount")))
    }
}

impl RegionCost {
    /// The categories' names, in the order of [`RegionCost::teams`]' arrays.
    pub const CATEGORIES: [&'static str; 5] = ["useful", "lost_preemption", "lost_failure", "running", "idle"];
}

impl RegionRecord {
    /// Whether it synced within `region_unhealthy_after_ms` of `now_ms`.
    pub fn healthy(&self, now_ms: u64, cfg: &FedConfig) -> bool {
        now_ms.saturating_sub(self.last_sync_ms) <= cfg.region_unhealthy_after_ms
    }
}

/// One pool and device model's capacity in a region (device shares in milli; 1000 = one device).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct CapacityEntry {
    /// The pool.
    pub pool: String,
    /// `gpu`, `npu`, or empty for a pool without devices.
    pub device_kind: String,
    /// The device model (e.g. "H100"); empty for a pool without devices.
    pub device_model: String,
    /// All healthy devices of that model on schedulable nodes.
    pub total_milli: u64,
    /// Of which free.
    pub free_milli: u64,
    /// The most free on a single schedulable node.
    pub max_node_free_milli: u64,
    /// Free CPU on the pool's schedulable nodes.
    pub free_cpu_milli: u64,
    /// Free memory on the pool's schedulable nodes.
    pub free_memory_mib: u64,
    /// Price per device-hour, micro-units (0: unknown).
    pub price_micros_per_device_hour: u64,
}

/// A team's use of a device model in a region: region-local jobs only (federated ones are
/// counted by the federation itself).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct TeamUsage {
    /// The team.
    pub team: String,
    /// The device model.
    pub device_model: String,
    /// In use now, milli.
    pub used_milli: u64,
    /// Device-milli-seconds used since the region's previous sync (the roll-up).
    pub device_milli_s: u64,
    /// Its use plus its pending local jobs' demand that may run on the model (the federation
    /// shares a global quota among regions by these). Never below `used_milli` once read.
    #[serde(default)]
    pub wanted_milli: u64,
    /// The smallest of its pending local jobs' demands on the model (0: none pending).
    #[serde(default)]
    pub min_pending_milli: u64,
}

/// A share of a global quota leased to a region (the wire's `QuotaLease`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct QuotaLease {
    /// The team.
    pub team: String,
    /// The device model.
    pub device_model: String,
    /// The share, milli.
    pub limit_milli: u64,
    /// Its end (federation clock).
    pub until_ms: u64,
}

/// A quota lease as the federation remembers it for a region: the current grant, and the
/// largest earlier grant the region may still enforce (until it reports the current one, or
/// the earlier grant's end + the margin passes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct GrantedLease {
    /// The team.
    pub team: String,
    /// The device model.
    pub device_model: String,
    /// The current grant, milli.
    pub limit_milli: u64,
    /// Its end.
    pub until_ms: u64,
    /// A larger earlier grant still possibly in force (0: none).
    #[serde(default)]
    pub prior_milli: u64,
    /// Its end.
    #[serde(default)]
    pub prior_until_ms: u64,
}

/// A checkpoint a job can restore from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct CheckpointRef {
    /// Where it is stored (object-store URI).
    pub uri: String,
    /// The training step it holds.
    pub step: u64,
    /// Its size.
    pub size_bytes: u64,
    /// The manifest's wall time (seconds).
    pub wall_time: u64,
    /// Restores only onto the same kind, model and count of devices.
    pub hardware_bound: bool,
    /// With `hardware_bound`: the device kind.
    pub device_kind: String,
    /// With `hardware_bound`: the device model.
    pub device_model: String,
    /// With `hardware_bound`: the device count.
    pub device_count: u32,
}

/// Where a federated job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FedJobState {
    /// Waiting for dispatch (never dispatched, or its lease ended and margin passed).
    Pending,
    /// Dispatched to a region that has not yet reported it running.
    Assigned,
    /// A region reported it running.
    Running,
    /// Ended well (reported by its region).
    Succeeded,
    /// Ended badly (reported by its region, after the region's own retries).
    Failed,
    /// Cancelled by its owner.
    Cancelled,
}

impl FedJobState {
    /// Whether it ended.
    pub fn is_terminal(self) -> bool {
        matches!(self, FedJobState::Succeeded | FedJobState::Failed | FedJobState::Cancelled)
    }

    /// Whether a region holds it (under a lease).
    pub fn is_held(self) -> bool {
        matches!(self, FedJobState::Assigned | FedJobState::Running)
    }

    /// Its name in the API and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            FedJobState::Pending => "pending",
            FedJobState::Assigned => "assigned",
            FedJobState::Running => "running",
            FedJobState::Succeeded => "succeeded",
            FedJobState::Failed => "failed",
            FedJobState::Cancelled => "cancelled",
        }
    }
}

/// One region's tenure of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedPlacement {
    /// The region.
    pub region: String,
    /// The epoch it ran under.
    pub epoch: u64,
    /// Dispatched at.
    pub from_ms: u64,
    /// Ended at (0 while it holds).
    pub to_ms: u64,
    /// Empty while it holds; `succeeded`, `failed`, `cancelled`, `lease_expired`, `refused`.
    pub end: String,
}

/// A federated job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedJob {
    /// `g-<n>`.
    pub id: GlobalId,
    /// The submitter's idempotency key.
    pub client_request_id: String,
    /// The job as a region runs it (constraints.regions: where it may run).
    pub spec: JobSpec,
    /// The team charged (global quota).
    pub team: String,
    /// Who submitted it ("user alice", or the region that forwarded it and for whom).
    pub submitted_by: String,
    /// Preferred region labels (data locality): a region matching more of them is preferred.
    pub data_labels: BTreeMap<String, String>,
    /// Federation clock at submit.
    pub submitted_at_ms: u64,
    /// Where it is.
    pub state: FedJobState,
    /// The region holding it (Assigned/Running) or that last held it.
    pub region: Option<String>,
    /// Incremented by each dispatch (the first dispatch makes it 1); a region's reports about
    /// an older epoch are refused.
    pub epoch: u64,
    /// The lease's end (federation clock); 0 while pending.
    pub lease_until_ms: u64,
    /// The device model dispatch chose (the region pins the job to it).
    pub device_model: Option<String>,
    /// Its whole device demand, milli (what the quota counts).
    pub demand_milli: u64,
    /// The latest checkpoint a region reported (the next dispatch restores from it).
    pub checkpoint: Option<CheckpointRef>,
    /// Why it waits, or how it ended.
    pub reason: String,
    /// Its placements, oldest first (at most `max_history`).
    pub history: Vec<FedPlacement>,
    /// Its id in the region holding it (0 until that region reports it).
    pub local_job_id: u64,
    /// Its owner asked to cancel it; the region holding it is told at its next sync.
    pub cancel_requested: bool,
    /// Federation clock at the last change.
    pub updated_at_ms: u64,
    /// The submitter's W3C `traceparent` (the parent of each region job's root span).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

/// A team's worldwide quota for one device model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalQuota {
    /// The team.
    pub team: String,
    /// The device model.
    pub device_model: String,
    /// At most this much (milli; 1000 = one device) held at once, worldwide.
    pub limit_milli: u64,
}

/// A region's periodic report (the body of `Federation.Sync`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RegionSync {
    /// The region.
    pub region: String,
    /// Its client addresses.
    pub endpoints: Vec<String>,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// The pools it owns.
    pub pools: Vec<String>,
    /// Its capacity.
    pub capacity: Vec<CapacityEntry>,
    /// Its backlog.
    pub backlog: u32,
    /// Its teams' local use.
    pub usage: Vec<TeamUsage>,
    /// The federated jobs it holds.
    pub held: Vec<HeldJob>,
    /// Its leader's clock.
    pub sent_at_ms: u64,
    /// Its cost ledger's totals (none without a price catalog).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<RegionCost>,
    /// The quota leases it enforces now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quota_leases: Vec<QuotaLease>,
}

/// A federated job as a region reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct HeldJob {
    /// The job.
    pub global_id: GlobalId,
    /// The epoch the region runs it under.
    pub epoch: u64,
    /// `assigned`, `running`, `succeeded`, `failed`, `cancelled`, `lost`.
    pub status: String,
    /// A message (how it ended).
    pub message: String,
    /// The region's latest checkpoint of it.
    pub checkpoint: Option<CheckpointRef>,
    /// Its id in the region.
    pub local_job_id: u64,
}

/// A lease renewed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// The job.
    pub global_id: GlobalId,
    /// Its epoch.
    pub epoch: u64,
    /// The lease's new end (federation clock).
    pub until_ms: u64,
}

/// A lease not renewed: the region must stop the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRefusal {
    /// The job.
    pub global_id: GlobalId,
    /// The epoch the region claimed.
    pub epoch: u64,
    /// Why, in words ("stale epoch 1: g-3 runs at epoch 2 in eu-west").
    pub reason: String,
}

/// A job a region is to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// The job.
    pub global_id: GlobalId,
    /// Its epoch.
    pub epoch: u64,
    /// Its spec.
    pub spec: JobSpec,
    /// Its team.
    pub team: String,
    /// The lease's end.
    pub until_ms: u64,
    /// Restore from this checkpoint.
    pub restore: Option<CheckpointRef>,
    /// The device model chosen.
    pub device_model: Option<String>,
    /// The submitter's `traceparent`, when the job has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

/// The federation's answer to a sync.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct SyncAnswer {
    /// Leases renewed.
    pub leases: Vec<LeaseGrant>,
    /// Leases refused.
    pub refused: Vec<LeaseRefusal>,
    /// New work.
    pub assignments: Vec<Assignment>,
    /// Jobs to cancel.
    pub cancel: Vec<GlobalId>,
    /// The region's share of every global quota.
    pub quota_leases: Vec<QuotaLease>,
}
