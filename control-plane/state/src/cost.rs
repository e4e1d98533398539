//! The cost ledger: a price catalog and, per allocation (attempt), what its resources cost and
//! how that cost is classified; capacity not allocated is idle, charged to its pool.
//!
//! Everything is exact integer arithmetic in **base units**: one base unit is
//! 1 / [`BASE_PER_MICRO`] of a micro-unit of currency, chosen so that every rate is an integer
//! number of base units per second (a device share in milli, CPU in milli-cores, memory in MiB):
//!
//! ```text
//!  device:  price_micro/hour x milli   x 1024  base/s     (x milli/1000 of a device)
//!  cpu:     price_micro/hour x cpu_milli x 1024 base/s
//!  memory:  price_micro/hour x mem_mib  x 1000  base/s     (MiB = GiB/1024)
//!  1 micro = 3600 s x 1000 milli x 1024 MiB = 3_686_400_000 base units
//! ```
//!
//! Conservation holds exactly in base units: per pool and over any window, useful +
//! lost_preemption + lost_failure + running + idle = capacity x time x price. See docs/cost.md.

use crate::command::CommandError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use suanli_model::{AllocId, NodeId};

/// Base units per micro-unit of currency (3600 s x 1000 milli x 1024 MiB).
pub const BASE_PER_MICRO: u128 = 3600 * 1000 * 1024;
/// Most device prices in one catalog.
pub const MAX_DEVICE_PRICES: usize = 1024;
/// Highest price of anything, in micro-units per hour (one million currency units an hour).
pub const MAX_PRICE_MICRO: u64 = 1_000_000_000_000;
/// Longest model, pool or region name in a price.
pub const MAX_PRICE_NAME: usize = 128;
/// Longest currency code.
pub const MAX_CURRENCY: usize = 8;
/// Attempts the ledger keeps with their intervals; beyond, the oldest are folded into
/// per-key totals before the ledger's horizon.
pub const MAX_LEDGER_ENTRIES: usize = 20_000;

/// The price of one device model (per whole device and hour), optionally only in one pool or
/// one region. The most specific price that matches a device wins: pool and region, then
/// pool, then region, then the model alone.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DevicePrice {
    /// Device model, as the node reports it (e.g. `A100-80G`).
    pub model: String,
    /// Only in this pool (empty: any).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
    /// Only in this region (empty: any).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub region: String,
    /// Micro-units of currency per device-hour.
    pub micro_per_hour: u64,
}

/// The price catalog.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PriceCatalog {
    /// Currency code, for display only (e.g. `USD`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub currency: String,
    /// Device prices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DevicePrice>,
    /// Micro-units per CPU core-hour.
    #[serde(default)]
    pub cpu_core_hour_micro: u64,
    /// Micro-units per memory GiB-hour.
    #[serde(default)]
    pub memory_gib_hour_micro: u64,
}

impl PriceCatalog {
    /// True when nothing is priced.
    pub fn is_empty(&self) -> bool {
        self == &PriceCatalog::default()
    }

