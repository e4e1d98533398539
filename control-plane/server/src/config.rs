//! The server's configuration: a TOML file, with flags and environment variables over it (the
//! `suanli server` command does the layering), validated with errors naming the field.

use crate::watchers::WatchLimits;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use suanli_raft::RaftSettings;
use thiserror::Error;

/// One initial voter of a fresh cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    /// Raft id (>= 1, unique).
    pub id: u64,
    /// gRPC address `host:port` other servers and clients reach it at.
    pub addr: String,
}

impl Peer {
    /// Parses `ID=HOST:PORT`.
    pub fn parse(s: &str) -> Result<Peer, ConfigError> {
        let bad = || ConfigError::new("peers", format!("{s:?} is not ID=HOST:PORT (e.g. 2=10.0.0.2:7400)"));
        let (id, addr) = s.split_once('=').ok_or_else(bad)?;
        let id: u64 = id.trim().parse().map_err(|_| bad())?;
        let addr = addr.trim().to_owned();
        if addr.is_empty() {
            return Err(bad());
        }
        Ok(Peer { id, addr })
    }
}

/// Everything a server needs. Defaults are a single server on `127.0.0.1:7400`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// This server's raft id (>= 1, unique in the cluster, never reused for another server).
    pub id: u64,
    /// Where the raft log, the snapshots and the state live (RocksDB).
    pub data_dir: PathBuf,
    /// Address to listen on for clients, agents and other servers (`host:port`; port 0 picks one).
    pub listen: String,
    /// Address other servers and clients use to reach this one (default: `listen`).
    pub advertise: Option<String>,
    /// Initial voters of a fresh cluster (this server among them). The smallest id initializes
    /// the cluster on first start; later starts ignore this list (membership lives in raft).
    /// Empty, without `join`: a single-server cluster.
    pub peers: Vec<Peer>,
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
    /// Most items one list returns.
    pub max_list: u32,
    /// Most requests in flight on one connection.
    pub max_concurrent_per_connection: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            id: 1,
            data_dir: PathBuf::from("suanli-data"),
            listen: "127.0.0.1:7400".into(),
            advertise: None,
            peers: Vec::new(),
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
            max_concurrent_per_connection: 1_024,
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
        toml::from_str(&text).map_err(|e| ConfigError::new("config", format!("{}: {e}", path.display())))
    }

    /// The address others reach this server at.
    pub fn advertised(&self) -> &str {
        self.advertise.as_deref().unwrap_or(&self.listen)
    }

    /// The bounds of the watch streams' slots.
    pub fn watch_limits(&self) -> WatchLimits {
        WatchLimits {
            agents: self.max_agent_watchers,
            clients: self.max_client_watchers,
            per_connection: self.max_watchers_per_connection,
        }
    }

    /// Checks every bound.
    pub fn validate(&self) -> Result<(), ConfigError> {
        range("id", self.id, 1, u64::MAX)?;
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::new("listen", format!("{:?} is not an IP:PORT address", self.listen)));
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
        }
        if !self.peers.is_empty() && !ids.contains(&self.id) {
            return Err(ConfigError::new("peers", format!("must include this server's id {}", self.id)));
        }
        if self.join.is_some() && !self.peers.is_empty() {
            return Err(ConfigError::new("join", "give either peers (a new cluster) or join (an existing one)"));
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
        range("max_concurrent_per_connection", self.max_concurrent_per_connection as u64, 1, 1_000_000)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_name_the_field() {
        ServerConfig::default().validate().expect("defaults are valid");
        let c = ServerConfig { heartbeat_ttl_ms: 10, ..ServerConfig::default() };
        let e = c.validate().expect_err("ttl below twice the interval");
        assert_eq!(e.field, "heartbeat_ttl_ms", "{e}");
        let c = ServerConfig { peers: vec![Peer { id: 2, addr: "x:1".into() }], ..ServerConfig::default() };
        assert_eq!(c.validate().expect_err("self missing").field, "peers");
        let c = ServerConfig { policy: "nope".into(), ..ServerConfig::default() };
        assert!(c.validate().expect_err("policy").to_string().contains("bestfit"));
        let c = ServerConfig { max_agent_watchers: 0, ..ServerConfig::default() };
        assert_eq!(c.validate().expect_err("no agent slots").field, "max_agent_watchers");
        let c = ServerConfig { max_client_watchers: 8, max_watchers_per_connection: 9, ..ServerConfig::default() };
        let e = c.validate().expect_err("a connection allowed more than the pool");
        assert_eq!(e.field, "max_watchers_per_connection", "{e}");
        assert!(e.message.contains("1..=8"), "{e}");
    }

    #[test]
    fn peers_parse_and_toml_rejects_unknown_keys() {
        assert_eq!(Peer::parse("2=127.0.0.1:7402").expect("ok"), Peer { id: 2, addr: "127.0.0.1:7402".into() });
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
