//! The federation's replicated state machine: the region directory, federated jobs with their
//! leases and epochs, global quotas, and the usage roll-up. Deterministic: time comes inside each
//! command. [`suanli_raft::Machine`] is implemented for it, so `suanli-raft` stores and
//! replicates it like a region's state.

use crate::command::{FedCommand, FedResponse};
use crate::dispatch::{self, Decision, Room};
use crate::model::{
    Assignment, FedConfig, FedJob, FedJobState, FedPlacement, GlobalQuota, LEASE_KILL_GRACE_MS, LeaseGrant,
    LeaseRefusal, QuotaLease, RegionRecord, RegionSync, SyncAnswer,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{JobSpec, Limits};

/// The federation's state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedState {
    /// The terms; `None` until the bootstrap's `Init` (then [`FedState::config`] answers the
    /// defaults).
    pub config: Option<FedConfig>,
    /// The region directory, by name.
    pub regions: BTreeMap<String, RegionRecord>,
    /// Which region owns each pool.
    pub pool_owner: BTreeMap<String, String>,
    /// Federated jobs by their number (`g-<n>`: n).
    pub jobs: BTreeMap<u64, FedJob>,
    /// Job number by submitter key.
    pub by_request: BTreeMap<String, u64>,
    /// The next job number (from 1).
    pub next_job: u64,
    /// Global quotas, sorted by (team, device model).
    pub quotas: Vec<GlobalQuota>,
    /// Device-milli-seconds used, by "team/region/device model" (regions' local use and the
    /// federated jobs they ran): the cost roll-up.
    pub usage: BTreeMap<String, u64>,
    /// The rolling digest of the applied log (see `suanli_raft::Machine::log_digest`).
    pub log_digest: u64,
}

impl FedState {
    /// The terms in force.
    pub fn config(&self) -> FedConfig {
        self.config.clone().unwrap_or_default()
    }

    /// A job by its id (`g-<n>`).
    pub fn job(&self, id: &str) -> Option<&FedJob> {
        parse_global_id(id).and_then(|n| self.jobs.get(&n))
    }

    /// Applies one command. Never panics; a refusal leaves the state unchanged.
    pub fn apply(&mut self, cmd: FedCommand) -> FedResponse {
        match cmd {
            FedCommand::Init { config } => {
                if self.config.is_some() {
                    return FedResponse::Done;
                }
                if let Err(e) = config.validate() {
                    return rejected(format!("config.{}", FedConfig::error_field(&e)), e);
                }
                self.config = Some(config);
                FedResponse::Done
            }
            FedCommand::SetConfig { config } => {
                if let Err(e) = config.validate() {
                    return rejected(format!("config.{}", FedConfig::error_field(&e)), e);
                }
                self.config = Some(config);
                FedResponse::Done
            }
            FedCommand::Submit { client_request_id, spec, team, submitted_by, data_labels, now_ms, trace } => {
                let r = self.submit(client_request_id, *spec, team, submitted_by, data_labels, now_ms);
                // A malformed trace context is dropped, never refused (tracing is best effort).
                let trace = trace.as_deref().and_then(suanli_model::trace::TraceParent::parse);
                if let (FedResponse::Submitted { id, created: true }, Some(tp)) = (&r, trace)
                    && let Some(job) = parse_global_id(id).and_then(|n| self.jobs.get_mut(&n))
                {
                    job.trace = Some(tp.to_string());
                }
                r
            }
            FedCommand::Cancel { id, now_ms } => self.cancel(&id, now_ms),
            FedCommand::SetQuota { team, device_model, limit_milli } => self.set_quota(team, device_model, limit_milli),
            FedCommand::Sync { sync, now_ms } => self.sync(*sync, now_ms),
            FedCommand::Dispatch { decisions, now_ms } => self.dispatch(decisions, now_ms),
            FedCommand::Expire { now_ms } => self.expire(now_ms),
        }
    }

