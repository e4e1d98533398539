//! `suanli agent` (the node agent) and the hidden `suanli task-shim`. Configuration layers:
//! defaults, then the TOML file (`--config`), then `SUANLI_AGENT_*` environment variables and
//! flags for the common fields.

use anyhow::Result;
use std::path::PathBuf;
use suanli_agent::AgentConfig;

/// `suanli agent` (each flag also read from the environment variable shown).
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// Configuration file (TOML; every field of the agent's configuration, see docs/agent.md).
    #[arg(long, env = "SUANLI_AGENT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Control-plane servers, HOST:PORT, comma-separated.
    #[arg(long, env = "SUANLI_AGENT_SERVERS", value_delimiter = ',')]
    pub servers: Vec<String>,
    /// This node's id (default: the host name).
    #[arg(long, env = "SUANLI_AGENT_NODE_ID")]
    pub node_id: Option<String>,
    /// The resource pool the node joins.
    #[arg(long, env = "SUANLI_AGENT_POOL")]
    pub pool: Option<String>,
    /// Where allocation directories and the agent's state live.
    #[arg(long, env = "SUANLI_AGENT_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Directory of device plugin libraries.
    #[arg(long, env = "SUANLI_AGENT_PLUGIN_DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Address of the task log service (IP:PORT; port 0 picks one).
    #[arg(long, env = "SUANLI_AGENT_LISTEN")]
    pub listen: Option<String>,
    /// TLS files from a `suanli tls init` directory: DIR/ca.pem, DIR/node-<node id>.pem and
    /// DIR/node-<node id>-key.pem (replaces the config's `[tls]`).
    #[arg(long, env = "SUANLI_AGENT_TLS_DIR", conflicts_with = "insecure")]
    pub tls_dir: Option<PathBuf>,
    /// Plaintext, no identities: only for servers started --insecure (a warning at every start).
    #[arg(long, env = "SUANLI_AGENT_INSECURE")]
    pub insecure: bool,
}

impl AgentArgs {
    /// The layered configuration, validated.
    pub fn config(&self) -> Result<AgentConfig> {
        let mut c = match &self.config {
            Some(p) => AgentConfig::from_file(p)?,
            None => AgentConfig::default(),
        };
        let servers: Vec<String> = self.servers.iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect();
        if !servers.is_empty() {
            c.servers = servers;
        }
        if let Some(v) = &self.node_id {
            c.node_id = v.clone();
        }
        if let Some(v) = &self.pool {
            c.pool = v.clone();
        }
        if let Some(v) = &self.data_dir {
            c.data_dir = v.clone();
        }
        if let Some(v) = &self.plugin_dir {
            c.plugin_dir = v.clone();
        }
        if let Some(v) = &self.listen {
            c.listen = v.clone();
        }
        if let Some(d) = &self.tls_dir {
            c.tls = Some(AgentConfig::tls_dir_files(d, &c.node_id));
            c.insecure = false;
        }
        if self.insecure {
            c.tls = None;
            c.insecure = true;
        }
        c.validate()?;
        Ok(c)
    }
}

/// `suanli task-shim` (started by the agent only).
#[derive(clap::Args, Debug)]
pub struct TaskShimArgs {
    /// The allocation directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// Rotate each log file at this size (bytes).
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_log_bytes: u64,
    /// A cgroup v2 directory to join before starting the command.
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// Working directory of the command (default: --dir).
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// The node's task journal: append a start and a stop line (identity from DIR/alloc.json).
    #[arg(long)]
    pub journal: Option<PathBuf>,
    /// The agent's lease file: do not start without a fresh lease, and SIGTERM then SIGKILL the
    /// task when it expires (absent: never fenced).
    #[arg(long)]
    pub lease: Option<PathBuf>,
    /// Disk quota of the task's files in DIR, logs not counted (bytes; 0: none): measured every
    /// 2 s, over it the task is stopped and fails with "disk quota exceeded: …".
    #[arg(long, default_value_t = 0)]
    pub disk_max_bytes: u64,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Runs the agent until SIGTERM or Ctrl-C.
pub fn run(a: AgentArgs) -> Result<()> {
    let cfg = a.config()?;
    crate::logging::init_traced(
        "info",
        crate::logging::Service {
            name: "suanli-agent",
            instance: cfg.node_id.clone(),
            config_endpoint: cfg.telemetry.otlp_endpoint.as_deref(),
            config_key: "telemetry.otlp_endpoint",
        },
    )?;
    if suanli_server::telemetry::enabled() {
        suanli_agent::telemetry::set_enabled(true);
    }
    let rt = crate::serve::runtime()?;
    let r = rt.block_on(suanli_agent::run(cfg, crate::serve::shutdown_signal()));
    // Plugin hosts and in-flight calls may hold runtime threads; tasks are separate processes.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    crate::logging::shutdown();
    r?;
    Ok(())
}

/// Runs the task shim.
pub fn shim(a: TaskShimArgs) -> std::process::ExitCode {
    let mut it = a.command.into_iter();
    let Some(command) = it.next() else {
        eprintln!("suanli task-shim: no command after --");
        return std::process::ExitCode::from(2);
    };
    suanli_agent::shim::run(suanli_agent::ShimArgs {
        dir: a.dir,
        max_log_bytes: a.max_log_bytes,
        cgroup: a.cgroup,
        workdir: a.workdir,
        journal: a.journal,
        lease: a.lease,
        disk_max_bytes: a.disk_max_bytes,
        command,
        args: it.collect(),
    })
}
