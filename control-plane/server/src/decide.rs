//! The leader's decisions as pure functions: state and time in, a decision out.
//!
//! ```text
//!  loops.rs / lifecycle.rs (the shell)            decide.rs (pure)
//!  ─ read metrics, state, heartbeats, clock ─▶   liveness(seen, ttl, now, clock pass)  ─▶ Alive | Down | ...
//!                                                 plan_choice(state, plan, since)       ─▶ Work | Reasons | Nothing
//!                                                 successors(me, voters, matched)       ─▶ hand-off order
//!                                                 first_start(cfg, initialized)         ─▶ Recover | Join | ...
//!  ◀─ carry it out: propose through raft, log, call a peer
//! ```
//!
//! Nothing here reads a clock, does I/O, awaits or locks: time is an argument, so each rule
//! is unit-tested at the instants that matter (one millisecond before and after a TTL, a clock
//! check that passed just before or just after it).

use crate::config::ServerConfig;
use std::collections::BTreeMap;
use std::time::Duration;
use suanli_model::Plan;
use suanli_raft::ServerNode;
use suanli_state::{AgentFence, State};
use tokio::time::Instant;

/// Refused reasons-only plans are written at most this often (they carry no placement).
pub const REASONS_EVERY: Duration = Duration::from_secs(5);

/// The heartbeat TTL of a node: the configured one, never shorter than what its agent's fence
/// needs under the clock drift bound ([`crate::clock::ttl_for_fence`]).
pub fn node_ttl(fence: Option<AgentFence>, ttl_ms: u64, drift_permille: u64) -> Duration {
    Duration::from_millis(ttl_ms.max(crate::clock::ttl_for_fence(fence, ttl_ms, drift_permille)))
}

/// What the liveness check makes of one ready node at one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// No heartbeat seen under this leadership: it gets a full TTL from now (a new leader has
    /// no history; the shell records `now` as its last heartbeat).
    Unseen,
    /// Heard from within its TTL.
    Alive,
    /// Silent past its TTL, and a clock check passed once the TTL was reached: declare it down.
    Down,
    /// Silent past its TTL, but no clock check passed since the TTL was reached (a leader clock
    /// running fast, or off its followers', declares nobody down): not yet.
    WaitingForClock,
}

/// The verdict on one node: last heartbeat `seen` (this leadership's), its `ttl`, at `now`,
/// with the last time this leader's clock check passed.
pub fn liveness(seen: Option<Instant>, ttl: Duration, now: Instant, clock_passed: Option<Instant>) -> Liveness {
    let Some(seen) = seen else { return Liveness::Unseen };
    if now.saturating_duration_since(seen) <= ttl {
        return Liveness::Alive;
    }
    if clock_passed.is_some_and(|p| p >= seen + ttl) { Liveness::Down } else { Liveness::WaitingForClock }
}

/// What the scheduling loop does with a plan it computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanChoice {
    /// It places or preempts something: propose it.
    Work,
    /// Nothing placed, but some waiting job's reason changed and none was written for
    /// [`REASONS_EVERY`]: propose it so `job status` shows why jobs wait.
    Reasons,
    /// Nothing worth a log entry.
    Nothing,
}

/// Whether `plan`, computed from `s`, is worth proposing, `since_reasons` after the last
/// reasons-only plan.
pub fn plan_choice(s: &State, plan: &Plan, since_reasons: Duration) -> PlanChoice {
    if !plan.placements.is_empty() || !plan.preemptions.is_empty() {
        return PlanChoice::Work;
    }
    if since_reasons >= REASONS_EVERY && reasons_changed(s, plan) { PlanChoice::Reasons } else { PlanChoice::Nothing }
}

