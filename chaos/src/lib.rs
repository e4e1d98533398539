//! suanli's chaos harness: a real cluster on loopback (`suanli server` and `suanli agent`
//! processes with the fake device plugin, a fault-injecting proxy on every link), a workload, a
//! nemesis whose schedule is a function of the seed, a history, and invariant checks at the end.
//!
//! One run of a scenario ([`run_scenario`]):
//!
//! 1. start the cluster ([`cluster::Cluster::start`]);
//! 2. **fault phase**: the clients ([`workload`]) submit, cancel, read and change quotas while
//!    the nemesis ([`nemesis`]) runs the scenario's schedule;
//! 3. **heal**: every link restored, every paused process continued, every dead process
//!    restarted, every failpoint and plugin fault cleared; the clients keep going for a moment
//!    (writes must succeed again), then stop;
//! 4. **recovery**: wait (bounded) until every job is running or finished;
//! 5. **checks** ([`checker`]): acknowledged writes, over-commit and double runs from the
//!    agents' journals, recovery, state-hash convergence, log agreement, the isolated leader;
//!    in scenarios with the hostile client ([`hostile`]), that the cluster stays writable; that
//!    cluster time and retry backoffs stayed bounded by real time.
//!
//! Scenarios are listed in [`scenario::SCENARIOS`] and documented in chaos/README.md.

pub mod checker;
pub mod cluster;
pub mod federation;
pub mod history;
pub mod hostile;
pub mod nemesis;
pub mod proxy;
pub mod scenario;
pub mod trainers;
pub mod workload;

use anyhow::Context as _;
use checker::Verdict;
use cluster::{Cluster, Shape};
use history::History;
use scenario::Scenario;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;

/// A deliberately broken server, to show that the checker catches what it claims to catch.
/// Each arms a test-only failpoint compiled in by the `failpoints` feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
pub enum Broken {
    /// Acknowledge log writes without the write-ahead log or an fsync (`raft::skip-fsync`):
    /// a power loss then loses acknowledged writes.
    SkipFsync,
    /// Hand one device share to two tasks: the scheduler's view forgets the devices of one
    /// running allocation (`state::double-assign`).
    DoubleAssign,
    /// Let `Internal.Propose` commit what it must refuse (`server::forward-unchecked`): the
    /// hostile client's poison proposals reach the log and halt the group.
    ForwardUnchecked,
}

impl Broken {
    /// The `SUANLI_FAILPOINTS` value every server starts with.
    pub fn failpoints(self) -> &'static str {
        match self {
            Broken::SkipFsync => "raft::skip-fsync=return",
            Broken::DoubleAssign => "state::double-assign=return",
            Broken::ForwardUnchecked => "server::forward-unchecked=return",
        }
    }
}

/// How a run is made.
#[derive(Debug, Clone)]
pub struct Options {
    /// Length of the fault phase (ms).
    pub duration_ms: u64,
    /// The `suanli` binary.
    pub bin: PathBuf,
    /// Keep the run's directory (data, logs, history.json) afterwards.
    pub keep: bool,
    /// Run a deliberately broken server.
    pub broken: Option<Broken>,
    /// Bound on recovery after the heal (ms): invariant 4.
    pub settle_bound_ms: u64,
    /// Agents (each with `gpus_per_agent` fake GPUs).
    pub agents: usize,
    /// Fake GPUs per agent.
    pub gpus_per_agent: u32,
    /// Workload clients.
    pub clients: usize,
}

impl Options {
    /// Defaults for `bin`: a 20 s fault phase, 60 s recovery bound, 3 agents of 4 GPUs,
    /// 4 clients.
    pub fn new(bin: PathBuf) -> Self {
        Options {
            duration_ms: 20_000,
            bin,
            keep: false,
            broken: None,
            settle_bound_ms: 60_000,
            agents: 3,
            gpus_per_agent: 4,
            clients: 4,
        }
    }
}

