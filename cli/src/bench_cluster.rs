//! `suanli bench submit` and `suanli bench failover`: real `suanli server` processes on
//! loopback (this same binary), RocksDB with fsync before every acknowledgement, over mutual
//! TLS (the local PKI's admin certificate; `--compare-insecure` measures the same load on a
//! plaintext `--insecure` cluster in the same run).

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use suanli_client::backoff::Backoff;
use suanli_client::{CallChannel as Channel, Connection, ConnectionConfig, pb};
use suanli_server::local::{LocalPki, ProcessCluster};

/// Flags of `suanli bench submit`.
#[derive(Args, Debug)]
pub struct SubmitArgs {
    /// Servers in the loopback cluster.
    #[arg(long, default_value_t = 3)]
    pub servers: usize,
    /// Submissions by the single synchronous client.
    #[arg(long, default_value_t = 1_000)]
    pub sync_jobs: usize,
    /// Submissions by the concurrent clients.
    #[arg(long, default_value_t = 20_000)]
    pub jobs: usize,
    /// Concurrent clients (requests in flight).
    #[arg(long, default_value_t = 256)]
    pub clients: usize,
    /// gRPC connections the concurrent clients share.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Nodes registered for the scheduling loop to place on (64 cores each).
    #[arg(long, default_value_t = 500)]
    pub nodes: usize,
    /// Jobs per `SubmitMany` call in the batched phase (0 skips that phase).
    #[arg(long, default_value_t = 100)]
    pub batch_size: usize,
    /// Concurrent clients in the batched phase. 64 × 100 jobs keep enough in flight to fill
    /// the server's group commits (2 batches of 1,024 in raft, the next one queued): with 32,
    /// the latency of a call bounds the rate and part of the CPU idles.
    #[arg(long, default_value_t = 64)]
    pub batch_clients: usize,
    /// Spread the concurrent and batched clients' connections over every server (followers
    /// group their clients' submissions and forward each group to the leader as one proposal)
    /// instead of connecting them all to the leader.
    #[arg(long)]
    pub spread: bool,
    /// Run the same load twice in this command, on a TLS cluster and on an `--insecure`
    /// (plaintext) one, and print both with the ratio TLS / insecure (throughput, p50, p99).
    #[arg(long)]
    pub compare_insecure: bool,
    /// Run the same load twice in this command over TLS, with tracing off and with the
    /// servers exporting spans to an in-process OTLP receiver (docs/tracing.md), and print
    /// the ratio traced / off (throughput, p50, p99).
    #[arg(long, conflicts_with = "compare_insecure")]
    pub compare_tracing: bool,
    /// With `--compare-insecure` or `--compare-tracing`: how many pairs of runs, the order
    /// alternating (A then B, B then A, ...) so that drift of the machine (page cache, disk,
    /// other load) falls on both sides. The summary gives the pooled ratios and the median of
    /// the rounds' ratios.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

/// Flags of `suanli bench failover`.
#[derive(Args, Debug)]
pub struct FailoverArgs {
    /// Leader kills.
    #[arg(long, default_value_t = 20)]
    pub kills: usize,
    /// Servers in the loopback cluster.
    #[arg(long, default_value_t = 3)]
    pub servers: usize,
}

fn rt() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("async runtime")
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn job(i: usize) -> String {
    format!(
        r#"{{"name":"bench-{i}","queue":"bench","groups":[{{"name":"main","replicas":1,"resources":{{"cpu_milli":100,"memory_mib":64}}}}]}}"#
    )
}

/// How the benchmark's cluster runs: mutual TLS with the local PKI, or plaintext.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    Tls,
    Insecure,
}

impl Wire {
    fn name(self) -> &'static str {
        match self {
            Wire::Tls => "TLS",
            Wire::Insecure => "insecure",
        }
    }

    /// The client side: the local PKI's admin, or plaintext.
    fn config(self, cfg: ConnectionConfig) -> ConnectionConfig {
        match self {
            Wire::Tls => ConnectionConfig { tls: Some(LocalPki::get().admin_tls()), ..cfg },
            Wire::Insecure => ConnectionConfig { tls: None, ..cfg },
        }
    }
}

