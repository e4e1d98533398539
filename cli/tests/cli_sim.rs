//! The `suanli` binary on good and bad input: bad input gets an error naming the file, line,
//! field and limit, a non-zero exit, and never a panic.

use std::path::Path;
use std::process::{Command, Output};

fn suanli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_suanli")).args(args).output().expect("run suanli")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p.display().to_string()
}

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,8,V100M32\nn1,32000,131072,2,T4\n";
const PODS: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
p0,8000,16384,1,500,\np1,4000,8192,1,250,T4\np2,16000,65536,2,1000,V100M32\np3,2000,4096,0,0,\n";

fn assert_clean_failure(o: &Output, needle: &str) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {e}");
    assert!(e.contains(needle), "stderr should contain {needle:?}: {e}");
    assert!(!e.contains("panicked"), "must not panic: {e}");
}

#[test]
fn fill_runs_every_policy_and_prints_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (n, p) = (write(dir.path(), "n.csv", NODES), write(dir.path(), "p.csv", PODS));
    let svg = dir.path().join("c.svg");
    let o = suanli(&[
        "sim",
        "fill",
        "--nodes",
        &n,
        "--pods",
        &p,
        "--policy",
        "all",
        "--seeds",
        "1-3",
        "--format",
        "json",
        "--svg",
        &svg.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let arr = v.as_array().expect("array of policy summaries");
    assert_eq!(arr.len(), 7);
    for s in arr {
        assert_eq!(s["seeds"].as_array().map(Vec::len), Some(3));
        let at130 = s["alloc_at_130"].as_f64().expect("alloc_at_130");
        assert!((0.0..=100.0).contains(&at130));
        // Only the default rehearses its tie rule, once per run.
        let rehearsed = &s["rehearsed_by_kind"];
        if s["policy"] == "suanli" {
            let (k, n) = (rehearsed[0].as_u64().expect("by-kind runs"), rehearsed[1].as_u64().expect("runs"));
            assert!(n == 3 && k <= n, "{s}");
        } else {
            assert!(rehearsed.is_null(), "{s}");
        }
    }
    let chart = std::fs::read_to_string(&svg).expect("svg written");
    assert!(chart.starts_with("<svg") && chart.contains("polyline"));
}

#[test]
fn bad_input_is_named_not_panicked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let n = write(dir.path(), "n.csv", NODES);
    let p = write(dir.path(), "p.csv", PODS);

    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &p, "--policy", "bestfit,magic"]);
    assert_clean_failure(&o, "unknown policy \"magic\"");
    assert!(stderr(&o).contains("suanli, fgd, bestfit"));

    let neg = write(dir.path(), "neg.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,-1,10,0,0\n");
    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &neg]);
    assert_clean_failure(&o, "line 2: field \"cpu_milli\"");

    let absurd = write(dir.path(), "absurd.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,10,1000,1000\n");
    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &absurd]);
    assert_clean_failure(&o, "field \"num_gpu\": 1000 exceeds the limit of 64");

    let truncated =
        write(dir.path(), "trunc.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,10,1,1000\np1,1,10\n");
    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &truncated]);
    assert_clean_failure(&o, "line 3");

    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &dir.path().join("missing.csv").display().to_string()]);
    assert_clean_failure(&o, "missing.csv");

    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &p, "--seeds", "9-3"]);
    assert_clean_failure(&o, "--seeds");

    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &p, "--inflate", "0"]);
    assert_clean_failure(&o, "inflate");

    let o = suanli(&["sim", "fill", "--nodes", &n, "--pods", &p, "--rehearsal-runs", "65"]);
    assert_clean_failure(&o, "--rehearsal-runs: 65 is over the limit of 64");

    let o = suanli(&["sim", "fill", "--synthetic-suite", "draws"]);
    assert_clean_failure(&o, "--synthetic-suite draws needs --draws SEEDS");
    let o = suanli(&["sim", "fill", "--synthetic-suite", "draws", "--draws", "1-101"]);
    assert_clean_failure(&o, "--draws: range 1-101 must be ascending and hold at most 100 seeds");
    let o = suanli(&["sim", "fill", "--synthetic-suite", "held-out", "--draws", "7"]);
    assert_clean_failure(&o, "--draws is for --synthetic-suite draws");

    let o = suanli(&["bench", "engine", "--nodes", "0"]);
    assert_clean_failure(&o, "--nodes");
}

/// `--compare-victim-orders` replays twice in one process. Two equal low-priority jobs hold the
/// node's two GPUs; a high-priority job arrives at t=1000. `old` (started at 0) checkpointed at
/// 900, `young` (started at 500) at 800: checkpoint-aware stops `old` (≈100 s lost),
/// youngest-first stops `young` (≈200 s lost), so the ratio is about 2.
#[test]
fn replay_compares_victim_orders_in_one_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let n = write(dir.path(), "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,V100M32\n");
    let p = write(
        dir.path(),
        "p.csv",
        "name,arrival_s,duration_s,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,queue,priority,replicas\n\
         old,0,10000,1000,1024,1,1000,,default,0,1\n\
         young,500,10000,1000,1024,1,1000,,default,0,1\n\
         high,1000,100,1000,1024,1,1000,,default,10,1\n",
    );
    let args = ["sim", "replay", "--nodes", &n, "--pods", &p, "--checkpoint-interval-s", "300", "--quiet"];
    let o = suanli(&[&args[..], &["--compare-victim-orders", "--format", "json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let ratio = v["lost_gpu_hours_ratio_youngest_first_to_checkpoint_aware"].as_f64().expect("ratio");
    assert!((1.8..=2.1).contains(&ratio), "ratio {ratio}: {v}");
    assert_eq!(v["checkpoint_aware"]["preemptions"], 1);
    assert_eq!(v["youngest_first"]["preemptions"], 1);
    let o = suanli(&[&args[..], &["--compare-victim-orders"]].concat());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("GPU-hours lost, youngest-first / checkpoint-aware: "), "{out}");

    // One order alone, arrivals compressed (everything at t=0: nothing to preempt).
    let o = suanli(&[&args[..], &["--victim-order", "youngest-first", "--compress-arrivals", "100000"]].concat());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("(0 preemption(s)"), "{out}{}", stderr(&o));

    let o = suanli(&[&args[..], &["--victim-order", "oldest"]].concat());
    assert_clean_failure(
        &o,
        "--victim-order: unknown order \"oldest\"; valid orders: checkpoint-aware, youngest-first",
    );
    let o = suanli(&[&args[..], &["--qos-priority", "LS"]].concat());
    assert_clean_failure(&o, "--qos-priority: \"LS\" is not CLASS=PRIORITY");
    let o = suanli(&[&args[..], &["--compress-arrivals", "0"]].concat());
    assert_clean_failure(&o, "--compress-arrivals: 0 must be between 1 and 1000000");
    let o = suanli(&[&args[..], &["--node-stride", "0"]].concat());
    assert_clean_failure(&o, "--node-stride");
}
