//! The state machine's side of checkpoints (issue 18): classified ends, lost work, checkpoint
//! records, capacity held for a preempting job, migration, avoiding the node that failed an
//! attempt, hardware-bound checkpoints, and the checkpoint configuration.

mod common;

use common::*;
use suanli_model::{
    AllocId, CheckpointHardware, CheckpointPolicy, DeviceKind, DeviceShare, JobId, JobSpec, NodeId, Placement, Plan,
    PoolId,
};
use suanli_state::{
    AllocStatus, ApplyPlan, Command, CommandError, Desired, EndClass, Job, JobState, MigrateJob, NOMINATION_SLACK_S,
    NodeDown, NodeMode, ReportCheckpoint, ReportedStatus, Response, SetNodeMode, State, StateConfig, StopReason,
    UpdateConfig,
};

fn job(s: &State, id: u64) -> &Job {
    s.job(JobId(id)).expect("job exists")
}

fn allocs_of(s: &State, id: u64) -> Vec<(AllocId, u64)> {
    job(s, id).allocs.iter().map(|a| (*a, s.allocs()[a].alloc.epoch)).collect()
}

fn with_checkpoints(mut sp: JobSpec, grace_s: u64) -> JobSpec {
    sp.checkpoint = Some(CheckpointPolicy { interval_s: 60, grace_s, restore_s: 5, signal: Default::default() });
    sp
}

fn ended(alloc: AllocId, epoch: u64, status: ReportedStatus, end: EndClass, code: Option<i32>, now: u64) -> Command {
    Command::AllocStatus(AllocStatus {
        alloc,
        epoch,
        status,
        message: "bye".into(),
        end: Some(end),
        exit_code: code,
        now,
    })
}

fn checkpoint(alloc: AllocId, epoch: u64, step: u64, hardware: Option<CheckpointHardware>, now: u64) -> Command {
    Command::ReportCheckpoint(ReportCheckpoint {
        alloc,
        epoch,
        uri: format!("file:///ck/a{epoch}-s{step}"),
        step,
        size_bytes: 10,
        wall_time: 1_700_000_000 + step,
        hardware,
        now,
    })
}

fn rejected_field(r: Response) -> String {
    match r {
        Response::Rejected(CommandError::Invalid { field, .. } | CommandError::Conflict { field, .. }) => field,
        other => panic!("expected a refusal naming a field, got {other:?}"),
    }
}

fn migrate(job: u64, to_pool: Option<&str>, to_node: Option<&str>, now: u64) -> Command {
    Command::MigrateJob(MigrateJob {
        job: JobId(job),
        to_pool: to_pool.map(PoolId::from),
        to_node: to_node.map(NodeId::from),
        now,
    })
}

/// Places replica 0 of a one-replica job on `node`'s GPUs `gpus` (whole ones).
fn place_on(s: &mut State, job: u64, node: &str, gpus: &[u32], now: u64) -> Vec<AllocId> {
    let p = Placement {
        job: JobId(job),
        group: 0,
        replica: 0,
        node: NodeId::from(node),
        cpu_milli: 1000,
        memory_mib: 1024,
        devices: gpus.iter().map(|i| DeviceShare { device: format!("gpu{i}"), milli: 1000, memory_mib: 0 }).collect(),
        borrowed: false,
    };
    let plan = Plan { placements: vec![p], ..Plan::default() };
    match apply_ok(s, Command::ApplyPlan(ApplyPlan { plan, now })) {
        Response::PlanApplied(o) => o.placed,
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_application_failure_is_classified_and_counts_against_max_attempts() {
    let mut s = cluster(2);
    apply_ok(&mut s, submit("a", spec("q", 1, 2, 0), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    let node = s.allocs()[&a].alloc.node.clone();
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 10));
    apply_ok(&mut s, ended(a, e, ReportedStatus::Failed, EndClass::Oom, Some(137), 20));
    let j = job(&s, 1);
    assert_eq!((j.state, j.failures, j.infra_requeues, j.requeues), (JobState::Pending, 1, 0, 1));
    let h = &j.history[0];
    assert_eq!((h.end, h.exit_code, h.lost_device_s), (Some(EndClass::Oom), Some(137), 20), "10 s x 2 GPUs");
    assert_eq!(j.lost_device_s, 20);
    // The next attempt avoids the node it failed on, for avoid_failed_node_s.
    let until = 20 + StateConfig::default().avoid_failed_node_s;
    assert_eq!(j.avoid.as_ref().map(|a| (&a.node, a.until)), Some((&node, until)));
    let avoided = |s: &State, now: u64| s.cluster_view(now).pending[0].spec.constraints.avoid_nodes.clone();
    assert_eq!(avoided(&s, until - 1), vec![node.clone()]);
    assert!(avoided(&s, until).is_empty(), "after the window a one-node pool recovers");
}

#[test]
fn the_only_node_that_can_run_a_job_is_not_avoided() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 2, 0), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 10));
    apply_ok(&mut s, ended(a, e, ReportedStatus::Failed, EndClass::Exit, Some(3), 20));
    let j = job(&s, 1);
    assert!(j.avoid.is_some(), "the failure is recorded against the node");
    // No other node could run it: it goes back to the same node after its backoff.
    let now = j.not_before.max(21);
    assert!(s.cluster_view(now).pending[0].spec.constraints.avoid_nodes.is_empty());
}

