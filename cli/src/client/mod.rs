//! Client commands: `suanli job|queue|pool|node|cluster ...`: argument parsing and rendering
//! over `suanli-client`, which owns the connection (leader following, hung-server probes,
//! retries with the same request id) and the typed calls.
//!
//! ```text
//!   --server a:7400,b:7400,c:7400 (env SUANLI_ADDR)
//!   --ca/--cert/--key/--token/--insecure, or SUANLI_TLS_DIR, or ./.suanli/dev/tls (creds.rs)
//!      │ suanli_client::Connection (TLS, 2 s connect, 2 s first answer + 1 s probe, leader hints)
//!      ▼
//!   job.rs | queue.rs (queues, pools) | node.rs | cluster.rs  ──▶  render.rs (tables, JSON)
//! ```
//!
//! Spec files are loaded and validated locally first ([`crate::spec`]); the `validate`
//! commands do only that and need no server.

pub(crate) mod cluster;
pub mod cost;
pub mod creds;
mod job;
mod node;
mod queue;
pub(crate) mod render;
mod service;

pub use cluster::ClusterArgs;
pub use job::JobArgs;
pub use node::NodeArgs;
pub use queue::{PoolArgs, QueueArgs};
pub use service::ServiceArgs;

use anyhow::Context;
use clap::{Args, ValueEnum};
use suanli_client::{Connection, ConnectionConfig};

/// Server address used when neither `--server` nor `SUANLI_ADDR` is given.
pub const DEFAULT_ADDR: &str = "127.0.0.1:7400";

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
    /// Credentials.
    #[command(flatten)]
    pub creds: creds::CredArgs,
}

impl ConnArgs {
    /// The connection to the listed servers with the credentials given, and the client
    /// library's defaults.
    pub(crate) fn connect(&self) -> anyhow::Result<Connection> {
        let c = self.creds.load()?;
        Ok(Connection::new(
            &self.servers,
            ConnectionConfig { tls: c.tls, token: c.token, ..ConnectionConfig::default() },
        )?)
    }
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
    /// `suanli service`.
    Service(ServiceArgs),
}

/// Runs a client command; the `validate` commands run without a runtime, the others on a
/// single-threaded tokio runtime.
pub fn run(cmd: ClientCmd) -> anyhow::Result<()> {
    if let Some(r) = match &cmd {
        ClientCmd::Job(a) => a.offline(),
        ClientCmd::Queue(a) => a.offline(),
        ClientCmd::Node(a) => a.offline(),
        ClientCmd::Pool(_) | ClientCmd::Cluster(_) | ClientCmd::Service(_) => None,
    } {
        return r;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async move {
        match cmd {
            ClientCmd::Job(a) => a.run().await,
            ClientCmd::Queue(a) => a.run().await,
            ClientCmd::Pool(a) => a.run().await,
            ClientCmd::Node(a) => a.run().await,
            ClientCmd::Service(a) => a.run().await,
            ClientCmd::Cluster(a) => a.run().await,
        }
    })
}

/// A duration for a flag: `90`, `90s`, `10m`, `2h`, `1d`, in seconds.
pub(crate) fn parse_duration_s(s: &str) -> Result<u64, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration_s("90"), Ok(90));
        assert_eq!(parse_duration_s("10m"), Ok(600));
        assert_eq!(parse_duration_s("1d"), Ok(86_400));
        assert!(parse_duration_s("5w").is_err());
    }
}
