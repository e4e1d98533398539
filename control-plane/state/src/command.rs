//! Replicated commands, their wire envelope, and the responses apply returns.
//!
//! Every command travels as an envelope `{"v": 1, "kind": "submit_job", "ignorable": false,
//! "body": {...}}`. A server that meets a `kind` it does not know decodes it as
//! [`Command::Unknown`] instead of failing: if the writer marked it `ignorable`, apply skips it
//! (Nomad's `IgnoreUnknownTypeFlag`); otherwise apply answers [`Response::Unsupported`], which the
//! raft layer treats as fatal, because skipping it would let replicas diverge. The body of an
//! unknown command is kept verbatim, so re-encoding it (e.g. when an old follower replicates its
//! log) loses nothing. The envelope needs a self-describing format (JSON).

use crate::config::{ConfigError, RetryPolicy, StateConfig};
use crate::refusal::RefusalReason;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use suanli_model::error::quote;
use suanli_model::{AllocId, Health, JobId, JobSpec, Node, NodeId, Plan, Queue, QueueId, ValidationError};
use thiserror::Error;

/// Version of the command schema this build writes. Bodies evolve additively (new fields have
/// defaults); a breaking change gets a new `kind`.
pub const COMMAND_VERSION: u32 = 1;

/// Creates or replaces a queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpsertQueue {
    /// The queue as it should be.
    pub queue: Queue,
}

/// Deletes a queue that no live job and no child queue uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteQueue {
    /// The queue.
    pub queue: QueueId,
}

/// A node agent registered (or re-registered after a restart) with its inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterNode {
    /// The node as its agent sees it. `schedulable` is ignored for a known node: cordons are
    /// an operator decision and survive re-registration.
    pub node: Node,
    /// Leader's time, seconds.
    pub now: u64,
    /// The agent's fence, when it reported one: the node may be declared down only after
    /// a heartbeat TTL long enough for it under the clock drift bound (docs/control-plane.md,
    /// "Clocks"). Absent in entries written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<crate::records::AgentFence>,
}

/// Whether a node takes new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NodeMode {
    /// Takes new placements.
    #[default]
    Schedulable,
    /// No new placements; running work stays.
    Cordoned,
    /// No new placements, and running work is stopped and requeued elsewhere.
    Draining,
}

/// Cordons, drains or uncordons a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetNodeMode {
    /// The node.
    pub node: NodeId,
    /// The new mode.
    pub mode: NodeMode,
    /// Leader's time, seconds.
    pub now: u64,
    /// With [`NodeMode::Draining`]: a new drain plan (grace, budget), replacing any before.
    /// `None`: a node already draining keeps its plan (the leader sends this when a grace
    /// period has run out, to evict what is due); otherwise an immediate drain without a
    /// budget, as before drain plans existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainOptions>,
}

/// How a drain empties its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DrainOptions {
    /// Seconds running work may go on finishing by itself before it is evicted (through
    /// the preemption path: checkpoint first where the job allows it). 0: evict now.
    pub grace_s: u64,
    /// Disruption budget: at most this many jobs evicted by this drain may be away at once
    /// (stopped and not yet running again elsewhere). 0: no limit.
    pub max_unavailable: u32,
}

/// The leader saw no heartbeat within the TTL: the node's work is lost and requeued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDown {
    /// The node.
    pub node: NodeId,
    /// Why (for operators).
    #[serde(default)]
    pub reason: String,
    /// Leader's time, seconds.
    pub now: u64,
}

/// A device changed health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceHealth {
    /// The node.
    pub node: NodeId,
    /// Device id on the node.
    pub device: String,
    /// New health.
    pub health: Health,
    /// Why it is unhealthy, as its agent said (`quarantined: …`, `recovering: …`, a plugin's
    /// reason); empty for a healthy device and in entries written before it existed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Leader's time, seconds.
    pub now: u64,
}

