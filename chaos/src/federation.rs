//! Multi-region chaos (issue 20, docs/federation.md): three regions, each a [`Cluster`] of real
//! `suanli server` processes with `[federation]` and fake-GPU agents, and a 3-voter federation
//! (`suanli federation serve`, one voter "in" each region). Every link that a region loss cuts
//! runs through a fault-injecting [`Proxy`]:
//!
//! ```text
//!   region r's servers ──proxy(r→v)──▶ federation voter v client port   (Federation.Sync, Submit)
//!   voter i            ──proxy(i→j)──▶ voter j peer port                 (raft, FederationPeer)
//!   region r's agents  ──proxy──────▶ region r's servers                 (as in every chaos cluster)
//!   harness            ──direct─────▶ any voter, any server              (observer)
//! ```
//!
//! Voters advertise peer *names* (`fed-N.peer.chaos:7501`) that only their `raft.dial` rewrites
//! resolve, each to the proxy of that directed link, as the region servers do. TLS is on
//! everywhere, with the process's [`crate::cluster::pki`]. The lease terms are short
//! ([`TERMS`]) so a region loss plays out in seconds.
//!
//! Two scenarios run here ([`SCENARIOS`]): `region-partition` (region A cut off from the
//! federation while checkpointing jobs run in it) and `federation-leader-kill` (the federation
//! leader SIGKILLed while global and local jobs are submitted). Their invariants come from the
//! agents' journals (`global_id`, `fed_epoch`, `at_ms`): no two runs of one global job overlap
//! ([`crate::checker::no_overlap`]), the old run stops before its lease ends, the new one starts
//! only after the lease end plus the margin, and from a checkpoint.

use crate::checker::{self, JournalLine, Verdict};
use crate::cluster::{self, Cluster, Shape};
use crate::proxy::{Fault, Proxy};
use crate::trainers;
use anyhow::{Context as _, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::federation_client::FederationClient;

/// The federation's lease terms in chaos runs (docs/federation.md "Leases"), all in ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    /// A lease's length.
    pub lease_ms: u64,
    /// How often a region's leader syncs.
    pub sync_interval_ms: u64,
    /// The stated bound on any two clocks' difference.
    pub max_clock_drift_ms: u64,
    /// How long past a lease's end the federation waits before re-dispatching.
    pub redispatch_margin_ms: u64,
    /// A region silent this long is unhealthy.
    pub region_unhealthy_after_ms: u64,
}

/// Short terms: lease 6 s, sync 1 s, drift 200 ms, margin 1 s, unhealthy after 3 s.
pub const TERMS: Terms = Terms {
    lease_ms: 6_000,
    sync_interval_ms: 1_000,
    max_clock_drift_ms: 200,
    redispatch_margin_ms: 1_000,
    region_unhealthy_after_ms: 3_000,
};

/// The regions' names, in order.
pub const REGIONS: [&str; 3] = ["us-east", "eu-west", "ap-south"];

/// The device model of every fake GPU (chaos/src/cluster.rs's agents).
pub const MODEL: &str = "A100-80G";

/// The team global jobs are submitted for (with a worldwide quota far above the run's use).
pub const TEAM: &str = "chaos";

/// How a multi-region world is built.
#[derive(Debug, Clone)]
pub struct WorldShape {
    /// Servers per region (1 or 3).
    pub servers_per_region: usize,
    /// Agents per region.
    pub agents_per_region: usize,
    /// GPUs per agent.
    pub gpus_per_agent: u32,
    /// The lease terms.
    pub terms: Terms,
}

impl Default for WorldShape {
    fn default() -> Self {
        WorldShape { servers_per_region: 3, agents_per_region: 1, gpus_per_agent: 4, terms: TERMS }
    }
}

/// A federation voter's process slot.
pub struct Voter {
    /// Raft id (index + 1).
    pub id: u64,
    /// Client listener (picked at the first start, reused by restarts).
    pub addr: String,
    /// Peer listener, as bound.
    pub peer_addr: String,
    /// The peer address it advertises (resolved only by the other voters' dial rewrites).
    pub peer_name: String,
    dir: PathBuf,
    child: Option<Child>,
}

/// Three regions and their federation.
pub struct World {
    dir: tempfile::TempDir,
    bin: PathBuf,
    shape: WorldShape,
    /// The regions (index r is `REGIONS[r]`).
    pub regions: Vec<Cluster>,
    /// The federation's voters (voter v is "in" region v).
    pub voters: Vec<Voter>,
    /// Voter i → voter j peer links.
    peer_links: BTreeMap<(usize, usize), Proxy>,
    /// Region r's servers → voter v's client listener.
    fed_links: BTreeMap<(usize, usize), Proxy>,
}

/// Parses `suanli federation listening client=ADDR peer=ADDR`.
fn parse_listening(line: &str) -> Option<(String, String)> {
    let rest = line.trim().strip_prefix("suanli federation listening ")?;
    let mut client = None;
    let mut peer = None;
    for kv in rest.split_whitespace() {
        if let Some(v) = kv.strip_prefix("client=") {
            client = Some(v.to_owned());
        } else if let Some(v) = kv.strip_prefix("peer=") {
            peer = Some(v.to_owned());
        }
    }
    Some((client?, peer?))
}

/// Reads a voter's stdout until its listening line (at most `within`); a thread keeps
/// draining the rest so the process never blocks on a full pipe.
fn await_listening(stdout: impl std::io::Read + Send + 'static, within: Duration) -> anyhow::Result<(String, String)> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(b) = parse_listening(&line)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(b);
            }
        }
    });
    rx.recv_timeout(within)
        .map_err(|e| anyhow::anyhow!("no `suanli federation listening ...` line within {within:?} ({e}): did it exit?"))
}

