//! The state machine: records, `apply`, snapshots and the scheduler's view.

use crate::command::{
    AllocReady, AllocStatus, ApplyPlan, CancelJob, ClearQuarantine, Command, CommandError, DeleteQueue, DeviceHealth,
    MigrateJob, NodeCondition, NodeDown, NodeMode, PlanOutcome, RegisterNode, ReportCheckpoint, ReportedStatus,
    Response, SetNodeMode, SubmitJob, UpdateConfig, UpsertQueue,
};
use crate::config::StateConfig;
use crate::records::{
    Alloc, AllocState, AttemptRecord, AvoidNode, CheckpointRecord, Desired, DrainPlan, EndClass, Job, JobState,
    MAX_ATTEMPT_HISTORY, MigrationTarget, NodeRecord, NodeStatus, Nomination, StopReason,
};
use crate::usage::{LiveIndex, Usage};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::error::{check_value, quote};
use suanli_model::{AllocId, Health, JobId, NodeId, Queue, QueueId};
use suanli_scheduler::{ClusterView, PendingJob};
use thiserror::Error;

/// Whether a handled command changed the state (only changes bump the revision).
pub(crate) enum Effect {
    Changed,
    Unchanged,
}

pub(crate) type Applied = Result<(Response, Effect), CommandError>;

/// Version of the snapshot format this build writes and reads.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// Debug builds check [`State::invariants`] after every state-changing command while the state
/// holds at most this many jobs plus allocations; above it, at every k-th revision (k = size /
/// this + 1), which bounds the amortized cost of the linear check per command.
#[cfg(debug_assertions)]
const DEBUG_INVARIANTS_EVERY_APPLY: usize = 256;

/// A snapshot could not be encoded or decoded.
#[derive(Debug, Error)]
pub enum SnapshotError {
    /// Malformed bytes.
    #[error("snapshot: {0}")]
    Codec(#[from] serde_json::Error),
    /// Written by a newer format.
    #[error("snapshot: format {found} is not supported; this build reads format {supported}")]
    Format {
        /// Format in the snapshot.
        found: u32,
        /// Format this build reads.
        supported: u32,
    },
    /// The snapshot's configuration is invalid.
    #[error("snapshot: {0}")]
    Config(#[from] crate::config::ConfigError),
}

/// The replicated state. Every field is ordered (BTreeMap), and apply reads no clock, so the
/// same commands in the same order give the same state on every replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub(crate) config: StateConfig,
    /// Latest `now` seen; time never goes backwards even if leaders' clocks disagree.
    pub(crate) clock: u64,
    /// Bumped by every command that changed something.
    pub(crate) revision: u64,
    pub(crate) next_job: u64,
    pub(crate) next_alloc: u64,
    pub(crate) next_finish: u64,
    pub(crate) queues: BTreeMap<QueueId, Queue>,
    pub(crate) nodes: BTreeMap<NodeId, NodeRecord>,
    pub(crate) jobs: BTreeMap<JobId, Job>,
    pub(crate) allocs: BTreeMap<AllocId, Alloc>,
    /// client_request_id -> job, for as long as the job is retained.
    pub(crate) requests: BTreeMap<String, JobId>,
    /// Jobs not finished.
    pub(crate) live_jobs: BTreeSet<JobId>,
    /// Finished jobs in finishing order (finish sequence -> job), oldest forgotten first.
    pub(crate) finished: BTreeMap<u64, JobId>,
    /// The rolling digest of the replicated log up to the last entry applied, kept here by
    /// the raft layer (`suanli_raft::Machine::set_log_digest`) so that snapshots carry it;
    /// `cluster check` compares it across servers. Bookkeeping of the log, not state: left
    /// out of [`State::state_hash`] (a refused command changes it), carried in the snapshot
    /// envelope; 0 in snapshots of earlier builds.
    #[serde(skip)]
    pub(crate) log_digest: u64,
    /// What live allocations use: derived from `allocs` and `nodes`, never serialized (so
    /// neither in snapshots nor in the state hash), rebuilt on restore.
    #[serde(skip)]
    pub(crate) live: LiveIndex,
    /// Queues that are some queue's parent (jobs go to leaf queues only): derived from
    /// `queues`, never serialized, rebuilt on restore and whenever a queue changes.
    #[serde(skip)]
    pub(crate) parents: BTreeSet<QueueId>,
    /// The cluster's identity ([`Command::SetClusterId`]; empty until the first leader sets
    /// it). Not written while empty, so states from before it hash as they did.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) cluster_id: String,
    /// Token key, tokens and the audit log ([`crate::security`]). Not written while empty, so
    /// states from before it hash as they did.
    #[serde(default, skip_serializing_if = "crate::security::SecurityState::is_empty")]
    pub(crate) security: crate::security::SecurityState,
    /// The cost ledger ([`crate::cost`]). Not written while empty, so states from before it
    /// hash as they did.
    #[serde(default, skip_serializing_if = "crate::cost::Ledger::is_empty")]
    pub(crate) cost: crate::cost::Ledger,
    /// The federation's quota leases to this region ([`crate::federated::FedQuotaLeases`]),
    /// sorted by (team, device model). Not written while empty, so states from before them
    /// hash as they did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) fed_quota: Vec<crate::federated::FedQuotaLease>,
}

#[derive(Serialize, Deserialize)]
struct SnapshotEnvelope<S> {
    format: u32,
    state: S,
    /// [`State::log_digest`] at the snapshot.
    #[serde(default)]
    log_digest: u64,
}

impl Default for State {
    fn default() -> Self {
        Self::new(StateConfig::default())
    }
}

/// Cuts a message to `max` bytes on a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// A cluster id is 1 to 64 characters of `[0-9a-z-]`.
fn check_cluster_id(id: &str) -> Result<(), CommandError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-')
    {
        return Err(CommandError::Invalid {
            field: "id".into(),
            message: format!("a cluster id is 1 to 64 characters of [0-9a-z-]; got {} bytes", id.len()),
        });
    }
    Ok(())
}

impl State {
    /// An empty state with `config` (validate it first; every replica must start from the
    /// same configuration, so servers should start from the default and change it with
    /// [`Command::UpdateConfig`]).
    pub fn new(config: StateConfig) -> Self {
        Self {
            config,
            clock: 0,
            revision: 0,
            next_job: 1,
            next_alloc: 1,
            next_finish: 0,
            queues: BTreeMap::new(),
            nodes: BTreeMap::new(),
            jobs: BTreeMap::new(),
            allocs: BTreeMap::new(),
            requests: BTreeMap::new(),
            live_jobs: BTreeSet::new(),
            finished: BTreeMap::new(),
            log_digest: 0,
            live: LiveIndex::default(),
            parents: BTreeSet::new(),
            cluster_id: String::new(),
            security: Default::default(),
            cost: crate::cost::Ledger::default(),
            fed_quota: Vec::new(),
        }
    }

    /// The rolling digest of the log applied so far (see `cluster check`).
    pub fn log_digest(&self) -> u64 {
        self.log_digest
    }

    /// Records the log digest after an entry was applied (the raft layer computes it).
    pub fn set_log_digest(&mut self, digest: u64) {
        self.log_digest = digest;
    }

    /// The cluster's identity (empty until the first leader set it).
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// Replaces the cluster id outside the log: only for building a new cluster's first state
    /// offline (`suanli cluster restore`), never on a running replica.
    pub fn reset_cluster_id(&mut self, id: &str) -> Result<(), CommandError> {
        check_cluster_id(id)?;
        id.clone_into(&mut self.cluster_id);
        Ok(())
    }

    /// The replicated configuration.
    pub fn config(&self) -> &StateConfig {
        &self.config
    }
    /// Latest time seen in a command (seconds).
    pub fn clock(&self) -> u64 {
        self.clock
    }
    /// Number of state-changing commands applied; a watch can resume from a revision.
    pub fn revision(&self) -> u64 {
        self.revision
    }
    /// Every queue.
    pub fn queues(&self) -> &BTreeMap<QueueId, Queue> {
        &self.queues
    }
    /// Every node.
    pub fn nodes(&self) -> &BTreeMap<NodeId, NodeRecord> {
        &self.nodes
    }
    /// Every retained job.
    pub fn jobs(&self) -> &BTreeMap<JobId, Job> {
        &self.jobs
    }
    /// One job.
    pub fn job(&self, id: JobId) -> Option<&Job> {
        self.jobs.get(&id)
    }
    /// The job a client request id created, while that job is retained.
    pub fn job_by_request(&self, client_request_id: &str) -> Option<&Job> {
        self.requests.get(client_request_id).and_then(|id| self.jobs.get(id))
    }
    /// Every retained allocation.
    pub fn allocs(&self) -> &BTreeMap<AllocId, Alloc> {
        &self.allocs
    }
    /// Allocations on one node (live and recently ended), for the node's agent, in id order.
    pub fn allocs_on(&self, node: &NodeId) -> impl Iterator<Item = &Alloc> {
        self.live.by_node.get(node).into_iter().flatten().filter_map(|id| self.allocs.get(id))
    }
    /// Jobs that are not finished.
    pub fn live_job_count(&self) -> usize {
        self.live_jobs.len()
    }

    /// Serializes the whole state (with its format version).
    pub fn snapshot(&self) -> Result<Vec<u8>, SnapshotError> {
        Ok(serde_json::to_vec(&SnapshotEnvelope { format: SNAPSHOT_FORMAT, state: self, log_digest: self.log_digest })?)
    }

