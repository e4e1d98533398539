//! The in-process loader: opens a plugin library with `libloading`, checks it, and calls it.
//!
//! ```text
//!  Library::open(path)
//!    dlopen ─▶ symbol `suanli_device_plugin_entry`? ─▶ entry(1, 1) != NULL?
//!      ─▶ struct_size >= the 1.0 table? ─▶ abi_major == 1? ─▶ required functions non-NULL?
//!      ─▶ name/version: UTF-8, bounded
//!  Library::init(config) ─▶ Instance ─▶ fingerprint / reserve / stats / health_events ─▶ shutdown
//! ```
//!
//! Nothing but the entry point is called before every check has passed. The table is copied
//! only as far as the plugin's `struct_size` says it exists, so an older plugin's shorter table is
//! never read past its end. The `libloading::Library` stays loaded while a [`Library`] or any
//! [`Instance`] exists (they share an `Arc`).
//!
//! This runs plugin code in the calling process: a crash here is a crash of the caller. The agent
//! therefore uses it only inside the `suanli plugin-host` child (see [`crate::process`]).

#![allow(unsafe_code)]

use std::ffi::c_char;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use prost::Message;

use crate::{ABI_MAJOR, ABI_MINOR, Code, PluginError, pb};
use suanli_device_abi::ffi::{
    API_SIZE_1_0, API_SIZE_1_1, API_SIZE_1_2, API_SIZE_1_3, API_SIZE_PREAMBLE, CallFn, ENTRY_SYMBOL, EntryFn,
    SuanliDpApi, SuanliDpCallArgs, SuanliDpError, SuanliDpInitArgs, SuanliDpPlugin, SuanliDpShutdownArgs,
};

/// The longest plugin name or version string accepted, in bytes.
pub const MAX_NAME_LEN: usize = 64;
/// The longest error message read from a plugin, in bytes (longer ones are cut).
pub const MAX_ERROR_MESSAGE_LEN: usize = 4096;
/// The largest response payload accepted from a plugin, in bytes.
pub const MAX_RESPONSE_LEN: usize = 8 << 20;

/// Why a library was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The file or its directory could be replaced by someone other than root or the agent's user.
    #[error("plugin library {path}: {reason}")]
    Permissions {
        /// The library.
        path: PathBuf,
        /// What is wrong, e.g. "writable by group or others (mode 0775)".
        reason: String,
    },
    /// `dlopen` failed (missing file, not a shared library, wrong architecture, missing dependency).
    #[error("plugin library {path}: cannot load: {reason}")]
    Open {
        /// The library.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// The entry symbol is missing.
    #[error("plugin library {path}: no symbol `suanli_device_plugin_entry` ({reason}); is it a suanli device plugin?")]
    Symbol {
        /// The library.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// The entry point returned NULL.
    #[error(
        "plugin library {path}: suanli_device_plugin_entry returned NULL for agent ABI {ABI_MAJOR}.{ABI_MINOR} (the plugin cannot serve this agent)"
    )]
    EntryRefused {
        /// The library.
        path: PathBuf,
    },
    /// The table is smaller than the ABI 1.0 table.
    #[error("plugin library {path}: SuanliDpApi.struct_size is {size}, smaller than the ABI 1.0 table ({need} bytes)")]
    TableTooSmall {
        /// The library.
        path: PathBuf,
        /// What the plugin said.
        size: usize,
        /// The least accepted.
        need: usize,
    },
    /// The plugin implements another major version.
    #[error(
        "plugin {name} {version} implements device plugin ABI {major}.{minor}; this agent implements ABI {ABI_MAJOR}.{ABI_MINOR} (major versions must match)"
    )]
    MajorMismatch {
        /// The plugin's name (or "?" when unreadable).
        name: String,
        /// The plugin's version (or "?").
        version: String,
        /// The plugin's major version.
        major: u32,
        /// The plugin's minor version.
        minor: u32,
    },
    /// A required function pointer is NULL.
    #[error("plugin {name}: SuanliDpApi.{function} is NULL (required since ABI 1.0)")]
    MissingFunction {
        /// The plugin's name.
        name: String,
        /// The field.
        function: &'static str,
    },
    /// The name or version string is NULL, empty, too long or not UTF-8.
    #[error("plugin library {path}: SuanliDpApi.{field} {reason}")]
    BadString {
        /// The library.
        path: PathBuf,
        /// `plugin_name` or `plugin_version`.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Refuses a library file that someone other than root or the current user could replace: the file
/// (after following links) must be a regular file owned by root or the current user and not
/// writable by group or others, and so must its directory be (a directory with the sticky bit,
/// like /tmp, is not enough: the file's name could still be reused).
pub fn check_file_permissions(path: &Path) -> Result<(), LoadError> {
    let perm_err = |reason: String| LoadError::Permissions { path: path.to_path_buf(), reason };
    let real = std::fs::canonicalize(path).map_err(|e| perm_err(format!("cannot resolve path: {e}")))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let md = std::fs::metadata(&real).map_err(|e| perm_err(format!("cannot stat: {e}")))?;
    if !md.is_file() {
        return Err(perm_err("is not a regular file".into()));
    }
    check_owner_mode("file", &real, &md, me).map_err(perm_err)?;
    let dir = real.parent().unwrap_or(Path::new("/"));
    let dmd = std::fs::metadata(dir).map_err(|e| perm_err(format!("cannot stat directory {}: {e}", dir.display())))?;
    check_owner_mode("directory", dir, &dmd, me).map_err(perm_err)
}

fn check_owner_mode(what: &str, p: &Path, md: &std::fs::Metadata, me: u32) -> Result<(), String> {
    if md.uid() != 0 && md.uid() != me {
        return Err(format!(
            "{what} {} is owned by uid {}, not root or the agent's user (uid {me})",
            p.display(),
            md.uid()
        ));
    }
    let mode = md.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(format!("{what} {} is writable by group or others (mode {mode:04o}); use chmod go-w", p.display()));
    }
    Ok(())
}

