//! The default's tie rule, chosen by rehearsing the workload.
//!
//! The `suanli` policy ranks nodes by FGD's score and differs from FGD only in how it breaks
//! FGD's ties ([`Ties`]). Which tie rule packs better depends on the workload: the weighted
//! tie-break for CPU-only and multi-device pods (`by-kind`) gains up to 3 points on some mixes
//! and loses a few tenths on others, and no feature of the mix measured so far tells the two
//! apart (docs/sim.md, "How the default decides"). So instead of guessing from the mix, the
//! default asks the workload: it fills an empty copy of the cluster (or an even sample of at
//! most [`RehearsalConfig::max_nodes`] of its nodes) with pods drawn from the typical workload,
//! once with each rule, on the same draws and node order, `runs` times, and keeps `by-kind`
//! only when its mean allocation is higher; otherwise `first-fit`, which without topology
//! labels places exactly as FGD does.
//!
//! Pure and deterministic: the draws come from [`RehearsalConfig::seed`], never a clock.
//! When constrained work over-asks a device model the rule is `first-fit` without a rehearsal
//! (measured: docs/sim.md), and with no GPU work or no GPUs there is nothing to rehearse.

use crate::cluster::{Cluster, ClusterError, DevReq, Shape, ShapeId};
use crate::engine::{WorkloadSample, build_profile, typical_key};
use crate::policy::{self, Norms, Ties, Weights};
use crate::rng::DetRng;
use crate::workload::{Profile, TypicalKey};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use suanli_model::{DeviceKind, Limits, Node};
use thiserror::Error;

/// Most rehearsal runs.
pub const MAX_RUNS: u32 = 64;
/// Most nodes a rehearsal may fill.
pub const MAX_NODES: usize = 100_000;
/// Most distinct memory requests a rehearsal draws for one typical shape.
pub const MAX_MEMORY_REQUESTS: usize = 64;

/// How a rehearsal runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RehearsalConfig {
    /// Paired fills per rule; 0 turns the rehearsal off (the profile's rule, [`Ties::of`]).
    pub runs: u32,
    /// Most nodes filled: a larger cluster is sampled evenly (every k-th node).
    pub max_nodes: usize,
    /// Pods drawn until their GPU request would pass this multiple of the GPUs (FGD's 1.3).
    pub inflate: f64,
    /// Seed of the draws and node orders.
    pub seed: u64,
    /// Draw each pod's memory request as the workload's samples of its typical shape ask it
    /// (the most common [`MAX_MEMORY_REQUESTS`] of them); `false`: pods ask no memory, as the
    /// fragmentation profile ignores it.
    pub memory: bool,
}

impl Default for RehearsalConfig {
    fn default() -> Self {
        Self { runs: 12, max_nodes: 2048, inflate: 1.3, seed: 0x005E_ED0F_7135, memory: true }
    }
}

impl RehearsalConfig {
    /// Checks every field against its limit.
    pub fn validate(&self) -> Result<(), RehearsalError> {
        if self.runs > MAX_RUNS {
            return Err(RehearsalError::Param { field: "runs", message: format!("{} is over {MAX_RUNS}", self.runs) });
        }
        if self.max_nodes == 0 || self.max_nodes > MAX_NODES {
            return Err(RehearsalError::Param {
                field: "max_nodes",
                message: format!("{} must be in 1..={MAX_NODES}", self.max_nodes),
            });
        }
        if !(self.inflate.is_finite() && self.inflate > 0.0 && self.inflate <= 10.0) {
            return Err(RehearsalError::Param {
                field: "inflate",
                message: format!("{} must be in (0, 10]", self.inflate),
            });
        }
        Ok(())
    }
}

/// Why a rehearsal could not run.
#[derive(Debug, Error)]
pub enum RehearsalError {
    /// Bad node list.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// Bad parameter.
    #[error("rehearsal.{field}: {message}")]
    Param {
        /// Parameter.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// What a rehearsal chose, and on what evidence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rehearsal {
    /// The tie rule to use.
    pub ties: Ties,
    /// Why: `rehearsed`, `off`, `model pressure`, `no GPU work` or `no GPUs`.
    pub why: &'static str,
    /// Paired runs made (0 when not rehearsed).
    pub runs: u32,
    /// Nodes filled.
    pub nodes: usize,
    /// Mean GPU allocation (%) with `by-kind` ties.
    pub by_kind: f64,
    /// Mean GPU allocation (%) with `first-fit` ties.
    pub first_fit: f64,
    /// Standard error of the paired difference (points).
    pub se: f64,
}

impl Rehearsal {
    fn without(ties: Ties, why: &'static str, nodes: usize) -> Self {
        Self { ties, why, runs: 0, nodes, by_kind: 0.0, first_fit: 0.0, se: 0.0 }
    }

