//! `suanli bench ...`: benchmarks that print a ratio against a baseline measured in the same
//! run, never timed assertions.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::time::Instant;
use suanli_scheduler::engine::{ClusterView, SchedulerConfig, schedule};
use suanli_sim::{fill, synth, trace};

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Placement throughput of the scheduling engine on a synthetic cluster (one core),
    /// against a naive full-scan baseline measured in the same run.
    Engine(EngineArgs),
    /// Acknowledged submissions per second on a 3-server loopback cluster with fsync: one
    /// synchronous client (the baseline) against many concurrent clients, with p50/p99
    /// latency, and the placements the scheduling loop commits meanwhile.
    Submit(crate::bench_cluster::SubmitArgs),
    /// Leader kills (SIGKILL) on a 3-server cluster: time until writes succeed again, p50/p99.
    Failover(crate::bench_cluster::FailoverArgs),
    /// The federation: dispatch decisions per second, its cost on a region's submit
    /// throughput (with and without `[federation]`), and region loss to running elsewhere.
    Federation(crate::bench_federation::FederationArgs),
}

#[derive(Args, Debug)]
pub struct EngineArgs {
    /// Nodes in the synthetic cluster (8 GPUs each, two NVLink islands).
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    /// Pending GPU request as a fraction of the cluster's GPUs.
    #[arg(long, default_value_t = 0.95)]
    pub load: f64,
    /// Team queues sharing the cluster (nominal quotas + borrowing in one cohort).
    #[arg(long, default_value_t = 8)]
    pub queues: usize,
    /// Jobs the naive baseline places (it is slow: keep it small).
    #[arg(long, default_value_t = 300)]
    pub baseline_jobs: usize,
    /// Policy.
    #[arg(long, default_value = "suanli")]
    pub policy: String,
    /// Seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Also time a full 130% fill of this trace cluster (Alibaba node list) ...
    #[arg(long, requires = "trace_pods")]
    pub trace_nodes: Option<PathBuf>,
    /// ... with this pod list.
    #[arg(long)]
    pub trace_pods: Option<PathBuf>,
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Engine(a) => engine(a),
        BenchCmd::Submit(a) => crate::bench_cluster::submit(a),
        BenchCmd::Failover(a) => crate::bench_cluster::failover(a),
        BenchCmd::Federation(a) => crate::bench_federation::run(a),
    }
}

fn placements_per_s(view: &ClusterView, cfg: &SchedulerConfig, seed: u64) -> Result<(usize, f64)> {
    let t = Instant::now();
    let plan = schedule(view, 0, seed, cfg)?;
    let s = t.elapsed().as_secs_f64();
    Ok((plan.placements.len(), s))
}

