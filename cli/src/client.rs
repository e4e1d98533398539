//! Client commands: `suanli job|queue|pool|node|cluster ...`, talking gRPC to any server.
//!
//! ```text
//!   --server a:7400,b:7400,c:7400 (env SUANLI_ADDR)
//!      │ connect (2 s timeout) ─ refused / UNAVAILABLE ──▶ next address
//!      │ no answer in 2 s and no answer to a 1 s probe (hung, stopped, removed) ──▶ next address
//!      │ error carrying `suanli-leader: host:port` metadata ──▶ retry there once
//!      ▼
//!   Jobs | Queues | Pools | Nodes | Cluster | Agent   (each request: 10 s timeout; watch: none)
//! ```
//!
//! A listed server that accepts connections but never answers (SIGSTOPped, wedged) costs at
//! most the 2 s wait and the 1 s probe (`Cluster.Leader` on the same connection); a server that
//! answers the probe is only slow, and the request keeps its full timeout there.
//!
//! `job submit` retries transport failures with the same `client_request_id`, so a retried
//! submission never creates a second job. Spec files are loaded and validated locally first
//! ([`crate::spec`]); the `validate` commands do only that and need no server.

use crate::spec;
use anyhow::{Context, anyhow, bail};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use suanli_proto::v1 as pb;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// Server address used when neither `--server` nor `SUANLI_ADDR` is given.
pub const DEFAULT_ADDR: &str = "127.0.0.1:7400";
/// Time allowed to open a connection to one server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Time allowed for one unary request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request waits for its answer before the server is probed.
const FIRST_ANSWER: Duration = Duration::from_secs(2);
/// How long the probe of a server that has not answered yet may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Response metadata key naming the leader's address.
const LEADER_KEY: &str = "suanli-leader";
/// Attempts of one submission (same request id) on transport failures.
const SUBMIT_ATTEMPTS: u32 = 5;
/// Largest page the list commands ask for (the server may answer fewer, bounded in bytes).
const PAGE: u32 = 500;

/// Largest reply the CLI accepts: the reply limit of a server left at its defaults (4 x 4 MiB),
/// which one whole job (`job status`, `job watch`) may reach; list pages stay under 4 MiB.
const MAX_REPLY_BYTES: usize = 4 * suanli_proto::DEFAULT_MAX_MESSAGE_BYTES;

/// A `Jobs` client that accepts replies up to [`MAX_REPLY_BYTES`].
fn jobs_client(ch: Channel) -> pb::jobs_client::JobsClient<Channel> {
    pb::jobs_client::JobsClient::new(ch).max_decoding_message_size(MAX_REPLY_BYTES)
}

/// How results are printed.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Aligned plain-text tables.
    Table,
    /// JSON (one document; `job watch` prints one object per line).
    Json,
}

/// Where the servers are and how to print.
#[derive(Args, Debug, Clone)]
pub struct ConnArgs {
    /// Server addresses, host:port, comma-separated; tried in order until one answers.
    #[arg(long = "server", global = true, env = "SUANLI_ADDR", default_value = DEFAULT_ADDR, value_delimiter = ',')]
    pub servers: Vec<String>,
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// `suanli job ...`.
#[derive(Args, Debug)]
pub struct JobArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: JobCmd,
}

