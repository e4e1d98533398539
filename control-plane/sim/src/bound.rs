//! An offline upper bound on the GPU allocation any placement policy can reach in a fill.
//!
//! In `sim fill` pods arrive one at a time, each is placed or fails, and nothing leaves, so
//! whatever a policy does, the pods it placed are a feasible packing of a subset of the arrived
//! pods. The largest GPU request of such a subset bounds every policy's final allocation. That
//! maximum is bounded in turn by a linear relaxation: pods are grouped into shapes s (count
//! n_s, value v_s = GPU milli asked) and nodes into types t (count m_t), x_{s,t} pods of s go to
//! type t where one empty node of t could hold one pod of s, and per type four rows cap the
//! use: CPU, memory, GPU milli, and "big slots" (a share above 500 milli, or a whole GPU, takes
//! a GPU of its own, since two such shares never fit on one GPU).
//!
//! The LP is never solved. For any multipliers u ≥ 0 on the rows, weak duality gives
//! L(u) = Σ u + Σ_s n_s · max(0, max_t (v_s − Σ_r u_{t,r} a_{s,r} / C_{t,r})) ≥ LP optimum ≥
//! any packing, so every L(u) evaluated is a certified bound. L is minimized by a deflected
//! projected subgradient with Polyak steps (deterministic, no clock), keeping the smallest
//! value seen. A feasible LP solution (averaged Lagrangian solutions scaled into capacity, then
//! topped up greedily) gives `lp_lower`, so the bound's distance from the LP optimum shows.
//!
//! What the bound ignores, each making it looser (never invalid): the arrival order (an online
//! policy cannot take back a placement), packing inside a node beyond the four rows (pods
//! split across nodes fractionally, GPU topology, device health), and CPU-only pods, which add
//! nothing to the objective but compete for CPU and memory, so the bound is loose on CPU-heavy
//! mixes: a policy that refused every CPU-only pod could in principle reach it.
//!
//! [`upper_bound_given`] closes that last gap for one policy's run: the CPU-only pods the run
//! placed become pods that must be placed (rows x_{c,t} with Σ_t x_{c,t} = n_c, valued 0; in
//! L(u) each adds −n_c · min_t Σ_r u_{t,r} a_{c,r} / C_{t,r}, and they may use nodes without
//! GPUs). It bounds what any packing could allocate while admitting the same CPU-only work,
//! so `bound given − policy` is that policy's headroom on a CPU-bound mix. MIG partitions count as GPUs of their own, and a pod of several replicas counts all of
//! them while using one replica's resources (what `fill` does), so there the bound may pass 100%.

use crate::trace::TracePod;
use std::collections::BTreeMap;
use suanli_model::{DeviceKind, Node};
use thiserror::Error;

/// Most distinct GPU pod shapes.
const MAX_SHAPES: usize = 20_000;
/// Most distinct node types.
const MAX_NODE_TYPES: usize = 10_000;
/// Most (shape, node type) pairs where the shape fits (memory: 4 bytes each).
const MAX_PAIRS: usize = 10_000_000;
/// Subgradient iterations, fewer when the pairs times the iterations would pass `WORK`.
const ITERATIONS: usize = 3000;
const MIN_ITERATIONS: usize = 20;
const WORK: usize = 200_000_000;
/// Iterations without a better iterate before the step factor halves.
const STALL: u32 = 150;
/// Weight of the previous direction in the next one.
const DEFLECT: f64 = 0.7;
/// Iterations between two primal recoveries.
const RECOVER_EVERY: u32 = 250;
const MIN_THETA: f64 = 1e-6;

/// An offline upper bound on what any placement policy could allocate.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Bound {
    /// Upper bound on the final GPU allocation, % of the cluster's GPU milli (certified: the Lagrangian dual value at the best multipliers found).
    pub alloc_pct: f64,
    /// A feasible value of the LP relaxation, % (the bound's gap to the LP optimum is at most alloc_pct - lp_lower_pct).
    pub lp_lower_pct: f64,
    /// Arrived GPU request, % of the cluster's GPU milli.
    pub arrived_pct: f64,
    /// Subgradient iterations run.
    pub iterations: u32,
}

