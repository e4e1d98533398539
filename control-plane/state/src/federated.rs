//! Federated jobs in a region (docs/federation.md): the federation assigns a job to this region
//! with an epoch and a lease; the region leader records it ([`FedAdopt`]), renews the lease at
//! each sync ([`FedRenew`]) and gives the job up when the federation refuses the lease, the lease
//! runs out, or the owner cancels ([`FedRelease`]). A federated job is placed only while its
//! lease has more than `stop_before_ms` left; its allocations carry the lease to the agents, which
//! stop the tasks by `lease_until_ms - stop_before_ms` unless a heartbeat brought a renewal.

use crate::records::CheckpointRecord;
use serde::{Deserialize, Serialize};
use suanli_model::JobSpec;

/// A region job's tie to the federation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedBinding {
    /// The federated job's id (`g-<n>`).
    pub global_id: String,
    /// The federation epoch this region runs it under.
    pub epoch: u64,
    /// The lease's end (federation clock, ms since the Unix epoch).
    pub lease_until_ms: u64,
    /// The tasks must be gone this long before the lease's end (drift bound + checkpoint grace
    /// + kill grace).
    pub stop_before_ms: u64,
    /// The team the federation charges.
    pub team: String,
    /// Set once released: why (the job is then ended here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<String>,
}

/// Adopt a federated job: creates the region job (idempotent on `(global_id, epoch)`; an epoch
/// below one this region already holds for the same global id is refused as stale).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedAdopt {
    /// The global id.
    pub global_id: String,
    /// The epoch.
    pub epoch: u64,
    /// The job (the region pins `constraints.device_models` to the model dispatch chose).
    pub spec: JobSpec,
    /// The team charged.
    pub team: String,
    /// The lease's end.
    pub lease_until_ms: u64,
    /// See [`FedBinding::stop_before_ms`].
    pub stop_before_ms: u64,
    /// Restore from this checkpoint (recorded as the job's latest before its first placement).
    #[serde(default)]
    pub restore: Option<CheckpointRecord>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Leases renewed by the federation: `(global_id, epoch, until_ms)`; entries for jobs not held
/// at that epoch are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedRenew {
    /// The renewals.
    pub leases: Vec<(String, u64, u64)>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Give a federated job up: its allocations are told to stop and it ends here (state
/// `cancelled`, reason "released to the federation: ..."), never retried by this region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedRelease {
    /// The global id.
    pub global_id: String,
    /// The epoch released (a release for another epoch is ignored).
    pub epoch: u64,
    /// Why: `refused: ...`, `lease_expired`, `cancelled`.
    pub reason: String,
    /// Leader's time, seconds.
    pub now: u64,
}

impl crate::State {
    pub(crate) fn fed_adopt(&mut self, c: FedAdopt, rev: u64) -> crate::state::Applied {
        let _ = (c, rev);
        todo!("h-region")
    }

    pub(crate) fn fed_renew(&mut self, c: FedRenew, rev: u64) -> crate::state::Applied {
        let _ = (c, rev);
        todo!("h-region")
    }

    pub(crate) fn fed_release(&mut self, c: FedRelease, rev: u64) -> crate::state::Applied {
        let _ = (c, rev);
        todo!("h-region")
    }
}
