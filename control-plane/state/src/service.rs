//! Services in the state machine (docs/services.md): replicas replaced one by one, rolling
//! updates of a service's spec, and scaling by a new `replicas`.
//!
//! ```text
//!  update_service ─▶ spec := new, version += 1 (the old spec kept while its replicas live)
//!        │
//!        ▼ advance_rollout (after the update, each readiness report and each replica end)
//!  per group, N = replicas:
//!    replicas at index ≥ N ─────────────────────────────▶ stop (scale-down)
//!    old-version replicas, not ready ───────────────────▶ stop
//!    old-version replicas, ready, while ready − 1 ≥ N − max_unavailable ▶ stop
//!  missing_replicas (what the scheduling pass offers):
//!    index < N with no live current-version replica: those with no live replica at all,
//!    then those whose old replica still runs while live < N + max_surge
//! ```

use crate::command::{CommandError, Response, UpdateService};
use crate::records::{Alloc, AllocState, Desired, EndClass, Job, JobState, MAX_LIVE_VERSIONS, StopReason};
use crate::state::{Applied, Effect, State, cut};
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{AllocId, JobId, JobSpec, NodeId};
use suanli_scheduler::PendingJob;

impl Job {
    /// The spec that an allocation of spec version `version` runs: the current one, or an
    /// earlier one kept while its replicas live ([`Job::old_specs`]).
    pub fn spec_for(&self, version: u32) -> &JobSpec {
        if version == self.version { &self.spec } else { self.old_specs.get(&version).unwrap_or(&self.spec) }
    }
}

impl State {
    /// Replaces a service's spec ([`UpdateService`]): the new spec must keep the queue and
    /// the task groups (by name, in order) and stay a service. A pending service takes it as
    /// it is; a running one replaces its replicas by a rolling update.
    pub(crate) fn update_service(&mut self, c: UpdateService, rev: u64) -> Applied {
        let job = self.jobs.get(&c.job).ok_or(CommandError::UnknownJob { job: c.job.0 })?;
        let conflict = |field: &str, message: String| CommandError::Conflict { field: field.into(), message };
        let invalid = |field: &str, message: String| CommandError::Invalid { field: field.into(), message };
        if !job.spec.is_service() {
            return Err(conflict("job", format!("job {} is not a service (kind = \"inference\" or [service])", c.job)));
        }
        if job.state.is_terminal() {
            return Err(conflict("job", format!("job {} is {}", c.job, job.state.as_str())));
        }
        c.spec.validate(&self.config.limits)?;
        if !c.spec.is_service() {
            return Err(invalid(
                "spec.kind",
                "the new spec must be a service too (kind = \"inference\" or [service])".into(),
            ));
        }
        if c.spec.queue != job.spec.queue {
            return Err(invalid(
                "spec.queue",
                format!("a service keeps its queue ({}); submit a new job to move it", job.spec.queue),
            ));
        }
        let names = |s: &JobSpec| s.groups.iter().map(|g| g.name.clone()).collect::<Vec<_>>();
        if names(&c.spec) != names(&job.spec) {
            return Err(invalid(
                "spec.groups",
                format!("a service keeps its task groups ({}), by name and in order", names(&job.spec).join(", ")),
            ));
        }
        if c.spec == job.spec {
            return Ok((Response::Done, Effect::Unchanged));
        }
        let running = matches!(job.state, JobState::Placed | JobState::Running);
        // Every version with live replicas is an old one once this update commits.
        let live_versions: BTreeSet<u32> = self.live_allocs(job).map(|a| a.version).collect();
        if running && live_versions.len() > MAX_LIVE_VERSIONS {
            return Err(conflict(
                "job",
                format!(
                    "job {} still runs replicas of {} spec versions (at most {MAX_LIVE_VERSIONS} may run at once); wait for the rolling update to go on",
                    c.job,
                    live_versions.len()
                ),
            ));
        }
        // Only `replicas` (or `min_replicas`) changed: a scale, not a new version.
        let scale = {
            let mut same = c.spec.clone();
            for (g, o) in same.groups.iter_mut().zip(&job.spec.groups) {
                g.replicas = o.replicas;
                g.min_replicas = o.min_replicas;
            }
            same == job.spec
        };
        let now = self.tick(c.now);
        let max = self.config.max_message_len;
        let Some(j) = self.jobs.get_mut(&c.job) else {
            return Err(CommandError::UnknownJob { job: c.job.0 });
        };
        let old = std::mem::replace(&mut j.spec, c.spec);
        let wanted: u32 = j.spec.groups.iter().map(|g| g.replicas).sum();
        let had: u32 = old.groups.iter().map(|g| g.replicas).sum();
        if running && wanted > had {
            // Scale-out time runs from the first scale-up not yet served.
            let since = j.scale_out.map_or(now, |(t, _)| t);
            j.scale_out = Some((since, wanted));
        } else if wanted < had {
            j.scale_out = None;
        }
        if scale {
            j.reason = cut(&format!("scaled to {wanted} replicas"), max);
        } else {
            if running {
                j.old_specs.insert(j.version, old);
            }
            j.version = j.version.saturating_add(1);
            // A new version starts without the old one's restart backoff.
            j.restart_streak = 0;
            if running {
                j.not_before = j.not_before.min(now);
            }
            j.reason = cut(&format!("updated to version {}", j.version), max);
        }
        j.updated_at = now;
        j.revision = rev;
        self.advance_rollout(c.job, now, rev);
        Ok((Response::Done, Effect::Changed))
    }

