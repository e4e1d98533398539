//! Applying a plan: every placement and preemption is re-checked against the state at this
//! log index, and only the parts that still hold are committed (Nomad's plan_apply).
//!
//! ```text
//!  preemptions ─▶ victim live, running as asked, preemptible, beneficiary still pending,
//!                 and outranked (priority) or reclaimable (borrowed)  ─▶ ask the job to stop
//!  placements by job ─▶ job pending, out of backoff, no live allocation
//!                    ─▶ each replica: node ready and schedulable, constraints (pools,
//!                       regions, labels, nodes, avoid_nodes), CPU/memory fit, each device
//!                       share exists, right kind and model, healthy, fits, and no MIG
//!                       partition shares its physical GPU with a used parent (or vice versa)
//!                    ─▶ gang: all replicas; elastic: ≥ min per group ─▶ quota admits it
//!                    ─▶ commit allocations (epoch = attempt + 1)   else: refuse the job
//! ```

use crate::command::{ApplyPlan, CommandError, PlanOutcome, Response};
use crate::records::{Alloc, AllocState, Desired, JobState, StopReason};
use crate::refusal::RefusalReason as R;
use crate::state::{Applied, Effect, State, cut};
use crate::usage::Usage;
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{
    AllocId, Allocation, DeviceKind, Health, JobId, Placement, Preemption, PreemptionReason, ResVec, WHOLE_DEVICE_MILLI,
};
use suanli_scheduler::quota::QuotaBook;

/// The device of `node` that shares a physical GPU with `device` and is in use (by `used`) or
/// asked for in the same placement (`asked`): its MIG parent, or one of its MIG partitions.
pub(crate) fn mig_conflict(
    node: &suanli_model::Node,
    device: &str,
    asked: &BTreeSet<&str>,
    used: impl Fn(&str) -> bool,
) -> Option<String> {
    let busy = |x: &str| x != device && (used(x) || asked.contains(x));
    let d = node.devices.iter().find(|d| d.id == device)?;
    if let Some(parent) = d.partition_of.as_deref()
        && node.devices.iter().any(|x| x.id == parent)
        && busy(parent)
    {
        return Some(parent.to_owned());
    }
    node.devices
        .iter()
        .filter(|x| x.partition_of.as_deref() == Some(device))
        .find(|x| busy(&x.id))
        .map(|x| x.id.clone())
}

