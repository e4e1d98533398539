//! Dispatch: which region runs a federated job. A pure function, like the region's engine: a
//! [`DispatchView`] (regions' capacity and health, quotas, pending jobs) and a seed in, decisions
//! with reasons out; no clock, no I/O, no hash-order dependence. The federation leader builds the
//! view from its state ([`view_of`]), calls [`dispatch`], and commits the decisions
//! ([`crate::FedCommand::Dispatch`]), whose apply re-checks each one.
//!
//! A job may go to a region that is healthy, allowed by its `constraints.regions` (empty: any),
//! has enough free devices of an allowed model (`constraints.device_models`, empty: any model of
//! the kind) in total and on one node for its largest task, and where the team's worldwide quota
//! for that model has room. Among those it prefers, in order: more matching data-locality
//! labels, a lower price for the model, more free capacity left after placing (spread), a
//! shorter backlog, then the region's name. Decisions within one pass see the capacity and quota
//! taken by the earlier ones. A job that fits nowhere is held with a reason that names every
//! region: "no region has 64 free H100: us-east 12, eu-west 40 (quota 32 left), ap-south unhealthy".

use crate::model::{CapacityEntry, FedJob, FedJobState, GlobalId, RegionRecord};
use crate::state::FedState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Everything dispatch reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DispatchView {
    /// The time of the view (federation clock, ms).
    pub now_ms: u64,
    /// Every region in the directory, by name.
    pub regions: Vec<RegionView>,
    /// Every global quota with its current use.
    pub quotas: Vec<QuotaView>,
    /// Pending jobs, oldest submission first (at most `max_dispatch_per_pass`).
    pub pending: Vec<PendingJob>,
}

/// A region as dispatch sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RegionView {
    /// Its name.
    pub name: String,
    /// Synced recently enough.
    pub healthy: bool,
    /// Its capacity, per pool and model, minus what was dispatched to it since it reported
    /// (assignments it has not yet placed).
    pub capacity: Vec<CapacityEntry>,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its backlog.
    pub backlog: u32,
}

/// A quota and its use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct QuotaView {
    /// The team.
    pub team: String,
    /// The device model.
    pub device_model: String,
    /// The limit, milli.
    pub limit_milli: u64,
    /// Held federated jobs' demand plus each region's reserve (reported local use or quota
    /// lease, whichever is more), milli.
    pub used_milli: u64,
}

/// A pending job as dispatch sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PendingJob {
    /// Its id.
    pub id: GlobalId,
    /// Its team.
    pub team: String,
    /// `gpu`, `npu`, or empty (no devices).
    pub device_kind: String,
    /// Allowed device models (empty: any of the kind).
    pub device_models: Vec<String>,
    /// Its whole device demand, milli.
    pub demand_milli: u64,
    /// Its largest single task's device demand, milli (must fit on one node).
    pub max_task_milli: u64,
    /// Its whole CPU demand.
    pub cpu_milli: u64,
    /// Its whole memory demand.
    pub memory_mib: u64,
    /// Allowed regions (empty: any).
    pub regions: Vec<String>,
    /// Preferred region labels.
    pub data_labels: BTreeMap<String, String>,
    /// A checkpoint bound to this device model (hardware-bound): only this model will do.
    pub bound_model: Option<String>,
    /// Its priority (higher first within a pass).
    pub priority: i32,
    /// Submitted at (older first among equal priorities).
    pub submitted_at_ms: u64,
}

/// One decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Run `job` in `region`, on `device_model` (None: a job without devices).
    Place {
        /// The job.
        job: GlobalId,
        /// The region.
        region: String,
        /// The model.
        device_model: Option<String>,
        /// Why this region, in words ("most free H100 (40), price 2.10/h, 1 label matched").
        why: String,
    },
    /// Keep `job` pending; `reason` explains itself.
    Hold {
        /// The job.
        job: GlobalId,
        /// Why, naming every region.
        reason: String,
    },
}

/// Quota limit and use, by team then device model (milli): looked up without allocating.
pub(crate) type Quotas = BTreeMap<String, BTreeMap<String, (u64, u64)>>;

