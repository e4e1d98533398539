//! RocksDB storage for openraft: the log ([`LogStore`]) and the state machine with its
//! snapshots ([`StateMachineStore`]), in column families of one database.
//!
//! ```text
//!  cf "logs"      index (u64, big endian) -> entry frame (`crate::frame`)
//!                                                             append/truncate/purge: fsync
//!  cf "meta"      "vote" -> Vote (fsync) | "committed" -> LogId | "last_purged" -> LogId
//!  cf "snapshot"  "meta" -> SnapshotMeta | "data" -> Machine::snapshot bytes      (fsync)
//! ```
//!
//! The machine itself lives in memory: it is rebuilt at start from the latest snapshot, then
//! openraft re-applies the committed log after it (we persist `committed` for that). Every
//! write that acknowledges raft state (vote, log entries, purges, snapshots) is synced to disk
//! before its callback fires, so an acknowledged write survives power loss.

// openraft's storage traits fix the (large) `StorageError` type for every fallible call.
#![allow(clippy::result_large_err)]

use crate::frame::{FrameError, decode_entry, entry_frame};
use crate::machine::{LogCommand, Machine};
use crate::node::ServerNode;
use bytes::Bytes;
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, OptionalSend, RaftLogReader, RaftSnapshotBuilder, RaftTypeConfig, SnapshotMeta,
    StorageError, StorageIOError, StoredMembership, Vote,
};
use rocksdb::{ColumnFamilyDescriptor, DB, Direction, IteratorMode, Options, WriteBatch, WriteOptions};
use serde::{Serialize, de::DeserializeOwned};
use std::fmt::Debug;
use std::io::Cursor;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio::sync::watch;

const CF_LOGS: &str = "logs";
const CF_META: &str = "meta";
const CF_SNAPSHOT: &str = "snapshot";
const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_LAST_PURGED: &[u8] = b"last_purged";
const KEY_SNAP_META: &[u8] = b"meta";
const KEY_SNAP_DATA: &[u8] = b"data";

/// The type configurations our storage serves: the log carries encoded commands, node ids are
/// `u64`, nodes carry an address, snapshots are byte buffers.
pub trait StoreConfig:
    RaftTypeConfig<D = LogCommand, NodeId = u64, Node = ServerNode, Entry = Entry<Self>, SnapshotData = Cursor<Vec<u8>>>
{
}

impl<C> StoreConfig for C where
    C: RaftTypeConfig<
            D = LogCommand,
            NodeId = u64,
            Node = ServerNode,
            Entry = Entry<C>,
            SnapshotData = Cursor<Vec<u8>>,
        >
{
}

type SErr = StorageError<u64>;

/// Opens (or creates) the database with our column families.
///
/// The WAL is recovered with RocksDB's `TolerateCorruptedTailRecords`: a record torn at the
/// very end of the WAL (a crash in the middle of a write that was therefore never synced, so
/// never acknowledged) is dropped, and any other damage (a checksum mismatch anywhere, a bad
/// record before the end) refuses to open (`ErrorKind::Corruption`), where RocksDB's default
/// (point in time) would silently drop every record after it. A WAL cut at a record boundary
/// (or mid-record) loses acknowledged entries without a checksum error: the durable marker
/// ([`LogStore::with_marker`]) catches that at open. Paranoid checks stay on.
pub fn open_db(dir: &Path) -> Result<Arc<DB>, rocksdb::Error> {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    opts.set_wal_recovery_mode(rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords);
    opts.set_paranoid_checks(true);
    let cfs = [CF_LOGS, CF_META, CF_SNAPSHOT].map(|n| ColumnFamilyDescriptor::new(n, Options::default()));
    Ok(Arc::new(DB::open_cf_descriptors(&opts, dir, cfs)?))
}

/// Opens an existing database read only (offline tools: nothing in `dir` changes).
pub fn open_db_read_only(dir: &Path) -> Result<Arc<DB>, rocksdb::Error> {
    let mut opts = Options::default();
    opts.set_wal_recovery_mode(rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords);
    opts.set_paranoid_checks(true);
    Ok(Arc::new(DB::open_cf_for_read_only(&opts, dir, [CF_LOGS, CF_META, CF_SNAPSHOT], false)?))
}

/// Writes the raft state of a new one-server cluster into an empty database: the snapshot
/// (`state`, at log id `(term 1, id, index 1)`, membership: `id` the only voter at `node`),
/// the log purged up to it, committed there, and a vote for `id` in term 1. One synced write.
pub fn write_restored(db: &DB, id: u64, node: ServerNode, state: &[u8]) -> Result<LogId<u64>, SErr> {
    let at = LogId::new(openraft::CommittedLeaderId::new(1, id), 1);
    let membership = openraft::Membership::new(
        vec![std::collections::BTreeSet::from([id])],
        std::collections::BTreeMap::from([(id, node)]),
    );
    let meta = SnapshotMeta {
        last_log_id: Some(at),
        last_membership: StoredMembership::new(Some(at), membership),
        snapshot_id: format!("restored-1-{id}-1"),
    };
    let mut batch = WriteBatch::default();
    let snap = cf(db, CF_SNAPSHOT)?;
    batch.put_cf(snap, KEY_SNAP_META, to_json(&meta)?);
    batch.put_cf(snap, KEY_SNAP_DATA, state);
    let m = cf(db, CF_META)?;
    batch.put_cf(m, KEY_LAST_PURGED, to_json(&at)?);
    batch.put_cf(m, KEY_COMMITTED, to_json(&Some(at))?);
    batch.put_cf(m, KEY_VOTE, to_json(&Vote::new(1u64, id))?);
    db.write_opt(batch, &synced()).map_err(|e| StorageIOError::write(&e))?;
    Ok(at)
}

/// FNV-1a, 64 bits: a stable hash (the same on every server and build) for comparing log
/// entries and state snapshots across servers. Not for security.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// FNV-1a 64 continued from `h` over `bytes` (`fnv1a(b) == fnv1a_extend(FNV_OFFSET, b)`).
fn fnv1a_extend(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// How many (index, digest) pairs of the most recently applied entries a replica keeps
/// (16 bytes each): `cluster check` compares servers at an index inside this window.
pub const DIGEST_WINDOW: usize = 65_536;

/// The rolling digest of the applied log: after entry `i`, `d(i) = FNV-1a 64 over
/// (d(i-1), i, term, payload, response)` where the payload is a command's bytes as the log
/// carries them (a blank entry's is empty, a membership's its JSON) and the response is the
/// state machine's answer as JSON. Deterministic, so equal on every replica at the same
/// index; carried in the machine ([`crate::Machine::log_digest`]), hence in snapshots, so it
/// survives restarts and snapshot installs. Not for security.
#[derive(Debug, Clone, Default)]
pub struct DigestWindow {
    recent: std::collections::VecDeque<(u64, u64)>,
}

/// Why a digest at an index is not available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestMiss {
    /// Not applied here yet (the last applied index).
    Ahead(u64),
    /// Older than the window (the oldest index kept).
    Behind(u64),
}

impl DigestWindow {
    fn reset(&mut self, index: u64, digest: u64) {
        self.recent.clear();
        self.recent.push_back((index, digest));
    }

