//! The job life cycle, plan re-checks, idempotent submission, reports and bounds.

mod common;

use common::*;
use suanli_model::{AllocId, DeviceShare, Health, JobId, NodeId, Placement, Plan, Preemption, PreemptionReason};
use suanli_state::{
    AllocState, ApplyPlan, CancelJob, ClearQuarantine, Command, CommandError, Desired, DeviceHealth, DrainOptions,
    JobState, MAX_ATTEMPT_HISTORY, NodeCondition, NodeDown, NodeMode, RefusalReason, ReportedStatus, Response,
    RetryPolicy, SetNodeMode, State, StateConfig, StopReason, SubmitJob, UpdateConfig,
};

fn job_state(s: &State, id: u64) -> JobState {
    s.job(JobId(id)).expect("job exists").state
}

fn allocs_of(s: &State, id: u64) -> Vec<(AllocId, u64)> {
    s.job(JobId(id)).expect("job exists").allocs.iter().map(|a| (*a, s.allocs()[a].alloc.epoch)).collect()
}

#[test]
fn a_gang_job_runs_to_success() {
    let mut s = cluster(2);
    let r = apply_ok(&mut s, submit("r1", spec("q", 2, 4, 0), 10));
    assert_eq!(r, Response::JobSubmitted { job: JobId(1), created: true });
    let out = schedule_once(&mut s, 11);
    assert_eq!(out.placed.len(), 2, "{out:?}");
    assert_eq!(job_state(&s, 1), JobState::Placed);
    let allocs = allocs_of(&s, 1);
    assert!(allocs.iter().all(|(_, e)| *e == 1), "first attempt is epoch 1");
    for (a, e) in &allocs {
        assert_eq!(apply_ok(&mut s, report(*a, *e, ReportedStatus::Running, 12)), Response::Done);
    }
    assert_eq!(job_state(&s, 1), JobState::Running);
    apply_ok(&mut s, report(allocs[0].0, 1, ReportedStatus::Succeeded, 20));
    assert_eq!(job_state(&s, 1), JobState::Running, "one replica of two finished");
    apply_ok(&mut s, report(allocs[1].0, 1, ReportedStatus::Succeeded, 21));
    assert_eq!(job_state(&s, 1), JobState::Succeeded);
    assert_eq!(s.live_job_count(), 0);
    // Everything is free again: an 8-GPU job fits.
    apply_ok(&mut s, submit("r2", spec("q", 2, 4, 0), 30));
    assert_eq!(schedule_once(&mut s, 31).placed.len(), 2);
}

#[test]
fn a_retried_submission_never_creates_a_second_job() {
    let mut s = cluster(1);
    let first = apply_ok(&mut s, submit("same", spec("q", 1, 1, 0), 1));
    let hash = s.state_hash();
    let rev = s.revision();
    let again = apply_ok(&mut s, submit("same", spec("q", 1, 1, 0), 2));
    assert_eq!(first, Response::JobSubmitted { job: JobId(1), created: true });
    assert_eq!(again, Response::JobSubmitted { job: JobId(1), created: false });
    assert_eq!(s.jobs().len(), 1);
    assert_eq!((s.state_hash(), s.revision()), (hash, rev), "a retry changes nothing");
    let other = apply_ok(&mut s, submit("same", spec("q", 1, 2, 0), 3));
    match other {
        Response::Rejected(CommandError::Conflict { field, .. }) => {
            assert_eq!(field, "client_request_id")
        }
        r => panic!("reusing a request id for another spec must conflict: {r:?}"),
    }
    assert_eq!(s.job_by_request("same").map(|j| j.id), Some(JobId(1)));
}

#[test]
fn the_same_request_id_with_another_retry_policy_is_another_request() {
    let mut s = cluster(1);
    let with = |retry: Option<RetryPolicy>| {
        Command::SubmitJob(Box::new(SubmitJob {
            client_request_id: "r".into(),
            spec: spec("q", 1, 1, 0),
            retry,
            now: 1,
            trace: None,
        }))
    };
    let first = apply_ok(&mut s, with(None));
    assert_eq!(first, Response::JobSubmitted { job: JobId(1), created: true });
    // An explicit copy of the default policy is the same request (what the first resolved to).
    let same = apply_ok(&mut s, with(Some(StateConfig::default().default_retry)));
    assert_eq!(same, Response::JobSubmitted { job: JobId(1), created: false });
    let hash = s.state_hash();
    let other = RetryPolicy { max_attempts: 1, ..RetryPolicy::default() };
    match apply_ok(&mut s, with(Some(other))) {
        Response::Rejected(CommandError::Conflict { field, message }) => {
            assert_eq!(field, "client_request_id");
            assert!(message.contains("retry policy"), "{message}");
        }
        r => panic!("another retry policy must conflict: {r:?}"),
    }
    assert_eq!(s.state_hash(), hash);
}

