//! A region's link to the federation (docs/federation.md), run by the region's leader when
//! `[federation]` is configured: every `sync_interval_ms` it sends `Federation.Sync` (the region's
//! capacity per pool and device model, backlog, teams' local use, and every federated job it
//! holds with its epoch, status and latest checkpoint), then commits what came back: `fed_renew`
//! for renewed leases, `fed_adopt` for new assignments, `fed_release` for refusals and
//! cancellations, `fed_quota_leases` for its shares of the global quotas (which
//! [`hold_for_quota_leases`] enforces on region-local work before each scheduling pass). A held
//! job whose lease gets within `stop_before_ms` of its end without a renewal is released here
//! too (`lease_expired`); the agents have already stopped its tasks by then on their own (the
//! lease travels in AllocInfo and heartbeats).

use crate::core::{Core, LEADER_HEADER};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use suanli_model::{CheckpointHardware, DeviceKind, JobSpec, Unplaced};
use suanli_proto::v1 as pb;
use suanli_proto::v1::federation_client::FederationClient;
use suanli_scheduler::ClusterView;
use suanli_state::federated::{FedAdopt, FedQuotaLease, FedQuotaLeases, FedRelease, FedRenew};
use suanli_state::{Batch, CheckpointRecord, Command, Job, JobState, Response, State};
use tokio::sync::watch;

/// The sync interval before the federation's first answer names its own.
pub const FIRST_SYNC_INTERVAL_MS: u64 = 1_000;
/// The drift bound before the federation's first answer names its own.
const DEFAULT_DRIFT_MS: u64 = 500;
/// A repeated link error is logged at warn at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// The kill grace every federated task gets after its checkpoint grace.
const KILL_GRACE_MS: u64 = 1_000;

/// The sync interval the federation asked for last (shared with the scheduling loop, which
/// holds back a federated job whose lease would run out before the next renewal).
static SYNC_INTERVAL_MS: AtomicU64 = AtomicU64::new(FIRST_SYNC_INTERVAL_MS);
/// The drift bound the federation named last (the scheduling loop treats a quota lease as over
/// this long before its end).
static DRIFT_MS: AtomicU64 = AtomicU64::new(DEFAULT_DRIFT_MS);

/// The clock drift bound in force (the federation's latest answer, 500 ms before one).
pub(crate) fn drift_ms() -> u64 {
    DRIFT_MS.load(Ordering::Relaxed)
}

/// How much lease, beyond a job's `stop_before_ms`, a pending federated job needs to be placed:
/// one sync interval (the time until the next renewal).
pub(crate) fn placement_margin_ms() -> u64 {
    SYNC_INTERVAL_MS.load(Ordering::Relaxed)
}

/// The reason a federated job waits while its lease is short.
pub const WAITING_FOR_LEASE: &str = "waiting for a federation lease";

/// Takes out of `view` every pending federated job whose lease has at most
/// `stop_before_ms + margin_ms` left at `now_ms` (or that was released), and returns them as
/// unplaced with [`WAITING_FOR_LEASE`].
pub(crate) fn hold_short_leases(s: &State, view: &mut ClusterView, now_ms: u64, margin_ms: u64) -> Vec<Unplaced> {
    let mut held = Vec::new();
    view.pending.retain(|p| {
        let Some(b) = s.job(p.id).and_then(|j| j.federation.as_ref()) else {
            return true;
        };
        let left = b.lease_until_ms.saturating_sub(now_ms);
        let ok = b.released.is_none() && left > b.stop_before_ms.saturating_add(margin_ms);
        if !ok {
            held.push(Unplaced { job: p.id, reason: WAITING_FOR_LEASE.into() });
        }
        ok
    });
    held
}

/// A pending job's device kind and the most device share it can hold (every replica of an
/// elastic job counted), or `None` for a job without devices.
fn device_demand(spec: &JobSpec) -> Option<(DeviceKind, u64)> {
    let kind = spec.groups.iter().find_map(|g| g.resources.devices.as_ref()).map(|d| d.kind)?;
    let total = spec.total();
    let milli = match kind {
        DeviceKind::Gpu => total.gpu_milli,
        DeviceKind::Npu => total.npu_milli,
    };
    (milli > 0).then_some((kind, milli))
}

/// Region-local use of each (team, device model): the device shares of live allocations of jobs
/// that are not federated (the federation counts those itself).
pub(crate) fn local_use(s: &State) -> BTreeMap<(String, String), u64> {
    let mut usage: BTreeMap<(String, String), u64> = BTreeMap::new();
    for r in s.nodes().values() {
        let n = &r.node;
        for a in s.allocs_on(&n.id).filter(|a| a.is_live()) {
            if s.job(a.alloc.job).is_none_or(|j| j.federation.is_some()) {
                continue;
            }
            let team = crate::access::queue_team(s, &a.alloc.queue).unwrap_or_default();
            for d in &a.alloc.devices {
                if let Some(dev) = n.devices.iter().find(|x| x.id == d.device) {
                    *usage.entry((team.clone(), dev.model.clone())).or_default() += u64::from(d.milli);
                }
            }
        }
    }
    usage
}

/// The device models of the region's nodes, by kind.
fn models_by_kind(s: &State) -> BTreeMap<DeviceKind, BTreeSet<String>> {
    let mut out: BTreeMap<DeviceKind, BTreeSet<String>> = BTreeMap::new();
    for r in s.nodes().values() {
        for d in &r.node.devices {
            out.entry(d.kind).or_default().insert(d.model.clone());
        }
    }
    out
}

