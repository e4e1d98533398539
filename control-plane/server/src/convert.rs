//! Replicated records to their wire messages.

use std::collections::BTreeMap;
use suanli_model::{CheckpointHardware, Health, QueueId, ResVec};
use suanli_proto::v1 as pb;
use suanli_state::{
    Alloc, Desired, Job, JobState, MigrationTarget, NodeMode, NodeRecord, NodeStatus, State, StopReason,
};

/// A resource vector on the wire (`u64::MAX` stays "unlimited").
pub fn res(v: &ResVec) -> pb::Resources {
    pb::Resources { cpu_milli: v.cpu_milli, memory_mib: v.memory_mib, gpu_milli: v.gpu_milli, npu_milli: v.npu_milli }
}

fn stop_reason(r: &StopReason) -> &'static str {
    match r {
        StopReason::Preempted { .. } => "preempted",
        StopReason::Cancelled => "cancelled",
        StopReason::JobFailed => "job_failed",
        StopReason::Requeue => "requeue",
        StopReason::Drain => "drain",
        StopReason::DeviceUnhealthy => "device_unhealthy",
        StopReason::Migrate => "migrate",
        StopReason::Update => "update",
    }
}

/// An allocation on the wire, with its job's task (what to run), checkpoint policy, the
/// cluster's checkpoint store and the job's latest checkpoint (what the agent restores).
pub fn alloc(s: &State, a: &Alloc) -> pb::AllocInfo {
    alloc_view(s, a, s.job(a.alloc.job), JobView::Full)
}

/// An allocation on the wire; its job's task and the checkpoint store only in the
/// [`JobView::Full`] view.
fn alloc_view(s: &State, a: &Alloc, job: Option<&Job>, view: JobView) -> pb::AllocInfo {
    let x = &a.alloc;
    let latest = job.and_then(|j| j.latest_checkpoint.as_ref());
    // What this allocation runs: its own spec version's (a rolling update may be under way).
    let spec = job.map(|j| j.spec_for(a.version));
    let policy = spec.and_then(|sp| sp.checkpoint.as_ref());
    let group = spec.and_then(|sp| sp.groups.get(x.group as usize));
    let task = group.and_then(|g| g.task.as_ref()).filter(|_| view == JobView::Full);
    let (desired, stop, ckpt, grace) = match &a.desired {
        Desired::Run => ("run", "", false, 0),
        Desired::Stop { reason, checkpoint_first, grace_s, .. } => {
            ("stop", stop_reason(reason), *checkpoint_first, *grace_s)
        }
    };
    let fed = job.and_then(|j| j.federation.as_ref());
    pb::AllocInfo {
        id: x.id.0,
        job_id: x.job.0,
        group: x.group,
        replica: x.replica,
        epoch: x.epoch,
        node: x.node.0.clone(),
        state: serde_plain(&a.state),
        desired: desired.into(),
        stop_reason: stop.into(),
        checkpoint_first: ckpt,
        grace_s: grace,
        cpu_milli: x.cpu_milli,
        memory_mib: x.memory_mib,
        devices: x
            .devices
            .iter()
            .map(|d| pb::DeviceShare { device: d.device.clone(), milli: d.milli, memory_mib: d.memory_mib })
            .collect(),
        started_at: x.started_at,
        message: a.message.clone(),
        queue: x.queue.0.clone(),
        priority: x.priority,
        borrowed: x.borrowed,
        restore_from: latest.map(|c| c.uri.clone()).unwrap_or_default(),
        restore_step: latest.map_or(0, |c| c.step),
        checkpoint_signal: policy.map(|p| p.signal.as_str().to_owned()).unwrap_or_default(),
        checkpoint_interval_s: policy.map_or(0, |p| p.interval_s),
        checkpoint_store: if view == JobView::Full { s.config().checkpoint_store.clone() } else { String::new() },
        team: crate::access::queue_team(s, job.map_or(&x.queue, |j| &j.spec.queue)).unwrap_or_default(),
        job_name: job.map(|j| j.spec.name.clone()).unwrap_or_default(),
        group_name: group.map(|g| g.name.clone()).unwrap_or_default(),
        command: task.map(|t| t.command.clone()).unwrap_or_default(),
        args: task.map(|t| t.args.clone()).unwrap_or_default(),
        env: task.map(|t| t.env.clone().into_iter().collect()).unwrap_or_default(),
        workdir: task.and_then(|t| t.workdir.clone()).unwrap_or_default(),
        global_job_id: fed.map(|f| f.global_id.clone()).unwrap_or_default(),
        fed_epoch: fed.map_or(0, |f| f.epoch),
        lease_until_ms: fed.map_or(0, |f| f.lease_until_ms),
        fed_stop_before_ms: fed.map_or(0, |f| f.stop_before_ms),
        traceparent: job.and_then(crate::telemetry::job_traceparent).unwrap_or_default(),
        service_json: spec
            .and_then(|sp| sp.service())
            .filter(|_| view == JobView::Full)
            .and_then(|sv| serde_json::to_string(sv.as_ref()).ok())
            .unwrap_or_default(),
        ready: a.ready,
        endpoint: a.endpoint.clone(),
        version: a.version,
        world_size: job.map_or(0, |j| s.world_size(j)),
        world_gen: job.map_or(0, |j| j.world_gen),
        latency_us: a.latency_us.map(|(l, _)| l),
        success_ppm: a.success_ppm.map(|(p, _)| p),
        reported_at: a.latency_us.map_or(0, |(_, t)| t).max(a.success_ppm.map_or(0, |(_, t)| t)),
    }
}

