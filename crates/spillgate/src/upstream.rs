//! The HTTP client that talks to backends.
//!
//! hyper-util's pooled client over rustls (the system's CA store, else webpki roots;
//! HTTP/1.1 and HTTP/2 by ALPN):
//! the thinnest layer that gives connection reuse, so the proxy path adds as little as
//! possible. The connect timeout lives in the connector; the time-to-first-byte timeout
//! wraps each request; the idle timeout between body chunks wraps the response body.

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use spillgate_core::config::Timeouts;

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
    /// Resolves when the response headers arrive, or fails after `timeout`.
    fn send(
        &self,
        req: http::Request<Full<Bytes>>,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<http::Response<Body>, AttemptError>>;
}

type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Pools an upstream client keeps at most: one per connection thread (see
/// [`set_pool_slot`]) plus one for every other thread.
const MAX_POOLS: usize = 65;

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

pub struct UpstreamClient {
    /// Built once and shared by the pools: building it reads and parses the system's CA
    /// store, milliseconds that each connection thread's first request used to wait for.
    connector: HttpsConnector<HttpConnector>,
    /// Built on first use by a thread of that slot.
    pools: Box<[OnceLock<HttpClient>]>,
}

impl UpstreamClient {
    pub fn new(timeouts: &Timeouts) -> UpstreamClient {
        UpstreamClient {
            connector: build_connector(timeouts.connect),
            pools: (0..MAX_POOLS).map(|_| OnceLock::new()).collect(),
        }
    }

    fn client(&self) -> &HttpClient {
        // `set_pool_slot` keeps slots below MAX_POOLS, the length of `pools`.
        let slot = POOL_SLOT.with(std::cell::Cell::get) % MAX_POOLS;
        self.pools[slot].get_or_init(|| build_client(self.connector.clone()))
    }
}

fn build_connector(connect_timeout: Duration) -> HttpsConnector<HttpConnector> {
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

fn build_client(https: HttpsConnector<HttpConnector>) -> HttpClient {
    Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(https)
}

impl Upstream for UpstreamClient {
    fn send(
        &self,
        req: http::Request<Full<Bytes>>,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<http::Response<Body>, AttemptError>> {
        let fut = self.client().request(req);
        Box::pin(async move {
            match tokio::time::timeout(timeout, fut).await {
                Err(_) => Err(AttemptError::FirstByteTimeout(timeout)),
                Ok(Ok(resp)) => Ok(resp.map(Body::new)),
                Ok(Err(e)) if e.is_connect() => Err(AttemptError::Connect(error_chain(&e))),
                Ok(Err(e)) => Err(AttemptError::Request(error_chain(&e))),
            }
        })
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
