//! Trace readers: the Alibaba GPU cluster trace (2023, "openb") and suanli's native format.
//!
//! Every error names the file, the line and the field, and the limit that was broken; nothing
//! here panics on bad input.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use suanli_model::{Constraints, Device, DeviceKind, DeviceRequest, Node, NodeId, PoolId, TaskResources};
use thiserror::Error;

/// Largest file a trace reader accepts (bytes).
pub const MAX_TRACE_BYTES: u64 = 1 << 30;
/// Most rows a trace may have.
pub const MAX_TRACE_ROWS: usize = 5_000_000;
/// Largest CPU one node or pod may state (milli-cores).
pub const MAX_CPU_MILLI: u64 = 1024 * 1000;
/// Largest memory one node or pod may state (MiB).
pub const MAX_MEMORY_MIB: u64 = 64 * 1024 * 1024;
/// Most GPUs on one node or pod.
pub const MAX_GPUS: u64 = 64;

/// A bad or unreadable trace.
#[derive(Debug, Error)]
pub enum TraceError {
    /// Could not open or read the file.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is too large.
    #[error("{path}: {size} bytes is larger than the limit of {MAX_TRACE_BYTES} bytes")]
    TooLarge {
        /// File.
        path: String,
        /// Its size.
        size: u64,
    },
    /// The header lacks a required column.
    #[error("{path}: line 1: missing column {column:?} (header has: {header})")]
    MissingColumn {
        /// File.
        path: String,
        /// Column.
        column: String,
        /// What the header has.
        header: String,
    },
    /// A row is malformed or out of range.
    #[error("{path}: line {line}: field {field:?}: {message}")]
    Field {
        /// File.
        path: String,
        /// 1-based line.
        line: u64,
        /// Column name.
        field: String,
        /// What is wrong and the limit.
        message: String,
    },
    /// A CSV-level error (truncated quoted field, bad UTF-8, ragged row...).
    #[error("{path}: line {line}: {message}")]
    Csv {
        /// File.
        path: String,
        /// 1-based line.
        line: u64,
        /// Cause.
        message: String,
    },
    /// The file has no data rows.
    #[error("{path}: no rows")]
    Empty {
        /// File.
        path: String,
    },
    /// Too many rows.
    #[error("{path}: more than {MAX_TRACE_ROWS} rows")]
    TooManyRows {
        /// File.
        path: String,
    },
}

/// One pod (task) of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracePod {
    /// Name.
    pub name: String,
    /// CPU milli-cores.
    pub cpu_milli: u64,
    /// Memory MiB.
    pub memory_mib: u64,
    /// Number of GPUs (0 = CPU-only).
    pub num_gpu: u32,
    /// Milli per GPU (1000 = whole).
    pub gpu_milli: u32,
    /// Allowed GPU models (empty = any).
    pub gpu_spec: Vec<String>,
    /// Arrival time, seconds (0 when the trace has none).
    pub arrival_s: u64,
    /// Run time, seconds (`None` when unknown).
    pub duration_s: Option<u64>,
    /// Queue (native format; `default` for the Alibaba trace).
    pub queue: String,
    /// Priority.
    pub priority: i32,
    /// Gang size: replicas that must start together (1 = a single task).
    pub replicas: u32,
    /// QoS class as the trace names it (Alibaba: `LS`, `BE`, `Burstable`, `Guaranteed`;
    /// empty when the trace has none). See [`priority_by_qos`].
    pub qos: String,
}

/// Gives each pod the priority its QoS class maps to (`map`: class -> priority); pods of
/// classes not in the map keep theirs. The Alibaba traces carry no priority, only QoS, so
/// this is how a replay of them makes preemption happen.
pub fn priority_by_qos(pods: &mut [TracePod], map: &std::collections::BTreeMap<String, i32>) {
    for p in pods {
        if let Some(&prio) = map.get(&p.qos) {
            p.priority = prio;
        }
    }
}

