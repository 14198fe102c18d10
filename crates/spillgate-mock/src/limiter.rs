//! Fixed-window request and token limiter, per deployment, shaped like Azure
//! OpenAI's quota enforcement so that the gateway's throttling logic can be
//! exercised against realistic 429s and `x-ratelimit-*` headers.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::Limits;
use crate::state::lock;

/// Smallest window the limiter accepts, so that a zero window cannot divide by zero.
const MIN_WINDOW: Duration = Duration::from_millis(1);

pub(crate) struct Limiter {
    allowed_requests: u64,
    allowed_tokens: u64,
    window: Duration,
    epoch: Instant,
    windows: Mutex<HashMap<String, WindowUsage>>,
}

#[derive(Clone, Copy)]
struct WindowUsage {
    index: u128,
    requests: u64,
    tokens: u64,
}

/// The outcome of one admission check, with what the headers need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    pub admitted: bool,
    pub limit_requests: u64,
    pub limit_tokens: u64,
    pub remaining_requests: u64,
    pub remaining_tokens: u64,
    /// Time until the current window ends.
    pub reset_in: Duration,
}

impl Decision {
    /// Whole seconds until the window ends, at least 1 (as `Retry-After` and
    /// `x-ratelimit-reset-*` carry it).
    pub fn reset_secs(&self) -> u64 {
        let ms = self.reset_ms();
        ms.div_ceil(1000).max(1)
    }

    /// Milliseconds until the window ends, at least 1.
    pub fn reset_ms(&self) -> u64 {
        let ms = self.reset_in.as_micros().div_ceil(1000);
        u64::try_from(ms).unwrap_or(u64::MAX).max(1)
    }
}

/// `ceil(per_minute * window / 60 s)`.
fn per_window(per_minute: u32, window: Duration) -> u64 {
    let scaled = u128::from(per_minute) * window.as_millis();
    u64::try_from(scaled.div_ceil(60_000)).unwrap_or(u64::MAX)
}

impl Limiter {
    pub fn new(limits: Limits) -> Limiter {
        let window = limits.window.max(MIN_WINDOW);
        Limiter {
            allowed_requests: per_window(limits.rpm, window),
            allowed_tokens: per_window(limits.tpm, window),
            window,
            epoch: Instant::now(),
            windows: Mutex::new(HashMap::new()),
        }
    }

    /// Admit (and count) one request of `tokens` estimated tokens for
    /// `deployment`, or refuse it without counting it.
    pub fn check(&self, deployment: &str, tokens: u64) -> Decision {
        self.check_at(deployment, tokens, Instant::now())
    }

    fn check_at(&self, deployment: &str, tokens: u64, now: Instant) -> Decision {
        let elapsed = now.saturating_duration_since(self.epoch);
        let window_nanos = self.window.as_nanos();
        let index = elapsed.as_nanos() / window_nanos;
        let into_window = elapsed.as_nanos() % window_nanos;
        let reset_in =
            Duration::from_nanos(u64::try_from(window_nanos - into_window).unwrap_or(u64::MAX));

        let mut windows = lock(&self.windows);
        let usage = match windows.get_mut(deployment) {
            Some(usage) => usage,
            None => windows.entry(deployment.to_owned()).or_insert(WindowUsage {
                index,
                requests: 0,
                tokens: 0,
            }),
        };
        if usage.index != index {
            *usage = WindowUsage {
                index,
                requests: 0,
                tokens: 0,
            };
        }
        let admitted = usage.requests < self.allowed_requests
            && usage.tokens.saturating_add(tokens) <= self.allowed_tokens;
        if admitted {
            usage.requests += 1;
            usage.tokens = usage.tokens.saturating_add(tokens);
        }
        Decision {
            admitted,
            limit_requests: self.allowed_requests,
            limit_tokens: self.allowed_tokens,
            remaining_requests: self.allowed_requests.saturating_sub(usage.requests),
            remaining_tokens: self.allowed_tokens.saturating_sub(usage.tokens),
            reset_in,
        }
    }

    pub fn reset(&self) {
        lock(&self.windows).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(rpm: u32, tpm: u32, window_ms: u64) -> Limiter {
        Limiter::new(Limits {
            rpm,
            tpm,
            window: Duration::from_millis(window_ms),
        })
    }

    #[test]
    fn allowance_is_rounded_up_per_window() {
        let l = limiter(6, 1000, 10_000);
        assert_eq!(l.allowed_requests, 1);
        assert_eq!(l.allowed_tokens, 167);
        let l = limiter(7, 60, 10_000);
        assert_eq!(l.allowed_requests, 2);
        assert_eq!(l.allowed_tokens, 10);
    }

    #[test]
    fn requests_are_limited_per_deployment_and_window() {
        let l = limiter(12, 1_000_000, 10_000);
        let t0 = l.epoch;
        assert!(l.check_at("a", 1, t0).admitted);
        let d = l.check_at("a", 1, t0 + Duration::from_secs(1));
        assert!(d.admitted);
        assert_eq!(d.remaining_requests, 0);
        let d = l.check_at("a", 1, t0 + Duration::from_millis(1500));
        assert!(!d.admitted);
        assert_eq!(d.reset_secs(), 9);
        assert_eq!(d.reset_ms(), 8500);
        // Another deployment has its own allowance.
        assert!(l.check_at("b", 1, t0 + Duration::from_secs(2)).admitted);
        // The next window starts afresh.
        assert!(l.check_at("a", 1, t0 + Duration::from_secs(10)).admitted);
    }

    #[test]
    fn tokens_are_limited_and_refusals_not_counted() {
        let l = limiter(1000, 600, 1000); // 10 tokens per 1 s window
        let t0 = l.epoch;
        assert!(l.check_at("a", 8, t0).admitted);
        let d = l.check_at("a", 3, t0);
        assert!(!d.admitted);
        assert_eq!(d.remaining_tokens, 2);
        assert!(l.check_at("a", 2, t0).admitted);
        l.reset();
        assert!(l.check_at("a", 10, t0).admitted);
    }

    #[test]
    fn reset_is_at_least_one_second() {
        let l = limiter(1, 1, 10);
        let d = l.check_at("a", 0, l.epoch);
        assert_eq!(d.reset_secs(), 1);
        assert_eq!(d.reset_ms(), 10);
    }
}
