//! What a replay measured ([`ReplayReport`]) and its renderings: the summary table, the time
//! series as CSV (JSON comes from the serde derives).

use serde::Serialize;
use std::fmt::Write as _;

/// Percentiles of a set of durations, seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Values counted.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: u64,
    /// 95th percentile.
    pub p95: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest value.
    pub max: u64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `v` (sorted in place).
    pub fn of(v: &mut [u64]) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_unstable();
        let n = v.len();
        let at = |p: u64| v[((p as usize * n).div_ceil(100)).clamp(1, n) - 1];
        Self {
            count: n as u64,
            mean: v.iter().map(|&x| x as f64).sum::<f64>() / n as f64,
            p50: at(50),
            p95: at(95),
            p99: at(99),
            max: v[n - 1],
        }
    }
}

/// One point of the utilization time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Simulated time, seconds.
    pub t_s: u64,
    /// Events processed so far.
    pub events: u64,
    /// Jobs waiting.
    pub pending_jobs: u64,
    /// Jobs running.
    pub running_jobs: u64,
    /// GPU milli allocated.
    pub gpu_alloc_milli: u64,
    /// Allocated GPU milli as % of the cluster's GPU milli.
    pub gpu_util_pct: f64,
    /// Expected fragmented GPU milli (against the recent workload) as % of the cluster's GPUs.
    pub frag_pct: f64,
    /// The same as % of the unallocated GPU milli.
    pub frag_of_free_pct: f64,
}

/// Per-queue results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueReport {
    /// Queue.
    pub queue: String,
    /// Owning team.
    pub team: String,
    /// Jobs submitted to it.
    pub jobs: u64,
    /// Its jobs that completed.
    pub completed: u64,
    /// Its jobs that never started.
    pub never_started: u64,
    /// GPU-hours allocated to it (including work later lost to preemption); a parent queue
    /// counts its subtree.
    pub gpu_hours: f64,
    /// Those GPU-hours as % of the cluster's GPU-hours over the replayed span.
    pub share_pct: f64,
    /// Largest used/nominal (dominant over the dimensions with a finite, non-zero nominal), %.
    /// `None` for a queue without quota.
    pub quota_use_max_pct: Option<f64>,
    /// Time-weighted mean of used/nominal over the replayed span, %.
    pub quota_use_mean_pct: Option<f64>,
    /// Times its jobs were preempted.
    pub preemptions: u64,
    /// Median wait of its started jobs, seconds.
    pub wait_p50_s: u64,
}

/// A job that never started, with the engine's last reason.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Unstarted {
    /// Pod name.
    pub name: String,
    /// Queue.
    pub queue: String,
    /// Why it waited, as the engine last said.
    pub reason: String,
}

/// What happened to one job (with [`super::ReplayOptions::record_jobs`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobOutcome {
    /// Pod name.
    pub name: String,
    /// Queue.
    pub queue: String,
    /// Submission time, seconds.
    pub submitted_s: u64,
    /// First start, seconds (`None`: never started).
    pub first_start_s: Option<u64>,
    /// Completion, seconds (`None`: never completed).
    pub done_s: Option<u64>,
    /// Times it was preempted.
    pub preemptions: u32,
}

/// One inference service's results (docs/sim.md, "Inference services").
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceReport {
    /// Service name.
    pub name: String,
    /// Scale-out times, seconds: from the autoscaler's scale-up (at the first load report
    /// over the target) until the replicas it asked for are all ready, as the state machine
    /// measures it for `suanli_inference_scale_out_seconds`.
    pub scale_out_s: Percentiles,
    /// Scale-ups the autoscaler committed.
    pub scale_ups: u64,
    /// Scale-downs the autoscaler committed.
    pub scale_downs: u64,
    /// Fewest ready replicas seen at a load report, once the first replica was ready.
    pub ready_min: u32,
    /// Most ready replicas seen at a load report.
    pub ready_max: u32,
    /// Time-weighted mean of ready replicas.
    pub ready_mean: f64,
    /// % of the time the demand exceeded the ready replicas' capacity (SLO violated).
    pub slo_violation_pct: f64,
    /// % of the requests beyond the ready replicas' capacity.
    pub unserved_pct: f64,
    /// GPU-hours its replicas held.
    pub gpu_hours: f64,
}

/// What the inference services of a replay measured, and the batch work beside them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InferenceReport {
    /// `shared` (services and batch on every node, services preempt batch) or `static`
    /// (services on a partition of their own, sized for their peak).
    pub mode: String,
    /// GPU milli of the inference partition (`static` only; 0 when shared).
    pub partition_gpu_milli: u64,
    /// Per service, in file order.
    pub services: Vec<ServiceReport>,
    /// Scale-out times of every service, seconds.
    pub scale_out_s: Percentiles,
    /// % of service-time over the SLO (all services, time-weighted).
    pub slo_violation_pct: f64,
    /// % of all requests beyond the ready replicas' capacity.
    pub unserved_pct: f64,
    /// GPU-hours the services held.
    pub service_gpu_hours: f64,
    /// GPU-hours batch work held (including work later lost to preemption).
    pub batch_gpu_hours: f64,
    /// Batch goodput: batch GPU-hours minus those lost to preemption.
    pub batch_goodput_gpu_hours: f64,
    /// Batch goodput as % of the cluster's GPU-hours over the replayed span.
    pub batch_goodput_pct: f64,
    /// Batch jobs completed.
    pub batch_completed: u64,
}

