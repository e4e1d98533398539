//! The operator's two clock incidents (issue 16, item 4), over real processes: three
//! `suanli server` processes under libfaketime and real agents with the fake plugin.
//!
//! 1. A leader whose wall clock runs an hour ahead for a few seconds, then is killed: cluster
//!    time afterwards is within seconds of real time, and an 8 s retry backoff is 8 s.
//! 2. A leader whose clocks run twice as fast while an agent is SIGSTOPped: no second attempt
//!    of the agent's task starts before the first attempt's shim fenced it (exit.json
//!    `fenced_at_ms`) and it ended (the journal).
//!
//! They need the workspace built (`cargo build -p suanli -p suanli-chaos`, and the fake
//! plugin) and libfaketime (`scripts/setup.sh` installs Debian's `faketime`): without it they
//! fail, naming the package.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use suanli_chaos::checker::{self, JournalLine};
use suanli_chaos::cluster::{self, ClockFault, Cluster, FakeClocks, Shape};
use suanli_chaos::history::now_ms;
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::jobs_client::JobsClient;

/// One cluster at a time: the machine has two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(f: F) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(f).expect("the test ran");
}

async fn start(fake: FakeClocks, agents: usize) -> anyhow::Result<Cluster> {
    let bin = cluster::default_bin()?;
    let shape = Shape { fake_clocks: Some(fake), ..Shape::new(3, agents, 1, 0) };
    Cluster::start(&bin, shape, 7, false).await
}

fn job(name: &str, script: &str, gpu: bool) -> String {
    let mut resources = serde_json::json!({"cpu_milli": 100, "memory_mib": 64});
    if gpu {
        resources["devices"] = serde_json::json!({"kind": "gpu", "count": 1, "milli": 1000});
    }
    serde_json::json!({
        "name": name, "queue": "default", "kind": "batch",
        "groups": [{"name": "main", "replicas": 1, "resources": resources,
                    "task": {"command": "/bin/sh", "args": ["-c", script]}}]
    })
    .to_string()
}

async fn submit(addr: &str, name: &str, spec: String, retry: pb::RetryPolicy) -> anyhow::Result<u64> {
    let ch = cluster::channel(addr, Duration::from_secs(3)).await?;
    let req = pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: name.to_owned(),
        spec_json: spec,
        retry: Some(retry),
    };
    Ok(JobsClient::new(ch).submit(req).await?.into_inner().job_id)
}

async fn get(addr: &str, id: u64) -> anyhow::Result<pb::JobInfo> {
    let ch = cluster::channel(addr, Duration::from_secs(3)).await?;
    Ok(JobsClient::new(ch).get(pb::GetJobRequest { job_id: id, stale: false }).await?.into_inner())
}

async fn clock_line(addr: &str) -> String {
    let Ok(ch) = cluster::channel(addr, Duration::from_secs(1)).await else { return String::new() };
    ClusterClient::new(ch).version(pb::VersionRequest {}).await.map(|r| r.into_inner().clock).unwrap_or_default()
}

fn journal(c: &Cluster, a: usize) -> Vec<JournalLine> {
    checker::parse_journal(&std::fs::read_to_string(c.journal_path(a)).unwrap_or_default())
}

