//! Placement policies: feasibility and node scoring.
//!
//! A policy looks at one node (through its class, see [`crate::cluster`]) and a task shape
//! and answers "no" or a score plus the devices it would use. Higher scores win; equal scores
//! are broken at random by the caller. Everything here is a pure function of its arguments.
//!
//! Shipped policies:
//! - `suanli` (default): weighted scorers — fragmentation (exact FGD delta against the typical
//!   workload), bin-pack, spread and topology (keep a multi-device task inside one NVLink/HCCS
//!   island or NUMA node).
//! - Faithful re-implementations of the baselines compared in "Beware of Fragmentation"
//!   (USENIX ATC'23): `random`, `bestfit`, `dotprod`, `gpupacking`, `gpuclustering` and `fgd`,
//!   with the published simulator's 0-100 integer scores and GPU selection rules, so that
//!   `suanli sim fill` results compare with the paper's.

use crate::cluster::{ALL_MODELS, DevReq, DevState, MAX_NODE_DEVICES, ModelSet, NodeView, Shape, StaticGroup};
use crate::workload::Profile;
use serde::{Deserialize, Serialize};
use std::fmt;
use suanli_model::DeviceKind;
use thiserror::Error;

/// How the caller resolves the device mask of an [`Eval`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Use exactly the devices in the mask.
    Exact,
    /// Use one device chosen uniformly at random from the mask.
    RandomOne,
    /// Use the `n` devices of the mask with the lowest device index on the node (the
    /// published simulator's rule; interchangeable devices make this a pure tie-break).
    Lowest(u8),
}

/// How equally scored nodes are chosen between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TieBreak {
    /// Uniformly at random (seeded).
    Random,
    /// The node earliest in a fixed order (a seeded permutation of the nodes): the published
    /// simulator's "smallest name" rule, which packs ties first-fit.
    FixedOrder,
}

/// A policy's verdict for one (node class, shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eval {
    /// Higher is better.
    pub score: i64,
    /// Canonical device slots to use.
    pub mask: u64,
    /// How to read the mask.
    pub pick: Pick,
}

/// A placement policy. Implementations must be deterministic functions of their arguments.
pub trait Policy: Send + Sync + fmt::Debug {
    /// Policy name as selected on the command line.
    fn name(&self) -> &'static str;
    /// `None` when the shape cannot be placed on the node, else the score and devices.
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval>;
    /// Whether the policy reads [`NodeView::tags`].
    fn needs_tags(&self) -> bool {
        false
    }
    /// How ties between nodes are broken.
    fn tie_break(&self) -> TieBreak {
        TieBreak::FixedOrder
    }
}

/// Error for an unknown policy name.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("unknown policy {name:?}; valid policies: {}", POLICY_NAMES.join(", "))]
pub struct UnknownPolicy {
    /// What was asked for.
    pub name: String,
}

/// Every selectable policy name.
pub const POLICY_NAMES: [&str; 7] = ["suanli", "fgd", "bestfit", "dotprod", "gpupacking", "gpuclustering", "random"];

/// Weights of the `suanli` policy's scorers. Scores are in comparable units: fragmentation in
/// whole devices of expected fragmentation avoided, the others in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Weights {
    /// Fragmentation-aware (FGD delta). 0 turns it off.
    pub fragmentation: f64,
    /// Bin-pack: prefer the node left fullest.
    pub binpack: f64,
    /// Spread: prefer the emptiest node (use for inference replicas; conflicts with bin-pack).
    pub spread: f64,
    /// Topology: keep a multi-device task inside one peer-link island / NUMA node.
    pub topology: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self { fragmentation: 1.0, binpack: 0.05, spread: 0.0, topology: 1.0 }
    }
}

/// Cluster-wide constants some scorers normalize by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Norms {
    /// Largest node CPU, milli-cores.
    pub max_cpu_milli: u64,
    /// Largest node accelerator count x 1000.
    pub max_dev_milli: u64,
}

