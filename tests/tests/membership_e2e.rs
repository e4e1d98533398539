//! Online membership on real server processes: one server alone, jobs written and a snapshot
//! taken (the log behind it purged), two servers join (catching up from the snapshot) and
//! become voters, one is removed; the data is on every member throughout.

#![allow(clippy::unwrap_used)]

use suanli_tests as common;

use common::{ProcessCluster, all_jobs, channel, cpu_job};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::queues_client::QueuesClient;

async fn members(addr: &str) -> Vec<pb::Member> {
    let mut c = ClusterClient::new(channel(addr).await.unwrap());
    c.members(pb::MembersRequest {}).await.unwrap().into_inner().members
}

async fn wait_for(what: &str, c: &ProcessCluster, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ok().await {
        assert!(Instant::now() < deadline, "{what} within 60 s\n{}\n{}", c.log(1), c.log(2));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_join_from_a_snapshot_and_are_removed_online() {
    let bin = &suanli_tests::bin();
    // Keep no log behind a snapshot, so joiners must catch up from the snapshot itself.
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("server.toml");
    std::fs::write(&cfg, "[raft]\nkeep_entries_after_snapshot = 0\n").unwrap();
    let mut c = ProcessCluster::start_one_of(bin, 3, &["--config", cfg.to_str().unwrap()]).unwrap();
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let a0 = c.addrs[0].clone();
    let ch = channel(&a0).await.unwrap();
    let q = serde_json::json!({"id": "q", "nominal": {"cpu_milli": 1000}});
    QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: q.to_string() }).await.unwrap();
    let mut jobs = JobsClient::new(ch.clone());
    for i in 0..50 {
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: format!("m-{i}"),
            spec_json: cpu_job(&format!("m{i}"), "q", 100),
            retry: None,
        };
        jobs.submit(req).await.unwrap();
    }
    let snap = ClusterClient::new(ch.clone()).snapshot(pb::SnapshotRequest {}).await.unwrap().into_inner();
    assert!(snap.last_log_index >= 50, "{snap:?}");

    for i in [1, 2] {
        c.spawn_joining(i, 0).unwrap();
    }
    wait_for("both joiners are voters", &c, async || {
        let m = members(&a0).await;
        m.len() == 3 && m.iter().all(|m| m.voter)
    })
    .await;
    for i in [1, 2] {
        let addr = c.addrs[i].clone();
        wait_for("a joiner has every job", &c, async || {
            all_jobs(&addr, true).await.map(|j| j.len()).unwrap_or(0) == 50
        })
        .await;
    }

    // Remove server 3 online; the two left keep serving writes.
    ClusterClient::new(channel(&c.addrs[1]).await.unwrap())
        .remove_server(pb::RemoveServerRequest { id: 3 })
        .await
        .unwrap();
    wait_for("server 3 is gone from the membership", &c, async || members(&a0).await.len() == 2).await;
    c.kill(2);
    let req = pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: "after".into(),
        spec_json: cpu_job("after", "q", 100),
        retry: None,
    };
    JobsClient::new(channel(&c.addrs[1]).await.unwrap()).submit(req).await.unwrap();
    assert_eq!(all_jobs(&a0, false).await.unwrap().len(), 51);
}