#[test]
fn jobs_go_to_leaf_queues_only() {
    let mut s = cluster(1);
    let mut child = queue("q-child", 1);
    child.parent = Some("q".into());
    apply_ok(&mut s, upsert_queue(child));
    let hash = s.state_hash();
    match apply_ok(&mut s, submit("p", spec("q", 1, 1, 0), 5)) {
        Response::Rejected(CommandError::Conflict { field, message }) => {
            assert_eq!(field, "queue");
            assert!(message.contains("leaf"), "{message}");
        }
        r => panic!("a parent queue must refuse jobs: {r:?}"),
    }
    assert_eq!(s.state_hash(), hash);
    assert!(matches!(apply_ok(&mut s, submit("c", spec("q-child", 1, 1, 0), 5)), Response::JobSubmitted { .. }));
    // A queue with live jobs cannot become a parent; the set survives a snapshot.
    let mut grandchild = queue("q-grandchild", 1);
    grandchild.parent = Some("q-child".into());
    assert!(matches!(apply_ok(&mut s, upsert_queue(grandchild)), Response::Rejected(CommandError::Conflict { .. })));
    let restored = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
    assert_eq!(restored, s);
    let mut restored = restored;
    assert!(matches!(apply_ok(&mut restored, submit("p2", spec("q", 1, 1, 0), 6)), Response::Rejected(_)));
    // Deleting the child makes the parent a leaf again.
    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(1), reason: String::new(), now: 7 }));
    apply_ok(&mut s, Command::DeleteQueue(suanli_state::DeleteQueue { queue: "q-child".into() }));
    assert!(matches!(apply_ok(&mut s, submit("p3", spec("q", 1, 1, 0), 8)), Response::JobSubmitted { .. }));
}

#[test]
fn bad_input_is_refused_naming_the_field_and_leaves_state_unchanged() {
    let mut s = cluster(1);
    let hash = s.state_hash();
    let mut bad = spec("q", 1, 1, 0);
    bad.groups[0].resources.cpu_milli = u64::MAX;
    match apply_ok(&mut s, submit("a", bad, 5)) {
        Response::Rejected(CommandError::Invalid { field, message }) => {
            assert_eq!(field, "groups[0].resources.cpu_milli");
            assert!(message.contains("between 0 and"), "{message}");
        }
        r => panic!("{r:?}"),
    }
    match apply_ok(&mut s, submit("b", spec("nope", 1, 1, 0), 5)) {
        Response::Rejected(CommandError::UnknownQueue { queue }) => assert_eq!(queue, "nope"),
        r => panic!("{r:?}"),
    }
    match apply_ok(&mut s, submit("", spec("q", 1, 1, 0), 5)) {
        Response::Rejected(CommandError::Invalid { field, .. }) => {
            assert_eq!(field, "client_request_id")
        }
        r => panic!("{r:?}"),
    }
    let long = "x".repeat(StateConfig::default().max_request_id_len + 1);
    assert!(matches!(apply_ok(&mut s, submit(&long, spec("q", 1, 1, 0), 5)), Response::Rejected(_)));
    assert!(matches!(
        apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(99), reason: String::new(), now: 5 })),
        Response::Rejected(CommandError::UnknownJob { job: 99 })
    ));
    let cfg = StateConfig { max_live_jobs: 0, ..StateConfig::default() };
    match apply_ok(&mut s, Command::UpdateConfig(Box::new(UpdateConfig { config: cfg }))) {
        Response::Rejected(CommandError::Invalid { field, .. }) => {
            assert_eq!(field, "max_live_jobs")
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(s.state_hash(), hash, "refused commands change nothing (not even the clock)");
}

#[test]
fn apply_refuses_placements_that_no_longer_hold() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 4, 0), 1));
    apply_ok(&mut s, submit("b", spec("q", 1, 4, 0), 1));
    // Two plans computed from the same view: each places one job on the only node's 4 GPUs
    // (the engine sees both jobs in one pass, so build single-job views to race them).
    let view = s.cluster_view(2);
    let mut va = view.clone();
    va.pending.retain(|p| p.id == JobId(1));
    let mut vb = view;
    vb.pending.retain(|p| p.id == JobId(2));
    let cfg = suanli_scheduler::SchedulerConfig::default();
    let pa = suanli_scheduler::schedule(&va, 2, 1, &cfg).expect("plan a");
    let pb = suanli_scheduler::schedule(&vb, 2, 1, &cfg).expect("plan b");
    assert_eq!((pa.placements.len(), pb.placements.len()), (1, 1));
    let Response::PlanApplied(oa) = apply_ok(&mut s, Command::ApplyPlan(ApplyPlan { plan: pa, now: 2 })) else {
        panic!("plan a")
    };
    let Response::PlanApplied(ob) = apply_ok(&mut s, Command::ApplyPlan(ApplyPlan { plan: pb, now: 2 })) else {
        panic!("plan b")
    };
    assert_eq!(oa.placed.len(), 1);
    assert!(ob.placed.is_empty(), "the second plan would over-commit the GPUs");
    assert_eq!(ob.refused_jobs.len(), 1);
    assert!(matches!(ob.refused_jobs[0].1, RefusalReason::DeviceFull { used: 1000, .. }), "{:?}", ob.refused_jobs);
    assert!(ob.refused_jobs[0].1.to_string().contains("milli > 1000"), "{:?}", ob.refused_jobs);
    assert_eq!(job_state(&s, 2), JobState::Pending);
    assert!(s.job(JobId(2)).is_some_and(|j| !j.reason.is_empty()), "the refusal is recorded");
}