#[test]
fn infrastructure_ends_do_not_use_up_attempts_but_are_bounded() {
    let mut s = cluster(2);
    let config = StateConfig { max_infra_requeues: 3, ..StateConfig::default() };
    apply_ok(&mut s, Command::UpdateConfig(Box::new(UpdateConfig { config })));
    let mut sub = submit("a", spec("q", 1, 1, 0), 1);
    if let Command::SubmitJob(c) = &mut sub {
        c.retry = Some(suanli_state::RetryPolicy { max_attempts: 1, backoff_base_s: 1, backoff_max_s: 1 });
    }
    apply_ok(&mut s, sub);
    let mut now = 2;
    // A device error the agent saw, then a lost node: neither is a failure of the job.
    schedule_once(&mut s, now);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, now));
    apply_ok(&mut s, ended(a, e, ReportedStatus::Failed, EndClass::DeviceError, None, now + 1));
    let j = job(&s, 1);
    assert_eq!((j.state, j.failures, j.infra_requeues), (JobState::Pending, 0, 1), "{}", j.reason);
    assert_eq!(j.history[0].end, Some(EndClass::DeviceError));
    now += 10;
    schedule_once(&mut s, now);
    let (a, _) = allocs_of(&s, 1)[0];
    let node = s.allocs()[&a].alloc.node.clone();
    apply_ok(&mut s, Command::NodeDown(NodeDown { node: node.clone(), reason: "ttl".into(), now }));
    let j = job(&s, 1);
    assert_eq!((j.state, j.failures, j.infra_requeues), (JobState::Pending, 0, 2));
    assert_eq!(j.history[1].end, Some(EndClass::NodeLost));
    apply_ok(&mut s, register(node_like(&node), now));
    // The third infrastructure requeue reaches max_infra_requeues: the job fails, saying so.
    now += 10;
    schedule_once(&mut s, now);
    let (a, _) = allocs_of(&s, 1)[0];
    let node = s.allocs()[&a].alloc.node.clone();
    apply_ok(&mut s, Command::NodeDown(NodeDown { node, reason: "ttl".into(), now }));
    let j = job(&s, 1);
    assert_eq!((j.state, j.infra_requeues), (JobState::Failed, 3));
    assert!(j.reason.contains("max_infra_requeues"), "{}", j.reason);
}

fn node_like(id: &NodeId) -> suanli_model::Node {
    node(id.as_str(), 4)
}

