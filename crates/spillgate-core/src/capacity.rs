//! Spare capacity of a deployment, tracked from its own rate-limit headers, and the rule
//! that admits low-priority requests only from what high-priority traffic does not need.
//!
//! Azure (and OpenAI) report after each response how many tokens and requests remain in
//! the current window (`x-ratelimit-remaining-tokens` / `-requests`) and when the window
//! resets. The APIM toolkit this follows stores the last value and compares it with a
//! threshold, which has two flaws its own authors report: a remembered value never
//! recovers when only low-priority traffic flows (no responses, no updates: a 60-second
//! blackout), and requests in flight are not counted. Here the remembered value refills
//! with time towards the limit according to the reset headers, requests in flight hold a
//! reservation, and stale data lets one probe through at a time.

use std::time::Duration;

/// What one response said about its deployment's limits. `None` where a header was
/// missing or meaningless (Azure has been seen sending `-1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitHeaders {
    pub remaining_tokens: Option<u64>,
    pub remaining_requests: Option<u64>,
    pub limit_tokens: Option<u64>,
    pub limit_requests: Option<u64>,
    pub reset_tokens: Option<Duration>,
    pub reset_requests: Option<Duration>,
}

impl RateLimitHeaders {
    pub fn is_empty(&self) -> bool {
        self.remaining_tokens.is_none() && self.remaining_requests.is_none()
    }
}

fn count(v: &str) -> Option<u64> {
    let v = v.trim();
    if v.starts_with('-') {
        return None;
    }
    v.parse::<u64>().ok()
}

/// A reset time: whole or decimal seconds (`43`, Azure), or a Go-style duration (`6m0s`,
/// `1s`, `20ms`, `1h2m3.5s`, OpenAI). `None` for anything else.
pub fn parse_reset(value: &str) -> Option<Duration> {
    let v = value.trim();
    if v.is_empty() || v.starts_with('-') {
        return None;
    }
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs <= 1e7).then(|| Duration::from_secs_f64(secs));
    }
    let mut total = 0.0f64;
    let mut rest = v;
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += n * scale;
        rest = &rest[unit_len..];
    }
    (total.is_finite() && total <= 1e7).then(|| Duration::from_secs_f64(total))
}

/// Reads the rate-limit headers of a response; `header` returns a value by lower-case name.
pub fn parse_headers<'a>(header: impl Fn(&str) -> Option<&'a str>) -> RateLimitHeaders {
    RateLimitHeaders {
        remaining_tokens: header("x-ratelimit-remaining-tokens").and_then(count),
        remaining_requests: header("x-ratelimit-remaining-requests").and_then(count),
        limit_tokens: header("x-ratelimit-limit-tokens").and_then(count),
        limit_requests: header("x-ratelimit-limit-requests").and_then(count),
        reset_tokens: header("x-ratelimit-reset-tokens").and_then(parse_reset),
        reset_requests: header("x-ratelimit-reset-requests").and_then(parse_reset),
    }
}

/// How the model fills gaps the headers leave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityPolicy {
    /// Refill horizon for tokens when no reset header came (Azure's TPM is per minute).
    pub tokens_window: Duration,
    /// Refill horizon for requests when no reset header came (Azure enforces RPM over
    /// short windows, typically 10 s).
    pub requests_window: Duration,
    /// Capacity data older than this lets one low-priority probe through.
    pub stale_after: Duration,
}

impl Default for CapacityPolicy {
    fn default() -> Self {
        CapacityPolicy {
            tokens_window: Duration::from_secs(60),
            requests_window: Duration::from_secs(10),
            stale_after: Duration::from_secs(10),
        }
    }
}

/// One counter (tokens or requests): what remained at the last observation, the largest
/// value known for the window (the limit, or the most ever seen remaining), and when it
/// is full again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    pub remaining: u64,
    pub limit: u64,
    pub observed_ms: u64,
    pub full_at_ms: u64,
}

