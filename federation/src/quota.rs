//! Global quotas and the leases that share them among regions (docs/federation.md, "Global
//! quotas and quota leases"). Pure and deterministic: time comes as an argument.
//!
//! A team's worldwide quota for a device model (`limit`) is taken by three kinds of holder:
//!
//! ```text
//!   limit ≥ federated jobs held (assigned or running)          ── counted by the federation itself
//!         + Σ over regions of reserved(region)                 ── region-local work
//!   reserved(region) = max(reported local use,
//!                          current lease     while now < until + margin,
//!                          larger prior lease while now < prior_until + margin and not yet replaced)
//! ```
//!
//! Each region's leader syncs every `sync_interval_ms`; the answer carries a new lease for every
//! quota. The lease is the region's max-min fair share of what the federated jobs do not hold,
//! shared among the federation's own pending jobs and the healthy regions' wants (use plus local
//! pending demand). What nobody wants stays unleased, so a federated job submitted later is
//! dispatched at once; the price is that a region's new local job under a global quota waits for
//! its region's next sync to be leased (demand-driven, as in Doorman). A lease is never more than the limit less
//! what the federated jobs and the *other* regions reserve, so the sum above stays within the
//! limit whatever order regions sync in. A region enforces a lease only until `until - drift` by
//! its own clock; the federation counts it until `until + margin` by its own: with clocks within
//! `drift` of each other and `margin ≥ 2 × drift`, the federation never counts a lease free while
//! the region may still use it. A smaller new lease does not free the old one at once: the old one
//! stays counted (`prior`) until the region reports that it enforces the new one, or the old one
//! ends.

use crate::dispatch::{model_allowed, pending_job};
use crate::model::{FedJobState, GrantedLease, QuotaLease, RegionRecord};
use crate::state::FedState;
use std::collections::BTreeMap;

/// The federated jobs' hold on each (team, device model): assigned or running jobs' demand. One
/// pass over the jobs.
pub fn held_by_quota(state: &FedState) -> BTreeMap<(String, String), u64> {
    let mut out: BTreeMap<(String, String), u64> = BTreeMap::new();
    for j in state.jobs.values().filter(|j| j.state.is_held()) {
        if let Some(m) = &j.device_model {
            let slot = out.entry((j.team.clone(), m.clone())).or_default();
            *slot = slot.saturating_add(j.demand_milli);
        }
    }
    out
}

/// True while a lease ending at `until_ms` may still be enforced by its region, as the
/// federation's clock reads `now_ms`.
fn in_force(until_ms: u64, now_ms: u64, margin_ms: u64) -> bool {
    until_ms > 0 && now_ms < until_ms.saturating_add(margin_ms)
}

/// A region's reported local use and want of (team, model) (a scan of its usage: for one
/// lookup; [`QuotaIndex`] answers many).
pub fn region_use(r: &RegionRecord, team: &str, model: &str) -> (u64, u64) {
    r.usage.iter().filter(|u| u.team == team && u.device_model == model).fold((0u64, 0u64), |(used, wanted), u| {
        (used.saturating_add(u.used_milli), wanted.saturating_add(u.wanted_milli.max(u.used_milli)))
    })
}

/// The reserve of a region with `used` reported and `lease` held, at `now_ms`.
fn reserve_of(used: u64, lease: Option<&GrantedLease>, now_ms: u64, margin_ms: u64) -> u64 {
    let mut reserved = used;
    if let Some(l) = lease {
        if in_force(l.until_ms, now_ms, margin_ms) {
            reserved = reserved.max(l.limit_milli);
        }
        if in_force(l.prior_until_ms, now_ms, margin_ms) {
            reserved = reserved.max(l.prior_milli);
        }
    }
    reserved
}

/// What region `r` counts as taking of (team, model) at `now_ms`: the most of its reported use
/// and the leases it may still enforce.
pub fn region_reserved(r: &RegionRecord, team: &str, model: &str, now_ms: u64, margin_ms: u64) -> u64 {
    let (used, _) = region_use(r, team, model);
    let lease = r.quota_leases.iter().find(|l| l.team == team && l.device_model == model);
    reserve_of(used, lease, now_ms, margin_ms)
}

