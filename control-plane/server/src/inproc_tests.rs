//! Whole servers in the test's process ([`crate::testkit`]): listeners on port 0, paused tokio
//! time, real raft and RocksDB. What they pin: a follower forwards writes to its leader (and
//! answers UNAVAILABLE, bounded, when it has none), and node liveness (down after the TTL,
//! never before, a heartbeat renewing it), and a replicated config change made through a
//! follower.

use crate::testkit::{self, Running};
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_proto::v1::queues_client::QueuesClient;
use tokio::time::Instant;
use tonic::Code;

fn queue_json(id: &str) -> String {
    serde_json::to_string(&suanli_model::Queue::new(id, suanli_model::ResVec::MAX)).expect("a queue encodes")
}

/// Servers `a` and `b`'s indexes: (leader, follower).
async fn roles(s: &[Running]) -> (usize, usize) {
    let l = testkit::leader_of(&s[0]).await;
    let l = usize::try_from(l - 1).expect("an index");
    (l, 1 - l)
}

#[tokio::test(start_paused = true)]
async fn a_follower_forwards_writes_to_the_leader() {
    let dir = tempfile::tempdir().expect("temp dir");
    let s = testkit::cluster(2, dir.path(), |c| c).await;
    let (l, f) = roles(&s).await;
    // Both know the same leader.
    assert_eq!(testkit::leader_of(&s[f]).await, l as u64 + 1);
    let mut follower = QueuesClient::new(s[f].channel());
    follower.upsert(pb::UpsertQueueRequest { queue_json: queue_json("via-follower") }).await.expect("forwarded");
    // Committed by the leader, applied there before the follower answered; and the follower
    // itself reads its own write (it waited until applied).
    let mut leader = QueuesClient::new(s[l].channel());
    let get = |stale| pb::GetQueueRequest { id: "via-follower".into(), stale };
    assert_eq!(leader.get(get(true)).await.expect("on the leader").get_ref().id, "via-follower");
    assert_eq!(follower.get(get(true)).await.expect("on the follower").get_ref().id, "via-follower");
    // A refusal comes back through the hop unchanged (INVALID_ARGUMENT, not UNAVAILABLE).
    let mut bad = suanli_model::Queue::new("orphan", suanli_model::ResVec::MAX);
    bad.parent = Some(suanli_model::QueueId("nope".into()));
    let e = follower
        .upsert(pb::UpsertQueueRequest { queue_json: serde_json::to_string(&bad).expect("encodes") })
        .await
        .expect_err("refused by the leader's state machine");
    assert_ne!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("nope"), "{e:?}");
}

#[tokio::test(start_paused = true)]
async fn a_follower_without_a_leader_answers_unavailable_within_the_request_timeout() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut s = testkit::cluster(2, dir.path(), |c| c).await;
    let (l, f) = roles(&s).await;
    let timeout = Duration::from_millis(testkit::config(1, dir.path()).request_timeout_ms);
    let leader = s.remove(l);
    let f = if f > l { f - 1 } else { f };
    leader.stop().await.expect("the leader steps down cleanly");
    // Two voters, one left: no quorum, so no leader. The write must not hang: the follower
    // forwards to the leader it last knew (refused: it is gone) or waits for an election, and
    // answers UNAVAILABLE either way, within the request timeout.
    let t = Instant::now();
    let e = QueuesClient::new(s[f].channel())
        .upsert(pb::UpsertQueueRequest { queue_json: queue_json("nobody-commits") })
        .await
        .expect_err("no quorum");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(t.elapsed() <= timeout + Duration::from_secs(1), "answered after {:?}", t.elapsed());
}

/// Registers node `id` with the server behind `ch`.
async fn register(ch: tonic::transport::Channel, id: &str) {
    let node = serde_json::json!({"id": id, "pool": "cpu", "cpu_milli": 8000, "memory_mib": 16000});
    let req =
        pb::RegisterNodeRequest { node_json: node.to_string(), agent_version: "test".into(), ..Default::default() };
    AgentClient::new(ch).register(req).await.expect("register");
}

/// Node `id`'s status and reason, read from the server's local state (no raft round, so the
/// read itself moves no timer).
async fn status(ch: tonic::transport::Channel, id: &str) -> (String, String) {
    let n = NodesClient::new(ch).get(pb::GetNodeRequest { id: id.into(), stale: true }).await.expect("node");
    let n = n.into_inner();
    (n.status, n.reason)
}

