//! The binary frame of a raft log entry, as the log store keeps it and as AppendEntries
//! carries it.
//!
//! ```text
//!  entry:   0xF1 | kind (u8) | term (u64 BE) | leader node (u64 BE) | index (u64 BE) | payload
//!           kind 0 blank (no payload) · 1 normal (the command's JSON, verbatim) ·
//!           2 membership (JSON of openraft's Membership)
//!  append:  0xF1 | header length (u32 BE) | header JSON {vote, prev_log_id, leader_commit}
//!           | entry count (u32 BE) | then per entry: length (u32 BE) | entry frame
//! ```
//!
//! Reading an entry back (openraft does, once per follower to replicate and once to apply)
//! slices the command out of the frame: no JSON is scanned until the command is applied. The
//! first byte is the format's version: anything else is refused with the byte it found.

use crate::machine::LogCommand;
use crate::store::StoreConfig;
use bytes::{BufMut, Bytes};
use openraft::raft::AppendEntriesRequest;
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// First byte of a frame: the format's version.
pub(crate) const FRAME_V1: u8 = 0xF1;
const KIND_BLANK: u8 = 0;
const KIND_NORMAL: u8 = 1;
const KIND_MEMBERSHIP: u8 = 2;
/// Magic, kind, term, node, index.
pub(crate) const ENTRY_HEADER: usize = 1 + 1 + 8 + 8 + 8;

/// A frame that cannot be read; names what is wrong and where.
#[derive(Debug, Error)]
pub enum FrameError {
    /// Shorter than its header or than a length it declares.
    #[error("{what} is truncated: {need} bytes needed at offset {at}, {have} present")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Offset of the field.
        at: usize,
        /// Bytes the field needs.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// Bytes after the last part a frame declares.
    #[error("{what} has {extra} bytes after its end at offset {at}")]
    Trailing {
        /// What was being read.
        what: &'static str,
        /// Where the frame ended.
        at: usize,
        /// Bytes after it.
        extra: usize,
    },
    /// An entry kind this build does not know.
    #[error("log entry kind {0} is unknown (0 blank, 1 normal, 2 membership)")]
    Kind(u8),
    /// Not a frame of this format.
    #[error("{what} starts with byte {byte:#04x}, not a frame (0xf1)")]
    Magic {
        /// What was being read.
        what: &'static str,
        /// The first byte.
        byte: u8,
    },
    /// A JSON part (a membership, the AppendEntries header) does not parse.
    #[error("{what}: {source}")]
    Json {
        /// What was being read.
        what: &'static str,
        /// The parser's error.
        source: serde_json::Error,
    },
}

fn json<T: for<'de> Deserialize<'de>>(what: &'static str, b: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(b).map_err(|source| FrameError::Json { what, source })
}

fn take<const N: usize>(what: &'static str, b: &[u8], at: usize) -> Result<[u8; N], FrameError> {
    b.get(at..at + N).and_then(|s| s.try_into().ok()).ok_or(FrameError::Truncated {
        what,
        at,
        need: N,
        have: b.len().saturating_sub(at),
    })
}

/// Checks the first byte of a frame. `need` is the smallest frame, reported when `b` is empty.
fn check_magic(what: &'static str, b: &[u8], need: usize) -> Result<(), FrameError> {
    match b.first() {
        Some(&FRAME_V1) => Ok(()),
        Some(&byte) => Err(FrameError::Magic { what, byte }),
        None => Err(FrameError::Truncated { what, at: 0, need, have: 0 }),
    }
}

/// Encoded size of `e`'s frame, exactly for blank and normal entries.
pub(crate) fn entry_len<C: StoreConfig>(e: &Entry<C>) -> usize {
    ENTRY_HEADER
        + match &e.payload {
            EntryPayload::Blank => 0,
            EntryPayload::Normal(c) => c.len(),
            EntryPayload::Membership(_) => 256,
        }
}

/// Appends `e`'s frame to `out`.
pub(crate) fn encode_entry<C: StoreConfig>(e: &Entry<C>, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    let kind = match &e.payload {
        EntryPayload::Blank => KIND_BLANK,
        EntryPayload::Normal(_) => KIND_NORMAL,
        EntryPayload::Membership(_) => KIND_MEMBERSHIP,
    };
    out.reserve(entry_len(e));
    out.put_u8(FRAME_V1);
    out.put_u8(kind);
    out.put_u64(e.log_id.leader_id.term);
    out.put_u64(e.log_id.leader_id.node_id);
    out.put_u64(e.log_id.index);
    match &e.payload {
        EntryPayload::Blank => {}
        EntryPayload::Normal(c) => out.extend_from_slice(c.bytes()),
        EntryPayload::Membership(m) => serde_json::to_writer(&mut *out, m)?,
    }
    Ok(())
}

/// `e`'s frame on its own.
pub(crate) fn entry_frame<C: StoreConfig>(e: &Entry<C>) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::with_capacity(entry_len(e));
    encode_entry(e, &mut out)?;
    Ok(out)
}

