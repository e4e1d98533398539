//! `suanli bench federation`: figures for the federation (docs/federation.md), printed against
//! what they must exceed or a baseline measured in the same run, never asserted:
//!
//! 1. **dispatch decisions per second**: `suanli_federation::dispatch::dispatch` on synthetic
//!    views (`dispatch::synthetic_view(regions, jobs, seed)`) of a few sizes, on one core;
//! 2. **the federation's cost on a region's submit throughput**: the same `bench submit` load on
//!    a region without `[federation]` and on one with it (syncing to a one-voter federation),
//!    in one run, and the ratio;
//! 3. **time from region loss to the jobs running elsewhere**, p50/p99 over `--trials`, against
//!    the lease + margin it must exceed: measured by `suanli-chaos bench-region-loss` (three
//!    regions and a 3-voter federation with every link behind a fault-injecting proxy; the
//!    chaos harness is a separate binary so that its failpoints never enter this one).

use crate::bench_cluster::{Side, Wire, compare};
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Flags of `suanli bench federation`.
#[derive(Args, Debug)]
pub struct FederationArgs {
    /// Region-loss trials (each cuts one region from the federation and heals it).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    pub trials: u64,
    /// A fast smoke run: small dispatch views, a short submit load, 2 region-loss trials.
    #[arg(long)]
    pub quick: bool,
    /// Seed of the synthetic views.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// The chaos harness binary for the region-loss trials (default: $SUANLI_CHAOS_BIN, else
    /// `suanli-chaos` next to this executable).
    #[arg(long)]
    pub chaos_bin: Option<PathBuf>,
    /// Skip the region-loss trials (they need `suanli-chaos`: `cargo build -p suanli-chaos`).
    #[arg(long)]
    pub no_region_loss: bool,
}

/// `suanli bench federation`.
pub fn run(a: FederationArgs) -> Result<()> {
    if cfg!(debug_assertions) {
        eprintln!("note: debug build; use `cargo run --release` for reported figures");
    }
    println!("== dispatch decisions per second (one core)");
    dispatch_rate(&a)?;
    println!("== a region's submit throughput without and with [federation]");
    submit_cost(&a)?;
    if a.no_region_loss {
        println!("== region loss: not measured (--no-region-loss)");
    } else {
        println!("== region loss: time until the lost region's job runs elsewhere");
        region_loss(&a)?;
    }
    Ok(())
}

fn dispatch_rate(a: &FederationArgs) -> Result<()> {
    use suanli_federation::dispatch::{dispatch, synthetic_view};
    let sizes: &[(usize, usize)] =
        if a.quick { &[(3, 100), (10, 1_000)] } else { &[(3, 1_000), (10, 10_000), (50, 10_000), (100, 50_000)] };
    for &(regions, jobs) in sizes {
        let view = synthetic_view(regions, jobs, a.seed);
        // Enough passes for a stable figure: at least 3, at least 1 s in all.
        let t = Instant::now();
        let mut passes = 0u64;
        let mut decisions = 0usize;
        while passes < 3 || t.elapsed() < Duration::from_secs(if a.quick { 0 } else { 1 }) {
            decisions += dispatch(&view, a.seed.wrapping_add(passes)).len();
            passes += 1;
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{regions:>4} regions {jobs:>7} pending: {:>10.0} decisions/s ({:.2} ms per pass of {} decisions, {passes} passes)",
            decisions as f64 / s,
            s * 1000.0 / passes as f64,
            decisions / passes.max(1) as usize
        );
    }
    Ok(())
}

/// A one-voter federation for the submit-cost run: `suanli federation serve` on ports probed
/// free on loopback, TLS with the local PKI, killed on drop.
struct OneVoter {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for OneVoter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("probing a free loopback port")?;
    Ok(l.local_addr()?.port())
}