async fn start(servers: usize, extra: &[&str], wire: Wire, extra_toml: &str) -> Result<(ProcessCluster, usize)> {
    let exe = std::env::current_exe().context("locating the suanli binary")?;
    // The benchmark is one caller sending as fast as it can: no per-caller rate limit.
    let cfg = std::env::temp_dir().join(format!("suanli-bench-{}.toml", std::process::id()));
    std::fs::write(&cfg, format!("rate_limit_per_s = 0\n{extra_toml}"))
        .with_context(|| format!("writing {}", cfg.display()))?;
    let cfg = cfg.display().to_string();
    let mut flags = extra.to_vec();
    flags.extend(["--config", cfg.as_str()]);
    if wire == Wire::Insecure {
        flags.push("--insecure");
    }
    let c = ProcessCluster::start(&exe, servers, &flags).context("starting servers")?;
    let leader = c.wait_leader(Duration::from_secs(60)).await.map_err(|e| anyhow!(e))?;
    Ok((c, leader))
}

/// A connection to one server (the benchmark chooses where each client's calls go).
fn connect(addr: &str, wire: Wire) -> Result<Arc<Connection>> {
    Ok(Arc::new(Connection::new(&[addr.to_owned()], wire.config(ConnectionConfig::default()))?))
}

async fn create_queue(conn: &Connection) -> Result<()> {
    let q = suanli_model::Queue::new("bench", suanli_model::ResVec::MAX);
    conn.upsert_queue(&serde_json::to_string(&q)?).await?;
    Ok(())
}

async fn submit_one(conn: &Connection, rid: String, i: usize) -> Result<Duration> {
    let t = Instant::now();
    let req = pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: rid,
        spec_json: job(i),
        retry: None,
    };
    conn.submit_job(req, |_, _| {}).await?;
    Ok(t.elapsed())
}

/// One submission on a channel of its own (the load phases: what is measured is the servers,
/// not the client library's choice of server for each call).
async fn submit_on(c: &mut pb::jobs_client::JobsClient<Channel>, rid: String, i: usize) -> Result<Duration> {
    let t = Instant::now();
    c.submit(pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: rid,
        spec_json: job(i),
        retry: None,
    })
    .await?;
    Ok(t.elapsed())
}

async fn placed(conn: &Connection) -> u64 {
    match conn.list_pools(true).await {
        Ok(pools) => pools.iter().filter_map(|p| p.used.as_ref()).map(|u| u.cpu_milli / 100).sum(),
        Err(_) => 0,
    }
}

/// One phase's figures: acknowledgements per second and call latencies.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Figure {
    pub(crate) rate: f64,
    pub(crate) p50: Duration,
    pub(crate) p99: Duration,
    /// Acknowledgements.
    pub(crate) n: usize,
    /// How long the phase took.
    pub(crate) took: Duration,
    /// CPU time (user + system) the servers used during the phase, where the platform says
    /// (Linux: /proc/PID/stat).
    pub(crate) cpu: Option<Duration>,
}

fn report(what: &str, n: usize, took: Duration, lat: &mut [Duration], cpu: Option<Duration>) -> Figure {
    lat.sort();
    let f = Figure { rate: n as f64 / took.as_secs_f64(), p50: pct(lat, 0.5), p99: pct(lat, 0.99), n, took, cpu };
    let cpu = match cpu {
        Some(c) => format!("   servers' CPU {:>6.3} ms/ack", ms(c) / n.max(1) as f64),
        None => String::new(),
    };
    println!(
        "{what:<34} {n:>7} acks in {:>6.2} s = {:>8.0}/s   latency p50 {:>6.2} ms  p99 {:>6.2} ms{cpu}",
        took.as_secs_f64(),
        f.rate,
        ms(f.p50),
        ms(f.p99)
    );
    f
}