impl Counter {
    /// Remaining at `now`: linear refill from the observation to the limit at `full_at`.
    pub fn estimate(&self, now_ms: u64) -> u64 {
        if now_ms >= self.full_at_ms || self.limit <= self.remaining {
            return self.limit.max(self.remaining);
        }
        if now_ms <= self.observed_ms {
            return self.remaining;
        }
        let span = (self.full_at_ms - self.observed_ms) as f64;
        let done = (now_ms - self.observed_ms) as f64 / span;
        self.remaining + ((self.limit - self.remaining) as f64 * done) as u64
    }

    /// When the estimate first reaches `needed`; `None` if never (limit too small).
    pub fn time_until(&self, needed: u64, now_ms: u64) -> Option<u64> {
        if self.estimate(now_ms) >= needed {
            return Some(0);
        }
        if needed > self.limit {
            return None;
        }
        let span = (self.full_at_ms - self.observed_ms) as f64;
        let frac = (needed - self.remaining) as f64 / (self.limit - self.remaining).max(1) as f64;
        let at = self.observed_ms + (span * frac).ceil() as u64;
        Some(at.saturating_sub(now_ms))
    }
}

/// The tracked capacity of one deployment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capacity {
    pub tokens: Option<Counter>,
    pub requests: Option<Counter>,
    /// Reservations of requests sent and not yet answered.
    pub inflight_tokens: u64,
    pub inflight_requests: u64,
    /// Last time any observation arrived.
    pub observed_ms: Option<u64>,
}

/// What low-priority admission decided for one deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Enough spare capacity (or nothing known yet): go.
    Admit,
    /// The data is stale: this request goes as the probe that refreshes it.
    Probe,
    /// Not now; the estimate meets the thresholds again in this many milliseconds.
    Refuse(u64),
}

/// Capacity that must stay free for high-priority traffic, per deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve {
    /// Tokens that must remain (APIM toolkit's `low-priority-tpm-threshold`).
    pub tokens: u64,
    /// Requests that must remain in the short window (`low-priority-rp10s-threshold`).
    pub requests: u64,
}

fn merge(
    old: Option<Counter>,
    remaining: Option<u64>,
    limit: Option<u64>,
    reset: Option<Duration>,
    window: Duration,
    now_ms: u64,
) -> Option<Counter> {
    let remaining = remaining?;
    let limit = limit
        .or_else(|| old.map(|o| o.limit))
        .unwrap_or(remaining)
        .max(remaining);
    let full_in = reset.unwrap_or(window);
    Some(Counter {
        remaining,
        limit,
        observed_ms: now_ms,
        full_at_ms: now_ms.saturating_add(crate::outcome::millis(full_in)),
    })
}

impl Capacity {
    /// Takes in what a response said.
    pub fn observe(&mut self, h: &RateLimitHeaders, policy: &CapacityPolicy, now_ms: u64) {
        if h.is_empty() {
            return;
        }
        if let Some(c) = merge(
            self.tokens,
            h.remaining_tokens,
            h.limit_tokens,
            h.reset_tokens,
            policy.tokens_window,
            now_ms,
        ) {
            self.tokens = Some(c);
        }
        if let Some(c) = merge(
            self.requests,
            h.remaining_requests,
            h.limit_requests,
            h.reset_requests,
            policy.requests_window,
            now_ms,
        ) {
            self.requests = Some(c);
        }
        self.observed_ms = Some(now_ms);
    }

    /// Without rate-limit headers, the response's own usage is the only news: take it off
    /// the tracked tokens.
    pub fn consume_tokens(&mut self, used: u64, now_ms: u64) {
        if let Some(c) = &mut self.tokens {
            let current = c.estimate(now_ms);
            c.remaining = current.saturating_sub(used);
            c.observed_ms = now_ms;
        }
    }

    pub fn reserve(&mut self, tokens: u64) {
        self.inflight_tokens = self.inflight_tokens.saturating_add(tokens);
        self.inflight_requests = self.inflight_requests.saturating_add(1);
    }

    pub fn release(&mut self, tokens: u64) {
        self.inflight_tokens = self.inflight_tokens.saturating_sub(tokens);
        self.inflight_requests = self.inflight_requests.saturating_sub(1);
    }

