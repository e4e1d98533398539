//! Offline tools over data directories (the server is not running): read the state a stopped
//! server's data dir holds, and write a new single-member data dir from a state. What
//! `suanli cluster restore` (from a backup file, or `--from-data-dir` for disaster recovery)
//! is built on.
//!
//! ```text
//!  read_data_dir(old):  snapshot ─restore─▶ machine ─apply every entry of the log after it─▶ state bytes
//!  write_data_dir(new): cf snapshot = (state, last log id L = (term 1, id, index 1), membership {id})
//!                       cf meta     = vote (term 1, id), committed L, last_purged L; marker next 2
//! ```
//!
//! A written dir is initialized: `suanli server` starts it as a one-server cluster that elects
//! itself and serves the state; more servers join it as usual.

#![allow(clippy::result_large_err)]

use crate::machine::Machine;
use crate::node::ServerNode;
use crate::store::{Halt, LogStore, StateMachineStore, StoreConfig, open_db, open_db_read_only, write_restored};
use crate::{OpenError, TypeConfig};
use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::{LogId, RaftLogReader, StoredMembership};
use std::path::Path;

/// What a stopped server's data dir holds, with its whole log applied.
#[derive(Debug)]
pub struct Recovered {
    /// The machine's snapshot encoding ([`Machine::snapshot`]).
    pub state: Vec<u8>,
    /// The last entry applied (the log's last entry).
    pub last_applied: Option<LogId<u64>>,
    /// The membership it had.
    pub membership: StoredMembership<u64, ServerNode>,
    /// Set when an entry of the log could not be applied (the state stops before it).
    pub halt: Option<Halt>,
}

/// Entries applied per batch while replaying a log.
const REPLAY_BATCH: u64 = 1_000;

/// Reads a stopped server's data dir without changing it: its snapshot, then every entry of
/// its log after it (committed or not: what this server would commit were it elected).
/// Refuses a damaged dir as a start would.
pub async fn read_data_dir<C, M>(dir: &Path) -> Result<Recovered, OpenError>
where
    C: StoreConfig,
    M: Machine<Response = C::R>,
{
    let shown = dir.display().to_string();
    let db = open_db_read_only(dir).map_err(|source| crate::db_error(&shown, source))?;
    let mut log = LogStore::<C>::new(db.clone());
    let snapshot = StateMachineStore::<C, M>::snapshot_log_id(&db)?;
    if let Err(found) = log.check_at_open(snapshot)? {
        return Err(OpenError::Damaged { dir: shown, found });
    }
    let mut sm = StateMachineStore::<C, M>::open(db)?;
    let handle = sm.handle();
    let last = log.get_log_state().await?.last_log_id.map_or(0, |l| l.index);
    let mut next = handle.applied_index().saturating_add(1);
    if sm.applied_state().await?.0.is_none() {
        next = 0;
    }
    while next <= last {
        let to = next.saturating_add(REPLAY_BATCH - 1).min(last);
        let entries = log.try_get_log_entries(next..=to).await?;
        if entries.is_empty() {
            break;
        }
        sm.apply(entries).await?;
        next = to.saturating_add(1);
    }
    let (last_applied, membership) = sm.applied_state().await?;
    let state = handle
        .read(|m| m.snapshot())
        .map_err(|e| openraft::StorageIOError::read_state_machine(&std::io::Error::other(e)))
        .map_err(openraft::StorageError::from)?;
    Ok(Recovered { state, last_applied, membership, halt: handle.halt() })
}

/// [`read_data_dir`] for the control plane's state.
pub async fn read_region_data_dir(dir: &Path) -> Result<Recovered, OpenError> {
    read_data_dir::<TypeConfig, suanli_state::State>(dir).await
}

/// Writes a new data dir (`dir` must not exist or be empty) whose state is `state` (a
/// [`Machine::snapshot`] encoding), with a fresh log and this one server (`id` at `node`) as
/// the only voter. Returns the log id the state stands at.
pub fn write_data_dir(dir: &Path, id: u64, node: ServerNode, state: &[u8]) -> Result<LogId<u64>, OpenError> {
    let shown = dir.display().to_string();
    let not_empty = std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(false);
    if not_empty {
        let msg = format!(
            "data_dir {shown} is not empty: a restore writes a new data dir only (give an empty or absent one)"
        );
        return Err(OpenError::Storage(openraft::StorageIOError::write(&std::io::Error::other(msg)).into()));
    }
    std::fs::create_dir_all(dir).map_err(|e| {
        OpenError::Storage(openraft::StorageIOError::write(&std::io::Error::other(format!("{shown}: {e}"))).into())
    })?;
    let db = open_db(dir).map_err(|source| crate::db_error(&shown, source))?;
    let at = write_restored(&db, id, node, state)?;
    // The marker, from what was just written.
    LogStore::<TypeConfig>::new(db).with_marker(dir)?;
    Ok(at)
}
