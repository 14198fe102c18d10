//! The admin listener: a separate port (never the public one) for operators, serving
//! `/admin/state` (every backend, its deployments and the live config version),
//! `/metrics` (Prometheus text) and `/` (a live dashboard). An optional token (from `env:`)
//! guards it.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::{header, HeaderValue, StatusCode};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

use crate::app::{App, BackendRt};
use crate::entra::{CredentialStatus, TokenSource};
use crate::state::{Availability, BackendState};

/// One state as JSON: `ready`, `probing` (recovering, one request at a time), `cooling` or
/// `tripped` (with reason and time left).
pub fn state_json(state: &BackendState, now: u64) -> serde_json::Value {
    match state.availability(now) {
        Availability::Ready if state.is_recovering() => serde_json::json!({"state": "probing"}),
        Availability::Ready => serde_json::json!({"state": "ready"}),
        Availability::Cooling { until_ms, reason } => {
            let tripped = reason == Some(spillgate_core::outcome::CoolReason::Tripped);
            serde_json::json!({
                "state": if tripped { "tripped" } else { "cooling" },
                "reason": reason.map(|r| r.as_str()),
                "until_ms": until_ms,
                "cooling_ms": until_ms.saturating_sub(now),
            })
        }
    }
}

fn capacity_json(state: &BackendState, now: u64) -> serde_json::Value {
    let c = state.capacity();
    let (tokens, requests) = c.available(now);
    serde_json::json!({
        "remaining_tokens": tokens,
        "limit_tokens": c.tokens.map(|t| t.limit),
        "remaining_requests": requests,
        "limit_requests": c.requests.map(|r| r.limit),
        "inflight_tokens": c.inflight_tokens,
        "inflight_requests": c.inflight_requests,
        "observed_ms_ago": c.observed_ms.map(|o| now.saturating_sub(o)),
    })
}

/// Whether a backend with an Entra ID credential has a token to send: `ready`,
/// `pending` (the first fetch is under way) or `missing` (fetching failed). `None` for a
/// backend without one.
pub fn token_state(b: &BackendRt) -> Option<&'static str> {
    let source = b.entra.as_ref()?;
    Some(match source.status() {
        CredentialStatus::Ready { .. }
        | CredentialStatus::Failing {
            token_left: Some(_),
            ..
        } => "ready",
        CredentialStatus::Pending => "pending",
        CredentialStatus::Failing {
            token_left: None, ..
        } => "missing",
    })
}

/// A backend's Entra ID credential for the admin port: which identity, where its tokens
/// come from, and the state of its token (with the last error while fetching fails).
fn credential_json(source: &TokenSource) -> serde_json::Value {
    let mut v = serde_json::json!({
        "entra": source.auth().credential.kind().as_str(),
        "credential": source.label(),
        "endpoint": source.endpoint(),
    });
    match source.status() {
        CredentialStatus::Ready { expires_in } => {
            v["token"] = serde_json::json!("ready");
            v["expires_in_s"] = serde_json::json!(expires_in.as_secs());
        }
        CredentialStatus::Pending => v["token"] = serde_json::json!("pending"),
        CredentialStatus::Failing {
            message,
            failures,
            token_left,
        } => {
            v["token"] = serde_json::json!(if token_left.is_some() {
                "ready"
            } else {
                "missing"
            });
            v["expires_in_s"] = serde_json::json!(token_left.map(|d| d.as_secs()));
            v["failures"] = serde_json::json!(failures);
            v["error"] = serde_json::json!(&*message);
        }
    }
    v
}

/// A backend and each of its deployments: name, priority and state. `detail` (the admin
/// port) adds kind, weight, last status, requests served, tracked capacity and the Entra
/// ID credential; without it (`/readyz` on the public port) it is names and states only
/// (and, for a backend with an Entra ID credential, whether it has a token).
pub fn backend_json(b: &BackendRt, now: u64, detail: bool) -> serde_json::Value {
    let mut v = state_json(&b.state, now);
    v["name"] = serde_json::json!(&*b.cfg.name);
    v["priority"] = serde_json::json!(b.cfg.priority);
    if let Some(t) = token_state(b) {
        v["token"] = serde_json::json!(t);
    }
    if let (true, Some(source)) = (detail, &b.entra) {
        v["credential"] = credential_json(source);
    }
    if detail {
        v["kind"] = serde_json::json!(b.cfg.kind.as_str());
        v["weight"] = serde_json::json!(b.cfg.weight);
        v["last_status"] = serde_json::json!(b.state.last_status());
        v["served_total"] = serde_json::json!(b.state.served());
    }
    v["deployments"] = b
        .deployments
        .all()
        .iter()
        .map(|(name, st)| {
            let mut d = state_json(st, now);
            d["name"] = serde_json::json!(name);
            if detail {
                d["last_status"] = serde_json::json!(st.last_status());
                d["capacity"] = capacity_json(st, now);
            }
            d
        })
        .collect();
    v
}

