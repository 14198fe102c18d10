//! The HTTP client that talks to backends.
//!
//! A connection pool per connection thread, over the gateway's own HTTP/1.1 connections
//! ([`crate::h1`]: no task or channel per connection) and hyper's HTTP/2 ones, through
//! rustls (the system's CA store, else webpki roots; HTTP/2 when the backend picks it by
//! ALPN). hyper-util's general-purpose pooled client cost about a tenth of the gateway's
//! instructions per proxied request (its pool map, a task per request to return each
//! HTTP/1 connection, the `Host` header built per request); here a connection goes back
//! to its pool when its response body ends, and the pool is a plain list per backend
//! origin. The connect timeout lives in the connector; the time-to-first-byte timeout
//! wraps each request; the idle timeout between body chunks wraps the response body (in
//! the proxy).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::uri::{Authority, Scheme};
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use http_body_util::Full;
use hyper::client::conn::http2;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use spillgate_core::config::Timeouts;

use crate::h1;
use crate::lock;
use crate::proxy::Forwarded;
use tokio::time::Instant;

/// Why an attempt got no response.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    #[error("connect failed: {0}")]
    Connect(String),
    #[error("no response headers within {0:?}")]
    FirstByteTimeout(Duration),
    #[error("request failed: {0}")]
    Request(String),
}

/// Sends one request to a backend. The gateway's request path only sees this trait, so
/// tests can run the whole gateway in memory against scripted backends, with paused time.
pub trait Upstream: Send + Sync + 'static {
    /// Resolves when the response headers arrive, or fails after `timeout`. A `Host` or
    /// `Content-Length` in `req`'s headers is the client's: what is sent is the
    /// backend's host and the body's length.
    fn send<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<http::Response<Body>, AttemptError>>;

    /// [`Upstream::send`] for a request the proxy relays: the answer's headers as they
    /// came where the connection kept them so (HTTP/1.1), else as a map.
    fn relay<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Upstreamed, AttemptError>> {
        use futures_util::FutureExt;
        Box::pin(self.send(req, timeout).map(|r| r.map(Upstreamed::from)))
    }

    /// The gateway's own client, when this is it: the proxy then holds its request's
    /// future in its own ([`UpstreamClient::relay_inline`]) instead of in a box.
    fn client(&self) -> Option<&UpstreamClient> {
        None
    }

    /// Sends `req`, one of the gateway's own requests (a health check, an identity
    /// token's) built as an `http::Request` with an absolute URI.
    fn send_http<'a>(
        &'a self,
        req: &'a http::Request<Bytes>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<http::Response<Body>, AttemptError>> {
        match UpstreamRequest::of(req) {
            Ok(req) => self.send(req, timeout),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
}

/// A backend's answer to a request the proxy relays.
pub struct Upstreamed {
    pub status: StatusCode,
    pub headers: UpstreamHeaders,
    pub body: Body,
}

/// A backend answer's headers: as they came over HTTP/1.1 (relayed line by line), or as
/// a map (HTTP/2, and backends simulated in memory).
pub enum UpstreamHeaders {
    Wire(h1::RawHeaders),
    Map(HeaderMap),
}

impl UpstreamHeaders {
    /// The first value of the header of the common name `name`: on the wire, found by
    /// the place its name was given when the head was read (see [`h1::Common`]).
    pub fn first<'a>(&'a self, name: &'a h1::Common) -> Option<&'a [u8]> {
        use h1::Values;
        match self {
            UpstreamHeaders::Wire(raw) => raw.first(name),
            UpstreamHeaders::Map(map) => map.first(name),
        }
    }
}

impl From<http::Response<Body>> for Upstreamed {
    fn from(resp: http::Response<Body>) -> Upstreamed {
        let (parts, body) = resp.into_parts();
        Upstreamed {
            status: parts.status,
            headers: UpstreamHeaders::Map(parts.headers),
            body,
        }
    }
}

impl Upstreamed {
    /// As an `http::Response`, the headers in a map.
    pub fn into_http(self) -> http::Response<Body> {
        let mut resp = http::Response::new(self.body);
        *resp.status_mut() = self.status;
        *resp.headers_mut() = match self.headers {
            UpstreamHeaders::Wire(raw) => raw.to_map(),
            UpstreamHeaders::Map(map) => map,
        };
        resp
    }
}

/// One attempt's request to a backend. It borrows what every attempt of a client's
/// request shares (the method, the client's headers as forwarded) and adds the backend's
/// credential when it is written: copying the header map for each attempt, building a
/// `Uri` and dropping them was 4% of a proxied JSON request's instructions, 5% with the
/// OpenAI SDK's headers. No `Debug`: it would print the client's headers next to the
/// credential, and nothing needs it.
pub struct UpstreamRequest<'a> {
    method: &'a Method,
    scheme: &'a Scheme,
    authority: &'a Authority,
    path_and_query: &'a str,
    headers: SharedHeaders<'a>,
    credential: Option<(&'a HeaderName, &'a HeaderValue)>,
    body: Bytes,
}

/// The headers the attempts of a request share.
#[derive(Clone, Copy)]
pub enum SharedHeaders<'a> {
    /// A map: the gateway's own requests, and tests.
    Map(&'a HeaderMap),
    /// A client's header lines as they go upstream.
    Forwarded(&'a Forwarded),
}

impl<'a> UpstreamRequest<'a> {
    /// A request for `path_and_query` (origin form: it starts with `/`) at `scheme` and
    /// `authority`, with `headers` and then `credential`, which replaces any header of
    /// its name. Refused when the target could break the request line (a control byte
    /// or a space) or holds a `#`.
    pub fn new(
        method: &'a Method,
        (scheme, authority): (&'a Scheme, &'a Authority),
        path_and_query: &'a str,
        headers: SharedHeaders<'a>,
        credential: Option<(&'a HeaderName, &'a HeaderValue)>,
        body: Bytes,
    ) -> Result<UpstreamRequest<'a>, AttemptError> {
        let target = path_and_query.as_bytes();
        if target.first() != Some(&b'/') || !target.iter().all(|&b| target_byte(b)) {
            return Err(AttemptError::Request(
                "the request target is not a path and query in origin form".into(),
            ));
        }
        Ok(UpstreamRequest {
            method,
            scheme,
            authority,
            path_and_query,
            headers,
            credential,
            body,
        })
    }

    /// `req` (its URI absolute) as an upstream request: the gateway's own requests
    /// (health checks, identity tokens) are built as `http::Request`s.
    pub fn of(req: &'a http::Request<Bytes>) -> Result<UpstreamRequest<'a>, AttemptError> {
        let uri = req.uri();
        let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
            return Err(AttemptError::Request(format!(
                "not an absolute URI: {}",
                uri.path()
            )));
        };
        let target = uri.path_and_query().map_or("/", |p| p.as_str());
        UpstreamRequest::new(
            req.method(),
            (scheme, authority),
            target,
            SharedHeaders::Map(req.headers()),
            None,
            req.body().clone(),
        )
    }

    pub fn method(&self) -> &Method {
        self.method
    }

    /// The backend's host and port.
    pub fn authority(&self) -> &Authority {
        self.authority
    }

    /// The path and query, in origin form.
    pub fn path_and_query(&self) -> &str {
        self.path_and_query
    }

    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Gives each header to send, in order, to `f`: the shared ones, less any `Host` or
    /// framing header (the sender writes its own) and any of the credential's name, then
    /// the credential.
    pub fn each_header(&self, mut f: impl FnMut(&[u8], &[u8])) {
        self.each_shared(&mut f);
        if let Some((name, value)) = self.credential {
            f(name.as_str().as_bytes(), value.as_bytes());
        }
    }

    /// [`UpstreamRequest::each_header`] without the credential.
    fn each_shared(&self, f: &mut impl FnMut(&[u8], &[u8])) {
        let credential = self.credential.map(|(name, _)| name);
        match self.headers {
            SharedHeaders::Map(map) => {
                for (name, value) in map {
                    let own = name == header::CONTENT_LENGTH
                        || name == header::TRANSFER_ENCODING
                        || name == header::HOST;
                    if !own && Some(name) != credential {
                        f(name.as_str().as_bytes(), value.as_bytes());
                    }
                }
            }
            SharedHeaders::Forwarded(forwarded) => forwarded.each_header(credential, f),
        }
    }

    /// As an `http::Request` with an absolute URI, the headers in a map of their own
    /// (a client's forwarded ones without `Host` or framing headers; a map's as they
    /// are): for an HTTP/2 connection, and for backends simulated in memory.
    pub fn to_http(&self) -> Result<http::Request<Full<Bytes>>, AttemptError> {
        let uri = http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(self.path_and_query)
            .build()
            .map_err(|e| AttemptError::Request(e.to_string()))?;
        let credential = self.credential.map(|(name, _)| name);
        let mut headers = match self.headers {
            SharedHeaders::Map(map) => map.clone(),
            SharedHeaders::Forwarded(forwarded) => forwarded.to_map(credential),
        };
        if let Some((name, value)) = self.credential {
            headers.insert(name.clone(), value.clone());
        }
        let mut req = http::Request::new(Full::new(self.body.clone()));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        Ok(req)
    }
}

