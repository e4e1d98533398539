//! The queues file of `suanli sim replay` (docs/sim.md, "The queues file"): a CSV of queues
//! with team, parent, cohort, weight, nominal quota and borrowing limit. Every error names the
//! file, the line and the field, and says what would be valid.

use super::ReplayError;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use suanli_model::{Queue, QueueId, ResVec};

/// Largest queues file accepted (bytes).
pub const MAX_QUEUES_BYTES: u64 = 16 << 20;
/// Most queues a queues file may define.
pub const MAX_QUEUES: usize = 10_000;

/// The columns of a queues file, in their documented order.
pub const QUEUE_COLUMNS: [&str; 10] = [
    "name",
    "team",
    "parent",
    "cohort",
    "weight",
    "cpu_milli",
    "memory_mib",
    "gpu_milli",
    "npu_milli",
    "borrow_gpu_milli",
];
/// The queue used when no queues file is given: `default`, with no quota limit.
pub fn default_queue() -> Queue {
    Queue::new("default", ResVec::MAX)
}

/// Reads a queues file (`name,team,parent,cohort,weight,cpu_milli,memory_mib,gpu_milli,
/// npu_milli,borrow_gpu_milli`; see docs/sim.md). Errors name the file, line and field.
pub fn read_queues(path: &Path) -> Result<Vec<Queue>, ReplayError> {
    let (p, bytes) = read_bounded(path, MAX_QUEUES_BYTES)?;
    parse_queues(&p, &bytes)
}

/// A small input file of a replay (queues, services), refused when larger than `limit`
/// bytes; returns its name for messages and its bytes.
pub(super) fn read_bounded(path: &Path, limit: u64) -> Result<(String, Vec<u8>), ReplayError> {
    let p = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| ReplayError::Io { path: p.clone(), source })?;
    let size = file.metadata().map_err(|source| ReplayError::Io { path: p.clone(), source })?.len();
    if size > limit {
        return Err(ReplayError::TooLarge { path: p, size, limit });
    }
    let mut bytes = Vec::new();
    file.take(limit).read_to_end(&mut bytes).map_err(|source| ReplayError::Io { path: p.clone(), source })?;
    Ok((p, bytes))
}