/// A node's agent reported a condition that keeps new work off the node (disk pressure), or
/// that it cleared. Running work stays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCondition {
    /// The node.
    pub node: NodeId,
    /// Why the node takes no new work ("disk pressure: …"); empty: the condition cleared.
    #[serde(default)]
    pub pressure: String,
    /// Leader's time, seconds.
    pub now: u64,
}

/// An operator ends the quarantine of one device: the node's agent resets and health-checks
/// the device before it returns to service (docs/agent.md, "Device errors").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClearQuarantine {
    /// The node.
    pub node: NodeId,
    /// The device id on that node.
    pub device: String,
    /// Leader's time, seconds.
    pub now: u64,
}

/// A client submits a job. Retries with the same `client_request_id` return the first job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitJob {
    /// Chosen by the client, unique per intended job; a retry after a timeout reuses it.
    pub client_request_id: String,
    /// The job.
    pub spec: JobSpec,
    /// Retry policy; `None` takes the configured default.
    #[serde(default)]
    pub retry: Option<RetryPolicy>,
    /// Leader's time, seconds.
    pub now: u64,
    /// The job's root span as a W3C `traceparent` (`00-<trace>-<span>-01`), chosen by the
    /// submit handler (docs/tracing.md); absent in commands of earlier builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

/// Cancels a job; its running tasks are told to stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelJob {
    /// The job.
    pub job: JobId,
    /// Why (for operators).
    #[serde(default)]
    pub reason: String,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Commits a scheduling plan. Apply re-checks every part against the state at this index and
/// commits the parts that still hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyPlan {
    /// The engine's plan.
    pub plan: Plan,
    /// The `now` the plan was computed for (seconds).
    pub now: u64,
}

/// What an agent reports about an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportedStatus {
    /// The task started.
    Running,
    /// The task exited successfully.
    Succeeded,
    /// The task exited with an error.
    Failed,
    /// The task was stopped (as asked, or by the agent).
    Stopped,
}

/// An agent's report on one allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocStatus {
    /// The allocation.
    pub alloc: AllocId,
    /// The epoch the agent runs; a report from another epoch is refused.
    pub epoch: u64,
    /// New status.
    pub status: ReportedStatus,
    /// Exit message or error, cut to the configured length.
    #[serde(default)]
    pub message: String,
    /// How it ended, as the agent saw it (none from older agents, and for `running`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<crate::records::EndClass>,
    /// The task's exit code, when it exited by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// A service replica's readiness as its agent's checks see it (docs/services.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocReady {
    /// The allocation.
    pub alloc: AllocId,
    /// The epoch the agent runs; a report from another epoch is refused.
    pub epoch: u64,
    /// Whether it passes its readiness check.
    pub ready: bool,
    /// Where it serves (`host:port`); empty when it has no port.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub endpoint: String,
    /// Its load for autoscaling, in thousandths of the metric's unit (absent: not read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_milli: Option<u64>,
    /// Its request latency as it measures it (`service.report`), in microseconds, at most
    /// [`MAX_LATENCY_US`] (absent: not read; older entries have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<u64>,
    /// The fraction of its requests that succeeded, in parts per million, at most
    /// [`MAX_SUCCESS_PPM`] (absent: not read; older entries have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success_ppm: Option<u32>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Longest endpoint an agent may report (`host:port`).
pub const MAX_ENDPOINT_LEN: usize = 300;
/// Longest latency a replica may report, in microseconds ([`suanli_model::MAX_REPORTED_LATENCY_MS`]).
pub const MAX_LATENCY_US: u64 = suanli_model::MAX_REPORTED_LATENCY_MS * 1000;
/// A success ratio of 1, in parts per million.
pub const MAX_SUCCESS_PPM: u32 = 1_000_000;

/// A completed checkpoint of a running allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportCheckpoint {
    /// The allocation that wrote it.
    pub alloc: AllocId,
    /// Its epoch.
    pub epoch: u64,
    /// Where it is stored.
    pub uri: String,
    /// Training step (or any monotonic progress marker).
    pub step: u64,
    /// Size in bytes.
    #[serde(default)]
    pub size_bytes: u64,
    /// The manifest's `wall_time` (0: not reported).
    #[serde(default)]
    pub wall_time: u64,
    /// Set for a hardware-bound checkpoint: the hardware it restores onto.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<suanli_model::CheckpointHardware>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Moves a job: its running attempt is stopped the checkpoint-first way and the next one is
