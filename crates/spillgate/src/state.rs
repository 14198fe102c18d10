//! What the gateway has learnt about each backend: cooldowns and the last status.
//!
//! Read on every request by every connection, so the cooldown check is lock-free: a
//! cooldown is an atomic deadline in unix milliseconds, merged with `fetch_max` so that
//! the later deadline wins even when two requests observe the same backend at once. The
//! breaker window and the tracked capacity sit behind short per-backend mutexes. Unix
//! milliseconds (not process-local instants) keep the values meaningful when they are
//! shared between instances (see `store`): what other instances learn is merged into this
//! same state, so the request path reads one local view whatever the store.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use spillgate_core::breaker::FailureWindow;
use spillgate_core::capacity::{Admission, Capacity, CapacityPolicy, RateLimitHeaders, Reserve};
use spillgate_core::outcome::{unix_ms, CoolReason, Cooldown};

/// Wall-clock milliseconds derived from tokio's clock, so that paused-time tests move
/// cooldowns forward together with `tokio::time`.
///
/// `now_ms` is the wall time taken at start plus the monotonic time since. Alone, that
/// would keep any later step of the system clock (an NTP correction, a VM resumed from a
/// pause) out of the gateway for good, and with it every deadline shared with other
/// instances. A shared store therefore calls [`Clock::rebase`] on each poll; without one
/// nothing else reads these deadlines and the clock is never re-based (paused-time tests
/// stay deterministic).
///
/// A re-base follows a step forward at once: cooldowns running here end that much early,
/// as they do on every instance whose clock was right. A step back is taken in slices, at
/// most half the time since the previous re-base each (and never more than
/// [`MAX_STEP_BACK_MS`]): the in-memory windows, budgets and deadlines never see time go
/// back by more than that, and `now_ms` keeps moving forward, at least at half speed,
/// until it agrees with the wall clock again. A running cooldown then lasts at most twice
/// as long in real time, never indefinitely.
#[derive(Debug)]
pub struct Clock {
    base_instant: tokio::time::Instant,
    /// Unix ms at `base_instant`, as of the last re-base.
    base_unix_ms: AtomicU64,
    /// When the last re-base ran (ms after `base_instant`).
    rebased_at_ms: AtomicU64,
}

/// The most one re-base moves `now_ms` back.
pub const MAX_STEP_BACK_MS: u64 = 5_000;

impl Clock {
    pub fn new() -> Clock {
        Clock {
            base_instant: tokio::time::Instant::now(),
            base_unix_ms: AtomicU64::new(unix_ms(SystemTime::now())),
            rebased_at_ms: AtomicU64::new(0),
        }
    }

    /// Milliseconds from the base instant to `at`.
    fn elapsed_ms(&self, at: tokio::time::Instant) -> u64 {
        spillgate_core::outcome::millis(at.saturating_duration_since(self.base_instant))
    }

    pub fn now_ms(&self) -> u64 {
        self.ms_at(crate::now::now())
    }

    /// `now_ms` at `at`, on the current base, for a caller that read the clock already
    /// (just before: a re-base since then would move the result with it).
    pub fn ms_at(&self, at: tokio::time::Instant) -> u64 {
        self.base_unix_ms
            .load(Ordering::Relaxed)
            .saturating_add(self.elapsed_ms(at))
    }

    /// The tokio instant at which unix time `ms` is reached.
    pub fn instant_at(&self, ms: u64) -> tokio::time::Instant {
        let base = self.base_unix_ms.load(Ordering::Relaxed);
        self.base_instant + std::time::Duration::from_millis(ms.saturating_sub(base))
    }

    /// Brings `now_ms` back in line with the system clock (see the type's docs). Returns
    /// how far it moved `now_ms` (negative: back).
    pub fn rebase(&self) -> i64 {
        self.rebase_to(unix_ms(SystemTime::now()))
    }

    /// Moves `now_ms` to `unix_ms` at once, as a clock step that happened since the
    /// last re-base would look.
    #[cfg(test)]
    pub(crate) fn step_for_test(&self, unix_ms: u64) {
        let base = unix_ms.saturating_sub(self.elapsed_ms(tokio::time::Instant::now()));
        self.base_unix_ms.store(base, Ordering::Relaxed);
    }

