//! Support for the fuzz targets: suanli-raft's frame codec, compiled from its own source files.
//!
//! The `suanli-raft` crate links RocksDB (librocksdb-sys: bindgen, and 35+ minutes of C++ where
//! built from source), rebuilt whenever RUSTFLAGS change, and cargo fuzz sets its own. The codec itself
//! (`control-plane/raft/src/frame.rs`) needs only the log command (`machine.rs`), the server node
//! (`node.rs`) and the `StoreConfig` bound, so this crate compiles those very files with
//! `#[path]` and supplies the two items of `store.rs` they name (`StoreConfig`, `Halt`, copied:
//! a change there that these copies miss fails this crate's build, not silently). The fuzzed
//! decoder is therefore the one the servers run, byte for byte, without RocksDB.

#![allow(dead_code, missing_docs, unreachable_pub)]

#[path = "../../control-plane/raft/src/frame.rs"]
pub mod frame;
#[path = "../../control-plane/raft/src/machine.rs"]
pub mod machine;
#[path = "../../control-plane/raft/src/node.rs"]
pub mod node;

/// The two items of suanli-raft's `store.rs` that the files above name.
pub mod store {
    use crate::machine::LogCommand;
    use crate::node::ServerNode;
    use openraft::{Entry, RaftTypeConfig};
    use std::io::Cursor;

    /// Copy of `suanli_raft::StoreConfig`.
    pub trait StoreConfig:
        RaftTypeConfig<
            D = LogCommand,
            NodeId = u64,
            Node = ServerNode,
            Entry = Entry<Self>,
            SnapshotData = Cursor<Vec<u8>>,
        >
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
}

/// Copy of `suanli_raft::Halt` (named by `machine.rs`).
pub struct Halt {
    pub index: u64,
    pub term: u64,
    pub kind: String,
    pub reason: String,
}

openraft::declare_raft_types!(
    /// Copy of `suanli_raft::TypeConfig`.
    pub TypeConfig:
        D = machine::LogCommand,
        R = suanli_state::Response,
        NodeId = u64,
        Node = node::ServerNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = std::io::Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// `frame::decode_append` for the targets (it is `pub(crate)` in suanli-raft).
pub fn decode_append(b: bytes::Bytes) -> Result<openraft::raft::AppendEntriesRequest<TypeConfig>, frame::FrameError> {
    frame::decode_append(b)
}

/// `frame::encode_append` for the targets.
pub fn encode_append(rpc: &openraft::raft::AppendEntriesRequest<TypeConfig>) -> Result<Vec<u8>, serde_json::Error> {
    frame::encode_append(rpc)
}

/// `frame::decode_entry` for the targets.
pub fn decode_entry(b: bytes::Bytes) -> Result<openraft::Entry<TypeConfig>, frame::FrameError> {
    frame::decode_entry(b)
}

/// `frame::entry_frame` for the targets.
pub fn entry_frame(e: &openraft::Entry<TypeConfig>) -> Result<Vec<u8>, serde_json::Error> {
    frame::entry_frame(e)
}