/// What the loader learned from a library's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    /// `plugin_name`.
    pub name: String,
    /// `plugin_version`.
    pub version: String,
    /// The ABI the plugin implements.
    pub abi_major: u32,
    /// The ABI minor version the plugin implements.
    pub abi_minor: u32,
    /// The plugin's `struct_size` for its table.
    pub api_struct_size: usize,
    /// Whether `health_events` (ABI 1.1) is offered.
    pub has_health_events: bool,
    /// Whether `release` (ABI 1.2) is offered.
    pub has_release: bool,
    /// Whether `reset` (ABI 1.3) is offered.
    pub has_reset: bool,
    /// The newest minor version whose whole table `api_struct_size` covers: less than `abi_minor`
    /// when the plugin claims a version its table does not have (the newer calls are then unused).
    pub table_minor: u32,
}

struct Loaded {
    /// The copied table: fields the plugin's table does not have are NULL/None.
    api: SuanliDpApi,
    info: PluginInfo,
    /// Keeps the code of `api` mapped; `None` for a table linked into this binary (tests).
    _lib: Option<libloading::Library>,
}

// SAFETY: the table holds static strings and function pointers; the header requires plugins to
// accept calls from several threads at once, and `Instance` keeps init/shutdown exclusive.
unsafe impl Send for Loaded {}
// SAFETY: as above.
unsafe impl Sync for Loaded {}

/// A loaded and checked plugin library. Cheap to clone.
#[derive(Clone)]
pub struct Library {
    inner: Arc<Loaded>,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library").field("info", &self.inner.info).finish()
    }
}

impl Library {
    /// Loads `path` and checks the entry symbol, the version and the table before calling
    /// anything else. File permissions are not checked here: see [`check_file_permissions`].
    pub fn open(path: &Path) -> Result<Library, LoadError> {
        let open_err = |reason: String| LoadError::Open { path: path.to_path_buf(), reason };
        // An absolute path, so that dlopen never searches the system's library directories.
        let real = std::fs::canonicalize(path).map_err(|e| open_err(e.to_string()))?;
        // SAFETY: loading a library runs its initializers; choosing to trust this file is the
        // caller's decision (the agent checks its permissions and runs it in a child process).
        let lib = unsafe { libloading::Library::new(&real) }.map_err(|e| open_err(e.to_string()))?;
        let entry: EntryFn = {
            // SAFETY: the header declares the symbol with exactly EntryFn's signature.
            let sym = unsafe { lib.get::<EntryFn>(ENTRY_SYMBOL) }
                .map_err(|e| LoadError::Symbol { path: path.to_path_buf(), reason: e.to_string() })?;
            *sym
        };
        // SAFETY: the entry point takes two integers and returns a static table (or NULL).
        let table = unsafe { entry(ABI_MAJOR, ABI_MINOR) };
        // SAFETY: `table` is the entry point's result for the library that stays loaded in `lib`.
        let (api, info) = unsafe { read_table(path, table) }?;
        Ok(Library { inner: Arc::new(Loaded { api, info, _lib: Some(lib) }) })
    }

