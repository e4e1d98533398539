//! `suanli plugin check` (the vendor's conformance kit) on real libraries: the C example built by
//! the system C compiler (and its version and fault variants), and the shipped Rust plugins.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

fn build_example(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    suanli_device_host::testing::build_c_example(dir, name, defines).unwrap_or_else(|e| panic!("{e}"))
}

fn check(lib: &Path, extra: &[&str]) -> (Output, String, String) {
    let out = Command::new(suanli_tests::bin())
        .args(["plugin", "check"])
        .arg(lib)
        .args(extra)
        .output()
        .expect("run suanli plugin check");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

fn assert_passes(lib: &Path, extra: &[&str]) -> String {
    let (out, stdout, stderr) = check(lib, extra);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed") && !stdout.contains("FAIL "),
        "plugin check {} failed ({}):\n{stdout}\n{stderr}",
        lib.display(),
        out.status
    );
    for name in [
        "load",
        "init",
        "fingerprint",
        "fingerprint stable",
        "reserve unknown device",
        "stats",
        "repeated calls",
        "concurrent calls",
        "deadlines",
        "no crashes",
        "shutdown",
    ] {
        assert!(stdout.contains(&format!("PASS {name} (")), "no PASS {name}:\n{stdout}");
    }
    stdout
}

#[test]
fn c_example_passes_the_conformance_kit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = build_example(dir.path(), "suanli_plugin_example", &[]);
    let stdout = assert_passes(&lib, &["--option", "color=blue"]);
    assert!(stdout.contains("PASS reserve (") && stdout.contains("PASS health_events ("), "{stdout}");
    assert!(stdout.contains("plugin example 0.1.0, ABI 1.3"), "{stdout}");

    // --json: one machine-readable report.
    let (out, stdout, _) = check(&lib, &["--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(v["failed"], 0);
    assert_eq!(v["plugin"]["abi"], "1.3");
    assert!(v["checks"].as_array().is_some_and(|c| c.len() >= 12), "{v}");
}

#[test]
fn newer_major_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = build_example(dir.path(), "major2", &["-DEXAMPLE_ABI_MAJOR=2"]);
    let (out, stdout, stderr) = check(&lib, &[]);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("FAIL load: plugin example 0.1.0 implements device plugin ABI 2.3; this agent implements ABI 1.3 (major versions must match)"),
        "{stdout}\n{stderr}"
    );
    assert!(stdout.contains("0 passed, 1 failed"), "{stdout}");
}

#[test]
fn older_minor_passes_without_health_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = build_example(dir.path(), "minor0", &["-DEXAMPLE_ABI_MINOR=0"]);
    let stdout = assert_passes(&lib, &[]);
    assert!(stdout.contains("plugin example 0.1.0, ABI 1.0"), "{stdout}");
    assert!(stdout.contains("SKIP health_events: not offered (an ABI 1.0 plugin)"), "{stdout}");
}

#[test]
fn crashing_and_hanging_plugins_fail_checks_without_killing_the_checker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let segv = build_example(dir.path(), "segv", &["-DEXAMPLE_CRASH=segv", "-DEXAMPLE_CHATTY"]);
    let (out, stdout, stderr) = check(&segv, &[]);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stdout.contains("FAIL fingerprint: ") && stdout.contains("signal 11 (SIGSEGV)"), "{stdout}");
    assert!(stdout.contains("FAIL no crashes: "), "{stdout}");
    // Calls that do not crash still pass once the host has been restarted.
    assert!(stdout.contains("PASS stats ("), "{stdout}");
    assert!(stdout.lines().last().is_some_and(|l| l.contains(" failed") && !l.contains(" 0 failed")), "{stdout}");
    assert!(stderr.contains("does not conform"), "{stderr}");

    let hang = build_example(dir.path(), "hang", &["-DEXAMPLE_CRASH=hang"]);
    let (out, stdout, stderr) = check(&hang, &["--fingerprint-timeout-ms", "300", "--repeats", "10"]);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("FAIL fingerprint: device plugin call example.fingerprint got no reply within 300ms"),
        "{stdout}"
    );
    assert!(stdout.contains("FAIL deadlines: "), "{stdout}");
}