    /// Checks every bound; the error names the field and the limit.
    pub fn validate(&self) -> Result<(), CommandError> {
        let bad = |field: String, message: String| CommandError::Invalid { field, message };
        if self.currency.len() > MAX_CURRENCY || !self.currency.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(bad(
                "prices.currency".into(),
                format!("at most {MAX_CURRENCY} ASCII letters or digits, got {:?}", self.currency),
            ));
        }
        if self.devices.len() > MAX_DEVICE_PRICES {
            return Err(CommandError::TooMany { what: "prices.devices".into(), limit: MAX_DEVICE_PRICES });
        }
        for (field, v) in
            [("prices.cpu_core_hour", self.cpu_core_hour_micro), ("prices.memory_gib_hour", self.memory_gib_hour_micro)]
        {
            if v > MAX_PRICE_MICRO {
                return Err(bad(field.into(), format!("at most {MAX_PRICE_MICRO} micro-units per hour, got {v}")));
            }
        }
        let mut seen = BTreeSet::new();
        for (i, d) in self.devices.iter().enumerate() {
            if d.model.is_empty() {
                return Err(bad(format!("prices.devices[{i}].model"), "must not be empty".into()));
            }
            for (name, v) in [("model", &d.model), ("pool", &d.pool), ("region", &d.region)] {
                if v.len() > MAX_PRICE_NAME {
                    return Err(bad(
                        format!("prices.devices[{i}].{name}"),
                        format!("at most {MAX_PRICE_NAME} bytes, got {}", v.len()),
                    ));
                }
            }
            if d.micro_per_hour > MAX_PRICE_MICRO {
                return Err(bad(
                    format!("prices.devices[{i}].per_hour"),
                    format!("at most {MAX_PRICE_MICRO} micro-units per hour, got {}", d.micro_per_hour),
                ));
            }
            if !seen.insert((&d.model, &d.pool, &d.region)) {
                return Err(bad(
                    format!("prices.devices[{i}]"),
                    format!("model {:?} pool {:?} region {:?} is priced twice", d.model, d.pool, d.region),
                ));
            }
        }
        Ok(())
    }

    /// The price of one device of `model` in `pool` and `region` (micro per hour), or `None`
    /// when no price matches (the device costs 0 and is listed as unpriced).
    pub fn device_price(&self, model: &str, pool: &str, region: &str) -> Option<u64> {
        self.devices
            .iter()
            .filter(|d| d.model == model)
            .filter(|d| d.pool.is_empty() || d.pool == pool)
            .filter(|d| d.region.is_empty() || d.region == region)
            .max_by_key(|d| (u8::from(!d.pool.is_empty()) * 2) + u8::from(!d.region.is_empty()))
            .map(|d| d.micro_per_hour)
    }

    /// Base units per second of a set of resources on `node`.
    pub fn rate(&self, node: &suanli_model::Node, cpu_milli: u64, memory_mib: u64, devices: &[(String, u64)]) -> u128 {
        let mut r = u128::from(self.cpu_core_hour_micro) * u128::from(cpu_milli) * 1024
            + u128::from(self.memory_gib_hour_micro) * u128::from(memory_mib) * 1000;
        for (id, milli) in devices {
            let model = node.devices.iter().find(|d| &d.id == id).map_or("", |d| d.model.as_str());
            let p = self.device_price(model, node.pool.as_str(), &node.region).unwrap_or(0);
            r += u128::from(p) * u128::from(*milli) * 1024;
        }
        r
    }

    /// Base units per second of a whole node (every device, all its CPU and memory).
    pub fn node_rate(&self, node: &suanli_model::Node) -> u128 {
        let devs: Vec<(String, u64)> =
            node.devices.iter().map(|d| (d.id.clone(), u64::from(suanli_model::WHOLE_DEVICE_MILLI))).collect();
        self.rate(node, node.cpu_milli, node.memory_mib, &devs)
    }
}

/// Replace the price catalog (admin). Prices apply to capacity from the command's time on,
/// and to attempts that start from then on: a running attempt keeps the rate it started with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetPrices {
    /// The new catalog.
    pub catalog: PriceCatalog,
    /// Leader's time (seconds).
    #[serde(default)]
    pub now: u64,
}

/// How an attempt's cost is classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Work that counted: a success (or cancellation) whole, else up to the last checkpoint.
    Useful,
    /// Lost to a preemption, migration, drain or stop: from the last checkpoint (or the start).
    LostPreemption,
    /// Lost to a failure (exit, OOM, device error, node lost): from the last checkpoint.
    LostFailure,
    /// Still running: accrued to now, not yet classified.
    Running,
    /// Capacity nobody had allocated, charged to its pool.
    Idle,
}

impl Category {
    /// Every category in report order.
    pub const ALL: [Category; 5] =
        [Category::Useful, Category::LostPreemption, Category::LostFailure, Category::Running, Category::Idle];

