//! The federation suites' harness (issue 20): several regions, each a real `suanli server`
//! group with fake-GPU agents in a pool of its own, under a three-voter federation
//! (`suanli federation serve`), all mutual TLS with the process's [`LocalPki`]; every region's
//! checkpoint store is one shared `file://` directory, so a job moved between regions restores.
//!
//! ```text
//!  FedHarness::start(&[Region{us-east, H100×2}, Region{eu-west, A100×8}, ...])
//!     ├─ FederatedCluster (suanli_server::local): voters ×3 (federation serve, SHORT terms)
//!     │                       + per region: server --region R --federation A,B,C
//!     ├─ per region: queue `default`, checkpoint_store = file://<tmp>/store
//!     ├─ per region: AgentProc "<region>-n1" in pool "<region>-gpu" with fake GPUs of its model
//!     └─ wait_healthy (every region in Federation.Regions, healthy)
//!  submit_global(region, team, spec) ── Jobs.Submit{global} on that region ── g-<n>
//!  fed_job / wait_fed_job ── Federation.GetJob        journal(region) ── the agent's journal
//! ```

use crate::agents::{AgentProc, ready_healthy, wait_nodes};
use crate::checkpoints::{TrainerLine, fake_gpus, read_trainer_journal, set_config, tail};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::federation_client::FederationClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_server::local::{FedTerms, FederatedCluster, LocalPki, RegionSpec, channel, channel_as};
use tonic::transport::Channel;

/// One region of a [`FedHarness`]: its name, and its one node's fake GPUs.
#[derive(Debug, Clone)]
pub struct Region {
    /// The region's name (`--region`).
    pub name: String,
    /// Servers in its raft group.
    pub servers: usize,
    /// Fake GPUs of its one node.
    pub gpus: u32,
    /// Their model.
    pub model: String,
}

impl Region {
    /// Region `name`: one server, one node of `gpus` fake GPUs of `model`.
    pub fn new(name: &str, gpus: u32, model: &str) -> Region {
        Region { name: name.into(), servers: 1, gpus, model: model.into() }
    }

    /// Its node's id.
    pub fn node(&self) -> String {
        format!("{}-n1", self.name)
    }

    /// Its pool.
    pub fn pool(&self) -> String {
        format!("{}-gpu", self.name)
    }
}

/// The three regions of the suites: us-east (2 H100), eu-west (8 A100-80G), ap-south (2 H100).
pub fn three_regions() -> Vec<Region> {
    vec![Region::new("us-east", 2, "H100"), Region::new("eu-west", 8, "A100-80G"), Region::new("ap-south", 2, "H100")]
}

/// Regions, their federation and their agents (see the module doc).
pub struct FedHarness {
    /// The processes of the federation and the regions.
    pub cluster: FederatedCluster,
    /// The regions as given.
    pub regions: Vec<Region>,
    /// One agent per region, in the same order.
    pub agents: Vec<AgentProc>,
    /// The shared checkpoint store's URL.
    pub store_url: String,
    dir: tempfile::TempDir,
}

/// Regions' servers' config: agents heartbeat every 200 ms and a silent node is down after 3 s.
const REGION_CONFIG: &str = "heartbeat_interval_ms = 200\nheartbeat_ttl_ms = 3000\n";

impl FedHarness {
    /// Starts the federation (3 voters, [`FedTerms::SHORT`]) and `regions`, each with its queue
    /// `default`, the shared checkpoint store and its agent; returns once every region is
    /// healthy in the federation and every node is ready.
    pub async fn start(regions: &[Region]) -> FedHarness {
        FedHarness::start_with(regions, FedTerms::SHORT).await
    }

