//! Talking to the control plane: any server will do. Unary calls move on to the next server on
//! a transport failure, `UNAVAILABLE` (a leader change) or a hung server (no answer within
//! `first_answer_ms` nor to a probe); the allocation watch reconnects to the next server with
//! backoff when its stream fails or does not open within `first_answer_ms`.
//!
//! ```text
//!  liveness: Register ─▶ Heartbeat at once, then every interval (health changes, stats)
//!            known=true ─▶ <data_dir>/lease {boot time before sending, F, G}
//!            known=false / inventory changed / watch says NOT_FOUND ─▶ Register again
//!  watch:    WatchAllocations(node) ─▶ full sets ─▶ task manager   (error ─▶ next server)
//! ```
//!
//! The servers dialed are those of `servers` and the members the cluster names in its
//! register and heartbeat answers (kept in `<data_dir>/servers.json` across restarts), so an
//! agent configured with one server survives that server's removal. A `suanli-leader` hint
//! naming one of them is tried next, unless `follow_leader_hints = false`; a hint naming any
//! other address is never dialed. Leader following, hung-server probes and the backoff are
//! `suanli-client`'s; this module keeps what only an agent does.

use crate::Agent;
use crate::config::AgentConfig;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use suanli_client::CallChannel;
use suanli_client::backoff::{Backoff, Delays};
use suanli_client::{ClientError, Connection, ConnectionConfig, LeaderHints};
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use tonic::Code;

/// The retry delays of the agent's loops (registration, the watch, reports): from
/// `retry_backoff_min_ms` doubling to `retry_backoff_max_ms`, as long as the agent runs.
pub(crate) fn retry_delays(cfg: &AgentConfig) -> Delays {
    Backoff::new(AgentConfig::ms(cfg.retry_backoff_min_ms), AgentConfig::ms(cfg.retry_backoff_max_ms)).delays()
}

/// The agent's connections to the control plane, through `suanli-client`: unary calls and the
/// allocation watch (no deadline, keepalives), both over the configured servers and the
/// members the cluster named (learnt from register and heartbeat answers, kept in
/// `<data_dir>/servers.json`).
pub(crate) struct Servers {
    unary: Connection,
    stream: Connection,
    learned_file: std::path::PathBuf,
}

/// Most member addresses learned from the cluster.
const MAX_LEARNED: usize = 16;
/// The file the learned member addresses are kept in, under the agent's data directory.
pub(crate) const LEARNED_FILE: &str = "servers.json";

/// The kind of a device's health reason: the text before its first `:` (`quarantined`,
/// `recovering`, a plugin's message head), so that a reason whose details change (a counter, a
/// temperature) is not sent again at every heartbeat, while a device that moves from recovery
/// to quarantine is.
fn reason_kind(reason: &str) -> String {
    reason.split(':').next().unwrap_or_default().trim().chars().take(64).collect()
}

/// Whether a failed call may succeed at another server (or later).
fn retriable(c: Code) -> bool {
    matches!(
        c,
        Code::Unavailable
            | Code::Unknown
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Internal
            | Code::Aborted
            | Code::ResourceExhausted
    )
}

