//! Reading and checking the manifest a task commits (docs/checkpoints.md, "The manifest").

use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use suanli_model::{CheckpointManifest, MANIFEST_FILE, ManifestDecodeError};

/// Bounds on what a task's manifest and checkpoint may be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestLimits {
    /// The manifest's largest size in bytes (64 KiB): it is read whole before decoding.
    pub max_manifest_bytes: u64,
    /// The most files one checkpoint may hold (10 000): each is one object in the store.
    pub max_files: usize,
}

impl Default for ManifestLimits {
    fn default() -> Self {
        Self { max_manifest_bytes: 64 * 1024, max_files: 10_000 }
    }
}

/// A committed checkpoint, checked against its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    /// The manifest as the task wrote it.
    pub manifest: CheckpointManifest,
    /// The checkpoint's absolute path (`<dir>/<manifest.path>`): a file or a directory.
    pub root: PathBuf,
    /// Every file of the checkpoint, relative to the checkpoint directory (so each starts with
    /// `manifest.path`), with its size; sorted by path.
    pub files: Vec<(PathBuf, u64)>,
}

/// Why a manifest was refused. The caller logs it and keeps the last good checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The manifest or a checkpoint file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// What was being read.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The manifest's bytes or its `path` field are refused.
    #[error("{path}: {source}")]
    Decode {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: ManifestDecodeError,
    },
    /// The manifest or a part of the checkpoint is a symlink (which could point outside the
    /// directory), or is neither a regular file nor a directory.
    #[error("manifest field `path` = {path:?}: {at} is {what}; only regular files and directories are stored")]
    NotPlain {
        /// The manifest's `path` field.
        path: String,
        /// The offending entry.
        at: PathBuf,
        /// What it is (`a symlink`, `a socket`, ...).
        what: &'static str,
    },
    /// The checkpoint does not exist.
    #[error("manifest field `path` = {path:?}: {at} does not exist")]
    Missing {
        /// The manifest's `path` field.
        path: String,
        /// Where it was looked for.
        at: PathBuf,
    },
    /// A file name that is not UTF-8 (it could not be named in the store).
    #[error("manifest field `path` = {path:?}: {at} has a name that is not UTF-8")]
    NotUtf8 {
        /// The manifest's `path` field.
        path: String,
        /// The offending entry.
        at: PathBuf,
    },
    /// The manifest's `bytes` differs from what the files hold.
    #[error("manifest field `bytes` = {claimed}, but the {files} file(s) under `path` = {path:?} hold {actual} bytes")]
    BytesMismatch {
        /// The manifest's `path` field.
        path: String,
        /// The manifest's `bytes` field.
        claimed: u64,
        /// The files' total.
        actual: u64,
        /// How many files were counted.
        files: usize,
    },
    /// More files than `max_files`.
    #[error("manifest field `path` = {path:?} holds more than max_files = {limit} files")]
    TooManyFiles {
        /// The manifest's `path` field.
        path: String,
        /// The limit.
        limit: usize,
    },
}

/// Reads `<dir>/suanli-checkpoint.json` and checks it against the files it names.
///
/// `Ok(None)`: no manifest yet. `Err`: a refused manifest, with the reason (the caller logs it
/// and keeps the last good one). Whether `step` is newer than the last committed one is the
/// caller's to check: this sees one manifest.
pub fn read_committed(dir: &Path, limits: &ManifestLimits) -> Result<Option<Committed>, ManifestError> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ManifestError::Io { path, source }
    };
    // O_NOFOLLOW: a manifest that is a symlink is refused (ELOOP) rather than followed.
    let file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&manifest_path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(ManifestError::NotPlain { path: String::new(), at: manifest_path, what: "a symlink" });
        }
        Err(e) => return Err(io(&manifest_path)(e)),
    };
    let mut bytes = Vec::new();
    file.take(limits.max_manifest_bytes.saturating_add(1)).read_to_end(&mut bytes).map_err(io(&manifest_path))?;
    let manifest = CheckpointManifest::decode(&bytes, limits.max_manifest_bytes)
        .map_err(|source| ManifestError::Decode { path: manifest_path.clone(), source })?;
    let files = checkpoint_files(dir, &manifest.path, limits.max_files)?;
    let actual: u64 = files.iter().map(|(_, size)| size).sum();
    if actual != manifest.bytes {
        return Err(ManifestError::BytesMismatch {
            path: manifest.path,
            claimed: manifest.bytes,
            actual,
            files: files.len(),
        });
    }
    Ok(Some(Committed { root: dir.join(&manifest.path), manifest, files }))
}

/// Lists the files under `<dir>/<rel>` (relative to `dir`, sorted), refusing symlinks anywhere
/// on the way (the parts of `rel` included) and anything but files and directories.
fn checkpoint_files(dir: &Path, rel: &str, max_files: usize) -> Result<Vec<(PathBuf, u64)>, ManifestError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ManifestError::Io { path, source }
    };
    // Every part of `rel` on the way down must be a real directory, not a symlink.
    let mut at = dir.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        at.push(part);
        let meta = match std::fs::symlink_metadata(&at) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ManifestError::Missing { path: rel.to_owned(), at });
            }
            Err(e) => return Err(io(&at)(e)),
        };
        let last = i + 1 == parts.len();
        if !last && !meta.is_dir() {
            return Err(ManifestError::NotPlain { path: rel.to_owned(), at, what: what(&meta.file_type()) });
        }
    }
    let mut files = Vec::new();
    let mut stack = vec![PathBuf::from(rel)];
    while let Some(rel_entry) = stack.pop() {
        let abs = dir.join(&rel_entry);
        let meta = std::fs::symlink_metadata(&abs).map_err(io(&abs))?;
        let kind = meta.file_type();
        if kind.is_file() {
            if files.len() == max_files {
                return Err(ManifestError::TooManyFiles { path: rel.to_owned(), limit: max_files });
            }
            files.push((rel_entry, meta.len()));
        } else if kind.is_dir() {
            for entry in std::fs::read_dir(&abs).map_err(io(&abs))? {
                let entry = entry.map_err(io(&abs))?;
                let name = entry.file_name();
                if name.to_str().is_none() {
                    return Err(ManifestError::NotUtf8 { path: rel.to_owned(), at: entry.path() });
                }
                stack.push(rel_entry.join(name));
            }
        } else {
            return Err(ManifestError::NotPlain { path: rel.to_owned(), at: abs, what: what(&kind) });
        }
    }
    files.sort();
    Ok(files)
}

fn what(kind: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if kind.is_symlink() {
        "a symlink"
    } else if kind.is_file() {
        "a regular file"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a fifo"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a device"
    }
}