/// Job commands.
#[derive(Subcommand, Debug)]
pub enum JobCmd {
    /// Validate a job spec file (.toml or .json) without a server; prints the normalized JSON.
    Validate {
        /// The spec file.
        file: PathBuf,
    },
    /// Submit job spec files (.toml or .json). Several files are all validated first, then
    /// sent together (`SubmitMany`, up to 1,024 jobs per call); each is accepted or refused on
    /// its own.
    Submit {
        /// The spec files.
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// De-duplication key: submitting again with the same id returns the first job.
        /// Generated when absent. With several files, the k-th file's job (k from 1, in the
        /// order given) uses `ID-k`.
        #[arg(long)]
        request_id: Option<String>,
    },
    /// Show a job and its allocations.
    Status {
        /// Job id.
        id: u64,
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// List jobs.
    List {
        /// Only jobs of this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only jobs in these states (repeat or comma-separate): pending, placed, running,
        /// preempted, requeuing, succeeded, failed, cancelled.
        #[arg(long = "state", value_delimiter = ',')]
        states: Vec<String>,
        /// Most jobs shown (default: every one, page after page).
        #[arg(long)]
        limit: Option<u32>,
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// Cancel a job.
    Cancel {
        /// Job id.
        id: u64,
        /// Why (recorded on the job).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Print a task's stdout (or stderr) as its node's agent recorded it.
    Logs {
        /// Job id.
        id: u64,
        /// The task, as `GROUP-REPLICA` (e.g. `worker-0`); default: the job's first task.
        #[arg(long)]
        task: Option<String>,
        /// A specific allocation (default: the task's latest attempt).
        #[arg(long)]
        alloc: Option<u64>,
        /// Show stderr instead of stdout.
        #[arg(long)]
        stderr: bool,
        /// Only the last BYTES bytes.
        #[arg(long, value_name = "BYTES")]
        tail: Option<u64>,
        /// Keep printing as the task writes, until it ends or Ctrl-C.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Print job changes as they happen, one line per event, until Ctrl-C.
    Watch {
        /// Only this job (default: all jobs).
        id: Option<u64>,
        /// Start after this state revision (0: the current state first).
        #[arg(long, default_value_t = 0)]
        from_revision: u64,
    },
}

/// `suanli queue ...`.
#[derive(Args, Debug)]
pub struct QueueArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: QueueCmd,
}

/// Queue commands.
#[derive(Subcommand, Debug)]
pub enum QueueCmd {
    /// Validate a queue file without a server; prints the normalized JSON.
    Validate {
        /// The queue file (.toml or .json).
        file: PathBuf,
    },
    /// Create or replace a queue from a file (.toml or .json).
    Apply {
        /// The queue file.
        file: PathBuf,
    },
    /// List queues with their quota and usage.
    List {
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// Show one queue.
    Get {
        /// Queue id.
        id: String,
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// Delete a queue.
    Delete {
        /// Queue id.
        id: String,
    },
}

/// `suanli pool ...`.
#[derive(Args, Debug)]
pub struct PoolArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: PoolCmd,
}

/// Pool commands.
#[derive(Subcommand, Debug)]
pub enum PoolCmd {
    /// List pools with their capacity and usage.
    List {
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
}

/// `suanli node ...`.
#[derive(Args, Debug)]
pub struct NodeArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: NodeCmd,
}

/// Node commands.
#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Validate a node file without a server; prints the normalized JSON.
    Validate {
        /// The node file (.toml or .json).
        file: PathBuf,
    },
    /// List nodes.
    List {
        /// Only nodes of this pool.
        #[arg(long)]
        pool: Option<String>,
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// Show one node and its devices.
    Get {
        /// Node id.
        id: String,
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// Stop new placements on a node; running work stays.
    Cordon {
        /// Node id.
        id: String,
    },
    /// Stop new placements and move the node's work elsewhere (through the preemption
    /// path: checkpoint first where the job allows it).
    Drain {
        /// Node id.
        id: String,
        /// Let running work go on this long before it is evicted (e.g. 90s, 10m, 1h; plain
        /// numbers are seconds). Nothing new is placed meanwhile.
        #[arg(long, value_parser = parse_duration_s, default_value = "0")]
        grace: u64,
        /// Disruption budget: evict at most this many jobs at once; the next goes when an
        /// evicted one runs again elsewhere (0: no limit).
        #[arg(long, default_value_t = 0)]
        max_unavailable: u32,
        /// Wait until no allocation is left on the node, printing progress.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up (exit 2) after this long (e.g. 30m).
        #[arg(long, value_parser = parse_duration_s, default_value = "1h")]
        timeout: u64,
    },
    /// Make a cordoned or draining node schedulable again.
    Uncordon {
        /// Node id.
        id: String,
    },
    /// Register a node from a file as an agent would (for tests and dev clusters).
    Register {
        /// The node file (.toml or .json).
        file: PathBuf,
        /// Keep heartbeating until Ctrl-C, so the node stays ready.
        #[arg(long)]
        keep_alive: bool,
    },
}

/// `suanli cluster ...`.
#[derive(Args, Debug)]
pub struct ClusterArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: ClusterCmd,
}

/// Cluster membership commands.
#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// List the servers, their roles and replication progress.
    Members,
    /// Show the current leader.
    Leader,
    /// Add a server: it catches up as a learner, then becomes a voter unless --learner-only.
    AddServer {
        /// Its raft node id.
        #[arg(long)]
        id: u64,
        /// Its client address, host:port.
        #[arg(long)]
        addr: String,
        /// Its peer address, host:port (default: --addr's port + 1).
        #[arg(long, default_value = "")]
        peer_addr: String,
        /// Keep it a non-voting learner.
        #[arg(long)]
        learner_only: bool,
    },
    /// Remove a server from the cluster.
    RemoveServer {
        /// Its raft node id.
        #[arg(long)]
        id: u64,
    },
    /// Check that the servers agree: every member's digest of its applied log at the
    /// leader's commit index, compared. Exits non-zero on a mismatch or a member that does
    /// not answer.
    Check {
        /// Compare at this log index instead of the leader's commit index.
        #[arg(long)]
        index: Option<u64>,
        /// How long each server may take to apply up to the index, in milliseconds.
        #[arg(long, default_value_t = 5_000)]
        wait_ms: u64,
    },
    /// Build a snapshot now.
    Snapshot,
    /// The server's build, the command kinds it applies, and whether it halted at a log
    /// entry it cannot apply (then the group is read-only there).
    Version,
    /// Online backup: the state at a linearizable point, through any server, written to FILE
    /// (checked, then renamed into place). Restore it with `cluster restore`.
    Backup {
        /// The backup file to write (replaced if it exists).
        file: PathBuf,
    },
    /// Offline: write a NEW data dir for a new one-server cluster (a new cluster id, a fresh
    /// log, this server the only member) from a backup FILE, or from a stopped server's data
    /// dir (--from-data-dir: recovery from a lost quorum). Then `suanli server --data-dir DIR
    /// --id N --listen ...` starts it; add the other servers with --join.
    Restore {
        /// The backup file (`cluster backup`); or give --from-data-dir.
        #[arg(required_unless_present = "from_data_dir", conflicts_with = "from_data_dir")]
        file: Option<PathBuf>,
        /// A stopped server's data dir to rebuild from (read, never changed).
        #[arg(long)]
        from_data_dir: Option<PathBuf>,
        /// The new data dir (must not exist, or be empty).
        #[arg(long)]
        data_dir: PathBuf,
        /// The raft id of the server that will run on it.
        #[arg(long)]
        id: u64,
        /// Its client listener, as `suanli server --listen` will get it.
        #[arg(long)]
        listen: String,
        /// Its advertised client address (default: --listen).
        #[arg(long)]
        advertise: Option<String>,
        /// Its peer listener (default: --listen's port + 1).
        #[arg(long)]
        peer_listen: Option<String>,
        /// Its advertised peer address (default: the peer listener).
        #[arg(long)]
        peer_advertise: Option<String>,
    },
    /// Skip the log entry the group halted at (a command no server can apply); every server
    /// applies again after it. Give the index and kind `cluster version` shows.
    SkipEntry {
        /// The halted entry's index.
        #[arg(long)]
        index: u64,
        /// Its command kind, as `cluster version` names it.
        #[arg(long)]
        kind: String,
    },
}

/// One client command group.
#[derive(Debug)]
pub enum ClientCmd {
    /// `suanli job`.
    Job(JobArgs),
    /// `suanli queue`.
    Queue(QueueArgs),
    /// `suanli pool`.
    Pool(PoolArgs),
    /// `suanli node`.
    Node(NodeArgs),
    /// `suanli cluster`.
    Cluster(ClusterArgs),
}

/// Runs a client command on a single-threaded tokio runtime.
pub fn run(cmd: ClientCmd) -> anyhow::Result<()> {
    // Commands that need no server run without a runtime.
    match &cmd {
        ClientCmd::Job(JobArgs { cmd: JobCmd::Validate { file }, .. }) => return print_json(&spec::load_job(file)?),
        ClientCmd::Queue(QueueArgs { cmd: QueueCmd::Validate { file }, .. }) => {
            return print_json(&spec::load_queue(file)?);
        }
        ClientCmd::Node(NodeArgs { cmd: NodeCmd::Validate { file }, .. }) => {
            return print_json(&spec::load_node(file)?);
        }
        _ => {}
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async move {
        match cmd {
            ClientCmd::Job(a) => job(a.conn, a.cmd).await,
            ClientCmd::Queue(a) => queue(a.conn, a.cmd).await,
            ClientCmd::Pool(a) => pool(a.conn, a.cmd).await,
            ClientCmd::Node(a) => node(a.conn, a.cmd).await,
            ClientCmd::Cluster(a) => cluster(a.conn, a.cmd).await,
        }
    })
}

fn print_json<T: serde::Serialize>(t: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(t)?);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Connections.

/// The canonical gRPC name of a status code.
fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A gRPC error as `<code>: <message>`.
fn status_err(s: Status) -> anyhow::Error {
    anyhow!("{}: {}", code_name(s.code()), s.message())
}

/// `call`'s answer, or `None` when the server is hung: no answer within [`FIRST_ANSWER`] and
/// none to a `Cluster.Leader` probe on the same connection within [`PROBE_TIMEOUT`]. A server
/// that answers the probe is alive and only slow: the call keeps waiting (its own timeout).
async fn answer_unless_hung<T>(ch: Channel, call: impl Future<Output = T>) -> Option<T> {
    tokio::pin!(call);
    tokio::select! {
        r = &mut call => return Some(r),
        () = tokio::time::sleep(FIRST_ANSWER) => {}
    }
    let probe = async move {
        let mut req = tonic::Request::new(pb::LeaderRequest {});
        req.set_timeout(PROBE_TIMEOUT);
        tokio::time::timeout(PROBE_TIMEOUT, pb::cluster_client::ClusterClient::new(ch).leader(req)).await
    };
    tokio::select! {
        r = &mut call => Some(r),
        // An answer from the server, even an error, shows it is alive (only slow); a
        // timeout or a transport failure of the probe is a hung or gone server.
        p = probe => match p {
            Ok(Ok(_)) => Some(call.await),
            Ok(Err(s)) if !matches!(
                s.code(),
                tonic::Code::Cancelled | tonic::Code::DeadlineExceeded | tonic::Code::Unavailable | tonic::Code::Unknown
            ) => Some(call.await),
            _ => None,
        },
    }
}

/// The leader address an error names in its metadata, if any.
fn leader_of(s: &Status) -> Option<String> {
    let v = s.metadata().get(LEADER_KEY)?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

/// Connections to a list of servers; remembers the one that last answered.
struct Conn {
    addrs: Vec<String>,
    current: Option<(String, Channel)>,
    request_timeout: Option<Duration>,
}

impl Conn {
    fn new(args: &ConnArgs) -> anyhow::Result<Self> {
        let addrs: Vec<String> = args.servers.iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect();
        if addrs.is_empty() {
            anyhow::bail!("--server: no address given (expected host:port[,host:port...])");
        }
        Ok(Self { addrs, current: None, request_timeout: Some(REQUEST_TIMEOUT) })
    }

    /// The same servers, without a request timeout (for streams).
    fn streaming(&self) -> Self {
        Self { addrs: self.addrs.clone(), current: None, request_timeout: None }
    }

    async fn connect(&self, addr: &str) -> Result<Channel, String> {
        let uri = if addr.contains("://") { addr.to_owned() } else { format!("http://{addr}") };
        let mut ep =
            Endpoint::from_shared(uri).map_err(|e| format!("bad address: {e}"))?.connect_timeout(CONNECT_TIMEOUT);
        if let Some(t) = self.request_timeout {
            ep = ep.timeout(t);
        }
        match tokio::time::timeout(CONNECT_TIMEOUT + Duration::from_millis(500), ep.connect()).await {
            Ok(Ok(ch)) => Ok(ch),
            Ok(Err(e)) => {
                let mut msg = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    let part = s.to_string();
                    if !msg.contains(&part) {
                        msg = format!("{msg}: {part}");
                    }
                    src = s.source();
                }
                Err(msg)
            }
            Err(_) => Err("connect timed out".into()),
        }
    }

    /// Calls `f` on the first server that answers: connection failures, UNAVAILABLE and a hung
    /// server ([`answer_unless_hung`]) move on to the next address; an error naming the leader
    /// is retried there once.
    async fn call<T, F, Fut>(&mut self, mut f: F) -> Result<T, Status>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut order: Vec<String> = Vec::new();
        if let Some((a, _)) = &self.current {
            order.push(a.clone());
        }
        order.extend(self.addrs.iter().filter(|a| !order.contains(a)).cloned().collect::<Vec<_>>());
        let mut failures: Vec<String> = Vec::new();
        let mut redirected = false;
        let mut i = 0;
        while i < order.len() {
            let addr = order[i].clone();
            i += 1;
            let ch = match &self.current {
                Some((a, ch)) if *a == addr => ch.clone(),
                _ => match self.connect(&addr).await {
                    Ok(ch) => ch,
                    Err(e) => {
                        failures.push(format!("{addr}: {e}"));
                        continue;
                    }
                },
            };
            let answer = match answer_unless_hung(ch.clone(), f(ch.clone())).await {
                Some(a) => a,
                None => {
                    failures.push(format!(
                        "{addr}: no answer within {} s, nor to a probe",
                        (FIRST_ANSWER + PROBE_TIMEOUT).as_secs()
                    ));
                    if matches!(&self.current, Some((a, _)) if *a == addr) {
                        self.current = None;
                    }
                    continue;
                }
            };
            match answer {
                Ok(r) => {
                    self.current = Some((addr, ch));
                    return Ok(r.into_inner());
                }
                Err(st) => {
                    if !redirected
                        && let Some(leader) = leader_of(&st)
                        && leader != addr
                    {
                        redirected = true;
                        failures.push(format!("{addr}: {} (leader is {leader})", st.message()));
                        order.insert(i, leader);
                        if matches!(&self.current, Some((a, _)) if *a == addr) {
                            self.current = None;
                        }
                        continue;
                    }
                    if st.code() == Code::Unavailable {
                        failures.push(format!("{addr}: {}", st.message()));
                        if matches!(&self.current, Some((a, _)) if *a == addr) {
                            self.current = None;
                        }
                        continue;
                    }
                    return Err(st);
                }
            }
        }
        Err(Status::unavailable(format!("no server answered ({})", failures.join("; "))))
    }

    /// Follows a list to its end, or until `cap` items: `page(channel, token, limit)` asks for
    /// one page and answers its items and the next token (the default value after the last
    /// page). A page may hold fewer items than asked while more follow (the server bounds pages
    /// in bytes too): only the token ends the list.
    async fn pages<T, K, F, Fut>(&mut self, cap: Option<u32>, mut page: F) -> Result<Vec<T>, Status>
    where
        K: Ord + Default + Clone,
        F: FnMut(Channel, K, u32) -> Fut,
        Fut: Future<Output = Result<tonic::Response<(Vec<T>, K)>, Status>>,
    {
        let cap = cap.map(|c| c as usize);
        let mut out = Vec::new();
        let mut after = K::default();
        loop {
            let want = cap.map_or(PAGE, |c| u32::try_from(c.saturating_sub(out.len())).unwrap_or(PAGE).min(PAGE));
            let (items, next) = self.call(|ch| page(ch, after.clone(), want)).await?;
            out.extend(items);
            if next == K::default() || cap.is_some_and(|c| out.len() >= c) {
                break;
            }
            if next <= after {
                return Err(Status::internal("the server answered a page token that does not advance"));
            }
            after = next;
        }
        if let Some(c) = cap {
            out.truncate(c);
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// Formatting.

/// Aligned plain-text table: columns separated by two spaces, the last column not padded.
/// A cell as a terminal may show it: control, bidi and zero-width characters (stored by an
/// earlier build, or reported by a server) are written as `\u{..}` escapes, never sent raw.
fn printable(c: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |ch: char| {
        ch.is_control()
            || matches!(ch, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2069}' | '\u{FEFF}')
    };
    if !c.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(c);
    }
    std::borrow::Cow::Owned(
        c.chars().map(|ch| if unsafe_char(ch) { ch.escape_unicode().to_string() } else { ch.to_string() }).collect(),
    )
}

fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows.iter().map(|r| r.iter().map(|c| printable(c).into_owned()).collect()).collect();
    let rows = &rows;
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let n = cells.len();
        let mut s = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            s.push_str(c);
            if i + 1 < n {
                let pad = widths.get(i).copied().unwrap_or(0).saturating_sub(c.chars().count()) + 2;
                s.extend(std::iter::repeat_n(' ', pad));
            }
        }
        s.trim_end().to_owned()
    };
    let mut out = line(headers.to_vec());
    for r in rows {
        out.push('\n');
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// Key-value lines with aligned values.
fn fields(kv: &[(&str, String)]) -> String {
    let w = kv.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    kv.iter().map(|(k, v)| format!("{:<w$} {v}", format!("{k}:"), w = w)).collect::<Vec<_>>().join("\n")
}

/// Milli-units as a decimal: 1500 -> "1.5", 250 -> "0.25".
fn milli(m: u64) -> String {
    let (whole, frac) = (m / 1000, m % 1000);
    if frac == 0 { whole.to_string() } else { format!("{whole}.{frac:03}").trim_end_matches('0').to_owned() }
}

/// MiB as a short size: 65536 -> "64Gi", 1536 -> "1.5Gi", 500 -> "500Mi".
fn mib(m: u64) -> String {
    if m >= 1024 * 1024 && m.is_multiple_of(1024 * 1024 / 8) {
        format!("{}Ti", milli(m * 1000 / (1024 * 1024)))
    } else if m >= 1024 && m.is_multiple_of(128) {
        format!("{}Gi", milli(m * 1000 / 1024))
    } else {
        format!("{m}Mi")
    }
}

/// A resource vector, non-zero dimensions only: `cpu=8 mem=64Gi gpu=4`.
fn res(r: Option<&pb::Resources>) -> String {
    let Some(r) = r else { return "-".into() };
    if [r.cpu_milli, r.memory_mib, r.gpu_milli, r.npu_milli].iter().all(|v| *v == u64::MAX) {
        return "unlimited".into();
    }
    let mut parts = Vec::new();
    if r.cpu_milli > 0 {
        parts.push(format!("cpu={}", milli(r.cpu_milli)));
    }
    if r.memory_mib > 0 {
        parts.push(format!("mem={}", mib(r.memory_mib)));
    }
    if r.gpu_milli > 0 {
        parts.push(format!("gpu={}", milli(r.gpu_milli)));
    }
    if r.npu_milli > 0 {
        parts.push(format!("npu={}", milli(r.npu_milli)));
    }
    if parts.is_empty() { "0".into() } else { parts.join(" ") }
}

/// `used/capacity` of one dimension.
fn frac(used: u64, cap: u64, f: fn(u64) -> String) -> String {
    format!("{}/{}", f(used), f(cap))
}

fn res_json(r: Option<&pb::Resources>) -> Value {
    match r {
        None => Value::Null,
        Some(r) => json!({
            "cpu_milli": r.cpu_milli, "memory_mib": r.memory_mib,
            "gpu_milli": r.gpu_milli, "npu_milli": r.npu_milli,
        }),
    }
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Time since `t` (seconds since the epoch): `45s`, `3m`, `2h`, `5d`.
fn age(t: u64) -> String {
    if t == 0 {
        return "-".into();
    }
    let d = now_s().saturating_sub(t);
    match d {
        0..60 => format!("{d}s"),
        60..3600 => format!("{}m", d / 60),
        3600..86_400 => format!("{}h", d / 3600),
        _ => format!("{}d", d / 86_400),
    }
}

fn dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { s.to_owned() }
}

fn alloc_json(a: &pb::AllocInfo) -> Value {
    json!({
        "id": a.id, "job_id": a.job_id, "group": a.group, "replica": a.replica, "epoch": a.epoch,
        "node": a.node, "state": a.state, "desired": a.desired, "stop_reason": a.stop_reason,
        "checkpoint_first": a.checkpoint_first, "grace_s": a.grace_s,
        "cpu_milli": a.cpu_milli, "memory_mib": a.memory_mib,
        "devices": a.devices.iter().map(|d| json!({"device": d.device, "milli": d.milli, "memory_mib": d.memory_mib})).collect::<Vec<_>>(),
        "started_at": a.started_at, "message": a.message, "queue": a.queue, "priority": a.priority,
        "borrowed": a.borrowed, "restore_from": a.restore_from, "group_name": a.group_name,
    })
}

fn job_json(j: &pb::JobInfo) -> Value {
    // A summary (what lists answer) has no spec: null, rather than an empty string.
    let spec: Value = if j.summary {
        Value::Null
    } else {
        serde_json::from_str(&j.spec_json).unwrap_or_else(|_| Value::String(j.spec_json.clone()))
    };
    json!({
        "id": j.id, "name": j.name, "queue": j.queue, "state": j.state, "priority": j.priority,
        "submitted_at": j.submitted_at, "updated_at": j.updated_at, "attempt": j.attempt,
        "failures": j.failures, "requeues": j.requeues, "not_before": j.not_before, "reason": j.reason,
        "allocs": j.allocs.iter().map(alloc_json).collect::<Vec<_>>(),
        "spec": spec, "revision": j.revision, "client_request_id": j.client_request_id,
        "queue_position": j.queue_position, "latest_checkpoint_uri": j.latest_checkpoint_uri,
        "omitted_allocs": j.omitted_allocs,
        "attempts": j.attempts.iter().map(|h| json!({
            "attempt": h.attempt, "alloc_id": h.alloc_id, "group": h.group, "replica": h.replica, "node": h.node,
            "started_at": h.started_at, "ended_at": h.ended_at, "state": h.state, "message": h.message,
        })).collect::<Vec<_>>(),
    })
}

fn queue_json(q: &pb::QueueInfo) -> Value {
    json!({
        "id": q.id, "team": q.team, "parent": q.parent, "cohort": q.cohort, "weight": q.weight,
        "nominal": res_json(q.nominal.as_ref()), "borrowing_limit": res_json(q.borrowing_limit.as_ref()),
        "lending_limit": res_json(q.lending_limit.as_ref()), "used": res_json(q.used.as_ref()),
        "borrowed": res_json(q.borrowed.as_ref()), "pending_jobs": q.pending_jobs, "running_jobs": q.running_jobs,
    })
}

fn pool_json(p: &pb::PoolInfo) -> Value {
    json!({
        "name": p.name, "nodes": p.nodes, "ready_nodes": p.ready_nodes,
        "capacity": res_json(p.capacity.as_ref()), "used": res_json(p.used.as_ref()),
    })
}

fn mode_name(m: i32) -> &'static str {
    match pb::NodeMode::try_from(m) {
        Ok(pb::NodeMode::Schedulable) => "schedulable",
        Ok(pb::NodeMode::Cordoned) => "cordoned",
        Ok(pb::NodeMode::Draining) => "draining",
        _ => "unknown",
    }
}

fn node_json(n: &pb::NodeInfo) -> Value {
    let labels: serde_json::Map<String, Value> =
        n.labels.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    json!({
        "id": n.id, "pool": n.pool, "region": n.region, "datacenter": n.datacenter, "status": n.status,
        "mode": mode_name(n.mode), "capacity": res_json(n.capacity.as_ref()), "used": res_json(n.used.as_ref()),
        "devices": n.devices.iter().map(|d| json!({
            "id": d.id, "kind": d.kind, "model": d.model, "memory_mib": d.memory_mib, "health": d.health,
            "numa": d.numa, "peer_group": d.peer_group, "partition_of": d.partition_of, "used_milli": d.used_milli,
        })).collect::<Vec<_>>(),
        "labels": labels, "updated_at": n.updated_at, "reason": n.reason, "allocations": n.allocations,
        "agent_addr": n.agent_addr, "pressure": n.pressure,
        "drain_deadline": n.drain_deadline, "drain_max_unavailable": n.drain_max_unavailable,
        "drain_moving": n.drain_moving,
        "stats": n.stats.iter().map(|s| json!({
            "id": s.id, "utilization_pct": s.utilization_pct, "memory_used_mib": s.memory_used_mib,
            "power_w": s.power_w, "temperature_c": s.temperature_c, "ecc_errors": s.ecc_errors,
            "xid_errors": s.xid_errors,
        })).collect::<Vec<_>>(),
    })
}

fn print_value(v: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Jobs.

/// A request id unique to this submission: time, process and a random part.
fn new_request_id() -> String {
    use std::hash::BuildHasher;
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let random = std::collections::hash_map::RandomState::new().hash_one((nanos, std::process::id()));
    format!("cli-{nanos:x}-{:x}-{random:016x}", std::process::id())
}

/// Calls `f` like [`Conn::call`], retrying transport failures ([`retryable`]) up to
/// [`SUBMIT_ATTEMPTS`] times with backoff. `f` must resend the same request ids (`what` names
/// them in the warning), so a retry never creates a second job.
async fn call_retrying<T, F, Fut>(conn: &mut Conn, what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut(Channel) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, Status>>,
{
    let mut attempt = 1;
    loop {
        match conn.call(&mut f).await {
            Ok(r) => return Ok(r),
            Err(st) if retryable(st.code()) && attempt < SUBMIT_ATTEMPTS => {
                let wait = Duration::from_millis(250 << attempt);
                eprintln!(
                    "warning: {}: {}; retrying in {:?} with the same {what}",
                    code_name(st.code()),
                    st.message(),
                    wait,
                );
                tokio::time::sleep(wait).await;
                attempt += 1;
            }
            Err(st) => return Err(status_err(st)),
        }
    }
}

/// Spec JSON sent in one `SubmitMany` call at most (besides the server's job count limit),
/// well inside the servers' default 4 MiB message limit.
const SUBMIT_CALL_BYTES: usize = 2 << 20;

/// `job submit` of several files: every file is loaded and validated before anything is sent
/// (a bad file names itself and nothing is submitted), then the jobs go in `SubmitMany` calls.
/// Fails (after printing every result) when any job was refused.
async fn submit_files(
    conn: &mut Conn,
    out: Output,
    files: &[PathBuf],
    request_id: Option<String>,
) -> anyhow::Result<()> {
    let base = request_id.unwrap_or_else(new_request_id);
    let mut reqs = Vec::with_capacity(files.len());
    for (k, f) in files.iter().enumerate() {
        let spec = spec::load_job(f)?;
        reqs.push(pb::SubmitJobRequest {
            client_request_id: format!("{base}-{}", k + 1),
            spec_json: serde_json::to_string(&spec)?,
            retry: None,
        });
    }
    let mut results: Vec<pb::SubmitJobResult> = Vec::with_capacity(reqs.len());
    let mut rest = &reqs[..];
    while !rest.is_empty() {
        let mut n = 0;
        let mut bytes = 0;
        while n < rest.len() && n < suanli_server::MAX_JOBS_PER_CALL {
            bytes += rest[n].spec_json.len();
            if n > 0 && bytes > SUBMIT_CALL_BYTES {
                break;
            }
            n += 1;
        }
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let what = format!("request ids {base}-{}..", results.len() + 1);
        let resp = call_retrying(conn, &what, |ch| {
            let jobs = chunk.to_vec();
            async move { jobs_client(ch).submit_many(pb::SubmitJobsRequest { jobs }).await }
        })
        .await?;
        if resp.results.len() != chunk.len() {
            bail!("the server answered {} results for {} jobs", resp.results.len(), chunk.len());
        }
        results.extend(resp.results);
    }
    let refused = results.iter().filter(|r| r.code != 0).count();
    match out {
        Output::Json => {
            let rows: Vec<Value> = files
                .iter()
                .zip(&reqs)
                .zip(&results)
                .map(|((f, q), r)| {
                    if r.code == 0 {
                        json!({"file": f.display().to_string(), "client_request_id": q.client_request_id,
                               "job_id": r.job_id, "created": r.created, "revision": r.revision})
                    } else {
                        json!({"file": f.display().to_string(), "client_request_id": q.client_request_id,
                               "error": {"code": code_name(Code::from(r.code)), "message": r.message}})
                    }
                })
                .collect();
            print_value(&Value::Array(rows))?;
        }
        Output::Table => {
            for ((f, q), r) in files.iter().zip(&reqs).zip(&results) {
                let f = f.display();
                let rid = &q.client_request_id;
                if r.code != 0 {
                    println!("{f}: refused: {}: {}", code_name(Code::from(r.code)), r.message);
                } else if r.created {
                    println!("{f}: job {} submitted (request id {rid})", r.job_id);
                } else {
                    println!("{f}: job {} already submitted with request id {rid} (not created again)", r.job_id);
                }
            }
        }
    }
    if refused > 0 {
        bail!("{refused} of {} jobs refused", results.len());
    }
    Ok(())
}

/// Codes after which a submission is retried with the same request id.
fn retryable(c: Code) -> bool {
    matches!(c, Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::Aborted)
}

fn job_row(j: &pb::JobInfo) -> Vec<String> {
    vec![
        j.id.to_string(),
        j.name.clone(),
        j.queue.clone(),
        j.state.clone(),
        j.priority.to_string(),
        age(j.submitted_at),
        (j.allocs.len() as u64 + j.omitted_allocs).to_string(),
        dash(&j.reason),
    ]
}

const JOB_HEADERS: [&str; 8] = ["ID", "NAME", "QUEUE", "STATE", "PRIO", "AGE", "ALLOCS", "REASON"];

fn print_job(j: &pb::JobInfo) {
    let mut kv = vec![
        ("id", j.id.to_string()),
        ("name", j.name.clone()),
        ("queue", j.queue.clone()),
        ("state", j.state.clone()),
        ("priority", j.priority.to_string()),
        ("submitted", format!("{} ago", age(j.submitted_at))),
        ("updated", format!("{} ago", age(j.updated_at))),
        ("attempt", format!("{} (failures {}, requeues {})", j.attempt, j.failures, j.requeues)),
        ("revision", j.revision.to_string()),
        ("request id", dash(&j.client_request_id)),
    ];
    if j.queue_position > 0 {
        kv.push(("queue position", j.queue_position.to_string()));
    }
    if j.not_before > now_s() {
        kv.push(("not before", format!("in {}s", j.not_before - now_s())));
    }
    if !j.reason.is_empty() {
        kv.push(("reason", j.reason.clone()));
    }
    if !j.latest_checkpoint_uri.is_empty() {
        kv.push(("checkpoint", j.latest_checkpoint_uri.clone()));
    }
    println!("{}", fields(&kv));
    print_allocs(j);
    print_attempts(j);
}

/// The ended attempts' allocations (oldest first): where each ran and how it ended.
fn print_attempts(j: &pb::JobInfo) {
    if j.attempts.is_empty() {
        return;
    }
    println!("past attempts:");
    let rows: Vec<Vec<String>> = j
        .attempts
        .iter()
        .map(|h| {
            vec![
                h.attempt.to_string(),
                h.alloc_id.to_string(),
                format!("{}/{}", h.group, h.replica),
                h.node.clone(),
                format!("{} ago", age(h.started_at)),
                format!("{} ago", age(h.ended_at)),
                h.state.clone(),
                dash(&h.message),
            ]
        })
        .collect();
    let t = table(&["ATTEMPT", "ALLOC", "GROUP/REPLICA", "NODE", "STARTED", "ENDED", "STATE", "MESSAGE"], &rows);
    for l in t.lines() {
        println!("  {l}");
    }
}

/// The current attempt's allocations.
fn print_allocs(j: &pb::JobInfo) {
    if j.allocs.is_empty() {
        println!("allocations: none");
        return;
    }
    println!("allocations:");
    let rows: Vec<Vec<String>> = j
        .allocs
        .iter()
        .map(|a| {
            let devs = a
                .devices
                .iter()
                .map(|d| {
                    if d.milli >= 1000 {
                        d.device.clone()
                    } else {
                        format!("{}({})", d.device, milli(u64::from(d.milli)))
                    }
                })
                .collect::<Vec<_>>()
                .join(",");
            let state = if a.desired == "stop" && !a.stop_reason.is_empty() {
                format!("{} (stop: {})", a.state, a.stop_reason)
            } else {
                a.state.clone()
            };
            vec![
                a.id.to_string(),
                format!("{}/{}", a.group, a.replica),
                a.epoch.to_string(),
                a.node.clone(),
                state,
                milli(a.cpu_milli),
                mib(a.memory_mib),
                dash(&devs),
                dash(&a.message),
            ]
        })
        .collect();
    let t = table(&["ALLOC", "GROUP/REPLICA", "EPOCH", "NODE", "STATE", "CPU", "MEM", "DEVICES", "MESSAGE"], &rows);
    for l in t.lines() {
        println!("  {l}");
    }
}

async fn job(args: ConnArgs, cmd: JobCmd) -> anyhow::Result<()> {
    let mut conn = Conn::new(&args)?;
    let out = args.output;
    match cmd {
        JobCmd::Validate { file } => print_json(&spec::load_job(&file)?),
        JobCmd::Submit { files, request_id } => {
            let [file] = files.as_slice() else {
                return submit_files(&mut conn, out, &files, request_id).await;
            };
            let spec = spec::load_job(file)?;
            let req = pb::SubmitJobRequest {
                client_request_id: request_id.unwrap_or_else(new_request_id),
                spec_json: serde_json::to_string(&spec)?,
                retry: None,
            };
            let what = format!("request id {}", req.client_request_id);
            let resp = call_retrying(&mut conn, &what, |ch| {
                let req = req.clone();
                async move { jobs_client(ch).submit(req).await }
            })
            .await?;
            match out {
                Output::Json => print_value(&json!({
                    "job_id": resp.job_id, "created": resp.created, "revision": resp.revision,
                    "client_request_id": req.client_request_id,
                })),
                Output::Table => {
                    if resp.created {
                        println!("job {} submitted (request id {})", resp.job_id, req.client_request_id);
                    } else {
                        println!(
                            "job {} already submitted with request id {} (not created again)",
                            resp.job_id, req.client_request_id
                        );
                    }
                    Ok(())
                }
            }
        }
        JobCmd::Status { id, stale } => {
            let j = conn
                .call(|ch| async move { jobs_client(ch).get(pb::GetJobRequest { job_id: id, stale }).await })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&job_json(&j)),
                Output::Table => {
                    print_job(&j);
                    Ok(())
                }
            }
        }
        JobCmd::List { queue, states, limit, stale } => {
            let queue = queue.unwrap_or_default();
            let jobs = conn
                .pages(limit, |ch, after_id, limit| {
                    let req =
                        pb::ListJobsRequest { queue: queue.clone(), states: states.clone(), limit, after_id, stale };
                    async move {
                        let r = jobs_client(ch).list(req).await?;
                        Ok(r.map(|r| (r.jobs, r.next_after_id)))
                    }
                })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&Value::Array(jobs.iter().map(job_json).collect())),
                Output::Table => {
                    println!("{}", table(&JOB_HEADERS, &jobs.iter().map(job_row).collect::<Vec<_>>()));
                    Ok(())
                }
            }
        }
        JobCmd::Cancel { id, reason } => {
            conn.call(|ch| {
                let reason = reason.clone();
                async move { jobs_client(ch).cancel(pb::CancelJobRequest { job_id: id, reason }).await }
            })
            .await
            .map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({"job_id": id, "cancelled": true})),
                Output::Table => {
                    println!("job {id} cancelled");
                    Ok(())
                }
            }
        }
        JobCmd::Logs { id, task, alloc, stderr, tail, follow } => {
            let j = conn
                .call(|ch| async move { jobs_client(ch).get(pb::GetJobRequest { job_id: id, stale: false }).await })
                .await
                .map_err(status_err)?;
            let (alloc_id, node_id) = pick_alloc(&j, task.as_deref(), alloc)?;
            let n = conn
                .call(|ch| {
                    let node_id = node_id.clone();
                    async move {
                        pb::nodes_client::NodesClient::new(ch)
                            .get(pb::GetNodeRequest { id: node_id, stale: false })
                            .await
                    }
                })
                .await
                .map_err(status_err)?;
            if n.agent_addr.is_empty() {
                anyhow::bail!("node {}: its agent did not register a log address (agent_addr)", n.id);
            }
            let ep = tonic::transport::Endpoint::from_shared(format!("http://{}", n.agent_addr))
                .with_context(|| format!("node {}: agent_addr {:?}", n.id, n.agent_addr))?
                .connect_timeout(Duration::from_secs(5));
            let ch = ep
                .connect()
                .await
                .with_context(|| format!("connecting to the agent of node {} at {}", n.id, n.agent_addr))?;
            let req = pb::LogsRequest {
                alloc_id,
                stream: if stderr { "stderr" } else { "stdout" }.into(),
                offset: tail.map_or(0, |t| -i64::try_from(t).unwrap_or(i64::MAX)),
                follow,
            };
            let mut stream =
                pb::agent_logs_client::AgentLogsClient::new(ch).logs(req).await.map_err(status_err)?.into_inner();
            let ctrl_c = tokio::signal::ctrl_c();
            tokio::pin!(ctrl_c);
            let mut stdout = std::io::stdout();
            loop {
                tokio::select! {
                    _ = &mut ctrl_c => return Ok(()),
                    m = stream.message() => match m.map_err(status_err)? {
                        None => return Ok(()),
                        Some(chunk) => {
                            use std::io::Write as _;
                            stdout.write_all(&chunk.data)?;
                            stdout.flush()?;
                        }
                    },
                }
            }
        }
        JobCmd::Watch { id, from_revision } => {
            let mut sconn = conn.streaming();
            let req = pb::WatchJobsRequest { job_id: id.unwrap_or(0), from_revision };
            let mut stream =
                sconn.call(|ch| async move { jobs_client(ch).watch(req).await }).await.map_err(status_err)?;
            let ctrl_c = tokio::signal::ctrl_c();
            tokio::pin!(ctrl_c);
            loop {
                tokio::select! {
                    _ = &mut ctrl_c => return Ok(()),
                    m = stream.message() => match m.map_err(status_err)? {
                        None => return Ok(()),
                        Some(ev) => print_event(&ev, out)?,
                    },
                }
            }
        }
    }
}

