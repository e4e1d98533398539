//! Every file under `examples/` loads and validates with the loader the client commands use
//! (`suanli job|queue validate`; the agent's for `nodes/`), and bad spec files fail with exit
//! code 2 and a message naming the file and the field, never a panic.
//!
//! And every example runs on the setup `examples/README.md` describes: `dev/` on `suanli dev`,
//! `jobs/` on the example cluster (one server, the queues of `queues/`, the agents of `nodes/`
//! with the fake and cpu plugins). Each job file, found by listing its directory, is submitted
//! with `suanli job submit`, must be placed with its tasks started, and is cancelled.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn suanli(args: &[&str]) -> Output {
    suanli_tests::cli().args(args).output().expect("run suanli")
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn toml_files(dir: &Path) -> Vec<PathBuf> {
    files(dir).into_iter().filter(|f| f.extension().is_some_and(|e| e == "toml")).collect()
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> =
        std::fs::read_dir(dir).expect("read examples dir").map(|e| e.expect("dir entry").path()).collect();
    v.sort();
    v
}

fn assert_clean_failure(o: &Output, needles: &[&str]) {
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {e}");
    for n in needles {
        assert!(e.contains(n), "stderr should contain {n:?}: {e}");
    }
    assert!(!e.contains("panicked"), "must not panic: {e}");
}