    /// After a readiness report: a scale-up is served once its replicas are all ready.
    pub(crate) fn note_scale_out(&mut self, id: JobId, now: u64) {
        let Some(j) = self.jobs.get(&id) else {
            return;
        };
        let Some((since, target)) = j.scale_out else {
            return;
        };
        let ready = self.live_allocs(j).filter(|a| a.ready && a.desired == Desired::Run).count();
        if ready < target as usize {
            return;
        }
        if let Some(j) = self.jobs.get_mut(&id) {
            j.scale_out = None;
            j.scale_outs.push(now.saturating_sub(since));
            let over = j.scale_outs.len().saturating_sub(crate::records::MAX_SCALE_OUTS);
            j.scale_outs.drain(..over);
        }
    }

    fn live_allocs<'a>(&'a self, j: &'a Job) -> impl Iterator<Item = &'a Alloc> + 'a {
        j.allocs.iter().filter_map(|a| self.allocs.get(a)).filter(|a| a.is_live())
    }

    /// Moves a running service's rolling update (or scale-down) along: stops the replicas
    /// beyond each group's `replicas`, and the old-version ones as far as `max_unavailable`
    /// allows; forgets the old specs no replica runs any more; says how far it got.
    pub(crate) fn advance_rollout(&mut self, id: JobId, now: u64, rev: u64) {
        let Some(j) = self.jobs.get(&id) else {
            return;
        };
        if !j.spec.is_service() || !matches!(j.state, JobState::Placed | JobState::Running) {
            return;
        }
        let strategy = j.spec.service().map(|s| s.update).unwrap_or_default();
        let mut stop: Vec<AllocId> = Vec::new();
        for (gi, g) in j.spec.groups.iter().enumerate() {
            let n = g.replicas;
            let live: Vec<&Alloc> = self.live_allocs(j).filter(|a| a.alloc.group == gi as u32).collect();
            let running = |a: &&&Alloc| a.desired == Desired::Run;
            // Scale-down: replicas beyond `replicas`, whatever their version.
            stop.extend(live.iter().filter(running).filter(|a| a.alloc.replica >= n).map(|a| a.alloc.id));
            let mut ready = live.iter().filter(running).filter(|a| a.ready && a.alloc.replica < n).count();
            let new_ready: BTreeSet<u32> =
                live.iter().filter(|a| a.version == j.version && a.ready).map(|a| a.alloc.replica).collect();
            let mut old: Vec<&&Alloc> =
                live.iter().filter(running).filter(|a| a.version != j.version && a.alloc.replica < n).collect();
            // Not ready first (stopping them costs no availability), then those whose
            // replacement is ready, then by replica.
            old.sort_by_key(|a| (a.ready, !new_ready.contains(&a.alloc.replica), a.alloc.replica));
            let floor = n.saturating_sub(strategy.max_unavailable) as usize;
            for a in old {
                if a.ready {
                    if ready <= floor {
                        break;
                    }
                    ready -= 1;
                }
                stop.push(a.alloc.id);
            }
        }
        for aid in stop {
            self.ask_stop(aid, StopReason::Update, now);
        }
        let Some(j) = self.jobs.get(&id) else {
            return;
        };
        let live_versions: BTreeSet<u32> = self.live_allocs(j).map(|a| a.version).collect();
        let wanted: u32 = j.spec.groups.iter().map(|g| g.replicas).sum();
        let updated = self.live_allocs(j).filter(|a| a.version == j.version && a.desired == Desired::Run).count();
        let max = self.config.max_message_len;
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let before = j.old_specs.len();
        j.old_specs.retain(|v, _| live_versions.contains(v));
        let rolling = !j.old_specs.is_empty();
        if rolling {
            j.reason =
                cut(&format!("rolling update to version {}: {updated} of {wanted} replicas updated", j.version), max);
        } else if before > 0 {
            j.reason = cut(&format!("updated to version {}", j.version), max);
        }
        j.updated_at = now;
        j.revision = rev;
    }

    /// A service replica ended (docs/services.md): the others keep serving, and this one is
    /// replaced by the next scheduling pass after the restart backoff. The backoff grows only
    /// for ends of the replica's own doing (an exit, an out-of-memory kill, a failed start,
    /// a failed liveness check); a drained node, a lost node or a failed device replaces it at
    /// once. A replica a rolling update or a scale-down stopped is not replaced (or, for an
    /// update, already was).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn replace_replica(
        &mut self,
        id: JobId,
        aid: AllocId,
        ended: AllocState,
        class: EndClass,
        stop_requested: bool,
        message: &str,
        now: u64,
        rev: u64,
    ) {
        let max = self.config.max_message_len;
        let Some(a) = self.allocs.get(&aid) else {
            return;
        };
        let (group, replica) = (a.alloc.group, a.alloc.replica);
        let superseded = matches!(a.desired, Desired::Stop { reason: StopReason::Update, .. });
        self.retire_allocs(id, &[aid]);
        if superseded {
            self.advance_rollout(id, now, rev);
            return;
        }
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let task = match j.spec.groups.get(group as usize) {
            Some(g) => format!("{}-{replica}", g.name),
            None => format!("{group}-{replica}"),
        };
        j.restarts = j.restarts.saturating_add(1);
        let by_itself = !stop_requested && !class.is_infrastructure();
        let wait = if by_itself {
            j.restart_streak = j.restart_streak.saturating_add(1);
            j.spec.service().map_or(0, |s| s.backoff_s(j.restart_streak))
        } else {
            0
        };
        j.not_before = j.not_before.max(now.saturating_add(wait));
        let word = match ended {
            AllocState::Lost => "was lost",
            AllocState::Succeeded => "exited 0",
            AllocState::Failed => class.as_str(),
            _ => "stopped",
        };
        j.reason = cut(&format!("replica {task} {word}: {message}; replaced after {wait} s"), max);
        j.updated_at = now;
        j.revision = rev;
        // An old-version replica that ended is replaced by the current version: the update
        // may go on.
        self.advance_rollout(id, now, rev);
    }

    /// The replicas a running service lacks: the first task group (by index) with replicas
    /// of its current version to place, and those replica indices in order. An index with no
    /// live replica at all comes first; one whose old-version replica still runs only while
    /// the group's live replicas stay within `replicas + max_surge`. A scheduling pass offers
    /// them as one pending request ([`State::cluster_view`]); a plan's placements for the
    /// service name them by position ([`crate::plan`]).
    pub fn missing_replicas(&self, j: &Job) -> Option<(u32, Vec<u32>)> {
        let surge = j.spec.service().map(|s| s.update.max_surge).unwrap_or_default();
        let mut live: BTreeMap<u32, Vec<(u32, u32)>> = BTreeMap::new();
        for a in self.live_allocs(j) {
            live.entry(a.alloc.group).or_default().push((a.alloc.replica, a.version));
        }
        j.spec.groups.iter().enumerate().find_map(|(gi, g)| {
            let gi = gi as u32;
            let here = live.get(&gi).map(Vec::as_slice).unwrap_or_default();
            let current = |r: u32| here.contains(&(r, j.version));
            let any = |r: u32| here.iter().any(|(x, _)| *x == r);
            let plain: Vec<u32> = (0..g.replicas).filter(|r| !any(*r)).collect();
            let room = (g.replicas.saturating_add(surge) as usize).saturating_sub(here.len() + plain.len());
            let surged = (0..g.replicas).filter(|r| any(*r) && !current(*r)).take(room);
            let mut missing: Vec<u32> = plain.iter().copied().chain(surged).collect();
            missing.sort_unstable();
            (!missing.is_empty()).then_some((gi, missing))
        })
    }

    /// How the engine sees a running service's or elastic job's missing replicas at `now`
    /// (none while a service is in its restart backoff): the job with one group, the missing
    /// replicas of the first group lacking any, of which at least one must fit. An elastic
    /// job's request is growth ([`PendingJob::grow`]: idle capacity only).
    pub(crate) fn service_view(&self, j: &Job, now: u64) -> Option<PendingJob> {
        if !self.adds_replicas_to(j) || j.not_before > now {
            return None;
        }
        let (gi, missing) = self.missing_replicas(j)?;
        let mut g = j.spec.groups.get(gi as usize)?.clone();
        g.replicas = u32::try_from(missing.len()).ok()?;
        g.min_replicas = Some(1);
        let mut spec = j.spec.clone();
        spec.groups = vec![g];
        spec.constraints = self.effective_constraints(j, now);
        // Spread (`service.spread`): the nodes its group's live replicas run on.
        let occupied: BTreeSet<NodeId> =
            self.live_allocs(j).filter(|a| a.alloc.group == gi).map(|a| a.alloc.node.clone()).collect();
        Some(PendingJob {
            grow: j.spec.is_elastic(),
            id: j.id,
            spec,
            submitted_at: j.submitted_at,
            nominated: false,
            occupied: occupied.into_iter().collect(),
        })
    }

    /// True when a plan may add replicas to `j` while it runs: a placed or running service,
    /// or a placed or running elastic job none of whose replicas has ended (one that finished
    /// means the work is finishing: nothing is added back).
    pub(crate) fn adds_replicas_to(&self, j: &Job) -> bool {
        if !matches!(j.state, JobState::Placed | JobState::Running) {
            return false;
        }
        j.spec.is_service()
            || (j.spec.is_elastic() && j.allocs.iter().all(|a| self.allocs.get(a).is_some_and(Alloc::is_live)))
    }

    /// An elastic job's allocations that are surplus now: per group, the live replicas asked
    /// to run beyond its `min_replicas`, the most recently started ones (then the highest
    /// replica index). Empty for other jobs and for an elastic job that is stopping.
    pub fn elastic_surplus(&self, j: &Job) -> BTreeSet<AllocId> {
        let mut out = BTreeSet::new();
        if !j.spec.is_elastic() || !matches!(j.state, JobState::Placed | JobState::Running) {
            return out;
        }
        for (gi, g) in j.spec.groups.iter().enumerate() {
            let mut run: Vec<&Alloc> =
                self.live_allocs(j).filter(|a| a.alloc.group == gi as u32 && a.desired == Desired::Run).collect();
            run.sort_by_key(|a| (a.alloc.started_at, a.alloc.replica));
            out.extend(run.iter().skip(g.min() as usize).map(|a| a.alloc.id));
        }
        out
    }

    /// How many replicas of `j` run or start now and are not asked to stop (its world size,
    /// `$SUANLI_WORLD_SIZE`). For work that is not elastic, its spec's replicas.
    pub fn world_size(&self, j: &Job) -> u32 {
        if !j.spec.is_elastic() {
            return j.spec.groups.iter().map(|g| g.replicas).sum();
        }
        let n = self.live_allocs(j).filter(|a| a.desired == Desired::Run).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// An elastic job's replica `aid` stops without stopping the job (docs/job-spec.md,
    /// "Elastic jobs"): when it is surplus ([`State::elastic_surplus`]), it alone is asked
    /// to stop (checkpoint first, for the reasons that save one), the job's membership
    /// generation moves on, and `true` is returned; otherwise nothing changes.
    pub(crate) fn shrink_elastic(&mut self, aid: AllocId, reason: StopReason, now: u64, rev: u64) -> bool {
        let Some(id) = self.allocs.get(&aid).map(|a| a.alloc.job) else {
            return false;
        };
        let Some(j) = self.jobs.get(&id) else {
            return false;
        };
        if !self.elastic_surplus(j).contains(&aid) {
            return false;
        }
        let why = crate::state::stop_text(&reason);
        self.ask_stop(aid, reason, now);
        let size = self.jobs.get(&id).map_or(0, |j| self.world_size(j));
        let max = self.config.max_message_len;
        if let Some(j) = self.jobs.get_mut(&id) {
            j.world_gen = j.world_gen.saturating_add(1);
            j.reason = cut(&format!("shrinking to {size} replicas: a replica {why}"), max);
            j.updated_at = now;
            j.revision = rev;
        }
        true
    }

    /// After an elastic job's replica ended: when it was shrunk away (asked to stop for a
    /// preemption, a drain or a failed device), or was lost to the infrastructure while its
    /// group keeps its minimum, it leaves the job, which keeps running with the others, and
    /// `true` is returned. Otherwise (an exit of its own, or the minimum is gone) `false`:
    /// the caller stops the whole attempt as for any job.
    pub(crate) fn elastic_replica_ended(
        &mut self,
        id: JobId,
        aid: AllocId,
        class: EndClass,
        message: &str,
        now: u64,
        rev: u64,
    ) -> bool {
        let Some(j) = self.jobs.get(&id) else {
            return false;
        };
        if !j.spec.is_elastic() || !matches!(j.state, JobState::Placed | JobState::Running) {
            return false;
        }
        let Some(a) = self.allocs.get(&aid) else {
            return false;
        };
        let (group, replica) = (a.alloc.group, a.alloc.replica);
        let shrunk = matches!(
            a.desired,
            Desired::Stop {
                reason: StopReason::Preempted { .. } | StopReason::Drain | StopReason::DeviceUnhealthy,
                ..
            }
        );
        let Some(g) = j.spec.groups.get(group as usize) else {
            return false;
        };
        let others = self
            .live_allocs(j)
            .filter(|x| x.alloc.id != aid && x.alloc.group == group && x.desired == Desired::Run)
            .count();
        let lost_but_enough = a.desired == Desired::Run && class.is_infrastructure() && others >= g.min() as usize;
        if !shrunk && !lost_but_enough {
            return false;
        }
        let task = format!("{}-{replica}", g.name);
        self.retire_allocs(id, &[aid]);
        let size = self.jobs.get(&id).map_or(0, |j| self.world_size(j));
        let max = self.config.max_message_len;
        if let Some(j) = self.jobs.get_mut(&id) {
            if lost_but_enough {
                j.world_gen = j.world_gen.saturating_add(1);
            }
            j.reason = cut(&format!("shrank to {size} replicas: {task} ended ({}): {message}", class.as_str()), max);
            j.updated_at = now;
            j.revision = rev;
        }
        true
    }
}

