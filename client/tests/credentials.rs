//! The connection's credentials against in-process `Cluster` services on port-0 listeners: the
//! bearer token on every call, TLS with a development CA (the server sees the client
//! certificate's identity), and clear failures when the two ends disagree.

use std::sync::{Arc, Mutex};
use std::time::Duration;
use suanli_client::{ClientError, Connection, ConnectionConfig, pb};
use suanli_security::certs::{self, Leaf};
use suanli_security::tls::{ClientAuth, PeerInfo, Tls};
use suanli_security::Principal;
use tonic::{Request, Response, Status};

/// What the fake saw of each `Leader` call: the `authorization` header and the peer's identity.
#[derive(Default, Clone)]
struct Seen(Arc<Mutex<Vec<(Option<String>, Option<String>)>>>);

impl Seen {
    fn all(&self) -> Vec<(Option<String>, Option<String>)> {
        self.0.lock().expect("the fake's lock").clone()
    }
}

struct Fake(Seen);

type Answer<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl pb::cluster_server::Cluster for Fake {
    async fn leader(&self, req: Request<pb::LeaderRequest>) -> Answer<pb::LeaderResponse> {
        let auth = req.metadata().get("authorization").map(|v| v.to_str().unwrap_or("(not ASCII)").to_owned());
        let who = req.extensions().get::<PeerInfo>().and_then(|p| p.principal.as_ref()).and_then(Principal::to_uri);
        self.0.0.lock().expect("the fake's lock").push((auth, who));
        Ok(Response::new(pb::LeaderResponse { leader_id: 1, ..Default::default() }))
    }
    async fn members(&self, _: Request<pb::MembersRequest>) -> Answer<pb::MembersResponse> {
        Err(Status::unimplemented("members"))
    }
    async fn add_server(&self, _: Request<pb::AddServerRequest>) -> Answer<pb::AddServerResponse> {
        Err(Status::unimplemented("add_server"))
    }
    async fn remove_server(&self, _: Request<pb::RemoveServerRequest>) -> Answer<pb::RemoveServerResponse> {
        Err(Status::unimplemented("remove_server"))
    }
    async fn snapshot(&self, _: Request<pb::SnapshotRequest>) -> Answer<pb::SnapshotResponse> {
        Err(Status::unimplemented("snapshot"))
    }
    async fn version(&self, _: Request<pb::VersionRequest>) -> Answer<pb::VersionResponse> {
        Err(Status::unimplemented("version"))
    }
    async fn skip_entry(&self, _: Request<pb::SkipEntryRequest>) -> Answer<pb::SkipEntryResponse> {
        Err(Status::unimplemented("skip_entry"))
    }
    async fn digest(&self, _: Request<pb::DigestRequest>) -> Answer<pb::DigestResponse> {
        Err(Status::unimplemented("digest"))
    }
    type BackupStream = tokio_stream::Empty<Result<pb::BackupChunk, Status>>;
    async fn get_config(&self, _: Request<pb::GetConfigRequest>) -> Answer<pb::GetConfigResponse> {
        Err(Status::unimplemented("get_config"))
    }
    async fn set_config(&self, _: Request<pb::SetConfigRequest>) -> Answer<pb::SetConfigResponse> {
        Err(Status::unimplemented("set_config"))
    }
    async fn backup(&self, _: Request<pb::BackupRequest>) -> Answer<Self::BackupStream> {
        Err(Status::unimplemented("backup"))
    }
}

/// Serves a fake on a port-0 listener, over TLS (client certificates optional) when `tls` is
/// given; its address and what it sees.
async fn serve(tls: Option<Tls>) -> (String, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binding a port-0 listener");
    let addr = listener.local_addr().expect("its address").to_string();
    let seen = Seen::default();
    let svc = pb::cluster_server::ClusterServer::new(Fake(seen.clone()));
    let router = tonic::transport::Server::builder().add_service(svc);
    match tls {
        Some(tls) => {
            let incoming = suanli_security::tls::incoming(listener, tls, ClientAuth::Optional, Duration::from_secs(5));
            tokio::spawn(router.serve_with_incoming(incoming));
        }
        None => {
            tokio::spawn(router.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)));
        }
    }
    (addr, seen)
}

fn quick() -> ConnectionConfig {
    ConnectionConfig {
        connect_timeout: Duration::from_secs(2),
        first_answer: Duration::from_secs(2),
        probe_timeout: Duration::from_secs(1),
        ..ConnectionConfig::default()
    }
}

/// A development PKI in a temp dir: server (localhost, 127.0.0.1), admin, and a member of `nlp`.
fn pki() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temp dir");
    let pki = dir.path().join("tls");
    let hosts: Vec<String> = certs::DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect();
    let admin = Principal::from_uri("suanli://user/admin?role=admin").expect("the admin's URI");
    let alice = Principal::from_uri("suanli://user/alice?role=member&team=nlp").expect("a member's URI");
    certs::init(
        &pki,
        &[Leaf::server("server", &hosts), Leaf::user(admin), Leaf::user(alice)],
        certs::DEFAULT_VALIDITY,
    )
    .expect("certs::init");
    dir
}