    /// Rebuilds a state from [`State::snapshot`] bytes.
    pub fn restore(bytes: &[u8]) -> Result<State, SnapshotError> {
        #[derive(Deserialize)]
        struct Header {
            format: u32,
        }
        let h: Header = serde_json::from_slice(bytes)?;
        if h.format != SNAPSHOT_FORMAT {
            return Err(SnapshotError::Format { found: h.format, supported: SNAPSHOT_FORMAT });
        }
        let e: SnapshotEnvelope<State> = serde_json::from_slice(bytes)?;
        e.state.config.validate()?;
        let mut s = e.state;
        s.log_digest = e.log_digest;
        s.live = LiveIndex::build(&s.allocs, &s.nodes, &s.jobs);
        s.reindex_parents();
        Ok(s)
    }

    /// A digest of the whole state: equal states hash equal on every replica and build.
    /// (FNV-1a over the canonical JSON encoding, in two lanes for 128 bits.)
    pub fn state_hash(&self) -> u128 {
        let bytes = serde_json::to_vec(self).expect("a state of plain data always serializes to JSON");
        let mut a: u64 = 0xcbf2_9ce4_8422_2325;
        let mut b: u64 = 0x8422_2325_cbf2_9ce4;
        for &x in &bytes {
            a = (a ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
            b = (b ^ u64::from(x.rotate_left(3))).wrapping_mul(0x0000_0100_0000_01b3);
        }
        (u128::from(a) << 64) | u128::from(b)
    }

    /// Applies one command. Deterministic: time comes from the command, never a clock. A
    /// rejected command leaves the state unchanged.
    ///
    /// In debug builds every command that changed the state is followed by
    /// [`invariants()`](State::invariants), and a violation panics with the command's kind
    /// (see `DEBUG_INVARIANTS_EVERY_APPLY` for the sampling on large states).
    pub fn apply(&mut self, cmd: Command) -> Response {
        #[cfg(debug_assertions)]
        let (before, kind) = (self.revision, cmd.kind().to_owned());
        let resp = self.apply_one(cmd);
        #[cfg(debug_assertions)]
        self.debug_check_invariants(before, &kind);
        resp
    }

    /// Runs [`invariants()`](State::invariants) after a command that changed the state: after
    /// every one while the state holds at most `DEBUG_INVARIANTS_EVERY_APPLY` jobs,
    /// allocations and nodes, then at every k-th revision with k = size / that bound + 1, so
    /// the amortized cost per command stays bounded (the check is linear in the state).
    #[cfg(debug_assertions)]
    fn debug_check_invariants(&self, before: u64, kind: &str) {
        if self.revision == before || self.double_assign_victim().is_some() {
            // Unchanged (rejected or a no-op), or deliberately broken by a failpoint.
            return;
        }
        let size = self.jobs.len() + self.allocs.len() + self.nodes.len();
        let every = (size / DEBUG_INVARIANTS_EVERY_APPLY + 1) as u64;
        // A batch advances many revisions at once: check when it crossed a multiple of k.
        if before / every == self.revision / every {
            return;
        }
        if let Err(v) = self.invariants() {
            panic!("applying a {kind} command at revision {} broke the state: {v}", self.revision);
        }
    }

    fn apply_one(&mut self, cmd: Command) -> Response {
        let rev = self.revision + 1;
        let result = match cmd {
            Command::UpsertQueue(c) => self.upsert_queue(c, rev),
            Command::DeleteQueue(c) => self.delete_queue(c),
            Command::RegisterNode(c) => self.register_node(*c, rev),
            Command::SetNodeMode(c) => self.set_node_mode(c),
            Command::NodeDown(c) => self.node_down(c, rev),
            Command::DeviceHealth(c) => self.device_health(c, rev),
            Command::NodeCondition(c) => self.node_condition(c),
            Command::ClearQuarantine(c) => self.clear_quarantine(c),
            Command::SubmitJob(c) => self.submit_job(*c, rev),
            Command::CancelJob(c) => self.cancel_job(c, rev),
            Command::ApplyPlan(c) => self.apply_plan_and_follow(c, rev),
            Command::AllocStatus(c) => self.alloc_status(c, rev),
            Command::AllocReady(c) => self.alloc_ready(c, rev),
            Command::ReportCheckpoint(c) => self.report_checkpoint(c, rev),
            Command::UpdateConfig(c) => self.update_config(*c),
            Command::SetClusterId(c) => self.set_cluster_id(c),
            Command::MigrateJob(c) => self.migrate_job(c, rev),
            Command::UpdateService(c) => self.update_service(*c, rev),
            Command::IssueToken(c) => self.issue_token(*c),
            Command::RevokeToken(c) => self.revoke_token(c),
            Command::RecordAudit(c) => self.record_audit(c),
            Command::FedAdopt(c) => self.fed_adopt(*c, rev),
            Command::FedRenew(c) => self.fed_renew(c, rev),
            Command::FedRelease(c) => self.fed_release(c, rev),
            Command::FedQuotaLeases(c) => self.fed_quota_leases(c),
            Command::SetPrices(c) => self.set_prices(c),
            Command::Batch(b) => return self.apply_batch(b),
            // Read only while halted, by the raft layer; met here, the entry was applied.
            Command::SkipEntry(c) => Err(CommandError::Conflict {
                field: "index".into(),
                message: format!("entry {} was applied on this server: nothing to skip", c.index),
            }),
            Command::Unknown { kind, ignorable: true, .. } => return Response::Ignored { kind },
            Command::Unknown { kind, ignorable: false, .. } => return Response::Unsupported { kind },
        };
        match result {
            Ok((resp, Effect::Changed)) => {
                self.revision = rev;
                self.advance_drains(rev);
                resp
            }
            Ok((resp, Effect::Unchanged)) => resp,
            Err(e) => Response::Rejected(e),
        }
    }

    fn apply_batch(&mut self, b: crate::command::Batch) -> Response {
        if b.commands.len() > self.config.max_plan_entries {
            return Response::Rejected(CommandError::TooMany {
                what: "commands in one batch".into(),
                limit: self.config.max_plan_entries,
            });
        }
        if b.commands.iter().any(|c| matches!(c, Command::Batch(_))) {
            return Response::Rejected(CommandError::Invalid {
                field: "batch.commands".into(),
                message: "a batch may not contain a batch".into(),
            });
        }
        Response::Batch(b.commands.into_iter().map(|c| self.apply_one(c)).collect())
    }

    pub(crate) fn tick(&mut self, now: u64) -> u64 {
        self.clock = self.clock.max(now);
        self.clock
    }

    // ---- queues --------------------------------------------------------------------------

    fn upsert_queue(&mut self, c: UpsertQueue, _rev: u64) -> Applied {
        let q = c.queue;
        q.validate(&self.config.limits)?;
        if !self.queues.contains_key(&q.id) && self.queues.len() >= self.config.max_queues {
            return Err(CommandError::TooMany { what: "queues".into(), limit: self.config.max_queues });
        }
        if let Some(p) = &q.parent {
            if !self.queues.contains_key(p) {
                return Err(CommandError::UnknownQueue { queue: p.to_string() });
            }
            // Walking up from the parent must not come back to this queue.
            let mut cur = Some(p.clone());
            let mut steps = 0;
            while let Some(id) = cur {
                if id == q.id || steps > self.queues.len() {
                    return Err(CommandError::Invalid {
                        field: "queue.parent".into(),
                        message: format!("parent {p} would make a cycle through {}", q.id),
                    });
                }
                steps += 1;
                cur = self.queues.get(&id).and_then(|x| x.parent.clone());
            }
        }
        if let Some(p) = &q.parent
            && !self.parents.contains(p)
            && let Some(j) = self.live_jobs.iter().filter_map(|id| self.jobs.get(id)).find(|j| &j.spec.queue == p)
        {
            return Err(CommandError::Conflict {
                field: "queue.parent".into(),
                message: format!("queue {p} still has live job {}; jobs run in leaf queues only", j.id),
            });
        }
        let id = q.id.clone();
        self.queues.insert(id.clone(), q);
        self.reindex_parents();
        self.reflag_borrowed(&id);
        Ok((Response::Done, Effect::Changed))
    }

    /// Rebuilds the set of parent queues from `queues` (queue changes are rare).
    fn reindex_parents(&mut self) {
        self.parents = self.queues.values().filter_map(|q| q.parent.clone()).collect();
    }

    /// When a queue's nominal quota shrinks below what runs on it, the newest, lowest-priority
    /// allocations beyond the quota are re-labelled as borrowed (reclaimable), so "non-borrowed
    /// usage fits the nominal quota" keeps holding without stopping anything.
    fn reflag_borrowed(&mut self, q: &QueueId) {
        let Some(nominal) = self.queues.get(q).map(|x| x.nominal) else {
            return;
        };
        let mut own: Vec<(i32, std::cmp::Reverse<AllocId>)> = Vec::new();
        let mut used = suanli_model::ResVec::ZERO;
        for a in self.allocs.values() {
            if a.is_live() && !a.alloc.borrowed && &a.alloc.queue == q {
                used += crate::usage::alloc_resvec(a, &self.nodes);
                own.push((a.alloc.priority, std::cmp::Reverse(a.alloc.id)));
            }
        }
        own.sort();
        for (_, std::cmp::Reverse(id)) in own {
            if used.fits_within(&nominal) {
                break;
            }
            let v = match self.allocs.get(&id) {
                Some(a) => crate::usage::alloc_resvec(a, &self.nodes),
                None => continue,
            };
            if let Some(a) = self.allocs.get_mut(&id) {
                std::sync::Arc::make_mut(&mut a.alloc).borrowed = true;
            }
            used = used.saturating_sub(&v);
        }
    }

    fn delete_queue(&mut self, c: DeleteQueue) -> Applied {
        if !self.queues.contains_key(&c.queue) {
            return Err(CommandError::UnknownQueue { queue: c.queue.to_string() });
        }
        if let Some(child) = self.queues.values().find(|q| q.parent.as_ref() == Some(&c.queue)) {
            return Err(CommandError::Conflict {
                field: "queue".into(),
                message: format!("queue {} is the parent of {}", c.queue, child.id),
            });
        }
        if let Some(j) = self.live_jobs.iter().filter_map(|id| self.jobs.get(id)).find(|j| j.spec.queue == c.queue) {
            return Err(CommandError::Conflict {
                field: "queue".into(),
                message: format!("queue {} still has live job {}", c.queue, j.id),
            });
        }
        if self.allocs.values().any(|a| a.is_live() && a.alloc.queue == c.queue) {
            return Err(CommandError::Conflict {
                field: "queue".into(),
                message: format!("queue {} still has live allocations", c.queue),
            });
        }
        self.queues.remove(&c.queue);
        self.reindex_parents();
        Ok((Response::Done, Effect::Changed))
    }

    fn set_cluster_id(&mut self, c: crate::command::SetClusterId) -> Applied {
        check_cluster_id(&c.id)?;
        if self.cluster_id == c.id {
            return Ok((Response::Done, Effect::Unchanged));
        }
        if !self.cluster_id.is_empty() {
            return Err(CommandError::Conflict {
                field: "id".into(),
                message: format!("the cluster id is already {}; it never changes", self.cluster_id),
            });
        }
        self.cluster_id = c.id;
        Ok((Response::Done, Effect::Changed))
    }

    fn update_config(&mut self, c: UpdateConfig) -> Applied {
        c.config.validate()?;
        self.fit_security_to(&c.config)?;
        self.config = c.config;
        Ok((Response::Done, Effect::Changed))
    }

    // ---- nodes ---------------------------------------------------------------------------

    fn node_rec(&self, node: &NodeId) -> Result<&NodeRecord, CommandError> {
        self.nodes.get(node).ok_or_else(|| CommandError::UnknownNode { node: node.to_string() })
    }

    fn register_node(&mut self, c: RegisterNode, rev: u64) -> Applied {
        c.node.validate(&self.config.limits)?;
        let known_mode = self.nodes.get(&c.node.id).map(|r| r.mode);
        let pressure = self.nodes.get(&c.node.id).map(|r| r.pressure.clone()).unwrap_or_default();
        if known_mode.is_none() && self.nodes.len() >= self.config.max_nodes {
            return Err(CommandError::TooMany { what: "nodes".into(), limit: self.config.max_nodes });
        }
        let now = self.tick(c.now);
        let mode =
            known_mode.map_or(if c.node.schedulable { NodeMode::Schedulable } else { NodeMode::Cordoned }, |m| m);
        let id = c.node.id.clone();
        let old_kinds: BTreeMap<String, suanli_model::DeviceKind> = self
            .nodes
            .get(&id)
            .map(|r| r.node.devices.iter().map(|d| (d.id.clone(), d.kind)).collect())
            .unwrap_or_default();
        let mut node = c.node;
        node.schedulable = mode == NodeMode::Schedulable;
        let drain = self.nodes.get(&id).and_then(|r| r.drain.clone());
        // Clears of devices the node still has: a gone device's count goes with it.
        let mut quarantine_clears = self.nodes.get(&id).map(|r| r.quarantine_clears.clone()).unwrap_or_default();
        quarantine_clears.retain(|d, _| node.devices.iter().any(|x| &x.id == d));
        // Reasons of devices still unhealthy in the new inventory (the agent repeats them).
        let mut device_reasons = self.nodes.get(&id).map(|r| r.device_reasons.clone()).unwrap_or_default();
        device_reasons.retain(|d, _| node.devices.iter().any(|x| &x.id == d && x.health == Health::Unhealthy));
        self.nodes.insert(
            id.clone(),
            NodeRecord {
                node,
                status: NodeStatus::Ready,
                mode,
                updated_at: now,
                reason: String::new(),
                fence: c.fence,
                pressure,
                drain,
                quarantine_clears,
                device_reasons,
            },
        );
        let kinds_changed = self.nodes.get(&id).is_some_and(|r| {
            r.node.devices.iter().map(|d| (d.id.clone(), d.kind)).collect::<BTreeMap<_, _>>() != old_kinds
        });
        self.cost_node(&id);
        self.reconcile_node(&id, &old_kinds, now, rev);
        // The node's device kinds decide the quota vector of its allocations: when they changed
        // (a device added, gone or of another kind), count afresh. A plain re-registration
        // (an agent restart) leaves the index as it is.
        if kinds_changed {
            self.live = LiveIndex::build(&self.allocs, &self.nodes, &self.jobs);
        }
        Ok((Response::Done, Effect::Changed))
    }

    /// After a node's inventory changed: allocations on devices it no longer has (or that
    /// changed kind), or beyond its CPU or memory, are lost; allocations on unhealthy devices
    /// are asked to stop.
    fn reconcile_node(
        &mut self,
        id: &NodeId,
        old_kinds: &BTreeMap<String, suanli_model::DeviceKind>,
        now: u64,
        rev: u64,
    ) {
        let Some(rec) = self.nodes.get(id) else {
            return;
        };
        let node = rec.node.clone();
        let live: Vec<AllocId> = self.allocs_on(id).filter(|a| a.is_live()).map(|a| a.alloc.id).collect();
        let mut lost = Vec::new();
        let mut keep = Vec::new();
        let mut dev_use: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for aid in &live {
            let Some(a) = self.allocs.get(aid) else {
                continue;
            };
            let mut ok = true;
            for s in &a.alloc.devices {
                match node.devices.iter().find(|d| d.id == s.device) {
                    None => ok = false,
                    Some(d) if old_kinds.get(&d.id).is_some_and(|k| *k != d.kind) => ok = false,
                    Some(d) => {
                        let e = dev_use.entry(d.id.as_str()).or_default();
                        e.0 += u64::from(s.milli);
                        e.1 += s.memory_mib;
                        if e.0 > u64::from(suanli_model::WHOLE_DEVICE_MILLI) || (d.memory_mib > 0 && e.1 > d.memory_mib)
                        {
                            ok = false;
                        }
                    }
                }
            }
            if ok { keep.push(*aid) } else { lost.push(*aid) }
        }
        // CPU and memory: keep the oldest allocations that fit.
        let (mut cpu, mut mem) = (0u64, 0u64);
        let mut fitting = Vec::new();
        for aid in keep {
            let Some(a) = self.allocs.get(&aid) else {
                continue;
            };
            let (c2, m2) = (cpu.saturating_add(a.alloc.cpu_milli), mem.saturating_add(a.alloc.memory_mib));
            if c2 <= node.cpu_milli && m2 <= node.memory_mib {
                cpu = c2;
                mem = m2;
                fitting.push(aid);
            } else {
                lost.push(aid);
            }
        }
        for aid in lost {
            let why = "node re-registered without the resources it used";
            self.end_alloc(aid, AllocState::Lost, Some(EndClass::DeviceError), None, why, now, rev);
        }
        let unhealthy: BTreeSet<&str> =
            node.devices.iter().filter(|d| d.health == Health::Unhealthy).map(|d| d.id.as_str()).collect();
        for aid in fitting {
            let uses_bad = self
                .allocs
                .get(&aid)
                .is_some_and(|a| a.alloc.devices.iter().any(|s| unhealthy.contains(s.device.as_str())));
            if uses_bad {
                self.stop_for_requeue(aid, StopReason::DeviceUnhealthy, now, rev);
            }
        }
    }

    fn set_node_mode(&mut self, c: SetNodeMode) -> Applied {
        self.node_rec(&c.node)?;
        let now = self.tick(c.now);
        if let Some(r) = self.nodes.get_mut(&c.node) {
            let was_draining = r.mode == NodeMode::Draining && r.drain.is_some();
            r.drain = match (c.mode, c.drain) {
                (NodeMode::Draining, Some(o)) => Some(DrainPlan {
                    // Cluster time counts whole seconds: one more makes the grace at least
                    // `grace_s` of real time (a drain at 100.9 s is time 100).
                    deadline: if o.grace_s == 0 { now } else { now.saturating_add(o.grace_s).saturating_add(1) },
                    max_unavailable: o.max_unavailable,
                    // Jobs already away count against the new budget too.
                    moving: r.drain.take().map(|d| d.moving).unwrap_or_default(),
                }),
                (NodeMode::Draining, None) if was_draining => r.drain.take(),
                (NodeMode::Draining, None) => Some(DrainPlan { deadline: now, ..DrainPlan::default() }),
                _ => None,
            };
            r.mode = c.mode;
            r.node.schedulable = c.mode == NodeMode::Schedulable;
            r.updated_at = now;
        }
        // Evicting what is due happens after every change ([`State::advance_drains`]).
        Ok((Response::Done, Effect::Changed))
    }

    // ---- drains --------------------------------------------------------------------------

    /// Whether a job evicted by a drain is back (running elsewhere) or over.
    fn settled(&self, id: JobId) -> bool {
        self.jobs.get(&id).is_none_or(|j| {
            matches!(j.state, JobState::Running | JobState::Succeeded | JobState::Failed | JobState::Cancelled)
        })
    }

    /// The live allocations on `node` still asked to run, by job (job order: deterministic).
    fn runnable_on(&self, node: &NodeId) -> BTreeMap<JobId, Vec<AllocId>> {
        let mut by_job: BTreeMap<JobId, Vec<AllocId>> = BTreeMap::new();
        for a in self.allocs_on(node).filter(|a| a.is_live() && a.desired == Desired::Run) {
            by_job.entry(a.alloc.job).or_default().push(a.alloc.id);
        }
        by_job
    }

    /// How many more jobs the drain of `node` may evict now (0 before its deadline).
    fn drain_room(&self, node: &NodeId, now: u64) -> usize {
        let Some(plan) = self.nodes.get(node).and_then(|r| r.drain.as_ref()) else {
            return 0;
        };
        if plan.deadline > now {
            return 0;
        }
        if plan.max_unavailable == 0 {
            return usize::MAX;
        }
        let away = plan.moving.iter().filter(|j| !self.settled(**j)).count();
        (plan.max_unavailable as usize).saturating_sub(away)
    }

    /// Moves every drain along at the state's time: forgets evicted jobs that are back, and
    /// once a drain's grace period is over evicts the jobs still running on its node, as many
    /// at once as its budget allows (each through the preemption path: the whole attempt
    /// stops, checkpointing first where the job allows it, and is requeued elsewhere).
    /// Called after every command that changed the state, so time and reports drive it.
    fn advance_drains(&mut self, rev: u64) {
        let now = self.clock;
        let draining: Vec<NodeId> =
            self.nodes.iter().filter(|(_, r)| r.drain.is_some()).map(|(id, _)| id.clone()).collect();
        for node in draining {
            let settled: Vec<JobId> = self
                .nodes
                .get(&node)
                .and_then(|r| r.drain.as_ref())
                .map(|p| p.moving.iter().copied().filter(|j| self.settled(*j)).collect())
                .unwrap_or_default();
            if let Some(p) = self.nodes.get_mut(&node).and_then(|r| r.drain.as_mut()) {
                for j in settled {
                    p.moving.remove(&j);
                }
            }
            let room = self.drain_room(&node, now);
            if room == 0 {
                continue;
            }
            for (job, allocs) in self.runnable_on(&node).into_iter().take(room) {
                for aid in allocs {
                    self.stop_for_requeue(aid, StopReason::Drain, now, rev);
                }
                if let Some(p) = self.nodes.get_mut(&node).and_then(|r| r.drain.as_mut()) {
                    p.moving.insert(job);
                }
            }
        }
    }

    /// Draining nodes where work is due for eviction at `now` (grace over, budget free) but
    /// still runs: the leader proposes a [`SetNodeMode`] without a plan for each, which
    /// evicts it (the state machine reads no clock, so time must come in a command).
    pub fn drains_due(&self, now: u64) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(id, r)| r.drain.is_some() && self.drain_room(id, now) > 0 && !self.runnable_on(id).is_empty())
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn node_down(&mut self, c: NodeDown, rev: u64) -> Applied {
        self.node_rec(&c.node)?;
        let now = self.tick(c.now);
        let reason = cut(&c.reason, self.config.max_message_len);
        if let Some(r) = self.nodes.get_mut(&c.node) {
            r.status = NodeStatus::Down;
            r.updated_at = now;
            r.reason = reason.clone();
        }
        self.cost_node(&c.node);
        let live: Vec<AllocId> = self.allocs_on(&c.node).filter(|a| a.is_live()).map(|a| a.alloc.id).collect();
        let msg = if reason.is_empty() { "node down".to_owned() } else { format!("node down: {reason}") };
        for aid in live {
            self.end_alloc(aid, AllocState::Lost, Some(EndClass::NodeLost), None, &msg, now, rev);
        }
        Ok((Response::Done, Effect::Changed))
    }

