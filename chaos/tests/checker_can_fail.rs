//! The checker can fail: servers broken on purpose behind test-only failpoints are caught, and
//! the leader-isolated scenario really sends writes to an isolated leader.
//!
//! Each test runs a real cluster (three `suanli server`, three `suanli agent` processes with the
//! fake plugin) for a few seconds of faults. They need the workspace built
//! (`cargo build --workspace`, which `cargo test --workspace` does) for `target/debug/suanli`
//! and the fake plugin.

use std::sync::Mutex;
use suanli_chaos::{Broken, Options, Report, run_scenario, scenario};

/// One cluster at a time: the machine has two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs a scenario on a runtime of its own, one cluster at a time.
fn run(name: &str, seed: u64, broken: Option<Broken>, duration_ms: u64) -> Report {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(run_async(name, seed, broken, duration_ms))
}

async fn run_async(name: &str, seed: u64, broken: Option<Broken>, duration_ms: u64) -> Report {
    let bin = suanli_chaos::cluster::default_bin().expect("the suanli binary");
    let mut o = Options::new(bin);
    o.duration_ms = duration_ms;
    o.broken = broken;
    o.settle_bound_ms = 30_000;
    let scn = scenario::find(name).expect("scenario");
    let r = run_scenario(scn, seed, &o).await.expect("the harness ran");
    println!("{}\n{}\n{}", suanli_chaos::table_header(), r.row(), r.details());
    r
}

fn verdict(r: &Report, name: &str) -> bool {
    r.verdicts.iter().find(|v| v.name == name).unwrap_or_else(|| panic!("no verdict {name}")).ok
}

#[test]
fn one_device_share_handed_to_two_tasks_is_caught_as_an_over_commit() {
    let r = run("leader-kill", 11, Some(Broken::DoubleAssign), 6_000);
    assert!(r.over_commits > 0, "the double assignment went unnoticed");
    assert!(!verdict(&r, "no over-commit"));
    assert!(!r.ok());
    // The rest of the cluster behaves: only the broken invariant fails.
    assert!(verdict(&r, "acknowledged writes") && verdict(&r, "convergence") && verdict(&r, "log agreement"));
}

#[test]
fn acknowledging_without_fsync_is_caught_as_lost_writes_after_a_power_loss() {
    let r = run("power-loss", 3, Some(Broken::SkipFsync), 6_000);
    assert!(r.lost > 0, "acknowledged writes lost in the power loss went unnoticed");
    assert!(!verdict(&r, "acknowledged writes"));
    // Nothing more is promised: servers that forget what they acknowledged may also forget
    // their votes, so two leaders of one term, and logs that disagree, are possible too (the
    // convergence and log agreement checks may fail as well, depending on the seed).
}

#[test]
fn an_isolated_leader_acknowledges_nothing_and_loses_nothing() {
    let r = run("leader-isolated", 5, None, 8_000);
    assert!(r.isolations > 0, "no isolation happened");
    assert!(r.isolated_writes > 0, "no client wrote to the isolated leader, so nothing was tested");
    assert!(verdict(&r, "isolated leader"));
    assert_eq!(r.lost, 0);
    assert!(r.ok(), "{}", r.details());
}

#[test]
fn a_poison_proposal_let_through_is_caught_as_a_cluster_no_longer_writable() {
    let r = run("hostile-client", 13, Some(Broken::ForwardUnchecked), 6_000);
    let v = r.verdicts.iter().find(|v| v.name == "stays writable").expect("the hostile scenario checks it");
    assert!(!v.ok, "a poison entry in the log went unnoticed: {}", v.detail);
    assert!(v.detail.contains("halted"), "the halt is named: {}", v.detail);
    assert!(v.detail.contains("answered OK"), "the accepted poison is named: {}", v.detail);
    // The servers halted read-only; none died, and they still agree with each other.
    assert!(!v.detail.contains("exited"), "{}", v.detail);
    assert!(verdict(&r, "convergence") && verdict(&r, "log agreement"));
}