#[test]
fn disk_pressure_keeps_new_work_off_a_node_until_it_clears() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 1, 0), 1));
    let view = s.cluster_view(2);
    let plan = suanli_scheduler::schedule(&view, 2, 1, &suanli_scheduler::SchedulerConfig::default()).expect("plan");
    let n0 = NodeId::from("n0");
    let why = "disk pressure: 1.0 MiB free < 1.0 GiB in /var/lib/suanli/agent".to_owned();
    apply_ok(&mut s, Command::NodeCondition(NodeCondition { node: n0.clone(), pressure: why.clone(), now: 2 }));
    assert!(s.cluster_view(3).nodes.iter().all(|n| !n.schedulable), "not schedulable under pressure");
    // A plan made before the condition is refused at apply, naming it.
    let Response::PlanApplied(o) = apply_ok(&mut s, Command::ApplyPlan(ApplyPlan { plan: plan.clone(), now: 3 }))
    else {
        panic!()
    };
    assert!(
        o.placed.is_empty()
            && o.refused_jobs[0].1 == RefusalReason::NodePressure { node: n0.clone(), pressure: why.clone() },
        "{o:?}"
    );
    // A re-registration (an agent restart) keeps it: only the agent's heartbeat clears it.
    apply_ok(&mut s, register(node("n0", 4), 4));
    assert_eq!(s.nodes()[&n0].pressure, why);
    assert_eq!(s.nodes()[&n0].mode, NodeMode::Schedulable, "the operator's mode is untouched");
    apply_ok(&mut s, Command::NodeCondition(NodeCondition { node: n0.clone(), pressure: String::new(), now: 5 }));
    assert!(s.cluster_view(6).nodes.iter().all(|n| n.schedulable));
    assert_eq!(schedule_once(&mut s, 6).placed.len(), 1, "placed once the pressure cleared");
    // An unknown node is refused.
    let r = s.apply(Command::NodeCondition(NodeCondition { node: NodeId::from("nope"), pressure: why, now: 7 }));
    assert!(matches!(r, Response::Rejected(CommandError::UnknownNode { .. })), "{r:?}");
}

#[test]
fn quarantine_clears_and_health_reasons_survive_re_registration() {
    let mut s = cluster(1);
    let n0 = NodeId::from("n0");
    let dev = s.nodes()[&n0].node.devices[0].id.clone();
    let clear = |device: &str, now| {
        Command::ClearQuarantine(ClearQuarantine { node: n0.clone(), device: device.to_owned(), now })
    };
    apply_ok(&mut s, clear(&dev, 2));
    apply_ok(&mut s, clear(&dev, 3));
    assert_eq!(s.nodes()[&n0].quarantine_clears.get(&dev), Some(&2));
    // An agent restart keeps the count (the agent compares against it).
    apply_ok(&mut s, register(node("n0", 4), 4));
    assert_eq!(s.nodes()[&n0].quarantine_clears.get(&dev), Some(&2));
    // An unknown device or node is refused, naming it; nothing changes.
    let r = s.apply(clear("gpu99", 5));
    assert!(matches!(&r, Response::Rejected(CommandError::UnknownDevice { device, .. }) if device == "gpu99"), "{r:?}");
    let r =
        s.apply(Command::ClearQuarantine(ClearQuarantine { node: NodeId::from("nope"), device: dev.clone(), now: 6 }));
    assert!(matches!(r, Response::Rejected(CommandError::UnknownNode { .. })), "{r:?}");
    assert_eq!(s.nodes()[&n0].quarantine_clears.len(), 1);
    // A device's reason is kept while it is unhealthy, across re-registration as long as the
    // inventory still says unhealthy, and dropped when it is healthy again.
    let health = |healthy: bool, reason: &str, now| {
        Command::DeviceHealth(DeviceHealth {
            node: n0.clone(),
            device: dev.clone(),
            health: if healthy { Health::Healthy } else { Health::Unhealthy },
            reason: reason.to_owned(),
            now,
        })
    };
    apply_ok(&mut s, health(false, "quarantined: XID 64 (fatal)", 8));
    assert_eq!(s.nodes()[&n0].device_reasons.get(&dev).map(String::as_str), Some("quarantined: XID 64 (fatal)"));
    let mut sick = node("n0", 4);
    sick.devices.iter_mut().filter(|d| d.id == dev).for_each(|d| d.health = Health::Unhealthy);
    apply_ok(&mut s, register(sick, 9));
    assert!(s.nodes()[&n0].device_reasons.contains_key(&dev), "kept while the inventory says unhealthy");
    apply_ok(&mut s, health(true, "ignored", 10));
    assert!(s.nodes()[&n0].device_reasons.is_empty(), "a healthy device has no reason");
    apply_ok(&mut s, health(false, "recovering: XID 79", 11));
    apply_ok(&mut s, register(node("n0", 4), 12));
    assert!(s.nodes()[&n0].device_reasons.is_empty(), "the new inventory says healthy");
    // The command's JSON form round-trips (it travels in the log).
    let c = clear(&dev, 13);
    let text = serde_json::to_string(&c).expect("encode");
    assert!(text.contains("\"clear_quarantine\""), "{text}");
    assert_eq!(serde_json::from_str::<Command>(&text).expect("decode"), c);
}

