//! `/metrics`: Prometheus text (OpenMetrics 1.0, prometheus-client), every series listed in
//! docs/metrics.md.
//!
//! ```text
//!  GET /metrics ─▶ known_caller (401 for anonymous)
//!              ─▶ state.read(|s| families from the replicated state)   any server: same figures
//!              ─▶ + device stats / heartbeats (leader memory)          leader only
//!              ─▶ + raft metrics of this server                        per process
//!              ─▶ OpenMetrics text
//! ```
//!
//! Every figure of the replicated part is derived from the state at scrape time, so any
//! server answers the same numbers for the same revision and nothing is counted twice (no
//! in-process counters that a restart or a leader change would reset). Figures "over the jobs
//! the state retains" fall when finished jobs are forgotten (`finished_retention`): they are
//! gauges (and a gauge-like histogram), read them with `delta()`/`max_over_time()`, not
//! `rate()`. A scrape is O(jobs + allocations + devices) under the state's read lock
//! (docs/metrics.md has the measured cost).

use crate::http::{HttpCtx, known_caller};
use axum::Router;
use axum::extract::{Request, State as AxState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use openraft::ServerState;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use suanli_model::{DeviceKind, Health, NodeId, WHOLE_DEVICE_MILLI};
use suanli_state::{AllocState, EndClass, JobState, NodeStatus, State};

/// A run longer than this (seconds) that ends by preemption or failure counts as an
/// interruption of a long job (`suanli_long_job_interruptions`).
pub const LONG_JOB_S: u64 = 3600;

/// Upper bounds (seconds) of the queue wait histogram's buckets.
pub const WAIT_BUCKETS_S: [f64; 14] =
    [1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0];

/// The OpenMetrics content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;
type G = Family<Labels, Gauge<f64, AtomicU64>>;
/// A node, its pool, and its devices' (id, model, memory MiB).
type NodeDevices = (NodeId, String, Vec<(String, String, u64)>);
type H = Family<Labels, Histogram, fn() -> Histogram>;

/// The routes this module serves.
pub(crate) fn routes(ctx: HttpCtx) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(ctx)
}

