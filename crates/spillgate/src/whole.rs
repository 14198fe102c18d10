//! A response body that came whole with its head: nearly every non-streamed answer, as
//! backends write a short body with its head. Taken at once, it skips the layers that a
//! body read as it arrives goes through: the idle timer, the coalescing of chunks and the
//! usage tap, each polled for every frame. Its usage is read at once, and the backend's
//! connection goes back to the pool before the client is written to.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

/// What a look at a body found.
pub enum Taken<B: HttpBody> {
    /// The whole body: it has no more frames.
    Whole(Bytes),
    /// Not all there yet: the body, with the frame the look took first, if any.
    Partial(Resumed<B>),
}

/// Takes `body` whole when all of it is there now (one poll, without a waker: nothing is
/// waited for). Otherwise hands it back as it was, with any frame the poll took put back
/// in front.
pub fn take_whole<B>(mut body: B) -> Taken<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    let mut cx = Context::from_waker(Waker::noop());
    let first = match Pin::new(&mut body).poll_frame(&mut cx) {
        Poll::Pending => None,
        Poll::Ready(None) => return Taken::Whole(Bytes::new()),
        Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
            Ok(data) if body.is_end_stream() => return Taken::Whole(data),
            Ok(data) => Some(Ok(Frame::data(data))),
            Err(frame) => Some(Ok(frame)),
        },
        Poll::Ready(Some(Err(e))) => Some(Err(e)),
    };
    Taken::Partial(Resumed { first, rest: body })
}

/// A body with a frame already taken off it put back in front.
pub struct Resumed<B: HttpBody> {
    first: Option<Result<Frame<Bytes>, B::Error>>,
    rest: B,
}

impl<B: HttpBody> Resumed<B> {
    /// `body` as it is, nothing taken off it.
    pub fn new(body: B) -> Self {
        Resumed {
            first: None,
            rest: body,
        }
    }

    /// The length of the data taken off the body and not yet given back.
    fn held(&self) -> u64 {
        match &self.first {
            Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => 0,
        }
    }
}

// Nothing here is ever pinned in place: the frame held is moved out, not polled.
impl<B: HttpBody + Unpin> Unpin for Resumed<B> {}

impl<B> HttpBody for Resumed<B>
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
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(first));
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }

    /// The body's own hint, and the data held in front of it: the length a client is
    /// told (`Content-Length`) comes from here.
    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let held = self.held();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(held));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(held));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;
    use http_body_util::{BodyExt, Full, StreamBody};
    use std::convert::Infallible;

    type Frames = StreamBody<stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, String>>>>;

    fn frames(parts: &[Result<&'static str, &'static str>]) -> Frames {
        let v: Vec<_> = parts
            .iter()
            .map(|p| match p {
                Ok(d) => Ok(Frame::data(Bytes::from_static(d.as_bytes()))),
                Err(e) => Err(e.to_string()),
            })
            .collect();
        StreamBody::new(stream::iter(v))
    }

    async fn all<B>(body: B) -> Result<Vec<Bytes>, B::Error>
    where
        B: HttpBody<Data = Bytes> + Unpin,
    {
        let mut body = body;
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(d) = frame?.into_data() {
                out.push(d);
            }
        }
        Ok(out)
    }

    #[test]
    fn a_body_that_is_all_there_is_taken_whole() {
        let body: Full<Bytes> = Full::new(Bytes::from_static(b"{\"usage\":{}}"));
        match take_whole(body) {
            Taken::Whole(b) => assert_eq!(&b[..], b"{\"usage\":{}}"),
            Taken::Partial(_) => panic!("a full body is whole"),
        }
        match take_whole(http_body_util::Empty::<Bytes>::new()) {
            Taken::Whole(b) => assert!(b.is_empty()),
            Taken::Partial(_) => panic!("an empty body is whole"),
        }
    }

    #[tokio::test]
    async fn a_body_with_more_to_come_gives_every_frame_in_order() {
        // Stream bodies do not know their end until polled again: the first frame is
        // taken and must come back first.
        let Taken::Partial(body) = take_whole(frames(&[Ok("ab"), Ok("cd"), Ok("e")])) else {
            panic!("a body with more frames is not whole");
        };
        assert!(!body.is_end_stream());
        let got = all(body).await.unwrap();
        assert_eq!(got, vec!["ab", "cd", "e"]);
    }

    #[tokio::test]
    async fn an_error_first_is_given_back_first() {
        let Taken::Partial(body) = take_whole(frames(&[Err("broken"), Ok("late")])) else {
            panic!("an error is not a whole body");
        };
        assert_eq!(all(body).await.unwrap_err(), "broken");
    }

    /// Nothing on the first poll, then one frame.
    struct Later(u8);

    impl HttpBody for Later {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            self.0 += 1;
            match self.0 {
                1 => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                2 => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"later"))))),
                _ => Poll::Ready(None),
            }
        }
        fn is_end_stream(&self) -> bool {
            self.0 >= 2
        }
    }

    #[tokio::test]
    async fn a_body_not_ready_is_left_as_it_was() {
        let Taken::Partial(body) = take_whole(Later(0)) else {
            panic!("a body with nothing yet is not whole");
        };
        assert_eq!(all(body).await.unwrap(), vec!["later"]);
    }

    /// A sized body whose bytes come in two frames: the size told includes the frame
    /// held, so a client's `Content-Length` stays the body's.
    struct Sized(Vec<&'static str>);

    impl HttpBody for Sized {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.0.is_empty() {
                return Poll::Ready(None);
            }
            let d = self.0.remove(0);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(d.as_bytes())))))
        }
        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.0.iter().map(|d| d.len() as u64).sum())
        }
    }

    #[tokio::test]
    async fn the_size_of_a_resumed_body_counts_the_frame_held() {
        let Taken::Partial(body) = take_whole(Sized(vec!["hello ", "world"])) else {
            panic!("half a body is not whole");
        };
        assert_eq!(body.size_hint().exact(), Some(11));
        let mut body = body;
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"hello ");
        // The frame held is given back: what is left is the rest's own.
        assert_eq!(body.size_hint().exact(), Some(5));
        assert_eq!(all(body).await.unwrap(), vec!["world"]);
        let Taken::Whole(b) = take_whole(Sized(vec!["all"])) else {
            panic!("a body whose one frame is its end is whole");
        };
        assert_eq!(&b[..], b"all");
    }
}
