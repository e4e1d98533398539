//! The `Access` service: who the caller is, bearer tokens (create, revoke, list) and the audit
//! log, over the replicated security records ([`suanli_state::security`]).
//!
//! ```text
//!  CreateToken ─▶ check fields ─▶ IssueToken{key: 32 random bytes if the state has none, record}
//!              ─▶ committed ─▶ sign the claims with the committed key (the first key wins)
//!  RevokeToken ─▶ RevokeToken{id}      ListTokens, Audit ─▶ linearizable paged reads
//! ```
//!
//! Who may call what is not decided here: the access layer in front of every service does it
//! (docs/security.md), and puts the caller's [`Principal`] into the request's extensions. A
//! request without one was served by an `--insecure` server: its caller is
//! [`Principal::Insecure`].

use crate::core::Core;
use crate::page::{self, Page};
use crate::status::{bounded, invalid, rejection};
use std::ops::Bound;
use std::sync::Arc;
use suanli_proto::v1 as pb;
use suanli_proto::v1::access_server::Access;
use suanli_security::principal::{Credential, valid_name};
use suanli_security::token::{self, Claims};
use suanli_security::{Principal, Role};
use suanli_state::security::{MAX_AUDIT_TEXT, TokenRecord, encode_key};
use suanli_state::{Command, CommandError, IssueToken, Response, RevokeToken};
use tonic::{Request, Status};

type Resp<T> = Result<tonic::Response<T>, Status>;

/// The `Access` service.
#[derive(Clone)]
pub struct AccessApi(pub Arc<Core>);

/// The caller as the access layer saw it ([`Principal::Insecure`] when there is none: only an
/// `--insecure` server serves requests without one).
pub fn caller<T>(req: &Request<T>) -> Principal {
    req.extensions().get::<Principal>().cloned().unwrap_or(Principal::Insecure)
}

/// What `WhoAmI` answers for `p`.
pub fn who_am_i(p: &Principal) -> pb::WhoAmIResponse {
    let mut r = pb::WhoAmIResponse { principal: p.to_string(), ..Default::default() };
    match p {
        Principal::Anonymous => r.kind = "anonymous".into(),
        Principal::Insecure => r.kind = "insecure".into(),
        Principal::Node { name } => {
            r.kind = "node".into();
            r.name = name.clone();
        }
        Principal::Server { name } => {
            r.kind = "server".into();
            r.name = name.clone();
        }
        Principal::User { name, role, team, credential } => {
            r.kind = "user".into();
            r.name = name.clone();
            r.role = role.as_str().into();
            r.team = team.clone().unwrap_or_default();
            if let Credential::Token { id } = credential {
                r.token_id = id.clone();
            }
        }
    }
    r
}

/// The claims of a `CreateToken` request, checked: every refusal names its field and limit.
pub fn token_claims(r: &pb::CreateTokenRequest, now: u64, max_ttl_s: u64, id: String) -> Result<Claims, Status> {
    if !valid_name(&r.name) {
        return Err(invalid(
            "name",
            format!(
                "{} bytes; must be 1 to {} bytes of letters, digits, '.', '_' and '-'",
                r.name.len(),
                suanli_security::principal::MAX_IDENTITY_NAME
            ),
        ));
    }
    let role: Role = r.role.parse().map_err(|e: String| invalid("role", bounded(e)))?;
    let team = if r.team.is_empty() {
        None
    } else if valid_name(&r.team) {
        Some(r.team.clone())
    } else {
        return Err(invalid(
            "team",
            format!(
                "{} bytes; must be 1 to {} bytes of letters, digits, '.', '_' and '-'",
                r.team.len(),
                suanli_security::principal::MAX_IDENTITY_NAME
            ),
        ));
    };
    if role == Role::Member && team.is_none() {
        return Err(invalid("team", "a member's token needs a team"));
    }
    if r.ttl_s == 0 || r.ttl_s > max_ttl_s {
        return Err(invalid(
            "ttl_s",
            format!("{} s; must be 1 to {max_ttl_s} s (the server's max_token_ttl_s)", r.ttl_s),
        ));
    }
    Ok(Claims { id, name: r.name.clone(), role, team, iat: now, exp: now.saturating_add(r.ttl_s) })
}