#[test]
fn every_example_validates() {
    let root = examples();
    let mut seen = 0;
    // Agent configurations: loaded and validated as `suanli agent --config` does.
    let agents = toml_files(&root.join("nodes"));
    assert!(agents.len() >= 2, "no agent configurations in examples/nodes");
    for f in agents {
        let c = suanli_agent::AgentConfig::from_file(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(!c.plugins.unwrap_or_default().is_empty(), "{}: names its plugins", f.display());
        seen += 1;
    }
    for (sub, kind) in [("jobs", "job"), ("dev", "job"), ("federation", "job"), ("queues", "queue")] {
        let dir = root.join(sub);
        let found = files(&dir);
        assert!(!found.is_empty(), "no examples in {}", dir.display());
        for f in found {
            let path = f.display().to_string();
            let o = suanli(&[kind, "validate", &path]);
            assert!(o.status.success(), "{path} should validate: {}", String::from_utf8_lossy(&o.stderr));
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("validate prints JSON");
            let id_key = if kind == "job" { "name" } else { "id" };
            assert!(v[id_key].is_string(), "{path}: normalized JSON lacks {id_key}: {v}");
            seen += 1;
        }
    }
    // The trainer's job (examples/trainer/job.toml; not run here: it trains for minutes) and
    // the model server's (examples/server/service.toml; its server.py runs in services_e2e).
    for f in toml_files(&root.join("trainer")).into_iter().chain(toml_files(&root.join("server"))) {
        let path = f.display().to_string();
        let o = suanli(&["job", "validate", &path]);
        assert!(o.status.success(), "{path} should validate: {}", String::from_utf8_lossy(&o.stderr));
        seen += 1;
    }
    // Simulator inputs: the services file replays (a short run on a small made-up cluster).
    let tmp = tempfile::tempdir().expect("tempdir");
    let nodes = tmp.path().join("nodes.csv");
    let rows: String = (0..6).map(|i| format!("n{i},96000,786432,8,V100M32\n")).collect();
    std::fs::write(&nodes, format!("sn,cpu_milli,memory_mib,gpu,model\n{rows}")).expect("write nodes");
    let pods = tmp.path().join("pods.csv");
    std::fs::write(
        &pods,
        "name,arrival_s,duration_s,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,queue,priority,replicas\nb,0,60,1000,1024,1,1000,,default,0,1\n",
    )
    .expect("write pods");
    for f in files(&root.join("sim")) {
        let path = f.display().to_string();
        let args = ["sim", "replay", "--nodes", &nodes.display().to_string(), "--pods", &pods.display().to_string()];
        let o =
            suanli(&[&args[..], &["--services", &path, "--until-s", "600", "--compare-static", "--quiet"]].concat());
        assert!(o.status.success(), "{path} should replay: {}", String::from_utf8_lossy(&o.stderr));
        assert!(String::from_utf8_lossy(&o.stdout).contains("batch goodput, shared / static"), "{path}");
        seen += 1;
    }
    // Fake device plugin configurations: checked by `suanli plugin check` in the plugin tests;
    // here they must at least be TOML.
    for f in files(&root.join("plugins")) {
        let text = std::fs::read_to_string(&f).expect("read plugin config");
        if let Err(e) = text.parse::<toml::Table>() {
            panic!("{}: not TOML: {e}", f.display());
        }
    }
    // Every subdirectory of examples/ is covered above (README.md describes them).
    for d in files(&root).into_iter().filter(|d| d.is_dir()) {
        let name = d.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        assert!(
            ["jobs", "dev", "federation", "queues", "nodes", "plugins", "trainer", "server", "sim"]
                .contains(&name.as_str()),
            "unchecked examples entry {name}"
        );
    }
    assert!(seen >= 10, "expected at least 10 examples, found {seen}");
}

#[test]
fn normalized_json_fills_defaults() {
    let f = examples().join("jobs/cpu-batch.toml");
    let o = suanli(&["job", "validate", &f.display().to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["kind"], "batch");
    assert_eq!(v["groups"][0]["replicas"], 6);
    assert_eq!(v["groups"][0]["resources"]["devices"], serde_json::Value::Null);
    assert_eq!(v["constraints"]["pools"], serde_json::json!([]));
    assert_eq!(v["checkpoint"], serde_json::Value::Null);
}

const GOOD: &str = r#"
name = "t"
queue = "q"

[[groups]]
name = "w"
replicas = 2

[groups.resources]
cpu_milli = 1000
memory_mib = 1024

[groups.resources.devices]
kind = "gpu"
count = 1
"#;

fn job_file(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p.display().to_string()
}

#[test]
fn bad_job_specs_name_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let good = job_file(d, "good.toml", GOOD);
    assert!(suanli(&["job", "validate", &good]).status.success());

    let cases: [(&str, String, &[&str]); 15] = [
        (
            "empty-command.toml",
            format!("{GOOD}\n[groups.task]\ncommand = \"\"\n"),
            &["groups[0].task.command", "must not be empty"],
        ),
        (
            "bad-env.toml",
            format!("{GOOD}\n[groups.task]\ncommand = \"/bin/true\"\nenv = {{ \"A=B\" = \"x\" }}\n"),
            &["groups[0].task.env.A=B", "without '='"],
        ),
        (
            "task-args-type.toml",
            format!("{GOOD}\n[groups.task]\ncommand = \"/bin/true\"\nargs = \"-x\"\n"),
            &["groups[0].task.args"],
        ),
        (
            "unknown.toml",
            GOOD.replace("replicas = 2", "replicas = 2\nreplica = 3"),
            &["groups[0].replica", "unknown field"],
        ),
        ("unknown-top.toml", format!("gpus = 4\n{GOOD}"), &["gpus: unknown field"]),
        ("negative.toml", GOOD.replace("cpu_milli = 1000", "cpu_milli = -1"), &["groups[0].resources.cpu_milli", "-1"]),
        ("zero-replicas.toml", GOOD.replace("replicas = 2", "replicas = 0"), &["groups[0].replicas", "between 1 and"]),
        (
            "too-many-cpus.toml",
            GOOD.replace("cpu_milli = 1000", "cpu_milli = 999999999"),
            &["groups[0].resources.cpu_milli", "between 0 and 1024000"],
        ),
        (
            "fractional-count.toml",
            GOOD.replace("count = 1", "count = 2\nmilli = 500"),
            &["groups[0].resources.devices.count", "fractional"],
        ),
        (
            "bad-kind.toml",
            GOOD.replace("kind = \"gpu\"", "kind = \"tpu\""),
            &["groups[0].resources.devices.kind", "`gpu` or `npu`"],
        ),
        ("float.toml", GOOD.replace("memory_mib = 1024", "memory_mib = 1.5"), &["groups[0].resources.memory_mib"]),
        ("missing-queue.toml", GOOD.replace("queue = \"q\"", ""), &["queue: missing required field"]),
        ("empty-name.toml", GOOD.replace("name = \"t\"", "name = \"\""), &["name: must not be empty"]),
        ("syntax.toml", GOOD.replace("replicas = 2", "replicas = "), &["syntax.toml", "TOML syntax"]),
        ("spec.yaml", "name: t\n".to_owned(), &["YAML is not supported"]),
    ];
    for (name, text, needles) in cases {
        let f = job_file(d, name, &text);
        let o = suanli(&["job", "validate", &f]);
        let mut all = vec![name];
        all.extend_from_slice(needles);
        assert_clean_failure(&o, &all);
    }

    let json = job_file(
        d,
        "neg.json",
        r#"{"name":"t","queue":"q","priority":-2000000,"groups":[{"name":"w","resources":{"cpu_milli":1}}]}"#,
    );
    assert_clean_failure(
        &suanli(&["job", "validate", &json]),
        &["neg.json", "priority", "between -1000000 and 1000000"],
    );

    let missing = d.join("nope.toml").display().to_string();
    assert_clean_failure(&suanli(&["job", "validate", &missing]), &["nope.toml", "cannot read"]);
}

#[test]
fn bad_queue_and_node_files_name_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let q = job_file(d, "q.toml", "id = \"q\"\nweight = 0\n");
    assert_clean_failure(&suanli(&["queue", "validate", &q]), &["q.toml", "queue.weight", "between 1 and"]);
    let q = job_file(d, "q2.toml", "id = \"q\"\n[nominal]\ngpus = 3\n");
    assert_clean_failure(&suanli(&["queue", "validate", &q]), &["queue.nominal.gpus: unknown field"]);
    let n = job_file(
        d,
        "n.toml",
        "id = \"n\"\npool = \"p\"\ncpu_milli = 1\nmemory_mib = 1\n[[devices]]\nid = \"0\"\nkind = \"gpu\"\nmodel = \"m\"\n\
         [[devices]]\nid = \"0\"\nkind = \"gpu\"\nmodel = \"m\"\n",
    );
    assert_clean_failure(&suanli(&["node", "validate", &n]), &["n.toml", "node.devices[1].id", "duplicate"]);
}

