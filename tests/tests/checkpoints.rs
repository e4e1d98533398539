//! Checkpoints end to end (issue 18, "What it must show" 1–5), on real servers, real agents
//! with the fake GPU plugin, and `examples/trainer/trainer.py` as the task: a trainer steps
//! every 0.2 s, checkpoints every 5 steps (and when it receives its checkpoint signal), and
//! journals each step, so each test proves from the journals what happened.
//!
//! 1. preemption: checkpoint within the grace, the preemptor gets the freed GPUs (not a
//!    third, pending job), the trainer resumes on another node, at most one interval lost;
//! 2. drain of a node running three trainers: all resume elsewhere, no attempts overlap;
//! 3. pool outage: every agent of pool A SIGKILLed with its tasks; jobs allowed in pool B run
//!    there from their checkpoints within [`failover_bound`] (measured and printed), a job
//!    pinned to A waits with a reason;
//! 4. a hardware-bound checkpoint never restores onto another GPU model, a portable one does;
//! 5. a stale attempt's ReportCheckpoint is refused; a checkpoint in an S3 store (moto)
//!    restores on another node.
//!
//! Run: `cargo build -p suanli -p suanli-plugin-fake -p suanli-plugin-cpu`, then
//! `cargo test -p suanli-tests --test checkpoints`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_tests as support;
use support::{CKPT_TTL_MS, CkptCluster, NodeSpec, Trainer, attempts, channel, nodes_of, overlaps, step_regressions};

/// Steps between two checkpoints of the trainers here (`--checkpoint-every`).
const EVERY: u64 = 5;

async fn set_mode(c: &CkptCluster, id: &str, mode: pb::NodeMode) {
    let req = pb::SetNodeModeRequest { id: id.into(), mode: mode as i32, grace_s: 0, max_unavailable: 0 };
    NodesClient::new(channel(&c.addr).await.unwrap()).set_mode(req).await.unwrap();
}

/// The latest committed step of job `id` once it is above `above`.
async fn committed_above(c: &CkptCluster, id: u64, above: u64) -> pb::JobInfo {
    c.wait_job(id, Duration::from_secs(30), "a checkpoint reported", |j| j.latest_checkpoint_step > above).await
}