/// Reads an entry's frame (a normal entry's command shares `b`'s memory).
pub(crate) fn decode_entry<C: StoreConfig>(b: Bytes) -> Result<Entry<C>, FrameError> {
    const WHAT: &str = "log entry";
    check_magic(WHAT, &b, ENTRY_HEADER)?;
    let [kind] = take::<1>(WHAT, &b, 1)?;
    let term = u64::from_be_bytes(take(WHAT, &b, 2)?);
    let node = u64::from_be_bytes(take(WHAT, &b, 10)?);
    let index = u64::from_be_bytes(take(WHAT, &b, 18)?);
    let rest = b.len() - ENTRY_HEADER;
    let payload = match kind {
        // A blank entry has no payload: bytes after its header are refused, not dropped.
        KIND_BLANK if rest > 0 => {
            return Err(FrameError::Trailing { what: "blank log entry", at: ENTRY_HEADER, extra: rest });
        }
        KIND_BLANK => EntryPayload::Blank,
        // A command is never empty (its JSON is at least `{}`).
        KIND_NORMAL if rest == 0 => {
            return Err(FrameError::Truncated {
                what: "normal log entry's command",
                at: ENTRY_HEADER,
                need: 1,
                have: 0,
            });
        }
        KIND_NORMAL => EntryPayload::Normal(LogCommand::from_bytes(b.slice(ENTRY_HEADER..))),
        KIND_MEMBERSHIP => EntryPayload::Membership(json("membership entry", &b[ENTRY_HEADER..])?),
        k => return Err(FrameError::Kind(k)),
    };
    Ok(Entry { log_id: LogId::new(CommittedLeaderId::new(term, node), index), payload })
}

#[derive(Serialize)]
struct HeaderOut<'a> {
    vote: &'a Vote<u64>,
    prev_log_id: Option<LogId<u64>>,
    leader_commit: Option<LogId<u64>>,
}

#[derive(Deserialize)]
struct HeaderIn {
    vote: Vote<u64>,
    prev_log_id: Option<LogId<u64>>,
    leader_commit: Option<LogId<u64>>,
}

/// An AppendEntries request as one frame.
pub(crate) fn encode_append<C: StoreConfig>(rpc: &AppendEntriesRequest<C>) -> Result<Vec<u8>, serde_json::Error> {
    let header = serde_json::to_vec(&HeaderOut {
        vote: &rpc.vote,
        prev_log_id: rpc.prev_log_id,
        leader_commit: rpc.leader_commit,
    })?;
    let size = 9 + header.len() + rpc.entries.iter().map(|e| 4 + entry_len(e)).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.put_u8(FRAME_V1);
    put_len(&mut out, header.len());
    out.extend_from_slice(&header);
    put_len(&mut out, rpc.entries.len());
    for e in &rpc.entries {
        let at = out.len();
        out.put_u32(0);
        encode_entry(e, &mut out)?;
        let len = out.len() - at - 4;
        out[at..at + 4].copy_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    }
    Ok(out)
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
}