/// A running service that autoscales, as the leader's autoscaler sees it at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoscaleInput {
    /// The service.
    pub job: JobId,
    /// Its spec (the autoscaler proposes it back with another `replicas`).
    pub spec: JobSpec,
    /// Its autoscaling section.
    pub autoscale: suanli_model::Autoscale,
    /// Its group's `replicas` now.
    pub current: u32,
    /// The fresh loads (thousandths) of its ready replicas: reported within three periods.
    pub loads: Vec<u64>,
}

impl State {
    /// Every running service with `service.autoscale`, with its ready replicas' fresh loads.
    pub fn autoscaled(&self, now: u64) -> Vec<AutoscaleInput> {
        self.live_jobs.iter().filter_map(|id| self.autoscale_input(*id, now)).collect()
    }

    /// [`State::autoscaled`] for one job: `None` unless it is a running service with
    /// `service.autoscale`.
    pub fn autoscale_input(&self, id: JobId, now: u64) -> Option<AutoscaleInput> {
        let j = self.jobs.get(&id)?;
        if !matches!(j.state, JobState::Placed | JobState::Running) {
            return None;
        }
        let a = j.spec.service().and_then(|s| s.autoscale.clone())?;
        let fresh = now.saturating_sub(a.period_s.saturating_mul(3));
        let loads = self
            .live_allocs(j)
            .filter(|x| x.alloc.group == 0 && x.desired == Desired::Run && x.ready)
            .filter_map(|x| x.load.filter(|(_, at)| *at >= fresh).map(|(l, _)| l))
            .collect();
        let current = j.spec.groups.first().map_or(0, |g| g.replicas);
        Some(AutoscaleInput { job: j.id, spec: j.spec.clone(), autoscale: a, current, loads })
    }
}

