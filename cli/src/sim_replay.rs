//! `suanli sim replay`: replays a trace with time (arrivals, durations, queueing, preemption,
//! backfill) on the scheduling engine and the replicated state machine, and reports waits,
//! completion times, utilization, fragmentation and per-queue use.

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use suanli_model::CheckpointPolicy;
use suanli_scheduler::POLICY_NAMES;
use suanli_scheduler::VictimOrder;
use suanli_scheduler::engine::SchedulerConfig;
use suanli_sim::replay::{self, ReplayOptions};
use suanli_sim::trace;

/// Output formats of a replay.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum ReplayFormat {
    /// Human-readable summary and per-queue table.
    Table,
    /// The whole report (summary, queues, time series) as JSON.
    Json,
    /// The utilization/fragmentation time series as CSV.
    Csv,
}

/// Arguments of `suanli sim replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Node list (Alibaba `openb_node_list_*.csv`).
    #[arg(long)]
    pub nodes: PathBuf,
    /// Pod list (Alibaba `openb_pod_list_*.csv` or suanli's native format, see docs/sim.md).
    #[arg(long)]
    pub pods: PathBuf,
    /// Queues file (`name,team,parent,cohort,weight,cpu_milli,memory_mib,gpu_milli,npu_milli,
    /// borrow_gpu_milli`, see docs/sim.md). Default: one queue `default` without quota.
    #[arg(long)]
    pub queues: Option<PathBuf>,
    /// Placement policy.
    #[arg(long, default_value = "suanli")]
    pub policy: String,
    /// Seed; every scheduling pass gets a seed derived from it and the pass number.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Least simulated seconds between two scheduling passes.
    #[arg(long, default_value_t = 10)]
    pub interval_s: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ReplayFormat::Table)]
    pub format: ReplayFormat,
    /// Stop with an error after this many events (arrivals, completions, wake-ups, passes).
    #[arg(long, default_value_t = 5_000_000)]
    pub max_events: u64,
    /// Recent arrivals that define the typical workload for fragmentation.
    #[arg(long, default_value_t = 2000)]
    pub workload_window: usize,
    /// Sample utilization and fragmentation every this many events.
    #[arg(long, default_value_t = 100)]
    pub sample_every: u64,
    /// Give every job a checkpoint policy with this interval (seconds); without it, preempted
    /// jobs lose all their work.
    #[arg(long)]
    pub checkpoint_interval_s: Option<u64>,
    /// Checkpoint grace period, seconds (with --checkpoint-interval-s).
    #[arg(long, default_value_t = 60)]
    pub checkpoint_grace_s: u64,
    /// Restore time after a checkpointed job restarts, seconds (with --checkpoint-interval-s).
    #[arg(long, default_value_t = 0)]
    pub restore_s: u64,
    /// A job preempted this many times runs as non-preemptible from then on.
    #[arg(long, default_value_t = 5)]
    pub max_preemptions_per_job: u32,
    /// Turn preemption off.
    #[arg(long)]
    pub no_preemption: bool,
    /// Turn backfill off.
    #[arg(long)]
    pub no_backfill: bool,
    /// Place gangs blind to the network (nodes' `topology.suanli.io/block` labels), to measure
    /// what topology-aware gang placement buys: compare the report's gang pairs across blocks.
    #[arg(long)]
    pub no_topology: bool,
    /// How preemption picks victims: `checkpoint-aware` (least lost work: device milli × time
    /// since the last checkpoint + restore) or `youngest-first` (most recently started).
    #[arg(long, default_value = "checkpoint-aware")]
    pub victim_order: String,
    /// Replay the trace twice in this process, once per victim order, and print both and the
    /// ratio of GPU-hours lost to preemption (youngest-first / checkpoint-aware).
    #[arg(long)]
    pub compare_victim_orders: bool,
    /// Keep every K-th node of the node list only (the model mix stays, capacity shrinks K
    /// times), so a trace that never fills the whole cluster queues on part of it.
    #[arg(long, default_value_t = 1)]
    pub node_stride: usize,
    /// Divide every arrival time by this factor (run times unchanged), so queues form.
    #[arg(long, default_value_t = 1)]
    pub compress_arrivals: u64,
    /// Priorities by QoS class for traces that carry QoS but no priority (Alibaba), e.g.
    /// `LS=10,Guaranteed=10,Burstable=5,BE=0`.
    #[arg(long)]
    pub qos_priority: Option<String>,
    /// Inference services to run beside the trace (CSV: name,queue,priority,gpu_milli,
    /// gpu_model,cpu_milli,memory_mib,min_replicas,max_replicas,capacity_rps,target_pct,
    /// trough_rps,peak_rps,peak_hour,startup_s,period_s,scale_down_window_s; see docs/sim.md):
    /// each one's diurnal request rate is reported by its replicas and autoscaled. Needs
    /// --until-s.
    #[arg(long)]
    pub services: Option<PathBuf>,
    /// End the replay at this simulated time, seconds (pods arriving later are left out).
    #[arg(long)]
    pub until_s: Option<u64>,
    /// Leave out the pods arriving before this simulated time, seconds (after
    /// --compress-arrivals): the replay starts at the first pod left, on an empty cluster.
    #[arg(long, default_value_t = 0)]
    pub from_s: u64,
    /// With --services: replay twice in this process, once with services and batch sharing
    /// every node (services preempt batch at peaks) and once with a static partition (the
    /// services' own nodes sized for their peak, batch on the rest), and compare them.
    #[arg(long)]
    pub compare_static: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Parses `CLASS=PRIORITY,...`.
