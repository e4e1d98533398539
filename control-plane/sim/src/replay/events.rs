//! The event loop of a replay: simulated time, the events of the trace, and the commands they
//! become on the real state machine.
//!
//! ```text
//!  start          UpsertQueue (parents first), RegisterNode per node
//!  Arrive(job)    SubmitJob                                  (the API server's command)
//!  pass           State::cluster_view ─▶ schedule ─▶ ApplyPlan (the leader's scheduling loop)
//!   ├ placed      AllocStatus Running per allocation          (its agent: the task starts)
//!   └ preempted   AllocStatus Stopped per allocation of the job (its agents stop it at once)
//!  Complete(job)  AllocStatus Succeeded per allocation        (its agents: the task exited 0)
//!  services:      SubmitJob at the start; a placed replica runs, and is ready startup_s later
//!   Ready         AllocReady ready                            (its agent's readiness probe)
//!   Tick          AllocReady load per ready replica, then     (the replicas' load reports)
//!                 State::autoscale_input ─▶ decide ─▶ UpdateService (the leader's autoscaler);
//!                 AllocStatus Stopped per replica it stops    (its agents stop it at once)
//! ```
//!
//! Every command is stamped with the simulated time, as the leader stamps what it proposes
//! (`Command::stamp`), and applied with `State::apply`. The replay keeps, beside the state,
//! only what the servers cannot know: each pod's work, the work its checkpoints saved, and
//! the measurements of [`super::metrics`].

use super::metrics::{Metrics, quota_ratio};
use super::report::{InferenceReport, JobOutcome, Percentiles, QueueReport, ReplayReport, ServiceReport, Unstarted};
use super::{Progress, REFUSED_EXAMPLES, ReplayError, ReplayOptions, UNSTARTED_EXAMPLES, pass_seed};
use crate::trace::TracePod;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::Arc;
use suanli_model::{AllocId, Allocation, JobId, JobSpec, Node, Queue, QueueId, ResVec};
use suanli_scheduler::cluster::Cluster;
use suanli_scheduler::engine::ClusterView;
use suanli_scheduler::policy::TieBreak;
use suanli_state::{
    AllocReady, AllocStatus, ApplyPlan, AutoscaleHistory, Command, Desired, JobState, PlanOutcome, RegisterNode,
    ReportedStatus, Response, State, StateConfig, SubmitJob, UpdateService, UpsertQueue,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A job's run ends (ignored when `run` is stale: the job was preempted meanwhile).
    Complete { job: u32, run: u32 },
    /// A job is submitted.
    Arrive { job: u32 },
    /// A service replica becomes ready (ignored when it stopped meanwhile).
    Ready { svc: u32, alloc: AllocId },
    /// A service's replicas report their load and the autoscaler decides.
    Tick { svc: u32 },
    /// A wake-up for a pass delayed by the interval.
    Wake,
}

/// Where a job is, as the replay mirrors the state machine (checked against it in debug
/// builds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    NotArrived,
    Pending,
    Running,
    Done,
}

/// One pod of the trace: the job it becomes and what the world outside the servers knows of
/// it (its work, and the work its checkpoints saved).
#[derive(Debug, Clone)]
pub(super) struct SimJob {
    pod: usize,
    spec: JobSpec,
    queue: usize,
    /// The state machine's id, once submitted.
    id: Option<JobId>,
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
    /// The allocations of the current run, as the state machine committed them.
    allocs: Vec<Arc<Allocation>>,
}

impl SimJob {
    pub(super) fn new(pod: usize, p: &TracePod, spec: JobSpec, queue: usize) -> Self {
        let usage = spec.total();
        Self {
            pod,
            submitted_at: p.arrival_s,
            work_s: p.duration_s,
            gpu_milli: usage.gpu_milli,
            usage,
            spec,
            queue,
            id: None,
            saved_s: 0,
            status: Status::NotArrived,
            run: 0,
            run_start: 0,
            run_restore_s: 0,
            first_start: None,
            done_at: None,
            preemptions: 0,
            allocs: Vec::new(),
        }
    }
}

/// One inference service: its job and what its replicas and load did.
#[derive(Debug, Clone)]
pub(super) struct SimService {
    /// Position in `ReplayOptions::services`.
    load: usize,
    spec: JobSpec,
    queue: usize,
    id: Option<JobId>,
    usage: ResVec,
    gpu_milli: u64,
    /// Replicas running now (placed and not stopped), and those of them that are ready.
    live: BTreeMap<AllocId, Arc<Allocation>>,
    ready: BTreeSet<AllocId>,
    /// The leader's autoscaler memory for this service.
    history: AutoscaleHistory,
    last_tick: u64,
    observed_s: u64,
    violation_s: u64,
    ready_s: u128,
    demand_milli_s: u128,
    unserved_milli_s: u128,
    /// Fewest and most ready replicas at a load report since the first one was ready.
    ready_min: Option<u32>,
    ready_max: u32,
    ever_ready: bool,
    scale_ups: u64,
    scale_downs: u64,
    scale_outs: Vec<u64>,
    gpu_milli_s: u128,
}