    fn push(&mut self, index: u64, digest: u64) {
        if self.recent.len() >= DIGEST_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back((index, digest));
    }

    /// The last applied index and its digest.
    pub fn last(&self) -> (u64, u64) {
        self.recent.back().copied().unwrap_or((0, 0))
    }

    /// The digest after entry `index` was applied.
    pub fn at(&self, index: u64) -> Result<u64, DigestMiss> {
        let (last, _) = self.last();
        if index > last {
            return Err(DigestMiss::Ahead(last));
        }
        let first = self.recent.front().map_or(0, |f| f.0);
        // Indexes are increasing but may skip (entries halted at are not applied).
        match self.recent.binary_search_by_key(&index, |p| p.0) {
            Ok(i) => Ok(self.recent[i].1),
            Err(_) => Err(DigestMiss::Behind(first)),
        }
    }
}

fn synced() -> WriteOptions {
    let mut w = WriteOptions::default();
    w.set_sync(true);
    w
}

/// The options of a write raft relies on, after the disk failpoints (feature `failpoints`;
/// without it this is [`synced`]):
///
/// - `raft::fsync`: `return` / `return(msg)` fails the write as a disk error would (openraft
///   then stops the node, and the server exits); `sleep(ms)` delays it as a slow fsync would.
/// - `raft::skip-fsync` (BROKEN on purpose, for proving the chaos checker): `return` makes log
///   appends (`lie = true`) neither synced nor logged ahead, so acknowledged entries live only
///   in memory, as on a disk whose cache lies about fsync, and die with the process.
///
/// The flag says whether the write is really durable (false only on the lying disk, whose
/// writes must not raise the durable marker either).
fn durable(lie: bool) -> Result<(WriteOptions, bool), std::io::Error> {
    #[cfg(feature = "failpoints")]
    {
        if let Some(msg) = fail::eval("raft::fsync", |arg| arg.unwrap_or_else(|| "injected fsync error".into())) {
            return Err(std::io::Error::other(msg));
        }
        if lie && fail::eval("raft::skip-fsync", |_| ()).is_some() {
            let mut w = WriteOptions::default();
            w.set_sync(false);
            w.disable_wal(true);
            return Ok((w, false));
        }
    }
    let _ = lie;
    Ok((synced(), true))
}

// ---- durable marker -----------------------------------------------------------------------

/// Name of the durable marker file, beside the database files in the data directory.
pub const MARKER_FILE: &str = "RAFT-DURABLE";

/// The durable marker: the log's end and the vote's term as last synced, kept in a small file
/// outside RocksDB, so a WAL that lost acknowledged records without a checksum error (cut at a
/// record boundary, or a torn tail RocksDB tolerates) is caught at open: the log is then
/// shorter than the marker says. Raised (one 64-byte `pwrite`, no fsync of its own) after each
/// synced append or vote, so it never names more than was synced; lowered and fsynced before
/// a truncation, so it never names entries a truncation legitimately removed. Losing a raise
/// (power loss before the page cache reached the disk) only weakens the check.
struct Marker {
    file: std::fs::File,
    /// One past the last log index synced (0: no entry).
    next: u64,
    /// The highest vote term synced.
    term: u64,
}

impl Marker {
    fn encode(next: u64, term: u64) -> [u8; 64] {
        let body = format!("suanli-durable v1 next={next} term={term}");
        let line = format!("{body} sum={:016x}", fnv1a(body.as_bytes()));
        let mut buf = [b' '; 64];
        buf[..line.len()].copy_from_slice(line.as_bytes());
        buf[63] = b'\n';
        buf
    }

    /// `(next, term)`, or `None` for a file that is not a marker this build wrote.
    fn decode(bytes: &[u8]) -> Option<(u64, u64)> {
        let text = std::str::from_utf8(bytes).ok()?.trim_end();
        let (body, sum) = text.rsplit_once(" sum=")?;
        if u64::from_str_radix(sum, 16).ok()? != fnv1a(body.as_bytes()) {
            return None;
        }
        let mut parts = body.strip_prefix("suanli-durable v1 ")?.split(' ');
        let next = parts.next()?.strip_prefix("next=")?.parse().ok()?;
        let term = parts.next()?.strip_prefix("term=")?.parse().ok()?;
        Some((next, term))
    }

    fn write(&mut self, next: u64, term: u64, sync: bool) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        self.file.write_all_at(&Self::encode(next, term), 0)?;
        if sync {
            self.file.sync_data()?;
        }
        self.next = next;
        self.term = term;
        Ok(())
    }

    /// Raises the marker after a synced write; a failure only weakens the check (logged).
    fn raise(m: &std::sync::Mutex<Marker>, next: u64, term: u64) {
        let mut g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (n, t) = (g.next.max(next), g.term.max(term));
        if (n, t) != (g.next, g.term)
            && let Err(e) = g.write(n, t, false)
        {
            tracing::warn!(error = %e, "could not raise the durable marker; the rollback check at the next start is weaker");
        }
    }
}

/// The index a key of the logs column family names (big-endian u64).
fn log_index(key: &[u8]) -> Result<u64, SErr> {
    let bytes =
        key.try_into().map_err(|_| StorageIOError::read_logs(&std::io::Error::other("log key is not 8 bytes")))?;
    Ok(u64::from_be_bytes(bytes))
}

fn cf<'a>(db: &'a DB, name: &str) -> Result<&'a rocksdb::ColumnFamily, SErr> {
    db.cf_handle(name)
        .ok_or_else(|| StorageIOError::read(&std::io::Error::other(format!("column family {name} is missing"))).into())
}

fn to_json<T: Serialize>(v: &T) -> Result<Vec<u8>, SErr> {
    serde_json::to_vec(v).map_err(|e| StorageIOError::write(&e).into())
}

fn encode_entry<C: StoreConfig>(e: &Entry<C>) -> Result<Vec<u8>, SErr> {
    entry_frame(e).map_err(|err| StorageIOError::write_logs(&err).into())
}

fn read_error(e: FrameError) -> SErr {
    StorageIOError::read_logs(&e).into()
}

/// An entry as stored (its frame).
fn decode<C: StoreConfig>(v: Box<[u8]>) -> Result<Entry<C>, SErr> {
    decode_entry(Bytes::from(Vec::from(v))).map_err(read_error)
}

fn from_json<T: DeserializeOwned>(b: &[u8]) -> Result<T, SErr> {
    serde_json::from_slice(b).map_err(|e| StorageIOError::read(&e).into())
}

fn get_meta<T: DeserializeOwned>(db: &DB, key: &[u8]) -> Result<Option<T>, SErr> {
    let v = db.get_cf(cf(db, CF_META)?, key).map_err(|e| StorageIOError::read(&e))?;
    v.map(|b| from_json(&b)).transpose()
}

/// Runs a blocking RocksDB write off the async executor.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, SErr> + Send + 'static) -> Result<T, SErr> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SErr::from(StorageIOError::write(&std::io::Error::other(e.to_string()))))?
}

// ---- log ----------------------------------------------------------------------------------

