//! The conformance kit as a library (`check::run`), on the C example and a crashing variant; the
//! command-line side is tested by the workspace's end-to-end crate (`tests/tests/plugin_check.rs`).

use std::path::{Path, PathBuf};

use suanli_device_host::check::{self, CheckOptions, Outcome, Report};
use suanli_device_host::pb;

const HOST: &str = env!("CARGO_BIN_EXE_suanli-plugin-host");

fn build_example(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    suanli_device_host::testing::build_c_example(dir, name, defines).unwrap_or_else(|e| panic!("{e}"))
}

async fn run(lib: &Path) -> (Report, Vec<String>) {
    let opts = CheckOptions::new(vec![HOST.into()], pb::PluginConfig::default());
    let mut lines = Vec::new();
    let report = check::run(lib, opts, &mut |r| lines.push(r.to_string())).await;
    (report, lines)
}

fn outcome(r: &Report, name: &str) -> Outcome {
    r.checks.iter().find(|c| c.name == name).map(|c| c.outcome).unwrap_or_else(|| panic!("no check {name}: {r:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_conforms_and_a_crashing_variant_does_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (r, lines) = run(&build_example(dir.path(), "example", &[])).await;
    assert!(r.ok(), "{}", lines.join("\n"));
    assert_eq!((r.passed, r.failed, r.skipped), (13, 0, 0), "{}", lines.join("\n"));
    assert_eq!(r.summary(), "13 passed, 0 failed");
    assert!(lines.iter().all(|l| l.starts_with("PASS ")), "{}", lines.join("\n"));

    let (r, lines) = run(&build_example(dir.path(), "minor0", &["-DEXAMPLE_ABI_MINOR=0"])).await;
    assert!(r.ok(), "{}", lines.join("\n"));
    assert_eq!(outcome(&r, "health_events"), Outcome::Skip);

    let (r, lines) = run(&build_example(dir.path(), "segv", &["-DEXAMPLE_CRASH=segv"])).await;
    eprintln!("{}", lines.join("\n"));
    assert!(!r.ok());
    for failed in ["fingerprint", "fingerprint stable", "concurrent calls", "no crashes"] {
        assert_eq!(outcome(&r, failed), Outcome::Fail, "{failed}: {}", lines.join("\n"));
    }
    for passed in
        ["load", "init", "reserve unknown device", "stats", "health_events", "repeated calls", "deadlines", "shutdown"]
    {
        assert_eq!(outcome(&r, passed), Outcome::Pass, "{passed}: {}", lines.join("\n"));
    }
    assert!(lines.iter().any(|l| l.starts_with("FAIL fingerprint: ") && l.contains("SIGSEGV")), "{}", lines.join("\n"));

    let (r, lines) = run(&build_example(dir.path(), "major2", &["-DEXAMPLE_ABI_MAJOR=2"])).await;
    assert_eq!((r.passed, r.failed), (0, 1));
    assert!(lines[0].contains("implements device plugin ABI 2.1; this agent implements ABI 1.1"), "{lines:?}");
}
