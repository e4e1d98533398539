//! The federation server process (`suanli federation serve`): its raft group on RocksDB, the
//! `Federation` service on the client listener, `RaftTransport` and `FederationPeer` on the peer
//! listener (mutual TLS, server certificates only), the authorization of every call, and the
//! leader's dispatch and lease-expiry loops.

use std::path::PathBuf;

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

/// Runs a federation server until `shutdown` resolves (SIGTERM in the CLI). Prints
/// `suanli federation listening client=ADDR peer=ADDR` once both listeners are bound.
pub async fn serve(
    cfg: FederationServerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let _ = (cfg, shutdown);
    todo!("h-fserver")
}
