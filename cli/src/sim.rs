//! `suanli sim ...`

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::Mutex;
use suanli_scheduler::POLICY_NAMES;
use suanli_scheduler::policy::Weights;
use suanli_scheduler::rehearsal::{MAX_RUNS, RehearsalConfig};
use suanli_sim::fill::{FillOptions, FillRun, fill};
use suanli_sim::report::{self, PolicySummary};
use suanli_sim::trace;

#[derive(Subcommand, Debug)]
pub enum SimCmd {
    /// The published fill procedure of "Beware of Fragmentation" (ATC'23): time ignored, pods
    /// arrive in a seeded order until the GPU request passes --inflate x the cluster; reports
    /// the GPU allocation ratio at every 1% of arrived request, per policy, mean over seeds.
    Fill(FillArgs),
    /// Replays a trace with time: arrivals, durations, queueing, quota, preemption and
    /// backfill; reports waits, completion times, utilization, fragmentation and queue use.
    Replay(crate::sim_replay::ReplayArgs),
}

/// Output formats.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Format {
    /// Human-readable table.
    Table,
    /// JSON (summaries with mean curves).
    Json,
    /// CSV of mean curves (policy, arrived_pct, alloc_pct).
    Csv,
}

/// Which synthetic mixes `--synthetic-suite` runs.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum SuiteSet {
    /// The held-out mixes (drawn from a fixed seed; never used for tuning).
    HeldOut,
    /// The tuning mixes (hand-made corners and the retired held-out draws)
    Tuning,
    /// Both.
    All,
    /// Fresh draws over the same parameter space from the seeds of `--draws` (twelve mixes
    /// each, named `d<seed>-h..`): more evidence than one held-out draw, never tuned on.
    Draws,
}

/// At most this many draws for `--synthetic-suite draws` (twelve mixes each).
const MAX_DRAWS: usize = 100;

#[derive(Args, Debug)]
pub struct FillArgs {
    /// Node list (Alibaba `openb_node_list_*.csv`).
    #[arg(long, required_unless_present_any = ["synthetic", "synthetic_suite"], requires = "pods")]
    pub nodes: Option<PathBuf>,
    /// Pod list (Alibaba `openb_pod_list_*.csv` or suanli's native format).
    #[arg(long, requires = "nodes")]
    pub pods: Option<PathBuf>,
    /// Instead of trace files: a synthetic cluster of this many 8-GPU nodes and a generated
    /// pod stream (see docs/sim.md).
    #[arg(long, conflicts_with_all = ["nodes", "pods", "synthetic_suite"])]
    pub synthetic: Option<usize>,
    /// Instead of trace files: the synthetic workload mixes on a cluster shaped like the public
    /// one (docs/sim.md, "The synthetic suite"): `held-out` (the mixes no tuning has seen),
    /// `tuning`, `all`, or `draws` (fresh draws from the seeds of `--draws`). One row per
    /// mix: each policy's allocation at 130% arrived, the first policy's lead over `fgd`, the
    /// unallocated shares' ratio and the offline bound.
    #[arg(long, value_enum, conflicts_with_all = ["nodes", "pods"])]
    pub synthetic_suite: Option<SuiteSet>,
    /// With `--synthetic-suite draws`: the seeds of the draws, as `--seeds` takes them (at most
    /// 100 draws, 1,200 mixes).
    #[arg(long)]
    pub draws: Option<String>,
    /// Comma-separated policies, or `all`.
    #[arg(long, default_value = "suanli,fgd,bestfit")]
    pub policy: String,
    /// Seeds: `42`, `42,43` or a range `42-51`.
    #[arg(long, default_value = "42")]
    pub seeds: String,
    /// Target GPU request as a multiple of the cluster's GPUs.
    #[arg(long, default_value_t = 1.3)]
    pub inflate: f64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Also write an SVG chart of the mean allocation curves here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Weight of the fragmentation scorer (`suanli` policy).
    #[arg(long, default_value_t = Weights::default().fragmentation)]
    pub w_frag: f64,
    /// Weight of the bin-pack scorer (`suanli` policy).
    #[arg(long, default_value_t = Weights::default().binpack)]
    pub w_binpack: f64,
    /// Paired rehearsal fills per tie rule with which the `suanli` policy chooses its tie rule
    /// for the workload (docs/sim.md, "How the default decides"); 0: the profile's rule alone.
    #[arg(long, default_value_t = RehearsalConfig::default().runs)]
    pub rehearsal_runs: u32,
}

