//! Storage integrity, backup, restore and disaster recovery on real `suanli server` processes
//! (RocksDB in temp dirs) and a real `suanli agent` with the fake device plugin.
//!
//! - A follower whose WAL has flipped bytes, then one whose WAL is cut in half, refuses to
//!   start (exit non-zero, naming its data dir, what was found and the runbook) while the other
//!   two keep serving without losing an acknowledged write.
//! - `cluster backup` through a follower while a client writes; `cluster restore` into a new
//!   data dir; a one-server cluster starts from it (new cluster id, the jobs and their states),
//!   two servers join it.
//! - An agent that ran tasks for the old cluster, pointed at the restored one, moves the old
//!   cluster's allocation dirs aside and runs the new cluster's allocations (whose ids repeat
//!   the old ones').
//! - Recovery from a lost quorum: `cluster restore --from-data-dir` of the one surviving server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use suanli_tests as common;
use suanli_tests as support;

use common::{ProcessCluster, all_jobs, channel, cpu_job};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::queues_client::QueuesClient;

const WAIT: Duration = Duration::from_secs(30);

fn bin() -> PathBuf {
    suanli_tests::bin()
}

/// Runs `suanli ARGS`; its stdout, or a panic with its stderr.
fn cli(args: &[&str]) -> String {
    let out = suanli_tests::cli().args(args).output().unwrap();
    assert!(out.status.success(), "suanli {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn queue(addr: &str) {
    let q = serde_json::json!({"id": "q", "nominal": {"cpu_milli": 1_000_000}});
    QueuesClient::new(channel(addr).await.unwrap())
        .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
        .await
        .unwrap();
}

/// Submits jobs `from..to` (request ids `{tag}-{i}`), retrying UNAVAILABLE; their ids.
async fn submit_range(addr: &str, tag: &str, from: usize, to: usize) -> Vec<u64> {
    let c = JobsClient::new(channel(addr).await.unwrap());
    let mut ids = Vec::new();
    for i in from..to {
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: format!("{tag}-{i}"),
            spec_json: cpu_job(&format!("{tag}{i}"), "q", 10),
            retry: None,
        };
        let r = common::RETRY
            .retry(
                || {
                    let mut c = c.clone();
                    let req = req.clone();
                    async move { c.submit(req).await }
                },
                |s: &tonic::Status| s.code() == tonic::Code::Unavailable,
                |_, _| {},
            )
            .await;
        match r {
            Ok(r) => ids.push(r.into_inner().job_id),
            Err(s) => panic!("submitting {tag}-{i}: {s:?}"),
        }
    }
    ids
}

async fn members(addr: &str) -> pb::MembersResponse {
    ClusterClient::new(channel(addr).await.unwrap()).members(pb::MembersRequest {}).await.unwrap().into_inner()
}

/// The cluster id a server reports, once it has one.
async fn cluster_id(addr: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let id = members(addr).await.cluster_id;
        if !id.is_empty() {
            return id;
        }
        assert!(Instant::now() < deadline, "{addr} has no cluster id within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The WAL files of a RocksDB data dir (`*.log`; RocksDB's own text log is `LOG`).
fn wal_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    v.sort_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0));
    v
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Restarts server `i` on its damaged dir and asserts it refuses: non-zero exit, a message
/// naming the dir, `expect` and the runbook. Returns the new part of its log.
fn assert_refused(c: &mut ProcessCluster, i: usize, expect: &[&str]) -> String {
    let before = c.log(i).len();
    c.spawn(i).unwrap();
    let st = c.wait_exit(i, WAIT).unwrap_or_else(|| panic!("server {} started on a damaged log:\n{}", i + 1, c.log(i)));
    assert!(!st.success(), "server {} exited 0", i + 1);
    let log = c.log(i)[before..].to_owned();
    let dir = c.data_dir(i).display().to_string();
    assert!(log.contains("is damaged") && log.contains(&dir), "no message naming {dir}:\n{log}");
    assert!(log.contains("Corruption: a server refuses to start"), "no runbook named:\n{log}");
    assert!(expect.iter().any(|e| log.contains(e)), "none of {expect:?} in:\n{log}");
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_wal_is_refused_and_the_others_keep_serving() {
    let mut c = ProcessCluster::start(&bin(), 3, &[]).unwrap();
    let leader = c.wait_leader(WAIT).await.unwrap();
    let addr = c.addrs[leader].clone();
    queue(&addr).await;
    let mut acked = submit_range(&addr, "w", 0, 60).await;
    let victim = (leader + 1) % 3;
    c.wait_caught_up(victim, WAIT).await.unwrap();
    c.kill(victim);
    let dir = c.data_dir(victim);
    let keep = tempfile::tempdir().unwrap();
    copy_dir(&dir, keep.path());

    // Flipped bytes in the middle of the WAL.
    let wal = wal_files(&dir).pop().expect("a WAL file");
    let mut bytes = std::fs::read(&wal).unwrap();
    assert!(bytes.len() > 4096, "the WAL holds the writes: {} bytes", bytes.len());
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 8] {
        *b ^= 0xff;
    }
    std::fs::write(&wal, &bytes).unwrap();
    assert_refused(&mut c, victim, &["RocksDB refused to recover it", "went back"]);

    // The other two serve, and lose nothing acknowledged.
    let survivors = c.alive_addrs();
    acked.extend(submit_range(&survivors[0], "w", 60, 80).await);
    for a in &survivors {
        let jobs = all_jobs(a, false).await.unwrap();
        let have: std::collections::BTreeSet<u64> = jobs.iter().map(|j| j.id).collect();
        assert!(acked.iter().all(|id| have.contains(id)), "{a} lost acknowledged jobs");
    }

    // The WAL cut in half (what a disk that lost its tail leaves): refused too.
    std::fs::remove_dir_all(&dir).unwrap();
    copy_dir(keep.path(), &dir);
    let wal = wal_files(&dir).pop().unwrap();
    let len = std::fs::metadata(&wal).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&wal).unwrap().set_len(len / 2).unwrap();
    assert_refused(&mut c, victim, &["went back", "RocksDB refused to recover it", "was committed here"]);

    // The pristine copy starts and catches up: the refusals were about the damage only.
    std::fs::remove_dir_all(&dir).unwrap();
    copy_dir(keep.path(), &dir);
    c.spawn(victim).unwrap();
    c.wait_caught_up(victim, WAIT).await.unwrap();
    assert_eq!(all_jobs(&c.addrs[victim], true).await.unwrap().len(), acked.len());
}

