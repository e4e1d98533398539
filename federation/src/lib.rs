//! suanli's federation: one global layer over several regions (docs/federation.md).
//!
//! Each region keeps its own control plane; the federation is a separate openraft group (same
//! binary, `suanli federation serve`) whose voters are spread across regions. It holds the region
//! directory and each region's capacity, the federated jobs with their leases and epochs, the
//! teams' worldwide quotas and the usage roll-up ([`FedState`]). Its leader dispatches pending jobs
//! with a pure function ([`dispatch::dispatch`]) and expires leases; each region's leader calls
//! `Federation.Sync` every `sync_interval_ms` to push capacity, renew the leases of the jobs it
//! holds and pull new assignments.
//!
//! ```text
//!   user ──Submit──▶ federation leader ──FedCommand (raft, RocksDB)──▶ FedState
//!                         │ dispatch loop: view_of(state) ─▶ dispatch() ─▶ FedCommand::Dispatch
//!                         │ expiry loop:   FedCommand::Expire { now }   (lease end + margin passed)
//!   region leader ──Sync(capacity, held jobs)──▶ FedCommand::Sync ──▶ leases, assignments, refusals
//!        └─▶ region raft: fed_adopt / fed_renew / fed_release / fed_quota_leases ─▶ agents (lease in AllocInfo + heartbeats)
//! ```
//!
//! Lease fencing: a region runs a federated job only under an unexpired lease; its agents stop
//! the task `stop_before_ms` before the lease's end; the federation re-dispatches (epoch + 1,
//! from the latest checkpoint) only after `lease_until + redispatch_margin_ms`.

pub mod access;
pub mod command;
pub mod dispatch;
pub mod loops;
pub mod metrics;
pub mod model;
pub mod node;
pub mod quota;
pub mod server;
pub mod service;
pub mod state;

pub use command::{FedCommand, FedResponse};
pub use model::*;
pub use state::FedState;

use suanli_raft::{LogCommand, ServerNode};

openraft::declare_raft_types!(
    /// The type configuration of the federation's raft group.
    pub FedTypeConfig:
        D = LogCommand,
        R = FedResponse,
        NodeId = u64,
        Node = ServerNode,
        Entry = openraft::Entry<FedTypeConfig>,
        SnapshotData = std::io::Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The federation's raft node.
pub type FedRaft = openraft::Raft<FedTypeConfig>;
/// Read access to the federation's applied state.
pub type FedHandle = suanli_raft::MachineHandle<FedState>;

/// The raft group name the federation's messages carry (a region's is "region").
pub const GROUP: &str = "federation";