async fn metrics(AxState(ctx): AxState<HttpCtx>, req: Request) -> Response {
    if let Err(r) = known_caller(&ctx, req.headers(), req.extensions()) {
        return r;
    }
    match render(&ctx.core) {
        Ok(text) => ([("content-type", CONTENT_TYPE)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response(),
    }
}

fn l<const N: usize>(pairs: [(&str, &str); N]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// A registry under construction: families are registered and filled in one go.
struct Reg(Registry);

impl Reg {
    fn gauge(&mut self, name: &str, help: &str) -> G {
        let g = G::default();
        self.0.register(name, help, g.clone());
        g
    }
    fn histogram(&mut self, name: &str, help: &str) -> H {
        let h: H = Family::new_with_constructor(|| Histogram::new(WAIT_BUCKETS_S));
        self.0.register(name, help, h.clone());
        h
    }
}

fn set(g: &G, labels: Labels, v: f64) {
    g.get_or_create(&labels).set(v);
}

fn add(g: &G, labels: Labels, v: f64) {
    g.get_or_create(&labels).inc_by(v);
}

/// Everything one server exports, as OpenMetrics text.
pub(crate) fn render(core: &crate::core::Core) -> Result<String, std::fmt::Error> {
    let t0 = std::time::Instant::now();
    let mut reg = Reg(Registry::default());
    let now = core.state.read(State::clock);
    // The cluster time the autoscaler uses: what replicas reported is fresh within three
    // periods of it (this server's clock where it does not lead).
    let fresh_now = core.now_s();
    core.state.read(|s| replicated(&mut reg, s, now, fresh_now));
    let leader = core.is_leader();
    leader_only(&mut reg, core, leader);
    raft(&mut reg, core);
    let r = reg.gauge("suanli_metrics_render_seconds", "Time this server took to build this scrape (per process).");
    set(&r, l([]), t0.elapsed().as_secs_f64());
    let mut out = String::with_capacity(16 * 1024);
    encode(&mut out, &reg.0)?;
    Ok(out)
}

/// The families derived from the replicated state (any server answers the same, but for
/// which reported latencies and success ratios are still fresh at `fresh_now`).
fn replicated(reg: &mut Reg, s: &State, now: u64, fresh_now: u64) {
    efficiency(reg, s);
    delivery(reg, s, now);
    governance(reg, s);
    inference(reg, s, fresh_now);
    let rev = reg.gauge("suanli_state_revision", "Revision of the replicated state this server has applied.");
    set(&rev, l([]), s.revision() as f64);
    let clock = reg.gauge("suanli_state_clock_seconds", "The replicated clock (seconds since the epoch).");
    set(&clock, l([]), now as f64);
}

fn kind_str(k: DeviceKind) -> &'static str {
    k.as_str()
}

fn efficiency(reg: &mut Reg, s: &State) {
    let devices = reg.gauge("suanli_devices", "Devices registered, by pool, kind, model and health.");
    let alloc = reg.gauge(
        "suanli_device_allocated_ratio",
        "Device share allocated to live allocations (in whole devices), by pool, kind and model.",
    );
    let idle = reg.gauge(
        "suanli_devices_idle",
        "Healthy devices on ready nodes with no share allocated, by pool, kind and model.",
    );
    let frag = reg.gauge(
        "suanli_pool_fragmentation_ratio",
        "Free device share stranded on partially allocated devices over all free device share of healthy devices on ready nodes (0 when nothing is free), by pool.",
    );
    let free_g = reg.gauge(
        "suanli_pool_free_devices",
        "Free device share (in whole devices) on healthy devices of ready nodes, by pool.",
    );
    let node_up = reg
        .gauge("suanli_node_up", "1 while the node is ready (heartbeating), 0 once declared down; by node and pool.");
    let node_sched = reg.gauge(
        "suanli_node_schedulable",
        "1 while the node accepts new work (ready, schedulable mode, no pressure); by node and pool.",
    );
    let cpu_cap = reg.gauge("suanli_node_cpu_cores", "Allocatable CPU cores of the node.");
    let cpu_used = reg.gauge("suanli_node_cpu_allocated_cores", "CPU cores allocated to live allocations on the node.");
    let mem_cap = reg.gauge("suanli_node_memory_bytes", "Allocatable memory of the node.");
    let mem_used = reg.gauge("suanli_node_memory_allocated_bytes", "Memory allocated to live allocations on the node.");

    // Share in use per (node, device) and per node (cpu, memory), from the live allocations.
    let mut dev_use: HashMap<(&NodeId, &str), u64> = HashMap::new();
    let mut node_use: HashMap<&NodeId, (u64, u64)> = HashMap::new();
    for a in s.allocs().values().filter(|a| a.is_live()) {
        let e = node_use.entry(&a.alloc.node).or_default();
        e.0 += a.alloc.cpu_milli;
        e.1 += a.alloc.memory_mib;
        for d in &a.alloc.devices {
            *dev_use.entry((&a.alloc.node, d.device.as_str())).or_default() += u64::from(d.milli);
        }
    }
    let whole = f64::from(WHOLE_DEVICE_MILLI);
    let mut pool_free: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for (id, rec) in s.nodes() {
        let pool = rec.node.pool.as_str();
        let nl = l([("node", id.as_str()), ("pool", pool)]);
        let ready = rec.status == NodeStatus::Ready;
        set(&node_up, nl.clone(), if ready { 1.0 } else { 0.0 });
        set(&node_sched, nl.clone(), if rec.accepts_work() { 1.0 } else { 0.0 });
        let (cu, mu) = node_use.get(id).copied().unwrap_or_default();
        set(&cpu_cap, nl.clone(), rec.node.cpu_milli as f64 / 1000.0);
        set(&cpu_used, nl.clone(), cu as f64 / 1000.0);
        set(&mem_cap, nl.clone(), rec.node.memory_mib as f64 * 1_048_576.0);
        set(&mem_used, nl, mu as f64 * 1_048_576.0);
        let pf = pool_free.entry(pool).or_default();
        for d in &rec.node.devices {
            let kind = kind_str(d.kind);
            let health = match d.health {
                Health::Healthy => "healthy",
                Health::Unhealthy => "unhealthy",
            };
            add(&devices, l([("pool", pool), ("kind", kind), ("model", &d.model), ("health", health)]), 1.0);
            let used = dev_use.get(&(id, d.id.as_str())).copied().unwrap_or(0).min(u64::from(WHOLE_DEVICE_MILLI));
            let pl = l([("pool", pool), ("kind", kind), ("model", &d.model)]);
            add(&alloc, pl.clone(), used as f64 / whole);
            add(&idle, pl, 0.0);
            if ready && d.health == Health::Healthy {
                let free = u64::from(WHOLE_DEVICE_MILLI) - used;
                pf.0 += free;
                if used == 0 {
                    add(&idle, l([("pool", pool), ("kind", kind), ("model", &d.model)]), 1.0);
                } else {
                    pf.1 += free;
                }
            }
        }
    }
    for (pool, (free, stranded)) in pool_free {
        let r = if free == 0 { 0.0 } else { stranded as f64 / free as f64 };
        set(&frag, l([("pool", pool)]), r);
        set(&free_g, l([("pool", pool)]), free as f64 / whole);
    }
}

fn delivery(reg: &mut Reg, s: &State, now: u64) {
    let jobs = reg.gauge(
        "suanli_jobs",
        "Jobs the state retains, by queue and state (finished jobs are forgotten after retention).",
    );
    let wait = reg.histogram(
        "suanli_queue_wait_seconds",
        "Seconds from submission to first placement of the jobs the state retains that were placed, by queue (a gauge histogram: it falls when jobs are forgotten).",
    );
    let to_start = reg.histogram(
        "suanli_job_time_to_start_seconds",
        "Seconds from submission until one of the job's tasks first reported running, for the jobs the state retains that started, by queue (a gauge histogram).",
    );
    let pending_age = reg.gauge(
        "suanli_queue_oldest_pending_seconds",
        "Age of the oldest job waiting for its first placement, by queue (0 when none waits).",
    );
    let finished = reg.gauge(
        "suanli_jobs_finished",
        "Finished jobs the state retains, by queue and outcome (succeeded, failed, cancelled); success rate = succeeded / sum.",
    );
    let requeues =
        reg.gauge("suanli_job_requeues", "Requeues (any cause) summed over the jobs the state retains, by queue.");
    let failures =
        reg.gauge("suanli_job_failed_attempts", "Failed attempts summed over the jobs the state retains, by queue.");
    let long = reg.gauge(
        "suanli_long_job_interruptions",
        "Attempts that ran longer than 3600 s and ended by preemption, node loss, device error, drain, migration or failure, over the attempt history the state retains, by queue and cause.",
    );
    let mut oldest: BTreeMap<&str, u64> = BTreeMap::new();
    for q in s.queues().keys() {
        oldest.insert(q.as_str(), 0);
    }
    for j in s.jobs().values() {
        let q = j.spec.queue.as_str();
        add(&jobs, l([("queue", q), ("state", j.state.as_str())]), 1.0);
        if j.state.is_terminal() {
            add(&finished, l([("queue", q), ("outcome", j.state.as_str())]), 1.0);
        }
        add(&requeues, l([("queue", q)]), f64::from(j.requeues));
        add(&failures, l([("queue", q)]), f64::from(j.failures));
        // First placement (recorded by the state; a job of an earlier build: its oldest
        // attempt's start, which is when it began running if it did).
        let first = j.first_placed_at.or_else(|| {
            j.history
                .first()
                .map(|h| h.started_at)
                .or_else(|| j.allocs.iter().filter_map(|a| s.allocs().get(a)).map(|a| a.alloc.started_at).min())
        });
        if let Some(t) = j.first_running_at {
            to_start.get_or_create(&l([("queue", q)])).observe(t.saturating_sub(j.submitted_at) as f64);
        }
        match first {
            Some(t) => wait.get_or_create(&l([("queue", q)])).observe(t.saturating_sub(j.submitted_at) as f64),
            None if j.state == JobState::Pending => {
                let e = oldest.entry(q).or_default();
                *e = (*e).max(now.saturating_sub(j.submitted_at));
            }
            None => {}
        }
        for h in &j.history {
            let Some(end) = h.end else { continue };
            if h.ended_at.saturating_sub(h.started_at) <= LONG_JOB_S {
                continue;
            }
            let cause = match end {
                EndClass::Preempted => "preempted",
                EndClass::NodeLost => "node_lost",
                EndClass::DeviceError => "device_error",
                EndClass::Drained => "drained",
                EndClass::Migrated => "migrated",
                EndClass::Exit | EndClass::Oom | EndClass::StartFailed => "failed",
                EndClass::Succeeded | EndClass::Cancelled | EndClass::Stopped => continue,
            };
            add(&long, l([("queue", q), ("cause", cause)]), 1.0);
        }
    }
    for (q, age) in oldest {
        set(&pending_age, l([("queue", q)]), age as f64);
    }
}

fn governance(reg: &mut Reg, s: &State) {
    let nominal = reg.gauge(
        "suanli_queue_quota_nominal",
        "Nominal (guaranteed) quota by queue, team and resource (gpu and npu in devices, cpu in cores, memory in GiB).",
    );
    let used = reg.gauge(
        "suanli_queue_quota_used",
        "Quota used by the queue's live allocations (units as suanli_queue_quota_nominal).",
    );
    let borrowed = reg.gauge(
        "suanli_queue_quota_borrowed",
        "Part of the used quota admitted on quota borrowed from the cohort (units as suanli_queue_quota_nominal).",
    );
    let fair = reg.gauge(
        "suanli_queue_fair_share",
        "Fair-share position: the queue's dominant share of the cluster's capacity divided by its weight (lower runs first).",
    );
    let weight = reg.gauge("suanli_queue_weight", "Fair-share weight of the queue.");
    let preempt = reg.gauge(
        "suanli_job_preemptions",
        "Attempts ended by preemption over the attempt history the state retains, by queue and team.",
    );
    let lost_pre = reg.gauge(
        "suanli_preemption_lost_device_hours",
        "Device-hours of work lost to preemption (since the last checkpoint), over the attempt history the state retains, by queue and team.",
    );
    let lost_all = reg.gauge(
        "suanli_lost_device_hours",
        "Device-hours of work lost at every end that was not a success (Job::lost_device_s), over the jobs the state retains, by queue and team.",
    );
    let dims = |v: suanli_model::ResVec| {
        [
            ("gpu", v.gpu_milli as f64 / 1000.0),
            ("npu", v.npu_milli as f64 / 1000.0),
            ("cpu", v.cpu_milli as f64 / 1000.0),
            ("memory", v.memory_mib as f64 / 1024.0),
        ]
    };
    let mut use_of: BTreeMap<&str, (suanli_model::ResVec, suanli_model::ResVec)> = BTreeMap::new();
    for a in s.allocs().values().filter(|a| a.is_live()) {
        let v = s.alloc_usage(a);
        let e = use_of.entry(a.alloc.queue.as_str()).or_default();
        e.0 += v;
        if a.alloc.borrowed {
            e.1 += v;
        }
    }
    let mut cap = suanli_model::ResVec::ZERO;
    for rec in s.nodes().values() {
        cap += rec.node.capacity();
    }
    let team_of = |q: &str| s.queues().get(&suanli_model::QueueId::from(q)).map(|x| x.team.clone()).unwrap_or_default();
    for (id, q) in s.queues() {
        let (u, b) = use_of.get(id.as_str()).copied().unwrap_or_default();
        for ((r, n), ((_, uu), (_, bb))) in dims(q.nominal).into_iter().zip(dims(u).into_iter().zip(dims(b))) {
            let lb = l([("queue", id.as_str()), ("team", &q.team), ("resource", r)]);
            set(&nominal, lb.clone(), n);
            set(&used, lb.clone(), uu);
            set(&borrowed, lb, bb);
        }
        let share = dims(u)
            .iter()
            .zip(dims(cap).iter())
            .filter(|(_, (_, c))| *c > 0.0)
            .map(|((_, x), (_, c))| x / c)
            .fold(0.0_f64, f64::max);
        let ql = l([("queue", id.as_str()), ("team", &q.team)]);
        set(&fair, ql.clone(), share / f64::from(q.weight.max(1)));
        set(&weight, ql.clone(), f64::from(q.weight));
        add(&preempt, ql.clone(), 0.0);
        add(&lost_pre, ql.clone(), 0.0);
        add(&lost_all, ql, 0.0);
    }
    for j in s.jobs().values() {
        let q = j.spec.queue.as_str();
        let team = team_of(q);
        let ql = l([("queue", q), ("team", &team)]);
        add(&lost_all, ql.clone(), j.lost_device_s as f64 / 3600.0);
        for h in j.history.iter().filter(|h| h.end == Some(EndClass::Preempted)) {
            add(&preempt, ql.clone(), 1.0);
            add(&lost_pre, ql.clone(), h.lost_device_s as f64 / 3600.0);
        }
    }
}

fn inference(reg: &mut Reg, s: &State, now: u64) {
    let wanted = reg.gauge(
        "suanli_inference_replicas_wanted",
        "Replicas wanted by live services (kind inference or a service section; docs/services.md), by queue.",
    );
    let running =
        reg.gauge("suanli_inference_replicas_running", "Replicas of live services whose allocation runs, by queue.");
    let ready = reg.gauge(
        "suanli_inference_replicas_ready",
        "Replicas of live services that pass their readiness check, as their agents report, by queue.",
    );
    let restarts = reg.gauge(
        "suanli_inference_restarts",
        "Replicas of live services replaced after they ended, plus whole-service requeues, by queue.",
    );
    let live = reg.gauge("suanli_inference_jobs", "Live services, by queue.");
    let load = reg.gauge(
        "suanli_inference_load",
        "Average load its ready replicas reported within three autoscaling periods, as the autoscaler sees it (the autoscaling metric's unit), by queue and service (running autoscaled services only; absent without fresh reports).",
    );
    let target = reg.gauge(
        "suanli_inference_load_target",
        "The load per replica an autoscaled service aims at (service.autoscale.target), by queue and service.",
    );
    let scaling = reg.gauge(
        "suanli_inference_scale_out_pending",
        "Live services with a scale-up whose replicas are not all ready yet, by queue.",
    );
    let scale_out = reg.histogram(
        "suanli_inference_scale_out_seconds",
        "Scale-out time of live services: from a scale-up to as many replicas ready (the latest 32 per service), by queue.",
    );
    let latency = reg.gauge(
        "suanli_inference_latency_ms",
        "Mean request latency its ready replicas measured and reported within three service.report periods, by queue and service.",
    );
    let success = reg.gauge(
        "suanli_inference_success_ratio",
        "Mean fraction of requests that succeeded, as its ready replicas measured and reported within three service.report periods, by queue and service.",
    );
    for q in s.queues().keys() {
        add(&scaling, l([("queue", q.as_str())]), 0.0);
        let ql = l([("queue", q.as_str())]);
        add(&wanted, ql.clone(), 0.0);
        add(&running, ql.clone(), 0.0);
        add(&ready, ql.clone(), 0.0);
        add(&restarts, ql.clone(), 0.0);
        add(&live, ql, 0.0);
    }
    for j in s.jobs().values().filter(|j| j.spec.is_service() && !j.state.is_terminal()) {
        let ql = l([("queue", j.spec.queue.as_str())]);
        add(&live, ql.clone(), 1.0);
        add(&wanted, ql.clone(), j.spec.groups.iter().map(|g| f64::from(g.replicas)).sum());
        let allocs = || j.allocs.iter().filter_map(|a| s.allocs().get(a));
        let n = allocs().filter(|a| a.state == AllocState::Running).count();
        add(&running, ql.clone(), n as f64);
        add(&ready, ql.clone(), allocs().filter(|a| a.state == AllocState::Running && a.ready).count() as f64);
        add(&restarts, ql.clone(), f64::from(j.requeues) + f64::from(j.restarts));
        add(&scaling, ql.clone(), if j.scale_out.is_some() { 1.0 } else { 0.0 });
        let h = scale_out.get_or_create(&ql);
        for t in &j.scale_outs {
            h.observe(*t as f64);
        }
        if let Some(a) = j.spec.service().and_then(|sv| sv.autoscale.clone()) {
            let sl = l([("queue", j.spec.queue.as_str()), ("service", j.spec.name.as_str())]);
            set(&target, sl.clone(), a.target as f64);
            // The loads the autoscaler decides on: fresh reports of ready replicas.
            let loads = s.autoscale_input(j.id, now).map(|x| x.loads).unwrap_or_default();
            if !loads.is_empty() {
                set(&load, sl, loads.iter().sum::<u64>() as f64 / loads.len() as f64 / 1000.0);
            }
        }
        let reported = s.reported(j, now);
        let sl = || l([("queue", j.spec.queue.as_str()), ("service", j.spec.name.as_str())]);
        if let Some(ms) = reported.mean_latency_ms() {
            set(&latency, sl(), ms);
        }
        if let Some(r) = reported.mean_success_ratio() {
            set(&success, sl(), r);
        }
    }
}

/// Device statistics and heartbeats: the leader's memory (followers export none).
fn leader_only(reg: &mut Reg, core: &crate::core::Core, leader: bool) {
    let util = reg.gauge(
        "suanli_device_utilization_ratio",
        "Device utilization from the plugin's last stats, by node, device, pool and model (leader only).",
    );
    let mem = reg.gauge(
        "suanli_device_memory_used_ratio",
        "Device memory used over the device's memory from the plugin's last stats (leader only; absent when the device reports no memory size).",
    );
    let pool_util = reg.gauge(
        "suanli_pool_device_utilization_ratio",
        "Mean device utilization by pool and model from the plugins' last stats (leader only).",
    );
    let hb = reg.gauge("suanli_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat (leader only).");
    let tie_rule = reg.gauge(
        "suanli_scheduler_tie_rule",
        "1 for the tie rule the default policy uses, as the last rehearsal on the pending work chose it: by-kind or first-fit (leader only).",
    );
    let tie_gain = reg.gauge(
        "suanli_scheduler_rehearsed_gain_points",
        "GPU allocation points by-kind ties gained over first-fit in the last rehearsal (leader only).",
    );
    if !leader {
        return;
    }
    if let Some(r) = core.tie_rule.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
        set(&tie_rule, l([("rule", r.ties.as_str()), ("why", r.why)]), 1.0);
        set(&tie_gain, l([]), r.gain());
    }
    let beats: Vec<(NodeId, f64)> = {
        let m = core.heartbeats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        m.iter().map(|(n, t)| (n.clone(), t.elapsed().as_secs_f64())).collect()
    };
    for (n, age) in beats {
        set(&hb, l([("node", n.as_str())]), age);
    }
    let nodes: Vec<NodeDevices> = core.state.read(|s| {
        s.nodes()
            .iter()
            .map(|(id, r)| {
                let devs = r.node.devices.iter().map(|d| (d.id.clone(), d.model.clone(), d.memory_mib)).collect();
                (id.clone(), r.node.pool.as_str().to_owned(), devs)
            })
            .collect()
    });
    let mut sums: BTreeMap<(String, String), (f64, u32)> = BTreeMap::new();
    for (id, pool, devs) in nodes {
        let stats = core.stats_of(&id);
        for st in stats {
            let Some((_, model, mem_mib)) = devs.iter().find(|(d, _, _)| *d == st.id) else { continue };
            let u = (st.utilization_pct / 100.0).clamp(0.0, 1.0);
            let dl = l([("node", id.as_str()), ("device", &st.id), ("pool", &pool), ("model", model)]);
            set(&util, dl.clone(), u);
            if *mem_mib > 0 {
                set(&mem, dl, st.memory_used_mib as f64 / *mem_mib as f64);
            }
            let e = sums.entry((pool.clone(), model.clone())).or_default();
            e.0 += u;
            e.1 += 1;
        }
    }
    for ((pool, model), (sum, n)) in sums {
        set(&pool_util, l([("pool", &pool), ("model", &model)]), sum / f64::from(n.max(1)));
    }
}

/// Raft health of this server (per process).
fn raft(reg: &mut Reg, core: &crate::core::Core) {
    let m = core.raft.metrics().borrow().clone();
    let id = core.id.to_string();
    let me = l([("server", id.as_str())]);
    let g = |reg: &mut Reg, name: &str, help: &str, v: f64| {
        let f = reg.gauge(name, help);
        set(&f, me.clone(), v);
    };
    let leader = m.state == ServerState::Leader;
    let last_log = m.last_log_index.unwrap_or(0);
    let applied = m.last_applied.map_or(0, |x| x.index);
    // The commit index: on the leader, the highest index a quorum of voters holds; elsewhere
    // openraft exposes none, so the applied index stands for it (a lower bound).
    let committed = if leader {
        let voters: Vec<u64> = m.membership_config.membership().voter_ids().collect();
        let mut matched: Vec<u64> = voters
            .iter()
            .map(|v| {
                if *v == core.id {
                    last_log
                } else {
                    m.replication.as_ref().and_then(|r| r.get(v).cloned().flatten()).map_or(0, |x| x.index)
                }
            })
            .collect();
        matched.sort_unstable_by(|a, b| b.cmp(a));
        let q = voters.len() / 2;
        matched.get(q).copied().unwrap_or(applied).max(applied)
    } else {
        applied
    };
    g(reg, "suanli_raft_is_leader", "1 when this server leads (per process).", if leader { 1.0 } else { 0.0 });
    g(reg, "suanli_raft_term", "Current raft term of this server.", m.current_term as f64);
    g(
        reg,
        "suanli_raft_leader_id",
        "Raft id of the leader this server knows (0: none).",
        m.current_leader.unwrap_or(0) as f64,
    );
    g(reg, "suanli_raft_last_log_index", "Index of the last entry in this server's log.", last_log as f64);
    g(
        reg,
        "suanli_raft_commit_index",
        "Highest committed index this server knows (the leader: quorum match; a follower: its applied index).",
        committed as f64,
    );
    g(reg, "suanli_raft_applied_index", "Index of the last entry applied to this server's state.", applied as f64);
    g(
        reg,
        "suanli_raft_commit_lag_entries",
        "Entries in this server's log not yet committed (last log index - commit index).",
        last_log.saturating_sub(committed) as f64,
    );
    g(
        reg,
        "suanli_raft_apply_lag_entries",
        "Committed entries not yet applied here (commit index - applied index).",
        committed.saturating_sub(applied) as f64,
    );
    let rep = reg.gauge(
        "suanli_raft_replication_lag_entries",
        "On the leader: entries each follower lacks (leader's last log index - follower's matched index).",
    );
    if let Some(r) = &m.replication {
        for (peer, matched) in r.iter() {
            if *peer == core.id {
                continue;
            }
            let idx = matched.as_ref().map_or(0, |x| x.index);
            set(&rep, l([("server", id.as_str()), ("peer", &peer.to_string())]), last_log.saturating_sub(idx) as f64);
        }
    }
}

/// The replicated families of `s` alone, as OpenMetrics text (tests and benchmarks).
#[cfg(test)]
pub fn render_state(s: &State) -> Result<String, std::fmt::Error> {
    let mut reg = Reg(Registry::default());
    replicated(&mut reg, s, s.clock(), s.clock());
    let mut out = String::new();
    encode(&mut out, &reg.0)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use suanli_model::{Device, Node, PoolId, Queue, ResVec};
    use suanli_state::{Command, RegisterNode, StateConfig, SubmitJob, UpsertQueue};

    fn state(jobs: usize) -> State {
        let mut s = State::new(StateConfig::default());
        let mut q = Queue::new("q", ResVec { gpu_milli: 4000, ..ResVec::ZERO });
        q.team = "ml".into();
        s.apply(Command::UpsertQueue(UpsertQueue { queue: q }));
        let node = Node {
            id: NodeId::from("n0"),
            pool: PoolId::from("p"),
            datacenter: String::new(),
            region: String::new(),
            labels: Default::default(),
            cpu_milli: 8000,
            memory_mib: 8192,
            devices: vec![
                Device::simple("gpu0", DeviceKind::Gpu, "A100"),
                Device::simple("gpu1", DeviceKind::Gpu, "A100"),
            ],
            schedulable: true,
            agent_addr: String::new(),
        };
        s.apply(Command::RegisterNode(Box::new(RegisterNode { node, now: 1, fence: None })));
        for i in 0..jobs {
            let kind = if i % 2 == 0 { "inference" } else { "training" };
            let spec = serde_json::from_value(serde_json::json!({"name": "j", "queue": "q", "kind": kind,
                "groups": [{"name": "w", "replicas": 2, "resources": {"cpu_milli": 100,
                "devices": {"kind": "gpu", "count": 1, "milli": 500}}}]}))
            .expect("spec");
            s.apply(Command::SubmitJob(Box::new(SubmitJob {
                client_request_id: format!("r{i}"),
                spec,
                retry: None,
                now: 10,
                trace: None,
            })));
        }
        s
    }

    /// Every line is a valid exposition line, names follow the conventions, and each family
    /// is there with the figures of a known state.
    #[test]
    fn the_text_parses_and_carries_every_family() {
        let s = state(3);
        let text = render_state(&s).expect("encodes");
        assert!(text.ends_with("# EOF\n"), "{text}");
        for line in text.lines() {
            if line.starts_with('#') {
                assert!(
                    line.starts_with("# HELP suanli_") || line.starts_with("# TYPE suanli_") || line == "# EOF",
                    "{line}"
                );
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("name value");
            assert!(value.parse::<f64>().is_ok(), "{line}");
            assert!(series.starts_with("suanli_"), "{line}");
        }
        for want in [
            "suanli_devices{pool=\"p\",kind=\"gpu\",model=\"A100\",health=\"healthy\"} 2.0",
            "suanli_devices_idle{pool=\"p\",kind=\"gpu\",model=\"A100\"} 2.0",
            "suanli_pool_fragmentation_ratio{pool=\"p\"} 0.0",
            "suanli_jobs{queue=\"q\",state=\"pending\"} 3.0",
            "suanli_queue_oldest_pending_seconds{queue=\"q\"} 0.0",
            "suanli_queue_quota_nominal{queue=\"q\",team=\"ml\",resource=\"gpu\"} 4.0",
            "suanli_queue_quota_used{queue=\"q\",team=\"ml\",resource=\"gpu\"} 0.0",
            "suanli_inference_replicas_wanted{queue=\"q\"} 4.0",
            "suanli_inference_jobs{queue=\"q\"} 2.0",
            "suanli_node_up{node=\"n0\",pool=\"p\"} 1.0",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    /// A job placed at 20 (submitted at 10) whose task reports running at 25: one wait of
    /// 10 s and one time to start of 15 s in its queue's histograms.
    #[test]
    fn wait_and_time_to_start_are_observed() {
        use suanli_state::{AllocStatus, ApplyPlan, ReportedStatus};
        let mut s = state(1);
        // Room for the job's CPU too (the known state's queue guarantees GPUs only).
        let mut q = Queue::new("q", ResVec { gpu_milli: 4000, ..ResVec::MAX });
        q.team = "ml".into();
        s.apply(Command::UpsertQueue(UpsertQueue { queue: q }));
        let plan = suanli_scheduler::schedule(&s.cluster_view(20), 20, 1, &Default::default()).expect("engine");
        s.apply(Command::ApplyPlan(ApplyPlan { plan, now: 20 }));
        let a = s.allocs().values().next().expect("placed").alloc.clone();
        s.apply(Command::AllocStatus(AllocStatus {
            alloc: a.id,
            epoch: a.epoch,
            status: ReportedStatus::Running,
            message: String::new(),
            end: None,
            exit_code: None,
            now: 25,
        }));
        let text = render_state(&s).expect("encodes");
        for want in [
            "# TYPE suanli_queue_wait_seconds histogram",
            "suanli_queue_wait_seconds_sum{queue=\"q\"} 10.0",
            "suanli_queue_wait_seconds_count{queue=\"q\"} 1",
            "# TYPE suanli_job_time_to_start_seconds histogram",
            "suanli_job_time_to_start_seconds_sum{queue=\"q\"} 15.0",
            "suanli_job_time_to_start_seconds_bucket{le=\"15.0\",queue=\"q\"} 1",
            "suanli_job_time_to_start_seconds_bucket{le=\"5.0\",queue=\"q\"} 0",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    /// Two replicas of a service report their latency and success ratio: the means are
    /// exported by queue and service while the reports are fresh (within three
    /// `service.report` periods), and not after.
    #[test]
    fn reported_latency_success_and_load_are_exported_while_fresh() {
        use suanli_state::{AllocReady, AllocStatus, ApplyPlan, ReportedStatus};
        let mut s = state(0);
        let mut q = Queue::new("q", ResVec { gpu_milli: 4000, ..ResVec::MAX });
        q.team = "ml".into();
        s.apply(Command::UpsertQueue(UpsertQueue { queue: q }));
        let spec = serde_json::from_value(serde_json::json!({"name": "api", "queue": "q", "kind": "inference",
            "groups": [{"name": "w", "replicas": 2, "resources": {"cpu_milli": 100}}],
            "service": {"report": {"period_s": 5},
                        "autoscale": {"min_replicas": 1, "max_replicas": 4, "target": 10, "period_s": 5}}}))
        .expect("spec");
        s.apply(Command::SubmitJob(Box::new(SubmitJob {
            client_request_id: "api".into(),
            spec,
            retry: None,
            now: 10,
            trace: None,
        })));
        let plan = suanli_scheduler::schedule(&s.cluster_view(20), 20, 1, &Default::default()).expect("engine");
        s.apply(Command::ApplyPlan(ApplyPlan { plan, now: 20 }));
        let allocs: Vec<_> = s.allocs().values().map(|a| a.alloc.clone()).collect();
        assert_eq!(allocs.len(), 2);
        let reports = [(10_000, 1_000_000, 5_000), (30_000, 900_000, 15_000)];
        for (a, (latency_us, success_ppm, load)) in allocs.iter().zip(reports) {
            s.apply(Command::AllocStatus(AllocStatus {
                alloc: a.id,
                epoch: a.epoch,
                status: ReportedStatus::Running,
                message: String::new(),
                end: None,
                exit_code: None,
                now: 21,
            }));
            s.apply(Command::AllocReady(AllocReady {
                alloc: a.id,
                epoch: a.epoch,
                ready: true,
                endpoint: "127.0.0.1:9000".into(),
                load_milli: Some(load),
                latency_us: Some(latency_us),
                success_ppm: Some(success_ppm),
                now: 22,
            }));
        }
        let text = |fresh_now: u64| {
            let mut reg = Reg(Registry::default());
            replicated(&mut reg, &s, s.clock(), fresh_now);
            let mut out = String::new();
            encode(&mut out, &reg.0).expect("encodes");
            out
        };
        let fresh = text(37);
        for want in [
            "suanli_inference_latency_ms{queue=\"q\",service=\"api\"} 20.0",
            "suanli_inference_success_ratio{queue=\"q\",service=\"api\"} 0.95",
            "suanli_inference_load{queue=\"q\",service=\"api\"} 10.0",
        ] {
            assert!(fresh.contains(want), "missing {want:?} in\n{fresh}");
        }
        let stale = text(38);
        assert!(!stale.contains("suanli_inference_latency_ms{"), "{stale}");
        assert!(!stale.contains("suanli_inference_success_ratio{"), "{stale}");
        // The load too, as the autoscaler sees it: three autoscaling periods.
        assert!(!stale.contains("suanli_inference_load{"), "{stale}");
        assert!(stale.contains("suanli_inference_load_target{queue=\"q\",service=\"api\"} 10"), "{stale}");
    }

    /// The cost of a scrape's replicated part for 10,000 jobs (docs/metrics.md quotes it).
    #[test]
    fn scrape_cost_for_10k_jobs() {
        let s = state(10_000);
        assert_eq!(s.jobs().len(), 10_000);
        let t = std::time::Instant::now();
        let runs = 5;
        let mut bytes = 0;
        for _ in 0..runs {
            bytes = render_state(&s).expect("encodes").len();
        }
        let each = t.elapsed() / runs;
        // A figure for docs/metrics.md, not a timed assertion (run with --nocapture).
        eprintln!("metrics: 10000 jobs: {each:?} per render, {bytes} bytes");
        assert!(bytes > 0);
    }
}
