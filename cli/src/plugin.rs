//! `suanli plugin check LIB.so` (the conformance kit) and the hidden `suanli plugin-host LIB.so`
//! (one plugin library hosted in a child process of the agent).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use suanli_device_host::check::{self, CheckOptions};
use suanli_device_host::{host, pb, process};

/// `suanli plugin ...`.
#[derive(clap::Args, Debug)]
pub struct PluginArgs {
    #[command(subcommand)]
    cmd: PluginCmd,
}

#[derive(clap::Subcommand, Debug)]
enum PluginCmd {
    /// Load a plugin library in a plugin-host child and run every call with deadlines: load and
    /// version negotiation, init, fingerprint, reserve, stats, health_events, repeated and
    /// concurrent calls, shutdown. Prints PASS/FAIL per check; exits non-zero on any failure.
    Check(CheckArgs),
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    /// The shared library.
    lib: PathBuf,
    /// A plugin configuration file, passed to init as `PluginConfig.config_path`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A plugin option `KEY=VALUE`, passed to init in `PluginConfig.options` (repeatable).
    #[arg(long = "option", value_name = "KEY=VALUE", value_parser = parse_option)]
    options: Vec<(String, String)>,
    /// The node id passed to init.
    #[arg(long, default_value = "plugin-check")]
    node_id: String,
    /// Deadline of each call but fingerprint and init, in milliseconds.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    call_timeout_ms: u64,
    /// Deadline of fingerprint and init, in milliseconds.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    fingerprint_timeout_ms: u64,
    /// How many times the repeated-calls check calls each method.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    repeats: u64,
    /// Concurrent callers in the concurrency check.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
    threads: u64,
    /// Print one JSON report on stdout instead of lines.
    #[arg(long)]
    json: bool,
}

fn parse_option(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE with a non-empty KEY")),
    }
}

/// `suanli plugin-host LIB.so`.
#[derive(clap::Args, Debug)]
pub struct PluginHostArgs {
    /// The shared library.
    pub lib: PathBuf,
}

/// Runs `suanli plugin ...`.
pub fn run(a: PluginArgs) -> anyhow::Result<()> {
    match a.cmd {
        PluginCmd::Check(c) => check_cmd(c),
    }
}

fn check_cmd(a: CheckArgs) -> anyhow::Result<()> {
    // The agent refuses a library others could replace; the kit only warns (a vendor's build
    // directory is often group-writable).
    if let Err(e) = host::check_file_permissions(&a.lib) {
        eprintln!("WARN {e} (the agent refuses such a file)");
    }
    let mut options = BTreeMap::new();
    for (k, v) in a.options {
        if options.insert(k.clone(), v).is_some() {
            anyhow::bail!("--option {k} is given twice");
        }
    }
    let config = pb::PluginConfig {
        node_id: a.node_id,
        config_path: a.config.map(|p| p.display().to_string()).unwrap_or_default(),
        options: options.into_iter().collect(),
    };
    let exe = std::env::current_exe().context("cannot find the suanli executable to run plugin-host")?;
    let mut opts = CheckOptions::new(vec![exe.into_os_string(), OsString::from("plugin-host")], config);
    opts.host.call_timeout = Duration::from_millis(a.call_timeout_ms);
    opts.host.fingerprint_timeout = Duration::from_millis(a.fingerprint_timeout_ms);
    opts.repeats = usize::try_from(a.repeats).context("--repeats")?;
    opts.threads = usize::try_from(a.threads).context("--threads")?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let json = a.json;
    if !json {
        println!(
            "checking {} against device plugin ABI {}.{}",
            a.lib.display(),
            suanli_device_host::ABI_MAJOR,
            suanli_device_host::ABI_MINOR
        );
    }
    let report = rt.block_on(check::run(&a.lib, opts, &mut |r| {
        if !json {
            println!("{r}");
        }
    }));
    if json {
        println!("{}", serde_json::to_string_pretty(&report).context("cannot encode the report")?);
    } else {
        println!("{}", report.summary());
    }
    if report.ok() {
        Ok(())
    } else {
        anyhow::bail!("plugin {} does not conform: {}", a.lib.display(), report.summary())
    }
}

/// Runs the plugin-host child.
pub fn host(a: PluginHostArgs) -> std::process::ExitCode {
    process::serve(&a.lib)
}
