//! Single calls that once bricked a cluster (issue 15), made through raw gRPC as a foreign
//! client would (the generated tonic clients, not the CLI), each on a 3-server cluster; after
//! each, and after a restart of every server, the cluster still serves reads and writes.
//!
//! Needs the workspace built (`cargo build --workspace`): `target/debug/suanli` with the
//! test-only failpoints the chaos crate asks for.

use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::internal_client::InternalClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_server::local::{ProcessCluster, channel};
use tonic::Code;

/// One cluster at a time: the machine has two cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const POISON: &str = r#"{"v":1,"kind":"from_the_future","ignorable":false,"body":{}}"#;

fn bin() -> std::path::PathBuf {
    suanli_chaos::cluster::default_bin().expect("the suanli binary (cargo build --workspace)")
}

fn small_timeouts() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("server.toml");
    std::fs::write(&cfg, "request_timeout_ms = 3000\n").expect("config");
    let path = cfg.to_str().expect("utf-8 path").to_owned();
    (dir, path)
}

/// Creates queue `q` (idempotent) and submits one job through server `i`'s client port:
/// the cluster takes writes. Retries while leadership settles (at most 30 s).
async fn writes(c: &ProcessCluster, i: usize, id: &str) -> Result<u64, tonic::Status> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = async {
            let ch = channel(&c.addrs[i]).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            let q = serde_json::json!({"id": "q", "nominal": {"cpu_milli": 100000}});
            QueuesClient::new(ch.clone()).upsert(pb::UpsertQueueRequest { queue_json: q.to_string() }).await?;
            let spec = serde_json::json!({
                "name": id, "queue": "q",
                "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": 100, "memory_mib": 64}}],
            });
            let req = pb::SubmitJobRequest {
                global: false,
                team: String::new(),
                client_request_id: id.into(),
                spec_json: spec.to_string(),
                retry: None,
            };
            Ok::<_, tonic::Status>(JobsClient::new(ch).submit(req).await?.into_inner().job_id)
        }
        .await;
        match r {
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) if s.code() == Code::DeadlineExceeded && Instant::now() < deadline => {}
            other => return other,
        }
    }
}

/// A linearizable read through server `i` (the job list).
async fn reads(c: &ProcessCluster, i: usize) -> Result<usize, tonic::Status> {
    let ch = channel(&c.addrs[i]).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let r = JobsClient::new(ch).list(pb::ListJobsRequest::default()).await?;
    Ok(r.into_inner().jobs.len())
}

/// Asserts that every server serves a write and a read, then restarts every server (SIGKILL,
/// start on the same data) and asserts it again.
async fn serves_before_and_after_a_full_restart(c: &mut ProcessCluster, tag: &str) {
    for i in 0..3 {
        writes(c, i, &format!("{tag}-before-{i}"))
            .await
            .unwrap_or_else(|s| panic!("write via {i}: {s:?}\n{}", c.log(i)));
        reads(c, i).await.unwrap_or_else(|s| panic!("read via {i}: {s:?}"));
    }
    for i in 0..3 {
        c.kill(i);
    }
    for i in 0..3 {
        c.spawn(i).expect("restart (returns once it listens again)");
    }
    c.wait_leader(Duration::from_secs(30)).await.expect("a leader after the restart");
    for i in 0..3 {
        writes(c, i, &format!("{tag}-after-{i}"))
            .await
            .unwrap_or_else(|s| panic!("write via {i} after restart: {s:?}\n{}", c.log(i)));
        let n = reads(c, i).await.unwrap_or_else(|s| panic!("read via {i} after restart: {s:?}"));
        assert!(n > 3 + i, "every acknowledged job is listed: {n}");
    }
}