/// Reads an AppendEntries request's frame. The entries' commands share `b`'s memory.
pub(crate) fn decode_append<C: StoreConfig>(b: Bytes) -> Result<AppendEntriesRequest<C>, FrameError> {
    const WHAT: &str = "append_entries";
    check_magic(WHAT, &b, 5)?;
    let mut at = 1;
    let next = |at: &mut usize| -> Result<Bytes, FrameError> {
        let len = u32::from_be_bytes(take(WHAT, &b, *at)?) as usize;
        let start = *at + 4;
        let part = b.get(start..start + len).ok_or(FrameError::Truncated {
            what: WHAT,
            at: start,
            need: len,
            have: b.len().saturating_sub(start),
        })?;
        *at = start + len;
        Ok(b.slice_ref(part))
    };
    let h: HeaderIn = json("append_entries header", &next(&mut at)?)?;
    let count = u32::from_be_bytes(take(WHAT, &b, at)?) as usize;
    at += 4;
    // Each entry takes at least its length and header: a count the bytes cannot hold is an
    // error before anything is allocated for it.
    if count > (b.len() - at) / (4 + ENTRY_HEADER) {
        return Err(FrameError::Truncated {
            what: WHAT,
            at,
            need: count.saturating_mul(4 + ENTRY_HEADER),
            have: b.len() - at,
        });
    }
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        entries.push(decode_entry(next(&mut at)?)?);
    }
    if at != b.len() {
        return Err(FrameError::Trailing { what: WHAT, at, extra: b.len() - at });
    }
    Ok(AppendEntriesRequest { vote: h.vote, prev_log_id: h.prev_log_id, entries, leader_commit: h.leader_commit })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TypeConfig;
    use crate::node::ServerNode;
    use openraft::Membership;
    use std::collections::{BTreeMap, BTreeSet};

    type E = Entry<TypeConfig>;

    fn entries() -> Vec<E> {
        let lid = |t, n, i| LogId::new(CommittedLeaderId::new(t, n), i);
        let nodes: BTreeMap<u64, ServerNode> =
            [(1, ServerNode::new("127.0.0.1:1", "")), (2, ServerNode::new("h:2", ""))].into();
        let m = Membership::new(vec![BTreeSet::from([1, 2])], nodes);
        vec![
            E { log_id: lid(1, 1, 1), payload: EntryPayload::Blank },
            E { log_id: lid(1, 1, 2), payload: EntryPayload::Membership(m) },
            E {
                log_id: lid(7, 3, u64::MAX),
                payload: EntryPayload::Normal(
                    LogCommand::encode(&serde_json::json!({"k": "v\"\n", "n": [1, 2]})).expect("ok"),
                ),
            },
        ]
    }

    fn same(a: &E, b: &E) -> bool {
        serde_json::to_string(a).expect("ok") == serde_json::to_string(b).expect("ok")
    }

    #[test]
    fn entries_round_trip_through_frames_and_json_is_refused() {
        for e in entries() {
            let f = Bytes::from(entry_frame(&e).expect("ok"));
            assert!(same(&decode_entry::<TypeConfig>(f).expect("ok"), &e));
            let json = Bytes::from(serde_json::to_vec(&e).expect("ok"));
            let err = decode_entry::<TypeConfig>(json).expect_err("not a frame");
            assert!(matches!(err, FrameError::Magic { byte: b'{', .. }), "{err}");
        }
    }

    #[test]
    fn append_entries_round_trip_and_json_is_refused() {
        let rpc = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(7, 3),
            prev_log_id: Some(LogId::new(CommittedLeaderId::new(6, 2), 41)),
            entries: entries(),
            leader_commit: None,
        };
        let framed = Bytes::from(encode_append(&rpc).expect("ok"));
        let back = decode_append::<TypeConfig>(framed).expect("ok");
        assert_eq!(serde_json::to_string(&back).expect("ok"), serde_json::to_string(&rpc).expect("ok"));
        let json = Bytes::from(serde_json::to_vec(&rpc).expect("ok"));
        assert!(matches!(decode_append::<TypeConfig>(json), Err(FrameError::Magic { byte: b'{', .. })));
        let empty = AppendEntriesRequest::<TypeConfig> { entries: vec![], ..rpc };
        let back = decode_append::<TypeConfig>(encode_append(&empty).expect("ok").into()).expect("ok");
        assert!(back.entries.is_empty());
    }

    #[test]
    fn damaged_frames_are_errors_that_say_where() {
        let f = entry_frame(&entries()[2]).expect("ok");
        for cut in [0, 1, 5, ENTRY_HEADER - 1] {
            let err = decode_entry::<TypeConfig>(Bytes::copy_from_slice(&f[..cut])).expect_err("refused");
            assert!(matches!(err, FrameError::Truncated { .. }), "{cut}: {err}");
        }
        let mut bad = f.clone();
        bad[1] = 9;
        assert!(matches!(decode_entry::<TypeConfig>(bad.into()), Err(FrameError::Kind(9))));
        let err = decode_entry::<TypeConfig>(Bytes::from_static(b"\x00abc")).expect_err("refused");
        assert!(err.to_string().contains("0x00"), "{err}");

        // Found by fuzzing (fuzz/fuzz_targets/raft_frame.rs): a blank entry followed by bytes was
        // read as blank and the bytes dropped; a normal entry with no command was read as one.
        let mut blank = entry_frame(&entries()[0]).expect("ok");
        blank.extend_from_slice(b"\x00\x00\x00\x03{}");
        let err = decode_entry::<TypeConfig>(blank.into()).expect_err("refused");
        assert!(matches!(err, FrameError::Trailing { at: ENTRY_HEADER, extra: 6, .. }), "{err}");
        assert!(err.to_string().contains("blank log entry"), "{err}");
        let empty = f[..ENTRY_HEADER].to_vec();
        let err = decode_entry::<TypeConfig>(empty.into()).expect_err("refused");
        assert!(err.to_string().contains("normal log entry's command is truncated"), "{err}");

        let rpc = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(1, 1),
            prev_log_id: None,
            entries: entries(),
            leader_commit: None,
        };
        let a = encode_append(&rpc).expect("ok");
        // Cut anywhere, even between two entries, the frame is refused.
        let last = entry_len(&rpc.entries[2]) + 4;
        for cut in [1, 3, 10, a.len() - last, a.len() - 1] {
            let err = decode_append::<TypeConfig>(Bytes::copy_from_slice(&a[..cut])).expect_err("refused");
            assert!(err.to_string().contains("append_entries"), "{cut}: {err}");
        }
        let mut long = a.clone();
        long.push(0);
        assert!(matches!(decode_append::<TypeConfig>(long.into()), Err(FrameError::Trailing { extra: 1, .. })));
    }
}