fn quota_of<'q>(quotas: &'q Quotas, team: &str, model: &str) -> Option<&'q (u64, u64)> {
    quotas.get(team).and_then(|m| m.get(model))
}

/// Decides where each pending job of `view` goes. Pure and deterministic: the same view and
/// seed give the same decisions. Returns one decision per pending job, in the view's order of
/// consideration: higher priority first, then older, then by id. Ties between regions are broken
/// by name, so the seed changes nothing today; it is kept so a future tie-break may use it
/// without changing the signature.
pub fn dispatch(view: &DispatchView, seed: u64) -> Vec<Decision> {
    let _ = seed;
    let mut regions: Vec<&RegionView> = view.regions.iter().collect();
    regions.sort_by(|a, b| a.name.cmp(&b.name));
    let mut rooms: Vec<Room> = regions.iter().map(|r| Room::of(r)).collect();
    let mut quotas: Quotas = BTreeMap::new();
    for q in &view.quotas {
        quotas.entry(q.team.clone()).or_default().insert(q.device_model.clone(), (q.limit_milli, q.used_milli));
    }
    let mut order: Vec<&PendingJob> = view.pending.iter().collect();
    order.sort_by(|a, b| {
        b.priority
            .cmp(&a.priority)
            .then(a.submitted_at_ms.cmp(&b.submitted_at_ms))
            .then(id_order(&a.id).cmp(&id_order(&b.id)))
    });
    let mut out = Vec::with_capacity(order.len());
    // Rooms and quota room only shrink within a pass, so a job of a shape that found no region
    // fits nowhere later in the pass either: later jobs of that shape skip the search (and
    // reuse the reason while nothing was placed since). A backlog of many like jobs then costs
    // one search per shape, not one per job.
    let mut held: BTreeMap<ShapeKey<'_>, (u64, String)> = BTreeMap::new();
    let mut placed = 0u64;
    for job in order {
        let key = ShapeKey::of(job);
        if let Some((at, reason)) = held.get_mut(&key) {
            if *at != placed {
                *reason = hold_reason(job, &regions, &rooms, &quotas);
                *at = placed;
            }
            out.push(Decision::Hold { job: job.id.clone(), reason: reason.clone() });
            continue;
        }
        let mut best: Option<(Score<'_>, usize)> = None;
        for (i, region) in regions.iter().enumerate() {
            for model in candidate_models(job, &rooms[i]) {
                if misfit(job, region, &rooms[i], model, &quotas).is_some() {
                    continue;
                }
                let score = Score::of(job, region, &rooms[i], model);
                if best.as_ref().is_none_or(|(b, _)| score < *b) {
                    best = Some((score, i));
                }
            }
        }
        let best = best.map(|(score, i)| (score.why(job), i, score.model.map(str::to_owned)));
        match best {
            Some((why, i, model)) => {
                rooms[i].take(job, model.as_deref());
                placed += 1;
                if let Some(m) = &model
                    && let Some(q) = quotas.get_mut(&job.team).and_then(|t| t.get_mut(m))
                {
                    q.1 = q.1.saturating_add(job.demand_milli);
                }
                out.push(Decision::Place {
                    job: job.id.clone(),
                    region: regions[i].name.clone(),
                    device_model: model,
                    why,
                });
            }
            None => {
                let reason = hold_reason(job, &regions, &rooms, &quotas);
                held.insert(key, (placed, reason.clone()));
                out.push(Decision::Hold { job: job.id.clone(), reason });
            }
        }
    }
    out
}

/// What decides whether a job fits a region and the words of its hold reason: two jobs with
/// the same key fit the same regions.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ShapeKey<'a> {
    team: &'a str,
    device_kind: &'a str,
    device_models: &'a [String],
    bound_model: Option<&'a str>,
    regions: &'a [String],
    demand_milli: u64,
    max_task_milli: u64,
    cpu_milli: u64,
    memory_mib: u64,
}

