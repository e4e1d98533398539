//! The node agent API. Heartbeats stay in the leader's memory (a follower passes them on to
//! the leader); only registrations, device health changes and allocation reports go through
//! raft.

use crate::convert;
use crate::core::Core;
use crate::status::{decode_json, invalid, invalid_model};
use std::sync::Arc;
use std::time::Duration;
use suanli_model::error::quote;
use suanli_model::{AllocId, CheckpointHardware, DeviceKind, Health, Node, NodeId};
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_client::AgentClient;
use suanli_proto::v1::agent_server::Agent;
use suanli_state::{
    AgentFence, AllocReady, AllocStatus, Command, DeviceHealth, EndClass, NodeCondition, NodeStatus, RegisterNode,
    ReportCheckpoint, ReportedStatus,
};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status};

/// Longest node condition or device health reason recorded (characters).
const MAX_PRESSURE_CHARS: usize = 200;

type Resp<T> = Result<tonic::Response<T>, Status>;

fn ok<T>(v: T) -> Resp<T> {
    Ok(tonic::Response::new(v))
}

/// The agent-facing service.
#[derive(Clone)]
pub struct AgentApi(pub Arc<Core>);

impl AgentApi {
    fn intervals(&self) -> pb::RegisterNodeResponse {
        pb::RegisterNodeResponse {
            heartbeat_interval_ms: self.0.cfg.heartbeat_interval_ms,
            heartbeat_ttl_ms: self.0.cfg.heartbeat_ttl_ms,
            members: self.0.member_addrs(),
            cluster_id: self.cluster_id(),
        }
    }

    fn cluster_id(&self) -> String {
        self.0.state.read(|s| s.cluster_id().to_owned())
    }

    fn seen(&self, node: &NodeId) {
        let mut hb = self.0.heartbeats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        hb.insert(node.clone(), Instant::now());
    }
}

#[tonic::async_trait]
impl Agent for AgentApi {
    async fn register(&self, req: Request<pb::RegisterNodeRequest>) -> Resp<pb::RegisterNodeResponse> {
        let r = req.into_inner();
        let node: Node = decode_json("node_json", &r.node_json, self.0.cfg.max_request_bytes)?;
        let id = node.id.clone();
        let fence =
            r.fence_reported.then_some(AgentFence { after_ms: r.fence_after_ms, kill_grace_ms: r.fence_kill_grace_ms });
        let ttl = self.0.cfg.heartbeat_ttl_ms;
        let need = crate::clock::ttl_for_fence(fence, ttl, self.0.cfg.max_clock_drift_permille);
        if need > ttl {
            let total = fence.map_or(0, |f| f.total_ms(ttl));
            tracing::warn!(
                node = %id,
                fence_ms = total,
                heartbeat_ttl_ms = ttl,
                needed_ms = need,
                "the agent's fence_after_ms + fence_kill_grace_ms does not fit the heartbeat TTL under the clock drift bound: the node is declared down only after {need} ms without a heartbeat (docs/control-plane.md, \"Clocks\")"
            );
        }
        let cmd = RegisterNode { node, now: self.0.now_s(), fence };
        self.0.propose(Command::RegisterNode(Box::new(cmd))).await?;
        if self.0.is_leader() {
            self.seen(&id);
        }
        self.0.kick.notify_one();
        ok(self.intervals())
    }