    /// [`Clock::rebase`] against a given wall time. Called by one task at a time.
    pub fn rebase_to(&self, wall_ms: u64) -> i64 {
        let elapsed = self.elapsed_ms(tokio::time::Instant::now());
        let since_last =
            elapsed.saturating_sub(self.rebased_at_ms.swap(elapsed, Ordering::Relaxed));
        let target = wall_ms.saturating_sub(elapsed);
        let current = self.base_unix_ms.load(Ordering::Relaxed);
        let next = if target >= current {
            target
        } else {
            let back = (current - target).min(since_last / 2).min(MAX_STEP_BACK_MS);
            current - back
        };
        self.base_unix_ms.store(next, Ordering::Relaxed);
        if next >= current {
            i64::try_from(next - current).unwrap_or(i64::MAX)
        } else {
            -i64::try_from(current - next).unwrap_or(i64::MAX)
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// Live state of one backend.
///
/// After a cooldown or a trip the backend is *recovering*: until one request answers
/// well, at most one request at a time (the probe) is sent to it, so a backend that comes
/// back is not hit by every waiting request at once.
#[derive(Debug, Default)]
pub struct BackendState {
    cool_until_ms: AtomicU64,
    reason: AtomicU8,
    last_status: AtomicU16,
    recovering: AtomicBool,
    probe_in_flight: AtomicBool,
    /// Until when (unix ms) another gateway instance holds this backend's probe, as the
    /// shared store last said: no need to ask again before then.
    remote_probe_until_ms: AtomicU64,
    /// Requests and failures in the breaker's window, with the window's length; built on
    /// first use and rebuilt when the configured window changes (e.g. by a reload).
    breaker: Mutex<Option<(std::time::Duration, FailureWindow)>>,
    /// Spare capacity tracked from the deployment's rate-limit headers.
    capacity: Mutex<Capacity>,
    /// A low-priority probe sent because the capacity data was stale is in flight.
    capacity_probe: AtomicBool,
    /// Responses this backend gave that went back to clients (for the dashboard's chart).
    served: AtomicU64,
}

/// Tokens (and one request) reserved on a deployment for a request in flight. Released
/// when dropped, so a request that is cancelled (its client went away) or fails gives its
/// reservation back on every path.
#[derive(Debug)]
pub struct Reservation {
    state: Arc<BackendState>,
    tokens: u64,
    armed: bool,
}

impl Reservation {
    /// Ends the reservation now, taking `used` tokens (a response's usage) off the
    /// tracked capacity when given.
    pub fn settle(mut self, used: Option<u64>, now_ms: u64) {
        self.armed = false;
        self.state.release(self.tokens, used, now_ms);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.armed {
            self.state.release(self.tokens, None, 0);
        }
    }
}

/// Holds a deployment's low-priority capacity probe; frees it when dropped.
#[derive(Debug)]
pub struct CapacityProbe(Arc<BackendState>);

impl Drop for CapacityProbe {
    fn drop(&mut self) {
        self.0.capacity_probe.store(false, Ordering::Release);
    }
}

/// Whether a request may go to a backend, as far as recovery probing goes.
#[derive(Debug)]
pub enum Probe {
    /// The backend is not recovering: no probe needed.
    NotNeeded,
    /// This request is the backend's probe.
    Acquired(ProbeGuard),
    /// Another request is probing it.
    Busy,
}

/// Holds a recovering backend's single probe slot (and, with a shared store, the
/// cluster's); frees it when dropped, however the probe ends (answer, failure, or the
/// client going away).
#[derive(Debug)]
pub struct ProbeGuard(Arc<BackendState>, Option<Box<crate::store::ClusterProbe>>);

impl ProbeGuard {
    /// Adds the cluster-wide slot to this instance's.
    pub fn attach(&mut self, cluster: crate::store::ClusterProbe) {
        self.1 = Some(Box::new(cluster));
    }

    /// The probe answered well: the backend is fully back (for every instance, when the
    /// slot is the cluster's).
    pub fn recovered(&mut self) {
        self.0.recovered();
        if let Some(c) = self.1.as_mut() {
            c.recovered();
        }
    }

    /// The state this guard probes.
    pub fn state(&self) -> &Arc<BackendState> {
        &self.0
    }
}

impl Drop for ProbeGuard {
    fn drop(&mut self) {
        self.0.probe_in_flight.store(false, Ordering::Release);
    }
}

/// What recording a cooldown did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cooled {
    /// No cooldown was running: this one started it (what the metrics count).
    pub started: bool,
    /// Its deadline is now the backend's.
    pub extended: bool,
}

/// How a backend looks at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Availability {
    Ready,
    Cooling {
        until_ms: u64,
        reason: Option<CoolReason>,
    },
}

impl BackendState {
    /// Records one attempt in the breaker window of length `window`. For a failure,
    /// returns the window's `(total, failed)` counts, which decide a trip (a success
    /// cannot trip, so its counts are not summed). The window is cleared after a trip by
    /// the caller.
    pub fn breaker_record(
        &self,
        window: std::time::Duration,
        now_ms: u64,
        failed: bool,
    ) -> Option<(u64, u64)> {
        let mut slot = self.breaker.lock().ok()?;
        if slot.as_ref().is_none_or(|(w, _)| *w != window) {
            *slot = None;
        }
        let (_, w) = slot.get_or_insert_with(|| (window, FailureWindow::new(window)));
        w.record(now_ms, failed);
        failed.then(|| w.counts(now_ms))
    }

