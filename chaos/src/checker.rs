//! The invariants, checked at the end of a run from the history, the agents' journals and the
//! servers' own views. Each gives a verdict and, when it fails, the evidence.
//!
//! 1. **acknowledged writes**: every submission a client saw acknowledged exists in the final
//!    state, under the id it was acknowledged with; no client request id made two jobs.
//! 2. **no over-commit**: from the journals (what agents ran, not what servers believed), the
//!    shares running on one device never sum past a whole device.
//! 3. **no double run**: two runs of one task (any epoch, any node) never overlap in time.
//! 4. **recovery**: after the faults heal, every job is running or finished (or waiting out
//!    its own retry backoff) within the stated bound.
//! 5. **convergence**: every server's state machine has the same hash at the same applied
//!    index.
//! 6. **log agreement**: where two servers both keep a committed index, they hold the same
//!    entry there.
//! 7. **isolated leader** (scenarios that isolate one): it acknowledged nothing invoked after
//!    it was cut off.
//! 8. **stays writable** (scenarios with the hostile client): checked in [`crate::hostile`].
//! 9. **bounded time**: no server's cluster time is ahead of the harness's real clock by more
//!    than the bound, and no job waits out a retry backoff longer than the workload's longest
//!    from real time (a leader's wrong clock froze neither).

use crate::history::{Op, OpKind, Outcome};
use crate::nemesis::Isolation;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use suanli_proto::v1 as pb;

/// One verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// The invariant.
    pub name: &'static str,
    /// Held.
    pub ok: bool,
    /// Numbers or evidence.
    pub detail: String,
}

/// A task start or stop from an agent's journal (`<data_dir>/journal.jsonl`, written by the
/// task shim; format in docs/agent.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JournalLine {
    /// `start` or `stop`.
    pub event: String,
    /// Node id.
    pub node: String,
    /// Allocation id.
    pub alloc_id: u64,
    /// Epoch.
    pub epoch: u64,
    /// Job id.
    pub job_id: u64,
    /// `<group>-<replica>`.
    pub task: String,
    /// Device shares.
    #[serde(default)]
    pub devices: Vec<JournalShare>,
    /// Unix ms.
    pub at_ms: u64,
    /// Killed by the shim's fencing.
    #[serde(default)]
    pub fenced: bool,
    /// The federated job's global id (empty for a region-local job).
    #[serde(default)]
    pub global_id: String,
    /// The federation epoch it ran under (0 for a region-local job).
    #[serde(default)]
    pub fed_epoch: u64,
}

/// A device share in a journal line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JournalShare {
    /// Device id.
    pub device: String,
    /// 1000 = the whole device.
    pub milli: u64,
}

