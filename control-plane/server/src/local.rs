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
//! The servers run TLS with the process's [`LocalPki`] (`--tls-dir`: its server certificate,
//! `suanli://server/server` for localhost, 127.0.0.1 and ::1), unless `--insecure` is among a
//! cluster's flags; the helpers here dial them as the PKI's admin (client listeners) or with
//! the server certificate (peer listeners). [`LocalPki::node`] and [`LocalPki::user`] issue the
//! certificates of agents and users on first ask.
//!
//! What the benchmarks need (start, leader, kill, restart, catch up) is always built; the rest
//! (membership changes, wipes, SIGTERM, restores, port pairs) only serves tests and is behind
//! the `testing` feature, which test crates enable in their dev-dependency on this crate.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_client::ClusterClient;
use suanli_proto::v1::federation_client::FederationClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_security::certs::{self, Leaf};
use suanli_security::tls::{self, Tls, TlsFiles};
use suanli_security::{Principal, Role};
use tonic::transport::{Channel, Endpoint};

/// How long local certificates are valid (the development default, a year).
const VALIDITY: Duration = certs::DEFAULT_VALIDITY;

/// A channel to `addr` as the local PKI's admin, over TLS (connected on the first call, within
/// 5 s; requests within 15 s: generous, because the servers under test share a small machine
/// with the test itself). A server that is down or refuses the handshake fails that call.
pub async fn channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Ok(tls::channel(endpoint(addr)?, Some(&LocalPki::get().admin_tls())))
}

/// The endpoint every helper here dials (`http://addr`; TLS comes from [`tls::channel`]).
fn endpoint(addr: &str) -> Result<Endpoint, tonic::transport::Error> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(15))
        .tcp_nodelay(true))
}

/// The PKI of local clusters (tests, benchmarks, chaos): one development CA per process, made on
/// first use in a temp dir that lives as long as the process, with the server and admin
/// certificates; node and user certificates are issued on first ask. Every cluster this module
/// starts uses it, unless started with `--insecure` among its flags (or with a PKI of its own,
/// [`LocalPki::create`] and [`ProcessCluster::start_with_pki`]).
pub struct LocalPki {
    dir: PathBuf,
    /// Issued leaves by file stem (node and user certificates), so each is issued once.
    issued: Mutex<BTreeMap<String, TlsFiles>>,
    admin_tls: OnceLock<Tls>,
}

