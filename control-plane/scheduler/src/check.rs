//! The plan checkers: what a plan from [`schedule`](crate::schedule) must satisfy, recomputed
//! from the view alone.
//!
//! ```text
//!  ClusterView + Plan ─▶ capacity   (a) no node or device over-committed by the placements (a
//!                                       victim holds its share until it stops); no unhealthy
//!                                       device, cordoned node or unmet constraint
//!                     ─▶ quota      (b) over nominal only through placements flagged borrowed,
//!                                       within borrowing limits and parent caps (a victim
//!                                       counts until it stops)
//!                     ─▶ gangs      (c) gang all-or-nothing, elastic at least its minimum,
//!                                       every considered job decided exactly once
//!                     ─▶ preemptions(d) only preemptible, outranked or reclaimable work, whole
//!                                       gangs, checkpoint first, only where it helps the job
//!                     ─▶ backfill       nothing long and lower-priority on a reserved node
//! ```
//!
//! No checker calls engine internals (clusters, classes, the quota book): each recomputes what
//! it needs from the inputs, so an engine bug cannot hide in a shared helper. `schedule()`
//! `debug_assert!`s [`plan`] on its own result; the property tests
//! (`tests/properties.rs`) run each checker on random inputs and prove each one able to fail.
//!
//! Checks are about what the plan adds: a node or a queue already over its limit before the
//! pass (a capacity that shrank, a quota that was lowered) only fails a check when the plan
//! places more there.

use crate::engine::{ClusterView, PendingJob, SchedulerConfig};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use suanli_model::{
    AllocId, Allocation, DeviceKind, DeviceShare, Health, JobId, JobSpec, Node, NodeId, Placement, Plan, Preemption,
    PreemptionReason, Queue, QueueId, ResVec, WHOLE_DEVICE_MILLI,
};
use thiserror::Error;

/// The guarantee a plan broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Property {
    /// (a) node and device capacity, health, cordons, requests and constraints.
    Capacity,
    /// (b) nominal quotas, borrowing limits and parent caps.
    Quota,
    /// (c) gang all-or-nothing, elastic minimums, every job decided once.
    Gang,
    /// (d) who may be preempted, and how.
    Preemption,
    /// Backfill behind a reservation.
    Backfill,
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Property::Capacity => "(a) capacity",
            Property::Quota => "(b) quota",
            Property::Gang => "(c) gang",
            Property::Preemption => "(d) preemption",
            Property::Backfill => "backfill",
        })
    }
}

/// A plan that breaks one of the engine's guarantees: which one, and where.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{property}: {message}")]
pub struct PlanViolation {
    /// The guarantee broken.
    pub property: Property,
    /// What broke it: the job, node, queue or allocation, and the numbers.
    pub message: String,
}

/// The result of one check.
pub type Check = Result<(), PlanViolation>;

macro_rules! ensure {
    ($prop:expr, $cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(PlanViolation { property: $prop, message: format!($($arg)+) });
        }
    };
}

macro_rules! fail {
    ($prop:expr, $($arg:tt)+) => {
        return Err(PlanViolation { property: $prop, message: format!($($arg)+) })
    };
}

/// Runs every checker on a plan that `schedule(view, now, _, cfg)` returned.
pub fn plan(view: &ClusterView, plan: &Plan, now: u64, cfg: &SchedulerConfig) -> Check {
    let inp = Inputs::new(view);
    capacity(&inp, plan)?;
    quota(&inp, plan)?;
    gangs(&inp, plan, cfg.max_jobs_per_pass)?;
    preemptions(&inp, plan, cfg)?;
    backfill(&inp, plan, now)
}

/// Device kinds by node, then device id.
type Kinds<'a> = BTreeMap<&'a str, BTreeMap<&'a str, DeviceKind>>;

fn usage(kinds: &Kinds<'_>, node: &NodeId, cpu: u64, mem: u64, shares: &[DeviceShare]) -> ResVec {
    let mut v = ResVec { cpu_milli: cpu, memory_mib: mem, ..ResVec::ZERO };
    for s in shares {
        match kinds.get(node.as_str()).and_then(|d| d.get(s.device.as_str())) {
            Some(DeviceKind::Npu) => v.npu_milli += u64::from(s.milli),
            _ => v.gpu_milli += u64::from(s.milli),
        }
    }
    v
}