/// Why no bound could be computed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BoundError {
    /// An input is out of range or too large.
    #[error("{field}: {message}")]
    Limit {
        /// The input.
        field: &'static str,
        /// What is wrong, with the limit.
        message: String,
    },
}

fn limit(field: &'static str, message: String) -> BoundError {
    BoundError::Limit { field, message }
}

/// Pods that are the same to the bound.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct ShapeKey<'a> {
    cpu: u64,
    mem: u64,
    gpus: u32,
    milli: u32,
    replicas: u32,
    spec: &'a [String],
}

/// Nodes that are the same to the bound: CPU, memory, GPU devices in all and per model.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct TypeKey<'a> {
    cpu: u64,
    mem: u64,
    slots: u64,
    models: Vec<(&'a str, u64)>,
}

/// Whole GPUs of a node as the engine counts them: a partition of another device adds none.
fn whole_gpus(n: &Node) -> u64 {
    let partition = |id: &str, p: &str| n.devices.iter().any(|x| x.id == p && x.id != id);
    n.devices
        .iter()
        .filter(|d| {
            d.kind == DeviceKind::Gpu && !d.partition_of.as_deref().is_some_and(|p| partition(d.id.as_str(), p))
        })
        .count() as u64
}

/// GPU devices of a node per model. MIG partitions count as devices of their own: the engine
/// never uses a parent and its partitions at once, so this is looser there, but still valid.
fn gpu_models(n: &Node) -> Vec<(&str, u64)> {
    let mut models: BTreeMap<&str, u64> = BTreeMap::new();
    for d in n.devices.iter().filter(|d| d.kind == DeviceKind::Gpu) {
        *models.entry(&d.model).or_default() += 1;
    }
    models.into_iter().collect()
}

/// True when one empty node of type `t` could hold one pod of shape `s`.
fn fits(s: &ShapeKey<'_>, t: &TypeKey<'_>) -> bool {
    let allowed = if s.spec.is_empty() {
        t.slots
    } else {
        let named: u64 = t.models.iter().filter(|(m, _)| s.spec.iter().any(|x| x.as_str() == *m)).map(|(_, c)| c).sum();
        named.min(t.slots)
    };
    s.cpu <= t.cpu && s.mem <= t.mem && u64::from(s.gpus) <= allowed
}

/// One shape in the LP: value, count, and use of the rows (CPU, memory, GPU milli, big slots).
struct Shape {
    value: f64,
    count: f64,
    uses: [f64; 4],
    /// Every pod of the shape must be placed (CPU-only work a run admitted).
    must: bool,
}

/// The LP in compressed form: shapes, capacities per type, and the types each shape fits.
struct Problem {
    shapes: Vec<Shape>,
    cap: Vec<[f64; 4]>,
    /// Shape s fits the types `elig[start[s]..start[s + 1]]`.
    start: Vec<usize>,
    elig: Vec<u32>,
    /// Shapes by decreasing value per dominant share of the capacity (the greedy's order).
    order: Vec<usize>,
}

