//! The connection against in-process `Cluster` services on port-0 listeners: a follower that
//! names the leader, a server that is down, and one that accepts connections but never answers.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use suanli_client::{ClientError, Connection, ConnectionConfig, LeaderHints, pb};
use tonic::{Request, Response, Status};

/// A server that answers `Members` with its id, or (a follower) refuses it with UNAVAILABLE
/// naming the leader; every `Members` call is counted.
struct Fake {
    id: u64,
    leader: Option<String>,
    calls: Arc<AtomicUsize>,
}

type Answer<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl pb::cluster_server::Cluster for Fake {
    async fn members(&self, _: Request<pb::MembersRequest>) -> Answer<pb::MembersResponse> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(l) = &self.leader {
            let mut s = Status::unavailable("not the leader");
            s.metadata_mut().insert(suanli_proto::LEADER_HEADER, l.parse().unwrap());
            return Err(s);
        }
        Ok(Response::new(pb::MembersResponse { term: self.id, ..Default::default() }))
    }
    async fn leader(&self, _: Request<pb::LeaderRequest>) -> Answer<pb::LeaderResponse> {
        Ok(Response::new(pb::LeaderResponse::default()))
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
        Err(Status::not_found("no version here"))
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
    /// Like `members`: the leader echoes the fields it was given as the new config.
    async fn set_config(&self, req: Request<pb::SetConfigRequest>) -> Answer<pb::SetConfigResponse> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(l) = &self.leader {
            let mut s = Status::unavailable("not the leader");
            s.metadata_mut().insert(suanli_proto::LEADER_HEADER, l.parse().unwrap());
            return Err(s);
        }
        let set = req.into_inner().set;
        let config_json = set.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
        Ok(Response::new(pb::SetConfigResponse { config_json, revision: self.id }))
    }
    async fn backup(&self, _: Request<pb::BackupRequest>) -> Answer<Self::BackupStream> {
        Err(Status::unimplemented("backup"))
    }
}

/// Serves `fake` on a port-0 listener; its address.
async fn serve(fake: Fake) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::cluster_server::ClusterServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    addr
}

/// An address that accepts TCP connections and never answers (a SIGSTOPped server).
async fn hung() -> (String, tokio::net::TcpListener) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    (listener.local_addr().unwrap().to_string(), listener)
}

/// An address that refuses connections: a socket bound (so the port is nobody else's) that
/// never listens. Keep the socket while the address is in use.
async fn refused() -> (String, tokio::net::TcpSocket) {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    (s.local_addr().unwrap().to_string(), s)
}

fn quick(hints: LeaderHints) -> ConnectionConfig {
    ConnectionConfig {
        connect_timeout: Duration::from_millis(300),
        first_answer: Duration::from_millis(200),
        probe_timeout: Duration::from_millis(200),
        hints,
        ..ConnectionConfig::default()
    }
}

#[tokio::test]
async fn a_follower_s_leader_hint_is_followed_once_and_remembered() {
    let (leader_calls, follower_calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let leader = serve(Fake { id: 1, leader: None, calls: leader_calls.clone() }).await;
    let follower = serve(Fake { id: 2, leader: Some(leader.clone()), calls: follower_calls.clone() }).await;
    // Only the follower is listed: the hint names an address the CLI was not given.
    let conn = Connection::new(std::slice::from_ref(&follower), quick(LeaderHints::Follow)).unwrap();
    assert_eq!(conn.members().await.unwrap().term, 1, "answered by the leader");
    assert_eq!(conn.current_addr(), Some(leader.clone()));
    assert_eq!(conn.members().await.unwrap().term, 1);
    assert_eq!((follower_calls.load(Ordering::SeqCst), leader_calls.load(Ordering::SeqCst)), (1, 2), "remembered");

    // KnownOnly: a hint naming an unlisted address is never dialed.
    let conn = Connection::new(std::slice::from_ref(&follower), quick(LeaderHints::KnownOnly)).unwrap();
    let e = conn.members().await.unwrap_err();
    assert!(matches!(e, ClientError::NoServer { .. }), "{e}");
    assert!(e.to_string().starts_with("UNAVAILABLE: no server answered ("), "{e}");
    // Listed, it is.
    let conn = Connection::new(&[follower.clone(), leader.clone()], quick(LeaderHints::KnownOnly)).unwrap();
    assert_eq!(conn.members().await.unwrap().term, 1);
}

#[tokio::test]
async fn refused_and_hung_servers_are_passed_over_and_other_errors_are_answers() {
    let calls = Arc::new(AtomicUsize::new(0));
    let good = serve(Fake { id: 7, leader: None, calls: calls.clone() }).await;
    let (stuck, _keep) = hung().await;
    let (down, _closed) = refused().await;
    let conn = Connection::new(&[down.clone(), stuck.clone(), good.clone()], quick(LeaderHints::Follow)).unwrap();
    let t = std::time::Instant::now();
    assert_eq!(conn.members().await.unwrap().term, 7);
    // The hung server cost at most its connect timeout, or its first answer and the probe.
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(conn.current_addr(), Some(good.clone()));
    // NOT_FOUND is an answer, not a reason to try elsewhere.
    let e = conn.version().await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert_eq!(e.to_string(), "NOT_FOUND: no version here");

    // Nobody answers: every address is named with why.
    let conn = Connection::new(&[down.clone(), stuck.clone()], quick(LeaderHints::Follow)).unwrap();
    let e = conn.members().await.unwrap_err().to_string();
    assert!(e.contains(&down) && e.contains(&stuck), "{e}");
}

#[tokio::test]
async fn an_idempotent_submission_is_retried_with_the_same_request_and_bounded() {
    // No server at all: the submission is tried 1 + 4 times (the SUBMIT backoff), then fails.
    let (down, _closed) = refused().await;
    let conn = Connection::new(&[down], quick(LeaderHints::Follow)).unwrap();
    let mut retries = Vec::new();
    let req = pb::SubmitJobRequest { client_request_id: suanli_client::new_request_id("test"), ..Default::default() };
    let e = conn.submit_job(req, |e, d| retries.push((e.code(), d))).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let waits: Vec<Duration> = retries.iter().map(|(_, d)| *d).collect();
    assert_eq!(waits, [500, 1000, 2000, 4000].map(Duration::from_millis));
}

#[tokio::test]
async fn a_config_change_reaches_the_leader_with_every_field() {
    let (leader_calls, follower_calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let leader = serve(Fake { id: 1, leader: None, calls: leader_calls.clone() }).await;
    let follower = serve(Fake { id: 2, leader: Some(leader.clone()), calls: follower_calls.clone() }).await;
    let conn = Connection::new(std::slice::from_ref(&follower), quick(LeaderHints::Follow)).unwrap();
    let set = [
        ("checkpoint_store".to_owned(), r#""file:///ckpt""#.to_owned()),
        ("avoid_failed_node_s".to_owned(), "60".to_owned()),
    ];
    let r = conn.set_config(set).await.unwrap();
    assert_eq!(r.revision, 1, "answered by the leader");
    assert_eq!(r.config_json, r#"avoid_failed_node_s=60,checkpoint_store="file:///ckpt""#);
    assert_eq!((follower_calls.load(Ordering::SeqCst), leader_calls.load(Ordering::SeqCst)), (1, 1));
}