/// Enforces the federation's quota leases on region-local work (docs/federation.md, "Global
/// quotas and quota leases"). For each pending local job of a team with a lease, in the view's
/// order: a leased model whose room (the lease, less the team's local use and what earlier jobs
/// of this pass may take) is below the job's whole device demand is taken out of the job's
/// allowed models; a job left with none is taken out of `view` and returned as unplaced with
/// the reason. A lease counts only while `now_ms + drift_ms` is before its end: an expired
/// lease admits nothing more until a sync renews it. Pessimistic within a pass (a job is
/// charged on every leased model it may land on), so the pass never overshoots a lease.
pub(crate) fn hold_for_quota_leases(s: &State, view: &mut ClusterView, now_ms: u64, drift_ms: u64) -> Vec<Unplaced> {
    let leases = s.quota_leases();
    if leases.is_empty() {
        return Vec::new();
    }
    let used = local_use(s);
    let mut room: BTreeMap<(String, String), (u64, &FedQuotaLease)> = BTreeMap::new();
    for l in leases {
        let live = now_ms.saturating_add(drift_ms) < l.until_ms;
        let taken = used.get(&(l.team.clone(), l.device_model.clone())).copied().unwrap_or(0);
        let left = if live { l.limit_milli.saturating_sub(taken) } else { 0 };
        room.insert((l.team.clone(), l.device_model.clone()), (left, l));
    }
    let kinds = models_by_kind(s);
    let mut held = Vec::new();
    view.pending.retain_mut(|p| {
        if s.job(p.id).is_none_or(|j| j.federation.is_some()) {
            return true;
        }
        let Some((kind, demand)) = device_demand(&p.spec) else {
            return true;
        };
        let team = crate::access::queue_team(s, &p.spec.queue).unwrap_or_default();
        let allowed: Vec<String> = if p.spec.constraints.device_models.is_empty() {
            kinds.get(&kind).map(|m| m.iter().cloned().collect()).unwrap_or_default()
        } else {
            p.spec.constraints.device_models.clone()
        };
        let key = |m: &str| (team.clone(), m.to_owned());
        let leased: Vec<&str> = allowed.iter().map(String::as_str).filter(|m| room.contains_key(&key(m))).collect();
        if leased.is_empty() {
            return true;
        }
        let short: Vec<&str> = leased.iter().copied().filter(|m| room[&key(m)].0 < demand).collect();
        let keep: Vec<String> = allowed.iter().filter(|m| !short.contains(&m.as_str())).cloned().collect();
        if keep.is_empty() {
            let why: Vec<String> = short
                .iter()
                .map(|m| {
                    let (left, l) = room[&key(m)];
                    if now_ms.saturating_add(drift_ms) >= l.until_ms {
                        format!("{m}: the lease ended at {} ms (the federation is not reachable?)", l.until_ms)
                    } else {
                        format!("{m}: {left} of {} milli left", l.limit_milli)
                    }
                })
                .collect();
            held.push(Unplaced {
                job: p.id,
                reason: format!("{WAITING_FOR_QUOTA_LEASE}: team {team} needs {demand} milli; {}", why.join("; ")),
            });
            return false;
        }
        for m in &leased {
            if !short.contains(m)
                && let Some(r) = room.get_mut(&key(m))
            {
                r.0 -= demand;
            }
        }
        if !short.is_empty() {
            p.spec.constraints.device_models = keep;
        }
        true
    });
    held
}

/// The reason a region-local job waits for its team's share of a global quota.
pub const WAITING_FOR_QUOTA_LEASE: &str = "waiting for the team's quota lease from the federation (a global quota)";

/// The held-job status the federation understands, for a region job.
fn held_status(j: &Job) -> &'static str {
    let lost = j.federation.as_ref().and_then(|b| b.released.as_deref()) == Some("lease_expired");
    match j.state {
        JobState::Running => "running",
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled if lost => "lost",
        JobState::Cancelled => "cancelled",
        JobState::Pending | JobState::Placed | JobState::Preempted | JobState::Requeuing => "assigned",
    }
}

/// The wire form of a checkpoint record.
fn checkpoint_ref(c: &CheckpointRecord) -> pb::CheckpointRef {
    pb::CheckpointRef {
        uri: c.uri.clone(),
        step: c.step,
        size_bytes: c.size_bytes,
        wall_time: c.wall_time,
        hardware_bound: c.hardware.is_some(),
        device_kind: c.hardware.as_ref().map(|h| h.kind.as_str().to_owned()).unwrap_or_default(),
        device_model: c.hardware.as_ref().map(|h| h.model.clone()).unwrap_or_default(),
        device_count: c.hardware.as_ref().map_or(0, |h| h.count),
    }
}

/// A checkpoint reference from the federation as the region records it.
pub(crate) fn checkpoint_record(c: &pb::CheckpointRef, now_s: u64) -> Result<CheckpointRecord, String> {
    let hardware = if c.hardware_bound {
        let kind = match c.device_kind.as_str() {
            "gpu" => DeviceKind::Gpu,
            "npu" => DeviceKind::Npu,
            other => return Err(format!("restore.device_kind: {other:?} is not gpu or npu")),
        };
        Some(CheckpointHardware { kind, model: c.device_model.clone(), count: c.device_count })
    } else {
        None
    };
    Ok(CheckpointRecord {
        uri: c.uri.clone(),
        step: c.step,
        size_bytes: c.size_bytes,
        at: now_s,
        alloc: suanli_model::AllocId(0),
        epoch: 0,
        wall_time: c.wall_time,
        hardware,
    })
}

/// What the link remembers between syncs (in memory only: a new leader starts afresh and
/// reports everything again, which the federation takes idempotently).
#[derive(Debug, Default)]
pub(crate) struct LinkMemory {
    /// Ended federated jobs `(global_id, epoch)` the federation has acknowledged.
    pub reported: BTreeSet<(String, u64)>,
    /// Assignments this region could not adopt, with why: reported once as failed.
    pub failed: BTreeMap<(String, u64), String>,
    /// Device-milli use per (team, model) at the previous sync and when it was.
    pub last_sync_ms: Option<u64>,
}

