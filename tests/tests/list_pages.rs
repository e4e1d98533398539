//! Lists page, bounded in count and in bytes, against a real `suanli server` process: jobs as
//! large as the job-spec limits allow list in pages a default gRPC client accepts (five of them
//! used to make one 22 MB reply, refused as OUT_OF_RANGE, for good), and queues, pools, nodes
//! and jobs come back exactly once across pages however small the pages are.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use suanli_tests as common;

use common::{channel, cpu_job};
use prost::Message;
use std::collections::BTreeSet;
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_proto::v1::pools_client::PoolsClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_server::config::DEFAULT_MAX_LIST_BYTES;
use tonic::transport::Channel;

/// What gRPC clients left at their defaults accept in one message (tonic, grpc-go, grpc-java).
const DEFAULT_CLIENT_LIMIT: usize = 4 * 1024 * 1024;

/// Runs `suanli ARGS --server ADDR --output json`, which must succeed; the printed array.
fn cli_list(addr: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let o = suanli_tests::cli()
        .args(args)
        .args(["--server", addr, "--output", "json"])
        .env_remove("SUANLI_ADDR")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "suanli {args:?} failed ({:?}): {out}{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    match serde_json::from_str(&out) {
        Ok(serde_json::Value::Array(v)) => v,
        other => panic!("suanli {args:?} printed no JSON array ({other:?}): {out}"),
    }
}

/// One server (extra flags `extra`) with queue `q`: the cluster (stops when dropped), its
/// address and a channel to it.
async fn one_server(extra: &[&str]) -> (common::ProcessCluster, String, Channel) {
    let c = common::start(1, extra);
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let addr = c.addrs[0].clone();
    let ch = channel(&addr).await.unwrap();
    let queue = serde_json::json!({"id": "q", "nominal": {"cpu_milli": 64000, "memory_mib": 256000}});
    QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: queue.to_string() }).await.unwrap();
    (c, addr, ch)
}

/// Every page of a list, asked for with `limit`: `list(token, limit)` answers the page's
/// encoded size, its items' keys and the next token. Checks that each page holds at most
/// `limit` items and at most `max_bytes` of them (unless alone), and that every key comes once.
async fn pages<K, F, Fut>(limit: u32, max_bytes: usize, mut list: F) -> Vec<Vec<K>>
where
    K: Ord + Clone + Default + std::fmt::Debug,
    F: FnMut(K, u32) -> Fut,
    Fut: std::future::Future<Output = (usize, Vec<K>, K)>,
{
    let mut out: Vec<Vec<K>> = Vec::new();
    let mut after = K::default();
    loop {
        let (bytes, keys, next) = list(after.clone(), limit).await;
        assert!(limit == 0 || keys.len() <= limit as usize, "{} items on a page of {limit}", keys.len());
        assert!(keys.len() == 1 || bytes <= max_bytes + 512, "a page of {bytes} bytes over {max_bytes}");
        assert!(!keys.is_empty(), "an empty page before the end (token {after:?})");
        out.push(keys);
        if next == K::default() {
            break;
        }
        assert!(next > after, "the token {next:?} does not advance past {after:?}");
        after = next;
    }
    let all: Vec<K> = out.iter().flatten().cloned().collect();
    let unique: BTreeSet<K> = all.iter().cloned().collect();
    assert_eq!(unique.len(), all.len(), "an item came twice: {out:?}");
    assert!(all.windows(2).all(|w| w[0] < w[1]), "out of order: {out:?}");
    out
}