#[test]
fn a_plan_is_rechecked_against_health_cordons_and_job_state() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 1, 0), 1));
    let view = s.cluster_view(2);
    let plan = suanli_scheduler::schedule(&view, 2, 1, &suanli_scheduler::SchedulerConfig::default()).expect("plan");
    let dev = plan.placements[0].devices[0].device.clone();
    let n0 = NodeId::from("n0");

    let mut t = s.clone();
    apply_ok(
        &mut t,
        Command::DeviceHealth(DeviceHealth {
            node: n0.clone(),
            device: dev,
            health: Health::Unhealthy,
            reason: String::new(),
            now: 2,
        }),
    );
    let Response::PlanApplied(o) = apply_ok(&mut t, Command::ApplyPlan(ApplyPlan { plan: plan.clone(), now: 2 }))
    else {
        panic!()
    };
    assert!(o.placed.is_empty() && o.refused_jobs[0].1.kind() == "unhealthy_device", "{o:?}");

    let mut t = s.clone();
    apply_ok(
        &mut t,
        Command::SetNodeMode(SetNodeMode { node: n0.clone(), mode: NodeMode::Cordoned, now: 2, drain: None }),
    );
    let Response::PlanApplied(o) = apply_ok(&mut t, Command::ApplyPlan(ApplyPlan { plan: plan.clone(), now: 2 }))
    else {
        panic!()
    };
    assert!(o.placed.is_empty(), "{o:?}");
    assert!(t.cluster_view(3).nodes.iter().all(|n| !n.schedulable));

    let mut t = s.clone();
    apply_ok(&mut t, Command::CancelJob(CancelJob { job: JobId(1), reason: String::new(), now: 2 }));
    let Response::PlanApplied(o) = apply_ok(&mut t, Command::ApplyPlan(ApplyPlan { plan: plan.clone(), now: 2 }))
    else {
        panic!()
    };
    assert!(o.placed.is_empty() && o.refused_jobs[0].1.to_string().contains("not pending"), "{o:?}");

    // The same plan twice: the second finds the job placed already.
    let mut t = s.clone();
    apply_ok(&mut t, Command::ApplyPlan(ApplyPlan { plan: plan.clone(), now: 2 }));
    let Response::PlanApplied(o) = apply_ok(&mut t, Command::ApplyPlan(ApplyPlan { plan, now: 2 })) else { panic!() };
    assert!(o.placed.is_empty(), "{o:?}");
}

#[test]
fn hand_made_plans_cannot_overcommit_or_cheat() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 2, 1, 0), 1));
    let p = |replica: u32, dev: &str, milli: u32| Placement {
        job: JobId(1),
        group: 0,
        replica,
        node: NodeId::from("n0"),
        cpu_milli: 1000,
        memory_mib: 1024,
        devices: vec![DeviceShare { device: dev.into(), milli, memory_mib: 0 }],
        borrowed: false,
    };
    let try_plan = |s: &mut State, placements: Vec<Placement>| {
        let plan = Plan { placements, ..Plan::default() };
        match apply_ok(s, Command::ApplyPlan(ApplyPlan { plan, now: 2 })) {
            Response::PlanApplied(o) => o,
            r => panic!("{r:?}"),
        }
    };
    let mut t = s.clone();
    let o = try_plan(&mut t, vec![p(0, "gpu0", 1000), p(1, "gpu0", 1000)]);
    assert!(o.placed.is_empty(), "same GPU twice: {o:?}");
    let o = try_plan(&mut t, vec![p(0, "gpu0", 1000)]);
    assert!(
        o.placed.is_empty() && matches!(o.refused_jobs[0].1, RefusalReason::GroupShort { .. }),
        "gang needs both: {o:?}"
    );
    let o = try_plan(&mut t, vec![p(0, "gpu0", 500), p(1, "gpu1", 500)]);
    assert!(o.placed.is_empty(), "half a GPU when a whole one is asked: {o:?}");
    let o = try_plan(&mut t, vec![p(0, "gpu9", 1000), p(1, "gpu1", 1000)]);
    assert!(o.placed.is_empty(), "unknown device: {o:?}");
    let o = try_plan(&mut t, vec![p(0, "gpu0", 1000), p(0, "gpu1", 1000)]);
    assert!(o.placed.is_empty(), "one replica placed twice: {o:?}");
    let o = try_plan(&mut t, vec![p(0, "gpu0", 1000), p(1, "gpu1", 1000)]);
    assert_eq!(o.placed.len(), 2, "{o:?}");
}

#[test]
fn failures_retry_with_backoff_then_fail() {
    let mut s = cluster(1);
    let retry = RetryPolicy { max_attempts: 2, backoff_base_s: 30, backoff_max_s: 60 };
    let sub =
        SubmitJob { client_request_id: "a".into(), spec: spec("q", 1, 1, 0), retry: Some(retry), now: 1, trace: None };
    apply_ok(&mut s, Command::SubmitJob(Box::new(sub)));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, report(a, e, ReportedStatus::Failed, 10));
    let j = s.job(JobId(1)).expect("job");
    assert_eq!((j.state, j.failures, j.not_before), (JobState::Pending, 1, 40), "requeued with backoff");
    assert!(s.cluster_view(39).pending.is_empty(), "in backoff");
    assert!(schedule_once(&mut s, 39).placed.is_empty());
    assert_eq!(schedule_once(&mut s, 40).placed.len(), 1);
    let (a2, e2) = allocs_of(&s, 1)[0];
    assert_eq!(e2, 2, "the second attempt is epoch 2");
    // A late report from the first attempt is refused: it is stale.
    assert!(matches!(
        apply_ok(&mut s, report(a, e, ReportedStatus::Running, 41)),
        Response::Rejected(CommandError::UnknownAlloc { .. } | CommandError::StaleEpoch { .. })
    ));
    assert!(matches!(
        apply_ok(&mut s, report(a2, 1, ReportedStatus::Running, 41)),
        Response::Rejected(CommandError::StaleEpoch { reported: 1, current: 2, .. })
    ));
    // The first attempt's allocation is gone from the state, but not from the job's history.
    let h = &s.job(JobId(1)).expect("job").history;
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(
        (h[0].attempt, h[0].alloc, h[0].state, h[0].started_at, h[0].ended_at),
        (1, a, AllocState::Failed, 3, 10)
    );
    apply_ok(&mut s, report(a2, e2, ReportedStatus::Failed, 50));
    assert_eq!(job_state(&s, 1), JobState::Failed, "two attempts failed");
    // Repeating a terminal report is harmless; contradicting it is refused.
    assert_eq!(apply_ok(&mut s, report(a2, e2, ReportedStatus::Failed, 51)), Response::Done);
    assert!(matches!(apply_ok(&mut s, report(a2, e2, ReportedStatus::Succeeded, 51)), Response::Rejected(_)));
}