    /// Checks a table that is linked into this binary (tests of plugins and of this crate).
    ///
    /// # Safety
    /// `table` must be NULL or point at a table valid for the rest of the program.
    pub unsafe fn from_static_table(table: *const SuanliDpApi) -> Result<Library, LoadError> {
        // SAFETY: the caller's promise.
        let (api, info) = unsafe { read_table(Path::new("(linked in)"), table) }?;
        Ok(Library { inner: Arc::new(Loaded { api, info, _lib: None }) })
    }

    /// What the table says.
    pub fn info(&self) -> &PluginInfo {
        &self.inner.info
    }
    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }
    /// The plugin's own version.
    pub fn version(&self) -> &str {
        &self.inner.info.version
    }
    /// The ABI `(major, minor)` the plugin implements.
    pub fn abi(&self) -> (u32, u32) {
        (self.inner.info.abi_major, self.inner.info.abi_minor)
    }
    /// Whether the plugin offers `health_events` (ABI 1.1 and its table covers it).
    pub fn has_health_events(&self) -> bool {
        self.inner.info.has_health_events
    }
    /// Whether the plugin offers `release` (ABI 1.2 and its table covers it).
    pub fn has_release(&self) -> bool {
        self.inner.info.has_release
    }
    /// Whether the plugin offers `reset` (ABI 1.3 and its table covers it).
    pub fn has_reset(&self) -> bool {
        self.inner.info.has_reset
    }
    /// The calls the plugin offers, by name.
    pub fn calls(&self) -> Vec<String> {
        let mut calls: Vec<String> = ["fingerprint", "reserve", "stats"].iter().map(|s| s.to_string()).collect();
        if self.has_health_events() {
            calls.push("health_events".into());
        }
        if self.has_release() {
            calls.push("release".into());
        }
        if self.has_reset() {
            calls.push("reset".into());
        }
        calls
    }

    /// Calls `init` with `config`; the instance is shut down by [`Instance::shutdown`] or on drop.
    pub fn init(&self, config: &pb::PluginConfig) -> Result<Instance, PluginError> {
        let bytes = config.encode_to_vec();
        let mut args = SuanliDpInitArgs {
            struct_size: size_of::<SuanliDpInitArgs>(),
            config: bytes.as_ptr(),
            config_len: bytes.len(),
            plugin: std::ptr::null_mut(),
        };
        let init = self.inner.api.init.ok_or_else(|| PluginError::internal("init is NULL"))?;
        // SAFETY: a valid args struct; `bytes` outlives the call.
        let err = unsafe { init(&mut args) };
        // SAFETY: `err` comes from this plugin's init.
        unsafe { self.take_error(err, "init") }?;
        if args.plugin.is_null() {
            return Err(PluginError::internal(format!(
                "plugin {}: init returned no error and no instance (args.plugin is NULL)",
                self.name()
            )));
        }
        Ok(Instance { lib: self.clone(), plugin: RwLock::new(PluginPtr(args.plugin)) })
    }

    /// Turns a returned error pointer into a `PluginError` and destroys it.
    ///
    /// # Safety
    /// `err` must be NULL or an error just returned by one of this plugin's calls.
    unsafe fn take_error(&self, err: *mut SuanliDpError, call: &str) -> Result<(), PluginError> {
        if err.is_null() {
            return Ok(());
        }
        let api = &self.inner.api;
        // The table was checked to have all three error functions.
        let (Some(code_fn), Some(msg_fn), Some(destroy)) = (api.error_code, api.error_message, api.error_destroy)
        else {
            return Err(PluginError::internal(format!("{call} failed (the plugin has no error functions)")));
        };
        // SAFETY: a live error from this plugin; its message lives until error_destroy.
        let code = unsafe { code_fn(err) };
        // SAFETY: as above.
        let msg_ptr = unsafe { msg_fn(err) };
        // SAFETY: NUL-terminated per the header; read at most MAX_ERROR_MESSAGE_LEN bytes.
        let message = unsafe { read_bounded(msg_ptr, MAX_ERROR_MESSAGE_LEN) }
            .map(|(bytes, _)| String::from_utf8_lossy(bytes).into_owned())
            .unwrap_or_else(|| "(no message)".into());
        // SAFETY: destroyed exactly once, after its message was copied.
        unsafe { destroy(err) };
        let code = if (1..=6).contains(&code) {
            Code::from_raw(code)
        } else {
            return Err(PluginError::internal(format!("{call} returned an error with invalid code {code}: {message}")));
        };
        Err(PluginError::new(code, message))
    }
}

