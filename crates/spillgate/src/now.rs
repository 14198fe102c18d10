//! The time, read from the system clock once per poll of a client connection's task.
//!
//! A proxied JSON request read the clock about ten times: the head's wait, the
//! request's start, the attempt's deadline, the backend's cooldown check, the answer's
//! time, the upstream connection's return to its pool, and tokio's own reads around
//! each turn of the runtime. nginx reads it about once a request (once per turn of its
//! event loop). On a virtual machine one read is 30-40 ns (a timestamp counter read in
//! the vDSO): by that cost, about 5% of a request's user time (an estimate from a loop of
//! reads, not a measurement of the gateway). A connection's task
//! is polled twice for a JSON request (the request, then the answer), and the moments
//! read within one poll are microseconds apart, so it is read once per poll and the
//! poll's later readers take that.
//!
//! Only within [`OnePoll`]: code polled outside one (the store's tasks, health checks,
//! tests that drive a handler directly) reads the clock each time, as before. Time that
//! must not stand still within a poll (a timeout measured around a blocking step) reads
//! `tokio::time::Instant::now` directly.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Instant;

#[derive(Clone, Copy)]
enum State {
    /// No [`OnePoll`] is being polled on this thread.
    Outside,
    /// One is, and has not read the clock yet.
    Unread,
    /// One is, and read it at this time.
    Read(Instant),
}

thread_local! {
    static STATE: Cell<State> = const { Cell::new(State::Outside) };
}

/// The time now: the time the current [`OnePoll`]'s poll first read, when one is being
/// polled on this thread; else read from the clock. tokio's clock: paused in tests that
/// pause it.
pub fn now() -> Instant {
    STATE.with(|state| match state.get() {
        State::Read(at) => at,
        State::Outside => Instant::now(),
        State::Unread => {
            let at = Instant::now();
            state.set(State::Read(at));
            at
        }
    })
}

/// A future whose every poll reads the clock at most once through [`now`]: each poll
/// starts without a reading, and the reading is gone when the poll returns (or
/// unwinds).
pub struct OnePoll<F>(pub F);

/// Puts back the state a poll found, when it ends however it ends.
struct Restore(State);

impl Drop for Restore {
    fn drop(&mut self) {
        STATE.with(|state| state.set(self.0));
    }
}

impl<F: Future + Unpin> Future for OnePoll<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _restore = Restore(STATE.with(|state| state.replace(State::Unread)));
        Pin::new(&mut self.0).poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Polls `f` once, inside a [`OnePoll`].
    fn poll_once<T>(f: impl FnMut(&mut Context<'_>) -> Poll<T> + Unpin) -> T {
        let mut fut = OnePoll(std::future::poll_fn(f));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match Pin::new(&mut fut).poll(&mut cx) {
            Poll::Ready(t) => t,
            Poll::Pending => panic!("ready at once"),
        }
    }

    /// Lets the clock move on (its resolution is far finer).
    fn tick() {
        std::thread::sleep(Duration::from_millis(2));
    }

    #[test]
    fn one_poll_reads_the_clock_once_and_the_next_poll_reads_it_again() {
        let (a, b, fresh) = poll_once(|_| {
            let a = now();
            tick();
            Poll::Ready((a, now(), Instant::now()))
        });
        // Within the poll: its first reading, though the clock moved on.
        assert_eq!(a, b);
        assert!(fresh > a);
        // Outside any poll: read each time.
        tick();
        let outside = now();
        assert!(outside > fresh);
        tick();
        assert!(now() > outside);
        // The next poll reads it afresh.
        let c = poll_once(|_| Poll::Ready(now()));
        assert!(c > outside);
    }

    #[test]
    fn a_poll_that_panics_leaves_no_reading_behind() {
        let unwound = std::panic::catch_unwind(|| {
            poll_once(|_| -> Poll<()> {
                now();
                panic!("the handler failed");
            })
        });
        assert!(unwound.is_err());
        let a = now();
        tick();
        assert!(now() > a);
    }

    #[test]
    fn a_poll_within_a_poll_gives_the_outer_one_its_reading_back() {
        let (outer, inner, after) = poll_once(|_| {
            let outer = now();
            tick();
            let inner = poll_once(|_| Poll::Ready(now()));
            Poll::Ready((outer, inner, now()))
        });
        assert!(inner > outer);
        assert_eq!(after, outer);
    }
}
