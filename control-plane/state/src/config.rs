//! The replicated configuration of the state machine: every bound apply enforces.
//!
//! The configuration is part of the replicated state (it travels in snapshots and changes only
//! through [`crate::Command::UpdateConfig`]), so every replica enforces the same limits at the
//! same log index.

use serde::{Deserialize, Serialize};
use suanli_model::Limits;
use thiserror::Error;

/// How a job is retried after its tasks fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct RetryPolicy {
    /// Attempts that may fail before the job is marked failed (1 = no retry).
    pub max_attempts: u32,
    /// Backoff after the first failure, in seconds; it doubles with every further failure.
    pub backoff_base_s: u64,
    /// Longest backoff, in seconds.
    pub backoff_max_s: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { max_attempts: 3, backoff_base_s: 10, backoff_max_s: 600 }
    }
}

impl RetryPolicy {
    /// Backoff before the attempt that follows `failures` failures (exponential, capped).
    pub fn backoff_s(&self, failures: u32) -> u64 {
        if failures == 0 {
            return 0;
        }
        let shift = (failures - 1).min(32);
        self.backoff_base_s.saturating_mul(1u64 << shift).min(self.backoff_max_s)
    }

    /// Checks bounds against `cfg`.
    pub fn validate(&self, cfg: &StateConfig) -> Result<(), ConfigError> {
        if self.max_attempts == 0 || self.max_attempts > cfg.max_total_attempts {
            return Err(ConfigError::new(
                "retry.max_attempts",
                self.max_attempts,
                format!("must be between 1 and {}", cfg.max_total_attempts),
            ));
        }
        if self.backoff_max_s > cfg.limits.max_duration_s {
            return Err(ConfigError::new(
                "retry.backoff_max_s",
                self.backoff_max_s,
                format!("must be at most {}", cfg.limits.max_duration_s),
            ));
        }
        if self.backoff_base_s > self.backoff_max_s {
            return Err(ConfigError::new(
                "retry.backoff_base_s",
                self.backoff_base_s,
                format!("must be at most backoff_max_s ({})", self.backoff_max_s),
            ));
        }
        Ok(())
    }
}

/// Every limit the state machine enforces. Defaults fit a large cluster; all are explicit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StateConfig {
    /// Validation limits for job specs, nodes and queues.
    pub limits: Limits,
    /// Most jobs that are not finished (pending, placed, running, stopping).
    pub max_live_jobs: usize,
    /// Most finished jobs kept for status queries and request de-duplication; the oldest
    /// finished job is forgotten first.
    pub max_retained_jobs: usize,
    /// Most registered nodes.
    pub max_nodes: usize,
    /// Most queues.
    pub max_queues: usize,
    /// Most live (pending or running) allocations.
    pub max_live_allocs: usize,
    /// Most placements or preemptions in one plan.
    pub max_plan_entries: usize,
    /// Longest client request id, in bytes.
    pub max_request_id_len: usize,
    /// Longest stored message or reason, in bytes (longer ones are cut).
    pub max_message_len: usize,
    /// Longest checkpoint URI, in bytes.
    pub max_uri_len: usize,
    /// Largest serialized command accepted, in bytes (checked by [`crate::check_encoded_size`]).
    pub max_command_bytes: usize,
    /// Retry policy of jobs submitted without one.
    pub default_retry: RetryPolicy,
    /// Most attempts of one job from any cause (failures, preemptions, lost nodes) before it
    /// is marked failed; bounds a job that keeps landing on broken nodes.
    pub max_total_attempts: u32,
    /// Where checkpoints are stored, as a URL agents open with `object_store`
    /// (`file:///shared/ckpt`, `s3://bucket/prefix`, `gs://…`, `az://…`); empty: each agent
    /// keeps them under its own data directory, so they restore only on that node.
    pub checkpoint_store: String,
    /// How long (seconds) a job's next attempt avoids the node its last attempt failed on;
    /// after it, the node may be used again (a one-node pool recovers).
    pub avoid_failed_node_s: u64,
    /// Most requeues for infrastructure causes (lost nodes, device errors, preemptions,
    /// drains, migrations) before the job fails anyway: they do not use up `max_attempts`,
    /// but they are not unbounded either.
    pub max_infra_requeues: u32,
    /// Most audit records kept (the oldest is dropped first).
    pub audit_retention: usize,
    /// Most tokens recorded and not yet expired (creating one more is refused).
    pub max_tokens: usize,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            max_live_jobs: 200_000,
            max_retained_jobs: 100_000,
            max_nodes: 50_000,
            max_queues: 10_000,
            max_live_allocs: 1_000_000,
            max_plan_entries: 100_000,
            max_request_id_len: 128,
            max_message_len: 1024,
            max_uri_len: 2048,
            max_command_bytes: 4 * 1024 * 1024,
            default_retry: RetryPolicy::default(),
            max_total_attempts: 100,
            checkpoint_store: String::new(),
            avoid_failed_node_s: 300,
            max_infra_requeues: 1000,
            audit_retention: 100_000,
            max_tokens: 10_000,
        }
    }
}

/// A configuration value out of bounds.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
#[error("{field}: {value} is invalid; {expected}")]
pub struct ConfigError {
    /// The field, e.g. `max_live_jobs`.
    pub field: String,
    /// The value given.
    pub value: String,
    /// What would be valid.
    pub expected: String,
}

