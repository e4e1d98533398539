//! Bearer tokens: `sl1.<base64url(JSON claims)>.<base64url(HMAC-SHA256 of the first two parts)>`,
//! signed with a 32-byte key kept in the replicated state (every server verifies locally; the
//! key never leaves the servers but in a backup). Revocation is a replicated list of token ids,
//! kept until the token would have expired anyway.
//!
//! A token is sent as the gRPC metadata `authorization: Bearer <token>`; when a call carries
//! one, it is the caller's identity (a client certificate, if any, only authenticated the TLS
//! connection).

use crate::principal::{Credential, Principal, Role};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The prefix (and version) of every token.
pub const PREFIX: &str = "sl1";

/// The metadata key a token travels in (value `Bearer <token>`).
pub const METADATA_KEY: &str = "authorization";

/// Longest token accepted, in bytes (anything longer is refused before any work).
pub const MAX_TOKEN_BYTES: usize = 4096;

/// Length of a signing key, in bytes.
pub const KEY_BYTES: usize = 32;

/// What a token says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Unique id (what revocation names).
    pub id: String,
    /// The user's name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// Its team (required for members).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// Issued at, seconds since the Unix epoch.
    pub iat: u64,
    /// Expires at, seconds since the Unix epoch.
    pub exp: u64,
}

impl Claims {
    /// The principal the token stands for.
    pub fn principal(&self) -> Principal {
        Principal::User {
            name: self.name.clone(),
            role: self.role,
            team: self.team.clone(),
            credential: Credential::Token { id: self.id.clone() },
        }
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TokenError {
    /// Not a token of this format (or too long).
    #[error("malformed token: {0}")]
    Malformed(String),
    /// The signature does not match the cluster's key (forged, or from another cluster).
    #[error("token signature does not verify")]
    BadSignature,
    /// Past its expiry.
    #[error("token {id} expired at {exp} (now {now})")]
    Expired {
        /// Its id.
        id: String,
        /// Its expiry.
        exp: u64,
        /// The verifier's time.
        now: u64,
    },
    /// On the revocation list.
    #[error("token {0} was revoked")]
    Revoked(String),
    /// The cluster has no signing key yet (no token was ever created).
    #[error("this cluster has issued no tokens (no signing key)")]
    NoKey,
}

/// The HMAC-SHA256 of `input` under `key`.
fn mac(key: &[u8], input: &[u8]) -> hmac::Tag {
    hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), input)
}

/// The token in an `authorization` metadata value (`Bearer <token>`, the scheme in either
/// case), refusing a value longer than a token allows before looking at it; the error names the
/// metadata key.
pub fn bearer(value: &[u8]) -> Result<&str, String> {
    if value.len() > MAX_TOKEN_BYTES + "Bearer ".len() {
        return Err(format!(
            "{METADATA_KEY}: {} bytes is over the limit of {MAX_TOKEN_BYTES} bytes for a token",
            value.len()
        ));
    }
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.strip_prefix("Bearer ").or_else(|| s.strip_prefix("bearer ")))
        .map(str::trim)
        .ok_or_else(|| format!("{METADATA_KEY}: not `Bearer <token>`"))
}