/// Whether `b` may stand in a request target as the gateway writes it: not a control
/// byte or a space, which could end the request line, and not `#` (a fragment is never
/// sent). UTF-8 passes, as in the clients' URIs the `http` crate accepts.
fn target_byte(b: u8) -> bool {
    b > b' ' && b != 0x7f && b != b'#'
}

/// Pools an upstream client keeps at most: one per connection thread (see
/// [`set_pool_slot`]) plus one for every other thread.
const MAX_POOLS: usize = 65;

/// An idle connection unused this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Idle HTTP/1.1 connections kept per backend origin and pool; past this, the one idle
/// longest is closed.
const MAX_IDLE_PER_ORIGIN: usize = 256;

/// How often a pool drops the connections that idled past [`IDLE_TIMEOUT`] or closed.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

thread_local! {
    /// Which of the upstream client's connection pools this thread uses: 0 for any
    /// thread, `1..` for the gateway's per-core connection threads.
    static POOL_SLOT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Makes the calling thread use its own upstream connection pool. A per-core connection
/// thread calls this once: an upstream connection is then created, driven and reused on
/// the thread whose requests use it, so a request never wakes another core (the cost
/// measured with connections shared across threads).
pub fn set_pool_slot(slot: usize) {
    POOL_SLOT.with(|s| s.set(slot % MAX_POOLS));
}

type Connector = HttpsConnector<HttpConnector>;
type H1 = h1::Conn;
type H2 = http2::SendRequest<Full<Bytes>>;
type SharedPool = Arc<Mutex<Pool<H1, H2>>>;

pub struct UpstreamClient(Arc<Inner>);

struct Inner {
    /// Built once and shared by the pools: building it reads and parses the system's CA
    /// store, milliseconds that each connection thread's first request used to wait for.
    connector: Connector,
    pools: Box<[SharedPool]>,
    /// Speak HTTP/2 without ALPN (prior knowledge), for tests of the HTTP/2 path over
    /// plain TCP.
    h2_only: bool,
}

impl UpstreamClient {
    pub fn new(timeouts: &Timeouts) -> UpstreamClient {
        Self::build(timeouts.connect, false)
    }

    fn build(connect_timeout: Duration, h2_only: bool) -> UpstreamClient {
        UpstreamClient(Arc::new(Inner {
            connector: build_connector(connect_timeout),
            pools: (0..MAX_POOLS)
                .map(|_| Arc::new(Mutex::new(Pool::default())))
                .collect(),
            h2_only,
        }))
    }
}

fn build_connector(connect_timeout: Duration) -> Connector {
    // The first-byte timeout is applied per request (it may be cut short by a request's
    // deadline); only the connect timeout lives in the connector.
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    // The system's CA store (so a private CA in front of a self-hosted server works),
    // else the bundled webpki roots.
    let builder = match hyper_rustls::HttpsConnectorBuilder::new().with_native_roots() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "no usable system CA certificates; using the bundled web PKI roots");
            hyper_rustls::HttpsConnectorBuilder::new().with_webpki_roots()
        }
    };
    builder
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http)
}

/// The `Host` header for requests to `authority` over `scheme`: the authority without
/// its port when the port is the scheme's default.
pub fn host_header(scheme: &Scheme, authority: &Authority) -> Option<HeaderValue> {
    let default = match scheme.as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    // Host and port only: never the authority's user information.
    let value = match authority.port_u16() {
        Some(p) if Some(p) != default => format!("{}:{p}", authority.host()),
        _ => authority.host().to_string(),
    };
    HeaderValue::from_str(&value).ok()
}

impl Upstream for UpstreamClient {
    fn send<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<http::Response<Body>, AttemptError>> {
        use futures_util::FutureExt;
        // One box: `relay` would box the attempt's future once more inside this one.
        Box::pin(
            self.relay_inline(req, timeout)
                .map(|r| r.map(Upstreamed::into_http)),
        )
    }

    fn relay<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Upstreamed, AttemptError>> {
        Box::pin(self.relay_inline(req, timeout))
    }

    fn client(&self) -> Option<&UpstreamClient> {
        Some(self)
    }
}

impl UpstreamClient {
    /// [`Upstream::relay`], its future not boxed: the proxy's attempt holds it (a box
    /// an attempt was an allocation, its free and a copy of 640 bytes: about 190
    /// instructions a JSON request, callgrind).
    pub fn relay_inline<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Upstreamed, AttemptError>> + Send + 'a {
        // Read on the calling thread: the slot says which thread's pool to use.
        let slot = POOL_SLOT.with(std::cell::Cell::get) % MAX_POOLS;
        async move {
            // One reading of the clock for the timeout and the pool's idle check. A
            // timeout past what the clock can hold is thirty years, as tokio's own. The
            // timeout is kept where the request waits: by an HTTP/1.1 connection's own
            // timer (see `h1::Conn::send`), by a timer of its own around a connect or an
            // HTTP/2 exchange. One await: with two (one with a timeout, one without) the
            // request's future was no longer inlined into the attempt's, and the answer
            // came out of it through two more copies, about 200 instructions a request
            // (callgrind).
            let now = crate::now::now();
            let at = now
                .checked_add(timeout)
                .or_else(|| now.checked_add(Duration::from_secs(30 * 365 * 86_400)))
                .unwrap_or(now);
            let deadline = Deadline { at, timeout };
            self.0.request(slot, &req, now, deadline).await
        }
    }
}

/// A backend origin: where a pooled connection leads.
#[derive(Clone, Debug, Eq)]
struct Origin {
    scheme: Scheme,
    authority: Authority,
}