/// Divides every arrival time by `factor` (≥ 1), keeping run times: the same work arrives
/// `factor` times faster, so queues form on a cluster the trace barely filled.
pub fn compress_arrivals(pods: &mut [TracePod], factor: u64) {
    let f = factor.max(1);
    for p in pods {
        p.arrival_s /= f;
    }
}

impl TracePod {
    /// A pod of one replica in queue `default`, any GPU model, no arrival time or run time, no
    /// priority or QoS: what the synthetic workloads start from.
    pub fn single(name: String, cpu_milli: u64, memory_mib: u64, num_gpu: u32, gpu_milli: u32) -> Self {
        TracePod {
            name,
            cpu_milli,
            memory_mib,
            num_gpu,
            gpu_milli,
            gpu_spec: Vec::new(),
            arrival_s: 0,
            duration_s: None,
            queue: "default".into(),
            priority: 0,
            replicas: 1,
            qos: String::new(),
        }
    }

    /// The pod's device request, if it uses GPUs.
    pub fn devices(&self) -> Option<DeviceRequest> {
        (self.num_gpu > 0 && self.gpu_milli > 0).then_some(DeviceRequest {
            kind: DeviceKind::Gpu,
            count: self.num_gpu,
            milli: self.gpu_milli,
            memory_mib: 0,
        })
    }

    /// Per-replica resources.
    pub fn resources(&self) -> TaskResources {
        TaskResources { cpu_milli: self.cpu_milli, memory_mib: self.memory_mib, devices: self.devices() }
    }

    /// Placement constraints.
    pub fn constraints(&self) -> Constraints {
        Constraints { device_models: self.gpu_spec.clone(), ..Default::default() }
    }

    /// GPU milli requested by all replicas.
    pub fn gpu_request_milli(&self) -> u64 {
        self.devices().map_or(0, |d| d.total_milli()) * u64::from(self.replicas)
    }
}

struct Table {
    path: String,
    columns: BTreeMap<String, usize>,
    header: String,
    rows: Vec<(u64, csv::StringRecord)>,
}

fn read_table(path: &Path) -> Result<Table, TraceError> {
    let p = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io { path: p.clone(), source })?;
    let size = file.metadata().map_err(|source| TraceError::Io { path: p.clone(), source })?.len();
    if size > MAX_TRACE_BYTES {
        return Err(TraceError::TooLarge { path: p, size });
    }
    let mut text = String::new();
    file.take(MAX_TRACE_BYTES)
        .read_to_string(&mut text)
        .map_err(|source| TraceError::Io { path: p.clone(), source })?;
    parse_table(&p, text.as_bytes())
}

fn parse_table(path: &str, bytes: &[u8]) -> Result<Table, TraceError> {
    let mut rdr = csv::ReaderBuilder::new().has_headers(true).flexible(false).comment(Some(b'#')).from_reader(bytes);
    let csv_err = |e: csv::Error| {
        let line = e.position().map_or(0, |p| p.line());
        TraceError::Csv { path: path.to_owned(), line, message: e.to_string() }
    };
    let headers = rdr.headers().map_err(csv_err)?.clone();
    let columns = headers.iter().enumerate().map(|(i, h)| (h.trim().to_owned(), i)).collect();
    let header = headers.iter().collect::<Vec<_>>().join(",");
    let mut rows = Vec::new();
    for rec in rdr.records() {
        let rec = rec.map_err(csv_err)?;
        if rows.len() >= MAX_TRACE_ROWS {
            return Err(TraceError::TooManyRows { path: path.to_owned() });
        }
        let line = rec.position().map_or(0, |p| p.line());
        rows.push((line, rec));
    }
    if rows.is_empty() {
        return Err(TraceError::Empty { path: path.to_owned() });
    }
    Ok(Table { path: path.to_owned(), columns, header, rows })
}

impl Table {
    fn col(&self, name: &str) -> Result<usize, TraceError> {
        self.columns.get(name).copied().ok_or_else(|| TraceError::MissingColumn {
            path: self.path.clone(),
            column: name.to_owned(),
            header: self.header.clone(),
        })
    }

