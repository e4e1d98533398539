//! The hostile client (issue 15): a foreign client that makes every call that once could brick
//! a cluster, alongside the normal workload, and the invariant it must not break: **the
//! cluster stays writable**.
//!
//! ```text
//!   hostile client ──direct──▶ server j peer port     Internal.Propose: poison (unknown kinds,
//!                                                      leader-only kinds, garbage, bad batches)
//!                  ──direct──▶ server j client port   Internal.Propose (not served there),
//!                                                      AddServer (unreachable, bad addresses,
//!                                                      a real id at another address),
//!                                                      RemoveServer (unknown ids), oversized and
//!                                                      malformed Submit / Upsert / Register,
//!                                                      Jobs.Watch floods on one connection
//! ```
//!
//! It holds the cluster's strongest credentials (the harness's PKI): the admin's certificate on
//! client listeners, the servers' own certificate on peer listeners, so what refuses its calls
//! is each server's checks, not only the authorization layer.
//!
//! Every call it makes must be refused; one answered OK is a violation. The calls come in
//! rounds, each round every kind once (the poison first, the rest in an order drawn from the
//! run's seed), so every run exercises every kind. It never removes a real member and never
//! sends a command that would change the state if a correct server accepted it.

use crate::checker::Verdict;
use crate::cluster::{Cluster, channel, lazy_channel, lazy_peer_channel};
use serde::Serialize;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::internal_client::InternalClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_scheduler::DetRng;
use tonic::Code;

/// Ids the hostile client asks to add (never real members; unreachable addresses).
const ADD_IDS: u64 = 900;
/// Ids the hostile client asks to remove (never added by anyone).
const REMOVE_IDS: u64 = 950;
/// Most additions of an unreachable server per run: each holds the leader's membership
/// changes for up to the request timeout.
const MAX_UNREACHABLE_ADDS: usize = 2;

/// A kind of hostile call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Call {
    /// `Internal.Propose` on a peer port: an unknown kind, a leader-only kind, garbage bytes,
    /// a bad envelope, a batch with a bad member.
    Poison,
    /// `Internal.Propose` on a client port (not served there).
    ProposeOnClientPort,
    /// `Cluster.AddServer` of a server nobody runs (it never catches up).
    AddUnreachable,
    /// `Cluster.AddServer` with an address that is not `host:port`, id 0, or a real member's
    /// id at another address.
    AddBad,
    /// `Cluster.RemoveServer` of an id that was never a member.
    RemoveUnknown,
    /// A Submit or Upsert past `max_request_bytes`.
    Oversized,
    /// Malformed JSON, unknown fields, unbounded names in Submit, Upsert or Register.
    Malformed,
    /// More `Jobs.Watch` streams on one connection than it may hold, held a while, dropped.
    WatchFlood,
}

/// Every kind, the poison first.
const CALLS: &[Call] = &[
    Call::Poison,
    Call::ProposeOnClientPort,
    Call::AddUnreachable,
    Call::AddBad,
    Call::RemoveUnknown,
    Call::Oversized,
    Call::Malformed,
    Call::WatchFlood,
];

/// What the hostile client did and what it saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostileReport {
    /// Calls made.
    pub calls: usize,
    /// Calls refused (any error status, a timeout included).
    pub refused: usize,
    /// Watch streams accepted and refused, over every flood.
    pub watches: (usize, usize),
    /// Ids of added servers whose call did not end in a clean refusal (a leader change in the
    /// middle, a timeout): a learner may be left; the harness removes it as the error tells an
    /// operator to.
    pub unknown_adds: Vec<u64>,
    /// Calls that succeeded where they must be refused.
    pub violations: Vec<String>,
}

/// The servers, as the hostile client reaches them (directly).
#[derive(Debug, Clone)]
pub struct Targets {
    /// Client listeners.
    pub addrs: Vec<String>,
    /// Peer listeners.
    pub peer_addrs: Vec<String>,
}

impl Targets {
    /// The servers of `cluster`.
    pub fn of(cluster: &Cluster) -> Targets {
        Targets {
            addrs: cluster.servers.iter().map(|s| s.addr.clone()).collect(),
            peer_addrs: cluster.servers.iter().map(|s| s.peer_addr.clone()).collect(),
        }
    }
}

