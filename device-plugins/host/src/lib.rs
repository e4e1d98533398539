//! The host side of suanli's device plugin ABI: what loads, runs, supervises and checks plugins.
//!
//! - [`host`]: the loader built on `libloading`, which checks the symbol, the version and the
//!   struct sizes before it calls anything;
//! - [`process`]: the `suanli plugin-host LIB` child, and [`frame`], its frame protocol;
//! - [`supervisor`]: the agent's side, one child per plugin, with deadlines and restarts;
//! - [`check`]: the conformance kit behind `suanli plugin check`;
//! - `testing` (feature `testing`): builds the plain-C example plugin for tests of hosts.
//!
//! ```text
//!  agent ── supervisor::PluginProcess ══frames══▶ suanli plugin-host (process::serve)
//!                                                   └─ host::Library ──C ABI──▶ plugin.so
//!                                                                               └─ suanli_device_abi::export_plugin!
//!                                                                                  (Rust) or C
//! ```
//!
//! Plugins never link this crate: the plugin side (header mirrors, SDK, export macro) is
//! `suanli-device-abi`, which has no async runtime and no gRPC; this one adds tokio and
//! libloading. It never loads a plugin into the agent's own process: [`host`] runs only inside
//! the plugin-host child (and in tests).

pub mod check;
pub mod frame;
pub mod host;
pub mod process;
pub mod supervisor;
#[cfg(feature = "testing")]
pub mod testing;

#[cfg(test)]
mod tests;

/// The plugin side, re-exported for hosts: error codes, errors, the ABI version and the payload
/// messages (package `suanli.v1`).
pub use suanli_device_abi::{ABI_MAJOR, ABI_MINOR, Code, EventClass, PluginError, pb};