    fn field_err(&self, line: u64, field: &str, message: String) -> TraceError {
        TraceError::Field { path: self.path.clone(), line, field: field.to_owned(), message }
    }

    fn str<'r>(&self, rec: &'r csv::StringRecord, col: usize) -> &'r str {
        rec.get(col).unwrap_or("").trim()
    }

    fn num(&self, line: u64, rec: &csv::StringRecord, col: usize, name: &str, max: u64) -> Result<u64, TraceError> {
        let s = self.str(rec, col);
        let v: u64 = s
            .parse()
            .map_err(|_| self.field_err(line, name, format!("{s:?} is not a non-negative integer (0..={max})")))?;
        if v > max {
            return Err(self.field_err(line, name, format!("{v} exceeds the limit of {max}")));
        }
        Ok(v)
    }

    fn opt_num(
        &self,
        line: u64,
        rec: &csv::StringRecord,
        col: Option<usize>,
        name: &str,
        max: u64,
    ) -> Result<Option<u64>, TraceError> {
        match col {
            Some(c) if !self.str(rec, c).is_empty() => self.num(line, rec, c, name, max).map(Some),
            _ => Ok(None),
        }
    }
}

fn parse_spec(s: &str) -> Vec<String> {
    s.split('|').map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned).collect()
}

/// Reads the Alibaba node list (`sn, cpu_milli, memory_mib, gpu, model`). Every node is put in
/// pool `default`; GPUs are named `gpu0..` with no topology (the trace has none).
pub fn read_alibaba_nodes(path: &Path) -> Result<Vec<Node>, TraceError> {
    parse_alibaba_nodes(&read_table(path)?)
}

/// Same as [`read_alibaba_nodes`] from text (tests, stdin).
pub fn parse_alibaba_nodes_str(name: &str, text: &str) -> Result<Vec<Node>, TraceError> {
    parse_alibaba_nodes(&parse_table(name, text.as_bytes())?)
}

fn parse_alibaba_nodes(t: &Table) -> Result<Vec<Node>, TraceError> {
    let (sn, cpu, mem, gpu, model) =
        (t.col("sn")?, t.col("cpu_milli")?, t.col("memory_mib")?, t.col("gpu")?, t.col("model")?);
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, rec) in &t.rows {
        let id = t.str(rec, sn);
        if id.is_empty() {
            return Err(t.field_err(*line, "sn", "must not be empty".into()));
        }
        if !seen.insert(id.to_owned()) {
            return Err(t.field_err(*line, "sn", format!("duplicate node {id:?}")));
        }
        let cpu_milli = t.num(*line, rec, cpu, "cpu_milli", MAX_CPU_MILLI)?;
        let memory_mib = t.num(*line, rec, mem, "memory_mib", MAX_MEMORY_MIB)?;
        let gpus = t.num(*line, rec, gpu, "gpu", MAX_GPUS)?;
        let m = t.str(rec, model);
        if gpus > 0 && m.is_empty() {
            return Err(t.field_err(*line, "model", "a node with GPUs needs a model".into()));
        }
        out.push(Node {
            id: NodeId::new(id),
            pool: PoolId::new("default"),
            datacenter: String::new(),
            region: String::new(),
            labels: BTreeMap::new(),
            cpu_milli,
            memory_mib,
            devices: (0..gpus).map(|i| Device::simple(format!("gpu{i}"), DeviceKind::Gpu, m)).collect(),
            schedulable: true,
            agent_addr: String::new(),
        });
    }
    Ok(out)
}

/// Reads an Alibaba pod list (`name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec,
/// qos, pod_phase, creation_time, deletion_time, scheduled_time]`).
pub fn read_alibaba_pods(path: &Path) -> Result<Vec<TracePod>, TraceError> {
    parse_alibaba_pods(&read_table(path)?)
}

/// Same as [`read_alibaba_pods`] from text.
pub fn parse_alibaba_pods_str(name: &str, text: &str) -> Result<Vec<TracePod>, TraceError> {
    parse_alibaba_pods(&parse_table(name, text.as_bytes())?)
}

