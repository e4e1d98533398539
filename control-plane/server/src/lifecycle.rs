//! A server's life in the membership: how it enters a cluster (bootstrap or join), notices it
//! was removed, and leaves on SIGTERM without hurting the others.
//!
//! ```text
//!  start:  storage initialized ─▶ recover          bootstrap + smallest peer id ─▶ initialize
//!          join ─▶ AddServer (ALREADY_EXISTS ─▶ exit)   otherwise ─▶ wait to be added (logged)
//!  run:    member once, then absent from the leader's membership ─▶ exit (removed)
//!  stop:   loops stop ─▶ [leader: pick the most caught-up voter] ─▶ raft.shutdown()
//!          ─▶ [leader: Internal.Campaign at that voter, until another leads (bounded)]
//!          ─▶ listeners drain (bounded grace) ─▶ return
//! ```
//!
//! Stepping down never waits unboundedly: every step has its own deadline, so SIGTERM always
//! ends the process. It must never declare a node down while leaving (the loops stop first),
//! nor campaign or vote after it decided to leave (raft is shut down before the listeners).

use crate::core::Core;
use crate::decide::{self, Start};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use suanli_client::backoff::Backoff;
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::internal_client::InternalClient;
use suanli_raft::ServerNode;
use suanli_security::tls::Tls;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tonic::{Code, Status};

/// Why a server ended on its own, not because it was asked to.
#[derive(Debug)]
pub enum Ending {
    /// `join` was refused for good (the id or an address is taken).
    JoinRefused(String),
    /// The cluster removed this server from its membership.
    Removed(String),
}

/// How often a server without storage says that it waits.
const WAITING_LOG_EVERY: Duration = Duration::from_secs(10);
/// How often a follower checks with the leader that it is still a member.
const MEMBER_CHECK_EVERY: Duration = Duration::from_secs(2);
/// Retries of `--join` before the server gives up and exits: about ten minutes of waiting for
/// the cluster it joins (0.2 s doubling to 5 s between tries).
const JOIN_RETRIES: usize = 120;
const JOIN_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(200), Duration::from_secs(5)).with_max_retries(JOIN_RETRIES);
/// Deadline of one call to another server made by these steps.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline of one `AddServer` call of `--join` (the leader answers once this server caught up).
const JOIN_CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// First start: initialize a new cluster (`bootstrap`: a single server, or the smallest id of
/// `peers`), or ask a running cluster to add this server (`join`), or wait to be added. Later
/// starts recover from storage and return at once.
pub async fn bootstrap(core: Arc<Core>, mut stop: watch::Receiver<bool>, ending: mpsc::Sender<Ending>) {
    let initialized = match core.raft.is_initialized().await {
        Ok(i) => i,
        Err(e) => {
            tracing::error!(error = %e, "raft stopped");
            return;
        }
    };
    let cfg = &core.cfg;
    let why = match decide::first_start(cfg, initialized) {
        Start::Recover => return,
        Start::Join(join) => {
            let mut backoff = JOIN_BACKOFF.delays();
            loop {
                match join_once(&join, &core, cfg.learner_only).await {
                    Ok(()) => {
                        tracing::info!(via = %join, "joined the cluster");
                        return;
                    }
                    Err(s) if matches!(s.code(), Code::AlreadyExists | Code::InvalidArgument) => {
                        let why = format!("joining through {join} was refused: {}", s.message());
                        tracing::error!(id = cfg.id, "{why}; this server exits");
                        let _ = ending.send(Ending::JoinRefused(why)).await;
                        return;
                    }
                    Err(s) => tracing::warn!(via = %join, error = %s.message(), "join failed; retrying"),
                }
                let Some(wait) = backoff.next_delay() else {
                    let why = format!("joining through {join} failed {JOIN_RETRIES} times in a row; giving up");
                    tracing::error!(id = cfg.id, "{why}; this server exits");
                    let _ = ending.send(Ending::JoinRefused(why)).await;
                    return;
                };
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = stop.changed() => return,
                }
            }
        }
        Start::Initialize(members) => match running_peer(core.as_ref()).await {
            None => {
                match core.raft.initialize(members).await {
                    Ok(()) => tracing::info!("initialized a new cluster (bootstrap)"),
                    Err(e) => tracing::info!(error = %e, "not initializing (already initialized?)"),
                }
                return;
            }
            Some((addr, leader)) => {
                tracing::error!(
                    peer = %addr,
                    leader,
                    "bootstrap refused: a listed peer already belongs to a running cluster; this server waits to be added (replace it under a new id: docs/operations.md)"
                );
                "a listed peer already runs the cluster"
            }
        },
        Start::Wait(why) => why,
    };
    // Empty storage and nothing to create: wait until a leader adds this server (its first
    // append initializes the storage).
    let me = cfg.advertised();
    let mut m = core.raft.metrics();
    loop {
        tracing::info!(id = cfg.id, listen = %me, "empty storage: waiting to be added to a cluster ({why})");
        let wait = tokio::time::timeout(WAITING_LOG_EVERY, m.wait_for(|m| m.membership_config.log_id().is_some()));
        tokio::select! {
            r = wait => match r {
                Ok(Ok(_)) => {
                    tracing::info!("added to a cluster");
                    return;
                }
                Ok(Err(_)) => return,
                Err(_) => {}
            },
            _ = stop.changed() => return,
        }
    }
}

