//! Property tests of the scheduling engine (issue 2, "What it must show", item 3).
//!
//! Random clusters (nodes with 0-8 GPUs, some NPUs, NVLink islands, unhealthy devices, cordoned
//! nodes), queues (nominal quotas, cohorts, borrowing and lending limits, a parent cap), valid
//! running allocations and pending jobs (whole, fractional, multi-GPU, gang, elastic, CPU-only,
//! priorities, constraints incl. allowed and avoided nodes) go through `schedule`, and the plan
//! is checked against the inputs:
//!
//! - (a) no node CPU/memory and no device share or device memory over-committed once placements
//!   are added to running work minus preempted victims; no placement on an unhealthy device or a
//!   cordoned node; every placement matches its request and constraints;
//! - (b) quota exceeded only by placements flagged `borrowed`, never beyond a borrowing limit, a
//!   queue without a cohort never over nominal, a parent cap never exceeded;
//! - (c) gang all-or-nothing; elastic groups at least their minimum; every pending job decided
//!   exactly once (placed or unplaced with a reason);
//! - (d) preemption only of preemptible work of lower priority, or of work on borrowed quota of
//!   another queue for a job within its nominal quota; whole gangs; checkpoint-first with the
//!   victim's grace; victims only on nodes the job could use; a job preempts only when its quota
//!   (own nominal or borrowing limit, every capped ancestor) admits it once the victims are gone;
//!   the preempting job waits;
//! - (e) the same (view, now, seed, config) gives the same plan, also after a JSON round trip of
//!   the view; another seed still satisfies every property;
//! - backfill: no lower-priority job lands on a node reserved for a blocked head job unless its
//!   runtime estimate ends before the reservation starts.
//!
//! The checkers are `suanli_scheduler::check` (which `schedule()` also `debug_assert!`s); each
//! recomputes what it needs from the inputs and none calls engine internals. The
//! generator also has a coverage test, so the properties cannot pass vacuously.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{
    AllocId, Allocation, CheckpointPolicy, Constraints, Device, DeviceKind, DeviceRequest, DeviceShare, ElasticRole,
    Health, JobId, JobKind, JobSpec, Node, NodeId, Plan, PoolId, Queue, QueueId, ResVec, TaskGroup, TaskResources,
};
use suanli_scheduler::check::{
    self, Check, Inputs, backfill as check_backfill, capacity as check_capacity, preemptions as check_preemptions,
    quota as check_quota,
};
use suanli_scheduler::{ClusterView, POLICY_NAMES, PendingJob, SchedulerConfig, schedule};

/// The scheduling pass's clock in every case.
const NOW: u64 = 100_000;
/// Cases per property; the whole file runs in a few seconds in the dev profile.
const CASES: u32 = 256;
const MODELS: [&str; 3] = ["A100", "V100", "H100"];

// ---------------------------------------------------------------------------------------------
// Generators: raw material first, then made valid deterministically (so proptest can shrink).

#[derive(Debug, Clone)]
struct NodeGen {
    gpus: u8,
    npus: u8,
    model: u8,
    /// 0: no peer links, 1: one island, 2: two islands.
    islands: u8,
    numa_split: bool,
    dev_mem: u8,
    unhealthy: Option<u8>,
    cpu: u8,
    mem: u8,
    schedulable: bool,
    pool: u8,
    region: u8,
    label: bool,
}

#[derive(Debug, Clone)]
enum DevGen {
    None,
    Frac { milli: u32, memory_mib: u64 },
    Whole { kind: DeviceKind, count: u32 },
}

#[derive(Debug, Clone)]
struct QueueGen {
    cohort: bool,
    weight: u32,
    extra_gpus: u64,
    extra_npus: u64,
    cpu_unlimited: bool,
    extra_cores: u64,
    borrow_limit_gpus: Option<u64>,
    lend_limit_gpus: Option<u64>,
    parent: bool,
}

#[derive(Debug, Clone)]
struct RunGen {
    node: usize,
    queue: usize,
    priority: i32,
    preemptible: bool,
    gang: bool,
    replicas: u32,
    cpu: u8,
    mem: u8,
    dev: DevGen,
    started_ago: u64,
    ckpt_after_start: Option<u64>,
    grace_s: Option<u64>,
    restore_s: u64,
    estimate_s: Option<u64>,
    borrowed: bool,
}

#[derive(Debug, Clone)]
struct GroupGen {
    replicas: u32,
    min: Option<u32>,
    cpu: u8,
    mem: u8,
    dev: DevGen,
}

#[derive(Debug, Clone)]
struct PendGen {
    queue: usize,
    priority: i32,
    preemptible: bool,
    gang: bool,
    groups: Vec<GroupGen>,
    constraint: u8,
    estimate_s: Option<u64>,
    submitted_ago: u64,
    checkpoint: bool,
}

#[derive(Debug, Clone)]
struct ConfGen {
    policy: usize,
    preemption: bool,
    backfill: bool,
    max_preemptions: usize,
    /// Pending work outranks running work and quotas are roomy: preemption is likely.
    crowded: bool,
}

/// One generated case: a valid view plus config and seed.
#[derive(Debug, Clone)]
struct Case {
    view: ClusterView,
    cfg: SchedulerConfig,
    seed: u64,
}

const CPU_CHOICES: [u64; 5] = [0, 500, 2_000, 8_000, 16_000];
const MEM_CHOICES: [u64; 4] = [0, 1_024, 8_192, 65_536];

fn priority() -> impl Strategy<Value = i32> {
    prop_oneof![Just(-1), Just(0), Just(0), Just(1), Just(3), Just(5)]
}

