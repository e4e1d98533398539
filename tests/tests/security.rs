//! The access matrix against a real TLS server: every method of `policy::RULES` on the client
//! and peer listeners, called by every kind of caller, is allowed or refused exactly as
//! `policy::decide` (and docs/security.md, which a unit test keeps equal to it) says; callers
//! without a certificate too (none at all, member tokens of the job's team and of another, an
//! expired and a revoked token), refused at the handshake on the peer listener. Plus: an
//! agent with node n1's certificate cannot report for node n2, a user's certificate cannot
//! reach raft, and a certificate from another CA gets no connection at all.
//!
//! "Allowed" means the layer let the call through: any answer but PERMISSION_DENIED or
//! UNAUTHENTICATED (the handler may then refuse the request's content).

use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_security::policy::{self, Decision, Listener};
use suanli_security::principal::Credential;
use suanli_security::tls::TlsFiles;
use suanli_security::{Principal, Role};
use suanli_server::local::{LocalPki, channel_as};
use suanli_tests as common;
use tonic::Code;
use tonic::codec::{DecodeBuf, EncodeBuf};

/// Sends and receives messages as raw bytes (the requests are encoded by the test).
#[derive(Clone, Copy, Default)]
struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// Calls `path` with `msg` (an encoded request); the answer's code once its headers are in
/// (a stream that opened is OK). A connection that fails is `Err` with why.
async fn call(ch: &tonic::transport::Channel, path: &str, msg: Vec<u8>) -> Result<Code, String> {
    call_with(ch, path, msg, None).await
}

/// [`call`] with a bearer token in the call's metadata.
async fn call_with(
    ch: &tonic::transport::Channel,
    path: &str,
    msg: Vec<u8>,
    token: Option<&str>,
) -> Result<Code, String> {
    let mut req = tonic::Request::new(msg);
    if let Some(t) = token {
        let v = format!("Bearer {t}").parse().map_err(|e| format!("token metadata: {e}"))?;
        req.metadata_mut().insert("authorization", v);
    }
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    let go = async {
        grpc.ready().await.map_err(|e| format!("not ready: {e}"))?;
        let path = tonic::codegen::http::uri::PathAndQuery::try_from(path).map_err(|e| e.to_string())?;
        match grpc.server_streaming(req, path, Raw).await {
            Ok(_) => Ok(Code::Ok),
            // A refused connection is not an answer of the server.
            Err(s) if s.code() == Code::Unavailable && s.source_chain_is_transport() => Err(s.to_string()),
            Err(s) => Ok(s.code()),
        }
    };
    tokio::time::timeout(Duration::from_secs(20), go).await.map_err(|_| "no answer within 20 s".to_owned())?
}

/// Whether a status came from a failed connection rather than from the server.
trait TransportError {
    fn source_chain_is_transport(&self) -> bool;
}

impl TransportError for tonic::Status {
    fn source_chain_is_transport(&self) -> bool {
        std::error::Error::source(self).is_some() && self.metadata().is_empty()
    }
}

/// One caller of the matrix.
struct Caller {
    name: &'static str,
    /// What the servers take it to be.
    principal: Principal,
    files: TlsFiles,
}

fn user(name: &str, role: Role, team: Option<&str>) -> Principal {
    Principal::User { name: name.into(), role, team: team.map(Into::into), credential: Credential::Certificate }
}

fn encode(m: &impl prost::Message) -> Vec<u8> {
    m.encode_to_vec()
}

fn spec(queue: &str) -> String {
    common::cpu_job("authz", queue, 100)
}

/// The request each method gets: about the objects of team `t1` and node `n1` where the
/// method checks one, else empty.
fn request(path: &str, job: u64) -> Vec<u8> {
    let node_json = serde_json::json!({
        "id": "n1", "pool": "default", "cpu_milli": 1000, "memory_mib": 1024, "devices": [],
        "schedulable": true, "agent_addr": "127.0.0.1:1"
    })
    .to_string();
    match path {
        "/suanli.v1.Jobs/Submit" => encode(&pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: "authz-1".into(),
            spec_json: spec("q1"),
            retry: None,
        }),
        "/suanli.v1.Jobs/SubmitMany" => encode(&pb::SubmitJobsRequest {
            jobs: vec![pb::SubmitJobRequest {
                global: false,
                team: String::new(),
                client_request_id: "authz-2".into(),
                spec_json: spec("q1"),
                retry: None,
            }],
        }),
        "/suanli.v1.Jobs/Cancel" => encode(&pb::CancelJobRequest { job_id: job, reason: "authz".into() }),
        "/suanli.v1.Jobs/Migrate" => encode(&pb::MigrateJobRequest { job_id: job, ..Default::default() }),
        "/suanli.v1.Jobs/UpdateService" => encode(&pb::UpdateServiceRequest { job_id: job, spec_json: spec("q1") }),
        "/suanli.v1.Agent/Register" => encode(&pb::RegisterNodeRequest { node_json, ..Default::default() }),
        "/suanli.v1.Agent/Heartbeat" => encode(&pb::HeartbeatRequest { node_id: "n1".into(), ..Default::default() }),
        "/suanli.v1.Agent/WatchAllocations" => {
            encode(&pb::WatchAllocationsRequest { node_id: "n1".into(), from_revision: 0 })
        }
        // Health names a service; reflection and the rest take their defaults.
        _ => Vec::new(),
    }
}

