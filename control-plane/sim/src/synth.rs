//! A synthetic cluster and workload, generated from a seed: for the engine benchmark, for
//! `suanli sim replay --synthetic` on a machine without the public trace, and for tests.
//!
//! The cluster: nodes of 8 GPUs in two NVLink islands of four (each island on its own NUMA
//! node), 128 cores and 1 TiB of memory, in two pools (`a100`, `h100`) and two regions; racks
//! of 4 nodes and network blocks of 8 racks (the `topology.suanli.io/rack` and `/block` labels). The
//! stream mixes what a shared training/inference platform sees: fractional GPUs for
//! inference and notebooks, single and multi-GPU tasks, multi-node gang training jobs and
//! CPU-only batch work, spread over team queues whose nominal quotas split the cluster and
//! which borrow from each other inside one cohort.

use std::collections::BTreeMap;
use suanli_model::{
    CheckpointPolicy, Constraints, Device, DeviceKind, DeviceRequest, JobId, JobKind, JobSpec, Node, NodeId, PoolId,
    Queue, QueueId, ResVec, TaskGroup, TaskResources,
};
use suanli_scheduler::DetRng;
use suanli_scheduler::engine::PendingJob;

/// GPUs per synthetic node.
pub const GPUS_PER_NODE: u32 = 8;
/// Nodes per rack of the synthetic cluster.
pub const NODES_PER_RACK: usize = 4;
/// Racks per network block (leaf switch) of the synthetic cluster: 32 nodes, 256 GPUs a block.
pub const RACKS_PER_BLOCK: usize = 8;

/// `n` synthetic nodes (see the module docs).
pub fn nodes(n: usize) -> Vec<Node> {
    (0..n)
        .map(|i| {
            let (pool, model, region) =
                if i % 4 == 3 { ("h100", "H100-80G", "east") } else { ("a100", "A100-80G", "west") };
            let mut node = gpu_node(format!("node-{i:05}"), pool, 128_000, 1024 * 1024, GPUS_PER_NODE, model);
            node.datacenter = format!("{region}-dc{}", i % 2);
            node.region = region.to_owned();
            node.labels = BTreeMap::from([
                (suanli_scheduler::cluster::RACK_LABEL.to_owned(), format!("rack-{:04}", i / NODES_PER_RACK)),
                (
                    suanli_scheduler::cluster::BLOCK_LABEL.to_owned(),
                    format!("block-{:03}", i / (NODES_PER_RACK * RACKS_PER_BLOCK)),
                ),
            ]);
            for (g, d) in node.devices.iter_mut().enumerate() {
                let g = g as u32;
                d.memory_mib = 81_920;
                (d.numa, d.peer_group) = (g / 4, Some(g / 4));
            }
            node
        })
        .collect()
}

/// A schedulable node in `pool` with `gpus` GPUs of `model` (ids `gpu0`..; memory unknown,
/// NUMA 0, no NVLink group, no labels, region or datacenter): what synthetic clusters start from.
pub fn gpu_node(id: String, pool: &str, cpu_milli: u64, memory_mib: u64, gpus: u32, model: &str) -> Node {
    Node {
        id: NodeId::new(id),
        pool: PoolId::new(pool),
        datacenter: String::new(),
        region: String::new(),
        labels: BTreeMap::new(),
        cpu_milli,
        memory_mib,
        devices: (0..gpus)
            .map(|g| Device {
                id: format!("gpu{g}"),
                kind: DeviceKind::Gpu,
                model: model.to_owned(),
                memory_mib: 0,
                health: Default::default(),
                numa: 0,
                peer_group: None,
                partition_of: None,
                share_isolation: Default::default(),
            })
            .collect(),
        schedulable: true,
        agent_addr: String::new(),
    }
}

/// Team queues whose nominal GPU quotas split `total_gpus` evenly, all in cohort `shared`
/// with borrowing up to half their nominal quota again.
pub fn queues(teams: usize, total_gpus: u64) -> Vec<Queue> {
    let teams = teams.max(1);
    let per = total_gpus * 1000 / teams as u64;
    (0..teams)
        .map(|t| {
            let mut q = Queue::new(format!("team-{t}"), ResVec { gpu_milli: per, ..ResVec::MAX });
            q.team = format!("team-{t}");
            q.cohort = Some("shared".into());
            q.weight = 1 + (t as u32 % 3);
            q.borrowing_limit = Some(ResVec { gpu_milli: per / 2, ..ResVec::MAX });
            q
        })
        .collect()
}

