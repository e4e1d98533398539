//! Builders shared by the state machine's tests.
#![allow(dead_code)]

use suanli_model::{
    Constraints, Device, DeviceKind, DeviceRequest, JobKind, JobSpec, Node, NodeId, PoolId, Queue, QueueId, ResVec,
    TaskGroup, TaskResources,
};
use suanli_scheduler::{SchedulerConfig, schedule};
use suanli_state::{
    AllocStatus, ApplyPlan, Command, PlanOutcome, RegisterNode, ReportedStatus, Response, State, SubmitJob, UpsertQueue,
};

pub fn node(id: &str, gpus: u32) -> Node {
    Node {
        id: NodeId::from(id),
        pool: PoolId::from("p"),
        datacenter: "dc".into(),
        region: "r".into(),
        labels: Default::default(),
        cpu_milli: 64_000,
        memory_mib: 256 * 1024,
        devices: (0..gpus)
            .map(|i| {
                let mut d = Device::simple(format!("gpu{i}"), DeviceKind::Gpu, "A100");
                d.memory_mib = 80 * 1024;
                d
            })
            .collect(),
        schedulable: true,
        agent_addr: String::new(),
    }
}

pub fn queue(id: &str, gpus: u64) -> Queue {
    Queue::new(id, ResVec { gpu_milli: gpus * 1000, ..ResVec::MAX })
}

pub fn spec(queue: &str, replicas: u32, gpus: u32, priority: i32) -> JobSpec {
    JobSpec {
        name: "j".into(),
        queue: QueueId::from(queue),
        kind: JobKind::Training,
        priority,
        preemptible: true,
        gang: true,
        groups: vec![TaskGroup {
            task: None,
            name: "w".into(),
            replicas,
            min_replicas: None,
            resources: TaskResources {
                cpu_milli: 1000,
                memory_mib: 1024,
                devices: (gpus > 0).then_some(DeviceRequest {
                    kind: DeviceKind::Gpu,
                    count: gpus,
                    milli: 1000,
                    memory_mib: 0,
                }),
            },
        }],
        constraints: Constraints::default(),
        runtime_estimate_s: Some(3600),
        checkpoint: None,
        service: None,
    }
}

pub fn upsert_queue(q: Queue) -> Command {
    Command::UpsertQueue(UpsertQueue { queue: q })
}

pub fn register(n: Node, now: u64) -> Command {
    Command::RegisterNode(Box::new(RegisterNode { node: n, now, fence: None }))
}

pub fn submit(rid: &str, spec: JobSpec, now: u64) -> Command {
    Command::SubmitJob(Box::new(SubmitJob { client_request_id: rid.into(), spec, retry: None, now, trace: None }))
}

pub fn report(alloc: suanli_model::AllocId, epoch: u64, status: ReportedStatus, now: u64) -> Command {
    Command::AllocStatus(AllocStatus { alloc, epoch, status, message: String::new(), end: None, exit_code: None, now })
}

/// Applies a command, checks the invariants, and returns the response.
pub fn apply_ok(s: &mut State, cmd: Command) -> Response {
    let r = s.apply(cmd);
    if let Err(v) = s.invariants() {
        panic!("{v}");
    }
    r
}

/// One scheduling pass at `now` through the real engine, committed as ApplyPlan.
pub fn schedule_once(s: &mut State, now: u64) -> PlanOutcome {
    let view = s.cluster_view(now);
    let plan = schedule(&view, now, 7, &SchedulerConfig::default()).expect("engine runs");
    match apply_ok(s, Command::ApplyPlan(ApplyPlan { plan, now })) {
        Response::PlanApplied(o) => o,
        other => panic!("plan not applied: {other:?}"),
    }
}

/// A state with one queue `q` (8 GPUs of quota) and `nodes` nodes of 4 GPUs each.
pub fn cluster(nodes: usize) -> State {
    let mut s = State::default();
    apply_ok(&mut s, upsert_queue(queue("q", 8)));
    for i in 0..nodes {
        apply_ok(&mut s, register(node(&format!("n{i}"), 4), 1));
    }
    s
}
