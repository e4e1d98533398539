//! `suanli node ...`: validate, list, get, cordon, drain (and wait), uncordon, clear-quarantine,
//! register.

use super::render::{age, dash, fields, mib, milli, now_s, print_indented_table, print_json, res, table, usage_cols};
use super::{ConnArgs, Output, parse_duration_s};
use crate::spec;
use anyhow::bail;
use clap::{Args, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;
use suanli_client::{Connection, pb};
use suanli_proto::json::node_mode_name;

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
    /// End an agent's quarantine of a device (after a fatal error or failed resets; see
    /// docs/agent.md, "Device errors"). The agent resets and health-checks the device before
    /// it returns to service; a device that fails the check is quarantined again.
    ClearQuarantine {
        /// Node id.
        id: String,
        /// Device id (as `suanli node get` lists it).
        device: String,
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

impl NodeArgs {
    /// The commands that need no server.
    pub(super) fn offline(&self) -> Option<anyhow::Result<()>> {
        match &self.cmd {
            NodeCmd::Validate { file } => Some(spec::load_node(file).and_then(|n| print_json(&n))),
            _ => None,
        }
    }

    pub(super) async fn run(self) -> anyhow::Result<()> {
        let conn = self.conn.connect()?;
        let out = self.conn.output;
        match self.cmd {
            NodeCmd::Validate { file } => print_json(&spec::load_node(&file)?),
            NodeCmd::List { pool, stale } => {
                let nodes = conn.list_nodes(pool.as_deref().unwrap_or_default(), stale).await?;
                match out {
                    Output::Json => print_json(&nodes),
                    Output::Table => {
                        let rows: Vec<Vec<String>> = nodes.iter().map(node_row).collect();
                        let h = ["NODE", "POOL", "STATUS", "MODE", "CPU", "MEM", "GPU", "NPU", "ALLOCS", "REASON"];
                        println!("{}", table(&h, &rows));
                        Ok(())
                    }
                }
            }
            NodeCmd::Get { id, stale } => {
                let n = conn.get_node(&id, stale).await?;
                match out {
                    Output::Json => print_json(&n),
                    Output::Table => {
                        print_node(&n);
                        Ok(())
                    }
                }
            }
            NodeCmd::Cordon { id } => set_mode(&conn, out, id, pb::NodeMode::Cordoned, 0, 0).await,
            NodeCmd::Drain { id, grace, max_unavailable, wait, timeout } => {
                set_mode(&conn, out, id.clone(), pb::NodeMode::Draining, grace, max_unavailable).await?;
                if wait { wait_drained(&conn, &id, timeout).await } else { Ok(()) }
            }
            NodeCmd::Uncordon { id } => set_mode(&conn, out, id, pb::NodeMode::Schedulable, 0, 0).await,
            NodeCmd::ClearQuarantine { id, device } => {
                let clears = conn.clear_quarantine(&id, &device).await?;
                match out {
                    Output::Json => print_json(&json!({"node": id, "device": device, "clears": clears})),
                    Output::Table => {
                        println!(
                            "node {id} device {device}: quarantine cleared (the agent resets and checks it at its next heartbeat)"
                        );
                        Ok(())
                    }
                }
            }
            NodeCmd::Register { file, keep_alive } => register(&conn, out, &file, keep_alive).await,
        }
    }
}

/// One row of `node list`.
fn node_row(n: &pb::NodeInfo) -> Vec<String> {
    let mut row = vec![n.id.clone(), n.pool.clone(), dash(&n.status), node_mode_name(n.mode).to_owned()];
    row.extend(usage_cols(n.used.as_ref(), n.capacity.as_ref()));
    row.push(n.allocations.to_string());
    // Why it takes no work: down, a drain in progress, or a condition its agent reported.
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
}

/// `node get`: the node, then its devices with their latest statistics.
fn print_node(n: &pb::NodeInfo) {
    let labels = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
    let drain = if n.mode == pb::NodeMode::Draining as i32 { drain_progress(n) } else { "-".into() };
    println!(
        "{}",
        fields(&[
            ("id", n.id.clone()),
            ("pool", n.pool.clone()),
            ("region", dash(&n.region)),
            ("datacenter", dash(&n.datacenter)),
            ("status", dash(&n.status)),
            ("mode", node_mode_name(n.mode).to_owned()),
            ("reason", dash(&n.reason)),
            ("pressure", dash(&n.pressure)),
            ("capacity", res(n.capacity.as_ref())),
            ("used", res(n.used.as_ref())),
            ("allocations", n.allocations.to_string()),
            ("drain", drain),
            ("labels", dash(&labels)),
            ("updated", format!("{} ago", age(n.updated_at))),
        ])
    );
    if n.devices.is_empty() {
        return;
    }
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
                dash(&d.share_isolation),
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
        "SHARES",
        "USED",
        "UTIL",
        "MEM_USED",
        "TEMP",
    ];
    print_indented_table(&h, &rows);
    let reasons: Vec<&pb::DeviceInfo> = n.devices.iter().filter(|d| !d.health_reason.is_empty()).collect();
    if !reasons.is_empty() {
        println!("unhealthy devices:");
        for d in reasons {
            println!("  {}: {}", d.id, d.health_reason);
        }
    }
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

/// How often `node drain --wait` looks at the node.
const DRAIN_POLL: Duration = Duration::from_millis(500);

/// `node drain --wait`: polls the node until no allocation is left on it.
async fn wait_drained(conn: &Connection, id: &str, timeout_s: u64) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
    let mut last = String::new();
    loop {
        let n = conn.get_node(id, false).await?;
        if n.mode != pb::NodeMode::Draining as i32 {
            bail!("node {id} is no longer draining (mode {})", node_mode_name(n.mode));
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
        tokio::time::sleep(DRAIN_POLL).await;
    }
}

async fn set_mode(
    conn: &Connection,
    out: Output,
    id: String,
    mode: pb::NodeMode,
    grace_s: u64,
    max_unavailable: u32,
) -> anyhow::Result<()> {
    conn.set_node_mode(pb::SetNodeModeRequest { id: id.clone(), mode: mode as i32, grace_s, max_unavailable }).await?;
    let m = node_mode_name(mode as i32);
    match out {
        Output::Json => print_json(&json!({"node": id, "mode": m})),
        Output::Table => {
            println!("node {id} {m}");
            Ok(())
        }
    }
}

/// `node register`: registers a node from a file, and with `--keep-alive` heartbeats for it
/// until Ctrl-C (registering again when the servers forgot it).
async fn register(conn: &Connection, out: Output, file: &std::path::Path, keep_alive: bool) -> anyhow::Result<()> {
    let node = spec::load_node(file)?;
    let req = pb::RegisterNodeRequest {
        node_json: serde_json::to_string(&node)?,
        agent_version: format!("suanli-cli/{}", env!("CARGO_PKG_VERSION")),
        ..Default::default()
    };
    let r = conn.register_node(&req).await?;
    match out {
        Output::Json => print_json(&json!({
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
        let hb = pb::HeartbeatRequest { node_id: node.id.to_string(), seq, ..Default::default() };
        match conn.heartbeat(&hb).await {
            Ok(h) if !h.known => {
                eprintln!("warning: the server does not know node {}; registering again", node.id);
                conn.register_node(&req).await?;
            }
            Ok(_) => {}
            Err(e) => eprintln!("warning: heartbeat failed: {e}"),
        }
    }
}
