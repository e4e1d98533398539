//! Invariants that must hold after every applied command, on every replica. Tests check them
//! after each step; chaos checks them on live clusters.

use crate::records::{Desired, JobState, NodeStatus, StopReason};
use crate::state::State;
use crate::usage::queue_usage;
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{Health, JobId, WHOLE_DEVICE_MILLI};
use thiserror::Error;

/// A broken invariant: which rule, and the evidence.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invariant {rule} violated: {detail}")]
pub struct Violation {
    /// Short rule name, e.g. `device-overcommit`.
    pub rule: &'static str,
    /// What was found.
    pub detail: String,
}

fn fail(rule: &'static str, detail: String) -> Result<(), Violation> {
    Err(Violation { rule, detail })
}

impl State {
    /// Checks every invariant; returns the first violation found.
    ///
    /// - `node-overcommit`: live allocations on a node fit its CPU and memory.
    /// - `device-overcommit`: shares on a device sum to at most 1000 milli, and memory slices
    ///   to at most its memory (when known); every share names a device the node has.
    /// - `mig-exclusive`: a MIG partition and its physical parent (both devices of the node)
    ///   are never used at once.
    /// - `alloc-node`: live allocations run on known nodes that are not down.
    /// - `one-live-alloc-per-task`: at most one live allocation per (job, group, replica,
    ///   spec version), and at most one allocation per (job, group, replica, epoch, version)
    ///   (a service's rolling update runs a replica's old and new version side by side).
    /// - `alloc-job`: a live allocation's job exists, and its epoch is the job's attempt.
    /// - `job-state`: pending jobs hold no live allocation; finished jobs' live allocations are
    ///   being stopped; the live-job index matches the jobs' states.
    /// - `quota`: per queue, live usage not declared borrowed fits its nominal quota.
    /// - `requests`: every remembered client request id points at the job it created.
    /// - `live-index`: the usage index kept up to date as allocations start and end equals a
    ///   fresh count over every live allocation.
    /// - `audit`: audit sequence numbers increase and are below the next one to assign; the
    ///   log holds at most `audit_retention` records.
    /// - `quarantine-clears`: a node counts quarantine clears only of devices it has.
    /// - `device-reasons`: a node keeps reasons only for its unhealthy devices.
    /// - `tokens`: at most `max_tokens` token records, each filed under its own id; a token
    ///   signing key, when set, decodes to 32 bytes.
    pub fn invariants(&self) -> Result<(), Violation> {
        self.security_invariants()?;
        for (id, rec) in &self.nodes {
            if let Some(d) = rec.quarantine_clears.keys().find(|d| !rec.node.devices.iter().any(|x| &x.id == *d)) {
                return fail(
                    "quarantine-clears",
                    format!("node {id} counts clears of device {d}, which it does not have"),
                );
            }
            let unhealthy = |d: &str| rec.node.devices.iter().any(|x| x.id == d && x.health == Health::Unhealthy);
            if let Some(d) = rec.device_reasons.keys().find(|d| !unhealthy(d)) {
                return fail(
                    "device-reasons",
                    format!("node {id} has a reason for device {d}, which is not unhealthy there"),
                );
            }
        }
        if let Err(detail) = self.cost_invariants() {
            return fail("cost-conservation", detail);
        }
        let usage = self.usage();
        for (id, u) in &usage.nodes {
            let Some(rec) = self.nodes.get(id) else {
                if u.cpu_milli > 0 || u.memory_mib > 0 {
                    return fail("alloc-node", format!("live allocations on unknown node {id}"));
                }
                continue;
            };
            if u.cpu_milli > rec.node.cpu_milli || u.memory_mib > rec.node.memory_mib {
                return fail(
                    "node-overcommit",
                    format!(
                        "node {id}: cpu {}/{} memory {}/{}",
                        u.cpu_milli, rec.node.cpu_milli, u.memory_mib, rec.node.memory_mib
                    ),
                );
            }
        }
        for (id, devs) in &usage.devices {
            for (dev, u) in devs {
                if u.milli == 0 && u.memory_mib == 0 {
                    continue;
                }
                let d = self.nodes.get(id).and_then(|r| r.node.devices.iter().find(|d| &d.id == dev));
                let Some(d) = d else {
                    return fail("device-overcommit", format!("share of unknown device {dev} on {id}"));
                };
                if u.milli > u64::from(WHOLE_DEVICE_MILLI) || (d.memory_mib > 0 && u.memory_mib > d.memory_mib) {
                    return fail(
                        "device-overcommit",
                        format!("device {dev} on {id}: {} milli, {}/{} MiB", u.milli, u.memory_mib, d.memory_mib),
                    );
                }
            }
        }
        for (id, devs) in &usage.devices {
            let Some(rec) = self.nodes.get(id) else { continue };
            let used = |d: &str| devs.get(d).is_some_and(|u| u.milli > 0 || u.memory_mib > 0);
            for d in &rec.node.devices {
                if let Some(parent) = d.partition_of.as_deref()
                    && parent != d.id
                    && used(&d.id)
                    && used(parent)
                {
                    return fail(
                        "mig-exclusive",
                        format!("device {} on {id} and its MIG parent {parent} are both in use", d.id),
                    );
                }
            }
        }
        let mut tasks = BTreeSet::new();
        let mut epochs = BTreeSet::new();
        let mut live_by_job: BTreeMap<JobId, usize> = BTreeMap::new();
        for a in self.allocs.values() {
            let x = &a.alloc;
            if !epochs.insert((x.job, x.group, x.replica, x.epoch, a.version)) {
                return fail(
                    "one-live-alloc-per-task",
                    format!("two allocations of job {} task {}/{} in epoch {}", x.job, x.group, x.replica, x.epoch),
                );
            }
            if !a.is_live() {
                continue;
            }
            if !tasks.insert((x.job, x.group, x.replica, a.version)) {
                return fail(
                    "one-live-alloc-per-task",
                    format!("two live allocations of job {} task {}/{}", x.job, x.group, x.replica),
                );
            }
            match self.nodes.get(&x.node) {
                Some(r) if r.status == NodeStatus::Down => {
                    return fail("alloc-node", format!("allocation {} is live on down node {}", x.id, x.node));
                }
                None => {
                    return fail("alloc-node", format!("allocation {} on unknown node {}", x.id, x.node));
                }
                Some(_) => {}
            }
            let Some(j) = self.jobs.get(&x.job) else {
                return fail("alloc-job", format!("live allocation {} of unknown job {}", x.id, x.job));
            };
            if x.epoch != j.attempt {
                return fail(
                    "alloc-job",
                    format!("live allocation {} has epoch {}, job attempt {}", x.id, x.epoch, j.attempt),
                );
            }
            if j.state.is_terminal() && a.desired == Desired::Run {
                return fail(
                    "job-state",
                    format!("job {} is {} but allocation {} still runs", j.id, j.state.as_str(), x.id),
                );
            }
            *live_by_job.entry(x.job).or_default() += 1;
        }
        for j in self.jobs.values() {
            if j.state == JobState::Pending && live_by_job.contains_key(&j.id) {
                return fail("job-state", format!("pending job {} holds live allocations", j.id));
            }
            if j.state.is_terminal() == self.live_jobs.contains(&j.id) {
                return fail("job-state", format!("live-job index disagrees with job {} ({})", j.id, j.state.as_str()));
            }
        }
        if self.live_jobs.iter().any(|id| !self.jobs.contains_key(id)) {
            return fail("job-state", "live-job index names a forgotten job".into());
        }
        for (q, (own, _borrowed)) in queue_usage(&self.allocs, &self.nodes) {
            let Some(queue) = self.queues.get(&q) else {
                return fail("quota", format!("live allocations charged to unknown queue {q}"));
            };
            if let Some(dim) = own.first_exceeding(&queue.nominal) {
                return fail(
                    "quota",
                    format!("queue {q}: {dim} used without borrowing exceeds nominal ({own} > {})", queue.nominal),
                );
            }
        }
        let fresh = crate::usage::LiveIndex::build(&self.allocs, &self.nodes, &self.jobs);
        if let Some(part) = self.live.differs_from(&fresh) {
            return fail("live-index", format!("the maintained {part} disagree with a fresh count"));
        }
        for (rid, id) in &self.requests {
            if self.jobs.get(id).is_none_or(|j| &j.client_request_id != rid) {
                return fail("requests", format!("request {rid:?} points at job {id}, which it did not create"));
            }
        }
        self.checkpoint_invariants()
    }

