//! The client API (`Jobs`, `Queues`, `Pools`, `Nodes`, `Cluster`) and the server-to-server
//! `Internal` service, over the shared [`Core`].

use crate::convert::{self, JobView};
use crate::core::Core;
use crate::page::{self, Page};
use crate::status::{decode_json, invalid, invalid_model, unavailable};
use std::collections::BTreeSet;
use std::ops::Bound;
use std::sync::Arc;
use std::time::Duration;
use suanli_model::error::{check_name, check_text, check_value, quote};
use suanli_model::{JobId, JobSpec, NodeId, PoolId, Queue, QueueId};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::cluster_server::Cluster;
use suanli_proto::v1::internal_server::Internal;
use suanli_proto::v1::jobs_server::Jobs;
use suanli_proto::v1::nodes_server::Nodes;
use suanli_proto::v1::pools_server::Pools;
use suanli_proto::v1::queues_server::Queues;
use suanli_raft::ServerNode;
use suanli_raft::membership::{self, check_addr};
use suanli_state::{
    CancelJob, ClearQuarantine, Command, DeleteQueue, MigrateJob, Response, SetNodeMode, SubmitJob, UpdateConfig,
    UpdateService, UpsertQueue,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status};

type Resp<T> = Result<tonic::Response<T>, Status>;

fn ok<T>(v: T) -> Resp<T> {
    Ok(tonic::Response::new(v))
}

/// Every client-facing service, cloned into each tonic server.
#[derive(Clone)]
pub struct Api(pub Arc<Core>, pub crate::batch::Batcher);

/// Most jobs in one `SubmitMany` call.
pub use suanli_proto::MAX_JOBS_PER_CALL;

/// Metadata a server sets on a read it forwards to the leader, so the call is answered where
/// it lands and never forwarded a second time.
const FORWARDED: &str = "suanli-forwarded";

/// A refused job of a `SubmitMany` call: its status, the field path prefixed with its place.
fn refused(s: &Status, i: usize) -> pb::SubmitJobResult {
    pb::SubmitJobResult {
        code: s.code() as i32,
        message: format!("jobs[{i}]: {}", s.message()),
        job_id: 0,
        created: false,
        revision: 0,
    }
}

/// The answer to one committed submission (a refusal becomes its status).
fn submitted(resp: Response, index: u64) -> Result<pb::SubmitJobResponse, Status> {
    if let Some(e) = resp.rejection() {
        return Err(crate::status::rejection(e));
    }
    match resp {
        Response::JobSubmitted { job, created } => {
            Ok(pb::SubmitJobResponse { job_id: job.0, created, revision: index, global_id: String::new() })
        }
        other => Err(Status::internal(format!("unexpected answer to a submission: {other:?}"))),
    }
}

const JOB_STATES: [&str; 8] =
    ["pending", "placed", "running", "preempted", "requeuing", "succeeded", "failed", "cancelled"];

#[tonic::async_trait]
impl Jobs for Api {
    async fn submit(&self, req: Request<pb::SubmitJobRequest>) -> Resp<pb::SubmitJobResponse> {
        if req.get_ref().global {
            let who = crate::access_api::caller(&req);
            // The federated job's trace: the caller's, or a new one when this server traces;
            // every region job of it joins that trace (docs/tracing.md).
            let trace = match crate::telemetry::caller_parent(req.metadata()) {
                Some(p) => Some(crate::telemetry::format_traceparent(&p)),
                None => crate::telemetry::new_job_root(None),
            };
            return self.submit_global(&who, req.into_inner(), trace).await;
        }
        let (caller, started) = (crate::telemetry::caller_parent(req.metadata()), std::time::SystemTime::now());
        let cmd = self.submit_command(req.into_inner(), caller.as_ref())?;
        let (resp, index) = self.1.propose(cmd).await?;
        let answer = submitted(resp, index)?;
        if answer.created {
            self.0.kick.notify_one();
            trace_submitted(&self.0, answer.job_id, started, index);
        }
        ok(answer)
    }

    async fn submit_many(&self, req: Request<pb::SubmitJobsRequest>) -> Resp<pb::SubmitJobsResponse> {
        let (caller, started) = (crate::telemetry::caller_parent(req.metadata()), std::time::SystemTime::now());
        let jobs = req.into_inner().jobs;
        if jobs.is_empty() {
            return Err(invalid("jobs", "must hold at least one job"));
        }
        if jobs.len() > MAX_JOBS_PER_CALL {
            return Err(invalid("jobs", format!("{} jobs; the limit is {MAX_JOBS_PER_CALL} per call", jobs.len())));
        }
        let mut results: Vec<Option<pb::SubmitJobResult>> = vec![None; jobs.len()];
        let (mut at, mut cmds) = (Vec::new(), Vec::new());
        for (i, j) in jobs.into_iter().enumerate() {
            match self.submit_command(j, caller.as_ref()) {
                Ok(c) => {
                    at.push(i);
                    cmds.push(c);
                }
                Err(s) => results[i] = Some(refused(&s, i)),
            }
        }
        let mut created = false;
        for (i, a) in at.into_iter().zip(self.1.propose_many(cmds).await) {
            results[i] = Some(match a.and_then(|(resp, index)| submitted(resp, index)) {
                Ok(r) => {
                    created |= r.created;
                    if r.created {
                        trace_submitted(&self.0, r.job_id, started, r.revision);
                    }
                    pb::SubmitJobResult {
                        code: 0,
                        message: String::new(),
                        job_id: r.job_id,
                        created: r.created,
                        revision: r.revision,
                    }
                }
                Err(s) => refused(&s, i),
            });
        }
        if created {
            self.0.kick.notify_one();
        }
        ok(pb::SubmitJobsResponse { results: results.into_iter().flatten().collect() })
    }