impl PartialEq for Origin {
    /// As `http` compares them (the authority's case does not matter), with the exact
    /// bytes tried first: the pool compares origins on every request, and the same
    /// backend's URL gives the same bytes, where a comparison without case went a byte
    /// at a time.
    fn eq(&self, other: &Origin) -> bool {
        self.scheme == other.scheme
            && (self.authority.as_str() == other.authority.as_str()
                || self.authority == other.authority)
    }
}

impl Inner {
    /// Sends `req` on a pooled connection to its origin, else on a new one. The
    /// request's future is held in the proxy's attempt (boxed for test and simulated
    /// upstreams), and kept within the size glibc's per-thread cache serves (1,032
    /// bytes; a larger box took about 300 instructions more to make and free): the
    /// taken connection and the first send's result are held in scopes that end before
    /// the next wait.
    async fn request(
        &self,
        slot: usize,
        req: &UpstreamRequest<'_>,
        now: Instant,
        deadline: Deadline,
    ) -> Result<Upstreamed, AttemptError> {
        let origin = Origin {
            scheme: req.scheme.clone(),
            authority: req.authority.clone(),
        };
        let pool = &self.pools[slot];
        let (conn, reused) = self.conn_for(pool, &origin, now, deadline).await?;
        {
            let sent = send_on(conn, req, pool, &origin, deadline.at).await;
            // A pooled connection the backend closed (or sent GOAWAY on) just as it was
            // taken: the request was not written, so it goes once more, on a new
            // connection. A request that may have been written is never sent again.
            if !(reused && matches!(sent, Err(h1::SendError::Unsent(_)))) {
                return sent.map_err(|e| deadline.error(e));
            }
        }
        let conn = self.connect_by(pool, &origin, deadline).await?;
        send_on(conn, req, pool, &origin, deadline.at)
            .await
            .map_err(|e| deadline.error(e))
    }

    /// A connection to `origin`: a pooled one (then `true`), else a new one. `now` is
    /// when the request began, for the pooled connections' idle time.
    async fn conn_for(
        &self,
        pool: &SharedPool,
        origin: &Origin,
        now: Instant,
        deadline: Deadline,
    ) -> Result<(Conn<H1, H2>, bool), AttemptError> {
        let pooled = lock(pool).take(origin, now);
        Ok(match pooled {
            Some(c) => (c, true),
            None => (self.connect_by(pool, origin, deadline).await?, false),
        })
    }

    /// [`Inner::connect`] within the request's deadline. Boxed: the connect future is
    /// kilobytes (with its timer); inline, it would make every request's future that
    /// large, copied as it is set up.
    async fn connect_by(
        &self,
        pool: &SharedPool,
        origin: &Origin,
        deadline: Deadline,
    ) -> Result<Conn<H1, H2>, AttemptError> {
        Box::pin(tokio::time::timeout_at(
            deadline.at,
            self.connect(pool, origin),
        ))
        .await
        .unwrap_or(Err(AttemptError::FirstByteTimeout(deadline.timeout)))
    }

    /// Opens a connection to `origin`, HTTP/2 when the backend picks it by ALPN (kept in
    /// `pool` at once, for the requests that come while this one runs), else HTTP/1.1.
    async fn connect(
        &self,
        pool: &SharedPool,
        origin: &Origin,
    ) -> Result<Conn<H1, H2>, AttemptError> {
        use tower::ServiceExt;
        let uri = http::Uri::builder()
            .scheme(origin.scheme.clone())
            .authority(origin.authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| AttemptError::Connect(e.to_string()))?;
        let io = self
            .connector
            .clone()
            .oneshot(uri)
            .await
            .map_err(|e| AttemptError::Connect(error_chain(&*e)))?;
        if self.h2_only || io.connected().is_negotiated_h2() {
            let (h2, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake::<_, Full<Bytes>>(io)
                .await
                .map_err(|e| AttemptError::Connect(error_chain(&e)))?;
            tokio::spawn(drive(conn));
            let mut guard = lock(pool);
            guard.put_shared(origin, h2.clone(), crate::now::now());
            keep_reaped(pool, guard);
            Ok(Conn::H2(h2))
        } else {
            let host = host_header(&origin.scheme, &origin.authority);
            Ok(Conn::H1(h1::Conn::new(plain_io(io), host)))
        }
    }
}

/// The connection's stream as `h1` reads and writes it: tokio's own TCP stream, or the
/// TLS stream over it. The connector hands it out as hyper's I/O (`MaybeHttpsStream`
/// over `TokioIo`), which `h1` would reach through two more conversions of every read
/// and write buffer, tokio's to hyper's and back (the response's read took about 150
/// instructions more, counted with callgrind).
fn plain_io(io: hyper_rustls::MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>) -> Box<dyn h1::Io> {
    match io {
        hyper_rustls::MaybeHttpsStream::Http(tcp) => Box::new(tcp.into_inner()),
        hyper_rustls::MaybeHttpsStream::Https(tls) => Box::new(tls.into_inner()),
    }
}

/// Drives one upstream connection until it closes. A combinator, not an `async fn`: an
/// async fn holding the connection and awaiting it kept room for it twice in the task,
/// kilobytes per open stream.
fn drive<F>(conn: F) -> impl std::future::Future<Output = ()>
where
    F: std::future::Future<Output = hyper::Result<()>>,
{
    use futures_util::FutureExt;
    conn.map(|r| {
        if let Err(e) = r {
            tracing::debug!(error = %error_chain(&e), "upstream connection ended with an error");
        }
    })
}

/// When a request's attempt gives up waiting for its answer's head: `at`, `timeout`
/// after it began.
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    /// The attempt's error for a failed exchange.
    fn error(self, e: h1::SendError) -> AttemptError {
        match e {
            h1::SendError::Unsent(e) | h1::SendError::Failed(e) => {
                AttemptError::Request(e.to_string())
            }
            h1::SendError::TimedOut => AttemptError::FirstByteTimeout(self.timeout),
        }
    }
}

/// Sends `req` on `conn`, until its answer's head or `deadline`: over HTTP/1.1 in origin
/// form with the connection's `Host`, the connection going back to `pool` when the
/// response body ends; over HTTP/2 with the authority in the URI and no `Host`. Not an
/// `async fn`, which would hold the connection twice (as its argument and as the
/// branch's); the HTTP/2 branch is boxed, its future being the larger and its requests
/// costing far more than an allocation.
fn send_on<'a>(
    conn: Conn<H1, H2>,
    req: &'a UpstreamRequest<'_>,
    pool: &SharedPool,
    origin: &Origin,
    deadline: Instant,
) -> impl std::future::Future<Output = Result<Upstreamed, h1::SendError>> + use<'a> {
    use futures_util::future::Either;
    use futures_util::FutureExt;
    match conn {
        Conn::H1(h1) => {
            let give_back = GiveBack {
                pool: Arc::downgrade(pool),
                origin: origin.clone(),
            };
            Either::Left(h1.send(req, give_back, deadline).map(|sent| {
                let resp = sent?;
                Ok(Upstreamed {
                    status: resp.status,
                    headers: UpstreamHeaders::Wire(resp.headers),
                    body: Body::new(resp.body),
                })
            }))
        }
        Conn::H2(h2) => Either::Right(Box::pin(async move {
            tokio::time::timeout_at(deadline, send_h2(h2, req))
                .await
                .unwrap_or(Err(h1::SendError::TimedOut))
        })),
    }
}