impl std::fmt::Debug for LocalPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPki").field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl LocalPki {
    /// The process's PKI (made on the first call, in a temp dir left in place for the life of
    /// the process: server processes it starts read their certificates from it).
    pub fn get() -> &'static LocalPki {
        static PKI: OnceLock<LocalPki> = OnceLock::new();
        PKI.get_or_init(|| {
            let tmp = tempfile::Builder::new()
                .prefix("suanli-pki-")
                .tempdir()
                .expect("a temp dir for the local PKI (is the temp dir writable?)");
            // Kept: the static is never dropped, and servers started from it may outlive a test.
            let dir = tmp.keep().join("pki");
            LocalPki::create(&dir).expect("the local PKI: certs::init in a fresh temp dir")
        })
    }

    /// A PKI of its own in `dir` (`certs::init`: a new CA, the server certificate for
    /// `localhost`, `127.0.0.1` and `::1`, and the admin's): for a cluster whose certificates a
    /// test rotates. Refuses a `dir` that already holds a CA.
    pub fn create(dir: &Path) -> std::io::Result<LocalPki> {
        let hosts: Vec<String> = certs::DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect();
        let admin = Principal::User {
            name: "admin".into(),
            role: Role::Admin,
            team: None,
            credential: suanli_security::principal::Credential::Certificate,
        };
        certs::init(dir, &[Leaf::server("server", &hosts), Leaf::user(admin)], VALIDITY)?;
        Ok(LocalPki { dir: dir.to_owned(), issued: Mutex::new(BTreeMap::new()), admin_tls: OnceLock::new() })
    }

    /// The PKI already in `dir` (`suanli tls init`'s layout, e.g. `suanli dev`'s): its CA issues
    /// the node and user certificates asked for that are not there yet. An error names the
    /// missing file.
    pub fn open(dir: &Path) -> std::io::Result<LocalPki> {
        for stem in ["server", "admin"] {
            let f = certs::paths(dir, stem);
            for p in [&f.ca, &f.cert, &f.key] {
                if !p.is_file() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("{}: missing (make the PKI with `suanli tls init`)", p.display()),
                    ));
                }
            }
        }
        Ok(LocalPki { dir: dir.to_owned(), issued: Mutex::new(BTreeMap::new()), admin_tls: OnceLock::new() })
    }

    /// The directory holding the files (`suanli tls init`'s layout).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The servers' certificate (`suanli://server/server`, hosts localhost, 127.0.0.1 and ::1).
    pub fn server(&self) -> TlsFiles {
        certs::paths(&self.dir, "server")
    }

    /// The admin user's certificate.
    pub fn admin(&self) -> TlsFiles {
        certs::paths(&self.dir, "admin")
    }

    /// Node `id`'s agent certificate (`suanli://node/<id>`, issued on first ask, for the same
    /// hosts as the servers': an agent serves its log service with it).
    pub fn node(&self, id: &str) -> TlsFiles {
        let hosts: Vec<String> = certs::DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect();
        self.issue_once(Leaf::node(id, &hosts))
    }

    /// A user's certificate (issued on first ask; one file pair per name, role and team, so two
    /// asks for one name with different roles get two certificates).
    pub fn user(&self, name: &str, role: Role, team: Option<&str>) -> TlsFiles {
        let principal = Principal::User {
            name: name.to_owned(),
            role,
            team: team.map(str::to_owned),
            credential: suanli_security::principal::Credential::Certificate,
        };
        let stem = match team {
            Some(t) => format!("user-{name}-{role}-{t}"),
            None => format!("user-{name}-{role}"),
        };
        self.issue_once(Leaf { stem, ..Leaf::user(principal) })
    }

    /// The admin's TLS material, loaded (what [`channel`] uses; loaded once).
    pub fn admin_tls(&self) -> Tls {
        self.admin_tls.get_or_init(|| Tls::load(self.admin()).expect("the local PKI's admin certificate loads")).clone()
    }

    fn issue_once(&self, leaf: Leaf) -> TlsFiles {
        let mut issued = self.issued.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = issued.get(&leaf.stem) {
            return f.clone();
        }
        let files = certs::issue(&self.dir, &leaf, VALIDITY)
            .unwrap_or_else(|e| panic!("issuing {} in the local PKI {}: {e}", leaf.stem, self.dir.display()));
        issued.insert(leaf.stem, files.clone());
        files
    }
}

/// A channel to `addr` as `files`' holder (over TLS, verified against its CA; connected on the
/// first call). An unreadable or mismatched file is an error naming it.
pub async fn channel_as(addr: &str, files: &TlsFiles) -> Result<Channel, ChannelError> {
    let tls = Tls::load(files.clone())?;
    Ok(tls::channel(endpoint(addr)?, Some(&tls)))
}

/// Why [`channel_as`] could not make a channel.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The certificate, its key or the CA could not be loaded.
    #[error(transparent)]
    Tls(#[from] suanli_security::tls::TlsError),
    /// The address is not one.
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
}

/// A plaintext channel (connected on the first call), for a cluster started `--insecure`.
pub async fn channel_insecure(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Ok(endpoint(addr)?.connect_lazy())
}

/// The identity the server at `addr` presents in its TLS handshake (verified with `tls`: its
/// CA, and the host of `addr` as the server name), and the certificate's DER: how a test sees
/// which certificate new connections get after a rotation.
pub async fn server_identity(addr: &str, tls: &Tls) -> Result<(Principal, Vec<u8>), String> {
    let sock: std::net::SocketAddr = addr.parse().map_err(|e| format!("{addr:?}: {e}"))?;
    let name = rustls_pki_types::ServerName::from(sock.ip());
    let handshake = async {
        let tcp = tokio::net::TcpStream::connect(sock).await.map_err(|e| format!("connecting to {addr}: {e}"))?;
        let conn = tokio_rustls::TlsConnector::from(tls.client_config())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake with {addr}: {e}"))?;
        let der = conn
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.as_ref().to_vec())
            .ok_or_else(|| format!("{addr} presented no certificate"))?;
        Ok((tls::principal_of(&der), der))
    };
    tokio::time::timeout(Duration::from_secs(10), handshake)
        .await
        .map_err(|_| format!("TLS handshake with {addr}: no answer within 10 s"))?
}