fn parse_qos_priority(s: &str) -> Result<BTreeMap<String, i32>> {
    let mut m = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            bail!("--qos-priority: {part:?} is not CLASS=PRIORITY");
        };
        let prio: i32 = v
            .trim()
            .parse()
            .ok()
            .filter(|p: &i32| p.unsigned_abs() <= 1_000_000)
            .with_context(|| format!("--qos-priority: {v:?} is not an integer in -1000000..=1000000"))?;
        m.insert(k.trim().to_owned(), prio);
    }
    if m.is_empty() {
        bail!("--qos-priority: empty; expected CLASS=PRIORITY[,CLASS=PRIORITY...]");
    }
    Ok(m)
}

/// Runs `suanli sim replay`.
pub fn run(a: ReplayArgs) -> Result<()> {
    if !POLICY_NAMES.contains(&a.policy.as_str()) {
        bail!("--policy: unknown policy {:?}; valid policies: {}", a.policy, POLICY_NAMES.join(", "));
    }
    let Some(victim_order) = VictimOrder::parse(&a.victim_order) else {
        bail!("--victim-order: unknown order {:?}; valid orders: {}", a.victim_order, VictimOrder::NAMES.join(", "));
    };
    if a.compress_arrivals == 0 || a.compress_arrivals > 1_000_000 {
        bail!("--compress-arrivals: {} must be between 1 and 1000000", a.compress_arrivals);
    }
    let qos = a.qos_priority.as_deref().map(parse_qos_priority).transpose()?;
    let loading = Instant::now();
    if a.node_stride == 0 || a.node_stride > 1_000_000 {
        bail!("--node-stride: {} must be between 1 and 1000000", a.node_stride);
    }
    let nodes: Vec<_> =
        trace::read_alibaba_nodes(&a.nodes).context("--nodes")?.into_iter().step_by(a.node_stride).collect();
    let mut pods = trace::read_pods(&a.pods).context("--pods")?;
    trace::compress_arrivals(&mut pods, a.compress_arrivals);
    if a.until_s.is_some_and(|u| u < a.from_s) {
        bail!("--until-s: must not be before --from-s ({})", a.from_s);
    }
    pods.retain(|p| p.arrival_s >= a.from_s && a.until_s.is_none_or(|u| p.arrival_s <= u));
    let services = match &a.services {
        Some(p) => replay::read_services(p).context("--services")?,
        None => Vec::new(),
    };
    if a.compare_static && services.is_empty() {
        bail!("--compare-static: needs --services (the services to partition for)");
    }
    if !services.is_empty() && a.until_s.is_none() {
        bail!("--services: needs --until-s (services run forever; say when the replay ends)");
    }
    if let Some(m) = &qos {
        trace::priority_by_qos(&mut pods, m);
    }
    let queues = match &a.queues {
        Some(p) => replay::read_queues(p).context("--queues")?,
        None => vec![replay::default_queue()],
    };
    let opts = ReplayOptions {
        config: SchedulerConfig {
            policy: a.policy.clone(),
            preemption: !a.no_preemption,
            backfill: !a.no_backfill,
            topology_aware: !a.no_topology,
            victim_order,
            ..SchedulerConfig::default()
        },
        seed: a.seed,
        interval_s: a.interval_s,
        max_events: a.max_events,
        workload_window: a.workload_window,
        sample_every: a.sample_every,
        record_jobs: false,
        max_preemptions_per_job: a.max_preemptions_per_job,
        checkpoint: a.checkpoint_interval_s.map(|interval_s| CheckpointPolicy {
            interval_s,
            grace_s: a.checkpoint_grace_s,
            restore_s: a.restore_s,
            signal: Default::default(),
        }),
        services,
        static_partition: false,
        until_s: a.until_s,
    };
    if a.compare_static {
        return compare_static(&a, &nodes, &pods, &queues, opts);
    }
    if a.compare_victim_orders {
        return compare(&a, &nodes, &pods, &queues, opts);
    }
    let bar = if a.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some(pods.len() as u64), ProgressDrawTarget::stderr())
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} jobs arrived {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let report = replay::replay_with_progress(&nodes, &pods, &queues, &opts, &mut |p| {
        bar.set_position(p.arrived);
        bar.set_message(format!("t={} events={} pending={}", replay::format_duration(p.now_s), p.events, p.pending));
    });
    bar.finish_and_clear();
    let report = report?;
    let took = started.elapsed().as_secs_f64();
    match a.format {
        ReplayFormat::Table => {
            println!("{} on {}: {} pod(s), {} queue(s)", a.pods.display(), a.nodes.display(), pods.len(), queues.len());
            print!("{}", report.table());
        }
        ReplayFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        ReplayFormat::Csv => print!("{}", report.series_csv()),
    }
    if !a.quiet {
        eprintln!(
            "replayed in {took:.2}s wall ({:.2}s loading), {} passes, {:.0} events/s",
            started.duration_since(loading).as_secs_f64(),
            report.passes,
            report.events as f64 / took.max(1e-9)
        );
    }
    Ok(())
}

