//! `suanli sim replay` on small native-format traces with exact outcomes, determinism, bad
//! input, and (when `SUANLI_TRACES` points at the Alibaba trace folder) a full replay.

use anyhow::Result;
use std::collections::BTreeMap;
use suanli_model::{CheckpointPolicy, Node, Queue};
use suanli_sim::replay::{
    JobOutcome, ReplayError, ReplayOptions, ReplayReport, default_queue, parse_queues_str, replay,
};
use suanli_sim::trace::{TracePod, parse_alibaba_nodes_str, parse_native_pods_str};

const POD_HEADER: &str =
    "name,arrival_s,duration_s,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,queue,priority,replicas\n";

fn nodes(rows: &[(&str, u32)]) -> Result<Vec<Node>> {
    let mut s = String::from("sn,cpu_milli,memory_mib,gpu,model\n");
    for (n, gpus) in rows {
        s.push_str(&format!("{n},64000,262144,{gpus},V100M32\n"));
    }
    Ok(parse_alibaba_nodes_str("nodes.csv", &s)?)
}

fn pods(rows: &str) -> Result<Vec<TracePod>> {
    Ok(parse_native_pods_str("pods.csv", &format!("{POD_HEADER}{rows}"))?)
}

fn opts() -> ReplayOptions {
    ReplayOptions { record_jobs: true, ..ReplayOptions::default() }
}

fn by_name(r: &ReplayReport) -> BTreeMap<String, JobOutcome> {
    r.job_outcomes.iter().map(|j| (j.name.clone(), j.clone())).collect()
}

fn times(r: &ReplayReport, name: &str) -> (Option<u64>, Option<u64>, u32) {
    let m = by_name(r);
    let j = &m[name];
    (j.first_start_s, j.done_s, j.preemptions)
}

#[test]
fn high_priority_preempts_low_and_the_victim_restarts_from_scratch() -> Result<()> {
    let n = nodes(&[("n1", 1)])?;
    let p = pods("low,0,1000,1000,1024,1,1000,,default,0,1\nhigh,100,50,1000,1024,1,1000,,default,10,1\n")?;
    let r = replay(&n, &p, &[default_queue()], &opts())?;
    // t=100: the pass preempts `low`; t=110 (one interval later) `high` starts; it ends at 160,
    // when `low` starts again with all of its 1000 s to do.
    assert_eq!(times(&r, "high"), (Some(110), Some(160), 0));
    assert_eq!(times(&r, "low"), (Some(0), Some(1160), 1));
    assert_eq!((r.completed, r.preempted_jobs, r.preemptions, r.never_started), (2, 1, 1, 0));
    assert!((r.lost_gpu_hours - 100.0 / 3600.0).abs() < 1e-9, "{}", r.lost_gpu_hours);
    assert_eq!(r.wait_s.max, 10);
    assert_eq!(r.jct_s.max, 1160);
    Ok(())
}

#[test]
fn a_checkpointed_victim_loses_only_work_since_its_last_checkpoint() -> Result<()> {
    let n = nodes(&[("n1", 1)])?;
    let p = pods("low,0,1000,1000,1024,1,1000,,default,0,1\nhigh,100,50,1000,1024,1,1000,,default,10,1\n")?;
    let o = ReplayOptions {
        checkpoint: Some(CheckpointPolicy { interval_s: 30, grace_s: 5, restore_s: 5, signal: Default::default() }),
        ..opts()
    };
    let r = replay(&n, &p, &[default_queue()], &o)?;
    // Checkpoints at 30, 60, 90: 90 s saved, 10 s lost; restarts at 160 with a 5 s restore.
    assert_eq!(times(&r, "low"), (Some(0), Some(160 + 5 + 910), 1));
    assert!((r.lost_gpu_hours - 10.0 / 3600.0).abs() < 1e-9, "{}", r.lost_gpu_hours);
    Ok(())
}