#[tokio::test(start_paused = true)]
async fn a_silent_node_is_down_after_its_ttl_and_a_heartbeat_keeps_it_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    // TTL 1 s, liveness every 100 ms, clock check every 100 ms (alone: it always passes).
    let cfg = testkit::config(1, dir.path());
    let ttl = Duration::from_millis(cfg.heartbeat_ttl_ms);
    let s = Running::start(testkit::listeners().await, crate::ServerConfig { bootstrap: true, ..cfg });
    testkit::leader_of(&s).await;
    register(s.channel(), "quiet").await;
    register(s.channel(), "chatty").await;
    let t0 = Instant::now();
    let beat = || async {
        let req = pb::HeartbeatRequest { node_id: "chatty".into(), ..Default::default() };
        let r = AgentClient::new(s.channel()).heartbeat(req).await.expect("heartbeat");
        assert!(r.get_ref().known, "a ready node's heartbeat is taken");
    };
    tokio::time::sleep_until(t0 + ttl / 2).await;
    beat().await;
    assert_eq!(status(s.channel(), "quiet").await.0, "ready", "half the TTL: still ready");
    tokio::time::sleep_until(t0 + ttl - Duration::from_millis(150)).await;
    beat().await;
    assert_eq!(status(s.channel(), "quiet").await.0, "ready", "just under the TTL: still ready");
    // Past the TTL, one liveness tick and one clock check: down, with the reason.
    tokio::time::sleep_until(t0 + ttl + Duration::from_millis(350)).await;
    let (st, reason) = status(s.channel(), "quiet").await;
    assert_eq!(st, "down", "{reason}");
    assert_eq!(reason, format!("no heartbeat for {} ms", ttl.as_millis()));
    assert_eq!(status(s.channel(), "chatty").await.0, "ready", "heartbeats renew the TTL");
    // Silent from here on, it goes down one TTL after its last heartbeat.
    tokio::time::sleep(ttl + Duration::from_millis(350)).await;
    assert_eq!(status(s.channel(), "chatty").await.0, "down");
    s.stop().await.expect("stops cleanly");
}

#[tokio::test(start_paused = true)]
async fn a_config_change_through_a_follower_is_made_by_the_leader_and_read_everywhere() {
    use suanli_proto::v1::cluster_client::ClusterClient;
    let dir = tempfile::tempdir().expect("temp dir");
    let s = testkit::cluster(2, dir.path(), |c| c).await;
    let (l, f) = roles(&s).await;
    let mut follower = ClusterClient::new(s[f].channel());
    let set = [
        ("checkpoint_store".to_owned(), r#""file:///shared/ckpt""#.to_owned()),
        ("avoid_failed_node_s".to_owned(), "60".to_owned()),
    ];
    let r = follower.set_config(pb::SetConfigRequest { set: set.into_iter().collect() }).await.expect("set");
    let r = r.into_inner();
    let changed: serde_json::Value = serde_json::from_str(&r.config_json).expect("json");
    assert_eq!(changed["checkpoint_store"], "file:///shared/ckpt");
    assert_eq!(changed["avoid_failed_node_s"], 60);
    for i in [l, f] {
        let got = ClusterClient::new(s[i].channel())
            .get_config(pb::GetConfigRequest { stale: false })
            .await
            .expect("get")
            .into_inner();
        assert!(got.revision >= r.revision, "server {i}: read at {} < {}", got.revision, r.revision);
        assert_eq!(serde_json::from_str::<serde_json::Value>(&got.config_json).expect("json"), changed);
    }
    // Refusals name the field and change nothing.
    let bad = [("avoid_failed_node_s".to_owned(), r#""soon""#.to_owned())];
    let e = follower.set_config(pb::SetConfigRequest { set: bad.into_iter().collect() }).await.expect_err("type");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("set.avoid_failed_node_s: "), "{e:?}");
    let unknown = [("no_such_field".to_owned(), "1".to_owned())];
    let e = follower.set_config(pb::SetConfigRequest { set: unknown.into_iter().collect() }).await.expect_err("x");
    assert!(e.message().starts_with("set.no_such_field: unknown field"), "{e:?}");
    let now = follower.get_config(pb::GetConfigRequest { stale: false }).await.expect("get").into_inner();
    assert_eq!(serde_json::from_str::<serde_json::Value>(&now.config_json).expect("json"), changed);
    // Migrating a job that does not exist is NOT_FOUND, through the follower's forwarding.
    let e = suanli_proto::v1::jobs_client::JobsClient::new(s[f].channel())
        .migrate(pb::MigrateJobRequest { job_id: 424_242, ..Default::default() })
        .await
        .expect_err("unknown job");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = suanli_proto::v1::jobs_client::JobsClient::new(s[f].channel())
        .migrate(pb::MigrateJobRequest { job_id: 1, to_node: "bad node".into(), ..Default::default() })
        .await
        .expect_err("bad name");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("to_node"), "{e:?}");
}
