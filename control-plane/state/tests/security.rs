//! The security records: tokens (key, validation, bound, expiry, revocation) and the audit log
//! (sequence numbers, cut texts, retention, paging), through `apply` as replicas run them.

use suanli_state::security::{MAX_AUDIT_ENTRIES_PER_COMMAND, MAX_AUDIT_TEXT, SecurityState, decode_key, encode_key};
use suanli_state::{
    AuditEntry, Command, CommandError, IssueToken, RecordAudit, Response, RevokeToken, State, StateConfig, TokenRecord,
    UpdateConfig,
};

fn key(b: u8) -> String {
    encode_key(&[b; 32])
}

fn token(id: &str, role: &str, team: Option<&str>, issued_at: u64, expires_at: u64) -> TokenRecord {
    TokenRecord {
        id: id.into(),
        name: "alice".into(),
        role: role.into(),
        team: team.map(str::to_owned),
        issued_at,
        expires_at,
        revoked: false,
        created_by: "user:root(admin)".into(),
    }
}

fn issue(s: &mut State, now: u64, key: Option<String>, t: TokenRecord) -> Response {
    let r = s.apply(Command::IssueToken(Box::new(IssueToken { now, key, token: t })));
    s.invariants().expect("invariants hold");
    r
}

fn revoke(s: &mut State, now: u64, id: &str) -> Response {
    let r = s.apply(Command::RevokeToken(RevokeToken { now, id: id.into() }));
    s.invariants().expect("invariants hold");
    r
}

fn audit(s: &mut State, entries: Vec<AuditEntry>) -> Response {
    let r = s.apply(Command::RecordAudit(RecordAudit { entries }));
    s.invariants().expect("invariants hold");
    r
}

fn entry(i: u64, principal: &str, method: &str) -> AuditEntry {
    AuditEntry {
        at_ms: 1_000 + i,
        principal: principal.into(),
        method: method.into(),
        target: format!("job {i}"),
        code: "OK".into(),
        message: String::new(),
        server: 1,
        remote: "127.0.0.1:5000".into(),
    }
}

fn rejected_field(r: Response) -> String {
    match r {
        Response::Rejected(CommandError::Invalid { field, .. } | CommandError::Conflict { field, .. }) => field,
        other => panic!("expected a rejection naming a field, got {other:?}"),
    }
}

#[test]
fn the_first_committed_key_wins_and_a_cluster_without_one_needs_it() {
    let mut s = State::default();
    assert_eq!(s.token_key(), None);
    assert_eq!(rejected_field(issue(&mut s, 10, None, token("t1", "admin", None, 10, 100))), "key");
    assert!(s.security().is_empty(), "a refused command changes nothing");
    assert_eq!(issue(&mut s, 10, Some(key(1)), token("t1", "admin", None, 10, 100)), Response::Done);
    assert_eq!(s.token_key(), Some(vec![1; 32]));
    // A second server's key, racing the first: ignored.
    assert_eq!(issue(&mut s, 11, Some(key(2)), token("t2", "viewer", None, 11, 100)), Response::Done);
    assert_eq!(s.token_key(), Some(vec![1; 32]));
    // No key needed once there is one.
    assert_eq!(issue(&mut s, 12, None, token("t3", "viewer", None, 12, 100)), Response::Done);
    assert_eq!(s.security().tokens.len(), 3);
    assert_eq!(s.security().tokens["t1"].created_by, "user:root(admin)");
}

#[test]
fn bad_keys_and_fields_are_refused_naming_the_field() {
    let mut s = State::default();
    for bad in ["", "not base64!", &encode_key(&[1; 31]), &encode_key(&[1; 33]), &"A".repeat(100)] {
        let r = issue(&mut s, 10, Some(bad.to_owned()), token("t1", "admin", None, 10, 100));
        assert_eq!(rejected_field(r), "key", "{bad:?}");
    }
    assert!(decode_key(&key(9)).is_ok());
    let k = Some(key(1));
    let long = "n".repeat(254);
    let cases: Vec<(TokenRecord, &str)> = vec![
        (token("", "admin", None, 10, 100), "token.id"),
        (token("t 1", "admin", None, 10, 100), "token.id"),
        (TokenRecord { name: long.clone(), ..token("t1", "admin", None, 10, 100) }, "token.name"),
        (TokenRecord { name: "al/ice".into(), ..token("t1", "admin", None, 10, 100) }, "token.name"),
        (token("t1", "admin", Some(""), 10, 100), "token.team"),
        (token("t1", "root", None, 10, 100), "token.role"),
        (token("t1", "member", None, 10, 100), "token.team"),
        (token("t1", "admin", None, 100, 100), "token.expires_at"),
        // Expired at the command's time already.
        (token("t1", "admin", None, 1, 5), "token.expires_at"),
    ];
    for (t, field) in cases {
        assert_eq!(rejected_field(issue(&mut s, 10, k.clone(), t.clone())), field, "{t:?}");
    }
    assert!(s.security().is_empty());
    assert_eq!(issue(&mut s, 10, k.clone(), token("t1", "member", Some("nlp"), 10, 100)), Response::Done);
    assert_eq!(rejected_field(issue(&mut s, 10, k, token("t1", "admin", None, 10, 100))), "token.id");
    // A long creator is cut, not refused.
    let t = TokenRecord { created_by: "é".repeat(400), ..token("t2", "viewer", None, 10, 100) };
    assert_eq!(issue(&mut s, 10, None, t), Response::Done);
    let cb = &s.security().tokens["t2"].created_by;
    assert!(cb.len() <= MAX_AUDIT_TEXT && cb.chars().all(|c| c == 'é'), "{}", cb.len());
}

