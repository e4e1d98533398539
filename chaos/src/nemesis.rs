//! The nemesis: a fault schedule derived from the seed alone, and its execution.
//!
//! The schedule (which fault, when, for how long, against which role) is a pure function of
//! the scenario and the seed ([`schedule`]), so the same seed injects the same faults. Roles
//! ("the leader", "a follower") are resolved against the live cluster when a step runs; the
//! choice among candidates is drawn from the same seeded stream.
//!
//! Steps run one after another: inject, hold, heal. Every injection and heal is recorded in
//! the history.

use crate::cluster::{ClockFault, Cluster, From};
use crate::history::{History, now_ms};
use crate::proxy::Fault;
use serde::Serialize;
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;
use suanli_scheduler::DetRng;

/// Which server a step targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Role {
    /// The current leader.
    Leader,
    /// A running follower.
    Follower,
}

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Kind {
    /// SIGKILL a server, restart it after the hold.
    KillServer(Role),
    /// SIGSTOP a server, SIGCONT after the hold.
    PauseServer(Role),
    /// Cut the leader from every other server; half the clients still reach only it, the
    /// other half only the rest.
    IsolateLeader,
    /// Cut a random minority of servers from the majority.
    PartitionMinority,
    /// Cut the leader and one follower (a minority of 5) from the other three.
    LeaderMinority,
    /// Five servers: two sides that cannot talk, joined by one server that reaches both.
    Bridge,
    /// Cut every link of an agent to the servers (longer than the heartbeat TTL: the node is
    /// declared down, its tasks fenced).
    PartitionAgent,
    /// SIGKILL an agent, restart it after the hold.
    KillAgent,
    /// SIGSTOP an agent (and its plugin hosts), SIGCONT after the hold.
    PauseAgent,
    /// Drain an agent's node now (grace 0: its work is asked to checkpoint and stop, then
    /// moves); schedulable again after the hold.
    DrainNode,
    /// The fake plugin segfaults once on its next stats call (the supervisor restarts it).
    PluginCrash,
    /// One device of an agent reports unhealthy for the hold.
    DeviceUnhealthy,
    /// Remove a follower from the membership, wipe its data, and add it back (it catches up
    /// from a snapshot).
    Membership,
    /// Every fsync of a server takes 150 ms longer.
    SlowDisk(Role),
    /// A server's next fsync fails: raft stops and the server exits; it is restarted after
    /// the hold with the fault gone.
    DiskError(Role),
    /// Every server-to-server link: 25 ms added per chunk and 0.5 % of chunks reset.
    FlakyNet,
    /// Every server SIGKILLed at the same instant, all restarted after the hold.
    PowerLoss,
    /// A rolling restart with SIGTERM: each server in turn (followers first, the leader last)
    /// gets SIGTERM (SIGKILL after 15 s, as systemd does), is started again and caught up
    /// before the next; the hold is the pause between two servers.
    RollingRestart,
    /// A server's wall clock stepped an hour ahead or behind (seeded), stepped back after the
    /// hold (libfaketime; the scenario runs its servers under it).
    ClockSkew(Role),
    /// A server's clocks (wall, monotonic, sleeps) run twice as fast; after the hold it is
    /// restarted on the real clock (stepping a monotonic clock back is no fault a real
    /// machine has).
    ClockRate(Role),
    /// The leader's clocks run twice as fast while an agent is SIGSTOPped for the hold (past
    /// the heartbeat TTL in the leader's clock, not in real time): the node must not be
    /// declared down before the agent's own fence fired (no double run). The agent is
    /// continued and the server restarted on the real clock after the hold.
    FastLeaderPausedAgent,
}

/// How long a SIGTERMed server may take before the rolling restart SIGKILLs it (systemd's
/// `TimeoutStopSec` default is 90 s; 15 s is what the operator used).
const TERM_TIMEOUT: Duration = Duration::from_secs(15);

/// One step of the schedule.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    /// Offset from the start of the fault phase (ms).
    pub at_ms: u64,
    /// The fault.
    pub kind: Kind,
    /// How long it is held before it heals (ms).
    pub hold_ms: u64,
}