/// `Internal.Propose` at `addr`: on a peer listener with the servers' own certificate (so the
/// server's checks answer, not the listener's), on a client listener as the admin.
async fn propose(c: &ProcessCluster, addr: &str, json: &str) -> Result<pb::ProposeResponse, tonic::Status> {
    let ch = if c.peer_addrs.iter().any(|p| p == addr) { c.peer_channel_to(addr) } else { c.channel_to(addr) };
    let ch = ch.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let req = pb::ProposeRequest { group: "region".into(), command_json: json.as_bytes().to_vec().into() };
    InternalClient::new(ch).propose(req).await.map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_command_never_reaches_the_log() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_d, cfg) = small_timeouts();
    let mut c = ProcessCluster::start(&bin(), 3, &["--config", &cfg]).expect("cluster");
    let l = c.wait_leader(Duration::from_secs(30)).await.expect("leader");
    // The client port does not serve the server-to-server service at all.
    let e = propose(&c, &c.addrs[l], POISON).await.expect_err("Internal is not on the client listener");
    // The authorization layer refuses a method the listener does not serve before routing.
    assert!(matches!(e.code(), Code::Unimplemented | Code::PermissionDenied), "{e:?}");
    // The peer port refuses what no server would forward: an unknown kind, a leader-only kind.
    let e = propose(&c, &c.peer_addrs[l], POISON).await.expect_err("unknown kinds are refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("from_the_future"), "{e:?}");
    let plan = r#"{"v":1,"kind":"apply_plan","ignorable":false,"body":{"plan":{},"now":1}}"#;
    let e = propose(&c, &c.peer_addrs[l], plan).await.expect_err("leader-only kinds are refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let batch = format!(r#"{{"v":1,"kind":"batch","ignorable":false,"body":{{"commands":[{POISON}]}}}}"#);
    let e = propose(&c, &c.peer_addrs[l], &batch).await.expect_err("inside a batch too");
    assert!(e.message().contains("commands[0]"), "{e:?}");
    serves_before_and_after_a_full_restart(&mut c, "poison").await;
}

async fn version(addr: &str) -> pb::VersionResponse {
    let ch = channel(addr).await.expect("connect");
    ClusterClient::new(ch).version(pb::VersionRequest {}).await.expect("version answers").into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_no_server_can_apply_halts_read_only_and_an_operator_skips_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_d, cfg) = small_timeouts();
    // The failpoint lets the leader commit what it would refuse: as a newer build's leader
    // would commit a kind this build does not know.
    let env = [("SUANLI_FAILPOINTS", "server::forward-unchecked=return")];
    let mut c = ProcessCluster::start_env(&bin(), 3, &["--config", &cfg], &env).expect("cluster");
    let l = c.wait_leader(Duration::from_secs(30)).await.expect("leader");
    writes(&c, l, "before").await.expect("writes before");
    let r = propose(&c, &c.peer_addrs[l], POISON).await.expect("committed (the failpoint lets it through)");
    let halted: serde_json::Value = serde_json::from_slice(&r.response_json).expect("json");
    assert_eq!(halted["result"], "halted", "{halted}");
    let at = r.index;

    let check_halted = async |c: &ProcessCluster| {
        for i in 0..3 {
            let deadline = Instant::now() + Duration::from_secs(20);
            let v = loop {
                let v = version(&c.addrs[i]).await;
                if v.halt.is_some() || Instant::now() > deadline {
                    break v;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            let h = v.halt.unwrap_or_else(|| panic!("server {i} halted\n{}", c.log(i)));
            assert_eq!((h.index, h.kind.as_str()), (at, "from_the_future"), "{h:?}");
            assert!(h.reason.contains("not ignorable") && h.reason.contains("suanli "), "{h:?}");
            // Up, read-only: reads are served, writes refused naming the entry.
            assert_eq!(reads(c, i).await.expect("reads while halted"), 1);
            let e = writes(c, i, &format!("halted-{i}")).await.expect_err("writes refused while halted");
            assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
            assert!(e.message().contains(&format!("entry {at}")), "{e:?}");
        }
    };
    check_halted(&c).await;
    // A restart does not brick it: every server comes back up, halted at the same entry.
    for i in 0..3 {
        c.kill(i);
        c.spawn(i).expect("restart (returns once it listens again)");
    }
    c.wait_leader(Duration::from_secs(30)).await.expect("a leader after the restart");
    check_halted(&c).await;
    // The operator's way out, through any server.
    let f = (l + 1) % 3;
    let ch = channel(&c.addrs[f]).await.expect("connect");
    let e = ClusterClient::new(ch.clone())
        .skip_entry(pb::SkipEntryRequest { index: at + 1, kind: "from_the_future".into() })
        .await
        .expect_err("only the halted entry can be skipped");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = ClusterClient::new(ch.clone())
            .skip_entry(pb::SkipEntryRequest { index: at, kind: "from_the_future".into() })
            .await;
        match r {
            Ok(_) => break,
            Err(e) if e.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("skip: {e:?}\n{}", c.log(f)),
        }
    }
    for i in 0..3 {
        let deadline = Instant::now() + Duration::from_secs(20);
        while version(&c.addrs[i]).await.halt.is_some() {
            assert!(Instant::now() < deadline, "server {i} applies again");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    serves_before_and_after_a_full_restart(&mut c, "skipped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_an_unreachable_server_is_refused_in_bounded_time_and_changes_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_d, cfg) = small_timeouts();
    let mut c = ProcessCluster::start(&bin(), 3, &["--config", &cfg]).expect("cluster");
    let l = c.wait_leader(Duration::from_secs(30)).await.expect("leader");
    let f = (l + 1) % 3;
    for via in [l, f] {
        let ch = channel(&c.addrs[via]).await.expect("connect");
        let t = Instant::now();
        let e = ClusterClient::new(ch.clone())
            .add_server(pb::AddServerRequest {
                id: 99,
                addr: "127.0.0.1:9".into(),
                learner_only: false,
                peer_addr: String::new(),
            })
            .await
            .expect_err("an unreachable server never catches up");
        assert!(t.elapsed() < Duration::from_secs(10), "bounded by the request timeout: {:?}", t.elapsed());
        assert!(matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded), "{e:?}");
        assert!(e.message().contains("99"), "{e:?}");
        let m = ClusterClient::new(ch.clone()).members(pb::MembersRequest {}).await.expect("members").into_inner();
        assert_eq!(m.members.len(), 3, "server 99 was removed again: {m:?}");
        assert!(m.members.iter().all(|m| m.voter));
        let e = ClusterClient::new(ch).remove_server(pb::RemoveServerRequest { id: 99 }).await.expect_err("gone");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        writes(&c, via, &format!("after-add-{via}")).await.expect("writes after the refused add");
    }
    // Bad addresses are refused before anything changes.
    let ch = channel(&c.addrs[l]).await.expect("connect");
    let e = ClusterClient::new(ch)
        .add_server(pb::AddServerRequest {
            id: 98,
            addr: "x".repeat(1 << 20),
            learner_only: true,
            peer_addr: String::new(),
        })
        .await
        .expect_err("not host:port");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().len() < 1024, "the error quotes a bounded prefix: {} bytes", e.message().len());
    serves_before_and_after_a_full_restart(&mut c, "add").await;
}

/// A job at the job-spec limits: 60 task groups, each task with ~62 KB of args, ~3.7 MB in all.
fn large_job(i: usize) -> String {
    let args: Vec<String> = (0..62).map(|k| format!("{i}-{k}-{}", "a".repeat(994))).collect();
    let groups: Vec<_> = (0..60)
        .map(|g| {
            serde_json::json!({"name": format!("g{g}"), "replicas": 1,
                "resources": {"cpu_milli": 1, "memory_mib": 1},
                "task": {"command": "true", "args": args}})
        })
        .collect();
    serde_json::json!({"name": format!("large-{i}"), "queue": "q", "groups": groups}).to_string()
}

/// Lists every job through server `i` page by page, as a client with gRPC's default 4 MiB
/// receive limit; returns the ids.
async fn list_all(c: &ProcessCluster, i: usize) -> Vec<u64> {
    let ch = channel(&c.addrs[i]).await.expect("connect");
    let mut jobs = JobsClient::new(ch).max_decoding_message_size(4 << 20);
    let (mut ids, mut after) = (Vec::new(), 0);
    loop {
        let r = jobs
            .list(pb::ListJobsRequest { after_id: after, ..Default::default() })
            .await
            .unwrap_or_else(|s| panic!("a page through {i}: {s:?}"))
            .into_inner();
        ids.extend(r.jobs.iter().map(|j| j.id));
        if r.next_after_id == 0 {
            return ids;
        }
        after = r.next_after_id;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_jobs_at_the_limits_never_break_listing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_d, cfg) = small_timeouts();
    let mut c = ProcessCluster::start(&bin(), 3, &["--config", &cfg]).expect("cluster");
    let l = c.wait_leader(Duration::from_secs(30)).await.expect("leader");
    writes(&c, l, "small").await.expect("queue q and one job");
    let ch = channel(&c.addrs[l]).await.expect("connect");
    let mut jobs = JobsClient::new(ch);
    for i in 0..5 {
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: format!("large-{i}"),
            spec_json: large_job(i),
            retry: None,
        };
        jobs.submit(req).await.unwrap_or_else(|s| panic!("large job {i} is within the limits: {s:?}"));
    }
    for i in 0..3 {
        assert_eq!(list_all(&c, i).await.len(), 6, "every job listed through server {i}");
    }
    serves_before_and_after_a_full_restart(&mut c, "lists").await;
    for i in 0..3 {
        assert!(list_all(&c, i).await.len() >= 12, "still listed after the restart");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_holding_every_watch_slot_leaves_agents_theirs() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("server.toml");
    std::fs::write(&cfg, "request_timeout_ms = 3000\nmax_client_watchers = 6\nmax_watchers_per_connection = 2\n")
        .expect("config");
    let mut c = ProcessCluster::start(&bin(), 3, &["--config", cfg.to_str().expect("utf-8")]).expect("cluster");
    let l = c.wait_leader(Duration::from_secs(30)).await.expect("leader");
    writes(&c, l, "w").await.expect("writes");
    let node = serde_json::json!({"id": "n1", "pool": "cpu", "cpu_milli": 8000, "memory_mib": 16000});
    let req =
        pb::RegisterNodeRequest { node_json: node.to_string(), agent_version: "test".into(), ..Default::default() };
    // As node n1's agent (its certificate): an agent reports for its own node only.
    let n1 = suanli_server::local::LocalPki::get().node("n1");
    let ch = suanli_server::local::channel_as(&c.addrs[l], &n1).await.expect("connect");
    suanli_proto::v1::agent_client::AgentClient::new(ch).register(req).await.expect("register");
    for i in 0..3 {
        // A foreign client takes every client slot of server i, connection after connection.
        let mut held = Vec::new();
        for _ in 0..4 {
            let mut jobs = JobsClient::new(channel(&c.addrs[i]).await.expect("connect"));
            loop {
                match jobs.watch(pb::WatchJobsRequest::default()).await {
                    Ok(s) => held.push(s.into_inner()),
                    Err(s) => {
                        assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                        break;
                    }
                }
            }
        }
        assert_eq!(held.len(), 6, "the client pool of server {i} is full");
        // An agent's watch of its node still opens on that server, and the server serves.
        let ch = suanli_server::local::channel_as(&c.addrs[i], &n1).await.expect("connect");
        let mut agent = suanli_proto::v1::agent_client::AgentClient::new(ch);
        // (A follower may not have applied the node's registration yet: NOT_FOUND until it has.)
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut s = loop {
            let req = pb::WatchAllocationsRequest { node_id: "n1".into(), from_revision: 0 };
            match agent.watch_allocations(req).await {
                Ok(s) => break s.into_inner(),
                Err(e) if e.code() == Code::NotFound && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("an agent's watch opens while clients hold theirs: {e:?}"),
            }
        };
        let first = tokio::time::timeout(Duration::from_secs(10), s.message()).await.expect("in time");
        assert!(first.expect("a first update").is_some());
        writes(&c, i, &format!("while-held-{i}")).await.expect("writes while the client slots are held");
    }
    serves_before_and_after_a_full_restart(&mut c, "watch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_user_wrote_is_never_silently_dropped() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_d, cfg) = small_timeouts();
    let mut c = ProcessCluster::start(&bin(), 3, &["--config", &cfg]).expect("cluster");
    let l = c.wait_leader(Duration::from_secs(30)).await.expect("leader");
    writes(&c, l, "w").await.expect("writes");
    for i in 0..3 {
        let ch = channel(&c.addrs[i]).await.expect("connect");
        for (field, spec) in [
            ("replica", r#"{"name":"x","queue":"q","groups":[{"name":"g","replica":2,"resources":{"cpu_milli":1}}]}"#),
            ("gpus", r#"{"name":"x","queue":"q","groups":[{"name":"g","resources":{"cpu_milli":1,"gpus":4}}]}"#),
        ] {
            let req = pb::SubmitJobRequest {
                global: false,
                team: String::new(),
                client_request_id: format!("typo-{i}-{field}"),
                spec_json: spec.into(),
                retry: None,
            };
            let e = JobsClient::new(ch.clone()).submit(req).await.expect_err("an unknown field is refused");
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains(field), "names the field: {e:?}");
        }
        let q = r#"{"id":"q2","weigth":3}"#;
        let e = QueuesClient::new(ch.clone())
            .upsert(pb::UpsertQueueRequest { queue_json: q.into() })
            .await
            .expect_err("a queue's unknown field is refused");
        assert!(e.message().contains("weigth"), "{e:?}");
    }
    serves_before_and_after_a_full_restart(&mut c, "strict").await;
}
