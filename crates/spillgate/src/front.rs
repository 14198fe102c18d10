//! Client connections: HTTP/1.1 served straight off the socket.
//!
//! hyper's server connection kept an 8 KiB read buffer and an 8 KiB write buffer for as
//! long as the connection was open, 80 MB of the gateway's memory at 5,000 open streams,
//! and copied each response through its write buffer. Here a request head is parsed with
//! httparse into a read buffer that is let go of once the request is read (an open stream
//! holds none), header values share the head's bytes, and a response's head goes out in
//! one `writev` with its first data when the body has that ready (else alone, at once).
//!
//! Each connection is one task: it reads a head, calls the handler, and polls the
//! handler's future itself. The handler answers a [`Reply`]: a response, whose head is
//! written from its header map, or a backend's answer relayed with its header lines as
//! they came (see [`crate::proxy::Relay`]). The request body reads the same socket when
//! the handler polls it; once it has been read, the socket is watched for the client
//! going away, which drops (and so cancels) the request in flight. Requests are answered
//! in order; one sent before the previous answer (pipelined) waits in the buffer.
//!
//! What it does not do, because the gateway's clients never need it: upgrades, HTTP/2,
//! or trailers (received ones are dropped; none are sent).

use std::future::{poll_fn, Future};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, Method, StatusCode, Uri, Version};
use http_body::{Body as _, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::errors::GatewayError;
use crate::h1::{self, Chunk, Framing, Part, Step};
use crate::lock;

/// What a client may send, and how long it has.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest request head (request line and headers), in bytes.
    pub max_head: usize,
    /// Most header lines in a request head.
    pub max_headers: usize,
    /// Time a client has for a whole request head, from when the connection is ready
    /// for one (opened, or done with the previous request): an idle connection closes
    /// after it.
    pub header_timeout: Duration,
    /// Time one write of a response may wait for the client to make room for it (it
    /// reads nothing): the connection closes after it, and the response's body (the
    /// backend's stream) is dropped.
    pub send_timeout: Duration,
}

/// Header slots for the most `server.max_headers` allows.
const HEADER_SLOTS: usize = spillgate_core::config::MAX_HEADERS_LIMIT as usize;
/// Header slots on the stack for a head's first parse: clients send far fewer (the
/// OpenAI SDK about fifteen), and a head with more is parsed again into as many slots
/// as the limit allows, in a vector.
const QUICK_SLOTS: usize = 32;
/// How long a closing connection reads what the client still sends, and how much.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 256 * 1024;
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// The read side of a connection: the connection's, lent to the body of the request being
/// served while that body reads from the socket (see [`Reader`]; both are polled by the
/// connection's task, one after the other).
struct Input {
    io: OwnedReadHalf,
    /// Bytes read and not yet used.
    buf: BytesMut,
    /// Room the next new read buffer gets.
    room: usize,
    /// How far the buffer was searched for the end of a head.
    scanned: usize,
    /// The request body's framing; `Done` once it has been read (or when there is none).
    body: Framing,
    /// False once a request body failed or was cut short: the connection cannot carry
    /// another request.
    intact: bool,
    /// Where the request's `Expect: 100-continue` stands.
    expect: Continue,
}

/// A client that sent `Expect: 100-continue` waits for `100 Continue` before its body; it
/// is sent when the body is first read (a request refused before its body is read, 401
/// say, is answered without the client sending it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Continue {
    /// Not asked for, or already sent.
    No,
    /// Asked for; the body has not been read yet.
    Wanted,
    /// The body is being read: the connection sends it now.
    Due,
}

/// The read side while lent to a request's body, locked with [`crate::lock`]: never
/// across an await, nor while the other side runs; a panic while it was held has already
/// ended the connection's task.
type Shared = Arc<Mutex<Input>>;

/// The read side as the connection holds it: its own until a request's body has bytes
/// still to read from the socket, then shared with that body and the ones after it. A
/// body that came whole with its head (a JSON request sent in one write) is taken off the
/// buffer at once and read from no socket: a connection whose bodies all come so serves
/// them without a lock or a shared reference, which were 14 atomic instructions a JSON
/// request (`bench/instructions.sh` with `LOCKS=1`). Once lent, the input stays shared
/// for the rest of the connection, as it always was before: the OpenAI Python SDK writes
/// a request's body after its head, and the gateway mostly reads them apart, so taking
/// the input back after each such body and lending it again cost an allocation and its
/// free each time (counted with a throwaway load that sent each body 20 ms after its head:
/// 26,414 instructions of the tasks a request taken back, 26,293 staying shared).
enum Reader {
    Own(Input),
    Lent(Shared),
}

#[cfg(test)]
thread_local! {
    /// How many times this thread's connections used their input locked, lent to a
    /// body (for the tests).
    static LENT_USES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Reader {
    /// Runs `f` on the input, locking it when it is lent.
    fn with<R>(&mut self, f: impl FnOnce(&mut Input) -> R) -> R {
        match self {
            Reader::Own(input) => f(input),
            Reader::Lent(shared) => {
                #[cfg(test)]
                LENT_USES.with(|n| n.set(n.get() + 1));
                f(&mut lock(shared))
            }
        }
    }

    /// The input shared with a body: the connection keeps one reference, the body gets
    /// the other.
    fn lend(self) -> (Reader, Shared) {
        let shared = match self {
            Reader::Own(input) => Arc::new(Mutex::new(input)),
            Reader::Lent(shared) => shared,
        };
        (Reader::Lent(Arc::clone(&shared)), shared)
    }
}

impl Input {
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        h1::poll_fill(&mut self.io, &mut self.buf, &mut self.room, cx)
    }

    /// Whether the client went away (closed its side, or the connection failed) while its
    /// request is served. Only once the request body has been read: before, the bytes are
    /// the body's. Once something else arrives (a next request, kept for its turn), the
    /// socket is not watched: a client that sends its next request and then closes its
    /// side still gets both answers.
    fn poll_gone(&mut self, cx: &mut Context<'_>) -> bool {
        if self.body != Framing::Done || !self.intact || !self.buf.is_empty() {
            return false;
        }
        // The read goes to the stack (see `h1::poll_fill`): an open stream holds no read
        // buffer.
        matches!(self.poll_fill(cx), Poll::Ready(Ok(0) | Err(_)))
    }

    /// The request body, taken off the buffer when all of it is there already (a body of
    /// known length that came with its head, as a small one nearly always does). Its
    /// framing is then `Done`.
    fn take_whole(&mut self) -> Option<Bytes> {
        let Framing::Length(n) = self.body else {
            return None;
        };
        let n = usize::try_from(n).ok().filter(|&n| n <= self.buf.len())?;
        self.body = Framing::Done;
        Some(h1::take_front(&mut self.buf, n))
    }

    /// Whether the buffer may hold a whole head: it has an empty line (a head ends with
    /// one). Searches only what was not searched before, so a head that trickles in is
    /// not parsed again for every byte.
    fn may_hold_head(&mut self) -> bool {
        let from = self.scanned.saturating_sub(2);
        self.scanned = self.buf.len();
        let buf = &self.buf[..];
        memchr::memchr_iter(b'\n', &buf[from..]).any(|i| {
            let rest = &buf[from + i + 1..];
            rest.starts_with(b"\n") || rest.starts_with(b"\r\n")
        })
    }
}

/// A request as the listener gives it to its handler: its headers as they came, not a
/// `HeaderMap` (see [`h1::RawHeaders`]). Building the map, filtering it on the way
/// upstream and dropping it was about 1,900 instructions a JSON request, 8,000 with the
/// OpenAI SDK's headers (callgrind), for headers that nearly all go upstream as they are.
pub struct Request<B> {
    pub method: Method,
    pub uri: Uri,
    pub version: Version,
    pub headers: h1::RawHeaders,
    pub body: B,
}

impl<B> Request<B> {
    /// `req`, its headers made lines (see [`h1::RawHeaders::from_map`]).
    pub fn from_http(req: http::Request<B>) -> Request<B> {
        let (parts, body) = req.into_parts();
        Request {
            headers: h1::RawHeaders::from_map(&parts.headers),
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            body,
        }
    }

    /// As an `http::Request`, the headers in a map.
    pub fn into_http(self) -> http::Request<B> {
        let mut req = http::Request::new(self.body);
        *req.headers_mut() = self.headers.to_map();
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.version_mut() = self.version;
        req
    }

    /// With its body made `f(body)`.
    pub fn map<C>(self, f: impl FnOnce(B) -> C) -> Request<C> {
        Request {
            method: self.method,
            uri: self.uri,
            version: self.version,
            headers: self.headers,
            body: f(self.body),
        }
    }
}

/// A request's body as the proxy reads it: a client connection's own
/// ([`RequestBody`]) as it is, any other (the tests', a simulation's) as a `Body`. Not
/// boxed as a `Body` for a connection's: that was an allocation and its free for every
/// request, and a dynamic call and an error conversion for each poll of it.
pub struct ClientBody(ClientKind);

enum ClientKind {
    Wire(RequestBody),
    Other(axum::body::Body),
}

impl ClientBody {
    /// `body`, kept as it is when it is a connection's own.
    pub fn new<B>(body: B) -> ClientBody
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<axum::BoxError>,
    {
        let mut body = Some(body);
        let wire = (&mut body as &mut dyn std::any::Any)
            .downcast_mut::<Option<RequestBody>>()
            .and_then(Option::take);
        match (wire, body) {
            (Some(wire), _) => ClientBody(ClientKind::Wire(wire)),
            (None, Some(other)) => ClientBody(ClientKind::Other(axum::body::Body::new(other))),
            // Taken only when it was a connection's (the first arm).
            (None, None) => ClientBody(ClientKind::Other(axum::body::Body::empty())),
        }
    }
}

impl http_body::Body for ClientBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match &mut self.get_mut().0 {
            ClientKind::Wire(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|frame| frame.map(|f| f.map_err(axum::Error::new))),
            ClientKind::Other(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            ClientKind::Wire(b) => b.is_end_stream(),
            ClientKind::Other(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            ClientKind::Wire(b) => b.size_hint(),
            ClientKind::Other(b) => b.size_hint(),
        }
    }
}

/// A request's body: taken whole with its head, or read from its connection as the
/// handler polls it.
pub struct RequestBody {
    source: Source,
    hint: SizeHint,
}

