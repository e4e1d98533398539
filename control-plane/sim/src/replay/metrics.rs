//! What a replay measures while it runs: GPU allocation over time, per-queue usage against
//! quota, the workload window (the typical shapes for fragmentation) and the sampled time
//! series. Only measurement: decisions are the engine's and the state machine's.

use super::report::Sample;
use super::{MAX_SAMPLES, ReplayOptions};
use crate::trace::TracePod;
use std::collections::{BTreeMap, VecDeque};
use suanli_model::{Allocation, DeviceKind, DeviceRequest, Queue, ResVec, TaskResources};
use suanli_scheduler::Profile;
use suanli_scheduler::cluster::{Cluster, DevReq};
use suanli_scheduler::engine::{WorkloadSample, build_profile};

/// Shape key of the workload window (per-replica resources and allowed models).
type ShapeKey = (u64, u64, u32, u32, Vec<String>);

/// One queue's running totals.
pub(super) struct QueueAcc {
    /// This queue and its ancestors (indices), for subtree usage.
    chain: Vec<usize>,
    /// What its subtree's running jobs use now.
    used: ResVec,
    /// GPU milli-seconds allocated to its subtree.
    pub(super) gpu_milli_s: u128,
    /// Largest used/nominal seen.
    pub(super) ratio_max: f64,
    /// used/nominal integrated over time (seconds).
    pub(super) ratio_s: f64,
    /// Times its jobs were preempted.
    pub(super) preemptions: u64,
}

/// The dominant used/nominal over the dimensions with a finite, non-zero nominal (`None`: a
/// queue without quota).
pub(super) fn quota_ratio(used: &ResVec, nominal: &ResVec) -> Option<f64> {
    let (u, n) = (used.dims(), nominal.dims());
    (0..4).filter(|&i| n[i] != u64::MAX && n[i] > 0).map(|i| u[i] as f64 / n[i] as f64).reduce(f64::max)
}

/// The device part of an allocation as the metrics cluster tracks it.
fn dev_req(a: &Allocation) -> Option<DevReq> {
    let first = a.devices.first()?;
    Some(DevReq {
        kind: DeviceKind::Gpu,
        count: a.devices.len() as u32,
        milli: first.milli.min(1000) as u16,
        memory_mib: first.memory_mib,
        isolated: false,
    })
}

/// The measurements of one replay.
pub(super) struct Metrics {
    /// The cluster's occupancy, for fragmentation (fed from the allocations the state
    /// machine committed).
    cluster: Cluster,
    /// The cluster's GPU milli.
    pub(super) total_gpu_milli: u64,
    /// GPU milli allocated now.
    pub(super) alloc_gpu_milli: u64,
    /// GPU milli-seconds allocated so far.
    pub(super) alloc_gpu_milli_s: u128,
    /// Largest allocated share seen (0..=1).
    pub(super) util_max: f64,
    /// Per queue, in `queues` order.
    pub(super) qacc: Vec<QueueAcc>,
    /// Recent arrivals: shape and replica count.
    window: VecDeque<(ShapeKey, u64)>,
    window_counts: BTreeMap<ShapeKey, u64>,
    window_len: usize,
    /// Preemptions in all.
    pub(super) preemptions: u64,
    /// GPU milli-seconds of work lost to preemption.
    pub(super) lost_gpu_milli_s: u128,
    /// Placements the state machine refused (job placements, as `PlanOutcome` counts them).
    pub(super) refused_placements: u64,
    /// Replica pairs of jobs placed with several replicas at once, and those crossing blocks.
    pub(super) gang_pairs: u64,
    pub(super) gang_pairs_crossing: u64,
    /// Preemptions the state machine refused.
    pub(super) refused_preemptions: u64,
    /// The first few refused placements, with the state machine's reasons.
    pub(super) refused_placement_examples: Vec<String>,
    /// The first few refused preemptions, with the state machine's reasons.
    pub(super) refused_preemption_examples: Vec<String>,
    /// The time series.
    pub(super) series: Vec<Sample>,
    /// Events between two samples (doubles whenever the series is thinned).
    pub(super) sample_stride: u64,
    frag_sum: f64,
    frag_n: u64,
    typical_coverage: f64,
}

