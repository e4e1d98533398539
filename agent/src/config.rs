//! The agent's configuration: a TOML file (`suanli agent --config FILE`), then `SUANLI_AGENT_*`
//! environment variables and flags for the common fields (applied by the CLI). Every limit is
//! here, validated, with an error naming the field and what would be valid.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Largest configuration file read (bytes).
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// Most digests `plugin_sha256` may list.
pub const MAX_PLUGIN_SHA256: usize = 256;

/// A configuration the agent cannot run with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this configuration (the message names the field).
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message, naming the key and what was expected.
        message: String,
    },
    /// A field is out of range or malformed.
    #[error("agent config: {field}: {message}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

/// Settings handed to one plugin's `init` (`[plugin_config.<stem>]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginSettings {
    /// The plugin's own configuration file (the fake plugin's device list), if it takes one.
    pub config_path: Option<PathBuf>,
    /// Free-form options passed through in `PluginConfig.options`.
    pub options: BTreeMap<String, String>,
}

/// Everything `suanli agent` needs. Field defaults are those of [`AgentConfig::default`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// Control-plane servers (`host:port`); any of them will do, the agent moves on to the
    /// next one when one fails. At least one, at most 16.
    pub servers: Vec<String>,
    /// This node's id (default: the host name).
    pub node_id: String,
    /// The resource pool the node joins.
    pub pool: String,
    /// Region, matched by job constraints.
    pub region: String,
    /// Datacenter (availability zone).
    pub datacenter: String,
    /// Labels matched by job constraints (at most 64). The three keys `topology.suanli.io/rack`,
    /// `topology.suanli.io/block` and `topology.suanli.io/nvlink-domain` place the node in the
    /// datacenter network for gang placement; they may also come from a device plugin's
    /// inventory, and a value set here wins over the plugin's.
    pub labels: BTreeMap<String, String>,
    /// Where allocation directories (task logs, exit records) and the agent's state live.
    pub data_dir: PathBuf,
    /// Directory of device plugin libraries (`*.so`).
    pub plugin_dir: PathBuf,
    /// File stems of the plugins to load (`fake` for `libsuanli_plugin_fake.so` is matched as
    /// the stem `libsuanli_plugin_fake`); default: every `*.so` in `plugin_dir`.
    pub plugins: Option<Vec<String>>,
    /// Per-plugin settings by file stem.
    pub plugin_config: BTreeMap<String, PluginSettings>,
    /// The SHA-256 digests (64 hex digits) of the plugin libraries the agent may load. When
    /// set, a library whose digest is not listed is refused before it is loaded, whatever its
    /// name; unset (the default): any library that passes the ownership and permission checks.
    /// At most 256 entries.
    pub plugin_sha256: Option<Vec<String>>,
    /// Address the task log service (`AgentLogs`) listens on; port 0 picks a free one.
    pub listen: String,
    /// Address the agent's HTTP listener (`/metrics`, docs/metrics.md) listens on; port 0
    /// picks a free one. `None` (the default): no listener.
    pub http_listen: Option<String>,
    /// Address others reach the log service at (default: the bound address). Set it when
    /// `listen` is a wildcard such as `0.0.0.0:7401`.
    pub advertise: Option<String>,
    /// Allocatable CPU in milli-cores (default: the cpu plugin's inventory, else /proc).
    pub cpu_milli: Option<u64>,
    /// Allocatable memory in MiB (default: the cpu plugin's inventory, else /proc/meminfo).
    pub memory_mib: Option<u64>,
    /// Deadline of one plugin call (reserve, stats, health events).
    pub plugin_call_timeout_ms: u64,
    /// Deadline of a plugin's fingerprint.
    pub plugin_fingerprint_timeout_ms: u64,
    /// First delay before restarting a crashed plugin host; doubles up to the max.
    pub plugin_backoff_min_ms: u64,
    /// Longest delay between plugin host restarts.
    pub plugin_backoff_max_ms: u64,
    /// How often plugins are asked for health events.
    pub health_poll_interval_ms: u64,
    /// How often plugins are fingerprinted again (and after every plugin restart).
    pub fingerprint_interval_ms: u64,
    /// Program and leading arguments of the plugin host (default: this executable +
    /// `plugin-host`); the library path is appended.
    pub host_cmd: Vec<String>,
    /// Program and leading arguments of the task shim (default: this executable + `task-shim`).
    pub shim_cmd: Vec<String>,
    /// Most tasks this node runs at once; an allocation beyond it is reported failed.
    pub max_tasks: usize,
    /// Largest size of one task log file (stdout or stderr) before it is rotated to `.1`; at
    /// most twice this is kept per stream.
    pub max_log_bytes: u64,
    /// Grace period between SIGTERM and SIGKILL when the allocation carries none (`grace_s`
    /// 0) and the least one given.
    pub stop_grace_min_ms: u64,
    /// Longest grace period honoured, whatever the allocation asks.
    pub stop_grace_max_ms: u64,
    /// After a task ended, how long its final status waits for the upload and report of a
    /// checkpoint it committed at the end (the status goes without it after this).
    pub checkpoint_final_wait_ms: u64,
    /// Deadline of one control-plane call.
    pub rpc_timeout_ms: u64,
    /// Deadline of connecting to a server.
    pub connect_timeout_ms: u64,
    /// A call with no answer after this long probes its server (`Cluster.Leader`, same
    /// deadline); a server that does not answer the probe either is hung (SIGSTOPped,
    /// removed, wedged) and the call moves on to the next server.
    pub first_answer_ms: u64,
    /// First delay before retrying a failed server call or stream; doubles up to the max.
    pub retry_backoff_min_ms: u64,
    /// Longest delay between retries.
    pub retry_backoff_max_ms: u64,
    /// Status reports sent at once.
    pub report_concurrency: usize,
    /// Try to enforce CPU and memory limits with cgroup v2.
    pub cgroups: bool,
    /// The cgroup v2 directory under which each task gets its own group.
    pub cgroup_parent: PathBuf,
    /// Finished allocation directories (logs) are deleted this long after their final status
    /// was acknowledged.
    pub alloc_retention_s: u64,
    /// Environment variables of the agent passed on to tasks (when set).
    pub inherit_env: Vec<String>,
    /// Concurrent `AgentLogs` streams.
    pub max_log_streams: usize,
    /// Fence tasks: a shim stops its task when the node's lease (renewed by each acknowledged
    /// heartbeat) expires, so a task never runs on after the control plane may have given its
    /// allocation to another node. Off: tasks survive a long disconnect, and may then run
    /// twice at once.
    pub fence: bool,
    /// F: a task gets SIGTERM when no heartbeat sent in the last F ms was acknowledged.
    /// 0: half the server's heartbeat TTL.
    pub fence_after_ms: u64,
    /// G: and SIGKILL G ms after that. 0: a fifth of the server's heartbeat TTL. F + G must
    /// stay below the TTL (a warning otherwise).
    pub fence_kill_grace_ms: u64,
    /// Follow a server's `suanli-leader` hint to another address of `servers`. Off: the agent
    /// only moves round `servers` in order (a follower forwards to the leader).
    pub follow_leader_hints: bool,
    /// Disk quota of one task's files in its allocation directory (logs not counted: they are
    /// bounded by `max_log_bytes`), bytes; measured every 2 s by its shim, which stops a task
    /// over it ("disk quota exceeded: …"). 0: no quota.
    pub task_disk_max_bytes: u64,
    /// The node is under disk pressure (takes no new work) while `data_dir`'s filesystem has
    /// less free than this, in bytes. 0: not checked by bytes.
    pub disk_pressure_free_bytes: u64,
    /// Or less free than this percentage of its size. 0: not checked by percentage.
    pub disk_pressure_free_percent: u64,
    /// How often the free space of `data_dir` is measured.
    pub disk_check_interval_ms: u64,
    /// Plaintext to the servers and on the log service, with no identities: only for a cluster
    /// whose servers run `--insecure` (a warning at every start). Without it, `[tls]` is
    /// required.
    pub insecure: bool,
    /// How often the `[tls]` files are checked for a change (a new certificate is used for new
    /// connections; SIGHUP reloads at once).
    pub tls_reload_interval_ms: u64,
    /// Deadline of one TLS handshake on the log service.
    pub tls_handshake_timeout_ms: u64,
    /// The node's TLS files (`[tls]`: `ca`, `cert`, `key`): the cluster's CA, the node's
    /// certificate (`suanli://node/<node_id>`, e.g. `suanli tls issue DIR --node ID`) and its
    /// key. It is presented to the servers and on the log service.
    pub tls: Option<suanli_security::tls::TlsFiles>,
    /// `[telemetry]`: where spans are exported (docs/tracing.md).
    pub telemetry: crate::telemetry::TelemetryConfig,
}

