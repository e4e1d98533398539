//! suanli's domain types and their validation.
//!
//! This crate owns the vocabulary every other suanli crate speaks: identifiers, resource
//! vectors, devices and their topology, nodes, queues with quotas, job specifications, running
//! allocations and the scheduling [`Plan`]. It is the leaf of the dependency graph.
//!
//! ```text
//!   JobSpec --validate(Limits)--> ok / ValidationError{field, limit}
//!   Node { devices: [Device{topology, health}] }     Queue { nominal, borrowing, lending }
//!            \                                          /
//!             +---- scheduler::ClusterView ------------+ --> scheduler::schedule --> Plan
//! ```
//!
//! It must never do I/O, read a clock, spawn threads or depend on tokio: every function here is
//! a pure function of its arguments, so the scheduler, the state machine and the simulator can
//! replay it exactly.

pub mod alloc;
pub mod checkpoint;
pub mod device;
pub mod error;
pub mod ids;
pub mod input;
pub mod job;
pub mod limits;
pub mod node;
pub mod plan;
pub mod queue;
pub mod resources;
pub mod service;
pub mod trace;

pub use alloc::{Allocation, ElasticRole};
pub use checkpoint::{
    CheckpointHardware, CheckpointManifest, MANIFEST_FILE, ManifestDecodeError, check_checkpoint_path,
};
pub use device::{Device, DeviceKind, Health, ShareIsolation};
pub use error::ValidationError;
pub use ids::{AllocId, JobId, NodeId, PoolId, QueueId};
pub use input::InputError;
pub use job::{
    CheckpointPolicy, CheckpointSignal, Constraints, DeviceRequest, GangTopology, JobKind, JobSpec, TaskGroup,
    TaskResources, TaskSpec,
};
pub use limits::Limits;
pub use node::Node;
pub use plan::{DeviceShare, Placement, Plan, Preemption, PreemptionReason, Reservation, Unplaced};
pub use queue::Queue;
pub use resources::ResVec;
pub use service::{
    Autoscale, LoadSource, MAX_REPORTED_LATENCY_MS, Probe, ProbeKind, ServiceReport, ServiceSpec, UpdateStrategy,
};

/// One whole device, in milli-units: a device is shared in thousandths.
pub const WHOLE_DEVICE_MILLI: u32 = 1000;
