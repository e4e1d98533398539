//! `suanli sim fill`: the published "Beware of Fragmentation" procedure.
//!
//! Time is ignored. The pod list is shuffled by the seed, then inflated by sampling pods
//! uniformly with replacement (appended at the end) until the GPU request would pass
//! `inflate` x the cluster's GPUs — with the published simulator's stopping rule, which
//! compares the running total plus the sampled pod's per-GPU milli against the target. Pods
//! arrive one at a time, each is placed once or counted as failed; nothing leaves. The typical
//! workload for fragmentation is computed once from the original pod list.
//!
//! Workload draws and scheduling tie-breaks use separate random streams, so every policy sees
//! the identical arrival sequence for a seed.

use crate::trace::TracePod;
use std::collections::BTreeMap;
use suanli_model::{Limits, Node};
use suanli_scheduler::cluster::{Cluster, ClusterError};
use suanli_scheduler::engine::{WorkloadSample, build_profile};
use suanli_scheduler::policy::{self, Norms, Weights};
use suanli_scheduler::rehearsal::{Rehearsal, RehearsalConfig, RehearsalError, rehearse};
use suanli_scheduler::{DetRng, Profile, UnknownPolicy};
use thiserror::Error;

/// Points on the allocation curve: arrived GPU request 0..=130% in steps of 1%.
pub const CURVE_POINTS: usize = 131;

