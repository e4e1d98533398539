//! Spec files written by hand: jobs ([`JobSpec`]), queues ([`Queue`]) and nodes ([`Node`]).
//!
//! A file is TOML (`.toml`) or JSON (`.json`), chosen by its extension; YAML is not supported.
//! Loading is strict, so a typo never silently becomes a default:
//!
//! ```text
//!   file ──parse (toml|json)──▶ value ──schema check──▶ serde ──▶ T ──T::validate(Limits)──▶ T
//!                                      unknown field,          (the model's own limits)
//!                                      wrong type, missing
//! ```
//!
//! Every error names the file and the dotted field path (`groups[0].resources.cpu_milli`), and
//! for limits the allowed range. The schema below mirrors the model's serde types; the
//! `schema_matches_model` tests fail when a model type gains a field the schema lacks.

use anyhow::{Context, anyhow, bail};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::path::Path;
use suanli_model::{JobSpec, Limits, Node, Queue, ValidationError};

/// Largest spec file read, in bytes (the API's default message limit).
pub const MAX_FILE_BYTES: u64 = suanli_proto::DEFAULT_MAX_MESSAGE_BYTES as u64;

/// The shape of a field, as the model's serde types accept it.
enum S {
    /// Unsigned 64-bit integer.
    U64,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// `true` or `false`.
    Bool,
    /// A string.
    Str,
    /// One of these lowercase strings.
    Enum(&'static [&'static str]),
    /// Absent, `null`, or the inner shape.
    Opt(&'static S),
    /// An array of the inner shape.
    List(&'static S),
    /// A table with free-form string keys and values of the inner shape.
    Map(&'static S),
    /// A table with exactly these fields (name, shape, required).
    Obj(&'static [(&'static str, &'static S, bool)]),
}

static U64: S = S::U64;
static U32: S = S::U32;
static I32: S = S::I32;
static BOOL: S = S::Bool;
static STR: S = S::Str;
static OPT_U32: S = S::Opt(&U32);
static OPT_U64: S = S::Opt(&U64);
static OPT_STR: S = S::Opt(&STR);
static STR_LIST: S = S::List(&STR);
static STR_MAP: S = S::Map(&STR);
static DEVICE_KIND: S = S::Enum(&["gpu", "npu"]);
static JOB_KIND: S = S::Enum(&["training", "batch", "inference"]);
static HEALTH: S = S::Enum(&["healthy", "unhealthy"]);

static DEVICE_REQUEST: S =
    S::Obj(&[("kind", &DEVICE_KIND, true), ("count", &U32, true), ("milli", &U32, false), ("memory_mib", &U64, false)]);
static OPT_DEVICE_REQUEST: S = S::Opt(&DEVICE_REQUEST);
static TASK_RESOURCES: S =
    S::Obj(&[("cpu_milli", &U64, false), ("memory_mib", &U64, false), ("devices", &OPT_DEVICE_REQUEST, false)]);
static TASK: S = S::Obj(&[
    ("command", &STR, true),
    ("args", &STR_LIST, false),
    ("env", &STR_MAP, false),
    ("workdir", &OPT_STR, false),
]);
static OPT_TASK: S = S::Opt(&TASK);
static TASK_GROUP: S = S::Obj(&[
    ("name", &STR, true),
    ("replicas", &U32, false),
    ("min_replicas", &OPT_U32, false),
    ("resources", &TASK_RESOURCES, true),
    ("task", &OPT_TASK, false),
]);
static TASK_GROUPS: S = S::List(&TASK_GROUP);
static CONSTRAINTS: S = S::Obj(&[
    ("pools", &STR_LIST, false),
    ("regions", &STR_LIST, false),
    ("device_models", &STR_LIST, false),
    ("labels", &STR_MAP, false),
]);
static CHECKPOINT: S = S::Obj(&[("interval_s", &U64, true), ("grace_s", &U64, true), ("restore_s", &U64, false)]);
static OPT_CHECKPOINT: S = S::Opt(&CHECKPOINT);
static JOB_SPEC: S = S::Obj(&[
    ("name", &STR, true),
    ("queue", &STR, true),
    ("kind", &JOB_KIND, false),
    ("priority", &I32, false),
    ("preemptible", &BOOL, false),
    ("gang", &BOOL, false),
    ("groups", &TASK_GROUPS, true),
    ("constraints", &CONSTRAINTS, false),
    ("runtime_estimate_s", &OPT_U64, false),
    ("checkpoint", &OPT_CHECKPOINT, false),
]);

static RESVEC: S = S::Obj(&[
    ("cpu_milli", &U64, false),
    ("memory_mib", &U64, false),
    ("gpu_milli", &U64, false),
    ("npu_milli", &U64, false),
]);
static OPT_RESVEC: S = S::Opt(&RESVEC);
static QUEUE: S = S::Obj(&[
    ("id", &STR, true),
    ("team", &STR, false),
    ("parent", &OPT_STR, false),
    ("cohort", &OPT_STR, false),
    ("weight", &U32, false),
    ("nominal", &RESVEC, false),
    ("borrowing_limit", &OPT_RESVEC, false),
    ("lending_limit", &OPT_RESVEC, false),
]);

static DEVICE: S = S::Obj(&[
    ("id", &STR, true),
    ("kind", &DEVICE_KIND, true),
    ("model", &STR, true),
    ("memory_mib", &U64, false),
    ("health", &HEALTH, false),
    ("numa", &U32, false),
    ("peer_group", &OPT_U32, false),
    ("partition_of", &OPT_STR, false),
]);
static DEVICES: S = S::List(&DEVICE);
static NODE: S = S::Obj(&[
    ("id", &STR, true),
    ("pool", &STR, true),
    ("datacenter", &STR, false),
    ("region", &STR, false),
    ("labels", &STR_MAP, false),
    ("cpu_milli", &U64, true),
    ("memory_mib", &U64, true),
    ("devices", &DEVICES, false),
    ("schedulable", &BOOL, false),
    ("agent_addr", &STR, false),
]);

/// Joins a field path and a key: `groups[0]` + `name` = `groups[0].name`.
fn join(path: &str, key: &str) -> String {
    if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") }
}

/// What a value is, for error messages.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "a table".into(),
    }
}

/// Checks `v` against `s`, naming the first bad field. `path` is the field's dotted path (empty
/// at the top level of a job, where the model's own paths have no prefix).
fn check(v: &Value, s: &S, path: &str) -> Result<(), String> {
    let field = || if path.is_empty() { "(top level)".to_owned() } else { path.to_owned() };
    let int = |min: i128, max: i128, what: &str| -> Result<(), String> {
        let n = match v {
            Value::Number(n) => n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)),
            _ => None,
        };
        match n {
            Some(n) if n >= min && n <= max => Ok(()),
            Some(n) => Err(format!("{}: {n} is out of range; must be {what} between {min} and {max}", field())),
            None => {
                Err(format!("{}: expected {what} (an integer between {min} and {max}), got {}", field(), describe(v)))
            }
        }
    };
    match s {
        S::U64 => int(0, i128::from(u64::MAX), "a non-negative integer"),
        S::U32 => int(0, i128::from(u32::MAX), "a non-negative integer"),
        S::I32 => int(i128::from(i32::MIN), i128::from(i32::MAX), "an integer"),
        S::Bool => match v {
            Value::Bool(_) => Ok(()),
            _ => Err(format!("{}: expected true or false, got {}", field(), describe(v))),
        },
        S::Str => match v {
            Value::String(_) => Ok(()),
            _ => Err(format!("{}: expected a string, got {}", field(), describe(v))),
        },
        S::Enum(names) => match v {
            Value::String(x) if names.contains(&x.as_str()) => Ok(()),
            _ => Err(format!("{}: expected one of {}, got {}", field(), names.join(", "), describe(v))),
        },
        S::Opt(inner) => match v {
            Value::Null => Ok(()),
            _ => check(v, inner, path),
        },
        S::List(inner) => match v {
            Value::Array(items) => {
                items.iter().enumerate().try_for_each(|(i, item)| check(item, inner, &format!("{}[{i}]", field())))
            }
            _ => Err(format!("{}: expected an array, got {}", field(), describe(v))),
        },
        S::Map(inner) => match v {
            Value::Object(m) => m.iter().try_for_each(|(k, item)| check(item, inner, &join(path, k))),
            _ => Err(format!("{}: expected a table, got {}", field(), describe(v))),
        },
        S::Obj(fields) => {
            let Value::Object(m) = v else {
                return Err(format!("{}: expected a table, got {}", field(), describe(v)));
            };
            for key in m.keys() {
                if !fields.iter().any(|(name, _, _)| name == key) {
                    let known: Vec<&str> = fields.iter().map(|(name, _, _)| *name).collect();
                    return Err(format!("{}: unknown field; expected one of: {}", join(path, key), known.join(", ")));
                }
            }
            for (name, shape, required) in *fields {
                match m.get(*name) {
                    Some(item) => check(item, shape, &join(path, name))?,
                    None if *required => return Err(format!("{}: missing required field", join(path, name))),
                    None => {}
                }
            }
            Ok(())
        }
    }
}

