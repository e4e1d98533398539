//! Checkpoint suites' harness (issue 18): a cluster of real servers and fake-plugin agents in
//! named pools with one shared checkpoint store ([`CkptCluster`]), trainer jobs
//! (`examples/trainer/trainer.py`, [`Trainer`]) journalling to one file each, and the checks
//! the suites and their reports make on those journals ([`overlaps`], [`resumes`]).
//!
//! ```text
//!  CkptCluster::start(nodes) ── servers (short heartbeat TTL) + agents (pool, GPU model)
//!        │                      └─ Cluster.SetConfig checkpoint_store = file://<tmp>/store
//!        ├─ submit(Trainer{..}) ── python3 trainer.py --steps … ; $TRAINER_JOURNAL = <tmp>/j<name>.jsonl
//!        ├─ wait_job(id, pred) ── polls Jobs.Get (50 ms → 1 s backoff), panics with the last view
//!        └─ journal(name)      ── Vec<TrainerLine>  → overlaps() / resumes()
//! ```

use crate::agents::AgentProc;
use crate::servers::RETRY;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_server::local::{ProcessCluster, channel};

/// Heartbeat TTL of the servers in these suites (ms): a dead agent's node is down after it.
pub const CKPT_TTL_MS: u64 = 3_000;

/// The trainer in the repository (`examples/trainer/trainer.py`).
pub fn trainer_py() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf();
    let t = root.join("examples").join("trainer").join("trainer.py");
    assert!(t.is_file(), "{} is missing (the trainer of issue 18)", t.display());
    t
}

/// A fake plugin config: `gpus` whole GPUs of model `model`.
pub fn fake_gpus(gpus: u32, model: &str) -> String {
    format!(
        "[[groups]]\ncount = {gpus}\nkind = \"gpu\"\nmodel = \"{model}\"\nmemory_mib = 81920\nid_prefix = \"gpu\"\n"
    )
}

/// One node of a [`CkptCluster`].
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// Node id.
    pub id: String,
    /// Pool.
    pub pool: String,
    /// Fake GPUs.
    pub gpus: u32,
    /// Their model.
    pub model: String,
}

impl NodeSpec {
    /// A node `id` in pool `pool` with `gpus` fake A100s.
    pub fn new(id: &str, pool: &str, gpus: u32) -> NodeSpec {
        NodeSpec { id: id.into(), pool: pool.into(), gpus, model: "A100-80G".into() }
    }

    /// The same with GPUs of model `model`.
    pub fn model(mut self, model: &str) -> NodeSpec {
        self.model = model.into();
        self
    }
}

/// A trainer job: `examples/trainer/trainer.py` with a checkpoint policy.
#[derive(Debug, Clone)]
pub struct Trainer {
    /// Job name; also names its journal.
    pub name: String,
    /// Steps before it exits 0.
    pub steps: u64,
    /// Seconds per step.
    pub step_s: f64,
    /// A checkpoint every this many steps.
    pub every: u64,
    /// Writes hardware-bound checkpoints.
    pub hardware_bound: bool,
    /// GPUs per task (0: CPU only).
    pub gpus: u32,
    /// Job priority.
    pub priority: i64,
    /// Allowed pools (empty: any).
    pub pools: Vec<String>,
    /// The checkpoint policy's grace (s).
    pub grace_s: u64,
}

impl Trainer {
    /// A trainer of 1 GPU: 0.2 s per step, a checkpoint every 5 steps, grace 5 s, 10,000 steps
    /// (it runs until the test ends).
    pub fn new(name: &str) -> Trainer {
        Trainer {
            name: name.into(),
            steps: 10_000,
            step_s: 0.2,
            every: 5,
            hardware_bound: false,
            gpus: 1,
            priority: 0,
            pools: Vec::new(),
            grace_s: 5,
        }
    }

    /// The job spec, journalling to `journal`.
    pub fn spec(&self, journal: &Path) -> serde_json::Value {
        let mut args = vec![
            trainer_py().display().to_string(),
            "--steps".into(),
            self.steps.to_string(),
            "--step-s".into(),
            format!("{}", self.step_s),
            "--checkpoint-every".into(),
            self.every.to_string(),
        ];
        if self.hardware_bound {
            args.push("--hardware-bound".into());
        }
        let mut resources = serde_json::json!({"cpu_milli": 100, "memory_mib": 64});
        if self.gpus > 0 {
            resources["devices"] = serde_json::json!({"kind": "gpu", "count": self.gpus, "milli": 1000});
        }
        // The interval the policy declares: the time `every` steps take, at least 1 s.
        let interval_s = ((self.every as f64 * self.step_s).ceil() as u64).max(1);
        let mut spec = serde_json::json!({
            "name": self.name,
            "queue": "default",
            "priority": self.priority,
            "preemptible": true,
            "checkpoint": {"interval_s": interval_s, "grace_s": self.grace_s, "restore_s": 1},
            "groups": [{
                "name": "main",
                "replicas": 1,
                "resources": resources,
                "task": {"command": "python3", "args": args,
                         "env": {"TRAINER_JOURNAL": journal.display().to_string(), "PYTHONUNBUFFERED": "1"}}
            }]
        });
        if !self.pools.is_empty() {
            spec["constraints"] = serde_json::json!({"pools": self.pools});
        }
        spec
    }
}

