//! `suanli-chaos`: runs chaos scenarios against real `suanli` clusters on loopback.

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use suanli_chaos::{Broken, Options, Report, run_scenario, scenario, table_header};

#[derive(Parser)]
#[command(
    name = "suanli-chaos",
    about = "Fault injection over a real suanli cluster, with invariant checks",
    args_conflicts_with_subcommands = true,
    after_help = "Scenarios: suanli-chaos list. Every run prints its seed; the same seed gives the same fault schedule."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// The scenario to run (see `list`).
    #[arg(long, default_value = "leader-kill")]
    scenario: String,
    /// Seed of the fault schedule and the workload (default: from the clock, printed).
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    common: Common,
}

#[derive(clap::Args, Clone)]
struct Common {
    /// Length of the fault phase, seconds.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    duration_s: u64,
    /// Keep each run's directory (data dirs, logs, history.json).
    #[arg(long)]
    keep: bool,
    /// Run a deliberately broken server (the checker must catch it).
    #[arg(long = "break", value_enum)]
    broken: Option<Broken>,
    /// Bound on recovery after the heal, seconds (invariant 4).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    settle_bound_s: u64,
    /// The `suanli` binary (default: $SUANLI_BIN, else next to this executable).
    #[arg(long)]
    bin: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every scenario once, and a table.
    Suite {
        /// Only the scenarios of the short suite (the one CI runs).
        #[arg(long)]
        short: bool,
        /// Base seed: scenario k runs with seed + k (default: from the clock, printed).
        #[arg(long)]
        seed: Option<u64>,
        #[command(flatten)]
        common: Common,
    },
    /// Runs one scenario again and again with fresh seeds until it fails or the time is up.
    Soak {
        /// The scenario.
        #[arg(long, default_value = "mixed")]
        scenario: String,
        /// How long, minutes.
        #[arg(long, default_value_t = 60)]
        minutes: u64,
        /// First seed (default: from the clock, printed).
        #[arg(long)]
        seed: Option<u64>,
        #[command(flatten)]
        common: Common,
    },
    /// Lists the scenarios.
    List,
    /// Region loss on three regions and a federation: the time until a job of the lost region
    /// runs elsewhere, per trial (`suanli bench federation` runs it and prints p50/p99).
    BenchRegionLoss {
        /// Trials (one region cut and healed each).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1_000))]
        trials: u64,
        /// Seed of the proxies (default 1).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The `suanli` binary (default: $SUANLI_BIN, else next to this executable).
        #[arg(long)]
        bin: Option<std::path::PathBuf>,
    },
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64 % 1_000_000_007)
}

fn options(c: &Common) -> anyhow::Result<Options> {
    let bin = match &c.bin {
        Some(b) => b.clone(),
        None => suanli_chaos::cluster::default_bin()?,
    };
    let mut o = Options::new(bin);
    o.duration_ms = c.duration_s * 1000;
    o.keep = c.keep;
    o.broken = c.broken;
    o.settle_bound_ms = c.settle_bound_s * 1000;
    Ok(o)
}

fn find(name: &str) -> anyhow::Result<&'static scenario::Scenario> {
    scenario::find(name).ok_or_else(|| {
        let names: Vec<&str> = scenario::SCENARIOS.iter().map(|s| s.name).collect();
        anyhow::anyhow!("--scenario: unknown scenario {name:?}; one of {}", names.join(", "))
    })
}

fn print_report(r: &Report) {
    println!("{}", table_header());
    println!("{}", r.row());
    println!("{}", r.details());
    if let Some(d) = &r.dir {
        println!("kept: {}", d.display());
    }
    println!("reproduce with: {}", r.reproduce());
}

async fn one(scn: &'static scenario::Scenario, seed: u64, o: &Options) -> anyhow::Result<Report> {
    let how = o.broken.map_or_else(String::new, |b| format!(" --break {b:?}"));
    println!("== {} (seed {seed}{how}): {}", scn.name, scn.about);
    println!("reproduce with: suanli-chaos --scenario {} --seed {seed}", scn.name);
    let t = Instant::now();
    let r = run_scenario(scn, seed, o).await?;
    println!("   {} in {:.0} s", if r.ok() { "pass" } else { "FAIL" }, t.elapsed().as_secs_f64());
    Ok(r)
}

async fn main_async(cli: Cli) -> anyhow::Result<bool> {
    match cli.cmd {
        Some(Cmd::BenchRegionLoss { trials, seed, bin }) => {
            let bin = match bin {
                Some(b) => b,
                None => suanli_chaos::cluster::default_bin()?,
            };
            let (mut times, floor) = suanli_chaos::federation::region_loss_trials(&bin, trials as usize, seed).await?;
            times.sort_unstable();
            let pct = |p: f64| times[((times.len() as f64 - 1.0) * p).round() as usize];
            // One machine-readable line for `suanli bench federation`.
            println!(
                "region-loss trials={} p50_ms={} p99_ms={} max_ms={} lease_plus_margin_ms={floor}",
                times.len(),
                pct(0.5),
                pct(0.99),
                pct(1.0)
            );
            Ok(true)
        }
        Some(Cmd::List) => {
            for s in scenario::SCENARIOS {
                println!("{:<20} {} servers{}  {}", s.name, s.servers, if s.short { ", short" } else { "" }, s.about);
            }
            Ok(true)
        }
        Some(Cmd::Suite { short, seed, common }) => {
            let o = options(&common)?;
            let base = seed.unwrap_or_else(clock_seed);
            println!("suite seed {base} (scenario k runs with seed {base} + k)");
            let t = Instant::now();
            let mut reports = Vec::new();
            for (k, scn) in scenario::SCENARIOS.iter().filter(|s| !short || s.short).enumerate() {
                let r = one(scn, base + k as u64, &o).await?;
                if !r.ok() {
                    println!("{}", r.details());
                    println!("reproduce with: {}", r.reproduce());
                }
                reports.push(r);
            }
            println!("\n{}", table_header());
            for r in &reports {
                println!("{}", r.row());
            }
            let failed = reports.iter().filter(|r| !r.ok()).count();
            println!("{} scenarios, {failed} failed, {:.0} s", reports.len(), t.elapsed().as_secs_f64());
            Ok(failed == 0)
        }
        Some(Cmd::Soak { scenario, minutes, seed, common }) => {
            let o = options(&common)?;
            let scn = find(&scenario)?;
            let mut seed = seed.unwrap_or_else(clock_seed);
            let until = Instant::now() + Duration::from_secs(minutes * 60);
            let mut n = 0;
            while Instant::now() < until {
                let r = one(scn, seed, &o).await?;
                n += 1;
                println!("{}", r.row());
                if !r.ok() {
                    print_report(&r);
                    return Ok(false);
                }
                seed += 1;
            }
            println!("soak: {n} runs of {} passed", scn.name);
            Ok(true)
        }
        None => {
            let o = options(&cli.run.common)?;
            let scn = find(&cli.run.scenario)?;
            let seed = cli.run.seed.unwrap_or_else(clock_seed);
            let r = one(scn, seed, &o).await?;
            print_report(&r);
            Ok(r.ok())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SUANLI_CHAOS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("suanli_chaos=info")),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("suanli-chaos: starting the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(main_async(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("suanli-chaos: {e:#}");
            ExitCode::from(2)
        }
    }
}