impl Problem {
    /// `shapes`: (value, count, must be placed) per shape.
    fn new(
        shapes: &BTreeMap<ShapeKey<'_>, (u64, u64, bool)>,
        types: &BTreeMap<TypeKey<'_>, u64>,
    ) -> Result<Self, BoundError> {
        let cap: Vec<[f64; 4]> =
            types.iter().map(|(t, &m)| [t.cpu, t.mem, t.slots * 1000, t.slots].map(|c| m as f64 * c as f64)).collect();
        let mut p = Problem { shapes: Vec::new(), cap, start: vec![0], elig: Vec::new(), order: Vec::new() };
        for (s, &(value, count, must)) in shapes {
            let before = p.elig.len();
            p.elig.extend(types.keys().enumerate().filter(|(_, t)| fits(s, t)).map(|(t, _)| t as u32));
            if p.elig.len() == before {
                if must {
                    return Err(limit(
                        "placed",
                        format!("a placed pod ({} milli-CPU, {} MiB) fits no node of the cluster", s.cpu, s.mem),
                    ));
                }
                continue;
            }
            if p.elig.len() > MAX_PAIRS {
                return Err(limit("eligible_pairs", format!("more than {MAX_PAIRS} (pod shape, node type) pairs")));
            }
            let (gpus, milli) = (u64::from(s.gpus), u64::from(s.milli.min(1000)));
            let big = if milli > 500 { gpus } else { 0 };
            let uses = [s.cpu, s.mem, gpus * milli, big].map(|a| a as f64);
            p.shapes.push(Shape { value: value as f64, count: count as f64, uses, must });
            p.start.push(p.elig.len());
        }
        let totals: [f64; 4] = std::array::from_fn(|r| p.cap.iter().map(|c| c[r]).sum());
        let density: Vec<f64> = p
            .shapes
            .iter()
            .map(|s| {
                let size =
                    s.uses.iter().zip(&totals).filter(|(_, t)| **t > 0.0).map(|(a, t)| a / t).fold(0.0, f64::max);
                s.value / size.max(f64::MIN_POSITIVE)
            })
            .collect();
        p.order = (0..p.shapes.len()).collect();
        // Pods that must be placed first (the greedy's value is feasible only when they are).
        p.order.sort_by(|&a, &b| {
            p.shapes[b].must.cmp(&p.shapes[a].must).then(density[b].total_cmp(&density[a])).then(a.cmp(&b))
        });
        Ok(p)
    }

    fn pairs(&self, s: usize) -> std::ops::Range<usize> {
        self.start[s]..self.start[s + 1]
    }

    /// L(u); fills `g` with a subgradient and `pick` with each shape's chosen pair.
    fn dual(&self, u: &[[f64; 4]], y: &mut [[f64; 4]], g: &mut [[f64; 4]], pick: &mut [Option<usize>]) -> f64 {
        let mut l = 0.0;
        for (((yt, gt), ut), ct) in y.iter_mut().zip(g.iter_mut()).zip(u).zip(&self.cap) {
            for (((yr, gr), &ur), &cr) in yt.iter_mut().zip(gt.iter_mut()).zip(ut).zip(ct) {
                (*yr, *gr) = if cr > 0.0 { (ur / cr, 1.0) } else { (0.0, 0.0) };
                l += ur;
            }
        }
        for (s, (sh, p)) in self.shapes.iter().zip(pick.iter_mut()).enumerate() {
            // A pod that must be placed takes its cheapest pair, even at a loss.
            let mut gain = if sh.must { f64::NEG_INFINITY } else { 0.0 };
            *p = None;
            for k in self.pairs(s) {
                let price: f64 = sh.uses.iter().zip(&y[self.elig[k] as usize]).map(|(a, b)| a * b).sum();
                if sh.value - price > gain {
                    gain = sh.value - price;
                    *p = Some(k);
                }
            }
            if let Some(k) = *p {
                l += sh.count * gain;
                let t = self.elig[k] as usize;
                for ((gr, &a), &c) in g[t].iter_mut().zip(&sh.uses).zip(&self.cap[t]) {
                    if c > 0.0 {
                        *gr -= sh.count * a / c;
                    }
                }
            }
        }
        l
    }

