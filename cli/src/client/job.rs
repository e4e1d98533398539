//! `suanli job ...`: validate, submit, status, list, cancel, logs, watch.

use super::render::{JOB_HEADERS, job_row, print_event, print_job, print_json, table};
use super::{ConnArgs, Output};
use crate::spec;
use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;
use suanli_client::{ClientError, Connection, JobFilter, code_name, new_request_id, pb};
use tonic::Code;

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
    /// Move a running job, checkpoint first: its tasks are asked to checkpoint and stop (as
    /// for a preemption), and the next attempt is placed in --to-pool or on --to-node, else on
    /// any other node the job allows. It resumes from its latest checkpoint.
    Migrate {
        /// Job id.
        id: u64,
        /// Only this pool.
        #[arg(long, conflicts_with = "to_node")]
        to_pool: Option<String>,
        /// Only this node.
        #[arg(long)]
        to_node: Option<String>,
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

impl JobArgs {
    /// The commands that need no server.
    pub(super) fn offline(&self) -> Option<anyhow::Result<()>> {
        match &self.cmd {
            JobCmd::Validate { file } => Some(spec::load_job(file).and_then(|s| print_json(&s))),
            _ => None,
        }
    }

    pub(super) async fn run(self) -> anyhow::Result<()> {
        let conn = self.conn.connect()?;
        let out = self.conn.output;
        match self.cmd {
            JobCmd::Validate { file } => print_json(&spec::load_job(&file)?),
            JobCmd::Submit { files, request_id } => submit(&conn, out, &files, request_id).await,
            JobCmd::Status { id, stale } => {
                let j = conn.get_job(id, stale).await?;
                match out {
                    Output::Json => print_json(&j),
                    Output::Table => {
                        print_job(&j);
                        Ok(())
                    }
                }
            }
            JobCmd::List { queue, states, limit, stale } => {
                let filter = JobFilter { queue: queue.unwrap_or_default(), states, stale };
                let jobs = conn.list_jobs(&filter, limit).await?;
                match out {
                    Output::Json => print_json(&jobs),
                    Output::Table => {
                        println!("{}", table(&JOB_HEADERS, &jobs.iter().map(job_row).collect::<Vec<_>>()));
                        Ok(())
                    }
                }
            }
            JobCmd::Cancel { id, reason } => {
                conn.cancel_job(id, &reason).await?;
                match out {
                    Output::Json => print_json(&json!({"job_id": id, "cancelled": true})),
                    Output::Table => {
                        println!("job {id} cancelled");
                        Ok(())
                    }
                }
            }
            JobCmd::Migrate { id, to_pool, to_node } => {
                let (pool, node) = (to_pool.unwrap_or_default(), to_node.unwrap_or_default());
                let revision = conn.migrate_job(id, &pool, &node).await?;
                match out {
                    Output::Json => print_json(&json!({
                        "job_id": id, "to_pool": pool, "to_node": node, "revision": revision,
                    })),
                    Output::Table => {
                        let to = match (pool.as_str(), node.as_str()) {
                            ("", "") => "another node".to_owned(),
                            (p, "") => format!("pool {p}"),
                            (_, n) => format!("node {n}"),
                        };
                        println!(
                            "job {id} is moving to {to}: its tasks checkpoint and stop, then it resumes there (revision {revision})"
                        );
                        Ok(())
                    }
                }
            }
            JobCmd::Logs { id, task, alloc, stderr, tail, follow } => {
                let j = conn.get_job(id, false).await?;
                let (alloc_id, node_id) = pick_alloc(&j, task.as_deref(), alloc)?;
                let n = conn.get_node(&node_id, false).await?;
                let req = pb::LogsRequest {
                    alloc_id,
                    stream: if stderr { "stderr" } else { "stdout" }.into(),
                    offset: tail.map_or(0, |t| -i64::try_from(t).unwrap_or(i64::MAX)),
                    follow,
                };
                let mut stream = conn
                    .agent_logs(&n.agent_addr, req)
                    .await
                    .with_context(|| format!("node {}: the task log at its agent {:?}", n.id, n.agent_addr))?;
                let ctrl_c = tokio::signal::ctrl_c();
                tokio::pin!(ctrl_c);
                let mut stdout = std::io::stdout();
                loop {
                    tokio::select! {
                        _ = &mut ctrl_c => return Ok(()),
                        m = stream.message() => match m.map_err(ClientError::from)? {
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
                let mut stream = conn.streaming().watch_jobs(id.unwrap_or(0), from_revision).await?;
                let ctrl_c = tokio::signal::ctrl_c();
                tokio::pin!(ctrl_c);
                loop {
                    tokio::select! {
                        _ = &mut ctrl_c => return Ok(()),
                        m = stream.message() => match m.map_err(ClientError::from)? {
                            None => return Ok(()),
                            Some(ev) => print_event(&ev, out == Output::Json)?,
                        },
                    }
                }
            }
        }
    }
}

/// Prints a retried submission on stderr.
fn warn_retry(what: &str) -> impl FnMut(&ClientError, Duration) + '_ {
    move |e, wait| eprintln!("warning: {e}; retrying in {wait:?} with the same {what}")
}

/// `job submit`: every file is loaded and validated before anything is sent (a bad file names
/// itself and nothing is submitted). One file goes in `Submit`, several in `SubmitMany` calls
/// (the k-th file's request id is `ID-k`). Fails (after printing every result) when any job
/// was refused.
async fn submit(conn: &Connection, out: Output, files: &[PathBuf], request_id: Option<String>) -> anyhow::Result<()> {
    let base = request_id.unwrap_or_else(|| new_request_id("cli"));
    if let [file] = files {
        let spec = spec::load_job(file)?;
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: base.clone(),
            spec_json: serde_json::to_string(&spec)?,
            retry: None,
        };
        let what = format!("request id {base}");
        let resp = conn.submit_job(req, warn_retry(&what)).await?;
        return match out {
            Output::Json => print_json(&json!({
                "job_id": resp.job_id, "created": resp.created, "revision": resp.revision,
                "client_request_id": base,
            })),
            Output::Table => {
                if resp.created {
                    println!("job {} submitted (request id {base})", resp.job_id);
                } else {
                    println!("job {} already submitted with request id {base} (not created again)", resp.job_id);
                }
                Ok(())
            }
        };
    }
    let mut reqs = Vec::with_capacity(files.len());
    for (k, f) in files.iter().enumerate() {
        let spec = spec::load_job(f)?;
        reqs.push(pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: format!("{base}-{}", k + 1),
            spec_json: serde_json::to_string(&spec)?,
            retry: None,
        });
    }
    let what = format!("request ids {base}-k");
    let results = conn.submit_jobs(&reqs, warn_retry(&what)).await?;
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
            print_json(&rows)?;
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
