//! Raft timing, snapshot and transport limits, validated.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Every raft knob suanli exposes. Defaults aim at sub-second failover on a LAN (etcd's
/// default election timeout is 1 s) and bounded logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RaftSettings {
    /// Name of the raft group; RPCs for another group are refused.
    pub group: String,
    /// Leader heartbeat period.
    pub heartbeat_interval_ms: u64,
    /// Lower bound of the randomized election timeout.
    pub election_timeout_min_ms: u64,
    /// Upper bound of the randomized election timeout.
    pub election_timeout_max_ms: u64,
    /// Deadline of one AppendEntries RPC.
    pub append_timeout_ms: u64,
    /// Deadline of one Vote RPC.
    pub vote_timeout_ms: u64,
    /// Deadline of one snapshot chunk.
    pub snapshot_chunk_timeout_ms: u64,
    /// Deadline for opening a connection to a peer.
    pub connect_timeout_ms: u64,
    /// Build a snapshot after this many log entries since the last one.
    pub snapshot_after_entries: u64,
    /// Entries kept in the log behind a snapshot (so slow followers catch up without one).
    pub keep_entries_after_snapshot: u64,
    /// Snapshot chunk size in bytes.
    pub snapshot_chunk_bytes: u64,
    /// Most entries in one AppendEntries.
    pub max_entries_per_append: u64,
    /// Most bytes of stored entries in one AppendEntries (one entry is always sent, however
    /// large). openraft 0.9 gives an AppendEntries one heartbeat interval to complete, so a
    /// follower catching up must receive and fsync this much within it.
    pub max_append_bytes: u64,
    /// Largest raft message a server accepts or a client sends, in bytes.
    pub max_message_bytes: usize,
    /// Address rewrites for dialing peers: `advertised address -> address to dial`. For NAT, a
    /// proxy in front of a peer, or the chaos harness's fault-injecting links (one proxy per
    /// directed link). Applies to raft RPCs and to forwarded writes and reads. Empty: dial the
    /// advertised address.
    pub dial: BTreeMap<String, String>,
}

impl Default for RaftSettings {
    fn default() -> Self {
        Self {
            group: "region".into(),
            heartbeat_interval_ms: 100,
            election_timeout_min_ms: 200,
            election_timeout_max_ms: 400,
            append_timeout_ms: 1000,
            vote_timeout_ms: 250,
            snapshot_chunk_timeout_ms: 5000,
            connect_timeout_ms: 500,
            snapshot_after_entries: 10_000,
            keep_entries_after_snapshot: 1000,
            snapshot_chunk_bytes: 1024 * 1024,
            max_entries_per_append: 64,
            max_append_bytes: 1024 * 1024,
            max_message_bytes: 64 * 1024 * 1024,
            dial: BTreeMap::new(),
        }
    }
}

/// A setting out of bounds.
#[derive(Debug, Error)]
pub enum SettingsError {
    /// One of our fields.
    #[error("raft.{field}: {value} is invalid; {expected}")]
    Field {
        /// Field name.
        field: &'static str,
        /// Value given.
        value: String,
        /// What would be valid.
        expected: String,
    },
    /// openraft refused the derived configuration.
    #[error("raft: {0}")]
    Openraft(Box<openraft::ConfigError>),
}

impl RaftSettings {
    /// The address to dial for a peer advertised at `addr` (see [`RaftSettings::dial`]).
    pub fn dial_addr<'a>(&'a self, addr: &'a str) -> &'a str {
        self.dial.get(addr).map_or(addr, String::as_str)
    }

