//! The one retry backoff of the workspace, through `backon`: exponential (doubling), bounded
//! by a largest delay and, for retries of one request, by a number of retries.
//!
//! Two uses: [`Backoff::retry`] retries one idempotent operation a bounded number of times;
//! [`Delays`] paces a loop that runs as long as its owner (an agent's allocation watch), with
//! [`Delays::reset`] after a success.

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use std::future::Future;
use std::time::Duration;

/// An exponential backoff policy: `min`, `2 min`, `4 min`, ... up to `max`, for at most
/// `max_retries` retries (`None`: as many as the caller asks for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay.
    pub min: Duration,
    /// The largest delay.
    pub max: Duration,
    /// Most retries (`None`: no limit; only for loops that end otherwise).
    pub max_retries: Option<usize>,
}

/// Retries of one submission (same request ids) after a transport failure: 4 retries, 0.5 s
/// doubling to 4 s (7.5 s of waiting in all).
pub const SUBMIT: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(4)).with_max_retries(4);

impl Backoff {
    /// Delays from `min` doubling to `max`, without a retry limit.
    pub const fn new(min: Duration, max: Duration) -> Backoff {
        Backoff { min, max, max_retries: None }
    }

    /// The same delays, for at most `n` retries.
    pub const fn with_max_retries(self, n: usize) -> Backoff {
        Backoff { max_retries: Some(n), ..self }
    }

    fn builder(&self) -> ExponentialBuilder {
        let b = ExponentialBuilder::new().with_factor(2.0).with_min_delay(self.min).with_max_delay(self.max);
        match self.max_retries {
            Some(n) => b.with_max_times(n),
            None => b.without_max_times(),
        }
    }

    /// The delays of this policy, for a loop that keeps them across iterations.
    pub fn delays(&self) -> Delays {
        Delays { policy: *self, it: self.builder().build() }
    }

    /// Runs `op` until it succeeds, fails with an error `when` does not retry, or the retries
    /// run out (then its last error). `notify` hears each retried error and the delay before
    /// the next attempt. `op` must be idempotent (resend the same request id).
    pub async fn retry<T, E, Fut>(
        &self,
        op: impl FnMut() -> Fut,
        when: impl FnMut(&E) -> bool,
        notify: impl FnMut(&E, Duration),
    ) -> Result<T, E>
    where
        Fut: Future<Output = Result<T, E>>,
    {
        let mut notify = notify;
        op.retry(self.builder()).sleep(tokio::time::sleep).when(when).notify(|e, d| notify(e, whole_ms(d))).await
    }
}

/// `d` to the nearest millisecond: backon computes delays in `f32` (200 ms may come out as
/// 200.000003 ms); every delay here is configured in milliseconds.
fn whole_ms(d: Duration) -> Duration {
    Duration::from_millis((d.as_secs_f64() * 1000.0).round() as u64)
}

/// The delays of one [`Backoff`], in order; [`Delays::reset`] starts again from `min`.
pub struct Delays {
    policy: Backoff,
    it: backon::ExponentialBackoff,
}

impl Delays {
    /// The next delay; `None` once `max_retries` delays were handed out.
    pub fn next_delay(&mut self) -> Option<Duration> {
        self.it.next().map(whole_ms)
    }

    /// The next delay, or `max` after the retries ran out (a loop that never gives up).
    pub fn next_or_max(&mut self) -> Duration {
        self.next_delay().unwrap_or(self.policy.max)
    }

    /// Starts again from `min` (after a success).
    pub fn reset(&mut self) {
        self.it = self.policy.builder().build();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_to_their_max_and_reset() {
        let mut d = Backoff::new(Duration::from_millis(100), Duration::from_millis(300)).delays();
        assert_eq!(d.next_or_max(), Duration::from_millis(100));
        assert_eq!(d.next_or_max(), Duration::from_millis(200));
        assert_eq!(d.next_or_max(), Duration::from_millis(300));
        assert_eq!(d.next_or_max(), Duration::from_millis(300));
        d.reset();
        assert_eq!(d.next_or_max(), Duration::from_millis(100));
    }

    #[test]
    fn retries_are_bounded() {
        let mut d = SUBMIT.delays();
        let all: Vec<Duration> = std::iter::from_fn(|| d.next_delay()).collect();
        assert_eq!(all, [500, 1000, 2000, 4000].map(Duration::from_millis));
    }

    #[tokio::test]
    async fn retry_stops_at_the_limit_and_at_a_final_error() {
        let policy = Backoff::new(Duration::from_millis(1), Duration::from_millis(1)).with_max_retries(2);
        let mut calls = 0;
        let r: Result<(), &str> = policy
            .retry(
                || {
                    calls += 1;
                    async { Err("transient") }
                },
                |_| true,
                |_, _| {},
            )
            .await;
        assert_eq!((r, calls), (Err("transient"), 3));
        let mut calls = 0;
        let r: Result<(), &str> = policy
            .retry(
                || {
                    calls += 1;
                    async { Err("final") }
                },
                |e| *e != "final",
                |_, _| {},
            )
            .await;
        assert_eq!((r, calls), (Err("final"), 1));
    }
}
