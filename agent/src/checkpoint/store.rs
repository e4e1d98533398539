//! The checkpoint store (docs/checkpoints.md, "Where checkpoints are stored"): committed
//! checkpoints are copied to an object store (`object_store`: local files or S3) at
//! `jobs/<job>/a<attempt>-s<step>/`, with the manifest beside them, written last.

use super::manifest::{Committed, ManifestError, ManifestLimits, read_committed};
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;
use object_store::path::{Path as ObjectPath, PathPart};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use suanli_model::{CheckpointManifest, MANIFEST_FILE, check_checkpoint_path};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_stream::StreamExt as _;

/// Bytes buffered per upload part (S3 parts must be at least 5 MiB).
const PART_BYTES: usize = 8 * 1024 * 1024;
/// Bytes read from a local file at a time.
const READ_BYTES: usize = 1024 * 1024;
/// Parts of one file in flight at once: memory per upload is at most about
/// `PART_BYTES * (UPLOAD_CONCURRENCY + 1)`, whatever the file's size.
const UPLOAD_CONCURRENCY: usize = 2;

/// A checkpoint store: where an agent uploads its tasks' checkpoints and downloads the ones
/// it restores. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    /// The store's URL without a trailing `/`; a checkpoint's URI is `<url>/<key>`.
    url: String,
    /// Key parts in front of `jobs/…` (an S3 URL's path).
    prefix: Vec<String>,
    limits: ManifestLimits,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store URL is not one this agent can open.
    #[error("checkpoint store url {url:?}: {reason}")]
    Url {
        /// The URL.
        url: String,
        /// What is wrong and what would be valid.
        reason: String,
    },
    /// The object store refused or failed an operation.
    #[error("checkpoint store {url}: {op} {key}: {source}")]
    Object {
        /// The store's URL.
        url: String,
        /// `put`, `get`, `head`, `list`.
        op: &'static str,
        /// The object's key.
        key: String,
        /// The object store's error.
        #[source]
        source: Box<object_store::Error>,
    },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The local path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file changed between the manifest check and its upload.
    #[error("{path} changed while being uploaded: the manifest check saw {expected} bytes")]
    Changed {
        /// The local file.
        path: PathBuf,
        /// Its size when the manifest was checked.
        expected: u64,
    },
    /// The URI is not a checkpoint of this store.
    #[error(
        "checkpoint uri {uri:?} is not a checkpoint of the store {url} \
         (expected {url}/jobs/<job>/a<attempt>-s<step>)"
    )]
    ForeignUri {
        /// The URI.
        uri: String,
        /// The store's URL.
        url: String,
    },
    /// A stored checkpoint does not match its manifest.
    #[error("stored checkpoint {uri}: {reason}")]
    Invalid {
        /// The checkpoint's URI.
        uri: String,
        /// What does not match.
        reason: String,
    },
    /// A downloaded checkpoint's manifest refused on the same checks a committed one gets.
    #[error("stored checkpoint {uri}: {source}")]
    Manifest {
        /// The checkpoint's URI.
        uri: String,
        /// The refusal.
        #[source]
        source: ManifestError,
    },
    /// The download directory already holds files.
    #[error("download directory {path} is not empty")]
    NotEmpty {
        /// The directory.
        path: PathBuf,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + use<> {
    let path = path.to_path_buf();
    move |source| StoreError::Io { path, source }
}

impl Store {
    /// Opens the store at `url`; empty: `file://<local_default>` (created).
    ///
    /// Schemes built: `file://<absolute dir>` and `s3://<bucket>[/<prefix>]` (also `s3a://`).
    /// S3 takes its credentials, region and endpoint from the agent's environment
    /// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
    /// `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, and the rest `object_store`'s `AmazonS3Builder::from_env`
    /// reads).
    pub fn open(url: &str, local_default: &Path) -> Result<Store, StoreError> {
        Self::open_with_env(url, local_default, std::env::vars())
    }

    /// [`Store::open`] with the `AWS_*` settings taken from `env` instead of the process
    /// environment (tests; an agent that runs several stores with different credentials).
    /// Variables that are not `AWS_*` settings `object_store` knows are ignored.
    pub fn open_with_env(
        url: &str,
        local_default: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Store, StoreError> {
        let url = if url.is_empty() { format!("file://{}", local_default.display()) } else { url.to_owned() };
        let refuse = |reason: String| StoreError::Url { url: url.clone(), reason };
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(refuse("has no scheme; expected file:///<dir> or s3://<bucket>[/<prefix>]".into()));
        };
        let rest = rest.trim_end_matches('/');
        let (inner, prefix): (Arc<dyn ObjectStore>, Vec<String>) = match scheme {
            "file" => {
                if !rest.starts_with('/') {
                    return Err(refuse("file:// needs an absolute directory (file:///var/lib/...)".into()));
                }
                std::fs::create_dir_all(rest).map_err(io(Path::new(rest)))?;
                let local =
                    object_store::local::LocalFileSystem::new_with_prefix(rest).map_err(|e| refuse(e.to_string()))?;
                (Arc::new(local), Vec::new())
            }
            "s3" | "s3a" => {
                let mut parts = rest.split('/');
                let bucket = parts.next().unwrap_or_default();
                if bucket.is_empty() {
                    return Err(refuse("s3:// needs a bucket (s3://<bucket>[/<prefix>])".into()));
                }
                let prefix: Vec<String> = parts.map(str::to_owned).collect();
                if prefix.iter().any(|p| p.is_empty() || p == "." || p == "..") {
                    return Err(refuse("the prefix after the bucket must be plain `/`-separated names".into()));
                }
                let mut builder = object_store::aws::AmazonS3Builder::new();
                for (key, value) in env {
                    if !key.starts_with("AWS_") {
                        continue;
                    }
                    if let Ok(config_key) = key.to_ascii_lowercase().parse::<object_store::aws::AmazonS3ConfigKey>() {
                        builder = builder.with_config(config_key, value);
                    }
                }
                let s3 = builder.with_bucket_name(bucket).build().map_err(|e| refuse(e.to_string()))?;
                (Arc::new(s3), prefix)
            }
            other => {
                return Err(refuse(format!("scheme {other:?} is not built into this agent; built: file, s3")));
            }
        };
        let base = format!("{scheme}://{rest}");
        Ok(Store { inner, url: base, prefix, limits: ManifestLimits::default() })
    }

    /// The same store, checking manifests against `limits` instead of the defaults.
    pub fn with_limits(mut self, limits: ManifestLimits) -> Store {
        self.limits = limits;
        self
    }

    /// The store's URL (no trailing `/`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Uploads the committed checkpoint's files (read from `dir`, streamed in parts) and then
    /// its manifest under `jobs/<job>/a<attempt>-s<step>/`; returns the checkpoint's URI (store
    /// URL + key). A file whose size changed since the check fails the upload.
    pub async fn put(&self, job: u64, attempt: u64, dir: &Path, c: &Committed) -> Result<String, StoreError> {
        let key = format!("jobs/{job}/a{attempt}-s{}", c.manifest.step);
        for (rel, size) in &c.files {
            let rel_str = rel.to_str().ok_or_else(|| StoreError::Invalid {
                uri: format!("{}/{key}", self.url),
                reason: format!("{} has a name that is not UTF-8", rel.display()),
            })?;
            let location = self.location(&key, rel_str);
            self.put_file(&dir.join(rel), *size, location).await?;
        }
        let manifest = serde_json::to_vec(&c.manifest).map_err(|e| StoreError::Invalid {
            uri: format!("{}/{key}", self.url),
            reason: format!("encoding the manifest: {e}"),
        })?;
        let location = self.location(&key, MANIFEST_FILE);
        self.inner.put(&location, manifest.into()).await.map_err(|e| self.object_error("put", &location, e))?;
        Ok(format!("{}/{key}", self.url))
    }

    /// Uploads one file: in one request when it fits in a part, else as a multipart upload
    /// with at most `UPLOAD_CONCURRENCY` parts in flight (memory stays bounded).
    async fn put_file(&self, path: &Path, size: u64, location: ObjectPath) -> Result<(), StoreError> {
        let file = tokio::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .await
            .map_err(io(path))?;
        let changed = || StoreError::Changed { path: path.to_path_buf(), expected: size };
        // One byte more than expected: a file that grew is seen.
        let mut reader = file.take(size.saturating_add(1));
        if size <= PART_BYTES as u64 {
            let mut buf = Vec::with_capacity(usize::try_from(size).unwrap_or(PART_BYTES));
            reader.read_to_end(&mut buf).await.map_err(io(path))?;
            if buf.len() as u64 != size {
                return Err(changed());
            }
            self.inner.put(&location, buf.into()).await.map_err(|e| self.object_error("put", &location, e))?;
            return Ok(());
        }
        let upload = self.inner.put_multipart(&location).await.map_err(|e| self.object_error("put", &location, e))?;
        let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut buf = vec![0u8; READ_BYTES];
        let mut total = 0u64;
        let failed = loop {
            let n = match reader.read(&mut buf).await {
                Ok(0) => break None,
                Ok(n) => n,
                Err(e) => break Some(io(path)(e)),
            };
            total += n as u64;
            if let Err(e) = writer.wait_for_capacity(UPLOAD_CONCURRENCY).await {
                break Some(self.object_error("put", &location, e));
            }
            writer.write(&buf[..n]);
        };
        let failed = failed.or_else(|| (total != size).then(changed));
        if let Some(err) = failed {
            // Best effort: the store may also expire unfinished uploads itself.
            if let Err(e) = writer.abort().await {
                tracing::warn!(key = %location, error = %e, "aborting a checkpoint upload failed");
            }
            return Err(err);
        }
        writer.finish().await.map_err(|e| self.object_error("put", &location, e))?;
        Ok(())
    }

    /// Downloads the checkpoint at `uri` (which must be under this store) into `into` (created;
    /// it must be empty), checks it against its manifest (the checks [`read_committed`] makes,
    /// and the manifest's step against the key's), and returns the local path to restore from
    /// (`into/<manifest.path>`) and the manifest.
    pub async fn get(&self, uri: &str, into: &Path) -> Result<(PathBuf, CheckpointManifest), StoreError> {
        let foreign = || StoreError::ForeignUri { uri: uri.to_owned(), url: self.url.clone() };
        let key = uri.strip_prefix(&self.url).and_then(|k| k.strip_prefix('/')).ok_or_else(foreign)?;
        let step = parse_key(key).ok_or_else(foreign)?;
        let invalid = |reason: String| StoreError::Invalid { uri: uri.to_owned(), reason };

        std::fs::create_dir_all(into).map_err(io(into))?;
        if std::fs::read_dir(into).map_err(io(into))?.next().is_some() {
            return Err(StoreError::NotEmpty { path: into.to_path_buf() });
        }

        // The manifest, read no further than the limit allows.
        let manifest_at = self.location(key, MANIFEST_FILE);
        let manifest_bytes = self.get_bounded(&manifest_at).await?;
        let manifest = CheckpointManifest::decode(&manifest_bytes, self.limits.max_manifest_bytes)
            .map_err(|e| invalid(e.to_string()))?;
        if manifest.step != step {
            return Err(invalid(format!("manifest field `step` = {} but the key says step {step}", manifest.step)));
        }

        // The files: each must lie under the manifest's `path`; their total may not pass
        // `bytes` (so a tampered store cannot fill the disk beyond what the manifest says).
        let dir = ObjectPath::from_iter(self.prefix.iter().map(String::as_str).chain(key.split('/')));
        let mut listing = self.inner.list(Some(&dir));
        let mut files = 0usize;
        let mut total = 0u64;
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| self.object_error("list", &dir, e))?;
            let Some(parts) = meta.location.prefix_match(&dir) else {
                continue;
            };
            let parts: Vec<String> = parts.map(|p| percent_decode(p.as_ref())).collect();
            let rel = parts.join("/");
            if rel == MANIFEST_FILE {
                continue;
            }
            check_checkpoint_path(&rel).map_err(|e| invalid(format!("object {rel:?}: {e}")))?;
            if rel != manifest.path && !rel.starts_with(&format!("{}/", manifest.path)) {
                return Err(invalid(format!(
                    "object {rel:?} is not under the manifest's `path` = {:?}",
                    manifest.path
                )));
            }
            files += 1;
            if files > self.limits.max_files {
                return Err(invalid(format!("more than max_files = {} objects", self.limits.max_files)));
            }
            total = total.saturating_add(meta.size);
            if total > manifest.bytes {
                return Err(invalid(format!("its objects hold more than the manifest's `bytes` = {}", manifest.bytes)));
            }
            self.get_file(&meta.location, &into.join(&rel), meta.size).await?;
        }

        // Same checks as a freshly committed checkpoint (bytes, files, no symlinks).
        let manifest_path = into.join(MANIFEST_FILE);
        tokio::fs::write(&manifest_path, &manifest_bytes).await.map_err(io(&manifest_path))?;
        let committed = read_committed(into, &self.limits)
            .map_err(|source| StoreError::Manifest { uri: uri.to_owned(), source })?
            .ok_or_else(|| invalid("manifest vanished after download".into()))?;
        Ok((committed.root, committed.manifest))
    }

    /// Reads a small object whole, refusing one over `max_manifest_bytes`.
    async fn get_bounded(&self, location: &ObjectPath) -> Result<Vec<u8>, StoreError> {
        let limit = self.limits.max_manifest_bytes;
        let mut stream =
            self.inner.get(location).await.map_err(|e| self.object_error("get", location, e))?.into_stream();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.object_error("get", location, e))?;
            if out.len() as u64 + chunk.len() as u64 > limit {
                return Err(StoreError::Invalid {
                    uri: format!("{}/{location}", self.url),
                    reason: format!("manifest is over the limit max_manifest_bytes = {limit}"),
                });
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    async fn get_file(&self, location: &ObjectPath, path: &Path, size: u64) -> Result<(), StoreError> {
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent).await.map_err(io(parent))?;
        }
        let mut file = tokio::fs::OpenOptions::new().write(true).create_new(true).open(path).await.map_err(io(path))?;
        let mut stream =
            self.inner.get(location).await.map_err(|e| self.object_error("get", location, e))?.into_stream();
        let mut written = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.object_error("get", location, e))?;
            written = written.saturating_add(chunk.len() as u64);
            if written > size {
                return Err(StoreError::Changed { path: path.to_path_buf(), expected: size });
            }
            file.write_all(&chunk).await.map_err(io(path))?;
        }
        file.flush().await.map_err(io(path))?;
        Ok(())
    }

    fn location(&self, key: &str, rel: &str) -> ObjectPath {
        let parts = self.prefix.iter().map(String::as_str).chain(key.split('/')).chain(rel.split('/'));
        ObjectPath::from_iter(parts.map(PathPart::from))
    }

    fn object_error(&self, op: &'static str, at: &ObjectPath, e: object_store::Error) -> StoreError {
        StoreError::Object { url: self.url.clone(), op, key: at.to_string(), source: Box::new(e) }
    }
}