/// Parses a journal; a torn last line (the writer died mid-write) is skipped.
pub fn parse_journal(text: &str) -> Vec<JournalLine> {
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// One task run reconstructed from the journals: start to stop (or still running at `now`).
#[derive(Debug, Clone)]
pub struct Run {
    /// Node.
    pub node: String,
    /// Allocation and epoch.
    pub alloc: (u64, u64),
    /// Job.
    pub job: u64,
    /// Task.
    pub task: String,
    /// Device shares.
    pub devices: Vec<(String, u64)>,
    /// Start (ms).
    pub from_ms: u64,
    /// Stop (ms), `u64::MAX` while running.
    pub until_ms: u64,
    /// Ended by fencing.
    pub fenced: bool,
    /// The federated job's global id (empty for a region-local job).
    pub global_id: String,
    /// The federation epoch it ran under.
    pub fed_epoch: u64,
}

/// Pairs starts and stops into runs.
pub fn runs(lines: &[JournalLine]) -> Vec<Run> {
    let mut open: BTreeMap<(String, u64, u64), Run> = BTreeMap::new();
    let mut out = Vec::new();
    for l in lines {
        let key = (l.node.clone(), l.alloc_id, l.epoch);
        match l.event.as_str() {
            "start" => {
                open.insert(
                    key,
                    Run {
                        node: l.node.clone(),
                        alloc: (l.alloc_id, l.epoch),
                        job: l.job_id,
                        task: l.task.clone(),
                        devices: l.devices.iter().map(|d| (d.device.clone(), d.milli)).collect(),
                        from_ms: l.at_ms,
                        until_ms: u64::MAX,
                        fenced: false,
                        global_id: l.global_id.clone(),
                        fed_epoch: l.fed_epoch,
                    },
                );
            }
            "stop" => {
                if let Some(mut r) = open.remove(&key) {
                    r.until_ms = l.at_ms;
                    r.fenced = l.fenced;
                    out.push(r);
                }
            }
            _ => {}
        }
    }
    out.extend(open.into_values());
    out
}

/// Invariant 2: over-committed device episodes (a device whose running shares passed 1000).
pub fn over_commits(runs: &[Run]) -> Vec<String> {
    // (node, device) → (at ms, +1 start / -1 stop, milli)
    type Events = BTreeMap<(String, String), Vec<(u64, i64, u64)>>;
    let mut events = Events::new();
    for r in runs {
        for (d, m) in &r.devices {
            let e = events.entry((r.node.clone(), d.clone())).or_default();
            e.push((r.from_ms, 1, *m));
            if r.until_ms != u64::MAX {
                e.push((r.until_ms, -1, *m));
            }
        }
    }
    let mut out = Vec::new();
    for ((node, dev), mut ev) in events {
        // At one instant, stops count before starts: a device handed over in the same
        // millisecond is not shared.
        ev.sort_by_key(|(t, sign, _)| (*t, *sign));
        let mut used: i64 = 0;
        let mut over = false;
        for (t, sign, m) in ev {
            used += sign * m as i64;
            if used > 1000 && !over {
                out.push(format!("{node}/{dev}: {used} milli in use at {t} ms"));
            }
            over = used > 1000;
        }
    }
    out
}

/// Invariant 3: tasks with two overlapping runs.
pub fn double_runs(runs: &[Run]) -> Vec<String> {
    let mut by_task: BTreeMap<(u64, String), Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_task.entry((r.job, r.task.clone())).or_default().push(r);
    }
    let mut out = Vec::new();
    for ((job, task), mut rs) in by_task {
        rs.sort_by_key(|r| r.from_ms);
        for w in rs.windows(2) {
            if w[1].from_ms < w[0].until_ms {
                out.push(format!(
                    "job {job} task {task}: alloc {:?} on {} ({}..{}) overlaps alloc {:?} on {} (from {})",
                    w[0].alloc,
                    w[0].node,
                    w[0].from_ms,
                    if w[0].until_ms == u64::MAX { "running".into() } else { w[0].until_ms.to_string() },
                    w[1].alloc,
                    w[1].node,
                    w[1].from_ms
                ));
            }
        }
    }
    out
}

/// Federation (docs/federation.md): runs of one global job's task that overlap in time, in any
/// region, node or epoch; keyed by (global id, task), since a job moved to another region
/// has another local job id there. Region-local runs (no global id) are not compared here.
pub fn no_overlap(runs: &[Run]) -> Vec<String> {
    let mut by_task: BTreeMap<(&str, &str), Vec<&Run>> = BTreeMap::new();
    for r in runs.iter().filter(|r| !r.global_id.is_empty()) {
        by_task.entry((r.global_id.as_str(), r.task.as_str())).or_default().push(r);
    }
    let mut out = Vec::new();
    for ((gid, task), mut rs) in by_task {
        rs.sort_by_key(|r| (r.from_ms, r.until_ms));
        // Against the latest end so far, not only the previous run: a long run may cover
        // several later ones.
        let mut latest: Option<&Run> = None;
        for r in rs {
            if let Some(p) = latest
                && r.from_ms < p.until_ms
            {
                out.push(format!(
                    "{gid} task {task}: epoch {} on {} ({}..{}) overlaps epoch {} on {} (from {})",
                    p.fed_epoch,
                    p.node,
                    p.from_ms,
                    if p.until_ms == u64::MAX { "running".into() } else { p.until_ms.to_string() },
                    r.fed_epoch,
                    r.node,
                    r.from_ms
                ));
            }
            if latest.is_none_or(|p| r.until_ms > p.until_ms) {
                latest = Some(r);
            }
        }
    }
    out
}

/// Invariant 1: acknowledged submissions missing from the final state (or under another
/// request id), and request ids that made more than one job.
pub fn lost_writes(ops: &[Op], jobs: &[pb::JobInfo]) -> (Vec<String>, Vec<String>) {
    let by_id: BTreeMap<u64, &pb::JobInfo> = jobs.iter().map(|j| (j.id, j)).collect();
    let mut lost = Vec::new();
    for op in ops {
        if let (OpKind::Submit { request_id }, Outcome::Ok { job: Some(id) }) = (&op.kind, &op.outcome) {
            match by_id.get(id) {
                None => lost.push(format!("{request_id}: acknowledged as job {id} at {} ms, absent", op.completed_ms)),
                Some(j) if &j.client_request_id != request_id => {
                    lost.push(format!("{request_id}: acknowledged as job {id}, which is {:?} now", j.client_request_id))
                }
                Some(_) => {}
            }
        }
    }
    let mut count: BTreeMap<&str, u32> = BTreeMap::new();
    for j in jobs.iter().filter(|j| !j.client_request_id.is_empty()) {
        *count.entry(&j.client_request_id).or_default() += 1;
    }
    let dups = count.into_iter().filter(|(_, n)| *n > 1).map(|(r, n)| format!("{r}: {n} jobs")).collect();
    (lost, dups)
}