impl Servers {
    /// Connections to `cfg.servers`, over `tls` (the node's certificate) unless the agent runs
    /// insecure.
    pub fn new(cfg: &AgentConfig, tls: Option<suanli_security::tls::Tls>) -> anyhow::Result<Servers> {
        let conn = ConnectionConfig {
            connect_timeout: AgentConfig::ms(cfg.connect_timeout_ms),
            request_timeout: Some(AgentConfig::ms(cfg.rpc_timeout_ms)),
            first_answer: AgentConfig::ms(cfg.first_answer_ms),
            probe_timeout: AgentConfig::ms(cfg.first_answer_ms),
            // A hint names a server's own address, which may sit behind a proxy or a load
            // balancer: only a listed one is dialed.
            hints: if cfg.follow_leader_hints { LeaderHints::KnownOnly } else { LeaderHints::Ignore },
            move_on: retriable,
            tls,
            ..ConnectionConfig::default()
        };
        let unary = Connection::new(&cfg.servers, conn).map_err(|e| anyhow::anyhow!("servers: {e}"))?;
        let stream = unary.streaming();
        let s = Servers { unary, stream, learned_file: cfg.data_dir.join(LEARNED_FILE) };
        // Members learned before a restart: a configured server may be gone since.
        match std::fs::read(&s.learned_file) {
            Ok(b) => match serde_json::from_slice::<Vec<String>>(&b) {
                Ok(learned) => {
                    let mut all = learned;
                    all.retain(|a| !s.unary.configured().contains(a));
                    all.sort();
                    all.dedup();
                    all.truncate(MAX_LEARNED);
                    s.set_learned(&all);
                }
                Err(e) => tracing::warn!(file = %s.learned_file.display(), error = %e, "ignoring the learned servers"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(file = %s.learned_file.display(), error = %e, "ignoring the learned servers"),
        }
        Ok(s)
    }

    fn set_learned(&self, learned: &[String]) {
        for bad in self.unary.set_learned(learned) {
            tracing::warn!(addr = %bad, "a learned server address does not parse");
        }
        self.stream.set_learned(learned);
    }

    /// The addresses dialed: the configured ones, then the learned ones.
    #[cfg(test)]
    pub fn addrs(&self) -> Vec<String> {
        self.unary.addrs()
    }

    /// Takes the cluster's current member list: the known servers become the configured ones
    /// plus these (a removed member is dropped unless configured). Kept on disk when it changed.
    pub fn learn(&self, members: &[String]) {
        if members.is_empty() {
            return;
        }
        let mut learned: Vec<String> = members
            .iter()
            .filter(|m| crate::config::check_host_port("members", m).is_ok() && !self.unary.configured().contains(m))
            .take(MAX_LEARNED)
            .cloned()
            .collect();
        learned.sort();
        learned.dedup();
        if self.unary.learned() == learned {
            return;
        }
        tracing::info!(configured = ?self.unary.configured(), learned = ?learned, "servers learned from the cluster");
        self.set_learned(&learned);
        let text = serde_json::to_vec(&learned).unwrap_or_default();
        let tmp = self.learned_file.with_extension("json.tmp");
        if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &self.learned_file)) {
            tracing::warn!(file = %self.learned_file.display(), error = %e, "keeping the learned servers");
        }
    }

    /// Calls `f` at the current server, moving through every server once on retriable errors
    /// and past a hung server (no answer within `first_answer_ms`, nor to a probe).
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, ClientError>
    where
        F: Fn(AgentClient<CallChannel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.unary.call(|ch| f(self.unary.agent(ch))).await
    }

    /// Opens the node's allocation watch at the first server that answers.
    pub async fn watch(
        &self,
        req: pb::WatchAllocationsRequest,
    ) -> Result<tonic::Streaming<pb::AllocationsUpdate>, ClientError> {
        self.stream
            .call(|ch| {
                let mut c = self.stream.agent(ch);
                let req = req.clone();
                async move { c.watch_allocations(req).await }
            })
            .await
    }
}

impl Servers {
    /// Who the servers take a bearer token's holder to be (`Access.WhoAmI` with that token):
    /// how the log service checks a caller that came with a token.
    pub async fn whoami(&self, token: &str) -> Result<pb::WhoAmIResponse, tonic::Status> {
        let value: tonic::metadata::MetadataValue<tonic::metadata::Ascii> = format!("Bearer {token}")
            .parse()
            .map_err(|_| tonic::Status::unauthenticated("authorization: not a valid metadata value"))?;
        self.unary
            .call(|ch| {
                let mut c = suanli_proto::v1::access_client::AccessClient::new(ch);
                let mut req = tonic::Request::new(pb::WhoAmIRequest {});
                req.metadata_mut().insert(suanli_security::token::METADATA_KEY, value.clone());
                async move { c.who_am_i(req).await }
            })
            .await
            .map_err(|e| tonic::Status::new(e.code(), e.to_string()))
    }
}

