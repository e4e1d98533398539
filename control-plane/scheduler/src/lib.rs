//! The pure scheduling engine.
//!
//! It owns every scheduling decision: queue order (priority, then weighted dominant-resource
//! fair share, then age), quota admission with borrowing inside a cohort, gang and elastic
//! placement under node, model and MIG rules (a GPU and its MIG partitions never in use at
//! once), the placement policies (fragmentation-aware by default), preemption with minimal lost
//! work (or youngest first, [`VictimOrder`]), and backfill that never delays a reserved head job.
//!
//! ```text
//!   ClusterView (immutable snapshot) ──┐
//!   now, seed ─────────────────────────┼──▶ schedule() ──▶ Plan {placements, preemptions,
//!   SchedulerConfig ───────────────────┘                        unplaced(reason), reservations}
//!        │
//!        └─ cluster::Cluster: nodes indexed by class; policy::Policy scores (class, shape)
//! ```
//!
//! It must never read a clock, do I/O, spawn threads or iterate a `HashMap` where the order
//! could reach a decision: time and randomness are arguments, so a plan replays exactly
//! (`clippy.toml` in this crate bans clocks, file and network I/O, threads and tokio).
//!
//! Its guarantees check themselves: [`check`] recomputes from the view what every plan must
//! satisfy (capacity, quota, gang, preemption, backfill), and `schedule()` `debug_assert!`s it
//! on each plan it returns.

pub mod check;
pub mod cluster;
pub mod engine;
pub mod policy;
pub mod quota;
pub mod rehearsal;
pub mod rng;
pub mod workload;

pub use cluster::{Choice, Cluster, ClusterError, Hold, MisfitTally, Shape, ShapeId};
pub use engine::{ClusterView, PendingJob, SchedulerConfig, VictimOrder, schedule};
pub use policy::{POLICY_NAMES, Policy, UnknownPolicy, Weights};
pub use quota::QuotaError;
pub use rng::DetRng;
pub use workload::{Profile, TypicalKey};
