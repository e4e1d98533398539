//! `#[repr(C)]` mirrors of `include/suanli_device_plugin.h`, field for field.
//!
//! The header is the contract; these types only restate it for Rust. Compile-time assertions below
//! pin every size and offset to the header's layout (pointer-sized fields, then two `uint32_t`),
//! and the integration test `header_layout` compiles the header with the system C compiler and
//! compares `sizeof`/`offsetof` with these values.
//!
//! Function pointers are `Option<unsafe extern "C" fn ..>`: a NULL pointer in C is `None`, so a
//! table copied from a plugin can be checked field by field before anything is called.

#![allow(unsafe_code)]

use std::ffi::c_char;
use std::mem::{offset_of, size_of};

/// The entry symbol's name, NUL-terminated (the header's `SUANLI_DP_ENTRY_SYMBOL`).
pub const ENTRY_SYMBOL: &[u8] = b"suanli_device_plugin_entry\0";

/// An error created by the plugin and destroyed by the agent (opaque).
#[repr(C)]
pub struct SuanliDpError {
    _opaque: [u8; 0],
}

/// One initialized plugin instance (opaque).
#[repr(C)]
pub struct SuanliDpPlugin {
    _opaque: [u8; 0],
}

/// Arguments of `init` (`SuanliDpInitArgs`).
#[repr(C)]
#[derive(Debug)]
pub struct SuanliDpInitArgs {
    /// In: `sizeof(SuanliDpInitArgs)` as the agent knows it.
    pub struct_size: usize,
    /// In: a `PluginConfig` payload, borrowed for the call.
    pub config: *const u8,
    /// In: the payload's length.
    pub config_len: usize,
    /// Out: the new instance; non-NULL when `init` returns NULL.
    pub plugin: *mut SuanliDpPlugin,
}

/// Arguments of every request/response call (`SuanliDpCallArgs`).
#[repr(C)]
#[derive(Debug)]
pub struct SuanliDpCallArgs {
    /// In: `sizeof(SuanliDpCallArgs)` as the agent knows it.
    pub struct_size: usize,
    /// In: the instance from `init`.
    pub plugin: *mut SuanliDpPlugin,
    /// In: the request payload (borrowed; may be NULL when the length is 0).
    pub request: *const u8,
    /// In: the request's length.
    pub request_len: usize,
    /// Out: the response payload, owned by the agent afterwards (freed with `buffer_free`).
    pub response: *mut u8,
    /// Out: the response's length.
    pub response_len: usize,
}

/// Arguments of `shutdown` (`SuanliDpShutdownArgs`).
#[repr(C)]
#[derive(Debug)]
pub struct SuanliDpShutdownArgs {
    /// In: `sizeof(SuanliDpShutdownArgs)` as the agent knows it.
    pub struct_size: usize,
    /// In: the instance; invalid after the call.
    pub plugin: *mut SuanliDpPlugin,
}

/// `void (*error_destroy)(SuanliDpError *)`.
pub type ErrorDestroyFn = unsafe extern "C" fn(*mut SuanliDpError);
/// `const char *(*error_message)(const SuanliDpError *)`.
pub type ErrorMessageFn = unsafe extern "C" fn(*const SuanliDpError) -> *const c_char;
/// `int32_t (*error_code)(const SuanliDpError *)`.
pub type ErrorCodeFn = unsafe extern "C" fn(*const SuanliDpError) -> i32;
/// `void (*buffer_free)(uint8_t *, size_t)`.
pub type BufferFreeFn = unsafe extern "C" fn(*mut u8, usize);
/// `SuanliDpError *(*init)(SuanliDpInitArgs *)`.
pub type InitFn = unsafe extern "C" fn(*mut SuanliDpInitArgs) -> *mut SuanliDpError;
/// `SuanliDpError *(*fingerprint|reserve|stats|health_events)(SuanliDpCallArgs *)`.
pub type CallFn = unsafe extern "C" fn(*mut SuanliDpCallArgs) -> *mut SuanliDpError;
/// `SuanliDpError *(*shutdown)(SuanliDpShutdownArgs *)`.
pub type ShutdownFn = unsafe extern "C" fn(*mut SuanliDpShutdownArgs) -> *mut SuanliDpError;
/// The entry point: `const SuanliDpApi *suanli_device_plugin_entry(uint32_t, uint32_t)`.
pub type EntryFn = unsafe extern "C" fn(host_abi_major: u32, host_abi_minor: u32) -> *const SuanliDpApi;

