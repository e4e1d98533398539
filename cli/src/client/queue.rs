//! `suanli queue ...` and `suanli pool ...`.

use super::render::{dash, fields, print_json, res, table, usage_cols};
use super::{ConnArgs, Output};
use crate::spec;
use clap::{Args, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use suanli_client::pb;

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

impl QueueArgs {
    /// The commands that need no server.
    pub(super) fn offline(&self) -> Option<anyhow::Result<()>> {
        match &self.cmd {
            QueueCmd::Validate { file } => Some(spec::load_queue(file).and_then(|q| print_json(&q))),
            _ => None,
        }
    }

    pub(super) async fn run(self) -> anyhow::Result<()> {
        let conn = self.conn.connect()?;
        let out = self.conn.output;
        match self.cmd {
            QueueCmd::Validate { file } => print_json(&spec::load_queue(&file)?),
            QueueCmd::Apply { file } => {
                let q = spec::load_queue(&file)?;
                conn.upsert_queue(&serde_json::to_string(&q)?).await?;
                match out {
                    Output::Json => print_json(&json!({"queue": q.id.as_str(), "applied": true})),
                    Output::Table => {
                        println!("queue {} applied", q.id);
                        Ok(())
                    }
                }
            }
            QueueCmd::List { stale } => {
                let queues = conn.list_queues(stale).await?;
                match out {
                    Output::Json => print_json(&queues),
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
                            "ID", "TEAM", "PARENT", "COHORT", "WEIGHT", "NOMINAL", "USED", "BORROWED", "PENDING",
                            "RUNNING",
                        ];
                        println!("{}", table(&h, &rows));
                        Ok(())
                    }
                }
            }
            QueueCmd::Get { id, stale } => {
                let q = conn.get_queue(&id, stale).await?;
                match out {
                    Output::Json => print_json(&q),
                    Output::Table => {
                        let unlimited =
                            |r: Option<&pb::Resources>| if r.is_none() { "unlimited".into() } else { res(r) };
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
                conn.delete_queue(&id).await?;
                match out {
                    Output::Json => print_json(&json!({"queue": id, "deleted": true})),
                    Output::Table => {
                        println!("queue {id} deleted");
                        Ok(())
                    }
                }
            }
        }
    }
}

impl PoolArgs {
    pub(super) async fn run(self) -> anyhow::Result<()> {
        let conn = self.conn.connect()?;
        match self.cmd {
            PoolCmd::List { stale } => {
                let pools = conn.list_pools(stale).await?;
                match self.conn.output {
                    Output::Json => print_json(&pools),
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
}