/// The TLS material a [`ProcessCluster`] runs with.
struct ClusterTls {
    /// `--tls-dir` of every server.
    dir: PathBuf,
    /// What its helper calls on client listeners present.
    admin: Tls,
    /// What its helper calls on peer listeners present (`Internal` is for servers only).
    server: Tls,
}

/// Server processes forming one cluster (ids 1..=n).
pub struct ProcessCluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    /// Their client addresses (index i is server id i + 1); empty until its first start.
    pub addrs: Vec<String>,
    /// Their peer addresses (raft, `Internal`), same order; empty until its first start.
    pub peer_addrs: Vec<String>,
    /// Their HTTP listeners' addresses (`/metrics`, the dashboard), same order; empty until its
    /// first start, or while the process serves no HTTP.
    pub http_addrs: Vec<String>,
    procs: Vec<Option<Child>>,
    /// The subcommand each process runs (`server`, or `federation serve`).
    command: Vec<String>,
    extra: Vec<String>,
    env: Vec<(String, String)>,
    /// `None`: the servers run `--insecure` (it is among `extra`).
    tls: Option<ClusterTls>,
}

impl ProcessCluster {
    /// `n` server slots (addresses not known yet) and a temp dir; starts nothing. The servers
    /// run TLS with `pki`'s server certificate, unless `extra` holds `--insecure`.
    fn reserve_with(bin: &Path, n: usize, extra: &[&str], pki: &LocalPki) -> std::io::Result<ProcessCluster> {
        let tls = if extra.contains(&"--insecure") {
            None
        } else {
            let load = |f: TlsFiles| Tls::load(f).map_err(std::io::Error::other);
            Some(ClusterTls { dir: pki.dir().to_owned(), admin: load(pki.admin())?, server: load(pki.server())? })
        };
        let mut c = Self::reserve(bin, n, extra)?;
        c.tls = tls;
        Ok(c)
    }

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
            http_addrs: vec![String::new(); n],
            procs: (0..n).map(|_| None).collect(),
            command: vec!["server".to_owned()],
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            env: Vec::new(),
            tls: None,
        })
    }

    /// Starts `n` servers of binary `bin` (`bin server ...`), with `extra` flags for each: over
    /// TLS with the process's [`LocalPki`] (`--tls-dir`), unless `extra` holds `--insecure`.
    pub fn start(bin: &Path, n: usize, extra: &[&str]) -> std::io::Result<ProcessCluster> {
        Self::start_with_pki(bin, n, extra, LocalPki::get())
    }

    /// [`ProcessCluster::start`] with the certificates of `pki` (a PKI of the cluster's own,
    /// whose files a test may reissue: the servers reload them on a change or SIGHUP).
    pub fn start_with_pki(bin: &Path, n: usize, extra: &[&str], pki: &LocalPki) -> std::io::Result<ProcessCluster> {
        let mut c = Self::reserve_with(bin, n, extra, pki)?;
        c.start_all()?;
        Ok(c)
    }

    /// Starts `n` processes of `bin command ...` (e.g. `command` = `["federation", "serve"]`):
    /// a subcommand that takes `suanli server`'s membership and TLS flags (`--id`,
    /// `--data-dir`, `--listen`, `--peer-listen`, `--peers`, `--bootstrap`, `--tls-dir`) and
    /// prints the same listening line (`suanli server listening ...` or
    /// `suanli federation listening ...`), with `extra` flags for each and `pki`'s certificates.
    pub fn start_command(
        bin: &Path,
        command: &[&str],
        n: usize,
        extra: &[&str],
        pki: &LocalPki,
    ) -> std::io::Result<ProcessCluster> {
        Self::start_command_in(bin, command, n, extra, pki, None)
    }

    /// As [`ProcessCluster::start_command`], with the data directories and logs in a new
    /// directory under `parent` (`None`: the system's temp dir), removed when it is dropped.
    pub fn start_command_in(
        bin: &Path,
        command: &[&str],
        n: usize,
        extra: &[&str],
        pki: &LocalPki,
        parent: Option<&Path>,
    ) -> std::io::Result<ProcessCluster> {
        if command.is_empty() {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "command: empty (e.g. [\"server\"])"));
        }
        let mut c = Self::reserve_with(bin, n, extra, pki)?;
        if let Some(parent) = parent {
            let keep = std::env::var_os("SUANLI_KEEP_CLUSTER_DIR").is_some();
            let prefix = format!("{}-", command.join("-"));
            c.dir = tempfile::Builder::new().prefix(&prefix).disable_cleanup(keep).tempdir_in(parent)?;
        }
        c.command = command.iter().map(|s| (*s).to_owned()).collect();
        c.start_all()?;
        Ok(c)
    }

    /// Whether these processes are federation servers (`suanli federation serve`).
    pub fn is_federation(&self) -> bool {
        self.command.first().is_some_and(|c| c == "federation")
    }

    /// The servers' `--tls-dir` (`None`: they run `--insecure`).
    pub fn tls_dir(&self) -> Option<&Path> {
        self.tls.as_ref().map(|t| t.dir.as_path())
    }

    /// A channel to `addr` (a client address of this cluster) as its PKI's admin, or
    /// plaintext for an `--insecure` cluster; connected on the first call.
    pub fn channel_to(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        Ok(tls::channel(endpoint(addr)?, self.tls.as_ref().map(|t| &t.admin)))
    }

    /// A channel to `addr` (a peer address of this cluster) with the servers' certificate, as
    /// another server calls it, or plaintext for an `--insecure` cluster.
    pub fn peer_channel_to(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        Ok(tls::channel(endpoint(addr)?, self.tls.as_ref().map(|t| &t.server)))
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
        let mut c = Self::reserve_with(bin, n, extra, LocalPki::get())?;
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
        let mut c = Self::reserve_with(bin, n, extra, LocalPki::get())?;
        c.launch(0, &["--bootstrap"])?;
        Ok(c)
    }

    /// `n` servers that have picked their ports but hold no data (e.g. to restore a data dir
    /// naming those ports, then [`ProcessCluster::spawn_initialized`]): each starts once with
    /// empty storage (waiting to be added), its ports are read, then it is stopped and its
    /// data directory removed. Later starts reuse the ports.
    #[cfg(feature = "testing")]
    pub fn prepare(bin: &Path, n: usize, extra: &[&str]) -> std::io::Result<ProcessCluster> {
        let mut c = Self::reserve_with(bin, n, extra, LocalPki::get())?;
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

    /// Sends SIGHUP to server `i` (it reloads its TLS files at once); `false` when it does not
    /// run or the signal could not be sent.
    #[cfg(feature = "testing")]
    pub fn reload_tls(&self, i: usize) -> bool {
        let Some(p) = self.procs[i].as_ref() else { return false };
        Command::new("kill").args(["-HUP", &p.id().to_string()]).status().is_ok_and(|s| s.success())
    }

    /// Server `i`'s process id, when it runs (`suanli bench` reads its memory from /proc).
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
        // `suanli server` serves HTTP (/metrics, the dashboard) on a port of its own, kept
        // across restarts like the others.
        let http: Vec<String> = if self.command == ["server"] || self.is_federation() {
            vec!["--http-listen".to_owned(), or_port_zero(&self.http_addrs[i])]
        } else {
            Vec::new()
        };
        let mut child = Command::new(&self.bin)
            .args(&self.command)
            .args(["--id", &id.to_string(), "--listen", &listen, "--peer-listen", &peer_listen])
            .args(&http)
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("s{}", i + 1)))
            .args(membership)
            .args(self.tls.iter().flat_map(|t| [std::ffi::OsStr::new("--tls-dir"), t.dir.as_os_str()]))
            .args(&self.extra)
            .env("SUANLI_LOG", std::env::var("SUANLI_LOG").unwrap_or_else(|_| "warn,suanli_server=info".into()))
            .env_remove("SUANLI_CONFIG")
            // Every harness call is the local PKI's one admin: no per-caller rate limit (a test
            // that wants one passes --rate-limit-per-s among its flags, or this variable).
            .env("SUANLI_RATE_LIMIT_PER_S", "0")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| std::io::Error::other("the server's stdout"))?;
        let bound = match await_bound(stdout, Duration::from_secs(60)) {
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
        self.http_addrs[i] = bound.http.map(|h| h.to_string()).unwrap_or_default();
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
                if let Ok(ch) = self.channel_to(&self.addrs[i])
                    && let Ok(id) = self.leader_of(ch).await
                {
                    let id = id as usize;
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

    /// The leader id a server names (`Cluster.Leader`, or `Federation.Status` for federation
    /// servers; 0: none known).
    async fn leader_of(&self, ch: Channel) -> Result<u64, tonic::Status> {
        if self.is_federation() {
            let r = FederationClient::new(ch).status(pb::FedStatusRequest {}).await?;
            Ok(r.into_inner().leader_id)
        } else {
            Ok(ClusterClient::new(ch).leader(pb::LeaderRequest {}).await?.into_inner().leader_id)
        }
    }

    /// Waits until server `i` has applied everything the leader had committed when called.
    pub async fn wait_caught_up(&self, i: usize, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        let leader = self.wait_leader(within).await?;
        let target = match self.channel_to(&self.addrs[leader]) {
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
            if let Ok(ch) = self.peer_channel_to(&self.peer_addrs[i])
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

/// What starts the line `suanli federation serve` prints once it listens (the rest is as
/// `suanli server`'s: `client=A peer=B`).
const FEDERATION_LINE_PREFIX: &str = "suanli federation listening";

/// [`crate::listeners::await_line`] for either subcommand: the addresses from the first
/// `suanli server listening ...` or `suanli federation listening ...` line on `stdout`.
fn await_bound(stdout: impl std::io::Read + Send + 'static, within: Duration) -> std::io::Result<crate::Bound> {
    use std::io::BufRead as _;
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        // Read to the end, so the process never blocks on a full pipe.
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(b) = parse_bound(&line)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(b);
            }
        }
    });
    rx.recv_timeout(within).map_err(|e| match e {
        RecvTimeoutError::Timeout => std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no `suanli server|federation listening ...` line on the process's stdout within {within:?}"),
        ),
        RecvTimeoutError::Disconnected => {
            std::io::Error::other("the process closed its stdout (it exited) before it listened")
        }
    })
}

