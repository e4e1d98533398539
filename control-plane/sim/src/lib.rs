//! Trace-driven simulation on suanli's scheduling engine and replicated state machine.
//!
//! ```text
//!  trace files ──▶ trace::read_* ──▶ fill::fill   (the ATC'23 fill procedure, per policy/seed)
//!                                │        └─▶ report (table, JSON, CSV, SVG)
//!                                └─▶ replay::replay (time, queues, preemption, backfill: every
//!                                          │         event a Command applied by suanli-state)
//!                                          └─▶ replay's report (table, JSON, CSV)
//! ```
//!
//! Everything is deterministic for a seed. The simulator reads files but never the clock for
//! decisions (wall time is only measured for reporting speed). `fill` places pods straight on
//! the engine's cluster model (the published procedure has no time and no queues); `replay`
//! keeps no rules of its own: what the servers would commit, it applies with `State::apply`.

pub mod bound;
pub mod fill;
pub mod mix;
pub mod replay;
pub mod report;
pub mod synth;
pub mod trace;