/// Where a [`RequestBody`]'s bytes come from.
enum Source {
    /// All of them, taken off the connection's buffer with the head (see
    /// [`Input::take_whole`]).
    Whole(Bytes),
    /// The connection, read as the body is polled.
    Wire(Shared),
    /// The body has ended (or there is none).
    Ended,
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = h1::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h1::Error>>> {
        if let Source::Whole(data) = &mut self.source {
            let data = std::mem::take(data);
            self.source = Source::Ended;
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        let Source::Wire(shared) = &self.source else {
            return Poll::Ready(None);
        };
        let mut input = lock(shared);
        let ended = loop {
            let Input { buf, body, .. } = &mut *input;
            match h1::decode(body, buf, true) {
                Ok(Step::Data(data)) => {
                    // Its last bytes (usually all of it, in one piece): the next poll
                    // finds the end without locking the connection's input again.
                    if *body == Framing::Done {
                        drop(input);
                        self.source = Source::Ended;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Step::End) => break None,
                Ok(Step::NeedMore) => {}
                Err(e) => break Some(e),
            }
            // The client waits to be asked: the connection asks, then polls again.
            match input.expect {
                Continue::No => {}
                Continue::Wanted => {
                    input.expect = Continue::Due;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Continue::Due => return Poll::Pending,
            }
            match std::task::ready!(input.poll_fill(cx)) {
                Ok(0) => {
                    break Some(h1::Error::new(
                        "the client closed the connection before the end of the request body",
                    ))
                }
                Ok(_) => {}
                Err(e) => break Some(h1::Error::new(format!("reading the request body: {e}"))),
            }
        };
        if ended.is_some() {
            input.intact = false;
        }
        drop(input);
        self.source = Source::Ended;
        Poll::Ready(ended.map(Err))
    }

    fn is_end_stream(&self) -> bool {
        match &self.source {
            Source::Whole(_) => false,
            Source::Wire(shared) => lock(shared).body == Framing::Done,
            Source::Ended => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

/// Takes a complete request head off the front of `buf`, as a request without its body,
/// or returns `None` when it is not all there yet. A head over the limits is refused
/// with 431, a malformed one with 400.
///
/// Not inlined, and with [`QUICK_SLOTS`] slots on the stack rather than the limit's
/// (up to 1,000 of 32 bytes each): inlined into the connection's poll with all of them,
/// the poll's stack frame was 36 KB (7.7 KB without), probed page by page each time it
/// ran (about 16 of the data cache's misses a request, callgrind) and pushing the
/// request's whole call chain that far down the stack.
#[inline(never)]
fn parse_head(
    buf: &mut BytesMut,
    limits: &Limits,
    last: &mut LastTarget,
) -> Result<Option<Request<()>>, GatewayError> {
    let too_large = |what: String| {
        GatewayError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            "request_head_too_large",
            what,
        )
    };
    let max = limits.max_headers.min(HEADER_SLOTS);
    let mut quick = [const { MaybeUninit::uninit() }; QUICK_SLOTS];
    let mut many = Vec::new();
    let (req, parsed) = match parse_request(buf, &mut quick[..max.min(QUICK_SLOTS)]) {
        (_, Err(httparse::Error::TooManyHeaders)) if max > QUICK_SLOTS => {
            many.resize_with(max, MaybeUninit::uninit);
            parse_request(buf, &mut many)
        }
        first => first,
    };
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) if len <= limits.max_head => len,
        Ok(httparse::Status::Partial) if buf.len() <= limits.max_head => return Ok(None),
        Ok(_) => {
            return Err(too_large(format!(
                "The request head is larger than this gateway's limit of {} bytes (server.max_header_bytes).",
                limits.max_head
            )))
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(too_large(format!(
                "The request has more headers than this gateway's limit of {} (server.max_headers).",
                limits.max_headers
            )))
        }
        Err(e) => {
            return Err(GatewayError::bad_request(
                "invalid_request_head",
                format!("The request head could not be parsed: {e}."),
            ))
        }
    };
    let method = Method::from_bytes(req.method.unwrap_or_default().as_bytes())
        .map_err(|_| GatewayError::bad_request("invalid_request_head", "Invalid method."))?;
    let version = h1::version(req.version);
    // Where the target lies, to cut it from the head once it is taken off the buffer.
    let path = Part::of(buf, req.path.unwrap_or_default().as_bytes());
    let mut spans = h1::HeadSpans::new();
    spans.record(buf, req.headers);
    // httparse accepted each name and value: the bytes a `HeaderName` and a
    // `HeaderValue` accept (see `HeadSpans::take_raw`).
    let headers = spans.take_raw(buf, len);
    let uri = last.uri(headers.head().get(path.range()).unwrap_or_default())?;
    Ok(Some(Request {
        method,
        uri,
        version,
        headers,
        body: (),
    }))
}

/// httparse's reading of the request head at the start of `buf`, into `slots`.
fn parse_request<'h, 'b>(
    buf: &'b [u8],
    slots: &'h mut [MaybeUninit<httparse::Header<'b>>],
) -> (httparse::Request<'h, 'b>, httparse::Result<usize>) {
    let mut req = httparse::Request::new(&mut []);
    let parsed =
        httparse::ParserConfig::default().parse_request_with_uninit_headers(&mut req, buf, slots);
    (req, parsed)
}

/// A connection's last request target and its `Uri`: a client sends the same one
/// request after request, which is then cloned rather than parsed again (`http`'s
/// parse, byte by byte, was about 370 instructions a request, callgrind). The target is
/// kept in a copy of its own: a slice of the request head would hold the connection's
/// read buffer, which could then not be reused. A target longer than
/// [`LastTarget::MAX`] is parsed each time and not kept. A new connection starts from
/// the target its thread kept last (clients of one gateway mostly send the same few), so
/// that its first request is not parsed either: a connection's first target, parsed and
/// copied, was about 450 instructions of its first request (callgrind).
struct LastTarget(Option<(Bytes, Uri)>);

thread_local! {
    /// The target a connection of this thread kept last, for the next new connection.
    static THREAD_TARGET: std::cell::RefCell<Option<(Bytes, Uri)>> =
        const { std::cell::RefCell::new(None) };
}

impl LastTarget {
    /// The longest target kept (API paths with their query are far shorter).
    const MAX: usize = 512;

    /// A new connection's: the target its thread kept last, if any.
    fn seeded() -> Self {
        LastTarget(THREAD_TARGET.with_borrow(Clone::clone))
    }

    /// `target` as a `Uri`, the last one's when it is the same bytes.
    fn uri(&mut self, target: &[u8]) -> Result<Uri, GatewayError> {
        if let Some((last, uri)) = &self.0 {
            if last[..] == *target {
                return Ok(uri.clone());
            }
        }
        let copy = Bytes::copy_from_slice(target);
        let uri = Uri::from_maybe_shared(copy.clone()).map_err(|_| {
            GatewayError::bad_request("invalid_request_head", "Invalid request target.")
        })?;
        if target.len() <= Self::MAX {
            self.0 = Some((copy, uri.clone()));
            THREAD_TARGET.with_borrow_mut(|t| t.clone_from(&self.0));
        }
        Ok(uri)
    }
}

/// The framing of a request body (RFC 9112, section 6.3), and whether the connection can
/// carry another request after it. A `Content-Length` beside a `Transfer-Encoding` is
/// not the body's: it is marked so in `headers` (and no client `Content-Length` or
/// `Transfer-Encoding` goes upstream: the gateway writes its own), and the connection
/// closes after.
fn request_framing(
    version: Version,
    headers: &mut h1::RawHeaders,
) -> Result<(Framing, bool), GatewayError> {
    let seen = headers.seen();
    let mut keep_alive = match version {
        Version::HTTP_10 => seen.connection_has(headers, "keep-alive"),
        _ => !seen.connection_has(headers, "close"),
    };
    let bad = |message: &str| GatewayError::bad_request("invalid_request_framing", message);
    if seen.transfer_encoding {
        // HTTP/1.0 has no transfer codings: a sender that uses one is not to be trusted
        // with where the message ends (RFC 9112, section 6.1).
        if version == Version::HTTP_10 {
            return Err(bad("An HTTP/1.0 request cannot use Transfer-Encoding."));
        }
        if !seen.chunked(headers) {
            return Err(bad(
                "A request with Transfer-Encoding must end it with `chunked`.",
            ));
        }
        keep_alive &= !seen.content_length;
        headers.set_stray_length();
        return Ok((Framing::Chunked(Chunk::Size), keep_alive));
    }
    match seen.content_length(headers) {
        Ok(None | Some(0)) => Ok((Framing::Done, keep_alive)),
        Ok(Some(n)) => Ok((Framing::Length(n), keep_alive)),
        Err(why) => Err(bad(&format!("The request has an {why}."))),
    }
}

/// What the listener writes back to a request: a response, or a backend's answer
/// relayed with its header lines as they came (see [`crate::proxy::Relay`]).
pub enum Reply<B> {
    Response(http::Response<B>),
    Relay(crate::proxy::Relay<B>),
}

/// A relayed answer's body: bytes the gateway already holds whole (nearly every answer
/// that is not a stream), or a body that streams. Not boxed as a `Body`: for a whole
/// answer, that was one allocation and its free, and a dynamic call (through an error
/// conversion) for each poll.
pub enum ReplyBody<B> {
    /// Given once; empty afterwards.
    Whole(Bytes),
    Stream(B),
}

impl<B: From<Bytes>> ReplyBody<B> {
    /// As a body of its own type.
    pub fn into_body(self) -> B {
        match self {
            ReplyBody::Whole(bytes) => B::from(bytes),
            ReplyBody::Stream(body) => body,
        }
    }
}

impl<B> http_body::Body for ReplyBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.get_mut() {
            ReplyBody::Whole(bytes) if bytes.is_empty() => Poll::Ready(None),
            ReplyBody::Whole(bytes) => Poll::Ready(Some(Ok(Frame::data(std::mem::take(bytes))))),
            ReplyBody::Stream(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReplyBody::Whole(bytes) => bytes.is_empty(),
            ReplyBody::Stream(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ReplyBody::Whole(bytes) => SizeHint::with_exact(bytes.len() as u64),
            ReplyBody::Stream(body) => body.size_hint(),
        }
    }
}

impl<B: From<Bytes>> Reply<B> {
    /// As an `http::Response`, a relayed answer's headers built into a map: for a
    /// reply that goes elsewhere than to a client connection (the simulator's load).
    pub fn into_response(self) -> http::Response<B> {
        match self {
            Reply::Response(resp) => resp,
            Reply::Relay(relay) => {
                let (head, body) = relay.into_parts();
                let mut resp = http::Response::new(body.into_body());
                *resp.status_mut() = head.status();
                *resp.headers_mut() = head.to_map();
                resp
            }
        }
    }
}

impl<B: http_body::Body<Data = Bytes> + Unpin> Reply<B> {
    /// Whether the body's length is known before it is sent: a body taken whole, or
    /// one with a declared length. An answer that streams (SSE) has none.
    fn length_known(&self) -> bool {
        match self {
            Reply::Response(resp) => resp.body().size_hint().exact().is_some(),
            Reply::Relay(relay) => relay.body().size_hint().exact().is_some(),
        }
    }
}

/// Where a connection's request future lives: one allocation, made for the first
/// request and written over by each next one, instead of one box a request. Kept
/// between requests whose answers had a known length (about 3 KB a connection in a
/// release build, so a kept-alive connection waiting for its next request holds it, for
/// at most `timeouts.client_header`, after which an idle connection is closed), and let
/// go of when an answer streams: an open stream holds none.
struct FutureSlot<F>(Option<Pin<Box<Option<F>>>>);

#[cfg(test)]
thread_local! {
    /// How many slot allocations this thread has made (for the tests).
    static SLOTS_MADE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl<F: Future> FutureSlot<F> {
    fn new() -> Self {
        FutureSlot(None)
    }

    /// `future`, in the slot's allocation (made now when there is none), to poll until
    /// it is ready and then [`FutureSlot::finish`].
    fn start(&mut self, future: F) -> SlotFuture<'_, F> {
        let slot = match self.0.take() {
            Some(mut slot) => {
                slot.set(Some(future));
                self.0.insert(slot)
            }
            None => {
                #[cfg(test)]
                SLOTS_MADE.with(|n| n.set(n.get() + 1));
                self.0.insert(Box::pin(Some(future)))
            }
        };
        SlotFuture(slot.as_mut())
    }

    /// Drops the future; the allocation too unless `keep`.
    fn finish(&mut self, keep: bool) {
        match &mut self.0 {
            Some(slot) if keep => slot.set(None),
            _ => self.0 = None,
        }
    }
}

/// The future in a [`FutureSlot`]. Not polled again once ready.
struct SlotFuture<'a, F>(Pin<&'a mut Option<F>>);

impl<F: Future> Future for SlotFuture<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self.0.as_mut().as_pin_mut() {
            Some(f) => f.poll(cx),
            // `start` always fills the slot, and `finish` empties it only after.
            None => Poll::Pending,
        }
    }
}

