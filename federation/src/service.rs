//! The `Federation` service (client listener) and `FederationPeer` (peer listener): requests
//! are checked (sizes against the replicated [`crate::FedConfig`], names, the caller's team),
//! converted to [`FedCommand`]s and committed through the leader; reads answer from this
//! member's applied state.

use crate::access::Caller;
use crate::command::{FedCommand, FedResponse};
use crate::model::{self, FedJob, FedJobState, RegionSync};
use crate::node::{Node, now_ms};
use crate::state::{FedState, parse_global_id};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use suanli_proto::v1 as pb;
use suanli_proto::v1::federation_peer_server::FederationPeer;
use suanli_proto::v1::federation_server::Federation;
use suanli_security::policy::Decision;
use suanli_security::principal::{Principal, Role, valid_name};
use tonic::{Request, Response, Status};

/// Longest `client_request_id`, in bytes.
pub const MAX_REQUEST_ID: usize = 128;
/// Most `data_labels` (and region labels, endpoints) in one request.
pub const MAX_LABELS: usize = 64;
/// Longest label key or value, region name, endpoint or device model, in bytes.
pub const MAX_NAME: usize = 256;
/// Most jobs one `Jobs` page holds (and its default).
pub const MAX_PAGE: u32 = 1000;

/// The services of one federation server.
#[derive(Clone)]
pub struct FedApi(pub Arc<Node>);

impl FedApi {
    /// Ok on the leader; elsewhere UNAVAILABLE naming the leader's client address (membership
    /// changes run on the leader, and the client follows the hint).
    fn lead_or_redirect(&self) -> Result<(), Status> {
        if self.0.is_leader() {
            return Ok(());
        }
        let leader = self.0.leader_node().map(|(_, n)| n.client_addr().to_owned());
        Err(crate::node::unavailable("this federation server does not lead; ask the leader", leader.as_deref()))
    }
}

fn invalid(field: &str, msg: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {msg}"))
}

fn caller<T>(req: &Request<T>) -> Caller {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .unwrap_or(Caller { principal: Principal::Anonymous, decision: Decision::Unauthenticated })
}

fn check_len(field: &str, s: &str, max: usize) -> Result<(), Status> {
    if s.len() > max {
        return Err(invalid(field, format!("{} bytes is over the limit of {max}", s.len())));
    }
    Ok(())
}

fn check_count(field: &str, n: usize, max: usize) -> Result<(), Status> {
    if n > max {
        return Err(invalid(field, format!("{n} entries is over the limit of {max}")));
    }
    Ok(())
}

fn check_map(field: &str, m: &BTreeMap<String, String>) -> Result<(), Status> {
    check_count(field, m.len(), MAX_LABELS)?;
    for (k, v) in m {
        if k.is_empty() {
            return Err(invalid(field, "an empty key"));
        }
        check_len(&format!("{field}[{k:?}]"), k, MAX_NAME)?;
        check_len(&format!("{field}[{k:?}]"), v, MAX_NAME)?;
    }
    Ok(())
}

/// Who a submission is for: its team and how it is recorded (`submitted_by`).
fn submitter(c: &Caller, r: &pb::FedSubmitRequest) -> Result<(String, String), Status> {
    if !r.on_behalf_of.is_empty() || !r.on_behalf_of_team.is_empty() || !r.on_behalf_of_role.is_empty() {
        let server = match &c.principal {
            Principal::Server { name } => name.clone(),
            Principal::Insecure => "insecure".into(),
            who => {
                return Err(Status::permission_denied(format!(
                    "on_behalf_of: honoured only from a region server's certificate, not from {who}"
                )));
            }
        };
        let role: Role = r.on_behalf_of_role.parse().map_err(|e| invalid("on_behalf_of_role", e))?;
        if !valid_name(&r.on_behalf_of) {
            return Err(invalid("on_behalf_of", format!("{:?} is not a valid user name", r.on_behalf_of)));
        }
        let user_team = (!r.on_behalf_of_team.is_empty()).then(|| r.on_behalf_of_team.clone());
        let team = if r.team.is_empty() { user_team.clone().unwrap_or_default() } else { r.team.clone() };
        match role {
            Role::Admin => {}
            Role::Member => {
                if user_team.as_deref() != Some(team.as_str()) {
                    return Err(Status::permission_denied(format!(
                        "user {} (member of {}) may not submit for team {team:?}",
                        r.on_behalf_of,
                        user_team.as_deref().unwrap_or("no team")
                    )));
                }
            }
            other => {
                return Err(Status::permission_denied(format!(
                    "user {} ({}) may not submit federated jobs (allowed: admin, member)",
                    r.on_behalf_of,
                    other.as_str()
                )));
            }
        }
        return Ok((team, format!("user {} via server {server}", r.on_behalf_of)));
    }
    let own_team = c.principal.team().map(str::to_owned);
    let team = if r.team.is_empty() { own_team.clone().unwrap_or_default() } else { r.team.clone() };
    if let Decision::AllowIfTeam(t) = &c.decision
        && *t != team
    {
        return Err(Status::permission_denied(format!(
            "{} may submit only for its own team {t:?}, not {team:?}",
            c.principal
        )));
    }
    let by = match &c.principal {
        Principal::User { name, .. } => format!("user {name}"),
        Principal::Server { name } => format!("server {name}"),
        other => other.to_string(),
    };
    Ok((team, by))
}

