//! mTLS over real loopback gRPC (tonic-health): identities reach the server, unverified peers
//! are refused on both sides, material reloads for new connections only, and a silent client
//! holds up nobody.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use suanli_security::certs::{self, DEFAULT_HOSTS, DEFAULT_VALIDITY, Leaf};
use suanli_security::principal::Credential;
use suanli_security::tls::{self, ClientAuth, PeerInfo, Tls, TlsFiles};
use suanli_security::{Principal, Role};
use tokio::io::AsyncReadExt;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

fn hosts() -> Vec<String> {
    DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect()
}

fn admin() -> Principal {
    Principal::User { name: "admin".into(), role: Role::Admin, team: None, credential: Credential::Certificate }
}

fn alice() -> Principal {
    Principal::User {
        name: "alice".into(),
        role: Role::Member,
        team: Some("nlp".into()),
        credential: Credential::Certificate,
    }
}

/// A development PKI in `dir`: server (default hosts), admin, alice, node n1.
fn pki(dir: &Path) {
    certs::init(
        dir,
        &[Leaf::server("server", &hosts()), Leaf::user(admin()), Leaf::user(alice()), Leaf::node("n1", &hosts())],
        DEFAULT_VALIDITY,
    )
    .expect("init a PKI");
}

fn load(files: TlsFiles) -> Tls {
    Tls::load(files).expect("load TLS material")
}

/// The peers the server saw, one per request, as its handlers would (request extensions).
type Seen = Arc<Mutex<Vec<Option<PeerInfo>>>>;

/// A health server over mTLS on a loopback port; returns its address and what it saw.
async fn serve(tls: Tls, auth: ClientAuth, handshake_timeout: Duration) -> (std::net::SocketAddr, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let incoming = tls::incoming(listener, tls, auth, handshake_timeout);
    tokio::spawn(async move {
        Server::builder()
            .layer(tonic::service::InterceptorLayer::new(move |req: tonic::Request<()>| {
                record.lock().expect("seen lock").push(req.extensions().get::<PeerInfo>().cloned());
                Ok(req)
            }))
            .add_service(health)
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
    (addr, seen)
}

fn endpoint(uri: String) -> Endpoint {
    Endpoint::from_shared(uri)
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
}

async fn check(ch: Channel) -> Result<(), tonic::Status> {
    HealthClient::new(ch).check(HealthCheckRequest { service: String::new() }).await.map(|_| ())
}

fn last_peer(seen: &Seen) -> Option<PeerInfo> {
    seen.lock().expect("seen lock").last().cloned().flatten()
}

/// A channel over a hand-made rustls client configuration (no client certificate, say).
fn channel_with(config: rustls::ClientConfig, addr: std::net::SocketAddr) -> Channel {
    let config = Arc::new(config);
    endpoint(format!("http://{addr}")).connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
        let config = config.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
            let tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    }))
}

/// A client configuration trusting `ca_dir`'s CA, presenting no certificate.
fn no_cert_config(ca_dir: &Path) -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    use rustls_pki_types::pem::PemObject;
    for c in rustls_pki_types::CertificateDer::pem_file_iter(ca_dir.join("ca.pem")).expect("ca.pem") {
        roots.add(c.expect("ca cert")).expect("add root");
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    cfg
}

#[tokio::test]
async fn the_server_sees_the_client_certificates_identity() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let server = load(certs::paths(dir.path(), "server"));
    assert_eq!(server.own_identity(), Some(Principal::Server { name: "server".into() }));
    let (addr, seen) = serve(server, ClientAuth::Required, Duration::from_secs(5)).await;
    let admin_tls = load(certs::paths(dir.path(), "admin"));
    assert_eq!(admin_tls.own_identity(), Some(admin()));

    // http and https endpoints, by IP address and by DNS name: TLS either way.
    for uri in [
        format!("http://{addr}"),
        format!("https://{addr}"),
        format!("http://localhost:{}", addr.port()),
        format!("https://localhost:{}", addr.port()),
    ] {
        check(tls::channel(endpoint(uri.clone()), Some(&admin_tls))).await.unwrap_or_else(|e| panic!("{uri}: {e}"));
        let peer = last_peer(&seen).expect("the handler sees PeerInfo");
        assert_eq!(peer.principal, Some(admin()), "{uri}");
        assert_eq!(peer.remote.map(|r| r.ip()), Some(addr.ip()));
    }

    let alice_tls = load(certs::paths(dir.path(), "user-alice"));
    check(tls::channel(endpoint(format!("http://{addr}")), Some(&alice_tls))).await.expect("alice");
    assert_eq!(last_peer(&seen).expect("peer").principal, Some(alice()));
    let node = load(certs::paths(dir.path(), "node-n1"));
    check(tls::channel(endpoint(format!("http://{addr}")), Some(&node))).await.expect("node");
    assert_eq!(last_peer(&seen).expect("peer").principal, Some(Principal::Node { name: "n1".into() }));

    // A plaintext client gets nowhere.
    assert!(check(tls::channel(endpoint(format!("http://{addr}")), None)).await.is_err());
}