impl Norms {
    /// From the cluster's static groups.
    pub fn of(groups: &[StaticGroup]) -> Self {
        Self {
            max_cpu_milli: groups.iter().map(|g| g.cpu_milli).max().unwrap_or(1).max(1),
            max_dev_milli: groups.iter().map(|g| g.devs.len() as u64 * 1000).max().unwrap_or(1000).max(1000),
        }
    }
}

/// Builds a policy by name. `ties` is the default's tie rule as a rehearsal chose it
/// ([`crate::rehearsal`]); `None`: the rule the profile alone gives ([`Ties::of`]).
pub fn build(
    name: &str,
    norms: Norms,
    profile: &Profile,
    weights: Weights,
    ties: Option<Ties>,
) -> Result<Box<dyn Policy>, UnknownPolicy> {
    Ok(match name {
        "suanli" => Box::new(Suanli {
            norms,
            ties: ties.unwrap_or_else(|| Ties::of(profile)),
            profile: profile.clone(),
            weights,
        }),
        "fgd" => Box::new(Fgd { profile: profile.clone() }),
        "bestfit" => Box::new(BestFit { norms }),
        "dotprod" => Box::new(DotProd { norms }),
        "gpupacking" => Box::new(GpuPacking),
        "gpuclustering" => Box::new(GpuClustering { norms }),
        "random" => Box::new(RandomPolicy),
        other => return Err(UnknownPolicy { name: other.to_owned() }),
    })
}

// ---------------------------------------------------------------------------------------------
// Feasibility

/// Devices that can take one unit of `req` (canonical slot mask).
#[inline]
pub fn eligible(g: &StaticGroup, n: &NodeView<'_>, req: &DevReq, models: ModelSet) -> u64 {
    let mut m = 0u64;
    for (i, (d, st)) in g.devs.iter().zip(n.devs).enumerate() {
        if d.kind == req.kind
            && models & (1u128 << d.model) != 0
            && (req.count == 1 || !d.partition)
            && (!req.isolated || d.isolated)
            && st.healthy
            && st.free_milli >= req.milli
            && st.free_mem_mib >= req.memory_mib
        {
            m |= 1 << i;
        }
    }
    m
}

