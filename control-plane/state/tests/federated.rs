//! Federated jobs in the region's state (docs/federation.md "Leases, epochs and fencing"):
//! adopt, renew and release, their idempotence and fencing by epoch.

mod common;

use common::*;
use suanli_model::{AllocId, CheckpointHardware, DeviceKind, JobId};
use suanli_state::federated::{FedAdopt, FedRelease, FedRenew};
use suanli_state::{CheckpointRecord, Command, CommandError, Desired, JobState, Response, State};

fn adopt(gid: &str, epoch: u64, lease_until_ms: u64, now: u64) -> Command {
    let mut sp = spec("q", 1, 1, 0);
    sp.constraints.device_models = vec!["A100".into()];
    Command::FedAdopt(Box::new(FedAdopt {
        global_id: gid.into(),
        epoch,
        spec: sp,
        team: "ml".into(),
        lease_until_ms,
        stop_before_ms: 2_000,
        restore: None,
        now,
        trace: None,
    }))
}

fn release(gid: &str, epoch: u64, reason: &str, now: u64) -> Command {
    Command::FedRelease(FedRelease { global_id: gid.into(), epoch, reason: reason.into(), now })
}

fn adopted(r: Response) -> (JobId, bool) {
    match r {
        Response::JobSubmitted { job, created } => (job, created),
        other => panic!("expected an adopted job, got {other:?}"),
    }
}

#[test]
fn adopt_creates_a_bound_job_and_is_idempotent_per_epoch() {
    let mut s = cluster(1);
    let rev = s.revision();
    let (id, created) = adopted(apply_ok(&mut s, adopt("g-1", 1, 60_000, 10)));
    assert!(created);
    assert!(s.revision() > rev, "an adoption bumps the revision");
    let j = s.job(id).expect("job");
    let b = j.federation.as_ref().expect("bound");
    assert_eq!((b.global_id.as_str(), b.epoch, b.lease_until_ms, b.stop_before_ms), ("g-1", 1, 60_000, 2_000));
    assert_eq!(b.team, "ml");
    assert_eq!(j.state, JobState::Pending);
    assert_eq!(j.spec.constraints.device_models, vec!["A100".to_owned()]);
    let rev = s.revision();
    assert_eq!(adopted(apply_ok(&mut s, adopt("g-1", 1, 90_000, 11))), (id, false));
    assert_eq!(s.revision(), rev, "a repeat changes nothing");
    // The job is placed like any other.
    let o = schedule_once(&mut s, 12);
    assert_eq!(o.placed.len(), 1);
}

#[test]
fn a_lower_epoch_is_refused_and_a_higher_one_supersedes() {
    let mut s = cluster(1);
    let (old, _) = adopted(apply_ok(&mut s, adopt("g-7", 2, 60_000, 10)));
    schedule_once(&mut s, 11);
    match apply_ok(&mut s, adopt("g-7", 1, 60_000, 12)) {
        Response::Rejected(CommandError::Conflict { field, message }) => {
            assert_eq!(field, "epoch");
            assert!(message.contains("epoch 1") && message.contains("epoch 2"), "{message}");
        }
        other => panic!("stale epoch not refused: {other:?}"),
    }
    let (new, created) = adopted(apply_ok(&mut s, adopt("g-7", 3, 90_000, 13)));
    assert!(created && new != old);
    let o = s.job(old).expect("old");
    assert_eq!(o.state, JobState::Cancelled);
    assert!(o.reason.contains("superseded by epoch 3"), "{}", o.reason);
    for a in &o.allocs {
        assert!(matches!(s.allocs()[a].desired, Desired::Stop { .. }), "the old epoch's tasks are told to stop");
    }
}

#[test]
fn adopt_refuses_unknown_queue_and_bad_fields() {
    let mut s = cluster(1);
    let mut c = adopt("g-1", 1, 60_000, 10);
    if let Command::FedAdopt(a) = &mut c {
        a.spec.queue = "nope".into();
    }
    match apply_ok(&mut s, c) {
        Response::Rejected(e @ CommandError::UnknownQueue { .. }) => assert!(e.to_string().contains("nope")),
        other => panic!("unknown queue not refused: {other:?}"),
    }
    match apply_ok(&mut s, adopt("g-1", 0, 60_000, 10)) {
        Response::Rejected(CommandError::Invalid { field, .. }) => assert_eq!(field, "epoch"),
        other => panic!("epoch 0 not refused: {other:?}"),
    }
    match apply_ok(&mut s, adopt("", 1, 60_000, 10)) {
        Response::Rejected(CommandError::Invalid { field, .. }) => assert_eq!(field, "global_id"),
        other => panic!("empty global id not refused: {other:?}"),
    }
    assert!(s.jobs().is_empty());
}

