//! Stopping servers the way operators and systemd do, on real processes: SIGTERM a leader and
//! a follower (each exits on its own within its bound while the others keep writing), and a
//! rolling restart with SIGTERM (SIGKILL after 15 s) while a client writes and tasks run on an
//! agent: no task fenced or restarted, no write unanswered for longer than one election.
//!
//! The bound on the write gap is derived from the raft settings: the leader stops heartbeating,
//! the voters' lease (election_timeout_max) lapses, one election round (election_timeout_max)
//! and a client's retry round — see [`write_gap_bound`].

#![allow(clippy::unwrap_used)]

use suanli_tests as support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::queues_client::QueuesClient;
use support::{AgentProc, ProcessCluster, cluster_with, fake_config, job, ready_healthy, submit, wait_nodes};
use tonic::transport::{Channel, Endpoint};

/// How long a SIGTERMed server may take: the leader hand-off and the listeners' grace (the
/// defaults, 2 s and 5 s), plus 3 s for the process itself on a busy machine.
fn exit_bound() -> Duration {
    let cfg = suanli_server::ServerConfig::default();
    Duration::from_millis(cfg.leader_handoff_ms + cfg.shutdown_grace_ms + 3_000)
}

/// One election: the lapse of the voters' lease after the last heartbeat, a campaign round,
/// and one retry round of the writer (its per-request timeout over the servers left), each
/// bounded by election_timeout_max; doubled for a loaded 2-core machine.
fn write_gap_bound() -> Duration {
    let r = suanli_raft::RaftSettings::default();
    Duration::from_millis(2 * (3 * r.election_timeout_max_ms + r.heartbeat_interval_ms))
}

/// A client that writes (queue upserts) in a loop through every server in turn, recording
/// the longest time between two acknowledged writes.
struct Writer {
    longest: Arc<Mutex<(Duration, u64)>>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn start(addrs: Vec<String>) -> Writer {
        let longest = Arc::new(Mutex::new((Duration::ZERO, 0u64)));
        let (stop, mut rx) = tokio::sync::watch::channel(false);
        let l = longest.clone();
        let task = tokio::spawn(async move {
            let chans: Vec<Channel> = addrs
                .iter()
                .map(|a| {
                    let ep = Endpoint::from_shared(format!("http://{a}"))
                        .unwrap()
                        .connect_timeout(Duration::from_millis(300))
                        .timeout(Duration::from_millis(1_000));
                    // Over TLS as the local PKI's admin, as every harness channel.
                    suanli_security::tls::channel(ep, Some(&suanli_tests::LocalPki::get().admin_tls()))
                })
                .collect();
            let mut last_ok = Instant::now();
            let mut i = 0usize;
            let mut n = 0u64;
            while !*rx.borrow() {
                let q = serde_json::json!({"id": "w", "weight": 1 + n % 7, "nominal": {"cpu_milli": 1000}});
                let r = QueuesClient::new(chans[i % chans.len()].clone())
                    .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
                    .await;
                match r {
                    Ok(_) => {
                        n += 1;
                        let gap = last_ok.elapsed();
                        last_ok = Instant::now();
                        let mut g = l.lock().unwrap();
                        g.1 = n;
                        if gap > g.0 {
                            g.0 = gap;
                        }
                    }
                    Err(_) => i += 1,
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                    _ = rx.changed() => {}
                }
            }
        });
        Writer { longest, stop, task }
    }

    /// Stops writing: the longest gap and the number of acknowledged writes.
    async fn finish(self) -> (Duration, u64) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        *self.longest.lock().unwrap()
    }
}

async fn leader_of(c: &ProcessCluster) -> usize {
    c.wait_leader(Duration::from_secs(30)).await.unwrap()
}