/// CPU, memory and device feasibility; the eligible device mask when feasible.
#[inline]
pub fn feasible(g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<u64> {
    if n.cpu_free < s.cpu_milli || n.mem_free < s.memory_mib {
        return None;
    }
    match &s.dev {
        None => Some(0),
        Some(req) => {
            let m = eligible(g, n, req, s.models);
            (m.count_ones() >= req.count).then_some(m)
        }
    }
}

/// Why a node cannot host `s`, or `None` when it can.
pub fn misfit(g: &StaticGroup, n: &NodeView<'_>, s: &Shape, models: &[String]) -> Option<String> {
    if n.cpu_free < s.cpu_milli {
        return Some("insufficient cpu".into());
    }
    if n.mem_free < s.memory_mib {
        return Some("insufficient memory".into());
    }
    let req = s.dev?;
    let kind = req.kind;
    if !g.devs.iter().any(|d| d.kind == kind) {
        return Some(format!("no {kind}"));
    }
    if !g.devs.iter().any(|d| d.kind == kind && s.models & (1u128 << d.model) != 0) {
        let allowed: Vec<&str> = match &s.model_names {
            Some(names) => names.iter().map(String::as_str).collect(),
            None => models
                .iter()
                .enumerate()
                .filter(|(i, _)| s.models & (1u128 << i) != 0)
                .map(|(_, m)| m.as_str())
                .collect(),
        };
        return Some(format!("{kind} model not in [{}]", allowed.join(",")));
    }
    if req.isolated && !g.devs.iter().any(|d| d.kind == kind && s.models & (1u128 << d.model) != 0 && d.isolated) {
        return Some(format!("{kind} shares not isolated (constraints.share_isolation = enforced)"));
    }
    let m = eligible(g, n, &req, s.models);
    if m.count_ones() >= req.count {
        return None;
    }
    let mut healthy = *n;
    let all_ok: Vec<_> = n.devs.iter().map(|d| crate::cluster::DevState { healthy: true, ..*d }).collect();
    healthy.devs = &all_ok;
    if eligible(g, &healthy, &req, s.models).count_ones() >= req.count {
        return Some(format!("unhealthy {kind}"));
    }
    if req.memory_mib > 0 {
        let no_mem = DevReq { memory_mib: 0, ..req };
        if eligible(g, n, &no_mem, s.models).count_ones() >= req.count {
            return Some(format!("insufficient {kind} memory"));
        }
    }
    Some(format!("insufficient {kind}"))
}

// ---------------------------------------------------------------------------------------------
// Shared helpers

fn lowest_n(mask: u64, n: u32) -> u64 {
    let mut m = mask;
    let mut out = 0;
    for _ in 0..n {
        let b = m & m.wrapping_neg();
        out |= b;
        m &= m - 1;
    }
    out
}

/// Sum of available milli of devices of `kind` (all accelerators when `None`).
#[inline]
fn free_total(g: &StaticGroup, n: &NodeView<'_>, kind: Option<DeviceKind>) -> u64 {
    g.devs
        .iter()
        .zip(n.devs)
        .filter(|(d, _)| kind.is_none_or(|k| d.kind == k))
        .map(|(_, st)| u64::from(st.avail()))
        .sum()
}

/// "best" GPU selection of the published simulator: a sharing task takes the eligible device
/// with the least left; whole devices are the lowest-index fully free ones.
fn best_choice(g: &StaticGroup, n: &NodeView<'_>, req: &DevReq, elig: u64) -> (u64, Pick) {
    if req.is_share() {
        let min = (0..g.devs.len()).filter(|&i| elig & (1 << i) != 0).map(|i| n.devs[i].free_milli).min();
        let mask = (0..g.devs.len())
            .filter(|&i| elig & (1 << i) != 0 && Some(n.devs[i].free_milli) == min)
            .fold(0u64, |m, i| m | (1 << i));
        (mask, Pick::Lowest(1))
    } else {
        (elig, Pick::Lowest(req.count.min(64) as u8))
    }
}

fn eval_best(g: &StaticGroup, n: &NodeView<'_>, s: &Shape, elig: u64, score: i64) -> Eval {
    match s.dev {
        None => Eval { score, mask: 0, pick: Pick::Exact },
        Some(r) => {
            let (mask, pick) = best_choice(g, n, &r, elig);
            Eval { score, mask, pick }
        }
    }
}

/// Takes `milli` from every device in `mask`.
fn take(devs: &mut [DevState], mask: u64, milli: u16) {
    for (i, d) in devs.iter_mut().enumerate() {
        if mask & (1 << i) != 0 {
            d.free_milli -= milli;
        }
    }
}

fn dev_total(s: &Shape) -> u64 {
    s.dev.map_or(0, |d| d.total_milli())
}

// ---------------------------------------------------------------------------------------------
// Baselines (faithful to the ATC'23 simulator)

/// Uniformly random feasible node; random device for sharing tasks.
#[derive(Debug)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }
    fn tie_break(&self) -> TieBreak {
        TieBreak::Random
    }
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval> {
        let elig = feasible(g, n, s)?;
        Some(match s.dev {
            None => Eval { score: 0, mask: 0, pick: Pick::Exact },
            Some(r) if r.is_share() => Eval { score: 0, mask: elig, pick: Pick::RandomOne },
            Some(r) => Eval { score: 0, mask: elig, pick: Pick::Lowest(r.count.min(64) as u8) },
        })
    }
}

/// Leaves the node fullest: score = 100 x (1 - (cpu left / max cpu + dev left / max dev) / 2).
#[derive(Debug)]
pub struct BestFit {
    norms: Norms,
}

impl Policy for BestFit {
    fn name(&self) -> &'static str {
        "bestfit"
    }
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval> {
        let elig = feasible(g, n, s)?;
        let cpu_left = (n.cpu_free - s.cpu_milli) as f64 / self.norms.max_cpu_milli as f64;
        let dev_left = free_total(g, n, s.dev.map(|d| d.kind).or(Some(DeviceKind::Gpu))).saturating_sub(dev_total(s))
            as f64
            / self.norms.max_dev_milli as f64;
        let score = (100.0 * (1.0 - (0.5 * cpu_left + 0.5 * dev_left))) as i64;
        Some(eval_best(g, n, s, elig, score))
    }
}