impl InferenceReport {
    fn table(&self, s: &mut String) {
        let h = |x: u64| format_duration(x);
        let _ = writeln!(
            s,
            "inference ({}{}): scale-outs {}, scale-out p50 {} p99 {} max {}; SLO violated {:.2}% of service-time, {:.3}% of requests unserved",
            self.mode,
            if self.partition_gpu_milli > 0 {
                format!(", partition of {:.0} GPU(s)", self.partition_gpu_milli as f64 / 1000.0)
            } else {
                String::new()
            },
            self.scale_out_s.count,
            h(self.scale_out_s.p50),
            h(self.scale_out_s.p99),
            h(self.scale_out_s.max),
            self.slo_violation_pct,
            self.unserved_pct
        );
        let _ = writeln!(
            s,
            "{:<20} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10}",
            "service", "ups", "downs", "ready", "min", "max", "p99 out", "SLO viol%", "unserved%", "GPU-hours"
        );
        for x in &self.services {
            let _ = writeln!(
                s,
                "{:<20} {:>6} {:>6} {:>8.2} {:>8} {:>8} {:>8} {:>9.2} {:>10.3} {:>10.1}",
                x.name,
                x.scale_ups,
                x.scale_downs,
                x.ready_mean,
                x.ready_min,
                x.ready_max,
                h(x.scale_out_s.p99),
                x.slo_violation_pct,
                x.unserved_pct,
                x.gpu_hours
            );
        }
        let _ = writeln!(
            s,
            "batch: {} completed, {:.1} GPU-h held, goodput {:.1} GPU-h ({:.2}% of the cluster); services {:.1} GPU-h",
            self.batch_completed,
            self.batch_gpu_hours,
            self.batch_goodput_gpu_hours,
            self.batch_goodput_pct,
            self.service_gpu_hours
        );
    }
}

/// Everything a replay measured. Deterministic for a seed: it holds no wall-clock times.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Policy.
    pub policy: String,
    /// Seed.
    pub seed: u64,
    /// Pass interval, seconds.
    pub interval_s: u64,
    /// Nodes in the cluster.
    pub nodes: u64,
    /// GPUs in the cluster (milli).
    pub gpu_milli: u64,
    /// Jobs in the trace.
    pub jobs: u64,
    /// Jobs that ran to completion.
    pub completed: u64,
    /// Jobs still running when the replay ended (pods without a duration, mostly).
    pub running_at_end: u64,
    /// Jobs that never started.
    pub never_started: u64,
    /// Jobs that started, were preempted and were still waiting to start again at the end.
    pub requeued_at_end: u64,
    /// Jobs preempted at least once.
    pub preempted_jobs: u64,
    /// Preemptions in all (a job may be preempted more than once).
    pub preemptions: u64,
    /// GPU-hours of work lost to preemption (since the victims' last checkpoints).
    pub lost_gpu_hours: f64,
    /// Scheduling passes run.
    pub passes: u64,
    /// Events processed.
    pub events: u64,
    /// First arrival, seconds.
    pub start_s: u64,
    /// Time of the last event, seconds.
    pub end_s: u64,
    /// Wait from submission to first start, seconds (started jobs).
    pub wait_s: Percentiles,
    /// Job completion time, submission to completion, seconds (completed jobs).
    pub jct_s: Percentiles,
    /// Time-weighted mean GPU allocation, % of the cluster's GPUs.
    pub gpu_util_mean_pct: f64,
    /// Highest GPU allocation, %.
    pub gpu_util_max_pct: f64,
    /// Mean fragmentation over the samples, % of the cluster's GPUs.
    pub frag_mean_pct: f64,
    /// Replica pairs of jobs placed with several replicas at once (gangs), over the replay.
    pub gang_pairs: u64,
    /// Communication cost: % of those pairs whose two nodes are in different network blocks
    /// (`topology.suanli.io/block`; a node without the label is a block of its own).
    pub gang_pairs_cross_block_pct: f64,
    /// Job placements the state machine refused when it re-checked a plan (the job stayed
    /// pending, as on a server). Not written when 0.
    #[serde(skip_serializing_if = "is_zero")]
    pub refused_placements: u64,
    /// Preemptions the state machine refused. Not written when 0.
    #[serde(skip_serializing_if = "is_zero")]
    pub refused_preemptions: u64,
    /// The first few refused placements and the first few refused preemptions, with the state
    /// machine's reasons.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused_examples: Vec<String>,
    /// Per queue, in name order.
    pub queues: Vec<QueueReport>,
    /// A few jobs that never started, with reasons.
    pub never_started_examples: Vec<Unstarted>,
    /// Utilization and fragmentation over time.
    pub series: Vec<Sample>,
    /// Every job's outcome, in submission order (only with [`super::ReplayOptions::record_jobs`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub job_outcomes: Vec<JobOutcome>,
    /// The inference services' results (only with [`super::ReplayOptions::services`]); the
    /// job counts above are the trace's (batch) jobs only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference: Option<InferenceReport>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn opt_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
}

