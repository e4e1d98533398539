//! The federation server process (`suanli federation serve`): its raft group on RocksDB, the
//! `Federation` service on the client listener, `RaftTransport` and `FederationPeer` on the peer
//! listener (mutual TLS, server certificates only), the authorization of every call, and the
//! leader's dispatch and lease-expiry loops.
//!
//! ```text
//!  serve(cfg) ─▶ bind listen + peer_listen ─▶ print `suanli federation listening client=A peer=B`
//!     ─▶ open_group::<FedTypeConfig, FedState>(data_dir, group "federation")
//!     ─▶ client listener: access layer (Listener::Federation) ─▶ Federation, health
//!     ─▶ peer listener:   access layer (Listener::FederationPeer) ─▶ RaftTransport, FederationPeer
//!     ─▶ bootstrap (smallest --peers id with --bootstrap initializes; restarts recover)
//!        ─▶ once leader and the terms are unset: FedCommand::Init { terms }
//!     ─▶ leader loops: dispatch pass, lease expiry (see `loops`)
//!  shutdown ─▶ loops stop ─▶ client listener drains ─▶ raft stops ─▶ peer listener closes (bounded)
//! ```

use crate::node::Node;
use serde::Deserialize;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use suanli_proto::v1::federation_peer_server::FederationPeerServer;
use suanli_proto::v1::federation_server::FederationServer;
use suanli_raft::{RaftService, ServerNode};
use suanli_security::policy::Listener;
use suanli_security::tls::{self, ClientAuth, Tls};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;

/// What starts the line `suanli federation serve` prints on stdout once it listens.
pub const LINE_PREFIX: &str = "suanli federation listening";

/// A federation server's configuration (flags of `suanli federation serve`, or its TOML file).
#[derive(Debug, Clone)]
pub struct FederationServerConfig {
    /// Its raft id.
    pub id: u64,
    /// Its RocksDB directory.
    pub data_dir: PathBuf,
    /// Client listener (`Federation`); port 0 picks one (printed on start).
    pub listen: String,
    /// Peer listener (`RaftTransport`, `FederationPeer`).
    pub peer_listen: String,
    /// HTTP listener (`/metrics`): `None` is the client port + 2 (port 0 stays 0), `"off"`
    /// serves none.
    pub http_listen: Option<String>,
    /// The initial voters, `id=client/peer` (as `suanli server --peers`).
    pub peers: Vec<(u64, String, String)>,
    /// Initialize the group when storage is empty (the smallest peer id does it).
    pub bootstrap: bool,
    /// Directory with ca.pem, server.pem, server-key.pem (None with `insecure`).
    pub tls_dir: Option<PathBuf>,
    /// Plaintext, no authorization (development only).
    pub insecure: bool,
    /// The terms written at bootstrap.
    pub terms: crate::FedConfig,
    /// How often the leader runs a dispatch pass (also after each submit and sync).
    pub dispatch_interval_ms: u64,
    /// How often the leader checks for ended leases.
    pub expire_interval_ms: u64,
    /// Largest request accepted.
    pub max_request_bytes: usize,
    /// Deadline of each request.
    pub request_timeout_ms: u64,
    /// Raft timing and limits (group "federation").
    pub raft: suanli_raft::RaftSettings,
}

impl Default for FederationServerConfig {
    fn default() -> Self {
        FederationServerConfig {
            id: 1,
            data_dir: PathBuf::from("data/federation"),
            listen: "127.0.0.1:7600".into(),
            peer_listen: "127.0.0.1:7601".into(),
            http_listen: None,
            peers: Vec::new(),
            bootstrap: false,
            tls_dir: None,
            insecure: false,
            terms: crate::FedConfig::default(),
            dispatch_interval_ms: 250,
            expire_interval_ms: 500,
            max_request_bytes: 4 * 1024 * 1024,
            request_timeout_ms: 10_000,
            raft: raft_settings(),
        }
    }
}