fn task(cpu: u64, mem_gib: u64, gpus: u32, milli: u32) -> TaskResources {
    TaskResources {
        cpu_milli: cpu,
        memory_mib: mem_gib * 1024,
        devices: (gpus > 0).then_some(DeviceRequest { kind: DeviceKind::Gpu, count: gpus, milli, memory_mib: 0 }),
    }
}

/// One synthetic job spec drawn from the mix, for queue `queue`.
pub fn job(rng: &mut DetRng, queue: &QueueId, name: String) -> JobSpec {
    let r = rng.below(100);
    let (kind, groups, gang) = match r {
        0..25 => {
            let milli = [250, 500, 500, 750][rng.below(4) as usize];
            (JobKind::Inference, vec![("serve", 1, task(4_000, 16, 1, milli))], false)
        }
        25..55 => (JobKind::Training, vec![("worker", 1, task(12_000, 96, 1, 1000))], false),
        55..75 => {
            let g = [2, 4][rng.below(2) as usize];
            (JobKind::Training, vec![("worker", 1, task(12_000 * u64::from(g), 96 * u64::from(g), g, 1000))], false)
        }
        75..90 => {
            let replicas = 2 + rng.below(3) as u32;
            (JobKind::Training, vec![("worker", replicas, task(96_000, 768, 8, 1000))], true)
        }
        _ => (JobKind::Batch, vec![("task", 1 + rng.below(4) as u32, task(8_000, 32, 0, 0))], false),
    };
    let models = match rng.below(10) {
        0 => vec!["H100-80G".to_owned()],
        1 => vec!["A100-80G".to_owned()],
        _ => Vec::new(),
    };
    JobSpec {
        name,
        queue: queue.clone(),
        kind,
        priority: if rng.below(10) == 0 { 10 } else { 0 },
        preemptible: true,
        gang,
        groups: groups
            .into_iter()
            .map(|(n, replicas, resources)| TaskGroup {
                name: n.into(),
                replicas,
                min_replicas: None,
                resources,
                task: None,
            })
            .collect(),
        constraints: Constraints { device_models: models, ..Default::default() },
        runtime_estimate_s: Some(600 + rng.below(6 * 3600)),
        checkpoint: (kind == JobKind::Training).then_some(CheckpointPolicy {
            interval_s: 1800,
            grace_s: 60,
            restore_s: 120,
            signal: Default::default(),
        }),
        service: None,
    }
}

/// Pending jobs spread round-robin over `queues` until their GPU request reaches
/// `gpu_fraction` of `total_gpus`.
pub fn pending(queues: &[Queue], total_gpus: u64, gpu_fraction: f64, seed: u64) -> Vec<PendingJob> {
    let mut rng = DetRng::new(seed);
    let target = (total_gpus as f64 * 1000.0 * gpu_fraction.clamp(0.0, 10.0)) as u64;
    let mut out = Vec::new();
    let mut gpu = 0u64;
    let mut i = 0u64;
    while gpu < target && !queues.is_empty() && out.len() < 10_000_000 {
        let q = &queues[(i % queues.len() as u64) as usize].id;
        let spec = job(&mut rng, q, format!("job-{i}"));
        gpu += spec.total().gpu_milli;
        out.push(PendingJob {
            grow: false,
            occupied: Vec::new(),
            id: JobId(i + 1),
            spec,
            submitted_at: i / 64,
            nominated: false,
        });
        i += 1;
    }
    out
}

/// The synthetic stream as trace pods (for `sim fill`/`sim replay` without a trace file):
/// `count` pods, arrivals spread `mean_gap_s` apart on average, durations from the runtime
/// estimates. With `gangs` false every pod is a single task (the fill procedure's model).
pub fn trace_pods(count: usize, seed: u64, mean_gap_s: u64, gangs: bool) -> Vec<crate::trace::TracePod> {
    let mut rng = DetRng::new(seed);
    let queue = QueueId::new("default");
    let mut t = 0u64;
    (0..count)
        .map(|i| {
            let spec = job(&mut rng, &queue, format!("synth-{i:06}"));
            t += rng.below(2 * mean_gap_s.max(1) + 1);
            let g = &spec.groups[0];
            let dev = g.resources.devices.as_ref();
            crate::trace::TracePod {
                gpu_spec: spec.constraints.device_models.clone(),
                arrival_s: t,
                duration_s: spec.runtime_estimate_s,
                priority: spec.priority,
                replicas: if gangs { g.replicas } else { 1 },
                ..crate::trace::TracePod::single(
                    spec.name.clone(),
                    g.resources.cpu_milli,
                    g.resources.memory_mib,
                    dev.map_or(0, |d| d.count),
                    dev.map_or(0, |d| d.milli),
                )
            }
        })
        .collect()
}
