//! The cost ledger on a known workload, every amount computed by hand (docs/cost.md), and a
//! property test: random command sequences conserve exactly.

mod common;

use common::*;
use suanli_model::{CheckpointPolicy, JobId, JobSpec, PoolId};
use suanli_state::cost::{BASE_PER_MICRO, DevicePrice, PriceCatalog, ReportBy, SetPrices, cents};
use suanli_state::{
    AllocStatus, CancelJob, Command, EndClass, ReportCheckpoint, ReportedStatus, RetryPolicy, State, SubmitJob,
};

/// Micro-units to base units.
fn m(micro: i128) -> i128 {
    micro * BASE_PER_MICRO as i128
}

/// A100 3.6/h (1000 micro per GPU-second), 7.2/h in pool b; CPU 0.036 per core-hour (10 micro
/// per core-second); memory 0.0036 per GiB-hour (1 micro per GiB-second).
fn catalog() -> PriceCatalog {
    PriceCatalog {
        currency: "USD".into(),
        devices: vec![
            DevicePrice { model: "A100".into(), micro_per_hour: 3_600_000, ..Default::default() },
            DevicePrice { model: "A100".into(), pool: "b".into(), micro_per_hour: 7_200_000, ..Default::default() },
        ],
        cpu_core_hour_micro: 36_000,
        memory_gib_hour_micro: 3_600,
    }
}

fn in_pool(mut sp: JobSpec, pool: &str) -> JobSpec {
    sp.constraints.pools = vec![PoolId::from(pool)];
    sp
}

fn alloc_of(s: &State, job: u64) -> (suanli_model::AllocId, u64) {
    let a = *s.job(JobId(job)).expect("job").allocs.last().expect("an allocation");
    (a, s.allocs()[&a].alloc.epoch)
}

fn end(s: &mut State, job: u64, status: ReportedStatus, class: EndClass, now: u64) {
    let (alloc, epoch) = alloc_of(s, job);
    let exit_code = (class == EndClass::Exit).then_some(1);
    let r = apply_ok(
        s,
        Command::AllocStatus(AllocStatus {
            alloc,
            epoch,
            status,
            message: "x".into(),
            end: Some(class),
            exit_code,
            now,
        }),
    );
    assert!(matches!(r, suanli_state::Response::Done), "job {job}'s end refused: {r:?}");
}

fn running(s: &mut State, job: u64, now: u64) {
    let (a, e) = alloc_of(s, job);
    apply_ok(s, report(a, e, ReportedStatus::Running, now));
}