/// F and G for a TTL, with a warning (once per TTL) when they break the fencing promise.
fn fence_timing(cfg: &AgentConfig, ttl_ms: u64, interval_ms: u64, warned: &mut u64) -> (u64, u64) {
    let (f, g) = crate::lease::timing(cfg.fence_after_ms, cfg.fence_kill_grace_ms, ttl_ms);
    if cfg.fence && *warned != ttl_ms {
        *warned = ttl_ms;
        if let Some(p) = crate::lease::timing_problem(f, g, ttl_ms) {
            tracing::warn!("{p}");
        }
        if f <= interval_ms.saturating_mul(2) {
            tracing::warn!(
                fence_after_ms = f,
                heartbeat_interval_ms = interval_ms,
                "fence_after_ms is at most two heartbeat intervals: one slow heartbeat fences every task of the node"
            );
        }
        if ttl_ms == 0 {
            tracing::warn!("the control plane gave no heartbeat TTL: fencing assumes 10000 ms");
        }
    }
    (f, g)
}

/// Writes the lease after a heartbeat sent at boot time `sent_ms` was acknowledged.
fn renew_lease(agent: &Agent, sent_ms: u64, f: u64, g: u64, failures: &mut u64) {
    let lease = crate::lease::Lease {
        sent_boottime_ms: sent_ms,
        fence_after_ms: f,
        kill_grace_ms: g,
        boot_id: agent.boot_id.clone(),
        check: String::new(),
    };
    if let Some(old) = agent.lease.borrow().as_ref()
        && old.left_ms(sent_ms, &agent.boot_id).is_err()
        && agent.cfg.fence
    {
        tracing::warn!(
            lapsed_ms = sent_ms.saturating_sub(old.term_at_ms()),
            "the lease had expired: tasks that ran under it were fenced by their shims"
        );
    }
    match lease.write(&agent.cfg.data_dir.join(crate::lease::LEASE_FILE)) {
        Ok(()) => {
            *failures = 0;
            agent.lease.send_replace(Some(lease));
        }
        Err(e) => {
            *failures += 1;
            if *failures == 1 || failures.is_power_of_two() {
                tracing::error!(error = %e, failures = *failures, "writing the lease; tasks will be fenced if this goes on");
            }
        }
    }
}

/// Sleeps `d` unless the agent stops first; false when it stopped.
pub(crate) async fn pause(agent: &Agent, d: Duration) -> bool {
    let mut stop = agent.stop.clone();
    if *stop.borrow() {
        return false;
    }
    tokio::select! {
        () = tokio::time::sleep(d) => true,
        _ = stop.changed() => false,
    }
}

