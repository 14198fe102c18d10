//! HTTP/1.1 to backends, for the one exchange the gateway makes: a request whose body is
//! already in memory, then a response whose body is passed on as it comes.
//!
//! hyper's client connection runs as a task of its own behind two channels (requests in,
//! body chunks out): every request and every streamed chunk went from one task to the
//! other and woke it, and each connection held a channel block of about 9 KiB and a
//! header buffer of 8 KiB. Here the request's future writes the request and reads the
//! response head on the socket itself, and the response body reads the socket when the
//! client's connection asks for more: no task, no channel. The read buffer is shared by
//! the chunks cut from it; an empty one is let go of before a read (see [`poll_fill`]),
//! so a connection waiting between two events holds none.
//!
//! A response head is kept as it came ([`RawHeaders`]: its bytes and where each header
//! lies in them): the proxy reads what it needs from it and relays the lines to the
//! client, with no header map in between.
//!
//! The client side ([`crate::front`]) reads heads and decodes request bodies with the
//! same pieces: [`poll_fill`], [`HeadSpans`], [`decode`] and [`Framing`],
//! [`content_length`], and the `Connection` token checks.
//!
//! What it does not do, because the gateway never needs it: send a streamed request
//! body, pipeline, or upgrade. A request is sent again elsewhere only when not a byte of
//! it was written (see [`SendError`]).

use std::future::{poll_fn, Future};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use http_body::{Frame, SizeHint};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::upstream::UpstreamRequest;

/// Most header lines a response head may have.
const MAX_HEADERS: usize = 128;
/// Largest response head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// Room for a read into an empty buffer (on the stack, see [`poll_fill`]), and for a new
/// buffer when one runs low. A chat answer's head and body fit; a larger body doubles it
/// read by read.
pub(crate) const READ_ROOM: usize = 4 * 1024;
/// Largest room taken for one read, reached while reads fill what they are given.
const MAX_READ_ROOM: usize = 64 * 1024;
/// Below this much room, a new read buffer is taken before reading.
const MIN_ROOM: usize = 1024;
/// Longest chunk-size line, and most bytes of trailers, of a chunked body.
const MAX_CHUNK_LINE: usize = 4 * 1024;
const MAX_TRAILERS: usize = 16 * 1024;

/// A byte stream to a backend: TCP, or TLS over TCP.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {
    /// Whether the stream, idle between exchanges, has ended or failed, or has bytes
    /// waiting (a backend's answer to no request): either way it cannot carry a
    /// request. Tried once, nothing waited for: a read into a few bytes on the stack.
    fn closed_while_idle(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        let mut probe = [0u8; 8];
        let mut probe = tokio::io::ReadBuf::new(&mut probe);
        Pin::new(self).poll_read(&mut cx, &mut probe).is_ready()
    }
}