#[test]
fn equal_priority_never_preempts() -> Result<()> {
    let n = nodes(&[("n1", 1)])?;
    let p = pods("a,0,1000,1000,1024,1,1000,,default,5,1\nb,100,50,1000,1024,1,1000,,default,5,1\n")?;
    let r = replay(&n, &p, &[default_queue()], &opts())?;
    assert_eq!(times(&r, "b"), (Some(1000), Some(1050), 0));
    assert_eq!(r.preemptions, 0);
    Ok(())
}

#[test]
fn a_gang_waits_for_capacity_and_short_jobs_backfill_around_it() -> Result<()> {
    let n = nodes(&[("n1", 4), ("n2", 4)])?;
    let p = pods(
        "a,0,100,1000,1024,4,1000,,default,0,1\n\
         g,10,100,1000,1024,4,1000,,default,0,2\n\
         b,20,50,1000,1024,1,1000,,default,0,1\n\
         c,30,500,1000,1024,1,1000,,default,0,1\n",
    )?;
    let r = replay(&n, &p, &[default_queue()], &opts())?;
    assert_eq!(times(&r, "a"), (Some(0), Some(100), 0));
    // The gang needs both nodes: it starts (both replicas at once) when `a` ends.
    assert_eq!(times(&r, "g"), (Some(100), Some(200), 0));
    // `b` ends before the gang's reservation at t=100: it backfills.
    assert_eq!(times(&r, "b"), (Some(20), Some(70), 0));
    // `c` would still run at t=100: it must not delay the gang.
    assert_eq!(times(&r, "c"), (Some(200), Some(700), 0));
    assert_eq!(r.completed, 4);
    Ok(())
}

#[test]
fn quota_limits_a_queue_while_another_runs() -> Result<()> {
    let q = parse_queues_str(
        "q.csv",
        "name,team,parent,cohort,weight,cpu_milli,memory_mib,gpu_milli,npu_milli,borrow_gpu_milli\n\
         small,ta,,,1,,,2000,,\n\
         big,tb,,,1,,,,,\n",
    )?;
    let n = nodes(&[("n1", 8)])?;
    let p = pods(
        "s1,0,100,1000,1024,1,1000,,small,0,1\n\
         s2,0,100,1000,1024,1,1000,,small,0,1\n\
         s3,0,100,1000,1024,1,1000,,small,0,1\n\
         b1,0,100,1000,1024,4,1000,,big,0,1\n",
    )?;
    let r = replay(&n, &p, &q, &opts())?;
    assert_eq!(times(&r, "s1").0, Some(0));
    assert_eq!(times(&r, "s2").0, Some(0));
    assert_eq!(times(&r, "b1").0, Some(0));
    // Capacity is free, quota is not: the third job of `small` waits for one to end.
    assert_eq!(times(&r, "s3"), (Some(100), Some(200), 0));
    let small = r.queues.iter().find(|x| x.queue == "small").expect("queue small is reported");
    assert_eq!(small.quota_use_max_pct, Some(100.0));
    // Full for 100 s, half for 100 s, over a 200 s span.
    assert_eq!(small.quota_use_mean_pct, Some(75.0));
    assert!((small.gpu_hours - 3.0 * 100.0 / 3600.0).abs() < 1e-9);
    let big = r.queues.iter().find(|x| x.queue == "big").expect("queue big is reported");
    assert_eq!(big.quota_use_max_pct, None);
    // 4 GPUs x 100 s of 8 GPUs x 200 s.
    assert!((big.share_pct - 25.0).abs() < 1e-9, "{}", big.share_pct);
    Ok(())
}