    async fn get(&self, req: Request<pb::GetJobRequest>) -> Resp<pb::JobInfo> {
        let r = req.into_inner();
        let info = self
            .0
            .read(r.stale, |s| {
                s.job(JobId(r.job_id)).map(|j| convert::job(s, j, convert::queue_position(s, j), JobView::Full))
            })
            .await?;
        let mut info = info.ok_or_else(|| Status::not_found(format!("job_id: unknown job {}", r.job_id)))?;
        // A job with very many allocations, each carrying its task, could outgrow the reply:
        // the spec always fits (it came in one request), the allocations are cut.
        convert::fit_job(&mut info, self.0.cfg.max_reply_bytes().saturating_sub(1024));
        ok(info)
    }

    async fn list(&self, req: Request<pb::ListJobsRequest>) -> Resp<pb::ListJobsResponse> {
        let r = req.into_inner();
        let mut states = Vec::new();
        for (i, st) in r.states.iter().enumerate() {
            match JOB_STATES.iter().position(|x| x == st) {
                Some(_) => states.push(st.clone()),
                None => {
                    return Err(invalid(
                        &format!("states[{i}]"),
                        format!("unknown state {st:?}; one of {}", JOB_STATES.join(", ")),
                    ));
                }
            }
        }
        let mut page = self.page(r.limit);
        let queue = r.queue;
        let after = r.after_id;
        let page = self
            .0
            .read(r.stale, |s| {
                let jobs = s
                    .jobs()
                    .range((Bound::Excluded(JobId(after)), Bound::Unbounded))
                    .map(|(_, j)| j)
                    .filter(|j| queue.is_empty() || j.spec.queue.0 == queue)
                    .filter(|j| states.is_empty() || states.iter().any(|x| x == j.state.as_str()));
                let max_bytes = page.max_bytes();
                for j in jobs {
                    let summary = || {
                        let mut info = convert::job(s, j, 0, JobView::Summary);
                        convert::fit_job(&mut info, max_bytes);
                        info
                    };
                    if !page.offer(summary) {
                        break;
                    }
                }
                page
            })
            .await?;
        let (jobs, next) = page.finish(|j| j.id);
        ok(pb::ListJobsResponse { jobs, next_after_id: next.unwrap_or(0) })
    }

    async fn cancel(&self, req: Request<pb::CancelJobRequest>) -> Resp<pb::CancelJobResponse> {
        let r = req.into_inner();
        let max = self.0.state.read(|s| s.config().max_message_len);
        check_text(|| "reason".into(), &r.reason, max).map_err(|e| invalid_model(&e))?;
        let live = crate::telemetry::enabled()
            && self.0.state.read(|s| s.job(JobId(r.job_id)).is_some_and(|j| !j.state.is_terminal()));
        let cmd = Command::CancelJob(CancelJob { job: JobId(r.job_id), reason: r.reason, now: self.0.now_s() });
        let (_, index) = self.0.propose(cmd).await?;
        self.0.kick.notify_one();
        if live {
            let mut applied = self.0.state.subscribe();
            let _ = tokio::time::timeout(Duration::from_secs(1), applied.wait_for(|i| *i >= index)).await;
            let now = self.0.now_s();
            self.0.state.read(|s| match s.job(JobId(r.job_id)) {
                Some(j) if j.state.is_terminal() => crate::telemetry::job_ended(s, j, now),
                _ => {}
            });
        }
        ok(pb::CancelJobResponse {})
    }

    type WatchStream = ReceiverStream<Result<pb::JobEvent, Status>>;