impl State {
    pub(crate) fn apply_plan(&mut self, c: ApplyPlan, rev: u64) -> Applied {
        let plan = c.plan;
        let limit = self.config.max_plan_entries;
        for (what, n) in [
            ("plan.placements", plan.placements.len()),
            ("plan.preemptions", plan.preemptions.len()),
            ("plan.unplaced", plan.unplaced.len()),
        ] {
            if n > limit {
                return Err(CommandError::TooMany { what: what.into(), limit });
            }
        }
        let now = self.tick(c.now);
        let mut out = PlanOutcome::default();

        for p in &plan.preemptions {
            match self.check_preemption(p) {
                Ok(()) => {
                    self.preempt(p, now, rev);
                    out.preempted.push(p.alloc);
                }
                Err(why) => out.refused_preemptions.push((p.alloc, why)),
            }
        }

        let mut by_job: BTreeMap<JobId, Vec<&Placement>> = BTreeMap::new();
        for p in &plan.placements {
            by_job.entry(p.job).or_default().push(p);
        }
        // The live index's usage is the working copy: a placement that holds stays reserved in
        // it (it is now a live allocation), one that does not is taken out again.
        let mut usage = std::mem::take(&mut self.live.usage);
        let victim = self.double_assign_victim().and_then(|id| self.allocs.get(&id)).map(|a| a.alloc.clone());
        if let Some(v) = &victim {
            usage.add(&v.node, 0, 0, &v.devices, -1);
        }
        let mut quota = QuotaBook::new(&self.queues.values().cloned().collect::<Vec<_>>());
        for (q, (_, v)) in &self.live.queues {
            quota.charge(q, *v);
        }
        let mut live_allocs = self.live.count;
        for (job, ps) in by_job {
            // A running service's placements fill its missing replicas, named by position.
            let filled = self.service_fill(job, &ps);
            let ps: Vec<&Placement> = match &filled {
                Some(Ok(mapped)) => mapped.iter().collect(),
                Some(Err(refusal)) => {
                    out.refused_jobs.push((job, refusal.clone()));
                    continue;
                }
                None => ps,
            };
            match self.check_job_placements(job, &ps, &mut usage, &mut quota, now, live_allocs) {
                Ok(borrowed) => {
                    live_allocs += ps.len();
                    let ids = self.commit_placements(job, &ps, borrowed, now, rev);
                    out.placed.extend(ids);
                }
                Err(refusal) => {
                    let why = cut(&refusal.to_string(), self.config.max_message_len);
                    if let Some(j) = self.jobs.get_mut(&job)
                        && j.state == JobState::Pending
                        && j.reason != why
                    {
                        j.reason = why.clone();
                        j.revision = rev;
                    }
                    out.refused_jobs.push((job, refusal));
                }
            }
        }

        if let Some(v) = &victim {
            usage.add(&v.node, 0, 0, &v.devices, 1);
        }
        self.live.usage = usage;

        let max = self.config.max_message_len;
        for u in &plan.unplaced {
            let service = self.jobs.get(&u.job).is_some_and(|j| self.adds_replicas_to(j));
            let elastic = self.jobs.get(&u.job).filter(|j| service && j.spec.is_elastic()).map(|j| {
                let wanted: u32 = j.spec.groups.iter().map(|g| g.replicas).sum();
                format!(
                    "{} of {wanted} replicas run; the others wait for idle capacity: {}",
                    self.world_size(j),
                    u.reason
                )
            });
            let why = match elastic {
                Some(text) => cut(&text, max),
                None if service => cut(&format!("replicas missing: {}", u.reason), max),
                None => cut(&u.reason, max),
            };
            if let Some(j) = self.jobs.get_mut(&u.job)
                && (j.state == JobState::Pending || service)
                && j.reason != why
            {
                j.reason = why;
                j.revision = rev;
            }
        }
        Ok((Response::PlanApplied(out), Effect::Changed))
    }

    fn check_preemption(&self, p: &Preemption) -> Result<(), R> {
        let a = self.allocs.get(&p.alloc).ok_or(R::AllocGone { alloc: p.alloc })?;
        if !a.is_live() {
            return Err(R::AllocEnded { alloc: p.alloc });
        }
        if a.desired != Desired::Run {
            return Err(R::AllocStopping { alloc: p.alloc });
        }
        if a.alloc.job != p.job || a.alloc.node != p.node {
            return Err(R::AllocMismatch { alloc: p.alloc, job: a.alloc.job, node: a.alloc.node.clone() });
        }
        if !a.alloc.preemptible {
            return Err(R::NotPreemptible { alloc: p.alloc });
        }
        let f = self.jobs.get(&p.for_job).ok_or(R::JobGone { job: p.for_job })?;
        // A running service preempts for its missing replicas as a pending job does (it
        // gets no hold: its priority puts it first when the capacity frees up).
        if f.state != JobState::Pending && !self.adds_replicas_to(f) {
            return Err(R::BeneficiaryNotPending { job: p.for_job });
        }
        let outranked = a.alloc.priority < f.spec.priority;
        let reclaimable = a.alloc.borrowed && a.alloc.queue != f.spec.queue;
        let ok = match p.reason {
            PreemptionReason::HigherPriority => outranked,
            PreemptionReason::ReclaimBorrowed => reclaimable || outranked,
        };
        if !ok {
            return Err(R::NotOutranked {
                alloc: p.alloc,
                priority: a.alloc.priority,
                borrowed: a.alloc.borrowed,
                for_job: p.for_job,
                for_priority: f.spec.priority,
            });
        }
        Ok(())
    }

    /// The victim's whole attempt stops (with a checkpoint first when it supports one), and
    /// the job is requeued once every allocation has ended.
    ///
    /// An elastic job's surplus replica is the exception: it alone stops and the job shrinks
    /// ([`State::shrink_elastic`]).
    fn preempt(&mut self, p: &Preemption, now: u64, rev: u64) {
        let reason = StopReason::Preempted { for_job: p.for_job };
        if self.shrink_elastic(p.alloc, reason.clone(), now, rev) {
            return;
        }
        let Some(job) = self.jobs.get_mut(&p.job) else {
            return;
        };
        let all = job.allocs.clone();
        if matches!(job.state, JobState::Placed | JobState::Running) {
            job.state = JobState::Preempted;
            job.reason = format!("preempted for job {}", p.for_job);
            job.updated_at = now;
            job.revision = rev;
        }
        self.ask_stop(p.alloc, reason.clone(), now);
        for a in all {
            self.ask_stop(a, reason.clone(), now);
        }
    }