/// Invariant 7: acknowledgements by an isolated server of operations invoked after it was cut off.
pub fn isolated_acks(ops: &[Op], isolations: &[Isolation]) -> Vec<String> {
    let mut out = Vec::new();
    for iso in isolations {
        for op in ops {
            let write = !matches!(op.kind, OpKind::Read { .. });
            if write
                && matches!(op.outcome, Outcome::Ok { .. })
                && op.server == iso.server
                && op.invoked_ms >= iso.from_ms
                && op.completed_ms <= iso.until_ms
            {
                out.push(format!(
                    "server index {} acknowledged {:?} (invoked {} ms, done {} ms) while isolated",
                    iso.server, op.kind, op.invoked_ms, op.completed_ms
                ));
            }
        }
    }
    out
}

/// Writes invoked during an isolation that asked the isolated server (what invariant 7 had to
/// judge: with none, the check proved nothing).
pub fn isolated_writes(ops: &[Op], isolations: &[Isolation]) -> usize {
    ops.iter()
        .filter(|o| {
            !matches!(o.kind, OpKind::Read { .. })
                && isolations
                    .iter()
                    .any(|i| o.asked.contains(&i.server) && o.invoked_ms >= i.from_ms && o.invoked_ms < i.until_ms)
        })
        .count()
}

/// Whether a job has settled for invariant 4: running, finished, or pending only while it waits
/// out its own retry backoff.
pub fn settled(j: &pb::JobInfo, now_s: u64) -> bool {
    match j.state.as_str() {
        "running" | "succeeded" | "failed" | "cancelled" => true,
        "pending" | "requeuing" => j.attempt > 0 && j.not_before > now_s,
        _ => false,
    }
}

/// Invariant 9: servers whose cluster time (`(id, seconds)`) is ahead of `now_s` by more than
/// `bound_s`, and jobs whose retry backoff ends later than `max_backoff_s` + `bound_s` from
/// `now_s`.
pub fn time_ahead(
    times: &[(u64, u64)],
    jobs: &[pb::JobInfo],
    now_s: u64,
    bound_s: u64,
    max_backoff_s: u64,
) -> Vec<String> {
    let mut out: Vec<String> = times
        .iter()
        .filter(|(_, t)| *t > now_s.saturating_add(bound_s))
        .map(|(id, t)| format!("server {id}: cluster time {} s ahead of real time (bound {bound_s} s)", t - now_s))
        .collect();
    let limit = now_s.saturating_add(bound_s).saturating_add(max_backoff_s);
    out.extend(jobs.iter().filter(|j| j.not_before > limit).map(|j| {
        format!(
            "job {} ({}) not before {} s from now (longest backoff {max_backoff_s} s)",
            j.id,
            j.state,
            j.not_before - now_s
        )
    }));
    out
}

