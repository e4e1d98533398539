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
    assert_eq!((r.passed, r.failed, r.skipped, r.warned), (23, 0, 1, 0), "{}", lines.join("\n"));
    assert_eq!(r.summary(), "23 passed, 0 failed, 1 skipped");
    // The only skip: no health event turned a device unhealthy (EXAMPLE_HEALTH_FLIP does, below).
    assert!(
        lines.iter().all(|l| l.starts_with("PASS ") || l.starts_with("SKIP health scenario: ")),
        "{}",
        lines.join("\n")
    );
    for name in [
        "table size",
        "exported symbols",
        "reserve empty",
        "reserve several",
        "reserve and release",
        "reset",
        "stats unknown device",
        "resources",
        "stdout",
        "host restart",
    ] {
        assert_eq!(outcome(&r, name), Outcome::Pass, "{name}: {}", lines.join("\n"));
    }

    let (r, lines) = run(&build_example(dir.path(), "minor0", &["-DEXAMPLE_ABI_MINOR=0"])).await;
    assert!(r.ok(), "{}", lines.join("\n"));
    assert_eq!(outcome(&r, "health_events"), Outcome::Skip);
    assert_eq!(outcome(&r, "reserve and release"), Outcome::Skip);
    let (r, lines) = run(&build_example(dir.path(), "minor1", &["-DEXAMPLE_ABI_MINOR=1"])).await;
    assert!(r.ok(), "{}", lines.join("\n"));
    assert_eq!(outcome(&r, "health_events"), Outcome::Pass);
    assert!(
        lines.iter().any(|l| l == "SKIP reserve and release: release not offered (an ABI 1.1 plugin: its reserve is stateless)"),
        "{}",
        lines.join("\n")
    );

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
    assert!(lines[0].contains("implements device plugin ABI 2.3; this agent implements ABI 1.3"), "{lines:?}");
}

fn line<'a>(lines: &'a [String], prefix: &str) -> &'a str {
    lines.iter().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no line {prefix:?}:\n{}", lines.join("\n")))
}

/// The kit's resource, version, symbol and stdout checks, each against a plugin that breaks
/// exactly that rule; and the health scenario against one that reports an XID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kit_names_each_cause() {
    let dir = tempfile::tempdir().expect("tempdir");

    // 1 MiB leaked per call: the host's RSS grows by hundreds of MiB over the repeated calls.
    let (r, lines) = run(&build_example(dir.path(), "leak", &["-DEXAMPLE_LEAK"])).await;
    assert!(!r.ok());
    assert_eq!(outcome(&r, "resources"), Outcome::Fail, "{}", lines.join("\n"));
    let l = line(&lines, "FAIL resources: ");
    assert!(l.contains("memory grows with every call") && l.contains("host RSS"), "{l}");

    // abi_minor 2 with a 1.0-sized table.
    let (r, lines) = run(&build_example(dir.path(), "lying", &["-DEXAMPLE_LYING_MINOR"])).await;
    assert!(!r.ok());
    let l = line(&lines, "FAIL table size: ");
    assert!(l.contains("abi_minor says 1.3 but struct_size") && l.contains("covers only the ABI 1.0 table"), "{l}");
    assert_eq!(outcome(&r, "health_events"), Outcome::Skip);

    // Writes to stdout and exports a second symbol: warnings, not failures.
    let (r, lines) = run(&build_example(dir.path(), "chatty", &["-DEXAMPLE_CHATTY", "-DEXAMPLE_EXTRA_EXPORT"])).await;
    assert!(r.ok(), "{}", lines.join("\n"));
    assert_eq!(r.warned, 2, "{}", lines.join("\n"));
    let l = line(&lines, "WARN stdout: ");
    assert!(l.contains("bytes to stdout"), "{l}");
    let l = line(&lines, "WARN exported symbols: ");
    assert!(l.contains("example_debug_dump") && l.contains("-fvisibility=hidden"), "{l}");
    assert!(r.summary().contains(", 2 warned"), "{}", r.summary());

    // An XID on example1: fingerprint shows it, reserve refuses it.
    let (r, lines) = run(&build_example(dir.path(), "flip", &["-DEXAMPLE_HEALTH_FLIP"])).await;
    assert!(r.ok(), "{}", lines.join("\n"));
    let l = line(&lines, "PASS health scenario ");
    assert!(l.contains("example1 unhealthy") && l.contains("failed_precondition"), "{l}");

    // init UNAVAILABLE: the kit fails it and says what the agent would do.
    let gate = dir.path().join("driver-loaded");
    let flag = format!("-DEXAMPLE_INIT_UNAVAILABLE={}", gate.display());
    let (r, lines) = run(&build_example(dir.path(), "late", &[flag.as_str()])).await;
    assert!(!r.ok());
    let l = line(&lines, "FAIL init: ");
    assert!(l.contains("unavailable") && l.contains("the agent retries an UNAVAILABLE init with backoff"), "{l}");
}

/// The agent's side of a late driver: init UNAVAILABLE is retried with backoff until it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_init_is_retried_until_the_driver_is_there() {
    use suanli_device_host::supervisor::{Options, PluginProcess};
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("driver-loaded");
    let flag = format!("-DEXAMPLE_INIT_UNAVAILABLE={}", gate.display());
    let lib = build_example(dir.path(), "late", &[flag.as_str()]);
    let opts = Options {
        host_cmd: vec![HOST.into()],
        backoff_min: std::time::Duration::from_millis(20),
        backoff_max: std::time::Duration::from_millis(200),
        ..Options::default()
    };
    let p = PluginProcess::start(lib.clone(), pb::PluginConfig::default(), opts.clone())
        .await
        .expect("start: Down, not refused");
    assert!(!p.is_up());
    let mut states = p.subscribe();
    let reason = states
        .wait_for(|s| matches!(s, suanli_device_host::supervisor::PluginState::Down { reason } if reason.contains("not loaded yet")))
        .await
        .map(|s| format!("{:?}", *s))
        .expect("down with the plugin's reason");
    assert!(reason.contains("unavailable"), "{reason}");
    assert!(!p.wait_up(std::time::Duration::from_millis(300)).await, "up before the driver is there");
    std::fs::write(&gate, b"").expect("the driver appears");
    assert!(p.wait_up(std::time::Duration::from_secs(10)).await, "not up after the driver appeared");
    assert_eq!(p.fingerprint().await.expect("fingerprint").devices.len(), 2);
    p.shutdown().await;

    // Without the retry (the kit's choice), start fails and names the cause.
    std::fs::remove_file(&gate).expect("rm");
    let e = PluginProcess::start(lib, pb::PluginConfig::default(), Options { retry_unavailable_init: false, ..opts })
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("not loaded yet"), "{e}");
}
