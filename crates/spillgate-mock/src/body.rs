//! Response bodies: a plain buffered body, and an SSE body that paces its
//! chunks, can break the connection on purpose, and counts whether the client
//! read it to the end or went away early.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::openai::ChunkFrames;
use crate::state::{bump, Shared};

/// Body of every response the mock sends.
pub(crate) enum MockBody {
    Full(Option<Bytes>),
    Sse(Box<SseBody>),
}

impl MockBody {
    pub fn full(bytes: impl Into<Bytes>) -> MockBody {
        MockBody::Full(Some(bytes.into()))
    }
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.get_mut() {
            MockBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            MockBody::Sse(sse) => sse.poll_next(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            MockBody::Full(bytes) => bytes.is_none(),
            // The SSE body must be polled to its end so that completion is counted.
            MockBody::Sse(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            MockBody::Full(Some(bytes)) => {
                SizeHint::with_exact(u64::try_from(bytes.len()).unwrap_or(u64::MAX))
            }
            MockBody::Full(None) => SizeHint::with_exact(0),
            MockBody::Sse(_) => SizeHint::default(),
        }
    }
}

/// Everything an SSE stream needs, fixed when the response starts.
pub(crate) struct SsePlan {
    /// The per-stream parts of every frame (id, model, ...).
    pub frames: ChunkFrames,
    pub chunks: usize,
    pub interval: Duration,
    pub break_after: Option<usize>,
    pub include_usage: bool,
    pub done: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Next is content chunk `n`.
    Chunk(usize),
    Usage,
    Done,
    /// About to abort the connection (after one more poll, see `poll_next`).
    Break,
    Finished,
}

pub(crate) struct SseBody {
    plan: SsePlan,
    phase: Phase,
    /// Pacing timer between chunks; reused so that a stream allocates it once.
    sleep: Option<Pin<Box<Sleep>>>,
    /// Whether the pause before the next frame has already elapsed.
    paused: bool,
    /// Whether `sleep` is set to the deadline of the current pause.
    armed: bool,
    shared: Arc<Shared>,
    /// The stream ended by design (fully written or deliberately broken), so
    /// dropping it is not a client cancellation.
    ended: bool,
}

impl SseBody {
    pub fn new(plan: SsePlan, shared: Arc<Shared>) -> SseBody {
        let phase = first_phase(&plan, 0);
        SseBody {
            plan,
            phase,
            sleep: None,
            paused: true,
            armed: false,
            shared,
            ended: false,
        }
    }

    /// Wait `interval` unless already waited; `Pending` while waiting.
    fn pause(&mut self, cx: &mut Context<'_>, interval: Duration) -> Poll<()> {
        if self.paused || interval.is_zero() {
            return Poll::Ready(());
        }
        if !self.armed {
            let deadline = Instant::now() + interval;
            match &mut self.sleep {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            self.armed = true;
        }
        if let Some(sleep) = &mut self.sleep {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        self.paused = true;
        self.armed = false;
        Poll::Ready(())
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let frame = match self.phase {
            Phase::Chunk(i) => {
                if self.pause(cx, self.plan.interval).is_pending() {
                    return Poll::Pending;
                }
                let last = i + 1 == self.plan.chunks;
                let frame = self.plan.frames.content(&self.shared.greeting, i, last);
                self.advance(first_phase(&self.plan, i + 1));
                frame
            }
            Phase::Usage => {
                let frame = self.plan.frames.usage(self.plan.chunks);
                self.phase = if self.plan.done {
                    Phase::Done
                } else {
                    Phase::Finished
                };
                frame
            }
            Phase::Done => {
                self.phase = Phase::Finished;
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                    b"data: [DONE]\n\n",
                )))));
            }
            Phase::Break => {
                // Give the connection one turn to flush the chunks already
                // written before the error makes it drop the connection;
                // otherwise the client might not see the promised `k` chunks.
                let interval = self.plan.interval.max(Duration::from_millis(1));
                if self.pause(cx, interval).is_pending() {
                    return Poll::Pending;
                }
                self.ended = true;
                self.phase = Phase::Finished;
                return Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "mock stream broken on purpose",
                ))));
            }
            Phase::Finished => {
                if !self.ended {
                    self.ended = true;
                    bump(&self.shared.counters.streams_completed);
                }
                return Poll::Ready(None);
            }
        };
        // Serializing the frame's plain structs into a `Vec` cannot fail;
        // should it ever, the stream ends with an error, like a broken one.
        Poll::Ready(Some(frame.map(Frame::data).map_err(io::Error::other)))
    }

    fn advance(&mut self, phase: Phase) {
        self.phase = phase;
        // Every chunk after the first, and the break, come after a pause.
        self.paused = false;
        self.armed = false;
    }
}

/// What follows once `sent` content chunks have been sent. A stream with
/// `break_after` always breaks, at the latest after its last content chunk.
fn first_phase(plan: &SsePlan, sent: usize) -> Phase {
    if plan.break_after.is_some_and(|k| sent >= k.min(plan.chunks)) {
        return Phase::Break;
    }
    if sent < plan.chunks {
        Phase::Chunk(sent)
    } else if plan.include_usage {
        Phase::Usage
    } else if plan.done {
        Phase::Done
    } else {
        Phase::Finished
    }
}

impl Drop for SseBody {
    fn drop(&mut self) {
        if !self.ended {
            bump(&self.shared.counters.streams_cancelled);
        }
    }
}