/// Copies and checks the table returned by an entry point.
///
/// # Safety
/// `table` must be NULL or point at a table whose first `struct_size` bytes are readable and stay
/// valid (with the strings and functions they point at) as long as the returned `SuanliDpApi` is
/// used.
unsafe fn read_table(path: &Path, table: *const SuanliDpApi) -> Result<(SuanliDpApi, PluginInfo), LoadError> {
    if table.is_null() {
        return Err(LoadError::EntryRefused { path: path.to_path_buf() });
    }
    // SAFETY: every table starts with its size_t struct_size.
    let size = unsafe { table.cast::<usize>().read_unaligned() };
    if size < API_SIZE_PREAMBLE {
        return Err(LoadError::TableTooSmall { path: path.to_path_buf(), size, need: API_SIZE_1_0 });
    }
    let mut api = std::mem::MaybeUninit::<SuanliDpApi>::zeroed();
    // SAFETY: copy only what the plugin says it has (at most our own size); the rest stays zero,
    // which is NULL for pointers and None for Option<fn>, both valid values.
    let api = unsafe {
        std::ptr::copy_nonoverlapping(table.cast::<u8>(), api.as_mut_ptr().cast::<u8>(), size.min(API_SIZE_1_3));
        api.assume_init()
    };
    // SAFETY: the strings are static in the loaded library (header: Ownership).
    let name = unsafe { read_name(path, "plugin_name", api.plugin_name) };
    // SAFETY: as above.
    let version = unsafe { read_name(path, "plugin_version", api.plugin_version) };
    if api.abi_major != ABI_MAJOR {
        return Err(LoadError::MajorMismatch {
            name: name.unwrap_or_else(|_| "?".into()),
            version: version.unwrap_or_else(|_| "?".into()),
            major: api.abi_major,
            minor: api.abi_minor,
        });
    }
    if size < API_SIZE_1_0 {
        return Err(LoadError::TableTooSmall { path: path.to_path_buf(), size, need: API_SIZE_1_0 });
    }
    let name = name?;
    let version = version?;
    let required: [(&'static str, bool); 9] = [
        ("error_destroy", api.error_destroy.is_some()),
        ("error_message", api.error_message.is_some()),
        ("error_code", api.error_code.is_some()),
        ("buffer_free", api.buffer_free.is_some()),
        ("init", api.init.is_some()),
        ("fingerprint", api.fingerprint.is_some()),
        ("reserve", api.reserve.is_some()),
        ("stats", api.stats.is_some()),
        ("shutdown", api.shutdown.is_some()),
    ];
    if let Some((function, _)) = required.iter().find(|(_, present)| !present) {
        return Err(LoadError::MissingFunction { name, function });
    }
    let has_health_events = api.abi_minor >= 1 && size >= API_SIZE_1_1 && api.health_events.is_some();
    let has_release = api.abi_minor >= 2 && size >= API_SIZE_1_2 && api.release.is_some();
    let has_reset = api.abi_minor >= 3 && size >= API_SIZE_1_3 && api.reset.is_some();
    let table_minor = suanli_device_abi::ffi::minor_covered_by(size).unwrap_or(0);
    let info = PluginInfo {
        name,
        version,
        abi_major: api.abi_major,
        abi_minor: api.abi_minor,
        api_struct_size: size,
        has_health_events,
        has_release,
        has_reset,
        table_minor,
    };
    Ok((api, info))
}

/// Reads a NUL-terminated string of at most `max` bytes: the bytes and whether it was cut.
///
/// # Safety
/// `p` must be NULL or point at a NUL-terminated string, or at least `max` readable bytes.
unsafe fn read_bounded<'a>(p: *const c_char, max: usize) -> Option<(&'a [u8], bool)> {
    if p.is_null() {
        return None;
    }
    let mut len = 0;
    // SAFETY: stops at the NUL or at `max`, whichever comes first.
    while len < max && unsafe { *p.add(len) } != 0 {
        len += 1;
    }
    // SAFETY: `len` bytes were just read.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    Some((bytes, len == max))
}

