//! `suanli`: the one binary. Subcommands: `dev` (a local cluster), `server`, `agent`, the client
//! commands (`job`, `queue`, `pool`, `node`, `cluster`), `plugin check`, `sim` (trace-driven
//! simulation) and `bench`; `plugin-host` and `task-shim` are started by the agent itself.

mod access_cmd;
mod agent_cmd;
mod bench;
mod bench_cluster;
mod bench_federation;
mod client;
mod federation_cmd;
mod logging;
mod otlp_sink;
mod plugin;
mod serve;
mod sim;
mod sim_replay;
mod spec;
mod tls_cmd;

use clap::{Parser, Subcommand};

/// mimalloc instead of the system allocator: the control plane allocates many small, short-lived
/// objects (specs, log entries, gRPC frames) from several threads, where glibc's malloc spent a
/// fifth of the leader's CPU in `bench submit` (docs/control-plane.md, "Performance").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// suanli (算力): a fault-tolerant scheduler for shared GPU, NPU and CPU capacity.
#[derive(Parser, Debug)]
#[command(name = "suanli", version, about, long_about = None)]
struct Cli {
    /// Log line format of `server`, `agent` and `dev` on stderr: `text` (coloured only when
    /// stderr is a terminal) or `json` (one JSON object per line).
    #[arg(long, global = true, env = "SUANLI_LOG_FORMAT", value_enum, default_value_t = logging::LogFormat::Text)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a local development cluster in one command (a server and two agents with fake GPUs/NPUs).
    Dev(serve::DevArgs),
    /// Run a control-plane server (raft member; config file, environment and flags).
    Server(serve::ServerArgs),
    /// Replay traces on the scheduling engine (what-if analysis).
    #[command(subcommand)]
    Sim(sim::SimCmd),
    /// Benchmarks that print ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Submit, inspect, list, cancel, watch jobs and show their logs; validate job spec files.
    Job(client::JobArgs),
    /// Long-running services: `service endpoints NAME` (where the ready replicas serve),
    /// `service status NAME`.
    Service(client::ServiceArgs),
    /// Create, list, inspect and delete queues; validate queue files.
    Queue(client::QueueArgs),
    /// List resource pools.
    Pool(client::PoolArgs),
    /// List, inspect, cordon, drain and register nodes.
    Node(client::NodeArgs),
    /// Raft membership: members, leader, add or remove servers, snapshots.
    Cluster(client::ClusterArgs),
    /// The cost ledger: `cost report --by team|queue|job|pool`, `cost prices set|show`.
    Cost(client::cost::CostArgs),
    /// Who the servers take this caller to be (certificate or token).
    Whoami(access_cmd::WhoamiArgs),
    /// Bearer tokens: create, revoke, list.
    Token(access_cmd::TokenArgs),
    /// The audit log of mutating calls (who, what, when, result).
    Audit(access_cmd::AuditArgs),
    /// Run the node agent: device plugins, registration, heartbeats, tasks.
    Agent(agent_cmd::AgentArgs),
    /// Device plugins: `plugin check LIB.so` is the vendor's conformance kit.
    Plugin(plugin::PluginArgs),
    /// The federation over regions: `federation serve` runs a federation server; status,
    /// regions, jobs, job, submit, cancel, quota, cost, add-server and remove-server talk to one;
    /// recover rebuilds one offline.
    Federation(federation_cmd::FederationArgs),
    /// Development certificates: `tls init DIR` (a CA, server and admin), `tls issue` (one more, or a rotation).
    Tls(tls_cmd::TlsArgs),
    /// (internal) Host one device plugin library in this process for the agent, over stdin/stdout.
    #[command(hide = true)]
    PluginHost(plugin::PluginHostArgs),
    /// (internal) Run one task for the agent and record its exit status.
    #[command(hide = true)]
    TaskShim(agent_cmd::TaskShimArgs),
}

/// mimalloc's `mi_option_purge_delay` (the option's number in mimalloc.h, stable across v2
/// and v3; the crate does not name it).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// How long freed memory stays mapped before mimalloc hands it back to the OS, unless the
/// operator set `MIMALLOC_PURGE_DELAY`. mimalloc's default (1 s in v3) is shorter than the
/// rhythm of a busy server's large buffers (a log entry batching up to 1,024 submissions, a
/// scheduling plan): with it they are returned and faulted in again, zeroing fresh huge pages,
/// 10% of the CPU in `bench submit`. Memory a burst used still goes back to the OS, ten seconds
/// after the burst.
const PURGE_DELAY_MS: std::ffi::c_long = 10_000;

#[allow(unsafe_code)]
fn tune_allocator() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: a plain store into mimalloc's option table, made before this process starts
        // any thread (the setter is documented as not thread safe).
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    }
}

