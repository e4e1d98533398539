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
    /// The client listener (IP:PORT): the public API and agents.
    #[arg(long, env = "SUANLI_LISTEN")]
    pub listen: Option<String>,
    /// Address clients and agents reach this server at (default: --listen).
    #[arg(long, env = "SUANLI_ADVERTISE")]
    pub advertise: Option<String>,
    /// The peer listener (IP:PORT): raft and server-to-server calls only (default: --listen's
    /// port + 1). Keep it on a network only the servers reach.
    #[arg(long, env = "SUANLI_PEER_LISTEN")]
    pub peer_listen: Option<String>,
    /// Address the other servers reach the peer listener at (default: --peer-listen).
    #[arg(long, env = "SUANLI_PEER_ADVERTISE")]
    pub peer_advertise: Option<String>,
    /// The HTTP listener (IP:PORT): /metrics and the dashboard (default: --listen's port + 2;
    /// "off": none).
    #[arg(long, env = "SUANLI_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    /// Where the raft log, snapshots and state live.
    #[arg(long, env = "SUANLI_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Initial voters of a new cluster, ID=HOST:PORT[/PEER_HOST:PEER_PORT], comma-separated
    /// (this server included; the peer address defaults to the client port + 1).
    #[arg(long, env = "SUANLI_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Create a new cluster if the storage is empty (alone, or with --peers: the smallest id
    /// does). Without it an empty server waits to be added or --join's: a wiped server never
    /// starts a second cluster.
    #[arg(long)]
    pub bootstrap: bool,
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
    /// Calls per second one user (or one anonymous address) may make, sustained (the config's
    /// `rate_limit_per_s`; 0: no limit). Local test clusters run with 0: every harness call is
    /// the one admin.
    #[arg(long, env = "SUANLI_RATE_LIMIT_PER_S")]
    pub rate_limit_per_s: Option<u32>,
    /// Serve TLS with the files of DIR (`suanli tls init DIR`'s layout): DIR/ca.pem,
    /// DIR/server.pem, DIR/server-key.pem (the configuration file's `[tls]` otherwise).
    #[arg(long, value_name = "DIR", conflicts_with = "insecure")]
    pub tls_dir: Option<PathBuf>,
    /// Serve plaintext with no identities: anyone who reaches a port is admin (a warning says
    /// so at every start). Only for a trusted network or a throwaway cluster.
    #[arg(long)]
    pub insecure: bool,
    /// This region's name in the federation (`[federation] region`: 1..=64 of `[a-z0-9-]`).
    #[arg(long, env = "SUANLI_REGION", value_name = "NAME")]
    pub region: Option<String>,
    /// The federation servers' addresses (`[federation] endpoints`); with `--region`.
    #[arg(long, env = "SUANLI_FEDERATION", value_name = "ADDR[,ADDR]", value_delimiter = ',')]
    pub federation: Vec<String>,
    /// A region label for data-locality preferences, `KEY=VALUE` (`[federation] labels`);
    /// repeatable.
    #[arg(long = "region-label", value_name = "KEY=VALUE")]
    pub region_labels: Vec<String>,
}