/// The stored log's shape, as read at open.
struct Stored {
    last_purged: Option<LogId<u64>>,
    /// The first index kept.
    first: Option<u64>,
    /// The first gap between kept entries (`from..=to` missing).
    hole: Option<(u64, u64)>,
    /// The last log id (the last entry, or the purged id).
    last: Option<LogId<u64>>,
    vote_term: u64,
    committed: Option<LogId<u64>>,
}

/// The raft log in RocksDB.
pub struct LogStore<C> {
    db: Arc<DB>,
    /// Byte budget of one replication read ([`crate::RaftSettings::max_append_bytes`]).
    append_bytes: usize,
    /// The durable marker, when opened with [`LogStore::with_marker`].
    marker: Option<Arc<std::sync::Mutex<Marker>>>,
    _c: PhantomData<C>,
}

impl<C> Clone for LogStore<C> {
    fn clone(&self) -> Self {
        Self { db: self.db.clone(), append_bytes: self.append_bytes, marker: self.marker.clone(), _c: PhantomData }
    }
}

impl<C: StoreConfig> LogStore<C> {
    /// A log store over an open database (see [`open_db`]); replication reads are bounded by
    /// entry count only.
    pub fn new(db: Arc<DB>) -> Self {
        Self { db, append_bytes: usize::MAX, marker: None, _c: PhantomData }
    }

    /// Keeps the durable marker ([`MARKER_FILE`] in `dir`): reads it if present (see
    /// [`LogStore::check_at_open`]), else creates it from what the database holds now (a new
    /// data dir, or one written by a build without the marker).
    pub fn with_marker(mut self, dir: &Path) -> Result<Self, SErr> {
        let path = dir.join(MARKER_FILE);
        let io = |e: std::io::Error| {
            SErr::from(StorageIOError::read(&std::io::Error::other(format!("{}: {e}", path.display()))))
        };
        let file =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
        let mut bytes = Vec::new();
        {
            use std::io::Read as _;
            (&file).read_to_end(&mut bytes).map_err(io)?;
        }
        let found = Marker::decode(&bytes);
        if found.is_none() && !bytes.is_empty() {
            tracing::warn!(path = %path.display(), "the durable marker is unreadable (torn by a power loss?); rewriting it from the log, without the rollback check this time");
        }
        let mut m = Marker { file, next: 0, term: 0 };
        match found {
            Some((next, term)) => (m.next, m.term) = (next, term),
            None => {
                let st = self.stored()?;
                let next = st.last.map_or(0, |l| l.index.saturating_add(1));
                m.write(next, st.vote_term, true).map_err(io)?;
            }
        }
        self.marker = Some(Arc::new(std::sync::Mutex::new(m)));
        Ok(self)
    }

    /// What the marker says was synced: `(one past the last log index, vote term)`.
    pub fn marker(&self) -> Option<(u64, u64)> {
        self.marker.as_ref().map(|m| {
            let g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (g.next, g.term)
        })
    }

    /// Reads the stored log's shape (walks every key of the log: at open only).
    fn stored(&self) -> Result<Stored, SErr> {
        let last_purged: Option<LogId<u64>> = get_meta(&self.db, KEY_LAST_PURGED)?;
        let vote: Option<Vote<u64>> = get_meta(&self.db, KEY_VOTE)?;
        let committed: Option<Option<LogId<u64>>> = get_meta(&self.db, KEY_COMMITTED)?;
        let logs = cf(&self.db, CF_LOGS)?;
        let mut it = self.db.raw_iterator_cf(logs);
        it.seek_to_first();
        let mut first = None;
        let mut prev: Option<u64> = None;
        let mut hole = None;
        while it.valid() {
            let idx = log_index(it.key().unwrap_or_default())?;
            first.get_or_insert(idx);
            if hole.is_none()
                && let Some(p) = prev
                && idx != p.saturating_add(1)
            {
                hole = Some((p.saturating_add(1), idx.saturating_sub(1)));
            }
            prev = Some(idx);
            it.next();
        }
        it.status().map_err(|e| StorageIOError::read_logs(&e))?;
        let last_entry = self.last_entry()?;
        Ok(Stored {
            last_purged,
            first,
            hole,
            last: last_entry.or(last_purged),
            vote_term: vote.map_or(0, |v| v.leader_id.term),
            committed: committed.flatten(),
        })
    }

    /// The consistency checks at open: the log has no hole between the purged id and its last
    /// entry, holds every entry the persisted commit index and the snapshot (`snapshot`: its
    /// last log id) cover, is not older than the vote's term, and is not shorter (nor the vote
    /// older) than the durable marker says was synced. `Err` says what was found, in numbers.
    pub fn check_at_open(&self, snapshot: Option<LogId<u64>>) -> Result<Result<(), String>, SErr> {
        let st = self.stored()?;
        let last = st.last.map(|l| l.index);
        let show = |i: Option<u64>| i.map_or_else(|| "none".to_owned(), |i| i.to_string());
        let mut found = Vec::new();
        let start = st.last_purged.map_or(0, |p| p.index.saturating_add(1));
        if let Some(first) = st.first
            && first != start
        {
            found.push(format!(
                "the log starts at index {first} but entries are purged only up to {}: a hole",
                show(st.last_purged.map(|p| p.index))
            ));
        }
        if let Some((a, b)) = st.hole {
            found.push(format!("entries {a}..={b} are missing from the log: a hole"));
        }
        if let Some(c) = st.committed
            && last < Some(c.index)
        {
            found.push(format!("the last log index is {} but index {} was committed here", show(last), c.index));
        }
        if let Some(s) = snapshot
            && last < Some(s.index)
        {
            found.push(format!(
                "the last log index is {} but the state machine's snapshot covers up to {}",
                show(last),
                s.index
            ));
        }
        let last_term = st.last.map_or(0, |l| l.leader_id.term);
        if st.vote_term < last_term {
            found.push(format!("the vote's term is {} but the last log entry's term is {last_term}", st.vote_term));
        }
        if let Some((next, term)) = self.marker() {
            let have = last.map_or(0, |l| l.saturating_add(1));
            if have < next {
                found.push(format!(
                    "the log ends at index {} but entries up to {} were synced here ({MARKER_FILE}): the log went back",
                    show(last),
                    next - 1
                ));
            }
            if st.vote_term < term {
                found.push(format!(
                    "the vote's term is {} but term {term} was voted in here ({MARKER_FILE}): the vote went back",
                    st.vote_term
                ));
            }
        }
        Ok(if found.is_empty() { Ok(()) } else { Err(found.join("; ")) })
    }

    /// Bounds what one replication read returns to about `bytes` of stored entries (at least
    /// one entry), so one AppendEntries stays small whatever the entries' size.
    pub fn with_append_bytes(mut self, bytes: usize) -> Self {
        self.append_bytes = bytes;
        self
    }

