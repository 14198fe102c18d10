//! Joins the chunks of a response body that are already there into one frame.
//!
//! An upstream body gives one chunk per frame. Forwarded frame by frame, an SSE stream
//! whose 100 chunks arrived in one read from the backend cost 100 writes to the client
//! (100 syscalls, 100 wakeups of the reader) where a plain proxy writes what it read in
//! one go. Here the chunks a body gives at once are gathered: an HTTP/1.1 body
//! ([`crate::h1`]) gives the chunks it has already read, one per poll, without waiting.
//! hyper's HTTP/2 bodies hand chunks over from their connection task through a channel,
//! one per turn of the scheduler, so after a chunk the body also gives that task
//! scheduler turns to hand over the next; the gathered bytes go out as soon as two turns
//! in a row bring nothing. A stream whose chunks are spaced in time (every real model
//! stream) is forwarded chunk by chunk as before, two scheduler turns later. The first chunk is not held at all: it usually arrives with the response head,
//! and passed on at once it leaves with the head in one write (held, the head went out
//! alone and the first event followed in a second write, two turns later).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};

/// Gathered bytes are sent once they reach this size, whatever follows.
const MAX_GATHER: usize = 64 * 1024;
/// Room a gathering starts with: half of what may be gathered. Grown from 4 KiB, a 20 KB
/// run of chunks (a 100-chunk SSE answer) was copied three more times, at 4, 8 and 16
/// KiB. The buffer lives until its frame is written; a join that fills under a quarter
/// of it is copied out instead ([`Joined::take`]).
const GATHER_ROOM: usize = MAX_GATHER / 2;
/// Scheduler turns given to the upstream connection for one gathered frame.
const MAX_TURNS: u32 = 256;
/// Turns without a new chunk before the gathered bytes go out. A hyper connection task
/// (HTTP/2 to backends) hands the next chunk over in the second turn after the last was
/// taken (measured with hyper's HTTP/1.1 client, replaced since by [`crate::h1`], whose
/// connection task worked the same way: with one turn nothing was ever gathered), so one
/// empty turn is waited for. An [`crate::h1`] body that is pending has nothing more to
/// give, so for it the turn brings nothing; it is spent for every body alike.
const PATIENCE: u32 = 1;

enum Held<E> {
    Trailers(HeaderMap),
    Err(E),
    End,
}