fn one_voter() -> Result<OneVoter> {
    let exe = std::env::current_exe().context("locating the suanli binary")?;
    let dir = tempfile::Builder::new().prefix("suanli-bench-fed-").tempdir()?;
    let (client, peer) = (format!("127.0.0.1:{}", free_port()?), format!("127.0.0.1:{}", free_port()?));
    let pki = suanli_server::local::LocalPki::get();
    let log = std::fs::File::create(dir.path().join("federation.log"))?;
    let mut child = Command::new(exe)
        .args(["federation", "serve", "--id", "1", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--listen", &client, "--peer-listen", &peer, "--peers", &format!("1={client}/{peer}"), "--bootstrap"])
        .arg("--tls-dir")
        .arg(pki.dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .context("starting suanli federation serve")?;
    let stdout = child.stdout.take().context("the federation's stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("suanli federation listening")
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(());
            }
        }
    });
    let mut v = OneVoter { child, addr: client, _dir: dir };
    if rx.recv_timeout(Duration::from_secs(60)).is_err() {
        let log = std::fs::read_to_string(v._dir.path().join("federation.log")).unwrap_or_default();
        let _ = v.child.kill();
        bail!("the federation did not listen within 60 s: {log}");
    }
    Ok(v)
}

fn submit_cost(a: &FederationArgs) -> Result<()> {
    let args = crate::bench_cluster::SubmitArgs {
        servers: 3,
        sync_jobs: if a.quick { 100 } else { 1_000 },
        jobs: if a.quick { 1_000 } else { 10_000 },
        clients: if a.quick { 32 } else { 128 },
        connections: 8,
        nodes: if a.quick { 20 } else { 200 },
        batch_size: 0,
        batch_clients: 1,
        spread: false,
        compare_insecure: false,
        compare_tracing: false,
        rounds: if a.quick { 1 } else { 3 },
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("async runtime")?;
    rt.block_on(async move {
        let voter = one_voter()?;
        println!("federation: region `bench` syncs to a one-voter federation at {}", voter.addr);
        let without = Side { name: "without [federation]", wire: Wire::Tls, extra_toml: String::new() };
        let with = Side {
            name: "with [federation]",
            wire: Wire::Tls,
            extra_toml: format!(
                "\n[federation]\nregion = \"bench\"\nendpoints = [\"{}\"]\nrequest_timeout_ms = 2000\n",
                voter.addr
            ),
        };
        let r = compare(&args, args.rounds, &with, &without).await;
        drop(voter);
        r
    })
}

fn chaos_bin(a: &FederationArgs) -> Result<PathBuf> {
    if let Some(b) = &a.chaos_bin {
        return Ok(b.clone());
    }
    if let Some(b) = std::env::var_os("SUANLI_CHAOS_BIN") {
        return Ok(PathBuf::from(b));
    }
    let exe = std::env::current_exe().context("locating the suanli binary")?;
    let b = exe.with_file_name("suanli-chaos");
    if !b.exists() {
        bail!(
            "--chaos-bin: {} is missing; the region-loss trials run the chaos harness: build it (cargo build -p suanli-chaos, same profile) or pass --no-region-loss",
            b.display()
        );
    }
    Ok(b)
}

fn region_loss(a: &FederationArgs) -> Result<()> {
    let bin = chaos_bin(a)?;
    let trials = if a.quick { 2 } else { a.trials };
    let exe = std::env::current_exe().context("locating the suanli binary")?;
    let out = Command::new(&bin)
        .args(["bench-region-loss", "--trials", &trials.to_string(), "--seed", &a.seed.to_string(), "--bin"])
        .arg(&exe)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    for l in text.lines().filter(|l| l.starts_with("trial")) {
        println!("{l}");
    }
    if !out.status.success() {
        bail!("{} bench-region-loss failed ({}):\n{text}", bin.display(), out.status);
    }
    let line = text
        .lines()
        .find(|l| l.starts_with("region-loss "))
        .with_context(|| format!("{} printed no `region-loss ...` line:\n{text}", bin.display()))?;
    let field = |k: &str| -> Result<u64> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("`{k}` missing in {line:?}"))
    };
    let (p50, p99, max, floor) = (field("p50_ms")?, field("p99_ms")?, field("max_ms")?, field("lease_plus_margin_ms")?);
    let floor_f = floor.max(1) as f64;
    println!(
        "{} trials: region loss to running elsewhere p50 {:.2} s ({:.2}x lease + margin), p99 {:.2} s ({:.2}x), max {:.2} s; lease + margin = {:.1} s",
        field("trials")?,
        p50 as f64 / 1000.0,
        p50 as f64 / floor_f,
        p99 as f64 / 1000.0,
        p99 as f64 / floor_f,
        max as f64 / 1000.0,
        floor as f64 / 1000.0
    );
    Ok(())
}