#[test]
fn tokens_are_bounded_and_expired_ones_pruned_at_the_commands_time() {
    let mut s = State::new(StateConfig { max_tokens: 2, ..StateConfig::default() });
    assert_eq!(issue(&mut s, 10, Some(key(1)), token("a", "viewer", None, 10, 50)), Response::Done);
    assert_eq!(issue(&mut s, 10, None, token("b", "viewer", None, 10, 100)), Response::Done);
    match issue(&mut s, 20, None, token("c", "viewer", None, 20, 100)) {
        Response::Rejected(CommandError::TooMany { limit: 2, what }) => assert!(what.contains("tokens"), "{what}"),
        other => panic!("a third token: {other:?}"),
    }
    // At 50 token a has expired: it no longer counts, and is dropped.
    assert_eq!(issue(&mut s, 50, None, token("c", "viewer", None, 50, 100)), Response::Done);
    let ids: Vec<&String> = s.security().tokens.keys().collect();
    assert_eq!(ids, ["b", "c"]);
    // Revoking prunes too; revoking an expired or unknown token names `id`.
    assert_eq!(revoke(&mut s, 60, "b"), Response::Done);
    assert!(s.token_revoked("b"));
    assert!(!s.token_revoked("c"));
    assert_eq!(revoke(&mut s, 61, "b"), Response::Done, "a retried revocation is not an error");
    assert_eq!(rejected_field(revoke(&mut s, 61, "zzz")), "id");
    assert_eq!(rejected_field(revoke(&mut s, 100, "c")), "id");
    let rev = s.revision();
    assert_eq!(rejected_field(revoke(&mut s, 100, "nope")), "id");
    assert_eq!(s.revision(), rev);
    // The refusal says which token and why.
    assert_eq!(
        revoke(&mut s, 100, "b"),
        Response::Rejected(CommandError::Invalid {
            field: "id".into(),
            message: "unknown token \"b\" (never issued here, or expired)".into(),
        })
    );
}

#[test]
fn audit_records_get_increasing_seqs_cut_texts_and_bounded_retention() {
    let mut s = State::new(StateConfig { audit_retention: 5, ..StateConfig::default() });
    assert_eq!(audit(&mut s, vec![]), Response::Done);
    assert!(s.security().is_empty(), "nothing recorded for no entries");
    let long = "ü".repeat(300);
    let mut e = entry(0, "user:root(admin)", "/suanli.v1.Jobs/Submit");
    e.message = long.clone();
    e.target = long.clone();
    assert_eq!(audit(&mut s, vec![e]), Response::Done);
    let r = &s.security().audit[0];
    assert_eq!(r.seq, 1, "the first record gets 1: after_seq 0 means from the oldest");
    assert!(r.entry.message.len() <= MAX_AUDIT_TEXT && r.entry.message.len() > MAX_AUDIT_TEXT - 2);
    assert!(long.starts_with(&r.entry.message));
    assert!(long.starts_with(&r.entry.target));
    assert_eq!(s.security().next_audit_seq, 2);
    let more: Vec<AuditEntry> = (1..8).map(|i| entry(i, "node:n1", "/suanli.v1.Agent/Heartbeat")).collect();
    assert_eq!(audit(&mut s, more), Response::Done);
    let seqs: Vec<u64> = s.security().audit.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [4, 5, 6, 7, 8], "the oldest are dropped beyond the retention");
    let too_many: Vec<AuditEntry> = (0..=MAX_AUDIT_ENTRIES_PER_COMMAND as u64).map(|i| entry(i, "x", "y")).collect();
    match audit(&mut s, too_many) {
        Response::Rejected(CommandError::TooMany { limit, .. }) => assert_eq!(limit, MAX_AUDIT_ENTRIES_PER_COMMAND),
        other => panic!("an oversize batch: {other:?}"),
    }
    // A smaller retention cuts the log at once; it never grows past it.
    let config = StateConfig { audit_retention: 2, ..s.config().clone() };
    assert_eq!(s.apply(Command::UpdateConfig(Box::new(UpdateConfig { config }))), Response::Done);
    s.invariants().expect("invariants hold");
    let seqs: Vec<u64> = s.security().audit.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [7, 8]);
}

