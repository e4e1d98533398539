//! A local cluster of real `suanli server` processes on loopback ports, each with its own
//! RocksDB directory in a temp dir: what the end-to-end tests, `suanli bench submit` and
//! `suanli bench failover` run against. Processes are killed (SIGKILL) when it is dropped.
//! The first start of [`ProcessCluster::start`] bootstraps (`--bootstrap --peers ...`), as an
//! operator creates a cluster.
//!
//! No port is looked for: a server's first start gives it port 0 for both listeners and reads
//! the ports it bound from the `suanli server listening client=... peer=...` line on its
//! stdout ([`suanli_server::listeners::await_line`]); every later start of it reuses them (the
//! cluster's membership names them). To list the others as initial voters, server 1 starts
//! last: servers 2..n start first and wait to be added.
//!
//! What the benchmarks need (start, leader, kill, restart, catch up) is always built; the rest
//! (membership changes, wipes, SIGTERM, restores, port pairs) only serves tests and is behind
//! the `testing` feature, which test crates enable in their dev-dependency on this crate.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use tonic::transport::{Channel, Endpoint};

/// A connected channel as the local PKI's admin, over TLS (connect within 5 s, requests within
/// 15 s: generous, because the servers under test share a small machine with the test itself).
pub async fn channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(15))
        .tcp_nodelay(true)
        .connect()
        .await
}

/// The PKI of local clusters (tests, benchmarks, chaos): one development CA per process, made on
/// first use in a temp dir that lives as long as the process, with the server and admin
/// certificates; node and user certificates are issued on first ask. Every cluster this module
/// starts uses it, unless started with `--insecure` among its flags.
pub struct LocalPki {
    #[allow(dead_code)]
    dir: PathBuf,
}

impl LocalPki {
    /// The process's PKI (made on the first call).
    pub fn get() -> &'static LocalPki {
        todo!("h-wire-srv")
    }
    /// The directory holding the files (`suanli tls init`'s layout).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The servers' certificate (`suanli://server/server`, hosts localhost and 127.0.0.1).
    pub fn server(&self) -> suanli_security::tls::TlsFiles {
        todo!("h-wire-srv")
    }
    /// The admin user's certificate.
    pub fn admin(&self) -> suanli_security::tls::TlsFiles {
        todo!("h-wire-srv")
    }
    /// Node `id`'s agent certificate (issued on first ask).
    pub fn node(&self, id: &str) -> suanli_security::tls::TlsFiles {
        let _ = id;
        todo!("h-wire-srv")
    }
    /// A user's certificate (issued on first ask).
    pub fn user(&self, name: &str, role: suanli_security::Role, team: Option<&str>) -> suanli_security::tls::TlsFiles {
        let _ = (name, role, team);
        todo!("h-wire-srv")
    }
    /// The admin's TLS material, loaded (what [`channel`] uses).
    pub fn admin_tls(&self) -> suanli_security::tls::Tls {
        todo!("h-wire-srv")
    }
}

/// A connected channel as `files`' holder (over TLS, verified against its CA).
pub async fn channel_as(
    addr: &str,
    files: &suanli_security::tls::TlsFiles,
) -> Result<Channel, tonic::transport::Error> {
    let _ = (addr, files);
    todo!("h-wire-srv")
}

/// A connected plaintext channel, for a cluster started `--insecure`.
pub async fn channel_insecure(addr: &str) -> Result<Channel, tonic::transport::Error> {
    let _ = addr;
    todo!("h-wire-srv")
}

/// Server processes forming one cluster (ids 1..=n).
pub struct ProcessCluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    /// Their client addresses (index i is server id i + 1); empty until its first start.
    pub addrs: Vec<String>,
    /// Their peer addresses (raft, `Internal`), same order; empty until its first start.
    pub peer_addrs: Vec<String>,
    procs: Vec<Option<Child>>,
    extra: Vec<String>,
    env: Vec<(String, String)>,
}

impl ProcessCluster {
    /// `n` server slots (addresses not known yet) and a temp dir; starts nothing.
    fn reserve(bin: &Path, n: usize, extra: &[&str]) -> std::io::Result<ProcessCluster> {
        // SUANLI_KEEP_CLUSTER_DIR=1 keeps the data directories and logs for a post-mortem.
        let keep = std::env::var_os("SUANLI_KEEP_CLUSTER_DIR").is_some();
        let dir = tempfile::Builder::new().prefix("suanli-cluster-").disable_cleanup(keep).tempdir()?;
        if keep {
            eprintln!("keeping the cluster's data and logs in {}", dir.path().display());
        }
        Ok(ProcessCluster {
            bin: bin.to_owned(),
            dir,
            addrs: vec![String::new(); n],
            peer_addrs: vec![String::new(); n],
            procs: (0..n).map(|_| None).collect(),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            env: Vec::new(),
        })
    }

