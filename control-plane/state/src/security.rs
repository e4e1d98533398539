//! The replicated security records: the bearer-token signing key, the tokens issued (until they
//! expire) with their revocation, and the audit log (a bounded ring, oldest dropped first).
//!
//! ```text
//!  Access.CreateToken ─▶ IssueToken{key if none yet, record} ─▶ tokens[id]; the server signs with token_key
//!  Access.RevokeToken ─▶ RevokeToken{id}                      ─▶ tokens[id].revoked (kept until it expires)
//!  every mutating call ─(the server's access layer, batched)─▶ RecordAudit{entries} ─▶ audit ring (seq assigned here)
//! ```
//!
//! Like the rest of the state it reads no clock: expiry is judged at the time a command carries.

use crate::command::CommandError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// A token's record (never the token itself: only the key can make it again).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// Its id.
    pub id: String,
    /// The user it stands for.
    pub name: String,
    /// Its role (`admin`, `operator`, `member`, `viewer`).
    pub role: String,
    /// Its team.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// Issued at, seconds since the Unix epoch.
    pub issued_at: u64,
    /// Expires at, seconds since the Unix epoch.
    pub expires_at: u64,
    /// Revoked.
    #[serde(default)]
    pub revoked: bool,
    /// Who created it (a principal as the audit log writes it).
    pub created_by: String,
}

/// One audited call, as the server's access layer saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When it was answered, milliseconds since the Unix epoch (the answering server's clock).
    pub at_ms: u64,
    /// Who called.
    pub principal: String,
    /// The gRPC method.
    pub method: String,
    /// What it was about.
    pub target: String,
    /// The status code's name (`OK`, `PERMISSION_DENIED`, ...).
    pub code: String,
    /// The status message, cut to [`MAX_AUDIT_TEXT`] bytes.
    pub message: String,
    /// The answering server's raft id.
    pub server: u64,
    /// The caller's address.
    pub remote: String,
}

/// A committed audit record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Increasing, assigned at apply.
    pub seq: u64,
    /// The entry.
    #[serde(flatten)]
    pub entry: AuditEntry,
}

/// Longest text field of an audit entry, in bytes (longer ones are cut at apply).
pub const MAX_AUDIT_TEXT: usize = 256;

/// The security part of the state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecurityState {
    /// The token signing key, base64 (standard, padded) of 32 bytes; `None` until the first
    /// token is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_key: Option<String>,
    /// Tokens issued and not yet expired, by id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tokens: BTreeMap<String, TokenRecord>,
    /// The audit log, oldest first, at most `StateConfig::audit_retention` records.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub audit: VecDeque<AuditRecord>,
    /// The sequence number the next audit record gets.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub next_audit_seq: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl SecurityState {
    /// Whether nothing was ever recorded (then it is left out of snapshots and the state hash).
    pub fn is_empty(&self) -> bool {
        self == &SecurityState::default()
    }
}

/// Records a token (and sets the signing key if there is none yet).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IssueToken {
    /// Time of the command.
    pub now: u64,
    /// A new signing key (base64 of 32 random bytes) for a cluster without one; ignored when
    /// the cluster has one (the first committed key wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The token's record.
    pub token: TokenRecord,
}

/// Revokes a token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeToken {
    /// Time of the command.
    pub now: u64,
    /// The token's id.
    pub id: String,
}

/// Appends audit entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordAudit {
    /// The entries, in the order they were answered.
    pub entries: Vec<AuditEntry>,
}

/// An audit page ([`crate::State::audit_page`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditPage {
    /// The records.
    pub records: Vec<AuditRecord>,
    /// The last record's seq when more may follow; 0 when this page was the last.
    pub next_after_seq: u64,
    /// The oldest seq kept.
    pub oldest_seq: u64,
}

/// Validation of the commands' fields (the server validates too; apply re-checks).
#[allow(dead_code)]
pub(crate) fn check_token(t: &TokenRecord) -> Result<(), CommandError> {
    let _ = t;
    todo!("h-state")
}

impl crate::State {
    /// The security records.
    pub fn security(&self) -> &SecurityState {
        &self.security
    }

    /// The token signing key (decoded), if the cluster has one.
    pub fn token_key(&self) -> Option<Vec<u8>> {
        todo!("h-state")
    }

    /// Whether the token `id` is revoked (a token unknown here is not on the list: its
    /// signature and expiry decide).
    pub fn token_revoked(&self, id: &str) -> bool {
        self.security.tokens.get(id).is_some_and(|t| t.revoked)
    }

    /// Up to `limit` audit records after `after_seq` whose principal and method contain the
    /// given texts (empty: any).
    pub fn audit_page(&self, after_seq: u64, limit: usize, principal: &str, method: &str) -> AuditPage {
        let _ = (after_seq, limit, principal, method);
        todo!("h-state")
    }

    pub(crate) fn issue_token(&mut self, c: IssueToken) -> crate::state::Applied {
        let _ = c;
        todo!("h-state")
    }

    pub(crate) fn revoke_token(&mut self, c: RevokeToken) -> crate::state::Applied {
        let _ = c;
        todo!("h-state")
    }

    pub(crate) fn record_audit(&mut self, c: RecordAudit) -> crate::state::Applied {
        let _ = c;
        todo!("h-state")
    }
}
