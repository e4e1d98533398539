//! The checkpoint manifest: what a task writes, last and atomically, to commit a checkpoint
//! (docs/checkpoints.md). The agent reads it, checks it against the files, stores the
//! checkpoint and reports it; the state machine records the latest one per job.

use serde::{Deserialize, Serialize};

/// The manifest's file name in `SUANLI_CHECKPOINT_DIR` (and beside a stored checkpoint).
pub const MANIFEST_FILE: &str = "suanli-checkpoint.json";

/// A committed checkpoint as its task describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointManifest {
    /// Training step (any progress marker that only grows).
    pub step: u64,
    /// When the task finished writing it (seconds since the Unix epoch, the task's clock).
    pub wall_time: u64,
    /// The checkpoint, relative to `SUANLI_CHECKPOINT_DIR`: a file or a directory.
    pub path: String,
    /// Its total size in bytes (every file under `path`).
    pub bytes: u64,
    /// True when it restores only onto the same device model and count (a device memory
    /// image such as cuda-checkpoint writes); false for a portable checkpoint.
    #[serde(default)]
    pub hardware_bound: bool,
}

/// The hardware a hardware-bound checkpoint needs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CheckpointHardware {
    /// Device kind (`gpu`, `npu`).
    pub kind: crate::DeviceKind,
    /// Device model as the plugin reports it (`NVIDIA H200`).
    pub model: String,
    /// Devices per task.
    pub count: u32,
}
