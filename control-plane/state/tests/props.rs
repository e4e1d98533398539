//! Property tests: random command sequences (real engine plans, hand-made bad plans, agent
//! reports with stale epochs, node failures, re-registrations that shrink nodes, cancels,
//! quota changes) keep every invariant, and snapshot -> restore and replay give the same hash.

mod common;

use common::*;
use proptest::prelude::*;
use suanli_model::{
    AllocId, CheckpointHardware, DeviceKind, DeviceRequest, DeviceShare, Health, JobId, NodeId, Placement, Plan, PoolId,
};
use suanli_scheduler::{SchedulerConfig, schedule};
use suanli_state::{
    AllocStatus, ApplyPlan, CancelJob, ClearQuarantine, Command, DeviceHealth, EndClass, MigrateJob, NodeDown,
    NodeMode, ReportCheckpoint, ReportedStatus, RetryPolicy, SetNodeMode, State, SubmitJob,
};

#[derive(Debug, Clone)]
enum Op {
    Submit { rid: u8, queue: u8, replicas: u32, gpus: u32, milli: u32, priority: i32, gang: bool, attempts: u32 },
    Schedule { seed: u64 },
    BadPlan { job: u8, node: u8, dev: u8, milli: u32, replica: u32 },
    Report { pick: usize, epoch_skew: u8, status: u8, end: u8, code: Option<i32> },
    Checkpoint { pick: usize, step: u64, bound: bool },
    Migrate { job: u8, pool: u8, node: u8 },
    NodeDown { node: u8 },
    Register { node: u8, gpus: u32, cpu_k: u64, npu: bool },
    Health { node: u8, dev: u8, healthy: bool },
    ClearQuarantine { node: u8, dev: u8 },
    Mode { node: u8, mode: u8 },
    Cancel { job: u8 },
    Quota { queue: u8, gpus: u64, cohort: bool },
    Advance { secs: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..24, 0u8..3, 1u32..4, 0u32..3, prop_oneof![Just(250u32), Just(500), Just(1000)], -3i32..4, any::<bool>(), 1u32..3)
            .prop_map(|(rid, queue, replicas, gpus, milli, priority, gang, attempts)| Op::Submit {
                rid, queue, replicas, gpus, milli, priority, gang, attempts
            }),
        4 => any::<u64>().prop_map(|seed| Op::Schedule { seed }),
        1 => (0u8..24, 0u8..4, 0u8..6, prop_oneof![Just(0u32), Just(500), Just(1000), Just(1500)], 0u32..4)
            .prop_map(|(job, node, dev, milli, replica)| Op::BadPlan { job, node, dev, milli, replica }),
        5 => (any::<usize>(), 0u8..4, 0u8..4, 0u8..16, prop::option::of(-2i32..140))
            .prop_map(|(pick, epoch_skew, status, end, code)| Op::Report { pick, epoch_skew, status, end, code }),
        1 => (any::<usize>(), 0u64..6, any::<bool>()).prop_map(|(pick, step, bound)| Op::Checkpoint { pick, step, bound }),
        2 => (0u8..24, 0u8..3, 0u8..6).prop_map(|(job, pool, node)| Op::Migrate { job, pool, node }),
        1 => (0u8..4).prop_map(|node| Op::NodeDown { node }),
        1 => (0u8..4, 0u32..6, 1u64..64, any::<bool>()).prop_map(|(node, gpus, cpu_k, npu)| Op::Register { node, gpus, cpu_k, npu }),
        1 => (0u8..4, 0u8..5, any::<bool>()).prop_map(|(node, dev, healthy)| Op::Health { node, dev, healthy }),
        1 => (0u8..4, 0u8..5).prop_map(|(node, dev)| Op::ClearQuarantine { node, dev }),
        1 => (0u8..4, 0u8..3).prop_map(|(node, mode)| Op::Mode { node, mode }),
        1 => (0u8..24).prop_map(|job| Op::Cancel { job }),
        1 => (0u8..3, 0u64..10, any::<bool>()).prop_map(|(queue, gpus, cohort)| Op::Quota { queue, gpus, cohort }),
        2 => (1u64..120).prop_map(|secs| Op::Advance { secs }),
    ]
}

const QUEUES: [&str; 3] = ["q", "r", "ghost"];

/// Ends a report may carry (by index; beyond the list: none).
const END_CLASSES: [EndClass; 11] = [
    EndClass::Succeeded,
    EndClass::Exit,
    EndClass::Exit,
    EndClass::Oom,
    EndClass::StartFailed,
    EndClass::DeviceError,
    EndClass::Stopped,
    EndClass::NodeLost,
    EndClass::Preempted,
    EndClass::Migrated,
    EndClass::Cancelled,
];