    fn node_condition(&mut self, c: NodeCondition) -> Applied {
        self.node_rec(&c.node)?;
        let now = self.tick(c.now);
        let pressure = cut(&c.pressure, self.config.max_message_len);
        if let Some(r) = self.nodes.get_mut(&c.node) {
            r.pressure = pressure;
            r.updated_at = now;
        }
        Ok((Response::Done, Effect::Changed))
    }

    fn clear_quarantine(&mut self, c: ClearQuarantine) -> Applied {
        let rec = self.node_rec(&c.node)?;
        if !rec.node.devices.iter().any(|d| d.id == c.device) {
            return Err(CommandError::UnknownDevice { node: c.node.to_string(), device: c.device });
        }
        let now = self.tick(c.now);
        if let Some(r) = self.nodes.get_mut(&c.node) {
            let n = r.quarantine_clears.entry(c.device).or_default();
            *n = n.saturating_add(1);
            r.updated_at = now;
        }
        Ok((Response::Done, Effect::Changed))
    }

    fn device_health(&mut self, c: DeviceHealth, rev: u64) -> Applied {
        let rec = self.node_rec(&c.node)?;
        if !rec.node.devices.iter().any(|d| d.id == c.device) {
            return Err(CommandError::UnknownDevice { node: c.node.to_string(), device: c.device });
        }
        let now = self.tick(c.now);
        let reason = cut(&c.reason, self.config.max_message_len);
        if let Some(r) = self.nodes.get_mut(&c.node) {
            for d in r.node.devices.iter_mut().filter(|d| d.id == c.device) {
                d.health = c.health;
            }
            if c.health == Health::Unhealthy && !reason.is_empty() {
                r.device_reasons.insert(c.device.clone(), reason);
            } else {
                r.device_reasons.remove(&c.device);
            }
            r.updated_at = now;
        }
        if c.health == Health::Unhealthy {
            let hit: Vec<AllocId> = self
                .allocs_on(&c.node)
                .filter(|a| a.is_live() && a.alloc.devices.iter().any(|s| s.device == c.device))
                .map(|a| a.alloc.id)
                .collect();
            for aid in hit {
                self.stop_for_requeue(aid, StopReason::DeviceUnhealthy, now, rev);
            }
        }
        Ok((Response::Done, Effect::Changed))
    }

