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

/// Why a manifest's bytes or its `path` field were refused ([`CheckpointManifest::decode`],
/// [`check_checkpoint_path`]). Checks on the files themselves (sizes, symlinks, counts) are the
/// agent's, which reads them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestDecodeError {
    /// The manifest is longer than the reader allows.
    #[error("manifest is {size} bytes, over the limit max_manifest_bytes = {limit}")]
    TooLarge {
        /// Its size (at least; a reader stops at limit + 1).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Not JSON, truncated, a missing or unknown field, or a value of the wrong type.
    #[error(
        "manifest is not a checkpoint manifest ({reason}); expected JSON \
         {{\"step\", \"wall_time\", \"path\", \"bytes\", \"hardware_bound\"?}}"
    )]
    Malformed {
        /// serde_json's message: names the field and the position.
        reason: String,
    },
    /// The `path` field is not a relative path inside the checkpoint directory.
    #[error("manifest field `path` = {path:?} is refused: {reason}")]
    Path {
        /// The field's value.
        path: String,
        /// What is wrong and what would be valid.
        reason: &'static str,
    },
}

impl CheckpointManifest {
    /// Decodes a manifest's bytes, refusing more than `max_bytes` and any manifest whose `path`
    /// fails [`check_checkpoint_path`].
    pub fn decode(bytes: &[u8], max_bytes: u64) -> Result<Self, ManifestDecodeError> {
        let size = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
        if size > max_bytes {
            return Err(ManifestDecodeError::TooLarge { size, limit: max_bytes });
        }
        let manifest: CheckpointManifest =
            serde_json::from_slice(bytes).map_err(|e| ManifestDecodeError::Malformed { reason: e.to_string() })?;
        check_checkpoint_path(&manifest.path)?;
        Ok(manifest)
    }
}

/// Checks a manifest's `path` (or a stored object's key below a checkpoint): relative, `/`
/// separated, made only of plain names (no empty, `.` or `..` parts, no NUL or `\`), not the
/// manifest itself, at most 4096 bytes. Symlinks are the reader's to check: this sees only text.
pub fn check_checkpoint_path(path: &str) -> Result<(), ManifestDecodeError> {
    let refuse = |reason: &'static str| ManifestDecodeError::Path { path: path.to_owned(), reason };
    if path.is_empty() {
        return Err(refuse("empty; name a file or directory inside SUANLI_CHECKPOINT_DIR"));
    }
    if path.len() > 4096 {
        return Err(refuse("longer than 4096 bytes"));
    }
    if path.starts_with('/') {
        return Err(refuse("absolute; it must be relative to SUANLI_CHECKPOINT_DIR"));
    }
    if path.contains('\0') || path.contains('\\') {
        return Err(refuse("contains NUL or `\\`; use `/`-separated plain names"));
    }
    for part in path.split('/') {
        match part {
            "" => return Err(refuse("has an empty part (`//` or a trailing `/`)")),
            "." => return Err(refuse("has a `.` part; name the file or directory itself")),
            ".." => {
                return Err(refuse("has a `..` part; it must stay inside SUANLI_CHECKPOINT_DIR"));
            }
            _ => {}
        }
    }
    if path == MANIFEST_FILE || path.starts_with(&format!("{MANIFEST_FILE}/")) {
        return Err(refuse("is the manifest itself; name the checkpoint it commits"));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn decode(s: &str) -> Result<CheckpointManifest, ManifestDecodeError> {
        CheckpointManifest::decode(s.as_bytes(), 64 * 1024)
    }

    #[test]
    fn decodes_a_good_manifest() {
        let m = decode(r#"{"step":7,"wall_time":1,"path":"ckpt/step7","bytes":10}"#).unwrap();
        assert_eq!(m.step, 7);
        assert!(!m.hardware_bound);
    }

    #[test]
    fn refuses_bad_bytes() {
        let truncated = decode(r#"{"step":7,"wall_time":1,"pa"#).unwrap_err();
        assert!(matches!(truncated, ManifestDecodeError::Malformed { .. }));
        let not_json = decode("step=7").unwrap_err();
        assert!(matches!(not_json, ManifestDecodeError::Malformed { .. }));
        let unknown = decode(r#"{"step":7,"wall_time":1,"path":"a","bytes":1,"evil":1}"#).unwrap_err();
        assert!(unknown.to_string().contains("evil"), "{unknown}");
        let missing = decode(r#"{"step":7,"wall_time":1,"path":"a"}"#).unwrap_err();
        assert!(missing.to_string().contains("bytes"), "{missing}");
        let big = CheckpointManifest::decode(&[b' '; 100], 99).unwrap_err();
        assert_eq!(big, ManifestDecodeError::TooLarge { size: 100, limit: 99 });
    }

    #[test]
    fn refuses_paths_outside_the_dir() {
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a/", "./a", "a\\b", MANIFEST_FILE] {
            let err = check_checkpoint_path(bad).unwrap_err();
            assert!(err.to_string().contains("`path`"), "{bad:?}: {err}");
        }
        for good in ["a", "ckpt/step-7", "model.pt", "a..b"] {
            check_checkpoint_path(good).unwrap();
        }
    }
}
