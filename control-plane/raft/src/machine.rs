//! The seam between consensus and the application: any deterministic state machine.
//!
//! `suanli-raft` is generic over [`Machine`], so another raft group (the federation's) reuses the
//! storage, the network and [`crate::open_group`] with its own command and state types.
//!
//! The log does not carry the machine's command type but [`LogCommand`]: the command's JSON,
//! made once by the proposer. Storing, reading back, replicating and receiving an entry copy
//! or share those bytes inside a binary frame ([`crate::frame`]); the command is parsed once
//! per server, when it is applied.

use bytes::Bytes;
use serde::de::{DeserializeOwned, Error as _};
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use std::fmt::Debug;

/// A command as the raft log carries it: its JSON encoding, shared (cloning is a reference
/// count, and an entry read back from storage or from a peer's message slices it out of that
/// buffer without a copy).
///
/// The log store and the raft transport write it verbatim inside their frames. Its serde
/// form (openraft requires one) is the JSON value itself, embedded as is.
#[derive(Clone, Debug)]
pub struct LogCommand(Bytes);

impl LogCommand {
    /// Encodes a command (once; every copy after this shares the bytes).
    pub fn encode<T: Serialize>(cmd: &T) -> Result<Self, serde_json::Error> {
        Ok(Self(serde_json::to_vec(cmd)?.into()))
    }

    /// Bytes that already hold a command's JSON (from a frame); parsed only by [`Self::decode`].
    pub(crate) fn from_bytes(b: Bytes) -> Self {
        Self(b)
    }

    /// Parses the command back.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.0)
    }

    /// The encoded JSON.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// Encoded size in bytes (what `max_command_bytes` limits).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never true for an encoded value; for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for LogCommand {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Checked (one scan): this path only serves JSON entries and messages, never the
        // store's or the transport's frames.
        let text = std::str::from_utf8(&self.0).map_err(S::Error::custom)?;
        RawValue::from_string(text.to_owned()).map_err(S::Error::custom)?.serialize(s)
    }
}

impl<'de> Deserialize<'de> for LogCommand {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        let text: Box<str> = raw.into();
        if text.is_empty() {
            return Err(D::Error::custom("a log command is empty"));
        }
        Ok(Self(Bytes::from(String::from(text).into_bytes())))
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

    /// The rolling digest of the applied log ([`crate::DigestWindow`]) stored in the machine,
    /// so that its snapshots carry it; 0 when the machine keeps none.
    fn log_digest(&self) -> u64 {
        0
    }

    /// Stores the rolling digest after each applied entry (see [`Machine::log_digest`]).
    fn set_log_digest(&mut self, _digest: u64) {}

    /// Applies one command. Must be deterministic: no clock, no I/O, no randomness.
    fn apply(&mut self, cmd: Self::Command) -> Self::Response;

    /// The response for raft-internal entries (blank and membership entries).
    fn internal_response() -> Self::Response;

    /// `Err(reason)` when this build may not apply `cmd` (e.g. a command kind too new for it,
    /// not marked ignorable). Checked before [`Machine::apply`]: the replica then halts at that
    /// entry with its state unchanged (read-only; [`crate::Halt`]).
    fn check(cmd: &Self::Command) -> Result<(), String>;

    /// The command's kind, for operators (named in a halt).
    fn kind(cmd: &Self::Command) -> String;

    /// `Some(reason)` when the replica cannot continue applying the log after `resp`: a
    /// backstop for what [`Machine::check`] should have caught; the replica halts after it.
    fn fatal(resp: &Self::Response) -> Option<String>;

    /// Whether `cmd`, met while halted at entry `halted_at`, is the operator's order to skip
    /// that entry (and every entry since, none of which was applied) and apply again.
    fn resumes(cmd: &Self::Command, halted_at: u64) -> bool;

    /// The answer to every entry not applied because of `halt`.
    fn halted_response(halt: &crate::Halt) -> Self::Response;

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

    fn log_digest(&self) -> u64 {
        suanli_state::State::log_digest(self)
    }

    fn set_log_digest(&mut self, digest: u64) {
        suanli_state::State::set_log_digest(self, digest);
    }

    fn apply(&mut self, cmd: Self::Command) -> Self::Response {
        suanli_state::State::apply(self, cmd)
    }

    fn internal_response() -> Self::Response {
        suanli_state::Response::Internal
    }

    fn check(cmd: &Self::Command) -> Result<(), String> {
        match cmd.unsupported_kind() {
            None => Ok(()),
            Some(kind) => Err(format!(
                "command kind {kind:?} is unknown to this build (suanli {}, which knows {}) and not ignorable: a build that knows it can apply it",
                env!("CARGO_PKG_VERSION"),
                suanli_state::Command::KINDS.join(", ")
            )),
        }
    }

    fn kind(cmd: &Self::Command) -> String {
        match cmd.unsupported_kind() {
            Some(k) => k.to_owned(),
            None => cmd.kind().to_owned(),
        }
    }

    fn resumes(cmd: &Self::Command, halted_at: u64) -> bool {
        matches!(cmd, suanli_state::Command::SkipEntry(s) if s.index == halted_at)
    }

    fn halted_response(halt: &crate::Halt) -> Self::Response {
        suanli_state::Response::Halted { index: halt.index, kind: halt.kind.clone(), reason: halt.reason.clone() }
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