/// Turns an op into a command against the current state (picking live ids where it needs
/// them). `None` when the op only moves time.
fn command(s: &State, op: &Op, now: &mut u64) -> Option<Command> {
    let nid = |n: u8| NodeId::from(format!("n{n}").as_str());
    Some(match op {
        Op::Submit { rid, queue, replicas, gpus, milli, priority, gang, attempts } => {
            let mut sp = spec(QUEUES[*queue as usize], *replicas, *gpus, *priority);
            sp.gang = *gang;
            if let Some(d) = sp.groups[0].resources.devices.as_mut()
                && *gpus == 1
            {
                d.milli = *milli;
            }
            if !*gang {
                sp.groups[0].min_replicas = Some(1);
            }
            let retry = Some(RetryPolicy { max_attempts: *attempts, backoff_base_s: 5, backoff_max_s: 20 });
            Command::SubmitJob(Box::new(SubmitJob {
                client_request_id: format!("rid-{rid}"),
                spec: sp,
                retry,
                now: *now,
                trace: None,
            }))
        }
        Op::Schedule { seed } => {
            let view = s.cluster_view(*now);
            let plan = schedule(&view, *now, *seed, &SchedulerConfig::default()).expect("engine runs");
            Command::ApplyPlan(ApplyPlan { plan, now: *now })
        }
        Op::BadPlan { job, node, dev, milli, replica } => {
            let p = Placement {
                job: JobId(u64::from(*job)),
                group: 0,
                replica: *replica,
                node: nid(*node),
                cpu_milli: 1000,
                memory_mib: 1024,
                devices: vec![DeviceShare { device: format!("gpu{dev}"), milli: *milli, memory_mib: 0 }],
                borrowed: false,
            };
            let plan =
                Plan { placements: vec![p.clone(), Placement { replica: p.replica + 1, ..p }], ..Plan::default() };
            Command::ApplyPlan(ApplyPlan { plan, now: *now })
        }
        Op::Report { pick, epoch_skew, status, end, code } => {
            let ids: Vec<AllocId> = s.allocs().keys().copied().collect();
            let id = if ids.is_empty() { AllocId(1) } else { ids[pick % ids.len()] };
            let epoch = s.allocs().get(&id).map_or(1, |a| a.alloc.epoch) + u64::from(*epoch_skew / 3);
            let status =
                [ReportedStatus::Running, ReportedStatus::Succeeded, ReportedStatus::Failed, ReportedStatus::Stopped]
                    [*status as usize % 4];
            // Mostly an end that goes with the status; sometimes none (an older agent), sometimes
            // one only the state machine may decide (refused).
            let end = END_CLASSES.get(*end as usize).copied();
            Command::AllocStatus(AllocStatus {
                alloc: id,
                epoch,
                status,
                message: String::new(),
                end,
                exit_code: *code,
                now: *now,
            })
        }
        Op::Migrate { job, pool, node } => Command::MigrateJob(MigrateJob {
            job: JobId(u64::from(*job)),
            to_pool: [None, Some("p"), Some("ghost")][*pool as usize % 3].map(PoolId::from),
            to_node: [None, Some(0), Some(1), Some(2), Some(3), Some(9)][*node as usize % 6].map(nid),
            now: *now,
        }),
        Op::Checkpoint { pick, step, bound } => {
            let ids: Vec<AllocId> = s.allocs().keys().copied().collect();
            let id = if ids.is_empty() { AllocId(1) } else { ids[pick % ids.len()] };
            let epoch = s.allocs().get(&id).map_or(1, |a| a.alloc.epoch);
            Command::ReportCheckpoint(ReportCheckpoint {
                alloc: id,
                epoch,
                uri: "file:///ck".into(),
                step: *step,
                size_bytes: 1,
                wall_time: *step,
                hardware: bound.then(|| CheckpointHardware { kind: DeviceKind::Gpu, model: "A100".into(), count: 1 }),
                now: *now,
            })
        }
        Op::NodeDown { node } => Command::NodeDown(NodeDown { node: nid(*node), reason: "ttl".into(), now: *now }),
        Op::Register { node, gpus, cpu_k, npu } => {
            let mut n = common::node(&format!("n{node}"), *gpus);
            if *npu {
                n.devices.iter_mut().for_each(|d| d.kind = DeviceKind::Npu);
            }
            n.cpu_milli = cpu_k * 1000;
            n.memory_mib = cpu_k * 4096;
            register(n, *now)
        }
        Op::Health { node, dev, healthy } => Command::DeviceHealth(DeviceHealth {
            node: nid(*node),
            device: format!("gpu{dev}"),
            health: if *healthy { Health::Healthy } else { Health::Unhealthy },
            reason: if *healthy { String::new() } else { format!("recovering: fault on gpu{dev}") },
            now: *now,
        }),
        Op::ClearQuarantine { node, dev } => {
            Command::ClearQuarantine(ClearQuarantine { node: nid(*node), device: format!("gpu{dev}"), now: *now })
        }
        Op::Mode { node, mode } => Command::SetNodeMode(SetNodeMode {
            node: nid(*node),
            mode: [NodeMode::Schedulable, NodeMode::Cordoned, NodeMode::Draining][*mode as usize % 3],
            now: *now,
            drain: None,
        }),
        Op::Cancel { job } => {
            Command::CancelJob(CancelJob { job: JobId(u64::from(*job)), reason: String::new(), now: *now })
        }
        Op::Quota { queue, gpus, cohort } => {
            let mut q = common::queue(QUEUES[*queue as usize % 2], *gpus);
            q.cohort = cohort.then(|| "c".to_owned());
            upsert_queue(q)
        }
        Op::Advance { secs } => {
            *now += secs;
            return None;
        }
    })
}