/// Invariant 6: entries that differ between servers at one committed index.
pub fn log_disagreements(views: &[(u64, Vec<pb::LogDigest>)]) -> Vec<String> {
    let mut at: BTreeMap<u64, BTreeMap<(u64, u64), BTreeSet<u64>>> = BTreeMap::new();
    for (server, entries) in views {
        for e in entries {
            at.entry(e.index).or_default().entry((e.term, e.hash)).or_default().insert(*server);
        }
    }
    at.into_iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(i, v)| {
            format!("index {i}: {:?}", v.into_iter().map(|((t, h), s)| (t, format!("{h:016x}"), s)).collect::<Vec<_>>())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(event: &str, node: &str, alloc: u64, job: u64, dev: &str, milli: u64, at: u64) -> JournalLine {
        JournalLine {
            global_id: String::new(),
            fed_epoch: 0,
            event: event.into(),
            node: node.into(),
            alloc_id: alloc,
            epoch: 1,
            job_id: job,
            task: "main-0".into(),
            devices: vec![JournalShare { device: dev.into(), milli }],
            at_ms: at,
            fenced: false,
        }
    }

    #[test]
    fn shares_that_fit_pass_and_an_over_commit_fails() {
        let ok = [
            line("start", "n1", 1, 1, "gpu0", 500, 10),
            line("start", "n1", 2, 2, "gpu0", 500, 11),
            line("stop", "n1", 1, 1, "gpu0", 500, 20),
            line("start", "n1", 3, 3, "gpu0", 500, 20),
        ];
        assert!(over_commits(&runs(&ok)).is_empty());
        let bad = [line("start", "n1", 1, 1, "gpu0", 1000, 10), line("start", "n1", 2, 2, "gpu0", 500, 15)];
        assert_eq!(over_commits(&runs(&bad)).len(), 1);
    }

    #[test]
    fn overlapping_runs_of_one_task_are_double_runs() {
        let ok = [
            line("start", "n1", 1, 7, "gpu0", 1000, 10),
            line("stop", "n1", 1, 7, "gpu0", 1000, 20),
            line("start", "n2", 2, 7, "gpu0", 1000, 21),
        ];
        assert!(double_runs(&runs(&ok)).is_empty());
        let bad = [line("start", "n1", 1, 7, "gpu0", 1000, 10), line("start", "n2", 2, 7, "gpu0", 1000, 21)];
        assert_eq!(double_runs(&runs(&bad)).len(), 1, "a run that never stopped overlaps the next");
    }

    #[test]
    fn runs_of_one_global_id_in_two_regions_must_not_overlap() {
        let fed = |event: &str, node: &str, alloc: u64, epoch: u64, at: u64| JournalLine {
            global_id: "g-1".into(),
            fed_epoch: epoch,
            ..line(event, node, alloc, alloc, "gpu0", 1000, at)
        };
        // Different local job ids (regions), one global id: a gap passes, an overlap fails.
        let ok = [
            fed("start", "us-east/n1", 1, 1, 10),
            fed("stop", "us-east/n1", 1, 1, 20),
            fed("start", "eu-west/n1", 9, 2, 21),
        ];
        assert!(no_overlap(&runs(&ok)).is_empty());
        let bad = [
            fed("start", "us-east/n1", 1, 1, 10),
            fed("start", "eu-west/n1", 9, 2, 21),
            fed("stop", "us-east/n1", 1, 1, 22),
        ];
        assert_eq!(no_overlap(&runs(&bad)).len(), 1);
        // A long run covering two later ones is caught for both.
        let covered = [
            fed("start", "a/n1", 1, 1, 10),
            fed("start", "b/n1", 2, 2, 12),
            fed("stop", "b/n1", 2, 2, 13),
            fed("start", "c/n1", 3, 3, 14),
        ];
        assert_eq!(no_overlap(&runs(&covered)).len(), 2);
        // Region-local runs are not compared by global id.
        let local = [line("start", "n1", 1, 7, "gpu0", 1000, 10), line("start", "n2", 2, 7, "gpu0", 1000, 11)];
        assert!(no_overlap(&runs(&local)).is_empty());
    }

    #[test]
    fn a_torn_journal_line_is_skipped() {
        let text = "{\"event\":\"start\",\"node\":\"n\",\"alloc_id\":1,\"epoch\":1,\"job_id\":1,\"task\":\"t\",\"at_ms\":5}\n{\"event\":\"st";
        assert_eq!(parse_journal(text).len(), 1);
    }

    #[test]
    fn log_views_that_differ_are_reported() {
        let d = |index, term, hash| pb::LogDigest { index, term, hash };
        let same = [(1, vec![d(1, 1, 9), d(2, 1, 8)]), (2, vec![d(2, 1, 8)])];
        assert!(log_disagreements(&same).is_empty());
        let differ = [(1, vec![d(2, 1, 8)]), (2, vec![d(2, 2, 7)])];
        assert_eq!(log_disagreements(&differ).len(), 1);
    }

    #[test]
    fn time_ahead_of_real_time_or_a_long_backoff_is_caught() {
        let job =
            |id: u64, not_before: u64| pb::JobInfo { id, not_before, state: "pending".into(), ..Default::default() };
        let now = 1_000_000;
        assert!(time_ahead(&[(1, now + 3), (2, now - 10)], &[job(1, now + 5)], now, 3, 2).is_empty());
        let bad = time_ahead(&[(1, now + 3_600), (2, now)], &[job(7, now + 3_602), job(8, now + 1)], now, 3, 2);
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert!(bad[0].contains("server 1") && bad[0].contains("3600 s ahead"), "{bad:?}");
        assert!(bad[1].contains("job 7") && bad[1].contains("3602 s"), "{bad:?}");
    }
}