    /// A feasible LP value: `xsum / weight` scaled per type into its capacity, then the
    /// capacity left filled greedily (all zeros: the plain greedy).
    fn primal(&self, xsum: &[f64], weight: f64) -> f64 {
        let mut used = vec![[0.0f64; 4]; self.cap.len()];
        for (s, sh) in self.shapes.iter().enumerate() {
            for k in self.pairs(s) {
                for (u, a) in used[self.elig[k] as usize].iter_mut().zip(&sh.uses) {
                    *u += a * xsum[k] / weight;
                }
            }
        }
        let scale: Vec<f64> = used
            .iter()
            .zip(&self.cap)
            .map(|(u, c)| u.iter().zip(c).filter(|(u, _)| **u > 0.0).map(|(u, c)| c / u).fold(1.0, f64::min))
            .collect();
        let mut rem: Vec<[f64; 4]> = self
            .cap
            .iter()
            .zip(&used)
            .zip(&scale)
            .map(|((c, u), f)| std::array::from_fn(|r| c[r] - u[r] * f))
            .collect();
        let mut value = 0.0;
        let mut left: Vec<f64> = Vec::with_capacity(self.shapes.len());
        let must_left =
            |left: &[f64]| self.shapes.iter().zip(left).any(|(sh, l)| sh.must && *l > 1e-6 * sh.count.max(1.0));
        for (s, sh) in self.shapes.iter().enumerate() {
            let placed: f64 = self.pairs(s).map(|k| xsum[k] / weight * scale[self.elig[k] as usize]).sum();
            value += sh.value * placed;
            left.push(sh.count - placed);
        }
        for &s in &self.order {
            let sh = &self.shapes[s];
            for k in self.pairs(s) {
                if left[s] <= 0.0 {
                    break;
                }
                let r = &mut rem[self.elig[k] as usize];
                let fit = sh
                    .uses
                    .iter()
                    .zip(r.iter())
                    .filter(|(a, _)| **a > 0.0)
                    .map(|(a, c)| c.max(0.0) / a)
                    .fold(left[s], f64::min);
                if fit > 0.0 {
                    for (c, a) in r.iter_mut().zip(&sh.uses) {
                        *c -= fit * a;
                    }
                    value += fit * sh.value;
                    left[s] -= fit;
                }
            }
        }
        // Infeasible while a pod that must be placed is left over: no lower value (0 is one).
        if must_left(&left) { 0.0 } else { value }
    }

    /// Minimizes L from u = 0, starting from the dual value `best`: the best dual value seen,
    /// the best primal value found, and the iterations run.
    fn minimize(&self, iterations: u32, mut best: f64) -> (f64, f64, u32) {
        let types = self.cap.len();
        let mut u = vec![[0.0f64; 4]; types];
        let mut y = vec![[0.0f64; 4]; types];
        let mut g = vec![[0.0f64; 4]; types];
        let mut dir = vec![[0.0f64; 4]; types];
        let mut pick = vec![None; self.shapes.len()];
        let mut xsum = vec![0.0f64; self.elig.len()];
        let mut lower = self.primal(&xsum, 1.0);
        let (mut iterate_best, mut theta, mut stall, mut runs) = (f64::INFINITY, 1.0, 0u32, 0u32);
        while runs < iterations && best - lower > 1e-9 * best.max(1.0) && theta >= MIN_THETA {
            let l = self.dual(&u, &mut y, &mut g, &mut pick);
            runs += 1;
            for (p, sh) in pick.iter().zip(&self.shapes) {
                if let Some(k) = *p {
                    xsum[k] += sh.count;
                }
            }
            if runs.is_multiple_of(RECOVER_EVERY) {
                lower = lower.max(self.primal(&xsum, f64::from(runs)));
            }
            best = best.min(l);
            if l < iterate_best {
                iterate_best = l;
                stall = 0;
            } else {
                stall += 1;
                if stall >= STALL {
                    theta *= 0.5;
                    stall = 0;
                }
            }
            // Deflected direction, projected: no push below zero at a zero multiplier.
            let mut norm = 0.0;
            for ((dt, gt), ut) in dir.iter_mut().zip(&g).zip(&u) {
                for ((d, &gr), &ur) in dt.iter_mut().zip(gt).zip(ut) {
                    let v = gr + DEFLECT * *d;
                    *d = if ur <= 0.0 && v > 0.0 { 0.0 } else { v };
                    norm += *d * *d;
                }
            }
            if norm <= 0.0 || l <= lower {
                break;
            }
            let step = theta * (l - lower) / norm;
            for (ut, dt) in u.iter_mut().zip(&dir) {
                for (ur, d) in ut.iter_mut().zip(dt) {
                    *ur = (*ur - step * d).max(0.0);
                }
            }
        }
        if runs > 0 {
            lower = lower.max(self.primal(&xsum, f64::from(runs)));
        }
        (best, lower, runs)
    }