/// The raft settings of the federation's group: the defaults, group "federation".
pub fn raft_settings() -> suanli_raft::RaftSettings {
    suanli_raft::RaftSettings { group: crate::GROUP.into(), ..suanli_raft::RaftSettings::default() }
}

/// The TOML file of `suanli federation serve --config FILE`. Unknown keys are refused, naming
/// them.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    /// Raft id.
    pub id: Option<u64>,
    /// RocksDB directory.
    pub data_dir: Option<PathBuf>,
    /// Client listener.
    pub listen: Option<String>,
    /// Peer listener.
    pub peer_listen: Option<String>,
    /// HTTP listener (`/metrics`), or "off".
    pub http_listen: Option<String>,
    /// Initial voters, `ID=CLIENT[/PEER]`.
    pub peers: Option<Vec<String>>,
    /// Initialize a new group when storage is empty.
    pub bootstrap: Option<bool>,
    /// TLS directory.
    pub tls_dir: Option<PathBuf>,
    /// Plaintext.
    pub insecure: Option<bool>,
    /// Dispatch pass period.
    pub dispatch_interval_ms: Option<u64>,
    /// Lease-expiry check period.
    pub expire_interval_ms: Option<u64>,
    /// Largest request.
    pub max_request_bytes: Option<usize>,
    /// Request deadline.
    pub request_timeout_ms: Option<u64>,
    /// The federation's terms (written at bootstrap).
    pub terms: Option<crate::FedConfig>,
    /// Raft settings (the group is always "federation").
    pub raft: Option<suanli_raft::RaftSettings>,
}