/// Minimum resources a job needs (every replica of a gang, `min` of each elastic group).
fn min_need(spec: &JobSpec) -> ResVec {
    let mut v = ResVec::ZERO;
    for g in &spec.groups {
        let n = if spec.gang { g.replicas } else { g.min_replicas.unwrap_or(g.replicas).min(g.replicas) };
        let d = g.resources.as_resvec().dims();
        v = v.saturating_add(&ResVec::from_dims(std::array::from_fn(|i| d[i].saturating_mul(u64::from(n)))));
    }
    v
}

/// The view indexed for the checkers.
pub struct Inputs<'a> {
    view: &'a ClusterView,
    nodes: BTreeMap<&'a NodeId, &'a Node>,
    pending: BTreeMap<JobId, &'a PendingJob>,
    running: BTreeMap<AllocId, &'a Allocation>,
    queues: BTreeMap<&'a QueueId, &'a Queue>,
    kinds: Kinds<'a>,
}

impl<'a> Inputs<'a> {
    /// Indexes nodes, pending jobs, running allocations, queues and device kinds.
    pub fn new(view: &'a ClusterView) -> Self {
        Self {
            view,
            nodes: view.nodes.iter().map(|n| (&n.id, n)).collect(),
            pending: view.pending.iter().map(|p| (p.id, p)).collect(),
            running: view.running.iter().map(|a| (a.id, &**a)).collect(),
            queues: view.queues.iter().map(|q| (&q.id, q)).collect(),
            kinds: view
                .nodes
                .iter()
                .map(|n| (n.id.as_str(), n.devices.iter().map(|d| (d.id.as_str(), d.kind)).collect()))
                .collect(),
        }
    }

    fn alloc_usage(&self, a: &Allocation) -> ResVec {
        usage(&self.kinds, &a.node, a.cpu_milli, a.memory_mib, &a.devices)
    }

    fn placement_usage(&self, p: &Placement) -> ResVec {
        usage(&self.kinds, &p.node, p.cpu_milli, p.memory_mib, &p.devices)
    }

    /// Running allocations that the plan does not preempt.
    fn surviving<'s>(&'s self, victims: &'s BTreeSet<AllocId>) -> impl Iterator<Item = &'a Allocation> + 's {
        self.view.running.iter().map(|a| &**a).filter(move |a| !victims.contains(&a.id))
    }

    /// The queue's ancestors, nearest first (a cycle or a missing parent ends the walk).
    fn ancestors(&self, q: &QueueId) -> Vec<&'a Queue> {
        let mut out: Vec<&Queue> = Vec::new();
        let mut cur = self.queues.get(q).and_then(|x| x.parent.as_ref());
        while let Some(p) = cur {
            let Some(pq) = self.queues.get(p) else { break };
            if out.iter().any(|o| o.id == pq.id) {
                break;
            }
            out.push(pq);
            cur = pq.parent.as_ref();
        }
        out
    }
}

fn victims(plan: &Plan) -> BTreeSet<AllocId> {
    plan.preemptions.iter().map(|p| p.alloc).collect()
}