    async fn heartbeat(&self, req: Request<pb::HeartbeatRequest>) -> Resp<pb::HeartbeatResponse> {
        if !self.0.is_leader() {
            let (ch, _) = self.0.leader_channel()?;
            return AgentClient::new(ch).heartbeat(req.into_inner()).await;
        }
        let r = req.into_inner();
        let id = NodeId(r.node_id.clone());
        let known = self.0.state.read(|s| {
            s.nodes().get(&id).map(|n| {
                (n.status == NodeStatus::Ready).then(|| {
                    // Bounded by the node's devices (the state machine keeps no entry for
                    // a device the node does not have).
                    (n.pressure.clone(), n.quarantine_clears.clone())
                })
            })
        });
        let Some(Some((pressure, quarantine_clears))) = known else {
            // Unknown, or declared down: the agent registers again with its inventory.
            return ok(pb::HeartbeatResponse {
                heartbeat_ttl_ms: self.0.cfg.heartbeat_ttl_ms,
                known: false,
                leases: Vec::new(),
                members: self.0.member_addrs(),
                cluster_id: self.cluster_id(),
                quarantine_clears: Default::default(),
            });
        };
        // Only a leader a quorum still follows may renew the agent's lease.
        self.0.confirm_leader(Duration::from_millis(self.0.cfg.raft.heartbeat_interval_ms.max(50) * 2)).await?;
        self.seen(&id);
        if !r.stats.is_empty() {
            // Bounded like a node's device list; only the latest report is kept.
            let max = suanli_model::Limits::default().max_devices_per_node;
            let stats: Vec<_> = r.stats.into_iter().take(max).collect();
            let mut m = self.0.device_stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            m.insert(id.clone(), stats);
        }
        // The agent keeps one message per episode, so this is a command per change, not per
        // heartbeat; the message is bounded so that a long one does not differ every time.
        let reported: String = r.disk_pressure.chars().take(MAX_PRESSURE_CHARS).collect();
        if reported != pressure {
            let cmd =
                Command::NodeCondition(NodeCondition { node: id.clone(), pressure: reported, now: self.0.now_s() });
            self.0.propose(cmd).await?;
            self.0.kick.notify_one();
        }
        for d in r.devices {
            let health = if d.healthy { Health::Healthy } else { Health::Unhealthy };
            // Bounded like the pressure message; the state machine cuts it again.
            let reason: String =
                if d.healthy { String::new() } else { d.reason.chars().take(MAX_PRESSURE_CHARS).collect() };
            let cmd = Command::DeviceHealth(DeviceHealth {
                node: id.clone(),
                device: d.device,
                health,
                reason,
                now: self.0.now_s(),
            });
            self.0.propose(cmd).await?;
            self.0.kick.notify_one();
        }
        ok(pb::HeartbeatResponse {
            heartbeat_ttl_ms: self.0.cfg.heartbeat_ttl_ms,
            known: true,
            quarantine_clears,
            members: self.0.member_addrs(),
            cluster_id: self.cluster_id(),
            // The federation leases of this node's federated allocations: a renewal reaches
            // the agent here even when its allocation watch is slow.
            leases: self.0.state.read(|s| {
                s.allocs_on(&id)
                    .filter(|a| a.is_live())
                    .filter_map(|a| {
                        let b = s.job(a.alloc.job)?.federation.as_ref()?;
                        Some(pb::AllocLease { alloc_id: a.alloc.id.0, until_ms: b.lease_until_ms })
                    })
                    .collect()
            }),
        })
    }

    type WatchAllocationsStream = ReceiverStream<Result<pb::AllocationsUpdate, Status>>;

    async fn watch_allocations(&self, req: Request<pb::WatchAllocationsRequest>) -> Resp<Self::WatchAllocationsStream> {
        let r = req.into_inner();
        let id = NodeId(r.node_id.clone());
        if self.0.state.read(|s| !s.nodes().contains_key(&id)) {
            return Err(Status::not_found(format!(
                "node_id: unknown node {}; register first",
                suanli_model::error::quote(&r.node_id)
            )));
        }
        // One slot per node: a re-connecting agent takes over its old stream's slot (that
        // stream ends with ABORTED), so agents never need more slots than there are nodes.
        let mut slot = self.0.watchers.agent(&id)?;
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let core = self.0.clone();
        tokio::spawn(async move {
            let node = id.0.clone();
            tokio::select! {
                () = watch_allocations(core, id, tx.clone()) => {}
                () = slot.replaced() => {
                    let msg = format!("a newer allocation watch of node {node:?} replaced this one");
                    let _ = tx.try_send(Err(Status::aborted(msg)));
                }
            }
            drop(slot);
        });
        ok(ReceiverStream::new(rx))
    }

