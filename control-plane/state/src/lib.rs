//! suanli's replicated state machine.
//!
//! It owns the cluster's durable truth: queues, nodes (inventory, health, cordons), jobs and
//! their life cycle, allocations with epochs, and the replicated configuration with every
//! bound. Raft (in `suanli-raft`) orders [`Command`]s into a log; every replica applies them
//! here, in order, and reaches the same [`State`].
//!
//! ```text
//!  client / agent / leader loops ──Command──▶ raft log ──▶ State::apply(cmd) ──▶ Response
//!                                                            │   (ApplyPlan re-checks every
//!                                                            │    placement at this index)
//!  leader's scheduling loop ◀── State::cluster_view(now) ◀──┘
//!  raft snapshots ◀──▶ State::snapshot() / State::restore()      tests, chaos ──▶ invariants()
//! ```
//!
//! It must never read a clock, do I/O, use randomness or iterate a `HashMap`: time travels
//! inside each command and every collection is ordered, so replicas cannot diverge. A refused
//! command ([`Response::Rejected`]) leaves the state exactly as it was.

pub mod command;
pub mod config;
pub mod cost;
pub mod federated;
pub mod invariants;
mod plan;
pub mod records;
pub mod refusal;
pub mod security;
mod service;
pub use service::{AutoscaleHistory, AutoscaleInput, Reported};
mod state;
mod usage;

pub use command::{
    AllocReady, AllocStatus, ApplyPlan, Batch, COMMAND_VERSION, CancelJob, ClearQuarantine, Command, CommandError,
    DeleteQueue, DeviceHealth, DrainOptions, MAX_ENDPOINT_LEN, MAX_LATENCY_US, MAX_SUCCESS_PPM, MigrateJob,
    NodeCondition, NodeDown, NodeMode, PlanOutcome, RegisterNode, ReportCheckpoint, ReportedStatus, Response,
    SetClusterId, SetNodeMode, SkipEntry, SubmitJob, UpdateConfig, UpdateService, UpsertQueue, check_encoded_size,
    encode_command,
};
pub use config::{CHECKPOINT_STORE_SCHEMES, ConfigError, RetryPolicy, StateConfig};
pub use invariants::Violation;
pub use records::{
    AgentFence, Alloc, AllocState, AttemptRecord, AvoidNode, CheckpointRecord, Desired, DrainPlan, EndClass, Job,
    JobState, MAX_ATTEMPT_HISTORY, MigrationTarget, NodeRecord, NodeStatus, Nomination, StopReason,
};
pub use refusal::RefusalReason;
pub use security::{
    AuditEntry, AuditPage, AuditRecord, IssueToken, RecordAudit, RevokeToken, SecurityState, TokenRecord,
};
pub use state::{NOMINATION_SLACK_S, SNAPSHOT_FORMAT, SnapshotError, State};
