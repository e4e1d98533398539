//! One scheduling pass: `schedule(view, now, seed, config) -> Plan`.
//!
//! ```text
//!  pending jobs ─▶ order (priority, weighted DRF share, age) ─▶ for each job:
//!     validate ─▶ quota admission ─▶ place replicas (gang: all or none; elastic: ≥ min)
//!        └─ no room ─▶ preempt (lower priority, or borrowed quota reclaimed) with the least
//!                      lost work ─▶ else reserve for the blocked head job, and let later jobs
//!                      backfill only where they cannot delay that reservation
//! ```
//!
//! The pass works on a private copy of the cluster built from the view; nothing is mutated
//! outside. Time (`now`) and randomness (`seed`) are arguments.

use crate::cluster::{Choice, Cluster, ClusterError, DevReq, Hold, ShapeId, TopoLevel};
use crate::policy::{self, Norms, Policy, UnknownPolicy, Weights};
use crate::quota::QuotaBook;
use crate::rng::DetRng;
use crate::workload::{Profile, TypicalKey};
use rustc_hash::FxHashMap as HashMap;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use suanli_model::{
    Allocation, DeviceKind, ElasticRole, GangTopology, JobId, JobSpec, Limits, Node, NodeId, Placement, Plan,
    Preemption, PreemptionReason, Queue, QueueId, ResVec, Reservation, TaskResources, Unplaced,
};
use thiserror::Error;

/// A job waiting to be placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingJob {
    /// Id.
    pub id: JobId,
    /// Spec.
    pub spec: JobSpec,
    /// Submission time (seconds).
    pub submitted_at: u64,
    /// Capacity was freed for this job by preemption in an earlier pass: it is considered
    /// before every other job, so the victims' queues cannot take the capacity back.
    #[serde(default)]
    pub nominated: bool,
    /// Nodes that already run replicas of this job (a running service's): with
    /// `service.spread`, its new replicas go elsewhere where they fit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub occupied: Vec<NodeId>,
    /// A running elastic job's missing replicas (docs/job-spec.md, "Elastic jobs"): placed only
    /// into capacity that is idle after every other pending job of the pass had its turn;
    /// never preempts and never holds a reservation.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grow: bool,
}

/// A recently seen task shape, for the fragmentation profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadSample {
    /// Resources of one replica.
    pub resources: TaskResources,
    /// Allowed device models (empty = any).
    pub device_models: Vec<String>,
    /// How many replicas of this shape arrived recently.
    pub count: u64,
}

/// The immutable snapshot one pass schedules against.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClusterView {
    /// Every node (cordoned and unhealthy ones too: they explain misfits).
    pub nodes: Vec<Node>,
    /// Every queue.
    pub queues: Vec<Queue>,
    /// Jobs waiting.
    pub pending: Vec<PendingJob>,
    /// Running allocations (shared with the state they come from: a view is cheap to take).
    pub running: Vec<Arc<Allocation>>,
    /// Recent workload for fragmentation-aware placement. Empty: derived from the pending
    /// jobs ([`workload_samples`]).
    pub workload: Vec<WorkloadSample>,
    /// Why each node with `schedulable = false` takes no new work, as pending reasons name it:
    /// `down`, `draining`, `cordoned`, or `not schedulable: <why>`. A node missing here is
    /// reported as `cordoned` (traces and hand-written views mark cordons only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unschedulable: BTreeMap<NodeId, String>,
}

/// Knobs of the engine; every limit is explicit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// Placement policy name (see [`policy::POLICY_NAMES`]).
    pub policy: String,
    /// Scorer weights of the `suanli` policy.
    pub weights: Weights,
    /// Validation limits.
    pub limits: Limits,
    /// Share of recent tasks the typical shapes must cover (FGD's 95%).
    pub typical_coverage: f64,
    /// Most pending jobs considered per pass (the rest wait for the next pass).
    pub max_jobs_per_pass: usize,
    /// Allow preemption.
    pub preemption: bool,
    /// Most allocations one job may preempt.
    pub max_preemptions_per_job: usize,
    /// Allow backfill behind a blocked head job.
    pub backfill: bool,
    /// Most release steps examined when computing a head job's reservation.
    pub max_reservation_steps: usize,
    /// Benchmark baseline only: evaluate every node for every replica instead of using the
    /// class index. Same decisions in distribution, far slower.
    pub naive_scan: bool,
    /// How preemption ranks the candidate victims on a node.
    pub victim_order: VictimOrder,
    /// Keep a multi-node gang in the fewest network units (nodes' `topology.suanli.io/block`
    /// and `nvlink-domain` labels). Off only to measure what topology awareness buys.
    pub topology_aware: bool,
    /// The `suanli` policy's tie rule, as a rehearsal on the workload chose it
    /// ([`crate::rehearsal::rehearse`]; the server rehearses in the background). `None`: the
    /// rule the workload profile alone gives ([`policy::Ties::of`]).
    pub ties: Option<policy::Ties>,
}

/// How preemption chooses among acceptable victims (lower priority or reclaimable borrowed
/// work). On each node the candidates are taken cheapest first until the job fits, and the
/// node whose victims cost least in total wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VictimOrder {
    /// Least lost work first: device milli × (seconds since the last committed checkpoint, or
    /// since the start without one, + the restore estimate) ([`Allocation::lost_work`]).
    #[default]
    CheckpointAware,
    /// The most recently started first (cost = seconds running), blind to checkpoints, as
    /// many schedulers order victims.
    YoungestFirst,
}

impl VictimOrder {
    /// Every order, by name.
    pub const NAMES: [&'static str; 2] = ["checkpoint-aware", "youngest-first"];

    /// Its name (`checkpoint-aware`, `youngest-first`).
    pub fn as_str(self) -> &'static str {
        match self {
            VictimOrder::CheckpointAware => "checkpoint-aware",
            VictimOrder::YoungestFirst => "youngest-first",
        }
    }

    /// The order named `s`, if any.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::CheckpointAware, Self::YoungestFirst].into_iter().find(|o| o.as_str() == s)
    }

    /// The cost of stopping `a` at `now` under this order (lower is preempted first).
    pub fn cost(self, a: &Allocation, now: u64) -> u128 {
        match self {
            VictimOrder::CheckpointAware => a.lost_work(now),
            VictimOrder::YoungestFirst => u128::from(now.saturating_sub(a.started_at)),
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: "suanli".into(),
            weights: Weights::default(),
            limits: Limits::default(),
            typical_coverage: 0.95,
            max_jobs_per_pass: 10_000,
            preemption: true,
            max_preemptions_per_job: 64,
            backfill: true,
            max_reservation_steps: 4096,
            naive_scan: false,
            victim_order: VictimOrder::CheckpointAware,
            topology_aware: true,
            ties: None,
        }
    }
}

/// Why a pass could not run at all.
#[derive(Debug, Error)]
pub enum ScheduleError {
    /// The node list is invalid.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// Unknown policy name.
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
}

/// Device kinds of the nodes that running allocations use (looked up by device id).
struct Kinds<'a> {
    nodes: HashMap<&'a str, &'a Node>,
}

impl<'a> Kinds<'a> {
    fn new(nodes: &'a [Node], running: &[Arc<Allocation>]) -> Self {
        let used: rustc_hash::FxHashSet<&str> = running.iter().map(|a| a.node.as_str()).collect();
        Self { nodes: nodes.iter().filter(|n| used.contains(n.id.as_str())).map(|n| (n.id.as_str(), n)).collect() }
    }

    fn get(&self, (node, dev): &(&str, &str)) -> Option<&DeviceKind> {
        self.nodes.get(node)?.devices.iter().find(|d| d.id == *dev).map(|d| &d.kind)
    }
}

fn dev_req_of(a: &Allocation, kinds: &Kinds<'_>) -> Option<DevReq> {
    let first = a.devices.first()?;
    let kind = kinds.get(&(a.node.as_str(), first.device.as_str())).copied().unwrap_or(DeviceKind::Gpu);
    Some(DevReq {
        kind,
        count: a.devices.len() as u32,
        milli: first.milli.min(1000) as u16,
        memory_mib: first.memory_mib,
        isolated: false,
    })
}

fn alloc_resvec(a: &Allocation, kinds: &Kinds<'_>) -> ResVec {
    let mut v = ResVec { cpu_milli: a.cpu_milli, memory_mib: a.memory_mib, ..ResVec::ZERO };
    for d in &a.devices {
        match kinds.get(&(a.node.as_str(), d.device.as_str())) {
            Some(DeviceKind::Npu) => v.npu_milli += u64::from(d.milli),
            _ => v.gpu_milli += u64::from(d.milli),
        }
    }
    v
}

/// The typical shape a workload sample counts towards in [`build_profile`].
fn typical_key(cluster: &Cluster, s: &WorkloadSample) -> TypicalKey {
    let dev = s.resources.devices.as_ref().map(|d| DevReq {
        kind: d.kind,
        count: d.count,
        milli: d.milli.min(1000) as u16,
        memory_mib: d.memory_mib,
        isolated: false,
    });
    TypicalKey::new(s.resources.cpu_milli, dev, cluster.model_set(&s.device_models))
}

