//! The cluster under test: real `suanli server` and `suanli agent` processes on loopback, each
//! with its own data directory, and a fault-injecting [`Proxy`] on every directed link.
//!
//! ```text
//!   client c ──proxy(c→j)──▶ server j client port
//!   agent a  ──proxy(a→j)──▶ server j client port                    (register, heartbeat, watch)
//!   server i ──proxy(i→j)──▶ server j peer port                      (raft, forwarding)
//!   harness  ─────direct───▶ server j, either port                   (observer: leader, Inspect; join)
//! ```
//!
//! Servers dial each other's peer listeners through `raft.dial` rewrites (advertised peer
//! address → the proxy of that directed link); agents only know their proxies and never
//! follow leader hints; the harness's own observer connects directly so it can always look.
//!
//! Every link runs mutual TLS with the process's development PKI
//! ([`suanli_server::local::LocalPki`]): the servers with its server certificate (valid for
//! 127.0.0.1, the address every dial rewrite and proxy has), each agent with its node's
//! certificate, the workload clients and the harness's observer as its admin, and the
//! harness's calls on peer listeners (`Internal`) with the server certificate. The proxies
//! forward bytes, so a handshake crosses them as any other traffic does.
//!
//! Nothing here looks for a free port. Every server listens on port 0 at its first start and
//! the harness reads the ports back (the `suanli server listening` line on its stdout); a
//! restart reuses them. A server advertises a peer *name* (`server-N.peer.chaos:7401`) that
//! only the dial rewrites resolve, so the configs can be written before any port is known;
//! the proxies are bound first and get their targets as the servers come up. The smallest id
//! starts last, once it can list the others as initial voters (they wait to be added).

use crate::proxy::{Fault, Proxy};
use anyhow::{Context as _, bail};
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::internal_client::InternalClient;
use suanli_server::local::LocalPki;
use tonic::transport::{Channel, Endpoint};

/// One end of a link (the dialing side); the other end is always a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum From {
    /// Server `i` (raft, forwarded writes).
    Server(usize),
    /// Workload client `c`.
    Client(usize),
    /// Agent `a`.
    Agent(usize),
}

/// How the cluster is built.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Voters at start (3 or 5).
    pub servers: usize,
    /// Agents, each with the fake plugin.
    pub agents: usize,
    /// GPUs per agent.
    pub gpus_per_agent: u32,
    /// Workload clients.
    pub clients: usize,
    /// Server heartbeat TTL for agents (ms); the agents' fencing derives from it.
    pub heartbeat_ttl_ms: u64,
    /// Extra environment for every server (e.g. `SUANLI_FAILPOINTS` for a broken build).
    pub server_env: Vec<(String, String)>,
    /// Servers run under libfaketime, their clocks settable with [`Cluster::set_clock`].
    pub fake_clocks: Option<FakeClocks>,
    /// The region's `[federation]` (multi-region runs, [`crate::federation`]); None: standalone.
    pub federation: Option<suanli_server::config::FederationLink>,
    /// The pool every agent joins (a pool belongs to one region of a federation).
    pub pool: String,
    /// Node ids are `<node_prefix>-<n>` (distinct across the regions of one run).
    pub node_prefix: String,
}

impl Shape {
    /// A standalone cluster: `servers` servers, `agents` agents of `gpus_per_agent` GPUs,
    /// `clients` clients, heartbeat TTL 3 s, real clocks, pool `default`, nodes `node-N`.
    pub fn new(servers: usize, agents: usize, gpus_per_agent: u32, clients: usize) -> Shape {
        Shape {
            servers,
            agents,
            gpus_per_agent,
            clients,
            heartbeat_ttl_ms: 3_000,
            server_env: Vec::new(),
            fake_clocks: None,
            federation: None,
            pool: "default".to_owned(),
            node_prefix: "node".to_owned(),
        }
    }
}

/// Which of a server's clocks libfaketime fakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeClocks {
    /// The wall clock only (`FAKETIME_DONT_FAKE_MONOTONIC=1`): a skew is a step of the wall
    /// clock, as an NTP step or an operator's `date -s` makes; `Instant`s are untouched.
    Wall,
    /// Wall and monotonic clocks (and sleeps): a rate fault makes the whole process run fast.
    All,
}