    /// Re-checks one job's placements, reserving their resources in `usage` and `quota` when
    /// they hold. Returns whether the job runs on borrowed quota.
    fn check_job_placements(
        &self,
        job: JobId,
        ps: &[&Placement],
        usage: &mut Usage,
        quota: &mut QuotaBook,
        now: u64,
        live_allocs: usize,
    ) -> Result<bool, R> {
        let j = self.jobs.get(&job).ok_or(R::JobGone { job })?;
        let adds = self.adds_replicas_to(j);
        if j.state != JobState::Pending && !adds {
            return Err(R::JobNotPending { job, state: j.state.as_str().into() });
        }
        if j.not_before > now {
            return Err(R::InBackoff { job, until: j.not_before });
        }
        if !adds && j.allocs.iter().any(|a| self.allocs.get(a).is_some_and(Alloc::is_live)) {
            return Err(R::StillLive { job });
        }
        if live_allocs.saturating_add(ps.len()) > self.config.max_live_allocs {
            return Err(R::TooManyLiveAllocs { limit: self.config.max_live_allocs });
        }
        let spec = &j.spec;
        let mut seen: BTreeSet<(u32, u32)> = BTreeSet::new();
        let mut per_group: BTreeMap<u32, u32> = BTreeMap::new();
        let mut reserved: Vec<&Placement> = Vec::new();
        let mut total = ResVec::ZERO;
        let result = (|| {
            for p in ps {
                let g = spec.groups.get(p.group as usize).ok_or(R::NoSuchGroup { job, group: p.group })?;
                if p.replica >= g.replicas {
                    return Err(R::ReplicaOutOfRange {
                        group: g.name.clone(),
                        replicas: g.replicas,
                        replica: p.replica,
                    });
                }
                if !seen.insert((p.group, p.replica)) {
                    return Err(R::ReplicaTwice { group: g.name.clone(), replica: p.replica });
                }
                let v = self.check_placement(p, usage, j)?;
                usage.add(&p.node, p.cpu_milli, p.memory_mib, &p.devices, 1);
                reserved.push(p);
                total += v;
                *per_group.entry(p.group).or_default() += 1;
            }
            for (gi, g) in spec.groups.iter().enumerate().filter(|_| !adds) {
                let n = per_group.get(&(gi as u32)).copied().unwrap_or(0);
                let need = if spec.gang { g.replicas } else { g.min() };
                if n < need {
                    return Err(R::GroupShort { group: g.name.clone(), fit: n, need });
                }
            }
            quota.check(&spec.queue, total).map(|a| a.borrowed).map_err(R::from)
        })();
        match result {
            Ok(borrowed) => {
                quota.charge(&spec.queue, total);
                Ok(borrowed)
            }
            Err(e) => {
                for p in reserved {
                    usage.add(&p.node, p.cpu_milli, p.memory_mib, &p.devices, -1);
                }
                Err(e)
            }
        }
    }

