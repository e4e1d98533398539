//! Services (docs/services.md): a replica that ends is replaced alone, after a backoff that
//! doubles while replicas keep failing and resets once one is ready; a lost or drained node
//! moves only its replicas; readiness and endpoints are recorded; a cancel ends it.

mod common;

use common::*;
use suanli_model::{AllocId, JobId, JobKind, NodeId, ServiceReport, ServiceSpec};
use suanli_state::{
    AllocReady, AllocState, CancelJob, Command, CommandError, Desired, JobState, MAX_LATENCY_US, NodeDown, NodeMode,
    Reported, ReportedStatus, Response, SetNodeMode, State, StopReason, UpdateService,
};

fn service(replicas: u32, backoff_s: u64) -> suanli_model::JobSpec {
    let mut sp = spec("q", replicas, 1, 0);
    sp.kind = JobKind::Inference;
    sp.gang = false;
    sp.service = Some(ServiceSpec { restart_backoff_s: backoff_s, max_restart_backoff_s: 8, ..ServiceSpec::default() });
    sp
}

/// Live allocations of job 1 as (alloc, replica, node), by replica.
fn live(s: &State) -> Vec<(AllocId, u32, String)> {
    let j = s.job(JobId(1)).expect("job 1");
    let mut v: Vec<_> = j
        .allocs
        .iter()
        .filter_map(|a| s.allocs().get(a))
        .filter(|a| a.is_live())
        .map(|a| (a.alloc.id, a.alloc.replica, a.alloc.node.0.clone()))
        .collect();
    v.sort_by_key(|x| x.1);
    v
}

fn run_all(s: &mut State, now: u64) {
    let epoch = s.job(JobId(1)).expect("job").attempt;
    for (a, _, _) in live(s) {
        if s.allocs()[&a].state == AllocState::Pending {
            apply_ok(s, report(a, epoch, ReportedStatus::Running, now));
        }
    }
}

fn ready(a: AllocId, epoch: u64, ready: bool, endpoint: &str, now: u64) -> Command {
    Command::AllocReady(AllocReady {
        alloc: a,
        epoch,
        ready,
        endpoint: endpoint.into(),
        load_milli: None,
        latency_us: None,
        success_ppm: None,
        now,
    })
}

/// A ready replica's report of what it measured (`service.report`).
fn measured(a: AllocId, epoch: u64, latency_us: Option<u64>, success_ppm: Option<u32>, now: u64) -> Command {
    Command::AllocReady(AllocReady {
        alloc: a,
        epoch,
        ready: true,
        endpoint: "127.0.0.1:9000".into(),
        load_milli: None,
        latency_us,
        success_ppm,
        now,
    })
}

/// What job 1's replicas reported that is fresh at `now`, sorted.
fn fresh(s: &State, now: u64) -> Reported {
    let mut r = s.reported(s.job(JobId(1)).expect("job 1"), now);
    r.latency_us.sort_unstable();
    r.success_ppm.sort_unstable();
    r
}

#[test]
fn reported_latency_and_success_are_kept_per_replica_and_dropped_when_stale() {
    let mut s = cluster(2);
    let mut sp = service(3, 1);
    sp.service.as_mut().expect("a service").report = Some(ServiceReport { period_s: 5, ..ServiceReport::default() });
    apply_ok(&mut s, submit("svc", sp, 1));
    schedule_once(&mut s, 1);
    run_all(&mut s, 2);
    let epoch = s.job(JobId(1)).expect("job").attempt;
    let r = live(&s).into_iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(r.len(), 3);

    // Replica 0 reports both at 10, replica 1 only a latency at 20; replica 2 nothing.
    assert_eq!(apply_ok(&mut s, measured(r[0], epoch, Some(12_000), Some(990_000), 10)), Response::Done);
    let a = &s.allocs()[&r[0]];
    assert_eq!((a.latency_us, a.success_ppm, a.ready), (Some((12_000, 10)), Some((990_000, 10)), true));
    apply_ok(&mut s, measured(r[1], epoch, Some(30_000), None, 20));
    apply_ok(&mut s, ready(r[2], epoch, true, "127.0.0.1:9000", 20));
    assert_eq!(fresh(&s, 20), Reported { latency_us: vec![12_000, 30_000], success_ppm: vec![990_000] });

    // A report without values keeps the last ones and their time.
    apply_ok(&mut s, ready(r[0], epoch, true, "127.0.0.1:9001", 21));
    assert_eq!(s.allocs()[&r[0]].latency_us, Some((12_000, 10)));

    // Three periods (15 s) after replica 0's report it still counts; a second later it is
    // stale and drops out, while replica 1's stays.
    assert_eq!(fresh(&s, 25).latency_us, [12_000, 30_000]);
    assert_eq!(fresh(&s, 26), Reported { latency_us: vec![30_000], success_ppm: vec![] });

    // A replica that is not ready, or has ended, does not count.
    apply_ok(&mut s, measured(r[0], epoch, Some(14_000), Some(1_000_000), 30));
    apply_ok(&mut s, ready(r[1], epoch, false, "127.0.0.1:9000", 30));
    assert_eq!(fresh(&s, 30), Reported { latency_us: vec![14_000], success_ppm: vec![1_000_000] });
    apply_ok(&mut s, report(r[0], epoch, ReportedStatus::Failed, 31));
    assert_eq!(fresh(&s, 31), Reported::default());

    // Out of range: refused, naming the field.
    let e = s.apply(measured(r[2], epoch, Some(MAX_LATENCY_US + 1), None, 32));
    assert!(matches!(&e, Response::Rejected(CommandError::Invalid { field, .. }) if field == "latency_us"), "{e:?}");
    let e = s.apply(measured(r[2], epoch, None, Some(1_000_001), 32));
    assert!(matches!(&e, Response::Rejected(CommandError::Invalid { field, .. }) if field == "success_ppm"), "{e:?}");
    assert_eq!(s.allocs()[&r[2]].latency_us, None);
}

