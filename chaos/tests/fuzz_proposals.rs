//! No input stops a server from applying (issue 15): arbitrary bytes, arbitrary JSON and
//! structurally valid envelopes with arbitrary bodies, for every command kind, through every
//! RPC that ends in a proposal (`Internal.Propose` on the peer port; Jobs.Submit, SubmitMany,
//! Cancel; Queues.Upsert, Delete; Nodes.SetMode, ClearQuarantine; Agent.Register, Heartbeat, ReportStatus,
//! ReportCheckpoint), to random servers of one 3-server cluster. Any answer is fine; after
//! every case every server still answers and reports no halt, and after every batch of cases
//! and at the end the servers converge (same state hash at the same applied index) and a valid
//! submission commits through every server.
//!
//! Seeded: `SUANLI_FUZZ_SEED=<n>` replays a run (the seed is printed), `SUANLI_FUZZ_CASES`
//! changes the number of cases (default 200). Needs the workspace built
//! (`cargo build --workspace`) for `target/debug/suanli`.

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde_json::{Value, json};
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::internal_client::InternalClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_server::local::ProcessCluster;
use suanli_state::Command;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

/// Every RPC that ends in a proposal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rpc {
    Propose,
    Submit,
    SubmitMany,
    Cancel,
    UpdateService,
    Upsert,
    DeleteQueue,
    SetMode,
    ClearQuarantine,
    Register,
    Heartbeat,
    ReportStatus,
    ReportCheckpoint,
}

const RPCS: &[Rpc] = &[
    Rpc::Propose,
    Rpc::Submit,
    Rpc::SubmitMany,
    Rpc::Cancel,
    Rpc::UpdateService,
    Rpc::Upsert,
    Rpc::DeleteQueue,
    Rpc::SetMode,
    Rpc::ClearQuarantine,
    Rpc::Register,
    Rpc::Heartbeat,
    Rpc::ReportStatus,
    Rpc::ReportCheckpoint,
];

/// One call.
#[derive(Debug, Clone)]
struct Case {
    rpc: Rpc,
    server: usize,
    /// The JSON field's bytes (`command_json`, `spec_json`, `queue_json`, `node_json`).
    payload: Vec<u8>,
    /// Ids, sequence numbers, epochs.
    n: (u64, u64),
    /// Names, reasons, messages.
    text: String,
    flag: bool,
    /// Enum fields (modes, statuses), exit codes.
    small: i32,
}

/// Field names and words the state's types use, so arbitrary JSON hits real fields.
const WORDS: &[&str] = &[
    "id",
    "name",
    "queue",
    "groups",
    "replicas",
    "resources",
    "cpu_milli",
    "memory_mib",
    "devices",
    "kind",
    "count",
    "milli",
    "task",
    "command",
    "args",
    "nominal",
    "node",
    "pool",
    "job",
    "alloc",
    "epoch",
    "status",
    "reason",
    "mode",
    "commands",
    "plan",
    "now",
    "index",
    "spec",
    "client_request_id",
    "retry",
    "priority",
    "labels",
    "health",
    "device",
    "uri",
    "step",
    "size_bytes",
    "message",
    "config",
    "parent",
    "cohort",
    "weight",
    "gpu",
    "npu",
    "batch",
    "running",
    "cordoned",
    "draining",
    "unhealthy",
    "default",
    "gang",
    "max_attempts",
    "borrowing_limit",
];

fn word() -> impl Strategy<Value = String> {
    prop_oneof![3 => prop::sample::select(WORDS).prop_map(str::to_owned), 1 => "[a-z_]{0,10}", 1 => ".{0,24}"]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        prop_oneof![Just(0u64), Just(1), Just(1000), Just(u64::from(u32::MAX) + 1), Just(u64::MAX), any::<u64>()]
            .prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        word().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(word(), inner, 0..5).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn spec() -> Value {
    json!({"name": "fz", "queue": "default", "kind": "batch",
        "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 100, "memory_mib": 64,
            "devices": {"kind": "gpu", "count": 1, "milli": 500}},
            "task": {"command": "/bin/true", "args": []}}]})
}

