//! CPU and memory limits through cgroup v2, when the host offers it: one group per task under a
//! configurable parent (default `/sys/fs/cgroup/suanli`), `cpu.max` from the allocation's
//! `cpu_milli`, `memory.max` from its `memory_mib`. The shim joins the group before it starts
//! the command, so nothing of the task ever runs outside it. On a cgroup v1 or hybrid host
//! (or without permission) nothing is enforced and the agent says so once.

use std::path::{Path, PathBuf};

/// The scheduling period written to `cpu.max` (microseconds).
const CPU_PERIOD_US: u64 = 100_000;

/// A usable cgroup v2 parent.
#[derive(Debug, Clone)]
pub struct Cgroups {
    parent: PathBuf,
}

fn controllers(dir: &Path) -> std::io::Result<Vec<String>> {
    Ok(std::fs::read_to_string(dir.join("cgroup.controllers"))?.split_whitespace().map(String::from).collect())
}

fn enable(dir: &Path) -> std::io::Result<()> {
    let on = std::fs::read_to_string(dir.join("cgroup.subtree_control"))?;
    let on: Vec<&str> = on.split_whitespace().collect();
    if on.contains(&"cpu") && on.contains(&"memory") {
        return Ok(());
    }
    std::fs::write(dir.join("cgroup.subtree_control"), "+cpu +memory")
}

impl Cgroups {
    /// Sets up `parent` (its parent must be a cgroup v2 directory offering cpu and memory) and
    /// proves a task group can be made there; the error says why not.
    pub fn detect(parent: &Path) -> Result<Cgroups, String> {
        let root = parent.parent().ok_or_else(|| format!("{} has no parent directory", parent.display()))?;
        let c = controllers(root).map_err(|e| format!("{}/cgroup.controllers: {e}", root.display()))?;
        if !(c.iter().any(|x| x == "cpu") && c.iter().any(|x| x == "memory")) {
            return Err(format!("{} offers controllers {c:?}, not both cpu and memory", root.display()));
        }
        enable(root).map_err(|e| format!("enabling cpu and memory in {}: {e}", root.display()))?;
        match std::fs::create_dir(parent) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("creating {}: {e}", parent.display())),
        }
        enable(parent).map_err(|e| format!("enabling cpu and memory in {}: {e}", parent.display()))?;
        let probe = parent.join(format!("probe-{}", std::process::id()));
        std::fs::create_dir(&probe).map_err(|e| format!("creating {}: {e}", probe.display()))?;
        let ok = probe.join("cpu.max").exists() && probe.join("memory.max").exists();
        let _ = std::fs::remove_dir(&probe);
        if !ok {
            return Err(format!("{} has no cpu.max or memory.max", probe.display()));
        }
        Ok(Cgroups { parent: parent.to_owned() })
    }

    /// Creates the group of one task with its limits; the shim joins it.
    pub fn create(&self, name: &str, cpu_milli: u64, memory_mib: u64) -> std::io::Result<PathBuf> {
        let dir = self.parent.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        std::fs::write(dir.join("cpu.max"), cpu_max(cpu_milli))?;
        std::fs::write(dir.join("memory.max"), memory_max(memory_mib))?;
        Ok(dir)
    }

    /// Removes a task's group once its processes are gone (best effort; a group with
    /// processes left cannot be removed and is retried at the next cleanup).
    pub fn remove(&self, name: &str) {
        let _ = std::fs::remove_dir(self.parent.join(name));
    }
}

/// `cpu.max` for `cpu_milli` (0: no limit).
pub fn cpu_max(cpu_milli: u64) -> String {
    if cpu_milli == 0 {
        return format!("max {CPU_PERIOD_US}");
    }
    // 1000 milli = one CPU = one full period; at least 1 ms per period (the kernel's floor).
    let quota = (cpu_milli.saturating_mul(CPU_PERIOD_US) / 1000).max(1000);
    format!("{quota} {CPU_PERIOD_US}")
}

/// `memory.max` for `memory_mib` (0: no limit).
pub fn memory_max(memory_mib: u64) -> String {
    if memory_mib == 0 { "max".into() } else { memory_mib.saturating_mul(1024 * 1024).to_string() }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn limits() {
        assert_eq!(cpu_max(0), "max 100000");
        assert_eq!(cpu_max(1500), "150000 100000");
        assert_eq!(cpu_max(1), "1000 100000");
        assert_eq!(memory_max(0), "max");
        assert_eq!(memory_max(2), "2097152");
    }

    #[test]
    fn a_v1_host_is_refused_with_a_reason() {
        let d = tempfile::tempdir().unwrap();
        let e = Cgroups::detect(&d.path().join("suanli")).unwrap_err();
        assert!(e.contains("cgroup.controllers"), "{e}");
    }
}