#[tokio::test]
async fn required_refuses_no_certificate_and_another_cas_optional_allows_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let other = tempfile::tempdir().expect("tempdir");
    pki(other.path());
    let server = load(certs::paths(dir.path(), "server"));
    let (required, _) = serve(server.clone(), ClientAuth::Required, Duration::from_secs(5)).await;
    let (optional, seen) = serve(server, ClientAuth::Optional, Duration::from_secs(5)).await;

    // No client certificate.
    // (TLS 1.3: the server's refusal arrives after the client's handshake, as an alert on the
    // first request.)
    let err = check(channel_with(no_cert_config(dir.path()), required)).await.expect_err("required: no cert");
    assert!(format!("{err:?}").contains("CertificateRequired"), "{err:?}");
    check(channel_with(no_cert_config(dir.path()), optional)).await.expect("optional: no cert");
    let peer = last_peer(&seen).expect("the handler sees PeerInfo");
    assert_eq!(peer.principal, None);

    // A certificate from another CA (the client trusts the server: only its certificate is wrong).
    let foreign = load(TlsFiles {
        ca: dir.path().join("ca.pem"),
        cert: other.path().join("admin.pem"),
        key: other.path().join("admin-key.pem"),
    });
    for addr in [required, optional] {
        let err = check(tls::channel(endpoint(format!("http://{addr}")), Some(&foreign)))
            .await
            .expect_err("a foreign certificate is refused");
        // Refused by the server's alert (after the client's handshake, in TLS 1.3).
        assert!(format!("{err:?}").contains("alert"), "{err:?}");
    }
}

#[tokio::test]
async fn the_client_verifies_the_server_ca_and_host() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let other = tempfile::tempdir().expect("tempdir");
    pki(other.path());
    let (addr, _) = serve(load(certs::paths(dir.path(), "server")), ClientAuth::Required, Duration::from_secs(5)).await;

    // A client trusting another CA (its own certificate is fine for the server).
    let distrustful = load(TlsFiles {
        ca: other.path().join("ca.pem"),
        cert: dir.path().join("admin.pem"),
        key: dir.path().join("admin-key.pem"),
    });
    let err = check(tls::channel(endpoint(format!("http://{addr}")), Some(&distrustful)))
        .await
        .expect_err("server from an unknown CA");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");

    // A server certificate for localhost only: reached as 127.0.0.1, it is refused.
    certs::issue(
        dir.path(),
        &Leaf { stem: "server-local".into(), ..Leaf::server("local", &["localhost".to_owned()]) },
        DEFAULT_VALIDITY,
    )
    .expect("issue");
    let (local, _) =
        serve(load(certs::paths(dir.path(), "server-local")), ClientAuth::Required, Duration::from_secs(5)).await;
    let admin_tls = load(certs::paths(dir.path(), "admin"));
    check(tls::channel(endpoint(format!("http://localhost:{}", local.port())), Some(&admin_tls)))
        .await
        .expect("by its name");
    let err = check(tls::channel(endpoint(format!("http://{local}")), Some(&admin_tls)))
        .await
        .expect_err("by an address it does not name");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
}

#[tokio::test]
async fn reload_applies_to_new_connections_and_old_ones_keep_working() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let server = load(certs::paths(dir.path(), "server"));
    let (addr, seen) = serve(server.clone(), ClientAuth::Required, Duration::from_secs(5)).await;
    let client = load(certs::paths(dir.path(), "admin"));
    assert!(!client.reload().expect("reload"), "nothing changed");
    assert_eq!(client.generation(), 0);

    let old = tls::channel(endpoint(format!("http://{addr}")), Some(&client));
    check(old.clone()).await.expect("before");
    assert_eq!(last_peer(&seen).expect("peer").principal, Some(admin()));

    // Rotate both sides: the admin's files now name another admin, the server's another server.
    let root =
        Principal::User { name: "root".into(), role: Role::Admin, team: None, credential: Credential::Certificate };
    certs::issue(dir.path(), &Leaf { stem: "admin".into(), ..Leaf::user(root.clone()) }, DEFAULT_VALIDITY)
        .expect("reissue admin");
    certs::issue(dir.path(), &Leaf { stem: "server".into(), ..Leaf::server("rotated", &hosts()) }, DEFAULT_VALIDITY)
        .expect("reissue server");
    assert!(client.reload().expect("reload"));
    assert_eq!(client.generation(), 1);
    assert_eq!(client.own_identity(), Some(root.clone()));
    assert!(server.reload().expect("reload"));
    assert_eq!(server.own_identity(), Some(Principal::Server { name: "rotated".into() }));
    assert!(!client.reload().expect("reload"));
    assert_eq!(client.generation(), 1);

    // The open connection is the old one; a new one presents the new certificate.
    check(old).await.expect("the old connection still works");
    assert_eq!(last_peer(&seen).expect("peer").principal, Some(admin()));
    check(tls::channel(endpoint(format!("http://{addr}")), Some(&client))).await.expect("new connection");
    assert_eq!(last_peer(&seen).expect("peer").principal, Some(root));
}