/// The outcome of one run: the table row and every verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Seed.
    pub seed: u64,
    /// Broken build, if any.
    pub broken: Option<Broken>,
    /// Faults injected (nemesis steps that ran).
    pub faults: usize,
    /// Client operations.
    pub ops: usize,
    /// Acknowledged writes (submissions, cancels, quota changes).
    pub acked: usize,
    /// Acknowledged submissions missing from the final state.
    pub lost: usize,
    /// Device over-commit episodes seen in the journals.
    pub over_commits: usize,
    /// Tasks that ran twice at the same time.
    pub double_runs: usize,
    /// Time from the heal until every job was running or finished (ms); None past the bound.
    pub recovery_ms: Option<u64>,
    /// Time from the heal until a write succeeded again (ms).
    pub writable_ms: Option<u64>,
    /// Task runs in the agents' journals.
    pub task_runs: usize,
    /// Windows during which the leader was isolated from the other servers.
    pub isolations: usize,
    /// Write operations invoked during an isolation that asked the isolated leader.
    pub isolated_writes: usize,
    /// Every invariant's verdict.
    pub verdicts: Vec<Verdict>,
    /// The run's directory, when kept.
    pub dir: Option<PathBuf>,
}

impl Report {
    /// Every invariant held.
    pub fn ok(&self) -> bool {
        self.verdicts.iter().all(|v| v.ok)
    }

    /// The command that replays this run's fault schedule.
    pub fn reproduce(&self) -> String {
        let mut s = format!("suanli-chaos --scenario {} --seed {}", self.scenario, self.seed);
        if let Some(b) = self.broken {
            s += &format!(
                " --break {}",
                clap::ValueEnum::to_possible_value(&b).map_or_else(String::new, |v| v.get_name().to_owned())
            );
        }
        s
    }
}

/// The header of [`Report::row`].
pub fn table_header() -> String {
    format!(
        "{:<20} {:>10} {:>6} {:>6} {:>6} {:>5} {:>5} {:>5} {:>6} {:>9} {:>9}  {}",
        "scenario", "seed", "faults", "ops", "acked", "lost", "over", "dbl", "runs", "writable", "recovery", "verdict"
    )
}

impl Report {
    /// One row of the suite's table.
    pub fn row(&self) -> String {
        let secs = |v: Option<u64>| v.map_or_else(|| "> bound".to_owned(), |ms| format!("{:.1} s", ms as f64 / 1000.0));
        let failed: Vec<&str> = self.verdicts.iter().filter(|v| !v.ok).map(|v| v.name).collect();
        format!(
            "{:<20} {:>10} {:>6} {:>6} {:>6} {:>5} {:>5} {:>5} {:>6} {:>9} {:>9}  {}",
            self.scenario,
            self.seed,
            self.faults,
            self.ops,
            self.acked,
            self.lost,
            self.over_commits,
            self.double_runs,
            self.task_runs,
            secs(self.writable_ms),
            secs(self.recovery_ms),
            if failed.is_empty() { "pass".to_owned() } else { format!("FAIL: {}", failed.join(", ")) }
        )
    }

