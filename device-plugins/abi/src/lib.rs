//! suanli's device plugin ABI, for plugin authors.
//!
//! The contract is the C header `include/suanli_device_plugin.h`; this crate gives plugin
//! authors a safe Rust trait, [`DevicePlugin`], and [`export_plugin!`], which exports the C entry
//! point and catches panics at the boundary ([`export`]). [`ffi`] mirrors the header's structs;
//! nothing Rust-specific (`&str`, `String`, `Result`, Rust `fn` types) ever crosses the boundary.
//!
//! ```text
//!  agent ── suanli-device-host (supervisor ══frames══▶ plugin-host child ── loader) ──C ABI──▶ plugin.so
//!                                                                                            └─ this crate:
//!                                                                                               export_plugin!
//! ```
//!
//! Payloads are the protocol buffers of `proto/proto/suanli/v1/device.proto`, generated without
//! gRPC by `suanli-device-proto` and re-exported as [`pb`].
//!
//! Every plugin cdylib links this crate, so it must never depend on an async runtime, gRPC,
//! JSON or a dynamic loader: the host side (the `libloading` loader, the plugin-host child, the
//! agent's supervisor, the conformance kit) is the `suanli-device-host` crate.

pub mod export;
pub mod ffi;

use std::fmt;

/// The device payload messages (package `suanli.v1`, the messages of `device.proto`).
pub use suanli_device_proto::v1 as pb;

/// The ABI major version this crate implements (breaking changes).
pub const ABI_MAJOR: u32 = 1;
/// The ABI minor version this crate implements (additions only).
pub const ABI_MINOR: u32 = 3;

/// Error codes a plugin returns (the header's `SUANLI_DP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    /// A request field is malformed or out of range.
    InvalidArgument = 1,
    /// A device id the plugin does not know.
    NotFound = 2,
    /// The vendor library or the device is not available now.
    Unavailable = 3,
    /// The request is valid but the device's state refuses it (e.g. reserve of an unhealthy device).
    FailedPrecondition = 4,
    /// The call is not supported by this plugin.
    Unimplemented = 5,
    /// A bug or an unexpected vendor error.
    Internal = 6,
}

impl Code {
    /// The code for a raw value; unknown values map to `Internal`.
    pub fn from_raw(v: i32) -> Code {
        match v {
            1 => Code::InvalidArgument,
            2 => Code::NotFound,
            3 => Code::Unavailable,
            4 => Code::FailedPrecondition,
            5 => Code::Unimplemented,
            _ => Code::Internal,
        }
    }

    /// The lowercase name, for messages.
    pub fn as_str(&self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::Unavailable => "unavailable",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error returned by a plugin call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct PluginError {
    /// What kind of failure.
    pub code: Code,
    /// A message for operators.
    pub message: String,
}

impl PluginError {
    /// An error with a code and a message.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
    /// `InvalidArgument`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    /// `NotFound`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    /// `Unavailable`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, message)
    }
    /// `Internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }
}

/// The class of an unhealthy health event (ABI 1.3, `HealthEvent.event_class`): what the agent
/// does about it. docs/plugin-abi.md has the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventClass {
    /// 0: a plugin before 1.3. The device is unhealthy until an event or a fingerprint says
    /// healthy again (the 1.2 meaning).
    Unspecified,
    /// 1: the task's own error (an illegal address, a kernel fault). The device stays in service;
    /// the tasks on it are told.
    Application,
    /// 2: the device leaves service, its tasks checkpoint and move, the agent resets it once
    /// nothing holds it and returns it after a healthy fingerprint.
    Recoverable,
    /// 3: the device is quarantined until an operator clears it; an alert is raised.
    Fatal,
}

impl EventClass {
    /// The class of a raw `event_class`; values this version does not know are recoverable (the
    /// device leaves service, but is not written off).
    pub fn from_raw(v: u32) -> EventClass {
        match v {
            0 => EventClass::Unspecified,
            1 => EventClass::Application,
            3 => EventClass::Fatal,
            _ => EventClass::Recoverable,
        }
    }

    /// The wire value.
    pub fn raw(self) -> u32 {
        match self {
            EventClass::Unspecified => 0,
            EventClass::Application => 1,
            EventClass::Recoverable => 2,
            EventClass::Fatal => 3,
        }
    }

    /// The lowercase name, for logs, metrics and fault files.
    pub fn as_str(self) -> &'static str {
        match self {
            EventClass::Unspecified => "unspecified",
            EventClass::Application => "application",
            EventClass::Recoverable => "recoverable",
            EventClass::Fatal => "fatal",
        }
    }

    /// The class named `s` (as [`EventClass::as_str`] writes it).
    pub fn parse(s: &str) -> Option<EventClass> {
        [EventClass::Unspecified, EventClass::Application, EventClass::Recoverable, EventClass::Fatal]
            .into_iter()
            .find(|c| c.as_str() == s)
    }
}

/// What a device plugin implements. [`export_plugin!`] turns an implementation into the C ABI.
///
/// Calls may arrive from several threads at once (the header's "Threads" rule); `init` and
/// `shutdown` never overlap another call.
pub trait DevicePlugin: Send + Sync + Sized + 'static {
    /// Short name, e.g. `"nvidia"`.
    const NAME: &'static str;
    /// The plugin's own version, e.g. `env!("CARGO_PKG_VERSION")`.
    const VERSION: &'static str;

    /// Creates the instance (opens vendor libraries, reads the config file).
    fn init(config: pb::PluginConfig) -> Result<Self, PluginError>;
    /// Every device, its health and topology.
    fn fingerprint(&self) -> Result<pb::Inventory, PluginError>;
    /// What a task given these devices needs (environment, device files, mounts).
    fn reserve(&self, req: pb::ReserveRequest) -> Result<pb::Reservation, PluginError>;
    /// Utilization, memory, power, temperature, error counters.
    fn stats(&self, req: pb::StatsRequest) -> Result<pb::StatsResponse, PluginError>;
    /// Health events since the previous call (ABI 1.1).
    fn health_events(&self) -> Result<pb::HealthEvents, PluginError> {
        Ok(pb::HealthEvents::default())
    }
    /// The task holding `req.reservation_id` ended (ABI 1.2): undo what `reserve` set up for it.
    /// An id the plugin does not hold is not an error. The default holds nothing, so does nothing.
    fn release(&self, _req: pb::ReleaseRequest) -> Result<(), PluginError> {
        Ok(())
    }
    /// Returns `req.device_id` to a clean state after a recoverable error (ABI 1.3), e.g. a GPU
    /// reset. The agent calls it only when no reservation holds the device, then fingerprints:
    /// the device is back in service when the fingerprint says it is healthy. The default cannot
    /// reset (UNIMPLEMENTED): the agent then only waits for a healthy fingerprint.
    fn reset(&self, req: pb::ResetRequest) -> Result<(), PluginError> {
        Err(PluginError::new(Code::Unimplemented, format!("{} cannot reset device {:?}", Self::NAME, req.device_id)))
    }
    /// Releases vendor resources; the instance is dropped right after.
    fn shutdown(&self) {}
}