/// Parses `42`, `1,2,3` or `42-51` (at most 10,000 seeds).
pub fn parse_seeds(s: &str) -> Result<Vec<u64>> {
    parse_seed_list("--seeds", s, 10_000)
}

/// Parses `42`, `1,2,3` or `42-51` for option `flag`: between 1 and `max` seeds.
fn parse_seed_list(flag: &str, s: &str, max: usize) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some((a, b)) = part.split_once('-') {
            let a: u64 = a.trim().parse().with_context(|| format!("{flag}: {a:?} is not a number"))?;
            let b: u64 = b.trim().parse().with_context(|| format!("{flag}: {b:?} is not a number"))?;
            if b < a || b - a >= max as u64 {
                bail!("{flag}: range {a}-{b} must be ascending and hold at most {max} seeds");
            }
            out.extend(a..=b);
        } else {
            out.push(part.parse().with_context(|| format!("{flag}: {part:?} is not a number"))?);
        }
        if out.len() > max {
            break;
        }
    }
    if out.is_empty() || out.len() > max {
        bail!("{flag}: give between 1 and {max} seeds");
    }
    Ok(out)
}

/// Parses a policy list (`all` = every policy), rejecting unknown names.
pub fn parse_policies(s: &str) -> Result<Vec<String>> {
    if s.trim() == "all" {
        return Ok(POLICY_NAMES.iter().map(|p| (*p).to_owned()).collect());
    }
    let v: Vec<String> = s.split(',').map(|p| p.trim().to_owned()).filter(|p| !p.is_empty()).collect();
    for p in &v {
        if !POLICY_NAMES.contains(&p.as_str()) {
            bail!("--policy: unknown policy {p:?}; valid policies: {}, or all", POLICY_NAMES.join(", "));
        }
    }
    if v.is_empty() {
        bail!("--policy: give at least one policy");
    }
    Ok(v)
}

pub fn run(cmd: SimCmd) -> Result<()> {
    match cmd {
        SimCmd::Fill(a) => run_fill(a),
        SimCmd::Replay(a) => crate::sim_replay::run(a),
    }
}

fn run_fill(a: FillArgs) -> Result<()> {
    let policies = parse_policies(&a.policy)?;
    let seeds = parse_seeds(&a.seeds)?;
    if a.rehearsal_runs > MAX_RUNS {
        bail!("--rehearsal-runs: {} is over the limit of {MAX_RUNS}", a.rehearsal_runs);
    }
    if let Some(set) = a.synthetic_suite {
        return run_suite(&a, set, &policies, &seeds);
    }
    let (nodes, pods, title) = match (&a.nodes, &a.pods, a.synthetic) {
        (Some(n), Some(p), _) => {
            let name = |p: &PathBuf| p.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned());
            (trace::read_alibaba_nodes(n)?, trace::read_pods(p)?, format!("{} on {}", name(p), name(n)))
        }
        (_, _, Some(n)) => {
            if n == 0 || n > 100_000 {
                bail!("--synthetic: {n} nodes; give between 1 and 100000");
            }
            let nodes = suanli_sim::synth::nodes(n);
            let pods = suanli_sim::synth::trace_pods(n * 8, 7, 1, false);
            (nodes, pods, format!("synthetic stream on {n} synthetic nodes"))
        }
        _ => bail!("give --nodes and --pods, --synthetic N or --synthetic-suite SET"),
    };
    let sums = run_many(&a, &nodes, &vec![&pods[..]; seeds.len()], &policies, &seeds)?;
    if let Some(svg) = &a.svg {
        std::fs::write(svg, report::curves_svg(&title, &sums))
            .with_context(|| format!("--svg: writing {}", svg.display()))?;
    }
    match a.format {
        Format::Table => {
            println!(
                "{title}: {} node(s), {} pod(s), inflate {}, seeds {}",
                nodes.len(),
                pods.len(),
                a.inflate,
                a.seeds
            );
            print!("{}", report::table(&sums));
            print!("{}", bound_lines(&nodes, &pods, &sums, &seeds, a.inflate)?);
        }
        Format::Json => println!("{}", serde_json::to_string_pretty(&sums)?),
        Format::Csv => print!("{}", report::curves_csv(&sums)),
    }
    Ok(())
}