/// A server's clock fault.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ClockFault {
    /// The real clock.
    None,
    /// The wall clock this many seconds off (positive: ahead).
    Skew(i64),
    /// The clocks running this many times as fast as real time, from now on (no jump).
    Rate(u32),
}

/// Where libfaketime is: `$SUANLI_CHAOS_LIBFAKETIME`, or Debian's `faketime` package paths.
/// Missing, clock faults cannot run: an error that says how to install it (never a skip).
pub fn libfaketime() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("SUANLI_CHAOS_LIBFAKETIME") {
        return Ok(PathBuf::from(p));
    }
    for p in [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ] {
        if Path::new(p).exists() {
            return Ok(PathBuf::from(p));
        }
    }
    bail!(
        "libfaketime is missing, and the clock faults need it: run scripts/setup.sh (apt-get install faketime) or set SUANLI_CHAOS_LIBFAKETIME"
    )
}

/// A server process slot.
pub struct ServerProc {
    /// Raft id (index + 1).
    pub id: u64,
    /// Client listener (listen and advertised address): picked at its first start.
    pub addr: String,
    /// Peer listener (raft, `Internal`), as bound: picked at its first start.
    pub peer_addr: String,
    /// The peer address it advertises: a name that every other server's `raft.dial` maps to
    /// the proxy of their link.
    pub peer_name: String,
    dir: PathBuf,
    child: Option<Child>,
    /// SIGSTOPped now.
    pub paused: bool,
    /// When its process was spawned (libfaketime counts a rate from its start).
    started: Option<Instant>,
}

/// An agent process slot.
pub struct AgentProc {
    /// Its node id.
    pub node: String,
    dir: PathBuf,
    child: Option<Child>,
    /// SIGSTOPped now.
    pub paused: bool,
}

/// The running cluster.
pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// Server slots (index i is raft id i + 1).
    pub servers: Vec<ServerProc>,
    /// Agent slots.
    pub agents: Vec<AgentProc>,
    links: BTreeMap<(From, usize), Proxy>,
    shape: Shape,
}

/// A channel to a server's client listener as the PKI's admin, with short timeouts (the
/// harness must not hang on a paused server): connected at the first call, within 500 ms
/// (TCP and the TLS handshake), each call within `timeout`.
pub async fn channel(addr: &str, timeout: Duration) -> anyhow::Result<Channel> {
    lazy_channel(addr, timeout)
}

/// A channel to a server's peer listener with the servers' certificate (`Internal` answers
/// servers only); connected like [`channel`].
pub async fn peer_channel(addr: &str, timeout: Duration) -> anyhow::Result<Channel> {
    lazy_peer_channel(addr, timeout)
}

/// A lazily connected channel to a client listener, as the PKI's admin (never blocks; fails at
/// the first request).
pub fn lazy_channel(addr: &str, timeout: Duration) -> anyhow::Result<Channel> {
    Ok(suanli_security::tls::channel(endpoint(addr, timeout)?, Some(&pki().admin_tls())))
}

/// A lazily connected channel to a peer listener, with the servers' certificate.
pub fn lazy_peer_channel(addr: &str, timeout: Duration) -> anyhow::Result<Channel> {
    Ok(suanli_security::tls::channel(endpoint(addr, timeout)?, Some(&server_tls()?)))
}

/// The PKI every cluster of this process runs with (made on first use).
pub fn pki() -> &'static LocalPki {
    LocalPki::get()
}

/// The servers' certificate, loaded once.
fn server_tls() -> anyhow::Result<suanli_security::tls::Tls> {
    static TLS: std::sync::OnceLock<suanli_security::tls::Tls> = std::sync::OnceLock::new();
    if let Some(t) = TLS.get() {
        return Ok(t.clone());
    }
    let t = suanli_security::tls::Tls::load(pki().server()).context("the local PKI's server certificate")?;
    Ok(TLS.get_or_init(|| t).clone())
}

fn endpoint(addr: &str, timeout: Duration) -> anyhow::Result<Endpoint> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_millis(500))
        .timeout(timeout)
        .tcp_nodelay(true))
}