impl SimService {
    pub(super) fn new(load: usize, spec: JobSpec, queue: usize) -> Self {
        let usage = spec.groups.first().map_or(ResVec::ZERO, |g| g.resources.as_resvec());
        Self {
            load,
            gpu_milli: usage.gpu_milli,
            usage,
            spec,
            queue,
            id: None,
            live: BTreeMap::new(),
            ready: BTreeSet::new(),
            history: AutoscaleHistory::default(),
            last_tick: 0,
            observed_s: 0,
            violation_s: 0,
            ready_s: 0,
            demand_milli_s: 0,
            unserved_milli_s: 0,
            ready_min: None,
            ready_max: 0,
            ever_ready: false,
            scale_ups: 0,
            scale_downs: 0,
            scale_outs: Vec::new(),
            gpu_milli_s: 0,
        }
    }
}

/// A replay in progress.
pub(super) struct Sim<'a> {
    opts: &'a ReplayOptions,
    pods: &'a [TracePod],
    queues: &'a [Queue],
    jobs: Vec<SimJob>,
    /// State machine job id -> index in `jobs`.
    by_id: BTreeMap<JobId, usize>,
    /// The replicated state, as every server would hold it.
    state: State,
    heap: BinaryHeap<Reverse<(u64, Ev)>>,
    start_s: u64,
    now: u64,
    events: u64,
    passes: u64,
    wake_at: Option<u64>,
    last_pass: Option<u64>,
    dirty: bool,
    arrived: u64,
    /// Jobs pending now.
    pending: usize,
    m: Metrics,
    /// Inference services, and their state machine ids.
    svcs: Vec<SimService>,
    svc_by_id: BTreeMap<JobId, usize>,
    /// GPU milli of a static inference partition (0: shared).
    partition_milli: u64,
}

/// The state machine's limits for a replay: the defaults, raised where the trace needs more
/// (every pod may be live at once), with the engine's validation limits.
fn state_config(
    nodes: &[Node],
    queues: &[Queue],
    jobs: &[SimJob],
    opts: &ReplayOptions,
) -> Result<StateConfig, ReplayError> {
    let replicas: usize = jobs.iter().map(|j| j.spec.groups.iter().map(|g| g.replicas as usize).sum::<usize>()).sum();
    // A service runs at most max_replicas, plus one surge replica while it is replaced.
    let replicas = replicas + opts.services.iter().map(|s| s.max_replicas as usize + 1).sum::<usize>();
    let d = StateConfig::default();
    let cfg = StateConfig {
        limits: opts.config.limits.clone(),
        max_live_jobs: d.max_live_jobs.max(jobs.len() + opts.services.len()),
        max_nodes: d.max_nodes.max(nodes.len()),
        max_queues: d.max_queues.max(queues.len()),
        max_live_allocs: d.max_live_allocs.max(replicas),
        max_plan_entries: d.max_plan_entries.max(replicas),
        // A preempted job is requeued: it must not run out of attempts before it is exempt.
        max_total_attempts: d.max_total_attempts.max(opts.max_preemptions_per_job.saturating_add(1)),
        ..d
    };
    cfg.validate().map_err(|e| ReplayError::Param { field: "state", message: e.to_string() })?;
    Ok(cfg)
}

impl<'a> Sim<'a> {
    /// A replay of `jobs` (in submission order) whose state machine knows the queues and nodes.
    pub(super) fn new(
        nodes: &[Node],
        pods: &'a [TracePod],
        queues: &'a [Queue],
        opts: &'a ReplayOptions,
        jobs: Vec<SimJob>,
        svcs: Vec<SimService>,
        partition_milli: u64,
    ) -> Result<Self, ReplayError> {
        let cluster = Cluster::new(nodes, &opts.config.limits, false, TieBreak::FixedOrder)?;
        let state = State::new(state_config(nodes, queues, &jobs, opts)?);
        let mut heap = BinaryHeap::with_capacity(jobs.len() * 2);
        for (j, job) in jobs.iter().enumerate() {
            heap.push(Reverse((job.submitted_at, Ev::Arrive { job: j as u32 })));
        }
        let start_s = jobs.first().map_or(0, |j| j.submitted_at);
        let mut sim = Sim {
            opts,
            pods,
            queues,
            by_id: BTreeMap::new(),
            state,
            heap,
            start_s,
            now: start_s,
            events: 0,
            passes: 0,
            wake_at: None,
            last_pass: None,
            dirty: false,
            arrived: 0,
            pending: 0,
            m: Metrics::new(cluster, queues, opts),
            jobs,
            svcs,
            svc_by_id: BTreeMap::new(),
            partition_milli,
        };
        sim.define_queues()?;
        for n in nodes {
            let cmd = Command::RegisterNode(Box::new(RegisterNode { node: n.clone(), now: 0, fence: None }));
            sim.apply(cmd, || format!("register node {:?}", n.id.as_str()))?;
        }
        sim.submit_services()?;
        Ok(sim)
    }

