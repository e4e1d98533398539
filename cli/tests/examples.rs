//! Every file under `examples/` loads and validates with the loader the client commands use
//! (`suanli job|queue|node validate`), and bad spec files fail with exit code 2 and a message
//! naming the file and the field, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn suanli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_suanli")).args(args).output().expect("run suanli")
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
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
    for (sub, kind) in [("jobs", "job"), ("dev", "job"), ("queues", "queue"), ("nodes", "node")] {
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
    // Fake device plugin configurations: checked by `suanli plugin check` in the plugin tests;
    // here they must at least be TOML.
    for f in files(&root.join("plugins")) {
        let text = std::fs::read_to_string(&f).expect("read plugin config");
        if let Err(e) = text.parse::<toml::Table>() {
            panic!("{}: not TOML: {e}", f.display());
        }
    }
    // Every subdirectory of examples/ is covered above.
    for d in files(&root) {
        let name = d.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        assert!(
            ["jobs", "dev", "queues", "nodes", "plugins"].contains(&name.as_str()),
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
    assert_eq!(v["groups"][0]["replicas"], 50);
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