/// The pure part of a sync: the request from the applied state.
pub(crate) fn build_request(
    s: &State,
    link: &crate::config::FederationLink,
    endpoints: Vec<String>,
    mem: &LinkMemory,
    now_ms: u64,
) -> pb::RegionSyncRequest {
    let mut pools = BTreeSet::new();
    // (pool, kind, model) -> (total, free, max free on one node, free cpu, free memory)
    let mut cap: BTreeMap<(String, String, String), [u64; 5]> = BTreeMap::new();
    let usage = local_use(s);
    let wanted = local_wants(s, &usage);
    for r in s.nodes().values() {
        let n = &r.node;
        pools.insert(n.pool.0.clone());
        let mut used: BTreeMap<&str, u64> = BTreeMap::new();
        let (mut cpu, mut mem_mib) = (0u64, 0u64);
        for a in s.allocs_on(&n.id).filter(|a| a.is_live()) {
            cpu = cpu.saturating_add(a.alloc.cpu_milli);
            mem_mib = mem_mib.saturating_add(a.alloc.memory_mib);
            for d in &a.alloc.devices {
                *used.entry(d.device.as_str()).or_default() += u64::from(d.milli);
            }
        }
        if !r.accepts_work() {
            continue;
        }
        let free_cpu = n.cpu_milli.saturating_sub(cpu);
        let free_mem = n.memory_mib.saturating_sub(mem_mib);
        let mut per_node: BTreeMap<(String, String), [u64; 2]> = BTreeMap::new();
        for d in n.devices.iter().filter(|d| d.health == suanli_model::Health::Healthy) {
            // A partitioned device's parent is not offered whole: its partitions are.
            if n.devices.iter().any(|x| x.partition_of.as_deref() == Some(d.id.as_str())) {
                continue;
            }
            let e = per_node.entry((d.kind.as_str().to_owned(), d.model.clone())).or_default();
            e[0] += 1000;
            e[1] += 1000u64.saturating_sub(used.get(d.id.as_str()).copied().unwrap_or(0));
        }
        if n.devices.is_empty() {
            per_node.insert((String::new(), String::new()), [0, 0]);
        }
        for ((kind, model), [total, free]) in per_node {
            let e = cap.entry((n.pool.0.clone(), kind, model)).or_default();
            e[0] += total;
            e[1] += free;
            e[2] = e[2].max(free);
            e[3] = e[3].saturating_add(free_cpu);
            e[4] = e[4].saturating_add(free_mem);
        }
    }
    let capacity = cap
        .into_iter()
        .map(|((pool, kind, model), [total, free, max_free, cpu, mem_mib])| pb::CapacityEntry {
            price_micros_per_device_hour: link.prices_micros_per_device_hour.get(&model).copied().unwrap_or(0),
            pool,
            device_kind: kind,
            device_model: model,
            total_milli: total,
            free_milli: free,
            max_node_free_milli: max_free,
            free_cpu_milli: cpu,
            free_memory_mib: mem_mib,
        })
        .collect();
    let elapsed_s = mem.last_sync_ms.map_or(0, |t| now_ms.saturating_sub(t) / 1000);
    let mut keys: BTreeSet<&(String, String)> = usage.keys().collect();
    keys.extend(wanted.keys());
    let usage = keys
        .into_iter()
        .map(|k| {
            let used = usage.get(k).copied().unwrap_or(0);
            pb::TeamUsage {
                team: k.0.clone(),
                device_model: k.1.clone(),
                used_milli: used,
                device_milli_s: used.saturating_mul(elapsed_s),
                wanted_milli: wanted.get(k).map_or(0, |w| w.0).max(used),
                min_pending_milli: wanted.get(k).map_or(0, |w| w.1),
            }
        })
        .collect();
    let mut backlog = 0u32;
    let mut held = Vec::new();
    for j in s.jobs().values() {
        if j.state == JobState::Pending && j.federation.is_none() {
            backlog = backlog.saturating_add(1);
        }
        let Some(b) = &j.federation else {
            continue;
        };
        if j.state.is_terminal() && mem.reported.contains(&(b.global_id.clone(), b.epoch)) {
            continue;
        }
        held.push(pb::HeldJob {
            global_id: b.global_id.clone(),
            epoch: b.epoch,
            status: held_status(j).into(),
            message: j.reason.clone(),
            checkpoint: j.latest_checkpoint.as_ref().map(checkpoint_ref),
            local_job_id: j.id.0,
        });
    }
    for ((gid, epoch), why) in &mem.failed {
        held.push(pb::HeldJob {
            global_id: gid.clone(),
            epoch: *epoch,
            status: "failed".into(),
            message: why.clone(),
            checkpoint: None,
            local_job_id: 0,
        });
    }
    pb::RegionSyncRequest {
        region: link.region.clone(),
        endpoints,
        labels: link.labels.clone().into_iter().collect(),
        pools: pools.into_iter().collect(),
        capacity,
        backlog,
        usage,
        held,
        sent_at_ms: now_ms,
        cost: region_cost(s, now_ms / 1000),
        quota_leases: s
            .quota_leases()
            .iter()
            .map(|l| pb::QuotaLease {
                team: l.team.clone(),
                device_model: l.device_model.clone(),
                limit_milli: l.limit_milli,
                until_ms: l.until_ms,
            })
            .collect(),
    }
}