    /// Submits every service at the start; each one's first load report follows one period
    /// later.
    fn submit_services(&mut self) -> Result<(), ReplayError> {
        for i in 0..self.svcs.len() {
            let name = self.svcs[i].spec.name.clone();
            let what = format!("submit service {name:?}");
            let cmd = Command::SubmitJob(Box::new(SubmitJob {
                client_request_id: format!("service-{i}"),
                spec: self.svcs[i].spec.clone(),
                retry: None,
                now: 0,
                trace: None,
            }));
            let id = match self.apply(cmd, || what.clone())? {
                Response::JobSubmitted { job, created: true } => job,
                other => return Err(self.unexpected(what, &other)),
            };
            self.svc_by_id.insert(id, i);
            let period = self.opts.services[self.svcs[i].load].period_s;
            let s = &mut self.svcs[i];
            s.id = Some(id);
            s.last_tick = self.now;
            self.heap.push(Reverse((self.now.saturating_add(period), Ev::Tick { svc: i as u32 })));
            self.dirty = true;
        }
        Ok(())
    }

    /// Stamps `cmd` with the simulated time (as the leader stamps what it proposes) and
    /// applies it; a refusal is an error naming `what`.
    fn apply(&mut self, mut cmd: Command, what: impl FnOnce() -> String) -> Result<Response, ReplayError> {
        cmd.stamp(self.now);
        match self.state.apply(cmd) {
            Response::Rejected(source) => Err(ReplayError::Refused { t_s: self.now, command: what(), source }),
            r => Ok(r),
        }
    }

    fn unexpected(&self, command: String, answer: &Response) -> ReplayError {
        ReplayError::Unexpected { t_s: self.now, command, answer: format!("{answer:?}") }
    }

    /// Upserts every queue, each after its parent (the state machine refuses a child first).
    fn define_queues(&mut self) -> Result<(), ReplayError> {
        let mut defined: BTreeSet<&QueueId> = BTreeSet::new();
        while defined.len() < self.queues.len() {
            let before = defined.len();
            for q in self.queues {
                if defined.contains(&q.id) || q.parent.as_ref().is_some_and(|p| !defined.contains(p)) {
                    continue;
                }
                let cmd = Command::UpsertQueue(UpsertQueue { queue: q.clone() });
                self.apply(cmd, || format!("upsert queue {:?}", q.id.as_str()))?;
                defined.insert(&q.id);
            }
            if defined.len() == before {
                return Err(ReplayError::Param {
                    field: "queues",
                    message: "a parent queue is missing or the hierarchy has a cycle".into(),
                });
            }
        }
        Ok(())
    }

    pub(super) fn run(mut self, progress: &mut dyn FnMut(&Progress)) -> Result<ReplayReport, ReplayError> {
        let mut next_sample = self.m.sample_stride;
        let mut next_progress = 0u64;
        while let Some(&Reverse((t, _))) = self.heap.peek() {
            if self.opts.until_s.is_some_and(|u| t > u) {
                break;
            }
            self.advance(t);
            while let Some(&Reverse((te, ev))) = self.heap.peek() {
                if te != t {
                    break;
                }
                self.heap.pop();
                self.count_event()?;
                match ev {
                    Ev::Complete { job, run } => self.complete(job as usize, run)?,
                    Ev::Arrive { job } => self.arrive(job as usize)?,
                    Ev::Ready { svc, alloc } => self.replica_ready(svc as usize, alloc)?,
                    Ev::Tick { svc } => self.tick(svc as usize)?,
                    Ev::Wake => self.wake_at = None,
                }
            }
            if self.dirty && self.wants_pass() {
                let allowed = self.last_pass.map_or(t, |l| l.saturating_add(self.opts.interval_s));
                if t >= allowed {
                    self.count_event()?;
                    self.pass(t)?;
                }
            }
            // Changes the last pass could not see yet (or made itself: preemptions) wait for a
            // wake-up one interval after it.
            if self.dirty && self.wake_at.is_none() && self.wants_pass() {
                let at = self.last_pass.map_or(t, |l| l.saturating_add(self.opts.interval_s)).max(t);
                self.wake_at = Some(at);
                self.heap.push(Reverse((at, Ev::Wake)));
            }
            if self.events >= next_sample {
                self.sample();
                next_sample = self.events.saturating_add(self.m.sample_stride);
            }
            if self.events >= next_progress {
                progress(&self.progress());
                next_progress = self.events + 4096;
            }
        }
        if let Some(u) = self.opts.until_s
            && u > self.now
        {
            self.advance(u);
        }
        self.sample();
        progress(&self.progress());
        #[cfg(debug_assertions)]
        if let Err(v) = self.state.invariants() {
            return Err(self.plan_err(self.passes, self.now, format!("the state breaks an invariant: {v}")));
        }
        Ok(self.report())
    }

    fn progress(&self) -> Progress {
        Progress {
            events: self.events,
            now_s: self.now,
            arrived: self.arrived,
            jobs: self.jobs.len() as u64,
            pending: self.pending as u64,
        }
    }

    fn count_event(&mut self) -> Result<(), ReplayError> {
        if self.events >= self.opts.max_events {
            return Err(ReplayError::TooManyEvents {
                limit: self.opts.max_events,
                t_s: self.now,
                pending: self.pending,
            });
        }
        self.events += 1;
        Ok(())
    }

    /// Moves the clock to `t`, integrating usage over the elapsed time.
    fn advance(&mut self, t: u64) {
        let dt = t.saturating_sub(self.now);
        self.m.advance(dt, self.queues);
        for s in &mut self.svcs {
            s.gpu_milli_s += u128::from(s.gpu_milli) * s.live.len() as u128 * u128::from(dt);
        }
        self.now = self.now.max(t);
    }

