//! What every service shares: the raft node, the applied state, and the two paths through
//! them — writes (propose here when leader, else forward to the leader) and reads (local when
//! stale, else after a read index confirmed by the leader).
//!
//! ```text
//!  service ──propose(cmd)──▶ leader? ── yes ─▶ suanli_raft::write ──▶ committed + applied here
//!                               └─ no ──▶ Internal.Propose on the leader (one hop, never more)
//!  service ──read(stale=false)──▶ read index (leader: ensure_linearizable; follower: ask the
//!                                 leader) ──▶ wait until applied here ──▶ read local state
//! ```

use crate::config::ServerConfig;
use crate::status::{rejection, unavailable};
use crate::watchers::WatchSlots;
use openraft::ServerState;
use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use suanli_model::NodeId;
use suanli_proto::v1::internal_client::InternalClient;
use suanli_proto::v1::{ProposeRequest, ReadIndexRequest};
use suanli_raft::ServerNode;
use suanli_raft::{LogCommand, StateHandle, SuanliRaft, WriteError};
use suanli_state::{Command, Response, State};
use tokio::sync::Notify;
use tokio::time::Instant;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

/// Metadata key that names the leader's address on UNAVAILABLE answers (shared with clients).
pub use suanli_proto::LEADER_HEADER;

/// The peer's address of a request: from the TLS connection's [`suanli_security::tls::PeerInfo`],
/// or from the plaintext TCP connection (`--insecure`); `None` when the transport reports none.
pub fn remote_of<T>(req: &tonic::Request<T>) -> Option<std::net::SocketAddr> {
    match req.extensions().get::<suanli_security::tls::PeerInfo>() {
        Some(p) => p.remote,
        None => req.remote_addr(),
    }
}

/// The shared core of one server.
pub struct Core {
    /// This server's raft id.
    pub id: u64,
    /// Its configuration.
    pub cfg: ServerConfig,
    /// The raft node.
    pub raft: SuanliRaft,
    /// The applied state.
    pub state: StateHandle,
    /// Wakes the scheduling loop (a submission, a freed allocation, a new node).
    pub kick: Notify,
    /// Last heartbeat per node; meaningful on the leader only (never replicated).
    pub heartbeats: Mutex<HashMap<NodeId, Instant>>,
    /// The default's tie rule as the scheduling loop last rehearsed it; leader memory only.
    pub tie_rule: Mutex<Option<suanli_scheduler::rehearsal::Rehearsal>>,
    /// Latest device statistics per node from heartbeats; leader memory only, like `heartbeats`.
    pub device_stats: Mutex<HashMap<NodeId, Vec<suanli_proto::v1::DeviceStats>>>,
    /// Bounds open watch streams: agents' and clients' pools, clients per connection.
    pub watchers: WatchSlots,
    channels: Mutex<HashMap<String, Channel>>,
    /// A read-only handle on the raft log (consistency checks: `Internal.Inspect`).
    pub log: suanli_raft::LogStore<suanli_raft::TypeConfig>,
    /// When a quorum last confirmed this server's leadership (taken before the round).
    confirmed: tokio::sync::Mutex<Option<Instant>>,
    /// One `Cluster.Backup` at a time (each holds the whole state in memory while it streams).
    pub backups: std::sync::Arc<tokio::sync::Semaphore>,
    /// The leader's clock check and the bound on the time it stamps (leader memory).
    pub clock: crate::clock::ClockGuard,
    /// One `Cluster.SetConfig` at a time: each merges into the configuration it read.
    pub config_writes: tokio::sync::Mutex<()>,
    /// The TLS material every link uses (`None`: the server runs `--insecure`): the listeners
    /// serve it, and every call to another server presents its certificate.
    tls: Option<suanli_security::tls::Tls>,
}

impl Core {
    /// A core over an opened raft node; `tls` is what calls to other servers present (`None`:
    /// plaintext, an `--insecure` server).
    pub fn new(
        cfg: ServerConfig,
        raft: SuanliRaft,
        state: StateHandle,
        log: suanli_raft::LogStore<suanli_raft::TypeConfig>,
        tls: Option<suanli_security::tls::Tls>,
    ) -> Self {
        let clock = crate::clock::ClockGuard::new(&cfg);
        Self {
            clock,
            id: cfg.id,
            watchers: WatchSlots::new(cfg.watch_limits()),
            cfg,
            raft,
            state,
            kick: Notify::new(),
            heartbeats: Mutex::new(HashMap::new()),
            device_stats: Mutex::new(HashMap::new()),
            tie_rule: Mutex::new(None),
            channels: Mutex::new(HashMap::new()),
            log,
            confirmed: tokio::sync::Mutex::new(None),
            backups: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
            config_writes: tokio::sync::Mutex::new(()),
            tls,
        }
    }