fn engine(a: EngineArgs) -> Result<()> {
    if a.nodes == 0 || a.nodes > 1_000_000 {
        anyhow::bail!("--nodes: {} must be between 1 and 1000000", a.nodes);
    }
    if cfg!(debug_assertions) {
        eprintln!(
            "note: debug build; the engine crates are optimized even here, but use `cargo run --release` for reported figures"
        );
    }
    let nodes = synth::nodes(a.nodes);
    let gpus = a.nodes as u64 * u64::from(synth::GPUS_PER_NODE);
    let queues = synth::queues(a.queues, gpus);
    let pending = synth::pending(&queues, gpus, a.load, a.seed);
    let tasks: u64 = pending.iter().map(|p| p.spec.groups.iter().map(|g| u64::from(g.replicas)).sum::<u64>()).sum();
    println!(
        "cluster: {} nodes, {} GPUs; stream: {} jobs, {} tasks ({:.0}% of GPUs requested), {} queues, policy {}",
        a.nodes,
        gpus,
        pending.len(),
        tasks,
        a.load * 100.0,
        a.queues,
        a.policy
    );
    let cfg = SchedulerConfig { policy: a.policy.clone(), ..SchedulerConfig::default() };
    let full =
        ClusterView { nodes: nodes.clone(), queues: queues.clone(), pending: pending.clone(), ..Default::default() };
    // The pass cost without any job: snapshot -> index build, queue setup.
    let empty = ClusterView { nodes: nodes.clone(), queues: queues.clone(), ..Default::default() };
    let build = (0..3).map(|_| placements_per_s(&empty, &cfg, a.seed).map(|r| r.1)).collect::<Result<Vec<_>>>()?;
    let build = build.iter().copied().fold(f64::INFINITY, f64::min);
    let (n, s) = placements_per_s(&full, &cfg, a.seed)?;
    println!(
        "indexed engine, whole stream in one pass: {n} placements in {s:.3} s = {:.0} placements/s end to end",
        n as f64 / s
    );
    println!(
        "  of which index build from the snapshot {build:.3} s (empty pass); placing: {:.0} placements/s",
        n as f64 / (s - build).max(1e-9)
    );

    // A pass starts by reserving every running allocation on its node. Same run: the
    // allocations of the full pass above, reserved one at a time (each moving its node to a
    // new class) against all at once (each touched node moved once).
    let plan = schedule(&full, 0, a.seed, &cfg)?;
    let running: Vec<_> =
        plan.placements.iter().map(|p| (&p.node, p.cpu_milli, p.memory_mib, p.devices.as_slice(), None)).collect();
    let limits = suanli_model::Limits::default();
    let tie = suanli_scheduler::policy::TieBreak::FixedOrder;
    let time_best = |f: &dyn Fn(&mut suanli_scheduler::Cluster)| -> Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let mut c = suanli_scheduler::Cluster::new(&full.nodes, &limits, false, tie)?;
            let t = Instant::now();
            f(&mut c);
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let one_by_one = time_best(&|c| {
        for r in &running {
            c.occupy(r.0, r.1, r.2, r.3, r.4);
        }
    })?;
    let at_once = time_best(&|c| c.occupy_all(running.iter().copied()))?;
    println!(
        "pass start, {} running allocations: one at a time {:.1} ms, all at once {:.1} ms: {:.1}x faster",
        running.len(),
        one_by_one * 1e3,
        at_once * 1e3,
        one_by_one / at_once.max(1e-9)
    );

    let head: Vec<_> = pending.iter().take(a.baseline_jobs).cloned().collect();
    let small = ClusterView { nodes, queues, pending: head, ..Default::default() };
    // Indexed: best of 5 (it is short); naive: once.
    let mut ni = 0;
    let mut si = f64::INFINITY;
    for _ in 0..5 {
        let (n, s) = placements_per_s(&small, &cfg, a.seed)?;
        ni = n;
        si = si.min(s);
    }
    let naive_cfg = SchedulerConfig { naive_scan: true, ..cfg };
    let (nn, sn) = placements_per_s(&small, &naive_cfg, a.seed)?;
    println!(
        "first {} jobs, same run: indexed {ni} placements in {si:.3} s, naive full scan {nn} in {sn:.3} s: {:.1}x faster",
        a.baseline_jobs,
        sn / si
    );

    if let (Some(tn), Some(tp)) = (&a.trace_nodes, &a.trace_pods) {
        let nodes = trace::read_alibaba_nodes(tn).with_context(|| format!("--trace-nodes {}", tn.display()))?;
        let pods = trace::read_pods(tp).with_context(|| format!("--trace-pods {}", tp.display()))?;
        let opts = fill::FillOptions { policy: a.policy.clone(), seed: a.seed, ..Default::default() };
        let t = Instant::now();
        let run = fill::fill(&nodes, &pods, &opts)?;
        let total = t.elapsed().as_secs_f64();
        let naive = fill::fill(&nodes, &pods, &fill::FillOptions { naive: true, ..opts })?;
        println!(
            "trace fill to 130% ({} nodes, {} arrivals): {:.3} s placing ({:.3} s with index build), naive full scan {:.3} s: {:.1}x",
            nodes.len(),
            run.arrived_pods,
            run.place_seconds,
            total,
            naive.place_seconds,
            naive.place_seconds / run.place_seconds.max(1e-9)
        );
    }
    Ok(())
}