/// The `suanli` binary: `$SUANLI_BIN`, or next to this executable (`target/debug/suanli`).
pub fn default_bin() -> anyhow::Result<PathBuf> {
    if let Some(b) = std::env::var_os("SUANLI_BIN") {
        return Ok(PathBuf::from(b));
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().context("executable without a directory")?.to_owned();
    // Test executables live in target/debug/deps.
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("suanli");
    if !bin.exists() {
        bail!("{} is missing: build the workspace first (cargo build --workspace) or set SUANLI_BIN", bin.display());
    }
    Ok(bin)
}

fn fake_plugin(bin: &Path) -> anyhow::Result<PathBuf> {
    let dir = bin.parent().context("binary without a directory")?;
    for p in [dir.join("libsuanli_plugin_fake.so"), dir.join("deps").join("libsuanli_plugin_fake.so")] {
        if p.exists() {
            return Ok(p);
        }
    }
    bail!("libsuanli_plugin_fake.so is not next to {}: build the workspace first", bin.display())
}

impl Cluster {
    /// Starts `shape.servers` servers (one initial cluster), `shape.agents` agents and every
    /// link's proxy; returns once a leader is known and the `default` queue exists.
    pub async fn start(bin: &Path, shape: Shape, seed: u64, keep: bool) -> anyhow::Result<Cluster> {
        if shape.fake_clocks.is_some() {
            libfaketime()?;
        }
        let dir = tempfile::Builder::new().prefix("suanli-chaos-").disable_cleanup(keep).tempdir()?;
        let servers: Vec<ServerProc> = (0..shape.servers)
            .map(|i| ServerProc {
                id: i as u64 + 1,
                addr: String::new(),
                peer_addr: String::new(),
                peer_name: format!("server-{}.peer.chaos:7401", i + 1),
                dir: dir.path().join(format!("s{}", i + 1)),
                child: None,
                paused: false,
                started: None,
            })
            .collect();
        // Every link's proxy first (its target is set once that server listens).
        let mut links = BTreeMap::new();
        let mut n = 0u64;
        for to in 0..servers.len() {
            let from = (0..servers.len())
                .filter(|i| *i != to)
                .map(From::Server)
                .chain((0..shape.clients).map(From::Client))
                .chain((0..shape.agents).map(From::Agent));
            for f in from {
                n += 1;
                links.insert((f, to), Proxy::bind(seed.wrapping_add(n)).await?);
            }
        }
        let agents = (0..shape.agents)
            .map(|a| AgentProc {
                node: format!("{}-{}", shape.node_prefix, a + 1),
                dir: dir.path().join(format!("a{}", a + 1)),
                child: None,
                paused: false,
            })
            .collect();
        let mut c = Cluster { dir, bin: bin.to_owned(), servers, agents, links, shape };
        let plugin_dir = c.dir.path().join("plugins");
        std::fs::create_dir_all(&plugin_dir)?;
        let so = plugin_dir.join("libsuanli_plugin_fake.so");
        std::fs::copy(fake_plugin(bin)?, &so)?;
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&so, std::fs::Permissions::from_mode(0o755))?;
        std::fs::set_permissions(&plugin_dir, std::fs::Permissions::from_mode(0o755))?;
        // Server 1 last: it bootstraps, listing the others' ports (they wait to be added).
        for i in (1..c.servers.len()).chain([0]) {
            c.write_server_config(i, None)?;
            c.start_server(i)?;
        }
        // From now on each config names the ports bound, as initial voters: what restarts use.
        for i in 0..c.servers.len() {
            c.write_server_config(i, None)?;
        }
        if let Err(e) = c.wait_leader(Duration::from_secs(30)).await {
            // The directory goes with the cluster: say what the servers said.
            let tails: Vec<String> = (0..c.servers.len())
                .map(|i| {
                    let log = c.server_log(i);
                    let tail: Vec<&str> = log.lines().rev().take(8).collect();
                    format!(
                        "server {} log (last lines):\n{}",
                        i + 1,
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    )
                })
                .collect();
            anyhow::bail!("{e}\n{}", tails.join("\n"));
        }
        c.ensure_default_queue().await?;
        for a in 0..c.agents.len() {
            c.write_agent_config(a)?;
            c.start_agent(a)?;
        }
        Ok(c)
    }

    /// GPUs each agent's fake plugin reports.
    pub fn gpus_per_agent(&self) -> u32 {
        self.shape.gpus_per_agent
    }

    /// The run's directory (data, configs, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The address a dialer uses to reach server `to` (a server reaches its peer listener,
    /// a client or an agent its client listener).
    pub fn link_addr(&self, from: From, to: usize) -> String {
        let direct = || match from {
            From::Server(_) => self.servers[to].peer_addr.clone(),
            _ => self.servers[to].addr.clone(),
        };
        self.links.get(&(from, to)).map_or_else(direct, |p| p.addr.clone())
    }

    /// Sets the fault of one directed link.
    pub fn set_link(&self, from: From, to: usize, f: Fault) {
        if let Some(p) = self.links.get(&(from, to)) {
            p.set(f);
        }
    }

    /// Every link's fault back to none.
    pub fn heal_links(&self) {
        for p in self.links.values() {
            p.set(Fault::default());
        }
    }

    /// Links currently faulty.
    pub fn faulty_links(&self) -> usize {
        self.links.values().filter(|p| p.fault() != Fault::default()).count()
    }

    /// Cuts (or restores) both directions between servers `a` and `b`.
    pub fn cut_servers(&self, a: usize, b: usize, blocked: bool) {
        let f = Fault { blocked, ..Fault::default() };
        self.set_link(From::Server(a), b, f);
        self.set_link(From::Server(b), a, f);
    }

    fn server_config_path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("s{}.toml", i + 1))
    }

    /// The failpoints file server `i` watches.
    pub fn failpoints_path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("s{}.failpoints", i + 1))
    }

    /// Writes server `i`'s config: an initial voter (`peers`), or a new member joining
    /// through server `via` (`join`). Ports not bound yet are 0; while another server's are
    /// not known, it has neither `peers` nor `bootstrap` (it waits to be added).
    pub fn write_server_config(&self, i: usize, join_via: impl Into<Option<usize>>) -> anyhow::Result<()> {
        let join_via: Option<usize> = join_via.into();
        let or_zero = |a: &str| if a.is_empty() { "127.0.0.1:0".to_owned() } else { a.to_owned() };
        let mut cfg = suanli_server::ServerConfig {
            id: self.servers[i].id,
            data_dir: self.servers[i].dir.clone(),
            listen: or_zero(&self.servers[i].addr),
            peer_listen: Some(or_zero(&self.servers[i].peer_addr)),
            peer_advertise: Some(self.servers[i].peer_name.clone()),
            // Not the default (listen's port + 2, which another process may hold here).
            http_listen: Some("127.0.0.1:0".into()),
            heartbeat_interval_ms: (self.shape.heartbeat_ttl_ms / 10).max(50),
            heartbeat_ttl_ms: self.shape.heartbeat_ttl_ms,
            request_timeout_ms: 3_000,
            tls: Some(pki().server()),
            federation: self.shape.federation.clone(),
            ..suanli_server::ServerConfig::default()
        };
        match join_via {
            // Joining is a client call (Cluster.AddServer), made directly.
            Some(v) => cfg.join = Some(self.servers[v].addr.clone()),
            None if self.servers.iter().enumerate().any(|(j, s)| j != i && s.addr.is_empty()) => {}
            None => {
                // Every initial voter carries it, as a unit file would: only the smallest id
                // initializes, and none does while a peer already answers as a cluster.
                cfg.bootstrap = true;
                cfg.peers = self
                    .servers
                    .iter()
                    .take(self.shape.servers)
                    .map(|s| suanli_server::Peer {
                        id: s.id,
                        addr: or_zero(&s.addr),
                        peer_addr: Some(s.peer_name.clone()),
                    })
                    .collect();
            }
        }
        cfg.raft.snapshot_after_entries = 2_000;
        cfg.raft.keep_entries_after_snapshot = 500;
        for (j, s) in self.servers.iter().enumerate().filter(|(j, _)| *j != i) {
            cfg.raft.dial.insert(s.peer_name.clone(), self.link_addr(From::Server(i), j));
        }
        let text = toml::to_string(&cfg).context("encoding a server config")?;
        std::fs::write(self.server_config_path(i), text)?;
        Ok(())
    }

    /// Starts (or restarts) server `i` on its data directory. At its first start it picks its
    /// ports (port 0): this waits until it prints them, then points its links' proxies there.
    pub fn start_server(&mut self, i: usize) -> anyhow::Result<()> {
        if self.servers[i].child.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("s{}.log", i + 1)))?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("server")
            .arg("--config")
            .arg(self.server_config_path(i))
            .env("SUANLI_LOG", std::env::var("SUANLI_CHAOS_SERVER_LOG").unwrap_or_else(|_| "warn".into()))
            .env("SUANLI_FAILPOINTS_FILE", self.failpoints_path(i))
            .env_remove("SUANLI_CONFIG")
            .env_remove("SUANLI_FAILPOINTS")
            // The workload and the checks all call as the one admin: no per-caller rate limit.
            .env("SUANLI_RATE_LIMIT_PER_S", "0")
            .stdin(Stdio::null())
            .stderr(Stdio::from(log))
            .process_group(0);
        for (k, v) in &self.shape.server_env {
            cmd.env(k, v);
        }
        if let Some(fake) = self.shape.fake_clocks {
            // A restarted server starts on the real clock: a fault never outlives its process.
            let file = self.faketime_path(i);
            write_atomically(&file, "+0\n")?;
            cmd.env("LD_PRELOAD", libfaketime()?)
                .env("FAKETIME_TIMESTAMP_FILE", &file)
                .env("FAKETIME_CACHE_DURATION", "1")
                .env_remove("FAKETIME");
            if fake == FakeClocks::Wall {
                cmd.env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
            }
        }
        let first = self.servers[i].addr.is_empty();
        cmd.stdout(if first { Stdio::piped() } else { Stdio::null() });
        let mut child = cmd.spawn().context("starting suanli server")?;
        self.servers[i].started = Some(Instant::now());
        self.servers[i].paused = false;
        if first {
            let stdout = child.stdout.take().context("the server's stdout")?;
            let bound = match suanli_server::listeners::await_line(stdout, Duration::from_secs(60)) {
                Ok(b) => b,
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("server {} did not listen: {e}\n{}", self.servers[i].id, self.server_log(i));
                }
            };
            let s = &mut self.servers[i];
            (s.addr, s.peer_addr) = (bound.client.to_string(), bound.peer.to_string());
            for ((from, to), p) in &self.links {
                if *to == i {
                    p.set_target(if matches!(from, From::Server(_)) { s.peer_addr.clone() } else { s.addr.clone() });
                }
            }
        }
        self.servers[i].child = Some(child);
        Ok(())
    }

    fn faketime_path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("s{}.faketime", i + 1))
    }

    /// Sets server `i`'s clock fault and returns once the server's clock (`Internal.Clock`)
    /// shows it: libfaketime reads its file again within a second or two, and a fault must not
    /// overlap the next one (two servers of three off is a majority of wrong clocks). The
    /// cluster must have been started with [`Shape::fake_clocks`]. A rate is continuous: the
    /// offset written makes the fast clock start from the real time of now. Back from a rate
    /// to `None` would step the monotonic clock back: restart the server instead.
    pub async fn set_clock(&self, i: usize, f: ClockFault) -> anyhow::Result<()> {
        self.write_clock(i, f)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(ch) = peer_channel(&self.servers[i].peer_addr, Duration::from_secs(1)).await {
                let req = pb::ClockRequest { group: "region".into() };
                if let Ok(r) = InternalClient::new(ch).clock(req).await {
                    let ahead_ms = i128::from(r.into_inner().wall_ms) - i128::from(crate::history::now_ms());
                    let shows = match f {
                        ClockFault::None => ahead_ms.abs() < 1_000,
                        ClockFault::Skew(s) => (ahead_ms - i128::from(s) * 1000).abs() < 1_000,
                        ClockFault::Rate(_) => ahead_ms > 200,
                    };
                    if shows {
                        return Ok(());
                    }
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "server {}'s clock did not show {f:?} within 10 s (is libfaketime preloaded?)",
                    self.servers[i].id
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn write_clock(&self, i: usize, f: ClockFault) -> anyhow::Result<()> {
        if self.shape.fake_clocks.is_none() {
            bail!("set_clock: this cluster was started without fake clocks");
        }
        let text = match f {
            ClockFault::None => "+0".to_owned(),
            ClockFault::Skew(s) => format!("{s:+}"),
            ClockFault::Rate(x) => {
                // libfaketime: fake = start + offset + (real - start) * x; continuous now when
                // offset = -(real - start) * (x - 1).
                let since = self.servers[i].started.map_or(0.0, |t| t.elapsed().as_secs_f64());
                format!("{:+.3} x{x}", -since * f64::from(x.saturating_sub(1)))
            }
        };
        write_atomically(&self.faketime_path(i), &format!("{text}\n"))
    }

    /// SIGKILL server `i` (continued first if paused, so it dies at once) and reap it.
    pub fn kill_server(&mut self, i: usize) {
        let s = &mut self.servers[i];
        if let Some(mut c) = s.child.take() {
            signal(c.id(), libc::SIGKILL);
            let _ = c.kill();
            let _ = c.wait();
        }
        s.paused = false;
    }

    /// SIGTERM server `i` and wait up to `within` for it to exit (SIGKILL after that, as
    /// systemd does). Answers whether it exited on its own, and how long it took.
    pub fn terminate_server(&mut self, i: usize, within: Duration) -> (bool, Duration) {
        let t = Instant::now();
        let s = &mut self.servers[i];
        s.paused = false;
        let Some(mut c) = s.child.take() else { return (true, Duration::ZERO) };
        signal(c.id(), libc::SIGTERM);
        loop {
            if let Ok(Some(_)) = c.try_wait() {
                return (true, t.elapsed());
            }
            if t.elapsed() >= within {
                signal(c.id(), libc::SIGKILL);
                let _ = c.kill();
                let _ = c.wait();
                return (false, t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether server `i` has a live process (a server that exited on its own is reaped).
    pub fn server_alive(&mut self, i: usize) -> bool {
        let s = &mut self.servers[i];
        match s.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                s.child = None;
                s.paused = false;
                false
            }
            None => false,
        }
    }

    /// SIGSTOP / SIGCONT server `i`.
    pub fn pause_server(&mut self, i: usize, stop: bool) {
        let s = &mut self.servers[i];
        if let Some(c) = &s.child {
            signal(c.id(), if stop { libc::SIGSTOP } else { libc::SIGCONT });
            s.paused = stop;
        }
    }

    /// Removes server `i`'s data (after a membership removal, before it joins again).
    pub fn wipe_server(&mut self, i: usize) -> anyhow::Result<()> {
        self.kill_server(i);
        let d = &self.servers[i].dir;
        if d.exists() {
            std::fs::remove_dir_all(d)?;
        }
        Ok(())
    }

    fn agent_fault_file(&self, a: usize) -> PathBuf {
        self.agents[a].dir.join("fake.faults.toml")
    }

    fn write_agent_config(&self, a: usize) -> anyhow::Result<()> {
        let ag = &self.agents[a];
        std::fs::create_dir_all(&ag.dir)?;
        let fake = ag.dir.join("fake.toml");
        std::fs::write(
            &fake,
            format!(
                "[[groups]]\ncount = {}\nkind = \"gpu\"\nmodel = \"A100-80G\"\nmemory_mib = 81920\nid_prefix = \"gpu\"\n",
                self.shape.gpus_per_agent
            ),
        )?;
        let mut plugin_config = BTreeMap::new();
        plugin_config.insert(
            "fake".to_owned(),
            suanli_agent::PluginSettings { config_path: Some(fake), options: BTreeMap::new() },
        );
        let cfg = suanli_agent::AgentConfig {
            servers: (0..self.servers.len()).map(|j| self.link_addr(From::Agent(a), j)).collect(),
            node_id: ag.node.clone(),
            pool: self.shape.pool.clone(),
            data_dir: ag.dir.join("data"),
            plugin_dir: self.dir.path().join("plugins"),
            plugins: Some(vec!["fake".to_owned()]),
            plugin_config,
            listen: "127.0.0.1:0".into(),
            cpu_milli: Some(32_000),
            memory_mib: Some(65_536),
            stop_grace_min_ms: 500,
            stop_grace_max_ms: 2_000,
            rpc_timeout_ms: 2_000,
            connect_timeout_ms: 500,
            retry_backoff_min_ms: 50,
            retry_backoff_max_ms: 500,
            cgroups: false,
            // Agents talk only through their own proxies, so a partition cuts them for real.
            follow_leader_hints: false,
            // The node's own certificate: it may report for this node only.
            tls: Some(pki().node(&ag.node)),
            ..suanli_agent::AgentConfig::default()
        };
        let toml = toml::to_string(&cfg).context("encoding an agent config")?;
        std::fs::write(ag.dir.join("agent.toml"), toml)?;
        Ok(())
    }

    /// Starts (or restarts) agent `a`.
    pub fn start_agent(&mut self, a: usize) -> anyhow::Result<()> {
        if self.agents[a].child.is_some() {
            return Ok(());
        }
        let ag = &self.agents[a];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(ag.dir.join("agent.log"))?;
        let child = Command::new(&self.bin)
            .arg("agent")
            .arg("--config")
            .arg(ag.dir.join("agent.toml"))
            .env("SUANLI_LOG", std::env::var("SUANLI_CHAOS_AGENT_LOG").unwrap_or_else(|_| "warn".into()))
            .env_remove("SUANLI_AGENT_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .process_group(0)
            .spawn()
            .context("starting suanli agent")?;
        self.agents[a].child = Some(child);
        self.agents[a].paused = false;
        Ok(())
    }

    /// SIGKILL agent `a` (its tasks' shims live on and fence themselves).
    pub fn kill_agent(&mut self, a: usize) {
        if let Some(mut c) = self.agents[a].child.take() {
            signal(c.id(), libc::SIGKILL); // with its plugin hosts
            let _ = c.kill();
            let _ = c.wait();
        }
        self.agents[a].paused = false;
    }

    /// SIGSTOP / SIGCONT agent `a`.
    pub fn pause_agent(&mut self, a: usize, stop: bool) {
        if let Some(c) = &self.agents[a].child {
            signal(c.id(), if stop { libc::SIGSTOP } else { libc::SIGCONT });
            self.agents[a].paused = stop;
        }
    }

    /// Writes agent `a`'s fake-plugin fault file (atomically); empty text clears it.
    pub fn set_plugin_faults(&self, a: usize, text: &str) -> anyhow::Result<()> {
        let path = self.agent_fault_file(a);
        if text.is_empty() {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(path.with_extension("toml.crashed"));
            return Ok(());
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// Agent `a`'s task journal.
    pub fn journal_path(&self, a: usize) -> PathBuf {
        self.agents[a].dir.join("data").join("journal.jsonl")
    }

    /// Server indices with a live, running (not paused) process.
    pub fn up_servers(&mut self) -> Vec<usize> {
        (0..self.servers.len()).filter(|i| self.server_alive(*i) && !self.servers[*i].paused).collect()
    }

    /// The leader as the running servers see it: the leader named in the highest term, when
    /// that server is up. Asked directly, not through the proxies.
    pub async fn leader(&mut self) -> Option<usize> {
        let mut best: Option<(u64, u64)> = None;
        for i in self.up_servers() {
            let Ok(ch) = channel(&self.servers[i].addr, Duration::from_millis(500)).await else { continue };
            if let Ok(r) = ClusterClient::new(ch).leader(pb::LeaderRequest {}).await {
                let r = r.into_inner();
                if r.leader_id != 0 && best.is_none_or(|(t, _)| r.term > t) {
                    best = Some((r.term, r.leader_id));
                }
            }
        }
        let (_, id) = best?;
        let i = self.servers.iter().position(|s| s.id == id)?;
        self.up_servers().contains(&i).then_some(i)
    }

    /// Waits for a leader.
    pub async fn wait_leader(&mut self, within: Duration) -> anyhow::Result<usize> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(l) = self.leader().await {
                return Ok(l);
            }
            if Instant::now() > deadline {
                bail!("no leader within {within:?} (logs in {})", self.dir.path().display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn ensure_default_queue(&mut self) -> anyhow::Result<()> {
        let q = serde_json::json!({"id": "default", "nominal": {"cpu_milli": u64::MAX, "memory_mib": u64::MAX,
            "gpu_milli": u64::MAX, "npu_milli": u64::MAX}});
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            for i in self.up_servers() {
                let Ok(ch) = channel(&self.servers[i].addr, Duration::from_secs(3)).await else { continue };
                let r = suanli_proto::v1::queues_client::QueuesClient::new(ch)
                    .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
                    .await;
                if r.is_ok() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("could not create the default queue within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Sets node `node`'s mode through the leader, directly (draining: grace 0, no budget).
    pub async fn set_node_mode(&mut self, node: &str, mode: pb::NodeMode) -> anyhow::Result<()> {
        let l = self.wait_leader(Duration::from_secs(10)).await?;
        let ch = channel(&self.servers[l].addr, Duration::from_secs(5)).await?;
        let req = pb::SetNodeModeRequest { id: node.into(), mode: mode as i32, grace_s: 0, max_unavailable: 0 };
        suanli_proto::v1::nodes_client::NodesClient::new(ch).set_mode(req).await?;
        Ok(())
    }

    /// Sets one field of the replicated configuration (`Cluster.SetConfig`, the value as
    /// JSON) through the leader, directly.
    pub async fn set_config(&mut self, field: &str, value: &serde_json::Value) -> anyhow::Result<()> {
        let l = self.wait_leader(Duration::from_secs(10)).await?;
        let ch = channel(&self.servers[l].addr, Duration::from_secs(5)).await?;
        let set = [(field.to_owned(), value.to_string())].into();
        ClusterClient::new(ch).set_config(pb::SetConfigRequest { set }).await?;
        Ok(())
    }

    /// Submits a job spec through the leader, directly, with client request id `rid`; its id.
    pub async fn submit(&mut self, rid: &str, spec: &serde_json::Value) -> anyhow::Result<u64> {
        let l = self.wait_leader(Duration::from_secs(10)).await?;
        let ch = channel(&self.servers[l].addr, Duration::from_secs(5)).await?;
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: rid.into(),
            spec_json: spec.to_string(),
            retry: None,
        };
        Ok(suanli_proto::v1::jobs_client::JobsClient::new(ch).submit(req).await?.into_inner().job_id)
    }

    /// Raft members as the leader sees them: `(id, voter)`.
    pub async fn members(&mut self) -> anyhow::Result<Vec<(u64, bool)>> {
        let l = self.wait_leader(Duration::from_secs(10)).await?;
        let ch = channel(&self.servers[l].addr, Duration::from_secs(3)).await?;
        let r = ClusterClient::new(ch).members(pb::MembersRequest {}).await?.into_inner();
        Ok(r.members.iter().map(|m| (m.id, m.voter)).collect())
    }

    /// Asks the cluster (through its leader) to remove server `i` from the membership.
    pub async fn remove_member(&mut self, i: usize) -> anyhow::Result<()> {
        let l = self.wait_leader(Duration::from_secs(10)).await?;
        let ch = channel(&self.servers[l].addr, Duration::from_secs(10)).await?;
        ClusterClient::new(ch).remove_server(pb::RemoveServerRequest { id: self.servers[i].id }).await?;
        Ok(())
    }

    /// `Internal.Inspect` of server `i`, directly (its peer listener).
    pub async fn inspect(&self, i: usize, from: u64, to: u64) -> anyhow::Result<pb::InspectResponse> {
        // Connecting may take as long as the call: the convergence and log checks ask whether
        // the servers agree, not how fast a server just out of a fault answers a handshake.
        let timeout = Duration::from_secs(5);
        let ep = endpoint(&self.servers[i].peer_addr, timeout)?.connect_timeout(timeout);
        let ch = suanli_security::tls::channel(ep, Some(&server_tls()?));
        let mut c = InternalClient::new(ch).max_decoding_message_size(64 << 20);
        let r = c.inspect(pb::InspectRequest { group: "region".into(), log_from: from, log_to: to }).await?;
        Ok(r.into_inner())
    }

    /// Stops every process: SIGCONT first for paused ones, then SIGKILL. Tasks' shims of the
    /// agents are killed too, by their process groups recorded in the journals.
    pub fn stop_all(&mut self) {
        for i in 0..self.servers.len() {
            self.pause_server(i, false);
            self.kill_server(i);
        }
        for a in 0..self.agents.len() {
            self.pause_agent(a, false);
            self.kill_agent(a);
            kill_tasks(&self.agents[a].dir.join("data"));
        }
    }

    /// A server's log (for failure reports).
    pub fn server_log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("s{}.log", i + 1))).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all();
    }
}

fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Signals a process the harness started: each is the leader of its own process group
/// (`process_group(0)`), so its helpers (an agent's plugin hosts) share its fate. Tasks run in
/// sessions of their own and are not touched.
fn signal(pid: u32, sig: i32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = suanli_agent::sys::kill_group(pid, sig);
    }
}

/// Kills whatever tasks an agent's data directory says still run (harness teardown).
fn kill_tasks(data: &Path) {
    let Ok(rd) = std::fs::read_dir(data.join("allocs")) else { return };
    for e in rd.filter_map(Result::ok) {
        let rec: Option<suanli_agent::TaskRecord> =
            std::fs::read(e.path().join("task.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
        if let Some(r) = rec
            && r.shim.alive()
        {
            let _ = suanli_agent::sys::kill_group(r.shim.pid, libc::SIGKILL);
        }
    }
}
