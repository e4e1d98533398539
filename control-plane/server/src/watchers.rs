//! Slots for long-lived watch streams, in two pools so that clients can never starve agents.
//!
//! ```text
//!  Jobs.Watch (clients) ──▶ per connection ≤ max_watchers_per_connection ─▶ pool max_client_watchers
//!  Agent.WatchAllocations ─▶ one slot per node (a re-connect takes over its node's slot,
//!                            ending the old stream) ──────────────────────▶ pool max_agent_watchers
//! ```
//!
//! A slot is held by the stream's task and given back when the task ends (the guard's drop).
//! Every map here is bounded by its pool: a connection's entry exists only while it holds a
//! slot, a node's entry only while its stream runs. No I/O, no clock.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use suanli_model::NodeId;
use tokio::sync::oneshot;
use tonic::Status;

/// The bounds (from [`crate::ServerConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchLimits {
    /// Most `Agent.WatchAllocations` streams (`max_agent_watchers`).
    pub agents: usize,
    /// Most client `Jobs.Watch` streams, all connections together (`max_client_watchers`).
    pub clients: usize,
    /// Most client streams on one connection (`max_watchers_per_connection`).
    pub per_connection: usize,
}

#[derive(Debug, Default)]
struct Inner {
    clients: usize,
    per_connection: HashMap<SocketAddr, usize>,
    agents: HashMap<NodeId, AgentEntry>,
    next_generation: u64,
}

#[derive(Debug)]
struct AgentEntry {
    generation: u64,
    /// Dropped when a newer stream of the same node takes the slot: the old stream ends.
    _replace: oneshot::Sender<()>,
}

/// The watch slots of one server.
#[derive(Debug)]
pub struct WatchSlots {
    limits: WatchLimits,
    inner: Arc<Mutex<Inner>>,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(PoisonError::into_inner)
}

impl WatchSlots {
    /// Empty pools with these bounds.
    pub fn new(limits: WatchLimits) -> Self {
        Self { limits, inner: Arc::default() }
    }

    /// A slot for one client watch from the connection `conn` (the peer's `ip:port`), or
    /// RESOURCE_EXHAUSTED naming the limit reached and its value. Without a peer address
    /// (a transport that does not report one) only the pool's bound applies.
    pub fn client(&self, conn: Option<SocketAddr>) -> Result<ClientSlot, Status> {
        let mut g = lock(&self.inner);
        if let Some(addr) = conn
            && g.per_connection.get(&addr).copied().unwrap_or(0) >= self.limits.per_connection
        {
            return Err(Status::resource_exhausted(format!(
                "too many watch streams on this connection ({addr}): the limit is {} (max_watchers_per_connection)",
                self.limits.per_connection
            )));
        }
        if g.clients >= self.limits.clients {
            return Err(Status::resource_exhausted(format!(
                "too many client watch streams on this server: the limit is {} (max_client_watchers)",
                self.limits.clients
            )));
        }
        g.clients += 1;
        if let Some(addr) = conn {
            *g.per_connection.entry(addr).or_insert(0) += 1;
        }
        Ok(ClientSlot { inner: self.inner.clone(), conn })
    }

    /// The slot of `node`'s allocation watch. A node has at most one: a new stream of a node
    /// that already has one takes its slot over, and the old stream's
    /// [`AgentSlot::replaced`] resolves. A node without a stream gets a new slot, or
    /// RESOURCE_EXHAUSTED naming `max_agent_watchers` when the pool is full.
    pub fn agent(&self, node: &NodeId) -> Result<AgentSlot, Status> {
        let mut g = lock(&self.inner);
        if !g.agents.contains_key(node) && g.agents.len() >= self.limits.agents {
            return Err(Status::resource_exhausted(format!(
                "too many agent watch streams on this server: the limit is {} (max_agent_watchers)",
                self.limits.agents
            )));
        }
        g.next_generation += 1;
        let generation = g.next_generation;
        let (tx, rx) = oneshot::channel();
        // Replacing the entry drops the old stream's sender: that stream ends.
        g.agents.insert(node.clone(), AgentEntry { generation, _replace: tx });
        Ok(AgentSlot { inner: self.inner.clone(), node: node.clone(), generation, replaced: Some(rx) })
    }