    pub fn breaker_clear(&self) {
        if let Ok(mut slot) = self.breaker.lock() {
            if let Some((_, w)) = slot.as_mut() {
                w.clear();
            }
        }
    }

    pub fn is_ready(&self, now_ms: u64) -> bool {
        self.cool_until_ms.load(Ordering::Relaxed) <= now_ms
    }

    /// Ready and, if recovering, with its probe slot free (here and, as far as this
    /// instance knows, on the other instances).
    pub fn is_usable(&self, now_ms: u64) -> bool {
        self.is_ready(now_ms)
            && !(self.recovering.load(Ordering::Acquire)
                && (self.probe_in_flight.load(Ordering::Acquire)
                    || self.remote_probe_until_ms.load(Ordering::Relaxed) > now_ms))
    }

    /// Another instance holds the probe: leave the backend alone until `until_ms`.
    pub fn remote_probe_busy(&self, until_ms: u64) {
        self.remote_probe_until_ms
            .store(until_ms, Ordering::Relaxed);
    }

    /// Another instance's probe found the backend well. Ignored while a cooldown runs
    /// here (a newer failure than the probe's answer).
    pub fn remote_recovered(&self, now_ms: u64) -> bool {
        if !self.is_ready(now_ms) || !self.recovering.load(Ordering::Acquire) {
            return false;
        }
        self.remote_probe_until_ms.store(0, Ordering::Relaxed);
        self.recovered();
        true
    }

    /// Takes in another instance's capacity observation when it is newer than ours.
    pub fn merge_remote_capacity(&self, remote: &spillgate_core::shared::SharedCapacity) -> bool {
        self.capacity
            .lock()
            .map(|mut c| c.merge_remote(remote))
            .unwrap_or(false)
    }

    pub fn is_recovering(&self) -> bool {
        self.recovering.load(Ordering::Acquire)
    }

    /// For a recovering backend, takes the probe slot; says when another request holds
    /// it. A backend that is not recovering needs no slot.
    pub fn acquire_probe(self: &Arc<Self>) -> Probe {
        if !self.recovering.load(Ordering::Acquire) {
            return Probe::NotNeeded;
        }
        match self.probe_in_flight.compare_exchange(
            false,
            true,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Probe::Acquired(ProbeGuard(Arc::clone(self), None)),
            Err(_) => Probe::Busy,
        }
    }

    /// Takes in a response's rate-limit headers.
    pub fn observe_capacity(
        &self,
        headers: &RateLimitHeaders,
        policy: &CapacityPolicy,
        now_ms: u64,
    ) {
        if let Ok(mut c) = self.capacity.lock() {
            c.observe(headers, policy, now_ms);
        }
    }

    /// Releases a reservation; `used` (a response's usage) is taken off the tracked
    /// tokens when the backend sent no rate-limit headers of its own.
    pub fn release(&self, tokens: u64, used: Option<u64>, now_ms: u64) {
        if let Ok(mut c) = self.capacity.lock() {
            c.release(tokens);
            if let Some(u) = used {
                c.consume_tokens(u, now_ms);
            }
        }
    }

    pub fn admit_low(
        &self,
        tokens: u64,
        reserve: Reserve,
        policy: &CapacityPolicy,
        now_ms: u64,
    ) -> Admission {
        let probing = self.capacity_probe.load(Ordering::Acquire);
        self.capacity
            .lock()
            .map(|c| c.admit_low(tokens, reserve, policy, probing, now_ms))
            .unwrap_or(Admission::Admit)
    }

    /// Whether the tracked capacity can take a request of `tokens` now (one request and
    /// its tokens free after in-flight reservations). Unknown capacity can.
    pub fn covers(&self, tokens: u64, now_ms: u64) -> bool {
        self.capacity
            .lock()
            .map(|c| c.covers(tokens, now_ms))
            .unwrap_or(true)
    }

