//! The agent's `/metrics` (docs/metrics.md, "Agent"): Prometheus text on its own HTTP
//! listener (`http_listen`, off by default), served by [`suanli_security::http::serve`] with
//! the agent's certificate. Callers must present a verified client certificate of the
//! cluster's CA (any role: agents hold no token key); under `insecure = true`, anyone.
//!
//! ```text
//!  http_listen ─▶ GET /metrics ─▶ verified client certificate? ─▶ plugin stats per device,
//!                                                                 tasks, heartbeat (lease)
//! ```

use crate::Agent;
use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use suanli_model::Health;
use suanli_security::tls::PeerInfo;

type G = Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>;
type C = Family<Vec<(String, String)>, Counter>;

/// The router of the agent's HTTP listener.
pub(crate) fn router(agent: Arc<Agent>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(agent)
}

async fn metrics(State(agent): State<Arc<Agent>>, req: Request) -> Response {
    let verified = req.extensions().get::<ConnectInfo<PeerInfo>>().is_some_and(|p| p.0.principal.is_some());
    if !agent.cfg.insecure && !verified {
        return (StatusCode::UNAUTHORIZED, "present a client certificate of the cluster's CA\n").into_response();
    }
    match render(&agent) {
        Ok(text) => {
            ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response(),
    }
}

fn gauge(reg: &mut Registry, name: &str, help: &str) -> G {
    let g = G::default();
    reg.register(name, help, g.clone());
    g
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// The agent's series as OpenMetrics text.
fn render(agent: &Agent) -> Result<String, std::fmt::Error> {
    let mut reg = Registry::default();
    let node = agent.node_id.as_str();
    let health = gauge(
        &mut reg,
        "suanli_agent_device_healthy",
        "1 while the device is healthy (plugin up, no fault), by device, kind and model.",
    );
    let util =
        gauge(&mut reg, "suanli_agent_device_utilization_ratio", "Device utilization from the plugin's last stats.");
    let used =
        gauge(&mut reg, "suanli_agent_device_memory_used_bytes", "Device memory used from the plugin's last stats.");
    let total = gauge(&mut reg, "suanli_agent_device_memory_bytes", "Device memory size from the plugin's inventory.");
    let power = gauge(&mut reg, "suanli_agent_device_power_watts", "Device power draw from the plugin's last stats.");
    let temp =
        gauge(&mut reg, "suanli_agent_device_temperature_celsius", "Device temperature from the plugin's last stats.");
    let devices = agent.plugins.devices();
    for d in &devices {
        let l = labels(&[
            ("node", node),
            ("device", &d.device.id),
            ("kind", d.device.kind.as_str()),
            ("model", &d.device.model),
        ]);
        health.get_or_create(&l).set(if d.device.health == Health::Healthy { 1.0 } else { 0.0 });
        total.get_or_create(&l).set(d.device.memory_mib as f64 * 1_048_576.0);
    }
    let rv = agent.plugins.remedy_view();
    let quarantined = gauge(
        &mut reg,
        "suanli_agent_device_quarantined",
        "1 for each device quarantined after a fatal error or failed resets (alert on it; see docs/agent.md).",
    );
    let recovering = gauge(
        &mut reg,
        "suanli_agent_device_recovering",
        "1 for each device out of service while a recoverable error is remedied (tasks moved, reset pending).",
    );
    for (ids, g) in [(&rv.quarantined, &quarantined), (&rv.recovering, &recovering)] {
        for id in ids {
            g.get_or_create(&labels(&[("node", node), ("device", id)])).set(1.0);
        }
    }
    let events = C::default();
    reg.register(
        "suanli_agent_device_events",
        "Device health events since the agent started, by class.",
        events.clone(),
    );
    for (class, n) in &rv.events {
        events.get_or_create(&labels(&[("node", node), ("class", class)])).inc_by(*n);
    }
    let resets = C::default();
    reg.register("suanli_agent_device_resets", "Device resets since the agent started, by result.", resets.clone());
    resets.get_or_create(&labels(&[("node", node), ("result", "recovered")])).inc_by(rv.resets_ok);
    resets.get_or_create(&labels(&[("node", node), ("result", "failed")])).inc_by(rv.resets_failed);
    for s in agent.plugins.stats() {
        let Some(d) = devices.iter().find(|d| d.device.id == s.id) else { continue };
        let l =
            labels(&[("node", node), ("device", &s.id), ("kind", d.device.kind.as_str()), ("model", &d.device.model)]);
        util.get_or_create(&l).set((s.utilization_pct / 100.0).clamp(0.0, 1.0));
        used.get_or_create(&l).set(s.memory_used_mib as f64 * 1_048_576.0);
        power.get_or_create(&l).set(s.power_w);
        temp.get_or_create(&l).set(s.temperature_c);
    }
    let tasks = gauge(&mut reg, "suanli_agent_tasks", "Allocations this agent manages (running or stopping).");
    let n = agent.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).count();
    tasks.get_or_create(&labels(&[("node", node)])).set(n as f64);
    let regs = gauge(
        &mut reg,
        "suanli_agent_registrations",
        "Successful registrations since the agent started (per process).",
    );
    regs.get_or_create(&labels(&[("node", node)])).set(*agent.registered.borrow() as f64);
    let hb = gauge(
        &mut reg,
        "suanli_agent_heartbeat_age_seconds",
        "Seconds since the last heartbeat the servers acknowledged (its lease); absent before the first.",
    );
    let lease = agent.lease.borrow().clone();
    if let Some(l) = lease {
        let age_ms = crate::sys::boottime_ms().saturating_sub(l.sent_boottime_ms);
        hb.get_or_create(&labels(&[("node", node)])).set(age_ms as f64 / 1000.0);
    }
    let up =
        gauge(&mut reg, "suanli_agent_up", "1 while the agent process serves (its scrape succeeding is the signal).");
    up.get_or_create(&labels(&[("node", node)])).set(1.0);
    let mut out = String::with_capacity(4096);
    encode(&mut out, &reg)?;
    Ok(out)
}