impl FederationServerConfig {
    /// Reads `path` (TOML, [`FileConfig`]) over the defaults; an error names the file and the
    /// key (an unknown key is refused).
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("config {}: {e}", path.display()))?;
        Self::from_toml(&text).map_err(|e| format!("config {}: {e}", path.display()))
    }

    /// [`FederationServerConfig::from_file`] of the text.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let f: FileConfig = toml::from_str(text).map_err(|e| e.message().to_owned())?;
        let mut c = FederationServerConfig::default();
        if let Some(v) = f.id {
            c.id = v;
        }
        if let Some(v) = f.data_dir {
            c.data_dir = v;
        }
        if let Some(v) = f.listen {
            c.listen = v;
        }
        if let Some(v) = f.peer_listen {
            c.peer_listen = v;
        }
        if let Some(v) = f.http_listen {
            c.http_listen = Some(v);
        }
        if let Some(v) = f.peers {
            c.peers = v.iter().map(|p| parse_peer(p)).collect::<Result<_, _>>()?;
        }
        if let Some(v) = f.bootstrap {
            c.bootstrap = v;
        }
        if let Some(v) = f.tls_dir {
            c.tls_dir = Some(v);
        }
        if let Some(v) = f.insecure {
            c.insecure = v;
        }
        if let Some(v) = f.dispatch_interval_ms {
            c.dispatch_interval_ms = v;
        }
        if let Some(v) = f.expire_interval_ms {
            c.expire_interval_ms = v;
        }
        if let Some(v) = f.max_request_bytes {
            c.max_request_bytes = v;
        }
        if let Some(v) = f.request_timeout_ms {
            c.request_timeout_ms = v;
        }
        if let Some(v) = f.terms {
            c.terms = v;
        }
        if let Some(v) = f.raft {
            c.raft = suanli_raft::RaftSettings { group: crate::GROUP.into(), ..v };
        }
        Ok(c)
    }

    /// Where the HTTP listener binds: `http_listen`, or the client listener's port + 2 (port 0
    /// stays 0); `None` when it is `"off"`.
    pub fn http_addr(&self) -> Result<Option<String>, String> {
        match self.http_listen.as_deref() {
            Some("off") => Ok(None),
            Some(a) => Ok(Some(a.to_owned())),
            None => {
                let (host, port) = self
                    .listen
                    .rsplit_once(':')
                    .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h, p)))
                    .ok_or_else(|| format!("listen: {:?} is not HOST:PORT", self.listen))?;
                let http = if port == 0 {
                    0
                } else {
                    port.checked_add(2).ok_or_else(|| {
                        format!("http_listen: the client port {port} + 2 is above 65535; set http_listen")
                    })?
                };
                Ok(Some(format!("{host}:{http}")))
            }
        }
    }

    /// Checks the fields (the error names the field and the limit).
    pub fn validate(&self) -> Result<(), String> {
        if self.id == 0 {
            return Err("id: must be >= 1".into());
        }
        self.http_addr()?;
        if self.tls_dir.is_none() && !self.insecure {
            return Err("tls_dir: required (or --insecure for a plaintext development server)".into());
        }
        if self.tls_dir.is_some() && self.insecure {
            return Err("insecure: cannot be combined with tls_dir".into());
        }
        if self.dispatch_interval_ms == 0 || self.dispatch_interval_ms > 60_000 {
            return Err(format!("dispatch_interval_ms: {} is out of range 1..=60000", self.dispatch_interval_ms));
        }
        if self.expire_interval_ms == 0 || self.expire_interval_ms > 60_000 {
            return Err(format!("expire_interval_ms: {} is out of range 1..=60000", self.expire_interval_ms));
        }
        if self.max_request_bytes < 1024 || self.max_request_bytes > 64 * 1024 * 1024 {
            return Err(format!("max_request_bytes: {} is out of range 1024..=67108864", self.max_request_bytes));
        }
        if self.request_timeout_ms < 100 || self.request_timeout_ms > 600_000 {
            return Err(format!("request_timeout_ms: {} is out of range 100..=600000", self.request_timeout_ms));
        }
        let mut ids = std::collections::BTreeSet::new();
        for (id, _, _) in &self.peers {
            if *id == 0 || !ids.insert(*id) {
                return Err(format!("peers: id {id} is zero or listed twice"));
            }
        }
        if !self.peers.is_empty() && !ids.contains(&self.id) {
            return Err(format!("peers: this server's id {} is not among them", self.id));
        }
        self.terms.validate().map_err(|e| format!("terms: {e}"))?;
        self.raft.validate().map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// Reads one `--peers` entry: `ID=HOST:PORT[/PEER_HOST:PEER_PORT]` (the peer address defaults
/// to the client port + 1, as `suanli server --peers`).
pub fn parse_peer(s: &str) -> Result<(u64, String, String), String> {
    let bad = || format!("peers: {s:?} is not ID=HOST:PORT[/PEER_HOST:PEER_PORT] (e.g. 2=10.0.0.2:7600/10.0.0.2:7601)");
    let (id, addr) = s.split_once('=').ok_or_else(bad)?;
    let id: u64 = id.trim().parse().map_err(|_| bad())?;
    let (client, peer) = match addr.split_once('/') {
        Some((a, p)) => (a.trim().to_owned(), p.trim().to_owned()),
        None => {
            let a = addr.trim().to_owned();
            let (host, port) = a.rsplit_once(':').ok_or_else(bad)?;
            let port: u16 = port.parse().map_err(|_| bad())?;
            let next = port.checked_add(1).ok_or_else(bad)?;
            (a.clone(), format!("{host}:{next}"))
        }
    };
    if client.is_empty() || peer.is_empty() || id == 0 {
        return Err(bad());
    }
    Ok((id, client, peer))
}

/// The addresses a federation server listens on, once bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// The client listener.
    pub client: std::net::SocketAddr,
    /// The peer listener.
    pub peer: std::net::SocketAddr,
    /// The HTTP listener (`/metrics`), unless `http_listen = "off"`.
    pub http: Option<std::net::SocketAddr>,
}