fn stopping_for_drain(s: &State, a: AllocId) -> bool {
    matches!(&s.allocs()[&a].desired, Desired::Stop { reason: StopReason::Drain, .. })
}

#[test]
fn a_drain_waits_its_grace_then_evicts_within_its_budget() {
    let mut s = cluster(2);
    let (n0, n1) = (NodeId::from("n0"), NodeId::from("n1"));
    let mode =
        |node: &NodeId, mode, now, drain| Command::SetNodeMode(SetNodeMode { node: node.clone(), mode, now, drain });
    // Three jobs, all on n0.
    apply_ok(&mut s, mode(&n1, NodeMode::Cordoned, 1, None));
    for i in 0..3 {
        apply_ok(&mut s, submit(&format!("j{i}"), spec("q", 1, 1, 0), 1));
    }
    assert_eq!(schedule_once(&mut s, 2).placed.len(), 3);
    let first: Vec<(AllocId, u64)> = (1..=3).map(|j| allocs_of(&s, j)[0]).collect();
    for &(a, e) in &first {
        apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    }
    apply_ok(&mut s, mode(&n1, NodeMode::Schedulable, 4, None));

    // Grace 100 s, at most one job away at once: nothing moves before the deadline.
    let opts = DrainOptions { grace_s: 100, max_unavailable: 1 };
    apply_ok(&mut s, mode(&n0, NodeMode::Draining, 10, Some(opts)));
    assert!(first.iter().all(|(a, _)| !stopping_for_drain(&s, *a)), "evicted within the grace period");
    assert_eq!(s.cluster_view(11).unschedulable.get(&n0).map(String::as_str), Some("draining"));
    // (The deadline is 10 + 100 + 1: cluster time counts whole seconds.)
    assert!(s.drains_due(110).is_empty());
    assert_eq!(s.drains_due(111), vec![n0.clone()]);
    // The leader's drain step at the deadline evicts one job (job order), no more.
    apply_ok(&mut s, mode(&n0, NodeMode::Draining, 111, None));
    let evicted: Vec<bool> = first.iter().map(|(a, _)| stopping_for_drain(&s, *a)).collect();
    assert_eq!(evicted, vec![true, false, false]);
    assert!(s.drains_due(111).is_empty(), "the budget is used");
    assert_eq!(s.nodes()[&n0].drain.as_ref().map(|d| d.moving.len()), Some(1));
    // The evicted job stops, is placed on n1: still away until it runs.
    apply_ok(&mut s, report(first[0].0, first[0].1, ReportedStatus::Stopped, 111));
    assert_eq!(schedule_once(&mut s, 112).placed.len(), 1);
    let (b, eb) = allocs_of(&s, 1)[0];
    assert_eq!(s.allocs()[&b].alloc.node, n1);
    assert!(!stopping_for_drain(&s, first[1].0), "job 1 is placed, not running: still away");
    // Running again: the budget frees and the next job is evicted in the same step.
    apply_ok(&mut s, report(b, eb, ReportedStatus::Running, 113));
    assert!(stopping_for_drain(&s, first[1].0) && !stopping_for_drain(&s, first[2].0));
    // Uncordoning ends the drain and its plan.
    apply_ok(&mut s, mode(&n0, NodeMode::Schedulable, 114, None));
    assert!(s.nodes()[&n0].drain.is_none() && s.drains_due(1000).is_empty());
}

#[test]
fn attempt_history_is_bounded_and_survives_a_snapshot() {
    let mut s = cluster(1);
    let retry = RetryPolicy { max_attempts: 100, backoff_base_s: 0, backoff_max_s: 0 };
    let sub =
        SubmitJob { client_request_id: "a".into(), spec: spec("q", 1, 1, 0), retry: Some(retry), now: 1, trace: None };
    apply_ok(&mut s, Command::SubmitJob(Box::new(sub)));
    let n = MAX_ATTEMPT_HISTORY as u64 + 5;
    for t in 0..n {
        let now = 10 + t * 10;
        assert_eq!(schedule_once(&mut s, now).placed.len(), 1, "attempt {}", t + 1);
        let (a, e) = allocs_of(&s, 1)[0];
        apply_ok(&mut s, report(a, e, ReportedStatus::Failed, now + 1));
    }
    let j = s.job(JobId(1)).expect("job");
    assert_eq!(j.history.len(), MAX_ATTEMPT_HISTORY, "bounded");
    assert_eq!(j.history.first().map(|h| h.attempt), Some(6), "the oldest went first");
    assert_eq!(j.history.last().map(|h| h.attempt), Some(n));
    let back = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
    assert_eq!(back.job(JobId(1)).expect("job").history, j.history);
}

