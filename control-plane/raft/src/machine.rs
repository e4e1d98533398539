//! The seam between consensus and the application: any deterministic state machine.
//!
//! `suanli-raft` is generic over [`Machine`], so another raft group (the federation's) reuses the
//! storage, the network and [`crate::open_group`] with its own command and state types.

use std::fmt::Debug;

/// A deterministic state machine replicated by raft.
pub trait Machine: Send + Sync + Sized + 'static {
    /// What the log carries.
    type Command: openraft::AppData + Debug;
    /// What applying a command returns to the proposer.
    type Response: openraft::AppDataResponse + Debug;

    /// An empty machine (before any log entry or snapshot).
    fn empty() -> Self;

    /// Applies one command. Must be deterministic: no clock, no I/O, no randomness.
    fn apply(&mut self, cmd: Self::Command) -> Self::Response;

    /// The response for raft-internal entries (blank and membership entries).
    fn internal_response() -> Self::Response;

    /// `Some(reason)` when the replica cannot continue applying the log after `resp` (e.g. a
    /// command kind too new for this build); the storage then fails and raft stops this node.
    fn fatal(resp: &Self::Response) -> Option<String>;

    /// Serializes the whole machine.
    fn snapshot(&self) -> Result<Vec<u8>, String>;

    /// Rebuilds a machine from [`Machine::snapshot`] bytes.
    fn restore(bytes: &[u8]) -> Result<Self, String>;
}

impl Machine for suanli_state::State {
    type Command = suanli_state::Command;
    type Response = suanli_state::Response;

    fn empty() -> Self {
        suanli_state::State::default()
    }

    fn apply(&mut self, cmd: Self::Command) -> Self::Response {
        suanli_state::State::apply(self, cmd)
    }

    fn internal_response() -> Self::Response {
        suanli_state::Response::Internal
    }

    fn fatal(resp: &Self::Response) -> Option<String> {
        match resp {
            suanli_state::Response::Unsupported { kind } => Some(format!(
                "command kind {kind:?} is not supported by this build and is not ignorable; upgrade this server"
            )),
            suanli_state::Response::Batch(rs) => rs.iter().find_map(Self::fatal),
            _ => None,
        }
    }

    fn snapshot(&self) -> Result<Vec<u8>, String> {
        suanli_state::State::snapshot(self).map_err(|e| e.to_string())
    }

    fn restore(bytes: &[u8]) -> Result<Self, String> {
        suanli_state::State::restore(bytes).map_err(|e| e.to_string())
    }
}