/// A `suanli server listening ...` or `suanli federation listening ...` line's addresses.
fn parse_bound(line: &str) -> Option<crate::Bound> {
    let t = line.trim();
    match t.strip_prefix(FEDERATION_LINE_PREFIX) {
        Some(rest) => crate::Bound::parse_line(&format!("suanli server listening{rest}")),
        None => crate::Bound::parse_line(t),
    }
}

/// `addr`, or a loopback address with port 0 while it is not known.
fn or_port_zero(addr: &str) -> String {
    if addr.is_empty() { "127.0.0.1:0".to_owned() } else { addr.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_pki_issues_each_certificate_once_and_they_name_their_holders() {
        let pki = LocalPki::get();
        assert!(std::ptr::eq(pki, LocalPki::get()), "one PKI per process");
        for f in [pki.server(), pki.admin()] {
            assert!(f.ca.exists() && f.cert.exists() && f.key.exists(), "{f:?}");
        }
        let server = Tls::load(pki.server()).expect("server loads");
        assert_eq!(server.own_identity(), Some(Principal::Server { name: "server".into() }));
        assert_eq!(pki.admin_tls().own_identity().and_then(|p| p.role()), Some(Role::Admin));
        let n1 = pki.node("n1");
        let modified = std::fs::metadata(&n1.cert).and_then(|m| m.modified()).expect("node cert");
        assert_eq!(pki.node("n1"), n1, "cached");
        assert_eq!(
            std::fs::metadata(&n1.cert).and_then(|m| m.modified()).expect("node cert"),
            modified,
            "not reissued"
        );
        assert_eq!(Tls::load(n1).expect("node loads").own_identity(), Some(Principal::Node { name: "n1".into() }));
        let alice = pki.user("alice", Role::Member, Some("nlp"));
        let viewer = pki.user("alice", Role::Viewer, None);
        assert_ne!(alice.cert, viewer.cert, "one file pair per name, role and team");
        let p = Tls::load(alice).expect("user loads").own_identity().expect("names alice");
        assert_eq!((p.role(), p.team()), (Some(Role::Member), Some("nlp")));
        // A second PKI in the same directory is refused (an existing CA is never overwritten).
        assert!(LocalPki::create(pki.dir()).is_err());
    }
}

/// The lease terms of a local federation (`suanli federation serve`'s flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FedTerms {
    /// `--lease-ms`.
    pub lease_ms: u64,
    /// `--sync-interval-ms`.
    pub sync_interval_ms: u64,
    /// `--max-clock-drift-ms`.
    pub max_clock_drift_ms: u64,
    /// `--redispatch-margin-ms`.
    pub redispatch_margin_ms: u64,
    /// `--region-unhealthy-after-ms`.
    pub region_unhealthy_after_ms: u64,
}