    /// The TLS material of this server's links (`None`: `--insecure`).
    pub fn tls(&self) -> Option<&suanli_security::tls::Tls> {
        self.tls.as_ref()
    }

    /// The latest device statistics of `node` this server holds (leader only).
    pub fn stats_of(&self, node: &NodeId) -> Vec<suanli_proto::v1::DeviceStats> {
        let m = self.device_stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        m.get(node).cloned().unwrap_or_default()
    }

    /// Cluster time to stamp on a command now (seconds): on the leader, its clock bounded by
    /// the state's time, the elapsed time of its leadership and its followers' clocks
    /// (docs/control-plane.md, "Clocks"); elsewhere this server's clock, which the leader
    /// replaces when the command reaches it.
    pub fn now_s(&self) -> u64 {
        let floor_ms = self.state.read(State::clock).saturating_mul(1000);
        let (term, solo) = {
            let m = self.raft.metrics();
            let m = m.borrow();
            let leading = (m.state == ServerState::Leader).then_some(m.current_term);
            (leading, m.membership_config.membership().voter_ids().all(|v| v == self.id))
        };
        self.clock.now_ms(term, floor_ms, solo) / 1000
    }

    /// The configured request timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.request_timeout_ms)
    }

    /// Whether this server leads right now (its own view).
    pub fn is_leader(&self) -> bool {
        self.raft.metrics().borrow().state == ServerState::Leader
    }

    /// The current leader's id and client address (what clients are pointed to), when known.
    pub fn leader(&self) -> Option<(u64, String)> {
        self.leader_node().map(|(id, n)| (id, n.client_addr().to_owned()))
    }

    /// The client addresses of the current members (voters and learners), sorted by id: what
    /// agents learn the cluster from.
    pub fn member_addrs(&self) -> Vec<String> {
        let m = self.raft.metrics();
        let m = m.borrow();
        m.membership_config.membership().nodes().map(|(_, n)| n.client_addr().to_owned()).collect()
    }

    /// The current leader's id and membership record (its peer address is `addr`).
    pub fn leader_node(&self) -> Option<(u64, ServerNode)> {
        let m = self.raft.metrics();
        let m = m.borrow();
        let id = m.current_leader?;
        let node = m.membership_config.membership().get_node(&id).cloned()?;
        Some((id, node))
    }

    /// The halt, when this server stopped applying its log at an entry it cannot apply: the
    /// group is read-only here (writes refused, reads served from the state before it).
    pub fn halted(&self) -> Option<suanli_raft::Halt> {
        self.state.halt()
    }

    /// FAILED_PRECONDITION for a write while halted, naming the entry and the way out.
    pub fn refuse_if_halted(&self) -> Result<(), Status> {
        match self.halted() {
            None => Ok(()),
            Some(h) => Err(Status::failed_precondition(format!(
                "read-only: this server halted at log entry {} (kind {:?}): {}; restart it with a build that can apply the entry, or skip it (`suanli cluster skip-entry --index {} --kind {:?}`, docs/operations.md)",
                h.index, h.kind, h.reason, h.index, h.kind
            ))),
        }
    }

    /// A (cached, lazily connected) channel to another server: over TLS with this server's
    /// certificate unless it runs `--insecure` (each new connection uses the material current
    /// then, so a reloaded certificate reaches cached channels when they reconnect).
    pub fn channel(&self, addr: &str) -> Result<Channel, Status> {
        let addr = self.cfg.raft.dial_addr(addr);
        let mut map = self.channels.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let uri = if addr.contains("://") { addr.to_owned() } else { format!("http://{addr}") };
        let ep = Endpoint::from_shared(uri)
            .map_err(|e| Status::internal(format!("leader address {addr:?}: {e}")))?
            .connect_timeout(self.cfg.raft.connect_timeout())
            .tcp_nodelay(true);
        let c = suanli_security::tls::channel(ep, self.tls.as_ref());
        map.insert(addr.to_owned(), c.clone());
        Ok(c)
    }

    /// A channel to the leader's client listener, or UNAVAILABLE when none is known or this
    /// server is it.
    pub fn leader_channel(&self) -> Result<(Channel, String), Status> {
        match self.leader() {
            Some((id, addr)) if id != self.id => Ok((self.channel(&addr)?, addr)),
            Some(_) => Err(unavailable("this server is the leader", None)),
            None => Err(unavailable("no leader is elected yet; retry shortly", None)),
        }
    }

    /// Waits (up to the request timeout) until some server is known to lead.
    async fn wait_for_leader(&self) -> Result<(), Status> {
        let mut rx = self.raft.metrics();
        let r = tokio::time::timeout(self.timeout(), rx.wait_for(|m| m.current_leader.is_some())).await;
        match r {
            Ok(Ok(_)) => Ok(()),
            _ => Err(unavailable("no leader was elected within the request timeout", None)),
        }
    }

    /// Commits `cmd` (forwarding it to the leader if needed) and returns the state machine's
    /// answer and the log index. A refused command becomes a gRPC status naming the field.
    pub async fn propose(&self, cmd: Command) -> Result<(Response, u64), Status> {
        let (resp, index) = self.propose_raw(cmd).await?;
        if let Some(e) = resp.rejection() {
            return Err(rejection(e));
        }
        Ok((resp, index))
    }

    /// Like [`Core::propose`] but returns a refusal as a [`Response::Rejected`].
    pub async fn propose_raw(&self, mut cmd: Command) -> Result<(Response, u64), Status> {
        cmd.stamp(self.now_s());
        // Encoded once: the log, the transport and a retry all share these bytes.
        let cmd = suanli_raft::encode(&cmd).map_err(|e| rejection(&e))?;
        self.propose_encoded(cmd).await
    }

    /// Like [`Core::propose_raw`] for a command already encoded (the batcher sizes its batches
    /// by the encoding).
    pub async fn propose_encoded(&self, cmd: LogCommand) -> Result<(Response, u64), Status> {
        self.refuse_if_halted()?;
        for _ in 0..3 {
            let r =
                tokio::time::timeout(self.timeout(), suanli_raft::write_encoded(&self.raft, &self.state, cmd.clone()))
                    .await;
            let r = match r {
                Err(_) => return Err(Status::deadline_exceeded("the write did not commit within the request timeout")),
                Ok(r) => r,
            };
            match r {
                Ok(ok) => return halted_answer(ok),
                Err(WriteError::Refused(e)) => return Err(rejection(&e)),
                Err(WriteError::Raft(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                    match f.leader_node {
                        Some(node) => return self.forward(&node, &cmd).await,
                        None => self.wait_for_leader().await?,
                    }
                }
                Err(WriteError::Raft(RaftError::APIError(e))) => {
                    return Err(Status::failed_precondition(e.to_string()));
                }
                Err(WriteError::Raft(RaftError::Fatal(e))) => {
                    return Err(Status::unavailable(format!("this server's raft stopped: {e}")));
                }
            }
        }
        Err(unavailable("leadership kept changing; retry", self.leader().map(|l| l.1)))
    }

    /// Sends a write to the leader's peer listener (`Internal.Propose`).
    async fn forward(&self, leader: &ServerNode, cmd: &LogCommand) -> Result<(Response, u64), Status> {
        let hint = leader.client_addr();
        let mut client = InternalClient::new(self.channel(&leader.addr)?)
            .max_decoding_message_size(self.cfg.max_request_bytes)
            .max_encoding_message_size(self.cfg.max_request_bytes.saturating_mul(2));
        let mut req = tonic::Request::new(ProposeRequest {
            group: self.cfg.raft.group.clone(),
            command_json: cmd.bytes().clone(),
        });
        req.set_timeout(self.timeout());
        let r = client.propose(req).await.map_err(|s| forwarded_error(s, hint))?.into_inner();
        let resp: Response =
            serde_json::from_slice(&r.response_json).map_err(|e| Status::internal(format!("leader's answer: {e}")))?;
        // Let a read on this server that follows see its own write.
        let _ = tokio::time::timeout(self.timeout(), self.state.wait_applied(r.index)).await;
        halted_answer((resp, r.index))
    }

    /// The replicated limit on one command's encoded size (`max_command_bytes`).
    pub fn max_command_bytes(&self) -> usize {
        self.state.read(|s| s.config().max_command_bytes)
    }

    /// Proposes on this server only (the `Internal.Propose` handler): never forwards again.
    /// `SkipEntry` is the one command proposed while halted.
    /// Every time the command carries is stamped here, by the leader (a follower's stamp is
    /// replaced).
    pub async fn propose_local(&self, mut cmd: Command) -> Result<(Response, u64), Status> {
        if !matches!(cmd, Command::SkipEntry(_)) {
            self.refuse_if_halted()?;
        }
        cmd.stamp(self.now_s());
        let r = tokio::time::timeout(self.timeout(), suanli_raft::write(&self.raft, &self.state, cmd)).await;
        match r {
            Err(_) => Err(Status::deadline_exceeded("the write did not commit within the request timeout")),
            Ok(Ok(ok)) => Ok(ok),
            Ok(Err(WriteError::Refused(e))) => Ok((Response::Rejected(e), 0)),
            Ok(Err(WriteError::Raft(RaftError::APIError(ClientWriteError::ForwardToLeader(f))))) => {
                Err(unavailable("not the leader", f.leader_node.map(|n| n.client_addr().to_owned())))
            }
            Ok(Err(e)) => Err(Status::unavailable(e.to_string())),
        }
    }

    /// The log index a linearizable read must see (leader only; the `Internal.ReadIndex`
    /// handler and local reads on the leader).
    pub async fn local_read_index(&self) -> Result<u64, Status> {
        let r = tokio::time::timeout(self.timeout(), self.raft.ensure_linearizable()).await;
        match r {
            Err(_) => Err(Status::deadline_exceeded("the leader could not confirm its lease in time")),
            Ok(Ok(l)) => Ok(l.map(|l| l.index).unwrap_or(0)),
            Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => {
                Err(unavailable("not the leader", f.leader_node.map(|n| n.client_addr().to_owned())))
            }
            Ok(Err(e)) => Err(Status::unavailable(e.to_string())),
        }
    }

    /// Confirms with a quorum that this server still leads, at most `max_age` ago. Heartbeat
    /// answers use it: an agent's lease (docs/agent.md) must only be renewed by a leader whose
    /// term a quorum still follows, never by a deposed leader cut off from the others, whose
    /// own view (`is_leader`) would say yes until it hears of the new term. Concurrent callers
    /// share one confirmation round.
    pub async fn confirm_leader(&self, max_age: Duration) -> Result<(), Status> {
        let mut last = self.confirmed.lock().await;
        if let Some(t) = *last
            && t.elapsed() < max_age
            && self.is_leader()
        {
            return Ok(());
        }
        let start = Instant::now();
        self.local_read_index().await?;
        *last = Some(start);
        Ok(())
    }

    /// The read index, from this server when it leads or from the leader otherwise. Retries
    /// (until the request timeout) while leadership is unsettled or the leader cannot yet
    /// confirm its lease with a quorum.
    async fn read_index(&self) -> Result<u64, Status> {
        let deadline = Instant::now() + self.timeout();
        loop {
            let r = match self.leader_node() {
                Some((id, _)) if id == self.id => self.local_read_index().await,
                Some((_, node)) => {
                    let mut client = InternalClient::new(self.channel(&node.addr)?);
                    let mut req = tonic::Request::new(ReadIndexRequest { group: self.cfg.raft.group.clone() });
                    req.set_timeout(self.timeout());
                    client
                        .read_index(req)
                        .await
                        .map(|r| r.into_inner().index)
                        .map_err(|s| forwarded_error(s, node.client_addr()))
                }
                None => self.wait_for_leader().await.map(|()| u64::MAX),
            };
            match r {
                Ok(u64::MAX) => continue,
                Ok(i) => return Ok(i),
                Err(s) if s.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(s) => return Err(s),
            }
        }
    }

    /// Runs `f` on the state: linearizable unless `stale` (then this server's local state).
    /// While halted, reads are served from the state before the halted entry (nothing after
    /// it is applied anywhere this build runs), without a read index that could never apply.
    pub async fn read<R>(&self, stale: bool, f: impl FnOnce(&State) -> R) -> Result<R, Status> {
        if !stale && self.halted().is_none() {
            let index = self.read_index().await?;
            tokio::time::timeout(self.timeout(), self.state.wait_applied(index))
                .await
                .map_err(|_| Status::deadline_exceeded("this server did not catch up with the leader in time"))?;
        }
        Ok(self.state.read(f))
    }
}

/// A write answered `Halted` (committed, but this group applies nothing until the halt is
/// resolved) becomes FAILED_PRECONDITION naming the entry.
fn halted_answer((resp, index): (Response, u64)) -> Result<(Response, u64), Status> {
    match halted_in(&resp) {
        Some((at, kind, reason)) => Err(Status::failed_precondition(format!(
            "read-only: the group halted at log entry {at} (kind {kind:?}): {reason}; see `suanli cluster version`"
        ))),
        None => Ok((resp, index)),
    }
}

fn halted_in(r: &Response) -> Option<(u64, &str, &str)> {
    match r {
        Response::Halted { index, kind, reason } => Some((*index, kind, reason)),
        Response::Batch(rs) => rs.iter().find_map(halted_in),
        _ => None,
    }
}

/// A failure of a call to another server, as answered to our caller (`addr`: the leader's
/// client address, the hint a client may follow).
fn forwarded_error(s: Status, addr: &str) -> Status {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            unavailable(&format!("forwarding to the leader ({addr}): {}", s.message()), Some(addr.to_owned()))
        }
        _ => s,
    }
}
