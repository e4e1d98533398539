//! Group commit: concurrent submissions on one server are proposed together as one
//! [`Command::Batch`], so one raft round trip and one fsync per server carry many of them.
//!
//! ```text
//!  Submit ─┐                        ┌─ answer 1
//!  Submit ─┼─▶ queue (bounded) ─▶ drain ─▶ propose(Batch[..]) ─▶ Response::Batch ─┼─ answer 2
//!  Submit ─┘   (no added delay: a batch is whatever queued while the last was in flight) └─ ...
//! ```
//!
//! A lone request is proposed on its own, so a single synchronous client pays nothing extra.
//! At most [`IN_FLIGHT`] batches are in raft at once; each answer is exactly what the command
//! alone would have received.

use crate::core::Core;
use std::sync::Arc;
use suanli_state::{Batch, Command, Response};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tonic::Status;

/// Most commands in one batch (~300 KiB of log entry for 1024 submissions). What bounds an
/// AppendEntries (openraft 0.9 gives it one heartbeat interval) is `raft.max_append_bytes`,
/// not this; a batch over `max_command_bytes` is split (see `propose_batch`). 1024 against 512
/// took the batched phase of `suanli bench submit` from ~15k to ~20k acks/s.
pub const MAX_BATCH: usize = 1024;
/// Batches proposed concurrently. Few and large beats many and small here: every entry costs
/// an fsync on each server and a trip through openraft's single core task, so with 256
/// concurrent clients on 2 cores 2 in flight gave ~7.5k acks/s where 16 gave ~4.7k
/// (`suanli bench submit`, docs/control-plane.md).
pub const IN_FLIGHT: usize = 2;
/// Requests waiting for a batch (a full queue answers RESOURCE_EXHAUSTED).
pub const QUEUE: usize = 16 * 1024;

type Reply = oneshot::Sender<Result<(Response, u64), Status>>;

/// The sending side, held by the services.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<(Command, Reply)>,
}

impl Batcher {
    /// Starts the batching task for `core`.
    pub fn start(core: Arc<Core>) -> Batcher {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(core, rx));
        Batcher { tx }
    }

    /// Commits `cmd` as part of a batch; answers like [`Core::propose_raw`].
    pub async fn propose(&self, cmd: Command) -> Result<(Response, u64), Status> {
        let (tx, rx) = oneshot::channel();
        self.tx.try_send((cmd, tx)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                Status::resource_exhausted(format!("too many submissions waiting: the limit is {QUEUE}"))
            }
            mpsc::error::TrySendError::Closed(_) => Status::unavailable("the server is shutting down"),
        })?;
        rx.await.map_err(|_| Status::unavailable("the server is shutting down"))?
    }

    /// Queues every command at once (so they share batches), then answers each in order.
    pub async fn propose_many(&self, cmds: Vec<Command>) -> Vec<Result<(Response, u64), Status>> {
        let mut waiting = Vec::with_capacity(cmds.len());
        for cmd in cmds {
            let (tx, rx) = oneshot::channel();
            waiting.push(match self.tx.try_send((cmd, tx)) {
                Ok(()) => Ok(rx),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    Err(Status::resource_exhausted(format!("too many submissions waiting: the limit is {QUEUE}")))
                }
                Err(mpsc::error::TrySendError::Closed(_)) => Err(Status::unavailable("the server is shutting down")),
            });
        }
        let mut out = Vec::with_capacity(waiting.len());
        for w in waiting {
            out.push(match w {
                Ok(rx) => rx.await.unwrap_or_else(|_| Err(Status::unavailable("the server is shutting down"))),
                Err(s) => Err(s),
            });
        }
        out
    }
}

async fn run(core: Arc<Core>, mut rx: mpsc::Receiver<(Command, Reply)>) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(x) => batch.push(x),
                Err(_) => break,
            }
        }
        let core = core.clone();
        tokio::spawn(async move {
            let _permit = permit;
            propose_batch(&core, batch).await;
        });
    }
}

/// Proposes `batch` as one [`Command::Batch`] and answers each request. A batch whose encoding
/// exceeds `max_command_bytes` (many large specs, each fine alone) is split in halves until
/// the parts fit, so requests are refused for their own size only.
async fn propose_batch(core: &Core, batch: Vec<(Command, Reply)>) {
    let mut todo = vec![batch];
    while let Some(mut batch) = todo.pop() {
        if batch.len() == 1 {
            if let Some((cmd, reply)) = batch.pop() {
                let _ = reply.send(core.propose_raw(cmd).await);
            }
            continue;
        }
        let (cmds, replies): (Vec<Command>, Vec<Reply>) = batch.into_iter().unzip();
        let mut cmd = Command::Batch(Batch { commands: cmds });
        cmd.stamp(core.now_s());
        let encoded = match suanli_raft::encode(&cmd) {
            Ok(e) => e,
            Err(e) => {
                fail_all(replies, &Status::internal(format!("encoding a batch: {e}")));
                continue;
            }
        };
        if encoded.len() > core.max_command_bytes() {
            let Command::Batch(Batch { commands }) = cmd else { continue };
            let mut all: Vec<(Command, Reply)> = commands.into_iter().zip(replies).collect();
            let second = all.split_off(all.len() / 2);
            todo.push(second);
            todo.push(all);
            continue;
        }
        match core.propose_encoded(encoded).await {
            Ok((Response::Batch(rs), index)) if rs.len() == replies.len() => {
                for (r, reply) in rs.into_iter().zip(replies) {
                    let _ = reply.send(Ok((r, index)));
                }
            }
            Ok((other, _)) => fail_all(replies, &Status::internal(format!("unexpected answer to a batch: {other:?}"))),
            Err(s) => fail_all(replies, &s),
        }
    }
}

