//! The `AgentLogs` service: a task's stdout or stderr for `suanli job logs`, read from its
//! allocation directory, optionally followed until the task ends or the client goes away.

use crate::tasks::{finished, parse_dir_name};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_logs_server::AgentLogs;
use tokio::sync::Semaphore;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Largest chunk sent at once.
const CHUNK_BYTES: usize = 64 * 1024;
/// How often a followed file is checked for more output.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// Serves task logs from `allocs_dir`.
pub(crate) struct LogsService {
    pub allocs_dir: PathBuf,
    pub streams: Arc<Semaphore>,
}

/// The newest attempt's directory of allocation `alloc`.
fn find_dir(allocs: &Path, alloc: u64) -> Option<PathBuf> {
    let rd = std::fs::read_dir(allocs).ok()?;
    rd.filter_map(Result::ok)
        .filter_map(|e| {
            let k = parse_dir_name(e.file_name().to_str()?)?;
            (k.0 == alloc).then_some((k.1, e.path()))
        })
        .max_by_key(|(epoch, _)| *epoch)
        .map(|(_, p)| p)
}

/// The files of one output stream, oldest first: the rotated `<name>.1`, then the current
/// `<name>` (docs/agent.md, "Files"). The one place that knows how the shim names them.
pub(crate) fn stream_files(dir: &Path, name: &str) -> [PathBuf; 2] {
    [dir.join(format!("{name}.1")), dir.join(name)]
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Up to `max` bytes of `path` from `offset`, the file's length and its inode (0 when the
/// file does not exist).
fn read_from(path: &Path, offset: u64, max: usize) -> std::io::Result<(Vec<u8>, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0, 0)),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    let len = meta.len();
    f.seek(SeekFrom::Start(offset.min(len)))?;
    let mut buf = vec![0u8; max];
    let n = f.read(&mut buf)?;
    buf.truncate(n);
    Ok((buf, len, meta.ino()))
}

/// A position in a stream read as one text: the rotated file, then the current one. Offsets
/// the client sees (`offset`, `next_offset`) count from the start of the rotated file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    /// 0: in the rotated file; 1: in the current file.
    file: usize,
    /// Byte offset in that file.
    offset: u64,
    /// Length of the rotated file when the cursor entered the current one (for `next_offset`).
    base: u64,
    /// Inode of the current file as last read (0: not read yet): another inode there means
    /// the shim rotated it.
    inode: u64,
}

impl Cursor {
    /// Where a request's `offset` starts (negative: that many bytes before the end of both).
    fn start(files: &[PathBuf; 2], requested: i64) -> Cursor {
        let (old, cur) = (file_len(&files[0]), file_len(&files[1]));
        let total = old + cur;
        let at =
            if requested < 0 { total.saturating_sub(requested.unsigned_abs()) } else { (requested as u64).min(total) };
        if at < old {
            Cursor { file: 0, offset: at, base: 0, inode: 0 }
        } else {
            Cursor { file: 1, offset: at - old, base: old, inode: 0 }
        }
    }

    /// The next chunk (empty at the end of the current file), and moves past it. A rotation
    /// seen while in the current file (another inode there, or it shrank below the cursor)
    /// continues in the rotated file at the same offset: what was not yet read moved there.
    fn next(&mut self, files: &[PathBuf; 2], max: usize) -> std::io::Result<Vec<u8>> {
        loop {
            let (data, len, inode) = read_from(&files[self.file], self.offset, max)?;
            if self.file == 1 {
                let rotated = len < self.offset || (self.inode != 0 && inode != 0 && inode != self.inode);
                if rotated {
                    self.file = 0;
                    self.inode = 0;
                    continue;
                }
                if inode != 0 {
                    self.inode = inode;
                }
            }
            if data.is_empty() && self.file == 0 {
                self.base = self.offset;
                self.file = 1;
                self.offset = 0;
                continue;
            }
            self.offset += data.len() as u64;
            return Ok(data);
        }
    }