    fn submit(
        &mut self,
        client_request_id: String,
        spec: JobSpec,
        team: String,
        submitted_by: String,
        data_labels: BTreeMap<String, String>,
        now_ms: u64,
    ) -> FedResponse {
        let cfg = self.config();
        let limits = Limits::default();
        if let Err(e) = check_text("client_request_id", &client_request_id, limits.max_name_len) {
            return e;
        }
        if let Some(n) = self.by_request.get(&client_request_id) {
            return FedResponse::Submitted { id: global_id(*n), created: false };
        }
        if let Err(e) = check_text("team", &team, limits.max_name_len) {
            return e;
        }
        if submitted_by.len() > limits.max_name_len {
            return rejected(
                "submitted_by",
                format!("{} bytes, too long; must be at most {}", submitted_by.len(), limits.max_name_len),
            );
        }
        if data_labels.len() > limits.max_constraints {
            return rejected(
                "data_labels",
                format!("{} labels, too many; must be at most {}", data_labels.len(), limits.max_constraints),
            );
        }
        for (k, v) in &data_labels {
            if k.is_empty() || k.len() > limits.max_name_len || v.len() > limits.max_label_value_len {
                return rejected(
                    format!("data_labels.{}", truncate(k, 64)),
                    format!(
                        "key of {} bytes, value of {} bytes; a key must be 1 to {} bytes, a value at most {}",
                        k.len(),
                        v.len(),
                        limits.max_name_len,
                        limits.max_label_value_len
                    ),
                );
            }
        }
        if let Err(e) = spec.validate(&limits) {
            return rejected(format!("spec.{}", e.field()), e.to_string());
        }
        let mut kind: Option<(usize, &'static str)> = None;
        let mut demand: u64 = 0;
        for (i, g) in spec.groups.iter().enumerate() {
            if let Some(d) = &g.resources.devices {
                match kind {
                    Some((first, k)) if k != d.kind.as_str() => {
                        return rejected(
                            format!("spec.groups[{i}].resources.devices.kind"),
                            format!(
                                "{}, but groups[{first}] asks for {k}; a federated job uses one device kind",
                                d.kind.as_str()
                            ),
                        );
                    }
                    Some(_) => {}
                    None => kind = Some((i, d.kind.as_str())),
                }
                demand = demand.saturating_add(u64::from(g.replicas).saturating_mul(d.total_milli()));
            }
        }
        let stop = cfg.stop_before_ms(&spec, LEASE_KILL_GRACE_MS);
        let need = stop.saturating_add(cfg.sync_interval_ms.saturating_mul(2));
        if need >= cfg.lease_ms {
            let grace = spec.checkpoint.map_or(0, |c| c.grace_s);
            return rejected(
                "spec.checkpoint.grace_s",
                format!(
                    "{grace}, too long for the federation's lease: drift {} ms + grace + kill {} ms + two sync \
                     intervals ({} ms) = {need} ms must be under lease_ms {}",
                    cfg.max_clock_drift_ms,
                    LEASE_KILL_GRACE_MS,
                    cfg.sync_interval_ms.saturating_mul(2),
                    cfg.lease_ms
                ),
            );
        }
        let live = self.jobs.values().filter(|j| !j.state.is_terminal()).count();
        if live >= cfg.max_jobs {
            return rejected(
                "jobs",
                format!(
                    "{live} federated jobs not yet ended, the most the federation keeps (max_jobs {})",
                    cfg.max_jobs
                ),
            );
        }
        let n = self.next_job.max(1);
        let id = global_id(n);
        self.next_job = n.saturating_add(1);
        self.by_request.insert(client_request_id.clone(), n);
        self.jobs.insert(
            n,
            FedJob {
                id: id.clone(),
                client_request_id,
                spec,
                team,
                submitted_by,
                data_labels,
                submitted_at_ms: now_ms,
                state: FedJobState::Pending,
                region: None,
                epoch: 0,
                lease_until_ms: 0,
                device_model: None,
                demand_milli: demand,
                checkpoint: None,
                reason: "waiting for dispatch".into(),
                history: Vec::new(),
                local_job_id: 0,
                cancel_requested: false,
                updated_at_ms: now_ms,
                trace: None,
            },
        );
        FedResponse::Submitted { id, created: true }
    }

    fn cancel(&mut self, id: &str, now_ms: u64) -> FedResponse {
        let Some(n) = parse_global_id(id) else {
            return rejected("id", format!("{:?} is not a federated job id (g-<n>)", truncate(id, 64)));
        };
        let Some(job) = self.jobs.get_mut(&n) else {
            return FedResponse::NotFound { field: "id".into(), message: format!("{id}: no such federated job") };
        };
        match job.state {
            FedJobState::Pending => {
                job.state = FedJobState::Cancelled;
                job.cancel_requested = true;
                job.reason = "cancelled by its owner".into();
                job.updated_at_ms = now_ms;
                self.trim_ended();
            }
            FedJobState::Assigned | FedJobState::Running => {
                if !job.cancel_requested {
                    job.cancel_requested = true;
                    job.updated_at_ms = now_ms;
                }
            }
            FedJobState::Succeeded | FedJobState::Failed | FedJobState::Cancelled => {}
        }
        FedResponse::Done
    }

    fn set_quota(&mut self, team: String, device_model: String, limit_milli: u64) -> FedResponse {
        let cfg = self.config();
        let limits = Limits::default();
        if let Err(e) = check_text("team", &team, limits.max_name_len) {
            return e;
        }
        if let Err(e) = check_text("device_model", &device_model, limits.max_name_len) {
            return e;
        }
        let at = self.quotas.binary_search_by(|q| {
            (q.team.as_str(), q.device_model.as_str()).cmp(&(team.as_str(), device_model.as_str()))
        });
        match (at, limit_milli) {
            (Ok(i), 0) => {
                self.quotas.remove(i);
            }
            (Ok(i), l) => {
                if let Some(q) = self.quotas.get_mut(i) {
                    q.limit_milli = l;
                }
            }
            (Err(_), 0) => {}
            (Err(i), l) => {
                if self.quotas.len() >= cfg.max_quotas {
                    return rejected(
                        "quotas",
                        format!("{} quotas set, the most allowed (max_quotas {})", self.quotas.len(), cfg.max_quotas),
                    );
                }
                self.quotas.insert(i, GlobalQuota { team, device_model, limit_milli: l });
            }
        }
        FedResponse::Done
    }

    /// Checks a sync against the limits and the pool directory (no change).
    fn check_sync(&self, sync: &RegionSync, cfg: &FedConfig) -> Result<(), FedResponse> {
        let limits = Limits::default();
        check_text("sync.region", &sync.region, limits.max_name_len)?;
        let r = &sync.region;
        if !self.regions.contains_key(r) && self.regions.len() >= cfg.max_regions {
            return Err(rejected(
                "sync.region",
                format!(
                    "{r} is new and the directory holds {} regions (max_regions {})",
                    self.regions.len(),
                    cfg.max_regions
                ),
            ));
        }
        let counts = [
            ("sync.pools", sync.pools.len(), cfg.max_pools_per_region, "max_pools_per_region"),
            ("sync.capacity", sync.capacity.len(), cfg.max_capacity_entries, "max_capacity_entries"),
            ("sync.held", sync.held.len(), cfg.max_held_per_sync, "max_held_per_sync"),
            ("sync.usage", sync.usage.len(), cfg.max_held_per_sync, "max_held_per_sync"),
            ("sync.quota_leases", sync.quota_leases.len(), cfg.max_quotas, "max_quotas"),
            ("sync.endpoints", sync.endpoints.len(), limits.max_constraints, "max_constraints"),
            ("sync.labels", sync.labels.len(), limits.max_constraints, "max_constraints"),
        ];
        for (field, n, max, name) in counts {
            if n > max {
                return Err(rejected(field, format!("{n} entries, too many; must be at most {max} ({name})")));
            }
        }
        for (i, e) in sync.endpoints.iter().enumerate() {
            check_text(&format!("sync.endpoints[{i}]"), e, limits.max_name_len)?;
        }
        if let Some(c) = &sync.cost {
            check_text("sync.cost.currency", &c.currency, limits.max_name_len)?;
            if c.teams.len() > cfg.max_held_per_sync {
                return Err(rejected(
                    "sync.cost.teams",
                    format!(
                        "{} entries, too many; must be at most {} (max_held_per_sync)",
                        c.teams.len(),
                        cfg.max_held_per_sync
                    ),
                ));
            }
            for t in c.teams.keys() {
                check_text("sync.cost.teams", t, limits.max_name_len)?;
            }
        }
        for (k, v) in &sync.labels {
            if k.is_empty() || k.len() > limits.max_name_len || v.len() > limits.max_label_value_len {
                return Err(rejected(
                    format!("sync.labels.{}", truncate(k, 64)),
                    format!(
                        "a key must be 1 to {} bytes, a value at most {}",
                        limits.max_name_len, limits.max_label_value_len
                    ),
                ));
            }
        }
        let mut seen = BTreeSet::new();
        for (i, p) in sync.pools.iter().enumerate() {
            check_text(&format!("sync.pools[{i}]"), p, limits.max_name_len)?;
            if !seen.insert(p.as_str()) {
                return Err(rejected(format!("sync.pools[{i}]"), format!("pool {p} is listed twice")));
            }
            if let Some(owner) = self.pool_owner.get(p)
                && owner != r
            {
                return Err(rejected(
                    format!("sync.pools[{i}]"),
                    format!("pool {p} is owned by region {owner}, not {r}"),
                ));
            }
        }
        for (i, c) in sync.capacity.iter().enumerate() {
            if !seen.contains(c.pool.as_str()) {
                return Err(rejected(
                    format!("sync.capacity[{i}].pool"),
                    format!("region {r} does not own pool {}", truncate(&c.pool, 64)),
                ));
            }
            if c.device_model.len() > limits.max_name_len || c.device_kind.len() > limits.max_name_len {
                return Err(rejected(
                    format!("sync.capacity[{i}].device_model"),
                    format!("too long; must be at most {} bytes", limits.max_name_len),
                ));
            }
            if c.device_kind.is_empty() != c.device_model.is_empty() {
                return Err(rejected(
                    format!("sync.capacity[{i}].device_kind"),
                    "device_kind and device_model are both set or both empty".to_owned(),
                ));
            }
        }
        for (i, u) in sync.usage.iter().enumerate() {
            check_text(&format!("sync.usage[{i}].team"), &u.team, limits.max_name_len)?;
            if u.device_model.len() > limits.max_name_len {
                return Err(rejected(
                    format!("sync.usage[{i}].device_model"),
                    format!("too long; must be at most {} bytes", limits.max_name_len),
                ));
            }
        }
        for (i, h) in sync.held.iter().enumerate() {
            if !matches!(h.status.as_str(), "assigned" | "running" | "succeeded" | "failed" | "cancelled" | "lost") {
                return Err(rejected(
                    format!("sync.held[{i}].status"),
                    format!(
                        "{:?}; must be one of assigned, running, succeeded, failed, cancelled, lost",
                        truncate(&h.status, 64)
                    ),
                ));
            }
            if h.global_id.len() > limits.max_name_len {
                return Err(rejected(format!("sync.held[{i}].global_id"), "too long".to_owned()));
            }
            if h.message.len() > MAX_MESSAGE_LEN {
                return Err(rejected(
                    format!("sync.held[{i}].message"),
                    format!("{} bytes; must be at most {MAX_MESSAGE_LEN}", h.message.len()),
                ));
            }
        }
        Ok(())
    }

    fn sync(&mut self, mut sync: RegionSync, now_ms: u64) -> FedResponse {
        let cfg = self.config();
        if let Err(e) = self.check_sync(&sync, &cfg) {
            return e;
        }
        let r = sync.region.clone();
        let acked = std::mem::take(&mut sync.quota_leases);
        // Pools: release the ones it no longer lists, claim the new ones.
        self.pool_owner.retain(|p, owner| owner != &r || sync.pools.contains(p));
        for p in &sync.pools {
            self.pool_owner.insert(p.clone(), r.clone());
        }
        for u in &sync.usage {
            if u.device_milli_s > 0 {
                let slot = self.usage.entry(format!("{}/{r}/{}", u.team, u.device_model)).or_default();
                *slot = slot.saturating_add(u.device_milli_s);
            }
        }
        let first_seen_ms = self.regions.get(&r).map_or(now_ms, |x| x.first_seen_ms);
        // A sync without totals (no catalog, or an older region) keeps the last ones.
        let cost = sync.cost.or_else(|| self.regions.get(&r).and_then(|x| x.cost.clone()));
        let quota_leases = self.regions.get(&r).map(|x| x.quota_leases.clone()).unwrap_or_default();
        self.regions.insert(
            r.clone(),
            RegionRecord {
                name: r.clone(),
                endpoints: sync.endpoints,
                labels: sync.labels,
                pools: sync.pools,
                capacity: sync.capacity,
                backlog: sync.backlog,
                usage: sync.usage,
                first_seen_ms,
                last_sync_ms: now_ms,
                sent_at_ms: sync.sent_at_ms,
                cost,
                quota_leases,
            },
        );
        let mut answer = SyncAnswer::default();
        let mut reported: BTreeSet<(u64, u64)> = BTreeSet::new();
        let mut ended = false;
        for h in sync.held {
            let Some((n, job)) = parse_global_id(&h.global_id).and_then(|n| self.jobs.get_mut(&n).map(|j| (n, j)))
            else {
                answer.refused.push(LeaseRefusal {
                    global_id: h.global_id.clone(),
                    epoch: h.epoch,
                    reason: format!("{} is not a federated job the federation knows", truncate(&h.global_id, 64)),
                });
                continue;
            };
            reported.insert((n, h.epoch));
            let holder = job.region.clone().unwrap_or_default();
            if h.epoch != job.epoch {
                let where_ = if job.state.is_held() {
                    format!("runs at epoch {} in {holder}", job.epoch)
                } else {
                    format!("is {} at epoch {}", job.state.as_str(), job.epoch)
                };
                answer.refused.push(LeaseRefusal {
                    global_id: job.id.clone(),
                    epoch: h.epoch,
                    reason: format!("stale epoch {}: {} {where_}", h.epoch, job.id),
                });
                continue;
            }
            if !job.state.is_held() || holder != r {
                let now_state = if job.state.is_held() {
                    format!("{holder} holds it")
                } else {
                    format!("it is {}", job.state.as_str())
                };
                answer.refused.push(LeaseRefusal {
                    global_id: job.id.clone(),
                    epoch: h.epoch,
                    reason: format!("{} is not held by {r}: {now_state}", job.id),
                });
                continue;
            }
            if now_ms >= job.lease_until_ms {
                answer.refused.push(LeaseRefusal {
                    global_id: job.id.clone(),
                    epoch: h.epoch,
                    reason: format!("lease of {} ended at {}", job.id, job.lease_until_ms),
                });
                continue;
            }
            if let Some(cp) = h.checkpoint
                && job.checkpoint.as_ref().is_none_or(|old| cp.step > old.step)
            {
                job.checkpoint = Some(cp);
            }
            if h.local_job_id != 0 {
                job.local_job_id = h.local_job_id;
            }
            match h.status.as_str() {
                "assigned" | "running" => {
                    if job.state == FedJobState::Running
                        && let Some(model) = &job.device_model
                    {
                        let ms = now_ms.saturating_sub(job.updated_at_ms);
                        let used = job.demand_milli.saturating_mul(ms) / 1000;
                        if used > 0 {
                            let slot = self.usage.entry(format!("{}/{r}/{model}", job.team)).or_default();
                            *slot = slot.saturating_add(used);
                        }
                    }
                    if h.status == "running" && job.state == FedJobState::Assigned {
                        job.state = FedJobState::Running;
                        job.reason = format!("running in {r}");
                    }
                    job.lease_until_ms = now_ms.saturating_add(cfg.lease_ms);
                    job.updated_at_ms = now_ms;
                    answer.leases.push(LeaseGrant {
                        global_id: job.id.clone(),
                        epoch: job.epoch,
                        until_ms: job.lease_until_ms,
                    });
                }
                "lost" => {
                    answer.refused.push(LeaseRefusal {
                        global_id: job.id.clone(),
                        epoch: h.epoch,
                        reason: format!(
                            "{r} reported {} lost; its lease ends at {} and it is re-dispatched after",
                            job.id, job.lease_until_ms
                        ),
                    });
                }
                status => {
                    let (state, end) = match status {
                        "succeeded" => (FedJobState::Succeeded, "succeeded"),
                        "failed" => (FedJobState::Failed, "failed"),
                        _ => (FedJobState::Cancelled, "cancelled"),
                    };
                    job.state = state;
                    job.reason = if h.message.is_empty() {
                        format!("{end} in {r}")
                    } else {
                        format!("{end} in {r}: {}", h.message)
                    };
                    job.lease_until_ms = 0;
                    job.updated_at_ms = now_ms;
                    close_placement(job, now_ms, end);
                    ended = true;
                }
            }
        }
        for (n, job) in &self.jobs {
            if job.region.as_deref() != Some(r.as_str()) || !job.state.is_held() {
                continue;
            }
            if job.cancel_requested {
                answer.cancel.push(job.id.clone());
            } else if job.state == FedJobState::Assigned && !reported.contains(&(*n, job.epoch)) {
                answer.assignments.push(Assignment {
                    global_id: job.id.clone(),
                    epoch: job.epoch,
                    spec: job.spec.clone(),
                    team: job.team.clone(),
                    until_ms: job.lease_until_ms,
                    restore: job.checkpoint.clone(),
                    device_model: job.device_model.clone(),
                    trace: job.trace.clone(),
                });
            }
        }
        if ended {
            self.trim_ended();
        }
        // The region's share of every global quota, after its jobs' ends were counted.
        let grants = crate::quota::grants(self, &r, &acked, now_ms);
        answer.quota_leases = grants
            .iter()
            .map(|g| QuotaLease {
                team: g.team.clone(),
                device_model: g.device_model.clone(),
                limit_milli: g.limit_milli,
                until_ms: g.until_ms,
            })
            .collect();
        if let Some(rec) = self.regions.get_mut(&r) {
            rec.quota_leases = grants;
        }
        FedResponse::Synced(Box::new(answer))
    }

    fn dispatch(&mut self, decisions: Vec<Decision>, now_ms: u64) -> FedResponse {
        let cfg = self.config();
        // Built once per command and kept current as placements apply, so that a pass of many
        // decisions costs one pass over the jobs, not one per decision.
        let mut index = ApplyIndex::of(self);
        let mut placed = Vec::new();
        let mut refused = Vec::new();
        for d in decisions {
            match d {
                Decision::Hold { job, reason } => {
                    if let Some(j) = parse_global_id(&job).and_then(|n| self.jobs.get_mut(&n))
                        && j.state == FedJobState::Pending
                        && j.reason != reason
                    {
                        j.reason = truncate(&reason, MAX_MESSAGE_LEN).to_owned();
                    }
                }
                Decision::Place { job, region, device_model, why } => {
                    match self.check_place(&index, &job, &region, device_model.as_deref(), now_ms) {
                        Err(e) => refused.push((job, e)),
                        Ok(n) => {
                            let Some(j) = self.jobs.get_mut(&n) else { continue };
                            index.assigned.entry(region.clone()).or_default().push(n);
                            if let Some(m) = &device_model {
                                index.quota.hold(&j.team, m, j.demand_milli);
                            }
                            j.state = FedJobState::Assigned;
                            j.epoch = j.epoch.saturating_add(1);
                            j.region = Some(region.clone());
                            j.lease_until_ms = now_ms.saturating_add(cfg.lease_ms);
                            j.device_model = device_model;
                            j.local_job_id = 0;
                            j.reason = format!("assigned to {region}: {}", truncate(&why, MAX_MESSAGE_LEN));
                            j.updated_at_ms = now_ms;
                            j.history.push(FedPlacement {
                                region: region.clone(),
                                epoch: j.epoch,
                                from_ms: now_ms,
                                to_ms: 0,
                                end: String::new(),
                            });
                            if j.history.len() > cfg.max_history {
                                let extra = j.history.len() - cfg.max_history;
                                j.history.drain(..extra);
                            }
                            placed.push((job, region));
                        }
                    }
                }
            }
        }
        FedResponse::Dispatched { placed, refused }
    }

    /// Re-checks a placement against the state now; the job's number when it holds.
    fn check_place(
        &self,
        index: &ApplyIndex,
        id: &str,
        region: &str,
        model: Option<&str>,
        now_ms: u64,
    ) -> Result<u64, String> {
        let Some((n, job)) = parse_global_id(id).and_then(|n| self.jobs.get(&n).map(|j| (n, j))) else {
            return Err(format!("{}: no such federated job", truncate(id, 64)));
        };
        if job.state != FedJobState::Pending || job.cancel_requested {
            return Err(format!("{id} is {}, not pending", job.state.as_str()));
        }
        let Some(rec) = self.regions.get(region) else {
            return Err(format!("region {} is not in the directory", truncate(region, 64)));
        };
        let assigned: Vec<&FedJob> =
            index.assigned.get(region).map(|v| v.iter().filter_map(|n| self.jobs.get(n)).collect()).unwrap_or_default();
        let view = dispatch::region_view_of(self, rec, &assigned, now_ms);
        let room = Room::of(&view);
        let pj = dispatch::pending_job(job);
        if pj.device_kind.is_empty() && model.is_some() {
            return Err(format!("{id} asks for no devices, but a device model was chosen"));
        }
        let mut quotas = dispatch::Quotas::new();
        if let Some(m) = model
            && let Some(q) = self.quotas.iter().find(|q| q.team == job.team && q.device_model == m)
        {
            let used = index.quota.reserved(&job.team, m, now_ms);
            quotas.entry(job.team.clone()).or_default().insert(m.to_owned(), (q.limit_milli, used));
        }
        dispatch::check_fit(&pj, &view, &room, model, &quotas)?;
        Ok(n)
    }

    fn expire(&mut self, now_ms: u64) -> FedResponse {
        let cfg = self.config();
        let mut expired = Vec::new();
        for job in self.jobs.values_mut() {
            if !job.state.is_held() || job.lease_until_ms.saturating_add(cfg.redispatch_margin_ms) > now_ms {
                continue;
            }
            let region = job.region.clone().unwrap_or_default();
            let ended_at = job.lease_until_ms;
            close_placement(job, now_ms, "lease_expired");
            job.lease_until_ms = 0;
            job.updated_at_ms = now_ms;
            if job.cancel_requested {
                job.state = FedJobState::Cancelled;
                job.reason = format!("cancelled by its owner; lease of {region} expired at {ended_at}");
            } else {
                job.state = FedJobState::Pending;
                let from = job.checkpoint.as_ref().map_or_else(
                    || "from the start (no checkpoint)".to_owned(),
                    |c| format!("from checkpoint step {}", c.step),
                );
                job.reason = format!("lease of {region} expired at {ended_at}; re-dispatching {from}");
            }
            expired.push(job.id.clone());
        }
        if !expired.is_empty() {
            self.trim_ended();
        }
        FedResponse::Expired { jobs: expired }
    }

    /// Drops the oldest ended jobs beyond `max_ended_jobs` (and their request ids).
    fn trim_ended(&mut self) {
        let cfg = self.config();
        let mut ended: Vec<(u64, u64)> =
            self.jobs.iter().filter(|(_, j)| j.state.is_terminal()).map(|(n, j)| (j.updated_at_ms, *n)).collect();
        if ended.len() <= cfg.max_ended_jobs {
            return;
        }
        ended.sort_unstable();
        let extra = ended.len() - cfg.max_ended_jobs;
        for (_, n) in ended.into_iter().take(extra) {
            if let Some(j) = self.jobs.remove(&n) {
                self.by_request.remove(&j.client_request_id);
            }
        }
    }

    /// Checks the state's own rules (for tests and the chaos checker): each pool has one
    /// owner and it lists the pool; a held job has a region, an epoch ≥ 1 and a lease; no two
    /// jobs share a request id; quota use is within each limit at the time of every dispatch.
    pub fn invariants(&self) -> Result<(), String> {
        let cfg = self.config();
        for (pool, owner) in &self.pool_owner {
            let Some(r) = self.regions.get(owner) else {
                return Err(format!("pool {pool} is owned by {owner}, which is not in the directory"));
            };
            if !r.pools.contains(pool) {
                return Err(format!("pool {pool} is owned by {owner}, which does not list it"));
            }
        }
        for r in self.regions.values() {
            for p in &r.pools {
                if self.pool_owner.get(p) != Some(&r.name) {
                    return Err(format!("region {} lists pool {p}, owned by {:?}", r.name, self.pool_owner.get(p)));
                }
            }
        }
        let mut requests = BTreeSet::new();
        for (n, j) in &self.jobs {
            if j.id != global_id(*n) {
                return Err(format!("job number {n} carries id {}", j.id));
            }
            if *n >= self.next_job {
                return Err(format!("{} is at or past the next job number {}", j.id, self.next_job));
            }
            if !requests.insert(j.client_request_id.as_str()) {
                return Err(format!("{} shares request id {:?} with another job", j.id, j.client_request_id));
            }
            if self.by_request.get(&j.client_request_id) != Some(n) {
                return Err(format!("{}'s request id does not map back to it", j.id));
            }
            if j.history.len() > cfg.max_history {
                return Err(format!(
                    "{} keeps {} placements, over max_history {}",
                    j.id,
                    j.history.len(),
                    cfg.max_history
                ));
            }
            if j.state.is_held() {
                let Some(region) = &j.region else {
                    return Err(format!("{} is {} without a region", j.id, j.state.as_str()));
                };
                if j.epoch == 0 || j.lease_until_ms == 0 {
                    return Err(format!("{} is held with epoch {} and lease {}", j.id, j.epoch, j.lease_until_ms));
                }
                match j.history.last() {
                    Some(p) if &p.region == region && p.epoch == j.epoch && p.end.is_empty() => {}
                    other => {
                        return Err(format!(
                            "{} is held by {region} at epoch {}, its last placement is {other:?}",
                            j.id, j.epoch
                        ));
                    }
                }
            } else if j.history.iter().any(|p| p.end.is_empty()) {
                return Err(format!("{} is {} with an open placement", j.id, j.state.as_str()));
            }
        }
        if self.by_request.len() != self.jobs.len() {
            return Err(format!("{} request ids for {} jobs", self.by_request.len(), self.jobs.len()));
        }
        for w in self.quotas.windows(2) {
            if let [a, b] = w
                && (a.team.as_str(), a.device_model.as_str()) >= (b.team.as_str(), b.device_model.as_str())
            {
                return Err(format!("quotas out of order at {}/{}", b.team, b.device_model));
            }
        }
        Ok(())
    }

    /// Serializes the whole state (snapshots).
    pub fn snapshot(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    /// Rebuilds it from [`FedState::snapshot`] bytes.
    pub fn restore(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// The longest free-text message a command may carry (a job's reason, a region's message).
pub const MAX_MESSAGE_LEN: usize = 4096;

/// What a `Dispatch` command's re-checks read, built once per command: the jobs assigned to
/// each region and not yet running, and the federated jobs' hold on each quota.
struct ApplyIndex {
    assigned: BTreeMap<String, Vec<u64>>,
    quota: crate::quota::QuotaIndex,
}

impl ApplyIndex {
    fn of(state: &FedState) -> Self {
        let mut assigned: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for (n, j) in &state.jobs {
            if j.state == FedJobState::Assigned
                && let Some(r) = &j.region
            {
                assigned.entry(r.clone()).or_default().push(*n);
            }
        }
        Self { assigned, quota: crate::quota::QuotaIndex::of(state) }
    }
}

fn rejected(field: impl Into<String>, message: impl Into<String>) -> FedResponse {
    FedResponse::Rejected { field: field.into(), message: message.into() }
}

/// A name: not empty, at most `max` bytes.
fn check_text(field: &str, value: &str, max: usize) -> Result<(), FedResponse> {
    if value.is_empty() {
        return Err(rejected(field, "must not be empty"));
    }
    if value.len() > max {
        return Err(rejected(field, format!("{} bytes, too long; must be at most {max}", value.len())));
    }
    Ok(())
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Ends a job's open placement.
fn close_placement(job: &mut FedJob, now_ms: u64, end: &str) {
    if let Some(p) = job.history.last_mut()
        && p.end.is_empty()
    {
        p.to_ms = now_ms;
        p.end = end.to_owned();
    }
}

/// `g-<n>` -> n.
pub fn parse_global_id(id: &str) -> Option<u64> {
    id.strip_prefix("g-").and_then(|n| n.parse().ok()).filter(|n| *n > 0)
}

/// n -> `g-<n>`.
pub fn global_id(n: u64) -> String {
    format!("g-{n}")
}

impl suanli_raft::Machine for FedState {
    type Command = FedCommand;
    type Response = FedResponse;

    fn empty() -> Self {
        FedState::default()
    }

    fn log_digest(&self) -> u64 {
        self.log_digest
    }

    fn set_log_digest(&mut self, digest: u64) {
        self.log_digest = digest;
    }

    fn apply(&mut self, cmd: FedCommand) -> FedResponse {
        FedState::apply(self, cmd)
    }

    fn internal_response() -> FedResponse {
        FedResponse::Internal
    }

    fn check(_cmd: &FedCommand) -> Result<(), String> {
        // An unknown kind fails to decode; the store halts the replica on that.
        Ok(())
    }

    fn kind(cmd: &FedCommand) -> String {
        cmd.kind().to_owned()
    }

    fn fatal(_resp: &FedResponse) -> Option<String> {
        None
    }

    fn resumes(_cmd: &FedCommand, _halted_at: u64) -> bool {
        false
    }

    fn halted_response(halt: &suanli_raft::Halt) -> FedResponse {
        FedResponse::Halted { index: halt.index, kind: halt.kind.clone(), reason: halt.reason.clone() }
    }

    fn snapshot(&self) -> Result<Vec<u8>, String> {
        FedState::snapshot(self).map_err(|e| e.to_string())
    }

    fn restore(bytes: &[u8]) -> Result<Self, String> {
        FedState::restore(bytes).map_err(|e| e.to_string())
    }
}