/// A fresh signing key (32 bytes from the system's random source), base64.
fn new_key() -> Result<String, Status> {
    let key: [u8; token::KEY_BYTES] = ring::rand::generate(&ring::rand::SystemRandom::new())
        .map_err(|_| Status::internal("the system random source failed"))?
        .expose();
    Ok(encode_key(&key))
}

/// A refused token command: an unknown token is NOT_FOUND, the rest as every command.
fn token_refusal(e: &CommandError) -> Status {
    match e {
        CommandError::Invalid { field, message } if field == "id" => {
            Status::not_found(bounded(format!("id: {message}")))
        }
        e => rejection(e),
    }
}

/// A text filter of `Audit`, bounded like the texts it filters.
fn check_filter(field: &str, v: &str) -> Result<(), Status> {
    if v.len() > MAX_AUDIT_TEXT {
        return Err(invalid(field, format!("{} bytes; the limit is {MAX_AUDIT_TEXT}", v.len())));
    }
    Ok(())
}

fn token_info(t: &TokenRecord) -> pb::TokenInfo {
    pb::TokenInfo {
        id: t.id.clone(),
        name: t.name.clone(),
        role: t.role.clone(),
        team: t.team.clone().unwrap_or_default(),
        issued_at: t.issued_at,
        expires_at: t.expires_at,
        revoked: t.revoked,
        created_by: t.created_by.clone(),
    }
}

fn audit_record(r: &suanli_state::AuditRecord) -> pb::AuditRecord {
    let e = &r.entry;
    pb::AuditRecord {
        seq: r.seq,
        at_ms: e.at_ms,
        principal: e.principal.clone(),
        method: e.method.clone(),
        target: e.target.clone(),
        code: e.code.clone(),
        message: e.message.clone(),
        server: e.server,
        remote: e.remote.clone(),
    }
}

impl AccessApi {
    fn page<T: prost::Message>(&self, limit: u32) -> Page<T> {
        Page::new(page::count(limit, self.0.cfg.max_list), self.0.cfg.max_list_bytes)
    }
}

#[tonic::async_trait]
impl Access for AccessApi {
    async fn who_am_i(&self, req: Request<pb::WhoAmIRequest>) -> Resp<pb::WhoAmIResponse> {
        Ok(tonic::Response::new(who_am_i(&caller(&req))))
    }

    async fn create_token(&self, req: Request<pb::CreateTokenRequest>) -> Resp<pb::CreateTokenResponse> {
        let by = caller(&req).to_string();
        let r = req.into_inner();
        let now = self.0.now_s();
        let claims = token_claims(&r, now, self.0.cfg.max_token_ttl_s, uuid::Uuid::now_v7().to_string())?;
        // A key only for a cluster without one; when two servers race, the first committed wins
        // and the other's is ignored (the token is signed with the committed key below).
        let key = match self.0.state.read(|s| s.security().token_key.is_some()) {
            true => None,
            false => Some(new_key()?),
        };
        let record = TokenRecord {
            id: claims.id.clone(),
            name: claims.name.clone(),
            role: claims.role.as_str().into(),
            team: claims.team.clone(),
            issued_at: claims.iat,
            expires_at: claims.exp,
            revoked: false,
            created_by: by,
        };
        let cmd = Command::IssueToken(Box::new(IssueToken { now, key, token: record }));
        let (resp, _) = self.0.propose_raw(cmd).await?;
        if let Response::Rejected(e) = &resp {
            return Err(token_refusal(e));
        }
        // Applied here before the proposal answered (a forwarded one waits until it is).
        let key = self
            .0
            .state
            .read(|s| s.token_key())
            .ok_or_else(|| Status::internal("the token was recorded but this server holds no signing key"))?;
        let signed = token::sign(&key, &claims);
        tracing::info!(id = %claims.id, name = %claims.name, role = %claims.role, "token created");
        Ok(tonic::Response::new(pb::CreateTokenResponse { token: signed, id: claims.id, expires_at: claims.exp }))
    }

