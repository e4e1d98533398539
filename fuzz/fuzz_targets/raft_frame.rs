//! The raft AppendEntries frame and the log entry frame (suanli-raft's `frame.rs`): what a peer
//! sends and what the log store reads back. Properties: decoding never panics; whatever decodes
//! re-encodes, and that encoding decodes and re-encodes to the same bytes; a blank or normal
//! entry re-encodes to exactly the bytes it was read from.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use openraft::EntryPayload;
use suanli_fuzz::{decode_append, decode_entry, encode_append, entry_frame};

fuzz_target!(|data: &[u8]| {
    // The first byte picks the decoder; it sees the rest.
    let Some((&which, rest)) = data.split_first() else { return };
    let b = Bytes::copy_from_slice(rest);
    if which & 1 == 0 {
        let Ok(rpc) = decode_append(b) else { return };
        let once = encode_append(&rpc).expect("a decoded AppendEntries re-encodes");
        let back = decode_append(Bytes::from(once.clone())).expect("a re-encoded AppendEntries decodes");
        assert_eq!(back.entries.len(), rpc.entries.len());
        assert_eq!(encode_append(&back).expect("re-encodes"), once, "the encoding is stable");
    } else {
        let Ok(e) = decode_entry(b) else { return };
        let once = entry_frame(&e).expect("a decoded entry re-encodes");
        if !matches!(e.payload, EntryPayload::Membership(_)) {
            assert_eq!(once.as_slice(), rest, "a blank or normal entry re-encodes to its bytes");
        }
        let back = decode_entry(Bytes::from(once.clone())).expect("a re-encoded entry decodes");
        assert_eq!(back.log_id, e.log_id);
        assert_eq!(entry_frame(&back).expect("re-encodes"), once, "the encoding is stable");
    }
});