/// A few hundred jobs over three queues (quota, a cohort, priorities, gangs) on a small
/// cluster: enough to exercise queueing, preemption and borrowing.
fn busy_trace() -> Result<(Vec<Node>, Vec<TracePod>, Vec<Queue>)> {
    let n = nodes(&[("n1", 8), ("n2", 8), ("n3", 4), ("n4", 2), ("n5", 0)])?;
    let q = parse_queues_str(
        "q.csv",
        "name,team,parent,cohort,weight,cpu_milli,memory_mib,gpu_milli,npu_milli,borrow_gpu_milli\n\
         org,,,,1,,,,,\n\
         research,r,org,c,2,,,12000,,6000\n\
         prod,p,org,c,1,,,10000,,\n\
         batch,b,,,1,,,,,\n",
    )?;
    let mut rows = String::new();
    let mut x: u64 = 12345;
    let mut next = |m: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    let mut t = 0;
    for i in 0..300 {
        t += next(120);
        let (ngpu, milli) = match next(6) {
            0 => (0, 0),
            1 | 2 => (1, 250 * (1 + next(3))),
            3 => (1, 1000),
            4 => (2, 1000),
            _ => (4, 1000),
        };
        let queue = ["research", "prod", "batch"][next(3) as usize];
        let prio = [0, 0, 5, 10][next(4) as usize];
        let reps = if next(8) == 0 { 2 } else { 1 };
        let dur = if next(20) == 0 { String::new() } else { (60 + next(3000)).to_string() };
        rows.push_str(&format!(
            "j{i},{t},{dur},{},{},{ngpu},{milli},,{queue},{prio},{reps}\n",
            1000 * (1 + next(8)),
            1024 * (1 + next(16))
        ));
    }
    Ok((n, pods(&rows)?, q))
}

#[test]
fn same_seed_same_report_and_every_job_is_accounted_for() -> Result<()> {
    let (n, p, q) = busy_trace()?;
    let a = replay(&n, &p, &q, &opts())?;
    let b = replay(&n, &p, &q, &opts())?;
    assert_eq!(serde_json::to_string(&a)?, serde_json::to_string(&b)?);
    assert_eq!(a.jobs, 300);
    assert_eq!(a.completed + a.running_at_end + a.never_started + a.requeued_at_end, a.jobs);
    assert!(a.passes > 10 && a.completed > 200, "passes {} completed {}", a.passes, a.completed);
    assert!(a.preemptions > 0, "the busy trace is meant to preempt");
    assert!(a.gpu_util_max_pct <= 100.0 + 1e-9);
    assert!(!a.series.is_empty());
    assert!(a.series.iter().all(|s| s.gpu_util_pct <= 100.0 + 1e-9 && s.frag_pct >= 0.0));
    let research = a.queues.iter().find(|x| x.queue == "research").expect("reported");
    assert!(research.quota_use_max_pct.is_some_and(|m| m <= 150.0 + 1e-9), "{:?}", research.quota_use_max_pct);
    // Another seed is also a valid replay (ties may break differently).
    let c = replay(&n, &p, &q, &ReplayOptions { seed: 7, ..opts() })?;
    assert_eq!(c.completed + c.running_at_end + c.never_started + c.requeued_at_end, c.jobs);
    Ok(())
}

#[test]
fn every_policy_replays_the_busy_trace() -> Result<()> {
    let (n, p, q) = busy_trace()?;
    for policy in suanli_scheduler::POLICY_NAMES {
        let mut o = opts();
        o.config.policy = policy.to_owned();
        let r = replay(&n, &p, &q, &o)?;
        assert_eq!(r.completed + r.running_at_end + r.never_started + r.requeued_at_end, r.jobs, "{policy}");
    }
    Ok(())
}

