//! The seam between consensus and the application: any deterministic state machine.
//!
//! `suanli-raft` is generic over [`Machine`], so another raft group (the federation's) reuses the
//! storage, the network and [`crate::open_group`] with its own command and state types.
//!
//! The log does not carry the machine's command type but [`LogCommand`]: the command's JSON,
//! made once by the proposer. Storing, reading back, replicating and receiving an entry copy
//! those bytes (serde_json embeds them verbatim and only scans them when reading); the command
//! is parsed once per server, when it is applied. The bytes are exactly what serializing the
//! command inside the entry produced before, so the stored format did not change.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::fmt::Debug;
use std::sync::Arc;

/// A command as the raft log carries it: its JSON encoding, shared (cloning is a reference
/// count). Only ever serialized with serde_json (the log store and the raft transport), which
/// writes it verbatim. (`Arc<Box<..>>` rather than `Arc<RawValue>`: wrapping the decoded box
/// moves a pointer where `Arc::from` would copy the bytes once more.)
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LogCommand(Arc<Box<RawValue>>);

impl LogCommand {
    /// Encodes a command (once; every copy after this shares the bytes).
    pub fn encode<T: Serialize>(cmd: &T) -> Result<Self, serde_json::Error> {
        Ok(Self(Arc::new(serde_json::value::to_raw_value(cmd)?)))
    }

    /// Parses the command back.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }

    /// The encoded JSON.
    pub fn json(&self) -> &str {
        self.0.get()
    }

    /// Encoded size in bytes (what `max_command_bytes` limits).
    pub fn len(&self) -> usize {
        self.0.get().len()
    }

    /// Never true for an encoded value; for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.0.get().is_empty()
    }
}

/// A deterministic state machine replicated by raft.
pub trait Machine: Send + Sync + Sized + 'static {
    /// The commands it applies; the log carries them encoded ([`LogCommand`]).
    type Command: Serialize + DeserializeOwned + Debug + Send + Sync + 'static;
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
