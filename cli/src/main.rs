//! `suanli`: the one binary. Subcommands: `sim` (trace-driven simulation) and `bench`
//! (engine benchmarks). Later: `server`, `agent`, `dev`, client commands.

mod bench;
mod sim;
mod sim_replay;

use clap::{Parser, Subcommand};

/// suanli (算力): a fault-tolerant scheduler for shared GPU, NPU and CPU capacity.
#[derive(Parser, Debug)]
#[command(name = "suanli", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Replay traces on the scheduling engine (what-if analysis).
    #[command(subcommand)]
    Sim(sim::SimCmd),
    /// Benchmarks that print ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Sim(c) => sim::run(c),
        Cmd::Bench(c) => bench::run(c),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