/// The allocation `job logs` shows: `alloc` if given, else the latest attempt of `task`
/// (`GROUP-REPLICA`, default the first task).
/// The allocation whose log `job logs` shows, as (allocation id, node): `--alloc` (current or
/// past attempt), else the task's allocation in the latest attempt, else (a job waiting to
/// be retried) the task's allocation in the last past attempt.
fn pick_alloc(j: &pb::JobInfo, task: Option<&str>, alloc: Option<u64>) -> anyhow::Result<(u64, String)> {
    if let Some(id) = alloc {
        let past = j.attempts.iter().find(|h| h.alloc_id == id).map(|h| (h.alloc_id, h.node.clone()));
        return j
            .allocs
            .iter()
            .find(|a| a.id == id)
            .map(|a| (a.id, a.node.clone()))
            .or(past)
            .with_context(|| format!("alloc: job {} has no allocation {id}", j.id));
    }
    match pick_current(j, task) {
        Ok(a) => Ok((a.id, a.node.clone())),
        Err(e) => {
            let (group, replica) = parse_task(task)?;
            j.attempts
                .iter()
                .rev()
                .find(|h| {
                    h.replica == replica
                        && group.map_or(h.group == 0, |g| h.group.to_string() == g || task_group_named(j, h.group, g))
                })
                .map(|h| (h.alloc_id, h.node.clone()))
                .ok_or(e)
        }
    }
}