impl ServerArgs {
    /// Applies `--region`, `--federation` and `--region-label` over the file's `[federation]`.
    fn federation_flags(&self, c: &mut ServerConfig) -> Result<()> {
        let endpoints: Vec<String> =
            self.federation.iter().map(|e| e.trim().to_owned()).filter(|e| !e.is_empty()).collect();
        if self.region.is_none() && endpoints.is_empty() && self.region_labels.is_empty() {
            return Ok(());
        }
        let mut f = c.federation.take().unwrap_or_default();
        if let Some(r) = &self.region {
            f.region = r.clone();
        }
        if !endpoints.is_empty() {
            f.endpoints = endpoints;
        }
        for l in &self.region_labels {
            let Some((k, v)) = l.split_once('=') else {
                anyhow::bail!("--region-label: {l:?} is not KEY=VALUE");
            };
            f.labels.insert(k.trim().to_owned(), v.trim().to_owned());
        }
        if f.region.is_empty() {
            anyhow::bail!("--federation and --region-label need --region NAME (or [federation] region in the config)");
        }
        if f.endpoints.is_empty() {
            anyhow::bail!("--region needs --federation ADDR[,ADDR] (or [federation] endpoints in the config)");
        }
        c.federation = Some(f);
        Ok(())
    }

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
        if let Some(v) = &self.peer_listen {
            c.peer_listen = Some(v.clone());
        }
        if let Some(v) = &self.peer_advertise {
            c.peer_advertise = Some(v.clone());
        }
        if let Some(v) = &self.http_listen {
            c.http_listen = Some(v.clone());
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
        if self.bootstrap {
            c.bootstrap = true;
        }
        if self.learner_only {
            c.learner_only = true;
        }
        if let Some(v) = &self.policy {
            c.policy = v.clone();
        }
        if let Some(v) = self.rate_limit_per_s {
            c.rate_limit_per_s = v;
        }
        if let Some(v) = self.heartbeat_ttl_ms {
            c.heartbeat_ttl_ms = v;
        }
        if let Some(dir) = &self.tls_dir {
            c.tls = Some(ServerConfig::tls_files_in(dir));
        }
        if self.insecure {
            c.insecure = true;
        }
        self.federation_flags(&mut c)?;
        c.validate()?;
        Ok(c)
    }
}

/// Logs to stderr, filtered by `SUANLI_LOG` (default `default`), in `--log-format`.
pub(crate) fn init_logging(default: &str) {
    crate::logging::init(default);
}

/// Resolves on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
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

/// The multi-threaded runtime of the long-running commands.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

/// Exit status of `suanli server` when the cluster removed it from its membership (it
/// stepped down first); other errors exit with 2. A supervisor should not restart it
/// (systemd: `RestartPreventExitStatus=3`).
pub const EXIT_REMOVED: u8 = 3;

/// `suanli server`: on the first SIGTERM/SIGINT it steps down (bounded, see
/// `suanli_server::serve`); a second one exits at once.
pub fn server(args: ServerArgs) -> Result<()> {
    let cfg = args.config()?;
    crate::logging::init_traced(
        "info,openraft=warn",
        crate::logging::Service {
            name: "suanli-server",
            instance: format!("server-{}@{}", cfg.id, cfg.listen),
            config_endpoint: cfg.telemetry.otlp_endpoint.as_deref(),
            config_key: "telemetry.otlp_endpoint",
        },
    )?;
    let rt = runtime()?;
    let first = async {
        shutdown_signal().await;
        tokio::spawn(async {
            shutdown_signal().await;
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        });
    };
    let r = rt.block_on(async move {
        let listeners = suanli_server::Listeners::bind(&cfg).await?;
        announce(&listeners)?;
        anyhow::Ok(suanli_server::serve(listeners, cfg, first).await?)
    });
    // Connections still open after the grace period are dropped with the runtime.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    crate::logging::shutdown();
    r?;
    Ok(())
}

/// Prints the bound addresses on stdout (`suanli server listening client=A peer=B`, flushed):
/// with port 0 in `--listen`/`--peer-listen`, how whoever started the server learns its ports
/// without probing them (docs/control-plane.md, "Listeners").
fn announce(listeners: &suanli_server::Listeners) -> std::io::Result<suanli_server::Bound> {
    use std::io::Write as _;
    let bound = listeners.bound()?;
    let mut out = std::io::stdout().lock();
    // A closed stdout (a supervisor that discards it) is no reason not to serve.
    let _ = writeln!(out, "{}", bound.line()).and_then(|()| out.flush());
    Ok(bound)
}