/// Starts the hostile client; it runs until `stop` is set and returns what it saw.
pub fn start(targets: Targets, seed: u64, stop: &Arc<AtomicBool>) -> tokio::task::JoinHandle<HostileReport> {
    let stop = stop.clone();
    tokio::spawn(async move {
        let mut h = Hostile { t: targets, rng: DetRng::new(seed ^ 0x4057_11E0), r: HostileReport::default(), adds: 0 };
        'run: while !stop.load(Ordering::Relaxed) {
            let mut round = CALLS.to_vec();
            // The poison first (the most dangerous call, made early in even a short run), then
            // the rest in an order drawn from the seed.
            for i in (2..round.len()).rev() {
                round.swap(i, 1 + h.rng.below(i as u64) as usize);
            }
            for call in round {
                if stop.load(Ordering::Relaxed) {
                    break 'run;
                }
                h.call(call).await;
                tokio::time::sleep(Duration::from_millis(150 + h.rng.below(250))).await;
            }
        }
        h.r
    })
}

struct Hostile {
    t: Targets,
    rng: DetRng,
    r: HostileReport,
    adds: usize,
}

/// The largest request a server decodes (the harness's servers keep the default).
fn max_request_bytes() -> usize {
    suanli_server::ServerConfig::default().max_request_bytes
}

/// The client watch streams one connection may hold (the harness's servers keep the default).
pub fn watchers_per_connection() -> usize {
    suanli_server::ServerConfig::default().max_watchers_per_connection
}

impl Hostile {
    fn pick(&mut self) -> usize {
        self.rng.below(self.t.addrs.len() as u64) as usize
    }

    /// Records a call that must be refused.
    fn refused<T>(&mut self, what: &str, via: usize, r: Result<T, tonic::Status>) -> Option<tonic::Status> {
        self.r.calls += 1;
        match r {
            Ok(_) => {
                self.r.violations.push(format!("{what} via server index {via} was answered OK"));
                None
            }
            Err(s) => {
                self.r.refused += 1;
                Some(s)
            }
        }
    }