/// placed where the target allows (any other node when no target is given).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateJob {
    /// The job.
    pub job: JobId,
    /// Only this pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_pool: Option<suanli_model::PoolId>,
    /// Only this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_node: Option<NodeId>,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Replaces a service's spec; its replicas are replaced by a rolling update at the pace of
/// the new spec's `service.update` (docs/services.md, "Rolling update"). Changing a group's
/// `replicas` alone scales it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateService {
    /// The service.
    pub job: JobId,
    /// Its new spec: the same queue and the same task groups (by name, in order).
    pub spec: JobSpec,
    /// Leader's time, seconds.
    pub now: u64,
}

/// Replaces the replicated configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateConfig {
    /// The new configuration (validated at apply).
    pub config: StateConfig,
}

/// The operator's order to skip a log entry that no server of the group can apply (a poison
/// entry), read while halted at it. Every entry from `index` up to this one is skipped (none
/// was applied anywhere: every server halted at `index`), then applying goes on. A server
/// that did apply `index` refuses it (nothing to skip), changing nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkipEntry {
    /// The halted entry's index.
    pub index: u64,
    /// Its command kind as the halt names it (a check that the operator skips what they saw).
    #[serde(default)]
    pub kind: String,
}

/// Sets the cluster's identity, once: written by the first leader of a new cluster (a random
/// id it drew before proposing, so apply stays deterministic). A later one with another id is
/// refused; the same id again changes nothing. Agents compare it with the id they ran work
/// for, so a restored cluster (which gets a new id offline) is never confused with its source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetClusterId {
    /// The id: 1 to 64 characters of `[0-9a-z-]`.
    pub id: String,
}

/// Several commands committed as one log entry (group commit of concurrent requests). Each
/// is applied in order exactly as if it had its own entry: each gets its own response and, if
/// it changes the state, its own revision. A batch may not contain a batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    /// The commands, in order.
    pub commands: Vec<Command>,
}