    async fn migrate(&self, req: Request<pb::MigrateJobRequest>) -> Resp<pb::MigrateJobResponse> {
        let r = req.into_inner();
        let max = self.0.state.read(|s| s.config().limits.max_name_len);
        let target = |field: &'static str, v: &str| -> Result<Option<String>, Status> {
            if v.is_empty() {
                return Ok(None);
            }
            check_name(|| field.into(), v, max).map_err(|e| invalid_model(&e))?;
            Ok(Some(v.to_owned()))
        };
        let cmd = Command::MigrateJob(MigrateJob {
            job: JobId(r.job_id),
            to_pool: target("to_pool", &r.to_pool)?.map(PoolId),
            to_node: target("to_node", &r.to_node)?.map(NodeId),
            now: self.0.now_s(),
        });
        self.0.propose(cmd).await?;
        self.0.kick.notify_one();
        // Applied here before `propose` answered (a forwarded write waits for it): the job's
        // revision now is its migration's or a later one.
        let revision = self.0.state.read(|s| s.job(JobId(r.job_id)).map_or(s.revision(), |j| j.revision));
        ok(pb::MigrateJobResponse { revision })
    }

    async fn update_service(&self, req: Request<pb::UpdateServiceRequest>) -> Resp<pb::UpdateServiceResponse> {
        let r = req.into_inner();
        let spec: JobSpec = decode_json("spec_json", &r.spec_json, self.0.cfg.max_request_bytes)?;
        let cmd = Command::UpdateService(Box::new(UpdateService { job: JobId(r.job_id), spec, now: self.0.now_s() }));
        self.0.propose(cmd).await?;
        self.0.kick.notify_one();
        let (revision, version) =
            self.0.state.read(|s| s.job(JobId(r.job_id)).map_or((s.revision(), 0), |j| (j.revision, j.version)));
        ok(pb::UpdateServiceResponse { revision, version })
    }

    async fn watch(&self, req: Request<pb::WatchJobsRequest>) -> Resp<Self::WatchStream> {
        // A connection is its peer's socket address: its streams are bounded on their own.
        let permit = self.0.watchers.client(crate::core::remote_of(&req))?;
        let r = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let core = self.0.clone();
        let reply_limit = core.cfg.max_reply_bytes().saturating_sub(1024);
        tokio::spawn(async move {
            let _permit = permit;
            let mut applied = core.state.subscribe();
            let mut last = r.from_revision;
            let mut seen_single = false;
            loop {
                let events: Vec<pb::JobEvent> = core.state.read(|s| {
                    // Each event is one message: a job's allocations are cut at the reply limit.
                    let whole = |j| {
                        let mut info = convert::job(s, j, 0, JobView::Full);
                        convert::fit_job(&mut info, reply_limit);
                        info
                    };
                    if r.job_id != 0 {
                        return match s.job(JobId(r.job_id)) {
                            Some(j) if j.revision > last || (last == 0 && !seen_single) => {
                                vec![pb::JobEvent { revision: j.revision, job: Some(whole(j)), removed: false }]
                            }
                            Some(_) => Vec::new(),
                            None if seen_single => vec![pb::JobEvent {
                                revision: s.revision(),
                                job: Some(pb::JobInfo { id: r.job_id, ..Default::default() }),
                                removed: true,
                            }],
                            None => Vec::new(),
                        };
                    }
                    let mut v: Vec<_> = s
                        .jobs()
                        .values()
                        .filter(|j| j.revision > last)
                        .map(|j| pb::JobEvent { revision: j.revision, job: Some(whole(j)), removed: false })
                        .collect();
                    v.sort_by_key(|e| e.revision);
                    v
                });
                for e in events {
                    if e.removed {
                        let _ = tx.send(Ok(e)).await;
                        return;
                    }
                    last = last.max(e.revision);
                    seen_single = true;
                    if tx.send(Ok(e)).await.is_err() {
                        return;
                    }
                }
                if r.job_id != 0 && !seen_single && core.state.read(|s| s.job(JobId(r.job_id)).is_none()) {
                    let _ = tx.send(Err(Status::not_found(format!("job_id: unknown job {}", r.job_id)))).await;
                    return;
                }
                tokio::select! {
                    c = applied.changed() => if c.is_err() { return },
                    () = tx.closed() => return,
                }
                // Coalesce bursts of commits into one scan.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        ok(ReceiverStream::new(rx))
    }
}

#[tonic::async_trait]
impl Queues for Api {
    async fn upsert(&self, req: Request<pb::UpsertQueueRequest>) -> Resp<pb::UpsertQueueResponse> {
        let q: Queue = decode_json("queue_json", &req.into_inner().queue_json, self.0.cfg.max_request_bytes)?;
        self.0.propose(Command::UpsertQueue(UpsertQueue { queue: q })).await?;
        self.0.kick.notify_one();
        ok(pb::UpsertQueueResponse {})
    }

    async fn delete(&self, req: Request<pb::DeleteQueueRequest>) -> Resp<pb::DeleteQueueResponse> {
        let id = req.into_inner().id;
        self.0.propose(Command::DeleteQueue(DeleteQueue { queue: QueueId(id) })).await?;
        ok(pb::DeleteQueueResponse {})
    }

    async fn get(&self, req: Request<pb::GetQueueRequest>) -> Resp<pb::QueueInfo> {
        let r = req.into_inner();
        let id = QueueId(r.id.clone());
        let q = self.0.read(r.stale, |s| convert::queue(s, &id)).await?;
        q.map_or_else(|| Err(Status::not_found(format!("id: unknown queue {}", quote(&r.id)))), ok)
    }

    async fn list(&self, req: Request<pb::ListQueuesRequest>) -> Resp<pb::ListQueuesResponse> {
        let r = req.into_inner();
        let mut page = self.page(r.limit);
        let after = QueueId(r.after);
        let page = self
            .0
            .read(r.stale, |s| {
                for id in s.queues().range((after_bound(&after), Bound::Unbounded)).map(|(id, _)| id) {
                    let Some(q) = convert::queue(s, id) else { continue };
                    if !page.offer(|| q) {
                        break;
                    }
                }
                page
            })
            .await?;
        let (queues, next) = page.finish(|q| q.id.clone());
        ok(pb::ListQueuesResponse { queues, next_after: next.unwrap_or_default() })
    }
}

#[tonic::async_trait]
impl Pools for Api {
    async fn list(&self, req: Request<pb::ListPoolsRequest>) -> Resp<pb::ListPoolsResponse> {
        let r = req.into_inner();
        let mut page = self.page(r.limit);
        // Pools are not records of their own: each is summed over its nodes, in name order.
        for p in self.0.read(r.stale, convert::pools).await? {
            if !r.after.is_empty() && p.name <= r.after {
                continue;
            }
            if !page.offer(|| p) {
                break;
            }
        }
        let (pools, next) = page.finish(|p| p.name.clone());
        ok(pb::ListPoolsResponse { pools, next_after: next.unwrap_or_default() })
    }
}

#[tonic::async_trait]
impl Nodes for Api {
    async fn list(&self, req: Request<pb::ListNodesRequest>) -> Resp<pb::ListNodesResponse> {
        let r = req.into_inner();
        let mut page = self.page(r.limit);
        let after = NodeId(r.after);
        let page = self
            .0
            .read(r.stale, |s| {
                let nodes = s
                    .nodes()
                    .range((after_bound(&after), Bound::Unbounded))
                    .map(|(_, n)| n)
                    .filter(|n| r.pool.is_empty() || n.node.pool.0 == r.pool);
                for n in nodes {
                    let info = || {
                        let mut info = convert::node(s, n);
                        // The stats lock is never held while the state is read elsewhere.
                        info.stats = self.0.stats_of(&n.node.id);
                        info
                    };
                    if !page.offer(info) {
                        break;
                    }
                }
                page
            })
            .await?;
        let (nodes, next) = page.finish(|n| n.id.clone());
        ok(pb::ListNodesResponse { nodes, next_after: next.unwrap_or_default() })
    }

    async fn get(&self, req: Request<pb::GetNodeRequest>) -> Resp<pb::NodeInfo> {
        let r = req.into_inner();
        let id = NodeId(r.id.clone());
        let n = self.0.read(r.stale, |s| s.nodes().get(&id).map(|n| convert::node(s, n))).await?;
        let mut n = n.ok_or_else(|| Status::not_found(format!("id: unknown node {}", quote(&r.id))))?;
        n.stats = self.0.stats_of(&id);
        ok(n)
    }

    async fn set_mode(&self, req: Request<pb::SetNodeModeRequest>) -> Resp<pb::SetNodeModeResponse> {
        let r = req.into_inner();
        let mode = match pb::NodeMode::try_from(r.mode) {
            Ok(pb::NodeMode::Schedulable) => suanli_state::NodeMode::Schedulable,
            Ok(pb::NodeMode::Cordoned) => suanli_state::NodeMode::Cordoned,
            Ok(pb::NodeMode::Draining) => suanli_state::NodeMode::Draining,
            _ => return Err(invalid("mode", format!("{} is not one of schedulable, cordoned, draining", r.mode))),
        };
        const MAX_GRACE_S: u64 = 366 * 24 * 3600;
        if r.grace_s > MAX_GRACE_S {
            return Err(invalid("grace_s", format!("{} s is more than a year ({MAX_GRACE_S} s)", r.grace_s)));
        }
        let drain = (mode == suanli_state::NodeMode::Draining)
            .then_some(suanli_state::DrainOptions { grace_s: r.grace_s, max_unavailable: r.max_unavailable });
        self.0
            .propose(Command::SetNodeMode(SetNodeMode { node: NodeId(r.id), mode, now: self.0.now_s(), drain }))
            .await?;
        self.0.kick.notify_one();
        ok(pb::SetNodeModeResponse {})
    }

    async fn clear_quarantine(&self, req: Request<pb::ClearQuarantineRequest>) -> Resp<pb::ClearQuarantineResponse> {
        let r = req.into_inner();
        let max = suanli_model::Limits::default().max_name_len;
        if r.id.is_empty() || r.id.len() > max {
            return Err(invalid("id", format!("a node id of 1..={max} bytes, got {}", r.id.len())));
        }
        if r.device.is_empty() || r.device.len() > max {
            return Err(invalid("device", format!("a device id of 1..={max} bytes, got {}", r.device.len())));
        }
        let node = NodeId(r.id);
        let cmd = Command::ClearQuarantine(ClearQuarantine {
            node: node.clone(),
            device: r.device.clone(),
            now: self.0.now_s(),
        });
        self.0.propose(cmd).await?;
        let clears =
            self.0.state.read(|s| s.nodes().get(&node).and_then(|n| n.quarantine_clears.get(&r.device).copied()));
        ok(pb::ClearQuarantineResponse { clears: clears.unwrap_or_default() })
    }
}

/// Where a list resumes after the page token `after`: from the first item when it is empty.
fn after_bound<K: Default + PartialEq>(after: &K) -> Bound<&K> {
    if *after == K::default() { Bound::Unbounded } else { Bound::Excluded(after) }
}

impl Api {
    /// An empty list page: the request's `limit` under `max_list`, and `max_list_bytes`.
    fn page<T: prost::Message>(&self, limit: u32) -> Page<T> {
        Page::new(page::count(limit, self.0.cfg.max_list), self.0.cfg.max_list_bytes)
    }

    fn leader_cluster_client(&self) -> Result<ClusterClient<tonic::transport::Channel>, Status> {
        let (ch, _) = self.0.leader_channel()?;
        Ok(ClusterClient::new(ch))
    }

    /// `Jobs.Submit{global}`: forwarded to the federation on the caller's behalf (this server's
    /// certificate; the federation trusts `on_behalf_of` only from a server).
    async fn submit_global(
        &self,
        who: &suanli_security::Principal,
        r: pb::SubmitJobRequest,
        trace: Option<String>,
    ) -> Resp<pb::SubmitJobResponse> {
        let Some(link) = self.0.cfg.federation.as_ref() else {
            return Err(Status::failed_precondition("global: this region has no [federation] configured"));
        };
        if r.client_request_id.is_empty() {
            return Err(invalid("client_request_id", "must not be empty"));
        }
        check_value(|| "client_request_id".into(), &r.client_request_id, 128).map_err(|e| invalid_model(&e))?;
        check_value(|| "team".into(), &r.team, 64).map_err(|e| invalid_model(&e))?;
        let (name, role, team) = match who {
            suanli_security::Principal::User { name, role, team, .. } => {
                (name.clone(), role.to_string(), team.clone().unwrap_or_default())
            }
            other => (other.to_string(), String::new(), String::new()),
        };
        let fwd = pb::FedSubmitRequest {
            spec_json: r.spec_json,
            team: if r.team.is_empty() { team.clone() } else { r.team },
            client_request_id: r.client_request_id,
            on_behalf_of: name,
            on_behalf_of_team: team,
            on_behalf_of_role: role,
            data_labels: Default::default(),
        };
        let timeout = Duration::from_millis(link.request_timeout_ms);
        let mut last = Status::unavailable("federation.endpoints: none configured");
        for addr in &link.endpoints {
            let mut client = suanli_proto::v1::federation_client::FederationClient::new(self.0.channel(addr)?)
                .max_encoding_message_size(self.0.cfg.max_request_bytes)
                .max_decoding_message_size(self.0.cfg.max_reply_bytes());
            let mut request = Request::new(fwd.clone());
            request.set_timeout(timeout);
            if let Some(v) = trace.as_deref().and_then(|t| t.parse().ok()) {
                request.metadata_mut().insert("traceparent", v);
            }
            match tokio::time::timeout(timeout, client.submit(request)).await {
                Ok(Ok(a)) => {
                    let a = a.into_inner();
                    return ok(pb::SubmitJobResponse {
                        global_id: a.global_id,
                        created: a.created,
                        ..Default::default()
                    });
                }
                // Another federation server may lead or answer: try it.
                Ok(Err(e)) if matches!(e.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                    last = Status::unavailable(format!("federation {addr}: {}", e.message()));
                }
                Ok(Err(e)) => return Err(Status::new(e.code(), format!("federation {addr}: {}", e.message()))),
                Err(_) => last = Status::deadline_exceeded(format!("federation {addr}: no answer within {timeout:?}")),
            }
        }
        Err(last)
    }
    /// Checks one submission and turns it into its command.
    fn submit_command(
        &self,
        r: pb::SubmitJobRequest,
        caller: Option<&opentelemetry::trace::SpanContext>,
    ) -> Result<Command, Status> {
        if r.client_request_id.is_empty() {
            return Err(invalid("client_request_id", "must not be empty (reuse one id when retrying a submission)"));
        }
        let max = self.0.state.read(|s| s.config().max_request_id_len);
        check_value(|| "client_request_id".into(), &r.client_request_id, max).map_err(|e| invalid_model(&e))?;
        let spec: JobSpec = decode_json("spec_json", &r.spec_json, self.0.cfg.max_request_bytes)?;
        let retry = r.retry.map(|p| suanli_state::RetryPolicy {
            max_attempts: p.max_attempts,
            backoff_base_s: p.backoff_base_s,
            backoff_max_s: p.backoff_max_s,
        });
        Ok(Command::SubmitJob(Box::new(SubmitJob {
            client_request_id: r.client_request_id,
            spec,
            retry,
            now: self.0.now_s(),
            trace: crate::telemetry::new_job_root(caller),
        })))
    }
}

/// The `job.submit` span of a job this call created (docs/tracing.md): from the call's
/// arrival to its Raft commit at `index`.
fn trace_submitted(core: &Core, job: u64, started: std::time::SystemTime, index: u64) {
    if !crate::telemetry::enabled() {
        return;
    }
    let found = core.state.read(|s| {
        let j = s.job(suanli_model::JobId(job))?;
        let mut attrs = crate::telemetry::job_attrs(s, j);
        attrs.push(opentelemetry::KeyValue::new("suanli.raft_index", index as i64));
        Some((crate::telemetry::job_root(j)?, attrs))
    });
    if let Some((root, attrs)) = found {
        crate::telemetry::emit(&root, "job.submit", started, std::time::SystemTime::now(), attrs);
    }
}

#[tonic::async_trait]
impl Cluster for Api {
    async fn members(&self, req: Request<pb::MembersRequest>) -> Resp<pb::MembersResponse> {
        // Replication progress (`matched_index`) is known to the leader only: a follower asks
        // the leader, once (a forwarded call is answered where it lands), and answers from its
        // own view when no leader answers.
        if !self.0.is_leader()
            && req.metadata().get(FORWARDED).is_none()
            && let Ok(mut c) = self.leader_cluster_client()
        {
            let mut fwd = Request::new(pb::MembersRequest {});
            fwd.metadata_mut().insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
            fwd.set_timeout(self.0.timeout());
            if let Ok(r) = c.members(fwd).await {
                return Ok(r);
            }
        }
        let m = self.0.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(id, n)| pb::Member {
                id: *id,
                addr: n.client_addr().to_owned(),
                peer_addr: n.addr.clone(),
                voter: voters.contains(id),
                leader: m.current_leader == Some(*id),
                matched_index: m
                    .replication
                    .as_ref()
                    .and_then(|r| r.get(id).cloned().flatten())
                    .map(|l| l.index)
                    .or_else(|| (*id == self.0.id).then(|| m.last_log_index.unwrap_or(0)))
                    .unwrap_or(0),
            })
            .collect();
        ok(pb::MembersResponse {
            members,
            term: m.current_term,
            commit_index: m.last_applied.map_or(0, |l| l.index),
            cluster_id: self.0.state.read(|s| s.cluster_id().to_owned()),
        })
    }

    async fn leader(&self, _req: Request<pb::LeaderRequest>) -> Resp<pb::LeaderResponse> {
        let term = self.0.raft.metrics().borrow().current_term;
        let (leader_id, leader_addr) = self.0.leader().unwrap_or((0, String::new()));
        ok(pb::LeaderResponse { leader_id, leader_addr, term })
    }

    async fn add_server(&self, req: Request<pb::AddServerRequest>) -> Resp<pb::AddServerResponse> {
        let r = req.into_inner();
        if r.id == 0 {
            return Err(invalid("id", "must be >= 1"));
        }
        let addr = check_addr("addr", &r.addr)?;
        let peer = if r.peer_addr.is_empty() {
            crate::config::next_port(&addr)
                .ok_or_else(|| invalid("peer_addr", "empty, and addr's port + 1 is no port: give the peer address"))?
        } else {
            check_addr("peer_addr", &r.peer_addr)?
        };
        if !self.0.is_leader() {
            return self.leader_cluster_client()?.add_server(r).await;
        }
        let node = ServerNode::new(peer, addr);
        let add =
            membership::add_server(&self.0.raft, r.id, node, r.learner_only, self.0.timeout(), "suanli cluster remove");
        tokio::time::timeout(self.0.timeout(), add).await.map_err(|_| {
            Status::deadline_exceeded(format!(
                "adding server {} did not finish within the request timeout ({} ms); see `suanli cluster members`",
                r.id, self.0.cfg.request_timeout_ms
            ))
        })??;
        ok(pb::AddServerResponse {})
    }

    async fn remove_server(&self, req: Request<pb::RemoveServerRequest>) -> Resp<pb::RemoveServerResponse> {
        let r = req.into_inner();
        if !self.0.is_leader() {
            return self.leader_cluster_client()?.remove_server(r).await;
        }
        membership::remove_server(&self.0.raft, r.id, self.0.timeout()).await?;
        ok(pb::RemoveServerResponse {})
    }

    async fn digest(&self, req: Request<pb::DigestRequest>) -> Resp<pb::DigestResponse> {
        let r = req.into_inner();
        let state = &self.0.state;
        let index = if r.index == 0 { state.last_digest().0 } else { r.index };
        let wait = Duration::from_millis(r.wait_ms).min(self.0.timeout());
        if tokio::time::timeout(wait, state.wait_applied(index)).await.is_err() {
            return Err(Status::deadline_exceeded(format!(
                "index: {index} is not applied here within {} ms (applied up to {})",
                wait.as_millis(),
                state.applied_index()
            )));
        }
        let digest = state.digest_at(index).map_err(|miss| match miss {
            suanli_raft::DigestMiss::Ahead(last) => {
                Status::unavailable(format!("index: {index} is not applied here (applied up to {last}); retry"))
            }
            suanli_raft::DigestMiss::Behind(oldest) => Status::out_of_range(format!(
                "index: {index} is older than the log digests this server keeps (from {oldest}; the last {} entries)",
                suanli_raft::DIGEST_WINDOW
            )),
        })?;
        ok(pb::DigestResponse { id: self.0.id, index, digest, applied_index: state.applied_index() })
    }

    async fn version(&self, _req: Request<pb::VersionRequest>) -> Resp<pb::VersionResponse> {
        ok(pb::VersionResponse {
            id: self.0.id,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            command_version: suanli_state::COMMAND_VERSION,
            command_kinds: Command::KINDS.iter().map(|k| (*k).to_owned()).collect(),
            halt: self.0.halted().map(|h| pb::HaltInfo {
                index: h.index,
                term: h.term,
                kind: h.kind,
                reason: h.reason,
            }),
            cluster_id: self.0.state.read(|s| s.cluster_id().to_owned()),
            clock: self.0.clock.line(self.0.is_leader()),
            cluster_time_s: self.0.state.read(suanli_state::State::clock),
        })
    }

    async fn skip_entry(&self, req: Request<pb::SkipEntryRequest>) -> Resp<pb::SkipEntryResponse> {
        let r = req.into_inner();
        if !self.0.is_leader() {
            return self.leader_cluster_client()?.skip_entry(r).await;
        }
        let Some(h) = self.0.halted() else {
            return Err(Status::failed_precondition("index: the leader is not halted: there is no entry to skip"));
        };
        if h.index != r.index || h.kind != r.kind {
            return Err(invalid(
                "index",
                format!(
                    "the leader halted at entry {} of kind {:?}, not entry {} of kind {}",
                    h.index,
                    h.kind,
                    r.index,
                    quote(&r.kind)
                ),
            ));
        }
        let cmd = Command::SkipEntry(suanli_state::SkipEntry { index: r.index, kind: r.kind });
        let (_, index) = self.0.propose_local(cmd).await?;
        if let Some(h) = self.0.halted() {
            return Err(Status::internal(format!(
                "the skip order committed at {index} but the group is still halted at {}",
                h.index
            )));
        }
        tracing::warn!(skipped = r.index, at = index, "operator skipped a halted log entry");
        self.0.kick.notify_one();
        ok(pb::SkipEntryResponse { index })
    }

    type BackupStream = tokio_stream::wrappers::ReceiverStream<Result<pb::BackupChunk, Status>>;

    async fn get_config(&self, req: Request<pb::GetConfigRequest>) -> Resp<pb::GetConfigResponse> {
        let r = req.into_inner();
        let (config, revision) = self.0.read(r.stale, |s| (serde_json::to_string(s.config()), s.revision())).await?;
        let config_json = config.map_err(|e| Status::internal(format!("encoding the config: {e}")))?;
        ok(pb::GetConfigResponse { config_json, revision })
    }

    async fn set_config(&self, req: Request<pb::SetConfigRequest>) -> Resp<pb::SetConfigResponse> {
        // `UpdateConfig` is built by the leader only (a follower never forwards it): the call
        // itself goes to the leader, once, which merges into the configuration it holds.
        let forwarded = req.metadata().get(FORWARDED).is_some();
        let r = req.into_inner();
        if !self.0.is_leader() {
            if forwarded {
                return Err(unavailable("not the leader (a forwarded SetConfig)", self.0.leader().map(|l| l.1)));
            }
            let mut fwd = Request::new(r);
            fwd.metadata_mut().insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
            fwd.set_timeout(self.0.timeout());
            return self.leader_cluster_client()?.set_config(fwd).await;
        }
        // One change at a time on this leader, so two calls never merge into the same base.
        let _one = self.0.config_writes.lock().await;
        let current = self.0.read(false, |s| s.config().clone()).await?;
        let config = crate::cluster_config::merge(&current, &r.set)?;
        let config_json =
            serde_json::to_string(&config).map_err(|e| Status::internal(format!("encoding the config: {e}")))?;
        let cmd = Command::UpdateConfig(Box::new(UpdateConfig { config }));
        let (resp, _) = self.0.propose_local(cmd).await?;
        if let Some(e) = resp.rejection() {
            return Err(crate::status::rejection(e));
        }
        // The state revision (as GetConfig answers it) once the change is applied here.
        let revision = self.0.state.read(suanli_state::State::revision);
        tracing::info!(fields = ?r.set.keys().collect::<Vec<_>>(), revision, "replicated configuration changed");
        self.0.kick.notify_one();
        ok(pb::SetConfigResponse { config_json, revision })
    }

    async fn backup(&self, _req: Request<pb::BackupRequest>) -> Resp<Self::BackupStream> {
        let permit = self.0.backups.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted("a backup is already being served by this server: one at a time; retry after it")
        })?;
        // The read barrier: the state served includes every write committed before this call.
        self.0.read(false, |_| ()).await?;
        let (cluster_id, last_applied, membership, state) = self.0.state.read_full(|a| {
            (a.machine.cluster_id().to_owned(), a.last_applied, a.membership.clone(), a.machine.snapshot())
        });
        let state = state.map_err(|e| Status::internal(format!("encoding the state: {e}")))?;
        let header = crate::backup::header_for(&cluster_id, last_applied, membership, &state, self.0.id);
        let file = crate::backup::encode(&header, &state).map_err(|e| Status::internal(e.to_string()))?;
        drop(state);
        tracing::info!(bytes = file.len(), last_applied = ?last_applied.map(|l| l.index), %cluster_id, "serving a backup");
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let _permit = permit;
            for chunk in file.chunks(crate::backup::CHUNK_BYTES) {
                if tx.send(Ok(pb::BackupChunk { data: chunk.to_vec() })).await.is_err() {
                    return; // the client went away
                }
            }
        });
        ok(tokio_stream::wrappers::ReceiverStream::new(rx))
    }

    async fn snapshot(&self, _req: Request<pb::SnapshotRequest>) -> Resp<pb::SnapshotResponse> {
        let target = self.0.raft.metrics().borrow().last_applied.map_or(0, |l| l.index);
        self.0.raft.trigger().snapshot().await.map_err(|e| Status::unavailable(e.to_string()))?;
        let mut rx = self.0.raft.metrics();
        let r =
            tokio::time::timeout(self.0.timeout(), rx.wait_for(|m| m.snapshot.map_or(0, |l| l.index) >= target)).await;
        match r {
            Ok(Ok(m)) => ok(pb::SnapshotResponse { last_log_index: m.snapshot.map_or(0, |l| l.index) }),
            _ => Err(Status::deadline_exceeded("the snapshot was not built within the request timeout")),
        }
    }
}

