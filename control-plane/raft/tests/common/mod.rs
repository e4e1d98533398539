//! Helpers for tests that run real raft nodes (RocksDB in temp dirs, gRPC on loopback).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;
use suanli_model::{Device, DeviceKind, JobSpec, Node, Queue, ResVec};
use suanli_raft::ServerNode;
use suanli_raft::{RaftService, RaftSettings, StateHandle, SuanliRaft};
use suanli_state::{Command, RegisterNode, SubmitJob, UpsertQueue};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// Timings fast enough for tests, still far above loopback latency.
pub fn settings() -> RaftSettings {
    RaftSettings {
        heartbeat_interval_ms: 50,
        election_timeout_min_ms: 200,
        election_timeout_max_ms: 400,
        ..RaftSettings::default()
    }
}

pub const WAIT: Option<Duration> = Some(Duration::from_secs(20));

/// One raft node with its gRPC server.
pub struct TestNode {
    pub id: u64,
    pub addr: String,
    pub raft: SuanliRaft,
    pub state: StateHandle,
    pub dir: TempDir,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl TestNode {
    pub async fn start(id: u64, settings: &RaftSettings) -> anyhow::Result<TestNode> {
        let dir = tempfile::tempdir()?;
        Self::start_in(id, dir, settings).await
    }

    pub async fn start_in(id: u64, dir: TempDir, settings: &RaftSettings) -> anyhow::Result<TestNode> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let (raft, state, _) = suanli_raft::open(dir.path(), id, settings, None).await?;
        let svc = RaftService::new(raft.clone(), settings).into_server(settings);
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            let r = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = r {
                eprintln!("raft server {id} stopped: {e}");
            }
        });
        Ok(TestNode { id, addr, raft, state, dir, stop: Some(stop), server: Some(server) })
    }

    pub fn node(&self) -> ServerNode {
        ServerNode::new(self.addr.clone(), "")
    }

    /// Stops raft and the server; keeps the data dir.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        self.raft.shutdown().await.map_err(|e| anyhow::anyhow!("shutdown: {e}"))?;
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.server.take() {
            h.await?;
        }
        Ok(())
    }
}

pub fn members(nodes: &[&TestNode]) -> BTreeMap<u64, ServerNode> {
    nodes.iter().map(|n| (n.id, n.node())).collect()
}

pub fn queue_cmd() -> Command {
    Command::UpsertQueue(UpsertQueue { queue: Queue::new("q", ResVec::MAX) })
}

pub fn node_cmd() -> Command {
    let node = Node {
        id: "n0".into(),
        pool: "p".into(),
        datacenter: String::new(),
        region: String::new(),
        labels: Default::default(),
        cpu_milli: 64_000,
        memory_mib: 1 << 18,
        devices: vec![Device::simple("gpu0", DeviceKind::Gpu, "A100")],
        schedulable: true,
        agent_addr: String::new(),
    };
    Command::RegisterNode(Box::new(RegisterNode { node, now: 1, fence: None }))
}

pub fn submit_cmd(i: usize) -> Command {
    let spec: JobSpec = serde_json::from_value(serde_json::json!({
        "name": format!("job-{i}"),
        "queue": "q",
        "groups": [{"name": "w", "replicas": 1, "resources": {"cpu_milli": 1000, "memory_mib": 512}}]
    }))
    .expect("a valid spec");
    Command::SubmitJob(Box::new(SubmitJob {
        client_request_id: format!("req-{i}"),
        spec,
        retry: None,
        now: 10 + i as u64,
        trace: None,
    }))
}