    // ---- jobs ----------------------------------------------------------------------------

    pub(crate) fn submit_job(&mut self, c: SubmitJob, rev: u64) -> Applied {
        let rid = &c.client_request_id;
        if rid.is_empty() {
            return Err(CommandError::Invalid {
                field: "client_request_id".into(),
                message: "must not be empty".into(),
            });
        }
        check_value(|| "client_request_id".into(), rid, self.config.max_request_id_len)?;
        // An omitted retry policy means the configured default: a retry must resolve to the
        // same policy as the first submission, or it is a different request.
        let retry = c.retry.unwrap_or(self.config.default_retry);
        if let Some(&id) = self.requests.get(rid) {
            let same = self.jobs.get(&id).is_some_and(|j| j.spec == c.spec && j.retry == retry);
            if !same {
                return Err(CommandError::Conflict {
                    field: "client_request_id".into(),
                    message: format!(
                        "{} was already used for job {id} with a different spec or retry policy",
                        quote(rid)
                    ),
                });
            }
            // A retry: the state is unchanged and the first job is the answer.
            return Ok((Response::JobSubmitted { job: id, created: false }, Effect::Unchanged));
        }
        c.spec.validate(&self.config.limits)?;
        if !self.queues.contains_key(&c.spec.queue) {
            return Err(CommandError::UnknownQueue { queue: c.spec.queue.to_string() });
        }
        if self.parents.contains(&c.spec.queue) {
            return Err(CommandError::Conflict {
                field: "queue".into(),
                message: format!(
                    "{} is a parent queue; jobs are submitted to leaf queues only",
                    quote(c.spec.queue.as_str())
                ),
            });
        }
        retry.validate(&self.config)?;
        if self.live_jobs.len() >= self.config.max_live_jobs {
            return Err(CommandError::TooMany { what: "live jobs".into(), limit: self.config.max_live_jobs });
        }
        let now = self.tick(c.now);
        let id = JobId(self.next_job);
        self.next_job += 1;
        self.jobs.insert(
            id,
            Job {
                id,
                client_request_id: rid.clone(),
                spec: c.spec,
                retry,
                state: JobState::Pending,
                submitted_at: now,
                updated_at: now,
                revision: rev,
                attempt: 0,
                failures: 0,
                requeues: 0,
                not_before: 0,
                reason: String::new(),
                allocs: Vec::new(),
                latest_checkpoint: None,
                history: Vec::new(),
                nomination: None,
                migration: None,
                avoid: None,
                infra_requeues: 0,
                lost_device_s: 0,
                federation: None,
                trace: c.trace,
                first_placed_at: None,
                first_running_at: None,
                restarts: 0,
                restart_streak: 0,
                version: 0,
                old_specs: BTreeMap::new(),
                scale_out: None,
                scale_outs: Vec::new(),
                world_gen: 0,
            },
        );
        self.requests.insert(c.client_request_id, id);
        self.live_jobs.insert(id);
        self.live.pending.insert(id);
        Ok((Response::JobSubmitted { job: id, created: true }, Effect::Changed))
    }

    fn cancel_job(&mut self, c: CancelJob, rev: u64) -> Applied {
        let job = self.jobs.get(&c.job).ok_or(CommandError::UnknownJob { job: c.job.0 })?;
        match job.state {
            JobState::Cancelled => return Ok((Response::Done, Effect::Unchanged)),
            s if s.is_terminal() => {
                return Err(CommandError::Conflict {
                    field: "job".into(),
                    message: format!("job {} already {}", c.job, s.as_str()),
                });
            }
            _ => {}
        }
        let now = self.tick(c.now);
        let reason =
            if c.reason.is_empty() { "cancelled".to_owned() } else { cut(&c.reason, self.config.max_message_len) };
        self.finish(c.job, JobState::Cancelled, StopReason::Cancelled, &reason, now, rev);
        Ok((Response::Done, Effect::Changed))
    }

