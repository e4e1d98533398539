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

fn read_from(path: &Path, offset: u64, max: usize) -> std::io::Result<(Vec<u8>, u64)> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(offset.min(len)))?;
    let mut buf = vec![0u8; max];
    let n = f.read(&mut buf)?;
    buf.truncate(n);
    Ok((buf, len))
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
        let path = dir.join(file);
        let len = std::fs::metadata(&path).map_or(0, |m| m.len());
        let mut offset =
            if r.offset < 0 { len.saturating_sub(r.offset.unsigned_abs()) } else { (r.offset as u64).min(len) };
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let _permit = permit;
            loop {
                // Checked before reading, so output written before the end is never missed.
                let done = !r.follow || finished(&dir);
                let (data, len) = match read_from(&path, offset, CHUNK_BYTES) {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(format!("reading {}: {e}", path.display())))).await;
                        return;
                    }
                };
                if len < offset {
                    offset = 0; // rotated
                    continue;
                }
                if !data.is_empty() {
                    offset += data.len() as u64;
                    if tx.send(Ok(pb::LogChunk { data, next_offset: offset })).await.is_err() {
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