/// Smallest dot product of free resources and request (Tetris-style alignment).
#[derive(Debug)]
pub struct DotProd {
    norms: Norms,
}

impl Policy for DotProd {
    fn name(&self) -> &'static str {
        "dotprod"
    }
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval> {
        let elig = feasible(g, n, s)?;
        let (mc, md) = (self.norms.max_cpu_milli as f64, self.norms.max_dev_milli as f64);
        let free_dev = free_total(g, n, s.dev.map(|d| d.kind).or(Some(DeviceKind::Gpu))) as f64;
        let dot = (n.cpu_free as f64 / mc) * (s.cpu_milli as f64 / mc) + (free_dev / md) * (dev_total(s) as f64 / md);
        let score = (100.0 * (1.0 - dot / 2.0)) as i64;
        Some(eval_best(g, n, s, elig, score))
    }
}

/// Packs sharing tasks onto used devices and whole-device tasks onto used nodes.
#[derive(Debug)]
pub struct GpuPacking;

impl Policy for GpuPacking {
    fn name(&self) -> &'static str {
        "gpupacking"
    }
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval> {
        let elig = feasible(g, n, s)?;
        let Some(r) = s.dev else { return Some(Eval { score: 0, mask: 0, pick: Pick::Exact }) };
        let of_kind: Vec<usize> = (0..g.devs.len()).filter(|&i| g.devs[i].kind == r.kind).collect();
        let all_free = of_kind.iter().all(|&i| n.devs[i].avail() == 1000);
        let score = if all_free {
            // A completely free node: the more devices it has, the less we want to open it.
            let free = of_kind.len() as i64;
            (33 - free).max(free)
        } else {
            // Walk devices ascending by free (stable), take the first `count` that fit.
            let mut order = of_kind.clone();
            order.sort_by_key(|&i| n.devs[i].avail());
            let taken: Vec<usize> =
                order.into_iter().filter(|&i| elig & (1 << i) != 0).take(r.count as usize).collect();
            let k = taken.iter().filter(|&&i| n.devs[i].avail() == 1000).count() as i64;
            if k > 0 {
                (50 - k).max(33)
            } else {
                let sum: i64 = taken.iter().map(|&i| i64::from(n.devs[i].avail()) * 100 / 1000).sum();
                (100 - sum / 10).max(50)
            }
        };
        Some(eval_best(g, n, s, elig, score))
    }
}

/// Clusters tasks of the same device-shape on the same nodes.
#[derive(Debug)]
pub struct GpuClustering {
    norms: Norms,
}

impl Policy for GpuClustering {
    fn name(&self) -> &'static str {
        "gpuclustering"
    }
    fn needs_tags(&self) -> bool {
        true
    }
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval> {
        let elig = feasible(g, n, s)?;
        let Some(r) = s.dev else { return Some(Eval { score: 0, mask: 0, pick: Pick::Exact }) };
        let md = self.norms.max_dev_milli as i64;
        let used = md - free_total(g, n, Some(r.kind)) as i64;
        let t = (25 * used) / md;
        let tag = r.tag_bit();
        let score = if n.tags & tag != 0 && n.tags.count_ones() == 1 {
            75 + t
        } else if n.tags & tag != 0 {
            50 + t
        } else if n.tags == 0 {
            25 + t
        } else {
            t
        };
        Some(eval_best(g, n, s, elig, score))
    }
}

/// Fragmentation Gradient Descent as published: integer score
/// `int(100 * sigmoid((F(before) - F(after)) / 1000))`.
#[derive(Debug)]
pub struct Fgd {
    profile: Profile,
}

fn sigmoid_score(delta_milli: f64) -> i64 {
    (100.0 / (1.0 + (-delta_milli / 1000.0).exp())) as i64
}

