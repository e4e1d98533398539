//! Inference services in a replay (docs/sim.md, "Inference services"): the services file,
//! each service's diurnal request rate, and the static partition a replay may compare with.
//!
//! ```text
//!  services file ─▶ ServiceLoad ─▶ a service job (kind inference, service.autoscale)
//!  every period_s:  demand(t) ─▶ each ready replica reports demand / ready (AllocReady.load)
//!                   ─▶ State::autoscale_input ─▶ AutoscaleHistory::decide ─▶ UpdateService
//! ```
//!
//! The request rate is a cosine over the day: `trough + (peak − trough) × (1 + cos(2π (t −
//! peak_hour × 3600) / 86400)) / 2` requests/s at simulated time `t` (the trace's time 0 is
//! midnight). A replica serves `capacity_rps` within the SLO; the service is over its SLO
//! while the demand exceeds its ready replicas' capacity.

use super::ReplayError;
use std::collections::BTreeMap;
use std::path::Path;
use suanli_model::{
    Autoscale, Constraints, DeviceKind, DeviceRequest, JobKind, JobSpec, LoadSource, Node, QueueId, ServiceSpec,
    TaskGroup, TaskResources,
};

/// Largest services file accepted (bytes).
pub const MAX_SERVICES_BYTES: u64 = 1 << 20;
/// Most services a services file may define.
pub const MAX_SERVICES: usize = 1000;
/// Largest request rate (requests/s) a service may have or a replica may serve.
pub const MAX_RPS: u64 = 1_000_000_000;
/// The node label a static partition sets (`inference` or `batch`).
pub const PARTITION_LABEL: &str = "sim.suanli.io/partition";

/// The columns of a services file, in their documented order.
pub const SERVICE_COLUMNS: [&str; 17] = [
    "name",
    "queue",
    "priority",
    "gpu_milli",
    "gpu_model",
    "cpu_milli",
    "memory_mib",
    "min_replicas",
    "max_replicas",
    "capacity_rps",
    "target_pct",
    "trough_rps",
    "peak_rps",
    "peak_hour",
    "startup_s",
    "period_s",
    "scale_down_window_s",
];

/// One inference service of a replay and its load over the day.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceLoad {
    /// Service (job) name.
    pub name: String,
    /// Queue it is submitted to.
    pub queue: String,
    /// Priority (default 100: above the trace's batch work).
    pub priority: i32,
    /// GPU milli per replica (1..=1000 for a share of one GPU, or whole GPUs).
    pub gpu_milli: u64,
    /// GPU model a replica needs, if any (like the trace's `gpu_spec`).
    pub gpu_model: Option<String>,
    /// CPU milli per replica.
    pub cpu_milli: u64,
    /// Memory per replica, MiB.
    pub memory_mib: u64,
    /// Fewest replicas.
    pub min_replicas: u32,
    /// Most replicas.
    pub max_replicas: u32,
    /// Requests/s one replica serves within the SLO.
    pub capacity_rps: u64,
    /// The autoscaling target, percent of `capacity_rps` (the HPA's target utilization).
    pub target_pct: u32,
    /// Request rate at the quietest time of day.
    pub trough_rps: u64,
    /// Request rate at the busiest time of day.
    pub peak_rps: u64,
    /// Hour of the day (0..=23) of the peak.
    pub peak_hour: u32,
    /// Seconds from a replica's start to its readiness.
    pub startup_s: u64,
    /// Load reports and autoscaling decisions every this many seconds.
    pub period_s: u64,
    /// Scale-down stabilization window, seconds.
    pub scale_down_window_s: u64,
}

impl ServiceLoad {
    /// The request rate at simulated time `t`, in thousandths of a request per second.
    pub fn demand_milli(&self, t: u64) -> u64 {
        let day = 86_400.0;
        let phase = ((t % 86_400) as f64 - f64::from(self.peak_hour) * 3600.0) / day;
        let wave = (1.0 + (2.0 * std::f64::consts::PI * phase).cos()) / 2.0;
        let span = self.peak_rps.saturating_sub(self.trough_rps) as f64;
        ((self.trough_rps as f64 + span * wave) * 1000.0).round() as u64
    }

    /// The autoscaling section: the target is `target_pct` of a replica's capacity.
    pub fn autoscale(&self) -> Autoscale {
        Autoscale {
            min_replicas: self.min_replicas,
            max_replicas: self.max_replicas,
            source: LoadSource::File,
            metric: "suanli_load".into(),
            target: (self.capacity_rps.saturating_mul(u64::from(self.target_pct)) / 100).max(1),
            tolerance_pct: 10,
            period_s: self.period_s,
            scale_up_window_s: 0,
            scale_down_window_s: self.scale_down_window_s,
            scale_up_step: 4,
            scale_down_step: 0,
        }
    }

