//! The request path: authenticate, read the model, pick a backend, forward, and fail over
//! at once on 429 / 5xx / connect errors.
//!
//! The body is buffered once (bounded by `server.max_body_bytes`) so that every attempt
//! sends the same bytes; the response is streamed back unbuffered, so SSE reaches the
//! client chunk by chunk. Failover happens only before the first response byte is sent:
//! after that the response belongs to the client, and a backend that breaks mid-stream
//! ends the client's stream without a fabricated end marker.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use spillgate_core::config::{AllCoolingPolicy, BackendKind};
use spillgate_core::outcome::{cooldown_duration, retry_hint, CoolReason, Cooldown, Outcome};
use spillgate_core::request::{
    classify_path, inspect_body, set_model, upstream_target, ApiRoute, BodyError, BodyInfo,
    ClientShape, RequestParts,
};
use spillgate_core::routing::{BackendId, Pool};
use tower_http::timeout::TimeoutBody;

use crate::app::{App, BackendRt, Snapshot};
use crate::auth::{Client, CLIENT_CREDENTIAL_HEADERS};
use crate::errors::GatewayError;

pub const HEADER_BACKEND: &str = "x-spillgate-backend";
pub const HEADER_ATTEMPTS: &str = "x-spillgate-attempts";

/// Connection-scoped headers (RFC 9110 §7.6.1) that a proxy must not forward.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

fn is_hop_by_hop(name: &HeaderName, connection_tokens: &[String]) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n) || n == "upgrade" || connection_tokens.iter().any(|t| t == n)
}

/// Header names listed in `Connection:` are hop-by-hop too.
fn connection_tokens(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// The client's headers as they go upstream: without hop-by-hop headers, the client's
/// credentials, cookies, `Host` and framing headers (the client recomputes those).
fn forward_headers(client: &HeaderMap) -> HeaderMap {
    let tokens = connection_tokens(client);
    let mut out = HeaderMap::with_capacity(client.len());
    for (name, value) in client {
        let n = name.as_str();
        if is_hop_by_hop(name, &tokens)
            || CLIENT_CREDENTIAL_HEADERS.contains(&n)
            || matches!(n, "host" | "content-length" | "expect" | "cookie")
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// The backend's response headers as they go to the client.
fn response_headers(upstream: &HeaderMap) -> HeaderMap {
    let tokens = connection_tokens(upstream);
    let mut out = HeaderMap::with_capacity(upstream.len() + 2);
    for (name, value) in upstream {
        if !is_hop_by_hop(name, &tokens) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// What the request asks for, once its body is read.
struct Classified<'a> {
    shape: ClientShape,
    operation: &'a str,
    query: Option<&'a str>,
    model: String,
    body_info: Option<BodyInfo>,
}

fn missing_model(method: &Method, path: &str) -> GatewayError {
    if method == Method::GET || method == Method::DELETE || method == Method::HEAD {
        GatewayError::not_found(format!(
            "`{method} {path}` is not served by this gateway: it routes requests by model, and this request names none."
        ))
    } else {
        GatewayError::bad_request(
            "missing_model",
            "You must provide a model parameter: the gateway routes requests by the `model` field of the JSON body.",
        )
    }
}

pub async fn handle(State(app): State<Arc<App>>, req: Request) -> Response {
    let started = tokio::time::Instant::now();
    let snap = app.snapshot.load_full();
    let (parts, body) = req.into_parts();
    let path = parts.uri.path();
    let route = classify_path(parts.method.as_str(), path);

    // Authenticate before reading the body: an unauthenticated client costs no buffering.
    let client = match &route {
        ApiRoute::NotFound => {
            return GatewayError::not_found(format!("Unknown path `{path}`.")).into_response();
        }
        _ => match snap.client_keys.authenticate(&parts.headers) {
            Some(c) => c,
            None => return GatewayError::unauthorized().into_response(),
        },
    };
    let (shape, deployment, operation) = match route {
        ApiRoute::ListModels => return list_models(&snap),
        ApiRoute::Invalid(why) => {
            return GatewayError::bad_request("invalid_path", why).into_response()
        }
        ApiRoute::NotFound => return GatewayError::not_found("Unknown path.").into_response(),
        ApiRoute::Operation {
            shape,
            deployment,
            operation,
        } => (shape, deployment, operation),
    };

    let body = match read_body(&parts.headers, body, snap.config.server.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };

    let (model, body_info) = match deployment {
        Some(d) => (d.to_string(), None),
        None => match inspect_body(&body) {
            Ok(info) => match info.model.clone() {
                Some(m) => (m, Some(info)),
                None => return missing_model(&parts.method, path).into_response(),
            },
            Err(e @ BodyError::InvalidJson(_)) => {
                return GatewayError::bad_request("invalid_json", e.to_string()).into_response()
            }
            Err(e @ BodyError::ModelNotString) => {
                return GatewayError::bad_request("invalid_model", e.to_string()).into_response()
            }
        },
    };
    let req = Classified {
        shape,
        operation,
        query: parts.uri.query(),
        model,
        body_info,
    };

    let Some(pool) = snap.config.table.pool(&req.model) else {
        tracing::info!(model = %req.model, client = client.name(), status = 404, "no backend serves this model");
        return GatewayError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "The model `{}` is not served by this gateway. `GET /v1/models` lists the models it serves.",
                req.model
            ),
        )
        .into_response();
    };

    let fwd_headers = forward_headers(&parts.headers);
    let mut guard = DisconnectGuard {
        model: &req.model,
        started,
        answered: false,
    };
    let outcome = attempt_loop(&app, &snap, pool, &parts.method, fwd_headers, &req, body).await;
    guard.answered = true;
    finish(outcome, &req, &client, &snap, started, app.clock.now_ms())
}

/// Logs a request whose client went away before it was answered. hyper drops the handler
/// future when the client disconnects, which also drops (and so cancels) the upstream
/// request in flight; this guard's `Drop` is the only place that sees it happen.
struct DisconnectGuard<'a> {
    model: &'a str,
    started: tokio::time::Instant,
    answered: bool,
}

impl Drop for DisconnectGuard<'_> {
    fn drop(&mut self) {
        if !self.answered {
            tracing::info!(
                model = %self.model,
                waited_ms = self.started.elapsed().as_secs_f64() * 1000.0,
                "client went away before the response; upstream request cancelled"
            );
        }
    }
}

