//! What a federation server's services and loops share: the raft node, the applied state, and
//! the write path (propose here when leader, else forward once to the leader's
//! `FederationPeer.Propose`; the leader stamps its clock on every command).

use crate::command::{FedCommand, FedResponse};
use crate::server::FederationServerConfig;
use crate::{FedHandle, FedRaft};
use openraft::ServerState;
use openraft::error::{ClientWriteError, RaftError};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use suanli_proto::v1::FedProposeRequest;
use suanli_proto::v1::federation_peer_client::FederationPeerClient;
use suanli_raft::{LogCommand, ServerNode};
use tokio::sync::Notify;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

/// The shared core of one federation server.
pub struct Node {
    /// Its configuration (listen addresses are the bound ones).
    pub cfg: FederationServerConfig,
    /// The raft node.
    pub raft: FedRaft,
    /// The applied state.
    pub state: FedHandle,
    /// Wakes the dispatch loop (a submit or a sync committed).
    pub kick: Notify,
    tls: Option<suanli_security::tls::Tls>,
    channels: Mutex<HashMap<String, Channel>>,
}

/// The federation's clock: ms since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Sets the leader's clock on a command that carries one.
pub fn stamp(cmd: &mut FedCommand, now: u64) {
    match cmd {
        FedCommand::Submit { now_ms, .. }
        | FedCommand::Cancel { now_ms, .. }
        | FedCommand::Sync { now_ms, .. }
        | FedCommand::Expire { now_ms } => *now_ms = now,
        // A dispatch's time is its view's; the rest carry none.
        FedCommand::Dispatch { .. }
        | FedCommand::Init { .. }
        | FedCommand::SetConfig { .. }
        | FedCommand::SetQuota { .. } => {}
    }
}

/// UNAVAILABLE naming the leader's client address (clients retry there).
pub fn unavailable(msg: &str, leader: Option<&str>) -> Status {
    let mut s = Status::unavailable(msg.to_owned());
    if let Some(addr) = leader
        && let Ok(v) = addr.parse()
    {
        s.metadata_mut().insert(suanli_proto::LEADER_HEADER, v);
    }
    s
}

impl Node {
    /// A node over an opened raft group.
    pub fn new(
        cfg: FederationServerConfig,
        raft: FedRaft,
        state: FedHandle,
        tls: Option<suanli_security::tls::Tls>,
    ) -> Node {
        Node { cfg, raft, state, kick: Notify::new(), tls, channels: Mutex::new(HashMap::new()) }
    }

    /// This server's id.
    pub fn id(&self) -> u64 {
        self.cfg.id
    }