/// FGD's device choice for a share of `milli` on one node: every eligible device tried, its
/// integer score of the fragmentation avoided; returns the best score (`i64::MIN` when no device
/// is eligible), the exact delta of the first best device and the mask of the best devices
/// (the caller takes the lowest physical index, as the published simulator does).
#[allow(clippy::too_many_arguments)]
fn fgd_share(
    profile: &Profile,
    g: &StaticGroup,
    n: &NodeView<'_>,
    after_cpu: u64,
    after_devs: &mut [DevState],
    elig: u64,
    milli: u16,
    before: f64,
) -> (i64, Option<f64>, u64) {
    let (mut best, mut delta, mut mask) = (i64::MIN, None, 0u64);
    for i in (0..g.devs.len()).filter(|&i| elig & (1 << i) != 0) {
        after_devs[i].free_milli -= milli;
        let after = profile.fragmentation(g, &NodeView { cpu_free: after_cpu, devs: after_devs, ..*n });
        after_devs[i].free_milli += milli;
        let sc = sigmoid_score(before - after);
        if sc > best {
            (best, delta, mask) = (sc, Some(before - after), 0);
        }
        if sc == best {
            mask |= 1 << i;
        }
    }
    (best, delta, mask)
}

impl Policy for Fgd {
    fn name(&self) -> &'static str {
        "fgd"
    }
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval> {
        let elig = feasible(g, n, s)?;
        let before = self.profile.fragmentation(g, n);
        let mut buf = [DevState::default(); MAX_NODE_DEVICES];
        let after_devs = &mut buf[..n.devs.len()];
        after_devs.copy_from_slice(n.devs);
        let after_cpu = n.cpu_free - s.cpu_milli;
        match s.dev {
            Some(r) if r.is_share() => {
                let (score, _, mask) = fgd_share(&self.profile, g, n, after_cpu, after_devs, elig, r.milli, before);
                Some(Eval { score, mask, pick: Pick::Lowest(1) })
            }
            Some(r) => {
                let mask = lowest_n(elig, r.count);
                let pick_from = elig;
                take(after_devs, mask, r.milli);
                let after = self.profile.fragmentation(g, &NodeView { cpu_free: after_cpu, devs: after_devs, ..*n });
                // Whole devices: any fully free ones give the same state; take the lowest ids.
                Some(Eval {
                    score: sigmoid_score(before - after),
                    mask: pick_from,
                    pick: Pick::Lowest(r.count.min(64) as u8),
                })
            }
            None => {
                let after = self.profile.fragmentation(g, &NodeView { cpu_free: after_cpu, ..*n });
                Some(Eval { score: sigmoid_score(before - after), mask: 0, pick: Pick::Exact })
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// suanli's default

/// suanli's default policy: FGD's integer score first, so the node chosen is always one FGD
/// ranks first; inside that set ([`Ties`]) a CPU-only or multi-device pod goes by the exact
/// fragmentation delta, bin-pack (for a CPU-only pod: the fewest free devices) and topology,
/// and a pod of one device by topology, then FGD's own device choice and order; when
/// constrained work over-asks a device model, every pod as FGD plus topology. Whole devices
/// stay inside one NVLink block where they fit (best fit); without a workload profile a
/// fractional pod takes the best-fitting device (docs/sim.md, "How the default decides").
#[derive(Debug)]
pub struct Suanli {
    norms: Norms,
    ties: Ties,
    profile: Profile,
    weights: Weights,
}

const SCALE: f64 = 1e6;
/// One step of the primary (FGD) score in the combined score; the secondary stays within a
/// quarter of it, so it only orders nodes of equal primary score.
const PRIMARY_STEP: i64 = 1_000_000_000;

/// How the default breaks ties between nodes FGD scores equally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ties {
    /// By the kind of pod: a pod of one device (a fraction or one whole device) by topology,
    /// then FGD's own device choice and node order; a CPU-only or multi-device pod by the
    /// weighted sum (exact fragmentation delta, bin-pack, spread, topology). For one-device
    /// pods the weighted sum chose worse than FGD's first fit on most mixes; for the other
    /// kinds it chose better (docs/sim.md, "How the default decides").
    ByKind,
    /// Every pod by topology, then FGD's own device choice (best integer score, lowest index)
    /// and node order, so that without topology labels the default places exactly as FGD:
    /// chosen when work limited to some device models asks more of a model than its share of
    /// the cluster (the exact delta would pull unconstrained work onto the models few typical
    /// tasks can use — the ones the constrained work needs).
    FirstFit,
}

impl Ties {
    /// The tie-break for a workload profile (see docs/sim.md, "How the default decides").
    pub fn of(profile: &Profile) -> Self {
        if profile.model_pressure().iter().any(|&p| p >= 1.0) { Ties::FirstFit } else { Ties::ByKind }
    }

    /// Its name (`by-kind`, `first-fit`).
    pub fn as_str(self) -> &'static str {
        match self {
            Ties::ByKind => "by-kind",
            Ties::FirstFit => "first-fit",
        }
    }

    /// Whether a pod of this shape breaks ties as FGD does (else by the weighted sum).
    fn fgd_for(self, s: &Shape) -> bool {
        match self {
            Ties::FirstFit => true,
            Ties::ByKind => s.dev.is_some_and(|r| r.count == 1),
        }
    }
}

impl Suanli {
    /// Chooses whole devices: the fullest topology block that holds all of them, else the
    /// fewest blocks. Returns (mask, topology score in [0,1]).
    fn whole_devices(&self, g: &StaticGroup, elig: u64, count: u32) -> (u64, f64) {
        if !g.has_topology || count <= 1 {
            return (lowest_n(elig, count), 1.0);
        }
        let nb = g.blocks.len();
        let mut per_block: Vec<u64> = vec![0; nb];
        for i in 0..g.devs.len() {
            if elig & (1 << i) != 0 {
                per_block[g.devs[i].block as usize] |= 1 << i;
            }
        }
        // Best fit: the block with the fewest eligible devices that still holds `count`.
        if let Some(b) =
            (0..nb).filter(|&b| per_block[b].count_ones() >= count).min_by_key(|&b| (per_block[b].count_ones(), b))
        {
            return (lowest_n(per_block[b], count), 1.0);
        }
        let mut order: Vec<usize> = (0..nb).collect();
        order.sort_by_key(|&b| (std::cmp::Reverse(per_block[b].count_ones()), b));
        let (mut mask, mut left, mut used) = (0u64, count, 0u32);
        for b in order {
            if left == 0 {
                break;
            }
            let take = per_block[b].count_ones().min(left);
            if take > 0 {
                mask |= lowest_n(per_block[b], take);
                left -= take;
                used += 1;
            }
        }
        (mask, 1.0 / f64::from(used.max(1)))
    }
}

impl Policy for Suanli {
    fn name(&self) -> &'static str {
        "suanli"
    }
    fn eval(&self, g: &StaticGroup, n: &NodeView<'_>, s: &Shape) -> Option<Eval> {
        let elig = feasible(g, n, s)?;
        let w = &self.weights;
        let kind = s.dev.map(|d| d.kind).or(Some(DeviceKind::Gpu));
        let use_frag = w.fragmentation != 0.0 && !self.profile.is_empty();
        let before = if use_frag { self.profile.fragmentation(g, n) } else { 0.0 };
        let after_cpu = n.cpu_free - s.cpu_milli;
        let mut buf = [DevState::default(); MAX_NODE_DEVICES];
        let after_devs = &mut buf[..n.devs.len()];
        after_devs.copy_from_slice(n.devs);
        // One-device pods break ties as FGD does; CPU-only and multi-device pods by the
        // weighted sum (unless constrained work over-asks a model: then every pod as FGD).
        // Without a profile there is no FGD score to follow: the weighted sum (best fit).
        let fgd_ties = use_frag && self.ties.fgd_for(s);
        let (delta, topo, mask, pick) = match s.dev {
            Some(r) if r.is_share() && fgd_ties => {
                // FGD's own choice.
                let (_, delta, mask) = fgd_share(&self.profile, g, n, after_cpu, after_devs, elig, r.milli, before);
                (delta?, 1.0, mask, Pick::Lowest(1))
            }
            Some(r) if r.is_share() => {
                let mut best: Option<(f64, u16, usize)> = None;
                let mut last: Option<crate::cluster::DevState> = None;
                for i in 0..g.devs.len() {
                    if elig & (1 << i) == 0 {
                        continue;
                    }
                    // Interchangeable slots with equal state give equal results.
                    if last == Some(n.devs[i]) && i > 0 && g.devs[i] == g.devs[i - 1] {
                        continue;
                    }
                    last = Some(n.devs[i]);
                    let delta = if use_frag {
                        after_devs[i].free_milli -= r.milli;
                        let after =
                            self.profile.fragmentation(g, &NodeView { cpu_free: after_cpu, devs: after_devs, ..*n });
                        after_devs[i].free_milli += r.milli;
                        before - after
                    } else {
                        0.0
                    };
                    let left = n.devs[i].free_milli - r.milli;
                    // The least fragmentation exactly, ties to the best fit.
                    let better = match best {
                        None => true,
                        Some((bd, bl, _)) => delta > bd + 1e-6 || ((delta - bd).abs() <= 1e-6 && left < bl),
                    };
                    if better {
                        best = Some((delta, left, i));
                    }
                }
                let (delta, _, i) = best?;
                (delta, 1.0, 1u64 << i, Pick::Exact)
            }
            Some(r) => {
                let (mask, topo) = self.whole_devices(g, elig, r.count);
                let delta = if use_frag {
                    take(after_devs, mask, r.milli);
                    before - self.profile.fragmentation(g, &NodeView { cpu_free: after_cpu, devs: after_devs, ..*n })
                } else {
                    0.0
                };
                (delta, topo, mask, Pick::Exact)
            }
            None => {
                let delta = if use_frag {
                    before - self.profile.fragmentation(g, &NodeView { cpu_free: after_cpu, ..*n })
                } else {
                    0.0
                };
                (delta, 1.0, 0, Pick::Exact)
            }
        };
        // Primary: FGD's own integer score of the exact delta (device milli), so the node chosen
        // is always one FGD would rank first. Secondary, inside that set: for a pod that breaks
        // ties as FGD does (`fgd_ties`), only the topology term, leaving FGD's own device choice
        // and first-fit order to decide; for the others the weighted sum.
        let primary = if use_frag { sigmoid_score(delta) } else { 0 };
        let secondary = if fgd_ties {
            w.topology * topo
        } else {
            let cpu_left = (n.cpu_free - s.cpu_milli) as f64 / self.norms.max_cpu_milli as f64;
            let dev_left = free_total(g, n, kind).saturating_sub(dev_total(s)) as f64 / self.norms.max_dev_milli as f64;
            // A CPU-only pod packs onto the nodes with the fewest free devices: its cores
            // there strand no GPU (measured: docs/sim.md, "How the default decides").
            let fill = if s.dev.is_none() { 1.0 - dev_left } else { 1.0 - 0.5 * (cpu_left + dev_left) };
            let base = w.binpack * fill + w.spread * (1.0 - fill);
            w.fragmentation * delta / 1000.0 + base + w.topology * topo
        };
        let secondary = (secondary * SCALE).round().clamp(-(PRIMARY_STEP as f64) / 4.0, PRIMARY_STEP as f64 / 4.0);
        Some(Eval { score: primary * PRIMARY_STEP + secondary as i64, mask, pick })
    }
}

