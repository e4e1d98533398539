//! Quota accounting: nominal quotas, borrowing and lending inside a cohort, hierarchical caps,
//! and weighted dominant-resource fair share.
//!
//! Rules (Kueue's model, simplified where noted in docs/architecture.md):
//! - A leaf queue may use up to its `nominal` quota without borrowing. `u64::MAX` in a dimension
//!   means "not limited".
//! - Beyond nominal it borrows from its cohort: at most its `borrowing_limit`, and at most what
//!   the other cohort members have unused and are willing to lend (`lending_limit`), less what
//!   others already borrow.
//! - Each ancestor with a non-zero nominal caps its whole subtree at `nominal +
//!   borrowing_limit`.
//! - Fair share: a queue's dominant share of the cluster divided by its weight.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use suanli_model::{Queue, QueueId, ResVec};
use thiserror::Error;

/// Why a queue's quota does not admit more work now. `dim` names the first dimension over
/// (`cpu_milli`, `memory_mib`, `gpu_milli`, `npu_milli`); `u64::MAX` prints as `unlimited`.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum QuotaError {
    /// The queue does not exist.
    #[error("unknown queue {queue}")]
    UnknownQueue {
        /// The queue asked for.
        queue: QueueId,
    },
    /// Over nominal, and no cohort to borrow from.
    #[error(
        "queue {queue} quota: {dim} would be {} > nominal {} and the queue has no cohort to borrow from",
        fmt_dim(*.would_be),
        fmt_dim(*.nominal)
    )]
    NoCohort {
        /// The queue.
        queue: QueueId,
        /// The dimension over.
        dim: String,
        /// Its usage with the work admitted.
        would_be: u64,
        /// The queue's nominal quota in it.
        nominal: u64,
    },
    /// Borrowing would pass the queue's borrowing limit.
    #[error("queue {queue} quota: {dim} would borrow {would_borrow} > borrowing limit {}", fmt_dim(*.limit))]
    BorrowingLimit {
        /// The queue.
        queue: QueueId,
        /// The dimension over.
        dim: String,
        /// What it would borrow.
        would_borrow: u64,
        /// Its borrowing limit in that dimension.
        limit: u64,
    },
    /// The cohort has less to lend than the queue would borrow.
    #[error("queue {queue} quota: {dim} would borrow {would_borrow} but cohort {cohort} has {lendable} to lend")]
    CohortExhausted {
        /// The queue.
        queue: QueueId,
        /// The dimension over.
        dim: String,
        /// What it would borrow.
        would_borrow: u64,
        /// The cohort.
        cohort: String,
        /// What the cohort can still lend.
        lendable: u64,
    },
    /// An ancestor's cap (nominal + borrowing limit) would be exceeded.
    #[error("parent queue {parent} quota: {dim} would be {would_be} > {}", fmt_dim(*.cap))]
    ParentCap {
        /// The capped ancestor.
        parent: QueueId,
        /// The dimension over.
        dim: String,
        /// The subtree's usage with the work admitted.
        would_be: u64,
        /// The ancestor's cap.
        cap: u64,
    },
}

#[derive(Debug, Clone)]
struct QState {
    q: Queue,
    used: ResVec,
    subtree_used: ResVec,
}

/// What admission decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Part of the job runs on borrowed quota.
    pub borrowed: bool,
}

/// Usage per queue, with admission checks.
#[derive(Debug, Clone, Default)]
pub struct QuotaBook {
    queues: BTreeMap<QueueId, QState>,
}

fn fmt_dim(v: u64) -> String {
    if v == u64::MAX { "unlimited".into() } else { v.to_string() }
}

impl QuotaBook {
    /// A book with no usage.
    pub fn new(queues: &[Queue]) -> Self {
        let queues = queues
            .iter()
            .map(|q| (q.id.clone(), QState { q: q.clone(), used: ResVec::ZERO, subtree_used: ResVec::ZERO }))
            .collect();
        Self { queues }
    }