/// Flags of `suanli dev`.
#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// Data directory of the development cluster (kept between runs; delete it to start over).
    #[arg(long, env = "SUANLI_DEV_DIR", default_value = ".suanli/dev")]
    pub data_dir: PathBuf,
    /// Address the server listens on (port 0: the system picks one, printed at start; the
    /// peer listener takes the next port, or another picked one with port 0).
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub listen: String,
    /// Start no agents (only the server, as before agents existed).
    #[arg(long)]
    pub no_agents: bool,
    /// Where the device plugin libraries are (default: next to this binary, as cargo builds them).
    #[arg(long)]
    pub plugin_dir: Option<PathBuf>,
    /// Start N regions (3 servers each, one fake-GPU agent each) under a federation of 3 voters
    /// instead of the single server (1..=8; docs/federation.md). Their state starts fresh on
    /// every run, under `<data dir>/regions`; the federation's addresses are written to
    /// `<data dir>/federation` (the CLI's default `--federation`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=8))]
    pub regions: Option<u16>,
}

/// The fake devices of the two dev nodes.
const FAKE_8GPU: &str = include_str!("../../examples/plugins/fake-8gpu.toml");
const FAKE_4NPU: &str = include_str!("../../examples/plugins/fake-4npu.toml");

/// The dev nodes' ids.
const DEV_NODES: [&str; 2] = ["dev-gpu", "dev-npu"];

/// The dev cluster's certificates in `dir` (`suanli tls init`'s layout): made on the first run
/// (a CA, the server's certificate for the loopback names and `listen`'s host, the admin's, and
/// each dev node's); a later run keeps them and only issues the leaves that are missing.
fn dev_pki(dir: &std::path::Path, listen: &str, more_nodes: &[String]) -> Result<()> {
    use suanli_security::certs::{self, Leaf};
    let mut hosts: Vec<String> = certs::DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect();
    if let Some((host, _)) = listen.rsplit_once(':') {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let unspecified = host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified());
        if !host.is_empty() && !unspecified && !hosts.iter().any(|h| h == host) {
            hosts.push(host.to_owned());
        }
    }
    let admin = suanli_security::Principal::User {
        name: "admin".into(),
        role: suanli_security::Role::Admin,
        team: None,
        credential: suanli_security::principal::Credential::Certificate,
    };
    let mut leaves = vec![Leaf::server("server", &hosts), Leaf::user(admin)];
    leaves.extend(DEV_NODES.iter().map(|n| Leaf::node(n, &hosts)));
    leaves.extend(more_nodes.iter().map(|n| Leaf::node(n, &hosts)));
    if !dir.join("ca.pem").exists() {
        certs::init(dir, &leaves, certs::DEFAULT_VALIDITY)
            .with_context(|| format!("creating the dev certificates in {}", dir.display()))?;
        eprintln!("suanli dev: made a development CA and certificates in {}", dir.display());
        return Ok(());
    }
    for leaf in &leaves {
        let files = certs::paths(dir, &leaf.stem);
        if !files.cert.exists() || !files.key.exists() {
            certs::issue(dir, leaf, certs::DEFAULT_VALIDITY)
                .with_context(|| format!("issuing {} in {}", leaf.stem, dir.display()))?;
        }
    }
    Ok(())
}