#[test]
fn the_log_digest_rides_in_snapshots_but_not_in_the_state_hash() {
    let mut s = cluster(1);
    let hash = s.state_hash();
    s.set_log_digest(0xfeed);
    assert_eq!(s.state_hash(), hash, "the log digest is not state");
    let back = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
    assert_eq!(back.log_digest(), 0xfeed);
}

#[test]
fn a_lost_node_requeues_its_jobs_without_counting_a_failure() {
    let mut s = cluster(2);
    apply_ok(&mut s, submit("a", spec("q", 1, 4, 0), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    let node = s.allocs()[&a].alloc.node.clone();
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, Command::NodeDown(NodeDown { node: node.clone(), reason: "no heartbeat".into(), now: 10 }));
    let j = s.job(JobId(1)).expect("job");
    assert_eq!((j.state, j.failures, j.requeues), (JobState::Pending, 0, 1));
    assert_eq!(schedule_once(&mut s, 11).placed.len(), 1);
    let (a2, _) = allocs_of(&s, 1)[0];
    assert_ne!(s.allocs()[&a2].alloc.node, node, "placed on the surviving node");
    // The node comes back and re-registers: it is ready again, its old work is gone.
    apply_ok(&mut s, register(node_named(&node), 12));
    assert!(s.cluster_view(12).nodes.iter().all(|n| n.schedulable));
}

fn node_named(id: &NodeId) -> suanli_model::Node {
    node(id.as_str(), 4)
}

#[test]
fn drain_and_unhealthy_devices_move_work() {
    let mut s = cluster(2);
    apply_ok(&mut s, submit("a", spec("q", 1, 1, 0), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    let (node, dev) = {
        let x = &s.allocs()[&a].alloc;
        (x.node.clone(), x.devices[0].device.clone())
    };
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(
        &mut s,
        Command::DeviceHealth(DeviceHealth {
            node: node.clone(),
            device: dev,
            health: Health::Unhealthy,
            reason: String::new(),
            now: 4,
        }),
    );
    assert_eq!(job_state(&s, 1), JobState::Requeuing);
    assert!(matches!(&s.allocs()[&a].desired, Desired::Stop { reason: StopReason::DeviceUnhealthy, .. }));
    assert!(s.cluster_view(5).running.iter().all(|x| !x.preemptible), "stopping work is not a victim");
    apply_ok(&mut s, report(a, e, ReportedStatus::Stopped, 5));
    assert_eq!(job_state(&s, 1), JobState::Pending);
    schedule_once(&mut s, 6);
    let (b, eb) = allocs_of(&s, 1)[0];
    let node_b = s.allocs()[&b].alloc.node.clone();
    apply_ok(&mut s, report(b, eb, ReportedStatus::Running, 7));
    apply_ok(
        &mut s,
        Command::SetNodeMode(SetNodeMode { node: node_b.clone(), mode: NodeMode::Draining, now: 8, drain: None }),
    );
    assert!(matches!(&s.allocs()[&b].desired, Desired::Stop { reason: StopReason::Drain, .. }));
    apply_ok(&mut s, report(b, eb, ReportedStatus::Stopped, 9));
    assert_eq!(job_state(&s, 1), JobState::Pending);
    let out = schedule_once(&mut s, 10);
    assert_eq!(out.placed.len(), 1);
    assert_ne!(s.allocs()[&out.placed[0]].alloc.node, node_b, "not back on the draining node");
}

#[test]
fn preemption_stops_the_victim_then_places_the_urgent_job() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("low", spec("q", 1, 4, 0), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, submit("high", spec("q", 1, 4, 100), 4));
    let out = schedule_once(&mut s, 5);
    assert_eq!(out.preempted, vec![a], "{out:?}");
    assert_eq!(job_state(&s, 1), JobState::Preempted);
    assert_eq!(job_state(&s, 2), JobState::Pending);
    // While the victim stops, nothing else may land on its GPUs.
    assert!(schedule_once(&mut s, 6).placed.is_empty());
    apply_ok(&mut s, report(a, e, ReportedStatus::Stopped, 7));
    assert_eq!(job_state(&s, 1), JobState::Pending, "the victim is requeued");
    let out = schedule_once(&mut s, 8);
    assert_eq!(out.placed.len(), 1);
    assert_eq!(s.allocs()[&out.placed[0]].alloc.job, JobId(2));
}

#[test]
fn preemptions_are_rechecked() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("low", spec("q", 1, 4, 50), 1));
    schedule_once(&mut s, 2);
    let (a, _) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, submit("also-low", spec("q", 1, 4, 10), 3));
    let pre = Preemption {
        alloc: a,
        job: JobId(1),
        node: NodeId::from("n0"),
        for_job: JobId(2),
        reason: PreemptionReason::HigherPriority,
        checkpoint_first: false,
        grace_s: 0,
    };
    let plan = Plan { preemptions: vec![pre], ..Plan::default() };
    let Response::PlanApplied(o) = apply_ok(&mut s, Command::ApplyPlan(ApplyPlan { plan, now: 4 })) else { panic!() };
    assert!(o.preempted.is_empty() && o.refused_preemptions.len() == 1, "a lower priority cannot preempt: {o:?}");
    assert_eq!(o.refused_preemptions[0].1.kind(), "not_outranked", "{o:?}");
    assert_eq!(job_state(&s, 1), JobState::Placed);
}

