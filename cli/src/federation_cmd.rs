//! `suanli federation ...`: run a federation server (`serve`, the same membership and TLS flags
//! as `suanli server`) and talk to one (`status`, `regions`, `jobs`, `job`, `submit`, `cancel`,
//! `quota`, `cost`, `add-server`, `remove-server`); `recover` rebuilds one offline from a stopped
//! server's data dir. docs/federation.md.
//!
//! ```text
//!   --federation a:7600,b:7600 (env SUANLI_FEDERATION; dev: ./.suanli/dev/federation)
//!   --ca/--cert/--key or SUANLI_TLS_DIR (certificates only: tokens are region-local)
//!      │ suanli_client::Connection (leader following)  ──▶  tables or --output json
//! ```

use crate::client::Output;
use crate::client::creds::CredArgs;
use crate::client::render::{fields, milli, print_json, table};
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use std::collections::BTreeMap;
use std::path::PathBuf;
use suanli_client::{Connection, ConnectionConfig, new_request_id, pb};
use suanli_federation::server::{FederationServerConfig, parse_peer};

/// Where `suanli dev` may leave the federation's addresses (one line, comma-separated).
pub const DEV_FEDERATION_FILE: &str = ".suanli/dev/federation";

/// `suanli federation`.
#[derive(Args, Debug)]
pub struct FederationArgs {
    /// Federation server addresses, host:port, comma-separated (default: the addresses in
    /// ./.suanli/dev/federation when present).
    #[arg(long, global = true, env = "SUANLI_FEDERATION", value_delimiter = ',')]
    pub federation: Vec<String>,
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Credentials.
    #[command(flatten)]
    pub creds: CredArgs,
    #[command(subcommand)]
    cmd: FedCmd,
}