/// The function table a plugin returns from its entry point (`SuanliDpApi`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SuanliDpApi {
    /// `sizeof(SuanliDpApi)` as the plugin knows it: which of the fields below exist.
    pub struct_size: usize,
    /// The ABI major version the plugin implements.
    pub abi_major: u32,
    /// The ABI minor version the plugin implements.
    pub abi_minor: u32,
    /// Static, NUL-terminated plugin name.
    pub plugin_name: *const c_char,
    /// Static, NUL-terminated plugin version.
    pub plugin_version: *const c_char,
    // ---- ABI 1.0 ----
    /// Releases an error returned by a call.
    pub error_destroy: Option<ErrorDestroyFn>,
    /// An error's message (lives until `error_destroy`).
    pub error_message: Option<ErrorMessageFn>,
    /// An error's code (`SUANLI_DP_*`).
    pub error_code: Option<ErrorCodeFn>,
    /// Releases a response buffer.
    pub buffer_free: Option<BufferFreeFn>,
    /// `PluginConfig` in; sets `args.plugin`.
    pub init: Option<InitFn>,
    /// `FingerprintRequest` -> `Inventory`.
    pub fingerprint: Option<CallFn>,
    /// `ReserveRequest` -> `Reservation`.
    pub reserve: Option<CallFn>,
    /// `StatsRequest` -> `StatsResponse`.
    pub stats: Option<CallFn>,
    /// Releases the instance.
    pub shutdown: Option<ShutdownFn>,
    // ---- ABI 1.1 ----
    /// `HealthRequest` -> `HealthEvents`.
    pub health_events: Option<CallFn>,
    // ---- ABI 1.2 ----
    /// `ReleaseRequest` -> `ReleaseResponse`.
    pub release: Option<CallFn>,
    // ---- ABI 1.3 ----
    /// `ResetRequest` -> `ResetResponse`.
    pub reset: Option<CallFn>,
}

/// The size of the ABI 1.0 part of [`SuanliDpApi`]: a table must be at least this large.
pub const API_SIZE_1_0: usize = offset_of!(SuanliDpApi, health_events);
/// The size of the ABI 1.1 part of [`SuanliDpApi`] (up to `health_events`).
pub const API_SIZE_1_1: usize = offset_of!(SuanliDpApi, release);
/// The size of the ABI 1.2 part of [`SuanliDpApi`] (up to `release`).
pub const API_SIZE_1_2: usize = offset_of!(SuanliDpApi, reset);
/// The size of [`SuanliDpApi`] in ABI 1.3 (this crate's version).
pub const API_SIZE_1_3: usize = size_of::<SuanliDpApi>();

/// The table size each minor version of major 1 implies, oldest first: `(minor, size)`.
pub const API_SIZES: [(u32, usize); 4] = [(0, API_SIZE_1_0), (1, API_SIZE_1_1), (2, API_SIZE_1_2), (3, API_SIZE_1_3)];

/// The newest minor version whose whole table fits in `struct_size` bytes (`None`: not even 1.0).
pub fn minor_covered_by(struct_size: usize) -> Option<u32> {
    API_SIZES.iter().rev().find(|(_, size)| struct_size >= *size).map(|(minor, _)| *minor)
}
/// The size of the header fields every major version keeps (size, version, name, version string):
/// enough to say which ABI a plugin implements, even one of another major.
pub const API_SIZE_PREAMBLE: usize = offset_of!(SuanliDpApi, error_destroy);

const P: usize = size_of::<usize>();
const _: () = {
    // Pointers, function pointers and size_t are all one machine word on supported targets.
    assert!(size_of::<*const u8>() == P);
    assert!(size_of::<Option<CallFn>>() == P);
    // SuanliDpInitArgs: size_t, ptr, size_t, ptr.
    assert!(size_of::<SuanliDpInitArgs>() == 4 * P);
    assert!(offset_of!(SuanliDpInitArgs, plugin) == 3 * P);
    // SuanliDpCallArgs: size_t, ptr, ptr, size_t, ptr, size_t.
    assert!(size_of::<SuanliDpCallArgs>() == 6 * P);
    assert!(offset_of!(SuanliDpCallArgs, response_len) == 5 * P);
    // SuanliDpShutdownArgs: size_t, ptr.
    assert!(size_of::<SuanliDpShutdownArgs>() == 2 * P);
    // SuanliDpApi: size_t, u32, u32, 2 strings, 9 functions (1.0), 1 function (1.1), 1 (1.2), 1 (1.3).
    assert!(offset_of!(SuanliDpApi, abi_major) == P);
    assert!(offset_of!(SuanliDpApi, abi_minor) == P + 4);
    assert!(offset_of!(SuanliDpApi, plugin_name) == P + 8);
    assert!(API_SIZE_PREAMBLE == 3 * P + 8);
    assert!(offset_of!(SuanliDpApi, init) == 7 * P + 8);
    assert!(API_SIZE_1_0 == 12 * P + 8);
    assert!(API_SIZE_1_1 == 13 * P + 8);
    assert!(API_SIZE_1_2 == 14 * P + 8);
    assert!(API_SIZE_1_3 == 15 * P + 8);
};

/// A [`SuanliDpApi`] that may live in a `static`: the pointers it holds are to static strings and
/// to functions, which every thread may read.
#[derive(Debug)]
#[repr(transparent)]
pub struct StaticApi(pub SuanliDpApi);

// SAFETY: the table is immutable after construction and points only at NUL-terminated strings
// that live as long as the table and at `extern "C"` functions; sharing it across threads is what
// the header's threading rules expect.
unsafe impl Sync for StaticApi {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl Send for StaticApi {}
