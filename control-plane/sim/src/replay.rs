//! `suanli sim replay`: the trace replayed with time, on the real scheduling engine.
//!
//! ```text
//!  pods (arrival_s, duration_s) ──▶ event heap (completions < arrivals < pass wake-ups, per time)
//!        │                                   │  all events of one time are applied together
//!        ▼                                   ▼
//!  pending jobs, running allocations ──▶ ClusterView ──▶ engine::schedule(view, now, pass seed)
//!        ▲                                                         │
//!        └──── apply the plan like the control plane: preemptions stop and requeue victims,
//!              placements start jobs (gangs all at once), unplaced jobs keep waiting
//! ```
//!
//! The clock is simulated: decisions never read the wall clock. A scheduling pass runs at the
//! time of an event that changed something while jobs are pending, at most once every
//! `interval_s` simulated seconds (later changes wait for a wake-up at `last pass +
//! interval_s`). Passes that could not change anything are skipped. Each pass gets a seed
//! derived from the run's seed and the pass number, so a run replays exactly.
//!
//! Modelling choices (also in docs/sim.md, `## replay`):
//! - A pod without a duration runs until the simulation ends (it never frees its capacity) and
//!   is reported as running at the end; it has no completion time.
//! - A preempted job stops at the pass that preempts it (the grace period is not simulated, so
//!   the freed capacity is never claimed twice) and is requeued with its original submission
//!   time. Without a checkpoint policy it loses all its work; with one it keeps the work up to
//!   its last periodic checkpoint and pays `restore_s` when it starts again.
//! - The capacity a preemption frees is nominated for the job it was freed for: victims are
//!   requeued once that job has started (or the next pass has run). A job preempted `max_preemptions_per_job` times
//!   runs as non-preemptible from then on, so contradicting preemption rules cannot cycle.
//! - Running allocations carry the true remaining run time as their runtime estimate, so
//!   backfill works with perfect estimates.
//!
//! Invariants checked when a plan is applied (an engine bug, not bad input, when they fail):
//! a placement's job is pending, a gang's replicas all arrive in one plan, no node or device is
//! over-committed, and every victim is running.

use crate::trace::TracePod;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::fmt::Write as _;
use std::io::Read;
use std::path::Path;
use suanli_model::{
    AllocId, Allocation, CheckpointPolicy, DeviceKind, JobId, JobKind, JobSpec, Node, Plan, Queue, QueueId, ResVec,
    TaskGroup,
};
use suanli_scheduler::cluster::{Cluster, ClusterError, DevReq};
use suanli_scheduler::engine::{
    ClusterView, PendingJob, ScheduleError, SchedulerConfig, WorkloadSample, build_profile,
};
use suanli_scheduler::policy::TieBreak;
use suanli_scheduler::{POLICY_NAMES, Profile};
use thiserror::Error;

/// Largest queues file accepted (bytes).
pub const MAX_QUEUES_BYTES: u64 = 16 << 20;
/// Most queues a queues file may define.
pub const MAX_QUEUES: usize = 10_000;
/// Latest arrival and longest duration a replayed pod may have (100 years, in seconds).
pub const MAX_SIM_TIME_S: u64 = 100 * 365 * 24 * 3600;
/// Largest workload window (arrivals remembered for the fragmentation profile).
pub const MAX_WORKLOAD_WINDOW: usize = 10_000_000;
/// Longest pass interval (one day, in seconds).
pub const MAX_INTERVAL_S: u64 = 24 * 3600;
/// Most samples kept in the time series; beyond it every other sample is dropped.
pub const MAX_SAMPLES: usize = 100_000;
/// Never-started jobs listed by name in the report.
pub const UNSTARTED_EXAMPLES: usize = 5;

/// The columns of a queues file, in their documented order.
pub const QUEUE_COLUMNS: [&str; 10] = [
    "name",
    "team",
    "parent",
    "cohort",
    "weight",
    "cpu_milli",
    "memory_mib",
    "gpu_milli",
    "npu_milli",
    "borrow_gpu_milli",
];

/// Why a replay could not run or had to stop.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// Could not open or read a file.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A queues file is larger than [`MAX_QUEUES_BYTES`].
    #[error("{path}: {size} bytes is larger than the limit of {MAX_QUEUES_BYTES} bytes")]
    TooLarge {
        /// File.
        path: String,
        /// Its size.
        size: u64,
    },
    /// A bad value in a queues file.
    #[error("{path}: line {line}: field {field:?}: {message}")]
    QueueField {
        /// File.
        path: String,
        /// 1-based line.
        line: u64,
        /// Column name.
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// A malformed queues file (ragged row, bad UTF-8, unknown column, no rows).
    #[error("{path}: line {line}: {message}")]
    QueueFile {
        /// File.
        path: String,
        /// 1-based line.
        line: u64,
        /// What is wrong.
        message: String,
    },
    /// A pod the replay refuses (beyond a limit, unknown queue, invalid as a job).
    #[error("pod #{index} ({name:?}): {message}")]
    Pod {
        /// 0-based position in the pod list.
        index: usize,
        /// Pod name.
        name: String,
        /// What is wrong and the limit.
        message: String,
    },
    /// A bad option.
    #[error("{field}: {message}")]
    Param {
        /// Option.
        field: &'static str,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// Bad node list.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The engine refused to run a pass.
    #[error("pass {pass} at t={t_s}s: {source}")]
    Schedule {
        /// Pass number.
        pass: u64,
        /// Simulated time.
        t_s: u64,
        /// Cause.
        source: ScheduleError,
    },
    /// A plan broke an invariant when applied (a scheduler bug: please report it with the seed).
    #[error("pass {pass} at t={t_s}s: invalid plan: {message} (reproduce with seed={seed})")]
    Plan {
        /// Pass number.
        pass: u64,
        /// Simulated time.
        t_s: u64,
        /// The run's seed.
        seed: u64,
        /// What was wrong.
        message: String,
    },
    /// The run needed more events than allowed.
    #[error(
        "stopped after {limit} events at t={t_s}s with {pending} job(s) pending: raise --max-events to replay further"
    )]
    TooManyEvents {
        /// The limit.
        limit: u64,
        /// Simulated time reached.
        t_s: u64,
        /// Jobs still pending.
        pending: usize,
    },
}