#[test]
fn unusable_files_are_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let junk = dir.path().join("libjunk.so");
    std::fs::write(&junk, b"not a library").expect("write");
    std::fs::set_permissions(&junk, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let (out, stdout, _) = check(&junk, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stdout.contains("FAIL load: plugin library") && stdout.contains("cannot load"), "{stdout}");

    // A group-writable library: the agent would refuse it, the kit warns and goes on.
    let lib = build_example(dir.path(), "loose", &[]);
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o775)).expect("chmod");
    let (out, stdout, stderr) = check(&lib, &["--repeats", "5"]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("WARN") && stderr.contains("writable by group or others"), "{stderr}");

    let (out, _, stderr) = check(&lib, &["--option", "novalue"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr.contains("KEY=VALUE"), "{stderr}");
}

/// The shipped Rust plugins, as built by `cargo build --workspace` next to this binary.
#[test]
fn shipped_rust_plugins_pass_the_conformance_kit() {
    let bin_dir = &suanli_tests::target_dir();
    let mut missing = Vec::new();
    for name in ["cpu", "fake"] {
        let lib = bin_dir.join(format!("libsuanli_plugin_{name}.so"));
        if !lib.exists() {
            missing.push(lib.display().to_string());
            continue;
        }
        let mut extra = Vec::new();
        // The fake plugin reads its devices from a file; its fault file is pointed at a path
        // that does not exist, so that no fault left next to the example config can interfere.
        let cfg = repo_root().join("examples/plugins/fake-8gpu.toml").display().to_string();
        let dir = tempfile::tempdir().expect("tempdir");
        let no_faults = format!("fault_file={}", dir.path().join("none.faults.toml").display());
        if name == "fake" {
            extra.extend(["--config", cfg.as_str(), "--option", no_faults.as_str()]);
        }
        let stdout = assert_passes(&lib, &extra);
        assert!(stdout.contains("PASS load (") && stdout.contains(&format!("plugin {name} ")), "{stdout}");
    }
    assert!(
        missing.is_empty(),
        "not built: {missing:?}; run `cargo build --workspace` before this test (cargo test does not build other packages' cdylibs)"
    );
}

/// The vendor plugins load and pass the kit on a machine without their vendor library (as
/// this one): zero devices, and the reason said clearly.
#[test]
fn vendor_plugins_report_not_available_cleanly() {
    let bin_dir = &suanli_tests::target_dir();
    for (name, needle) in [("nvidia", "NVML not available"), ("ascend", "DCMI library not available")] {
        let lib = bin_dir.join(format!("libsuanli_plugin_{name}.so"));
        assert!(lib.exists(), "not built: {}; run `cargo build --workspace` first", lib.display());
        let (out, stdout, stderr) = check(&lib, &[]);
        assert!(
            out.status.success() && stdout.contains(" passed, 0 failed"),
            "plugin check {name} failed:\n{stdout}\n{stderr}"
        );
        assert!(stdout.contains("0 devices") || stdout.contains("no devices"), "{name}: {stdout}");
        let all = format!("{stdout}{stderr}");
        assert!(all.contains(needle), "{name} should say {needle:?}:\n{all}");
        assert!(!all.contains("panicked"), "{all}");
    }
}

