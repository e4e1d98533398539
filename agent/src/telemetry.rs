//! The agent's spans of a job's trace (docs/tracing.md): `task.start` (the allocation seen to
//! the task running), `task.run` (running to its end, with how it ended) and `checkpoint`
//! (per committed checkpoint), each a child of the job's root span whose context the control
//! plane sends in `AllocInfo.traceparent`, with the node, the allocation and its attempt.
//!
//! Spans go to the global tracer provider the CLI installs when an OTLP endpoint is
//! configured; without one [`set_enabled`] was never called and every function returns at
//! once.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use opentelemetry::trace::{
    Span as _, SpanBuilder, SpanContext, SpanId, SpanKind, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Context, KeyValue};
use suanli_proto::v1 as pb;

/// `[telemetry]` of the agent config.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The OTLP gRPC endpoint spans are exported to (`http://host:port`); it wins over
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`. Neither set: no exporter, spans cost nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Marks tracing on: called once by the process that installed an exporting tracer provider.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// What the agent remembers of a traced allocation until its final report.
struct Traced {
    root: SpanContext,
    attrs: Vec<KeyValue>,
    seen: SystemTime,
    running: Option<SystemTime>,
}

static ALLOCS: Mutex<BTreeMap<(u64, u64), Traced>> = Mutex::new(BTreeMap::new());

fn parse(tp: &str) -> Option<SpanContext> {
    let tp = suanli_model::trace::TraceParent::parse(tp)?;
    let sc = SpanContext::new(
        TraceId::from_bytes(tp.trace_id),
        SpanId::from_bytes(tp.span_id),
        TraceFlags::new(tp.flags),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// Remembers an allocation the agent is about to start (once per allocation and attempt).
pub fn alloc_seen(node: &str, a: &pb::AllocInfo) {
    if !enabled() {
        return;
    }
    let Some(root) = parse(&a.traceparent) else { return };
    let attrs = vec![
        KeyValue::new("suanli.job", a.job_id as i64),
        KeyValue::new("suanli.alloc", a.id as i64),
        KeyValue::new("suanli.attempt", a.epoch as i64),
        KeyValue::new("suanli.node", node.to_owned()),
        KeyValue::new("suanli.queue", a.queue.clone()),
        KeyValue::new(
            "suanli.devices",
            a.devices.iter().map(|d| format!("{}:{}", d.device, d.milli)).collect::<Vec<_>>().join(","),
        ),
    ];
    let mut m = ALLOCS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    m.entry((a.id, a.epoch)).or_insert(Traced { root, attrs, seen: SystemTime::now(), running: None });
}

fn emit(root: &SpanContext, name: &'static str, start: SystemTime, end: SystemTime, attrs: Vec<KeyValue>) {
    let tracer = opentelemetry::global::tracer("suanli");
    let parent = Context::new().with_remote_span_context(root.clone());
    let mut span = SpanBuilder::from_name(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(start.min(end))
        .with_attributes(attrs)
        .start_with_context(&tracer, &parent);
    span.end_with_timestamp(end);
}

/// A status report was queued: RUNNING emits `task.start`; a final one emits `task.run`
/// (or `task.start` failing, when it never ran) and forgets the allocation.
pub fn reported(alloc: u64, epoch: u64, status: pb::AllocReport, end: &str, message: &str) {
    if !enabled() {
        return;
    }
    let now = SystemTime::now();
    let mut m = ALLOCS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if status == pb::AllocReport::Running {
        if let Some(t) = m.get_mut(&(alloc, epoch))
            && t.running.is_none()
        {
            t.running = Some(now);
            emit(&t.root, "task.start", t.seen, now, t.attrs.clone());
        }
        return;
    }
    let Some(t) = m.remove(&(alloc, epoch)) else { return };
    let mut attrs = t.attrs;
    attrs.push(KeyValue::new("suanli.end", end.to_owned()));
    attrs.push(KeyValue::new("suanli.message", message.to_owned()));
    let name = if t.running.is_some() { "task.run" } else { "task.start" };
    emit(&t.root, name, t.running.unwrap_or(t.seen), now, attrs);
}

/// A checkpoint was committed and reported: a `checkpoint` span from `started` (the commit
/// seen) to now, with its step and size.
pub fn checkpoint(alloc: u64, epoch: u64, step: u64, bytes: u64, started: SystemTime) {
    if !enabled() {
        return;
    }
    let m = ALLOCS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(t) = m.get(&(alloc, epoch)) else { return };
    let mut attrs = t.attrs.clone();
    attrs.push(KeyValue::new("suanli.checkpoint_step", step as i64));
    attrs.push(KeyValue::new("suanli.checkpoint_bytes", bytes as i64));
    emit(&t.root, "checkpoint", started, SystemTime::now(), attrs);
}