macro_rules! commands {
    ($( $(#[$doc:meta])* $variant:ident($body:ty) = $kind:literal, ignorable: $ign:literal; )*) => {
        /// A change to replicated state. See the module docs for the wire envelope.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Command {
            $( $(#[$doc])* $variant($body), )*
            /// A kind this build does not know (written by a newer server).
            Unknown {
                /// Its kind name.
                kind: String,
                /// Whether the writer allows older servers to skip it.
                ignorable: bool,
                /// Envelope version it was written with.
                version: u32,
                /// Its body as a JSON value, so re-encoding keeps every field. A number is
                /// kept as serde_json reads it: an integer beyond 64 bits or a float as the
                /// nearest f64 its default (not correctly rounded) parser finds, which a round
                /// trip may move by one ULP (fuzz/fuzz_targets/state_command.rs found one).
                body: serde_json::Value,
            },
        }

        impl Command {
            /// The kind name written in the envelope.
            pub fn kind(&self) -> &str {
                match self {
                    $( Command::$variant(_) => $kind, )*
                    Command::Unknown { kind, .. } => kind,
                }
            }

            /// Whether an older server that does not know this kind may skip it.
            pub fn ignorable(&self) -> bool {
                match self {
                    $( Command::$variant(_) => $ign, )*
                    Command::Unknown { ignorable, .. } => *ignorable,
                }
            }

            /// Every kind this build knows.
            pub const KINDS: &'static [&'static str] = &[$($kind),*];
        }

        impl Serialize for Command {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                // The body is written straight into the envelope (no intermediate JSON value).
                match self {
                    $( Command::$variant(b) => EnvelopeRef { v: COMMAND_VERSION, kind: $kind, ignorable: $ign, body: b }
                        .serialize(s), )*
                    Command::Unknown { kind, ignorable, version, body } => {
                        EnvelopeRef { v: *version, kind, ignorable: *ignorable, body }.serialize(s)
                    }
                }
            }
        }

        /// Reads a known kind's body straight into its type when `kind` comes before `body`
        /// (as this build writes it); otherwise, or for an unknown kind, through a JSON value.
        fn typed_body<'de, A: serde::de::MapAccess<'de>>(kind: &str, m: &mut A) -> Result<Body, A::Error> {
            Ok(match kind {
                $( $kind => Body::Typed(Box::new(Command::$variant(m.next_value().map_err(|err| {
                    A::Error::custom(format!("command {}: {err}", $kind))
                })?))), )*
                _ => Body::Raw(m.next_value()?),
            })
        }

        fn from_raw<E: serde::de::Error>(kind: String, ignorable: bool, v: u32, body: serde_json::Value) -> Result<Command, E> {
            Ok(match kind.as_str() {
                $( $kind => Command::$variant(serde_json::from_value(body).map_err(|err| {
                    E::custom(format!("command {}: {err}", $kind))
                })?), )*
                _ => Command::Unknown { kind, ignorable, version: v, body },
            })
        }
    };
}

commands! {
    /// Create or replace a queue.
    UpsertQueue(UpsertQueue) = "upsert_queue", ignorable: false;
    /// Delete an unused queue.
    DeleteQueue(DeleteQueue) = "delete_queue", ignorable: false;
    /// Register or re-register a node.
    RegisterNode(Box<RegisterNode>) = "register_node", ignorable: false;
    /// Cordon, drain or uncordon a node.
    SetNodeMode(SetNodeMode) = "set_node_mode", ignorable: false;
    /// A node missed its heartbeats.
    NodeDown(NodeDown) = "node_down", ignorable: false;
    /// A device changed health.
    DeviceHealth(DeviceHealth) = "device_health", ignorable: false;
    /// A node's agent reported a condition (disk pressure) or its end. Not ignorable: it
    /// decides where plans may place work, which every replica re-checks at apply.
    NodeCondition(NodeCondition) = "node_condition", ignorable: false;
    /// An operator cleared a device's quarantine. Not ignorable: the count it raises is what
    /// the node's agent compares, so every replica must hold the same one.
    ClearQuarantine(ClearQuarantine) = "clear_quarantine", ignorable: false;
    /// Submit a job. (The three large bodies are boxed: a batch of 1,024 commands is then a
    /// 112-byte-per-command vector, not 288, which a decode grows by doubling on every server.)
    SubmitJob(Box<SubmitJob>) = "submit_job", ignorable: false;
    /// Cancel a job.
    CancelJob(CancelJob) = "cancel_job", ignorable: false;
    /// Commit a scheduling plan.
    ApplyPlan(ApplyPlan) = "apply_plan", ignorable: false;
    /// An allocation's status changed.
    AllocStatus(AllocStatus) = "alloc_status", ignorable: false;
    /// A service replica became ready or stopped being ready.
    AllocReady(AllocReady) = "alloc_ready", ignorable: false;
    /// A checkpoint completed (metadata only: an older server may skip it safely).
    ReportCheckpoint(ReportCheckpoint) = "report_checkpoint", ignorable: true;
    /// Replace the replicated configuration.
    UpdateConfig(Box<UpdateConfig>) = "update_config", ignorable: false;
    /// Several commands in one entry.
    Batch(Batch) = "batch", ignorable: false;
    /// Skip a halted entry (operator recovery).
    SkipEntry(SkipEntry) = "skip_entry", ignorable: false;
    /// Set the cluster id (once). Ignorable: an older server only lacks the id.
    SetClusterId(SetClusterId) = "set_cluster_id", ignorable: true;
    /// Move a job elsewhere, checkpoint first.
    MigrateJob(MigrateJob) = "migrate_job", ignorable: false;
    /// Replace a service's spec (a rolling update or a scale).
    UpdateService(Box<UpdateService>) = "update_service", ignorable: false;
    /// Record a bearer token (and the signing key, the first time).
    IssueToken(Box<crate::security::IssueToken>) = "issue_token", ignorable: false;
    /// Revoke a bearer token.
    RevokeToken(crate::security::RevokeToken) = "revoke_token", ignorable: false;
    /// Append audit records. Ignorable: an older server only lacks the records.
    RecordAudit(crate::security::RecordAudit) = "record_audit", ignorable: true;
    /// Take on a federated job the federation assigned to this region (docs/federation.md).
    FedAdopt(Box<crate::federated::FedAdopt>) = "fed_adopt", ignorable: false;
    /// Federation leases renewed. Not ignorable: a replica that skipped it would stop the job.
    FedRenew(crate::federated::FedRenew) = "fed_renew", ignorable: false;
    /// Give a federated job up (lease refused, expired, or cancelled by the federation).
    FedRelease(crate::federated::FedRelease) = "fed_release", ignorable: false;
    /// The federation's quota leases to this region, replacing the ones held. Not ignorable:
    /// a replica that skipped it would admit a team's local work the federation did not lease.
    FedQuotaLeases(crate::federated::FedQuotaLeases) = "fed_quota_leases", ignorable: false;
    /// Replace the cost ledger's price catalog (docs/cost.md).
    SetPrices(crate::cost::SetPrices) = "set_prices", ignorable: false;
}

impl Command {
    /// Sets the time a command carries (the leader stamps every command it proposes, those
    /// forwarded to it included; see docs/control-plane.md, "Clocks"). A plan keeps the `now`
    /// it was computed for, and commands without a time are left as they are.
    pub fn stamp(&mut self, now: u64) {
        match self {
            Command::RegisterNode(c) => c.now = now,
            Command::SetNodeMode(c) => c.now = now,
            Command::NodeDown(c) => c.now = now,
            Command::DeviceHealth(c) => c.now = now,
            Command::SubmitJob(c) => c.now = now,
            Command::CancelJob(c) => c.now = now,
            Command::AllocStatus(c) => c.now = now,
            Command::AllocReady(c) => c.now = now,
            Command::ReportCheckpoint(c) => c.now = now,
            Command::MigrateJob(c) => c.now = now,
            Command::UpdateService(c) => c.now = now,
            Command::IssueToken(c) => c.now = now,
            Command::RevokeToken(c) => c.now = now,
            Command::NodeCondition(c) => c.now = now,
            Command::ClearQuarantine(c) => c.now = now,
            Command::FedAdopt(c) => c.now = now,
            Command::FedRenew(c) => c.now = now,
            Command::FedRelease(c) => c.now = now,
            Command::FedQuotaLeases(c) => c.now = now,
            Command::SetPrices(c) => c.now = now,
            Command::Batch(b) => b.commands.iter_mut().for_each(|c| c.stamp(now)),
            Command::ApplyPlan(_)
            | Command::UpsertQueue(_)
            | Command::DeleteQueue(_)
            | Command::UpdateConfig(_)
            | Command::SkipEntry(_)
            | Command::SetClusterId(_)
            | Command::RecordAudit(_)
            | Command::Unknown { .. } => {}
        }
    }

    /// The kind of the first command (this one, or one inside a batch) that this build does
    /// not know and may not skip: such a command must not be applied at all, so a replica
    /// halts before it rather than apply half a batch.
    pub fn unsupported_kind(&self) -> Option<&str> {
        match self {
            Command::Unknown { kind, ignorable: false, .. } => Some(kind),
            Command::Batch(b) => b.commands.iter().find_map(Command::unsupported_kind),
            _ => None,
        }
    }
}

/// The envelope as written: `{"v", "kind", "ignorable", "body"}` in that order.
#[derive(Serialize)]
struct EnvelopeRef<'a, B: Serialize> {
    v: u32,
    kind: &'a str,
    ignorable: bool,
    body: &'a B,
}