    /// The checkpoint-side records (issue 18):
    ///
    /// - `nomination`: a job holding capacity is pending; its victims are allocations that
    ///   were created, and each one still live is being stopped for that job.
    /// - `migration`: a migration target belongs to a job between its stop and its next
    ///   placement (requeuing or pending).
    /// - `end-class`: a live allocation has no end yet; an ended allocation's lost work is
    ///   counted in its job's `lost_device_s`; infrastructure requeues are requeues.
    /// - `checkpoint`: a hardware-bound checkpoint names a model and at least one device.
    /// - `federation`: a federated job has a global id and an epoch of at least 1.
    fn checkpoint_invariants(&self) -> Result<(), Violation> {
        for j in self.jobs.values() {
            if let Some(n) = &j.nomination {
                if j.state != JobState::Pending {
                    return fail("nomination", format!("job {} holds capacity but is {}", j.id, j.state.as_str()));
                }
                for v in &n.victims {
                    if v.0 >= self.next_alloc {
                        return fail("nomination", format!("job {} waits for allocation {v}, never created", j.id));
                    }
                    let Some(a) = self.allocs.get(v).filter(|a| a.is_live()) else {
                        continue;
                    };
                    let for_this = matches!(
                        &a.desired,
                        Desired::Stop { reason: StopReason::Preempted { for_job }, .. } if *for_job == j.id
                    );
                    if !for_this {
                        return fail(
                            "nomination",
                            format!("job {} waits for allocation {v}, which is not being stopped for it", j.id),
                        );
                    }
                }
            }
            if let Some(b) = &j.federation
                && (b.epoch == 0 || b.global_id.is_empty())
            {
                return fail(
                    "federation",
                    format!("job {}: federated with epoch {} and global id {:?}", j.id, b.epoch, b.global_id),
                );
            }
            if j.migration.is_some() && !matches!(j.state, JobState::Requeuing | JobState::Pending) {
                return fail("migration", format!("job {} has a migration target but is {}", j.id, j.state.as_str()));
            }
            if j.infra_requeues > j.requeues {
                return fail(
                    "end-class",
                    format!("job {}: {} infrastructure requeues of {} in all", j.id, j.infra_requeues, j.requeues),
                );
            }
            let mut lost: u64 = j.history.iter().map(|h| h.lost_device_s).fold(0, u64::saturating_add);
            for a in j.allocs.iter().filter_map(|a| self.allocs.get(a)) {
                if a.is_live() && a.end.is_some() {
                    return fail("end-class", format!("live allocation {} already has an end", a.alloc.id));
                }
                lost = lost.saturating_add(a.lost_device_s);
            }
            if lost > j.lost_device_s {
                return fail(
                    "end-class",
                    format!("job {}: its allocations lost {lost} device-s, the job counts {}", j.id, j.lost_device_s),
                );
            }
            if let Some(h) = j.latest_checkpoint.as_ref().and_then(|c| c.hardware.as_ref())
                && (h.model.is_empty() || h.count == 0)
            {
                return fail("checkpoint", format!("job {}: hardware-bound checkpoint without model or count", j.id));
            }
        }
        Ok(())
    }
}

