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
    /// Load a plugin library in a plugin-host child and run every call with deadlines: load,
    /// version and table size, exported symbols, init, fingerprint, reserve (empty, several,
    /// with a reservation id and release), stats, health_events and a health scenario, repeated
    /// and concurrent calls with the host's memory and descriptors, stdout, a host restart,
    /// shutdown. Prints PASS/WARN/FAIL/SKIP per check; exits non-zero on any failure.
    Check(CheckArgs),
    /// Write a new device plugin that passes `suanli plugin check`, to start from: C (plugin.c
    /// over protobuf-c, a Makefile, the header and schema) or Rust (a cdylib crate over
    /// suanli-device-abi). Every place a real plugin calls its driver is marked `VENDOR:`.
    New(NewArgs),
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Lang {
    C,
    Rust,
}

#[derive(clap::Args, Debug)]
struct NewArgs {
    /// The plugin's name: 1 to 32 of a-z, 0-9 and _, starting with a letter (the library becomes
    /// libsuanli_plugin_NAME.so; the agent's config calls it NAME).
    name: String,
    /// The language of the scaffold.
    #[arg(long, value_enum)]
    lang: Lang,
    /// Where to write it (must not exist, or be empty). Default: ./suanli-plugin-NAME.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Rust only: the suanli-device-abi crate (device-plugins/abi of a suanli checkout) the
    /// plugin depends on. Default: the one this binary was built from, when it exists.
    #[arg(long)]
    abi_path: Option<PathBuf>,
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
        PluginCmd::New(n) => new_cmd(n),
    }
}

/// The files of a C scaffold: the example plugin, its Makefile, the header and the schema.
const C_PLUGIN: &str = include_str!("../../device-plugins/examples/c/plugin.c");
const C_MAKEFILE: &str = include_str!("../../device-plugins/examples/c/Makefile");
const C_HEADER: &str = include_str!("../../device-plugins/abi/include/suanli_device_plugin.h");
const C_SCHEMA: &str = include_str!("../../device-plugins/abi/include/suanli_device.proto");
const RUST_CARGO: &str = include_str!("../templates/rust/Cargo.toml.in");
const RUST_LIB: &str = include_str!("../templates/rust/lib.rs.in");

/// Checks a plugin name: 1..=32 of `a-z0-9_`, starting with a letter.
fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = (1..=32).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        anyhow::bail!("plugin name {name:?}: expected 1 to 32 of a-z, 0-9 and _, starting with a letter (e.g. mynpu)")
    }
}

/// The C example made into plugin `name`: its name, device ids and variables renamed; the
/// test-only EXAMPLE_* switches stay (documented in the README it gets).
fn c_plugin(name: &str) -> String {
    let upper = name.to_ascii_uppercase();
    C_PLUGIN
        .replace("\"example", &format!("\"{name}"))
        .replace("example plugin", &format!("{name} plugin"))
        .replace("EXAMPLE_VISIBLE_DEVICES", &format!("{upper}_VISIBLE_DEVICES"))
        .replace("EXAMPLE_DEVICE_MILLI", &format!("{upper}_DEVICE_MILLI"))
        .replace("EXAMPLE_DEVICE_MEMORY_MIB", &format!("{upper}_DEVICE_MEMORY_MIB"))
}

fn c_readme(name: &str) -> String {
    format!(
        "# The {name} device plugin for suanli\n\n\
Scaffolded by `suanli plugin new --lang c {name}` from suanli's C example plugin (device plugin ABI\n\
{major}.{minor}). It reports two devices that do not exist yet: replace every `VENDOR:` part of `plugin.c`\n\
with calls to your driver library. The contract is `include/suanli_device_plugin.h` (its THE CALLS\n\
section lists every rule); payloads are `include/suanli_device.proto`, compiled by protoc-c.\n\n\
```sh\n\
apt-get install protobuf-c-compiler libprotobuf-c-dev pkg-config   # RHEL: protobuf-c-compiler protobuf-c-devel\n\
make                                   # -> build/libsuanli_plugin_{name}.so\n\
suanli plugin check build/libsuanli_plugin_{name}.so\n\
```\n\n\
The `EXAMPLE_*` compile switches in `plugin.c` (crash, leak, chatty, ...) are test aids of the\n\
example: never ship a build with them; delete them when you no longer need them.\n\n\
## Packaging\n\n\
- Link protobuf-c dynamically (Debian's libprotobuf-c.a is not position-independent), or compile\n\
  protobuf-c's own `protobuf-c.c` into the plugin; the Makefile does the former.\n\
- Export only `suanli_device_plugin_entry`: the Makefile builds with `-fvisibility=hidden`.\n\
- Build against the oldest glibc you support (e.g. in a Debian 11 or RHEL 8 container): a\n\
  library built against a newer glibc refuses to load on an older one.\n\
- Install it as `libsuanli_plugin_{name}.so`, mode 0755, owned by root, in the agent's\n\
  `plugin_dir`; configure it under `[plugin_config.{name}]`.\n",
        major = suanli_device_host::ABI_MAJOR,
        minor = suanli_device_host::ABI_MINOR,
    )
}