/// Builds the fragmentation profile from samples. Like the published FGD it ignores memory: a
/// memory-aware profile was measured and gained nothing (docs/sim.md, "How the default decides").
pub fn build_profile(cluster: &Cluster, samples: &[WorkloadSample], coverage: f64) -> Profile {
    let mut counts: BTreeMap<TypicalKey, u64> = BTreeMap::new();
    for s in samples {
        *counts.entry(typical_key(cluster, s)).or_default() += s.count;
    }
    let mut supply = vec![0.0; 128];
    cluster.for_each_node(|g, _| {
        for d in g.devs.iter().filter(|d| !d.partition) {
            supply[d.model as usize] += 1.0;
        }
    });
    let mut p = Profile::from_counts(&counts, coverage);
    p.set_supply(supply);
    p
}

/// The workload a pass measures fragmentation against: the view's recent workload, or, when it
/// has none, the pending jobs' replicas.
pub fn workload_samples(view: &ClusterView) -> Vec<WorkloadSample> {
    if view.workload.is_empty() {
        view.pending
            .iter()
            .flat_map(|p| {
                p.spec.groups.iter().map(|g| WorkloadSample {
                    resources: g.resources.clone(),
                    device_models: p.spec.constraints.device_models.clone(),
                    count: u64::from(g.replicas),
                })
            })
            .collect()
    } else {
        view.workload.clone()
    }
}

struct Pass<'a> {
    cfg: &'a SchedulerConfig,
    now: u64,
    cluster: Cluster,
    policy: Box<dyn Policy>,
    quota: QuotaBook,
    rng: DetRng,
    kinds: Kinds<'a>,
    running: &'a [Arc<Allocation>],
    /// Indices into `running` already chosen as victims.
    evicted: BTreeSet<usize>,
    /// Nodes whose running work was preempted in this pass ([`Hold::Draining`]): held out of
    /// placement, open only to later preemptions' holds.
    draining: BTreeSet<u32>,
    /// What this pass's victims hold of their queues' quota: refunded while a preemption
    /// chooses victims, charged again for placements (a victim counts until it stops, at apply
    /// as here).
    stopping: Vec<(QueueId, ResVec)>,
    /// Whether `stopping` is charged now.
    stopping_charged: bool,
    plan: Plan,
    /// Blocked head job's reservation: (start time, nodes).
    reservation: Option<(u64, Vec<u32>)>,
    /// A reservation was already attempted this pass.
    reserve_tried: bool,
}

/// A replica placed tentatively in this pass.
struct Tentative {
    group: u32,
    replica: u32,
    shape: ShapeId,
    choice: Choice,
    charge: ResVec,
    borrowed: bool,
}

impl Tentative {
    /// Capacity held for a preempting job (charged as a whole later, never borrowed).
    fn held(group: usize, replica: u32, shape: ShapeId, choice: Choice) -> Self {
        Self { group: group as u32, replica, shape, choice, charge: ResVec::ZERO, borrowed: false }
    }
}

/// Runs one scheduling pass. Deterministic: the same view, `now`, `seed` and config give the
/// same plan.
pub fn schedule(view: &ClusterView, now: u64, seed: u64, cfg: &SchedulerConfig) -> Result<Plan, ScheduleError> {
    let probe = policy::build(
        &cfg.policy,
        Norms { max_cpu_milli: 1, max_dev_milli: 1000 },
        &Profile::default(),
        cfg.weights,
        None,
    )?;
    let mut cluster = Cluster::new(&view.nodes, &cfg.limits, probe.needs_tags(), probe.tie_break())?;
    cluster.set_unschedulable_reasons(&view.unschedulable);
    let kinds = Kinds::new(&view.nodes, &view.running);
    let mut quota = QuotaBook::new(&view.queues);
    cluster.occupy_all(
        view.running.iter().map(|a| (&a.node, a.cpu_milli, a.memory_mib, a.devices.as_slice(), dev_req_of(a, &kinds))),
    );
    for a in &view.running {
        quota.charge(&a.queue, alloc_resvec(a, &kinds));
    }
    let profile = build_profile(&cluster, &workload_samples(view), cfg.typical_coverage);
    let policy = policy::build(&cfg.policy, Norms::of(cluster.groups()), &profile, cfg.weights, cfg.ties)?;
    let mut pass = Pass {
        cfg,
        now,
        cluster,
        policy,
        quota,
        rng: DetRng::new(seed),
        kinds,
        running: &view.running,
        evicted: BTreeSet::new(),
        draining: BTreeSet::new(),
        stopping: Vec::new(),
        stopping_charged: true,
        plan: Plan::default(),
        reservation: None,
        reserve_tried: false,
    };
    let total: ResVec = view.nodes.iter().map(Node::capacity).fold(ResVec::ZERO, |a, b| a + b);

    // Per-queue lists ordered by priority, then age, then id.
    let mut lists: BTreeMap<QueueId, Vec<&PendingJob>> = BTreeMap::new();
    for p in &view.pending {
        if let Err(e) = p.spec.validate(&cfg.limits) {
            pass.plan.unplaced.push(Unplaced { job: p.id, reason: format!("invalid spec: {e}") });
        } else if !pass.quota.contains(&p.spec.queue) {
            pass.plan.unplaced.push(Unplaced { job: p.id, reason: format!("unknown queue {}", p.spec.queue) });
        } else {
            lists.entry(p.spec.queue.clone()).or_default().push(p);
        }
    }
    for l in lists.values_mut() {
        l.sort_by(|a, b| {
            a.grow
                .cmp(&b.grow)
                .then(b.nominated.cmp(&a.nominated))
                .then(b.spec.priority.cmp(&a.spec.priority))
                .then(a.submitted_at.cmp(&b.submitted_at))
                .then(a.id.cmp(&b.id))
        });
        l.reverse(); // pop from the back
    }
    let mut considered = 0usize;
    while considered < cfg.max_jobs_per_pass {
        // Head of each queue: elastic growth last, nominated first, then highest priority,
        // then lowest weighted dominant share, then oldest.
        let mut best: Option<(&QueueId, &PendingJob, f64)> = None;
        for (q, l) in &lists {
            let Some(&job) = l.last() else { continue };
            let share = pass.quota.share(q, &total);
            let better = match best {
                None => true,
                Some((_, b, bs)) => {
                    (
                        !job.grow,
                        job.nominated,
                        job.spec.priority,
                        std::cmp::Reverse(share_key(share)),
                        std::cmp::Reverse(job.submitted_at),
                        std::cmp::Reverse(job.id),
                    ) > (
                        !b.grow,
                        b.nominated,
                        b.spec.priority,
                        std::cmp::Reverse(share_key(bs)),
                        std::cmp::Reverse(b.submitted_at),
                        std::cmp::Reverse(b.id),
                    )
                }
            };
            if better {
                best = Some((q, job, share));
            }
        }
        let Some((q, job, _)) = best else { break };
        let q = q.clone();
        if let Some(l) = lists.get_mut(&q) {
            l.pop();
        }
        considered += 1;
        pass.job(job);
    }
    let plan = pass.plan;
    debug_assert_eq!(
        crate::check::plan(view, &plan, now, cfg),
        Ok(()),
        "schedule(now={now}, seed={seed}) broke its own guarantees"
    );
    Ok(plan)
}

/// Where a gang's replicas may go.
enum Scope {
    /// Anywhere.
    Any,
    /// Inside one unit.
    Unit(TopoLevel, u32),
    /// Block by block in this order, then anywhere.
    Span(Vec<u32>),
}

/// Most units tried, per topology level, for one gang.
const MAX_TOPO_TRIES: usize = 16;

/// Orders f64 shares totally (shares are finite and non-negative).
fn share_key(s: f64) -> u64 {
    (s.clamp(0.0, 1e12) * 1e9) as u64
}

