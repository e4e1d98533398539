//! The harness of suanli's cross-crate end-to-end suites (`tests/tests/*.rs`): everything is
//! real — `suanli server` processes ([`ProcessCluster`], from `suanli-server`'s `testing`
//! feature), `suanli agent` processes ([`AgentProc`]) with the fake device plugin's `.so` in a
//! private plugin directory, `suanli dev`, the CLI, and tasks that are `/bin/sh` processes.
//!
//! ```text
//!  tests/tests/<suite>.rs ──▶ suanli_tests::{bin, cluster, AgentProc, submit, wait_*, ...}
//!                               ├─ spawns target/debug/suanli (or $SUANLI_BIN): server | agent | dev | CLI
//!                               └─ copies target/debug/libsuanli_plugin_fake.so into each agent's plugin dir
//! ```
//!
//! Tests outside the `suanli` package cannot ask cargo for the binary (`CARGO_BIN_EXE_*` exists
//! only in the package that defines it), so the harness looks next to the test executable, as
//! the chaos harness does: run `cargo build --workspace` first (scripts/test.sh does). Each
//! crate's own unit, property and conformance tests stay in that crate; only suites that need
//! several crates' artifacts at once live here.
//!
//! Every link is mutual TLS with the process's local PKI (`suanli_server::local::LocalPki`):
//! servers get the server certificate, agents their node's ([`AgentProc`] writes `[tls]`),
//! gRPC helpers dial as its admin ([`channel`]), and CLI commands get the admin's files through
//! `SUANLI_CA`/`SUANLI_CERT`/`SUANLI_KEY` ([`cli`], [`admin_env`]).
//!
//! This is test code: a helper that cannot do its job panics with what it was doing, which
//! fails the test that called it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod agents;
pub mod checkpoints;
pub mod dev;
pub mod federation;
pub mod http;
pub mod servers;

pub use agents::*;
pub use checkpoints::*;
pub use servers::*;

use std::path::PathBuf;
use std::process::Command;
pub use suanli_server::local::LocalPki;

/// Gives `cmd` (a CLI command of the binary under test) the local PKI's admin credentials
/// (`SUANLI_CA`, `SUANLI_CERT`, `SUANLI_KEY`), and removes the other credential variables the
/// test's own environment may hold.
pub fn admin_env(cmd: &mut Command) -> &mut Command {
    let admin = LocalPki::get().admin();
    cmd.env("SUANLI_CA", &admin.ca)
        .env("SUANLI_CERT", &admin.cert)
        .env("SUANLI_KEY", &admin.key)
        .env_remove("SUANLI_TOKEN")
        .env_remove("SUANLI_INSECURE")
        .env_remove("SUANLI_TLS_DIR")
}

/// A CLI command of the binary under test, as the local PKI's admin ([`admin_env`]).
pub fn cli() -> Command {
    let mut c = Command::new(bin());
    admin_env(&mut c);
    c
}

/// The directory holding the workspace's build outputs for the test executable that runs
/// (`target/debug`; test executables live in `target/debug/deps`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let mut dir = exe.parent().expect("the test executable has a directory").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// The `suanli` binary under test: `$SUANLI_BIN` when set, else `suanli` in [`target_dir`].
/// Panics when it is missing, saying how to build it.
pub fn bin() -> PathBuf {
    if let Some(b) = std::env::var_os("SUANLI_BIN") {
        let b = PathBuf::from(b);
        assert!(b.is_file(), "SUANLI_BIN={} is not a file", b.display());
        return b;
    }
    let b = target_dir().join("suanli");
    assert!(
        b.is_file(),
        "{} is missing: run `cargo build --workspace` first (or set SUANLI_BIN to a suanli binary)",
        b.display()
    );
    b
}
