//! Bad input against a real server: each gets a gRPC status naming the field (and the limit
//! where there is one); the server stays up and its state is unchanged.

#![allow(clippy::unwrap_used)]

use suanli_tests as common;

use common::{all_jobs, channel, cpu_job};
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_server::local::ProcessCluster;
use tonic::Code;
use tonic::transport::Channel;

fn submit(rid: &str, spec: String) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: rid.into(),
        spec_json: spec,
        retry: None,
    }
}

async fn state_of(addr: &str) -> (Vec<pb::JobInfo>, Vec<pb::QueueInfo>) {
    let q = QueuesClient::new(channel(addr).await.unwrap())
        .list(pb::ListQueuesRequest { stale: false, ..Default::default() })
        .await;
    (all_jobs(addr, false).await.unwrap(), q.unwrap().into_inner().queues)
}

/// One server with queue `q` (64 cores): the cluster (stops when dropped), its address and a
/// channel to it.
async fn one_server_with_queue() -> (ProcessCluster, String, Channel) {
    let c = common::start(1, &[]);
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let addr = c.addrs[0].clone();
    let ch = channel(&addr).await.unwrap();
    let queue = serde_json::json!({"id": "q", "nominal": {"cpu_milli": 64000, "memory_mib": 256000}});
    QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: queue.to_string() }).await.unwrap();
    (c, addr, ch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_name_the_field_and_change_nothing() {
    let (_c, addr, ch) = one_server_with_queue().await;
    let mut jobs = JobsClient::new(ch.clone());
    jobs.submit(submit("ok-1", cpu_job("ok", "q", 100))).await.unwrap();
    // The scheduler records why the job waits (no nodes); wait for that so the only writer
    // left is the bad requests below.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while all_jobs(&addr, false).await.unwrap().iter().any(|j| j.reason.is_empty()) {
        assert!(std::time::Instant::now() < deadline, "the scheduler never recorded a reason");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = state_of(&addr).await;

    let expect = |r: Result<tonic::Response<pb::SubmitJobResponse>, tonic::Status>, code: Code, words: &[&str]| {
        let s = r.expect_err("must be refused");
        assert_eq!(s.code(), code, "{s:?}");
        for w in words {
            assert!(s.message().contains(w), "{:?} does not name {w:?}", s.message());
        }
    };

    // Malformed spec.
    expect(jobs.submit(submit("bad-1", "{not json".into())).await, Code::InvalidArgument, &["spec_json"]);
    // Missing field.
    expect(
        jobs.submit(submit("bad-2", r#"{"name":"x","queue":"q"}"#.into())).await,
        Code::InvalidArgument,
        &["spec_json", "groups"],
    );
    // A negative quantity.
    let neg = cpu_job("neg", "q", 100).replace("\"cpu_milli\":100", "\"cpu_milli\":-5");
    assert!(neg.contains("-5"), "{neg}");
    expect(
        jobs.submit(submit("bad-3", neg)).await,
        Code::InvalidArgument,
        &["spec_json.groups[0].resources.cpu_milli"],
    );
    // An unknown queue.
    expect(jobs.submit(submit("bad-4", cpu_job("x", "nope", 100))).await, Code::NotFound, &["queue", "nope"]);
    // A spec over the size limit (4 MiB by default).
    let huge = cpu_job(&"x".repeat(4 * 1024 * 1024 + 10), "q", 100);
    expect(jobs.submit(submit("bad-5", huge)).await, Code::ResourceExhausted, &["spec_json", "limit", "4194304"]);
    // A request far over any limit is cut off by the transport, naming the limit.
    let enormous = cpu_job(&"x".repeat(6 * 1024 * 1024), "q", 100);
    let s = jobs.submit(submit("bad-6", enormous)).await.expect_err("too large");
    assert!(s.message().contains("limit"), "{s:?}");
    // Zero replicas and an empty request id (validation in the state machine / the service).
    let zero = cpu_job("zero", "q", 100).replace("\"replicas\":1", "\"replicas\":0");
    expect(jobs.submit(submit("bad-7", zero)).await, Code::InvalidArgument, &["replicas"]);
    expect(jobs.submit(submit("", cpu_job("x", "q", 100))).await, Code::InvalidArgument, &["client_request_id"]);
    // Unknown job state filter, unknown node mode, bad node and queue documents.
    let s = jobs
        .list(pb::ListJobsRequest { states: vec!["sleeping".into()], ..Default::default() })
        .await
        .expect_err("bad filter");
    assert!(s.message().contains("states[0]"), "{s:?}");
    let s = NodesClient::new(ch.clone())
        .set_mode(pb::SetNodeModeRequest { id: "n".into(), mode: 42, ..Default::default() })
        .await
        .expect_err("bad mode");
    assert!(s.message().starts_with("mode"), "{s:?}");
    // Agent calls need an agent's certificate (here the server's, which may call anything).
    let server_cert = suanli_server::local::LocalPki::get().server();
    let as_server = suanli_server::local::channel_as(&addr, &server_cert).await.unwrap();
    let s = AgentClient::new(as_server)
        .register(pb::RegisterNodeRequest {
            node_json: r#"{"id":"n","pool":"p","cpu_milli":-1}"#.into(),
            ..Default::default()
        })
        .await
        .expect_err("bad node");
    assert!(s.message().contains("node_json.cpu_milli"), "{s:?}");
    let s = QueuesClient::new(ch.clone())
        .upsert(pb::UpsertQueueRequest { queue_json: r#"{"id":"q2","nominal":{"gpu_milli":"lots"}}"#.into() })
        .await
        .expect_err("bad queue");
    assert!(s.message().contains("queue_json.nominal.gpu_milli"), "{s:?}");

    // The server is up, and nothing changed.
    assert_eq!(state_of(&addr).await, before, "a refused request changed the state");
    jobs.submit(submit("ok-2", cpu_job("ok2", "q", 100))).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_many_answers_each_job_on_its_own() {
    let (_c, addr, ch) = one_server_with_queue().await;
    let mut jobs = JobsClient::new(ch);
    let req = pb::SubmitJobsRequest {
        jobs: vec![
            submit("m-1", cpu_job("a", "q", 100)),
            submit("m-2", "{not json".into()),
            submit("m-3", cpu_job("b", "nope", 100)),
            submit("m-4", cpu_job("c", "q", 100)),
        ],
    };
    let r = jobs.submit_many(req.clone()).await.unwrap().into_inner().results;
    assert_eq!(r.len(), 4, "{r:?}");
    assert_eq!((r[0].code, r[0].created), (0, true), "{r:?}");
    assert_eq!(r[1].code, Code::InvalidArgument as i32, "{r:?}");
    assert!(r[1].message.contains("jobs[1]") && r[1].message.contains("spec_json"), "{r:?}");
    assert_eq!(r[2].code, Code::NotFound as i32, "{r:?}");
    assert!(r[2].message.contains("jobs[2]") && r[2].message.contains("nope"), "{r:?}");
    assert_eq!((r[3].code, r[3].created), (0, true), "{r:?}");
    assert_ne!(r[3].job_id, r[0].job_id);
    // The whole call retried (say after a timeout): the same jobs, nothing created twice.
    let again = jobs.submit_many(req).await.unwrap().into_inner().results;
    assert_eq!((again[0].job_id, again[0].created), (r[0].job_id, false));
    assert_eq!((again[3].job_id, again[3].created), (r[3].job_id, false));
    assert_eq!(all_jobs(&addr, false).await.unwrap().len(), 2);
    // Bounds: at least one job, at most 1024, each named with its limit.
    let s = jobs.submit_many(pb::SubmitJobsRequest { jobs: vec![] }).await.expect_err("empty");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("jobs"), "{s:?}");
    let many = (0..1025).map(|i| submit(&format!("x-{i}"), cpu_job("x", "q", 1))).collect();
    let s = jobs.submit_many(pb::SubmitJobsRequest { jobs: many }).await.expect_err("too many");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("jobs") && s.message().contains("1024"), "{s:?}");
    assert_eq!(all_jobs(&addr, false).await.unwrap().len(), 2, "a refused call changed nothing");
}

/// Jobs near the task size limit (64 KiB each) submitted together: each fits the 4 MiB
/// command limit alone, but a group commit of them would not, so the server splits the group
/// (before, every job of the group was refused as "command is N bytes").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_specs_submitted_together_are_each_accepted() {
    let (_c, _addr, ch) = one_server_with_queue().await;
    let env: serde_json::Map<String, serde_json::Value> =
        (0..60).map(|i| (format!("V{i}"), serde_json::Value::String("x".repeat(1000)))).collect();
    let spec = |i: usize| {
        serde_json::json!({
            "name": format!("big-{i}"), "queue": "q",
            "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 1, "memory_mib": 1},
                        "task": {"command": "true", "env": env}}]
        })
        .to_string()
    };
    let calls = (0..4).map(|c| {
        let jobs = (0..40).map(|i| submit(&format!("big-{c}-{i}"), spec(c * 40 + i))).collect();
        let mut client = JobsClient::new(ch.clone());
        tokio::spawn(async move { client.submit_many(pb::SubmitJobsRequest { jobs }).await })
    });
    let mut ids = std::collections::BTreeSet::new();
    for call in calls.collect::<Vec<_>>() {
        for r in call.await.unwrap().unwrap().into_inner().results {
            assert_eq!((r.code, r.created), (0, true), "{r:?}");
            ids.insert(r.job_id);
        }
    }
    assert_eq!(ids.len(), 160);
}

/// What a foreign client (raw gRPC, no CLI) writes is checked as strictly as the CLI checks a
/// file: unknown fields, unbounded or unprintable names, a parent queue, a reused request id
/// with another retry policy and an oversized request are each refused with the exact code, a
/// short message naming the field, and the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_clients_get_the_strict_input_path() {
    let (_c, addr, ch) = one_server_with_queue().await;
    let mut jobs = JobsClient::new(ch.clone());
    let mut queues = QueuesClient::new(ch.clone());
    let refused = |s: tonic::Status, code: Code, words: &[&str]| {
        assert_eq!(s.code(), code, "{s:?}");
        assert!(s.message().len() < 1024, "a {}-byte message", s.message().len());
        for w in words {
            assert!(s.message().contains(w), "{:?} does not name {w:?}", s.message());
        }
    };
    let upsert = |q: serde_json::Value| pb::UpsertQueueRequest { queue_json: q.to_string() };
    let mb = "x".repeat(1 << 20);

    // Unknown fields: `replica` for `replicas`, `gpus` for `devices`, a queue's `weigth`.
    let replica = cpu_job("j", "q", 100).replace("\"replicas\":1", "\"replica\":2");
    let s = jobs.submit(submit("u-1", replica)).await.expect_err("replica");
    refused(s, Code::InvalidArgument, &["spec_json.groups[0].replica", "unknown field"]);
    let gpus = cpu_job("j", "q", 100).replace("\"memory_mib\":64", "\"memory_mib\":64,\"gpus\":4");
    let s = jobs.submit(submit("u-2", gpus)).await.expect_err("gpus");
    refused(s, Code::InvalidArgument, &["spec_json.groups[0].resources.gpus", "unknown field"]);
    let s = queues.upsert(upsert(serde_json::json!({"id": "w", "weigth": 3}))).await.expect_err("weigth");
    refused(s, Code::InvalidArgument, &["queue_json.weigth", "unknown field"]);

    // Unbounded and unprintable names; messages quote a bounded prefix at most.
    let s = queues.upsert(upsert(serde_json::json!({"id": "t", "team": mb}))).await.expect_err("1 MB team");
    refused(s, Code::InvalidArgument, &["queue.team", "1048576 bytes", "at most 253"]);
    let s = queues.upsert(upsert(serde_json::json!({"id": "defa\u{200b}ult"}))).await.expect_err("zero width");
    refused(s, Code::InvalidArgument, &["queue.id", "zero-width"]);
    let s = queues.upsert(upsert(serde_json::json!({"id": "t", "team": "a\u{1b}[31m"}))).await.expect_err("escape");
    refused(s, Code::InvalidArgument, &["queue.team", "control character"]);
    let mut label = serde_json::from_str::<serde_json::Value>(&cpu_job("j", "q", 100)).unwrap();
    label["constraints"] = serde_json::json!({"labels": {"k": mb}});
    let s = jobs.submit(submit("u-3", label.to_string())).await.expect_err("1 MB label value");
    refused(s, Code::InvalidArgument, &["constraints.labels.k: 1048576 bytes", "at most 256"]);
    let s = jobs.submit(submit(&mb, cpu_job("j", "q", 100))).await.expect_err("1 MB request id");
    refused(s, Code::InvalidArgument, &["client_request_id", "at most 128"]);
    let s = jobs.submit(submit("id\u{1b}]0;x\u{7}", cpu_job("j", "q", 100))).await.expect_err("escape in id");
    refused(s, Code::InvalidArgument, &["client_request_id", "control character"]);
    let s = jobs.get(pb::GetJobRequest { job_id: 999, stale: false }).await.expect_err("unknown job");
    refused(s, Code::NotFound, &["999"]);
    let s = queues.get(pb::GetQueueRequest { id: mb.clone(), stale: false }).await.expect_err("unknown queue");
    refused(s, Code::NotFound, &["id", "1048576 bytes"]);

    // Jobs go to leaf queues only.
    queues.upsert(upsert(serde_json::json!({"id": "org", "nominal": {"cpu_milli": 1000}}))).await.unwrap();
    queues.upsert(upsert(serde_json::json!({"id": "org-a", "parent": "org"}))).await.unwrap();
    let s = jobs.submit(submit("p-1", cpu_job("j", "org", 100))).await.expect_err("parent queue");
    refused(s, Code::FailedPrecondition, &["queue", "org", "leaf"]);

    // The same request id and spec with another retry policy is another request.
    let first = jobs.submit(submit("r-1", cpu_job("r", "q", 100))).await.unwrap().into_inner();
    assert!(first.created);
    let again = jobs.submit(submit("r-1", cpu_job("r", "q", 100))).await.unwrap().into_inner();
    assert_eq!((again.job_id, again.created), (first.job_id, false));
    let retry = pb::RetryPolicy { max_attempts: 1, backoff_base_s: 0, backoff_max_s: 0 };
    let other = pb::SubmitJobRequest { retry: Some(retry), ..submit("r-1", cpu_job("r", "q", 100)) };
    let s = jobs.submit(other).await.expect_err("another retry policy");
    refused(s, Code::FailedPrecondition, &["client_request_id", "retry policy"]);

    // Free text: a cancel reason with terminal escapes is refused.
    let s = jobs
        .cancel(pb::CancelJobRequest { job_id: first.job_id, reason: "done\u{1b}[2J".into() })
        .await
        .expect_err("escape in reason");
    refused(s, Code::InvalidArgument, &["reason", "control character"]);

    // A request over the transport's limit: RESOURCE_EXHAUSTED, as api.proto promises.
    let enormous = cpu_job(&"x".repeat(6 * 1024 * 1024), "q", 100);
    let s = jobs.submit(submit("big", enormous)).await.expect_err("too large");
    refused(s, Code::ResourceExhausted, &["limit"]);

    // The server still serves: a valid submit, a cancel with a plain reason, and a list.
    let ok = jobs.submit(submit("ok-3", cpu_job("ok3", "q", 100))).await.unwrap().into_inner();
    assert!(ok.created);
    jobs.cancel(pb::CancelJobRequest { job_id: first.job_id, reason: "no longer needed".into() }).await.unwrap();
    let all = all_jobs(&addr, false).await.unwrap();
    assert_eq!(all.len(), 2, "{all:?}");
    let names: Vec<_> =
        queues.list(pb::ListQueuesRequest { stale: false, ..Default::default() }).await.unwrap().into_inner().queues;
    assert_eq!(names.iter().map(|q| q.id.as_str()).collect::<Vec<_>>(), ["org", "org-a", "q"]);
}