/// What each team with a quota lease wants of the leased model: its local use plus the whole
/// device demand of its pending local jobs that may run on the model.
/// Also the smallest such job's demand per (team, model) (0: none pending).
fn local_wants(s: &State, usage: &BTreeMap<(String, String), u64>) -> BTreeMap<(String, String), (u64, u64)> {
    let mut wanted: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    if s.quota_leases().is_empty() {
        return wanted;
    }
    for l in s.quota_leases() {
        let k = (l.team.clone(), l.device_model.clone());
        let used = usage.get(&k).copied().unwrap_or(0);
        wanted.insert(k, (used, 0));
    }
    let kinds = models_by_kind(s);
    for j in s.jobs().values().filter(|j| j.state == JobState::Pending && j.federation.is_none()) {
        let Some((kind, demand)) = device_demand(&j.spec) else { continue };
        let team = crate::access::queue_team(s, &j.spec.queue).unwrap_or_default();
        let models = &j.spec.constraints.device_models;
        for l in s.quota_leases().iter().filter(|l| l.team == team) {
            let of_kind = kinds.get(&kind).is_some_and(|m| m.contains(&l.device_model));
            if of_kind && (models.is_empty() || models.contains(&l.device_model)) {
                let slot = wanted.entry((l.team.clone(), l.device_model.clone())).or_default();
                slot.0 = slot.0.saturating_add(demand);
                slot.1 = if slot.1 == 0 { demand } else { slot.1.min(demand) };
            }
        }
    }
    wanted
}

/// Most teams a sync's cost totals list (the federation's bound, `cost.teams`).
const MAX_COST_TEAMS: usize = 10_000;

/// The region's cost ledger totals by team for the federation's global roll-up (none without a
/// price catalog): exact base units, from the ledger's start to its clock.
fn region_cost(s: &State, now_s: u64) -> Option<pb::RegionCost> {
    use suanli_state::cost::{BASE_PER_MICRO, ReportBy};
    let ledger = s.ledger();
    if ledger.prices.is_empty() {
        return None;
    }
    // Up to the leader's clock (the replicated one stands still in an idle region).
    let r = s.ledger().report(ReportBy::Team, 0, 0, now_s.max(s.clock()));
    // The federation takes at most MAX_COST_TEAMS rows: the smallest teams beyond are summed
    // into "(more)" (the sum still conserves).
    let mut rows: Vec<(String, suanli_state::cost::Amounts)> = r.rows.into_iter().collect();
    if rows.len() > MAX_COST_TEAMS {
        rows.sort_by_key(|(k, a)| (std::cmp::Reverse(a.total()), k.clone()));
        let mut more = suanli_state::cost::Amounts::default();
        for (_, a) in rows.drain(MAX_COST_TEAMS - 1..) {
            more.merge(&a);
        }
        rows.push(("(more)".to_owned(), more));
    }
    let teams = rows
        .iter()
        .map(|(team, a)| pb::CostRow {
            key: team.clone(),
            amounts: None,
            base: Some(pb::CostAmounts {
                useful: a.useful.to_string(),
                lost_preemption: a.lost_preemption.to_string(),
                lost_failure: a.lost_failure.to_string(),
                running: a.running.to_string(),
                idle: a.idle.to_string(),
                total: a.total().to_string(),
            }),
        })
        .collect();
    Some(pb::RegionCost {
        currency: ledger.prices.currency.clone(),
        until: r.until,
        capacity_base: r.capacity.to_string(),
        teams,
        base_per_micro: BASE_PER_MICRO.to_string(),
    })
}

/// The pure part of an answer: the commands that record it. `adopts` come first in their
/// own list so that each answer can be matched to its assignment.
pub(crate) struct Answer {
    /// Renewals, releases (refused, cancelled).
    pub commands: Vec<Command>,
    /// One per assignment that could be turned into a command: its key and the command.
    pub adopts: Vec<((String, u64), Command)>,
    /// Assignments that could not (a spec that does not parse): key and why.
    pub failed: Vec<((String, u64), String)>,
}

/// Commands for a sync answer, against the state `s` (to find the epoch of a cancelled job).
pub(crate) fn answer_commands(s: &State, r: &pb::RegionSyncResponse, now_s: u64) -> Answer {
    let drift = if r.max_clock_drift_ms == 0 { DEFAULT_DRIFT_MS } else { r.max_clock_drift_ms };
    let mut commands = Vec::new();
    if !r.quota_leases.is_empty() || !s.quota_leases().is_empty() {
        let leases: Vec<FedQuotaLease> = r
            .quota_leases
            .iter()
            .map(|l| FedQuotaLease {
                team: l.team.clone(),
                device_model: l.device_model.clone(),
                limit_milli: l.limit_milli,
                until_ms: l.until_ms,
            })
            .collect();
        if leases != s.quota_leases() {
            commands.push(Command::FedQuotaLeases(FedQuotaLeases { leases, now: now_s }));
        }
    }
    if !r.leases.is_empty() {
        let leases = r.leases.iter().map(|g| (g.global_id.clone(), g.epoch, g.until_ms)).collect();
        commands.push(Command::FedRenew(FedRenew { leases, now: now_s }));
    }
    for f in &r.refused {
        commands.push(Command::FedRelease(FedRelease {
            global_id: f.global_id.clone(),
            epoch: f.epoch,
            reason: format!("refused: {}", f.reason),
            now: now_s,
        }));
    }
    for gid in &r.cancel {
        for j in s.fed_jobs(gid).filter(|j| !j.state.is_terminal()) {
            if let Some(b) = &j.federation {
                commands.push(Command::FedRelease(FedRelease {
                    global_id: gid.clone(),
                    epoch: b.epoch,
                    reason: "cancelled".into(),
                    now: now_s,
                }));
            }
        }
    }
    let mut adopts = Vec::new();
    let mut failed = Vec::new();
    for a in &r.assignments {
        let key = (a.global_id.clone(), a.epoch);
        let mut spec: JobSpec = match serde_json::from_str(&a.spec_json) {
            Ok(spec) => spec,
            Err(e) => {
                failed.push((key, format!("spec_json: {e}")));
                continue;
            }
        };
        if !a.device_model.is_empty() {
            spec.constraints.device_models = vec![a.device_model.clone()];
        }
        let restore = match a.restore.as_ref().map(|c| checkpoint_record(c, now_s)).transpose() {
            Ok(r) => r,
            Err(e) => {
                failed.push((key, e));
                continue;
            }
        };
        let grace_ms = spec.checkpoint.as_ref().map_or(0, |c| c.grace_s.saturating_mul(1000));
        let stop_before_ms = drift.saturating_add(grace_ms).saturating_add(KILL_GRACE_MS);
        adopts.push((
            key,
            Command::FedAdopt(Box::new(FedAdopt {
                global_id: a.global_id.clone(),
                epoch: a.epoch,
                spec,
                team: a.team.clone(),
                lease_until_ms: a.until_ms,
                stop_before_ms,
                restore,
                now: now_s,
                // The region job's root span: a child of the federated submitter's span, in
                // its trace (the span id is drawn here, by the leader, not by the state).
                trace: crate::telemetry::parse_traceparent(&a.traceparent)
                    .and_then(|p| crate::telemetry::new_job_root(Some(&p))),
            })),
        ));
    }
    Answer { commands, adopts, failed }
}