/// Whether group `index` of the job's spec is named `name`.
fn task_group_named(j: &pb::JobInfo, index: u32, name: &str) -> bool {
    let spec: Value = serde_json::from_str(&j.spec_json).unwrap_or(Value::Null);
    spec["groups"][index as usize]["name"].as_str() == Some(name)
}

/// `GROUP-REPLICA` as (group, replica); none: the first group's replica 0.
fn parse_task(task: Option<&str>) -> anyhow::Result<(Option<&str>, u32)> {
    match task {
        None => Ok((None, 0)),
        Some(t) => {
            let (g, r) = t.rsplit_once('-').with_context(|| format!("task: {t:?} is not GROUP-REPLICA"))?;
            let r: u32 = r.parse().with_context(|| format!("task: replica {r:?} in {t:?} is not a number"))?;
            Ok((Some(g), r))
        }
    }
}

fn pick_current<'a>(j: &'a pb::JobInfo, task: Option<&str>) -> anyhow::Result<&'a pb::AllocInfo> {
    let (group, replica) = parse_task(task)?;
    j.allocs
        .iter()
        .filter(|a| a.replica == replica && group.is_none_or(|g| a.group_name == g || a.group.to_string() == g))
        .filter(|a| group.is_some() || a.group == 0)
        .max_by_key(|a| (a.epoch, a.id))
        .with_context(|| match task {
            Some(t) => format!("task: job {} has no allocation for task {t}", j.id),
            None => format!("job {} has no allocation yet (is it still pending?)", j.id),
        })
}

