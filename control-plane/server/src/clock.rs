//! Cluster time and the leader's clock check (docs/control-plane.md, "Clocks").
//!
//! ```text
//!  sampling (leader, every clock_check_interval_ms): Internal.Clock on every other voter
//!      ─▶ a sample per answer (wall offset at the RTT midpoint, monotonic pair)
//!      ─▶ Verdict: skew = leader − followers' median; drift = leader's rate vs theirs
//!  stamping (leader, every proposal, forwarded ones included):
//!      now = clamp(want, state time, (followers' median when fresh, else time at leadership
//!                                     start + monotonic elapsed) + max_clock_skew_ms)
//!      want = the leader's wall clock, or the followers' median when its clock failed the check
//!  liveness: a node is declared down only after a check that passed once its heartbeat age
//!      reached the TTL (a fast leader clock cannot declare it down early)
//! ```
//!
//! Everything here is leader memory, like heartbeats; nothing is replicated but the stamped
//! `now` of each command, which the state machine applies as `max(state time, now)`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use suanli_proto::v1::ClockRequest;
use suanli_proto::v1::internal_client::InternalClient;
use suanli_state::AgentFence;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::core::Core;

/// Samples older than this are dropped (the window the rate is measured over).
const RATE_WINDOW: Duration = Duration::from_secs(10);
/// The rate is judged only over at least this long.
const MIN_RATE_SPAN_MS: u64 = 1_000;
/// Most samples kept per follower.
const MAX_SAMPLES: usize = 64;
/// Added to the TTL an agent's fence needs (rounding, scheduling).
pub const FENCE_MARGIN_MS: u64 = 100;

/// Wall clock, milliseconds since the Unix epoch.
pub fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

/// The heartbeat TTL a node with this fence needs: `(F + G) * (1 + ρ) / (1 − ρ) + margin`,
/// rounded up (ρ = `drift_permille` / 1000). Without a reported fence, 0 (the TTL alone).
pub fn ttl_for_fence(fence: Option<AgentFence>, ttl_ms: u64, drift_permille: u64) -> u64 {
    let Some(f) = fence else { return 0 };
    let total = u128::from(f.total_ms(ttl_ms));
    let rho = u128::from(drift_permille.min(999));
    let need = (total * (1000 + rho)).div_ceil(1000 - rho);
    u64::try_from(need).unwrap_or(u64::MAX).saturating_add(FENCE_MARGIN_MS)
}

/// One answer of a follower's `Internal.Clock`.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// This server's monotonic time at the midpoint of the call.
    pub at: Instant,
    /// The follower's wall clock minus this server's, at the midpoint (ms).
    pub offset_ms: i64,
    /// The follower's wall clock (ms) as it answered.
    pub remote_wall_ms: u64,
    /// The follower's monotonic clock (ms since it started).
    pub remote_mono_ms: u64,
    /// The call's round trip (ms): the uncertainty of the midpoint is half of it.
    pub rtt_ms: u64,
}

/// What the last clock check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Check {
    /// Not leading: nothing is checked here.
    #[default]
    Follower,
    /// The only voter: no clock to compare with; its own clock is cluster time.
    Solo,
    /// Not known yet (no follower answered lately, or the rate window is still short).
    Unknown,
    /// Within both bounds.
    Ok,
    /// The wall clock differs from the followers' median beyond `max_clock_skew_ms`.
    Skewed,
    /// The clock rate differs from the followers' beyond `max_clock_drift_permille`.
    Drifting,
}

/// The clock check's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// The outcome.
    pub check: Check,
    /// This server's wall clock minus the followers' median (ms; positive: ahead).
    pub skew_ms: Option<i64>,
    /// This server's clock rate against the followers' median, in thousandths (positive: fast).
    pub drift_permille: Option<i64>,
    /// Followers that answered within the last three intervals, of `followers`.
    pub answered: usize,
    /// Voters other than this server.
    pub followers: usize,
}

impl Verdict {
    /// Whether this server may act on time (declare nodes down).
    pub fn passed(&self) -> bool {
        matches!(self.check, Check::Ok | Check::Solo)
    }

    /// Whether its wall clock may be stamped (the rate may still be unknown).
    pub fn wall_trusted(&self) -> bool {
        !matches!(self.check, Check::Skewed | Check::Drifting)
    }
}