/// Plain TCP: a read is tried only when the socket was last seen readable, and the
/// stream is not made to wake a task (`poll_read` with a waker that does nothing took
/// the registration's lock and swapped its waker twice, for this check and the next
/// read: about 160 instructions of a JSON request, callgrind).
impl Io for tokio::net::TcpStream {
    fn closed_while_idle(&mut self) -> bool {
        let mut probe = [0u8; 8];
        !matches!(self.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for tokio_rustls::client::TlsStream<T> {}

#[cfg(test)]
impl Io for tokio::io::DuplexStream {}

/// Why an exchange failed. Never carries a header value, so no credential can be in it.
#[derive(Debug, Clone)]
pub struct Error(String);

impl Error {
    pub fn new(what: impl Into<String>) -> Error {
        Error(what.into())
    }
    fn io(what: &str, e: &std::io::Error) -> Error {
        Error(format!("{what}: {e}"))
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// Why [`Conn::send`] got no response.
#[derive(Debug)]
pub enum SendError {
    /// The first write failed: the request may go on another connection. Over plain TCP
    /// not a byte went; over TLS at most part of the first records, never a request the
    /// backend could act on.
    Unsent(Error),
    /// Failed once (some of) the request may have been written: not to be sent again.
    Failed(Error),
    /// No response head by the exchange's deadline.
    TimedOut,
}

/// An HTTP/1.1 connection to a backend, idle between exchanges.
pub struct Conn {
    io: Box<dyn Io>,
    /// Bytes read and not yet used; empty between exchanges.
    buf: BytesMut,
    /// Room the next new read buffer gets.
    room: usize,
    /// The request head being written (kept for the next request).
    head: Vec<u8>,
    /// `Host` for the requests that have none: the backend's, built once per connection.
    host: Option<HeaderValue>,
    /// The exchanges' deadline timer, see [`expired`].
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Conn {
    pub fn new(io: Box<dyn Io>, host: Option<HeaderValue>) -> Conn {
        Conn {
            io,
            buf: BytesMut::new(),
            room: READ_ROOM,
            head: Vec::new(),
            host,
            timer: None,
        }
    }

    /// Whether an idle connection is gone: closed by the backend (or in error), or with
    /// bytes nobody asked for. Reads only what the runtime already knows is there, with
    /// no waker kept: a connection closed since it was last polled shows here.
    pub fn is_closed(&mut self) -> bool {
        self.io.closed_while_idle()
    }

    /// Reads what is there into the buffer (a new buffer when less than [`MIN_ROOM`] is
    /// left); `Ok(0)` at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        poll_fill(&mut self.io, &mut self.buf, &mut self.room, cx)
    }

    /// Sends `req` (in origin form, with the connection's `Host`) and reads the response
    /// head, unless `deadline` comes first ([`SendError::TimedOut`]). The connection
    /// then belongs to the response body, which gives it to `release` at its end if it
    /// can carry another request.
    ///
    /// An `async` block rather than an `async fn`: the future holds the connection and
    /// `release` once, where an `async fn` kept its arguments and their moved copies
    /// both (184 bytes more in every request's upstream future).
    #[allow(clippy::manual_async_fn)]
    pub fn send<'a, 'r, R: Release>(
        mut self,
        req: &'a UpstreamRequest<'r>,
        release: R,
        deadline: tokio::time::Instant,
    ) -> impl Future<Output = Result<Response<R>, SendError>> + use<'a, 'r, R> {
        async move {
            let body = req.body();
            self.head.clear();
            encode_head(&mut self.head, req, self.host.as_ref(), body.len());
            // Out of the connection while it is written and read, put back with it.
            let mut timer = self.timer.take();
            let wrote = match self.write(body, &mut timer, deadline).await {
                Ok(wrote) => wrote,
                Err(None) => return Err(SendError::TimedOut),
                Err(Some((written, e))) => {
                    let e = Error::io("writing the request", &e);
                    return Err(if written == 0 {
                        SendError::Unsent(e)
                    } else {
                        SendError::Failed(e)
                    });
                }
            };
            let is_head = req.method() == Method::HEAD;
            let head = loop {
                if let Some(head) = parse_head(&mut self.buf).map_err(SendError::Failed)? {
                    // 1xx (100 Continue, 103 Early Hints): the real answer follows.
                    if interim(head.status.as_u16()) {
                        continue;
                    }
                    break head;
                }
                if self.buf.len() >= MAX_HEAD {
                    return Err(SendError::Failed(Error::new(format!(
                        "response head over {} KiB",
                        MAX_HEAD / 1024
                    ))));
                }
                let n = poll_fn(|cx| match self.poll_fill(cx) {
                    Poll::Ready(read) => Poll::Ready(Some(read)),
                    Poll::Pending => expired(&mut timer, deadline, cx).map(|()| None),
                })
                .await
                .ok_or(SendError::TimedOut)?
                .map_err(|e| SendError::Failed(Error::io("reading the response", &e)))?;
                if n == 0 {
                    return Err(SendError::Failed(Error::new(if self.buf.is_empty() {
                        "the backend closed the connection before answering"
                    } else {
                        "the backend closed the connection in the middle of the response head"
                    })));
                }
            };
            if head.status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(SendError::Failed(Error::new(
                    "the backend switched protocols, which the gateway never asks for",
                )));
            }
            let mut headers = head.headers;
            let (framing, keep_alive) = framing(is_head, head.status, head.version, &mut headers)
                .map_err(SendError::Failed)?;
            // Answered before taking the whole request: the rest of it is not sent, so the
            // connection cannot carry another.
            let reusable = keep_alive && wrote == Wrote::All;
            self.timer = timer;
            let mut body = Body {
                conn: Some(self),
                framing,
                release: reusable.then_some(release),
            };
            body.settle();
            Ok(Response {
                status: head.status,
                headers,
                body,
            })
        }
    }

    /// Writes the head and then `body`, unless the backend refuses it first (a request too
    /// large, say, answered with an error without being read); on failure, how many bytes
    /// went, and `None` when `deadline` came first.
    async fn write(
        &mut self,
        body: &[u8],
        timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
        deadline: tokio::time::Instant,
    ) -> Result<Wrote, Option<(usize, std::io::Error)>> {
        let total = self.head.len() + body.len();
        let mut written = 0;
        poll_fn(|cx| loop {
            // The error the write or the flush failed with; `None` while it waits.
            let failed = if written == total {
                // Over TLS, everything may be taken and still wait here to reach the socket.
                match Pin::new(&mut self.io).poll_flush(cx) {
                    Poll::Ready(Ok(())) => return Poll::Ready(Ok(Wrote::All)),
                    Poll::Ready(Err(e)) => Some(e),
                    Poll::Pending => None,
                }
            } else {
                let from_head = self.head.get(written..).unwrap_or_default();
                let from_body = body
                    .get(written.saturating_sub(self.head.len())..)
                    .unwrap_or_default();
                let bufs = [IoSlice::new(from_head), IoSlice::new(from_body)];
                match Pin::new(&mut self.io).poll_write_vectored(cx, &bufs) {
                    Poll::Ready(Ok(0)) => Some(std::io::ErrorKind::WriteZero.into()),
                    Poll::Ready(Ok(n)) => {
                        written += n;
                        continue;
                    }
                    Poll::Ready(Err(e)) => Some(e),
                    Poll::Pending => None,
                }
            };
            return match failed {
                // Failed: the backend may have answered, then closed. Any answer is the
                // response.
                Some(_) if written > 0 && self.answered(cx, Answer::Any) => {
                    Poll::Ready(Ok(Wrote::Answered))
                }
                Some(e) => Poll::Ready(Err(Some((written, e)))),
                // Not taking more: it may have refused the request already (the read is
                // polled too, so an answer wakes this). A success sent early is not: the
                // backend reads the rest.
                None if self.answered(cx, Answer::Refusal) => Poll::Ready(Ok(Wrote::Answered)),
                None => expired(timer, deadline, cx).map(|()| Err(None)),
            };
        })
        .await
    }

    /// Reads what the backend sent and says whether a complete final response head of
    /// the `wanted` kind is there; registers `cx` for more when not.
    fn answered(&mut self, cx: &mut Context<'_>, wanted: Answer) -> bool {
        loop {
            match self.poll_fill(cx) {
                Poll::Ready(Ok(n)) if n > 0 && self.buf.len() < MAX_HEAD => {
                    if final_head_in(&self.buf, wanted) {
                        return true;
                    }
                }
                _ => return final_head_in(&self.buf, wanted),
            }
        }
    }
}

/// Whether `deadline` has come, by a connection's timer (made at its first wait; see
/// [`poll_deadline`]). One timer for the connection's life: a timer of its own for each
/// exchange was put into the runtime's timer wheel and taken out again: 354 instructions
/// to poll it the first time and 123 to drop it, in a JSON request (callgrind). Nor is
/// it moved to each exchange's deadline (about 120 more).
///
/// A timer left running between exchanges (the connection idle in its pool, or read by
/// a response body) may go off and wake the task that last waited on it: a wake for
/// nothing, which costs that task a poll, once a timeout at most.
fn expired(
    timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    deadline: tokio::time::Instant,
    cx: &mut Context<'_>,
) -> Poll<()> {
    let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
    poll_deadline(timer.as_mut(), deadline, cx)
}

/// Whether `deadline` has come, by `timer`, kept for waits one after another with later
/// and later deadlines (a connection's exchanges here, a client connection's heads in
/// [`crate::front`]); registers `cx` to be woken when not. A timer set before `deadline`
/// is left where it is, and moved on when it goes off early: moving it for each wait
/// cost about 120 instructions, where this is once a timeout at most. Only a deadline
/// nearer than the timer's moves it at once.
pub(crate) fn poll_deadline(
    mut timer: Pin<&mut tokio::time::Sleep>,
    deadline: tokio::time::Instant,
    cx: &mut Context<'_>,
) -> Poll<()> {
    if timer.deadline() > deadline {
        timer.as_mut().reset(deadline);
    }
    loop {
        std::task::ready!(timer.as_mut().poll(cx));
        if timer.deadline() >= deadline {
            return Poll::Ready(());
        }
        timer.as_mut().reset(deadline);
    }
}

/// Reads what `io` has into `buf` (a new buffer of `room` bytes when less than
/// [`MIN_ROOM`] is left; `room` doubles, up to a limit, while reads fill it); `Ok(0)` at
/// the end of the stream.
///
/// An empty `buf` is let go of and the read goes to the stack first: a connection that
/// waits for its next bytes (a stream between two events, an idle client) holds no
/// buffer, and what arrives is copied into one of its size. (A 4 KiB buffer kept per
/// connection was 20 MB at 5,000 open streams.)
pub(crate) fn poll_fill<R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
    room: &mut usize,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<usize>> {
    if buf.is_empty() {
        *buf = BytesMut::new();
        let mut probe = [MaybeUninit::<u8>::uninit(); READ_ROOM];
        let mut probe = tokio::io::ReadBuf::uninit(&mut probe);
        std::task::ready!(Pin::new(io).poll_read(cx, &mut probe))?;
        let got = probe.filled();
        let n = got.len();
        if n < READ_ROOM {
            *buf = BytesMut::from(got);
        } else {
            // A full probe: more is likely waiting, and gets the room reads have been given.
            buf.reserve(got.len() + *room);
            buf.extend_from_slice(got);
            if *room < MAX_READ_ROOM {
                *room *= 2;
            }
        }
        return Poll::Ready(Ok(n));
    }
    if buf.capacity() - buf.len() < MIN_ROOM {
        buf.reserve(*room);
    }
    let space = buf.capacity() - buf.len();
    let n = std::task::ready!(tokio_util::io::poll_read_buf(Pin::new(io), cx, buf))?;
    if n >= space && *room < MAX_READ_ROOM {
        *room *= 2;
    }
    Poll::Ready(Ok(n))
}

/// How writing a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wrote {
    All,
    /// The backend answered before taking it all.
    Answered,
}

/// Which early answers end the writing of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// An error status (400 and up): the backend does not want the rest.
    Refusal,
    /// Any final status (the backend stopped reading).
    Any,
}

/// Whether `buf` starts with a complete final (not 1xx) response head of the `wanted`
/// kind, after any informational ones; also true for a head that cannot be parsed, for
/// the read that follows to report.
fn final_head_in(buf: &[u8], wanted: Answer) -> bool {
    let mut at = 0;
    loop {
        let mut parsed = [const { MaybeUninit::uninit() }; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut []);
        match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut resp,
            buf.get(at..).unwrap_or_default(),
            &mut parsed,
        ) {
            Ok(httparse::Status::Complete(len)) => match resp.code {
                Some(code) if interim(code) => at += len,
                Some(code) => return wanted == Answer::Any || code >= 400,
                None => return true,
            },
            Ok(httparse::Status::Partial) => return false,
            Err(_) => return true,
        }
    }
}

/// An informational status the final answer follows (100 Continue, 103 Early Hints),
/// unlike 101, which switches protocols.
fn interim(code: u16) -> bool {
    (100..200).contains(&code) && code != 101
}

/// The request line and headers. `Content-Length` is the body's (any the request had, and
/// any `Transfer-Encoding`, are left out); a `GET` or `HEAD` without a body has none.
/// `Host` is the connection's (`host`), never the request's (the client's).
fn encode_head(
    out: &mut Vec<u8>,
    req: &UpstreamRequest<'_>,
    host: Option<&HeaderValue>,
    body_len: usize,
) {
    out.extend_from_slice(req.method().as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(req.path_and_query().as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(host) = host {
        header_line(out, &header::HOST, host);
    }
    req.each_header(|name, value| raw_line(out, name, value));
    if body_len > 0 || !matches!(*req.method(), Method::GET | Method::HEAD) {
        length_line(out, body_len as u64);
    }
    out.extend_from_slice(b"\r\n");
}

/// A header line of a head being written.
pub(crate) fn header_line(out: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue) {
    raw_line(out, name.as_str().as_bytes(), value.as_bytes());
}

/// A header line of a head being written, from a name and a value already checked.
#[inline]
pub(crate) fn raw_line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// The `content-length` line of a head being written.
pub(crate) fn length_line(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

struct Head {
    status: StatusCode,
    version: Version,
    headers: RawHeaders,
}

/// A backend's response: its status, its headers as they came, and its body.
pub struct Response<R> {
    pub status: StatusCode,
    pub headers: RawHeaders,
    pub body: Body<R>,
}

/// Takes a complete response head off the front of `buf`, or leaves `buf` as it is and
/// returns `None` when the head is not all there yet. Header values share the head's
/// bytes (no copy).
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Error> {
    if buf.is_empty() {
        return Ok(None);
    }
    // Left uninitialised for httparse to fill: a 4 KiB array zeroed per response cost
    // more than parsing a short head.
    let mut parsed = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut parsed,
    ) {
        // One read may have brought more than the limit at once.
        Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD => len,
        Ok(httparse::Status::Complete(_)) => {
            return Err(Error::new(format!(
                "response head over {} KiB",
                MAX_HEAD / 1024
            )))
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Error::new(format!(
                "response head with more than {MAX_HEADERS} headers"
            )))
        }
        Err(e) => return Err(Error::new(format!("invalid response head: {e}"))),
    };
    let status = resp
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or_else(|| Error::new("invalid response status"))?;
    let version = version(resp.version);
    let mut spans = HeadSpans::new();
    spans.record(buf, resp.headers);
    let headers = spans.take_raw(buf, len);
    Ok(Some(Head {
        status,
        version,
        headers,
    }))
}

/// The version httparse read (`1` for HTTP/1.1, `0` for HTTP/1.0).
pub(crate) fn version(minor: Option<u8>) -> Version {
    match minor {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    }
}

/// Heads with at most this many headers keep their spans on the stack.
const SMALL_HEAD: usize = 64;

/// Where each header of a parsed head lies in it, recorded while httparse's slices borrow
/// the buffer, so that the head can be taken off the buffer afterwards and its values cut
/// from it. On the stack for a head of up to [`SMALL_HEAD`] headers. The room is not
/// written before it is filled: an array of spans set to zero first was a 1 KiB
/// `memset` for each head, about 150 instructions a proxied request (callgrind).
pub(crate) struct HeadSpans {
    spans: SmallVec<[Span; SMALL_HEAD]>,
}

impl HeadSpans {
    /// No spans yet. Filled in place by [`HeadSpans::record`]: returned by value after
    /// recording, the 1 KiB array was copied once more per head.
    #[inline]
    pub(crate) fn new() -> HeadSpans {
        HeadSpans {
            spans: SmallVec::new(),
        }
    }

    /// Records where each of `parsed` (slices of `head`) lies in it.
    pub(crate) fn record(&mut self, head: &[u8], parsed: &[httparse::Header<'_>]) {
        let span = |h: &httparse::Header<'_>| Span {
            name: Part::of(head, h.name.as_bytes()),
            value: Part::of(head, h.value),
        };
        self.spans.clear();
        self.spans.extend(parsed.iter().map(span));
    }

    /// The spans recorded.
    fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Takes the head, its first `len` bytes, off `buf`, its headers as they came. Their
    /// names and values are the ones httparse accepted, the same bytes `HeaderName` and
    /// `HeaderValue` accept (a token; visible ASCII, spaces, tabs and obs-text), and the
    /// head is within [`MAX_HEAD`], so no name is over `HeaderName`'s 64 KiB: checking
    /// them again is left to [`RawHeaders::to_map`].
    pub(crate) fn take_raw(&self, buf: &mut BytesMut, len: usize) -> RawHeaders {
        let head = buf.split_to(len).freeze();
        let mut seen = Seen::default();
        let mut fields = spare_fields();
        fields.extend(self.spans().iter().map(|span| {
            let name = head.get(span.name.range()).unwrap_or_default();
            let common = common_index(name);
            if let Some(i) = common {
                seen.note(i, head.get(span.value.range()).unwrap_or_default());
            }
            Field {
                span: *span,
                common: common.map_or(NO_NAME, |i| i as u8),
            }
        }));
        RawHeaders {
            head,
            fields,
            seen,
            stray_length: false,
        }
    }
}

/// A header of a [`RawHeaders`]: where it lies, and which of [`COMMON_NAMES`] its name
/// is ([`NO_NAME`] for none).
#[derive(Debug, Clone, Copy)]
struct Field {
    span: Span,
    common: u8,
}

/// A head's headers as they came: the head's bytes and where each header lies in them,
/// each name looked up once in [`COMMON_NAMES`]. The proxy relays a backend's to the
/// client line by line (`proxy::Relay`): built into a `HeaderMap`, filtered in it,
/// written out of it and dropped, they cost about 4,000 instructions a JSON response
/// (callgrind), for headers nearly all of which pass through as they are. A client's
/// go upstream the same way (`proxy::Forwarded`).
pub struct RawHeaders {
    head: Bytes,
    fields: Vec<Field>,
    seen: Seen,
    /// A `Content-Length` beside a `Transfer-Encoding`, in an answer with a body: not
    /// the body's length (see [`framing`]), and not passed on.
    stray_length: bool,
}

impl RawHeaders {
    /// Each header in order: where its name is in [`COMMON_NAMES`], its name as it came
    /// (in its own case), its value.
    pub(crate) fn fields(&self) -> impl Iterator<Item = (Option<usize>, &[u8], &[u8])> {
        self.fields.iter().map(|f| {
            (
                (f.common != NO_NAME).then_some(usize::from(f.common)),
                self.head.get(f.span.name.range()).unwrap_or_default(),
                self.head.get(f.span.value.range()).unwrap_or_default(),
            )
        })
    }

    /// The head's bytes, its start line included when it was read with one.
    pub(crate) fn head(&self) -> &[u8] {
        &self.head
    }

    /// Which framing headers there are.
    pub(crate) fn seen(&self) -> Seen {
        self.seen
    }

    /// The first value of the header named `name`, whatever its case.
    pub fn get<'a>(&'a self, name: &'a HeaderName) -> Option<&'a [u8]> {
        self.values(name).next()
    }

    /// The first value of the header of the common name `name`, as a `HeaderValue`
    /// that shares the head's bytes.
    pub fn value(&self, name: &Common) -> Option<HeaderValue> {
        self.share(self.first(name)?).ok()
    }

    /// `value`, one of its values, as a `HeaderValue` that shares the head's bytes (a
    /// copy of them, were it not one of its values).
    pub(crate) fn share(
        &self,
        value: &[u8],
    ) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
        let start = (value.as_ptr() as usize).wrapping_sub(self.head.as_ptr() as usize);
        if start <= self.head.len() && value.len() <= self.head.len() - start {
            HeaderValue::from_maybe_shared(self.head.slice(start..start + value.len()))
        } else {
            HeaderValue::from_bytes(value)
        }
    }

    /// Marks its `Content-Length` as not the body's (it stands beside a
    /// `Transfer-Encoding`): left out of [`RawHeaders::to_map`] and
    /// [`RawHeaders::declared_length`].
    pub(crate) fn set_stray_length(&mut self) {
        self.stray_length = self.seen.content_length;
    }

    /// The body length its `Content-Length` gives (to a HEAD request, the length a GET
    /// would get): none when it is not the body's ([`framing`]), nor when it is
    /// malformed or conflicting.
    pub(crate) fn declared_length(&self) -> Option<u64> {
        if self.stray_length {
            return None;
        }
        self.seen.content_length(self).ok().flatten()
    }

    /// `map`'s headers, as a head that held them would give them (for requests made
    /// as an `http::Request`: tests, and callers other than the listener). A header
    /// such a head could not hold is left out, which none of a map is: a map's names
    /// and values are the bytes a head's may be. As in a head, a value's leading and
    /// trailing spaces and tabs are not part of it.
    pub fn from_map(map: &HeaderMap) -> RawHeaders {
        let mut lines = Vec::new();
        for (name, value) in map {
            header_line(&mut lines, name, value);
        }
        lines.extend_from_slice(b"\r\n");
        RawHeaders::parse(&lines).unwrap_or_else(|| RawHeaders {
            head: Bytes::new(),
            fields: Vec::new(),
            seen: Seen::default(),
            stray_length: false,
        })
    }

    /// The headers of `lines` (a head without its start line, its empty line
    /// included); `None` when they are not a complete head.
    fn parse(lines: &[u8]) -> Option<RawHeaders> {
        let most = lines.iter().filter(|&&b| b == b'\n').count();
        let mut parsed = vec![httparse::EMPTY_HEADER; most];
        let Ok(httparse::Status::Complete((len, parsed))) =
            httparse::parse_headers(lines, &mut parsed)
        else {
            return None;
        };
        let mut spans = HeadSpans::new();
        spans.record(lines, parsed);
        Some(spans.take_raw(&mut BytesMut::from(lines), len))
    }

    /// The number of headers.
    pub fn len(&self) -> usize {
        self.fields.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// The headers as a map, their values sharing the head's bytes; a `Content-Length`
    /// that is not the body's is left out. A header the map would refuse is left out
    /// too, which none that httparse read within the head's limit is (see
    /// [`HeadSpans::take_raw`]).
    pub fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.fields.len());
        for f in &self.fields {
            if self.stray_length && usize::from(f.common) == CONTENT_LENGTH {
                continue;
            }
            let name = match f.common {
                NO_NAME => {
                    let bytes = self.head.get(f.span.name.range()).unwrap_or_default();
                    match HeaderName::from_bytes(bytes) {
                        Ok(n) => n,
                        Err(_) => continue,
                    }
                }
                i => COMMON_NAMES[usize::from(i)].clone(),
            };
            if let Ok(value) = HeaderValue::from_maybe_shared(self.head.slice(f.span.value.range()))
            {
                map.append(name, value);
            }
        }
        map
    }
}