/// The job's view for the API.
pub fn job_info(j: &FedJob) -> pb::FedJobInfo {
    pb::FedJobInfo {
        global_id: j.id.clone(),
        name: j.spec.name.clone(),
        team: j.team.clone(),
        state: j.state.as_str().into(),
        region: j.region.clone().unwrap_or_default(),
        epoch: j.epoch,
        lease_until_ms: j.lease_until_ms,
        reason: j.reason.clone(),
        checkpoint: j.checkpoint.as_ref().map(checkpoint_to_pb),
        history: j
            .history
            .iter()
            .map(|p| pb::FedPlacement {
                region: p.region.clone(),
                epoch: p.epoch,
                from_ms: p.from_ms,
                to_ms: p.to_ms,
                end: p.end.clone(),
            })
            .collect(),
        submitted_at_ms: j.submitted_at_ms,
        device_model: j.device_model.clone().unwrap_or_default(),
        local_job_id: j.local_job_id,
        spec_json: serde_json::to_string(&j.spec).unwrap_or_default(),
        trace_id: j
            .trace
            .as_deref()
            .and_then(suanli_model::trace::TraceParent::parse)
            .map(|t| t.trace_id_hex())
            .unwrap_or_default(),
    }
}

/// Model -> proto.
pub fn checkpoint_to_pb(c: &model::CheckpointRef) -> pb::CheckpointRef {
    pb::CheckpointRef {
        uri: c.uri.clone(),
        step: c.step,
        size_bytes: c.size_bytes,
        wall_time: c.wall_time,
        hardware_bound: c.hardware_bound,
        device_kind: c.device_kind.clone(),
        device_model: c.device_model.clone(),
        device_count: c.device_count,
    }
}

/// Proto -> model.
pub fn checkpoint_from_pb(c: &pb::CheckpointRef) -> model::CheckpointRef {
    model::CheckpointRef {
        uri: c.uri.clone(),
        step: c.step,
        size_bytes: c.size_bytes,
        wall_time: c.wall_time,
        hardware_bound: c.hardware_bound,
        device_kind: c.device_kind.clone(),
        device_model: c.device_model.clone(),
        device_count: c.device_count,
    }
}

/// Model -> proto.
pub fn capacity_to_pb(c: &model::CapacityEntry) -> pb::CapacityEntry {
    pb::CapacityEntry {
        pool: c.pool.clone(),
        device_kind: c.device_kind.clone(),
        device_model: c.device_model.clone(),
        total_milli: c.total_milli,
        free_milli: c.free_milli,
        max_node_free_milli: c.max_node_free_milli,
        free_cpu_milli: c.free_cpu_milli,
        free_memory_mib: c.free_memory_mib,
        price_micros_per_device_hour: c.price_micros_per_device_hour,
    }
}