/// (a) capacity, health, cordon, request and constraint conformance: on every node and device
/// that receives placements, the placements fit in what the running work leaves — including
/// work this plan preempts, which keeps its devices until it has stopped (apply refuses a
/// placement on them; the job the victims make room for is placed in a later pass).
pub fn capacity(inp: &Inputs<'_>, plan: &Plan) -> Check {
    const P: Property = Property::Capacity;
    // What the plan adds, per node (cpu, memory) and per device (milli, memory).
    let mut node_add: BTreeMap<&NodeId, (u64, u64)> = BTreeMap::new();
    let mut dev_add: BTreeMap<(&NodeId, &str), (u64, u64)> = BTreeMap::new();
    for p in &plan.placements {
        let Some(node) = inp.nodes.get(&p.node) else {
            fail!(P, "job {} placed on unknown node {}", p.job, p.node);
        };
        ensure!(P, node.schedulable, "job {} placed on cordoned node {}", p.job, p.node);
        let Some(job) = inp.pending.get(&p.job) else {
            fail!(P, "placement for job {} that is not pending", p.job);
        };
        let Some(g) = job.spec.groups.get(p.group as usize) else {
            fail!(P, "job {} placed in group {}, which it does not have", p.job, p.group);
        };
        let r = &g.resources;
        ensure!(
            P,
            p.cpu_milli == r.cpu_milli && p.memory_mib == r.memory_mib,
            "job {} on {}: cpu_milli {} memory_mib {} do not match the request ({} and {})",
            p.job,
            p.node,
            p.cpu_milli,
            p.memory_mib,
            r.cpu_milli,
            r.memory_mib
        );
        let c = &job.spec.constraints;
        ensure!(
            P,
            c.pools.is_empty() || c.pools.contains(&node.pool),
            "job {} on {} outside pools {:?}",
            p.job,
            p.node,
            c.pools
        );
        ensure!(
            P,
            c.regions.is_empty() || c.regions.contains(&node.region),
            "job {} on {} outside regions {:?}",
            p.job,
            p.node,
            c.regions
        );
        ensure!(
            P,
            c.labels.iter().all(|(k, v)| node.labels.get(k) == Some(v)),
            "job {} on {} lacks labels {:?}",
            p.job,
            p.node,
            c.labels
        );
        ensure!(
            P,
            c.nodes.is_empty() || c.nodes.contains(&p.node),
            "job {} on {} outside node constraints {:?}",
            p.job,
            p.node,
            c.nodes
        );
        ensure!(P, !c.avoid_nodes.contains(&p.node), "job {} on {}, which it must avoid", p.job, p.node);
        match &r.devices {
            None => ensure!(P, p.devices.is_empty(), "CPU-only job {} got devices {:?}", p.job, p.devices),
            Some(req) => {
                ensure!(
                    P,
                    p.devices.len() == req.count as usize,
                    "job {} wants {} devices, got {:?}",
                    p.job,
                    req.count,
                    p.devices
                );
                let ids: BTreeSet<&str> = p.devices.iter().map(|s| s.device.as_str()).collect();
                ensure!(P, ids.len() == p.devices.len(), "job {} got one device twice: {:?}", p.job, p.devices);
                for s in &p.devices {
                    let Some(d) = node.devices.iter().find(|d| d.id == s.device) else {
                        fail!(P, "job {} on unknown device {}/{}", p.job, p.node, s.device);
                    };
                    ensure!(
                        P,
                        d.health == Health::Healthy,
                        "job {} placed on unhealthy device {}/{}",
                        p.job,
                        p.node,
                        d.id
                    );
                    ensure!(
                        P,
                        d.kind == req.kind,
                        "job {} wants {} but got {}/{} ({})",
                        p.job,
                        req.kind,
                        p.node,
                        d.id,
                        d.kind
                    );
                    ensure!(
                        P,
                        c.device_models.is_empty() || c.device_models.contains(&d.model),
                        "job {} got model {} outside {:?}",
                        p.job,
                        d.model,
                        c.device_models
                    );
                    ensure!(
                        P,
                        req.milli >= suanli_model::WHOLE_DEVICE_MILLI || c.share_isolation <= d.share_isolation,
                        "job {} needs {} share isolation and got {}/{} ({})",
                        p.job,
                        c.share_isolation,
                        p.node,
                        d.id,
                        d.share_isolation
                    );
                    ensure!(
                        P,
                        s.milli == req.milli && s.memory_mib == req.memory_mib,
                        "job {} share {s:?} does not match request {req:?}",
                        p.job
                    );
                    let e = dev_add.entry((&p.node, s.device.as_str())).or_default();
                    e.0 += u64::from(s.milli);
                    e.1 += s.memory_mib;
                }
            }
        }
        let e = node_add.entry(&p.node).or_default();
        e.0 += p.cpu_milli;
        e.1 += p.memory_mib;
    }
    if node_add.is_empty() {
        return Ok(());
    }
    // What running work (victims of this plan included) holds on the nodes that receive
    // placements.
    let mut node_used: BTreeMap<&NodeId, (u64, u64)> = BTreeMap::new();
    let mut dev_used: BTreeMap<(&NodeId, &str), (u64, u64)> = BTreeMap::new();
    for a in inp.view.running.iter().filter(|a| node_add.contains_key(&a.node)) {
        let e = node_used.entry(&a.node).or_default();
        e.0 += a.cpu_milli;
        e.1 += a.memory_mib;
        for s in &a.devices {
            let e = dev_used.entry((&a.node, s.device.as_str())).or_default();
            e.0 += u64::from(s.milli);
            e.1 += s.memory_mib;
        }
    }
    for (id, (cpu, mem)) in &node_add {
        let Some(n) = inp.nodes.get(id) else { continue };
        let (used_cpu, used_mem) = node_used.get(id).copied().unwrap_or_default();
        let free_cpu = n.cpu_milli.saturating_sub(used_cpu);
        let free_mem = n.memory_mib.saturating_sub(used_mem);
        ensure!(P, *cpu <= free_cpu, "node {id}: placements take cpu_milli {cpu}, {free_cpu} free of {}", n.cpu_milli);
        ensure!(
            P,
            *mem <= free_mem,
            "node {id}: placements take memory_mib {mem}, {free_mem} free of {}",
            n.memory_mib
        );
    }
    for ((node, d), (milli, dmem)) in &dev_add {
        let cap = inp.nodes.get(node).and_then(|n| n.devices.iter().find(|x| x.id == *d)).map_or(0, |x| x.memory_mib);
        let (used_milli, used_mem) = dev_used.get(&(*node, *d)).copied().unwrap_or_default();
        let free_milli = u64::from(WHOLE_DEVICE_MILLI).saturating_sub(used_milli);
        let free_mem = cap.saturating_sub(used_mem);
        ensure!(P, *milli <= free_milli, "device {node}/{d}: placements take {milli} milli, {free_milli} free");
        ensure!(P, *dmem <= free_mem, "device {node}/{d}: placements take {dmem} MiB, {free_mem} free of {cap}");
    }
    // MIG: a physical device and its partitions are never in use at once.
    let used = |node: &NodeId, d: &str| {
        dev_add.get(&(node, d)).is_some_and(|u| u.0 > 0) || dev_used.get(&(node, d)).is_some_and(|u| u.0 > 0)
    };
    for id in node_add.keys() {
        let Some(n) = inp.nodes.get(id) else { continue };
        for d in &n.devices {
            let Some(parent) = d.partition_of.as_deref() else { continue };
            if n.devices.iter().any(|x| x.id == parent && x.id != d.id) {
                ensure!(
                    P,
                    !(used(id, &d.id) && used(id, parent)),
                    "node {id}: MIG partition {} and its parent {parent} both in use",
                    d.id
                );
            }
        }
    }
    Ok(())
}

