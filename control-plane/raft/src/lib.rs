//! suanli's consensus layer: openraft wired to RocksDB storage and a gRPC transport.
//!
//! It owns durability and replication of the control plane's state: the openraft type
//! configuration, the log and state-machine storage in RocksDB column families (every
//! acknowledged write is fsynced first; snapshots bound the log), and the tonic network with a
//! deadline on every RPC. The server (`suanli-server`) calls [`open`], mounts [`RaftService`] on its
//! gRPC port, proposes [`suanli_state::Command`]s with [`write`] and reads with
//! [`linearizable_read`] or [`MachineHandle::read`].
//!
//! ```text
//!   server ──write(cmd)──▶ Raft<TypeConfig> ──append (fsync)──▶ LogStore   (cf logs, meta)
//!                              │   ▲ RaftNetwork: GrpcNetwork ──▶ peers' RaftService
//!                              ▼   │
//!                        StateMachineStore ──apply──▶ suanli_state::State (memory)
//!                              │ snapshots (fsync) ──▶ cf snapshot ── purge the log before it
//!   server ◀──read / linearizable_read── MachineHandle (RwLock over the applied state)
//! ```
//!
//! **Reuse (federation).** Everything here is generic over a [`Machine`] (command, response,
//! apply, snapshot, restore) and an openraft type config satisfying [`StoreConfig`]. A second
//! raft group declares its own config with `openraft::declare_raft_types!`, implements
//! [`Machine`] for its state, calls [`open_group`] with its own data directory and a distinct
//! [`RaftSettings::group`], and mounts its own [`RaftService`]; the group name travels in every
//! raft message, so two groups can share one port without crossing.
//!
//! It must never decide anything about scheduling or validate application input (that is the
//! state machine's job), acknowledge a write before it is synced, or block the async runtime on
//! disk writes (they run on the blocking pool).

mod frame;
mod machine;
pub mod membership;
mod network;
mod node;
pub mod restore;
mod settings;
mod store;

pub use frame::FrameError;
pub use machine::{LogCommand, Machine};
pub use network::{GrpcNetwork, GrpcNetworkFactory, RaftService};
pub use node::ServerNode;
pub use settings::{RaftSettings, SettingsError};
pub use store::{
    Applied, DIGEST_WINDOW, DigestMiss, DigestWindow, Halt, LogStore, MARKER_FILE, MachineHandle, SnapshotBuilder,
    StateMachineStore, StoreConfig, fnv1a, open_db,
};

use openraft::Raft;
use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use std::path::Path;
use suanli_state::{Command, CommandError, Response, State};
use thiserror::Error;