/// The offline bound (mean over seeds) and each policy's unallocated share against FGD's.
fn bound_lines(
    nodes: &[suanli_model::Node],
    pods: &[trace::TracePod],
    sums: &[PolicySummary],
    seeds: &[u64],
    inflate: f64,
) -> Result<String> {
    let total: u64 = nodes
        .iter()
        .map(|n| {
            n.devices.iter().filter(|d| d.kind == suanli_model::DeviceKind::Gpu && d.partition_of.is_none()).count()
                as u64
                * 1000
        })
        .sum();
    let mut bound = 0.0;
    for &seed in seeds {
        let (seq, _) = suanli_sim::fill::arrival_sequence(pods, nodes.len(), total, inflate, seed);
        bound += suanli_sim::bound::upper_bound(nodes, pods, &seq).context("offline bound")?.alloc_pct;
    }
    let bound = bound / seeds.len() as f64;
    let mut out = format!(
        "offline bound (no policy can allocate more of these arrivals): {bound:.2}% allocated, {:.2}% unallocated at least\n",
        (100.0 - bound).max(0.0)
    );
    for s in sums {
        if let Some(b) = s.bound_given_placed {
            out.push_str(&format!(
                "offline bound given the CPU-only pods {} placed: {b:.2}% ({:.2} points above its {:.2}%)\n",
                s.policy,
                b - s.alloc_at_130,
                s.alloc_at_130
            ));
        }
    }
    if let Some(f) = sums.iter().find(|s| s.policy == "fgd") {
        let free_fgd = 100.0 - f.alloc_at_130;
        for s in sums.iter().filter(|s| s.policy != "fgd") {
            let free = 100.0 - s.alloc_at_130;
            let ratio = if free_fgd > 1e-9 { free / free_fgd } else { 1.0 };
            out.push_str(&format!("unallocated at 130%: {} {free:.2}% / fgd {free_fgd:.2}% = {ratio:.3}\n", s.policy));
        }
    }
    Ok(out)
}

/// Runs every (policy, seed) pair on all cores; one summary per policy, in order.
/// `pods[k]` is the pod list seed `seeds[k]` runs on.
fn run_many(
    a: &FillArgs,
    nodes: &[suanli_model::Node],
    pods: &[&[trace::TracePod]],
    policies: &[String],
    seeds: &[u64],
) -> Result<Vec<PolicySummary>> {
    anyhow::ensure!(pods.len() == seeds.len(), "one pod list per seed");
    let weights = Weights { fragmentation: a.w_frag, binpack: a.w_binpack, ..Weights::default() };
    let jobs: Vec<(usize, usize)> = (0..policies.len()).flat_map(|p| (0..seeds.len()).map(move |k| (p, k))).collect();
    let threads =
        a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).clamp(1, 256);
    let bar = ProgressBar::new(jobs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} runs {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let rehearsal = Some(RehearsalConfig { runs: a.rehearsal_runs, ..RehearsalConfig::default() });
    // One pod list under every seed (a trace): its rehearsal is the same for every run, so it is
    // made once.
    let same_pods = pods.windows(2).all(|w| std::ptr::eq(w[0], w[1]));
    let rehearsed = match pods.first() {
        Some(first) if same_pods && policies.iter().any(|p| p == "suanli") => {
            let opts = FillOptions { weights, rehearsal, ..FillOptions::default() };
            suanli_sim::fill::rehearse_pods(nodes, first, &opts)?
        }
        _ => None,
    };
    let results: Mutex<Vec<Option<FillRun>>> = Mutex::new(vec![None; jobs.len()]);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let first_err: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads.min(jobs.len()) {
            scope.spawn(|| {
                loop {
                    let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(p, si)) = jobs.get(k) else { break };
                    let opts = FillOptions {
                        policy: policies[p].clone(),
                        seed: seeds[si],
                        inflate: a.inflate,
                        weights,
                        bound_given_placed: true,
                        rehearsal,
                        rehearsed: rehearsed.clone(),
                        ..FillOptions::default()
                    };
                    match fill(nodes, pods[si], &opts) {
                        Ok(r) => {
                            if let Ok(mut v) = results.lock() {
                                v[k] = Some(r);
                            }
                        }
                        Err(e) => {
                            if let Ok(mut f) = first_err.lock() {
                                f.get_or_insert(e.into());
                            }
                        }
                    }
                    bar.inc(1);
                }
            });
        }
    });
    bar.finish_and_clear();
    if let Some(e) = first_err.into_inner().ok().flatten() {
        return Err(e);
    }
    let results = results.into_inner().map_err(|_| anyhow::anyhow!("a worker thread panicked"))?;
    let sums: Vec<PolicySummary> = policies
        .iter()
        .enumerate()
        .map(|(p, name)| {
            let runs: Vec<FillRun> =
                jobs.iter().zip(&results).filter(|((pp, _), _)| *pp == p).filter_map(|(_, r)| r.clone()).collect();
            report::summarize(name, &runs)
        })
        .collect();
    Ok(sums)
}