impl State {
    fn security_invariants(&self) -> Result<(), Violation> {
        let sec = &self.security;
        let mut prev = 0;
        for r in &sec.audit {
            if r.seq <= prev || r.seq >= sec.next_audit_seq {
                return fail(
                    "audit",
                    format!("audit seq {} after {prev}, next to assign {}", r.seq, sec.next_audit_seq),
                );
            }
            prev = r.seq;
        }
        if sec.audit.len() > self.config.audit_retention {
            return fail(
                "audit",
                format!("{} audit records, retention {}", sec.audit.len(), self.config.audit_retention),
            );
        }
        if sec.tokens.len() > self.config.max_tokens {
            return fail("tokens", format!("{} tokens, max_tokens {}", sec.tokens.len(), self.config.max_tokens));
        }
        if let Some((id, t)) = sec.tokens.iter().find(|(id, t)| **id != t.id) {
            return fail("tokens", format!("token {} filed under id {id}", t.id));
        }
        if let Some(k) = &sec.token_key
            && crate::security::decode_key(k).is_err()
        {
            return fail("tokens", "the token signing key is not base64 of 32 bytes".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::command::{Command, UpsertQueue};
    use crate::config::StateConfig;
    use crate::state::State;
    use suanli_model::{JobId, Queue, ResVec};

    /// Each security rule catches its breakage.
    #[test]
    fn security_records_are_checked() {
        use crate::security::{AuditEntry, AuditRecord, TokenRecord};
        let rec = |seq| AuditRecord {
            seq,
            entry: AuditEntry {
                at_ms: 0,
                principal: "p".into(),
                method: "m".into(),
                target: String::new(),
                code: "OK".into(),
                message: String::new(),
                server: 1,
                remote: String::new(),
            },
        };
        let rule = |s: &State| s.invariants().map_err(|v| v.rule);
        let base = State::new(StateConfig { audit_retention: 2, max_tokens: 1, ..StateConfig::default() });
        assert_eq!(rule(&base), Ok(()));
        let mut s = base.clone();
        s.security.audit.extend([rec(2), rec(1)]);
        s.security.next_audit_seq = 3;
        assert_eq!(rule(&s), Err("audit"), "decreasing");
        let mut s = base.clone();
        s.security.audit.extend([rec(1), rec(2)]);
        s.security.next_audit_seq = 2;
        assert_eq!(rule(&s), Err("audit"), "a seq not below the next");
        let mut s = base.clone();
        s.security.audit.extend([rec(1), rec(2), rec(3)]);
        s.security.next_audit_seq = 4;
        assert_eq!(rule(&s), Err("audit"), "beyond retention");
        let t = |id: &str| TokenRecord {
            id: id.into(),
            name: "a".into(),
            role: "admin".into(),
            team: None,
            issued_at: 1,
            expires_at: 2,
            revoked: false,
            created_by: String::new(),
        };
        let mut s = base.clone();
        s.security.tokens.insert("a".into(), t("a"));
        assert_eq!(rule(&s), Ok(()));
        s.security.tokens.insert("b".into(), t("b"));
        assert_eq!(rule(&s), Err("tokens"), "beyond max_tokens");
        let mut s = base.clone();
        s.security.tokens.insert("a".into(), t("b"));
        assert_eq!(rule(&s), Err("tokens"), "filed under another id");
        let mut s = base;
        s.security.token_key = Some("short".into());
        assert_eq!(rule(&s), Err("tokens"), "a bad key");
    }

    fn upsert(id: &str) -> Command {
        Command::UpsertQueue(UpsertQueue { queue: Queue::new(id, ResVec::MAX) })
    }

    /// Debug builds run `invariants()` after every command that changes the state: a state
    /// broken behind apply's back (here the live-job index names a job that does not exist)
    /// stops at the next command, naming it.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "applying a upsert_queue command at revision 2 broke the state: invariant job-state")]
    fn apply_checks_the_invariants_in_debug_builds() {
        let mut s = State::new(StateConfig::default());
        s.apply(upsert("a"));
        s.live_jobs.insert(JobId(99));
        s.apply(upsert("b"));
    }

    /// Each checkpoint-side invariant fires on a state broken the way it guards against.
    #[test]
    fn checkpoint_invariants_catch_broken_records() {
        use crate::records::{EndClass, JobState, Nomination};
        use std::collections::BTreeSet;
        use suanli_model::{
            AllocId, CheckpointHardware, Constraints, DeviceKind, DeviceRequest, JobKind, JobSpec, QueueId, TaskGroup,
            TaskResources,
        };
        let mut s = State::new(StateConfig::default());
        s.apply(upsert("q"));
        let spec = JobSpec {
            name: "j".into(),
            queue: QueueId::from("q"),
            kind: JobKind::Training,
            priority: 0,
            preemptible: true,
            gang: true,
            groups: vec![TaskGroup {
                task: None,
                name: "w".into(),
                replicas: 1,
                min_replicas: None,
                resources: TaskResources {
                    cpu_milli: 1000,
                    memory_mib: 1024,
                    devices: Some(DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: 1000, memory_mib: 0 }),
                },
            }],
            constraints: Constraints::default(),
            runtime_estimate_s: None,
            checkpoint: None,
            service: None,
        };
        s.apply(Command::SubmitJob(Box::new(crate::SubmitJob {
            client_request_id: "a".into(),
            spec,
            retry: None,
            now: 1,
            trace: None,
        })));
        assert_eq!(s.invariants(), Ok(()));
        let id = JobId(1);
        let rule = |s: &State| s.invariants().map_err(|v| v.rule);
        let broken = |f: &dyn Fn(&mut crate::records::Job)| {
            let mut b = s.clone();
            if let Some(j) = b.jobs.get_mut(&id) {
                f(j);
            }
            b.live = crate::usage::LiveIndex::build(&b.allocs, &b.nodes, &b.jobs);
            rule(&b)
        };
        let never_made = Nomination { victims: BTreeSet::from([AllocId(99)]), since: 1 };
        assert_eq!(broken(&|j| j.nomination = Some(never_made.clone())), Err("nomination"));
        let held = Nomination { victims: BTreeSet::new(), since: 1 };
        assert_eq!(
            broken(&|j| {
                j.nomination = Some(held.clone());
                j.state = JobState::Preempted;
            }),
            Err("nomination")
        );
        assert_eq!(
            broken(&|j| {
                j.migration = Some(crate::records::MigrationTarget::default());
                j.state = JobState::Running;
            }),
            Err("migration")
        );
        assert_eq!(broken(&|j| j.infra_requeues = 1), Err("end-class"));
        let lost_more = |j: &mut crate::records::Job| {
            j.history.push(crate::records::AttemptRecord {
                attempt: 1,
                alloc: AllocId(1),
                group: 0,
                replica: 0,
                node: suanli_model::NodeId::from("n"),
                started_at: 1,
                ended_at: 2,
                state: crate::records::AllocState::Lost,
                message: String::new(),
                end: Some(EndClass::NodeLost),
                exit_code: None,
                lost_device_s: 5,
                restored_step: None,
            });
        };
        assert_eq!(broken(&lost_more), Err("end-class"));
        let bad_hw = |j: &mut crate::records::Job| {
            j.latest_checkpoint = Some(crate::records::CheckpointRecord {
                uri: "file:///c".into(),
                step: 1,
                size_bytes: 1,
                at: 1,
                alloc: AllocId(1),
                epoch: 1,
                wall_time: 0,
                hardware: Some(CheckpointHardware { kind: DeviceKind::Gpu, model: "A100".into(), count: 0 }),
            });
        };
        assert_eq!(broken(&bad_hw), Err("checkpoint"));
    }

    /// `mig-exclusive` fires when a MIG partition and its parent are both in use (here the
    /// node's record is changed behind apply's back after both were placed as plain GPUs).
    #[test]
    fn a_partition_used_next_to_its_parent_breaks_mig_exclusive() {
        use crate::command::{ApplyPlan, RegisterNode, SubmitJob};
        use suanli_model::{
            Constraints, Device, DeviceKind, DeviceRequest, DeviceShare, JobKind, JobSpec, Node, NodeId, Placement,
            Plan, PoolId, QueueId, TaskGroup, TaskResources,
        };
        let mut s = State::new(StateConfig::default());
        s.apply(upsert("q"));
        let node = Node {
            id: NodeId::from("n0"),
            pool: PoolId::from("p"),
            datacenter: String::new(),
            region: String::new(),
            labels: Default::default(),
            cpu_milli: 8000,
            memory_mib: 8192,
            devices: vec![
                Device::simple("gpu0", DeviceKind::Gpu, "A100"),
                Device::simple("gpu0-mig0", DeviceKind::Gpu, "A100-3g.40gb"),
            ],
            schedulable: true,
            agent_addr: String::new(),
        };
        s.apply(Command::RegisterNode(Box::new(RegisterNode { node, now: 1, fence: None })));
        let mut placements = Vec::new();
        for (i, dev) in ["gpu0", "gpu0-mig0"].into_iter().enumerate() {
            let spec = JobSpec {
                name: format!("j{i}"),
                queue: QueueId::from("q"),
                kind: JobKind::Batch,
                priority: 0,
                preemptible: true,
                gang: false,
                groups: vec![TaskGroup {
                    task: None,
                    name: "t".into(),
                    replicas: 1,
                    min_replicas: None,
                    resources: TaskResources {
                        cpu_milli: 100,
                        memory_mib: 100,
                        devices: Some(DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: 1000, memory_mib: 0 }),
                    },
                }],
                constraints: Constraints::default(),
                runtime_estimate_s: None,
                checkpoint: None,
                service: None,
            };
            s.apply(Command::SubmitJob(Box::new(SubmitJob {
                client_request_id: format!("r{i}"),
                spec,
                retry: None,
                now: 1,
                trace: None,
            })));
            placements.push(Placement {
                job: JobId(i as u64 + 1),
                group: 0,
                replica: 0,
                node: NodeId::from("n0"),
                cpu_milli: 100,
                memory_mib: 100,
                devices: vec![DeviceShare { device: dev.into(), milli: 1000, memory_mib: 0 }],
                borrowed: false,
            });
        }
        s.apply(Command::ApplyPlan(ApplyPlan { plan: Plan { placements, ..Plan::default() }, now: 2 }));
        assert_eq!(s.invariants(), Ok(()));
        if let Some(rec) = s.nodes.get_mut(&NodeId::from("n0")) {
            rec.node.devices[1].partition_of = Some("gpu0".into());
        }
        let v = s.invariants().expect_err("both halves of one GPU are in use");
        assert_eq!(v.rule, "mig-exclusive", "{v}");
    }

    /// A command that changes nothing is not checked (the state is as the last check left it).
    #[test]
    fn an_unchanged_state_is_not_rechecked() {
        let mut s = State::new(StateConfig::default());
        s.apply(upsert("a"));
        s.live_jobs.insert(JobId(99));
        let r = s.apply(Command::UpsertQueue(UpsertQueue { queue: Queue::new("", ResVec::MAX) }));
        assert!(matches!(r, crate::Response::Rejected(_)), "{r:?}");
        assert!(s.invariants().is_err());
    }
}