type Key = (String, String);

/// What the quota arithmetic reads, indexed once per command (a sync, a dispatch pass) so that
/// each quota costs a lookup per region, not a scan of every job, usage row and lease: the
/// federated jobs' hold and pending demand per (team, model), and each region's use, want and
/// lease per (team, model). Owned, so a command may change jobs while it holds one.
#[derive(Debug, Clone, Default)]
pub struct QuotaIndex {
    held: BTreeMap<Key, u64>,
    /// (demand, smallest job's demand) of the federation's pending jobs.
    pending: BTreeMap<Key, (u64, u64)>,
    regions: Vec<RegionQuota>,
    margin_ms: u64,
}

#[derive(Debug, Clone)]
struct RegionQuota {
    name: String,
    /// (used, wanted, smallest pending demand).
    usage: BTreeMap<Key, (u64, u64, u64)>,
    leases: BTreeMap<Key, GrantedLease>,
}

impl QuotaIndex {
    /// Indexes `state` (one pass over its jobs, one over each region's usage and leases).
    pub fn of(state: &FedState) -> Self {
        let quotas: std::collections::BTreeSet<(&str, &str)> =
            state.quotas.iter().map(|q| (q.team.as_str(), q.device_model.as_str())).collect();
        let mut pending: BTreeMap<Key, (u64, u64)> = BTreeMap::new();
        for j in state.jobs.values().filter(|j| j.state == FedJobState::Pending && !j.cancel_requested) {
            let p = pending_job(j);
            if p.device_kind.is_empty() {
                continue;
            }
            // The quotas of its team (a range of the sorted set) whose model it may run on.
            for (team, model) in quotas.range((j.team.as_str(), "")..).take_while(|(t, _)| *t == j.team) {
                if model_allowed(&p, model) {
                    let slot = pending.entry(((*team).to_owned(), (*model).to_owned())).or_default();
                    slot.0 = slot.0.saturating_add(j.demand_milli);
                    slot.1 = if slot.1 == 0 { j.demand_milli } else { slot.1.min(j.demand_milli) };
                }
            }
        }
        let regions = state
            .regions
            .values()
            .map(|r| {
                let mut usage: BTreeMap<Key, (u64, u64, u64)> = BTreeMap::new();
                for u in &r.usage {
                    let e = usage.entry((u.team.clone(), u.device_model.clone())).or_default();
                    e.0 = e.0.saturating_add(u.used_milli);
                    e.1 = e.1.saturating_add(u.wanted_milli.max(u.used_milli));
                    if u.min_pending_milli > 0 {
                        e.2 = if e.2 == 0 { u.min_pending_milli } else { e.2.min(u.min_pending_milli) };
                    }
                }
                let leases =
                    r.quota_leases.iter().map(|l| ((l.team.clone(), l.device_model.clone()), l.clone())).collect();
                RegionQuota { name: r.name.clone(), usage, leases }
            })
            .collect();
        Self { held: held_by_quota(state), pending, regions, margin_ms: state.config().redispatch_margin_ms }
    }

    fn key(team: &str, model: &str) -> Key {
        (team.to_owned(), model.to_owned())
    }

    /// The federated jobs' hold on (team, model).
    pub fn held(&self, team: &str, model: &str) -> u64 {
        self.held.get(&Self::key(team, model)).copied().unwrap_or(0)
    }

    /// Counts `milli` more held by federated jobs (a placement applied in the same command).
    pub fn hold(&mut self, team: &str, model: &str, milli: u64) {
        let slot = self.held.entry(Self::key(team, model)).or_default();
        *slot = slot.saturating_add(milli);
    }

    /// The demand of the federation's pending jobs that may run on (team, model), and the
    /// smallest such job's.
    pub fn pending(&self, team: &str, model: &str) -> (u64, u64) {
        self.pending.get(&Self::key(team, model)).copied().unwrap_or((0, 0))
    }