/// Checks a command a follower forwarded (`Internal.Propose`) before it may reach the log:
/// only kinds a server builds from a validated client or agent request are forwarded; a kind
/// this leader does not know, or one only the leader itself builds (plans, liveness, config,
/// skip orders), is refused. Bodies are checked again by apply, deterministically, on every
/// server.
fn forwardable(cmd: &Command) -> Result<(), Status> {
    match cmd {
        Command::Unknown { kind, .. } => Err(invalid(
            "command_json.kind",
            format!(
                "{} is not a command kind this leader's build knows ({}); retry once the leader runs a build that knows it",
                quote(kind),
                Command::KINDS.join(", ")
            ),
        )),
        Command::ApplyPlan(_)
        | Command::NodeDown(_)
        | Command::UpdateConfig(_)
        | Command::SkipEntry(_)
        | Command::SetClusterId(_)
        | Command::FedAdopt(_)
        | Command::FedRenew(_)
        | Command::FedRelease(_)
        | Command::FedQuotaLeases(_) => Err(invalid(
            "command_json.kind",
            format!("{:?} is built by the leader only and is never forwarded", cmd.kind()),
        )),
        Command::Batch(b) => {
            for (i, c) in b.commands.iter().enumerate() {
                if matches!(c, Command::Batch(_)) {
                    return Err(invalid(&format!("command_json.body.commands[{i}]"), "a batch may not hold a batch"));
                }
                forwardable(c).map_err(|s| Status::new(s.code(), format!("commands[{i}]: {}", s.message())))?;
            }
            Ok(())
        }
        Command::UpsertQueue(_)
        | Command::DeleteQueue(_)
        | Command::RegisterNode(_)
        | Command::SetNodeMode(_)
        | Command::DeviceHealth(_)
        | Command::NodeCondition(_)
        | Command::ClearQuarantine(_)
        | Command::SubmitJob(_)
        | Command::CancelJob(_)
        | Command::AllocStatus(_)
        | Command::AllocReady(_)
        | Command::ReportCheckpoint(_)
        | Command::MigrateJob(_)
        | Command::UpdateService(_)
        | Command::IssueToken(_)
        | Command::RevokeToken(_)
        | Command::RecordAudit(_)
        | Command::SetPrices(_) => Ok(()),
    }
}

