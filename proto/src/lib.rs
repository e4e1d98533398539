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

/// Package `suanli.v1`.
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