fn print_event(ev: &pb::JobEvent, out: Output) -> anyhow::Result<()> {
    match out {
        Output::Json => {
            let v = json!({
                "revision": ev.revision, "removed": ev.removed,
                "job": ev.job.as_ref().map(job_json).unwrap_or(Value::Null),
            });
            println!("{}", serde_json::to_string(&v)?);
        }
        Output::Table => match &ev.job {
            None => println!("rev {} (no job)", ev.revision),
            Some(j) if ev.removed => println!("rev {} job {} {} removed", ev.revision, j.id, j.name),
            Some(j) => {
                let reason = if j.reason.is_empty() { String::new() } else { format!(" ({})", j.reason) };
                println!(
                    "rev {} job {} {} queue={} state={} allocs={}{reason}",
                    ev.revision,
                    j.id,
                    j.name,
                    j.queue,
                    j.state,
                    j.allocs.len()
                );
            }
        },
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Queues, pools, nodes.

async fn queue(args: ConnArgs, cmd: QueueCmd) -> anyhow::Result<()> {
    let mut conn = Conn::new(&args)?;
    let out = args.output;
    let qc = pb::queues_client::QueuesClient::new;
    match cmd {
        QueueCmd::Validate { file } => print_json(&spec::load_queue(&file)?),
        QueueCmd::Apply { file } => {
            let q = spec::load_queue(&file)?;
            let queue_json = serde_json::to_string(&q)?;
            conn.call(|ch| {
                let queue_json = queue_json.clone();
                async move { qc(ch).upsert(pb::UpsertQueueRequest { queue_json }).await }
            })
            .await
            .map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({"queue": q.id.as_str(), "applied": true})),
                Output::Table => {
                    println!("queue {} applied", q.id);
                    Ok(())
                }
            }
        }
        QueueCmd::List { stale } => {
            let queues = conn
                .pages(None, |ch, after, limit| async move {
                    let r = qc(ch).list(pb::ListQueuesRequest { stale, limit, after }).await?;
                    Ok(r.map(|r| (r.queues, r.next_after)))
                })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&Value::Array(queues.iter().map(queue_json).collect())),
                Output::Table => {
                    let rows: Vec<Vec<String>> = queues
                        .iter()
                        .map(|q| {
                            vec![
                                q.id.clone(),
                                dash(&q.team),
                                dash(&q.parent),
                                dash(&q.cohort),
                                q.weight.to_string(),
                                res(q.nominal.as_ref()),
                                res(q.used.as_ref()),
                                res(q.borrowed.as_ref()),
                                q.pending_jobs.to_string(),
                                q.running_jobs.to_string(),
                            ]
                        })
                        .collect();
                    let h = [
                        "ID", "TEAM", "PARENT", "COHORT", "WEIGHT", "NOMINAL", "USED", "BORROWED", "PENDING", "RUNNING",
                    ];
                    println!("{}", table(&h, &rows));
                    Ok(())
                }
            }
        }
        QueueCmd::Get { id, stale } => {
            let q = conn
                .call(|ch| {
                    let id = id.clone();
                    async move { qc(ch).get(pb::GetQueueRequest { id, stale }).await }
                })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&queue_json(&q)),
                Output::Table => {
                    let unlimited = |r: Option<&pb::Resources>| if r.is_none() { "unlimited".into() } else { res(r) };
                    println!(
                        "{}",
                        fields(&[
                            ("id", q.id.clone()),
                            ("team", dash(&q.team)),
                            ("parent", dash(&q.parent)),
                            ("cohort", dash(&q.cohort)),
                            ("weight", q.weight.to_string()),
                            ("nominal", res(q.nominal.as_ref())),
                            ("borrowing limit", unlimited(q.borrowing_limit.as_ref())),
                            ("lending limit", unlimited(q.lending_limit.as_ref())),
                            ("used", res(q.used.as_ref())),
                            ("borrowed", res(q.borrowed.as_ref())),
                            ("pending jobs", q.pending_jobs.to_string()),
                            ("running jobs", q.running_jobs.to_string()),
                        ])
                    );
                    Ok(())
                }
            }
        }
        QueueCmd::Delete { id } => {
            conn.call(|ch| {
                let id = id.clone();
                async move { qc(ch).delete(pb::DeleteQueueRequest { id }).await }
            })
            .await
            .map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({"queue": id, "deleted": true})),
                Output::Table => {
                    println!("queue {id} deleted");
                    Ok(())
                }
            }
        }
    }
}