impl<'a> ShapeKey<'a> {
    fn of(job: &'a PendingJob) -> Self {
        Self {
            team: &job.team,
            device_kind: &job.device_kind,
            device_models: &job.device_models,
            bound_model: job.bound_model.as_deref(),
            regions: &job.regions,
            demand_milli: job.demand_milli,
            max_task_milli: job.max_task_milli,
            cpu_milli: job.cpu_milli,
            memory_mib: job.memory_mib,
        }
    }
}

/// The view of `state` at `now_ms` (regions' health from their last sync, quota use, pending
/// jobs in order, capacity less the not-yet-placed assignments).
pub fn view_of(state: &FedState, now_ms: u64) -> DispatchView {
    let cfg = state.config();
    // One pass over the jobs: the assignments not yet placed, by region, and the federated
    // jobs' hold on each quota.
    let mut assigned: BTreeMap<&str, Vec<&FedJob>> = BTreeMap::new();
    for j in state.jobs.values() {
        if j.state == FedJobState::Assigned
            && let Some(r) = j.region.as_deref()
        {
            assigned.entry(r).or_default().push(j);
        }
    }
    let regions = state
        .regions
        .values()
        .map(|r| region_view_of(state, r, assigned.get(r.name.as_str()).map_or(&[][..], Vec::as_slice), now_ms))
        .collect();
    let index = crate::quota::QuotaIndex::of(state);
    let quotas = state
        .quotas
        .iter()
        .map(|q| QuotaView {
            team: q.team.clone(),
            device_model: q.device_model.clone(),
            limit_milli: q.limit_milli,
            used_milli: index.reserved(&q.team, &q.device_model, now_ms),
        })
        .collect();
    let mut pending: Vec<PendingJob> = state
        .jobs
        .values()
        .filter(|j| j.state == FedJobState::Pending && !j.cancel_requested)
        .map(pending_job)
        .collect();
    pending.sort_by(|a, b| {
        b.priority
            .cmp(&a.priority)
            .then(a.submitted_at_ms.cmp(&b.submitted_at_ms))
            .then(id_order(&a.id).cmp(&id_order(&b.id)))
    });
    pending.truncate(cfg.max_dispatch_per_pass);
    DispatchView { now_ms, regions, quotas, pending }
}

/// A synthetic view for the benchmark (`suanli bench federation`, decisions per second):
/// `regions` regions with two device models each, a few teams with quotas, and `jobs` pending
/// jobs of mixed sizes. The same arguments give the same view.
pub fn synthetic_view(regions: usize, jobs: usize, seed: u64) -> DispatchView {
    let mut rng = SplitMix(seed);
    let models = ["H100", "A100", "L40S"];
    let mut view = DispatchView { now_ms: 1_000_000, ..DispatchView::default() };
    for r in 0..regions {
        let mut capacity = Vec::new();
        for (k, model) in models.iter().enumerate() {
            if rng.below(3) == 0 && k > 0 {
                continue;
            }
            let total = 1000 * (8 * (1 + rng.below(64)));
            let free = total * rng.below(101) / 100;
            capacity.push(CapacityEntry {
                pool: format!("pool-{r}-{k}"),
                device_kind: "gpu".into(),
                device_model: (*model).into(),
                total_milli: total,
                free_milli: free,
                max_node_free_milli: free.min(8000),
                free_cpu_milli: 64_000 * (1 + rng.below(32)),
                free_memory_mib: 512 * 1024 * (1 + rng.below(32)),
                price_micros_per_device_hour: 1_000_000 + rng.below(3_000_000),
            });
        }
        let mut labels = BTreeMap::new();
        labels.insert("data".to_owned(), format!("set-{}", rng.below(4)));
        view.regions.push(RegionView {
            name: format!("region-{r:03}"),
            healthy: rng.below(10) != 0,
            capacity,
            labels,
            backlog: rng.below(100) as u32,
        });
    }
    for t in 0..8 {
        for model in models {
            view.quotas.push(QuotaView {
                team: format!("team-{t}"),
                device_model: model.into(),
                limit_milli: 1000 * (64 + rng.below(512)),
                used_milli: 1000 * rng.below(64),
            });
        }
    }
    for j in 0..jobs {
        let count = 1 + rng.below(8);
        let replicas = 1 + rng.below(4);
        let mut data_labels = BTreeMap::new();
        if rng.below(2) == 0 {
            data_labels.insert("data".to_owned(), format!("set-{}", rng.below(4)));
        }
        let cpu_only = rng.below(10) == 0;
        view.pending.push(PendingJob {
            id: format!("g-{}", j + 1),
            team: format!("team-{}", rng.below(8)),
            device_kind: if cpu_only { String::new() } else { "gpu".into() },
            device_models: if cpu_only || rng.below(2) == 0 {
                Vec::new()
            } else {
                vec![models[rng.below(3) as usize].into()]
            },
            demand_milli: if cpu_only { 0 } else { 1000 * count * replicas },
            max_task_milli: if cpu_only { 0 } else { 1000 * count },
            cpu_milli: 4000 * replicas,
            memory_mib: 16 * 1024 * replicas,
            regions: Vec::new(),
            data_labels,
            bound_model: None,
            priority: rng.below(3) as i32,
            submitted_at_ms: j as u64,
        });
    }
    view
}

