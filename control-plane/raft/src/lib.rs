//! suanli's consensus layer — not implemented yet in the compiled crate.
//!
//! The implementation (openraft 0.9 type config over `suanli_state::Command`, RocksDB log and
//! state-machine storage in column families with synced writes, a tonic network with per-RPC
//! deadlines, and tests including openraft's storage conformance suite) is written but has not
//! yet been built and tested against the real RocksDB; it waits in `wip/` (not compiled) for
//! the session that verifies it. See `wip/README.md`.
