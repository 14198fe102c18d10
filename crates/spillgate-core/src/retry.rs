//! Retry policies with Azure API Management's semantics: which outcomes are retried, on
//! the same backend or on the next one, how long to wait between tries of the same
//! backend, and a budget that bounds the extra upstream attempts.
//!
//! APIM users write `<retry condition="..." count interval max-interval delta
//! first-fast-retry>`. Its documentation gives three waiting rules: a fixed `interval`;
//! linear `interval + (count - 1) * delta`; and exponential
//! `interval + (2^count - 1) * random(delta * 0.8, delta * 1.2)` capped at `max-interval`,
//! with the example "10 s, 20 s, 40 s, 80 s, then 100 s" for interval = delta = 10 s and
//! max-interval = 100 s. Other copies print `2^(count - 1)`, and taking `count` as the
//! 1-based retry number fits the example with neither form. We use the exponential form
//! `interval + (2^n - 1) * random(0.8 delta, 1.2 delta)` where `n` is the number of
//! retries already made on this backend (0 for the first retry): it reproduces the
//! documented example exactly (10, 20, 40, 80, 100) and reduces to the fixed interval
//! for the first retry. The linear form is `interval + n * delta` with the same `n`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// What one upstream attempt produced, as retry conditions see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptResult {
    /// The backend answered with this status.
    Status(u16),
    /// No answer: connect failure, reset, or no response headers in time.
    ConnectError,
}

/// One element of a retry condition, as written in config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    /// `429`
    Status(u16),
    /// `5xx`, `4xx`, ...
    Class(u8),
    /// `>=300`
    AtLeast(u16),
    /// `500-504`
    Range(u16, u16),
    /// `connect-error`: no response at all.
    ConnectError,
}

impl FromStr for Condition {
    type Err = String;

    fn from_str(s: &str) -> Result<Condition, String> {
        let t = s.trim();
        let status = |v: &str| -> Result<u16, String> {
            match v.trim().parse::<u16>() {
                Ok(n) if (100..=599).contains(&n) => Ok(n),
                _ => Err(format!("{v:?} is not an HTTP status (100-599)")),
            }
        };
        if t == "connect-error" {
            return Ok(Condition::ConnectError);
        }
        if let Some(rest) = t.strip_prefix(">=") {
            return status(rest).map(Condition::AtLeast);
        }
        if t.len() == 3 && t.ends_with("xx") {
            let d = t.as_bytes()[0];
            if (b'1'..=b'5').contains(&d) {
                return Ok(Condition::Class(d - b'0'));
            }
        }
        if let Some((lo, hi)) = t.split_once('-') {
            let (lo, hi) = (status(lo)?, status(hi)?);
            if lo > hi {
                return Err(format!("range {t:?} is empty"));
            }
            return Ok(Condition::Range(lo, hi));
        }
        status(t).map(Condition::Status).map_err(|_| {
            format!("{t:?} is not a condition: use a status (429), a class (5xx), a bound (>=300), a range (500-504) or connect-error")
        })
    }
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Condition::Status(s) => write!(f, "{s}"),
            Condition::Class(c) => write!(f, "{c}xx"),
            Condition::AtLeast(s) => write!(f, ">={s}"),
            Condition::Range(a, b) => write!(f, "{a}-{b}"),
            Condition::ConnectError => f.write_str("connect-error"),
        }
    }
}

impl Condition {
    pub fn matches(self, r: AttemptResult) -> bool {
        match (self, r) {
            (Condition::ConnectError, AttemptResult::ConnectError) => true,
            (_, AttemptResult::ConnectError) | (Condition::ConnectError, _) => false,
            (Condition::Status(s), AttemptResult::Status(x)) => s == x,
            (Condition::Class(c), AttemptResult::Status(x)) => x / 100 == u16::from(c),
            (Condition::AtLeast(s), AttemptResult::Status(x)) => x >= s,
            (Condition::Range(a, b), AttemptResult::Status(x)) => (a..=b).contains(&x),
        }
    }
}

/// A set of conditions: matches when any element does.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConditionSet(pub Vec<Condition>);

impl ConditionSet {
    /// Parses config strings; on error, the index of the bad item and why.
    pub fn parse(items: &[String]) -> Result<ConditionSet, (usize, String)> {
        items
            .iter()
            .enumerate()
            .map(|(i, s)| s.parse::<Condition>().map_err(|e| (i, e)))
            .collect::<Result<Vec<_>, _>>()
            .map(ConditionSet)
    }

    pub fn matches(&self, r: AttemptResult) -> bool {
        self.0.iter().any(|c| c.matches(r))
    }

    /// 429, 5xx and connection failures: what fails over by default.
    pub fn default_failover() -> ConditionSet {
        ConditionSet(vec![
            Condition::Status(429),
            Condition::Class(5),
            Condition::ConnectError,
        ])
    }
}