#[test]
fn without_a_report_section_nothing_reported_is_exported() {
    let mut s = cluster(1);
    apply_ok(&mut s, submit("svc", service(1, 1), 1));
    schedule_once(&mut s, 1);
    run_all(&mut s, 2);
    let epoch = s.job(JobId(1)).expect("job").attempt;
    let a = live(&s)[0].0;
    apply_ok(&mut s, measured(a, epoch, Some(5_000), Some(500_000), 3));
    assert_eq!(s.allocs()[&a].latency_us, Some((5_000, 3)), "kept on the allocation");
    assert_eq!(fresh(&s, 3), Reported::default());
}

#[test]
fn a_replica_that_exits_is_replaced_alone_with_a_growing_backoff() {
    let mut s = cluster(2);
    apply_ok(&mut s, submit("svc", service(3, 2), 1));
    assert_eq!(schedule_once(&mut s, 1).placed.len(), 3);
    run_all(&mut s, 2);
    let before = live(&s);
    assert_eq!(before.len(), 3);
    let epoch = s.job(JobId(1)).expect("job").attempt;

    // Replica 1 exits 0: the others keep running, the job stays running.
    let (gone, _, _) = before[1].clone();
    apply_ok(&mut s, report(gone, epoch, ReportedStatus::Succeeded, 10));
    let j = s.job(JobId(1)).expect("job");
    assert_eq!(j.state, JobState::Running);
    assert_eq!((j.restarts, j.restart_streak, j.not_before), (1, 1, 12));
    assert!(j.reason.contains("replica w-1 exited 0"), "{}", j.reason);
    assert_eq!(live(&s).len(), 2);
    assert!(s.allocs().get(&gone).is_none(), "the ended replica moves to the history");
    assert_eq!(j.history.last().map(|h| h.replica), Some(1));

    // Within the backoff nothing is placed; after it, only replica 1, in the same attempt.
    assert!(schedule_once(&mut s, 11).placed.is_empty());
    let out = schedule_once(&mut s, 12);
    assert_eq!(out.placed.len(), 1);
    let now = live(&s);
    assert_eq!(now.iter().map(|x| x.1).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(now[0].0, before[0].0);
    assert_eq!(now[2].0, before[2].0);
    assert_eq!(s.job(JobId(1)).expect("job").attempt, epoch, "a replacement is not a new attempt");
    assert!(s.job(JobId(1)).expect("job").reason.is_empty());

    // A second failure in a row doubles the wait; a ready replica resets the streak.
    run_all(&mut s, 13);
    let again = live(&s)[1].0;
    apply_ok(&mut s, report(again, epoch, ReportedStatus::Failed, 20));
    let j = s.job(JobId(1)).expect("job");
    assert_eq!((j.restarts, j.restart_streak, j.not_before), (2, 2, 24));
    let first = live(&s)[0].0;
    assert_eq!(
        apply_ok(&mut s, ready(first, epoch, true, "127.0.0.1:8080", 21)),
        Response::Done,
        "a readiness report is taken"
    );
    let j = s.job(JobId(1)).expect("job");
    assert_eq!(j.restart_streak, 0);
    assert!(s.allocs()[&live(&s)[0].0].ready);
    assert_eq!(s.allocs()[&live(&s)[0].0].endpoint, "127.0.0.1:8080");
}

#[test]
fn a_lost_node_moves_only_its_replicas_at_once() {
    let mut s = cluster(3);
    apply_ok(&mut s, submit("svc", service(3, 5), 1));
    schedule_once(&mut s, 1);
    run_all(&mut s, 2);
    let before = live(&s);
    let victim = before[0].2.clone();
    let on_victim = before.iter().filter(|x| x.2 == victim).count();
    apply_ok(
        &mut s,
        Command::NodeDown(NodeDown { node: NodeId::from(victim.as_str()), reason: "ttl".into(), now: 30 }),
    );
    let j = s.job(JobId(1)).expect("job");
    assert_eq!(j.state, JobState::Running);
    assert_eq!(j.not_before, 30, "no backoff for a lost node: replaced from now");
    assert_eq!(j.restart_streak, 0);
    assert_eq!(live(&s).len(), 3 - on_victim);
    let out = schedule_once(&mut s, 30);
    assert_eq!(out.placed.len(), on_victim);
    let after = live(&s);
    assert_eq!(after.len(), 3);
    assert!(after.iter().all(|x| x.2 != victim), "{after:?}");
    for x in before.iter().filter(|x| x.2 != victim) {
        assert!(after.contains(x), "replica {x:?} kept running");
    }
}

#[test]
fn a_drain_moves_one_replica_at_a_time_and_a_cancel_ends_the_service() {
    let mut s = cluster(2);
    apply_ok(&mut s, submit("svc", service(2, 1), 1));
    schedule_once(&mut s, 1);
    run_all(&mut s, 2);
    let before = live(&s);
    let node = before[0].2.clone();
    apply_ok(
        &mut s,
        Command::SetNodeMode(SetNodeMode {
            node: NodeId::from(node.as_str()),
            mode: NodeMode::Draining,
            now: 5,
            drain: None,
        }),
    );
    assert_eq!(s.job(JobId(1)).expect("job").state, JobState::Running, "a drain does not requeue a service");
    let epoch = s.job(JobId(1)).expect("job").attempt;
    for (a, _, n) in live(&s) {
        if n == node {
            apply_ok(&mut s, report(a, epoch, ReportedStatus::Stopped, 6));
        }
    }
    schedule_once(&mut s, 6);
    let after = live(&s);
    assert_eq!(after.len(), 2);
    assert!(after.iter().all(|x| x.2 != node), "{after:?}");

    // Reports for an ended replica are refused; bad endpoints name the field.
    let e = s.apply(ready(before[0].0, epoch, true, "h:1", 7));
    assert!(matches!(e, Response::Rejected(CommandError::UnknownAlloc { .. })), "{e:?}");
    let e = s.apply(ready(after[0].0, epoch, true, "a b:1", 7));
    assert!(matches!(&e, Response::Rejected(CommandError::Invalid { field, .. }) if field == "endpoint"), "{e:?}");

    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(1), reason: String::new(), now: 8 }));
    for (a, _, _) in live(&s) {
        apply_ok(&mut s, report(a, epoch, ReportedStatus::Stopped, 9));
    }
    assert_eq!(s.job(JobId(1)).map(|j| j.state), Some(JobState::Cancelled));
    assert!(schedule_once(&mut s, 20).placed.is_empty());
}