/// Whether any unplaced job's reason differs from the one it shows now (a reason cut to the
/// replicated `max_message_len` counts as the same).
fn reasons_changed(s: &State, plan: &Plan) -> bool {
    let max = s.config().max_message_len;
    plan.unplaced.iter().any(|u| {
        s.job(u.job).is_some_and(|j| j.reason != u.reason && !(u.reason.len() > max && u.reason.starts_with(&j.reason)))
    })
}

/// Whether a committed plan calls for another pass at once: some placements were refused at
/// apply (the state moved under the plan), or the pass was cut at `max_jobs_per_pass`.
pub fn pass_again(refused_jobs: usize, placements: usize, max_jobs_per_pass: usize) -> bool {
    refused_jobs > 0 || placements >= max_jobs_per_pass
}

/// The voters a stepping-down leader `me` asks to take over, most caught up first (ties: the
/// smaller id), from its replication view (`matched`: the last index each voter holds).
pub fn successors(
    me: u64,
    voters: impl IntoIterator<Item = (u64, ServerNode)>,
    matched: &BTreeMap<u64, u64>,
) -> Vec<(u64, ServerNode)> {
    let mut out: Vec<(u64, u64, ServerNode)> = voters
        .into_iter()
        .filter(|(v, _)| *v != me)
        .map(|(v, n)| (v, matched.get(&v).copied().unwrap_or(0), n))
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    out.into_iter().map(|(v, _, n)| (v, n)).collect()
}

/// What a server does about its membership when it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// Its storage holds a membership: recover from it.
    Recover,
    /// Ask the cluster at this address to add it.
    Join(String),
    /// Create a new cluster with these voters (unless a listed peer already runs one).
    Initialize(BTreeMap<u64, ServerNode>),
    /// Wait until a leader adds it; the reason, for the log.
    Wait(&'static str),
}