fn median(mut v: Vec<i64>) -> Option<i64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2 })
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Judges the samples at `now`: pure, for tests.
pub fn judge(
    samples: &BTreeMap<u64, VecDeque<Sample>>,
    now: Instant,
    followers: usize,
    fresh: Duration,
    max_skew_ms: u64,
    max_drift_permille: u64,
) -> Verdict {
    if followers == 0 {
        return Verdict { check: Check::Solo, ..Verdict::default() };
    }
    let mut offsets = Vec::new();
    let mut drifts = Vec::new();
    for s in samples.values() {
        let Some(last) = s.back() else { continue };
        if now.saturating_duration_since(last.at) > fresh {
            continue;
        }
        offsets.push(last.offset_ms);
        // The rate over the shortest recent span that measures it well enough (a clock that
        // just turned fast shows at once, not diluted by the whole window): at least
        // MIN_RATE_SPAN_MS, and long enough that the midpoints' uncertainty (half a round
        // trip each) is under half the bound.
        let measured = s.iter().rev().skip(1).find_map(|first| {
            let local = ms(last.at.saturating_duration_since(first.at));
            let remote = last.remote_mono_ms.saturating_sub(first.remote_mono_ms);
            let uncertain = (first.rtt_ms + last.rtt_ms) / 2;
            (local >= MIN_RATE_SPAN_MS
                && remote > 0
                && uncertain.saturating_mul(1000) / remote <= max_drift_permille / 2)
                .then(|| i128::from(local) * 1000 / i128::from(remote) - 1000)
        });
        if let Some(d) = measured {
            drifts.push(i64::try_from(d).unwrap_or(i64::MAX));
        }
    }
    let answered = offsets.len();
    // The medians count the leader's own clock (offset 0, rate 0), so with three voters one
    // bad clock, the leader's or a follower's, never moves them.
    let with_self = |mut v: Vec<i64>| {
        (!v.is_empty()).then(|| {
            v.push(0);
            v
        })
    };
    let skew_ms = with_self(offsets).and_then(median).map(|o| -o);
    let drift_permille = with_self(drifts).and_then(median);
    let max_skew = i64::try_from(max_skew_ms).unwrap_or(i64::MAX);
    let max_drift = i64::try_from(max_drift_permille).unwrap_or(i64::MAX);
    let check = match (skew_ms, drift_permille) {
        (None, _) => Check::Unknown,
        (Some(s), _) if s.abs() > max_skew => Check::Skewed,
        (_, Some(d)) if d.abs() > max_drift => Check::Drifting,
        (_, None) => Check::Unknown,
        _ => Check::Ok,
    };
    Verdict { check, skew_ms, drift_permille, answered, followers }
}

/// What a leader's clock may stamp, from what it knows now.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// This server's wall clock (ms).
    pub wall_ms: u64,
    /// The state's time (ms): never stamped below.
    pub floor_ms: u64,
    /// Cluster time at leadership start plus the monotonic time since (ms); None on a
    /// cluster that has no time yet.
    pub elapsed_ms: Option<u64>,
    /// The median of the voters' wall clocks now, this one's included (ms), when fresh (it then
    /// replaces the elapsed bound).
    pub median_ms: Option<u64>,
    /// Whether this server has no other voter (its clock is the only one).
    pub solo: bool,
    /// Whether its wall clock passed the check (else it stamps the followers' median).
    pub trusted: bool,
    /// `max_clock_skew_ms`.
    pub slack_ms: u64,
}

/// The time a leader stamps (ms): `clamp(want, floor, ceiling)`, pure.
pub fn bounded_ms(b: Bounds) -> u64 {
    let want = if b.trusted { b.wall_ms } else { b.median_ms.unwrap_or(b.wall_ms) };
    // The voters' median when fresh (it also lets a cluster restarted after a long stop catch
    // up with real time), else the elapsed time since the leadership began; a leader whose
    // clock failed the check takes the lower of the two (with two voters a bad clock moves
    // the median by half its error).
    let ceiling = match (b.median_ms, b.elapsed_ms) {
        _ if b.solo => None,
        (Some(m), Some(e)) if !b.trusted => Some(m.min(e)),
        (m, e) => m.or(e),
    };
    let ceiling = ceiling.map(|c| c.saturating_add(b.slack_ms));
    let t = match ceiling {
        Some(c) => want.min(c),
        None => want,
    };
    t.max(b.floor_ms)
}