#[test]
fn limits_and_bad_pods_are_refused_with_clear_errors() -> Result<()> {
    let n = nodes(&[("n1", 1)])?;
    let p = pods("a,0,10,1000,1024,1,1000,,nope,0,1\n")?;
    let e = replay(&n, &p, &[default_queue()], &opts()).expect_err("unknown queue");
    assert_eq!(e.to_string(), "pod #0 (\"a\"): queue \"nope\" is not defined; defined queues: default");

    let p = pods("a,4000000000000,10,1000,1024,1,1000,,default,0,1\n")?;
    let e = replay(&n, &p, &[default_queue()], &opts()).expect_err("absurd arrival");
    assert!(e.to_string().contains("arrival_s 4000000000000 exceeds the limit"), "{e}");

    let p = pods("a,0,10,1000,1024,1,1000,,default,0,20000\n");
    assert!(p.is_err(), "the trace reader refuses 20000 replicas");

    let p = pods("a,0,10,1000,1024,1,1000,,default,0,1\nb,5,10,1000,1024,1,1000,,default,0,1\n")?;
    let e = replay(&n, &p, &[default_queue()], &ReplayOptions { max_events: 3, ..opts() }).expect_err("event limit");
    assert!(matches!(e, ReplayError::TooManyEvents { limit: 3, .. }), "{e}");
    assert!(e.to_string().contains("raise --max-events"), "{e}");

    let mut o = opts();
    o.config.policy = "nope".into();
    let e = replay(&n, &p, &[default_queue()], &o).expect_err("policy");
    assert!(e.to_string().starts_with("policy: unknown policy \"nope\""), "{e}");
    let e = replay(&n, &p, &[default_queue()], &ReplayOptions { interval_s: 0, ..opts() }).expect_err("interval");
    assert_eq!(e.to_string(), "interval_s: 0 must be between 1 and 86400");

    // A parent queue takes no jobs.
    let q = parse_queues_str("q.csv", "name,parent\norg,\ndefault,org\n")?;
    let p = pods("a,0,10,1000,1024,1,1000,,org,0,1\n")?;
    let e = replay(&n, &p, &q, &opts()).expect_err("parent queue");
    assert!(e.to_string().contains("is a parent queue"), "{e}");

    // A pod no node can ever hold waits and is reported with the engine's reason.
    let p = pods("big,0,10,1000,1024,8,1000,,default,0,1\nok,0,10,1000,1024,1,1000,,default,0,1\n")?;
    let r = replay(&n, &p, &[default_queue()], &opts())?;
    assert_eq!((r.completed, r.never_started), (1, 1));
    assert!(r.never_started_examples[0].reason.contains("nodes fit"), "{:?}", r.never_started_examples);
    Ok(())
}

#[test]
fn pods_without_duration_run_to_the_end() -> Result<()> {
    let n = nodes(&[("n1", 1)])?;
    let p = pods("forever,0,,1000,1024,1,1000,,default,0,1\nlater,50,10,1000,1024,1,1000,,default,0,1\n")?;
    let r = replay(&n, &p, &[default_queue()], &opts())?;
    assert_eq!((r.completed, r.running_at_end, r.never_started), (0, 1, 1));
    assert_eq!(times(&r, "forever"), (Some(0), None, 0));
    Ok(())
}

const HEADER: &str = "name,team,parent,cohort,weight,cpu_milli,memory_mib,gpu_milli,npu_milli,borrow_gpu_milli\n";

