//! Support for tests of plugin hosts: builds the plain-C example plugin
//! (`device-plugins/examples/c/plugin.c`) against this crate's header with the system C compiler.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiles the C example into `dir/lib<name>.so` with extra flags (`-DEXAMPLE_ABI_MAJOR=2`,
/// `-DEXAMPLE_CRASH=segv`, ...), mode 0755 so the agent's permission check accepts it. Uses
/// `$CC` when set, else `cc`. The error carries the compiler's output.
pub fn build_c_example(dir: &Path, name: &str, defines: &[&str]) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = dir.join(format!("lib{name}.so"));
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let res = Command::new(&cc)
        .args(["-shared", "-fPIC", "-std=c99", "-Wall", "-Werror", "-I"])
        .arg(root.join("../abi/include"))
        .args(defines)
        .arg("-o")
        .arg(&out)
        .arg(root.join("../examples/c/plugin.c"))
        .output()
        .map_err(|e| format!("running the C compiler {cc:?}: {e}"))?;
    if !res.status.success() {
        return Err(format!("{cc:?} {defines:?} failed:\n{}", String::from_utf8_lossy(&res.stderr)));
    }
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod 0755 {}: {e}", out.display()))?;
    Ok(out)
}
