//! `suanli sim replay`: the trace replayed with time, on the real scheduling engine and the
//! real replicated state machine.
//!
//! ```text
//!  pods (arrival_s, duration_s) ──▶ events: completions < arrivals < pass wake-ups, per time
//!        │                                  (all events of one time are applied together)
//!        ▼
//!  each event ──▶ the Command a server would commit, stamped with the simulated time
//!                 (SubmitJob, ApplyPlan, the agents' AllocStatus) ──▶ suanli_state::State::apply
//!        ▲                                                                   │
//!        │        a pass: State::cluster_view(now) ──▶ engine::schedule(view, now, pass seed)
//!        └──────────────── ApplyPlan{plan, now} (apply re-checks it, as on the servers) ◀──┘
//! ```
//!
//! The clock is simulated: decisions never read the wall clock. A scheduling pass runs at the
//! time of an event that changed something while jobs are pending, at most once every
//! `interval_s` simulated seconds (later changes wait for a wake-up at `last pass +
//! interval_s`). Passes that could not change anything are skipped. Each pass gets a seed
//! derived from the run's seed and the pass number, so a run replays exactly.
//!
//! The replay keeps no copy of the cluster's rules: queues, nodes, jobs, allocations, quota
//! and the re-check of every plan are `suanli-state`'s, as on a server; the engine sees the
//! view the leader's scheduling loop would take. What the replay adds is the world outside
//! the servers: when pods arrive, how long their tasks run, and the agents' reports (a task
//! starts as soon as it is placed, ends after its duration, and stops at once when asked).
//!
//! Modelling choices (also in docs/sim.md, `## replay`):
//! - A pod without a duration runs until the simulation ends (it never frees its capacity) and
//!   is reported as running at the end; it has no completion time.
//! - A preempted job's agents stop its tasks at the instant of the plan (the grace period is
//!   not simulated) and the state machine requeues it with its original submission time.
//!   Without a checkpoint policy it loses all its work; with one it keeps the work up to its
//!   last periodic checkpoint and pays `restore_s` when it starts again.
//! - What the engine learns from the view beyond the state: the workload window, checkpoint
//!   times (those the agents would have reported), exact remaining run times (perfect
//!   estimates for backfill), and that a job preempted `max_preemptions_per_job` times is not
//!   offered for preemption again (so contradicting preemption rules cannot cycle).
//!
//! A plan part the state machine refuses is handled as on a server (the job stays pending and
//! another pass follows) and counted in the report: the view was taken from the very state the
//! plan is applied to, so a refusal shows the engine planning something the servers refuse.

mod events;
mod inference;
mod metrics;
mod queues;
mod report;

pub use inference::{
    MAX_RPS, MAX_SERVICES, MAX_SERVICES_BYTES, PARTITION_LABEL, SERVICE_COLUMNS, ServiceLoad, parse_services_str,
    read_services, static_partition,
};
pub use queues::{MAX_QUEUES, MAX_QUEUES_BYTES, QUEUE_COLUMNS, default_queue, parse_queues_str, read_queues};
pub use report::{
    InferenceReport, JobOutcome, Percentiles, QueueReport, ReplayReport, Sample, ServiceReport, Unstarted,
    format_duration,
};