fn queue_err(body: &str) -> String {
    match parse_queues_str("q.csv", &format!("{HEADER}{body}")) {
        Ok(q) => panic!("expected an error for {body:?}, got {q:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_queue_files_name_file_line_and_field() -> Result<()> {
    assert_eq!(
        queue_err("a,t,,,x,,,,,\n"),
        "q.csv: line 2: field \"weight\": \"x\" is not a non-negative integer (0..=1000000, empty = unlimited)"
    );
    assert_eq!(queue_err("a,t,,,0,,,,,\n"), "q.csv: line 2: field \"weight\": 0 must be between 1 and 1000000");
    assert_eq!(
        queue_err("a,t,,,1,,,,,\nb,t,,,1,,,-5,,\n"),
        "q.csv: line 3: field \"gpu_milli\": \"-5\" is not a non-negative integer (0..=4611686018427387903, empty = unlimited)"
    );
    assert_eq!(
        queue_err("a,t,,,1,,,,,\na,t,,,1,,,,,\n"),
        "q.csv: line 3: field \"name\": duplicate queue \"a\" (first defined on line 2)"
    );
    assert_eq!(queue_err(",t,,,1,,,,,\n"), "q.csv: line 2: field \"name\": must not be empty");
    assert_eq!(
        queue_err("a,t,zz,,1,,,,,\n"),
        "q.csv: line 2: field \"parent\": unknown queue \"zz\"; define it on its own line"
    );
    assert!(
        queue_err("a,t,b,,1,,,,,\nb,t,a,,1,,,,,\n")
            .starts_with("q.csv: line 2: field \"parent\": queue \"a\" is its own ancestor")
    );
    assert_eq!(queue_err("a,t,a,,1,,,,,\n"), "q.csv: line 2: field \"parent\": queue \"a\" cannot be its own parent");
    assert!(
        queue_err("a,t,,,1,,,,,500\n")
            .starts_with("q.csv: line 2: field \"borrow_gpu_milli\": a borrowing limit needs a cohort")
    );
    assert!(queue_err("a,t,,,1,,,99999999999999999999,,\n").contains("field \"gpu_milli\""));
    assert!(queue_err("a,t,,,1\n").starts_with("q.csv: line 2:"), "ragged row");
    assert_eq!(queue_err(""), "q.csv: line 1: no queues defined");
    let e = parse_queues_str("q.csv", "name,gpu_mili\na,1\n").expect_err("typo column");
    assert!(e.to_string().starts_with("q.csv: line 1: unknown column \"gpu_mili\"; valid columns: name,team"), "{e}");
    let e = parse_queues_str("q.csv", "team\nt\n").expect_err("no name");
    assert!(e.to_string().contains("missing column \"name\""), "{e}");
    // Columns may be left out; empty means unlimited.
    let q = parse_queues_str("q.csv", "name,gpu_milli\n# a comment\na,4000\nb,\n")?;
    assert_eq!(q[0].nominal.gpu_milli, 4000);
    assert_eq!(q[0].nominal.cpu_milli, u64::MAX);
    assert_eq!(q[1].nominal.gpu_milli, u64::MAX);
    Ok(())
}

#[test]
fn alibaba_gpushare60_replays_quickly() -> Result<()> {
    let Some(dir) = std::env::var_os("SUANLI_TRACES").filter(|v| !v.is_empty()) else {
        println!("skipped: set SUANLI_TRACES to the alibaba-gpu-v2023 trace folder to replay it");
        return Ok(());
    };
    let dir = std::path::PathBuf::from(dir);
    let n = suanli_sim::trace::read_alibaba_nodes(&dir.join("openb_node_list_gpu_node.csv"))?;
    let p = suanli_sim::trace::read_pods(&dir.join("openb_pod_list_gpushare60.csv"))?;
    let started = std::time::Instant::now();
    let r = replay(&n, &p, &[default_queue()], &ReplayOptions::default())?;
    println!("gpushare60 replayed in {:.2}s:\n{}", started.elapsed().as_secs_f64(), r.table());
    assert_eq!(r.jobs, 8152);
    assert_eq!(r.completed + r.running_at_end + r.never_started + r.requeued_at_end, r.jobs);
    assert!(r.completed > 8000, "{}", r.completed);
    Ok(())
}

#[test]
fn contradicting_preemption_rules_cannot_cycle_forever() -> Result<()> {
    // `borrow` runs on quota lent by `lend`; `other` (outside the cohort, higher nominal than it
    // uses) may reclaim borrowed work, and `borrow`'s higher priority may preempt `other`'s job
    // back. Whatever the engine decides, the replay ends: a job preempted
    // `max_preemptions_per_job` times runs as non-preemptible.
    let q = parse_queues_str("q.csv", "name,cohort,gpu_milli\nlend,c,1000\nborrow,c,0\nother,,\n")?;
    let n = nodes(&[("n1", 1)])?;
    let p = pods("h,0,1000,1000,1024,1,1000,,borrow,10,1\nl,5,1000,1000,1024,1,1000,,other,5,1\n")?;
    for max in [1, 5] {
        let o = ReplayOptions { max_preemptions_per_job: max, ..opts() };
        let r = replay(&n, &p, &q, &o)?;
        assert_eq!(r.completed, 2, "max {max}");
        assert!(r.preemptions <= 2 * u64::from(max), "max {max}: {} preemptions", r.preemptions);
        println!("max_preemptions_per_job {max}: {:?}", r.job_outcomes);
    }
    Ok(())
}
