//! suanli's versioned gRPC APIs: the `.proto` files under `proto/suanli/v1/` and the tonic/prost
//! code generated from them.
//!
//! It owns the wire contract between clients, agents and servers, and between servers (raft).
//! Clients depend on this crate alone, never on a server crate.
//!
//! ```text
//!  proto/suanli/v1/{types,api,agent,raft}.proto ──build.rs (vendored protoc)──▶ v1::{..}
//!     Jobs, Queues, Pools, Nodes, Cluster  ◀── `suanli` CLI, dashboards
//!     Agent                                ◀── `suanli agent` on every node
//!     RaftTransport                        ◀── `suanli-raft` between servers
//! ```
//!
//! It must never hold logic: no validation, no I/O beyond what tonic generates. Fields are only
//! ever added; numbers are never reused.

/// Package `suanli.v1`. Every message derives `serde::Serialize` (JSON output of clients),
/// and every proto `map` is a `BTreeMap`, so both iterate and print in key order.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("suanli.v1");
    // The device plugin payloads (device.proto), generated without gRPC in `suanli-device-proto`.
    pub use suanli_device_proto::v1::*;
}

/// The encoded `FileDescriptorSet` of every `.proto` file above (with source info): what a
/// server's gRPC reflection service answers with, so `grpcurl` and similar tools need no copy
/// of the files.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("suanli_descriptor");

/// Largest message a server decodes by default (bytes); servers make it configurable.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Response metadata key in which a server names the leader's client address (`host:port`),
/// on UNAVAILABLE answers from a server that cannot serve a write itself. Clients retry there.
pub const LEADER_HEADER: &str = "suanli-leader";

/// Most jobs one `Jobs.SubmitMany` call may carry; a larger call is INVALID_ARGUMENT.
pub const MAX_JOBS_PER_CALL: usize = 1024;

/// Serde helpers named by the `#[serde(...)]` attributes `build.rs` puts on generated types,
/// so their JSON reads as the CLI and docs show it (enum names, embedded JSON documents).
pub mod json {
    use serde::Serializer;

    /// A `NodeMode` as its lowercase name (`schedulable`, `cordoned`, `draining`; `unknown`
    /// for a value this build does not know).
    pub fn node_mode<S: Serializer>(mode: &i32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(node_mode_name(*mode))
    }

    /// The lowercase name of a `NodeMode` value.
    pub fn node_mode_name(mode: i32) -> &'static str {
        match crate::v1::NodeMode::try_from(mode) {
            Ok(crate::v1::NodeMode::Schedulable) => "schedulable",
            Ok(crate::v1::NodeMode::Cordoned) => "cordoned",
            Ok(crate::v1::NodeMode::Draining) => "draining",
            _ => "unknown",
        }
    }

    /// A JSON document carried as a string field (`JobInfo.spec_json`), embedded as JSON: null
    /// when empty (a summary carries none), the text itself when it is not JSON.
    pub fn embedded<S: Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
        if text.is_empty() {
            return s.serialize_none();
        }
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v) => s.serialize_some(&v),
            Err(_) => s.serialize_str(text),
        }
    }
}