/// Reads and parses a TOML or JSON file into a JSON value (the form the API carries).
fn read_value(path: &Path) -> anyhow::Result<Value> {
    let shown = path.display();
    let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).unwrap_or_default();
    if !matches!(ext.as_str(), "toml" | "json") {
        if matches!(ext.as_str(), "yaml" | "yml") {
            bail!("{shown}: YAML is not supported; write the spec as TOML (.toml) or JSON (.json)");
        }
        bail!("{shown}: unknown file type {ext:?}; a spec file must end in .toml or .json");
    }
    let meta = std::fs::metadata(path).with_context(|| format!("{shown}: cannot read"))?;
    if meta.len() > MAX_FILE_BYTES {
        bail!("{shown}: {} bytes is too large; a spec file must be at most {MAX_FILE_BYTES} bytes", meta.len());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("{shown}: cannot read"))?;
    if ext == "toml" {
        let table: toml::Table = toml::from_str(&text).map_err(|e| anyhow!("{shown}: TOML syntax: {e}"))?;
        serde_json::to_value(table).map_err(|e| anyhow!("{shown}: {e}"))
    } else {
        serde_json::from_str(&text).map_err(|e| anyhow!("{shown}: JSON syntax: {e}"))
    }
}

/// Checks `v` against the schema, decodes it and validates it with the model's `validate`.
fn decode<T: DeserializeOwned>(
    shown: &str,
    v: Value,
    schema: &S,
    prefix: &str,
    validate: impl FnOnce(&T) -> Result<(), ValidationError>,
) -> anyhow::Result<T> {
    check(&v, schema, prefix).map_err(|e| anyhow!("{shown}: {e}"))?;
    let t: T = serde_json::from_value(v).map_err(|e| anyhow!("{shown}: {e}"))?;
    validate(&t).map_err(|e| anyhow!("{shown}: {e}"))?;
    Ok(t)
}