/// # Safety
/// As [`read_bounded`].
unsafe fn read_name(path: &Path, field: &'static str, p: *const c_char) -> Result<String, LoadError> {
    let bad = |reason: &str| LoadError::BadString { path: path.to_path_buf(), field, reason: reason.to_string() };
    // SAFETY: the caller's promise; MAX_NAME_LEN + 1 so that a name of exactly MAX_NAME_LEN fits.
    let Some((bytes, cut)) = (unsafe { read_bounded(p, MAX_NAME_LEN + 1) }) else {
        return Err(bad("is NULL"));
    };
    if cut {
        return Err(bad(&format!("is longer than {MAX_NAME_LEN} bytes")));
    }
    if bytes.is_empty() {
        return Err(bad("is empty"));
    }
    let s = std::str::from_utf8(bytes).map_err(|_| bad("is not valid UTF-8"))?;
    if s.chars().any(|c| c.is_control()) {
        return Err(bad("contains control characters"));
    }
    Ok(s.to_string())
}

#[derive(Debug)]
struct PluginPtr(*mut SuanliDpPlugin);

// SAFETY: the instance pointer is only passed back to the plugin, which must accept calls from
// any thread (header: Threads).
unsafe impl Send for PluginPtr {}
// SAFETY: as above.
unsafe impl Sync for PluginPtr {}

/// An initialized plugin instance. Calls may run from several threads at once; `shutdown` waits
/// for running calls and then makes further calls fail, as the header's threading rules require.
pub struct Instance {
    lib: Library,
    /// NULL after shutdown. Calls hold the read lock, shutdown the write lock.
    plugin: RwLock<PluginPtr>,
}

impl fmt::Debug for Instance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Instance").field("plugin", &self.lib.name()).finish()
    }
}

impl Instance {
    /// The library this instance came from.
    pub fn library(&self) -> &Library {
        &self.lib
    }

    /// `fingerprint`: every device, its health and topology.
    pub fn fingerprint(&self) -> Result<pb::Inventory, PluginError> {
        self.call_decoded("fingerprint", self.lib.inner.api.fingerprint, &pb::FingerprintRequest {})
    }
    /// `reserve`: what a task given these devices needs.
    pub fn reserve(&self, req: &pb::ReserveRequest) -> Result<pb::Reservation, PluginError> {
        self.call_decoded("reserve", self.lib.inner.api.reserve, req)
    }
    /// `stats`: utilization and counters.
    pub fn stats(&self, req: &pb::StatsRequest) -> Result<pb::StatsResponse, PluginError> {
        self.call_decoded("stats", self.lib.inner.api.stats, req)
    }
    /// `health_events` (ABI 1.1): events since the previous call; empty for a plugin without it.
    pub fn health_events(&self) -> Result<pb::HealthEvents, PluginError> {
        if !self.lib.has_health_events() {
            return Ok(pb::HealthEvents::default());
        }
        self.call_decoded("health_events", self.lib.inner.api.health_events, &pb::HealthRequest {})
    }

    /// `release` (ABI 1.2): the task holding the reservation ended; nothing for a plugin without it.
    pub fn release(&self, req: &pb::ReleaseRequest) -> Result<pb::ReleaseResponse, PluginError> {
        if !self.lib.has_release() {
            return Ok(pb::ReleaseResponse::default());
        }
        self.call_decoded("release", self.lib.inner.api.release, req)
    }

    /// `reset` (ABI 1.3) of one device; UNIMPLEMENTED for a plugin without it.
    pub fn reset(&self, req: &pb::ResetRequest) -> Result<pb::ResetResponse, PluginError> {
        self.call_decoded("reset", self.reset_fn()?, req)
    }

    fn reset_fn(&self) -> Result<Option<CallFn>, PluginError> {
        if !self.lib.has_reset() {
            return Err(PluginError::new(Code::Unimplemented, "reset: the plugin does not offer it (ABI before 1.3)"));
        }
        Ok(self.lib.inner.api.reset)
    }