/// A job at the job-spec limits: 60 task groups, each task with ~62 KB of args (the limit is
/// 64 KiB per task), ~3.7 MB of spec in all (the request limit is 4 MiB).
fn large_job(i: usize) -> (String, Vec<String>) {
    let args: Vec<String> = (0..62).map(|k| format!("{i}-{k}-{}", "a".repeat(994))).collect();
    let groups: Vec<_> = (0..60)
        .map(|g| {
            serde_json::json!({"name": format!("g{g}"), "replicas": 1,
                "resources": {"cpu_milli": 1, "memory_mib": 1},
                "task": {"command": "true", "args": args}})
        })
        .collect();
    let spec = serde_json::json!({"name": format!("large-{i}"), "queue": "q", "groups": groups}).to_string();
    (spec, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_jobs_at_the_spec_limits_list_in_pages_a_default_client_accepts() {
    let (_c, addr, ch) = one_server(&[]).await;
    // A foreign client: the generated stub with its defaults (it accepts 4 MiB per reply).
    let mut jobs = JobsClient::new(ch.clone());
    let mut submitted = Vec::new();
    for i in 0..5 {
        let (spec, args) = large_job(i);
        assert!((3_600_000..4_000_000).contains(&spec.len()), "{} bytes", spec.len());
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: format!("large-{i}"),
            spec_json: spec,
            retry: None,
        };
        let r = jobs.submit(req).await.unwrap().into_inner();
        submitted.push((r.job_id, args));
    }
    let ids: Vec<u64> = submitted.iter().map(|(id, _)| *id).collect();

    for limit in [0, 2, 1] {
        let pages = pages(limit, DEFAULT_MAX_LIST_BYTES, |after_id, limit| {
            let mut jobs = jobs.clone();
            async move {
                let req = pb::ListJobsRequest { limit, after_id, ..Default::default() };
                let r = jobs.list(req).await.unwrap_or_else(|s| panic!("list after {after_id}: {s:?}")).into_inner();
                assert!(r.encoded_len() <= DEFAULT_CLIENT_LIMIT);
                for j in &r.jobs {
                    assert!(j.summary && j.spec_json.is_empty(), "not a summary: {}", j.spec_json.len());
                    assert_eq!(j.omitted_allocs, 0);
                }
                (r.encoded_len(), r.jobs.iter().map(|j| j.id).collect(), r.next_after_id)
            }
        })
        .await;
        assert_eq!(pages.concat(), ids, "limit {limit}: {pages:?}");
    }

    // Get answers the whole job: its spec as submitted.
    for (id, args) in &submitted {
        let j = jobs.get(pb::GetJobRequest { job_id: *id, stale: false }).await.unwrap().into_inner();
        assert!(!j.summary);
        let spec: serde_json::Value = serde_json::from_str(&j.spec_json).unwrap();
        let groups = spec["groups"].as_array().unwrap();
        assert_eq!(groups.len(), 60);
        for g in groups {
            assert_eq!(g["task"]["args"], serde_json::json!(args));
        }
    }

    // And `suanli job list` shows them all.
    let listed = cli_list(&addr, &["job", "list"]);
    let got: Vec<u64> = listed.iter().map(|j| j["id"].as_u64().unwrap()).collect();
    assert_eq!(got, ids);
    assert!(listed.iter().all(|j| j["spec"].is_null()), "a summary printed a spec");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_pools_nodes_and_jobs_come_back_once_across_small_pages() {
    // Pages of at most 7 items and 1 KiB: both bounds end pages below.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("server.toml");
    std::fs::write(&config, "max_list = 7\nmax_list_bytes = 1024\n").unwrap();
    let config = config.display().to_string();
    let (_c, addr, ch) = one_server(&["--config", &config, "--heartbeat-ttl-ms", "600000"]).await;
    let max_bytes = 1024;

    let mut queues: Vec<String> = vec!["q".into()];
    for i in 0..24 {
        let id = format!("team-{i:02}");
        let q = serde_json::json!({"id": id, "team": "x".repeat(60), "nominal": {"cpu_milli": 1000}});
        QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: q.to_string() }).await.unwrap();
        queues.push(id);
    }
    queues.sort();
    let mut nodes = Vec::new();
    for i in 0..30 {
        let id = format!("node-{i:02}");
        let node = serde_json::json!({"id": id, "pool": format!("pool-{}", i % 6), "cpu_milli": 64000,
            "memory_mib": 256000, "labels": {"rack": format!("r{i}")}});
        let req =
            pb::RegisterNodeRequest { node_json: node.to_string(), agent_version: "test".into(), ..Default::default() };
        // Registration is for the node's own agent (its certificate), not the admin.
        let files = suanli_server::local::LocalPki::get().node(&id);
        let as_node = suanli_server::local::channel_as(&addr, &files);
        AgentClient::new(as_node.await.unwrap()).register(req).await.unwrap();
        nodes.push(id);
    }
    let pools: Vec<String> = (0..6).map(|p| format!("pool-{p}")).collect();
    let mut jobs = Vec::new();
    for i in 0..20 {
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: format!("small-{i}"),
            spec_json: cpu_job(&format!("small-{i}-{}", "n".repeat(100)), "q", 100),
            retry: None,
        };
        jobs.push(JobsClient::new(ch.clone()).submit(req).await.unwrap().into_inner().job_id);
    }

    for limit in [0, 1, 3, 100] {
        let q = pages(limit, max_bytes, |after, limit| {
            let mut c = QueuesClient::new(ch.clone());
            async move {
                let r = c.list(pb::ListQueuesRequest { stale: false, limit, after }).await.unwrap().into_inner();
                (r.encoded_len(), r.queues.into_iter().map(|q| q.id).collect(), r.next_after)
            }
        })
        .await;
        assert_eq!(q.concat(), queues, "queues, limit {limit}: {q:?}");

        let n = pages(limit, max_bytes, |after, limit| {
            let mut c = NodesClient::new(ch.clone());
            async move {
                let r = c.list(pb::ListNodesRequest { limit, after, ..Default::default() }).await.unwrap().into_inner();
                (r.encoded_len(), r.nodes.into_iter().map(|n| n.id).collect(), r.next_after)
            }
        })
        .await;
        assert_eq!(n.concat(), nodes, "nodes, limit {limit}: {n:?}");
        // More than max_list (7) nodes: a token, no longer a silent stop.
        assert!(n.len() >= 5, "{n:?}");

        let p = pages(limit, max_bytes, |after, limit| {
            let mut c = PoolsClient::new(ch.clone());
            async move {
                let r = c.list(pb::ListPoolsRequest { stale: false, limit, after }).await.unwrap().into_inner();
                (r.encoded_len(), r.pools.into_iter().map(|p| p.name).collect(), r.next_after)
            }
        })
        .await;
        assert_eq!(p.concat(), pools, "pools, limit {limit}: {p:?}");

        let j = pages(limit, max_bytes, |after_id, limit| {
            let mut c = JobsClient::new(ch.clone());
            async move {
                let req = pb::ListJobsRequest { limit, after_id, ..Default::default() };
                let r = c.list(req).await.unwrap().into_inner();
                (r.encoded_len(), r.jobs.into_iter().map(|j| j.id).collect(), r.next_after_id)
            }
        })
        .await;
        assert_eq!(j.concat(), jobs, "jobs, limit {limit}: {j:?}");
        if limit == 100 {
            // The byte bound alone ends these pages.
            assert!(n.len() > 1 && j.len() > 1 && q.len() > 1, "{n:?} {j:?} {q:?}");
        }
    }

    // A pool filter pages the same way.
    let in_pool = pages(2, max_bytes, |after, limit| {
        let mut c = NodesClient::new(ch.clone());
        async move {
            let req = pb::ListNodesRequest { pool: "pool-1".into(), limit, after, ..Default::default() };
            let r = c.list(req).await.unwrap().into_inner();
            assert!(r.nodes.iter().all(|n| n.pool == "pool-1"));
            (r.encoded_len(), r.nodes.into_iter().map(|n| n.id).collect(), r.next_after)
        }
    })
    .await;
    assert_eq!(in_pool.concat(), ["node-01", "node-07", "node-13", "node-19", "node-25"]);

    // The CLI follows the pages of every list.
    let ids = |v: Vec<serde_json::Value>, key: &str| -> Vec<String> {
        v.iter().map(|x| x[key].as_str().map_or_else(|| x[key].to_string(), str::to_owned)).collect()
    };
    assert_eq!(ids(cli_list(&addr, &["queue", "list"]), "id"), queues);
    assert_eq!(ids(cli_list(&addr, &["node", "list"]), "id"), nodes);
    assert_eq!(ids(cli_list(&addr, &["pool", "list"]), "name"), pools);
    let listed: Vec<u64> = cli_list(&addr, &["job", "list"]).iter().map(|j| j["id"].as_u64().unwrap()).collect();
    assert_eq!(listed, jobs);
    let some: Vec<u64> =
        cli_list(&addr, &["job", "list", "--limit", "9"]).iter().map(|j| j["id"].as_u64().unwrap()).collect();
    assert_eq!(some, jobs[..9]);
}