/// Options of one replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Engine configuration (the policy name is `config.policy`).
    pub config: SchedulerConfig,
    /// The run's seed; each pass gets a seed derived from it and the pass number.
    pub seed: u64,
    /// Least simulated time between two passes, seconds (1 ..= one day).
    pub interval_s: u64,
    /// Most events (arrivals, completions, wake-ups and passes) before the run stops with an error.
    pub max_events: u64,
    /// Arrivals remembered for the fragmentation profile (the typical workload).
    pub workload_window: usize,
    /// Take a utilization/fragmentation sample every this many events.
    pub sample_every: u64,
    /// Checkpoint policy given to every job (`None`: jobs cannot checkpoint and lose all their
    /// work when preempted).
    pub checkpoint: Option<CheckpointPolicy>,
    /// Also report every job's outcome ([`ReplayReport::job_outcomes`]).
    pub record_jobs: bool,
    /// A job preempted this many times is not offered for preemption again (it runs as
    /// non-preemptible), so preemption rules that contradict each other cannot cycle forever.
    pub max_preemptions_per_job: u32,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            config: SchedulerConfig::default(),
            seed: 42,
            interval_s: 10,
            max_events: 5_000_000,
            workload_window: 2000,
            sample_every: 100,
            checkpoint: None,
            record_jobs: false,
            max_preemptions_per_job: 5,
        }
    }
}

impl ReplayOptions {
    fn validate(&self) -> Result<(), ReplayError> {
        if !POLICY_NAMES.contains(&self.config.policy.as_str()) {
            return Err(ReplayError::Param {
                field: "policy",
                message: format!(
                    "unknown policy {:?}; valid policies: {}",
                    self.config.policy,
                    POLICY_NAMES.join(", ")
                ),
            });
        }
        let range = |field: &'static str, v: u64, lo: u64, hi: u64| {
            if v < lo || v > hi {
                Err(ReplayError::Param { field, message: format!("{v} must be between {lo} and {hi}") })
            } else {
                Ok(())
            }
        };
        range("interval_s", self.interval_s, 1, MAX_INTERVAL_S)?;
        range("max_events", self.max_events, 1, u64::MAX / 2)?;
        range("workload_window", self.workload_window as u64, 1, MAX_WORKLOAD_WINDOW as u64)?;
        range("sample_every", self.sample_every, 1, u64::MAX / 2)?;
        if let Some(c) = &self.checkpoint {
            range("checkpoint.interval_s", c.interval_s, 1, self.config.limits.max_duration_s)?;
            range("checkpoint.grace_s", c.grace_s, 0, self.config.limits.max_duration_s)?;
            range("checkpoint.restore_s", c.restore_s, 0, self.config.limits.max_duration_s)?;
        }
        Ok(())
    }
}

/// The queue used when no queues file is given: `default`, with no quota limit.
pub fn default_queue() -> Queue {
    Queue::new("default", ResVec::MAX)
}

// ---------------------------------------------------------------------------------------------
// Queues file

/// Reads a queues file (`name,team,parent,cohort,weight,cpu_milli,memory_mib,gpu_milli,
/// npu_milli,borrow_gpu_milli`; see docs/sim.md). Errors name the file, line and field.
pub fn read_queues(path: &Path) -> Result<Vec<Queue>, ReplayError> {
    let p = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| ReplayError::Io { path: p.clone(), source })?;
    let size = file.metadata().map_err(|source| ReplayError::Io { path: p.clone(), source })?.len();
    if size > MAX_QUEUES_BYTES {
        return Err(ReplayError::TooLarge { path: p, size });
    }
    let mut bytes = Vec::new();
    file.take(MAX_QUEUES_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|source| ReplayError::Io { path: p.clone(), source })?;
    parse_queues(&p, &bytes)
}

/// Same as [`read_queues`] from text; `name` is used in error messages.
pub fn parse_queues_str(name: &str, text: &str) -> Result<Vec<Queue>, ReplayError> {
    parse_queues(name, text.as_bytes())
}

fn parse_queues(path: &str, bytes: &[u8]) -> Result<Vec<Queue>, ReplayError> {
    let file_err = |line: u64, message: String| ReplayError::QueueFile { path: path.to_owned(), line, message };
    let field_err = |line: u64, field: &str, message: String| ReplayError::QueueField {
        path: path.to_owned(),
        line,
        field: field.to_owned(),
        message,
    };
    let mut rdr = csv::ReaderBuilder::new().has_headers(true).flexible(false).comment(Some(b'#')).from_reader(bytes);
    let csv_err = |e: csv::Error| file_err(e.position().map_or(0, |p| p.line()), e.to_string());
    let headers = rdr.headers().map_err(csv_err)?.clone();
    let mut col: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, h) in headers.iter().enumerate() {
        let h = h.trim();
        let Some(known) = QUEUE_COLUMNS.iter().find(|c| **c == h) else {
            return Err(file_err(1, format!("unknown column {h:?}; valid columns: {}", QUEUE_COLUMNS.join(","))));
        };
        if col.insert(known, i).is_some() {
            return Err(file_err(1, format!("column {h:?} appears twice")));
        }
    }
    if !col.contains_key("name") {
        return Err(file_err(1, format!("missing column \"name\" (columns: {})", QUEUE_COLUMNS.join(","))));
    }
    let limits = suanli_model::Limits::default();
    let mut queues: Vec<Queue> = Vec::new();
    let mut lines: Vec<u64> = Vec::new();
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for rec in rdr.records() {
        let rec = rec.map_err(csv_err)?;
        let line = rec.position().map_or(0, |p| p.line());
        if queues.len() >= MAX_QUEUES {
            return Err(file_err(line, format!("more than {MAX_QUEUES} queues")));
        }
        let get = |c: &str| col.get(c).and_then(|&i| rec.get(i)).map_or("", str::trim);
        let num = |c: &str, max: u64| -> Result<Option<u64>, ReplayError> {
            let s = get(c);
            if s.is_empty() {
                return Ok(None);
            }
            let v: u64 = s.parse().map_err(|_| {
                field_err(line, c, format!("{s:?} is not a non-negative integer (0..={max}, empty = unlimited)"))
            })?;
            if v > max {
                return Err(field_err(line, c, format!("{v} exceeds the limit of {max}")));
            }
            Ok(Some(v))
        };
        let name = get("name");
        if name.is_empty() {
            return Err(field_err(line, "name", "must not be empty".into()));
        }
        if name.len() > limits.max_name_len || name.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(field_err(
                line,
                "name",
                format!("{name:?} must be at most {} bytes without spaces or control characters", limits.max_name_len),
            ));
        }
        if let Some(first) = seen.get(name) {
            return Err(field_err(line, "name", format!("duplicate queue {name:?} (first defined on line {first})")));
        }
        seen.insert(name.to_owned(), line);
        let weight = match num("weight", 1_000_000)? {
            None => 1,
            Some(0) => {
                return Err(field_err(line, "weight", "0 must be between 1 and 1000000".into()));
            }
            Some(w) => w as u32,
        };
        let dim = |c: &str| num(c, u64::MAX / 4).map(|v| v.unwrap_or(u64::MAX));
        let nominal = ResVec {
            cpu_milli: dim("cpu_milli")?,
            memory_mib: dim("memory_mib")?,
            gpu_milli: dim("gpu_milli")?,
            npu_milli: dim("npu_milli")?,
        };
        let opt = |c: &str| Some(get(c)).filter(|s| !s.is_empty()).map(str::to_owned);
        let cohort = opt("cohort");
        let borrow = num("borrow_gpu_milli", u64::MAX / 4)?;
        if borrow.is_some() && cohort.is_none() {
            return Err(field_err(
                line,
                "borrow_gpu_milli",
                "a borrowing limit needs a cohort to borrow from; set the cohort column or leave this empty".into(),
            ));
        }
        let parent = opt("parent").map(QueueId);
        if parent.as_ref().is_some_and(|p| p.as_str() == name) {
            return Err(field_err(line, "parent", format!("queue {name:?} cannot be its own parent")));
        }
        let q = Queue {
            id: QueueId::new(name),
            team: get("team").to_owned(),
            parent,
            cohort,
            weight,
            nominal,
            borrowing_limit: borrow.map(|b| ResVec { gpu_milli: b, ..ResVec::MAX }),
            lending_limit: None,
        };
        q.validate(&limits).map_err(|e| field_err(line, e.field().trim_start_matches("queue."), e.to_string()))?;
        queues.push(q);
        lines.push(line);
    }
    if queues.is_empty() {
        return Err(file_err(1, "no queues defined".into()));
    }
    // Parents must exist and the hierarchy must not loop.
    for (i, q) in queues.iter().enumerate() {
        let mut cur = q.parent.clone();
        let mut depth = 0;
        while let Some(p) = cur {
            let Some(pq) = queues.iter().find(|o| o.id == p) else {
                return Err(field_err(
                    lines[i],
                    "parent",
                    format!("unknown queue {:?}; define it on its own line", p.as_str()),
                ));
            };
            depth += 1;
            if pq.id == q.id || depth > 64 {
                return Err(field_err(
                    lines[i],
                    "parent",
                    format!("queue {:?} is its own ancestor (or the hierarchy is deeper than 64)", q.id.as_str()),
                ));
            }
            cur = pq.parent.clone();
        }
    }
    Ok(queues)
}