enum Body {
    Typed(Box<Command>),
    Raw(serde_json::Value),
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Field {
    V,
    Kind,
    Ignorable,
    Body,
    #[serde(other)]
    Other,
}

struct EnvelopeVisitor;

impl<'de> serde::de::Visitor<'de> for EnvelopeVisitor {
    type Value = Command;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a command envelope {v, kind, ignorable, body}")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Command, A::Error> {
        let (mut v, mut kind, mut ignorable, mut body) = (None, None::<String>, false, None);
        while let Some(key) = m.next_key::<Field>()? {
            match key {
                Field::V => v = Some(m.next_value::<u32>()?),
                Field::Kind => kind = Some(m.next_value()?),
                Field::Ignorable => ignorable = m.next_value()?,
                Field::Body => {
                    body = Some(match &kind {
                        Some(k) => typed_body(k, &mut m)?,
                        None => Body::Raw(m.next_value()?),
                    })
                }
                Field::Other => {
                    m.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        let v = v.ok_or_else(|| A::Error::missing_field("v"))?;
        let kind = kind.ok_or_else(|| A::Error::missing_field("kind"))?;
        match body.unwrap_or(Body::Raw(serde_json::Value::Null)) {
            Body::Typed(c) => Ok(*c),
            Body::Raw(raw) => from_raw(kind, ignorable, v, raw),
        }
    }
}

impl<'de> Deserialize<'de> for Command {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(EnvelopeVisitor)
    }
}

/// Encodes a command as JSON bytes (the format the raft log stores).
pub fn encode_command(cmd: &Command) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(cmd)
}

/// Checks an encoded command's size (`bytes`) against `limit` (`max_command_bytes`). Servers
/// call this (through `suanli_raft::write_encoded`) before proposing, so one request cannot
/// bloat the log.
pub fn check_encoded_size(bytes: usize, limit: usize) -> Result<usize, CommandError> {
    if bytes > limit {
        return Err(CommandError::TooLarge { bytes, limit });
    }
    Ok(bytes)
}

/// Why a command was refused. A refused command leaves the state unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum CommandError {
    /// A field is invalid.
    #[error("{field}: {message}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// The command is larger than allowed.
    #[error("command is {bytes} bytes; the limit is {limit} bytes")]
    TooLarge {
        /// Encoded size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// A bounded collection is full.
    #[error("too many {what}: the limit is {limit}")]
    TooMany {
        /// What is full (e.g. `live jobs`).
        what: String,
        /// The configured limit.
        limit: usize,
    },
    /// The queue does not exist.
    #[error("queue: unknown queue {}", quote(queue))]
    UnknownQueue {
        /// The name given.
        queue: String,
    },
    /// The job does not exist (or was forgotten after it finished).
    #[error("job: unknown job {job}")]
    UnknownJob {
        /// The id given.
        job: u64,
    },
    /// The node does not exist.
    #[error("node: unknown node {}", quote(node))]
    UnknownNode {
        /// The name given.
        node: String,
    },
    /// The device does not exist on the node.
    #[error("device: unknown device {} on node {}", quote(device), quote(node))]
    UnknownDevice {
        /// The node.
        node: String,
        /// The device id given.
        device: String,
    },
    /// The allocation does not exist (or was forgotten).
    #[error("alloc: unknown allocation {alloc}")]
    UnknownAlloc {
        /// The id given.
        alloc: u64,
    },
    /// A report from an epoch other than the allocation's.
    #[error("epoch: report for allocation {alloc} carries epoch {reported}, current is {current}")]
    StaleEpoch {
        /// The allocation.
        alloc: u64,
        /// Epoch in the report.
        reported: u64,
        /// The allocation's epoch.
        current: u64,
    },
    /// The command conflicts with current state.
    #[error("{field}: {message}")]
    Conflict {
        /// The field that conflicts.
        field: String,
        /// What conflicts.
        message: String,
    },
}

impl From<ValidationError> for CommandError {
    fn from(e: ValidationError) -> Self {
        // The message without the field (Display puts it in front once).
        let text = e.to_string();
        let message = text.strip_prefix(e.field()).and_then(|m| m.strip_prefix(": ")).unwrap_or(&text).to_owned();
        CommandError::Invalid { field: e.field().to_owned(), message }
    }
}

impl From<ConfigError> for CommandError {
    fn from(e: ConfigError) -> Self {
        CommandError::Invalid { field: e.field.clone(), message: e.to_string() }
    }
}

/// What the application of one plan committed and refused.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PlanOutcome {
    /// Allocations created, in order.
    pub placed: Vec<AllocId>,
    /// Jobs whose placements were refused, with the reason (they stay pending; the job's
    /// `reason` is its text).
    pub refused_jobs: Vec<(JobId, RefusalReason)>,
    /// Allocations told to stop for a preemption.
    pub preempted: Vec<AllocId>,
    /// Preemptions refused, with the reason.
    pub refused_preemptions: Vec<(AllocId, RefusalReason)>,
}

