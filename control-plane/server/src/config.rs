//! The server's configuration: a TOML file, with flags and environment variables over it (the
//! `suanli server` command does the layering), validated with errors naming the field.

use crate::watchers::WatchLimits;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use suanli_raft::RaftSettings;
use suanli_security::tls::TlsFiles;
use thiserror::Error;

/// Default of [`ServerConfig::max_token_ttl_s`]: 90 days.
pub const DEFAULT_MAX_TOKEN_TTL_S: u64 = 90 * 24 * 3_600;

/// Default of [`ServerConfig::max_list_bytes`]: 4 MiB less 64 KiB, so a page with its framing
/// fits the 4 MiB receive limit of gRPC clients left at their defaults.
pub const DEFAULT_MAX_LIST_BYTES: usize = 4 * 1024 * 1024 - 64 * 1024;

/// One initial voter of a fresh cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    /// Raft id (>= 1, unique).
    pub id: u64,
    /// Its client address `host:port` (clients and agents).
    pub addr: String,
    /// Its peer address `host:port` (raft, forwarding). Default: `addr` with the port + 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_addr: Option<String>,
}

impl Peer {
    /// Parses `ID=HOST:PORT` or `ID=HOST:PORT/PEER_HOST:PEER_PORT`.
    pub fn parse(s: &str) -> Result<Peer, ConfigError> {
        let bad = || {
            ConfigError::new(
                "peers",
                format!("{s:?} is not ID=HOST:PORT[/PEER_HOST:PEER_PORT] (e.g. 2=10.0.0.2:7400/10.0.0.2:7401)"),
            )
        };
        let (id, addr) = s.split_once('=').ok_or_else(bad)?;
        let id: u64 = id.trim().parse().map_err(|_| bad())?;
        let (addr, peer_addr) = match addr.split_once('/') {
            Some((a, p)) => (a.trim().to_owned(), Some(p.trim().to_owned())),
            None => (addr.trim().to_owned(), None),
        };
        if addr.is_empty() || peer_addr.as_ref().is_some_and(String::is_empty) {
            return Err(bad());
        }
        Ok(Peer { id, addr, peer_addr })
    }

    /// Its peer address (given, or the client address's port + 1).
    pub fn peer(&self) -> Result<String, ConfigError> {
        match &self.peer_addr {
            Some(p) => Ok(p.clone()),
            None => next_port(&self.addr).ok_or_else(|| {
                ConfigError::new(
                    "peers",
                    format!("{:?}: cannot derive a peer address (port + 1); give ID=CLIENT/PEER", self.addr),
                )
            }),
        }
    }
}

/// `host:port` with the port + 1 (port 0 stays 0: the system picks); `None` when `addr` has
/// no numeric port or it is 65535. The default peer listener is the client listener's next port.
pub fn next_port(addr: &str) -> Option<String> {
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let next = if port == 0 { 0 } else { port.checked_add(1)? };
    Some(format!("{host}:{next}"))
}

/// Whether `addr` ends in port 0 (the system picks the port when it is bound).
fn port_is_zero(addr: &str) -> bool {
    addr.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>() == Ok(0))
}