/// A small deterministic generator (splitmix64) for [`synthetic_view`].
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// Sort key of a global id: its number when it parses (so g-10 follows g-9), then the text.
fn id_order(id: &str) -> (u64, &str) {
    (crate::state::parse_global_id(id).unwrap_or(u64::MAX), id)
}

/// A region's room for one device model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ModelRoom {
    /// `gpu` or `npu`.
    pub kind: String,
    /// Free in total, milli.
    pub free: u64,
    /// Most free on one node, milli.
    pub max_node: u64,
    /// The lowest price among its pools (0: unknown).
    pub price: u64,
}

/// What a region has free, by device model, and CPU and memory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Room {
    /// By device model.
    pub models: BTreeMap<String, ModelRoom>,
    /// Free CPU over its pools.
    pub cpu_milli: u64,
    /// Free memory over its pools.
    pub memory_mib: u64,
}

impl Room {
    /// A region's room from its capacity entries (a pool's CPU and memory counted once even
    /// when it reports several models).
    pub(crate) fn of(region: &RegionView) -> Room {
        let mut room = Room::default();
        let mut pools: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for e in &region.capacity {
            let p = pools.entry(e.pool.as_str()).or_default();
            p.0 = p.0.max(e.free_cpu_milli);
            p.1 = p.1.max(e.free_memory_mib);
            if e.device_model.is_empty() {
                continue;
            }
            let m = room.models.entry(e.device_model.clone()).or_insert_with(|| ModelRoom {
                kind: e.device_kind.clone(),
                free: 0,
                max_node: 0,
                price: 0,
            });
            m.free = m.free.saturating_add(e.free_milli);
            m.max_node = m.max_node.max(e.max_node_free_milli.min(e.free_milli));
            if e.price_micros_per_device_hour > 0 && (m.price == 0 || e.price_micros_per_device_hour < m.price) {
                m.price = e.price_micros_per_device_hour;
            }
        }
        for (cpu, mem) in pools.values() {
            room.cpu_milli = room.cpu_milli.saturating_add(*cpu);
            room.memory_mib = room.memory_mib.saturating_add(*mem);
        }
        room
    }

    /// Takes `job`'s demand (on `model`).
    fn take(&mut self, job: &PendingJob, model: Option<&str>) {
        self.cpu_milli = self.cpu_milli.saturating_sub(job.cpu_milli);
        self.memory_mib = self.memory_mib.saturating_sub(job.memory_mib);
        if let Some(m) = model.and_then(|m| self.models.get_mut(m)) {
            m.free = m.free.saturating_sub(job.demand_milli);
            m.max_node = m.max_node.min(m.free);
        }
    }
}

