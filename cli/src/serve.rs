//! `suanli server` (one control-plane server) and `suanli dev` (a local cluster in one
//! command). Configuration layers: defaults, then the TOML file (`--config`), then
//! environment variables (`SUANLI_*`), then flags.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use suanli_server::{Peer, ServerConfig};

/// Flags of `suanli server` (each also read from the environment variable shown).
#[derive(Args, Debug, Clone, Default)]
pub struct ServerArgs {
    /// TOML configuration file (every field of the server's configuration; flags win over it).
    #[arg(long, env = "SUANLI_CONFIG")]
    pub config: Option<PathBuf>,
    /// This server's raft id (>= 1, unique, never reused).
    #[arg(long, env = "SUANLI_ID")]
    pub id: Option<u64>,
    /// Address to listen on (IP:PORT) for clients, agents and other servers.
    #[arg(long, env = "SUANLI_LISTEN")]
    pub listen: Option<String>,
    /// Address the others reach this server at (default: --listen).
    #[arg(long, env = "SUANLI_ADVERTISE")]
    pub advertise: Option<String>,
    /// Where the raft log, snapshots and state live.
    #[arg(long, env = "SUANLI_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Initial voters of a new cluster, ID=HOST:PORT, comma-separated (this server included).
    #[arg(long, env = "SUANLI_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Join a running cluster through this server instead.
    #[arg(long, env = "SUANLI_JOIN")]
    pub join: Option<String>,
    /// With --join: stay a non-voting learner.
    #[arg(long)]
    pub learner_only: bool,
    /// Placement policy (suanli, fgd, bestfit, dotprod, gpupacking, gpuclustering, random).
    #[arg(long, env = "SUANLI_POLICY")]
    pub policy: Option<String>,
    /// Declare a node down after this long without a heartbeat.
    #[arg(long, env = "SUANLI_HEARTBEAT_TTL_MS")]
    pub heartbeat_ttl_ms: Option<u64>,
}

impl ServerArgs {
    /// The layered configuration, validated.
    pub fn config(&self) -> Result<ServerConfig> {
        let mut c = match &self.config {
            Some(p) => ServerConfig::from_file(p)?,
            None => ServerConfig::default(),
        };
        if let Some(v) = self.id {
            c.id = v;
        }
        if let Some(v) = &self.listen {
            c.listen = v.clone();
        }
        if let Some(v) = &self.advertise {
            c.advertise = Some(v.clone());
        }
        if let Some(v) = &self.data_dir {
            c.data_dir = v.clone();
        }
        if !self.peers.is_empty() {
            c.peers =
                self.peers.iter().filter(|p| !p.trim().is_empty()).map(|p| Peer::parse(p)).collect::<Result<_, _>>()?;
        }
        if let Some(v) = &self.join {
            c.join = Some(v.clone());
        }
        if self.learner_only {
            c.learner_only = true;
        }
        if let Some(v) = &self.policy {
            c.policy = v.clone();
        }
        if let Some(v) = self.heartbeat_ttl_ms {
            c.heartbeat_ttl_ms = v;
        }
        c.validate()?;
        Ok(c)
    }
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SUANLI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

/// `suanli server`.
pub fn server(args: ServerArgs) -> Result<()> {
    let cfg = args.config()?;
    init_logging("info,openraft=warn");
    runtime()?.block_on(suanli_server::serve(cfg, shutdown_signal()))?;
    Ok(())
}

/// Flags of `suanli dev`.
#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// Data directory of the development server (kept between runs; delete it to start over).
    #[arg(long, env = "SUANLI_DEV_DIR", default_value = ".suanli/dev")]
    pub data_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub listen: String,
}

/// `suanli dev`: one server on an embedded default data directory, with a `default` queue.
pub fn dev(args: DevArgs) -> Result<()> {
    // No agents run in dev yet (nodes are registered by hand and send no heartbeats), so a
    // node is kept for a day without one instead of the production 10 s.
    let cfg = ServerConfig {
        data_dir: args.data_dir,
        listen: args.listen.clone(),
        heartbeat_ttl_ms: 24 * 3600 * 1000,
        ..ServerConfig::default()
    };
    cfg.validate()?;
    init_logging("info,openraft=warn");
    let rt = runtime()?;
    rt.block_on(async move {
        let server = tokio::spawn(suanli_server::serve(cfg, shutdown_signal()));
        if let Err(e) = ensure_default_queue(&args.listen).await {
            tracing::warn!(error = %e, "could not create the default queue");
        } else {
            eprintln!(
                "suanli dev: serving on {} (data in the dev directory). Try:\n  suanli job submit examples/jobs/cpu-batch.toml --server {}\n  suanli job list --server {}\nCtrl-C stops it.",
                args.listen, args.listen, args.listen
            );
        }
        server.await.context("server task")??;
        Ok(())
    })
}

async fn ensure_default_queue(addr: &str) -> Result<()> {
    use suanli_proto::v1::cluster_client::ClusterClient;
    use suanli_proto::v1::queues_client::QueuesClient;
    let uri = format!("http://{addr}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // Wait until the server is up and has elected itself.
    loop {
        if let Ok(mut c) = ClusterClient::connect(uri.clone()).await
            && let Ok(r) = c.leader(suanli_proto::v1::LeaderRequest {}).await
            && r.into_inner().leader_id != 0
        {
            break;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "the dev server did not elect itself within 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut q = QueuesClient::connect(uri).await?;
    let exists = q.get(suanli_proto::v1::GetQueueRequest { id: "default".into(), stale: false }).await.is_ok();
    if !exists {
        let queue = suanli_model::Queue::new("default", suanli_model::ResVec::MAX);
        q.upsert(suanli_proto::v1::UpsertQueueRequest { queue_json: serde_json::to_string(&queue)? }).await?;
    }
    Ok(())
}