/// Registration and heartbeats, forever (until the agent stops).
pub(crate) async fn liveness(agent: Arc<Agent>) {
    let cfg = &agent.cfg;
    let mut backoff = retry_delays(cfg);
    let mut failures = 0u64;
    let mut lease_failures = 0u64;
    let mut warned_ttl = u64::MAX;
    'register: loop {
        if *agent.stop.borrow() {
            return;
        }
        agent.plugins.inventory_changed.store(false, Ordering::SeqCst);
        let node = agent.node();
        let json = match serde_json::to_string(&node) {
            Ok(j) => j,
            Err(e) => {
                tracing::error!(error = %e, "encoding the node");
                return;
            }
        };
        // The fence travels with the registration: the leader's liveness waits it out
        // (docs/control-plane.md, "Clocks").
        let req = pb::RegisterNodeRequest {
            node_json: json,
            agent_version: env!("CARGO_PKG_VERSION").into(),
            fence_after_ms: agent.cfg.fence_after_ms,
            fence_kill_grace_ms: agent.cfg.fence_kill_grace_ms,
            fence_reported: agent.cfg.fence,
        };
        let resp = agent.servers.call(|mut c| {
            let req = req.clone();
            async move { c.register(req).await }
        });
        let resp = match resp.await {
            Ok(r) => r,
            Err(s) => {
                failures += 1;
                if failures == 1 || failures.is_power_of_two() {
                    tracing::warn!(code = ?s.code(), error = %s.message(), failures, "registering the node failed; retrying");
                }
                if !pause(&agent, backoff.next_or_max()).await {
                    return;
                }
                continue;
            }
        };
        failures = 0;
        backoff.reset();
        agent.servers.learn(&resp.members);
        let interval = Duration::from_millis(resp.heartbeat_interval_ms.clamp(10, 600_000));
        let mut ttl_ms = resp.heartbeat_ttl_ms;
        agent.plugins.stats_every_ms.store(resp.heartbeat_interval_ms.clamp(10, 600_000), Ordering::Relaxed);
        // What the control plane was told of each device: healthy, and for an unhealthy one the
        // kind of its reason (registration carries no reason, so the first heartbeat says it).
        let mut reported: BTreeMap<String, (bool, String)> = node
            .devices
            .iter()
            .map(|d| (d.id.clone(), (d.health == suanli_model::Health::Healthy, String::new())))
            .collect();
        let unhealthy = reported.values().filter(|(h, _)| !*h).count();
        tracing::info!(node = %node.id, pool = %node.pool, devices = node.devices.len(), unhealthy,
            cpu_milli = node.cpu_milli, memory_mib = node.memory_mib, agent_addr = %node.agent_addr, "node registered");
        agent.registered.send_modify(|g| *g += 1);
        let mut seq = 0u64;
        let mut hb_failures = 0u64;
        // The first heartbeat goes at once: the lease is renewed by heartbeats only (a
        // registration answered by a follower does not reset the leader's TTL clock).
        let mut wait = Duration::ZERO;
        loop {
            let mut stop = agent.stop.clone();
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = agent.plugins.changed.notified() => {}
                () = agent.reregister.notified() => continue 'register,
                _ = stop.changed() => return,
            }
            if agent.plugins.inventory_changed.load(Ordering::SeqCst) {
                tracing::info!("device inventory changed: registering again");
                continue 'register;
            }
            let devices = agent.plugins.devices();
            let changes: Vec<pb::DeviceHealthReport> = devices
                .iter()
                .filter(|d| {
                    let healthy = d.device.health == suanli_model::Health::Healthy;
                    reported
                        .get(&d.device.id)
                        .is_some_and(|(h, kind)| *h != healthy || (!healthy && *kind != reason_kind(&d.reason)))
                })
                .map(|d| pb::DeviceHealthReport {
                    device: d.device.id.clone(),
                    healthy: d.device.health == suanli_model::Health::Healthy,
                    reason: d.reason.clone(),
                })
                .collect();
            wait = interval;
            seq += 1;
            let req = pb::HeartbeatRequest {
                node_id: agent.node_id.clone(),
                seq,
                devices: changes.clone(),
                stats: agent.plugins.stats(),
                disk_pressure: agent.disk_pressure.borrow().clone(),
            };
            // Taken before sending: the leader's TTL clock starts when it sees the heartbeat,
            // which is no earlier.
            let sent_ms = crate::sys::boottime_ms();
            let r = agent.servers.call(|mut c| {
                let req = req.clone();
                async move { c.heartbeat(req).await }
            });
            let r = r.await;
            if let Ok(r) = &r {
                agent.servers.learn(&r.members);
            }
            match r {
                Ok(r) if !r.known => {
                    tracing::warn!(
                        "the control plane does not know this node (or declared it down): registering again"
                    );
                    continue 'register;
                }
                Ok(r) => {
                    hb_failures = 0;
                    if r.heartbeat_ttl_ms > 0 {
                        ttl_ms = r.heartbeat_ttl_ms;
                    }
                    let interval_ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
                    let (f, g) = fence_timing(&agent.cfg, ttl_ms, interval_ms, &mut warned_ttl);
                    renew_lease(&agent, sent_ms, f, g, &mut lease_failures);
                    // Federation lease renewals: each federated task's `fed-lease` moves later.
                    for l in &r.leases {
                        crate::tasks::renew_fed(&agent, l.alloc_id, l.until_ms);
                    }
                    // Operators' quarantine clears (`suanli node clear-quarantine`).
                    agent.plugins.apply_clears(&r.quarantine_clears);
                    for c in changes {
                        if c.healthy {
                            tracing::info!(device = %c.device, "device reported healthy");
                        } else {
                            tracing::warn!(device = %c.device, reason = %c.reason, "device reported unhealthy");
                        }
                        let kind = if c.healthy { String::new() } else { reason_kind(&c.reason) };
                        reported.insert(c.device, (c.healthy, kind));
                    }
                }
                Err(s) if s.code() == Code::NotFound => {
                    tracing::warn!(error = %s.message(), "heartbeat refused: registering again");
                    continue 'register;
                }
                Err(s) => {
                    hb_failures += 1;
                    if hb_failures == 1 || hb_failures.is_power_of_two() {
                        tracing::warn!(code = ?s.code(), error = %s.message(), failures = hb_failures, "heartbeat failed");
                    }
                }
            }
        }
    }
}