impl ConfigError {
    fn new(field: &str, value: impl ToString, expected: String) -> Self {
        Self { field: field.into(), value: value.to_string(), expected }
    }
}

impl StateConfig {
    /// Checks that every bound is usable (non-zero, and not absurd).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let counts: [(&str, usize, usize); 12] = [
            ("max_live_jobs", self.max_live_jobs, 100_000_000),
            ("max_retained_jobs", self.max_retained_jobs, 100_000_000),
            ("max_nodes", self.max_nodes, 10_000_000),
            ("max_queues", self.max_queues, 10_000_000),
            ("max_live_allocs", self.max_live_allocs, 1_000_000_000),
            ("max_plan_entries", self.max_plan_entries, 100_000_000),
            ("max_request_id_len", self.max_request_id_len, 4096),
            ("max_message_len", self.max_message_len, 1 << 20),
            ("max_uri_len", self.max_uri_len, 1 << 16),
            ("max_command_bytes", self.max_command_bytes, 1 << 30),
            ("audit_retention", self.audit_retention, 10_000_000),
            ("max_tokens", self.max_tokens, 1_000_000),
        ];
        for (field, v, max) in counts {
            if v == 0 || v > max {
                return Err(ConfigError::new(field, v, format!("must be between 1 and {max}")));
            }
        }
        if self.max_total_attempts == 0 || self.max_total_attempts > 1_000_000 {
            return Err(ConfigError::new(
                "max_total_attempts",
                self.max_total_attempts,
                "must be between 1 and 1000000".into(),
            ));
        }
        if self.checkpoint_store.len() > self.max_uri_len {
            return Err(ConfigError::new(
                "checkpoint_store",
                format!("{} bytes", self.checkpoint_store.len()),
                format!("must be at most max_uri_len ({}) bytes", self.max_uri_len),
            ));
        }
        if !self.checkpoint_store.is_empty() {
            let scheme = self.checkpoint_store.split_once("://").map(|(s, _)| s);
            if !scheme.is_some_and(|s| CHECKPOINT_STORE_SCHEMES.contains(&s)) {
                return Err(ConfigError::new(
                    "checkpoint_store",
                    suanli_model::error::quote(&self.checkpoint_store),
                    format!(
                        "must be empty or a URL with scheme {} (scheme://...)",
                        CHECKPOINT_STORE_SCHEMES.join(", ")
                    ),
                ));
            }
        }
        if self.avoid_failed_node_s > self.limits.max_duration_s {
            return Err(ConfigError::new(
                "avoid_failed_node_s",
                self.avoid_failed_node_s,
                format!("must be at most limits.max_duration_s ({})", self.limits.max_duration_s),
            ));
        }
        if self.max_infra_requeues == 0 || self.max_infra_requeues > 1_000_000 {
            return Err(ConfigError::new(
                "max_infra_requeues",
                self.max_infra_requeues,
                "must be between 1 and 1000000".into(),
            ));
        }
        self.default_retry.validate(self)
    }
}

/// The URL schemes a checkpoint store may use (what the agents' `object_store` opens).
pub const CHECKPOINT_STORE_SCHEMES: [&str; 4] = ["file", "s3", "gs", "az"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let r = RetryPolicy { max_attempts: 5, backoff_base_s: 10, backoff_max_s: 60 };
        assert_eq!(r.backoff_s(0), 0);
        assert_eq!(r.backoff_s(1), 10);
        assert_eq!(r.backoff_s(2), 20);
        assert_eq!(r.backoff_s(3), 40);
        assert_eq!(r.backoff_s(4), 60);
        assert_eq!(r.backoff_s(400), 60);
    }

    #[test]
    fn config_errors_name_the_field() {
        assert_eq!(StateConfig::default().validate(), Ok(()));
        let c = StateConfig { max_live_jobs: 0, ..StateConfig::default() };
        let e = c.validate().expect_err("zero jobs is unusable");
        assert_eq!(e.field, "max_live_jobs");
        let c = StateConfig {
            default_retry: RetryPolicy { max_attempts: 0, ..RetryPolicy::default() },
            ..StateConfig::default()
        };
        assert_eq!(c.validate().map_err(|e| e.field), Err("retry.max_attempts".to_owned()));
    }

    #[test]
    fn checkpoint_settings_are_bounded() {
        let field = |c: StateConfig| c.validate().map_err(|e| e.field);
        for ok in ["", "file:///shared/ckpt", "s3://bucket/prefix", "gs://b", "az://container/p"] {
            assert_eq!(field(StateConfig { checkpoint_store: ok.into(), ..StateConfig::default() }), Ok(()), "{ok}");
        }
        for bad in ["/shared/ckpt", "http://x", "s3:/bucket", "ftp://h/p"] {
            let c = StateConfig { checkpoint_store: bad.into(), ..StateConfig::default() };
            assert_eq!(field(c), Err("checkpoint_store".to_owned()), "{bad}");
        }
        let long = format!("s3://{}", "b".repeat(3000));
        assert_eq!(
            field(StateConfig { checkpoint_store: long, ..StateConfig::default() }),
            Err("checkpoint_store".into())
        );
        let c = StateConfig { avoid_failed_node_s: u64::MAX, ..StateConfig::default() };
        assert_eq!(field(c), Err("avoid_failed_node_s".to_owned()));
        let c = StateConfig { max_infra_requeues: 0, ..StateConfig::default() };
        assert_eq!(field(c), Err("max_infra_requeues".to_owned()));
    }
}