/// `suanli dev`: one server on an embedded default data directory with a `default` queue, and
/// two agents with fake devices: `dev-gpu` (8 fake 80 GB GPUs in two NVLink islands) and
/// `dev-npu` (4 fake NPUs), both with the cpu plugin. Checkpoints go to one directory both
/// agents share (`<data dir>/checkpoints`), so a job restores on either node. Every link is
/// mutual TLS with the certificates in `<data dir>/tls` (made on the first run); the CLI finds
/// them there when run from the same directory.
pub fn dev(args: DevArgs) -> Result<()> {
    if let Some(n) = args.regions {
        return dev_regions(&args, usize::from(n));
    }
    let tls_dir = args.data_dir.join("tls");
    dev_pki(&tls_dir, &args.listen, &[])?;
    let cfg = ServerConfig {
        data_dir: args.data_dir.join("server"),
        listen: args.listen.clone(),
        bootstrap: true,
        tls: Some(suanli_security::certs::paths(&tls_dir, "server")),
        ..ServerConfig::default()
    };
    cfg.validate()?;
    // With OTEL_EXPORTER_OTLP_ENDPOINT set, the dev server and its in-process agents export
    // the job-life spans (docs/tracing.md); one process, one service name.
    crate::logging::init_traced(
        "info,openraft=warn",
        crate::logging::Service {
            name: "suanli-dev",
            instance: format!("dev@{}", cfg.listen),
            config_endpoint: None,
            config_key: "telemetry.otlp_endpoint",
        },
    )?;
    if suanli_server::telemetry::enabled() {
        suanli_agent::telemetry::set_enabled(true);
    }
    let rt = runtime()?;
    rt.block_on(async move {
        // A port in use ends `suanli dev` at once, naming the field and the address.
        let listeners = suanli_server::Listeners::bind(&cfg).await?;
        let bound = announce(&listeners)?;
        let l = bound.client.to_string();
        let agents = if args.no_agents { Vec::new() } else { dev_agents(&args, &l, &tls_dir)? };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let mut server = tokio::spawn(suanli_server::serve(listeners, cfg, stopped(stop_rx.clone())));
        // A server that cannot start ends `suanli dev` at once, naming why.
        tokio::select! {
            r = &mut server => {
                r.context("server task")??;
                anyhow::bail!("the dev server stopped before it was ready");
            }
            r = ensure_dev_setup(&l, &args.data_dir, &tls_dir) => {
                if let Err(e) = r {
                    tracing::warn!(error = %format!("{e:#}"), "could not set up the dev cluster (default queue, checkpoint store)");
                }
            }
        }
        let mut handles = Vec::new();
        for a in agents {
            let id = a.node_id.clone();
            let h = tokio::spawn(suanli_agent::run(a, stopped(stop_rx.clone())));
            handles.push((id, h));
        }
        // The dashboard's address, with a viewer token so it opens with data (docs/dashboard.md).
        if let Some(http) = bound.http {
            eprintln!("suanli dev: dashboard {}", dev_dashboard_line(&l, &http.to_string(), &tls_dir).await);
        }
        // From the directory `suanli dev` runs in, the CLI finds ./.suanli/dev/tls by itself.
        let creds = if tls_dir == std::path::Path::new(crate::client::creds::DEV_TLS_DIR) {
            format!("the CLI run from this directory finds them; elsewhere: export SUANLI_TLS_DIR={}", abs(&tls_dir))
        } else {
            format!("export SUANLI_TLS_DIR={} for the CLI", abs(&tls_dir))
        };
        eprintln!(
            "suanli dev: server on {l}, agents {:?} (data in {}), mutual TLS with the certificates in {} ({creds}). Try:\n  suanli job submit examples/dev/hello-gpu.toml --server {l}\n  suanli job list --server {l}\n  suanli job logs <id> --server {l}\nCtrl-C stops it (running tasks are left to the agents' next start).",
            handles.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(),
            args.data_dir.display(),
            tls_dir.display(),
        );
        let mut ended = None;
        tokio::select! {
            () = shutdown_signal() => {}
            r = &mut server => {
                tracing::error!("the dev server stopped; stopping the agents");
                ended = Some(r);
            }
        }
        let _ = stop_tx.send(true);
        for (id, h) in handles {
            match h.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(agent = %id, error = %format!("{e:#}"), "agent stopped with an error"),
                Err(e) => tracing::warn!(agent = %id, error = %e, "agent task failed"),
            }
        }
        match ended {
            Some(r) => r.context("server task")??,
            None => server.await.context("server task")??,
        }
        Ok(())
    })
}