#[test]
fn a_service_may_not_be_a_gang() {
    let mut s = cluster(1);
    let mut sp = service(2, 1);
    sp.gang = true;
    let r = s.apply(submit("svc", sp, 1));
    assert!(matches!(&r, Response::Rejected(CommandError::Invalid { field, .. }) if field == "gang"), "{r:?}");
}

fn update(spec: suanli_model::JobSpec, now: u64) -> Command {
    Command::UpdateService(Box::new(UpdateService { job: JobId(1), spec, now }))
}

/// Live allocations of job 1 asked to keep running, as (alloc, replica, version, ready).
fn serving(s: &State) -> Vec<(AllocId, u32, u32, bool)> {
    let j = s.job(JobId(1)).expect("job 1");
    let mut v: Vec<_> = j
        .allocs
        .iter()
        .filter_map(|a| s.allocs().get(a))
        .filter(|a| a.is_live() && a.desired == Desired::Run)
        .map(|a| (a.alloc.id, a.alloc.replica, a.version, a.ready))
        .collect();
    v.sort_by_key(|x| (x.1, x.2));
    v
}

/// Every running replica of job 1 reports ready; every one asked to stop (then or as a
/// consequence) has stopped.
fn settle(s: &mut State, now: u64) {
    run_all(s, now);
    let epoch = s.job(JobId(1)).expect("job").attempt;
    loop {
        let mut changed = false;
        for (a, _, _) in live(s) {
            let x = &s.allocs()[&a];
            if matches!(x.desired, Desired::Stop { .. }) {
                apply_ok(s, report(a, epoch, ReportedStatus::Stopped, now));
                changed = true;
            } else if !x.ready {
                apply_ok(s, ready(a, epoch, true, "127.0.0.1:9000", now));
                changed = true;
            }
        }
        if !changed {
            return;
        }
    }
}