impl Drop for RawHeaders {
    /// The list of where each header lies goes back to the thread's spares.
    fn drop(&mut self) {
        recycle_fields(std::mem::take(&mut self.fields));
    }
}

/// Most lists of header places kept for reuse by a thread, and the largest kept (in
/// headers).
const SPARE_LISTS: usize = 16;
const SPARE_CAPACITY: usize = 64;

thread_local! {
    /// Emptied lists of where a head's headers lay, for the next heads this thread
    /// reads (requests and responses): each new list cost an allocation and its free.
    /// Connections stay on their thread, so lists come back where they are taken.
    static SPARE_FIELDS: std::cell::RefCell<Vec<Vec<Field>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty list: a spare one when this thread has one.
fn spare_fields() -> Vec<Field> {
    // `try_with`: no spare (rather than a panic) while the thread's locals are destroyed.
    SPARE_FIELDS
        .try_with(|spare| spare.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Empties `fields` and keeps it for this thread's next head, when it is neither
/// unallocated nor too large and the thread has not enough spares already; else drops
/// it.
fn recycle_fields(mut fields: Vec<Field>) {
    let capacity = fields.capacity();
    if capacity == 0 || capacity > SPARE_CAPACITY {
        return;
    }
    fields.clear();
    let _ = SPARE_FIELDS.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        if spare.len() < SPARE_LISTS {
            spare.push(fields);
        }
    });
}

/// The headers of `lines` (a head without its start line) as [`HeadSpans::take_raw`]
/// keeps them.
#[cfg(test)]
pub(crate) fn raw_headers(lines: &[u8]) -> RawHeaders {
    RawHeaders::parse(lines).expect("a complete head")
}

/// Header values by name: a map's, or a head's as it came.
pub trait Values {
    /// The values of the headers named `name`, in order.
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl DoubleEndedIterator<Item = &'a [u8]>;

    /// The first value of the header of the common name `name`.
    fn first<'a>(&'a self, name: &'a Common) -> Option<&'a [u8]> {
        self.values(&name.name).next()
    }
}

/// One of [`COMMON_NAMES`] and where it is among them: a head's headers of that name
/// are found by the place each header's name was given when the head was read, with
/// neither a hash of the name nor a comparison of bytes (a lookup by `HeaderName` was
/// about 150 instructions).
pub struct Common {
    name: HeaderName,
    at: u8,
}

impl Common {
    /// `name`, which must be one of [`COMMON_NAMES`] (refused at compile time when
    /// made in a constant or a static).
    pub const fn new(name: &'static str) -> Common {
        let at = common_at(name);
        assert!(at < COMMON_NAME_TEXTS.len());
        Common {
            name: HeaderName::from_static(name),
            at: at as u8,
        }
    }
}

impl Values for HeaderMap {
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl DoubleEndedIterator<Item = &'a [u8]> {
        self.get_all(name).into_iter().map(HeaderValue::as_bytes)
    }
}

impl Values for RawHeaders {
    fn first<'a>(&'a self, name: &'a Common) -> Option<&'a [u8]> {
        let f = self.fields.iter().find(|f| f.common == name.at)?;
        self.head.get(f.span.value.range())
    }

    /// A common name is found by its place in [`COMMON_NAMES`], noted for each header
    /// when the head was read; any other by its bytes, among the headers of no common
    /// name.
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl DoubleEndedIterator<Item = &'a [u8]> {
        let lower = name.as_str().as_bytes();
        let common = common_index(lower).map_or(NO_NAME, |i| i as u8);
        self.fields.iter().filter_map(move |f| {
            let found = if common == NO_NAME {
                f.common == NO_NAME
                    && same_ignoring_case(
                        self.head.get(f.span.name.range()).unwrap_or_default(),
                        lower,
                    )
            } else {
                f.common == common
            };
            found.then(|| self.head.get(f.span.value.range()).unwrap_or_default())
        })
    }
}

/// Where a part of a head lies in it: offset and length. Heads are far shorter than
/// 4 GiB (their limits are at most 1 MiB).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Part(u32, u32);

impl Part {
    /// Where `part`, a slice of `head`, lies in it.
    pub(crate) fn of(head: &[u8], part: &[u8]) -> Part {
        Part(
            (part.as_ptr() as usize - head.as_ptr() as usize) as u32,
            part.len() as u32,
        )
    }

    pub(crate) fn range(self) -> std::ops::Range<usize> {
        self.0 as usize..(self.0 + self.1) as usize
    }
}

/// Where a header's name and value lie in its head.
#[derive(Debug, Clone, Copy, Default)]
struct Span {
    name: Part,
    value: Part,
}

/// Which of the headers that say how a message is framed (and `Expect`) a head has,
/// noted while its map is built from where each name lies in [`COMMON_NAMES`]. Their
/// values are looked up only when they are there: most heads have neither `Connection`
/// nor `Transfer-Encoding`, and a lookup hashes the name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) connection: bool,
    pub(crate) transfer_encoding: bool,
    pub(crate) content_length: bool,
    pub(crate) expect: bool,
    /// The length a head's one `Content-Length` of plain digits gives, read as its map is
    /// built: nearly every head's, which then needs no lookup (it hashes the name). `None`
    /// for a second `Content-Length` or any other value: the map's values decide.
    length: Option<u64>,
}

impl Seen {
    /// Notes the header at `common` of [`COMMON_NAMES`], whose value is `value`.
    fn note(&mut self, common: usize, value: &[u8]) {
        match common {
            CONNECTION => self.connection = true,
            TRANSFER_ENCODING => self.transfer_encoding = true,
            CONTENT_LENGTH => {
                self.length = if self.content_length {
                    None
                } else {
                    decimal(value)
                };
                self.content_length = true;
            }
            EXPECT => self.expect = true,
            _ => {}
        }
    }

    /// Whether the head's `Connection` lists `token`: looked up only when it has one.
    pub(crate) fn connection_has(self, headers: &impl Values, token: &str) -> bool {
        self.connection && connection_has(headers, token)
    }

    /// The head's `Content-Length` (see [`content_length`]): looked up only when it has
    /// one.
    pub(crate) fn content_length(self, headers: &impl Values) -> Result<Option<u64>, &'static str> {
        match (self.content_length, self.length) {
            (false, _) => Ok(None),
            (true, Some(n)) => Ok(Some(n)),
            (true, None) => content_length(headers),
        }
    }

    /// The last `Transfer-Encoding` value's last coding is `chunked`.
    pub(crate) fn chunked(self, headers: &impl Values) -> bool {
        self.transfer_encoding
            && headers
                .values(&header::TRANSFER_ENCODING)
                .next_back()
                .is_some_and(|v| last_token_is(v, "chunked"))
    }
}

/// Declares [`COMMON_NAMES`] and [`COMMON_NAME_TEXTS`] from one list, in the same order.
macro_rules! common_names {
    ($($name:literal,)*) => {
        /// The header names the gateway meets most (from the OpenAI SDKs, Azure OpenAI
        /// and OpenAI). One of these is taken from here, neither parsed nor copied:
        /// `HeaderName::from_bytes` allocates a copy of every name `http` does not know
        /// itself, such as the `x-ratelimit-*` and `x-stainless-*` ones.
        static COMMON_NAMES: [HeaderName; [$($name),*].len()] =
            [$(HeaderName::from_static($name)),*];
        /// [`COMMON_NAMES`] as text.
        pub(crate) const COMMON_NAME_TEXTS: [&str; [$($name),*].len()] = [$($name),*];
    };
}

common_names! {
    // Requests: HTTP and the OpenAI SDKs.
    "host", "user-agent", "accept", "accept-encoding", "accept-language", "content-type",
    "content-length", "content-encoding", "authorization", "api-key", "connection",
    "keep-alive", "transfer-encoding", "te", "upgrade", "expect", "cookie", "origin",
    "referer", "traceparent", "tracestate", "openai-organization", "openai-project",
    "openai-beta", "x-request-id", "x-ms-client-request-id", "x-priority",
    "x-stainless-lang", "x-stainless-package-version", "x-stainless-os", "x-stainless-arch",
    "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-async",
    "x-stainless-retry-count", "x-stainless-read-timeout", "x-stainless-timeout",
    "x-stainless-helper-method", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host",
    "x-real-ip", "forwarded",
    // Responses: Azure OpenAI and OpenAI.
    "date", "server", "cache-control", "vary", "set-cookie", "alt-svc", "cf-ray",
    "cf-cache-status", "strict-transport-security", "x-content-type-options",
    "access-control-expose-headers", "apim-request-id", "x-ms-region", "x-ms-rai-invoked",
    "x-ms-deployment-name", "azureml-model-session", "x-envoy-upstream-service-time",
    "openai-processing-ms", "openai-version", "openai-model", "x-should-retry",
    "retry-after", "retry-after-ms", "x-ms-retry-after-ms", "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens",
    // Names the gateway drops from a backend's response (see `proxy::Relay`).
    "proxy-connection", "proxy-authenticate", "proxy-authorization", "trailer",
    "x-spillgate-backend", "x-spillgate-attempts", "x-spillgate-model",
}

/// Slots of the table over [`COMMON_NAMES`] (2^[`SLOT_BITS`]), and the mark of an empty
/// one.
const SLOT_BITS: u32 = 10;
const NAME_SLOTS: usize = 1 << SLOT_BITS;
const NO_NAME: u8 = u8::MAX;

/// A name's key: its length and its first, middle and last bytes, each with its 0x20 bit
/// set (a letter's lower case). No two common names share one: the table's build would
/// find no slot of its own for each otherwise.
#[inline]
const fn name_key(len: usize, first: u8, mid: u8, last: u8) -> u32 {
    (len as u32) << 21 | fold(first) << 14 | fold(mid) << 7 | fold(last)
}

/// A byte of a name's key: its 0x20 bit set, its high bit cleared.
#[inline]
const fn fold(b: u8) -> u32 {
    (b | 0x20) as u32 & 0x7f
}

/// The key of `name`, not empty.
const fn key_of(name: &[u8]) -> u32 {
    let len = name.len();
    name_key(len, name[0], name[len / 2], name[len - 1])
}

/// The slot of `key`: the top bits of its product with the table's multiplier.
#[inline]
const fn name_slot(key: u32, multiplier: u32) -> usize {
    (key.wrapping_mul(multiplier) >> (32 - SLOT_BITS)) as usize
}