/// Answers every request of a batch with the same error.
fn fail_all(replies: Vec<Reply>, s: &Status) {
    for reply in replies {
        let _ = reply.send(Err(s.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit;
    use suanli_model::{Queue, QueueId, ResVec};
    use suanli_state::{StateConfig, UpdateConfig, UpsertQueue};

    fn queue(id: &str) -> Command {
        Command::UpsertQueue(UpsertQueue { queue: Queue::new(id, ResVec::MAX) })
    }

    fn answers(rs: &[Result<(Response, u64), Status>]) -> Vec<(&Response, u64)> {
        rs.iter().map(|r| r.as_ref().map(|(resp, i)| (resp, *i)).expect("committed")).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_submissions_share_one_entry_and_each_gets_its_own_answer() {
        let dir = tempfile::tempdir().expect("temp dir");
        let core = testkit::solo_core(dir.path()).await;
        let b = Batcher::start(core.clone());
        let mut cmds: Vec<Command> = (0..100).map(|i| queue(&format!("q{i}"))).collect();
        // One refused in the middle: refused alone, as it would be on its own.
        let mut orphan = Queue::new("orphan", ResVec::MAX);
        orphan.parent = Some(QueueId("nope".into()));
        cmds.insert(50, Command::UpsertQueue(UpsertQueue { queue: orphan }));
        let rs = b.propose_many(cmds).await;
        let got = answers(&rs);
        assert_eq!(got.len(), 101);
        let indexes: std::collections::BTreeSet<u64> = got.iter().map(|(_, i)| *i).collect();
        assert_eq!(indexes.len(), 1, "queued together, committed as one entry: {indexes:?}");
        for (k, (r, _)) in got.iter().enumerate() {
            if k == 50 {
                assert!(matches!(r, Response::Rejected(_)), "the orphan is refused: {r:?}");
            } else {
                assert_eq!(**r, Response::Done, "command {k}");
            }
        }
        let n = core.state.read(|s| s.queues().len());
        assert_eq!(n, 100, "every valid queue applied, the refused one not");
        // A lone request is proposed on its own (no batch around it).
        let (r, i) = b.propose(queue("alone")).await.expect("committed");
        assert_eq!(r, Response::Done);
        assert!(i > *indexes.first().expect("an index"));
    }

    #[tokio::test(start_paused = true)]
    async fn more_than_a_batch_holds_takes_several_entries() {
        let dir = tempfile::tempdir().expect("temp dir");
        let core = testkit::solo_core(dir.path()).await;
        let b = Batcher::start(core);
        let rs = b.propose_many((0..MAX_BATCH + 10).map(|i| queue(&format!("q{i}"))).collect()).await;
        let got = answers(&rs);
        let mut per_index = std::collections::BTreeMap::<u64, usize>::new();
        for (_, i) in &got {
            *per_index.entry(*i).or_default() += 1;
        }
        assert_eq!(per_index.values().copied().collect::<Vec<_>>(), [MAX_BATCH, 10], "{per_index:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_over_the_command_limit_is_split_until_its_parts_fit() {
        let dir = tempfile::tempdir().expect("temp dir");
        let core = testkit::solo_core(dir.path()).await;
        let limit = 2_000;
        let config = StateConfig { max_command_bytes: limit, ..StateConfig::default() };
        core.propose_local(Command::UpdateConfig(Box::new(UpdateConfig { config }))).await.expect("config");
        let one = suanli_raft::encode(&queue("q00")).expect("encodes").len();
        assert!(one * 32 > limit, "32 queues ({one} bytes each) do not fit one entry");
        let b = Batcher::start(core.clone());
        let rs = b.propose_many((0..32).map(|i| queue(&format!("q{i:02}"))).collect()).await;
        let got = answers(&rs);
        assert!(got.iter().all(|(r, _)| **r == Response::Done), "each refused for its own size only: {got:?}");
        let entries: std::collections::BTreeSet<u64> = got.iter().map(|(_, i)| *i).collect();
        assert!(entries.len() > 1, "split: {entries:?}");
        assert!(entries.len() < 32, "halves, not one entry each: {entries:?}");
        assert_eq!(core.state.read(|s| s.queues().len()), 32);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_answers_resource_exhausted_and_the_rest_commit() {
        let dir = tempfile::tempdir().expect("temp dir");
        let core = testkit::solo_core(dir.path()).await;
        let b = Batcher::start(core);
        // Queued before the batching task runs (one thread): the last one finds the queue full.
        // (Orphans: refused at apply, cheaply, which is an answer like any other.)
        let orphan = |i: usize| {
            let mut q = Queue::new(format!("q{i}"), ResVec::MAX);
            q.parent = Some(QueueId("nope".into()));
            Command::UpsertQueue(UpsertQueue { queue: q })
        };
        let rs = b.propose_many((0..=QUEUE).map(orphan).collect()).await;
        let (last, committed) = rs.split_last().expect("answers");
        let e = last.as_ref().expect_err("over the queue");
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains(&format!("the limit is {QUEUE}")), "{e:?}");
        assert!(committed.iter().all(Result::is_ok), "everything queued commits");
    }
}
