//! Log output of the long-running commands (`server`, `agent`, `dev`): stderr, filtered by
//! `SUANLI_LOG`, as text (ANSI colours only when stderr is a terminal) or as JSON lines.
//!
//! With an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`, or the `[telemetry] otlp_endpoint`
//! config key of the server and the agent) it also installs the OpenTelemetry exporter
//! (docs/tracing.md): a batch span processor over gRPC (tonic), set as the global tracer
//! provider (the job-life spans of `suanli_server::telemetry` and the agent go there), and a
//! `tracing-opentelemetry` layer so the process's own `tracing` spans export too. Without
//! one nothing is installed: spans cost a check of one flag.

use std::io::IsTerminal;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// `--log-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines; coloured only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields, spans).
    Json,
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// The installed tracer provider (flushed by [`shutdown`]) and the runtime its gRPC channel
/// lives on.
static PROVIDER: Mutex<Option<(opentelemetry_sdk::trace::SdkTracerProvider, tokio::runtime::Runtime)>> =
    Mutex::new(None);

/// The environment variable naming the OTLP endpoint (the OpenTelemetry convention).
pub const OTLP_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// How long [`shutdown`] waits for the last spans to leave.
const FLUSH_BOUND: Duration = Duration::from_secs(3);

/// Records the format chosen on the command line (once, in `main`).
pub fn set_format(f: LogFormat) {
    let _ = FORMAT.set(f);
}

/// Logs to stderr, filtered by `SUANLI_LOG` (default `default`), in the chosen format.
pub fn init(default: &str) {
    let _ = install(default, None);
}

/// What a process exports its spans as: `service.name` and `service.instance.id`.
#[derive(Debug, Clone)]
pub struct Service<'a> {
    /// `suanli-server`, `suanli-agent`, `suanli-federation`.
    pub name: &'static str,
    /// This process among the service's (server id, node id...).
    pub instance: String,
    /// The config key's value, if the config sets one (it wins over the environment).
    pub config_endpoint: Option<&'a str>,
    /// The config key's name, for errors (`telemetry.otlp_endpoint`).
    pub config_key: &'static str,
}

/// Like [`init`], and installs the OTLP exporter when an endpoint is configured (see the
/// module doc). A malformed endpoint is an error naming the key or variable it came from.
pub fn init_traced(default: &str, service: Service<'_>) -> Result<()> {
    let endpoint = match service.config_endpoint.filter(|e| !e.trim().is_empty()) {
        Some(e) => Some((service.config_key, e.trim().to_owned())),
        None => std::env::var(OTLP_ENV).ok().filter(|e| !e.trim().is_empty()).map(|e| (OTLP_ENV, e.trim().to_owned())),
    };
    let Some((key, endpoint)) = endpoint else {
        return install(default, None);
    };
    check_endpoint(key, &endpoint)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp")
        .enable_all()
        .build()
        .context("starting the OTLP exporter's runtime")?;
    let exporter = {
        let _in = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(Duration::from_secs(5))
            .build()
            .with_context(|| format!("{key}: {endpoint}: building the OTLP exporter"))?
    };
    let mut batch = opentelemetry_sdk::trace::BatchConfigBuilder::default();
    if std::env::var_os("OTEL_BSP_SCHEDULE_DELAY").is_none() {
        batch = batch.with_scheduled_delay(Duration::from_millis(500));
    }
    let processor =
        opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter).with_batch_config(batch.build()).build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.name)
        .with_attribute(opentelemetry::KeyValue::new("service.instance.id", service.instance))
        .build();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_id_generator(StoredIds)
        .with_resource(resource)
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    suanli_server::telemetry::set_enabled(true);
    let tracer = provider.tracer("suanli");
    if let Ok(mut p) = PROVIDER.lock() {
        *p = Some((provider, rt));
    }
    install(default, Some(tracing_opentelemetry::layer().with_tracer(tracer)))
}