#[tokio::test]
async fn a_broken_reload_keeps_the_previous_material() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let files = certs::paths(dir.path(), "admin");
    let client = load(files.clone());
    // The key of another certificate: what a reloader sees between a rotation's two renames.
    std::fs::copy(dir.path().join("user-alice-key.pem"), &files.key).expect("copy");
    let err = client.reload().expect_err("mismatched key");
    assert!(matches!(&err, tls::TlsError::Invalid { what: "key", .. }), "{err}");
    assert!(err.to_string().contains("admin-key.pem"), "{err}");
    assert_eq!(client.generation(), 0);
    assert_eq!(client.own_identity(), Some(admin()));
}

#[tokio::test]
async fn the_reloader_follows_file_changes_and_sighup() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let polled = load(certs::paths(dir.path(), "node-n1"));
    let _poller = polled.spawn_reloader(Duration::from_millis(20));
    let hupped = load(certs::paths(dir.path(), "user-alice"));
    let _hup = hupped.spawn_reloader(Duration::from_secs(3600));

    certs::issue(dir.path(), &Leaf::node("n1", &hosts()), DEFAULT_VALIDITY).expect("reissue n1");
    wait_for(|| polled.generation() == 1, "the poller reloads").await;

    certs::issue(dir.path(), &Leaf::user(alice()), DEFAULT_VALIDITY).expect("reissue alice");
    let pid = std::process::id().to_string();
    let status = std::process::Command::new("kill").args(["-HUP", &pid]).status().expect("kill");
    assert!(status.success());
    wait_for(|| hupped.generation() == 1, "SIGHUP reloads").await;
}

/// Waits (up to 10 s) for `cond`: reloads are observable only through their effect.
async fn wait_for(cond: impl Fn() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_silent_client_holds_up_no_other_handshake() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let handshake_timeout = Duration::from_millis(500);
    let (addr, _) = serve(load(certs::paths(dir.path(), "server")), ClientAuth::Required, handshake_timeout).await;
    let mut silent = tokio::net::TcpStream::connect(addr).await.expect("connect");

    // Another client connects while the silent one holds its handshake open.
    let started = Instant::now();
    let admin_tls = load(certs::paths(dir.path(), "admin"));
    check(tls::channel(endpoint(format!("http://{addr}")), Some(&admin_tls))).await.expect("another client");
    assert!(started.elapsed() < handshake_timeout, "waited for the silent client: {:?}", started.elapsed());

    // The silent one is dropped once its handshake time is up.
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf))
        .await
        .expect("closed within 10 s")
        .unwrap_or(0);
    assert_eq!(n, 0, "the server closes the silent connection");
    // And the server still serves.
    check(tls::channel(endpoint(format!("http://{addr}")), Some(&admin_tls))).await.expect("after");
}

#[tokio::test]
async fn the_connect_timeout_bounds_a_server_that_never_handshakes() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    // Accepts TCP connections and says nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let admin_tls = load(certs::paths(dir.path(), "admin"));
    let ep =
        Endpoint::from_shared(format!("http://{addr}")).expect("endpoint").connect_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let err = check(tls::channel(ep, Some(&admin_tls))).await.expect_err("never handshakes");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let files = certs::paths(dir.path(), "admin");
    let missing = Tls::load(TlsFiles { key: dir.path().join("nope.pem"), ..files.clone() }).expect_err("missing key");
    assert!(matches!(&missing, tls::TlsError::Io { what: "key", .. }), "{missing}");
    assert!(missing.to_string().contains("nope.pem"), "{missing}");

    std::fs::write(dir.path().join("garbage.pem"), "not pem").expect("write");
    let garbage = Tls::load(TlsFiles { ca: dir.path().join("garbage.pem"), ..files.clone() }).expect_err("bad ca");
    assert!(matches!(&garbage, tls::TlsError::Invalid { what: "ca", .. }), "{garbage}");
    let garbage = Tls::load(TlsFiles { cert: dir.path().join("garbage.pem"), ..files.clone() }).expect_err("bad cert");
    assert!(matches!(&garbage, tls::TlsError::Invalid { what: "cert", .. }), "{garbage}");

    let huge = dir.path().join("huge.pem");
    std::fs::write(&huge, vec![b'a'; (tls::MAX_PEM_BYTES + 1) as usize]).expect("write");
    let err = Tls::load(TlsFiles { ca: huge, ..files }).expect_err("too large");
    assert!(err.to_string().contains("larger than"), "{err}");
}
