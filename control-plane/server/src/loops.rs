//! The leader's loops: scheduling and node liveness. Both run on every server and act only
//! while it leads, so a new leader takes over without any hand-off.
//!
//! ```text
//!  scheduling: wake (kick | interval) ─▶ view = state.cluster_view(now) ─▶ schedule(view, now,
//!              seed ^ applied index) ─▶ ApplyPlan{plan, now} through raft (apply re-checks it)
//!  liveness:   every heartbeat interval ─▶ ready node silent for its TTL (never shorter than
//!              its agent's fence under the drift bound) and a clock check passed since
//!              ─▶ NodeDown through raft (its allocations are lost and their jobs requeued)
//! ```

use crate::core::Core;
use crate::decide::{self, Liveness, PlanChoice, REASONS_EVERY};
use std::sync::Arc;
use std::time::Duration;
use suanli_model::NodeId;
use suanli_scheduler::rehearsal::{Rehearsal, RehearsalConfig, rehearse};
use suanli_scheduler::{SchedulerConfig, schedule};
use suanli_state::{ApplyPlan, Command, NodeDown, NodeStatus, Response, SetNodeMode, State};
use tokio::sync::watch;
use tokio::time::Instant;

pub(crate) async fn until_leader(core: &Core, stop: &mut watch::Receiver<bool>) -> bool {
    let mut m = core.raft.metrics();
    tokio::select! {
        r = m.wait_for(|m| m.state == openraft::ServerState::Leader) => r.is_ok(),
        _ = stop.changed() => false,
    }
}

/// Gives the cluster its identity: while it has none, its leader proposes a new random id
/// (drawn here, so apply stays deterministic; apply keeps the first one committed). Ends once
/// the applied state has one.
pub async fn identity(core: Arc<Core>, mut stop: watch::Receiver<bool>) {
    let mut backoff = suanli_client::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(5)).delays();
    loop {
        if !core.state.read(|s| s.cluster_id().is_empty()) {
            return;
        }
        if !core.is_leader() && !until_leader(&core, &mut stop).await {
            return;
        }
        if core.halted().is_none() && core.state.read(|s| s.cluster_id().is_empty()) {
            let id = crate::backup::new_cluster_id();
            match core.propose_local(Command::SetClusterId(suanli_state::SetClusterId { id: id.clone() })).await {
                Ok(_) => {
                    tracing::info!(cluster_id = %core.state.read(|s| s.cluster_id().to_owned()), "the cluster has its identity")
                }
                Err(e) => tracing::warn!(error = %e, "could not set the cluster id yet; retrying"),
            }
        }
        tokio::select! {
            () = tokio::time::sleep(backoff.next_or_max()) => {}
            _ = stop.changed() => return,
        }
    }
}

/// How often the leader rehearses the default's tie rule on the pending work (at most).
const REHEARSE_EVERY: Duration = Duration::from_secs(300);