/// [`send_on`] over HTTP/2.
async fn send_h2(mut h2: H2, req: &UpstreamRequest<'_>) -> Result<Upstreamed, h1::SendError> {
    let mut req = req
        .to_http()
        .map_err(|e| h1::SendError::Failed(h1::Error::new(e.to_string())))?;
    // HTTP/2 carries the authority in the request's `:authority`, from its URI, and the
    // body's length in its frames: a client's `Content-Length` (its body may have been
    // changed since) is not sent.
    req.headers_mut().remove(header::HOST);
    req.headers_mut().remove(header::CONTENT_LENGTH);
    match h2.try_send_request(req).await {
        Ok(resp) => Ok(Upstreamed::from(resp.map(Body::new))),
        Err(mut e) => {
            let error = h1::Error::new(error_chain(e.error()));
            Err(match e.take_message() {
                Some(_) => h1::SendError::Unsent(error),
                None => h1::SendError::Failed(error),
            })
        }
    }
}

/// What the pool needs to know of a connection.
trait Reusable {
    /// The connection is gone (closed by either side, or failed).
    fn is_closed(&mut self) -> bool;
}

impl Reusable for H1 {
    fn is_closed(&mut self) -> bool {
        h1::Conn::is_closed(self)
    }
}

impl Reusable for H2 {
    fn is_closed(&mut self) -> bool {
        http2::SendRequest::is_closed(self)
    }
}

/// One thread's idle HTTP/1.1 connections and shared HTTP/2 connections, by origin.
/// A list, not a map: a gateway has a handful of backend origins, and hashing an
/// authority (byte by byte, case-folded) cost more than comparing a few.
struct Pool<A, B> {
    origins: Vec<(Origin, Idle<A, B>)>,
    last_sweep: Option<Instant>,
    /// A [`reap`] task runs for this pool.
    reaping: bool,
}

impl<A, B> Default for Pool<A, B> {
    fn default() -> Self {
        Pool {
            origins: Vec::new(),
            last_sweep: None,
            reaping: false,
        }
    }
}

struct Idle<A, B> {
    /// HTTP/1.1 connections waiting for a request, oldest first, each with when it
    /// became idle.
    h1: Vec<(A, Instant)>,
    /// An HTTP/2 connection (many requests at once), with when it was last used.
    h2: Option<(B, Instant)>,
}

impl<A, B> Default for Idle<A, B> {
    fn default() -> Self {
        Idle {
            h1: Vec::new(),
            h2: None,
        }
    }
}

/// A kept connection that is not to be used again: closed, or idle past [`IDLE_TIMEOUT`].
fn stale(conn: &mut impl Reusable, since: Instant, now: Instant) -> bool {
    conn.is_closed() || now.duration_since(since) >= IDLE_TIMEOUT
}

impl<A: Reusable, B: Reusable + Clone> Idle<A, B> {
    fn sweep(&mut self, now: Instant) {
        self.h1.retain_mut(|(c, since)| !stale(c, *since, now));
        if self
            .h2
            .as_mut()
            .is_some_and(|(c, since)| stale(c, *since, now))
        {
            self.h2 = None;
        }
    }

    fn is_empty(&self) -> bool {
        self.h1.is_empty() && self.h2.is_none()
    }
}

/// A connection, by the protocol the backend chose.
enum Conn<A, B> {
    H1(A),
    H2(B),
}

impl<A: Reusable, B: Reusable + Clone> Pool<A, B> {
    /// A connection to `origin` ready for a request: the shared HTTP/2 one, else the
    /// HTTP/1.1 one idle the shortest time. Closed and expired ones are dropped on the way.
    fn take(&mut self, origin: &Origin, now: Instant) -> Option<Conn<A, B>> {
        self.maybe_sweep(now);
        let idle = self.idle(origin)?;
        if let Some((c, since)) = &mut idle.h2 {
            if !stale(c, *since, now) {
                *since = now;
                return Some(Conn::H2(c.clone()));
            }
            idle.h2 = None;
        }
        // An HTTP/1.1 connection is kept only between exchanges: the newest that is not
        // stale.
        while let Some((mut c, since)) = idle.h1.pop() {
            if !stale(&mut c, since, now) {
                return Some(Conn::H1(c));
            }
        }
        None
    }

    fn position(&self, origin: &Origin) -> Option<usize> {
        self.origins.iter().position(|(o, _)| o == origin)
    }

    fn idle(&mut self, origin: &Origin) -> Option<&mut Idle<A, B>> {
        let i = self.position(origin)?;
        Some(&mut self.origins[i].1)
    }

    fn idle_or_new(&mut self, origin: &Origin) -> &mut Idle<A, B> {
        let i = match self.position(origin) {
            Some(i) => i,
            None => {
                self.origins.push((origin.clone(), Idle::default()));
                self.origins.len() - 1
            }
        };
        &mut self.origins[i].1
    }

    /// Keeps an HTTP/1.1 connection whose response has ended. Whether the backend has
    /// closed it is looked at when it is taken (and by the sweeps), not here as well:
    /// the response was just read from it, and a close comes later if at all. (One that
    /// is closed already keeps its place until then.)
    fn put(&mut self, origin: &Origin, conn: A, now: Instant) {
        let idle = self.idle_or_new(origin);
        if idle.h1.len() >= MAX_IDLE_PER_ORIGIN {
            idle.h1.remove(0);
        }
        idle.h1.push((conn, now));
    }

    /// Keeps an HTTP/2 connection for every request to `origin`.
    fn put_shared(&mut self, origin: &Origin, conn: B, now: Instant) {
        self.idle_or_new(origin).h2 = Some((conn, now));
    }

    /// Every [`SWEEP_EVERY`], drops closed and expired connections of every origin.
    fn maybe_sweep(&mut self, now: Instant) {
        match self.last_sweep {
            Some(t) if now.duration_since(t) < SWEEP_EVERY => {}
            Some(_) => self.sweep(now),
            None => self.last_sweep = Some(now),
        }
    }

    fn sweep(&mut self, now: Instant) {
        self.last_sweep = Some(now);
        self.origins.retain_mut(|(_, idle)| {
            idle.sweep(now);
            !idle.is_empty()
        });
    }

    #[cfg(test)]
    fn idle_h1(&self, origin: &Origin) -> usize {
        self.position(origin)
            .map_or(0, |i| self.origins[i].1.h1.len())
    }
}

/// A running [`reap`] task of a pool. Dropped with the task (also when the task's runtime
/// goes away before finishing it, or before ever running it): the pool then starts a new
/// reaper with its next connection.
struct Reaping<A, B>(Weak<Mutex<Pool<A, B>>>);

impl<A, B> Drop for Reaping<A, B> {
    fn drop(&mut self) {
        if let Some(pool) = self.0.upgrade() {
            lock(&pool).reaping = false;
        }
    }
}

/// Sweeps the pool every [`SWEEP_EVERY`] while it keeps connections, so idle ones close
/// after [`IDLE_TIMEOUT`] even when no request comes to take them.
async fn reap<A: Reusable, B: Reusable + Clone>(reaping: Reaping<A, B>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(pool) = reaping.0.upgrade() else {
            return;
        };
        let mut pool = lock(&pool);
        pool.sweep(Instant::now());
        if pool.origins.is_empty() {
            return;
        }
    }
}