fn queue() -> Value {
    json!({"id": "fz-q", "nominal": {"cpu_milli": 1000, "memory_mib": 1024, "gpu_milli": 1000}})
}

fn node() -> Value {
    json!({"id": "fz-node", "pool": "default", "cpu_milli": 8000, "memory_mib": 65536,
        "devices": [{"id": "gpu0", "kind": "gpu", "model": "A100", "memory_mib": 40960}]})
}

/// A body a correct build could deserialize for `kind` (before mutation).
fn body(kind: &str) -> Value {
    match kind {
        "upsert_queue" => json!({"queue": queue()}),
        "delete_queue" => json!({"queue": "fz-q"}),
        "register_node" => json!({"node": node(), "now": 1}),
        "set_node_mode" => json!({"node": "fz-node", "mode": "cordoned", "now": 1}),
        "node_down" => json!({"node": "fz-node", "reason": "fz", "now": 1}),
        "device_health" => json!({"node": "fz-node", "device": "gpu0", "health": "unhealthy", "now": 1}),
        "submit_job" => json!({"client_request_id": "fz", "spec": spec(), "retry": null, "now": 1}),
        "cancel_job" => json!({"job": 1, "reason": "fz", "now": 1}),
        "apply_plan" => json!({"plan": {}, "now": 1}),
        "alloc_status" => json!({"alloc": 1, "epoch": 1, "status": "running", "message": "", "now": 1}),
        "report_checkpoint" => json!({"alloc": 1, "epoch": 1, "uri": "s3://fz", "step": 1, "size_bytes": 1, "now": 1}),
        "update_config" => json!({"config": {}}),
        "batch" => json!({"commands": [envelope("submit_job", false), envelope("cancel_job", false)]}),
        "skip_entry" => json!({"index": 1, "kind": "fz"}),
        _ => json!({}),
    }
}

fn envelope(kind: &str, ignorable: bool) -> Value {
    json!({"v": 1, "kind": kind, "ignorable": ignorable, "body": body(kind)})
}

/// The well-formed documents an RPC takes, to mutate.
fn templates(rpc: Rpc) -> Vec<Value> {
    match rpc {
        Rpc::Propose => {
            let mut v: Vec<Value> = Command::KINDS.iter().map(|k| envelope(k, false)).collect();
            v.push(envelope("from_the_future", false));
            v.push(envelope("from_the_future", true));
            v
        }
        Rpc::Submit | Rpc::SubmitMany => vec![spec()],
        Rpc::Upsert => vec![queue()],
        Rpc::Register => vec![node()],
        _ => vec![json!({})],
    }
}

/// Sets (or removes, for `None`) `key` in the object found by following `path` (indexes
/// into object values and arrays, taken modulo their length).
fn mutate(doc: &mut Value, path: &[usize], key: &str, value: Option<Value>) {
    // The JSON pointer of the innermost object or array the path reaches.
    let mut pointer = String::new();
    let mut at: &Value = doc;
    for p in path {
        let next = match at {
            Value::Object(m) if !m.is_empty() => {
                m.iter().nth(p % m.len()).map(|(k, v)| (k.replace('~', "~0").replace('/', "~1"), v))
            }
            Value::Array(a) if !a.is_empty() => Some(((p % a.len()).to_string(), &a[p % a.len()])),
            _ => None,
        };
        match next {
            Some((step, n)) if n.is_object() || n.is_array() => {
                pointer = format!("{pointer}/{step}");
                at = n;
            }
            _ => break,
        }
    }
    let Some(at) = doc.pointer_mut(&pointer) else { return };
    if let Value::Object(m) = at {
        // Half the time an existing key (a known field with a wrong value), else a new one.
        let key = if !m.is_empty() && path.len().is_multiple_of(2) {
            m.keys().nth(key.len() % m.len()).cloned().unwrap_or_default()
        } else {
            key.to_owned()
        };
        match value {
            Some(v) => {
                m.insert(key, v);
            }
            None => {
                m.remove(&key);
            }
        }
    }
}

