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

mod access;
mod access_api;
mod agent;
mod api;
mod autoscale;
pub mod backup;
mod batch;
mod clock;
mod cluster_config;
pub mod config;
mod convert;
mod core;
mod cost_api;
mod dashboard;
mod decide;
mod failpoints;
mod federation_link;
pub mod health;
mod http;
mod lifecycle;
pub mod listeners;
pub mod local;
mod loops;
mod metrics;
mod oversize;
mod page;
mod status;
pub mod telemetry;
mod watchers;

#[cfg(test)]
mod inproc_tests;
#[cfg(test)]
mod testkit;

pub use api::MAX_JOBS_PER_CALL;
pub use config::{ConfigError, Peer, ServerConfig, next_port};
pub use core::LEADER_HEADER;
pub use listeners::{Bound, LISTENING_FILE, Listeners};

use crate::agent::AgentApi;
use crate::api::Api;
use crate::core::Core;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use suanli_proto::v1::access_server::AccessServer;
use suanli_proto::v1::agent_server::AgentServer;
use suanli_proto::v1::cluster_server::ClusterServer;
use suanli_proto::v1::cost_server::CostServer;
use suanli_proto::v1::internal_server::InternalServer;
use suanli_proto::v1::jobs_server::JobsServer;
use suanli_proto::v1::nodes_server::NodesServer;
use suanli_proto::v1::pools_server::PoolsServer;
use suanli_proto::v1::queues_server::QueuesServer;
use suanli_raft::RaftService;
use suanli_raft::ServerNode;
use suanli_security::tls::{self, ClientAuth, Tls};
use thiserror::Error;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;

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
    /// `join` was refused for good (the id, or an address, belongs to another member).
    #[error("join refused: {0}")]
    JoinRefused(String),
    /// This server must not start: its storage is empty but the cluster still counts its id as
    /// a voter (it was wiped).
    #[error("refusing to start: {0}")]
    Refused(String),
    /// The cluster removed this server from its membership; it stepped down and stopped.
    #[error("removed from the cluster: {0}")]
    Removed(String),
    /// The TLS material could not be loaded (the error names the file: `tls.ca`, `tls.cert`
    /// or `tls.key`).
    #[error("tls: {0}")]
    Tls(#[from] suanli_security::tls::TlsError),
}

macro_rules! bounded {
    ($server:ident, $svc:expr, $max:expr) => {
        $server::new($svc)
            .max_decoding_message_size($max.saturating_add(64 * 1024))
            .max_encoding_message_size($max.saturating_mul(4))
    };
}