    /// A pass could place something: a job is pending, or a service misses replicas.
    fn wants_pass(&self) -> bool {
        self.pending > 0
            || self.svcs.iter().any(|s| {
                s.id.and_then(|id| self.state.job(id)).is_some_and(|j| self.state.missing_replicas(j).is_some())
            })
    }

    fn sample(&mut self) {
        let running = self.jobs.iter().filter(|j| j.status == Status::Running).count() as u64;
        self.m.sample(self.now, self.events, self.pending as u64, running);
    }

    fn charge(&mut self, j: usize, add: bool) {
        let job = &self.jobs[j];
        let (q, usage, gpu) = (job.queue, job.usage, job.gpu_milli);
        self.m.charge(q, usage, gpu, add, self.queues);
    }

    /// Debug builds check that the replay's mirror of a job agrees with the state machine.
    fn debug_check(&self, j: usize) {
        if cfg!(debug_assertions) {
            let job = &self.jobs[j];
            let state = job.id.and_then(|id| self.state.job(id)).map(|x| x.state);
            let agrees = match job.status {
                Status::NotArrived => state.is_none(),
                Status::Pending => state == Some(JobState::Pending),
                Status::Running => state == Some(JobState::Running),
                // A finished job may already be forgotten.
                Status::Done => state.is_none_or(|s| s == JobState::Succeeded),
            };
            debug_assert!(agrees, "job {} ({}): replay says {:?}, state says {state:?}", j, job.spec.name, job.status);
        }
    }

    fn arrive(&mut self, j: usize) -> Result<(), ReplayError> {
        self.arrived += 1;
        self.m.arrive(&self.pods[self.jobs[j].pod]);
        let job = &self.jobs[j];
        let what = || format!("submit pod #{} ({:?})", job.pod, job.spec.name);
        let cmd = Command::SubmitJob(Box::new(SubmitJob {
            client_request_id: format!("pod-{}", job.pod),
            spec: job.spec.clone(),
            retry: None,
            now: 0,
            trace: None,
        }));
        let what = what();
        let id = match self.apply(cmd, || what.clone())? {
            Response::JobSubmitted { job, created: true } => job,
            other => return Err(self.unexpected(what, &other)),
        };
        self.by_id.insert(id, j);
        let job = &mut self.jobs[j];
        job.id = Some(id);
        job.status = Status::Pending;
        self.pending += 1;
        self.dirty = true;
        self.debug_check(j);
        Ok(())
    }

    /// The agents report `status` for every allocation of job `j`'s current run, which ends
    /// it; returns those allocations (their resources are free again).
    fn end_run(&mut self, j: usize, status: ReportedStatus, message: &str) -> Result<(), ReplayError> {
        let allocs = std::mem::take(&mut self.jobs[j].allocs);
        for a in &allocs {
            let cmd = Command::AllocStatus(AllocStatus {
                alloc: a.id,
                epoch: a.epoch,
                status,
                message: message.to_owned(),
                end: None,
                exit_code: None,
                now: 0,
            });
            self.apply(cmd, || format!("allocation {} of job {} {status:?}", a.id, a.job))?;
            self.m.vacate(a);
        }
        self.charge(j, false);
        Ok(())
    }

    fn complete(&mut self, j: usize, run: u32) -> Result<(), ReplayError> {
        let job = &self.jobs[j];
        if job.status != Status::Running || job.run != run {
            return Ok(()); // preempted since this completion was scheduled
        }
        self.end_run(j, ReportedStatus::Succeeded, "exit 0")?;
        let job = &mut self.jobs[j];
        job.status = Status::Done;
        job.done_at = Some(self.now);
        self.dirty = true;
        self.debug_check(j);
        Ok(())
    }

    fn plan_err(&self, pass: u64, t: u64, message: String) -> ReplayError {
        ReplayError::Plan { pass, t_s: t, seed: self.opts.seed, message }
    }

    /// What the engine learns beyond the state machine's view (see the module docs of
    /// `replay`): checkpoint times the agents would have reported, exact remaining run
    /// times, and which jobs were preempted too often to be offered again.
    fn adjust_view(&self, view: &mut ClusterView, t: u64) {
        let max_d = self.opts.config.limits.max_duration_s;
        for a in &mut view.running {
            let Some(job) = self.by_id.get(&a.job).map(|&j| &self.jobs[j]) else {
                continue;
            };
            let remaining = job.work_s.map(|w| w.saturating_sub(job.saved_s));
            let estimate = remaining.map(|r| r.saturating_add(job.run_restore_s)).filter(|&d| d >= 1);
            let checkpoint = self.opts.checkpoint.and_then(|cp| {
                let from = job.run_start.saturating_add(job.run_restore_s);
                let k = t.saturating_sub(from) / cp.interval_s.max(1);
                (k > 0).then(|| from + k * cp.interval_s)
            });
            let preemptible = a.preemptible && job.preemptions < self.opts.max_preemptions_per_job;
            if a.runtime_estimate_s != estimate || a.last_checkpoint_at != checkpoint || a.preemptible != preemptible {
                let x = Arc::make_mut(a);
                x.runtime_estimate_s = estimate;
                x.last_checkpoint_at = checkpoint;
                x.preemptible = preemptible;
            }
        }
        for p in &mut view.pending {
            if let Some(job) = self.by_id.get(&p.id).map(|&j| &self.jobs[j]) {
                p.spec.runtime_estimate_s =
                    job.work_s.map(|w| w.saturating_sub(job.saved_s)).filter(|&d| d >= 1 && d <= max_d);
            }
        }
    }

