//! Disk pressure: the agent measures the free space of its data directory's filesystem and,
//! below a threshold, reports the condition in its heartbeats; the control plane then places
//! no new work on the node until it clears. While under pressure, finished allocation
//! directories whose final status was acknowledged are deleted at once, whatever
//! `alloc_retention_s` says, to give the space back.
//!
//! ```text
//!  every disk_check_interval_ms: statvfs(data_dir) ─▶ free < threshold ─▶ "disk pressure: …"
//!      ─▶ heartbeat.disk_pressure ─▶ leader: NodeCondition ─▶ node takes no new work
//!      ─▶ reported allocation directories deleted (oldest first does not matter: all go)
//!  free ≥ threshold + 10 % ─▶ "" ─▶ NodeCondition (cleared) ─▶ schedulable again
//! ```

use crate::Agent;
use std::sync::Arc;
use std::time::Duration;

/// The pressure threshold in bytes for a filesystem of `total` bytes: the larger of the two
/// settings (0 for both: never under pressure).
pub(crate) fn threshold(total: u64, free_bytes: u64, free_percent: u64) -> u64 {
    free_bytes.max(total / 100 * free_percent)
}

/// Whether the node is under pressure with `free` bytes free against `threshold`, given
/// whether it was (`under`): it enters below the threshold and leaves once free space is back
/// above it by a tenth, so a filesystem hovering at the threshold does not flap.
pub(crate) fn under_pressure(free: u64, threshold: u64, under: bool) -> bool {
    if threshold == 0 {
        return false;
    }
    if under { free < threshold.saturating_add(threshold / 10) } else { free < threshold }
}

/// `n` bytes for people: `512 B`, `3.0 MiB`, `1.5 GiB`.
pub(crate) fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    #[allow(clippy::cast_precision_loss)] // a display figure
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Measures the data directory every `disk_check_interval_ms`, forever (until the agent stops).
pub(crate) async fn watch(agent: Arc<Agent>) {
    let every = Duration::from_millis(agent.cfg.disk_check_interval_ms);
    let mut failed = false;
    loop {
        let dir = agent.cfg.data_dir.clone();
        let was = !agent.disk_pressure.borrow().is_empty();
        match crate::sys::fs_space(&dir) {
            Ok((free, total)) => {
                failed = false;
                let t = threshold(total, agent.cfg.disk_pressure_free_bytes, agent.cfg.disk_pressure_free_percent);
                let under = under_pressure(free, t, was);
                if under && !was {
                    let msg = format!("disk pressure: {} free < {} in {}", human(free), human(t), dir.display());
                    tracing::warn!(free, threshold = t, "{msg}: the node takes no new work until it clears");
                    agent.disk_pressure.send_replace(msg);
                } else if !under && was {
                    tracing::info!(free, threshold = t, "disk pressure cleared");
                    agent.disk_pressure.send_replace(String::new());
                }
            }
            Err(e) => {
                if !failed {
                    tracing::warn!(dir = %dir.display(), error = %e, "measuring the free space of the data directory");
                }
                failed = true;
            }
        }
        if !agent.disk_pressure.borrow().is_empty() {
            let a = agent.clone();
            let removed = tokio::task::spawn_blocking(move || crate::tasks::gc_pass(&a, Duration::ZERO)).await;
            if let Ok(n) = removed
                && n > 0
            {
                tracing::info!(removed = n, "disk pressure: deleted finished allocation directories");
            }
        }
        if !crate::control::pause(&agent, every).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_enters_below_and_leaves_above_with_a_margin() {
        assert_eq!(threshold(1000 * 100, 0, 0), 0);
        assert_eq!(threshold(1000 * 100, 50, 0), 50);
        assert_eq!(threshold(1000 * 100, 50, 5), 5000, "the larger of the two");
        assert!(!under_pressure(0, 0, false), "no threshold: never");
        assert!(!under_pressure(1000, 1000, false));
        assert!(under_pressure(999, 1000, false));
        assert!(under_pressure(1050, 1000, true), "stays until 10 % above");
        assert!(!under_pressure(1100, 1000, true));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 * 1024 * 1024), "3.0 MiB");
        assert_eq!(human(1536 * 1024 * 1024), "1.5 GiB");
    }
}