fn check_gpu(t: &Table, line: u64, num_gpu: u64, gpu_milli: u64) -> Result<(), TraceError> {
    if num_gpu > 1 && gpu_milli != 1000 && gpu_milli != 0 {
        return Err(t.field_err(
            line,
            "gpu_milli",
            format!("{gpu_milli} with num_gpu {num_gpu}: a multi-GPU task takes whole GPUs (gpu_milli 1000)"),
        ));
    }
    Ok(())
}

/// Columns every pod format has.
struct PodCols {
    name: usize,
    cpu: usize,
    mem: usize,
    ngpu: usize,
    milli: usize,
    spec: Option<usize>,
    qos: Option<usize>,
}

impl PodCols {
    fn of(t: &Table) -> Result<Self, TraceError> {
        Ok(Self {
            name: t.col("name")?,
            cpu: t.col("cpu_milli")?,
            mem: t.col("memory_mib")?,
            ngpu: t.col("num_gpu")?,
            milli: t.col("gpu_milli")?,
            spec: t.columns.get("gpu_spec").copied(),
            qos: t.columns.get("qos").copied(),
        })
    }

    /// The resource part of a pod row, validated; time, queue and gang fields are defaults.
    fn pod(&self, t: &Table, line: u64, rec: &csv::StringRecord) -> Result<TracePod, TraceError> {
        let n = t.str(rec, self.name);
        if n.is_empty() {
            return Err(t.field_err(line, "name", "must not be empty".into()));
        }
        let num_gpu = t.num(line, rec, self.ngpu, "num_gpu", MAX_GPUS)?;
        let gpu_milli = t.num(line, rec, self.milli, "gpu_milli", 1000)?;
        check_gpu(t, line, num_gpu, gpu_milli)?;
        Ok(TracePod {
            name: n.to_owned(),
            cpu_milli: t.num(line, rec, self.cpu, "cpu_milli", MAX_CPU_MILLI)?,
            memory_mib: t.num(line, rec, self.mem, "memory_mib", MAX_MEMORY_MIB)?,
            num_gpu: num_gpu as u32,
            gpu_milli: gpu_milli as u32,
            gpu_spec: self.spec.map(|s| parse_spec(t.str(rec, s))).unwrap_or_default(),
            arrival_s: 0,
            duration_s: None,
            queue: "default".into(),
            priority: 0,
            replicas: 1,
            qos: self.qos.map(|q| t.str(rec, q).to_owned()).unwrap_or_default(),
        })
    }
}

fn parse_alibaba_pods(t: &Table) -> Result<Vec<TracePod>, TraceError> {
    let cols = PodCols::of(t)?;
    let created = t.columns.get("creation_time").copied();
    let deleted = t.columns.get("deletion_time").copied();
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, rec) in &t.rows {
        let line = *line;
        let mut pod = cols.pod(t, line, rec)?;
        let c = t.opt_num(line, rec, created, "creation_time", u64::MAX / 4)?;
        let d = t.opt_num(line, rec, deleted, "deletion_time", u64::MAX / 4)?;
        pod.arrival_s = c.unwrap_or(0);
        pod.duration_s = match (c, d) {
            (Some(c), Some(d)) if d >= c => Some(d - c),
            _ => None,
        };
        out.push(pod);
    }
    Ok(out)
}

/// Reads suanli's native trace format (documented in docs/sim.md):
/// `name, arrival_s, duration_s, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, queue,
/// priority, replicas` — `replicas` > 1 is a gang that starts all-or-nothing.
pub fn read_native_pods(path: &Path) -> Result<Vec<TracePod>, TraceError> {
    parse_native_pods(&read_table(path)?)
}

/// Same as [`read_native_pods`] from text.
pub fn parse_native_pods_str(name: &str, text: &str) -> Result<Vec<TracePod>, TraceError> {
    parse_native_pods(&parse_table(name, text.as_bytes())?)
}

