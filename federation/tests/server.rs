//! Three real federation servers in this process (`serve_on` on 127.0.0.1:0, RocksDB in
//! tempdirs, TLS from a generated PKI): a leader is elected, Submit is idempotent, Status
//! answers on a follower, a follower forwards writes, authorization holds (viewer, another
//! team's member, a region method on the federation), and a region's Sync registers it.

use std::time::Duration;
use suanli_client::{ClientError, Connection, ConnectionConfig, LeaderHints, pb};
use suanli_federation::server::{FederationServerConfig, serve_on};
use suanli_security::certs::{self, Leaf};
use suanli_security::principal::{Credential, Principal, Role};
use suanli_security::tls::Tls;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::Code;

struct Fed {
    clients: Vec<String>,
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), String>>>,
    pki: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn user(name: &str, role: Role, team: Option<&str>) -> Leaf {
    Leaf::user(Principal::User {
        name: name.into(),
        role,
        team: team.map(str::to_owned),
        credential: Credential::Certificate,
    })
}

impl Fed {
    async fn start() -> Fed {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = dir.path().join("pki");
        let hosts = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
        certs::init(
            &pki,
            &[
                Leaf::server("server", &hosts),
                Leaf::server("region-eu", &hosts),
                Leaf::user(Principal::User {
                    name: "admin".into(),
                    role: Role::Admin,
                    team: None,
                    credential: Credential::Certificate,
                }),
                user("ann", Role::Member, Some("a")),
                user("bob", Role::Member, Some("b")),
                user("vic", Role::Viewer, None),
            ],
            Duration::from_secs(3600),
        )
        .expect("pki");
        let mut listeners = Vec::new();
        for _ in 0..3 {
            let c = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let p = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            listeners.push((c, p));
        }
        let peers: Vec<(u64, String, String)> = listeners
            .iter()
            .enumerate()
            .map(|(i, (c, p))| {
                (i as u64 + 1, c.local_addr().expect("addr").to_string(), p.local_addr().expect("addr").to_string())
            })
            .collect();
        let clients = peers.iter().map(|p| p.1.clone()).collect();
        let (mut stops, mut tasks) = (Vec::new(), Vec::new());
        for (i, (c, p)) in listeners.into_iter().enumerate() {
            let cfg = FederationServerConfig {
                id: i as u64 + 1,
                data_dir: dir.path().join(format!("fed-{}", i + 1)),
                peers: peers.clone(),
                bootstrap: true,
                tls_dir: Some(pki.clone()),
                dispatch_interval_ms: 100,
                expire_interval_ms: 100,
                http_listen: Some("127.0.0.1:0".into()),
                ..FederationServerConfig::default()
            };
            let (tx, rx) = oneshot::channel::<()>();
            stops.push(tx);
            tasks.push(tokio::spawn(serve_on(c, p, cfg, async move {
                let _ = rx.await;
            })));
        }
        Fed { clients, stops, tasks, pki, _dir: dir }
    }

    fn conn(&self, stem: &str, addrs: &[String], hints: LeaderHints) -> Connection {
        let tls = Tls::load(certs::paths(&self.pki, stem)).expect("client tls");
        Connection::new(addrs, ConnectionConfig { tls: Some(tls), hints, ..ConnectionConfig::default() })
            .expect("connection")
    }

    fn all(&self, stem: &str) -> Connection {
        self.conn(stem, &self.clients, LeaderHints::Follow)
    }

    /// Waits until a leader is known and the terms are written; its id.
    async fn leader(&self) -> u64 {
        let admin = self.all("admin");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(s) = admin.fed_status().await
                && s.leader_id != 0
                && s.members.len() == 3
            {
                return s.leader_id;
            }
            assert!(tokio::time::Instant::now() < deadline, "no federation leader within 30 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        for t in self.tasks {
            let r = tokio::time::timeout(Duration::from_secs(15), t).await.expect("stops within 15 s");
            r.expect("task").expect("clean exit");
        }
    }
}

fn spec(name: &str) -> String {
    serde_json::json!({"name": name, "queue": "default", "groups": [{"name": "main", "replicas": 1,
        "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": 1000}},
        "task": {"command": "/bin/sh", "args": ["-c", "sleep 600"]}}]})
    .to_string()
}