#[tonic::async_trait]
impl Internal for Api {
    async fn propose(&self, req: Request<pb::ProposeRequest>) -> Resp<pb::ProposeResponse> {
        let r = req.into_inner();
        if r.group != self.0.cfg.raft.group {
            return Err(Status::not_found(format!("group: {} is not served here", quote(&r.group))));
        }
        let cmd: Command = serde_json::from_slice(&r.command_json).map_err(|e| invalid("command_json", e))?;
        // `server::forward-unchecked` (chaos and tests only) lets a command through unchecked:
        // how a test commits an entry no server can apply, as a newer build's leader would.
        #[cfg(feature = "failpoints")]
        let unchecked = fail::eval("server::forward-unchecked", |_| ()).is_some();
        #[cfg(not(feature = "failpoints"))]
        let unchecked = false;
        if !unchecked {
            forwardable(&cmd)?;
        }
        if !self.0.is_leader() {
            return Err(unavailable("not the leader", self.0.leader().map(|l| l.1)));
        }
        let wakes = matches!(cmd, Command::SubmitJob(_) | Command::CancelJob(_) | Command::AllocStatus(_));
        let (resp, index) = self.0.propose_local(cmd).await?;
        if wakes {
            self.0.kick.notify_one();
        }
        let response_json = serde_json::to_vec(&resp).map_err(|e| Status::internal(e.to_string()))?;
        ok(pb::ProposeResponse { response_json: response_json.into(), index })
    }