/// Checks a sync's sizes and names against the terms (before anything is proposed) and
/// converts it.
pub fn sync_from_pb(r: &pb::RegionSyncRequest, cfg: &model::FedConfig) -> Result<RegionSync, Status> {
    if r.region.is_empty() {
        return Err(invalid("region", "required"));
    }
    if !valid_name(&r.region) {
        return Err(invalid("region", format!("{:?} is not a valid name (letters, digits, '.', '_', '-')", r.region)));
    }
    check_count("endpoints", r.endpoints.len(), MAX_LABELS)?;
    for (i, e) in r.endpoints.iter().enumerate() {
        check_len(&format!("endpoints[{i}]"), e, MAX_NAME)?;
    }
    check_map("labels", &r.labels)?;
    check_count("pools", r.pools.len(), cfg.max_pools_per_region)?;
    for (i, p) in r.pools.iter().enumerate() {
        if p.is_empty() {
            return Err(invalid(&format!("pools[{i}]"), "empty"));
        }
        check_len(&format!("pools[{i}]"), p, MAX_NAME)?;
    }
    check_count("capacity", r.capacity.len(), cfg.max_capacity_entries)?;
    for (i, c) in r.capacity.iter().enumerate() {
        check_len(&format!("capacity[{i}].pool"), &c.pool, MAX_NAME)?;
        check_len(&format!("capacity[{i}].device_model"), &c.device_model, MAX_NAME)?;
        if !matches!(c.device_kind.as_str(), "" | "gpu" | "npu") {
            return Err(invalid(
                &format!("capacity[{i}].device_kind"),
                format!("{:?}: one of gpu, npu, or empty", c.device_kind),
            ));
        }
        if c.free_milli > c.total_milli {
            return Err(invalid(
                &format!("capacity[{i}].free_milli"),
                format!("{} is more than total_milli {}", c.free_milli, c.total_milli),
            ));
        }
    }
    check_count("usage", r.usage.len(), cfg.max_held_per_sync)?;
    for (i, u) in r.usage.iter().enumerate() {
        check_len(&format!("usage[{i}].team"), &u.team, MAX_NAME)?;
        check_len(&format!("usage[{i}].device_model"), &u.device_model, MAX_NAME)?;
    }
    check_count("quota_leases", r.quota_leases.len(), cfg.max_quotas)?;
    for (i, l) in r.quota_leases.iter().enumerate() {
        check_len(&format!("quota_leases[{i}].team"), &l.team, MAX_NAME)?;
        check_len(&format!("quota_leases[{i}].device_model"), &l.device_model, MAX_NAME)?;
    }
    check_count("held", r.held.len(), cfg.max_held_per_sync)?;
    for (i, h) in r.held.iter().enumerate() {
        if parse_global_id(&h.global_id).is_none() {
            return Err(invalid(&format!("held[{i}].global_id"), format!("{:?} is not g-<n>", h.global_id)));
        }
        if !matches!(h.status.as_str(), "assigned" | "running" | "succeeded" | "failed" | "cancelled" | "lost") {
            return Err(invalid(
                &format!("held[{i}].status"),
                format!("{:?}: one of assigned, running, succeeded, failed, cancelled, lost", h.status),
            ));
        }
        check_len(&format!("held[{i}].message"), &h.message, 4096)?;
        if let Some(c) = &h.checkpoint {
            check_len(&format!("held[{i}].checkpoint.uri"), &c.uri, 4096)?;
        }
    }
    Ok(RegionSync {
        region: r.region.clone(),
        endpoints: r.endpoints.clone(),
        labels: r.labels.clone(),
        pools: r.pools.clone(),
        capacity: r
            .capacity
            .iter()
            .map(|c| model::CapacityEntry {
                pool: c.pool.clone(),
                device_kind: c.device_kind.clone(),
                device_model: c.device_model.clone(),
                total_milli: c.total_milli,
                free_milli: c.free_milli,
                max_node_free_milli: c.max_node_free_milli,
                free_cpu_milli: c.free_cpu_milli,
                free_memory_mib: c.free_memory_mib,
                price_micros_per_device_hour: c.price_micros_per_device_hour,
            })
            .collect(),
        backlog: r.backlog,
        usage: r
            .usage
            .iter()
            .map(|u| model::TeamUsage {
                team: u.team.clone(),
                device_model: u.device_model.clone(),
                used_milli: u.used_milli,
                device_milli_s: u.device_milli_s,
                wanted_milli: u.wanted_milli.max(u.used_milli),
                min_pending_milli: u.min_pending_milli,
            })
            .collect(),
        held: r
            .held
            .iter()
            .map(|h| model::HeldJob {
                global_id: h.global_id.clone(),
                epoch: h.epoch,
                status: h.status.clone(),
                message: h.message.clone(),
                checkpoint: h.checkpoint.as_ref().map(checkpoint_from_pb),
                local_job_id: h.local_job_id,
            })
            .collect(),
        sent_at_ms: r.sent_at_ms,
        cost: r.cost.as_ref().map(region_cost_from_pb).transpose()?,
        quota_leases: r
            .quota_leases
            .iter()
            .map(|l| model::QuotaLease {
                team: l.team.clone(),
                device_model: l.device_model.clone(),
                limit_milli: l.limit_milli,
                until_ms: l.until_ms,
            })
            .collect(),
    })
}