#[test]
fn adopt_with_restore_records_the_checkpoint_and_pins_its_hardware() {
    let mut s = cluster(1);
    let mut c = adopt("g-2", 4, 60_000, 10);
    if let Command::FedAdopt(a) = &mut c {
        a.restore = Some(CheckpointRecord {
            uri: "file:///ck/g-2/s40".into(),
            step: 40,
            size_bytes: 5,
            at: 3,
            alloc: AllocId(99),
            epoch: 3,
            wall_time: 0,
            hardware: Some(CheckpointHardware { kind: DeviceKind::Gpu, model: "A100".into(), count: 1 }),
        });
    }
    let (id, _) = adopted(apply_ok(&mut s, c));
    let ck = s.job(id).and_then(|j| j.latest_checkpoint.clone()).expect("restore recorded");
    assert_eq!((ck.uri.as_str(), ck.step, ck.alloc, ck.epoch), ("file:///ck/g-2/s40", 40, AllocId(0), 0));
    let j = s.job(id).expect("job");
    assert_eq!(s.effective_constraints(j, 11).device_models, vec!["A100".to_owned()]);
    let o = schedule_once(&mut s, 11);
    assert_eq!(o.placed.len(), 1);
    assert_eq!(s.allocs()[&o.placed[0]].restored_step, Some(40), "the first placement restores from it");
}

#[test]
fn renew_extends_only_the_matching_epoch() {
    let mut s = cluster(1);
    let (a, _) = adopted(apply_ok(&mut s, adopt("g-1", 2, 60_000, 10)));
    let (b, _) = adopted(apply_ok(&mut s, adopt("g-2", 1, 60_000, 10)));
    let rev = s.revision();
    let renew = FedRenew {
        leases: vec![("g-1".into(), 2, 75_000), ("g-2".into(), 9, 75_000), ("g-3".into(), 1, 75_000)],
        now: 11,
    };
    apply_ok(&mut s, Command::FedRenew(renew));
    let until = |s: &State, id| s.job(id).and_then(|j| j.federation.as_ref()).map(|b| b.lease_until_ms);
    assert_eq!(until(&s, a), Some(75_000));
    assert_eq!(until(&s, b), Some(60_000), "another epoch's renewal is ignored");
    assert!(s.revision() > rev && s.job(a).expect("a").revision > rev, "watchers see the renewal");
    // A renewal never shortens a lease.
    apply_ok(&mut s, Command::FedRenew(FedRenew { leases: vec![("g-1".into(), 2, 70_000)], now: 12 }));
    assert_eq!(until(&s, a), Some(75_000));
}

#[test]
fn release_stops_the_tasks_and_ends_the_job_once() {
    let mut s = cluster(1);
    let (id, _) = adopted(apply_ok(&mut s, adopt("g-1", 1, 60_000, 10)));
    schedule_once(&mut s, 11);
    let allocs = s.job(id).expect("job").allocs.clone();
    assert_eq!(allocs.len(), 1);
    // Another epoch: ignored.
    let rev = s.revision();
    apply_ok(&mut s, release("g-1", 2, "cancelled", 12));
    assert_eq!(s.revision(), rev);
    apply_ok(&mut s, release("g-1", 1, "lease_expired", 12));
    let j = s.job(id).expect("job");
    assert_eq!(j.state, JobState::Cancelled);
    assert_eq!(j.reason, "released to the federation: lease_expired");
    assert_eq!(j.federation.as_ref().and_then(|b| b.released.as_deref()), Some("lease_expired"));
    assert!(matches!(s.allocs()[&allocs[0]].desired, Desired::Stop { .. }));
    let rev = s.revision();
    apply_ok(&mut s, release("g-1", 1, "cancelled", 13));
    assert_eq!(s.revision(), rev, "a second release changes nothing");
    // Never placed again.
    assert!(schedule_once(&mut s, 14).placed.is_empty());
}

#[test]
fn federated_state_survives_a_snapshot() {
    let mut s = cluster(1);
    apply_ok(&mut s, adopt("g-1", 1, 60_000, 10));
    let back = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
    assert_eq!(back.state_hash(), s.state_hash());
    assert_eq!(back, s);
}