    /// True when the queue exists.
    pub fn contains(&self, q: &QueueId) -> bool {
        self.queues.contains_key(q)
    }

    /// Current usage of a queue (its own jobs).
    pub fn used(&self, q: &QueueId) -> ResVec {
        self.queues.get(q).map_or(ResVec::ZERO, |s| s.used)
    }

    /// The queue.
    pub fn queue(&self, q: &QueueId) -> Option<&Queue> {
        self.queues.get(q).map(|s| &s.q)
    }

    fn ancestors(&self, q: &QueueId) -> Vec<QueueId> {
        let mut out = Vec::new();
        let mut cur = self.queues.get(q).and_then(|s| s.q.parent.clone());
        while let Some(p) = cur {
            if out.contains(&p) || out.len() > 64 {
                break; // a cycle or absurd depth: stop climbing
            }
            cur = self.queues.get(&p).and_then(|s| s.q.parent.clone());
            out.push(p);
        }
        out
    }

    /// Adds usage to a queue and its ancestors.
    pub fn charge(&mut self, q: &QueueId, amount: ResVec) {
        if let Some(s) = self.queues.get_mut(q) {
            s.used += amount;
            s.subtree_used += amount;
        }
        for a in self.ancestors(q) {
            if let Some(s) = self.queues.get_mut(&a) {
                s.subtree_used += amount;
            }
        }
    }

    /// Removes usage from a queue and its ancestors.
    pub fn refund(&mut self, q: &QueueId, amount: ResVec) {
        if let Some(s) = self.queues.get_mut(q) {
            s.used = s.used.saturating_sub(&amount);
            s.subtree_used = s.subtree_used.saturating_sub(&amount);
        }
        for a in self.ancestors(q) {
            if let Some(s) = self.queues.get_mut(&a) {
                s.subtree_used = s.subtree_used.saturating_sub(&amount);
            }
        }
    }

    /// True when `need` more fits inside the queue's own nominal quota.
    pub fn within_nominal(&self, q: &QueueId, need: ResVec) -> bool {
        self.queues.get(q).is_some_and(|s| (s.used + need).fits_within(&s.q.nominal))
    }

    /// True when `other`'s usage counts against an ancestor of `q` that caps its subtree
    /// (non-zero nominal): reclaiming `other`'s work can lift that cap for `q`.
    pub fn shares_capped_ancestor(&self, q: &QueueId, other: &QueueId) -> bool {
        let theirs = self.ancestors(other);
        self.ancestors(q)
            .iter()
            .filter(|a| self.queues.get(*a).is_some_and(|s| !s.q.nominal.is_zero()))
            .any(|a| a == other || theirs.contains(a))
    }

    /// What the cohort can still lend to `q`.
    fn cohort_pool(&self, q: &QueueId, cohort: &str) -> ResVec {
        let mut lendable = ResVec::ZERO;
        let mut borrowed = ResVec::ZERO;
        for (id, s) in &self.queues {
            if id == q || s.q.cohort.as_deref() != Some(cohort) {
                continue;
            }
            let unused = s.q.nominal.saturating_sub(&s.used);
            let limit = s.q.lending_limit.unwrap_or(ResVec::MAX);
            lendable += unused.min(&limit);
            borrowed += s.used.saturating_sub(&s.q.nominal);
        }
        lendable.saturating_sub(&borrowed)
    }