    /// The bound (milli), a feasible LP value (milli) and the iterations run.
    fn solve(&self) -> (f64, f64, u32) {
        // Two dual points in closed form: u = 0 (every arrived pod that fits somewhere), and
        // the GPU rows priced at the largest value per GPU milli (the GPU capacity).
        let l0: f64 = self.shapes.iter().map(|s| s.count * s.value).sum();
        let ratio = self.shapes.iter().filter(|s| s.uses[2] > 0.0).map(|s| s.value / s.uses[2]).fold(0.0, f64::max);
        let lcap = self.cap.iter().map(|c| c[2]).sum::<f64>() * ratio;
        let iterations = (WORK / self.elig.len().max(1)).clamp(MIN_ITERATIONS, ITERATIONS) as u32;
        let (best, lower, runs) = self.minimize(iterations, l0.min(lcap));
        // A margin far above the rounding of the sums in L keeps the bound certified.
        ((best + 1e-9 * best.max(l0)).min(l0).min(lcap), lower, runs)
    }
}

/// The bound for the pods of `seq` (indices into `pods`, with repeats) on `nodes`.
pub fn upper_bound(nodes: &[Node], pods: &[TracePod], seq: &[usize]) -> Result<Bound, BoundError> {
    bound_of(nodes, pods, seq, None)
}

/// The bound for the pods of `seq` when the CPU-only pods one run placed must be placed too:
/// `placed[i]` is how many times the run placed pod `i` (entries of GPU pods are ignored).
/// Valid for any policy that admits at least those CPU-only pods; an error when `placed` has
/// another length than `pods`, places a pod more often than it arrived, or places one that
/// fits no node.
pub fn upper_bound_given(
    nodes: &[Node],
    pods: &[TracePod],
    seq: &[usize],
    placed: &[u32],
) -> Result<Bound, BoundError> {
    if placed.len() != pods.len() {
        return Err(limit("placed", format!("{} entries for {} pods", placed.len(), pods.len())));
    }
    bound_of(nodes, pods, seq, Some(placed))
}