    /// Entries with index in `range`, in order, stopping early once `budget` bytes are read
    /// (never before the first entry).
    fn read_entries(&self, range: impl RangeBounds<u64>, budget: usize) -> Result<Vec<Entry<C>>, SErr> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let logs = cf(&self.db, CF_LOGS)?;
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for r in self.db.iterator_cf(logs, IteratorMode::From(&start.to_be_bytes(), Direction::Forward)) {
            let (k, v) = r.map_err(|e| StorageIOError::read_logs(&e))?;
            let idx = log_index(&k)?;
            if !range.contains(&idx) || (!out.is_empty() && bytes.saturating_add(v.len()) > budget) {
                break;
            }
            bytes = bytes.saturating_add(v.len());
            out.push(decode(v)?);
        }
        Ok(out)
    }

    /// `(index, term, hash of the entry's frame)` for the entries kept in `from..=to`, at most
    /// `max` of them, in index order: what a consistency check compares across servers (a
    /// committed index must hold the same entry everywhere).
    /// Blocking; a short range read.
    pub fn digests(&self, from: u64, to: u64, max: usize) -> Result<Vec<(u64, u64, u64)>, SErr> {
        let logs = cf(&self.db, CF_LOGS)?;
        let mut out = Vec::new();
        for r in self.db.iterator_cf(logs, IteratorMode::From(&from.to_be_bytes(), Direction::Forward)) {
            let (k, v) = r.map_err(|e| StorageIOError::read_logs(&e))?;
            let idx = log_index(&k)?;
            if idx > to || out.len() >= max {
                break;
            }
            let frame = Bytes::from(Vec::from(v));
            let e: Entry<C> = decode_entry(frame.clone()).map_err(read_error)?;
            out.push((idx, e.log_id.leader_id.term, fnv1a(&frame)));
        }
        Ok(out)
    }

    /// The last index this node persisted as committed (0 when none).
    pub fn committed_index(&self) -> Result<u64, SErr> {
        let c: Option<Option<LogId<u64>>> = get_meta(&self.db, KEY_COMMITTED)?;
        Ok(c.flatten().map_or(0, |l| l.index))
    }

    /// The first and last index in the log (`None` when empty).
    pub fn bounds(&self) -> Result<Option<(u64, u64)>, SErr> {
        let logs = cf(&self.db, CF_LOGS)?;
        let first = match self.db.iterator_cf(logs, IteratorMode::Start).next() {
            None => return Ok(None),
            Some(r) => log_index(&r.map_err(|e| StorageIOError::read_logs(&e))?.0)?,
        };
        Ok(self.last_entry()?.map(|l| (first, l.index)))
    }

    fn last_entry(&self) -> Result<Option<LogId<u64>>, SErr> {
        let mut it = self.db.iterator_cf(cf(&self.db, CF_LOGS)?, IteratorMode::End);
        match it.next() {
            None => Ok(None),
            Some(r) => {
                let (_, v) = r.map_err(|e| StorageIOError::read_logs(&e))?;
                let e: Entry<C> = decode(v)?;
                Ok(Some(e.log_id))
            }
        }
    }
}

impl<C: StoreConfig> RaftLogReader<C> for LogStore<C> {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<C>>, SErr> {
        self.read_entries(range, usize::MAX)
    }

    /// What replication sends in one AppendEntries: openraft 0.9 lets this return a prefix of
    /// the range, and the byte budget keeps a catching-up follower's batch inside the RPC's
    /// deadline even when every entry is a large group commit.
    async fn limited_get_log_entries(&mut self, start: u64, end: u64) -> Result<Vec<Entry<C>>, SErr> {
        self.read_entries(start..end, self.append_bytes)
    }
}