/// The table and its multiplier, built at compile time: each common name has a slot of
/// its own (a perfect hash), so a lookup compares at most one name. The multiplier is
/// the first odd number from the golden ratio's under which no two names share a slot
/// (a handful of tries, with 80 names in 1,024 slots). With linear probing in 256 slots
/// a lookup was about 120 instructions (callgrind); each header name of every head is
/// looked up.
const NAME_TABLE: ([u8; NAME_SLOTS], u32) = {
    assert!(COMMON_NAME_TEXTS.len() < NO_NAME as usize);
    let mut multiplier: u32 = 0x9e37_79b9;
    let mut tries = 0;
    loop {
        // Two names with one key would share every slot: refused here.
        assert!(tries < 4096);
        let mut slots = [NO_NAME; NAME_SLOTS];
        let mut own = true;
        let mut i = 0;
        while i < COMMON_NAME_TEXTS.len() {
            let s = name_slot(key_of(COMMON_NAME_TEXTS[i].as_bytes()), multiplier);
            if slots[s] != NO_NAME {
                own = false;
                break;
            }
            slots[s] = i as u8;
            i += 1;
        }
        if own {
            break (slots, multiplier);
        }
        multiplier = multiplier.wrapping_add(2);
        tries += 1;
    }
};

/// Where `name` is in [`COMMON_NAMES`] (at compile time; past its end when it is not
/// there, which the assertion below refuses: the project does not `panic!`).
pub(crate) const fn common_at(name: &str) -> usize {
    let mut i = 0;
    while i < COMMON_NAME_TEXTS.len() {
        let (a, b) = (COMMON_NAME_TEXTS[i].as_bytes(), name.as_bytes());
        if a.len() == b.len() {
            let mut k = 0;
            while k < a.len() && a[k] == b[k] {
                k += 1;
            }
            if k == a.len() {
                return i;
            }
        }
        i += 1;
    }
    i
}
const CONNECTION: usize = common_at("connection");
const TRANSFER_ENCODING: usize = common_at("transfer-encoding");
const CONTENT_LENGTH: usize = common_at("content-length");
const EXPECT: usize = common_at("expect");
const _: () = assert!(
    CONNECTION < COMMON_NAME_TEXTS.len()
        && TRANSFER_ENCODING < COMMON_NAME_TEXTS.len()
        && CONTENT_LENGTH < COMMON_NAME_TEXTS.len()
        && EXPECT < COMMON_NAME_TEXTS.len()
);

/// The name at `i` of [`COMMON_NAMES`].
pub(crate) fn common_header_name(i: usize) -> Option<HeaderName> {
    COMMON_NAMES.get(i).cloned()
}

/// `name` as one of [`COMMON_NAMES`], whatever its case.
#[cfg(test)]
fn common_name(name: &[u8]) -> Option<HeaderName> {
    common_index(name).and_then(common_header_name)
}

/// Where `name` is in [`COMMON_NAMES`], whatever its case: the one name in its slot,
/// compared.
#[inline]
pub(crate) fn common_index(name: &[u8]) -> Option<usize> {
    let (&first, &last) = (name.first()?, name.last()?);
    let mid = *name.get(name.len() / 2)?;
    let (slots, multiplier) = &NAME_TABLE;
    let slot = slots[name_slot(name_key(name.len(), first, mid, last), *multiplier)];
    let i = usize::from(slot);
    let text = COMMON_NAME_TEXTS.get(i)?;
    same_ignoring_case(name, text.as_bytes()).then_some(i)
}

/// Whether `name` is `lower` (lower-case ASCII, as every header name the gateway looks
/// for is) in any case: each byte equal, or a letter of `lower` upper-cased. Eight bytes
/// at a time (the last eight overlapping the ones before when the length is not a
/// multiple of eight), without a branch per byte: a byte at a time it cost about 9
/// instructions a byte, and looking up a head's names in [`COMMON_NAMES`] was 7.7% of
/// a request with the OpenAI SDK's headers (callgrind; 6.8% since).
pub(crate) fn same_ignoring_case(name: &[u8], lower: &[u8]) -> bool {
    debug_assert!(lower.is_ascii());
    let len = lower.len();
    if name.len() != len {
        return false;
    }
    if len < 8 {
        return name.iter().zip(lower).fold(0, |diff, (&n, &l)| {
            let letter = u8::from(l.wrapping_sub(b'a') < 26) << 5;
            diff | ((n | letter) ^ l)
        }) == 0;
    }
    // Never `None`: `at + 8 <= len`.
    let word = |bytes: &[u8], at: usize| {
        bytes
            .get(at..at + 8)
            .and_then(|w| <[u8; 8]>::try_from(w).ok())
            .map_or(0, u64::from_le_bytes)
    };
    let mut diff = 0;
    let mut at = 0;
    loop {
        let from = at.min(len - 8);
        diff |= case_folded_diff(word(name, from), word(lower, from));
        at += 8;
        if at >= len {
            return diff == 0;
        }
    }
}

/// The bits by which eight bytes of a name differ from eight of lower-case ASCII `l`,
/// the case of `l`'s letters ignored. Each byte of `l` is below 0x80, so adding to it
/// carries into no other byte: `l + 0x1f` has its high bit set from `a` up, `l + 0x05`
/// from `{` up, and between the two are the letters, whose 0x20 bit is then ignored.
fn case_folded_diff(n: u64, l: u64) -> u64 {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let from_a = l.wrapping_add(0x1f1f_1f1f_1f1f_1f1f);
    let from_brace = l.wrapping_add(0x0505_0505_0505_0505);
    let letters = (from_a & !from_brace & HIGH) >> 2;
    (n | letters) ^ l
}

/// How a body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// This many bytes are left.
    Length(u64),
    /// Chunked, at this point of the encoding.
    Chunked(Chunk),
    /// Ends when the backend closes the connection (responses only).
    Close,
    /// Ended.
    Done,
}

impl Framing {
    /// What is known of the length still to come.
    pub(crate) fn size_hint(self) -> SizeHint {
        match self {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chunk {
    /// At a chunk-size line.
    Size,
    /// This many bytes of chunk data are left.
    Data(u64),
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// At the trailer section (after the last chunk), with this many bytes of it read.
    Trailers(usize),
}

/// The framing of a response body (RFC 9112, section 6.3), and whether the connection
/// can carry another request after it. A `Content-Length` beside a `Transfer-Encoding` is
/// not the body's: `headers` notes it as stray.
fn framing(
    is_head: bool,
    status: StatusCode,
    version: Version,
    headers: &mut RawHeaders,
) -> Result<(Framing, bool), Error> {
    let seen = headers.seen;
    let mut keep_alive = version == Version::HTTP_11 && !seen.connection_has(headers, "close");
    if is_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok((Framing::Done, keep_alive));
    }
    if seen.transfer_encoding {
        let chunked = seen.chunked(headers);
        // With a Content-Length too, the message is suspect: not reused.
        keep_alive &= !seen.content_length;
        headers.set_stray_length();
        return Ok(if chunked {
            (Framing::Chunked(Chunk::Size), keep_alive)
        } else {
            (Framing::Close, false)
        });
    }
    let length = seen
        .content_length(headers)
        .map_err(|why| Error::new(format!("{why} in the response")))?;
    Ok(match length {
        Some(0) => (Framing::Done, keep_alive),
        Some(n) => (Framing::Length(n), keep_alive),
        None => (Framing::Close, false),
    })
}

/// The body length `Content-Length` gives, if any. Repeated equal values (`5, 5`, or the
/// header twice) are one length; unequal or malformed ones are an error.
pub(crate) fn content_length(headers: &impl Values) -> Result<Option<u64>, &'static str> {
    let mut length = None;
    let mut one = |n: u64| {
        if length.is_some_and(|l| l != n) {
            return Err("conflicting content-length values");
        }
        length = Some(n);
        Ok(())
    };
    for v in headers.values(&header::CONTENT_LENGTH) {
        // Plain digits, as every client and backend sends: one token, nothing to trim.
        if let Some(n) = decimal(v) {
            one(n)?;
            continue;
        }
        for part in tokens(v) {
            one(decimal(part).ok_or("invalid content-length")?)?;
        }
    }
    Ok(length)
}

/// A non-empty run of ASCII digits as a number (`None` for anything else or past
/// `u64::MAX`), read from the bytes without a UTF-8 check or a string parse.
pub(crate) fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &b| {
        let d = b.wrapping_sub(b'0');
        (d < 10).then_some(())?;
        n.checked_mul(10)?.checked_add(u64::from(d))
    })
}

/// Whether a `Connection` header of `headers` lists `token` (`close`, `keep-alive`).
pub(crate) fn connection_has(headers: &impl Values, token: &str) -> bool {
    headers
        .values(&header::CONNECTION)
        .any(|v| has_token(v, token))
}

/// The comma-separated tokens of `v`, without the spaces around them (a header value
/// holds no control byte but tab: trimming ASCII whitespace trims spaces and tabs).
pub(crate) fn tokens(v: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    v.split(|&b| b == b',').map(<[u8]>::trim_ascii)
}

/// Whether the comma-separated value `v` lists `token` (case ignored).
pub(crate) fn has_token(v: &[u8], token: &str) -> bool {
    tokens(v).any(|t| t.eq_ignore_ascii_case(token.as_bytes()))
}

/// Whether the last token of the comma-separated value `v` is `token` (case ignored).
pub(crate) fn last_token_is(v: &[u8], token: &str) -> bool {
    tokens(v)
        .next_back()
        .is_some_and(|t| t.eq_ignore_ascii_case(token.as_bytes()))
}

/// Where a connection goes when a response body has ended and it can carry another
/// request.
pub trait Release: Send + Unpin + 'static {
    fn release(self, conn: Conn);
}

/// A response body read from its connection as it is polled. At its end the connection
/// goes to its [`Release`] when it can be used again; dropped before, the connection
/// closes with it.
pub struct Body<R> {
    conn: Option<Conn>,
    framing: Framing,
    /// Where the connection goes at the end; `None` when it cannot carry another request.
    release: Option<R>,
}

/// What the read buffer gave.
pub(crate) enum Step {
    Data(Bytes),
    /// More bytes are needed (or, when asked to stop at data, data is next).
    NeedMore,
    /// The body has ended.
    End,
}

/// Up to `left` bytes of data off the front of `buf` (counted off `left`); `NeedMore`
/// when `buf` is empty or `data` is false.
#[inline]
fn take_data(left: &mut u64, buf: &mut BytesMut, data: bool) -> Step {
    if buf.is_empty() || !data {
        return Step::NeedMore;
    }
    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
    *left -= n as u64;
    Step::Data(take_front(buf, n))
}

/// The first `n` bytes of `buf`, taken off it. All of it is taken whole: splitting a
/// buffer that is not yet shared makes it shared, an allocation per read (a read buffer
/// is one read's size, see [`poll_fill`]).
pub(crate) fn take_front(buf: &mut BytesMut, n: usize) -> Bytes {
    if n == buf.len() {
        std::mem::take(buf).freeze()
    } else {
        buf.split_to(n).freeze()
    }
}

/// Decodes `buf` up to the next data (taken off it, unless `data` is false) or the end.
/// Data taken, it also moves past the framing after it that `buf` holds already (a
/// chunk's CRLF, the next chunk's size line, the last chunk and trailers), so that a body
/// whose end has arrived ends with its last data: one call per chunk of a stream, where a
/// second call to settle the framing cost as much again. An error in that framing is
/// left where it is, for the next call to find and report after the data.
pub(crate) fn decode(framing: &mut Framing, buf: &mut BytesMut, data: bool) -> Result<Step, Error> {
    let step = decode_step(framing, buf, data)?;
    if let Step::Data(_) = step {
        let _ = decode_step(framing, buf, false);
    }
    Ok(step)
}

