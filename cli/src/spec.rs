//! Spec files written by hand: jobs ([`JobSpec`]), queues ([`Queue`]) and nodes ([`Node`]).
//!
//! A file is TOML (`.toml`) or JSON (`.json`), chosen by its extension; YAML is not supported.
//! Loading is strict, so a typo never silently becomes a default, and it is the same strict
//! path the servers decode the API's `*_json` fields with ([`suanli_model::input`]): a JSON
//! file goes through the very function a server applies to `spec_json`, so both refuse a bad
//! file with the same message (the `parity` tests below hold that):
//!
//! ```text
//!   .json text ──────────────────────────input::from_json_str──▶ T ──T::validate(Limits)──▶ T
//!   .toml text ──parse──▶ value ──────────input::from_json_value─▶ T    (the model's own limits)
//!                                 unknown field, wrong type, missing field
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

/// A spec file's content, as the decoder takes it.
enum Doc {
    /// A JSON file's text: decoded by the very function the servers decode the API's `*_json`
    /// fields with ([`suanli_model::input::from_json_str`]), so both refuse it alike.
    Json(String),
    /// A TOML file (or a value built in code), parsed into a JSON value first.
    Value(Value),
}

/// Reads a TOML or JSON file; a TOML file is parsed into a JSON value (the form the API carries).
fn read_doc(path: &Path) -> anyhow::Result<Doc> {
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
        Ok(Doc::Value(serde_json::to_value(table).map_err(|e| anyhow!("{shown}: {e}"))?))
    } else {
        Ok(Doc::Json(text))
    }
}