impl FedTerms {
    /// Short terms for tests and the dev cluster: a 6 s lease synced every second, 200 ms of
    /// clock drift, a 1 s re-dispatch margin, a region unhealthy after 3 s without a sync.
    pub const SHORT: FedTerms = FedTerms {
        lease_ms: 6_000,
        sync_interval_ms: 1_000,
        max_clock_drift_ms: 200,
        redispatch_margin_ms: 1_000,
        region_unhealthy_after_ms: 3_000,
    };

    /// The flags that set them.
    pub fn flags(&self) -> Vec<String> {
        [
            ("--lease-ms", self.lease_ms),
            ("--sync-interval-ms", self.sync_interval_ms),
            ("--max-clock-drift-ms", self.max_clock_drift_ms),
            ("--redispatch-margin-ms", self.redispatch_margin_ms),
            ("--region-unhealthy-after-ms", self.region_unhealthy_after_ms),
        ]
        .into_iter()
        .flat_map(|(f, v)| [f.to_owned(), v.to_string()])
        .collect()
    }
}

/// One region of a [`FederatedCluster`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// Its name (`--region`), e.g. `us-east`.
    pub name: String,
    /// How many servers its raft group has.
    pub servers: usize,
    /// Its labels (`--region-label k=v`).
    pub labels: Vec<(String, String)>,
    /// More flags for each of its servers (e.g. `--config FILE`).
    pub extra: Vec<String>,
}

