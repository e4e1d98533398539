//! The checkpoint store end to end: a checkpoint committed on one "node" (a tempdir) is put
//! into the store and got back on another, byte for byte, and a tampered stored manifest is
//! refused. Once through `file://`, once through S3 against a real S3-protocol server (moto in
//! server mode; scripts/test.sh installs it).
#![allow(clippy::unwrap_used)]

use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use suanli_agent::checkpoint::{ManifestLimits, Store, StoreError, read_committed};
use suanli_model::MANIFEST_FILE;

/// Writes a checkpoint as a task would: files under `ckpt/step-5/`, then the manifest
/// (temp file + rename). One file spans several upload parts (8 MiB each).
fn commit_checkpoint(dir: &Path) -> u64 {
    let root = dir.join("ckpt/step-5");
    std::fs::create_dir_all(root.join("opt")).unwrap();
    let big: Vec<u8> =
        (0..(17 * 1024 * 1024 + 123)).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(root.join("model.bin"), &big).unwrap();
    std::fs::write(root.join("opt/state.json"), br#"{"lr":0.1}"#).unwrap();
    std::fs::write(root.join("100% done #1.txt"), b"odd name").unwrap();
    std::fs::write(root.join("empty"), b"").unwrap();
    let bytes = big.len() as u64 + 10 + 8;
    let manifest = format!(r#"{{"step":5,"wall_time":1700000000,"path":"ckpt/step-5","bytes":{bytes}}}"#);
    std::fs::write(dir.join("m.tmp"), manifest).unwrap();
    std::fs::rename(dir.join("m.tmp"), dir.join(MANIFEST_FILE)).unwrap();
    bytes
}

/// Every file under `root`, relative, with its contents.
fn tree(root: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(root).unwrap().to_path_buf();
                out.push((rel, std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Put from node A, get on node B, then tamper with the stored manifest (through `raw`, the
/// same store seen directly, at `manifest_key`) and see each tampering refused.
async fn round_trip(node_a: Store, node_b: Store, raw: Arc<dyn ObjectStore>, manifest_key: &str, expected_uri: &str) {
    let a = tempfile::tempdir().unwrap();
    let bytes = commit_checkpoint(a.path());
    let committed = read_committed(a.path(), &ManifestLimits::default()).unwrap().expect("a committed manifest");
    let uri = node_a.put(7, 2, a.path(), &committed).await.unwrap();
    assert_eq!(uri, expected_uri);

    let b = tempfile::tempdir().unwrap();
    let (restore, manifest) = node_b.get(&uri, &b.path().join("restore")).await.unwrap();
    assert_eq!(restore, b.path().join("restore/ckpt/step-5"));
    assert_eq!(manifest, committed.manifest);
    assert_eq!(manifest.bytes, bytes);
    assert_eq!(tree(&restore), tree(&a.path().join("ckpt/step-5")));

    // A URI of another store or not a checkpoint key.
    let err = node_b.get("s3://elsewhere/jobs/7/a2-s5", &b.path().join("x")).await.unwrap_err();
    assert!(matches!(err, StoreError::ForeignUri { .. }), "{err}");

    // Tampered manifests: each is refused, naming the field.
    let location = object_store::path::Path::parse(manifest_key).unwrap();
    let tampered = [
        (format!(r#"{{"step":5,"wall_time":1,"path":"ckpt/step-5","bytes":{}}}"#, bytes + 1), "`bytes`"),
        (format!(r#"{{"step":5,"wall_time":1,"path":"ckpt/step-5","bytes":{}}}"#, bytes - 1), "`bytes`"),
        (format!(r#"{{"step":6,"wall_time":1,"path":"ckpt/step-5","bytes":{bytes}}}"#), "`step`"),
        (format!(r#"{{"step":5,"wall_time":1,"path":"other","bytes":{bytes}}}"#), "`path`"),
        (format!(r#"{{"step":5,"wall_time":1,"path":"../etc","bytes":{bytes}}}"#), "`path`"),
        (r#"{"step":5,"wall_time":1,"pa"#.to_owned(), "not a checkpoint manifest"),
        (
            format!(r#"{{"step":5,"wall_time":1,"path":"ckpt/step-5","bytes":{bytes}}}{}"#, " ".repeat(70 * 1024)),
            "max_manifest_bytes",
        ),
    ];
    for (i, (json, field)) in tampered.iter().enumerate() {
        raw.put(&location, json.clone().into_bytes().into()).await.unwrap();
        let into = b.path().join(format!("tampered-{i}"));
        let err = node_b.get(&uri, &into).await.unwrap_err().to_string();
        assert!(err.contains(field), "{json}: {err}");
    }
}

#[tokio::test]
async fn file_store_round_trip() {
    let store_dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", store_dir.path().display());
    let node_a = Store::open(&url, Path::new("/nonexistent")).unwrap();
    let node_b = Store::open(&url, Path::new("/nonexistent")).unwrap();
    let raw: Arc<dyn ObjectStore> =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(store_dir.path()).unwrap());
    round_trip(node_a, node_b, raw, &format!("jobs/7/a2-s5/{MANIFEST_FILE}"), &format!("{url}/jobs/7/a2-s5")).await;
    // The empty URL is the local default.
    let default = Store::open("", store_dir.path()).unwrap();
    assert_eq!(default.url(), url);
}

/// A moto server in its own process, killed on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn moto_server() -> PathBuf {
    if let Some(path) = std::env::var_os("SUANLI_MOTO_SERVER") {
        return PathBuf::from(path);
    }
    let tools = match std::env::var_os("SUANLI_TOOLS_DIR") {
        Some(dir) => PathBuf::from(dir),
        // <target>/debug/deps/<this test> → <target>/tools
        None => std::env::current_exe().unwrap().ancestors().nth(3).unwrap().join("tools"),
    };
    tools.join("moto/bin/moto_server")
}

/// Starts moto on a port it picks itself (`-p 0`) and reads the port from its banner.
fn start_moto() -> Moto {
    let exe = moto_server();
    assert!(
        exe.exists(),
        "moto_server not found at {} (set SUANLI_MOTO_SERVER to its path). scripts/test.sh \
         installs it; by hand: python3 -m venv target/tools/moto && \
         target/tools/moto/bin/pip install 'moto[server]==5.1.18'",
        exe.display()
    );
    let mut child = Command::new(&exe)
        .args(["-H", "127.0.0.1", "-p", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", exe.display()));
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    // Reads the banner, then keeps draining moto's request log so it never blocks on a full
    // pipe.
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.split("Running on http://127.0.0.1:").nth(1) {
                let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                if let (Some(tx), Ok(port)) = (tx.take(), port.parse::<u16>()) {
                    let _ = tx.send(port);
                }
            }
        }
    });
    let port = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("moto printed no `Running on http://127.0.0.1:<port>` within 60 s");
    Moto { child, port }
}

/// Creates a bucket with a bare HTTP request (moto takes it unsigned).
fn create_bucket(port: u16, bucket: &str) {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "create bucket: {response}");
}

#[tokio::test]
async fn s3_store_round_trip_against_moto() {
    let moto = start_moto();
    create_bucket(moto.port, "checkpoints");
    // What an agent's environment holds for moto (docs/checkpoints.md).
    let env: Vec<(String, String)> = [
        ("AWS_ENDPOINT", format!("http://127.0.0.1:{}", moto.port)),
        ("AWS_ALLOW_HTTP", "true".to_owned()),
        ("AWS_ACCESS_KEY_ID", "testing".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "testing".to_owned()),
        ("AWS_REGION", "us-east-1".to_owned()),
        ("PATH", "ignored".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let url = "s3://checkpoints/cluster-a";
    let node_a = Store::open_with_env(url, Path::new("/nonexistent"), env.clone()).unwrap();
    let node_b = Store::open_with_env(url, Path::new("/nonexistent"), env.clone()).unwrap();
    let mut raw = object_store::aws::AmazonS3Builder::new().with_bucket_name("checkpoints");
    for (k, v) in &env {
        if let Ok(key) = k.to_ascii_lowercase().parse() {
            raw = raw.with_config(key, v);
        }
    }
    let raw: Arc<dyn ObjectStore> = Arc::new(raw.build().unwrap());
    round_trip(
        node_a,
        node_b,
        Arc::clone(&raw),
        &format!("cluster-a/jobs/7/a2-s5/{MANIFEST_FILE}"),
        "s3://checkpoints/cluster-a/jobs/7/a2-s5",
    )
    .await;
    // The big file went up in parts and is whole in the bucket.
    let meta = raw
        .head(&object_store::path::Path::parse("cluster-a/jobs/7/a2-s5/ckpt/step-5/model.bin").unwrap())
        .await
        .unwrap();
    assert_eq!(meta.size, 17 * 1024 * 1024 + 123);
    // A bucket that does not exist fails with the store's URL in the message.
    let missing = Store::open_with_env("s3://no-such-bucket", Path::new("/x"), env).unwrap();
    let dir = tempfile::tempdir().unwrap();
    commit_checkpoint(dir.path());
    let c = read_committed(dir.path(), &ManifestLimits::default()).unwrap().unwrap();
    let err = missing.put(1, 1, dir.path(), &c).await.unwrap_err().to_string();
    assert!(err.contains("s3://no-such-bucket"), "{err}");
}