/// The first-start rule: recover when initialized; `join`; with `bootstrap`, the smallest id
/// of `peers` (or a server alone) initializes; any other server waits to be added, so a wiped
/// server restarted with its original flags never creates a second cluster.
pub fn first_start(cfg: &ServerConfig, initialized: bool) -> Start {
    if initialized {
        return Start::Recover;
    }
    if let Some(join) = &cfg.join {
        return Start::Join(join.clone());
    }
    let smallest = cfg.peers.iter().map(|p| p.id).min().unwrap_or(cfg.id);
    if cfg.bootstrap && smallest == cfg.id {
        let members = if cfg.peers.is_empty() {
            [(cfg.id, ServerNode::new(cfg.peer_advertised(), cfg.advertised().to_owned()))].into()
        } else {
            // validate() checked that every peer address derives.
            cfg.peers.iter().map(|p| (p.id, ServerNode::new(p.peer().unwrap_or_default(), p.addr.clone()))).collect()
        };
        return Start::Initialize(members);
    }
    Start::Wait(if cfg.bootstrap {
        "another server bootstraps the cluster"
    } else {
        "start the first server of a new cluster with --bootstrap; this one must be added (`suanli cluster add-server`) or --join"
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Peer;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_node_is_down_only_past_its_ttl_and_after_a_clock_check_that_passed_since() {
        let t0 = Instant::now();
        let ttl = Duration::from_millis(10_000);
        let pass = |d: Duration| Some(t0 + d);
        assert_eq!(liveness(None, ttl, t0, pass(ttl)), Liveness::Unseen, "a new leader gives a full TTL");
        assert_eq!(liveness(Some(t0), ttl, t0 + ttl, pass(ttl)), Liveness::Alive, "exactly the TTL is alive");
        let late = t0 + ttl + MS;
        assert_eq!(liveness(Some(t0), ttl, late, pass(ttl)), Liveness::Down, "a check passed at the TTL");
        assert_eq!(liveness(Some(t0), ttl, late, pass(ttl + MS)), Liveness::Down);
        assert_eq!(
            liveness(Some(t0), ttl, late, pass(ttl - MS)),
            Liveness::WaitingForClock,
            "a check that passed before the TTL was reached says nothing about the silence"
        );
        assert_eq!(liveness(Some(t0), ttl, late, None), Liveness::WaitingForClock, "never passed");
        // A heartbeat later than the clock's last pass restarts the wait.
        assert_eq!(liveness(Some(t0 + ttl), ttl, t0 + 2 * ttl + MS, pass(ttl + MS)), Liveness::WaitingForClock);
    }

    #[test]
    fn a_fence_longer_than_the_ttl_stretches_it() {
        assert_eq!(node_ttl(None, 10_000, 50), Duration::from_millis(10_000));
        // 8 s fence + 4 s kill grace under 5% drift needs (12000 * 1.05 / 0.95) + 100 ms.
        let fence = AgentFence { after_ms: 8_000, kill_grace_ms: 4_000 };
        assert_eq!(node_ttl(Some(fence), 10_000, 50), Duration::from_millis(13_364));
        let short = AgentFence { after_ms: 1_000, kill_grace_ms: 1_000 };
        assert_eq!(node_ttl(Some(short), 10_000, 50), Duration::from_millis(10_000), "never shorter");
    }

    #[test]
    fn reasons_only_plans_wait_their_interval() {
        let s = State::default();
        let empty = Plan::default();
        assert_eq!(plan_choice(&s, &empty, Duration::from_secs(60)), PlanChoice::Nothing, "no reason changed");
        assert!(pass_again(1, 0, 5_000), "a refused placement is retried at once");
        assert!(pass_again(0, 5_000, 5_000), "a pass cut at its bound goes on");
        assert!(!pass_again(0, 4_999, 5_000));
    }

    #[test]
    fn hand_off_goes_to_the_most_caught_up_voter_first() {
        let node =
            |i: u64| ServerNode::new(format!("127.0.0.1:{}", 7401 + 2 * i), format!("127.0.0.1:{}", 7400 + 2 * i));
        let voters = (1..=5).map(|i| (i, node(i)));
        let matched: BTreeMap<u64, u64> = [(2, 90), (3, 120), (4, 120)].into();
        let order: Vec<u64> = successors(1, voters, &matched).into_iter().map(|(id, _)| id).collect();
        assert_eq!(order, [3, 4, 2, 5], "most caught up first, ties by id, unknown progress last, never itself");
        assert!(successors(1, [(1, node(1))], &matched).is_empty(), "alone: nobody to hand off to");
    }

    #[test]
    fn only_the_smallest_bootstrapping_id_initializes() {
        let peers: Vec<Peer> = ["1=127.0.0.1:7400", "2=127.0.0.1:7402", "3=127.0.0.1:7404"]
            .into_iter()
            .map(|p| Peer::parse(p).expect("peer"))
            .collect();
        let cfg =
            |id: u64, bootstrap: bool| ServerConfig { id, bootstrap, peers: peers.clone(), ..ServerConfig::default() };
        assert_eq!(first_start(&cfg(1, true), true), Start::Recover, "storage wins over flags");
        let Start::Initialize(m) = first_start(&cfg(1, true), false) else { panic!("server 1 initializes") };
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(m[&2].addr, "127.0.0.1:7403", "peer address derived (port + 1)");
        assert!(matches!(first_start(&cfg(2, true), false), Start::Wait(w) if w.contains("another server")));
        assert!(
            matches!(first_start(&cfg(1, false), false), Start::Wait(w) if w.contains("--bootstrap")),
            "a wiped server restarted without --bootstrap never creates a cluster"
        );
        let alone = ServerConfig { bootstrap: true, ..ServerConfig::default() };
        let Start::Initialize(m) = first_start(&alone, false) else { panic!("alone, it initializes") };
        assert_eq!(m.len(), 1);
        let join = ServerConfig { join: Some("10.0.0.1:7400".into()), ..ServerConfig::default() };
        assert_eq!(first_start(&join, false), Start::Join("10.0.0.1:7400".into()));
    }
}