/// Decodes `doc` strictly (the model's input path) and validates it with the model's
/// `validate`. `prefix` is the document's field path prefix (`queue`, `node`; empty for a job).
fn decode<T: DeserializeOwned>(
    shown: &str,
    doc: Doc,
    prefix: &str,
    validate: impl FnOnce(&T) -> Result<(), ValidationError>,
) -> anyhow::Result<T> {
    let decoded = match doc {
        Doc::Json(text) => suanli_model::input::from_json_str(&text),
        Doc::Value(v) => suanli_model::input::from_json_value(v),
    };
    let t: T = decoded.map_err(|e| {
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

fn job(shown: &str, doc: Doc) -> anyhow::Result<JobSpec> {
    decode(shown, doc, "", |s: &JobSpec| s.validate(&Limits::default()))
}

fn queue(shown: &str, doc: Doc) -> anyhow::Result<Queue> {
    decode(shown, doc, "queue", |q: &Queue| q.validate(&Limits::default()))
}

fn node(shown: &str, doc: Doc) -> anyhow::Result<Node> {
    decode(shown, doc, "node", |n: &Node| n.validate(&Limits::default()))
}

/// Decodes and validates a job spec given as a JSON value; `shown` names its source in errors.
#[cfg(test)]
pub fn job_from_value(shown: &str, v: Value) -> anyhow::Result<JobSpec> {
    job(shown, Doc::Value(v))
}

/// Decodes and validates a queue given as a JSON value.
#[cfg(test)]
pub fn queue_from_value(shown: &str, v: Value) -> anyhow::Result<Queue> {
    queue(shown, Doc::Value(v))
}

/// Decodes and validates a node given as a JSON value.
#[cfg(test)]
pub fn node_from_value(shown: &str, v: Value) -> anyhow::Result<Node> {
    node(shown, Doc::Value(v))
}

/// Loads and validates a job spec file (`.toml` or `.json`).
pub fn load_job(path: &Path) -> anyhow::Result<JobSpec> {
    job(&path.display().to_string(), read_doc(path)?)
}

/// Loads and validates a queue file (`.toml` or `.json`).
pub fn load_queue(path: &Path) -> anyhow::Result<Queue> {
    queue(&path.display().to_string(), read_doc(path)?)
}

/// Loads and validates a node file (`.toml` or `.json`).
pub fn load_node(path: &Path) -> anyhow::Result<Node> {
    node(&path.display().to_string(), read_doc(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use suanli_model::{
        CheckpointPolicy, CheckpointSignal, Constraints, Device, DeviceKind, DeviceRequest, Health, JobKind, NodeId,
        PoolId, QueueId, ResVec, TaskGroup, TaskResources,
    };

    fn full_job() -> JobSpec {
        JobSpec {
            name: "j".into(),
            queue: QueueId::from("q"),
            kind: JobKind::Training,
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
                nodes: vec![NodeId::from("n1")],
                avoid_nodes: vec![NodeId::from("n2")],
                gang_topology: suanli_model::GangTopology::RequireBlock,
                share_isolation: suanli_model::ShareIsolation::Enforced,
            },
            runtime_estimate_s: Some(5),
            checkpoint: Some(CheckpointPolicy {
                interval_s: 1,
                grace_s: 2,
                restore_s: 3,
                signal: CheckpointSignal::Usr2,
            }),
            service: None,
        }
    }

    /// A service with every `service` field set (a service is never a gang).
    fn full_service() -> JobSpec {
        let probe = |kind| suanli_model::Probe {
            kind,
            path: "/ready".into(),
            command: "true".into(),
            args: vec!["a".into()],
            period_ms: 200,
            timeout_ms: 300,
            failure_threshold: 2,
            initial_delay_ms: 5,
        };
        let mut job = full_job();
        job.kind = JobKind::Inference;
        job.gang = false;
        job.constraints.gang_topology = suanli_model::GangTopology::default();
        job.service = Some(suanli_model::ServiceSpec {
            port: 8080,
            readiness: Some(probe(suanli_model::ProbeKind::Http)),
            liveness: Some(probe(suanli_model::ProbeKind::Command)),
            restart_backoff_s: 2,
            max_restart_backoff_s: 30,
            spread: false,
            update: suanli_model::UpdateStrategy { max_unavailable: 2, max_surge: 3 },
            autoscale: Some(suanli_model::Autoscale {
                min_replicas: 1,
                max_replicas: 4,
                source: suanli_model::LoadSource::Prometheus,
                metric: "requests_in_flight".into(),
                target: 7,
                tolerance_pct: 5,
                period_s: 3,
                scale_up_window_s: 1,
                scale_down_window_s: 9,
                scale_up_step: 2,
                scale_down_step: 1,
            }),
            report: Some(suanli_model::ServiceReport {
                source: suanli_model::LoadSource::Prometheus,
                latency_metric: "p99_ms".into(),
                success_metric: "ok_ratio".into(),
                period_s: 5,
            }),
        });
        job
    }

    /// Every field the model serializes decodes again through the strict path (nothing the
    /// model writes is refused as unknown).
    #[test]
    fn model_round_trips_through_the_strict_path() {
        let round = job_from_value("f", serde_json::to_value(full_job()).expect("json")).expect("valid");
        assert_eq!(round, full_job());
        let round = job_from_value("f", serde_json::to_value(full_service()).expect("json")).expect("valid");
        assert_eq!(round, full_service());
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
                share_isolation: suanli_model::ShareIsolation::Enforced,
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

    /// A job spec good in every field; each parity case spoils one.
    const GOOD_TOML: &str = r#"
name = "tokenize"
queue = "team-nlp"
kind = "batch"
priority = -10

[[groups]]
name = "shard"
replicas = 2

[groups.resources]
cpu_milli = 250
memory_mib = 128
"#;

    /// What a server answers for `text` sent as `SubmitJobRequest.spec_json`
    /// (control-plane/server/src/api.rs, `submit_command`): `status::decode_json("spec_json", ..)`
    /// is `suanli_model::input::from_json_str` with the field under `spec_json`; a spec that
    /// decodes is then validated by the state machine with the cluster's limits, refused as a
    /// `CommandError` whose text is the status message.
    fn server_says(text: &str) -> String {
        match suanli_model::input::from_json_str::<JobSpec>(text) {
            Err(e) if e.field.is_empty() => format!("spec_json: {}", e.message),
            Err(e) => format!("spec_json.{}: {}", e.field, e.message),
            Ok(spec) => match spec.validate(&Limits::default()) {
                Err(e) => suanli_state::CommandError::from(e).to_string(),
                Ok(()) => "accepted".to_owned(),
            },
        }
    }

    /// The field and message of a refusal, without who refused (`<file>: `, `spec_json.`) and,
    /// with `positions` false, without serde's ` at line L column C` (a TOML file reaches a
    /// server as JSON text the CLI built, whose positions are not the file's).
    fn field_and_message(said: &str, who: &str, positions: bool) -> String {
        let s = said.strip_prefix(who).unwrap_or(said);
        let s = s.strip_prefix("(top level): ").unwrap_or(s);
        let s = s.strip_prefix("spec_json.").or_else(|| s.strip_prefix("spec_json: ")).unwrap_or(s);
        match s.find(" at line ") {
            Some(i) if !positions => s[..i].to_owned(),
            _ => s.to_owned(),
        }
    }

    /// Item 2 of issue 17: the CLI's loader and the server's decode path refuse the same bad
    /// files with the same message for the field.
    #[test]
    fn cli_and_server_refuse_the_same_files_with_the_same_messages() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good: Value = serde_json::to_value(toml::from_str::<toml::Table>(GOOD_TOML).expect("toml")).expect("json");
        assert_eq!(server_says(&good.to_string()), "accepted");
        let spoil = |f: &dyn Fn(&mut Value)| {
            let mut v = good.clone();
            f(&mut v);
            v
        };
        let cases: Vec<(&str, Value, &str)> = vec![
            (
                "unknown-field",
                spoil(&|v| v["groups"][0]["resources"]["gpus"] = Value::from(1)),
                "groups[0].resources.gpus: unknown field",
            ),
            (
                "wrong-type",
                spoil(&|v| v["groups"][0]["replicas"] = Value::from("two")),
                "groups[0].replicas: invalid type",
            ),
            ("over-a-limit", spoil(&|v| v["priority"] = Value::from(2_000_000)), "priority: "),
            (
                "zero-replicas",
                spoil(&|v| v["groups"][0]["replicas"] = Value::from(0)),
                "groups[0].replicas: 0 is out of range",
            ),
            (
                "missing-field",
                spoil(&|v| {
                    v.as_object_mut().expect("object").remove("queue");
                }),
                "queue: missing required field",
            ),
            ("bad-enum", spoil(&|v| v["kind"] = Value::from("nightly")), "kind: unknown variant"),
        ];
        for (name, doc, expect) in &cases {
            let server = server_says(&serde_json::to_string_pretty(doc).expect("json"));
            // The same document as a JSON file: the very same message, positions included.
            let json_file = dir.path().join(format!("{name}.json"));
            std::fs::write(&json_file, serde_json::to_string_pretty(doc).expect("json")).expect("write");
            let shown = format!("{}: ", json_file.display());
            let cli = load_job(&json_file).expect_err(name).to_string();
            assert!(cli.starts_with(&shown), "{name}: the CLI names the file: {cli}");
            assert_eq!(field_and_message(&cli, &shown, true), field_and_message(&server, "", true), "{name} (.json)");
            assert!(field_and_message(&cli, &shown, true).starts_with(expect), "{name}: {cli}");
            // As a TOML file: the same field and message.
            let toml_file = dir.path().join(format!("{name}.toml"));
            let table: toml::Table = serde_json::from_value(doc.clone()).expect("a TOML table");
            std::fs::write(&toml_file, toml::to_string(&table).expect("toml")).expect("write");
            let shown = format!("{}: ", toml_file.display());
            let cli = load_job(&toml_file).expect_err(name).to_string();
            let server = server_says(&doc.to_string());
            assert_eq!(field_and_message(&cli, &shown, false), field_and_message(&server, "", false), "{name} (.toml)");
        }
        // Bad syntax: a JSON file is refused by both alike; a TOML file never reaches a server,
        // and the CLI names the file, the syntax and the line.
        let broken = &serde_json::to_string_pretty(&good).expect("json")[..40];
        let json_file = dir.path().join("syntax.json");
        std::fs::write(&json_file, broken).expect("write");
        let shown = format!("{}: ", json_file.display());
        let cli = load_job(&json_file).expect_err("syntax").to_string();
        assert_eq!(field_and_message(&cli, &shown, true), field_and_message(&server_says(broken), "", true));
        let toml_file = dir.path().join("syntax.toml");
        std::fs::write(&toml_file, GOOD_TOML.replace("replicas = 2", "replicas = ")).expect("write");
        let cli = load_job(&toml_file).expect_err("syntax").to_string();
        assert!(cli.starts_with(&format!("{}: TOML syntax: ", toml_file.display())) && cli.contains("line 9"), "{cli}");
    }
}
