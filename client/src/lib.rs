//! suanli's one client library: what the CLI, the agent, chaos, the benchmarks and the tests
//! use to talk to a cluster. It owns the leader-following connection, the one retry backoff,
//! request ids and typed calls; callers render and decide.
//!
//! ```text
//!   addresses a:7400,b:7400,c:7400 (+ members learnt later)
//!      │ connect (connect_timeout) ─ refused / UNAVAILABLE ─────────────────▶ next address
//!      │ no answer in first_answer and none to a probe_timeout `Cluster.Leader` ─▶ next address
//!      │ error naming the leader in `suanli-leader` metadata ───────────────▶ retry there once
//!      ▼
//!   Connection::call(|channel| ...)  ◀── typed calls: submit_job, list_jobs (paged), members, ...
//!   backoff::Backoff (backon)        ◀── idempotent retries (same request id), reconnect loops
//! ```
//!
//! A listed server that accepts connections but never answers (SIGSTOPped, wedged) costs at
//! most `first_answer` + `probe_timeout`; a server that answers the probe is only slow, and the
//! request keeps its own timeout there.
//!
//! It must never depend on a server crate (only on `suanli-proto`), print, or retry a
//! non-idempotent request: a retried submission carries the same request id, so the server
//! returns the first job instead of creating a second.

pub mod backoff;
mod calls;
mod conn;
mod cost;
mod error;
pub mod federation;

pub use calls::{JobFilter, PAGE};
pub use conn::{Bearer, CallChannel, Connection, ConnectionConfig, LeaderHints, answer_unless_hung, leader_hint};
pub use error::{ClientError, code_name};
pub use suanli_proto::v1 as pb;

/// A new request id: `{prefix}-{UUID v7}` (time-ordered, 74 random bits), at most 48 bytes
/// for a prefix of up to 11. The server takes any id up to its `max_request_id_len` (128 by
/// default); the prefix says which tool submitted (`cli`, `bench`, `chaos`).
pub fn new_request_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_differ_and_sort_by_time() {
        let (a, b) = (new_request_id("cli"), new_request_id("cli"));
        assert_ne!(a, b);
        assert!(a.starts_with("cli-") && a.len() == 4 + 36, "{a}");
        // v7: the first 48 bits are milliseconds, so ids made later never sort first.
        assert!(a[..4 + 13] <= b[..4 + 13], "{a} {b}");
    }
}
