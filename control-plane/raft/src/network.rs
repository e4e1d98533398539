//! The raft transport over gRPC (`suanli.v1.RaftTransport`): the client side openraft uses to
//! reach peers, and the service a server mounts to answer them.
//!
//! ```text
//!  openraft ──RaftNetwork──▶ GrpcNetwork ──tonic (deadline per RPC)──▶ RaftService ──▶ Raft<C>
//!             AppendEntries as a binary frame (`crate::frame`: the entries as stored), Vote and
//!             replies as JSON; snapshot chunks as raw bytes
//! ```
//!
//! Each RPC gets a deadline: the smaller of the configured one and openraft's TTL, enforced on
//! the client (a timer) and sent to the server (`grpc-timeout`). An unreachable peer is
//! reported as such so openraft backs off; a remote raft error travels back typed.

// openraft's `RaftNetwork` fixes the (large) error type; boxing it here would not help.
#![allow(clippy::result_large_err)]

use crate::frame::{decode_append, encode_append};
use crate::node::ServerNode;
use crate::settings::RaftSettings;
use crate::store::StoreConfig;
use openraft::Raft;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable};
use openraft::network::{RPCOption, RPCTypes, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;
use suanli_proto::v1::raft_transport_client::RaftTransportClient;
use suanli_proto::v1::raft_transport_server::{RaftTransport, RaftTransportServer};
use suanli_proto::v1::{RaftMessage, SnapshotChunk};
use suanli_security::tls::Tls;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

/// Creates one [`GrpcNetwork`] per peer.
pub struct GrpcNetworkFactory<C> {
    id: u64,
    settings: RaftSettings,
    tls: Option<Tls>,
    _c: PhantomData<C>,
}

impl<C> GrpcNetworkFactory<C> {
    /// A factory for node `id` (used in timeout reports). With `tls`, peers are dialed over
    /// mutual TLS (this server's certificate is its client certificate; a peer's is verified
    /// against the CA, for the host of its address); without it, plaintext.
    pub fn new(id: u64, settings: RaftSettings, tls: Option<Tls>) -> Self {
        Self { id, settings, tls, _c: PhantomData }
    }
}

impl<C: StoreConfig> RaftNetworkFactory<C> for GrpcNetworkFactory<C> {
    type Network = GrpcNetwork<C>;

    async fn new_client(&mut self, target: u64, node: &ServerNode) -> Self::Network {
        GrpcNetwork {
            id: self.id,
            target,
            addr: self.settings.dial_addr(&node.addr).to_owned(),
            settings: self.settings.clone(),
            tls: self.tls.clone(),
            client: None,
            _c: PhantomData,
        }
    }
}

/// The connection to one peer; connects lazily and reconnects after failures.
pub struct GrpcNetwork<C> {
    id: u64,
    target: u64,
    addr: String,
    settings: RaftSettings,
    tls: Option<Tls>,
    client: Option<RaftTransportClient<Channel>>,
    _c: PhantomData<C>,
}

type RpcErr<E = openraft::error::Infallible> = RPCError<u64, ServerNode, RaftError<u64, E>>;

impl<C: StoreConfig> GrpcNetwork<C> {
    fn client<E: std::error::Error>(&mut self) -> Result<RaftTransportClient<Channel>, RpcErr<E>> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let uri = if self.addr.contains("://") { self.addr.clone() } else { format!("http://{}", self.addr) };
        let endpoint = Endpoint::from_shared(uri)
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&e)))?
            .connect_timeout(self.settings.connect_timeout())
            .tcp_nodelay(true);
        let max = self.settings.max_message_bytes;
        let c = RaftTransportClient::new(suanli_security::tls::channel(endpoint, self.tls.as_ref()))
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        self.client = Some(c.clone());
        Ok(c)
    }

    /// Runs one RPC under a deadline and maps transport failures to openraft's error kinds.
    async fn call<E, T, F, Fut>(
        &mut self,
        action: RPCTypes,
        limit: Duration,
        ttl: Duration,
        f: F,
    ) -> Result<T, RpcErr<E>>
    where
        E: std::error::Error + DeserializeOwned,
        T: DeserializeOwned,
        F: FnOnce(RaftTransportClient<Channel>, Duration) -> Fut,
        Fut: Future<Output = Result<tonic::Response<RaftMessage>, Status>>,
    {
        let deadline = limit.min(ttl);
        let client = self.client()?;
        let reply = match tokio::time::timeout(deadline, f(client, deadline)).await {
            Err(_) => {
                return Err(RPCError::Timeout(Timeout { action, id: self.id, target: self.target, timeout: deadline }));
            }
            Ok(Err(status)) => {
                if matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown) {
                    self.client = None; // reconnect next time
                    return Err(RPCError::Unreachable(Unreachable::new(&status)));
                }
                if status.code() == tonic::Code::DeadlineExceeded {
                    return Err(RPCError::Timeout(Timeout {
                        action,
                        id: self.id,
                        target: self.target,
                        timeout: deadline,
                    }));
                }
                return Err(RPCError::Network(NetworkError::new(&status)));
            }
            Ok(Ok(r)) => r.into_inner(),
        };
        let result: Result<T, RaftError<u64, E>> =
            serde_json::from_slice(&reply.body).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }

    fn message<T: Serialize, E: std::error::Error>(&self, v: &T, size_hint: usize) -> Result<RaftMessage, RpcErr<E>> {
        let mut json = Vec::with_capacity(size_hint);
        serde_json::to_writer(&mut json, v).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        Ok(RaftMessage { group: self.settings.group.clone(), body: json.into() })
    }
}

