//! Dispatch: which region runs a federated job. A pure function, like the region's engine: a
//! [`DispatchView`] (regions' capacity and health, quotas, pending jobs) and a seed in, decisions
//! with reasons out; no clock, no I/O, no hash-order dependence. The federation leader builds the
//! view from its state ([`view_of`]), calls [`dispatch`], and commits the decisions
//! ([`crate::FedCommand::Dispatch`]), whose apply re-checks each one.
//!
//! A job may go to a region that is healthy, allowed by its `constraints.regions` (empty: any),
//! has enough free devices of an allowed model (`constraints.device_models`, empty: any model of
//! the kind) in total and on one node for its largest task, and where the team's worldwide quota
//! for that model has room. Among those it prefers, in order: more matching data-locality
//! labels, a lower price for the model, more free capacity left after placing (spread), a
//! shorter backlog, then the region's name. Decisions within one pass see the capacity and quota
//! taken by the earlier ones. A job that fits nowhere is held with a reason that names every
//! region: "no region has 64 free H100: us-east 12, eu-west 40 (quota 32 left), ap-south unhealthy".

use crate::model::{CapacityEntry, FedConfig, GlobalId};
use crate::state::FedState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Everything dispatch reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DispatchView {
    /// The time of the view (federation clock, ms).
    pub now_ms: u64,
    /// Every region in the directory, by name.
    pub regions: Vec<RegionView>,
    /// Every global quota with its current use.
    pub quotas: Vec<QuotaView>,
    /// Pending jobs, oldest submission first (at most `max_dispatch_per_pass`).
    pub pending: Vec<PendingJob>,
}

/// A region as dispatch sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RegionView {
    /// Its name.
    pub name: String,
    /// Synced recently enough.
    pub healthy: bool,
    /// Its capacity, per pool and model, minus what was dispatched to it since it reported
    /// (assignments it has not yet placed).
    pub capacity: Vec<CapacityEntry>,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its backlog.
    pub backlog: u32,
}

/// A quota and its use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct QuotaView {
    /// The team.
    pub team: String,
    /// The device model.
    pub device_model: String,
    /// The limit, milli.
    pub limit_milli: u64,
    /// Held federated jobs' demand plus regions' reported local use, milli.
    pub used_milli: u64,
}

/// A pending job as dispatch sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PendingJob {
    /// Its id.
    pub id: GlobalId,
    /// Its team.
    pub team: String,
    /// `gpu`, `npu`, or empty (no devices).
    pub device_kind: String,
    /// Allowed device models (empty: any of the kind).
    pub device_models: Vec<String>,
    /// Its whole device demand, milli.
    pub demand_milli: u64,
    /// Its largest single task's device demand, milli (must fit on one node).
    pub max_task_milli: u64,
    /// Its whole CPU demand.
    pub cpu_milli: u64,
    /// Its whole memory demand.
    pub memory_mib: u64,
    /// Allowed regions (empty: any).
    pub regions: Vec<String>,
    /// Preferred region labels.
    pub data_labels: BTreeMap<String, String>,
    /// A checkpoint bound to this device model (hardware-bound): only this model will do.
    pub bound_model: Option<String>,
    /// Its priority (higher first within a pass).
    pub priority: i32,
    /// Submitted at (older first among equal priorities).
    pub submitted_at_ms: u64,
}

/// One decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Run `job` in `region`, on `device_model` (None: a job without devices).
    Place {
        /// The job.
        job: GlobalId,
        /// The region.
        region: String,
        /// The model.
        device_model: Option<String>,
        /// Why this region, in words ("most free H100 (40), price 2.10/h, 1 label matched").
        why: String,
    },
    /// Keep `job` pending; `reason` explains itself.
    Hold {
        /// The job.
        job: GlobalId,
        /// Why, naming every region.
        reason: String,
    },
}

/// Decides where each pending job of `view` goes. Pure and deterministic: the same view and
/// seed give the same decisions. Returns one decision per pending job, in the view's order of
/// consideration.
pub fn dispatch(view: &DispatchView, seed: u64) -> Vec<Decision> {
    let _ = (view, seed);
    todo!("h-fcore")
}

/// The view of `state` at `now_ms` (regions' health from their last sync, quota use, pending
/// jobs in order, capacity less the not-yet-placed assignments).
pub fn view_of(state: &FedState, now_ms: u64) -> DispatchView {
    let _ = (state, now_ms, FedConfig::default());
    todo!("h-fcore")
}