/// Everything a server needs. Defaults are a single server on `127.0.0.1:7400`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// This server's raft id (>= 1, unique in the cluster, never reused for another server).
    pub id: u64,
    /// Where the raft log, the snapshots and the state live (RocksDB).
    pub data_dir: PathBuf,
    /// The client listener (`host:port`; port 0 picks one): the public API (`Jobs`, `Queues`,
    /// `Pools`, `Nodes`, `Cluster`), agents, health and reflection.
    pub listen: String,
    /// Address clients and agents use to reach this one (default: `listen`).
    pub advertise: Option<String>,
    /// The peer listener: raft and the server-to-server `Internal` service (forwarded writes,
    /// read indexes), never the client API. Default: `listen`'s address with the port + 1.
    /// Keep it on a network only servers reach.
    pub peer_listen: Option<String>,
    /// Address other servers use to reach this one's peer listener (default: `peer_listen`).
    pub peer_advertise: Option<String>,
    /// The HTTP listener (`/metrics`, the dashboard; docs/metrics.md, docs/dashboard.md):
    /// TLS with the server's certificate unless `insecure`. Default: `listen`'s address with
    /// the port + 2; `"off"` serves none.
    pub http_listen: Option<String>,
    /// Initial voters of a fresh cluster (this server among them). With `bootstrap`, the
    /// smallest id initializes the cluster on first start; later starts ignore this list
    /// (membership lives in raft). Empty, with `bootstrap`: a single-server cluster.
    pub peers: Vec<Peer>,
    /// Create a new cluster when the storage is empty (with `peers`: only the smallest id does).
    /// Without it a server with empty storage never creates a cluster: it waits to be added
    /// (`suanli cluster add-server`) or joins (`join`), so a wiped server restarted with its
    /// original flags cannot start a second cluster on the same addresses. Even with it, a
    /// server refuses to initialize while any listed peer already answers as part of a cluster.
    pub bootstrap: bool,
    /// Join a running cluster through any of its servers instead (added as learner, then voter).
    pub join: Option<String>,
    /// With `join`: stay a non-voting learner.
    pub learner_only: bool,
    /// Raft timing and limits.
    pub raft: RaftSettings,
    /// Largest client or agent request decoded, in bytes (RESOURCE_EXHAUSTED above it).
    pub max_request_bytes: usize,
    /// How long a write waits for its commit (and a read for its read index) before
    /// DEADLINE_EXCEEDED.
    pub request_timeout_ms: u64,
    /// Longest pause between two scheduling passes while jobs wait (a submission or a freed
    /// allocation wakes the loop earlier).
    pub schedule_interval_ms: u64,
    /// Shortest gap between two passes: under a stream of submissions the loop places what
    /// queued during the gap in one pass and one plan, instead of a pass per submission.
    pub schedule_min_gap_ms: u64,
    /// Seed of the scheduling engine's tie-breaking (mixed with the applied log index, so a
    /// pass replays exactly from the log).
    pub scheduler_seed: u64,
    /// Placement policy (`suanli`, `fgd`, `bestfit`, ...).
    pub policy: String,
    /// Most jobs considered in one scheduling pass.
    pub max_jobs_per_pass: usize,
    /// How often agents heartbeat.
    pub heartbeat_interval_ms: u64,
    /// A node without a heartbeat for this long is declared down (its work is requeued).
    pub heartbeat_ttl_ms: u64,
    /// Most open `Agent.WatchAllocations` streams: a pool of their own, so clients can never
    /// take the slots agents need to get work. One per node (a re-connecting agent takes its
    /// old stream's slot over), so it only needs to cover the cluster's nodes.
    pub max_agent_watchers: usize,
    /// Most open client `Jobs.Watch` streams, all connections together (`max_watchers` in
    /// older configuration files, which then bounded agents' streams too).
    #[serde(alias = "max_watchers")]
    pub max_client_watchers: usize,
    /// Most client watch streams on one connection (a peer's `ip:port`), so one client cannot
    /// take the whole client pool.
    pub max_watchers_per_connection: usize,
    /// Most items one list page returns (a request's `limit` can only lower it).
    pub max_list: u32,
    /// Most encoded bytes of the items of one list page: a page ends before the item that would
    /// go over it (and holds at least one). The default leaves room under the 4 MiB that gRPC
    /// clients accept by default; it must stay below the reply limit, 4 x `max_request_bytes`.
    pub max_list_bytes: usize,
    /// Most requests in flight on one connection.
    pub max_concurrent_per_connection: usize,
    /// On SIGTERM: how long a leader waits for another server to take over before it goes
    /// anyway (the others then elect one within an election timeout).
    pub leader_handoff_ms: u64,
    /// On SIGTERM: how long the listeners let open requests finish before the remaining
    /// connections (agent watch streams, idle HTTP/2 connections) are closed.
    pub shutdown_grace_ms: u64,
    /// Most the leader's wall clock may differ from the median of its followers' before it
    /// stops acting on its own clock (docs/control-plane.md, "Clocks"); also how far the
    /// cluster's time may run ahead of that median.
    pub max_clock_skew_ms: u64,
    /// The clock drift bound ρ, in thousandths: the most the leader's clock rate may differ
    /// from its followers' (measured), and the most any clock is assumed to drift when the
    /// heartbeat TTL is checked against an agent's fence.
    pub max_clock_drift_permille: u64,
    /// How often the leader samples its followers' clocks (`Internal.Clock`).
    pub clock_check_interval_ms: u64,
    /// The TLS material of every link (`[tls]`: `ca`, `cert`, `key`, PEM files): the client
    /// listener asks for a client certificate (optional: token holders come without one), the
    /// peer listener requires one, and this server presents `cert` as its client certificate
    /// to the other servers. Required unless `insecure`.
    pub tls: Option<TlsFiles>,
    /// Serve plaintext with no identities (anyone who reaches a port is admin): only for a
    /// cluster on a trusted network or a throwaway test; a warning is logged at every start.
    pub insecure: bool,
    /// How often the TLS files are checked for a change (a changed file is reloaded; SIGHUP
    /// reloads at once). New connections use the new certificate; open ones keep theirs.
    pub tls_reload_interval_ms: u64,
    /// Longest TLS handshake a listener waits for (a connection still handshaking then is
    /// dropped); handshakes run concurrently, so a slow one holds no other.
    pub tls_handshake_timeout_ms: u64,
    /// Longest lifetime of a bearer token `Access.CreateToken` signs, in seconds (default 90
    /// days; at most 10 years).
    pub max_token_ttl_s: u64,
    /// Calls per second one user (by identity) or one anonymous address may make on the client
    /// listener, sustained; above it a call answers RESOURCE_EXHAUSTED. Nodes, servers and
    /// callers of an `insecure` server are not limited. 0: no limit (docs/security.md).
    pub rate_limit_per_s: u32,
    /// Calls one caller may make at once above `rate_limit_per_s` (the token bucket's size).
    pub rate_limit_burst: u32,
    /// This region's link to a federation (`[federation]`; docs/federation.md). None: a
    /// standalone region (every `--global` submit is refused).
    pub federation: Option<FederationLink>,
}