/// The two dev agents' configurations; copies the plugin libraries into the dev directory
/// (the agent refuses plugin files others can write) and writes the fake device files.
fn dev_agents(args: &DevArgs, server: &str, tls_dir: &std::path::Path) -> Result<Vec<suanli_agent::AgentConfig>> {
    let plugins = dev_plugins(args)?;
    let mut out = Vec::new();
    for (node, fake, text, cpu_milli, memory_mib) in [
        (DEV_NODES[0], "fake-8gpu.toml", FAKE_8GPU, 32_000, 256 * 1024),
        (DEV_NODES[1], "fake-4npu.toml", FAKE_4NPU, 16_000, 128 * 1024),
    ] {
        let dir = args.data_dir.join("agents").join(node);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let fake_path = dir.join(fake);
        if !fake_path.exists() {
            // Kept between runs, so faults written next to it by hand stay in force.
            std::fs::write(&fake_path, text)?;
        }
        out.push(dev_agent_config(
            node,
            "default",
            "dev",
            &[server.to_owned()],
            &dir,
            &plugins,
            fake_path,
            (cpu_milli, memory_mib),
            tls_dir,
        ));
    }
    Ok(out)
}

/// One dev agent's configuration: node `node` in `pool` and `region`, reaching `servers`,
/// with the fake and cpu plugins of `plugins` (the fake one reading `fake_path`), a fixed
/// slice of this machine's CPU and memory, and its certificate in `tls_dir`.
#[allow(clippy::too_many_arguments)]
fn dev_agent_config(
    node: &str,
    pool: &str,
    region: &str,
    servers: &[String],
    dir: &std::path::Path,
    plugins: &std::path::Path,
    fake_path: PathBuf,
    (cpu_milli, memory_mib): (u64, u64),
    tls_dir: &std::path::Path,
) -> suanli_agent::AgentConfig {
    let mut plugin_config = std::collections::BTreeMap::new();
    plugin_config.insert(
        "libsuanli_plugin_fake".to_owned(),
        // The fake GPUs model MPS-limited shares, as the NVIDIA plugin's are where MPS runs, so
        // a job may ask for `constraints.share_isolation = "enforced"` (docs/services.md).
        suanli_agent::PluginSettings {
            config_path: Some(fake_path),
            options: [("enforce_shares".to_owned(), "true".to_owned())].into_iter().collect(),
        },
    );
    suanli_agent::AgentConfig {
        servers: servers.to_vec(),
        node_id: node.into(),
        pool: pool.into(),
        region: region.into(),
        datacenter: format!("{region}-1"),
        data_dir: dir.to_owned(),
        plugin_dir: plugins.to_owned(),
        plugins: Some(vec!["libsuanli_plugin_fake".into(), "libsuanli_plugin_cpu".into()]),
        plugin_config,
        // Several nodes share this machine: each claims a fixed slice instead of all of it.
        cpu_milli: Some(cpu_milli),
        memory_mib: Some(memory_mib),
        tls: Some(suanli_agent::AgentConfig::tls_dir_files(tls_dir, node)),
        ..suanli_agent::AgentConfig::default()
    }
}

/// Copies the fake and cpu plugin libraries into `<data dir>/plugins` (the agent refuses
/// plugin files others can write); that directory.
fn dev_plugins(args: &DevArgs) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let src = match &args.plugin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()
            .context("locating the suanli binary")?
            .parent()
            .map(std::path::Path::to_path_buf)
            .context("the suanli binary has no directory")?,
    };
    let plugins = args.data_dir.join("plugins");
    std::fs::create_dir_all(&plugins).with_context(|| format!("creating {}", plugins.display()))?;
    std::fs::set_permissions(&plugins, std::fs::Permissions::from_mode(0o755))?;
    for name in ["libsuanli_plugin_fake.so", "libsuanli_plugin_cpu.so"] {
        let from = src.join(name);
        let to = plugins.join(name);
        // Copy to a temporary name and rename, so a running plugin-host keeps its mapping.
        let tmp = plugins.join(format!(".{name}.tmp"));
        std::fs::copy(&from, &tmp).with_context(|| {
            format!("copying the device plugin {} (build it with `cargo build --workspace`)", from.display())
        })?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&tmp, &to)?;
    }
    Ok(plugins)
}