impl World {
    /// Binds every proxy, starts the federation (voters 2 and 3 wait to be added, voter 1
    /// bootstraps listing all three), sets a worldwide quota for [`TEAM`], then starts the
    /// regions with `[federation]` pointing at their proxies, and returns once every region
    /// shows healthy in `Federation.Regions`.
    pub async fn start(bin: &Path, shape: WorldShape, seed: u64, keep: bool) -> anyhow::Result<World> {
        let dir = tempfile::Builder::new().prefix("suanli-chaos-fed-").disable_cleanup(keep).tempdir()?;
        let n = REGIONS.len();
        let mut peer_links = BTreeMap::new();
        let mut fed_links = BTreeMap::new();
        let mut k = 10_000u64;
        for i in 0..n {
            for j in 0..n {
                k += 1;
                if i != j {
                    peer_links.insert((i, j), Proxy::bind(seed.wrapping_add(k)).await?);
                }
                fed_links.insert((i, j), Proxy::bind(seed.wrapping_add(k + 100)).await?);
            }
        }
        let voters = (0..n)
            .map(|v| Voter {
                id: v as u64 + 1,
                addr: String::new(),
                peer_addr: String::new(),
                peer_name: format!("fed-{}.peer.chaos:7501", v + 1),
                dir: dir.path().join(format!("fed{}", v + 1)),
                child: None,
            })
            .collect();
        let mut w = World { dir, bin: bin.to_owned(), shape, regions: Vec::new(), voters, peer_links, fed_links };
        for v in (1..n).chain([0]) {
            w.start_voter(v)?;
        }
        w.wait_fed_leader(Duration::from_secs(30)).await.context("the federation elected no leader")?;
        w.set_quota(TEAM, MODEL, 1_000_000_000).await.context("setting the chaos team's worldwide quota")?;
        for (r, name) in REGIONS.iter().enumerate() {
            let link = suanli_server::config::FederationLink {
                region: (*name).to_owned(),
                endpoints: (0..n).map(|v| w.fed_links[&(r, v)].addr.clone()).collect(),
                // Region 0 carries the data the trainers prefer: they land there.
                labels: if r == 0 { [("data".to_owned(), "chaos".to_owned())].into() } else { BTreeMap::new() },
                request_timeout_ms: 1_000,
                ..Default::default()
            };
            let shape = Shape {
                federation: Some(link),
                pool: format!("pool-{name}"),
                node_prefix: (*name).to_owned(),
                ..Shape::new(w.shape.servers_per_region, w.shape.agents_per_region, w.shape.gpus_per_agent, 0)
            };
            let c = Cluster::start(bin, shape, seed.wrapping_add(1_000 * (r as u64 + 1)), keep)
                .await
                .with_context(|| format!("starting region {name}"))?;
            w.regions.push(c);
        }
        // One checkpoint store every region reaches: a job moved to another region restores there.
        let store = w.dir.path().join("checkpoints");
        std::fs::create_dir_all(&store)?;
        let url = serde_json::Value::String(format!("file://{}", store.display()));
        for r in 0..n {
            w.regions[r].set_config("checkpoint_store", &url).await.context("setting checkpoint_store")?;
        }
        w.wait_regions_healthy(&(0..n).collect::<Vec<_>>(), Duration::from_secs(60)).await?;
        Ok(w)
    }

    /// The run's directory (the federation's data, configs and logs; trainer journals).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The lease terms.
    pub fn terms(&self) -> Terms {
        self.shape.terms
    }

    fn voter_log(&self, v: usize) -> PathBuf {
        self.dir.path().join(format!("fed{}.log", v + 1))
    }

    /// Voter `v`'s log (for failure reports).
    pub fn voter_log_text(&self, v: usize) -> String {
        std::fs::read_to_string(self.voter_log(v)).unwrap_or_default()
    }

    /// `suanli federation serve`'s arguments for voter `v`: the same membership flags as
    /// `suanli server`, the terms, and a config file with the dial rewrites. Ports not known
    /// yet are 0; while another voter's are not known it has no `--peers` (it waits).
    fn voter_args(&self, v: usize) -> anyhow::Result<Vec<String>> {
        let or_zero = |a: &str| if a.is_empty() { "127.0.0.1:0".to_owned() } else { a.to_owned() };
        let me = &self.voters[v];
        let t = self.shape.terms;
        let mut args: Vec<String> = vec![
            "federation".into(),
            "serve".into(),
            "--id".into(),
            me.id.to_string(),
            "--data-dir".into(),
            me.dir.display().to_string(),
            "--listen".into(),
            or_zero(&me.addr),
            "--peer-listen".into(),
            or_zero(&me.peer_addr),
            "--tls-dir".into(),
            cluster::pki().dir().display().to_string(),
            "--lease-ms".into(),
            t.lease_ms.to_string(),
            "--sync-interval-ms".into(),
            t.sync_interval_ms.to_string(),
            "--max-clock-drift-ms".into(),
            t.max_clock_drift_ms.to_string(),
            "--redispatch-margin-ms".into(),
            t.redispatch_margin_ms.to_string(),
            "--region-unhealthy-after-ms".into(),
            t.region_unhealthy_after_ms.to_string(),
        ];
        let others_known = self.voters.iter().enumerate().all(|(j, s)| j == v || !s.addr.is_empty());
        if others_known {
            let peers: Vec<String> =
                self.voters.iter().map(|s| format!("{}={}/{}", s.id, or_zero(&s.addr), s.peer_name)).collect();
            args.push("--peers".into());
            args.push(peers.join(","));
            args.push("--bootstrap".into());
        }
        // The dial rewrites: every other voter's advertised peer name → the proxy of this link.
        let mut dial = toml::Table::new();
        for (j, s) in self.voters.iter().enumerate().filter(|(j, _)| *j != v) {
            dial.insert(s.peer_name.clone(), toml::Value::String(self.peer_links[&(v, j)].addr.clone()));
        }
        let mut raft = toml::Table::new();
        raft.insert("dial".into(), toml::Value::Table(dial));
        let mut file = toml::Table::new();
        file.insert("raft".into(), toml::Value::Table(raft));
        let path = self.dir.path().join(format!("fed{}.toml", v + 1));
        std::fs::write(&path, toml::to_string(&file).context("encoding a federation config")?)?;
        args.push("--config".into());
        args.push(path.display().to_string());
        Ok(args)
    }

