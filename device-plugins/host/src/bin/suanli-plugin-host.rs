//! `suanli-plugin-host LIB`: the plugin-host child on its own, the same as `suanli plugin-host
//! LIB` (see `suanli_device_host::process`). The crate's tests supervise it; an embedder without
//! the full `suanli` binary can point `supervisor::Options::host_cmd` at it.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    match (args.next(), args.next()) {
        (Some(lib), None) => suanli_device_host::process::serve(&PathBuf::from(lib)),
        _ => {
            eprintln!("usage: suanli-plugin-host LIB.so (started by the agent; frames on stdin/stdout)");
            ExitCode::from(2)
        }
    }
}