/// The CPU time (user + system, all threads) the cluster's live server processes have used
/// so far: the sum of `utime` and `stime` of /proc/PID/stat. `None` off Linux or when a
/// process cannot be read (the phase then reports no CPU figure).
pub(crate) fn servers_cpu(c: &ProcessCluster) -> Option<Duration> {
    // USER_HZ: 100 on every Linux architecture suanli builds for (the kernel's ABI constant
    // for /proc, independent of the kernel's own HZ).
    const USER_HZ: u64 = 100;
    let mut ticks = 0u64;
    for i in c.alive() {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", c.pid(i)?)).ok()?;
        // Fields after the command name (which may hold spaces, inside parentheses): state is
        // field 3, utime 14 and stime 15.
        let rest = &stat[stat.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        ticks += f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    }
    Some(Duration::from_millis(ticks * 1000 / USER_HZ))
}

fn cpu_since(c: &ProcessCluster, before: Option<Duration>) -> Option<Duration> {
    Some(servers_cpu(c)?.saturating_sub(before?))
}

/// One side of a comparison (`--compare-insecure`, `--compare-tracing`, `bench federation`):
/// what it is called, its wire, and what is appended to its servers' config file.
pub(crate) struct Side {
    pub(crate) name: &'static str,
    pub(crate) wire: Wire,
    pub(crate) extra_toml: String,
}

/// Runs `rounds` pairs of `submit_run`, `variant` and `base` in alternating order, and prints
/// each round and the summary: per phase, the pooled throughput of each side (all its
/// acknowledgements over all its phase time) and their ratio, the median of the rounds'
/// throughput, p50 and p99 ratios, and the servers' CPU time per acknowledgement.
pub(crate) async fn compare(a: &SubmitArgs, rounds: usize, variant: &Side, base: &Side) -> Result<()> {
    let rounds = rounds.max(1);
    let (mut v_runs, mut b_runs) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let order: [(&Side, bool); 2] =
            if r % 2 == 0 { [(base, false), (variant, true)] } else { [(variant, true), (base, false)] };
        for (side, is_variant) in order {
            println!("== round {}/{rounds}: {}", r + 1, side.name);
            let run = submit_run(a, side.wire, &side.extra_toml).await?;
            if is_variant { v_runs.push(run) } else { b_runs.push(run) }
        }
    }
    println!("== {} / {}, {rounds} rounds in this command (order alternating)", variant.name, base.name);
    let phases: Vec<&'static str> = b_runs[0].phases.iter().map(|(w, _)| *w).collect();
    for (k, what) in phases.iter().enumerate() {
        let v: Vec<Figure> = v_runs.iter().filter_map(|r| r.phases.get(k).map(|p| p.1)).collect();
        let b: Vec<Figure> = b_runs.iter().filter_map(|r| r.phases.get(k).map(|p| p.1)).collect();
        let pooled = |f: &[Figure]| {
            f.iter().map(|x| x.n).sum::<usize>() as f64 / f.iter().map(|x| x.took.as_secs_f64()).sum::<f64>().max(1e-9)
        };
        let cpu_per_ack = |f: &[Figure]| -> Option<f64> {
            let cpu: Option<Vec<Duration>> = f.iter().map(|x| x.cpu).collect();
            Some(ms(cpu?.iter().sum()) / f.iter().map(|x| x.n).sum::<usize>().max(1) as f64)
        };
        let ratios =
            |g: &dyn Fn(&Figure) -> f64| -> Vec<f64> { v.iter().zip(&b).map(|(x, y)| g(x) / g(y).max(1e-9)).collect() };
        let thr = ratios(&|f| f.rate);
        let (pv, pb) = (pooled(&v), pooled(&b));
        println!(
            "{what:<12} throughput {pv:>8.0}/s vs {pb:>8.0}/s = {:.2}x pooled, rounds {} (median {:.2}x)   p50 {:.2}x  p99 {:.2}x (medians)",
            pv / pb.max(1e-9),
            thr.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(" "),
            median(thr.clone()),
            median(ratios(&|f| ms(f.p50))),
            median(ratios(&|f| ms(f.p99))),
        );
        if let (Some(cv), Some(cb)) = (cpu_per_ack(&v), cpu_per_ack(&b)) {
            println!("{:<12} servers' CPU {cv:.3} vs {cb:.3} ms per ack = {:.2}x", "", cv / cb.max(1e-9));
        }
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
}

/// The figures of one run of `bench submit`, by phase.
#[derive(Debug, Clone, Default)]
pub(crate) struct Run {
    pub(crate) phases: Vec<(&'static str, Figure)>,
}

/// `suanli bench submit`.
pub fn submit(a: SubmitArgs) -> Result<()> {
    if a.clients == 0 || a.connections == 0 || a.servers == 0 {
        bail!("--clients, --connections and --servers must be at least 1");
    }
    rt()?.block_on(async move {
        if a.compare_tracing {
            // The receiver counts what arrives: every span exported reached it.
            let (sink, endpoint) = crate::otlp_sink::Sink::start().await?;
            println!("tracing: servers export every span to an in-process OTLP receiver at {endpoint}");
            let off = Side { name: "tracing off", wire: Wire::Tls, extra_toml: String::new() };
            let on = Side {
                name: "traced",
                wire: Wire::Tls,
                extra_toml: format!("[telemetry]\notlp_endpoint = {endpoint:?}\n"),
            };
            compare(&a, a.rounds, &on, &off).await?;
            println!("spans received: {} (aim: throughput >= 0.95x)", sink.spans());
            return Ok(());
        }
        if a.compare_insecure {
            let tls = Side { name: "TLS", wire: Wire::Tls, extra_toml: String::new() };
            let plain = Side { name: "insecure", wire: Wire::Insecure, extra_toml: String::new() };
            return compare(&a, a.rounds, &tls, &plain).await;
        }
        println!("== over mutual TLS (the local PKI's admin certificate)");
        submit_run(&a, Wire::Tls, "").await?;
        Ok(())
    })
}

/// One run of `bench submit` on a new cluster over `wire`, `extra_toml` appended to the
/// servers' config file (`bench federation`: a `[federation]` table).
pub(crate) async fn submit_run(a: &SubmitArgs, wire: Wire, extra_toml: &str) -> Result<Run> {
    let mut run = Run::default();
    {
        let (c, leader) = start(a.servers, &["--heartbeat-ttl-ms", "3600000"], wire, extra_toml).await?;
        let addr = c.addrs[leader].clone();
        println!("{} servers on loopback ({}), RocksDB fsync before every ack; leader {addr}", a.servers, wire.name());
        let ch = connect(&addr, wire)?;
        create_queue(&ch).await?;
        for n in 0..a.nodes {
            let id = format!("bench-node-{n}");
            let node = serde_json::json!({"id": id, "pool": "bench",
                "cpu_milli": 64_000u64, "memory_mib": 512_000u64});
            let req = pb::RegisterNodeRequest {
                node_json: node.to_string(),
                agent_version: "bench".into(),
                ..Default::default()
            };
            match wire {
                Wire::Insecure => ch.register_node(&req).await?,
                // Registering is a node's own call: with that node's certificate.
                Wire::Tls => {
                    let tls = suanli_security::tls::Tls::load(LocalPki::get().node(&id))?;
                    let cfg = ConnectionConfig { tls: Some(tls), ..ConnectionConfig::default() };
                    Connection::new(std::slice::from_ref(&addr), cfg)?.register_node(&req).await?
                }
            };
        }

        // Baseline: one synchronous client, one request in flight.
        let mut lat = Vec::with_capacity(a.sync_jobs);
        let cpu = servers_cpu(&c);
        let t = Instant::now();
        for i in 0..a.sync_jobs {
            lat.push(submit_one(&ch, format!("sync-{i}"), i).await?);
        }
        let sync_took = t.elapsed();
        run.phases.push((
            "synchronous",
            report("1 synchronous client", a.sync_jobs, sync_took, &mut lat, cpu_since(&c, cpu)),
        ));
        let sync_rate = a.sync_jobs as f64 / sync_took.as_secs_f64();

        // Many concurrent clients over a few connections.
        let mut chans = Vec::new();
        for k in 0..a.connections {
            let to = if a.spread { &c.addrs[(leader + k) % c.addrs.len()] } else { &addr };
            chans.push(ch.direct(to)?);
        }
        if a.spread {
            println!("clients spread over all {} servers ({} connections)", c.addrs.len(), a.connections);
        }
        let next = Arc::new(AtomicUsize::new(0));
        let placed_before = placed(&ch).await;
        let cpu = servers_cpu(&c);
        let t = Instant::now();
        let mut tasks = Vec::new();
        for k in 0..a.clients {
            let mut jc = pb::jobs_client::JobsClient::new(chans[k % chans.len()].clone());
            let next = next.clone();
            let (total, sync_jobs) = (a.jobs, a.sync_jobs);
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok::<_, anyhow::Error>(lat);
                    }
                    lat.push(submit_on(&mut jc, format!("conc-{i}"), sync_jobs + i).await?);
                }
            }));
        }
        let mut lat = Vec::with_capacity(a.jobs);
        for t in tasks {
            lat.extend(t.await??);
        }
        let took = t.elapsed();
        let placed_during = placed(&ch).await.saturating_sub(placed_before);
        run.phases.push((
            "concurrent",
            report(&format!("{} concurrent clients", a.clients), a.jobs, took, &mut lat, cpu_since(&c, cpu)),
        ));
        let rate = a.jobs as f64 / took.as_secs_f64();
        println!("ratio concurrent/synchronous: {:.1}x", rate / sync_rate);
        println!(
            "scheduling loop: {placed_during} placements committed during the concurrent run = {:.0}/s",
            placed_during as f64 / took.as_secs_f64()
        );
        // Batched clients: `SubmitMany` calls of --batch-size jobs, each job acknowledged alone.
        let mut batched = 0;
        if a.batch_size > 0 {
            batched = a.jobs;
            let (fig, placed_b) = submit_batched(a, &chans, &ch, &c).await?;
            run.phases.push(("batched", fig));
            println!("ratio batched/synchronous: {:.1}x", fig.rate / sync_rate);
            println!("scheduling loop: {placed_b} placements committed during the batched run");
        }
        let t2 = Instant::now();
        let total = (a.sync_jobs + a.jobs + batched) as u64;
        let cap = (a.nodes as u64) * 640;
        let want = total.min(cap);
        while placed(&ch).await < want && t2.elapsed() < Duration::from_secs(120) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "all {} placed {:.2} s after the last acknowledgement ({} placed in total)",
            want,
            t2.elapsed().as_secs_f64(),
            placed(&ch).await
        );
    }
    // The cluster was dropped (its servers killed) before the next run starts.
    Ok(run)
}