    /// Starts `n` servers of binary `bin` (`bin server ...`), with `extra` flags for each.
    pub fn start(bin: &Path, n: usize, extra: &[&str]) -> std::io::Result<ProcessCluster> {
        let mut c = Self::reserve(bin, n, extra)?;
        c.start_all()?;
        Ok(c)
    }

    /// First starts of every server: 2..n wait to be added, then 1 bootstraps them all.
    fn start_all(&mut self) -> std::io::Result<()> {
        for i in 1..self.addrs.len() {
            self.launch(i, &[])?;
        }
        self.spawn(0)
    }

    /// Like [`ProcessCluster::start`], with environment variables for every server (e.g.
    /// `SUANLI_FAILPOINTS` in a build that has them).
    #[cfg(feature = "testing")]
    pub fn start_env(bin: &Path, n: usize, extra: &[&str], env: &[(&str, &str)]) -> std::io::Result<ProcessCluster> {
        let mut c = Self::reserve(bin, n, extra)?;
        c.env = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        c.start_all()?;
        Ok(c)
    }

    /// The temp dir holding data directories and logs.
    #[cfg(feature = "testing")]
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `n` slots, but starts only server 1, as a single-server cluster; the others can be
    /// started later with [`ProcessCluster::spawn_joining`] (their ports picked then).
    #[cfg(feature = "testing")]
    pub fn start_one_of(bin: &Path, n: usize, extra: &[&str]) -> std::io::Result<ProcessCluster> {
        let mut c = Self::reserve(bin, n, extra)?;
        c.launch(0, &["--bootstrap"])?;
        Ok(c)
    }

    /// `n` servers that have picked their ports but hold no data (e.g. to restore a data dir
    /// naming those ports, then [`ProcessCluster::spawn_initialized`]): each starts once with
    /// empty storage (waiting to be added), its ports are read, then it is stopped and its
    /// data directory removed. Later starts reuse the ports.
    #[cfg(feature = "testing")]
    pub fn prepare(bin: &Path, n: usize, extra: &[&str]) -> std::io::Result<ProcessCluster> {
        let mut c = Self::reserve(bin, n, extra)?;
        for i in 0..n {
            c.launch(i, &[])?;
            c.kill(i);
            c.wipe(i)?;
        }
        Ok(c)
    }

