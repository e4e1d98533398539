//! Golden scenario tests (issue 2, "What it must show", item 4).
//!
//! Each `tests/golden/*.json` file holds one scheduling pass: a `description`, the input `view`
//! (a `ClusterView`), `now`, `seed`, `config` overrides (any `SchedulerConfig` fields; the rest
//! keep their defaults) and, last, `expect`: the decisions written compactly so a reviewer can
//! check them by hand:
//!
//! - placements: `job 3 g0 r1 -> n1 [gpu4 gpu5]` (a fractional share reads `gpu2=250m`, with a
//!   memory slice `gpu2=250m/8192Mi`; `borrowed` at the end when admitted on borrowed quota);
//! - preemptions: `alloc 7 (job 102 on n1) for job 5: higher_priority, checkpoint first (grace 300s)`
//!   or `..., stop now`;
//! - unplaced: `job 5: <reason, verbatim>`;
//! - reservations: `job 5 at t=3600 on [n1]`.
//!
//! Lists are in the plan's order (placements and preemptions in the order the pass decided them).
//!
//! Blessing: `SUANLI_BLESS=1 cargo test -p suanli-scheduler --test golden` rewrites each file's
//! `expect` from the engine's current output (the input part is left byte for byte as written;
//! `expect` must be the file's last key). A blessed file is not evidence of anything: read every
//! changed decision and confirm it is the right answer before committing it. The expectations in
//! this folder were worked out by hand from the inputs, and each file's `description` says why
//! they are right.

#![allow(
    clippy::disallowed_methods,
    reason = "the golden files are this test's input (clippy.toml bans I/O in the crate)"
)]

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use suanli_model::{DeviceShare, Plan, PreemptionReason};
use suanli_scheduler::{ClusterView, SchedulerConfig, schedule};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    /// What the scenario shows and why the expectation is right.
    #[allow(dead_code)]
    description: Vec<String>,
    now: u64,
    seed: u64,
    #[serde(default)]
    config: serde_json::Value,
    view: ClusterView,
    #[serde(default)]
    expect: Option<Expect>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Expect {
    placements: Vec<String>,
    preemptions: Vec<String>,
    unplaced: Vec<String>,
    reservations: Vec<String>,
}

fn share(s: &DeviceShare) -> String {
    match (s.milli, s.memory_mib) {
        (1000, 0) => s.device.clone(),
        (m, 0) => format!("{}={m}m", s.device),
        (m, mem) => format!("{}={m}m/{mem}Mi", s.device),
    }
}

fn describe(plan: &Plan) -> Expect {
    let placements = plan
        .placements
        .iter()
        .map(|p| {
            let devs: Vec<String> = p.devices.iter().map(share).collect();
            let mut s = format!("job {} g{} r{} -> {} [{}]", p.job, p.group, p.replica, p.node, devs.join(" "));
            if p.borrowed {
                s.push_str(" borrowed");
            }
            s
        })
        .collect();
    let preemptions = plan
        .preemptions
        .iter()
        .map(|p| {
            let reason = match p.reason {
                PreemptionReason::HigherPriority => "higher_priority",
                PreemptionReason::ReclaimBorrowed => "reclaim_borrowed",
            };
            let mut s = format!("alloc {} (job {} on {}) for job {}: {reason}, ", p.alloc, p.job, p.node, p.for_job);
            if p.checkpoint_first {
                let _ = write!(s, "checkpoint first (grace {}s)", p.grace_s);
            } else {
                s.push_str("stop now");
            }
            s
        })
        .collect();
    let unplaced = plan.unplaced.iter().map(|u| format!("job {}: {}", u.job, u.reason)).collect();
    let reservations = plan
        .reservations
        .iter()
        .map(|r| {
            let nodes: Vec<&str> = r.nodes.iter().map(|n| n.as_str()).collect();
            format!("job {} at t={} on [{}]", r.job, r.start_at, nodes.join(", "))
        })
        .collect();
    Expect { placements, preemptions, unplaced, reservations }
}

fn scenario_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/golden exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

/// Replaces (or appends) the file's trailing `"expect"` value, keeping the input text as written.
fn bless(path: &Path, text: &str, got: &Expect) {
    let body = serde_json::to_string_pretty(got).expect("serializable");
    let body = body.replace('\n', "\n  ");
    let head = match text.rfind("\"expect\"") {
        Some(i) => text[..i].trim_end().to_owned(),
        None => {
            let end = text.rfind('}').expect("a JSON object");
            format!("{},", text[..end].trim_end())
        }
    };
    let out = format!("{head}\n  \"expect\": {body}\n}}\n");
    std::fs::write(path, out).expect("writable golden file");
}

#[test]
fn golden_scenarios() {
    let blessing = std::env::var("SUANLI_BLESS").is_ok_and(|v| v == "1");
    let files = scenario_files();
    assert!(files.len() >= 8, "expected the golden scenarios in tests/golden, found {files:?}");
    let mut failures = Vec::new();
    for path in &files {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("?").to_owned();
        let text = std::fs::read_to_string(path).expect("readable golden file");
        let sc: Scenario = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let cfg: SchedulerConfig = if sc.config.is_null() {
            SchedulerConfig::default()
        } else {
            serde_json::from_value(sc.config.clone()).unwrap_or_else(|e| panic!("{name}: config: {e}"))
        };
        let plan = schedule(&sc.view, sc.now, sc.seed, &cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        let again = schedule(&sc.view, sc.now, sc.seed, &cfg).expect("same input");
        assert_eq!(plan, again, "{name}: the same input gave two different plans");
        let got = describe(&plan);
        if blessing {
            if sc.expect.as_ref() != Some(&got) {
                bless(path, &text, &got);
                eprintln!("blessed {name}: review the new expectation by hand");
            }
            continue;
        }
        match &sc.expect {
            None => failures.push(format!("{name}: no \"expect\" yet; run with SUANLI_BLESS=1 and review it")),
            Some(want) if *want != got => failures.push(format!(
                "{name}:\n  expected: {}\n  got:      {}",
                serde_json::to_string_pretty(want).expect("json"),
                serde_json::to_string_pretty(&got).expect("json")
            )),
            Some(_) => {}
        }
    }
    assert!(failures.is_empty(), "golden scenarios differ:\n{}", failures.join("\n"));
}