    fn pass(&mut self, t: u64) -> Result<(), ReplayError> {
        self.passes += 1;
        let pass = self.passes;
        self.last_pass = Some(t);
        self.dirty = false;
        // The leader's scheduling loop: a view of the committed state, the engine, a plan.
        let mut view = self.state.cluster_view(t);
        view.workload = self.m.workload();
        self.adjust_view(&mut view, t);
        let seed = pass_seed(self.opts.seed, pass);
        let plan = suanli_scheduler::schedule(&view, t, seed, &self.opts.config)
            .map_err(|source| ReplayError::Schedule { pass, t_s: t, source })?;
        drop(view);
        let placed_any = !plan.placements.is_empty();
        let gangs = self.gang_pairs(&plan.placements);
        let what = format!("plan of pass {pass}");
        let out = match self.apply(Command::ApplyPlan(ApplyPlan { plan, now: t }), || what.clone())? {
            Response::PlanApplied(out) => out,
            other => return Err(self.unexpected(what, &other)),
        };
        for (job, pairs, crossing) in gangs {
            if !out.refused_jobs.iter().any(|(j, _)| *j == job) {
                self.m.gang_pairs += pairs;
                self.m.gang_pairs_crossing += crossing;
            }
        }
        self.applied(pass, t, out)?;
        // Victims freed capacity for the jobs they were preempted for: another pass must follow.
        // So must one when the engine considered only part of the queue.
        if placed_any && self.pending > self.opts.config.max_jobs_per_pass {
            self.dirty = true;
        }
        Ok(())
    }

    /// Per job placed with several replicas at once (a gang, or an elastic job's minimum): its
    /// replica pairs, and those whose nodes are in different network blocks (a node without a
    /// block label counts as a block of its own).
    fn gang_pairs(&self, placements: &[suanli_model::Placement]) -> Vec<(suanli_model::JobId, u64, u64)> {
        let block = |n: &suanli_model::NodeId| -> String {
            self.state
                .nodes()
                .get(n)
                .and_then(|r| r.node.labels.get(suanli_scheduler::cluster::BLOCK_LABEL).cloned())
                .unwrap_or_else(|| format!("node:{n}"))
        };
        let mut by_job: BTreeMap<suanli_model::JobId, Vec<String>> = BTreeMap::new();
        for p in placements.iter().filter(|p| !self.svc_by_id.contains_key(&p.job)) {
            by_job.entry(p.job).or_default().push(block(&p.node));
        }
        by_job
            .into_iter()
            .filter(|(_, b)| b.len() > 1)
            .map(|(job, blocks)| {
                let n = blocks.len() as u64;
                let mut same = 0u64;
                let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
                for b in &blocks {
                    *counts.entry(b).or_default() += 1;
                }
                for c in counts.values() {
                    same += c * (c - 1) / 2;
                }
                let pairs = n * (n - 1) / 2;
                (job, pairs, pairs - same)
            })
            .collect()
    }

    /// Plays what follows a committed plan: the agents of preempted jobs stop them, and the
    /// agents of placed jobs start them. Refused parts are counted; as on the servers, a job
    /// whose placement was refused stays pending and another pass follows.
    fn applied(&mut self, pass: u64, t: u64, out: PlanOutcome) -> Result<(), ReplayError> {
        let job_of = |sim: &Self, id: &AllocId| -> Result<(usize, Arc<Allocation>), ReplayError> {
            let a = sim.state.allocs().get(id).map(|a| a.alloc.clone());
            match a.and_then(|a| sim.by_id.get(&a.job).map(|&j| (j, a))) {
                Some(x) => Ok(x),
                None => Err(sim.plan_err(pass, t, format!("allocation {id} is not in the state after the plan"))),
            }
        };
        let mut victims: BTreeSet<usize> = BTreeSet::new();
        let mut svc_stopped: Vec<(usize, AllocId)> = Vec::new();
        for id in &out.preempted {
            if let Some((k, _)) = self.svc_alloc(id) {
                svc_stopped.push((k, *id));
                continue;
            }
            victims.insert(job_of(self, id)?.0);
        }
        // A preemption of a gang's other replicas is refused as "already stopping" once the
        // first one stopped the whole gang: not a refusal that changes anything.
        let refused_preemptions: Vec<&(AllocId, suanli_state::RefusalReason)> = out
            .refused_preemptions
            .iter()
            .filter(|(a, _)| job_of(self, a).map_or(true, |(j, _)| !victims.contains(&j)))
            .collect();
        self.m.refused_placements += out.refused_jobs.len() as u64;
        self.m.refused_preemptions += refused_preemptions.len() as u64;
        // The first few of each kind, with the state machine's reasons.
        let room = REFUSED_EXAMPLES.saturating_sub(self.m.refused_placement_examples.len());
        let jobs = out.refused_jobs.iter().map(|(job, why)| format!("t={t}s: placement of job {job}: {why}"));
        self.m.refused_placement_examples.extend(jobs.take(room));
        let room = REFUSED_EXAMPLES.saturating_sub(self.m.refused_preemption_examples.len());
        let pre = refused_preemptions.iter().map(|(a, why)| format!("t={t}s: preemption of allocation {a}: {why}"));
        self.m.refused_preemption_examples.extend(pre.take(room));
        // As the leader kicks its loop: a job refused for now is tried again in another pass.
        if !out.refused_jobs.is_empty() {
            self.dirty = true;
        }
        let mut placed: BTreeMap<usize, Vec<Arc<Allocation>>> = BTreeMap::new();
        let mut svc_placed: Vec<(usize, Arc<Allocation>)> = Vec::new();
        for id in &out.placed {
            if let Some(x) = self.svc_alloc(id) {
                svc_placed.push(x);
                continue;
            }
            let (j, a) = job_of(self, id)?;
            placed.entry(j).or_default().push(a);
        }
        for &j in &victims {
            self.preempt(j, t)?;
        }
        for (k, id) in svc_stopped {
            self.stop_replica(k, id, "stopped for preemption")?;
        }
        for (k, a) in svc_placed {
            self.replica_started(pass, k, a, t)?;
        }

        for (j, allocs) in placed {
            self.start(pass, j, t, allocs)?;
        }
        if !victims.is_empty() {
            self.dirty = true;
        }
        Ok(())
    }