    /// Server `i`'s data directory.
    #[cfg(feature = "testing")]
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("s{}", i + 1))
    }

    /// Starts server `i` with neither `--peers` nor `--join`: for a data dir that is already
    /// initialized (a restored one).
    #[cfg(feature = "testing")]
    pub fn spawn_initialized(&mut self, i: usize) -> std::io::Result<()> {
        self.launch(i, &[])
    }

    /// Waits up to `within` for server `i` to exit on its own; its exit status (`None`: still
    /// running, or not started).
    #[cfg(feature = "testing")]
    pub fn wait_exit(&mut self, i: usize, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            let p = self.procs[i].as_mut()?;
            if let Ok(Some(st)) = p.try_wait() {
                self.procs[i] = None;
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts server `i` with `--join` through server `via` (a new member of a running cluster).
    #[cfg(feature = "testing")]
    pub fn spawn_joining(&mut self, i: usize, via: usize) -> std::io::Result<()> {
        let join = self.addrs[via].clone();
        self.launch(i, &["--join", &join])
    }

    /// Starts (or restarts) server `i` (0-based) on its data directory, with `--bootstrap`
    /// and the initial voters (a restart with storage ignores both).
    pub fn spawn(&mut self, i: usize) -> std::io::Result<()> {
        let peers = self.peers_flag();
        self.launch(i, &["--bootstrap", "--peers", &peers])
    }

    /// Starts server `i` with its original `--peers` but without `--bootstrap`: what a wiped
    /// server restarted by the same unit does. With empty storage it waits to be added.
    #[cfg(feature = "testing")]
    pub fn spawn_waiting(&mut self, i: usize) -> std::io::Result<()> {
        let peers = self.peers_flag();
        self.launch(i, &["--peers", &peers])
    }

    /// Starts server `i`'s addresses and data directory under raft id `id`, with `membership`
    /// flags (e.g. `--join A`): how tests try a reused id.
    #[cfg(feature = "testing")]
    pub fn spawn_as(&mut self, i: usize, id: u64, membership: &[&str]) -> std::io::Result<()> {
        self.launch_as(i, id, membership)
    }

    /// Deletes server `i`'s data directory (stop it first).
    #[cfg(feature = "testing")]
    pub fn wipe(&mut self, i: usize) -> std::io::Result<()> {
        let d = self.dir.path().join(format!("s{}", i + 1));
        match std::fs::remove_dir_all(&d) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Sends SIGTERM to server `i` and waits up to `within` for it to exit; SIGKILL after
    /// that, as systemd does. Answers its exit status and how long it took, or `None` (with
    /// the time) when it had to be killed.
    #[cfg(feature = "testing")]
    pub fn terminate(&mut self, i: usize, within: Duration) -> (Option<std::process::ExitStatus>, Duration) {
        let t = Instant::now();
        let Some(mut p) = self.procs[i].take() else { return (None, Duration::ZERO) };
        let _ = Command::new("kill").args(["-TERM", &p.id().to_string()]).status();
        loop {
            if let Ok(Some(st)) = p.try_wait() {
                return (Some(st), t.elapsed());
            }
            if t.elapsed() >= within {
                let _ = p.kill();
                let _ = p.wait();
                return (None, t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Server `i`'s process id, when it runs.
    #[cfg(feature = "testing")]
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.procs[i].as_ref().map(Child::id)
    }

    /// `--peers` for every slot; a slot not started yet gets port 0 (valid only for the server
    /// being started: its own entry becomes the ports it binds).
    fn peers_flag(&self) -> String {
        let peers: Vec<String> = self
            .addrs
            .iter()
            .zip(&self.peer_addrs)
            .enumerate()
            .map(|(k, (a, p))| format!("{}={}/{}", k + 1, or_port_zero(a), or_port_zero(p)))
            .collect();
        peers.join(",")
    }

    fn launch(&mut self, i: usize, membership: &[&str]) -> std::io::Result<()> {
        self.launch_as(i, (i + 1) as u64, membership)
    }

    fn launch_as(&mut self, i: usize, id: u64, membership: &[&str]) -> std::io::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("s{}.log", i + 1)))?;
        let (listen, peer_listen) = (or_port_zero(&self.addrs[i]), or_port_zero(&self.peer_addrs[i]));
        let mut child = Command::new(&self.bin)
            .arg("server")
            .args(["--id", &id.to_string(), "--listen", &listen, "--peer-listen", &peer_listen])
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("s{}", i + 1)))
            .args(membership)
            .args(&self.extra)
            .env("SUANLI_LOG", std::env::var("SUANLI_LOG").unwrap_or_else(|_| "warn,suanli_server=info".into()))
            .env_remove("SUANLI_CONFIG")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| std::io::Error::other("the server's stdout"))?;
        let bound = match crate::listeners::await_line(stdout, Duration::from_secs(60)) {
            Ok(b) => b,
            Err(e) => {
                let _ = child.kill();
                let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("server {} ({status}): {e}; its log:\n{}", i + 1, self.log(i)),
                ));
            }
        };
        (self.addrs[i], self.peer_addrs[i]) = (bound.client.to_string(), bound.peer.to_string());
        self.procs[i] = Some(child);
        Ok(())
    }

    /// SIGKILL server `i` and reap it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.procs[i].take() {
            let _ = p.kill();
            let _ = p.wait();
        }
    }

    /// Indices of running servers.
    pub fn alive(&self) -> Vec<usize> {
        (0..self.addrs.len()).filter(|i| self.procs[*i].is_some()).collect()
    }

    /// Addresses of running servers.
    pub fn alive_addrs(&self) -> Vec<String> {
        self.alive().into_iter().map(|i| self.addrs[i].clone()).collect()
    }

    /// Server `i`'s log.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("s{}.log", i + 1))).unwrap_or_default()
    }

    /// Waits until a running server names a running leader; returns the leader's index.
    pub async fn wait_leader(&self, within: Duration) -> Result<usize, String> {
        let deadline = Instant::now() + within;
        loop {
            for i in self.alive() {
                if let Ok(ch) = channel(&self.addrs[i]).await
                    && let Ok(r) = ClusterClient::new(ch).leader(pb::LeaderRequest {}).await
                {
                    let id = r.into_inner().leader_id as usize;
                    if id >= 1 && self.procs.get(id - 1).is_some_and(Option::is_some) {
                        return Ok(id - 1);
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(format!("no leader within {within:?}; server 1 log:\n{}", self.log(0)));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until server `i` has applied everything the leader had committed when called.
    pub async fn wait_caught_up(&self, i: usize, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        let leader = self.wait_leader(within).await?;
        let target = match channel(&self.addrs[leader]).await {
            Ok(ch) => ClusterClient::new(ch)
                .members(pb::MembersRequest {})
                .await
                .map(|r| r.into_inner().commit_index)
                .unwrap_or(0),
            Err(_) => 0,
        };
        // Applied here, asked of this server alone (`Internal.Inspect` on its peer listener is
        // never forwarded; `Cluster.Members` through a follower answers with the leader's view).
        loop {
            if let Ok(ch) = channel(&self.peer_addrs[i]).await
                && let Ok(r) = suanli_proto::v1::internal_client::InternalClient::new(ch)
                    .inspect(pb::InspectRequest { group: "region".into(), log_from: 0, log_to: 0 })
                    .await
                && r.into_inner().applied_index >= target
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("server {} did not catch up to {target} within {within:?}", i + 1));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        for i in 0..self.procs.len() {
            self.kill(i);
        }
    }
}

/// `addr`, or a loopback address with port 0 while it is not known.
fn or_port_zero(addr: &str) -> String {
    if addr.is_empty() { "127.0.0.1:0".to_owned() } else { addr.to_owned() }
}