#[test]
fn agents_report_only_the_ends_they_may_see() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", spec("q", 1, 1, 0), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    let before = s.state_hash();
    for (status, end) in [
        (ReportedStatus::Stopped, EndClass::Preempted),
        (ReportedStatus::Failed, EndClass::Migrated),
        (ReportedStatus::Stopped, EndClass::Cancelled),
        (ReportedStatus::Failed, EndClass::Succeeded),
        (ReportedStatus::Succeeded, EndClass::Exit),
        (ReportedStatus::Running, EndClass::Exit),
    ] {
        assert_eq!(rejected_field(s.apply(ended(a, e, status, end, None, 3))), "end", "{status:?} {end:?}");
    }
    assert_eq!(s.state_hash(), before, "refused reports change nothing");
    apply_ok(&mut s, ended(a, e, ReportedStatus::Succeeded, EndClass::Succeeded, Some(0), 4));
    let a = &s.allocs()[&a];
    assert_eq!((a.end, a.exit_code, a.lost_device_s), (Some(EndClass::Succeeded), Some(0), 0));
}

#[test]
fn a_preempted_checkpointing_job_loses_only_the_work_since_its_checkpoint() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("low", with_checkpoints(spec("q", 1, 4, 0), 30), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 10));
    apply_ok(&mut s, checkpoint(a, e, 100, None, 50));
    apply_ok(&mut s, submit("high", spec("q", 1, 4, 100), 55));
    let out = schedule_once(&mut s, 60);
    assert_eq!(out.preempted, vec![a]);
    assert!(matches!(
        s.allocs()[&a].desired,
        Desired::Stop { reason: StopReason::Preempted { .. }, checkpoint_first: true, grace_s: 30, .. }
    ));
    // The agent saw an exit code (the task's answer to SIGTERM): the ordered reason wins.
    apply_ok(&mut s, ended(a, e, ReportedStatus::Failed, EndClass::Exit, Some(143), 70));
    let j = job(&s, 1);
    assert_eq!((j.state, j.failures, j.infra_requeues), (JobState::Pending, 0, 1));
    let h = &j.history[0];
    assert_eq!((h.end, h.exit_code), (Some(EndClass::Preempted), Some(143)));
    assert_eq!((h.lost_device_s, j.lost_device_s), (80, 80), "(70 - 50) s x 4 GPUs");
    assert!(j.avoid.is_none(), "a preemption is not the node's fault");
}

#[test]
fn a_preempting_job_holds_the_freed_capacity_until_its_victims_stop() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("low", with_checkpoints(spec("q", 1, 4, 0), 30), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, submit("high", spec("q", 1, 4, 100), 4));
    assert_eq!(schedule_once(&mut s, 5).preempted, vec![a]);
    let n = job(&s, 2).nomination.clone().expect("nominated");
    assert_eq!((n.victims.into_iter().collect::<Vec<_>>(), n.since), (vec![a], 5));
    assert_eq!(job(&s, 2).reason, "waiting for 1 preempted allocations to stop");
    // While the victim is in its grace the preemptor is not offered: no second victim.
    assert!(s.cluster_view(6).pending.iter().all(|p| p.id != JobId(2)));
    // A third job of middle priority arrives; once the victim stops, the preemptor is
    // offered first and takes the devices.
    apply_ok(&mut s, submit("mid", spec("q", 1, 4, 50), 7));
    apply_ok(&mut s, report(a, e, ReportedStatus::Stopped, 8));
    assert_eq!(job(&s, 2).reason, "the capacity its preemptions freed is held for it");
    let view = s.cluster_view(9);
    let p = view.pending.iter().find(|p| p.id == JobId(2)).expect("offered");
    assert!(p.nominated);
    let out = schedule_once(&mut s, 9);
    assert_eq!(out.placed.len(), 1);
    assert_eq!(s.allocs()[&out.placed[0]].alloc.job, JobId(2), "the preemptor, not the third job");
    assert!(job(&s, 2).nomination.is_none(), "placed: the hold is released");
}