/// A listed peer (not this server) that answers with a known leader: the cluster exists, so
/// this server must not create another one.
async fn running_peer(core: &Core) -> Option<(String, u64)> {
    for p in core.cfg.peers.iter().filter(|p| p.id != core.cfg.id) {
        let Ok(ch) = core.channel(&p.addr) else { continue };
        let mut req = tonic::Request::new(pb::LeaderRequest {});
        req.set_timeout(CALL_TIMEOUT);
        let call = tokio::time::timeout(CALL_TIMEOUT, ClusterClient::new(ch).leader(req)).await;
        if let Ok(Ok(r)) = call
            && r.get_ref().leader_id != 0
        {
            return Some((p.addr.clone(), r.get_ref().leader_id));
        }
    }
    None
}

/// A wiped server must not come back under its id: it lost its vote and its log, and a voter
/// that forgets its vote can elect two leaders in one term. Checked before the peer listener
/// is served (it is bound: a leader's connection waits in its backlog, else the leader would
/// start filling the empty storage at once): when the storage
/// is empty and the leader (one of the listed peers) names this id as a voter it had already
/// replicated entries to, the reason to refuse.
/// The peers are asked over TLS with `tls` (this server's certificate), plaintext without it.
pub async fn wiped_voter(cfg: &crate::ServerConfig, tls: Option<&Tls>) -> Option<String> {
    if cfg.join.is_some() {
        return None;
    }
    for p in cfg.peers.iter().filter(|p| p.id != cfg.id) {
        let Ok(ch) = dial(&p.addr, tls, CALL_TIMEOUT) else { continue };
        let Ok(Ok(r)) = tokio::time::timeout(CALL_TIMEOUT, ClusterClient::new(ch).members(pb::MembersRequest {})).await
        else {
            continue;
        };
        let r = r.into_inner();
        // Only the leader's view counts, and only a voter it had replicated to: the other
        // initial voters of a new cluster have empty storage too, but nothing matched yet.
        let from_leader = r.members.iter().any(|m| m.leader && m.addr == p.addr);
        if from_leader && r.members.iter().any(|m| m.id == cfg.id && m.voter && m.matched_index > 0) {
            return Some(format!(
                "server {id} is a voter of the cluster that {addr} belongs to, but this server's storage is empty: it was wiped, and a wiped server must not come back under its id (it lost its vote and log). Remove it (`suanli cluster remove-server --id {id}`) and start it under a new id with --join (docs/operations.md, \"Replace a server\")",
                id = cfg.id,
                addr = p.addr
            ));
        }
    }
    None
}

