//! Checkpoints on the agent's side (docs/checkpoints.md): reading and checking the manifest a
//! task commits in `SUANLI_CHECKPOINT_DIR` ([`read_committed`]), and moving committed
//! checkpoints to and from the checkpoint store ([`Store`]).
//!
//! ```text
//!  task writes <dir>/<path>…, then <dir>/suanli-checkpoint.json (temp file + rename)
//!  read_committed(dir) ──▶ Committed { manifest, root, files }   (or a refusal with its reason)
//!  Store::put(job, attempt, dir, committed) ──▶ <store>/jobs/<job>/a<attempt>-s<step>/…  ──▶ uri
//!  Store::get(uri, into) ──▶ into/<path> (checked against its manifest again)
//! ```
//!
//! Nothing here trusts the task: a manifest is size-bounded before it is decoded, its `path`
//! must stay inside the directory (no `..`, no absolute path, no symlink anywhere), its `bytes`
//! must equal what the files hold, and a checkpoint has at most `max_files` files. A refusal is
//! an error value, never a panic. Files are streamed, never read whole into memory.

mod manifest;
mod store;

pub use manifest::{Committed, ManifestError, ManifestLimits, read_committed};
pub use store::{Store, StoreError};
