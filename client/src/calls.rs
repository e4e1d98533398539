//! Typed calls: one method per request the tools make, each through [`Connection::call`].

use crate::backoff;
use crate::conn::CallChannel as Channel;
use crate::conn::Connection;
use crate::error::ClientError;
use std::future::Future;
use std::time::Duration;
use suanli_proto::v1 as pb;
use tonic::Status;

/// Largest page the list calls ask for (the server may answer fewer, bounded in bytes).
pub const PAGE: u32 = 500;

/// Spec JSON sent in one `SubmitMany` call at most (besides [`suanli_proto::MAX_JOBS_PER_CALL`]),
/// well inside the servers' default 4 MiB message limit.
const SUBMIT_CALL_BYTES: usize = 2 << 20;

/// Which jobs `list_jobs` returns.
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    /// Only jobs of this queue (empty: all).
    pub queue: String,
    /// Only jobs in these states (empty: all).
    pub states: Vec<String>,
    /// Allow a possibly stale answer from the contacted server's local state.
    pub stale: bool,
}

impl Connection {
    fn jobs(&self, ch: Channel) -> pb::jobs_client::JobsClient<Channel> {
        pb::jobs_client::JobsClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    fn cluster(&self, ch: Channel) -> pb::cluster_client::ClusterClient<Channel> {
        pb::cluster_client::ClusterClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    fn nodes(&self, ch: Channel) -> pb::nodes_client::NodesClient<Channel> {
        pb::nodes_client::NodesClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    fn queues(&self, ch: Channel) -> pb::queues_client::QueuesClient<Channel> {
        pb::queues_client::QueuesClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    /// An `Agent` service client on `ch` (node registration, heartbeats, reports).
    pub fn agent(&self, ch: Channel) -> pb::agent_client::AgentClient<Channel> {
        pb::agent_client::AgentClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    /// Follows a list to its end, or until `cap` items: `page(channel, token, limit)` asks for
    /// one page and answers its items and the next token (the default value after the last
    /// page). A page may hold fewer items than asked while more follow (the server bounds pages
    /// in bytes too): only the token ends the list.
    pub async fn pages<T, K, F, Fut>(&self, cap: Option<u32>, mut page: F) -> Result<Vec<T>, ClientError>
    where
        K: Ord + Default + Clone,
        F: FnMut(Channel, K, u32) -> Fut,
        Fut: Future<Output = Result<tonic::Response<(Vec<T>, K)>, Status>>,
    {
        let cap = cap.map(|c| c as usize);
        let mut out = Vec::new();
        let mut after = K::default();
        loop {
            let want = cap.map_or(PAGE, |c| u32::try_from(c.saturating_sub(out.len())).unwrap_or(PAGE).min(PAGE));
            let (items, next) = self.call(|ch| page(ch, after.clone(), want)).await?;
            out.extend(items);
            if next == K::default() || cap.is_some_and(|c| out.len() >= c) {
                break;
            }
            if next <= after {
                return Err(ClientError::Protocol("a page token that does not advance".into()));
            }
            after = next;
        }
        if let Some(c) = cap {
            out.truncate(c);
        }
        Ok(out)
    }

    // ---- jobs ----------------------------------------------------------------------------

    /// Submits one job; transport failures are retried ([`backoff::SUBMIT`]) with the same
    /// request, so a retry never creates a second job. `on_retry` hears each retried error.
    pub async fn submit_job(
        &self,
        req: pb::SubmitJobRequest,
        on_retry: impl FnMut(&ClientError, Duration),
    ) -> Result<pb::SubmitJobResponse, ClientError> {
        backoff::SUBMIT
            .retry(
                || {
                    let req = req.clone();
                    self.call(move |ch| {
                        let req = req.clone();
                        let mut c = self.jobs(ch);
                        async move { c.submit(req).await }
                    })
                },
                ClientError::is_transient,
                on_retry,
            )
            .await
    }

    /// Submits many jobs in `SubmitMany` calls of at most [`suanli_proto::MAX_JOBS_PER_CALL`]
    /// jobs and 2 MiB of specs each, each call retried like [`Connection::submit_job`]. One
    /// result per job, in order.
    pub async fn submit_jobs(
        &self,
        reqs: &[pb::SubmitJobRequest],
        mut on_retry: impl FnMut(&ClientError, Duration),
    ) -> Result<Vec<pb::SubmitJobResult>, ClientError> {
        let mut results: Vec<pb::SubmitJobResult> = Vec::with_capacity(reqs.len());
        let mut rest = reqs;
        while !rest.is_empty() {
            let mut n = 0;
            let mut bytes = 0;
            while n < rest.len() && n < suanli_proto::MAX_JOBS_PER_CALL {
                bytes += rest[n].spec_json.len();
                if n > 0 && bytes > SUBMIT_CALL_BYTES {
                    break;
                }
                n += 1;
            }
            let (chunk, tail) = rest.split_at(n);
            rest = tail;
            let resp = backoff::SUBMIT
                .retry(
                    || {
                        self.call(|ch| {
                            let jobs = chunk.to_vec();
                            let mut c = self.jobs(ch);
                            async move { c.submit_many(pb::SubmitJobsRequest { jobs }).await }
                        })
                    },
                    ClientError::is_transient,
                    &mut on_retry,
                )
                .await?;
            if resp.results.len() != chunk.len() {
                return Err(ClientError::Protocol(format!("{} results for {} jobs", resp.results.len(), chunk.len())));
            }
            results.extend(resp.results);
        }
        Ok(results)
    }

    /// The whole job.
    pub async fn get_job(&self, job_id: u64, stale: bool) -> Result<pb::JobInfo, ClientError> {
        self.call(|ch| {
            let mut c = self.jobs(ch);
            async move { c.get(pb::GetJobRequest { job_id, stale }).await }
        })
        .await
    }

    /// Job summaries, every page, or the first `cap`.
    pub async fn list_jobs(&self, filter: &JobFilter, cap: Option<u32>) -> Result<Vec<pb::JobInfo>, ClientError> {
        self.pages(cap, |ch, after_id, limit| {
            let req = pb::ListJobsRequest {
                queue: filter.queue.clone(),
                states: filter.states.clone(),
                limit,
                after_id,
                stale: filter.stale,
            };
            let mut c = self.jobs(ch);
            async move {
                let r = c.list(req).await?;
                Ok(r.map(|r| (r.jobs, r.next_after_id)))
            }
        })
        .await
    }

    /// Cancels a job.
    pub async fn cancel_job(&self, job_id: u64, reason: &str) -> Result<(), ClientError> {
        self.call(|ch| {
            let req = pb::CancelJobRequest { job_id, reason: reason.to_owned() };
            let mut c = self.jobs(ch);
            async move { c.cancel(req).await }
        })
        .await
        .map(drop)
    }

    /// Moves a running job, checkpoint first: to `to_pool` / `to_node` when not empty, else to
    /// any other allowed node. Answers the state revision of the request. Not retried (a
    /// retry after a lost answer would be refused: the job is already moving).
    pub async fn migrate_job(&self, job_id: u64, to_pool: &str, to_node: &str) -> Result<u64, ClientError> {
        self.call(|ch| {
            let req = pb::MigrateJobRequest { job_id, to_pool: to_pool.to_owned(), to_node: to_node.to_owned() };
            let mut c = self.jobs(ch);
            async move { c.migrate(req).await }
        })
        .await
        .map(|r| r.revision)
    }

    /// Replaces a service's spec (a rolling update, or a scale when only `replicas` changed);
    /// returns its spec version now.
    pub async fn update_service(&self, job_id: u64, spec_json: &str) -> Result<u32, ClientError> {
        self.call(|ch| {
            let req = pb::UpdateServiceRequest { job_id, spec_json: spec_json.to_owned() };
            let mut c = self.jobs(ch);
            async move { c.update_service(req).await }
        })
        .await
        .map(|r| r.version)
    }

    /// Job changes after `from_revision` (call on a [`Connection::streaming`] connection).
    pub async fn watch_jobs(
        &self,
        job_id: u64,
        from_revision: u64,
    ) -> Result<tonic::Streaming<pb::JobEvent>, ClientError> {
        self.call(|ch| {
            let mut c = self.jobs(ch);
            async move { c.watch(pb::WatchJobsRequest { job_id, from_revision }).await }
        })
        .await
    }

    // ---- queues and pools ----------------------------------------------------------------

    /// Creates or replaces a queue given as JSON.
    pub async fn upsert_queue(&self, queue_json: &str) -> Result<(), ClientError> {
        self.call(|ch| {
            let req = pb::UpsertQueueRequest { queue_json: queue_json.to_owned() };
            let mut c = self.queues(ch);
            async move { c.upsert(req).await }
        })
        .await
        .map(drop)
    }

    /// One queue.
    pub async fn get_queue(&self, id: &str, stale: bool) -> Result<pb::QueueInfo, ClientError> {
        self.call(|ch| {
            let req = pb::GetQueueRequest { id: id.to_owned(), stale };
            let mut c = self.queues(ch);
            async move { c.get(req).await }
        })
        .await
    }

    /// Every queue.
    pub async fn list_queues(&self, stale: bool) -> Result<Vec<pb::QueueInfo>, ClientError> {
        self.pages(None, |ch, after, limit| {
            let mut c = self.queues(ch);
            async move {
                let r = c.list(pb::ListQueuesRequest { stale, limit, after }).await?;
                Ok(r.map(|r| (r.queues, r.next_after)))
            }
        })
        .await
    }

    /// Deletes a queue.
    pub async fn delete_queue(&self, id: &str) -> Result<(), ClientError> {
        self.call(|ch| {
            let req = pb::DeleteQueueRequest { id: id.to_owned() };
            let mut c = self.queues(ch);
            async move { c.delete(req).await }
        })
        .await
        .map(drop)
    }

    /// Every pool.
    pub async fn list_pools(&self, stale: bool) -> Result<Vec<pb::PoolInfo>, ClientError> {
        let max = self.config().max_reply_bytes;
        self.pages(None, |ch, after, limit| async move {
            let r = pb::pools_client::PoolsClient::new(ch)
                .max_decoding_message_size(max)
                .list(pb::ListPoolsRequest { stale, limit, after })
                .await?;
            Ok(r.map(|r| (r.pools, r.next_after)))
        })
        .await
    }

    // ---- nodes ---------------------------------------------------------------------------

    /// Every node (of `pool`, when not empty).
    pub async fn list_nodes(&self, pool: &str, stale: bool) -> Result<Vec<pb::NodeInfo>, ClientError> {
        self.pages(None, |ch, after, limit| {
            let req = pb::ListNodesRequest { pool: pool.to_owned(), stale, limit, after };
            let mut c = self.nodes(ch);
            async move {
                let r = c.list(req).await?;
                Ok(r.map(|r| (r.nodes, r.next_after)))
            }
        })
        .await
    }

    /// One node.
    pub async fn get_node(&self, id: &str, stale: bool) -> Result<pb::NodeInfo, ClientError> {
        self.call(|ch| {
            let req = pb::GetNodeRequest { id: id.to_owned(), stale };
            let mut c = self.nodes(ch);
            async move { c.get(req).await }
        })
        .await
    }

    /// Cordons, drains or uncordons a node.
    pub async fn set_node_mode(&self, req: pb::SetNodeModeRequest) -> Result<(), ClientError> {
        self.call(|ch| {
            let req = req.clone();
            let mut c = self.nodes(ch);
            async move { c.set_mode(req).await }
        })
        .await
        .map(drop)
    }

    /// Ends the quarantine of a device (the agent resets and checks it first); returns how
    /// many times that device's quarantine has been cleared.
    pub async fn clear_quarantine(&self, node: &str, device: &str) -> Result<u64, ClientError> {
        self.call(|ch| {
            let req = pb::ClearQuarantineRequest { id: node.to_owned(), device: device.to_owned() };
            let mut c = self.nodes(ch);
            async move { c.clear_quarantine(req).await }
        })
        .await
        .map(|r| r.clears)
    }

    /// Registers a node (as an agent does).
    pub async fn register_node(&self, req: &pb::RegisterNodeRequest) -> Result<pb::RegisterNodeResponse, ClientError> {
        self.call(|ch| {
            let req = req.clone();
            let mut c = self.agent(ch);
            async move { c.register(req).await }
        })
        .await
    }

    /// One heartbeat of a registered node.
    pub async fn heartbeat(&self, req: &pb::HeartbeatRequest) -> Result<pb::HeartbeatResponse, ClientError> {
        self.call(|ch| {
            let req = req.clone();
            let mut c = self.agent(ch);
            async move { c.heartbeat(req).await }
        })
        .await
    }

    /// Reports how an allocation is doing (as an agent does): `end` and `exit_code_set` say
    /// how it ended, for an ended one.
    pub async fn report_status(&self, req: &pb::ReportStatusRequest) -> Result<(), ClientError> {
        self.call(|ch| {
            let req = req.clone();
            let mut c = self.agent(ch);
            async move { c.report_status(req).await }
        })
        .await
        .map(drop)
    }

    /// Reports a committed, stored checkpoint (as an agent does): step, wall time, size and,
    /// for a hardware-bound one, the device kind, model and count it restores onto.
    pub async fn report_checkpoint(&self, req: &pb::ReportCheckpointRequest) -> Result<(), ClientError> {
        self.call(|ch| {
            let req = req.clone();
            let mut c = self.agent(ch);
            async move { c.report_checkpoint(req).await }
        })
        .await
        .map(drop)
    }

    /// A task's log from the agent at `agent_addr` (direct, not through the servers).
    pub async fn agent_logs(
        &self,
        agent_addr: &str,
        req: pb::LogsRequest,
    ) -> Result<tonic::Streaming<pb::LogChunk>, ClientError> {
        if agent_addr.is_empty() {
            return Err(ClientError::Config {
                field: "agent_addr".into(),
                message: "the node's agent did not register a log address".into(),
            });
        }
        let ch = self.direct(agent_addr)?;
        Ok(pb::agent_logs_client::AgentLogsClient::new(ch).logs(req).await?.into_inner())
    }

    // ---- cluster -------------------------------------------------------------------------

    /// The members as the answering server sees them.
    pub async fn members(&self) -> Result<pb::MembersResponse, ClientError> {
        self.call(|ch| {
            let mut c = self.cluster(ch);
            async move { c.members(pb::MembersRequest {}).await }
        })
        .await
    }

    /// The current leader.
    pub async fn leader(&self) -> Result<pb::LeaderResponse, ClientError> {
        self.call(|ch| {
            let mut c = self.cluster(ch);
            async move { c.leader(pb::LeaderRequest {}).await }
        })
        .await
    }

    /// Adds a server.
    pub async fn add_server(&self, req: pb::AddServerRequest) -> Result<(), ClientError> {
        self.call(|ch| {
            let req = req.clone();
            let mut c = self.cluster(ch);
            async move { c.add_server(req).await }
        })
        .await
        .map(drop)
    }

    /// Removes a server.
    pub async fn remove_server(&self, id: u64) -> Result<(), ClientError> {
        self.call(|ch| {
            let mut c = self.cluster(ch);
            async move { c.remove_server(pb::RemoveServerRequest { id }).await }
        })
        .await
        .map(drop)
    }

    /// Builds a snapshot now.
    pub async fn snapshot(&self) -> Result<pb::SnapshotResponse, ClientError> {
        self.call(|ch| {
            let mut c = self.cluster(ch);
            async move { c.snapshot(pb::SnapshotRequest {}).await }
        })
        .await
    }

    /// The answering server's build, command kinds and halt state.
    pub async fn version(&self) -> Result<pb::VersionResponse, ClientError> {
        self.call(|ch| {
            let mut c = self.cluster(ch);
            async move { c.version(pb::VersionRequest {}).await }
        })
        .await
    }

    /// The replicated configuration as JSON, and the state revision it was read at.
    pub async fn get_config(&self, stale: bool) -> Result<pb::GetConfigResponse, ClientError> {
        self.call(|ch| {
            let mut c = self.cluster(ch);
            async move { c.get_config(pb::GetConfigRequest { stale }).await }
        })
        .await
    }

    /// Changes fields of the replicated configuration: each `(path, JSON value)` pair sets one
    /// field (`checkpoint_store` = `"file:///shared/ckpt"`). Answers the new configuration.
    /// Safe to retry: the same values set again change nothing.
    pub async fn set_config(
        &self,
        set: impl IntoIterator<Item = (String, String)>,
    ) -> Result<pb::SetConfigResponse, ClientError> {
        let set: std::collections::BTreeMap<String, String> = set.into_iter().collect();
        self.call(|ch| {
            let req = pb::SetConfigRequest { set: set.clone() };
            let mut c = self.cluster(ch);
            async move { c.set_config(req).await }
        })
        .await
    }

    /// Skips the log entry the group halted at.
    pub async fn skip_entry(&self, index: u64, kind: &str) -> Result<pb::SkipEntryResponse, ClientError> {
        self.call(|ch| {
            let req = pb::SkipEntryRequest { index, kind: kind.to_owned() };
            let mut c = self.cluster(ch);
            async move { c.skip_entry(req).await }
        })
        .await
    }

    /// One member's digest of its applied log at `index`, asked at `addr` directly.
    pub async fn digest_at(&self, addr: &str, index: u64, wait_ms: u64) -> Result<pb::DigestResponse, ClientError> {
        let ch = self.direct(addr)?;
        Ok(self.cluster(ch).digest(pb::DigestRequest { index, wait_ms }).await?.into_inner())
    }

    /// An online backup's bytes (call on a [`Connection::streaming`] connection): refused past
    /// `max_bytes`, or when the stream is silent for `stall`.
    pub async fn backup(&self, max_bytes: u64, stall: Duration) -> Result<Vec<u8>, ClientError> {
        let mut stream = self
            .call(|ch| {
                let mut c = pb::cluster_client::ClusterClient::new(ch).max_decoding_message_size(4 << 20);
                async move { c.backup(pb::BackupRequest {}).await }
            })
            .await?;
        let mut bytes: Vec<u8> = Vec::new();
        loop {
            let m = tokio::time::timeout(stall, stream.message())
                .await
                .map_err(|_| ClientError::Stalled { what: "backup", after: stall })??;
            let Some(chunk) = m else { break };
            if (bytes.len() + chunk.data.len()) as u64 > max_bytes {
                return Err(ClientError::TooLarge { what: "the backup", limit: max_bytes });
            }
            bytes.extend_from_slice(&chunk.data);
        }
        Ok(bytes)
    }

    // ---- access --------------------------------------------------------------------------

    fn access(&self, ch: Channel) -> pb::access_client::AccessClient<Channel> {
        pb::access_client::AccessClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    /// Who the answering server takes this caller to be.
    pub async fn whoami(&self) -> Result<pb::WhoAmIResponse, ClientError> {
        self.call(|ch| {
            let mut c = self.access(ch);
            async move { c.who_am_i(pb::WhoAmIRequest {}).await }
        })
        .await
    }

    /// Creates a bearer token for `name` with `role` (and `team`, required for members) valid
    /// `ttl_s` seconds. Answers the token (shown once: the cluster keeps only its id and
    /// claims), its id and expiry. Not retried after an answer is lost: a lost answer leaves
    /// at most an unused token behind, which expires (or `revoke_token` it).
    pub async fn create_token(
        &self,
        name: &str,
        role: &str,
        team: &str,
        ttl_s: u64,
    ) -> Result<pb::CreateTokenResponse, ClientError> {
        self.call(|ch| {
            let req =
                pb::CreateTokenRequest { name: name.to_owned(), role: role.to_owned(), team: team.to_owned(), ttl_s };
            let mut c = self.access(ch);
            async move { c.create_token(req).await }
        })
        .await
    }

    /// Revokes a token by id; answers the log index of the revocation. Safe to retry.
    pub async fn revoke_token(&self, id: &str) -> Result<u64, ClientError> {
        let r = self
            .call(|ch| {
                let req = pb::RevokeTokenRequest { id: id.to_owned() };
                let mut c = self.access(ch);
                async move { c.revoke_token(req).await }
            })
            .await?;
        Ok(r.index)
    }

    /// Every token issued and not yet expired, revoked ones included, by id (all pages).
    pub async fn list_tokens(&self) -> Result<Vec<pb::TokenInfo>, ClientError> {
        self.pages(None, |ch, after, limit| {
            let mut c = self.access(ch);
            async move {
                let r = c.list_tokens(pb::ListTokensRequest { limit, after }).await?;
                Ok(r.map(|r| (r.tokens, r.next_after)))
            }
        })
        .await
    }

    /// One page of the audit log: records after `req.after_seq` matching its filters.
    pub async fn audit_page(&self, req: pb::AuditRequest) -> Result<pb::AuditResponse, ClientError> {
        self.call(|ch| {
            let req = req.clone();
            let mut c = self.access(ch);
            async move { c.audit(req).await }
        })
        .await
    }

    /// Up to `cap` audit records after `after_seq` whose caller and method contain the given
    /// texts (empty: any), oldest first, following pages. Answers them and the seq to pass as
    /// `after_seq` for more (0 when the log held no more).
    pub async fn audit(
        &self,
        after_seq: u64,
        principal: &str,
        method: &str,
        cap: u32,
    ) -> Result<(Vec<pb::AuditRecord>, u64), ClientError> {
        let mut out: Vec<pb::AuditRecord> = Vec::new();
        let mut after = after_seq;
        loop {
            let want = (cap as usize).saturating_sub(out.len()).min(PAGE as usize) as u32;
            if want == 0 {
                return Ok((out, after));
            }
            let req = pb::AuditRequest {
                after_seq: after,
                limit: want,
                principal: principal.to_owned(),
                method: method.to_owned(),
            };
            let p = self.audit_page(req).await?;
            out.extend(p.records);
            if p.next_after_seq == 0 {
                return Ok((out, 0));
            }
            if p.next_after_seq <= after {
                return Err(ClientError::Protocol("an audit page token that does not advance".into()));
            }
            after = p.next_after_seq;
        }
    }
}