/// `used/capacity` columns of a resource pair: CPU, MEM, GPU, NPU.
fn usage_cols(used: Option<&pb::Resources>, cap: Option<&pb::Resources>) -> Vec<String> {
    let z = pb::Resources::default();
    let (u, c) = (used.unwrap_or(&z), cap.unwrap_or(&z));
    vec![
        frac(u.cpu_milli, c.cpu_milli, milli),
        frac(u.memory_mib, c.memory_mib, mib),
        frac(u.gpu_milli, c.gpu_milli, milli),
        frac(u.npu_milli, c.npu_milli, milli),
    ]
}

async fn pool(args: ConnArgs, cmd: PoolCmd) -> anyhow::Result<()> {
    let mut conn = Conn::new(&args)?;
    match cmd {
        PoolCmd::List { stale } => {
            let pools = conn
                .pages(None, |ch, after, limit| async move {
                    let r = pb::pools_client::PoolsClient::new(ch)
                        .list(pb::ListPoolsRequest { stale, limit, after })
                        .await?;
                    Ok(r.map(|r| (r.pools, r.next_after)))
                })
                .await
                .map_err(status_err)?;
            match args.output {
                Output::Json => print_value(&Value::Array(pools.iter().map(pool_json).collect())),
                Output::Table => {
                    let rows: Vec<Vec<String>> = pools
                        .iter()
                        .map(|p| {
                            let mut row = vec![p.name.clone(), format!("{}/{}", p.ready_nodes, p.nodes)];
                            row.extend(usage_cols(p.used.as_ref(), p.capacity.as_ref()));
                            row
                        })
                        .collect();
                    println!("{}", table(&["POOL", "READY/NODES", "CPU", "MEM", "GPU", "NPU"], &rows));
                    Ok(())
                }
            }
        }
    }
}

/// A duration for a flag: `90`, `90s`, `10m`, `2h`, `1d`, in seconds.
fn parse_duration_s(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a duration (e.g. 90s, 10m, 1h)"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{s:?}: unit {unit:?} is not s, m, h or d")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too long"))
}

/// Drain progress as one line: allocations left, jobs away, time to the deadline.
fn drain_progress(n: &pb::NodeInfo) -> String {
    let mut s = format!("{} allocations left", n.allocations);
    if n.drain_max_unavailable > 0 {
        s += &format!(", {} of at most {} jobs away", n.drain_moving, n.drain_max_unavailable);
    }
    let now = now_s();
    if n.drain_deadline > now {
        s += &format!(", running work evicted in {}s", n.drain_deadline - now);
    }
    s
}

/// `node drain --wait`: polls the node until no allocation is left on it.
async fn wait_drained(conn: &mut Conn, id: &str, timeout_s: u64) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
    let mut last = String::new();
    loop {
        let n = conn
            .call(|ch| {
                let id = id.to_owned();
                async move { pb::nodes_client::NodesClient::new(ch).get(pb::GetNodeRequest { id, stale: false }).await }
            })
            .await
            .map_err(status_err)?;
        if n.mode != pb::NodeMode::Draining as i32 {
            bail!("node {id} is no longer draining (mode {})", mode_name(n.mode));
        }
        if n.allocations == 0 {
            println!("node {id} drained: no allocations left");
            return Ok(());
        }
        let p = drain_progress(&n);
        if p != last {
            println!("node {id}: {p}");
            last = p;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("node {id} still has {} allocations after {timeout_s}s (--timeout)", n.allocations);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn set_mode(conn: &mut Conn, out: Output, id: String, mode: pb::NodeMode) -> anyhow::Result<()> {
    set_mode_with(conn, out, id, mode, 0, 0).await
}

async fn set_mode_with(
    conn: &mut Conn,
    out: Output,
    id: String,
    mode: pb::NodeMode,
    grace_s: u64,
    max_unavailable: u32,
) -> anyhow::Result<()> {
    conn.call(|ch| {
        let id = id.clone();
        async move {
            pb::nodes_client::NodesClient::new(ch)
                .set_mode(pb::SetNodeModeRequest { id, mode: mode as i32, grace_s, max_unavailable })
                .await
        }
    })
    .await
    .map_err(status_err)?;
    let m = mode_name(mode as i32);
    match out {
        Output::Json => print_value(&json!({"node": id, "mode": m})),
        Output::Table => {
            println!("node {id} {m}");
            Ok(())
        }
    }
}

async fn node(args: ConnArgs, cmd: NodeCmd) -> anyhow::Result<()> {
    let mut conn = Conn::new(&args)?;
    let out = args.output;
    let nc = pb::nodes_client::NodesClient::new;
    match cmd {
        NodeCmd::Validate { file } => print_json(&spec::load_node(&file)?),
        NodeCmd::List { pool, stale } => {
            let pool = pool.unwrap_or_default();
            let nodes = conn
                .pages(None, |ch, after, limit| {
                    let req = pb::ListNodesRequest { pool: pool.clone(), stale, limit, after };
                    async move {
                        let r = nc(ch).list(req).await?;
                        Ok(r.map(|r| (r.nodes, r.next_after)))
                    }
                })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&Value::Array(nodes.iter().map(node_json).collect())),
                Output::Table => {
                    let rows: Vec<Vec<String>> = nodes
                        .iter()
                        .map(|n| {
                            let mut row =
                                vec![n.id.clone(), n.pool.clone(), dash(&n.status), mode_name(n.mode).to_owned()];
                            row.extend(usage_cols(n.used.as_ref(), n.capacity.as_ref()));
                            row.push(n.allocations.to_string());
                            // Why it takes no work: down, a drain in progress, or a condition its
                            // agent reported.
                            let now = now_s();
                            let drain = if n.mode == pb::NodeMode::Draining as i32 && n.drain_deadline > now {
                                format!("drain: evicts in {}s", n.drain_deadline - now)
                            } else {
                                String::new()
                            };
                            let why = [n.reason.as_str(), drain.as_str(), n.pressure.as_str()]
                                .into_iter()
                                .filter(|r| !r.is_empty())
                                .collect::<Vec<_>>()
                                .join("; ");
                            row.push(dash(&why));
                            row
                        })
                        .collect();
                    let h = ["NODE", "POOL", "STATUS", "MODE", "CPU", "MEM", "GPU", "NPU", "ALLOCS", "REASON"];
                    println!("{}", table(&h, &rows));
                    Ok(())
                }
            }
        }
        NodeCmd::Get { id, stale } => {
            let n = conn
                .call(|ch| {
                    let id = id.clone();
                    async move { nc(ch).get(pb::GetNodeRequest { id, stale }).await }
                })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&node_json(&n)),
                Output::Table => {
                    let labels = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
                    println!(
                        "{}",
                        fields(&[
                            ("id", n.id.clone()),
                            ("pool", n.pool.clone()),
                            ("region", dash(&n.region)),
                            ("datacenter", dash(&n.datacenter)),
                            ("status", dash(&n.status)),
                            ("mode", mode_name(n.mode).to_owned()),
                            ("reason", dash(&n.reason)),
                            ("pressure", dash(&n.pressure)),
                            ("capacity", res(n.capacity.as_ref())),
                            ("used", res(n.used.as_ref())),
                            ("allocations", n.allocations.to_string()),
                            (
                                "drain",
                                if n.mode == pb::NodeMode::Draining as i32 { drain_progress(&n) } else { "-".into() },
                            ),
                            ("labels", dash(&labels)),
                            ("updated", format!("{} ago", age(n.updated_at))),
                        ])
                    );
                    if !n.devices.is_empty() {
                        let rows: Vec<Vec<String>> = n
                            .devices
                            .iter()
                            .map(|d| {
                                let st = n.stats.iter().find(|s| s.id == d.id);
                                vec![
                                    d.id.clone(),
                                    d.kind.clone(),
                                    d.model.clone(),
                                    mib(d.memory_mib),
                                    d.health.clone(),
                                    d.numa.to_string(),
                                    d.peer_group.map_or_else(|| "-".to_owned(), |g| g.to_string()),
                                    dash(&d.partition_of),
                                    milli(d.used_milli),
                                    st.map_or_else(|| "-".to_owned(), |s| format!("{:.0}%", s.utilization_pct)),
                                    st.map_or_else(|| "-".to_owned(), |s| mib(s.memory_used_mib)),
                                    st.map_or_else(|| "-".to_owned(), |s| format!("{:.0}C", s.temperature_c)),
                                ]
                            })
                            .collect();
                        println!("devices:");
                        let h = [
                            "DEVICE",
                            "KIND",
                            "MODEL",
                            "MEMORY",
                            "HEALTH",
                            "NUMA",
                            "PEERS",
                            "PARTITION_OF",
                            "USED",
                            "UTIL",
                            "MEM_USED",
                            "TEMP",
                        ];
                        for l in table(&h, &rows).lines() {
                            println!("  {l}");
                        }
                    }
                    Ok(())
                }
            }
        }
        NodeCmd::Cordon { id } => set_mode(&mut conn, out, id, pb::NodeMode::Cordoned).await,
        NodeCmd::Drain { id, grace, max_unavailable, wait, timeout } => {
            set_mode_with(&mut conn, out, id.clone(), pb::NodeMode::Draining, grace, max_unavailable).await?;
            if wait { wait_drained(&mut conn, &id, timeout).await } else { Ok(()) }
        }
        NodeCmd::Uncordon { id } => set_mode(&mut conn, out, id, pb::NodeMode::Schedulable).await,
        NodeCmd::Register { file, keep_alive } => register(&mut conn, out, &file, keep_alive).await,
    }
}