/// A handler's answer as a [`Reply`].
pub trait IntoReply {
    type Body;
    fn into_reply(self) -> Reply<Self::Body>;
}

impl<B> IntoReply for http::Response<B> {
    type Body = B;
    fn into_reply(self) -> Reply<B> {
        Reply::Response(self)
    }
}

impl<B> IntoReply for Reply<B> {
    type Body = B;
    fn into_reply(self) -> Reply<B> {
        self
    }
}

/// How the connection's wait for a head ended.
enum Next {
    Head(Request<()>),
    /// Closed by the client, idle too long, or the gateway is stopping: closes quietly.
    End,
    /// Answered with this error, then closed.
    Refused(GatewayError),
}

/// Serves `stream` until the client closes it, a request says to, or `stopped` turns
/// true (the request in progress is answered first). `handler` answers each request.
///
/// A function rather than a `tower::Service`: a service's future has to be named, so
/// the gateway's was boxed (`Pin<Box<dyn Future>>`), one allocation of about 2.8 KB
/// per request. At that size glibc's malloc passes its per-thread cache by (it stops
/// at 1,032 bytes, and cannot be raised), and the allocation and its free took about
/// 450 instructions of a JSON request (callgrind). The future's type known, the
/// connection keeps one allocation for it from request to request (see
/// [`FutureSlot`]).
pub async fn serve<H, F, B>(
    stream: TcpStream,
    mut handler: H,
    limits: Limits,
    stopped: watch::Receiver<bool>,
) where
    H: FnMut(Request<RequestBody>) -> F,
    F: Future,
    F::Output: IntoReply<Body = B>,
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let (io, out) = stream.into_split();
    let mut out = Out {
        io: out,
        send_timeout: limits.send_timeout,
    };
    // Each response's head is encoded here: one allocation a connection, not one a
    // response (see `respond`).
    let mut head = Vec::new();
    let mut reader = Reader::Own(Input {
        io,
        buf: BytesMut::new(),
        room: h1::READ_ROOM,
        scanned: 0,
        body: Framing::Done,
        intact: true,
        expect: Continue::No,
    });
    // One wait for the stop signal and one timer for the connection's whole life.
    let stop_signal = {
        let mut stopped = stopped.clone();
        async move {
            // A sender dropped without a stop is no stop.
            if stopped.wait_for(|s| *s).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    let mut stop_signal = std::pin::pin!(stop_signal);
    let stopping_at_start = *stopped.borrow();
    let mut timer = std::pin::pin!(tokio::time::sleep(limits.header_timeout));
    // The waker the stop signal and the timer hold, when both wait with it: neither is
    // polled again for each head while it stays so (see the wait below).
    let mut waits_with: Option<Waker> = None;
    let mut last_target = LastTarget::seeded();
    let mut slot = FutureSlot::new();
    loop {
        // When the wait for this head ends. The timer is not moved to it here but when it
        // goes off early, at an earlier request's end of wait (`h1::poll_deadline`): moved
        // with each request of a kept-alive connection, it was taken out of the timer
        // wheel and put back each time (about 120 instructions, callgrind).
        let deadline = crate::now::now() + limits.header_timeout;
        // What the response needs, out of a block: a local the block ends (the request's
        // head, the parse's result) takes no room in the connection's future while the
        // response streams, which may be minutes. The refusals are boxed for the same
        // reason: rare, and their future was the largest state of all. With `respond`'s
        // own trim, the future went from 2,376 to 1,640 bytes and its task's cell from
        // 2,560 to 1,792 (release build, `-Zprint-type-sizes`).
        let (resp, method, version, keep_alive) = {
            let next = poll_fn(|cx| {
                let read = reader.with(|input| loop {
                    if input.may_hold_head() || input.buf.len() > limits.max_head {
                        match parse_head(&mut input.buf, &limits, &mut last_target) {
                            Ok(Some(head)) => {
                                // The buffer now starts after it: searched from its start.
                                input.scanned = 0;
                                break Some(Next::Head(head));
                            }
                            Ok(None) => {}
                            Err(e) => break Some(Next::Refused(e)),
                        }
                    }
                    match input.poll_fill(cx) {
                        Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => break Some(Next::End),
                        Poll::Ready(Ok(_)) => {}
                        Poll::Pending => break None,
                    }
                });
                if let Some(next) = read {
                    return Poll::Ready(next);
                }
                // Looked at only while the connection waits: a request already there is
                // answered (and the connection then closed, `stopped` being read after
                // each response), and polling the signal's `Notify` with every request
                // cost about 190 instructions. Nor polled again while it waits with
                // this task's waker: until a stop is sent (which `has_changed` reads
                // from a counter), polling it would only register the same waker again.
                // The same for the timer, until it goes off: the two polls were about
                // 250 instructions a request (callgrind).
                let waiting = waits_with.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
                if (!waiting || stopped.has_changed().unwrap_or(true))
                    && stop_signal.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Next::End);
                }
                if waiting && !timer.is_elapsed() {
                    return Poll::Pending;
                }
                if h1::poll_deadline(timer.as_mut(), deadline, cx).is_pending() {
                    if !waiting {
                        waits_with = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
                // Part of a head and no more: told so. An idle connection (or one that sent
                // only the empty lines a client may send between requests) just closes.
                let idle =
                    reader.with(|input| input.buf.iter().all(|b| matches!(b, b'\r' | b'\n')));
                Poll::Ready(if idle {
                    Next::End
                } else {
                    Next::Refused(GatewayError::new(
                        StatusCode::REQUEST_TIMEOUT,
                        "invalid_request_error",
                        "request_head_timeout",
                        format!(
                            "The request head did not arrive within {} ms (timeouts.client_header).",
                            limits.header_timeout.as_millis()
                        ),
                    ))
                })
            })
            .await;
            let mut head = match next {
                Next::Head(head) => head,
                Next::End => return,
                Next::Refused(e) => {
                    return Box::pin(refuse(out, reader, e, (&Method::GET, Version::HTTP_11))).await
                }
            };
            let version = head.version;
            let method = head.method.clone();
            let (framing, keep_alive) = match request_framing(version, &mut head.headers) {
                Ok(f) => f,
                Err(e) => return Box::pin(refuse(out, reader, e, (&method, version))).await,
            };
            let hint = framing.size_hint();
            let expects_continue = version == Version::HTTP_11
                && head.headers.seen().expect
                && head
                    .headers
                    .get(&header::EXPECT)
                    .is_some_and(|v| v.eq_ignore_ascii_case(b"100-continue"));
            let (whole, unread) = reader.with(|input| {
                input.body = framing;
                let waits = expects_continue && framing != Framing::Done && input.buf.is_empty();
                input.expect = if waits {
                    Continue::Wanted
                } else {
                    Continue::No
                };
                let whole = input.take_whole();
                (whole, input.body != Framing::Done)
            });
            // Lent to the body only when the body has bytes still to read (never when it
            // was taken whole: its framing is then `Done`).
            let source = match whole {
                Some(data) => Source::Whole(data),
                None if unread => {
                    let (kept, lent) = reader.lend();
                    reader = kept;
                    Source::Wire(lent)
                }
                None => Source::Ended,
            };
            let body = RequestBody { source, hint };
            let req = head.map(|()| body);
            let answered = {
                let mut call = slot.start(handler(req));
                let mut continued = 0;
                poll_fn(|cx| loop {
                    if let Poll::Ready(resp) = Pin::new(&mut call).poll(cx) {
                        return Poll::Ready(Some(resp.into_reply()));
                    }
                    // `None`: poll the call again.
                    let waited = reader.with(|input| {
                        if input.expect == Continue::Due {
                            return match Pin::new(&mut out.io)
                                .poll_write(cx, &CONTINUE[continued..])
                            {
                                Poll::Ready(Ok(n)) if n > 0 => {
                                    continued += n;
                                    if continued == CONTINUE.len() {
                                        // Sent: the body reads from now on.
                                        input.expect = Continue::No;
                                    }
                                    None
                                }
                                Poll::Ready(_) => Some(Poll::Ready(None)),
                                Poll::Pending => Some(Poll::Pending),
                            };
                        }
                        Some(if input.poll_gone(cx) {
                            Poll::Ready(None)
                        } else {
                            Poll::Pending
                        })
                    });
                    if let Some(waited) = waited {
                        return waited;
                    }
                })
                .await
            };
            // Gone: the request in flight is dropped with the connection.
            let Some(resp) = answered else {
                return;
            };
            // Dropped once it has answered: it is done, and a response that streams for
            // minutes would keep what it holds. Its allocation is kept for the
            // connection's next request unless the answer may stream (of unknown
            // length): an open stream then holds none.
            slot.finish(resp.length_known());
            (resp, method, version, keep_alive)
        };
        // Read (a lock) only when a stop may have been sent: `has_changed` says so for
        // any value sent since the receiver this one was cloned from last looked (it
        // counts versions, no lock), and a stop that receiver had seen was read once at
        // the connection's start.
        let stopping =
            stopping_at_start || (stopped.has_changed().unwrap_or(true) && *stopped.borrow());
        let keep_alive = keep_alive && !stopping;
        let request = (&method, version);
        match respond(&mut out, &mut head, &mut reader, resp, request, keep_alive).await {
            Ok(true) => {}
            Ok(false) => return close(out, &mut reader).await,
            Err(e @ WriteError::Stalled(_)) => {
                tracing::info!(error = %e, "client connection closed");
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "client connection ended with an error");
                return;
            }
        }
    }
}

/// Answers `e` to a request (with `method` and `version`, as far as they are known) that
/// cannot be read, and closes the connection.
async fn refuse(mut out: Out, mut reader: Reader, e: GatewayError, request: (&Method, Version)) {
    tracing::debug!(status = e.status.as_u16(), code = e.code, "request refused");
    let _ = respond(
        &mut out,
        &mut Vec::new(),
        &mut reader,
        Reply::Response(e.into_response()),
        request,
        false,
    )
    .await;
    close(out, &mut reader).await;
}

/// The write side of a connection.
struct Out {
    io: OwnedWriteHalf,
    /// [`Limits::send_timeout`].
    send_timeout: Duration,
}

