//! Trainers under faults (scenario `migrate`, issue 18): checkpointing trainer jobs
//! (`examples/trainer/trainer.py`) submitted before the fault phase, each journalling every
//! step to its own file, a checkpoint store shared by every agent, and the two invariants
//! read from those journals at the end:
//!
//! - **no job runs twice at once**: the journal spans of two attempts of one job never
//!   overlap ([`overlaps`]);
//! - **steps never go back beyond the last committed checkpoint**: each attempt starts from
//!   a step an earlier attempt checkpointed (or 0 when none did), never below the step the
//!   previous attempt started from ([`step_regressions`]).
//!
//! The journal checks are pure functions of the lines; the end-to-end suites
//! (`tests/tests/checkpoints.rs`) use the same ones.

use crate::checker::Verdict;
use crate::cluster::Cluster;
use crate::history::History;
use anyhow::Context as _;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;

/// One line of a trainer journal (`$TRAINER_JOURNAL`, docs/checkpoints.md). The ids are the
/// task's environment variables as the trainer read them: numbers or strings of digits.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TrainerLine {
    /// `$SUANLI_JOB_ID`.
    #[serde(deserialize_with = "number_or_digits")]
    pub job: u64,
    /// `$SUANLI_ATTEMPT` (the epoch).
    #[serde(deserialize_with = "number_or_digits")]
    pub attempt: u64,
    /// `$SUANLI_ALLOC_ID`.
    #[serde(deserialize_with = "number_or_digits")]
    pub alloc: u64,
    /// The step (for `start` and `restore`: the step it starts from).
    pub step: u64,
    /// Unix time (s).
    pub t: f64,
    /// step | start | checkpoint | restore | exit
    pub event: String,
}

/// A u64 written as a JSON number or as a string of digits.
fn number_or_digits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        Number(u64),
        Digits(String),
    }
    match N::deserialize(d)? {
        N::Number(n) => Ok(n),
        N::Digits(s) => s.parse().map_err(|e| serde::de::Error::custom(format!("{s:?} is not a u64: {e}"))),
    }
}

/// Parses a trainer journal; a line that does not parse (one cut short by a SIGKILL) is
/// skipped.
pub fn parse_trainer_journal(text: &str) -> Vec<TrainerLine> {
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Reads and parses the journal at `path` (missing: empty).
pub fn read_trainer_journal(path: &Path) -> Vec<TrainerLine> {
    parse_trainer_journal(&std::fs::read_to_string(path).unwrap_or_default())
}

/// One attempt of a job as its journal shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptRun {
    /// The epoch.
    pub attempt: u64,
    /// First journal time (s).
    pub from: f64,
    /// Last journal time (s).
    pub to: f64,
    /// The step it started from (its `restore` line, else its `start` line; 0 without one).
    pub start_step: u64,
    /// Whether it restored from a checkpoint (a `restore` line).
    pub restored: bool,
    /// The highest step it reached.
    pub max_step: u64,
    /// The checkpoints it wrote (steps), in order.
    pub checkpoints: Vec<u64>,
}

/// The attempts of job `job` in `lines`, by epoch (the trainer jobs here have one task, so
/// one allocation per attempt).
pub fn attempts(lines: &[TrainerLine], job: u64) -> Vec<AttemptRun> {
    let mut by: BTreeMap<u64, AttemptRun> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.job == job) {
        let r = by.entry(l.attempt).or_insert(AttemptRun {
            attempt: l.attempt,
            from: l.t,
            to: l.t,
            start_step: 0,
            restored: false,
            max_step: 0,
            checkpoints: Vec::new(),
        });
        r.from = r.from.min(l.t);
        r.to = r.to.max(l.t);
        r.max_step = r.max_step.max(l.step);
        match l.event.as_str() {
            "start" if !r.restored => r.start_step = l.step,
            "restore" => {
                r.start_step = l.step;
                r.restored = true;
            }
            "checkpoint" => r.checkpoints.push(l.step),
            _ => {}
        }
    }
    by.into_values().collect()
}

fn jobs(lines: &[TrainerLine]) -> BTreeSet<u64> {
    lines.iter().map(|l| l.job).collect()
}

/// Pairs of attempts of one job whose journal spans overlap in time (must be empty: no job
/// runs twice at once).
pub fn overlaps(lines: &[TrainerLine]) -> Vec<String> {
    let mut out = Vec::new();
    for job in jobs(lines) {
        let runs = attempts(lines, job);
        for (i, a) in runs.iter().enumerate() {
            for b in &runs[i + 1..] {
                if a.from <= b.to && b.from <= a.to {
                    out.push(format!(
                        "job {job}: attempt {} [{:.3}, {:.3}] overlaps attempt {} [{:.3}, {:.3}]",
                        a.attempt, a.from, a.to, b.attempt, b.from, b.to
                    ));
                }
            }
        }
    }
    out
}

