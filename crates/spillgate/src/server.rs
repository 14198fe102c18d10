//! The public listener: HTTP/1.1 with bounded header size and count, `/healthz`,
//! `/readyz`, and everything else to the proxy.
//!
//! The accept loop is written out (rather than `axum::serve`) because it is where the
//! header limits are set and where a shutdown signal stops accepting.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::StatusCode;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::app::App;
use crate::state::Availability;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(crate::proxy::handle)
        .with_state(app)
}

async fn healthz() -> impl IntoResponse {
    Json(serde_json::json!({"status": "ok"}))
}

/// Ready when at least one backend can take traffic now. Lists backend names and states
/// only: no URLs, no keys.
async fn readyz(State(app): State<Arc<App>>) -> Response {
    let snap = app.snapshot.load();
    let now = app.clock.now_ms();
    let mut any_ready = false;
    let backends: Vec<_> = snap
        .backends
        .iter()
        .map(|b| match b.state.availability(now) {
            Availability::Ready => {
                any_ready = true;
                serde_json::json!({"name": &*b.cfg.name, "priority": b.cfg.priority, "state": "ready"})
            }
            Availability::Cooling { until_ms, reason } => serde_json::json!({
                "name": &*b.cfg.name,
                "priority": b.cfg.priority,
                "state": "cooling",
                "reason": reason.map(|r| r.as_str()),
                "cooling_ms": until_ms.saturating_sub(now),
            }),
        })
        .collect();
    let status = if any_ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(serde_json::json!({"ready": any_ready, "backends": backends})),
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
    /// Stops accepting new connections. Connections already open finish their requests.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Binds `app`'s listen address (port 0 picks a free port) and serves until shut down.
pub async fn start(app: Arc<App>) -> anyhow::Result<Running> {
    let server_cfg = app.snapshot.load().config.server.clone();
    let listener = TcpListener::bind(server_cfg.listen).await?;
    let addr = listener.local_addr()?;
    let (stop, mut stopped) = watch::channel(false);
    crate::health::spawn(&app);
    let service = router(Arc::clone(&app));
    let task = tokio::spawn(async move {
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .max_buf_size(server_cfg.max_header_bytes)
            .max_headers(server_cfg.max_headers)
            .header_read_timeout(Duration::from_secs(30))
            .keep_alive(true);
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stopped.changed() => break,
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
            let _ = stream.set_nodelay(true);
            let conn = http.serve_connection(
                TokioIo::new(stream),
                TowerToHyperService::new(service.clone()),
            );
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "client connection ended with an error");
                }
            });
        }
    });
    Ok(Running {
        addr,
        app,
        stop,
        task,
    })
}
