//! Elastic jobs (docs/job-spec.md, "Elastic jobs"), through the real engine: a running elastic
//! job grows into capacity that is idle after pending work had its turn, never by preempting;
//! a higher-priority job shrinks it, newest replicas first and checkpoint first, before any
//! other victim; its minimum goes only when no lower-priority work could give way instead;
//! a drained or lost surplus replica leaves the job running.

mod common;

use common::*;
use suanli_model::{AllocId, CheckpointPolicy, JobId, JobSpec, NodeId};
use suanli_state::{
    CancelJob, Command, Desired, JobState, NodeDown, NodeMode, ReportedStatus, SetNodeMode, State, StopReason,
};

/// An elastic trainer: `replicas` wanted, at least `min`, one GPU each, checkpointing.
fn elastic(replicas: u32, min: u32, priority: i32) -> JobSpec {
    let mut sp = spec("q", replicas, 1, priority);
    sp.gang = false;
    sp.groups[0].min_replicas = Some(min);
    sp.checkpoint = Some(CheckpointPolicy { interval_s: 600, grace_s: 30, restore_s: 10, signal: Default::default() });
    sp
}

fn batch(gpus_each: u32, replicas: u32, priority: i32) -> JobSpec {
    let mut sp = spec("q", replicas, gpus_each, priority);
    sp.gang = true;
    sp
}

/// Live allocations of `job` as (alloc, replica, desired run), by replica.
fn live(s: &State, job: u64) -> Vec<(AllocId, u32, bool)> {
    let j = s.job(JobId(job)).expect("job");
    let mut v: Vec<_> = j
        .allocs
        .iter()
        .filter_map(|a| s.allocs().get(a))
        .filter(|a| a.is_live())
        .map(|a| (a.alloc.id, a.alloc.replica, a.desired == Desired::Run))
        .collect();
    v.sort_by_key(|x| x.1);
    v
}

fn run_all(s: &mut State, job: u64, now: u64) {
    let epoch = s.job(JobId(job)).expect("job").attempt;
    for (a, _, _) in live(s, job) {
        if s.allocs()[&a].state == suanli_state::AllocState::Pending {
            apply_ok(s, report(a, epoch, ReportedStatus::Running, now));
        }
    }
}

fn stop_all_asked(s: &mut State, job: u64, now: u64) {
    let epoch = s.job(JobId(job)).expect("job").attempt;
    for (a, _, run) in live(s, job) {
        if !run {
            apply_ok(s, report(a, epoch, ReportedStatus::Stopped, now));
        }
    }
}

fn world(s: &State, job: u64) -> (u32, u64) {
    let j = s.job(JobId(job)).expect("job");
    (s.world_size(j), j.world_gen)
}

#[test]
fn an_elastic_job_grows_into_idle_capacity_and_shrinks_newest_first_before_its_minimum() {
    let mut s = cluster(1); // 4 GPUs
    apply_ok(&mut s, submit("x", batch(1, 2, 5), 1)); // job 1: 2 GPUs
    apply_ok(&mut s, submit("l", batch(1, 1, 0), 1)); // job 2: 1 GPU, low priority
    assert_eq!(schedule_once(&mut s, 1).placed.len(), 3);
    run_all(&mut s, 1, 1);
    run_all(&mut s, 2, 1);
    apply_ok(&mut s, submit("e", elastic(3, 1, 5), 2)); // job 3
    assert_eq!(schedule_once(&mut s, 2).placed.len(), 1, "one GPU is free: the minimum starts");
    run_all(&mut s, 3, 2);
    assert_eq!(world(&s, 3), (1, 0));

    // Job 1 ends: job 3 grows into the two freed GPUs, in the same attempt.
    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(1), reason: String::new(), now: 3 }));
    stop_all_asked(&mut s, 1, 3);
    let out = schedule_once(&mut s, 4);
    assert_eq!(out.placed.len(), 2, "{out:?}");
    assert!(out.preempted.is_empty());
    let j = s.job(JobId(3)).expect("job");
    assert_eq!((j.state, j.attempt), (JobState::Running, 1));
    assert_eq!(j.reason, "grew to 3 replicas");
    assert_eq!(world(&s, 3), (3, 1));
    run_all(&mut s, 3, 5);
    let oldest = live(&s, 3)[0].0;

    // A job of priority 10 needs 3 GPUs: job 3's two surplus replicas and the low-priority
    // job 2 give way; job 3's minimum (its oldest replica) stays.
    apply_ok(&mut s, submit("h", batch(1, 3, 10), 10)); // job 4
    let out = schedule_once(&mut s, 10);
    assert_eq!(out.preempted.len(), 3, "{out:?}");
    let stopping: Vec<AllocId> = live(&s, 3).iter().filter(|x| !x.2).map(|x| x.0).collect();
    assert_eq!(stopping.len(), 2);
    assert!(!stopping.contains(&oldest), "the newest replicas go first");
    for a in &stopping {
        match &s.allocs()[a].desired {
            Desired::Stop { reason: StopReason::Preempted { for_job }, checkpoint_first, grace_s, .. } => {
                assert_eq!((*for_job, *checkpoint_first, *grace_s), (JobId(4), true, 30));
            }
            other => panic!("{other:?}"),
        }
    }
    let j = s.job(JobId(3)).expect("job");
    assert_eq!(j.state, JobState::Running, "a shrink does not stop the job");
    assert!(j.reason.starts_with("shrinking to 1 replicas"), "{}", j.reason);
    assert_eq!(world(&s, 3), (1, 3));
    assert_eq!(s.job(JobId(2)).expect("job").state, JobState::Preempted);

    // The shrunk replicas stop: they leave the job, which runs on with its minimum. While
    // job 4 still waits for job 2, the freed GPUs are not idle: job 3 does not grow into them.
    stop_all_asked(&mut s, 3, 11);
    let out = schedule_once(&mut s, 11);
    assert!(out.placed.is_empty() && out.preempted.is_empty(), "{out:?}");
    stop_all_asked(&mut s, 2, 11);
    let j = s.job(JobId(3)).expect("job");
    assert_eq!(j.state, JobState::Running);
    assert!(j.reason.starts_with("shrank to 1 replicas"), "{}", j.reason);
    assert_eq!(live(&s, 3).iter().map(|x| x.0).collect::<Vec<_>>(), [oldest]);
    assert_eq!(j.history.len(), 2);
    let out = schedule_once(&mut s, 12);
    assert_eq!(out.placed.len(), 3, "job 4 takes the freed GPUs: {out:?}");
    assert_eq!(s.job(JobId(2)).expect("job").state, JobState::Pending, "no room for job 2 yet");
    run_all(&mut s, 4, 12);

    // Now only job 3's minimum could give way to another priority-10 GPU: the whole job stops.
    apply_ok(&mut s, submit("h2", batch(1, 1, 10), 20)); // job 5
    let out = schedule_once(&mut s, 20);
    assert_eq!(out.preempted, vec![oldest]);
    assert_eq!(s.job(JobId(3)).expect("job").state, JobState::Preempted);
}