/// Running work sits a little lower on average, so pending work often outranks it.
fn running_priority() -> impl Strategy<Value = i32> {
    prop_oneof![Just(-1), Just(-1), Just(0), Just(0), Just(1), Just(3), Just(5)]
}

fn dev_gen() -> impl Strategy<Value = DevGen> {
    prop_oneof![
        2 => Just(DevGen::None),
        3 => ((1u32..10).prop_map(|m| m * 100), prop_oneof![Just(0u64), Just(4_096), Just(20_000)])
            .prop_map(|(milli, memory_mib)| DevGen::Frac { milli, memory_mib }),
        4 => prop_oneof![Just(1u32), Just(1), Just(2), Just(4), Just(8)]
            .prop_map(|count| DevGen::Whole { kind: DeviceKind::Gpu, count }),
        1 => (1u32..=2).prop_map(|count| DevGen::Whole { kind: DeviceKind::Npu, count }),
    ]
}

fn node_gen() -> impl Strategy<Value = NodeGen> {
    (
        (prop_oneof![1 => Just(0u8), 4 => 1u8..=8], prop_oneof![3 => Just(0u8), 1 => 1u8..=2], 0u8..3, 0u8..3),
        (any::<bool>(), 0u8..3, prop::option::weighted(0.25, 0u8..8), 0u8..3, 0u8..3),
        (prop::bool::weighted(0.85), 0u8..2, 0u8..2, any::<bool>()),
    )
        .prop_map(
            |(
                (gpus, npus, model, islands),
                (numa_split, dev_mem, unhealthy, cpu, mem),
                (schedulable, pool, region, label),
            )| {
                NodeGen {
                    gpus,
                    npus,
                    model,
                    islands,
                    numa_split,
                    dev_mem,
                    unhealthy,
                    cpu,
                    mem,
                    schedulable,
                    pool,
                    region,
                    label,
                }
            },
        )
}

fn queue_gen() -> impl Strategy<Value = QueueGen> {
    (
        (prop::bool::weighted(0.7), 1u32..=4, 0u64..=16, 0u64..=2, prop::bool::weighted(0.6)),
        (4u64..=128, prop::option::of(0u64..=6), prop::option::weighted(0.3, 0u64..=6), prop::bool::weighted(0.3)),
    )
        .prop_map(
            |((cohort, weight, extra_gpus, extra_npus, cpu_unlimited), (extra_cores, borrow, lend, parent))| QueueGen {
                cohort,
                weight,
                extra_gpus,
                extra_npus,
                cpu_unlimited,
                extra_cores,
                borrow_limit_gpus: borrow,
                lend_limit_gpus: lend,
                parent,
            },
        )
}

fn run_gen() -> impl Strategy<Value = RunGen> {
    (
        (0usize..16, 0usize..8, running_priority(), prop::bool::weighted(0.85), any::<bool>(), 1u32..=3),
        (0u8..5, 0u8..4, dev_gen(), 0u64..50_000),
        (
            prop::option::of(0u64..50_000),
            prop::option::of(0u64..600),
            0u64..300,
            prop::option::of(1u64..60_000),
            prop::bool::weighted(0.4),
        ),
    )
        .prop_map(
            |(
                (node, queue, priority, preemptible, gang, replicas),
                (cpu, mem, dev, started_ago),
                (ckpt_after_start, grace_s, restore_s, estimate_s, borrowed),
            )| RunGen {
                node,
                queue,
                priority,
                preemptible,
                gang,
                replicas,
                cpu,
                mem,
                dev,
                started_ago,
                ckpt_after_start,
                grace_s,
                restore_s,
                estimate_s,
                borrowed,
            },
        )
}

fn group_gen() -> impl Strategy<Value = GroupGen> {
    (1u32..=4, prop::option::of(1u32..=4), 0u8..5, 0u8..4, dev_gen())
        .prop_map(|(replicas, min, cpu, mem, dev)| GroupGen { replicas, min, cpu, mem, dev })
}

fn pend_gen() -> impl Strategy<Value = PendGen> {
    (
        (0usize..33, priority(), prop::bool::weighted(0.8), any::<bool>()),
        (
            prop::collection::vec(group_gen(), 1..=2),
            0u8..16,
            prop::option::of(1u64..20_000),
            0u64..5_000,
            any::<bool>(),
        ),
    )
        .prop_map(
            |((queue, priority, preemptible, gang), (groups, constraint, estimate_s, submitted_ago, checkpoint))| {
                PendGen {
                    queue,
                    priority,
                    preemptible,
                    gang,
                    groups,
                    constraint,
                    estimate_s,
                    submitted_ago,
                    checkpoint,
                }
            },
        )
}

fn conf_gen(crowded: f64) -> impl Strategy<Value = ConfGen> {
    (
        prop_oneof![4 => Just(0usize), 3 => 0usize..POLICY_NAMES.len()],
        prop::bool::weighted(0.8),
        prop::bool::weighted(0.8),
        prop_oneof![Just(1usize), Just(2), Just(64)],
        prop::bool::weighted(crowded),
    )
        .prop_map(|(policy, preemption, backfill, max_preemptions, crowded)| ConfGen {
            policy,
            preemption,
            backfill,
            max_preemptions,
            crowded,
        })
}

fn case() -> impl Strategy<Value = Case> {
    case_with(0.35)
}

/// Cases where a share `crowded` of them is built for preemption.
fn case_with(crowded: f64) -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(node_gen(), 1..=6),
        prop::collection::vec(queue_gen(), 1..=4),
        prop::option::weighted(0.5, 0u64..=8),
        prop::collection::vec(run_gen(), 0..=12),
        prop::collection::vec(pend_gen(), 1..=8),
        conf_gen(crowded),
        any::<u64>(),
    )
        .prop_map(|(nodes, queues, org_extra, runs, pends, conf, seed)| {
            build_case(&nodes, &queues, org_extra, &runs, &pends, &conf, seed)
        })
}