    fn position(&self) -> u64 {
        if self.file == 0 { self.offset } else { self.base + self.offset }
    }
}

#[tonic::async_trait]
impl AgentLogs for LogsService {
    type LogsStream = ReceiverStream<Result<pb::LogChunk, Status>>;

    async fn logs(&self, req: Request<pb::LogsRequest>) -> Result<Response<Self::LogsStream>, Status> {
        let r = req.into_inner();
        let file = match r.stream.as_str() {
            "" | "stdout" => "stdout.log",
            "stderr" => "stderr.log",
            other => return Err(Status::invalid_argument(format!("stream: {other:?} is not stdout or stderr"))),
        };
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "too many log streams on this agent (max_log_streams = {})",
                self.streams.available_permits()
            ))
        })?;
        let dir = find_dir(&self.allocs_dir, r.alloc_id).ok_or_else(|| {
            Status::not_found(format!(
                "alloc_id: allocation {} never ran on this node (or its logs were deleted)",
                r.alloc_id
            ))
        })?;
        let files = stream_files(&dir, file);
        let mut cursor = Cursor::start(&files, r.offset);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let _permit = permit;
            loop {
                // Checked before reading, so output written before the end is never missed.
                let done = !r.follow || finished(&dir);
                let data = match cursor.next(&files, CHUNK_BYTES) {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(format!("reading {}: {e}", dir.display())))).await;
                        return;
                    }
                };
                if !data.is_empty() {
                    if tx.send(Ok(pb::LogChunk { data, next_offset: cursor.position() })).await.is_err() {
                        return;
                    }
                    continue;
                }
                if done {
                    return;
                }
                tokio::select! {
                    () = tokio::time::sleep(FOLLOW_POLL) => {}
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(files: &[PathBuf; 2], offset: i64) -> Vec<u8> {
        let mut c = Cursor::start(files, offset);
        let mut out = Vec::new();
        loop {
            let d = c.next(files, 3).expect("read");
            if d.is_empty() {
                return out;
            }
            out.extend(d);
        }
    }

    #[test]
    fn reads_across_the_rotated_file_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = stream_files(dir.path(), "stdout.log");
        // Nothing yet: empty, not an error.
        assert!(read_all(&files, 0).is_empty());
        std::fs::write(&files[1], b"only current\n").expect("write");
        assert_eq!(read_all(&files, 0), b"only current\n");
        std::fs::write(&files[0], b"old 1\nold 2\n").expect("write");
        std::fs::write(&files[1], b"new 3\n").expect("write");
        assert_eq!(read_all(&files, 0), b"old 1\nold 2\nnew 3\n");
        // A tail reaches back into the rotated file; an offset counts from its start.
        assert_eq!(read_all(&files, -11), b"ld 2\nnew 3\n");
        assert_eq!(read_all(&files, -100), b"old 1\nold 2\nnew 3\n");
        assert_eq!(read_all(&files, 6), b"old 2\nnew 3\n");
        assert_eq!(read_all(&files, 13), b"ew 3\n");
    }

    #[test]
    fn a_rotation_while_following_loses_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = stream_files(dir.path(), "stdout.log");
        std::fs::write(&files[1], b"abcdef").expect("write");
        let mut c = Cursor::start(&files, 0);
        assert_eq!(c.next(&files, 4).expect("read"), b"abcd");
        // The shim rotates: the current file becomes `.1` and a new one starts.
        std::fs::rename(&files[1], &files[0]).expect("rotate");
        // Longer than what was read of the old one: only its inode tells the rotation.
        std::fs::write(&files[1], b"ghijkl").expect("write");
        let mut rest = Vec::new();
        loop {
            let d = c.next(&files, 4).expect("read");
            if d.is_empty() {
                break;
            }
            rest.extend(d);
        }
        assert_eq!(rest, b"efghijkl");
    }
}