    /// The job this service becomes: an inference service of `min_replicas` replicas that
    /// autoscales, never preempted, restricted to nodes with `labels`.
    pub fn spec(&self, labels: &BTreeMap<String, String>) -> JobSpec {
        let devices = (self.gpu_milli > 0).then(|| {
            if self.gpu_milli <= 1000 {
                DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: self.gpu_milli as u32, memory_mib: 0 }
            } else {
                DeviceRequest {
                    kind: DeviceKind::Gpu,
                    count: self.gpu_milli.div_ceil(1000) as u32,
                    milli: 1000,
                    memory_mib: 0,
                }
            }
        });
        JobSpec {
            name: self.name.clone(),
            queue: QueueId::new(self.queue.as_str()),
            kind: JobKind::Inference,
            priority: self.priority,
            preemptible: false,
            gang: false,
            groups: vec![TaskGroup {
                task: None,
                name: "replica".into(),
                replicas: self.min_replicas,
                min_replicas: None,
                resources: TaskResources { cpu_milli: self.cpu_milli, memory_mib: self.memory_mib, devices },
            }],
            constraints: Constraints {
                device_models: self.gpu_model.iter().cloned().collect(),
                labels: labels.clone(),
                ..Default::default()
            },
            runtime_estimate_s: None,
            checkpoint: None,
            service: Some(ServiceSpec { autoscale: Some(self.autoscale()), ..ServiceSpec::default() }),
        }
    }

    /// Whole GPUs this service needs at its most replicas (fractional replicas packed).
    fn peak_gpus(&self) -> u64 {
        let n = u64::from(self.max_replicas);
        match self.gpu_milli {
            0 => 0,
            m if m <= 1000 => n.div_ceil(1000 / m),
            m => n * m.div_ceil(1000),
        }
    }
}

/// Reads a services file (see [`SERVICE_COLUMNS`] and docs/sim.md). Errors name the file,
/// line and field.
pub fn read_services(path: &Path) -> Result<Vec<ServiceLoad>, ReplayError> {
    let (p, bytes) = super::queues::read_bounded(path, MAX_SERVICES_BYTES)?;
    parse_services(&p, &bytes)
}

/// Same as [`read_services`] from text; `name` is used in error messages.
pub fn parse_services_str(path: &str, text: &str) -> Result<Vec<ServiceLoad>, ReplayError> {
    parse_services(path, text.as_bytes())
}