/// The allocation watch, forever: each full set goes to the task manager.
pub(crate) async fn watch(agent: Arc<Agent>, tx: tokio::sync::watch::Sender<Option<pb::AllocationsUpdate>>) {
    let cfg = &agent.cfg;
    let mut backoff = retry_delays(cfg);
    let mut registered = agent.registered.subscribe();
    let mut stop = agent.stop.clone();
    // Nothing to watch before the node is registered.
    loop {
        if *registered.borrow_and_update() > 0 {
            break;
        }
        tokio::select! {
            r = registered.changed() => if r.is_err() { return },
            _ = stop.changed() => return,
        }
    }
    let mut failures = 0u64;
    loop {
        if *agent.stop.borrow() {
            return;
        }
        let req = pb::WatchAllocationsRequest { node_id: agent.node_id.clone(), from_revision: 0 };
        // A server answers the opening at once (the updates come later): one that does not
        // within `first_answer_ms`, nor answers a probe, is hung, and the next is tried.
        let opened = agent.servers.watch(req).await;
        let server = agent.servers.stream.current_addr().unwrap_or_default();
        match opened {
            Ok(mut s) => {
                let mut got = false;
                loop {
                    tokio::select! {
                        m = s.message() => match m {
                            Ok(Some(u)) => {
                                if !got {
                                    got = true;
                                    failures = 0;
                                    backoff.reset();
                                    tracing::info!(server = %server, revision = u.revision, allocs = u.allocs.len(), "watching allocations");
                                }
                                tx.send_replace(Some(u));
                            }
                            Ok(None) => {
                                tracing::warn!(server = %server, "allocation watch ended; reconnecting");
                                break;
                            }
                            Err(e) => {
                                tracing::warn!(server = %server, code = ?e.code(), error = %e.message(), "allocation watch failed; reconnecting");
                                break;
                            }
                        },
                        _ = stop.changed() => return,
                    }
                }
                agent.servers.stream.advance();
            }
            Err(s) if s.code() == Code::NotFound => {
                tracing::warn!(error = %s.message(), "the server does not know this node: registering again");
                let before = *registered.borrow_and_update();
                agent.reregister.notify_one();
                let _ = tokio::time::timeout(AgentConfig::ms(cfg.rpc_timeout_ms), async {
                    while *registered.borrow() == before {
                        if registered.changed().await.is_err() {
                            return;
                        }
                    }
                })
                .await;
            }
            Err(s) => {
                failures += 1;
                if failures == 1 || failures.is_power_of_two() {
                    tracing::warn!(code = ?s.code(), error = %s.message(), "cannot open the allocation watch");
                }
            }
        }
        if !pause(&agent, backoff.next_or_max()).await {
            return;
        }
    }
}