    /// Marks a job finished, tells its live allocations to stop, and forgets the oldest
    /// finished jobs beyond the retention limit.
    pub(crate) fn finish(&mut self, id: JobId, state: JobState, why: StopReason, reason: &str, now: u64, rev: u64) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        job.state = state;
        job.reason = reason.to_owned();
        job.updated_at = now;
        job.revision = rev;
        job.nomination = None;
        job.migration = None;
        let allocs = job.allocs.clone();
        self.live_jobs.remove(&id);
        self.live.pending.remove(&id);
        self.finished.insert(self.next_finish, id);
        self.next_finish += 1;
        for aid in allocs {
            self.ask_stop(aid, why.clone(), now);
        }
        self.forget_finished();
    }

    fn forget_finished(&mut self) {
        let retained = self.jobs.len().saturating_sub(self.live_jobs.len());
        let mut excess = retained.saturating_sub(self.config.max_retained_jobs);
        if excess == 0 {
            return;
        }
        let mut drop = Vec::new();
        for (&seq, &id) in &self.finished {
            if excess == 0 {
                break;
            }
            let busy = self
                .jobs
                .get(&id)
                .is_some_and(|j| j.allocs.iter().any(|a| self.allocs.get(a).is_some_and(Alloc::is_live)));
            if !busy {
                drop.push((seq, id));
                excess -= 1;
            }
        }
        for (seq, id) in drop {
            self.finished.remove(&seq);
            if let Some(job) = self.jobs.remove(&id) {
                for a in &job.allocs {
                    if let Some(x) = self.allocs.remove(a) {
                        self.live.forget(&x);
                    }
                }
                if self.requests.get(&job.client_request_id) == Some(&id) {
                    self.requests.remove(&job.client_request_id);
                }
            }
        }
    }

    /// Sets an allocation's desired state to stop (once; the first reason wins).
    pub(crate) fn ask_stop(&mut self, aid: AllocId, reason: StopReason, now: u64) {
        let Some(a) = self.allocs.get_mut(&aid) else {
            return;
        };
        if !a.is_live() || a.desired != Desired::Run {
            return;
        }
        let saves = matches!(
            reason,
            StopReason::Preempted { .. } | StopReason::Drain | StopReason::DeviceUnhealthy | StopReason::Migrate
        );
        let grace = a.alloc.checkpoint_grace_s.filter(|_| saves);
        a.desired =
            Desired::Stop { reason, checkpoint_first: grace.is_some(), grace_s: grace.unwrap_or(0), since: now };
        a.updated_at = now;
    }

    /// Stops an allocation whose job must move (drain, unhealthy device): the whole attempt
    /// stops and the job is requeued once every allocation has ended.
    fn stop_for_requeue(&mut self, aid: AllocId, reason: StopReason, now: u64, rev: u64) {
        let Some(job_id) = self.allocs.get(&aid).map(|a| a.alloc.job) else {
            return;
        };
        // An elastic job's surplus replica: the job shrinks and keeps running.
        if self.shrink_elastic(aid, reason.clone(), now, rev) {
            return;
        }
        self.ask_stop(aid, reason.clone(), now);
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return;
        };
        // A service keeps serving: only this replica moves, replaced when it has stopped.
        if matches!(job.state, JobState::Placed | JobState::Running) && !job.spec.is_service() {
            job.state = JobState::Requeuing;
            job.reason = format!("moving: {}", stop_text(&reason));
            job.updated_at = now;
            job.revision = rev;
            let others = job.allocs.clone();
            for o in others {
                self.ask_stop(o, StopReason::Requeue, now);
            }
        }
    }

    /// Marks a live allocation ended and moves its job along. `seen` is how it ended as the
    /// agent saw it, or as the state machine decided (a node declared down); the reason a stop
    /// was ordered for wins over it ([`classify_end`]).
    #[allow(clippy::too_many_arguments)]
    fn end_alloc(
        &mut self,
        aid: AllocId,
        state: AllocState,
        seen: Option<EndClass>,
        exit_code: Option<i32>,
        message: &str,
        now: u64,
        rev: u64,
    ) {
        let max = self.config.max_message_len;
        let avoid_s = self.config.avoid_failed_node_s;
        let Some(a) = self.allocs.get(&aid) else {
            return;
        };
        if !a.is_live() {
            return;
        }
        let job_id = a.alloc.job;
        let class = classify_end(&a.desired, state, seen);
        // The job's latest checkpoint counts for every allocation of the attempt that wrote it.
        let job_ckpt = self
            .jobs
            .get(&job_id)
            .and_then(|j| j.latest_checkpoint.as_ref())
            .filter(|c| c.epoch == a.alloc.epoch)
            .map(|c| c.at);
        let lost = if class == EndClass::Succeeded { 0 } else { lost_device_s(&a.alloc, job_ckpt, now) };
        let since_ckpt = a.alloc.last_checkpoint_at.unwrap_or(0).max(job_ckpt.unwrap_or(0));
        let nominee = match &a.desired {
            Desired::Stop { reason: StopReason::Preempted { for_job }, .. } => Some(*for_job),
            _ => None,
        };
        self.cost_close(aid, class, since_ckpt);
        let Some(a) = self.allocs.get_mut(&aid) else {
            return;
        };
        self.live.add(a, &self.nodes, -1);
        a.state = state;
        a.updated_at = now;
        a.message = cut(message, max);
        a.end = Some(class);
        a.exit_code = exit_code;
        a.lost_device_s = lost;
        a.ready = false;
        let stop_requested = a.desired != Desired::Run;
        let node = a.alloc.node.clone();
        if let Some(j) = self.jobs.get_mut(&job_id) {
            j.lost_device_s = j.lost_device_s.saturating_add(lost);
            if class.avoids_node() && avoid_s > 0 && !j.state.is_terminal() {
                j.avoid = Some(AvoidNode { node, until: now.saturating_add(avoid_s) });
            }
        }
        if let Some(p) = nominee {
            self.victim_ended(p, aid, rev);
        }
        self.on_alloc_ended(job_id, aid, state, class, stop_requested, message, now, rev);
    }

    /// One of the allocations preempted for job `p` ended: its pending reason says how many
    /// it still waits for.
    fn victim_ended(&mut self, p: JobId, aid: AllocId, rev: u64) {
        let Some(n) = self.jobs.get(&p).and_then(|j| j.nomination.as_ref()) else {
            return;
        };
        if !n.victims.contains(&aid) {
            return;
        }
        let left = n.victims.iter().filter(|v| self.allocs.get(v).is_some_and(Alloc::is_live)).count();
        let max = self.config.max_message_len;
        if let Some(j) = self.jobs.get_mut(&p)
            && j.state == JobState::Pending
        {
            j.reason = cut(&nomination_reason(left), max);
            j.revision = rev;
        }
    }

    fn job_has_live(&self, id: JobId) -> bool {
        self.jobs.get(&id).is_some_and(|j| j.allocs.iter().any(|a| self.allocs.get(a).is_some_and(Alloc::is_live)))
    }

    #[allow(clippy::too_many_arguments)]
    fn on_alloc_ended(
        &mut self,
        id: JobId,
        aid: AllocId,
        ended: AllocState,
        class: EndClass,
        stop_requested: bool,
        message: &str,
        now: u64,
        rev: u64,
    ) {
        let max = self.config.max_message_len;
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        if job.spec.is_service() && matches!(job.state, JobState::Placed | JobState::Running) && !ended.is_live() {
            self.replace_replica(id, aid, ended, class, stop_requested, message, now, rev);
            return;
        }
        if !ended.is_live() && self.elastic_replica_ended(id, aid, class, message, now, rev) {
            return;
        }
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        match job.state {
            JobState::Placed | JobState::Running => match ended {
                AllocState::Succeeded => {
                    let all_done =
                        job.allocs.iter().all(|a| self.allocs.get(a).is_some_and(|x| x.state == AllocState::Succeeded));
                    if all_done {
                        self.finish(id, JobState::Succeeded, StopReason::JobFailed, "succeeded", now, rev);
                    } else if let Some(j) = self.jobs.get_mut(&id) {
                        j.state = JobState::Running;
                        j.updated_at = now;
                        j.revision = rev;
                    }
                }
                // Not the application's doing: requeued without using up an attempt.
                AllocState::Failed if !class.is_infrastructure() => {
                    let (failures, max_attempts, others) =
                        (job.failures + 1, job.retry.max_attempts, job.allocs.clone());
                    let reason = cut(&format!("attempt {} failed: {message}", job.attempt), max);
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.failures = failures;
                    }
                    if failures >= max_attempts {
                        self.finish(id, JobState::Failed, StopReason::JobFailed, &reason, now, rev);
                    } else {
                        for o in others {
                            self.ask_stop(o, StopReason::JobFailed, now);
                        }
                        if let Some(j) = self.jobs.get_mut(&id) {
                            j.state = JobState::Requeuing;
                            j.not_before = now.saturating_add(j.retry.backoff_s(failures));
                            j.reason = reason;
                            j.updated_at = now;
                            j.revision = rev;
                        }
                        self.requeue_when_stopped(id, now, rev);
                    }
                }
                AllocState::Failed | AllocState::Stopped | AllocState::Lost => {
                    let others = job.allocs.clone();
                    for o in others {
                        self.ask_stop(o, StopReason::Requeue, now);
                    }
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.state = JobState::Requeuing;
                        let word = match ended {
                            AllocState::Lost => "lost",
                            AllocState::Failed => class.as_str(),
                            _ => "stopped",
                        };
                        j.reason = cut(
                            &format!("{word} {}: {message}", if stop_requested { "as asked" } else { "unexpectedly" }),
                            max,
                        );
                        j.updated_at = now;
                        j.revision = rev;
                    }
                    self.requeue_when_stopped(id, now, rev);
                }
                AllocState::Pending | AllocState::Running => {}
            },
            JobState::Preempted | JobState::Requeuing => self.requeue_when_stopped(id, now, rev),
            JobState::Pending | JobState::Succeeded | JobState::Failed | JobState::Cancelled => {
                if let Some(j) = self.jobs.get_mut(&id) {
                    j.revision = rev;
                }
                self.forget_finished();
            }
        }
    }

    /// A stopping job whose allocations have all ended goes back to pending (or fails when it
    /// used up its attempts).
    fn requeue_when_stopped(&mut self, id: JobId, now: u64, rev: u64) {
        if self.job_has_live(id) {
            return;
        }
        let max_total = self.config.max_total_attempts;
        let max_infra = self.config.max_infra_requeues;
        let infra = self.job(id).is_some_and(|j| self.attempt_was_infrastructure(j));
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        if !matches!(job.state, JobState::Preempted | JobState::Requeuing) {
            return;
        }
        job.requeues = job.requeues.saturating_add(1);
        if infra {
            job.infra_requeues = job.infra_requeues.saturating_add(1);
        }
        if job.requeues >= max_total {
            let reason = format!("gave up after {} attempts; last: {}", job.requeues, job.reason);
            self.finish(id, JobState::Failed, StopReason::JobFailed, &reason, now, rev);
            return;
        }
        if infra && job.infra_requeues >= max_infra {
            let reason = format!(
                "gave up after {} requeues for infrastructure causes (max_infra_requeues {max_infra}); last: {}",
                job.infra_requeues, job.reason
            );
            self.finish(id, JobState::Failed, StopReason::JobFailed, &reason, now, rev);
            return;
        }
        job.state = JobState::Pending;
        job.updated_at = now;
        job.revision = rev;
        self.live.pending.insert(id);
        // The ended attempt's allocations are not needed any more: agents treat an unknown
        // allocation as one to stop.
        let old = std::mem::take(&mut job.allocs);
        self.retire_allocs(id, &old);
    }

    /// Moves ended allocations of job `id` out of the live table into its history (the
    /// newest [`MAX_ATTEMPT_HISTORY`] kept) and out of its allocation list.
    pub(crate) fn retire_allocs(&mut self, id: JobId, ended: &[AllocId]) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        job.allocs.retain(|a| !ended.contains(a));
        for a in ended {
            if let Some(x) = self.allocs.remove(a) {
                job.history.push(AttemptRecord {
                    attempt: x.alloc.epoch,
                    alloc: x.alloc.id,
                    group: x.alloc.group,
                    replica: x.alloc.replica,
                    node: x.alloc.node.clone(),
                    started_at: x.alloc.started_at,
                    ended_at: x.updated_at,
                    state: x.state,
                    message: x.message.clone(),
                    end: x.end,
                    exit_code: x.exit_code,
                    lost_device_s: x.lost_device_s,
                    restored_step: x.restored_step,
                });
                self.live.forget(&x);
            }
        }
        let over = job.history.len().saturating_sub(MAX_ATTEMPT_HISTORY);
        job.history.drain(..over);
    }

    /// Whether the ended attempt of `j` (its allocations, all ended) stopped for
    /// infrastructure causes: some allocation ended that way and none by the application's
    /// own failure (exit, oom, start_failed).
    fn attempt_was_infrastructure(&self, j: &Job) -> bool {
        let ends: Vec<EndClass> = j.allocs.iter().filter_map(|a| self.allocs.get(a)).filter_map(|a| a.end).collect();
        ends.iter().any(|e| e.is_infrastructure())
            && !ends.iter().any(|e| matches!(e, EndClass::Exit | EndClass::Oom | EndClass::StartFailed))
    }

    // ---- plans ---------------------------------------------------------------------------

    /// Applies a plan (`plan.rs`), then follows up on what it committed: jobs that preempted
    /// others hold the freed capacity ([`Job::nomination`]); placed jobs drop their
    /// nomination and migration target and their allocations note the checkpoint step they
    /// restore from; unplaced jobs drop a hold that ran out, and those whose hardware-bound
    /// checkpoint needs a device model no schedulable node has say so.
    fn apply_plan_and_follow(&mut self, c: ApplyPlan, rev: u64) -> Applied {
        let unplaced: Vec<JobId> = c.plan.unplaced.iter().map(|u| u.job).collect();
        let (resp, effect) = self.apply_plan(c, rev)?;
        if let Response::PlanApplied(out) = &resp {
            self.after_plan(out, &unplaced, rev);
        }
        Ok((resp, effect))
    }

    fn after_plan(&mut self, out: &PlanOutcome, unplaced: &[JobId], rev: u64) {
        let now = self.clock;
        let max = self.config.max_message_len;
        // Victims by the job they were stopped for: every allocation of a victim's attempt
        // (a gang stops whole).
        let mut victims: BTreeMap<JobId, BTreeSet<AllocId>> = BTreeMap::new();
        for aid in &out.preempted {
            let Some(job) = self.allocs.get(aid).and_then(|a| self.jobs.get(&a.alloc.job)) else {
                continue;
            };
            for x in job.allocs.iter().filter_map(|x| self.allocs.get(x)).filter(|x| x.is_live()) {
                if let Desired::Stop { reason: StopReason::Preempted { for_job }, .. } = &x.desired {
                    victims.entry(*for_job).or_default().insert(x.alloc.id);
                }
            }
        }
        for (p, set) in victims {
            let left = set.len();
            if let Some(j) = self.jobs.get_mut(&p)
                && j.state == JobState::Pending
            {
                let mut all = j.nomination.take().map(|n| n.victims).unwrap_or_default();
                all.extend(set);
                j.nomination = Some(Nomination { victims: all, since: now });
                j.reason = cut(&nomination_reason(left), max);
                j.revision = rev;
            }
        }
        let mut placed: BTreeSet<JobId> = BTreeSet::new();
        for aid in &out.placed {
            let Some(job) = self.allocs.get(aid).map(|a| a.alloc.job) else {
                continue;
            };
            let step = self.jobs.get(&job).and_then(|j| j.latest_checkpoint.as_ref()).map(|c| c.step);
            if let Some(a) = self.allocs.get_mut(aid) {
                a.restored_step = step;
            }
            placed.insert(job);
        }
        for id in placed {
            if let Some(j) = self.jobs.get_mut(&id) {
                j.nomination = None;
                j.migration = None;
            }
        }
        // A hold whose victims outstayed their grace ended: the job competed like any other.
        let expired: Vec<JobId> = unplaced
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter(|j| j.nomination.is_some() && matches!(self.nomination_wait(j, now), NominationWait::None))
            .map(|j| j.id)
            .collect();
        for id in expired {
            if let Some(j) = self.jobs.get_mut(&id) {
                j.nomination = None;
                j.revision = rev;
            }
        }
        let needs_hardware = unplaced.iter().any(|id| {
            self.jobs.get(id).is_some_and(|j| j.latest_checkpoint.as_ref().is_some_and(|c| c.hardware.is_some()))
        });
        if !needs_hardware {
            return;
        }
        let models: BTreeSet<(suanli_model::DeviceKind, &str)> = self
            .nodes
            .values()
            .filter(|r| r.accepts_work())
            .flat_map(|r| r.node.devices.iter().map(|d| (d.kind, d.model.as_str())))
            .collect();
        let waiting: Vec<(JobId, String)> = unplaced
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter(|j| j.state == JobState::Pending)
            .filter_map(|j| {
                let h = j.latest_checkpoint.as_ref()?.hardware.as_ref()?;
                (!models.contains(&(h.kind, h.model.as_str())))
                    .then(|| (j.id, format!("waiting for hardware its checkpoint needs: {} x{}", h.model, h.count)))
            })
            .collect();
        for (id, why) in waiting {
            if let Some(j) = self.jobs.get_mut(&id)
                && j.reason != why
            {
                j.reason = cut(&why, max);
                j.revision = rev;
            }
        }
    }

    // ---- migration -----------------------------------------------------------------------

    /// `job migrate`: the job's attempt stops checkpoint-first and its next attempt goes
    /// where the target allows (elsewhere than it ran when no node is named).
    fn migrate_job(&mut self, c: MigrateJob, rev: u64) -> Applied {
        let job = self.jobs.get(&c.job).ok_or(CommandError::UnknownJob { job: c.job.0 })?;
        if !matches!(job.state, JobState::Placed | JobState::Running) {
            return Err(CommandError::Conflict {
                field: "job".into(),
                message: format!("job {} is {}; only a placed or running job can migrate", c.job, job.state.as_str()),
            });
        }
        let own = &job.spec.constraints;
        if let Some(p) = &c.to_pool {
            if !self.nodes.values().any(|r| &r.node.pool == p) {
                return Err(CommandError::Invalid {
                    field: "to_pool".into(),
                    message: format!("no registered node is in pool {}", quote(p.as_str())),
                });
            }
            if !own.pools.is_empty() && !own.pools.contains(p) {
                return Err(CommandError::Invalid {
                    field: "to_pool".into(),
                    message: format!("job {}'s constraints do not allow pool {}", c.job, quote(p.as_str())),
                });
            }
        }
        if let Some(n) = &c.to_node {
            let Some(r) = self.nodes.get(n) else {
                return Err(CommandError::Invalid {
                    field: "to_node".into(),
                    message: format!("{} is not a registered node", quote(n.as_str())),
                });
            };
            let pool_ok = c.to_pool.as_ref().is_none_or(|p| &r.node.pool == p)
                && (own.pools.is_empty() || own.pools.contains(&r.node.pool));
            if !pool_ok {
                return Err(CommandError::Invalid {
                    field: "to_node".into(),
                    message: format!("node {} is in pool {}, which the target does not allow", n, r.node.pool),
                });
            }
            if (!own.nodes.is_empty() && !own.nodes.contains(n)) || own.avoid_nodes.contains(n) {
                return Err(CommandError::Invalid {
                    field: "to_node".into(),
                    message: format!("job {}'s constraints do not allow node {}", c.job, quote(n.as_str())),
                });
            }
        }
        let allocs = job.allocs.clone();
        let now = self.tick(c.now);
        for aid in allocs {
            self.ask_stop(aid, StopReason::Migrate, now);
        }
        if let Some(j) = self.jobs.get_mut(&c.job) {
            j.migration = Some(MigrationTarget { pool: c.to_pool, node: c.to_node });
            j.state = JobState::Requeuing;
            j.reason = format!("moving: {}", stop_text(&StopReason::Migrate));
            j.updated_at = now;
            j.revision = rev;
        }
        Ok((Response::Done, Effect::Changed))
    }

    // ---- agent reports -------------------------------------------------------------------

    fn check_report(&self, alloc: AllocId, epoch: u64) -> Result<&Alloc, CommandError> {
        let a = self.allocs.get(&alloc).ok_or(CommandError::UnknownAlloc { alloc: alloc.0 })?;
        if a.alloc.epoch != epoch {
            return Err(CommandError::StaleEpoch { alloc: alloc.0, reported: epoch, current: a.alloc.epoch });
        }
        Ok(a)
    }

    fn alloc_status(&mut self, c: AllocStatus, rev: u64) -> Applied {
        check_reported_end(&c)?;
        let a = self.check_report(c.alloc, c.epoch)?.clone();
        let target = match c.status {
            ReportedStatus::Running => AllocState::Running,
            ReportedStatus::Succeeded => AllocState::Succeeded,
            ReportedStatus::Failed => AllocState::Failed,
            ReportedStatus::Stopped => AllocState::Stopped,
        };
        if a.state == target {
            return Ok((Response::Done, Effect::Unchanged)); // a repeated report
        }
        if !a.is_live() {
            return Err(CommandError::Conflict {
                field: "status".into(),
                message: format!("allocation {} already ended as {:?}; cannot become {:?}", c.alloc, a.state, target),
            });
        }
        let now = self.tick(c.now);
        if target == AllocState::Running {
            let max = self.config.max_message_len;
            let job_id = a.alloc.job;
            if let Some(a) = self.allocs.get_mut(&c.alloc) {
                a.state = AllocState::Running;
                a.updated_at = now;
                a.message = cut(&c.message, max);
                std::sync::Arc::make_mut(&mut a.alloc).started_at = now;
            }
            if let Some(j) = self.jobs.get_mut(&job_id) {
                j.first_running_at.get_or_insert(now);
                if j.state == JobState::Placed {
                    j.state = JobState::Running;
                    j.updated_at = now;
                    j.revision = rev;
                }
            }
        } else {
            self.end_alloc(c.alloc, target, c.end, c.exit_code, &c.message, now, rev);
        }
        Ok((Response::Done, Effect::Changed))
    }

    fn alloc_ready(&mut self, c: AllocReady, rev: u64) -> Applied {
        if c.endpoint.len() > crate::command::MAX_ENDPOINT_LEN
            || c.endpoint.chars().any(|ch| ch.is_control() || ch.is_whitespace())
        {
            return Err(CommandError::Invalid {
                field: "endpoint".into(),
                message: format!(
                    "must be host:port, at most {} bytes, without spaces or control characters",
                    crate::command::MAX_ENDPOINT_LEN
                ),
            });
        }
        if let Some(l) = c.latency_us.filter(|l| *l > crate::command::MAX_LATENCY_US) {
            return Err(CommandError::Invalid {
                field: "latency_us".into(),
                message: format!("{l} must be at most {} (an hour)", crate::command::MAX_LATENCY_US),
            });
        }
        if let Some(p) = c.success_ppm.filter(|p| *p > crate::command::MAX_SUCCESS_PPM) {
            return Err(CommandError::Invalid {
                field: "success_ppm".into(),
                message: format!("{p} must be at most {} (a ratio of 1)", crate::command::MAX_SUCCESS_PPM),
            });
        }
        let a = self.check_report(c.alloc, c.epoch)?;
        if !a.is_live() {
            return Err(CommandError::Conflict {
                field: "alloc".into(),
                message: format!("allocation {} already ended as {:?}", c.alloc, a.state),
            });
        }
        let measured = c.load_milli.is_some() || c.latency_us.is_some() || c.success_ppm.is_some();
        if a.ready == c.ready && a.endpoint == c.endpoint && !measured {
            return Ok((Response::Done, Effect::Unchanged));
        }
        let job_id = a.alloc.job;
        let now = self.tick(c.now);
        if let Some(a) = self.allocs.get_mut(&c.alloc) {
            a.ready = c.ready;
            a.endpoint = c.endpoint;
            a.updated_at = now;
            if let Some(l) = c.load_milli {
                a.load = Some((l, now));
            }
            if let Some(l) = c.latency_us {
                a.latency_us = Some((l, now));
            }
            if let Some(p) = c.success_ppm {
                a.success_ppm = Some((p, now));
            }
        }
        if let Some(j) = self.jobs.get_mut(&job_id) {
            if c.ready {
                j.restart_streak = 0;
            }
            j.revision = rev;
        }
        // A replica that became ready may let a rolling update stop an old one, and may
        // complete a scale-up.
        self.advance_rollout(job_id, now, rev);
        self.note_scale_out(job_id, now);
        Ok((Response::Done, Effect::Changed))
    }

    fn report_checkpoint(&mut self, c: ReportCheckpoint, rev: u64) -> Applied {
        let a = self.check_report(c.alloc, c.epoch)?;
        if !a.is_live() {
            return Err(CommandError::Conflict {
                field: "alloc".into(),
                message: format!("allocation {} already ended", c.alloc),
            });
        }
        if c.uri.is_empty() || c.uri.len() > self.config.max_uri_len {
            return Err(CommandError::Invalid {
                field: "uri".into(),
                message: format!("{} bytes; must be between 1 and {} bytes", c.uri.len(), self.config.max_uri_len),
            });
        }
        if let Some(h) = &c.hardware {
            if h.model.is_empty() || h.model.len() > self.config.limits.max_name_len {
                return Err(CommandError::Invalid {
                    field: "hardware.model".into(),
                    message: format!(
                        "{} bytes; must be between 1 and {} bytes",
                        h.model.len(),
                        self.config.limits.max_name_len
                    ),
                });
            }
            if h.count == 0 {
                return Err(CommandError::Invalid {
                    field: "hardware.count".into(),
                    message: "0 devices; a hardware-bound checkpoint needs at least 1".into(),
                });
            }
        }
        let job_id = a.alloc.job;
        if let Some(last) = self.jobs.get(&job_id).and_then(|j| j.latest_checkpoint.as_ref())
            && c.step < last.step
        {
            return Err(CommandError::Conflict {
                field: "step".into(),
                message: format!(
                    "step {} is below the job's latest committed checkpoint (step {}); steps only grow",
                    c.step, last.step
                ),
            });
        }
        let now = self.tick(c.now);
        if let Some(a) = self.allocs.get_mut(&c.alloc) {
            std::sync::Arc::make_mut(&mut a.alloc).last_checkpoint_at = Some(now);
            a.updated_at = now;
        }
        if let Some(j) = self.jobs.get_mut(&job_id) {
            j.latest_checkpoint = Some(CheckpointRecord {
                uri: c.uri,
                step: c.step,
                size_bytes: c.size_bytes,
                at: now,
                alloc: c.alloc,
                epoch: c.epoch,
                wall_time: c.wall_time,
                hardware: c.hardware,
            });
            j.updated_at = now;
            j.revision = rev;
        }
        Ok((Response::Done, Effect::Changed))
    }

    // ---- scheduling ----------------------------------------------------------------------

    /// The immutable view the leader's scheduling loop hands to
    /// [`suanli_scheduler::schedule`]: every node (schedulable only when ready and not
    /// cordoned), every queue, jobs pending and out of backoff at `now`, and live allocations
    /// (those already stopping are not offered as preemption victims again).
    pub fn cluster_view(&self, now: u64) -> ClusterView {
        let victim = self.double_assign_victim();
        let nodes = self
            .nodes
            .values()
            .map(|r| {
                let mut n = r.node.clone();
                n.schedulable = r.accepts_work();
                n
            })
            .collect();
        let nominee_waiting = self
            .live
            .pending
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .any(|j| j.state == JobState::Pending && j.nomination.is_some());
        let pending = self
            .live
            .pending
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter(|j| j.state == JobState::Pending && j.not_before <= now)
            .filter_map(|j| self.pending_view(j, now))
            .chain(self.live_jobs.iter().filter_map(|id| self.jobs.get(id)).filter_map(|j| self.service_view(j, now)))
            // Elastic growth waits while a preemption's beneficiary waits for its victims: the
            // capacity they free is held for it, not idle.
            .filter(|p: &PendingJob| !p.grow || !nominee_waiting)
            .collect();
        // Elastic jobs' replicas: surplus (shrunk first) or minimum (taken last).
        let mut elastic: BTreeMap<AllocId, suanli_model::ElasticRole> = BTreeMap::new();
        for j in self.live_jobs.iter().filter_map(|id| self.jobs.get(id)).filter(|j| j.spec.is_elastic()) {
            let surplus = self.elastic_surplus(j);
            for aid in &j.allocs {
                let role = if surplus.contains(aid) {
                    suanli_model::ElasticRole::Surplus
                } else {
                    suanli_model::ElasticRole::Minimum
                };
                elastic.insert(*aid, role);
            }
        }
        let running = self
            .allocs
            .values()
            .filter(|a| a.is_live())
            .map(|a| {
                let mut x = a.alloc.clone();
                if a.desired != Desired::Run {
                    std::sync::Arc::make_mut(&mut x).preemptible = false;
                }
                if let Some(role) = elastic.get(&x.id) {
                    std::sync::Arc::make_mut(&mut x).elastic = *role;
                }
                if victim == Some(x.id) {
                    std::sync::Arc::make_mut(&mut x).devices.clear();
                }
                x
            })
            .collect();
        let unschedulable =
            self.nodes.values().filter_map(|r| r.unschedulable_reason().map(|why| (r.node.id.clone(), why))).collect();
        ClusterView {
            nodes,
            queues: self.queues.values().cloned().collect(),
            pending,
            running,
            workload: Vec::new(),
            unschedulable,
        }
    }

    /// How the engine sees one pending job at `now`, or `None` while it waits for the victims
    /// it preempted to stop (so no further victims are picked for it); its constraints are
    /// [`State::effective_constraints`].
    fn pending_view(&self, j: &Job, now: u64) -> Option<PendingJob> {
        let nominated = match self.nomination_wait(j, now) {
            NominationWait::None => false,
            NominationWait::Waiting => return None,
            NominationWait::Ready => true,
        };
        let mut spec = j.spec.clone();
        spec.constraints = self.effective_constraints(j, now);
        Some(PendingJob { grow: false, occupied: Vec::new(), id: j.id, spec, submitted_at: j.submitted_at, nominated })
    }

    /// A job's constraints at `now` as the scheduler's view gives them: its spec's, narrowed by
    /// what the state knows: a migration target (`pools`, `nodes`; without a target node,
    /// `avoid_nodes` gets the nodes its last attempt ran on), the node its last attempt failed
    /// on (in `avoid_nodes` until `avoid.until`), and the device model a hardware-bound
    /// checkpoint restores onto (`device_models`). A plan re-check may use it too.
    pub fn effective_constraints(&self, j: &Job, now: u64) -> suanli_model::Constraints {
        let mut c = j.spec.constraints.clone();
        if let Some(m) = &j.migration {
            if let Some(p) = &m.pool {
                c.pools = vec![p.clone()];
            }
            match &m.node {
                Some(n) => c.nodes = vec![n.clone()],
                None => {
                    for h in j.history.iter().filter(|h| h.attempt == j.attempt) {
                        if !c.avoid_nodes.contains(&h.node) {
                            c.avoid_nodes.push(h.node.clone());
                        }
                    }
                }
            }
        }
        if let Some(h) = j.latest_checkpoint.as_ref().and_then(|k| k.hardware.as_ref()) {
            c.device_models = vec![h.model.clone()];
        }
        // The failed node is avoided only while another node could run the job at all: a job
        // whose pool has one usable node goes back to it after its backoff, not after
        // `avoid_failed_node_s`.
        if let Some(a) = &j.avoid
            && now < a.until
            && !c.avoid_nodes.contains(&a.node)
            && self.another_node_could_run(j, &c, &a.node)
        {
            c.avoid_nodes.push(a.node.clone());
        }
        c
    }

    /// Whether a node other than `except`, accepting work, could hold the job under
    /// constraints `c` (pools, regions, labels, node lists, device kinds, models and counts,
    /// healthy devices only), whatever runs there now.
    fn another_node_could_run(&self, j: &Job, c: &suanli_model::Constraints, except: &NodeId) -> bool {
        let mut spec = j.spec.clone();
        spec.constraints = c.clone();
        self.nodes.values().any(|r| {
            let id = &r.node.id;
            if id == except || !r.accepts_work() || c.avoid_nodes.contains(id) {
                return false;
            }
            if !c.nodes.is_empty() && !c.nodes.contains(id) {
                return false;
            }
            let mut n = r.node.clone();
            n.schedulable = true;
            suanli_scheduler::check::usable_by(&n, &spec)
        })
    }

    /// Where a job stands with the capacity its preemptions freed.
    fn nomination_wait(&self, j: &Job, now: u64) -> NominationWait {
        let Some(n) = &j.nomination else {
            return NominationWait::None;
        };
        let live: Vec<&Alloc> = n.victims.iter().filter_map(|v| self.allocs.get(v)).filter(|a| a.is_live()).collect();
        if live.is_empty() {
            return NominationWait::Ready;
        }
        let grace = live.iter().filter_map(|a| a.alloc.checkpoint_grace_s).max().unwrap_or(0);
        if now > n.since.saturating_add(grace).saturating_add(NOMINATION_SLACK_S) {
            // The victims outstayed their grace: the job competes like any other.
            return NominationWait::None;
        }
        NominationWait::Waiting
    }

    /// The quota vector of an allocation (device shares counted by the kind its node reports).
    pub fn alloc_usage(&self, a: &Alloc) -> suanli_model::ResVec {
        crate::usage::alloc_resvec(a, &self.nodes)
    }

    /// Node and device usage counted afresh from every live allocation (the invariants'
    /// reference for [`State::live`]).
    pub(crate) fn usage(&self) -> Usage {
        let mut u = Usage::of(self.allocs.values());
        if let Some(a) = self.double_assign_victim().and_then(|id| self.allocs.get(&id)) {
            u.add(&a.alloc.node, 0, 0, &a.alloc.devices, -1);
        }
        u
    }

    /// Failpoint `state::double-assign` (feature `failpoints`; BROKEN on purpose, only for
    /// proving that the chaos harness catches an over-committed device): while armed, the live
    /// allocation with the smallest id that holds a device share is left out of device
    /// accounting, in the scheduler's view and in the plan re-check alike, so its share is
    /// handed to a second task. Apply depends on it: arm it on every server or none.
    pub(crate) fn double_assign_victim(&self) -> Option<AllocId> {
        #[cfg(feature = "failpoints")]
        if fail::eval("state::double-assign", |_| ()).is_some() {
            return self.allocs.values().find(|a| a.is_live() && !a.alloc.devices.is_empty()).map(|a| a.alloc.id);
        }
        None
    }
}

