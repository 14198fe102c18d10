//! `timeouts.idle`: a response body fails when no frame has come for that long.
//!
//! A timer is armed only while the body has nothing to give (not while it only gives the
//! scheduler a turn, see [`Yields`]), and is moved only when it fires and frames came
//! since it was armed: once per idle period at most, however many chunks a stream has. (tower-http's `TimeoutBody` creates a timer on the first poll after
//! every frame and drops it when the frame arrives; on a 100-chunk stream that timer work
//! was about 5% of the gateway's instructions.)

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// The error a body ends with when it was idle too long.
#[derive(Debug)]
pub struct IdleTimedOut(Duration);

impl std::fmt::Display for IdleTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no data from the backend for {} ms (timeouts.idle)",
            self.0.as_millis()
        )
    }
}

impl std::error::Error for IdleTimedOut {}

/// A body that may return `Pending` having already woken its task (to give the
/// scheduler a turn): no timer needs arming for that, it is polled again at once.
pub trait Yields {
    fn yielded(&self) -> bool;
}

pub struct IdleTimeout<B> {
    inner: B,
    idle: Duration,
    /// When the last frame came (or the body was created).
    last: Instant,
    /// Armed while the inner body is pending; its deadline may lag behind `last + idle`.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl<B> IdleTimeout<B> {
    pub fn new(idle: Duration, inner: B) -> Self {
        IdleTimeout {
            inner,
            idle,
            last: Instant::now(),
            sleep: None,
        }
    }
}

impl<B> HttpBody for IdleTimeout<B>
where
    B: HttpBody + Yields + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = B::Data;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            this.last = Instant::now();
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        if this.inner.yielded() {
            return Poll::Pending;
        }
        let deadline = this.last + this.idle;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        loop {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if sleep.deadline() >= deadline {
                return Poll::Ready(Some(Err(Box::new(IdleTimedOut(this.idle)))));
            }
            // It fired for an earlier silence that frames have since ended: wait for the
            // rest of the current one.
            sleep.as_mut().reset(deadline);
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::BodyExt;

    /// Gives a chunk at each of `at` (offsets from its start), then ends; pending (with
    /// its own timer) in between.
    struct Timed {
        start: Instant,
        at: Vec<Duration>,
        next: usize,
        sleep: Option<Pin<Box<Sleep>>>,
    }

    impl Yields for Timed {
        fn yielded(&self) -> bool {
            false
        }
    }

    impl HttpBody for Timed {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            let this = &mut *self;
            let Some(at) = this.at.get(this.next).copied() else {
                return Poll::Ready(None);
            };
            let due = this.start + at;
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            if sleep.deadline() != due {
                sleep.as_mut().reset(due);
            }
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.next += 1;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: x\n\n")))))
        }
    }

    fn timed(secs: &[u64]) -> Timed {
        Timed {
            start: Instant::now(),
            at: secs.iter().map(|s| Duration::from_secs(*s)).collect(),
            next: 0,
            sleep: None,
        }
    }

    /// Reads the body to its end: the frames it gave and how it ended, with the time.
    async fn drain(mut body: IdleTimeout<Timed>) -> (usize, Result<(), String>, Duration) {
        let start = Instant::now();
        let mut frames = 0;
        loop {
            match body.frame().await {
                Some(Ok(_)) => frames += 1,
                Some(Err(e)) => return (frames, Err(e.to_string()), start.elapsed()),
                None => return (frames, Ok(()), start.elapsed()),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn chunks_closer_than_the_idle_time_go_through_however_long_the_stream() {
        // 12 chunks 9 s apart: 99 s in all, far past the 10 s idle time.
        let at: Vec<u64> = (0..12).map(|i| i * 9).collect();
        let (frames, end, took) =
            drain(IdleTimeout::new(Duration::from_secs(10), timed(&at))).await;
        assert_eq!((frames, end), (12, Ok(())));
        assert_eq!(took, Duration::from_secs(99));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silence_of_the_idle_time_ends_the_body_that_long_after_the_last_chunk() {
        let (frames, end, took) = drain(IdleTimeout::new(
            Duration::from_secs(10),
            timed(&[1, 7, 30]),
        ))
        .await;
        assert_eq!(frames, 2);
        assert_eq!(
            end,
            Err("no data from the backend for 10000 ms (timeouts.idle)".into())
        );
        assert_eq!(took, Duration::from_secs(17));
    }

    #[tokio::test(start_paused = true)]
    async fn behind_chunk_coalescing_the_silence_is_timed_the_same() {
        // Coalescing returns Pending while it gives the scheduler turns; the timer is
        // armed only when the stream is really silent, and still fires on time.
        let mut body = IdleTimeout::new(
            Duration::from_secs(10),
            crate::coalesce::Coalesce::new(timed(&[1, 7, 30])),
        );
        let start = Instant::now();
        let mut frames = 0;
        let end = loop {
            match body.frame().await {
                Some(Ok(_)) => frames += 1,
                Some(Err(e)) => break Err(e.to_string()),
                None => break Ok(()),
            }
        };
        assert_eq!(frames, 2);
        assert!(end.is_err());
        assert_eq!(start.elapsed(), Duration::from_secs(17));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_silent_from_the_start_ends_after_the_idle_time() {
        let (frames, end, took) =
            drain(IdleTimeout::new(Duration::from_secs(5), timed(&[60]))).await;
        assert_eq!(frames, 0);
        assert!(end.is_err());
        assert_eq!(took, Duration::from_secs(5));
    }
}