/// `--compare-victim-orders`: one replay per order, same trace, options and seed.
fn compare(
    a: &ReplayArgs,
    nodes: &[suanli_model::Node],
    pods: &[trace::TracePod],
    queues: &[suanli_model::Queue],
    opts: ReplayOptions,
) -> Result<()> {
    let orders = [VictimOrder::CheckpointAware, VictimOrder::YoungestFirst];
    let mut reports = Vec::new();
    for order in orders {
        let o =
            ReplayOptions { config: SchedulerConfig { victim_order: order, ..opts.config.clone() }, ..opts.clone() };
        let started = Instant::now();
        let r = replay::replay(nodes, pods, queues, &o).with_context(|| format!("replay with {}", order.as_str()))?;
        if !a.quiet {
            eprintln!("{}: replayed in {:.2}s wall", order.as_str(), started.elapsed().as_secs_f64());
        }
        reports.push((order, r));
    }
    let lost = |i: usize| reports[i].1.lost_gpu_hours;
    let ratio = if lost(0) > 0.0 { lost(1) / lost(0) } else { f64::NAN };
    match a.format {
        ReplayFormat::Json => {
            let v = serde_json::json!({
                "checkpoint_aware": reports[0].1,
                "youngest_first": reports[1].1,
                "lost_gpu_hours_ratio_youngest_first_to_checkpoint_aware": ratio,
            });
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        _ => {
            println!("{} on {}: {} pod(s), {} queue(s)", a.pods.display(), a.nodes.display(), pods.len(), queues.len());
            for (order, r) in &reports {
                println!("== victim order {}", order.as_str());
                print!("{}", r.table());
            }
            println!("victim order       preemptions  preempted jobs  GPU-h lost to preemption");
            for (order, r) in &reports {
                println!(
                    "{:<18} {:>11} {:>15} {:>25.2}",
                    order.as_str(),
                    r.preemptions,
                    r.preempted_jobs,
                    r.lost_gpu_hours
                );
            }
            println!("GPU-hours lost, youngest-first / checkpoint-aware: {ratio:.2}x");
        }
    }
    Ok(())
}

/// `--compare-static`: services and batch sharing every node, then on a static partition;
/// same trace, services, options and seed.
fn compare_static(
    a: &ReplayArgs,
    nodes: &[suanli_model::Node],
    pods: &[trace::TracePod],
    queues: &[suanli_model::Queue],
    opts: ReplayOptions,
) -> Result<()> {
    let mut reports = Vec::new();
    for static_partition in [false, true] {
        let o = ReplayOptions { static_partition, ..opts.clone() };
        let mode = if static_partition { "static" } else { "shared" };
        let started = Instant::now();
        let r = replay::replay(nodes, pods, queues, &o).with_context(|| format!("replay {mode}"))?;
        if !a.quiet {
            eprintln!("{mode}: replayed in {:.2}s wall", started.elapsed().as_secs_f64());
        }
        reports.push(r);
    }
    match a.format {
        ReplayFormat::Json => {
            let v = serde_json::json!({ "shared": reports[0], "static": reports[1] });
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        _ => {
            println!("{} on {}: {} pod(s), {} queue(s)", a.pods.display(), a.nodes.display(), pods.len(), queues.len());
            for r in &reports {
                let mode = r.inference.as_ref().map_or("", |i| i.mode.as_str());
                println!("== {mode}");
                print!("{}", r.table());
            }
            print!("{}", static_comparison(&reports[0], &reports[1]));
        }
    }
    Ok(())
}

/// The side-by-side table of `--compare-static`.
fn static_comparison(shared: &replay::ReplayReport, fixed: &replay::ReplayReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let (Some(x), Some(y)) = (&shared.inference, &fixed.inference) else {
        return s;
    };
    let _ = writeln!(s, "{:<34} {:>14} {:>14}", "", "shared", "static");
    let mut row = |name: &str, a: String, b: String| {
        let _ = writeln!(s, "{name:<34} {a:>14} {b:>14}");
    };
    row(
        "inference scale-out p99",
        replay::format_duration(x.scale_out_s.p99),
        replay::format_duration(y.scale_out_s.p99),
    );
    row("scale-outs", x.scale_out_s.count.to_string(), y.scale_out_s.count.to_string());
    row(
        "SLO violated, % of service-time",
        format!("{:.2}", x.slo_violation_pct),
        format!("{:.2}", y.slo_violation_pct),
    );
    row("requests unserved, %", format!("{:.3}", x.unserved_pct), format!("{:.3}", y.unserved_pct));
    row(
        "batch goodput, GPU-h",
        format!("{:.1}", x.batch_goodput_gpu_hours),
        format!("{:.1}", y.batch_goodput_gpu_hours),
    );
    row("batch jobs completed", x.batch_completed.to_string(), y.batch_completed.to_string());
    row("batch preemptions", shared.preemptions.to_string(), fixed.preemptions.to_string());
    row(
        "GPU allocation, mean %",
        format!("{:.2}", shared.gpu_util_mean_pct),
        format!("{:.2}", fixed.gpu_util_mean_pct),
    );
    let ratio =
        if y.batch_goodput_gpu_hours > 0.0 { x.batch_goodput_gpu_hours / y.batch_goodput_gpu_hours } else { f64::NAN };
    let _ = writeln!(s, "batch goodput, shared / static: {ratio:.2}x");
    s
}