    /// As [`FedHarness::start`] with other terms.
    pub async fn start_with(regions: &[Region], terms: FedTerms) -> FedHarness {
        let dir = tempfile::Builder::new().prefix("suanli-fed-").tempdir().unwrap();
        let cfg = dir.path().join("region.toml");
        std::fs::write(&cfg, REGION_CONFIG).unwrap();
        let cfg = cfg.display().to_string();
        let specs: Vec<RegionSpec> = regions
            .iter()
            .map(|r| RegionSpec { extra: vec!["--config".into(), cfg.clone()], ..RegionSpec::new(&r.name, r.servers) })
            .collect();
        let cluster = FederatedCluster::start(&crate::bin(), &specs, 3, terms, LocalPki::get(), None)
            .unwrap_or_else(|e| panic!("starting the federated cluster: {e}"));
        cluster.default_queues(Duration::from_secs(30)).await.unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir(&store).unwrap();
        let store_url = format!("file://{}", store.display());
        let mut agents = Vec::new();
        for r in regions {
            let c = cluster.region(&r.name).unwrap();
            let leader = c.addrs[c.wait_leader(Duration::from_secs(30)).await.unwrap()].clone();
            set_config(&leader, "checkpoint_store", &serde_json::Value::String(store_url.clone())).await;
            let extra = format!("pool = \"{}\"\nregion = \"{}\"\n", r.pool(), r.name);
            let mut a = AgentProc::new(&r.node(), &c.addrs, &fake_gpus(r.gpus, &r.model), &extra);
            a.start();
            agents.push(a);
        }
        for r in regions {
            let c = cluster.region(&r.name).unwrap();
            let leader = c.addrs[c.wait_leader(Duration::from_secs(30)).await.unwrap()].clone();
            wait_nodes(&leader, Duration::from_secs(30), "the region's agent registered", |ns| {
                ready_healthy(ns, &r.node(), r.gpus as usize)
            })
            .await;
        }
        let h = FedHarness { cluster, regions: regions.to_vec(), agents, store_url, dir };
        if let Err(e) = h.cluster.wait_healthy(Duration::from_secs(30)).await {
            panic!("{e}\n{}", h.logs());
        }
        h
    }

    /// A directory of the harness's own (removed with it), for trainer journals and the like.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The client address of region `name`'s current leader (its first running server when
    /// none answers within 10 s).
    pub async fn region_addr(&self, name: &str) -> String {
        let c = self.cluster.region(name).unwrap_or_else(|| panic!("no region {name}"));
        match c.wait_leader(Duration::from_secs(10)).await {
            Ok(i) => c.addrs[i].clone(),
            Err(_) => c.alive_addrs().first().cloned().unwrap_or_else(|| c.addrs[0].clone()),
        }
    }

    /// The HTTP listener (`/metrics`) of a running federation server.
    pub fn fed_http_addr(&self) -> String {
        let f = &self.cluster.federation;
        let i = (0..f.addrs.len()).find(|i| f.alive_addrs().contains(&f.addrs[*i])).unwrap_or(0);
        f.http_addrs[i].clone()
    }

    /// A `Federation` client to a running federation server, as the PKI's admin.
    pub async fn fed(&self) -> FederationClient<Channel> {
        let addr = self.cluster.federation.alive_addrs().first().cloned().expect("a federation server runs");
        FederationClient::new(channel(&addr).await.unwrap())
    }

    /// A `Federation` client presenting the servers' certificate (what a region leader's link
    /// does), to federation server `i`.
    pub async fn fed_as_server(&self, i: usize) -> FederationClient<Channel> {
        let ch = channel_as(&self.cluster.federation.addrs[i], &LocalPki::get().server()).await.unwrap();
        FederationClient::new(ch)
    }

    /// Sets `team`'s worldwide quota of `model` to `devices` whole devices.
    pub async fn set_quota(&self, team: &str, model: &str, devices: u64) {
        self.fed()
            .await
            .set_quota(pb::FedSetQuotaRequest {
                team: team.into(),
                device_model: model.into(),
                limit_milli: devices * 1000,
            })
            .await
            .unwrap_or_else(|e| panic!("setting {team}'s {model} quota: {e:?}"));
    }

