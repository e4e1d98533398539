//! One OpenTelemetry trace per job life (docs/tracing.md).
//!
//! The job's root span context is chosen by the submit handler (the caller's trace id when it
//! sent a W3C `traceparent`, else a new one) and stored with the job in the replicated state,
//! so whichever server or agent handles a later event parents its span on it. Each event's
//! span is emitted by exactly one process: the one on whose code path the event happens (the
//! submit handler, the leader's scheduling loop, the handler of an agent's report), with the
//! times the state recorded. The root `job` span itself is emitted once, when the job ends,
//! with the stored span id.
//!
//! Spans go to the global tracer provider. With none installed (no OTLP endpoint configured)
//! [`enabled`] is false and every function here returns before building anything.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{
    Span as _, SpanBuilder, SpanContext, SpanId, SpanKind, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Context, KeyValue};
use suanli_state::{Job, State};

/// `[telemetry]` of the server config.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The OTLP gRPC endpoint spans are exported to (`http://host:port`); it wins over
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`. Neither set: no exporter, spans cost nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

static ENABLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static FORCED_SPAN_ID: Cell<Option<SpanId>> = const { Cell::new(None) };
    static FORCED_TRACE_ID: Cell<Option<TraceId>> = const { Cell::new(None) };
}

/// Marks tracing on: called once by the process that installed an exporting tracer provider.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// True when spans are exported (an OTLP endpoint is configured).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The span id the next span started on this thread must have, taken once: the tracer
/// provider's id generator (installed by the CLI) asks for it before drawing a random one. It
/// is how the root `job` span gets the id stored with the job.
pub fn take_forced_span_id() -> Option<SpanId> {
    FORCED_SPAN_ID.with(|c| c.take())
}

/// Like [`take_forced_span_id`] for the trace id of a span without a parent.
pub fn take_forced_trace_id() -> Option<TraceId> {
    FORCED_TRACE_ID.with(|c| c.take())
}

/// Parses a W3C `traceparent` ([`suanli_model::trace::TraceParent`]) into a remote span
/// context; `None` when malformed or all-zero.
pub fn parse_traceparent(s: &str) -> Option<SpanContext> {
    let tp = suanli_model::trace::TraceParent::parse(s)?;
    let sc = SpanContext::new(
        TraceId::from_bytes(tp.trace_id),
        SpanId::from_bytes(tp.span_id),
        TraceFlags::new(tp.flags),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// Formats a span context as a W3C `traceparent`.
pub fn format_traceparent(sc: &SpanContext) -> String {
    format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8())
}

fn random<const N: usize>() -> [u8; N] {
    use ring::rand::SecureRandom as _;
    let mut b = [0u8; N];
    // The system's random source does not fail on the platforms we run on; a zero id would
    // only make the span invalid (not exported), never wrong.
    let _ = ring::rand::SystemRandom::new().fill(&mut b);
    b
}

/// The root span of a new job, as a `traceparent` to store with it: the caller's trace (its
/// span is the root's parent, see [`caller_parent`]) or a new one, and a new span id. `None`
/// when tracing is off and the caller sent no trace context (nothing is stored).
pub fn new_job_root(caller: Option<&SpanContext>) -> Option<String> {
    let trace_id = match caller {
        Some(c) => c.trace_id(),
        None if enabled() => TraceId::from_bytes(random::<16>()),
        None => return None,
    };
    let mut span = random::<8>();
    if span == [0; 8] {
        span[7] = 1;
    }
    let trace_id = if trace_id == TraceId::INVALID { TraceId::from_bytes([1; 16]) } else { trace_id };
    let sc = SpanContext::new(trace_id, SpanId::from_bytes(span), TraceFlags::SAMPLED, false, TraceState::default());
    Some(match caller {
        Some(c) => format!("{} {}", format_traceparent(&sc), c.span_id()),
        None => format_traceparent(&sc),
    })
}

/// The caller's span context from gRPC metadata (`traceparent`), if it sent a valid one.
pub fn caller_parent(md: &tonic::metadata::MetadataMap) -> Option<SpanContext> {
    md.get("traceparent").and_then(|v| v.to_str().ok()).and_then(parse_traceparent)
}

/// The job's root span context (remote: another process may have chosen it). The stored
/// text is the root's `traceparent`, then, when the submitter sent one, a space and the
/// submitter's span id (the root's parent).
pub fn job_root(job: &Job) -> Option<SpanContext> {
    job.trace.as_deref().and_then(|t| t.split(' ').next()).and_then(parse_traceparent)
}

/// The root's `traceparent` alone (what an agent is given).
pub fn job_traceparent(job: &Job) -> Option<String> {
    job_root(job).map(|sc| format_traceparent(&sc))
}

/// The submitter's span (the root span's parent), when it sent one.
pub fn job_parent(job: &Job) -> Option<SpanContext> {
    let root = job_root(job)?;
    let parent = job.trace.as_deref()?.split(' ').nth(1)?;
    let id = SpanId::from_hex(parent).ok().filter(|id| *id != SpanId::INVALID)?;
    Some(SpanContext::new(root.trace_id(), id, TraceFlags::SAMPLED, true, TraceState::default()))
}

/// The job's trace id, 32 hex digits.
pub fn trace_id_of(job: &Job) -> Option<String> {
    job_root(job).map(|sc| sc.trace_id().to_string())
}

/// A time in seconds since the Unix epoch (the state's clock) as a [`SystemTime`].
pub fn at_s(s: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(s)
}

/// The attributes every span of a job carries: `suanli.job`, `suanli.queue`, `suanli.team`
/// (the queue's team, when it has one), `suanli.region` (when the job is federated) and the
/// job's `suanli.attempt`.
pub fn job_attrs(s: &State, job: &Job) -> Vec<KeyValue> {
    let mut v = vec![
        KeyValue::new("suanli.job", job.id.0 as i64),
        KeyValue::new("suanli.queue", job.spec.queue.0.clone()),
        KeyValue::new("suanli.attempt", job.attempt as i64),
    ];
    if let Some(q) = s.queues().get(&job.spec.queue).filter(|q| !q.team.is_empty()) {
        v.push(KeyValue::new("suanli.team", q.team.clone()));
    }
    if !job.spec.name.is_empty() {
        v.push(KeyValue::new("suanli.job_name", job.spec.name.clone()));
    }
    v
}

/// Attributes of one allocation: `suanli.node`, `suanli.pool`, `suanli.region` (the node's),
/// `suanli.devices` (`id:milli` list), `suanli.attempt` (its epoch), `suanli.alloc`.
pub fn alloc_attrs(s: &State, a: &suanli_model::Allocation) -> Vec<KeyValue> {
    let mut v = vec![
        KeyValue::new("suanli.alloc", a.id.0 as i64),
        KeyValue::new("suanli.node", a.node.as_str().to_owned()),
        KeyValue::new("suanli.attempt", a.epoch as i64),
        KeyValue::new(
            "suanli.devices",
            a.devices.iter().map(|d| format!("{}:{}", d.device, d.milli)).collect::<Vec<_>>().join(","),
        ),
    ];
    if let Some(n) = s.nodes().get(&a.node) {
        v.push(KeyValue::new("suanli.pool", n.node.pool.as_str().to_owned()));
        if !n.node.region.is_empty() {
            v.push(KeyValue::new("suanli.region", n.node.region.clone()));
        }
    }
    v
}

/// Device-seconds an allocation held from `start` to `end` (state seconds), shares weighted
/// (1000 milli = one device): the attempt's `suanli.device_seconds`.
pub fn device_seconds(a: &suanli_model::Allocation, end: u64) -> f64 {
    let milli: u64 = a.devices.iter().map(|d| u64::from(d.milli)).sum();
    end.saturating_sub(a.started_at) as f64 * milli as f64 / 1000.0
}

/// Emits one finished child span of the job's root span. A no-op when tracing is off or the
/// job has no trace.
pub fn emit(root: &SpanContext, name: &'static str, start: SystemTime, end: SystemTime, attrs: Vec<KeyValue>) {
    if !enabled() {
        return;
    }
    let tracer = opentelemetry::global::tracer("suanli");
    let parent = Context::new().with_remote_span_context(root.clone());
    let start = start.min(end);
    let mut span = SpanBuilder::from_name(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(start)
        .with_attributes(attrs)
        .start_with_context(&tracer, &parent);
    span.end_with_timestamp(end);
}

/// Emits the root `job` span itself (once, when the job ends): the stored span id, parented
/// on the submitter's span when it sent one (`parent`), from its submission to `end`.
pub fn emit_root(
    root: &SpanContext,
    parent: Option<&SpanContext>,
    start: SystemTime,
    end: SystemTime,
    attrs: Vec<KeyValue>,
) {
    if !enabled() {
        return;
    }
    let tracer = opentelemetry::global::tracer("suanli");
    // The ids are the stored ones: the id generator takes them from here (a true root has no
    // parent, so its trace id comes from the generator too).
    let cx = match parent {
        Some(p) => Context::new().with_remote_span_context(p.clone()),
        None => Context::new(),
    };
    FORCED_SPAN_ID.with(|c| c.set(Some(root.span_id())));
    FORCED_TRACE_ID.with(|c| c.set(Some(root.trace_id())));
    let mut span = SpanBuilder::from_name("job")
        .with_kind(SpanKind::Internal)
        .with_start_time(start.min(end))
        .with_attributes(attrs)
        .start_with_context(&tracer, &cx);
    FORCED_SPAN_ID.with(|c| c.set(None));
    FORCED_TRACE_ID.with(|c| c.set(None));
    span.end_with_timestamp(end);
}

/// The priced cost of an attempt from the ledger (docs/cost.md): `suanli.cost` (its total, in
/// the catalog's currency, 6 decimals), `suanli.cost.currency`, and its split into
/// `suanli.cost.useful` and the part lost (`suanli.cost.lost`, to preemption or failure).
/// Nothing when no price catalog is set or the attempt was folded out of the ledger.
pub fn attempt_cost_attrs(s: &State, a: &suanli_model::Allocation, end: u64) -> Vec<KeyValue> {
    use suanli_state::cost::format_amount;
    let ledger = s.ledger();
    if ledger.prices.is_empty() {
        return Vec::new();
    }
    let Some(e) = ledger.entries.get(&a.id) else { return Vec::new() };
    let am = e.amounts(0, u64::MAX, end);
    vec![
        KeyValue::new("suanli.cost", format_amount(am.total())),
        KeyValue::new("suanli.cost.currency", ledger.prices.currency.clone()),
        KeyValue::new("suanli.cost.useful", format_amount(am.useful + am.running)),
        KeyValue::new("suanli.cost.lost", format_amount(am.lost_preemption + am.lost_failure)),
    ]
}

/// What the tracing side of an agent's report needs from before it is applied: the
/// allocation (still live then) and whether its job had ended already.
#[derive(Debug, Clone)]
pub struct BeforeReport {
    alloc: std::sync::Arc<suanli_model::Allocation>,
    job_ended: bool,
}

/// Looks at a live allocation before its report is applied; `None` when tracing is off, the
/// allocation is unknown or already ended, or its job has no trace.
pub fn before_report(s: &State, alloc: suanli_model::AllocId) -> Option<BeforeReport> {
    if !enabled() {
        return None;
    }
    let a = s.allocs().get(&alloc).filter(|a| a.is_live())?;
    let job = s.job(a.alloc.job)?;
    job.trace.as_ref()?;
    Some(BeforeReport { alloc: a.alloc.clone(), job_ended: job.state.is_terminal() })
}

/// After an agent's report of an allocation's end was applied: the `attempt` span (its
/// placement to its end, with the end class, node, devices and device-seconds) and, when this
/// report ended the job, the root `job` span.
pub fn after_report(s: &State, before: &BeforeReport, now: u64) {
    let a = &before.alloc;
    let Some(job) = s.job(a.job) else { return };
    let Some(root) = job_root(job) else { return };
    // An ended attempt's allocation is in the job's history once the job is requeued; one
    // that ended the job stays in the allocation table, ended.
    let ended = match job.history.iter().rev().find(|h| h.alloc == a.id) {
        Some(h) => Some((h.end, h.ended_at, h.lost_device_s)),
        None => s.allocs().get(&a.id).filter(|x| !x.is_live()).map(|x| (x.end, x.updated_at, x.lost_device_s)),
    };
    let Some((end, ended_at, lost)) = ended else { return };
    let mut attrs = job_attrs(s, job);
    attrs.retain(|kv| kv.key.as_str() != "suanli.attempt");
    attrs.extend(alloc_attrs(s, a));
    attrs.push(KeyValue::new("suanli.end", end.map(|e| e.as_str().to_owned()).unwrap_or_default()));
    attrs.push(KeyValue::new("suanli.device_seconds", device_seconds(a, ended_at)));
    attrs.push(KeyValue::new("suanli.lost_device_seconds", lost as i64));
    attrs.extend(attempt_cost_attrs(s, a, ended_at));
    emit(&root, "attempt", at_s(a.started_at), at_s(ended_at.max(a.started_at)), attrs);
    if job.state.is_terminal() && !before.job_ended {
        job_ended(s, job, now);
    }
}

/// The root `job` span of a job that just ended (succeeded, failed or cancelled).
pub fn job_ended(s: &State, job: &Job, now: u64) {
    if !enabled() {
        return;
    }
    let Some(root) = job_root(job) else { return };
    let mut attrs = job_attrs(s, job);
    attrs.push(KeyValue::new("suanli.state", job.state.as_str().to_owned()));
    attrs.push(KeyValue::new("suanli.failures", i64::from(job.failures)));
    attrs.push(KeyValue::new("suanli.requeues", i64::from(job.requeues)));
    attrs.push(KeyValue::new("suanli.lost_device_seconds", job.lost_device_s as i64));
    if !job.reason.is_empty() {
        attrs.push(KeyValue::new("suanli.reason", job.reason.clone()));
    }
    let end = at_s(now.max(job.submitted_at)).max(SystemTime::now().min(at_s(now + 1)));
    emit_root(&root, job_parent(job).as_ref(), at_s(job.submitted_at), end, attrs);
}

/// Why each job of a plan waited, read before the plan is applied (the job's `reason` is
/// cleared once it is placed). Empty when tracing is off.
pub fn wait_reasons(s: &State, plan: &suanli_model::Plan) -> std::collections::BTreeMap<suanli_model::JobId, String> {
    if !enabled() {
        return Default::default();
    }
    plan.placements.iter().filter_map(|p| s.job(p.job).map(|j| (p.job, j.reason.clone()))).collect()
}

/// After a plan committed: per placed job a `job.queued` span (from its submission, or its
/// last attempt's end, to now, with the last wait reason) and per allocation a `job.placed`
/// span; per preempted allocation a `job.preempted` span.
pub fn plan_committed(
    s: &State,
    placed: &[suanli_model::AllocId],
    preempted: &[suanli_model::AllocId],
    reasons: &std::collections::BTreeMap<suanli_model::JobId, String>,
    now: u64,
) {
    if !enabled() {
        return;
    }
    let wall = SystemTime::now();
    let mut queued = std::collections::BTreeSet::new();
    for id in placed {
        let Some(a) = s.allocs().get(id) else { continue };
        let Some(job) = s.job(a.alloc.job) else { continue };
        let Some(root) = job_root(job) else { continue };
        if queued.insert(job.id) {
            let since = job.history.last().map_or(job.submitted_at, |h| h.ended_at.max(job.submitted_at));
            let mut attrs = job_attrs(s, job);
            if let Some(r) = reasons.get(&job.id).filter(|r| !r.is_empty()) {
                attrs.push(KeyValue::new("suanli.wait_reason", r.clone()));
            }
            emit(&root, "job.queued", at_s(since).min(wall), wall, attrs);
        }
        let mut attrs = job_attrs(s, job);
        attrs.retain(|kv| kv.key.as_str() != "suanli.attempt");
        attrs.extend(alloc_attrs(s, &a.alloc));
        emit(&root, "job.placed", wall, wall, attrs);
    }
    for id in preempted {
        let Some(a) = s.allocs().get(id) else { continue };
        let Some(job) = s.job(a.alloc.job) else { continue };
        let Some(root) = job_root(job) else { continue };
        let mut attrs = job_attrs(s, job);
        attrs.retain(|kv| kv.key.as_str() != "suanli.attempt");
        attrs.extend(alloc_attrs(s, &a.alloc));
        attrs.push(KeyValue::new("suanli.device_seconds", device_seconds(&a.alloc, now)));
        emit(&root, "job.preempted", wall, wall, attrs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_refuses_malformed() {
        let s = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let sc = parse_traceparent(s).expect("valid");
        assert_eq!(format_traceparent(&sc), s);
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_new_root_keeps_the_callers_trace_and_off_stores_nothing() {
        let caller = parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").expect("valid");
        let root = new_job_root(Some(&caller)).expect("a root");
        let (tp, parent) = root.split_once(' ').expect("with the caller's span");
        assert_eq!(parent, caller.span_id().to_string());
        let sc = parse_traceparent(tp).expect("valid");
        assert_eq!(sc.trace_id(), caller.trace_id());
        assert_ne!(sc.span_id(), caller.span_id());
        if !enabled() {
            assert_eq!(new_job_root(None), None);
        }
    }
}