#[test]
fn a_hold_whose_victims_outstay_their_grace_expires() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("low", with_checkpoints(spec("q", 1, 4, 0), 30), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, submit("high", spec("q", 1, 4, 100), 4));
    schedule_once(&mut s, 5);
    let deadline = 5 + 30 + NOMINATION_SLACK_S;
    assert!(s.cluster_view(deadline).pending.iter().all(|p| p.id != JobId(2)));
    let view = s.cluster_view(deadline + 1);
    let p = view.pending.iter().find(|p| p.id == JobId(2)).expect("competes again");
    assert!(!p.nominated);
    // A pass that leaves it unplaced drops the hold that ran out.
    let plan =
        Plan { unplaced: vec![suanli_model::Unplaced { job: JobId(2), reason: "no room".into() }], ..Plan::default() };
    apply_ok(&mut s, Command::ApplyPlan(ApplyPlan { plan, now: deadline + 1 }));
    assert!(job(&s, 2).nomination.is_none());
    apply_ok(&mut s, submit("high2", spec("q", 1, 4, 100), deadline + 2));
    // Cancelling a preemptor drops its hold.
    let (b, _) = allocs_of(&s, 1)[0];
    assert_eq!(b, a, "the victim still stops");
    apply_ok(&mut s, report(a, e, ReportedStatus::Stopped, deadline + 3));
    let out = schedule_once(&mut s, deadline + 4);
    assert_eq!(out.placed.len(), 1);
    let placed = s.allocs()[&out.placed[0]].alloc.job;
    apply_ok(&mut s, submit("high3", spec("q", 1, 4, 200), deadline + 5));
    let out = schedule_once(&mut s, deadline + 6);
    assert_eq!(out.preempted.len(), 1, "{out:?}");
    assert!(job(&s, 4).nomination.is_some(), "job 4 preempted job {placed}");
    let cancel = suanli_state::CancelJob { job: JobId(4), reason: String::new(), now: deadline + 7 };
    apply_ok(&mut s, Command::CancelJob(cancel));
    assert!(job(&s, 4).nomination.is_none());
}

#[test]
fn checkpoints_keep_wall_time_and_hardware_and_never_go_back() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", with_checkpoints(spec("q", 1, 1, 0), 30), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    let hw = CheckpointHardware { kind: DeviceKind::Gpu, model: "A100".into(), count: 1 };
    apply_ok(&mut s, checkpoint(a, e, 10, Some(hw.clone()), 4));
    let c = job(&s, 1).latest_checkpoint.clone().expect("recorded");
    assert_eq!((c.step, c.wall_time, c.hardware, c.at), (10, 1_700_000_010, Some(hw.clone()), 4));
    let before = s.state_hash();
    assert_eq!(rejected_field(s.apply(checkpoint(a, e, 9, None, 5))), "step");
    let bad_count = CheckpointHardware { count: 0, ..hw.clone() };
    assert_eq!(rejected_field(s.apply(checkpoint(a, e, 11, Some(bad_count), 5))), "hardware.count");
    let no_model = CheckpointHardware { model: String::new(), ..hw.clone() };
    assert_eq!(rejected_field(s.apply(checkpoint(a, e, 11, Some(no_model), 5))), "hardware.model");
    let long = CheckpointHardware { model: "m".repeat(254), ..hw };
    assert_eq!(rejected_field(s.apply(checkpoint(a, e, 11, Some(long), 5))), "hardware.model");
    assert!(matches!(
        s.apply(checkpoint(a, e + 1, 11, None, 5)),
        Response::Rejected(CommandError::StaleEpoch { reported: 2, current: 1, .. })
    ));
    assert_eq!(s.state_hash(), before);
    apply_ok(&mut s, checkpoint(a, e, 10, None, 6));
    assert_eq!(job(&s, 1).latest_checkpoint.as_ref().map(|c| c.step), Some(10), "the same step may be re-reported");
}