fn default_node_id() -> String {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let h = h.trim();
    if h.is_empty() { "localhost".to_owned() } else { h.to_owned() }
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            servers: vec!["127.0.0.1:7400".into()],
            node_id: default_node_id(),
            pool: "default".into(),
            region: String::new(),
            datacenter: String::new(),
            labels: BTreeMap::new(),
            data_dir: PathBuf::from("/var/lib/suanli/agent"),
            plugin_dir: PathBuf::from("/usr/lib/suanli/plugins"),
            plugins: None,
            plugin_config: BTreeMap::new(),
            plugin_sha256: None,
            listen: "127.0.0.1:0".into(),
            http_listen: None,
            advertise: None,
            cpu_milli: None,
            memory_mib: None,
            plugin_call_timeout_ms: 5_000,
            plugin_fingerprint_timeout_ms: 30_000,
            plugin_backoff_min_ms: 200,
            plugin_backoff_max_ms: 30_000,
            health_poll_interval_ms: 1_000,
            fingerprint_interval_ms: 30_000,
            host_cmd: Vec::new(),
            shim_cmd: Vec::new(),
            max_tasks: 256,
            max_log_bytes: 64 * 1024 * 1024,
            stop_grace_min_ms: 10_000,
            stop_grace_max_ms: 300_000,
            checkpoint_final_wait_ms: 120_000,
            rpc_timeout_ms: 10_000,
            connect_timeout_ms: 3_000,
            first_answer_ms: 2_000,
            retry_backoff_min_ms: 100,
            retry_backoff_max_ms: 5_000,
            report_concurrency: 8,
            cgroups: true,
            cgroup_parent: PathBuf::from("/sys/fs/cgroup/suanli"),
            alloc_retention_s: 24 * 3600,
            inherit_env: ["PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ"].map(String::from).to_vec(),
            max_log_streams: 64,
            fence: true,
            fence_after_ms: 0,
            fence_kill_grace_ms: 0,
            follow_leader_hints: true,
            task_disk_max_bytes: 0,
            disk_pressure_free_bytes: 1 << 30,
            disk_pressure_free_percent: 0,
            disk_check_interval_ms: 1_000,
            insecure: false,
            tls_reload_interval_ms: 5_000,
            tls_handshake_timeout_ms: 10_000,
            tls: None,
            telemetry: Default::default(),
        }
    }
}