/// Why a response did not go out whole.
#[derive(Debug)]
enum WriteError {
    Io(std::io::Error),
    /// The client made no room for a write within this (`timeouts.client_send`).
    Stalled(Duration),
    /// The client went away while the body was awaited.
    Gone,
    /// The response body failed.
    Body(String),
    /// The response body had more or fewer bytes than its `Content-Length`.
    Length,
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Io(e) => write!(f, "writing the response: {e}"),
            WriteError::Gone => f.write_str("the client went away during the response"),
            WriteError::Stalled(d) => write!(
                f,
                "the client read nothing of the response for {} ms (timeouts.client_send)",
                d.as_millis()
            ),
            WriteError::Body(e) => write!(f, "response body failed: {e}"),
            WriteError::Length => f.write_str("response body length differs from its header"),
        }
    }
}

/// What the connection waiting on a response body saw.
enum Event<F> {
    Frame(Option<F>),
    /// The body has nothing yet: the head goes out now.
    Idle,
    Gone,
}

/// Writes `resp` (to a request with `method` and `version`), and says whether the
/// connection can carry another request: `keep_alive` is what the request allowed.
/// The head is encoded into `head`, the connection's buffer for it, kept from response
/// to response while their lengths are known (a malloc and a free less a request), and
/// let go of once a stream's head has gone out, as the request future's slot is.
///
/// The head is encoded before the future is made, which holds only what writing the body
/// needs: a response streams for as long as its body does (minutes for a long
/// completion), and an `async fn` would keep its arguments (the response's parts) and
/// every local in the connection's future all that time.
fn respond<'a, B>(
    out: &'a mut Out,
    head: &'a mut Vec<u8>,
    reader: &'a mut Reader,
    reply: Reply<B>,
    (method, version): (&Method, Version),
    keep_alive: bool,
) -> impl Future<Output = Result<bool, WriteError>> + 'a
where
    B: http_body::Body<Data = Bytes> + Unpin + 'a,
    B::Error: std::fmt::Display,
{
    let (mut status, fields, mut body) = match reply {
        Reply::Response(resp) => {
            let (parts, body) = resp.into_parts();
            (
                parts.status,
                Fields::Map(parts.headers),
                ReplyBody::Stream(body),
            )
        }
        Reply::Relay(relay) => {
            let (lines, body) = relay.into_parts();
            (lines.status(), Fields::Relay(lines), body)
        }
    };
    // A 1xx is never a final answer: one given as such would leave the client waiting for
    // another. Reported as the server error it is.
    let informational = status.is_informational();
    if informational {
        tracing::error!(status = status.as_u16(), "a 1xx status given as a response");
        status = StatusCode::INTERNAL_SERVER_ERROR;
    }
    let no_body = *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    // The body's exact size (what it will give, whatever the headers say), else the
    // handler's own length. For HEAD, the handler's length first: the length a GET would
    // get, where the body has none.
    let exact = body.size_hint().exact();
    let known = match exact {
        Some(n) if *method != Method::HEAD => Some(n),
        _ => match &fields {
            Fields::Map(headers) => h1::content_length(headers).ok().flatten(),
            Fields::Relay(lines) => lines.length(),
        }
        .or(exact),
    };
    let unread = reader.with(|input| input.body != Framing::Done || !input.intact);
    // Also not when the handler's own `Connection` says `close` (seen by `encode_head`).
    let mut reusable = keep_alive && !unread && !informational;
    let mut framing = if no_body {
        Framing::Done
    } else if let Some(n) = known {
        Framing::Length(n)
    } else if version == Version::HTTP_11 {
        Framing::Chunked(Chunk::Size)
    } else {
        // Ends when the connection closes.
        reusable = false;
        Framing::Close
    };
    head.clear();
    // A response to HEAD gives the length a GET would get.
    let length = match framing {
        Framing::Length(n) => Some(n),
        _ if *method == Method::HEAD => known,
        _ => None,
    };
    let chunked = matches!(framing, Framing::Chunked(_));
    encode_head(
        head,
        status,
        &fields,
        length,
        chunked,
        &mut reusable,
        version,
    );
    let streams = known.is_none();
    async move {
        if framing == Framing::Done {
            write_all(out, &mut [IoSlice::new(head)]).await?;
            return Ok(reusable);
        }
        // Sent with the first data, or alone when the body has none ready.
        let mut head_due = true;
        loop {
            if !head_due && streams && head.capacity() > 0 {
                *head = Vec::new();
            }
            let event = poll_fn(|cx| match Pin::new(&mut body).poll_frame(cx) {
                Poll::Ready(f) => Poll::Ready(Event::Frame(f)),
                Poll::Pending if head_due => Poll::Ready(Event::Idle),
                Poll::Pending if reader.with(|input| input.poll_gone(cx)) => {
                    Poll::Ready(Event::Gone)
                }
                Poll::Pending => Poll::Pending,
            })
            .await;
            let head_slice: &[u8] = if std::mem::take(&mut head_due) {
                head
            } else {
                &[]
            };
            let data = match event {
                Event::Idle => {
                    write_all(out, &mut [IoSlice::new(head_slice)]).await?;
                    continue;
                }
                Event::Gone => return Err(WriteError::Gone),
                Event::Frame(Some(Err(e))) => return Err(WriteError::Body(e.to_string())),
                Event::Frame(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => data,
                    // Trailers are not sent.
                    Err(_) => Bytes::new(),
                },
                Event::Frame(None) => {
                    // The end: the last chunk of a chunked body; a sized body must be whole.
                    let end: &[u8] = match framing {
                        Framing::Chunked(_) => b"0\r\n\r\n",
                        Framing::Length(n) if n > 0 => {
                            write_all(out, &mut [IoSlice::new(head_slice)]).await?;
                            return Err(WriteError::Length);
                        }
                        _ => b"",
                    };
                    write_all(out, &mut [IoSlice::new(head_slice), IoSlice::new(end)]).await?;
                    return Ok(reusable);
                }
            };
            let ends = body.is_end_stream();
            match &mut framing {
                Framing::Length(left) => {
                    if data.len() as u64 > *left {
                        return Err(WriteError::Length);
                    }
                    *left -= data.len() as u64;
                    write_all(out, &mut [IoSlice::new(head_slice), IoSlice::new(&data)]).await?;
                    if *left == 0 {
                        // Whatever the body still has (trailers) is not sent.
                        return Ok(reusable);
                    }
                    if ends {
                        return Err(WriteError::Length);
                    }
                }
                Framing::Chunked(_) => {
                    let mut size = [0u8; 20];
                    let size = chunk_line(&mut size, data.len());
                    let (line, tail): (&[u8], &[u8]) = match (data.is_empty(), ends) {
                        (true, false) => (b"", b""),
                        (true, true) => (b"", b"0\r\n\r\n"),
                        (false, false) => (size, b"\r\n"),
                        (false, true) => (size, b"\r\n0\r\n\r\n"),
                    };
                    write_all(
                        out,
                        &mut [
                            IoSlice::new(head_slice),
                            IoSlice::new(line),
                            IoSlice::new(&data),
                            IoSlice::new(tail),
                        ],
                    )
                    .await?;
                    if ends {
                        return Ok(reusable);
                    }
                }
                _ => {
                    write_all(out, &mut [IoSlice::new(head_slice), IoSlice::new(&data)]).await?;
                    if ends {
                        return Ok(reusable);
                    }
                }
            }
        }
    }
}

/// A response's header lines to write: a map's, or a relayed answer's.
enum Fields {
    Map(HeaderMap),
    Relay(crate::proxy::RelayHead),
}

/// `n` in hex and CRLF, in `buf`.
fn chunk_line(buf: &mut [u8; 20], n: usize) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut at = 18;
    let mut n = n;
    buf[18] = b'\r';
    buf[19] = b'\n';
    loop {
        at -= 1;
        buf[at] = HEX[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    &buf[at..]
}

/// The status line and headers. The framing headers are the connection's own
/// (`content-length: length`, or chunked, and `Connection`): any the response had are
/// left out, but a `Connection: close` among them makes the connection not `reusable`.
/// The `Connection` header written says whether it is, as `version` needs it said.
fn encode_head(
    out: &mut Vec<u8>,
    status: StatusCode,
    fields: &Fields,
    length: Option<u64>,
    chunked: bool,
    reusable: &mut bool,
    version: Version,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or_default().as_bytes());
    out.extend_from_slice(b"\r\n");
    // Whether the handler gave a `Date`, noted on the way (a lookup hashes the name).
    let mut dated = false;
    match fields {
        Fields::Map(headers) => {
            for (name, value) in headers {
                if *name == header::CONNECTION {
                    *reusable &= !h1::has_token(value.as_bytes(), "close");
                } else if *name != header::TRANSFER_ENCODING && *name != header::CONTENT_LENGTH {
                    dated |= *name == header::DATE;
                    h1::header_line(out, name, value);
                }
            }
        }
        // Neither framing headers nor `Connection` among them.
        Fields::Relay(lines) => dated = lines.write_headers(out),
    }
    if !dated {
        out.extend_from_slice(b"date: ");
        push_date(out);
        out.extend_from_slice(b"\r\n");
    }
    if let Some(n) = length {
        h1::length_line(out, n);
    }
    if chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    let connection: &[u8] = match (*reusable, version) {
        (false, _) => b"close",
        (true, Version::HTTP_10) => b"keep-alive",
        (true, _) => b"",
    };
    if !connection.is_empty() {
        out.extend_from_slice(b"connection: ");
        out.extend_from_slice(connection);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends the current time as an HTTP date, formatted once a second per thread.
fn push_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, String)> =
            const { std::cell::RefCell::new((u64::MAX, String::new())) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, text)| {
        if *at != secs {
            *at = secs;
            *text = httpdate::fmt_http_date(now);
        }
        out.extend_from_slice(text.as_bytes());
    });
}