// ---------------------------------------------------------------------------------------------
// Report

/// Percentiles of a set of durations, seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Values counted.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: u64,
    /// 95th percentile.
    pub p95: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest value.
    pub max: u64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `v` (sorted in place).
    pub fn of(v: &mut [u64]) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_unstable();
        let n = v.len();
        let at = |p: u64| v[((p as usize * n).div_ceil(100)).clamp(1, n) - 1];
        Self {
            count: n as u64,
            mean: v.iter().map(|&x| x as f64).sum::<f64>() / n as f64,
            p50: at(50),
            p95: at(95),
            p99: at(99),
            max: v[n - 1],
        }
    }
}

/// One point of the utilization time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Simulated time, seconds.
    pub t_s: u64,
    /// Events processed so far.
    pub events: u64,
    /// Jobs waiting.
    pub pending_jobs: u64,
    /// Jobs running.
    pub running_jobs: u64,
    /// GPU milli allocated.
    pub gpu_alloc_milli: u64,
    /// Allocated GPU milli as % of the cluster's GPU milli.
    pub gpu_util_pct: f64,
    /// Expected fragmented GPU milli (against the recent workload) as % of the cluster's GPUs.
    pub frag_pct: f64,
    /// The same as % of the unallocated GPU milli.
    pub frag_of_free_pct: f64,
}

/// Per-queue results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueReport {
    /// Queue.
    pub queue: String,
    /// Owning team.
    pub team: String,
    /// Jobs submitted to it.
    pub jobs: u64,
    /// Its jobs that completed.
    pub completed: u64,
    /// Its jobs that never started.
    pub never_started: u64,
    /// GPU-hours allocated to it (including work later lost to preemption); a parent queue
    /// counts its subtree.
    pub gpu_hours: f64,
    /// Those GPU-hours as % of the cluster's GPU-hours over the replayed span.
    pub share_pct: f64,
    /// Largest used/nominal (dominant over the dimensions with a finite, non-zero nominal), %.
    /// `None` for a queue without quota.
    pub quota_use_max_pct: Option<f64>,
    /// Time-weighted mean of used/nominal over the replayed span, %.
    pub quota_use_mean_pct: Option<f64>,
    /// Times its jobs were preempted.
    pub preemptions: u64,
    /// Median wait of its started jobs, seconds.
    pub wait_p50_s: u64,
}

/// A job that never started, with the engine's last reason.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Unstarted {
    /// Pod name.
    pub name: String,
    /// Queue.
    pub queue: String,
    /// Why it waited, as the engine last said.
    pub reason: String,
}

/// What happened to one job (with [`ReplayOptions::record_jobs`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobOutcome {
    /// Pod name.
    pub name: String,
    /// Queue.
    pub queue: String,
    /// Submission time, seconds.
    pub submitted_s: u64,
    /// First start, seconds (`None`: never started).
    pub first_start_s: Option<u64>,
    /// Completion, seconds (`None`: never completed).
    pub done_s: Option<u64>,
    /// Times it was preempted.
    pub preemptions: u32,
}

/// Everything a replay measured. Deterministic for a seed: it holds no wall-clock times.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Policy.
    pub policy: String,
    /// Seed.
    pub seed: u64,
    /// Pass interval, seconds.
    pub interval_s: u64,
    /// Nodes in the cluster.
    pub nodes: u64,
    /// GPUs in the cluster (milli).
    pub gpu_milli: u64,
    /// Jobs in the trace.
    pub jobs: u64,
    /// Jobs that ran to completion.
    pub completed: u64,
    /// Jobs still running when the replay ended (pods without a duration, mostly).
    pub running_at_end: u64,
    /// Jobs that never started.
    pub never_started: u64,
    /// Jobs that started, were preempted and were still waiting to start again at the end.
    pub requeued_at_end: u64,
    /// Jobs preempted at least once.
    pub preempted_jobs: u64,
    /// Preemptions in all (a job may be preempted more than once).
    pub preemptions: u64,
    /// GPU-hours of work lost to preemption (since the victims' last checkpoints).
    pub lost_gpu_hours: f64,
    /// Scheduling passes run.
    pub passes: u64,
    /// Events processed.
    pub events: u64,
    /// First arrival, seconds.
    pub start_s: u64,
    /// Time of the last event, seconds.
    pub end_s: u64,
    /// Wait from submission to first start, seconds (started jobs).
    pub wait_s: Percentiles,
    /// Job completion time, submission to completion, seconds (completed jobs).
    pub jct_s: Percentiles,
    /// Time-weighted mean GPU allocation, % of the cluster's GPUs.
    pub gpu_util_mean_pct: f64,
    /// Highest GPU allocation, %.
    pub gpu_util_max_pct: f64,
    /// Mean fragmentation over the samples, % of the cluster's GPUs.
    pub frag_mean_pct: f64,
    /// Per queue, in name order.
    pub queues: Vec<QueueReport>,
    /// A few jobs that never started, with reasons.
    pub never_started_examples: Vec<Unstarted>,
    /// Utilization and fragmentation over time.
    pub series: Vec<Sample>,
    /// Every job's outcome, in submission order (only with [`ReplayOptions::record_jobs`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub job_outcomes: Vec<JobOutcome>,
}