fn check_name(field: &str, v: &str, allow_empty: bool) -> Result<(), ConfigError> {
    if v.is_empty() && !allow_empty {
        return Err(invalid(field, "must not be empty"));
    }
    if v.len() > 253 {
        return Err(invalid(field, format!("{} bytes; must be at most 253 bytes", v.len())));
    }
    if v.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(field, format!("{v:?} must not contain whitespace or control characters")));
    }
    Ok(())
}

fn check_ms(field: &str, v: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if v < min || v > max {
        return Err(invalid(field, format!("{v} is out of range; must be between {min} and {max}")));
    }
    Ok(())
}

pub(crate) fn check_host_port(field: &str, v: &str) -> Result<(), ConfigError> {
    let ok = v.rsplit_once(':').is_some_and(|(h, p)| {
        !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0) && !h.contains(char::is_whitespace)
    });
    if ok { Ok(()) } else { Err(invalid(field, format!("{v:?} is not HOST:PORT (port 1 to 65535)"))) }
}

fn check_stem(field: &str, v: &str) -> Result<(), ConfigError> {
    check_name(field, v, false)?;
    if v.contains('/') || v == "." || v == ".." {
        return Err(invalid(field, format!("{v:?} must be a file stem, not a path")));
    }
    Ok(())
}