/// One status report, retried until a server acknowledges it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Report {
    pub alloc: u64,
    pub epoch: u64,
    pub status: pb::AllocReport,
    pub message: String,
    pub exit_code: i32,
    /// How it ended (an `EndClass` name: succeeded, exit, oom, start_failed, device_error,
    /// node_lost, stopped); empty for RUNNING.
    pub end: &'static str,
    /// `exit_code` is the task's own (it exited by itself).
    pub exit_code_set: bool,
}

impl Report {
    /// A RUNNING report.
    pub fn running(alloc: u64, epoch: u64, message: String) -> Report {
        Report { alloc, epoch, status: pb::AllocReport::Running, message, exit_code: 0, end: "", exit_code_set: false }
    }

    pub fn is_final(&self) -> bool {
        self.status != pb::AllocReport::Running
    }
}

/// Pending reports: at most one per allocation (a final report replaces RUNNING, never the
/// other way round), so the queue is bounded by the allocations the node has.
#[derive(Default)]
pub(crate) struct Reporter {
    pending: std::sync::Mutex<BTreeMap<(u64, u64), (u64, Report)>>,
    version: std::sync::atomic::AtomicU64,
    notify: tokio::sync::Notify,
    /// While set (the node switches to another cluster), nothing is queued or sent: reports
    /// of the old cluster's allocations must never reach the new one, whose ids may repeat.
    held: std::sync::atomic::AtomicBool,
}

impl Reporter {
    /// Drops every pending report, and (`on`) every report until released (`hold(false)`).
    pub fn hold(&self, on: bool) {
        self.held.store(on, Ordering::SeqCst);
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
    }

    pub fn enqueue(&self, r: Report) {
        if self.held.load(Ordering::SeqCst) {
            return;
        }
        crate::telemetry::reported(r.alloc, r.epoch, r.status, r.end, &r.message);
        let v = self.version.fetch_add(1, Ordering::Relaxed);
        let mut p = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (r.alloc, r.epoch);
        if let Some((_, old)) = p.get(&key)
            && old.is_final()
            && !r.is_final()
        {
            return;
        }
        p.insert(key, (v, r));
        drop(p);
        self.notify.notify_one();
    }