impl fmt::Display for ConditionSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        write!(f, "[{}]", parts.join(", "))
    }
}

/// Why a backoff cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackoffError {
    #[error(
        "max_interval needs delta (APIM's exponential rule uses interval, max_interval and delta)"
    )]
    MaxWithoutDelta,
    #[error("max_interval ({max:?}) must not be shorter than interval ({interval:?})")]
    MaxBelowInterval { interval: Duration, max: Duration },
}

/// The wait between two tries of the same backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    interval: Duration,
    delta: Option<Duration>,
    max_interval: Option<Duration>,
    first_fast_retry: bool,
}

/// Longest wait any rule can produce, so a linear rule with many retries stays finite.
const BACKOFF_CEILING: Duration = Duration::from_secs(3600);

impl Backoff {
    pub fn try_new(
        interval: Duration,
        delta: Option<Duration>,
        max_interval: Option<Duration>,
        first_fast_retry: bool,
    ) -> Result<Backoff, BackoffError> {
        if let Some(max) = max_interval {
            if delta.is_none() {
                return Err(BackoffError::MaxWithoutDelta);
            }
            if max < interval {
                return Err(BackoffError::MaxBelowInterval { interval, max });
            }
        }
        Ok(Backoff {
            interval,
            delta,
            max_interval,
            first_fast_retry,
        })
    }

    /// No waiting at all: the gateway's default for retries, which switch backends.
    pub fn none() -> Backoff {
        Backoff {
            interval: Duration::ZERO,
            delta: None,
            max_interval: None,
            first_fast_retry: false,
        }
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    pub fn max_interval(&self) -> Option<Duration> {
        self.max_interval
    }

    /// The wait before retry `n` (0 = the first retry) of the same backend. `unit` is a
    /// uniform random draw in `[0, 1)`, scaling delta into `[0.8 delta, 1.2 delta)`.
    pub fn delay(&self, n: u32, unit: f64) -> Duration {
        if self.first_fast_retry && n == 0 {
            return Duration::ZERO;
        }
        let d = match (self.delta, self.max_interval) {
            (None, _) => self.interval,
            (Some(delta), None) => self.interval.saturating_add(delta.saturating_mul(n)),
            (Some(delta), Some(max)) => {
                let factor = 0.8 + 0.4 * unit.clamp(0.0, 1.0);
                // 2^n - 1; past 2^62 the cap applies anyway.
                let growth = if n >= 62 {
                    f64::INFINITY
                } else {
                    ((1u64 << n) - 1) as f64
                };
                let extra_secs = delta.as_secs_f64() * growth * factor;
                let extra = if extra_secs.is_finite() && extra_secs < BACKOFF_CEILING.as_secs_f64()
                {
                    Duration::from_secs_f64(extra_secs)
                } else {
                    BACKOFF_CEILING
                };
                self.interval.saturating_add(extra).min(max)
            }
        };
        d.min(BACKOFF_CEILING)
    }
}

/// Bounds extra upstream attempts (failovers and retries) to a share of recent requests
/// plus a small floor, over a sliding window of one-second buckets (the idea of tower's
/// retry budget). When every backend is failing, this keeps the gateway from multiplying
/// the traffic it sends them.
#[derive(Debug, Clone)]
pub struct RetryBudget {
    ratio: f64,
    min_per_second: u32,
    /// `(second, requests, retries)` ring, one slot per second of the window.
    slots: Vec<(u64, u64, u64)>,
    /// Requests and retries other gateway instances counted in their windows, when
    /// instances share their budgets: the budget then bounds the cluster's retries.
    remote: (u64, u64),
}

/// A snapshot of a budget, for logs and error messages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetState {
    pub requests: u64,
    pub retries: u64,
    pub allowed: u64,
    pub window_secs: u64,
}

impl fmt::Display for BudgetState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} retries used of {} allowed in the last {} s ({} requests)",
            self.retries, self.allowed, self.window_secs, self.requests
        )
    }
}

impl RetryBudget {
    pub fn new(ratio: f64, min_per_second: u32, window: Duration) -> RetryBudget {
        let secs = window.as_secs().clamp(1, 3600);
        RetryBudget {
            ratio: if ratio.is_finite() {
                ratio.max(0.0)
            } else {
                0.0
            },
            min_per_second,
            slots: vec![(u64::MAX, 0, 0); usize::try_from(secs).unwrap_or(60)],
            remote: (0, 0),
        }
    }

    /// What other instances counted in their windows (replacing what they said before).
    pub fn set_remote(&mut self, requests: u64, retries: u64) {
        self.remote = (requests, retries);
    }