/// A channel to another server's `addr` (connected on first use within [`CALL_TIMEOUT`], each
/// call bounded by `timeout`): over TLS with `tls`, plaintext without it.
fn dial(addr: &str, tls: Option<&Tls>, timeout: Duration) -> Result<tonic::transport::Channel, Status> {
    let uri = if addr.contains("://") { addr.to_owned() } else { format!("http://{addr}") };
    let ep = tonic::transport::Endpoint::from_shared(uri)
        .map_err(|e| Status::invalid_argument(format!("{addr:?}: {e}")))?
        .connect_timeout(CALL_TIMEOUT)
        .timeout(timeout)
        .tcp_nodelay(true);
    Ok(suanli_security::tls::channel(ep, tls))
}

async fn join_once(via: &str, core: &Core, learner_only: bool) -> Result<(), Status> {
    let (id, addr, peer_addr) = (core.cfg.id, core.cfg.advertised().to_owned(), core.cfg.peer_advertised());
    // AddServer waits for the new member's catch-up: longer than the other calls here.
    let ch = dial(via, core.tls(), JOIN_CALL_TIMEOUT)
        .map_err(|e| Status::invalid_argument(format!("join: {}", e.message())))?;
    let req = pb::AddServerRequest { id, addr, learner_only, peer_addr };
    ClusterClient::new(ch).add_server(req).await?;
    Ok(())
}

/// Watches the membership: once this server has been a member, it ends with
/// [`Ending::Removed`] when the leader's membership no longer holds it. A removed server may
/// never receive the entry that removes it (the leader stops replicating to it at once), so a
/// follower asks the leader it last knew, and any member it knows, every few seconds.
pub async fn watch_membership(core: Arc<Core>, mut stop: watch::Receiver<bool>, ending: mpsc::Sender<Ending>) {
    let id = core.id;
    let mut was_member = false;
    let mut known: BTreeMap<u64, String> = BTreeMap::new();
    loop {
        tokio::select! {
            () = tokio::time::sleep(MEMBER_CHECK_EVERY) => {}
            _ = stop.changed() => return,
        }
        let (member, leader, committed_without_me) = {
            let m = core.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            let member = membership.get_node(&id).is_some();
            let applied = m.last_applied.map_or(0, |l| l.index);
            let at = m.membership_config.log_id().map_or(0, |l| l.index);
            let committed_without_me = !member && at > 0 && at <= applied;
            if member {
                known = membership.nodes().map(|(i, n)| (*i, n.client_addr().to_owned())).collect();
            }
            (member, m.current_leader, committed_without_me)
        };
        if member {
            was_member = true;
        }
        if !was_member {
            continue;
        }
        if committed_without_me {
            let why = format!("a committed membership no longer holds server {id}");
            let _ = ending.send(Ending::Removed(why)).await;
            return;
        }
        if core.is_leader() {
            continue;
        }
        // Ask the leader (the one this server knows first, then every member) for its view.
        let mut order: Vec<String> = Vec::new();
        if let Some(l) = leader.and_then(|l| known.get(&l)) {
            order.push(l.clone());
        }
        order.extend(known.iter().filter(|(i, _)| **i != id).map(|(_, a)| a.clone()));
        order.dedup();
        for addr in order {
            let Ok(ch) = core.channel(&addr) else { continue };
            let mut req = tonic::Request::new(pb::MembersRequest {});
            req.set_timeout(CALL_TIMEOUT);
            let r = match tokio::time::timeout(CALL_TIMEOUT, ClusterClient::new(ch).members(req)).await {
                Ok(Ok(r)) => r.into_inner(),
                Ok(Err(s)) => {
                    tracing::debug!(%addr, error = %s.message(), "membership check: no answer");
                    continue;
                }
                Err(_) => {
                    tracing::debug!(%addr, "membership check: timed out");
                    continue;
                }
            };
            tracing::debug!(%addr, term = r.term, members = ?r.members.iter().map(|m| (m.id, m.leader, &m.addr)).collect::<Vec<_>>(), "membership check");
            // Only a leader's own answer counts: it lists itself as leader. (Not compared with
            // this server's term: a removed voter that missed its removal campaigns in vain,
            // and its term runs ahead of the leader's.)
            let from_leader = r.members.iter().any(|m| m.leader && m.addr == addr);
            if !from_leader {
                continue;
            }
            if r.members.iter().all(|m| m.id != id) {
                let why = format!("the leader at {addr} (term {}) no longer lists server {id} as a member", r.term);
                let _ = ending.send(Ending::Removed(why)).await;
                return;
            }
            break;
        }
    }
}