impl Bound {
    /// `suanli federation listening client=A peer=B[ http=C]`.
    pub fn line(&self) -> String {
        let http = self.http.map(|h| format!(" http={h}")).unwrap_or_default();
        format!("{LINE_PREFIX} client={} peer={}{http}", self.client, self.peer)
    }

    /// Reads a [`Bound::line`]; `None` for any other line.
    pub fn parse_line(line: &str) -> Option<Bound> {
        let rest = line.trim().strip_prefix(LINE_PREFIX)?;
        let (mut client, mut peer, mut http) = (None, None, None);
        for word in rest.split_whitespace() {
            if let Some(a) = word.strip_prefix("client=") {
                client = a.parse().ok();
            } else if let Some(a) = word.strip_prefix("peer=") {
                peer = a.parse().ok();
            } else if let Some(a) = word.strip_prefix("http=") {
                http = a.parse().ok();
            }
        }
        Some(Bound { client: client?, peer: peer?, http })
    }
}

/// Runs a federation server until `shutdown` resolves (SIGTERM in the CLI). Prints
/// `suanli federation listening client=ADDR peer=ADDR` once both listeners are bound.
pub async fn serve(
    cfg: FederationServerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    cfg.validate()?;
    let client = TcpListener::bind(&cfg.listen).await.map_err(|e| format!("listen {}: {e}", cfg.listen))?;
    let peer =
        TcpListener::bind(&cfg.peer_listen).await.map_err(|e| format!("peer_listen {}: {e}", cfg.peer_listen))?;
    serve_on(client, peer, cfg, shutdown).await
}