#[test]
fn audit_pages_follow_seqs_and_filter_by_principal_and_method() {
    let mut s = State::default();
    let entries: Vec<AuditEntry> = (0..10u64)
        .map(|i| {
            if i.is_multiple_of(2) {
                entry(i, "token:t1:alice(member,nlp)", "/suanli.v1.Jobs/Submit")
            } else {
                entry(i, "user:root(admin)", "/suanli.v1.Nodes/Drain")
            }
        })
        .collect();
    audit(&mut s, entries);
    let p = s.audit_page(0, 4, "", "");
    assert_eq!(p.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!((p.next_after_seq, p.oldest_seq), (4, 1));
    let p = s.audit_page(4, 4, "", "");
    assert_eq!(p.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [5, 6, 7, 8]);
    assert_eq!(p.next_after_seq, 8);
    let p = s.audit_page(8, 4, "", "");
    assert_eq!(p.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [9, 10]);
    assert_eq!(p.next_after_seq, 0, "the last page");
    // Exactly a page left: no further page is promised.
    assert_eq!(s.audit_page(6, 4, "", "").next_after_seq, 0);
    let p = s.audit_page(0, 100, "alice", "");
    assert_eq!(p.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 3, 5, 7, 9]);
    let p = s.audit_page(0, 2, "", "Drain");
    assert_eq!(p.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 4]);
    assert_eq!(p.next_after_seq, 4);
    let p = s.audit_page(4, 2, "root", "Drain");
    assert_eq!(p.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [6, 8]);
    assert!(s.audit_page(0, 10, "nobody", "").records.is_empty());
    assert_eq!(s.audit_page(100, 10, "", "").records.len(), 0);
    assert_eq!(s.audit_page(0, 0, "", "").records.len(), 1, "a limit of 0 still reads one");
}

#[test]
fn lowering_max_tokens_below_the_tokens_held_is_refused() {
    let mut s = State::default();
    issue(&mut s, 10, Some(key(1)), token("a", "viewer", None, 10, 100));
    issue(&mut s, 10, None, token("b", "viewer", None, 10, 100));
    let config = StateConfig { max_tokens: 1, ..s.config().clone() };
    let r = s.apply(Command::UpdateConfig(Box::new(UpdateConfig { config: config.clone() })));
    assert_eq!(rejected_field(r), "max_tokens");
    revoke(&mut s, 20, "a");
    let r = s.apply(Command::UpdateConfig(Box::new(UpdateConfig { config: config.clone() })));
    assert_eq!(rejected_field(r), "max_tokens", "a revoked token is still held until it expires");
    let bad = StateConfig { max_tokens: 0, ..s.config().clone() };
    match s.apply(Command::UpdateConfig(Box::new(UpdateConfig { config: bad }))) {
        Response::Rejected(CommandError::Invalid { field, .. }) => assert_eq!(field, "max_tokens"),
        other => panic!("max_tokens 0: {other:?}"),
    }
    let bad = StateConfig { audit_retention: 0, ..s.config().clone() };
    assert_eq!(
        rejected_field(s.apply(Command::UpdateConfig(Box::new(UpdateConfig { config: bad })))),
        "audit_retention"
    );
}

#[test]
fn security_records_survive_a_snapshot_and_hash_alike() {
    let mut s = State::default();
    let empty_hash = s.state_hash();
    let before = String::from_utf8(s.snapshot().expect("snapshot")).expect("utf8");
    assert!(!before.contains("security"), "an empty security part is left out: {before}");
    issue(&mut s, 10, Some(key(3)), token("a", "member", Some("nlp"), 10, 100));
    issue(&mut s, 10, None, token("b", "operator", None, 10, 100));
    revoke(&mut s, 11, "b");
    audit(&mut s, (0..3).map(|i| entry(i, "user:root(admin)", "/suanli.v1.Access/CreateToken")).collect());
    assert_ne!(s.state_hash(), empty_hash);
    let back = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
    assert_eq!(back, s);
    assert_eq!(back.state_hash(), s.state_hash());
    assert_eq!(back.token_key(), Some(vec![3; 32]));
    assert!(back.token_revoked("b"));
    assert_eq!(back.audit_page(0, 10, "", "").records.len(), 3);
    let sec: &SecurityState = back.security();
    assert_eq!(sec.next_audit_seq, 4);
}

#[test]
fn security_commands_round_trip_through_the_envelope() {
    let cmds = [
        Command::IssueToken(Box::new(IssueToken { now: 5, key: Some(key(1)), token: token("a", "admin", None, 5, 9) })),
        Command::RevokeToken(RevokeToken { now: 6, id: "a".into() }),
        Command::RecordAudit(RecordAudit { entries: vec![entry(1, "p", "m")] }),
    ];
    for (cmd, kind) in cmds.into_iter().zip(["issue_token", "revoke_token", "record_audit"]) {
        let bytes = suanli_state::encode_command(&cmd).expect("encodes");
        let text = String::from_utf8(bytes).expect("utf8");
        assert!(text.contains(&format!(r#""kind":"{kind}""#)), "{text}");
        assert_eq!(serde_json::from_str::<Command>(&text).expect("decodes"), cmd);
        assert!(Command::KINDS.contains(&kind));
    }
    // Stamping sets the time of the token commands.
    let mut c = Command::RevokeToken(RevokeToken { now: 0, id: "a".into() });
    c.stamp(77);
    assert_eq!(c, Command::RevokeToken(RevokeToken { now: 77, id: "a".into() }));
}