    async fn revoke_token(&self, req: Request<pb::RevokeTokenRequest>) -> Resp<pb::RevokeTokenResponse> {
        let r = req.into_inner();
        if !valid_name(&r.id) {
            return Err(invalid(
                "id",
                format!(
                    "{} bytes; a token id is 1 to {} bytes of letters, digits, '.', '_' and '-'",
                    r.id.len(),
                    suanli_security::principal::MAX_IDENTITY_NAME
                ),
            ));
        }
        let cmd = Command::RevokeToken(RevokeToken { now: self.0.now_s(), id: r.id.clone() });
        let (resp, index) = self.0.propose_raw(cmd).await?;
        if let Response::Rejected(e) = &resp {
            return Err(token_refusal(e));
        }
        tracing::info!(id = %r.id, "token revoked");
        Ok(tonic::Response::new(pb::RevokeTokenResponse { index }))
    }

    async fn list_tokens(&self, req: Request<pb::ListTokensRequest>) -> Resp<pb::ListTokensResponse> {
        let r = req.into_inner();
        let mut page = self.page(r.limit);
        let now = self.0.now_s();
        let after = if r.after.is_empty() { Bound::Unbounded } else { Bound::Excluded(r.after.clone()) };
        let page = self
            .0
            .read(false, |s| {
                let live = s.security().tokens.range((after, Bound::Unbounded)).map(|(_, t)| t);
                for t in live.filter(|t| t.expires_at > now) {
                    if !page.offer(|| token_info(t)) {
                        break;
                    }
                }
                page
            })
            .await?;
        let (tokens, next) = page.finish(|t| t.id.clone());
        Ok(tonic::Response::new(pb::ListTokensResponse { tokens, next_after: next.unwrap_or_default() }))
    }

