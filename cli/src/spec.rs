//! Spec files written by hand: jobs ([`JobSpec`]), queues ([`Queue`]) and nodes ([`Node`]).
//!
//! A file is TOML (`.toml`) or JSON (`.json`), chosen by its extension; YAML is not supported.
//! Loading is strict, so a typo never silently becomes a default, and it is the same strict
//! path the servers decode the API's `*_json` fields with ([`suanli_model::input`]):
//!
//! ```text
//!   file ──parse (toml|json)──▶ value ──suanli_model::input──▶ T ──T::validate(Limits)──▶ T
//!                                       unknown field, wrong type,   (the model's own limits)
//!                                       missing field
//! ```
//!
//! Every error names the file and the dotted field path (`groups[0].resources.cpu_milli`), and
//! for limits the allowed range.

use anyhow::{Context, anyhow, bail};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::path::Path;
use suanli_model::{JobSpec, Limits, Node, Queue, ValidationError};

/// Largest spec file read, in bytes (the API's default message limit).
pub const MAX_FILE_BYTES: u64 = suanli_proto::DEFAULT_MAX_MESSAGE_BYTES as u64;

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

/// Decodes `v` strictly (the model's input path) and validates it with the model's
/// `validate`. `prefix` is the document's field path prefix (`queue`, `node`; empty for a job).
fn decode<T: DeserializeOwned>(
    shown: &str,
    v: Value,
    prefix: &str,
    validate: impl FnOnce(&T) -> Result<(), ValidationError>,
) -> anyhow::Result<T> {
    let t: T = suanli_model::input::from_json_value(v).map_err(|e| {
        let field = match (prefix.is_empty(), e.field.is_empty()) {
            (true, true) => "(top level)".to_owned(),
            (true, false) => e.field,
            (false, true) => prefix.to_owned(),
            (false, false) => format!("{prefix}.{}", e.field),
        };
        anyhow!("{shown}: {field}: {}", e.message)
    })?;
    validate(&t).map_err(|e| anyhow!("{shown}: {e}"))?;
    Ok(t)
}

/// Decodes and validates a job spec given as a JSON value; `shown` names its source in errors.
pub fn job_from_value(shown: &str, v: Value) -> anyhow::Result<JobSpec> {
    decode(shown, v, "", |s: &JobSpec| s.validate(&Limits::default()))
}

/// Decodes and validates a queue given as a JSON value.
pub fn queue_from_value(shown: &str, v: Value) -> anyhow::Result<Queue> {
    decode(shown, v, "queue", |q: &Queue| q.validate(&Limits::default()))
}

/// Decodes and validates a node given as a JSON value.
pub fn node_from_value(shown: &str, v: Value) -> anyhow::Result<Node> {
    decode(shown, v, "node", |n: &Node| n.validate(&Limits::default()))
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

    /// Every field the model serializes decodes again through the strict path (nothing the
    /// model writes is refused as unknown).
    #[test]
    fn model_round_trips_through_the_strict_path() {
        let round = job_from_value("f", serde_json::to_value(full_job()).expect("json")).expect("valid");
        assert_eq!(round, full_job());
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
        assert_eq!(queue_from_value("f", serde_json::to_value(&q).expect("json")).expect("valid"), q);
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
            agent_addr: "127.0.0.1:7401".into(),
        };
        assert_eq!(node_from_value("f", serde_json::to_value(&n).expect("json")).expect("valid"), n);
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
        assert!(e.to_string().starts_with("f: groups[0].resources.cpu_milli: invalid value: integer `-1`"), "{e}");

        let mut v = serde_json::to_value(full_job()).expect("json");
        v["groups"][0]["replicas"] = Value::from(0);
        v["groups"][0]["min_replicas"] = Value::Null;
        let e = job_from_value("f", v).expect_err("zero replicas");
        assert!(e.to_string().contains("groups[0].replicas: 0 is out of range"), "{e}");

        let mut v = serde_json::to_value(full_job()).expect("json");
        v.as_object_mut().expect("object").remove("queue");
        let e = job_from_value("f", v).expect_err("missing");
        assert!(e.to_string().contains("queue: missing required field"), "{e}");

        let q = serde_json::json!({"id": "q", "weigth": 2});
        let e = queue_from_value("f", q).expect_err("typo");
        assert!(e.to_string().starts_with("f: queue.weigth: unknown field"), "{e}");

        let round = job_from_value("f", serde_json::to_value(full_job()).expect("json")).expect("valid");
        assert_eq!(round, full_job());
    }
}