#[test]
fn a_hardware_bound_checkpoint_restores_only_onto_its_model() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", with_checkpoints(spec("q", 1, 1, 0), 30), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    let hw = CheckpointHardware { kind: DeviceKind::Gpu, model: "H200".into(), count: 1 };
    apply_ok(&mut s, checkpoint(a, e, 7, Some(hw), 4));
    apply_ok(&mut s, Command::NodeDown(NodeDown { node: NodeId::from("n0"), reason: "ttl".into(), now: 5 }));
    apply_ok(&mut s, register(node("n0", 4), 6));
    assert_eq!(s.cluster_view(7).pending[0].spec.constraints.device_models, vec!["H200".to_owned()]);
    assert!(schedule_once(&mut s, 7).placed.is_empty(), "no H200 anywhere");
    assert_eq!(job(&s, 1).reason, "waiting for hardware its checkpoint needs: H200 x1");
    let mut h = node("h", 1);
    h.devices.iter_mut().for_each(|d| d.model = "H200".into());
    apply_ok(&mut s, register(h, 8));
    let out = schedule_once(&mut s, 9);
    assert_eq!(out.placed.len(), 1);
    let x = &s.allocs()[&out.placed[0]];
    assert_eq!((x.alloc.node.as_str(), x.restored_step), ("h", Some(7)));
}

#[test]
fn a_portable_checkpoint_restores_anywhere() {
    let mut s = cluster(1);
    let mut sp = with_checkpoints(spec("q", 1, 1, 0), 30);
    sp.constraints.device_models = vec!["A100".into(), "H200".into()];
    apply_ok(&mut s, submit("a", sp, 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, checkpoint(a, e, 7, None, 4));
    apply_ok(&mut s, report(a, e, ReportedStatus::Stopped, 5));
    let view = s.cluster_view(6);
    assert_eq!(view.pending[0].spec.constraints.device_models, vec!["A100".to_owned(), "H200".to_owned()]);
}

#[test]
fn migrate_is_checked_then_stops_checkpoint_first_and_narrows_the_next_placement() {
    let mut s = cluster(2);
    let mut other = node("o", 4);
    other.pool = PoolId::from("other");
    apply_ok(&mut s, register(other, 1));
    let mut sp = with_checkpoints(spec("q", 1, 1, 0), 45);
    sp.constraints.pools = vec![PoolId::from("p")];
    apply_ok(&mut s, submit("a", sp, 1));
    assert_eq!(rejected_field(s.apply(migrate(1, None, None, 2))), "job", "pending: nothing to move");
    let placed = place_on(&mut s, 1, "n0", &[0], 2);
    let (a, e) = (placed[0], 1);
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, checkpoint(a, e, 5, None, 4));
    let before = s.state_hash();
    assert_eq!(rejected_field(s.apply(migrate(1, Some("nowhere"), None, 5))), "to_pool");
    assert_eq!(rejected_field(s.apply(migrate(1, Some("other"), None, 5))), "to_pool", "outside its pools");
    assert_eq!(rejected_field(s.apply(migrate(1, None, Some("ghost"), 5))), "to_node");
    assert_eq!(rejected_field(s.apply(migrate(1, None, Some("o"), 5))), "to_node", "in a pool it may not use");
    assert!(matches!(s.apply(migrate(9, None, None, 5)), Response::Rejected(CommandError::UnknownJob { job: 9 })));
    assert_eq!(s.state_hash(), before);

    assert_eq!(apply_ok(&mut s, migrate(1, Some("p"), Some("n1"), 5)), Response::Done);
    assert!(matches!(
        s.allocs()[&a].desired,
        Desired::Stop { reason: StopReason::Migrate, checkpoint_first: true, grace_s: 45, .. }
    ));
    assert_eq!(job(&s, 1).state, JobState::Requeuing);
    apply_ok(&mut s, report(a, e, ReportedStatus::Stopped, 9));
    let j = job(&s, 1);
    assert_eq!((j.state, j.infra_requeues, j.failures), (JobState::Pending, 1, 0));
    assert_eq!(j.history[0].end, Some(EndClass::Migrated));
    let c = s.cluster_view(10).pending[0].spec.constraints.clone();
    assert_eq!((c.pools, c.nodes), (vec![PoolId::from("p")], vec![NodeId::from("n1")]));
    let placed = place_on(&mut s, 1, "n1", &[0], 10);
    assert!(job(&s, 1).migration.is_none(), "placed: the target is done");
    assert_eq!(s.allocs()[&placed[0]].restored_step, Some(5));

    // Without a target node, the next attempt avoids the nodes the last one ran on.
    apply_ok(&mut s, report(placed[0], 2, ReportedStatus::Running, 11));
    apply_ok(&mut s, migrate(1, None, None, 12));
    apply_ok(&mut s, report(placed[0], 2, ReportedStatus::Stopped, 13));
    let c = s.cluster_view(14).pending[0].spec.constraints.clone();
    assert_eq!((c.pools, c.nodes, c.avoid_nodes), (vec![PoolId::from("p")], vec![], vec![NodeId::from("n1")]));
}