/// An endpoint the tonic exporter can reach: `http://host:port` (TLS to the collector is not
/// built in; run a local collector).
fn check_endpoint(key: &str, e: &str) -> Result<()> {
    let Some(rest) = e.strip_prefix("http://") else {
        if e.starts_with("https://") {
            bail!("{key}: {e:?}: https is not supported (export to a local collector over http://host:port)");
        }
        bail!("{key}: {e:?} is not an http://host:port URL");
    };
    let host_port = rest.trim_end_matches('/');
    let ok = e.len() <= 2048
        && host_port.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
        && e.parse::<tonic::transport::Uri>().is_ok();
    if !ok {
        bail!("{key}: {e:?} is not an http://host:port URL (at most 2048 characters)");
    }
    Ok(())
}

type OtelLayer =
    tracing_opentelemetry::OpenTelemetryLayer<tracing_subscriber::Registry, opentelemetry_sdk::trace::SdkTracer>;

fn install(default: &str, otel: Option<OtelLayer>) -> Result<()> {
    use tracing_subscriber::Layer as _;
    let filter = tracing_subscriber::EnvFilter::try_from_env("SUANLI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // The exported `tracing` spans: suanli's own at info and up, nothing of the transport
    // (the exporter's own calls would feed back into it).
    let otel_filter = tracing_subscriber::EnvFilter::new(OTEL_SPANS);
    let registry = tracing_subscriber::registry().with(otel.map(|l| l.with_filter(otel_filter)));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let _ = match FORMAT.get().copied().unwrap_or_default() {
        LogFormat::Text => registry.with(fmt.with_ansi(std::io::stderr().is_terminal()).with_filter(filter)).try_init(),
        LogFormat::Json => {
            registry.with(fmt.json().with_current_span(true).with_span_list(false).with_filter(filter)).try_init()
        }
    };
    Ok(())
}

/// Which `tracing` spans the `tracing-opentelemetry` layer exports.
const OTEL_SPANS: &str = "off,suanli=info,suanli_server=info,suanli_agent=info,suanli_federation=info";

/// Flushes and stops the exporter, if one was installed (bounded by a few seconds).
pub fn shutdown() {
    let taken = PROVIDER.lock().ok().and_then(|mut p| p.take());
    if let Some((provider, rt)) = taken {
        suanli_server::telemetry::set_enabled(false);
        if let Err(e) = provider.shutdown_with_timeout(FLUSH_BOUND) {
            eprintln!("warning: flushing spans to the OTLP endpoint: {e}");
        }
        rt.shutdown_timeout(Duration::from_millis(200));
    }
}

/// The id generator of the tracer provider: random ids, except where the server asks for the
/// ids stored with a job (its root `job` span, see `suanli_server::telemetry::emit_root`).
#[derive(Debug)]
struct StoredIds;

impl opentelemetry_sdk::trace::IdGenerator for StoredIds {
    fn new_trace_id(&self) -> opentelemetry::trace::TraceId {
        suanli_server::telemetry::take_forced_trace_id()
            .unwrap_or_else(|| opentelemetry_sdk::trace::RandomIdGenerator::default().new_trace_id())
    }

    fn new_span_id(&self) -> opentelemetry::trace::SpanId {
        suanli_server::telemetry::take_forced_span_id()
            .unwrap_or_else(|| opentelemetry_sdk::trace::RandomIdGenerator::default().new_span_id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_naming_the_key() {
        assert!(check_endpoint("k", "http://127.0.0.1:4317").is_ok());
        assert!(check_endpoint("k", "http://collector:4317/").is_ok());
        for bad in ["127.0.0.1:4317", "https://x:4317", "http://x", "http://:1", "http://x:0", "ftp://x:1"] {
            let e = check_endpoint("telemetry.otlp_endpoint", bad).expect_err(bad).to_string();
            assert!(e.starts_with("telemetry.otlp_endpoint: "), "{e}");
        }
    }
}