/// The batched phase of `bench submit`: its figures and the placements made meanwhile.
async fn submit_batched(
    a: &SubmitArgs,
    chans: &[Channel],
    ch: &Connection,
    c: &ProcessCluster,
) -> Result<(Figure, u64)> {
    let next = Arc::new(AtomicUsize::new(0));
    let placed_before = placed(ch).await;
    let cpu = servers_cpu(c);
    let t = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..a.batch_clients.max(1) {
        let mut jc = pb::jobs_client::JobsClient::new(chans[k % chans.len()].clone());
        let (next, total, size, base) = (next.clone(), a.jobs, a.batch_size, a.sync_jobs + a.jobs);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let from = next.fetch_add(size, Ordering::Relaxed);
                if from >= total {
                    return Ok::<_, anyhow::Error>(lat);
                }
                let jobs: Vec<pb::SubmitJobRequest> = (from..(from + size).min(total))
                    .map(|i| pb::SubmitJobRequest {
                        global: false,
                        team: String::new(),
                        client_request_id: format!("batch-{i}"),
                        spec_json: job(base + i),
                        retry: None,
                    })
                    .collect();
                let t = Instant::now();
                let results = jc.submit_many(pb::SubmitJobsRequest { jobs }).await?.into_inner().results;
                if let Some(bad) = results.iter().find(|x| x.code != 0) {
                    bail!("a batched submission was refused: {}", bad.message);
                }
                lat.push(t.elapsed());
            }
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    let took = t.elapsed();
    let placed_during = placed(ch).await.saturating_sub(placed_before);
    let fig = report(
        &format!("{} clients x {} jobs per call", a.batch_clients.max(1), a.batch_size),
        a.jobs,
        took,
        &mut lat,
        cpu_since(c, cpu),
    );
    Ok((fig, placed_during))
}