/// The scheduling loop.
pub async fn scheduling(core: Arc<Core>, mut stop: watch::Receiver<bool>) {
    let interval = Duration::from_millis(core.cfg.schedule_interval_ms);
    let cfg = SchedulerConfig {
        policy: core.cfg.policy.clone(),
        max_jobs_per_pass: core.cfg.max_jobs_per_pass,
        ..SchedulerConfig::default()
    };
    let mut last_reasons = Instant::now().checked_sub(REASONS_EVERY).unwrap_or_else(Instant::now);
    let min_gap = Duration::from_millis(core.cfg.schedule_min_gap_ms);
    let mut last_pass = Instant::now().checked_sub(min_gap).unwrap_or_else(Instant::now);
    // The default's tie rule is rehearsed on the pending work in the background, at most
    // every REHEARSE_EVERY, and used by the passes after it ends (suanli_scheduler::rehearsal).
    let mut rehearsing: Option<tokio::task::JoinHandle<Result<Rehearsal, String>>> = None;
    let mut last_rehearsal: Option<Instant> = None;
    let mut cfg = cfg;
    loop {
        if *stop.borrow() {
            return;
        }
        if !core.is_leader() && !until_leader(&core, &mut stop).await {
            return;
        }
        tokio::select! {
            () = core.kick.notified() => {}
            () = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
        let since = last_pass.elapsed();
        if since < min_gap {
            tokio::time::sleep(min_gap - since).await;
        }
        last_pass = Instant::now();
        // A halted group is read-only: no plan could commit.
        if !core.is_leader() || core.halted().is_some() {
            continue;
        }
        if rehearsing.as_ref().is_some_and(tokio::task::JoinHandle::is_finished)
            && let Some(h) = rehearsing.take()
        {
            match h.await {
                Ok(Ok(r)) => {
                    if cfg.ties != Some(r.ties) {
                        tracing::info!(
                            rule = r.ties.as_str(),
                            why = r.why,
                            runs = r.runs,
                            nodes = r.nodes,
                            gain = r.gain(),
                            se = r.se,
                            "the default's tie rule, rehearsed on the pending work"
                        );
                    }
                    cfg.ties = Some(r.ties);
                    *core.tie_rule.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(r);
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "rehearsing the default's tie rule failed"),
                Err(e) => tracing::error!(error = %e, "rehearsing the default's tie rule panicked"),
            }
        }
        let now = core.now_s();
        let mut view = core.state.read(|s| s.cluster_view(now));
        // A federated job whose lease is about to run out waits for its renewal.
        let held = if core.cfg.federation.is_some() {
            let margin = crate::federation_link::placement_margin_ms();
            let drift = crate::federation_link::drift_ms();
            core.state.read(|s| {
                let mut held = crate::federation_link::hold_short_leases(s, &mut view, wall_ms(), margin);
                held.extend(crate::federation_link::hold_for_quota_leases(s, &mut view, wall_ms(), drift));
                held
            })
        } else {
            Vec::new()
        };
        if view.pending.is_empty() && held.is_empty() {
            continue;
        }
        if cfg.policy == "suanli"
            && rehearsing.is_none()
            && !view.pending.is_empty()
            && last_rehearsal.is_none_or(|t| t.elapsed() >= REHEARSE_EVERY)
        {
            last_rehearsal = Some(Instant::now());
            let (nodes, samples) = (view.nodes.clone(), suanli_scheduler::engine::workload_samples(&view));
            let (coverage, weights) = (cfg.typical_coverage, cfg.weights);
            let rc = RehearsalConfig { seed: core.cfg.scheduler_seed, ..RehearsalConfig::default() };
            rehearsing = Some(tokio::task::spawn_blocking(move || {
                rehearse(&nodes, &samples, coverage, weights, &rc).map_err(|e| e.to_string())
            }));
        }
        let seed = core.cfg.scheduler_seed ^ core.state.applied_index();
        let c = cfg.clone();
        let planned = if view.pending.is_empty() {
            Ok(Ok(suanli_model::Plan::default()))
        } else {
            tokio::task::spawn_blocking(move || schedule(&view, now, seed, &c)).await
        };
        let plan = match planned {
            Ok(Ok(mut p)) => {
                p.unplaced.extend(held);
                p
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "scheduling pass failed");
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "scheduling pass panicked");
                continue;
            }
        };
        match core.state.read(|s| decide::plan_choice(s, &plan, last_reasons.elapsed())) {
            PlanChoice::Work => {}
            PlanChoice::Reasons => last_reasons = Instant::now(),
            PlanChoice::Nothing => continue,
        }
        let placements = plan.placements.len();
        let reasons = core.state.read(|s| crate::telemetry::wait_reasons(s, &plan));
        match core.propose_local(Command::ApplyPlan(ApplyPlan { plan, now })).await {
            Ok((Response::PlanApplied(o), index)) => {
                if crate::telemetry::enabled() {
                    core.state.read(|s| crate::telemetry::plan_committed(s, &o.placed, &o.preempted, &reasons, now));
                }
                tracing::debug!(index, placed = o.placed.len(), refused = o.refused_jobs.len(), "plan committed");
                if decide::pass_again(o.refused_jobs.len(), placements, core.cfg.max_jobs_per_pass) {
                    core.kick.notify_one();
                }
            }
            Ok((other, _)) => tracing::warn!(answer = ?other, "plan refused"),
            Err(e) => tracing::info!(error = %e.message(), "plan not committed (leadership change?)"),
        }
    }
}