/// `[federation]`: which region this server's cluster is, and where the federation is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FederationLink {
    /// The region's name (1..=64 bytes of `[a-z0-9-]`), the same on all its servers.
    pub region: String,
    /// The federation servers' client addresses (`suanli federation serve`), at least one.
    pub endpoints: Vec<String>,
    /// The region's labels, for data-locality preferences (e.g. `data = "imagenet-eu"`).
    pub labels: std::collections::BTreeMap<String, String>,
    /// Price per device-hour by device model, in micro-units (reported with the capacity).
    pub prices_micros_per_device_hour: std::collections::BTreeMap<String, u64>,
    /// Deadline of one call to the federation.
    pub request_timeout_ms: u64,
}

impl Default for FederationLink {
    fn default() -> Self {
        Self {
            region: String::new(),
            endpoints: Vec::new(),
            labels: Default::default(),
            prices_micros_per_device_hour: Default::default(),
            request_timeout_ms: 2_000,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            id: 1,
            data_dir: PathBuf::from("suanli-data"),
            listen: "127.0.0.1:7400".into(),
            advertise: None,
            peer_listen: None,
            http_listen: None,
            peer_advertise: None,
            peers: Vec::new(),
            bootstrap: false,
            join: None,
            learner_only: false,
            raft: RaftSettings::default(),
            max_request_bytes: suanli_proto::DEFAULT_MAX_MESSAGE_BYTES,
            request_timeout_ms: 10_000,
            schedule_interval_ms: 200,
            schedule_min_gap_ms: 50,
            scheduler_seed: 0x5EED,
            policy: "suanli".into(),
            max_jobs_per_pass: 5_000,
            heartbeat_interval_ms: 1_000,
            heartbeat_ttl_ms: 10_000,
            max_agent_watchers: 10_000,
            max_client_watchers: 1_024,
            max_watchers_per_connection: 16,
            max_list: 10_000,
            max_list_bytes: DEFAULT_MAX_LIST_BYTES,
            max_concurrent_per_connection: 1_024,
            leader_handoff_ms: 2_000,
            shutdown_grace_ms: 5_000,
            max_clock_skew_ms: 500,
            max_clock_drift_permille: 50,
            clock_check_interval_ms: 500,
            tls: None,
            insecure: false,
            tls_reload_interval_ms: 5_000,
            tls_handshake_timeout_ms: 10_000,
            max_token_ttl_s: DEFAULT_MAX_TOKEN_TTL_S,
            rate_limit_per_s: 200,
            rate_limit_burst: 400,
            federation: None,
        }
    }
}

/// A configuration value out of bounds, or an unreadable file.
#[derive(Debug, Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    /// The field (dotted path).
    pub field: String,
    /// What is wrong and what would be valid.
    pub message: String,
}

impl ConfigError {
    fn new(field: &str, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

fn range(field: &str, v: u64, lo: u64, hi: u64) -> Result<(), ConfigError> {
    if v < lo || v > hi {
        return Err(ConfigError::new(field, format!("{v} is out of range; must be {lo}..={hi}")));
    }
    Ok(())
}

impl ServerConfig {
    /// Reads a TOML file (unknown keys are errors).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("config", format!("{}: {e}", path.display())))?;
        Self::from_toml(&text)
            .map_err(|e| ConfigError { message: format!("{} (in {})", e.message, path.display()), ..e })
    }

    /// Parses TOML text strictly: an unknown key in any table (`[raft]` included) is an error
    /// naming its dotted path, e.g. `raft.heartbeat_ms`.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let de = toml::de::Deserializer::parse(text).map_err(|e| ConfigError::new("config", e.to_string()))?;
        suanli_model::input::decode(de).map_err(|e| {
            // Tables that deny unknown fields themselves fail inside the parser (with TOML's
            // snippet); the others are caught by the strict decoder. One message for both.
            let message = if e.message == suanli_model::input::UNKNOWN_FIELD || e.message.contains("unknown field `") {
                "unknown key; not a server setting (a misspelled key is refused, not ignored; see docs/control-plane.md)"
                    .to_owned()
            } else {
                e.message
            };
            ConfigError::new(if e.field.is_empty() { "config" } else { &e.field }, message)
        })
    }