/// Chunks joined into one run of bytes: a lone chunk is kept as it came (no copy), a
/// second one starts a copy. Also what the usage tap keeps of a JSON body.
#[derive(Default)]
pub enum Joined {
    #[default]
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Joined {
    pub fn len(&self) -> usize {
        match self {
            Joined::Empty => 0,
            Joined::One(b) => b.len(),
            Joined::Many(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds `data`. The copy a second chunk starts gets at least `room` bytes: what the
    /// caller expects to join, as a buffer that grows is copied again each time.
    pub fn push(&mut self, data: Bytes, room: usize) {
        *self = match std::mem::take(self) {
            Joined::Empty => Joined::One(data),
            Joined::One(first) => {
                let mut buf = BytesMut::with_capacity((first.len() + data.len()).max(room));
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                Joined::Many(buf)
            }
            Joined::Many(mut buf) => {
                buf.extend_from_slice(&data);
                Joined::Many(buf)
            }
        };
    }

    /// The bytes joined so far.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Joined::Empty => &[],
            Joined::One(b) => b,
            Joined::Many(b) => b,
        }
    }

    /// The joined bytes, leaving it empty (`None` when it was). Joined bytes that fill
    /// under a quarter of their buffer are copied out: frozen, they would keep the whole
    /// room for as long as the frame waits to be written (a slow client's stream can
    /// hold a frame at a time for minutes, 32 KiB for two small events).
    pub fn take(&mut self) -> Option<Bytes> {
        match std::mem::take(self) {
            Joined::Empty => None,
            Joined::One(b) => Some(b),
            Joined::Many(b) if b.len() < b.capacity() / 4 => Some(Bytes::copy_from_slice(&b)),
            Joined::Many(b) => Some(b.freeze()),
        }
    }
}

pub struct Coalesce<B: HttpBody> {
    inner: B,
    gathered: Joined,
    /// What the inner body gave after bytes were gathered: returned after them.
    held: Option<Held<B::Error>>,
    /// A chunk arrived since the last turn given away.
    fresh: bool,
    /// Turns given away for the bytes gathered now, and how many of the last ones in a
    /// row brought nothing.
    turns: u32,
    idle: u32,
    /// The last poll returned `Pending` after waking its own task (a turn given away).
    yielded: bool,
    /// A data chunk has been passed on or gathered.
    started: bool,
}

// Nothing here is ever pinned in place: the held error is moved out, not polled.
impl<B: HttpBody + Unpin> Unpin for Coalesce<B> {}

impl<B: HttpBody> Coalesce<B> {
    pub fn new(inner: B) -> Self {
        Coalesce {
            inner,
            gathered: Joined::Empty,
            held: None,
            fresh: false,
            turns: 0,
            idle: 0,
            yielded: false,
            started: false,
        }
    }
}

impl<B> Coalesce<B>
where
    B: HttpBody<Data = Bytes>,
{
    /// The gathered bytes as one frame (`None` when nothing is gathered).
    fn flush(&mut self) -> Option<Frame<Bytes>> {
        self.fresh = false;
        self.turns = 0;
        self.idle = 0;
        self.gathered.take().map(Frame::data)
    }

    /// Returns what was gathered, keeping `held` for the next poll; or `held` itself
    /// when nothing was gathered.
    fn flush_then(&mut self, held: Held<B::Error>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if let Some(frame) = self.flush() {
            self.held = Some(held);
            return Poll::Ready(Some(Ok(frame)));
        }
        Poll::Ready(release(held))
    }
}

fn release<E>(held: Held<E>) -> Option<Result<Frame<Bytes>, E>> {
    match held {
        Held::Trailers(t) => Some(Ok(Frame::trailers(t))),
        Held::Err(e) => Some(Err(e)),
        Held::End => None,
    }
}

impl<B: HttpBody> crate::idle::Yields for Coalesce<B> {
    fn yielded(&self) -> bool {
        self.yielded
    }
}

impl<B> HttpBody for Coalesce<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        this.yielded = false;
        if let Some(held) = this.held.take() {
            return Poll::Ready(release(held));
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        // The first chunk (it goes out with the response head), or the
                        // whole body in one frame (a JSON answer): no turn to wait for.
                        let first = !std::mem::replace(&mut this.started, true);
                        if this.gathered.is_empty() && (first || this.inner.is_end_stream()) {
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        this.gathered.push(data, GATHER_ROOM);
                        this.fresh = true;
                        if this.gathered.len() >= MAX_GATHER {
                            return Poll::Ready(this.flush().map(Ok));
                        }
                    }
                    Err(frame) => {
                        let Ok(trailers) = frame.into_trailers() else {
                            // A frame is data or trailers; a kind added to http-body later
                            // would be skipped here, not passed on.
                            continue;
                        };
                        return this.flush_then(Held::Trailers(trailers));
                    }
                },
                Poll::Ready(Some(Err(e))) => return this.flush_then(Held::Err(e)),
                Poll::Ready(None) => return this.flush_then(Held::End),
                Poll::Pending => {
                    if this.gathered.is_empty() {
                        return Poll::Pending;
                    }
                    if (this.fresh || this.idle < PATIENCE) && this.turns < MAX_TURNS {
                        this.idle = if this.fresh { 0 } else { this.idle + 1 };
                        // Let the upstream connection hand over the next chunk, if it has
                        // one already; this task runs again right after.
                        this.fresh = false;
                        this.turns += 1;
                        this.yielded = true;
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    return Poll::Ready(this.flush().map(Ok));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.gathered.is_empty()
            && match &self.held {
                Some(Held::End) => true,
                Some(_) => false,
                None => self.inner.is_end_stream(),
            }
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        let extra = self.gathered.len() as u64;
        hint.set_lower(hint.lower().saturating_add(extra));
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper.saturating_add(extra));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A body scripted step by step: `Some(item)` is ready, `None` is one `Pending`.
    struct Script {
        steps: VecDeque<Option<Result<Frame<Bytes>, &'static str>>>,
        ended: bool,
        /// Reports its end as soon as its last step is taken, as a content-length body.
        eager: bool,
    }

    impl HttpBody for Script {
        type Data = Bytes;
        type Error = &'static str;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            match self.steps.pop_front() {
                Some(Some(item)) => Poll::Ready(Some(item)),
                Some(None) => Poll::Pending,
                None => {
                    self.ended = true;
                    Poll::Ready(None)
                }
            }
        }
        fn is_end_stream(&self) -> bool {
            self.ended || (self.eager && self.steps.is_empty())
        }
    }