impl AutoscaleInput {
    /// The spec the autoscaler proposes for `wanted` replicas (`update_service`): the same
    /// spec with the group's `replicas` set, and its `min_replicas` lowered to fit.
    pub fn scaled_spec(&self, wanted: u32) -> JobSpec {
        let mut spec = self.spec.clone();
        if let Some(g) = spec.groups.first_mut() {
            g.replicas = wanted;
            g.min_replicas = g.min_replicas.map(|m| m.min(wanted));
        }
        spec
    }
}

/// What a service's replicas measured of their requests lately (`service.report`;
/// docs/services.md, "Latency and success rate"), one entry per replica that reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reported {
    /// Request latencies (microseconds).
    pub latency_us: Vec<u64>,
    /// Success ratios (parts per million).
    pub success_ppm: Vec<u32>,
}

impl Reported {
    /// The mean latency, in ms (`None`: no replica reported one).
    pub fn mean_latency_ms(&self) -> Option<f64> {
        let n = self.latency_us.len();
        (n > 0).then(|| self.latency_us.iter().map(|l| *l as f64).sum::<f64>() / n as f64 / 1000.0)
    }

    /// The mean success ratio, 0 to 1 (`None`: no replica reported one).
    pub fn mean_success_ratio(&self) -> Option<f64> {
        let n = self.success_ppm.len();
        (n > 0).then(|| self.success_ppm.iter().map(|p| f64::from(*p)).sum::<f64>() / n as f64 / 1e6)
    }
}

