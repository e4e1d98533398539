//! One trace per job life, end to end (docs/tracing.md): a real OTLP receiver (the
//! collector's `TraceService`, tonic) in this process; three `suanli server` processes and a
//! `suanli agent` exporting to it. A preemptible job is preempted by a higher-priority one,
//! the leader is killed, and the job restarts under the new leader and finishes. Its spans
//! share one trace, the root `job` span exists once, every other span is its child, and the
//! spans come from two server processes and the agent, for attempts 1 and 2.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use suanli_proto::v1 as pb;
use suanli_server::local::{ProcessCluster, channel};
use suanli_tests::agents::{AgentProc, job, wait_nodes};
use suanli_tests::bin;
use suanli_tests::checkpoints::fake_gpus;

/// One received span: its process (`service.name`, `service.instance.id`) and itself.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    instance: String,
    name: String,
    trace: String,
    span: String,
    parent: String,
    attrs: BTreeMap<String, String>,
}

#[derive(Default, Clone)]
struct Receiver(Arc<Mutex<Vec<Got>>>);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rs in req.into_inner().resource_spans {
            let res: BTreeMap<String, String> = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                .collect();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(Got {
                        service: res.get("service.name").cloned().unwrap_or_default(),
                        instance: res.get("service.instance.id").cloned().unwrap_or_default(),
                        name: s.name.clone(),
                        trace: hex(&s.trace_id),
                        span: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        attrs: s.attributes.iter().map(|kv| (kv.key.clone(), text(kv.value.as_ref()))).collect(),
                    });
                }
            }
        }
        self.0.lock().unwrap().extend(got);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Receiver {
    /// Starts the receiver on a loopback port; its `http://` endpoint.
    async fn start(&self) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let svc = TraceServiceServer::new(self.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
                .await
                .unwrap();
        });
        format!("http://{addr}")
    }

    fn spans_of(&self, job: u64) -> Vec<Got> {
        let j = job.to_string();
        self.0.lock().unwrap().iter().filter(|g| g.attrs.get("suanli.job") == Some(&j)).cloned().collect()
    }

    /// Waits (bounded) until `f` holds for the job's spans.
    async fn wait(&self, job: u64, what: &str, within: Duration, f: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        let deadline = Instant::now() + within;
        loop {
            let s = self.spans_of(job);
            if f(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "{what}: not within {within:?}; spans: {s:#?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn has(s: &[Got], name: &str, attempt: u64) -> bool {
    let a = attempt.to_string();
    s.iter().any(|g| g.name == name && g.attrs.get("suanli.attempt") == Some(&a))
}

fn spec(name: &str, priority: i64, preemptible: bool, secs: u32) -> serde_json::Value {
    serde_json::json!({
        "name": name, "queue": "default", "priority": priority, "preemptible": preemptible,
        "groups": [{"name": "main", "replicas": 1,
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 2, "milli": 1000}},
            "task": {"command": "/bin/sh", "args": ["-c", format!("exec sleep {secs}")]}}]
    })
}

async fn submit(addr: &str, rid: &str, spec: &serde_json::Value) -> u64 {
    let mut c = suanli_proto::v1::jobs_client::JobsClient::new(channel(addr).await.unwrap());
    let mut req = tonic::Request::new(pb::SubmitJobRequest {
        client_request_id: rid.into(),
        spec_json: spec.to_string(),
        ..Default::default()
    });
    // The caller's own span: the job's root span is its child.
    req.metadata_mut().insert("traceparent", CALLER.parse().unwrap());
    c.submit(req).await.unwrap().into_inner().job_id
}

const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