fn build_node(i: usize, g: &NodeGen) -> Node {
    let gpus = u32::from(g.gpus);
    let mut devices = Vec::new();
    for k in 0..gpus {
        let half = if gpus > 1 { k * 2 / gpus } else { 0 };
        devices.push(Device {
            id: format!("gpu{k}"),
            kind: DeviceKind::Gpu,
            model: MODELS[usize::from(g.model)].to_owned(),
            memory_mib: [0, 16_384, 81_920][usize::from(g.dev_mem)],
            health: if g.unhealthy == Some(k as u8) { Health::Unhealthy } else { Health::Healthy },
            numa: if g.numa_split { half } else { 0 },
            peer_group: match g.islands {
                0 => None,
                1 => Some(0),
                _ => Some(half),
            },
            partition_of: None,
            // Every other GPU of a NUMA-split node limits its shares (MPS).
            share_isolation: if g.numa_split && k % 2 == 0 {
                suanli_model::ShareIsolation::Enforced
            } else {
                suanli_model::ShareIsolation::Advisory
            },
        });
    }
    for k in 0..u32::from(g.npus) {
        devices.push(Device {
            id: format!("npu{k}"),
            kind: DeviceKind::Npu,
            model: "910B".into(),
            memory_mib: 65_536,
            health: Health::Healthy,
            numa: 0,
            peer_group: Some(9),
            partition_of: None,
            share_isolation: suanli_model::ShareIsolation::Advisory,
        });
    }
    let mut labels = BTreeMap::new();
    if g.label {
        labels.insert("ib".to_owned(), "yes".to_owned());
    }
    Node {
        id: NodeId(format!("n{i}")),
        pool: PoolId::new(["p0", "p1"][usize::from(g.pool)]),
        datacenter: "dc".into(),
        region: ["r0", "r1"][usize::from(g.region)].into(),
        labels,
        cpu_milli: [8_000, 32_000, 96_000][usize::from(g.cpu)],
        memory_mib: [16_384, 131_072, 524_288][usize::from(g.mem)],
        devices,
        schedulable: g.schedulable,
        agent_addr: String::new(),
    }
}

fn resources(cpu: u8, mem: u8, dev: &DevGen) -> TaskResources {
    let mut r = TaskResources {
        cpu_milli: CPU_CHOICES[usize::from(cpu)],
        memory_mib: MEM_CHOICES[usize::from(mem)],
        devices: match dev {
            DevGen::None => None,
            DevGen::Frac { milli, memory_mib } => {
                Some(DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: *milli, memory_mib: *memory_mib })
            }
            DevGen::Whole { kind, count } => {
                Some(DeviceRequest { kind: *kind, count: *count, milli: 1000, memory_mib: 0 })
            }
        },
    };
    if r.devices.is_none() && r.cpu_milli == 0 {
        r.cpu_milli = 1_000;
    }
    r
}

/// Free capacity while laying out running work.
#[derive(Clone)]
struct Free {
    cpu: Vec<u64>,
    mem: Vec<u64>,
    /// Per node, per device: (free milli, free memory).
    dev: Vec<Vec<(u32, u64)>>,
}

/// Fits one replica on `node`, returning its device shares.
fn fit(free: &mut Free, nodes: &[Node], node: usize, r: &TaskResources) -> Option<Vec<DeviceShare>> {
    if free.cpu[node] < r.cpu_milli || free.mem[node] < r.memory_mib {
        return None;
    }
    let mut shares = Vec::new();
    if let Some(req) = &r.devices {
        let devs = &nodes[node].devices;
        let mut picked = Vec::new();
        for (i, d) in devs.iter().enumerate() {
            let (m, mm) = free.dev[node][i];
            let ok = if req.milli >= 1000 { m == 1000 } else { m >= req.milli && mm >= req.memory_mib };
            if d.kind == req.kind && ok && picked.len() < req.count as usize {
                picked.push(i);
            }
        }
        if picked.len() < req.count as usize {
            return None;
        }
        for i in picked {
            free.dev[node][i].0 -= req.milli;
            free.dev[node][i].1 -= req.memory_mib;
            shares.push(DeviceShare { device: devs[i].id.clone(), milli: req.milli, memory_mib: req.memory_mib });
        }
    }
    free.cpu[node] -= r.cpu_milli;
    free.mem[node] -= r.memory_mib;
    Some(shares)
}

