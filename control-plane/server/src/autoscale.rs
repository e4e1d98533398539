//! The leader's autoscaler (docs/services.md, "Autoscaling"): once a second it reads the
//! services with `service.autoscale` and their replicas' reported loads from the replicated
//! state, lets each one's [`AutoscaleHistory`] decide (at most once per `period_s`), and
//! proposes a scale (`update_service` with a new `replicas`) where the decision differs.
//!
//! ```text
//!  agents ─▶ ReportStatus(load_milli) ─▶ alloc_ready: Alloc.load = (value, time)
//!  leader, every 1 s ─▶ State::autoscaled(now) ─▶ AutoscaleHistory::decide ─▶ update_service
//! ```
//!
//! The recommendations live in this leader's memory only: a new leader starts without them
//! (it scales up at once, and down only after a whole `scale_down_window_s`).

use crate::core::Core;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use suanli_model::JobId;
use suanli_state::{AutoscaleHistory, Command, UpdateService};
use tokio::sync::watch;

/// Runs while the server runs; decides only while it leads.
pub async fn autoscaling(core: Arc<Core>, mut stop: watch::Receiver<bool>) {
    let mut history: BTreeMap<JobId, AutoscaleHistory> = BTreeMap::new();
    loop {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
        if !core.is_leader() || core.halted().is_some() {
            history.clear();
            continue;
        }
        let now = core.now_s();
        let services = core.state.read(|s| s.autoscaled(now));
        history.retain(|id, _| services.iter().any(|x| x.job == *id));
        for x in services {
            let h = history.entry(x.job).or_default();
            let Some(wanted) = h.decide(&x.autoscale, x.current, &x.loads, now) else { continue };
            if wanted == x.current {
                continue;
            }
            let spec = x.scaled_spec(wanted);
            let avg = x.loads.iter().sum::<u64>() / x.loads.len().max(1) as u64;
            let cmd = Command::UpdateService(Box::new(UpdateService { job: x.job, spec, now }));
            match core.propose_local(cmd).await {
                Ok(_) => {
                    tracing::info!(job = %x.job, from = x.current, to = wanted, average_load = avg as f64 / 1000.0, target = x.autoscale.target, "autoscaled");
                    core.kick.notify_one();
                }
                Err(e) => tracing::warn!(job = %x.job, error = %e.message(), "autoscaling not committed"),
            }
        }
    }
}