impl Pass<'_> {
    fn job(&mut self, job: &PendingJob) {
        let spec = &job.spec;
        let need = spec.min_total();
        // Backfill: once a head job holds a reservation, a later job that could still be
        // running at the reserved start must stay off the reserved nodes. The hold covers
        // preemption too: a job kept off the reserved nodes must not reach them by preempting
        // (or by the placement that follows when no victim turns out to be needed).
        let held = self.hold_for(job);
        // Elastic growth takes only idle capacity: no preemption, no reservation.
        let may_preempt = self.cfg.preemption && !job.grow;
        let outcome = match self.quota.check(&spec.queue, need) {
            // A queue within its nominal quota may reclaim what others borrowed.
            Err(reason) => {
                let mut reason = reason.to_string();
                if self.stopping_blocks(&spec.queue, need) {
                    reason
                        .push_str(" (counting the work preempted in this pass, which holds its quota until it stops)");
                }
                Err((reason, may_preempt && self.try_preempt(job, true), false))
            }
            Ok(admission) => match self.place_all(job, admission.borrowed) {
                Ok(list) => {
                    self.emit(job, list);
                    Ok(())
                }
                Err(reason) => Err((reason, may_preempt && self.try_preempt(job, false), !job.grow)),
            },
        };
        self.release_hold(&held);
        let Err((mut reason, preempted, capacity)) = outcome else { return };
        if preempted {
            return;
        }
        if capacity
            && !held.is_empty()
            && let (Some(r), Some((start, _))) = (self.plan.reservations.last(), &self.reservation)
        {
            reason = format!(
                "{reason}; {} node(s) reserved for job {} from t={start} (backfill there needs a runtime estimate ending by then)",
                held.len(),
                r.job
            );
        }
        if capacity
            && self.cfg.backfill
            && self.reservation.is_none()
            && let Some((start, nodes)) = self.reserve(job)
        {
            reason = format!("{reason}; reserved {} node(s) from t={start}", nodes.len());
            self.plan.reservations.push(Reservation {
                job: job.id,
                start_at: start,
                nodes: nodes.iter().map(|&n| self.cluster.node_id(n).clone()).collect(),
            });
            self.reservation = Some((start, nodes));
        }
        self.plan.unplaced.push(Unplaced { job: job.id, reason });
    }

    fn hold_for(&mut self, job: &PendingJob) -> Vec<u32> {
        let Some((start, nodes)) = &self.reservation else { return Vec::new() };
        let ends_before = job.spec.runtime_estimate_s.is_some_and(|e| self.now.saturating_add(e) <= *start);
        if ends_before {
            return Vec::new();
        }
        let nodes = nodes.clone();
        for &n in &nodes {
            self.cluster.hold(n, Hold::Reserved);
        }
        nodes
    }

    fn release_hold(&mut self, held: &[u32]) {
        for &n in held {
            self.cluster.unhold(n, Hold::Reserved);
        }
    }

    /// Holds (`true`) or opens (`false`) the nodes whose work this pass preempted.
    fn hold_draining(&mut self, on: bool) {
        for &n in &self.draining {
            if on {
                self.cluster.hold(n, Hold::Draining);
            } else {
                self.cluster.unhold(n, Hold::Draining);
            }
        }
    }

    /// Charges (`true`) or refunds (`false`) what this pass's victims hold of their queues'
    /// quota; a no-op when it already is so.
    fn charge_stopping(&mut self, on: bool) {
        if self.stopping_charged == on {
            return;
        }
        for (q, r) in &self.stopping {
            if on {
                self.quota.charge(q, *r);
            } else {
                self.quota.refund(q, *r);
            }
        }
        self.stopping_charged = on;
    }

    /// Whether only this pass's victims (still running) keep `need` out of `queue`'s quota.
    fn stopping_blocks(&mut self, queue: &QueueId, need: ResVec) -> bool {
        if self.stopping.is_empty() {
            return false;
        }
        self.charge_stopping(false);
        let ok = self.quota.check(queue, need).is_ok();
        self.charge_stopping(true);
        ok
    }

    /// One replica's node and devices under the configured scan.
    fn choose(&mut self, shape: ShapeId) -> Option<Choice> {
        if self.cfg.naive_scan {
            self.cluster.choose_naive(shape, self.policy.as_ref(), &mut self.rng)
        } else {
            self.cluster.choose(shape, self.policy.as_ref(), &mut self.rng)
        }
    }

    /// For a service that spreads (`service.spread`, the default): a node in a pool none of
    /// its replicas runs in (`used`: those already running and those placed in this pass)
    /// where one fits, else a node none of them runs on, else any node.
    fn choose_spread(&mut self, shape: ShapeId, spread: bool, used: &[u32]) -> Option<Choice> {
        if spread && !used.is_empty() {
            // Another pool first (a pool is a failure domain: its own power, network, agents),
            // then another node of the same pools.
            let mates = self.cluster.pool_mates(used);
            if mates.len() < self.cluster.len() {
                let other_pool = self.cluster.exclude(shape, &mates);
                if let Some(c) = self.choose(other_pool) {
                    return Some(c);
                }
            }
            let elsewhere = self.cluster.exclude(shape, used);
            if let Some(c) = self.choose(elsewhere) {
                return Some(c);
            }
        }
        self.choose(shape)
    }

    /// Where a job's replicas run before this pass (dense node indices), when it spreads.
    fn spread_from(&self, job: &PendingJob) -> (bool, Vec<u32>) {
        let spread = job.spec.service().is_some_and(|s| s.spread);
        let used =
            if spread { job.occupied.iter().filter_map(|n| self.cluster.index_of(n)).collect() } else { Vec::new() };
        (spread, used)
    }

    /// Places the job's replicas: first every group's minimum (all replicas of a gang), all or
    /// nothing; then, for an elastic job, the replicas beyond the minimum while quota and
    /// capacity last. On failure nothing stays committed and the reason names the first group
    /// whose minimum did not fit. The minimum was admitted by the caller and is charged here
    /// before any extra replica is checked against the queue's quota.
    fn place_all(&mut self, job: &PendingJob, borrowed: bool) -> Result<Vec<Tentative>, String> {
        let spec = &job.spec;
        let need = spec.min_total();
        let shapes: Vec<ShapeId> =
            spec.groups.iter().map(|g| self.cluster.shape(&g.resources, &spec.constraints)).collect();
        self.quota.charge(&spec.queue, need);
        let mut placed = match self.place_min(job, &shapes, borrowed) {
            Ok(p) => p,
            Err(reason) => {
                self.quota.refund(&spec.queue, need);
                return Err(reason);
            }
        };
        if !spec.gang {
            let (spread, mut used) = self.spread_from(job);
            used.extend(placed.iter().map(|t| t.choice.node));
            for (gi, (g, &shape)) in spec.groups.iter().zip(&shapes).enumerate() {
                let per = g.resources.as_resvec();
                for r in g.min()..g.replicas {
                    // Replicas beyond the minimum were not admitted up front: check each.
                    let Ok(a) = self.quota.check(&spec.queue, per) else { break };
                    let Some(choice) = self.choose_spread(shape, spread, &used) else { break };
                    used.push(choice.node);
                    self.cluster.commit(shape, &choice);
                    self.quota.charge(&spec.queue, per);
                    placed.push(Tentative {
                        group: gi as u32,
                        replica: r,
                        shape,
                        choice,
                        charge: per,
                        borrowed: a.borrowed,
                    });
                }
            }
        }
        Ok(placed)
    }

    /// Every group's minimum (all replicas of a gang), all or nothing; a gang spanning nodes is
    /// kept in the fewest network units its constraint allows. Nothing stays committed on error.
    fn place_min(&mut self, job: &PendingJob, shapes: &[ShapeId], borrowed: bool) -> Result<Vec<Tentative>, String> {
        let spec = &job.spec;
        let replicas: u32 = spec.groups.iter().map(|g| g.replicas).sum();
        let topo = spec.constraints.gang_topology;
        let levels: Vec<TopoLevel> = match topo {
            GangTopology::Prefer => vec![TopoLevel::NvlinkDomain, TopoLevel::Block],
            GangTopology::RequireBlock => vec![TopoLevel::Block],
            GangTopology::RequireNvlinkDomain => vec![TopoLevel::NvlinkDomain],
            GangTopology::Ignore => Vec::new(),
        };
        let levels: Vec<TopoLevel> = levels.into_iter().filter(|&l| self.cluster.topo_units(l) > 0).collect();
        let required = matches!(topo, GangTopology::RequireBlock | GangTopology::RequireNvlinkDomain);
        if !spec.gang || replicas < 2 || !self.cfg.topology_aware || (levels.is_empty() && !required) {
            return self.place_min_in(job, shapes, borrowed, Scope::Any);
        }
        let need: u64 = spec
            .groups
            .iter()
            .map(|g| {
                u64::from(g.replicas)
                    * g.resources.devices.as_ref().map_or(0, |d| u64::from(d.count) * u64::from(d.milli.min(1000)))
            })
            .sum();
        for &level in &levels {
            // Best fit: the units with the least free capacity that could still hold the gang.
            let free = self.cluster.topo_free(level);
            let mut cands: Vec<(u64, u32)> =
                free.iter().enumerate().filter(|(_, f)| **f >= need).map(|(u, f)| (*f, u as u32)).collect();
            cands.sort_unstable();
            for &(_, unit) in cands.iter().take(MAX_TOPO_TRIES) {
                if let Ok(p) = self.place_min_in(job, shapes, borrowed, Scope::Unit(level, unit)) {
                    return Ok(p);
                }
            }
        }
        if required {
            let level = if topo == GangTopology::RequireBlock { "block" } else { "NVLink domain" };
            let units = levels.first().map_or(0, |&l| self.cluster.topo_units(l));
            return Err(format!(
                "gang of {replicas} replicas fits in no single {level} ({units} known; constraints.gang_topology = {})",
                if topo == GangTopology::RequireBlock { "require-block" } else { "require-nvlink-domain" }
            ));
        }
        // Spans units: fill the blocks with the most free capacity first, so the gang crosses
        // as few as it must; replicas that no block can take go anywhere.
        if self.cluster.topo_units(TopoLevel::Block) > 0 {
            let free = self.cluster.topo_free(TopoLevel::Block);
            let mut order: Vec<(std::cmp::Reverse<u64>, u32)> = free
                .iter()
                .enumerate()
                .filter(|(_, f)| **f > 0)
                .map(|(u, f)| (std::cmp::Reverse(*f), u as u32))
                .collect();
            order.sort_unstable();
            return self.place_min_in(job, shapes, borrowed, Scope::Span(order.into_iter().map(|(_, u)| u).collect()));
        }
        self.place_min_in(job, shapes, borrowed, Scope::Any)
    }

    /// Places every group's minimum inside `scope`; all or nothing.
    fn place_min_in(
        &mut self,
        job: &PendingJob,
        shapes: &[ShapeId],
        borrowed: bool,
        scope: Scope,
    ) -> Result<Vec<Tentative>, String> {
        let spec = &job.spec;
        let mut placed: Vec<Tentative> = Vec::new();
        let mut at = 0usize;
        let (spread, mut used) = self.spread_from(job);
        for (gi, (g, &shape)) in spec.groups.iter().zip(shapes).enumerate() {
            let min = if spec.gang { g.replicas } else { g.min() };
            for r in 0..min {
                let choice = match &scope {
                    Scope::Any => {
                        let c = self.choose_spread(shape, spread, &used);
                        if let Some(c) = &c {
                            used.push(c.node);
                        }
                        c
                    }
                    Scope::Unit(level, unit) => {
                        let s = self.cluster.restrict(shape, *level, *unit);
                        self.choose(s)
                    }
                    Scope::Span(order) => {
                        let mut found = None;
                        while let Some(&unit) = order.get(at) {
                            let s = self.cluster.restrict(shape, TopoLevel::Block, unit);
                            found = self.choose(s);
                            if found.is_some() {
                                break;
                            }
                            at += 1;
                        }
                        found.or_else(|| self.choose(shape))
                    }
                };
                let Some(choice) = choice else {
                    let why = self.cluster.explain(shape).message();
                    self.rollback(&spec.queue, &placed);
                    return Err(format!("group {} ({r}/{min} replicas placeable): {why}", g.name));
                };
                self.cluster.commit(shape, &choice);
                placed.push(Tentative { group: gi as u32, replica: r, shape, choice, charge: ResVec::ZERO, borrowed });
            }
        }
        Ok(placed)
    }

    fn rollback(&mut self, queue: &QueueId, placed: &[Tentative]) {
        for t in placed.iter().rev() {
            self.cluster.release(t.shape, &t.choice);
            self.quota.refund(queue, t.charge);
        }
    }

    fn emit(&mut self, job: &PendingJob, list: Vec<Tentative>) {
        for t in list {
            let s = self.cluster.shape_of(t.shape);
            let (cpu, mem) = (s.cpu_milli, s.memory_mib);
            self.plan.placements.push(Placement {
                job: job.id,
                group: t.group,
                replica: t.replica,
                node: self.cluster.node_id(t.choice.node).clone(),
                cpu_milli: cpu,
                memory_mib: mem,
                devices: self.cluster.shares(&t.choice),
                borrowed: t.borrowed,
            });
        }
    }

    fn vacate(&mut self, i: usize) {
        let a = &self.running[i];
        let d = dev_req_of(a, &self.kinds);
        self.cluster.vacate(&a.node, a.cpu_milli, a.memory_mib, &a.devices, d);
    }

    fn reoccupy(&mut self, i: usize) {
        let a = &self.running[i];
        let d = dev_req_of(a, &self.kinds);
        self.cluster.occupy(&a.node, a.cpu_milli, a.memory_mib, &a.devices, d);
    }

    /// Removes a victim's usage from its queue; returns what was refunded.
    fn refund_victim(&mut self, u: usize) -> (QueueId, ResVec) {
        let a = &self.running[u];
        let r = alloc_resvec(a, &self.kinds);
        self.quota.refund(&a.queue, r);
        (a.queue.clone(), r)
    }

    /// Victims for `job`: lower priority, or (when `reclaim` or the job is within its nominal
    /// quota) allocations of other queues running on borrowed quota.
    ///
    /// Quota boundaries hold: work of another queue that runs inside its queue's nominal quota
    /// (a guarantee) is never preempted for priority; only its borrowed work is, and reclaim
    /// happens only inside the same cohort.
    fn victim_ok(&self, job: &PendingJob, a: &Allocation, reclaim_allowed: bool) -> Option<PreemptionReason> {
        if !a.preemptible {
            return None;
        }
        if a.queue == job.spec.queue {
            return (a.priority < job.spec.priority).then_some(PreemptionReason::HigherPriority);
        }
        let cohort = |q: &QueueId| self.quota.queue(q).and_then(|q| q.cohort.clone());
        let same_cohort = cohort(&a.queue).is_some() && cohort(&a.queue) == cohort(&job.spec.queue);
        if a.priority < job.spec.priority && (a.borrowed || !self.guaranteed(a)) {
            return Some(PreemptionReason::HigherPriority);
        }
        if reclaim_allowed && a.borrowed && same_cohort {
            return Some(PreemptionReason::ReclaimBorrowed);
        }
        None
    }

    /// True when `a` runs inside a finite nominal quota of its queue (a dimension it uses is
    /// limited by the queue's nominal), so other queues cannot take it by priority.
    fn guaranteed(&self, a: &Allocation) -> bool {
        let Some(q) = self.quota.queue(&a.queue) else { return false };
        let used = alloc_resvec(a, &self.kinds).dims();
        let nominal = q.nominal.dims();
        !a.borrowed && (0..4).any(|i| used[i] > 0 && nominal[i] != u64::MAX)
    }

    /// What stopping `a` costs: an elastic job's surplus replica first (the most recently
    /// started first: shrinking newest replicas first), then other work by the configured
    /// victim order, an elastic job's minimum last (taking it stops the whole job, so it gives
    /// way only when no other acceptable victim set frees enough).
    fn victim_cost(&self, a: &Allocation) -> u128 {
        // Scaled so that sums keep the configured order's comparisons exactly, any set of
        // surplus replicas (at most `max_preemptions_per_job`, each below 2^32) costs less
        // than one other victim with work to lose, and one minimum replica more than any
        // set of others.
        const SCALE: u128 = 1 << 40;
        const LAST: u128 = 1 << 110;
        let base = || self.cfg.victim_order.cost(a, self.now).saturating_mul(SCALE);
        match a.elastic {
            ElasticRole::Surplus => u128::from(self.now.saturating_sub(a.started_at).min(u64::from(u32::MAX))),
            ElasticRole::None => base(),
            ElasticRole::Minimum => base().saturating_add(LAST),
        }
    }

    /// All allocations of the same job when `a` is part of a gang, else just `a`.
    fn victim_unit(&self, i: usize) -> Vec<usize> {
        let a = &self.running[i];
        if !a.gang {
            return vec![i];
        }
        (0..self.running.len()).filter(|&j| self.running[j].job == a.job && !self.evicted.contains(&j)).collect()
    }

    /// Tries to make room for the whole job by preempting. On success the victims are in the
    /// plan, the job's capacity is held for the rest of this pass, and the job waits (its
    /// placements follow once the victims have stopped). Returns false and changes nothing
    /// when no acceptable victim set exists.
    ///
    /// The victims keep running until they stop, so their nodes are held out of placement for
    /// the rest of the pass ([`Hold::Draining`]) and their usage counts against their queues'
    /// quota for placements: what they free beyond the job's own holds may be held by a later
    /// preemption in this pass, never placed on (apply would refuse it).
    fn try_preempt(&mut self, job: &PendingJob, quota_blocked: bool) -> bool {
        self.hold_draining(false);
        self.charge_stopping(false);
        let done = self.preempt_for(job, quota_blocked);
        self.charge_stopping(true);
        self.hold_draining(true);
        done
    }

    /// [`Pass::try_preempt`] with this pass's draining nodes open to holds and its victims'
    /// quota refunded.
    fn preempt_for(&mut self, job: &PendingJob, quota_blocked: bool) -> bool {
        let spec = &job.spec;
        let need = spec.min_total();
        let reclaim_allowed = self.quota.within_nominal(&spec.queue, need);
        // Within its own queue a job may displace lower-priority work even when the queue is
        // at its quota: that frees the queue's own usage.
        let own_lower = |a: &Arc<Allocation>| a.queue == spec.queue && a.preemptible && a.priority < spec.priority;
        if quota_blocked && !reclaim_allowed && !self.running.iter().any(own_lower) {
            return false;
        }
        // Candidates per node, cheapest first (by the configured victim order).
        let mut by_node: BTreeMap<u32, Vec<(u128, usize)>> = BTreeMap::new();
        for (i, a) in self.running.iter().enumerate() {
            if self.evicted.contains(&i) {
                continue;
            }
            if quota_blocked
                && !(own_lower(a) || (reclaim_allowed && a.borrowed && a.queue != spec.queue && a.preemptible))
            {
                continue;
            }
            if self.victim_ok(job, a, reclaim_allowed).is_none() {
                continue;
            }
            let Some(n) = self.cluster.node_index(&a.node) else { continue };
            let unit = self.victim_unit(i);
            let cost: u128 = unit.iter().map(|&j| self.victim_cost(&self.running[j])).sum();
            by_node.entry(n).or_default().push((cost, i));
        }
        for v in by_node.values_mut() {
            v.sort_unstable();
        }
        let mut evicted_now: Vec<usize> = Vec::new();
        let mut held: Vec<Tentative> = Vec::new();
        let mut ok = true;
        'groups: for (gi, g) in spec.groups.iter().enumerate() {
            let shape = self.cluster.shape(&g.resources, &spec.constraints);
            let min = if spec.gang { g.replicas } else { g.min() };
            for r in 0..min {
                if let Some(c) = self.cluster.choose(shape, self.policy.as_ref(), &mut self.rng) {
                    self.cluster.commit(shape, &c);
                    held.push(Tentative::held(gi, r, shape, c));
                    continue;
                }
                // Cheapest node: release its candidates in order until the shape fits. A gang
                // candidate releases its whole gang (every member stops), so mates on the same
                // node free their share too and the gang's cost is counted once.
                let mut best: Option<(u128, usize, u32, Vec<usize>)> = None;
                for (&node, cands) in &by_node {
                    let mut freed = Vec::new();
                    let mut cost = 0u128;
                    let mut fits = false;
                    for &(c, i) in cands {
                        if self.evicted.contains(&i) || evicted_now.contains(&i) || freed.contains(&i) {
                            continue;
                        }
                        if best.as_ref().is_some_and(|b| cost + c > b.0) {
                            break;
                        }
                        for u in self.victim_unit(i) {
                            if !freed.contains(&u) && !evicted_now.contains(&u) {
                                freed.push(u);
                                self.vacate(u);
                            }
                        }
                        cost += c;
                        if self.cluster.choose_on(node, shape, self.policy.as_ref(), &mut self.rng).is_some() {
                            fits = true;
                            break;
                        }
                    }
                    for &i in freed.iter().rev() {
                        self.reoccupy(i);
                    }
                    if fits {
                        let cand = (cost, freed.len(), node, freed);
                        if best.as_ref().is_none_or(|b| (cand.0, cand.1, cand.2) < (b.0, b.1, b.2)) {
                            best = Some(cand);
                        }
                    }
                }
                let Some((_, _, node, victims)) = best else {
                    ok = false;
                    break 'groups;
                };
                for v in victims {
                    for u in self.victim_unit(v) {
                        if !evicted_now.contains(&u) {
                            self.evicted.insert(u);
                            evicted_now.push(u);
                            self.vacate(u);
                        }
                    }
                }
                match self.cluster.choose_on(node, shape, self.policy.as_ref(), &mut self.rng) {
                    Some(c) => {
                        self.cluster.commit(shape, &c);
                        held.push(Tentative::held(gi, r, shape, c));
                    }
                    None => {
                        ok = false;
                        break 'groups;
                    }
                }
                if evicted_now.len() > self.cfg.max_preemptions_per_job {
                    ok = false;
                    break 'groups;
                }
            }
        }
        // Victims leave their queues' usage.
        let mut refunds: Vec<(QueueId, ResVec)> = Vec::new();
        if ok {
            for &u in &evicted_now {
                refunds.push(self.refund_victim(u));
            }
        }
        if ok && quota_blocked {
            let shapes: Vec<ShapeId> =
                spec.groups.iter().map(|g| self.cluster.shape(&g.resources, &spec.constraints)).collect();
            // Quota, not only capacity, blocks the job: stop the queue's own lower-priority
            // work, or reclaim borrowed work whose usage counts against the capped ancestor,
            // least lost work first, until the quota admits the job. Work elsewhere would be
            // stopped for nothing.
            let mut extra: Vec<(u128, usize)> = by_node
                .values()
                .flatten()
                .copied()
                .filter(|&(_, i)| {
                    let a = &self.running[i];
                    let usable = self
                        .cluster
                        .node_index(&a.node)
                        .is_some_and(|n| shapes.iter().any(|&s| self.cluster.node_usable(n, s)));
                    usable && (a.queue == spec.queue || self.quota.shares_capped_ancestor(&spec.queue, &a.queue))
                })
                .collect();
            extra.sort_unstable();
            for (_, i) in extra {
                if self.quota.check(&spec.queue, need).is_ok() {
                    break;
                }
                if self.evicted.contains(&i) {
                    continue;
                }
                for u in self.victim_unit(i) {
                    self.evicted.insert(u);
                    evicted_now.push(u);
                    self.vacate(u);
                    refunds.push(self.refund_victim(u));
                }
            }
            ok = self.quota.check(&spec.queue, need).is_ok() && evicted_now.len() <= self.cfg.max_preemptions_per_job;
        }
        if !ok || evicted_now.is_empty() {
            for (q, r) in refunds.iter().rev() {
                self.quota.charge(q, *r);
            }
            for t in held.iter().rev() {
                self.cluster.release(t.shape, &t.choice);
            }
            for &u in evicted_now.iter().rev() {
                self.evicted.remove(&u);
                self.reoccupy(u);
            }
            // Everything fit after all: place it, but not on what earlier victims of this pass
            // free, nor in the quota they hold (they still run).
            self.hold_draining(true);
            self.charge_stopping(true);
            if ok
                && evicted_now.is_empty()
                && let Ok(a) = self.quota.check(&spec.queue, need)
                && let Ok(list) = self.place_all(job, a.borrowed)
            {
                self.emit(job, list);
                return true;
            }
            return false;
        }
        // Commit: the job's capacity stays held for the rest of this pass, and the victims'
        // nodes and quota take no placement until they have stopped.
        self.stopping.extend(refunds);
        for &u in &evicted_now {
            if let Some(n) = self.cluster.node_index(&self.running[u].node) {
                self.draining.insert(n);
            }
        }
        for &u in &evicted_now {
            let a = &self.running[u];
            let reason = self.victim_ok(job, a, reclaim_allowed).unwrap_or(PreemptionReason::HigherPriority);
            self.plan.preemptions.push(Preemption {
                alloc: a.id,
                job: a.job,
                node: a.node.clone(),
                for_job: job.id,
                reason,
                checkpoint_first: a.checkpoint_grace_s.is_some(),
                grace_s: a.checkpoint_grace_s.unwrap_or(0),
            });
        }
        self.quota.charge(&spec.queue, need);
        self.plan.unplaced.push(Unplaced {
            job: job.id,
            reason: format!("preempting {} allocation(s); placement follows when they stop", evicted_now.len()),
        });
        true
    }

    /// The earliest time the job fits if running work ends at its estimate, and the nodes it
    /// would use then. `None` when no running work has an estimate that frees enough.
    fn reserve(&mut self, job: &PendingJob) -> Option<(u64, Vec<u32>)> {
        let mut ends: Vec<(u64, usize)> = self
            .running
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.evicted.contains(i))
            .filter_map(|(i, a)| a.runtime_estimate_s.map(|e| (a.started_at.saturating_add(e).max(self.now), i)))
            .collect();
        ends.sort_unstable();
        // One attempt per pass: the simulation clones the cluster, which must not happen for
        // every job that fails once the cluster is full.
        if ends.is_empty() || std::mem::replace(&mut self.reserve_tried, true) {
            return None;
        }
        let mut sim = self.cluster.clone();
        let spec = &job.spec;
        let mut rng = self.rng.clone();
        let mut k = 0;
        let mut steps = 0;
        while k < ends.len() && steps < self.cfg.max_reservation_steps {
            let t = ends[k].0;
            while k < ends.len() && ends[k].0 == t {
                let a = &self.running[ends[k].1];
                sim.vacate(&a.node, a.cpu_milli, a.memory_mib, &a.devices, dev_req_of(a, &self.kinds));
                k += 1;
            }
            steps += 1;
            let mut placed: Vec<(ShapeId, Choice)> = Vec::new();
            let mut all = true;
            for g in &spec.groups {
                let shape = sim.shape(&g.resources, &spec.constraints);
                let min = if spec.gang { g.replicas } else { g.min() };
                for _ in 0..min {
                    match sim.choose(shape, self.policy.as_ref(), &mut rng) {
                        Some(c) => {
                            sim.commit(shape, &c);
                            placed.push((shape, c));
                        }
                        None => {
                            all = false;
                            break;
                        }
                    }
                }
                if !all {
                    break;
                }
            }
            if all {
                let nodes: BTreeSet<u32> = placed.iter().map(|(_, c)| c.node).collect();
                return Some((t, nodes.into_iter().collect()));
            }
            for (s, c) in placed.iter().rev() {
                sim.release(*s, c);
            }
        }
        None
    }
}