fn start() -> (State, Vec<Command>) {
    let mut s = State::default();
    let mut log = vec![upsert_queue(queue("q", 6)), upsert_queue(queue("r", 4))];
    for i in 0..3 {
        let mut n = node(&format!("n{i}"), 4);
        if i == 2 {
            n.devices.iter_mut().for_each(|d| d.kind = DeviceKind::Npu);
        }
        log.push(register(n, 0));
    }
    for c in &log {
        s.apply(c.clone());
    }
    (s, log)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_command_sequences_keep_every_invariant(ops in prop::collection::vec(op(), 1..120)) {
        let (mut s, mut log) = start();
        let mut now = 1;
        for (i, op) in ops.iter().enumerate() {
            let Some(cmd) = command(&s, op, &mut now) else { continue };
            log.push(cmd.clone());
            let resp = s.apply(cmd);
            prop_assert!(!resp.is_fatal());
            if let Err(v) = s.invariants() {
                prop_assert!(false, "step {i} {op:?} -> {resp:?}: {v}");
            }
        }
        let restored = State::restore(&s.snapshot().expect("snapshot")).expect("restore");
        prop_assert_eq!(restored.state_hash(), s.state_hash());
        // Replaying the same log (through the wire encoding) reaches the same state.
        let mut replay = State::default();
        for c in &log {
            let wire: Command = serde_json::from_slice(&serde_json::to_vec(c).expect("encodes")).expect("decodes");
            replay.apply(wire);
        }
        prop_assert_eq!(replay.state_hash(), s.state_hash());
    }

    #[test]
    fn job_ids_are_never_duplicated_by_retries(rids in prop::collection::vec(0u8..8, 1..60)) {
        let (mut s, _) = start();
        for (i, r) in rids.iter().enumerate() {
            s.apply(submit(&format!("r{r}"), spec("q", 1, 1, 0), i as u64));
        }
        let distinct: std::collections::BTreeSet<_> = rids.iter().collect();
        prop_assert_eq!(s.jobs().len(), distinct.len());
    }
}

#[test]
fn a_device_request_is_always_whole_or_a_fraction_of_one() {
    // Guard for the generator above: fractional requests use count 1.
    let mut sp = spec("q", 1, 1, 0);
    if let Some(d) = sp.groups[0].resources.devices.as_mut() {
        *d = DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: 250, memory_mib: 0 };
    }
    assert!(sp.validate(&suanli_model::Limits::default()).is_ok());
}

#[test]
fn the_generator_reaches_the_interesting_states() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    use std::collections::BTreeSet;
    use suanli_state::{JobState, Response};
    let mut runner = TestRunner::deterministic();
    let mut seen_states = BTreeSet::new();
    let (mut placed, mut refused, mut preempted) = (0, 0, 0);
    let (mut ends, mut nominated, mut migrating) = (std::collections::HashSet::new(), 0, 0);
    for _ in 0..20 {
        let ops = prop::collection::vec(op(), 200).new_tree(&mut runner).expect("generates").current();
        let (mut s, _) = start();
        let mut now = 1;
        for op in &ops {
            let Some(cmd) = command(&s, op, &mut now) else {
                continue;
            };
            if let Response::PlanApplied(o) = s.apply(cmd) {
                placed += o.placed.len();
                refused += o.refused_jobs.len();
                preempted += o.preempted.len();
            }
            assert_eq!(s.invariants(), Ok(()));
            seen_states.extend(s.jobs().values().map(|j| j.state.as_str()));
            ends.extend(s.jobs().values().flat_map(|j| j.history.iter().filter_map(|h| h.end)));
            nominated += s.jobs().values().filter(|j| j.nomination.is_some()).count();
            migrating += s.jobs().values().filter(|j| j.migration.is_some()).count();
        }
    }
    for st in [JobState::Pending, JobState::Running, JobState::Succeeded, JobState::Failed, JobState::Cancelled] {
        assert!(seen_states.contains(st.as_str()), "never reached {st:?}: {seen_states:?}");
    }
    assert!(placed > 50 && refused > 10, "placed {placed}, refused {refused}, preempted {preempted}");
    for e in [EndClass::Exit, EndClass::Oom, EndClass::NodeLost, EndClass::Stopped, EndClass::Migrated] {
        assert!(ends.contains(&e), "never saw an attempt end {e:?}: {ends:?}");
    }
    assert!(nominated > 0 && migrating > 0, "nominations {nominated}, migrations {migrating}");
}