/// A member's bearer token, made by the admin.
async fn member_token(
    access: &mut pb::access_client::AccessClient<tonic::transport::Channel>,
    name: &str,
    team: &str,
    ttl_s: u64,
) -> pb::CreateTokenResponse {
    let req = pb::CreateTokenRequest { name: name.into(), role: "member".into(), team: team.into(), ttl_s };
    access.create_token(req).await.expect("a token").into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_method_times_every_caller_is_decided_as_the_matrix_says() {
    // Each caller makes fewer calls than the rate limit's burst.
    let c = common::start(1, &[]);
    c.wait_leader(Duration::from_secs(30)).await.expect("a leader");
    let pki = LocalPki::get();
    // Queue q1 of team t1, and a job in it (the object of the team checks).
    let admin = channel_as(&c.addrs[0], &pki.admin()).await.expect("admin channel");
    let q = serde_json::json!({"id": "q1", "team": "t1"}).to_string();
    suanli_proto::v1::queues_client::QueuesClient::new(admin.clone())
        .upsert(pb::UpsertQueueRequest { queue_json: q })
        .await
        .expect("queue q1");
    let job = suanli_proto::v1::jobs_client::JobsClient::new(admin.clone())
        .submit(pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: "authz-0".into(),
            spec_json: spec("q1"),
            retry: None,
        })
        .await
        .expect("a job in q1")
        .into_inner()
        .job_id;

    let callers = [
        Caller { name: "admin", principal: user("admin", Role::Admin, None), files: pki.admin() },
        Caller {
            name: "operator",
            principal: user("op", Role::Operator, None),
            files: pki.user("op", Role::Operator, None),
        },
        Caller {
            name: "member of the job's team",
            principal: user("m1", Role::Member, Some("t1")),
            files: pki.user("m1", Role::Member, Some("t1")),
        },
        Caller {
            name: "member of another team",
            principal: user("m2", Role::Member, Some("t2")),
            files: pki.user("m2", Role::Member, Some("t2")),
        },
        Caller { name: "viewer", principal: user("v", Role::Viewer, None), files: pki.user("v", Role::Viewer, None) },
        Caller { name: "node n1", principal: Principal::Node { name: "n1".into() }, files: pki.node("n1") },
        Caller { name: "server", principal: Principal::Server { name: "server".into() }, files: pki.server() },
    ];

    let mut wrong = Vec::new();
    let mut checked = 0;
    for caller in &callers {
        let client = channel_as(&c.addrs[0], &caller.files).await.expect("channel");
        let peer = channel_as(&c.peer_addrs[0], &caller.files).await.expect("peer channel");
        for rule in policy::RULES.iter().filter(|r| matches!(r.listener, Listener::Client | Listener::Peer)) {
            let ch = if rule.listener == Listener::Peer { &peer } else { &client };
            let got = call(ch, rule.method, request(rule.method, job)).await;
            let decision = policy::decide(rule, &caller.principal);
            // The team checks: the objects are team t1's; the node checks: node n1's.
            let want_allowed = match &decision {
                Decision::Allow => true,
                Decision::AllowIfTeam(t) => t == "t1",
                Decision::AllowIfNode(n) => n == "n1",
                Decision::Unauthenticated | Decision::Deny(_) => false,
            };
            let ok = match (&got, want_allowed) {
                (Ok(code), true) => !matches!(code, Code::PermissionDenied | Code::Unauthenticated),
                (Ok(code), false) => {
                    let want = if matches!(decision, Decision::Unauthenticated) {
                        Code::Unauthenticated
                    } else {
                        Code::PermissionDenied
                    };
                    *code == want
                }
                (Err(_), _) => false,
            };
            checked += 1;
            if !ok {
                wrong.push(format!("{} {}: got {got:?}, matrix says {decision:?}", caller.name, rule.method));
            }
        }
    }
    assert!(wrong.is_empty(), "{} of {checked} calls decided against the matrix:\n{}", wrong.len(), wrong.join("\n"));

    // An agent with node n1's certificate reporting for node n2.
    let n1 = channel_as(&c.addrs[0], &pki.node("n1")).await.expect("n1");
    let hb = encode(&pb::HeartbeatRequest { node_id: "n2".into(), ..Default::default() });
    assert_eq!(call(&n1, "/suanli.v1.Agent/Heartbeat", hb).await, Ok(Code::PermissionDenied));
    // A user's certificate cannot join raft, nor propose through Internal.
    let op = channel_as(&c.peer_addrs[0], &pki.user("op", Role::Operator, None)).await.expect("op");
    for m in ["/suanli.v1.RaftTransport/Vote", "/suanli.v1.RaftTransport/AppendEntries", "/suanli.v1.Internal/Propose"]
    {
        assert_eq!(call(&op, m, Vec::new()).await, Ok(Code::PermissionDenied), "{m}");
    }
    // An unknown method is denied, even to an admin.
    assert_eq!(call(&admin, "/suanli.v1.Jobs/Nope", Vec::new()).await, Ok(Code::PermissionDenied));

    // Callers without a certificate: none at all, and bearer tokens (a member of the job's team,
    // one of another team, an expired one, a revoked one), over TLS that verifies the server
    // only. The peer listener refuses them all at the handshake.
    let ca_only = TlsFiles { ca: pki.admin().ca, cert: Default::default(), key: Default::default() };
    let mut access = pb::access_client::AccessClient::new(admin.clone());
    let t1 = member_token(&mut access, "tm1", "t1", 3600).await;
    let t2 = member_token(&mut access, "tm2", "t2", 3600).await;
    let expired = member_token(&mut access, "tx", "t1", 1).await;
    let revoked = member_token(&mut access, "tr", "t1", 3600).await;
    access.revoke_token(pb::RevokeTokenRequest { id: revoked.id.clone() }).await.expect("revoked");
    // The 1 s token's expiry is judged at the server's clock in whole seconds.
    while std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs()
        <= expired.expires_at
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let token_user = |name: &str, team: &str, id: &str| Principal::User {
        name: name.into(),
        role: Role::Member,
        team: Some(team.into()),
        credential: Credential::Token { id: id.into() },
    };
    let bearers: [(&str, Option<&str>, Option<Principal>); 5] = [
        ("no credential", None, Some(Principal::Anonymous)),
        ("token of the job's team", Some(&t1.token), Some(token_user("tm1", "t1", &t1.id))),
        ("token of another team", Some(&t2.token), Some(token_user("tm2", "t2", &t2.id))),
        ("expired token", Some(&expired.token), None),
        ("revoked token", Some(&revoked.token), None),
    ];
    let client = channel_as(&c.addrs[0], &ca_only).await.expect("channel without a certificate");
    let peer = channel_as(&c.peer_addrs[0], &ca_only).await.expect("peer channel");
    for (name, tok, principal) in &bearers {
        for rule in policy::RULES.iter().filter(|r| matches!(r.listener, Listener::Client | Listener::Peer)) {
            if rule.listener == Listener::Peer {
                let got = call_with(&peer, rule.method, Vec::new(), *tok).await;
                checked += 1;
                // TLS 1.3 refuses a missing client certificate after the client's half of the
                // handshake: the first call then fails as a transport error (UNKNOWN or
                // UNAVAILABLE), never with an answer of the server.
                let refused = got.is_err()
                    || matches!(got, Ok(Code::Unknown | Code::Unavailable | Code::Cancelled | Code::Internal));
                if !refused {
                    wrong.push(format!("{name} {} on the peer listener: got {got:?}, no connection", rule.method));
                }
                continue;
            }
            let got = call_with(&client, rule.method, request(rule.method, job), *tok).await;
            // A bad token is refused before anything else, whatever the method.
            let decision = principal.as_ref().map_or(Decision::Unauthenticated, |p| policy::decide(rule, p));
            let ok = match (&got, &decision) {
                (Ok(code), Decision::Allow) => !matches!(code, Code::PermissionDenied | Code::Unauthenticated),
                (Ok(code), Decision::AllowIfTeam(t)) if t == "t1" => {
                    !matches!(code, Code::PermissionDenied | Code::Unauthenticated)
                }
                (Ok(code), Decision::Unauthenticated) => *code == Code::Unauthenticated,
                (Ok(code), _) => *code == Code::PermissionDenied,
                (Err(_), _) => false,
            };
            checked += 1;
            if !ok {
                wrong.push(format!("{name} {}: got {got:?}, matrix says {decision:?}", rule.method));
            }
        }
    }
    assert!(wrong.is_empty(), "{} of {checked} calls decided against the matrix:\n{}", wrong.len(), wrong.join("\n"));

    // A certificate from another CA: no connection, refused at once (no hang).
    let other_dir = tempfile::tempdir().expect("tempdir");
    let other = LocalPki::create(&other_dir.path().join("pki")).expect("another CA");
    for addr in [&c.addrs[0], &c.peer_addrs[0]] {
        let ch = channel_as(addr, &other.admin()).await.expect("channel");
        let got = call(&ch, "/suanli.v1.Cluster/Version", Vec::new()).await;
        assert!(got.is_err(), "{addr}: a certificate of another CA got an answer: {got:?}");
    }
}