/// Releases for the jobs whose lease ran to within `stop_before_ms` of its end at `now_ms`.
pub(crate) fn expired_leases(s: &State, now_ms: u64, now_s: u64) -> Vec<Command> {
    s.jobs()
        .values()
        .filter(|j| !j.state.is_terminal())
        .filter_map(|j| j.federation.as_ref())
        .filter(|b| b.released.is_none() && b.lease_until_ms.saturating_sub(b.stop_before_ms) <= now_ms)
        .map(|b| {
            Command::FedRelease(FedRelease {
                global_id: b.global_id.clone(),
                epoch: b.epoch,
                reason: "lease_expired".into(),
                now: now_s,
            })
        })
        .collect()
}

/// Rate-limits the link's warnings (once per [`WARN_EVERY`] for the same kind).
#[derive(Default)]
struct Warn {
    last: Option<(String, Instant)>,
}

impl Warn {
    fn warn(&mut self, kind: &str, message: &str) {
        let due = match &self.last {
            Some((k, at)) => k != kind || at.elapsed() >= WARN_EVERY,
            None => true,
        };
        if due {
            tracing::warn!(%message, "federation link: {kind}");
            self.last = Some((kind.to_owned(), Instant::now()));
        } else {
            tracing::debug!(%message, "federation link: {kind}");
        }
    }
}

/// One `Federation.Sync`, trying the last good endpoint first, then the others, following a
/// leader hint once per endpoint.
async fn call_sync(
    core: &Core,
    link: &crate::config::FederationLink,
    start: &mut usize,
    req: &pb::RegionSyncRequest,
) -> Result<pb::RegionSyncResponse, (String, tonic::Status)> {
    let timeout = Duration::from_millis(link.request_timeout_ms);
    let n = link.endpoints.len();
    let mut last = None;
    for k in 0..n {
        let i = (*start + k) % n;
        let mut addr = link.endpoints[i].clone();
        for _hop in 0..2 {
            let channel = match core.channel(&addr) {
                Ok(c) => c,
                Err(e) => {
                    last = Some((addr.clone(), e));
                    break;
                }
            };
            let mut client = FederationClient::new(channel)
                .max_decoding_message_size(core.cfg.max_reply_bytes())
                .max_encoding_message_size(core.cfg.max_request_bytes);
            let mut request = tonic::Request::new(req.clone());
            request.set_timeout(timeout);
            match tokio::time::timeout(timeout, client.sync(request)).await {
                Ok(Ok(r)) => {
                    *start = i;
                    return Ok(r.into_inner());
                }
                Ok(Err(e)) => {
                    let hint = (e.code() == tonic::Code::Unavailable)
                        .then(|| e.metadata().get(LEADER_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned))
                        .flatten()
                        .filter(|h| !h.is_empty() && *h != addr);
                    last = Some((addr.clone(), e));
                    match hint {
                        Some(h) => addr = h,
                        None => break,
                    }
                }
                Err(_) => {
                    last =
                        Some((addr.clone(), tonic::Status::deadline_exceeded("no answer within request_timeout_ms")));
                    break;
                }
            }
        }
    }
    Err(last.unwrap_or_else(|| (String::new(), tonic::Status::unavailable("federation.endpoints: none configured"))))
}

/// Commits `cmds` in batches of at most the state's plan limit; returns each command's answer
/// (a batch that did not commit answers none of its commands).
async fn commit(core: &Core, cmds: Vec<Command>) -> Vec<Option<Response>> {
    let per = core.state.read(|s| s.config().max_plan_entries).max(1);
    let mut out = Vec::with_capacity(cmds.len());
    let mut cmds = cmds.into_iter().peekable();
    while cmds.peek().is_some() {
        let chunk: Vec<Command> = cmds.by_ref().take(per).collect();
        let n = chunk.len();
        match core.propose_local(Command::Batch(Batch { commands: chunk })).await {
            Ok((Response::Batch(rs), _)) => out.extend(rs.into_iter().map(Some)),
            Ok((other, _)) => {
                tracing::warn!(answer = ?other, "federation link: batch refused");
                out.extend(std::iter::repeat_n(None, n));
            }
            Err(e) => {
                tracing::info!(error = %e.message(), "federation link: batch not committed (leadership change?)");
                out.extend(std::iter::repeat_n(None, n));
            }
        }
    }
    out
}