#[test]
fn a_rolling_update_replaces_replicas_one_at_a_time_without_losing_a_ready_one() {
    let mut s = cluster(3);
    apply_ok(&mut s, submit("svc", service(3, 1), 1));
    schedule_once(&mut s, 1);
    settle(&mut s, 2);
    assert_eq!(serving(&s).iter().filter(|x| x.3).count(), 3);

    // Version 1: another command; max_unavailable 0, max_surge 1 (the defaults).
    let mut v1 = service(3, 1);
    v1.groups[0].task = Some(suanli_model::TaskSpec { command: "/bin/true".into(), ..Default::default() });
    assert_eq!(apply_ok(&mut s, update(v1.clone(), 10)), Response::Done);
    let j = s.job(JobId(1)).expect("job");
    assert_eq!((j.version, j.old_specs.len()), (1, 1));
    assert_eq!(serving(&s).len(), 3, "nothing stops before a new replica is ready");
    assert_eq!(s.missing_replicas(j), Some((0, vec![0])), "one surge replica at a time");

    let mut now = 10;
    for step in 0..3u32 {
        now += 1;
        assert_eq!(schedule_once(&mut s, now).placed.len(), 1, "step {step}");
        assert!(schedule_once(&mut s, now).placed.is_empty(), "never beyond replicas + max_surge");
        // While the new replica starts, all three old ones keep serving.
        assert_eq!(serving(&s).iter().filter(|x| x.3).count(), 3, "step {step}");
        now += 1;
        settle(&mut s, now);
        // Ready: its old counterpart was asked to stop and has stopped.
        let ready_now = serving(&s).iter().filter(|x| x.3).count();
        assert_eq!(ready_now, 3, "step {step}: {:?}", serving(&s));
        let updated = serving(&s).iter().filter(|x| x.2 == 1).count();
        assert_eq!(updated as u32, step + 1, "step {step}: {:?}", serving(&s));
    }
    let j = s.job(JobId(1)).expect("job");
    assert!(j.old_specs.is_empty(), "no replica runs version 0 any more");
    assert_eq!(serving(&s).iter().map(|x| (x.1, x.2)).collect::<Vec<_>>(), [(0, 1), (1, 1), (2, 1)]);
    assert_eq!(j.restarts, 0, "replicas replaced by the update are not restarts");
    assert_eq!(j.reason, "updated to version 1");
    assert_eq!(j.history.len(), 3, "the three old replicas, in the history");
    // The allocations of the old version said why they stopped.
    assert!(j.history.iter().all(|h| h.end == Some(suanli_state::EndClass::Stopped)), "{:?}", j.history);
}