    /// Every verdict with its detail, one per line.
    pub fn details(&self) -> String {
        self.verdicts
            .iter()
            .map(|v| format!("  [{}] {}: {}", if v.ok { "ok" } else { "FAIL" }, v.name, v.detail))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Runs one scenario with one seed and checks every invariant.
pub async fn run_scenario(scn: &Scenario, seed: u64, opts: &Options) -> anyhow::Result<Report> {
    if let Some(which) = scn.federation {
        let o = federation::run(which, seed, opts).await?;
        return Ok(Report {
            scenario: scn.name.to_owned(),
            seed,
            broken: opts.broken,
            faults: o.faults,
            ops: o.ops,
            acked: o.acked,
            lost: o.lost,
            over_commits: 0,
            double_runs: o.overlaps,
            recovery_ms: o.recovery_ms,
            writable_ms: None,
            task_runs: o.task_runs,
            isolations: 0,
            isolated_writes: 0,
            verdicts: o.verdicts,
            dir: o.dir,
        });
    }
    let mut server_env = Vec::new();
    if let Some(b) = opts.broken {
        server_env.push(("SUANLI_FAILPOINTS".to_owned(), b.failpoints().to_owned()));
    }
    let shape = Shape {
        server_env,
        fake_clocks: scn.clocks,
        ..Shape::new(scn.servers, opts.agents, opts.gpus_per_agent, opts.clients)
    };
    let mut cluster = Cluster::start(&opts.bin, shape, seed, opts.keep).await.context("starting the cluster")?;
    tracing::info!(scenario = scn.name, seed, dir = %cluster.dir().display(), "cluster up");
    let history = History::default();
    let stop = Arc::new(AtomicBool::new(false));
    // The clients stop with this run, even when it ends early with an error.
    let _stop_clients = StopOnDrop(stop.clone());
    let trainer_jobs = trainers::start(&mut cluster, scn.trainers).await?;
    let spec = workload::WorkloadSpec::default();
    let clients = workload::start(&cluster, opts.clients, seed, &spec, &history, &stop)?;
    let hostile = scn.hostile.then(|| hostile::start(hostile::Targets::of(&cluster), seed, &stop));

    // Fault phase.
    let steps = nemesis::schedule(scn.kinds, opts.duration_ms, scn.hold_ms, seed);
    let phase_end = Instant::now() + Duration::from_millis(opts.duration_ms);
    let (isolations, faults) = nemesis::run(&mut cluster, &steps, opts.clients, seed, &history).await?;
    tokio::time::sleep_until(phase_end.into()).await;

    // Heal; the clients stop (the operations in flight complete or time out).
    let exited = heal(&mut cluster)?;
    history.fault(format!(
        "heal everything{}",
        if exited.is_empty() { String::new() } else { format!(" (restarted {exited:?})") }
    ));
    if scn.kinds.contains(&nemesis::Kind::DrainNode) {
        trainers::undrain_all(&mut cluster, &history).await;
    }
    let healed = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let bound = Duration::from_millis(opts.settle_bound_ms);
    let writable = probe_write(&mut cluster, healed, bound).await;
    for c in clients {
        let _ = c.await;
    }
    let hostile = match hostile {
        Some(h) => Some(h.await.context("the hostile client")?),
        None => None,
    };

    let mut verdicts = Vec::new();
    let ops = history.ops();
    let acked = ops
        .iter()
        .filter(|o| !matches!(o.kind, history::OpKind::Read { .. }) && matches!(o.outcome, history::Outcome::Ok { .. }))
        .count();

    // (4) recovery, and the final jobs.
    verdicts.push(Verdict {
        name: "writable after heal",
        ok: writable.is_ok(),
        detail: match &writable {
            Ok(ms) => format!("a write through the leader succeeded {:.2} s after the heal", *ms as f64 / 1000.0),
            Err(e) => format!("no write succeeded within {} s of the heal: {e}", bound.as_secs()),
        },
    });
    let (jobs, recovery_ms, unsettled) = recover(&mut cluster, healed, bound).await;
    verdicts.push(Verdict {
        name: "recovery",
        ok: recovery_ms.is_some(),
        detail: match recovery_ms {
            Some(ms) => format!(
                "{} jobs running or finished {:.1} s after the heal (bound {} s)",
                jobs.len(),
                ms as f64 / 1000.0,
                bound.as_secs()
            ),
            None => format!(
                "{} of {} jobs not running or finished {} s after the heal: {}",
                unsettled.len(),
                jobs.len(),
                bound.as_secs(),
                unsettled.join("; ")
            ),
        },
    });

    // (9) bounded time: what every server applied against the harness's real clock.
    let mut times = Vec::new();
    for i in cluster.up_servers() {
        if let Ok(r) = cluster.inspect(i, 0, 0).await {
            times.push((r.id, r.cluster_time_s));
        }
    }
    let now_s = history::now_ms() / 1000;
    let ahead = checker::time_ahead(&times, &jobs, now_s, TIME_BOUND_S, spec.max_backoff_s());
    verdicts.push(Verdict {
        name: "bounded time",
        ok: ahead.is_empty() && !times.is_empty(),
        detail: if times.is_empty() {
            "no server answered Internal.Inspect".to_owned()
        } else if ahead.is_empty() {
            let lead = times.iter().map(|(_, t)| i128::from(*t) - i128::from(now_s)).max().unwrap_or(0);
            format!(
                "cluster time on {} servers at most {lead:+} s from real time (bound {TIME_BOUND_S} s); every retry backoff within the workload's {} s",
                times.len(),
                spec.max_backoff_s()
            )
        } else {
            sample(&ahead)
        },
    });

    // (1) acknowledged writes.
    let (lost, dups) = checker::lost_writes(&ops, &jobs);
    let submits_acked = ops
        .iter()
        .filter(|o| {
            matches!(o.kind, history::OpKind::Submit { .. }) && matches!(o.outcome, history::Outcome::Ok { .. })
        })
        .count();
    verdicts.push(Verdict {
        name: "acknowledged writes",
        ok: lost.is_empty() && dups.is_empty(),
        detail: if lost.is_empty() && dups.is_empty() {
            format!("{submits_acked} acknowledged submissions, all present once in {} jobs", jobs.len())
        } else {
            format!("{} lost, {} duplicated: {}", lost.len(), dups.len(), sample(lost.iter().chain(&dups)))
        },
    });

    // (2), (3) from the agents' journals.
    let mut lines = Vec::new();
    for a in 0..cluster.agents.len() {
        let text = std::fs::read_to_string(cluster.journal_path(a)).unwrap_or_default();
        lines.extend(checker::parse_journal(&text));
    }
    let runs = checker::runs(&lines);
    let over = checker::over_commits(&runs);
    verdicts.push(Verdict {
        name: "no over-commit",
        ok: over.is_empty(),
        detail: if over.is_empty() {
            format!("{} task runs on {} devices, never past a whole device", runs.len(), devices(&runs))
        } else {
            format!("{} episodes: {}", over.len(), sample(&over))
        },
    });
    let double = checker::double_runs(&runs);
    let fenced = runs.iter().filter(|r| r.fenced).count();
    verdicts.push(Verdict {
        name: "no double run",
        ok: double.is_empty(),
        detail: if double.is_empty() {
            format!("{} task runs ({fenced} fenced by their shims), none overlapping another of its task", runs.len())
        } else {
            format!("{} overlaps: {}", double.len(), sample(&double))
        },
    });

    // (10), (11) the trainers' journals: no job runs twice at once, steps never go back
    // beyond the last committed checkpoint.
    if !trainer_jobs.is_empty() {
        verdicts.extend(trainers::verdicts(&trainer_jobs, &jobs));
    }

    // (8) the hostile client's calls broke nothing (before the convergence checks: the probe
    // writes it makes are part of the state they compare).
    if let Some(h) = &hostile {
        verdicts.push(hostile::stays_writable(&mut cluster, h, &exited, Duration::from_secs(20)).await);
    }

    // (5), (6) the servers' own views.
    verdicts.push(converge(&mut cluster).await);
    verdicts.push(log_agreement(&mut cluster).await);

    // (7) the isolated leader.
    let iso = checker::isolated_acks(&ops, &isolations);
    let isolated_writes = checker::isolated_writes(&ops, &isolations);
    verdicts.push(Verdict {
        name: "isolated leader",
        ok: iso.is_empty(),
        detail: if isolations.is_empty() {
            "no leader was isolated in this run".to_owned()
        } else if iso.is_empty() {
            format!(
                "{} isolation(s); {isolated_writes} writes sent to the isolated leader while it was cut off, none acknowledged by it",
                isolations.len()
            )
        } else {
            format!("{} acknowledged while isolated: {}", iso.len(), sample(&iso))
        },
    });

    let dir = opts.keep.then(|| cluster.dir().to_owned());
    if let Some(d) = &dir {
        let dump = serde_json::json!({"ops": ops, "faults": history.faults(), "steps": steps, "tasks": lines,
            "hostile": hostile});
        std::fs::write(d.join("history.json"), serde_json::to_vec_pretty(&dump)?)?;
    }
    cluster.stop_all();
    Ok(Report {
        scenario: scn.name.to_owned(),
        seed,
        broken: opts.broken,
        faults,
        ops: ops.len(),
        acked,
        lost: lost.len(),
        over_commits: over.len(),
        double_runs: double.len(),
        recovery_ms,
        writable_ms: writable.ok(),
        task_runs: runs.len(),
        isolations: isolations.len(),
        isolated_writes,
        verdicts,
        dir,
    })
}

/// How far cluster time may run ahead of real time (invariant 9): the servers'
/// `max_clock_skew_ms` (500 ms), whole seconds in commands, and a clock sample's age.
pub const TIME_BOUND_S: u64 = 3;

/// Sets the flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn sample<'a>(items: impl IntoIterator<Item = &'a String>) -> String {
    let v: Vec<&String> = items.into_iter().collect();
    let mut s = v.iter().take(5).map(|x| x.as_str()).collect::<Vec<_>>().join("; ");
    if v.len() > 5 {
        s += &format!("; … {} more", v.len() - 5);
    }
    s
}

fn devices(runs: &[checker::Run]) -> usize {
    runs.iter()
        .flat_map(|r| r.devices.iter().map(|(d, _)| (r.node.as_str(), d.as_str())))
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

/// Heals every fault: links, pauses, dead processes, failpoints, plugin faults. Returns the
/// servers (ids) that were found dead and restarted.
fn heal(cluster: &mut Cluster) -> anyhow::Result<Vec<u64>> {
    cluster.heal_links();
    let mut restarted = Vec::new();
    for i in 0..cluster.servers.len() {
        std::fs::write(cluster.failpoints_path(i), "")?;
        cluster.pause_server(i, false);
        if !cluster.server_alive(i) {
            cluster.start_server(i)?;
            restarted.push(cluster.servers[i].id);
        }
    }
    for a in 0..cluster.agents.len() {
        cluster.set_plugin_faults(a, "")?;
        cluster.pause_agent(a, false);
        cluster.start_agent(a)?;
    }
    Ok(restarted)
}

/// Time from `healed` until a write (a quota upsert of the `chaos-probe` queue, sent to the
/// leader directly) succeeds, within `bound`.
async fn probe_write(cluster: &mut Cluster, healed: Instant, bound: Duration) -> Result<u64, String> {
    let q = serde_json::json!({"id": "chaos-probe", "nominal": {"cpu_milli": 1000, "memory_mib": 1024}}).to_string();
    let mut last = String::from("no leader");
    while healed.elapsed() < bound {
        if let Some(l) = cluster.leader().await {
            match cluster::channel(&cluster.servers[l].addr, Duration::from_secs(2)).await {
                Ok(ch) => match suanli_proto::v1::queues_client::QueuesClient::new(ch)
                    .upsert(pb::UpsertQueueRequest { queue_json: q.clone() })
                    .await
                {
                    Ok(_) => return Ok(healed.elapsed().as_millis() as u64),
                    Err(e) => last = format!("{:?}: {}", e.code(), e.message()),
                },
                Err(e) => last = e.to_string(),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(last)
}

/// Every job, read linearizably from the leader (directly, not through the proxies).
pub(crate) async fn list_jobs(cluster: &mut Cluster) -> anyhow::Result<Vec<pb::JobInfo>> {
    let l = cluster.wait_leader(Duration::from_secs(10)).await?;
    let ch = cluster::channel(&cluster.servers[l].addr, Duration::from_secs(5)).await?;
    let mut c = JobsClient::new(ch).max_decoding_message_size(64 << 20);
    let mut out = Vec::new();
    let mut after_id = 0;
    loop {
        let r = c
            .list(pb::ListJobsRequest { queue: String::new(), states: Vec::new(), limit: 1000, after_id, stale: false })
            .await?
            .into_inner();
        out.extend(r.jobs);
        if r.next_after_id == 0 {
            return Ok(out);
        }
        after_id = r.next_after_id;
    }
}

/// Waits until every job is running or finished (invariant 4); returns the last listing, the
/// time it took since `healed`, and the jobs still unsettled when the bound passed.
async fn recover(
    cluster: &mut Cluster,
    healed: Instant,
    bound: Duration,
) -> (Vec<pb::JobInfo>, Option<u64>, Vec<String>) {
    let mut last = Vec::new();
    loop {
        match list_jobs(cluster).await {
            Ok(jobs) => {
                let now_s = history::now_ms() / 1000;
                let unsettled: Vec<String> = jobs
                    .iter()
                    .filter(|j| !checker::settled(j, now_s))
                    .map(|j| format!("job {} {} ({})", j.id, j.state, j.reason))
                    .collect();
                last = jobs;
                if unsettled.is_empty() {
                    return (last, Some(healed.elapsed().as_millis() as u64), Vec::new());
                }
                if healed.elapsed() > bound {
                    let shown = unsettled.into_iter().take(5).collect();
                    return (last, None, shown);
                }
            }
            Err(e) => {
                if healed.elapsed() > bound {
                    return (last, None, vec![format!("listing jobs failed: {e}")]);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The servers that are voters now (indices).
async fn voters(cluster: &mut Cluster) -> Vec<usize> {
    let members = cluster.members().await.unwrap_or_default();
    (0..cluster.servers.len()).filter(|i| members.contains(&(cluster.servers[*i].id, true))).collect()
}

/// Invariant 5: every voter's state machine reaches the same hash at the same applied index.
async fn converge(cluster: &mut Cluster) -> Verdict {
    let name = "convergence";
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    let mut unreachable: Option<usize> = None;
    while Instant::now() < deadline {
        let v = voters(cluster).await;
        if v.len() < cluster.servers.len() {
            // A server removed by the nemesis joins again on its own: every one must be a
            // voter again after the heal.
            last = format!("{} of {} servers are voters", v.len(), cluster.servers.len());
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let mut seen = Vec::new();
        for i in &v {
            match cluster.inspect(*i, 0, 0).await {
                Ok(r) => seen.push((r.id, r.applied_index, r.state_hash)),
                Err(e) => {
                    last = format!("server index {i}: {e}");
                    unreachable = Some(*i);
                }
            }
        }
        if !v.is_empty() && seen.len() == v.len() {
            let index = seen[0].1;
            if seen.iter().all(|s| s.1 == index) {
                let hashes: std::collections::BTreeSet<u64> = seen.iter().map(|s| s.2).collect();
                return if hashes.len() == 1 {
                    Verdict {
                        name,
                        ok: true,
                        detail: format!("{} servers at index {index}, state hash {:016x}", seen.len(), seen[0].2),
                    }
                } else {
                    Verdict {
                        name,
                        ok: false,
                        detail: format!(
                            "different state at index {index}: {}",
                            seen.iter()
                                .map(|(id, _, h)| format!("server {id} {h:016x}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    }
                };
            }
            last = format!(
                "applied: {}",
                seen.iter().map(|(id, i, _)| format!("server {id} at {i}")).collect::<Vec<_>>().join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A server that could not be inspected: the end of its log says what it was doing.
    if let Some(i) = unreachable {
        let log = cluster.server_log(i);
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        last.push_str(&format!("\n    last lines of server index {i}'s log:\n      {}", tail.join("\n      ")));
    }
    Verdict { name, ok: false, detail: format!("servers did not reach one applied index within 30 s: {last}") }
}

/// Invariant 6: over the committed range every voter still keeps, the entries agree.
async fn log_agreement(cluster: &mut Cluster) -> Verdict {
    let name = "log agreement";
    let v = voters(cluster).await;
    let mut bounds = Vec::new();
    for i in &v {
        match cluster.inspect(*i, 0, 0).await {
            Ok(r) => bounds.push((*i, r.first_log_index, r.committed_index.min(r.last_log_index))),
            Err(e) => return Verdict { name, ok: false, detail: format!("server index {i}: {e}") },
        }
    }
    let from = bounds.iter().map(|b| b.1).max().unwrap_or(0).max(1);
    let to = bounds.iter().map(|b| b.2).min().unwrap_or(0);
    if bounds.len() < 2 || to < from {
        return Verdict {
            name,
            ok: true,
            detail: format!("no committed range kept by every server ({from}..={to}); nothing to compare"),
        };
    }
    let to = to.min(from + 9_999);
    let mut views = Vec::new();
    for (i, _, _) in &bounds {
        match cluster.inspect(*i, from, to).await {
            Ok(r) => views.push((r.id, r.entries)),
            Err(e) => return Verdict { name, ok: false, detail: format!("server index {i}: {e}") },
        }
    }
    let compared: usize = views.iter().map(|(_, e)| e.len()).min().unwrap_or(0);
    let bad = checker::log_disagreements(&views);
    if bad.is_empty() {
        Verdict {
            name,
            ok: true,
            detail: format!("entries {from}..={to} agree on {} servers ({compared} each)", views.len()),
        }
    } else {
        Verdict { name, ok: false, detail: format!("{} indexes differ: {}", bad.len(), sample(&bad)) }
    }
}