fn opt_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
}

impl ReplayReport {
    /// A human-readable summary.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let h = |x: u64| format_duration(x);
        let _ = writeln!(
            s,
            "policy {} seed {} interval {}s: {} node(s), {:.0} GPU(s); replayed t={}s..{}s ({}), {} pass(es), {} event(s)",
            self.policy,
            self.seed,
            self.interval_s,
            self.nodes,
            self.gpu_milli as f64 / 1000.0,
            self.start_s,
            self.end_s,
            h(self.end_s.saturating_sub(self.start_s)),
            self.passes,
            self.events
        );
        let _ = writeln!(
            s,
            "jobs {}: completed {}, running at end {}, never started {}, requeued at end {}, preempted {} ({} preemption(s), {:.2} GPU-h lost)",
            self.jobs,
            self.completed,
            self.running_at_end,
            self.never_started,
            self.requeued_at_end,
            self.preempted_jobs,
            self.preemptions,
            self.lost_gpu_hours
        );
        let _ = writeln!(s, "{:<22} {:>10} {:>10} {:>10} {:>10} {:>10}", "", "p50", "p95", "p99", "max", "mean");
        for (name, p) in [("wait (submit->start)", &self.wait_s), ("completion time", &self.jct_s)] {
            let _ = writeln!(
                s,
                "{:<22} {:>10} {:>10} {:>10} {:>10} {:>10}",
                name,
                h(p.p50),
                h(p.p95),
                h(p.p99),
                h(p.max),
                h(p.mean.round() as u64)
            );
        }
        let _ = writeln!(
            s,
            "GPU allocation: mean {:.2}%, max {:.2}%; fragmentation: mean {:.2}% of GPUs ({} samples)",
            self.gpu_util_mean_pct,
            self.gpu_util_max_pct,
            self.frag_mean_pct,
            self.series.len()
        );
        let _ = writeln!(
            s,
            "{:<16} {:>7} {:>9} {:>9} {:>11} {:>7} {:>9} {:>9} {:>8} {:>9}",
            "queue",
            "jobs",
            "completed",
            "unstarted",
            "GPU-hours",
            "share%",
            "quota max",
            "quota avg",
            "preempt",
            "wait p50"
        );
        for q in &self.queues {
            let _ = writeln!(
                s,
                "{:<16} {:>7} {:>9} {:>9} {:>11.1} {:>7.2} {:>9} {:>9} {:>8} {:>9}",
                q.queue,
                q.jobs,
                q.completed,
                q.never_started,
                q.gpu_hours,
                q.share_pct,
                opt_pct(q.quota_use_max_pct),
                opt_pct(q.quota_use_mean_pct),
                q.preemptions,
                h(q.wait_p50_s)
            );
        }
        for u in &self.never_started_examples {
            let _ = writeln!(s, "never started: {} (queue {}): {}", u.name, u.queue, u.reason);
        }
        s
    }

    /// The time series as CSV.
    pub fn series_csv(&self) -> String {
        let mut s = String::from(
            "t_s,events,pending_jobs,running_jobs,gpu_alloc_milli,gpu_util_pct,frag_pct,frag_of_free_pct\n",
        );
        for p in &self.series {
            let _ = writeln!(
                s,
                "{},{},{},{},{},{:.4},{:.4},{:.4}",
                p.t_s,
                p.events,
                p.pending_jobs,
                p.running_jobs,
                p.gpu_alloc_milli,
                p.gpu_util_pct,
                p.frag_pct,
                p.frag_of_free_pct
            );
        }
        s
    }
}

/// `93s`, `15m32s`, `3h05m`, `2d04h`.
pub fn format_duration(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

// ---------------------------------------------------------------------------------------------
// The replay

/// How far a replay has come, for progress bars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Events processed.
    pub events: u64,
    /// Simulated time, seconds.
    pub now_s: u64,
    /// Jobs arrived so far.
    pub arrived: u64,
    /// Jobs in the trace.
    pub jobs: u64,
    /// Jobs pending now.
    pub pending: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A job's run ends (ignored when `run` is stale: the job was preempted meanwhile).
    Complete { job: u32, run: u32 },
    /// A job is submitted.
    Arrive { job: u32 },
    /// A wake-up for a pass delayed by the interval.
    Wake,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    NotArrived,
    Pending,
    Running,
    Done,
}

#[derive(Debug, Clone)]
struct Job {
    pod: usize,
    spec: JobSpec,
    queue: usize,
    submitted_at: u64,
    /// Work needed in all, seconds (`None`: runs until the end).
    work_s: Option<u64>,
    /// Work saved by checkpoints.
    saved_s: u64,
    status: Status,
    /// Bumped at each start; completion events carry it.
    run: u32,
    run_start: u64,
    /// Restore time paid at the start of the current run.
    run_restore_s: u64,
    first_start: Option<u64>,
    done_at: Option<u64>,
    preemptions: u32,
    gpu_milli: u64,
    usage: ResVec,
    last_reason: String,
}

/// Shape key of the workload window (per-replica resources and allowed models).
type ShapeKey = (u64, u64, u32, u32, Vec<String>);

struct QueueAcc {
    /// This queue and its ancestors (indices), for subtree usage.
    chain: Vec<usize>,
    used: ResVec,
    gpu_milli_s: u128,
    ratio_max: f64,
    ratio_s: f64,
    preemptions: u64,
}

struct Sim<'a> {
    opts: &'a ReplayOptions,
    pods: &'a [TracePod],
    queues: &'a [Queue],
    jobs: Vec<Job>,
    view: ClusterView,
    heap: BinaryHeap<Reverse<(u64, Ev)>>,
    now: u64,
    events: u64,
    passes: u64,
    next_alloc: u64,
    wake_at: Option<u64>,
    last_pass: Option<u64>,
    dirty: bool,
    arrived: u64,
    /// The cluster as the control plane sees it after each applied plan (metrics, invariants).
    cluster: Cluster,
    total_gpu_milli: u64,
    alloc_gpu_milli: u64,
    alloc_gpu_milli_s: u128,
    util_max: f64,
    qacc: Vec<QueueAcc>,
    /// Recent arrivals: shape and replica count.
    window: VecDeque<(ShapeKey, u64)>,
    window_counts: BTreeMap<ShapeKey, u64>,
    preemptions: u64,
    /// Preempted jobs held out of the queue until the job they made room for starts (or one
    /// more pass has run): preemptor -> (pass of the preemption, victims).
    held: BTreeMap<usize, (u64, Vec<usize>)>,
    lost_gpu_milli_s: u128,
    series: Vec<Sample>,
    sample_stride: u64,
    frag_sum: f64,
    frag_n: u64,
}

