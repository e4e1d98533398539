//! What happened in a run: every client operation with its invocation and completion, every
//! fault the nemesis injected, and (read at the end) every task start and stop from the agents'
//! own journals.

use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch: the clock the agents' journals use too (all
/// processes run on one host, so their stamps are comparable).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A client operation.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpKind {
    /// Submit a job with this client request id.
    Submit {
        /// Idempotency key (also the job's name).
        request_id: String,
    },
    /// Cancel a job.
    Cancel {
        /// The job.
        job: u64,
    },
    /// Create or update a queue's quota.
    Queue {
        /// The queue.
        queue: String,
        /// Its nominal GPU share in milli.
        gpu_milli: u64,
    },
    /// Read a job (linearizable).
    Read {
        /// The job.
        job: u64,
    },
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Acknowledged; for a submission, the job id.
    Ok {
        /// The job a submission created (or found, on a retry).
        job: Option<u64>,
    },
    /// Refused: it certainly did not take effect.
    Fail {
        /// The status.
        why: String,
    },
    /// Unknown: a timeout or an unavailable server; it may or may not have taken effect.
    Info {
        /// The status.
        why: String,
    },
}

/// One operation of the history.
#[derive(Debug, Clone, Serialize)]
pub struct Op {
    /// The client that ran it.
    pub client: usize,
    /// What it was.
    #[serde(flatten)]
    pub kind: OpKind,
    /// When it was invoked (ms).
    pub invoked_ms: u64,
    /// When it completed (ms).
    pub completed_ms: u64,
    /// The server (index) whose answer ended it.
    pub server: usize,
    /// Every server (index) asked, in order: retries of an unknown outcome reuse the request id.
    pub asked: Vec<usize>,
    /// How it ended.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// A fault the nemesis injected or healed.
#[derive(Debug, Clone, Serialize)]
pub struct FaultEvent {
    /// When (ms).
    pub at_ms: u64,
    /// What, e.g. `kill server 2 (leader)`.
    pub what: String,
}

/// The shared, append-only history of a run.
#[derive(Debug, Default, Clone)]
pub struct History {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    ops: Vec<Op>,
    faults: Vec<FaultEvent>,
}

impl History {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a completed operation.
    pub fn op(&self, op: Op) {
        self.lock().ops.push(op);
    }

    /// Records a fault (and prints it as it happens).
    pub fn fault(&self, what: String) {
        let at_ms = now_ms();
        tracing::info!(%what, "nemesis");
        self.lock().faults.push(FaultEvent { at_ms, what });
    }

    /// Every operation so far.
    pub fn ops(&self) -> Vec<Op> {
        self.lock().ops.clone()
    }

    /// Every fault so far.
    pub fn faults(&self) -> Vec<FaultEvent> {
        self.lock().faults.clone()
    }
}
