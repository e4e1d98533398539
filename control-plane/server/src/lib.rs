//! suanli's control-plane server: a client listener serving clients (`Jobs`, `Queues`,
//! `Pools`, `Nodes`, `Cluster`) and agents (`Agent`), and a peer listener serving the other
//! servers (`RaftTransport`, `Internal`), over a raft-replicated [`suanli_state::State`]; and
//! the leader's scheduling and liveness loops.
//!
//! ```text
//!             ┌──────────────────────── suanli server ─────────────────────────┐
//!  clients ──▶│ Api (Jobs, Queues, Pools, Nodes, Cluster) ─┐                   │
//!  agents  ──▶│ AgentApi (register, heartbeat, watch, report) ├─▶ Core ─▶ raft ─┼─▶ peers
//!  servers ──▶│ RaftService, Internal (Propose, ReadIndex) ┘      │   RocksDB │
//!             │ loops (leader only): scheduling ─▶ ApplyPlan; liveness ─▶ NodeDown │
//!             └─────────────────────────────────────────────────────────────────┘
//! ```
//!
//! Any server accepts any request: writes on a follower are forwarded to the leader (one hop),
//! reads are linearizable through a read index unless the request asks for a stale read. Every
//! request is bounded in size and time ([`ServerConfig`]). It must never schedule or decide
//! liveness on a follower, acknowledge a write before raft committed it, or keep heartbeats
//! anywhere but in the leader's memory.

mod agent;
mod api;
mod batch;
mod clock;
pub mod config;
mod convert;
mod core;
mod failpoints;
pub mod health;
pub mod local;
mod loops;
mod oversize;
mod page;
mod status;
mod watchers;

pub use api::MAX_JOBS_PER_CALL;
pub use config::{ConfigError, Peer, ServerConfig, next_port};
pub use core::LEADER_HEADER;

use crate::agent::AgentApi;
use crate::api::Api;
use crate::core::Core;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use suanli_proto::v1::agent_server::AgentServer;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::cluster_server::ClusterServer;
use suanli_proto::v1::internal_server::InternalServer;
use suanli_proto::v1::jobs_server::JobsServer;
use suanli_proto::v1::nodes_server::NodesServer;
use suanli_proto::v1::pools_server::PoolsServer;
use suanli_proto::v1::queues_server::QueuesServer;
use suanli_raft::RaftService;
use suanli_raft::ServerNode;
use thiserror::Error;
use tokio::sync::watch;

/// Why a server could not start or stopped with an error.
#[derive(Debug, Error)]
pub enum ServerError {
    /// Bad configuration.
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    /// Data directory or socket.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The raft storage could not be opened.
    #[error(transparent)]
    Open(#[from] suanli_raft::OpenError),
    /// The gRPC server failed.
    #[error("grpc: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// Raft stopped on its own (a storage error such as a failed fsync): the server exits
    /// rather than serve from a node that can no longer persist; a supervisor restarts it and
    /// it recovers from what is on disk.
    #[error("raft stopped: {0}")]
    RaftStopped(String),
}

macro_rules! bounded {
    ($server:ident, $svc:expr, $max:expr) => {
        $server::new($svc)
            .max_decoding_message_size($max.saturating_add(64 * 1024))
            .max_encoding_message_size($max.saturating_mul(4))
    };
}

/// Runs a server until `shutdown` resolves (then stops serving, and stops raft).
///
/// Two listeners: the client one (`listen`: the public API, agents) and the peer one
/// (`peer_listen`: raft and `Internal`). Nothing reaches the raft log from the client
/// listener but commands this server built from validated requests.
pub async fn serve(cfg: ServerConfig, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ServerError> {
    cfg.validate()?;
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|source| ServerError::Io { what: format!("data_dir {}", cfg.data_dir.display()), source })?;
    let settings = cfg.raft.clone();
    failpoints::arm();
    let (raft, state, log) = suanli_raft::open(&cfg.data_dir, cfg.id, &settings).await?;
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .map_err(|source| ServerError::Io { what: format!("listen {}", cfg.listen), source })?;
    let peer_addr = cfg.peer_listen_addr();
    let peer_listener = tokio::net::TcpListener::bind(&peer_addr)
        .await
        .map_err(|source| ServerError::Io { what: format!("peer_listen {peer_addr}"), source })?;
    let max = cfg.max_request_bytes;
    let core = Arc::new(Core::new(cfg.clone(), raft.clone(), state, log));
    let api = Api(core.clone(), batch::Batcher::start(core.clone()));
    let (health, health_server) = health::HealthServices::serving().await;
    let (reflection_v1, reflection_v1alpha) = health::reflection();
    let clients = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .concurrency_limit_per_connection(cfg.max_concurrent_per_connection)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .layer(oversize::layer())
        .add_service(bounded!(JobsServer, api.clone(), max))
        .add_service(bounded!(QueuesServer, api.clone(), max))
        .add_service(bounded!(PoolsServer, api.clone(), max))
        .add_service(bounded!(NodesServer, api.clone(), max))
        .add_service(bounded!(ClusterServer, api.clone(), max))
        .add_service(bounded!(AgentServer, AgentApi(core.clone()), max))
        .add_service(health_server)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let peers = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .add_service(RaftService::new(raft.clone(), &settings).into_server(&settings))
        .add_service(bounded!(InternalServer, api.clone(), settings.max_message_bytes));

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = vec![
        tokio::spawn(bootstrap(core.clone(), stop_rx.clone())),
        tokio::spawn(loops::scheduling(core.clone(), stop_rx.clone())),
        tokio::spawn(loops::liveness(core.clone(), stop_rx.clone())),
        tokio::spawn(clock::sampling(core.clone(), stop_rx.clone())),
    ];
    tracing::info!(id = cfg.id, listen = %cfg.listen, advertise = %cfg.advertised(), peer_listen = %peer_addr, peer_advertise = %cfg.peer_advertised(), data_dir = %cfg.data_dir.display(), "suanli server listening");
    let fatal = Arc::new(std::sync::Mutex::new(None::<String>));
    let shutdown = health.until(shutdown);
    let (done_tx, done_rx) = watch::channel(false);
    {
        let fatal = fatal.clone();
        let mut metrics = raft.metrics();
        tokio::spawn(async move {
            tokio::select! {
                () = shutdown => {}
                why = raft_stopped(&mut metrics) => {
                    tracing::error!(error = %why, "raft stopped; the server exits");
                    *fatal.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
                }
            }
            let _ = done_tx.send(true);
        });
    }
    let until = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|d| *d).await;
    };
    let (served, peered) = tokio::join!(
        clients.serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            until(done_rx.clone())
        ),
        peers.serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(peer_listener),
            until(done_rx.clone())
        ),
    );
    let _ = stop_tx.send(true);
    for t in tasks.drain(..) {
        let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
    }
    if let Err(e) = raft.shutdown().await {
        tracing::warn!(error = %e, "raft shutdown");
    }
    served?;
    peered?;
    let why = fatal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    match why {
        Some(why) => Err(ServerError::RaftStopped(why)),
        None => Ok(()),
    }
}