/// gRPC metadata key naming the server a raft message is meant for. A server whose id differs
/// refuses the message: a new server at a reused address must not answer for the old one (its
/// empty log's answers would corrupt the leader's replication progress for the old id; openraft
/// 0.9 panics on that in `calc_mid`). A message without it (an earlier build) is accepted.
pub const TARGET_HEADER: &str = "suanli-raft-target";

fn with_deadline<T>(msg: T, d: Duration, target: u64) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(d);
    r.metadata_mut().insert(TARGET_HEADER, tonic::metadata::MetadataValue::from(target));
    r
}

impl<C: StoreConfig> RaftNetwork<C> for GrpcNetwork<C> {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RpcErr> {
        let frame = encode_append(&rpc).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let msg = RaftMessage { group: self.settings.group.clone(), body: frame.into() };
        let limit = self.settings.append_timeout();
        let target = self.target;
        // openraft 0.9 wraps this call in its own timeout of one heartbeat interval, so the
        // configured deadline can only shorten it; what keeps a large batch inside that
        // timeout is the byte budget of replication reads (`RaftSettings::max_append_bytes`).
        self.call(RPCTypes::AppendEntries, limit, limit, |mut c, d| async move {
            c.append_entries(with_deadline(msg, d, target)).await
        })
        .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<C>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<u64>, RpcErr<InstallSnapshotError>> {
        let to_json = |v: Result<Vec<u8>, serde_json::Error>| v.map_err(|e| RPCError::Network(NetworkError::new(&e)));
        let chunk = SnapshotChunk {
            group: self.settings.group.clone(),
            vote_json: to_json(serde_json::to_vec(&rpc.vote))?,
            meta_json: to_json(serde_json::to_vec(&rpc.meta))?,
            offset: rpc.offset,
            data: rpc.data.into(),
            done: rpc.done,
        };
        let limit = self.settings.snapshot_timeout();
        let target = self.target;
        self.call(RPCTypes::InstallSnapshot, limit, option.hard_ttl(), |mut c, d| async move {
            c.install_snapshot(with_deadline(chunk, d, target)).await
        })
        .await
    }