    pub fn len(&self) -> usize {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    fn batch(&self, n: usize) -> Vec<(u64, Report)> {
        if self.held.load(Ordering::SeqCst) {
            return Vec::new();
        }
        let p = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        p.values().take(n).cloned().collect()
    }

    fn done(&self, key: (u64, u64), version: u64) {
        let mut p = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if p.get(&key).is_some_and(|(v, _)| *v == version) {
            p.remove(&key);
        }
    }
}

/// Sends pending reports, forever; a final one acknowledged (or refused for good) leaves a
/// `reported` marker in its allocation directory so a restarted agent does not send it again.
pub(crate) async fn report_loop(agent: Arc<Agent>) {
    let cfg = &agent.cfg;
    let mut backoff = retry_delays(cfg);
    let mut stop = agent.stop.clone();
    loop {
        let batch = agent.reporter.batch(cfg.report_concurrency);
        if batch.is_empty() {
            tokio::select! {
                () = agent.reporter.notify.notified() => continue,
                _ = stop.changed() => return,
            }
        }
        let mut set = tokio::task::JoinSet::new();
        for (v, r) in batch {
            let a = agent.clone();
            set.spawn(async move {
                let req = pb::ReportStatusRequest {
                    alloc_id: r.alloc,
                    epoch: r.epoch,
                    status: r.status as i32,
                    message: r.message.clone(),
                    exit_code: r.exit_code,
                    end: r.end.to_owned(),
                    exit_code_set: r.exit_code_set,
                    ..Default::default()
                };
                let res = a
                    .servers
                    .call(|mut c| {
                        let req = req.clone();
                        async move { c.report_status(req).await }
                    })
                    .await;
                (v, r, res)
            });
        }
        let mut failed = false;
        while let Some(j) = set.join_next().await {
            let Ok((v, r, res)) = j else {
                continue;
            };
            let key = (r.alloc, r.epoch);
            match res {
                Ok(_) => {
                    tracing::debug!(alloc = r.alloc, epoch = r.epoch, status = ?r.status, "reported");
                    if r.is_final() {
                        crate::tasks::mark_reported(&agent, key, &r);
                    }
                    agent.reporter.done(key, v);
                }
                Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::NotFound | Code::InvalidArgument) => {
                    tracing::info!(alloc = r.alloc, epoch = r.epoch, status = ?r.status, code = ?s.code(), error = %s.message(),
                        "report refused by the control plane (stale or unknown allocation); dropped");
                    if r.is_final() {
                        crate::tasks::mark_reported(&agent, key, &r);
                    }
                    agent.reporter.done(key, v);
                }
                Err(s) => {
                    failed = true;
                    tracing::debug!(alloc = r.alloc, code = ?s.code(), error = %s.message(), "report failed; will retry");
                }
            }
        }
        if failed {
            if !pause(&agent, backoff.next_or_max()).await {
                return;
            }
        } else {
            backoff.reset();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn learned_members_are_dialed_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = AgentConfig {
            servers: vec!["127.0.0.1:7400".into()],
            data_dir: dir.path().to_owned(),
            ..AgentConfig::default()
        };
        let s = Servers::new(&cfg, None).unwrap();
        assert_eq!(s.addrs(), ["127.0.0.1:7400"]);
        // A member list naming the configured server, two others, and garbage.
        s.learn(&["127.0.0.1:7402".into(), "127.0.0.1:7400".into(), "127.0.0.1:7401".into(), "no port".into()]);
        assert_eq!(s.addrs(), ["127.0.0.1:7400", "127.0.0.1:7401", "127.0.0.1:7402"]);
        // Kept across a restart.
        let again = Servers::new(&cfg, None).unwrap();
        assert_eq!(again.addrs(), s.addrs());
        // A member removed from the cluster is dropped; the configured one never is.
        s.learn(&["127.0.0.1:7401".into()]);
        assert_eq!(s.addrs(), ["127.0.0.1:7400", "127.0.0.1:7401"]);
        assert_eq!(Servers::new(&cfg, None).unwrap().addrs(), ["127.0.0.1:7400", "127.0.0.1:7401"]);
    }

    fn rep(status: pb::AllocReport) -> Report {
        Report { status, ..Report::running(1, 1, String::new()) }
    }

    #[test]
    fn a_final_report_is_never_replaced_by_running() {
        let r = Reporter::default();
        r.enqueue(rep(pb::AllocReport::Running));
        r.enqueue(rep(pb::AllocReport::Succeeded));
        r.enqueue(rep(pb::AllocReport::Running));
        let b = r.batch(10);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].1.status, pb::AllocReport::Succeeded);
    }

    #[test]
    fn retry_delays_double_to_the_configured_max() {
        let cfg = AgentConfig { retry_backoff_min_ms: 100, retry_backoff_max_ms: 300, ..AgentConfig::default() };
        let mut b = retry_delays(&cfg);
        assert_eq!(b.next_or_max(), Duration::from_millis(100));
        assert_eq!(b.next_or_max(), Duration::from_millis(200));
        assert_eq!(b.next_or_max(), Duration::from_millis(300));
        b.reset();
        assert_eq!(b.next_or_max(), Duration::from_millis(100));
    }
}