/// (b) quota: over nominal only through placements flagged borrowed, within borrowing limits;
/// no cohort, no borrowing; parent caps hold for every subtree that receives placements. Work
/// this plan preempts still counts against its queues until it has stopped (apply counts it):
/// the quota it frees goes to a later pass, as its devices do.
pub fn quota(inp: &Inputs<'_>, plan: &Plan) -> Check {
    const P: Property = Property::Quota;
    if plan.placements.is_empty() {
        return Ok(());
    }
    let mut kept: BTreeMap<&QueueId, ResVec> = BTreeMap::new();
    for a in inp.view.running.iter() {
        let e = kept.entry(&a.queue).or_insert(ResVec::ZERO);
        *e = e.saturating_add(&inp.alloc_usage(a));
    }
    let mut own: BTreeMap<&QueueId, ResVec> = BTreeMap::new();
    let mut all: BTreeMap<&QueueId, ResVec> = BTreeMap::new();
    for p in &plan.placements {
        let Some(job) = inp.pending.get(&p.job) else {
            fail!(P, "placement for unknown job {}", p.job);
        };
        let q = &job.spec.queue;
        let Some(queue) = inp.queues.get(q) else {
            fail!(P, "job {} placed from unknown queue {q}", p.job);
        };
        let u = inp.placement_usage(p);
        let e = all.entry(q).or_insert(ResVec::ZERO);
        *e = e.saturating_add(&u);
        if p.borrowed {
            let may_borrow = queue.cohort.is_some() || inp.ancestors(q).iter().any(|a| !a.nominal.is_zero());
            ensure!(
                P,
                may_borrow,
                "job {} flagged borrowed in queue {q}, which has no cohort or parent to borrow from",
                p.job
            );
        } else {
            let e = own.entry(q).or_insert(ResVec::ZERO);
            *e = e.saturating_add(&u);
        }
    }
    for (q, placed) in &all {
        let Some(queue) = inp.queues.get(q) else { continue };
        let base = kept.get(q).copied().unwrap_or(ResVec::ZERO);
        if let Some(o) = own.get(q) {
            let unflagged = base.saturating_add(o);
            ensure!(
                P,
                unflagged.fits_within(&queue.nominal),
                "queue {q}: running {base} + placements not flagged borrowed = {unflagged} exceeds nominal {}",
                queue.nominal
            );
        }
        let total = base.saturating_add(placed);
        match (&queue.cohort, &queue.borrowing_limit) {
            (None, _) => ensure!(
                P,
                total.fits_within(&queue.nominal),
                "queue {q} has no cohort but uses {total} > nominal {}",
                queue.nominal
            ),
            (Some(_), Some(limit)) => ensure!(
                P,
                total.saturating_sub(&queue.nominal).fits_within(limit),
                "queue {q} borrows {} > borrowing limit {limit}",
                total.saturating_sub(&queue.nominal)
            ),
            (Some(_), None) => {}
        }
    }
    // Parent caps: a subtree that received placements stays within nominal + borrowing limit.
    for parent in inp.view.queues.iter().filter(|q| !q.nominal.is_zero()) {
        let in_subtree = |q: &QueueId| inp.ancestors(q).iter().any(|a| a.id == parent.id);
        if !all.keys().any(|q| in_subtree(q)) {
            continue;
        }
        let mut used = ResVec::ZERO;
        for a in inp.view.running.iter().filter(|a| in_subtree(&a.queue)) {
            used = used.saturating_add(&inp.alloc_usage(a));
        }
        for (q, u) in &all {
            if in_subtree(q) {
                used = used.saturating_add(u);
            }
        }
        let cap = parent.nominal.saturating_add(&parent.borrowing_limit.unwrap_or(ResVec::ZERO));
        ensure!(P, used.fits_within(&cap), "parent queue {}: subtree uses {used} > cap {cap}", parent.id);
    }
    Ok(())
}