/// Writes all of `bufs`, in as few writes as the socket takes.
async fn write_all(out: &mut Out, bufs: &mut [IoSlice<'_>]) -> Result<(), WriteError> {
    let mut bufs = bufs;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        // Tried at once; only a write the client has no room for gets a timer.
        let written =
            match poll_fn(|cx| Poll::Ready(Pin::new(&mut out.io).poll_write_vectored(cx, bufs)))
                .await
            {
                Poll::Ready(r) => r,
                Poll::Pending => {
                    tokio::time::timeout(out.send_timeout, out.io.write_vectored(bufs))
                        .await
                        .map_err(|_| WriteError::Stalled(out.send_timeout))?
                }
            };
        match written {
            Ok(0) => return Err(WriteError::Io(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) => return Err(WriteError::Io(e)),
        }
    }
    Ok(())
}

/// Closes the connection after its last response: the write side first, then what the
/// client still sends is read and dropped for a moment (bounded in time and bytes), so
/// that unread bytes do not make the kernel reset the connection before the client
/// reads the answer.
async fn close(mut out: Out, reader: &mut Reader) {
    let _ = out.io.shutdown().await;
    let mut read = 0;
    let _ = tokio::time::timeout(
        LINGER,
        poll_fn(|cx| {
            reader.with(|input| {
                let mut scratch = [MaybeUninit::<u8>::uninit(); h1::READ_ROOM];
                loop {
                    let mut scratch = tokio::io::ReadBuf::uninit(&mut scratch);
                    match std::task::ready!(Pin::new(&mut input.io).poll_read(cx, &mut scratch)) {
                        Ok(()) if !scratch.filled().is_empty() && read < LINGER_BYTES => {
                            read += scratch.filled().len();
                        }
                        _ => return Poll::Ready(()),
                    }
                }
            })
        }),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Full, StreamBody};
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use tokio::io::AsyncReadExt;

    type Resp = http::Response<BoxBody<Bytes, Infallible>>;

    /// What the test service saw of the requests, and whether a pending one was dropped.
    #[derive(Default)]
    struct Seen {
        calls: AtomicUsize,
        dropped: AtomicBool,
        headers: Mutex<Vec<HeaderMap>>,
    }

    struct DropFlag(Arc<Seen>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.dropped.store(true, Ordering::SeqCst);
        }
    }

    fn full(b: impl Into<Bytes>) -> BoxBody<Bytes, Infallible> {
        Full::new(b.into()).boxed()
    }

    /// A whole body gives its bytes once, then ends; an empty one ends at once; its
    /// length is known, as `respond` frames it by.
    #[tokio::test]
    async fn a_whole_reply_body_gives_its_bytes_once_then_ends() {
        let mut whole: ReplyBody<BoxBody<Bytes, Infallible>> =
            ReplyBody::Whole(Bytes::from_static(b"{\"ok\":1}"));
        assert_eq!(whole.size_hint().exact(), Some(8));
        assert!(!whole.is_end_stream());
        let frame = whole.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), &b"{\"ok\":1}"[..]);
        assert!(whole.is_end_stream());
        assert!(whole.frame().await.is_none());
        let mut empty: ReplyBody<BoxBody<Bytes, Infallible>> = ReplyBody::Whole(Bytes::new());
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));
        assert!(empty.frame().await.is_none());
        // A stream is its own body's.
        let mut stream = ReplyBody::Stream(full("ab"));
        assert_eq!(stream.size_hint().exact(), Some(2));
        let frame = stream.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), &b"ab"[..]);
        // And, for a reply that goes elsewhere, a whole body becomes the same bytes.
        let body: axum::body::Body = ReplyBody::Whole(Bytes::from_static(b"xyz")).into_body();
        assert_eq!(body.collect().await.unwrap().to_bytes(), &b"xyz"[..]);
    }

    /// The test service, by path: `/pending` never answers; `/early` answers without
    /// reading the body; `/empty` answers 204; `/stream` answers two chunks, its length
    /// unknown; `/endless` answers 64 KiB chunks for ever (its body sets `dropped` when
    /// dropped); `/big` answers [`BIG`] bytes at once; anything else answers the method,
    /// the target and the body (read whole), or 400 with the body's error.
    async fn service(seen: Arc<Seen>, req: http::Request<RequestBody>) -> Resp {
        seen.calls.fetch_add(1, Ordering::SeqCst);
        seen.headers.lock().unwrap().push(req.headers().clone());
        let path = req.uri().path().to_string();
        match path.as_str() {
            "/pending" => {
                let _flag = DropFlag(Arc::clone(&seen));
                std::future::pending::<()>().await;
                unreachable!()
            }
            "/early" => http::Response::new(full("early")),
            "/empty" => {
                let mut r = http::Response::new(full(""));
                *r.status_mut() = StatusCode::NO_CONTENT;
                r
            }
            "/endless" => {
                let flag = DropFlag(Arc::clone(&seen));
                let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                let chunks = futures_util::stream::repeat_with(move || {
                    let _alive = &flag;
                    Ok::<_, Infallible>(Frame::data(chunk.clone()))
                });
                http::Response::new(StreamBody::new(chunks).boxed())
            }
            "/big" => http::Response::new(full(vec![b'x'; BIG])),
            "/framed" => {
                // Framing headers of its own: a wrong length, and a close; and a date.
                let mut r = http::Response::new(full("framed"));
                let h = r.headers_mut();
                h.insert(header::CONTENT_LENGTH, http::HeaderValue::from_static("99"));
                h.insert(header::CONNECTION, http::HeaderValue::from_static("close"));
                h.insert(header::DATE, http::HeaderValue::from_static(FRAMED_DATE));
                r
            }
            "/sized" => {
                // What a GET would get, answered to HEAD without a body.
                let mut r = http::Response::new(full(""));
                let h = r.headers_mut();
                h.insert(header::CONTENT_LENGTH, http::HeaderValue::from_static("42"));
                r
            }
            "/stream" => {
                let chunks = futures_util::stream::iter([
                    Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"data: 1\n\n"))),
                    Ok(Frame::data(Bytes::from_static(b"data: 2\n\n"))),
                ]);
                http::Response::new(StreamBody::new(chunks).boxed())
            }
            _ => {
                let target = req.uri().to_string();
                let method = req.method().to_string();
                match req.into_body().collect().await {
                    Ok(body) => {
                        let body = String::from_utf8_lossy(&body.to_bytes()).to_string();
                        http::Response::new(full(format!("{method} {target} {body}")))
                    }
                    Err(e) => {
                        let mut r = http::Response::new(full(format!("body error: {e}")));
                        *r.status_mut() = StatusCode::BAD_REQUEST;
                        r
                    }
                }
            }
        }
    }

    /// The `Date` `/framed` gives.
    const FRAMED_DATE: &str = "Sun, 06 Nov 2005 08:48:37 GMT";

    /// The size of `/big`'s body: far more than the kernel's socket buffers hold.
    const BIG: usize = 32 << 20;

    const LIMITS: Limits = Limits {
        max_head: 8192,
        max_headers: 16,
        header_timeout: Duration::from_secs(10),
        send_timeout: Duration::from_secs(30),
    };

    /// A server on a free loopback port, serving every connection with the test service.
    async fn server(limits: Limits) -> (std::net::SocketAddr, Arc<Seen>, watch::Sender<bool>) {
        server_with(limits, false).await
    }

    /// [`server`], each connection polled with a new waker each time when `fresh_wakers`
    /// (see [`FreshWakers`]).
    async fn server_with(
        limits: Limits,
        fresh_wakers: bool,
    ) -> (std::net::SocketAddr, Arc<Seen>, watch::Sender<bool>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Seen::default());
        let (stop, stopped) = watch::channel(false);
        let s = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let s = Arc::clone(&s);
                let svc = move |req: Request<RequestBody>| {
                    let s = Arc::clone(&s);
                    async move { service(s, req.into_http()).await }
                };
                let conn = serve(stream, svc, limits, stopped.clone());
                if fresh_wakers {
                    tokio::spawn(FreshWakers::new(conn));
                } else {
                    tokio::spawn(conn);
                }
            }
        });
        (addr, seen, stop)
    }

    /// Polls its future with a new waker each time, which wakes the task only while it
    /// is the latest: a future that kept an earlier one for a wait is never woken by it.
    struct FreshWakers<F> {
        future: Pin<Box<F>>,
        latest: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl<F: Future> FreshWakers<F> {
        fn new(future: F) -> Self {
            FreshWakers {
                future: Box::pin(future),
                latest: Arc::default(),
            }
        }
    }

    struct Numbered {
        n: usize,
        latest: Arc<std::sync::atomic::AtomicUsize>,
        task: Waker,
    }

    impl std::task::Wake for Numbered {
        fn wake(self: Arc<Self>) {
            if self.latest.load(Ordering::SeqCst) == self.n {
                self.task.wake_by_ref();
            }
        }
    }

    impl<F: Future> Future for FreshWakers<F> {
        type Output = F::Output;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            let n = self.latest.fetch_add(1, Ordering::SeqCst) + 1;
            let waker = Waker::from(Arc::new(Numbered {
                n,
                latest: Arc::clone(&self.latest),
                task: cx.waker().clone(),
            }));
            self.future.as_mut().poll(&mut Context::from_waker(&waker))
        }
    }

    /// One response read off `sock`: the head as text, and the body (by its length,
    /// chunked, or to the close).
    async fn response(sock: &mut TcpStream, buf: &mut Vec<u8>) -> (String, String) {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = read_more(sock, buf).await;
            assert!(
                n > 0,
                "closed before a whole head: {:?}",
                String::from_utf8_lossy(buf)
            );
        };
        let head = String::from_utf8(buf.drain(..head_end).collect()).unwrap();
        let lower = head.to_ascii_lowercase();
        let mut body = Vec::new();
        if lower.starts_with("http/1.1 204") || lower.starts_with("http/1.1 100") {
            return (head, String::new());
        }
        if let Some(len) = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map(|v| v.trim().parse::<usize>().unwrap())
        {
            while buf.len() < len {
                let n = read_more(sock, buf).await;
                assert!(n > 0, "closed inside the body");
            }
            body.extend(buf.drain(..len));
        } else if lower.contains("transfer-encoding: chunked") {
            loop {
                let text = String::from_utf8_lossy(buf).to_string();
                if let Some(end) = text
                    .find("0\r\n\r\n")
                    .filter(|&i| i == 0 || text[..i].ends_with("\r\n"))
                {
                    // Decode what came before the last chunk.
                    let mut rest = &buf[..end];
                    while !rest.is_empty() {
                        let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
                        let size =
                            usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap(), 16)
                                .unwrap();
                        body.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
                        rest = &rest[eol + 2 + size + 2..];
                    }
                    buf.drain(..end + 5);
                    break;
                }
                let n = read_more(sock, buf).await;
                assert!(n > 0, "closed inside a chunked body");
            }
        } else {
            while read_more(sock, buf).await > 0 {}
            body.append(buf);
        }
        (head, String::from_utf8(body).unwrap())
    }

    /// The head of a response without a body (to HEAD) read off `sock`, as text.
    async fn head_only(sock: &mut TcpStream, buf: &mut Vec<u8>) -> String {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            assert!(read_more(sock, buf).await > 0, "closed before a whole head");
        };
        String::from_utf8(buf.drain(..head_end).collect()).unwrap()
    }

    /// Reads what comes next onto `buf` (0: closed); a test fails rather than waits forever.
    async fn read_more(sock: &mut TcpStream, buf: &mut Vec<u8>) -> usize {
        let mut more = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(60), sock.read(&mut more))
            .await
            .expect("an answer")
            .unwrap();
        buf.extend_from_slice(&more[..n]);
        n
    }

    /// Whether the server closed `sock` (after what was read already).
    async fn closed(sock: &mut TcpStream) -> bool {
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), sock.read(&mut b)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    async fn connect(addr: std::net::SocketAddr, send: &[u8]) -> TcpStream {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        sock.write_all(send).await.unwrap();
        sock
    }

    #[tokio::test]
    async fn stopping_closes_waiting_connections_and_not_one_whose_request_runs() {
        let (addr, _seen, stop) = server(LIMITS).await;
        // Kept alive after its answer, then waiting for its next request.
        let mut idle = connect(addr, b"GET /early HTTP/1.1\r\n\r\n").await;
        assert_eq!(response(&mut idle, &mut Vec::new()).await.1, "early");
        // Waiting for the rest of a head.
        let mut partial = connect(addr, b"GET /early HTTP/1.1\r\nhost:").await;
        // Its request read, its answer pending.
        let mut busy = connect(addr, b"GET /pending HTTP/1.1\r\n\r\n").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(true).unwrap();
        assert!(closed(&mut idle).await);
        assert!(closed(&mut partial).await);
        // The request in progress is not cut: its connection stays open while it runs.
        let mut b = [0u8; 1];
        assert!(
            tokio::time::timeout(Duration::from_millis(200), busy.read(&mut b))
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order_on_one_connection() {
        let (addr, seen, _stop) = server(LIMITS).await;
        let mut sock = connect(
            addr,
            b"POST /echo?a=1 HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello\
              GET /echo HTTP/1.1\r\nhost: x\r\n\r\n\
              POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\ntrailer: t\r\n\r\n",
        )
        .await;
        let mut buf = Vec::new();
        let (head, body) = response(&mut sock, &mut buf).await;
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.contains("content-length: 20\r\n"), "{head}");
        assert!(head.contains("date: "), "{head}");
        assert!(!head.contains("connection:"), "{head}");
        assert_eq!(body, "POST /echo?a=1 hello");
        assert_eq!(response(&mut sock, &mut buf).await.1, "GET /echo ");
        assert_eq!(response(&mut sock, &mut buf).await.1, "POST /echo abcde");
        assert_eq!(seen.calls.load(Ordering::SeqCst), 3);
        // Still open for a fourth.
        sock.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(response(&mut sock, &mut buf).await.1, "GET /echo ");
        let headers = seen.headers.lock().unwrap();
        assert_eq!(headers[0]["host"], "x");
        assert!(headers[2].get("content-length").is_none());
    }

    #[tokio::test]
    async fn heads_with_more_headers_than_the_stack_slots_are_read_up_to_the_limit() {
        let max = QUICK_SLOTS + 8;
        let limits = Limits {
            max_head: 16 * 1024,
            max_headers: max,
            ..LIMITS
        };
        let (addr, seen, _stop) = server(limits).await;
        let mut sock = TcpStream::connect(addr).await.unwrap();
        sock.set_nodelay(true).unwrap();
        let mut buf = Vec::new();
        let head = |n: usize| {
            let lines: String = (0..n).map(|i| format!("h{i}: v{i}\r\n")).collect();
            format!("GET /echo HTTP/1.1\r\n{lines}\r\n").into_bytes()
        };
        for n in [QUICK_SLOTS, QUICK_SLOTS + 1, max] {
            sock.write_all(&head(n)).await.unwrap();
            let (status, _) = response(&mut sock, &mut buf).await;
            assert!(status.starts_with("HTTP/1.1 200"), "{n} headers: {status}");
        }
        // The same, its head in two parts, the first already past the stack's slots.
        let whole = head(max);
        let cut = whole.len() * 9 / 10;
        sock.write_all(&whole[..cut]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        sock.write_all(&whole[cut..]).await.unwrap();
        let (status, _) = response(&mut sock, &mut buf).await;
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        {
            let headers = seen.headers.lock().unwrap();
            let counts: Vec<usize> = headers.iter().map(|h| h.len()).collect();
            assert_eq!(counts, [QUICK_SLOTS, QUICK_SLOTS + 1, max, max]);
            for h in headers.iter() {
                for i in 0..h.len() {
                    assert_eq!(h[format!("h{i}").as_str()], format!("v{i}").as_str());
                }
            }
        }
        // One past the limit is refused.
        sock.write_all(&head(max + 1)).await.unwrap();
        let (status, body) = response(&mut sock, &mut buf).await;
        assert!(status.starts_with("HTTP/1.1 431"), "{status}");
        assert!(body.contains("request_head_too_large"), "{body}");
    }

    #[tokio::test]
    async fn a_head_sent_a_byte_at_a_time_is_read() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let mut sock = TcpStream::connect(addr).await.unwrap();
        sock.set_nodelay(true).unwrap();
        for b in b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n" {
            sock.write_all(&[*b]).await.unwrap();
            tokio::task::yield_now().await;
        }
        let (head, body) = response(&mut sock, &mut Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert_eq!(body, "GET /echo ");
    }

    #[tokio::test]
    async fn bodies_of_unknown_length_are_chunked_and_head_and_204_have_none() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let mut sock = connect(addr, b"GET /stream HTTP/1.1\r\n\r\n").await;
        let mut buf = Vec::new();
        let (head, body) = response(&mut sock, &mut buf).await;
        assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
        assert_eq!(body, "data: 1\n\ndata: 2\n\n");
        sock.write_all(
            b"HEAD /early HTTP/1.1\r\n\r\nGET /empty HTTP/1.1\r\n\r\nGET /early HTTP/1.1\r\n\r\n",
        )
        .await
        .unwrap();
        // HEAD: the head only (its length says what a GET would get).
        let head = head_only(&mut sock, &mut buf).await;
        assert!(head.contains("content-length: 5\r\n"), "{head}");
        let (head, body) = response(&mut sock, &mut buf).await;
        assert!(head.starts_with("HTTP/1.1 204"), "{head}");
        assert!(
            !head.contains("content-length") && !head.contains("chunked"),
            "{head}"
        );
        assert_eq!(body, "");
        // The bytes after each head are the next response's.
        assert_eq!(response(&mut sock, &mut buf).await.1, "early");
    }

    #[tokio::test]
    async fn the_body_sets_the_length_and_a_handler_may_close_the_connection() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        // The handler's `Content-Length: 99` is not what its body holds: the body's own
        // size is sent. Its `Connection: close` closes the connection after the answer.
        let mut sock = connect(addr, b"GET /framed HTTP/1.1\r\n\r\n").await;
        let (head, body) = response(&mut sock, &mut Vec::new()).await;
        assert!(head.contains("content-length: 6\r\n"), "{head}");
        assert!(!head.contains("99"), "{head}");
        assert_eq!(head.matches("connection").count(), 1, "{head}");
        assert!(head.contains("connection: close\r\n"), "{head}");
        // The handler's date, and no other.
        assert_eq!(head.matches("date: ").count(), 1, "{head}");
        assert!(head.contains(&format!("date: {FRAMED_DATE}\r\n")), "{head}");
        assert_eq!(body, "framed");
        assert!(closed(&mut sock).await);
        // To HEAD, the handler's length is the one a GET would get.
        let mut sock = connect(
            addr,
            b"HEAD /sized HTTP/1.1\r\n\r\nGET /early HTTP/1.1\r\n\r\n",
        )
        .await;
        let mut buf = Vec::new();
        let head = head_only(&mut sock, &mut buf).await;
        assert!(head.contains("content-length: 42\r\n"), "{head}");
        assert!(!head.contains("connection"), "{head}");
        assert_eq!(response(&mut sock, &mut buf).await.1, "early");
    }

    /// A relayed answer goes out with its own lines as they came (less what the gateway
    /// keeps back) and the connection's framing: the length the backend declared when
    /// the body does not say its own, else chunked; its `Date`, and no second one.
    #[tokio::test]
    async fn a_relayed_answer_keeps_its_lines_and_gets_the_connections_framing() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_stop, stopped) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let svc = |req: Request<RequestBody>| async move {
                    let declared = (req.uri.path() == "/declared").then_some(5);
                    let chunks = futures_util::stream::iter([Ok::<_, Infallible>(Frame::data(
                        Bytes::from_static(b"hello"),
                    ))]);
                    let lines = format!(
                        "Content-Type: text/plain\r\nDate: {FRAMED_DATE}\r\nConnection: close\r\n\
                         Content-Length: 5\r\nX-Request-Id: up\r\n\r\n"
                    );
                    let relay = crate::proxy::test_relay(
                        lines.as_bytes(),
                        declared,
                        StreamBody::new(chunks).boxed(),
                    );
                    Reply::Relay(relay)
                };
                tokio::spawn(serve(stream, svc, LIMITS, stopped.clone()));
            }
        });
        let mut sock = connect(
            addr,
            b"GET /declared HTTP/1.1\r\n\r\nGET /unknown HTTP/1.1\r\n\r\n",
        )
        .await;
        let mut buf = Vec::new();
        let (head, body) = response(&mut sock, &mut buf).await;
        assert_eq!(
            head,
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nDate: {FRAMED_DATE}\r\n\
                 x-upstream-request-id: up\r\nx-spillgate-backend: b\r\n\
                 x-spillgate-attempts: 1\r\ncontent-length: 5\r\n\r\n"
            )
        );
        assert_eq!(body, "hello");
        // The backend's `Connection: close` was its own connection's: this one goes on.
        let (head, body) = response(&mut sock, &mut buf).await;
        assert!(
            head.ends_with("transfer-encoding: chunked\r\n\r\n"),
            "{head}"
        );
        assert!(
            !head.to_ascii_lowercase().contains("content-length"),
            "{head}"
        );
        assert_eq!(body, "hello");
    }

    #[tokio::test]
    async fn http_1_0_closes_unless_kept_alive_and_is_never_chunked() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let mut sock = connect(addr, b"GET /stream HTTP/1.0\r\n\r\n").await;
        let (head, body) = response(&mut sock, &mut Vec::new()).await;
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert!(!head.contains("chunked"), "{head}");
        assert_eq!(body, "data: 1\n\ndata: 2\n\n");
        let mut sock = connect(
            addr,
            b"GET /echo HTTP/1.0\r\nconnection: keep-alive\r\n\r\nGET /echo HTTP/1.0\r\n\r\n",
        )
        .await;
        let mut buf = Vec::new();
        let (head, _) = response(&mut sock, &mut buf).await;
        assert!(head.contains("connection: keep-alive\r\n"), "{head}");
        let (head, _) = response(&mut sock, &mut buf).await;
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert!(closed(&mut sock).await);
    }

    /// A connection that sent `POST /echo` with `Expect: 100-continue`, was answered
    /// `100 Continue`, and then sent its body `hi`; and what it read after the `100
    /// Continue`.
    async fn echo_after_continue(addr: std::net::SocketAddr) -> (TcpStream, Vec<u8>) {
        let mut sock = connect(
            addr,
            b"POST /echo HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n",
        )
        .await;
        let mut got = Vec::new();
        while got.len() < CONTINUE.len() {
            assert!(read_more(&mut sock, &mut got).await > 0);
        }
        assert_eq!(&got[..CONTINUE.len()], CONTINUE);
        sock.write_all(b"hi").await.unwrap();
        let rest = got.split_off(CONTINUE.len());
        (sock, rest)
    }

    #[tokio::test]
    async fn expect_100_continue_is_answered_before_the_body_is_sent() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let (mut sock, rest) = echo_after_continue(addr).await;
        assert!(rest.is_empty(), "{rest:?}");
        assert_eq!(
            response(&mut sock, &mut Vec::new()).await.1,
            "POST /echo hi"
        );
        // Answered without its body being read: not asked for it, and told the connection
        // closes (the body it did not send would be taken for a request).
        let mut sock = connect(
            addr,
            b"POST /early HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n",
        )
        .await;
        let (head, body) = response(&mut sock, &mut Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert_eq!(body, "early");
    }

    /// How many times this thread's connections have used their input lent.
    fn lent_uses() -> usize {
        LENT_USES.with(std::cell::Cell::get)
    }

    #[tokio::test]
    async fn a_body_that_came_with_its_head_is_taken_whole_and_the_connection_kept() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let before = lent_uses();
        // Not read by its handler: taken off the buffer with the head all the same, so the
        // connection carries the next request (sent in the same write).
        let mut sock = connect(
            addr,
            b"POST /early HTTP/1.1\r\ncontent-length: 5\r\n\r\n12345\
              POST /echo HTTP/1.1\r\ncontent-length: 2\r\n\r\nhi",
        )
        .await;
        let mut buf = Vec::new();
        let (head, body) = response(&mut sock, &mut buf).await;
        assert!(!head.contains("connection: close"), "{head}");
        assert_eq!(body, "early");
        assert_eq!(response(&mut sock, &mut buf).await.1, "POST /echo hi");
        // Neither request's body read from the socket: the input never lent.
        assert_eq!(lent_uses(), before);
    }

    #[tokio::test]
    async fn a_body_read_from_the_socket_lends_the_input_for_the_rest_of_the_connection() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let before = lent_uses();
        // The client sends its body only once asked: it is read from the socket as the
        // handler polls it.
        let (mut sock, mut buf) = echo_after_continue(addr).await;
        let (head, body) = response(&mut sock, &mut buf).await;
        assert!(!head.contains("connection: close"), "{head}");
        assert_eq!(body, "POST /echo hi");
        let lent = lent_uses();
        assert!(lent > before, "the body was read from the socket");
        // Still shared for the next request on the connection, whose body came whole:
        // taken off the buffer under the lock, and answered as any other.
        sock.write_all(b"POST /echo HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc")
            .await
            .unwrap();
        assert_eq!(response(&mut sock, &mut buf).await.1, "POST /echo abc");
        assert!(lent_uses() > lent);
    }

    /// Runs `f` with an input on a connected loopback socket, `buf` read already and a
    /// body framed as `body` to come.
    fn with_input(buf: &[u8], body: Framing, f: impl FnOnce(Input)) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let client = TcpStream::connect(listener.local_addr().unwrap())
                .await
                .unwrap();
            let (io, _out) = client.into_split();
            f(Input {
                io,
                buf: BytesMut::from(buf),
                room: h1::READ_ROOM,
                scanned: 0,
                body,
                intact: true,
                expect: Continue::No,
            });
        });
    }

    #[test]
    fn a_lent_input_is_shared_and_lent_again_as_it_is() {
        with_input(b"rest", Framing::Length(9), |input| {
            let (mut reader, lent) = Reader::Own(input).lend();
            assert!(matches!(reader, Reader::Lent(_)));
            // The body's side sees what the connection's does.
            lock(&lent).body = Framing::Done;
            assert_eq!(reader.with(|input| input.body), Framing::Done);
            drop(lent);
            // Lent again: the same input, no new allocation.
            let before = match &reader {
                Reader::Lent(shared) => Arc::clone(shared),
                Reader::Own(..) => panic!("not lent"),
            };
            let (mut reader, lent) = reader.lend();
            assert!(Arc::ptr_eq(&before, &lent));
            assert_eq!(reader.with(|input| input.buf.clone()), &b"rest"[..]);
        });
    }

    #[test]
    fn only_a_whole_body_of_known_length_is_taken_with_the_head() {
        with_input(b"12345GET", Framing::Length(9), |mut input| {
            // Not all there: left to be read.
            assert_eq!(input.take_whole(), None);
            assert_eq!(input.body, Framing::Length(9));
            assert_eq!(input.buf.len(), 8);
            input.body = Framing::Chunked(Chunk::Size);
            assert_eq!(input.take_whole(), None);
            // All there, and the next request's bytes after it stay.
            input.body = Framing::Length(5);
            assert_eq!(input.take_whole(), Some(Bytes::from_static(b"12345")));
            assert_eq!(input.body, Framing::Done);
            assert_eq!(&input.buf[..], b"GET");
            input.body = Framing::Length(3);
            assert_eq!(input.take_whole(), Some(Bytes::from_static(b"GET")));
            assert!(input.buf.is_empty());
        });
    }

    #[tokio::test]
    async fn a_client_that_sends_its_next_request_then_closes_gets_both_answers() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let mut sock = connect(
            addr,
            b"GET /echo HTTP/1.1\r\n\r\nGET /early HTTP/1.1\r\n\r\n",
        )
        .await;
        sock.shutdown().await.unwrap();
        let mut buf = Vec::new();
        assert_eq!(response(&mut sock, &mut buf).await.1, "GET /echo ");
        assert_eq!(response(&mut sock, &mut buf).await.1, "early");
        assert!(closed(&mut sock).await);
    }

    #[tokio::test]
    async fn a_body_left_unread_closes_the_connection_after_the_answer() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let mut sock = connect(
            addr,
            b"POST /early HTTP/1.1\r\ncontent-length: 10\r\n\r\n12345",
        )
        .await;
        let (head, body) = response(&mut sock, &mut Vec::new()).await;
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert_eq!(body, "early");
        assert!(closed(&mut sock).await);
    }

    #[tokio::test]
    async fn bad_heads_get_an_openai_error_and_a_close() {
        let limits = Limits {
            max_head: 8192,
            max_headers: 8,
            ..LIMITS
        };
        let (addr, seen, _stop) = server(limits).await;
        let many: String = (0..9).map(|i| format!("h{i}: v\r\n")).collect();
        let cases: Vec<(Vec<u8>, &str, &str)> = vec![
            (
                format!("GET / HTTP/1.1\r\nbig: {}\r\n\r\n", "a".repeat(9000)).into_bytes(),
                "431",
                "request_head_too_large",
            ),
            // Too large before its end has even arrived.
            (
                format!("GET / HTTP/1.1\r\nbig: {}", "a".repeat(9000)).into_bytes(),
                "431",
                "request_head_too_large",
            ),
            (
                format!("GET / HTTP/1.1\r\n{many}\r\n").into_bytes(),
                "431",
                "request_head_too_large",
            ),
            (
                b"GET / HTTP/1.1\r\nbad header\r\n\r\n".to_vec(),
                "400",
                "invalid_request_head",
            ),
            (
                b"G@T / HTTP/1.1\r\n\r\n".to_vec(),
                "400",
                "invalid_request_head",
            ),
            (
                b"POST / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab".to_vec(),
                "400",
                "invalid_request_framing",
            ),
            (
                b"POST / HTTP/1.1\r\ncontent-length: -1\r\n\r\n".to_vec(),
                "400",
                "invalid_request_framing",
            ),
            (
                b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n".to_vec(),
                "400",
                "invalid_request_framing",
            ),
            (
                b"POST / HTTP/1.0\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
                "400",
                "invalid_request_framing",
            ),
        ];
        for (send, status, code) in cases {
            let mut sock = connect(addr, &send).await;
            let (head, body) = response(&mut sock, &mut Vec::new()).await;
            assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{head}");
            assert!(head.contains("connection: close\r\n"), "{head}");
            assert!(
                head.contains("content-type: application/json\r\n"),
                "{head}"
            );
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], code, "{body}");
            assert!(closed(&mut sock).await);
        }
        assert_eq!(seen.calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn chunked_beside_a_length_drops_the_length_and_closes_after() {
        let (addr, seen, _stop) = server(LIMITS).await;
        let mut sock = connect(
            addr,
            b"POST /echo HTTP/1.1\r\ncontent-length: 100\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        )
        .await;
        let (head, body) = response(&mut sock, &mut Vec::new()).await;
        assert_eq!(body, "POST /echo ok");
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert!(seen.headers.lock().unwrap()[0]
            .get("content-length")
            .is_none());
        assert!(closed(&mut sock).await);
    }

    #[tokio::test]
    async fn a_body_cut_short_is_an_error_to_the_service() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let mut sock = connect(
            addr,
            b"POST /echo HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        )
        .await;
        let (head, body) = response(&mut sock, &mut Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        assert!(body.contains("invalid chunk size"), "{body}");
        assert!(head.contains("connection: close\r\n"), "{head}");
    }

    #[test]
    fn a_new_connection_starts_from_the_target_its_thread_kept_last() {
        // A thread of its own: nothing kept on it yet.
        std::thread::spawn(|| {
            assert!(LastTarget::seeded().0.is_none());
            let mut first = LastTarget::seeded();
            let uri = first.uri(b"/v1/chat/completions?x=1").unwrap();
            let mut second = LastTarget::seeded();
            assert!(second
                .0
                .as_ref()
                .is_some_and(|(t, u)| &t[..] == b"/v1/chat/completions?x=1" && *u == uri));
            assert_eq!(second.uri(b"/v1/chat/completions?x=1").unwrap(), uri);
            // Another target replaces it for the connections after; a refused one or
            // one too long to keep does not.
            assert_eq!(second.uri(b"/v1/models").unwrap().path(), "/v1/models");
            assert!(second.uri(b"/a b").is_err());
            let long = format!("/v1/models?x={}", "y".repeat(LastTarget::MAX));
            assert!(second.uri(long.as_bytes()).is_ok());
            let third = LastTarget::seeded();
            assert!(third.0.is_some_and(|(t, _)| &t[..] == b"/v1/models"));
            // The first connection keeps its own.
            assert_eq!(first.uri(b"/v1/chat/completions?x=1").unwrap(), uri);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_repeated_target_gets_the_same_uri_and_another_its_own() {
        let mut last = LastTarget(None);
        let parsed = |t: &str| Uri::from_maybe_shared(Bytes::copy_from_slice(t.as_bytes()));
        let long = format!("/v1/models?x={}", "y".repeat(LastTarget::MAX));
        for target in [
            "/v1/chat/completions",
            "/v1/chat/completions",
            // Same lengths, other bytes.
            "/v1/chat/completionz",
            "/v1/chat/completions?x=1",
            "/v1/chat/completions?x=2",
            "/v2/chat/completions?x=2",
            "http://gateway.example/v1/chat/completions",
            "/v1/chat/completions",
            "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            "*",
            "/v1/chat/completions",
            &long,
            &long,
            "/v1/chat/completions",
        ] {
            let uri = last.uri(target.as_bytes()).unwrap();
            assert_eq!(uri, parsed(target).unwrap(), "{target}");
            assert_eq!(uri.to_string(), target);
        }
        // A target refused is refused again: nothing of it was kept.
        assert!(last.uri(b"/a b").is_err());
        assert!(last.uri(b"/a b").is_err());
        assert!(last.uri(&long.as_bytes()[..LastTarget::MAX + 4]).is_ok());
        assert!(last
            .0
            .as_ref()
            .is_some_and(|(t, _)| t.len() <= LastTarget::MAX));
        assert_eq!(
            last.uri(b"/v1/chat/completions").unwrap(),
            "/v1/chat/completions"
        );
        assert!(last.uri(b"/v1/models").is_ok());
        assert_eq!(last.uri(b"/v1/models").unwrap().path(), "/v1/models");
    }

    #[tokio::test(start_paused = true)]
    async fn each_wait_for_a_head_gets_the_whole_timeout() {
        let limits = Limits {
            header_timeout: Duration::from_secs(30),
            ..LIMITS
        };
        let (addr, _seen, _stop) = server(limits).await;
        let started = tokio::time::Instant::now();
        let mut sock = connect(addr, b"GET /first HTTP/1.1\r\n\r\n").await;
        let mut buf = Vec::new();
        assert_eq!(response(&mut sock, &mut buf).await.1, "GET /first ");
        // Past the first wait's end, each request comes within 30 s of the one before.
        for (at, path) in [(20, "second"), (45, "third")] {
            tokio::time::sleep_until(started + Duration::from_secs(at)).await;
            let req = format!("GET /{path} HTTP/1.1\r\n\r\n");
            sock.write_all(req.as_bytes()).await.unwrap();
            assert_eq!(
                response(&mut sock, &mut buf).await.1,
                format!("GET /{path} ")
            );
        }
        // Part of a head, then nothing: refused 30 s after the third answer, not before.
        tokio::time::sleep_until(started + Duration::from_secs(60)).await;
        sock.write_all(b"GET /fourth HTTP/1.1\r\nhost:")
            .await
            .unwrap();
        let (head, _) = response(&mut sock, &mut buf).await;
        assert!(head.starts_with("HTTP/1.1 408"), "{head}");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(75) && waited < Duration::from_secs(76),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_head_gets_408_and_an_idle_connection_closes() {
        let limits = Limits {
            header_timeout: Duration::from_secs(30),
            ..LIMITS
        };
        let (addr, _seen, _stop) = server(limits).await;
        let mut partial = connect(addr, b"GET /echo HTTP/1.1\r\nhost:").await;
        let mut blank = connect(addr, b"\r\n").await;
        let mut idle = connect(addr, b"GET /echo HTTP/1.1\r\n\r\n").await;
        let mut buf = Vec::new();
        assert_eq!(response(&mut idle, &mut buf).await.1, "GET /echo ");
        let started = tokio::time::Instant::now();
        let (head, body) = response(&mut partial, &mut Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 408"), "{head}");
        assert!(body.contains("request_head_timeout"), "{body}");
        assert!(started.elapsed() >= Duration::from_secs(29));
        // The idle one closes without a word, as does one that sent an empty line.
        assert_eq!(read_more(&mut idle, &mut Vec::new()).await, 0);
        assert_eq!(read_more(&mut blank, &mut Vec::new()).await, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_nothing_is_cut_off_and_the_body_dropped() {
        let (addr, seen, _stop) = server(LIMITS).await;
        let mut sock = connect(addr, b"GET /endless HTTP/1.1\r\n\r\n").await;
        // The gateway writes until the socket buffers are full, then waits: 30 s
        // (`send_timeout`) for the client to make room, which it never does.
        tokio::time::sleep(Duration::from_secs(29)).await;
        assert!(!seen.dropped.load(Ordering::SeqCst), "cut off too early");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            seen.dropped.load(Ordering::SeqCst),
            "the body was not dropped"
        );
        // What was written still arrives, then the connection ends, the body unfinished.
        let mut buf = Vec::new();
        let mut total = 0;
        loop {
            let n = read_more(&mut sock, &mut buf).await;
            if n == 0 {
                break;
            }
            total += n;
            buf.clear();
        }
        assert!(total > 64 * 1024, "{total}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_gets_all_of_a_large_response() {
        let (addr, _seen, _stop) = server(LIMITS).await;
        let mut sock = connect(addr, b"GET /big HTTP/1.1\r\n\r\n").await;
        // At most 256 KiB a second: 128 s or more for the body, far past the 30 s
        // `send_timeout`, which bounds only a write the client makes no room for.
        let mut buf = Vec::new();
        let mut body = 0;
        let mut head = None;
        while head.is_none() || body < BIG {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let mut chunk = vec![0u8; 256 * 1024];
            let n = sock.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed after {body} bytes of the body");
            match head {
                None => {
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        head = Some(String::from_utf8_lossy(&buf[..i]).to_string());
                        body = buf.len() - i - 4;
                    }
                }
                Some(_) => body += n,
            }
        }
        let head = head.unwrap();
        assert!(head.contains(&format!("content-length: {BIG}")), "{head}");
        assert_eq!(body, BIG);
    }

    #[tokio::test]
    async fn a_client_gone_while_waiting_drops_the_request() {
        let (addr, seen, _stop) = server(LIMITS).await;
        let sock = connect(addr, b"GET /pending HTTP/1.1\r\n\r\n").await;
        while seen.calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!seen.dropped.load(Ordering::SeqCst));
        drop(sock);
        tokio::time::timeout(Duration::from_secs(5), async {
            while !seen.dropped.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the request was dropped");
    }

    #[tokio::test]
    async fn a_connection_polled_with_a_new_waker_each_time_still_sees_a_stop() {
        // A connection's stop signal and head timer are not polled again while they
        // wait with the task's waker: with another waker they are.
        let (addr, _seen, stop) = server_with(LIMITS, true).await;
        let mut idle = connect(addr, b"GET /echo HTTP/1.1\r\n\r\n").await;
        let mut buf = Vec::new();
        response(&mut idle, &mut buf).await;
        // Waited once, with one waker; waits again with another.
        idle.write_all(b"GET /echo HTTP/1.1\r\n\r\n").await.unwrap();
        response(&mut idle, &mut buf).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(true).unwrap();
        assert!(closed(&mut idle).await);
    }

    #[tokio::test]
    async fn a_stop_closes_idle_connections_and_answers_the_request_in_progress() {
        let (addr, seen, stop) = server(LIMITS).await;
        let mut idle = connect(addr, b"GET /echo HTTP/1.1\r\n\r\n").await;
        let mut buf = Vec::new();
        response(&mut idle, &mut buf).await;
        // Sent, and its body held back: in progress when the stop comes.
        let mut busy = connect(addr, b"POST /echo HTTP/1.1\r\ncontent-length: 2\r\n\r\n").await;
        while seen.calls.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        stop.send(true).unwrap();
        assert!(closed(&mut idle).await);
        busy.write_all(b"ok").await.unwrap();
        let (head, body) = response(&mut busy, &mut Vec::new()).await;
        assert_eq!(body, "POST /echo ok");
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert!(closed(&mut busy).await);
    }

    #[test]
    fn chunk_lines() {
        let mut b = [0u8; 20];
        assert_eq!(chunk_line(&mut b, 0), b"0\r\n");
        assert_eq!(chunk_line(&mut b, 10), b"a\r\n");
        assert_eq!(chunk_line(&mut b, 0x1f3), b"1f3\r\n");
        assert_eq!(chunk_line(&mut b, usize::MAX), b"ffffffffffffffff\r\n");
    }

    #[tokio::test]
    async fn a_connections_body_reaches_the_proxy_unboxed_and_any_other_boxed() {
        use http_body_util::BodyExt;
        let wire = RequestBody {
            source: Source::Ended,
            hint: SizeHint::with_exact(0),
        };
        let body = ClientBody::new(wire);
        assert!(matches!(body.0, ClientKind::Wire(_)));
        assert!(body.is_end_stream());
        let other = ClientBody::new(Full::new(Bytes::from_static(b"abc")));
        assert!(matches!(other.0, ClientKind::Other(_)));
        assert_eq!(other.size_hint().exact(), Some(3));
        let read = other.collect().await.unwrap().to_bytes();
        assert_eq!(read, Bytes::from_static(b"abc"));
    }

    #[test]
    fn a_future_slot_keeps_its_allocation_only_for_answers_of_known_length() {
        // Ready at once, and what it holds is dropped with it (an `async` block's would
        // be dropped as it finished).
        struct Call {
            n: u32,
            _flag: DropFlag,
        }
        impl Future for Call {
            type Output = u32;
            fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<u32> {
                Poll::Ready(self.n)
            }
        }
        let seen = Arc::new(Seen::default());
        let mut slot = FutureSlot::new();
        let call = |n: u32| Call {
            n,
            _flag: DropFlag(Arc::clone(&seen)),
        };
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let at = |slot: &FutureSlot<_>| slot.0.as_ref().map(|b| std::ptr::from_ref(&**b));

        let mut first = slot.start(call(1));
        assert_eq!(Pin::new(&mut first).poll(&mut cx), Poll::Ready(1));
        assert!(!seen.dropped.load(Ordering::SeqCst), "held until finished");
        slot.finish(true);
        assert!(
            seen.dropped.swap(false, Ordering::SeqCst),
            "dropped when finished"
        );
        let kept = at(&slot);
        assert!(kept.is_some(), "the allocation is kept");

        let mut second = slot.start(call(2));
        assert_eq!(Pin::new(&mut second).poll(&mut cx), Poll::Ready(2));
        assert_eq!(at(&slot), kept, "the next request reuses it");
        slot.finish(false);
        assert!(seen.dropped.load(Ordering::SeqCst));
        assert!(slot.0.is_none(), "let go of when the answer may stream");

        let known = Reply::Response(http::Response::new(full("done")));
        assert!(known.length_known());
        let chunks = futures_util::stream::iter([Ok::<_, Infallible>(Frame::data(
            Bytes::from_static(b"data: 1\n\n"),
        ))]);
        let streamed = Reply::Response(http::Response::new(StreamBody::new(chunks).boxed()));
        assert!(!streamed.length_known());
        let relayed = |length| {
            let lines = b"Content-Type: text/plain\r\n\r\n";
            let chunks = futures_util::stream::iter([Ok::<_, Infallible>(Frame::data(
                Bytes::from_static(b"hello"),
            ))]);
            let body = match length {
                Some(()) => full("hello"),
                None => StreamBody::new(chunks).boxed(),
            };
            Reply::Relay(crate::proxy::test_relay(lines, None, body))
        };
        assert!(relayed(Some(())).length_known());
        assert!(!relayed(None).length_known());
    }

    #[tokio::test]
    async fn a_connection_keeps_its_future_slot_between_answers_of_known_length_only() {
        // The server's tasks run on this test's thread: its count is theirs.
        let made = || SLOTS_MADE.with(std::cell::Cell::get);
        let (addr, _seen, _stop) = server(LIMITS).await;
        let before = made();
        let mut sock = connect(addr, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let mut buf = Vec::new();
        assert_eq!(response(&mut sock, &mut buf).await.1, "GET /a ");
        sock.write_all(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(response(&mut sock, &mut buf).await.1, "GET /b ");
        assert_eq!(made() - before, 1, "the second request reuses the first's");
        sock.write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        response(&mut sock, &mut buf).await;
        sock.write_all(b"GET /c HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(response(&mut sock, &mut buf).await.1, "GET /c ");
        assert_eq!(
            made() - before,
            2,
            "let go of for the stream, made again after it"
        );
    }

    #[tokio::test]
    async fn a_connection_future_is_small() {
        // What each open connection holds for as long as it is open, beside its buffers
        // (and, between answers of known length, its request future's slot).
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (_, stopped) = watch::channel(false);
        let svc = |_req: Request<RequestBody>| async { http::Response::new(full("")) };
        let n = std::mem::size_of_val(&serve(stream, svc, LIMITS, stopped));
        eprintln!("serve future: {n} bytes");
        assert!(n < 4096, "{n}");
    }
}