    /// Every poison proposal, once each: what no correct server lets into the log.
    fn poisons(&mut self) -> Vec<(&'static str, Vec<u8>)> {
        let n = self.rng.below(1_000);
        let unknown = format!(r#"{{"v":1,"kind":"from_the_future_{n}","ignorable":false,"body":{{"x":{n}}}}}"#);
        let len = self.rng.below(512) as usize;
        let garbage: Vec<u8> = (0..len).map(|_| self.rng.below(256) as u8).collect();
        vec![
            ("an unknown kind", unknown.clone().into_bytes()),
            ("an ignorable unknown kind", unknown.replace("false", "true").into_bytes()),
            ("apply_plan", br#"{"v":1,"kind":"apply_plan","ignorable":false,"body":{"plan":{},"now":1}}"#.to_vec()),
            ("node_down", br#"{"v":1,"kind":"node_down","ignorable":false,"body":{"node":"node-1","now":1}}"#.to_vec()),
            ("skip_entry", br#"{"v":1,"kind":"skip_entry","ignorable":false,"body":{"index":1,"kind":"x"}}"#.to_vec()),
            (
                "a batch holding an unknown kind",
                format!(r#"{{"v":1,"kind":"batch","ignorable":false,"body":{{"commands":[{unknown}]}}}}"#).into_bytes(),
            ),
            (
                "a batch holding a batch",
                br#"{"v":1,"kind":"batch","ignorable":false,"body":{"commands":[{"v":1,"kind":"batch","ignorable":false,"body":{"commands":[]}}]}}"#.to_vec(),
            ),
            ("a truncated envelope", format!(r#"{{"v":{},"kind":"upsert_queue","ignorable":false,"body":{{"#, 2 + n).into_bytes()),
            ("garbage bytes", garbage),
        ]
    }

    async fn call(&mut self, call: Call) {
        let via = self.pick();
        let timeout = Duration::from_millis(5_000);
        match call {
            Call::Poison => {
                // Every poison to every server: the leader is always among them.
                for (what, bytes) in self.poisons() {
                    for i in 0..self.t.peer_addrs.len() {
                        let r = propose(&self.t.peer_addrs[i], true, bytes.clone()).await;
                        self.refused(&format!("Internal.Propose on the peer port of {what}"), i, r);
                    }
                }
            }
            Call::ProposeOnClientPort => {
                let cmd = br#"{"v":1,"kind":"delete_queue","ignorable":false,"body":{"id":"hostile"}}"#;
                let r = propose(&self.t.addrs[via], false, cmd.to_vec()).await;
                self.refused("Internal.Propose on the client port", via, r);
            }
            Call::AddUnreachable => {
                if self.adds >= MAX_UNREACHABLE_ADDS {
                    return;
                }
                let id = ADD_IDS + self.adds as u64;
                self.adds += 1;
                let req = pb::AddServerRequest {
                    id,
                    addr: "127.0.0.1:9".into(),
                    learner_only: self.rng.below(2) == 0,
                    peer_addr: String::new(),
                };
                let r = self.add(via, req).await;
                if let Some(s) = self.refused(&format!("AddServer of unreachable server {id}"), via, r) {
                    let clean = s.code() == Code::Unavailable && s.message().contains("it was removed again");
                    if !clean {
                        tracing::info!(id, code = ?s.code(), message = s.message(), "an addition not cleanly refused");
                        self.r.unknown_adds.push(id);
                    }
                } else {
                    self.r.unknown_adds.push(id);
                }
            }
            Call::AddBad => {
                let (id, addr) = match self.rng.below(5) {
                    0 => (ADD_IDS + 10, "x".repeat(1 << 16)),
                    1 => (ADD_IDS + 11, "no-port".to_owned()),
                    2 => (ADD_IDS + 12, "127.0.0.1:0".to_owned()),
                    3 => (0, "127.0.0.1:9".to_owned()),
                    // A real member's id at another address.
                    _ => (1 + self.rng.below(self.t.addrs.len() as u64), "127.0.0.1:9".to_owned()),
                };
                let shown: String = addr.chars().take(24).collect();
                let req = pb::AddServerRequest { id, addr, learner_only: false, peer_addr: String::new() };
                let r = self.add(via, req).await;
                self.refused(&format!("AddServer of id {id} at {shown:?}"), via, r);
            }
            Call::RemoveUnknown => {
                let id = REMOVE_IDS + self.rng.below(50);
                let r = match lazy_channel(&self.t.addrs[via], timeout) {
                    Ok(ch) => ClusterClient::new(ch).remove_server(pb::RemoveServerRequest { id }).await.map(|_| ()),
                    Err(e) => Err(tonic::Status::unavailable(e.to_string())),
                };
                self.refused(&format!("RemoveServer of unknown server {id}"), via, r);
            }
            Call::Oversized => {
                let pad = "x".repeat(max_request_bytes() + 1024);
                let ch = lazy_channel(&self.t.addrs[via], timeout);
                let r = match (ch, self.rng.below(2)) {
                    (Ok(ch), 0) => {
                        let spec = format!(r#"{{"name":"{pad}","queue":"default","groups":[]}}"#);
                        let req = pb::SubmitJobRequest {
                            global: false,
                            team: String::new(),
                            client_request_id: "hostile-big".into(),
                            spec_json: spec,
                            retry: None,
                        };
                        JobsClient::new(ch).submit(req).await.map(|_| ())
                    }
                    (Ok(ch), _) => {
                        let q = format!(r#"{{"id":"{pad}"}}"#);
                        QueuesClient::new(ch).upsert(pb::UpsertQueueRequest { queue_json: q }).await.map(|_| ())
                    }
                    (Err(e), _) => Err(tonic::Status::unavailable(e.to_string())),
                };
                self.refused("an oversized Submit or Upsert", via, r);
            }
            Call::Malformed => {
                let which = self.rng.below(6);
                let ch = match lazy_channel(&self.t.addrs[via], timeout) {
                    Ok(ch) => ch,
                    Err(e) => {
                        self.refused(
                            "a malformed request",
                            via,
                            Err::<(), _>(tonic::Status::unavailable(e.to_string())),
                        );
                        return;
                    }
                };
                let group = r#"{"name":"main","replicas":1,"resources":{"cpu_milli":100,"memory_mib":64}}"#;
                let submit = |spec: String| {
                    let req = pb::SubmitJobRequest {
                        global: false,
                        team: String::new(),
                        client_request_id: format!("hostile-{which}"),
                        spec_json: spec,
                        retry: None,
                    };
                    let mut c = JobsClient::new(ch.clone());
                    async move { c.submit(req).await.map(|_| ()) }
                };
                let (what, r) = match which {
                    0 => (
                        "a truncated job spec",
                        submit(format!(r#"{{"name":"h","queue":"default","groups":[{group}"#)).await,
                    ),
                    1 => (
                        "a job spec with an unknown field",
                        submit(format!(r#"{{"name":"h","queue":"default","groups":[{group}],"sneaky":true}}"#)).await,
                    ),
                    2 => (
                        "a job name of 64 KiB",
                        submit(format!(r#"{{"name":"{}","queue":"default","groups":[{group}]}}"#, "n".repeat(1 << 16)))
                            .await,
                    ),
                    3 => {
                        let q = r#"{"id":"hostile","nominal":{"cpu_milli":1},"sneaky":1}"#.to_owned();
                        (
                            "a queue with an unknown field",
                            QueuesClient::new(ch).upsert(pb::UpsertQueueRequest { queue_json: q }).await.map(|_| ()),
                        )
                    }
                    4 => {
                        let q = format!(r#"{{"id":"{}","nominal":{{"cpu_milli":1}}}}"#, "q".repeat(4096));
                        (
                            "a queue id of 4 KiB",
                            QueuesClient::new(ch).upsert(pb::UpsertQueueRequest { queue_json: q }).await.map(|_| ()),
                        )
                    }
                    _ => {
                        let node = r#"{"id":"hostile-node","pool":"default","cpu_milli":1000,"memory_mib":1024,"devices":[],"sneaky":1}"#;
                        let req = pb::RegisterNodeRequest {
                            node_json: node.to_owned(),
                            agent_version: "hostile".into(),
                            ..Default::default()
                        };
                        ("a node with an unknown field", AgentClient::new(ch).register(req).await.map(|_| ()))
                    }
                };
                self.refused(what, via, r);
            }
            Call::WatchFlood => self.flood(via).await,
        }
    }

    async fn add(&self, via: usize, req: pb::AddServerRequest) -> Result<(), tonic::Status> {
        match lazy_channel(&self.t.addrs[via], Duration::from_secs(10)) {
            Ok(ch) => ClusterClient::new(ch).add_server(req).await.map(|_| ()),
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        }
    }

    /// Opens more watch streams on one connection than it may hold, holds them, drops them.
    async fn flood(&mut self, via: usize) {
        let limit = watchers_per_connection();
        let Ok(ch) = lazy_channel(&self.t.addrs[via], Duration::from_secs(3)) else { return };
        let mut held = Vec::new();
        let mut refused = 0;
        for _ in 0..limit + 4 {
            match JobsClient::new(ch.clone()).watch(pb::WatchJobsRequest { job_id: 0, from_revision: 0 }).await {
                Ok(s) => held.push(s.into_inner()),
                Err(_) => refused += 1,
            }
        }
        self.r.calls += 1;
        self.r.watches.0 += held.len();
        self.r.watches.1 += refused;
        if held.len() > limit {
            self.r.violations.push(format!(
                "server index {via} accepted {} watch streams on one connection (at most {limit})",
                held.len()
            ));
        } else {
            self.r.refused += 1;
        }
        tokio::time::sleep(Duration::from_millis(500 + self.rng.below(1_000))).await;
        drop(held);
    }
}

/// `Internal.Propose` of `bytes` at `addr`: a peer listener (`peer`) with the servers' own
/// certificate, so the poison meets the server's checks and not only the listener's; a client
/// listener as the admin.
async fn propose(addr: &str, peer: bool, bytes: Vec<u8>) -> Result<(), tonic::Status> {
    let ch =
        if peer { lazy_peer_channel(addr, Duration::from_secs(5)) } else { lazy_channel(addr, Duration::from_secs(5)) };
    match ch {
        Ok(ch) => InternalClient::new(ch)
            .propose(pb::ProposeRequest { group: "region".into(), command_json: bytes.into() })
            .await
            .map(|_| ()),
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    }
}

/// Invariant 8, **stays writable**, after the heal of a run with the hostile client: no
/// hostile call was answered OK where it must be refused, no server exited on its own, the
/// membership is exactly the real servers (all voters), no server reports a halt, a
/// submission through each server commits within `bound`, and every server is still alive.
pub async fn stays_writable(cluster: &mut Cluster, report: &HostileReport, exited: &[u64], bound: Duration) -> Verdict {
    let name = "stays writable";
    let mut bad = Vec::new();
    bad.extend(report.violations.iter().take(5).cloned());
    if !exited.is_empty() {
        bad.push(format!("servers {exited:?} exited on their own during the fault phase"));
    }
    // A learner an interrupted AddServer left behind is removed, as its error tells an
    // operator to; one left behind by a call refused cleanly stays and fails the check.
    for id in &report.unknown_adds {
        if let Ok(l) = cluster.wait_leader(Duration::from_secs(10)).await
            && let Ok(ch) = channel(&cluster.servers[l].addr, Duration::from_secs(10)).await
        {
            let _ = ClusterClient::new(ch).remove_server(pb::RemoveServerRequest { id: *id }).await;
        }
    }
    let real: BTreeSet<(u64, bool)> = cluster.servers.iter().map(|s| (s.id, true)).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    let members = loop {
        let m: BTreeSet<(u64, bool)> = cluster.members().await.unwrap_or_default().into_iter().collect();
        if m == real || Instant::now() > deadline {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    if members != real {
        bad.push(format!("membership is {members:?}, not the real servers {real:?}"));
    }
    for i in 0..cluster.servers.len() {
        let addr = cluster.servers[i].addr.clone();
        match channel(&addr, Duration::from_secs(3)).await {
            Ok(ch) => match ClusterClient::new(ch).version(pb::VersionRequest {}).await {
                Ok(v) => {
                    if let Some(h) = v.into_inner().halt {
                        bad.push(format!("server index {i} halted at entry {} (kind {:?})", h.index, h.kind));
                    }
                }
                Err(e) => bad.push(format!("server index {i}: Version: {:?} {}", e.code(), e.message())),
            },
            Err(e) => bad.push(format!("server index {i}: {e}")),
        }
        if let Err(e) = submit_commits(&addr, &format!("hostile-probe-{i}"), bound).await {
            let e: String = e.chars().take(120).collect();
            bad.push(format!("no write through server index {i} within {} s: {e}", bound.as_secs()));
        }
    }
    for i in 0..cluster.servers.len() {
        if !cluster.server_alive(i) {
            bad.push(format!("server index {i} exited after the heal"));
        }
    }
    let ok = bad.is_empty();
    let detail = if ok {
        format!(
            "{} hostile calls, all refused ({} watch streams held, {} refused); {} interrupted additions cleaned up; \
             membership exact, no halt, a write committed through each of {} servers",
            report.calls,
            report.watches.0,
            report.watches.1,
            report.unknown_adds.len(),
            cluster.servers.len()
        )
    } else {
        format!("{} problems: {}", bad.len(), bad.join("; "))
    };
    Verdict { name, ok, detail }
}

/// Submits a one-task CPU job through `addr`, retrying unknown outcomes (same request id)
/// until `bound`.
async fn submit_commits(addr: &str, request_id: &str, bound: Duration) -> Result<u64, String> {
    let spec = serde_json::json!({
        "name": request_id, "queue": "default", "kind": "batch",
        "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 100, "memory_mib": 64},
                    "task": {"command": "/bin/sh", "args": ["-c", "sleep 0.1"]}}],
    })
    .to_string();
    let deadline = Instant::now() + bound;
    loop {
        let r = match channel(addr, Duration::from_secs(5)).await {
            Ok(ch) => JobsClient::new(ch)
                .submit(pb::SubmitJobRequest {
                    global: false,
                    team: String::new(),
                    client_request_id: request_id.into(),
                    spec_json: spec.clone(),
                    retry: None,
                })
                .await
                .map(|r| r.into_inner().job_id)
                .map_err(|s| (s.code(), s.message().chars().take(200).collect::<String>())),
            Err(e) => Err((Code::Unavailable, e.to_string())),
        };
        match r {
            Ok(id) => return Ok(id),
            Err((code, msg)) => {
                let unknown =
                    matches!(code, Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled);
                if !unknown || Instant::now() > deadline {
                    return Err(format!("{code:?}: {msg}"));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