/// The fake GPUs of a dev region's node: 4 of `model`.
fn dev_region_gpus(model: &str) -> String {
    format!("[[groups]]\ncount = 4\nkind = \"gpu\"\nmodel = \"{model}\"\nmemory_mib = 81920\nid_prefix = \"gpu\"\n")
}

/// The device model of dev region `i`'s GPUs (H100, A100-80G, H100, ...).
fn dev_region_model(i: usize) -> &'static str {
    if i % 2 == 1 { "A100-80G" } else { "H100" }
}

/// The file holding the dev federation's addresses (comma-separated, one line), which the CLI
/// reads as its default `--federation`.
pub const DEV_FEDERATION_FILE: &str = "federation";

/// `suanli dev --regions N`: N regions of 3 `suanli server` processes each (`us-east`,
/// `eu-west`, `ap-south`, then `region-4`...), under a federation of 3 voters (`suanli
/// federation serve`), with short lease terms; one in-process fake-GPU agent per region
/// (`<region>-gpu`, 4 fake H100 or A100-80G in pool `<region>-gpu`); every region has the
/// `default` queue and the shared checkpoint store `<data dir>/checkpoints`. All mutual TLS
/// with the dev certificates. The processes' data lives under `<data dir>/regions`, made fresh
/// on every run and removed at the end; Ctrl-C (or SIGTERM) stops the agents, then the servers.
fn dev_regions(args: &DevArgs, n: usize) -> Result<()> {
    use suanli_server::local::{FedTerms, FederatedCluster, LocalPki, RegionSpec, region_name};
    let names: Vec<String> = (0..n).map(region_name).collect();
    let nodes: Vec<String> = names.iter().map(|r| format!("{r}-gpu")).collect();
    let tls_dir = args.data_dir.join("tls");
    dev_pki(&tls_dir, &args.listen, &nodes)?;
    let pki = LocalPki::open(&tls_dir).with_context(|| format!("the dev certificates in {}", tls_dir.display()))?;
    let plugins = if args.no_agents { None } else { Some(dev_plugins(args)?) };
    let run = args.data_dir.join("regions");
    if run.exists() {
        std::fs::remove_dir_all(&run).with_context(|| format!("removing the previous run's {}", run.display()))?;
    }
    std::fs::create_dir_all(&run).with_context(|| format!("creating {}", run.display()))?;
    let bin = std::env::current_exe().context("locating the suanli binary")?;
    let specs: Vec<RegionSpec> = names.iter().map(|r| RegionSpec::new(r, 3)).collect();
    init_logging("info,openraft=warn");
    eprintln!("suanli dev: starting {n} regions of 3 servers and a federation of 3 voters (data in {})", run.display());
    let cluster = FederatedCluster::start(&bin, &specs, 3, FedTerms::SHORT, &pki, Some(&run))
        .context("starting the dev regions and federation")?;
    let fed = cluster.federation_addrs().join(",");
    let fed_file = args.data_dir.join(DEV_FEDERATION_FILE);
    std::fs::write(&fed_file, format!("{fed}\n")).with_context(|| format!("writing {}", fed_file.display()))?;
    let rt = runtime()?;
    let r = rt.block_on(async {
        let within = std::time::Duration::from_secs(60);
        cluster.default_queues(within).await.map_err(anyhow::Error::msg)?;
        let mut leaders = Vec::new();
        for (name, c) in &cluster.regions {
            let l = c.wait_leader(within).await.map_err(anyhow::Error::msg)?;
            ensure_dev_setup(&c.addrs[l], &args.data_dir, &tls_dir)
                .await
                .with_context(|| format!("setting up region {name} (default queue, checkpoint store)"))?;
            leaders.push(c.addrs[l].clone());
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut handles = Vec::new();
        if let Some(plugins) = &plugins {
            for (i, (name, c)) in cluster.regions.iter().enumerate() {
                let node = &nodes[i];
                let dir = run.join("agents").join(node);
                std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
                let fake_path = dir.join("fake-gpu.toml");
                std::fs::write(&fake_path, dev_region_gpus(dev_region_model(i)))?;
                let cfg = dev_agent_config(
                    node,
                    node,
                    name,
                    &c.addrs,
                    &dir,
                    plugins,
                    fake_path,
                    (16_000, 64 * 1024),
                    &tls_dir,
                );
                let mut rx = stop_rx.clone();
                let stopped = async move {
                    let _ = rx.wait_for(|s| *s).await;
                };
                handles.push((node.clone(), tokio::spawn(suanli_agent::run(cfg, stopped))));
            }
        }
        // One signal future for the whole run: a SIGTERM while the regions come up is not lost.
        let stop = shutdown_signal();
        tokio::pin!(stop);
        let healthy = tokio::select! {
            r = cluster.wait_healthy(within) => Some(r.map_err(anyhow::Error::msg)),
            () = &mut stop => None,
        };
        if let Some(Ok(dir)) = &healthy {
            let mut lines = vec![format!(
                "suanli dev: {n} regions under a federation, mutual TLS with the certificates in {} (export SUANLI_TLS_DIR={} for the CLI elsewhere)",
                tls_dir.display(),
                abs(&tls_dir)
            )];
            lines.push(format!("  federation: {fed} (in {}: the CLI's default --federation)", fed_file.display()));
            for (i, (name, c)) in cluster.regions.iter().enumerate() {
                let agent = if plugins.is_some() {
                    format!("agent {} with 4 fake {}", nodes[i], dev_region_model(i))
                } else {
                    "no agent".to_owned()
                };
                let pools = dir.regions.iter().find(|r| &r.name == name).map(|r| r.pools.join(",")).unwrap_or_default();
                lines.push(format!("  {name}: servers {} ({agent}; pools {pools})", c.addrs.join(",")));
            }
            for (name, c) in &cluster.regions {
                if let Some(http) = c.http_addrs.first().filter(|h| !h.is_empty()) {
                    let first = c.addrs.first().map_or("", String::as_str);
                    lines.push(format!("  {name} dashboard: {}", dev_dashboard_line(first, http, &tls_dir).await));
                }
            }
            lines.push("Try:".into());
            lines.push("  suanli federation regions".into());
            lines.push(format!(
                "  suanli job submit examples/federation/train-h100.toml --global --team default --server {}",
                leaders[0]
            ));
            lines.push("  suanli federation jobs".into());
            lines.push("Ctrl-C stops it (the regions' state is not kept).".into());
            eprintln!("{}", lines.join("\n"));
            stop.await;
        }
        let _ = stop_tx.send(true);
        for (id, h) in handles {
            match h.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(agent = %id, error = %format!("{e:#}"), "agent stopped with an error"),
                Err(e) => tracing::warn!(agent = %id, error = %e, "agent task failed"),
            }
        }
        match healthy {
            // Stopped (Ctrl-C, SIGTERM) before every region was up: a clean stop all the same.
            None => Ok(()),
            Some(r) => r.map(|_| ()),
        }
    });
    drop(cluster);
    let _ = std::fs::remove_file(&fed_file);
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    r
}

