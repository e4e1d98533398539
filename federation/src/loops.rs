//! The federation leader's loops: dispatch (every `dispatch_interval_ms` and right after a
//! submit or sync commits) and lease expiry (every `expire_interval_ms`). Followers idle.
//!
//! ```text
//!  dispatch: view_of(state, now) ─▶ dispatch(view, seed) ─▶ changes? ─▶ FedCommand::Dispatch
//!            (a placement, or a hold whose reason differs from the job's current one)
//!  expiry:   some held job with lease_until + margin <= now? ─▶ FedCommand::Expire { now }
//! ```

use crate::command::FedCommand;
use crate::dispatch::{self, Decision};
use crate::node::{Node, now_ms};
use crate::state::FedState;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The decisions worth committing: every placement, and every hold whose reason is new.
pub fn changes(state: &FedState, decisions: Vec<Decision>) -> Vec<Decision> {
    decisions
        .into_iter()
        .filter(|d| match d {
            Decision::Place { .. } => true,
            Decision::Hold { job, reason } => state.job(job).is_some_and(|j| j.reason != *reason),
        })
        .collect()
}

/// Whether some held job's lease ended more than the margin ago at `now`.
pub fn has_expired(state: &FedState, now: u64) -> bool {
    let margin = state.config().redispatch_margin_ms;
    state.jobs.values().any(|j| j.state.is_held() && j.lease_until_ms.saturating_add(margin) <= now)
}

/// The dispatch loop.
pub async fn dispatching(node: Arc<Node>, mut stop: watch::Receiver<bool>) {
    let every = Duration::from_millis(node.cfg.dispatch_interval_ms);
    let mut seed: u64 = node.id();
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = node.kick.notified() => {}
            _ = stop.changed() => return,
        }
        if !node.is_leader() || node.state.read(|s| s.config.is_none()) {
            continue;
        }
        let now = now_ms();
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let decisions = node.state.read(|s| {
            let view = dispatch::view_of(s, now);
            if view.pending.is_empty() {
                return Vec::new();
            }
            changes(s, dispatch::dispatch(&view, seed))
        });
        if decisions.is_empty() {
            continue;
        }
        let n = decisions.len();
        match node.propose_local(FedCommand::Dispatch { decisions, now_ms: now }).await {
            Ok(r) => tracing::debug!(decisions = n, answer = ?r, "dispatch pass committed"),
            Err(e) => tracing::warn!(error = %e.message(), "dispatch pass not committed"),
        }
    }
}

/// The lease-expiry loop.
pub async fn expiring(node: Arc<Node>, mut stop: watch::Receiver<bool>) {
    let every = Duration::from_millis(node.cfg.expire_interval_ms);
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        if !node.is_leader() {
            continue;
        }
        let now = now_ms();
        if !node.state.read(|s| has_expired(s, now)) {
            continue;
        }
        match node.propose_local(FedCommand::Expire { now_ms: now }).await {
            Ok(r) => tracing::info!(answer = ?r, "leases expired"),
            Err(e) => tracing::warn!(error = %e.message(), "lease expiry not committed"),
        }
    }
}