#[test]
fn growth_waits_for_pending_work_and_never_preempts() {
    let mut s = cluster(1); // 4 GPUs
    apply_ok(&mut s, submit("x", batch(2, 1, 5), 1)); // job 1: 2 GPUs
    schedule_once(&mut s, 1);
    run_all(&mut s, 1, 1);
    apply_ok(&mut s, submit("e", elastic(4, 1, 5), 2)); // job 2: gets the 2 free GPUs
    assert_eq!(schedule_once(&mut s, 2).placed.len(), 2);
    run_all(&mut s, 2, 2);
    // A low-priority job waits: it may not preempt, and job 2 does not grow over it.
    apply_ok(&mut s, submit("l", batch(1, 1, 0), 3)); // job 3
    let out = schedule_once(&mut s, 3);
    assert!(out.placed.is_empty() && out.preempted.is_empty(), "{out:?}");
    // Job 1 ends: the pending job goes first, job 2 grows into what is left.
    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(1), reason: String::new(), now: 4 }));
    stop_all_asked(&mut s, 1, 4);
    let out = schedule_once(&mut s, 5);
    assert_eq!(out.placed.len(), 2, "{out:?}");
    assert_eq!(s.job(JobId(3)).expect("job").state, JobState::Placed);
    assert_eq!(world(&s, 2), (3, 1));
    // A higher-priority elastic job's growth does not preempt the low-priority job.
    run_all(&mut s, 2, 6);
    run_all(&mut s, 3, 6);
    let out = schedule_once(&mut s, 7);
    assert!(out.placed.is_empty() && out.preempted.is_empty(), "{out:?}");
    // A replica that finished means the work is finishing: nothing is added back.
    let epoch = s.job(JobId(2)).expect("job").attempt;
    let first = live(&s, 2)[0].0;
    apply_ok(&mut s, report(first, epoch, ReportedStatus::Succeeded, 8));
    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(3), reason: String::new(), now: 8 }));
    stop_all_asked(&mut s, 3, 8);
    assert!(schedule_once(&mut s, 9).placed.is_empty());
}

#[test]
fn a_drained_or_lost_surplus_replica_leaves_the_job_running() {
    let mut s = cluster(3); // 3 nodes of 4 GPUs
    apply_ok(&mut s, upsert_queue(queue("q", 12)));
    let mut sp = elastic(3, 1, 5);
    sp.groups[0].resources.devices.as_mut().expect("gpus").count = 4; // a node per replica
    apply_ok(&mut s, submit("e", sp, 1));
    assert_eq!(schedule_once(&mut s, 1).placed.len(), 3);
    run_all(&mut s, 1, 1);
    let node_of = |s: &State, a: AllocId| s.allocs()[&a].alloc.node.clone();
    let all = live(&s, 1);
    // Replicas 1 and 2 started together with 0; the surplus ones are the highest replicas.
    let (r1, r2) = (all[1].0, all[2].0);

    let drained = node_of(&s, r2);
    apply_ok(
        &mut s,
        Command::SetNodeMode(SetNodeMode { node: drained, mode: NodeMode::Draining, now: 5, drain: None }),
    );
    let j = s.job(JobId(1)).expect("job");
    assert!(matches!(j.state, JobState::Placed | JobState::Running), "{:?}", j.state);
    assert_eq!(world(&s, 1).0, 2);
    stop_all_asked(&mut s, 1, 6);
    assert_eq!(live(&s, 1).len(), 2);

    let down = node_of(&s, r1);
    apply_ok(&mut s, Command::NodeDown(NodeDown { node: NodeId::from(down.0.as_str()), reason: "ttl".into(), now: 7 }));
    let j = s.job(JobId(1)).expect("job");
    assert!(matches!(j.state, JobState::Placed | JobState::Running), "{:?}: {}", j.state, j.reason);
    assert!(j.reason.starts_with("shrank to 1 replicas"), "{}", j.reason);
    assert_eq!(live(&s, 1).len(), 1);
    // Losing the minimum stops the attempt as for any job.
    let last = live(&s, 1)[0].0;
    let n = node_of(&s, last);
    apply_ok(&mut s, Command::NodeDown(NodeDown { node: NodeId::from(n.0.as_str()), reason: "ttl".into(), now: 8 }));
    assert_ne!(s.job(JobId(1)).expect("job").state, JobState::Running);
}
