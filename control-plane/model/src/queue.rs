//! Queues: hierarchical, per team, with a weight and quotas that can be borrowed and lent
//! within a cohort (Kueue's model).

use crate::error::{ValidationError, check_name, check_optional_name, check_range};
use crate::{Limits, QueueId, ResVec};
use serde::{Deserialize, Serialize};

/// A queue. Jobs are submitted to leaf queues. A queue's usage also counts against every
/// ancestor, whose `nominal` (plus its borrowing limit) caps the whole subtree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Queue {
    /// Unique name.
    pub id: QueueId,
    /// Owning team (for reports and cost).
    #[serde(default)]
    pub team: String,
    /// Parent queue, for hierarchies (org -> team -> project).
    #[serde(default)]
    pub parent: Option<QueueId>,
    /// Queues in the same cohort lend unused quota to each other.
    #[serde(default)]
    pub cohort: Option<String>,
    /// Fair-share weight (> 0): a queue of weight 2 is entitled to twice the share of weight 1.
    #[serde(default = "one")]
    pub weight: u32,
    /// Guaranteed quota.
    #[serde(default)]
    pub nominal: ResVec,
    /// How much above `nominal` the queue may borrow from its cohort. `None`: no limit other
    /// than what the cohort has unused.
    #[serde(default)]
    pub borrowing_limit: Option<ResVec>,
    /// How much of its unused nominal quota the queue lends to the cohort. `None`: all of it.
    #[serde(default)]
    pub lending_limit: Option<ResVec>,
}

fn one() -> u32 {
    1
}

impl Queue {
    /// A queue with a nominal quota, weight 1, no cohort.
    pub fn new(id: impl Into<String>, nominal: ResVec) -> Self {
        Self {
            id: QueueId(id.into()),
            team: String::new(),
            parent: None,
            cohort: None,
            weight: 1,
            nominal,
            borrowing_limit: None,
            lending_limit: None,
        }
    }

    /// Checks names and bounds.
    pub fn validate(&self, limits: &Limits) -> Result<(), ValidationError> {
        check_name(|| "queue.id".into(), self.id.as_str(), limits.max_name_len)?;
        check_optional_name(|| "queue.team".into(), &self.team, limits.max_name_len)?;
        if let Some(p) = &self.parent {
            check_name(|| "queue.parent".into(), p.as_str(), limits.max_name_len)?;
        }
        if let Some(c) = &self.cohort {
            check_name(|| "queue.cohort".into(), c, limits.max_name_len)?;
        }
        check_range(|| "queue.weight".into(), self.weight, 1, 1_000_000)?;
        if self.parent.as_ref() == Some(&self.id) {
            return Err(ValidationError::Invalid {
                field: "queue.parent".into(),
                message: "a queue cannot be its own parent".into(),
            });
        }
        Ok(())
    }
}