/// Default model set helper for tests.
pub fn any_model() -> ModelSet {
    ALL_MODELS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Cluster;
    use crate::workload::TypicalKey;
    use std::collections::BTreeMap;
    use suanli_model::{Constraints, Device, DeviceRequest, Limits, Node, NodeId, PoolId, TaskResources};

    fn gpu_node(id: &str, gpus: usize) -> Node {
        Node {
            id: NodeId::new(id),
            pool: PoolId::new("p"),
            datacenter: String::new(),
            region: String::new(),
            labels: Default::default(),
            cpu_milli: 16_000,
            memory_mib: 65_536,
            devices: (0..gpus).map(|i| Device::simple(format!("gpu{i}"), DeviceKind::Gpu, "A100")).collect(),
            schedulable: true,
            agent_addr: String::new(),
        }
    }

    /// Typical tasks: `share` of 600-milli fractions, `whole` of whole GPUs (one core each).
    fn profile(share: u64, whole: u64) -> Profile {
        let key = |milli| TypicalKey { cpu_milli: 1000, milli, count: 1, kind: DeviceKind::Gpu, models: ALL_MODELS };
        let counts: BTreeMap<TypicalKey, u64> = [(key(600), share), (key(1000), whole)].into_iter().collect();
        Profile::from_counts(&counts, 1.0)
    }

    /// The tie-break depends on the kind of pod: a node of one free GPU and a node of two, both
    /// free. A task of 600 or 1000 milli, or a CPU-only task, strands the same on either (FGD
    /// scores them equally). A one-device task leaves the tie to FGD's node order (equal scores,
    /// FGD's device rule); a CPU-only task packs where the fewest devices are free (the one-GPU
    /// node). Without a workload profile there is no FGD score to follow: the weighted sum
    /// (bin-pack) decides for every kind.
    #[test]
    fn one_device_pods_leave_ties_to_fgds_order_and_cpu_only_pods_pack() {
        let nodes = [gpu_node("one", 1), gpu_node("two", 2)];
        let mut c = Cluster::new(&nodes, &Limits::default(), false, TieBreak::FixedOrder).expect("cluster");
        let task = |milli: Option<u32>| TaskResources {
            cpu_milli: 1000,
            memory_mib: 1024,
            devices: milli.map(|milli| DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli, memory_mib: 0 }),
        };
        let share = c.shape(&task(Some(600)), &Constraints::default());
        let whole = c.shape(&task(Some(1000)), &Constraints::default());
        let cpu = c.shape(&task(None), &Constraints::default());
        let (share, whole, cpu) = (c.shape_of(share).clone(), c.shape_of(whole).clone(), c.shape_of(cpu).clone());
        let index = |id: &str| c.index_of(&NodeId::new(id)).expect("node");
        let (one, two) = (index("one"), index("two"));
        let eval = |policy: &str, p: &Profile, node: u32, s: &Shape| {
            let policy = build(policy, Norms::of(c.groups()), p, Weights::default(), None).expect("policy");
            let (g, n) = c.view(node);
            policy.eval(g, &n, s).expect("the task fits")
        };

        let p = profile(40, 60);
        assert_eq!(Ties::of(&p), Ties::ByKind);
        for s in [&share, &whole, &cpu] {
            assert_eq!(eval("fgd", &p, one, s).score, eval("fgd", &p, two, s).score, "FGD ranks both nodes first");
        }
        // One-device tasks: FGD's tie (and FGD's device rule for the fraction).
        for s in [&share, &whole] {
            let (a, b) = (eval("suanli", &p, one, s), eval("suanli", &p, two, s));
            assert_eq!(a.score, b.score, "{a:?} {b:?}");
        }
        assert_eq!(eval("suanli", &p, two, &share).pick, Pick::Lowest(1));
        // A CPU-only task: the weighted tie-break, onto the node with the fewest free devices.
        let (a, b) = (eval("suanli", &p, one, &cpu), eval("suanli", &p, two, &cpu));
        assert!(a.score > b.score, "{a:?} {b:?}");
        // No profile: bin-pack for every kind, the fraction on the best-fitting device.
        let none = Profile::default();
        for s in [&share, &whole, &cpu] {
            let (a, b) = (eval("suanli", &none, one, s), eval("suanli", &none, two, s));
            assert!(a.score > b.score, "{a:?} {b:?}");
        }
        assert_eq!(eval("suanli", &none, two, &share).pick, Pick::Exact);
    }
}