async fn wait_state(addr: &str, id: u64, within: Duration, f: impl Fn(&pb::JobInfo) -> bool) -> pb::JobInfo {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Ok(j)) = tokio::time::timeout(Duration::from_secs(2), async {
            let mut c = suanli_proto::v1::jobs_client::JobsClient::new(channel(addr).await.map_err(|e| e.to_string())?);
            c.get(pb::GetJobRequest { job_id: id, stale: true })
                .await
                .map(|r| r.into_inner())
                .map_err(|e| e.to_string())
        })
        .await
            && f(&j)
        {
            return j;
        }
        assert!(Instant::now() < deadline, "job {id} did not get there within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_follows_a_job_through_preemption_and_a_leader_change() {
    let t0 = Instant::now();
    let rx = Receiver::default();
    let endpoint = rx.start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("server.toml");
    std::fs::write(&cfg, "heartbeat_interval_ms = 200\nheartbeat_ttl_ms = 3000\n").unwrap();
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let mut c = ProcessCluster::start_env(&bin(), 3, &["--config", cfg.to_str().unwrap()], &env).unwrap();
    let leader = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let addr = c.addrs[leader].clone();
    let q = serde_json::json!({"id": "default", "team": "vision", "nominal": {"cpu_milli": u64::MAX,
        "memory_mib": u64::MAX, "gpu_milli": u64::MAX, "npu_milli": u64::MAX}});
    suanli_proto::v1::queues_client::QueuesClient::new(channel(&addr).await.unwrap())
        .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
        .await
        .unwrap();
    // Prices, so each attempt span carries what it cost.
    let catalog = pb::PriceCatalogInfo {
        currency: "USD".into(),
        devices: vec![pb::DevicePriceInfo { model: "H200".into(), per_hour: "3.6".into(), ..Default::default() }],
        cpu_core_hour: "0.036".into(),
        memory_gib_hour: "0".into(),
    };
    suanli_proto::v1::cost_client::CostClient::new(channel(&addr).await.unwrap())
        .set_prices(pb::SetPricesRequest { catalog: Some(catalog) })
        .await
        .unwrap();
    let mut agent = AgentProc::new("n1", &c.addrs, &fake_gpus(2, "H200"), "pool = \"p\"\n");
    agent.start_with(|cmd| {
        for (k, v) in env {
            cmd.env(k, v);
        }
    });
    wait_nodes(&addr, Duration::from_secs(30), "the agent registered", |ns| {
        suanli_tests::agents::ready_healthy(ns, "n1", 2)
    })
    .await;

    // Attempt 1 runs, then a higher-priority job preempts it.
    let low = submit(&addr, "low", &spec("low", 0, true, 4)).await;
    wait_state(&addr, low, Duration::from_secs(20), |j| j.state == "running").await;
    let high = submit(&addr, "high", &spec("high", 100, false, 2)).await;
    wait_state(&addr, high, Duration::from_secs(20), |j| j.state == "running").await;
    // The old leader's spans leave before it is killed (SIGKILL loses what is unsent).
    rx.wait(low, "attempt 1's spans from the first leader", Duration::from_secs(10), |s| {
        has(s, "job.preempted", 1) && has(s, "attempt", 1) && has(s, "job.placed", 1)
    })
    .await;
    c.kill(leader);
    let next = c.wait_leader(Duration::from_secs(20)).await.unwrap();
    let addr = c.addrs[next].clone();
    let j = wait_state(&addr, low, Duration::from_secs(30), |j| j.state == "succeeded").await;
    assert_eq!(j.attempt, 2, "{j:#?}");
    assert_eq!(j.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736", "the job keeps the caller's trace id");
    let spans = rx
        .wait(low, "the root span and attempt 2's spans", Duration::from_secs(10), |s| {
            s.iter().any(|g| g.name == "job")
                && has(s, "task.run", 2)
                && has(s, "job.placed", 2)
                && has(s, "attempt", 2)
        })
        .await;

    // One trace: the caller's.
    let traces: BTreeSet<&str> = spans.iter().map(|g| g.trace.as_str()).collect();
    assert_eq!(traces, BTreeSet::from(["4bf92f3577b34da6a3ce929d0e0e4736"]), "{spans:#?}");
    // The root span exists once; its parent is the caller's span; all others are its children.
    let roots: Vec<&Got> = spans.iter().filter(|g| g.name == "job").collect();
    assert_eq!(roots.len(), 1, "one root span: {roots:#?}");
    let root = roots[0];
    assert_eq!(root.parent, "00f067aa0ba902b7");
    assert_eq!(root.attrs.get("suanli.state").map(String::as_str), Some("succeeded"));
    for g in spans.iter().filter(|g| g.name != "job") {
        assert_eq!(g.parent, root.span, "{} is a child of the root: {g:#?}", g.name);
    }
    // No span twice (each event is emitted by one process).
    let mut seen = BTreeSet::new();
    for g in &spans {
        let key = (g.name.clone(), g.attrs.get("suanli.attempt").cloned(), g.attrs.get("suanli.alloc").cloned());
        assert!(seen.insert(key.clone()), "{key:?} twice: {spans:#?}");
    }
    // Both server processes and the agent contributed.
    let servers: BTreeSet<&str> =
        spans.iter().filter(|g| g.service == "suanli-server").map(|g| g.instance.as_str()).collect();
    assert!(servers.len() >= 2, "spans from two servers: {servers:?}");
    assert!(spans.iter().any(|g| g.service == "suanli-agent" && g.instance == "n1"), "agent spans: {spans:#?}");
    for (name, attempt) in [("job.submit", 0), ("job.queued", 0), ("task.start", 1), ("task.run", 1), ("task.start", 2)]
    {
        assert!(
            spans.iter().any(
                |g| g.name == name && (attempt == 0 || g.attrs.get("suanli.attempt") == Some(&attempt.to_string()))
            ),
            "{name} (attempt {attempt}) missing: {spans:#?}"
        );
    }
    let a1 = spans.iter().find(|g| g.name == "attempt" && g.attrs["suanli.attempt"] == "1").unwrap();
    assert_eq!(a1.attrs.get("suanli.end").map(String::as_str), Some("preempted"), "{a1:#?}");
    for g in spans.iter().filter(|g| matches!(g.name.as_str(), "attempt" | "job.placed" | "job.preempted")) {
        for k in ["suanli.job", "suanli.queue", "suanli.pool", "suanli.attempt", "suanli.node", "suanli.devices"] {
            assert!(g.attrs.contains_key(k), "{k} on {g:#?}");
        }
        assert_eq!(g.attrs["suanli.pool"], "p");
        assert_eq!(g.attrs["suanli.team"], "vision");
    }
    assert!(spans.iter().any(|g| g.name == "attempt" && g.attrs.contains_key("suanli.device_seconds")));
    // Each attempt's priced cost (2 H200 at 3.6/h: 0.002 per second held, plus CPU), its split
    // adding up to its total; the attempt that ran to the end (seconds of the replicated
    // clock; the preempted one may have held its devices for less than one) cost something.
    let mut priced = 0.0;
    for g in spans.iter().filter(|g| g.name == "attempt") {
        let amount = |k: &str| -> f64 { g.attrs.get(k).unwrap_or_else(|| panic!("{k} on {g:#?}")).parse().unwrap() };
        assert_eq!(g.attrs.get("suanli.cost.currency").map(String::as_str), Some("USD"), "{g:#?}");
        assert!(
            (amount("suanli.cost.useful") + amount("suanli.cost.lost") - amount("suanli.cost")).abs() < 2e-6,
            "{g:#?}"
        );
        if amount("suanli.device_seconds") > 0.0 {
            assert!(amount("suanli.cost") >= 0.002 * amount("suanli.device_seconds") / 2.0 - 1e-6, "{g:#?}");
        }
        priced += amount("suanli.cost");
    }
    assert!(priced > 0.0, "the attempts cost something: {spans:#?}");
    let high_job = job(&addr, high).await;
    assert_eq!(high_job.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    agent.kill();
    eprintln!("one trace, {} spans, {} servers, in {:?}", spans.len(), servers.len(), t0.elapsed());
}
