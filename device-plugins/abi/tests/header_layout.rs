//! The Rust mirrors in `ffi` against the header itself: compiles a C program with the system C
//! compiler that prints every struct's size and every field's offset, and compares.

use std::mem::{offset_of, size_of};
use std::process::Command;

use suanli_device_abi::ffi::{
    API_SIZE_1_0, API_SIZE_1_1, SuanliDpApi, SuanliDpCallArgs, SuanliDpInitArgs, SuanliDpShutdownArgs,
};

const PROGRAM: &str = r#"
#include <stdio.h>
#include "suanli_device_plugin.h"
#define S(t) printf(#t " %zu\n", sizeof(t));
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(t, f));
int main(void) {
  S(SuanliDpInitArgs) O(SuanliDpInitArgs, config) O(SuanliDpInitArgs, config_len) O(SuanliDpInitArgs, plugin)
  S(SuanliDpCallArgs) O(SuanliDpCallArgs, plugin) O(SuanliDpCallArgs, request) O(SuanliDpCallArgs, request_len)
  O(SuanliDpCallArgs, response) O(SuanliDpCallArgs, response_len)
  S(SuanliDpShutdownArgs) O(SuanliDpShutdownArgs, plugin)
  S(SuanliDpApi) O(SuanliDpApi, abi_major) O(SuanliDpApi, abi_minor) O(SuanliDpApi, plugin_name)
  O(SuanliDpApi, plugin_version) O(SuanliDpApi, error_destroy) O(SuanliDpApi, error_message)
  O(SuanliDpApi, error_code) O(SuanliDpApi, buffer_free) O(SuanliDpApi, init) O(SuanliDpApi, fingerprint)
  O(SuanliDpApi, reserve) O(SuanliDpApi, stats) O(SuanliDpApi, shutdown) O(SuanliDpApi, health_events)
  O(SuanliDpApi, release)
  printf("SUANLI_DP_ABI %d.%d\n", SUANLI_DP_ABI_MAJOR, SUANLI_DP_ABI_MINOR);
  printf("SUANLI_DP_ENTRY_SYMBOL %s\n", SUANLI_DP_ENTRY_SYMBOL);
  printf("codes %d %d %d %d %d %d\n", SUANLI_DP_INVALID_ARGUMENT, SUANLI_DP_NOT_FOUND, SUANLI_DP_UNAVAILABLE,
         SUANLI_DP_FAILED_PRECONDITION, SUANLI_DP_UNIMPLEMENTED, SUANLI_DP_INTERNAL);
  return 0;
}
"#;

#[test]
fn rust_mirrors_match_the_c_header() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("layout.c");
    let exe = dir.path().join("layout");
    std::fs::write(&src, PROGRAM).expect("write layout.c");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    let out = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Werror", "-I", include, "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run the system C compiler `cc`");
    assert!(out.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(&exe).output().expect("run the layout program");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8");

    let expected = [
        ("SuanliDpInitArgs", size_of::<SuanliDpInitArgs>()),
        ("SuanliDpInitArgs.config", offset_of!(SuanliDpInitArgs, config)),
        ("SuanliDpInitArgs.config_len", offset_of!(SuanliDpInitArgs, config_len)),
        ("SuanliDpInitArgs.plugin", offset_of!(SuanliDpInitArgs, plugin)),
        ("SuanliDpCallArgs", size_of::<SuanliDpCallArgs>()),
        ("SuanliDpCallArgs.plugin", offset_of!(SuanliDpCallArgs, plugin)),
        ("SuanliDpCallArgs.request", offset_of!(SuanliDpCallArgs, request)),
        ("SuanliDpCallArgs.request_len", offset_of!(SuanliDpCallArgs, request_len)),
        ("SuanliDpCallArgs.response", offset_of!(SuanliDpCallArgs, response)),
        ("SuanliDpCallArgs.response_len", offset_of!(SuanliDpCallArgs, response_len)),
        ("SuanliDpShutdownArgs", size_of::<SuanliDpShutdownArgs>()),
        ("SuanliDpShutdownArgs.plugin", offset_of!(SuanliDpShutdownArgs, plugin)),
        ("SuanliDpApi", size_of::<SuanliDpApi>()),
        ("SuanliDpApi.abi_major", offset_of!(SuanliDpApi, abi_major)),
        ("SuanliDpApi.abi_minor", offset_of!(SuanliDpApi, abi_minor)),
        ("SuanliDpApi.plugin_name", offset_of!(SuanliDpApi, plugin_name)),
        ("SuanliDpApi.plugin_version", offset_of!(SuanliDpApi, plugin_version)),
        ("SuanliDpApi.error_destroy", offset_of!(SuanliDpApi, error_destroy)),
        ("SuanliDpApi.error_message", offset_of!(SuanliDpApi, error_message)),
        ("SuanliDpApi.error_code", offset_of!(SuanliDpApi, error_code)),
        ("SuanliDpApi.buffer_free", offset_of!(SuanliDpApi, buffer_free)),
        ("SuanliDpApi.init", offset_of!(SuanliDpApi, init)),
        ("SuanliDpApi.fingerprint", offset_of!(SuanliDpApi, fingerprint)),
        ("SuanliDpApi.reserve", offset_of!(SuanliDpApi, reserve)),
        ("SuanliDpApi.stats", offset_of!(SuanliDpApi, stats)),
        ("SuanliDpApi.shutdown", offset_of!(SuanliDpApi, shutdown)),
        ("SuanliDpApi.health_events", API_SIZE_1_0),
        ("SuanliDpApi.release", API_SIZE_1_1),
    ];
    for (name, rust) in expected {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} missing from the C program's output:\n{text}"));
        let c: usize = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number");
        assert_eq!(c, rust, "{name}: C says {c}, Rust says {rust}");
    }
    let abi = format!("SUANLI_DP_ABI {}.{}", suanli_device_abi::ABI_MAJOR, suanli_device_abi::ABI_MINOR);
    assert!(text.contains(&abi), "header version differs from the crate's {abi}:\n{text}");
    assert!(text.contains("SUANLI_DP_ENTRY_SYMBOL suanli_device_plugin_entry"), "{text}");
    let codes = [
        suanli_device_abi::Code::InvalidArgument,
        suanli_device_abi::Code::NotFound,
        suanli_device_abi::Code::Unavailable,
        suanli_device_abi::Code::FailedPrecondition,
        suanli_device_abi::Code::Unimplemented,
        suanli_device_abi::Code::Internal,
    ]
    .map(|c| (c as i32).to_string())
    .join(" ");
    assert!(text.contains(&format!("codes {codes}")), "{text}");
}