    /// Job `j` was preempted: its agents stop it now and the state machine requeues it.
    fn preempt(&mut self, j: usize, t: u64) -> Result<(), ReplayError> {
        if self.jobs[j].status != Status::Running {
            return Err(self.plan_err(self.passes, t, format!("job {j} was preempted but it does not run")));
        }
        self.end_run(j, ReportedStatus::Stopped, "stopped for preemption")?;
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
        self.m.lost_gpu_milli_s += u128::from(lost_s) * u128::from(job.gpu_milli);
        job.saved_s = new_saved;
        job.preemptions += 1;
        job.status = Status::Pending;
        self.m.preemptions += 1;
        self.m.qacc[job.queue].preemptions += 1;
        self.pending += 1;
        self.debug_check(j);
        Ok(())
    }

    /// Job `j` was placed on `allocs`: its agents start it now.
    fn start(&mut self, pass: u64, j: usize, t: u64, allocs: Vec<Arc<Allocation>>) -> Result<(), ReplayError> {
        if self.jobs[j].status != Status::Pending {
            return Err(self.plan_err(pass, t, format!("job {j} was placed but it is not pending")));
        }
        for a in &allocs {
            if !self.m.occupy(a) {
                let msg = format!("placing job {} ({}) over-commits node {}", a.job, self.jobs[j].spec.name, a.node);
                return Err(self.plan_err(pass, t, msg));
            }
            let cmd = Command::AllocStatus(AllocStatus {
                alloc: a.id,
                epoch: a.epoch,
                status: ReportedStatus::Running,
                message: String::new(),
                end: None,
                exit_code: None,
                now: 0,
            });
            self.apply(cmd, || format!("allocation {} of job {} running", a.id, a.job))?;
        }
        let job = &mut self.jobs[j];
        let restore = if job.saved_s > 0 { job.spec.checkpoint.map_or(0, |c| c.restore_s) } else { 0 };
        let remaining = job.work_s.map(|w| w.saturating_sub(job.saved_s));
        job.allocs = allocs;
        job.status = Status::Running;
        job.run += 1;
        job.run_start = t;
        job.run_restore_s = restore;
        job.first_start.get_or_insert(t);
        if let Some(r) = remaining {
            let end = t.saturating_add(restore).saturating_add(r);
            self.heap.push(Reverse((end, Ev::Complete { job: j as u32, run: job.run })));
        }
        self.pending -= 1;
        self.charge(j, true);
        self.debug_check(j);
        Ok(())
    }

    /// The service and allocation of a service replica's allocation id.
    fn svc_alloc(&self, id: &AllocId) -> Option<(usize, Arc<Allocation>)> {
        let a = self.state.allocs().get(id)?;
        self.svc_by_id.get(&a.alloc.job).map(|&k| (k, a.alloc.clone()))
    }

    /// The endpoint a replica's agent reports (any host:port will do: nothing dials it).
    fn endpoint(a: &Allocation) -> String {
        format!("{}:8000", a.node)
    }

    /// A service replica was placed: its agent starts it, and it is ready `startup_s` later.
    fn replica_started(&mut self, pass: u64, k: usize, a: Arc<Allocation>, t: u64) -> Result<(), ReplayError> {
        if !self.m.occupy(&a) {
            let msg = format!("placing a replica of service {} over-commits node {}", self.svcs[k].spec.name, a.node);
            return Err(self.plan_err(pass, t, msg));
        }
        let cmd = Command::AllocStatus(AllocStatus {
            alloc: a.id,
            epoch: a.epoch,
            status: ReportedStatus::Running,
            message: String::new(),
            end: None,
            exit_code: None,
            now: 0,
        });
        self.apply(cmd, || format!("replica {} of service {} running", a.id, a.job))?;
        let s = &mut self.svcs[k];
        s.live.insert(a.id, a.clone());
        let (q, usage, gpu) = (s.queue, s.usage, s.gpu_milli);
        let startup = self.opts.services[s.load].startup_s;
        self.m.charge(q, usage, gpu, true, self.queues);
        self.heap.push(Reverse((t.saturating_add(startup), Ev::Ready { svc: k as u32, alloc: a.id })));
        Ok(())
    }