    /// Starts (or restarts) voter `v`. At its first start it picks its ports: this waits for
    /// its listening line, then points the proxies of its links there.
    pub fn start_voter(&mut self, v: usize) -> anyhow::Result<()> {
        if self.voters[v].child.is_some() {
            return Ok(());
        }
        std::fs::create_dir_all(&self.voters[v].dir)?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.voter_log(v))?;
        let first = self.voters[v].addr.is_empty();
        let mut child = Command::new(&self.bin)
            .args(self.voter_args(v)?)
            .env("SUANLI_LOG", std::env::var("SUANLI_CHAOS_SERVER_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(if first { Stdio::piped() } else { Stdio::null() })
            .stderr(Stdio::from(log))
            .process_group(0)
            .spawn()
            .context("starting suanli federation serve")?;
        if first {
            let stdout = child.stdout.take().context("the voter's stdout")?;
            let (client, peer) = match await_listening(stdout, Duration::from_secs(60)) {
                Ok(b) => b,
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("federation voter {} did not listen: {e}\n{}", v + 1, self.voter_log_text(v));
                }
            };
            for ((_, to), p) in &self.peer_links {
                if *to == v {
                    p.set_target(peer.clone());
                }
            }
            for ((_, to), p) in &self.fed_links {
                if *to == v {
                    p.set_target(client.clone());
                }
            }
            (self.voters[v].addr, self.voters[v].peer_addr) = (client, peer);
        }
        self.voters[v].child = Some(child);
        Ok(())
    }