/// Why a fill could not run.
#[derive(Debug, Error)]
pub enum FillError {
    /// Bad node list.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// Bad policy name.
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
    /// The default's rehearsal could not run.
    #[error(transparent)]
    Rehearsal(#[from] RehearsalError),
    /// Bad parameter.
    #[error("{field}: {message}")]
    Param {
        /// Parameter.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Options of one fill run.
#[derive(Debug, Clone)]
pub struct FillOptions {
    /// Policy name.
    pub policy: String,
    /// Seed.
    pub seed: u64,
    /// Target GPU request as a multiple of the cluster's GPUs (1.3 in the paper).
    pub inflate: f64,
    /// Weights for the `suanli` policy.
    pub weights: Weights,
    /// Typical-workload coverage (0.95).
    pub coverage: f64,
    /// Use the naive full-scan placement (benchmark baseline) instead of the class index.
    pub naive: bool,
    /// Also compute the offline bound given the CPU-only pods this run placed
    /// ([`crate::bound::upper_bound_given`]): [`FillRun::bound_given_placed`].
    pub bound_given_placed: bool,
    /// How the `suanli` policy chooses its tie rule: a rehearsal that draws the pod list's own
    /// pods (the default, as the server does with its workload), or `None` for the profile's
    /// rule alone.
    pub rehearsal: Option<RehearsalConfig>,
    /// A rehearsal already made for these nodes and pods with these options
    /// ([`rehearse_pods`]), used instead of rehearsing again: runs of one pod list under many
    /// seeds rehearse alike, since the rehearsal's draws have a seed of their own.
    pub rehearsed: Option<Rehearsal>,
}

impl Default for FillOptions {
    fn default() -> Self {
        Self {
            policy: "suanli".into(),
            seed: 42,
            inflate: 1.3,
            weights: Weights::default(),
            coverage: 0.95,
            naive: false,
            bound_given_placed: false,
            rehearsal: Some(RehearsalConfig::default()),
            rehearsed: None,
        }
    }
}

/// Result of one fill run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FillRun {
    /// Policy.
    pub policy: String,
    /// Seed.
    pub seed: u64,
    /// Allocation ratio (% of cluster GPU milli) at each 1% of arrived GPU request, 0..=130.
    /// `None` past the last arrival.
    pub curve: Vec<Option<f64>>,
    /// Pods that arrived.
    pub arrived_pods: u64,
    /// Pods that could not be placed.
    pub failed_pods: u64,
    /// GPU milli of failed pods.
    pub failed_gpu_milli: u64,
    /// Final allocation ratio, %.
    pub final_alloc: f64,
    /// Final fragmentation: expected fragmented GPU milli (by the typical workload) as % of the
    /// cluster's GPUs.
    pub final_frag: f64,
    /// Fragmentation as % of the unallocated GPU milli.
    pub final_frag_of_free: f64,
    /// Time spent placing, seconds (excludes loading).
    pub place_seconds: f64,
    /// Placements made.
    pub placements: u64,
    /// Upper bound on the final allocation (%) of any packing that admits the CPU-only pods
    /// this run placed (with [`FillOptions::bound_given_placed`]).
    pub bound_given_placed: Option<f64>,
    /// How the `suanli` policy chose its tie rule ([`FillOptions::rehearsal`]).
    pub rehearsal: Option<Rehearsal>,
}

/// The rehearsal a `suanli` run of `pods` on `nodes` with `opts` makes (`None` for other
/// policies or without [`FillOptions::rehearsal`]): make it once and pass it as
/// [`FillOptions::rehearsed`] to runs of the same pods under other seeds.
pub fn rehearse_pods(nodes: &[Node], pods: &[TracePod], opts: &FillOptions) -> Result<Option<Rehearsal>, FillError> {
    rehearse_samples(nodes, &samples_of(pods), opts)
}

/// [`rehearse_pods`] on the pod list's samples.
fn rehearse_samples(
    nodes: &[Node],
    samples: &[WorkloadSample],
    opts: &FillOptions,
) -> Result<Option<Rehearsal>, FillError> {
    match &opts.rehearsal {
        Some(r) if opts.policy == "suanli" => Ok(Some(rehearse(nodes, samples, opts.coverage, opts.weights, r)?)),
        _ => Ok(None),
    }
}

/// A pod list as workload samples.
pub fn samples_of(pods: &[TracePod]) -> Vec<WorkloadSample> {
    pods.iter()
        .map(|p| WorkloadSample { resources: p.resources(), device_models: p.gpu_spec.clone(), count: 1 })
        .collect()
}

/// The arrival sequence for a seed: shuffled list, then sampled clones (indices into `pods`);
/// and the fixed node order used to break ties (a permutation of `0..nodes`).
pub fn arrival_sequence(
    pods: &[TracePod],
    nodes: usize,
    total_gpu_milli: u64,
    inflate: f64,
    seed: u64,
) -> (Vec<usize>, Vec<u32>) {
    let mut rng = DetRng::new(seed);
    let mut seq: Vec<usize> = (0..pods.len()).collect();
    rng.shuffle(&mut seq);
    let target = inflate * total_gpu_milli as f64;
    let mut total: u64 = pods.iter().map(|p| p.gpu_request_milli()).sum();
    if (total as f64) < target && !pods.is_empty() {
        // Bounded: at most 100x the list, whatever the inputs.
        for _ in 0..pods.len().saturating_mul(100) {
            let i = rng.below(pods.len() as u64) as usize;
            let p = &pods[i];
            let per_gpu = if p.devices().is_some() { u64::from(p.gpu_milli) } else { 0 };
            if (total + per_gpu) as f64 > target {
                break;
            }
            total += p.gpu_request_milli();
            seq.push(i);
        }
    }
    let mut order: Vec<u32> = (0..nodes as u32).collect();
    rng.shuffle(&mut order);
    (seq, order)
}

/// Runs one fill.
pub fn fill(nodes: &[Node], pods: &[TracePod], opts: &FillOptions) -> Result<FillRun, FillError> {
    if !(opts.inflate.is_finite() && opts.inflate > 0.0 && opts.inflate <= 10.0) {
        return Err(FillError::Param { field: "inflate", message: format!("{} must be in (0, 10]", opts.inflate) });
    }
    let probe = policy::build(
        &opts.policy,
        Norms { max_cpu_milli: 1, max_dev_milli: 1000 },
        &Profile::default(),
        opts.weights,
        None,
    )?;
    let mut cluster = Cluster::new(nodes, &Limits::default(), probe.needs_tags(), probe.tie_break())?;
    let total = cluster.total_gpu_milli();
    if total == 0 {
        return Err(FillError::Param { field: "nodes", message: "the cluster has no GPUs to fill".into() });
    }
    // The typical workload, as FGD defines it, from the same samples the rehearsal draws on.
    let samples = samples_of(pods);
    let profile = build_profile(&cluster, &samples, opts.coverage);
    let rehearsal = match &opts.rehearsed {
        Some(r) if opts.policy == "suanli" => Some(r.clone()),
        _ => rehearse_samples(nodes, &samples, opts)?,
    };
    let policy = policy::build(
        &opts.policy,
        Norms::of(cluster.groups()),
        &profile,
        opts.weights,
        rehearsal.as_ref().map(|r| r.ties),
    )?;
    let (seq, order) = arrival_sequence(pods, cluster.len(), total, opts.inflate, opts.seed);
    cluster.set_order(&order);
    let mut rng = DetRng::new(opts.seed ^ 0x9E37_79B9_7F4A_7C15);

    // Shapes interned once per distinct pod.
    let mut shape_of: Vec<Option<u32>> = vec![None; pods.len()];
    let mut arrived = 0u64;
    let mut used = 0u64;
    let (mut failed, mut failed_gpu, mut placements) = (0u64, 0u64, 0u64);
    let mut placed_cpu_only = if opts.bound_given_placed { vec![0u32; pods.len()] } else { Vec::new() };
    let mut sums: BTreeMap<i64, (f64, u64)> = BTreeMap::new();
    let started = std::time::Instant::now();
    for &i in &seq {
        let p = &pods[i];
        let shape = match shape_of[i] {
            Some(s) => s,
            None => {
                let s = cluster.shape(&p.resources(), &p.constraints());
                shape_of[i] = Some(s);
                s
            }
        };
        let req = p.gpu_request_milli();
        arrived += req;
        let choice = if opts.naive {
            cluster.choose_naive(shape, policy.as_ref(), &mut rng)
        } else {
            cluster.choose(shape, policy.as_ref(), &mut rng)
        };
        match choice {
            Some(c) => {
                cluster.commit(shape, &c);
                used += req;
                placements += 1;
                if req == 0
                    && let Some(k) = placed_cpu_only.get_mut(i)
                {
                    *k += 1;
                }
            }
            None => {
                failed += 1;
                failed_gpu += req;
            }
        }
        let arrive_pct = (arrived as f64 / total as f64 * 100.0).round_ties_even() as i64;
        let alloc_pct = ((used as f64 / total as f64 * 100.0) * 100.0).round() / 100.0;
        let e = sums.entry(arrive_pct).or_insert((0.0, 0));
        e.0 += alloc_pct;
        e.1 += 1;
    }
    let place_seconds = started.elapsed().as_secs_f64();
    let mut curve = Vec::with_capacity(CURVE_POINTS);
    let last = sums.keys().next_back().copied().unwrap_or(0);
    for x in 0..CURVE_POINTS as i64 {
        let v = match sums.get(&x) {
            Some((s, n)) => Some(s / *n as f64),
            None if x <= last => {
                let (s, n) =
                    (x - 1..=x + 1).filter_map(|k| sums.get(&k)).fold((0.0, 0u64), |a, b| (a.0 + b.0, a.1 + b.1));
                (n > 0).then(|| s / n as f64)
            }
            None => None,
        };
        curve.push(v);
    }
    let mut frag = 0.0;
    cluster.for_each_node(|g, v| frag += profile.fragmentation(g, &v));
    let free = total.saturating_sub(used) as f64;
    let bound_given_placed = if opts.bound_given_placed {
        let b = crate::bound::upper_bound_given(nodes, pods, &seq, &placed_cpu_only)
            .map_err(|e| FillError::Param { field: "bound_given_placed", message: e.to_string() })?;
        Some(b.alloc_pct)
    } else {
        None
    };
    Ok(FillRun {
        policy: opts.policy.clone(),
        seed: opts.seed,
        curve,
        arrived_pods: seq.len() as u64,
        failed_pods: failed,
        failed_gpu_milli: failed_gpu,
        final_alloc: used as f64 / total as f64 * 100.0,
        final_frag: frag / total as f64 * 100.0,
        final_frag_of_free: if free > 0.0 { frag / free * 100.0 } else { 0.0 },
        place_seconds,
        placements,
        bound_given_placed,
        rehearsal,
    })
}

/// The value at x% of a curve, falling back to the last defined point before it.
pub fn curve_at(curve: &[Option<f64>], x: usize) -> Option<f64> {
    curve.iter().take(x + 1).rev().find_map(|v| *v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;

    #[test]
    fn a_seed_replays_exactly_and_seeds_differ() {
        let nodes = synth::nodes(24);
        let pods = synth::trace_pods(300, 5, 1, false);
        let run = |policy: &str, seed| {
            fill(&nodes, &pods, &FillOptions { policy: policy.into(), seed, ..Default::default() }).expect("fill")
        };
        for policy in suanli_scheduler::POLICY_NAMES {
            let (a, b) = (run(policy, 7), run(policy, 7));
            assert_eq!(a.curve, b.curve, "{policy}");
            assert_eq!((a.failed_pods, a.placements), (b.failed_pods, b.placements), "{policy}");
        }
        // Another seed gives another arrival order (same pods, different curve somewhere).
        assert_ne!(run("bestfit", 7).curve, run("bestfit", 8).curve);
    }

    #[test]
    fn bad_parameters_are_named() {
        let nodes = synth::nodes(2);
        let pods = synth::trace_pods(10, 1, 1, false);
        let e = fill(&nodes, &pods, &FillOptions { inflate: f64::NAN, ..Default::default() }).expect_err("nan");
        assert!(e.to_string().starts_with("inflate:"), "{e}");
        let e = fill(&nodes, &pods, &FillOptions { policy: "nope".into(), ..Default::default() }).expect_err("policy");
        assert!(e.to_string().contains("unknown policy \"nope\""), "{e}");
        let e = fill(&[], &pods, &FillOptions::default()).expect_err("no gpus");
        assert!(e.to_string().contains("no GPUs"), "{e}");
    }
}