/// The whole picture, as `/admin/state` serves it.
pub fn state(app: &App) -> serde_json::Value {
    let snap = app.snapshot.load();
    let now = app.clock.now_ms();
    let backends: Vec<_> = snap
        .backends
        .iter()
        .map(|b| backend_json(b, now, true))
        .collect();
    let routes: Vec<_> = snap
        .config
        .table
        .routes
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name,
                "models": r.patterns.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
                "fallback": r.fallback,
                "tiers": r.pool.tiers.iter().map(|t| serde_json::json!({
                    "priority": t.priority,
                    "backends": t.members.iter().map(|(id, w)| serde_json::json!({
                        "name": &*snap.backends[*id].cfg.name, "weight": w,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::json!({
        "config": {
            "version": snap.version,
            "loaded_at_ms": snap.loaded_at_ms,
            "loaded_at": httpdate::fmt_http_date(std::time::UNIX_EPOCH + std::time::Duration::from_millis(snap.loaded_at_ms)),
        },
        "now_ms": now,
        "draining": app.draining(),
        "state_store": app.store.status().json(true),
        "backends": backends,
        "routes": routes,
    })
}

async fn admin_state(State(app): State<Arc<App>>) -> Response {
    Json(state(&app)).into_response()
}

/// Requires `Authorization: Bearer <token>` when an admin token is configured. The token
/// is the one the listener started with (`[admin]` is read at start only), so a reload
/// cannot remove it from a listener that is running.
async fn require_token(
    State(token): State<Option<[u8; 32]>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(expected) = token {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes())
            .and_then(|v| (v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ")).then(|| &v[7..]))
            .unwrap_or_default();
        let ok: bool = sha(presented).ct_eq(&expected).into();
        if !ok {
            let mut r = (
                StatusCode::UNAUTHORIZED,
                "admin token required (Authorization: Bearer <token>)\n",
            )
                .into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    next.run(req).await
}

fn sha(b: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b).into()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.metrics.render(&app);
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

/// The dashboard: one static page, compiled into the binary, that polls `/admin/state`.
const DASHBOARD: &str = include_str!("dashboard.html");

async fn dashboard() -> Response {
    let mut resp = DASHBOARD.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'",
        ),
    );
    resp
}

pub fn router(app: Arc<App>) -> Router {
    let token = app
        .snapshot
        .load()
        .config
        .admin
        .token
        .as_ref()
        .map(|t| sha(t.expose().as_bytes()));
    // The page carries no data and so needs no token; the data endpoints do.
    let guarded = Router::new()
        .route("/admin/state", get(admin_state))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(token, require_token));
    Router::new()
        .route("/", get(dashboard))
        .merge(guarded)
        .with_state(app)
}

/// A running admin listener.
pub struct RunningAdmin {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl RunningAdmin {
    pub fn stop(self) {
        self.task.abort();
    }
}

/// Starts the admin listener, if enabled.
pub async fn start(app: Arc<App>) -> anyhow::Result<Option<RunningAdmin>> {
    let Some(listen) = app.snapshot.load().config.admin.listen else {
        return Ok(None);
    };
    let listener = TcpListener::bind(listen).await.map_err(|e| {
        anyhow::anyhow!(
            "admin.listen {listen}: {e} (set [admin] listen to a free port, or enabled = false)"
        )
    })?;
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() && app.snapshot.load().config.admin.token.is_none() {
        tracing::warn!(%addr, "the admin listener is reachable beyond this host and has no token: set [admin] token");
    }
    let service = router(app);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, service).await {
            tracing::error!(error = %e, "admin listener stopped");
        }
    });
    Ok(Some(RunningAdmin { addr, task }))
}