    async fn report_status(&self, req: Request<pb::ReportStatusRequest>) -> Resp<pb::ReportStatusResponse> {
        let r = req.into_inner();
        let status = match pb::AllocReport::try_from(r.status) {
            Ok(pb::AllocReport::Running) => ReportedStatus::Running,
            Ok(pb::AllocReport::Succeeded) => ReportedStatus::Succeeded,
            Ok(pb::AllocReport::Failed) => ReportedStatus::Failed,
            Ok(pb::AllocReport::Stopped) => ReportedStatus::Stopped,
            _ => {
                return Err(invalid(
                    "status",
                    format!("{} is not one of running, succeeded, failed, stopped", r.status),
                ));
            }
        };
        if r.readiness_report {
            if status != ReportedStatus::Running {
                return Err(invalid("status", "a readiness report (readiness_report) must say RUNNING"));
            }
            let cmd = Command::AllocReady(AllocReady {
                alloc: AllocId(r.alloc_id),
                epoch: r.epoch,
                ready: r.ready,
                endpoint: r.endpoint,
                load_milli: r.load_milli,
                latency_us: r.latency_us,
                success_ppm: r.success_ppm,
                now: self.0.now_s(),
            });
            self.0.propose(cmd).await?;
            return ok(pb::ReportStatusResponse {});
        }
        let end = reported_end(status, &r.end)?;
        let traced = if status == ReportedStatus::Running {
            None
        } else {
            self.0.state.read(|s| crate::telemetry::before_report(s, AllocId(r.alloc_id)))
        };
        let cmd = Command::AllocStatus(AllocStatus {
            alloc: AllocId(r.alloc_id),
            epoch: r.epoch,
            status,
            message: r.message,
            end,
            exit_code: r.exit_code_set.then_some(r.exit_code),
            now: self.0.now_s(),
        });
        let (_, index) = self.0.propose(cmd).await?;
        if status != ReportedStatus::Running {
            self.0.kick.notify_one();
        }
        if let Some(before) = traced {
            trace_report(&self.0, &before, index).await;
        }
        ok(pb::ReportStatusResponse {})
    }

    async fn report_checkpoint(&self, req: Request<pb::ReportCheckpointRequest>) -> Resp<pb::ReportCheckpointResponse> {
        let r = req.into_inner();
        let limits = self.0.state.read(|s| s.config().limits.clone());
        let hardware = checkpoint_hardware(&r, &limits)?;
        let cmd = Command::ReportCheckpoint(ReportCheckpoint {
            alloc: AllocId(r.alloc_id),
            epoch: r.epoch,
            uri: r.uri,
            step: r.step,
            size_bytes: r.size_bytes,
            wall_time: r.wall_time,
            hardware,
            now: self.0.now_s(),
        });
        self.0.propose(cmd).await?;
        ok(pb::ReportCheckpointResponse {})
    }
}

/// Emits the spans of an applied end report once this server has applied it (a follower
/// forwarded it to the leader; bounded wait).
async fn trace_report(core: &Core, before: &crate::telemetry::BeforeReport, index: u64) {
    let mut applied = core.state.subscribe();
    let _ = tokio::time::timeout(Duration::from_secs(1), applied.wait_for(|i| *i >= index)).await;
    let now = core.now_s();
    core.state.read(|s| crate::telemetry::after_report(s, before, now));
}

/// The ends an agent reports: what it saw happen to the task. The others (preempted, drained,
/// migrated, cancelled) are the state machine's to decide, from why it stopped the task.
const AGENT_ENDS: [EndClass; 7] = [
    EndClass::Succeeded,
    EndClass::Exit,
    EndClass::Oom,
    EndClass::StartFailed,
    EndClass::DeviceError,
    EndClass::NodeLost,
    EndClass::Stopped,
];

/// A report's `end`: none when empty (an older agent, or a running task); refused when it is
/// not an end an agent reports, or comes with a running report.
fn reported_end(status: ReportedStatus, end: &str) -> Result<Option<EndClass>, Status> {
    if end.is_empty() {
        return Ok(None);
    }
    let names = || AGENT_ENDS.iter().map(|e| e.as_str()).collect::<Vec<_>>().join(", ");
    let Some(class) = EndClass::parse(end).filter(|c| AGENT_ENDS.contains(c)) else {
        return Err(invalid("end", format!("{} is not one of {} (or empty)", quote(end), names())));
    };
    if status == ReportedStatus::Running {
        return Err(invalid("end", format!("{} given for a running allocation; leave it empty", quote(end))));
    }
    Ok(Some(class))
}