/// Checks common to every test: no overlapping attempts, no step going back.
fn check_journal(c: &CkptCluster, name: &str) -> Vec<support::TrainerLine> {
    let j = c.journal(name);
    let o = overlaps(&j);
    assert!(o.is_empty(), "{name}: attempts overlap: {o:#?}");
    let r = step_regressions(&j);
    assert!(r.is_empty(), "{name}: steps went back: {r:#?}");
    j
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn preemption_checkpoints_first_and_the_trainer_resumes_elsewhere() {
    let c = CkptCluster::start(&[NodeSpec::new("n1", "p", 2), NodeSpec::new("n2", "p", 2)]).await;
    // n2 takes nothing yet: the trainer lands on n1, and the preemptor must preempt it.
    set_mode(&c, "n2", pb::NodeMode::Cordoned).await;
    let t = Trainer { gpus: 2, priority: 0, ..Trainer::new("low") };
    let tid = c.submit(&t).await;
    let j = c.wait_job(tid, Duration::from_secs(30), "the trainer runs", |j| j.state == "running").await;
    assert_eq!(nodes_of(&j), ["n1"]);
    committed_above(&c, tid, 0).await;
    // A third job that would take the freed GPUs if they were not held for the preemptor.
    let third = support::submit(&c.addr, "third", &support::sleeper("third", 2, -10)).await;
    let before = c.journal("low").iter().filter(|l| l.event == "checkpoint").map(|l| l.step).max().unwrap_or(0);
    let hi = support::submit(&c.addr, "high", &support::sleeper("high", 2, 100)).await;
    let asked = Instant::now();
    let h = c.wait_job(hi, Duration::from_secs(30), "the preemptor runs", |j| j.state == "running").await;
    let took = asked.elapsed();
    assert_eq!(nodes_of(&h), ["n1"], "the preemptor runs on the freed GPUs");
    let third_job = support::job(&c.addr, third).await;
    assert_eq!(third_job.state, "pending", "the third job did not take the freed GPUs: {third_job:#?}");
    // The trainer wrote a new checkpoint when asked, within its grace, and it was reported.
    let j1 = c.journal("low");
    let a1 = attempts(&j1, tid);
    let first = a1.first().expect("the first attempt journalled");
    let asked_ckpt = first.checkpoints.iter().copied().filter(|s| *s > before).max();
    assert!(
        asked_ckpt.is_some(),
        "no checkpoint after the preemption was asked (last before: {before}); attempt: {first:?}\n{}",
        c.logs()
    );
    assert!(took < Duration::from_secs(t.grace_s + 10), "the preemptor waited {took:?} (grace {} s)", t.grace_s);
    let after = support::job(&c.addr, tid).await;
    eprintln!(
        "preemption: preemptor running {took:?} after submission; trainer's committed step {} (asked checkpoint {asked_ckpt:?})",
        after.latest_checkpoint_step
    );
    // Room elsewhere: the trainer resumes on n2 from its checkpoint (before the third job,
    // which has a lower priority).
    set_mode(&c, "n2", pb::NodeMode::Schedulable).await;
    let r = c
        .wait_job(tid, Duration::from_secs(30), "the trainer resumes on n2", |j| {
            j.state == "running" && nodes_of(j) == ["n2"] && j.attempt > first.attempt
        })
        .await;
    let attempt = r.attempt;
    let lines = c
        .wait_journal("low", Duration::from_secs(20), "the resumed trainer steps", |l| {
            l.iter().any(|x| x.job == tid && x.attempt == attempt && x.event == "step")
        })
        .await;
    let a = attempts(&lines, tid);
    let (old, new) = (&a[0], a.last().unwrap());
    assert!(new.restored, "the second attempt restored: {a:#?}");
    assert!(new.start_step >= asked_ckpt.unwrap(), "resumed from {} < committed {asked_ckpt:?}", new.start_step);
    let lost = old.max_step.saturating_sub(new.start_step);
    eprintln!(
        "preemption: attempt {} reached step {}, attempt {} resumed from {} ({lost} steps lost)",
        old.attempt, old.max_step, new.attempt, new.start_step
    );
    assert!(lost <= EVERY, "{lost} steps lost, more than one interval ({EVERY})");
    check_journal(&c, "low");
    // The third job still waits (n1 is the preemptor's, n2 the trainer's).
    assert_eq!(support::job(&c.addr, third).await.state, "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn draining_a_node_moves_three_trainers_with_their_checkpoints() {
    let c =
        CkptCluster::start(&[NodeSpec::new("d1", "p", 3), NodeSpec::new("d2", "p", 2), NodeSpec::new("d3", "p", 2)])
            .await;
    set_mode(&c, "d2", pb::NodeMode::Cordoned).await;
    set_mode(&c, "d3", pb::NodeMode::Cordoned).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let t = Trainer::new(&format!("t{i}"));
        ids.push((c.submit(&t).await, t.name.clone()));
    }
    for (id, _) in &ids {
        let j = c.wait_job(*id, Duration::from_secs(30), "the trainer runs on d1", |j| j.state == "running").await;
        assert_eq!(nodes_of(&j), ["d1"]);
        committed_above(&c, *id, 0).await;
    }
    set_mode(&c, "d2", pb::NodeMode::Schedulable).await;
    set_mode(&c, "d3", pb::NodeMode::Schedulable).await;
    let drained = Instant::now();
    c.drain("d1").await;
    for (id, name) in &ids {
        let j = c
            .wait_job(*id, Duration::from_secs(40), "the trainer resumes on another node", |j| {
                support::running_elsewhere(j, &["d1"]) && j.attempt > 1
            })
            .await;
        let attempt = j.attempt;
        let lines = c
            .wait_journal(name, Duration::from_secs(20), "the moved trainer steps", |l| {
                l.iter().any(|x| x.job == *id && x.attempt == attempt && x.event == "step")
            })
            .await;
        let a = attempts(&lines, *id);
        let new = a.last().unwrap();
        assert!(new.restored && new.start_step > 0, "{name} resumed from its checkpoint: {a:#?}");
        let lost = a[0].max_step.saturating_sub(new.start_step);
        eprintln!(
            "drain: {name} on {:?} after {:?}, resumed from step {} ({lost} steps lost)",
            nodes_of(&j),
            drained.elapsed(),
            new.start_step
        );
        assert!(lost <= EVERY, "{name}: {lost} steps lost");
        check_journal(&c, name);
    }
}

/// How long jobs of a dead pool may take to run again in another pool: the heartbeat TTL
/// (the node is declared down), a scheduling pass, the checkpoint download and the trainer's
/// start, with 10 s of room for a loaded 2-core machine.
fn failover_bound() -> Duration {
    Duration::from_millis(CKPT_TTL_MS) + Duration::from_secs(10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dark_pool_fails_over_to_the_other_pool_from_checkpoints() {
    let mut c = CkptCluster::start(&[
        NodeSpec::new("a1", "pool-a", 2),
        NodeSpec::new("a2", "pool-a", 2),
        NodeSpec::new("b1", "pool-b", 2),
    ])
    .await;
    set_mode(&c, "b1", pb::NodeMode::Cordoned).await;
    let both = vec!["pool-a".to_owned(), "pool-b".to_owned()];
    let mut movable = Vec::new();
    for i in 0..2 {
        let t = Trainer { pools: both.clone(), ..Trainer::new(&format!("m{i}")) };
        movable.push((c.submit(&t).await, t.name.clone()));
    }
    let pinned_t = Trainer { pools: vec!["pool-a".into()], ..Trainer::new("pinned") };
    let pinned = c.submit(&pinned_t).await;
    let mut committed = Vec::new();
    for id in movable.iter().map(|x| x.0).chain([pinned]) {
        c.wait_job(id, Duration::from_secs(30), "running in pool A", |j| j.state == "running").await;
        committed.push(committed_above(&c, id, 0).await.latest_checkpoint_step);
    }
    set_mode(&c, "b1", pb::NodeMode::Schedulable).await;
    // Pool A goes dark: its agents and their tasks SIGKILLed at once.
    let dark = Instant::now();
    for id in ["a1", "a2"] {
        let a = c.agent(id);
        a.kill();
        a.kill_tasks();
    }
    let mut worst = Duration::ZERO;
    for (k, (id, name)) in movable.iter().enumerate() {
        let j = c
            .wait_job(*id, failover_bound() + Duration::from_secs(20), "running in pool B", |j| {
                support::running_elsewhere(j, &["a1", "a2"])
            })
            .await;
        let attempt = j.attempt;
        let lines = c
            .wait_journal(name, Duration::from_secs(20), "the trainer steps in pool B", |l| {
                l.iter().any(|x| x.job == *id && x.attempt == attempt && x.event != "exit")
            })
            .await;
        let took = dark.elapsed();
        worst = worst.max(took);
        let new = attempts(&lines, *id).pop().unwrap();
        assert!(new.restored, "{name} restored in pool B: {new:?}");
        assert!(new.start_step >= committed[k], "{name} resumed from {} < {}", new.start_step, committed[k]);
        eprintln!("pool outage: {name} running on {:?} from step {} after {took:?}", nodes_of(&j), new.start_step);
        check_journal(&c, name);
    }
    eprintln!(
        "pool outage: failover took {worst:?} for the slowest job (bound {:?}: heartbeat TTL {CKPT_TTL_MS} ms + 10 s)",
        failover_bound()
    );
    assert!(worst <= failover_bound(), "failover took {worst:?}, over the bound {:?}", failover_bound());
    // The pinned job waits with a reason, and stays there.
    let p = c
        .wait_job(pinned, Duration::from_secs(10), "the pinned job waits", |j| {
            j.state == "pending" && !j.reason.is_empty()
        })
        .await;
    eprintln!("pool outage: the job pinned to pool-a waits: {}", p.reason);
    assert!(nodes_of(&p).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hardware_bound_checkpoints_restore_only_on_the_same_model() {
    let c = CkptCluster::start(&[NodeSpec::new("h1", "p", 2), NodeSpec::new("h2", "p", 2).model("H100-80G")]).await;
    set_mode(&c, "h2", pb::NodeMode::Cordoned).await;
    let bound_t = Trainer { hardware_bound: true, ..Trainer::new("bound") };
    let portable_t = Trainer::new("portable");
    let bound = c.submit(&bound_t).await;
    let portable = c.submit(&portable_t).await;
    for id in [bound, portable] {
        let j = c.wait_job(id, Duration::from_secs(30), "running on h1", |j| j.state == "running").await;
        assert_eq!(nodes_of(&j), ["h1"]);
    }
    let b = committed_above(&c, bound, 0).await;
    assert!(b.latest_checkpoint_hardware.contains("A100-80G"), "hardware recorded: {b:#?}");
    let p = committed_above(&c, portable, 0).await;
    assert!(p.latest_checkpoint_hardware.is_empty(), "a portable checkpoint names no hardware: {p:#?}");
    set_mode(&c, "h2", pb::NodeMode::Schedulable).await;

    // The portable one moves to the H100 node and restores there.
    c.migrate(portable, "", "h2").await.unwrap_or_else(|e| panic!("migrating the portable trainer: {e:?}"));
    let j = c
        .wait_job(portable, Duration::from_secs(40), "the portable trainer runs on h2", |j| {
            j.state == "running" && nodes_of(j) == ["h2"]
        })
        .await;
    let attempt = j.attempt;
    let lines = c
        .wait_journal("portable", Duration::from_secs(20), "it steps on h2", |l| {
            l.iter().any(|x| x.job == portable && x.attempt == attempt && x.event == "step")
        })
        .await;
    let new = attempts(&lines, portable).pop().unwrap();
    assert!(new.restored && new.start_step > 0, "the portable checkpoint restored on h2: {new:?}");
    check_journal(&c, "portable");

    // The hardware-bound one asked to move to the H100 node: refused up front, or it waits
    // with a reason naming the hardware; it never runs there.
    match c.migrate(bound, "", "h2").await {
        Err(e) => {
            eprintln!("hardware-bound migrate refused: {e:?}");
            assert!(e.message().contains("A100") || e.message().contains("hardware"), "{e:?}");
        }
        Ok(_) => {
            let w = c
                .wait_job(bound, Duration::from_secs(30), "the hardware-bound trainer waits", |j| {
                    // "moving: migrated" is the reason between the stop and the next pass that
                    // finds no node; the scheduler's reason replaces it.
                    j.state == "pending" && !j.reason.is_empty() && !j.reason.starts_with("moving")
                })
                .await;
            eprintln!("hardware-bound trainer waits: {}", w.reason);
            assert!(w.reason.contains("A100-80G"), "the reason names the hardware: {:?}", w.reason);
            // Longer than a few scheduling passes: still not on h2.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let w = support::job(&c.addr, bound).await;
            assert!(!nodes_of(&w).contains(&"h2".to_owned()), "{w:#?}");
        }
    }
    let h2 = c.agents.iter().find(|a| a.node_id == "h2").unwrap();
    assert!(
        !h2.journal().iter().any(|e| e.job_id == bound),
        "the hardware-bound checkpoint was started on the H100 node: {:#?}",
        h2.journal()
    );
    check_journal(&c, "bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_attempts_checkpoint_report_is_refused() {
    let c = CkptCluster::start(&[NodeSpec::new("s1", "p", 1), NodeSpec::new("s2", "p", 1)]).await;
    set_mode(&c, "s2", pb::NodeMode::Cordoned).await;
    let id = c.submit(&Trainer::new("stale")).await;
    let j1 = c.wait_job(id, Duration::from_secs(30), "running", |j| j.state == "running").await;
    let old = j1.allocs[0].clone();
    committed_above(&c, id, 0).await;
    set_mode(&c, "s2", pb::NodeMode::Schedulable).await;
    c.drain("s1").await;
    let j2 = c
        .wait_job(id, Duration::from_secs(40), "the next attempt runs", |j| support::running_elsewhere(j, &["s1"]))
        .await;
    assert!(j2.attempt > j1.attempt);
    // Agent calls need an agent's (or a server's) certificate: the admin's is refused.
    let server_cert = suanli_server::local::LocalPki::get().server();
    let mut agent = AgentClient::new(suanli_server::local::channel_as(&c.addr, &server_cert).await.unwrap());
    let stale_step = j2.latest_checkpoint_step + 1_000;
    let report = |alloc_id: u64, epoch: u64| pb::ReportCheckpointRequest {
        alloc_id,
        epoch,
        uri: format!("{}/jobs/{id}/stale", c.store_url),
        step: stale_step,
        size_bytes: 1,
        wall_time: 1,
        ..Default::default()
    };
    // The live allocation with the ended attempt's epoch: the epoch fence refuses it.
    let live = j2.allocs.iter().find(|a| a.state == "running").unwrap();
    assert!(live.epoch > old.epoch);
    let e = agent.report_checkpoint(report(live.id, old.epoch)).await.expect_err("a stale epoch is refused");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    eprintln!("stale: report with the live allocation and the old epoch refused: {e:?}");
    // The ended attempt's own allocation: it is gone from the state, so refused too.
    let e = agent.report_checkpoint(report(old.id, old.epoch)).await.expect_err("an ended attempt's report is refused");
    assert!(matches!(e.code(), tonic::Code::FailedPrecondition | tonic::Code::NotFound), "{e:?}");
    eprintln!("stale: report from the ended attempt's allocation refused: {e:?}");
    let after = support::job(&c.addr, id).await;
    assert!(after.latest_checkpoint_step < stale_step, "the stale step was not recorded: {after:#?}");
}

/// A moto S3 server on a port it chose itself (`moto_server -p 0`, the port read from its log).
struct Moto {
    child: std::process::Child,
    endpoint: String,
    _log: tempfile::TempDir,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `$SUANLI_MOTO_SERVER`, else the gate's install (`$SUANLI_TOOLS_DIR`, default
/// `target/tools`, then `moto/bin/moto_server`), as agent/tests/checkpoint_store.rs finds it.
fn moto_server() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("SUANLI_MOTO_SERVER") {
        return p.into();
    }
    let tools = std::env::var_os("SUANLI_TOOLS_DIR")
        .map_or_else(|| support::target_dir().parent().unwrap().join("tools"), std::path::PathBuf::from);
    let p = tools.join("moto").join("bin").join("moto_server");
    assert!(
        p.is_file(),
        "moto_server not found at {} and SUANLI_MOTO_SERVER is unset: scripts/test.sh installs it into target/tools/moto",
        p.display()
    );
    p
}

async fn start_moto() -> Moto {
    let log = tempfile::tempdir().unwrap();
    let out = log.path().join("moto.log");
    let child = std::process::Command::new(moto_server())
        .args(["-H", "127.0.0.1", "-p", "0"])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(log.path().join("moto.err")).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let endpoint = loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default()
            + &std::fs::read_to_string(log.path().join("moto.err")).unwrap_or_default();
        if let Some(i) = text.find("Running on http://127.0.0.1:") {
            let rest = &text[i + "Running on http://".len()..];
            let end = rest.find(|c: char| c.is_whitespace() || c == '/').unwrap_or(rest.len());
            break format!("http://{}", &rest[..end]);
        }
        assert!(Instant::now() < deadline, "moto did not start within 30 s:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    Moto { child, endpoint, _log: log }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_in_s3_restores_on_another_node() {
    let moto = start_moto().await;
    // The bucket, by a plain S3 PUT (moto accepts any credentials).
    let st = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys,urllib.request as u; u.urlopen(u.Request(sys.argv[1], method='PUT')).read()",
            &format!("{}/suanli-ckpt", moto.endpoint),
        ])
        .status()
        .unwrap();
    assert!(st.success(), "creating the bucket on {}", moto.endpoint);
    let env = [
        ("AWS_ENDPOINT", moto.endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
    ];
    let c = CkptCluster::start_with_store(
        &[NodeSpec::new("s3a", "p", 1), NodeSpec::new("s3b", "p", 1)],
        Some("s3://suanli-ckpt/e2e"),
        &env,
    )
    .await;
    set_mode(&c, "s3b", pb::NodeMode::Cordoned).await;
    let id = c.submit(&Trainer::new("s3")).await;
    c.wait_job(id, Duration::from_secs(30), "running on s3a", |j| j.state == "running").await;
    let committed = committed_above(&c, id, 0).await.latest_checkpoint_step;
    set_mode(&c, "s3b", pb::NodeMode::Schedulable).await;
    c.drain("s3a").await;
    let j =
        c.wait_job(id, Duration::from_secs(40), "running on s3b", |j| support::running_elsewhere(j, &["s3a"])).await;
    assert!(j.allocs.iter().all(|a| a.restore_from.starts_with("s3://suanli-ckpt/e2e/")), "{j:#?}");
    let attempt = j.attempt;
    let lines = c
        .wait_journal("s3", Duration::from_secs(20), "it steps on s3b", |l| {
            l.iter().any(|x| x.job == id && x.attempt == attempt && x.event == "step")
        })
        .await;
    let new = attempts(&lines, id).pop().unwrap();
    assert!(
        new.restored && new.start_step >= committed,
        "restored from S3 at {} (committed {committed})",
        new.start_step
    );
    eprintln!("s3: restored on s3b from step {} via {}", new.start_step, j.allocs[0].restore_from);
    check_journal(&c, "s3");
}
