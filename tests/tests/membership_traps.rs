//! The membership traps an operator falls into, on real server processes: a reused id or
//! address at `--join` (refused: the process exits non-zero, the membership is unchanged);
//! a wiped first server restarted with its original `--peers` (no second cluster), replaced
//! under a new id as the runbook says; a removed server (it exits, status 3); a client whose
//! first address is a hung server; an agent configured with one server that learns the others
//! and survives that server's removal.

#![allow(clippy::unwrap_used)]

use suanli_tests as support;

use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::queues_client::QueuesClient;
use support::{AgentProc, ProcessCluster, bin, channel, fake_config, job, ready_healthy, submit, wait_nodes};

async fn members(addr: &str) -> Vec<pb::Member> {
    let mut c = ClusterClient::new(channel(addr).await.unwrap());
    c.members(pb::MembersRequest {}).await.unwrap().into_inner().members
}

async fn ids(addr: &str) -> Vec<(u64, bool)> {
    let mut v: Vec<(u64, bool)> = members(addr).await.iter().map(|m| (m.id, m.voter)).collect();
    v.sort_unstable();
    v
}

async fn wait_for(what: &str, c: &ProcessCluster, within: Duration, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok().await {
        assert!(Instant::now() < deadline, "{what} within {within:?}\n{}\n{}\n{}", c.log(0), c.log(1), c.log(2));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Three voters (ids 1..=3) grown online from server 1, and `spare` more addresses.
async fn three_of(spare: usize, extra: &[&str]) -> ProcessCluster {
    let mut c = ProcessCluster::start_one_of(&bin(), 3 + spare, extra).unwrap();
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let a0 = c.addrs[0].clone();
    // One at a time: two learners joining at once have made openraft 0.9.25's leader panic
    // (`attempt to subtract with overflow` in ProgressEntry::calc_mid), which is not what
    // these tests are about.
    for (i, want) in [(1, vec![(1, true), (2, true)]), (2, vec![(1, true), (2, true), (3, true)])] {
        c.spawn_joining(i, 0).unwrap();
        wait_for("a voter more", &c, Duration::from_secs(60), async || ids(&a0).await == want).await;
    }
    c
}

async fn write_queue(addr: &str, id: &str) {
    let q = serde_json::json!({"id": id, "nominal": {"cpu_milli": 1000}});
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = QueuesClient::new(channel(addr).await.unwrap())
            .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
            .await;
        match r {
            Ok(_) => return,
            Err(e) => assert!(Instant::now() < deadline, "writing queue {id} through {addr}: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_id_or_address_is_refused_and_a_server_is_replaced_under_a_new_id() {
    let mut c = three_of(1, &[]).await;
    let a0 = c.addrs[0].clone();
    // Id 2 again, on the spare addresses: refused, the process exits non-zero.
    c.spawn_as(3, 2, &["--join", &a0]).unwrap();
    let st = c.wait_exit(3, Duration::from_secs(20)).unwrap_or_else(|| panic!("still running:\n{}", c.log(3)));
    assert!(!st.success(), "{st}");
    let log = c.log(3);
    assert!(log.contains("server 2 is already a member"), "{log}");
    assert!(!log.contains("joined the cluster"), "{log}");
    assert_eq!(ids(&a0).await, [(1, true), (2, true), (3, true)]);

    // Server 3 is lost and wiped; a new id on its old addresses is refused while id 3 is a member.
    c.kill(2);
    c.wipe(2).unwrap();
    c.spawn_as(2, 5, &["--join", &a0]).unwrap();
    let st = c.wait_exit(2, Duration::from_secs(20)).unwrap_or_else(|| panic!("still running:\n{}", c.log(2)));
    assert!(!st.success(), "{st}");
    assert!(c.log(2).contains("already used by server 3"), "{}", c.log(2));
    assert_eq!(ids(&a0).await, [(1, true), (2, true), (3, true)]);

    // The runbook "Replace a server": remove the old id, wipe, join under a new id.
    ClusterClient::new(channel(&a0).await.unwrap()).remove_server(pb::RemoveServerRequest { id: 3 }).await.unwrap();
    c.wipe(2).unwrap();
    c.spawn_as(2, 5, &["--join", &a0]).unwrap();
    wait_for("server 5 is a voter", &c, Duration::from_secs(60), async || {
        ids(&a0).await == [(1, true), (2, true), (5, true)]
    })
    .await;
    write_queue(&c.addrs[2], "after-replace").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_first_server_restarted_with_its_peers_forms_no_second_cluster() {
    let mut c = support::cluster(3).await.0;
    for i in 0..5 {
        write_queue(&c.addrs[1], &format!("q{i}")).await;
    }
    let first_log = c.log(0);
    assert!(first_log.contains("initialized a new cluster"), "{first_log}");
    let inits = |log: &str| log.matches("initialized a new cluster").count();

    // Server 1 (which led) wiped, then restarted by the same unit: --peers without --bootstrap,
    // then with it (a unit file that always passes it). Either it waits to be added or, once
    // the leader knows it had replicated to id 1, refuses to start as a wiped voter; it never
    // initializes a second cluster.
    let has = |log: &str, a: &str, b: &str| log.contains(a) || log.contains(b);
    c.kill(0);
    c.wipe(0).unwrap();
    c.spawn_waiting(0).unwrap();
    wait_for("server 1 waits or refuses", &c, Duration::from_secs(20), async || {
        has(&c.log(0), "waiting to be added", "it was wiped")
    })
    .await;
    c.kill(0);
    c.wipe(0).unwrap();
    c.spawn(0).unwrap();
    wait_for("server 1 refuses to bootstrap", &c, Duration::from_secs(20), async || {
        has(&c.log(0), "bootstrap refused", "it was wiped")
    })
    .await;
    assert_eq!(inits(&c.log(0)), inits(&first_log), "a second cluster was initialized:\n{}", c.log(0));
    c.kill(0);

    // A follower wiped under a leader that stays: its id is a voter the leader had replicated
    // to, so it refuses to start at all (before it serves its peer listener, so the leader cannot
    // refill it under the old id), with or without --bootstrap.
    let l = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let f = [1, 2].into_iter().find(|i| *i != l).unwrap();
    for bootstrap in [false, true] {
        c.kill(f);
        c.wipe(f).unwrap();
        if bootstrap {
            c.spawn(f).unwrap();
        } else {
            c.spawn_waiting(f).unwrap();
        }
        let st = c.wait_exit(f, Duration::from_secs(20)).unwrap_or_else(|| panic!("still running:\n{}", c.log(f)));
        assert!(!st.success(), "{st}");
        assert!(c.log(f).contains("it was wiped"), "{}", c.log(f));
    }
    // One cluster: the leader's membership is unchanged, and nobody else initialized one.
    assert_eq!(ids(&c.addrs[l]).await, [(1, true), (2, true), (3, true)]);
    assert!(!c.log(f).contains("initialized a new cluster"), "{}", c.log(f));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_server_exits_with_status_3() {
    let mut c = three_of(0, &[]).await;
    let a0 = c.addrs[0].clone();
    ClusterClient::new(channel(&a0).await.unwrap()).remove_server(pb::RemoveServerRequest { id: 3 }).await.unwrap();
    let st = c.wait_exit(2, Duration::from_secs(20)).unwrap_or_else(|| panic!("server 3 still runs:\n{}", c.log(2)));
    assert_eq!(st.code(), Some(3), "{st}\n{}", c.log(2));
    assert!(c.log(2).contains("removed from the cluster"), "{}", c.log(2));
    assert_eq!(ids(&a0).await, [(1, true), (2, true)]);
    write_queue(&a0, "after-remove").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_moves_past_a_hung_first_server() {
    let c = support::cluster(1).await.0;
    // Accepts connections, never answers.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_addr = hung.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in hung.incoming().flatten() {
            held.push(s);
        }
    });
    let servers = format!("{hung_addr},{}", c.addrs[0]);
    let t = Instant::now();
    let out = suanli_tests::cli()
        .args(["cluster", "members", "--server", &servers])
        .env_remove("SUANLI_ADDR")
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 2 s for an answer and 1 s for the probe, plus the process on a busy machine.
    assert!(took < Duration::from_secs(6), "a hung first server cost {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_configured_with_one_server_learns_the_others_and_survives_its_removal() {
    // A short TTL, so outliving it is quick to show.
    let mut c = three_of(0, &["--heartbeat-ttl-ms", "4000"]).await;
    let a0 = c.addrs[0].clone();
    let q = serde_json::json!({"id": "default", "nominal": {"cpu_milli": u64::MAX, "memory_mib": u64::MAX, "gpu_milli": u64::MAX}});
    QueuesClient::new(channel(&a0).await.unwrap())
        .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
        .await
        .unwrap();
    let mut agent = AgentProc::new("node-a", std::slice::from_ref(&c.addrs[2]), &fake_config(2, 0, 0), "");
    agent.start();
    wait_nodes(&a0, Duration::from_secs(30), "the agent registered", |n| ready_healthy(n, "node-a", 2)).await;
    let learned = agent.data_dir().join("servers.json");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&learned).unwrap_or_default();
        if c.addrs[..2].iter().all(|a| text.contains(a.as_str())) {
            break;
        }
        assert!(Instant::now() < deadline, "learned servers: {text:?}\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let spec = serde_json::json!({"name": "long", "queue": "default", "groups": [{"name": "main", "replicas": 1,
        "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": 1000}},
        "task": {"command": "/bin/sh", "args": ["-c", "sleep 600"]}}]});
    let id = submit(&a0, "long", &spec).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let before = loop {
        let j = job(&a0, id).await;
        if j.state == "running" {
            break j;
        }
        assert!(Instant::now() < deadline, "{j:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Its only configured server is removed (and exits).
    ClusterClient::new(channel(&a0).await.unwrap()).remove_server(pb::RemoveServerRequest { id: 3 }).await.unwrap();
    assert!(c.wait_exit(2, Duration::from_secs(20)).is_some(), "server 3 still runs");
    // Two TTLs later the node is still ready and the task still runs, unfenced.
    tokio::time::sleep(Duration::from_secs(8)).await;
    wait_nodes(&a0, Duration::from_secs(5), "the node is still ready", |n| ready_healthy(n, "node-a", 2)).await;
    let after = job(&a0, id).await;
    assert_eq!(after.state, "running", "{after:#?}\n{}", agent.log());
    assert_eq!(after.attempt, before.attempt);
    assert_eq!(agent.journal().len(), 1, "one start, no stop: {:#?}", agent.journal());
}
