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
    /// The manifest itself is a symlink (it is never followed).
    #[error("{at} is a symlink; the manifest must be a regular file (write a temp file, rename it)")]
    ManifestSymlink {
        /// The manifest's path.
        at: PathBuf,
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn write_manifest(dir: &Path, json: &str) {
        let tmp = dir.join("manifest.tmp");
        std::fs::write(&tmp, json).unwrap();
        std::fs::rename(&tmp, dir.join(MANIFEST_FILE)).unwrap();
    }

    fn manifest(path: &str, bytes: u64) -> String {
        format!(r#"{{"step":3,"wall_time":1700000000,"path":"{path}","bytes":{bytes}}}"#)
    }

    fn read(dir: &Path) -> Result<Option<Committed>, ManifestError> {
        read_committed(dir, &ManifestLimits::default())
    }

    /// `<dir>/ckpt/{a.bin (5 bytes), sub/b.bin (3 bytes)}`.
    fn checkpoint() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ckpt/sub")).unwrap();
        std::fs::write(dir.path().join("ckpt/a.bin"), b"12345").unwrap();
        std::fs::write(dir.path().join("ckpt/sub/b.bin"), b"678").unwrap();
        dir
    }

    fn refusal(dir: &Path) -> String {
        match read(dir) {
            Err(e) => e.to_string(),
            Ok(c) => panic!("accepted: {c:?}"),
        }
    }

    #[test]
    fn no_manifest_yet_is_none() {
        let dir = checkpoint();
        assert!(read(dir.path()).unwrap().is_none());
    }

    #[test]
    fn a_good_directory_checkpoint_lists_its_files() {
        let dir = checkpoint();
        write_manifest(dir.path(), &manifest("ckpt", 8));
        let c = read(dir.path()).unwrap().unwrap();
        assert_eq!(c.manifest.step, 3);
        assert_eq!(c.root, dir.path().join("ckpt"));
        assert_eq!(c.files, vec![(PathBuf::from("ckpt/a.bin"), 5), (PathBuf::from("ckpt/sub/b.bin"), 3)]);
    }

    #[test]
    fn a_good_file_checkpoint() {
        let dir = checkpoint();
        write_manifest(dir.path(), &manifest("ckpt/a.bin", 5));
        let c = read(dir.path()).unwrap().unwrap();
        assert_eq!(c.files, vec![(PathBuf::from("ckpt/a.bin"), 5)]);
    }

    #[test]
    fn refuses_truncated_not_json_and_unknown_fields() {
        let dir = checkpoint();
        let full = manifest("ckpt", 8);
        write_manifest(dir.path(), &full[..full.len() - 5]);
        assert!(refusal(dir.path()).contains("not a checkpoint manifest"));
        write_manifest(dir.path(), "step: 3");
        assert!(refusal(dir.path()).contains("not a checkpoint manifest"));
        write_manifest(dir.path(), r#"{"step":3,"wall_time":1,"path":"ckpt","bytes":8,"extra":true}"#);
        assert!(refusal(dir.path()).contains("extra"));
    }

    #[test]
    fn refuses_an_oversized_manifest() {
        let dir = checkpoint();
        let padded = format!("{}{}", manifest("ckpt", 8), " ".repeat(70 * 1024));
        write_manifest(dir.path(), &padded);
        let err = refusal(dir.path());
        assert!(err.contains("max_manifest_bytes = 65536"), "{err}");
    }

    #[test]
    fn refuses_absolute_and_dotdot_paths() {
        let dir = checkpoint();
        write_manifest(dir.path(), &manifest("/etc", 8));
        assert!(refusal(dir.path()).contains("absolute"));
        write_manifest(dir.path(), &manifest("ckpt/../../etc", 8));
        assert!(refusal(dir.path()).contains("`..`"));
    }

    #[test]
    fn refuses_symlinks_that_could_escape() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"xyz").unwrap();
        // The checkpoint itself is a link out.
        let dir = checkpoint();
        symlink(outside.path(), dir.path().join("link")).unwrap();
        write_manifest(dir.path(), &manifest("link", 3));
        assert!(refusal(dir.path()).contains("a symlink"));
        // A directory on the way is a link out.
        write_manifest(dir.path(), &manifest("link/secret", 3));
        assert!(refusal(dir.path()).contains("a symlink"));
        // A link inside the checkpoint.
        let dir = checkpoint();
        symlink(outside.path().join("secret"), dir.path().join("ckpt/sub/c.bin")).unwrap();
        write_manifest(dir.path(), &manifest("ckpt", 8));
        let err = refusal(dir.path());
        assert!(err.contains("c.bin is a symlink") && err.contains("`path`"), "{err}");
        // The manifest itself.
        let dir = checkpoint();
        std::fs::write(outside.path().join("m.json"), manifest("ckpt", 8)).unwrap();
        symlink(outside.path().join("m.json"), dir.path().join(MANIFEST_FILE)).unwrap();
        assert!(refusal(dir.path()).contains("is a symlink"));
    }

    #[test]
    fn refuses_a_manifest_that_lies_about_its_size() {
        let dir = checkpoint();
        write_manifest(dir.path(), &manifest("ckpt", 9));
        let err = refusal(dir.path());
        assert!(err.contains("`bytes` = 9") && err.contains("hold 8 bytes"), "{err}");
    }

    #[test]
    fn refuses_a_missing_checkpoint() {
        let dir = checkpoint();
        write_manifest(dir.path(), &manifest("nope", 0));
        assert!(refusal(dir.path()).contains("does not exist"));
    }

    #[test]
    fn refuses_too_many_files() {
        let dir = checkpoint();
        write_manifest(dir.path(), &manifest("ckpt", 8));
        let limits = ManifestLimits { max_files: 1, ..ManifestLimits::default() };
        let err = read_committed(dir.path(), &limits).unwrap_err().to_string();
        assert!(err.contains("max_files = 1"), "{err}");
    }

    #[test]
    fn refuses_a_socket() {
        let dir = checkpoint();
        let _listener = std::os::unix::net::UnixListener::bind(dir.path().join("ckpt/sock")).unwrap();
        write_manifest(dir.path(), &manifest("ckpt", 8));
        assert!(refusal(dir.path()).contains("a socket"));
    }
}