    /// Checks bounds.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let bad = |field: &'static str, value: u64, expected: String| {
            Err(SettingsError::Field { field, value: value.to_string(), expected })
        };
        if self.group.is_empty() || self.group.len() > 64 {
            return Err(SettingsError::Field {
                field: "group",
                value: format!("{:?}", self.group),
                expected: "must be 1 to 64 bytes".into(),
            });
        }
        for (field, v, min, max) in [
            ("heartbeat_interval_ms", self.heartbeat_interval_ms, 10, 60_000),
            ("election_timeout_min_ms", self.election_timeout_min_ms, 20, 600_000),
            ("election_timeout_max_ms", self.election_timeout_max_ms, 21, 600_000),
            ("append_timeout_ms", self.append_timeout_ms, 1, 600_000),
            ("vote_timeout_ms", self.vote_timeout_ms, 1, 600_000),
            ("snapshot_chunk_timeout_ms", self.snapshot_chunk_timeout_ms, 1, 3_600_000),
            ("connect_timeout_ms", self.connect_timeout_ms, 1, 600_000),
            ("snapshot_after_entries", self.snapshot_after_entries, 1, 1 << 40),
            ("keep_entries_after_snapshot", self.keep_entries_after_snapshot, 0, 1 << 40),
            ("snapshot_chunk_bytes", self.snapshot_chunk_bytes, 1024, 1 << 30),
            ("max_entries_per_append", self.max_entries_per_append, 1, 1 << 20),
            ("max_append_bytes", self.max_append_bytes, 4096, 1 << 30),
        ] {
            if v < min || v > max {
                return bad(field, v, format!("must be between {min} and {max}"));
            }
        }
        if self.dial.len() > 4096 {
            return bad("dial", self.dial.len() as u64, "at most 4096 address rewrites".into());
        }
        if let Some((from, to)) =
            self.dial.iter().find(|(f, t)| f.is_empty() || t.is_empty() || f.len() > 256 || t.len() > 256)
        {
            return Err(SettingsError::Field {
                field: "dial",
                value: format!("{from:?} = {to:?}"),
                expected: "addresses must be 1 to 256 bytes".into(),
            });
        }
        if self.election_timeout_min_ms <= self.heartbeat_interval_ms {
            return bad(
                "election_timeout_min_ms",
                self.election_timeout_min_ms,
                format!("must exceed heartbeat_interval_ms ({})", self.heartbeat_interval_ms),
            );
        }
        if self.election_timeout_max_ms <= self.election_timeout_min_ms {
            return bad(
                "election_timeout_max_ms",
                self.election_timeout_max_ms,
                format!("must exceed election_timeout_min_ms ({})", self.election_timeout_min_ms),
            );
        }
        let chunk_room = usize::try_from(self.snapshot_chunk_bytes).unwrap_or(usize::MAX).saturating_mul(2);
        let append_room = usize::try_from(self.max_append_bytes).unwrap_or(usize::MAX).saturating_mul(2);
        if self.max_message_bytes < append_room.max(chunk_room) || self.max_message_bytes > 1 << 31 {
            return Err(SettingsError::Field {
                field: "max_message_bytes",
                value: self.max_message_bytes.to_string(),
                expected: format!(
                    "must be between 2 x snapshot_chunk_bytes and 2 x max_append_bytes ({}) and 2 GiB",
                    append_room.max(chunk_room)
                ),
            });
        }
        Ok(())
    }

    /// The openraft configuration these settings imply.
    pub fn openraft_config(&self) -> Result<Arc<openraft::Config>, SettingsError> {
        self.validate()?;
        let c = openraft::Config {
            cluster_name: self.group.clone(),
            heartbeat_interval: self.heartbeat_interval_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            install_snapshot_timeout: self.snapshot_chunk_timeout_ms,
            max_payload_entries: self.max_entries_per_append,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(self.snapshot_after_entries),
            snapshot_max_chunk_size: self.snapshot_chunk_bytes,
            max_in_snapshot_log_to_keep: self.keep_entries_after_snapshot,
            ..openraft::Config::default()
        };
        Ok(Arc::new(c.validate().map_err(|e| SettingsError::Openraft(Box::new(e)))?))
    }

    pub(crate) fn append_timeout(&self) -> Duration {
        Duration::from_millis(self.append_timeout_ms)
    }
    pub(crate) fn vote_timeout(&self) -> Duration {
        Duration::from_millis(self.vote_timeout_ms)
    }
    pub(crate) fn snapshot_timeout(&self) -> Duration {
        Duration::from_millis(self.snapshot_chunk_timeout_ms)
    }
    /// [`RaftSettings::max_append_bytes`] as a size.
    pub fn append_bytes(&self) -> usize {
        usize::try_from(self.max_append_bytes).unwrap_or(usize::MAX)
    }
    /// Deadline for opening a connection to a peer.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_errors_name_the_field() {
        assert!(RaftSettings::default().openraft_config().is_ok());
        let s = RaftSettings { election_timeout_min_ms: 50, ..RaftSettings::default() };
        let e = s.validate().expect_err("below the heartbeat");
        assert!(e.to_string().contains("raft.election_timeout_min_ms"), "{e}");
        let s = RaftSettings { max_message_bytes: 10, ..RaftSettings::default() };
        assert!(s.validate().expect_err("too small").to_string().contains("max_message_bytes"));
    }
}