fn payload(rpc: Rpc) -> BoxedStrategy<Vec<u8>> {
    let t = templates(rpc);
    let edits = prop::collection::vec(
        (prop::collection::vec(any::<usize>(), 0..4), word(), prop::option::weighted(0.85, json())),
        0..4,
    );
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..256),
        1 => json().prop_map(|v| v.to_string().into_bytes()),
        4 => (prop::sample::select(t), edits).prop_map(|(mut doc, edits)| {
            for (path, key, value) in edits {
                mutate(&mut doc, &path, &key, value);
            }
            doc.to_string().into_bytes()
        }),
    ]
    .boxed()
}

fn case() -> impl Strategy<Value = Case> {
    // Internal.Propose carries every command kind: a third of the cases.
    let rpc = prop_oneof![1 => Just(Rpc::Propose), 2 => prop::sample::select(RPCS)];
    (rpc, 0..3usize).prop_flat_map(|(rpc, server)| {
        let n = prop_oneof![0..4u64, any::<u64>()];
        (
            payload(rpc),
            (n.clone(), n),
            prop_oneof![word(), ".{0,300}"],
            any::<bool>(),
            prop_oneof![0..5i32, any::<i32>()],
        )
            .prop_map(move |(payload, n, text, flag, small)| Case {
                rpc,
                server,
                payload,
                n,
                text,
                flag,
                small,
            })
    })
}

/// A channel to `addr` over TLS with the process's PKI (the cluster's): a peer listener
/// (`peer`) with the servers' own certificate, so a proposal meets the server's checks and not
/// only the listener's; a client listener as the admin.
fn lazy(addr: &str, peer: bool) -> Channel {
    let pki = suanli_server::local::LocalPki::get();
    let tls = suanli_security::tls::Tls::load(if peer { pki.server() } else { pki.admin() }).expect("the local PKI");
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .expect("a loopback address")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    suanli_security::tls::channel(ep, Some(&tls))
}