#[derive(Subcommand, Debug)]
enum FedCmd {
    /// Run a federation server (a member of the federation's own raft group).
    Serve(FedServeArgs),
    /// Members, leader, counts and lease terms.
    Status,
    /// The region directory (capacity, health) and the global quotas.
    Regions,
    /// List federated jobs.
    Jobs {
        /// Only jobs in this state: pending, assigned, running, succeeded, failed, cancelled.
        #[arg(long)]
        state: Option<String>,
        /// Only jobs held by (or last held by) this region.
        #[arg(long)]
        region: Option<String>,
        /// Most jobs shown (default: every one).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Show one federated job (g-<n>) with its placements.
    Job {
        /// Its global id.
        id: String,
    },
    /// Submit a job spec file (the same file `suanli job submit` takes) to the federation.
    Submit {
        /// The spec file (.toml or .json).
        file: PathBuf,
        /// The team charged (default: the certificate's team).
        #[arg(long)]
        team: Option<String>,
        /// A preferred region label (data locality), KEY=VALUE; repeatable.
        #[arg(long = "prefer", value_name = "KEY=VALUE")]
        prefer: Vec<String>,
        /// De-duplication key: submitting again with it returns the first job (generated
        /// when absent).
        #[arg(long)]
        request_id: Option<String>,
    },
    /// Cancel a federated job.
    Cancel {
        /// Its global id.
        id: String,
    },
    /// Global quotas (worldwide, per team and device model).
    #[command(subcommand)]
    Quota(QuotaCmd),
    /// Add a federation server (admin): start it first with empty storage and without
    /// --bootstrap; it catches up as a learner, then becomes a voter unless --learner-only.
    AddServer(crate::client::cluster::AddServerArgs),
    /// Offline recovery from a lost majority (every federation server stopped): write a NEW data
    /// dir holding the state of a surviving server's data dir (read, never changed), with this
    /// server its only voter. Then `suanli federation serve --data-dir DIR --id N --listen ...`
    /// starts it; add the other voters with `add-server`.
    Recover {
        /// A stopped federation server's data dir to rebuild from.
        #[arg(long)]
        from_data_dir: PathBuf,
        /// The new data dir (must not exist, or be empty).
        #[arg(long)]
        data_dir: PathBuf,
        /// The raft id of the server that will run on it.
        #[arg(long)]
        id: u64,
        /// Its client listener, as `suanli federation serve --listen` will get it.
        #[arg(long)]
        listen: String,
        /// Its peer listener (default: --listen's port + 1).
        #[arg(long)]
        peer_listen: Option<String>,
    },
    /// Remove a federation server (admin): its vote first, then the server.
    RemoveServer {
        /// Its raft node id.
        #[arg(long)]
        id: u64,
    },
    /// The global cost roll-up: each region's ledger totals at its latest sync, summed by team
    /// or listed by region (docs/cost.md).
    Cost {
        /// team (summed over regions) or region.
        #[arg(long, default_value = "team")]
        by: String,
        /// table, json or csv (default: json with --output json, else table).
        #[arg(long, value_enum)]
        format: Option<crate::client::cost::Format>,
    },
}

#[derive(Subcommand, Debug)]
enum QuotaCmd {
    /// Set a team's worldwide quota for a device model (0 removes it).
    Set {
        /// The team.
        team: String,
        /// The device model (e.g. H100).
        model: String,
        /// Devices (decimal: 1.5 is one and a half).
        devices: String,
    },
    /// List the global quotas with their use.
    List,
}

/// Flags of `suanli federation serve`: the same names as `suanli server` for membership and
/// TLS, plus the federation's terms. `--insecure` (plaintext, no identities: development only)
/// is the command group's flag.
#[derive(Args, Debug, Clone, Default)]
pub struct FedServeArgs {
    /// TOML configuration file (unknown keys are refused; flags win over it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// This server's raft id (>= 1, unique).
    #[arg(long)]
    pub id: Option<u64>,
    /// The client listener (IP:PORT; port 0 picks one, printed on start).
    #[arg(long)]
    pub listen: Option<String>,
    /// The peer listener (IP:PORT): raft and FederationPeer, servers only.
    #[arg(long)]
    pub peer_listen: Option<String>,
    /// The HTTP listener (IP:PORT) serving /metrics; default: the client port + 2; "off": none.
    #[arg(long)]
    pub http_listen: Option<String>,
    /// Where the raft log and state live.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Initial voters, ID=HOST:PORT[/PEER_HOST:PEER_PORT], comma-separated (this server
    /// included).
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Create the group if the storage is empty (the smallest id of --peers does).
    #[arg(long)]
    pub bootstrap: bool,
    /// Serve TLS with DIR/ca.pem, DIR/server.pem, DIR/server-key.pem.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Lease length (terms written at bootstrap).
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// How often a region leader syncs (at most lease / 3).
    #[arg(long)]
    pub sync_interval_ms: Option<u64>,
    /// The assumed bound on clock differences.
    #[arg(long)]
    pub max_clock_drift_ms: Option<u64>,
    /// Re-dispatch no earlier than lease end + this (at least 2 x drift).
    #[arg(long)]
    pub redispatch_margin_ms: Option<u64>,
    /// A region that has not synced for this long is unhealthy.
    #[arg(long)]
    pub region_unhealthy_after_ms: Option<u64>,
}

impl FedServeArgs {
    /// The layered configuration: defaults, the file, the flags (`insecure`: `--insecure`).
    pub fn config(&self, insecure: bool) -> Result<FederationServerConfig> {
        let mut c = match &self.config {
            Some(p) => FederationServerConfig::from_file(p).map_err(anyhow::Error::msg)?,
            None => FederationServerConfig::default(),
        };
        if let Some(v) = self.id {
            c.id = v;
        }
        if let Some(v) = &self.listen {
            c.listen = v.clone();
            if self.peer_listen.is_none() {
                c.peer_listen = next_port(v).unwrap_or_else(|| c.peer_listen.clone());
            }
        }
        if let Some(v) = &self.peer_listen {
            c.peer_listen = v.clone();
        }
        if let Some(v) = &self.http_listen {
            c.http_listen = Some(v.clone());
        }
        if let Some(v) = &self.data_dir {
            c.data_dir = v.clone();
        }
        if !self.peers.is_empty() {
            c.peers = self
                .peers
                .iter()
                .filter(|p| !p.trim().is_empty())
                .map(|p| parse_peer(p))
                .collect::<Result<_, _>>()
                .map_err(anyhow::Error::msg)?;
        }
        if self.bootstrap {
            c.bootstrap = true;
        }
        if let Some(v) = &self.tls_dir {
            c.tls_dir = Some(v.clone());
        }
        if insecure {
            c.insecure = true;
        }
        let t = &mut c.terms;
        for (flag, v) in [
            (&mut t.lease_ms, self.lease_ms),
            (&mut t.sync_interval_ms, self.sync_interval_ms),
            (&mut t.max_clock_drift_ms, self.max_clock_drift_ms),
            (&mut t.redispatch_margin_ms, self.redispatch_margin_ms),
            (&mut t.region_unhealthy_after_ms, self.region_unhealthy_after_ms),
        ] {
            if let Some(v) = v {
                *flag = v;
            }
        }
        c.validate().map_err(anyhow::Error::msg)?;
        Ok(c)
    }
}

/// `host:port` with the port + 1 (port 0 stays 0).
fn next_port(addr: &str) -> Option<String> {
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let next = if port == 0 { 0 } else { port.checked_add(1)? };
    Some(format!("{host}:{next}"))
}

impl FederationArgs {
    /// Whether this is `federation serve` (a long-running server, not a client command).
    pub fn is_serve(&self) -> bool {
        matches!(self.cmd, FedCmd::Serve(_))
    }
}

/// Runs `suanli federation ...`.
pub fn run(args: FederationArgs) -> Result<()> {
    if let FedCmd::Serve(s) = &args.cmd {
        return serve(s, args.creds.insecure);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting tokio")?;
    if let FedCmd::Recover { from_data_dir, data_dir, id, listen, peer_listen } = &args.cmd {
        let listen =
            suanli_raft::membership::check_addr("listen", listen).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        let peer = match peer_listen {
            Some(p) => {
                suanli_raft::membership::check_addr("peer_listen", p).map_err(|e| anyhow::anyhow!("{}", e.message()))?
            }
            None => {
                let (host, port) = listen.rsplit_once(':').unwrap_or((listen.as_str(), "0"));
                let port = port.parse::<u16>().ok().and_then(|p| p.checked_add(1));
                format!("{host}:{}", port.context("peer_listen: --listen's port + 1 is no port; give --peer-listen")?)
            }
        };
        let node = suanli_raft::ServerNode::new(peer, listen);
        let r = rt
            .block_on(suanli_federation::server::recover_data_dir(from_data_dir, data_dir, *id, node))
            .map_err(|e| anyhow::anyhow!(e))?;
        if args.output == Output::Json {
            return print_json(&serde_json::json!({
                "data_dir": data_dir.display().to_string(), "id": id,
                "source_last_applied_index": r.source_last_applied, "halted_at": r.halted_at,
                "jobs": r.jobs, "regions": r.regions, "quotas": r.quotas,
            }));
        }
        println!(
            "federation state at log index {} written to {} (server {id} its only voter): {} jobs, {} regions, {} quotas",
            r.source_last_applied,
            data_dir.display(),
            r.jobs,
            r.regions,
            r.quotas
        );
        if let Some(i) = r.halted_at {
            println!("note: the source's log holds entry {i} this build cannot apply; the state stops before it");
        }
        return Ok(());
    }
    rt.block_on(client(args))
}

fn serve(args: &FedServeArgs, insecure: bool) -> Result<()> {
    let cfg = args.config(insecure)?;
    crate::logging::init_traced(
        "info,openraft=warn",
        crate::logging::Service {
            name: "suanli-federation",
            instance: format!("federation-{}", std::process::id()),
            config_endpoint: None,
            config_key: crate::logging::OTLP_ENV,
        },
    )?;
    let rt = crate::serve::runtime()?;
    let first = async {
        crate::serve::shutdown_signal().await;
        tokio::spawn(async {
            crate::serve::shutdown_signal().await;
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        });
    };
    let r = rt.block_on(suanli_federation::server::serve(cfg, first));
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    crate::logging::shutdown();
    r.map_err(anyhow::Error::msg)
}

fn addresses(given: &[String]) -> Result<Vec<String>> {
    let given: Vec<String> = given.iter().map(|a| a.trim().to_owned()).filter(|a| !a.is_empty()).collect();
    if !given.is_empty() {
        return Ok(given);
    }
    match std::fs::read_to_string(DEV_FEDERATION_FILE) {
        Ok(text) => {
            let v: Vec<String> =
                text.split([',', '\n']).map(|a| a.trim().to_owned()).filter(|a| !a.is_empty()).collect();
            if v.is_empty() {
                bail!("{DEV_FEDERATION_FILE} names no address; pass --federation ADDR[,ADDR] (or SUANLI_FEDERATION)");
            }
            Ok(v)
        }
        Err(_) => bail!("no federation address: pass --federation ADDR[,ADDR] (or SUANLI_FEDERATION)"),
    }
}

fn connect(args: &FederationArgs) -> Result<Connection> {
    let c = args.creds.load()?;
    if c.token.is_some() {
        bail!("--token: a federation server takes client certificates only (bearer tokens are region-local)");
    }
    let addrs = addresses(&args.federation)?;
    Ok(suanli_client::federation::connect_federation(
        &addrs,
        ConnectionConfig { tls: c.tls, ..ConnectionConfig::default() },
    )?)
}

/// `1.5` devices -> 1500 milli.
fn devices_milli(s: &str) -> Result<u64> {
    let s = s.trim();
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    if frac.len() > 3 || whole.is_empty() && frac.is_empty() {
        bail!("DEVICES: {s:?} is not a number of devices with at most 3 decimals (e.g. 8, 0.5)");
    }
    let w: u64 = if whole.is_empty() { 0 } else { whole.parse().with_context(|| format!("DEVICES: {s:?}"))? };
    let f: u64 =
        if frac.is_empty() { 0 } else { format!("{frac:0<3}").parse().with_context(|| format!("DEVICES: {s:?}"))? };
    w.checked_mul(1000).and_then(|m| m.checked_add(f)).with_context(|| format!("DEVICES: {s:?} is too large"))
}

fn ms_ago(t: u64) -> String {
    if t == 0 {
        return "-".into();
    }
    let now = suanli_federation::node::now_ms();
    format!("{:.1}s ago", now.saturating_sub(t) as f64 / 1000.0)
}

fn dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { s.to_owned() }
}

const JOB_HEADERS: [&str; 7] = ["ID", "NAME", "TEAM", "STATE", "REGION", "EPOCH", "REASON"];

fn job_row(j: &pb::FedJobInfo) -> Vec<String> {
    vec![
        j.global_id.clone(),
        j.name.clone(),
        j.team.clone(),
        j.state.clone(),
        dash(&j.region),
        j.epoch.to_string(),
        dash(&j.reason),
    ]
}

async fn client(args: FederationArgs) -> Result<()> {
    let conn = connect(&args)?;
    let out = args.output;
    match args.cmd {
        FedCmd::Serve(_) | FedCmd::Recover { .. } => Ok(()),
        FedCmd::Status => {
            let s = conn.fed_status().await?;
            if out == Output::Json {
                return print_json(&s);
            }
            println!(
                "{}",
                fields(&[
                    ("answered by", s.id.to_string()),
                    ("leader", if s.leader_id == 0 { "none".into() } else { s.leader_id.to_string() }),
                    ("applied index", s.applied_index.to_string()),
                    ("regions", format!("{} ({} healthy)", s.regions, s.healthy_regions)),
                    ("jobs", format!("{} pending, {} running", s.jobs_pending, s.jobs_running)),
                    (
                        "lease",
                        format!(
                            "{} ms (re-dispatch margin {} ms, clock drift bound {} ms)",
                            s.lease_ms, s.redispatch_margin_ms, s.max_clock_drift_ms
                        )
                    ),
                ])
            );
            let rows: Vec<Vec<String>> = s
                .members
                .iter()
                .map(|m| {
                    vec![
                        m.id.to_string(),
                        m.client_addr.clone(),
                        m.peer_addr.clone(),
                        if m.voter { "voter".into() } else { "learner".into() },
                        if m.id == s.leader_id { "leader".into() } else { String::new() },
                    ]
                })
                .collect();
            println!("{}", table(&["ID", "CLIENT", "PEER", "ROLE", ""], &rows));
            Ok(())
        }
        FedCmd::Regions => {
            let r = conn.fed_regions().await?;
            if out == Output::Json {
                return print_json(&r);
            }
            let rows: Vec<Vec<String>> = r
                .regions
                .iter()
                .map(|g| {
                    let mut by_model: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
                    for c in &g.capacity {
                        let e = by_model
                            .entry(if c.device_model.is_empty() { "cpu" } else { &c.device_model })
                            .or_default();
                        e.0 += c.free_milli;
                        e.1 += c.total_milli;
                    }
                    let cap = by_model
                        .iter()
                        .map(|(m, (f, t))| format!("{m} {}/{}", milli(*f), milli(*t)))
                        .collect::<Vec<_>>()
                        .join(", ");
                    vec![
                        g.name.clone(),
                        if g.healthy { "healthy".into() } else { "unhealthy".into() },
                        ms_ago(g.last_sync_ms),
                        dash(&cap),
                        g.backlog.to_string(),
                        g.federated_jobs.to_string(),
                        g.pools.join(","),
                    ]
                })
                .collect();
            println!(
                "{}",
                table(&["REGION", "HEALTH", "LAST SYNC", "FREE/TOTAL", "BACKLOG", "FED JOBS", "POOLS"], &rows)
            );
            if !r.quotas.is_empty() {
                println!();
                print_quotas(&r.quotas);
            }
            Ok(())
        }
        FedCmd::Jobs { state, region, limit } => {
            let jobs = conn.fed_jobs(state.as_deref().unwrap_or(""), region.as_deref().unwrap_or(""), limit).await?;
            if out == Output::Json {
                return print_json(&jobs);
            }
            println!("{}", table(&JOB_HEADERS, &jobs.iter().map(job_row).collect::<Vec<_>>()));
            Ok(())
        }
        FedCmd::Job { id } => {
            let j = conn.fed_get_job(&id).await?;
            if out == Output::Json {
                return print_json(&j);
            }
            println!(
                "{}",
                fields(&[
                    ("id", j.global_id.clone()),
                    ("name", j.name.clone()),
                    ("team", j.team.clone()),
                    ("state", j.state.clone()),
                    ("region", dash(&j.region)),
                    ("epoch", j.epoch.to_string()),
                    ("device model", dash(&j.device_model)),
                    ("lease until", if j.lease_until_ms == 0 { "-".into() } else { j.lease_until_ms.to_string() }),
                    ("local job", if j.local_job_id == 0 { "-".into() } else { j.local_job_id.to_string() }),
                    ("reason", dash(&j.reason)),
                    (
                        "checkpoint",
                        j.checkpoint.as_ref().map_or("-".into(), |c| format!("step {} at {}", c.step, c.uri)),
                    ),
                ])
            );
            if !j.history.is_empty() {
                let rows: Vec<Vec<String>> = j
                    .history
                    .iter()
                    .map(|p| {
                        vec![
                            p.region.clone(),
                            p.epoch.to_string(),
                            p.from_ms.to_string(),
                            if p.to_ms == 0 { "-".into() } else { p.to_ms.to_string() },
                            if p.end.is_empty() { "holds".into() } else { p.end.clone() },
                        ]
                    })
                    .collect();
                println!("placements:");
                crate::client::render::print_indented_table(&["REGION", "EPOCH", "FROM", "TO", "END"], &rows);
            }
            Ok(())
        }
        FedCmd::Submit { file, team, prefer, request_id } => {
            let spec = crate::spec::load_job(&file)?;
            let mut data_labels = BTreeMap::new();
            for p in &prefer {
                let Some((k, v)) = p.split_once('=') else {
                    bail!("--prefer {p:?}: expected KEY=VALUE (e.g. data=imagenet-eu)");
                };
                data_labels.insert(k.trim().to_owned(), v.trim().to_owned());
            }
            let req = pb::FedSubmitRequest {
                spec_json: serde_json::to_string(&spec)?,
                team: team.unwrap_or_default(),
                client_request_id: request_id.unwrap_or_else(|| new_request_id("cli")),
                data_labels,
                ..Default::default()
            };
            let r = conn.fed_submit(req, |e, d| eprintln!("retrying in {} ms: {e}", d.as_millis())).await?;
            if out == Output::Json {
                return print_json(&r);
            }
            if r.created {
                println!("submitted {}", r.global_id);
            } else {
                println!("{} (already submitted with this request id)", r.global_id);
            }
            Ok(())
        }
        FedCmd::AddServer(a) => {
            conn.fed_add_server(a.request()).await?;
            let crate::client::cluster::AddServerArgs { id, addr, learner_only, .. } = a;
            let role = if learner_only { "learner" } else { "voter" };
            if out == Output::Json {
                return print_json(&serde_json::json!({"id": id, "addr": addr, "role": role}));
            }
            println!("federation server {id} at {addr} added as a {role}");
            Ok(())
        }
        FedCmd::RemoveServer { id } => {
            conn.fed_remove_server(id).await?;
            if out == Output::Json {
                return print_json(&serde_json::json!({"id": id, "removed": true}));
            }
            println!("federation server {id} removed");
            Ok(())
        }
        FedCmd::Cancel { id } => {
            conn.fed_cancel(&id).await?;
            if out == Output::Json {
                return print_json(&serde_json::json!({"global_id": id, "cancel_requested": true}));
            }
            println!("{id}: cancel requested (a running job stops at its region's next sync)");
            Ok(())
        }
        FedCmd::Quota(QuotaCmd::Set { team, model, devices }) => {
            let m = devices_milli(&devices)?;
            conn.fed_set_quota(&team, &model, m).await?;
            if out == Output::Json {
                return print_json(&serde_json::json!({"team": team, "device_model": model, "limit_milli": m}));
            }
            if m == 0 {
                println!("quota of team {team} for {model} removed");
            } else {
                println!("quota of team {team} for {model}: {} devices worldwide", milli(m));
            }
            Ok(())
        }
        FedCmd::Cost { by, format } => {
            let r = conn.fed_cost(&by).await?;
            let format = format.unwrap_or(if out == Output::Json {
                crate::client::cost::Format::Json
            } else {
                crate::client::cost::Format::Table
            });
            crate::client::cost::print_report(&r, format)
        }
        FedCmd::Quota(QuotaCmd::List) => {
            let r = conn.fed_regions().await?;
            if out == Output::Json {
                return print_json(&r.quotas);
            }
            print_quotas(&r.quotas);
            Ok(())
        }
    }
}

/// One row per quota, then one per region lease under it (`  lease REGION`): the lease, the
/// region's reported use and want.
fn print_quotas(q: &[pb::QuotaInfo]) {
    let mut rows: Vec<Vec<String>> = Vec::new();
    for q in q {
        rows.push(vec![
            q.team.clone(),
            q.device_model.clone(),
            milli(q.limit_milli),
            milli(q.used_milli),
            milli(q.reserved_milli),
            String::new(),
        ]);
        for l in &q.leases {
            rows.push(vec![
                format!("  lease {}", l.region),
                String::new(),
                milli(l.limit_milli),
                milli(l.used_milli),
                String::new(),
                milli(l.wanted_milli),
            ]);
        }
    }
    println!("{}", table(&["TEAM", "MODEL", "LIMIT", "USED", "RESERVED", "WANTED"], &rows));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_as_milli() {
        assert_eq!(devices_milli("8").expect("ok"), 8000);
        assert_eq!(devices_milli("0.5").expect("ok"), 500);
        assert_eq!(devices_milli("1.25").expect("ok"), 1250);
        assert!(devices_milli("1.2345").is_err());
        assert!(devices_milli("x").is_err());
    }

    #[test]
    fn serve_flags_mirror_the_server() {
        let a = FedServeArgs {
            id: Some(2),
            listen: Some("127.0.0.1:7600".into()),
            peers: vec!["1=127.0.0.1:7500/127.0.0.1:7501".into(), "2=127.0.0.1:7600".into()],
            lease_ms: Some(30_000),
            ..FedServeArgs::default()
        };
        let c = a.config(true).expect("valid");
        assert_eq!(c.peer_listen, "127.0.0.1:7601");
        assert_eq!(c.peers[1], (2, "127.0.0.1:7600".into(), "127.0.0.1:7601".into()));
        assert_eq!(c.terms.lease_ms, 30_000);
    }
}