    async fn read_index(&self, req: Request<pb::ReadIndexRequest>) -> Resp<pb::ReadIndexResponse> {
        if req.into_inner().group != self.0.cfg.raft.group {
            return Err(Status::not_found("group: not served here"));
        }
        ok(pb::ReadIndexResponse { index: self.0.local_read_index().await? })
    }

    async fn campaign(&self, req: Request<pb::CampaignRequest>) -> Resp<pb::CampaignResponse> {
        let r = req.into_inner();
        if r.group != self.0.cfg.raft.group {
            return Err(Status::not_found(format!("group: {} is not served here", quote(&r.group))));
        }
        ok(crate::lifecycle::campaign(&self.0, r.from_id, Duration::from_millis(r.wait_ms)).await)
    }

    async fn inspect(&self, req: Request<pb::InspectRequest>) -> Resp<pb::InspectResponse> {
        let r = req.into_inner();
        if r.group != self.0.cfg.raft.group {
            return Err(Status::not_found(format!("group: {} is not served here", quote(&r.group))));
        }
        const MAX_DIGESTS: usize = 10_000;
        let (applied_index, state_hash) = self.0.state.read_applied(|index, s| {
            let hash = s.snapshot().map(|b| suanli_raft::fnv1a(&b)).map_err(|e| Status::internal(e.to_string()));
            hash.map(|h| (index, h))
        })?;
        let term = self.0.raft.metrics().borrow().current_term;
        let halt = self.0.halted();
        let log = self.0.log.clone();
        let (from, to) = (r.log_from, r.log_to);
        let (bounds, committed, digests) = tokio::task::spawn_blocking(move || {
            let err = |e: openraft::StorageError<u64>| format!("reading the log: {e}");
            let bounds = log.bounds().map_err(err)?;
            let committed = log.committed_index().map_err(err)?;
            let digests = if to == 0 { Vec::new() } else { log.digests(from, to, MAX_DIGESTS).map_err(err)? };
            Ok::<_, String>((bounds, committed, digests))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(Status::internal)?;
        let (first_log_index, last_log_index) = bounds.unwrap_or((0, 0));
        ok(pb::InspectResponse {
            id: self.0.id,
            leader: self.0.is_leader(),
            term,
            applied_index,
            state_hash,
            committed_index: committed.max(applied_index),
            first_log_index,
            last_log_index,
            entries: digests.into_iter().map(|(index, term, hash)| pb::LogDigest { index, term, hash }).collect(),
            halted_index: halt.as_ref().map_or(0, |h| h.index),
            halted_reason: halt.map(|h| h.reason).unwrap_or_default(),
            cluster_id: self.0.state.read(|s| s.cluster_id().to_owned()),
            cluster_time_s: self.0.state.read(suanli_state::State::clock),
            clock: self.0.clock.line(self.0.is_leader()),
        })
    }

    async fn clock(&self, req: Request<pb::ClockRequest>) -> Resp<pb::ClockResponse> {
        if req.into_inner().group != self.0.cfg.raft.group {
            return Err(Status::not_found("group: not served here"));
        }
        ok(pb::ClockResponse { wall_ms: crate::clock::wall_ms(), mono_ms: self.0.clock.mono_ms() })
    }
}