/// One mix's results in the synthetic suite.
#[derive(Debug, serde::Serialize)]
struct SuiteRow {
    mix: suanli_sim::mix::Mix,
    summaries: Vec<PolicySummary>,
    /// Mean offline upper bound on allocation at the end of the run, %.
    bound_alloc: f64,
}

fn run_suite(a: &FillArgs, set: SuiteSet, policies: &[String], seeds: &[u64]) -> Result<()> {
    use suanli_sim::mix;
    if set != SuiteSet::Draws && a.draws.is_some() {
        bail!("--draws is for --synthetic-suite draws");
    }
    let mixes = match set {
        SuiteSet::HeldOut => mix::held_out_set(),
        SuiteSet::Tuning => mix::tuning_set(),
        SuiteSet::All => mix::tuning_set().into_iter().chain(mix::held_out_set()).collect(),
        SuiteSet::Draws => {
            let Some(spec) = &a.draws else {
                bail!("--synthetic-suite draws needs --draws SEEDS (for example --draws 1301-1310)");
            };
            parse_seed_list("--draws", spec, MAX_DRAWS)?
                .into_iter()
                .flat_map(|seed| mix::draw(seed, &format!("d{seed}-")))
                .collect()
        }
    };
    let nodes = mix::hetero_nodes(mix::SUITE_NODES);
    let total_gpu: u64 = nodes.iter().map(|n| n.devices.len() as u64 * 1000).sum();
    let mut rows = Vec::new();
    for m in mixes {
        // Each seed draws the mix's pods anew as well as their arrival order, so the standard
        // error covers both.
        let lists: Vec<Vec<trace::TracePod>> =
            seeds.iter().map(|&s| mix::pods(&m, mix::SUITE_PODS, mix::pod_seed(&m, s))).collect();
        let refs: Vec<&[trace::TracePod]> = lists.iter().map(Vec::as_slice).collect();
        let summaries = run_many(a, &nodes, &refs, policies, seeds)?;
        let mut bound_sum = 0.0;
        for (&seed, pods) in seeds.iter().zip(&lists) {
            let (seq, _) = suanli_sim::fill::arrival_sequence(pods, nodes.len(), total_gpu, a.inflate, seed);
            bound_sum += suanli_sim::bound::upper_bound(&nodes, pods, &seq)
                .with_context(|| format!("offline bound of mix {}", m.name))?
                .alloc_pct;
        }
        rows.push(SuiteRow { mix: m, summaries, bound_alloc: bound_sum / seeds.len() as f64 });
    }
    if a.format == Format::Json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if a.format == Format::Csv {
        println!("mix,policy,alloc_at_130,bound_alloc,bound_given_placed");
        for r in &rows {
            for s in &r.summaries {
                println!(
                    "{},{},{:.4},{:.4},{:.4}",
                    r.mix.name,
                    s.policy,
                    s.alloc_at_130,
                    r.bound_alloc,
                    s.bound_given_placed.unwrap_or(f64::NAN)
                );
            }
        }
        return Ok(());
    }
    println!(
        "synthetic suite ({set:?}): {} mixes on {} nodes shaped like the public cluster, {} pods each, inflate {}, seeds {}",
        rows.len(),
        nodes.len(),
        suanli_sim::mix::SUITE_PODS,
        a.inflate,
        a.seeds
    );
    println!(
        "allocation % at 130% arrived (mean over seeds); se: standard error of the paired difference; bound: offline \
         upper bound on any policy's allocation; b|P: the bound for any packing that admits the CPU-only pods P placed"
    );
    let fgd = policies.iter().position(|p| p == "fgd");
    let mut head = format!("{:<26}", "mix");
    for p in policies {
        head.push_str(&format!(" {p:>9}"));
    }
    if fgd.is_some() {
        head.push_str(&format!(" {:>8} {:>6} {:>13}", "Δ vs fgd", "se", "unalloc ratio"));
    }
    head.push_str(&format!(" {:>7}", "bound"));
    for p in policies {
        head.push_str(&format!(" {:>9}", format!("b|{p}")));
    }
    let rehearsed = policies.iter().any(|p| p == "suanli");
    if rehearsed {
        head.push_str(&format!(" {:>14}", "suanli by-kind"));
    }
    println!("{head}");
    let (mut wins, mut worst, mut clear_losses) = (0usize, f64::INFINITY, 0usize);
    for r in &rows {
        let mut line = format!("{:<26}", r.mix.name);
        for s in &r.summaries {
            line.push_str(&format!(" {:>9.2}", s.alloc_at_130));
        }
        if let Some(f) = fgd {
            let (c, b) = (r.summaries[0].alloc_at_130, r.summaries[f].alloc_at_130);
            let ratio = if 100.0 - b > 1e-9 { (100.0 - c) / (100.0 - b) } else { 1.0 };
            let se = paired_se(&r.summaries[0], &r.summaries[f]);
            line.push_str(&format!(" {:>+8.2} {:>6.2} {:>13.3}", c - b, se, ratio));
            if c + 1e-9 >= b {
                wins += 1;
            } else if b - c > 2.0 * se {
                clear_losses += 1;
            }
            worst = worst.min(c - b);
        }
        line.push_str(&format!(" {:>7.2}", r.bound_alloc));
        for s in &r.summaries {
            line.push_str(&format!(" {:>9.2}", s.bound_given_placed.unwrap_or(f64::NAN)));
        }
        if rehearsed {
            // Of the seeds, how many rehearsals chose the by-kind ties (the rest: first-fit).
            let chosen = r.summaries.iter().find(|s| s.policy == "suanli").and_then(|s| s.rehearsed_by_kind);
            line.push_str(&match chosen {
                Some((k, n)) => format!(" {:>14}", format!("{k}/{n}")),
                None => format!(" {:>14}", "-"),
            });
        }
        println!("{line}");
    }
    if fgd.is_some() && policies[0] != "fgd" {
        println!(
            "{} ≥ fgd on {wins}/{} mixes; smallest lead {worst:+.2} points; below by more than 2 se on {clear_losses}",
            policies[0],
            rows.len()
        );
    }
    Ok(())
}

/// The standard error of the mean of `a - b` over the seeds both runs reached 130% on (paired:
/// the same seed gives both policies the same arrivals); 0 with fewer than two seeds.
fn paired_se(a: &PolicySummary, b: &PolicySummary) -> f64 {
    let d: Vec<f64> =
        a.alloc_at_130_by_seed.iter().zip(&b.alloc_at_130_by_seed).filter_map(|(x, y)| Some((*x)? - (*y)?)).collect();
    if d.len() < 2 {
        return 0.0;
    }
    let n = d.len() as f64;
    let m = d.iter().sum::<f64>() / n;
    (d.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) / n).sqrt()
}