/// The device models of `room` that `job` may use (`None` alone for a job without devices).
fn candidate_models<'r>(job: &'r PendingJob, room: &'r Room) -> impl Iterator<Item = Option<&'r str>> + 'r {
    let no_devices = job.device_kind.is_empty();
    std::iter::once(None).filter(move |_| no_devices).chain(
        room.models
            .iter()
            .filter(move |(name, m)| !no_devices && m.kind == job.device_kind && model_allowed(job, name))
            .map(|(name, _)| Some(name.as_str())),
    )
}

/// Whether `job` may run on `model` (its constraints and a hardware-bound checkpoint).
pub(crate) fn model_allowed(job: &PendingJob, model: &str) -> bool {
    (job.device_models.is_empty() || job.device_models.iter().any(|m| m == model))
        && job.bound_model.as_deref().is_none_or(|b| b == model)
}

/// Whether `job` may run in `region` at all (health aside).
pub(crate) fn region_allowed(job: &PendingJob, region: &str) -> bool {
    job.regions.is_empty() || job.regions.iter().any(|r| r == region)
}

/// Why a job does not fit a region on a model, with the figures: found without allocating, put
/// in words only when asked ([`check_fit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Misfit {
    Unhealthy,
    NotAllowed,
    CpuMemory,
    NoModel,
    ModelNotAllowed,
    NoSuchModel,
    Free(u64),
    OneNode(u64),
    Quota(u64),
}

/// Why `job` does not fit `region` on `model` (quota limit and use by team and model), or None.
fn misfit(job: &PendingJob, region: &RegionView, room: &Room, model: Option<&str>, quotas: &Quotas) -> Option<Misfit> {
    if !region.healthy {
        return Some(Misfit::Unhealthy);
    }
    if !region_allowed(job, &region.name) {
        return Some(Misfit::NotAllowed);
    }
    if room.cpu_milli < job.cpu_milli || room.memory_mib < job.memory_mib {
        return Some(Misfit::CpuMemory);
    }
    if job.device_kind.is_empty() {
        return None;
    }
    let Some(model) = model else {
        return Some(Misfit::NoModel);
    };
    if !model_allowed(job, model) {
        return Some(Misfit::ModelNotAllowed);
    }
    let Some(m) = room.models.get(model).filter(|m| m.kind == job.device_kind) else {
        return Some(Misfit::NoSuchModel);
    };
    if m.free < job.demand_milli {
        return Some(Misfit::Free(m.free));
    }
    if m.max_node < job.max_task_milli {
        return Some(Misfit::OneNode(m.max_node));
    }
    if let Some((limit, used)) = quota_of(quotas, &job.team, model)
        && used.saturating_add(job.demand_milli) > *limit
    {
        return Some(Misfit::Quota(limit.saturating_sub(*used)));
    }
    None
}

/// Why `job` does not fit `region` on `model` (quota limit and use by team and model), in
/// words, or Ok.
pub(crate) fn check_fit(
    job: &PendingJob,
    region: &RegionView,
    room: &Room,
    model: Option<&str>,
    quotas: &Quotas,
) -> Result<(), String> {
    let Some(why) = misfit(job, region, room, model, quotas) else {
        return Ok(());
    };
    let name = &region.name;
    let model = model.unwrap_or_default();
    Err(match why {
        Misfit::Unhealthy => format!("region {name} is unhealthy"),
        Misfit::NotAllowed => format!("region {name} is not in the job's constraints.regions"),
        Misfit::CpuMemory => format!(
            "region {name} has {}m CPU and {} MiB free, the job needs {}m and {} MiB",
            room.cpu_milli, room.memory_mib, job.cpu_milli, job.memory_mib
        ),
        Misfit::NoModel => format!("the job needs {} devices and no device model was chosen", job.device_kind),
        Misfit::ModelNotAllowed => format!("device model {model} is not allowed for the job"),
        Misfit::NoSuchModel => format!("region {name} has no {} {model}", job.device_kind),
        Misfit::Free(free) => {
            format!("region {name} has {} free {model}, the job needs {}", devices(free), devices(job.demand_milli))
        }
        Misfit::OneNode(max) => format!(
            "region {name} has at most {} free {model} on one node, the largest task needs {}",
            devices(max),
            devices(job.max_task_milli)
        ),
        Misfit::Quota(left) => format!(
            "team {} has {} {model} of quota left, the job needs {}",
            job.team,
            devices(left),
            devices(job.demand_milli)
        ),
    })
}