fn bound_of(nodes: &[Node], pods: &[TracePod], seq: &[usize], placed: Option<&[u32]>) -> Result<Bound, BoundError> {
    let total = nodes.iter().map(whole_gpus).sum::<u64>() * 1000;
    if total == 0 {
        return Err(limit("nodes", "the cluster has no GPUs".into()));
    }
    let mut times = vec![0u64; pods.len()];
    let mut arrived = 0u64;
    for &i in seq {
        let p =
            pods.get(i).ok_or_else(|| limit("seq", format!("pod index {i} is out of range ({} pods)", pods.len())))?;
        times[i] += 1;
        arrived = arrived.saturating_add(p.gpu_request_milli());
    }
    let mut shapes = BTreeMap::new();
    let mut must_any = false;
    for (i, (p, &n)) in pods.iter().zip(&times).enumerate() {
        let value = p.gpu_request_milli();
        // A CPU-only pod counts only where the run placed it (then it must be placed).
        let must = match placed {
            Some(placed) if value == 0 => {
                let k = u64::from(placed[i]);
                if k > n {
                    return Err(limit("placed", format!("pod {i} placed {k} times but arrived {n} times")));
                }
                k
            }
            _ => 0,
        };
        let n = if value == 0 { must } else { n };
        if n == 0 {
            continue;
        }
        must_any |= must > 0;
        let key = ShapeKey {
            cpu: p.cpu_milli,
            mem: p.memory_mib,
            gpus: p.num_gpu,
            milli: p.gpu_milli,
            replicas: p.replicas,
            spec: &p.gpu_spec,
        };
        shapes.entry(key).or_insert((value, 0, must > 0)).1 += n;
        if shapes.len() > MAX_SHAPES {
            return Err(limit("shapes", format!("more than {MAX_SHAPES} distinct pod shapes arrived")));
        }
    }
    let mut types = BTreeMap::new();
    for n in nodes.iter().filter(|n| n.schedulable) {
        let models = gpu_models(n);
        let slots: u64 = models.iter().map(|(_, c)| c).sum();
        // Nodes without GPUs matter only as room for CPU-only pods that must be placed.
        if slots == 0 && !must_any {
            continue;
        }
        *types.entry(TypeKey { cpu: n.cpu_milli, mem: n.memory_mib, slots, models }).or_insert(0u64) += 1;
        if types.len() > MAX_NODE_TYPES {
            return Err(limit("node_types", format!("more than {MAX_NODE_TYPES} distinct schedulable GPU node types")));
        }
    }
    let (milli, lower, iterations) = Problem::new(&shapes, &types)?.solve();
    let pct = |m: f64| m / total as f64 * 100.0;
    Ok(Bound { alloc_pct: pct(milli), lp_lower_pct: pct(lower), arrived_pct: pct(arrived as f64), iterations })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fill::{FillOptions, arrival_sequence, fill};
    use crate::synth;
    use suanli_model::{Device, NodeId, PoolId};

    fn node(i: usize, cores: u64, gpus: u32) -> Node {
        Node {
            id: NodeId::new(format!("node-{i:05}")),
            pool: PoolId::new("a100"),
            datacenter: "west-dc0".into(),
            region: "west".into(),
            labels: BTreeMap::new(),
            cpu_milli: cores * 1000,
            memory_mib: 512 * 1024,
            devices: (0..gpus).map(|g| Device::simple(format!("gpu{g}"), DeviceKind::Gpu, "A100-80G")).collect(),
            schedulable: true,
            agent_addr: String::new(),
        }
    }

    fn pod(cores: u64, num_gpu: u32, gpu_milli: u32) -> TracePod {
        TracePod::single("p".into(), cores * 1000, 1024, num_gpu, gpu_milli)
    }

    #[test]
    fn the_bound_is_above_every_policy() {
        let pods = synth::trace_pods(400, 3, 1, false);
        // As generated, every policy fills the cluster; with 48 cores a node the CPU binds
        // first and the bound falls well below 100%.
        for cores in [None, Some(48)] {
            let mut nodes = synth::nodes(16);
            if let Some(c) = cores {
                nodes.iter_mut().for_each(|n| n.cpu_milli = c * 1000);
            }
            let gpus = nodes.iter().flat_map(|n| &n.devices).filter(|d| d.kind == DeviceKind::Gpu).count() as u64;
            for seed in [1, 7] {
                let (seq, _) = arrival_sequence(&pods, nodes.len(), gpus * 1000, 1.3, seed);
                let bound = upper_bound(&nodes, &pods, &seq).expect("bound");
                assert!(bound.alloc_pct >= bound.lp_lower_pct - 1e-9, "{bound:?}");
                assert!(bound.alloc_pct <= bound.arrived_pct.min(100.0) + 1e-9, "{bound:?}");
                assert_eq!(bound.alloc_pct < 90.0, cores.is_some(), "{bound:?}");
                for policy in suanli_scheduler::POLICY_NAMES {
                    let opts =
                        FillOptions { policy: policy.into(), seed, bound_given_placed: true, ..Default::default() };
                    let run = fill(&nodes, &pods, &opts).expect("fill");
                    assert!(
                        bound.alloc_pct + 1e-9 >= run.final_alloc,
                        "{policy} {seed}: {} > {bound:?}",
                        run.final_alloc
                    );
                    let given = run.bound_given_placed.expect("asked for");
                    assert!(given + 1e-9 >= run.final_alloc, "{policy} {seed}: {} > {given}", run.final_alloc);
                }
            }
        }
    }

    #[test]
    fn cpu_limits_the_bound() {
        let nodes = [node(0, 64, 8), node(1, 64, 8)];
        let pods = vec![pod(30, 1, 1000); 6];
        // Four pods of 30 cores fit (two per node): 4 of 16 GPUs.
        let b = upper_bound(&nodes, &pods, &[0, 1, 2, 3]).expect("bound");
        assert!((25.0 - 1e-9..=25.5).contains(&b.alloc_pct), "{b:?}");
        // Six do not: the CPU rows bind, the LP takes 128/30 pods, 26.67%, not 37.5%.
        let b = upper_bound(&nodes, &pods, &[0, 1, 2, 3, 4, 5]).expect("bound");
        assert!((b.arrived_pct - 37.5).abs() < 1e-9, "{b:?}");
        assert!((25.0..=128.0 / 30.0 / 16.0 * 100.0 + 0.5).contains(&b.alloc_pct), "{b:?}");
        assert!(b.alloc_pct >= b.lp_lower_pct - 1e-9, "{b:?}");
    }

    #[test]
    fn big_shares_take_a_gpu_each() {
        let nodes = [node(0, 64, 1)];
        // Two 600-milli shares never share a GPU: one fits, 60%.
        let b = upper_bound(&nodes, &[pod(1, 1, 600)], &[0, 0]).expect("bound");
        assert!((b.arrived_pct - 120.0).abs() < 1e-9, "{b:?}");
        assert!((60.0 - 1e-9..=60.5).contains(&b.alloc_pct), "{b:?}");
        // Two 500-milli shares do share it: the cut must not apply.
        let b = upper_bound(&nodes, &[pod(1, 1, 500)], &[0, 0]).expect("bound");
        assert!(b.alloc_pct >= 100.0 - 1e-9, "{b:?}");
    }

    #[test]
    fn placed_cpu_work_tightens_the_bound() {
        let nodes = [node(0, 8, 1)];
        // A 6-core CPU-only pod arrives, then a 4-core one-GPU pod: alone, the GPU pod fits.
        let pods = vec![pod(4, 1, 1000), pod(6, 0, 0)];
        let b = upper_bound(&nodes, &pods, &[1, 0]).expect("bound");
        assert!(b.alloc_pct >= 100.0 - 1e-9, "{b:?}");
        // Admitting the CPU pod leaves 2 cores: the LP takes half the GPU pod at most.
        let b = upper_bound_given(&nodes, &pods, &[1, 0], &[0, 1]).expect("bound");
        assert!((50.0 - 1e-6..=50.5).contains(&b.alloc_pct), "{b:?}");
        assert!(b.alloc_pct >= b.lp_lower_pct - 1e-9, "{b:?}");
        // A GPU pod's entry is ignored; a CPU pod not placed adds nothing.
        let b = upper_bound_given(&nodes, &pods, &[1, 0], &[1, 0]).expect("bound");
        assert!(b.alloc_pct >= 100.0 - 1e-9, "{b:?}");
        // On a node without GPUs the CPU pod is out of the way.
        let b = upper_bound_given(&[node(0, 8, 1), node(1, 8, 0)], &pods, &[1, 0], &[0, 1]).expect("bound");
        assert!(b.alloc_pct >= 100.0 - 1e-6, "{b:?}");
    }

    #[test]
    fn limits_name_the_field() {
        let field_of = |r: Result<Bound, BoundError>| {
            let BoundError::Limit { field, message } = r.expect_err("limit");
            assert!(!message.is_empty(), "{field}");
            field
        };
        let one = [node(0, 64, 8)];
        let pods: Vec<TracePod> =
            (0..=MAX_SHAPES as u64).map(|i| TracePod { cpu_milli: i + 1, ..pod(0, 1, 1000) }).collect();
        let seq: Vec<usize> = (0..pods.len()).collect();
        assert_eq!(field_of(upper_bound(&one, &pods, &seq)), "shapes");
        let many: Vec<Node> =
            (0..=MAX_NODE_TYPES).map(|i| Node { cpu_milli: 1000 + i as u64, ..node(i, 1, 1) }).collect();
        assert_eq!(field_of(upper_bound(&many, &pods[..1], &[0])), "node_types");
        assert_eq!(field_of(upper_bound(&one, &pods[..1], &[5])), "seq");
        assert_eq!(field_of(upper_bound(&[node(0, 8, 0)], &pods[..1], &[0])), "nodes");
        let e = upper_bound(&one, &pods[..1], &[5]).expect_err("seq");
        assert!(e.to_string().starts_with("seq: "), "{e}");
        let cpu = [pod(4, 1, 1000), pod(6, 0, 0), pod(100, 0, 0)];
        assert_eq!(field_of(upper_bound_given(&one, &cpu, &[0, 1], &[0, 1])), "placed");
        assert_eq!(field_of(upper_bound_given(&one, &cpu, &[0, 1], &[0, 2, 0])), "placed");
        assert_eq!(field_of(upper_bound_given(&one, &cpu, &[0, 1, 2], &[0, 1, 1])), "placed");
    }
}
