//! suanli's node agent (`suanli agent`): it loads the device plugins, registers the node with
//! the control plane and heartbeats, watches the node's allocations and runs each task as a
//! real OS process (under `suanli task-shim`), stops tasks when asked, and reports how each
//! one ended. It serves task logs to `suanli job logs`.
//!
//! ```text
//!          plugin_dir/*.so ──▶ plugins (one supervised plugin-host child each)
//!                                 │ devices, health, stats
//!  servers ◀── Register/Heartbeat ┤
//!  servers ──▶ WatchAllocations ──▶ tasks: mkdir alloc dir ─▶ reserve ─▶ task-shim ─▶ command
//!  servers ◀── ReportStatus ◀──────┘ (retried until acknowledged; `reported` marker)
//!  suanli job logs ──▶ AgentLogs ──▶ <data_dir>/allocs/<alloc>-<epoch>/stdout.log
//! ```
//!
//! It must never run an allocation twice: an allocation's directory is created before its
//! task starts, and an allocation whose directory exists is never started again (after an
//! agent restart it is adopted, reported as ended, or reported lost). A plugin must never take
//! it down (plugins live in child processes). Stopping the agent leaves tasks running; the
//! next agent on the same data directory adopts them.
//!
//! Nor may a task run on after the control plane may have given its allocation to another
//! node: every acknowledged heartbeat renews a lease (`<data_dir>/lease`), and the shims kill
//! their tasks when it expires ([`lease`]). What ran, and when, is in the node's task journal
//! (`<data_dir>/journal.jsonl`, [`journal`]).
//!
//! Nor may a task that fills the disk take the node down: the lease, `stop.json` and
//! `exit.json` are written into space reserved beforehand, task output is bounded and dropped
//! (with a marker) rather than failing the shim, and below a free-space threshold the node
//! reports disk pressure and takes no new work until it clears (`disk`).

mod cgroup;
pub mod checkpoint;
mod ckpt;
pub mod config;
mod control;
mod disk;
pub mod fedlease;
pub mod journal;
pub mod lease;
mod logs;
mod metrics;
mod plugins;
mod probe;
pub mod shim;
pub mod sys;
mod tasks;
pub mod telemetry;

pub use config::{AgentConfig, ConfigError, PluginSettings};
pub use journal::{JournalDevice, JournalEntry, JournalEvent, read_journal};
pub use lease::Lease;
pub use plugins::{PluginCheck, Refused, check_plugins, file_sha256};
pub use shim::{ExitRecord, ShimArgs};
pub use tasks::TaskRecord;

use anyhow::Context as _;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use suanli_model::{Node, NodeId, PoolId};
use suanli_security::tls::ClientAuth;
use tokio::sync::{Notify, watch};

/// Everything the agent's loops share.
pub(crate) struct Agent {
    cfg: AgentConfig,
    node_id: String,
    agent_addr: String,
    plugins: Arc<plugins::Plugins>,
    servers: control::Servers,
    cgroups: Option<cgroup::Cgroups>,
    reporter: control::Reporter,
    tasks: Mutex<tasks::Tasks>,
    /// Turns true when the agent stops.
    stop: watch::Receiver<bool>,
    /// Bumped after every successful registration.
    registered: watch::Sender<u64>,
    /// Asks the liveness loop to register again.
    reregister: Notify,
    /// The lease last written (after an acknowledged heartbeat).
    lease: watch::Sender<Option<lease::Lease>>,
    /// This boot's id (leases carry it).
    boot_id: String,
    /// "disk pressure: …" while the data directory is short of space, else empty (sent with
    /// every heartbeat).
    disk_pressure: watch::Sender<String>,
}

impl Agent {
    /// The node as registered now. Its labels are the plugins' topology labels
    /// (`topology.suanli.io/rack`, `/block`, `/nvlink-domain`) and the config's `labels`, which
    /// win on conflict: an operator's config overrides what a plugin reports.
    fn node(&self) -> Node {
        let devices: Vec<_> = self.plugins.devices().into_iter().map(|d| d.device).collect();
        let (pc, pm) = self.plugins.host_resources();
        let mut labels = self.plugins.topology();
        labels.extend(self.cfg.labels.clone());
        Node {
            id: NodeId(self.node_id.clone()),
            pool: PoolId(self.cfg.pool.clone()),
            datacenter: self.cfg.datacenter.clone(),
            region: self.cfg.region.clone(),
            labels,
            cpu_milli: self.cfg.cpu_milli.or(pc).unwrap_or_else(host_cpu_milli),
            memory_mib: self.cfg.memory_mib.or(pm).unwrap_or_else(host_memory_mib),
            devices,
            schedulable: true,
            agent_addr: self.agent_addr.clone(),
        }
    }