    /// SIGKILL voter `v` and reap it.
    pub fn kill_voter(&mut self, v: usize) {
        if let Some(mut c) = self.voters[v].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether voter `v` runs.
    pub fn voter_alive(&mut self, v: usize) -> bool {
        match self.voters[v].child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                self.voters[v].child = None;
                false
            }
            None => false,
        }
    }

    /// A Federation client of voter `v`, directly (the harness's observer).
    pub fn fed_client(
        &self,
        v: usize,
        timeout: Duration,
    ) -> anyhow::Result<FederationClient<tonic::transport::Channel>> {
        Ok(FederationClient::new(cluster::lazy_channel(&self.voters[v].addr, timeout)?)
            .max_decoding_message_size(64 << 20))
    }

    /// The federation leader as the live voters see it (the highest applied index's answer).
    pub async fn fed_leader(&mut self) -> Option<usize> {
        let mut best: Option<(u64, u64)> = None;
        for v in 0..self.voters.len() {
            if !self.voter_alive(v) {
                continue;
            }
            let Ok(mut c) = self.fed_client(v, Duration::from_millis(500)) else { continue };
            if let Ok(r) = c.status(pb::FedStatusRequest {}).await {
                let r = r.into_inner();
                if r.leader_id != 0 && best.is_none_or(|(i, _)| r.applied_index > i) {
                    best = Some((r.applied_index, r.leader_id));
                }
            }
        }
        let (_, id) = best?;
        let v = self.voters.iter().position(|s| s.id == id)?;
        self.voter_alive(v).then_some(v)
    }

    /// Waits for a federation leader.
    pub async fn wait_fed_leader(&mut self, within: Duration) -> anyhow::Result<usize> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(l) = self.fed_leader().await {
                return Ok(l);
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = (0..self.voters.len())
                    .map(|v| {
                        let log = self.voter_log_text(v);
                        let tail: Vec<&str> = log.lines().rev().take(6).collect();
                        format!("voter {}:\n{}", v + 1, tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
                    })
                    .collect();
                bail!("no federation leader within {within:?}\n{}", logs.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Sets a worldwide quota through any voter that answers.
    pub async fn set_quota(&mut self, team: &str, model: &str, limit_milli: u64) -> anyhow::Result<()> {
        let req = pb::FedSetQuotaRequest { team: team.into(), device_model: model.into(), limit_milli };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut last = String::new();
            for v in 0..self.voters.len() {
                let mut c = self.fed_client(v, Duration::from_secs(3))?;
                match c.set_quota(req.clone()).await {
                    Ok(_) => return Ok(()),
                    Err(e) => last = format!("{:?}: {}", e.code(), e.message()),
                }
            }
            if Instant::now() > deadline {
                bail!("Federation.SetQuota: {last}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Submits a global job through voter `v` (a follower forwards it): its global id.
    pub async fn submit_global(
        &self,
        v: usize,
        rid: &str,
        spec: &serde_json::Value,
        labels: &[(&str, &str)],
    ) -> anyhow::Result<String> {
        let mut c = self.fed_client(v, Duration::from_secs(3))?;
        let req = pb::FedSubmitRequest {
            spec_json: spec.to_string(),
            team: TEAM.into(),
            client_request_id: rid.into(),
            data_labels: labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            ..Default::default()
        };
        Ok(c.submit(req).await?.into_inner().global_id)
    }

    /// Every federated job, from the first voter that answers the whole listing.
    pub async fn fed_jobs(&mut self) -> anyhow::Result<Vec<pb::FedJobInfo>> {
        let mut last = anyhow::anyhow!("no voter is running");
        let order: Vec<usize> = match self.fed_leader().await {
            Some(l) => std::iter::once(l).chain((0..self.voters.len()).filter(|v| *v != l)).collect(),
            None => (0..self.voters.len()).collect(),
        };
        'voters: for v in order {
            let mut c = self.fed_client(v, Duration::from_secs(3))?;
            let mut out = Vec::new();
            let mut after = String::new();
            loop {
                let req = pb::FedJobsRequest { limit: 1000, after: after.clone(), ..Default::default() };
                match c.jobs(req).await {
                    Ok(r) => {
                        let r = r.into_inner();
                        out.extend(r.jobs);
                        if r.next.is_empty() {
                            return Ok(out);
                        }
                        after = r.next;
                    }
                    Err(e) => {
                        last = anyhow::anyhow!("voter {}: {:?}: {}", v + 1, e.code(), e.message());
                        continue 'voters;
                    }
                }
            }
        }
        Err(last)
    }

    /// The regions `Federation.Regions` shows healthy.
    pub async fn healthy_regions(&mut self) -> anyhow::Result<BTreeSet<String>> {
        let l = self.fed_leader().await.unwrap_or(0);
        let mut c = self.fed_client(l, Duration::from_secs(3))?;
        let r = c.regions(pb::FedRegionsRequest {}).await?.into_inner();
        Ok(r.regions.into_iter().filter(|x| x.healthy).map(|x| x.name).collect())
    }

    /// Waits until regions `rs` show healthy.
    pub async fn wait_regions_healthy(&mut self, rs: &[usize], within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let last = match self.healthy_regions().await {
                Ok(h) if rs.iter().all(|r| h.contains(REGIONS[*r])) => return Ok(()),
                Ok(h) => format!("healthy: {h:?}"),
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                bail!(
                    "regions {:?} not all healthy within {within:?} ({last}); logs in {}",
                    rs.iter().map(|r| REGIONS[*r]).collect::<Vec<_>>(),
                    self.dir.path().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Cuts (or restores) region `r` from the federation: its servers' links to every voter,
    /// and its voter's peer links both ways. Its agents keep reaching its servers.
    pub fn cut_region(&self, r: usize, blocked: bool) {
        let f = Fault { blocked, ..Fault::default() };
        for v in 0..self.voters.len() {
            if let Some(p) = self.fed_links.get(&(r, v)) {
                p.set(f);
            }
        }
        for ((i, j), p) in &self.peer_links {
            if *i == r || *j == r {
                p.set(f);
            }
        }
    }

    /// Every federation link back to none.
    pub fn heal_links(&self) {
        for p in self.peer_links.values().chain(self.fed_links.values()) {
            p.set(Fault::default());
        }
        for c in &self.regions {
            c.heal_links();
        }
    }

    /// Every agent's journal line in every region, with the node's region.
    pub fn journals(&self) -> Vec<(usize, JournalLine)> {
        let mut out = Vec::new();
        for (r, c) in self.regions.iter().enumerate() {
            for a in 0..c.agents.len() {
                let text = std::fs::read_to_string(c.journal_path(a)).unwrap_or_default();
                out.extend(checker::parse_journal(&text).into_iter().map(|l| (r, l)));
            }
        }
        out
    }

    /// Stops every process of the world.
    pub fn stop_all(&mut self) {
        for v in 0..self.voters.len() {
            self.kill_voter(v);
        }
        for c in &mut self.regions {
            c.stop_all();
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// A federated trainer: one GPU, checkpoints every second, 1 s checkpoint grace (the lease
/// of [`TERMS`] leaves room for it: drift + grace + kill grace + two syncs < lease).
pub fn fed_trainer_spec(name: &str, journal: &Path) -> serde_json::Value {
    trainers::trainer_spec(name, journal, trainers::STEPS, trainers::STEP_S, trainers::EVERY, 1, 10)
}

/// A short CPU-only job (a global or local submit of the workload).
pub fn short_spec(name: &str, secs: u64) -> serde_json::Value {
    serde_json::json!({
        "name": name, "queue": "default", "kind": "batch",
        "groups": [{"name": "main", "replicas": 1,
                    "resources": {"cpu_milli": 100, "memory_mib": 64},
                    "task": {"command": "/bin/sh", "args": ["-c", format!("sleep {secs}")]}}]
    })
}

/// One acknowledged (or failed) global submit.
#[derive(Debug, Clone)]
pub struct GlobalSubmit {
    /// Client request id.
    pub rid: String,
    /// The global id acknowledged; None: not acknowledged (error text in `error`).
    pub global_id: Option<String>,
    /// Why it was not acknowledged.
    pub error: String,
}

/// Submits global job `rid` through any live voter, trying each once (leader first).
pub async fn submit_any(w: &mut World, rid: &str, spec: &serde_json::Value) -> GlobalSubmit {
    let mut err = String::from("no voter is running");
    let order: Vec<usize> = match w.fed_leader().await {
        Some(l) => std::iter::once(l).chain((0..w.voters.len()).filter(|v| *v != l)).collect(),
        None => (0..w.voters.len()).collect(),
    };
    for v in order {
        if !w.voter_alive(v) {
            continue;
        }
        match w.submit_global(v, rid, spec, &[]).await {
            Ok(g) => return GlobalSubmit { rid: rid.to_owned(), global_id: Some(g), error: String::new() },
            Err(e) => err = format!("voter {}: {e:#}", v + 1),
        }
    }
    GlobalSubmit { rid: rid.to_owned(), global_id: None, error: err }
}

/// Verdict: every acknowledged global submit is listed by the federation under the id it was
/// acknowledged with.
pub fn acknowledged_global(submits: &[GlobalSubmit], jobs: &[pb::FedJobInfo]) -> Verdict {
    let listed: BTreeSet<&str> = jobs.iter().map(|j| j.global_id.as_str()).collect();
    let acked: Vec<&str> = submits.iter().filter_map(|s| s.global_id.as_deref()).collect();
    let lost: Vec<String> = acked.iter().filter(|g| !listed.contains(**g)).map(|g| (*g).to_owned()).collect();
    Verdict {
        name: "acknowledged global submits",
        ok: lost.is_empty(),
        detail: if lost.is_empty() {
            format!(
                "{} acknowledged ({} not acknowledged), all listed among {} federated jobs",
                acked.len(),
                submits.len() - acked.len(),
                jobs.len()
            )
        } else {
            format!("{} lost: {}", lost.len(), lost.join(", "))
        },
    }
}

/// Polls the federation's jobs every 200 ms while `stop` is unset, keeping the largest
/// `lease_until_ms` seen per (global id, epoch, region): the lease ends the checks hold the
/// journals against.
pub async fn watch_leases(w: &mut World, until: Instant, seen: &mut BTreeMap<(String, u64), (String, u64)>) {
    while Instant::now() < until {
        if let Ok(jobs) = w.fed_jobs().await {
            record_leases(&jobs, seen);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Keeps the largest lease end per (global id, epoch) with its region.
pub fn record_leases(jobs: &[pb::FedJobInfo], seen: &mut BTreeMap<(String, u64), (String, u64)>) {
    for j in jobs {
        if j.epoch == 0 || j.region.is_empty() || j.lease_until_ms == 0 {
            continue;
        }
        let e = seen.entry((j.global_id.clone(), j.epoch)).or_insert_with(|| (j.region.clone(), 0));
        e.1 = e.1.max(j.lease_until_ms);
    }
}

/// The region index of a region's name.
pub fn region_index(name: &str) -> Option<usize> {
    REGIONS.iter().position(|r| *r == name)
}

/// Verdict: no two runs of one global job's task overlap in time, across every region and
/// epoch ([`checker::no_overlap`]).
pub fn no_overlap_verdict(lines: &[(usize, JournalLine)]) -> Verdict {
    let tagged: Vec<JournalLine> =
        lines.iter().map(|(r, l)| JournalLine { node: format!("{}/{}", REGIONS[*r], l.node), ..l.clone() }).collect();
    let runs = checker::runs(&tagged);
    let fed = runs.iter().filter(|r| !r.global_id.is_empty()).count();
    let ids: BTreeSet<&str> = runs.iter().filter(|r| !r.global_id.is_empty()).map(|r| r.global_id.as_str()).collect();
    let bad = checker::no_overlap(&runs);
    Verdict {
        name: "no overlap",
        ok: bad.is_empty(),
        detail: if bad.is_empty() {
            format!("{fed} runs of {} global jobs, none overlapping another run of its global id", ids.len())
        } else {
            format!("{} overlaps: {}", bad.len(), bad.iter().take(5).cloned().collect::<Vec<_>>().join("; "))
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_line_parses() {
        assert_eq!(
            parse_listening("suanli federation listening client=127.0.0.1:1 peer=127.0.0.1:2\n"),
            Some(("127.0.0.1:1".to_owned(), "127.0.0.1:2".to_owned()))
        );
        assert_eq!(parse_listening("suanli server listening client=127.0.0.1:1 peer=127.0.0.1:2"), None);
        assert_eq!(parse_listening("suanli federation listening client=127.0.0.1:1"), None);
    }

    #[test]
    fn the_terms_leave_room_for_a_trainer() {
        let t = TERMS;
        // stop_before = drift + grace (1 s) + kill grace (1 s); refused at submit unless
        // stop_before + 2 syncs < lease.
        let stop_before = t.max_clock_drift_ms + 1_000 + 1_000;
        assert!(stop_before + 2 * t.sync_interval_ms < t.lease_ms);
        assert!(t.redispatch_margin_ms >= 2 * t.max_clock_drift_ms);
    }
}

/// Which multi-region scenario a [`crate::scenario::Scenario`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FedScenario {
    /// Region A cut off from the federation while checkpointing jobs run in it.
    RegionPartition,
    /// The federation leader SIGKILLed while global and local jobs are submitted.
    LeaderKill,
}

/// What one multi-region run found.
pub struct FedOutcome {
    /// Every verdict.
    pub verdicts: Vec<Verdict>,
    /// Faults injected.
    pub faults: usize,
    /// Submits made (global and local).
    pub ops: usize,
    /// Of them acknowledged.
    pub acked: usize,
    /// Acknowledged global submits missing.
    pub lost: usize,
    /// Overlapping runs of one global job.
    pub overlaps: usize,
    /// Task runs in the journals.
    pub task_runs: usize,
    /// Time from the heal until region A was healthy again (ms).
    pub recovery_ms: Option<u64>,
    /// The run's directory, when kept.
    pub dir: Option<PathBuf>,
}

/// Runs a multi-region scenario with one seed.
pub async fn run(which: FedScenario, seed: u64, opts: &crate::Options) -> anyhow::Result<FedOutcome> {
    let shape = WorldShape { servers_per_region: 1, ..WorldShape::default() };
    let mut w =
        World::start(&opts.bin, shape, seed, opts.keep).await.context("starting three regions and a federation")?;
    tracing::info!(?which, seed, dir = %w.dir().display(), "regions and federation up");
    let out = match which {
        FedScenario::RegionPartition => region_partition(&mut w, seed).await,
        FedScenario::LeaderKill => leader_kill(&mut w, seed, opts.duration_ms).await,
    };
    let mut out = out?;
    out.dir = opts.keep.then(|| w.dir().to_owned());
    w.stop_all();
    Ok(out)
}

/// One global workload step: a short CPU job through any voter.
async fn workload_submit(w: &mut World, n: &mut u64, seed: u64, submits: &mut Vec<GlobalSubmit>) {
    *n += 1;
    let rid = format!("fed-w-{seed}-{n}");
    submits.push(submit_any(w, &rid, &short_spec(&format!("fed-w-{n}"), 1)).await);
}

/// Every region job of region `r` (linearizable, from its leader directly).
async fn region_jobs(w: &mut World, r: usize) -> anyhow::Result<Vec<pb::JobInfo>> {
    crate::list_jobs(&mut w.regions[r]).await
}

/// `region-partition`: trainers run in region A (they prefer its data label); every link of A
/// to the federation is cut (its servers to every voter, its voter to the other voters) while
/// a global workload keeps submitting; the trainers must stop in A before their lease ends and
/// start elsewhere after the lease end plus the margin, from their checkpoint; then A rejoins
/// and releases its old-epoch jobs.
async fn region_partition(w: &mut World, seed: u64) -> anyhow::Result<FedOutcome> {
    let t = w.terms();
    let mut submits = Vec::new();
    let mut n = 0u64;
    let mut leases: BTreeMap<(String, u64), (String, u64)> = BTreeMap::new();
    // Two trainers, preferring region 0's data.
    let mut trainers_: Vec<(String, PathBuf)> = Vec::new();
    for i in 0..2 {
        let journal = w.dir().join(format!("trainer-{i}.jsonl"));
        let spec = fed_trainer_spec(&format!("fed-trainer-{i}"), &journal);
        let leader = w.fed_leader().await.unwrap_or(0);
        let g = w
            .submit_global(leader, &format!("fed-trainer-{seed}-{i}"), &spec, &[("data", "chaos")])
            .await
            .with_context(|| format!("submitting fed-trainer-{i}"))?;
        submits.push(GlobalSubmit {
            rid: format!("fed-trainer-{seed}-{i}"),
            global_id: Some(g.clone()),
            error: String::new(),
        });
        trainers_.push((g, journal));
    }
    // Wait until both run and have checkpointed (and a sync carried the checkpoint).
    let deadline = Instant::now() + Duration::from_secs(40);
    let held: BTreeMap<String, (String, u64)> = loop {
        let jobs = w.fed_jobs().await.unwrap_or_default();
        record_leases(&jobs, &mut leases);
        let running: BTreeMap<String, (String, u64)> = jobs
            .iter()
            .filter(|j| j.state == "running" && trainers_.iter().any(|(g, _)| *g == j.global_id))
            .map(|j| (j.global_id.clone(), (j.region.clone(), j.epoch)))
            .collect();
        let checkpointed = trainers_
            .iter()
            .all(|(_, p)| trainers::read_trainer_journal(p).iter().any(|l| l.event == "checkpoint" && l.step > 0));
        if running.len() == trainers_.len() && checkpointed {
            break running;
        }
        if Instant::now() > deadline {
            bail!(
                "the trainers did not all run and checkpoint within 40 s: {:?}",
                jobs.iter()
                    .map(|j| format!("{} {} {} ({})", j.global_id, j.state, j.region, j.reason))
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Two more syncs: the federation has the latest checkpoints.
    let settle = Instant::now() + Duration::from_millis(2 * t.sync_interval_ms);
    while Instant::now() < settle {
        workload_submit(w, &mut n, seed, &mut submits).await;
        watch_leases(w, Instant::now() + Duration::from_millis(300), &mut leases).await;
    }
    // Region A: where the first trainer runs; its trainers are the ones checked.
    let a_name = held.values().next().map(|(r, _)| r.clone()).context("no trainer held")?;
    let a = region_index(&a_name).with_context(|| format!("unknown region {a_name}"))?;
    let in_a: BTreeMap<String, u64> =
        held.iter().filter(|(_, (r, _))| *r == a_name).map(|(g, (_, e))| (g.clone(), *e)).collect();
    let cut_at = crate::history::now_ms();
    w.cut_region(a, true);
    tracing::info!(region = %a_name, jobs = ?in_a, "region cut from the federation");
    // Until every trainer of A runs elsewhere at a later epoch (bound: lease + margin + 30 s).
    let bound = Instant::now() + Duration::from_millis(t.lease_ms + t.redispatch_margin_ms + 30_000);
    let mut moved_ms = None;
    loop {
        workload_submit(w, &mut n, seed, &mut submits).await;
        let jobs = w.fed_jobs().await.unwrap_or_default();
        record_leases(&jobs, &mut leases);
        let moved = in_a.iter().all(|(g, e)| {
            jobs.iter().any(|j| j.global_id == *g && j.epoch > *e && j.state == "running" && j.region != a_name)
        });
        if moved {
            moved_ms = Some(crate::history::now_ms() - cut_at);
            break;
        }
        if Instant::now() > bound {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Heal: A rejoins; its reports of the old epochs are refused and it releases them.
    w.heal_links();
    let healed = Instant::now();
    let rejoined = w.wait_regions_healthy(&[a], Duration::from_secs(30)).await;
    let recovery_ms = rejoined.as_ref().ok().map(|()| healed.elapsed().as_millis() as u64);
    // A few syncs for A's link to hear the refusals and release.
    let mut released;
    let rel_deadline = Instant::now() + Duration::from_millis(10 * t.sync_interval_ms + 5_000);
    loop {
        let jobs = region_jobs(w, a).await.unwrap_or_default();
        released = jobs
            .iter()
            .filter(|j| in_a.get(&j.global_id).is_some_and(|e| j.fed_epoch <= *e))
            .map(|j| (j.global_id.clone(), j.fed_epoch, j.state.clone(), j.reason.clone()))
            .collect::<Vec<_>>();
        let all_ended = !released.is_empty()
            && released.iter().all(|(_, _, s, _)| matches!(s.as_str(), "cancelled" | "failed" | "succeeded"));
        if all_ended || Instant::now() > rel_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let final_jobs = w.fed_jobs().await.unwrap_or_default();
    record_leases(&final_jobs, &mut leases);

    // Checks.
    let lines = w.journals();
    let tagged: Vec<JournalLine> =
        lines.iter().map(|(r, l)| JournalLine { node: format!("{}/{}", REGIONS[*r], l.node), ..l.clone() }).collect();
    let runs = checker::runs(&tagged);
    let mut verdicts = Vec::new();
    verdicts.push(Verdict {
        name: "moved after region loss",
        ok: moved_ms.is_some(),
        detail: match moved_ms {
            Some(ms) => format!(
                "{} job(s) of {a_name} running in another region at a later epoch {:.1} s after the cut (lease {} s + margin {} s)",
                in_a.len(),
                ms as f64 / 1000.0,
                t.lease_ms / 1000,
                t.redispatch_margin_ms as f64 / 1000.0
            ),
            None => format!("not every job of {a_name} ran elsewhere within the bound: {in_a:?}"),
        },
    });
    let mut stop_bad = Vec::new();
    let mut start_bad = Vec::new();
    let mut restored_bad = Vec::new();
    let mut gaps = Vec::new();
    for (g, e) in &in_a {
        let Some((_, lease_end)) = leases.get(&(g.clone(), *e)) else {
            stop_bad.push(format!("{g}: no lease end seen for epoch {e}"));
            continue;
        };
        let old: Vec<&checker::Run> = runs.iter().filter(|r| r.global_id == *g && r.fed_epoch == *e).collect();
        let new: Vec<&checker::Run> = runs.iter().filter(|r| r.global_id == *g && r.fed_epoch > *e).collect();
        let old_end = old.iter().map(|r| r.until_ms).max().unwrap_or(0);
        for r in &old {
            if r.until_ms == u64::MAX || r.until_ms > lease_end.saturating_sub(t.max_clock_drift_ms) {
                stop_bad.push(format!(
                    "{g} epoch {e} on {}: stopped at {} > lease end {lease_end} - drift {}",
                    r.node,
                    if r.until_ms == u64::MAX { "never".to_owned() } else { r.until_ms.to_string() },
                    t.max_clock_drift_ms
                ));
            }
        }
        for r in &new {
            if r.from_ms + t.max_clock_drift_ms < lease_end + t.redispatch_margin_ms {
                start_bad.push(format!(
                    "{g} epoch {} on {}: started at {} before lease end {lease_end} + margin {} - drift",
                    r.fed_epoch, r.node, r.from_ms, t.redispatch_margin_ms
                ));
            }
        }
        if let Some(first) = new.iter().map(|r| r.from_ms).min() {
            gaps.push(first.saturating_sub(old_end));
        }
        let journal = trainers_.iter().find(|(x, _)| x == g).map(|(_, p)| trainers::read_trainer_journal(p));
        let restored = journal
            .unwrap_or_default()
            .iter()
            .any(|l| l.event == "restore" && l.step > 0 && (l.t * 1000.0) as u64 >= cut_at);
        if !restored {
            restored_bad.push(format!("{g}: no restore from a step > 0 after the cut"));
        }
    }
    verdicts.push(Verdict {
        name: "stopped before lease end",
        ok: stop_bad.is_empty() && !in_a.is_empty(),
        detail: if stop_bad.is_empty() {
            format!("every run of {a_name}'s {} job(s) stopped by its lease end - drift", in_a.len())
        } else {
            stop_bad.join("; ")
        },
    });
    verdicts.push(Verdict {
        name: "started after lease end + margin",
        ok: start_bad.is_empty(),
        detail: if start_bad.is_empty() {
            format!(
                "every later epoch started after lease end + margin; gaps between old end and new start {gaps:?} ms"
            )
        } else {
            start_bad.join("; ")
        },
    });
    verdicts.push(Verdict {
        name: "restored from checkpoint",
        ok: restored_bad.is_empty(),
        detail: if restored_bad.is_empty() {
            format!("{} job(s) restored from a step > 0 in their new region", in_a.len())
        } else {
            restored_bad.join("; ")
        },
    });
    let late_in_a: Vec<String> = runs
        .iter()
        .filter(|r| in_a.contains_key(&r.global_id) && r.node.starts_with(&format!("{a_name}/")) && r.from_ms > cut_at)
        .map(|r| format!("{} epoch {} started on {} at {}", r.global_id, r.fed_epoch, r.node, r.from_ms))
        .collect();
    let not_released: Vec<String> = released
        .iter()
        .filter(|(_, _, s, _)| !matches!(s.as_str(), "cancelled" | "failed" | "succeeded"))
        .map(|(g, e, s, why)| format!("{g} epoch {e} {s} ({why})"))
        .collect();
    verdicts.push(Verdict {
        name: "stale region released",
        ok: rejoined.is_ok() && late_in_a.is_empty() && not_released.is_empty() && !released.is_empty(),
        detail: match (&rejoined, late_in_a.is_empty() && not_released.is_empty()) {
            (Err(e), _) => format!("{a_name} did not rejoin: {e}"),
            (Ok(()), true) if !released.is_empty() => format!(
                "{a_name} rejoined {:.1} s after the heal and ended its old-epoch jobs: {}",
                recovery_ms.unwrap_or(0) as f64 / 1000.0,
                released.iter().map(|(g, e, s, why)| format!("{g}@{e} {s} ({why})")).collect::<Vec<_>>().join("; ")
            ),
            (Ok(()), _) => format!(
                "{a_name} after the heal: {}{}",
                if released.is_empty() { "no region job of its old epochs found; ".to_owned() } else { String::new() },
                late_in_a.iter().chain(&not_released).cloned().collect::<Vec<_>>().join("; ")
            ),
        },
    });
    let ov = no_overlap_verdict(&lines);
    let overlaps = if ov.ok { 0 } else { 1 };
    verdicts.push(ov);
    let ack = acknowledged_global(&submits, &final_jobs);
    let lost = if ack.ok { 0 } else { submits.len() };
    verdicts.push(ack);
    if let Some(d) = w.regions.first().map(|_| w.dir().to_owned()) {
        let dump = serde_json::json!({
            "cut_at_ms": cut_at, "region": a_name, "jobs_in_a": in_a,
            "leases": leases.iter().map(|((g, e), (r, u))| serde_json::json!({"global_id": g, "epoch": e, "region": r, "lease_until_ms": u})).collect::<Vec<_>>(),
            "submits": submits.iter().map(|s| serde_json::json!({"rid": s.rid, "global_id": s.global_id, "error": s.error})).collect::<Vec<_>>(),
            "tasks": lines.iter().map(|(r, l)| serde_json::json!({"region": REGIONS[*r], "line": l})).collect::<Vec<_>>(),
        });
        std::fs::write(d.join("history.json"), serde_json::to_vec_pretty(&dump)?)?;
    }
    Ok(FedOutcome {
        verdicts,
        faults: 1,
        ops: submits.len(),
        acked: submits.iter().filter(|s| s.global_id.is_some()).count(),
        lost,
        overlaps,
        task_runs: runs.len(),
        recovery_ms,
        dir: None,
    })
}

/// `federation-leader-kill`: global jobs submitted through the federation and local jobs
/// through each region all along; a third of the way in the federation leader is SIGKILLed
/// (restarted 3 s later). Dispatch must continue after the failover, region-local scheduling
/// must never stop, and no acknowledged global submit may be lost.
async fn leader_kill(w: &mut World, seed: u64, duration_ms: u64) -> anyhow::Result<FedOutcome> {
    let mut submits = Vec::new();
    let mut n = 0u64;
    let mut local: Vec<(usize, u64, u64)> = Vec::new(); // (region, job id, submitted at ms)
    let mut local_tries = 0usize;
    let start = Instant::now();
    let kill_at = start + Duration::from_millis(duration_ms / 3);
    let hold = Duration::from_secs(3);
    let end = start + Duration::from_millis(duration_ms.max(9_000));
    let mut killed: Option<(usize, u64, Instant)> = None;
    let mut restarted_at_ms = None;
    let mut ln = 0u64;
    while Instant::now() < end {
        if killed.is_none() && Instant::now() >= kill_at {
            let l = w.wait_fed_leader(Duration::from_secs(10)).await?;
            w.kill_voter(l);
            killed = Some((l, crate::history::now_ms(), Instant::now()));
            tracing::info!(voter = l + 1, "federation leader SIGKILLed");
        }
        if let Some((l, _, at)) = killed
            && restarted_at_ms.is_none()
            && at.elapsed() >= hold
        {
            w.start_voter(l)?;
            restarted_at_ms = Some(crate::history::now_ms());
        }
        workload_submit(w, &mut n, seed, &mut submits).await;
        for r in 0..w.regions.len() {
            ln += 1;
            local_tries += 1;
            let rid = format!("local-{seed}-{r}-{ln}");
            if let Ok(id) = w.regions[r].submit(&rid, &short_spec(&format!("local-{ln}"), 1)).await {
                local.push((r, id, crate::history::now_ms()));
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (dead, killed_ms, _) = killed.context("the run ended before the leader was killed")?;
    if restarted_at_ms.is_none() {
        w.start_voter(dead)?;
    }
    let healed = Instant::now();
    w.wait_fed_leader(Duration::from_secs(30)).await?;
    // Every acknowledged global job submitted after the kill is placed (a region holds it)
    // or finished, within the bound.
    let after_kill: BTreeSet<String> = submits.iter().filter_map(|s| s.global_id.clone()).collect();
    let bound = Duration::from_secs(60);
    let (jobs, unplaced) = loop {
        let jobs = w.fed_jobs().await.unwrap_or_default();
        let unplaced: Vec<String> = jobs
            .iter()
            .filter(|j| after_kill.contains(&j.global_id) && matches!(j.state.as_str(), "pending"))
            .map(|j| format!("{} pending ({})", j.global_id, j.reason))
            .collect();
        if (unplaced.is_empty() && !jobs.is_empty()) || healed.elapsed() > bound {
            break (jobs, unplaced);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let recovery_ms = unplaced.is_empty().then(|| healed.elapsed().as_millis() as u64);
    let mut verdicts = Vec::new();
    let placed_after = jobs.iter().filter(|j| j.submitted_at_ms > killed_ms && !j.region.is_empty()).count();
    verdicts.push(Verdict {
        name: "dispatch after failover",
        ok: unplaced.is_empty() && placed_after > 0,
        detail: if unplaced.is_empty() {
            format!("{placed_after} global jobs submitted after the leader kill placed in a region; none left pending")
        } else {
            format!(
                "{} still pending {} s after the run: {}",
                unplaced.len(),
                bound.as_secs(),
                unplaced.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            )
        },
    });
    // Local jobs submitted while the federation had no leader: placed in their region.
    let hold_end = killed_ms + hold.as_millis() as u64;
    let during: Vec<&(usize, u64, u64)> =
        local.iter().filter(|(_, _, at)| *at >= killed_ms && *at <= hold_end).collect();
    let mut stuck = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        stuck.clear();
        let now_s = crate::history::now_ms() / 1000;
        for (r, name) in REGIONS.iter().enumerate().take(w.regions.len()) {
            let rj = region_jobs(w, r).await.unwrap_or_default();
            for (_, id, _) in during.iter().filter(|(x, _, _)| *x == r) {
                match rj.iter().find(|j| j.id == *id) {
                    Some(j) if checker::settled(j, now_s) => {}
                    Some(j) => stuck.push(format!("{name} job {id} {} ({})", j.state, j.reason)),
                    None => stuck.push(format!("{name} job {id} missing")),
                }
            }
        }
        if stuck.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    verdicts.push(Verdict {
        name: "local scheduling during failover",
        ok: stuck.is_empty() && !during.is_empty(),
        detail: if during.is_empty() {
            "no local job was acknowledged while the federation leader was down".to_owned()
        } else if stuck.is_empty() {
            format!("{} local jobs acknowledged during the failover, every one placed or finished", during.len())
        } else {
            format!("{} not placed: {}", stuck.len(), stuck.iter().take(5).cloned().collect::<Vec<_>>().join("; "))
        },
    });
    let ack = acknowledged_global(&submits, &jobs);
    let lost = if ack.ok { 0 } else { 1 };
    verdicts.push(ack);
    let lines = w.journals();
    let ov = no_overlap_verdict(&lines);
    let overlaps = if ov.ok { 0 } else { 1 };
    verdicts.push(ov);
    let tagged: Vec<JournalLine> =
        lines.iter().map(|(r, l)| JournalLine { node: format!("{}/{}", REGIONS[*r], l.node), ..l.clone() }).collect();
    Ok(FedOutcome {
        verdicts,
        faults: 1,
        ops: submits.len() + local_tries,
        acked: submits.iter().filter(|s| s.global_id.is_some()).count() + local.len(),
        lost,
        overlaps,
        task_runs: checker::runs(&tagged).len(),
        recovery_ms,
        dir: None,
    })
}

/// `suanli-chaos bench-region-loss`: the time from a region's loss (every link of it to the
/// federation cut) to its job running elsewhere (the new epoch's start in an agent's journal),
/// over `trials` trials on one world. Returns the times (ms) and the lease + margin they must
/// exceed.
pub async fn region_loss_trials(bin: &Path, trials: usize, seed: u64) -> anyhow::Result<(Vec<u64>, u64)> {
    let shape = WorldShape { servers_per_region: 1, ..WorldShape::default() };
    let mut w = World::start(bin, shape, seed, false).await?;
    let t = w.terms();
    let mut times = Vec::new();
    for k in 0..trials {
        let rid = format!("loss-{seed}-{k}");
        let g = submit_any(&mut w, &rid, &short_spec(&rid, 3_600)).await;
        let g = g.global_id.with_context(|| format!("trial {k}: the submit was not acknowledged: {}", g.error))?;
        // Running somewhere.
        let deadline = Instant::now() + Duration::from_secs(60);
        let (region, epoch) = loop {
            let jobs = w.fed_jobs().await.unwrap_or_default();
            if let Some(j) = jobs.iter().find(|j| j.global_id == g && j.state == "running") {
                break (j.region.clone(), j.epoch);
            }
            if Instant::now() > deadline {
                bail!("trial {k}: {g} did not run within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let r = region_index(&region).with_context(|| format!("unknown region {region}"))?;
        let cut = crate::history::now_ms();
        w.cut_region(r, true);
        // Until an agent's journal shows the next epoch started.
        let deadline = Instant::now() + Duration::from_millis(t.lease_ms + t.redispatch_margin_ms + 60_000);
        let started = loop {
            let lines = w.journals();
            if let Some(at) = lines
                .iter()
                .filter(|(_, l)| l.event == "start" && l.global_id == g && l.fed_epoch > epoch)
                .map(|(_, l)| l.at_ms)
                .min()
            {
                break at;
            }
            if Instant::now() > deadline {
                bail!("trial {k}: {g} did not start elsewhere within the bound after {region} was cut");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        times.push(started.saturating_sub(cut));
        println!(
            "trial {:>3}: {g} from {region}: running elsewhere {:.2} s after the cut",
            k + 1,
            (started - cut.min(started)) as f64 / 1000.0
        );
        w.heal_links();
        w.wait_regions_healthy(&[0, 1, 2], Duration::from_secs(60)).await?;
        // Frees its capacity for the next trials.
        let l = w.fed_leader().await.unwrap_or(0);
        let _ = w.fed_client(l, Duration::from_secs(3))?.cancel(pb::FedCancelRequest { global_id: g.clone() }).await;
    }
    Ok((times, t.lease_ms + t.redispatch_margin_ms))
}
