//! End to end, on three real `suanli server` processes (loopback, RocksDB in temp dirs):
//! 1,000 submissions while the leader is SIGKILLed mid-stream; every acknowledged job on every
//! surviving server, no duplicates from retried submissions, the killed server catches up; then
//! all three killed and started again, and every job, queue, node and allocation is back.

#![allow(clippy::unwrap_used)]

use suanli_tests as common;

use common::{ProcessCluster, all_jobs, channel, cpu_job, jobs_client};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_proto::v1::queues_client::QueuesClient;
use tokio::sync::Mutex;

const JOBS: usize = 1000;
const WORKERS: usize = 16;

/// Submits with request id `rid` until some server acknowledges it; returns (job id, created).
async fn submit_until_acked(addrs: &[String], start: usize, rid: &str, spec: &str) -> (u64, bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut k = start;
    loop {
        let addr = &addrs[k % addrs.len()];
        k += 1;
        if let Ok(mut c) = jobs_client(addr).await {
            let req = pb::SubmitJobRequest {
                global: false,
                team: String::new(),
                client_request_id: rid.into(),
                spec_json: spec.into(),
                retry: None,
            };
            match c.submit(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    return (r.job_id, r.created);
                }
                Err(s) => {
                    assert!(
                        !matches!(s.code(), tonic::Code::InvalidArgument | tonic::Code::NotFound),
                        "submission refused: {s:?}"
                    );
                }
            }
        }
        assert!(Instant::now() < deadline, "submission {rid} not acknowledged within 60 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Everything that must survive a full restart, read linearizably from `addr`.
async fn digest(c: &ProcessCluster, i: usize) -> (Vec<pb::JobInfo>, Vec<pb::QueueInfo>, Vec<pb::NodeInfo>) {
    let addr = &c.addrs[i];
    let fail = |what: &str, e: &dyn std::fmt::Debug| -> ! {
        panic!("{what} from server {}: {e:?}\n--- its log:\n{}", i + 1, c.log(i))
    };
    let jobs = all_jobs(addr, false).await.unwrap_or_else(|e| fail("jobs", &e));
    let ch = channel(addr).await.unwrap_or_else(|e| fail("connect", &e));
    let queues = QueuesClient::new(ch.clone())
        .list(pb::ListQueuesRequest { stale: false, ..Default::default() })
        .await
        .unwrap_or_else(|e| fail("queues", &e))
        .into_inner();
    let nodes = NodesClient::new(ch)
        .list(pb::ListNodesRequest { pool: String::new(), stale: false, ..Default::default() })
        .await
        .unwrap_or_else(|e| fail("nodes", &e));
    (jobs, queues.queues, nodes.into_inner().nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_killed_mid_stream_then_full_restart() {
    let mut c = common::start(3, &["--heartbeat-ttl-ms", "600000"]);
    let leader = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let ch = channel(&c.addrs[leader]).await.unwrap();
    let queue = serde_json::json!({"id": "team-a", "nominal": {"cpu_milli": u64::MAX, "memory_mib": u64::MAX,
        "gpu_milli": u64::MAX, "npu_milli": u64::MAX}});
    QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: queue.to_string() }).await.unwrap();
    for n in 0..2 {
        let id = format!("node-{n}");
        let node = serde_json::json!({"id": id, "pool": "cpu", "cpu_milli": 1_000_000u64,
            "memory_mib": 4_000_000u64});
        let req =
            pb::RegisterNodeRequest { node_json: node.to_string(), agent_version: "e2e".into(), ..Default::default() };
        // Registration is for the node's own agent (its certificate), not the admin.
        let files = suanli_server::local::LocalPki::get().node(&id);
        let as_node = suanli_server::local::channel_as(&c.addrs[leader], &files);
        AgentClient::new(as_node.await.unwrap()).register(req).await.unwrap();
    }

    // 1,000 submissions from 16 concurrent clients that retry with the same request id.
    let next = Arc::new(AtomicUsize::new(0));
    let acked: Arc<Mutex<BTreeMap<String, (u64, bool)>>> = Arc::default();
    let addrs = Arc::new(c.addrs.clone());
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (next, acked, addrs) = (next.clone(), acked.clone(), addrs.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= JOBS {
                    return;
                }
                let rid = format!("e2e-{i}");
                let r = submit_until_acked(&addrs, w + i, &rid, &cpu_job(&rid, "team-a", 100)).await;
                acked.lock().await.insert(rid, r);
            }
        }));
    }
    while acked.lock().await.len() < JOBS / 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let killed = c.wait_leader(Duration::from_secs(5)).await.unwrap();
    let kill_at = Instant::now();
    c.kill(killed);
    let survivors: Vec<String> = c.alive().into_iter().map(|i| c.addrs[i].clone()).collect();
    let probe = submit_until_acked(&survivors, 0, "e2e-probe", &cpu_job("probe", "team-a", 100)).await;
    let failover = kill_at.elapsed();
    println!("leader {} SIGKILLed after {} acks; writes served again after {failover:?}", killed + 1, JOBS / 3);
    assert!(failover < Duration::from_secs(5), "failover took {failover:?}");
    for w in workers {
        w.await.unwrap();
    }
    let mut acked = acked.lock().await.clone();
    acked.insert("e2e-probe".into(), probe);
    let retried = acked.values().filter(|(_, created)| !created).count();
    println!("{} submissions acknowledged; {retried} were answered as retries of a committed submission", acked.len());

    // Every acknowledged job on every surviving server, exactly once.
    let want: BTreeMap<u64, String> = acked.iter().map(|(rid, (id, _))| (*id, rid.clone())).collect();
    assert_eq!(want.len(), acked.len(), "two request ids were given the same job");
    for addr in &survivors {
        let jobs = all_jobs(addr, false).await.unwrap();
        let got: BTreeMap<u64, String> = jobs.iter().map(|j| (j.id, j.client_request_id.clone())).collect();
        assert_eq!(got, want, "server {addr} disagrees with the acknowledged submissions (or holds duplicates)");
    }

    // The killed server restarts and catches up.
    c.spawn(killed).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = all_jobs(&c.addrs[killed], true).await.map(|j| j.len()).unwrap_or(0);
        if n == want.len() {
            break;
        }
        assert!(Instant::now() < deadline, "restarted server has {n} of {} jobs\n{}", want.len(), c.log(killed));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Let the scheduler place everything, then stop all three and start them again.
    let leader = c.wait_leader(Duration::from_secs(10)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let jobs = all_jobs(&c.addrs[leader], false).await.unwrap();
        let pending = jobs.iter().filter(|j| j.state == "pending").count();
        if pending == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{pending} jobs still pending");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = digest(&c, leader).await;
    let allocs: BTreeSet<u64> = before.0.iter().flat_map(|j| j.allocs.iter().map(|a| a.id)).collect();
    assert!(allocs.len() >= JOBS, "expected every job placed, got {} allocations", allocs.len());
    for i in 0..3 {
        c.kill(i);
    }
    for i in 0..3 {
        c.spawn(i).unwrap();
    }
    let leader = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let after = digest(&c, leader).await;
    assert_eq!(after.0.len(), before.0.len(), "jobs after restart");
    assert_eq!(after, before, "state after a full restart differs");
    println!(
        "full restart: {} jobs, {} queues, {} nodes, {} allocations back",
        after.0.len(),
        after.1.len(),
        after.2.len(),
        allocs.len()
    );
}