    /// `(requests, retries)` this instance counted in the window ending at `now_ms`.
    pub fn local_counts(&self, now_ms: u64) -> (u64, u64) {
        let sec = now_ms / 1000;
        let len = self.slots.len() as u64;
        let (mut requests, mut retries) = (0u64, 0u64);
        for (s, req, ret) in &self.slots {
            if *s != u64::MAX && *s <= sec && sec - *s < len {
                requests = requests.saturating_add(*req);
                retries = retries.saturating_add(*ret);
            }
        }
        (requests, retries)
    }

    fn slot(&mut self, now_ms: u64) -> &mut (u64, u64, u64) {
        let sec = now_ms / 1000;
        let len = self.slots.len() as u64;
        let i = usize::try_from(sec % len).unwrap_or(0);
        let slot = &mut self.slots[i];
        if slot.0 != sec {
            *slot = (sec, 0, 0);
        }
        slot
    }

    /// Records one client request.
    pub fn deposit(&mut self, now_ms: u64) {
        self.slot(now_ms).1 += 1;
    }

    /// Takes one extra attempt from the budget, or refuses.
    pub fn try_withdraw(&mut self, now_ms: u64) -> bool {
        let s = self.state(now_ms);
        if s.retries < s.allowed {
            self.slot(now_ms).2 += 1;
            true
        } else {
            false
        }
    }