fn sigterm(c: &mut ProcessCluster, i: usize, what: &str) {
    let (status, took) = c.terminate(i, Duration::from_secs(15));
    let status = status.unwrap_or_else(|| panic!("{what} (server {}) ignored SIGTERM for 15 s\n{}", i + 1, c.log(i)));
    assert!(status.success(), "{what} (server {}) exited with {status}\n{}", i + 1, c.log(i));
    assert!(took <= exit_bound(), "{what} took {took:?} to exit (bound {:?})\n{}", exit_bound(), c.log(i));
    eprintln!("{what} (server {}) exited in {took:?}", i + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_a_leader_then_a_follower_and_the_rest_keeps_writing() {
    let (mut c, _) = cluster_with(3, &[]).await;
    let w = Writer::start(c.addrs.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let l = leader_of(&c).await;
    sigterm(&mut c, l, "the leader");
    let log = c.log(l);
    assert!(log.contains("another server leads"), "the leader handed off:\n{log}");
    let l2 = leader_of(&c).await;
    assert_ne!(l2, l);
    c.spawn(l).unwrap();
    c.wait_caught_up(l, Duration::from_secs(30)).await.unwrap();

    let l = leader_of(&c).await;
    let f = (0..3).find(|i| *i != l).unwrap();
    sigterm(&mut c, f, "a follower");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (gap, writes) = w.finish().await;
    eprintln!("longest write gap {gap:?} over {writes} writes (bound {:?})", write_gap_bound());
    assert!(writes > 20, "the writer made progress: {writes}");
    assert!(gap <= write_gap_bound(), "a write gap of {gap:?} exceeds one election ({:?})", write_gap_bound());
    // The stopped servers never declared a node down nor campaigned after deciding to stop.
    for i in [l, f] {
        assert!(!c.log(i).contains("declaring node down"), "server {}:\n{}", i + 1, c.log(i));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_with_sigterm_fences_and_restarts_nothing() {
    let (mut c, addr) = cluster_with(3, &[]).await;
    let mut agent = AgentProc::new("node-a", &c.addrs, &fake_config(4, 0, 0), "");
    agent.start();
    wait_nodes(&addr, Duration::from_secs(30), "the agent registered", |n| ready_healthy(n, "node-a", 4)).await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let spec = serde_json::json!({
            "name": format!("long{i}"), "queue": "default",
            "groups": [{"name": "main", "replicas": 1,
                "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": 1000}},
                "task": {"command": "/bin/sh", "args": ["-c", "sleep 600"]}}]
        });
        ids.push(submit(&addr, &format!("long-{i}"), &spec).await);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let before = loop {
        let mut jobs = Vec::new();
        for id in &ids {
            jobs.push(job(&addr, *id).await);
        }
        if jobs.iter().all(|j| j.state == "running") {
            break jobs;
        }
        assert!(Instant::now() < deadline, "tasks running within 30 s: {jobs:#?}\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let w = Writer::start(c.addrs.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let l = leader_of(&c).await;
    for i in (0..3).filter(|i| *i != l).chain([l]) {
        sigterm(&mut c, i, if i == l { "the leader" } else { "a follower" });
        c.spawn(i).unwrap();
        c.wait_caught_up(i, Duration::from_secs(30)).await.unwrap();
    }
    // Longer than the agent's fence (TTL / 2) after the last restart.
    let ttl = Duration::from_millis(suanli_server::ServerConfig::default().heartbeat_ttl_ms);
    tokio::time::sleep(ttl / 2 + Duration::from_secs(1)).await;
    let (gap, writes) = w.finish().await;
    eprintln!("longest write gap {gap:?} over {writes} writes (bound {:?})", write_gap_bound());
    assert!(gap <= write_gap_bound(), "a write gap of {gap:?} exceeds one election ({:?})", write_gap_bound());

    let addr = c.addrs[leader_of(&c).await].clone();
    for b in &before {
        let a = job(&addr, b.id).await;
        assert_eq!(a.state, "running", "job {} after the rolling restart: {a:#?}", b.id);
        assert_eq!(a.attempt, b.attempt, "job {}: attempt changed", b.id);
        let ids = |j: &pb::JobInfo| j.allocs.iter().map(|x| (x.id, x.epoch, x.node.clone())).collect::<Vec<_>>();
        assert_eq!(ids(&a), ids(b), "job {}: allocations changed", b.id);
    }
    // The journal: one start per task, no stop (nothing fenced or restarted).
    let journal = agent.journal();
    assert_eq!(journal.len(), 4, "{journal:#?}");
    let nodes = wait_nodes(&addr, Duration::from_secs(5), "the node is ready", |n| ready_healthy(n, "node-a", 4)).await;
    assert_eq!(nodes.len(), 1);
    for i in 0..3 {
        assert!(!c.log(i).contains("declaring node down"), "server {}:\n{}", i + 1, c.log(i));
    }
    assert!(!agent.log().contains("fenced"), "{}", agent.log());
}