    async fn audit(&self, req: Request<pb::AuditRequest>) -> Resp<pb::AuditResponse> {
        let r = req.into_inner();
        check_filter("principal", &r.principal)?;
        check_filter("method", &r.method)?;
        let mut page = self.page(r.limit);
        let count = page::count(r.limit, self.0.cfg.max_list);
        let (page, more_after, oldest_seq) = self
            .0
            .read(false, |s| {
                let p = s.audit_page(r.after_seq, count, &r.principal, &r.method);
                for rec in &p.records {
                    if !page.offer(|| audit_record(rec)) {
                        break;
                    }
                }
                (page, p.next_after_seq, p.oldest_seq)
            })
            .await?;
        // The page may end early (its bytes) or the state's page says more follow.
        let (records, next) = page.finish(|x| x.seq);
        let next_after_seq = next.unwrap_or(more_after);
        Ok(tonic::Response::new(pb::AuditResponse { records, next_after_seq, oldest_seq }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str, role: &str, team: &str, ttl_s: u64) -> pb::CreateTokenRequest {
        pb::CreateTokenRequest { name: name.into(), role: role.into(), team: team.into(), ttl_s }
    }

    fn field_of(r: Result<Claims, Status>) -> String {
        let e = r.expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        e.message().split(':').next().unwrap_or_default().to_owned()
    }

    #[test]
    fn token_requests_are_checked_field_by_field() {
        let ok = token_claims(&req("alice", "member", "nlp", 60), 1_000, 3_600, "id1".into()).expect("valid");
        assert_eq!((ok.iat, ok.exp, ok.team.as_deref(), ok.role), (1_000, 1_060, Some("nlp"), Role::Member));
        let admin = token_claims(&req("root", "admin", "", 3_600), 1_000, 3_600, "id2".into()).expect("valid");
        assert_eq!(admin.team, None);
        let long = "a".repeat(254);
        for (r, field) in [
            (req("", "admin", "", 60), "name"),
            (req(&long, "admin", "", 60), "name"),
            (req("a b", "admin", "", 60), "name"),
            (req("alice", "god", "", 60), "role"),
            (req("alice", "", "", 60), "role"),
            (req("alice", "member", "", 60), "team"),
            (req("alice", "member", "n/lp", 60), "team"),
            (req("alice", "admin", "", 0), "ttl_s"),
            (req("alice", "admin", "", 3_601), "ttl_s"),
        ] {
            assert_eq!(field_of(token_claims(&r, 1_000, 3_600, "id".into())), field, "{r:?}");
        }
        let e = token_claims(&req("alice", "admin", "", 3_601), 1_000, 3_600, "id".into()).expect_err("too long");
        assert!(e.message().contains("1 to 3600 s"), "{e:?}");
    }

    #[test]
    fn who_am_i_names_every_kind_of_caller() {
        let user = Principal::User {
            name: "alice".into(),
            role: Role::Member,
            team: Some("nlp".into()),
            credential: Credential::Token { id: "t1".into() },
        };
        let r = who_am_i(&user);
        assert_eq!(
            (r.principal.as_str(), r.kind.as_str(), r.name.as_str(), r.role.as_str(), r.team.as_str()),
            ("token:t1:alice(member,nlp)", "user", "alice", "member", "nlp")
        );
        assert_eq!(r.token_id, "t1");
        let r = who_am_i(&Principal::Node { name: "n1".into() });
        assert_eq!((r.kind.as_str(), r.name.as_str(), r.principal.as_str()), ("node", "n1", "node:n1"));
        assert_eq!(who_am_i(&Principal::Server { name: "s1".into() }).kind, "server");
        assert_eq!(who_am_i(&Principal::Anonymous).kind, "anonymous");
        let r = who_am_i(&Principal::Insecure);
        assert_eq!((r.kind.as_str(), r.principal.as_str()), ("insecure", "insecure"));
        assert_eq!(caller(&Request::new(())), Principal::Insecure, "no access layer: an insecure server");
        let mut req = Request::new(());
        req.extensions_mut().insert(user.clone());
        assert_eq!(caller(&req), user);
    }

    #[test]
    fn new_keys_are_random_and_decode_to_32_bytes() {
        let a = new_key().expect("a key");
        let b = new_key().expect("a key");
        assert_ne!(a, b);
        assert_eq!(suanli_state::security::decode_key(&a).expect("decodes").len(), 32);
    }
}

/// The service on real raft and RocksDB: called directly on a leading core (to give it a
/// caller and read its state), and over gRPC through a follower of a two-server cluster.
#[cfg(test)]
mod inproc {
    use super::*;
    use crate::testkit;
    use suanli_proto::v1::access_client::AccessClient;
    use suanli_security::token::TokenError;
    use suanli_state::{AuditEntry, RecordAudit};
    use tonic::Code;

    fn create(name: &str, role: &str, team: &str, ttl_s: u64) -> pb::CreateTokenRequest {
        pb::CreateTokenRequest { name: name.into(), role: role.into(), team: team.into(), ttl_s }
    }

    fn admin() -> Principal {
        Principal::User { name: "root".into(), role: Role::Admin, team: None, credential: Credential::Certificate }
    }

    #[tokio::test(start_paused = true)]
    async fn a_created_token_verifies_with_the_committed_key_until_revoked() {
        let dir = tempfile::tempdir().expect("temp dir");
        let core = testkit::solo_core(dir.path()).await;
        let api = AccessApi(core.clone());
        assert_eq!(core.state.read(|s| s.token_key()), None, "no key before the first token");
        let mut req = Request::new(create("alice", "member", "nlp", 3_600));
        req.extensions_mut().insert(admin());
        let t = api.create_token(req).await.expect("created").into_inner();
        let key = core.state.read(|s| s.token_key()).expect("the first token made the key");
        let now = core.now_s();
        let claims =
            token::verify(&key, &t.token, now, |id| core.state.read(|s| s.token_revoked(id))).expect("verifies");
        assert_eq!(
            (claims.id.as_str(), claims.name.as_str(), claims.team.as_deref()),
            (t.id.as_str(), "alice", Some("nlp"))
        );
        assert_eq!(claims.exp, t.expires_at);
        assert!(t.expires_at >= now + 3_599 && t.expires_at <= now + 3_601, "{} vs {now}", t.expires_at);
        let rec = core.state.read(|s| s.security().tokens.get(&t.id).cloned()).expect("recorded");
        assert_eq!(rec.created_by, "user:root(admin)");
        assert_eq!(uuid::Uuid::parse_str(&t.id).expect("a uuid").get_version_num(), 7);
        // A second token keeps the key.
        let t2 = api.create_token(Request::new(create("bob", "viewer", "", 60))).await.expect("created").into_inner();
        assert_eq!(core.state.read(|s| s.token_key()), Some(key.clone()));
        let rec2 = core.state.read(|s| s.security().tokens.get(&t2.id).cloned()).expect("recorded");
        assert_eq!(rec2.created_by, "insecure", "no access layer in front: an insecure caller");
        // Revoked: the same token no longer verifies.
        let r = api.revoke_token(Request::new(pb::RevokeTokenRequest { id: t.id.clone() })).await.expect("revoked");
        assert!(r.get_ref().index > 0);
        let e = token::verify(&key, &t.token, now, |id| core.state.read(|s| s.token_revoked(id))).expect_err("revoked");
        assert_eq!(e, TokenError::Revoked(t.id.clone()));
        // Refusals name the field.
        let e =
            api.revoke_token(Request::new(pb::RevokeTokenRequest { id: "nope".into() })).await.expect_err("unknown");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        assert!(e.message().starts_with("id: unknown token"), "{e:?}");
        let e = api.revoke_token(Request::new(pb::RevokeTokenRequest { id: "a b".into() })).await.expect_err("bad id");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let too_long = core.cfg.max_token_ttl_s + 1;
        let e = api.create_token(Request::new(create("x", "admin", "", too_long))).await.expect_err("ttl");
        assert!(e.message().starts_with("ttl_s: "), "{e:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn audit_pages_are_bounded_in_count_and_bytes_and_filter() {
        let dir = tempfile::tempdir().expect("temp dir");
        let core = testkit::solo_core(dir.path()).await;
        let api = AccessApi(core.clone());
        let entry = |i: u64| AuditEntry {
            at_ms: i,
            principal: if i.is_multiple_of(2) { "user:root(admin)".into() } else { "node:n1".into() },
            method: "/suanli.v1.Jobs/Submit".into(),
            target: format!("job {i}"),
            code: "OK".into(),
            message: "m".repeat(200),
            server: 1,
            remote: "127.0.0.1:1".into(),
        };
        let entries: Vec<AuditEntry> = (1..=30).map(entry).collect();
        core.propose(Command::RecordAudit(RecordAudit { entries })).await.expect("recorded");
        let read = |after_seq, limit, principal: &str| {
            let api = api.clone();
            let r = pb::AuditRequest { after_seq, limit, principal: principal.into(), method: String::new() };
            async move { api.audit(Request::new(r)).await.expect("audit").into_inner() }
        };
        // Paging through everything, 7 at a time.
        let (mut after, mut seen) = (0, Vec::new());
        loop {
            let p = read(after, 7, "").await;
            assert!(p.records.len() <= 7);
            assert_eq!(p.oldest_seq, 1);
            seen.extend(p.records.iter().map(|r| r.seq));
            if p.next_after_seq == 0 {
                break;
            }
            after = p.next_after_seq;
        }
        assert_eq!(seen, (1..=30).collect::<Vec<u64>>());
        let p = read(0, 0, "node:").await;
        assert_eq!(p.records.len(), 15, "limit 0 is max_list");
        assert!(p.records.iter().all(|r| r.principal == "node:n1"));
        assert_eq!(p.next_after_seq, 0);
        let e = api
            .audit(Request::new(pb::AuditRequest { method: "x".repeat(300), ..Default::default() }))
            .await
            .expect_err("a long filter");
        assert!(e.message().starts_with("method: 300 bytes; the limit is 256"), "{e:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn audit_pages_end_early_at_their_byte_bound() {
        let dir = tempfile::tempdir().expect("temp dir");
        let core = testkit::solo_core(dir.path()).await;
        // A 1 KiB page bound: each ~300-byte record takes a third of it.
        let mut cfg = core.cfg.clone();
        cfg.max_list_bytes = 1024;
        let small =
            AccessApi(Arc::new(crate::core::Core::new(cfg, core.raft.clone(), core.state.clone(), core.log.clone(), None)));
        let entries: Vec<AuditEntry> = (1..=10)
            .map(|i| AuditEntry {
                at_ms: i,
                principal: "p".into(),
                method: "m".into(),
                target: String::new(),
                code: "OK".into(),
                message: "x".repeat(256),
                server: 1,
                remote: String::new(),
            })
            .collect();
        core.propose(Command::RecordAudit(RecordAudit { entries })).await.expect("recorded");
        let p = small.audit(Request::new(pb::AuditRequest::default())).await.expect("audit").into_inner();
        assert!(p.records.len() < 10 && !p.records.is_empty(), "{}", p.records.len());
        assert_eq!(p.next_after_seq, p.records.last().map(|r| r.seq).expect("a record"));
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_made_through_a_follower_are_listed_revoked_and_paged_everywhere() {
        let dir = tempfile::tempdir().expect("temp dir");
        let s = testkit::cluster(2, dir.path(), |c| c).await;
        let l = usize::try_from(testkit::leader_of(&s[0]).await - 1).expect("an index");
        let f = 1 - l;
        let mut follower = AccessClient::new(s[f].channel());
        let mut leader = AccessClient::new(s[l].channel());
        let who = follower.who_am_i(pb::WhoAmIRequest {}).await.expect("whoami").into_inner();
        assert_eq!(who.kind, "insecure");
        let mut ids = Vec::new();
        for i in 0..5 {
            let t = follower.create_token(create(&format!("u{i}"), "viewer", "", 600)).await.expect("created");
            let t = t.into_inner();
            assert!(t.token.starts_with("sl1."), "{}", t.token);
            ids.push(t.id);
        }
        ids.sort();
        // Paged by id, two at a time, on the leader.
        let (mut after, mut listed) = (String::new(), Vec::new());
        loop {
            let r = pb::ListTokensRequest { limit: 2, after: after.clone() };
            let p = leader.list_tokens(r).await.expect("list").into_inner();
            assert!(p.tokens.len() <= 2);
            listed.extend(p.tokens.iter().map(|t| t.id.clone()));
            if p.next_after.is_empty() {
                break;
            }
            after = p.next_after;
        }
        assert_eq!(listed, ids);
        follower.revoke_token(pb::RevokeTokenRequest { id: ids[2].clone() }).await.expect("revoked");
        let all = leader.list_tokens(pb::ListTokensRequest::default()).await.expect("list").into_inner();
        let revoked: Vec<&str> = all.tokens.iter().filter(|t| t.revoked).map(|t| t.id.as_str()).collect();
        assert_eq!(revoked, [ids[2].as_str()]);
        assert!(all.tokens.iter().all(|t| t.role == "viewer" && t.created_by == "insecure"));
        let e = follower.revoke_token(pb::RevokeTokenRequest { id: "gone".into() }).await.expect_err("unknown");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        let e = follower.create_token(create("m", "member", "", 600)).await.expect_err("no team");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().starts_with("team: "), "{e:?}");
        for r in s {
            r.stop().await.expect("stops cleanly");
        }
    }
}