fn rust_readme(name: &str) -> String {
    let us = name.replace('-', "_");
    format!(
        "# The {name} device plugin for suanli\n\n\
Scaffolded by `suanli plugin new --lang rust {name}` (device plugin ABI {major}.{minor}). It reports\n\
two devices that do not exist yet: replace every `VENDOR:` part of `src/lib.rs` with calls to your\n\
driver library. The contract is suanli's `device-plugins/abi/include/suanli_device_plugin.h`.\n\n\
```sh\n\
cargo build --release\n\
suanli plugin check target/release/libsuanli_plugin_{us}.so\n\
```\n\n\
## Packaging\n\n\
- Keep `panic = \"unwind\"`: `export_plugin!` turns a panic into an INTERNAL error.\n\
- A cdylib exports only `suanli_device_plugin_entry` (`#[no_mangle]` items are the only exports).\n\
- Build against the oldest glibc you support (e.g. in a Debian 11 or RHEL 8 container).\n\
- Install it as `libsuanli_plugin_{us}.so`, mode 0755, owned by root, in the agent's\n\
  `plugin_dir`; configure it under `[plugin_config.{us}]`.\n",
        major = suanli_device_host::ABI_MAJOR,
        minor = suanli_device_host::ABI_MINOR,
    )
}

fn new_cmd(a: NewArgs) -> anyhow::Result<()> {
    check_name(&a.name)?;
    let name = a.name.as_str();
    let dir = a.dir.clone().unwrap_or_else(|| PathBuf::from(format!("suanli-plugin-{}", name.replace('_', "-"))));
    if dir.exists() && std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?.next().is_some() {
        anyhow::bail!("{} exists and is not empty; choose another --dir", dir.display());
    }
    let files: Vec<(PathBuf, String)> = match a.lang {
        Lang::C => {
            let makefile =
                C_MAKEFILE.replace("NAME ?= suanli_plugin_example", &format!("NAME ?= suanli_plugin_{name}"));
            vec![
                ("plugin.c".into(), c_plugin(name)),
                ("Makefile".into(), makefile),
                ("include/suanli_device_plugin.h".into(), C_HEADER.to_string()),
                ("include/suanli_device.proto".into(), C_SCHEMA.to_string()),
                ("README.md".into(), c_readme(name)),
                (".gitignore".into(), "/build/\n".to_string()),
            ]
        }
        Lang::Rust => {
            let abi = match &a.abi_path {
                Some(p) => p.clone(),
                None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../device-plugins/abi")),
            };
            let abi = std::fs::canonicalize(&abi).with_context(|| {
                format!(
                    "the suanli-device-abi crate is not at {}: pass --abi-path DIR (device-plugins/abi of a suanli checkout)",
                    abi.display()
                )
            })?;
            if !abi.join("Cargo.toml").exists() {
                anyhow::bail!(
                    "{} has no Cargo.toml: --abi-path must name device-plugins/abi of a suanli checkout",
                    abi.display()
                );
            }
            let abi_str = abi.to_str().context("the suanli-device-abi path is not UTF-8")?;
            let sub = |t: &str| {
                t.replace("@NAME@", name)
                    .replace("@NAME_US@", &name.replace('-', "_"))
                    .replace("@NAME_UPPER@", &name.to_ascii_uppercase())
                    .replace("@ABI_PATH@", abi_str)
            };
            vec![
                ("Cargo.toml".into(), sub(RUST_CARGO)),
                ("src/lib.rs".into(), sub(RUST_LIB)),
                ("README.md".into(), rust_readme(name)),
                (".gitignore".into(), "/target/\n".to_string()),
            ]
        }
    };
    for (rel, text) in &files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let next = match a.lang {
        Lang::C => format!("make -C {0} && suanli plugin check {0}/build/libsuanli_plugin_{name}.so", dir.display()),
        Lang::Rust => format!(
            "cd {0} && cargo build --release && suanli plugin check target/release/libsuanli_plugin_{name}.so",
            dir.display()
        ),
    };
    println!("wrote the {name} plugin ({} files) to {}; next: {next}", files.len(), dir.display());
    Ok(())
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