/// A few words for why an allocation was asked to stop.
pub(crate) fn stop_text(r: &StopReason) -> String {
    match r {
        StopReason::Preempted { for_job } => format!("preempted for job {for_job}"),
        StopReason::Cancelled => "cancelled".into(),
        StopReason::JobFailed => "job failed".into(),
        StopReason::Requeue => "requeued".into(),
        StopReason::Drain => "node draining".into(),
        StopReason::DeviceUnhealthy => "device unhealthy".into(),
        StopReason::Migrate => "migrated".into(),
        StopReason::Update => "replaced by the service's update".into(),
    }
}

/// How long (seconds) beyond its victims' longest checkpoint grace a job waits for them to
/// stop before it competes like any other job.
pub const NOMINATION_SLACK_S: u64 = 60;

/// Where a job stands with capacity held for it ([`State::cluster_view`]).
enum NominationWait {
    /// Nothing held (or the hold ran out): an ordinary pending job.
    None,
    /// Victims are still live: not offered to the engine.
    Waiting,
    /// Every victim ended: offered first.
    Ready,
}

/// A nominated job's pending reason while `left` victims are still stopping.
fn nomination_reason(left: usize) -> String {
    if left == 0 {
        "the capacity its preemptions freed is held for it".to_owned()
    } else {
        format!("waiting for {left} preempted allocations to stop")
    }
}