impl<C: StoreConfig> RaftLogStorage<C> for LogStore<C> {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, SErr> {
        let last_purged: Option<LogId<u64>> = get_meta(&self.db, KEY_LAST_PURGED)?;
        let last = self.last_entry()?.or(last_purged);
        Ok(LogState { last_purged_log_id: last_purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), SErr> {
        let db = self.db.clone();
        let bytes = to_json(vote)?;
        let marker = self.marker.clone();
        let term = vote.leader_id.term;
        blocking(move || {
            let (w, _) = durable(false).map_err(|e| StorageIOError::write_vote(&e))?;
            db.put_cf_opt(cf(&db, CF_META)?, KEY_VOTE, bytes, &w).map_err(|e| StorageIOError::write_vote(&e))?;
            if let Some(m) = &marker {
                Marker::raise(m, 0, term);
            }
            Ok(())
        })
        .await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, SErr> {
        get_meta(&self.db, KEY_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), SErr> {
        // Not synced: losing it only means re-applying a little more of the log at start.
        let bytes = to_json(&committed)?;
        #[allow(unused_mut)]
        let mut w = WriteOptions::default();
        #[cfg(feature = "failpoints")]
        if fail::eval("raft::skip-fsync", |_| ()).is_some() {
            w.disable_wal(true); // the lying disk of `durable` loses this pointer with the entries
        }
        self.db.put_cf_opt(cf(&self.db, CF_META)?, KEY_COMMITTED, bytes, &w).map_err(|e| StorageIOError::write(&e))?;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<u64>>, SErr> {
        Ok(get_meta::<Option<LogId<u64>>>(&self.db, KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<C>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<C>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = WriteBatch::default();
        let logs = cf(&self.db, CF_LOGS)?;
        // The lying disk of `raft::skip-fsync` still keeps membership entries, so a cluster
        // that lost its acknowledged writes comes back (and the checker can see what is
        // missing) instead of staying uninitialized.
        let mut lie = true;
        let mut last = None;
        for e in entries {
            lie &= !matches!(e.payload, EntryPayload::Membership(_));
            batch.put_cf(logs, e.log_id.index.to_be_bytes(), encode_entry(&e)?);
            last = Some(e.log_id.index);
        }
        let db = self.db.clone();
        let marker = self.marker.clone();
        let res = blocking(move || {
            let (w, really) = durable(lie).map_err(|e| StorageIOError::write_logs(&e))?;
            db.write_opt(batch, &w).map_err(|e| StorageIOError::write_logs(&e))?;
            if really && let (Some(m), Some(last)) = (&marker, last) {
                Marker::raise(m, last.saturating_add(1), 0);
            }
            Ok(())
        })
        .await;
        match &res {
            Ok(()) => callback.log_io_completed(Ok(())),
            Err(e) => callback.log_io_completed(Err(std::io::Error::other(e.to_string()))),
        }
        res
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        let db = self.db.clone();
        let marker = self.marker.clone();
        blocking(move || {
            if let Some(m) = &marker {
                // Lowered (and synced) first: a crash between the two leaves a marker that
                // names no removed entry.
                let mut g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if g.next > log_id.index {
                    let term = g.term;
                    g.write(log_id.index, term, true).map_err(|e| StorageIOError::write_logs(&e))?;
                }
            }
            let mut batch = WriteBatch::default();
            let logs = cf(&db, CF_LOGS)?;
            batch.delete_range_cf(logs, log_id.index.to_be_bytes(), u64::MAX.to_be_bytes());
            batch.delete_cf(logs, u64::MAX.to_be_bytes());
            db.write_opt(batch, &synced()).map_err(|e| StorageIOError::write_logs(&e))?;
            Ok(())
        })
        .await
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        let db = self.db.clone();
        let meta = to_json(&log_id)?;
        blocking(move || {
            let mut batch = WriteBatch::default();
            batch.put_cf(cf(&db, CF_META)?, KEY_LAST_PURGED, meta);
            batch.delete_range_cf(cf(&db, CF_LOGS)?, 0u64.to_be_bytes(), log_id.index.saturating_add(1).to_be_bytes());
            db.write_opt(batch, &synced()).map_err(|e| StorageIOError::write_logs(&e))?;
            Ok(())
        })
        .await
    }
}

/// Records a halt (logged once, here, where it is decided).
fn halt(at: &LogId<u64>, kind: String, reason: String) -> Halt {
    tracing::error!(index = at.index, term = at.leader_id.term, %kind, %reason, "cannot apply this log entry: the group is read-only on this server until a build that can apply it restarts it, or an operator skips the entry (docs/operations.md)");
    Halt { index: at.index, term: at.leader_id.term, kind, reason }
}

// ---- state machine ------------------------------------------------------------------------

/// The applied machine with the raft bookkeeping that goes with it.
pub struct Applied<M> {
    /// The application's state.
    pub machine: M,
    /// Last log entry applied.
    pub last_applied: Option<LogId<u64>>,
    /// Last membership applied.
    pub membership: StoredMembership<u64, ServerNode>,
    /// Set when an entry could not be applied: the group is read-only from it on (see
    /// [`Halt`]). Never persisted: a restart re-applies the log and halts at the same entry
    /// again, unless the build now knows it.
    pub halt: Option<Halt>,
    /// Digests of the most recently applied entries (see [`DigestWindow`]).
    pub digests: DigestWindow,
}

impl<M: Machine> Applied<M> {
    /// Records entry `log_id` as applied, with what it carried and what it answered.
    fn advance(&mut self, log_id: LogId<u64>, payload: &[u8], response: &[u8]) {
        let mut h = fnv1a_extend(self.machine.log_digest(), &[0x5a]);
        h = fnv1a_extend(h, &log_id.index.to_le_bytes());
        h = fnv1a_extend(h, &log_id.leader_id.term.to_le_bytes());
        h = fnv1a_extend(h, &(payload.len() as u64).to_le_bytes());
        h = fnv1a_extend(h, payload);
        h = fnv1a_extend(h, response);
        self.machine.set_log_digest(h);
        self.digests.push(log_id.index, h);
        self.last_applied = Some(log_id);
    }

    /// Starts the window over at the machine's own index (a restored or installed snapshot).
    fn restart_digests(&mut self) {
        let index = self.last_applied.map_or(0, |l| l.index);
        let d = self.machine.log_digest();
        self.digests.reset(index, d);
    }
}

/// Why a replica stopped applying its log, and where. The server stays up, read-only for the
/// group: the state stays as it was before `index`, and every later entry is answered
/// [`Machine::halted_response`] until a build that can apply the entry restarts the server
/// or the operator commits the machine's skip order for it ([`Machine::resumes`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Halt {
    /// The entry that could not be applied.
    pub index: u64,
    /// Its term.
    pub term: u64,
    /// Its command kind, when the envelope could be read (empty otherwise).
    pub kind: String,
    /// What this build could not do with it, and what would.
    pub reason: String,
}

/// Read access to the applied state machine, shared with the raft storage.
pub struct MachineHandle<M> {
    shared: Arc<RwLock<Applied<M>>>,
    applied: watch::Receiver<u64>,
}

impl<M> Clone for MachineHandle<M> {
    fn clone(&self) -> Self {
        Self { shared: self.shared.clone(), applied: self.applied.clone() }
    }
}

impl<M> MachineHandle<M> {
    /// The halt, when this replica stopped applying its log (the group is read-only here).
    pub fn halt(&self) -> Option<Halt> {
        read_lock(&self.shared).halt.clone()
    }

    /// Reads the local state as applied so far. Possibly stale on a follower; for a
    /// linearizable read call [`crate::linearizable_read`] (or `Raft::ensure_linearizable`
    /// first).
    pub fn read<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        f(&read_lock(&self.shared).machine)
    }

    /// Reads the local state together with the index it was applied up to (one lock, so the
    /// two belong together).
    pub fn read_applied<R>(&self, f: impl FnOnce(u64, &M) -> R) -> R {
        let g = read_lock(&self.shared);
        f(g.last_applied.map_or(0, |l| l.index), &g.machine)
    }

    /// Reads the applied machine with its raft bookkeeping (last applied log id,
    /// membership), under one lock.
    pub fn read_full<R>(&self, f: impl FnOnce(&Applied<M>) -> R) -> R {
        f(&read_lock(&self.shared))
    }

    /// The rolling log digest after entry `index` was applied here (see [`DigestWindow`]).
    pub fn digest_at(&self, index: u64) -> Result<u64, DigestMiss> {
        read_lock(&self.shared).digests.at(index)
    }

    /// The last applied index and the log digest there.
    pub fn last_digest(&self) -> (u64, u64) {
        read_lock(&self.shared).digests.last()
    }

    /// Last applied log index (0 before any).
    pub fn applied_index(&self) -> u64 {
        *self.applied.borrow()
    }

    /// A receiver that changes after every applied batch (its value: last applied index).
    /// Watch streams wait on it instead of polling.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.applied.clone()
    }

    /// Waits until the storage behind this handle is gone (raft shut down, its state-machine
    /// worker and any snapshot build finished), so the data directory may be opened again.
    pub async fn closed(&self) {
        let mut rx = self.applied.clone();
        while rx.changed().await.is_ok() {}
    }

    /// Waits until `index` is applied locally.
    pub async fn wait_applied(&self, index: u64) {
        let mut rx = self.applied.clone();
        // An error means the storage was dropped: nothing more will be applied.
        let _ = rx.wait_for(|&i| i >= index).await;
    }
}

fn read_lock<M>(l: &RwLock<Applied<M>>) -> RwLockReadGuard<'_, Applied<M>> {
    // A panic while applying would leave the lock poisoned; the data is still the last
    // consistent state (apply never leaves it half-changed on a refused command).
    l.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write_lock<M>(l: &RwLock<Applied<M>>) -> RwLockWriteGuard<'_, Applied<M>> {
    l.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The state machine storage: the machine in memory, snapshots in RocksDB.
pub struct StateMachineStore<C, M> {
    db: Arc<DB>,
    shared: Arc<RwLock<Applied<M>>>,
    applied_tx: Arc<watch::Sender<u64>>,
    applied_rx: watch::Receiver<u64>,
    _c: PhantomData<C>,
}

impl<C: StoreConfig, M: Machine<Response = C::R>> StateMachineStore<C, M> {
    /// Opens the state machine over a database: restores the latest persisted snapshot, if
    /// any. The log after it is re-applied by openraft at start.
    pub fn open(db: Arc<DB>) -> Result<Self, SErr> {
        let meta: Option<SnapshotMeta<u64, ServerNode>> = {
            let v =
                db.get_cf(cf(&db, CF_SNAPSHOT)?, KEY_SNAP_META).map_err(|e| StorageIOError::read_snapshot(None, &e))?;
            v.map(|b| from_json(&b)).transpose()?
        };
        let applied = match meta {
            None => Applied {
                machine: M::empty(),
                last_applied: None,
                membership: StoredMembership::default(),
                halt: None,
                digests: DigestWindow::default(),
            },
            Some(meta) => {
                let data = db
                    .get_cf(cf(&db, CF_SNAPSHOT)?, KEY_SNAP_DATA)
                    .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?
                    .ok_or_else(|| {
                        StorageIOError::read_snapshot(
                            Some(meta.signature()),
                            &std::io::Error::other("snapshot data is missing"),
                        )
                    })?;
                let machine = M::restore(&data)
                    .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &std::io::Error::other(e)))?;
                Applied {
                    machine,
                    last_applied: meta.last_log_id,
                    membership: meta.last_membership.clone(),
                    halt: None,
                    digests: DigestWindow::default(),
                }
            }
        };
        let mut applied = applied;
        applied.restart_digests();
        let index = applied.last_applied.map_or(0, |l| l.index);
        let (tx, rx) = watch::channel(index);
        Ok(Self {
            db,
            shared: Arc::new(RwLock::new(applied)),
            applied_tx: Arc::new(tx),
            applied_rx: rx,
            _c: PhantomData,
        })
    }

    /// A read handle on the applied machine.
    pub fn handle(&self) -> MachineHandle<M> {
        MachineHandle { shared: self.shared.clone(), applied: self.applied_rx.clone() }
    }

    /// The snapshot's last log id, as persisted (what the machine is restored from at open).
    pub fn snapshot_log_id(db: &DB) -> Result<Option<LogId<u64>>, SErr> {
        let v = db.get_cf(cf(db, CF_SNAPSHOT)?, KEY_SNAP_META).map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        let meta: Option<SnapshotMeta<u64, ServerNode>> = v.map(|b| from_json(&b)).transpose()?;
        Ok(meta.and_then(|m| m.last_log_id))
    }

    fn persist_snapshot(db: &DB, meta: &SnapshotMeta<u64, ServerNode>, data: &[u8]) -> Result<(), SErr> {
        Self::persist_snapshot_purging(db, meta, data, false)
    }

    /// Persists a snapshot; with `installed` (one received from the leader), a log that ends
    /// before the snapshot is purged up to it in the same write, so the stored log never ends
    /// before the stored snapshot (what [`LogStore::check_at_open`] relies on; openraft would
    /// purge it right after anyway).
    fn persist_snapshot_purging(
        db: &DB,
        meta: &SnapshotMeta<u64, ServerNode>,
        data: &[u8],
        installed: bool,
    ) -> Result<(), SErr> {
        let mut batch = WriteBatch::default();
        let snap = cf(db, CF_SNAPSHOT)?;
        batch.put_cf(snap, KEY_SNAP_META, to_json(meta)?);
        batch.put_cf(snap, KEY_SNAP_DATA, data);
        if installed && let Some(last) = meta.last_log_id {
            let logs = cf(db, CF_LOGS)?;
            let log_last = match db.iterator_cf(logs, IteratorMode::End).next() {
                None => None,
                Some(r) => Some(log_index(&r.map_err(|e| StorageIOError::read_logs(&e))?.0)?),
            };
            let purged: Option<LogId<u64>> = get_meta(db, KEY_LAST_PURGED)?;
            let ends = log_last.or(purged.map(|p| p.index));
            if ends < Some(last.index) {
                batch.put_cf(cf(db, CF_META)?, KEY_LAST_PURGED, to_json(&last)?);
                batch.delete_range_cf(logs, 0u64.to_be_bytes(), last.index.saturating_add(1).to_be_bytes());
            }
        }
        db.write_opt(batch, &synced()).map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        Ok(())
    }
}

/// Builds snapshots from a consistent copy of the machine.
pub struct SnapshotBuilder<C, M> {
    db: Arc<DB>,
    shared: Arc<RwLock<Applied<M>>>,
    /// Held so that [`MachineHandle::closed`] also waits for snapshot builds in flight.
    _applied_tx: Arc<watch::Sender<u64>>,
    _c: PhantomData<C>,
}

impl<C: StoreConfig, M: Machine<Response = C::R>> RaftSnapshotBuilder<C> for SnapshotBuilder<C, M> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<C>, SErr> {
        let (data, last_log_id, membership) = {
            let a = read_lock(&self.shared);
            let data =
                a.machine.snapshot().map_err(|e| StorageIOError::write_snapshot(None, &std::io::Error::other(e)))?;
            (data, a.last_applied, a.membership.clone())
        };
        let snapshot_id = match last_log_id {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => "0-0-0".to_owned(),
        };
        let meta = SnapshotMeta { last_log_id, last_membership: membership, snapshot_id };
        let db = self.db.clone();
        let (m2, d2) = (meta.clone(), data.clone());
        blocking(move || StateMachineStore::<C, M>::persist_snapshot(&db, &m2, &d2)).await?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

impl<C: StoreConfig, M: Machine<Response = C::R>> RaftStateMachine<C> for StateMachineStore<C, M> {
    type SnapshotBuilder = SnapshotBuilder<C, M>;