/// A base-unit amount as the wire carries it (a decimal integer string; empty is 0).
fn base_units(field: &str, s: &str) -> Result<i128, Status> {
    if s.is_empty() {
        return Ok(0);
    }
    s.parse().map_err(|_| invalid(field, format!("{s:?} is not an integer amount of base units")))
}

/// A region's cost totals from the wire; every amount checked.
fn region_cost_from_pb(c: &pb::RegionCost) -> Result<model::RegionCost, Status> {
    check_len("cost.currency", &c.currency, MAX_NAME)?;
    check_count("cost.teams", c.teams.len(), MAX_COST_ROWS)?;
    if c.base_per_micro != BASE_PER_MICRO.to_string() {
        return Err(invalid(
            "cost.base_per_micro",
            format!("{:?}: this federation counts {BASE_PER_MICRO} base units per micro-unit", c.base_per_micro),
        ));
    }
    let mut teams = BTreeMap::new();
    for (i, row) in c.teams.iter().enumerate() {
        check_len(&format!("cost.teams[{i}].key"), &row.key, MAX_NAME)?;
        let b = row.base.clone().unwrap_or_default();
        let f = |name: &str, v: &str| base_units(&format!("cost.teams[{i}].base.{name}"), v);
        let amounts = [
            model::Base(f("useful", &b.useful)?),
            model::Base(f("lost_preemption", &b.lost_preemption)?),
            model::Base(f("lost_failure", &b.lost_failure)?),
            model::Base(f("running", &b.running)?),
            model::Base(f("idle", &b.idle)?),
        ];
        if teams.insert(row.key.clone(), amounts).is_some() {
            return Err(invalid(&format!("cost.teams[{i}].key"), format!("{:?} is listed twice", row.key)));
        }
    }
    Ok(model::RegionCost {
        currency: c.currency.clone(),
        until: c.until,
        capacity: model::Base(base_units("cost.capacity_base", &c.capacity_base)?),
        teams,
    })
}

/// Most rows (teams) of a region's cost totals in one sync.
pub const MAX_COST_ROWS: usize = 10_000;

/// The global cost roll-up (`Federation.Cost`): by team, each region's totals summed (regions
/// pricing in another currency than the first are refused: their sum means nothing); by
/// region, one row per region. Amounts are exact base units, and formatted as decimals.
pub fn cost_report(s: &FedState, by: &str) -> Result<pb::CostReportResponse, Status> {
    let by_region = match by {
        "" | "team" => false,
        "region" => true,
        other => return Err(invalid("by", format!("{other:?}: team or region"))),
    };
    let costs: Vec<(&String, &model::RegionCost)> =
        s.regions.iter().filter_map(|(name, r)| r.cost.as_ref().map(|c| (name, c))).collect();
    let currencies: BTreeSet<&str> = costs.iter().map(|(_, c)| c.currency.as_str()).collect();
    if !by_region && currencies.len() > 1 {
        let each: Vec<String> = costs.iter().map(|(n, c)| format!("{n}: {}", c.currency)).collect();
        return Err(Status::failed_precondition(format!(
            "the regions price in different currencies ({}); a sum by team means nothing: use by=region",
            each.join(", ")
        )));
    }
    let mut rows: BTreeMap<String, [i128; 5]> = BTreeMap::new();
    let mut total = [0i128; 5];
    let mut capacity = 0i128;
    for (name, c) in &costs {
        capacity = capacity.saturating_add(c.capacity.0);
        for (team, a) in &c.teams {
            let key = if by_region { (*name).clone() } else { team.clone() };
            let row = rows.entry(key).or_default();
            for k in 0..5 {
                row[k] = row[k].saturating_add(a[k].0);
                total[k] = total[k].saturating_add(a[k].0);
            }
        }
    }
    let row = |key: String, a: &[i128; 5]| pb::CostRow {
        key,
        amounts: Some(amounts_pb(a, true)),
        base: Some(amounts_pb(a, false)),
    };
    let sum: i128 = total.iter().fold(0i128, |x, y| x.saturating_add(*y));
    Ok(pb::CostReportResponse {
        by: if by_region { "region".into() } else { "team".into() },
        since: 0,
        until: costs.iter().map(|(_, c)| c.until).min().unwrap_or(0),
        horizon: 0,
        currency: if currencies.len() == 1 {
            currencies.into_iter().next().unwrap_or_default().to_owned()
        } else {
            String::new()
        },
        rows: rows.iter().map(|(k, a)| row(k.clone(), a)).collect(),
        total: Some(row("total".into(), &total)),
        capacity: format_base(capacity),
        capacity_base: capacity.to_string(),
        conserved: sum == capacity,
        base_per_micro: BASE_PER_MICRO.to_string(),
    })
}

