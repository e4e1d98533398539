//! Services (docs/services.md): a replica that ends is replaced alone, after a backoff that
//! doubles while replicas keep failing and resets once one is ready; a lost or drained node
//! moves only its replicas; readiness and endpoints are recorded; a cancel ends it.

mod common;

use common::*;
use suanli_model::{AllocId, JobId, JobKind, NodeId, ServiceSpec};
use suanli_state::{
    AllocReady, AllocState, CancelJob, Command, CommandError, JobState, NodeDown, NodeMode, ReportedStatus, Response,
    SetNodeMode, State,
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
    Command::AllocReady(AllocReady { alloc: a, epoch, ready, endpoint: endpoint.into(), now })
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
