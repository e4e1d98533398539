//! The `plugin_sha256` allow-list with the real fake plugin library: listed, it loads; not
//! listed, it is refused before it is loaded, with an error naming the file, its digest and the
//! config key; the ownership and permission checks still come first.
//!
//! Needs `target/debug/suanli-plugin-host` and `libsuanli_plugin_fake.so` (`cargo build -p
//! suanli-device-host -p suanli-plugin-fake`; scripts/test.sh builds the workspace first).

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use suanli_agent::{AgentConfig, check_plugins, file_sha256};

fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug")
}

fn fake_so() -> PathBuf {
    let so = target_dir().join("libsuanli_plugin_fake.so");
    if so.exists() { so } else { target_dir().join("deps/libsuanli_plugin_fake.so") }
}

fn host() -> PathBuf {
    let h = target_dir().join("suanli-plugin-host");
    assert!(h.is_file(), "{} is missing: run `cargo build -p suanli-device-host` first", h.display());
    h
}

/// An agent configuration loading only `fake` from `plugins`, with `extra` appended.
fn config(plugins: &Path, extra: &str) -> AgentConfig {
    let fake_cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/plugins/fake-8gpu.toml");
    let toml = format!(
        "insecure = true\nnode_id = \"allowlist\"\nplugin_dir = {plugins:?}\nplugins = [\"fake\"]\nhost_cmd = [{host:?}]\n{extra}\n\
         [plugin_config.fake]\nconfig_path = {fake_cfg:?}\n",
        plugins = plugins.display().to_string(),
        host = host().display().to_string(),
        fake_cfg = fake_cfg.display().to_string(),
    );
    AgentConfig::from_toml(&toml).expect("a valid agent config")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_listed_plugin_digest_loads() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).expect("plugins dir");
    let so = plugins.join("libsuanli_plugin_fake.so");
    std::fs::copy(fake_so(), &so).expect("copy the fake plugin (cargo build -p suanli-plugin-fake)");
    std::fs::set_permissions(&so, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(&plugins, std::fs::Permissions::from_mode(0o755)).expect("chmod");

    // The digest the agent computes is the one `sha256sum` prints.
    let digest = file_sha256(&so).expect("hash the library");
    let out = std::process::Command::new("sha256sum").arg(&so).output().expect("sha256sum runs");
    assert_eq!(String::from_utf8_lossy(&out.stdout).split_whitespace().next(), Some(digest.as_str()));
    let other = "0".repeat(64);

    // No allow-list: loads (the default is unchanged).
    let c = check_plugins(&config(&plugins, "")).await;
    assert_eq!(c.loaded, ["libsuanli_plugin_fake"], "{c:?}");

    // Listed (in capitals, beside another digest): loads.
    let listed = format!("plugin_sha256 = [{other:?}, {:?}]", digest.to_ascii_uppercase());
    let c = check_plugins(&config(&plugins, &listed)).await;
    assert_eq!(c.loaded, ["libsuanli_plugin_fake"], "{c:?}");
    assert!(c.refused.is_empty(), "{c:?}");

    // Not listed: refused before it is loaded, naming the file, its digest and the key.
    let c = check_plugins(&config(&plugins, &format!("plugin_sha256 = [{other:?}]"))).await;
    assert!(c.loaded.is_empty(), "{c:?}");
    let [r] = c.refused.as_slice() else { panic!("one refusal expected: {c:?}") };
    assert_eq!(r.path, so);
    for part in [so.display().to_string().as_str(), digest.as_str(), "plugin_sha256", "not listed"] {
        assert!(r.reason.contains(part), "{part:?} missing from: {}", r.reason);
    }
    // An empty list allows nothing.
    let c = check_plugins(&config(&plugins, "plugin_sha256 = []")).await;
    assert!(c.loaded.is_empty() && c.refused.len() == 1, "{c:?}");

    // Listed but writable by others: the permission check still refuses it.
    std::fs::set_permissions(&so, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let c = check_plugins(&config(&plugins, &listed)).await;
    assert!(c.loaded.is_empty(), "{c:?}");
    let [r] = c.refused.as_slice() else { panic!("one refusal expected: {c:?}") };
    assert!(r.reason.contains("writable by group or others"), "{}", r.reason);
}