/// How an allocation ended: success stays success; otherwise the reason a stop was ordered for
/// wins over what the agent (or a node declared down) saw; otherwise what was seen; otherwise
/// what the reported state implies.
pub(crate) fn classify_end(desired: &Desired, state: AllocState, seen: Option<EndClass>) -> EndClass {
    if state == AllocState::Succeeded || seen == Some(EndClass::Succeeded) {
        return EndClass::Succeeded;
    }
    if let Desired::Stop { reason, .. } = desired {
        return match reason {
            StopReason::Preempted { .. } => EndClass::Preempted,
            StopReason::Cancelled => EndClass::Cancelled,
            StopReason::JobFailed | StopReason::Requeue => EndClass::Stopped,
            StopReason::Drain => EndClass::Drained,
            StopReason::DeviceUnhealthy => EndClass::DeviceError,
            StopReason::Migrate => EndClass::Migrated,
            StopReason::Update => EndClass::Stopped,
        };
    }
    match (seen, state) {
        (Some(c), _) => c,
        (None, AllocState::Failed) => EndClass::Exit,
        (None, AllocState::Lost) => EndClass::NodeLost,
        (None, _) => EndClass::Stopped,
    }
}

/// Device-seconds of work an allocation ending at `now` lost: the time since it started or
/// last checkpointed (its own, or `job_ckpt`, its attempt's latest), times its device shares
/// in whole devices (500 milli for 10 s is 5).
pub(crate) fn lost_device_s(a: &suanli_model::Allocation, job_ckpt: Option<u64>, now: u64) -> u64 {
    let since = a.started_at.max(a.last_checkpoint_at.unwrap_or(0)).max(job_ckpt.unwrap_or(0));
    let milli: u128 = a.devices.iter().map(|d| u128::from(d.milli)).sum();
    let lost = u128::from(now.saturating_sub(since)) * milli / u128::from(suanli_model::WHOLE_DEVICE_MILLI);
    u64::try_from(lost).unwrap_or(u64::MAX)
}