/// Two pools, one node each:
///   n0 in pool a: 4 A100 (4 x 1000) + 64 cores (640) + 256 GiB (256) = 4896 micro/s
///   n1 in pool b: 2 A100 (2 x 2000) + 640 + 256                        = 4896 micro/s
/// Every task asks 1 core (10) and 1 GiB (1): 11 micro/s besides its GPUs.
///   J1 2 GPUs in a: 2011/s; placed 10, checkpoint 40, preempted, stopped 60
///        useful 30 s x 2011 = 60330; lost_preemption 20 s x 2011 = 40220
///   J2 0.5 GPU in a: 500 + 11 = 511/s; placed 10, succeeded 110: useful 100 x 511 = 51100
///   J3 2 GPUs in a (the preemptor): placed 60, succeeded 100: useful 40 x 2011 = 80440
///   J4 1 GPU in b: 2000 + 11 = 2011/s; placed 120, failed 150: lost_failure 30 x 2011 = 60330
///   J5 1 GPU in b: placed 160, running at 200: running 40 x 2011 = 80440
/// Capacity from the prices (t = 10) to 200: 2 x 4896 x 190 = 1860480
///   pool a: 930240 - (60330 + 40220 + 51100 + 80440 = 232090) = 698150 idle
///   pool b: 930240 - (60330 + 80440 = 140770)                 = 789470 idle
/// Totals: useful 191870, lost_preemption 40220, lost_failure 60330, running 80440,
/// idle 1487620; sum 1860480 micro = 1.86 (186 cents).
#[test]
fn known_workload_to_the_cent() {
    let mut s = State::default();
    apply_ok(&mut s, upsert_queue(queue("q", 64)));
    let mut n0 = node("n0", 4);
    n0.pool = PoolId::from("a");
    let mut n1 = node("n1", 2);
    n1.pool = PoolId::from("b");
    apply_ok(&mut s, register(n0, 1));
    apply_ok(&mut s, register(n1, 1));
    apply_ok(&mut s, Command::SetPrices(SetPrices { catalog: catalog(), now: 10 }));

    let mut j1 = in_pool(spec("q", 1, 2, 0), "a");
    j1.checkpoint = Some(CheckpointPolicy { interval_s: 30, grace_s: 30, restore_s: 5, signal: Default::default() });
    apply_ok(&mut s, submit("j1", j1, 10));
    let mut j2 = in_pool(spec("q", 1, 1, 0), "a");
    j2.preemptible = false;
    if let Some(d) = j2.groups[0].resources.devices.as_mut() {
        d.milli = 500;
    }
    apply_ok(&mut s, submit("j2", j2, 10));
    assert_eq!(schedule_once(&mut s, 10).placed.len(), 2);
    running(&mut s, 1, 11);
    running(&mut s, 2, 11);
    let (a1, e1) = alloc_of(&s, 1);
    apply_ok(
        &mut s,
        Command::ReportCheckpoint(ReportCheckpoint {
            alloc: a1,
            epoch: e1,
            uri: "file:///ck/1".into(),
            step: 1,
            size_bytes: 10,
            wall_time: 40,
            hardware: None,
            now: 40,
        }),
    );
    apply_ok(&mut s, submit("j3", in_pool(spec("q", 1, 2, 100), "a"), 50));
    let out = schedule_once(&mut s, 50);
    assert_eq!(out.preempted, vec![a1], "{out:?}");
    // The agent reports its stop; the state machine classes it as the preemption it asked for.
    end(&mut s, 1, ReportedStatus::Stopped, EndClass::Stopped, 60);
    apply_ok(&mut s, Command::CancelJob(CancelJob { job: JobId(1), reason: "done".into(), now: 60 }));
    assert_eq!(schedule_once(&mut s, 60).placed.len(), 1);
    running(&mut s, 3, 61);
    end(&mut s, 3, ReportedStatus::Succeeded, EndClass::Succeeded, 100);
    end(&mut s, 2, ReportedStatus::Succeeded, EndClass::Succeeded, 110);

    let retry = RetryPolicy { max_attempts: 1, ..RetryPolicy::default() };
    let sub = SubmitJob {
        client_request_id: "j4".into(),
        spec: in_pool(spec("q", 1, 1, 0), "b"),
        retry: Some(retry),
        now: 120,
        trace: None,
    };
    apply_ok(&mut s, Command::SubmitJob(Box::new(sub)));
    assert_eq!(schedule_once(&mut s, 120).placed.len(), 1);
    running(&mut s, 4, 121);
    end(&mut s, 4, ReportedStatus::Failed, EndClass::Exit, 150);
    apply_ok(&mut s, submit("j5", in_pool(spec("q", 1, 1, 0), "b"), 160));
    assert_eq!(schedule_once(&mut s, 160).placed.len(), 1);
    running(&mut s, 5, 200);
    assert_eq!(s.clock(), 200);

    let r = s.cost_report(ReportBy::Pool, 0, 0);
    assert_eq!(r.capacity, m(1_860_480));
    assert_eq!(r.total.useful, m(191_870), "{r:#?}");
    assert_eq!(r.total.lost_preemption, m(40_220));
    assert_eq!(r.total.lost_failure, m(60_330));
    assert_eq!(r.total.running, m(80_440));
    assert_eq!(r.total.idle, m(1_487_620));
    assert_eq!(r.total.total(), r.capacity, "conservation");
    assert_eq!(cents(r.capacity), 186);
    assert_eq!(r.rows["a"].idle, m(698_150));
    assert_eq!(r.rows["a"].total(), m(930_240));
    assert_eq!(r.rows["b"].idle, m(789_470));
    assert_eq!(r.rows["b"].lost_failure, m(60_330));

    let r = s.cost_report(ReportBy::Job, 0, 0);
    assert_eq!(r.rows["1"].useful, m(60_330));
    assert_eq!(r.rows["1"].lost_preemption, m(40_220));
    assert_eq!(r.rows["2"].useful, m(51_100), "the fractional job is priced pro rata");
    assert_eq!(r.rows["(idle)"].idle, m(1_487_620));
    assert_eq!(r.total.total(), r.capacity);

    // A window [100, 150): J2 10 s x 511 useful, J4 30 s lost_failure; capacity 2 x 4896 x 50.
    let r = s.cost_report(ReportBy::Pool, 100, 150);
    assert_eq!(r.capacity, m(2 * 4896 * 50));
    assert_eq!(r.total.useful, m(5_110));
    assert_eq!(r.total.lost_failure, m(60_330));
    assert_eq!(r.total.total(), r.capacity, "conservation in a window");

    // Snapshots carry the ledger.
    let back = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
    assert_eq!(back.cost_report(ReportBy::Team, 0, 0), s.cost_report(ReportBy::Team, 0, 0));
    assert_eq!(back.state_hash(), s.state_hash());
}