    /// Checks one replica against the node as it is now; returns its quota vector.
    fn check_placement(&self, p: &Placement, usage: &Usage, j: &crate::records::Job) -> Result<ResVec, R> {
        let spec = &j.spec;
        let g = spec.groups.get(p.group as usize).ok_or(R::NoSuchGroup { job: j.id, group: p.group })?;
        let node_id = || p.node.clone();
        let rec = self.nodes.get(&p.node).ok_or_else(|| R::NodeGone { node: node_id() })?;
        if !rec.accepts_work() {
            if !rec.pressure.is_empty() {
                return Err(R::NodePressure { node: node_id(), pressure: rec.pressure.clone() });
            }
            return Err(R::NodeNotAccepting { node: node_id(), status: rec.status, mode: rec.mode });
        }
        let node = &rec.node;
        let c = &spec.constraints;
        if !c.pools.is_empty() && !c.pools.contains(&node.pool) {
            return Err(R::OutsidePools { node: node_id(), pool: node.pool.to_string() });
        }
        if !c.regions.is_empty() && !c.regions.contains(&node.region) {
            return Err(R::OutsideRegions { node: node_id(), region: node.region.clone() });
        }
        if let Some((k, v)) = c.labels.iter().find(|(k, v)| node.labels.get(*k) != Some(*v)) {
            return Err(R::MissingLabel { node: node_id(), key: k.clone(), value: v.clone() });
        }
        if !c.nodes.is_empty() && !c.nodes.contains(&p.node) {
            return Err(R::NodeNotAllowed { node: node_id() });
        }
        if c.avoid_nodes.contains(&p.node) {
            return Err(R::NodeAvoided { node: node_id() });
        }
        let r = &g.resources;
        if p.cpu_milli < r.cpu_milli || p.memory_mib < r.memory_mib {
            return Err(R::ReservesLess { node: node_id() });
        }
        let u = usage.node(&p.node);
        if u.cpu_milli.saturating_add(p.cpu_milli) > node.cpu_milli {
            return Err(R::CpuFull {
                node: node_id(),
                used: u.cpu_milli,
                asked: p.cpu_milli,
                capacity: node.cpu_milli,
            });
        }
        if u.memory_mib.saturating_add(p.memory_mib) > node.memory_mib {
            return Err(R::MemoryFull {
                node: node_id(),
                used: u.memory_mib,
                asked: p.memory_mib,
                capacity: node.memory_mib,
            });
        }
        let mut v = ResVec { cpu_milli: p.cpu_milli, memory_mib: p.memory_mib, ..ResVec::ZERO };
        match &r.devices {
            None if !p.devices.is_empty() => {
                return Err(R::UnexpectedDevices { group: g.name.clone() });
            }
            None => {}
            Some(req) => {
                if p.devices.len() != req.count as usize {
                    return Err(R::DeviceCount { group: g.name.clone(), asked: req.count, held: p.devices.len() });
                }
                let mut ids = BTreeSet::new();
                for s in &p.devices {
                    if !ids.insert(s.device.as_str()) {
                        return Err(R::DeviceTwice { device: s.device.clone() });
                    }
                    let d = node
                        .devices
                        .iter()
                        .find(|d| d.id == s.device)
                        .ok_or_else(|| R::NoSuchDevice { node: node_id(), device: s.device.clone() })?;
                    if d.kind != req.kind {
                        return Err(R::WrongKind {
                            device: d.id.clone(),
                            node: node_id(),
                            found: d.kind,
                            asked: req.kind,
                        });
                    }
                    if d.health != Health::Healthy {
                        return Err(R::UnhealthyDevice { device: d.id.clone(), node: node_id() });
                    }
                    if !c.device_models.is_empty() && !c.device_models.contains(&d.model) {
                        return Err(R::ModelNotAllowed {
                            device: d.id.clone(),
                            node: node_id(),
                            model: d.model.clone(),
                        });
                    }
                    if s.milli != req.milli || s.milli == 0 || s.milli > WHOLE_DEVICE_MILLI {
                        return Err(R::ShareMismatch { device: d.id.clone(), milli: s.milli, asked: req.milli });
                    }
                    if s.memory_mib < req.memory_mib {
                        return Err(R::MemorySliceShort {
                            device: d.id.clone(),
                            slice: s.memory_mib,
                            asked: req.memory_mib,
                        });
                    }
                    let du = usage.device(&p.node, &d.id);
                    if du.milli + u64::from(s.milli) > u64::from(WHOLE_DEVICE_MILLI) {
                        return Err(R::DeviceFull {
                            device: d.id.clone(),
                            node: node_id(),
                            used: du.milli,
                            asked: s.milli,
                        });
                    }
                    if d.memory_mib > 0 && du.memory_mib.saturating_add(s.memory_mib) > d.memory_mib {
                        return Err(R::DeviceMemoryFull {
                            device: d.id.clone(),
                            node: node_id(),
                            used: du.memory_mib,
                            asked: s.memory_mib,
                            capacity: d.memory_mib,
                        });
                    }
                    if let Some(other) = mig_conflict(node, &d.id, &ids, |x| usage.device(&p.node, x).milli > 0) {
                        return Err(R::MigConflict { device: d.id.clone(), node: node_id(), other });
                    }
                    match d.kind {
                        DeviceKind::Gpu => v.gpu_milli += u64::from(s.milli),
                        DeviceKind::Npu => v.npu_milli += u64::from(s.milli),
                    }
                }
            }
        }
        Ok(v)
    }