/// `suanli plugin new --lang c`: the scaffold builds with its own Makefile (protoc-c on the
/// schema copy it carries, outside cargo) and passes the kit; only the entry point is exported.
#[test]
fn plugin_new_c_builds_with_make_and_passes_the_kit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("mynpu");
    let st = Command::new(suanli_tests::bin())
        .args(["plugin", "new", "--lang", "c", "mynpu", "--dir"])
        .arg(&out)
        .output()
        .expect("run suanli plugin new");
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    for f in ["plugin.c", "Makefile", "include/suanli_device_plugin.h", "include/suanli_device.proto", "README.md"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let make = Command::new("make").arg("-s").arg("-C").arg(&out).output().expect("make");
    assert!(
        make.status.success(),
        "{}{}",
        String::from_utf8_lossy(&make.stdout),
        String::from_utf8_lossy(&make.stderr)
    );
    let lib = out.join("build/libsuanli_plugin_mynpu.so");
    let stdout = assert_passes(&lib, &[]);
    assert!(stdout.contains("plugin mynpu 0.1.0, ABI 1.3"), "{stdout}");
    assert!(stdout.contains("PASS exported symbols (") && stdout.contains("PASS reserve and release ("), "{stdout}");

    // A second scaffold into a non-empty directory, and a bad name, are refused.
    let again = Command::new(suanli_tests::bin())
        .args(["plugin", "new", "--lang", "c", "mynpu", "--dir"])
        .arg(&out)
        .output()
        .expect("run");
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("not empty"));
    let bad = Command::new(suanli_tests::bin()).args(["plugin", "new", "--lang", "c", "My-NPU"]).output().expect("run");
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("1 to 32 of a-z"));
}

/// `suanli plugin new --lang rust`: the scaffold builds with cargo against this checkout's
/// suanli-device-abi and passes the kit. Its own target directory under target/ keeps reruns
/// incremental; the workspace's Cargo.lock pins the same crate versions.
#[test]
fn plugin_new_rust_builds_with_cargo_and_passes_the_kit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("mynpu");
    let st = Command::new(suanli_tests::bin())
        .args(["plugin", "new", "--lang", "rust", "mynpu", "--dir"])
        .arg(&out)
        .output()
        .expect("run suanli plugin new");
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    std::fs::copy(repo_root().join("Cargo.lock"), out.join("Cargo.lock")).expect("copy Cargo.lock");
    let target = suanli_tests::target_dir().parent().expect("target/").join("plugin-scaffold");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let build = Command::new(cargo)
        .args(["build", "--quiet"])
        .current_dir(&out)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CLIPPY_ARGS")
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo build of the scaffold");
    assert!(build.status.success(), "{}", String::from_utf8_lossy(&build.stderr));
    let lib = target.join("debug/libsuanli_plugin_mynpu.so");
    let local = dir.path().join("libsuanli_plugin_mynpu.so");
    std::fs::copy(&lib, &local).expect("copy the library");
    std::fs::set_permissions(&local, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let stdout = assert_passes(&local, &[]);
    assert!(stdout.contains("plugin mynpu 0.1.0, ABI 1.3"), "{stdout}");
    assert!(stdout.contains("PASS exported symbols (") && stdout.contains("PASS reserve and release ("), "{stdout}");
}

/// The kit's messages name the cause, through the command line: a leak, a lying minor version,
/// stdout writes (a warning).
#[test]
fn the_kit_fails_a_leak_and_a_lying_minor_and_warns_of_stdout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let leak = build_example(dir.path(), "leak", &["-DEXAMPLE_LEAK"]);
    let (out, stdout, _) = check(&leak, &[]);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("FAIL resources: host RSS") && stdout.contains("memory grows with every call"), "{stdout}");

    let lying = build_example(dir.path(), "lying", &["-DEXAMPLE_LYING_MINOR"]);
    let (out, stdout, _) = check(&lying, &["--repeats", "10"]);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("FAIL table size: abi_minor says 1.3 but struct_size"), "{stdout}");

    let chatty = build_example(dir.path(), "chatty", &["-DEXAMPLE_CHATTY"]);
    let (out, stdout, _) = check(&chatty, &["--repeats", "10"]);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("WARN stdout: the plugin wrote") && stdout.contains(", 1 warned"), "{stdout}");
}
