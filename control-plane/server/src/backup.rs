//! Backup files and offline restore: the cluster's identity, the backup file format
//! (`Cluster.Backup` streams one, `suanli cluster backup` writes it), and building a new
//! cluster's first data dir from a backup or from a surviving server's data dir.
//!
//! ```text
//!  backup file:  "SUANLI-BACKUP 1\n"  header (one line of JSON)  "\n"  state snapshot bytes
//!  header:       format, cluster_id, last_applied (log id), membership, state_bytes,
//!                checksum (FNV-1a 64 of the state bytes, hex), created_unix_ms, server_id
//!  restore:      backup | old data dir ─▶ State ─(new cluster id)─▶ suanli_raft::restore::write_data_dir
//! ```
//!
//! A restored cluster always gets a new cluster id: agents that ran work for the old one
//! drop that work before running anything for the new one, so allocation ids (which keep
//! increasing from the backup's counters) can never be confused across the two.

use openraft::{LogId, StoredMembership};
use serde::{Deserialize, Serialize};
use std::path::Path;
use suanli_raft::ServerNode;
use suanli_state::State;
use thiserror::Error;

/// The first line of every backup file.
pub const MAGIC: &[u8] = b"SUANLI-BACKUP 1\n";
/// The header's format version this build writes and reads.
pub const FORMAT: u32 = 1;
/// Most bytes of a backup's header line.
pub const MAX_HEADER_BYTES: usize = 1 << 20;
/// Bytes per `Cluster.Backup` chunk.
pub const CHUNK_BYTES: usize = 1 << 20;

/// What a backup file says about itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BackupHeader {
    /// [`FORMAT`].
    pub format: u32,
    /// The identity of the cluster it was taken from.
    pub cluster_id: String,
    /// The last log entry the state includes.
    pub last_applied: Option<LogId<u64>>,
    /// The source cluster's membership then.
    pub membership: StoredMembership<u64, ServerNode>,
    /// Length of the state snapshot that follows the header.
    pub state_bytes: u64,
    /// FNV-1a 64 of the state snapshot, 16 hex digits.
    pub checksum: String,
    /// When the server that served it took it (its clock, ms since the Unix epoch).
    pub created_unix_ms: u64,
    /// The server that served it.
    pub server_id: u64,
}

/// A backup file that cannot be restored, or a restore that failed.
#[derive(Debug, Error)]
pub enum BackupError {
    /// Not a backup file, or a damaged one.
    #[error("not a usable backup file: {0}")]
    Format(String),
    /// The state inside it does not load.
    #[error("the backup's state does not load: {0}")]
    State(String),
    /// The new data dir already holds something.
    #[error("data_dir {0} is not empty: a restore writes a new data dir only (give an empty or absent one)")]
    NotEmpty(String),
    /// Writing or reading a data dir failed.
    #[error(transparent)]
    Open(Box<suanli_raft::OpenError>),
}

impl From<suanli_raft::OpenError> for BackupError {
    fn from(e: suanli_raft::OpenError) -> Self {
        BackupError::Open(Box::new(e))
    }
}

/// A new random cluster id: 32 hex digits (128 bits from the standard library's OS-seeded
/// hasher keys, the time and the process id; an identity, not a secret).
pub fn new_cluster_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut halves = [0u64; 2];
    for (i, h) in halves.iter_mut().enumerate() {
        let mut s = std::collections::hash_map::RandomState::new().build_hasher();
        s.write_u128(nanos);
        s.write_u32(std::process::id());
        s.write_usize(i);
        *h = s.finish();
    }
    format!("{:016x}{:016x}", halves[0], halves[1])
}

/// A backup file's bytes: magic, header line, state.
pub fn encode(header: &BackupHeader, state: &[u8]) -> Result<Vec<u8>, BackupError> {
    let h = serde_json::to_vec(header).map_err(|e| BackupError::Format(e.to_string()))?;
    let mut out = Vec::with_capacity(MAGIC.len() + h.len() + 1 + state.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&h);
    out.push(b'\n');
    out.extend_from_slice(state);
    Ok(out)
}

/// The header of a backup taken now from `state` (a [`State::snapshot`] encoding).
pub fn header_for(
    cluster_id: &str,
    last_applied: Option<LogId<u64>>,
    membership: StoredMembership<u64, ServerNode>,
    state: &[u8],
    server_id: u64,
) -> BackupHeader {
    let created_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    BackupHeader {
        format: FORMAT,
        cluster_id: cluster_id.to_owned(),
        last_applied,
        membership,
        state_bytes: state.len() as u64,
        checksum: format!("{:016x}", suanli_raft::fnv1a(state)),
        created_unix_ms,
        server_id,
    }
}

