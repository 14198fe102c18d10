//! Circuit breaking: a backend that keeps failing is taken out of rotation for a while,
//! even when each failure on its own carries no `Retry-After` (a 500 with no hint, a
//! connection reset).
//!
//! This is APIM's backend circuit-breaker rule: trip when `failures` failures happen
//! within `window` (or, optionally, when at least `ratio` of at least `min_requests`
//! requests in the window failed), for `trip`; with `accept_retry_after`, a failure that
//! carried a longer `Retry-After` trips for that long instead. The window is a ring of
//! one-second buckets, so recording is O(1) and memory is fixed.

use std::time::Duration;

/// When a backend trips, and for how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerPolicy {
    /// Trip after this many failures within `window`.
    pub failures: u32,
    /// Also trip when this share of the window's requests failed (with at least
    /// `min_requests` of them).
    pub ratio: Option<f64>,
    pub min_requests: u32,
    pub window: Duration,
    pub trip: Duration,
    pub accept_retry_after: bool,
}

impl BreakerPolicy {
    /// Whether the counts of a window call for a trip.
    pub fn should_trip(&self, total: u64, failed: u64) -> bool {
        if self.failures > 0 && failed >= u64::from(self.failures) {
            return true;
        }
        match self.ratio {
            Some(r) => {
                total >= u64::from(self.min_requests.max(1)) && failed as f64 >= r * total as f64
            }
            None => false,
        }
    }

    /// How long a trip lasts, given the hint the tripping failure carried.
    pub fn trip_for(&self, hint: Option<Duration>) -> Duration {
        match hint {
            Some(h) if self.accept_retry_after && h > self.trip => h,
            _ => self.trip,
        }
    }
}

/// Requests and failures of one backend over the last `window`.
#[derive(Debug, Clone)]
pub struct FailureWindow {
    /// `(second, total, failed)`, one slot per second of the window.
    slots: Vec<(u64, u64, u64)>,
}

impl FailureWindow {
    pub fn new(window: Duration) -> FailureWindow {
        let secs = window.as_secs().clamp(1, 3600);
        FailureWindow {
            slots: vec![(u64::MAX, 0, 0); usize::try_from(secs).unwrap_or(60)],
        }
    }

    pub fn record(&mut self, now_ms: u64, failed: bool) {
        let sec = now_ms / 1000;
        let len = self.slots.len() as u64;
        let slot = &mut self.slots[usize::try_from(sec % len).unwrap_or(0)];
        if slot.0 != sec {
            *slot = (sec, 0, 0);
        }
        slot.1 += 1;
        if failed {
            slot.2 += 1;
        }
    }

    /// `(total, failed)` within the window ending at `now_ms`.
    pub fn counts(&self, now_ms: u64) -> (u64, u64) {
        let sec = now_ms / 1000;
        let len = self.slots.len() as u64;
        self.slots
            .iter()
            .filter(|(s, _, _)| *s != u64::MAX && *s <= sec && sec - *s < len)
            .fold((0, 0), |(t, f), (_, tt, ff)| (t + tt, f + ff))
    }

    /// Forgets everything: after a trip, the backend starts with a clean record.
    pub fn clear(&mut self) {
        for s in &mut self.slots {
            *s = (u64::MAX, 0, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy() -> BreakerPolicy {
        BreakerPolicy {
            failures: 3,
            ratio: None,
            min_requests: 0,
            window: Duration::from_secs(10),
            trip: Duration::from_secs(30),
            accept_retry_after: true,
        }
    }

    #[test]
    fn trips_after_n_failures_in_the_window() {
        let p = policy();
        let mut w = FailureWindow::new(p.window);
        let t = 50_000;
        w.record(t, true);
        w.record(t + 1_000, false);
        w.record(t + 2_000, true);
        let (total, failed) = w.counts(t + 2_000);
        assert_eq!((total, failed), (3, 2));
        assert!(!p.should_trip(total, failed));
        w.record(t + 3_000, true);
        let (total, failed) = w.counts(t + 3_000);
        assert!(p.should_trip(total, failed));
        // Failures older than the window no longer count.
        let (total, failed) = w.counts(t + 10_500);
        assert_eq!((total, failed), (3, 2));
        assert!(!p.should_trip(total, failed));
        w.clear();
        assert_eq!(w.counts(t + 3_000), (0, 0));
    }

    #[test]
    fn ratio_rule_needs_enough_requests() {
        let p = BreakerPolicy {
            failures: 0,
            ratio: Some(0.5),
            min_requests: 10,
            ..policy()
        };
        assert!(!p.should_trip(4, 4), "too few requests to judge");
        assert!(!p.should_trip(10, 4));
        assert!(p.should_trip(10, 5));
        assert!(p.should_trip(100, 60));
    }

    #[test]
    fn accept_retry_after_extends_the_trip() {
        let p = policy();
        assert_eq!(p.trip_for(None), Duration::from_secs(30));
        assert_eq!(
            p.trip_for(Some(Duration::from_secs(5))),
            Duration::from_secs(30)
        );
        assert_eq!(
            p.trip_for(Some(Duration::from_secs(90))),
            Duration::from_secs(90)
        );
        let strict = BreakerPolicy {
            accept_retry_after: false,
            ..p
        };
        assert_eq!(
            strict.trip_for(Some(Duration::from_secs(90))),
            Duration::from_secs(30)
        );
    }

    proptest! {
        #[test]
        fn counts_match_a_naive_recount(events in prop::collection::vec((0u64..4_000, any::<bool>()), 0..200)) {
            let mut w = FailureWindow::new(Duration::from_secs(5));
            let mut t = 0u64;
            let mut log = Vec::new();
            for (dt, failed) in events {
                t += dt;
                w.record(t, failed);
                log.push((t / 1000, failed));
                let sec = t / 1000;
                let recent: Vec<_> = log.iter().filter(|(s, _)| sec - s < 5).collect();
                let expect = (recent.len() as u64, recent.iter().filter(|(_, f)| *f).count() as u64);
                prop_assert_eq!(w.counts(t), expect);
            }
        }
    }
}