fn build_case(
    node_gens: &[NodeGen],
    queue_gens: &[QueueGen],
    org_extra: Option<u64>,
    runs: &[RunGen],
    pends: &[PendGen],
    conf: &ConfGen,
    seed: u64,
) -> Case {
    let nodes: Vec<Node> = node_gens
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let mut g = g.clone();
            if conf.crowded {
                // Roomy CPU and memory, so devices are what runs out.
                g.cpu = g.cpu.max(1);
                g.mem = g.mem.max(1);
            }
            build_node(i, &g)
        })
        .collect();
    let qid = |i: usize| QueueId(format!("q{i}"));
    let nq = queue_gens.len();

    // Running work: laid out so nothing is over-committed (it may sit on devices that became
    // unhealthy or on nodes cordoned since). A gang is placed whole or not at all.
    let mut free = Free {
        cpu: nodes.iter().map(|n| n.cpu_milli).collect(),
        mem: nodes.iter().map(|n| n.memory_mib).collect(),
        dev: nodes.iter().map(|n| n.devices.iter().map(|d| (1000, d.memory_mib)).collect()).collect(),
    };
    let mut running = Vec::new();
    let mut next_alloc = 1u64;
    // Crowded cases lay the running work out twice, so devices are mostly taken.
    let repeat = if conf.crowded { 2 } else { 1 };
    for (j, rg) in runs.iter().cycle().take(runs.len() * repeat).enumerate() {
        let res = resources(rg.cpu, rg.mem, &rg.dev);
        let queue = rg.queue % nq;
        let borrowed = rg.borrowed && queue_gens[queue].cohort;
        let before = free.clone();
        let mut allocs = Vec::new();
        for r in 0..rg.replicas {
            let node = (rg.node + r as usize) % nodes.len();
            let Some(devices) = fit(&mut free, &nodes, node, &res) else {
                if rg.gang {
                    free = before.clone();
                    allocs.clear();
                    break;
                }
                continue;
            };
            let started_at = NOW - rg.started_ago;
            allocs.push(Allocation {
                id: AllocId(next_alloc),
                job: JobId(1000 + j as u64),
                group: 0,
                replica: r,
                epoch: 0,
                node: nodes[node].id.clone(),
                queue: qid(queue),
                priority: rg.priority,
                preemptible: rg.preemptible,
                cpu_milli: res.cpu_milli,
                memory_mib: res.memory_mib,
                devices,
                started_at,
                last_checkpoint_at: rg.ckpt_after_start.map(|c| (started_at + c).min(NOW)),
                checkpoint_grace_s: rg.grace_s,
                restore_s: rg.restore_s,
                runtime_estimate_s: rg.estimate_s,
                borrowed,
                gang: rg.gang,
                // A non-gang group of several replicas stands for an elastic job: its first
                // replica is the minimum, the others surplus (shrunk first).
                elastic: match (rg.gang, rg.replicas > 1, r) {
                    (false, true, 0) => ElasticRole::Minimum,
                    (false, true, _) => ElasticRole::Surplus,
                    _ => ElasticRole::None,
                },
            });
            next_alloc += 1;
        }
        running.extend(allocs.into_iter().map(std::sync::Arc::new));
    }

    // Queues sized around the running work so that it is valid: non-borrowed work within
    // nominal, borrowed work within the borrowing limit, the parent cap above its subtree.
    let kinds = device_kinds(&nodes);
    let mut own = vec![ResVec::ZERO; nq];
    let mut lent = vec![ResVec::ZERO; nq];
    for a in &running {
        let i: usize = a.queue.0[1..].parse().expect("generated queue id");
        let u = alloc_usage(&kinds, a);
        if a.borrowed { lent[i] = add(lent[i], u) } else { own[i] = add(own[i], u) }
    }
    let has_org = org_extra.is_some() && queue_gens.iter().any(|q| q.parent);
    let mut queues = Vec::new();
    let mut subtree = ResVec::ZERO;
    for (i, g) in queue_gens.iter().enumerate() {
        let mut g = g.clone();
        if conf.crowded {
            g.extra_gpus += 48;
            g.extra_npus += 8;
            g.cpu_unlimited = true;
        }
        let nominal = ResVec {
            cpu_milli: if g.cpu_unlimited { u64::MAX } else { own[i].cpu_milli + g.extra_cores * 1000 },
            memory_mib: if g.cpu_unlimited { u64::MAX } else { own[i].memory_mib + g.extra_cores * 4096 },
            gpu_milli: own[i].gpu_milli + g.extra_gpus * 1000,
            npu_milli: own[i].npu_milli + g.extra_npus * 1000,
        };
        let total = add(own[i], lent[i]);
        let over = sub(total, nominal);
        let mut q = Queue::new(format!("q{i}"), nominal);
        q.weight = g.weight;
        q.cohort = g.cohort.then(|| "c".to_owned());
        q.borrowing_limit = g.borrow_limit_gpus.map(|b| ResVec {
            cpu_milli: over.cpu_milli + 64_000,
            memory_mib: over.memory_mib + 262_144,
            gpu_milli: over.gpu_milli + b * 1000,
            npu_milli: over.npu_milli + 1000,
        });
        q.lending_limit = g.lend_limit_gpus.map(|l| ResVec { gpu_milli: l * 1000, ..ResVec::MAX });
        if has_org && g.parent {
            q.parent = Some(QueueId::new("org"));
            subtree = add(subtree, total);
        }
        queues.push(q);
    }
    if let Some(extra) = org_extra.filter(|_| has_org) {
        let nominal = ResVec {
            cpu_milli: u64::MAX,
            memory_mib: u64::MAX,
            gpu_milli: subtree.gpu_milli + extra * 1000,
            npu_milli: subtree.npu_milli + 1000,
        };
        queues.push(Queue::new("org", nominal));
    }

    let pending = pends
        .iter()
        .enumerate()
        .map(|(k, pg)| {
            let queue = if pg.queue == 32 { QueueId::new("ghost") } else { qid(pg.queue % nq) };
            let groups = pg
                .groups
                .iter()
                .enumerate()
                .map(|(gi, gg)| TaskGroup {
                    task: None,
                    name: format!("g{gi}"),
                    replicas: gg.replicas,
                    min_replicas: gg.min.map(|m| m.min(gg.replicas)),
                    resources: resources(gg.cpu, gg.mem, &gg.dev),
                })
                .collect();
            let mut constraints = Constraints::default();
            match pg.constraint {
                4 => constraints.device_models = vec!["A100".into()],
                5 => constraints.device_models = vec!["V100".into(), "H100".into()],
                6 => constraints.pools = vec![PoolId::new("p0")],
                7 => {
                    constraints.labels.insert("ib".into(), "yes".into());
                }
                8 => constraints.regions = vec!["r1".into()],
                9 => constraints.device_models = vec!["B200".into()],
                10 => constraints.nodes = vec![NodeId::new("n0"), NodeId::new("n1")],
                11 => constraints.avoid_nodes = vec![NodeId::new("n0")],
                12 => constraints.share_isolation = suanli_model::ShareIsolation::Enforced,
                _ => {}
            }
            PendingJob {
                grow: false,
                occupied: Vec::new(),
                id: JobId(1 + k as u64),
                spec: JobSpec {
                    name: format!("job{k}"),
                    queue,
                    kind: JobKind::Batch,
                    priority: pg.priority + if conf.crowded { 3 } else { 0 },
                    preemptible: pg.preemptible,
                    gang: pg.gang,
                    groups,
                    constraints,
                    runtime_estimate_s: pg.estimate_s,
                    checkpoint: pg.checkpoint.then_some(CheckpointPolicy {
                        interval_s: 600,
                        grace_s: 60,
                        restore_s: 30,
                        signal: Default::default(),
                    }),
                    service: None,
                },
                submitted_at: NOW - pg.submitted_ago,
                nominated: false,
            }
        })
        .collect();

    let cfg = SchedulerConfig {
        policy: POLICY_NAMES[conf.policy].to_owned(),
        preemption: conf.preemption,
        backfill: conf.backfill,
        max_preemptions_per_job: conf.max_preemptions,
        ..SchedulerConfig::default()
    };
    Case {
        view: ClusterView { nodes, queues, pending, running, workload: Vec::new(), ..Default::default() },
        cfg,
        seed,
    }
}