fn parse_services(path: &str, bytes: &[u8]) -> Result<Vec<ServiceLoad>, ReplayError> {
    let file_err = |line: u64, message: String| ReplayError::QueueFile { path: path.to_owned(), line, message };
    let field_err = |line: u64, field: &str, message: String| ReplayError::QueueField {
        path: path.to_owned(),
        line,
        field: field.to_owned(),
        message,
    };
    let mut rdr = csv::ReaderBuilder::new().has_headers(true).flexible(false).comment(Some(b'#')).from_reader(bytes);
    let csv_err = |e: csv::Error| file_err(e.position().map_or(0, |p| p.line()), e.to_string());
    let headers = rdr.headers().map_err(csv_err)?.clone();
    let required = ["name", "max_replicas", "capacity_rps", "peak_rps"];
    let col = super::queues::header_columns(path, &headers, &SERVICE_COLUMNS, &required)?;
    let limits = suanli_model::Limits::default();
    let mut out: Vec<ServiceLoad> = Vec::new();
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for rec in rdr.records() {
        let rec = rec.map_err(csv_err)?;
        let line = rec.position().map_or(0, |p| p.line());
        if out.len() >= MAX_SERVICES {
            return Err(file_err(line, format!("more than {MAX_SERVICES} services")));
        }
        let get = |c: &str| col.get(c).and_then(|&i| rec.get(i)).map_or("", str::trim);
        let num = |c: &str, lo: u64, hi: u64, default: Option<u64>| -> Result<u64, ReplayError> {
            let s = get(c);
            if s.is_empty() {
                return default.ok_or_else(|| field_err(line, c, format!("must be set ({lo}..={hi})")));
            }
            let v: u64 =
                s.parse().map_err(|_| field_err(line, c, format!("{s:?} is not an integer in {lo}..={hi}")))?;
            if v < lo || v > hi {
                return Err(field_err(line, c, format!("{v} must be between {lo} and {hi}")));
            }
            Ok(v)
        };
        let name = get("name");
        if name.is_empty()
            || name.len() > limits.max_name_len
            || name.chars().any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(field_err(
                line,
                "name",
                format!("{name:?} must be 1..={} bytes without spaces or control characters", limits.max_name_len),
            ));
        }
        if let Some(first) = seen.insert(name.to_owned(), line) {
            return Err(field_err(line, "name", format!("duplicate service {name:?} (first defined on line {first})")));
        }
        let queue = Some(get("queue")).filter(|s| !s.is_empty()).unwrap_or("default").to_owned();
        let priority = {
            let s = get("priority");
            if s.is_empty() {
                100
            } else {
                s.parse::<i32>().ok().filter(|p| p.unsigned_abs() <= 1_000_000).ok_or_else(|| {
                    field_err(line, "priority", format!("{s:?} is not an integer in -1000000..=1000000"))
                })?
            }
        };
        let max_r = u64::from(limits.max_replicas);
        let min_replicas = num("min_replicas", 1, max_r, Some(1))? as u32;
        let max_replicas = num("max_replicas", u64::from(min_replicas), max_r, None)? as u32;
        let gpu_milli = num("gpu_milli", 0, 64_000, Some(1000))?;
        if gpu_milli > 1000 && gpu_milli % 1000 != 0 {
            return Err(field_err(
                line,
                "gpu_milli",
                format!(
                    "{gpu_milli}: a replica takes a share of one GPU (1..=1000) or whole GPUs (a multiple of 1000)"
                ),
            ));
        }
        let trough_rps = num("trough_rps", 0, MAX_RPS, Some(0))?;
        let s = ServiceLoad {
            name: name.to_owned(),
            queue,
            priority,
            gpu_milli,
            gpu_model: Some(get("gpu_model")).filter(|s| !s.is_empty()).map(str::to_owned),
            cpu_milli: num("cpu_milli", 0, 1 << 40, Some(4000))?,
            memory_mib: num("memory_mib", 0, 1 << 40, Some(16_384))?,
            min_replicas,
            max_replicas,
            capacity_rps: num("capacity_rps", 1, MAX_RPS, None)?,
            target_pct: num("target_pct", 1, 100, Some(70))? as u32,
            trough_rps,
            peak_rps: num("peak_rps", trough_rps, MAX_RPS, None)?,
            peak_hour: num("peak_hour", 0, 23, Some(14))? as u32,
            startup_s: num("startup_s", 0, 86_400, Some(60))?,
            period_s: num("period_s", 1, 3600, Some(15))?,
            scale_down_window_s: num("scale_down_window_s", 0, 86_400, Some(300))?,
        };
        s.spec(&BTreeMap::new())
            .validate(&limits)
            .map_err(|e| field_err(line, e.field(), format!("not a valid service: {e}")))?;
        out.push(s);
    }
    if out.is_empty() {
        return Err(file_err(1, "no services defined".into()));
    }
    Ok(out)
}

/// A static partition of `nodes` for `services`: the first nodes (in list order) with GPUs
/// of the services' models, until their GPUs hold every service at its most replicas, are
/// labelled `inference`; every other node `batch`. Returns the labelled nodes and the
/// inference partition's GPU milli. CPU and memory are not counted.
pub fn static_partition(nodes: &[Node], services: &[ServiceLoad]) -> Result<(Vec<Node>, u64), ReplayError> {
    let need: u64 = services.iter().map(ServiceLoad::peak_gpus).sum();
    let models: Vec<&str> = services.iter().filter_map(|s| s.gpu_model.as_deref()).collect();
    let fits = |n: &Node| {
        n.devices.iter().any(|d| {
            d.kind == DeviceKind::Gpu
                && (models.is_empty() || models.iter().any(|m| m.split('|').any(|x| x == d.model)))
        })
    };
    let mut got = 0u64;
    let mut got_milli = 0u64;
    let mut out = Vec::with_capacity(nodes.len());
    for n in nodes {
        let mut n = n.clone();
        let gpus = n.devices.iter().filter(|d| d.kind == DeviceKind::Gpu).count() as u64;
        let part = if got < need && gpus > 0 && fits(&n) {
            got += gpus;
            got_milli += gpus * 1000;
            "inference"
        } else {
            "batch"
        };
        n.labels.insert(PARTITION_LABEL.into(), part.into());
        out.push(n);
    }
    if got < need {
        return Err(ReplayError::Param {
            field: "services",
            message: format!(
                "a static partition needs {need} GPU(s) for the services at their most replicas; the nodes have {got}"
            ),
        });
    }
    Ok((out, got_milli))
}
