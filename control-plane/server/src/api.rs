//! The client API (`Jobs`, `Queues`, `Pools`, `Nodes`, `Cluster`) and the server-to-server
//! `Internal` service, over the shared [`Core`].

use crate::convert;
use crate::core::{Core, now_s};
use crate::status::{decode_json, invalid, unavailable};
use openraft::BasicNode;
use openraft::ChangeMembers;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use suanli_model::{JobId, JobSpec, NodeId, Queue, QueueId};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::cluster_server::Cluster;
use suanli_proto::v1::internal_server::Internal;
use suanli_proto::v1::jobs_server::Jobs;
use suanli_proto::v1::nodes_server::Nodes;
use suanli_proto::v1::pools_server::Pools;
use suanli_proto::v1::queues_server::Queues;
use suanli_state::{CancelJob, Command, DeleteQueue, Response, SetNodeMode, SubmitJob, UpsertQueue};
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
pub const MAX_JOBS_PER_CALL: usize = 1024;

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
            Ok(pb::SubmitJobResponse { job_id: job.0, created, revision: index })
        }
        other => Err(Status::internal(format!("unexpected answer to a submission: {other:?}"))),
    }
}

const JOB_STATES: [&str; 8] =
    ["pending", "placed", "running", "preempted", "requeuing", "succeeded", "failed", "cancelled"];

#[tonic::async_trait]
impl Jobs for Api {
    async fn submit(&self, req: Request<pb::SubmitJobRequest>) -> Resp<pb::SubmitJobResponse> {
        let cmd = self.submit_command(req.into_inner())?;
        let (resp, index) = self.1.propose(cmd).await?;
        let answer = submitted(resp, index)?;
        if answer.created {
            self.0.kick.notify_one();
        }
        ok(answer)
    }