#[derive(Default)]
struct Inner {
    /// The term whose leadership `anchor` belongs to.
    term: Option<u64>,
    /// Cluster time (ms) when this server's leadership began, and when that was.
    anchor: Option<(u64, Instant)>,
    samples: BTreeMap<u64, VecDeque<Sample>>,
    verdict: Verdict,
    /// When a check last passed.
    last_pass: Option<Instant>,
}

/// The leader's clock state (in [`Core`]).
pub struct ClockGuard {
    max_skew_ms: u64,
    max_drift_permille: u64,
    interval: Duration,
    start: Instant,
    inner: Mutex<Inner>,
}

impl ClockGuard {
    /// A guard with the server's bounds.
    pub fn new(cfg: &crate::config::ServerConfig) -> Self {
        Self {
            max_skew_ms: cfg.max_clock_skew_ms,
            max_drift_permille: cfg.max_clock_drift_permille,
            interval: Duration::from_millis(cfg.clock_check_interval_ms),
            start: Instant::now(),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Milliseconds of this process's monotonic clock (what `Internal.Clock` answers).
    pub fn mono_ms(&self) -> u64 {
        ms(self.start.elapsed())
    }

    /// The time (ms) to stamp now: a leader in `term` bounds its clock; a follower answers its
    /// own wall clock (the leader stamps forwarded commands again). Never below `floor_ms`.
    pub fn now_ms(&self, leading_term: Option<u64>, floor_ms: u64, solo: bool) -> u64 {
        self.now_ms_at(wall_ms(), leading_term, floor_ms, solo)
    }

    /// [`ClockGuard::now_ms`] with the wall clock read as `wall` (tests step it).
    fn now_ms_at(&self, wall: u64, leading_term: Option<u64>, floor_ms: u64, solo: bool) -> u64 {
        let Some(term) = leading_term else { return wall.max(floor_ms) };
        let mut g = self.lock();
        let now = Instant::now();
        if g.term != Some(term) {
            g.term = Some(term);
            g.anchor = Some((floor_ms, now));
        }
        let elapsed_ms = g.anchor.and_then(|(t, at)| (t > 0).then(|| t.saturating_add(ms(now - at))));
        let fresh = self.interval * 3;
        // Each follower's clock now: its answer plus this server's monotonic time since (not
        // its wall clock, which may just have stepped).
        let mut clocks: Vec<i64> = g
            .samples
            .values()
            .filter_map(|s| s.back())
            .filter(|s| now.saturating_duration_since(s.at) <= fresh)
            .map(|s| i64::try_from(s.remote_wall_ms.saturating_add(ms(now - s.at))).unwrap_or(i64::MAX))
            .collect();
        let median_ms = if clocks.is_empty() {
            None
        } else {
            clocks.push(i64::try_from(wall).unwrap_or(i64::MAX));
            median(clocks).and_then(|m| u64::try_from(m).ok())
        };
        bounded_ms(Bounds {
            wall_ms: wall,
            floor_ms,
            elapsed_ms,
            median_ms,
            solo,
            trusted: g.verdict.wall_trusted(),
            slack_ms: self.max_skew_ms,
        })
    }

    /// Keeps a follower's answer.
    pub fn record(&self, peer: u64, s: Sample) {
        let mut g = self.lock();
        let q = g.samples.entry(peer).or_default();
        q.push_back(s);
        while q.len() > MAX_SAMPLES || q.front().is_some_and(|f| s.at.saturating_duration_since(f.at) > RATE_WINDOW) {
            q.pop_front();
        }
    }

    /// Not leading: drop every sample and the leadership anchor.
    pub fn forget(&self) {
        let mut g = self.lock();
        *g = Inner::default();
    }

    /// Judges the samples kept for `voters` (the other voters now), logs a change of verdict
    /// (loudly when the clock fails) and returns it.
    pub fn check(&self, voters: &[u64]) -> Verdict {
        let mut g = self.lock();
        g.samples.retain(|id, _| voters.contains(id));
        let now = Instant::now();
        let v = judge(&g.samples, now, voters.len(), self.interval * 3, self.max_skew_ms, self.max_drift_permille);
        if v.passed() {
            g.last_pass = Some(now);
        }
        let before = g.verdict.check;
        g.verdict = v;
        drop(g);
        if before != v.check {
            let line = self.describe(&v);
            match v.check {
                Check::Skewed | Check::Drifting => tracing::error!(
                    clock = %line,
                    "this leader's clock disagrees with its followers': it stamps their median time and declares no node down until it agrees again; fix its clock (NTP) or move leadership (docs/operations.md, \"A server's clock is wrong\")"
                ),
                _ => tracing::info!(clock = %line, "clock check"),
            }
        }
        v
    }

    /// When a check last passed (a node silent since before then may be declared down only
    /// once a check passed after its TTL was reached: `decide::liveness`).
    pub fn last_pass(&self) -> Option<Instant> {
        self.lock().last_pass
    }

    /// Whether the last check passed.
    pub fn passing(&self) -> bool {
        self.lock().verdict.passed()
    }

    /// One line for `cluster version` and `Internal.Inspect`: the verdict, and on a leader
    /// each follower's clock against its own as last sampled (which server is off).
    pub fn line(&self, leading: bool) -> String {
        let (mut v, each) = {
            let g = self.lock();
            let each: Vec<String> = g
                .samples
                .iter()
                .filter_map(|(id, s)| s.back().map(|s| format!("server {id} {:+} ms", s.offset_ms)))
                .collect();
            (g.verdict, each)
        };
        if leading && v.check == Check::Follower {
            v.check = Check::Unknown; // leading, not checked yet
        }
        let mut line = self.describe(&v);
        if !each.is_empty() {
            line += &format!("; followers against this server: {}", each.join(", "));
        }
        line
    }

    fn describe(&self, v: &Verdict) -> String {
        let (s, d) = (self.max_skew_ms, self.max_drift_permille);
        let skew = v.skew_ms.map_or("unknown".into(), |x| format!("{x:+} ms"));
        let drift = v.drift_permille.map_or("unknown".into(), |x| format!("{x:+}‰"));
        let of = format!("{} of {} followers answered", v.answered, v.followers);
        match v.check {
            Check::Follower => "not checked here: the leader checks its clock against this server's".into(),
            Check::Solo => "the only voter: nothing to compare with, its own clock is cluster time".into(),
            Check::Unknown => {
                format!("checking: skew {skew}, rate {drift} ({of}); no node is declared down until it passes")
            }
            Check::Ok => format!("ok: skew {skew} (limit {s} ms), rate {drift} (limit {d}‰), {of}"),
            Check::Skewed => format!(
                "SKEWED: this leader's clock is {skew} off its followers' median (limit {s} ms): it stamps their median time and declares no node down"
            ),
            Check::Drifting => format!(
                "DRIFTING: this leader's clock runs {drift} against its followers' (limit {d}‰): it stamps their median time and declares no node down"
            ),
        }
    }
}

/// The leader's sampling loop: every `clock_check_interval_ms`, `Internal.Clock` on every
/// other voter, then a check.
pub async fn sampling(core: Arc<Core>, mut stop: watch::Receiver<bool>) {
    let interval = Duration::from_millis(core.cfg.clock_check_interval_ms);
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
        if !core.is_leader() {
            core.clock.forget();
            continue;
        }
        let voters: Vec<(u64, String)> = {
            let m = core.raft.metrics();
            let m = m.borrow();
            let mem = m.membership_config.membership();
            mem.voter_ids()
                .filter(|id| *id != core.id)
                .filter_map(|id| mem.get_node(&id).map(|n| (id, n.addr.clone())))
                .collect()
        };
        let mut calls = tokio::task::JoinSet::new();
        for (id, addr) in &voters {
            let Ok(ch) = core.channel(addr) else { continue };
            let group = core.cfg.raft.group.clone();
            let id = *id;
            calls.spawn(async move {
                let mut req = tonic::Request::new(ClockRequest { group });
                req.set_timeout(interval);
                let (t0, w0) = (Instant::now(), wall_ms());
                let r = InternalClient::new(ch).clock(req).await.ok()?.into_inner();
                let rtt = t0.elapsed();
                let mid = t0 + rtt / 2;
                let local_mid = w0.saturating_add(ms(rtt / 2));
                let offset_ms = i64::try_from(i128::from(r.wall_ms) - i128::from(local_mid)).unwrap_or(i64::MAX);
                Some((
                    id,
                    Sample {
                        at: mid,
                        offset_ms,
                        remote_wall_ms: r.wall_ms,
                        remote_mono_ms: r.mono_ms,
                        rtt_ms: ms(rtt),
                    },
                ))
            });
        }
        while let Some(r) = calls.join_next().await {
            if let Ok(Some((id, s))) = r {
                core.clock.record(id, s);
            }
        }
        let ids: Vec<u64> = voters.iter().map(|v| v.0).collect();
        if core.is_leader() {
            core.clock.check(&ids);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000;

    fn b(wall_ms: u64, floor_ms: u64) -> Bounds {
        Bounds { wall_ms, floor_ms, elapsed_ms: None, median_ms: None, solo: false, trusted: true, slack_ms: 500 }
    }

    #[test]
    fn a_leader_an_hour_ahead_stamps_no_more_than_elapsed_time_past_the_last_commit() {
        let real = 1_700_000_000_000;
        // Just elected, no follower sampled yet: bounded by the last commit + elapsed + slack.
        let t = bounded_ms(Bounds { elapsed_ms: Some(real + 2_000), ..b(real + H, real) });
        assert_eq!(t, real + 2_500);
        // Followers sampled: bounded by their median + slack, and it stamps their median.
        let t =
            bounded_ms(Bounds { elapsed_ms: Some(real), median_ms: Some(real), trusted: false, ..b(real + H, real) });
        assert_eq!(t, real);
        // Two voters: the median is half an hour ahead; the elapsed bound holds it.
        let half = real + H / 2;
        let t =
            bounded_ms(Bounds { elapsed_ms: Some(real), median_ms: Some(half), trusted: false, ..b(real + H, real) });
        assert_eq!(t, real + 500);
    }

    #[test]
    fn time_never_goes_below_the_state_time() {
        let t = bounded_ms(Bounds { elapsed_ms: Some(10_000), median_ms: Some(9_000), ..b(5_000, 20_000) });
        assert_eq!(t, 20_000, "a leader behind the state's time stamps the state's time");
        assert_eq!(bounded_ms(Bounds { solo: true, ..b(5_000, 20_000) }), 20_000);
    }

    #[test]
    fn a_restarted_cluster_catches_up_with_its_followers_and_a_new_one_takes_the_wall_clock() {
        let day = 24 * H;
        let old = 1_700_000_000_000;
        // Down a day: the elapsed bound alone would hold time a day behind; the followers agree.
        let t = bounded_ms(Bounds { elapsed_ms: Some(old + 1_000), median_ms: Some(old + day), ..b(old + day, old) });
        assert_eq!(t, old + day);
        // A cluster without time yet, and a single voter: the wall clock.
        assert_eq!(bounded_ms(b(old, 0)), old);
        assert_eq!(bounded_ms(Bounds { solo: true, elapsed_ms: Some(5), ..b(old + H, 0) }), old + H);
    }

    fn samples(
        offsets_and_rates: &[(i64, f64)],
        span_ms: u64,
        rtt_ms: u64,
    ) -> (BTreeMap<u64, VecDeque<Sample>>, Instant) {
        let t0 = Instant::now();
        let now = t0 + Duration::from_millis(span_ms);
        let mut m = BTreeMap::new();
        for (i, (off, rate)) in offsets_and_rates.iter().enumerate() {
            let mut q = VecDeque::new();
            q.push_back(Sample { at: t0, offset_ms: *off, remote_wall_ms: 0, remote_mono_ms: 1_000, rtt_ms });
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
            let remote = 1_000 + (span_ms as f64 / rate) as u64;
            q.push_back(Sample { at: now, offset_ms: *off, remote_wall_ms: 0, remote_mono_ms: remote, rtt_ms });
            m.insert(i as u64 + 2, q);
        }
        (m, now)
    }

    #[test]
    fn the_check_finds_skew_and_drift_against_the_followers_median() {
        let fresh = Duration::from_millis(1_500);
        let (m, now) = samples(&[(-3_600_000, 1.0), (-3_600_010, 1.0)], 2_000, 2);
        let v = judge(&m, now, 2, fresh, 500, 50);
        assert_eq!((v.check, v.skew_ms), (Check::Skewed, Some(3_600_000)));
        assert!(!v.passed() && !v.wall_trusted());
        // A leader running 2x: its monotonic span is twice the followers'.
        let (m, now) = samples(&[(0, 2.0), (0, 2.0)], 2_000, 2);
        let v = judge(&m, now, 2, fresh, 500, 50);
        assert_eq!((v.check, v.drift_permille), (Check::Drifting, Some(1_000)));
        let (m, now) = samples(&[(20, 1.0), (-30, 1.01)], 4_000, 2);
        let v = judge(&m, now, 2, fresh, 500, 50);
        assert_eq!(v.check, Check::Ok, "{v:?}");
        assert!(v.passed());
        // One follower an hour ahead, or running 2x: the median (the leader's clock counted)
        // holds, and the leader is fine.
        let (m, now) = samples(&[(3_600_000, 1.0), (10, 1.0)], 2_000, 2);
        assert_eq!(judge(&m, now, 2, fresh, 500, 50).check, Check::Ok);
        let (m, now) = samples(&[(0, 0.5), (0, 1.0)], 2_000, 2);
        assert_eq!(judge(&m, now, 2, fresh, 500, 50).check, Check::Ok);
        // Too short a window, or too slow a round trip, to judge the rate: not passed yet.
        let (m, now) = samples(&[(0, 1.0)], 500, 2);
        assert_eq!(judge(&m, now, 2, fresh, 500, 50).check, Check::Unknown);
        let (m, now) = samples(&[(0, 1.0)], 2_000, 400);
        let v = judge(&m, now, 2, fresh, 500, 50);
        assert!(v.check == Check::Unknown && v.wall_trusted(), "{v:?}");
        // No follower answered lately; a single voter passes.
        let (m, now) = samples(&[(0, 1.0)], 2_000, 2);
        assert_eq!(judge(&m, now + Duration::from_secs(5), 2, fresh, 500, 50).check, Check::Unknown);
        assert_eq!(judge(&BTreeMap::new(), now, 0, fresh, 500, 50).check, Check::Solo);
    }

    #[test]
    fn the_ttl_covers_the_fence_under_the_drift_bound() {
        let f = AgentFence { after_ms: 1_000, kill_grace_ms: 500 };
        // 1500 * 1.05 / 0.95 = 1657.9 -> 1658, + margin.
        assert_eq!(ttl_for_fence(Some(f), 3_000, 50), 1_658 + FENCE_MARGIN_MS);
        let auto = AgentFence { after_ms: 0, kill_grace_ms: 0 };
        assert!(ttl_for_fence(Some(auto), 10_000, 50) <= 10_000, "the automatic fence fits the TTL");
        assert_eq!(ttl_for_fence(None, 10_000, 50), 0);
    }

    #[test]
    fn a_new_leadership_anchors_at_the_state_time() {
        let g = ClockGuard::new(&crate::config::ServerConfig::default());
        let floor = wall_ms() - 60_000;
        // A leader whose state time is a minute behind its clock, with no sample yet: it may
        // only stamp the state time plus elapsed time plus the slack.
        let t = g.now_ms(Some(3), floor, false);
        assert!(t >= floor && t <= floor + 500 + 1_000, "{t} vs {floor}");
        // A follower stamps its own clock (the leader stamps again).
        assert!(g.now_ms(None, floor, false) >= floor + 59_000);
    }

    #[test]
    fn a_wall_clock_stepped_after_the_last_sample_is_still_bounded_by_the_followers() {
        let g = ClockGuard::new(&crate::config::ServerConfig::default());
        let real = wall_ms();
        for peer in [2, 3] {
            g.record(
                peer,
                Sample { at: Instant::now(), offset_ms: 0, remote_wall_ms: real, remote_mono_ms: 5, rtt_ms: 1 },
            );
        }
        g.check(&[2, 3]);
        // The leader's wall clock steps an hour ahead before the next check: its stamp stays
        // within the slack of the voters' median (the followers' clocks, aged by its
        // monotonic clock).
        let t = g.now_ms_at(real + H, Some(4), real - 1_000, false);
        assert!(t <= real + 500 + 1_000, "stamped {} ms ahead", t - real);
        // And an hour behind: never below the state time.
        assert_eq!(g.now_ms_at(real - H, Some(4), real - 1_000, false), real - 1_000);
    }
}