/// [`serve`] on listeners the caller bound (tests bind `127.0.0.1:0` first so the peers know
/// each other's addresses). Prints the listening line too.
pub async fn serve_on(
    client: TcpListener,
    peer: TcpListener,
    mut cfg: FederationServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    cfg.validate()?;
    cfg.raft.group = crate::GROUP.into();
    let http = match cfg.http_addr()? {
        Some(a) => Some(TcpListener::bind(&a).await.map_err(|e| format!("http_listen {a}: {e}"))?),
        None => None,
    };
    let bound = Bound {
        client: client.local_addr().map_err(|e| format!("listen: {e}"))?,
        peer: peer.local_addr().map_err(|e| format!("peer_listen: {e}"))?,
        http: http.as_ref().map(|h| h.local_addr()).transpose().map_err(|e| format!("http_listen: {e}"))?,
    };
    cfg.listen = bound.client.to_string();
    cfg.peer_listen = bound.peer.to_string();
    // This server's own entry in `peers` may give port 0 (the system picks): the membership the
    // bootstrap writes, and the leader hints read from it, must carry the ports bound.
    let own = cfg.id;
    let (listen, peer_listen) = (cfg.listen.clone(), cfg.peer_listen.clone());
    for (_, c, p) in cfg.peers.iter_mut().filter(|(id, _, _)| *id == own) {
        if c.ends_with(":0") {
            c.clone_from(&listen);
        }
        if p.ends_with(":0") {
            p.clone_from(&peer_listen);
        }
    }
    std::fs::create_dir_all(&cfg.data_dir).map_err(|e| format!("data_dir {}: {e}", cfg.data_dir.display()))?;
    let tls = match &cfg.tls_dir {
        Some(dir) => Some(
            Tls::load(suanli_security::certs::paths(dir, "server"))
                .map_err(|e| format!("tls_dir {}: {e}", dir.display()))?,
        ),
        None => {
            tracing::warn!("--insecure: plaintext, no identities: anyone who reaches a port is admin");
            None
        }
    };
    let reloader = tls.as_ref().map(|t| AbortOnDrop(t.spawn_reloader(Duration::from_secs(10))));
    let settings = cfg.raft.clone();
    let (raft, state, _log) =
        suanli_raft::open_group::<crate::FedTypeConfig, crate::FedState>(&cfg.data_dir, cfg.id, &settings, tls.clone())
            .await
            .map_err(|e| e.to_string())?;
    let node = Arc::new(Node::new(cfg.clone(), raft.clone(), state, tls.clone()));
    let max = cfg.max_request_bytes;
    let (health_reporter, health_server) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<FederationServer<crate::service::FedApi>>().await;
    let access = crate::access::AccessLayer::new(cfg.insecure);
    let api = crate::service::FedApi(node.clone());
    let clients = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .timeout(Duration::from_millis(cfg.request_timeout_ms))
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .layer(access.for_listener(Listener::Federation))
        .add_service(
            FederationServer::new(api.clone())
                .max_decoding_message_size(max.saturating_add(64 * 1024))
                .max_encoding_message_size(max.saturating_mul(4)),
        )
        .add_service(health_server.clone());
    let peers = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .layer(access.for_listener(Listener::FederationPeer))
        .add_service(RaftService::new(raft.clone(), &settings).into_server(&settings))
        .add_service(
            FederationPeerServer::new(api)
                .max_decoding_message_size(settings.max_message_bytes)
                .max_encoding_message_size(settings.max_message_bytes),
        )
        .add_service(health_server);

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = vec![
        tokio::spawn(bootstrap(node.clone(), stop_rx.clone())),
        tokio::spawn(crate::loops::dispatching(node.clone(), stop_rx.clone())),
        tokio::spawn(crate::loops::expiring(node.clone(), stop_rx.clone())),
    ];
    {
        use std::io::Write as _;
        // A closed stdout (a supervisor discarding it) is no reason not to serve.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", bound.line()).and_then(|()| out.flush());
    }
    tracing::info!(id = cfg.id, client = %bound.client, peer = %bound.peer, data_dir = %cfg.data_dir.display(), tls = tls.is_some(), "suanli federation listening");

    let (done_tx, done_rx) = watch::channel(false);
    let (peers_done_tx, peers_done_rx) = watch::channel(false);
    let until = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|d| *d).await;
    };
    let handshake = Duration::from_secs(10);
    // The HTTP listener (`/metrics`): TLS with the server certificate (a client certificate
    // optional there, required by the handler), plaintext under --insecure.
    let http_task = http.map(|listener| {
        let (router, tls, done) = (crate::metrics::routes(node.clone()), tls.clone(), done_rx.clone());
        AbortOnDrop(tokio::spawn(async move {
            if let Err(e) = suanli_security::http::serve(listener, tls, handshake, router, until(done)).await {
                tracing::warn!(error = %e, "the HTTP listener stopped");
            }
        }))
    });
    let mut listeners = tokio::spawn(async move {
        let (a, b) = match tls {
            Some(tls) => {
                tokio::join!(
                    clients.serve_with_incoming_shutdown(
                        tls::incoming(client, tls.clone(), ClientAuth::Optional, handshake),
                        until(done_rx)
                    ),
                    peers.serve_with_incoming_shutdown(
                        tls::incoming(peer, tls, ClientAuth::Required, handshake),
                        until(peers_done_rx)
                    ),
                )
            }
            None => tokio::join!(
                clients.serve_with_incoming_shutdown(TcpListenerStream::new(client), until(done_rx)),
                peers.serve_with_incoming_shutdown(TcpListenerStream::new(peer), until(peers_done_rx)),
            ),
        };
        a.and(b)
    });
    let mut metrics = raft.metrics();
    let ended: Option<String> = tokio::select! {
        () = shutdown => {
            tracing::info!("shutdown requested: stepping down");
            None
        }
        why = raft_stopped(&mut metrics) => {
            tracing::error!(error = %why, "raft stopped; the federation server exits");
            Some(format!("raft stopped: {why}"))
        }
        r = &mut listeners => Some(match r {
            Ok(Err(e)) => format!("grpc: {e}"),
            Ok(Ok(())) => "the listeners stopped".into(),
            Err(e) => format!("the listeners' task: {e}"),
        }),
    };
    // 1. The loops stop: no dispatch or expiry from a server on its way out.
    let _ = stop_tx.send(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    for mut t in tasks.drain(..) {
        if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
            t.abort();
        }
    }
    // 2. Clients go elsewhere.
    let _ = done_tx.send(true);
    // 3. Raft stops (bounded), then the peer listener closes.
    match tokio::time::timeout(Duration::from_secs(5), raft.shutdown()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "raft shutdown"),
        Err(_) => tracing::warn!("raft did not shut down within 5 s; going on"),
    }
    let _ = peers_done_tx.send(true);
    match tokio::time::timeout(Duration::from_secs(2), &mut listeners).await {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "listeners"),
        Ok(_) => {}
        Err(_) => listeners.abort(),
    }
    drop(http_task);
    drop(reloader);
    tracing::info!("shutdown: done");
    match ended {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// First start: the smallest id of `peers` (or a lone server) with `bootstrap` initializes the
/// group; later starts recover from storage. Then, whenever this server leads a group whose
/// terms are unset, it writes [`crate::FedCommand::Init`] with its configured terms.
async fn bootstrap(node: Arc<Node>, mut stop: watch::Receiver<bool>) {
    let initialized = match node.raft.is_initialized().await {
        Ok(i) => i,
        Err(e) => {
            tracing::error!(error = %e, "raft stopped");
            return;
        }
    };
    let cfg = &node.cfg;
    if !initialized && cfg.bootstrap {
        let smallest = cfg.peers.iter().map(|p| p.0).min().unwrap_or(cfg.id);
        if smallest == cfg.id {
            let members: std::collections::BTreeMap<u64, ServerNode> = if cfg.peers.is_empty() {
                [(cfg.id, ServerNode::new(cfg.peer_listen.clone(), cfg.listen.clone()))].into()
            } else {
                cfg.peers.iter().map(|(id, c, p)| (*id, ServerNode::new(p.clone(), c.clone()))).collect()
            };
            match node.raft.initialize(members).await {
                Ok(()) => tracing::info!("initialized a new federation group (bootstrap)"),
                Err(e) => tracing::info!(error = %e, "not initializing (already initialized?)"),
            }
        } else {
            tracing::info!(id = cfg.id, bootstrapper = smallest, "waiting for the bootstrapping peer");
        }
    } else if !initialized {
        tracing::info!(id = cfg.id, "empty storage and no --bootstrap: waiting to be added to a federation group");
    }
    // The terms, once, by whoever leads first.
    let mut m = node.raft.metrics();
    loop {
        if node.is_leader() && node.state.read(|s| s.config.is_none()) {
            let cmd = crate::FedCommand::Init { config: cfg.terms.clone() };
            match node.propose_local(cmd).await.and_then(crate::node::answer) {
                Ok(_) => {
                    tracing::info!("federation terms written (Init)");
                    return;
                }
                Err(e) if e.code() == tonic::Code::InvalidArgument => {
                    tracing::error!(error = %e.message(), "the federation's terms were refused; the defaults stay in force");
                    return;
                }
                Err(e) => tracing::warn!(error = %e.message(), "writing the federation terms; retrying"),
            }
        } else if node.state.read(|s| s.config.is_some()) {
            return;
        }
        tokio::select! {
            r = m.changed() => if r.is_err() { return },
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Aborts its task when dropped.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_like_the_region_servers() {
        assert_eq!(parse_peer("2=10.0.0.2:7600").expect("ok"), (2, "10.0.0.2:7600".into(), "10.0.0.2:7601".into()));
        assert_eq!(parse_peer("3=a:1/b:2").expect("ok"), (3, "a:1".into(), "b:2".into()));
        assert!(parse_peer("x=a:1").expect_err("bad").starts_with("peers:"));
        assert!(parse_peer("0=a:1").is_err());
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = FederationServerConfig::from_toml("id = 2\nbogus_key = 1\n").expect_err("unknown");
        assert!(e.contains("bogus_key"), "{e}");
        let c = FederationServerConfig::from_toml("id = 2\n[terms]\nlease_ms = 30000\n").expect("ok");
        assert_eq!((c.id, c.terms.lease_ms), (2, 30_000));
    }

    #[test]
    fn http_listens_beside_the_client_port_unless_off() {
        let mut c = FederationServerConfig { listen: "10.0.0.1:7600".into(), ..Default::default() };
        assert_eq!(c.http_addr(), Ok(Some("10.0.0.1:7602".into())));
        c.listen = "127.0.0.1:0".into();
        assert_eq!(c.http_addr(), Ok(Some("127.0.0.1:0".into())));
        c.http_listen = Some("off".into());
        assert_eq!(c.http_addr(), Ok(None));
        c.http_listen = None;
        c.listen = "h:65534".into();
        assert!(c.http_addr().expect_err("too high").starts_with("http_listen:"));
    }

    #[test]
    fn the_line_round_trips() {
        let b = Bound { client: ([127, 0, 0, 1], 1).into(), peer: ([127, 0, 0, 1], 2).into(), http: None };
        assert_eq!(Bound::parse_line(&b.line()), Some(b));
        let h = Bound { http: Some(([127, 0, 0, 1], 3).into()), ..b };
        assert!(h.line().ends_with(" http=127.0.0.1:3"), "{}", h.line());
        assert_eq!(Bound::parse_line(&h.line()), Some(h));
        assert_eq!(Bound::parse_line("suanli server listening client=127.0.0.1:1 peer=127.0.0.1:2"), None);
    }
}

/// What `suanli federation recover` wrote.
#[derive(Debug, Clone)]
pub struct Recovered {
    /// The log index of the source the state includes.
    pub source_last_applied: u64,
    /// Set when the source's log holds an entry this build could not apply (state before it).
    pub halted_at: Option<u64>,
    /// Federated jobs, regions and quotas in the recovered state.
    pub jobs: usize,
    /// Regions in the directory.
    pub regions: usize,
    /// Global quotas.
    pub quotas: usize,
}

/// Recovery from a lost majority (offline, the servers stopped): reads a stopped federation
/// server's data dir `old` (never changed; its snapshot, then every entry of its log applied)
/// and writes a NEW data dir `new` (absent or empty) holding that state with a fresh log and
/// server `id` at `node` as the only voter. `suanli federation serve --data-dir NEW --id ID ...`
/// then starts a one-voter federation with the old jobs, leases, quotas and regions; add the
/// other voters with `add-server`. The same tools as a region's `cluster restore --from-data-dir`.
pub async fn recover_data_dir(
    old: &std::path::Path,
    new: &std::path::Path,
    id: u64,
    node: suanli_raft::ServerNode,
) -> Result<Recovered, String> {
    if id == 0 {
        return Err("id: must be >= 1".into());
    }
    let rec = suanli_raft::restore::read_data_dir::<crate::FedTypeConfig, crate::FedState>(old)
        .await
        .map_err(|e| format!("from_data_dir {}: {e}", old.display()))?;
    let state =
        crate::FedState::restore(&rec.state).map_err(|e| format!("from_data_dir {}: the state: {e}", old.display()))?;
    suanli_raft::restore::write_data_dir(new, id, node, &rec.state)
        .map_err(|e| format!("data_dir {}: {e}", new.display()))?;
    Ok(Recovered {
        source_last_applied: rec.last_applied.map_or(0, |l| l.index),
        halted_at: rec.halt.map(|h| h.index),
        jobs: state.jobs.len(),
        regions: state.regions.len(),
        quotas: state.quotas.len(),
    })
}