/// Signs `claims` with `key`: `sl1.<base64url(JSON claims)>.<base64url(HMAC-SHA256)>`, the MAC
/// taken over `sl1.<claims part>`.
pub fn sign(key: &[u8], claims: &Claims) -> String {
    let json = serde_json::to_vec(claims).expect("claims of plain data always serialize to JSON");
    let body = format!("{PREFIX}.{}", URL_SAFE_NO_PAD.encode(json));
    let tag = mac(key, body.as_bytes());
    format!("{body}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))
}

/// Verifies a token against `key` at `now` (seconds since the epoch); `revoked` says whether
/// an id is on the revocation list. The signature is checked in constant time before the
/// claims are trusted (or even decoded). An empty key is [`TokenError::NoKey`].
pub fn verify(key: &[u8], token: &str, now: u64, revoked: impl Fn(&str) -> bool) -> Result<Claims, TokenError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::Malformed(format!("{} bytes; the limit is {MAX_TOKEN_BYTES}", token.len())));
    }
    if key.is_empty() {
        return Err(TokenError::NoKey);
    }
    let (body, sig) =
        token.rsplit_once('.').ok_or_else(|| TokenError::Malformed(format!("not {PREFIX}.<claims>.<signature>")))?;
    let claims_part = match body.split_once('.') {
        Some((p, c)) if p == PREFIX && !c.contains('.') => c,
        Some((p, _)) if p != PREFIX => {
            return Err(TokenError::Malformed(format!("prefix is not {PREFIX} (another format or version)")));
        }
        _ => return Err(TokenError::Malformed(format!("not {PREFIX}.<claims>.<signature>"))),
    };
    let sig = URL_SAFE_NO_PAD.decode(sig).map_err(|e| TokenError::Malformed(format!("signature: {e}")))?;
    hmac::verify(&hmac::Key::new(hmac::HMAC_SHA256, key), body.as_bytes(), &sig)
        .map_err(|_| TokenError::BadSignature)?;
    let json = URL_SAFE_NO_PAD.decode(claims_part).map_err(|e| TokenError::Malformed(format!("claims: {e}")))?;
    let claims: Claims = serde_json::from_slice(&json).map_err(|e| TokenError::Malformed(format!("claims: {e}")))?;
    if claims.exp <= now {
        return Err(TokenError::Expired { id: claims.id, exp: claims.exp, now });
    }
    if revoked(&claims.id) {
        return Err(TokenError::Revoked(claims.id));
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; KEY_BYTES] = [7; KEY_BYTES];

    #[test]
    fn bearer_values_are_read_and_bounded() {
        assert_eq!(bearer(b"Bearer sl1.a.b"), Ok("sl1.a.b"));
        assert_eq!(bearer(b"bearer  sl1.a.b "), Ok("sl1.a.b"));
        assert!(bearer(b"Basic eA==").expect_err("not bearer").contains("not `Bearer"));
        let long = format!("Bearer {}", "x".repeat(MAX_TOKEN_BYTES + 1));
        assert!(bearer(long.as_bytes()).expect_err("too long").contains("over the limit"));
        assert!(bearer(&[0xff, 0xfe]).is_err());
    }

    fn claims() -> Claims {
        Claims {
            id: "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b".into(),
            name: "alice".into(),
            role: Role::Member,
            team: Some("nlp".into()),
            iat: 1_000,
            exp: 2_000,
        }
    }

    fn never(_: &str) -> bool {
        false
    }

    #[test]
    fn round_trip() {
        let t = sign(&KEY, &claims());
        assert!(t.starts_with("sl1."), "{t}");
        assert_eq!(t.split('.').count(), 3);
        assert!(t.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_')), "{t}");
        let c = verify(&KEY, &t, 1_500, never).expect("a fresh token verifies");
        assert_eq!(c, claims());
        let p = c.principal();
        assert_eq!(p.to_string(), "token:0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b:alice(member,nlp)");
    }

    #[test]
    fn tampered_claims_do_not_verify() {
        let t = sign(&KEY, &claims());
        let (_, sig) = t.rsplit_once('.').expect("three parts");
        let admin = Claims { role: Role::Admin, team: None, ..claims() };
        let forged_body = sign(&KEY, &admin);
        let (forged_body, _) = forged_body.rsplit_once('.').expect("three parts");
        let forged = format!("{forged_body}.{sig}");
        assert_eq!(verify(&KEY, &forged, 1_500, never), Err(TokenError::BadSignature));
        // One flipped character of the signature.
        let mut bytes = t.clone().into_bytes();
        let last = bytes.len() - 2;
        bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(bytes).expect("ascii");
        assert_eq!(verify(&KEY, &flipped, 1_500, never), Err(TokenError::BadSignature));
    }

    #[test]
    fn wrong_key_and_no_key() {
        let t = sign(&KEY, &claims());
        assert_eq!(verify(&[8; KEY_BYTES], &t, 1_500, never), Err(TokenError::BadSignature));
        assert_eq!(verify(&[], &t, 1_500, never), Err(TokenError::NoKey));
    }

    #[test]
    fn expired_and_revoked() {
        let t = sign(&KEY, &claims());
        assert_eq!(
            verify(&KEY, &t, 2_000, never),
            Err(TokenError::Expired { id: claims().id, exp: 2_000, now: 2_000 })
        );
        assert_eq!(verify(&KEY, &t, 1_999, |id| id == claims().id), Err(TokenError::Revoked(claims().id)));
        assert!(verify(&KEY, &t, 1_999, |id| id == "other").is_ok());
        let e = verify(&KEY, &t, 5_000, never).expect_err("expired");
        assert!(e.to_string().contains("expired at 2000 (now 5000)"), "{e}");
    }

    #[test]
    fn oversize_is_refused_before_any_work() {
        let long = format!("sl1.{}.x", "a".repeat(MAX_TOKEN_BYTES));
        match verify(&KEY, &long, 1_500, never) {
            Err(TokenError::Malformed(m)) => assert!(m.contains("limit is 4096"), "{m}"),
            other => panic!("oversize token: {other:?}"),
        }
    }

    #[test]
    fn garbage_is_malformed_or_unsigned() {
        let good = sign(&KEY, &claims());
        let (_, sig) = good.rsplit_once('.').expect("three parts");
        for g in
            ["", "sl1", "sl1.", "sl1..", "x.y.z", "sl2.abc.def", "sl1.a.b.c", "sl1.abc.!!!", "Bearer sl1.a.b", "\u{0}"]
        {
            match verify(&KEY, g, 1_500, never) {
                Err(TokenError::Malformed(_) | TokenError::BadSignature) => {}
                other => panic!("{g:?}: {other:?}"),
            }
        }
        // Signed, but the claims are not claims: refused only after the signature checks.
        let body = format!("{PREFIX}.{}", URL_SAFE_NO_PAD.encode(b"{\"id\":1}"));
        let tag = URL_SAFE_NO_PAD.encode(mac(&KEY, body.as_bytes()).as_ref());
        assert!(matches!(verify(&KEY, &format!("{body}.{tag}"), 1_500, never), Err(TokenError::Malformed(_))));
        // The same garbage claims with someone else's signature: the signature fails first.
        assert_eq!(verify(&KEY, &format!("{body}.{sig}"), 1_500, never), Err(TokenError::BadSignature));
    }
}
