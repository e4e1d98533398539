//! `suanli cluster ...`: membership, leader, snapshots, version, skip-entry, the digest check,
//! and backups. `cluster restore` is offline server wiring: it writes a new server data dir
//! through `suanli-server`'s backup module (the backup file format lives there).

use super::render::{dash, print_json, table};
use super::{ConnArgs, Output};
use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use suanli_client::{Connection, ConnectionConfig, pb};

/// `suanli cluster ...`.
#[derive(Args, Debug)]
pub struct ClusterArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: ClusterCmd,
}

/// Cluster membership commands.
/// A new member of a raft group (`cluster add-server`, `federation add-server`).
#[derive(clap::Args, Debug)]
pub struct AddServerArgs {
    /// Its raft node id.
    #[arg(long)]
    pub id: u64,
    /// Its client address, host:port.
    #[arg(long)]
    pub addr: String,
    /// Its peer address, host:port (default: --addr's port + 1).
    #[arg(long, default_value = "")]
    pub peer_addr: String,
    /// Keep it a non-voting learner.
    #[arg(long)]
    pub learner_only: bool,
}

impl AddServerArgs {
    /// The request.
    pub fn request(&self) -> pb::AddServerRequest {
        pb::AddServerRequest {
            id: self.id,
            addr: self.addr.clone(),
            learner_only: self.learner_only,
            peer_addr: self.peer_addr.clone(),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// List the servers, their roles and replication progress.
    Members,
    /// Show the current leader.
    Leader,
    /// Add a server: it catches up as a learner, then becomes a voter unless --learner-only.
    AddServer(AddServerArgs),
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
    /// The replicated configuration (limits, retry defaults, checkpoint store, ...).
    #[command(subcommand)]
    Config(ConfigCmd),
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

/// `suanli cluster config ...`.
#[derive(Subcommand, Debug)]
pub enum ConfigCmd {
    /// Show the replicated configuration, one `FIELD = VALUE` line per field.
    Get {
        /// Answer from the contacted server's local state (possibly stale).
        #[arg(long)]
        stale: bool,
    },
    /// Change fields: `FIELD=VALUE ...`, FIELD as `get` names it (`checkpoint_store`,
    /// `default_retry.max_attempts`), VALUE as JSON (`300`, `true`, `"text"`), else taken as a
    /// string (`checkpoint_store=file:///shared/ckpt`). All change at once, or none.
    Set {
        /// FIELD=VALUE pairs.
        #[arg(required = true, num_args = 1.., value_parser = parse_setting)]
        settings: Vec<(String, String)>,
    },
}

/// `FIELD=VALUE` as (field, value as JSON): VALUE if it is JSON, else VALUE as a JSON string.
fn parse_setting(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("{s:?} is not FIELD=VALUE"))?;
    let k = k.trim();
    if k.is_empty() {
        return Err(format!("{s:?} names no field before '='"));
    }
    let json = match serde_json::from_str::<serde_json::Value>(v) {
        Ok(_) => v.to_owned(),
        Err(_) => serde_json::Value::String(v.to_owned()).to_string(),
    };
    Ok((k.to_owned(), json))
}

/// A JSON object's leaves as `path = value` lines, in key order (nested objects dotted).
fn config_lines(v: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                for k in keys {
                    let p = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&m[k], &p, out);
                }
            }
            leaf => out.push(format!("{prefix} = {leaf}")),
        }
    }
    let mut out = Vec::new();
    walk(v, "", &mut out);
    out
}

/// Prints a configuration a server answered (`config_json`) at `revision`.
fn print_config(out: Output, config_json: &str, revision: u64) -> anyhow::Result<()> {
    let config: serde_json::Value = serde_json::from_str(config_json).context("the server's config_json")?;
    match out {
        Output::Json => print_json(&json!({"revision": revision, "config": config})),
        Output::Table => {
            for l in config_lines(&config) {
                println!("{}", super::render::printable(&l));
            }
            Ok(())
        }
    }
}

/// Most bytes `cluster backup` accepts from a server.
const MAX_BACKUP_BYTES: u64 = 64 << 30;
/// Longest wait for the next chunk of a backup.
const BACKUP_STALL: Duration = Duration::from_secs(60);

impl ClusterArgs {
    pub(super) async fn run(self) -> anyhow::Result<()> {
        let out = self.conn.output;
        match self.cmd {
            ClusterCmd::Restore {
                file,
                from_data_dir,
                data_dir,
                id,
                listen,
                advertise,
                peer_listen,
                peer_advertise,
            } => {
                let target = RestoreTarget { data_dir, id, listen, advertise, peer_listen, peer_advertise };
                restore(out, file, from_data_dir, target).await
            }
            cmd => online(&self.conn.connect()?, out, cmd).await,
        }
    }
}