// ---------------------------------------------------------------------------------------------
// Usage from the inputs, for the generator's quota bookkeeping.

fn add(a: ResVec, b: ResVec) -> ResVec {
    a.saturating_add(&b)
}

fn sub(a: ResVec, b: ResVec) -> ResVec {
    a.saturating_sub(&b)
}

type Kinds = BTreeMap<(String, String), DeviceKind>;

fn device_kinds(nodes: &[Node]) -> Kinds {
    nodes.iter().flat_map(|n| n.devices.iter().map(|d| ((n.id.0.clone(), d.id.clone()), d.kind))).collect()
}

fn usage(kinds: &Kinds, node: &NodeId, cpu: u64, mem: u64, shares: &[DeviceShare]) -> ResVec {
    let mut v = ResVec { cpu_milli: cpu, memory_mib: mem, ..ResVec::ZERO };
    for s in shares {
        match kinds.get(&(node.0.clone(), s.device.clone())) {
            Some(DeviceKind::Npu) => v.npu_milli += u64::from(s.milli),
            _ => v.gpu_milli += u64::from(s.milli),
        }
    }
    v
}

fn alloc_usage(kinds: &Kinds, a: &Allocation) -> ResVec {
    usage(kinds, &a.node, a.cpu_milli, a.memory_mib, &a.devices)
}

fn check_all(case: &Case, plan: &Plan) -> Check {
    check::plan(&case.view, plan, NOW, &case.cfg)
}

fn check_gangs(inp: &Inputs<'_>, plan: &Plan) -> Check {
    check::gangs(inp, plan, usize::MAX)
}

fn run(case: &Case, seed: u64) -> Plan {
    schedule(&case.view, NOW, seed, &case.cfg).expect("generated views are valid")
}

/// `PROPTEST_CASES=20000` runs a longer hunt; the default keeps the file well under 30 s.
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(CASES);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// (a) No over-commitment; no unhealthy device, cordoned node or unmet constraint.
    #[test]
    fn capacity_is_never_overcommitted(case in case()) {
        let plan = run(&case, case.seed);
        let r = check_capacity(&Inputs::new(&case.view), &plan);
        prop_assert!(r.is_ok(), "{}\nplan: {plan:#?}", msg(&r));
    }

    /// (b) Quota exceeded only by declared borrowing, within limits.
    #[test]
    fn quota_is_exceeded_only_by_declared_borrowing(case in case()) {
        let plan = run(&case, case.seed);
        let r = check_quota(&Inputs::new(&case.view), &plan);
        prop_assert!(r.is_ok(), "{}\nplan: {plan:#?}", msg(&r));
    }

    /// (c) Gang all-or-nothing; elastic at least min; every job decided once.
    #[test]
    fn gangs_are_all_or_nothing_and_elastic_jobs_get_their_minimum(case in case()) {
        let plan = run(&case, case.seed);
        let r = check_gangs(&Inputs::new(&case.view), &plan);
        prop_assert!(r.is_ok(), "{}\nplan: {plan:#?}", msg(&r));
    }

    /// Backfill never puts a long lower-priority job on a reserved node.
    #[test]
    fn backfill_respects_the_reservation(case in case()) {
        let plan = run(&case, case.seed);
        let r = check_backfill(&Inputs::new(&case.view), &plan, NOW);
        prop_assert!(r.is_ok(), "{}\nplan: {plan:#?}", msg(&r));
    }

    /// (e) Same inputs, same plan; another seed still satisfies every property.
    #[test]
    fn same_inputs_give_the_same_plan_and_any_seed_is_valid(case in case(), other in any::<u64>()) {
        let plan = run(&case, case.seed);
        prop_assert_eq!(&plan, &run(&case, case.seed));
        let json = serde_json::to_string(&case.view).expect("views serialize");
        let copy: ClusterView = serde_json::from_str(&json).expect("and deserialize");
        prop_assert_eq!(&plan, &schedule(&copy, NOW, case.seed, &case.cfg).expect("valid"));
        let plan2 = run(&case, other);
        let r = check_all(&case, &plan2);
        prop_assert!(r.is_ok(), "seed {other}: {}\nplan: {plan2:#?}", msg(&r));
    }
}

