//! The public listener: HTTP/1.1 (see [`crate::front`]) with bounded header size and
//! count, `/healthz`, `/readyz`, and everything else to the proxy.
//!
//! The accept loop is written out (rather than `axum::serve`) because it is where the
//! connection limit is kept and where a shutdown signal stops accepting.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::StatusCode;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore, TryAcquireError};

use crate::app::App;
use crate::front::{Reply, Request};
use crate::proxy::RequestId;

/// What the public listener serves (through [`Gateway::handle`]; tests, benches and the
/// simulator call it as a `tower::Service`): `/healthz` and `/readyz` through a small
/// axum router, every other path straight to the proxy (a router, a middleware and an
/// extractor per request were a tenth of the gateway's instructions per proxied
/// request), both behind [`serve`]'s request id and accounting.
#[derive(Clone)]
pub struct Gateway {
    app: Arc<App>,
    probes: Router,
}

/// The public listener's service for `app`.
pub fn router(app: Arc<App>) -> Gateway {
    let probes = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Arc::clone(&app));
    Gateway { app, probes }
}

impl<B> tower::Service<Request<B>> for Gateway
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Reply<axum::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        Box::pin(self.handle(req).map(Ok))
    }
}

impl Gateway {
    /// The answer to `req`, as a future the caller may keep where it likes (the client
    /// connection keeps it in one allocation from request to request, see
    /// [`crate::front::serve`]).
    pub fn handle<B>(&self, req: Request<B>) -> impl Future<Output = Reply<axum::body::Body>> + Send
    where
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<axum::BoxError>,
    {
        let req = req.map(crate::front::ClientBody::new);
        let probes = matches!(req.uri.path(), "/healthz" | "/readyz").then(|| self.probes.clone());
        serve(Arc::clone(&self.app), probes, req)
    }
}

/// A request made as an `http::Request` (the tests', a simulation's), its headers made
/// the lines a client's would be.
impl<B> tower::Service<http::Request<B>> for Gateway
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Reply<axum::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        tower::Service::<Request<B>>::call(self, Request::from_http(req))
    }
}

/// The request id header, as a request's headers are searched for it.
static REQUEST_ID: crate::h1::Common = crate::h1::Common::new("x-request-id");