    /// Checks and reserves in one step, so two requests cannot both be admitted against
    /// the same remaining capacity: with `reserve` (a low-priority request) the admission
    /// rule must pass; with `strict`, the capacity must also cover the request. On success
    /// the guard holds the reservation, and the admission says whether this request is
    /// the capacity probe.
    pub fn try_reserve(
        self: &Arc<Self>,
        tokens: u64,
        reserve: Option<(Reserve, &CapacityPolicy)>,
        strict: bool,
        now_ms: u64,
    ) -> Option<(Reservation, Admission)> {
        let mut c = self.capacity.lock().ok()?;
        let admission = match reserve {
            Some((r, policy)) => {
                let probing = self.capacity_probe.load(Ordering::Acquire);
                c.admit_low(tokens, r, policy, probing, now_ms)
            }
            None => Admission::Admit,
        };
        if let Admission::Refuse(_) = admission {
            return None;
        }
        if strict && admission == Admission::Admit && !c.covers(tokens, now_ms) {
            return None;
        }
        c.reserve(tokens);
        Some((
            Reservation {
                state: Arc::clone(self),
                tokens,
                armed: true,
            },
            admission,
        ))
    }

    /// Takes the capacity probe slot, if free.
    pub fn acquire_capacity_probe(self: &Arc<Self>) -> Option<CapacityProbe> {
        self.capacity_probe
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| CapacityProbe(Arc::clone(self)))
    }

    /// Share of the token limit free now, when known.
    pub fn headroom(&self, now_ms: u64) -> Option<f64> {
        self.capacity.lock().ok().and_then(|c| c.headroom(now_ms))
    }

    /// A copy of the tracked capacity (for state views).
    pub fn capacity(&self) -> Capacity {
        self.capacity.lock().map(|c| c.clone()).unwrap_or_default()
    }

    pub fn count_served(&self) {
        self.served.fetch_add(1, Ordering::Relaxed);
    }

    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// The backend answered well: it is fully back.
    pub fn recovered(&self) {
        self.recovering.store(false, Ordering::Release);
    }

    pub fn cooldown(&self, now_ms: u64) -> Option<Cooldown> {
        let until_ms = self.cool_until_ms.load(Ordering::Relaxed);
        if until_ms <= now_ms {
            return None;
        }
        let reason = CoolReason::from_u8(self.reason.load(Ordering::Relaxed))
            .unwrap_or(CoolReason::ServerError);
        Some(Cooldown { until_ms, reason })
    }

    pub fn availability(&self, now_ms: u64) -> Availability {
        match self.cooldown(now_ms) {
            None => Availability::Ready,
            Some(c) => Availability::Cooling {
                until_ms: c.until_ms,
                reason: Some(c.reason),
            },
        }
    }