    /// A service replica passed its readiness probe; the state machine may count a scale-out
    /// as served.
    fn replica_ready(&mut self, k: usize, alloc: AllocId) -> Result<(), ReplayError> {
        let Some(a) = self.svcs[k].live.get(&alloc).cloned() else {
            return Ok(()); // stopped before it was ready
        };
        let id = a.job;
        let before = self.state.job(id).and_then(|j| j.scale_out);
        let cmd = Command::AllocReady(AllocReady {
            alloc,
            epoch: a.epoch,
            ready: true,
            endpoint: Self::endpoint(&a),
            load_milli: None,
            latency_us: None,
            success_ppm: None,
            now: 0,
        });
        self.apply(cmd, || format!("replica {alloc} of service {id} ready"))?;
        self.svcs[k].ready.insert(alloc);
        self.svcs[k].ever_ready = true;
        let after = self.state.job(id).map(|j| (j.scale_out, j.scale_outs.last().copied()));
        if before.is_some()
            && let Some((None, Some(took))) = after
        {
            self.svcs[k].scale_outs.push(took);
        }
        self.stop_unwanted(k)
    }

    /// A service's load reports and its autoscaler's decision, every `period_s`: measures the
    /// period that ended, each ready replica reports `demand / ready`, and a scale the
    /// autoscaler decides is committed as the leader's autoscaler would (`UpdateService`).
    fn tick(&mut self, k: usize) -> Result<(), ReplayError> {
        let t = self.now;
        let load = &self.opts.services[self.svcs[k].load];
        let (period, capacity) = (load.period_s, load.capacity_rps);
        let demand = load.demand_milli(t);
        let s = &mut self.svcs[k];
        let dt = t.saturating_sub(s.last_tick);
        s.last_tick = t;
        let ready = s.ready.len() as u64;
        let cap = ready.saturating_mul(capacity).saturating_mul(1000);
        s.observed_s += dt;
        s.ready_s += u128::from(ready) * u128::from(dt);
        s.demand_milli_s += u128::from(demand) * u128::from(dt);
        if demand > cap {
            s.violation_s += dt;
            s.unserved_milli_s += u128::from(demand - cap) * u128::from(dt);
        }
        if s.ever_ready {
            let r = ready as u32;
            s.ready_min = Some(s.ready_min.map_or(r, |m| m.min(r)));
            s.ready_max = s.ready_max.max(r);
        }
        if let Some(each) = demand.checked_div(ready) {
            let reports: Vec<Arc<Allocation>> = s.ready.iter().filter_map(|id| s.live.get(id).cloned()).collect();
            for a in reports {
                let cmd = Command::AllocReady(AllocReady {
                    alloc: a.id,
                    epoch: a.epoch,
                    ready: true,
                    endpoint: Self::endpoint(&a),
                    load_milli: Some(each),
                    latency_us: None,
                    success_ppm: None,
                    now: 0,
                });
                self.apply(cmd, || format!("load report of replica {} of service {}", a.id, a.job))?;
            }
        }
        if let Some(x) = self.svcs[k].id.and_then(|id| self.state.autoscale_input(id, t))
            && let Some(wanted) = self.svcs[k].history.decide(&x.autoscale, x.current, &x.loads, t)
            && wanted != x.current
        {
            let cmd =
                Command::UpdateService(Box::new(UpdateService { job: x.job, spec: x.scaled_spec(wanted), now: 0 }));
            self.apply(cmd, || format!("autoscale service {} to {wanted} replicas", x.job))?;
            let s = &mut self.svcs[k];
            if wanted > x.current {
                s.scale_ups += 1;
            } else {
                s.scale_downs += 1;
            }
            self.dirty = true;
            self.stop_unwanted(k)?;
        }
        self.heap.push(Reverse((t.saturating_add(period), Ev::Tick { svc: k as u32 })));
        Ok(())
    }

    /// The agents stop the replicas the state machine no longer wants (a scale-down).
    fn stop_unwanted(&mut self, k: usize) -> Result<(), ReplayError> {
        let unwanted: Vec<AllocId> = self.svcs[k]
            .live
            .keys()
            .filter(|id| self.state.allocs().get(id).is_some_and(|a| a.desired != Desired::Run))
            .copied()
            .collect();
        for id in unwanted {
            self.stop_replica(k, id, "stopped: scaled down")?;
        }
        Ok(())
    }