/// Restores the default action of SIGPIPE (end the process quietly), as other Unix tools
/// have it: Rust's runtime ignores SIGPIPE, so `suanli job list | head -1` would see EPIPE on
/// its next write and `println!` would panic. Only for the commands that print results and
/// then end (client commands, `sim`); the server, the agent and the processes they talk to over
/// pipes (plugin host, task shim) keep SIGPIPE ignored and handle EPIPE as an error, and so
/// does `bench`: it kills the servers it talks to, and a socket write that is a `writev` (h2's
/// vectored writes; only `send` passes MSG_NOSIGNAL) to a killed peer raised SIGPIPE, which
/// ended a `bench submit --compare-tracing` run silently with exit 141.
#[allow(unsafe_code)]
fn quiet_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: `signal` with SIG_DFL only changes this process's disposition of one signal,
    // before any thread is started; no handler code runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> std::process::ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    if matches!(
        cli.cmd,
        Cmd::Sim(_)
            | Cmd::Job(_)
            | Cmd::Service(_)
            | Cmd::Queue(_)
            | Cmd::Pool(_)
            | Cmd::Node(_)
            | Cmd::Cluster(_)
            | Cmd::Whoami(_)
            | Cmd::Token(_)
            | Cmd::Audit(_)
    ) || matches!(&cli.cmd, Cmd::Federation(f) if !f.is_serve())
    {
        quiet_on_closed_stdout();
    }
    logging::set_format(cli.log_format);
    let res = match cli.cmd {
        Cmd::PluginHost(a) => return plugin::host(a),
        Cmd::TaskShim(a) => return agent_cmd::shim(a),
        Cmd::Agent(a) => agent_cmd::run(a),
        Cmd::Plugin(a) => plugin::run(a),
        Cmd::Tls(a) => tls_cmd::run(a),
        Cmd::Dev(a) => serve::dev(a),
        Cmd::Server(a) => serve::server(a),
        Cmd::Sim(c) => sim::run(c),
        Cmd::Bench(c) => bench::run(c),
        Cmd::Job(c) => client::run(client::ClientCmd::Job(c)),
        Cmd::Service(c) => client::run(client::ClientCmd::Service(c)),
        Cmd::Queue(c) => client::run(client::ClientCmd::Queue(c)),
        Cmd::Pool(c) => client::run(client::ClientCmd::Pool(c)),
        Cmd::Node(c) => client::run(client::ClientCmd::Node(c)),
        Cmd::Cluster(c) => client::run(client::ClientCmd::Cluster(c)),
        Cmd::Cost(a) => a.run(),
        Cmd::Whoami(a) => a.run(),
        Cmd::Token(a) => a.run(),
        Cmd::Audit(a) => a.run(),
        Cmd::Federation(a) => federation_cmd::run(a),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if matches!(e.downcast_ref::<suanli_server::ServerError>(), Some(suanli_server::ServerError::Removed(_))) {
                return std::process::ExitCode::from(serve::EXIT_REMOVED);
            }
            std::process::ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parses(args: &[&str]) -> bool {
        Cli::try_parse_from(std::iter::once("suanli").chain(args.iter().copied())).is_ok()
    }

    #[test]
    fn checkpoint_commands_parse() {
        assert!(parses(&["job", "migrate", "7"]));
        assert!(parses(&["job", "migrate", "7", "--to-pool", "gpu-b"]));
        assert!(parses(&["job", "migrate", "7", "--to-node", "n3"]));
        assert!(!parses(&["job", "migrate", "7", "--to-pool", "gpu-b", "--to-node", "n3"]), "one target");
        assert!(parses(&["cluster", "config", "get"]));
        assert!(parses(&["cluster", "config", "get", "--stale", "--output", "json"]));
        assert!(parses(&["cluster", "config", "set", "checkpoint_store=file:///c", "avoid_failed_node_s=60"]));
        assert!(!parses(&["cluster", "config", "set"]), "at least one FIELD=VALUE");
        assert!(!parses(&["cluster", "config", "set", "novalue"]));
    }

    #[test]
    fn access_commands_parse() {
        assert!(parses(&["whoami"]));
        assert!(parses(&["whoami", "--output", "json"]));
        assert!(parses(&["token", "create", "--name", "ci", "--role", "member", "--team", "nlp", "--ttl", "30d"]));
        assert!(parses(&["token", "create", "--name", "ci", "--role", "viewer"]), "ttl defaults to 30d");
        assert!(!parses(&["token", "create", "--name", "ci", "--role", "viewer", "--ttl", "3w"]));
        assert!(!parses(&["token", "create", "--role", "viewer"]), "a name is required");
        assert!(parses(&["token", "revoke", "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"]));
        assert!(parses(&["token", "list", "--output", "json"]));
        assert!(parses(&["audit"]));
        assert!(parses(&["audit", "--principal", "alice", "--method", "Jobs/", "--after", "10", "--limit", "5"]));
        assert!(!parses(&["audit", "--limit", "0"]));
    }
}
