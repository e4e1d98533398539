//! A region's link to the federation (docs/federation.md), run by the region's leader when
//! `[federation]` is configured: every `sync_interval_ms` it sends `Federation.Sync` (the region's
//! capacity per pool and device model, backlog, teams' local use, and every federated job it
//! holds with its epoch, status and latest checkpoint), then commits what came back: `fed_renew`
//! for renewed leases, `fed_adopt` for new assignments, `fed_release` for refusals and
//! cancellations. A held job whose lease gets within `stop_before_ms` of its end without a
//! renewal is released here too (`lease_expired`); the agents have already stopped its tasks by
//! then on their own (the lease travels in AllocInfo and heartbeats).

use crate::core::Core;
use std::sync::Arc;
use tokio::sync::watch;

/// The link loop (returns at once when `[federation]` is not configured).
pub async fn link(core: Arc<Core>, stop: watch::Receiver<bool>) {
    if core.cfg.federation.is_none() {
        return;
    }
    let _ = stop;
    todo!("h-region")
}