openraft::declare_raft_types!(
    /// The type configuration of a region's control plane.
    pub TypeConfig:
        D = LogCommand,
        R = Response,
        NodeId = u64,
        Node = ServerNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = std::io::Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// A region's raft node.
pub type SuanliRaft = Raft<TypeConfig>;
/// Read access to a region's applied state.
pub type StateHandle = MachineHandle<State>;

/// Opening a raft node failed.
#[derive(Debug, Error)]
pub enum OpenError {
    /// Bad settings.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// The database could not be opened (held by another process, corrupt, no permission).
    #[error("raft storage at {dir}: {source}")]
    Db {
        /// The data directory.
        dir: String,
        /// RocksDB's error.
        source: rocksdb::Error,
    },
    /// The stored log, vote or state is damaged or inconsistent: the server must not run on
    /// it (it may have voted or acknowledged on what was lost).
    #[error(
        "raft storage at {dir} is damaged: {found}. This server must not run on this data: follow the runbook \"Corruption: a server refuses to start\" in docs/operations.md (keep a copy, wipe the data dir, rejoin under a new id)"
    )]
    Damaged {
        /// The data directory.
        dir: String,
        /// What was found, with the numbers.
        found: String,
    },
    /// The persisted state could not be read.
    #[error("raft storage: {0}")]
    Storage(#[from] openraft::StorageError<u64>),
    /// openraft refused to start.
    #[error("raft: {0}")]
    Fatal(#[from] openraft::error::Fatal<u64>),
}

/// A RocksDB error at open: corruption is [`OpenError::Damaged`] (with the runbook), the rest
/// [`OpenError::Db`].
fn db_error(dir: &str, source: rocksdb::Error) -> OpenError {
    match source.kind() {
        rocksdb::ErrorKind::Corruption => {
            OpenError::Damaged { dir: dir.to_owned(), found: format!("RocksDB refused to recover it: {source}") }
        }
        _ => OpenError::Db { dir: dir.to_owned(), source },
    }
}

/// Opens (creating if needed) a raft node of any group: storage in `dir`, gRPC network to
/// peers. A fresh cluster still needs `raft.initialize(members)` on one node; a restarted node
/// recovers its log, vote and snapshot and rejoins on its own.
///
/// Peers are dialed over mutual TLS with `tls` (plaintext without it: a server started
/// `--insecure`).
///
/// Besides the node and its applied state it returns a second handle on the log store, for
/// reading only ([`LogStore::digests`]: the consistency checks of the chaos harness).
pub async fn open_group<C, M>(
    dir: &Path,
    id: u64,
    settings: &RaftSettings,
    tls: Option<suanli_security::tls::Tls>,
) -> Result<(Raft<C>, MachineHandle<M>, LogStore<C>), OpenError>
where
    C: StoreConfig,
    M: Machine<Response = C::R>,
{
    let config = settings.openraft_config()?;
    let shown = dir.display().to_string();
    let db = open_db(dir).map_err(|source| db_error(&shown, source))?;
    let log = LogStore::<C>::new(db.clone()).with_append_bytes(settings.append_bytes()).with_marker(dir)?;
    let snapshot = StateMachineStore::<C, M>::snapshot_log_id(&db)?;
    if let Err(found) = log.check_at_open(snapshot)? {
        return Err(OpenError::Damaged { dir: shown, found });
    }
    let reader = log.clone();
    let sm = StateMachineStore::<C, M>::open(db)?;
    let handle = sm.handle();
    let net = GrpcNetworkFactory::<C>::new(id, settings.clone(), tls);
    let raft = Raft::new(id, config, net, log, sm).await?;
    Ok((raft, handle, reader))
}

/// Opens a region's control-plane raft node (see [`open_group`]).
pub async fn open(
    dir: &Path,
    id: u64,
    settings: &RaftSettings,
    tls: Option<suanli_security::tls::Tls>,
) -> Result<(SuanliRaft, StateHandle, LogStore<TypeConfig>), OpenError> {
    open_group::<TypeConfig, State>(dir, id, settings, tls).await
}

/// A write that did not commit.
#[derive(Debug, Error)]
pub enum WriteError {
    /// Refused before proposing (e.g. larger than `max_command_bytes`).
    #[error(transparent)]
    Refused(#[from] CommandError),
    /// Not the leader (the error names the leader when known), or raft stopped.
    #[error(transparent)]
    Raft(#[from] RaftError<u64, ClientWriteError<u64, ServerNode>>),
}

/// Proposes a command and waits until it is committed on a quorum (each member fsynced it)
/// and applied here. Checks its encoded size against the replicated `max_command_bytes` first.
/// The returned [`Response`] may still be [`Response::Rejected`]: committed, but refused by
/// the state machine with the state unchanged.
pub async fn write(raft: &SuanliRaft, state: &StateHandle, cmd: Command) -> Result<(Response, u64), WriteError> {
    write_encoded(raft, state, encode(&cmd)?).await
}

/// Encodes a command for [`write_encoded`] (once: a proposer that may retry keeps the result).
pub fn encode(cmd: &Command) -> Result<LogCommand, CommandError> {
    LogCommand::encode(cmd).map_err(|e| CommandError::Invalid { field: "command".into(), message: e.to_string() })
}

/// [`write`] of a command already encoded. The size check reads the encoded length.
pub async fn write_encoded(
    raft: &SuanliRaft,
    state: &StateHandle,
    cmd: LogCommand,
) -> Result<(Response, u64), WriteError> {
    let limit = state.read(|s| s.config().max_command_bytes);
    suanli_state::check_encoded_size(cmd.len(), limit)?;
    let r = raft.client_write(cmd).await?;
    Ok((r.data, r.log_id.index))
}

/// Runs `f` on state that reflects every write committed before this call (raft read index:
/// the leader confirms it still leads, then waits until that index is applied here).
pub async fn linearizable_read<C, M, R>(
    raft: &Raft<C>,
    handle: &MachineHandle<M>,
    f: impl FnOnce(&M) -> R,
) -> Result<R, RaftError<u64, CheckIsLeaderError<u64, ServerNode>>>
where
    C: StoreConfig,
    M: Machine<Response = C::R>,
{
    let read_log_id = raft.ensure_linearizable().await?;
    if let Some(l) = read_log_id {
        handle.wait_applied(l.index).await;
    }
    Ok(handle.read(f))
}
