//! Federated jobs in a region (docs/federation.md): the federation assigns a job to this region
//! with an epoch and a lease; the region leader records it ([`FedAdopt`]), renews the lease at
//! each sync ([`FedRenew`]) and gives the job up when the federation refuses the lease, the lease
//! runs out, or the owner cancels ([`FedRelease`]). A federated job is placed only while its
//! lease has more than `stop_before_ms` left; its allocations carry the lease to the agents, which
//! stop the tasks by `lease_until_ms - stop_before_ms` unless a heartbeat brought a renewal.

use crate::command::{CommandError, Response, SubmitJob};
use crate::records::{CheckpointRecord, Job, JobState, StopReason};
use crate::state::{Effect, cut};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use suanli_model::error::{check_value, quote};
use suanli_model::{AllocId, JobId, JobSpec};

/// A region job's tie to the federation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedBinding {
    /// The federated job's id (`g-<n>`).
    pub global_id: String,
    /// The federation epoch this region runs it under.
    pub epoch: u64,
    /// The lease's end (federation clock, ms since the Unix epoch).
    pub lease_until_ms: u64,
    /// The tasks must be gone this long before the lease's end (drift bound + checkpoint grace
    /// + kill grace).
    pub stop_before_ms: u64,
    /// The team the federation charges.
    pub team: String,
    /// Set once released: why (the job is then ended here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<String>,
}

/// Adopt a federated job: creates the region job (idempotent on `(global_id, epoch)`; an epoch
/// below one this region already holds for the same global id is refused as stale).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedAdopt {
    /// The global id.
    pub global_id: String,
    /// The epoch.
    pub epoch: u64,
    /// The job (the region pins `constraints.device_models` to the model dispatch chose).
    pub spec: JobSpec,
    /// The team charged.
    pub team: String,
    /// The lease's end.
    pub lease_until_ms: u64,
    /// See [`FedBinding::stop_before_ms`].
    pub stop_before_ms: u64,
    /// Restore from this checkpoint (recorded as the job's latest before its first placement).
    #[serde(default)]
    pub restore: Option<CheckpointRecord>,
    /// The region job's trace (as `SubmitJob::trace`): its root span, a child of the
    /// federated submitter's span. Drawn by the leader that proposes the adoption.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Leases renewed by the federation: `(global_id, epoch, until_ms)`; entries for jobs not held
/// at that epoch are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedRenew {
    /// The renewals.
    pub leases: Vec<(String, u64, u64)>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Give a federated job up: its allocations are told to stop and it ends here (state
/// `cancelled`, reason "released to the federation: ..."), never retried by this region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedRelease {
    /// The global id.
    pub global_id: String,
    /// The epoch released (a release for another epoch is ignored).
    pub epoch: u64,
    /// Why: `refused: ...`, `lease_expired`, `cancelled`.
    pub reason: String,
    /// Leader's time, seconds.
    pub now: u64,
}

/// A share of a team's worldwide quota for one device model that the federation leases to this
/// region: the team's region-local work on that model may hold at most `limit_milli` while the
/// lease lasts; once it has run out (by the region's clock, less the drift bound) nothing more
/// of the team's local work is placed on that model until a sync renews it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedQuotaLease {
    /// The team.
    pub team: String,
    /// The device model.
    pub device_model: String,
    /// The share, in milli-devices (1000 = one device).
    pub limit_milli: u64,
    /// The lease's end (federation clock, ms since the Unix epoch).
    pub until_ms: u64,
}

/// Replace this region's quota leases with the federation's latest answer (every global
/// quota of the federation has one entry, possibly of 0; a quota removed there is dropped here).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FedQuotaLeases {
    /// The leases.
    pub leases: Vec<FedQuotaLease>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// The most quota leases a region holds (the federation's `max_quotas` is lower).
pub const MAX_QUOTA_LEASES: usize = 4096;

/// The longest global id accepted (`g-<n>` in practice).
pub const MAX_GLOBAL_ID_LEN: usize = 64;

/// The region-side request id of a federated job's `(global_id, epoch)`: each epoch is its own
/// region job.
pub fn fed_request_id(global_id: &str, epoch: u64) -> String {
    format!("fed:{global_id}:{epoch}")
}