/// A job whose task only sleeps, on `gpus` whole GPUs, at `priority`, not preemptible.
pub fn sleeper(name: &str, gpus: u32, priority: i64) -> serde_json::Value {
    serde_json::json!({
        "name": name, "queue": "default", "priority": priority, "preemptible": false,
        "groups": [{"name": "main", "replicas": 1,
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": gpus, "milli": 1000}},
            "task": {"command": "/bin/sh", "args": ["-c", "sleep 600"]}}]
    })
}

/// The trainer journal's lines and checks are the chaos harness's (scenario `migrate`), one
/// copy for both.
pub use suanli_chaos::trainers::{
    AttemptRun, TrainerLine, attempts, overlaps, parse_trainer_journal, read_trainer_journal, step_regressions,
};

/// A cluster for the checkpoint suites: servers with a short heartbeat TTL, agents in pools,
/// one checkpoint store shared by every agent, and a directory of trainer journals.
pub struct CkptCluster {
    /// The servers.
    pub servers: ProcessCluster,
    /// The leader's address when it started (calls retry and follow hints through it).
    pub addr: String,
    /// The agents, in the order given.
    pub agents: Vec<AgentProc>,
    /// The nodes' specs.
    pub nodes: Vec<NodeSpec>,
    /// The checkpoint store's URL (`file://…` unless [`CkptCluster::start_with_store`]).
    pub store_url: String,
    dir: tempfile::TempDir,
}

impl CkptCluster {
    /// One server (a three-server group adds nothing to these suites but time) and `nodes`,
    /// with a `file://` store in a temporary directory.
    pub async fn start(nodes: &[NodeSpec]) -> CkptCluster {
        CkptCluster::start_with_store(nodes, None, &[]).await
    }

    /// As [`CkptCluster::start`], with the store at `store_url` (`None`: a `file://` store) and
    /// `agent_env` set for every agent (e.g. the S3 endpoint and keys).
    pub async fn start_with_store(
        nodes: &[NodeSpec],
        store_url: Option<&str>,
        agent_env: &[(&str, &str)],
    ) -> CkptCluster {
        let dir = tempfile::Builder::new().prefix("suanli-ckpt-").tempdir().unwrap();
        let cfg = dir.path().join("server.toml");
        std::fs::write(&cfg, format!("heartbeat_interval_ms = 200\nheartbeat_ttl_ms = {CKPT_TTL_MS}\n")).unwrap();
        let (servers, addr) = crate::agents::cluster_with(1, &["--config", cfg.to_str().unwrap()]).await;
        let store_url = match store_url {
            Some(u) => u.to_owned(),
            None => {
                let store = dir.path().join("store");
                std::fs::create_dir(&store).unwrap();
                format!("file://{}", store.display())
            }
        };
        set_config(&addr, "checkpoint_store", &serde_json::Value::String(store_url.clone())).await;
        let mut agents = Vec::new();
        for n in nodes {
            let extra = format!("pool = \"{}\"\n", n.pool);
            let mut a = AgentProc::new(&n.id, std::slice::from_ref(&addr), &fake_gpus(n.gpus, &n.model), &extra);
            a.start_env(agent_env);
            agents.push(a);
        }
        for n in nodes {
            crate::agents::wait_nodes(&addr, Duration::from_secs(30), "the agents registered", |ns| {
                crate::agents::ready_healthy(ns, &n.id, n.gpus as usize)
            })
            .await;
        }
        CkptCluster { servers, addr, agents, nodes: nodes.to_vec(), store_url, dir }
    }