impl State {
    /// The latencies and success ratios the running, ready replicas of `j` reported within
    /// three of its `service.report` periods before `now` (seconds), the autoscaler's
    /// freshness rule: a replica whose agent stopped reporting drops out. Empty for a job
    /// without `service.report`.
    pub fn reported(&self, j: &Job, now: u64) -> Reported {
        let Some(r) = j.spec.service.as_ref().and_then(|sv| sv.report.as_ref()) else {
            return Reported::default();
        };
        let fresh = now.saturating_sub(r.period_s.saturating_mul(3));
        let mut out = Reported::default();
        for a in self.live_allocs(j).filter(|a| a.state == AllocState::Running && a.ready) {
            if let Some((l, _)) = a.latency_us.filter(|(_, at)| *at >= fresh) {
                out.latency_us.push(l);
            }
            if let Some((p, _)) = a.success_ppm.filter(|(_, at)| *at >= fresh) {
                out.success_ppm.push(p);
            }
        }
        out
    }
}

/// One service's recent recommendations, kept by the leader's autoscaler (not replicated:
/// a new leader starts without them, so it scales down only once its own history covers a
/// whole scale-down window).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AutoscaleHistory {
    /// (time, recommended replicas), oldest first.
    recs: std::collections::VecDeque<(u64, u32)>,
    /// When the last decision was taken.
    last: Option<u64>,
    /// When the first decision was taken: a scale-down waits until the history covers the
    /// whole scale-down window (the recommendations before it are unknown, not low).
    since: Option<u64>,
}