    /// Tokens and requests free now, after in-flight reservations; `None` when unknown.
    pub fn available(&self, now_ms: u64) -> (Option<u64>, Option<u64>) {
        (
            self.tokens
                .map(|c| c.estimate(now_ms).saturating_sub(self.inflight_tokens)),
            self.requests
                .map(|c| c.estimate(now_ms).saturating_sub(self.inflight_requests)),
        )
    }

    /// Whether a request of `tokens` fits now: one request and its tokens free after
    /// in-flight reservations. Unknown capacity fits.
    pub fn covers(&self, tokens: u64, now_ms: u64) -> bool {
        let (t, r) = self.available(now_ms);
        t.is_none_or(|t| t >= tokens) && r.is_none_or(|r| r >= 1)
    }

    /// Whether a low-priority request estimated at `tokens` may go to this deployment:
    /// after it, at least `reserve` must remain for high-priority traffic.
    pub fn admit_low(
        &self,
        tokens: u64,
        reserve: Reserve,
        policy: &CapacityPolicy,
        probe_in_flight: bool,
        now_ms: u64,
    ) -> Admission {
        let Some(observed) = self.observed_ms else {
            // Nothing known yet: the first responses will tell.
            return Admission::Admit;
        };
        let (free_tokens, free_requests) = self.available(now_ms);
        let need_tokens = reserve.tokens.saturating_add(tokens);
        let need_requests = reserve.requests.saturating_add(1);
        let tokens_ok = free_tokens.is_none_or(|f| f >= need_tokens);
        let requests_ok = free_requests.is_none_or(|f| f >= need_requests);
        if tokens_ok && requests_ok {
            return Admission::Admit;
        }
        let stale = now_ms.saturating_sub(observed) >= crate::outcome::millis(policy.stale_after);
        if stale && !probe_in_flight {
            return Admission::Probe;
        }
        // When will it fit? The later of the two counters, in-flight reservations included.
        let wait = |c: Option<Counter>, need: u64, inflight: u64| -> Option<u64> {
            match c {
                None => Some(0),
                Some(c) => c.time_until(need.saturating_add(inflight), now_ms),
            }
        };
        let wt = wait(self.tokens, need_tokens, self.inflight_tokens);
        let wr = wait(self.requests, need_requests, self.inflight_requests);
        let until_probe = u64::try_from(policy.stale_after.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_sub(now_ms.saturating_sub(observed));
        let fit = match (wt, wr) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
        // A probe will be let through once the data is stale, whichever comes first.
        Admission::Refuse(fit.map_or(until_probe, |f| f.min(until_probe.max(1))))
    }

    /// Takes in what another gateway instance observed on the same deployment, when it is
    /// newer than what this one knows: its counters replace ours (the ones it has), and
    /// this instance's own in-flight reservations stay. Returns whether it was taken.
    pub fn merge_remote(&mut self, remote: &crate::shared::SharedCapacity) -> bool {
        if self.observed_ms.is_some_and(|o| o >= remote.observed_ms) {
            return false;
        }
        if remote.tokens.is_some() {
            self.tokens = remote.tokens;
        }
        if remote.requests.is_some() {
            self.requests = remote.requests;
        }
        self.observed_ms = Some(remote.observed_ms);
        true
    }

    /// Headroom for choosing between backends: the share of the token limit free now.
    pub fn headroom(&self, now_ms: u64) -> Option<f64> {
        let c = self.tokens?;
        let free = c.estimate(now_ms).saturating_sub(self.inflight_tokens);
        Some(free as f64 / c.limit.max(1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn newer_remote_observations_replace_counters_and_keep_reservations() {
        let policy = CapacityPolicy::default();
        let mut c = Capacity::default();
        c.observe(
            &RateLimitHeaders {
                remaining_tokens: Some(50_000),
                remaining_requests: Some(90),
                limit_tokens: Some(60_000),
                ..RateLimitHeaders::default()
            },
            &policy,
            1_000,
        );
        c.reserve(500);
        let remote = crate::shared::SharedCapacity {
            observed_ms: 2_000,
            tokens: Some(Counter {
                remaining: 100,
                limit: 60_000,
                observed_ms: 2_000,
                full_at_ms: 62_000,
            }),
            requests: None,
        };
        assert!(c.merge_remote(&remote));
        assert_eq!(c.tokens.map(|t| t.remaining), Some(100));
        assert_eq!(
            c.requests.map(|r| r.remaining),
            Some(90),
            "kept: the remote had none"
        );
        assert_eq!((c.inflight_tokens, c.inflight_requests), (500, 1));
        assert_eq!(c.observed_ms, Some(2_000));
        // An older or equal observation changes nothing.
        let older = crate::shared::SharedCapacity {
            observed_ms: 2_000,
            tokens: None,
            requests: None,
        };
        assert!(!c.merge_remote(&older));
        // Low priority on this instance now sees the other instance's numbers.
        let reserve = Reserve {
            tokens: 1_000,
            requests: 1,
        };
        assert!(matches!(
            c.admit_low(10, reserve, &policy, false, 2_001),
            Admission::Refuse(_)
        ));
    }

    fn headers(pairs: &[(&str, &str)]) -> RateLimitHeaders {
        parse_headers(|n| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| *v))
    }

    #[test]
    fn reset_forms() {
        assert_eq!(parse_reset("43"), Some(Duration::from_secs(43)));
        assert_eq!(parse_reset("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(
            parse_reset("1h2m3.5s"),
            Some(Duration::from_millis(3_723_500))
        );
        assert_eq!(parse_reset("2m"), Some(Duration::from_secs(120)));
        for bad in ["", "-1", "soon", "5x", "m5", "1.2.3s", "s"] {
            assert_eq!(parse_reset(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn headers_parse_and_minus_one_is_unknown() {
        let h = headers(&[
            ("x-ratelimit-remaining-tokens", "29000"),
            ("x-ratelimit-remaining-requests", "-1"),
            ("x-ratelimit-limit-tokens", "30000"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        assert_eq!(h.remaining_tokens, Some(29_000));
        assert_eq!(h.remaining_requests, None);
        assert_eq!(h.limit_tokens, Some(30_000));
        assert_eq!(h.reset_tokens, Some(Duration::from_secs(360)));
        assert!(!h.is_empty());
        assert!(headers(&[]).is_empty());
    }

    fn observed(remaining: u64, limit: u64, reset_s: u64) -> Capacity {
        let mut c = Capacity::default();
        let h = RateLimitHeaders {
            remaining_tokens: Some(remaining),
            remaining_requests: Some(10),
            limit_tokens: Some(limit),
            limit_requests: Some(10),
            reset_tokens: Some(Duration::from_secs(reset_s)),
            reset_requests: Some(Duration::from_secs(1)),
        };
        c.observe(&h, &CapacityPolicy::default(), 1_000);
        c
    }

    #[test]
    fn remaining_refills_towards_the_limit() {
        let c = observed(10_000, 100_000, 60);
        let t = c.tokens.unwrap();
        assert_eq!(t.estimate(1_000), 10_000);
        assert_eq!(t.estimate(31_000), 55_000, "half way through the window");
        assert_eq!(t.estimate(61_000), 100_000);
        assert_eq!(t.estimate(500_000), 100_000);
        assert_eq!(t.time_until(55_000, 1_000), Some(30_000));
        assert_eq!(t.time_until(200_000, 1_000), None);
    }

    #[test]
    fn limit_is_learnt_when_not_sent() {
        let p = CapacityPolicy::default();
        let mut c = Capacity::default();
        let h = |r: u64| RateLimitHeaders {
            remaining_tokens: Some(r),
            ..RateLimitHeaders::default()
        };
        c.observe(&h(90_000), &p, 0);
        c.observe(&h(40_000), &p, 1_000);
        let t = c.tokens.unwrap();
        assert_eq!(t.limit, 90_000, "the most ever seen remaining");
        // No reset header: refills over the default 60 s tokens window.
        assert_eq!(t.estimate(31_000), 65_000);
    }

    #[test]
    fn in_flight_requests_count() {
        let mut c = observed(50_000, 100_000, 60);
        let reserve = Reserve {
            tokens: 30_000,
            requests: 3,
        };
        let p = CapacityPolicy::default();
        assert_eq!(
            c.admit_low(10_000, reserve, &p, false, 1_000),
            Admission::Admit
        );
        c.reserve(15_000);
        assert_eq!(c.available(1_000), (Some(35_000), Some(9)));
        assert!(matches!(
            c.admit_low(10_000, reserve, &p, false, 1_000),
            Admission::Refuse(_)
        ));
        c.release(15_000);
        assert_eq!(
            c.admit_low(10_000, reserve, &p, false, 1_000),
            Admission::Admit
        );
    }

    #[test]
    fn thresholds_and_retry_after() {
        let c = observed(35_000, 100_000, 60);
        let reserve = Reserve {
            tokens: 30_000,
            requests: 3,
        };
        let p = CapacityPolicy {
            stale_after: Duration::from_secs(600),
            ..CapacityPolicy::default()
        };
        // 35k free, 30k reserve: a 5k request fits, a 6k one does not yet.
        assert_eq!(
            c.admit_low(5_000, reserve, &p, false, 1_000),
            Admission::Admit
        );
        match c.admit_low(6_000, reserve, &p, false, 1_000) {
            // 1k more tokens needed; the counter refills 65k over 60 s: ~923 ms.
            Admission::Refuse(ms) => assert!((900..=1_000).contains(&ms), "{ms}"),
            other => panic!("{other:?}"),
        }
        // The request counter gates too.
        let mut c = observed(90_000, 100_000, 60);
        c.requests = Some(Counter {
            remaining: 3,
            limit: 10,
            observed_ms: 1_000,
            full_at_ms: 11_000,
        });
        assert!(matches!(
            c.admit_low(10, reserve, &p, false, 1_000),
            Admission::Refuse(_)
        ));
        assert_eq!(
            c.admit_low(10, reserve, &p, false, 3_000),
            Admission::Admit,
            "refilled to 4 of 10"
        );
    }

    #[test]
    fn probe_rule_when_data_is_stale() {
        let c = observed(0, 100_000, 3_600);
        let reserve = Reserve {
            tokens: 30_000,
            requests: 3,
        };
        let p = CapacityPolicy::default(); // stale after 10 s
        assert!(matches!(
            c.admit_low(100, reserve, &p, false, 5_000),
            Admission::Refuse(_)
        ));
        assert_eq!(
            c.admit_low(100, reserve, &p, false, 11_000),
            Admission::Probe
        );
        assert!(
            matches!(
                c.admit_low(100, reserve, &p, true, 11_000),
                Admission::Refuse(_)
            ),
            "at most one probe in flight"
        );
        // The refusal says when the next probe may go.
        assert_eq!(
            c.admit_low(100, reserve, &p, false, 5_000),
            Admission::Refuse(6_000)
        );
    }

    #[test]
    fn nothing_known_admits() {
        let c = Capacity::default();
        let reserve = Reserve {
            tokens: 30_000,
            requests: 3,
        };
        assert_eq!(
            c.admit_low(1, reserve, &CapacityPolicy::default(), false, 0),
            Admission::Admit
        );
        assert_eq!(c.headroom(0), None);
    }

    #[test]
    fn usage_without_headers_is_taken_off() {
        let mut c = observed(50_000, 100_000, 60);
        c.consume_tokens(5_000, 1_000);
        assert_eq!(c.tokens.unwrap().estimate(1_000), 45_000);
    }

    proptest! {
        /// The estimate never exceeds the limit, never falls below the observation, and
        /// never decreases with time.
        #[test]
        fn estimate_bounds(rem in 0u64..200_000, extra in 0u64..200_000, reset in 0u64..120_000, t1 in 0u64..200_000, dt in 0u64..200_000) {
            let c = Counter { remaining: rem, limit: rem + extra, observed_ms: 1_000, full_at_ms: 1_000 + reset };
            let a = c.estimate(1_000 + t1);
            let b = c.estimate(1_000 + t1 + dt);
            prop_assert!(a >= rem && a <= rem + extra);
            prop_assert!(b >= a);
        }

        #[test]
        fn reset_never_panics(s in "[0-9hmsuµn.]{0,12}") {
            let _ = parse_reset(&s);
        }
    }
}