    fn data(s: &'static str) -> Option<Result<Frame<Bytes>, &'static str>> {
        Some(Ok(Frame::data(Bytes::from_static(s.as_bytes()))))
    }

    /// Polls as a connection does, counting the self-wakes (scheduler turns given away).
    struct Waker(Arc<AtomicUsize>);
    impl std::task::Wake for Waker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn poll(
        body: &mut Coalesce<Script>,
        wakes: &Arc<AtomicUsize>,
    ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
        let waker = std::task::Waker::from(Arc::new(Waker(Arc::clone(wakes))));
        let mut cx = Context::from_waker(&waker);
        Pin::new(body).poll_frame(&mut cx)
    }

    fn text(p: Poll<Option<Result<Frame<Bytes>, &'static str>>>) -> String {
        match p {
            Poll::Ready(Some(Ok(f))) => match f.into_data() {
                Ok(d) => String::from_utf8_lossy(&d).into_owned(),
                Err(_) => "<trailers>".into(),
            },
            Poll::Ready(Some(Err(e))) => format!("<err {e}>"),
            Poll::Ready(None) => "<end>".into(),
            Poll::Pending => "<pending>".into(),
        }
    }

    /// A body whose first chunk ("0") was taken: it is passed on at once, with no turn
    /// given away, to leave with the response head.
    fn after_first(
        steps: Vec<Option<Result<Frame<Bytes>, &'static str>>>,
    ) -> (Coalesce<Script>, Arc<AtomicUsize>) {
        let mut all = VecDeque::from(vec![data("0")]);
        all.extend(steps);
        let mut body = Coalesce::new(Script {
            steps: all,
            ended: false,
            eager: false,
        });
        let wakes = Arc::new(AtomicUsize::new(0));
        assert_eq!(text(poll(&mut body, &wakes)), "0");
        assert_eq!(wakes.load(Ordering::Relaxed), 0);
        (body, wakes)
    }

    #[test]
    fn the_first_chunk_goes_out_at_once_and_the_next_ready_ones_are_joined() {
        let (mut body, wakes) = after_first(vec![data("a"), data("b"), None, None]);
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(text(poll(&mut body, &wakes)), "ab");
        assert_eq!(wakes.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn chunks_handed_over_turn_by_turn_go_out_as_one_frame() {
        // Chunks come one or two turns after the last, as from hyper's client.
        let (mut body, wakes) = after_first(vec![
            data("a"),
            None,
            data("b"),
            None,
            None,
            data("c"),
            None,
            None,
            None,
            data("d"),
        ]);
        for _ in 0..4 {
            assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        }
        assert_eq!(
            wakes.load(Ordering::Relaxed),
            4,
            "a turn given after each pending"
        );
        // Two turns after "c" bring nothing: what was gathered goes out.
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(text(poll(&mut body, &wakes)), "abc");
        assert_eq!(wakes.load(Ordering::Relaxed), 5);
        assert_eq!(text(poll(&mut body, &wakes)), "d");
        assert_eq!(text(poll(&mut body, &wakes)), "<end>");
        assert!(body.is_end_stream());
    }

    #[test]
    fn a_lone_chunk_goes_out_after_one_turn_and_idle_waits_do_not_spin() {
        let (mut body, wakes) = after_first(vec![None, data("first"), None, None, None, None]);
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(
            wakes.load(Ordering::Relaxed),
            0,
            "nothing gathered: no self-wake"
        );
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(wakes.load(Ordering::Relaxed), 2);
        assert_eq!(text(poll(&mut body, &wakes)), "first");
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(wakes.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn end_error_and_trailers_come_after_the_gathered_bytes() {
        for (last, want) in [
            (Some(Err("broken")), "<err broken>"),
            (Some(Ok(Frame::trailers(HeaderMap::new()))), "<trailers>"),
        ] {
            let (mut body, wakes) = after_first(vec![data("x"), data("y"), last]);
            assert_eq!(text(poll(&mut body, &wakes)), "xy");
            assert_eq!(text(poll(&mut body, &wakes)), want);
        }
        let (mut body, wakes) = after_first(vec![data("x"), data("y")]);
        assert_eq!(text(poll(&mut body, &wakes)), "xy");
        assert!(body.is_end_stream());
        assert_eq!(text(poll(&mut body, &wakes)), "<end>");
        assert_eq!(wakes.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_single_frame_body_passes_without_a_turn() {
        let mut body = Coalesce::new(Script {
            steps: VecDeque::from(vec![data("{\"id\":1}")]),
            ended: false,
            eager: false,
        });
        body.inner.eager = true;
        let wakes = Arc::new(AtomicUsize::new(0));
        assert_eq!(text(poll(&mut body, &wakes)), "{\"id\":1}");
        assert_eq!(text(poll(&mut body, &wakes)), "<end>");
        assert_eq!(wakes.load(Ordering::Relaxed), 0);
    }

    /// The capacity of the buffer behind `bytes` (its only owner).
    fn capacity(bytes: Bytes) -> usize {
        match bytes.try_into_mut() {
            Ok(buf) => buf.capacity(),
            Err(_) => panic!("the joined bytes are shared"),
        }
    }

    #[test]
    fn a_small_join_does_not_keep_its_room() {
        let mut small = Joined::Empty;
        small.push(Bytes::from_static(b"data: 1\n\n"), GATHER_ROOM);
        small.push(Bytes::from_static(b"data: 2\n\n"), GATHER_ROOM);
        let bytes = small.take().unwrap();
        assert_eq!(&bytes[..], b"data: 1\n\ndata: 2\n\n");
        assert!(capacity(bytes) < 1024);
        assert!(small.is_empty());

        // A join that fills the room is handed over as it is, without a copy.
        let mut large = Joined::Empty;
        large.push(Bytes::from(vec![b'a'; 10_000]), GATHER_ROOM);
        large.push(Bytes::from(vec![b'b'; 10_000]), GATHER_ROOM);
        let bytes = large.take().unwrap();
        assert_eq!(bytes.len(), 20_000);
        assert_eq!(capacity(bytes), GATHER_ROOM);
    }

    #[test]
    fn gathering_stops_at_the_size_cap() {
        let chunk: &'static str = Box::leak("z".repeat(40 * 1024).into_boxed_str());
        let (mut body, wakes) =
            after_first(vec![data(chunk), None, data(chunk), None, data(chunk)]);
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(text(poll(&mut body, &wakes)).len(), 80 * 1024);
        assert_eq!(text(poll(&mut body, &wakes)), "<pending>");
        assert_eq!(text(poll(&mut body, &wakes)).len(), 40 * 1024);
    }
}
