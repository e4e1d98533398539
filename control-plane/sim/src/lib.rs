//! Trace-driven simulation on suanli's scheduling engine.
//!
//! ```text
//!  trace files ──▶ trace::read_* ──▶ fill::fill   (the ATC'23 fill procedure, per policy/seed)
//!                                └─▶ replay::replay (time, queues, preemption, backfill)
//!                                          │
//!                                          └─▶ report (table, JSON, CSV, SVG)
//! ```
//!
//! Everything is deterministic for a seed. The simulator reads files but never the clock for
//! decisions (wall time is only measured for reporting speed).

pub mod fill;
pub mod replay;
pub mod report;
pub mod synth;
pub mod trace;