/// (c) gang all-or-nothing, elastic at least min, replicas well-formed, and every pending job
/// decided at most once; all of them when the pass could consider them all
/// (`max_jobs_per_pass`).
pub fn gangs(inp: &Inputs<'_>, plan: &Plan, max_jobs_per_pass: usize) -> Check {
    const P: Property = Property::Gang;
    let mut placed: BTreeMap<JobId, BTreeMap<u32, BTreeSet<u32>>> = BTreeMap::new();
    for p in &plan.placements {
        let fresh = placed.entry(p.job).or_default().entry(p.group).or_default().insert(p.replica);
        ensure!(P, fresh, "job {} group {} replica {} placed twice", p.job, p.group, p.replica);
    }
    for (job, groups) in &placed {
        let Some(pj) = inp.pending.get(job) else {
            fail!(P, "job {job} placed but not pending");
        };
        let spec = &pj.spec;
        ensure!(
            P,
            groups.keys().all(|&g| (g as usize) < spec.groups.len()),
            "job {job}: placement in a group it does not have"
        );
        for (gi, g) in spec.groups.iter().enumerate() {
            let empty = BTreeSet::new();
            let reps = groups.get(&(gi as u32)).unwrap_or(&empty);
            ensure!(
                P,
                reps.iter().all(|&r| r < g.replicas),
                "job {job} group {gi}: replica index beyond {}: {reps:?}",
                g.replicas
            );
            let n = reps.len() as u32;
            if spec.gang {
                ensure!(P, n == g.replicas, "gang job {job} group {gi}: {n} of {} replicas placed", g.replicas);
            } else {
                let min = g.min_replicas.unwrap_or(g.replicas).min(g.replicas);
                ensure!(P, n >= min, "elastic job {job} group {gi}: {n} replicas placed, min {min}");
            }
        }
    }
    let mut unplaced = BTreeSet::new();
    for u in &plan.unplaced {
        ensure!(P, unplaced.insert(u.job), "job {} unplaced twice", u.job);
        ensure!(P, !placed.contains_key(&u.job), "job {} both placed and unplaced", u.job);
        ensure!(P, !u.reason.is_empty(), "job {} unplaced without a reason", u.job);
        ensure!(P, inp.pending.contains_key(&u.job), "job {} unplaced but not pending", u.job);
    }
    if inp.pending.len() <= max_jobs_per_pass {
        for id in inp.pending.keys() {
            ensure!(
                P,
                placed.contains_key(id) || unplaced.contains(id),
                "pending job {id} neither placed nor unplaced"
            );
        }
    }
    Ok(())
}