#[test]
fn max_unavailable_stops_first_and_a_bad_version_is_rolled_back() {
    let mut s = cluster(3);
    let mut v0 = service(2, 1);
    v0.service.as_mut().expect("service").update = suanli_model::UpdateStrategy { max_unavailable: 1, max_surge: 0 };
    apply_ok(&mut s, submit("svc", v0.clone(), 1));
    schedule_once(&mut s, 1);
    settle(&mut s, 2);
    let mut v1 = v0.clone();
    v1.groups[0].task = Some(suanli_model::TaskSpec { command: "/bin/false".into(), ..Default::default() });
    apply_ok(&mut s, update(v1, 10));
    // max_surge 0: one old replica stops first, the other keeps serving.
    let stopping: Vec<_> = live(&s)
        .iter()
        .filter(|x| matches!(s.allocs()[&x.0].desired, Desired::Stop { reason: StopReason::Update, .. }))
        .map(|x| x.1)
        .collect();
    assert_eq!(stopping, [0]);
    assert!(schedule_once(&mut s, 10).placed.is_empty(), "no room until it has stopped");
    let epoch = s.job(JobId(1)).expect("job").attempt;
    let old0 = live(&s)[0].0;
    apply_ok(&mut s, report(old0, epoch, ReportedStatus::Stopped, 11));
    assert_eq!(schedule_once(&mut s, 11).placed.len(), 1);
    // The new version never becomes ready; rolling back to version 0's spec is an update too.
    run_all(&mut s, 12);
    assert_eq!(serving(&s).iter().filter(|x| x.3).count(), 1, "one old replica still serves");
    apply_ok(&mut s, update(v0, 13));
    let j = s.job(JobId(1)).expect("job");
    assert_eq!(j.version, 2);
    // The version-1 replica (not ready) is stopped at once; the version-0 one keeps serving.
    assert_eq!(serving(&s).iter().map(|x| (x.1, x.2, x.3)).collect::<Vec<_>>(), [(1, 0, true)]);
    settle(&mut s, 14);
    let mut now = 14;
    let done = |s: &State| serving(s).iter().filter(|x| x.2 == 2 && x.3).count() == 2;
    while !done(&s) && now < 40 {
        now += 1;
        schedule_once(&mut s, now);
        settle(&mut s, now);
    }
    assert_eq!(serving(&s).iter().map(|x| (x.1, x.2, x.3)).collect::<Vec<_>>(), [(0, 2, true), (1, 2, true)]);
}

#[test]
fn a_new_replica_count_scales_without_a_new_version() {
    let mut s = cluster(3);
    apply_ok(&mut s, submit("svc", service(3, 1), 1));
    schedule_once(&mut s, 1);
    settle(&mut s, 2);
    let kept: Vec<AllocId> = serving(&s).iter().map(|x| x.0).collect();
    apply_ok(&mut s, update(service(5, 1), 10));
    let j = s.job(JobId(1)).expect("job");
    assert_eq!((j.version, j.reason.as_str()), (0, "scaled to 5 replicas"));
    assert_eq!(schedule_once(&mut s, 10).placed.len(), 2);
    settle(&mut s, 11);
    assert_eq!(serving(&s).len(), 5);
    assert!(kept.iter().all(|a| serving(&s).iter().any(|x| x.0 == *a)), "the first three keep running");

    // Down to 2: replicas 2, 3 and 4 stop and are not replaced.
    apply_ok(&mut s, update(service(2, 1), 20));
    settle(&mut s, 21);
    assert!(schedule_once(&mut s, 22).placed.is_empty());
    assert_eq!(serving(&s).iter().map(|x| x.1).collect::<Vec<_>>(), [0, 1]);
    let j = s.job(JobId(1)).expect("job");
    assert_eq!((j.restarts, j.state), (0, JobState::Running));
}

#[test]
fn updates_that_would_change_what_the_service_is_are_refused_naming_the_field() {
    let mut s = cluster(2);
    apply_ok(&mut s, upsert_queue(queue("other", 8)));
    apply_ok(&mut s, submit("svc", service(2, 1), 1));
    let refused = |s: &mut State, sp: suanli_model::JobSpec| match s.apply(update(sp, 5)) {
        Response::Rejected(CommandError::Invalid { field, .. } | CommandError::Conflict { field, .. }) => field,
        other => panic!("not refused by field: {other:?}"),
    };
    let mut q = service(2, 1);
    q.queue = "other".into();
    assert_eq!(refused(&mut s, q), "spec.queue");
    let mut g = service(2, 1);
    g.groups[0].name = "renamed".into();
    assert_eq!(refused(&mut s, g), "spec.groups");
    let mut batch = service(2, 1);
    batch.kind = JobKind::Batch;
    batch.service = None;
    assert_eq!(refused(&mut s, batch), "spec.kind");
    let mut stuck = service(2, 1);
    stuck.service.as_mut().expect("service").update = suanli_model::UpdateStrategy { max_unavailable: 0, max_surge: 0 };
    assert_eq!(refused(&mut s, stuck), "service.update");
    // The same spec again changes nothing.
    let rev = s.revision();
    assert_eq!(s.apply(update(service(2, 1), 6)), Response::Done);
    assert_eq!(s.revision(), rev);
    // Not a service: a batch job is not updated.
    apply_ok(&mut s, submit("batch", spec("q", 1, 1, 0), 7));
    let e = s.apply(Command::UpdateService(Box::new(UpdateService { job: JobId(2), spec: service(2, 1), now: 8 })));
    assert!(matches!(e, Response::Rejected(CommandError::Conflict { .. })), "{e:?}");
}