    /// The budget over the window ending at `now_ms`, other instances' counts included.
    pub fn state(&self, now_ms: u64) -> BudgetState {
        let len = self.slots.len() as u64;
        let (local_requests, local_retries) = self.local_counts(now_ms);
        let requests = local_requests.saturating_add(self.remote.0);
        let retries = local_retries.saturating_add(self.remote.1);
        let allowed = u64::from(self.min_per_second) * len + (self.ratio * requests as f64) as u64;
        BudgetState {
            requests,
            retries,
            allowed,
            window_secs: len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(v: u64) -> Duration {
        Duration::from_secs(v)
    }

    #[test]
    fn conditions_parse_and_match() {
        let set =
            ConditionSet::parse(&["429".into(), "5xx".into(), "connect-error".into()]).unwrap();
        assert!(set.matches(AttemptResult::Status(429)));
        assert!(set.matches(AttemptResult::Status(503)));
        assert!(set.matches(AttemptResult::ConnectError));
        assert!(!set.matches(AttemptResult::Status(400)));
        assert!(!set.matches(AttemptResult::Status(200)));
        let ge = ConditionSet::parse(&[">=300".into()]).unwrap();
        assert!(ge.matches(AttemptResult::Status(300)));
        assert!(ge.matches(AttemptResult::Status(404)));
        assert!(!ge.matches(AttemptResult::Status(299)));
        assert!(!ge.matches(AttemptResult::ConnectError));
        let r = ConditionSet::parse(&["500-502".into()]).unwrap();
        assert!(r.matches(AttemptResult::Status(502)));
        assert!(!r.matches(AttemptResult::Status(503)));
        assert_eq!(set.to_string(), "[429, 5xx, connect-error]");
    }

    #[test]
    fn bad_conditions_say_which_and_why() {
        assert_eq!(
            ConditionSet::parse(&["429".into(), "6xx".into()])
                .unwrap_err()
                .0,
            1
        );
        for bad in ["", "abc", "99", ">=700", "503-500", "5x", "connect"] {
            assert!(bad.parse::<Condition>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn apim_documented_example_vectors() {
        // interval = delta = 10 s, max-interval = 100 s: "10, 20, 40, 80, 100, 100".
        let b = Backoff::try_new(s(10), Some(s(10)), Some(s(100)), false).unwrap();
        let mid = 0.5; // random factor exactly 1.0
        let got: Vec<u64> = (0..6).map(|n| b.delay(n, mid).as_secs()).collect();
        assert_eq!(got, vec![10, 20, 40, 80, 100, 100]);
        // The random factor spans [0.8, 1.2) of delta.
        assert_eq!(b.delay(1, 0.0), Duration::from_secs(18));
        assert_eq!(b.delay(2, 0.0), Duration::from_secs(34));
        assert_eq!(b.delay(2, 0.999_999).as_millis(), 45_999);
        // Seed 001: interval 1, max 10, delta 1.
        let b = Backoff::try_new(s(1), Some(s(1)), Some(s(10)), false).unwrap();
        let got: Vec<u64> = (0..6).map(|n| b.delay(n, mid).as_secs()).collect();
        assert_eq!(got, vec![1, 2, 4, 8, 10, 10]);
    }

    #[test]
    fn fixed_linear_and_fast_first() {
        let fixed = Backoff::try_new(s(2), None, None, false).unwrap();
        assert_eq!(
            (0..4).map(|n| fixed.delay(n, 0.3)).collect::<Vec<_>>(),
            vec![s(2); 4]
        );
        let linear = Backoff::try_new(s(1), Some(s(2)), None, false).unwrap();
        assert_eq!(
            (0..4)
                .map(|n| linear.delay(n, 0.3).as_secs())
                .collect::<Vec<_>>(),
            vec![1, 3, 5, 7]
        );
        let fast = Backoff::try_new(s(1), Some(s(1)), Some(s(10)), true).unwrap();
        assert_eq!(fast.delay(0, 0.5), Duration::ZERO);
        assert_eq!(fast.delay(1, 0.5), s(2));
        assert_eq!(linear.delay(u32::MAX, 0.5), BACKOFF_CEILING);
        assert_eq!(Backoff::none().delay(3, 0.5), Duration::ZERO);
    }

    #[test]
    fn invalid_backoffs_cannot_be_built() {
        assert_eq!(
            Backoff::try_new(s(1), None, Some(s(5)), false),
            Err(BackoffError::MaxWithoutDelta)
        );
        assert!(matches!(
            Backoff::try_new(s(10), Some(s(1)), Some(s(5)), false),
            Err(BackoffError::MaxBelowInterval { .. })
        ));
    }

    #[test]
    fn budget_allows_floor_plus_ratio() {
        let mut b = RetryBudget::new(0.2, 1, Duration::from_secs(10));
        let t = 1_000_000;
        // Floor: 1 per second over 10 s = 10 retries with no requests at all.
        for _ in 0..10 {
            assert!(b.try_withdraw(t));
        }
        assert!(!b.try_withdraw(t));
        // 100 requests add 20 more.
        for _ in 0..100 {
            b.deposit(t);
        }
        for _ in 0..20 {
            assert!(b.try_withdraw(t));
        }
        assert!(!b.try_withdraw(t));
        let st = b.state(t);
        assert_eq!((st.requests, st.retries, st.allowed), (100, 30, 30));
        assert!(st.to_string().contains("30 retries used of 30 allowed"));
        // The window slides: 10 s later everything has expired.
        let later = t + 10_000;
        assert_eq!(b.state(later).retries, 0);
        assert!(b.try_withdraw(later));
    }

    #[test]
    fn other_instances_counts_share_one_budget() {
        let mut b = RetryBudget::new(0.5, 0, Duration::from_secs(10));
        let t = 1_000_000;
        for _ in 0..10 {
            b.deposit(t);
        }
        // Alone: 5 retries allowed.
        assert_eq!(b.state(t).allowed, 5);
        // Another instance sent 10 requests and made 7 retries: 10 allowed in all, 7 used.
        b.set_remote(10, 7);
        let st = b.state(t);
        assert_eq!((st.requests, st.retries, st.allowed), (20, 7, 10));
        assert_eq!(b.local_counts(t), (10, 0));
        for _ in 0..3 {
            assert!(b.try_withdraw(t));
        }
        assert!(!b.try_withdraw(t), "the cluster's budget is spent");
        b.set_remote(0, 0);
        assert!(b.try_withdraw(t), "alone again");
    }

    proptest! {
        /// Every exponential delay lies in [interval, max_interval].
        #[test]
        fn exponential_delay_within_bounds(
            interval in 0u64..30_000, extra in 0u64..300_000, delta in 1u64..60_000,
            n in 0u32..100, unit in 0.0f64..1.0,
        ) {
            let (i, m) = (Duration::from_millis(interval), Duration::from_millis(interval + extra));
            let b = Backoff::try_new(i, Some(Duration::from_millis(delta)), Some(m), false).unwrap();
            let d = b.delay(n, unit);
            prop_assert!(d >= i && d <= m, "{:?} not in [{:?}, {:?}]", d, i, m);
        }

        /// Delays never shrink as retries go on (for a fixed random draw).
        #[test]
        fn exponential_delay_is_monotonic(n in 0u32..60, unit in 0.0f64..1.0) {
            let b = Backoff::try_new(Duration::from_secs(1), Some(Duration::from_secs(1)), Some(Duration::from_secs(120)), false).unwrap();
            prop_assert!(b.delay(n + 1, unit) >= b.delay(n, unit));
        }

        /// A retry is granted exactly when the window's retries are below its allowance,
        /// so granting never takes the window past what it allows.
        #[test]
        fn budget_never_overdraws(ops in prop::collection::vec((0u64..30_000, any::<bool>()), 1..400)) {
            let mut b = RetryBudget::new(0.2, 2, Duration::from_secs(5));
            let mut t = 0;
            for (dt, is_request) in ops {
                t += dt / 10;
                if is_request {
                    b.deposit(t);
                } else {
                    let before = b.state(t);
                    let granted = b.try_withdraw(t);
                    prop_assert_eq!(granted, before.retries < before.allowed);
                    if granted {
                        prop_assert!(b.state(t).retries <= before.allowed);
                    }
                }
            }
        }
    }
}