/// Runs a server on `listeners` until `shutdown` resolves, then steps down without hurting
/// the cluster (loops stop, a leader hands off, raft stops, the listeners drain for
/// `shutdown_grace_ms`; see `lifecycle`), and returns. It also returns, with an error, when
/// raft stops on its own, when `join` is refused ([`ServerError::JoinRefused`]) or when the
/// cluster removed this server ([`ServerError::Removed`]).
///
/// The caller binds the two listeners ([`Listeners::bind`] binds what `cfg` names; a test
/// binds `127.0.0.1:0`): the client one (the public API, agents) and the peer one (raft and
/// `Internal`). The server serves the addresses they are bound to (`cfg.listen` and
/// `cfg.peer_listen` are replaced by them, see [`ServerConfig::bound_to`]) and writes them to
/// `<data_dir>/listening.json`. Nothing reaches the raft log from the client listener but
/// commands this server built from validated requests.
///
/// With `cfg.tls` both listeners serve TLS (the client listener takes a client certificate
/// when one is offered, the peer listener requires one of the cluster's CA), every call to
/// another server (raft, forwarding, joining) presents this server's certificate, and the
/// files are reloaded on a change or SIGHUP; an unreadable file ends it at once
/// ([`ServerError::Tls`], naming the file). With `cfg.insecure` everything is plaintext and a
/// warning says so at every start.
pub async fn serve(
    listeners: Listeners,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    cfg.validate()?;
    let bound =
        listeners.bound().map_err(|source| ServerError::Io { what: "the listeners' addresses".into(), source })?;
    let cfg = cfg.bound_to(&bound);
    let Listeners { client: listener, peer: peer_listener, http: http_listener } = listeners;
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|source| ServerError::Io { what: format!("data_dir {}", cfg.data_dir.display()), source })?;
    bound.write(&cfg.data_dir).map_err(|source| ServerError::Io {
        what: format!("data_dir {}: writing {LISTENING_FILE}", cfg.data_dir.display()),
        source,
    })?;
    let tls = match &cfg.tls {
        Some(files) => Some(Tls::load(files.clone())?),
        None => {
            tracing::warn!(
                "--insecure: plaintext, no identities: anyone who reaches a port is admin (give [tls] or --tls-dir to serve TLS)"
            );
            None
        }
    };
    // Reloads the certificate on a file change or SIGHUP; ends with the server.
    let reloader =
        tls.as_ref().map(|t| AbortOnDrop(t.spawn_reloader(Duration::from_millis(cfg.tls_reload_interval_ms))));
    let settings = cfg.raft.clone();
    failpoints::arm();
    let (raft, state, log) = suanli_raft::open(&cfg.data_dir, cfg.id, &settings, tls.clone()).await?;
    // Before anything is served (the listeners are bound: a peer's connection waits in the
    // backlog, and is dropped with them when this server refuses to start).
    if !raft.is_initialized().await.unwrap_or(true)
        && let Some(why) = lifecycle::wiped_voter(&cfg, tls.as_ref()).await
    {
        tracing::error!("{why}");
        let _ = raft.shutdown().await;
        return Err(ServerError::Refused(why));
    }
    let peer_addr = bound.peer;
    let max = cfg.max_request_bytes;
    let core = Arc::new(Core::new(cfg.clone(), raft.clone(), state, log, tls.clone()));
    let api = Api(core.clone(), batch::Batcher::start(core.clone()));
    let (health, health_server) = health::HealthServices::serving().await;
    let (reflection_v1, reflection_v1alpha) = health::reflection();
    let access = access::Access::start(core.clone(), cfg.insecure);
    let clients = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .concurrency_limit_per_connection(cfg.max_concurrent_per_connection)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .layer(access.layer(suanli_security::policy::Listener::Client))
        .layer(oversize::layer())
        .add_service(bounded!(JobsServer, api.clone(), max))
        .add_service(bounded!(QueuesServer, api.clone(), max))
        .add_service(bounded!(PoolsServer, api.clone(), max))
        .add_service(bounded!(NodesServer, api.clone(), max))
        .add_service(bounded!(ClusterServer, api.clone(), max))
        .add_service(bounded!(AgentServer, AgentApi(core.clone()), max))
        .add_service(bounded!(AccessServer, access_api::AccessApi(core.clone()), max))
        .add_service(bounded!(CostServer, cost_api::CostApi(core.clone()), max))
        .add_service(health_server)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let peers = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .layer(access.layer(suanli_security::policy::Listener::Peer))
        .add_service(RaftService::new(raft.clone(), &settings).into_server(&settings))
        .add_service(bounded!(InternalServer, api.clone(), settings.max_message_bytes));

    let (stop_tx, stop_rx) = watch::channel(false);
    let (ending_tx, mut ending_rx) = tokio::sync::mpsc::channel(4);
    let mut tasks = vec![
        tokio::spawn(lifecycle::bootstrap(core.clone(), stop_rx.clone(), ending_tx.clone())),
        tokio::spawn(loops::scheduling(core.clone(), stop_rx.clone())),
        tokio::spawn(loops::liveness(core.clone(), stop_rx.clone())),
        tokio::spawn(autoscale::autoscaling(core.clone(), stop_rx.clone())),
        tokio::spawn(lifecycle::watch_membership(core.clone(), stop_rx.clone(), ending_tx)),
        tokio::spawn(loops::identity(core.clone(), stop_rx.clone())),
        tokio::spawn(federation_link::link(core.clone(), stop_rx.clone())),
        tokio::spawn(clock::sampling(core.clone(), stop_rx.clone())),
    ];
    tracing::info!(id = cfg.id, listen = %cfg.listen, advertise = %cfg.advertised(), peer_listen = %peer_addr, peer_advertise = %cfg.peer_advertised(), data_dir = %cfg.data_dir.display(), tls = tls.is_some(), "suanli server listening");
    let (done_tx, done_rx) = watch::channel(false);
    let until = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|d| *d).await;
    };
    // The client listener drains first (clients and agents move to another server at once);
    // the peer listener only after raft stopped, so raft here is never cut off from its peers
    // while it still runs (it would campaign).
    let (peers_done_tx, peers_done_rx) = watch::channel(false);
    let handshake = Duration::from_millis(cfg.tls_handshake_timeout_ms);
    // The HTTP listener (/metrics, the dashboard) stops with the client listener; a failure
    // of it is logged and ends nothing else.
    let _http = http_listener.map(|l| {
        let router = http::router(http::HttpCtx { core: core.clone(), access: access.clone(), api: api.clone() });
        let (tls, done) = (tls.clone(), done_rx.clone());
        AbortOnDrop(tokio::spawn(async move {
            if let Err(e) = suanli_security::http::serve(l, tls, handshake, router, until(done)).await {
                tracing::error!(error = %e, "the HTTP listener failed; /metrics and the dashboard are not served");
            }
        }))
    });
    let mut listeners = tokio::spawn(async move {
        let (served, peered) = match tls {
            // The client listener takes a certificate when one is offered (users, agents,
            // servers forwarding) and token holders without one; the peer listener only
            // callers with a certificate of the cluster's CA.
            Some(tls) => {
                tokio::join!(
                    clients.serve_with_incoming_shutdown(
                        tls::incoming(listener, tls.clone(), ClientAuth::Optional, handshake),
                        until(done_rx)
                    ),
                    peers.serve_with_incoming_shutdown(
                        tls::incoming(peer_listener, tls, ClientAuth::Required, handshake),
                        until(peers_done_rx)
                    ),
                )
            }
            None => {
                tokio::join!(
                    clients.serve_with_incoming_shutdown(TcpListenerStream::new(listener), until(done_rx)),
                    peers.serve_with_incoming_shutdown(TcpListenerStream::new(peer_listener), until(peers_done_rx)),
                )
            }
        };
        served.and(peered)
    });
    let mut metrics = raft.metrics();
    let ended: Option<ServerError> = tokio::select! {
        () = shutdown => {
            tracing::info!("shutdown requested: stepping down");
            None
        }
        why = raft_stopped(&mut metrics) => {
            tracing::error!(error = %why, "raft stopped; the server exits");
            Some(ServerError::RaftStopped(why))
        }
        Some(e) = ending_rx.recv() => Some(match e {
            lifecycle::Ending::JoinRefused(why) => ServerError::JoinRefused(why),
            lifecycle::Ending::Removed(why) => {
                tracing::warn!(reason = %why, "removed from the cluster: stepping down and exiting");
                ServerError::Removed(why)
            }
        }),
        r = &mut listeners => {
            // A listener failed on its own: nothing is served any more.
            let e = match r {
                Ok(Err(e)) => ServerError::Transport(e),
                Ok(Ok(())) => ServerError::RaftStopped("the listeners stopped".into()),
                Err(e) => ServerError::RaftStopped(format!("the listeners' task: {e}")),
            };
            Some(e)
        }
    };
    health.until(std::future::ready(())).await;

    // 1. No scheduling pass or liveness verdict from a server on its way out.
    tracing::info!(step = 1, "shutdown: stopping the scheduling and liveness loops");
    let _ = stop_tx.send(true);
    let loops_deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    for mut t in tasks.drain(..) {
        if tokio::time::timeout_at(loops_deadline, &mut t).await.is_err() {
            t.abort();
        }
    }
    // 2. Clients and agents: GOAWAY on the client listener, so they go to another server.
    let _ = done_tx.send(true);
    // 3. Raft stops: no more heartbeats, campaigns or votes from here.
    let successors = if core.is_leader() { lifecycle::successors(&core) } else { Vec::new() };
    tracing::info!(step = 3, leader = !successors.is_empty(), "shutdown: stopping raft");
    match tokio::time::timeout(Duration::from_secs(5), raft.shutdown()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "raft shutdown"),
        Err(_) => tracing::warn!("raft did not shut down within 5 s; going on"),
    }
    // 4. A leader asks its most caught-up voter to campaign at once, and waits (bounded)
    //    until another server leads.
    if !successors.is_empty() {
        let within = Duration::from_millis(cfg.leader_handoff_ms);
        tracing::info!(step = 4, candidates = ?successors.iter().map(|s| s.0).collect::<Vec<_>>(), within_ms = cfg.leader_handoff_ms, "shutdown: handing leadership off");
        match lifecycle::hand_off(&core, &successors, within).await {
            Some(id) => tracing::info!(new_leader = id, "shutdown: another server leads"),
            None => tracing::warn!("shutdown: no new leader seen in time; the others elect one on their own"),
        }
    }
    // 5. The listeners: open requests get the grace period; what remains is closed.
    let _ = peers_done_tx.send(true);
    let grace = Duration::from_millis(cfg.shutdown_grace_ms);
    tracing::info!(step = 5, grace_ms = cfg.shutdown_grace_ms, "shutdown: draining the listeners");
    let served = match tokio::time::timeout(grace, &mut listeners).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "listeners' task");
            Ok(())
        }
        Err(_) => {
            tracing::info!("shutdown: grace period over; closing the remaining connections");
            listeners.abort();
            Ok(())
        }
    };
    drop(reloader);
    tracing::info!("shutdown: done");
    if let Some(e) = ended {
        return Err(e);
    }
    served?;
    Ok(())
}

/// Aborts its task when dropped (on every way out of [`serve`]).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
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