    /// Ends a running cooldown early, if it is for `reason` (a token obtained ends a
    /// cooldown for the lack of one). The backend stays recovering: one probe first.
    pub fn end_cooldown(&self, reason: CoolReason, now_ms: u64) -> bool {
        let until = self.cool_until_ms.load(Ordering::Acquire);
        if until <= now_ms || self.reason.load(Ordering::Relaxed) != reason.to_u8() {
            return false;
        }
        // Only this deadline is ended: a later one set meanwhile (a 429, say) stays.
        self.cool_until_ms
            .compare_exchange(until, now_ms, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Records a cooldown; the later deadline wins. Returns whether this one extended it.
    pub fn cool(&self, cooldown: Cooldown) -> bool {
        self.cool_at(cooldown, u64::MAX).extended
    }

    /// [`BackendState::cool`], also saying whether this cooldown started one (none was
    /// running at `now_ms`). Decided on the same atomic step, so of two requests that
    /// cool a ready backend at once exactly one starts it.
    pub fn cool_at(&self, cooldown: Cooldown, now_ms: u64) -> Cooled {
        self.recovering.store(true, Ordering::Release);
        let previous = self
            .cool_until_ms
            .fetch_max(cooldown.until_ms, Ordering::AcqRel);
        let extended = cooldown.until_ms > previous;
        if extended {
            // A racing cooldown with a later deadline may store its reason after ours;
            // the reason is informational, the deadline is what routing reads.
            self.reason
                .store(cooldown.reason.to_u8(), Ordering::Relaxed);
        }
        Cooled {
            started: previous <= now_ms && extended,
            extended,
        }
    }

    pub fn set_last_status(&self, status: u16) {
        self.last_status.store(status, Ordering::Relaxed);
    }

    pub fn last_status(&self) -> Option<u16> {
        match self.last_status.load(Ordering::Relaxed) {
            0 => None,
            s => Some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn later_deadline_wins_under_races() {
        let s = BackendState::default();
        assert!(s.cool(Cooldown {
            until_ms: 100,
            reason: CoolReason::Throttled
        }));
        assert!(!s.cool(Cooldown {
            until_ms: 50,
            reason: CoolReason::ServerError
        }));
        assert_eq!(
            s.cooldown(10),
            Some(Cooldown {
                until_ms: 100,
                reason: CoolReason::Throttled
            })
        );
        assert!(!s.is_ready(99));
        assert!(s.is_ready(100));
        assert_eq!(s.availability(100), Availability::Ready);
    }

    #[test]
    fn only_the_cooldown_that_finds_the_backend_ready_starts_one() {
        let s = Arc::new(BackendState::default());
        let c = |until_ms| Cooldown {
            until_ms,
            reason: CoolReason::Throttled,
        };
        assert_eq!(
            s.cool_at(c(100), 10),
            Cooled {
                started: true,
                extended: true
            }
        );
        // Running: a later deadline extends it, an earlier one changes nothing.
        assert_eq!(
            s.cool_at(c(200), 20),
            Cooled {
                started: false,
                extended: true
            }
        );
        assert_eq!(
            s.cool_at(c(150), 30),
            Cooled {
                started: false,
                extended: false
            }
        );
        // Over: the next one starts a new cooldown.
        assert!(s.cool_at(c(400), 200).started);
        // Many threads cooling a ready backend at once: exactly one starts it.
        let s = Arc::new(BackendState::default());
        let started: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let s = Arc::clone(&s);
                    scope.spawn(move || usize::from(s.cool_at(c(1_000 + i), 10).started))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(started, 1);
    }

    #[test]
    fn one_probe_at_a_time_while_recovering() {
        let s = Arc::new(BackendState::default());
        assert!(
            matches!(s.acquire_probe(), Probe::NotNeeded),
            "a healthy backend needs no probe"
        );
        s.cool(Cooldown {
            until_ms: 10,
            reason: CoolReason::Throttled,
        });
        assert!(!s.is_usable(5));
        assert!(s.is_usable(10));
        let Probe::Acquired(guard) = s.acquire_probe() else {
            panic!("the first request after the cooldown is the probe")
        };
        assert!(!s.is_usable(10), "the probe slot is taken");
        assert!(matches!(s.acquire_probe(), Probe::Busy));
        drop(guard);
        assert!(s.is_usable(10));
        s.recovered();
        assert!(matches!(s.acquire_probe(), Probe::NotNeeded));
    }

    #[tokio::test(start_paused = true)]
    async fn clock_follows_paused_tokio_time() {
        let c = Clock::new();
        let t0 = c.now_ms();
        let at = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert_eq!(c.now_ms() - t0, 20_000);
        // A reading taken before is that time's.
        assert_eq!(c.ms_at(at), t0);
        assert_eq!(c.ms_at(at + Duration::from_millis(1_500)), t0 + 1_500);
        assert_eq!(
            c.instant_at(t0 + 5_000),
            c.base_instant + Duration::from_millis(5_000)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_rebase_follows_a_step_forward_at_once_and_a_step_back_in_slices() {
        let c = Clock::new();
        let t0 = c.now_ms();
        tokio::time::sleep(Duration::from_secs(10)).await;
        // In step: nothing moves.
        assert_eq!(c.rebase_to(t0 + 10_000), 0);
        assert_eq!(c.now_ms(), t0 + 10_000);
        // The system clock jumps 60 s ahead: followed at once.
        assert_eq!(c.rebase_to(t0 + 70_000), 60_000);
        assert_eq!(c.now_ms(), t0 + 70_000);
        let deadline = c.now_ms() + 20_000;
        assert_eq!(
            c.instant_at(deadline),
            tokio::time::Instant::now() + Duration::from_secs(20)
        );
        // Then 30 s back. Re-based every second, now_ms never goes back by more than half
        // a second per re-base, keeps moving forward, and catches up with the wall clock.
        let mut wall = t0 + 40_000;
        let mut last = c.now_ms();
        let mut seconds = 0;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            wall += 1_000;
            seconds += 1;
            let before = c.now_ms();
            let moved = c.rebase_to(wall);
            let now = c.now_ms();
            assert!((-500..=0).contains(&moved), "{moved}");
            assert!(now >= last + 500, "now_ms keeps moving forward");
            assert_eq!(now as i64, before as i64 + moved);
            last = now;
            if now == wall {
                break;
            }
            assert!(seconds < 100, "never caught up");
        }
        assert_eq!(seconds, 60, "30 s absorbed at half speed");
        // A re-base after a long quiet spell moves back at most MAX_STEP_BACK_MS.
        tokio::time::sleep(Duration::from_secs(600)).await;
        wall += 600_000;
        assert_eq!(c.rebase_to(wall - 60_000), -(MAX_STEP_BACK_MS as i64));
    }
}
