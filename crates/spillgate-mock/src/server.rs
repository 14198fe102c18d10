//! The running mock server: accepts connections (HTTP/1.1 and HTTP/2 with
//! prior knowledge) and owns them, so that stopping the server also cuts
//! every open connection, as a crashed backend would.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use crate::config::MockConfig;
use crate::handler;
use crate::reply::Reply;
use crate::state::{RecordedRequest, Shared};
use crate::MockState;

/// A running mock backend. Dropping it (or calling [`MockBackend::shutdown`])
/// stops listening and closes every connection.
pub struct MockBackend {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockBackend")
            .field("name", &self.shared.cfg.name)
            .field("addr", &self.addr)
            .finish()
    }
}

impl MockBackend {
    /// Start on an ephemeral port of 127.0.0.1.
    pub async fn start(cfg: MockConfig) -> anyhow::Result<MockBackend> {
        Self::start_on(cfg, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await
    }

    /// Start on `addr`.
    pub async fn start_on(cfg: MockConfig, addr: SocketAddr) -> anyhow::Result<MockBackend> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding mock backend {:?} to {addr}", cfg.name))?;
        let addr = listener
            .local_addr()
            .context("reading the mock backend's address")?;
        let shared = Arc::new(Shared::new(cfg));
        let task = tokio::spawn(serve(listener, Arc::clone(&shared)));
        Ok(MockBackend {
            addr,
            shared,
            task: Some(task),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn name(&self) -> &str {
        &self.shared.cfg.name
    }

    /// Requests received on API paths (everything but `/_mock/*`).
    pub fn hits(&self) -> u64 {
        Shared::get(&self.shared.counters.hits)
    }

    /// API requests answered 429, by the limiter or by a scripted reply.
    pub fn hits_429(&self) -> u64 {
        Shared::get(&self.shared.counters.hits_429)
    }

    /// Every API request received since the start or the last reset.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.requests()
    }

    /// Turn recording of API requests on or off (it is on from the start).
    /// Long benchmark runs turn it off: every record is kept until `reset`,
    /// so memory would otherwise grow with every request.
    pub fn set_recording(&self, on: bool) {
        self.shared.set_recording(on);
    }

    /// The next API requests get these replies, in order; once the queue is
    /// empty, the default behaviour applies again.
    pub fn push_script(&self, replies: Vec<Reply>) {
        self.shared.push_script(replies);
    }

    /// Replace the default behaviour; `None` restores the built-in one.
    pub fn set_default(&self, reply: Option<Reply>) {
        self.shared.set_default(reply);
    }

    /// SSE responses whose body was written to the end.
    pub fn streams_completed(&self) -> u64 {
        Shared::get(&self.shared.counters.streams_completed)
    }

    /// SSE responses dropped before their end because the client went away
    /// (or the server was stopped); deliberate `break_after` breaks do not count.
    pub fn streams_cancelled(&self) -> u64 {
        Shared::get(&self.shared.counters.streams_cancelled)
    }

    /// API requests whose client disconnected before the response head was sent (e.g. a
    /// gateway that cancelled an upstream request because its own client went away).
    pub fn requests_abandoned(&self) -> u64 {
        Shared::get(&self.shared.counters.requests_abandoned)
    }

    /// Token requests received by the token service (empty without one).
    pub fn identity_requests(&self) -> Vec<RecordedRequest> {
        self.shared
            .identity
            .as_ref()
            .map(|i| i.view().recorded)
            .unwrap_or_default()
    }

    /// Switches the token service: failing (503) or not, and revoking every token
    /// issued so far. No effect without one.
    pub fn identity_control(&self, control: crate::IdentityControl) {
        if let Some(i) = &self.shared.identity {
            i.control(&control);
        }
    }

    /// Everything `GET /_mock/state` reports.
    pub fn state(&self) -> MockState {
        self.shared.state()
    }

    /// Clear counters, recorded requests, the script, the default reply and
    /// the limiter's windows.
    pub fn reset(&self) {
        self.shared.reset();
    }

    /// Stop the server and wait until the listener and all connections are closed.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // The only possible error is the cancellation just requested.
            let _ = task.await;
        }
    }
}

impl Drop for MockBackend {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Accept loop. Connections live in a `JoinSet` owned by this task, so that
/// aborting the task drops them all.
async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let builder = auto::Builder::new(TokioExecutor::new());
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _peer)) => stream,
                    Err(err) => {
                        // E.g. out of file descriptors under benchmark load:
                        // back off instead of spinning.
                        tracing::warn!(%err, "mock backend accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                // SSE chunks must reach the client when written, not when
                // Nagle's algorithm decides.
                if let Err(err) = stream.set_nodelay(true) {
                    tracing::debug!(%err, "set_nodelay failed");
                }
                let shared = Arc::clone(&shared);
                let service = service_fn(move |req| {
                    let shared = Arc::clone(&shared);
                    async move { Ok::<_, Infallible>(handler::handle(shared, req).await) }
                });
                let conn = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .into_owned();
                connections.spawn(async move {
                    if let Err(err) = conn.await {
                        tracing::debug!(%err, "mock backend connection ended with an error");
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}