fn parse_native_pods(t: &Table) -> Result<Vec<TracePod>, TraceError> {
    let cols = PodCols::of(t)?;
    let (arr, dur) = (t.col("arrival_s")?, t.col("duration_s")?);
    let (queue, prio, reps) =
        (t.columns.get("queue").copied(), t.columns.get("priority").copied(), t.columns.get("replicas").copied());
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, rec) in &t.rows {
        let line = *line;
        let mut pod = cols.pod(t, line, rec)?;
        pod.priority = match prio.map(|p| t.str(rec, p)).filter(|s| !s.is_empty()) {
            None => 0,
            Some(s) => s.parse::<i32>().ok().filter(|p| p.unsigned_abs() <= 1_000_000).ok_or_else(|| {
                t.field_err(line, "priority", format!("{s:?} is not an integer in -1000000..=1000000"))
            })?,
        };
        let replicas = match reps {
            Some(r) if !t.str(rec, r).is_empty() => t.num(line, rec, r, "replicas", 10_000)?,
            _ => 1,
        };
        if replicas == 0 {
            return Err(t.field_err(line, "replicas", "must be at least 1".into()));
        }
        pod.replicas = replicas as u32;
        pod.queue = queue.map(|q| t.str(rec, q)).filter(|s| !s.is_empty()).unwrap_or("default").to_owned();
        pod.arrival_s = t.num(line, rec, arr, "arrival_s", u64::MAX / 4)?;
        pod.duration_s = t.opt_num(line, rec, Some(dur), "duration_s", u64::MAX / 4)?;
        out.push(pod);
    }
    Ok(out)
}

/// Reads pods in either format, telling them apart by the header (`arrival_s` = native).
pub fn read_pods(path: &Path) -> Result<Vec<TracePod>, TraceError> {
    let t = read_table(path)?;
    if t.columns.contains_key("arrival_s") { parse_native_pods(&t) } else { parse_alibaba_pods(&t) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_rows_name_line_and_field() {
        let e = parse_alibaba_pods_str(
            "p.csv",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,100,10,1,500\nb,-5,10,0,0\n",
        )
        .expect_err("negative cpu");
        assert_eq!(
            e.to_string(),
            "p.csv: line 3: field \"cpu_milli\": \"-5\" is not a non-negative integer (0..=1024000)"
        );
        let e = parse_alibaba_pods_str("p.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,100,10,2,500\n")
            .expect_err("fractional multi-gpu");
        assert!(e.to_string().contains("line 2: field \"gpu_milli\""), "{e}");
        let e = parse_alibaba_pods_str("p.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,100,10,1,5000\n")
            .expect_err("absurd milli");
        assert!(e.to_string().contains("exceeds the limit of 1000"), "{e}");
        let e = parse_alibaba_pods_str("p.csv", "name,cpu_milli,memory_mib,num_gpu\na,1,1,1\n").expect_err("column");
        assert!(e.to_string().contains("missing column \"gpu_milli\""), "{e}");
        let e = parse_alibaba_pods_str("p.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,100,10,1\n")
            .expect_err("truncated row");
        assert!(e.to_string().starts_with("p.csv: line 2:"), "{e}");
        let e = parse_alibaba_nodes_str("n.csv", "sn,cpu_milli,memory_mib,gpu,model\nx,1,1,99999999999,T4\n")
            .expect_err("absurd gpus");
        assert!(e.to_string().contains("field \"gpu\""), "{e}");
        assert!(matches!(
            parse_alibaba_pods_str("e.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"),
            Err(TraceError::Empty { .. })
        ));
    }

    #[test]
    fn native_format_reads_queues_and_gangs() {
        let pods = parse_native_pods_str(
            "n.csv",
            "name,arrival_s,duration_s,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,queue,priority,replicas\n\
             j1,0,3600,8000,32768,8,1000,A100|H100,team-a,10,4\n",
        )
        .expect("valid");
        assert_eq!(pods[0].replicas, 4);
        assert_eq!(pods[0].gpu_spec, vec!["A100", "H100"]);
        assert_eq!(pods[0].gpu_request_milli(), 32_000);
    }
}
