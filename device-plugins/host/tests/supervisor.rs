//! The supervisor against real children (`suanli-plugin-host`) hosting real libraries: the C
//! example plugin built by the system C compiler, in its normal, version and fault variants.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use suanli_device_host::supervisor::{HostError, Options, PluginProcess, PluginState};
use suanli_device_host::{Code, pb};

const HOST: &str = env!("CARGO_BIN_EXE_suanli-plugin-host");

fn build_example(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    suanli_device_host::testing::build_c_example(dir, name, defines).unwrap_or_else(|e| panic!("{e}"))
}

fn opts() -> Options {
    Options {
        host_cmd: vec![HOST.into()],
        call_timeout: Duration::from_secs(5),
        fingerprint_timeout: Duration::from_secs(5),
        backoff_min: Duration::from_millis(100),
        backoff_max: Duration::from_secs(10),
        retry_unavailable_init: true,
    }
}

fn config() -> pb::PluginConfig {
    pb::PluginConfig { node_id: "n1".into(), ..Default::default() }
}

async fn wait_state(p: &PluginProcess, up: bool) -> PluginState {
    let mut rx = p.subscribe();
    let s = tokio::time::timeout(Duration::from_secs(20), rx.wait_for(|s| matches!(s, PluginState::Up) == up))
        .await
        .expect("state change within 20s")
        .expect("supervisor alive");
    s.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_plugin_serves_every_call_and_shuts_down() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Chatty: every call prints to stdout, which must not reach the frame channel.
    let lib = build_example(dir.path(), "example", &["-DEXAMPLE_CHATTY"]);
    let p = PluginProcess::start(lib, config(), opts()).await.expect("start");
    let hello = p.hello();
    assert_eq!((hello.plugin_name.as_str(), hello.plugin_version.as_str()), ("example", "0.1.0"));
    assert_eq!((hello.abi_major, hello.abi_minor), (1, 3));
    assert_eq!(hello.calls, ["fingerprint", "reserve", "stats", "health_events", "release", "reset"]);
    assert!(p.is_up());

    let inv = p.fingerprint().await.expect("fingerprint");
    let ids: Vec<&str> = inv.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["example0", "example1"]);
    assert!(inv.fake);
    assert_eq!(inv.devices[0].links[0].peer, "example1");
    assert_eq!(inv.devices[1].peer_group, Some(0));
    assert!(suanli_device_host::check::validate_inventory(&inv).is_empty());

    let r = p
        .reserve(pb::ReserveRequest {
            device_ids: vec!["example1".into(), "example0".into()],
            alloc_id: 7,
            ..Default::default()
        })
        .await
        .expect("reserve");
    assert_eq!(r.env.get("EXAMPLE_VISIBLE_DEVICES").map(String::as_str), Some("1,0"));
    let err = p
        .reserve(pb::ReserveRequest { device_ids: vec!["nope".into()], alloc_id: 7, ..Default::default() })
        .await
        .expect_err("unknown device");
    match err {
        HostError::Plugin(e) => {
            assert_eq!(e.code, Code::NotFound);
            assert!(e.message.contains("plugin example: reserve: ") && e.message.contains("\"nope\""), "{e}");
        }
        other => panic!("expected a plugin error, got {other}"),
    }

    let s = p.stats(pb::StatsRequest { device_ids: vec!["example1".into()] }).await.expect("stats");
    assert_eq!(s.devices.len(), 1);
    assert_eq!(s.devices[0].utilization_pct, 37.5);
    assert!(p.health_events().await.expect("health").events.is_empty());

    // Concurrent callers share one child.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let p = p.clone();
        tasks.spawn(async move {
            for _ in 0..20 {
                p.stats(pb::StatsRequest::default()).await.expect("stats");
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("task");
    }
    assert_eq!(p.restarts(), 0);

    p.shutdown().await;
    assert!(!p.is_up());
    assert!(matches!(p.stats(pb::StatsRequest::default()).await, Err(HostError::Down { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segfault_is_reported_and_the_plugin_is_restarted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = build_example(dir.path(), "segv", &["-DEXAMPLE_CRASH=segv"]);
    let p = PluginProcess::start(lib, config(), opts()).await.expect("start");

    // Other calls in flight when the child dies fail too, with the same detail.
    let stats = {
        let p = p.clone();
        tokio::spawn(async move {
            let mut out = Vec::new();
            for _ in 0..50 {
                out.push(p.stats(pb::StatsRequest::default()).await);
            }
            out
        })
    };
    let err = p.fingerprint().await.expect_err("fingerprint crashes");
    match &err {
        HostError::Crashed { method, detail } => {
            assert_eq!(method, "example.fingerprint");
            assert!(detail.contains("signal 11 (SIGSEGV)"), "{detail}");
        }
        other => panic!("expected Crashed, got {other}"),
    }
    assert!(!p.is_up(), "down right after the crash");
    match p.stats(pb::StatsRequest::default()).await {
        Err(HostError::Down { reason }) => assert!(reason.contains("SIGSEGV"), "{reason}"),
        Ok(_) => {} // already restarted: possible on a fast machine only after backoff_min
        Err(other) => panic!("expected Down, got {other}"),
    }
    for r in stats.await.expect("task") {
        match r {
            Ok(_) | Err(HostError::Down { .. }) | Err(HostError::Crashed { .. }) => {}
            Err(e) => panic!("unexpected {e}"),
        }
    }

    wait_state(&p, true).await;
    assert_eq!(p.restarts(), 1);
    // The restarted child ran init again and serves.
    assert_eq!(p.stats(pb::StatsRequest::default()).await.expect("stats after restart").devices.len(), 2);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_and_hang_are_reported_and_restarts_back_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = build_example(dir.path(), "abort", &["-DEXAMPLE_CRASH=abort"]);
    let p = PluginProcess::start(lib, config(), opts()).await.expect("start");
    let mut downtimes = Vec::new();
    for round in 0..3 {
        let err = p.fingerprint().await.expect_err("fingerprint aborts");
        assert!(err.to_string().contains("signal 6 (SIGABRT"), "round {round}: {err}");
        let t = Instant::now();
        wait_state(&p, true).await;
        downtimes.push(t.elapsed());
    }
    assert_eq!(p.restarts(), 3);
    // backoff_min 100ms, doubling (the child never stayed up for backoff_max).
    for (i, (d, min)) in downtimes.iter().zip([100u64, 200, 400]).enumerate() {
        assert!(*d >= Duration::from_millis(min), "restart {i} after {d:?}, expected at least {min}ms");
    }
    p.shutdown().await;

    let lib = build_example(dir.path(), "hang", &["-DEXAMPLE_CRASH=hang"]);
    let mut o = opts();
    o.fingerprint_timeout = Duration::from_millis(300);
    let p = PluginProcess::start(lib, config(), o).await.expect("start");
    let mut rx = p.subscribe();
    let t = Instant::now();
    let err = p.fingerprint().await.expect_err("fingerprint hangs");
    assert!(t.elapsed() < Duration::from_secs(5), "the deadline is 300ms, took {:?}", t.elapsed());
    assert!(
        matches!(&err, HostError::Timeout { method, after } if method == "example.fingerprint" && *after == Duration::from_millis(300)),
        "{err}"
    );
    let down = rx.wait_for(|s| !matches!(s, PluginState::Up)).await.expect("state").clone();
    assert!(
        matches!(&down, PluginState::Down { reason } if reason.contains("no reply to fingerprint within 300ms")),
        "{down:?}"
    );
    wait_state(&p, true).await;
    assert_eq!(p.restarts(), 1);
    assert!(p.stats(pb::StatsRequest::default()).await.is_ok());
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_are_negotiated_at_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let newer = build_example(dir.path(), "major2", &["-DEXAMPLE_ABI_MAJOR=2"]);
    let t = Instant::now();
    let err = PluginProcess::start(newer, config(), opts()).await.expect_err("newer major refused");
    let msg = err.to_string();
    assert!(matches!(err, HostError::Load(_)), "{err:?}");
    assert!(
        msg.contains("plugin example 0.1.0 implements device plugin ABI 2.3; this agent implements ABI 1.3"),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));

    let older = build_example(dir.path(), "minor0", &["-DEXAMPLE_ABI_MINOR=0"]);
    let p = PluginProcess::start(older, config(), opts()).await.expect("an older minor is accepted");
    assert_eq!((p.hello().abi_major, p.hello().abi_minor), (1, 0));
    assert!(!p.offers("health_events"));
    assert!(p.health_events().await.expect("empty for a 1.0 plugin").events.is_empty());
    assert_eq!(p.fingerprint().await.expect("fingerprint").devices.len(), 2);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_libraries_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let not_a_lib = dir.path().join("libjunk.so");
    std::fs::write(&not_a_lib, b"not an ELF file").expect("write");
    let err = PluginProcess::start(not_a_lib, config(), opts()).await.expect_err("junk refused");
    assert!(err.to_string().contains("cannot load"), "{err}");

    let src = dir.path().join("nosym.c");
    std::fs::write(&src, "int not_a_plugin(void) { return 1; }\n").expect("write");
    let nosym = dir.path().join("libnosym.so");
    let st = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&nosym).arg(&src).status().expect("cc");
    assert!(st.success());
    let err = PluginProcess::start(nosym, config(), opts()).await.expect_err("no entry refused");
    assert!(err.to_string().contains("no symbol `suanli_device_plugin_entry`"), "{err}");

    let err = PluginProcess::start(dir.path().join("missing.so"), config(), opts()).await.expect_err("missing");
    assert!(err.to_string().contains("missing.so"), "{err}");

    let mut bad = opts();
    bad.host_cmd = vec![dir.path().join("no-such-host").into()];
    let err = PluginProcess::start(dir.path().join("x.so"), config(), bad).await.expect_err("no host binary");
    assert!(err.to_string().contains("cannot start the plugin host"), "{err}");
}

/// The child's side of the protocol, driven by hand: requests before init, unknown methods and
/// an oversized frame are refused with reasons, never a crash.
#[test]
fn plugin_host_refuses_protocol_violations() {
    use std::io::{Read, Write};
    use suanli_device_host::frame;

    let dir = tempfile::tempdir().expect("tempdir");
    let lib = build_example(dir.path(), "example", &[]);
    let mut child = Command::new(HOST)
        .arg(&lib)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the host");
    let mut input = child.stdin.take().expect("stdin");
    let mut output = child.stdout.take().expect("stdout");
    let hello: pb::HostHello =
        frame::decode(&frame::read_sync(&mut output).expect("hello frame"), "HostHello").expect("hello");
    assert_eq!((hello.plugin_name.as_str(), hello.error.as_str()), ("example", ""));

    let mut call = |id: u64, method: &str, payload: Vec<u8>| -> pb::HostReply {
        let req = pb::HostRequest { id, method: method.into(), payload };
        frame::write_sync(&mut input, &req).expect("write request");
        frame::decode(&frame::read_sync(&mut output).expect("reply frame"), "HostReply").expect("reply")
    };
    let r = call(1, "stats", Vec::new());
    assert_eq!((r.id, r.code), (1, frame::code::PROTOCOL));
    assert!(r.error.contains("the first request must be init"), "{}", r.error);
    let r = call(2, "init", prost::Message::encode_to_vec(&config()));
    assert_eq!((r.id, r.code, r.error.as_str()), (2, 0, ""));
    let r = call(3, "init", Vec::new());
    assert!(r.code == frame::code::PROTOCOL && r.error.contains("already initialized"), "{r:?}");
    let r = call(4, "format_disk", Vec::new());
    assert!(r.code == frame::code::PROTOCOL && r.error.contains("unknown method \"format_disk\""), "{r:?}");
    let r = call(5, "reserve", vec![0xff, 0xff]);
    assert_eq!(r.code, Code::InvalidArgument as i32, "{r:?}");

    // An oversized frame: the child names the limit and exits with status 3.
    input.write_all(&((frame::MAX_FRAME_LEN as u32) + 1).to_le_bytes()).expect("write");
    drop(input);
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(3));
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("read stderr");
    assert!(err.contains(&format!("exceeds the limit of {} bytes", frame::MAX_FRAME_LEN)), "{err}");
}