    /// Open streams: (clients, agents).
    #[cfg(test)]
    pub fn in_use(&self) -> (usize, usize) {
        let g = lock(&self.inner);
        (g.clients, g.agents.len())
    }
}

/// One client watch's slot; given back on drop.
#[derive(Debug)]
pub struct ClientSlot {
    inner: Arc<Mutex<Inner>>,
    conn: Option<SocketAddr>,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut g = lock(&self.inner);
        g.clients = g.clients.saturating_sub(1);
        if let Some(addr) = self.conn
            && let Some(n) = g.per_connection.get_mut(&addr)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                g.per_connection.remove(&addr);
            }
        }
    }
}

/// One node's allocation-watch slot; given back on drop unless a newer stream of the node
/// took it over.
#[derive(Debug)]
pub struct AgentSlot {
    inner: Arc<Mutex<Inner>>,
    node: NodeId,
    generation: u64,
    replaced: Option<oneshot::Receiver<()>>,
}

impl AgentSlot {
    /// Resolves when a newer stream of the same node took this slot over (at most once;
    /// pending forever after that).
    pub async fn replaced(&mut self) {
        match self.replaced.take() {
            Some(rx) => {
                let _ = rx.await;
            }
            None => std::future::pending().await,
        }
    }
}

impl Drop for AgentSlot {
    fn drop(&mut self) {
        let mut g = lock(&self.inner);
        if g.agents.get(&self.node).is_some_and(|e| e.generation == self.generation) {
            g.agents.remove(&self.node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn slots(agents: usize, clients: usize, per_connection: usize) -> WatchSlots {
        WatchSlots::new(WatchLimits { agents, clients, per_connection })
    }

    fn addr(port: u16) -> Option<SocketAddr> {
        Some(SocketAddr::from(([10, 0, 0, 1], port)))
    }

    #[test]
    fn a_connection_is_bounded_then_the_pool() {
        let s = slots(2, 3, 2);
        let a1 = s.client(addr(1)).expect("first");
        let _a2 = s.client(addr(1)).expect("second");
        let e = s.client(addr(1)).expect_err("third on one connection");
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("max_watchers_per_connection") && e.message().contains(" 2 "), "{e:?}");
        let _b1 = s.client(addr(2)).expect("another connection");
        let e = s.client(addr(3)).expect_err("pool full");
        assert!(e.message().contains("max_client_watchers") && e.message().contains(" 3 "), "{e:?}");
        drop(a1);
        assert_eq!(s.in_use(), (2, 0));
        let _c1 = s.client(addr(3)).expect("a freed slot is reusable");
        // Agents have their own pool.
        let _n = s.agent(&NodeId("n1".into())).expect("agents are not starved by clients");
    }

    #[test]
    fn dropped_slots_leave_no_entries() {
        let s = slots(2, 8, 8);
        let v: Vec<_> = (0..8).map(|p| s.client(addr(p)).expect("slot")).collect();
        drop(v);
        assert_eq!(s.in_use(), (0, 0));
        assert!(lock(&s.inner).per_connection.is_empty());
        let _ = s.client(None).expect("no peer address: the pool alone bounds it");
        assert!(lock(&s.inner).per_connection.is_empty());
    }

    #[tokio::test]
    async fn a_node_reconnecting_takes_over_its_slot() {
        let s = slots(1, 1, 1);
        let n1 = NodeId("n1".into());
        let mut old = s.agent(&n1).expect("first stream");
        let e = s.agent(&NodeId("n2".into())).expect_err("pool of one");
        assert!(e.message().contains("max_agent_watchers") && e.message().contains(" 1 "), "{e:?}");
        let new = s.agent(&n1).expect("a re-connect replaces");
        tokio::time::timeout(Duration::from_secs(5), old.replaced()).await.expect("the old stream is told");
        drop(old);
        assert_eq!(s.in_use(), (0, 1), "the old stream's end must not free the new one's slot");
        drop(new);
        assert_eq!(s.in_use(), (0, 0));
        let _n2 = s.agent(&NodeId("n2".into())).expect("freed");
    }
}