proptest! {
    // Crowded cases only, and twice as many: preemption is the rarest decision.
    #![proptest_config(ProptestConfig { cases: 2 * config().cases, ..config() })]

    /// (d) Preemption only of lower-priority or other queues' borrowed, preemptible work.
    #[test]
    fn preemption_spares_equal_priority_work_within_quota(case in case_with(1.0)) {
        let plan = run(&case, case.seed);
        let r = check_preemptions(&Inputs::new(&case.view), &plan, &case.cfg);
        prop_assert!(r.is_ok(), "{}\nplan: {plan:#?}", msg(&r));
    }
}

fn msg(r: &Check) -> String {
    r.as_ref().err().map(ToString::to_string).unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// The properties must not pass vacuously: the generator reaches every decision kind, and the
// checkers reject plans that break them.

fn sample(n: usize) -> Vec<Case> {
    let mut runner = TestRunner::deterministic();
    let strat = case();
    (0..n).map(|_| strat.new_tree(&mut runner).expect("generator").current()).collect()
}

#[test]
fn generated_cases_exercise_every_decision() {
    let cases = sample(400);
    let (mut placed, mut preempted, mut reserved, mut unplaced, mut borrowed, mut gang, mut frac) =
        (0, 0, 0, 0, 0, 0, 0);
    for c in &cases {
        let plan = run(c, c.seed);
        if let Err(e) = check_all(c, &plan) {
            panic!("{e}\ncase: {c:#?}\nplan: {plan:#?}");
        }
        placed += usize::from(!plan.placements.is_empty());
        preempted += usize::from(!plan.preemptions.is_empty());
        reserved += usize::from(!plan.reservations.is_empty());
        unplaced += usize::from(!plan.unplaced.is_empty());
        borrowed += usize::from(plan.placements.iter().any(|p| p.borrowed));
        let ids: BTreeSet<JobId> = plan.placements.iter().map(|p| p.job).collect();
        let jobs: Vec<&PendingJob> = c.view.pending.iter().filter(|p| ids.contains(&p.id)).collect();
        gang += usize::from(jobs.iter().any(|j| j.spec.gang && j.spec.groups.iter().any(|g| g.replicas > 1)));
        frac += usize::from(plan.placements.iter().any(|p| p.devices.iter().any(|d| d.milli < 1000)));
    }
    let n = cases.len();
    let stats = format!(
        "of {n}: placed {placed}, preempted {preempted}, reserved {reserved}, unplaced {unplaced}, borrowed {borrowed}, multi-replica gangs {gang}, fractional {frac}"
    );
    eprintln!("{stats}");
    assert!(placed * 2 > n, "{stats}");
    assert!(unplaced * 4 > n, "{stats}");
    assert!(preempted * 20 > n, "{stats}");
    assert!(reserved * 50 > n, "{stats}");
    assert!(borrowed * 40 > n, "{stats}");
    assert!(gang * 20 > n, "{stats}");
    assert!(frac * 10 > n, "{stats}");
}

/// A case whose plan has placements and preemptions, to corrupt.
fn busy_case() -> (Case, Plan) {
    sample(400)
        .into_iter()
        .map(|c| {
            let p = run(&c, c.seed);
            (c, p)
        })
        .find(|(_, p)| !p.placements.is_empty() && !p.preemptions.is_empty())
        .expect("some generated case preempts and places")
}

#[test]
fn checkers_reject_broken_plans() {
    let (case, plan) = busy_case();
    assert_eq!(check_all(&case, &plan), Ok(()));

    // (a) the same replica twice on its node, and a placement on a cordoned node.
    let mut bad = plan.clone();
    let mut p = bad.placements[0].clone();
    p.replica += 1000;
    for _ in 0..200 {
        bad.placements.push(p.clone());
    }
    assert!(check_capacity(&Inputs::new(&case.view), &bad).is_err());
    let mut bad = plan.clone();
    let mut view = case.view.clone();
    for n in &mut view.nodes {
        n.schedulable = false;
    }
    assert!(check_capacity(&Inputs::new(&view), &bad).is_err());

    // (b) every placement flagged not borrowed, in a queue whose nominal quota is zero.
    let mut view = case.view.clone();
    for q in &mut view.queues {
        q.nominal = ResVec::ZERO;
        q.cohort = None;
    }
    assert!(check_quota(&Inputs::new(&view), &plan).is_err());

    // (c) one replica of a placed job dropped from a gang, or a job left undecided.
    let mut view = case.view.clone();
    let first = plan.placements[0].job;
    for p in &mut view.pending {
        if p.id == first {
            p.spec.gang = true;
            p.spec.groups[0].replicas += 1;
        }
    }
    assert!(check_gangs(&Inputs::new(&view), &plan).is_err());
    bad = plan.clone();
    bad.unplaced.clear();
    bad.placements.clear();
    assert!(check_gangs(&Inputs::new(&case.view), &bad).is_err());

    // (d) the victim made equal priority and not borrowed, or non-preemptible.
    let victim = plan.preemptions[0].alloc;
    let for_job = plan.preemptions[0].for_job;
    let prio = case.view.pending.iter().find(|p| p.id == for_job).map(|p| p.spec.priority).expect("for_job is pending");
    let mut view = case.view.clone();
    for a in &mut view.running {
        if a.id == victim {
            let a = std::sync::Arc::make_mut(a);
            a.priority = prio;
            a.borrowed = false;
        }
    }
    assert!(check_preemptions(&Inputs::new(&view), &plan, &case.cfg).is_err());
    let mut view = case.view.clone();
    for a in &mut view.running {
        if a.id == victim {
            std::sync::Arc::make_mut(a).preemptible = false;
        }
    }
    assert!(check_preemptions(&Inputs::new(&view), &plan, &case.cfg).is_err());
}

#[test]
fn checkers_reject_backfill_onto_reserved_nodes() {
    let (case, plan) = sample(2_000)
        .into_iter()
        .map(|c| {
            let p = run(&c, c.seed);
            (c, p)
        })
        .find(|(_, p)| !p.reservations.is_empty() && !p.placements.is_empty())
        .expect("some generated case reserves and places");
    assert_eq!(check_all(&case, &plan), Ok(()));
    let mut bad = plan.clone();
    let head = bad.reservations[0].job;
    let mut view = case.view.clone();
    // Make every placed job a long, low-priority one, and reserve every node.
    bad.reservations[0].nodes = view.nodes.iter().map(|n| n.id.clone()).collect();
    bad.reservations[0].start_at = NOW;
    for p in &mut view.pending {
        if p.id != head {
            p.spec.priority = -100;
            p.spec.runtime_estimate_s = None;
        }
    }
    assert!(check_backfill(&Inputs::new(&view), &bad, NOW).is_err());
    // Nominated jobs go first in a pass, before a head job that is not nominated reserved
    // anything: their placements are not backfill.
    for p in &mut view.pending {
        p.nominated = p.id != head;
    }
    assert_eq!(check_backfill(&Inputs::new(&view), &bad, NOW), Ok(()));
}

// ---------------------------------------------------------------------------------------------
// MIG: a physical GPU and its partitions are never in use at once, over several passes.

/// Per node, per GPU: how many MIG partitions it carries (0 = not MIG-enabled).
fn mig_node(i: usize, layout: &[u8]) -> Node {
    let mut devices = Vec::new();
    for (k, &parts) in layout.iter().enumerate() {
        devices.push(Device::simple(format!("gpu{k}"), DeviceKind::Gpu, "A100"));
        for j in 0..parts {
            let mut d = Device::simple(format!("gpu{k}-mig{j}"), DeviceKind::Gpu, "A100-1g.10gb");
            d.partition_of = Some(format!("gpu{k}"));
            devices.push(d);
        }
    }
    Node {
        id: NodeId(format!("n{i}")),
        pool: PoolId::new("p0"),
        datacenter: "dc".into(),
        region: "r0".into(),
        labels: BTreeMap::new(),
        cpu_milli: 64_000,
        memory_mib: 262_144,
        devices,
        schedulable: true,
        agent_addr: String::new(),
    }
}

/// A job of the MIG cases: `kind` 0 whole GPU, 1 a 400-milli share, 2 two GPUs, 3 a MIG slice
/// by model, 4 a whole parent by model.
fn mig_job(id: u64, kind: u8, priority: i32) -> PendingJob {
    let (count, milli, models): (u32, u32, Vec<String>) = match kind {
        0 => (1, 1000, vec![]),
        1 => (1, 400, vec![]),
        2 => (2, 1000, vec![]),
        3 => (1, 1000, vec!["A100-1g.10gb".into()]),
        _ => (1, 1000, vec!["A100".into()]),
    };
    PendingJob {
        grow: false,
        occupied: Vec::new(),
        id: JobId(id),
        spec: JobSpec {
            name: format!("mig{id}"),
            queue: QueueId::new("q"),
            kind: JobKind::Batch,
            priority,
            preemptible: true,
            gang: false,
            groups: vec![TaskGroup {
                task: None,
                name: "g".into(),
                replicas: 1,
                min_replicas: None,
                resources: TaskResources {
                    cpu_milli: 1000,
                    memory_mib: 1024,
                    devices: Some(DeviceRequest { kind: DeviceKind::Gpu, count, milli, memory_mib: 0 }),
                },
            }],
            constraints: Constraints { device_models: models, ..Constraints::default() },
            runtime_estimate_s: None,
            checkpoint: None,
            service: None,
        },
        submitted_at: id,
        nominated: false,
    }
}

/// Fails when a device is over 1000 milli or a partition and its parent are both in use.
fn mig_double_booking(nodes: &[Node], running: &[std::sync::Arc<Allocation>]) -> Option<String> {
    let mut used: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    for a in running {
        for s in &a.devices {
            *used.entry((a.node.as_str(), s.device.as_str())).or_default() += s.milli;
        }
    }
    if let Some(((n, d), m)) = used.iter().find(|(_, m)| **m > 1000) {
        return Some(format!("device {n}/{d} holds {m} milli"));
    }
    for n in nodes {
        for d in &n.devices {
            if let Some(p) = &d.partition_of
                && used.contains_key(&(n.id.as_str(), d.id.as_str()))
                && used.contains_key(&(n.id.as_str(), p.as_str()))
            {
                return Some(format!("{}: partition {} and its parent {p} both in use", n.id, d.id));
            }
        }
    }
    None
}

proptest! {
    #![proptest_config(config())]

    /// Random MIG layouts, random jobs (whole, shared, two-GPU, slice, parent) arriving over
    /// passes with random priorities (so preemption frees parents and slices) and random ends:
    /// after every pass no device is double booked, the plan passes the checker, and every
    /// pending job is decided.
    #[test]
    fn mig_parents_and_partitions_are_never_used_at_once(
        layouts in prop::collection::vec(prop::collection::vec(0u8..=3, 1..=3), 1..=3),
        jobs in prop::collection::vec((0u8..5, 0i32..3, 1u8..4), 1..=24),
        seed in any::<u64>(),
        policy in 0usize..POLICY_NAMES.len(),
    ) {
        let nodes: Vec<Node> = layouts.iter().enumerate().map(|(i, l)| mig_node(i, l)).collect();
        let cfg = SchedulerConfig { policy: POLICY_NAMES[policy].to_owned(), ..SchedulerConfig::default() };
        let mut running: Vec<std::sync::Arc<Allocation>> = Vec::new();
        let mut ends: BTreeMap<AllocId, u64> = BTreeMap::new();
        let mut pending: Vec<PendingJob> = Vec::new();
        let mut next_alloc = 1u64;
        let passes = 6u64;
        let per_pass = jobs.len().div_ceil(passes as usize - 2).max(1);
        for pass in 0..passes {
            let now = NOW + pass * 100;
            for (k, &(kind, prio, _)) in jobs.iter().enumerate().skip(pass as usize * per_pass).take(per_pass) {
                pending.push(mig_job(k as u64 + 1, kind, prio));
            }
            running.retain(|a| ends.get(&a.id).is_none_or(|&e| e > pass));
            let view = ClusterView {
                nodes: nodes.clone(),
                queues: vec![Queue::new("q", ResVec::MAX)],
                pending: pending.clone(),
                running: running.clone(),
                ..Default::default()
            };
            let plan = schedule(&view, now, seed ^ pass, &cfg).expect("valid view");
            let r = check::plan(&view, &plan, now, &cfg);
            prop_assert!(r.is_ok(), "pass {pass}: {}\nplan: {plan:#?}", msg(&r));
            // Victims stop; placements start.
            let victims: BTreeSet<AllocId> = plan.preemptions.iter().map(|p| p.alloc).collect();
            for a in running.iter().filter(|a| victims.contains(&a.id)) {
                let k = a.job.0 as usize - 1;
                pending.push(mig_job(a.job.0, jobs[k].0, jobs[k].1));
            }
            running.retain(|a| !victims.contains(&a.id));
            for p in &plan.placements {
                let job = pending.iter().find(|j| j.id == p.job).expect("placed job was pending").clone();
                running.push(std::sync::Arc::new(Allocation {
                    id: AllocId(next_alloc),
                    job: p.job,
                    group: p.group,
                    replica: p.replica,
                    epoch: 1,
                    node: p.node.clone(),
                    queue: job.spec.queue.clone(),
                    priority: job.spec.priority,
                    preemptible: true,
                    cpu_milli: p.cpu_milli,
                    memory_mib: p.memory_mib,
                    devices: p.devices.clone(),
                    started_at: now,
                    last_checkpoint_at: None,
                    checkpoint_grace_s: None,
                    restore_s: 0,
                    runtime_estimate_s: None,
                    borrowed: p.borrowed,
                    gang: false,
                    elastic: Default::default(),
                }));
                ends.insert(AllocId(next_alloc), pass + u64::from(jobs[p.job.0 as usize - 1].2));
                next_alloc += 1;
            }
            let placed: BTreeSet<JobId> = plan.placements.iter().map(|p| p.job).collect();
            pending.retain(|j| !placed.contains(&j.id));
            if let Some(why) = mig_double_booking(&nodes, &running) {
                prop_assert!(false, "pass {pass}: {why}\nplan: {plan:#?}");
            }
        }
    }
}

/// The checker catches a plan that hands out a partition while its parent is used.
#[test]
fn checker_rejects_a_partition_next_to_its_used_parent() {
    let nodes = vec![mig_node(0, &[2])];
    let mut job = mig_job(1, 3, 0);
    job.spec.constraints.device_models.clear();
    let parent = Allocation {
        id: AllocId(1),
        job: JobId(50),
        group: 0,
        replica: 0,
        epoch: 1,
        node: NodeId::new("n0"),
        queue: QueueId::new("q"),
        priority: 0,
        preemptible: false,
        cpu_milli: 1000,
        memory_mib: 1024,
        devices: vec![DeviceShare { device: "gpu0".into(), milli: 300, memory_mib: 0 }],
        started_at: 0,
        last_checkpoint_at: None,
        checkpoint_grace_s: None,
        restore_s: 0,
        runtime_estimate_s: None,
        borrowed: false,
        gang: false,
        elastic: Default::default(),
    };
    let view = ClusterView {
        nodes,
        queues: vec![Queue::new("q", ResVec::MAX)],
        pending: vec![job],
        running: vec![std::sync::Arc::new(parent)],
        ..Default::default()
    };
    let placement = suanli_model::Placement {
        job: JobId(1),
        group: 0,
        replica: 0,
        node: NodeId::new("n0"),
        cpu_milli: 1000,
        memory_mib: 1024,
        devices: vec![DeviceShare { device: "gpu0-mig1".into(), milli: 1000, memory_mib: 0 }],
        borrowed: false,
    };
    let plan = Plan { placements: vec![placement.clone()], ..Plan::default() };
    let r = check_capacity(&Inputs::new(&view), &plan);
    assert!(msg(&r).contains("MIG partition gpu0-mig1 and its parent gpu0 both in use"), "{}", msg(&r));
    // The same slice on a free GPU passes; with node constraints that exclude n0 it fails.
    let mut free = view.clone();
    free.running.clear();
    assert_eq!(check_capacity(&Inputs::new(&free), &plan), Ok(()));
    free.pending[0].spec.constraints.avoid_nodes = vec![NodeId::new("n0")];
    assert!(check_capacity(&Inputs::new(&free), &plan).is_err());
    free.pending[0].spec.constraints.avoid_nodes.clear();
    free.pending[0].spec.constraints.nodes = vec![NodeId::new("n1")];
    assert!(check_capacity(&Inputs::new(&free), &plan).is_err());
}
