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
}

/// Largest message a server decodes by default (bytes); servers make it configurable.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