    /// Calls `method` with an already encoded request; returns the encoded response.
    /// `method` is one of `fingerprint`, `reserve`, `stats`, `health_events`, `release`, `reset`.
    pub fn call_raw(&self, method: &str, request: &[u8]) -> Result<Vec<u8>, PluginError> {
        let api = &self.lib.inner.api;
        let f = match method {
            "fingerprint" => api.fingerprint,
            "reserve" => api.reserve,
            "stats" => api.stats,
            "health_events" if self.lib.has_health_events() => api.health_events,
            "health_events" => return Ok(Vec::new()),
            "release" if self.lib.has_release() => api.release,
            "release" => return Ok(Vec::new()),
            "reset" => self.reset_fn()?,
            other => {
                return Err(PluginError::new(
                    Code::Unimplemented,
                    format!(
                        "unknown method {other:?} (valid: fingerprint, reserve, stats, health_events, release, reset)"
                    ),
                ));
            }
        };
        self.call(method, f, request)
    }

    fn call_decoded<Req: Message, Resp: Message + Default>(
        &self,
        method: &str,
        f: Option<CallFn>,
        req: &Req,
    ) -> Result<Resp, PluginError> {
        let bytes = self.call(method, f, &req.encode_to_vec())?;
        Resp::decode(bytes.as_slice()).map_err(|e| {
            PluginError::internal(format!(
                "plugin {}: {method} returned a payload that does not decode: {e}",
                self.lib.name()
            ))
        })
    }

    fn call(&self, method: &str, f: Option<CallFn>, request: &[u8]) -> Result<Vec<u8>, PluginError> {
        let Some(f) = f else {
            return Err(PluginError::new(Code::Unimplemented, format!("plugin {} has no {method}", self.lib.name())));
        };
        let guard = self.plugin.read().unwrap_or_else(|e| e.into_inner());
        if guard.0.is_null() {
            return Err(PluginError::new(Code::FailedPrecondition, format!("{method}: the instance was shut down")));
        }
        let mut args = SuanliDpCallArgs {
            struct_size: size_of::<SuanliDpCallArgs>(),
            plugin: guard.0,
            request: if request.is_empty() { std::ptr::null() } else { request.as_ptr() },
            request_len: request.len(),
            response: std::ptr::null_mut(),
            response_len: 0,
        };
        // SAFETY: valid args; the instance is live (read lock held, not shut down).
        let err = unsafe { f(&mut args) };
        drop(guard);
        if !err.is_null() {
            // On error the response is not the agent's: the header says the plugin leaves it NULL.
            // SAFETY: `err` was just returned by this plugin.
            unsafe { self.lib.take_error(err, method) }?;
        }
        let (ptr, len) = (args.response, args.response_len);
        if ptr.is_null() {
            if len != 0 {
                return Err(PluginError::internal(format!(
                    "plugin {}: {method} returned response NULL with response_len {len}",
                    self.lib.name()
                )));
            }
            return Ok(Vec::new());
        }
        let out = if len > MAX_RESPONSE_LEN {
            Err(PluginError::internal(format!(
                "plugin {}: {method} returned {len} bytes, more than the limit of {MAX_RESPONSE_LEN}",
                self.lib.name()
            )))
        } else {
            // SAFETY: the plugin hands over `len` bytes at `ptr` (header: Ownership).
            Ok(unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec())
        };
        if let Some(free) = self.lib.inner.api.buffer_free {
            // SAFETY: returned exactly once, with the length the plugin gave.
            unsafe { free(ptr, len) };
        }
        out
    }

    /// Calls `shutdown` once: waits for running calls, then releases the instance. Later calls
    /// fail with `FailedPrecondition`; a second shutdown does nothing.
    pub fn shutdown(&self) -> Result<(), PluginError> {
        let mut guard = self.plugin.write().unwrap_or_else(|e| e.into_inner());
        if guard.0.is_null() {
            return Ok(());
        }
        let mut args = SuanliDpShutdownArgs { struct_size: size_of::<SuanliDpShutdownArgs>(), plugin: guard.0 };
        guard.0 = std::ptr::null_mut();
        let Some(f) = self.lib.inner.api.shutdown else {
            return Ok(());
        };
        // SAFETY: the live instance, with no call running (write lock held); it is never used again.
        let err = unsafe { f(&mut args) };
        // SAFETY: `err` was just returned by this plugin.
        unsafe { self.lib.take_error(err, "shutdown") }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(plugin = self.lib.name(), error = %e, "device plugin shutdown failed");
        }
    }
}