/// The fault schedule of a scenario: steps drawn from `kinds` until `duration_ms`.
pub fn schedule(kinds: &[Kind], duration_ms: u64, hold_ms: (u64, u64), seed: u64) -> Vec<Step> {
    let mut rng = DetRng::new(seed);
    let mut out = Vec::new();
    let mut t = 1_000;
    while t < duration_ms && !kinds.is_empty() {
        let kind = kinds[rng.below(kinds.len() as u64) as usize];
        let hold = hold_ms.0 + rng.below(hold_ms.1.saturating_sub(hold_ms.0).max(1));
        out.push(Step { at_ms: t, kind, hold_ms: hold });
        t += hold + 500 + rng.below(1_500);
    }
    out
}

/// A window during which a server was cut off from every other server.
#[derive(Debug, Clone, Copy)]
pub struct Isolation {
    /// The server (index).
    pub server: usize,
    /// From (ms).
    pub from_ms: u64,
    /// Until (ms).
    pub until_ms: u64,
}

/// Runs the steps; returns the isolation windows it created and the steps it could run.
pub async fn run(
    cluster: &mut Cluster,
    steps: &[Step],
    clients: usize,
    seed: u64,
    history: &History,
) -> anyhow::Result<(Vec<Isolation>, usize)> {
    let mut rng = DetRng::new(seed ^ 0xC4A0_5EED);
    let start = Instant::now();
    let mut isolations = Vec::new();
    let mut done = 0;
    for s in steps {
        let at = start + Duration::from_millis(s.at_ms);
        tokio::time::sleep_until(at.into()).await;
        let hold = Duration::from_millis(s.hold_ms);
        if let Some(iso) = inject(cluster, s.kind, hold, clients, &mut rng, history).await? {
            isolations.push(iso);
        }
        done += 1;
    }
    Ok((isolations, done))
}

async fn role(cluster: &mut Cluster, r: Role, rng: &mut DetRng) -> Option<usize> {
    let leader = match cluster.wait_leader(Duration::from_secs(10)).await {
        Ok(l) => l,
        Err(_) => return None,
    };
    match r {
        Role::Leader => Some(leader),
        Role::Follower => {
            let f: Vec<usize> = cluster.up_servers().into_iter().filter(|i| *i != leader).collect();
            (!f.is_empty()).then(|| f[rng.below(f.len() as u64) as usize])
        }
    }
}

fn name(cluster: &Cluster, i: usize) -> String {
    format!("server {}", cluster.servers[i].id)
}

/// Blocks (or unblocks) every link between the two sides, both directions.
fn cut(cluster: &Cluster, a: &[usize], b: &[usize], blocked: bool) {
    for x in a {
        for y in b {
            cluster.cut_servers(*x, *y, blocked);
        }
    }
}