    /// snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Category::Useful => "useful",
            Category::LostPreemption => "lost_preemption",
            Category::LostFailure => "lost_failure",
            Category::Running => "running",
            Category::Idle => "idle",
        }
    }

    /// The category of the part of an attempt after its last checkpoint, by how it ended.
    pub fn of_end(class: crate::records::EndClass) -> Category {
        use crate::records::EndClass as E;
        match class {
            E::Succeeded | E::Cancelled => Category::Useful,
            E::Preempted | E::Drained | E::Migrated | E::Stopped => Category::LostPreemption,
            E::Exit | E::Oom | E::StartFailed | E::DeviceError | E::NodeLost => Category::LostFailure,
        }
    }
}

/// Amounts per category, in base units. Idle may be negative when the allocated rate exceeds
/// the capacity rate (an attempt started at a price higher than the one now in force).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Amounts {
    /// Useful.
    #[serde(default)]
    pub useful: i128,
    /// Lost to preemption.
    #[serde(default)]
    pub lost_preemption: i128,
    /// Lost to failure.
    #[serde(default)]
    pub lost_failure: i128,
    /// Running.
    #[serde(default)]
    pub running: i128,
    /// Idle.
    #[serde(default)]
    pub idle: i128,
}

impl Amounts {
    /// Adds `v` to one category.
    pub fn add(&mut self, c: Category, v: i128) {
        match c {
            Category::Useful => self.useful += v,
            Category::LostPreemption => self.lost_preemption += v,
            Category::LostFailure => self.lost_failure += v,
            Category::Running => self.running += v,
            Category::Idle => self.idle += v,
        }
    }

    /// One category.
    pub fn get(&self, c: Category) -> i128 {
        match c {
            Category::Useful => self.useful,
            Category::LostPreemption => self.lost_preemption,
            Category::LostFailure => self.lost_failure,
            Category::Running => self.running,
            Category::Idle => self.idle,
        }
    }

    /// Adds every category of `o`.
    pub fn merge(&mut self, o: &Amounts) {
        for c in Category::ALL {
            self.add(c, o.get(c));
        }
    }

    /// The sum of all categories.
    pub fn total(&self) -> i128 {
        Category::ALL.iter().map(|c| self.get(*c)).sum()
    }

    fn is_zero(&self) -> bool {
        self == &Amounts::default()
    }
}

/// One attempt (allocation) in the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The queue's team (empty: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub team: String,
    /// Queue charged.
    pub queue: String,
    /// Job.
    pub job: u64,
    /// Pool of its node.
    pub pool: String,
    /// Node.
    pub node: String,
    /// Device shares (milli) in total.
    #[serde(default)]
    pub device_milli: u64,
    /// Base units per second (the catalog when it started).
    pub rate: u128,
    /// Start (the replicated clock).
    pub start: u64,
    /// End, once ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<u64>,
    /// Useful up to here; the rest (to the end) is `lost` (set at the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub useful_until: Option<u64>,
    /// The category of the part after `useful_until` (set at the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<Category>,
}

impl Entry {
    /// Its amounts within `[lo, hi)`, `now` being the end of a running attempt.
    pub fn amounts(&self, lo: u64, hi: u64, now: u64) -> Amounts {
        let mut a = Amounts::default();
        let over = |s: u64, e: u64| -> i128 { i128::from(e.min(hi).saturating_sub(s.max(lo))) };
        let r = i128::try_from(self.rate).unwrap_or(i128::MAX);
        match self.end {
            None => a.add(Category::Running, r * over(self.start, now)),
            Some(end) => {
                let u = self.useful_until.unwrap_or(end).clamp(self.start, end);
                a.add(Category::Useful, r * over(self.start, u));
                a.add(self.lost.unwrap_or(Category::Useful), r * over(u, end));
            }
        }
        a
    }
}

