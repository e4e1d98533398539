//! What the federation's raft log carries: [`FedCommand`] in, [`FedResponse`] out.
//!
//! The leader stamps every command with its clock (`now_ms`) before proposing; apply never
//! reads a clock. A command the state refuses is committed and answered
//! [`FedResponse::Rejected`] with the state unchanged.

use crate::dispatch::Decision;
use crate::model::{FedConfig, GlobalId, RegionSync, SyncAnswer};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use suanli_model::JobSpec;

/// A change to the federation's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FedCommand {
    /// Sets the configuration the first time (bootstrap); ignored once set.
    Init {
        /// The terms.
        config: FedConfig,
    },
    /// Replaces the configuration (validated).
    SetConfig {
        /// The terms.
        config: FedConfig,
    },
    /// A new federated job (idempotent on `client_request_id`).
    Submit {
        /// The submitter's key.
        client_request_id: String,
        /// The job (validated by the service before proposing, and again here).
        spec: Box<JobSpec>,
        /// The team charged.
        team: String,
        /// Who submitted it.
        submitted_by: String,
        /// Preferred region labels.
        #[serde(default)]
        data_labels: BTreeMap<String, String>,
        /// Leader's clock.
        now_ms: u64,
        /// The submitter's W3C `traceparent`, when it sent one: every region's job joins that
        /// trace (docs/tracing.md).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trace: Option<String>,
    },
    /// Cancel a job: a pending one ends now, a held one when its region reports it stopped
    /// (or its lease ends).
    Cancel {
        /// The job.
        id: GlobalId,
        /// Leader's clock.
        now_ms: u64,
    },
    /// Set (limit > 0) or remove (0) a team's worldwide quota for a device model.
    SetQuota {
        /// The team.
        team: String,
        /// The device model.
        device_model: String,
        /// Milli (1000 = one device).
        limit_milli: u64,
    },
    /// A region's sync: registers it on first sight, records its capacity, renews the leases
    /// of the jobs it holds at their current epoch, refuses the rest, and answers with its new
    /// assignments ([`FedResponse::Synced`]).
    Sync {
        /// The region's report.
        sync: Box<RegionSync>,
        /// Leader's clock.
        now_ms: u64,
    },
    /// A dispatch pass's decisions (from [`crate::dispatch::dispatch`] on a view at `now_ms`);
    /// apply re-checks each placement (job still pending, region healthy, quota) and grants
    /// the lease: epoch + 1, `lease_until = now_ms + lease_ms`.
    Dispatch {
        /// The decisions.
        decisions: Vec<Decision>,
        /// The view's time.
        now_ms: u64,
    },
    /// Leases that ended: every held job with `lease_until + redispatch_margin <= now_ms` goes
    /// back to pending (its placement closed `lease_expired`), or ends cancelled when its
    /// owner asked.
    Expire {
        /// Leader's clock.
        now_ms: u64,
    },
}

/// What applying a [`FedCommand`] answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "snake_case")]
pub enum FedResponse {
    /// Applied; nothing to say.
    Done,
    /// A raft-internal entry.
    Internal,
    /// A job submitted (or found by its request id).
    Submitted {
        /// Its id.
        id: GlobalId,
        /// False when it existed.
        created: bool,
    },
    /// A sync's answer.
    Synced(Box<SyncAnswer>),
    /// A dispatch's outcome.
    Dispatched {
        /// Jobs placed, with their region.
        placed: Vec<(GlobalId, String)>,
        /// Placements refused at apply, with why.
        refused: Vec<(GlobalId, String)>,
    },
    /// Leases expired.
    Expired {
        /// Jobs back to pending (or cancelled).
        jobs: Vec<GlobalId>,
    },
    /// Refused; the state is unchanged. `field` names what was wrong ("sync.capacity[3].pool").
    Rejected {
        /// The field.
        field: String,
        /// Why, with the limit or the owner.
        message: String,
    },
    /// Refused because what it names does not exist (a cancel of an unknown job); the state
    /// is unchanged. The call answers NOT_FOUND.
    NotFound {
        /// The field naming it.
        field: String,
        /// What was not found.
        message: String,
    },
    /// This replica halted at an entry it cannot apply (read-only).
    Halted {
        /// The entry.
        index: u64,
        /// Its kind.
        kind: String,
        /// Why.
        reason: String,
    },
}

impl FedCommand {
    /// The command's kind (for operators and halts).
    pub fn kind(&self) -> &'static str {
        match self {
            FedCommand::Init { .. } => "init",
            FedCommand::SetConfig { .. } => "set_config",
            FedCommand::Submit { .. } => "submit",
            FedCommand::Cancel { .. } => "cancel",
            FedCommand::SetQuota { .. } => "set_quota",
            FedCommand::Sync { .. } => "sync",
            FedCommand::Dispatch { .. } => "dispatch",
            FedCommand::Expire { .. } => "expire",
        }
    }
}