/// The snake_case serde name of a unit enum value.
fn serde_plain<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

/// How much of a job goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobView {
    /// Everything: the spec as submitted, each allocation with its task (Get, Watch).
    Full,
    /// A summary (List): no spec, no task in the allocations; `summary` is set.
    Summary,
}

/// A job on the wire, with its allocations.
pub fn job(s: &State, j: &Job, queue_position: u64, view: JobView) -> pb::JobInfo {
    let summary = view == JobView::Summary;
    let latest = j.latest_checkpoint.as_ref();
    let allocs = j.allocs.iter().filter_map(|id| s.allocs().get(id));
    pb::JobInfo {
        id: j.id.0,
        name: j.spec.name.clone(),
        queue: j.spec.queue.0.clone(),
        state: j.state.as_str().into(),
        priority: j.spec.priority,
        submitted_at: j.submitted_at,
        updated_at: j.updated_at,
        attempt: j.attempt,
        failures: j.failures,
        requeues: j.requeues,
        not_before: j.not_before,
        reason: j.reason.clone(),
        allocs: allocs.map(|a| alloc_view(s, a, Some(j), view)).collect(),
        spec_json: if summary { String::new() } else { serde_json::to_string(&j.spec).unwrap_or_default() },
        revision: j.revision,
        client_request_id: j.client_request_id.clone(),
        queue_position,
        latest_checkpoint_uri: latest.map(|c| c.uri.clone()).unwrap_or_default(),
        summary,
        omitted_allocs: 0,
        attempts: if summary { Vec::new() } else { j.history.iter().map(attempt).collect() },
        latest_checkpoint_step: latest.map_or(0, |c| c.step),
        latest_checkpoint_at: latest.map_or(0, |c| if c.wall_time > 0 { c.wall_time } else { c.at }),
        latest_checkpoint_hardware: latest.and_then(|c| c.hardware.as_ref()).map(hardware).unwrap_or_default(),
        infra_requeues: j.infra_requeues,
        restarts: j.restarts,
        service: j.spec.is_service(),
        version: j.version,
        lost_device_s: j.lost_device_s,
        nominated_victims: j.nomination.as_ref().map(|n| n.victims.iter().map(|v| v.0).collect()).unwrap_or_default(),
        migrating_to: j.migration.as_ref().map(migrating_to).unwrap_or_default(),
        global_id: j.federation.as_ref().map(|f| f.global_id.clone()).unwrap_or_default(),
        fed_epoch: j.federation.as_ref().map_or(0, |f| f.epoch),
        lease_until_ms: j.federation.as_ref().map_or(0, |f| f.lease_until_ms),
        trace_id: crate::telemetry::trace_id_of(j).unwrap_or_default(),
    }
}

/// A hardware-bound checkpoint's hardware as people read it: `NVIDIA H200 x8`.
pub fn hardware(h: &CheckpointHardware) -> String {
    format!("{} x{}", h.model, h.count)
}

/// Where `job migrate` sends a job: `pool gpu-b`, `node n3`, both, or `another node`.
fn migrating_to(m: &MigrationTarget) -> String {
    match (&m.pool, &m.node) {
        (Some(p), Some(n)) => format!("pool {p}, node {n}"),
        (Some(p), None) => format!("pool {p}"),
        (None, Some(n)) => format!("node {n}"),
        (None, None) => "another node".into(),
    }
}