    /// A service replica's agent reports it stopped; its resources are free again.
    fn stop_replica(&mut self, k: usize, id: AllocId, message: &str) -> Result<(), ReplayError> {
        let Some(a) = self.svcs[k].live.remove(&id) else {
            return Ok(());
        };
        self.svcs[k].ready.remove(&id);
        let cmd = Command::AllocStatus(AllocStatus {
            alloc: a.id,
            epoch: a.epoch,
            status: ReportedStatus::Stopped,
            message: message.to_owned(),
            end: None,
            exit_code: None,
            now: 0,
        });
        self.apply(cmd, || format!("replica {} of service {} stopped", a.id, a.job))?;
        self.m.vacate(&a);
        let s = &self.svcs[k];
        let (q, usage, gpu) = (s.queue, s.usage, s.gpu_milli);
        self.m.charge(q, usage, gpu, false, self.queues);
        self.dirty = true;
        Ok(())
    }

    /// The services' results, and the batch work beside them.
    fn inference_report(&self, completed: u64, cluster_milli_s: f64) -> Option<InferenceReport> {
        if self.svcs.is_empty() {
            return None;
        }
        let pct = |a: u128, b: u128| if b > 0 { a as f64 / b as f64 * 100.0 } else { 0.0 };
        let mut all_outs = Vec::new();
        let (mut viol, mut obs, mut unserved, mut demand, mut svc_milli_s) = (0u64, 0u64, 0u128, 0u128, 0u128);
        let services = self
            .svcs
            .iter()
            .map(|s| {
                all_outs.extend_from_slice(&s.scale_outs);
                viol += s.violation_s;
                obs += s.observed_s;
                unserved += s.unserved_milli_s;
                demand += s.demand_milli_s;
                svc_milli_s += s.gpu_milli_s;
                ServiceReport {
                    name: s.spec.name.clone(),
                    scale_out_s: Percentiles::of(&mut s.scale_outs.clone()),
                    scale_ups: s.scale_ups,
                    scale_downs: s.scale_downs,
                    ready_min: s.ready_min.unwrap_or(0),
                    ready_max: s.ready_max,
                    ready_mean: if s.observed_s > 0 { s.ready_s as f64 / s.observed_s as f64 } else { 0.0 },
                    slo_violation_pct: pct(u128::from(s.violation_s), u128::from(s.observed_s)),
                    unserved_pct: pct(s.unserved_milli_s, s.demand_milli_s),
                    gpu_hours: s.gpu_milli_s as f64 / 1000.0 / 3600.0,
                }
            })
            .collect();
        let batch_milli_s = self.m.alloc_gpu_milli_s.saturating_sub(svc_milli_s);
        let goodput_milli_s = batch_milli_s.saturating_sub(self.m.lost_gpu_milli_s);
        let h = |x: u128| x as f64 / 1000.0 / 3600.0;
        Some(InferenceReport {
            mode: if self.partition_milli > 0 { "static" } else { "shared" }.into(),
            partition_gpu_milli: self.partition_milli,
            services,
            scale_out_s: Percentiles::of(&mut all_outs),
            slo_violation_pct: pct(u128::from(viol), u128::from(obs)),
            unserved_pct: pct(unserved, demand),
            service_gpu_hours: h(svc_milli_s),
            batch_gpu_hours: h(batch_milli_s),
            batch_goodput_gpu_hours: h(goodput_milli_s),
            batch_goodput_pct: if cluster_milli_s > 0.0 {
                goodput_milli_s as f64 / cluster_milli_s * 100.0
            } else {
                0.0
            },
            batch_completed: completed,
        })
    }

    /// Why a job still waits, as the state machine last recorded it.
    fn reason(&self, job: &SimJob) -> String {
        job.id.and_then(|id| self.state.job(id)).map(|j| j.reason.clone()).unwrap_or_default()
    }

    fn report(&self) -> ReplayReport {
        let start_s = self.start_s;
        let span = self.now.saturating_sub(start_s);
        let total = self.m.total_gpu_milli;
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
                            reason: self.reason(job),
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
                let a = &self.m.qacc[i];
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
            nodes: self.state.nodes().len() as u64,
            gpu_milli: total,
            jobs: self.jobs.len() as u64,
            completed,
            running_at_end: running,
            never_started: never,
            requeued_at_end: requeued,
            preempted_jobs: preempted,
            preemptions: self.m.preemptions,
            lost_gpu_hours: self.m.lost_gpu_milli_s as f64 / 1000.0 / 3600.0,
            passes: self.passes,
            events: self.events,
            start_s,
            end_s: self.now,
            wait_s: Percentiles::of(&mut waits),
            jct_s: Percentiles::of(&mut jcts),
            gpu_util_mean_pct: if cluster_milli_s > 0.0 {
                self.m.alloc_gpu_milli_s as f64 / cluster_milli_s * 100.0
            } else {
                self.m.alloc_gpu_milli as f64 / total.max(1) as f64 * 100.0
            },
            gpu_util_max_pct: self.m.util_max * 100.0,
            frag_mean_pct: self.m.frag_mean_pct(),
            gang_pairs: self.m.gang_pairs,
            gang_pairs_cross_block_pct: if self.m.gang_pairs > 0 {
                self.m.gang_pairs_crossing as f64 / self.m.gang_pairs as f64 * 100.0
            } else {
                0.0
            },
            refused_placements: self.m.refused_placements,
            refused_preemptions: self.m.refused_preemptions,
            refused_examples: self.m.refused_examples(),
            queues,
            never_started_examples: examples,
            inference: self.inference_report(completed, cluster_milli_s),
            series: self.m.series.clone(),
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