/// One step of [`decode`]: up to the next data (taken off `buf` when `data` is true) or
/// the end. On an error, `framing` and `buf` are as they were before the bytes in error.
#[inline(always)]
fn decode_step(framing: &mut Framing, buf: &mut BytesMut, data: bool) -> Result<Step, Error> {
    loop {
        match framing {
            Framing::Done => return Ok(Step::End),
            Framing::Length(left) => {
                let step = take_data(left, buf, data);
                if *left == 0 {
                    *framing = Framing::Done;
                }
                return Ok(step);
            }
            Framing::Close => {
                let mut unbounded = u64::MAX;
                return Ok(take_data(&mut unbounded, buf, data));
            }
            Framing::Chunked(chunk) => match chunk {
                Chunk::Size => {
                    let Some(eol) = memchr::memchr(b'\n', buf) else {
                        if buf.len() > MAX_CHUNK_LINE {
                            return Err(Error::new("chunk-size line too long"));
                        }
                        return Ok(Step::NeedMore);
                    };
                    let size = chunk_size(&buf[..eol])?;
                    buf.advance(eol + 1);
                    *chunk = if size == 0 {
                        Chunk::Trailers(0)
                    } else {
                        Chunk::Data(size)
                    };
                }
                // A chunk's data and its CRLF, alone in the buffer (an event of a stream
                // in one read): the data is taken whole, the CRLF cut off.
                Chunk::Data(left)
                    if data
                        && left.checked_add(2) == Some(buf.len() as u64)
                        && buf.ends_with(b"\r\n") =>
                {
                    let mut all = std::mem::take(buf);
                    all.truncate(all.len() - 2);
                    *chunk = Chunk::Size;
                    return Ok(Step::Data(all.freeze()));
                }
                Chunk::Data(left) => {
                    let step = take_data(left, buf, data);
                    if *left == 0 {
                        *chunk = Chunk::DataEnd;
                    }
                    return Ok(step);
                }
                Chunk::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Step::NeedMore);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(Error::new("chunk data not followed by CRLF"));
                    }
                    buf.advance(2);
                    *chunk = Chunk::Size;
                }
                Chunk::Trailers(read) => {
                    let Some(eol) = memchr::memchr(b'\n', buf) else {
                        if *read + buf.len() > MAX_TRAILERS {
                            return Err(Error::new("chunked trailers too long"));
                        }
                        return Ok(Step::NeedMore);
                    };
                    if *read + eol + 1 > MAX_TRAILERS {
                        return Err(Error::new("chunked trailers too long"));
                    }
                    if eol == 0 || buf[eol - 1] != b'\r' {
                        return Err(Error::new("trailer line not ended by CRLF"));
                    }
                    *read += eol + 1;
                    // Trailers are not passed on; the empty line ends the body.
                    if eol == 1 {
                        *framing = Framing::Done;
                    }
                    buf.advance(eol + 1);
                }
            },
        }
    }
}

impl<R: Release> Body<R> {
    /// Moves past the framing that arrived with the head, up to data: a body whose end
    /// has arrived too (an empty chunked body, say) ends now, its connection free. An
    /// error is left where it is, as [`decode`] leaves it, for the first poll to report.
    fn settle(&mut self) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if let Ok(Step::End) = decode(&mut self.framing, &mut conn.buf, false) {
            self.finish();
        }
    }

    /// The body has ended: the connection goes back if it can carry another request
    /// (nothing unread is left on it), else closes.
    fn finish(&mut self) {
        self.framing = Framing::Done;
        if let (Some(conn), Some(release)) = (self.conn.take(), self.release.take()) {
            if conn.buf.is_empty() {
                release.release(conn);
            }
        }
    }

    /// Ends the body with an error; the connection closes.
    fn fail(&mut self, e: Error) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        self.framing = Framing::Done;
        self.conn = None;
        Poll::Ready(Some(Err(e)))
    }
}

/// The size of a chunk from its line (hex digits, then optional extensions; CRLF).
/// Read digit by digit (this runs for every chunk of every stream): leading zeros are
/// fine, more than a u64 holds is an error.
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    let invalid = || Error::new("invalid chunk size");
    let line = line
        .strip_suffix(b"\r")
        .ok_or_else(|| Error::new("chunk-size line not ended by CRLF"))?;
    let mut size = 0u64;
    let mut digits = 0;
    for &b in line {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => break,
        };
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(d)))
            .ok_or_else(invalid)?;
        digits += 1;
    }
    if digits == 0 {
        return Err(invalid());
    }
    // Then spaces or tabs only, up to the end or to extensions (no bare CR in them).
    let rest = &line[digits..];
    let after = &rest[rest
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(rest.len())..];
    if (after.is_empty() || after.starts_with(b";")) && !after.contains(&b'\r') {
        Ok(size)
    } else {
        Err(invalid())
    }
}

impl<R: Release> http_body::Body for Body<R> {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match decode(&mut this.framing, &mut conn.buf, true) {
                Err(e) => return this.fail(e),
                Ok(Step::Data(data)) => {
                    // `decode` went on to the end when it had arrived.
                    if this.framing == Framing::Done {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Step::End) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(Step::NeedMore) => {}
            }
            match std::task::ready!(conn.poll_fill(cx)) {
                Ok(0) if this.framing == Framing::Close => this.framing = Framing::Done,
                Ok(0) => {
                    return this.fail(Error::new(
                        "the backend closed the connection before the end of the body",
                    ))
                }
                Ok(_) => {}
                Err(e) => return this.fail(Error::io("reading the response body", &e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Done
    }

    fn size_hint(&self) -> SizeHint {
        self.framing.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    /// Eight bytes at a time, names are compared as a byte at a time would: for every
    /// common name, in lower, upper and mixed case, and with each byte in turn changed
    /// to bytes that differ from it in one bit or are its other case.
    #[test]
    fn names_compare_eight_bytes_at_a_time_as_one_at_a_time() {
        let one_at_a_time = |name: &[u8], lower: &[u8]| {
            name.len() == lower.len()
                && name.iter().zip(lower).all(|(&n, &l)| {
                    n == l || (l.is_ascii_lowercase() && n == l.to_ascii_uppercase())
                })
        };
        for lower in COMMON_NAME_TEXTS {
            let lower = lower.as_bytes();
            let mixed: Vec<u8> = lower
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    if i % 3 == 0 {
                        b.to_ascii_uppercase()
                    } else {
                        *b
                    }
                })
                .collect();
            for name in [lower.to_vec(), lower.to_ascii_uppercase(), mixed] {
                assert!(same_ignoring_case(&name, lower), "{name:?}");
                for i in 0..name.len() {
                    for flip in [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x0d] {
                        let mut changed = name.clone();
                        changed[i] ^= flip;
                        assert_eq!(
                            same_ignoring_case(&changed, lower),
                            one_at_a_time(&changed, lower),
                            "{changed:?} against {lower:?}"
                        );
                    }
                }
                assert!(!same_ignoring_case(&name[1..], lower));
            }
        }
    }

    #[test]
    fn case_is_ignored_for_letters_only() {
        assert!(same_ignoring_case(b"X-Ms-Region", b"x-ms-region"));
        assert!(same_ignoring_case(b"te", b"te"));
        assert!(!same_ignoring_case(b"x\rms-region", b"x-ms-region"));
        assert!(!same_ignoring_case(b"x-ms-regio", b"x-ms-region"));
        assert!(!same_ignoring_case(b"x-ms-regioN2", b"x-ms-region"));
        assert!(!same_ignoring_case(b"X_MS_REGION", b"x-ms-region"));
        // 0x10 and `0` (0x30), `@` and `` ` ``, `[` and `{` differ only in the 0x20 bit,
        // which is ignored only where the expected byte is a letter.
        assert!(!same_ignoring_case(b"\x10", b"0"));
        assert!(!same_ignoring_case(b"@", b"`"));
        assert!(!same_ignoring_case(b"[", b"{"));
        // The same, eight bytes at a time: `^` and `~`, `\` and `|` (tokens both).
        assert!(!same_ignoring_case(b"x-long-^", b"x-long-~"));
        assert!(!same_ignoring_case(b"x-longer-\\-name", b"x-longer-|-name"));
        assert!(!same_ignoring_case(b"@-longer-name", b"`-longer-name"));
        assert!(same_ignoring_case(b"X-LONG-~|", b"x-long-~|"));
    }

    #[test]
    fn common_names_are_found_in_any_case_and_others_are_not() {
        for known in &COMMON_NAMES {
            let name = known.as_str();
            assert_eq!(common_name(name.as_bytes()).as_ref(), Some(known), "{name}");
            let upper = name.to_ascii_uppercase();
            assert_eq!(
                common_name(upper.as_bytes()).as_ref(),
                Some(known),
                "{upper}"
            );
        }
        for other in [
            "x-mock-backend",
            "x-ratelimit-remaining",
            "hosts",
            "",
            "content_type",
        ] {
            assert_eq!(common_name(other.as_bytes()), None, "{other}");
        }
    }

    /// Every common name, in either case, with each of its bytes changed to every
    /// value, one byte longer and one shorter: the table finds what a scan finds. And
    /// names too long for the key's length bits are no common name.
    #[test]
    fn the_name_table_finds_each_near_miss_as_a_scan_does() {
        let scan = |name: &[u8]| {
            COMMON_NAME_TEXTS
                .iter()
                .position(|t| t.as_bytes().eq_ignore_ascii_case(name))
        };
        for text in COMMON_NAME_TEXTS {
            for name in [text.to_string(), text.to_ascii_uppercase()] {
                let name = name.into_bytes();
                for at in 0..name.len() {
                    for byte in 0..=u8::MAX {
                        let mut near = name.clone();
                        near[at] = byte;
                        assert_eq!(common_index(&near), scan(&near), "{near:?}");
                    }
                }
                let longer = [&name[..], b"x"].concat();
                assert_eq!(common_index(&longer), scan(&longer));
                let shorter = &name[..name.len() - 1];
                assert_eq!(common_index(shorter), scan(shorter));
            }
        }
        let mut wrapped = b"host".to_vec();
        wrapped.resize(4 + (1 << 11), b't');
        assert_eq!(common_index(&wrapped), None);
        assert_eq!(common_index(&vec![b'a'; 1 << 20]), None);
    }

    proptest::proptest! {
        /// The table finds what a comparison with each common name in turn finds, for
        /// any name: a common one in any case, one changed by a byte, or any other.
        #[test]
        fn the_name_table_finds_what_a_scan_finds(
            pick in 0..COMMON_NAME_TEXTS.len(),
            case in proptest::num::u64::ANY,
            change in proptest::option::of((0usize..64, proptest::num::u8::ANY)),
            other in "[!-~]{0,40}",
        ) {
            let scan = |name: &[u8]| {
                COMMON_NAME_TEXTS
                    .iter()
                    .position(|t| t.as_bytes().eq_ignore_ascii_case(name))
            };
            let mut name: Vec<u8> = COMMON_NAME_TEXTS[pick]
                .bytes()
                .enumerate()
                .map(|(i, b)| if case >> (i % 64) & 1 == 1 { b.to_ascii_uppercase() } else { b })
                .collect();
            if let Some((at, byte)) = change {
                let at = at % name.len();
                name[at] = byte;
            }
            proptest::prop_assert_eq!(common_index(&name), scan(&name));
            proptest::prop_assert_eq!(common_index(other.as_bytes()), scan(other.as_bytes()));
        }
    }

    #[test]
    fn a_head_keeps_every_header_known_or_not() {
        let raw =
            b"X-Ratelimit-Remaining-Tokens: 10\r\nX-Custom-Thing: a\r\nContent-Type: b\r\n\r\n";
        let map = map_of(raw);
        let head = Bytes::from_static(raw);
        assert_eq!(map.len(), 3);
        assert_eq!(map["x-ratelimit-remaining-tokens"], "10");
        assert_eq!(map["x-custom-thing"], "a");
        assert_eq!(map[header::CONTENT_TYPE], "b");
        assert_eq!(head.len(), raw.len());
    }

    #[test]
    fn heads_of_more_headers_than_the_stack_holds_keep_them_all() {
        for n in [SMALL_HEAD - 1, SMALL_HEAD, SMALL_HEAD + 1, 120] {
            let mut raw = String::new();
            for i in 0..n {
                raw.push_str(&format!("X-H{i}: v{i}\r\n"));
            }
            raw.push_str("\r\n");
            let lines = raw_headers(raw.as_bytes());
            let fields: Vec<_> = lines
                .fields()
                .map(|(_, n, v)| (n.to_vec(), v.to_vec()))
                .collect();
            assert_eq!(fields.len(), n);
            for (i, (name, value)) in fields.iter().enumerate() {
                assert_eq!(name, format!("X-H{i}").as_bytes(), "{n} headers");
                assert_eq!(value, format!("v{i}").as_bytes(), "{n} headers");
            }
        }
    }

    /// The headers of `raw` (a head without its status line) as a map.
    fn map_of(raw: &[u8]) -> HeaderMap {
        raw_headers(raw).to_map()
    }

    /// A map's headers made lines are the map's again: names, values, order and
    /// repeats; and found by name, common or not, in any case.
    #[test]
    fn a_map_made_lines_keeps_every_header() {
        let mut map = HeaderMap::new();
        map.append("x-custom", HeaderValue::from_static("1"));
        map.append(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        map.append("x-custom", HeaderValue::from_static("2"));
        map.append(
            "api-key",
            HeaderValue::from_bytes(b"caf\xc3\xa9\t!").unwrap(),
        );
        let lines = RawHeaders::from_map(&map);
        assert_eq!(lines.len(), 4);
        assert_eq!(lines.to_map(), map);
        let custom = HeaderName::from_static("x-custom");
        assert_eq!(lines.values(&custom).collect::<Vec<_>>(), [b"1", b"2"]);
        assert_eq!(lines.get(&header::AUTHORIZATION), Some(&b"Bearer k"[..]));
        assert!(RawHeaders::from_map(&HeaderMap::new()).is_empty());
        let mixed = raw_headers(b"X-CUSTOM: a\r\nAPI-Key: b\r\nx-custom: c\r\n\r\n");
        assert_eq!(mixed.values(&custom).collect::<Vec<_>>(), [b"a", b"c"]);
        assert_eq!(
            mixed.get(&HeaderName::from_static("api-key")),
            Some(&b"b"[..])
        );
        assert_eq!(mixed.get(&header::AUTHORIZATION), None);
        // A common name is found by its place, in any case, as a map finds it.
        let api_key = Common::new("api-key");
        assert_eq!(mixed.first(&api_key), Some(&b"b"[..]));
        assert_eq!(lines.first(&api_key), map.first(&api_key));
        assert_eq!(lines.first(&api_key), Some(&b"caf\xc3\xa9\t!"[..]));
        let authorization = Common::new("authorization");
        assert_eq!(mixed.first(&authorization), None);
        assert_eq!(lines.first(&authorization), Some(&b"Bearer k"[..]));
        let shared = lines.value(&authorization).unwrap();
        assert_eq!(shared, "Bearer k");
        // The value shares the head's bytes; one that is not a value of it is copied.
        let value = lines.first(&authorization).unwrap();
        assert_eq!(shared.as_bytes().as_ptr(), value.as_ptr());
        let elsewhere = b"Bearer k".to_vec();
        let copied = lines.share(&elsewhere).unwrap();
        assert_eq!(copied, "Bearer k");
        assert_ne!(copied.as_bytes().as_ptr(), elsewhere.as_ptr());
    }

    /// A list of where a response's headers lay, given back when the response is done,
    /// is reused by the thread's next response empty: no header of one shows in
    /// another's. Lists too large are dropped.
    #[test]
    fn reused_field_lists_carry_nothing_over() {
        SPARE_FIELDS.with_borrow_mut(Vec::clear);
        let first = raw_headers(b"Authorization: Bearer secret\r\nX-One: 1\r\nX-Two: 2\r\n\r\n");
        let capacity = first.fields.capacity();
        drop(first);
        assert_eq!(SPARE_FIELDS.with_borrow(Vec::len), 1);
        let second = raw_headers(b"X-Three: 3\r\n\r\n");
        assert_eq!(SPARE_FIELDS.with_borrow(Vec::len), 0, "the spare was taken");
        assert_eq!(second.fields.capacity(), capacity, "the same list");
        let names: Vec<&[u8]> = second.fields().map(|(_, n, _)| n).collect();
        assert_eq!(names, [b"X-Three".as_slice()]);
        assert!(second.get(&header::AUTHORIZATION).is_none());
        recycle_fields(Vec::with_capacity(SPARE_CAPACITY * 2));
        recycle_fields(Vec::new());
        assert_eq!(
            SPARE_FIELDS.with_borrow(Vec::len),
            0,
            "too large, or nothing to keep"
        );
    }

    /// What a head says it has of the framing headers is what its map has, in any case
    /// and any mix: a header missed would leave a body unread or a close unseen.
    #[test]
    fn a_head_notes_exactly_the_framing_headers_it_has() {
        let names = [
            "Connection",
            "TRANSFER-encoding",
            "content-Length",
            "expect",
        ];
        for mask in 0..16u8 {
            let mut raw = b"X-Other: 1\r\nContent-Type: a\r\n".to_vec();
            for (i, name) in names.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    raw.extend_from_slice(format!("{name}: v\r\n").as_bytes());
                }
            }
            raw.extend_from_slice(b"\r\n");
            let lines = raw_headers(&raw);
            let (map, seen) = (lines.to_map(), lines.seen());
            let has = |name| map.contains_key(name);
            assert_eq!(
                seen,
                Seen {
                    connection: has(header::CONNECTION),
                    transfer_encoding: has(header::TRANSFER_ENCODING),
                    content_length: has(header::CONTENT_LENGTH),
                    expect: has(header::EXPECT),
                    // The one `Content-Length` here reads `v`: no length of its own.
                    length: None,
                },
                "{mask:04b}"
            );
            assert_eq!(
                [
                    seen.connection,
                    seen.transfer_encoding,
                    seen.content_length,
                    seen.expect
                ],
                [0, 1, 2, 3].map(|i| mask & (1 << i) != 0),
                "{mask:04b}"
            );
        }
    }