async fn inject(
    cluster: &mut Cluster,
    kind: Kind,
    hold: Duration,
    clients: usize,
    rng: &mut DetRng,
    h: &History,
) -> anyhow::Result<Option<Isolation>> {
    let n = cluster.servers.len();
    let block = Fault { blocked: true, ..Fault::default() };
    match kind {
        Kind::KillServer(r) => {
            let Some(i) = role(cluster, r, rng).await else { return Ok(None) };
            h.fault(format!("kill -9 {} ({r:?})", name(cluster, i)));
            cluster.kill_server(i);
            tokio::time::sleep(hold).await;
            cluster.start_server(i)?;
            h.fault(format!("restart {}", name(cluster, i)));
        }
        Kind::PauseServer(r) => {
            let Some(i) = role(cluster, r, rng).await else { return Ok(None) };
            h.fault(format!("SIGSTOP {} ({r:?})", name(cluster, i)));
            cluster.pause_server(i, true);
            tokio::time::sleep(hold).await;
            cluster.pause_server(i, false);
            h.fault(format!("SIGCONT {}", name(cluster, i)));
        }
        Kind::IsolateLeader => {
            let Some(l) = role(cluster, Role::Leader, rng).await else { return Ok(None) };
            let others: Vec<usize> = (0..n).filter(|i| *i != l).collect();
            let from_ms = now_ms();
            cut(cluster, &[l], &others, true);
            for c in 0..clients {
                if c % 2 == 0 {
                    for o in &others {
                        cluster.set_link(From::Client(c), *o, block);
                    }
                } else {
                    cluster.set_link(From::Client(c), l, block);
                }
            }
            h.fault(format!("isolate leader {} from the other servers; even clients reach only it", name(cluster, l)));
            tokio::time::sleep(hold).await;
            let until_ms = now_ms();
            cluster.heal_links();
            h.fault(format!("heal: {} reconnected", name(cluster, l)));
            return Ok(Some(Isolation { server: l, from_ms, until_ms }));
        }
        Kind::PartitionMinority => {
            let mut ids: Vec<usize> = (0..n).collect();
            rng.shuffle(&mut ids);
            let (minority, majority) = ids.split_at((n - 1) / 2);
            cut(cluster, minority, majority, true);
            h.fault(format!("partition {minority:?} | {majority:?} (indices)"));
            tokio::time::sleep(hold).await;
            cluster.heal_links();
            h.fault("heal partition".into());
        }
        Kind::LeaderMinority => {
            let Some(l) = role(cluster, Role::Leader, rng).await else { return Ok(None) };
            let mut rest: Vec<usize> = (0..n).filter(|i| *i != l).collect();
            rng.shuffle(&mut rest);
            let k = (n - 1) / 2;
            let mut minority = vec![l];
            minority.extend(rest.drain(..k.saturating_sub(1)));
            cut(cluster, &minority, &rest, true);
            h.fault(format!("partition leader's minority {minority:?} | {rest:?} (indices)"));
            tokio::time::sleep(hold).await;
            cluster.heal_links();
            h.fault("heal partition".into());
        }
        Kind::Bridge => {
            let mut ids: Vec<usize> = (0..n).collect();
            rng.shuffle(&mut ids);
            let half = n / 2;
            let (a, rest) = ids.split_at(half);
            let (bridge, b) = rest.split_at(1);
            cut(cluster, a, b, true);
            h.fault(format!("bridge: {a:?} | {b:?}, joined only through {bridge:?} (indices)"));
            tokio::time::sleep(hold).await;
            cluster.heal_links();
            h.fault("heal bridge".into());
        }
        Kind::PartitionAgent => {
            let a = rng.below(cluster.agents.len() as u64) as usize;
            for j in 0..n {
                cluster.set_link(From::Agent(a), j, block);
            }
            h.fault(format!("cut agent {} from every server", cluster.agents[a].node));
            tokio::time::sleep(hold).await;
            for j in 0..n {
                cluster.set_link(From::Agent(a), j, Fault::default());
            }
            h.fault(format!("heal agent {}", cluster.agents[a].node));
        }
        Kind::KillAgent => {
            let a = rng.below(cluster.agents.len() as u64) as usize;
            h.fault(format!("kill -9 agent {}", cluster.agents[a].node));
            cluster.kill_agent(a);
            tokio::time::sleep(hold).await;
            cluster.start_agent(a)?;
            h.fault(format!("restart agent {}", cluster.agents[a].node));
        }
        Kind::PauseAgent => {
            let a = rng.below(cluster.agents.len() as u64) as usize;
            h.fault(format!("SIGSTOP agent {}", cluster.agents[a].node));
            cluster.pause_agent(a, true);
            tokio::time::sleep(hold).await;
            cluster.pause_agent(a, false);
            h.fault(format!("SIGCONT agent {}", cluster.agents[a].node));
        }
        Kind::DrainNode => {
            let a = rng.below(cluster.agents.len() as u64) as usize;
            let node = cluster.agents[a].node.clone();
            match cluster.set_node_mode(&node, pb::NodeMode::Draining).await {
                Ok(()) => h.fault(format!("drain node {node}")),
                Err(e) => {
                    h.fault(format!("drain node {node} refused: {e}"));
                    return Ok(None);
                }
            }
            tokio::time::sleep(hold).await;
            // Undone for sure: the heal checks every node is schedulable again.
            match cluster.set_node_mode(&node, pb::NodeMode::Schedulable).await {
                Ok(()) => h.fault(format!("node {node} schedulable again")),
                Err(e) => h.fault(format!("uncordon node {node} failed (the heal retries): {e}")),
            }
        }
        Kind::PluginCrash => {
            let a = rng.below(cluster.agents.len() as u64) as usize;
            cluster.set_plugin_faults(a, "crash = \"segfault\"\ncrash_on = \"stats\"\ncrash_once = true\n")?;
            h.fault(format!("fake plugin of agent {} segfaults on its next stats call", cluster.agents[a].node));
            tokio::time::sleep(hold).await;
            cluster.set_plugin_faults(a, "")?;
            h.fault(format!("clear plugin faults of agent {}", cluster.agents[a].node));
        }
        Kind::DeviceUnhealthy => {
            let a = rng.below(cluster.agents.len() as u64) as usize;
            let gpus = cluster_gpus(cluster);
            let d = rng.below(u64::from(gpus.max(1)));
            cluster.set_plugin_faults(a, &format!("unhealthy = [\"gpu{d}\"]\n"))?;
            h.fault(format!("gpu{d} of agent {} unhealthy", cluster.agents[a].node));
            tokio::time::sleep(hold).await;
            cluster.set_plugin_faults(a, "")?;
            h.fault(format!("gpu{d} of agent {} healthy again", cluster.agents[a].node));
        }
        Kind::Membership => {
            let Some(f) = role(cluster, Role::Follower, rng).await else { return Ok(None) };
            let Some(l) = cluster.leader().await else { return Ok(None) };
            if let Err(e) = cluster.remove_member(f).await {
                h.fault(format!("remove {} refused: {e}", name(cluster, f)));
                return Ok(None);
            }
            h.fault(format!("remove {} from the membership; wipe its data", name(cluster, f)));
            cluster.wipe_server(f)?;
            tokio::time::sleep(hold).await;
            cluster.write_server_config(f, l)?;
            cluster.start_server(f)?;
            h.fault(format!("{} joins again through {} with empty storage", name(cluster, f), name(cluster, l)));
            let id = cluster.servers[f].id;
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if cluster.members().await.is_ok_and(|m| m.contains(&(id, true))) {
                    h.fault(format!("{} is a voter again", name(cluster, f)));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Kind::SlowDisk(r) => {
            let Some(i) = role(cluster, r, rng).await else { return Ok(None) };
            std::fs::write(cluster.failpoints_path(i), "raft::fsync=sleep(150)\n")?;
            h.fault(format!("slow fsync (+150 ms) on {} ({r:?})", name(cluster, i)));
            tokio::time::sleep(hold).await;
            std::fs::write(cluster.failpoints_path(i), "")?;
            h.fault(format!("disk of {} healthy again", name(cluster, i)));
        }
        Kind::DiskError(r) => {
            let Some(i) = role(cluster, r, rng).await else { return Ok(None) };
            std::fs::write(cluster.failpoints_path(i), "raft::fsync=return(injected EIO)\n")?;
            h.fault(format!("fsync fails on {} ({r:?})", name(cluster, i)));
            tokio::time::sleep(hold).await;
            std::fs::write(cluster.failpoints_path(i), "")?;
            let exited = !cluster.server_alive(i);
            // A server that is still up (it wrote nothing during the hold) is restarted too,
            // so the fault never lingers in a process.
            cluster.kill_server(i);
            cluster.start_server(i)?;
            h.fault(format!(
                "restart {} with a healthy disk ({})",
                name(cluster, i),
                if exited { "it had exited on the error" } else { "it had not written" }
            ));
        }
        Kind::FlakyNet => {
            let f = Fault { blocked: false, delay_ms: 25, reset_per_mille: 5 };
            for i in 0..n {
                for j in (0..n).filter(|j| *j != i) {
                    cluster.set_link(From::Server(i), j, f);
                }
            }
            h.fault("every server link: +25 ms per chunk, 0.5 % resets".into());
            tokio::time::sleep(hold).await;
            cluster.heal_links();
            h.fault("network healthy again".into());
        }
        Kind::ClockSkew(r) => {
            let Some(i) = role(cluster, r, rng).await else { return Ok(None) };
            let s: i64 = if rng.below(2) == 0 { 3_600 } else { -3_600 };
            cluster.set_clock(i, ClockFault::Skew(s)).await?;
            h.fault(format!("clock of {} ({r:?}) stepped {s:+} s", name(cluster, i)));
            tokio::time::sleep(hold).await;
            cluster.set_clock(i, ClockFault::None).await?;
            h.fault(format!("clock of {} back to real time", name(cluster, i)));
        }
        Kind::ClockRate(r) => {
            let Some(i) = role(cluster, r, rng).await else { return Ok(None) };
            cluster.set_clock(i, ClockFault::Rate(2)).await?;
            h.fault(format!("clocks of {} ({r:?}) run 2x", name(cluster, i)));
            tokio::time::sleep(hold).await;
            cluster.kill_server(i);
            cluster.start_server(i)?;
            h.fault(format!("restart {} on the real clock", name(cluster, i)));
        }
        Kind::FastLeaderPausedAgent => {
            let Some(i) = role(cluster, Role::Leader, rng).await else { return Ok(None) };
            let a = rng.below(cluster.agents.len() as u64) as usize;
            cluster.set_clock(i, ClockFault::Rate(2)).await?;
            cluster.pause_agent(a, true);
            h.fault(format!("clocks of leader {} run 2x; SIGSTOP agent {}", name(cluster, i), cluster.agents[a].node));
            tokio::time::sleep(hold).await;
            cluster.pause_agent(a, false);
            cluster.kill_server(i);
            cluster.start_server(i)?;
            h.fault(format!(
                "SIGCONT agent {}; restart {} on the real clock",
                cluster.agents[a].node,
                name(cluster, i)
            ));
        }
        Kind::PowerLoss => {
            h.fault("power loss: every server SIGKILLed at once".into());
            for i in 0..n {
                cluster.kill_server(i);
            }
            tokio::time::sleep(hold).await;
            for i in 0..n {
                cluster.start_server(i)?;
            }
            h.fault("power back: every server restarted".into());
        }
        Kind::RollingRestart => {
            let Some(l) = cluster.leader().await else { return Ok(None) };
            let order: Vec<usize> = (0..n).filter(|i| *i != l).chain([l]).collect();
            for i in order {
                if !cluster.server_alive(i) {
                    continue;
                }
                h.fault(format!("rolling restart: SIGTERM {}", name(cluster, i)));
                let (graceful, took) = cluster.terminate_server(i, TERM_TIMEOUT);
                h.fault(format!(
                    "{} {} after {} ms",
                    name(cluster, i),
                    if graceful { "exited" } else { "did not exit: SIGKILLed" },
                    took.as_millis()
                ));
                cluster.start_server(i)?;
                let _ = cluster.wait_leader(Duration::from_secs(10)).await;
                tokio::time::sleep(hold).await;
            }
            h.fault("rolling restart done".into());
        }
    }
    Ok(None)
}

fn cluster_gpus(c: &Cluster) -> u32 {
    c.gpus_per_agent()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let kinds = [Kind::KillServer(Role::Leader), Kind::PartitionMinority, Kind::PauseAgent];
        let a = schedule(&kinds, 30_000, (1_000, 3_000), 42);
        let b = schedule(&kinds, 30_000, (1_000, 3_000), 42);
        let c = schedule(&kinds, 30_000, (1_000, 3_000), 43);
        let show = |s: &[Step]| format!("{s:?}");
        assert_eq!(show(&a), show(&b));
        assert_ne!(show(&a), show(&c));
        assert!(a.len() > 3);
        assert!(a.windows(2).all(|w| w[1].at_ms >= w[0].at_ms + w[0].hold_ms), "steps overlap: {a:?}");
    }
}