#[tokio::test]
async fn a_token_travels_with_every_call_and_only_when_configured() {
    let (addr, seen) = serve(None).await;
    let with = Connection::new(
        std::slice::from_ref(&addr),
        ConnectionConfig { token: Some("sl1.abc.def".into()), ..quick() },
    )
    .expect("a connection with a token");
    with.leader().await.expect("a call with the token");
    // A stream's configuration (another ConnectionConfig) keeps the token.
    with.streaming().leader().await.expect("a call on the streaming connection");
    let without = Connection::new(std::slice::from_ref(&addr), quick()).expect("a connection without a token");
    without.leader().await.expect("a call without a token");
    let auth: Vec<Option<String>> = seen.all().into_iter().map(|(a, _)| a).collect();
    assert_eq!(auth, [Some("Bearer sl1.abc.def".to_owned()), Some("Bearer sl1.abc.def".to_owned()), None]);
}

#[test]
fn a_bad_token_is_a_config_error_naming_the_field() {
    for (token, why) in [
        ("", "is empty"),
        ("sl1.a b.c", "printable ASCII"),
        ("sl1.ü.c", "printable ASCII"),
    ] {
        let e = Connection::new(&["127.0.0.1:1".into()], ConnectionConfig { token: Some(token.into()), ..quick() })
            .expect_err("a bad token is refused");
        assert!(matches!(e, ClientError::Config { ref field, .. } if field == "token"), "{e}");
        assert!(e.to_string().contains(why), "{token:?}: {e}");
    }
    let long = "x".repeat(suanli_security::token::MAX_TOKEN_BYTES + 1);
    let e = Connection::new(&["127.0.0.1:1".into()], ConnectionConfig { token: Some(long), ..quick() })
        .expect_err("a token over the limit is refused");
    assert!(e.to_string().contains("more than the limit of 4096"), "{e}");
}

#[tokio::test]
async fn over_tls_the_server_sees_the_client_certificate_and_a_token_may_come_without_one() {
    let dir = pki();
    let pki = dir.path().join("tls");
    let server = Tls::load(certs::paths(&pki, "server")).expect("the server's TLS");
    let (addr, seen) = serve(Some(server)).await;
    let addr = addr.replace("127.0.0.1", "localhost");

    let admin = Tls::load(certs::paths(&pki, "admin")).expect("the admin's TLS");
    let conn = Connection::new(std::slice::from_ref(&addr), ConnectionConfig { tls: Some(admin), ..quick() })
        .expect("a TLS connection");
    assert_eq!(conn.leader().await.expect("a call over TLS").leader_id, 1);
    let alice = Tls::load(certs::paths(&pki, "user-alice")).expect("alice's TLS");
    let conn = Connection::new(
        std::slice::from_ref(&addr),
        ConnectionConfig { tls: Some(alice), token: Some("sl1.t.s".into()), ..quick() },
    )
    .expect("a TLS connection with a token");
    conn.leader().await.expect("a call over TLS with a token");
    // Only the CA (the server verified) and a token: no client certificate at all.
    let ca_only = Tls::load_ca_only(pki.join("ca.pem")).expect("CA-only TLS");
    assert_eq!(ca_only.own_identity(), None);
    let conn = Connection::new(
        std::slice::from_ref(&addr),
        ConnectionConfig { tls: Some(ca_only), token: Some("sl1.u.v".into()), ..quick() },
    )
    .expect("a CA-only connection with a token");
    conn.leader().await.expect("a call over TLS without a client certificate");
    assert_eq!(
        seen.all(),
        [
            (None, Some("suanli://user/admin?role=admin".to_owned())),
            (Some("Bearer sl1.t.s".to_owned()), Some("suanli://user/alice?role=member&team=nlp".to_owned())),
            (Some("Bearer sl1.u.v".to_owned()), None),
        ]
    );
}

#[tokio::test]
async fn mismatched_ends_fail_clearly_and_quickly() {
    let dir = pki();
    let pki = dir.path().join("tls");
    let server = Tls::load(certs::paths(&pki, "server")).expect("the server's TLS");
    let (tls_addr, _) = serve(Some(server)).await;
    let (plain_addr, _) = serve(None).await;
    let admin = Tls::load(certs::paths(&pki, "admin")).expect("the admin's TLS");

    let t = std::time::Instant::now();
    // A plaintext client to a TLS server.
    let plain = Connection::new(std::slice::from_ref(&tls_addr), quick()).expect("a plaintext connection");
    let e = plain.leader().await.expect_err("plaintext to a TLS server fails");
    assert!(matches!(e, ClientError::NoServer { .. } | ClientError::Status(_)), "{e}");
    // A TLS client to a plaintext server.
    let tls = Connection::new(std::slice::from_ref(&plain_addr), ConnectionConfig { tls: Some(admin.clone()), ..quick() })
        .expect("a TLS connection");
    let e = tls.leader().await.expect_err("TLS to a plaintext server fails");
    assert!(matches!(e, ClientError::NoServer { .. }), "{e}");
    // A client trusting another CA refuses the server's certificate, naming why.
    let other = pki_other();
    let stranger = Tls::load(certs::paths(&other.path().join("tls"), "admin")).expect("another CA's admin");
    let c = Connection::new(std::slice::from_ref(&tls_addr), ConnectionConfig { tls: Some(stranger), ..quick() })
        .expect("a TLS connection");
    let e = c.leader().await.expect_err("another CA's server is refused");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(8), "no hang: {:?}", t.elapsed());
}

fn pki_other() -> tempfile::TempDir {
    pki()
}
