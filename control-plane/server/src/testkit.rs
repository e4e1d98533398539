//! In-process servers for this crate's tests: real raft and RocksDB in a temp dir, listeners
//! bound to `127.0.0.1:0` and handed to [`crate::serve`], all on the test's own runtime, so
//! `#[tokio::test(start_paused = true)]` drives every timer of the server (heartbeat TTLs,
//! request timeouts, raft elections) without waiting for them.
//!
//! They run `insecure` (plaintext): with the clock paused, a TLS handshake's timeout could
//! fire while the handshake's bytes are still on their way. TLS is covered by the tests that
//! run real server processes (`local::ProcessCluster`, tests/tests/tls.rs).

use crate::core::Core;
use crate::{Bound, Listeners, Peer, ServerConfig, ServerError};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_raft::ServerNode;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

/// A configuration for server `id` with its data under `dir`, on port 0.
pub fn config(id: u64, dir: &Path) -> ServerConfig {
    ServerConfig {
        id,
        data_dir: dir.join(format!("s{id}")),
        listen: "127.0.0.1:0".into(),
        heartbeat_interval_ms: 100,
        heartbeat_ttl_ms: 1_000,
        clock_check_interval_ms: 100,
        request_timeout_ms: 3_000,
        insecure: true,
        ..ServerConfig::default()
    }
}

/// Two listeners on `127.0.0.1:0`.
pub async fn listeners() -> Listeners {
    let bind = || TcpListener::bind("127.0.0.1:0");
    Listeners { client: bind().await.expect("bind port 0"), peer: bind().await.expect("bind port 0"), http: None }
}

/// A server running in a task of the test's runtime.
pub struct Running {
    /// Where it listens.
    pub bound: Bound,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServerError>>,
}

impl Running {
    /// Starts `cfg` on `listeners`.
    pub fn start(listeners: Listeners, cfg: ServerConfig) -> Running {
        let bound = listeners.bound().expect("bound addresses");
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(crate::serve(listeners, cfg, async move {
            let _ = rx.await;
        }));
        Running { bound, stop: Some(tx), task }
    }

    /// A channel to its client listener.
    pub fn channel(&self) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.bound.client))
            .expect("an address")
            .connect_timeout(Duration::from_secs(1))
            .connect_lazy()
    }

    /// Stops it (as on SIGTERM) and returns what `serve` returned.
    pub async fn stop(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.await.expect("the server task")
    }
}

/// Servers `1..=n` of one new cluster (each an initial voter), started.
pub async fn cluster(n: u64, dir: &Path, tune: impl Fn(ServerConfig) -> ServerConfig) -> Vec<Running> {
    let mut ls = Vec::new();
    for _ in 0..n {
        ls.push(listeners().await);
    }
    let peers: Vec<Peer> = ls
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let b = l.bound().expect("bound");
            Peer { id: i as u64 + 1, addr: b.client.to_string(), peer_addr: Some(b.peer.to_string()) }
        })
        .collect();
    ls.into_iter()
        .enumerate()
        .map(|(i, l)| {
            let cfg = ServerConfig { bootstrap: true, peers: peers.clone(), ..config(i as u64 + 1, dir) };
            Running::start(l, tune(cfg))
        })
        .collect()
}

/// The leader's id as `s` sees it, once it knows one (asked every 10 ms of the test's clock).
pub async fn leader_of(s: &Running) -> u64 {
    let mut c = ClusterClient::new(s.channel());
    loop {
        if let Ok(r) = c.leader(pb::LeaderRequest {}).await
            && r.get_ref().leader_id != 0
        {
            return r.get_ref().leader_id;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A [`Core`] of a single-voter cluster on raft and RocksDB in `dir`, leading, with no
/// listener and none of the loops (what the batcher's tests drive).
pub async fn solo_core(dir: &Path) -> Arc<Core> {
    let cfg = config(1, dir);
    let (raft, state, log) = suanli_raft::open(&cfg.data_dir, cfg.id, &cfg.raft, None).await.expect("open raft");
    let me = ServerNode::new(cfg.peer_advertised(), cfg.advertised().to_owned());
    let members: std::collections::BTreeMap<u64, ServerNode> = [(cfg.id, me)].into();
    raft.initialize(members).await.expect("initialize");
    let core = Arc::new(Core::new(cfg, raft, state, log, None));
    let mut m = core.raft.metrics();
    m.wait_for(|m| m.state == openraft::ServerState::Leader).await.expect("leads");
    core
}