    /// The server's files in a directory of `suanli tls init`'s layout (`--tls-dir DIR`):
    /// DIR/ca.pem, DIR/server.pem, DIR/server-key.pem.
    pub fn tls_files_in(dir: &Path) -> TlsFiles {
        suanli_security::certs::paths(dir, "server")
    }

    /// Largest reply a client-facing service encodes (4 x `max_request_bytes`): lists return
    /// whole records, several of which may each be as large as the request that created them.
    pub fn max_reply_bytes(&self) -> usize {
        self.max_request_bytes.saturating_mul(4)
    }

    /// The address clients and agents reach this server at.
    pub fn advertised(&self) -> &str {
        self.advertise.as_deref().unwrap_or(&self.listen)
    }

    /// The peer listener's address (given, or `listen` with the port + 1).
    pub fn peer_listen_addr(&self) -> String {
        self.peer_listen.clone().or_else(|| next_port(&self.listen)).unwrap_or_default()
    }

    /// The HTTP listener's address (given, or `listen` with the port + 2); `None` for `"off"`.
    pub fn http_listen_addr(&self) -> Option<String> {
        match self.http_listen.as_deref() {
            Some("off") => None,
            Some(a) => Some(a.to_owned()),
            None => next_port(&self.listen).and_then(|p| next_port(&p)).or_else(|| Some(String::new())),
        }
    }

    /// The address other servers reach this server's peer listener at.
    pub fn peer_advertised(&self) -> String {
        self.peer_advertise.clone().unwrap_or_else(|| self.peer_listen_addr())
    }

    /// This configuration as served from `bound` (the addresses its listeners got; port 0
    /// picks one): `listen` and `peer_listen` become the bound addresses, so what is
    /// advertised (unless `advertise` / `peer_advertise` say otherwise) is reachable; this
    /// server's own entry in `peers`, where it gives port 0, becomes its advertised addresses,
    /// so a new cluster's membership names the ports actually bound.
    pub fn bound_to(mut self, bound: &crate::Bound) -> ServerConfig {
        self.listen = bound.client.to_string();
        self.peer_listen = Some(bound.peer.to_string());
        self.http_listen = Some(bound.http.map_or_else(|| "off".to_owned(), |a| a.to_string()));
        let (addr, peer) = (self.advertised().to_owned(), self.peer_advertised());
        for p in self.peers.iter_mut().filter(|p| p.id == self.id) {
            let peer_zero = p.peer().is_ok_and(|a| port_is_zero(&a));
            if port_is_zero(&p.addr) {
                p.addr = addr.clone();
            }
            if peer_zero {
                p.peer_addr = Some(peer.clone());
            }
        }
        self
    }

    /// The bounds of the watch streams' slots.
    pub fn watch_limits(&self) -> WatchLimits {
        WatchLimits {
            agents: self.max_agent_watchers,
            clients: self.max_client_watchers,
            per_connection: self.max_watchers_per_connection,
        }
    }