#[test]
fn a_drain_stops_checkpointing_jobs_checkpoint_first() {
    let mut s = cluster(2);
    apply_ok(&mut s, submit("a", with_checkpoints(spec("q", 1, 1, 0), 40), 1));
    apply_ok(&mut s, submit("b", spec("q", 1, 1, 0), 1));
    let a = place_on(&mut s, 1, "n0", &[0], 2)[0];
    let b = place_on(&mut s, 2, "n0", &[1], 2)[0];
    apply_ok(&mut s, report(a, 1, ReportedStatus::Running, 4));
    apply_ok(&mut s, report(b, 1, ReportedStatus::Running, 4));
    let drain = |node: &str| {
        Command::SetNodeMode(SetNodeMode { node: NodeId::from(node), mode: NodeMode::Draining, now: 5, drain: None })
    };
    apply_ok(&mut s, drain("n0"));
    assert!(matches!(
        s.allocs()[&a].desired,
        Desired::Stop { reason: StopReason::Drain, checkpoint_first: true, grace_s: 40, .. }
    ));
    assert!(
        matches!(s.allocs()[&b].desired, Desired::Stop { reason: StopReason::Drain, checkpoint_first: false, .. }),
        "a job without a checkpoint policy just stops"
    );
    apply_ok(&mut s, report(a, 1, ReportedStatus::Stopped, 20));
    let j = job(&s, 1);
    assert_eq!((j.history[0].end, j.infra_requeues, j.lost_device_s), (Some(EndClass::Drained), 1, 16));
}

#[test]
fn records_of_earlier_builds_decode() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("a", with_checkpoints(spec("q", 1, 1, 0), 30), 1));
    schedule_once(&mut s, 2);
    let (a, e) = allocs_of(&s, 1)[0];
    apply_ok(&mut s, report(a, e, ReportedStatus::Running, 3));
    apply_ok(&mut s, checkpoint(a, e, 3, None, 4));
    apply_ok(&mut s, report(a, e, ReportedStatus::Failed, 5));
    schedule_once(&mut s, 100);
    // A job as an earlier build wrote it: none of the issue-18 fields.
    let mut v = serde_json::to_value(job(&s, 1)).expect("encodes");
    let o = v.as_object_mut().expect("an object");
    for k in ["nomination", "migration", "avoid", "infra_requeues", "lost_device_s"] {
        o.remove(k);
    }
    o["latest_checkpoint"].as_object_mut().expect("a checkpoint").remove("wall_time");
    for h in o["history"].as_array_mut().expect("history") {
        let h = h.as_object_mut().expect("a record");
        for k in ["end", "exit_code", "lost_device_s", "restored_step"] {
            h.remove(k);
        }
    }
    let old: Job = serde_json::from_value(v).expect("an old job decodes");
    assert_eq!((old.infra_requeues, old.lost_device_s, old.history[0].end), (0, 0, None));
    assert_eq!(old.latest_checkpoint.map(|c| (c.step, c.wall_time, c.hardware)), Some((3, 0, None)));
    let alloc = &s.allocs()[&job(&s, 1).allocs[0]];
    let mut v = serde_json::to_value(alloc).expect("encodes");
    for k in ["end", "exit_code", "lost_device_s", "restored_step"] {
        v.as_object_mut().expect("an object").remove(k);
    }
    let old: suanli_state::Alloc = serde_json::from_value(v).expect("an old allocation decodes");
    assert_eq!((old.end, old.restored_step), (None, None));
    // And a snapshot round trip keeps every new field.
    let back = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
    assert_eq!(back.state_hash(), s.state_hash());
    assert_eq!(back.job(JobId(1)).map(|j| j.lost_device_s), Some(job(&s, 1).lost_device_s));
}