impl Metrics {
    pub(super) fn new(cluster: Cluster, queues: &[Queue], opts: &ReplayOptions) -> Self {
        let qacc = queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let mut chain = vec![i];
                let mut cur = q.parent.clone();
                while let Some(p) = cur {
                    match queues.iter().position(|o| o.id == p) {
                        Some(k) if !chain.contains(&k) && chain.len() <= 64 => {
                            chain.push(k);
                            cur = queues[k].parent.clone();
                        }
                        _ => break,
                    }
                }
                QueueAcc { chain, used: ResVec::ZERO, gpu_milli_s: 0, ratio_max: 0.0, ratio_s: 0.0, preemptions: 0 }
            })
            .collect();
        Self {
            total_gpu_milli: cluster.total_gpu_milli(),
            cluster,
            alloc_gpu_milli: 0,
            alloc_gpu_milli_s: 0,
            util_max: 0.0,
            qacc,
            window: VecDeque::new(),
            window_counts: BTreeMap::new(),
            window_len: opts.workload_window,
            preemptions: 0,
            lost_gpu_milli_s: 0,
            refused_placements: 0,
            gang_pairs: 0,
            gang_pairs_crossing: 0,
            refused_preemptions: 0,
            refused_placement_examples: Vec::new(),
            refused_preemption_examples: Vec::new(),
            series: Vec::new(),
            sample_stride: opts.sample_every,
            frag_sum: 0.0,
            frag_n: 0,
            typical_coverage: opts.config.typical_coverage,
        }
    }

    /// Integrates usage over `dt` seconds.
    pub(super) fn advance(&mut self, dt: u64, queues: &[Queue]) {
        if dt == 0 {
            return;
        }
        self.alloc_gpu_milli_s += u128::from(self.alloc_gpu_milli) * u128::from(dt);
        for (i, a) in self.qacc.iter_mut().enumerate() {
            a.gpu_milli_s += u128::from(a.used.gpu_milli) * u128::from(dt);
            if let Some(r) = quota_ratio(&a.used, &queues[i].nominal) {
                a.ratio_s += r * dt as f64;
            }
        }
    }

    /// A job of queue `q` using `usage` (`gpu_milli` of it on GPUs) starts (`add`) or stops.
    pub(super) fn charge(&mut self, q: usize, usage: ResVec, gpu_milli: u64, add: bool, queues: &[Queue]) {
        if add {
            self.alloc_gpu_milli += gpu_milli;
        } else {
            self.alloc_gpu_milli = self.alloc_gpu_milli.saturating_sub(gpu_milli);
        }
        let chain = self.qacc[q].chain.clone();
        for k in chain {
            let a = &mut self.qacc[k];
            a.used = if add { a.used + usage } else { a.used.saturating_sub(&usage) };
            if let Some(r) = quota_ratio(&a.used, &queues[k].nominal) {
                a.ratio_max = a.ratio_max.max(r);
            }
        }
        if self.total_gpu_milli > 0 {
            self.util_max = self.util_max.max(self.alloc_gpu_milli as f64 / self.total_gpu_milli as f64);
        }
    }

    /// Takes a committed allocation's resources in the metrics cluster; false when they do
    /// not fit there (the state machine and the engine's cluster model disagree).
    pub(super) fn occupy(&mut self, a: &Allocation) -> bool {
        self.cluster.occupy(&a.node, a.cpu_milli, a.memory_mib, &a.devices, dev_req(a))
    }

    /// Gives an ended allocation's resources back.
    pub(super) fn vacate(&mut self, a: &Allocation) {
        self.cluster.vacate(&a.node, a.cpu_milli, a.memory_mib, &a.devices, dev_req(a));
    }

    /// A pod arrived: its shape enters the workload window.
    pub(super) fn arrive(&mut self, p: &TracePod) {
        let key: ShapeKey = (p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_spec.clone());
        let n = u64::from(p.replicas);
        *self.window_counts.entry(key.clone()).or_default() += n;
        self.window.push_back((key, n));
        if self.window.len() > self.window_len
            && let Some((old, n)) = self.window.pop_front()
            && let Some(c) = self.window_counts.get_mut(&old)
        {
            *c = c.saturating_sub(n);
            if *c == 0 {
                self.window_counts.remove(&old);
            }
        }
    }

    /// The workload window as samples for the engine's fragmentation profile.
    pub(super) fn workload(&self) -> Vec<WorkloadSample> {
        self.window_counts
            .iter()
            .map(|((cpu_milli, memory_mib, num_gpu, gpu_milli, spec), &count)| {
                let devices = (*num_gpu > 0 && *gpu_milli > 0).then_some(DeviceRequest {
                    kind: DeviceKind::Gpu,
                    count: *num_gpu,
                    milli: *gpu_milli,
                    memory_mib: 0,
                });
                WorkloadSample {
                    resources: TaskResources { cpu_milli: *cpu_milli, memory_mib: *memory_mib, devices },
                    device_models: spec.clone(),
                    count,
                }
            })
            .collect()
    }

    /// Records one point of the time series.
    pub(super) fn sample(&mut self, t_s: u64, events: u64, pending_jobs: u64, running_jobs: u64) {
        if self.series.len() >= MAX_SAMPLES {
            // Keep every other sample and sample half as often from now on.
            let kept: Vec<Sample> = self.series.iter().step_by(2).cloned().collect();
            self.series = kept;
            self.sample_stride = self.sample_stride.saturating_mul(2);
        }
        let samples = self.workload();
        let profile: Profile = if samples.is_empty() {
            Profile::default()
        } else {
            build_profile(&self.cluster, &samples, self.typical_coverage)
        };
        let mut frag = 0.0;
        self.cluster.for_each_node(|g, v| frag += profile.fragmentation(g, &v));
        let total = self.total_gpu_milli.max(1) as f64;
        let free = self.total_gpu_milli.saturating_sub(self.alloc_gpu_milli) as f64;
        let frag_pct = frag / total * 100.0;
        self.frag_sum += frag_pct;
        self.frag_n += 1;
        self.series.push(Sample {
            t_s,
            events,
            pending_jobs,
            running_jobs,
            gpu_alloc_milli: self.alloc_gpu_milli,
            gpu_util_pct: self.alloc_gpu_milli as f64 / total * 100.0,
            frag_pct,
            frag_of_free_pct: if free > 0.0 { frag / free * 100.0 } else { 0.0 },
        });
    }

    /// The first few refused placements, then the first few refused preemptions.
    pub(super) fn refused_examples(&self) -> Vec<String> {
        self.refused_placement_examples.iter().chain(&self.refused_preemption_examples).cloned().collect()
    }

    /// Mean fragmentation over the samples, % of the cluster's GPUs.
    pub(super) fn frag_mean_pct(&self) -> f64 {
        if self.frag_n > 0 { self.frag_sum / self.frag_n as f64 } else { 0.0 }
    }
}