/// One pool's capacity and allocated rate over time.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PoolLedger {
    /// Capacity rate of its nodes that are up (base units per second).
    pub capacity_rate: u128,
    /// Sum of the rates of its running attempts.
    pub allocated_rate: u128,
    /// Change points: from this time on, (capacity rate, allocated rate).
    pub points: BTreeMap<u64, (u128, u128)>,
}

impl PoolLedger {
    /// (capacity, allocated) integrated over `[lo, hi)`.
    pub fn integrate(&self, lo: u64, hi: u64) -> (i128, i128) {
        let (mut cap, mut alloc) = (0i128, 0i128);
        let mut it = self.points.iter().peekable();
        while let Some((&t, &(c, a))) = it.next() {
            let next = it.peek().map_or(hi, |(n, _)| **n);
            let d = i128::from(next.min(hi).saturating_sub(t.max(lo)));
            if d > 0 {
                cap += i128::try_from(c).unwrap_or(i128::MAX) * d;
                alloc += i128::try_from(a).unwrap_or(i128::MAX) * d;
            }
        }
        (cap, alloc)
    }

    fn mark(&mut self, now: u64) {
        self.points.insert(now, (self.capacity_rate, self.allocated_rate));
    }
}

/// What the ledger keeps about a node: its pool and capacity rate while up.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeCap {
    /// Its pool.
    pub pool: String,
    /// Its capacity rate counted in the pool (0 while down).
    pub rate: u128,
}

/// Totals from before the horizon, per key.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Folded {
    /// Per team.
    #[serde(default)]
    pub teams: BTreeMap<String, Amounts>,
    /// Per queue.
    #[serde(default)]
    pub queues: BTreeMap<String, Amounts>,
    /// Per pool (idle included).
    #[serde(default)]
    pub pools: BTreeMap<String, Amounts>,
    /// Per pool: capacity x time x price.
    #[serde(default)]
    pub capacity: BTreeMap<String, i128>,
    /// All jobs together (jobs are not kept one by one before the horizon).
    #[serde(default)]
    pub jobs: Amounts,
}

/// The ledger, part of the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Ledger {
    /// The price catalog.
    #[serde(default, skip_serializing_if = "PriceCatalog::is_empty")]
    pub prices: PriceCatalog,
    /// Attempts, by allocation.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub entries: BTreeMap<AllocId, Entry>,
    /// Pools.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pools: BTreeMap<String, PoolLedger>,
    /// Nodes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub nodes: BTreeMap<NodeId, NodeCap>,
    /// Time before which only totals are kept (0: everything is kept).
    #[serde(default)]
    pub horizon: u64,
    /// Totals before the horizon.
    #[serde(default)]
    pub folded: Folded,
    /// Entries kept before folding (0: [`MAX_LEDGER_ENTRIES`]; tests lower it).
    #[serde(skip)]
    pub max_entries: usize,
}

impl Ledger {
    /// True when nothing was ever recorded (left out of snapshots then).
    pub fn is_empty(&self) -> bool {
        self.prices.is_empty()
            && self.entries.is_empty()
            && self.pools.is_empty()
            && self.nodes.is_empty()
            && self.horizon == 0
            && self.folded == Folded::default()
    }

    fn limit(&self) -> usize {
        if self.max_entries == 0 { MAX_LEDGER_ENTRIES } else { self.max_entries }
    }

    /// A node's capacity rate became `rate` (0: down or gone) in `pool` at `now`.
    pub fn set_node(&mut self, id: &NodeId, pool: &str, rate: u128, now: u64) {
        let old = self.nodes.get(id).cloned().unwrap_or_default();
        if old.pool == pool && old.rate == rate && self.nodes.contains_key(id) {
            return;
        }
        if let Some(p) = self.pools.get_mut(&old.pool) {
            p.capacity_rate = p.capacity_rate.saturating_sub(old.rate);
            p.mark(now);
        }
        let p = self.pools.entry(pool.to_owned()).or_default();
        p.capacity_rate += rate;
        p.mark(now);
        self.nodes.insert(id.clone(), NodeCap { pool: pool.to_owned(), rate });
    }

