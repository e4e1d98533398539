//! Job specifications: what a team asks for.

use crate::error::{ValidationError, check_name, check_range, check_value};
use crate::{DeviceKind, Limits, NodeId, PoolId, QueueId, ResVec, ShareIsolation, WHOLE_DEVICE_MILLI};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What the job is, which sets defaults (inference services never finish on their own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// Model training: long, usually gang-scheduled, usually checkpointed.
    #[default]
    Training,
    /// Batch work: independent tasks.
    Batch,
    /// A long-running inference service.
    Inference,
}

/// Devices one task replica needs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceRequest {
    /// GPU or NPU.
    pub kind: DeviceKind,
    /// Number of devices. With `milli` below 1000 it must be 1 (a fractional device).
    pub count: u32,
    /// Share of each device in milli-units; 1000 (the default) is a whole device.
    #[serde(default = "whole")]
    pub milli: u32,
    /// Device memory slice per device in MiB; 0 means no slice is reserved (whole devices get
    /// all their memory).
    #[serde(default)]
    pub memory_mib: u64,
}

fn whole() -> u32 {
    WHOLE_DEVICE_MILLI
}

impl DeviceRequest {
    /// Total milli-devices this request takes.
    pub fn total_milli(&self) -> u64 {
        u64::from(self.count) * u64::from(self.milli)
    }
    /// True for a fractional (shared) device request.
    pub fn is_fractional(&self) -> bool {
        self.milli < WHOLE_DEVICE_MILLI
    }
}

/// Resources of one task replica.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct TaskResources {
    /// CPU in milli-cores.
    #[serde(default)]
    pub cpu_milli: u64,
    /// Memory in MiB.
    #[serde(default)]
    pub memory_mib: u64,
    /// Accelerators, if any.
    #[serde(default)]
    pub devices: Option<DeviceRequest>,
}

impl TaskResources {
    /// As a quota vector.
    pub fn as_resvec(&self) -> ResVec {
        let mut v = ResVec { cpu_milli: self.cpu_milli, memory_mib: self.memory_mib, ..ResVec::ZERO };
        if let Some(d) = &self.devices {
            match d.kind {
                DeviceKind::Gpu => v.gpu_milli = d.total_milli(),
                DeviceKind::Npu => v.npu_milli = d.total_milli(),
            }
        }
        v
    }
}

/// A set of identical task replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskGroup {
    /// Name, unique within the job (e.g. `worker`, `ps`).
    pub name: String,
    /// Number of replicas wanted.
    #[serde(default = "one")]
    pub replicas: u32,
    /// For elastic jobs: the fewest replicas worth starting. `None` means `replicas`.
    #[serde(default)]
    pub min_replicas: Option<u32>,
    /// Per-replica resources.
    pub resources: TaskResources,
    /// What each replica runs on its node. `None`: nothing to run (the agent reports the task
    /// failed with "no task"), as for jobs replayed from traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskSpec>,
}

/// The process a task runs: the agent starts `command` with `args`, the environment `env`
/// (plus what the device plugins inject and `SUANLI_JOB_ID`, `SUANLI_TASK`, `SUANLI_ATTEMPT`)
/// in `workdir`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct TaskSpec {
    /// The program: a path, or a name looked up in the agent's `PATH`.
    pub command: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (default: the allocation's own directory on the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
}