/// Attempts whose steps went back beyond a committed checkpoint: an attempt that starts
/// below the step the previous attempt started from (the committed step only grows), or
/// from a step no earlier attempt checkpointed. Must be empty.
pub fn step_regressions(lines: &[TrainerLine]) -> Vec<String> {
    let mut out = Vec::new();
    for job in jobs(lines) {
        let mut written: Vec<u64> = Vec::new();
        let mut prev_start = 0;
        for r in attempts(lines, job) {
            if r.start_step < prev_start {
                out.push(format!(
                    "job {job}: attempt {} started from step {} below the previous attempt's {prev_start}",
                    r.attempt, r.start_step
                ));
            }
            if r.start_step > 0 && !written.contains(&r.start_step) {
                out.push(format!(
                    "job {job}: attempt {} restored step {} that no earlier attempt checkpointed ({written:?})",
                    r.attempt, r.start_step
                ));
            }
            prev_start = r.start_step;
            written.extend(&r.checkpoints);
        }
    }
    out
}

/// The trainer in the repository (`examples/trainer/trainer.py`), beside this crate.
pub fn trainer_py() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("examples").join("trainer").join("trainer.py")
}

/// The spec of trainer job `name` on one whole GPU: `step_s` per step, a checkpoint every
/// `every` steps, `steps` steps, checkpoint grace `grace_s`, journalling to `journal`.
pub fn trainer_spec(
    name: &str,
    journal: &Path,
    steps: u64,
    step_s: f64,
    every: u64,
    grace_s: u64,
    priority: i64,
) -> serde_json::Value {
    let interval_s = ((every as f64 * step_s).ceil() as u64).max(1);
    serde_json::json!({
        "name": name,
        "queue": "default",
        "priority": priority,
        "preemptible": true,
        "checkpoint": {"interval_s": interval_s, "grace_s": grace_s, "restore_s": 1},
        "groups": [{
            "name": "main",
            "replicas": 1,
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": 1000}},
            "task": {"command": "python3",
                     "args": [trainer_py().display().to_string(), "--steps", steps.to_string(),
                              "--step-s", format!("{step_s}"), "--checkpoint-every", every.to_string()],
                     "env": {"TRAINER_JOURNAL": journal.display().to_string(), "PYTHONUNBUFFERED": "1"}}
        }]
    })
}

/// The trainers of a run: job ids and journal paths.
#[derive(Debug, Clone)]
pub struct TrainerJob {
    /// Job id.
    pub id: u64,
    /// Its journal.
    pub journal: PathBuf,
}

/// Seconds per trainer step in chaos runs.
pub const STEP_S: f64 = 0.2;
/// Steps between two checkpoints.
pub const EVERY: u64 = 5;
/// Steps of one trainer: 30 s of stepping, so most still run when the fault phase ends.
pub const STEPS: u64 = 150;

/// Points the cluster's checkpoint store at a directory every agent reaches and submits `n`
/// trainers (priority 10: the workload's jobs do not starve them) through the leader.
pub async fn start(cluster: &mut Cluster, n: usize) -> anyhow::Result<Vec<TrainerJob>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let trainer = trainer_py();
    anyhow::ensure!(trainer.is_file(), "{} is missing (the trainer of issue 18)", trainer.display());
    let store = cluster.dir().join("checkpoints");
    std::fs::create_dir_all(&store)?;
    let url = format!("file://{}", store.display());
    cluster
        .set_config("checkpoint_store", &serde_json::Value::String(url))
        .await
        .context("setting checkpoint_store")?;
    let mut out = Vec::new();
    for i in 0..n {
        let journal = cluster.dir().join(format!("trainer-{i}.jsonl"));
        let spec = trainer_spec(&format!("trainer-{i}"), &journal, STEPS, STEP_S, EVERY, 3, 10);
        let id =
            cluster.submit(&format!("trainer-{i}"), &spec).await.with_context(|| format!("submitting trainer-{i}"))?;
        out.push(TrainerJob { id, journal });
    }
    Ok(out)
}