impl AgentConfig {
    /// Reads and validates a TOML file (missing fields take their defaults).
    pub fn from_file(path: &Path) -> Result<AgentConfig, ConfigError> {
        let p = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(ConfigError::Parse {
                path: p,
                message: format!("{} bytes; a config file must be at most {MAX_CONFIG_BYTES} bytes", meta.len()),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
        let cfg = Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: p.clone(), message },
            other => other,
        })?;
        Ok(cfg)
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<AgentConfig, ConfigError> {
        let cfg: AgentConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse { path: "<toml>".into(), message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every field against its limits.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.servers.is_empty() || self.servers.len() > 16 {
            return Err(invalid("servers", format!("{} entries; must list 1 to 16 HOST:PORT", self.servers.len())));
        }
        for (i, s) in self.servers.iter().enumerate() {
            check_host_port(&format!("servers[{i}]"), s)?;
        }
        check_name("node_id", &self.node_id, false)?;
        check_name("pool", &self.pool, false)?;
        check_name("region", &self.region, true)?;
        check_name("datacenter", &self.datacenter, true)?;
        if self.labels.len() > 64 {
            return Err(invalid("labels", format!("{} entries; at most 64", self.labels.len())));
        }
        for (k, v) in &self.labels {
            check_name(&format!("labels.{k}"), k, false)?;
            if v.len() > 253 || v.chars().any(char::is_control) {
                return Err(invalid(
                    format!("labels.{k}"),
                    "value must be at most 253 bytes without control characters",
                ));
            }
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if let Some(list) = &self.plugins {
            if list.len() > 64 {
                return Err(invalid("plugins", format!("{} entries; at most 64", list.len())));
            }
            for (i, s) in list.iter().enumerate() {
                check_stem(&format!("plugins[{i}]"), s)?;
            }
        }
        if self.plugin_config.len() > 64 {
            return Err(invalid("plugin_config", format!("{} entries; at most 64", self.plugin_config.len())));
        }
        for (k, v) in &self.plugin_config {
            check_stem(&format!("plugin_config.{k}"), k)?;
            if v.options.len() > 256 {
                return Err(invalid(format!("plugin_config.{k}.options"), "at most 256 entries"));
            }
        }
        if let Some(list) = &self.plugin_sha256 {
            if list.len() > MAX_PLUGIN_SHA256 {
                return Err(invalid("plugin_sha256", format!("{} entries; at most {MAX_PLUGIN_SHA256}", list.len())));
            }
            for (i, d) in list.iter().enumerate() {
                if d.len() != 64 || !d.bytes().all(|b| b.is_ascii_hexdigit()) {
                    let shown: String = d.chars().take(80).collect();
                    return Err(invalid(
                        format!("plugin_sha256[{i}]"),
                        format!("{shown:?} is not a SHA-256 digest: 64 hex digits (`sha256sum FILE` prints it)"),
                    ));
                }
            }
        }
        self.listen
            .parse::<SocketAddr>()
            .map_err(|e| invalid("listen", format!("{:?} is not IP:PORT: {e}", self.listen)))?;
        if let Some(h) = &self.http_listen {
            h.parse::<SocketAddr>().map_err(|e| invalid("http_listen", format!("{h:?} is not IP:PORT: {e}")))?;
        }
        if let Some(a) = &self.advertise {
            check_host_port("advertise", a)?;
        }
        if let Some(c) = self.cpu_milli {
            check_ms("cpu_milli", c, 0, u64::MAX / 4)?;
        }
        if let Some(m) = self.memory_mib {
            check_ms("memory_mib", m, 0, u64::MAX / 4)?;
        }
        check_ms("plugin_call_timeout_ms", self.plugin_call_timeout_ms, 10, 600_000)?;
        check_ms("plugin_fingerprint_timeout_ms", self.plugin_fingerprint_timeout_ms, 10, 600_000)?;
        check_ms("plugin_backoff_min_ms", self.plugin_backoff_min_ms, 1, 600_000)?;
        check_ms("plugin_backoff_max_ms", self.plugin_backoff_max_ms, self.plugin_backoff_min_ms, 3_600_000)?;
        check_ms("health_poll_interval_ms", self.health_poll_interval_ms, 10, 600_000)?;
        check_ms("fingerprint_interval_ms", self.fingerprint_interval_ms, 100, 86_400_000)?;
        for (field, cmd) in [("host_cmd", &self.host_cmd), ("shim_cmd", &self.shim_cmd)] {
            if cmd.len() > 16 || cmd.first().is_some_and(String::is_empty) {
                return Err(invalid(
                    field,
                    "a program (non-empty) and at most 15 leading arguments, or empty for the default",
                ));
            }
        }
        check_ms("max_tasks", self.max_tasks as u64, 1, 100_000)?;
        check_ms("max_log_bytes", self.max_log_bytes, 4096, 1 << 40)?;
        check_ms("stop_grace_min_ms", self.stop_grace_min_ms, 0, 3_600_000)?;
        check_ms("stop_grace_max_ms", self.stop_grace_max_ms, self.stop_grace_min_ms, 86_400_000)?;
        check_ms("checkpoint_final_wait_ms", self.checkpoint_final_wait_ms, 0, 3_600_000)?;
        check_ms("rpc_timeout_ms", self.rpc_timeout_ms, 100, 600_000)?;
        check_ms("connect_timeout_ms", self.connect_timeout_ms, 10, 600_000)?;
        check_ms("first_answer_ms", self.first_answer_ms, 10, 600_000)?;
        check_ms("retry_backoff_min_ms", self.retry_backoff_min_ms, 1, 600_000)?;
        check_ms("retry_backoff_max_ms", self.retry_backoff_max_ms, self.retry_backoff_min_ms, 3_600_000)?;
        check_ms("report_concurrency", self.report_concurrency as u64, 1, 256)?;
        if self.cgroups && !self.cgroup_parent.is_absolute() {
            return Err(invalid("cgroup_parent", format!("{} must be an absolute path", self.cgroup_parent.display())));
        }
        check_ms("alloc_retention_s", self.alloc_retention_s, 0, 365 * 86_400)?;
        if self.inherit_env.len() > 256 {
            return Err(invalid("inherit_env", "at most 256 names"));
        }
        check_ms("max_log_streams", self.max_log_streams as u64, 1, 10_000)?;
        if self.fence_after_ms != 0 {
            check_ms("fence_after_ms", self.fence_after_ms, 100, 7 * 86_400_000)?;
        }
        if self.fence_kill_grace_ms != 0 {
            check_ms("fence_kill_grace_ms", self.fence_kill_grace_ms, 10, 86_400_000)?;
        }
        if self.task_disk_max_bytes != 0 {
            check_ms("task_disk_max_bytes", self.task_disk_max_bytes, 4096, 1 << 50)?;
        }
        check_ms("disk_pressure_free_bytes", self.disk_pressure_free_bytes, 0, 1 << 50)?;
        check_ms("disk_pressure_free_percent", self.disk_pressure_free_percent, 0, 99)?;
        check_ms("disk_check_interval_ms", self.disk_check_interval_ms, 100, 600_000)?;
        check_ms("tls_reload_interval_ms", self.tls_reload_interval_ms, 100, 86_400_000)?;
        check_ms("tls_handshake_timeout_ms", self.tls_handshake_timeout_ms, 100, 600_000)?;
        match (&self.tls, self.insecure) {
            (None, false) => {
                return Err(invalid(
                    "tls",
                    "no [tls] table (ca, cert, key: the cluster's CA and this node's certificate, e.g. from \
                     `suanli tls issue DIR --node ID`, or `suanli agent --tls-dir DIR`); set `insecure = true` \
                     (`--insecure`) only for servers started --insecure",
                ));
            }
            (Some(_), true) => {
                return Err(invalid("tls", "[tls] and insecure = true are both set; choose one"));
            }
            (Some(t), false) => {
                for (field, path) in [("tls.ca", &t.ca), ("tls.cert", &t.cert), ("tls.key", &t.key)] {
                    if path.as_os_str().is_empty() {
                        return Err(invalid(field, "must not be empty"));
                    }
                }
            }
            (None, true) => {}
        }
        Ok(())
    }

    /// The files of a `suanli tls init` directory for node `node_id`: `DIR/ca.pem`,
    /// `DIR/node-<node_id>.pem`, `DIR/node-<node_id>-key.pem`.
    pub fn tls_dir_files(dir: &Path, node_id: &str) -> suanli_security::tls::TlsFiles {
        suanli_security::certs::paths(dir, &format!("node-{node_id}"))
    }

    pub(crate) fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// The directory of allocation directories.
    pub fn allocs_dir(&self) -> PathBuf {
        self.data_dir.join("allocs")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A config with TLS files (not read by `validate`).
    fn with_tls(extra: &str) -> String {
        format!("{extra}\n[tls]\nca = \"/p/ca.pem\"\ncert = \"/p/node-n1.pem\"\nkey = \"/p/node-n1-key.pem\"\n")
    }

    #[test]
    fn defaults_are_valid_once_tls_or_insecure_is_chosen() {
        let e = AgentConfig::default().validate().unwrap_err().to_string();
        assert!(e.starts_with("agent config: tls: no [tls] table") && e.contains("insecure = true"), "{e}");
        AgentConfig { insecure: true, ..AgentConfig::default() }.validate().unwrap();
        let c = AgentConfig::from_toml(&with_tls("")).unwrap();
        assert_eq!(c.tls.unwrap().cert, PathBuf::from("/p/node-n1.pem"));
        AgentConfig::from_toml("insecure = true").unwrap();
        let e = AgentConfig::from_toml(&with_tls("insecure = true")).unwrap_err().to_string();
        assert!(e.contains("tls: [tls] and insecure = true are both set"), "{e}");
        let e = AgentConfig::from_toml("[tls]\nca = \"/c\"\ncert = \"/c\"").unwrap_err().to_string();
        assert!(e.contains("key"), "a missing key is named: {e}");
        let e = AgentConfig::from_toml("[tls]\nca = \"\"\ncert = \"/c\"\nkey = \"/k\"").unwrap_err().to_string();
        assert!(e.contains("tls.ca: must not be empty"), "{e}");
        let e = AgentConfig::from_toml(&with_tls("tls_handshake_timeout_ms = 0")).unwrap_err().to_string();
        assert!(e.contains("tls_handshake_timeout_ms"), "{e}");
        assert_eq!(AgentConfig::tls_dir_files(Path::new("/d"), "gpu-1").key, PathBuf::from("/d/node-gpu-1-key.pem"));
    }

    #[test]
    fn errors_name_the_field() {
        let e = AgentConfig::from_toml("insecure = true\nservers = []").unwrap_err().to_string();
        assert!(e.contains("servers") && e.contains("1 to 16"), "{e}");
        let e = AgentConfig::from_toml("servers = [\"nohost\"]").unwrap_err().to_string();
        assert!(e.contains("servers[0]"), "{e}");
        let e = AgentConfig::from_toml("max_tasks = 0").unwrap_err().to_string();
        assert!(e.contains("max_tasks") && e.contains("between 1 and"), "{e}");
        let e = AgentConfig::from_toml("listen = \"x\"").unwrap_err().to_string();
        assert!(e.contains("listen"), "{e}");
        let e = AgentConfig::from_toml("nodeid = \"a\"").unwrap_err().to_string();
        assert!(e.contains("nodeid"), "{e}");
        let e = AgentConfig::from_toml("plugins = [\"../x\"]").unwrap_err().to_string();
        assert!(e.contains("plugins[0]"), "{e}");
        let e = AgentConfig::from_toml("plugin_sha256 = [\"abc\"]").unwrap_err().to_string();
        assert!(e.contains("plugin_sha256[0]") && e.contains("64 hex digits"), "{e}");
        let ok = format!("insecure = true\nplugin_sha256 = [{:?}, {:?}]", "ab".repeat(32), "CD".repeat(32));
        assert_eq!(AgentConfig::from_toml(&ok).unwrap().plugin_sha256.map(|l| l.len()), Some(2));
        let e = AgentConfig::from_toml("stop_grace_min_ms = 10\nstop_grace_max_ms = 5").unwrap_err().to_string();
        assert!(e.contains("stop_grace_max_ms"), "{e}");
        let e = AgentConfig::from_toml("fence_after_ms = 5").unwrap_err().to_string();
        assert!(e.contains("fence_after_ms") && e.contains("between 100 and"), "{e}");
        let e = AgentConfig::from_toml("fence_kill_grace_ms = 1").unwrap_err().to_string();
        assert!(e.contains("fence_kill_grace_ms"), "{e}");
        let e = AgentConfig::from_toml("task_disk_max_bytes = 10").unwrap_err().to_string();
        assert!(e.contains("task_disk_max_bytes: 10") && e.contains("between 4096 and"), "{e}");
        let e = AgentConfig::from_toml("disk_pressure_free_percent = 100").unwrap_err().to_string();
        assert!(e.contains("disk_pressure_free_percent") && e.contains("between 0 and 99"), "{e}");
        let e = AgentConfig::from_toml("disk_check_interval_ms = 1").unwrap_err().to_string();
        assert!(e.contains("disk_check_interval_ms"), "{e}");
        let c =
            AgentConfig::from_toml("insecure = true\ndisk_pressure_free_bytes = 0\ntask_disk_max_bytes = 0").unwrap();
        assert_eq!((c.disk_pressure_free_bytes, c.task_disk_max_bytes), (0, 0), "0: off");
        let c =
            AgentConfig::from_toml("insecure = true\nfence = false\nfollow_leader_hints = false\nfence_after_ms = 0")
                .unwrap();
        assert!(!c.fence && !c.follow_leader_hints && c.fence_after_ms == 0);
    }

    #[test]
    fn a_full_file_parses() {
        let c = AgentConfig::from_toml(
            r#"
servers = ["10.0.0.1:7400", "10.0.0.2:7400"]
node_id = "gpu-a-001"
pool = "train"
region = "cn-east"
labels = { rack = "r1" }
data_dir = "/tmp/x"
plugin_dir = "/tmp/p"
plugins = ["libsuanli_plugin_fake"]
[plugin_config.libsuanli_plugin_fake]
config_path = "/etc/fake.toml"
options = { seed = "1" }
[tls]
ca = "/etc/suanli/tls/ca.pem"
cert = "/etc/suanli/tls/node-gpu-a-001.pem"
key = "/etc/suanli/tls/node-gpu-a-001-key.pem"
"#,
        )
        .unwrap();
        assert_eq!(c.servers.len(), 2);
        assert_eq!(c.plugin_config["libsuanli_plugin_fake"].options["seed"], "1");
    }
}