/// Base units per micro-unit of currency: the region ledgers' (suanli_state::cost::BASE_PER_MICRO);
/// a region's sync names its own and a different one is refused.
pub const BASE_PER_MICRO: i128 = 3600 * 1000 * 1024;

/// Base units as a decimal amount with 6 fractional digits (half away from zero).
fn format_base(base: i128) -> String {
    let micro = (base.abs() + BASE_PER_MICRO / 2) / BASE_PER_MICRO;
    let sign = if base < 0 && micro > 0 { "-" } else { "" };
    format!("{sign}{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

fn amounts_pb(a: &[i128; 5], decimal: bool) -> pb::CostAmounts {
    let f = |v: i128| if decimal { format_base(v) } else { v.to_string() };
    let total = a.iter().fold(0i128, |x, y| x.saturating_add(*y));
    pb::CostAmounts {
        useful: f(a[0]),
        lost_preemption: f(a[1]),
        lost_failure: f(a[2]),
        running: f(a[3]),
        idle: f(a[4]),
        total: f(total),
    }
}

/// A sync's answer with the lease terms.
pub fn sync_answer_to_pb(a: &model::SyncAnswer, cfg: &model::FedConfig, now: u64) -> pb::RegionSyncResponse {
    pb::RegionSyncResponse {
        leases: a
            .leases
            .iter()
            .map(|l| pb::LeaseGrant { global_id: l.global_id.clone(), epoch: l.epoch, until_ms: l.until_ms })
            .collect(),
        refused: a
            .refused
            .iter()
            .map(|l| pb::LeaseRefusal { global_id: l.global_id.clone(), epoch: l.epoch, reason: l.reason.clone() })
            .collect(),
        assignments: a
            .assignments
            .iter()
            .map(|x| pb::Assignment {
                global_id: x.global_id.clone(),
                epoch: x.epoch,
                spec_json: serde_json::to_string(&x.spec).unwrap_or_default(),
                team: x.team.clone(),
                until_ms: x.until_ms,
                restore: x.restore.as_ref().map(checkpoint_to_pb),
                device_model: x.device_model.clone().unwrap_or_default(),
                traceparent: x.trace.clone().unwrap_or_default(),
            })
            .collect(),
        lease_ms: cfg.lease_ms,
        sync_interval_ms: cfg.sync_interval_ms,
        max_clock_drift_ms: cfg.max_clock_drift_ms,
        now_ms: now,
        cancel: a.cancel.clone(),
        quota_leases: a
            .quota_leases
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

/// Each quota with its use (held federated jobs' demand plus the regions' reported local use),
/// what is reserved of it at `now_ms` (dispatch admits within the rest) and each region's lease.
pub fn quota_infos(s: &FedState, now_ms: u64) -> Vec<pb::QuotaInfo> {
    let index = crate::quota::QuotaIndex::of(s);
    s.quotas
        .iter()
        .map(|q| {
            let (team, model) = (q.team.as_str(), q.device_model.as_str());
            let mut local = 0u64;
            let mut leases = Vec::new();
            for r in s.regions.values() {
                let (used, wanted) = index.region_use(&r.name, team, model);
                local = local.saturating_add(used);
                if let Some(l) = index.lease(&r.name, team, model) {
                    leases.push(pb::RegionQuotaLease {
                        region: r.name.clone(),
                        limit_milli: l.limit_milli,
                        until_ms: l.until_ms,
                        used_milli: used,
                        wanted_milli: wanted,
                    });
                }
            }
            pb::QuotaInfo {
                team: q.team.clone(),
                device_model: q.device_model.clone(),
                limit_milli: q.limit_milli,
                used_milli: index.held(team, model).saturating_add(local),
                leases,
                reserved_milli: index.reserved(team, model, now_ms),
            }
        })
        .collect()
}

fn state_name(s: &str) -> Result<Option<FedJobState>, Status> {
    Ok(Some(match s {
        "" => return Ok(None),
        "pending" => FedJobState::Pending,
        "assigned" => FedJobState::Assigned,
        "running" => FedJobState::Running,
        "succeeded" => FedJobState::Succeeded,
        "failed" => FedJobState::Failed,
        "cancelled" => FedJobState::Cancelled,
        other => {
            return Err(invalid(
                "state",
                format!("{other:?}: one of pending, assigned, running, succeeded, failed, cancelled"),
            ));
        }
    }))
}

#[tonic::async_trait]
impl Federation for FedApi {
    async fn submit(&self, req: Request<pb::FedSubmitRequest>) -> Result<Response<pb::FedSubmitResponse>, Status> {
        let c = caller(&req);
        let trace = req.metadata().get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let r = req.into_inner();
        let (team, submitted_by) = submitter(&c, &r)?;
        if team.is_empty() {
            return Err(invalid("team", "required (the caller's certificate names no team)"));
        }
        if !valid_name(&team) {
            return Err(invalid("team", format!("{team:?} is not a valid name")));
        }
        check_len("client_request_id", &r.client_request_id, MAX_REQUEST_ID)?;
        check_len("spec_json", &r.spec_json, self.0.cfg.max_request_bytes)?;
        check_map("data_labels", &r.data_labels)?;
        let spec: suanli_model::JobSpec = serde_json::from_str(&r.spec_json).map_err(|e| invalid("spec_json", e))?;
        spec.validate(&suanli_model::Limits::default()).map_err(|e| invalid("spec_json", e))?;
        // Required, as a region's Submit requires it: the key that makes a retry (after a
        // timeout, a leader change) find the job its first try created instead of a second one.
        if r.client_request_id.is_empty() {
            return Err(invalid(
                "client_request_id",
                "must not be empty (the idempotency key: a retry with the same id finds the same job)",
            ));
        }
        let client_request_id = r.client_request_id.clone();
        let cmd = FedCommand::Submit {
            client_request_id,
            spec: Box::new(spec),
            team,
            submitted_by,
            data_labels: r.data_labels.clone(),
            now_ms: 0,
            trace,
        };
        match self.0.propose(cmd).await? {
            FedResponse::Submitted { id, created } => {
                tracing::info!(global_id = %id, created, caller = %c.principal, "federated job submitted");
                Ok(Response::new(pb::FedSubmitResponse { global_id: id, created }))
            }
            other => Err(Status::internal(format!("unexpected answer to a submit: {other:?}"))),
        }
    }

    async fn cancel(&self, req: Request<pb::FedCancelRequest>) -> Result<Response<pb::FedCancelResponse>, Status> {
        let c = caller(&req);
        let r = req.into_inner();
        if parse_global_id(&r.global_id).is_none() {
            return Err(invalid("global_id", format!("{:?} is not g-<n>", r.global_id)));
        }
        let team = self.0.state.read(|s| s.job(&r.global_id).map(|j| j.team.clone()));
        let Some(team) = team else {
            return Err(Status::not_found(format!("global_id: job {} not found", r.global_id)));
        };
        if let Decision::AllowIfTeam(t) = &c.decision
            && *t != team
        {
            return Err(Status::permission_denied(format!(
                "{} may cancel only its own team's jobs: {} is team {team:?}'s",
                c.principal, r.global_id
            )));
        }
        self.0.propose(FedCommand::Cancel { id: r.global_id.clone(), now_ms: 0 }).await?;
        tracing::info!(global_id = %r.global_id, caller = %c.principal, "federated job cancel requested");
        Ok(Response::new(pb::FedCancelResponse {}))
    }

    async fn sync(&self, req: Request<pb::RegionSyncRequest>) -> Result<Response<pb::RegionSyncResponse>, Status> {
        let r = req.into_inner();
        let cfg = self.0.state.read(FedState::config);
        let sync = sync_from_pb(&r, &cfg)?;
        let now = now_ms();
        if r.sent_at_ms != 0 && now.abs_diff(r.sent_at_ms) > cfg.max_clock_drift_ms {
            tracing::warn!(region = %r.region, skew_ms = now as i64 - r.sent_at_ms as i64, bound_ms = cfg.max_clock_drift_ms, "a region's clock is off by more than max_clock_drift_ms");
        }
        match self.0.propose(FedCommand::Sync { sync: Box::new(sync), now_ms: 0 }).await? {
            FedResponse::Synced(a) => {
                let cfg = self.0.state.read(FedState::config);
                Ok(Response::new(sync_answer_to_pb(&a, &cfg, now_ms())))
            }
            other => Err(Status::internal(format!("unexpected answer to a sync: {other:?}"))),
        }
    }

    async fn status(&self, _req: Request<pb::FedStatusRequest>) -> Result<Response<pb::FedStatusResponse>, Status> {
        let m = self.0.raft.metrics().borrow().clone();
        let voters: std::collections::BTreeSet<u64> = m.membership_config.membership().voter_ids().collect();
        let members = m
            .membership_config
            .membership()
            .nodes()
            .map(|(id, n)| pb::FedMember {
                id: *id,
                client_addr: n.client_addr().to_owned(),
                peer_addr: n.addr.clone(),
                voter: voters.contains(id),
            })
            .collect();
        let now = now_ms();
        let out = self.0.state.read_applied(|applied, s| {
            let cfg = s.config();
            let count = |st: FedJobState| s.jobs.values().filter(|j| j.state == st).count() as u32;
            pb::FedStatusResponse {
                id: self.0.id(),
                leader_id: m.current_leader.unwrap_or(0),
                members,
                applied_index: applied,
                regions: s.regions.len() as u32,
                healthy_regions: s.regions.values().filter(|r| r.healthy(now, &cfg)).count() as u32,
                jobs_pending: count(FedJobState::Pending),
                jobs_running: count(FedJobState::Running) + count(FedJobState::Assigned),
                lease_ms: cfg.lease_ms,
                redispatch_margin_ms: cfg.redispatch_margin_ms,
                max_clock_drift_ms: cfg.max_clock_drift_ms,
            }
        });
        Ok(Response::new(out))
    }

    async fn regions(&self, _req: Request<pb::FedRegionsRequest>) -> Result<Response<pb::FedRegionsResponse>, Status> {
        let now = now_ms();
        let out = self.0.state.read(|s| {
            let cfg = s.config();
            let mut held: BTreeMap<&str, u32> = BTreeMap::new();
            for j in s.jobs.values().filter(|j| j.state.is_held()) {
                if let Some(r) = j.region.as_deref() {
                    *held.entry(r).or_default() += 1;
                }
            }
            pb::FedRegionsResponse {
                regions: s
                    .regions
                    .values()
                    .map(|r| pb::RegionInfo {
                        name: r.name.clone(),
                        endpoints: r.endpoints.clone(),
                        pools: r.pools.clone(),
                        healthy: r.healthy(now, &cfg),
                        last_sync_ms: r.last_sync_ms,
                        capacity: r.capacity.iter().map(capacity_to_pb).collect(),
                        backlog: r.backlog,
                        labels: r.labels.clone(),
                        federated_jobs: held.get(r.name.as_str()).copied().unwrap_or(0),
                    })
                    .collect(),
                quotas: quota_infos(s, now),
            }
        });
        Ok(Response::new(out))
    }

    async fn jobs(&self, req: Request<pb::FedJobsRequest>) -> Result<Response<pb::FedJobsResponse>, Status> {
        let r = req.into_inner();
        let state = state_name(&r.state)?;
        let after = match r.after.as_str() {
            "" => 0,
            a => parse_global_id(a).ok_or_else(|| invalid("after", format!("{a:?} is not g-<n>")))?,
        };
        if r.limit > MAX_PAGE {
            return Err(invalid("limit", format!("{} is over the limit of {MAX_PAGE}", r.limit)));
        }
        let limit = if r.limit == 0 { 100 } else { r.limit as usize };
        let out = self.0.state.read(|s| {
            let mut jobs = Vec::new();
            let mut more = false;
            for j in s.jobs.range(after.saturating_add(1)..).map(|(_, j)| j) {
                if state.is_some_and(|st| j.state != st) {
                    continue;
                }
                if !r.region.is_empty() && j.region.as_deref() != Some(r.region.as_str()) {
                    continue;
                }
                if jobs.len() == limit {
                    more = true;
                    break;
                }
                jobs.push(job_info(j));
            }
            let next = if more { jobs.last().map(|j| j.global_id.clone()).unwrap_or_default() } else { String::new() };
            pb::FedJobsResponse { jobs, next }
        });
        Ok(Response::new(out))
    }

    async fn get_job(&self, req: Request<pb::FedGetJobRequest>) -> Result<Response<pb::FedJobInfo>, Status> {
        let id = req.into_inner().global_id;
        if parse_global_id(&id).is_none() {
            return Err(invalid("global_id", format!("{id:?} is not g-<n>")));
        }
        self.0
            .state
            .read(|s| s.job(&id).map(job_info))
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("global_id: job {id} not found")))
    }

    async fn set_quota(
        &self,
        req: Request<pb::FedSetQuotaRequest>,
    ) -> Result<Response<pb::FedSetQuotaResponse>, Status> {
        let c = caller(&req);
        let r = req.into_inner();
        if !valid_name(&r.team) {
            return Err(invalid("team", format!("{:?} is not a valid name", r.team)));
        }
        if r.device_model.is_empty() {
            return Err(invalid("device_model", "required"));
        }
        check_len("device_model", &r.device_model, MAX_NAME)?;
        self.0
            .propose(FedCommand::SetQuota {
                team: r.team.clone(),
                device_model: r.device_model.clone(),
                limit_milli: r.limit_milli,
            })
            .await?;
        tracing::info!(team = %r.team, device_model = %r.device_model, limit_milli = r.limit_milli, caller = %c.principal, "global quota set");
        Ok(Response::new(pb::FedSetQuotaResponse {}))
    }

    async fn add_server(&self, req: Request<pb::AddServerRequest>) -> Result<Response<pb::AddServerResponse>, Status> {
        let c = caller(&req);
        let r = req.into_inner();
        if r.id == 0 {
            return Err(invalid("id", "must be >= 1"));
        }
        let addr = suanli_raft::membership::check_addr("addr", &r.addr)?;
        let peer = if r.peer_addr.is_empty() {
            let (host, port) = addr.rsplit_once(':').unwrap_or((addr.as_str(), "0"));
            match port.parse::<u16>().ok().and_then(|p| p.checked_add(1)) {
                Some(p) => format!("{host}:{p}"),
                None => {
                    return Err(invalid("peer_addr", "empty, and addr's port + 1 is no port: give the peer address"));
                }
            }
        } else {
            suanli_raft::membership::check_addr("peer_addr", &r.peer_addr)?
        };
        self.lead_or_redirect()?;
        let node = suanli_raft::ServerNode::new(peer, addr);
        let timeout = self.0.timeout();
        let add = suanli_raft::membership::add_server(
            &self.0.raft,
            r.id,
            node.clone(),
            r.learner_only,
            timeout,
            "suanli federation remove-server",
        );
        tokio::time::timeout(timeout, add).await.map_err(|_| {
            Status::deadline_exceeded(format!(
                "adding federation server {} did not finish within the request timeout ({} ms); see `suanli federation status`",
                r.id,
                timeout.as_millis()
            ))
        })??;
        tracing::info!(id = r.id, %node, learner_only = r.learner_only, caller = %c.principal, "federation server added");
        Ok(Response::new(pb::AddServerResponse {}))
    }

    async fn remove_server(
        &self,
        req: Request<pb::RemoveServerRequest>,
    ) -> Result<Response<pb::RemoveServerResponse>, Status> {
        let c = caller(&req);
        let id = req.into_inner().id;
        self.lead_or_redirect()?;
        suanli_raft::membership::remove_server(&self.0.raft, id, self.0.timeout()).await?;
        tracing::info!(id, caller = %c.principal, "federation server removed");
        Ok(Response::new(pb::RemoveServerResponse {}))
    }

    async fn cost(&self, req: Request<pb::FedCostRequest>) -> Result<Response<pb::CostReportResponse>, Status> {
        let by = req.into_inner().by;
        let out = self.0.state.read(|s| cost_report(s, &by))?;
        Ok(Response::new(out))
    }
}

#[tonic::async_trait]
impl FederationPeer for FedApi {
    async fn propose(&self, req: Request<pb::FedProposeRequest>) -> Result<Response<pb::FedProposeResponse>, Status> {
        let r = req.into_inner();
        let cmd: FedCommand = serde_json::from_slice(&r.command_json).map_err(|e| invalid("command_json", e))?;
        let resp = self.0.propose_local(cmd).await?;
        let json = serde_json::to_vec(&resp).map_err(|e| Status::internal(format!("response: {e}")))?;
        Ok(Response::new(pb::FedProposeResponse { response_json: json.into() }))
    }
}