impl AutoscaleHistory {
    /// The replicas to run at `now` (seconds), or `None` when this is not a decision time
    /// (within `period_s` of the last) or no replica reported a load. As the Kubernetes HPA:
    /// the recommendation `ceil(current × average / target)` (within the tolerance: no
    /// change), then up to the lowest recommendation of the scale-up window and down to the
    /// highest of the scale-down window, by at most the step in each direction. No scale-down
    /// before the history spans `scale_down_window_s` (a fresh leader, or a new service).
    pub fn decide(&mut self, a: &suanli_model::Autoscale, current: u32, loads: &[u64], now: u64) -> Option<u32> {
        if self.last.is_some_and(|t| now < t.saturating_add(a.period_s)) || loads.is_empty() {
            return None;
        }
        self.last = Some(now);
        let since = *self.since.get_or_insert(now);
        let avg = loads.iter().map(|l| u128::from(*l)).sum::<u128>() / loads.len() as u128;
        let rec = a.recommend(current, u64::try_from(avg).unwrap_or(u64::MAX));
        self.recs.push_back((now, rec));
        let keep = a.scale_up_window_s.max(a.scale_down_window_s);
        while self.recs.front().is_some_and(|(t, _)| now.saturating_sub(*t) > keep) {
            self.recs.pop_front();
        }
        let within = |w: u64| self.recs.iter().filter(move |(t, _)| now.saturating_sub(*t) <= w).map(|(_, r)| *r);
        let up = within(a.scale_up_window_s).min().unwrap_or(rec);
        let down = within(a.scale_down_window_s).max().unwrap_or(rec);
        let step = |s: u32| if s == 0 { u32::MAX } else { s };
        let wanted = if up > current {
            up.min(current.saturating_add(step(a.scale_up_step)))
        } else if down < current && now.saturating_sub(since) >= a.scale_down_window_s {
            down.max(current.saturating_sub(step(a.scale_down_step)))
        } else {
            current
        };
        Some(wanted.clamp(a.min_replicas, a.max_replicas))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use suanli_model::{Autoscale, LoadSource};

    fn a() -> Autoscale {
        Autoscale {
            min_replicas: 1,
            max_replicas: 10,
            source: LoadSource::File,
            metric: "suanli_load".into(),
            target: 10,
            tolerance_pct: 10,
            period_s: 5,
            scale_up_window_s: 0,
            scale_down_window_s: 20,
            scale_up_step: 4,
            scale_down_step: 0,
        }
    }

    #[test]
    fn scale_up_is_bounded_by_the_step_and_scale_down_waits_its_window() {
        let mut h = AutoscaleHistory::default();
        // 2 replicas at 50: 10 wanted; at most 4 more per decision.
        assert_eq!(h.decide(&a(), 2, &[50_000, 50_000], 0), Some(6));
        // Within the period: no decision.
        assert_eq!(h.decide(&a(), 6, &[20_000; 6], 3), None);
        assert_eq!(h.decide(&a(), 6, &[20_000; 6], 5), Some(10));
        // The load falls: the high recommendations of the last 20 s hold the replicas.
        assert_eq!(h.decide(&a(), 10, &[1_000; 10], 10), Some(10));
        assert_eq!(h.decide(&a(), 10, &[1_000; 10], 20), Some(10));
        assert_eq!(h.decide(&a(), 10, &[1_000; 10], 25), Some(10));
        // 20 s after the last high one (at 5), the window holds only low ones.
        assert_eq!(h.decide(&a(), 10, &[1_000; 10], 30), Some(1));
        // No load reported: no decision.
        assert_eq!(h.decide(&a(), 1, &[], 40), None);
    }

    #[test]
    fn a_fresh_history_scales_up_at_once_and_down_only_after_a_whole_window() {
        // A new leader: the recommendations of the last window are unknown, not low.
        let mut h = AutoscaleHistory::default();
        assert_eq!(h.decide(&a(), 8, &[1_000; 8], 100), Some(8));
        assert_eq!(h.decide(&a(), 8, &[1_000; 8], 110), Some(8));
        assert_eq!(h.decide(&a(), 8, &[1_000; 8], 120), Some(1), "the window (20 s) is covered");
        let mut h = AutoscaleHistory::default();
        assert_eq!(h.decide(&a(), 2, &[50_000, 50_000], 100), Some(6), "scale-up does not wait");
    }
}