/// Makes the call; returns its status code (any is fine).
async fn send(c: &ProcessCluster, k: &Case) -> Code {
    let text = String::from_utf8_lossy(&k.payload).into_owned();
    // Half the proposals go to the leader (a follower refuses what passes its checks).
    let server = match c.wait_leader(Duration::from_secs(5)).await {
        Ok(l) if k.rpc == Rpc::Propose && k.n.1.is_multiple_of(2) => l,
        _ => k.server,
    };
    let ch = if k.rpc == Rpc::Propose { lazy(&c.peer_addrs[server], true) } else { lazy(&c.addrs[server], false) };
    let retry =
        k.flag.then_some(pb::RetryPolicy { max_attempts: k.n.0 as u32, backoff_base_s: k.n.1, backoff_max_s: k.n.0 });
    let submit = |i: u64| pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: format!("{}-{i}", k.text),
        spec_json: text.clone(),
        retry,
    };
    let r: Result<(), tonic::Status> = match k.rpc {
        Rpc::Propose => {
            // Now and then a group no server serves.
            let group = if k.small == 3 && !k.flag { k.text.clone() } else { "region".to_owned() };
            let req = pb::ProposeRequest { group, command_json: k.payload.clone().into() };
            InternalClient::new(ch).propose(req).await.map(drop)
        }
        Rpc::Submit => JobsClient::new(ch).submit(submit(0)).await.map(drop),
        Rpc::SubmitMany => {
            let jobs = (0..(k.n.0 % 4)).map(submit).collect();
            JobsClient::new(ch).submit_many(pb::SubmitJobsRequest { jobs }).await.map(drop)
        }
        Rpc::Cancel => {
            JobsClient::new(ch).cancel(pb::CancelJobRequest { job_id: k.n.0, reason: k.text.clone() }).await.map(drop)
        }
        Rpc::UpdateService => {
            // A spec (or bytes) for one of the first jobs, which may be a service.
            let req = pb::UpdateServiceRequest { job_id: k.n.0 % 8, spec_json: text };
            JobsClient::new(ch).update_service(req).await.map(drop)
        }
        Rpc::Upsert => QueuesClient::new(ch).upsert(pb::UpsertQueueRequest { queue_json: text }).await.map(drop),
        Rpc::DeleteQueue => QueuesClient::new(ch).delete(pb::DeleteQueueRequest { id: k.text.clone() }).await.map(drop),
        Rpc::SetMode => {
            let id = if k.flag { "fz-node".to_owned() } else { k.text.clone() };
            NodesClient::new(ch)
                .set_mode(pb::SetNodeModeRequest { id, mode: k.small, ..Default::default() })
                .await
                .map(drop)
        }
        Rpc::ClearQuarantine => {
            let id = if k.flag { "fz-node".to_owned() } else { k.text.clone() };
            let device = if k.small % 2 == 0 { "gpu0".to_owned() } else { k.text.clone() };
            NodesClient::new(ch).clear_quarantine(pb::ClearQuarantineRequest { id, device }).await.map(drop)
        }
        Rpc::Register => {
            let req = pb::RegisterNodeRequest { node_json: text, agent_version: k.text.clone(), ..Default::default() };
            AgentClient::new(ch).register(req).await.map(drop)
        }
        Rpc::Heartbeat => {
            let node_id = if k.flag { "fz-node".to_owned() } else { k.text.clone() };
            let devices = (0..(k.n.1 % 3))
                .map(|i| pb::DeviceHealthReport {
                    device: if i == 0 { "gpu0".into() } else { k.text.clone() },
                    healthy: k.small % 2 == 0,
                    reason: k.text.clone(),
                })
                .collect();
            let req =
                pb::HeartbeatRequest { node_id, seq: k.n.0, devices, stats: Vec::new(), disk_pressure: String::new() };
            AgentClient::new(ch).heartbeat(req).await.map(drop)
        }
        Rpc::ReportStatus => {
            let req = pb::ReportStatusRequest {
                alloc_id: k.n.0,
                epoch: k.n.1,
                status: k.small % 6,
                message: k.text.clone(),
                exit_code: k.small,
                end: k.text.clone(),
                exit_code_set: k.small % 2 == 0,
                readiness_report: k.small % 3 == 0,
                ready: k.small % 2 == 1,
                endpoint: k.text.clone(),
                load_milli: (k.small % 4 == 0).then_some(k.n.0),
                latency_us: (k.small % 5 == 0).then_some(k.n.1),
                success_ppm: (k.small % 7 == 0).then_some(k.small.unsigned_abs()),
            };
            AgentClient::new(ch).report_status(req).await.map(drop)
        }
        Rpc::ReportCheckpoint => {
            let req = pb::ReportCheckpointRequest {
                alloc_id: k.n.0,
                epoch: k.n.1,
                uri: k.text.clone(),
                step: k.n.1,
                size_bytes: k.n.0,
                wall_time: k.n.0,
                hardware_bound: k.small % 2 == 0,
                device_kind: k.text.clone(),
                device_model: k.text.clone(),
                device_count: k.small.unsigned_abs(),
            };
            AgentClient::new(ch).report_checkpoint(req).await.map(drop)
        }
    };
    r.err().map_or(Code::Ok, |s| s.code())
}

/// Every server answers and none reports a halt (after every case).
async fn applying(c: &ProcessCluster) -> Result<(), String> {
    for i in 0..c.addrs.len() {
        let v = ClusterClient::new(lazy(&c.addrs[i], false))
            .version(pb::VersionRequest {})
            .await
            .map_err(|e| format!("server {i} does not answer Version: {e:?}"))?
            .into_inner();
        if let Some(h) = v.halt {
            return Err(format!("server {i} halted at entry {} (kind {:?}): {}", h.index, h.kind, h.reason));
        }
        if c.log(i).contains("panicked") {
            return Err(format!("server {i} panicked"));
        }
    }
    Ok(())
}