/// The column positions of a CSV header whose columns must all be among `known` (each at
/// most once), with `required` ones present. Errors name the file and line 1.
pub(super) fn header_columns(
    path: &str,
    headers: &csv::StringRecord,
    known: &[&'static str],
    required: &[&'static str],
) -> Result<BTreeMap<&'static str, usize>, ReplayError> {
    let err = |message: String| ReplayError::QueueFile { path: path.to_owned(), line: 1, message };
    let mut col: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (i, h) in headers.iter().enumerate() {
        let h = h.trim();
        let Some(k) = known.iter().find(|c| **c == h) else {
            return Err(err(format!("unknown column {h:?}; valid columns: {}", known.join(","))));
        };
        if col.insert(k, i).is_some() {
            return Err(err(format!("column {h:?} appears twice")));
        }
    }
    if let Some(c) = required.iter().find(|c| !col.contains_key(**c)) {
        return Err(err(format!("missing column {c:?} (columns: {})", known.join(","))));
    }
    Ok(col)
}

/// Same as [`read_queues`] from text; `name` is used in error messages.
pub fn parse_queues_str(name: &str, text: &str) -> Result<Vec<Queue>, ReplayError> {
    parse_queues(name, text.as_bytes())
}

fn parse_queues(path: &str, bytes: &[u8]) -> Result<Vec<Queue>, ReplayError> {
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
    let col = header_columns(path, &headers, &QUEUE_COLUMNS, &["name"])?;
    let limits = suanli_model::Limits::default();
    let mut queues: Vec<Queue> = Vec::new();
    let mut lines: Vec<u64> = Vec::new();
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for rec in rdr.records() {
        let rec = rec.map_err(csv_err)?;
        let line = rec.position().map_or(0, |p| p.line());
        if queues.len() >= MAX_QUEUES {
            return Err(file_err(line, format!("more than {MAX_QUEUES} queues")));
        }
        let get = |c: &str| col.get(c).and_then(|&i| rec.get(i)).map_or("", str::trim);
        let num = |c: &str, max: u64| -> Result<Option<u64>, ReplayError> {
            let s = get(c);
            if s.is_empty() {
                return Ok(None);
            }
            let v: u64 = s.parse().map_err(|_| {
                field_err(line, c, format!("{s:?} is not a non-negative integer (0..={max}, empty = unlimited)"))
            })?;
            if v > max {
                return Err(field_err(line, c, format!("{v} exceeds the limit of {max}")));
            }
            Ok(Some(v))
        };
        let name = get("name");
        if name.is_empty() {
            return Err(field_err(line, "name", "must not be empty".into()));
        }
        if name.len() > limits.max_name_len || name.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(field_err(
                line,
                "name",
                format!("{name:?} must be at most {} bytes without spaces or control characters", limits.max_name_len),
            ));
        }
        if let Some(first) = seen.get(name) {
            return Err(field_err(line, "name", format!("duplicate queue {name:?} (first defined on line {first})")));
        }
        seen.insert(name.to_owned(), line);
        let weight = match num("weight", 1_000_000)? {
            None => 1,
            Some(0) => {
                return Err(field_err(line, "weight", "0 must be between 1 and 1000000".into()));
            }
            Some(w) => w as u32,
        };
        let dim = |c: &str| num(c, u64::MAX / 4).map(|v| v.unwrap_or(u64::MAX));
        let nominal = ResVec {
            cpu_milli: dim("cpu_milli")?,
            memory_mib: dim("memory_mib")?,
            gpu_milli: dim("gpu_milli")?,
            npu_milli: dim("npu_milli")?,
        };
        let opt = |c: &str| Some(get(c)).filter(|s| !s.is_empty()).map(str::to_owned);
        let cohort = opt("cohort");
        let borrow = num("borrow_gpu_milli", u64::MAX / 4)?;
        if borrow.is_some() && cohort.is_none() {
            return Err(field_err(
                line,
                "borrow_gpu_milli",
                "a borrowing limit needs a cohort to borrow from; set the cohort column or leave this empty".into(),
            ));
        }
        let parent = opt("parent").map(QueueId);
        if parent.as_ref().is_some_and(|p| p.as_str() == name) {
            return Err(field_err(line, "parent", format!("queue {name:?} cannot be its own parent")));
        }
        let q = Queue {
            id: QueueId::new(name),
            team: get("team").to_owned(),
            parent,
            cohort,
            weight,
            nominal,
            borrowing_limit: borrow.map(|b| ResVec { gpu_milli: b, ..ResVec::MAX }),
            lending_limit: None,
        };
        q.validate(&limits).map_err(|e| field_err(line, e.field().trim_start_matches("queue."), e.to_string()))?;
        queues.push(q);
        lines.push(line);
    }
    if queues.is_empty() {
        return Err(file_err(1, "no queues defined".into()));
    }
    // Parents must exist and the hierarchy must not loop.
    for (i, q) in queues.iter().enumerate() {
        let mut cur = q.parent.clone();
        let mut depth = 0;
        while let Some(p) = cur {
            let Some(pq) = queues.iter().find(|o| o.id == p) else {
                return Err(field_err(
                    lines[i],
                    "parent",
                    format!("unknown queue {:?}; define it on its own line", p.as_str()),
                ));
            };
            depth += 1;
            if pq.id == q.id || depth > 64 {
                return Err(field_err(
                    lines[i],
                    "parent",
                    format!("queue {:?} is its own ancestor (or the hierarchy is deeper than 64)", q.id.as_str()),
                ));
            }
            cur = pq.parent.clone();
        }
    }
    Ok(queues)
}
