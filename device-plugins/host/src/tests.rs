//! In-process tests of both sides of the boundary: a Rust plugin exported through
//! `export::Table` (what `export_plugin!` builds) and called through `host::Library`.

#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};

use crate::host::{Library, LoadError};
use crate::{Code, PluginError, pb};
use suanli_device_abi::DevicePlugin;
use suanli_device_abi::export::Table;
use suanli_device_abi::ffi::{API_SIZE_1_0, SuanliDpApi};

static SHUTDOWNS: AtomicU32 = AtomicU32::new(0);

struct TestPlugin {
    node: String,
}

impl DevicePlugin for TestPlugin {
    const NAME: &'static str = "test";
    const VERSION: &'static str = "9.9.9";

    fn init(config: pb::PluginConfig) -> Result<Self, PluginError> {
        match config.options.get("mode").map(String::as_str) {
            Some("fail") => Err(PluginError::unavailable("no vendor library")),
            Some("panic") => panic!("init exploded"),
            _ => Ok(TestPlugin { node: config.node_id }),
        }
    }
    fn fingerprint(&self) -> Result<pb::Inventory, PluginError> {
        if self.node == "panic" {
            panic!("fingerprint exploded on {}", self.node);
        }
        Ok(pb::Inventory {
            vendor: "test".into(),
            devices: vec![pb::PluginDevice {
                id: "t0".into(),
                kind: "gpu".into(),
                model: "T".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
    }
    fn reserve(&self, req: pb::ReserveRequest) -> Result<pb::Reservation, PluginError> {
        if req.device_ids != ["t0"] {
            return Err(PluginError::not_found(format!("unknown devices {:?}", req.device_ids)));
        }
        let mut r = pb::Reservation::default();
        r.env.insert("TEST_VISIBLE".into(), "0".into());
        Ok(r)
    }
    fn stats(&self, _req: pb::StatsRequest) -> Result<pb::StatsResponse, PluginError> {
        // An empty message: a NULL response buffer of length 0.
        Ok(pb::StatsResponse::default())
    }
    fn shutdown(&self) {
        SHUTDOWNS.fetch_add(1, Ordering::SeqCst);
    }
}

fn table() -> &'static SuanliDpApi {
    let t: &'static Table = Box::leak(Box::new(Table::new::<TestPlugin>().expect("valid name and version")));
    t.api()
}

fn library(api: &'static SuanliDpApi) -> Result<Library, LoadError> {
    // SAFETY: a leaked, static table of functions linked into this test binary.
    unsafe { Library::from_static_table(api) }
}

fn config(node: &str, mode: Option<&str>) -> pb::PluginConfig {
    let mut c = pb::PluginConfig { node_id: node.into(), ..Default::default() };
    if let Some(m) = mode {
        c.options.insert("mode".into(), m.into());
    }
    c
}

#[test]
fn calls_cross_the_boundary_and_panics_become_errors() {
    let lib = library(table()).expect("load");
    assert_eq!((lib.name(), lib.version(), lib.abi()), ("test", "9.9.9", (1, 3)));
    assert!(lib.has_health_events());

    let inst = lib.init(&config("n1", None)).expect("init");
    assert_eq!(inst.fingerprint().expect("fingerprint").devices[0].id, "t0");
    let r = inst
        .reserve(&pb::ReserveRequest { device_ids: vec!["t0".into()], alloc_id: 1, ..Default::default() })
        .expect("reserve");
    assert_eq!(r.env["TEST_VISIBLE"], "0");
    let e = inst
        .reserve(&pb::ReserveRequest { device_ids: vec!["x".into()], alloc_id: 1, ..Default::default() })
        .expect_err("not found");
    assert_eq!(e.code, Code::NotFound);
    assert!(e.message.contains("unknown devices"), "{e}");
    assert_eq!(inst.stats(&pb::StatsRequest::default()).expect("stats"), pb::StatsResponse::default());
    assert!(inst.health_events().expect("default health events").events.is_empty());
    let e = inst.call_raw("bogus", &[]).expect_err("unknown method");
    assert_eq!(e.code, Code::Unimplemented);
    // A request that is not a protobuf is refused by the plugin side, not a crash.
    let e = inst.call_raw("reserve", &[0xff, 0xff, 0xff]).expect_err("garbage request");
    assert_eq!(e.code, Code::InvalidArgument);

    let before = SHUTDOWNS.load(Ordering::SeqCst);
    inst.shutdown().expect("shutdown");
    assert_eq!(SHUTDOWNS.load(Ordering::SeqCst), before + 1);
    assert_eq!(inst.fingerprint().expect_err("after shutdown").code, Code::FailedPrecondition);
    inst.shutdown().expect("a second shutdown does nothing");
    drop(inst);
    assert_eq!(SHUTDOWNS.load(Ordering::SeqCst), before + 1, "shut down once only");

    let panicky = lib.init(&config("panic", None)).expect("init");
    let e = panicky.fingerprint().expect_err("panic caught");
    assert_eq!(e.code, Code::Internal);
    assert!(e.message.contains("plugin panicked in fingerprint: fingerprint exploded on panic"), "{e}");
    // The instance survives its panic.
    assert!(panicky.stats(&pb::StatsRequest::default()).is_ok());
    drop(panicky); // shutdown on drop

    let e = lib.init(&config("n", Some("fail"))).expect_err("init error");
    assert_eq!((e.code, e.message.as_str()), (Code::Unavailable, "no vendor library"));
    let e = lib.init(&config("n", Some("panic"))).expect_err("init panic");
    assert_eq!(e.code, Code::Internal);
    assert!(e.message.contains("init exploded"), "{e}");
}

#[test]
fn concurrent_calls_on_one_instance() {
    let lib = library(table()).expect("load");
    let inst = lib.init(&config("n1", None)).expect("init");
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..100 {
                    inst.fingerprint().expect("fingerprint");
                    inst.reserve(&pb::ReserveRequest {
                        device_ids: vec!["t0".into()],
                        alloc_id: 1,
                        ..Default::default()
                    })
                    .expect("reserve");
                }
            });
        }
    });
}

