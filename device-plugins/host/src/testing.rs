//! Support for tests of plugin hosts: builds the plain-C example plugin
//! (`device-plugins/examples/c`: `plugin.c`, its payloads through protobuf-c) with its own
//! Makefile, outside cargo, exactly as a vendor builds it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds the C example into `dir/lib<name>.so` (mode 0755) with extra flags
/// (`-DEXAMPLE_ABI_MAJOR=2`, `-DEXAMPLE_CRASH=segv`, ...): `make -C device-plugins/examples/c
/// O=<dir>/<name>.build NAME=<name> EXTRA_CFLAGS=...`, which runs protoc-c on the shipped
/// schema and links libprotobuf-c (`scripts/setup.sh` installs both). Uses `$CC` when set. The
/// error carries make's output.
pub fn build_c_example(dir: &Path, name: &str, defines: &[&str]) -> Result<PathBuf, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/c");
    let build = dir.join(format!("{name}.build"));
    let res = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(&src)
        .arg(format!("O={}", build.display()))
        .arg(format!("NAME={name}"))
        .arg(format!("EXTRA_CFLAGS={}", defines.join(" ")))
        .output()
        .map_err(|e| format!("running make (is it installed? scripts/setup.sh installs it): {e}"))?;
    if !res.status.success() {
        return Err(format!(
            "make {defines:?} of the C example failed:\n{}{}",
            String::from_utf8_lossy(&res.stdout),
            String::from_utf8_lossy(&res.stderr)
        ));
    }
    let built = build.join(format!("lib{name}.so"));
    let out = dir.join(format!("lib{name}.so"));
    std::fs::copy(&built, &out).map_err(|e| format!("copying {} to {}: {e}", built.display(), out.display()))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod 0755 {}: {e}", out.display()))?;
    Ok(out)
}