/// Resolves when raft reports a fatal error (or its metrics end).
async fn raft_stopped(m: &mut watch::Receiver<openraft::RaftMetrics<u64, ServerNode>>) -> String {
    loop {
        if let Err(e) = &m.borrow().running_state {
            return e.to_string();
        }
        if m.changed().await.is_err() {
            return "raft's metrics channel closed".into();
        }
    }
}

/// First start: initialize a new cluster (single server, or the smallest id of `peers`), or
/// ask a running cluster to add this server (`join`). Later starts recover from storage.
async fn bootstrap(core: Arc<Core>, mut stop: watch::Receiver<bool>) {
    match core.raft.is_initialized().await {
        Ok(true) => return,
        Ok(false) => {}
        Err(e) => {
            tracing::error!(error = %e, "raft stopped");
            return;
        }
    }
    let cfg = &core.cfg;
    let me = cfg.advertised().to_owned();
    let me_peer = cfg.peer_advertised();
    if let Some(join) = &cfg.join {
        let mut backoff = Duration::from_millis(200);
        loop {
            match join_once(join, cfg.id, &me, &me_peer, cfg.learner_only).await {
                Ok(()) => {
                    tracing::info!(via = %join, "joined the cluster");
                    return;
                }
                Err(e) => tracing::warn!(via = %join, error = %e, "join failed; retrying"),
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                _ = stop.changed() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
    let members: BTreeMap<u64, ServerNode> = if cfg.peers.is_empty() {
        [(cfg.id, ServerNode::new(me_peer, me))].into()
    } else {
        if cfg.peers.iter().map(|p| p.id).min() != Some(cfg.id) {
            return; // the smallest id initializes; this one is added by it
        }
        // validate() checked that every peer address derives.
        cfg.peers.iter().map(|p| (p.id, ServerNode::new(p.peer().unwrap_or_default(), p.addr.clone()))).collect()
    };
    match core.raft.initialize(members).await {
        Ok(()) => tracing::info!("initialized a new cluster"),
        Err(e) => tracing::info!(error = %e, "not initializing (already initialized?)"),
    }
}

async fn join_once(via: &str, id: u64, addr: &str, peer_addr: &str, learner_only: bool) -> Result<(), String> {
    let uri = if via.contains("://") { via.to_owned() } else { format!("http://{via}") };
    let mut c = ClusterClient::connect(uri).await.map_err(|e| e.to_string())?;
    c.add_server(suanli_proto::v1::AddServerRequest {
        id,
        addr: addr.to_owned(),
        learner_only,
        peer_addr: peer_addr.to_owned(),
    })
    .await
    .map_err(|s| format!("{}: {}", s.code(), s.message()))?;
    Ok(())
}