/// The ends an agent may report, and only with a status that agrees.
fn check_reported_end(c: &AllocStatus) -> Result<(), CommandError> {
    let Some(end) = c.end else {
        return Ok(());
    };
    let agent_may = matches!(
        end,
        EndClass::Succeeded
            | EndClass::Exit
            | EndClass::Oom
            | EndClass::StartFailed
            | EndClass::DeviceError
            | EndClass::Stopped
            | EndClass::NodeLost
    );
    if !agent_may {
        return Err(CommandError::Invalid {
            field: "end".into(),
            message: format!(
                "{} is decided by the state machine; an agent reports succeeded, exit, oom, start_failed, \
                 device_error, stopped or node_lost",
                end.as_str()
            ),
        });
    }
    let agrees = match c.status {
        ReportedStatus::Running => false,
        ReportedStatus::Succeeded => end == EndClass::Succeeded,
        ReportedStatus::Failed | ReportedStatus::Stopped => end != EndClass::Succeeded,
    };
    if !agrees {
        return Err(CommandError::Invalid {
            field: "end".into(),
            message: format!(
                "{} does not go with status {}",
                end.as_str(),
                match c.status {
                    ReportedStatus::Running => "running",
                    ReportedStatus::Succeeded => "succeeded",
                    ReportedStatus::Failed => "failed",
                    ReportedStatus::Stopped => "stopped",
                }
            ),
        });
    }
    Ok(())
}