/// Milli-devices as devices ("12", "0.5").
fn devices(milli: u64) -> String {
    if milli.is_multiple_of(1000) {
        format!("{}", milli / 1000)
    } else {
        let s = format!("{}.{:03}", milli / 1000, milli % 1000);
        s.trim_end_matches('0').to_owned()
    }
}

/// A candidate's rank: smaller is better.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Score<'a> {
    /// Labels not matched (fewer is better).
    unmatched: usize,
    /// Price, unknown last.
    price: u64,
    /// Free left after placing, negated (more is better).
    free_left_neg: std::cmp::Reverse<u64>,
    /// Backlog.
    backlog: u32,
    /// Region name.
    region: &'a str,
    /// Model name (None: a job without devices).
    model: Option<&'a str>,
    /// Labels matched (for the explanation).
    matched: usize,
    /// Free left (for the explanation).
    free_left: u64,
}

impl<'a> Score<'a> {
    fn of(job: &PendingJob, region: &'a RegionView, room: &Room, model: Option<&'a str>) -> Score<'a> {
        let matched = job.data_labels.iter().filter(|(k, v)| region.labels.get(*k) == Some(*v)).count();
        let (price, free_left) = match model.and_then(|m| room.models.get(m)) {
            Some(m) => (if m.price == 0 { u64::MAX } else { m.price }, m.free.saturating_sub(job.demand_milli)),
            None => (u64::MAX, room.cpu_milli.saturating_sub(job.cpu_milli)),
        };
        Score {
            unmatched: job.data_labels.len().saturating_sub(matched),
            price,
            free_left_neg: std::cmp::Reverse(free_left),
            backlog: region.backlog,
            region: &region.name,
            model,
            matched,
            free_left,
        }
    }

    fn why(&self, job: &PendingJob) -> String {
        let price = if self.price == u64::MAX {
            "price unknown".to_owned()
        } else {
            format!("price {}.{:02}/h", self.price / 1_000_000, (self.price % 1_000_000) / 10_000)
        };
        let free = if job.device_kind.is_empty() {
            format!("{}m CPU free after placing", self.free_left)
        } else {
            format!("{} {} free after placing", devices(self.free_left), self.model.unwrap_or_default())
        };
        format!(
            "{free}, {price}, {} of {} labels matched, backlog {}",
            self.matched,
            job.data_labels.len(),
            self.backlog
        )
    }
}

/// The words for what `job` asks ("64 free H100", "8 free gpu (H100|A100)").
fn wanted(job: &PendingJob) -> String {
    if job.device_kind.is_empty() {
        return format!("{}m CPU and {} MiB free", job.cpu_milli, job.memory_mib);
    }
    let what = match (&job.bound_model, job.device_models.as_slice()) {
        (Some(b), _) => b.clone(),
        (None, []) => job.device_kind.clone(),
        (None, ms) => ms.join("|"),
    };
    format!("{} free {what}", devices(job.demand_milli))
}