    async fn vote(&mut self, rpc: VoteRequest<u64>, option: RPCOption) -> Result<VoteResponse<u64>, RpcErr> {
        let msg = self.message(&rpc, 256)?;
        let limit = self.settings.vote_timeout();
        let target = self.target;
        self.call(RPCTypes::Vote, limit, option.hard_ttl(), |mut c, d| async move {
            c.vote(with_deadline(msg, d, target)).await
        })
        .await
    }
}

/// The gRPC service that hands peers' raft messages to the local [`Raft`].
pub struct RaftService<C: StoreConfig> {
    raft: Raft<C>,
    group: String,
    id: u64,
}

impl<C: StoreConfig> RaftService<C> {
    /// A service for `raft`, answering only messages for `settings.group`.
    pub fn new(raft: Raft<C>, settings: &RaftSettings) -> Self {
        let id = raft.metrics().borrow().id;
        Self { raft, group: settings.group.clone(), id }
    }

    /// The tonic server to mount (`Server::builder().add_service(...)`), with the configured
    /// message size limit.
    pub fn into_server(self, settings: &RaftSettings) -> RaftTransportServer<Self> {
        RaftTransportServer::new(self)
            .max_decoding_message_size(settings.max_message_bytes)
            .max_encoding_message_size(settings.max_message_bytes)
    }

    /// Refuses a message meant for another server id ([`TARGET_HEADER`]).
    fn check_target(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let Some(v) = meta.get(TARGET_HEADER) else { return Ok(()) };
        let target = v.to_str().ok().and_then(|t| t.parse::<u64>().ok());
        match target {
            Some(t) if t == self.id => Ok(()),
            Some(t) => Err(Status::failed_precondition(format!(
                "raft message for server {t} reached server {} (the address was reused by another server)",
                self.id
            ))),
            None => Err(Status::invalid_argument(format!("{TARGET_HEADER}: not a server id"))),
        }
    }

    fn check_group(&self, group: &str) -> Result<(), Status> {
        if group != self.group {
            return Err(Status::not_found(format!(
                "raft group {group:?} is not served here (this is {:?})",
                self.group
            )));
        }
        Ok(())
    }
}

fn decode<T: DeserializeOwned>(what: &str, b: &[u8]) -> Result<T, Status> {
    serde_json::from_slice(b).map_err(|e| Status::invalid_argument(format!("{what}: {e}")))
}

fn reply<T: Serialize>(v: &T, group: &str) -> Result<tonic::Response<RaftMessage>, Status> {
    let json = serde_json::to_vec(v).map_err(|e| Status::internal(format!("encoding reply: {e}")))?;
    Ok(tonic::Response::new(RaftMessage { group: group.to_owned(), body: json.into() }))
}

#[tonic::async_trait]
impl<C: StoreConfig> RaftTransport for RaftService<C> {
    async fn append_entries(&self, req: Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, Status> {
        self.check_target(req.metadata())?;
        let m = req.into_inner();
        self.check_group(&m.group)?;
        let rpc: AppendEntriesRequest<C> =
            decode_append(m.body).map_err(|e| Status::invalid_argument(e.to_string()))?;
        reply(&self.raft.append_entries(rpc).await, &self.group)
    }

    async fn vote(&self, req: Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, Status> {
        self.check_target(req.metadata())?;
        let m = req.into_inner();
        self.check_group(&m.group)?;
        let rpc: VoteRequest<u64> = decode("vote", &m.body)?;
        reply(&self.raft.vote(rpc).await, &self.group)
    }

    async fn install_snapshot(&self, req: Request<SnapshotChunk>) -> Result<tonic::Response<RaftMessage>, Status> {
        self.check_target(req.metadata())?;
        let m = req.into_inner();
        self.check_group(&m.group)?;
        let rpc = InstallSnapshotRequest::<C> {
            vote: decode("install_snapshot.vote_json", &m.vote_json)?,
            meta: decode("install_snapshot.meta_json", &m.meta_json)?,
            offset: m.offset,
            data: m.data.to_vec(),
            done: m.done,
        };
        reply(&self.raft.install_snapshot(rpc).await, &self.group)
    }
}
