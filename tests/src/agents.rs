//! Agents and jobs: `suanli agent` processes with the fake device plugin ([`AgentProc`]), a
//! cluster with a `default` queue ([`cluster`]), and a task script that records where and when
//! it ran ([`record_job`], [`read_lines`]).

use crate::bin;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::nodes_client::NodesClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_server::local::{LocalPki, ProcessCluster, channel};

/// The fake plugin built by cargo beside the `suanli` binary ([`crate::target_dir`]).
pub fn fake_so() -> PathBuf {
    let debug = crate::target_dir();
    let so = debug.join("libsuanli_plugin_fake.so");
    if so.exists() {
        return so;
    }
    // A dependency's cdylib stays in deps/.
    let deps = debug.join("deps").join("libsuanli_plugin_fake.so");
    assert!(deps.exists(), "{} is missing: run `cargo build --workspace` first", so.display());
    deps
}

/// `n` servers with a `default` queue of unlimited quota; the leader's address.
pub async fn cluster(n: usize) -> (ProcessCluster, String) {
    cluster_with(n, &[]).await
}

/// As [`cluster`], with `extra` flags for every server (e.g. `--config FILE`).
pub async fn cluster_with(n: usize, extra: &[&str]) -> (ProcessCluster, String) {
    let c = ProcessCluster::start(&bin(), n, extra).unwrap();
    let leader = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let addr = c.addrs[leader].clone();
    let q = serde_json::json!({"id": "default", "nominal": {"cpu_milli": u64::MAX, "memory_mib": u64::MAX,
        "gpu_milli": u64::MAX, "npu_milli": u64::MAX}});
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = async {
            QueuesClient::new(channel(&addr).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?)
                .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
                .await
        }
        .await;
        match r {
            Ok(_) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "creating the default queue: {e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    (c, addr)
}

/// A fake device plugin config: `gpus` GPUs in NVLink islands of `island` (0: none) and `npus` NPUs.
pub fn fake_config(gpus: u32, island: u32, npus: u32) -> String {
    let mut s = String::new();
    if gpus > 0 {
        s += &format!(
            "[[groups]]\ncount = {gpus}\nkind = \"gpu\"\nmodel = \"A100-80G\"\nmemory_mib = 81920\nid_prefix = \"gpu\"\n"
        );
        if island > 0 {
            s += &format!("island_size = {island}\n");
        }
    }
    if npus > 0 {
        s += &format!(
            "[[groups]]\ncount = {npus}\nkind = \"npu\"\nmodel = \"Ascend910B\"\nmemory_mib = 65536\nid_prefix = \"npu\"\npeer_group = 7\n"
        );
    }
    s
}

/// One `suanli agent` process with its own data dir, plugin dir (a private copy of the fake
/// plugin) and fake device config.
pub struct AgentProc {
    /// The node id it registers as.
    pub node_id: String,
    dir: tempfile::TempDir,
    data: PathBuf,
    child: Option<Child>,
}

impl AgentProc {
    /// Prepares (does not start) an agent for `node_id` against `servers`, with the fake
    /// devices of `fake` and extra TOML lines for the agent config. It dials with node
    /// `node_id`'s certificate from the local PKI (`[tls]`), unless `extra` says
    /// `insecure = true` (for servers started `--insecure`).
    pub fn new(node_id: &str, servers: &[String], fake: &str, extra: &str) -> AgentProc {
        AgentProc::with_data_dir(node_id, servers, fake, extra, None)
    }

    /// As [`AgentProc::new`], with the data directory at `data` (default: `data` in the
    /// agent's temporary directory).
    pub fn with_data_dir(node_id: &str, servers: &[String], fake: &str, extra: &str, data: Option<&Path>) -> AgentProc {
        let keep = std::env::var_os("SUANLI_KEEP_CLUSTER_DIR").is_some();
        let dir = tempfile::Builder::new().prefix("suanli-agent-").disable_cleanup(keep).tempdir().unwrap();
        if keep {
            eprintln!("keeping agent {node_id}'s directory {}", dir.path().display());
        }
        let plugins = dir.path().join("plugins");
        std::fs::create_dir(&plugins).unwrap();
        let so = plugins.join("libsuanli_plugin_fake.so");
        std::fs::copy(fake_so(), &so).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&so, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&plugins, std::fs::Permissions::from_mode(0o755)).unwrap();
        let fake_path = dir.path().join("fake.toml");
        std::fs::write(&fake_path, fake).unwrap();
        let servers: Vec<String> = servers.iter().map(|s| format!("{s:?}")).collect();
        let data = data.map_or_else(|| dir.path().join("data"), Path::to_path_buf);
        let insecure = extra.lines().any(|l| l.split_whitespace().collect::<String>() == "insecure=true");
        let tls = if insecure {
            String::new()
        } else {
            let f = LocalPki::get().node(node_id);
            format!(
                "[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
                f.ca.display().to_string(),
                f.cert.display().to_string(),
                f.key.display().to_string()
            )
        };
        let toml = format!(
            r#"servers = [{servers}]
node_id = "{node_id}"
data_dir = "{data}"
plugin_dir = "{plugins}"
plugins = ["fake"]
cpu_milli = 64000
memory_mib = 65536
stop_grace_min_ms = 1000
retry_backoff_min_ms = 50
retry_backoff_max_ms = 500
cgroups = false
{extra}
[plugin_config.fake]
config_path = "{fake}"
{tls}"#,
            servers = servers.join(", "),
            data = data.display(),
            plugins = plugins.display(),
            fake = fake_path.display(),
        );
        std::fs::write(dir.path().join("agent.toml"), toml).unwrap();
        AgentProc { node_id: node_id.to_owned(), dir, data, child: None }
    }

    /// Adds a second plugin library as `libsuanli_plugin_<name>.so` (a private copy, mode 0755)
    /// and loads it beside the fake plugin (takes effect at the next start).
    pub fn add_plugin(&self, so: &Path, name: &str) {
        use std::os::unix::fs::PermissionsExt as _;
        let dst = self.dir.path().join("plugins").join(format!("libsuanli_plugin_{name}.so"));
        std::fs::copy(so, &dst).unwrap();
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cfg = self.dir.path().join("agent.toml");
        let text = std::fs::read_to_string(&cfg).unwrap();
        let text = text.replacen("plugins = [\"fake\"", &format!("plugins = [\"fake\", {name:?}"), 1);
        std::fs::write(&cfg, text).unwrap();
    }

    /// The agent's own temporary directory (its config, plugins, log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The agent's data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.data.clone()
    }

    /// Starts (or restarts) the agent process; its stderr goes to `agent.log` (appended).
    pub fn start(&mut self) {
        self.start_with(|_| {});
    }

    /// As [`AgentProc::start`], letting `f` adjust the command first (environment, ...).
    pub fn start_with(&mut self, f: impl FnOnce(&mut Command)) {
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("agent.log")).unwrap();
        let mut cmd = Command::new(bin());
        f(&mut cmd);
        let child = cmd
            .arg("agent")
            .arg("--config")
            .arg(self.dir.path().join("agent.toml"))
            .env("SUANLI_LOG", std::env::var("SUANLI_LOG").unwrap_or_else(|_| "info".into()))
            .env_remove("SUANLI_AGENT_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// SIGKILL the agent (its tasks keep running).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The agent's pid.
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.as_ref().expect("the agent runs").id()).unwrap()
    }

    /// Sends signal `name` (`STOP`, `CONT`, ...) to the agent process.
    pub fn signal(&self, name: &str) {
        let pid = self.pid();
        let st = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status().unwrap();
        assert!(st.success(), "kill -{name} {pid}");
    }

    /// The node's task journal so far.
    pub fn journal(&self) -> Vec<suanli_agent::JournalEntry> {
        suanli_agent::read_journal(&self.data_dir().join("journal.jsonl")).unwrap()
    }

    /// The node's lease file, when there is one.
    pub fn lease(&self) -> Option<suanli_agent::Lease> {
        suanli_agent::Lease::read(&self.data_dir().join("lease")).ok()
    }

    /// Whether the agent process still runs.
    pub fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// Replaces the fake plugin's fault file atomically (`fake.faults.toml` next to its config).
    pub fn set_faults(&self, text: &str) {
        let tmp = self.dir.path().join(".faults.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("fake.faults.toml")).unwrap();
    }

    /// Removes the fault file (and its crash-once marker).
    pub fn clear_faults(&self) {
        let _ = std::fs::remove_file(self.dir.path().join("fake.faults.toml"));
        let _ = std::fs::remove_file(self.dir.path().join("fake.faults.toml.crashed"));
    }

    /// Kills the process groups of tasks this agent started that still run.
    pub fn kill_tasks(&self) {
        let Ok(rd) = std::fs::read_dir(self.data_dir().join("allocs")) else {
            return;
        };
        for e in rd.filter_map(Result::ok) {
            let rec: Option<suanli_agent::TaskRecord> =
                std::fs::read(e.path().join("task.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
            if let Some(r) = rec
                && r.shim.alive()
            {
                let _ = suanli_agent::sys::kill_group(r.shim.pid, 9);
            }
        }
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.kill();
        self.kill_tasks();
    }
}

/// Every node, linearizably.
pub async fn nodes(addr: &str) -> Vec<pb::NodeInfo> {
    let ch = channel(addr).await.unwrap();
    NodesClient::new(ch)
        .list(pb::ListNodesRequest { pool: String::new(), stale: false, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .nodes
}

/// Waits until `f` holds for the node list; the last list is in the panic message otherwise.
pub async fn wait_nodes(
    addr: &str,
    within: Duration,
    what: &str,
    f: impl Fn(&[pb::NodeInfo]) -> bool,
) -> Vec<pb::NodeInfo> {
    let deadline = Instant::now() + within;
    loop {
        let n = nodes(addr).await;
        if f(&n) {
            return n;
        }
        assert!(Instant::now() < deadline, "{what} not within {within:?}; nodes: {n:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether node `id` is ready with `devices` devices, all healthy.
pub fn ready_healthy(n: &[pb::NodeInfo], id: &str, devices: usize) -> bool {
    n.iter().any(|x| {
        x.id == id
            && x.status == "ready"
            && x.devices.len() == devices
            && x.devices.iter().all(|d| d.health == "healthy")
    })
}

/// Submits a job spec (JSON); its id.
pub async fn submit(addr: &str, rid: &str, spec: &serde_json::Value) -> u64 {
    let mut c = JobsClient::new(channel(addr).await.unwrap());
    let req = pb::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: rid.into(),
        spec_json: spec.to_string(),
        retry: None,
    };
    c.submit(req).await.unwrap_or_else(|e| panic!("submitting {spec}: {e:?}")).into_inner().job_id
}

/// One job.
pub async fn job(addr: &str, id: u64) -> pb::JobInfo {
    let mut c = JobsClient::new(channel(addr).await.unwrap());
    c.get(pb::GetJobRequest { job_id: id, stale: false }).await.unwrap().into_inner()
}

/// Waits until `f` holds of job `id` (looked at every 100 ms); its last look.
pub async fn wait_job(
    addr: &str,
    id: u64,
    within: Duration,
    what: &str,
    f: impl Fn(&pb::JobInfo) -> bool,
) -> pb::JobInfo {
    let deadline = Instant::now() + within;
    loop {
        let j = job(addr, id).await;
        if f(&j) {
            return j;
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}; job: {j:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts one agent per node id in `nodes`, each with the fake device config `fake`, and
/// waits until all are registered and ready.
pub async fn start_agents(addr: &str, nodes: &[&str], fake: &str) -> Vec<AgentProc> {
    let mut agents: Vec<AgentProc> =
        nodes.iter().map(|n| AgentProc::new(n, std::slice::from_ref(&addr.to_owned()), fake, "")).collect();
    for a in &mut agents {
        a.start();
    }
    wait_nodes(addr, Duration::from_secs(30), "every agent registered", |n| {
        nodes.iter().all(|id| n.iter().any(|x| x.id == *id && x.status == "ready"))
    })
    .await;
    agents
}

/// Waits until every job in `ids` is in a terminal state; the jobs, by id.
pub async fn wait_terminal(addr: &str, ids: &[u64], within: Duration) -> BTreeMap<u64, pb::JobInfo> {
    let deadline = Instant::now() + within;
    loop {
        let mut out = BTreeMap::new();
        for &id in ids {
            out.insert(id, job(addr, id).await);
        }
        let open: Vec<_> = out
            .values()
            .filter(|j| !matches!(j.state.as_str(), "succeeded" | "failed" | "cancelled"))
            .map(|j| (j.id, j.state.clone(), j.reason.clone()))
            .collect();
        if open.is_empty() {
            return out;
        }
        assert!(Instant::now() < deadline, "jobs not finished within {within:?}: {open:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The task script: appends a start line to `$REC`, prints to stdout, sleeps `$NAP`, appends an
/// end line. Fields: S|E job attempt task node ns devices cuda ascend.
pub const RECORD_SCRIPT: &str = r#"line() { echo "$1 $SUANLI_JOB_ID $SUANLI_ATTEMPT $SUANLI_TASK $SUANLI_NODE $(date +%s%N) ${SUANLI_DEVICES:--} ${CUDA_VISIBLE_DEVICES:--} ${ASCEND_RT_VISIBLE_DEVICES:--}" >> "$REC"; }
line S
echo "hello from job $SUANLI_JOB_ID task $SUANLI_TASK"
sleep "$NAP"
line E"#;

/// A job spec whose single group runs [`RECORD_SCRIPT`].
pub fn record_job(
    name: &str,
    rec: &Path,
    nap_s: f64,
    replicas: u32,
    gang: bool,
    devices: Option<(&str, u32, u32)>,
) -> serde_json::Value {
    let mut resources = serde_json::json!({"cpu_milli": 100, "memory_mib": 64});
    if let Some((kind, count, milli)) = devices {
        resources["devices"] = serde_json::json!({"kind": kind, "count": count, "milli": milli,
            "memory_mib": if milli < 1000 { 20480 } else { 0 }});
    }
    serde_json::json!({
        "name": name,
        "queue": "default",
        "gang": gang,
        "groups": [{
            "name": "main",
            "replicas": replicas,
            "resources": resources,
            "task": {"command": "/bin/sh", "args": ["-c", RECORD_SCRIPT],
                     "env": {"REC": rec.display().to_string(), "NAP": format!("{nap_s}")}}
        }]
    })
}

/// One line of the record file.
#[derive(Debug, Clone)]
pub struct Line {
    /// `S` (started) rather than `E` (ended).
    pub start: bool,
    /// `$SUANLI_JOB_ID`.
    pub job: u64,
    /// `$SUANLI_ATTEMPT`.
    pub attempt: u64,
    /// `$SUANLI_TASK`.
    pub task: String,
    /// `$SUANLI_NODE`.
    pub node: String,
    /// Wall-clock nanoseconds (`date +%s%N`).
    pub ns: u128,
    /// `device:milli` pairs.
    pub devices: Vec<(String, u32)>,
    /// `$CUDA_VISIBLE_DEVICES` (`-`: unset).
    pub cuda: String,
    /// `$ASCEND_RT_VISIBLE_DEVICES` (`-`: unset).
    pub ascend: String,
}

/// Parses the record file.
pub fn read_lines(rec: &Path) -> Vec<Line> {
    let text = std::fs::read_to_string(rec).unwrap_or_default();
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!(f.len(), 9, "malformed record line {l:?}");
            let devices = if f[6] == "-" {
                Vec::new()
            } else {
                f[6].split(',')
                    .map(|d| {
                        let (id, m) = d.rsplit_once(':').unwrap();
                        (id.to_owned(), m.parse().unwrap())
                    })
                    .collect()
            };
            Line {
                start: f[0] == "S",
                job: f[1].parse().unwrap(),
                attempt: f[2].parse().unwrap(),
                task: f[3].to_owned(),
                node: f[4].to_owned(),
                ns: f[5].parse().unwrap(),
                devices,
                cuda: f[7].to_owned(),
                ascend: f[8].to_owned(),
            }
        })
        .collect()
}