    /// An attempt starts at `now`.
    pub fn open(&mut self, id: AllocId, entry: Entry) {
        let p = self.pools.entry(entry.pool.clone()).or_default();
        p.allocated_rate += entry.rate;
        p.mark(entry.start);
        self.entries.insert(id, entry);
        if self.entries.len() > self.limit() {
            self.compact();
        }
    }

    /// An attempt ends at `now`: useful up to `useful_until`, the rest in `lost`.
    pub fn close(&mut self, id: AllocId, now: u64, useful_until: u64, lost: Category) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if e.end.is_some() {
            return;
        }
        let end = now.max(e.start);
        e.end = Some(end);
        e.useful_until = Some(useful_until.clamp(e.start, end));
        e.lost = Some(lost);
        let (pool, rate) = (e.pool.clone(), e.rate);
        if let Some(p) = self.pools.get_mut(&pool) {
            p.allocated_rate = p.allocated_rate.saturating_sub(rate);
            p.mark(end);
        }
    }

    /// Folds the oldest half of the ended attempts (and the pools' change points before them)
    /// into per-key totals, moving the horizon forward.
    fn compact(&mut self) {
        let open_from = self.entries.values().filter(|e| e.end.is_none()).map(|e| e.start).min().unwrap_or(u64::MAX);
        let mut ends: Vec<u64> = self.entries.values().filter_map(|e| e.end).collect();
        ends.sort_unstable();
        let Some(&cut) = ends.get(ends.len() / 2) else {
            return;
        };
        let h = cut.min(open_from);
        if h <= self.horizon {
            return;
        }
        let lo = self.horizon;
        let mut gone = Vec::new();
        for (id, e) in &self.entries {
            if e.start >= h {
                continue;
            }
            let a = e.amounts(lo, h, h);
            let team = if e.team.is_empty() { "(none)".to_owned() } else { e.team.clone() };
            self.folded.teams.entry(team).or_default().merge(&a);
            self.folded.queues.entry(e.queue.clone()).or_default().merge(&a);
            self.folded.pools.entry(e.pool.clone()).or_default().merge(&a);
            self.folded.jobs.merge(&a);
            if e.end.is_some_and(|end| end <= h) {
                gone.push(*id);
            }
        }
        for id in gone {
            self.entries.remove(&id);
        }
        for (name, p) in &mut self.pools {
            let (cap, alloc) = p.integrate(lo, h);
            self.folded.pools.entry(name.clone()).or_default().add(Category::Idle, cap - alloc);
            *self.folded.capacity.entry(name.clone()).or_default() += cap;
            let at_h = p.points.range(..=h).next_back().map(|(_, v)| *v);
            p.points = p.points.split_off(&h);
            if let Some(v) = at_h {
                p.points.entry(h).or_insert(v);
            }
        }
        self.horizon = h;
    }

    /// A report over `[since, until)` (0: open) at `now`, grouped `by`.
    pub fn report(&self, by: ReportBy, since: u64, until: u64, now: u64) -> Report {
        let lo = since.max(self.horizon);
        let hi = if until == 0 { now } else { until.min(now) };
        let with_folded = since == 0 && self.horizon > 0;
        let mut rows: BTreeMap<String, Amounts> = BTreeMap::new();
        for e in self.entries.values() {
            let a = e.amounts(lo, hi, now);
            if a.is_zero() && (e.end.is_some_and(|end| end < lo) || e.start > hi) {
                continue;
            }
            let key = match by {
                ReportBy::Team if e.team.is_empty() => "(none)".to_owned(),
                ReportBy::Team => e.team.clone(),
                ReportBy::Queue => e.queue.clone(),
                ReportBy::Job => e.job.to_string(),
                ReportBy::Pool => e.pool.clone(),
            };
            rows.entry(key).or_default().merge(&a);
        }
        let mut capacity = 0i128;
        let mut pools = BTreeMap::new();
        for (name, p) in &self.pools {
            let (cap, alloc) = p.integrate(lo, hi.max(lo));
            let (mut cap, mut idle) = (cap, cap - alloc);
            if with_folded {
                cap += self.folded.capacity.get(name).copied().unwrap_or(0);
                idle += self.folded.pools.get(name).map_or(0, |a| a.idle);
            }
            capacity += cap;
            pools.insert(name.clone(), cap);
            let key = if by == ReportBy::Pool { name.clone() } else { "(idle)".to_owned() };
            if idle != 0 || by == ReportBy::Pool {
                rows.entry(key).or_default().add(Category::Idle, idle);
            }
        }
        if with_folded {
            let mut add = |k: &String, a: &Amounts| {
                let mut a = *a;
                a.idle = 0;
                rows.entry(k.clone()).or_default().merge(&a);
            };
            match by {
                ReportBy::Team => self.folded.teams.iter().for_each(|(k, a)| add(k, a)),
                ReportBy::Queue => self.folded.queues.iter().for_each(|(k, a)| add(k, a)),
                ReportBy::Pool => self.folded.pools.iter().for_each(|(k, a)| add(k, a)),
                ReportBy::Job => add(&"(before horizon)".to_owned(), &self.folded.jobs),
            }
        }
        let mut total = Amounts::default();
        rows.values().for_each(|a| total.merge(a));
        Report { rows, total, capacity, pool_capacity: pools, since: lo, until: hi, horizon: self.horizon }
    }

    /// Conservation: per pool, the attempts' amounts since the horizon equal the allocated
    /// rate integrated over time, and the pool's rates agree with its nodes and attempts.
    pub fn check(&self, now: u64) -> Result<(), String> {
        let mut by_pool: BTreeMap<&str, (i128, u128)> = BTreeMap::new();
        for e in self.entries.values() {
            let s = by_pool.entry(e.pool.as_str()).or_default();
            s.0 += e.amounts(self.horizon, now, now).total();
            if e.end.is_none() {
                s.1 += e.rate;
            }
        }
        let mut caps: BTreeMap<&str, u128> = BTreeMap::new();
        for n in self.nodes.values() {
            *caps.entry(n.pool.as_str()).or_default() += n.rate;
        }
        for (name, p) in &self.pools {
            let (sum, open) = by_pool.remove(name.as_str()).unwrap_or_default();
            let (_, alloc) = p.integrate(self.horizon, now);
            if sum != alloc {
                return Err(format!(
                    "pool {name}: attempts add up to {sum} base units, allocated rate x time to {alloc}"
                ));
            }
            if open != p.allocated_rate {
                return Err(format!(
                    "pool {name}: running attempts' rates add up to {open}, allocated rate is {}",
                    p.allocated_rate
                ));
            }
            let cap = caps.get(name.as_str()).copied().unwrap_or(0);
            if cap != p.capacity_rate {
                return Err(format!("pool {name}: nodes' rates add up to {cap}, capacity rate is {}", p.capacity_rate));
            }
        }
        if let Some((name, _)) = by_pool.into_iter().next() {
            return Err(format!("attempts in pool {name}, which the ledger does not know"));
        }
        Ok(())
    }
}