/// This server's wall clock, ms since the Unix epoch (federation leases are in wall time).
pub(crate) fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The node liveness loop.
pub async fn liveness(core: Arc<Core>, mut stop: watch::Receiver<bool>) {
    let period = Duration::from_millis(core.cfg.heartbeat_interval_ms);
    // The term this server last led in: a leadership lost and won back between two ticks
    // is a new leadership too (the nodes heartbeated to another leader meanwhile).
    let mut leading: Option<u64> = None;
    let mut deferred = std::collections::BTreeSet::new();
    loop {
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
        // Halted (read-only): no node can be declared down; once applying again, every node
        // gets a full TTL, as under a new leader.
        if !core.is_leader() || core.halted().is_some() {
            leading = None;
            deferred.clear();
            continue;
        }
        let term = core.raft.metrics().borrow().current_term;
        let t = Instant::now();
        let (ttl_ms, drift) = (core.cfg.heartbeat_ttl_ms, core.cfg.max_clock_drift_permille);
        let ready: Vec<(NodeId, Duration)> = core.state.read(|s: &State| {
            s.nodes()
                .values()
                .filter(|n| n.status == NodeStatus::Ready)
                .map(|n| (n.node.id.clone(), decide::node_ttl(n.fence, ttl_ms, drift)))
                .collect()
        });
        let clock_passed = core.clock.last_pass();
        let mut down = Vec::new();
        {
            let mut hb = core.heartbeats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if leading != Some(term) {
                // A new leader has no heartbeat history: every node gets a full TTL from now
                // (no earlier than the moment it became leader).
                hb.clear();
                leading = Some(term);
            }
            for (id, ttl) in ready {
                match decide::liveness(hb.get(&id).copied(), ttl, t, clock_passed) {
                    Liveness::Unseen => {
                        hb.insert(id.clone(), t);
                        deferred.remove(&id);
                    }
                    Liveness::Alive => {
                        deferred.remove(&id);
                    }
                    Liveness::Down => down.push((id, ttl)),
                    // Logged only while the check fails: one passing but not yet repeated is
                    // no news.
                    Liveness::WaitingForClock => {
                        if !core.clock.passing() && deferred.insert(id.clone()) {
                            tracing::warn!(node = %id, clock = %core.clock.line(core.is_leader()), "node silent past its TTL; not declared down until this leader's clock check passes");
                        }
                    }
                }
            }
        }
        // Drains whose grace period ran out (or whose budget freed up) with work still on
        // their node: the state machine evicts at the time a command brings.
        let due = core.state.read(|s: &State| s.drains_due(core.now_s()));
        for id in due {
            let cmd = Command::SetNodeMode(SetNodeMode {
                node: id.clone(),
                mode: suanli_state::NodeMode::Draining,
                now: core.now_s(),
                drain: None,
            });
            if let Err(e) = core.propose_local(cmd).await {
                tracing::info!(node = %id, error = %e.message(), "drain step not committed");
            }
        }
        for (id, ttl) in down {
            deferred.remove(&id);
            let reason = format!("no heartbeat for {} ms", ttl.as_millis());
            tracing::warn!(node = %id, %reason, "declaring node down");
            let cmd = Command::NodeDown(NodeDown { node: id.clone(), reason, now: core.now_s() });
            match core.propose_local(cmd).await {
                Ok(_) => {
                    core.heartbeats.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&id);
                    core.kick.notify_one();
                }
                Err(e) => tracing::info!(node = %id, error = %e.message(), "node down not committed"),
            }
        }
    }
}