/// The dev cluster's shared checkpoint store: `file://` and the absolute path of
/// `<data dir>/checkpoints` (created).
fn dev_checkpoint_store(data_dir: &std::path::Path) -> Result<String> {
    let dir = data_dir.join("checkpoints");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let abs = std::fs::canonicalize(&dir).with_context(|| format!("resolving {}", dir.display()))?;
    let path = abs.to_str().with_context(|| format!("{} is not UTF-8", abs.display()))?;
    anyhow::ensure!(
        !path.chars().any(|c| c.is_whitespace() || c.is_control() || matches!(c, '%' | '?' | '#')),
        "the dev data directory {path:?} holds characters a file:// URL would need escaped; use --data-dir without them"
    );
    Ok(format!("file://{path}"))
}

/// The dev cluster's `default` queue, and its checkpoint store unless one is set already (an
/// operator's `cluster config set checkpoint_store=...` is kept across restarts).
async fn ensure_dev_setup(addr: &str, data_dir: &std::path::Path, tls_dir: &std::path::Path) -> Result<()> {
    let conn = ensure_default_queue(addr, tls_dir).await?;
    let current: serde_json::Value = serde_json::from_str(&conn.get_config(false).await?.config_json)?;
    if current["checkpoint_store"].as_str().is_none_or(str::is_empty) {
        let store = dev_checkpoint_store(data_dir)?;
        conn.set_config([("checkpoint_store".to_owned(), serde_json::Value::String(store).to_string())]).await?;
    }
    Ok(())
}

