//! A node whose fake plugin offers a GPU both whole and as seven MIG-style partitions
//! (`partition_of`), registered by a real agent with a real server: the tasks that ran (the
//! agent's journal) never used the GPU and one of its partitions at the same time.
//!
//! Needs `target/debug/suanli` and `libsuanli_plugin_fake.so` (`cargo build -p suanli -p
//! suanli-plugin-fake`), or `SUANLI_BIN` naming a binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use suanli_proto::v1 as pb;

fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug")
}

fn bin() -> PathBuf {
    let b = std::env::var_os("SUANLI_BIN").map_or_else(|| target_dir().join("suanli"), PathBuf::from);
    assert!(b.is_file(), "{} is missing: run `cargo build -p suanli -p suanli-plugin-fake` first", b.display());
    b
}

fn fake_so() -> PathBuf {
    let so = target_dir().join("libsuanli_plugin_fake.so");
    if so.exists() { so } else { target_dir().join("deps/libsuanli_plugin_fake.so") }
}

/// A channel as the local PKI's admin (the cluster runs mutual TLS).
async fn channel(addr: &str) -> tonic::transport::Channel {
    suanli_server::local::channel(addr).await.unwrap()
}

const MIG_NODE: &str = r#"
[[groups]]
count = 2
kind = "gpu"
model = "A100-80G"
memory_mib = 81920

[[mig]]
gpu = "gpu0"
slices = 7
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_and_its_mig_partitions_are_never_booked_at_once() {
    let cluster = suanli_server::local::ProcessCluster::start(&bin(), 1, &[]).unwrap();
    let leader = cluster.wait_leader(Duration::from_secs(30)).await.unwrap();
    let addr = cluster.addrs[leader].clone();
    let q = serde_json::json!({"id": "default", "nominal": {"cpu_milli": u64::MAX, "memory_mib": u64::MAX,
        "gpu_milli": u64::MAX, "npu_milli": u64::MAX}});
    pb::queues_client::QueuesClient::new(channel(&addr).await)
        .upsert(pb::UpsertQueueRequest { queue_json: q.to_string() })
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    std::fs::copy(fake_so(), plugins.join("libsuanli_plugin_fake.so")).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(plugins.join("libsuanli_plugin_fake.so"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&plugins, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("fake.toml"), MIG_NODE).unwrap();
    let node = suanli_server::local::LocalPki::get().node("mig-node");
    let toml = format!(
        "servers = [{addr:?}]\nnode_id = \"mig-node\"\ndata_dir = {data:?}\nplugin_dir = {plugins:?}\nplugins = [\"fake\"]\n\
         cpu_milli = 64000\nmemory_mib = 65536\nstop_grace_min_ms = 1000\ncgroups = false\nshim_cmd = [{bin:?}, \"task-shim\"]\nhost_cmd = [{bin:?}, \"plugin-host\"]\n\
         [plugin_config.fake]\nconfig_path = {fake:?}\n\
         [tls]\nca = {ca:?}\ncert = {cert:?}\nkey = {key:?}\n",
        data = dir.path().join("data").display().to_string(),
        plugins = plugins.display().to_string(),
        bin = bin().display().to_string(),
        fake = dir.path().join("fake.toml").display().to_string(),
        ca = node.ca.display().to_string(),
        cert = node.cert.display().to_string(),
        key = node.key.display().to_string(),
    );
    let cfg = suanli_agent::AgentConfig::from_toml(&toml).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(suanli_agent::run(cfg, async move {
        let _ = stop_rx.await;
    }));

    let mut nodes = pb::nodes_client::NodesClient::new(channel(&addr).await);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = nodes.list(pb::ListNodesRequest::default()).await.unwrap().into_inner().nodes;
        if n.iter().any(|x| x.id == "mig-node" && x.status == "ready" && x.devices.len() == 9) {
            break;
        }
        assert!(Instant::now() < deadline, "the MIG node did not register with 9 devices: {n:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Nine one-GPU jobs: more than the node can hold if a GPU and its partitions are exclusive.
    let mut jobs = pb::jobs_client::JobsClient::new(channel(&addr).await);
    for i in 0..9 {
        let spec = serde_json::json!({"name": format!("mig-{i}"), "queue": "default", "groups": [{"name": "main",
            "resources": {"cpu_milli": 100, "memory_mib": 64, "devices": {"kind": "gpu", "count": 1, "milli": 1000}},
            "task": {"command": "/bin/sh", "args": ["-c", "sleep 2"]}}]});
        let req = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: format!("mig-{i}"),
            spec_json: spec.to_string(),
            retry: None,
        };
        jobs.submit(req).await.unwrap();
    }
    // Until every job has started and stopped.
    let journal = dir.path().join("data").join(suanli_agent::journal::JOURNAL_FILE);
    let deadline = Instant::now() + Duration::from_secs(90);
    let entries = loop {
        let e = suanli_agent::read_journal(&journal).unwrap_or_default();
        if e.iter().filter(|x| !x.is_start()).count() >= 9 {
            break e;
        }
        assert!(Instant::now() < deadline, "the nine jobs did not all run: {e:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stop_tx.send(());
    let _ = agent.await;

    // Each task's devices and [start, stop] times; a whole gpu0 overlaps no gpu0-migN.
    let mut spans: Vec<(String, u64, u64)> = Vec::new();
    for s in entries.iter().filter(|x| x.is_start()) {
        let stop = entries.iter().find(|x| !x.is_start() && x.alloc_id == s.alloc_id && x.epoch == s.epoch);
        let end = stop.map_or(u64::MAX, |x| x.at_ms);
        for d in &s.devices {
            spans.push((d.device.clone(), s.at_ms, end));
        }
    }
    for (a, a0, a1) in spans.iter().filter(|(d, _, _)| d == "gpu0") {
        for (b, b0, b1) in spans.iter().filter(|(d, _, _)| d.starts_with("gpu0-mig")) {
            assert!(a1 <= b0 || b1 <= a0, "{a} [{a0}, {a1}] and {b} [{b0}, {b1}] were booked at once");
        }
    }
}
