//! The cost ledger end to end (docs/cost.md): a real server and an agent with the fake GPU
//! plugin; prices set and reports read through the `suanli` binary; conservation and the
//! categories checked on what a running, checkpointing trainer and idle capacity cost.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;
use suanli_tests as support;
use support::{CkptCluster, NodeSpec, Trainer, cli};

fn suanli(addr: &str, args: &[&str]) -> String {
    // `--server` is a flag of the `cost` command group, so it follows the group's name.
    let out = cli().arg(args[0]).arg("--server").arg(addr).args(&args[1..]).output().expect("suanli runs");
    assert!(out.status.success(), "suanli {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

fn report(addr: &str, by: &str) -> serde_json::Value {
    serde_json::from_str(&suanli(addr, &["cost", "report", "--by", by, "--format", "json"])).expect("json")
}

fn base(v: &serde_json::Value, cat: &str) -> i128 {
    v["base"][cat].as_str().expect("a base amount").parse().expect("an integer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prices_set_and_the_report_conserves() {
    let c = CkptCluster::start(&[NodeSpec::new("n1", "p", 2)]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prices.toml");
    std::fs::write(
        &file,
        "currency = \"USD\"\ncpu_core_hour = \"0.04\"\n[[device]]\nmodel = \"A100-80G\"\nper_hour = \"3.6\"\n",
    )
    .unwrap();
    suanli(&c.addr, &["cost", "prices", "set", "--file", file.to_str().unwrap()]);
    let shown: serde_json::Value =
        serde_json::from_str(&suanli(&c.addr, &["cost", "prices", "show", "--output", "json"])).unwrap();
    assert_eq!(shown["catalog"]["devices"][0]["per_hour"], "3.600000", "{shown}");
    assert_eq!(shown["unpriced_models"].as_array().map(Vec::len), Some(0), "{shown}");

    let id = c.submit(&Trainer { gpus: 1, ..Trainer::new("t") }).await;
    c.wait_job(id, Duration::from_secs(20), "a checkpoint", |j| j.state == "running" && j.latest_checkpoint_step > 0)
        .await;
    let r = report(&c.addr, "job");
    assert_eq!(r["conserved"], true, "{r}");
    let key = id.to_string();
    let row = r["rows"].as_array().unwrap().iter().find(|x| x["key"] == key.as_str()).expect("the job's row");
    assert!(base(row, "running") > 0, "{r}");
    assert!(base(&r["total"], "idle") > 0, "one GPU of two is idle: {r}");
    assert_eq!(r["total"]["base"]["total"], r["capacity_base"], "{r}");

    suanli(&c.addr, &["job", "cancel", &id.to_string()]);
    c.wait_job(id, Duration::from_secs(20), "cancelled", |j| j.state == "cancelled").await;
    // The job is cancelled before its allocation has ended (the task is still stopping); the
    // attempt is classified when the allocation ends.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let r = loop {
        let r = report(&c.addr, "pool");
        if base(&r["total"], "running") == 0 || std::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(r["conserved"], true, "{r}");
    assert_eq!(base(&r["total"], "running"), 0, "{r}");
    assert!(base(&r["total"], "useful") > 0, "a cancelled attempt counts as useful: {r}");
    let csv = suanli(&c.addr, &["cost", "report", "--by", "team", "--format", "csv", "--since", "-1h"]);
    assert!(csv.starts_with("key,useful,lost_preemption,lost_failure,running,idle,total\n"), "{csv}");
    let bad = cli().args(["cost", "--server", &c.addr, "report", "--by", "color"]).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("by"), "{}", String::from_utf8_lossy(&bad.stderr));
}