/// How a report groups its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportBy {
    /// By the queue's team.
    Team,
    /// By queue.
    Queue,
    /// By job.
    Job,
    /// By pool (idle in its pool's row).
    Pool,
}

impl std::str::FromStr for ReportBy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "team" => Ok(ReportBy::Team),
            "queue" => Ok(ReportBy::Queue),
            "job" => Ok(ReportBy::Job),
            "pool" => Ok(ReportBy::Pool),
            _ => Err(format!("by: expected team, queue, job or pool, got {s:?}")),
        }
    }
}

/// A cost report. Amounts in base units (see [`BASE_PER_MICRO`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Rows by key. Idle is charged to its pool's row (by pool) or to the `(idle)` row.
    pub rows: BTreeMap<String, Amounts>,
    /// Sum of the rows.
    pub total: Amounts,
    /// Capacity x time x price over the window: equals `total.total()` (conservation).
    pub capacity: i128,
    /// The same per pool.
    pub pool_capacity: BTreeMap<String, i128>,
    /// Window start actually covered (the horizon when asked for earlier).
    pub since: u64,
    /// Window end actually covered (at most now).
    pub until: u64,
    /// Time before which only totals are kept.
    pub horizon: u64,
}

/// Base units as a decimal amount of currency with 6 fractional digits, rounded half away from
/// zero.
pub fn format_amount(base: i128) -> String {
    let per = i128::try_from(BASE_PER_MICRO).unwrap_or(1);
    let micro = (base.abs() + per / 2) / per;
    let sign = if base < 0 && micro > 0 { "-" } else { "" };
    format!("{sign}{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

/// Base units rounded to cents (half away from zero).
pub fn cents(base: i128) -> i128 {
    let per = i128::try_from(BASE_PER_MICRO).unwrap_or(1) * 10_000;
    let c = (base.abs() + per / 2) / per;
    if base < 0 { -c } else { c }
}

/// Parses a decimal price (`2.5`, `0.000125`: at most 6 fractional digits) into micro-units.
pub fn parse_price(field: &str, s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    if int.is_empty() && frac.is_empty()
        || !int.chars().all(|c| c.is_ascii_digit())
        || !frac.chars().all(|c| c.is_ascii_digit())
    {
        return Err(format!("{field}: expected a decimal number like 2.5, got {s:?}"));
    }
    if frac.len() > 6 {
        return Err(format!("{field}: at most 6 fractional digits, got {s:?}"));
    }
    let i: u64 = if int.is_empty() { 0 } else { int.parse().map_err(|_| format!("{field}: {s:?} is too large"))? };
    let f: u64 = format!("{frac:0<6}").parse().map_err(|_| format!("{field}: {s:?} is not a number"))?;
    let v = i
        .checked_mul(1_000_000)
        .and_then(|v| v.checked_add(f))
        .filter(|v| *v <= MAX_PRICE_MICRO)
        .ok_or_else(|| format!("{field}: at most {} per hour, got {s:?}", MAX_PRICE_MICRO / 1_000_000))?;
    Ok(v)
}

/// Micro-units as a decimal string.
pub fn format_micro(v: u64) -> String {
    format!("{}.{:06}", v / 1_000_000, v % 1_000_000)
}

impl crate::State {
    /// The cost ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.cost
    }

    /// Lowers the number of attempts the ledger keeps before folding (tests).
    pub fn set_ledger_limit(&mut self, n: usize) {
        self.cost.max_entries = n;
    }

    /// A cost report at the state's clock.
    pub fn cost_report(&self, by: ReportBy, since: u64, until: u64) -> Report {
        self.cost.report(by, since, until, self.clock)
    }

    pub(crate) fn set_prices(&mut self, c: SetPrices) -> crate::state::Applied {
        c.catalog.validate()?;
        self.tick(c.now);
        self.cost.prices = c.catalog;
        let ids: Vec<NodeId> = self.nodes.keys().cloned().collect();
        for id in ids {
            self.cost_node(&id);
        }
        Ok((crate::Response::Done, crate::state::Effect::Changed))
    }

    /// The ledger conserves (see [`Ledger::check`]) and every node's capacity rate is what
    /// the catalog says.
    pub(crate) fn cost_invariants(&self) -> Result<(), String> {
        if self.cost.is_empty() {
            return Ok(());
        }
        self.cost.check(self.clock)?;
        for (id, n) in &self.cost.nodes {
            let want = match self.nodes.get(id) {
                Some(r) if r.status == crate::NodeStatus::Ready => self.cost.prices.node_rate(&r.node),
                _ => 0,
            };
            if n.rate != want {
                return Err(format!("node {id}: ledger rate {} but the catalog gives {want}", n.rate));
            }
        }
        Ok(())
    }

    /// A node's capacity may have changed (registered, re-registered, down, repriced).
    pub(crate) fn cost_node(&mut self, id: &NodeId) {
        if self.cost.prices.is_empty() && self.cost.nodes.is_empty() {
            return;
        }
        let Some(r) = self.nodes.get(id) else {
            return;
        };
        let rate = if r.status == crate::NodeStatus::Ready { self.cost.prices.node_rate(&r.node) } else { 0 };
        let pool = r.node.pool.to_string();
        self.cost.set_node(id, &pool, rate, self.clock);
    }

    /// An allocation was created.
    pub(crate) fn cost_open(&mut self, id: AllocId) {
        if self.cost.prices.is_empty() {
            return;
        }
        let Some(a) = self.allocs.get(&id) else {
            return;
        };
        let a = &a.alloc;
        let (pool, rate) = match self.nodes.get(&a.node) {
            Some(r) => {
                let devs: Vec<(String, u64)> =
                    a.devices.iter().map(|d| (d.device.clone(), u64::from(d.milli))).collect();
                (r.node.pool.to_string(), self.cost.prices.rate(&r.node, a.cpu_milli, a.memory_mib, &devs))
            }
            None => (String::new(), 0),
        };
        // A federated job is charged to the team the federation charges; others to their
        // queue's team.
        let team = match self.jobs.get(&a.job).and_then(|j| j.federation.as_ref()) {
            Some(b) if !b.team.is_empty() => b.team.clone(),
            _ => self.queues.get(&a.queue).map(|q| q.team.clone()).unwrap_or_default(),
        };
        let entry = Entry {
            team,
            queue: a.queue.to_string(),
            job: a.job.0,
            pool,
            node: a.node.to_string(),
            device_milli: a.devices.iter().map(|d| u64::from(d.milli)).sum(),
            rate,
            start: self.clock,
            end: None,
            useful_until: None,
            lost: None,
        };
        self.cost.open(id, entry);
    }

    /// An allocation ended: useful up to `since_ckpt` (its last checkpoint, or its start),
    /// unless it succeeded (or was cancelled): useful whole.
    pub(crate) fn cost_close(&mut self, id: AllocId, class: crate::EndClass, since_ckpt: u64) {
        let now = self.clock;
        let lost = Category::of_end(class);
        let until = if lost == Category::Useful { now } else { since_ckpt };
        self.cost.close(id, now, until, lost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_parse_and_format() {
        assert_eq!(parse_price("p", "2.5"), Ok(2_500_000));
        assert_eq!(parse_price("p", "0.000125"), Ok(125));
        assert!(parse_price("p", "1.0000001").is_err_and(|e| e.contains("6 fractional")));
        assert!(parse_price("p", "abc").is_err());
        assert_eq!(format_micro(2_500_000), "2.500000");
        assert_eq!(format_amount(i128::try_from(BASE_PER_MICRO).unwrap_or(0) * 1_500_000), "1.500000");
        assert_eq!(cents(i128::try_from(BASE_PER_MICRO).unwrap_or(0) * 15_000), 2);
    }

    #[test]
    fn most_specific_price_wins() {
        let c = PriceCatalog {
            devices: vec![
                DevicePrice { model: "A".into(), micro_per_hour: 1, ..Default::default() },
                DevicePrice { model: "A".into(), region: "r".into(), micro_per_hour: 2, ..Default::default() },
                DevicePrice { model: "A".into(), pool: "p".into(), micro_per_hour: 3, ..Default::default() },
                DevicePrice { model: "A".into(), pool: "p".into(), region: "r".into(), micro_per_hour: 4 },
            ],
            ..Default::default()
        };
        assert_eq!(c.device_price("A", "x", "y"), Some(1));
        assert_eq!(c.device_price("A", "x", "r"), Some(2));
        assert_eq!(c.device_price("A", "p", "y"), Some(3));
        assert_eq!(c.device_price("A", "p", "r"), Some(4));
        assert_eq!(c.device_price("B", "p", "r"), None);
    }
}