/// How `bench failover` retries its write after a kill: every 5 ms (the measurement's
/// resolution), bounded by 30 s of waiting.
const FAILOVER_RETRY: Backoff =
    Backoff::new(Duration::from_millis(5), Duration::from_millis(5)).with_max_retries(6_000);

/// `suanli bench failover`.
pub fn failover(a: FailoverArgs) -> Result<()> {
    if a.servers < 3 {
        bail!("--servers must be at least 3 (a leader kill must leave a majority)");
    }
    rt()?.block_on(async move {
        let (mut c, leader) = start(a.servers, &[], Wire::Tls, "").await?;
        create_queue(&*connect(&c.addrs[leader], Wire::Tls)?).await?;
        let mut times = Vec::new();
        let mut seq = 0usize;
        for k in 0..a.kills {
            let leader = c.wait_leader(Duration::from_secs(30)).await.map_err(|e| anyhow!(e))?;
            // A write succeeds before the kill (the cluster is healthy).
            submit_one(&*connect(&c.addrs[leader], Wire::Tls)?, format!("warm-{k}"), seq).await?;
            seq += 1;
            let t = Instant::now();
            c.kill(leader);
            // One submission (same request id) through the client library over the survivors
            // (each call goes round them, following leader hints), every 5 ms until it is
            // acknowledged, for at most 30 s.
            let conn = Connection::new(
                &c.alive_addrs(),
                Wire::Tls.config(ConnectionConfig {
                    request_timeout: Some(Duration::from_millis(500)),
                    ..ConnectionConfig::default()
                }),
            )?;
            let req = pb::SubmitJobRequest { global: false, team: String::new(), client_request_id: format!("failover-{k}"), spec_json: job(seq), retry: None };
            FAILOVER_RETRY
                .retry(
                    || conn.call(|ch| {
                        let req = req.clone();
                        async move { pb::jobs_client::JobsClient::new(ch).submit(req).await }
                    }),
                    |_| t.elapsed() < Duration::from_secs(30),
                    |_, _| {},
                )
                .await
                .map_err(|e| anyhow!("no write succeeded within 30 s of killing the leader: {e}"))?;
            let took = t.elapsed();
            seq += 1;
            println!("kill {:>2}: leader {} SIGKILLed; writes succeed again after {:>7.1} ms", k + 1, leader + 1, ms(took));
            times.push(took);
            c.spawn(leader)?;
            c.wait_caught_up(leader, Duration::from_secs(60)).await.map_err(|e| anyhow!(e))?;
        }
        times.sort();
        let raft = suanli_raft::RaftSettings::default();
        println!(
            "failover over {} leader kills: p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms (election timeout {}-{} ms, heartbeat {} ms)",
            times.len(),
            ms(pct(&times, 0.5)),
            ms(pct(&times, 0.99)),
            ms(times.last().copied().unwrap_or_default()),
            raft.election_timeout_min_ms,
            raft.election_timeout_max_ms,
            raft.heartbeat_interval_ms,
        );
        Ok(())
    })
}