#[test]
fn unreachable_server_is_a_clean_error() {
    // Port 1 on localhost: nothing listens there, so the connection is refused at once.
    let dir = tempfile::tempdir().expect("tempdir");
    let o = suanli(&["job", "list", "--server", "127.0.0.1:1"]);
    assert_clean_failure(&o, &["error: UNAVAILABLE", "127.0.0.1:1"]);
    let o = suanli(&["queue", "list", "--server", "127.0.0.1:1,127.0.0.1:2"]);
    assert_clean_failure(&o, &["127.0.0.1:1", "127.0.0.1:2"]);
    // A bad spec is refused before any connection is tried.
    let bad = job_file(dir.path(), "bad.toml", &GOOD.replace("replicas = 2", "replicas = 0"));
    assert_clean_failure(&suanli(&["job", "submit", &bad, "--server", "127.0.0.1:1"]), &["groups[0].replicas"]);
}

// ---- every example runs on its documented setup -----------------------------------------

/// A child process killed (SIGTERM, then SIGKILL) when dropped, also when the test fails.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Kills what tasks the agents under `.0` left running (agents leave their tasks behind by
/// design), also when the test fails.
struct TaskReaper(PathBuf);

impl Drop for TaskReaper {
    fn drop(&mut self) {
        let Ok(nodes) = std::fs::read_dir(&self.0) else {
            return;
        };
        for n in nodes.filter_map(Result::ok) {
            let Ok(allocs) = std::fs::read_dir(n.path().join("allocs")) else {
                continue;
            };
            for a in allocs.filter_map(Result::ok) {
                let rec: Option<suanli_agent::TaskRecord> =
                    std::fs::read(a.path().join("task.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
                if let Some(r) = rec
                    && r.shim.alive()
                {
                    let _ = suanli_agent::sys::kill_group(r.shim.pid, 9);
                }
            }
        }
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where cargo put this binary and the plugin libraries.
fn plugin_dir() -> PathBuf {
    suanli_tests::bin().parent().expect("bin dir").to_path_buf()
}

/// The CLI from the repository root, with the admin certificate of the `suanli tls init`
/// directory `tls` (`SUANLI_TLS_DIR`, as a shell would export it).
fn cli_at(tls: &Path, addr: &str, args: &[&str]) -> Output {
    Command::new(suanli_tests::bin())
        .current_dir(repo_root())
        .env("SUANLI_TLS_DIR", tls)
        .env_remove("SUANLI_CA")
        .env_remove("SUANLI_CERT")
        .env_remove("SUANLI_KEY")
        .env_remove("SUANLI_TOKEN")
        .env_remove("SUANLI_INSECURE")
        .args(args)
        .args(["--server", addr])
        .output()
        .expect("run suanli")
}

fn cli_json(tls: &Path, addr: &str, args: &[&str]) -> serde_json::Value {
    let o = cli_at(tls, addr, &[args, &["--output", "json"]].concat());
    assert!(o.status.success(), "suanli {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("json")
}

fn wait_for<T>(within: Duration, what: &str, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) => assert!(Instant::now() < deadline, "timed out waiting for {what}: {last}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The last few KiB of a log file (for failure messages).
fn tail(p: &Path) -> String {
    let text = std::fs::read_to_string(p).unwrap_or_default();
    let mut start = text.len().saturating_sub(4096);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("--- {} (end)\n{}", p.display(), &text[start..])
}

fn spawn_logged(cmd: &mut Command, log: &Path) -> Proc {
    let f = std::fs::File::create(log).expect("log file");
    Proc(cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(f).spawn().expect("spawn"))
}

/// Submits every job file of `dir` in turn with `suanli job submit`: each must be placed with
/// every listed task running (or already succeeded); then it is cancelled and must end before
/// the next (the example jobs fit the cluster one at a time). `logs` is shown on failure.
fn run_every_job(tls: &Path, addr: &str, dir: &Path, logs: &dyn Fn() -> String) {
    let found = files(dir);
    assert!(!found.is_empty(), "no examples in {}", dir.display());
    for f in found {
        let path = f.display().to_string();
        let v = cli_json(tls, addr, &["job", "submit", &path]);
        let id = v["job_id"].as_u64().unwrap_or_else(|| panic!("{path}: no job id: {v}")).to_string();
        wait_for(Duration::from_secs(90), &format!("{path} (job {id}) placed and its tasks started"), || {
            let j = cli_json(tls, addr, &["job", "status", &id]);
            let allocs = j["allocs"].as_array().cloned().unwrap_or_default();
            let state = j["state"].as_str().unwrap_or_default();
            let started = |a: &serde_json::Value| matches!(a["state"].as_str(), Some("running" | "succeeded"));
            if matches!(state, "failed" | "cancelled") {
                panic!("{path}: job {id} ended {state}: {j:#}\n{}", logs());
            }
            if matches!(state, "running" | "succeeded") && !allocs.is_empty() && allocs.iter().all(started) {
                Ok(())
            } else {
                Err(format!("{j:#}\n{}", logs()))
            }
        });
        // The tasks really run: every one has written to its stdout (served by its agent).
        let j = cli_json(tls, addr, &["job", "status", &id]);
        for a in j["allocs"].as_array().cloned().unwrap_or_default() {
            let alloc = a["id"].as_u64().expect("alloc id").to_string();
            wait_for(Duration::from_secs(30), &format!("{path}: output of allocation {alloc}"), || {
                let o = cli_at(tls, addr, &["job", "logs", &id, "--alloc", &alloc]);
                let out = String::from_utf8_lossy(&o.stdout).into_owned();
                if o.status.success() && !out.trim().is_empty() {
                    Ok(())
                } else {
                    let err = cli_at(tls, addr, &["job", "logs", &id, "--alloc", &alloc, "--stderr"]);
                    Err(format!("stdout {out:?}, stderr {:?}", String::from_utf8_lossy(&err.stdout)))
                }
            });
        }
        let j = cli_json(tls, addr, &["job", "status", &id]);
        assert_ne!(j["state"], "failed", "{path}: {j:#}");
        if j["state"] != "succeeded" {
            let o = cli_at(tls, addr, &["job", "cancel", &id, "--reason", "example checked"]);
            assert!(o.status.success(), "cancel {path}: {}", String::from_utf8_lossy(&o.stderr));
        }
        wait_for(Duration::from_secs(60), &format!("{path} (job {id}) ended and its tasks stopped"), || {
            let j = cli_json(tls, addr, &["job", "status", &id]);
            let ended = matches!(j["state"].as_str(), Some("succeeded" | "cancelled"));
            let live = j["allocs"]
                .as_array()
                .is_some_and(|a| a.iter().any(|a| matches!(a["state"].as_str(), Some("pending" | "running"))));
            if ended && !live { Ok(()) } else { Err(format!("{j:#}")) }
        });
    }
}

#[test]
fn every_dev_example_runs_on_suanli_dev() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("dev.log");
    // Port 0: `suanli dev` prints the address it bound on stdout.
    let mut child = Command::new(suanli_tests::bin())
        .current_dir(repo_root())
        .args(["dev", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("dev"))
        .arg("--plugin-dir")
        .arg(plugin_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("piped stdout");
    let _dev = Proc(child);
    let bound = suanli_server::listeners::await_line(stdout, Duration::from_secs(60));
    let addr = bound.unwrap_or_else(|e| panic!("suanli dev: {e}\n{}", tail(&log))).client.to_string();
    let logs = || tail(&log);
    // The certificates `suanli dev` made on its first run.
    let tls = dir.path().join("dev").join("tls");
    wait_for(Duration::from_secs(60), "the two dev nodes", || {
        let o = cli_at(&tls, &addr, &["node", "list", "--output", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        let ready = v.as_array().map_or(0, |n| n.iter().filter(|n| n["status"] == "ready").count());
        if ready == 2 { Ok(()) } else { Err(format!("{v}\n{}", logs())) }
    });
    run_every_job(&tls, &addr, &examples().join("dev"), &logs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_job_example_runs_on_the_example_cluster() {
    let bin = suanli_tests::bin();
    // 1. One server (`suanli server --id 1 ... --bootstrap`, on the ports it picks: port 0).
    let cluster = suanli_server::local::ProcessCluster::start(&bin, 1, &[]).expect("server");
    cluster.wait_leader(Duration::from_secs(30)).await.expect("a leader");
    let addr = cluster.addrs[0].clone();
    let dir = tempfile::tempdir().expect("tempdir");
    tokio::task::spawn_blocking(move || {
        let _reaper = TaskReaper(dir.path().to_path_buf());
        // The cluster's `suanli tls init` directory (the local PKI of the test process).
        let tls = suanli_tests::LocalPki::get().dir();
        // 2. The teams' queues.
        for q in toml_files(&examples().join("queues")) {
            let o = cli_at(tls, &addr, &["queue", "apply", &q.display().to_string()]);
            assert!(o.status.success(), "{}: {}", q.display(), String::from_utf8_lossy(&o.stderr));
        }
        // 3. Every agent of examples/nodes, from the repository root, with the fake and cpu
        //    plugins cargo built; only the servers and the data directory are overridden.
        let mut agents = Vec::new();
        let mut ids = Vec::new();
        let mut logs_of = Vec::new();
        for f in toml_files(&examples().join("nodes")) {
            let cfg = suanli_agent::AgentConfig::from_file(&f).expect("agent config");
            // Its certificate in the cluster's directory (`suanli tls init --node ID` did it in
            // examples/README.md).
            suanli_tests::LocalPki::get().node(&cfg.node_id);
            let log = dir.path().join(format!("{}.log", cfg.node_id));
            agents.push(spawn_logged(
                Command::new(suanli_tests::bin())
                    .current_dir(repo_root())
                    .args(["agent", "--config"])
                    .arg(&f)
                    .args(["--servers", &addr, "--data-dir"])
                    .arg(dir.path().join(&cfg.node_id))
                    .arg("--plugin-dir")
                    .arg(plugin_dir())
                    .arg("--tls-dir")
                    .arg(tls)
                    .env_remove("SUANLI_AGENT_CONFIG"),
                &log,
            ));
            ids.push(cfg.node_id);
            logs_of.push(log);
        }
        let logs = || logs_of.iter().map(|l| tail(l)).collect::<String>();
        wait_for(Duration::from_secs(60), "every example node ready with its fake devices", || {
            let v = cli_json(tls, &addr, &["node", "list"]);
            let n = v.as_array().cloned().unwrap_or_default();
            let ok = ids.iter().all(|id| {
                n.iter().any(|x| {
                    x["id"] == id.as_str()
                        && x["status"] == "ready"
                        && x["devices"].as_array().is_some_and(|d| !d.is_empty())
                })
            });
            if ok { Ok(()) } else { Err(format!("{v:#}\n{}", logs())) }
        });
        // 4. Every job file.
        run_every_job(tls, &addr, &examples().join("jobs"), &logs);
        drop(agents);
    })
    .await
    .expect("the example cluster test");
    drop(cluster);
}
