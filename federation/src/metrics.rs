//! A federation server's `/metrics` (Prometheus text, OpenMetrics 1.0, prometheus-client) on
//! its HTTP listener (`http_listen`), every series listed in docs/metrics.md.
//!
//! ```text
//!  GET /metrics ─▶ the TLS client certificate's identity (anonymous: 401; --insecure: anyone)
//!              ─▶ state.read(|s| regions, jobs, quotas, cost roll-up)   any member: same figures
//!              ─▶ + raft metrics of this server                         per process
//!              ─▶ OpenMetrics text
//! ```
//!
//! As on a region server, every replicated figure is derived from the state at scrape time
//! (gauges; nothing is counted in process), so any member answers the same numbers for the
//! same applied index. Region health and sync age use this server's clock.

use crate::model::{FedJobState, RegionCost};
use crate::node::{Node, now_ms};
use crate::state::FedState;
use axum::Router;
use axum::extract::{ConnectInfo, Request, State as AxState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use suanli_security::Principal;
use suanli_security::tls::PeerInfo;

/// The OpenMetrics content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;
type G = Family<Labels, Gauge<f64, AtomicU64>>;
type C = Family<Labels, prometheus_client::metrics::counter::Counter<f64, AtomicU64>>;

/// The routes of a federation server's HTTP listener.
pub fn routes(node: Arc<Node>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(node)
}

async fn metrics(AxState(node): AxState<Arc<Node>>, req: Request) -> Response {
    if !node.cfg.insecure {
        let who = req.extensions().get::<ConnectInfo<PeerInfo>>().and_then(|c| c.0.principal.clone());
        if matches!(who, None | Some(Principal::Anonymous)) {
            return (
                StatusCode::UNAUTHORIZED,
                "anonymous: present a client certificate of the federation's CA (any role reads metrics)\n",
            )
                .into_response();
        }
    }
    match render(&node) {
        Ok(text) => ([("content-type", CONTENT_TYPE)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response(),
    }
}

fn l<const N: usize>(pairs: [(&str, &str); N]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

struct Reg(Registry);

impl Reg {
    fn gauge(&mut self, name: &str, help: &str) -> G {
        let g = G::default();
        self.0.register(name, help, g.clone());
        g
    }

    fn counter(&mut self, name: &str, help: &str) -> C {
        let c = C::default();
        self.0.register(name, help, c.clone());
        c
    }
}

fn set(g: &G, labels: Labels, v: f64) {
    g.get_or_create(&labels).set(v);
}

/// Everything one federation server exports, as OpenMetrics text.
pub fn render(node: &Node) -> Result<String, std::fmt::Error> {
    let mut reg = Reg(Registry::default());
    let now = now_ms();
    let applied = node.state.read_applied(|applied, s| {
        replicated(&mut reg, s, now);
        applied
    });
    raft(&mut reg, node, applied);
    let mut out = String::with_capacity(8 * 1024);
    encode(&mut out, &reg.0)?;
    Ok(out)
}

/// The families derived from the replicated state alone, at `now_ms`, as OpenMetrics text
/// (what [`render`] adds the raft figures to; tests read it from a state).
pub fn render_state(s: &FedState, now_ms: u64) -> Result<String, std::fmt::Error> {
    let mut reg = Reg(Registry::default());
    replicated(&mut reg, s, now_ms);
    let mut out = String::with_capacity(8 * 1024);
    encode(&mut out, &reg.0)?;
    Ok(out)
}

/// The families derived from the replicated state, at `now_ms` (this server's clock).
fn replicated(reg: &mut Reg, s: &FedState, now_ms: u64) {
    let cfg = s.config();
    let regions = reg.gauge(
        "suanli_federation_regions",
        "Regions in the directory, by health (synced within region_unhealthy_after_ms).",
    );
    let (healthy, total) = (s.regions.values().filter(|r| r.healthy(now_ms, &cfg)).count(), s.regions.len());
    set(&regions, l([("health", "healthy")]), healthy as f64);
    set(&regions, l([("health", "unhealthy")]), (total - healthy) as f64);
    let age = reg.gauge(
        "suanli_federation_region_sync_age_seconds",
        "Seconds since each region's latest sync (this server's clock).",
    );
    let backlog = reg
        .gauge("suanli_federation_region_backlog_jobs", "Jobs pending in each region's own queues at its latest sync.");
    let devices = reg.gauge(
        "suanli_federation_region_devices",
        "Devices each region reported at its latest sync, by pool, model and state (total or free; shares in whole devices).",
    );
    for r in s.regions.values() {
        set(&age, l([("region", &r.name)]), now_ms.saturating_sub(r.last_sync_ms) as f64 / 1000.0);
        set(&backlog, l([("region", &r.name)]), f64::from(r.backlog));
        for c in r.capacity.iter().filter(|c| !c.device_model.is_empty()) {
            let base = [("region", r.name.as_str()), ("pool", c.pool.as_str()), ("model", c.device_model.as_str())];
            let with = |state: &str| {
                let mut v = l(base);
                v.push(("state".into(), state.into()));
                v
            };
            devices.get_or_create(&with("total")).inc_by(c.total_milli as f64 / 1000.0);
            devices.get_or_create(&with("free")).inc_by(c.free_milli as f64 / 1000.0);
        }
    }
    let jobs =
        reg.gauge("suanli_federation_jobs", "Federated jobs the federation keeps, by state (and region while held).");
    let mut counts: BTreeMap<(&'static str, String), u64> = BTreeMap::new();
    for st in [
        FedJobState::Pending,
        FedJobState::Assigned,
        FedJobState::Running,
        FedJobState::Succeeded,
        FedJobState::Failed,
        FedJobState::Cancelled,
    ] {
        counts.insert((st.as_str(), String::new()), 0);
    }
    for j in s.jobs.values() {
        let region = if j.state.is_held() { j.region.clone().unwrap_or_default() } else { String::new() };
        if !region.is_empty() {
            counts.remove(&(j.state.as_str(), String::new()));
        }
        *counts.entry((j.state.as_str(), region)).or_default() += 1;
    }
    for ((state, region), n) in counts {
        set(&jobs, l([("state", state), ("region", &region)]), n as f64);
    }
    let limit = reg.gauge(
        "suanli_federation_quota_limit_devices",
        "Each team's worldwide quota of a device model (whole devices).",
    );
    let used = reg.gauge(
        "suanli_federation_quota_used_devices",
        "Each team's worldwide use of a quota's device model: federated jobs held plus the regions' reported local use.",
    );
    let reserved = reg.gauge(
        "suanli_federation_quota_reserved_devices",
        "What dispatch counts as taken of a worldwide quota: federated jobs held plus, per region, the most of its reported use and the quota leases it may still enforce.",
    );
    let lease = reg.gauge(
        "suanli_federation_quota_lease_devices",
        "Each region's lease of a worldwide quota (its region-local work on the model may hold at most this much).",
    );
    for q in crate::service::quota_infos(s, now_ms) {
        let lb = l([("team", &q.team), ("model", &q.device_model)]);
        set(&limit, lb.clone(), q.limit_milli as f64 / 1000.0);
        set(&used, lb.clone(), q.used_milli as f64 / 1000.0);
        set(&reserved, lb, q.reserved_milli as f64 / 1000.0);
        for r in &q.leases {
            let lb = l([("team", &q.team), ("model", &q.device_model), ("region", &r.region)]);
            set(&lease, lb, r.limit_milli as f64 / 1000.0);
        }
    }
    // The usage roll-up: device-milli-seconds by "team/region/model", from the regions' syncs
    // (their local jobs) and the federated jobs they ran.
    let usage = reg.counter(
        "suanli_federation_usage_device_seconds",
        "Device-seconds used worldwide since each region first synced, by team, region and device model: the regions' local jobs (their syncs) and the federated jobs they ran.",
    );
    for (key, milli_s) in &s.usage {
        let mut parts = key.splitn(3, '/');
        let (Some(team), Some(region), Some(model)) = (parts.next(), parts.next(), parts.next()) else { continue };
        usage
            .get_or_create(&l([("team", team), ("region", region), ("model", model)]))
            .inc_by(*milli_s as f64 / 1000.0);
    }
    let cost = reg.gauge(
        "suanli_federation_cost",
        "The global cost roll-up: each region's ledger totals at its latest sync, by region, team, category and currency (docs/cost.md).",
    );
    for r in s.regions.values() {
        let Some(c) = &r.cost else { continue };
        for (team, amounts) in &c.teams {
            for (k, name) in RegionCost::CATEGORIES.iter().enumerate() {
                let v = amounts[k].0 as f64 / crate::service::BASE_PER_MICRO as f64 / 1e6;
                set(&cost, l([("region", &r.name), ("team", team), ("category", name), ("currency", &c.currency)]), v);
            }
        }
    }
}

fn raft(reg: &mut Reg, node: &Node, applied: u64) {
    let m = node.raft.metrics().borrow().clone();
    let leader = reg.gauge("suanli_federation_raft_leader", "1 on the federation's leader, 0 on other members.");
    set(&leader, l([]), if node.is_leader() { 1.0 } else { 0.0 });
    let term = reg.gauge("suanli_federation_raft_term", "This member's current raft term.");
    set(&term, l([]), m.current_term as f64);
    let last = reg.gauge("suanli_federation_raft_last_log_index", "The last raft log index this member holds.");
    set(&last, l([]), m.last_log_index.unwrap_or(0) as f64);
    let app = reg.gauge("suanli_federation_raft_applied_index", "The raft log index this member has applied.");
    set(&app, l([]), applied as f64);
    let voters = reg.gauge("suanli_federation_raft_voters", "Voters in the federation's membership.");
    set(&voters, l([]), m.membership_config.membership().voter_ids().count() as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usage_roll_up_is_a_counter_by_team_region_and_model() {
        let mut s = FedState::default();
        s.usage.insert("team-a/us-east/H100".into(), 7_200_000);
        s.usage.insert("malformed".into(), 5);
        let text = render_state(&s, 0).expect("render");
        assert!(text.contains("# TYPE suanli_federation_usage_device_seconds counter"), "{text}");
        assert!(
            text.contains(
                "suanli_federation_usage_device_seconds_total{team=\"team-a\",region=\"us-east\",model=\"H100\"} 7200.0"
            ),
            "{text}"
        );
        assert!(!text.contains("malformed"), "{text}");
    }
}