#[test]
fn bad_prices_name_the_field() {
    let mut s = State::default();
    let mut c = catalog();
    c.devices[1].micro_per_hour = u64::MAX;
    let r = s.apply(Command::SetPrices(SetPrices { catalog: c, now: 1 }));
    assert!(format!("{r:?}").contains("prices.devices[1].per_hour"), "{r:?}");
    let mut c = catalog();
    c.devices.push(c.devices[0].clone());
    let r = s.apply(Command::SetPrices(SetPrices { catalog: c, now: 1 }));
    assert!(format!("{r:?}").contains("priced twice"), "{r:?}");
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Submit(u8, u16),
        Schedule,
        Run(u8),
        End(u8, u8),
        Checkpoint(u8),
        Down(u8),
        Up(u8),
        Reprice(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u8..4, 1u16..1000).prop_map(|(g, milli)| Op::Submit(g, milli)),
            Just(Op::Schedule),
            any::<u8>().prop_map(Op::Run),
            (any::<u8>(), 0u8..4).prop_map(|(j, k)| Op::End(j, k)),
            any::<u8>().prop_map(Op::Checkpoint),
            (0u8..3).prop_map(Op::Down),
            (0u8..3).prop_map(Op::Up),
            (1u32..10_000_000).prop_map(Op::Reprice),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_sequences_conserve(ops in proptest::collection::vec((op(), 0u64..50), 1..60), limit in 2usize..20) {
            let mut s = State::default();
            s.set_ledger_limit(limit);
            apply_ok(&mut s, upsert_queue(queue("q", 64)));
            for i in 0..3 {
                let mut n = node(&format!("n{i}"), 4);
                n.pool = PoolId::from(if i == 2 { "b" } else { "a" });
                apply_ok(&mut s, register(n, 1));
            }
            apply_ok(&mut s, Command::SetPrices(SetPrices { catalog: catalog(), now: 1 }));
            let mut now = 1;
            let mut jobs = 0u64;
            for (o, dt) in ops {
                now += dt;
                let live: Vec<(suanli_model::AllocId, u64)> =
                    s.allocs().values().filter(|a| a.is_live()).map(|a| (a.alloc.id, a.alloc.epoch)).collect();
                let pick = |i: u8| live.get(usize::from(i) % live.len().max(1)).copied();
                let cmd = match o {
                    Op::Submit(g, milli) => {
                        jobs += 1;
                        let mut sp = spec("q", 1, u32::from(g), 0);
                        if g == 1 && let Some(d) = sp.groups[0].resources.devices.as_mut() {
                            d.milli = u32::from(milli);
                        }
                        Some(submit(&format!("j{jobs}"), sp, now))
                    }
                    Op::Schedule => { schedule_once(&mut s, now); None }
                    Op::Run(i) => pick(i).map(|(a, e)| report(a, e, ReportedStatus::Running, now)),
                    Op::End(i, k) => pick(i).map(|(alloc, epoch)| {
                        let (status, class) = match k {
                            0 => (ReportedStatus::Succeeded, EndClass::Succeeded),
                            1 => (ReportedStatus::Failed, EndClass::Exit),
                            2 => (ReportedStatus::Failed, EndClass::Oom),
                            _ => (ReportedStatus::Stopped, EndClass::Stopped),
                        };
                        let exit_code = (class == EndClass::Exit).then_some(1);
                        Command::AllocStatus(AllocStatus { alloc, epoch, status, message: String::new(), end: Some(class), exit_code, now })
                    }),
                    Op::Checkpoint(i) => pick(i).map(|(alloc, epoch)| Command::ReportCheckpoint(ReportCheckpoint {
                        alloc, epoch, uri: format!("file:///ck/{now}"), step: now, size_bytes: 1, wall_time: now, hardware: None, now,
                    })),
                    Op::Down(i) => Some(Command::NodeDown(suanli_state::NodeDown { node: format!("n{i}").as_str().into(), reason: "gone".into(), now })),
                    Op::Up(i) => {
                        let mut n = node(&format!("n{i}"), 4);
                        n.pool = PoolId::from(if i == 2 { "b" } else { "a" });
                        Some(register(n, now))
                    }
                    Op::Reprice(p) => {
                        let mut c = catalog();
                        c.devices[0].micro_per_hour = u64::from(p);
                        Some(Command::SetPrices(SetPrices { catalog: c, now }))
                    }
                };
                if let Some(c) = cmd {
                    apply_ok(&mut s, c);
                }
                for by in [ReportBy::Pool, ReportBy::Team, ReportBy::Job] {
                    let r = s.cost_report(by, 0, 0);
                    prop_assert_eq!(r.total.total(), r.capacity, "{:?}", by);
                }
                let r = s.cost_report(ReportBy::Pool, now / 2, now);
                prop_assert_eq!(r.total.total(), r.capacity, "window");
            }
        }
    }
}

/// A node that registers after the catalog is set is priced from its registration on.
#[test]
fn a_node_registered_after_the_prices_is_capacity() {
    let mut s = State::default();
    apply_ok(&mut s, upsert_queue(queue("q", 64)));
    apply_ok(&mut s, Command::SetPrices(SetPrices { catalog: catalog(), now: 5 }));
    let mut n0 = node("n0", 4);
    n0.pool = PoolId::from("a");
    apply_ok(&mut s, register(n0, 10));
    apply_ok(&mut s, submit("j", in_pool(spec("q", 1, 1, 0), "a"), 20));
    let r = s.cost_report(ReportBy::Pool, 0, 0);
    assert_eq!(r.capacity, m(4896 * 10), "{r:#?}");
}