/// (d) who may be preempted, and how.
pub fn preemptions(inp: &Inputs<'_>, plan: &Plan, cfg: &SchedulerConfig) -> Check {
    const P: Property = Property::Preemption;
    if plan.preemptions.is_empty() {
        return Ok(());
    }
    ensure!(P, cfg.preemption, "preemption disabled but the plan preempts {:?}", plan.preemptions);
    let victims = victims(plan);
    ensure!(P, victims.len() == plan.preemptions.len(), "an allocation preempted twice: {:?}", plan.preemptions);
    let placed: BTreeSet<JobId> = plan.placements.iter().map(|p| p.job).collect();
    let unplaced: BTreeSet<JobId> = plan.unplaced.iter().map(|u| u.job).collect();
    let mut per_job: BTreeMap<JobId, usize> = BTreeMap::new();
    for Preemption { alloc, job, node, for_job, reason, checkpoint_first, grace_s } in &plan.preemptions {
        let Some(a) = inp.running.get(alloc) else {
            fail!(P, "preempted alloc {alloc} is not running");
        };
        let Some(f) = inp.pending.get(for_job) else {
            fail!(P, "alloc {alloc} preempted for unknown job {for_job}");
        };
        ensure!(
            P,
            a.job == *job && a.node == *node,
            "preemption of {alloc} names job {job} on {node}, alloc is job {} on {}",
            a.job,
            a.node
        );
        ensure!(P, a.preemptible, "non-preemptible alloc {alloc} preempted for job {for_job}");
        ensure!(P, !f.grow, "alloc {alloc} preempted for job {for_job}'s elastic growth (idle capacity only)");
        let lower = a.priority < f.spec.priority;
        let reclaim = a.borrowed && a.queue != f.spec.queue;
        ensure!(
            P,
            lower || reclaim,
            "alloc {alloc} (priority {}, queue {}, borrowed {}) preempted for job {for_job} (priority {}, queue {})",
            a.priority,
            a.queue,
            a.borrowed,
            f.spec.priority,
            f.spec.queue
        );
        let want = if lower { PreemptionReason::HigherPriority } else { PreemptionReason::ReclaimBorrowed };
        ensure!(P, *reason == want, "alloc {alloc}: reason {reason:?}, expected {want:?}");
        if !lower {
            // Reclaiming is for a job within its own nominal quota.
            let q = &f.spec.queue;
            let used = inp
                .surviving(&victims)
                .filter(|x| &x.queue == q)
                .fold(ResVec::ZERO, |acc, x| acc.saturating_add(&inp.alloc_usage(x)));
            let nominal = inp.queues.get(q).map_or(ResVec::ZERO, |x| x.nominal);
            let need = min_need(&f.spec);
            ensure!(
                P,
                used.saturating_add(&need).fits_within(&nominal),
                "job {for_job} reclaims borrowed alloc {alloc} but needs {need} on top of {used}, over nominal {nominal}"
            );
        }
        ensure!(
            P,
            *checkpoint_first == a.checkpoint_grace_s.is_some() && *grace_s == a.checkpoint_grace_s.unwrap_or(0),
            "alloc {alloc}: checkpoint_first {checkpoint_first} grace {grace_s}, victim's grace {:?}",
            a.checkpoint_grace_s
        );
        if a.gang {
            for mate in inp.view.running.iter().filter(|m| m.job == a.job) {
                ensure!(P, victims.contains(&mate.id), "gang job {} partly preempted: {} kept", a.job, mate.id);
            }
        }
        // A victim frees capacity only where the job could run. Exceptions: a gang's mates stop
        // with it wherever they are, and borrowed work under a capped ancestor of the job's
        // queue may be reclaimed to free quota rather than capacity.
        let frees_quota = reclaim
            && inp.ancestors(&f.spec.queue).iter().any(|anc| {
                !anc.nominal.is_zero() && (anc.id == a.queue || inp.ancestors(&a.queue).iter().any(|x| x.id == anc.id))
            });
        if !a.gang && !frees_quota {
            let n = inp.nodes.get(&a.node).copied();
            ensure!(
                P,
                n.is_some_and(|n| usable_by(n, &f.spec)),
                "alloc {alloc} on {} preempted for job {for_job}, which cannot use that node",
                a.node
            );
        }
        ensure!(P, !placed.contains(for_job), "job {for_job} placed in the same pass that preempts for it");
        ensure!(P, unplaced.contains(for_job), "job {for_job} preempts but is not listed as waiting");
        *per_job.entry(*for_job).or_default() += 1;
    }
    for (j, n) in per_job {
        ensure!(P, n <= cfg.max_preemptions_per_job, "job {j} preempts {n} > max {}", cfg.max_preemptions_per_job);
        // Preempting is only worth it when the job's quota admits it once the victims are gone:
        // its own nominal (no cohort) or borrowing limit, and every capped ancestor.
        let (Some(f), Some(queue)) =
            (inp.pending.get(&j), inp.pending.get(&j).and_then(|f| inp.queues.get(&f.spec.queue)))
        else {
            fail!(P, "job {j} preempts but is not pending in a known queue");
        };
        let q = &f.spec.queue;
        let need = min_need(&f.spec);
        let usage_of = |pred: &dyn Fn(&QueueId) -> bool| {
            inp.surviving(&victims)
                .filter(|a| pred(&a.queue))
                .fold(need, |acc, a| acc.saturating_add(&inp.alloc_usage(a)))
        };
        let own = usage_of(&|x| x == q);
        match (&queue.cohort, &queue.borrowing_limit) {
            (None, _) => ensure!(
                P,
                own.fits_within(&queue.nominal),
                "job {j} preempts but needs {own} > nominal {} of {q}",
                queue.nominal
            ),
            (Some(_), Some(l)) => ensure!(
                P,
                own.saturating_sub(&queue.nominal).fits_within(l),
                "job {j} preempts but would borrow {} beyond {q}'s limit {l}",
                own.saturating_sub(&queue.nominal)
            ),
            (Some(_), None) => {}
        }
        for anc in inp.ancestors(q).into_iter().filter(|a| !a.nominal.is_zero()) {
            let sub_use = usage_of(&|x| x == &anc.id || inp.ancestors(x).iter().any(|y| y.id == anc.id));
            let cap = anc.nominal.saturating_add(&anc.borrowing_limit.unwrap_or(ResVec::ZERO));
            ensure!(
                P,
                sub_use.fits_within(&cap),
                "job {j} preempts but parent {} stays over its cap: {sub_use} > {cap}",
                anc.id
            );
        }
    }
    Ok(())
}