impl RegionSpec {
    /// Region `name` of `servers` servers, no labels, no other flags.
    pub fn new(name: &str, servers: usize) -> RegionSpec {
        RegionSpec { name: name.to_owned(), servers, labels: Vec::new(), extra: Vec::new() }
    }
}

/// The names of the regions of [`FederatedCluster`]s, in order (a fourth and later region is
/// `region-4`, ...).
pub const REGION_NAMES: [&str; 3] = ["us-east", "eu-west", "ap-south"];

/// The name of region `i` (0-based) of a local federation.
pub fn region_name(i: usize) -> String {
    REGION_NAMES.get(i).map_or_else(|| format!("region-{}", i + 1), |n| (*n).to_owned())
}

/// Several regions and their federation, all real processes on loopback with one PKI: the
/// federation's voters (`suanli federation serve`, one "in" each region) start first, then each
/// region's servers (`suanli server --region NAME --federation A,B,C`). What `suanli dev
/// --regions N` and the federation suites run; agents are the caller's.
///
/// ```text
///   federation: ProcessCluster(federation serve) ×voters ◀──Sync── region leaders
///   regions:    [ProcessCluster(server --region us-east --federation ...), eu-west, ap-south, ...]
/// ```
pub struct FederatedCluster {
    /// The federation's voters.
    pub federation: ProcessCluster,
    /// The regions, in the order given, by name.
    pub regions: Vec<(String, ProcessCluster)>,
    /// The terms the federation runs with.
    pub terms: FedTerms,
}