/// The voters to hand leadership to, most caught up first (the leader's replication view;
/// the order is `decide::successors`).
pub fn successors(core: &Core) -> Vec<(u64, ServerNode)> {
    let m = core.raft.metrics();
    let m = m.borrow();
    let membership = m.membership_config.membership();
    let matched: BTreeMap<u64, u64> =
        m.replication.iter().flatten().filter_map(|(id, l)| l.as_ref().map(|l| (*id, l.index))).collect();
    let voters = membership.voter_ids().filter_map(|v| Some((v, membership.get_node(&v)?.clone())));
    decide::successors(core.id, voters, &matched)
}

/// Asks `successors` in turn to campaign until one answers with a leader other than this
/// server, or `within` passes. Raft here is already shut down.
pub async fn hand_off(core: &Core, successors: &[(u64, ServerNode)], within: Duration) -> Option<u64> {
    let deadline = Instant::now() + within;
    for (id, node) in successors {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let Ok(ch) = core.channel(&node.addr) else { continue };
        let mut req = tonic::Request::new(pb::CampaignRequest {
            group: core.cfg.raft.group.clone(),
            from_id: core.id,
            wait_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
        });
        req.set_timeout(left + Duration::from_millis(200));
        match tokio::time::timeout(left + Duration::from_millis(200), InternalClient::new(ch).campaign(req)).await {
            Ok(Ok(r)) if r.get_ref().leader_id != 0 && r.get_ref().leader_id != core.id => {
                return Some(r.get_ref().leader_id);
            }
            Ok(Ok(_)) => tracing::info!(successor = id, "no new leader yet"),
            Ok(Err(s)) => tracing::info!(successor = id, error = %s.message(), "campaign request failed"),
            Err(_) => tracing::info!(successor = id, "campaign request timed out"),
        }
    }
    None
}

/// The `Internal.Campaign` handler: campaign (once the stepping-down leader's lease has
/// lapsed, which the voters' lease check needs), then wait until a leader other than
/// `from_id` is known, campaigning again each election timeout; bounded by `wait`.
pub async fn campaign(core: &Core, from_id: u64, wait: Duration) -> pb::CampaignResponse {
    let wait = wait.min(Duration::from_secs(10));
    let deadline = Instant::now() + wait;
    let lease = Duration::from_millis(core.cfg.raft.election_timeout_max_ms);
    let mut rx = core.raft.metrics();
    let new_leader = |m: &openraft::RaftMetrics<u64, ServerNode>| m.current_leader.is_some_and(|l| l != from_id);
    // The leader stopped heartbeating just before it asked: the others refuse votes until
    // their lease (election_timeout_max) since its last heartbeat has passed.
    let first = tokio::time::timeout(lease.min(wait), rx.wait_for(new_leader)).await.map(|r| r.is_ok());
    if first != Ok(true) {
        loop {
            if Instant::now() >= deadline {
                break;
            }
            if let Err(e) = core.raft.trigger().elect().await {
                tracing::warn!(error = %e, "campaign: raft stopped");
                break;
            }
            tracing::info!(from = from_id, "campaigning: the leader is stepping down");
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(lease.min(left), rx.wait_for(new_leader)).await.map(|r| r.is_ok()).is_ok() {
                break;
            }
        }
    }
    let m = core.raft.metrics().borrow().clone();
    pb::CampaignResponse { leader_id: m.current_leader.filter(|l| *l != from_id).unwrap_or(0), term: m.current_term }
}