/// The commands that talk to the cluster.
async fn online(conn: &Connection, out: Output, cmd: ClusterCmd) -> anyhow::Result<()> {
    match cmd {
        ClusterCmd::Restore { .. } => anyhow::bail!("cluster restore is offline: it talks to no server"),
        ClusterCmd::Backup { file } => backup(conn, out, &file).await,
        ClusterCmd::Members => {
            let r = conn.members().await?;
            match out {
                Output::Json => print_json(&r),
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
            let r = conn.leader().await?;
            match out {
                Output::Json => print_json(&r),
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
        ClusterCmd::AddServer(a) => {
            conn.add_server(a.request()).await?;
            let AddServerArgs { id, addr, learner_only, .. } = a;
            match out {
                Output::Json => {
                    print_json(&json!({"id": id, "addr": addr, "learner_only": learner_only, "added": true}))
                }
                Output::Table => {
                    let role = if learner_only { "learner" } else { "voter" };
                    println!("server {id} at {addr} added as a {role}");
                    Ok(())
                }
            }
        }
        ClusterCmd::RemoveServer { id } => {
            conn.remove_server(id).await?;
            match out {
                Output::Json => print_json(&json!({"id": id, "removed": true})),
                Output::Table => {
                    println!("server {id} removed");
                    Ok(())
                }
            }
        }
        ClusterCmd::Check { index, wait_ms } => check(conn, out, index, wait_ms).await,
        ClusterCmd::Snapshot => {
            let r = conn.snapshot().await?;
            match out {
                Output::Json => print_json(&r),
                Output::Table => {
                    println!("snapshot built up to log index {}", r.last_log_index);
                    Ok(())
                }
            }
        }
        ClusterCmd::Version => {
            let r = conn.version().await?;
            match out {
                Output::Json => print_json(&r),
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
        ClusterCmd::Config(ConfigCmd::Get { stale }) => {
            let r = conn.get_config(stale).await?;
            print_config(out, &r.config_json, r.revision)
        }
        ClusterCmd::Config(ConfigCmd::Set { settings }) => {
            let fields: Vec<String> = settings.iter().map(|(k, _)| k.clone()).collect();
            let r = conn.set_config(settings).await?;
            if out == Output::Table {
                println!("configuration changed at revision {} ({}):", r.revision, fields.join(", "));
            }
            print_config(out, &r.config_json, r.revision)
        }
        ClusterCmd::SkipEntry { index, kind } => {
            let r = conn.skip_entry(index, &kind).await?;
            match out {
                Output::Json => print_json(&json!({"skipped": index, "at": r.index})),
                Output::Table => {
                    println!("entry {index} skipped by the order committed at {}; the group applies again", r.index);
                    Ok(())
                }
            }
        }
    }
}

/// `cluster check`: asks each member (at its client address) for its log digest at one
/// index and compares them with the leader's (or, with no leader answering, the most common).
async fn check(conn: &Connection, out: Output, index: Option<u64>, wait_ms: u64) -> anyhow::Result<()> {
    let m = conn.members().await?;
    let index = index.unwrap_or(m.commit_index);
    let base = conn.config().request_timeout.unwrap_or(Duration::from_secs(10));
    let direct = conn.with_config(ConnectionConfig {
        request_timeout: Some(Duration::from_millis(wait_ms).max(base) + Duration::from_secs(1)),
        ..conn.config().clone()
    });
    let mut answers: Vec<(&pb::Member, Result<pb::DigestResponse, String>)> = Vec::new();
    for member in &m.members {
        let r = direct.digest_at(&member.addr, index, wait_ms).await.map_err(|e| e.to_string());
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
        Output::Json => print_json(&json!({
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

/// `cluster backup`: the bytes through the client library, checked, written to a `.partial`
/// file, synced, then renamed into place.
async fn backup(conn: &Connection, out: Output, file: &std::path::Path) -> anyhow::Result<()> {
    let bytes = conn.streaming().backup(MAX_BACKUP_BYTES, BACKUP_STALL).await?;
    let (h, _) = suanli_server::backup::decode(&bytes).context("checking the backup received")?;
    let tmp = file.with_extension("partial");
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(&bytes).with_context(|| format!("writing {}", tmp.display()))?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, file).with_context(|| format!("renaming into {}", file.display()))?;
    let index = h.last_applied.map_or(0, |l| l.index);
    match out {
        Output::Json => print_json(&json!({
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

/// Where `cluster restore` writes the new cluster's only server.
struct RestoreTarget {
    data_dir: PathBuf,
    id: u64,
    listen: String,
    advertise: Option<String>,
    peer_listen: Option<String>,
    peer_advertise: Option<String>,
}

/// `cluster restore` (offline): a new data dir from a backup file or a stopped server's dir.
async fn restore(
    out: Output,
    file: Option<PathBuf>,
    from_data_dir: Option<PathBuf>,
    t: RestoreTarget,
) -> anyhow::Result<()> {
    let RestoreTarget { data_dir, id, listen, advertise, peer_listen, peer_advertise } = t;
    let cfg = suanli_server::ServerConfig {
        id,
        listen,
        advertise,
        peer_listen,
        peer_advertise,
        data_dir: data_dir.clone(),
        ..suanli_server::ServerConfig::default()
    };
    cfg.validate_settings()?; // writes a data directory: serves nothing, so no transport to choose
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
        Output::Json => print_json(&json!({
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_json_or_else_strings() {
        assert_eq!(parse_setting("avoid_failed_node_s=60"), Ok(("avoid_failed_node_s".into(), "60".into())));
        assert_eq!(
            parse_setting("checkpoint_store=file:///shared/ckpt"),
            Ok(("checkpoint_store".into(), r#""file:///shared/ckpt""#.into()))
        );
        assert_eq!(
            parse_setting(r#"checkpoint_store="s3://b/p""#),
            Ok(("checkpoint_store".into(), r#""s3://b/p""#.into()))
        );
        assert_eq!(parse_setting("checkpoint_store="), Ok(("checkpoint_store".into(), r#""""#.into())));
        assert!(parse_setting("no-equals").is_err());
        assert!(parse_setting("=5").is_err());
    }

    #[test]
    fn config_prints_one_dotted_line_per_field() {
        let v = json!({"b": 1, "a": {"y": "s", "x": true}});
        assert_eq!(config_lines(&v), vec!["a.x = true", "a.y = \"s\"", "b = 1"]);
    }
}