    /// Keeps the connection a body gives back.
    #[derive(Clone, Default)]
    struct Back(Arc<Mutex<Option<Conn>>>);

    impl Release for Back {
        fn release(self, conn: Conn) {
            *self.0.lock().unwrap() = Some(conn);
        }
    }

    impl Back {
        fn take(&self) -> Option<Conn> {
            self.0.lock().unwrap().take()
        }
    }

    /// A deadline no test reaches.
    fn far() -> tokio::time::Instant {
        tokio::time::Instant::now() + std::time::Duration::from_secs(3600)
    }

    /// Sends `req` on `conn`.
    async fn send<R: Release>(
        conn: Conn,
        req: http::Request<Bytes>,
        release: R,
    ) -> Result<http::Response<Body<R>>, SendError> {
        let resp = conn
            .send(&UpstreamRequest::of(&req).unwrap(), release, far())
            .await?;
        let mut http = http::Response::new(resp.body);
        *http.status_mut() = resp.status;
        *http.headers_mut() = resp.headers.to_map();
        Ok(http)
    }

    fn pair() -> (Conn, DuplexStream) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let host = HeaderValue::from_static("backend.example:8080");
        (Conn::new(Box::new(a), Some(host)), b)
    }

    fn post(body: &'static str) -> http::Request<Bytes> {
        http::Request::post("http://backend.example:8080/v1/chat/completions?x=1")
            .header("x-request-id", "r1")
            .body(Bytes::from_static(body.as_bytes()))
            .unwrap()
    }