#[test]
fn a_leader_an_hour_ahead_then_killed_leaves_cluster_time_and_backoffs_bounded() {
    block_on(async {
        let mut c = start(FakeClocks::Wall, 1).await?;
        let l = c.wait_leader(Duration::from_secs(10)).await?;
        let addr = c.servers[l].addr.clone();
        c.set_clock(l, ClockFault::Skew(3_600)).await?;
        eprintln!("server {}'s wall clock is an hour ahead", c.servers[l].id);
        // Failing jobs with an 8 s backoff, submitted through the fast leader while it leads
        // (from before libfaketime picks the step up to after the clock check caught it).
        let retry = pb::RetryPolicy { max_attempts: 3, backoff_base_s: 8, backoff_max_s: 8 };
        let mut jobs = Vec::new();
        let mut line = String::new();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(4) {
            let name = format!("fail-{}", jobs.len());
            jobs.push(submit(&addr, &name, job(&name, "exit 3", false), retry).await?);
            let l = clock_line(&addr).await;
            if l.starts_with("SKEWED") {
                line = l;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert!(
            line.contains("+3599") || line.contains("+3600"),
            "`cluster version` never showed the leader SKEWED by an hour: {line:?}"
        );
        eprintln!("leader's clock line: {line}");
        c.kill_server(l);
        let l2 = c.wait_leader(Duration::from_secs(15)).await?;
        c.start_server(l)?; // on the real clock
        let addr2 = c.servers[l2].addr.clone();
        // Each failed attempt waits 8 s of cluster time, measured from real time here: the
        // second attempts start within seconds.
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let now_s = now_ms() / 1000;
            let mut waiting = 0;
            for id in &jobs {
                let j = get(&addr2, *id).await?;
                assert!(
                    j.not_before <= now_s + 8 + 3,
                    "job {id} waits until {} s from now (attempt {}): a backoff of 8 s became longer",
                    j.not_before.saturating_sub(now_s),
                    j.attempt
                );
                if j.attempt < 2 && j.state != "failed" {
                    waiting += 1;
                }
            }
            if waiting == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "{waiting} of {} jobs never started a second attempt", jobs.len());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let now_s = now_ms() / 1000;
        for i in 0..c.servers.len() {
            let r = c.inspect(i, 0, 0).await?;
            assert!(
                r.cluster_time_s <= now_s + suanli_chaos::TIME_BOUND_S,
                "server {}: cluster time {} s ahead of real time",
                r.id,
                r.cluster_time_s - now_s
            );
        }
        Ok(())
    });
}

/// The first attempt's `exit.json` (`fenced_at_ms`), in the agent's data directory.
fn fenced_at_ms(dir: &Path, alloc: u64, epoch: u64) -> Option<u64> {
    let text = std::fs::read(dir.join("allocs").join(format!("{alloc}-{epoch}")).join("exit.json")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    v.get("fenced_at_ms").and_then(serde_json::Value::as_u64)
}

#[test]
fn a_leader_at_twice_the_rate_starts_no_second_attempt_before_the_first_is_fenced() {
    block_on(async {
        let mut c = start(FakeClocks::All, 2).await?;
        let l = c.wait_leader(Duration::from_secs(10)).await?;
        let addr = c.servers[l].addr.clone();
        // A task that ignores SIGTERM, on a whole GPU (one per agent).
        let retry = pb::RetryPolicy { max_attempts: 3, backoff_base_s: 1, backoff_max_s: 1 };
        let id = submit(&addr, "stubborn", job("stubborn", "trap '' TERM; sleep 120", true), retry).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let (a, first) = loop {
            let found = (0..2).find_map(|a| journal(&c, a).into_iter().find(|l| l.job_id == id).map(|l| (a, l)));
            if let Some(f) = found {
                break f;
            }
            assert!(Instant::now() < deadline, "the job never started");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let l = c.leader().await.unwrap_or(l);
        c.set_clock(l, ClockFault::Rate(2)).await?;
        c.pause_agent(a, true);
        eprintln!(
            "server {}'s clocks run 2x; agent {} (running job {id}) is stopped",
            c.servers[l].id, c.agents[a].node
        );
        // Past the TTL (3 s) in the fast leader's clock after 1.5 s of real time; hold 5 s.
        let mut line = String::new();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            let s = clock_line(&c.servers[l].addr).await;
            if s.starts_with("DRIFTING") || s.starts_with("SKEWED") {
                line = s;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(!line.is_empty(), "`cluster version` never showed the fast leader's clock failing its check");
        eprintln!("leader's clock line: {line}");
        // Heal the leader (restart on the real clock); the agent stays stopped: a healthy
        // leader declares its node down after a full TTL and the job moves to the other agent.
        c.kill_server(l);
        c.start_server(l)?;
        let other = 1 - a;
        let deadline = Instant::now() + Duration::from_secs(40);
        let second = loop {
            if let Some(s) = journal(&c, other).into_iter().find(|x| x.job_id == id && x.event == "start") {
                break s;
            }
            assert!(Instant::now() < deadline, "the job never moved to the other agent");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        c.pause_agent(a, false);
        let data = c.journal_path(a).parent().map(Path::to_path_buf).unwrap_or_default();
        let fenced = fenced_at_ms(&data, first.alloc_id, first.epoch);
        let runs = checker::runs(&journal(&c, a));
        let run = runs.iter().find(|r| r.alloc == (first.alloc_id, first.epoch));
        eprintln!(
            "first attempt fenced at {fenced:?}, ended at {:?}; second started at {}",
            run.map(|r| r.until_ms),
            second.at_ms
        );
        let fenced = fenced.expect("the first attempt's exit.json records its fence");
        assert!(
            fenced <= second.at_ms,
            "the second attempt started {} ms before the first was fenced",
            fenced - second.at_ms
        );
        let run = run.expect("the first attempt's run ended in its journal");
        assert!(run.fenced, "the first attempt was ended by its fence");
        assert!(
            run.until_ms <= second.at_ms,
            "double run: the second attempt started {} ms before the first ended",
            run.until_ms - second.at_ms
        );
        Ok(())
    });
}