/// Reads and checks a backup file's bytes: the magic, the header, the length and the checksum.
pub fn decode(bytes: &[u8]) -> Result<(BackupHeader, &[u8]), BackupError> {
    let bad = |m: String| BackupError::Format(m);
    let rest = bytes.strip_prefix(MAGIC).ok_or_else(|| {
        bad("it does not start with \"SUANLI-BACKUP 1\" (not a suanli backup, or a newer format)".into())
    })?;
    let end = rest
        .iter()
        .take(MAX_HEADER_BYTES)
        .position(|&b| b == b'\n')
        .ok_or_else(|| bad(format!("no header line within {MAX_HEADER_BYTES} bytes")))?;
    let header: BackupHeader = serde_json::from_slice(&rest[..end]).map_err(|e| bad(format!("header: {e}")))?;
    if header.format != FORMAT {
        return Err(bad(format!("header.format is {}; this build reads format {FORMAT}", header.format)));
    }
    let state = &rest[end + 1..];
    if state.len() as u64 != header.state_bytes {
        return Err(bad(format!(
            "the state is {} bytes but header.state_bytes says {} (a truncated file?)",
            state.len(),
            header.state_bytes
        )));
    }
    let sum = format!("{:016x}", suanli_raft::fnv1a(state));
    if sum != header.checksum {
        return Err(bad(format!(
            "checksum mismatch: the state hashes to {sum}, header.checksum says {}",
            header.checksum
        )));
    }
    Ok((header, state))
}

/// What a restore wrote.
#[derive(Debug, Clone)]
pub struct Restored {
    /// The new cluster's id.
    pub cluster_id: String,
    /// The source cluster's id (empty when it had none).
    pub source_cluster_id: String,
    /// The last log id of the source the state includes.
    pub source_last_applied: Option<LogId<u64>>,
    /// Jobs and allocations in the restored state.
    pub jobs: usize,
    /// Allocations in the restored state.
    pub allocs: usize,
    /// Set when the source's log holds an entry this build could not apply (state before it).
    pub halted_at: Option<u64>,
}

/// Gives `state` a new cluster id and writes it as a new one-server data dir.
fn write_new(state: &[u8], dir: &Path, id: u64, node: ServerNode) -> Result<Restored, BackupError> {
    if std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) {
        return Err(BackupError::NotEmpty(dir.display().to_string()));
    }
    let mut s = State::restore(state).map_err(|e| BackupError::State(e.to_string()))?;
    let source = s.cluster_id().to_owned();
    let cluster_id = new_cluster_id();
    s.reset_cluster_id(&cluster_id).map_err(|e| BackupError::State(e.to_string()))?;
    let bytes = s.snapshot().map_err(|e| BackupError::State(e.to_string()))?;
    suanli_raft::restore::write_data_dir(dir, id, node, &bytes)?;
    Ok(Restored {
        cluster_id,
        source_cluster_id: source,
        source_last_applied: None,
        jobs: s.jobs().len(),
        allocs: s.allocs().len(),
        halted_at: None,
    })
}

/// `suanli cluster restore FILE`: a new data dir in `dir` (empty or absent) for server `id`
/// at `node`, holding the backup's state under a new cluster id.
pub fn restore_backup(bytes: &[u8], dir: &Path, id: u64, node: ServerNode) -> Result<Restored, BackupError> {
    let (header, state) = decode(bytes)?;
    let mut r = write_new(state, dir, id, node)?;
    r.source_last_applied = header.last_applied;
    Ok(r)
}

/// `suanli cluster restore --from-data-dir OLD`: the same from a stopped server's data dir
/// (read only), with every entry of its log applied.
pub async fn restore_data_dir(old: &Path, dir: &Path, id: u64, node: ServerNode) -> Result<Restored, BackupError> {
    let rec = suanli_raft::restore::read_region_data_dir(old).await?;
    let mut r = write_new(&rec.state, dir, id, node)?;
    r.source_last_applied = rec.last_applied;
    r.halted_at = rec.halt.map(|h| h.index);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backup_round_trips_and_damage_is_named() {
        let state = State::default().snapshot().expect("snapshot");
        let h = header_for("abc", None, StoredMembership::default(), &state, 1);
        let file = encode(&h, &state).expect("encodes");
        let (back, s) = decode(&file).expect("decodes");
        assert_eq!((back.cluster_id.as_str(), s), ("abc", &state[..]));
        let e = decode(&file[..file.len() - 1]).expect_err("truncated").to_string();
        assert!(e.contains("header.state_bytes"), "{e}");
        let mut flipped = file.clone();
        let last = flipped.len() - 2;
        flipped[last] ^= 0x20;
        let e = decode(&flipped).expect_err("flipped").to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        assert!(decode(b"hello").expect_err("not one").to_string().contains("SUANLI-BACKUP"));
    }

    #[test]
    fn a_restore_writes_only_a_new_data_dir() {
        let mut s = State::default();
        s.reset_cluster_id("abc").expect("valid");
        let state = s.snapshot().expect("snapshot");
        let file = encode(&header_for("abc", None, StoredMembership::default(), &state, 1), &state).expect("encodes");
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("CURRENT"), b"x").expect("write");
        let node = ServerNode::new("127.0.0.1:2", "127.0.0.1:1");
        let e = restore_backup(&file, dir.path(), 1, node.clone()).expect_err("refused").to_string();
        assert!(e.contains("is not empty"), "{e}");
        let fresh = dir.path().join("new");
        let r = restore_backup(&file, &fresh, 1, node).expect("restores");
        assert_eq!(r.source_cluster_id, "abc");
        assert_ne!(r.cluster_id, "abc");
    }

    #[test]
    fn cluster_ids_differ_and_are_valid() {
        let (a, b) = (new_cluster_id(), new_cluster_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        State::default().reset_cluster_id(&a).expect("valid");
    }
}