impl TaskSpec {
    /// Checks the task against `limits`; `at` is the field path of the task (`groups[0].task`).
    pub fn validate(&self, at: &str, limits: &Limits) -> Result<(), ValidationError> {
        let bad = |field: String, message: String| ValidationError::Invalid { field, message };
        if self.command.is_empty() {
            return Err(ValidationError::Empty { field: format!("{at}.command") });
        }
        check_range(|| format!("{at}.args"), self.args.len(), 0, limits.max_task_entries)?;
        check_range(|| format!("{at}.env"), self.env.len(), 0, limits.max_task_entries)?;
        let mut bytes = self.command.len() + self.workdir.as_ref().map_or(0, String::len);
        bytes += self.args.iter().map(String::len).sum::<usize>();
        bytes += self.env.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        check_range(|| at.to_owned(), bytes, 1, limits.max_task_bytes)?;
        if self.command.contains('\0') {
            return Err(bad(format!("{at}.command"), "contains a NUL byte".into()));
        }
        if let Some(i) = self.args.iter().position(|a| a.contains('\0')) {
            return Err(bad(format!("{at}.args[{i}]"), "contains a NUL byte".into()));
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(bad(
                    crate::error::key_path(&format!("{at}.env"), k),
                    "a variable name must be non-empty without '=' or NUL, its value without NUL".into(),
                ));
            }
        }
        if let Some(w) = &self.workdir
            && (w.is_empty() || w.contains('\0'))
        {
            return Err(bad(format!("{at}.workdir"), "must be a non-empty path without NUL".into()));
        }
        Ok(())
    }
}

fn one() -> u32 {
    1
}

impl TaskGroup {
    /// The fewest replicas that may start.
    pub fn min(&self) -> u32 {
        self.min_replicas.unwrap_or(self.replicas).min(self.replicas)
    }
}

/// How a gang whose replicas span nodes is kept together in the datacenter network (nodes'
/// `topology.suanli.io/block` and `topology.suanli.io/nvlink-domain` labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum GangTopology {
    /// The fewest units it fits in: one NVLink domain, else one block, else as few blocks as
    /// the free devices allow.
    #[default]
    Prefer,
    /// One block or not at all (the job waits).
    RequireBlock,
    /// One multi-node NVLink domain or not at all.
    RequireNvlinkDomain,
    /// Ignore the network: place replicas as single tasks are placed.
    Ignore,
}

impl GangTopology {
    /// True for the default.
    pub fn is_default(&self) -> bool {
        *self == GangTopology::Prefer
    }
}

/// Where a job may run. Empty lists mean "anywhere".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Constraints {
    /// Allowed pools.
    pub pools: Vec<PoolId>,
    /// Allowed regions.
    pub regions: Vec<String>,
    /// Allowed device models, any of (like the trace's `gpu_spec`: `V100M16|V100M32`).
    pub device_models: Vec<String>,
    /// Labels the node must carry with these values.
    pub labels: BTreeMap<String, String>,
    /// Allowed nodes, any of (empty: any node). A user may pin a job; the state machine also
    /// sets it in the scheduler's view for `job migrate --to-node`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeId>,
    /// Nodes not to use. The state machine sets it in the scheduler's view for the node that
    /// just failed an attempt (for a bounded time, so a one-node pool still recovers).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub avoid_nodes: Vec<NodeId>,
    /// How a gang spanning nodes is kept together in the network (gangs only).
    #[serde(skip_serializing_if = "GangTopology::is_default")]
    pub gang_topology: GangTopology,
    /// The least isolation a fractional device share needs: `enforced` places the job's
    /// fractional replicas only on devices whose plugin limits each share (MPS); whole-device
    /// requests are not affected (a whole device is not shared).
    #[serde(skip_serializing_if = "ShareIsolation::is_advisory")]
    pub share_isolation: ShareIsolation,
}

/// How a job checkpoints, so preemption can save its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CheckpointPolicy {
    /// Interval between checkpoints, in seconds.
    pub interval_s: u64,
    /// How long the task may take to write a checkpoint when asked to stop.
    pub grace_s: u64,
    /// Estimated time to restore from a checkpoint.
    #[serde(default)]
    pub restore_s: u64,
    /// The signal that asks the task to write a checkpoint now (docs/checkpoints.md).
    #[serde(default)]
    pub signal: CheckpointSignal,
}