    /// `Jobs.Submit{global}` on region `region`'s leader, charged to `team`: the global id.
    pub async fn submit_global(&self, region: &str, team: &str, rid: &str, spec: &serde_json::Value) -> String {
        let addr = self.region_addr(region).await;
        submit_global_at(&addr, team, rid, spec)
            .await
            .unwrap_or_else(|e| panic!("submitting {spec} via {region}: {e:?}"))
    }

    /// `Federation.GetJob`.
    pub async fn fed_job(&self, id: &str) -> Result<pb::FedJobInfo, tonic::Status> {
        Ok(self.fed().await.get_job(pb::FedGetJobRequest { global_id: id.into() }).await?.into_inner())
    }

    /// Every federated job (`Federation.Jobs`, all pages).
    pub async fn fed_jobs(&self) -> Vec<pb::FedJobInfo> {
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let r = self
                .fed()
                .await
                .jobs(pb::FedJobsRequest { state: String::new(), region: String::new(), limit: 100, after })
                .await
                .unwrap_or_else(|e| panic!("listing federated jobs: {e:?}"))
                .into_inner();
            out.extend(r.jobs);
            if r.next.is_empty() {
                return out;
            }
            after = r.next;
        }
    }

    /// Waits until federated job `id` satisfies `f`; panics after `within` with the last view
    /// and the logs.
    pub async fn wait_fed_job(
        &self,
        id: &str,
        within: Duration,
        what: &str,
        f: impl Fn(&pb::FedJobInfo) -> bool,
    ) -> pb::FedJobInfo {
        let deadline = Instant::now() + within;
        loop {
            let j = self.fed_job(id).await;
            if let Ok(j) = &j
                && f(j)
            {
                return j.clone();
            }
            if Instant::now() >= deadline {
                panic!("{what}: not within {within:?}; {id}: {j:#?}\n{}", self.logs());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The agent of region `name`.
    pub fn agent(&self, region: &str) -> &AgentProc {
        let i = self.regions.iter().position(|r| r.name == region).unwrap_or_else(|| panic!("no region {region}"));
        &self.agents[i]
    }

    /// Region `name`'s agent's journal lines of federated job `global_id`.
    pub fn journal(&self, region: &str, global_id: &str) -> Vec<suanli_agent::JournalEntry> {
        self.agent(region).journal().into_iter().filter(|e| e.global_id == global_id).collect()
    }

    /// Every region's agent's journal lines of `global_id`, with the region's name, by time.
    pub fn journals(&self, global_id: &str) -> Vec<(String, suanli_agent::JournalEntry)> {
        let mut out: Vec<(String, suanli_agent::JournalEntry)> = self
            .regions
            .iter()
            .flat_map(|r| self.journal(&r.name, global_id).into_iter().map(|e| (r.name.clone(), e)))
            .collect();
        out.sort_by_key(|(_, e)| e.at_ms);
        out
    }

    /// Sends `signal` (`STOP`, `CONT`, `KILL`) to every running server of region `name`.
    pub fn signal_region(&self, region: &str, signal: &str) {
        let c = self.cluster.region(region).unwrap_or_else(|| panic!("no region {region}"));
        for i in c.alive() {
            if let Some(pid) = c.pid(i) {
                let st = std::process::Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status();
                assert!(st.is_ok_and(|s| s.success()), "kill -{signal} {pid} (region {region} server {})", i + 1);
            }
        }
    }

    /// The tails of every process's log, for a failure message.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for i in 0..self.cluster.federation.addrs.len() {
            s += &format!("--- federation {} ---\n{}\n", i + 1, tail(&self.cluster.federation.log(i), 4_000));
        }
        for (name, c) in &self.cluster.regions {
            for i in 0..c.addrs.len() {
                s += &format!("--- region {name} server {} ---\n{}\n", i + 1, tail(&c.log(i), 4_000));
            }
        }
        for a in &self.agents {
            s += &format!("--- agent {} ---\n{}\n", a.node_id, tail(&a.log(), 4_000));
        }
        s
    }

    /// Waits until the trainer journal at `path` has a `restore` line written after `after_ms`
    /// (wall clock, ms); all its lines then, or why not.
    pub async fn wait_journal_restore(
        &self,
        path: &Path,
        within: Duration,
        after_ms: u64,
    ) -> Result<Vec<TrainerLine>, String> {
        let deadline = Instant::now() + within;
        loop {
            let lines = read_trainer_journal(path);
            if lines.iter().any(|l| l.event == "restore" && l.t * 1000.0 > after_ms as f64) {
                return Ok(lines);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "no restore line after {after_ms} in {} within {within:?}; last lines: {:?}",
                    path.display(),
                    lines.iter().rev().take(5).collect::<Vec<_>>()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A path in the harness's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// The W3C trace context every [`submit_global_at`] sends: each federated job, and each of
/// its region jobs, records its trace id ([`TRACE_ID`]).
pub const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
/// The trace id of [`TRACEPARENT`].
pub const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

/// `Jobs.Submit{global: true, team}` on the region server at `addr`, as the PKI's admin, with
/// [`TRACEPARENT`].
pub async fn submit_global_at(
    addr: &str,
    team: &str,
    rid: &str,
    spec: &serde_json::Value,
) -> Result<String, tonic::Status> {
    let ch = channel(addr).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut req = tonic::Request::new(pb::SubmitJobRequest {
        global: true,
        team: team.into(),
        client_request_id: rid.into(),
        spec_json: spec.to_string(),
        retry: None,
    });
    req.metadata_mut().insert("traceparent", tonic::metadata::MetadataValue::from_static(TRACEPARENT));
    let r = JobsClient::new(ch).submit(req).await?.into_inner();
    Ok(r.global_id)
}

/// A job whose one task sleeps `secs` on `gpus` whole GPUs (any model), in queue `default`.
pub fn gpu_sleeper(name: &str, gpus: u32, secs: u32) -> serde_json::Value {
    serde_json::json!({
        "name": name, "queue": "default",
        "groups": [{"name": "main", "replicas": 1,
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": gpus, "milli": 1000}},
            "task": {"command": "/bin/sh", "args": ["-c", format!("sleep {secs}")]}}]
    })
}

/// Whether a federated job's state is one of `states`.
pub fn in_state(j: &pb::FedJobInfo, states: &[&str]) -> bool {
    states.contains(&j.state.as_str())
}

/// The CLI's `suanli federation regions --output json` against `fed` (comma-separated
/// addresses) with the TLS files of `tls_dir` (`suanli tls init`'s layout): the directory as
/// JSON, or why not.
pub fn cli_regions(fed: &str, tls_dir: &Path) -> Result<serde_json::Value, String> {
    cli_federation(fed, tls_dir, &["regions"])
}

/// `suanli federation ARGS... --output json` against `fed` with the TLS files of `tls_dir` (as
/// its admin): the answer as JSON, or why not.
pub fn cli_federation(fed: &str, tls_dir: &Path, args: &[&str]) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(crate::bin())
        .arg("federation")
        .args(args)
        .args(["--output", "json", "--federation", fed])
        .env("SUANLI_TLS_DIR", tls_dir)
        .env_remove("SUANLI_CA")
        .env_remove("SUANLI_CERT")
        .env_remove("SUANLI_KEY")
        .env_remove("SUANLI_TOKEN")
        .env_remove("SUANLI_FEDERATION")
        .output()
        .map_err(|e| format!("running suanli federation {args:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("suanli federation {args:?}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr)));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("suanli federation {args:?} --output json: {e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// The healthy regions' names in a `suanli federation regions --output json` answer (an object
/// with `regions`, or a bare list of regions, each with `name` and `healthy`).
pub fn healthy_names(v: &serde_json::Value) -> Vec<String> {
    let list = v.get("regions").unwrap_or(v);
    list.as_array()
        .map(|a| {
            a.iter()
                .filter(|r| r.get("healthy").and_then(serde_json::Value::as_bool) == Some(true))
                .filter_map(|r| r.get("name").and_then(serde_json::Value::as_str).map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}