/// One ended allocation of a job's history on the wire.
fn attempt(h: &suanli_state::AttemptRecord) -> pb::AttemptInfo {
    pb::AttemptInfo {
        attempt: h.attempt,
        alloc_id: h.alloc.0,
        group: h.group,
        replica: h.replica,
        node: h.node.as_str().to_owned(),
        started_at: h.started_at,
        ended_at: h.ended_at,
        state: serde_plain(&h.state),
        message: h.message.clone(),
        end: h.end.map(|e| e.as_str().to_owned()).unwrap_or_default(),
        exit_code: h.exit_code.unwrap_or(0),
        exit_code_set: h.exit_code.is_some(),
        lost_device_s: h.lost_device_s,
        restored_step: h.restored_step.unwrap_or(0),
        restored_step_set: h.restored_step.is_some(),
    }
}

/// Cuts a job's allocations, keeping the first ones, until the job takes at most `max_bytes`
/// as one item of a reply ([`crate::page::item_bytes`]); `omitted_allocs` counts those left
/// out. Everything else stays: the rest of a summary is bounded by the job-spec limits (names,
/// ids), and a full job's spec by the request that submitted it.
pub fn fit_job(info: &mut pb::JobInfo, max_bytes: usize) {
    use prost::Message;
    if crate::page::item_bytes(info) <= max_bytes {
        return;
    }
    let allocs = std::mem::take(&mut info.allocs);
    let total = allocs.len() as u64;
    // The count of those left out is at most `total`, and its field at most this long.
    info.omitted_allocs = total;
    // One key byte and at most 5 length bytes around the body.
    let mut body = info.encoded_len();
    for a in allocs {
        let n = a.encoded_len();
        let add = 1 + prost::length_delimiter_len(n) + n;
        if 6 + body + add > max_bytes {
            break;
        }
        body += add;
        info.allocs.push(a);
    }
    info.omitted_allocs = total - info.allocs.len() as u64;
}

/// Position (1-based) of a pending job among its queue's pending jobs, in the order the
/// engine considers them within a queue (priority, then submission time, then id); 0 when the
/// job is not pending.
pub fn queue_position(s: &State, j: &Job) -> u64 {
    if j.state != JobState::Pending {
        return 0;
    }
    let key = |x: &Job| (std::cmp::Reverse(x.spec.priority), x.submitted_at, x.id);
    let mine = key(j);
    let ahead = s
        .jobs()
        .values()
        .filter(|x| x.state == JobState::Pending && x.spec.queue == j.spec.queue && key(x) < mine)
        .count();
    ahead as u64 + 1
}

fn mode(m: NodeMode) -> i32 {
    match m {
        NodeMode::Schedulable => pb::NodeMode::Schedulable as i32,
        NodeMode::Cordoned => pb::NodeMode::Cordoned as i32,
        NodeMode::Draining => pb::NodeMode::Draining as i32,
    }
}

/// A node on the wire, with live usage per device.
pub fn node(s: &State, r: &NodeRecord) -> pb::NodeInfo {
    let mut used = ResVec::ZERO;
    let mut per_device: BTreeMap<&str, u64> = BTreeMap::new();
    let mut count = 0u64;
    for a in s.allocs_on(&r.node.id).filter(|a| a.is_live()) {
        count += 1;
        used = used.saturating_add(&s.alloc_usage(a));
        for d in &a.alloc.devices {
            *per_device.entry(d.device.as_str()).or_default() += u64::from(d.milli);
        }
    }
    pb::NodeInfo {
        id: r.node.id.0.clone(),
        pool: r.node.pool.0.clone(),
        region: r.node.region.clone(),
        datacenter: r.node.datacenter.clone(),
        status: match r.status {
            NodeStatus::Ready => "ready".into(),
            NodeStatus::Down => "down".into(),
        },
        mode: mode(r.mode),
        capacity: Some(res(&r.node.capacity())),
        used: Some(res(&used)),
        devices: r
            .node
            .devices
            .iter()
            .map(|d| pb::DeviceInfo {
                id: d.id.clone(),
                kind: serde_plain(&d.kind),
                model: d.model.clone(),
                memory_mib: d.memory_mib,
                health: match d.health {
                    Health::Healthy => "healthy".into(),
                    Health::Unhealthy => "unhealthy".into(),
                },
                numa: d.numa,
                peer_group: d.peer_group,
                partition_of: d.partition_of.clone().unwrap_or_default(),
                used_milli: per_device.get(d.id.as_str()).copied().unwrap_or(0),
                share_isolation: d.share_isolation.as_str().into(),
                health_reason: r.device_reasons.get(&d.id).cloned().unwrap_or_default(),
            })
            .collect(),
        labels: r.node.labels.clone().into_iter().collect(),
        updated_at: r.updated_at,
        reason: r.reason.clone(),
        allocations: count,
        agent_addr: r.node.agent_addr.clone(),
        stats: Vec::new(),
        pressure: r.pressure.clone(),
        drain_deadline: r.drain.as_ref().map_or(0, |d| d.deadline),
        drain_max_unavailable: r.drain.as_ref().map_or(0, |d| d.max_unavailable),
        drain_moving: r.drain.as_ref().map_or(0, |d| u32::try_from(d.moving.len()).unwrap_or(u32::MAX)),
    }
}