/// The result of applying one command (or one raft-internal entry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    /// A raft-internal entry (blank or membership) with nothing to apply.
    Internal,
    /// Applied.
    Done,
    /// A job submission: the job's id, and whether this command created it (false: a retry
    /// of an earlier submission with the same client request id).
    JobSubmitted {
        /// The job.
        job: JobId,
        /// True when this command created it.
        created: bool,
    },
    /// A plan was applied (possibly partly).
    PlanApplied(PlanOutcome),
    /// An ignorable command of an unknown kind was skipped.
    Ignored {
        /// Its kind.
        kind: String,
    },
    /// Refused; the state is unchanged.
    Rejected(CommandError),
    /// The responses of a [`Batch`], in order. (Encoded as `{"result": "batch", "responses":
    /// [...]}`: an internally tagged variant cannot hold a bare sequence, and a follower that
    /// forwards a batch to the leader gets this back as JSON.)
    Batch(#[serde(with = "batch_responses")] Vec<Response>),
    /// A non-ignorable command of an unknown kind: this server is too old to apply the log.
    /// The raft layer halts the group on this server, read-only (see [`Response::is_fatal`];
    /// it checks [`Command::unsupported_kind`] first, so apply rarely gets here).
    Unsupported {
        /// Its kind.
        kind: String,
    },
    /// Not applied: this replica halted at entry `index` (read-only until a build that can
    /// apply it restarts it, or a [`SkipEntry`] for it commits).
    Halted {
        /// The entry it halted at.
        index: u64,
        /// That entry's command kind (empty when unreadable).
        kind: String,
        /// Why, and what would apply it.
        reason: String,
    },
}