    /// The request deadline.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.request_timeout_ms)
    }

    /// Whether this server leads.
    pub fn is_leader(&self) -> bool {
        self.raft.metrics().borrow().state == ServerState::Leader
    }

    /// The leader's id and membership record, when known.
    pub fn leader_node(&self) -> Option<(u64, ServerNode)> {
        let m = self.raft.metrics();
        let m = m.borrow();
        let id = m.current_leader?;
        let node = m.membership_config.membership().get_node(&id).cloned()?;
        Some((id, node))
    }

    /// A cached, lazily connected channel to another federation server (TLS with this
    /// server's certificate unless insecure).
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

    /// Commits `cmd` (forwarding once to the leader when this server does not lead) and
    /// returns the state machine's answer; a refusal becomes INVALID_ARGUMENT naming the field.
    pub async fn propose(&self, cmd: FedCommand) -> Result<FedResponse, Status> {
        let r = self.propose_raw(cmd).await?;
        answer(r)
    }

    /// [`Node::propose`], returning a refusal as [`FedResponse::Rejected`].
    pub async fn propose_raw(&self, mut cmd: FedCommand) -> Result<FedResponse, Status> {
        stamp(&mut cmd, now_ms());
        for _ in 0..3 {
            match self.write_here(&cmd).await {
                Ok(r) => return Ok(r),
                Err(Forward::To(node)) => return self.forward(&node, &cmd).await,
                Err(Forward::Unknown) => self.wait_for_leader().await?,
                Err(Forward::Failed(s)) => return Err(s),
            }
        }
        Err(unavailable("leadership kept changing; retry", self.leader_node().map(|l| l.1.api_addr).as_deref()))
    }

    /// Proposes on this server only (the `FederationPeer.Propose` handler and the leader's
    /// loops): never forwards; the time is stamped here.
    pub async fn propose_local(&self, mut cmd: FedCommand) -> Result<FedResponse, Status> {
        stamp(&mut cmd, now_ms());
        match self.write_here(&cmd).await {
            Ok(r) => Ok(r),
            Err(Forward::To(node)) => {
                Err(unavailable("this federation server no longer leads", Some(node.client_addr())))
            }
            Err(Forward::Unknown) => Err(unavailable("no federation leader is known; retry shortly", None)),
            Err(Forward::Failed(s)) => Err(s),
        }
    }

    async fn write_here(&self, cmd: &FedCommand) -> Result<FedResponse, Forward> {
        if let Some(h) = self.state.halt() {
            return Err(Forward::Failed(Status::failed_precondition(format!(
                "read-only: this federation server halted at log entry {} (kind {:?}): {}",
                h.index, h.kind, h.reason
            ))));
        }
        let enc = LogCommand::encode(cmd).map_err(|e| Forward::Failed(Status::internal(format!("command: {e}"))))?;
        let max = self.cfg.raft.max_message_bytes / 2;
        if enc.len() > max {
            return Err(Forward::Failed(Status::invalid_argument(format!(
                "command: {} bytes encoded is over the limit of {max} (half of raft.max_message_bytes)",
                enc.len()
            ))));
        }
        let r = tokio::time::timeout(self.timeout(), self.raft.client_write(enc)).await;
        match r {
            Err(_) => {
                Err(Forward::Failed(Status::deadline_exceeded("the write did not commit within the request timeout")))
            }
            Ok(Ok(w)) => {
                if matches!(cmd, FedCommand::Submit { .. } | FedCommand::Sync { .. } | FedCommand::Expire { .. }) {
                    self.kick.notify_one();
                }
                Ok(w.data)
            }
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => match f.leader_node {
                Some(n) => Err(Forward::To(n)),
                None => Err(Forward::Unknown),
            },
            Ok(Err(RaftError::APIError(e))) => Err(Forward::Failed(Status::failed_precondition(e.to_string()))),
            Ok(Err(RaftError::Fatal(e))) => {
                Err(Forward::Failed(Status::unavailable(format!("this server's raft stopped: {e}"))))
            }
        }
    }

    async fn wait_for_leader(&self) -> Result<(), Status> {
        let mut rx = self.raft.metrics();
        match tokio::time::timeout(self.timeout(), rx.wait_for(|m| m.current_leader.is_some())).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(unavailable("no federation leader was elected within the request timeout", None)),
        }
    }

    /// Sends a write to the leader's peer listener (`FederationPeer.Propose`), once.
    async fn forward(&self, leader: &ServerNode, cmd: &FedCommand) -> Result<FedResponse, Status> {
        let hint = leader.client_addr().to_owned();
        let mut client = FederationPeerClient::new(self.channel(&leader.addr)?)
            .max_decoding_message_size(self.cfg.raft.max_message_bytes)
            .max_encoding_message_size(self.cfg.raft.max_message_bytes);
        let json = serde_json::to_vec(cmd).map_err(|e| Status::internal(format!("command: {e}")))?;
        let mut req = tonic::Request::new(FedProposeRequest { command_json: json.into() });
        req.set_timeout(self.timeout());
        let r = client.propose(req).await.map_err(|s| match s.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown => {
                unavailable(&format!("forwarding to the federation leader ({hint}): {}", s.message()), Some(&hint))
            }
            _ => s,
        })?;
        let resp: FedResponse = serde_json::from_slice(&r.into_inner().response_json)
            .map_err(|e| Status::internal(format!("the leader's answer: {e}")))?;
        Ok(resp)
    }
}

enum Forward {
    To(ServerNode),
    Unknown,
    Failed(Status),
}

/// A committed answer as a call's result: a refusal is INVALID_ARGUMENT naming its field, an
/// unknown job NOT_FOUND, a halt FAILED_PRECONDITION.
pub fn answer(r: FedResponse) -> Result<FedResponse, Status> {
    match r {
        FedResponse::Rejected { field, message } => Err(Status::invalid_argument(format!("{field}: {message}"))),
        FedResponse::NotFound { field, message } => Err(Status::not_found(format!("{field}: {message}"))),
        FedResponse::Halted { index, kind, reason } => Err(Status::failed_precondition(format!(
            "read-only: this federation server halted at log entry {index} (kind {kind:?}): {reason}"
        ))),
        other => Ok(other),
    }
}