    /// The journal path of trainer `name`.
    pub fn journal_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("j-{name}.jsonl"))
    }

    /// Submits trainer `t`; its job id.
    pub async fn submit(&self, t: &Trainer) -> u64 {
        crate::agents::submit(&self.addr, &t.name, &t.spec(&self.journal_path(&t.name))).await
    }

    /// Trainer `name`'s journal so far.
    pub fn journal(&self, name: &str) -> Vec<TrainerLine> {
        read_trainer_journal(&self.journal_path(name))
    }

    /// The agent of node `id`.
    pub fn agent(&mut self, id: &str) -> &mut AgentProc {
        self.agents.iter_mut().find(|a| a.node_id == id).unwrap_or_else(|| panic!("no agent {id}"))
    }

    /// Every agent's log, for a failure message.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for a in &self.agents {
            s += &format!("--- agent {} ---\n{}\n", a.node_id, tail(&a.log(), 6_000));
        }
        s += &format!("--- server ---\n{}\n", tail(&self.servers.log(0), 6_000));
        s
    }

    /// Waits until job `id` satisfies `f` (polling Jobs.Get with the harness's backoff, capped
    /// at 200 ms); panics after `within` with the last view and the logs.
    pub async fn wait_job(
        &self,
        id: u64,
        within: Duration,
        what: &str,
        f: impl Fn(&pb::JobInfo) -> bool,
    ) -> pb::JobInfo {
        let deadline = Instant::now() + within;
        let mut nap = Duration::from_millis(50);
        loop {
            let j = get_job(&self.addr, id).await;
            if let Ok(j) = &j
                && f(j)
            {
                return j.clone();
            }
            assert!(Instant::now() < deadline, "{what}: not within {within:?}; job {id}: {j:#?}\n{}", self.logs());
            tokio::time::sleep(nap).await;
            nap = (nap * 2).min(Duration::from_millis(200));
        }
    }

    /// Waits until trainer `name`'s journal satisfies `f`.
    pub async fn wait_journal(
        &self,
        name: &str,
        within: Duration,
        what: &str,
        f: impl Fn(&[TrainerLine]) -> bool,
    ) -> Vec<TrainerLine> {
        let deadline = Instant::now() + within;
        loop {
            let j = self.journal(name);
            if f(&j) {
                return j;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {within:?}; journal of {name}: {} lines, last {:?}\n{}",
                j.len(),
                j.last(),
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Drains node `id` now (grace 0: checkpoint-first stops right away).
    pub async fn drain(&self, id: &str) {
        let req = pb::SetNodeModeRequest {
            id: id.into(),
            mode: pb::NodeMode::Draining as i32,
            grace_s: 0,
            max_unavailable: 0,
        };
        NodesClient::new(channel(&self.addr).await.unwrap())
            .set_mode(req)
            .await
            .unwrap_or_else(|e| panic!("draining {id}: {e:?}"));
    }

    /// Cordons node `id`.
    pub async fn cordon(&self, id: &str) {
        let req = pb::SetNodeModeRequest {
            id: id.into(),
            mode: pb::NodeMode::Cordoned as i32,
            grace_s: 0,
            max_unavailable: 0,
        };
        NodesClient::new(channel(&self.addr).await.unwrap())
            .set_mode(req)
            .await
            .unwrap_or_else(|e| panic!("cordoning {id}: {e:?}"));
    }

    /// `Jobs.Migrate`.
    pub async fn migrate(&self, job: u64, to_pool: &str, to_node: &str) -> Result<u64, tonic::Status> {
        let req = pb::MigrateJobRequest { job_id: job, to_pool: to_pool.into(), to_node: to_node.into() };
        Ok(JobsClient::new(channel(&self.addr).await.unwrap()).migrate(req).await?.into_inner().revision)
    }
}

impl AgentProc {
    /// Starts the agent with `env` added to its environment.
    pub fn start_env(&mut self, env: &[(&str, &str)]) {
        self.start_with(|cmd| {
            for (k, v) in env {
                cmd.env(k, v);
            }
        });
    }
}

/// The last `n` bytes of `s` (on a char boundary).
pub fn tail(s: &str, n: usize) -> &str {
    let mut from = s.len().saturating_sub(n);
    while !s.is_char_boundary(from) {
        from += 1;
    }
    &s[from..]
}

/// Jobs.Get, linearizable.
pub async fn get_job(addr: &str, id: u64) -> Result<pb::JobInfo, tonic::Status> {
    let ch = channel(addr).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    Ok(JobsClient::new(ch).get(pb::GetJobRequest { job_id: id, stale: false }).await?.into_inner())
}

/// `Cluster.SetConfig` of one field (its value as JSON), retried while the cluster is
/// unavailable; panics when refused.
pub async fn set_config(addr: &str, field: &str, value: &serde_json::Value) {
    let set: BTreeMap<String, String> = [(field.to_owned(), value.to_string())].into();
    RETRY
        .retry(
            || {
                let set = set.clone();
                async move {
                    let ch = channel(addr).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
                    ClusterClient::new(ch).set_config(pb::SetConfigRequest { set }).await
                }
            },
            |s: &tonic::Status| s.code() == tonic::Code::Unavailable,
            |_, _| {},
        )
        .await
        .unwrap_or_else(|e| panic!("setting {field} = {value}: {e:?}"));
}

/// The live allocations' nodes of `j`.
pub fn nodes_of(j: &pb::JobInfo) -> Vec<String> {
    j.allocs.iter().filter(|a| a.state == "running").map(|a| a.node.clone()).collect()
}

/// Whether `j` runs (state `running`, an allocation running) on a node other than `not`.
pub fn running_elsewhere(j: &pb::JobInfo, not: &[&str]) -> bool {
    j.state == "running" && {
        let n = nodes_of(j);
        !n.is_empty() && n.iter().all(|x| !not.contains(&x.as_str()))
    }
}