fn submit_req(name: &str, team: &str, key: &str) -> pb::FedSubmitRequest {
    pb::FedSubmitRequest {
        spec_json: spec(name),
        team: team.into(),
        client_request_id: key.into(),
        ..Default::default()
    }
}

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> (Code, String) {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => (e.code(), e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_servers_elect_submit_forward_authorize_and_sync() {
    let fed = Fed::start().await;
    let leader = fed.leader().await;
    let admin = fed.all("admin");

    // Submit is idempotent on the request id.
    let a = admin.fed_submit(submit_req("one", "a", "k-1"), |_, _| {}).await.expect("submit");
    assert!(a.created);
    assert!(a.global_id.starts_with("g-"), "{a:?}");
    let again = admin.fed_submit(submit_req("one", "a", "k-1"), |_, _| {}).await.expect("retry");
    assert_eq!((again.global_id.as_str(), again.created), (a.global_id.as_str(), false));

    // Status on a follower answers there, naming the leader.
    let follower = (1..=3u64).find(|id| *id != leader).expect("a follower");
    let faddr = vec![fed.clients[(follower - 1) as usize].clone()];
    let on_follower = fed.conn("admin", &faddr, LeaderHints::Ignore);
    let s = on_follower.fed_status().await.expect("status on a follower");
    assert_eq!((s.id, s.leader_id), (follower, leader));
    assert_eq!(s.members.len(), 3);

    // A write sent to the follower alone is forwarded to the leader.
    let f = on_follower.fed_submit(submit_req("two", "a", "k-2"), |_, _| {}).await.expect("forwarded submit");
    assert!(f.created);
    let j = on_follower.fed_get_job(&f.global_id).await;
    let j = match j {
        Ok(j) => j,
        // The follower may not have applied it yet: the leader has.
        Err(_) => admin.fed_get_job(&f.global_id).await.expect("get job"),
    };
    assert_eq!((j.name.as_str(), j.team.as_str()), ("two", "a"));
    let (c, m) = code(admin.fed_get_job("g-999").await);
    assert_eq!(c, Code::NotFound, "{m}");
    assert!(m.contains("g-999"), "{m}");
    let (c, m) = code(admin.fed_cancel("g-999").await);
    assert_eq!(c, Code::NotFound, "{m}");
    assert!(m.contains("g-999"), "{m}");
    let (c, m) = code(admin.fed_submit(submit_req("keyless", "a", ""), |_, _| {}).await);
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("client_request_id"), "{m}");
    let mut bad = submit_req("x", "a", "k-bad");
    bad.spec_json = "{not json".into();
    let (c, m) = code(admin.fed_submit(bad, |_, _| {}).await);
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("spec_json"), "{m}");

    // Authorization.
    let ann = fed.all("user-ann");
    ann.fed_submit(submit_req("ann's", "", "k-ann"), |_, _| {}).await.expect("a member submits for its own team");
    let bob = fed.all("user-bob");
    let (c, m) = code(bob.fed_submit(submit_req("bob's", "a", "k-bob"), |_, _| {}).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    let (c, m) = code(bob.fed_cancel(&a.global_id).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    let vic = fed.all("user-vic");
    let (c, m) = code(vic.fed_submit(submit_req("vic's", "a", "k-vic"), |_, _| {}).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    vic.fed_status().await.expect("a viewer reads");
    let mut forged = submit_req("forged", "a", "k-forged");
    forged.on_behalf_of = "ann".into();
    forged.on_behalf_of_team = "a".into();
    forged.on_behalf_of_role = "member".into();
    let (c, m) = code(bob.fed_submit(forged, |_, _| {}).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("on_behalf_of"), "{m}");
    // A region's method on the federation's address says what the address is.
    let tls = Tls::load(certs::paths(&fed.pki, "admin")).expect("tls");
    let ep = tonic::transport::Endpoint::from_shared(format!("http://{}", fed.clients[0])).expect("endpoint");
    let mut jobs = pb::jobs_client::JobsClient::new(suanli_security::tls::channel(ep, Some(&tls)));
    let s = jobs.submit(pb::SubmitJobRequest::default()).await.expect_err("denied");
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    assert!(s.message().contains("federation server") && s.message().contains("region"), "{}", s.message());

    // A region's sync (server certificate) registers it; a user's is refused.
    let region = fed.all("server-region-eu");
    let sync = pb::RegionSyncRequest {
        region: "eu-west".into(),
        endpoints: vec!["10.0.0.1:7400".into()],
        pools: vec!["eu-gpu".into()],
        capacity: vec![pb::CapacityEntry {
            pool: "eu-gpu".into(),
            device_kind: "gpu".into(),
            device_model: "H100".into(),
            total_milli: 8000,
            free_milli: 8000,
            max_node_free_milli: 8000,
            free_cpu_milli: 64_000,
            free_memory_mib: 512 * 1024,
            price_micros_per_device_hour: 0,
        }],
        sent_at_ms: suanli_federation::node::now_ms(),
        ..Default::default()
    };
    let (c, m) = code(admin.fed_sync(sync.clone()).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    let answer = region.fed_sync(sync.clone()).await.expect("sync");
    assert!(answer.lease_ms > 0 && answer.now_ms > 0, "{answer:?}");
    let regions = admin.fed_regions().await.expect("regions");
    assert_eq!(regions.regions.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["eu-west"]);
    let mut too_many = sync;
    too_many.pools = (0..10_000).map(|i| format!("p{i}")).collect();
    let (c, m) = code(region.fed_sync(too_many).await);
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("pools"), "{m}");

    // Paging follows numbers, not strings (g-10 after g-9).
    for i in 0..10 {
        admin.fed_submit(submit_req(&format!("p{i}"), "a", &format!("page-{i}")), |_, _| {}).await.expect("submit");
    }
    let all = admin.fed_jobs("", "", None).await.expect("jobs");
    assert!(all.len() >= 13, "{}", all.len());
    let mut ids: Vec<String> = all.iter().map(|j| j.global_id.clone()).collect();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "no job twice");

    fed.stop().await;
}