/// The signal that asks a task to checkpoint. SIGUSR1 by default: it has no meaning of its own
/// (SIGTERM already means "stop" to most runtimes, and SIGINT raises KeyboardInterrupt in
/// Python), so a trainer can catch it, finish its step, checkpoint and keep going until it is
/// told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum CheckpointSignal {
    /// SIGUSR1 (the default).
    #[default]
    #[serde(rename = "SIGUSR1")]
    Usr1,
    /// SIGUSR2.
    #[serde(rename = "SIGUSR2")]
    Usr2,
    /// SIGINT.
    #[serde(rename = "SIGINT")]
    Int,
    /// SIGTERM (the task checkpoints as part of stopping).
    #[serde(rename = "SIGTERM")]
    Term,
    /// SIGHUP.
    #[serde(rename = "SIGHUP")]
    Hup,
}

impl CheckpointSignal {
    /// Its conventional name, as in the spec (`SIGUSR1`).
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointSignal::Usr1 => "SIGUSR1",
            CheckpointSignal::Usr2 => "SIGUSR2",
            CheckpointSignal::Int => "SIGINT",
            CheckpointSignal::Term => "SIGTERM",
            CheckpointSignal::Hup => "SIGHUP",
        }
    }

    /// The signal named `s` (`SIGUSR1`), if it is one of these.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Usr1, Self::Usr2, Self::Int, Self::Term, Self::Hup].into_iter().find(|x| x.as_str() == s)
    }
}

/// A job as submitted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Human-readable name.
    pub name: String,
    /// Leaf queue it is submitted to.
    pub queue: QueueId,
    /// Training, batch or inference.
    #[serde(default)]
    pub kind: JobKind,
    /// Higher runs first and may preempt lower.
    #[serde(default)]
    pub priority: i32,
    /// Whether higher-priority work may preempt it.
    #[serde(default = "yes")]
    pub preemptible: bool,
    /// All-or-nothing: every replica of every group starts together or none does. When false,
    /// each group needs at least its `min_replicas` (elastic).
    #[serde(default)]
    pub gang: bool,
    /// Task groups.
    pub groups: Vec<TaskGroup>,
    /// Placement constraints.
    #[serde(default)]
    pub constraints: Constraints,
    /// Expected run time in seconds, used for backfill.
    #[serde(default)]
    pub runtime_estimate_s: Option<u64>,
    /// Checkpointing, if the job supports it.
    #[serde(default)]
    pub checkpoint: Option<CheckpointPolicy>,
    /// A long-running service (docs/services.md): replicas are replaced when they end, whatever
    /// the exit code, and report readiness. `kind = "inference"` implies it with its defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<crate::ServiceSpec>,
}

fn yes() -> bool {
    true
}

