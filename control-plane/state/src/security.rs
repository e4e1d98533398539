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

use crate::command::{CommandError, Response};
use crate::state::{Effect, cut};
use base64::Engine as _;
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

/// Longest text field of an audit entry (and a token's `created_by`), in bytes (longer ones
/// are cut at apply, on a character boundary).
pub const MAX_AUDIT_TEXT: usize = 256;

/// Most entries in one [`RecordAudit`] command (more is refused as a whole: the access layer
/// sends its batches at most this long).
pub const MAX_AUDIT_ENTRIES_PER_COMMAND: usize = 1024;

/// The roles a token may carry (`suanli_security::Role`'s names).
pub const TOKEN_ROLES: [&str; 4] = ["admin", "operator", "member", "viewer"];

/// Longest identity name (token id, user, team), in bytes (`suanli_security`'s
/// `MAX_IDENTITY_NAME`).
pub const MAX_IDENTITY_NAME: usize = 253;

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
    /// The sequence number the next audit record gets (0 until the first record, which gets
    /// 1: `after_seq = 0` means "from the oldest").
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

/// A name usable in an identity: 1 to [`MAX_IDENTITY_NAME`] bytes of ASCII letters, digits,
/// `.`, `_` and `-`.
fn check_name(field: &str, s: &str) -> Result<(), CommandError> {
    if s.is_empty() || s.len() > MAX_IDENTITY_NAME {
        return Err(CommandError::Invalid {
            field: field.into(),
            message: format!("{} bytes; must be 1 to {MAX_IDENTITY_NAME} bytes", s.len()),
        });
    }
    if let Some(c) = s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(CommandError::Invalid {
            field: field.into(),
            message: format!("{} contains {c:?}; only letters, digits, '.', '_' and '-' are allowed", quote(s)),
        });
    }
    Ok(())
}

/// Validation of a token record's fields (the server validates too; apply re-checks).
pub(crate) fn check_token(t: &TokenRecord) -> Result<(), CommandError> {
    check_name("token.id", &t.id)?;
    check_name("token.name", &t.name)?;
    if let Some(team) = &t.team {
        check_name("token.team", team)?;
    }
    if !TOKEN_ROLES.contains(&t.role.as_str()) {
        return Err(CommandError::Invalid {
            field: "token.role".into(),
            message: format!("unknown role {}: one of {}", quote(&t.role), TOKEN_ROLES.join(", ")),
        });
    }
    if t.role == "member" && t.team.is_none() {
        return Err(CommandError::Invalid {
            field: "token.team".into(),
            message: "a member's token needs a team".into(),
        });
    }
    if t.expires_at <= t.issued_at {
        return Err(CommandError::Invalid {
            field: "token.expires_at".into(),
            message: format!("{} is not after issued_at ({})", t.expires_at, t.issued_at),
        });
    }
    Ok(())
}