/// Jobs by id with their states, as `addr` serves them.
async fn job_states(addr: &str, stale: bool) -> BTreeMap<u64, String> {
    all_jobs(addr, stale).await.unwrap().into_iter().map(|j| (j.id, j.state)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_through_a_follower_restores_into_a_new_cluster_that_grows_to_three() {
    let c = ProcessCluster::start(&bin(), 3, &[]).unwrap();
    let leader = c.wait_leader(WAIT).await.unwrap();
    let addr = c.addrs[leader].clone();
    queue(&addr).await;
    let first = submit_range(&addr, "b", 0, 30).await;
    let old_id = cluster_id(&addr).await;
    let follower = c.addrs[(leader + 1) % 3].clone();
    // A writer keeps going while the backup is taken through a follower.
    let writer = {
        let addr = addr.clone();
        tokio::spawn(async move { submit_range(&addr, "b", 30, 60).await })
    };
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("cluster.backup");
    let out = cli(&["cluster", "backup", file.to_str().unwrap(), "--server", &follower, "--output", "json"]);
    let later = writer.await.unwrap();
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["cluster_id"], old_id.as_str(), "{out}");
    let bytes = std::fs::read(&file).unwrap();
    let (header, state) = suanli_server::backup::decode(&bytes).unwrap();
    let backed = suanli_state::State::restore(state).unwrap();
    // Linearizable: every job acknowledged before the backup started is in it.
    assert!(first.iter().all(|id| backed.job(suanli_model::JobId(*id)).is_some()));
    assert!(header.last_applied.is_some());
    let in_backup: BTreeMap<u64, String> = {
        let old = job_states(&addr, false).await;
        old.into_iter().filter(|(id, _)| backed.job(suanli_model::JobId(*id)).is_some()).collect()
    };
    assert!(in_backup.len() >= 30 && in_backup.len() <= 60 + later.len());

    // Restore into a new cluster of one server, then two more join it.
    let mut n = ProcessCluster::prepare(&bin(), 3, &[]).unwrap();
    let out = cli(&[
        "cluster",
        "restore",
        file.to_str().unwrap(),
        "--data-dir",
        n.data_dir(0).to_str().unwrap(),
        "--id",
        "1",
        "--listen",
        &n.addrs[0],
        "--peer-listen",
        &n.peer_addrs[0],
        "--output",
        "json",
    ]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["source_cluster_id"], old_id.as_str(), "{out}");
    n.spawn_initialized(0).unwrap();
    n.wait_leader(WAIT).await.unwrap();
    let new_id = cluster_id(&n.addrs[0]).await;
    assert_ne!(new_id, old_id, "a restored cluster has a new identity");
    assert_eq!(r["cluster_id"], new_id.as_str());
    assert_eq!(job_states(&n.addrs[0], false).await, in_backup, "the jobs and their states are the backup's");
    for i in [1, 2] {
        n.spawn_joining(i, 0).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = members(&n.addrs[0]).await;
        if m.members.len() == 3 && m.members.iter().all(|m| m.voter) {
            break;
        }
        assert!(Instant::now() < deadline, "the joiners did not become voters: {m:?}\n{}", n.log(1));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in [1, 2] {
        n.wait_caught_up(i, WAIT).await.unwrap();
        assert_eq!(job_states(&n.addrs[i], true).await, in_backup);
        assert_eq!(members(&n.addrs[i]).await.cluster_id, new_id);
    }
    // Ids keep increasing from the backup's counters.
    let max = in_backup.keys().max().copied().unwrap_or(0);
    let fresh = submit_range(&n.addrs[1], "after", 0, 1).await;
    assert!(fresh[0] > max, "new job id {} after {max}", fresh[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_surviving_server_rebuilds_the_cluster() {
    let mut c = ProcessCluster::start(&bin(), 3, &[]).unwrap();
    let leader = c.wait_leader(WAIT).await.unwrap();
    let addr = c.addrs[leader].clone();
    queue(&addr).await;
    let acked = submit_range(&addr, "d", 0, 40).await;
    let before = job_states(&addr, false).await;
    let old_id = cluster_id(&addr).await;
    // The two others are gone for good; the survivor (the last leader) is stopped.
    for i in 0..3 {
        c.kill(i);
    }
    let mut n = ProcessCluster::prepare(&bin(), 1, &[]).unwrap();
    let out = cli(&[
        "cluster",
        "restore",
        "--from-data-dir",
        c.data_dir(leader).to_str().unwrap(),
        "--data-dir",
        n.data_dir(0).to_str().unwrap(),
        "--id",
        "1",
        "--listen",
        &n.addrs[0],
        "--peer-listen",
        &n.peer_addrs[0],
    ]);
    assert!(out.contains("new cluster"), "{out}");
    n.spawn_initialized(0).unwrap();
    n.wait_leader(WAIT).await.unwrap();
    assert_ne!(cluster_id(&n.addrs[0]).await, old_id);
    let after = job_states(&n.addrs[0], false).await;
    assert!(acked.iter().all(|id| after.contains_key(id)), "an acknowledged job is missing");
    assert_eq!(after, before);
    submit_range(&n.addrs[0], "d", 40, 41).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_of_the_old_cluster_runs_the_restored_clusters_allocations() {
    use support::{AgentProc, fake_config, ready_healthy, record_job, submit, wait_nodes, wait_terminal};
    let (old, old_addr) = support::cluster(1).await;
    let mut agent = AgentProc::new("node-a", std::slice::from_ref(&old_addr), &fake_config(2, 0, 0), "");
    agent.start();
    wait_nodes(&old_addr, WAIT, "agent registered", |n| ready_healthy(n, "node-a", 2)).await;
    let rec_dir = tempfile::tempdir().unwrap();
    let rec = rec_dir.path().join("record.txt");
    let j1 = submit(&old_addr, "j1", &record_job("j1", &rec, 0.1, 1, false, None)).await;
    wait_terminal(&old_addr, &[j1], WAIT).await;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("b");
    cli(&["cluster", "backup", file.to_str().unwrap(), "--server", &old_addr]);
    // After the backup the old cluster runs one more job: its allocation id is the one the
    // restored cluster hands out next.
    let j2 = submit(&old_addr, "j2", &record_job("j2", &rec, 0.1, 1, false, None)).await;
    let old_j2 = wait_terminal(&old_addr, &[j2], WAIT).await;
    let old_alloc = old_j2[&j2].allocs[0].id;
    agent.kill();
    drop(old);

    let mut n = ProcessCluster::prepare(&bin(), 1, &[]).unwrap();
    cli(&[
        "cluster",
        "restore",
        file.to_str().unwrap(),
        "--data-dir",
        n.data_dir(0).to_str().unwrap(),
        "--id",
        "1",
        "--listen",
        &n.addrs[0],
        "--peer-listen",
        &n.peer_addrs[0],
    ]);
    n.spawn_initialized(0).unwrap();
    n.wait_leader(WAIT).await.unwrap();
    let new_addr = n.addrs[0].clone();
    // The same agent, pointed at the new cluster.
    let toml_path = agent.data_dir().parent().unwrap().join("agent.toml");
    let toml = std::fs::read_to_string(&toml_path).unwrap().replace(&old_addr, &new_addr);
    std::fs::write(&toml_path, toml).unwrap();
    agent.start();
    let j3 = submit(&new_addr, "j3", &record_job("j3", &rec, 0.1, 1, false, None)).await;
    let jobs = wait_terminal(&new_addr, &[j3], Duration::from_secs(60)).await;
    let j = &jobs[&j3];
    assert_eq!(j.state, "succeeded", "{}: {}\n--- agent:\n{}", j.id, j.reason, agent.log());
    assert_eq!(j.allocs[0].id, old_alloc, "the new cluster reused the old allocation id (the collision case)");
    let log = agent.log();
    assert!(log.contains("ANOTHER CLUSTER"), "the agent did not say it switched clusters:\n{log}");
    let aside = std::fs::read_dir(agent.data_dir().join("old-clusters")).unwrap().count();
    assert_eq!(aside, 1, "the old cluster's work is kept aside once");
    let lines = std::fs::read_to_string(&rec).unwrap();
    assert!(lines.lines().any(|l| l.starts_with(&format!("S {j3} "))), "j3 never ran:\n{lines}");
}