fn check_global_id(global_id: &str) -> Result<(), CommandError> {
    if global_id.is_empty() {
        return Err(CommandError::Invalid { field: "global_id".into(), message: "must not be empty".into() });
    }
    check_value(|| "global_id".into(), global_id, MAX_GLOBAL_ID_LEN)?;
    Ok(())
}

impl crate::State {
    /// The region jobs of a global id (every epoch this region still retains), lowest id first.
    pub fn fed_jobs(&self, global_id: &str) -> impl Iterator<Item = &Job> {
        self.jobs.values().filter(move |j| j.federation.as_ref().is_some_and(|b| b.global_id == global_id))
    }

    pub(crate) fn fed_adopt(&mut self, c: FedAdopt, rev: u64) -> crate::state::Applied {
        check_global_id(&c.global_id)?;
        if c.epoch == 0 {
            return Err(CommandError::Invalid {
                field: "epoch".into(),
                message: "0; a federated job's epoch starts at 1".into(),
            });
        }
        check_value(|| "team".into(), &c.team, MAX_GLOBAL_ID_LEN)?;
        if let Some(r) = &c.restore {
            check_value(|| "restore.uri".into(), &r.uri, self.config.max_message_len)?;
            if r.uri.is_empty() {
                return Err(CommandError::Invalid { field: "restore.uri".into(), message: "must not be empty".into() });
            }
            if let Some(h) = &r.hardware
                && (h.model.is_empty() || h.count == 0)
            {
                return Err(CommandError::Invalid {
                    field: "restore.hardware".into(),
                    message: "a hardware-bound checkpoint names a model and at least 1 device".into(),
                });
            }
        }
        let mut held_max = 0;
        for j in self.fed_jobs(&c.global_id) {
            let e = j.federation.as_ref().map_or(0, |b| b.epoch);
            if e == c.epoch {
                // A repeat (a new leader, a retried batch): the job adopted first is the answer.
                return Ok((Response::JobSubmitted { job: j.id, created: false }, Effect::Unchanged));
            }
            held_max = held_max.max(e);
        }
        if held_max > c.epoch {
            return Err(CommandError::Conflict {
                field: "epoch".into(),
                message: format!(
                    "{}: epoch {} is below epoch {held_max} this region already holds; stale assignment refused",
                    quote(&c.global_id),
                    c.epoch
                ),
            });
        }
        let older: Vec<JobId> = self.fed_jobs(&c.global_id).filter(|j| !j.state.is_terminal()).map(|j| j.id).collect();
        let submitted = self.submit_job(
            SubmitJob {
                client_request_id: fed_request_id(&c.global_id, c.epoch),
                spec: c.spec,
                retry: None,
                now: c.now,
                trace: c.trace,
            },
            rev,
        )?;
        let (Response::JobSubmitted { job, created }, _) = &submitted else {
            return Ok(submitted);
        };
        let (job, created) = (*job, *created);
        if !created {
            return Ok(submitted);
        }
        let now = self.clock;
        for id in older {
            let reason = format!("released to the federation: superseded by epoch {}", c.epoch);
            self.finish(id, JobState::Cancelled, StopReason::Cancelled, &reason, now, rev);
            if let Some(b) = self.jobs.get_mut(&id).and_then(|j| j.federation.as_mut()) {
                b.released = Some(format!("superseded by epoch {}", c.epoch));
            }
        }
        if let Some(j) = self.jobs.get_mut(&job) {
            j.federation = Some(FedBinding {
                global_id: c.global_id,
                epoch: c.epoch,
                lease_until_ms: c.lease_until_ms,
                stop_before_ms: c.stop_before_ms,
                team: c.team,
                released: None,
            });
            // Restored from another region's (or an earlier epoch's) checkpoint: no allocation
            // of this region wrote it, so it carries no allocation or epoch of this region.
            j.latest_checkpoint = c.restore.map(|r| CheckpointRecord { alloc: AllocId(0), epoch: 0, at: now, ..r });
        }
        Ok((Response::JobSubmitted { job, created: true }, Effect::Changed))
    }