    /// What the backend end of the pipe has received so far.
    async fn received(server: &mut DuplexStream) -> String {
        let mut buf = vec![0; 1 << 16];
        let n = server.read(&mut buf).await.unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    async fn exchange(
        conn: Conn,
        server: &mut DuplexStream,
        req: http::Request<Bytes>,
        response: &[u8],
    ) -> (Result<http::Response<Body<Back>>, SendError>, Back) {
        server.write_all(response).await.unwrap();
        let back = Back::default();
        (send(conn, req, back.clone()).await, back)
    }

    /// A new connection whose backend has already written `response`, sent a POST.
    async fn respond(
        response: &[u8],
    ) -> (
        Result<http::Response<Body<Back>>, SendError>,
        Back,
        DuplexStream,
    ) {
        let (conn, mut server) = pair();
        let (resp, back) = exchange(conn, &mut server, post("{}"), response).await;
        (resp, back, server)
    }

    async fn read_all(body: Body<Back>) -> Result<Bytes, Error> {
        body.collect().await.map(|c| c.to_bytes())
    }

    /// Sends `req` on `conn` with `deadline`: the response (its body read whole, the
    /// connection given back) or the error, and how long it took.
    async fn timed(
        conn: Conn,
        req: http::Request<Bytes>,
        deadline: tokio::time::Instant,
    ) -> (Result<(StatusCode, Conn), SendError>, std::time::Duration) {
        let start = tokio::time::Instant::now();
        let back = Back::default();
        let sent = conn
            .send(&UpstreamRequest::of(&req).unwrap(), back.clone(), deadline)
            .await;
        let taken = start.elapsed();
        let answer = match sent {
            Ok(resp) => {
                read_all(resp.body).await.unwrap();
                Ok((resp.status, back.take().expect("connection given back")))
            }
            Err(e) => Err(e),
        };
        (answer, taken)
    }

    /// The backend end of `server`: answers each request after the delay `delays`
    /// gives for it (none: never answers), and reads what comes meanwhile.
    fn answering(mut server: DuplexStream, delays: Vec<Option<u64>>) {
        tokio::spawn(async move {
            let mut buf = vec![0; 1 << 16];
            for delay in delays {
                // Each request is small, and comes in one read.
                if server.read(&mut buf).await.unwrap_or(0) == 0 {
                    return;
                }
                let Some(ms) = delay else {
                    std::future::pending::<()>().await;
                    return;
                };
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                server
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .unwrap();
            }
        });
    }

    #[tokio::test(start_paused = true)]
    async fn each_exchange_on_a_connection_ends_at_its_own_deadline() {
        use std::time::Duration;
        let secs = |n| tokio::time::Instant::now() + Duration::from_secs(n);
        let timed_out = |answer: &Result<(StatusCode, Conn), SendError>, taken, after| {
            assert!(
                matches!(answer, Err(SendError::TimedOut)),
                "{:?}",
                answer.as_ref().map(|(status, _)| status)
            );
            let after = Duration::from_secs(after);
            assert!(
                taken >= after && taken < after + Duration::from_millis(10),
                "timed out after {taken:?}, not {after:?}"
            );
        };
        let (conn, server) = pair();
        answering(server, vec![Some(0), Some(3_000), Some(0), None]);
        // The connection's timer is made for the first exchange's deadline, a second
        // away; the answer comes at once.
        let (answer, _) = timed(conn, post("{}"), secs(1)).await;
        let (status, conn) = answer.unwrap();
        assert_eq!(status, 200);
        // One timer for the connection's life, not one an exchange.
        let timer_of = |conn: &Conn| conn.timer.as_deref().map(std::ptr::from_ref);
        let timer = timer_of(&conn);
        assert!(timer.is_some());
        // A later deadline, eight seconds away: an answer after three is taken (the
        // timer, moved on, does not go off at the earlier one).
        let (answer, taken) = timed(conn, post("{}"), secs(8)).await;
        let (_, conn) = answer.unwrap();
        assert_eq!(taken, Duration::from_secs(3));
        // A nearer deadline than the timer's: moved back to it.
        let (answer, _) = timed(conn, post("{}"), secs(60)).await;
        let (_, conn) = answer.unwrap();
        assert_eq!(timer_of(&conn), timer);
        let (answer, taken) = timed(conn, post("{}"), secs(2)).await;
        timed_out(&answer, taken, 2);

        // Moved on to a later deadline and not answered: it goes off then, not at the
        // deadline it was first set for.
        let (conn, server) = pair();
        answering(server, vec![Some(0), None]);
        let (answer, _) = timed(conn, post("{}"), secs(1)).await;
        let (_, conn) = answer.unwrap();
        let (answer, taken) = timed(conn, post("{}"), secs(4)).await;
        timed_out(&answer, taken, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn an_exchange_that_cannot_write_its_request_ends_at_its_deadline() {
        use std::time::Duration;
        // A backend that reads nothing: the request fills the pipe and waits.
        let (a, _server) = tokio::io::duplex(64);
        let conn = Conn::new(Box::new(a), HeaderValue::from_str("b").ok());
        let big = "x".repeat(64 * 1024);
        let req = http::Request::post("http://b/v1/chat/completions")
            .body(Bytes::from(big))
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let (answer, taken) =
            tokio::time::timeout(Duration::from_secs(60), timed(conn, req, deadline))
                .await
                .expect("the deadline ends the exchange");
        assert!(
            matches!(answer, Err(SendError::TimedOut)),
            "{:?}",
            answer.map(|(status, _)| status)
        );
        assert!(taken < Duration::from_millis(5_010), "{taken:?}");
    }

    #[tokio::test]
    async fn sends_origin_form_with_host_and_reuses_after_a_sized_body() {
        let (conn, mut server) = pair();
        let (resp, back) = exchange(
            conn,
            &mut server,
            post("{\"a\":1}"),
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Ratelimit-Remaining-Tokens: 9\r\nContent-Length: 5\r\n\r\nhello",
        )
        .await;
        let resp = resp.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-ratelimit-remaining-tokens"], "9");
        assert_eq!(resp.headers()["content-type"], "application/json");
        assert_eq!(
            http_body::Body::size_hint(resp.body()).exact(),
            Some(5),
            "a sized body says its size"
        );
        let body = resp.into_body();
        // The whole body came with the head: it ends with its data, and the connection
        // is free at once.
        assert_eq!(read_all(body).await.unwrap(), "hello");
        let sent = received(&mut server).await;
        assert_eq!(
            sent,
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: backend.example:8080\r\nx-request-id: r1\r\ncontent-length: 7\r\n\r\n{\"a\":1}"
        );
        let conn = back.take().expect("connection given back");
        let (resp, back) = exchange(
            conn,
            &mut server,
            post("{}"),
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        )
        .await;
        assert_eq!(read_all(resp.unwrap().into_body()).await.unwrap(), "ok");
        assert!(back.take().is_some(), "reused again");
    }

    #[tokio::test]
    async fn bodies_larger_than_the_read_room_come_whole() {
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut sized =
            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", big.len()).into_bytes();
        sized.extend_from_slice(&big);
        let mut chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        chunked.extend_from_slice(format!("{:x}\r\n", big.len()).as_bytes());
        chunked.extend_from_slice(&big);
        chunked.extend_from_slice(b"\r\n0\r\n\r\n");
        for response in [sized, chunked] {
            let (resp, back, _server) = respond(&response).await;
            assert_eq!(read_all(resp.unwrap().into_body()).await.unwrap(), big);
            let conn = back.take().expect("given back");
            assert!(conn.room > READ_ROOM, "reads that fill their room get more");
        }
    }

    #[tokio::test]
    async fn request_headers_length_and_host() {
        let (conn, mut server) = pair();
        let req = http::Request::get("http://b/v1/models")
            .header(header::HOST, "kept.example")
            .header(header::CONTENT_LENGTH, "99")
            .header(header::TRANSFER_ENCODING, "chunked")
            .body(Bytes::new())
            .unwrap();
        let (resp, _) = exchange(conn, &mut server, req, b"HTTP/1.1 204 No Content\r\n\r\n").await;
        assert_eq!(resp.unwrap().status(), 204);
        assert_eq!(
            received(&mut server).await,
            "GET /v1/models HTTP/1.1\r\nhost: backend.example:8080\r\n\r\n",
            "the connection's Host, not the request's; a GET with no body has no length; the client's length and coding are not passed on"
        );
        let (conn, mut server) = pair();
        let req = http::Request::delete("http://b/v1/files/f")
            .body(Bytes::new())
            .unwrap();
        let (resp, _) = exchange(
            conn,
            &mut server,
            req,
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        resp.unwrap();
        assert!(received(&mut server)
            .await
            .ends_with("content-length: 0\r\n\r\n"));
    }

    #[tokio::test]
    async fn the_credential_is_written_in_place_of_the_headers_of_its_name() {
        let (conn, mut server) = pair();
        let mut headers = HeaderMap::new();
        headers.append("api-key", HeaderValue::from_static("client"));
        headers.append("x-request-id", HeaderValue::from_static("r1"));
        let (name, key) = (
            HeaderName::from_static("api-key"),
            HeaderValue::from_static("backend"),
        );
        let (scheme, authority) = (
            http::uri::Scheme::HTTP,
            http::uri::Authority::from_static("b"),
        );
        let req = UpstreamRequest::new(
            &Method::POST,
            (&scheme, &authority),
            "/v1/embeddings?x=1",
            crate::upstream::SharedHeaders::Map(&headers),
            Some((&name, &key)),
            Bytes::from_static(b"{}"),
        )
        .unwrap();
        server
            .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            .await
            .unwrap();
        let resp = conn.send(&req, Back::default(), far()).await.unwrap();
        assert_eq!(resp.status, 204);
        assert_eq!(
            received(&mut server).await,
            "POST /v1/embeddings?x=1 HTTP/1.1\r\nhost: backend.example:8080\r\nx-request-id: r1\r\napi-key: backend\r\ncontent-length: 2\r\n\r\n{}"
        );
    }

    #[tokio::test]
    async fn empty_bodies_end_at_once_and_free_the_connection() {
        for response in [
            &b"HTTP/1.1 204 No Content\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
        ] {
            let (resp, back, _server) = respond(response).await;
            let resp = resp.unwrap();
            assert!(http_body::Body::is_end_stream(resp.body()));
            assert!(back.take().is_some(), "given back before the body is read");
            assert_eq!(read_all(resp.into_body()).await.unwrap(), "");
        }
        // A HEAD response's length is the resource's, not a body's.
        let (conn, mut server) = pair();
        let req = http::Request::head("http://b/x")
            .body(Bytes::new())
            .unwrap();
        let (resp, back) = exchange(
            conn,
            &mut server,
            req,
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n",
        )
        .await;
        assert_eq!(read_all(resp.unwrap().into_body()).await.unwrap(), "");
        assert!(back.take().is_some());
    }

    #[tokio::test]
    async fn a_chunked_stream_is_passed_on_chunk_by_chunk_as_it_comes() {
        let (resp, back, mut server) = respond(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n").await;
        let mut body = resp.unwrap().into_body();
        for event in ["data: one\n\n", "data: two\n\n"] {
            server
                .write_all(format!("{:x};ext=1\r\n{event}\r\n", event.len()).as_bytes())
                .await
                .unwrap();
            let frame = body.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), event);
        }
        // The last data and the end in one read: the data ends the body.
        server
            .write_all(b"e\r\ndata: [DONE]\n\n\r\n0\r\nx-trailer: t\r\n\r\n")
            .await
            .unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "data: [DONE]\n\n");
        assert!(http_body::Body::is_end_stream(&body));
        assert!(back.take().is_some(), "free once the end is read");
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn an_answer_before_the_whole_request_is_taken_is_the_response() {
        // A pipe that takes 1 KiB, and a backend that answers a 64 KiB request at once
        // without reading it.
        let (a, mut server) = tokio::io::duplex(1024);
        let conn = Conn::new(Box::new(a), None);
        server
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\n\r\nbig!")
            .await
            .unwrap();
        let req = http::Request::post("http://b/v1/embeddings")
            .body(Bytes::from(vec![b'x'; 64 * 1024]))
            .unwrap();
        let back = Back::default();
        let sending = send(conn, req, back.clone());
        let resp = tokio::time::timeout(std::time::Duration::from_secs(10), sending)
            .await
            .expect("the answer was not seen while writing")
            .unwrap();
        assert_eq!(resp.status(), 413);
        assert_eq!(read_all(resp.into_body()).await.unwrap(), "big!");
        assert!(
            back.take().is_none(),
            "the rest of the request was never sent"
        );
    }

    /// Takes every write and never finishes a flush, as a TLS stream whose records wait
    /// for the socket does.
    struct HeldFlush(DuplexStream);

    impl Io for HeldFlush {}

    impl AsyncRead for HeldFlush {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.0).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for HeldFlush {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Pin::new(&mut self.0).poll_write(cx, buf)
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Pending
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Pending
        }
    }

    /// An idle TCP connection to a backend is open until the backend sends something
    /// (an answer to no request) or closes it; the check waits for nothing.
    #[tokio::test]
    async fn an_idle_tcp_connection_is_closed_once_the_backend_writes_or_closes() {
        /// Whether the check says closed within a few seconds (the runtime sees the
        /// socket's readiness only when it polls for events).
        async fn seen_closed(tcp: &mut tokio::net::TcpStream) -> bool {
            for _ in 0..200 {
                if tcp.closed_while_idle() {
                    return true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            false
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        for ends in ["writes", "closes"] {
            let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut backend, _) = listener.accept().await.unwrap();
            // Exchanges go on while it is open: it is never taken for closed.
            for _ in 0..3 {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                assert!(!tcp.closed_while_idle(), "{ends}: open");
            }
            tcp.write_all(b"ping").await.unwrap();
            let mut got = [0u8; 4];
            backend.read_exact(&mut got).await.unwrap();
            assert!(!tcp.closed_while_idle(), "{ends}: still open");
            match ends {
                "writes" => backend.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap(),
                _ => drop(backend),
            }
            assert!(seen_closed(&mut tcp).await, "{ends}");
        }
    }

    #[tokio::test]
    async fn a_refusal_is_seen_while_the_request_waits_to_be_flushed() {
        let (a, mut server) = tokio::io::duplex(1 << 20);
        let conn = Conn::new(Box::new(HeldFlush(a)), None);
        server
            .write_all(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
            .await
            .unwrap();
        let sending = send(conn, post("{}"), Back::default());
        let resp = tokio::time::timeout(std::time::Duration::from_secs(10), sending)
            .await
            .expect("the answer was not seen while flushing")
            .unwrap();
        assert_eq!(resp.status(), 401);
    }

    #[tokio::test]
    async fn a_success_sent_early_does_not_cut_the_request_short() {
        let (a, mut server) = tokio::io::duplex(1024);
        let conn = Conn::new(Box::new(a), None);
        server
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            .await
            .unwrap();
        // The backend reads the whole request after answering.
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            let whole = |got: &[u8]| {
                memchr::memmem::find(got, b"\r\n\r\n")
                    .is_some_and(|end| got.len() == end + 4 + 64 * 1024)
            };
            while !whole(&got) {
                let n = server.read(&mut buf).await.unwrap();
                assert!(n > 0);
                got.extend_from_slice(&buf[..n]);
            }
            server
        });
        let req = http::Request::post("http://b/v1/embeddings")
            .body(Bytes::from(vec![b'x'; 64 * 1024]))
            .unwrap();
        let back = Back::default();
        let sending = send(conn, req, back.clone());
        let resp = tokio::time::timeout(std::time::Duration::from_secs(10), sending)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(read_all(resp.into_body()).await.unwrap(), "ok");
        // The reader ends only once the whole request has come.
        tokio::time::timeout(std::time::Duration::from_secs(10), reader)
            .await
            .expect("the request was cut short")
            .unwrap();
        assert!(back.take().is_some(), "written whole: reused");
    }

    #[tokio::test]
    async fn informational_responses_are_passed_over() {
        let (resp, _, _server) = respond(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 1\r\n\r\nz").await;
        let resp = resp.unwrap();
        assert_eq!(resp.status(), 201);
        assert!(resp.headers().get("link").is_none());
        assert_eq!(read_all(resp.into_body()).await.unwrap(), "z");
    }

    #[tokio::test]
    async fn connections_that_cannot_carry_another_request_are_not_given_back() {
        for (response, body) in [
            // Closed by the backend's word.
            (&b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"[..], "ok"),
            // HTTP/1.0.
            (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", "ok"),
            // Bytes after the end of the body.
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokextra", "ok"),
            // Both a coding and a length.
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n2\r\nok\r\n0\r\n\r\n", "ok"),
        ] {
            let (resp, back, _server) = respond(response).await;
            assert_eq!(read_all(resp.unwrap().into_body()).await.unwrap(), body);
            assert!(back.take().is_none(), "{}", String::from_utf8_lossy(response));
        }
        // The length beside a coding is not the body's: not passed on.
        let (resp, _, _server) = respond(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n").await;
        let resp = resp.unwrap();
        assert!(resp.headers().get(header::CONTENT_LENGTH).is_none());
        assert_eq!(read_all(resp.into_body()).await.unwrap(), "ok");
        // No length: the body ends when the backend closes.
        let (resp, back, mut server) = respond(b"HTTP/1.1 200 OK\r\n\r\nuntil").await;
        let body = resp.unwrap().into_body();
        server.write_all(b" the end").await.unwrap();
        drop(server);
        assert_eq!(read_all(body).await.unwrap(), "until the end");
        assert!(back.take().is_none());
    }

    #[tokio::test]
    async fn a_body_cut_short_fails_and_its_connection_closes() {
        for response in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n",
        ] {
            let (resp, back, server) = respond(response).await;
            let body = resp.unwrap().into_body();
            drop(server);
            let e = read_all(body).await.unwrap_err();
            assert!(e.to_string().contains("before the end of the body"), "{e}");
            assert!(back.take().is_none());
        }
    }

    #[tokio::test]
    async fn bad_chunked_framing_fails_the_body() {
        for (framing, want) in [
            (&b"2\r\nokX\r\n"[..], "not followed by CRLF"),
            (b"zz\r\n", "invalid chunk size"),
            (b"2\nok\r\n", "not ended by CRLF"),
            (b"0\r\n\n", "trailer line not ended by CRLF"),
        ] {
            let mut response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            response.extend_from_slice(framing);
            let (resp, back, _server) = respond(&response).await;
            let e = read_all(resp.unwrap().into_body()).await.unwrap_err();
            assert!(e.to_string().contains(want), "{e} / {want}");
            assert!(back.take().is_none());
        }
    }

    #[test]
    fn content_lengths_are_read_strictly() {
        let length = |values: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::CONTENT_LENGTH, HeaderValue::from_static(v));
            }
            content_length(&h)
        };
        assert_eq!(length(&[]), Ok(None));
        assert_eq!(length(&["0"]), Ok(Some(0)));
        assert_eq!(length(&[" \t42\t "]), Ok(Some(42)));
        assert_eq!(length(&["5, 5", "5"]), Ok(Some(5)));
        assert_eq!(length(&["18446744073709551615"]), Ok(Some(u64::MAX)));
        for bad in [
            "",
            " ",
            "+1",
            "-1",
            "1x",
            "1 2",
            "0x10",
            "18446744073709551616",
            "5,",
        ] {
            assert_eq!(length(&[bad]), Err("invalid content-length"), "{bad:?}");
        }
        assert_eq!(
            length(&["1", "2"]),
            Err("conflicting content-length values")
        );
    }

    /// The length a head notes as its map is built is the one its map's values give,
    /// for one header or several, plain digits or not: a second `Content-Length` that
    /// differs is still an error, and one that agrees still one length.
    #[test]
    fn the_noted_length_is_the_maps() {
        let cases: [&[&str]; 11] = [
            &[],
            &["0"],
            &["42"],
            &["18446744073709551615"],
            &["18446744073709551616"],
            &[" 42"],
            &["5, 5"],
            &["1x"],
            &["5", "5"],
            &["5", "6"],
            &["5", "x"],
        ];
        for values in cases {
            let mut raw = b"X-Other: 1\r\n".to_vec();
            for v in values {
                raw.extend_from_slice(format!("Content-Length: {v}\r\n").as_bytes());
            }
            raw.extend_from_slice(b"\r\n");
            let lines = raw_headers(&raw);
            let (map, seen) = (lines.to_map(), lines.seen());
            assert_eq!(
                seen.content_length(&map),
                content_length(&map),
                "{values:?}"
            );
            // Read on the way only when it is one value of plain digits (the parser
            // takes the spaces before a value off).
            assert_eq!(
                seen.length.is_some(),
                matches!(values, ["0" | "42" | " 42" | "18446744073709551615"]),
                "{values:?}"
            );
        }
    }

    #[tokio::test]
    async fn bad_response_heads_fail_the_request() {
        let cases: [(&[u8], &str); 7] = [
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n",
                "invalid content-length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                "conflicting content-length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                "invalid content-length",
            ),
            (
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
                "switched protocols",
            ),
            (b"HTCPCP/1.0 418\r\n\r\n", "invalid response head"),
            (
                b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n",
                "invalid response head",
            ),
            (b"HTTP/1.1 200", "in the middle of the response head"),
        ];
        for (response, want) in cases {
            let (conn, mut server) = pair();
            server.write_all(response).await.unwrap();
            server.shutdown().await.unwrap();
            let r = send(conn, post("{}"), Back::default()).await;
            match r {
                Err(SendError::Failed(e)) => assert!(e.to_string().contains(want), "{e} / {want}"),
                other => panic!(
                    "{}: {:?}",
                    String::from_utf8_lossy(response),
                    other.map(|r| r.status())
                ),
            }
        }
        // Equal repeated lengths are one length.
        let (resp, _, _server) =
            respond(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok")
                .await;
        assert_eq!(read_all(resp.unwrap().into_body()).await.unwrap(), "ok");
    }

    #[tokio::test]
    async fn response_heads_have_limits() {
        // One header line longer than the limit, never ended: it is the head's size that
        // stops it, not its count of headers.
        let mut big = b"HTTP/1.1 200 OK\r\nx-filler: ".to_vec();
        big.resize(MAX_HEAD + 4096, b'a');
        let (resp, _, _server) = respond(&big).await;
        match resp {
            Err(SendError::Failed(e)) => assert!(e.to_string().contains("over 64 KiB"), "{e}"),
            _ => panic!("accepted"),
        }
        // A whole head over the limit, the end of which came in one read with more.
        let mut whole = b"HTTP/1.1 200 OK\r\nx-filler: ".to_vec();
        whole.resize(MAX_HEAD + 100, b'a');
        whole.extend_from_slice(b"\r\nContent-Length: 0\r\n\r\n");
        let (resp, _, _server) = respond(&whole).await;
        match resp {
            Err(SendError::Failed(e)) => assert!(e.to_string().contains("over 64 KiB"), "{e}"),
            _ => panic!("accepted"),
        }
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        let (resp, _, _server) = respond(&many).await;
        match resp {
            Err(SendError::Failed(e)) => {
                assert!(e.to_string().contains("more than 128 headers"), "{e}")
            }
            _ => panic!("accepted"),
        }
    }

    /// A `Content-Length` beside a `Transfer-Encoding` is not the body's and is not
    /// passed on; to a HEAD request there is no body, and it is the length a GET would
    /// get.
    #[tokio::test]
    async fn a_stray_length_is_dropped_unless_the_answer_has_no_body() {
        let head = b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n";
        for (method, body, declared) in [
            (Method::HEAD, &b""[..], Some(99)),
            (Method::POST, &b"2\r\nok\r\n0\r\n\r\n"[..], None),
        ] {
            let (conn, mut server) = pair();
            server.write_all(head).await.unwrap();
            server.write_all(body).await.unwrap();
            let mut req = post("{}");
            *req.method_mut() = method.clone();
            let resp = conn
                .send(&UpstreamRequest::of(&req).unwrap(), Back::default(), far())
                .await
                .unwrap();
            assert_eq!(resp.headers.declared_length(), declared, "{method}");
            assert_eq!(
                resp.headers.to_map().contains_key(header::CONTENT_LENGTH),
                declared.is_some(),
                "{method}"
            );
        }
    }

    #[tokio::test]
    async fn a_request_not_written_at_all_is_said_to_be_unsent() {
        let (conn, server) = pair();
        drop(server);
        match send(conn, post("{\"k\":2}"), Back::default()).await {
            Err(SendError::Unsent(e)) => {
                assert!(e.to_string().contains("writing the request"), "{e}")
            }
            other => panic!("{:?}", other.map(|r| r.status())),
        }
        // Written, then no answer: failed, never to be sent again.
        let (conn, mut server) = pair();
        let task = tokio::spawn(async move {
            let _ = received(&mut server).await;
            drop(server);
        });
        match send(conn, post("{}"), Back::default()).await {
            Err(SendError::Failed(e)) => assert!(e.to_string().contains("before answering"), "{e}"),
            other => panic!("{:?}", other.map(|r| r.status())),
        }
        task.await.unwrap();
    }

    #[tokio::test]
    async fn an_idle_connection_shows_a_close_or_unasked_bytes() {
        let (mut conn, server) = pair();
        assert!(!conn.is_closed());
        drop(server);
        assert!(conn.is_closed());
        let (mut conn, mut server) = pair();
        server
            .write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
            .await
            .unwrap();
        assert!(conn.is_closed(), "bytes nobody asked for");
    }

    /// Encodes `chunks` (with an extension on some) and `trailers` as a chunked body.
    fn chunked(chunks: &[Vec<u8>], trailers: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, c) in chunks.iter().filter(|c| !c.is_empty()).enumerate() {
            if i % 2 == 0 {
                out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            } else {
                out.extend_from_slice(format!("{:X} ; name=\"v\"\r\n", c.len()).as_bytes());
            }
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n");
        if trailers {
            out.extend_from_slice(b"x-checksum: abc\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    proptest::proptest! {
        /// Whatever the chunks and however the bytes arrive, the data comes out whole,
        /// the end is found where it is, and what follows is left unread.
        #[test]
        fn chunked_decoding_is_the_same_however_the_bytes_arrive(
            chunks in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..300), 0..8),
            trailers in proptest::bool::ANY,
            cuts in proptest::collection::vec(1usize..64, 1..40),
        ) {
            let mut wire = chunked(&chunks, trailers);
            let end = wire.len();
            wire.extend_from_slice(b"NEXT");
            let mut framing = Framing::Chunked(Chunk::Size);
            let mut buf = BytesMut::new();
            let mut data = Vec::new();
            let mut fed = 0;
            let mut cut = cuts.iter().cycle();
            let total: usize = chunks.iter().map(Vec::len).sum();
            loop {
                match decode(&mut framing, &mut buf, true).unwrap() {
                    Step::Data(d) => {
                        data.extend_from_slice(&d);
                        // The last data, with the end of the body already read: the
                        // body ends with it.
                        if data.len() == total && fed >= end {
                            proptest::prop_assert_eq!(framing, Framing::Done);
                        }
                    }
                    Step::End => break,
                    Step::NeedMore => {
                        proptest::prop_assert!(fed < end, "wants more past the end");
                        let n = (*cut.next().unwrap()).min(wire.len() - fed);
                        buf.extend_from_slice(&wire[fed..fed + n]);
                        fed += n;
                    }
                }
            }
            proptest::prop_assert_eq!(data, chunks.concat());
            let mut rest = buf.to_vec();
            rest.extend_from_slice(&wire[fed..]);
            proptest::prop_assert_eq!(&rest[..], b"NEXT");
        }
    }

    #[test]
    fn bad_framing_after_data_is_reported_after_the_data() {
        let mut framing = Framing::Chunked(Chunk::Size);
        let mut buf = BytesMut::from(&b"2\r\nok\r\nzz\r\n"[..]);
        match decode(&mut framing, &mut buf, true) {
            Ok(Step::Data(d)) => assert_eq!(&d[..], b"ok"),
            _ => panic!("the data first"),
        }
        // Moved past the CRLF, stopped at the bad size line: found again now.
        assert_eq!(framing, Framing::Chunked(Chunk::Size));
        let e = decode(&mut framing, &mut buf, true).err().unwrap();
        assert!(e.to_string().contains("invalid chunk size"), "{e}");
        // A trailer line in error leaves the count of trailer bytes as it was.
        let mut framing = Framing::Chunked(Chunk::Trailers(3));
        let mut buf = BytesMut::from(&b"x: y\n"[..]);
        assert!(decode(&mut framing, &mut buf, true).is_err());
        assert_eq!(framing, Framing::Chunked(Chunk::Trailers(3)));
    }

    #[test]
    fn chunk_sizes() {
        assert_eq!(chunk_size(b"1a\r").unwrap(), 26);
        assert_eq!(chunk_size(b"FF;a=b\r").unwrap(), 255);
        assert_eq!(chunk_size(b"10 \r").unwrap(), 16);
        assert_eq!(chunk_size(b"ffffffffffffffff\r").unwrap(), u64::MAX);
        assert_eq!(chunk_size(b"000000000000000000001a\r").unwrap(), 26);
        assert_eq!(chunk_size(b"00000000000000000000\r").unwrap(), 0);
        assert_eq!(chunk_size(b"aF09\t\r").unwrap(), 0xaf09);
        assert_eq!(chunk_size(b"0;last\r").unwrap(), 0);
        for bad in [
            &b"\r"[..],
            b"g\r",
            b"1a",
            b"1 2\r",
            b"10000000000000000\r",
            b"-1\r",
            b"5\r\r",
            b"5\x0c\r",
            b"5;a\rb\r",
            b"0x1\r",
            b" 1\r",
            b";\r",
        ] {
            assert!(chunk_size(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