    fn shim_cmd(&self) -> Vec<std::ffi::OsString> {
        if self.cfg.shim_cmd.is_empty() {
            let exe = std::env::current_exe().map(Into::into).unwrap_or_else(|_| "suanli".into());
            vec![exe, "task-shim".into()]
        } else {
            self.cfg.shim_cmd.iter().map(Into::into).collect()
        }
    }
}

fn host_cpu_milli() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64) * 1000
}

fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}

/// Holds an exclusive lock on `<data_dir>/agent.lock` for the agent's life: two agents on one
/// data directory could run a task twice.
fn lock_data_dir(dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    let path = dir.join("agent.lock");
    match sys::try_lock(&path).with_context(|| format!("data_dir: locking {}", path.display()))? {
        Some(f) => Ok(f),
        None => anyhow::bail!("data_dir {}: another agent holds {}", dir.display(), path.display()),
    }
}

/// Gives the lease file its full size now, while the disk has room: from then on it is
/// rewritten in place and needs no new space (a lease of an older agent is rewritten in the
/// new layout; a missing one is reserved empty, which no shim accepts).
fn reserve_lease(path: &std::path::Path) {
    let r = match lease::Lease::read(path) {
        Ok(l) => l.write(path),
        Err(lease::LeaseError::Missing { .. }) => sys::write_padded(path, b"{}", lease::LEASE_FILE_BYTES),
        Err(_) => Ok(()),
    };
    if let Err(e) = r {
        tracing::warn!(path = %path.display(), error = %e, "reserving the lease file");
    }
}

/// An agent for unit tests: no plugins, the given servers, nothing running yet.
#[cfg(test)]
pub(crate) async fn test_agent(mut cfg: AgentConfig) -> Arc<Agent> {
    cfg.plugins = Some(Vec::new());
    std::fs::create_dir_all(cfg.allocs_dir()).expect("test data dir");
    let plugins = Arc::new(plugins::Plugins::load(&cfg, "n1").await);
    let (stop_tx, stop) = watch::channel(false);
    // Never stops: the sender lives as long as the test process.
    std::mem::forget(stop_tx);
    Arc::new(Agent {
        node_id: "n1".into(),
        agent_addr: String::new(),
        plugins,
        servers: control::Servers::new(&cfg, None).expect("test servers"),
        cgroups: None,
        reporter: control::Reporter::default(),
        tasks: Mutex::new(tasks::Tasks::default()),
        stop,
        registered: watch::channel(0).0,
        reregister: Notify::new(),
        lease: watch::channel(None).0,
        boot_id: sys::boot_id(),
        disk_pressure: watch::channel(String::new()).0,
        cfg,
    })
}