    /// `by-kind` less `first-fit`, points of GPU allocation.
    pub fn gain(&self) -> f64 {
        self.by_kind - self.first_fit
    }
}

/// A typical shape as a rehearsal draws it.
struct Typical {
    /// Cumulative frequency up to and including this shape.
    cum: f64,
    /// The shape once per memory request it is asked with, with cumulative sample counts.
    ids: Vec<(ShapeId, u64)>,
    /// GPU milli per device (0 for CPU-only or other kinds).
    gpu_per: u64,
    /// GPU milli in all.
    gpu: u64,
}

/// Chooses the default's tie rule for `samples` (the typical workload, as the engine and
/// `sim fill` build it with `coverage`) on `nodes`. Deterministic.
pub fn rehearse(
    nodes: &[Node],
    samples: &[WorkloadSample],
    coverage: f64,
    weights: Weights,
    cfg: &RehearsalConfig,
) -> Result<Rehearsal, RehearsalError> {
    cfg.validate()?;
    let picked: Vec<Node> = if nodes.len() > cfg.max_nodes {
        (0..cfg.max_nodes).map(|i| nodes[i * nodes.len() / cfg.max_nodes].clone()).collect()
    } else {
        nodes.to_vec()
    };
    let probe =
        policy::build("suanli", Norms { max_cpu_milli: 1, max_dev_milli: 1000 }, &Profile::default(), weights, None)
            .map_err(|e| RehearsalError::Param { field: "policy", message: e.to_string() })?;
    let mut empty = Cluster::new(&picked, &Limits::default(), probe.needs_tags(), probe.tie_break())?;
    let profile = build_profile(&empty, samples, coverage);
    let static_rule = Ties::of(&profile);
    let n = empty.len();
    if cfg.runs == 0 {
        return Ok(Rehearsal::without(static_rule, "off", n));
    }
    if static_rule == Ties::FirstFit {
        return Ok(Rehearsal::without(static_rule, "model pressure", n));
    }
    let total = empty.total_gpu_milli();
    if total == 0 {
        return Ok(Rehearsal::without(static_rule, "no GPUs", n));
    }
    // Memory the typical shapes ask: per typical key, each memory request and how many
    // samples ask it (the profile itself ignores memory, as FGD does).
    let mut mems: BTreeMap<TypicalKey, BTreeMap<u64, u64>> = BTreeMap::new();
    for s in samples.iter().filter(|s| cfg.memory && s.count > 0) {
        *mems.entry(typical_key(&empty, s)).or_default().entry(s.resources.memory_mib).or_default() += s.count;
    }
    // The typical shapes, interned once (one per memory request the shape is asked with), with
    // their cumulative frequencies and GPU milli.
    let mut shapes: Vec<Typical> = Vec::new();
    let mut cum = 0.0;
    for (k, f) in profile.shapes() {
        let dev = (k.count > 0).then_some(DevReq {
            kind: k.kind,
            count: k.count,
            milli: k.milli,
            memory_mib: 0,
            isolated: false,
        });
        let gpu = |per: u64| if k.count > 0 && k.kind == DeviceKind::Gpu { per } else { 0 };
        let asked: Vec<(u64, u64)> = match mems.get(k) {
            Some(m) if !m.is_empty() => {
                let mut v: Vec<(u64, u64)> = m.iter().map(|(mib, n)| (*mib, *n)).collect();
                v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                v.truncate(MAX_MEMORY_REQUESTS);
                v.sort_unstable();
                v
            }
            _ => vec![(0, 1)],
        };
        let mut ids = Vec::with_capacity(asked.len());
        let mut acc = 0u64;
        for (memory_mib, count) in asked {
            acc += count;
            let id = empty.intern(Shape {
                cpu_milli: k.cpu_milli,
                memory_mib,
                dev,
                models: k.models,
                model_names: None,
                groups: None,
                nodes: None,
            });
            ids.push((id, acc));
        }
        cum += f;
        shapes.push(Typical {
            cum,
            ids,
            gpu_per: gpu(u64::from(k.milli)),
            gpu: gpu(u64::from(k.milli) * u64::from(k.count)),
        });
    }
    if shapes.iter().all(|s| s.gpu == 0) {
        return Ok(Rehearsal::without(static_rule, "no GPU work", n));
    }
    let norms = Norms::of(empty.groups());
    let rules = [Ties::ByKind, Ties::FirstFit];
    let mut policies = Vec::with_capacity(rules.len());
    for t in rules {
        policies.push(
            policy::build("suanli", norms, &profile, weights, Some(t))
                .map_err(|e| RehearsalError::Param { field: "policy", message: e.to_string() })?,
        );
    }
    let target = cfg.inflate * total as f64;
    // Bounded whatever the workload: at most 64 pods a node's worth of draws.
    let max_pods = n.saturating_mul(64).max(1);
    let mut diffs = Vec::with_capacity(cfg.runs as usize);
    let mut sums = [0.0f64; 2];
    for r in 0..cfg.runs {
        let mut rng = DetRng::new(cfg.seed ^ u64::from(r).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut seq = Vec::new();
        let mut asked = 0u64;
        while seq.len() < max_pods {
            let u = rng.unit() * cum;
            let t = &shapes[shapes.partition_point(|s| s.cum <= u).min(shapes.len() - 1)];
            if (asked + t.gpu_per) as f64 > target {
                break;
            }
            asked += t.gpu;
            let id = match t.ids.as_slice() {
                [(id, _)] => *id,
                ids => {
                    let x = rng.below(ids[ids.len() - 1].1);
                    ids[ids.partition_point(|m| m.1 <= x).min(ids.len() - 1)].0
                }
            };
            seq.push((id, t.gpu));
        }
        let mut order: Vec<u32> = (0..n as u32).collect();
        rng.shuffle(&mut order);
        let tie_seed = rng.next_u64();
        let mut alloc = [0.0f64; 2];
        for (k, p) in policies.iter().enumerate() {
            let mut c = empty.clone();
            c.set_order(&order);
            let mut ties = DetRng::new(tie_seed);
            let mut used = 0u64;
            for &(id, gpu) in &seq {
                if let Some(choice) = c.choose(id, p.as_ref(), &mut ties) {
                    c.commit(id, &choice);
                    used += gpu;
                }
            }
            alloc[k] = used as f64 / total as f64 * 100.0;
            sums[k] += alloc[k];
        }
        diffs.push(alloc[0] - alloc[1]);
    }
    let runs = f64::from(cfg.runs);
    let mean = diffs.iter().sum::<f64>() / runs;
    let se = if cfg.runs > 1 {
        (diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (runs - 1.0) / runs).sqrt()
    } else {
        0.0
    };
    Ok(Rehearsal {
        ties: if mean > 0.0 { Ties::ByKind } else { Ties::FirstFit },
        why: "rehearsed",
        runs: cfg.runs,
        nodes: n,
        by_kind: sums[0] / runs,
        first_fit: sums[1] / runs,
        se,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use suanli_model::{Device, DeviceRequest, NodeId, PoolId, TaskResources};

    /// `n` nodes alternating 8 and 2 GPUs (A100 and T4 by turns), 64 cores each.
    fn nodes(n: usize) -> Vec<Node> {
        (0..n)
            .map(|i| Node {
                id: NodeId::new(format!("n{i:03}")),
                pool: PoolId::new("p"),
                datacenter: String::new(),
                region: String::new(),
                labels: Default::default(),
                cpu_milli: 64_000,
                memory_mib: 262_144,
                devices: (0..if i % 2 == 0 { 8 } else { 2 })
                    .map(|d| Device::simple(format!("gpu{d}"), DeviceKind::Gpu, if i % 4 < 2 { "A100" } else { "T4" }))
                    .collect(),
                schedulable: true,
                agent_addr: String::new(),
            })
            .collect()
    }

    fn sample(cpu: u64, dev: Option<(u32, u32)>, models: &[&str], count: u64) -> WorkloadSample {
        WorkloadSample {
            resources: TaskResources {
                cpu_milli: cpu,
                memory_mib: 1024,
                devices: dev.map(|(count, milli)| DeviceRequest { kind: DeviceKind::Gpu, count, milli, memory_mib: 0 }),
            },
            device_models: models.iter().map(|m| (*m).to_owned()).collect(),
            count,
        }
    }

    /// A mix of every kind of pod, no model over-asked.
    fn mix() -> Vec<WorkloadSample> {
        vec![
            sample(12_000, None, &[], 30),
            sample(4_000, Some((1, 500)), &[], 25),
            sample(8_000, Some((1, 1000)), &[], 25),
            sample(16_000, Some((4, 1000)), &[], 10),
            sample(2_000, Some((1, 300)), &["T4"], 10),
        ]
    }

    #[test]
    fn a_rehearsal_is_deterministic_and_keeps_by_kind_only_when_it_packs_more() {
        let (n, w) = (nodes(64), mix());
        let cfg = RehearsalConfig::default();
        let r = rehearse(&n, &w, 0.95, Weights::default(), &cfg).expect("rehearsal");
        assert_eq!(r, rehearse(&n, &w, 0.95, Weights::default(), &cfg).expect("again"), "same inputs, same verdict");
        assert_eq!((r.why, r.runs, r.nodes), ("rehearsed", cfg.runs, 64));
        assert!(r.by_kind > 0.0 && r.first_fit > 0.0 && r.by_kind <= 100.0 && r.first_fit <= 100.0, "{r:?}");
        assert_eq!(r.ties, if r.gain() > 0.0 { Ties::ByKind } else { Ties::FirstFit }, "{r:?}");
        // Another seed draws other pods: the allocations differ, the rule still follows the gain.
        let other = rehearse(&n, &w, 0.95, Weights::default(), &RehearsalConfig { seed: 7, ..cfg }).expect("seed 7");
        assert_ne!((other.by_kind, other.first_fit), (r.by_kind, r.first_fit));
        assert_eq!(other.ties, if other.gain() > 0.0 { Ties::ByKind } else { Ties::FirstFit }, "{other:?}");
        // A large cluster is sampled evenly.
        let s = rehearse(&n, &w, 0.95, Weights::default(), &RehearsalConfig { max_nodes: 16, ..cfg }).expect("sampled");
        assert_eq!(s.nodes, 16);
    }

    #[test]
    fn the_pods_memory_is_rehearsed() {
        // CPU-only pods that ask half a node's memory each: with their memory a node holds two,
        // without it four; the GPU pods beside them then pack differently.
        let n = nodes(16);
        let mut w = mix();
        w[0].resources.memory_mib = 131_072;
        let cfg = RehearsalConfig::default();
        let with = rehearse(&n, &w, 0.95, Weights::default(), &cfg).expect("with memory");
        let without =
            rehearse(&n, &w, 0.95, Weights::default(), &RehearsalConfig { memory: false, ..cfg }).expect("without");
        assert_eq!((with.why, without.why), ("rehearsed", "rehearsed"));
        assert_ne!((with.by_kind, with.first_fit), (without.by_kind, without.first_fit));
        // Memory requests of one typical shape are drawn as the samples ask them.
        let mut two = mix();
        two.push(WorkloadSample {
            resources: TaskResources { memory_mib: 200_000, ..two[0].resources.clone() },
            ..two[0].clone()
        });
        let r = rehearse(&n, &two, 0.95, Weights::default(), &cfg).expect("two memory requests");
        assert_ne!((r.by_kind, r.first_fit), (with.by_kind, with.first_fit));
    }

    #[test]
    fn without_a_question_there_is_no_rehearsal() {
        let n = nodes(8);
        let run =
            |w: &[WorkloadSample], cfg: RehearsalConfig| rehearse(&n, w, 0.95, Weights::default(), &cfg).expect("ok");
        let off = run(&mix(), RehearsalConfig { runs: 0, ..RehearsalConfig::default() });
        assert_eq!((off.ties, off.why, off.runs), (Ties::ByKind, "off", 0));
        // Constrained work over-asks T4 (a quarter of the devices): FGD's ties, measured once.
        let pressed = vec![sample(2_000, Some((1, 1000)), &["T4"], 80), sample(2_000, Some((1, 500)), &[], 20)];
        let p = run(&pressed, RehearsalConfig::default());
        assert_eq!((p.ties, p.why, p.runs), (Ties::FirstFit, "model pressure", 0));
        let cpu = run(&[sample(4_000, None, &[], 10)], RehearsalConfig::default());
        assert_eq!((cpu.why, cpu.runs), ("no GPU work", 0));
        let no_gpus: Vec<Node> = n
            .iter()
            .cloned()
            .map(|mut x| {
                x.devices.clear();
                x
            })
            .collect();
        let r = rehearse(&no_gpus, &mix(), 0.95, Weights::default(), &RehearsalConfig::default()).expect("ok");
        assert_eq!((r.why, r.runs), ("no GPUs", 0));
    }

    #[test]
    fn bad_settings_name_the_field_and_the_limit() {
        let n = nodes(2);
        let err = |cfg: RehearsalConfig| {
            rehearse(&n, &mix(), 0.95, Weights::default(), &cfg).expect_err("refused").to_string()
        };
        let d = RehearsalConfig::default();
        assert_eq!(err(RehearsalConfig { runs: 65, ..d }), "rehearsal.runs: 65 is over 64");
        assert!(err(RehearsalConfig { max_nodes: 0, ..d }).starts_with("rehearsal.max_nodes: 0 must be in 1..="));
        assert!(err(RehearsalConfig { inflate: f64::NAN, ..d }).starts_with("rehearsal.inflate: NaN"));
    }
}