    /// Checks every bound, and that the transport is chosen: `[tls]` or `insecure`, exactly one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_settings()?;
        self.validate_transport()
    }

    /// `[tls]` or `insecure`: one of them, not both.
    pub fn validate_transport(&self) -> Result<(), ConfigError> {
        match (&self.tls, self.insecure) {
            (None, false) => Err(ConfigError::new(
                "tls",
                "no TLS material: give [tls] ca, cert and key (`suanli tls init DIR` makes a development CA; then `suanli server --tls-dir DIR`), or serve plaintext with no identities with --insecure (insecure = true)",
            )),
            (Some(_), true) => Err(ConfigError::new(
                "tls",
                "both [tls] and insecure are given: drop insecure (TLS) or [tls] (plaintext)",
            )),
            (Some(t), false) => {
                for (what, p) in [("tls.ca", &t.ca), ("tls.cert", &t.cert), ("tls.key", &t.key)] {
                    if p.as_os_str().is_empty() {
                        return Err(ConfigError::new(what, "must not be empty (a PEM file)"));
                    }
                }
                Ok(())
            }
            (None, true) => Ok(()),
        }
    }

    /// Checks every bound but the transport's choice ([`ServerConfig::validate_transport`]):
    /// what a tool that only writes a data directory (`suanli cluster restore`) needs.
    pub fn validate_settings(&self) -> Result<(), ConfigError> {
        range("id", self.id, 1, u64::MAX)?;
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::new("listen", format!("{:?} is not an IP:PORT address", self.listen)));
        }
        let peer = self.peer_listen_addr();
        if peer.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::new("peer_listen", format!("{peer:?} is not an IP:PORT address")));
        }
        if peer == self.listen && !peer.ends_with(":0") {
            return Err(ConfigError::new(
                "peer_listen",
                format!("{peer:?} is the client listener's address; give the peer listener its own port"),
            ));
        }
        if let Some(http) = self.http_listen_addr() {
            if http.parse::<std::net::SocketAddr>().is_err() {
                return Err(ConfigError::new(
                    "http_listen",
                    format!("{http:?} is not an IP:PORT address (or \"off\" for no HTTP listener)"),
                ));
            }
            if (http == self.listen || http == peer) && !http.ends_with(":0") {
                return Err(ConfigError::new(
                    "http_listen",
                    format!("{http:?} is the client or peer listener's address; give the HTTP listener its own port"),
                ));
            }
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(ConfigError::new("data_dir", "must not be empty"));
        }
        let mut ids = std::collections::BTreeSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            range(&format!("peers[{i}].id"), p.id, 1, u64::MAX)?;
            if !ids.insert(p.id) {
                return Err(ConfigError::new(&format!("peers[{i}].id"), format!("id {} appears twice", p.id)));
            }
            let peer = p.peer().map_err(|e| ConfigError::new(&format!("peers[{i}]"), e.message))?;
            if p.id != self.id && (port_is_zero(&p.addr) || port_is_zero(&peer)) {
                return Err(ConfigError::new(
                    &format!("peers[{i}]"),
                    format!(
                        "{}/{peer}: port 0 is only for this server's own entry (it becomes the port bound); give server {}'s ports",
                        p.addr, p.id
                    ),
                ));
            }
        }
        if !self.peers.is_empty() && !ids.contains(&self.id) {
            return Err(ConfigError::new("peers", format!("must include this server's id {}", self.id)));
        }
        if self.join.is_some() && !self.peers.is_empty() {
            return Err(ConfigError::new("join", "give either peers (a new cluster) or join (an existing one)"));
        }
        if self.join.is_some() && self.bootstrap {
            return Err(ConfigError::new(
                "bootstrap",
                "give either bootstrap (create a new cluster) or join (an existing one)",
            ));
        }
        self.raft.validate().map_err(|e| ConfigError::new("raft", e.to_string()))?;
        range("max_request_bytes", self.max_request_bytes as u64, 1024, 256 * 1024 * 1024)?;
        range("request_timeout_ms", self.request_timeout_ms, 100, 600_000)?;
        range("schedule_interval_ms", self.schedule_interval_ms, 10, 60_000)?;
        range("schedule_min_gap_ms", self.schedule_min_gap_ms, 0, self.schedule_interval_ms)?;
        range("max_jobs_per_pass", self.max_jobs_per_pass as u64, 1, 1_000_000)?;
        if !suanli_scheduler::POLICY_NAMES.contains(&self.policy.as_str()) {
            return Err(ConfigError::new(
                "policy",
                format!("unknown policy {:?}; one of {}", self.policy, suanli_scheduler::POLICY_NAMES.join(", ")),
            ));
        }
        range("heartbeat_interval_ms", self.heartbeat_interval_ms, 10, 600_000)?;
        range("heartbeat_ttl_ms", self.heartbeat_ttl_ms, 2 * self.heartbeat_interval_ms, 7 * 24 * 3_600_000)?;
        range("max_agent_watchers", self.max_agent_watchers as u64, 1, 1_000_000)?;
        range("max_client_watchers", self.max_client_watchers as u64, 1, 1_000_000)?;
        range(
            "max_watchers_per_connection",
            self.max_watchers_per_connection as u64,
            1,
            self.max_client_watchers as u64,
        )?;
        range("max_list", u64::from(self.max_list), 1, 1_000_000)?;
        // Room for the page token and the response's own framing under the reply limit.
        let reply_limit = self.max_reply_bytes() as u64;
        range("max_list_bytes", self.max_list_bytes as u64, 1024, reply_limit.saturating_sub(1024))?;
        range("max_concurrent_per_connection", self.max_concurrent_per_connection as u64, 1, 1_000_000)?;
        range("leader_handoff_ms", self.leader_handoff_ms, 0, 60_000)?;
        range("shutdown_grace_ms", self.shutdown_grace_ms, 0, 600_000)?;
        range("max_clock_skew_ms", self.max_clock_skew_ms, 10, 3_600_000)?;
        range("max_clock_drift_permille", self.max_clock_drift_permille, 1, 500)?;
        range("clock_check_interval_ms", self.clock_check_interval_ms, 10, 60_000)?;
        range("tls_reload_interval_ms", self.tls_reload_interval_ms, 100, 3_600_000)?;
        range("tls_handshake_timeout_ms", self.tls_handshake_timeout_ms, 100, 600_000)?;
        range("max_token_ttl_s", self.max_token_ttl_s, 1, 10 * 366 * 24 * 3_600)?;
        range("rate_limit_per_s", self.rate_limit_per_s.into(), 0, 1_000_000)?;
        if self.rate_limit_per_s > 0 {
            range("rate_limit_burst", self.rate_limit_burst.into(), 1, 10_000_000)?;
        }
        if let Some(f) = &self.federation {
            f.validate()?;
        }
        Ok(())
    }
}