/// The servers reach one applied index with one state hash, and a valid submission commits
/// through every server (after every batch).
async fn converges_and_writes(c: &ProcessCluster, tag: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0..c.addrs.len() {
        let ch = lazy(&c.addrs[i], false);
        let q = json!({"id": "fz-check", "nominal": {"cpu_milli": 100000, "memory_mib": 100000}}).to_string();
        let spec = json!({"name": "fz-check", "queue": "fz-check",
            "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 100, "memory_mib": 64}}]})
        .to_string();
        loop {
            let r = async {
                QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: q.clone() }).await?;
                let req = pb::SubmitJobRequest {
                    global: false,
                    team: String::new(),
                    client_request_id: format!("{tag}-{i}"),
                    spec_json: spec.clone(),
                    retry: None,
                };
                JobsClient::new(ch.clone()).submit(req).await
            }
            .await;
            match r {
                Ok(_) => break,
                Err(s)
                    if matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded) && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(s) => return Err(format!("a valid write through server {i}: {s:?}")),
            }
        }
    }
    let mut last = String::new();
    while Instant::now() < deadline {
        let mut seen = Vec::new();
        let mut errors = Vec::new();
        for p in &c.peer_addrs {
            let req = pb::InspectRequest { group: "region".into(), log_from: 0, log_to: 0 };
            match InternalClient::new(lazy(p, true)).inspect(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    seen.push((r.applied_index, r.state_hash));
                }
                Err(e) => errors.push(format!("Inspect of {p}: {:?} {}", e.code(), e.message())),
            }
        }
        if seen.len() == c.peer_addrs.len() && seen.iter().all(|s| s.0 == seen[0].0) {
            if seen.iter().all(|s| s.1 == seen[0].1) {
                return Ok(());
            }
            return Err(format!("different state hashes at applied index {}: {seen:?}", seen[0].0));
        }
        last = format!("applied (index, hash): {seen:?} {errors:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("no common applied index within 20 s: {last}"))
}

#[test]
fn no_input_through_any_proposing_rpc_stops_a_server_from_applying() {
    let seed: u64 = std::env::var("SUANLI_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let cases: u32 = std::env::var("SUANLI_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    println!("fuzz seed {seed}, {cases} cases (replay with SUANLI_FUZZ_SEED={seed})");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("server.toml");
    std::fs::write(&cfg, "request_timeout_ms = 3000\n").expect("config");
    let bin = suanli_chaos::cluster::default_bin().expect("the suanli binary (cargo build --workspace)");
    let c = ProcessCluster::start(&bin, 3, &["--config", cfg.to_str().expect("utf-8 path")]).expect("cluster");
    rt.block_on(c.wait_leader(Duration::from_secs(30))).expect("a leader");

    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config { cases, max_shrink_iters: 0, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
    let n = Cell::new(0u32);
    let codes = RefCell::new(std::collections::BTreeMap::<(String, String), u32>::new());
    let started = Instant::now();
    let result = runner.run(&case(), |k| {
        let i = n.get();
        n.set(i + 1);
        rt.block_on(async {
            let code = send(&c, &k).await;
            *codes.borrow_mut().entry((format!("{:?}", k.rpc), format!("{code:?}"))).or_default() += 1;
            let fail = |what: String| {
                TestCaseError::fail(format!(
                    "seed {seed}, case {i}: {what}\ncase: {k:?}\npayload: {}",
                    String::from_utf8_lossy(&k.payload)
                ))
            };
            applying(&c).await.map_err(fail)?;
            if (i + 1).is_multiple_of(25) {
                converges_and_writes(&c, &format!("batch-{i}")).await.map_err(fail)?;
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        let logs: Vec<String> = (0..3)
            .map(|i| {
                let log = c.log(i);
                let tail: Vec<&str> = log.lines().rev().take(10).collect();
                format!("server {i}:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect();
        panic!("{e}\nreplay with SUANLI_FUZZ_SEED={seed}\n{}", logs.join("\n"));
    }
    rt.block_on(async {
        applying(&c).await?;
        converges_and_writes(&c, "end").await
    })
    .unwrap_or_else(|e| panic!("seed {seed}, at the end: {e}"));
    println!("{} cases in {:.1} s; answers by rpc:", n.get(), started.elapsed().as_secs_f64());
    for ((rpc, code), count) in codes.borrow().iter() {
        println!("  {rpc:<16} {code:<18} {count}");
    }
}
