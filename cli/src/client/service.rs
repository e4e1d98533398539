//! `suanli service`: long-running services (docs/services.md). `service endpoints NAME`
//! prints where the ready replicas serve, one `host:port` a line, for a load balancer's
//! upstream list; `service status NAME` shows replicas wanted, running and ready;
//! `service update NAME FILE` replaces its spec by a rolling update (or scales it).

use super::render::{print_json, table};
use super::{ConnArgs, Output};
use anyhow::bail;
use clap::{Args, Subcommand};
use serde_json::json;
use suanli_client::{Connection, JobFilter, pb};

/// `suanli service`.
#[derive(Args, Debug)]
pub struct ServiceArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: ServiceCmd,
}

/// Service commands.
#[derive(Subcommand, Debug)]
pub enum ServiceCmd {
    /// Where the ready replicas of a service serve: one `host:port` a line (JSON: each
    /// replica with its node and allocation).
    Endpoints {
        /// The service: its job name (the one live service of that name) or job id.
        service: String,
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// Replace a service's spec: its replicas are replaced one step at a time as the new
    /// spec's `[service.update]` allows (max_unavailable, max_surge); a new `replicas` alone
    /// scales it. The queue and the task groups stay.
    Update {
        /// The service: its job name (the one live service of that name) or job id.
        service: String,
        /// The new spec file (TOML or JSON, as `job submit` reads it).
        file: std::path::PathBuf,
    },
    /// A service's replicas: wanted, running, ready, restarts, and each replica's endpoint,
    /// with the latency and success ratio it last reported (`service.report`).
    Status {
        /// The service: its job name (the one live service of that name) or job id.
        service: String,
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
}

/// Live job states (a service is live until cancelled).
const LIVE: [&str; 5] = ["pending", "placed", "running", "preempted", "requeuing"];

/// The service named `name` (a job id, or the name of exactly one live service), in full.
async fn find(conn: &Connection, name: &str, stale: bool) -> anyhow::Result<pb::JobInfo> {
    if let Ok(id) = name.parse::<u64>() {
        let j = conn.get_job(id, stale).await?;
        if !j.service {
            bail!("job {id} ({}) is not a service (kind = \"inference\" or a [service] section)", j.name);
        }
        return Ok(j);
    }
    let filter = JobFilter { queue: String::new(), states: LIVE.iter().map(|s| (*s).to_owned()).collect(), stale };
    let jobs: Vec<pb::JobInfo> =
        conn.list_jobs(&filter, None).await?.into_iter().filter(|j| j.name == name && j.service).collect();
    match jobs.as_slice() {
        [] => bail!("no live service named {name:?} (give a job id for one that ended)"),
        [one] => Ok(conn.get_job(one.id, stale).await?),
        many => {
            let ids: Vec<String> = many.iter().map(|j| j.id.to_string()).collect();
            bail!("{} live services are named {name:?} (jobs {}): give a job id", many.len(), ids.join(", "))
        }
    }
}

/// The replicas that serve traffic: running and ready, with an endpoint.
fn ready(j: &pb::JobInfo) -> impl Iterator<Item = &pb::AllocInfo> {
    j.allocs.iter().filter(|a| a.state == "running" && a.ready && !a.endpoint.is_empty())
}

impl ServiceArgs {
    pub(super) async fn run(self) -> anyhow::Result<()> {
        let conn = self.conn.connect()?;
        let out = self.conn.output;
        match self.cmd {
            ServiceCmd::Endpoints { service, stale } => {
                let j = find(&conn, &service, stale).await?;
                match out {
                    Output::Json => {
                        let v: Vec<_> = ready(&j)
                            .map(|a| {
                                json!({"endpoint": a.endpoint, "node": a.node, "alloc_id": a.id,
                                    "group": a.group_name, "replica": a.replica})
                            })
                            .collect();
                        print_json(&json!({"job_id": j.id, "name": j.name, "endpoints": v}))
                    }
                    Output::Table => {
                        for a in ready(&j) {
                            println!("{}", a.endpoint);
                        }
                        Ok(())
                    }
                }
            }
            ServiceCmd::Update { service, file } => {
                let spec = crate::spec::load_job(&file)?;
                let j = find(&conn, &service, false).await?;
                let version = conn.update_service(j.id, &serde_json::to_string(&spec)?).await?;
                match out {
                    Output::Json => print_json(&json!({"job_id": j.id, "name": j.name, "version": version})),
                    Output::Table => {
                        if version == j.version {
                            println!("service {} (job {}): unchanged at version {version}", j.name, j.id);
                        } else {
                            println!(
                                "service {} (job {}): version {version}; follow with `suanli service status {}`",
                                j.name, j.id, j.id
                            );
                        }
                        Ok(())
                    }
                }
            }
            ServiceCmd::Status { service, stale } => {
                let j = find(&conn, &service, stale).await?;
                let wanted = serde_json::from_str::<suanli_model::JobSpec>(&j.spec_json)
                    .map(|s| s.groups.iter().map(|g| g.replicas).sum::<u32>())
                    .unwrap_or(0);
                let running = j.allocs.iter().filter(|a| a.state == "running").count();
                let n_ready = ready(&j).count();
                let old = j.allocs.iter().filter(|a| a.version != j.version).count();
                match out {
                    Output::Json => print_json(&json!({
                        "job_id": j.id, "name": j.name, "state": j.state, "wanted": wanted,
                        "running": running, "ready": n_ready, "restarts": j.restarts, "reason": j.reason,
                        "version": j.version, "old_version_replicas": old,
                        "replicas": j.allocs.iter().map(|a| json!({
                            "alloc_id": a.id, "group": a.group_name, "replica": a.replica, "node": a.node,
                            "state": a.state, "ready": a.ready, "endpoint": a.endpoint,
                            "version": a.version, "latency_ms": a.latency_us.map(|l| l as f64 / 1000.0),
                            "success_ratio": a.success_ppm.map(|p| f64::from(p) / 1e6),
                            "reported_at": a.reported_at})).collect::<Vec<_>>(),
                    })),
                    Output::Table => {
                        println!(
                            "service {} (job {}): {} · version {} · {wanted} wanted, {running} running, {n_ready} ready, {} restarts",
                            j.name, j.id, j.state, j.version, j.restarts
                        );
                        if old > 0 {
                            println!("rolling update: {old} replicas of earlier versions still run");
                        }
                        if !j.reason.is_empty() {
                            println!("reason: {}", j.reason);
                        }
                        let rows: Vec<Vec<String>> = j
                            .allocs
                            .iter()
                            .map(|a| {
                                vec![
                                    format!("{}-{}", a.group_name, a.replica),
                                    a.id.to_string(),
                                    a.node.clone(),
                                    a.state.clone(),
                                    if a.ready { "yes".into() } else { "no".into() },
                                    if a.endpoint.is_empty() { "-".into() } else { a.endpoint.clone() },
                                    a.version.to_string(),
                                    a.latency_us.map_or_else(|| "-".into(), |l| format!("{:.1}ms", l as f64 / 1000.0)),
                                    a.success_ppm
                                        .map_or_else(|| "-".into(), |p| format!("{:.2}%", f64::from(p) / 10_000.0)),
                                ]
                            })
                            .collect();
                        println!(
                            "{}",
                            table(
                                &[
                                    "REPLICA", "ALLOC", "NODE", "STATE", "READY", "ENDPOINT", "VERSION", "LATENCY",
                                    "SUCCESS"
                                ],
                                &rows
                            )
                        );
                        Ok(())
                    }
                }
            }
        }
    }
}