/// `jobs/<job>/a<attempt>-s<step>` → step.
fn parse_key(key: &str) -> Option<u64> {
    let mut parts = key.split('/');
    let (Some("jobs"), Some(job), Some(last), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return None;
    };
    job.parse::<u64>().ok()?;
    let (attempt, step) = last.strip_prefix('a')?.split_once("-s")?;
    attempt.parse::<u64>().ok()?;
    step.parse().ok()
}

/// Undoes the percent-encoding `object_store` applies to characters a key part may not hold.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((hi << 4) | lo);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse() {
        assert_eq!(parse_key("jobs/3/a2-s700"), Some(700));
        assert_eq!(parse_key("jobs/3/a2-s700/x"), None);
        assert_eq!(parse_key("jobs/x/a2-s700"), None);
        assert_eq!(parse_key("other/3/a2-s7"), None);
    }

    #[test]
    fn percent_decoding_undoes_encoding() {
        for name in ["plain.pt", "100%.bin", "a#b", "x%2"] {
            let part = PathPart::from(name);
            assert_eq!(percent_decode(part.as_ref()), name, "{}", part.as_ref());
        }
    }

    #[test]
    fn urls() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open("", dir.path()).unwrap();
        assert_eq!(store.url(), format!("file://{}", dir.path().display()));
        for bad in ["gs://b", "nope", "file://relative", "s3://"] {
            let err = Store::open(bad, dir.path()).unwrap_err();
            assert!(matches!(err, StoreError::Url { .. }), "{bad}: {err}");
        }
    }
}
