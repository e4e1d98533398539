//! TLS on real `suanli server` processes (issue 19): certificates rotate while a cluster serves
//! writes, a server refuses to start without choosing TLS or `--insecure`, and a plaintext
//! peer and a TLS peer never talk (a clear error, no hang).
//!
//! Needs the workspace built (`cargo build --workspace`): `target/debug/suanli`.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_security::certs::{self, Leaf};
use suanli_security::tls::Tls;
use suanli_security::{Principal, Role};
use suanli_server::local::{LocalPki, ProcessCluster, channel, channel_insecure, server_identity};
use suanli_tests::bin;

/// One cluster at a time: the machine is small.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a refused connection may take to say so (a hang fails the test).
const REFUSED_WITHIN: Duration = Duration::from_secs(10);

fn hosts() -> Vec<String> {
    certs::DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect()
}

/// Waits until new connections to `addr` are handed the certificate naming `want`.
async fn presents(addr: &str, tls: &Tls, want: &Principal, within: Duration) -> Result<Duration, String> {
    let t = Instant::now();
    loop {
        let seen = server_identity(addr, tls).await;
        match &seen {
            Ok((p, _)) if p == want => return Ok(t.elapsed()),
            _ if t.elapsed() > within => return Err(format!("{addr} still presents {seen:?} after {within:?}")),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A server config file in `dir` with `text`; its path.
fn config_file(dir: &Path, text: &str) -> String {
    let p = dir.join("server.toml");
    std::fs::write(&p, text).expect("write the server config");
    p.to_str().expect("utf-8 temp path").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_while_a_cluster_serves_writes() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = LocalPki::create(&dir.path().join("pki")).expect("a PKI of the cluster's own");
    // Servers 1 and 2 are told by SIGHUP; server 3 finds the new files by polling them.
    let cfg = config_file(dir.path(), "tls_reload_interval_ms = 500\n");
    let mut c = ProcessCluster::start_with_pki(&bin(), 3, &["--config", &cfg], &pki).expect("a TLS cluster");
    c.wait_leader(Duration::from_secs(30)).await.expect("a leader");
    let admin = Tls::load(pki.admin()).expect("the admin's certificate");
    let before = Principal::Server { name: "server".into() };
    for a in c.addrs.iter().chain(&c.peer_addrs) {
        let (p, _) = server_identity(a, &admin).await.expect("a TLS handshake");
        assert_eq!(p, before, "{a}");
    }

    let conn = Arc::new(
        suanli_client::Connection::new(
            &c.addrs,
            suanli_client::ConnectionConfig { tls: Some(admin.clone()), ..suanli_client::ConnectionConfig::default() },
        )
        .expect("a client"),
    );
    let queue = serde_json::json!({"id": "rot", "nominal": {"cpu_milli": 1_000_000_000u64}});
    conn.upsert_queue(&queue.to_string()).await.expect("the queue");

    // The writer: one job after another, each retried (same request id) as the client does.
    let stop = Arc::new(AtomicBool::new(false));
    let retried = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (stop, retried, conn) = (stop.clone(), retried.clone(), conn.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0usize, Vec::new());
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                k += 1;
                let spec = serde_json::json!({
                    "name": format!("rot-{k}"), "queue": "rot",
                    "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 1, "memory_mib": 1}}],
                });
                let req = pb::SubmitJobRequest {
                    global: false,
                    team: String::new(),
                    client_request_id: format!("rot-{k}"),
                    spec_json: spec.to_string(),
                    retry: None,
                };
                match conn.submit_job(req, |_, _| _ = retried.fetch_add(1, Ordering::Relaxed)).await {
                    Ok(_) => ok += 1,
                    Err(e) => failed.push(format!("rot-{k}: {e}")),
                }
            }
            (ok, failed)
        })
    };
    let written = |n: usize| {
        let conn = conn.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while conn.list_jobs(&Default::default(), None).await.map_or(0, |j| j.len()) < n {
                assert!(Instant::now() < deadline, "fewer than {n} jobs within 30 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    written(20).await;

    // Rotate: a new server certificate (naming another server, so a handshake tells the two
    // apart) written over the old files.
    let rotated = Principal::Server { name: "server-rotated".into() };
    let leaf = Leaf { stem: "server".into(), ..Leaf::server("server-rotated", &hosts()) };
    certs::issue(pki.dir(), &leaf, certs::DEFAULT_VALIDITY).expect("reissue the server certificate");
    assert!(c.reload_tls(0) && c.reload_tls(1), "SIGHUP to servers 1 and 2");
    let mut took = Vec::new();
    for a in c.addrs.iter().chain(&c.peer_addrs) {
        // SIGHUP is at once; polling every 500 ms: both well within 15 s.
        took.push(presents(a, &admin, &rotated, Duration::from_secs(15)).await.expect("the new certificate"));
    }
    eprintln!("new connections got the new certificate within {:?} (client, then peer listeners)", took);

    // A restarted server dials its peers with the new certificate and they accept it (raft
    // catches it up), while the others keep serving.
    c.kill(2);
    c.spawn(2).expect("restart server 3");
    c.wait_caught_up(2, Duration::from_secs(60)).await.expect("server 3 catches up over TLS");
    let after = conn.list_jobs(&Default::default(), None).await.expect("list").len();
    written(after + 20).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = writer.await.expect("the writer");
    let retried = retried.load(Ordering::Relaxed);
    eprintln!("rotation under load: {ok} writes acknowledged, {retried} retried calls, {} failed", failed.len());
    assert!(failed.is_empty(), "writes failed beyond their retries: {failed:?}");
    assert!(ok >= after + 20, "{ok} writes");
    // Every acknowledged write is there, once.
    let jobs = conn.list_jobs(&Default::default(), None).await.expect("list");
    assert_eq!(jobs.len(), ok, "each acknowledged write made exactly one job");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_tls_or_insecure_refuses_to_start_naming_tls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(bin())
            .args(["server", "--id", "1", "--listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0", "--bootstrap"])
            .arg("--data-dir")
            .arg(&data)
            .args(extra)
            .env_remove("SUANLI_CONFIG")
            .env("SUANLI_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run suanli server");
        (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (st, err) = run(&[]);
    assert!(!st.success(), "{st}: {err}");
    assert!(err.contains("tls: no TLS material"), "{err}");
    assert!(err.contains("suanli tls init") && err.contains("--insecure"), "{err}");
    let (st, err) = run(&["--tls-dir", "/nowhere", "--insecure"]);
    assert!(!st.success() && err.contains("--insecure") && err.contains("--tls-dir"), "{st}: {err}");
    let cfg = config_file(dir.path(), "[tls]\nca = \"/a\"\ncert = \"/b\"\nkey = \"/c\"\n");
    let (st, err) = run(&["--config", &cfg, "--insecure"]);
    assert!(!st.success() && err.contains("tls: both [tls] and insecure"), "{st}: {err}");
    // A directory without the files: the error names the file.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let (st, err) = run(&["--tls-dir", empty.to_str().expect("utf-8")]);
    assert!(!st.success(), "{st}: {err}");
    assert!(err.contains("tls: ") && err.contains(&empty.join("ca.pem").display().to_string()), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_and_tls_never_talk_and_say_so_at_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let leader = |ch| async move {
        let mut client = ClusterClient::new(ch);
        tokio::time::timeout(REFUSED_WITHIN, client.leader(pb::LeaderRequest {}))
            .await
            .expect("an answer or an error, not a hang")
    };
    let tls = ProcessCluster::start(&bin(), 1, &[]).expect("a TLS server");
    let plain = ProcessCluster::start(&bin(), 1, &["--insecure"]).expect("an --insecure server");
    assert_eq!(tls.tls_dir(), Some(LocalPki::get().dir()));
    assert_eq!(plain.tls_dir(), None);
    tls.wait_leader(Duration::from_secs(30)).await.expect("TLS server leads");
    plain.wait_leader(Duration::from_secs(30)).await.expect("plaintext server leads");
    // Each speaks to its own kind.
    leader(channel(&tls.addrs[0]).await.expect("endpoint")).await.expect("TLS to TLS");
    leader(channel_insecure(&plain.addrs[0]).await.expect("endpoint")).await.expect("plaintext to plaintext");
    for (what, addr) in [("client", &tls.addrs[0]), ("peer", &tls.peer_addrs[0])] {
        let t = Instant::now();
        let e = leader(channel_insecure(addr).await.expect("endpoint")).await.expect_err("plaintext to TLS");
        eprintln!("plaintext to the TLS {what} listener: {:?} {:?} after {:?}", e.code(), e.message(), t.elapsed());
        // The server answers the HTTP/2 preface with a TLS alert and closes: the client reads a
        // bad HTTP/2 frame (INTERNAL, "h2 protocol error") or a closed connection (CANCELLED,
        // UNAVAILABLE, UNKNOWN "transport error"), whichever it sees first; at once either way.
        assert!(
            matches!(
                e.code(),
                tonic::Code::Unavailable | tonic::Code::Internal | tonic::Code::Cancelled | tonic::Code::Unknown
            ),
            "{what}: {e:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(2), "{what}: {:?}", t.elapsed());
    }
    let t = Instant::now();
    let e = leader(channel(&plain.addrs[0]).await.expect("endpoint")).await.expect_err("TLS to plaintext");
    eprintln!("TLS to the plaintext listener: {:?} {:?} after {:?}", e.code(), e.message(), t.elapsed());
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // Another CA's client refuses the server; the server refuses another CA's certificate, on
    // either listener, even from a client that trusts the server.
    let other = tempfile::tempdir().expect("temp dir");
    let stranger = LocalPki::create(&other.path().join("pki")).expect("another CA");
    let files = stranger.user("mallory", Role::Admin, None);
    let e = leader(suanli_server::local::channel_as(&tls.addrs[0], &files).await.expect("loads"))
        .await
        .expect_err("another CA");
    eprintln!("a client of another CA: {:?} {:?}", e.code(), e.message());
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let forged = suanli_security::tls::TlsFiles { ca: LocalPki::get().admin().ca, ..files };
    for addr in [&tls.addrs[0], &tls.peer_addrs[0]] {
        let e = leader(suanli_server::local::channel_as(addr, &forged).await.expect("loads"))
            .await
            .expect_err("a certificate of another CA");
        eprintln!("a certificate of another CA at {addr}: {:?} {:?}", e.code(), e.message());
        // TLS 1.3: the client's side of the handshake is done before the server checks its
        // certificate; the server's alert and close reach it as a closed connection.
        assert!(matches!(e.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled), "{e:?}");
    }
}