/// Whether a request id the client sent is safe to echo and log.
fn sane_request_id(b: &[u8]) -> bool {
    !b.is_empty()
        && b.len() <= 128
        && b.iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// A new request id: 16 random hex digits, written without a formatter (every request
/// without an id of its own takes one). Always a valid header value; held inline, so
/// the copies the request and its response take allocate nothing.
fn new_request_id() -> RequestId {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let id = fastrand::u64(..);
    let mut n = id;
    let mut digits = [0u8; 16];
    for d in digits.iter_mut().rev() {
        *d = HEX[(n & 15) as usize];
        n >>= 4;
    }
    RequestId::Own(digits)
}

/// Gives every request an id (the client's `x-request-id` when present and sane, else a
/// new one), carried by every log line of the request, sent upstream and returned in
/// `x-request-id`. `probes` serves `/healthz` and `/readyz` (not counted); the proxy
/// serves (and counts) the rest. Not an `async fn`: one would hold the request twice
/// (its argument, and the copy its body moves it into) beside the proxy's future that
/// takes it, and each byte of the future is copied as it is written into the
/// connection's slot for it (see [`crate::front::serve`]).
fn serve(
    app: Arc<App>,
    probes: Option<Router>,
    req: Request<crate::front::ClientBody>,
) -> impl Future<Output = Reply<axum::body::Body>> + Send {
    use futures_util::future::Either;
    use tower::ServiceExt;
    use tracing::Instrument;
    let header = match req
        .headers
        .value(&REQUEST_ID)
        .filter(|v| sane_request_id(v.as_bytes()))
    {
        Some(v) => RequestId::Client(v),
        None => new_request_id(),
    };
    let span = tracing::info_span!("req", request_id = %header.as_str());
    let Some(probes) = probes else {
        let proxied = crate::proxy::handle(app, req, header.clone()).instrument(span);
        return Either::Left(proxied.map(move |mut reply| {
            match &mut reply {
                Reply::Response(resp) => {
                    resp.headers_mut()
                        .insert(crate::proxy::HEADER_REQUEST_ID, header.to_value());
                }
                Reply::Relay(relay) => relay.set_request_id(header),
            }
            reply
        }));
    };
    Either::Right(async move {
        let Ok(mut resp) = probes.oneshot(req.into_http()).instrument(span).await;
        resp.headers_mut()
            .insert(crate::proxy::HEADER_REQUEST_ID, header.to_value());
        Reply::Response(resp)
    })
}

async fn healthz() -> impl IntoResponse {
    Json(serde_json::json!({"status": "ok"}))
}

/// Readiness for a load balancer: the gateway answers requests (even when every backend
/// is throttled it answers 429 with `Retry-After`, which clients need to see, so cooling
/// backends do not make it unready). The body lists each backend's state and its
/// deployments' states, the backends whose Entra ID token is missing, and whether the
/// shared state store (Redis) is connected: names only, no URLs, keys or identity errors.
/// A lost Redis does not make the gateway unready: it serves from its own state.
async fn readyz(State(app): State<Arc<App>>) -> Response {
    let snap = app.snapshot.load();
    let now = app.clock.now_ms();
    let backends: Vec<_> = snap
        .backends
        .iter()
        .map(|b| crate::admin::backend_json(b, now, false))
        .collect();
    // A backend can serve when the resource and at least one of its deployments are ready.
    let any_ready = snap.backends.iter().any(|b| {
        let deps = b.deployments.all();
        b.state.is_ready(now) && (deps.is_empty() || deps.iter().any(|(_, d)| d.is_ready(now)))
    });
    // Backends with an Entra ID credential and no token to send: they cannot serve until
    // one is obtained (the admin port's /admin/state says why).
    let without_token: Vec<&str> = snap
        .backends
        .iter()
        .filter(|b| crate::admin::token_state(b).is_some_and(|t| t != "ready"))
        .map(|b| &*b.cfg.name)
        .collect();
    let draining = app.draining();
    let status = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (
        status,
        Json(serde_json::json!({
            "ready": !draining,
            "draining": draining,
            "any_backend_ready": any_ready,
            "backends_without_token": without_token,
            // Whether the shared store is reachable; the gateway serves either way.
            "state_store": app.store.status().json(false),
            "backends": backends,
        })),
    )
        .into_response()
}

/// A running gateway listener.
pub struct Running {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Graceful shutdown: marks the gateway as draining (`/readyz` turns 503), keeps
    /// accepting for `server.shutdown_delay` (0 by default) so a load balancer can take it
    /// out, then stops accepting (new connections are refused), lets in-flight requests
    /// and streams finish for up to `server.drain_timeout`, and closes what is left.
    pub async fn shutdown(self) {
        self.app.start_draining();
        // Still accepting for a while: load balancers see /readyz turn 503 and stop
        // sending before connections are refused.
        let delay = self.app.snapshot.load().config.server.shutdown_delay;
        if !delay.is_zero() {
            tracing::info!(
                delay_ms = delay.as_millis() as u64,
                "not ready; accepting until the shutdown delay ends"
            );
            tokio::time::sleep(delay).await;
        }
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Binds `app`'s listen address (port 0 picks a free port) and serves until shut down,
/// each connection as a task of the current runtime.
pub async fn start(app: Arc<App>) -> anyhow::Result<Running> {
    start_on(app, None).await
}

/// Like [`start`], with the connections served on `workers` (see [`ConnectionThreads`])
/// instead of the current runtime: each connection thread accepts on its own listener
/// bound to the same address (`SO_REUSEPORT`, the kernel spreads new connections over
/// them) and serves what it accepted from start to end. A connection accepted on one
/// thread and handed to another waited for that thread to wake, before its first byte.
pub async fn start_on(
    app: Arc<App>,
    workers: Option<Arc<ConnectionThreads>>,
) -> anyhow::Result<Running> {
    let snap = app.snapshot.load();
    let server_cfg = snap.config.server.clone();
    let header_timeout = snap.config.timeouts.client_header;
    let send_timeout = snap.config.timeouts.client_send;
    drop(snap);
    let listeners = bind_shared(
        server_cfg.listen,
        workers.as_ref().map_or(1, |w| w.threads()),
    )?;
    let addr = listeners[0].local_addr()?;
    let (stop, stopped) = watch::channel(false);
    crate::health::spawn(&app);
    app.start_store();
    // Each connection holds a permit: past the limit, new connections wait (see
    // `Accept::run`) instead of exhausting memory and file descriptors; and the drain
    // ends when every permit is back.
    let permits = Arc::new(Semaphore::new(server_cfg.max_connections));
    let accept = Accept {
        limits: crate::front::Limits {
            max_head: server_cfg.max_header_bytes,
            max_headers: server_cfg.max_headers,
            header_timeout,
            send_timeout,
        },
        service: router(Arc::clone(&app)),
        permits: Arc::clone(&permits),
        stopped,
    };
    let mut loops = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let accept = accept.clone();
        // The listener is registered with the reactor of the runtime that accepts on it.
        let run = async move {
            match TcpListener::from_std(listener) {
                Ok(l) => accept.run(l).await,
                Err(e) => tracing::error!(error = %e, "could not listen on a connection thread"),
            }
        };
        loops.push(match &workers {
            Some(w) => w.spawn_on(i, run),
            None => tokio::spawn(run),
        });
    }
    drop(accept);
    let task = tokio::spawn(async move {
        // The connection threads run as long as they are referenced: until the drain ends.
        let _workers = workers;
        // The accept loops end (closing their listeners: new connections are refused at
        // once) when `stop` says so.
        for l in loops {
            let _ = l.await;
        }
        tracing::info!(
            drain_timeout_ms = server_cfg.drain_timeout.as_millis() as u64,
            "draining in-flight requests"
        );
        // Every loop has ended: the permits still out are the open connections'. Idle
        // ones close at once; the others after the response in progress. (The limit is
        // at most 1,000,000 by the config's bounds.)
        let all = u32::try_from(server_cfg.max_connections).unwrap_or(u32::MAX);
        if tokio::time::timeout(server_cfg.drain_timeout, permits.acquire_many(all))
            .await
            .is_err()
        {
            tracing::warn!("drain timeout reached; closing the connections still open");
        }
    });
    Ok(Running {
        addr,
        app,
        stop,
        task,
    })
}

/// `n` listeners on `addr`, sharing it with `SO_REUSEPORT` (port 0: a free port), not yet
/// registered with any runtime. With `TCP_NODELAY`, which on Linux the connections they
/// accept inherit (a system call less a connection).
fn bind_shared(addr: SocketAddr, n: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    // An address something else listens on is refused, as a plain bind would be: a second
    // gateway started on the same port must fail, not silently take half the connections
    // (listeners with SO_REUSEPORT of the same user share a port). Port 0 needs no such
    // check (the kernel never picks a port another SO_REUSEPORT socket holds), and must
    // not get one: between the check's socket closing and the first listener binding,
    // another socket may take the port it picked.
    let mut addr = addr;
    if addr.port() != 0 {
        addr = std::net::TcpListener::bind(addr)?.local_addr()?;
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // As `TcpListener::bind` does: a restarted gateway can bind while connections
        // of the previous one are in TIME_WAIT.
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.set_nodelay(true)?;
        // Not `TCP_DEFER_ACCEPT` (accepting only once the request's first bytes are
        // there, as nginx's `listen ... deferred`): a throwaway build with it showed no
        // gain in a stream's first event (20 rounds as `FIRST_EVENT=1 bench/ab.sh`
        // runs them: +0.001 ms, 95% CI -0.003 to +0.015), and there is no safe way to
        // set it (std's `set_deferaccept` is unstable; socket2 and nix lack it).
        socket.bind(addr)?;
        let listener = socket.listen(1024)?;
        // The port the kernel picked, for the listeners after the first to share.
        addr = listener.local_addr()?;
        out.push(listener.into_std()?);
    }
    Ok(out)
}

/// What each accept loop shares.
#[derive(Clone)]
struct Accept {
    limits: crate::front::Limits,
    service: Gateway,
    /// One held by each connection until it ends.
    permits: Arc<Semaphore>,
    stopped: watch::Receiver<bool>,
}

impl Accept {
    /// Accepts on `listener` until stopped, serving each connection as a task of the
    /// current runtime.
    async fn run(self, listener: TcpListener) {
        // One wait for the stop for the loop's whole life: made again for each
        // connection (twice, beside the accept and the wait for a slot), it was about
        // 1,000 instructions a connection (callgrind).
        let mut stop_rx = self.stopped.clone();
        let mut stop = std::pin::pin!(async move {
            let _ = stop_rx.changed().await;
        });
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = &mut stop => break,
            };
            let (stream, _peer) = match accepted {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // Accepted first, then a slot: the kernel picks the listener, so a loop that
            // took a slot before accepting could hold it while a connection waited in
            // another listener's queue. Past the limit, each listener holds the one
            // connection it accepted until a slot frees (in order of waiting), and the
            // rest wait in the kernel's accept queues.
            let permit = match Arc::clone(&self.permits).try_acquire_owned() {
                Ok(p) => p,
                Err(TryAcquireError::Closed) => break,
                // The stop first: a stop frees slots (idle connections close on it), so
                // both are often ready at once, and the connection that waited is then
                // closed unanswered rather than served by chance.
                Err(TryAcquireError::NoPermits) => tokio::select! {
                    biased;
                    () = &mut stop => break,
                    p = Arc::clone(&self.permits).acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                },
            };
            // Inherited from the listener on Linux (see `bind_shared`).
            #[cfg(not(target_os = "linux"))]
            let _ = stream.set_nodelay(true);
            let gateway = self.service.clone();
            let conn = crate::front::serve(
                stream,
                move |req| gateway.handle(req),
                self.limits,
                self.stopped.clone(),
            );
            // A combinator rather than an `async` block: the task holds the connection
            // once (a block also kept what it was built from), for as long as it is open.
            // Boxed: the connection's future is about 1.7 KB, and tokio moves a task's
            // future through several layers as it spawns it and writes its stage over
            // (`Core::set_stage`) as it ends, eight copies of the whole future, about
            // 1,500 instructions a connection (callgrind); the box is copied into once.
            // Each poll reads the clock once (`crate::now`).
            tokio::spawn(crate::now::OnePoll(
                Box::pin(conn).map(move |()| drop(permit)),
            ));
            // The new connection's request is usually there already: its task reads it and
            // sends it on before this loop calls `accept4` again, which mostly finds
            // nothing more and had delayed the request when it came first. Under a burst,
            // one connection is accepted per turn of the queue (as nginx's default
            // `multi_accept off` accepts one per turn of its event loop).
            behind_queued().await;
        }
    }
}

/// Lets the tasks queued on this thread run, then resumes: the task wakes itself and goes
/// to the back of the runtime's queue. (Unlike `tokio::task::yield_now`, whose wake waits
/// for the next turn of the I/O driver, an extra `epoll_wait`.)
fn behind_queued() -> impl Future<Output = ()> {
    let mut queued = false;
    std::future::poll_fn(move |cx| {
        if queued {
            return Poll::Ready(());
        }
        queued = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
}

/// One single-threaded runtime per core, each accepting connections on its own listener
/// and serving them from start to end, with its own upstream connection pool (nginx's
/// process-per-core layout).
/// A request then runs on one thread from the client's bytes to the backend's answer:
/// measured on 2 cores, tokio's shared multi-threaded scheduler spent a third more CPU per
/// proxied request on its workers waking each other than one thread did.
pub struct ConnectionThreads {
    handles: Vec<tokio::runtime::Handle>,
    /// Dropped with the pool: each thread's runtime then finishes its `block_on`.
    _stop: watch::Sender<()>,
}

impl ConnectionThreads {
    /// Starts `n` threads (at least one), each with a current-thread runtime.
    pub fn start(n: usize) -> anyhow::Result<Arc<ConnectionThreads>> {
        let (stop, _) = watch::channel(());
        let mut handles = Vec::new();
        for i in 0..n.max(1) {
            let (tx, rx) = std::sync::mpsc::channel();
            let mut stopped = stop.subscribe();
            std::thread::Builder::new()
                .name(format!("spillgate-conn-{i}"))
                .spawn(move || {
                    crate::upstream::set_pool_slot(i + 1);
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = tx.send(Ok(rt.handle().clone()));
                    // Runs the connections' tasks until the pool is dropped.
                    rt.block_on(async move { while stopped.changed().await.is_ok() {} });
                })?;
            handles.push(rx.recv()??);
        }
        Ok(Arc::new(ConnectionThreads {
            handles,
            _stop: stop,
        }))
    }

    /// How many connection threads there are (at least one).
    fn threads(&self) -> usize {
        self.handles.len()
    }

    /// Runs `fut` on connection thread `i` (modulo their number).
    fn spawn_on(
        &self,
        i: usize,
        fut: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        self.handles[i % self.handles.len()].spawn(fut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shared_listeners_take_one_port_and_the_kernel_spreads_connections() {
        let listeners = bind_shared("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let addr = listeners[0].local_addr().unwrap();
        assert_ne!(addr.port(), 0);
        assert_eq!(listeners[1].local_addr().unwrap(), addr);
        let listeners: Vec<TcpListener> = listeners
            .into_iter()
            .map(|l| TcpListener::from_std(l).unwrap())
            .collect();
        let mut clients = Vec::new();
        for _ in 0..32 {
            clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Each connection waits in exactly one listener's queue.
        let mut counts = [0; 2];
        for _ in 0..32 {
            tokio::select! {
                a = listeners[0].accept() => { a.unwrap(); counts[0] += 1; }
                a = listeners[1].accept() => { a.unwrap(); counts[1] += 1; }
            }
        }
        assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
    }

    // Linux only: elsewhere the accept loop sets the option on each connection.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn accepted_connections_send_without_delay() {
        let listener = bind_shared("127.0.0.1:0".parse().unwrap(), 1).unwrap();
        let listener = TcpListener::from_std(listener.into_iter().next().unwrap()).unwrap();
        let _client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        // What the accept loop relies on instead of setting it on each connection.
        assert!(stream.nodelay().unwrap());
    }

    #[tokio::test]
    async fn behind_queued_lets_the_tasks_queued_before_it_run_first() {
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..3 {
            let ran = Arc::clone(&ran);
            tokio::spawn(async move {
                ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
        }
        // The spawned tasks have not run: this one has not given way yet.
        assert_eq!(ran.load(std::sync::atomic::Ordering::Relaxed), 0);
        behind_queued().await;
        assert_eq!(ran.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    #[tokio::test]
    async fn port_0_gives_each_gateway_a_port_of_its_own() {
        // Each gateway's listeners share the one port the kernel picked for the first of
        // them, and no two gateways get the same one. (The race this binding removes, a
        // probed port taken before the bind, is not reproduced here.)
        let mut ports = std::collections::HashSet::new();
        let mut held = Vec::new();
        for _ in 0..50 {
            let listeners = bind_shared("127.0.0.1:0".parse().unwrap(), 3).unwrap();
            let port = listeners[0].local_addr().unwrap().port();
            assert_ne!(port, 0);
            for l in &listeners {
                assert_eq!(l.local_addr().unwrap().port(), port);
            }
            assert!(ports.insert(port), "port {port} given twice");
            held.push(listeners);
        }
    }

    #[tokio::test]
    async fn an_address_another_listener_holds_is_refused() {
        // A plain listener, and another gateway's shared listeners.
        let plain = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gateway = bind_shared("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        for addr in [
            plain.local_addr().unwrap(),
            gateway[0].local_addr().unwrap(),
        ] {
            let err = bind_shared(addr, 2).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{addr}");
        }
    }
}