async fn register_once(conn: &mut Conn, req: &pb::RegisterNodeRequest) -> anyhow::Result<pb::RegisterNodeResponse> {
    conn.call(|ch| {
        let req = req.clone();
        async move { pb::agent_client::AgentClient::new(ch).register(req).await }
    })
    .await
    .map_err(status_err)
}

async fn register(conn: &mut Conn, out: Output, file: &std::path::Path, keep_alive: bool) -> anyhow::Result<()> {
    let node = spec::load_node(file)?;
    let req = pb::RegisterNodeRequest {
        node_json: serde_json::to_string(&node)?,
        agent_version: format!("suanli-cli/{}", env!("CARGO_PKG_VERSION")),
        ..Default::default()
    };
    let ac = pb::agent_client::AgentClient::new;
    let r = register_once(conn, &req).await?;
    match out {
        Output::Json => print_value(&json!({
            "node": node.id.as_str(), "registered": true,
            "heartbeat_interval_ms": r.heartbeat_interval_ms, "heartbeat_ttl_ms": r.heartbeat_ttl_ms,
        }))?,
        Output::Table => println!(
            "node {} registered (heartbeat every {} ms, down after {} ms without one)",
            node.id, r.heartbeat_interval_ms, r.heartbeat_ttl_ms
        ),
    }
    if !keep_alive {
        return Ok(());
    }
    let interval = Duration::from_millis(r.heartbeat_interval_ms.clamp(100, 60_000));
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            () = tokio::time::sleep(interval) => {}
        }
        seq += 1;
        let node_id = node.id.to_string();
        let hb = conn
            .call(|ch| {
                let node_id = node_id.clone();
                async move {
                    ac(ch)
                        .heartbeat(pb::HeartbeatRequest {
                            node_id,
                            seq,
                            devices: Vec::new(),
                            stats: Vec::new(),
                            disk_pressure: String::new(),
                        })
                        .await
                }
            })
            .await;
        match hb {
            Ok(h) if !h.known => {
                eprintln!("warning: the server does not know node {}; registering again", node.id);
                register_once(conn, &req).await?;
            }
            Ok(_) => {}
            Err(st) => eprintln!("warning: heartbeat failed: {}: {}", code_name(st.code()), st.message()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cluster.

/// `cluster check`: asks each member (at its client address) for its log digest at one
/// index and compares them with the leader's (or, with no leader answering, the most common).
async fn check(conn: &mut Conn, out: Output, index: Option<u64>, wait_ms: u64) -> anyhow::Result<()> {
    let cc = pb::cluster_client::ClusterClient::new;
    let m = conn.call(|ch| async move { cc(ch).members(pb::MembersRequest {}).await }).await.map_err(status_err)?;
    let index = index.unwrap_or(m.commit_index);
    let direct = Conn {
        addrs: vec![String::new()],
        current: None,
        request_timeout: Some(Duration::from_millis(wait_ms).max(REQUEST_TIMEOUT) + Duration::from_secs(1)),
    };
    let mut answers: Vec<(&pb::Member, Result<pb::DigestResponse, String>)> = Vec::new();
    for member in &m.members {
        let r = match direct.connect(&member.addr).await {
            Err(e) => Err(format!("unreachable: {e}")),
            Ok(ch) => cc(ch)
                .digest(pb::DigestRequest { index, wait_ms })
                .await
                .map(tonic::Response::into_inner)
                .map_err(|s| format!("{}: {}", code_name(s.code()), s.message())),
        };
        answers.push((member, r));
    }
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for (_, r) in &answers {
        if let Ok(d) = r {
            *counts.entry(d.digest).or_default() += 1;
        }
    }
    let leader = answers.iter().find(|(mb, r)| mb.leader && r.is_ok()).and_then(|(_, r)| r.as_ref().ok());
    let most = counts.iter().max_by_key(|(d, n)| (**n, std::cmp::Reverse(**d))).map(|(d, _)| *d);
    let reference = leader.map(|d| d.digest).or(most);
    let mut bad = 0usize;
    let verdicts: Vec<(&pb::Member, &Result<pb::DigestResponse, String>, &str)> = answers
        .iter()
        .map(|(mb, r)| {
            let v = match r {
                Ok(d) if Some(d.digest) == reference => "OK",
                Ok(_) => "MISMATCH",
                Err(_) => "ERROR",
            };
            if v != "OK" {
                bad += 1;
            }
            (*mb, r, v)
        })
        .collect();
    match out {
        Output::Json => print_value(&json!({
            "index": index,
            "ok": bad == 0,
            "servers": verdicts.iter().map(|(mb, r, v)| match r {
                Ok(d) => json!({"id": mb.id, "addr": mb.addr, "result": v, "applied_index": d.applied_index,
                    "digest": format!("{:016x}", d.digest)}),
                Err(e) => json!({"id": mb.id, "addr": mb.addr, "result": v, "error": e}),
            }).collect::<Vec<_>>(),
        }))?,
        Output::Table => {
            let rows: Vec<Vec<String>> = verdicts
                .iter()
                .map(|(mb, r, v)| match r {
                    Ok(d) => vec![
                        mb.id.to_string(),
                        mb.addr.clone(),
                        d.applied_index.to_string(),
                        format!("{:016x}", d.digest),
                        (*v).to_owned(),
                    ],
                    Err(e) => vec![mb.id.to_string(), mb.addr.clone(), "-".into(), "-".into(), format!("{v}: {e}")],
                })
                .collect();
            println!("{}", table(&["ID", "ADDR", "APPLIED", "DIGEST", "RESULT"], &rows));
            if bad == 0 {
                println!("all {} servers agree at log index {index}", rows.len());
            }
        }
    }
    if bad > 0 {
        anyhow::bail!("{bad} of {} servers do not agree at log index {index} (or did not answer)", answers.len());
    }
    Ok(())
}

/// Most bytes `cluster backup` accepts from a server.
const MAX_BACKUP_BYTES: u64 = 64 << 30;
/// Longest wait for the next chunk of a backup.
const BACKUP_STALL: Duration = Duration::from_secs(60);

async fn cluster(args: ConnArgs, cmd: ClusterCmd) -> anyhow::Result<()> {
    let mut conn = Conn::new(&args)?;
    let out = args.output;
    let cc = pb::cluster_client::ClusterClient::new;
    match cmd {
        ClusterCmd::Backup { file } => {
            let mut sconn = conn.streaming();
            let mut stream = sconn
                .call(|ch| async move { cc(ch).max_decoding_message_size(4 << 20).backup(pb::BackupRequest {}).await })
                .await
                .map_err(status_err)?;
            let mut bytes: Vec<u8> = Vec::new();
            loop {
                let m = tokio::time::timeout(BACKUP_STALL, stream.message())
                    .await
                    .map_err(|_| anyhow::anyhow!("the backup stream stalled for {BACKUP_STALL:?}"))?
                    .map_err(status_err)?;
                let Some(chunk) = m else { break };
                anyhow::ensure!(
                    (bytes.len() + chunk.data.len()) as u64 <= MAX_BACKUP_BYTES,
                    "the backup is larger than {MAX_BACKUP_BYTES} bytes; refusing it"
                );
                bytes.extend_from_slice(&chunk.data);
            }
            let (h, _) = suanli_server::backup::decode(&bytes).context("checking the backup received")?;
            let tmp = file.with_extension("partial");
            {
                use std::io::Write as _;
                let mut f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
                f.write_all(&bytes).with_context(|| format!("writing {}", tmp.display()))?;
                f.sync_all()?;
            }
            std::fs::rename(&tmp, &file).with_context(|| format!("renaming into {}", file.display()))?;
            let index = h.last_applied.map_or(0, |l| l.index);
            match out {
                Output::Json => print_value(&json!({
                    "file": file.display().to_string(), "bytes": bytes.len(), "cluster_id": h.cluster_id,
                    "last_applied_index": index, "server_id": h.server_id, "checksum": h.checksum,
                })),
                Output::Table => {
                    println!(
                        "backup of cluster {} at log index {index} (served by server {}) written to {} ({} bytes, checksum {})",
                        dash(&h.cluster_id),
                        h.server_id,
                        file.display(),
                        bytes.len(),
                        h.checksum
                    );
                    Ok(())
                }
            }
        }
        ClusterCmd::Restore { file, from_data_dir, data_dir, id, listen, advertise, peer_listen, peer_advertise } => {
            let cfg = suanli_server::ServerConfig {
                id,
                listen,
                advertise,
                peer_listen,
                peer_advertise,
                data_dir: data_dir.clone(),
                ..suanli_server::ServerConfig::default()
            };
            cfg.validate()?;
            let node = suanli_raft::ServerNode::new(cfg.peer_advertised(), cfg.advertised().to_owned());
            let r = match (&file, &from_data_dir) {
                (Some(f), _) => {
                    let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
                    suanli_server::backup::restore_backup(&bytes, &data_dir, id, node)?
                }
                (None, Some(old)) => suanli_server::backup::restore_data_dir(old, &data_dir, id, node).await?,
                (None, None) => anyhow::bail!("give a backup FILE or --from-data-dir"),
            };
            let index = r.source_last_applied.map_or(0, |l| l.index);
            match out {
                Output::Json => print_value(&json!({
                    "data_dir": data_dir.display().to_string(), "id": id, "cluster_id": r.cluster_id,
                    "source_cluster_id": r.source_cluster_id, "source_last_applied_index": index,
                    "jobs": r.jobs, "allocs": r.allocs, "halted_at": r.halted_at,
                })),
                Output::Table => {
                    println!(
                        "new cluster {} written to {} (server {id} its only member): the state of cluster {} at log index {index}, {} jobs, {} allocations",
                        r.cluster_id,
                        data_dir.display(),
                        dash(&r.source_cluster_id),
                        r.jobs,
                        r.allocs
                    );
                    if let Some(h) = r.halted_at {
                        println!(
                            "warning: the source's log halted at entry {h} (a command this build cannot apply): the state stops before it"
                        );
                    }
                    println!(
                        "start it with: suanli server --id {id} --data-dir {} --listen {}   (then add servers with --join)",
                        data_dir.display(),
                        cfg.listen
                    );
                    Ok(())
                }
            }
        }
        ClusterCmd::Members => {
            let r =
                conn.call(|ch| async move { cc(ch).members(pb::MembersRequest {}).await }).await.map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({
                    "term": r.term, "commit_index": r.commit_index, "cluster_id": r.cluster_id,
                    "members": r.members.iter().map(|m| json!({
                        "id": m.id, "addr": m.addr, "peer_addr": m.peer_addr, "voter": m.voter, "leader": m.leader, "matched_index": m.matched_index,
                    })).collect::<Vec<_>>(),
                })),
                Output::Table => {
                    let rows: Vec<Vec<String>> = r
                        .members
                        .iter()
                        .map(|m| {
                            let role = if m.leader {
                                "leader"
                            } else if m.voter {
                                "voter"
                            } else {
                                "learner"
                            };
                            vec![
                                m.id.to_string(),
                                m.addr.clone(),
                                dash(&m.peer_addr),
                                role.to_owned(),
                                m.matched_index.to_string(),
                            ]
                        })
                        .collect();
                    println!("{}", table(&["ID", "ADDR", "PEER", "ROLE", "MATCHED"], &rows));
                    println!("cluster {}, term {}, commit index {}", dash(&r.cluster_id), r.term, r.commit_index);
                    Ok(())
                }
            }
        }
        ClusterCmd::Leader => {
            let r =
                conn.call(|ch| async move { cc(ch).leader(pb::LeaderRequest {}).await }).await.map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({
                    "leader_id": r.leader_id, "leader_addr": r.leader_addr, "term": r.term,
                })),
                Output::Table => {
                    if r.leader_id == 0 {
                        println!("no leader known (term {})", r.term);
                    } else {
                        println!("leader {} at {} (term {})", r.leader_id, dash(&r.leader_addr), r.term);
                    }
                    Ok(())
                }
            }
        }
        ClusterCmd::AddServer { id, addr, peer_addr, learner_only } => {
            conn.call(|ch| {
                let (addr, peer_addr) = (addr.clone(), peer_addr.clone());
                async move { cc(ch).add_server(pb::AddServerRequest { id, addr, learner_only, peer_addr }).await }
            })
            .await
            .map_err(status_err)?;
            match out {
                Output::Json => {
                    print_value(&json!({"id": id, "addr": addr, "learner_only": learner_only, "added": true}))
                }
                Output::Table => {
                    let role = if learner_only { "learner" } else { "voter" };
                    println!("server {id} at {addr} added as a {role}");
                    Ok(())
                }
            }
        }
        ClusterCmd::RemoveServer { id } => {
            conn.call(|ch| async move { cc(ch).remove_server(pb::RemoveServerRequest { id }).await })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({"id": id, "removed": true})),
                Output::Table => {
                    println!("server {id} removed");
                    Ok(())
                }
            }
        }
        ClusterCmd::Check { index, wait_ms } => check(&mut conn, out, index, wait_ms).await,
        ClusterCmd::Snapshot => {
            let r = conn
                .call(|ch| async move { cc(ch).snapshot(pb::SnapshotRequest {}).await })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({"last_log_index": r.last_log_index})),
                Output::Table => {
                    println!("snapshot built up to log index {}", r.last_log_index);
                    Ok(())
                }
            }
        }
        ClusterCmd::Version => {
            let r =
                conn.call(|ch| async move { cc(ch).version(pb::VersionRequest {}).await }).await.map_err(status_err)?;
            let halt =
                r.halt.as_ref().map(|h| json!({"index": h.index, "term": h.term, "kind": h.kind, "reason": h.reason}));
            match out {
                Output::Json => print_value(&json!({
                    "id": r.id, "version": r.version, "command_version": r.command_version,
                    "command_kinds": r.command_kinds, "halt": halt, "cluster_id": r.cluster_id,
                    "clock": r.clock, "cluster_time_s": r.cluster_time_s,
                })),
                Output::Table => {
                    println!("server {}: suanli {} (commands v{})", r.id, r.version, r.command_version);
                    println!("cluster {}", dash(&r.cluster_id));
                    println!("applies: {}", r.command_kinds.join(", "));
                    println!("clock: {}", r.clock);
                    println!("cluster time: {} s since the Unix epoch", r.cluster_time_s);
                    match &r.halt {
                        None => println!("applying the log (not halted)"),
                        Some(h) => println!(
                            "HALTED at log entry {} (term {}, kind {:?}): {}\nread-only until a build that applies it restarts this server, or `suanli cluster skip-entry --index {} --kind {:?}`",
                            h.index, h.term, h.kind, h.reason, h.index, h.kind
                        ),
                    }
                    Ok(())
                }
            }
        }
        ClusterCmd::SkipEntry { index, kind } => {
            let r = conn
                .call(|ch| {
                    let kind = kind.clone();
                    async move { cc(ch).skip_entry(pb::SkipEntryRequest { index, kind }).await }
                })
                .await
                .map_err(status_err)?;
            match out {
                Output::Json => print_value(&json!({"skipped": index, "at": r.index})),
                Output::Table => {
                    println!("entry {index} skipped by the order committed at {}; the group applies again", r.index);
                    Ok(())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_cells_never_carry_terminal_escapes() {
        let t = table(&["TEAM"], &[vec!["a\u{1b}[31mred\u{200b}".into()]]);
        assert!(!t.contains('\u{1b}') && !t.contains('\u{200b}'), "{t:?}");
        assert!(t.contains("\\u{1b}[31mred\\u{200b}"), "{t}");
    }

    #[test]
    fn units_print_short() {
        assert_eq!(milli(1500), "1.5");
        assert_eq!(milli(250), "0.25");
        assert_eq!(milli(8000), "8");
        assert_eq!(mib(65536), "64Gi");
        assert_eq!(mib(1536), "1.5Gi");
        assert_eq!(mib(500), "500Mi");
        assert_eq!(mib(2 * 1024 * 1024), "2Ti");
    }

    #[test]
    fn tables_align() {
        let t = table(&["A", "LONG"], &[vec!["xyz".into(), "1".into()], vec!["q".into(), "22".into()]]);
        assert_eq!(t, "A    LONG\nxyz  1\nq    22");
    }

    #[test]
    fn request_ids_differ() {
        assert_ne!(new_request_id(), new_request_id());
    }
}