    async fn submit_many(&self, req: Request<pb::SubmitJobsRequest>) -> Resp<pb::SubmitJobsResponse> {
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
            match self.submit_command(j) {
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
            .read(r.stale, |s| s.job(JobId(r.job_id)).map(|j| convert::job(s, j, convert::queue_position(s, j))))
            .await?;
        info.map_or_else(|| Err(Status::not_found(format!("job_id: unknown job {}", r.job_id))), ok)
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
        let max = self.0.cfg.max_list;
        let limit = if r.limit == 0 { max } else { r.limit.min(max) } as usize;
        let queue = r.queue;
        let after = r.after_id;
        let (jobs, more) = self
            .0
            .read(r.stale, |s| {
                let mut it = s
                    .jobs()
                    .range(JobId(after.saturating_add(1))..)
                    .map(|(_, j)| j)
                    .filter(|j| queue.is_empty() || j.spec.queue.0 == queue)
                    .filter(|j| states.is_empty() || states.iter().any(|x| x == j.state.as_str()));
                let page: Vec<pb::JobInfo> = it.by_ref().take(limit).map(|j| convert::job(s, j, 0)).collect();
                let more = it.next().is_some();
                (page, more)
            })
            .await?;
        let next = if more { jobs.last().map(|j| j.id).unwrap_or(0) } else { 0 };
        ok(pb::ListJobsResponse { jobs, next_after_id: next })
    }

    async fn cancel(&self, req: Request<pb::CancelJobRequest>) -> Resp<pb::CancelJobResponse> {
        let r = req.into_inner();
        let cmd = Command::CancelJob(CancelJob { job: JobId(r.job_id), reason: r.reason, now: now_s() });
        self.0.propose(cmd).await?;
        self.0.kick.notify_one();
        ok(pb::CancelJobResponse {})
    }

    type WatchStream = ReceiverStream<Result<pb::JobEvent, Status>>;

    async fn watch(&self, req: Request<pb::WatchJobsRequest>) -> Resp<Self::WatchStream> {
        // A connection is its peer's socket address: its streams are bounded on their own.
        let permit = self.0.watchers.client(req.remote_addr())?;
        let r = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let core = self.0.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut applied = core.state.subscribe();
            let mut last = r.from_revision;
            let mut seen_single = false;
            loop {
                let events: Vec<pb::JobEvent> = core.state.read(|s| {
                    if r.job_id != 0 {
                        return match s.job(JobId(r.job_id)) {
                            Some(j) if j.revision > last || (last == 0 && !seen_single) => {
                                vec![pb::JobEvent {
                                    revision: j.revision,
                                    job: Some(convert::job(s, j, 0)),
                                    removed: false,
                                }]
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
                        .map(|j| pb::JobEvent {
                            revision: j.revision,
                            job: Some(convert::job(s, j, 0)),
                            removed: false,
                        })
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
        q.map_or_else(|| Err(Status::not_found(format!("id: unknown queue {:?}", r.id))), ok)
    }

    async fn list(&self, req: Request<pb::ListQueuesRequest>) -> Resp<pb::ListQueuesResponse> {
        let queues = self
            .0
            .read(req.into_inner().stale, |s| s.queues().keys().filter_map(|id| convert::queue(s, id)).collect())
            .await?;
        ok(pb::ListQueuesResponse { queues })
    }
}

#[tonic::async_trait]
impl Pools for Api {
    async fn list(&self, req: Request<pb::ListPoolsRequest>) -> Resp<pb::ListPoolsResponse> {
        let pools = self.0.read(req.into_inner().stale, convert::pools).await?;
        ok(pb::ListPoolsResponse { pools })
    }
}

#[tonic::async_trait]
impl Nodes for Api {
    async fn list(&self, req: Request<pb::ListNodesRequest>) -> Resp<pb::ListNodesResponse> {
        let r = req.into_inner();
        let limit = self.0.cfg.max_list as usize;
        let nodes = self
            .0
            .read(r.stale, |s| {
                s.nodes()
                    .values()
                    .filter(|n| r.pool.is_empty() || n.node.pool.0 == r.pool)
                    .take(limit)
                    .map(|n| convert::node(s, n))
                    .collect::<Vec<_>>()
            })
            .await?;
        let nodes = nodes
            .into_iter()
            .map(|mut n| {
                n.stats = self.0.stats_of(&NodeId(n.id.clone()));
                n
            })
            .collect();
        ok(pb::ListNodesResponse { nodes })
    }

    async fn get(&self, req: Request<pb::GetNodeRequest>) -> Resp<pb::NodeInfo> {
        let r = req.into_inner();
        let id = NodeId(r.id.clone());
        let n = self.0.read(r.stale, |s| s.nodes().get(&id).map(|n| convert::node(s, n))).await?;
        let mut n = n.ok_or_else(|| Status::not_found(format!("id: unknown node {:?}", r.id)))?;
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
        self.0.propose(Command::SetNodeMode(SetNodeMode { node: NodeId(r.id), mode, now: now_s() })).await?;
        self.0.kick.notify_one();
        ok(pb::SetNodeModeResponse {})
    }
}

impl Api {
    fn leader_cluster_client(&self) -> Result<ClusterClient<tonic::transport::Channel>, Status> {
        let (ch, _) = self.0.leader_channel()?;
        Ok(ClusterClient::new(ch))
    }

    fn voters(&self) -> BTreeSet<u64> {
        self.0.raft.metrics().borrow().membership_config.membership().voter_ids().collect()
    }

    /// Checks one submission and turns it into its command.
    fn submit_command(&self, r: pb::SubmitJobRequest) -> Result<Command, Status> {
        if r.client_request_id.is_empty() {
            return Err(invalid("client_request_id", "must not be empty (reuse one id when retrying a submission)"));
        }
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
            now: now_s(),
        })))
    }
}

/// Runs one membership change, waiting (up to the request timeout) while an earlier change is
/// still being committed: openraft allows one change at a time, and that is transient.
async fn change_membership(core: &Core, change: ChangeMembers<u64, BasicNode>) -> Result<(), Status> {
    use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
    let deadline = std::time::Instant::now() + core.timeout();
    loop {
        match core.raft.change_membership(change.clone(), false).await {
            Ok(_) => return Ok(()),
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(ChangeMembershipError::InProgress(_))))
                if std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(membership_error(e)),
        }
    }
}

fn membership_error(e: impl std::fmt::Display) -> Status {
    Status::failed_precondition(format!("membership change: {e}"))
}

#[tonic::async_trait]
impl Cluster for Api {
    async fn members(&self, _req: Request<pb::MembersRequest>) -> Resp<pb::MembersResponse> {
        let m = self.0.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(id, n)| pb::Member {
                id: *id,
                addr: n.addr.clone(),
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
        ok(pb::MembersResponse { members, term: m.current_term, commit_index: m.last_applied.map_or(0, |l| l.index) })
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
        if r.addr.is_empty() {
            return Err(invalid("addr", "must be host:port"));
        }
        if !self.0.is_leader() {
            return self.leader_cluster_client()?.add_server(r).await;
        }
        // Catch up as a learner first (from a snapshot when the log was purged), then vote.
        self.0.raft.add_learner(r.id, BasicNode::new(r.addr.clone()), true).await.map_err(membership_error)?;
        if !r.learner_only && !self.voters().contains(&r.id) {
            let add: BTreeSet<u64> = [r.id].into();
            change_membership(&self.0, ChangeMembers::AddVoterIds(add)).await?;
        }
        ok(pb::AddServerResponse {})
    }

    async fn remove_server(&self, req: Request<pb::RemoveServerRequest>) -> Resp<pb::RemoveServerResponse> {
        let r = req.into_inner();
        if !self.0.is_leader() {
            return self.leader_cluster_client()?.remove_server(r).await;
        }
        let m = self.0.raft.metrics().borrow().membership_config.clone();
        let known = m.membership().get_node(&r.id).is_some();
        if !known {
            return Err(Status::not_found(format!("id: unknown server {}", r.id)));
        }
        if self.voters().contains(&r.id) {
            let rm: BTreeSet<u64> = [r.id].into();
            change_membership(&self.0, ChangeMembers::RemoveVoters(rm)).await?;
        }
        let rm: BTreeSet<u64> = [r.id].into();
        change_membership(&self.0, ChangeMembers::RemoveNodes(rm)).await?;
        ok(pb::RemoveServerResponse {})
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

#[tonic::async_trait]
impl Internal for Api {
    async fn propose(&self, req: Request<pb::ProposeRequest>) -> Resp<pb::ProposeResponse> {
        let r = req.into_inner();
        if r.group != self.0.cfg.raft.group {
            return Err(Status::not_found(format!("group: {:?} is not served here", r.group)));
        }
        let cmd: Command = serde_json::from_slice(&r.command_json).map_err(|e| invalid("command_json", e))?;
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

    async fn inspect(&self, req: Request<pb::InspectRequest>) -> Resp<pb::InspectResponse> {
        let r = req.into_inner();
        if r.group != self.0.cfg.raft.group {
            return Err(Status::not_found(format!("group: {:?} is not served here", r.group)));
        }
        const MAX_DIGESTS: usize = 10_000;
        let (applied_index, state_hash) = self.0.state.read_applied(|index, s| {
            let hash = s.snapshot().map(|b| suanli_raft::fnv1a(&b)).map_err(|e| Status::internal(e.to_string()));
            hash.map(|h| (index, h))
        })?;
        let term = self.0.raft.metrics().borrow().current_term;
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
        })
    }
}