fn copy_of(api: &SuanliDpApi) -> &'static mut SuanliDpApi {
    Box::leak(Box::new(*api))
}

#[test]
fn tables_are_checked_before_anything_is_called() {
    let good = table();

    let newer = copy_of(good);
    newer.abi_major = 2;
    newer.abi_minor = 0;
    let e = library(newer).expect_err("newer major");
    assert_eq!(
        e.to_string(),
        "plugin test 9.9.9 implements device plugin ABI 2.0; this agent implements ABI 1.3 (major versions must match)"
    );

    let older = copy_of(good);
    older.abi_minor = 0;
    older.struct_size = API_SIZE_1_0;
    let lib = library(older).expect("an older minor loads");
    assert!(!lib.has_health_events());
    let inst = lib.init(&config("n", None)).expect("init");
    assert!(inst.health_events().expect("empty").events.is_empty());
    drop(inst);

    // 1.3 claimed, but the table is too short to hold health_events: not offered, and the
    // loader says which minor the table covers (the kit fails the mismatch).
    let short = copy_of(good);
    short.struct_size = API_SIZE_1_0;
    let lib = library(short).expect("loads");
    assert!(!lib.has_health_events() && !lib.has_release());
    assert_eq!((lib.info().abi_minor, lib.info().table_minor), (3, 0));

    let tiny = copy_of(good);
    tiny.struct_size = 16;
    assert!(matches!(library(tiny), Err(LoadError::TableTooSmall { size: 16, .. })));

    let missing = copy_of(good);
    missing.reserve = None;
    let e = library(missing).expect_err("missing reserve");
    assert_eq!(e.to_string(), "plugin test: SuanliDpApi.reserve is NULL (required since ABI 1.0)");

    let unnamed = copy_of(good);
    unnamed.plugin_name = std::ptr::null();
    assert!(library(unnamed).expect_err("no name").to_string().contains("plugin_name is NULL"));

    let long = copy_of(good);
    let name: &'static std::ffi::CStr =
        Box::leak(std::ffi::CString::new("x".repeat(200)).expect("no NUL").into_boxed_c_str());
    long.plugin_name = name.as_ptr();
    assert!(library(long).expect_err("long name").to_string().contains("longer than 64 bytes"));
}

#[test]
fn null_table_is_refused() {
    // SAFETY: NULL is allowed.
    let e = unsafe { Library::from_static_table(std::ptr::null()) }.expect_err("NULL table");
    assert!(matches!(e, LoadError::EntryRefused { .. }));
}

#[test]
fn file_permissions_are_checked() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("libp.so");
    std::fs::write(&f, b"x").expect("write");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    crate::host::check_file_permissions(&f).expect("0755 file in a 0755 dir");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o775)).expect("chmod");
    let e = crate::host::check_file_permissions(&f).expect_err("group-writable file");
    assert!(e.to_string().contains("writable by group or others (mode 0775)"), "{e}");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod dir");
    let e = crate::host::check_file_permissions(&f).expect_err("world-writable directory");
    assert!(e.to_string().contains("directory"), "{e}");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod dir");
}