    /// Region `name`'s reported use and want of (team, model).
    pub fn region_use(&self, name: &str, team: &str, model: &str) -> (u64, u64) {
        let (used, wanted, _) = self.region_claim(name, team, model);
        (used, wanted)
    }

    /// Region `name`'s reported use, want and smallest pending demand of (team, model).
    pub fn region_claim(&self, name: &str, team: &str, model: &str) -> (u64, u64, u64) {
        self.regions
            .iter()
            .find(|r| r.name == name)
            .and_then(|r| r.usage.get(&Self::key(team, model)).copied())
            .unwrap_or((0, 0, 0))
    }

    /// Region `name`'s lease of (team, model).
    pub fn lease(&self, name: &str, team: &str, model: &str) -> Option<&GrantedLease> {
        self.regions.iter().find(|r| r.name == name).and_then(|r| r.leases.get(&Self::key(team, model)))
    }

    /// Every region's reserve of (team, model) at `now_ms`, except `except`'s.
    pub fn regions_reserved(&self, team: &str, model: &str, now_ms: u64, except: Option<&str>) -> u64 {
        let k = Self::key(team, model);
        self.regions.iter().filter(|r| Some(r.name.as_str()) != except).fold(0u64, |a, r| {
            let used = r.usage.get(&k).map_or(0, |u| u.0);
            a.saturating_add(reserve_of(used, r.leases.get(&k), now_ms, self.margin_ms))
        })
    }

    /// What is counted as taken of (team, model)'s quota at `now_ms`: the federated jobs held
    /// plus every region's reserve.
    pub fn reserved(&self, team: &str, model: &str, now_ms: u64) -> u64 {
        self.held(team, model).saturating_add(self.regions_reserved(team, model, now_ms, None))
    }
}

/// What the federation counts as taken of (team, model)'s quota at `now_ms`: the federated jobs
/// held (`held`, from [`held_by_quota`]) plus every region's [`region_reserved`].
pub fn reserved(state: &FedState, held: u64, team: &str, model: &str, now_ms: u64) -> u64 {
    let margin = state.config().redispatch_margin_ms;
    state.regions.values().fold(held, |a, r| a.saturating_add(region_reserved(r, team, model, now_ms, margin)))
}

/// Max-min fair shares of `capacity` among `wants` (water-filling): every claimant gets its want
/// or an equal share of what is left, whichever is smaller (claimants taken by want, then by
/// position; the remainder of an integer division goes to the last ones). The shares sum to at
/// most `capacity`.
pub fn fair_shares(capacity: u64, wants: &[u64]) -> Vec<u64> {
    let mut out = vec![0u64; wants.len()];
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut left = capacity;
    let mut open = wants.len() as u64;
    for &i in &order {
        let even = left / open.max(1);
        let share = wants[i].min(even);
        out[i] = share;
        left -= share;
        open -= 1;
    }
    out
}

/// A claim on a quota: what the claimant holds, what it wants in all (held included), and the
/// smallest unit its pending work can start in (0: none pending).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// Held now.
    pub used: u64,
    /// Wanted in all (at least `used`).
    pub want: u64,
    /// The smallest pending job's demand.
    pub unit: u64,
}

/// Shares of `capacity` among `claims` that start work: max-min fair shares of the wants
/// ([`fair_shares`]), except that a share leaving less room above the claimant's use than its
/// smallest pending job is useless (it starts nothing: two regions each leased half a GPU for
/// one-GPU jobs would wait forever). Such shares are cut back to the use, and what that frees
/// goes, one pending job's unit at a time, to the claimants in turn, starting at `start`
/// (rotated by the caller so that no claimant always goes first). The shares sum to at most
/// `capacity`; each is at most its want.
pub fn granular_shares(capacity: u64, claims: &[Claim], start: usize) -> Vec<u64> {
    let wants: Vec<u64> = claims.iter().map(|c| c.want.max(c.used)).collect();
    let mut out = fair_shares(capacity, &wants);
    for (x, c) in out.iter_mut().zip(claims) {
        let room = x.saturating_sub(c.used);
        if c.unit > 0 && room > 0 && room < c.unit {
            *x = c.used;
        }
    }
    let mut left = capacity.saturating_sub(out.iter().sum());
    let n = claims.len();
    let mut progress = true;
    while left > 0 && progress && n > 0 {
        progress = false;
        for k in 0..n {
            let i = (start + k) % n;
            let c = &claims[i];
            if c.unit == 0 || c.unit > left {
                continue;
            }
            // Room above the use in whole units only: what the claimant holds beyond its use
            // that is not a whole unit is useless and is counted as part of the next unit.
            let room = out[i].saturating_sub(c.used);
            let next = c.used.saturating_add((room / c.unit + 1).saturating_mul(c.unit));
            let add = next.saturating_sub(out[i]);
            if next <= wants[i] && add <= left {
                out[i] = next;
                left -= add;
                progress = true;
            }
        }
    }
    out
}