impl JobSpec {
    /// The job's service section: its own, or the defaults for `kind = "inference"`; `None`
    /// for work that runs to completion.
    pub fn service(&self) -> Option<std::borrow::Cow<'_, crate::ServiceSpec>> {
        match &self.service {
            Some(s) => Some(std::borrow::Cow::Borrowed(s)),
            None if self.kind == JobKind::Inference => Some(std::borrow::Cow::Owned(crate::ServiceSpec::default())),
            None => None,
        }
    }

    /// True for a long-running service (see [`JobSpec::service`]).
    pub fn is_service(&self) -> bool {
        self.service.is_some() || self.kind == JobKind::Inference
    }

    /// True for elastic work (docs/job-spec.md, "Elastic jobs"): not a service, not a gang,
    /// and some group may run with fewer replicas than it asks for (`min_replicas <
    /// replicas`). A running elastic job grows into idle capacity and is shrunk, newest
    /// replicas first, before anything of its minimum is preempted.
    pub fn is_elastic(&self) -> bool {
        !self.gang && !self.is_service() && self.groups.iter().any(|g| g.min() < g.replicas)
    }

    /// Total resources of all replicas.
    pub fn total(&self) -> ResVec {
        let mut v = ResVec::ZERO;
        for g in &self.groups {
            let r = g.resources.as_resvec();
            for _ in 0..g.replicas.min(1_000_000) {
                v += r;
            }
        }
        v
    }

    /// Total resources of the minimum replica counts (what admission must find).
    pub fn min_total(&self) -> ResVec {
        let mut v = ResVec::ZERO;
        for g in &self.groups {
            let r = g.resources.as_resvec();
            let n = if self.gang { g.replicas } else { g.min() };
            let d = r.dims();
            v += ResVec::from_dims(std::array::from_fn(|i| d[i].saturating_mul(u64::from(n))));
        }
        v
    }

    /// Checks every field against `limits`, naming the first bad field.
    pub fn validate(&self, limits: &Limits) -> Result<(), ValidationError> {
        check_name(|| "name".into(), &self.name, limits.max_name_len)?;
        check_name(|| "queue".into(), self.queue.as_str(), limits.max_name_len)?;
        check_range(|| "priority".into(), self.priority, -limits.max_priority, limits.max_priority)?;
        if self.groups.is_empty() {
            return Err(ValidationError::Empty { field: "groups".into() });
        }
        check_range(|| "groups".into(), self.groups.len(), 1, limits.max_groups)?;
        for (i, g) in self.groups.iter().enumerate() {
            check_name(|| format!("groups[{i}].name"), &g.name, limits.max_name_len)?;
            if self.groups[..i].iter().any(|o| o.name == g.name) {
                return Err(ValidationError::Invalid {
                    field: format!("groups[{i}].name"),
                    message: format!("duplicate group name {:?}", g.name),
                });
            }
            check_range(|| format!("groups[{i}].replicas"), g.replicas, 1, limits.max_replicas)?;
            if let Some(m) = g.min_replicas {
                check_range(|| format!("groups[{i}].min_replicas"), m, 1, g.replicas)?;
            }
            let r = &g.resources;
            check_range(|| format!("groups[{i}].resources.cpu_milli"), r.cpu_milli, 0, limits.max_cpu_milli)?;
            check_range(|| format!("groups[{i}].resources.memory_mib"), r.memory_mib, 0, limits.max_memory_mib)?;
            if let Some(d) = &r.devices {
                check_range(
                    || format!("groups[{i}].resources.devices.count"),
                    d.count,
                    1,
                    limits.max_devices_per_task,
                )?;
                check_range(|| format!("groups[{i}].resources.devices.milli"), d.milli, 1, WHOLE_DEVICE_MILLI)?;
                if d.is_fractional() && d.count != 1 {
                    return Err(ValidationError::Invalid {
                        field: format!("groups[{i}].resources.devices.count"),
                        message: format!(
                            "a fractional device request (milli {} < 1000) must have count 1, got {}",
                            d.milli, d.count
                        ),
                    });
                }
                check_range(
                    || format!("groups[{i}].resources.devices.memory_mib"),
                    d.memory_mib,
                    0,
                    limits.max_device_memory_mib,
                )?;
            }
            if let Some(t) = &g.task {
                t.validate(&format!("groups[{i}].task"), limits)?;
            }
            if r.cpu_milli == 0 && r.memory_mib == 0 && r.devices.is_none() {
                return Err(ValidationError::Invalid {
                    field: format!("groups[{i}].resources"),
                    message: "a task must request some cpu_milli, memory_mib or devices".into(),
                });
            }
        }
        let c = &self.constraints;
        for (field, n) in [
            ("constraints.pools", c.pools.len()),
            ("constraints.regions", c.regions.len()),
            ("constraints.device_models", c.device_models.len()),
            ("constraints.labels", c.labels.len()),
            ("constraints.nodes", c.nodes.len()),
            ("constraints.avoid_nodes", c.avoid_nodes.len()),
        ] {
            check_range(|| field.into(), n, 0, limits.max_constraints)?;
        }
        for (i, p) in c.pools.iter().enumerate() {
            check_name(|| format!("constraints.pools[{i}]"), p.as_str(), limits.max_name_len)?;
        }
        for (i, r) in c.regions.iter().enumerate() {
            check_name(|| format!("constraints.regions[{i}]"), r, limits.max_name_len)?;
        }
        for (i, m) in c.device_models.iter().enumerate() {
            if m.is_empty() {
                return Err(ValidationError::Empty { field: format!("constraints.device_models[{i}]") });
            }
            check_value(|| format!("constraints.device_models[{i}]"), m, limits.max_name_len)?;
        }
        crate::node::check_labels("constraints.labels", &c.labels, limits)?;
        for (i, n) in c.nodes.iter().enumerate() {
            check_name(|| format!("constraints.nodes[{i}]"), n.as_str(), limits.max_name_len)?;
        }
        for (i, n) in c.avoid_nodes.iter().enumerate() {
            check_name(|| format!("constraints.avoid_nodes[{i}]"), n.as_str(), limits.max_name_len)?;
        }
        if let Some(e) = self.runtime_estimate_s {
            check_range(|| "runtime_estimate_s".into(), e, 1, limits.max_duration_s)?;
        }
        if let Some(cp) = &self.checkpoint {
            check_range(|| "checkpoint.interval_s".into(), cp.interval_s, 1, limits.max_duration_s)?;
            check_range(|| "checkpoint.grace_s".into(), cp.grace_s, 0, limits.max_duration_s)?;
            check_range(|| "checkpoint.restore_s".into(), cp.restore_s, 0, limits.max_duration_s)?;
        }
        if let Some(s) = &self.service {
            s.validate(limits)?;
        }
        if self.service.as_ref().is_some_and(|s| s.autoscale.is_some()) && self.groups.len() != 1 {
            return Err(ValidationError::Invalid {
                field: "service.autoscale".into(),
                message: format!("scales one task group; this service has {}", self.groups.len()),
            });
        }
        if self.is_service() && self.gang {
            return Err(ValidationError::Invalid {
                field: "gang".into(),
                message: "a service's replicas are replaced one by one: gang must be false".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec {
            name: "train".into(),
            queue: QueueId::from("team-a"),
            kind: JobKind::Training,
            priority: 10,
            preemptible: true,
            gang: true,
            groups: vec![TaskGroup {
                task: None,
                name: "worker".into(),
                replicas: 2,
                min_replicas: None,
                resources: TaskResources {
                    cpu_milli: 8000,
                    memory_mib: 65536,
                    devices: Some(DeviceRequest { kind: DeviceKind::Gpu, count: 4, milli: 1000, memory_mib: 0 }),
                },
            }],
            constraints: Constraints::default(),
            runtime_estimate_s: Some(3600),
            checkpoint: None,
            service: None,
        }
    }

    #[test]
    fn valid_spec_passes_and_totals_add_up() {
        let s = spec();
        assert_eq!(s.validate(&Limits::default()), Ok(()));
        assert_eq!(s.total().gpu_milli, 8000);
        assert_eq!(s.min_total().cpu_milli, 16000);
    }

    #[test]
    fn errors_name_the_field_and_limit() {
        let mut s = spec();
        s.groups[0].resources.cpu_milli = u64::MAX;
        let e = s.validate(&Limits::default()).expect_err("absurd cpu must be refused");
        assert_eq!(e.field(), "groups[0].resources.cpu_milli");
        assert!(e.to_string().contains("between 0 and 1024000"), "{e}");

        let mut s = spec();
        if let Some(d) = s.groups[0].resources.devices.as_mut() {
            d.milli = 500;
        }
        let e = s.validate(&Limits::default()).expect_err("fractional x4 must be refused");
        assert_eq!(e.field(), "groups[0].resources.devices.count");

        let mut s = spec();
        s.groups.clear();
        assert_eq!(s.validate(&Limits::default()).map_err(|e| e.field().to_owned()), Err("groups".to_owned()));
    }
}
