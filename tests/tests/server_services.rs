//! Against a real server: the standard gRPC services (health, reflection) are answered; and
//! watch-stream slots: a foreign client that opens watch streams until refused (per
//! connection, then the client pool) cannot take the agents' slots, a re-connecting agent
//! takes its node's slot over, and the server keeps serving reads and writes.

#![allow(clippy::unwrap_used)]

use suanli_tests as common;

use common::{channel, cpu_job};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::queues_client::QueuesClient;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

/// One reflection request's answer (`grpc.reflection.v1`).
async fn reflect(ch: &tonic::transport::Channel, req: MessageRequest) -> MessageResponse {
    let req = ServerReflectionRequest { host: String::new(), message_request: Some(req) };
    let mut answers = ServerReflectionClient::new(ch.clone())
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    answers.message().await.unwrap().unwrap().message_response.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_are_served() {
    let c = common::start(1, &[]);
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let ch = channel(&c.addrs[0]).await.unwrap();

    let mut health = HealthClient::new(ch.clone());
    for service in std::iter::once("").chain(suanli_server::health::SERVICE_NAMES) {
        let r = health.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        assert_eq!(r.status(), ServingStatus::Serving, "{service:?}");
    }
    let s = health.check(HealthCheckRequest { service: "suanli.v1.Nope".into() }).await.expect_err("unknown");
    assert_eq!(s.code(), Code::NotFound, "{s:?}");

    let MessageResponse::ListServicesResponse(list) = reflect(&ch, MessageRequest::ListServices(String::new())).await
    else {
        panic!("not a list of services");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in ["suanli.v1.Jobs", "suanli.v1.Queues", "suanli.v1.Nodes", "suanli.v1.Agent", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == want), "{want} is not listed: {names:?}");
    }
    // A tool can then fetch the file that defines a service, without a copy of the .proto.
    let MessageResponse::FileDescriptorResponse(files) =
        reflect(&ch, MessageRequest::FileContainingSymbol("suanli.v1.Jobs".into())).await
    else {
        panic!("not a file descriptor");
    };
    assert!(!files.file_descriptor_proto.is_empty());
}

/// A fresh connection's Jobs client (one `Channel` is one HTTP/2 connection).
async fn jobs_on_new_connection(addr: &str) -> JobsClient<tonic::transport::Channel> {
    JobsClient::new(channel(addr).await.unwrap())
}

async fn register(addr: &str, node_id: &str) {
    let node = serde_json::json!({"id": node_id, "pool": "cpu", "cpu_milli": 8000, "memory_mib": 16000});
    let req =
        pb::RegisterNodeRequest { node_json: node.to_string(), agent_version: "test".into(), ..Default::default() };
    // Registration is for the node's own agent (its certificate), not the admin.
    let files = suanli_server::local::LocalPki::get().node(node_id);
    AgentClient::new(suanli_server::local::channel_as(addr, &files).await.unwrap()).register(req).await.unwrap();
}

/// An agent's allocation watch of `node`, opened on a fresh connection (as a restarted agent
/// would), with its first update.
async fn agent_watch(addr: &str, node: &str) -> Result<tonic::Streaming<pb::AllocationsUpdate>, tonic::Status> {
    let files = suanli_server::local::LocalPki::get().node(node);
    let mut agent = AgentClient::new(suanli_server::local::channel_as(addr, &files).await.unwrap());
    let req = pb::WatchAllocationsRequest { node_id: node.into(), from_revision: 0 };
    let mut s = agent.watch_allocations(req).await?.into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), s.message()).await.unwrap().unwrap();
    assert!(first.is_some(), "the watch sends the node's current allocations first");
    Ok(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_filling_its_watch_slots_leaves_agents_theirs() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("server.toml");
    std::fs::write(&cfg, "max_client_watchers = 6\nmax_watchers_per_connection = 2\nmax_agent_watchers = 1\n").unwrap();
    let c = common::start(1, &["--config", cfg.to_str().unwrap(), "--heartbeat-ttl-ms", "600000"]);
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let addr = c.addrs[0].clone();
    let queue = serde_json::json!({"id": "q", "nominal": {"cpu_milli": 64000, "memory_mib": 256000}});
    let ch = channel(&addr).await.unwrap();
    QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: queue.to_string() }).await.unwrap();
    register(&addr, "n1").await;
    register(&addr, "n2").await;

    // A foreign client: on each new connection, watch streams until refused. The refusal
    // names the per-connection limit until the client pool is full, then the pool's.
    let mut held = Vec::new();
    let mut connections = 0;
    loop {
        connections += 1;
        assert!(connections <= 10, "the client pool (6) never filled");
        let mut jobs = jobs_on_new_connection(&addr).await;
        let mut opened = 0;
        let refused = loop {
            match jobs.watch(pb::WatchJobsRequest::default()).await {
                Ok(s) => {
                    held.push(s.into_inner());
                    opened += 1;
                }
                Err(s) => break s,
            }
        };
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        if refused.message().contains("max_client_watchers") {
            assert!(refused.message().contains("the limit is 6"), "{refused:?}");
            assert_eq!(opened, 0, "a connection's streams are refused by the pool only once it is full");
            break;
        }
        assert!(refused.message().contains("max_watchers_per_connection"), "{refused:?}");
        assert!(refused.message().contains("the limit is 2"), "{refused:?}");
        assert_eq!(opened, 2, "each connection gets exactly its limit");
    }
    assert_eq!((held.len(), connections), (6, 4));

    // The agent still gets its stream: agents have their own pool.
    let mut old = agent_watch(&addr, "n1").await.expect("an agent's watch opens while clients hold theirs");
    // A restarted agent of the same node takes its slot over (the pool holds one); the old
    // stream ends.
    let _new = agent_watch(&addr, "n1").await.expect("a re-connect replaces the node's stream");
    let end = tokio::time::timeout(Duration::from_secs(10), old.message()).await.expect("the old stream ends");
    match end {
        Err(s) => assert_eq!(s.code(), Code::Aborted, "{s:?}"),
        Ok(None) => {}
        Ok(Some(u)) => panic!("the replaced stream sent {u:?}"),
    }
    // Another node's stream does not fit the pool of one, and the refusal says why.
    let s = agent_watch(&addr, "n2").await.expect_err("the agent pool holds one");
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(s.message().contains("max_agent_watchers") && s.message().contains("the limit is 1"), "{s:?}");

    // Reads and writes are served.
    let mut jobs = JobsClient::new(ch.clone());
    let req = pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: "w-1".into(),
        spec_json: cpu_job("w", "q", 100),
        retry: None,
    };
    jobs.submit(req).await.unwrap();
    let listed = jobs.list(pb::ListJobsRequest { limit: 10, ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(listed.jobs.len(), 1);
    // The held client streams see that write.
    let ev = tokio::time::timeout(Duration::from_secs(10), held[0].message()).await.unwrap().unwrap();
    assert!(ev.is_some_and(|e| e.job.is_some_and(|j| j.name == "w")));

    // A client stream that ends gives its slot back.
    held.truncate(5);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut jobs = jobs_on_new_connection(&addr).await;
    loop {
        match jobs.watch(pb::WatchJobsRequest::default()).await {
            Ok(_) => break,
            Err(s) if s.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => panic!("a freed client slot was not given back: {s:?}"),
        }
    }
}