/// The link loop (returns at once when `[federation]` is not configured).
pub async fn link(core: Arc<Core>, stop: watch::Receiver<bool>) {
    if core.cfg.federation.is_none() {
        return;
    }
    let Some(link) = core.cfg.federation.clone() else {
        return;
    };
    let mut mem = LinkMemory::default();
    let mut warn = Warn::default();
    let mut start = 0usize;
    let mut stop = stop;
    loop {
        if *stop.borrow() {
            return;
        }
        if !core.is_leader() {
            // A new leader starts afresh: it reports everything again.
            mem = LinkMemory::default();
            if !crate::loops::until_leader(&core, &mut stop).await {
                return;
            }
        }
        let interval = Duration::from_millis(SYNC_INTERVAL_MS.load(Ordering::Relaxed));
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
        if !core.is_leader() || core.halted().is_some() {
            continue;
        }
        // Leases first: a job whose lease runs out is released whether or not the federation
        // answers (its agents stop its tasks on their own).
        let now_ms = crate::loops::wall_ms();
        let now_s = core.now_s();
        let expired = core.state.read(|s| expired_leases(s, now_ms, now_s));
        if !expired.is_empty() {
            commit(&core, expired).await;
        }
        let endpoints = core.member_addrs();
        let req = core.state.read(|s| build_request(s, &link, endpoints, &mem, now_ms));
        let ended: Vec<(String, u64)> = req
            .held
            .iter()
            .filter(|h| !matches!(h.status.as_str(), "assigned" | "running"))
            .map(|h| (h.global_id.clone(), h.epoch))
            .collect();
        let answer = match call_sync(&core, &link, &mut start, &req).await {
            Ok(a) => a,
            Err((addr, e)) => {
                let kind = if e.code() == tonic::Code::PermissionDenied {
                    "the federation endpoint refused this region (is it a federation server?)"
                } else {
                    "sync failed"
                };
                warn.warn(kind, &format!("{addr}: {}: {}", e.code(), e.message()));
                continue;
            }
        };
        mem.last_sync_ms = Some(now_ms);
        for k in ended {
            mem.failed.remove(&k);
            mem.reported.insert(k);
        }
        if answer.sync_interval_ms > 0 {
            SYNC_INTERVAL_MS.store(answer.sync_interval_ms.clamp(50, 60_000), Ordering::Relaxed);
        }
        if answer.max_clock_drift_ms > 0 {
            DRIFT_MS.store(answer.max_clock_drift_ms.min(60_000), Ordering::Relaxed);
        }
        let Answer { mut commands, adopts, failed } = {
            let now_s = core.now_s();
            core.state.read(|s| answer_commands(s, &answer, now_s))
        };
        mem.failed.extend(failed);
        let first_adopt = commands.len();
        let keys: Vec<(String, u64)> = adopts.iter().map(|(k, _)| k.clone()).collect();
        commands.extend(adopts.into_iter().map(|(_, c)| c));
        if commands.is_empty() {
            continue;
        }
        let answers = commit(&core, commands).await;
        for (key, r) in keys.into_iter().zip(answers.into_iter().skip(first_adopt)) {
            if let Some(Response::Rejected(e)) = r {
                tracing::warn!(global_id = %key.0, epoch = key.1, error = %e, "federation link: assignment not adopted");
                mem.failed.insert(key, e.to_string());
            }
        }
        core.kick.notify_one();
        // Keep the memory bounded by what the state still holds.
        let held: BTreeSet<(String, u64)> = core.state.read(|s| {
            s.jobs().values().filter_map(|j| j.federation.as_ref().map(|b| (b.global_id.clone(), b.epoch))).collect()
        });
        mem.reported.retain(|k| held.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use suanli_model::{
        Device, DeviceRequest, JobKind, Node, NodeId, PoolId, Queue, QueueId, ResVec, TaskGroup, TaskResources,
    };
    use suanli_state::{RegisterNode, SubmitJob, UpsertQueue};

    fn spec(queue: &str, gpus: u32) -> JobSpec {
        JobSpec {
            name: "j".into(),
            queue: QueueId::from(queue),
            kind: JobKind::Training,
            priority: 0,
            preemptible: true,
            gang: true,
            groups: vec![TaskGroup {
                task: None,
                name: "w".into(),
                replicas: 1,
                min_replicas: None,
                resources: TaskResources {
                    cpu_milli: 1000,
                    memory_mib: 1024,
                    devices: Some(DeviceRequest { kind: DeviceKind::Gpu, count: gpus, milli: 1000, memory_mib: 0 }),
                },
            }],
            constraints: Default::default(),
            runtime_estimate_s: None,
            checkpoint: None,
            service: None,
        }
    }

    fn node(id: &str, pool: &str, gpus: u32) -> Node {
        Node {
            id: NodeId::from(id),
            pool: PoolId::from(pool),
            datacenter: "dc".into(),
            region: "r".into(),
            labels: Default::default(),
            cpu_milli: 8_000,
            memory_mib: 64 * 1024,
            devices: (0..gpus).map(|i| Device::simple(format!("gpu{i}"), DeviceKind::Gpu, "H100")).collect(),
            schedulable: true,
            agent_addr: String::new(),
        }
    }

    fn state() -> State {
        let mut s = State::default();
        let mut q = Queue::new("q", ResVec::MAX);
        q.team = "ml".into();
        s.apply(Command::UpsertQueue(UpsertQueue { queue: q }));
        for (id, pool, gpus) in [("n1", "a", 4), ("n2", "a", 2), ("n3", "b", 0)] {
            s.apply(Command::RegisterNode(Box::new(RegisterNode { node: node(id, pool, gpus), now: 1, fence: None })));
        }
        s
    }

    fn link() -> crate::config::FederationLink {
        crate::config::FederationLink {
            region: "eu".into(),
            endpoints: vec!["f:1".into()],
            prices_micros_per_device_hour: [("H100".to_owned(), 2_000_000)].into_iter().collect(),
            ..Default::default()
        }
    }

    fn adopt(s: &mut State, gid: &str, until_ms: u64) -> suanli_model::JobId {
        let resp = s.apply(Command::FedAdopt(Box::new(FedAdopt {
            global_id: gid.into(),
            epoch: 1,
            spec: spec("q", 1),
            team: "ml".into(),
            lease_until_ms: until_ms,
            stop_before_ms: 2_000,
            restore: None,
            now: 2,
            trace: None,
        })));
        match resp {
            Response::JobSubmitted { job, .. } => job,
            other => panic!("not adopted: {other:?}"),
        }
    }

    fn place(s: &mut State, now: u64) {
        let view = s.cluster_view(now);
        let plan = suanli_scheduler::schedule(&view, now, 1, &Default::default()).expect("engine");
        s.apply(Command::ApplyPlan(suanli_state::ApplyPlan { plan, now }));
    }

    #[test]
    fn the_request_reports_capacity_usage_backlog_and_held_jobs() {
        let mut s = state();
        s.apply(Command::SubmitJob(Box::new(SubmitJob {
            client_request_id: "local".into(),
            spec: spec("q", 2),
            retry: None,
            now: 2,
            trace: None,
        })));
        let fed = adopt(&mut s, "g-1", 60_000);
        place(&mut s, 3);
        s.apply(Command::SubmitJob(Box::new(SubmitJob {
            client_request_id: "waits".into(),
            spec: spec("q", 8),
            retry: None,
            now: 4,
            trace: None,
        })));
        let r = build_request(
            &s,
            &link(),
            vec!["s:1".into()],
            &LinkMemory { last_sync_ms: Some(0), ..Default::default() },
            10_000,
        );
        assert_eq!(r.region, "eu");
        assert_eq!(r.pools, vec!["a".to_owned(), "b".to_owned()]);
        let h100 = r.capacity.iter().find(|c| c.pool == "a" && c.device_model == "H100").expect("pool a H100");
        assert_eq!((h100.total_milli, h100.free_milli), (6000, 3000), "3 of 6 devices are allocated");
        assert_eq!(h100.price_micros_per_device_hour, 2_000_000);
        assert!(h100.max_node_free_milli <= 3000 && h100.max_node_free_milli >= 1000);
        assert!(r.capacity.iter().any(|c| c.pool == "b" && c.device_kind.is_empty()), "a CPU-only pool is listed");
        assert_eq!(r.backlog, 1, "the local job that does not fit");
        let u = r.usage.iter().find(|u| u.team == "ml" && u.device_model == "H100").expect("local use");
        assert_eq!(u.used_milli, 2000, "only the local job's devices");
        assert_eq!(u.device_milli_s, 2000 * 10);
        assert_eq!(r.held.len(), 1);
        assert_eq!((r.held[0].global_id.as_str(), r.held[0].epoch, r.held[0].local_job_id), ("g-1", 1, fed.0));
        assert_eq!(r.held[0].status, "assigned");
    }

    fn submit(s: &mut State, rid: &str, gpus: u32, now: u64) -> suanli_model::JobId {
        match s.apply(Command::SubmitJob(Box::new(SubmitJob {
            client_request_id: rid.into(),
            spec: spec("q", gpus),
            retry: None,
            now,
            trace: None,
        }))) {
            Response::JobSubmitted { job, .. } => job,
            other => panic!("not submitted: {other:?}"),
        }
    }

    fn lease_answer(limit_milli: u64, until_ms: u64) -> pb::RegionSyncResponse {
        pb::RegionSyncResponse {
            quota_leases: vec![pb::QuotaLease {
                team: "ml".into(),
                device_model: "H100".into(),
                limit_milli,
                until_ms,
            }],
            max_clock_drift_ms: 500,
            ..Default::default()
        }
    }

    #[test]
    fn quota_leases_bound_a_teams_local_work_and_an_expired_one_admits_nothing() {
        let mut s = state();
        let first = submit(&mut s, "one", 2, 2);
        let second = submit(&mut s, "two", 2, 2);
        // Without a lease nothing is held; the wants are reported only for leased quotas.
        let mut view = s.cluster_view(3);
        assert!(hold_for_quota_leases(&s, &mut view, 10_000, 500).is_empty());
        assert!(build_request(&s, &link(), vec![], &LinkMemory::default(), 1).usage.is_empty());
        // The answer's lease becomes one command; repeating it changes nothing.
        let a = answer_commands(&s, &lease_answer(3_000, 60_000), 3);
        assert!(matches!(&a.commands[..], [Command::FedQuotaLeases(c)] if c.leases.len() == 1));
        for c in a.commands {
            assert!(!matches!(s.apply(c), Response::Rejected(_)));
        }
        assert!(answer_commands(&s, &lease_answer(3_000, 60_000), 4).commands.is_empty());
        let r = build_request(&s, &link(), vec![], &LinkMemory::default(), 1);
        let u = r.usage.iter().find(|u| u.team == "ml" && u.device_model == "H100").expect("want");
        assert_eq!((u.used_milli, u.wanted_milli), (0, 4_000), "two pending jobs of 2 GPUs");
        assert_eq!(r.quota_leases.len(), 1, "the lease enforced is reported back");
        // 3 of 4 wanted GPUs leased: the first job is planned, the second waits, naming why.
        let mut view = s.cluster_view(3);
        let held = hold_for_quota_leases(&s, &mut view, 10_000, 500);
        assert_eq!(view.pending.iter().map(|p| p.id).collect::<Vec<_>>(), vec![first]);
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].job, second);
        assert!(held[0].reason.starts_with(WAITING_FOR_QUOTA_LEASE), "{}", held[0].reason);
        assert!(held[0].reason.contains("H100: 1000 of 3000 milli left"), "{}", held[0].reason);
        // The first runs; its use counts against the lease.
        let plan = suanli_scheduler::schedule(&view, 3, 1, &Default::default()).expect("engine");
        s.apply(Command::ApplyPlan(suanli_state::ApplyPlan { plan, now: 3 }));
        let mut view = s.cluster_view(4);
        let held = hold_for_quota_leases(&s, &mut view, 10_000, 500);
        assert!(held[0].reason.contains("1000 of 3000 milli left"), "{}", held[0].reason);
        // Past the lease's end less the drift bound, nothing more is admitted.
        s.apply(Command::CancelJob(suanli_state::CancelJob { job: first, reason: String::new(), now: 5 }));
        let mut view = s.cluster_view(6);
        let held = hold_for_quota_leases(&s, &mut view, 59_500, 500);
        assert!(held.iter().any(|h| h.job == second && h.reason.contains("the lease ended")), "{held:?}");
        // An answer without leases clears them.
        let a = answer_commands(&s, &pb::RegionSyncResponse::default(), 7);
        for c in a.commands {
            s.apply(c);
        }
        assert!(s.quota_leases().is_empty());
    }

    #[test]
    fn ended_jobs_are_reported_until_acknowledged() {
        let mut s = state();
        adopt(&mut s, "g-1", 60_000);
        s.apply(Command::FedRelease(FedRelease {
            global_id: "g-1".into(),
            epoch: 1,
            reason: "lease_expired".into(),
            now: 3,
        }));
        let mut mem = LinkMemory::default();
        let r = build_request(&s, &link(), vec![], &mem, 1);
        assert_eq!(r.held.len(), 1);
        assert_eq!(r.held[0].status, "lost");
        mem.reported.insert(("g-1".into(), 1));
        mem.failed.insert(("g-2".into(), 4), "queue: unknown queue \"x\"".into());
        let r = build_request(&s, &link(), vec![], &mem, 1);
        assert_eq!(r.held.len(), 1);
        assert_eq!((r.held[0].global_id.as_str(), r.held[0].status.as_str()), ("g-2", "failed"));
    }

    #[test]
    fn answers_become_renewals_releases_and_adoptions() {
        let mut s = state();
        adopt(&mut s, "g-1", 60_000);
        let mut sp = spec("q", 1);
        sp.checkpoint = Some(suanli_model::CheckpointPolicy {
            interval_s: 60,
            grace_s: 5,
            restore_s: 1,
            signal: Default::default(),
        });
        let answer = pb::RegionSyncResponse {
            leases: vec![pb::LeaseGrant { global_id: "g-1".into(), epoch: 1, until_ms: 90_000 }],
            refused: vec![pb::LeaseRefusal { global_id: "g-9".into(), epoch: 2, reason: "stale".into() }],
            assignments: vec![
                pb::Assignment {
                    global_id: "g-2".into(),
                    epoch: 3,
                    spec_json: serde_json::to_string(&sp).expect("json"),
                    team: "ml".into(),
                    until_ms: 70_000,
                    restore: Some(pb::CheckpointRef { uri: "file:///c".into(), step: 7, ..Default::default() }),
                    device_model: "H100".into(),
                    traceparent: String::new(),
                },
                pb::Assignment { global_id: "g-3".into(), epoch: 1, spec_json: "{".into(), ..Default::default() },
            ],
            max_clock_drift_ms: 300,
            cancel: vec!["g-1".into()],
            ..Default::default()
        };
        let a = answer_commands(&s, &answer, 5);
        assert_eq!(a.commands.len(), 3, "{:?}", a.commands);
        assert!(matches!(&a.commands[0], Command::FedRenew(r) if r.leases == vec![("g-1".to_owned(), 1, 90_000)]));
        assert!(matches!(&a.commands[1], Command::FedRelease(r) if r.reason == "refused: stale"));
        assert!(matches!(&a.commands[2], Command::FedRelease(r) if r.reason == "cancelled" && r.epoch == 1));
        assert_eq!(a.adopts.len(), 1);
        let Command::FedAdopt(ad) = &a.adopts[0].1 else { panic!("an adoption") };
        assert_eq!(ad.spec.constraints.device_models, vec!["H100".to_owned()]);
        assert_eq!(ad.stop_before_ms, 300 + 5_000 + 1_000);
        assert_eq!(ad.restore.as_ref().map(|r| r.step), Some(7));
        assert_eq!(a.failed.len(), 1);
        assert!(a.failed[0].1.starts_with("spec_json"), "{}", a.failed[0].1);
        for c in a.commands.into_iter().chain(a.adopts.into_iter().map(|(_, c)| c)) {
            assert!(!matches!(s.apply(c), Response::Rejected(_)));
        }
        s.invariants().expect("invariants");
    }

    #[test]
    fn short_leases_are_held_back_and_expired_ones_released() {
        let mut s = state();
        let soon = adopt(&mut s, "g-1", 10_000);
        let later = adopt(&mut s, "g-2", 60_000);
        let mut view = s.cluster_view(3);
        let held = hold_short_leases(&s, &mut view, 7_000, 1_000);
        assert_eq!(held.iter().map(|u| u.job).collect::<Vec<_>>(), vec![soon]);
        assert_eq!(held[0].reason, WAITING_FOR_LEASE);
        assert!(view.pending.iter().any(|p| p.id == later) && !view.pending.iter().any(|p| p.id == soon));
        assert!(expired_leases(&s, 7_999, 3).is_empty());
        let ex = expired_leases(&s, 8_000, 3);
        assert!(matches!(&ex[..], [Command::FedRelease(r)] if r.global_id == "g-1" && r.reason == "lease_expired"));
    }
}