/// "no region has 64 free H100: us-east 12, eu-west 40 (quota 32 left), ap-south unhealthy".
fn hold_reason(job: &PendingJob, regions: &[&RegionView], rooms: &[Room], quotas: &Quotas) -> String {
    if regions.is_empty() {
        return format!("no region has {}: no region has synced yet", wanted(job));
    }
    let mut parts = Vec::with_capacity(regions.len());
    for (region, room) in regions.iter().zip(rooms) {
        if !region.healthy {
            parts.push(format!("{} unhealthy", region.name));
            continue;
        }
        if !region_allowed(job, &region.name) {
            parts.push(format!("{} not allowed", region.name));
            continue;
        }
        if job.device_kind.is_empty() {
            parts.push(format!("{} {}m/{} MiB", region.name, room.cpu_milli, room.memory_mib));
            continue;
        }
        // The allowed model with the most free speaks for the region.
        let best = room
            .models
            .iter()
            .filter(|(name, m)| m.kind == job.device_kind && model_allowed(job, name))
            .max_by(|a, b| a.1.free.cmp(&b.1.free).then(b.0.cmp(a.0)));
        let Some((name, m)) = best else {
            parts.push(format!("{} 0", region.name));
            continue;
        };
        let mut part = format!("{} {}", region.name, devices(m.free));
        if job.bound_model.is_none() && job.device_models.len() != 1 {
            part.push(' ');
            part.push_str(name);
        }
        let mut notes = Vec::new();
        if let Some((limit, used)) = quota_of(quotas, &job.team, name)
            && used.saturating_add(job.demand_milli) > *limit
        {
            notes.push(format!("quota {} left", devices(limit.saturating_sub(*used))));
        }
        if m.free >= job.demand_milli && m.max_node < job.max_task_milli {
            notes.push(format!("{} on one node", devices(m.max_node)));
        }
        if room.cpu_milli < job.cpu_milli || room.memory_mib < job.memory_mib {
            notes.push(format!("{}m CPU, {} MiB free", room.cpu_milli, room.memory_mib));
        }
        if !notes.is_empty() {
            part.push_str(&format!(" ({})", notes.join(", ")));
        }
        parts.push(part);
    }
    format!("no region has {}: {}", wanted(job), parts.join(", "))
}

/// A region as dispatch sees it at `now_ms`: its capacity less the demand of `assigned`, the
/// jobs assigned to it that it has not yet reported running (found by the caller, in one pass).
pub(crate) fn region_view_of(state: &FedState, region: &RegionRecord, assigned: &[&FedJob], now_ms: u64) -> RegionView {
    let cfg = state.config();
    let mut capacity = region.capacity.clone();
    for job in assigned {
        let mut demand = job.demand_milli;
        let total = job.spec.total();
        let mut cpu = total.cpu_milli;
        let mut mem = total.memory_mib;
        for e in capacity.iter_mut() {
            // CPU and memory are taken from the first pools that have them.
            let c = cpu.min(e.free_cpu_milli);
            e.free_cpu_milli -= c;
            cpu -= c;
            let m = mem.min(e.free_memory_mib);
            e.free_memory_mib -= m;
            mem -= m;
            if demand > 0 && job.device_model.as_deref() == Some(e.device_model.as_str()) {
                let d = demand.min(e.free_milli);
                e.free_milli -= d;
                e.max_node_free_milli = e.max_node_free_milli.min(e.free_milli);
                demand -= d;
            }
        }
    }
    RegionView {
        name: region.name.clone(),
        healthy: region.healthy(now_ms, &cfg),
        capacity,
        labels: region.labels.clone(),
        backlog: region.backlog,
    }
}

/// A job as dispatch sees it.
pub(crate) fn pending_job(job: &FedJob) -> PendingJob {
    let spec = &job.spec;
    let device_kind = spec
        .groups
        .iter()
        .find_map(|g| g.resources.devices.as_ref())
        .map(|d| d.kind.as_str().to_owned())
        .unwrap_or_default();
    let max_task_milli =
        spec.groups.iter().filter_map(|g| g.resources.devices.as_ref()).map(|d| d.total_milli()).max().unwrap_or(0);
    let total = spec.total();
    PendingJob {
        id: job.id.clone(),
        team: job.team.clone(),
        device_kind,
        device_models: spec.constraints.device_models.clone(),
        demand_milli: job.demand_milli,
        max_task_milli,
        cpu_milli: total.cpu_milli,
        memory_mib: total.memory_mib,
        regions: spec.constraints.regions.clone(),
        data_labels: job.data_labels.clone(),
        bound_model: job
            .checkpoint
            .as_ref()
            .filter(|c| c.hardware_bound && !c.device_model.is_empty())
            .map(|c| c.device_model.clone()),
        priority: spec.priority,
        submitted_at_ms: job.submitted_at_ms,
    }
}