/// SplitMix64: spreads the run seed and the pass number into a pass seed.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The seed of pass `pass` of a run seeded with `seed`.
pub fn pass_seed(seed: u64, pass: u64) -> u64 {
    mix(mix(seed) ^ pass)
}

fn quota_ratio(used: &ResVec, nominal: &ResVec) -> Option<f64> {
    let (u, n) = (used.dims(), nominal.dims());
    (0..4).filter(|&i| n[i] != u64::MAX && n[i] > 0).map(|i| u[i] as f64 / n[i] as f64).reduce(f64::max)
}

fn pod_job(
    index: usize,
    pod: &TracePod,
    queues: &[Queue],
    opts: &ReplayOptions,
) -> Result<(JobSpec, usize), ReplayError> {
    let err = |message: String| ReplayError::Pod { index, name: pod.name.clone(), message };
    if pod.arrival_s > MAX_SIM_TIME_S {
        return Err(err(format!("arrival_s {} exceeds the limit of {MAX_SIM_TIME_S} (100 years)", pod.arrival_s)));
    }
    if let Some(d) = pod.duration_s
        && d > MAX_SIM_TIME_S
    {
        return Err(err(format!("duration_s {d} exceeds the limit of {MAX_SIM_TIME_S} (100 years)")));
    }
    let Some(queue) = queues.iter().position(|q| q.id.as_str() == pod.queue) else {
        let names: Vec<&str> = queues.iter().take(20).map(|q| q.id.as_str()).collect();
        return Err(err(format!("queue {:?} is not defined; defined queues: {}", pod.queue, names.join(", "))));
    };
    if queues.iter().any(|q| q.parent.as_ref().is_some_and(|p| p.as_str() == pod.queue)) {
        return Err(err(format!("queue {:?} is a parent queue; jobs are submitted to leaf queues", pod.queue)));
    }
    let max_d = opts.config.limits.max_duration_s;
    let spec = JobSpec {
        name: pod.name.clone(),
        queue: QueueId::new(pod.queue.as_str()),
        kind: if pod.replicas > 1 { JobKind::Training } else { JobKind::Batch },
        priority: pod.priority,
        preemptible: true,
        gang: pod.replicas > 1,
        groups: vec![TaskGroup {
            task: None,
            name: "task".into(),
            replicas: pod.replicas,
            min_replicas: None,
            resources: pod.resources(),
        }],
        constraints: pod.constraints(),
        runtime_estimate_s: pod.duration_s.filter(|&d| d >= 1 && d <= max_d),
        checkpoint: opts.checkpoint,
    };
    spec.validate(&opts.config.limits).map_err(|e| err(format!("not a valid job: {e}")))?;
    Ok((spec, queue))
}

/// Replays `pods` on `nodes` with `queues` (give `[default_queue()]` for the Alibaba trace).
pub fn replay(
    nodes: &[Node],
    pods: &[TracePod],
    queues: &[Queue],
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    replay_with_progress(nodes, pods, queues, opts, &mut |_| {})
}

/// [`replay`], calling `progress` every few thousand events and once at the end.
pub fn replay_with_progress(
    nodes: &[Node],
    pods: &[TracePod],
    queues: &[Queue],
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<ReplayReport, ReplayError> {
    opts.validate()?;
    if nodes.is_empty() {
        return Err(ReplayError::Param { field: "nodes", message: "the node list is empty".into() });
    }
    if queues.is_empty() {
        return Err(ReplayError::Param { field: "queues", message: "no queues defined".into() });
    }
    if pods.len() > u32::MAX as usize / 2 {
        return Err(ReplayError::Param {
            field: "pods",
            message: format!("{} pods is more than a replay takes", pods.len()),
        });
    }
    let cluster = Cluster::new(nodes, &opts.config.limits, false, TieBreak::FixedOrder)?;
    let total_gpu_milli = cluster.total_gpu_milli();
    // Job ids grow with submission order: (arrival, position in the file).
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.sort_by_key(|&i| (pods[i].arrival_s, i));
    let mut jobs = Vec::with_capacity(pods.len());
    for &i in &order {
        let (spec, queue) = pod_job(i, &pods[i], queues, opts)?;
        let gpu_milli = spec.total().gpu_milli;
        let usage = spec.total();
        jobs.push(Job {
            pod: i,
            submitted_at: pods[i].arrival_s,
            work_s: pods[i].duration_s,
            spec,
            queue,
            saved_s: 0,
            status: Status::NotArrived,
            run: 0,
            run_start: 0,
            run_restore_s: 0,
            first_start: None,
            done_at: None,
            preemptions: 0,
            gpu_milli,
            usage,
            last_reason: String::new(),
        });
    }
    let mut heap = BinaryHeap::with_capacity(jobs.len() * 2);
    for (j, job) in jobs.iter().enumerate() {
        heap.push(Reverse((job.submitted_at, Ev::Arrive { job: j as u32 })));
    }
    let qacc = queues
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let mut chain = vec![i];
            let mut cur = q.parent.clone();
            while let Some(p) = cur {
                match queues.iter().position(|o| o.id == p) {
                    Some(k) if !chain.contains(&k) && chain.len() <= 64 => {
                        chain.push(k);
                        cur = queues[k].parent.clone();
                    }
                    _ => break,
                }
            }
            QueueAcc { chain, used: ResVec::ZERO, gpu_milli_s: 0, ratio_max: 0.0, ratio_s: 0.0, preemptions: 0 }
        })
        .collect();
    let mut sim = Sim {
        opts,
        pods,
        queues,
        jobs,
        view: ClusterView { nodes: nodes.to_vec(), queues: queues.to_vec(), ..Default::default() },
        heap,
        now: order.first().map_or(0, |&i| pods[i].arrival_s),
        events: 0,
        passes: 0,
        next_alloc: 1,
        wake_at: None,
        last_pass: None,
        dirty: false,
        arrived: 0,
        cluster,
        total_gpu_milli,
        alloc_gpu_milli: 0,
        alloc_gpu_milli_s: 0,
        util_max: 0.0,
        qacc,
        window: VecDeque::new(),
        window_counts: BTreeMap::new(),
        preemptions: 0,
        held: BTreeMap::new(),
        lost_gpu_milli_s: 0,
        series: Vec::new(),
        sample_stride: opts.sample_every,
        frag_sum: 0.0,
        frag_n: 0,
    };
    let start_s = sim.now;
    sim.run(progress)?;
    Ok(sim.report(start_s))
}