#[test]
fn cancel_stops_running_work_and_is_idempotent() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 1, 0), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    let cancel = || Command::CancelJob(CancelJob { job: JobId(1), reason: "user".into(), now: 3 });
    apply_ok(&mut s, cancel());
    assert_eq!(job_state(&s, 1), JobState::Cancelled);
    assert!(matches!(&s.allocs()[&a].desired, Desired::Stop { reason: StopReason::Cancelled, .. }));
    let h = s.state_hash();
    assert_eq!(apply_ok(&mut s, cancel()), Response::Done);
    assert_eq!(s.state_hash(), h);
    apply_ok(&mut s, report(a, e, ReportedStatus::Stopped, 4));
    assert_eq!(s.allocs()[&a].state, AllocState::Stopped);
}

#[test]
fn finished_jobs_are_forgotten_beyond_the_retention_limit() {
    let mut s = cluster(1);
    let cfg = StateConfig { max_retained_jobs: 2, max_live_jobs: 3, ..StateConfig::default() };
    apply_ok(&mut s, Command::UpdateConfig(Box::new(UpdateConfig { config: cfg })));
    for i in 0..3 {
        apply_ok(&mut s, submit(&format!("r{i}"), spec("q", 1, 1, 0), 1));
    }
    assert!(matches!(
        apply_ok(&mut s, submit("r3", spec("q", 1, 1, 0), 1)),
        Response::Rejected(CommandError::TooMany { limit: 3, .. })
    ));
    for i in 1..=3 {
        apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(i), reason: String::new(), now: 2 }));
    }
    assert_eq!(s.jobs().len(), 2);
    assert!(s.job(JobId(1)).is_none() && s.job_by_request("r0").is_none(), "the oldest is forgotten");
    assert!(s.job(JobId(3)).is_some());
}

#[test]
fn unknown_commands_are_skipped_only_when_ignorable() {
    let mut s = cluster(1);
    let h = s.state_hash();
    let ign: Command =
        serde_json::from_str(r#"{"v":2,"kind":"set_price","ignorable":true,"body":{}}"#).expect("decodes");
    assert_eq!(apply_ok(&mut s, ign), Response::Ignored { kind: "set_price".into() });
    assert_eq!(s.state_hash(), h);
    let hard: Command = serde_json::from_str(r#"{"v":2,"kind":"split_brain","body":{}}"#).expect("decodes");
    let r = apply_ok(&mut s, hard);
    assert!(r.is_fatal(), "{r:?}");
    assert_eq!(s.state_hash(), h);
}

#[test]
fn snapshot_restore_keeps_the_hash() {
    let mut s = cluster(2);
    apply_ok(&mut s, submit("a", spec("q", 2, 2, 0), 1));
    schedule_once(&mut s, 2);
    let bytes = s.snapshot().expect("snapshot");
    let t = State::restore(&bytes).expect("restore");
    assert_eq!(t, s);
    assert_eq!(t.state_hash(), s.state_hash());
    assert!(State::restore(b"{\"format\":99,\"state\":{}}").is_err());
    assert!(State::restore(b"garbage").is_err());
}

#[test]
fn shrinking_a_quota_relabels_running_work_as_borrowed() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 2, 0), 1));
    apply_ok(&mut s, submit("b", spec("q", 1, 2, 5), 1));
    assert_eq!(schedule_once(&mut s, 2).placed.len(), 2);
    apply_ok(&mut s, upsert_queue(queue("q", 2)));
    let borrowed: Vec<bool> = s.allocs().values().map(|a| a.alloc.borrowed).collect();
    assert_eq!(borrowed.iter().filter(|b| **b).count(), 1, "{borrowed:?}");
    let low = s.allocs().values().find(|a| a.alloc.borrowed).expect("one borrowed");
    assert_eq!(low.alloc.priority, 0, "the lower priority one is relabelled");
}

#[test]
fn queues_refuse_cycles_and_deleting_used_queues() {
    let mut s = cluster(1);
    let mut child = queue("child", 1);
    child.parent = Some("q".into());
    apply_ok(&mut s, upsert_queue(child));
    let mut q = queue("q", 8);
    q.parent = Some("child".into());
    assert!(matches!(apply_ok(&mut s, upsert_queue(q)), Response::Rejected(CommandError::Invalid { .. })));
    let del = |q: &str| Command::DeleteQueue(suanli_state::DeleteQueue { queue: q.into() });
    assert!(matches!(apply_ok(&mut s, del("q")), Response::Rejected(CommandError::Conflict { .. })));
    apply_ok(&mut s, submit("a", spec("child", 1, 1, 0), 1));
    assert!(matches!(apply_ok(&mut s, del("child")), Response::Rejected(CommandError::Conflict { .. })));
    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(1), reason: String::new(), now: 2 }));
    assert_eq!(apply_ok(&mut s, del("child")), Response::Done);
}

#[test]
fn time_never_goes_backwards() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 1, 0), 100));
    apply_ok(&mut s, submit("b", spec("q", 1, 1, 0), 50));
    assert_eq!(s.clock(), 100);
    assert_eq!(s.job(JobId(2)).map(|j| j.submitted_at), Some(100));
}