/// [`Response::Batch`]'s field as a map (`responses`), which internal tagging can carry.
mod batch_responses {
    use super::Response;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize)]
    struct Ref<'a> {
        responses: &'a [Response],
    }

    #[derive(Deserialize)]
    struct Owned {
        responses: Vec<Response>,
    }

    pub fn serialize<S: Serializer>(rs: &[Response], s: S) -> Result<S::Ok, S::Error> {
        Ref { responses: rs }.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Response>, D::Error> {
        Ok(Owned::deserialize(d)?.responses)
    }
}

impl Response {
    /// True when the replica cannot continue applying the log.
    pub fn is_fatal(&self) -> bool {
        match self {
            Response::Unsupported { .. } => true,
            Response::Batch(rs) => rs.iter().any(Response::is_fatal),
            _ => false,
        }
    }

    /// The refusal, if any.
    pub fn rejection(&self) -> Option<&CommandError> {
        match self {
            Response::Rejected(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_names_the_kind() {
        let cmd = Command::CancelJob(CancelJob { job: JobId(7), reason: "x".into(), now: 3 });
        let text = String::from_utf8(encode_command(&cmd).expect("encodes")).expect("utf8");
        assert!(text.contains(r#""kind":"cancel_job""#), "{text}");
        assert!(text.contains(r#""v":1"#), "{text}");
        let back: Command = serde_json::from_str(&text).expect("decodes");
        assert_eq!(back, cmd);
    }

    #[test]
    fn every_response_round_trips_through_json() {
        // A follower gets the leader's answer to a forwarded write as JSON; a batch's answer
        // once failed to encode ("cannot serialize tagged newtype variant").
        let r = Response::Batch(vec![
            Response::JobSubmitted { job: JobId(1), created: true },
            Response::Rejected(CommandError::UnknownJob { job: 9 }),
            Response::Batch(vec![Response::Done]),
        ]);
        let text = serde_json::to_string(&r).expect("encodes");
        assert!(text.starts_with(r#"{"result":"batch","responses":["#), "{text}");
        assert_eq!(serde_json::from_str::<Response>(&text).expect("decodes"), r);
    }

    #[test]
    fn unknown_kinds_decode_and_keep_their_body() {
        let text = r#"{"v":2,"kind":"set_price","ignorable":true,"body":{"model":"H100","usd":3}}"#;
        let cmd: Command = serde_json::from_str(text).expect("unknown kinds decode");
        assert_eq!(cmd.kind(), "set_price");
        assert!(cmd.ignorable());
        let again = serde_json::to_value(&cmd).expect("encodes");
        let orig: serde_json::Value = serde_json::from_str(text).expect("json");
        assert_eq!(again, orig, "re-encoding an unknown command must lose nothing");
    }

    #[test]
    fn an_unknown_body_with_a_huge_number_round_trips_but_for_its_last_bit() {
        // Found by fuzzing (fuzz/fuzz_targets/state_command.rs): the 84-digit integer is read as
        // an f64 and written back as 1.1111111111111108e81, which reads as 1.111111111111111e81.
        let text = format!(
            r#"{{"v": 1, "kind": "alloc_slltus", "ignorable": false, "body": {{"alloc": {}, "ep": 15}}}}"#,
            "1".repeat(84)
        );
        let cmd: Command = serde_json::from_str(&text).expect("an unknown kind decodes");
        assert_eq!(cmd.unsupported_kind(), Some("alloc_slltus"));
        let back: Command = serde_json::from_slice(&encode_command(&cmd).expect("encodes")).expect("decodes");
        let (Command::Unknown { kind, version, body, .. }, Command::Unknown { body: body2, .. }) = (&cmd, &back) else {
            panic!("both unknown: {cmd:?} {back:?}");
        };
        assert_eq!((kind.as_str(), *version), ("alloc_slltus", 1));
        assert_eq!(body["ep"], body2["ep"]);
        let (a, b) = (body["alloc"].as_f64().expect("a number"), body2["alloc"].as_f64().expect("a number"));
        assert!((a - b).abs() <= a.abs() * 4.0 * f64::EPSILON, "{a} vs {b}");
    }

    #[test]
    fn a_bad_body_of_a_known_kind_is_an_error_naming_the_kind() {
        let text = r#"{"v":1,"kind":"cancel_job","body":{"job":"seven"}}"#;
        let e = serde_json::from_str::<Command>(text).expect_err("bad body");
        assert!(e.to_string().contains("cancel_job"), "{e}");
    }

    #[test]
    fn field_order_does_not_matter_and_extra_fields_are_ignored() {
        let cmd = Command::CancelJob(CancelJob { job: JobId(7), reason: "x".into(), now: 3 });
        let text =
            r#"{"body":{"job":7,"reason":"x","now":3},"later":[1,2],"ignorable":false,"kind":"cancel_job","v":1}"#;
        assert_eq!(serde_json::from_str::<Command>(text).expect("body first decodes"), cmd);
        let batch = Command::Batch(Batch { commands: vec![cmd.clone(), cmd] });
        let back: Command = serde_json::from_slice(&encode_command(&batch).expect("encodes")).expect("decodes");
        assert_eq!(back, batch);
    }

    #[test]
    fn a_missing_version_or_kind_is_named() {
        let e = serde_json::from_str::<Command>(r#"{"kind":"cancel_job","body":{"job":1,"now":1}}"#).expect_err("no v");
        assert!(e.to_string().contains("`v`"), "{e}");
        let e = serde_json::from_str::<Command>(r#"{"v":1,"body":{}}"#).expect_err("no kind");
        assert!(e.to_string().contains("`kind`"), "{e}");
    }
}