impl FederationLink {
    /// The most federation endpoints.
    pub const MAX_ENDPOINTS: usize = 16;
    /// The most region labels.
    pub const MAX_LABELS: usize = 64;

    /// Checks the table; errors name `federation.<key>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = &self.region;
        if r.is_empty() || r.len() > 64 || !r.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(ConfigError::new(
                "federation.region",
                format!("{r:?} is not a region name: 1..=64 bytes of [a-z0-9-]"),
            ));
        }
        if self.endpoints.is_empty() || self.endpoints.len() > Self::MAX_ENDPOINTS {
            return Err(ConfigError::new(
                "federation.endpoints",
                format!(
                    "{} endpoints; give 1..={} federation server addresses",
                    self.endpoints.len(),
                    Self::MAX_ENDPOINTS
                ),
            ));
        }
        for (i, e) in self.endpoints.iter().enumerate() {
            if e.trim().is_empty() || e.len() > 256 || e.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(ConfigError::new(
                    &format!("federation.endpoints[{i}]"),
                    format!("{e:?} is not an address (HOST:PORT, at most 256 bytes, no spaces)"),
                ));
            }
        }
        if self.labels.len() > Self::MAX_LABELS {
            return Err(ConfigError::new(
                "federation.labels",
                format!("{} labels; at most {}", self.labels.len(), Self::MAX_LABELS),
            ));
        }
        for (k, v) in &self.labels {
            if k.is_empty() || k.len() > 63 || v.len() > 256 || k.chars().chain(v.chars()).any(char::is_control) {
                return Err(ConfigError::new(
                    &format!("federation.labels.{k}"),
                    "a label key is 1..=63 bytes and its value at most 256, without control characters",
                ));
            }
        }
        for m in self.prices_micros_per_device_hour.keys() {
            if m.is_empty() || m.len() > 128 || m.chars().any(char::is_control) {
                return Err(ConfigError::new(
                    "federation.prices_micros_per_device_hour",
                    format!("{m:?} is not a device model name (1..=128 bytes)"),
                ));
            }
        }
        range("federation.request_timeout_ms", self.request_timeout_ms, 100, 60_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lifetimes_are_bounded() {
        assert_eq!(ServerConfig::default().max_token_ttl_s, 90 * 24 * 3600);
        let c = ServerConfig::from_toml("max_token_ttl_s = 3600\n").expect("a valid ttl");
        assert_eq!(c.max_token_ttl_s, 3600);
        for bad in [0, 11 * 366 * 24 * 3600] {
            let c = ServerConfig { max_token_ttl_s: bad, ..ServerConfig::default() };
            assert_eq!(c.validate().expect_err("out of range").field, "max_token_ttl_s");
        }
    }

    #[test]
    fn the_federation_table_is_checked() {
        let ok = FederationLink {
            region: "eu-west-1".into(),
            endpoints: vec!["127.0.0.1:7600".into()],
            ..FederationLink::default()
        };
        let with = |f: FederationLink| ServerConfig { federation: Some(f), ..insecure() };
        with(ok.clone()).validate().expect("valid");
        let c = ServerConfig::from_toml(
            "insecure = true\n[federation]\nregion = \"r1\"\nendpoints = [\"a:1\"]\nlabels = { data = \"x\" }\n",
        )
        .expect("parses");
        c.validate().expect("valid");
        for (bad, field) in [
            (FederationLink { region: "EU".into(), ..ok.clone() }, "federation.region"),
            (FederationLink { region: String::new(), ..ok.clone() }, "federation.region"),
            (FederationLink { region: "a".repeat(65), ..ok.clone() }, "federation.region"),
            (FederationLink { endpoints: vec![], ..ok.clone() }, "federation.endpoints"),
            (FederationLink { endpoints: vec!["a:1".into(); 17], ..ok.clone() }, "federation.endpoints"),
            (FederationLink { endpoints: vec![" ".into()], ..ok.clone() }, "federation.endpoints[0]"),
            (FederationLink { request_timeout_ms: 99, ..ok.clone() }, "federation.request_timeout_ms"),
            (FederationLink { request_timeout_ms: 60_001, ..ok.clone() }, "federation.request_timeout_ms"),
            (
                FederationLink { labels: (0..65).map(|i| (format!("k{i}"), "v".into())).collect(), ..ok.clone() },
                "federation.labels",
            ),
        ] {
            assert_eq!(with(bad).validate().expect_err(field).field, field);
        }
        let e = ServerConfig::from_toml("[federation]\nregion = \"r\"\nzone = 1\n").expect_err("unknown key");
        assert_eq!(e.field, "federation.zone", "{e}");
    }

    #[test]
    fn unknown_keys_in_any_table_are_named() {
        let e = ServerConfig::from_toml("[raft]\nheartbeat_ms = 5\n").expect_err("unknown raft key");
        assert_eq!(e.field, "raft.heartbeat_ms", "{e}");
        assert!(e.message.starts_with("unknown key"), "{e}");
        let e = ServerConfig::from_toml("[[peers]]\nid = 1\naddr = \"a:1\"\nx = 1\n").expect_err("peer key");
        assert_eq!(e.field, "peers[0].x", "{e}");
        let e = ServerConfig::from_toml("listen_addr = \"a:1\"\n").expect_err("top-level key");
        assert_eq!((e.field.as_str(), e.message.starts_with("unknown key")), ("listen_addr", true), "{e}");
        let c = ServerConfig::from_toml("id = 3\n[raft]\nheartbeat_interval_ms = 70\n").expect("known keys");
        assert_eq!((c.id, c.raft.heartbeat_interval_ms), (3, 70));
    }

    /// The defaults with the transport chosen (plaintext).
    fn insecure() -> ServerConfig {
        ServerConfig { insecure: true, ..ServerConfig::default() }
    }

    #[test]
    fn tls_or_insecure_is_required_and_not_both() {
        let e = ServerConfig::default().validate().expect_err("neither");
        assert_eq!(e.field, "tls", "{e}");
        assert!(e.message.contains("suanli tls init") && e.message.contains("--insecure"), "{e}");
        insecure().validate().expect("insecure alone");
        let files = TlsFiles { ca: "ca.pem".into(), cert: "server.pem".into(), key: "server-key.pem".into() };
        let tls = ServerConfig { tls: Some(files.clone()), ..ServerConfig::default() };
        tls.validate().expect("tls alone");
        let both = ServerConfig { insecure: true, ..tls.clone() };
        let e = both.validate().expect_err("both");
        assert_eq!(e.field, "tls", "{e}");
        assert!(e.message.contains("both"), "{e}");
        let empty = ServerConfig { tls: Some(TlsFiles { key: "".into(), ..files }), ..ServerConfig::default() };
        assert_eq!(empty.validate().expect_err("empty key").field, "tls.key");
        // The file's form: a [tls] table, strict like every other table.
        let c = ServerConfig::from_toml("[tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n").expect("[tls]");
        assert_eq!(c.tls.as_ref().map(|t| t.key.as_path()), Some(Path::new("c")));
        c.validate().expect("valid");
        let e = ServerConfig::from_toml("[tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\ncrl = \"d\"\n")
            .expect_err("unknown");
        assert_eq!(e.field, "tls.crl", "{e}");
        let c = ServerConfig::from_toml("insecure = true\n").expect("insecure key");
        c.validate().expect("valid");
        let c = ServerConfig { tls_handshake_timeout_ms: 0, ..insecure() };
        assert_eq!(c.validate().expect_err("0 ms").field, "tls_handshake_timeout_ms");
        let c = ServerConfig { tls_reload_interval_ms: 10, ..insecure() };
        assert_eq!(c.validate().expect_err("10 ms").field, "tls_reload_interval_ms");
    }

    #[test]
    fn defaults_validate_and_bad_values_name_the_field() {
        insecure().validate().expect("defaults are valid");
        let c = ServerConfig { heartbeat_ttl_ms: 10, ..insecure() };
        let e = c.validate().expect_err("ttl below twice the interval");
        assert_eq!(e.field, "heartbeat_ttl_ms", "{e}");
        let c = ServerConfig { peers: vec![Peer { id: 2, addr: "x:1".into(), peer_addr: None }], ..insecure() };
        assert_eq!(c.validate().expect_err("self missing").field, "peers");
        let c = ServerConfig { bootstrap: true, join: Some("10.0.0.1:7400".into()), ..insecure() };
        assert_eq!(c.validate().expect_err("bootstrap and join").field, "bootstrap");
        let c = ServerConfig { shutdown_grace_ms: 600_001, ..insecure() };
        assert_eq!(c.validate().expect_err("grace").field, "shutdown_grace_ms");
        let c = ServerConfig { policy: "nope".into(), ..insecure() };
        assert!(c.validate().expect_err("policy").to_string().contains("bestfit"));
        // A page must fit the reply limit (4 x max_request_bytes) with room for its token.
        let c = ServerConfig { max_request_bytes: 1024 * 1024, ..insecure() };
        c.validate().expect("4 MiB replies hold the default page");
        let c = ServerConfig { max_request_bytes: 512 * 1024, ..insecure() };
        let e = c.validate().expect_err("a 2 MiB reply limit cannot hold a 4 MiB page");
        assert_eq!(e.field, "max_list_bytes", "{e}");
        assert!(e.message.contains("2096128"), "{e}");
        let c = ServerConfig { max_agent_watchers: 0, ..insecure() };
        assert_eq!(c.validate().expect_err("no agent slots").field, "max_agent_watchers");
        let c = ServerConfig { max_client_watchers: 8, max_watchers_per_connection: 9, ..insecure() };
        let e = c.validate().expect_err("a connection allowed more than the pool");
        assert_eq!(e.field, "max_watchers_per_connection", "{e}");
        assert!(e.message.contains("1..=8"), "{e}");
    }

    #[test]
    fn port_zero_becomes_the_bound_addresses() {
        let bound = crate::Bound { client: ([127, 0, 0, 1], 4100).into(), peer: ([127, 0, 0, 1], 4200).into(), http: None };
        let c = ServerConfig {
            id: 1,
            listen: "127.0.0.1:0".into(),
            peers: vec![
                Peer::parse("1=127.0.0.1:0/127.0.0.1:0").expect("own entry"),
                Peer::parse("2=127.0.0.1:5100/127.0.0.1:5200").expect("other"),
            ],
            ..insecure()
        };
        c.validate().expect("port 0 in the own entry");
        let c = c.bound_to(&bound);
        assert_eq!((c.advertised(), c.peer_advertised().as_str()), ("127.0.0.1:4100", "127.0.0.1:4200"));
        assert_eq!(c.peers[0], Peer::parse("1=127.0.0.1:4100/127.0.0.1:4200").expect("bound"));
        assert_eq!(c.peers[1], Peer::parse("2=127.0.0.1:5100/127.0.0.1:5200").expect("untouched"));
        // An advertised address given wins over the bound one.
        let c = ServerConfig { advertise: Some("10.0.0.1:7400".into()), ..insecure() }.bound_to(&bound);
        assert_eq!((c.listen.as_str(), c.advertised()), ("127.0.0.1:4100", "10.0.0.1:7400"));
        // Another server's port cannot be picked here.
        let c = ServerConfig {
            peers: vec![Peer::parse("1=127.0.0.1:7400").expect("own"), Peer::parse("2=127.0.0.1:0").expect("other")],
            ..insecure()
        };
        let e = c.validate().expect_err("port 0 for another server");
        assert_eq!(e.field, "peers[1]", "{e}");
        assert!(e.message.contains("only for this server's own entry"), "{e}");
    }

    #[test]
    fn peers_parse_and_toml_rejects_unknown_keys() {
        assert_eq!(
            Peer::parse("2=127.0.0.1:7402").expect("ok"),
            Peer { id: 2, addr: "127.0.0.1:7402".into(), peer_addr: None }
        );
        let p = Peer::parse("2=127.0.0.1:7402/10.0.0.2:9000").expect("ok");
        assert_eq!(p.peer().expect("given"), "10.0.0.2:9000");
        assert_eq!(Peer::parse("2=127.0.0.1:7402").expect("ok").peer().expect("derived"), "127.0.0.1:7403");
        assert!(Peer::parse("2=127.0.0.1:7402/").is_err());
        assert!(Peer::parse("x=1").is_err());
        assert!(toml::from_str::<ServerConfig>("idd = 3").is_err());
        let c: ServerConfig =
            toml::from_str("id = 2\n[raft]\nelection_timeout_min_ms = 400\nelection_timeout_max_ms = 800\n")
                .expect("parses");
        assert_eq!(c.raft.election_timeout_min_ms, 400);
        // The old name of the client pool still reads.
        let c: ServerConfig = toml::from_str("max_watchers = 7").expect("alias");
        assert_eq!(c.max_client_watchers, 7);
    }
}