/// The new leases for `region`, which has just synced at `now_ms` (its record already holds the
/// sync's use and wants; `acked` are the leases it reported enforcing). One entry per global
/// quota, in the quotas' order.
pub(crate) fn grants(state: &FedState, region: &str, acked: &[QuotaLease], now_ms: u64) -> Vec<GrantedLease> {
    let cfg = state.config();
    let margin = cfg.redispatch_margin_ms;
    let Some(me) = state.regions.get(region) else {
        return Vec::new();
    };
    let index = QuotaIndex::of(state);
    // The regions that share: the healthy ones, and this one (which has just synced).
    let sharing: Vec<&RegionRecord> =
        state.regions.values().filter(|r| r.name == region || r.healthy(now_ms, &cfg)).collect();
    let mine = sharing.iter().position(|r| r.name == region).unwrap_or(0);
    let my_leases: BTreeMap<(&str, &str), &GrantedLease> =
        me.quota_leases.iter().map(|l| ((l.team.as_str(), l.device_model.as_str()), l)).collect();
    let acked: BTreeMap<(&str, &str), &QuotaLease> =
        acked.iter().map(|l| ((l.team.as_str(), l.device_model.as_str()), l)).collect();
    let mut out = Vec::with_capacity(state.quotas.len());
    for q in &state.quotas {
        let (team, model) = (q.team.as_str(), q.device_model.as_str());
        let free = q.limit_milli.saturating_sub(index.held(team, model));
        let mut claims = Vec::with_capacity(sharing.len() + 1);
        let (fed_want, fed_unit) = index.pending(team, model);
        claims.push(Claim { used: 0, want: fed_want, unit: fed_unit });
        for r in &sharing {
            let (used, want, unit) = index.region_claim(&r.name, team, model);
            claims.push(Claim { used, want, unit });
        }
        // Who goes first when units compete rotates once per lease term.
        let start = usize::try_from((now_ms / cfg.lease_ms.max(1)) % claims.len() as u64).unwrap_or(0);
        let target = granular_shares(free, &claims, start)[mine + 1];
        let others = index.regions_reserved(team, model, now_ms, Some(region));
        let headroom = free.saturating_sub(others);
        let limit_milli = target.min(headroom);
        let until_ms = now_ms.saturating_add(cfg.lease_ms);
        // The lease this region held before this sync, and whether it reported enforcing it.
        let old = my_leases.get(&(team, model));
        let mut prior = (0u64, 0u64);
        if let Some(o) = old {
            let enforcing_current =
                acked.get(&(team, model)).is_some_and(|a| a.until_ms == o.until_ms && a.limit_milli == o.limit_milli);
            if !enforcing_current && in_force(o.prior_until_ms, now_ms, margin) {
                prior = (o.prior_milli, o.prior_until_ms);
            }
            // Until the region reports the new lease, it may still enforce the one it holds.
            if in_force(o.until_ms, now_ms, margin) && o.limit_milli > limit_milli {
                prior = (prior.0.max(o.limit_milli), prior.1.max(o.until_ms));
            }
        }
        if prior.0 <= limit_milli {
            prior = (0, 0);
        }
        out.push(GrantedLease {
            team: q.team.clone(),
            device_model: q.device_model.clone(),
            limit_milli,
            until_ms,
            prior_milli: prior.0,
            prior_until_ms: prior.1,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fair_shares_fill_the_small_wants_first() {
        assert_eq!(fair_shares(10, &[2, 8, 8]), vec![2, 4, 4]);
        assert_eq!(fair_shares(10, &[0, 0, 0]), vec![0, 0, 0]);
        assert_eq!(fair_shares(10, &[20, 1]), vec![9, 1]);
        assert_eq!(fair_shares(7, &[5, 5]), vec![3, 4]);
        assert_eq!(fair_shares(0, &[5, 5]), vec![0, 0]);
        assert_eq!(fair_shares(5, &[]), Vec::<u64>::new());
    }

    #[test]
    fn granular_shares_start_work_instead_of_splitting_a_unit() {
        let one_gpu = |used| Claim { used, want: used + 1000, unit: 1000 };
        // Two regions each want one more GPU of a 1-GPU quota: one gets it, by turn.
        assert_eq!(granular_shares(1000, &[one_gpu(0), one_gpu(0)], 0), vec![1000, 0]);
        assert_eq!(granular_shares(1000, &[one_gpu(0), one_gpu(0)], 1), vec![0, 1000]);
        // Enough for both: both.
        assert_eq!(granular_shares(2000, &[one_gpu(0), one_gpu(0)], 0), vec![1000, 1000]);
        // Fractional units share as before.
        let half = Claim { used: 0, want: 1000, unit: 500 };
        assert_eq!(granular_shares(1000, &[half, half], 0), vec![500, 500]);
        // A claimant without pending work keeps its fair share of its use.
        let idle = Claim { used: 300, want: 300, unit: 0 };
        assert_eq!(granular_shares(1000, &[idle, one_gpu(0)], 0), vec![300, 0]);
        assert_eq!(granular_shares(1300, &[idle, one_gpu(0)], 0), vec![300, 1000]);
    }

    proptest! {
        #[test]
        fn granular_shares_stay_within_capacity_and_wants_and_start_work(
            cap in 0u64..20_000,
            claims in prop::collection::vec((0u64..5_000, 0u64..10_000, prop::sample::select(vec![0u64, 250, 500, 1000, 2000])), 0..6),
            start in 0usize..6,
        ) {
            let claims: Vec<Claim> = claims.into_iter().map(|(used, more, unit)| Claim { used, want: used + more, unit }).collect();
            let s = granular_shares(cap, &claims, start);
            prop_assert!(s.iter().sum::<u64>() <= cap);
            for (x, c) in s.iter().zip(&claims) {
                prop_assert!(*x <= c.want.max(c.used));
            }
            // Liveness: when what is left unshared fits some claimant's next unit within its
            // want, some claimant can start a unit (none is left with only a useless fraction
            // while a whole unit is free).
            let left = cap.saturating_sub(s.iter().sum());
            for (x, c) in s.iter().zip(&claims) {
                // (A share below the use must first make up the difference.)
                if c.unit > 0 && c.used + c.unit <= c.want && x.saturating_sub(c.used) < c.unit {
                    let needs = c.unit + c.used.saturating_sub(*x);
                    prop_assert!(left < needs, "{:?} got {} while {} is left", c, x, left);
                }
            }
        }

        #[test]
        fn fair_shares_are_within_capacity_and_wants(cap in 0u64..1_000_000, wants in prop::collection::vec(0u64..500_000, 0..12)) {
            let s = fair_shares(cap, &wants);
            prop_assert!(s.iter().sum::<u64>() <= cap);
            for (x, w) in s.iter().zip(&wants) {
                prop_assert!(x <= w);
            }
            // Pareto: capacity is left over only when every want is met.
            if s.iter().sum::<u64>() < cap {
                prop_assert_eq!(&s, &wants);
            }
            // Max-min: a claimant short of its want gets at least as much as any other.
            for (i, (x, w)) in s.iter().zip(&wants).enumerate() {
                if x < w {
                    for (j, y) in s.iter().enumerate() {
                        prop_assert!(*x + 1 >= *y, "claimant {} got {} < want {} while {} got {}", i, x, w, j, y);
                    }
                }
            }
        }
    }
}