    async fn applied_state(&mut self) -> Result<(Option<LogId<u64>>, StoredMembership<u64, ServerNode>), SErr> {
        let a = read_lock(&self.shared);
        Ok((a.last_applied, a.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<C::R>, SErr>
    where
        I: IntoIterator<Item = Entry<C>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut out = Vec::new();
        let last = {
            let mut a = write_lock(&self.shared);
            for e in entries {
                if let Some(h) = &a.halt {
                    // Read-only: nothing is applied until the skip order for this halt.
                    let resumes = match &e.payload {
                        EntryPayload::Normal(raw) => raw.decode::<M::Command>().is_ok_and(|c| M::resumes(&c, h.index)),
                        _ => false,
                    };
                    if resumes {
                        tracing::warn!(
                            index = e.log_id.index,
                            skipped_from = h.index,
                            "skip order applied: entries from the halted one to here are skipped; applying again"
                        );
                        a.halt = None;
                        let r = M::internal_response();
                        let rb = serde_json::to_vec(&r).unwrap_or_default();
                        let payload = match &e.payload {
                            EntryPayload::Normal(raw) => raw.bytes().clone(),
                            _ => Bytes::new(),
                        };
                        a.advance(e.log_id, &payload, &rb);
                        out.push(r);
                    } else {
                        out.push(M::halted_response(h));
                    }
                    continue;
                }
                let mut payload = Bytes::new();
                let resp = match e.payload {
                    EntryPayload::Blank => M::internal_response(),
                    EntryPayload::Normal(raw) => {
                        payload = raw.bytes().clone();
                        // Bytes a server of this group encoded. One this build cannot read or
                        // may not apply (a kind too new for it) halts the group here, read-only,
                        // with the state unchanged: never a storage error, which would stop
                        // raft and, at every restart, the server.
                        let checked = raw
                            .decode::<M::Command>()
                            .map_err(|err| (String::new(), format!("this build cannot decode it: {err}")))
                            .and_then(|cmd| match M::check(&cmd) {
                                Ok(()) => Ok(cmd),
                                Err(why) => Err((M::kind(&cmd), why)),
                            });
                        match checked {
                            Ok(cmd) => {
                                let r = a.machine.apply(cmd);
                                match M::fatal(&r) {
                                    None => r,
                                    Some(why) => {
                                        let h = halt(&e.log_id, String::new(), why);
                                        let r = M::halted_response(&h);
                                        a.halt = Some(h);
                                        out.push(r);
                                        continue;
                                    }
                                }
                            }
                            Err((kind, why)) => {
                                let h = halt(&e.log_id, kind, why);
                                let r = M::halted_response(&h);
                                a.halt = Some(h);
                                out.push(r);
                                continue;
                            }
                        }
                    }
                    EntryPayload::Membership(m) => {
                        payload = Bytes::from(serde_json::to_vec(&m).unwrap_or_default());
                        a.membership = StoredMembership::new(Some(e.log_id), m);
                        M::internal_response()
                    }
                };
                let rb = serde_json::to_vec(&resp).unwrap_or_default();
                a.advance(e.log_id, &payload, &rb);
                out.push(resp);
            }
            a.last_applied.map_or(0, |l| l.index)
        };
        self.applied_tx.send_replace(last);
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            db: self.db.clone(),
            shared: self.shared.clone(),
            _applied_tx: self.applied_tx.clone(),
            _c: PhantomData,
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, ServerNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let data = snapshot.into_inner();
        let machine = M::restore(&data)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &std::io::Error::other(e)))?;
        let db = self.db.clone();
        let m2 = meta.clone();
        blocking(move || Self::persist_snapshot_purging(&db, &m2, &data, true)).await?;
        let last = {
            let mut a = write_lock(&self.shared);
            a.machine = machine;
            // The snapshot's sender applied what halted here: nothing is left to skip.
            a.halt = None;
            a.last_applied = meta.last_log_id;
            a.membership = meta.last_membership.clone();
            a.restart_digests();
            a.last_applied.map_or(0, |l| l.index)
        };
        self.applied_tx.send_replace(last);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<C>>, SErr> {
        let snap = cf(&self.db, CF_SNAPSHOT)?;
        let Some(meta) = self.db.get_cf(snap, KEY_SNAP_META).map_err(|e| StorageIOError::read_snapshot(None, &e))?
        else {
            return Ok(None);
        };
        let meta: SnapshotMeta<u64, ServerNode> = from_json(&meta)?;
        let data = self
            .db
            .get_cf(snap, KEY_SNAP_DATA)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?
            .unwrap_or_default();
        Ok(Some(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TypeConfig;
    use openraft::{CommittedLeaderId, RaftLogReader};

    /// Stores entries 1..=n whose commands are `size` bytes of JSON each.
    fn log_of(n: u64, size: usize) -> (tempfile::TempDir, LogStore<TypeConfig>) {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = open_db(dir.path()).expect("db");
        let log = LogStore::<TypeConfig>::new(db.clone());
        let logs = cf(&db, CF_LOGS).expect("cf");
        for i in 1..=n {
            let cmd = LogCommand::encode(&"x".repeat(size)).expect("encodes");
            let e = Entry::<TypeConfig> {
                log_id: LogId::new(CommittedLeaderId::new(1, 1), i),
                payload: EntryPayload::Normal(cmd),
            };
            db.put_cf(logs, i.to_be_bytes(), encode_entry(&e).expect("frame")).expect("put");
        }
        (dir, log)
    }

    #[tokio::test]
    async fn replication_reads_stop_at_the_byte_budget_but_never_return_nothing() {
        let (_d, log) = log_of(10, 1000);
        // Unbounded: the whole range, as before.
        assert_eq!(log.clone().limited_get_log_entries(1, 11).await.expect("read").len(), 10);
        // ~1,030 bytes stored per entry: a 3,500-byte budget holds 3 of them.
        let mut small = log.clone().with_append_bytes(3500);
        let got = small.limited_get_log_entries(2, 11).await.expect("read");
        assert_eq!(got.iter().map(|e| e.log_id.index).collect::<Vec<_>>(), vec![2, 3, 4]);
        // One entry larger than the budget is still sent, alone.
        let mut tiny = log.clone().with_append_bytes(10);
        assert_eq!(tiny.limited_get_log_entries(5, 11).await.expect("read").len(), 1);
        // Everything else (apply, the storage suite) reads whole ranges whatever the budget.
        assert_eq!(tiny.try_get_log_entries(1..=10).await.expect("read").len(), 10);
        // And the command bytes come back as they were stored.
        let back: Option<String> = match &got[0].payload {
            EntryPayload::Normal(c) => c.decode().ok(),
            _ => None,
        };
        assert_eq!(back.map(|s| s.len()), Some(1000));
    }

    fn entry(index: u64, json: &str) -> Entry<TypeConfig> {
        let cmd: LogCommand = serde_json::from_str(json).expect("json");
        Entry { log_id: LogId::new(CommittedLeaderId::new(1, 1), index), payload: EntryPayload::Normal(cmd) }
    }

    #[tokio::test]
    async fn an_entry_this_build_cannot_apply_halts_the_group_read_only_until_skipped() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = open_db(dir.path()).expect("db");
        let mut sm = StateMachineStore::<TypeConfig, suanli_state::State>::open(db).expect("sm");
        let h = sm.handle();
        let queue = |i: u64, id: &str| {
            entry(
                i,
                &format!(r#"{{"v":1,"kind":"upsert_queue","ignorable":false,"body":{{"queue":{{"id":"{id}"}}}}}}"#),
            )
        };
        let poison = entry(2, r#"{"v":1,"kind":"from_the_future","ignorable":false,"body":{}}"#);
        let garbage = entry(3, r#"{"v":1,"kind":"cancel_job","ignorable":false,"body":{"job":"seven"}}"#);
        let rs = sm.apply([queue(1, "a"), poison, garbage, queue(4, "b")]).await.expect("never a storage error");
        assert_eq!(rs.len(), 4);
        assert!(
            matches!(&rs[1], suanli_state::Response::Halted { index: 2, kind, .. } if kind == "from_the_future"),
            "{:?}",
            rs[1]
        );
        assert!(matches!(rs[3], suanli_state::Response::Halted { index: 2, .. }), "{:?}", rs[3]);
        let halt = h.halt().expect("halted");
        assert_eq!((halt.index, halt.kind.as_str()), (2, "from_the_future"));
        assert!(halt.reason.contains("not ignorable"), "{}", halt.reason);
        // Nothing after the halt was applied, and the applied index stays before it.
        assert_eq!(h.applied_index(), 1);
        assert!(h.read(|s| s.queues().len()) == 1);
        // A skip order for another entry changes nothing; the right one resumes.
        let wrong = entry(5, r#"{"v":1,"kind":"skip_entry","ignorable":false,"body":{"index":3}}"#);
        let skip =
            entry(6, r#"{"v":1,"kind":"skip_entry","ignorable":false,"body":{"index":2,"kind":"from_the_future"}}"#);
        let rs = sm.apply([wrong, skip, queue(7, "c")]).await.expect("applies");
        assert!(matches!(rs[0], suanli_state::Response::Halted { .. }), "{:?}", rs[0]);
        assert!(h.halt().is_none());
        assert_eq!(h.applied_index(), 7);
        let ids: Vec<String> = h.read(|s| s.queues().keys().map(|q| q.0.clone()).collect());
        assert_eq!(ids, vec!["a".to_owned(), "c".to_owned()], "entries 2..=6 skipped, 7 applied");
        // A poison inside a batch halts before any of the batch applies.
        let batch = entry(
            8,
            r#"{"v":1,"kind":"batch","ignorable":false,"body":{"commands":[{"v":1,"kind":"upsert_queue","ignorable":false,"body":{"queue":{"id":"d"}}},{"v":1,"kind":"nope","ignorable":false,"body":{}}]}}"#,
        );
        sm.apply([batch]).await.expect("applies");
        assert_eq!(h.halt().map(|h| (h.index, h.kind)), Some((8, "nope".to_owned())));
        assert_eq!(h.read(|s| s.queues().len()), 2, "no part of the batch applied");
    }

    /// A data dir holding entries `range` (term 2), a vote for term `vote_term`, and the
    /// given committed and purged ids; the durable marker made from it.
    fn shaped(
        range: impl IntoIterator<Item = u64>,
        vote_term: u64,
        committed: Option<u64>,
        purged: Option<u64>,
    ) -> (tempfile::TempDir, Arc<DB>) {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = open_db(dir.path()).expect("db");
        let logs = cf(&db, CF_LOGS).expect("cf");
        for i in range {
            let e = Entry::<TypeConfig> {
                log_id: LogId::new(CommittedLeaderId::new(2, 1), i),
                payload: EntryPayload::Blank,
            };
            db.put_cf(logs, i.to_be_bytes(), encode_entry(&e).expect("frame")).expect("put");
        }
        let meta = cf(&db, CF_META).expect("cf");
        let vote = Vote::new(vote_term, 1);
        db.put_cf(meta, KEY_VOTE, to_json(&vote).expect("json")).expect("put");
        let id = |i: u64| LogId::new(CommittedLeaderId::new(2, 1), i);
        if let Some(c) = committed {
            db.put_cf(meta, KEY_COMMITTED, to_json(&Some(id(c))).expect("json")).expect("put");
        }
        if let Some(p) = purged {
            db.put_cf(meta, KEY_LAST_PURGED, to_json(&id(p)).expect("json")).expect("put");
        }
        (dir, db)
    }

    fn check(dir: &tempfile::TempDir, db: &Arc<DB>, snapshot: Option<u64>) -> Result<(), String> {
        let log = LogStore::<TypeConfig>::new(db.clone()).with_marker(dir.path()).expect("marker");
        log.check_at_open(snapshot.map(|i| LogId::new(CommittedLeaderId::new(2, 1), i))).expect("reads")
    }

    #[test]
    fn a_consistent_log_opens() {
        let (d, db) = shaped(0..=10, 2, Some(10), None);
        assert_eq!(check(&d, &db, Some(8)), Ok(()));
        let (d, db) = shaped(6..=10, 2, Some(9), Some(5));
        assert_eq!(check(&d, &db, Some(5)), Ok(()));
        // Everything purged: the purged id is the log's end.
        let (d, db) = shaped(std::iter::empty(), 2, Some(7), Some(7));
        assert_eq!(check(&d, &db, Some(7)), Ok(()));
    }

    #[test]
    fn a_log_that_ends_before_the_committed_index_is_refused() {
        let (d, db) = shaped(0..=10, 2, Some(14), None);
        let e = check(&d, &db, None).expect_err("refused");
        assert!(e.contains("last log index is 10 but index 14 was committed"), "{e}");
    }

    #[test]
    fn a_log_that_ends_before_the_snapshot_is_refused() {
        let (d, db) = shaped(0..=10, 2, Some(10), None);
        let e = check(&d, &db, Some(12)).expect_err("refused");
        assert!(e.contains("last log index is 10 but the state machine's snapshot covers up to 12"), "{e}");
    }

    #[test]
    fn holes_in_the_log_are_refused() {
        let (d, db) = shaped(0..=10, 2, Some(10), None);
        db.delete_cf(cf(&db, CF_LOGS).expect("cf"), 4u64.to_be_bytes()).expect("delete");
        let e = check(&d, &db, None).expect_err("refused");
        assert!(e.contains("entries 4..=4 are missing"), "{e}");
        // A gap between the purged id and the first entry kept is a hole too.
        let (d, db) = shaped(9..=12, 2, Some(12), Some(5));
        let e = check(&d, &db, None).expect_err("refused");
        assert!(e.contains("starts at index 9 but entries are purged only up to 5"), "{e}");
    }

    #[test]
    fn a_vote_older_than_the_last_entry_is_refused() {
        let (d, db) = shaped(0..=10, 1, Some(10), None);
        let e = check(&d, &db, None).expect_err("refused");
        assert!(e.contains("vote's term is 1 but the last log entry's term is 2"), "{e}");
    }

    #[test]
    fn a_log_or_vote_that_went_back_past_the_durable_marker_is_refused() {
        let (d, db) = shaped(0..=10, 2, Some(8), None);
        assert_eq!(check(&d, &db, None), Ok(()), "first open writes the marker");
        // The WAL loses its tail at a record boundary: entries 9 and 10, and the commit
        // pointer with them; no checksum fails. Only the marker knows.
        db.delete_range_cf(cf(&db, CF_LOGS).expect("cf"), 9u64.to_be_bytes(), 11u64.to_be_bytes()).expect("cut");
        let e = check(&d, &db, None).expect_err("refused");
        assert!(e.contains("log ends at index 8 but entries up to 10 were synced here"), "{e}");
        // The vote going back is caught the same way.
        let (d, db) = shaped(0..=3, 5, None, None);
        assert_eq!(check(&d, &db, None), Ok(()));
        db.put_cf(cf(&db, CF_META).expect("cf"), KEY_VOTE, to_json(&Vote::new(3u64, 1u64)).expect("json"))
            .expect("put");
        let e = check(&d, &db, None).expect_err("refused");
        assert!(e.contains("vote's term is 3 but term 5 was voted in here"), "{e}");
    }

    #[tokio::test]
    async fn the_marker_follows_appends_and_truncations() {
        let (d, db) = shaped(0..=3, 2, Some(1), None);
        let mut log = LogStore::<TypeConfig>::new(db.clone()).with_marker(d.path()).expect("marker");
        assert_eq!(log.marker(), Some((4, 2)));
        // A truncation lowers the marker before it removes entries: the log then opens.
        log.truncate(LogId::new(CommittedLeaderId::new(2, 1), 2)).await.expect("truncate");
        assert_eq!(log.marker(), Some((2, 2)));
        drop(log);
        assert_eq!(check(&d, &db, None), Ok(()));
        // And the marker on disk says what memory said.
        let bytes = std::fs::read(d.path().join(MARKER_FILE)).expect("marker file");
        assert_eq!(Marker::decode(&bytes), Some((2, 2)));
        // A marker that is not one (torn by a power loss) is rewritten, not trusted.
        std::fs::write(d.path().join(MARKER_FILE), b"garbage").expect("write");
        assert_eq!(check(&d, &db, None), Ok(()));
    }
}