/// Runs the agent until `shutdown` completes. Tasks keep running after it returns; the next
/// agent on the same `data_dir` adopts them.
pub async fn run(mut cfg: AgentConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    cfg.validate()?;
    // The shims run in their allocation directories: every path they are given is absolute.
    cfg.data_dir = std::path::absolute(&cfg.data_dir)
        .with_context(|| format!("data_dir: resolving {}", cfg.data_dir.display()))?;
    std::fs::create_dir_all(cfg.allocs_dir())
        .with_context(|| format!("data_dir: creating {}", cfg.allocs_dir().display()))?;
    let _lock = lock_data_dir(&cfg.data_dir)?;
    reserve_lease(&cfg.data_dir.join(lease::LEASE_FILE));
    let tls = match &cfg.tls {
        Some(files) => {
            let tls = suanli_security::tls::Tls::load(files.clone()).context("tls")?;
            match tls.own_identity() {
                Some(suanli_security::Principal::Node { name }) if name == cfg.node_id => {}
                other => tracing::warn!(
                    cert = %files.cert.display(),
                    names = ?other.as_ref().and_then(suanli_security::Principal::to_uri),
                    node = %cfg.node_id,
                    "the node certificate does not name this node (suanli://node/<node_id>): the servers will refuse its calls"
                ),
            }
            Some(tls)
        }
        None => {
            tracing::warn!(
                "insecure = true: plaintext to the servers and on the log service, no identities; only for servers started --insecure"
            );
            None
        }
    };
    // New connections pick up a rotated certificate; SIGHUP reloads at once.
    let reloader = tls.as_ref().map(|t| t.spawn_reloader(AgentConfig::ms(cfg.tls_reload_interval_ms)));
    let listener =
        tokio::net::TcpListener::bind(&cfg.listen).await.with_context(|| format!("listen: binding {}", cfg.listen))?;
    let bound = listener.local_addr().context("listen: local address")?;
    let agent_addr = match &cfg.advertise {
        Some(a) => a.clone(),
        None => {
            if bound.ip().is_unspecified() {
                tracing::warn!(listen = %bound, "listen is a wildcard address and advertise is unset: `suanli job logs` cannot reach this agent");
            }
            bound.to_string()
        }
    };
    let cgroups = if cfg.cgroups {
        match cgroup::Cgroups::detect(&cfg.cgroup_parent) {
            Ok(c) => {
                tracing::info!(parent = %cfg.cgroup_parent.display(), "cgroup v2: CPU and memory limits are enforced per task");
                Some(c)
            }
            Err(why) => {
                tracing::warn!(
                    "cgroup v2 with cpu and memory controllers is not available ({why}): CPU and memory limits are not enforced"
                );
                None
            }
        }
    } else {
        tracing::warn!("cgroups = false: CPU and memory limits are not enforced");
        None
    };
    if !cfg.fence {
        tracing::warn!(
            "fence = false: tasks keep running when this node loses the control plane, and may run twice at once if their allocations are given to another node"
        );
    }
    let node_id = cfg.node_id.clone();
    let plugins = Arc::new(plugins::Plugins::load(&cfg, &node_id).await);
    tracing::info!(node = %node_id, plugins = ?plugins.names(), devices = plugins.devices().len(), "plugins loaded");
    let (stop_tx, stop_rx) = watch::channel(false);
    let servers = control::Servers::new(&cfg, tls.clone())?;
    let agent = Arc::new(Agent {
        node_id,
        agent_addr,
        plugins: plugins.clone(),
        servers,
        cgroups,
        reporter: control::Reporter::default(),
        tasks: Mutex::new(tasks::Tasks::default()),
        stop: stop_rx.clone(),
        registered: watch::channel(0).0,
        reregister: Notify::new(),
        lease: watch::channel(lease::Lease::read(&cfg.data_dir.join(lease::LEASE_FILE)).ok()).0,
        boot_id: sys::boot_id(),
        disk_pressure: watch::channel(String::new()).0,
        cfg,
    });
    tasks::recover(&agent).context("reading the allocation directories")?;
    let max_streams = agent.cfg.max_log_streams;
    plugins.spawn_monitors(&agent.cfg, stop_rx.clone());
    let (sets_tx, sets_rx) = watch::channel(None);
    let mut loops = tokio::task::JoinSet::new();
    loops.spawn(control::liveness(agent.clone()));
    loops.spawn(control::watch(agent.clone(), sets_tx));
    loops.spawn(tasks::manage(agent.clone(), sets_rx));
    loops.spawn(control::report_loop(agent.clone()));
    loops.spawn(tasks::gc(agent.clone()));
    loops.spawn(disk::watch(agent.clone()));
    let svc = logs::LogsService {
        allocs_dir: agent.cfg.allocs_dir(),
        streams: Arc::new(tokio::sync::Semaphore::new(max_streams)),
        auth: logs::LogsAuth::new(agent.cfg.insecure, {
            let agent = agent.clone();
            Box::new(move |token| {
                let agent = agent.clone();
                Box::pin(async move { agent.servers.whoami(&token).await })
            })
        }),
    };
    let mut stop_logs = stop_rx.clone();
    let handshake = AgentConfig::ms(agent.cfg.tls_handshake_timeout_ms);
    let tls_for_http = tls.clone();
    loops.spawn(async move {
        let svc = suanli_proto::v1::agent_logs_server::AgentLogsServer::new(svc);
        let stopped = async move {
            let _ = stop_logs.changed().await;
        };
        let r = match tls {
            // Users without a certificate may read logs with a token (logs.rs checks who).
            Some(tls) => {
                let incoming = suanli_security::tls::incoming(listener, tls, ClientAuth::Optional, handshake);
                tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming_shutdown(incoming, stopped)
                    .await
            }
            None => {
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming_shutdown(incoming, stopped)
                    .await
            }
        };
        if let Err(e) = r {
            tracing::error!(error = %e, "the log service stopped");
        }
    });
    // The HTTP listener (`/metrics`), when `http_listen` is set: its address is logged.
    let http_addr = match agent.cfg.http_listen.clone() {
        Some(h) => {
            let l = tokio::net::TcpListener::bind(&h).await.with_context(|| format!("http_listen: binding {h}"))?;
            let bound = l.local_addr().context("http_listen: local address")?;
            let mut stop_http = stop_rx.clone();
            let http_tls = tls_for_http;
            let router = metrics::router(agent.clone());
            loops.spawn(async move {
                let stopped = async move {
                    let _ = stop_http.changed().await;
                };
                if let Err(e) = suanli_security::http::serve(l, http_tls, handshake, router, stopped).await {
                    tracing::error!(error = %e, "the HTTP listener stopped");
                }
            });
            bound.to_string()
        }
        None => "off".to_owned(),
    };
    tracing::info!(node = %agent.node_id, addr = %agent.agent_addr, servers = ?agent.cfg.servers, http = %http_addr, "agent running");
    shutdown.await;
    tracing::info!(
        pending_reports = agent.reporter.len(),
        "agent stopping; tasks keep running and are adopted by the next agent"
    );
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), async { while loops.join_next().await.is_some() {} }).await;
    loops.abort_all();
    if let Some(r) = reloader {
        r.abort();
    }
    plugins.shutdown().await;
    Ok(())
}