/// Reads the whole request body, refusing it with 413 before any upstream call when it is
/// larger than the limit.
async fn read_body(headers: &HeaderMap, body: Body, max: usize) -> Result<Bytes, GatewayError> {
    let too_large = || {
        GatewayError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("The request body is larger than this gateway's limit of {max} bytes (server.max_body_bytes)."),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    match Limited::new(body, max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(_) => Err(GatewayError::bad_request(
            "incomplete_body",
            "The request body could not be read completely.",
        )),
    }
}

fn list_models(snap: &Snapshot) -> Response {
    let data: Vec<_> = snap
        .config
        .table
        .model_names()
        .map(|m| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": "spillgate"}))
        .collect();
    let body = serde_json::json!({"object": "list", "data": data});
    let mut resp = Response::new(Body::from(body.to_string()));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// How the attempts for one request ended.
enum Ended {
    /// A backend's response, to stream to the client.
    Served {
        backend: BackendId,
        attempts: u32,
        response: http::Response<hyper::body::Incoming>,
    },
    /// Nothing usable: every candidate failed, was tried, or is cooling down.
    Exhausted {
        attempts: u32,
        failures: Vec<Outcome>,
    },
}

/// Tries backends in selection order until one answers with something other than 429,
/// 5xx or a connect error. Never sleeps while a candidate is ready; never tries a backend
/// twice for one request.
async fn attempt_loop(
    app: &App,
    snap: &Snapshot,
    pool: &Pool,
    method: &Method,
    headers: HeaderMap,
    req: &Classified<'_>,
    body: Bytes,
) -> Ended {
    let policy = snap.config.routing;
    let max_attempts = policy
        .max_attempts
        .unwrap_or_else(|| u32::try_from(pool.len()).unwrap_or(u32::MAX));
    let mut rng = fastrand::Rng::new();
    let mut tried: Vec<BackendId> = Vec::new();
    let mut failures: Vec<Outcome> = Vec::new();
    let mut waited = Duration::ZERO;
    let mut lazy_body_info: Option<BodyInfo> = None;

    loop {
        if tried.len() as u32 >= max_attempts {
            return Ended::Exhausted {
                attempts: tried.len() as u32,
                failures,
            };
        }
        let now = app.clock.now_ms();
        let untried = |id: BackendId| !tried.contains(&id);
        let pick = pool.select(
            |id| untried(id) && snap.backends[id].state.is_ready(now),
            &mut rng,
        );
        let (id, forced) = match pick {
            Some(id) => (id, false),
            None => {
                // Every untried candidate is cooling down (or none is left).
                let soonest = pool
                    .members()
                    .filter(|id| untried(*id))
                    .filter_map(|id| snap.backends[id].state.cooldown(now).map(|c| c.until_ms))
                    .min();
                match (policy.when_all_cooling, soonest) {
                    (_, None) | (AllCoolingPolicy::Reject, _) => {
                        return Ended::Exhausted {
                            attempts: tried.len() as u32,
                            failures,
                        }
                    }
                    (AllCoolingPolicy::Wait, Some(until)) => {
                        let wait = Duration::from_millis(until.saturating_sub(now));
                        if waited + wait > policy.max_wait {
                            return Ended::Exhausted {
                                attempts: tried.len() as u32,
                                failures,
                            };
                        }
                        tracing::debug!(model = %req.model, wait_ms = wait.as_millis() as u64, "all candidates cooling; waiting for the soonest");
                        tokio::time::sleep_until(app.clock.instant_at(until)).await;
                        waited += wait;
                        continue;
                    }
                    (AllCoolingPolicy::ForwardFirst, Some(_)) => match pool.first(untried) {
                        Some(id) => (id, true),
                        None => {
                            return Ended::Exhausted {
                                attempts: tried.len() as u32,
                                failures,
                            }
                        }
                    },
                }
            }
        };
        tried.push(id);
        let attempts = tried.len() as u32;
        let backend = &snap.backends[id];

        let upstream_req = match build_upstream_request(
            backend,
            method,
            &headers,
            req,
            &body,
            &mut lazy_body_info,
        ) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(backend = %backend.cfg.name, error = %e, "could not build the upstream request");
                failures.push(Outcome::ConnectError);
                continue;
            }
        };
        let result = app.client.send(upstream_req).await;
        let now = app.clock.now_ms();
        match result {
            Ok(resp) => {
                let status = resp.status().as_u16();
                backend.state.set_last_status(status);
                let outcome = Outcome::from_status(status);
                if let Some(reason) = CoolReason::from_outcome(outcome) {
                    let hint =
                        retry_hint(|n| resp.headers().get(n).and_then(|v| v.to_str().ok()), now);
                    cool(
                        backend,
                        reason,
                        hint,
                        now,
                        &snap.config.cooldown,
                        Some(status),
                    );
                    if !forced {
                        failures.push(outcome);
                        continue;
                    }
                }
                return Ended::Served {
                    backend: id,
                    attempts,
                    response: resp,
                };
            }
            Err(e) => {
                backend.state.set_last_status(0);
                tracing::warn!(backend = %backend.cfg.name, error = %e, "upstream attempt failed");
                cool(
                    backend,
                    CoolReason::ConnectError,
                    None,
                    now,
                    &snap.config.cooldown,
                    None,
                );
                failures.push(Outcome::ConnectError);
            }
        }
    }
}

fn cool(
    backend: &BackendRt,
    reason: CoolReason,
    hint: Option<Duration>,
    now: u64,
    policy: &spillgate_core::config::CooldownPolicy,
    status: Option<u16>,
) {
    let d = cooldown_duration(reason, hint, policy);
    let until_ms = now.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let extended = backend.state.cool(Cooldown { until_ms, reason });
    tracing::info!(
        backend = %backend.cfg.name,
        reason = reason.as_str(),
        status = status.unwrap_or(0),
        cooldown_ms = d.as_millis() as u64,
        from_header = hint.is_some(),
        extended,
        "backend cooling down"
    );
}

fn build_upstream_request(
    backend: &BackendRt,
    method: &Method,
    headers: &HeaderMap,
    req: &Classified<'_>,
    body: &Bytes,
    lazy_body_info: &mut Option<BodyInfo>,
) -> anyhow::Result<http::Request<Full<Bytes>>> {
    let deployment = backend
        .cfg
        .deployment_for(&req.model)
        .ok_or_else(|| anyhow::anyhow!("backend does not serve the model"))?;
    // Azure classic requests carry the model in the path; their body is only read when a
    // backend needs the model in the body (an OpenAI-kind backend).
    let info = match (&req.body_info, backend.cfg.kind, req.shape) {
        (Some(i), _, _) => Some(i),
        (None, BackendKind::Openai, _) => {
            if lazy_body_info.is_none() {
                *lazy_body_info = Some(inspect_body(body).unwrap_or(BodyInfo {
                    model: None,
                    model_span: None,
                    is_object: false,
                }));
            }
            lazy_body_info.as_ref()
        }
        (None, _, _) => None,
    };
    let target = upstream_target(
        &RequestParts {
            shape: req.shape,
            operation: req.operation,
            query: req.query,
            body_model: info.and_then(|i| i.model.as_deref()),
            body_is_object: info.is_some_and(|i| i.is_object),
        },
        backend.cfg.kind,
        &backend.base_path,
        deployment,
    );
    let body = match (&target.body_model, info) {
        (Some(name), Some(info)) => match set_model(body, info, name) {
            Some(b) => Bytes::from(b),
            None => body.clone(),
        },
        _ => body.clone(),
    };
    let uri = http::Uri::builder()
        .scheme(backend.scheme.clone())
        .authority(backend.authority.clone())
        .path_and_query(target.path_and_query)
        .build()?;
    let mut builder = http::Request::builder().method(method.clone()).uri(uri);
    if let Some(h) = builder.headers_mut() {
        h.clone_from(headers);
        if let Some((name, value)) = &backend.credential {
            h.insert(name.clone(), value.clone());
        }
    }
    Ok(builder.body(Full::new(body))?)
}

fn finish(
    ended: Ended,
    req: &Classified<'_>,
    client: &Client,
    snap: &Snapshot,
    started: tokio::time::Instant,
    now_ms: u64,
) -> Response {
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    match ended {
        Ended::Served {
            backend,
            attempts,
            response,
        } => {
            let b = &snap.backends[backend];
            let (parts, body) = response.into_parts();
            let mut headers = response_headers(&parts.headers);
            if let Ok(v) = HeaderValue::from_str(&b.cfg.name) {
                headers.insert(HEADER_BACKEND, v);
            }
            headers.insert(HEADER_ATTEMPTS, HeaderValue::from(attempts));
            tracing::info!(
                model = %req.model,
                client = client.name(),
                backend = %b.cfg.name,
                status = parts.status.as_u16(),
                attempts,
                ttfb_ms = elapsed_ms,
                "request"
            );
            let idle = snap.config.timeouts.idle;
            let mut resp = Response::new(Body::new(TimeoutBody::new(idle, body)));
            *resp.status_mut() = parts.status;
            *resp.headers_mut() = headers;
            resp
        }
        Ended::Exhausted { attempts, failures } => {
            let err = exhausted_error(snap, req, &failures, now_ms);
            tracing::info!(
                model = %req.model,
                client = client.name(),
                backend = "-",
                status = err.status.as_u16(),
                attempts,
                ttfb_ms = elapsed_ms,
                "request: no backend available"
            );
            let mut resp = err.into_response();
            resp.headers_mut()
                .insert(HEADER_ATTEMPTS, HeaderValue::from(attempts));
            resp
        }
    }
}

/// The answer when no backend could serve: 429 when throttling is all there is, 503 when
/// some backend failed; `Retry-After` is the soonest recovery in the pool (1 s when none
/// is cooling, e.g. when `routing.max_attempts` stopped the attempts).
fn exhausted_error(
    snap: &Snapshot,
    req: &Classified<'_>,
    failures: &[Outcome],
    now_ms: u64,
) -> GatewayError {
    let pool: Vec<BackendId> = snap
        .config
        .table
        .pool(&req.model)
        .map(|p| p.members().collect())
        .unwrap_or_default();
    let cooldowns: Vec<Cooldown> = pool
        .iter()
        .filter_map(|id| snap.backends[*id].state.cooldown(now_ms))
        .collect();
    let retry_after = cooldowns
        .iter()
        .map(|c| c.until_ms - now_ms)
        .min()
        .map_or(Duration::from_secs(1), Duration::from_millis);
    let throttled_only = failures.iter().all(|o| *o == Outcome::Throttled)
        && cooldowns.iter().all(|c| c.reason == CoolReason::Throttled);
    let n = pool.len();
    let err = if throttled_only {
        GatewayError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "all_backends_throttled",
            format!(
                "All {n} backend(s) serving model `{}` are over their rate limits. Retry after the time in the Retry-After header.",
                req.model
            ),
        )
    } else {
        GatewayError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable_error",
            "no_backend_available",
            format!(
                "No backend serving model `{}` could take the request ({n} configured; failing or cooling down). Retry after the time in the Retry-After header.",
                req.model
            ),
        )
    };
    err.with_retry_after(retry_after)
}