/// Decodes a signing key: base64 (standard, padded) of exactly 32 bytes.
pub fn decode_key(key: &str) -> Result<Vec<u8>, CommandError> {
    let invalid = |message: String| CommandError::Invalid { field: "key".into(), message };
    if key.len() > 64 {
        return Err(invalid(format!("{} bytes of base64; a key is 44", key.len())));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(key)
        .map_err(|e| invalid(format!("not base64 (standard, padded): {e}")))?;
    if bytes.len() != TOKEN_KEY_BYTES {
        return Err(invalid(format!("{} bytes; a key is {TOKEN_KEY_BYTES} bytes", bytes.len())));
    }
    Ok(bytes)
}

/// Encodes a signing key as [`SecurityState::token_key`] holds it.
pub fn encode_key(key: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(key)
}

/// Length of a token signing key, in bytes.
pub const TOKEN_KEY_BYTES: usize = 32;

fn quote(s: &str) -> String {
    suanli_model::error::quote(s)
}

impl crate::State {
    /// The security records.
    pub fn security(&self) -> &SecurityState {
        &self.security
    }

    /// The token signing key (decoded), if the cluster has one.
    pub fn token_key(&self) -> Option<Vec<u8>> {
        // Only a valid key is ever committed ([`decode_key`] at apply).
        self.security.token_key.as_deref().and_then(|k| decode_key(k).ok())
    }

    /// Whether the token `id` is revoked (a token unknown here is not on the list: its
    /// signature and expiry decide).
    pub fn token_revoked(&self, id: &str) -> bool {
        self.security.tokens.get(id).is_some_and(|t| t.revoked)
    }

    /// Up to `limit` (at least 1) audit records after `after_seq` whose principal and method
    /// contain the given texts (empty: any), oldest first.
    pub fn audit_page(&self, after_seq: u64, limit: usize, principal: &str, method: &str) -> AuditPage {
        let limit = limit.max(1);
        let audit = &self.security.audit;
        let start = audit.partition_point(|r| r.seq <= after_seq);
        let mut records = Vec::new();
        let mut next_after_seq = 0;
        for r in audit.range(start..) {
            if !r.entry.principal.contains(principal) || !r.entry.method.contains(method) {
                continue;
            }
            if records.len() == limit {
                // One more matches: the page is full and more follow.
                next_after_seq = records.last().map_or(0, |x: &AuditRecord| x.seq);
                break;
            }
            records.push(r.clone());
        }
        AuditPage { records, next_after_seq, oldest_seq: audit.front().map_or(0, |r| r.seq) }
    }

    /// Drops the tokens expired at `now` (their revocation is moot: a verifier refuses them
    /// as expired).
    fn prune_tokens(&mut self, now: u64) -> bool {
        let before = self.security.tokens.len();
        self.security.tokens.retain(|_, t| t.expires_at > now);
        self.security.tokens.len() != before
    }

    pub(crate) fn issue_token(&mut self, c: IssueToken) -> crate::state::Applied {
        let mut t = c.token;
        check_token(&t)?;
        let new_key = match &c.key {
            Some(k) => Some(decode_key(k).map(|_| k.clone())?),
            None => None,
        };
        if self.security.token_key.is_none() && new_key.is_none() {
            return Err(CommandError::Invalid {
                field: "key".into(),
                message: "the cluster has no token signing key yet: the first token must carry one".into(),
            });
        }
        let now = c.now.max(self.clock);
        if t.expires_at <= now {
            return Err(CommandError::Invalid {
                field: "token.expires_at".into(),
                message: format!("{} is not after the command's time ({now})", t.expires_at),
            });
        }
        if self.security.tokens.contains_key(&t.id) {
            return Err(CommandError::Conflict {
                field: "token.id".into(),
                message: format!("token {} already exists", quote(&t.id)),
            });
        }
        let live = self.security.tokens.values().filter(|x| x.expires_at > now).count();
        if live >= self.config.max_tokens {
            return Err(CommandError::TooMany {
                what: "tokens (issued and not yet expired)".into(),
                limit: self.config.max_tokens,
            });
        }
        self.tick(c.now);
        self.prune_tokens(now);
        if self.security.token_key.is_none() {
            self.security.token_key = new_key;
        }
        t.created_by = cut(&t.created_by, MAX_AUDIT_TEXT);
        t.revoked = false;
        self.security.tokens.insert(t.id.clone(), t);
        Ok((Response::Done, Effect::Changed))
    }

    pub(crate) fn revoke_token(&mut self, c: RevokeToken) -> crate::state::Applied {
        let now = c.now.max(self.clock);
        let unknown = || CommandError::Invalid {
            field: "id".into(),
            message: format!("unknown token {} (never issued here, or expired)", quote(&c.id)),
        };
        match self.security.tokens.get(&c.id) {
            None => return Err(unknown()),
            Some(t) if t.expires_at <= now => return Err(unknown()),
            Some(t) if t.revoked => {
                // Already revoked: a retry of the same revocation. Pruning still happens.
                self.tick(c.now);
                let pruned = self.prune_tokens(now);
                return Ok((Response::Done, if pruned { Effect::Changed } else { Effect::Unchanged }));
            }
            Some(_) => {}
        }
        self.tick(c.now);
        self.prune_tokens(now);
        if let Some(t) = self.security.tokens.get_mut(&c.id) {
            t.revoked = true;
        }
        Ok((Response::Done, Effect::Changed))
    }

    pub(crate) fn record_audit(&mut self, c: RecordAudit) -> crate::state::Applied {
        if c.entries.len() > MAX_AUDIT_ENTRIES_PER_COMMAND {
            return Err(CommandError::TooMany {
                what: "audit entries in one command".into(),
                limit: MAX_AUDIT_ENTRIES_PER_COMMAND,
            });
        }
        if c.entries.is_empty() {
            return Ok((Response::Done, Effect::Unchanged));
        }
        let sec = &mut self.security;
        for e in c.entries {
            let seq = sec.next_audit_seq.max(1);
            sec.next_audit_seq = seq + 1;
            let entry = AuditEntry {
                at_ms: e.at_ms,
                principal: cut(&e.principal, MAX_AUDIT_TEXT),
                method: cut(&e.method, MAX_AUDIT_TEXT),
                target: cut(&e.target, MAX_AUDIT_TEXT),
                code: cut(&e.code, MAX_AUDIT_TEXT),
                message: cut(&e.message, MAX_AUDIT_TEXT),
                server: e.server,
                remote: cut(&e.remote, MAX_AUDIT_TEXT),
            };
            sec.audit.push_back(AuditRecord { seq, entry });
        }
        self.trim_audit(self.config.audit_retention);
        Ok((Response::Done, Effect::Changed))
    }

    /// Drops the oldest audit records beyond `retention`.
    fn trim_audit(&mut self, retention: usize) {
        let audit = &mut self.security.audit;
        if audit.len() > retention {
            let excess = audit.len() - retention;
            audit.drain(..excess);
        }
    }

    /// Fits the security records to a new configuration before it is committed: the audit
    /// log is cut to the new retention; a `max_tokens` below the tokens recorded is refused
    /// (tokens cannot be dropped: a revoked one would be accepted again).
    pub(crate) fn fit_security_to(&mut self, config: &crate::config::StateConfig) -> Result<(), CommandError> {
        let now = self.clock;
        let live = self.security.tokens.values().filter(|t| t.expires_at > now).count();
        if live > config.max_tokens {
            return Err(CommandError::Conflict {
                field: "max_tokens".into(),
                message: format!(
                    "{} is below the {live} tokens issued and not yet expired; revoked tokens are kept until they expire",
                    config.max_tokens
                ),
            });
        }
        self.prune_tokens(now);
        self.trim_audit(config.audit_retention);
        Ok(())
    }
}