    /// Checks whether `need` may be admitted to queue `q` now. The error says which quota and
    /// dimension is exceeded.
    pub fn check(&self, q: &QueueId, need: ResVec) -> Result<Admission, QuotaError> {
        let s = self.queues.get(q).ok_or_else(|| QuotaError::UnknownQueue { queue: q.clone() })?;
        let after = s.used + need;
        let mut borrowed = false;
        if !after.fits_within(&s.q.nominal) {
            let over = after.saturating_sub(&s.q.nominal);
            let dim = after.first_exceeding(&s.q.nominal).unwrap_or("?");
            let Some(cohort) = s.q.cohort.as_deref() else {
                return Err(QuotaError::NoCohort {
                    queue: q.clone(),
                    dim: dim.into(),
                    would_be: dim_of(&after, dim),
                    nominal: dim_of(&s.q.nominal, dim),
                });
            };
            if let Some(limit) = &s.q.borrowing_limit
                && let Some(d) = over.first_exceeding(limit)
            {
                return Err(QuotaError::BorrowingLimit {
                    queue: q.clone(),
                    dim: d.into(),
                    would_borrow: dim_of(&over, d),
                    limit: dim_of(limit, d),
                });
            }
            let pool = self.cohort_pool(q, cohort);
            if let Some(d) = over.first_exceeding(&pool) {
                return Err(QuotaError::CohortExhausted {
                    queue: q.clone(),
                    dim: d.into(),
                    would_borrow: dim_of(&over, d),
                    cohort: cohort.into(),
                    lendable: dim_of(&pool, d),
                });
            }
            borrowed = true;
        }
        for a in self.ancestors(q) {
            let Some(p) = self.queues.get(&a) else { continue };
            if p.q.nominal.is_zero() {
                continue;
            }
            let cap = p.q.nominal + p.q.borrowing_limit.unwrap_or(ResVec::ZERO);
            let sub = p.subtree_used + need;
            if let Some(d) = sub.first_exceeding(&cap) {
                return Err(QuotaError::ParentCap {
                    parent: a,
                    dim: d.into(),
                    would_be: dim_of(&sub, d),
                    cap: dim_of(&cap, d),
                });
            }
            if !sub.fits_within(&p.q.nominal) {
                borrowed = true;
            }
        }
        Ok(Admission { borrowed })
    }

    /// Weighted dominant share of a queue against the cluster total (lower runs first).
    pub fn share(&self, q: &QueueId, total: &ResVec) -> f64 {
        self.queues.get(q).map_or(f64::MAX, |s| s.used.dominant_share(total) / f64::from(s.q.weight.max(1)))
    }
}

fn dim_of(v: &ResVec, name: &str) -> u64 {
    ResVec::DIM_NAMES.iter().position(|n| *n == name).map_or(0, |i| v.dims()[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(n: u64) -> ResVec {
        ResVec { gpu_milli: n * 1000, ..ResVec::ZERO }
    }

    fn q(id: &str, nominal_gpus: u64, cohort: Option<&str>) -> Queue {
        let mut q = Queue::new(id, ResVec { gpu_milli: nominal_gpus * 1000, ..ResVec::MAX });
        q.cohort = cohort.map(str::to_owned);
        q
    }

    #[test]
    fn borrowing_is_bounded_by_cohort_and_limit() {
        let mut a = q("a", 4, Some("c"));
        a.borrowing_limit = Some(gpu(2));
        let b = q("b", 4, Some("c"));
        let lone = q("lone", 4, None);
        let mut book = QuotaBook::new(&[a, b, lone]);
        assert_eq!(book.check(&"a".into(), gpu(4)), Ok(Admission { borrowed: false }));
        assert_eq!(book.check(&"a".into(), gpu(6)), Ok(Admission { borrowed: true }));
        let e = book.check(&"a".into(), gpu(7)).expect_err("over borrowing limit");
        assert!(matches!(e, QuotaError::BorrowingLimit { .. }), "{e:?}");
        assert!(e.to_string().contains("borrowing limit"), "{e}");
        let e = book.check(&"lone".into(), gpu(5)).expect_err("no cohort");
        assert!(e.to_string().contains("no cohort"), "{e}");
        book.charge(&"b".into(), gpu(3));
        let e = book.check(&"a".into(), gpu(6)).expect_err("b lends only 1");
        assert!(matches!(e, QuotaError::CohortExhausted { lendable: 1000, .. }), "{e:?}");
        assert!(e.to_string().contains("cohort c has 1000"), "{e}");
        assert!(book.check(&"nope".into(), gpu(1)).is_err());
    }
}