#[test]
fn re_registering_with_less_capacity_loses_only_what_no_longer_fits() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 2, 0), 1));
    apply_ok(&mut s, submit("b", spec("q", 1, 1, 0), 1));
    assert_eq!(schedule_once(&mut s, 2).placed.len(), 2);
    let mut smaller = node("n0", 4);
    smaller.devices.truncate(0);
    let used: Vec<String> =
        s.allocs().values().flat_map(|a| a.alloc.devices.iter().map(|d| d.device.clone())).collect();
    // Keep exactly the devices of one job, and turn the others into NPUs (a kind change).
    let keep =
        s.allocs().values().find(|a| a.alloc.job == JobId(2)).expect("job 2 placed").alloc.devices[0].device.clone();
    for id in 0..4 {
        let mut d = suanli_model::Device::simple(format!("gpu{id}"), suanli_model::DeviceKind::Gpu, "A100");
        if d.id != keep && used.contains(&d.id) {
            d.kind = suanli_model::DeviceKind::Npu;
        }
        smaller.devices.push(d);
    }
    apply_ok(&mut s, register(smaller, 3));
    assert_eq!(job_state(&s, 1), JobState::Pending, "its devices changed kind: lost and requeued");
    assert_eq!(job_state(&s, 2), JobState::Placed, "its device is unchanged");
    let mut tiny = node("n0", 4);
    tiny.cpu_milli = 500;
    apply_ok(&mut s, register(tiny, 4));
    assert_eq!(job_state(&s, 2), JobState::Pending, "no longer fits the node's cpu");
}

#[test]
fn a_batch_applies_each_command_as_its_own_entry() {
    let mut s = cluster(1);
    let mut one = cluster(1);
    let cmds = vec![
        submit("b1", spec("q", 1, 1, 0), 10),
        submit("b2", spec("nope", 1, 1, 0), 10),
        submit("b1", spec("q", 1, 1, 0), 10),
        submit("b3", spec("q", 1, 1, 0), 10),
    ];
    let singles: Vec<Response> = cmds.iter().map(|c| one.apply(c.clone())).collect();
    let r = s.apply(Command::Batch(suanli_state::Batch { commands: cmds }));
    assert_eq!(r, Response::Batch(singles), "a batch answers exactly like its commands one by one");
    assert_eq!(s.state_hash(), one.state_hash(), "and leaves the same state");
    assert_eq!(s.revision(), one.revision(), "with one revision per change");
    let nested = Command::Batch(suanli_state::Batch {
        commands: vec![Command::Batch(suanli_state::Batch { commands: vec![] })],
    });
    let before = s.state_hash();
    assert!(matches!(s.apply(nested), Response::Rejected(CommandError::Invalid { .. })));
    assert_eq!(s.state_hash(), before);
}

#[test]
fn cluster_time_never_goes_backwards_and_a_retry_waits_from_it() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 1, 0), 100));
    assert_eq!(s.clock(), 100);
    // A command stamped earlier (a leader whose clock is behind) does not move time back.
    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(9), reason: "x".into(), now: 50 }));
    assert_eq!(s.clock(), 100, "time is the latest seen, never an earlier stamp");
    let retry = RetryPolicy { max_attempts: 3, backoff_base_s: 8, backoff_max_s: 60 };
    let sub =
        SubmitJob { client_request_id: "b".into(), spec: spec("q", 1, 1, 0), retry: Some(retry), now: 90, trace: None };
    apply_ok(&mut s, Command::SubmitJob(Box::new(sub)));
    schedule_once(&mut s, 101);
    let (a, e) = allocs_of(&s, 2)[0];
    // The failure report is stamped behind cluster time: the backoff counts from cluster time.
    apply_ok(&mut s, report(a, e, ReportedStatus::Failed, 95));
    let j = s.job(JobId(2)).expect("job");
    assert_eq!(j.not_before, 101 + 8, "8 s from the cluster's time, not from a stamp behind it");
}

#[test]
fn stamping_sets_every_time_a_command_carries_but_a_plans() {
    let mut c = Command::Batch(suanli_state::Batch {
        commands: vec![
            submit("a", spec("q", 1, 1, 0), 1),
            Command::CancelJob(CancelJob { job: JobId(1), reason: "x".into(), now: 2 }),
            register(node("n", 1), 3),
        ],
    });
    c.stamp(77);
    let Command::Batch(b) = &c else { panic!("a batch") };
    for cmd in &b.commands {
        let now = match cmd {
            Command::SubmitJob(x) => x.now,
            Command::CancelJob(x) => x.now,
            Command::RegisterNode(x) => x.now,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(now, 77, "{cmd:?}");
    }
    let mut p = Command::ApplyPlan(ApplyPlan { plan: Plan::default(), now: 5 });
    p.stamp(77);
    assert_eq!(p, Command::ApplyPlan(ApplyPlan { plan: Plan::default(), now: 5 }), "a plan keeps its own now");
}

#[test]
fn an_agents_fence_is_kept_and_old_entries_without_it_decode() {
    let mut s = cluster(0);
    let fence = suanli_state::AgentFence { after_ms: 1000, kill_grace_ms: 0 };
    let c =
        Command::RegisterNode(Box::new(suanli_state::RegisterNode { node: node("f", 1), now: 5, fence: Some(fence) }));
    apply_ok(&mut s, c);
    let r = &s.nodes()[&NodeId::from("f")];
    assert_eq!(r.fence, Some(fence));
    assert_eq!(fence.total_ms(3000), 1000 + 600, "automatic G is a fifth of the TTL");
    // An entry written before the field existed decodes, and encodes back without it.
    let old = register(node("g", 1), 6);
    let text = serde_json::to_string(&old).expect("encodes");
    assert!(!text.contains("fence"), "{text}");
    let back: Command = serde_json::from_str(&text).expect("decodes");
    assert_eq!(back, old);
}