/// Re-exported for callers that build views by hand.
pub type NodeList = Vec<NodeId>;

#[cfg(test)]
mod tests {
    use super::*;
    use suanli_model::{
        AllocId, Constraints, Device, DeviceRequest, DeviceShare, JobKind, NodeId, PoolId, ShareIsolation, TaskGroup,
        TaskResources,
    };

    fn node() -> Node {
        Node {
            id: NodeId::new("n0"),
            pool: PoolId::new("p"),
            datacenter: String::new(),
            region: String::new(),
            labels: Default::default(),
            cpu_milli: 8000,
            memory_mib: 8192,
            devices: vec![Device::simple("gpu0", DeviceKind::Gpu, "A100")],
            schedulable: true,
            agent_addr: String::new(),
        }
    }

    fn gpu_job(id: u64, queue: &str, priority: i32) -> PendingJob {
        PendingJob {
            grow: false,
            occupied: Vec::new(),
            id: JobId(id),
            spec: JobSpec {
                name: format!("j{id}"),
                queue: QueueId::new(queue),
                kind: JobKind::Batch,
                priority,
                preemptible: true,
                gang: false,
                groups: vec![TaskGroup {
                    task: None,
                    name: "t".into(),
                    replicas: 1,
                    min_replicas: None,
                    resources: TaskResources {
                        cpu_milli: 1000,
                        memory_mib: 1024,
                        devices: Some(DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: 1000, memory_mib: 0 }),
                    },
                }],
                constraints: Constraints::default(),
                runtime_estimate_s: None,
                checkpoint: None,
                service: None,
            },
            submitted_at: 0,
            nominated: false,
        }
    }

    fn running(queue: &str, priority: i32, borrowed: bool) -> Allocation {
        Allocation {
            id: AllocId(1),
            job: JobId(100),
            group: 0,
            replica: 0,
            epoch: 0,
            node: NodeId::new("n0"),
            queue: QueueId::new(queue),
            priority,
            preemptible: true,
            cpu_milli: 1000,
            memory_mib: 1024,
            devices: vec![DeviceShare { device: "gpu0".into(), milli: 1000, memory_mib: 0 }],
            started_at: 0,
            last_checkpoint_at: None,
            checkpoint_grace_s: None,
            restore_s: 0,
            runtime_estimate_s: None,
            borrowed,
            gang: false,
            elastic: ElasticRole::None,
        }
    }

    fn queue(id: &str, gpus: Option<u64>, cohort: Option<&str>) -> Queue {
        let mut q = Queue::new(id, ResVec { gpu_milli: gpus.map_or(u64::MAX, |g| g * 1000), ..ResVec::MAX });
        q.cohort = cohort.map(str::to_owned);
        q
    }

    fn victims(queues: Vec<Queue>, alloc: Allocation, job: PendingJob) -> Vec<PreemptionReason> {
        let view = ClusterView {
            nodes: vec![node()],
            queues,
            pending: vec![job],
            running: vec![Arc::new(alloc)],
            workload: vec![],
            unschedulable: BTreeMap::new(),
        };
        let plan = schedule(&view, 100, 1, &SchedulerConfig::default()).expect("plan");
        plan.preemptions.iter().map(|p| p.reason).collect()
    }

    #[test]
    fn pending_reasons_name_each_node_state() {
        let mut nodes = Vec::new();
        for (i, schedulable) in [false, false, false, false, true].into_iter().enumerate() {
            nodes.push(Node { id: NodeId::new(format!("n{i}")), schedulable, ..node() });
        }
        let unschedulable: BTreeMap<NodeId, String> = [("n0", "down"), ("n1", "draining"), ("n2", "cordoned")]
            .into_iter()
            .map(|(n, w)| (NodeId::new(n), w.to_owned()))
            .collect();
        let mut job = gpu_job(1, "a", 0);
        job.spec.groups[0].resources.cpu_milli = 1_000_000;
        let view = ClusterView {
            nodes,
            queues: vec![queue("a", None, None)],
            pending: vec![job],
            unschedulable,
            ..Default::default()
        };
        let plan = schedule(&view, 100, 1, &SchedulerConfig::default()).expect("plan");
        let why = &plan.unplaced.first().expect("the job cannot be placed").reason;
        // n3 has no recorded reason: a plain cordon (as traces mark it).
        assert!(why.contains("0/5 nodes fit: 2 cordoned, 1 down, 1 draining, 1 insufficient cpu"), "{why}");
    }

    /// A two-GPU node n0 running a two-GPU victim of queue "a" at priority 0; an urgent job
    /// (1, priority 10) and a peer (2, priority 0, submitted after it), one GPU each.
    fn victim_urgent_and_peer() -> (Node, Allocation, PendingJob, PendingJob) {
        let mut n = node();
        n.devices =
            vec![Device::simple("gpu0", DeviceKind::Gpu, "A100"), Device::simple("gpu1", DeviceKind::Gpu, "A100")];
        let mut victim = running("a", 0, false);
        victim.devices =
            ["gpu0", "gpu1"].iter().map(|d| DeviceShare { device: (*d).into(), milli: 1000, memory_mib: 0 }).collect();
        let mut peer = gpu_job(2, "a", 0);
        peer.submitted_at = 1;
        (n, victim, gpu_job(1, "a", 10), peer)
    }

    /// A victim keeps its devices until it stops: what it frees beyond the job it makes room for
    /// is not placed on in the same pass (apply would refuse it), and the waiting job says why.
    #[test]
    fn what_a_victim_frees_is_not_placed_on_while_it_stops() {
        // The urgent job needs one GPU and preempts the two-GPU victim; the equal-priority job
        // after it cannot preempt, and the other GPU still runs the victim.
        let (n, victim, urgent, peer) = victim_urgent_and_peer();
        let view = |pending: Vec<PendingJob>| ClusterView {
            nodes: vec![n.clone()],
            queues: vec![queue("a", None, None)],
            pending,
            running: vec![Arc::new(victim.clone())],
            ..Default::default()
        };
        for seed in 0..10 {
            let plan = schedule(&view(vec![urgent.clone(), peer.clone()]), 100, seed, &SchedulerConfig::default())
                .expect("plan");
            assert_eq!(plan.preemptions.len(), 1, "{plan:?}");
            assert_eq!(plan.preemptions[0].for_job, JobId(1));
            assert!(plan.placements.is_empty(), "placed on a GPU the victim still runs on: {plan:?}");
            let why = &plan.unplaced.iter().find(|u| u.job == JobId(2)).expect("job 2 waits").reason;
            assert!(why.contains("1 freed by preemption in this pass for another job"), "{why}");
            // A second urgent job that the victim's other GPU would fit preempts nothing more:
            // it waits for the victim to stop, as the peer does.
            let mut second = gpu_job(3, "a", 10);
            second.submitted_at = 2;
            let plan =
                schedule(&view(vec![urgent.clone(), second]), 100, seed, &SchedulerConfig::default()).expect("plan");
            assert_eq!(plan.preemptions.len(), 1, "{plan:?}");
            assert!(plan.placements.is_empty(), "{plan:?}");
            let why = &plan.unplaced.iter().find(|u| u.job == JobId(3)).expect("job 3 waits").reason;
            assert!(why.contains("1 freed by preemption in this pass for another job"), "{why}");
        }
    }

    #[test]
    fn the_quota_a_victim_frees_is_not_placed_in_while_it_stops() {
        // Queue "a" may use two GPUs and runs a two-GPU victim on n0. The urgent job (one
        // GPU) is blocked by the quota, not by capacity (n1 is free), and preempts the victim;
        // the quota it frees beyond the urgent job's GPU is not given to the peer in this pass:
        // the victim counts against the queue until it stops (apply would refuse the peer).
        let (n0, victim, urgent, peer) = victim_urgent_and_peer();
        let n1 = Node { id: NodeId::new("n1"), ..n0.clone() };
        let view = ClusterView {
            nodes: vec![n0, n1],
            queues: vec![queue("a", Some(2), None)],
            pending: vec![urgent, peer],
            running: vec![Arc::new(victim)],
            ..Default::default()
        };
        for seed in 0..10 {
            let plan = schedule(&view, 100, seed, &SchedulerConfig::default()).expect("plan");
            assert_eq!(plan.preemptions.len(), 1, "{plan:?}");
            assert_eq!(plan.preemptions[0].for_job, JobId(1));
            assert!(plan.placements.is_empty(), "placed in the quota the victim still holds: {plan:?}");
            let why = &plan.unplaced.iter().find(|u| u.job == JobId(2)).expect("job 2 waits").reason;
            assert!(why.contains("counting the work preempted in this pass"), "{why}");
        }
    }

    fn nodes(n: usize) -> Vec<Node> {
        (0..n).map(|i| Node { id: NodeId::new(format!("n{i}")), ..node() }).collect()
    }

    fn place(nodes: Vec<Node>, running: Vec<Allocation>, job: PendingJob, seed: u64) -> Plan {
        let view = ClusterView {
            nodes,
            queues: vec![queue("a", None, None)],
            pending: vec![job],
            running: running.into_iter().map(Arc::new).collect(),
            ..Default::default()
        };
        schedule(&view, 100, seed, &SchedulerConfig::default()).expect("plan")
    }

    /// A CPU-only service of `replicas`, spreading or not.
    fn cpu_service(replicas: u32, spread: bool) -> PendingJob {
        let mut j = gpu_job(1, "a", 0);
        j.spec.kind = JobKind::Inference;
        j.spec.groups[0].replicas = replicas;
        j.spec.groups[0].resources.devices = None;
        j.spec.service = Some(suanli_model::ServiceSpec { spread, ..Default::default() });
        j
    }

    fn nodes_of(plan: &Plan) -> Vec<String> {
        plan.placements.iter().map(|p| p.node.0.clone()).collect()
    }

    #[test]
    fn a_service_spreads_across_pools_first() {
        // Pool a: n0, n1; pool b: n2. Three replicas: one in b, then the other node of a.
        let mut ns = nodes(3);
        for n in &mut ns[..2] {
            n.pool = suanli_model::PoolId::new("a");
        }
        ns[2].pool = suanli_model::PoolId::new("b");
        let plan = place(ns.clone(), vec![], cpu_service(2, true), 1);
        let pools: BTreeSet<String> =
            nodes_of(&plan).iter().map(|n| if n == "n2" { "b".into() } else { "a".into() }).collect();
        assert_eq!(pools.len(), 2, "{:?}", nodes_of(&plan));
        let mut three = nodes_of(&place(ns, vec![], cpu_service(3, true), 1));
        three.sort();
        assert_eq!(three, ["n0", "n1", "n2"]);
    }

    #[test]
    fn a_service_spreads_its_replicas_and_packs_when_told_or_when_it_must() {
        // Each node holds all three replicas (8 cores, 1 each).
        let spread = place(nodes(3), vec![], cpu_service(3, true), 1);
        let mut on: Vec<String> = nodes_of(&spread);
        on.sort();
        assert_eq!(on, ["n0", "n1", "n2"]);
        let packed = place(nodes(3), vec![], cpu_service(3, false), 1);
        let distinct: BTreeSet<String> = nodes_of(&packed).into_iter().collect();
        assert!(distinct.len() < 3, "without spread the default packs: {:?}", nodes_of(&packed));
        // Replacements avoid the nodes the running replicas occupy.
        let mut one = cpu_service(1, true);
        one.occupied = vec![NodeId::new("n0"), NodeId::new("n2")];
        assert_eq!(nodes_of(&place(nodes(3), vec![], one, 1)), ["n1"]);
        // One node only: every replica still lands (spread is a preference).
        assert_eq!(nodes_of(&place(nodes(1), vec![], cpu_service(3, true), 1)), ["n0", "n0", "n0"]);
    }

    /// Golden scenario (issue 24): blocks `a` (6 nodes), `b` (8 nodes) and `c` (12 nodes) of
    /// one-GPU nodes, in an order that interleaves the blocks.
    fn blocked_nodes() -> Vec<Node> {
        let mut out = Vec::new();
        for (block, n) in [("a", 6), ("b", 8), ("c", 12)] {
            for i in 0..n {
                let mut node = Node { id: NodeId::new(format!("{block}{i:02}")), ..node() };
                node.labels.insert(crate::cluster::BLOCK_LABEL.into(), block.into());
                node.labels.insert(crate::cluster::RACK_LABEL.into(), format!("{block}-r{}", i / 4));
                out.push(node);
            }
        }
        out.sort_by_key(|n| (n.id.0.as_bytes()[1..].to_vec(), n.id.0.clone()));
        out
    }

    fn gang(replicas: u32, topology: suanli_model::GangTopology) -> PendingJob {
        let mut j = gpu_job(1, "a", 0);
        j.spec.gang = true;
        j.spec.groups[0].replicas = replicas;
        j.spec.constraints.gang_topology = topology;
        j
    }

    fn blocks_of(plan: &Plan) -> BTreeMap<char, usize> {
        let mut m = BTreeMap::new();
        for p in &plan.placements {
            *m.entry(p.node.0.chars().next().unwrap_or('?')).or_default() += 1;
        }
        m
    }

    #[test]
    fn golden_an_eight_node_gang_lands_in_the_one_block_it_fits_best() {
        use suanli_model::GangTopology;
        for seed in 0..20 {
            // 8 fit in b (exactly) and in c; best fit is b.
            let plan = place(blocked_nodes(), vec![], gang(8, GangTopology::Prefer), seed);
            assert_eq!(blocks_of(&plan), BTreeMap::from([('b', 8)]), "seed {seed}");
            // Blind to topology, the same gang spreads over the blocks (the node order
            // interleaves them).
            let view = ClusterView {
                nodes: blocked_nodes(),
                queues: vec![queue("a", None, None)],
                pending: vec![gang(8, GangTopology::Prefer)],
                ..Default::default()
            };
            let cfg = SchedulerConfig { topology_aware: false, ..SchedulerConfig::default() };
            let blind = schedule(&view, 100, seed, &cfg).expect("plan");
            assert_eq!(blind.placements.len(), 8);
            assert!(blocks_of(&blind).len() > 1, "seed {seed}: {:?}", blocks_of(&blind));
        }
    }

    #[test]
    fn golden_a_gang_that_must_span_two_blocks_spans_two_or_says_why_it_waits() {
        use suanli_model::GangTopology;
        // 14 fit in no block (c has 12): preferred, it spans the fewest blocks, two: c then b.
        let plan = place(blocked_nodes(), vec![], gang(14, GangTopology::Prefer), 3);
        assert_eq!(plan.placements.len(), 14);
        assert_eq!(blocks_of(&plan), BTreeMap::from([('b', 2), ('c', 12)]));
        // Required, it waits, and says why.
        let plan = place(blocked_nodes(), vec![], gang(14, GangTopology::RequireBlock), 3);
        assert!(plan.placements.is_empty());
        let why = &plan.unplaced.first().expect("unplaced").reason;
        assert!(why.contains("gang of 14 replicas fits in no single block (3 known"), "{why}");
        // A required block that fits is used whole.
        let plan = place(blocked_nodes(), vec![], gang(12, GangTopology::RequireBlock), 3);
        assert_eq!(blocks_of(&plan), BTreeMap::from([('c', 12)]));
        // Ignore: no topology preference at all.
        let plan = place(blocked_nodes(), vec![], gang(14, GangTopology::Ignore), 3);
        assert_eq!(plan.placements.len(), 14);
        // A constraint on a topology label still selects nodes (labels are not in the class).
        let mut j = gpu_job(1, "a", 0);
        j.spec.constraints.labels.insert(crate::cluster::BLOCK_LABEL.into(), "a".into());
        let plan = place(blocked_nodes(), vec![], j, 3);
        assert!(plan.placements[0].node.0.starts_with('a'), "{:?}", plan.placements);
    }

    #[test]
    fn node_constraints_choose_and_exclude_nodes() {
        for seed in 0..20 {
            let mut job = gpu_job(1, "a", 0);
            job.spec.constraints.nodes = vec![NodeId::new("n2")];
            let plan = place(nodes(4), vec![], job, seed);
            assert_eq!(plan.placements.iter().map(|p| p.node.as_str()).collect::<Vec<_>>(), ["n2"]);

            let mut job = gpu_job(1, "a", 0);
            job.spec.constraints.avoid_nodes = vec![NodeId::new("n0"), NodeId::new("n1"), NodeId::new("n3")];
            let plan = place(nodes(4), vec![], job, seed);
            assert_eq!(plan.placements.iter().map(|p| p.node.as_str()).collect::<Vec<_>>(), ["n2"]);
        }
        // Allowed and avoided at once: nowhere to go, and the reason says why.
        let mut job = gpu_job(1, "a", 0);
        job.spec.constraints.nodes = vec![NodeId::new("n1")];
        job.spec.constraints.avoid_nodes = vec![NodeId::new("n1")];
        let plan = place(nodes(2), vec![], job, 1);
        assert!(plan.placements.is_empty());
        let why = &plan.unplaced.first().expect("unplaced").reason;
        assert!(why.contains("2 excluded by node constraints"), "{why}");
    }

    #[test]
    fn preemption_only_frees_capacity_on_allowed_nodes() {
        // Both nodes are full of low-priority work; the job may only use n1, so only n1's
        // allocation is a victim.
        let run = |i: u64, n: &str| Allocation {
            id: AllocId(i),
            job: JobId(100 + i),
            node: NodeId::new(n),
            ..running("a", 0, false)
        };
        let mut job = gpu_job(1, "a", 10);
        job.spec.constraints.nodes = vec![NodeId::new("n1")];
        let plan = place(nodes(2), vec![run(1, "n0"), run(2, "n1")], job, 3);
        assert_eq!(plan.preemptions.iter().map(|p| p.node.as_str()).collect::<Vec<_>>(), ["n1"]);
    }

    #[test]
    fn device_models_narrow_the_devices() {
        let mut n = node();
        n.devices =
            vec![Device::simple("gpu0", DeviceKind::Gpu, "A100"), Device::simple("gpu1", DeviceKind::Gpu, "H100")];
        for seed in 0..10 {
            let mut job = gpu_job(1, "a", 0);
            job.spec.constraints.device_models = vec!["H100".into()];
            let plan = place(vec![n.clone()], vec![], job, seed);
            assert_eq!(plan.placements[0].devices[0].device, "gpu1");
        }
    }

    /// `constraints.share_isolation = "enforced"` keeps a fractional replica on devices whose
    /// plugin limits shares; whole-device requests and unconstrained shares go anywhere; with no
    /// such device the job waits and says why.
    #[test]
    fn enforced_share_isolation_narrows_shares_only() {
        let mut n = node();
        n.devices =
            vec![Device::simple("gpu0", DeviceKind::Gpu, "A100"), Device::simple("gpu1", DeviceKind::Gpu, "A100")];
        n.devices[1].share_isolation = ShareIsolation::Enforced;
        let share = |isolation| {
            let mut j = gpu_job(1, "a", 0);
            j.spec.groups[0].resources.devices =
                Some(DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: 300, memory_mib: 0 });
            j.spec.constraints.share_isolation = isolation;
            j
        };
        let mut seen = BTreeSet::new();
        for seed in 0..10 {
            let plan = place(vec![n.clone()], vec![], share(ShareIsolation::Enforced), seed);
            assert_eq!(plan.placements[0].devices[0].device, "gpu1");
            seen.insert(
                place(vec![n.clone()], vec![], share(ShareIsolation::Advisory), seed).placements[0].devices[0]
                    .device
                    .clone(),
            );
            // The constraint does not narrow whole devices.
            let mut whole = gpu_job(1, "a", 0);
            whole.spec.constraints.share_isolation = ShareIsolation::Enforced;
            whole.spec.groups[0].resources.devices =
                Some(DeviceRequest { kind: DeviceKind::Gpu, count: 2, milli: 1000, memory_mib: 0 });
            assert_eq!(place(vec![n.clone()], vec![], whole, seed).placements.len(), 1);
        }
        assert!(seen.contains("gpu0"), "an unconstrained share may use the advisory GPU: {seen:?}");
        n.devices[1].share_isolation = ShareIsolation::Advisory;
        let plan = place(vec![n], vec![], share(ShareIsolation::Enforced), 0);
        assert!(plan.placements.is_empty(), "{plan:?}");
        let why = &plan.unplaced[0].reason;
        assert!(why.contains("gpu shares not isolated (constraints.share_isolation = enforced)"), "{why}");
    }

    fn mig_node() -> Node {
        let mut n = node();
        let mut devices = vec![Device::simple("gpu0", DeviceKind::Gpu, "A100")];
        for k in 0..2 {
            let mut d = Device::simple(format!("gpu0-mig{k}"), DeviceKind::Gpu, "A100-3g.40gb");
            d.partition_of = Some("gpu0".into());
            devices.push(d);
        }
        n.devices = devices;
        n
    }

    fn holding(dev: &str, milli: u32) -> Allocation {
        let mut a = running("a", 100, false);
        a.preemptible = false;
        a.devices = vec![DeviceShare { device: dev.into(), milli, memory_mib: 0 }];
        a
    }

    #[test]
    fn a_mig_parent_and_its_partitions_are_never_handed_out_together() {
        for seed in 0..20 {
            // A partition in use: the parent is not free, whole or shared; the other slice is.
            let plan = place(vec![mig_node()], vec![holding("gpu0-mig0", 1000)], gpu_job(1, "a", 0), seed);
            assert_eq!(plan.placements[0].devices[0].device, "gpu0-mig1");
            let mut share = gpu_job(1, "a", 0);
            share.spec.groups[0].resources.devices =
                Some(DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: 300, memory_mib: 0 });
            share.spec.constraints.device_models = vec!["A100".into()];
            let plan = place(vec![mig_node()], vec![holding("gpu0-mig0", 1000)], share.clone(), seed);
            assert!(plan.placements.is_empty(), "{plan:?}");
            // A share of the parent in use: no partition is free.
            let mut slice = gpu_job(1, "a", 0);
            slice.spec.constraints.device_models = vec!["A100-3g.40gb".into()];
            let plan = place(vec![mig_node()], vec![holding("gpu0", 200)], slice, seed);
            assert!(plan.placements.is_empty(), "{plan:?}");
            let why = &plan.unplaced[0].reason;
            assert!(why.contains("insufficient gpu"), "{why}");
            // Two devices at once are whole GPUs only, never a parent with its own slice.
            let mut two = gpu_job(1, "a", 0);
            two.spec.groups[0].resources.devices =
                Some(DeviceRequest { kind: DeviceKind::Gpu, count: 2, milli: 1000, memory_mib: 0 });
            let plan = place(vec![mig_node()], vec![], two, seed);
            assert!(plan.placements.is_empty(), "{plan:?}");
        }
    }

    #[test]
    fn a_mig_gpu_counts_once() {
        let c = Cluster::new(&[mig_node()], &Limits::default(), false, policy::TieBreak::Random).expect("cluster");
        assert_eq!(c.total_gpu_milli(), 1000);
        assert_eq!(c.free_gpu_milli(), 1000);
    }

    #[test]
    fn victim_order_checkpoint_aware_spares_old_unsaved_work() {
        // n0: started long ago, checkpointed just now. n1: started recently, never checkpointed.
        let mut old = Allocation { id: AllocId(1), job: JobId(101), ..running("a", 0, false) };
        old.started_at = 0;
        old.last_checkpoint_at = Some(99_990);
        let mut young =
            Allocation { id: AllocId(2), job: JobId(102), node: NodeId::new("n1"), ..running("a", 0, false) };
        young.started_at = 99_000;
        let view = ClusterView {
            nodes: nodes(2),
            queues: vec![queue("a", None, None)],
            pending: vec![gpu_job(1, "a", 10)],
            running: vec![Arc::new(old), Arc::new(young)],
            ..Default::default()
        };
        let victim = |order| {
            let cfg = SchedulerConfig { victim_order: order, ..SchedulerConfig::default() };
            let plan = schedule(&view, 100_000, 1, &cfg).expect("plan");
            plan.preemptions.iter().map(|p| p.alloc).collect::<Vec<_>>()
        };
        assert_eq!(victim(VictimOrder::CheckpointAware), [AllocId(1)]);
        assert_eq!(victim(VictimOrder::YoungestFirst), [AllocId(2)]);
        assert_eq!(VictimOrder::parse("youngest-first"), Some(VictimOrder::YoungestFirst));
        assert_eq!(VictimOrder::parse("oldest"), None);
    }

    #[test]
    fn another_queues_guaranteed_work_is_not_preempted_for_priority() {
        // Team A runs inside its nominal quota: B's higher priority does not override it.
        let qs = vec![queue("a", Some(1), None), queue("b", None, None)];
        assert_eq!(victims(qs, running("a", 0, false), gpu_job(1, "b", 10)), vec![]);
        // Without a quota (unlimited queue) there is no guarantee: priority applies.
        let qs = vec![queue("a", None, None), queue("b", None, None)];
        assert_eq!(victims(qs, running("a", 0, false), gpu_job(1, "b", 10)), vec![PreemptionReason::HigherPriority]);
        // Inside one queue, priority applies.
        let qs = vec![queue("a", Some(1), None)];
        assert_eq!(victims(qs, running("a", 0, false), gpu_job(1, "a", 10)), vec![PreemptionReason::HigherPriority]);
    }

    #[test]
    fn borrowed_work_is_reclaimed_only_inside_its_cohort() {
        // The lender reclaims at equal priority.
        let qs = vec![queue("lend", Some(1), Some("c")), queue("borrow", Some(0), Some("c"))];
        assert_eq!(
            victims(qs, running("borrow", 0, true), gpu_job(1, "lend", 0)),
            vec![PreemptionReason::ReclaimBorrowed]
        );
        // A queue outside the cohort cannot reclaim what it never lent.
        let qs =
            vec![queue("lend", Some(1), Some("c")), queue("borrow", Some(0), Some("c")), queue("other", Some(1), None)];
        assert_eq!(victims(qs, running("borrow", 0, true), gpu_job(1, "other", 0)), vec![]);
    }
}