impl FederatedCluster {
    /// Starts `voters` federation servers with `terms`, then every region of `regions`, all
    /// with `pki`'s certificates; data directories under `parent` (`None`: temp dirs). Returns
    /// once every process listens (not yet once regions have synced: see
    /// [`FederatedCluster::wait_healthy`]).
    pub fn start(
        bin: &Path,
        regions: &[RegionSpec],
        voters: usize,
        terms: FedTerms,
        pki: &LocalPki,
        parent: Option<&Path>,
    ) -> std::io::Result<FederatedCluster> {
        let flags = terms.flags();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let federation = ProcessCluster::start_command_in(bin, &["federation", "serve"], voters, &flags, pki, parent)?;
        let fed = federation.addrs.join(",");
        let mut out = Vec::new();
        for r in regions {
            let mut extra = vec!["--region".to_owned(), r.name.clone(), "--federation".to_owned(), fed.clone()];
            for (k, v) in &r.labels {
                extra.extend(["--region-label".to_owned(), format!("{k}={v}")]);
            }
            extra.extend(r.extra.iter().cloned());
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let c = ProcessCluster::start_command_in(bin, &["server"], r.servers, &extra, pki, parent)?;
            out.push((r.name.clone(), c));
        }
        Ok(FederatedCluster { federation, regions: out, terms })
    }

    /// The federation servers' client addresses.
    pub fn federation_addrs(&self) -> Vec<String> {
        self.federation.addrs.clone()
    }

    /// Region `name`'s servers; `None` when there is no such region.
    pub fn region(&self, name: &str) -> Option<&ProcessCluster> {
        self.regions.iter().find(|(n, _)| n == name).map(|(_, c)| c)
    }

    /// Region `name`'s servers, mutably.
    pub fn region_mut(&mut self, name: &str) -> Option<&mut ProcessCluster> {
        self.regions.iter_mut().find(|(n, _)| n == name).map(|(_, c)| c)
    }

    /// The region directory from a running federation server (`Federation.Regions`).
    pub async fn regions_info(&self) -> Result<pb::FedRegionsResponse, String> {
        let mut last = String::from("no federation server runs");
        for addr in self.federation.alive_addrs() {
            let ch = match self.federation.channel_to(&addr) {
                Ok(ch) => ch,
                Err(e) => {
                    last = format!("{addr}: {e}");
                    continue;
                }
            };
            match FederationClient::new(ch).regions(pb::FedRegionsRequest {}).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        Err(last)
    }

    /// Waits until the federation has a leader and every region shows healthy in
    /// `Federation.Regions`; the directory then. The error names the regions still missing
    /// or unhealthy, and the last answer.
    pub async fn wait_healthy(&self, within: Duration) -> Result<pb::FedRegionsResponse, String> {
        let deadline = Instant::now() + within;
        self.federation.wait_leader(within).await?;
        loop {
            let last = self.regions_info().await;
            if let Ok(r) = &last {
                let missing: Vec<&str> = self
                    .regions
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .filter(|n| !r.regions.iter().any(|x| x.name == *n && x.healthy))
                    .collect();
                if missing.is_empty() {
                    return last;
                }
                if Instant::now() >= deadline {
                    return Err(format!("regions {missing:?} not healthy within {within:?}; directory: {r:?}"));
                }
            } else if Instant::now() >= deadline {
                return Err(format!("the federation's regions not readable within {within:?}: {last:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits for every region's leader, then makes (or replaces) its queue `default` with no
    /// quota limit and team `default`: a federated job lands in the queue its spec names.
    pub async fn default_queues(&self, within: Duration) -> Result<(), String> {
        let q = serde_json::json!({"id": "default", "team": "default",
            "nominal": {"cpu_milli": u64::MAX, "memory_mib": u64::MAX, "gpu_milli": u64::MAX, "npu_milli": u64::MAX}});
        for (name, c) in &self.regions {
            let deadline = Instant::now() + within;
            loop {
                let leader = c.wait_leader(within).await.map_err(|e| format!("region {name}: {e}"))?;
                let r = match c.channel_to(&c.addrs[leader]) {
                    Ok(ch) => QueuesClient::new(ch)
                        .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                match r {
                    Ok(()) => break,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(format!("region {name}: creating queue default: {e}"));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
        Ok(())
    }
}