/// Lifetime of the viewer token `suanli dev` prints with the dashboard's address.
const DEV_DASHBOARD_TOKEN_TTL_S: u64 = 7 * 24 * 3600;

/// `https://HTTP/#token=T`: the dashboard's address with a viewer token (user `dashboard`, 7 days) made
/// with the dev admin's certificate through `server`, in the URL's fragment (never sent to the
/// server in a URL; the page keeps it in session storage). When no token can be made, the
/// address alone and the command that makes one.
async fn dev_dashboard_line(server: &str, http: &str, tls_dir: &std::path::Path) -> String {
    let url = format!("https://{http}/");
    let token = async {
        let admin = suanli_security::tls::Tls::load(suanli_security::certs::paths(tls_dir, "admin"))
            .context("the dev admin certificate")?;
        let conn = suanli_client::Connection::new(
            &[server.to_owned()],
            suanli_client::ConnectionConfig { tls: Some(admin), ..suanli_client::ConnectionConfig::default() },
        )?;
        anyhow::Ok(conn.create_token("dashboard", "viewer", "", DEV_DASHBOARD_TOKEN_TTL_S).await?.token)
    };
    match token.await {
        Ok(t) => format!("{url}#token={t} (a viewer token, valid 7 days)"),
        Err(e) => format!(
            "{url} (no token made: {e:#}; make one with `suanli token create --name me --role viewer` and open {url}#token=<token>)"
        ),
    }
}

/// `p` made absolute (as given when that fails), for a hint.
fn abs(p: &std::path::Path) -> String {
    std::path::absolute(p).unwrap_or_else(|_| p.to_owned()).display().to_string()
}

async fn ensure_default_queue(addr: &str, tls_dir: &std::path::Path) -> Result<suanli_client::Connection> {
    let admin = suanli_security::tls::Tls::load(suanli_security::certs::paths(tls_dir, "admin"))
        .context("the dev admin certificate")?;
    let conn = suanli_client::Connection::new(
        &[addr.to_owned()],
        suanli_client::ConnectionConfig { tls: Some(admin), ..suanli_client::ConnectionConfig::default() },
    )?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // Wait until the server is up and has elected itself.
    while !conn.leader().await.is_ok_and(|r| r.leader_id != 0) {
        anyhow::ensure!(std::time::Instant::now() < deadline, "the dev server did not elect itself within 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    if conn.get_queue("default", false).await.is_err() {
        // Team `default`: a member token of that team may submit to it (README).
        let mut queue = suanli_model::Queue::new("default", suanli_model::ResVec::MAX);
        queue.team = "default".into();
        conn.upsert_queue(&serde_json::to_string(&queue)?).await?;
    }
    Ok(conn)
}