/// Decodes and validates a job spec given as a JSON value; `shown` names its source in errors.
pub fn job_from_value(shown: &str, v: Value) -> anyhow::Result<JobSpec> {
    decode(shown, v, &JOB_SPEC, "", |s: &JobSpec| s.validate(&Limits::default()))
}

/// Decodes and validates a queue given as a JSON value.
pub fn queue_from_value(shown: &str, v: Value) -> anyhow::Result<Queue> {
    decode(shown, v, &QUEUE, "queue", |q: &Queue| q.validate(&Limits::default()))
}

/// Decodes and validates a node given as a JSON value.
pub fn node_from_value(shown: &str, v: Value) -> anyhow::Result<Node> {
    decode(shown, v, &NODE, "node", |n: &Node| n.validate(&Limits::default()))
}

/// Loads and validates a job spec file (`.toml` or `.json`).
pub fn load_job(path: &Path) -> anyhow::Result<JobSpec> {
    job_from_value(&path.display().to_string(), read_value(path)?)
}

/// Loads and validates a queue file (`.toml` or `.json`).
pub fn load_queue(path: &Path) -> anyhow::Result<Queue> {
    queue_from_value(&path.display().to_string(), read_value(path)?)
}

/// Loads and validates a node file (`.toml` or `.json`).
pub fn load_node(path: &Path) -> anyhow::Result<Node> {
    node_from_value(&path.display().to_string(), read_value(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use suanli_model::{
        CheckpointPolicy, Constraints, Device, DeviceKind, DeviceRequest, Health, JobKind, NodeId, PoolId, QueueId,
        ResVec, TaskGroup, TaskResources,
    };

    fn full_job() -> JobSpec {
        JobSpec {
            name: "j".into(),
            queue: QueueId::from("q"),
            kind: JobKind::Inference,
            priority: -3,
            preemptible: false,
            gang: true,
            groups: vec![TaskGroup {
                task: None,
                name: "g".into(),
                replicas: 2,
                min_replicas: Some(1),
                resources: TaskResources {
                    cpu_milli: 1,
                    memory_mib: 1,
                    devices: Some(DeviceRequest { kind: DeviceKind::Npu, count: 1, milli: 500, memory_mib: 3 }),
                },
            }],
            constraints: Constraints {
                pools: vec![PoolId::from("p")],
                regions: vec!["r".into()],
                device_models: vec!["m".into()],
                labels: BTreeMap::from([("k".to_owned(), "v".to_owned())]),
            },
            runtime_estimate_s: Some(5),
            checkpoint: Some(CheckpointPolicy { interval_s: 1, grace_s: 2, restore_s: 3 }),
        }
    }

    /// Every field the model serializes is one the schema knows, with the same shape.
    #[test]
    fn schema_matches_model() {
        let v = serde_json::to_value(full_job()).expect("json");
        assert_eq!(check(&v, &JOB_SPEC, ""), Ok(()));
        let q = Queue {
            id: QueueId::from("q"),
            team: "t".into(),
            parent: Some(QueueId::from("p")),
            cohort: Some("c".into()),
            weight: 2,
            nominal: ResVec { cpu_milli: 1, memory_mib: 2, gpu_milli: 3, npu_milli: 4 },
            borrowing_limit: Some(ResVec::ZERO),
            lending_limit: Some(ResVec::ZERO),
        };
        assert_eq!(check(&serde_json::to_value(q).expect("json"), &QUEUE, "queue"), Ok(()));
        let n = Node {
            id: NodeId::from("n"),
            pool: PoolId::from("p"),
            datacenter: "d".into(),
            region: "r".into(),
            labels: BTreeMap::from([("k".to_owned(), "v".to_owned())]),
            cpu_milli: 1,
            memory_mib: 1,
            devices: vec![Device {
                id: "0".into(),
                kind: DeviceKind::Gpu,
                model: "m".into(),
                memory_mib: 1,
                health: Health::Unhealthy,
                numa: 1,
                peer_group: Some(0),
                partition_of: Some("x".into()),
            }],
            schedulable: false,
            agent_addr: String::new(),
        };
        assert_eq!(check(&serde_json::to_value(n).expect("json"), &NODE, "node"), Ok(()));
    }

    #[test]
    fn bad_fields_are_named() {
        let mut v = serde_json::to_value(full_job()).expect("json");
        v["groups"][0]["resources"]["gpus"] = Value::from(1);
        let e = job_from_value("f", v).expect_err("unknown field");
        assert!(e.to_string().starts_with("f: groups[0].resources.gpus: unknown field"), "{e}");

        let mut v = serde_json::to_value(full_job()).expect("json");
        v["groups"][0]["resources"]["cpu_milli"] = Value::from(-1);
        let e = job_from_value("f", v).expect_err("negative");
        assert!(e.to_string().contains("groups[0].resources.cpu_milli: -1 is out of range"), "{e}");

        let mut v = serde_json::to_value(full_job()).expect("json");
        v["groups"][0]["replicas"] = Value::from(0);
        v["groups"][0]["min_replicas"] = Value::Null;
        let e = job_from_value("f", v).expect_err("zero replicas");
        assert!(e.to_string().contains("groups[0].replicas: 0 is out of range"), "{e}");

        let mut v = serde_json::to_value(full_job()).expect("json");
        v.as_object_mut().expect("object").remove("queue");
        let e = job_from_value("f", v).expect_err("missing");
        assert!(e.to_string().contains("queue: missing required field"), "{e}");

        let round = job_from_value("f", serde_json::to_value(full_job()).expect("json")).expect("valid");
        assert_eq!(round, full_job());
    }
}