impl ReplayReport {
    /// A human-readable summary.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let h = |x: u64| format_duration(x);
        let _ = writeln!(
            s,
            "policy {} seed {} interval {}s: {} node(s), {:.0} GPU(s); replayed t={}s..{}s ({}), {} pass(es), {} event(s)",
            self.policy,
            self.seed,
            self.interval_s,
            self.nodes,
            self.gpu_milli as f64 / 1000.0,
            self.start_s,
            self.end_s,
            h(self.end_s.saturating_sub(self.start_s)),
            self.passes,
            self.events
        );
        let _ = writeln!(
            s,
            "jobs {}: completed {}, running at end {}, never started {}, requeued at end {}, preempted {} ({} preemption(s), {:.2} GPU-h lost)",
            self.jobs,
            self.completed,
            self.running_at_end,
            self.never_started,
            self.requeued_at_end,
            self.preempted_jobs,
            self.preemptions,
            self.lost_gpu_hours
        );
        let _ = writeln!(s, "{:<22} {:>10} {:>10} {:>10} {:>10} {:>10}", "", "p50", "p95", "p99", "max", "mean");
        for (name, p) in [("wait (submit->start)", &self.wait_s), ("completion time", &self.jct_s)] {
            let _ = writeln!(
                s,
                "{:<22} {:>10} {:>10} {:>10} {:>10} {:>10}",
                name,
                h(p.p50),
                h(p.p95),
                h(p.p99),
                h(p.max),
                h(p.mean.round() as u64)
            );
        }
        let _ = writeln!(
            s,
            "GPU allocation: mean {:.2}%, max {:.2}%; fragmentation: mean {:.2}% of GPUs ({} samples)",
            self.gpu_util_mean_pct,
            self.gpu_util_max_pct,
            self.frag_mean_pct,
            self.series.len()
        );
        let _ = writeln!(
            s,
            "{:<16} {:>7} {:>9} {:>9} {:>11} {:>7} {:>9} {:>9} {:>8} {:>9}",
            "queue",
            "jobs",
            "completed",
            "unstarted",
            "GPU-hours",
            "share%",
            "quota max",
            "quota avg",
            "preempt",
            "wait p50"
        );
        for q in &self.queues {
            let _ = writeln!(
                s,
                "{:<16} {:>7} {:>9} {:>9} {:>11.1} {:>7.2} {:>9} {:>9} {:>8} {:>9}",
                q.queue,
                q.jobs,
                q.completed,
                q.never_started,
                q.gpu_hours,
                q.share_pct,
                opt_pct(q.quota_use_max_pct),
                opt_pct(q.quota_use_mean_pct),
                q.preemptions,
                h(q.wait_p50_s)
            );
        }
        if self.gang_pairs > 0 {
            let _ = writeln!(
                s,
                "gangs: {} replica pairs placed, {:.1}% of them across network blocks",
                self.gang_pairs, self.gang_pairs_cross_block_pct
            );
        }
        if self.refused_placements + self.refused_preemptions > 0 {
            let _ = writeln!(
                s,
                "refused by the state machine's re-check: {} placement(s), {} preemption(s)",
                self.refused_placements, self.refused_preemptions
            );
            for r in &self.refused_examples {
                let _ = writeln!(s, "refused: {r}");
            }
        }
        for u in &self.never_started_examples {
            let _ = writeln!(s, "never started: {} (queue {}): {}", u.name, u.queue, u.reason);
        }
        if let Some(i) = &self.inference {
            i.table(&mut s);
        }
        s
    }

    /// The time series as CSV.
    pub fn series_csv(&self) -> String {
        let mut s = String::from(
            "t_s,events,pending_jobs,running_jobs,gpu_alloc_milli,gpu_util_pct,frag_pct,frag_of_free_pct\n",
        );
        for p in &self.series {
            let _ = writeln!(
                s,
                "{},{},{},{},{},{:.4},{:.4},{:.4}",
                p.t_s,
                p.events,
                p.pending_jobs,
                p.running_jobs,
                p.gpu_alloc_milli,
                p.gpu_util_pct,
                p.frag_pct,
                p.frag_of_free_pct
            );
        }
        s
    }
}

/// `93s`, `15m32s`, `3h05m`, `2d04h`.
pub fn format_duration(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}