/// Starts a [`reap`] task for `pool` when none runs (and a runtime is there to run it).
/// Takes the pool's lock and releases it before spawning: a runtime that is shutting
/// down drops the task at once, and the task's end takes the lock.
fn keep_reaped<A, B>(pool: &Arc<Mutex<Pool<A, B>>>, mut guard: MutexGuard<'_, Pool<A, B>>)
where
    A: Reusable + Send + 'static,
    B: Reusable + Clone + Send + 'static,
{
    // Most calls find a reaper running: no runtime lookup for them.
    if guard.reaping {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    guard.reaping = true;
    drop(guard);
    rt.spawn(reap(Reaping(Arc::downgrade(pool))));
}

/// Where an HTTP/1.1 connection goes once its response body has ended: back to the pool
/// of the thread that made it, if the pool is still there.
struct GiveBack {
    pool: Weak<Mutex<Pool<H1, H2>>>,
    origin: Origin,
}

impl h1::Release for GiveBack {
    fn release(self, conn: H1) {
        if let Some(pool) = self.pool.upgrade() {
            let mut guard = lock(&pool);
            guard.put(&self.origin, conn, crate::now::now());
            keep_reaped(&pool, guard);
        }
    }
}

/// An error and its causes on one line. hyper's errors carry no headers, so no
/// credential can appear here.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex as StdMutex;

    use http_body::Frame;
    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use std::io::Write;
    use tokio::net::TcpListener;

    const LONG: Duration = Duration::from_secs(60);

    fn client() -> UpstreamClient {
        UpstreamClient::build(Duration::from_secs(5), false)
    }

    fn post(url: &str) -> http::Request<Bytes> {
        http::Request::post(url)
            .body(Bytes::from_static(b"{\"model\":\"m\"}"))
            .unwrap()
    }

    fn origin(port: u16) -> Origin {
        Origin {
            scheme: Scheme::HTTP,
            authority: format!("127.0.0.1:{port}").parse().unwrap(),
        }
    }

    fn idle_h1(c: &UpstreamClient, port: u16) -> usize {
        lock(&c.0.pools[0]).idle_h1(&origin(port))
    }

    /// What a test backend saw: connections accepted, and each request's line and Host.
    #[derive(Default)]
    struct Seen {
        accepted: AtomicUsize,
        requests: StdMutex<Vec<(String, Option<String>)>>,
    }

    /// An HTTP/1.1 (or, with `h2`, HTTP/2) backend on loopback: `/stall` sends one chunk
    /// and then nothing; anything else gets `ok`.
    async fn backend(h2: bool) -> (u16, Arc<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Seen::default());
        let seen2 = Arc::clone(&seen);
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                seen2.accepted.fetch_add(1, Ordering::SeqCst);
                let seen = Arc::clone(&seen2);
                let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                    let seen = Arc::clone(&seen);
                    async move {
                        let host = req
                            .headers()
                            .get(header::HOST)
                            .map(|h| h.to_str().unwrap().to_string());
                        seen.requests
                            .lock()
                            .unwrap()
                            .push((req.uri().to_string(), host));
                        let stall = req.uri().path() == "/stall";
                        let _ = req.into_body().collect().await;
                        let body: http_body_util::combinators::BoxBody<Bytes, hyper::Error> =
                            if stall {
                                let first = futures_util::stream::once(async {
                                    Ok::<_, hyper::Error>(Frame::data(Bytes::from_static(b"a")))
                                });
                                let rest = futures_util::stream::pending();
                                http_body_util::StreamBody::new(futures_util::StreamExt::chain(
                                    first, rest,
                                ))
                                .boxed()
                            } else {
                                Full::new(Bytes::from_static(b"ok"))
                                    .map_err(|never| match never {})
                                    .boxed()
                            };
                        Ok::<_, std::convert::Infallible>(http::Response::new(body))
                    }
                });
                let io = TokioIo::new(stream);
                if h2 {
                    tokio::spawn(
                        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, svc),
                    );
                } else {
                    tokio::spawn(
                        hyper::server::conn::http1::Builder::new().serve_connection(io, svc),
                    );
                }
            }
        });
        (port, seen)
    }

    async fn body_of(resp: http::Response<Body>) -> Bytes {
        resp.into_body().collect().await.unwrap().to_bytes()
    }

    /// The body of a POST to `path` on the backend at `port`, which must answer.
    async fn answer(c: &UpstreamClient, port: u16, path: &str) -> Bytes {
        let resp = c
            .send_http(&post(&format!("http://127.0.0.1:{port}{path}")), LONG)
            .await
            .unwrap();
        body_of(resp).await
    }

    #[tokio::test]
    async fn sequential_requests_share_one_connection_in_origin_form_with_host() {
        let (port, seen) = backend(false).await;
        let c = client();
        for i in 0..3 {
            let resp = c
                .send_http(&post(&format!("http://127.0.0.1:{port}/v1/x?i={i}")), LONG)
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(body_of(resp).await, "ok");
        }
        assert_eq!(seen.accepted.load(Ordering::SeqCst), 1);
        let reqs = seen.requests.lock().unwrap().clone();
        let host = Some(format!("127.0.0.1:{port}"));
        assert_eq!(
            reqs,
            (0..3)
                .map(|i| (format!("/v1/x?i={i}"), host.clone()))
                .collect::<Vec<_>>()
        );
        assert_eq!(idle_h1(&c, port), 1);
    }

    #[tokio::test]
    async fn the_host_and_length_sent_are_the_connections_whatever_the_request_had() {
        for h2 in [false, true] {
            let (port, seen) = backend(h2).await;
            let mut req = post(&format!("http://127.0.0.1:{port}/"));
            let headers = req.headers_mut();
            headers.insert(header::HOST, HeaderValue::from_static("client.example"));
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("999"));
            let c = UpstreamClient::build(Duration::from_secs(5), h2);
            // Over HTTP/2, a length that is not the body's would fail the request.
            let resp = c.send_http(&req, LONG).await.unwrap();
            assert_eq!(body_of(resp).await, "ok");
            let reqs = seen.requests.lock().unwrap().clone();
            // HTTP/2 has no Host header: its authority (the URI's) is the backend's.
            let want = if h2 {
                (format!("http://127.0.0.1:{port}/"), None)
            } else {
                ("/".to_string(), Some(format!("127.0.0.1:{port}")))
            };
            assert_eq!(reqs, vec![want], "h2: {h2}");
        }
    }

    #[tokio::test]
    async fn concurrent_requests_each_get_a_connection_and_all_are_kept() {
        let (port, seen) = backend(false).await;
        let c = client();
        let url = format!("http://127.0.0.1:{port}/");
        let (ra, rb) = (post(&url), post(&url));
        let (a, b) = tokio::join!(c.send_http(&ra, LONG), c.send_http(&rb, LONG));
        body_of(a.unwrap()).await;
        body_of(b.unwrap()).await;
        assert_eq!(seen.accepted.load(Ordering::SeqCst), 2);
        assert_eq!(idle_h1(&c, port), 2);
        // Both reused afterwards: no third connection.
        let (ra, rb) = (post(&url), post(&url));
        let (a, b) = tokio::join!(c.send_http(&ra, LONG), c.send_http(&rb, LONG));
        body_of(a.unwrap()).await;
        body_of(b.unwrap()).await;
        assert_eq!(seen.accepted.load(Ordering::SeqCst), 2);
    }

    /// The body of a `/stall` answer, its first chunk read; the rest never comes.
    async fn stalled(c: &UpstreamClient, port: u16) -> Body {
        let resp = c
            .send_http(&post(&format!("http://127.0.0.1:{port}/stall")), LONG)
            .await
            .unwrap();
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "a");
        body
    }

    #[tokio::test]
    async fn a_connection_whose_body_was_dropped_unread_is_not_reused() {
        let (port, seen) = backend(false).await;
        let c = client();
        drop(stalled(&c, port).await);
        assert_eq!(idle_h1(&c, port), 0);
        assert_eq!(answer(&c, port, "/").await, "ok");
        assert_eq!(seen.accepted.load(Ordering::SeqCst), 2);
    }

    /// A backend that answers one request per connection, then closes it without saying
    /// so (no `Connection: close`, as an idle timeout on its side would); each close is
    /// reported on the channel once done.
    fn closing_backend() -> (
        u16,
        Arc<AtomicUsize>,
        tokio::sync::mpsc::UnboundedReceiver<()>,
    ) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let (closed, closes) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            while let Ok((mut s, _)) = listener.accept() {
                counter.fetch_add(1, Ordering::SeqCst);
                if read_request(&mut s) {
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
                }
                drop(s);
                let _ = closed.send(());
            }
        });
        (port, accepted, closes)
    }

    #[tokio::test]
    async fn connections_the_backend_closed_are_not_used_again() {
        let (port, accepted, mut closes) = closing_backend();
        let c = client();
        for _ in 0..10 {
            assert_eq!(answer(&c, port, "/").await, "ok");
            // Closed before the next request (a close racing a request is another case:
            // the request fails, as it would on any connection lost mid-request).
            closes.recv().await.unwrap();
            tokio::task::yield_now().await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 10);
    }

    #[tokio::test]
    async fn http2_connections_carry_concurrent_requests() {
        let (port, seen) = backend(true).await;
        let c = UpstreamClient::build(Duration::from_secs(5), true);
        let url = format!("http://127.0.0.1:{port}/v1/y");
        let (ra, rb) = (post(&url), post(&url));
        let (a, b) = tokio::join!(c.send_http(&ra, LONG), c.send_http(&rb, LONG));
        assert_eq!(body_of(a.unwrap()).await, "ok");
        assert_eq!(body_of(b.unwrap()).await, "ok");
        // The first two raced to connect; the third goes over a kept connection.
        let accepted = seen.accepted.load(Ordering::SeqCst);
        assert!((1..=2).contains(&accepted), "{accepted} connections");
        let resp = c.send_http(&post(&url), LONG).await.unwrap();
        assert_eq!(body_of(resp).await, "ok");
        assert_eq!(seen.accepted.load(Ordering::SeqCst), accepted);
        let reqs = seen.requests.lock().unwrap().clone();
        assert_eq!(reqs.len(), 3);
        for (uri, host) in reqs {
            assert_eq!(uri, url);
            assert_eq!(host, None, "the authority goes in :authority only");
        }
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_error() {
        // Bound and not listening: connections are refused, and nothing else can take
        // the port while the test runs.
        let dead = tokio::net::TcpSocket::new_v4().unwrap();
        dead.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = dead.local_addr().unwrap().port();
        let err = client()
            .send_http(&post(&format!("http://127.0.0.1:{port}/")), LONG)
            .await
            .unwrap_err();
        assert!(matches!(err, AttemptError::Connect(_)), "{err:?}");
    }

    #[test]
    fn a_target_that_could_break_the_request_line_is_refused() {
        let (method, scheme) = (Method::POST, Scheme::HTTP);
        let authority = Authority::from_static("b.test:8080");
        let headers = HeaderMap::new();
        let make = |target| {
            UpstreamRequest::new(
                &method,
                (&scheme, &authority),
                target,
                SharedHeaders::Map(&headers),
                None,
                Bytes::new(),
            )
        };
        for bad in [
            "",
            "v1/x",
            "http://b.test/v1/x",
            "/v1/x y",
            "/v1/x HTTP/1.1\r\nx-injected: 1",
            "/v1/x\n",
            "/v1/x\t",
            "/v1/x\0",
            "/v1/x\x7f",
            "/v1/x#fragment",
        ] {
            assert!(
                matches!(make(bad), Err(AttemptError::Request(_))),
                "{bad:?}"
            );
        }
        for good in [
            "/",
            "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            "/v1/files?purpose=caf\u{e9}&x=%20\"{}\"",
        ] {
            let req = make(good).unwrap();
            assert_eq!(req.path_and_query(), good);
        }
    }

    #[test]
    fn the_credential_is_sent_in_place_of_any_header_of_its_name() {
        let (method, scheme) = (Method::POST, Scheme::HTTPS);
        let authority = Authority::from_static("b.test");
        let mut headers = HeaderMap::new();
        headers.append("api-key", HeaderValue::from_static("client-1"));
        headers.append("x-request-id", HeaderValue::from_static("r1"));
        headers.append("api-key", HeaderValue::from_static("client-2"));
        let name = HeaderName::from_static("api-key");
        let key = HeaderValue::from_static("backend");
        let req = UpstreamRequest::new(
            &method,
            (&scheme, &authority),
            "/v1/x?y=1",
            SharedHeaders::Map(&headers),
            Some((&name, &key)),
            Bytes::from_static(b"{}"),
        )
        .unwrap();
        assert_eq!(
            sent(&req),
            [("x-request-id", "r1"), ("api-key", "backend")].map(owned)
        );
        let http = req.to_http().unwrap();
        assert_eq!(http.method(), Method::POST);
        assert_eq!(http.uri(), "https://b.test/v1/x?y=1");
        assert_eq!(http.headers()["x-request-id"], "r1");
        let keys: Vec<_> = http.headers().get_all("api-key").iter().collect();
        assert_eq!(keys, [&key]);
        // The shared headers are lent, not changed.
        assert_eq!(headers.get_all("api-key").iter().count(), 2);
        // Without a credential, every header goes as it is.
        let plain = UpstreamRequest::of(
            &http::Request::get("http://b.test:81")
                .header("api-key", "k")
                .body(Bytes::new())
                .unwrap(),
        )
        .map(|r| (r.path_and_query().to_string(), sent(&r)))
        .unwrap();
        assert_eq!(plain.0, "/");
        assert_eq!(plain.1, [("api-key", "k")].map(owned));
    }

    /// The headers `req` sends, in order.
    fn sent(req: &UpstreamRequest<'_>) -> Vec<(String, String)> {
        let mut sent = Vec::new();
        req.each_header(|n, v| sent.push(owned((n, v))));
        sent
    }

    fn owned((n, v): (impl AsRef<[u8]>, impl AsRef<[u8]>)) -> (String, String) {
        let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
        (text(n.as_ref()), text(v.as_ref()))
    }

    /// A client's lines go as they came, less the credential's name in any case, be it
    /// a common name or not; the request id and the credential follow. Over HTTP/2 (or
    /// to a simulated backend) they are the same headers, in a map.
    #[test]
    fn forwarded_lines_leave_the_credentials_name_to_the_credential() {
        let (method, scheme) = (Method::POST, Scheme::HTTPS);
        let authority = Authority::from_static("b.test");
        let lines = h1::raw_headers(
            b"X-Backend-Key: client\r\nAccept: a\r\nUser-Agent: u\r\nx-backend-key: c2\r\n\r\n",
        );
        let forwarded = Forwarded::new(
            lines,
            crate::proxy::RequestId::Client(HeaderValue::from_static("r1")),
        );
        let mut key = HeaderValue::from_static("backend");
        key.set_sensitive(true);
        for (name, left) in [
            (
                "x-backend-key",
                [("Accept", "a"), ("User-Agent", "u")].map(owned).to_vec(),
            ),
            (
                "user-agent",
                [
                    ("X-Backend-Key", "client"),
                    ("Accept", "a"),
                    ("x-backend-key", "c2"),
                ]
                .map(owned)
                .to_vec(),
            ),
        ] {
            let name = HeaderName::from_static(name);
            let req = UpstreamRequest::new(
                &method,
                (&scheme, &authority),
                "/v1/x",
                SharedHeaders::Forwarded(&forwarded),
                Some((&name, &key)),
                Bytes::new(),
            )
            .unwrap();
            let mut want = left;
            want.push(owned(("x-request-id", "r1")));
            want.push(owned((name.as_str(), "backend")));
            assert_eq!(sent(&req), want, "{name}");
            let http = req.to_http().unwrap();
            let mut map = HeaderMap::new();
            for (n, v) in &want {
                map.append(
                    HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            assert_eq!(*http.headers(), map, "{name}");
            assert!(http.headers()[&name].is_sensitive());
        }
    }

    #[tokio::test]
    async fn a_relative_uri_is_refused() {
        let err = client().send_http(&post("/v1/x"), LONG).await.unwrap_err();
        assert!(matches!(err, AttemptError::Request(_)), "{err:?}");
    }

    #[tokio::test]
    async fn a_connection_still_reading_its_body_is_not_taken() {
        let (port, seen) = backend(false).await;
        let c = client();
        let stalled = stalled(&c, port).await;
        assert_eq!(answer(&c, port, "/").await, "ok");
        assert_eq!(seen.accepted.load(Ordering::SeqCst), 2);
        drop(stalled);
    }

    /// Reads one request of the tests' 13-byte body from a blocking socket.
    fn read_request(s: &mut std::net::TcpStream) -> bool {
        use std::io::Read;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).unwrap_or(0);
            if n == 0 {
                return false;
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(end) = memchr::memmem::find(&buf, b"\r\n\r\n") {
                if buf.len() >= end + 4 + 13 {
                    return true;
                }
            }
        }
    }

    #[tokio::test]
    async fn a_request_the_backend_may_have_read_is_not_sent_again() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            // Answers the first request, reads the second and closes without an answer;
            // any later connection is answered, so a resend would succeed.
            let (mut s, _) = listener.accept().unwrap();
            assert!(read_request(&mut s));
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .unwrap();
            assert!(read_request(&mut s));
            drop(s);
            while let Ok((mut s, _)) = listener.accept() {
                if read_request(&mut s) {
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nresent");
                }
            }
        });
        let c = client();
        let url = format!("http://127.0.0.1:{port}/");
        let resp = c.send_http(&post(&url), LONG).await.unwrap();
        assert_eq!(body_of(resp).await, "ok");
        let err = c.send_http(&post(&url), LONG).await.unwrap_err();
        assert!(matches!(err, AttemptError::Request(_)), "{err:?}");
    }

    #[test]
    fn a_pool_whose_reaper_died_with_its_runtime_starts_a_new_one() {
        let pool: Arc<Mutex<Pool<Fake, Fake>>> = Arc::default();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut guard = lock(&pool);
            guard.put(&origin(1), Fake::new(1), Instant::now());
            keep_reaped(&pool, guard);
        });
        assert!(lock(&pool).reaping);
        drop(rt);
        assert!(!lock(&pool).reaping, "the reaper's end is seen");
    }

    #[test]
    fn host_header_drops_only_the_default_port() {
        let h = |s: &str, a: &str| host_header(&s.parse().unwrap(), &a.parse().unwrap());
        assert_eq!(
            h("https", "r.openai.azure.com").unwrap(),
            "r.openai.azure.com"
        );
        assert_eq!(
            h("https", "r.openai.azure.com:443").unwrap(),
            "r.openai.azure.com"
        );
        assert_eq!(
            h("https", "r.openai.azure.com:8443").unwrap(),
            "r.openai.azure.com:8443"
        );
        assert_eq!(h("http", "127.0.0.1:80").unwrap(), "127.0.0.1");
        assert_eq!(h("http", "127.0.0.1:8080").unwrap(), "127.0.0.1:8080");
        assert_eq!(h("http", "[::1]:9000").unwrap(), "[::1]:9000");
        assert_eq!(
            h("https", "user:secret@r.example:8443").unwrap(),
            "r.example:8443"
        );
        assert_eq!(h("https", "user:secret@r.example").unwrap(), "r.example");
    }

    /// A connection as the pool sees it, with its state set by the test.
    #[derive(Clone, Default)]
    struct Fake {
        id: usize,
        closed: Arc<AtomicBool>,
    }

    impl Fake {
        fn new(id: usize) -> Fake {
            Fake {
                id,
                ..Fake::default()
            }
        }
    }

    impl Reusable for Fake {
        fn is_closed(&mut self) -> bool {
            self.closed.load(Ordering::SeqCst)
        }
    }

    fn taken_h1(t: Option<Conn<Fake, Fake>>) -> Option<usize> {
        match t {
            Some(Conn::H1(f)) => Some(f.id),
            Some(Conn::H2(_)) => panic!("an HTTP/2 connection"),
            None => None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_pool_gives_the_newest_connection_and_drops_dead_ones() {
        let mut pool: Pool<Fake, Fake> = Pool::default();
        let o = origin(1);
        let now = Instant::now();
        let (a, b, c) = (Fake::new(1), Fake::new(2), Fake::new(3));
        pool.put(&o, a.clone(), now);
        pool.put(&o, b.clone(), now);
        pool.put(&o, c.clone(), now);
        b.closed.store(true, Ordering::SeqCst);
        // The newest, c; then b is closed (dropped on the way): a.
        assert_eq!(taken_h1(pool.take(&o, now)), Some(3));
        assert_eq!(taken_h1(pool.take(&o, now)), Some(1));
        assert_eq!(pool.idle_h1(&o), 0);
        assert_eq!(taken_h1(pool.take(&o, now)), None);
        assert_eq!(taken_h1(pool.take(&origin(2), now)), None);
        // A connection closed when it is given back is dropped when next taken.
        pool.put(&o, b, now);
        assert_eq!(pool.idle_h1(&o), 1);
        assert_eq!(taken_h1(pool.take(&o, now)), None);
        assert_eq!(pool.idle_h1(&o), 0);
        // Origins are kept apart.
        pool.put(&origin(2), Fake::new(20), now);
        pool.put(&o, Fake::new(10), now);
        pool.put(&origin(3), Fake::new(30), now);
        assert_eq!(taken_h1(pool.take(&origin(2), now)), Some(20));
        assert_eq!(taken_h1(pool.take(&origin(3), now)), Some(30));
        assert_eq!(taken_h1(pool.take(&o, now)), Some(10));
        assert_eq!(taken_h1(pool.take(&origin(2), now)), None);
    }

    /// What a test's request to a loopback backend at a port borrows: a POST to
    /// `/v1/chat/completions`, with no headers.
    struct ChatTo {
        method: Method,
        scheme: Scheme,
        authority: Authority,
        headers: HeaderMap,
    }

    impl ChatTo {
        fn port(port: u16) -> ChatTo {
            ChatTo {
                method: Method::POST,
                scheme: Scheme::HTTP,
                authority: format!("127.0.0.1:{port}").parse().unwrap(),
                headers: HeaderMap::new(),
            }
        }

        fn request(&self) -> UpstreamRequest<'_> {
            UpstreamRequest::new(
                &self.method,
                (&self.scheme, &self.authority),
                "/v1/chat/completions",
                SharedHeaders::Map(&self.headers),
                None,
                Bytes::from_static(b"{}"),
            )
            .unwrap()
        }
    }

    /// The request of [`ChatTo`] through `relay_inline`, with `timeout` for its first
    /// byte.
    async fn relayed(
        c: &UpstreamClient,
        port: u16,
        timeout: Duration,
    ) -> Result<Upstreamed, AttemptError> {
        let to = ChatTo::port(port);
        c.relay_inline(to.request(), timeout).await
    }

    #[tokio::test]
    async fn a_first_byte_timeout_past_what_the_clock_holds_is_none() {
        let (port, _) = backend(false).await;
        let answer = relayed(&client(), port, Duration::MAX).await.unwrap();
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(&body_of(answer.into_http()).await[..], b"ok");
    }

    #[tokio::test(start_paused = true)]
    async fn a_backend_silent_past_the_first_byte_timeout_fails_the_attempt() {
        // Accepts, reads, and never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut sink = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut sink).await;
        });
        let timeout = Duration::from_millis(250);
        match relayed(&client(), port, timeout).await {
            Err(AttemptError::FirstByteTimeout(d)) => assert_eq!(d, timeout),
            Err(e) => panic!("{e}"),
            Ok(a) => panic!("answered {}", a.status),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pooled_connection_silent_past_the_first_byte_timeout_fails_the_attempt() {
        // Answers the first request, then reads and never answers; counts connections.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::spawn(async move {
                let mut held = Vec::new();
                while let Ok((other, _)) = listener.accept().await {
                    count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    held.push(other);
                }
            });
            let mut buf = vec![0; 4096];
            let _ = tokio::io::AsyncReadExt::read(&mut stream, &mut buf).await;
            tokio::io::AsyncWriteExt::write_all(
                &mut stream,
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            )
            .await
            .unwrap();
            let mut sink = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut sink).await;
        });
        let c = client();
        let answer = relayed(&c, port, LONG).await.unwrap();
        assert_eq!(&body_of(answer.into_http()).await[..], b"ok");
        let timeout = Duration::from_millis(250);
        let start = Instant::now();
        match relayed(&c, port, timeout).await {
            Err(AttemptError::FirstByteTimeout(d)) => assert_eq!(d, timeout),
            Err(e) => panic!("{e}"),
            Ok(a) => panic!("answered {}", a.status),
        }
        let taken = start.elapsed();
        assert!(taken < timeout + Duration::from_millis(10), "{taken:?}");
        // Both went on the one connection.
        assert_eq!(accepted.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn an_attempts_future_fits_the_allocators_per_thread_cache() {
        // Held in each attempt's future (boxed where the upstream is not the gateway's
        // client): glibc's per-thread cache serves up to 1,032 bytes, and a larger box
        // took the allocator's slow path (640 bytes in a release build).
        let c = client();
        let to = ChatTo::port(9);
        let future = c.relay_inline(to.request(), LONG);
        let n = std::mem::size_of_val(&future);
        eprintln!("upstream attempt future: {n} bytes");
        assert!(n <= 1032, "{n}");
    }

    #[test]
    fn origins_compare_as_http_does_whatever_the_case() {
        let at = |scheme: &Scheme, authority: &str| Origin {
            scheme: scheme.clone(),
            authority: authority.parse().unwrap(),
        };
        let same = "res.openai.azure.com";
        // (scheme, authority) against HTTPS `same`, and whether they are equal.
        for (scheme, authority, equal) in [
            (Scheme::HTTPS, same, true),
            (Scheme::HTTPS, "Res.OpenAI.Azure.com", true),
            (Scheme::HTTP, same, false),
            (Scheme::HTTPS, "res.openai.azure.com:8443", false),
            (Scheme::HTTPS, "res2.openai.azure.com", false),
        ] {
            assert_eq!(
                at(&scheme, authority) == at(&Scheme::HTTPS, same),
                equal,
                "{scheme}://{authority}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_expire_and_the_count_is_capped() {
        let mut pool: Pool<Fake, Fake> = Pool::default();
        let o = origin(1);
        let t0 = Instant::now();
        for i in 0..MAX_IDLE_PER_ORIGIN + 2 {
            pool.put(&o, Fake::new(i), t0);
        }
        // The two idle longest went.
        assert_eq!(pool.idle_h1(&o), MAX_IDLE_PER_ORIGIN);
        assert_eq!(pool.origins[0].1.h1[0].0.id, 2);
        pool.put(&o, Fake::new(1000), t0 + Duration::from_secs(60));
        // Past the idle timeout of all but the last one.
        let later = t0 + IDLE_TIMEOUT + Duration::from_secs(1);
        assert_eq!(taken_h1(pool.take(&o, later)), Some(1000));
        assert_eq!(taken_h1(pool.take(&o, later)), None);
        assert_eq!(pool.idle_h1(&o), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_shared_http2_connection_is_taken_until_it_closes_or_idles_out() {
        let mut pool: Pool<Fake, Fake> = Pool::default();
        let o = origin(1);
        let t0 = Instant::now();
        let h2 = Fake::new(7);
        pool.put_shared(&o, h2.clone(), t0);
        for i in 0..3 {
            let t = t0 + Duration::from_secs(60 * i);
            assert!(matches!(pool.take(&o, t), Some(Conn::H2(f)) if f.id == 7));
        }
        // Last used at 120 s: gone past 120 s + the idle timeout.
        let t = t0 + Duration::from_secs(120) + IDLE_TIMEOUT;
        assert!(pool.take(&o, t).is_none());
        pool.put_shared(&o, h2.clone(), t);
        h2.closed.store(true, Ordering::SeqCst);
        assert!(pool.take(&o, t).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn the_reaper_closes_idle_connections_without_requests_then_stops() {
        let pool: Arc<Mutex<Pool<Fake, Fake>>> = Arc::default();
        let o = origin(1);
        let live = Fake::new(1);
        {
            let mut guard = lock(&pool);
            guard.put(&o, live.clone(), Instant::now());
            keep_reaped(&pool, guard);
            assert!(lock(&pool).reaping);
        }
        // A reaper runs: the next `keep_reaped` starts none (each reaper holds a weak
        // reference to the pool).
        keep_reaped(&pool, lock(&pool));
        assert_eq!(Arc::weak_count(&pool), 1);
        tokio::time::sleep(IDLE_TIMEOUT - Duration::from_secs(1)).await;
        assert_eq!(lock(&pool).idle_h1(&o), 1);
        tokio::time::sleep(SWEEP_EVERY + Duration::from_secs(2)).await;
        let guard = lock(&pool);
        assert_eq!(guard.idle_h1(&o), 0);
        assert!(guard.origins.is_empty());
        assert!(!guard.reaping, "the reaper stops once the pool is empty");
        // Only the pool held the connection: it was dropped (closed).
        assert_eq!(Arc::strong_count(&live.closed), 1);
    }
}