use crate::trace::TracePod;
use std::collections::BTreeMap;
use suanli_model::{CheckpointPolicy, Constraints, JobKind, JobSpec, Node, Queue, QueueId, TaskGroup};
use suanli_scheduler::POLICY_NAMES;
use suanli_scheduler::cluster::ClusterError;
use suanli_scheduler::engine::{ScheduleError, SchedulerConfig};
use suanli_state::CommandError;
use thiserror::Error;

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
/// Refused placements, and refused preemptions, listed with their reasons in the report.
pub const REFUSED_EXAMPLES: usize = 5;
/// Largest `max_preemptions_per_job` (the state machine fails a job requeued more often than
/// its `max_total_attempts`, at most 1,000,000).
pub const MAX_PREEMPTIONS_PER_JOB: u32 = 999_999;

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
    /// A queues or services file is larger than its limit.
    #[error("{path}: {size} bytes is larger than the limit of {limit} bytes")]
    TooLarge {
        /// File.
        path: String,
        /// Its size.
        size: u64,
        /// The limit ([`MAX_QUEUES_BYTES`], [`MAX_SERVICES_BYTES`]).
        limit: u64,
    },
    /// A bad value in a queues or services file.
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
    /// A malformed queues or services file (ragged row, bad UTF-8, unknown column, no rows).
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
    /// A committed plan left the replay inconsistent: the state machine's allocations do not
    /// fit the engine's cluster model, a placed job was not pending, or the state breaks an
    /// invariant (a bug: please report it with the seed).
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
    /// The state machine refused a command the replay built from the trace (a node, a queue
    /// or a job it does not accept under its limits).
    #[error("t={t_s}s: {command} refused by the state machine: {source}")]
    Refused {
        /// Simulated time.
        t_s: u64,
        /// What the command was for (`register node "n1"`, `submit pod #3 ("a")`, ...).
        command: String,
        /// The state machine's answer.
        source: CommandError,
    },
    /// The state machine answered a command with something other than what that command
    /// gets (a bug in the replay or the state machine).
    #[error("t={t_s}s: {command}: unexpected answer from the state machine: {answer}")]
    Unexpected {
        /// Simulated time.
        t_s: u64,
        /// What the command was for.
        command: String,
        /// The answer, as debug text.
        answer: String,
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
    /// Inference services beside the trace (docs/sim.md, "Inference services"): submitted at
    /// the start, their load reported and autoscaled every `period_s`. Needs `until_s`.
    pub services: Vec<ServiceLoad>,
    /// Services and batch on partitions of their own ([`static_partition`]) instead of sharing
    /// every node.
    pub static_partition: bool,
    /// End the replay at this simulated time (events after it are not played; work still
    /// running is reported as running at the end).
    pub until_s: Option<u64>,
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
            services: Vec::new(),
            static_partition: false,
            until_s: None,
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
        range(
            "max_preemptions_per_job",
            u64::from(self.max_preemptions_per_job),
            0,
            u64::from(MAX_PREEMPTIONS_PER_JOB),
        )?;
        if let Some(u) = self.until_s {
            range("until_s", u, 0, MAX_SIM_TIME_S)?;
        }
        if !self.services.is_empty() && self.until_s.is_none() {
            return Err(ReplayError::Param {
                field: "until_s",
                message: "a replay with services must say when it ends (services run forever)".into(),
            });
        }
        if self.static_partition && self.services.is_empty() {
            return Err(ReplayError::Param {
                field: "static_partition",
                message: "a static partition is made for services; give some".into(),
            });
        }
        if let Some(c) = &self.checkpoint {
            range("checkpoint.interval_s", c.interval_s, 1, self.config.limits.max_duration_s)?;
            range("checkpoint.grace_s", c.grace_s, 0, self.config.limits.max_duration_s)?;
            range("checkpoint.restore_s", c.restore_s, 0, self.config.limits.max_duration_s)?;
        }
        Ok(())
    }
}

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

/// The job a pod becomes, and its queue's position in `queues`.
fn pod_job(
    index: usize,
    pod: &TracePod,
    queues: &[Queue],
    opts: &ReplayOptions,
    labels: &BTreeMap<String, String>,
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
        constraints: Constraints { labels: labels.clone(), ..pod.constraints() },
        runtime_estimate_s: pod.duration_s.filter(|&d| d >= 1 && d <= max_d),
        checkpoint: opts.checkpoint,
        service: None,
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
    let label = |part: &str| -> BTreeMap<String, String> {
        if opts.static_partition {
            BTreeMap::from([(PARTITION_LABEL.to_owned(), part.to_owned())])
        } else {
            BTreeMap::new()
        }
    };
    let (nodes, partition_milli) =
        if opts.static_partition { static_partition(nodes, &opts.services)? } else { (nodes.to_vec(), 0) };
    // Job ids grow with submission order: (arrival, position in the file).
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.sort_by_key(|&i| (pods[i].arrival_s, i));
    let mut jobs = Vec::with_capacity(pods.len());
    let batch = label("batch");
    for &i in &order {
        let (spec, queue) = pod_job(i, &pods[i], queues, opts, &batch)?;
        jobs.push(events::SimJob::new(i, &pods[i], spec, queue));
    }
    let inference = label("inference");
    let mut services = Vec::with_capacity(opts.services.len());
    for (i, s) in opts.services.iter().enumerate() {
        let err =
            |message: String| ReplayError::Param { field: "services", message: format!("{:?}: {message}", s.name) };
        let Some(queue) = queues.iter().position(|q| q.id.as_str() == s.queue) else {
            return Err(err(format!("queue {:?} is not defined", s.queue)));
        };
        if queues.iter().any(|q| q.parent.as_ref().is_some_and(|p| p.as_str() == s.queue)) {
            return Err(err(format!("queue {:?} is a parent queue; services go to leaf queues", s.queue)));
        }
        let spec = s.spec(&inference);
        spec.validate(&opts.config.limits).map_err(|e| err(format!("not a valid service: {e}")))?;
        services.push(events::SimService::new(i, spec, queue));
    }
    events::Sim::new(&nodes, pods, queues, opts, jobs, services, partition_milli)?.run(progress)
}