/// The hardware a checkpoint report binds its checkpoint to: none unless `hardware_bound`;
/// then the device kind (`gpu` or `npu`), model (a name within the limits) and count (1 up to
/// the devices a node may have) must all be given.
fn checkpoint_hardware(
    r: &pb::ReportCheckpointRequest,
    limits: &suanli_model::Limits,
) -> Result<Option<CheckpointHardware>, Status> {
    if !r.hardware_bound {
        return Ok(None);
    }
    let kind = match r.device_kind.as_str() {
        "gpu" => DeviceKind::Gpu,
        "npu" => DeviceKind::Npu,
        other => {
            return Err(invalid(
                "device_kind",
                format!("{} is not gpu or npu (a hardware-bound checkpoint names its devices' kind)", quote(other)),
            ));
        }
    };
    if r.device_model.is_empty() {
        return Err(invalid("device_model", "is empty; a hardware-bound checkpoint names its devices' model"));
    }
    suanli_model::error::check_value(|| "device_model".into(), &r.device_model, limits.max_name_len)
        .map_err(|e| invalid_model(&e))?;
    let max = limits.max_devices_per_node;
    if r.device_count == 0 || r.device_count as usize > max {
        return Err(invalid("device_count", format!("{} is not between 1 and {max}", r.device_count)));
    }
    Ok(Some(CheckpointHardware { kind, model: r.device_model.clone(), count: r.device_count }))
}

/// Sends `node`'s live allocations each time they change, until the receiver goes away or
/// the state stops.
async fn watch_allocations(
    core: Arc<Core>,
    id: NodeId,
    tx: tokio::sync::mpsc::Sender<Result<pb::AllocationsUpdate, Status>>,
) {
    let mut applied = core.state.subscribe();
    let mut last: Option<Vec<pb::AllocInfo>> = None;
    loop {
        let (rev, allocs, cluster_id) = core.state.read(|s| {
            let v: Vec<pb::AllocInfo> =
                s.allocs_on(&id).filter(|a| a.is_live()).map(|a| convert::alloc(s, a)).collect();
            (s.revision(), v, s.cluster_id().to_owned())
        });
        if last.as_ref() != Some(&allocs) {
            let update = pb::AllocationsUpdate { revision: rev, allocs: allocs.clone(), cluster_id };
            if tx.send(Ok(update)).await.is_err() {
                return;
            }
            last = Some(allocs);
        }
        tokio::select! {
            c = applied.changed() => if c.is_err() { return },
            () = tx.closed() => return,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_an_agent_reports_are_mapped_and_others_refused_naming_end() {
        assert_eq!(reported_end(ReportedStatus::Failed, "").ok(), Some(None));
        assert_eq!(reported_end(ReportedStatus::Failed, "oom").ok(), Some(Some(EndClass::Oom)));
        assert_eq!(reported_end(ReportedStatus::Succeeded, "succeeded").ok(), Some(Some(EndClass::Succeeded)));
        assert_eq!(reported_end(ReportedStatus::Stopped, "node_lost").ok(), Some(Some(EndClass::NodeLost)));
        for (status, bad) in [
            (ReportedStatus::Failed, "segfault"),
            (ReportedStatus::Stopped, "preempted"),
            (ReportedStatus::Running, "exit"),
        ] {
            let e = reported_end(status, bad).expect_err(bad);
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with("end: "), "{}", e.message());
        }
    }

    #[test]
    fn hardware_is_read_only_when_bound_and_checked_field_by_field() {
        let limits = suanli_model::Limits::default();
        let good = pb::ReportCheckpointRequest {
            hardware_bound: true,
            device_kind: "gpu".into(),
            device_model: "NVIDIA H200".into(),
            device_count: 8,
            ..Default::default()
        };
        assert_eq!(
            checkpoint_hardware(&good, &limits).ok(),
            Some(Some(CheckpointHardware { kind: DeviceKind::Gpu, model: "NVIDIA H200".into(), count: 8 }))
        );
        let portable = pb::ReportCheckpointRequest { hardware_bound: false, ..good.clone() };
        assert_eq!(checkpoint_hardware(&portable, &limits).ok(), Some(None));
        let cases = [
            ("device_kind", pb::ReportCheckpointRequest { device_kind: "cpu".into(), ..good.clone() }),
            ("device_model", pb::ReportCheckpointRequest { device_model: String::new(), ..good.clone() }),
            ("device_count", pb::ReportCheckpointRequest { device_count: 0, ..good.clone() }),
            ("device_count", pb::ReportCheckpointRequest { device_count: 100_000, ..good.clone() }),
        ];
        for (field, r) in cases {
            let e = checkpoint_hardware(&r, &limits).expect_err(field);
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(field), "{field}: {}", e.message());
        }
    }
}