impl Sim<'_> {
    fn run(&mut self, progress: &mut dyn FnMut(&Progress)) -> Result<(), ReplayError> {
        let mut next_sample = self.sample_stride;
        let mut next_progress = 0u64;
        while let Some(&Reverse((t, _))) = self.heap.peek() {
            self.advance(t);
            while let Some(&Reverse((te, ev))) = self.heap.peek() {
                if te != t {
                    break;
                }
                self.heap.pop();
                self.count_event()?;
                match ev {
                    Ev::Complete { job, run } => self.complete(job as usize, run),
                    Ev::Arrive { job } => self.arrive(job as usize),
                    Ev::Wake => self.wake_at = None,
                }
            }
            if self.dirty && !self.view.pending.is_empty() {
                let allowed = self.last_pass.map_or(t, |l| l.saturating_add(self.opts.interval_s));
                if t >= allowed {
                    self.count_event()?;
                    self.pass(t)?;
                }
            }
            // Changes the last pass could not see yet (or made itself: preemptions) wait for a
            // wake-up one interval after it.
            if self.dirty && !self.view.pending.is_empty() && self.wake_at.is_none() {
                let at = self.last_pass.map_or(t, |l| l.saturating_add(self.opts.interval_s)).max(t);
                self.wake_at = Some(at);
                self.heap.push(Reverse((at, Ev::Wake)));
            }
            if self.events >= next_sample {
                self.sample();
                next_sample = self.events.saturating_add(self.sample_stride);
            }
            if self.events >= next_progress {
                progress(&self.progress());
                next_progress = self.events + 4096;
            }
        }
        self.sample();
        progress(&self.progress());
        Ok(())
    }

    fn progress(&self) -> Progress {
        Progress {
            events: self.events,
            now_s: self.now,
            arrived: self.arrived,
            jobs: self.jobs.len() as u64,
            pending: self.view.pending.len() as u64,
        }
    }

    fn count_event(&mut self) -> Result<(), ReplayError> {
        if self.events >= self.opts.max_events {
            return Err(ReplayError::TooManyEvents {
                limit: self.opts.max_events,
                t_s: self.now,
                pending: self.view.pending.len(),
            });
        }
        self.events += 1;
        Ok(())
    }

    /// Moves the clock to `t`, integrating usage over the elapsed time.
    fn advance(&mut self, t: u64) {
        let dt = t.saturating_sub(self.now);
        if dt > 0 {
            self.alloc_gpu_milli_s += u128::from(self.alloc_gpu_milli) * u128::from(dt);
            for (i, a) in self.qacc.iter_mut().enumerate() {
                a.gpu_milli_s += u128::from(a.used.gpu_milli) * u128::from(dt);
                if let Some(r) = quota_ratio(&a.used, &self.queues[i].nominal) {
                    a.ratio_s += r * dt as f64;
                }
            }
        }
        self.now = self.now.max(t);
    }

    fn charge(&mut self, job: usize, add: bool) {
        let (q, usage, gpu) = (self.jobs[job].queue, self.jobs[job].usage, self.jobs[job].gpu_milli);
        if add {
            self.alloc_gpu_milli += gpu;
        } else {
            self.alloc_gpu_milli = self.alloc_gpu_milli.saturating_sub(gpu);
        }
        let chain = self.qacc[q].chain.clone();
        for k in chain {
            let a = &mut self.qacc[k];
            a.used = if add { a.used + usage } else { a.used.saturating_sub(&usage) };
            if let Some(r) = quota_ratio(&a.used, &self.queues[k].nominal) {
                a.ratio_max = a.ratio_max.max(r);
            }
        }
        if self.total_gpu_milli > 0 {
            self.util_max = self.util_max.max(self.alloc_gpu_milli as f64 / self.total_gpu_milli as f64);
        }
    }

    fn arrive(&mut self, j: usize) {
        self.arrived += 1;
        let p = &self.pods[self.jobs[j].pod];
        let key: ShapeKey = (p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_spec.clone());
        let n = u64::from(p.replicas);
        *self.window_counts.entry(key.clone()).or_default() += n;
        self.window.push_back((key, n));
        if self.window.len() > self.opts.workload_window
            && let Some((old, n)) = self.window.pop_front()
            && let Some(c) = self.window_counts.get_mut(&old)
        {
            *c = c.saturating_sub(n);
            if *c == 0 {
                self.window_counts.remove(&old);
            }
        }
        self.enqueue(j);
    }

    /// The workload window as samples for the engine's fragmentation profile.
    fn workload(&self) -> Vec<WorkloadSample> {
        self.window_counts
            .iter()
            .map(|((cpu_milli, memory_mib, num_gpu, gpu_milli, spec), &count)| {
                let devices = (*num_gpu > 0 && *gpu_milli > 0).then_some(suanli_model::DeviceRequest {
                    kind: DeviceKind::Gpu,
                    count: *num_gpu,
                    milli: *gpu_milli,
                    memory_mib: 0,
                });
                WorkloadSample {
                    resources: suanli_model::TaskResources { cpu_milli: *cpu_milli, memory_mib: *memory_mib, devices },
                    device_models: spec.clone(),
                    count,
                }
            })
            .collect()
    }

    fn enqueue(&mut self, j: usize) {
        let job = &mut self.jobs[j];
        job.status = Status::Pending;
        let mut spec = job.spec.clone();
        spec.runtime_estimate_s = job
            .work_s
            .map(|w| w.saturating_sub(job.saved_s))
            .filter(|&d| d >= 1 && d <= self.opts.config.limits.max_duration_s);
        let p = PendingJob { id: JobId(j as u64), spec, submitted_at: job.submitted_at, nominated: false };
        let pos = self.view.pending.partition_point(|q| q.id.0 < j as u64);
        self.view.pending.insert(pos, p);
        self.dirty = true;
    }

    fn complete(&mut self, j: usize, run: u32) {
        let job = &self.jobs[j];
        if job.status != Status::Running || job.run != run {
            return; // preempted since this completion was scheduled
        }
        self.stop_allocs(j);
        let job = &mut self.jobs[j];
        job.status = Status::Done;
        job.done_at = Some(self.now);
        self.dirty = true;
    }

    /// Removes a job's allocations from the view and the metrics cluster.
    fn stop_allocs(&mut self, j: usize) {
        let id = JobId(j as u64);
        let cluster = &mut self.cluster;
        self.view.running.retain(|a| {
            if a.job == id {
                cluster.vacate(&a.node, a.cpu_milli, a.memory_mib, &a.devices, dev_req(a));
                false
            } else {
                true
            }
        });
        self.charge(j, false);
    }

    fn pass(&mut self, t: u64) -> Result<(), ReplayError> {
        self.passes += 1;
        let pass = self.passes;
        self.last_pass = Some(t);
        self.dirty = false;
        self.view.workload = self.workload();
        if let Some(cp) = self.opts.checkpoint {
            for a in &mut self.view.running {
                let job = &self.jobs[a.job.0 as usize];
                let from = job.run_start.saturating_add(job.run_restore_s);
                let k = t.saturating_sub(from) / cp.interval_s.max(1);
                let at = (k > 0).then(|| from + k * cp.interval_s);
                if a.last_checkpoint_at != at {
                    std::sync::Arc::make_mut(a).last_checkpoint_at = at;
                }
            }
        }
        let seed = pass_seed(self.opts.seed, pass);
        let plan = suanli_scheduler::schedule(&self.view, t, seed, &self.opts.config)
            .map_err(|source| ReplayError::Schedule { pass, t_s: t, source })?;
        self.apply(pass, t, plan)
    }

    fn plan_err(&self, pass: u64, t: u64, message: String) -> ReplayError {
        ReplayError::Plan { pass, t_s: t, seed: self.opts.seed, message }
    }

    fn apply(&mut self, pass: u64, t: u64, plan: Plan) -> Result<(), ReplayError> {
        // Preemptions: stop every victim job (a gang stops whole) and requeue it.
        let mut victims: BTreeMap<usize, usize> = BTreeMap::new();
        for p in &plan.preemptions {
            let j = p.job.0 as usize;
            let running = self.view.running.iter().any(|a| a.id == p.alloc && a.job == p.job);
            if !running || self.jobs.get(j).is_none_or(|x| x.status != Status::Running) {
                return Err(self.plan_err(
                    pass,
                    t,
                    format!("preempts allocation {} of job {} which is not running", p.alloc, p.job),
                ));
            }
            victims.entry(j).or_insert(p.for_job.0 as usize);
        }
        // Holds from earlier passes expire: their preemptor had its pass.
        let expired: Vec<usize> = self.held.iter().filter(|(_, (p, _))| *p < pass).map(|(&f, _)| f).collect();
        for f in expired {
            if let Some((_, held)) = self.held.remove(&f) {
                for v in held {
                    self.enqueue(v);
                }
            }
        }
        for (&j, &for_job) in &victims {
            self.preempt(j, t, for_job, pass);
        }
        // Placements, per job.
        let mut by_job: BTreeMap<u64, Vec<&suanli_model::Placement>> = BTreeMap::new();
        for p in &plan.placements {
            by_job.entry(p.job.0).or_default().push(p);
        }
        let placed_any = !by_job.is_empty();
        for (j, list) in by_job {
            let ju = j as usize;
            let Some(job) = self.jobs.get(ju) else {
                return Err(self.plan_err(pass, t, format!("places unknown job {j}")));
            };
            if job.status != Status::Pending {
                return Err(self.plan_err(pass, t, format!("places job {j} ({}) which is not pending", job.spec.name)));
            }
            let want = job.spec.groups.iter().map(|g| g.replicas).sum::<u32>() as usize;
            if list.len() != want {
                return Err(self.plan_err(
                    pass,
                    t,
                    format!(
                        "places {} of the {want} replicas of job {j} ({}); gangs start all at once",
                        list.len(),
                        job.spec.name
                    ),
                ));
            }
            let (queue, prio, gang) = (job.spec.queue.clone(), job.spec.priority, job.spec.gang);
            let restore = if job.saved_s > 0 { job.spec.checkpoint.map_or(0, |c| c.restore_s) } else { 0 };
            let remaining = job.work_s.map(|w| w.saturating_sub(job.saved_s));
            let estimate = remaining.map(|r| r.saturating_add(restore)).filter(|&d| d >= 1);
            let grace = job.spec.checkpoint.map(|c| c.grace_s);
            let preemptible = job.spec.preemptible && job.preemptions < self.opts.max_preemptions_per_job;
            let mut allocs = Vec::with_capacity(list.len());
            for p in list {
                let a = Allocation {
                    id: AllocId(self.next_alloc),
                    job: p.job,
                    group: p.group,
                    replica: p.replica,
                    epoch: u64::from(self.jobs[ju].run) + 1,
                    node: p.node.clone(),
                    queue: queue.clone(),
                    priority: prio,
                    preemptible,
                    cpu_milli: p.cpu_milli,
                    memory_mib: p.memory_mib,
                    devices: p.devices.clone(),
                    started_at: t,
                    last_checkpoint_at: None,
                    checkpoint_grace_s: grace,
                    restore_s: restore,
                    runtime_estimate_s: estimate,
                    borrowed: p.borrowed,
                    gang,
                };
                self.next_alloc += 1;
                if !self.cluster.occupy(&a.node, a.cpu_milli, a.memory_mib, &a.devices, dev_req(&a)) {
                    return Err(self.plan_err(
                        pass,
                        t,
                        format!("placing job {j} ({}) over-commits node {}", self.jobs[ju].spec.name, a.node),
                    ));
                }
                allocs.push(a);
            }
            self.view.running.extend(allocs.into_iter().map(std::sync::Arc::new));
            let pos = self.view.pending.partition_point(|p| p.id.0 < j);
            if self.view.pending.get(pos).is_some_and(|p| p.id.0 == j) {
                self.view.pending.remove(pos);
            }
            let job = &mut self.jobs[ju];
            job.status = Status::Running;
            job.run += 1;
            job.run_start = t;
            job.run_restore_s = restore;
            job.first_start.get_or_insert(t);
            job.last_reason.clear();
            if let Some(r) = remaining {
                let end = t.saturating_add(restore).saturating_add(r);
                self.heap.push(Reverse((end, Ev::Complete { job: ju as u32, run: job.run })));
            }
            self.charge(ju, true);
            // The capacity nominated for this job is taken: its victims may queue again.
            if let Some((_, held)) = self.held.remove(&ju) {
                for v in held {
                    self.enqueue(v);
                }
            }
        }
        for u in plan.unplaced {
            if let Some(job) = self.jobs.get_mut(u.job.0 as usize) {
                job.last_reason = u.reason;
            }
        }
        // Victims freed capacity for the jobs they were preempted for: another pass must follow.
        // So must one when the engine considered only part of the queue.
        if !victims.is_empty() || (placed_any && self.view.pending.len() > self.opts.config.max_jobs_per_pass) {
            self.dirty = true;
        }
        Ok(())
    }

    fn preempt(&mut self, j: usize, t: u64, for_job: usize, pass: u64) {
        self.stop_allocs(j);
        let cp = self.jobs[j].spec.checkpoint;
        let job = &mut self.jobs[j];
        let elapsed = t.saturating_sub(job.run_start);
        let useful = elapsed.saturating_sub(job.run_restore_s);
        let kept = match cp {
            Some(c) if c.interval_s > 0 => useful / c.interval_s * c.interval_s,
            _ => 0,
        };
        let new_saved = match (cp, job.work_s) {
            (None, _) => 0,
            (Some(_), Some(w)) => job.saved_s.saturating_add(kept).min(w),
            (Some(_), None) => job.saved_s.saturating_add(kept),
        };
        let lost_s = elapsed.saturating_sub(new_saved.saturating_sub(if cp.is_some() { job.saved_s } else { 0 }));
        self.lost_gpu_milli_s += u128::from(lost_s) * u128::from(job.gpu_milli);
        job.saved_s = new_saved;
        job.preemptions += 1;
        self.preemptions += 1;
        let q = job.queue;
        self.qacc[q].preemptions += 1;
        // Like a nominated node: the victim queues again only once the job it made room for
        // has started, so it cannot take its capacity back in the next pass.
        if self.jobs.get(for_job).is_some_and(|f| f.status == Status::Pending) && for_job != j {
            // The engine considers a nominated job before all others.
            if let Some(p) = self.view.pending.iter_mut().find(|p| p.id.0 == for_job as u64) {
                p.nominated = true;
            }
            self.jobs[j].status = Status::Pending;
            self.held.entry(for_job).or_insert_with(|| (pass, Vec::new())).1.push(j);
            self.dirty = true;
        } else {
            self.enqueue(j);
        }
    }

    fn sample(&mut self) {
        if self.series.len() >= MAX_SAMPLES {
            // Keep every other sample and sample half as often from now on.
            let kept: Vec<Sample> = self.series.iter().step_by(2).cloned().collect();
            self.series = kept;
            self.sample_stride = self.sample_stride.saturating_mul(2);
        }
        let samples = self.workload();
        let profile: Profile = if samples.is_empty() {
            Profile::default()
        } else {
            build_profile(
                &self.cluster,
                &samples,
                self.opts.config.typical_coverage,
                self.opts.config.policy == "suanli",
            )
        };
        let mut frag = 0.0;
        self.cluster.for_each_node(|g, v| frag += profile.fragmentation(g, &v));
        let total = self.total_gpu_milli.max(1) as f64;
        let free = self.total_gpu_milli.saturating_sub(self.alloc_gpu_milli) as f64;
        let frag_pct = frag / total * 100.0;
        self.frag_sum += frag_pct;
        self.frag_n += 1;
        let running = self.jobs.iter().filter(|j| j.status == Status::Running).count() as u64;
        self.series.push(Sample {
            t_s: self.now,
            events: self.events,
            pending_jobs: self.view.pending.len() as u64,
            running_jobs: running,
            gpu_alloc_milli: self.alloc_gpu_milli,
            gpu_util_pct: self.alloc_gpu_milli as f64 / total * 100.0,
            frag_pct,
            frag_of_free_pct: if free > 0.0 { frag / free * 100.0 } else { 0.0 },
        });
    }

    fn report(&self, start_s: u64) -> ReplayReport {
        let span = self.now.saturating_sub(start_s);
        let total = self.total_gpu_milli;
        let mut waits = Vec::new();
        let mut jcts = Vec::new();
        let (mut completed, mut running, mut never, mut requeued, mut preempted) = (0, 0, 0, 0, 0);
        let mut examples = Vec::new();
        let mut per_q: Vec<(u64, u64, u64, Vec<u64>)> = vec![(0, 0, 0, Vec::new()); self.queues.len()];
        for job in &self.jobs {
            let q = &mut per_q[job.queue];
            q.0 += 1;
            if let Some(s) = job.first_start {
                waits.push(s - job.submitted_at);
                q.3.push(s - job.submitted_at);
            }
            if job.preemptions > 0 {
                preempted += 1;
            }
            match job.status {
                Status::Done => {
                    completed += 1;
                    q.1 += 1;
                    if let Some(d) = job.done_at {
                        jcts.push(d - job.submitted_at);
                    }
                }
                Status::Running => running += 1,
                Status::Pending | Status::NotArrived if job.first_start.is_some() => requeued += 1,
                Status::Pending | Status::NotArrived => {
                    never += 1;
                    q.2 += 1;
                    if examples.len() < UNSTARTED_EXAMPLES {
                        examples.push(Unstarted {
                            name: job.spec.name.clone(),
                            queue: job.spec.queue.to_string(),
                            reason: job.last_reason.clone(),
                        });
                    }
                }
            }
        }
        let cluster_milli_s = total as f64 * span as f64;
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let a = &self.qacc[i];
                let has_quota = quota_ratio(&ResVec::ZERO, &q.nominal).is_some();
                let (jobs, completed, never_started, waits) = &per_q[i];
                let mut w = waits.clone();
                QueueReport {
                    queue: q.id.to_string(),
                    team: q.team.clone(),
                    jobs: *jobs,
                    completed: *completed,
                    never_started: *never_started,
                    gpu_hours: a.gpu_milli_s as f64 / 1000.0 / 3600.0,
                    share_pct: if cluster_milli_s > 0.0 { a.gpu_milli_s as f64 / cluster_milli_s * 100.0 } else { 0.0 },
                    quota_use_max_pct: has_quota.then_some(a.ratio_max * 100.0),
                    quota_use_mean_pct: has_quota
                        .then(|| if span > 0 { a.ratio_s / span as f64 * 100.0 } else { a.ratio_max * 100.0 }),
                    preemptions: a.preemptions,
                    wait_p50_s: Percentiles::of(&mut w).p50,
                }
            })
            .collect();
        ReplayReport {
            policy: self.opts.config.policy.clone(),
            seed: self.opts.seed,
            interval_s: self.opts.interval_s,
            nodes: self.view.nodes.len() as u64,
            gpu_milli: total,
            jobs: self.jobs.len() as u64,
            completed,
            running_at_end: running,
            never_started: never,
            requeued_at_end: requeued,
            preempted_jobs: preempted,
            preemptions: self.preemptions,
            lost_gpu_hours: self.lost_gpu_milli_s as f64 / 1000.0 / 3600.0,
            passes: self.passes,
            events: self.events,
            start_s,
            end_s: self.now,
            wait_s: Percentiles::of(&mut waits),
            jct_s: Percentiles::of(&mut jcts),
            gpu_util_mean_pct: if cluster_milli_s > 0.0 {
                self.alloc_gpu_milli_s as f64 / cluster_milli_s * 100.0
            } else {
                self.alloc_gpu_milli as f64 / total.max(1) as f64 * 100.0
            },
            gpu_util_max_pct: self.util_max * 100.0,
            frag_mean_pct: if self.frag_n > 0 { self.frag_sum / self.frag_n as f64 } else { 0.0 },
            queues,
            never_started_examples: examples,
            series: self.series.clone(),
            job_outcomes: if self.opts.record_jobs {
                self.jobs
                    .iter()
                    .map(|j| JobOutcome {
                        name: j.spec.name.clone(),
                        queue: j.spec.queue.to_string(),
                        submitted_s: j.submitted_at,
                        first_start_s: j.first_start,
                        done_s: j.done_at,
                        preemptions: j.preemptions,
                    })
                    .collect()
            } else {
                Vec::new()
            },
        }
    }
}

/// The device part of an allocation as the metrics cluster tracks it (kind from the node's
/// devices is not needed here: tags are not tracked).
fn dev_req(a: &Allocation) -> Option<DevReq> {
    let first = a.devices.first()?;
    Some(DevReq {
        kind: DeviceKind::Gpu,
        count: a.devices.len() as u32,
        milli: first.milli.min(1000) as u16,
        memory_mib: first.memory_mib,
    })
}