/// A queue on the wire, with live usage (own quota and borrowed) and job counts.
pub fn queue(s: &State, id: &QueueId) -> Option<pb::QueueInfo> {
    let q = s.queues().get(id)?;
    let (mut used, mut borrowed) = (ResVec::ZERO, ResVec::ZERO);
    for a in s.allocs().values().filter(|a| a.is_live() && &a.alloc.queue == id) {
        if a.alloc.borrowed {
            borrowed = borrowed.saturating_add(&s.alloc_usage(a));
        } else {
            used = used.saturating_add(&s.alloc_usage(a));
        }
    }
    let (mut pending, mut running) = (0, 0);
    for j in s.jobs().values().filter(|j| &j.spec.queue == id) {
        match j.state {
            JobState::Pending | JobState::Requeuing | JobState::Preempted => pending += 1,
            JobState::Placed | JobState::Running => running += 1,
            _ => {}
        }
    }
    Some(pb::QueueInfo {
        id: q.id.0.clone(),
        team: q.team.clone(),
        parent: q.parent.as_ref().map(|p| p.0.clone()).unwrap_or_default(),
        cohort: q.cohort.clone().unwrap_or_default(),
        weight: q.weight,
        nominal: Some(res(&q.nominal)),
        borrowing_limit: q.borrowing_limit.as_ref().map(res),
        lending_limit: q.lending_limit.as_ref().map(res),
        used: Some(res(&used)),
        borrowed: Some(res(&borrowed)),
        pending_jobs: pending,
        running_jobs: running,
    })
}

/// Every pool with its node counts, capacity and live usage.
pub fn pools(s: &State) -> Vec<pb::PoolInfo> {
    let mut out: BTreeMap<String, pb::PoolInfo> = BTreeMap::new();
    for r in s.nodes().values() {
        let p = out.entry(r.node.pool.0.clone()).or_insert_with(|| pb::PoolInfo {
            name: r.node.pool.0.clone(),
            nodes: 0,
            ready_nodes: 0,
            capacity: Some(pb::Resources::default()),
            used: Some(pb::Resources::default()),
        });
        p.nodes += 1;
        if r.status == NodeStatus::Ready {
            p.ready_nodes += 1;
        }
        let cap = r.node.capacity();
        if let Some(c) = p.capacity.as_mut() {
            add(c, &cap);
        }
        for a in s.allocs_on(&r.node.id).filter(|a| a.is_live()) {
            if let Some(u) = p.used.as_mut() {
                add(u, &s.alloc_usage(a));
            }
        }
    }
    out.into_values().collect()
}

fn add(p: &mut pb::Resources, v: &ResVec) {
    p.cpu_milli = p.cpu_milli.saturating_add(v.cpu_milli);
    p.memory_mib = p.memory_mib.saturating_add(v.memory_mib);
    p.gpu_milli = p.gpu_milli.saturating_add(v.gpu_milli);
    p.npu_milli = p.npu_milli.saturating_add(v.npu_milli);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::item_bytes;

    fn job_with_allocs(n: u64) -> pb::JobInfo {
        let allocs = (0..n)
            .map(|i| pb::AllocInfo { id: i, node: format!("node-{i}"), state: "running".into(), ..Default::default() })
            .collect();
        pb::JobInfo { id: 7, name: "j".into(), summary: true, allocs, ..Default::default() }
    }

    #[test]
    fn fit_job_keeps_the_first_allocations_that_fit_and_counts_the_rest() {
        let small = job_with_allocs(3);
        let mut same = small.clone();
        fit_job(&mut same, item_bytes(&small));
        assert_eq!(same, small, "a job that fits is left alone");

        let big = job_with_allocs(10_000);
        for budget in [200, 4096, 100_000] {
            let mut j = big.clone();
            fit_job(&mut j, budget);
            assert!(item_bytes(&j) <= budget, "{} > {budget}", item_bytes(&j));
            assert_eq!(j.allocs.len() as u64 + j.omitted_allocs, 10_000);
            assert_eq!(
                j.allocs.iter().map(|a| a.id).collect::<Vec<_>>(),
                (0..j.allocs.len() as u64).collect::<Vec<_>>()
            );
            // Not much room is left unused: one more allocation would not have fitted.
            let mut one_more = j.clone();
            one_more.allocs.push(big.allocs[j.allocs.len()].clone());
            assert!(item_bytes(&one_more) > budget - 8, "budget {budget}: room for more was left");
        }
    }
}
