//! The client commands against fake in-process gRPC servers: a follower that answers
//! UNAVAILABLE naming the leader in `suanli-leader` metadata, and a leader that pages job lists,
//! de-duplicates submissions by request id and streams watch events.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Output;
use std::sync::Mutex;
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_server::{Jobs, JobsServer};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// A follower: refuses everything, naming the leader.
struct Follower {
    leader: String,
}

fn redirect(leader: &str) -> Status {
    let mut s = Status::unavailable("not the leader");
    if let Ok(v) = leader.parse() {
        s.metadata_mut().insert("suanli-leader", v);
    }
    s
}

/// The leader: jobs 1..=5, submissions de-duplicated by request id.
#[derive(Default)]
struct Leader {
    submitted: Mutex<BTreeMap<String, u64>>,
}

fn job(id: u64) -> pb::JobInfo {
    pb::JobInfo {
        id,
        name: format!("job-{id}"),
        queue: "team-a".into(),
        state: "running".into(),
        spec_json: "{\"name\":\"x\"}".into(),
        allocs: vec![pb::AllocInfo {
            id: 100 + id,
            job_id: id,
            node: "gpu-a-001".into(),
            state: "running".into(),
            desired: "run".into(),
            cpu_milli: 8000,
            memory_mib: 65536,
            devices: vec![pb::DeviceShare { device: "GPU-0".into(), milli: 1000, memory_mib: 0 }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

type EventStream =
    std::pin::Pin<Box<dyn tonic::codegen::tokio_stream::Stream<Item = Result<pb::JobEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Jobs for Follower {
    async fn submit(&self, _: Request<pb::SubmitJobRequest>) -> Result<Response<pb::SubmitJobResponse>, Status> {
        Err(redirect(&self.leader))
    }
    async fn get(&self, _: Request<pb::GetJobRequest>) -> Result<Response<pb::JobInfo>, Status> {
        Err(redirect(&self.leader))
    }
    async fn list(&self, _: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        Err(redirect(&self.leader))
    }
    async fn cancel(&self, _: Request<pb::CancelJobRequest>) -> Result<Response<pb::CancelJobResponse>, Status> {
        Err(redirect(&self.leader))
    }
    type WatchStream = EventStream;
    async fn watch(&self, _: Request<pb::WatchJobsRequest>) -> Result<Response<EventStream>, Status> {
        Err(redirect(&self.leader))
    }
}

#[tonic::async_trait]
impl Jobs for Leader {
    async fn submit(&self, r: Request<pb::SubmitJobRequest>) -> Result<Response<pb::SubmitJobResponse>, Status> {
        let r = r.into_inner();
        let spec: serde_json::Value =
            serde_json::from_str(&r.spec_json).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if spec["name"] == "refuse-me" {
            return Err(Status::invalid_argument("queue: no such queue \"nope\""));
        }
        let mut m = self.submitted.lock().map_err(|_| Status::internal("poisoned"))?;
        let n = m.len() as u64;
        let created = !m.contains_key(&r.client_request_id);
        let id = *m.entry(r.client_request_id).or_insert(n + 10);
        Ok(Response::new(pb::SubmitJobResponse { job_id: id, created, revision: 3 }))
    }
    async fn get(&self, r: Request<pb::GetJobRequest>) -> Result<Response<pb::JobInfo>, Status> {
        match r.into_inner().job_id {
            id @ 1..=5 => Ok(Response::new(job(id))),
            id => Err(Status::not_found(format!("job {id} not found"))),
        }
    }
    async fn list(&self, r: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        // Pages of at most 2, whatever the client asks.
        let r = r.into_inner();
        let jobs: Vec<pb::JobInfo> = (r.after_id + 1..=5).take(2.min(r.limit as usize)).map(job).collect();
        let next = jobs.last().map(|j| j.id).filter(|&id| id < 5).unwrap_or(0);
        Ok(Response::new(pb::ListJobsResponse { jobs, next_after_id: next }))
    }
    async fn cancel(&self, _: Request<pb::CancelJobRequest>) -> Result<Response<pb::CancelJobResponse>, Status> {
        Ok(Response::new(pb::CancelJobResponse {}))
    }
    type WatchStream = EventStream;
    async fn watch(&self, _: Request<pb::WatchJobsRequest>) -> Result<Response<EventStream>, Status> {
        let events = vec![
            Ok(pb::JobEvent { revision: 7, job: Some(job(1)), removed: false }),
            Ok(pb::JobEvent { revision: 8, job: Some(job(2)), removed: true }),
        ];
        Ok(Response::new(Box::pin(tonic::codegen::tokio_stream::iter(events))))
    }
}

/// Starts a follower and a leader on free ports; returns their addresses.
fn start() -> (tokio::runtime::Runtime, SocketAddr, SocketAddr) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let (f, l) = rt.block_on(async {
        let li = TcpIncoming::bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let fi = TcpIncoming::bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let (la, fa) = (li.local_addr().expect("addr"), fi.local_addr().expect("addr"));
        tokio::spawn(
            tonic::transport::Server::builder().add_service(JobsServer::new(Leader::default())).serve_with_incoming(li),
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(JobsServer::new(Follower { leader: la.to_string() }))
                .serve_with_incoming(fi),
        );
        (fa, la)
    });
    (rt, f, l)
}

fn suanli(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_suanli")).args(args).output().expect("run suanli")
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const SPEC: &str = "name = \"t\"\nqueue = \"team-a\"\n[[groups]]\nname = \"w\"\n[groups.resources]\ncpu_milli = 1000\n";

#[test]
fn client_follows_the_leader_and_pages() {
    let (_rt, follower, _leader) = start();
    let dead = "127.0.0.1:1";
    // A dead address first, then the follower, which names the leader.
    let servers = format!("{dead},{follower}");
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("job.toml");
    std::fs::write(&spec, SPEC).expect("write");
    let spec = spec.display().to_string();

    let out = ok(&suanli(&["job", "submit", &spec, "--request-id", "r-1", "--server", &servers, "--output", "json"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!((v["job_id"].as_u64(), v["created"].as_bool()), (Some(10), Some(true)), "{out}");
    let out = ok(&suanli(&["job", "submit", &spec, "--request-id", "r-1", "--server", &servers]));
    assert!(out.contains("job 10 already submitted"), "{out}");
    let out = ok(&suanli(&["job", "submit", &spec, "--server", &servers]));
    assert!(out.contains("job 11 submitted"), "{out}");

    // The leader pages by 2: the client follows next_after_id up to the limit.
    let out = ok(&suanli(&["job", "list", "--server", &servers, "--output", "json"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(5), "{out}");
    let out = ok(&suanli(&["job", "list", "--limit", "3", "--server", &servers]));
    assert_eq!(out.lines().count(), 4, "header + 3 rows: {out}");
    assert!(out.starts_with("ID  NAME   QUEUE   STATE"), "{out}");

    let out = ok(&suanli(&["job", "status", "3", "--server", &servers]));
    assert!(out.contains("gpu-a-001") && out.contains("GPU-0") && out.contains("64Gi"), "{out}");
    let o = suanli(&["job", "status", "9", "--server", &servers]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("error: NOT_FOUND: job 9 not found"));

    let bad = dir.path().join("refused.toml");
    std::fs::write(&bad, SPEC.replace("name = \"t\"", "name = \"refuse-me\"")).expect("write");
    let o = suanli(&["job", "submit", &bad.display().to_string(), "--server", &servers]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("error: INVALID_ARGUMENT: queue: no such queue"));

    ok(&suanli(&["job", "cancel", "2", "--server", &servers]));

    let out = ok(&suanli(&["job", "watch", "--server", &servers]));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with("rev 7 job 1 job-1") && lines[1].contains("removed"), "{out}");
    let out = ok(&suanli(&["job", "watch", "1", "--server", &servers, "--output", "json"]));
    for l in out.lines() {
        let v: serde_json::Value = serde_json::from_str(l).expect("one JSON object per line");
        assert!(v["revision"].is_u64());
    }
}

#[test]
fn env_addr_is_used() {
    let (_rt, follower, _leader) = start();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_suanli"))
        .args(["job", "status", "1"])
        .env("SUANLI_ADDR", follower.to_string())
        .output()
        .expect("run");
    assert!(ok(&o).contains("job-1"));
}