/// Makes every node schedulable again (a drain's undo may have failed during a partition),
/// retrying for up to 20 s.
pub async fn undrain_all(cluster: &mut Cluster, h: &History) {
    let nodes: Vec<String> = cluster.agents.iter().map(|a| a.node.clone()).collect();
    for node in nodes {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match cluster.set_node_mode(&node, pb::NodeMode::Schedulable).await {
                Ok(()) => break,
                Err(e) if Instant::now() > deadline => {
                    h.fault(format!("heal: node {node} could not be made schedulable: {e}"));
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

/// The trainer invariants' verdicts, from the journals and the final job listing.
pub fn verdicts(trainers: &[TrainerJob], jobs: &[pb::JobInfo]) -> Vec<Verdict> {
    let mut lines = Vec::new();
    let mut silent = Vec::new();
    for t in trainers {
        let l = read_trainer_journal(&t.journal);
        if !l.iter().any(|x| x.job == t.id) {
            silent.push(format!("job {} ({})", t.id, t.journal.display()));
        }
        lines.extend(l);
    }
    let runs: Vec<AttemptRun> = trainers.iter().flat_map(|t| attempts(&lines, t.id)).collect();
    let restored = runs.iter().filter(|r| r.restored).count();
    let committed: Vec<String> = trainers
        .iter()
        .map(|t| {
            let c = jobs.iter().find(|j| j.id == t.id).map_or(0, |j| j.latest_checkpoint_step);
            format!("{}:{c}", t.id)
        })
        .collect();
    let over = overlaps(&lines);
    let back = step_regressions(&lines);
    vec![
        Verdict {
            name: "trainers ran",
            ok: silent.is_empty(),
            detail: if silent.is_empty() {
                format!(
                    "{} trainers, {} attempts ({restored} restored from a checkpoint); committed steps {}",
                    trainers.len(),
                    runs.len(),
                    committed.join(", ")
                )
            } else {
                format!("no journal line from {}", silent.join("; "))
            },
        },
        Verdict {
            name: "no job runs twice",
            ok: over.is_empty(),
            detail: if over.is_empty() {
                format!("{} trainer attempts, none overlapping another attempt of its job", runs.len())
            } else {
                format!("{} overlaps: {}", over.len(), over.iter().take(5).cloned().collect::<Vec<_>>().join("; "))
            },
        },
        Verdict {
            name: "steps from checkpoints",
            ok: back.is_empty(),
            detail: if back.is_empty() {
                format!("every attempt started from a committed checkpoint or later ({restored} restores)")
            } else {
                format!("{} regressions: {}", back.len(), back.iter().take(5).cloned().collect::<Vec<_>>().join("; "))
            },
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(attempt: u64, step: u64, t: f64, event: &str) -> TrainerLine {
        TrainerLine { job: 7, attempt, alloc: attempt * 10, step, t, event: event.into() }
    }

    fn good() -> Vec<TrainerLine> {
        vec![
            line(1, 0, 1.0, "start"),
            line(1, 5, 2.0, "step"),
            line(1, 5, 2.1, "checkpoint"),
            line(1, 7, 2.5, "step"),
            line(2, 5, 3.0, "restore"),
            line(2, 6, 3.2, "step"),
            line(2, 10, 4.0, "checkpoint"),
            line(3, 10, 5.0, "restore"),
        ]
    }

    #[test]
    fn a_clean_history_passes() {
        assert!(overlaps(&good()).is_empty());
        assert!(step_regressions(&good()).is_empty());
        let a = attempts(&good(), 7);
        assert_eq!(a.len(), 3);
        assert_eq!((a[1].start_step, a[1].restored, a[1].max_step), (5, true, 10));
    }

    #[test]
    fn overlapping_attempts_are_caught() {
        let mut l = good();
        // Attempt 1 still stepping after attempt 2 started.
        l.push(line(1, 8, 3.1, "step"));
        let o = overlaps(&l);
        assert_eq!(o.len(), 1, "{o:?}");
        assert!(o[0].contains("attempt 1") && o[0].contains("attempt 2"), "{o:?}");
    }

    #[test]
    fn steps_going_back_are_caught() {
        // Attempt 3 starts from 0 after attempt 2 had resumed from step 5.
        let mut l = good();
        l.retain(|x| x.attempt != 3);
        l.push(line(3, 0, 5.0, "start"));
        let r = step_regressions(&l);
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(r[0].contains("below the previous attempt's 5"), "{r:?}");
        // A restore of a step nobody checkpointed.
        let mut l = good();
        l.retain(|x| x.attempt != 3);
        l.push(line(3, 9, 5.0, "restore"));
        let r = step_regressions(&l);
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(r[0].contains("no earlier attempt checkpointed"), "{r:?}");
    }

    #[test]
    fn a_torn_last_line_is_skipped() {
        let text = "{\"job\":1,\"attempt\":1,\"alloc\":1,\"step\":0,\"t\":1.0,\"event\":\"start\"}\n{\"job\":1,\"att";
        assert_eq!(parse_trainer_journal(text).len(), 1);
    }

    #[test]
    fn ids_may_be_strings_of_digits() {
        // What the trainer writes: its environment's values as they are.
        let text = r#"{"alloc": "12", "attempt": "3", "event": "restore", "job": "4", "restore_step": "10", "step": 10, "t": 1.5}"#;
        let l = parse_trainer_journal(text);
        assert_eq!(l, [TrainerLine { job: 4, attempt: 3, alloc: 12, step: 10, t: 1.5, event: "restore".into() }]);
    }
}