    /// For a running service or elastic job, its placements with their (group, replica) taken from the
    /// engine's view of it ([`State::missing_replicas`]: group 0 of the view is the first
    /// group lacking replicas, replica `i` its `i`-th missing one); `None` for other jobs.
    fn service_fill(&self, job: JobId, ps: &[&Placement]) -> Option<Result<Vec<Placement>, R>> {
        let j = self.jobs.get(&job).filter(|j| self.adds_replicas_to(j))?;
        let Some((gi, missing)) = self.missing_replicas(j) else {
            return Some(Err(R::StillLive { job }));
        };
        let name = j.spec.groups.get(gi as usize).map(|g| g.name.clone()).unwrap_or_default();
        let mut out = Vec::with_capacity(ps.len());
        for p in ps {
            let Some(&replica) = missing.get(p.replica as usize).filter(|_| p.group == 0) else {
                return Some(Err(R::ReplicaOutOfRange {
                    group: name,
                    replicas: u32::try_from(missing.len()).unwrap_or(u32::MAX),
                    replica: p.replica,
                }));
            };
            out.push(Placement { group: gi, replica, ..(*p).clone() });
        }
        Some(Ok(out))
    }

    fn commit_placements(&mut self, job: JobId, ps: &[&Placement], borrowed: bool, now: u64, rev: u64) -> Vec<AllocId> {
        let adds = self.jobs.get(&job).is_some_and(|j| self.adds_replicas_to(j));
        let Some(j) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        if !adds {
            j.attempt += 1;
            j.state = JobState::Placed;
        }
        j.first_placed_at.get_or_insert(now);
        self.live.pending.remove(&job);
        j.reason.clear();
        j.updated_at = now;
        j.revision = rev;
        let epoch = j.attempt;
        let version = j.version;
        let spec = j.spec.clone();
        let mut ids = Vec::with_capacity(ps.len());
        for p in ps {
            let id = AllocId(self.next_alloc);
            self.next_alloc += 1;
            ids.push(id);
            let alloc = Allocation {
                id,
                job,
                group: p.group,
                replica: p.replica,
                epoch,
                node: p.node.clone(),
                queue: spec.queue.clone(),
                priority: spec.priority,
                preemptible: spec.preemptible,
                cpu_milli: p.cpu_milli,
                memory_mib: p.memory_mib,
                devices: p.devices.clone(),
                started_at: now,
                last_checkpoint_at: None,
                checkpoint_grace_s: spec.checkpoint.map(|c| c.grace_s),
                restore_s: spec.checkpoint.map_or(0, |c| c.restore_s),
                runtime_estimate_s: spec.runtime_estimate_s,
                borrowed: borrowed || p.borrowed,
                gang: spec.gang,
                elastic: suanli_model::ElasticRole::None,
            };
            let rec = Alloc {
                alloc: std::sync::Arc::new(alloc),
                state: AllocState::Pending,
                desired: Desired::Run,
                updated_at: now,
                message: String::new(),
                end: None,
                exit_code: None,
                lost_device_s: 0,
                restored_step: None,
                ready: false,
                endpoint: String::new(),
                version,
                load: None,
                latency_us: None,
                success_ppm: None,
            };
            // Node and device usage was reserved by the re-check.
            self.live.account(&rec, &self.nodes, 1);
            self.live.retain(&rec);
            self.allocs.insert(id, rec);
            self.cost_open(id);
        }
        if let Some(j) = self.jobs.get_mut(&job) {
            if adds {
                j.allocs.extend(ids.iter().copied());
            } else {
                j.allocs = ids.clone();
            }
        }
        // An elastic job grew: its tasks learn the new membership.
        if adds && let Some(size) = self.jobs.get(&job).filter(|j| j.spec.is_elastic()).map(|j| self.world_size(j)) {
            let max = self.config.max_message_len;
            if let Some(j) = self.jobs.get_mut(&job) {
                j.world_gen = j.world_gen.saturating_add(1);
                j.reason = cut(&format!("grew to {size} replicas"), max);
            }
        }
        ids
    }
}