    pub(crate) fn fed_renew(&mut self, c: FedRenew, rev: u64) -> crate::state::Applied {
        if c.leases.len() > self.config.max_plan_entries {
            return Err(CommandError::TooMany {
                what: "leases in one renewal".into(),
                limit: self.config.max_plan_entries,
            });
        }
        let wanted: BTreeMap<(&str, u64), u64> =
            c.leases.iter().map(|(g, e, until)| ((g.as_str(), *e), *until)).collect();
        let mut changed = false;
        for j in self.jobs.values_mut() {
            let Some(b) = j.federation.as_mut() else {
                continue;
            };
            if b.released.is_some() || j.state.is_terminal() {
                continue;
            }
            if let Some(&until) = wanted.get(&(b.global_id.as_str(), b.epoch))
                && until > b.lease_until_ms
            {
                b.lease_until_ms = until;
                j.revision = rev;
                changed = true;
            }
        }
        if !changed {
            return Ok((Response::Done, Effect::Unchanged));
        }
        self.tick(c.now);
        Ok((Response::Done, Effect::Changed))
    }

    /// The federation's quota leases to this region, sorted by (team, device model).
    pub fn quota_leases(&self) -> &[FedQuotaLease] {
        &self.fed_quota
    }

    pub(crate) fn fed_quota_leases(&mut self, c: FedQuotaLeases) -> crate::state::Applied {
        if c.leases.len() > MAX_QUOTA_LEASES {
            return Err(CommandError::TooMany { what: "quota leases".into(), limit: MAX_QUOTA_LEASES });
        }
        for (i, l) in c.leases.iter().enumerate() {
            check_value(|| format!("leases[{i}].team"), &l.team, MAX_GLOBAL_ID_LEN)?;
            check_value(|| format!("leases[{i}].device_model"), &l.device_model, MAX_GLOBAL_ID_LEN)?;
            if l.device_model.is_empty() {
                return Err(CommandError::Invalid {
                    field: format!("leases[{i}].device_model"),
                    message: "must not be empty".into(),
                });
            }
        }
        let mut leases = c.leases;
        leases.sort_by(|a, b| (&a.team, &a.device_model).cmp(&(&b.team, &b.device_model)));
        if let Some(w) = leases.windows(2).find(|w| w[0].team == w[1].team && w[0].device_model == w[1].device_model) {
            return Err(CommandError::Invalid {
                field: "leases".into(),
                message: format!("two leases for team {} and model {}", quote(&w[0].team), quote(&w[0].device_model)),
            });
        }
        if leases == self.fed_quota {
            return Ok((Response::Done, Effect::Unchanged));
        }
        self.fed_quota = leases;
        self.tick(c.now);
        Ok((Response::Done, Effect::Changed))
    }

    pub(crate) fn fed_release(&mut self, c: FedRelease, rev: u64) -> crate::state::Applied {
        check_global_id(&c.global_id)?;
        let Some(id) = self
            .fed_jobs(&c.global_id)
            .find(|j| j.federation.as_ref().is_some_and(|b| b.epoch == c.epoch))
            .map(|j| j.id)
        else {
            return Ok((Response::Done, Effect::Unchanged));
        };
        let Some(job) = self.jobs.get(&id) else {
            return Ok((Response::Done, Effect::Unchanged));
        };
        if job.federation.as_ref().is_some_and(|b| b.released.is_some()) {
            return Ok((Response::Done, Effect::Unchanged));
        }
        let terminal = job.state.is_terminal();
        let max = self.config.max_message_len;
        let why = if c.reason.is_empty() { "released".to_owned() } else { cut(&c.reason, max) };
        let now = self.tick(c.now);
        if !terminal {
            let reason = cut(&format!("released to the federation: {why}"), max);
            self.finish(id, JobState::Cancelled, StopReason::Cancelled, &reason, now, rev);
        }
        if let Some(j) = self.jobs.get_mut(&id) {
            j.revision = rev;
            j.updated_at = now;
            if let Some(b) = j.federation.as_mut() {
                b.released = Some(why);
            }
        }
        Ok((Response::Done, Effect::Changed))
    }
}