/// Whether a node could host some task of the job at all (ignoring what runs there).
pub fn usable_by(n: &Node, spec: &JobSpec) -> bool {
    let c = &spec.constraints;
    let placeable = n.schedulable
        && (c.pools.is_empty() || c.pools.contains(&n.pool))
        && (c.regions.is_empty() || c.regions.contains(&n.region))
        && c.labels.iter().all(|(k, v)| n.labels.get(k) == Some(v))
        && (c.nodes.is_empty() || c.nodes.contains(&n.id))
        && !c.avoid_nodes.contains(&n.id);
    placeable
        && spec.groups.iter().any(|g| match &g.resources.devices {
            None => true,
            Some(req) => {
                let ok = n
                    .devices
                    .iter()
                    .filter(|d| d.kind == req.kind && d.health == Health::Healthy)
                    .filter(|d| c.device_models.is_empty() || c.device_models.contains(&d.model))
                    .count();
                ok >= req.count as usize
            }
        })
}

/// Backfill: a lower-priority job placed on a reserved node after the reservation was made
/// ends before the reservation starts.
pub fn backfill(inp: &Inputs<'_>, plan: &Plan, now: u64) -> Check {
    const P: Property = Property::Backfill;
    for r in &plan.reservations {
        let Some(head) = inp.pending.get(&r.job) else {
            fail!(P, "reservation for unknown job {}", r.job);
        };
        ensure!(P, plan.unplaced.iter().any(|u| u.job == r.job), "reserved job {} is not waiting", r.job);
        ensure!(P, r.start_at >= now, "reservation for job {} starts in the past ({})", r.job, r.start_at);
        let reserved: BTreeSet<&NodeId> = r.nodes.iter().collect();
        for p in plan.placements.iter().filter(|p| reserved.contains(&p.node)) {
            let Some(j) = inp.pending.get(&p.job) else {
                continue;
            };
            // A nominated job is considered before every other job of the pass, so it was placed
            // before a head job that is not nominated could reserve anything.
            if j.spec.priority >= head.spec.priority || (j.nominated && !head.nominated) {
                continue;
            }
            let ends = j.spec.runtime_estimate_s.map(|e| now.saturating_add(e));
            ensure!(
                P,
                ends.is_some_and(|e| e <= r.start_at),
                "job {} (priority {}, ends {ends:?}) placed on {} reserved for job {} from t={}",
                p.job,
                j.spec.priority,
                p.node,
                r.job,
                r.start_at
            );
        }
    }
    Ok(())
}
