//! Turns one HTTP request into the mock's answer: records it, checks the API
//! key, takes the next scripted reply or applies the limiter, and builds the
//! response. Requests under `/_mock/` go to the control API instead.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::body::{MockBody, SseBody, SsePlan};
use crate::limiter::Decision;
use crate::openai::{self, ChunkFrames, Ctx, Probe, Route};
use crate::reply::{self, Reply, ReplyBody};
use crate::state::{bump, RecordedRequest, Shared};

const CONTROL_PREFIX: &str = "/_mock/";
const X_MOCK_BACKEND: &str = "x-mock-backend";
const JSON: &str = "application/json";
const EVENT_STREAM: &str = "text/event-stream";
const TEXT: &str = "text/plain; charset=utf-8";

pub(crate) async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<MockBody> {
    if req.uri().path().starts_with(CONTROL_PREFIX) {
        control(&shared, req).await
    } else if shared.identity.is_some()
        && crate::identity::is_token_path(req.method(), req.uri().path())
    {
        token(&shared, req).await
    } else {
        api(shared, req).await
    }
}

/// A request to the token service (see `identity.rs`).
async fn token(shared: &Shared, req: Request<Incoming>) -> Response<MockBody> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => return control_error(StatusCode::BAD_REQUEST, &err.to_string()),
    };
    let Some(identity) = &shared.identity else {
        return control_error(StatusCode::NOT_FOUND, "no token service");
    };
    let recorded = RecordedRequest {
        body: String::from_utf8_lossy(&body).into_owned(),
        ..record(shared, &parts, &body, None)
    };
    let (status, value) = identity.respond(&shared.cfg.name, &parts, &body, recorded, unix_now());
    sleep(shared.cfg.latency).await;
    json_response(status, &value)
}

/// What the response builders need to know about the request.
struct ApiRequest<'a> {
    parts: &'a Parts,
    route: Route,
    probe: Probe,
    model: String,
    body_len: usize,
}

/// Counts requests whose client went away before the response head was sent: the
/// server drops this future when the connection closes, and the guard's `Drop` sees it.
async fn api(shared: Arc<Shared>, req: Request<Incoming>) -> Response<MockBody> {
    struct Abandoned {
        shared: Arc<Shared>,
        answered: bool,
    }
    impl Drop for Abandoned {
        fn drop(&mut self) {
            if !self.answered {
                bump(&self.shared.counters.requests_abandoned);
            }
        }
    }
    let mut guard = Abandoned {
        shared: Arc::clone(&shared),
        answered: false,
    };
    let resp = api_inner(shared, req).await;
    guard.answered = true;
    resp
}

async fn api_inner(shared: Arc<Shared>, req: Request<Incoming>) -> Response<MockBody> {
    bump(&shared.counters.hits);
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => {
            tracing::debug!(%err, "reading request body failed");
            let resp = json_response(
                StatusCode::BAD_REQUEST,
                &openai::error_body(400, "could not read the request body"),
            );
            return finish(&shared, resp, None, &[]);
        }
    };
    let route = openai::route(parts.uri.path());
    let probe = Probe::parse(&body);
    let deployment = route.deployment.clone().or_else(|| probe.model.clone());
    if shared.recording() {
        shared.record(record(&shared, &parts, &body, deployment.clone()));
    }

    let api_req = ApiRequest {
        parts: &parts,
        route,
        probe,
        model: deployment.unwrap_or_else(|| "mock-model".to_owned()),
        body_len: body.len(),
    };
    respond(&shared, &api_req).await
}

fn record(
    shared: &Shared,
    parts: &Parts,
    body: &Bytes,
    deployment: Option<String>,
) -> RecordedRequest {
    RecordedRequest {
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        query: parts.uri.query().map(str::to_owned),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: if shared.cfg.record_bodies {
            String::from_utf8_lossy(body).into_owned()
        } else {
            String::new()
        },
        body_sha256: hex(&Sha256::digest(body)),
        deployment,
    }
}

async fn respond(shared: &Arc<Shared>, req: &ApiRequest<'_>) -> Response<MockBody> {
    let allowed = match &shared.identity {
        // Playing a token service: its own tokens are accepted, and the API key if
        // one is expected; nothing else.
        Some(identity) => {
            bearer(&req.parts.headers).is_some_and(|t| identity.accepts(t))
                || shared
                    .cfg
                    .expect_api_key
                    .as_deref()
                    .is_some_and(|k| authorized(Some(k), &req.parts.headers))
        }
        None => authorized(shared.cfg.expect_api_key.as_deref(), &req.parts.headers),
    };
    if !allowed {
        sleep(shared.cfg.latency).await;
        let body = openai::error_body(401, openai::UNAUTHORIZED_MESSAGE);
        return finish(
            shared,
            json_response(StatusCode::UNAUTHORIZED, &body),
            None,
            &[],
        );
    }

    if let Some(reply) = shared.next_override() {
        // Scripted and default replies bypass the limiter: a test that
        // scripts an answer wants exactly that answer.
        sleep(shared.cfg.latency + Duration::from_millis(reply.delay_ms)).await;
        let resp = scripted(shared, req, &reply);
        return finish(shared, resp, None, &reply.headers);
    }

    let mut decision = None;
    if let Some(limiter) = &shared.limiter {
        if req.parts.method == Method::POST {
            let tokens = openai::estimated_tokens(req.body_len, &req.probe);
            decision = Some(limiter.check(&req.model, tokens));
        }
    }
    sleep(shared.cfg.latency).await;
    let resp = match decision {
        Some(d) if !d.admitted => throttled(&d),
        _ => auto(shared, req, StatusCode::OK),
    };
    finish(shared, resp, decision.as_ref(), &[])
}

async fn sleep(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// The token of an `Authorization: Bearer` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
}

/// Whether the request carries the expected key in `api-key` or as a bearer token.
fn authorized(expected: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(expected) = expected else {
        return true;
    };
    let api_key = headers.get("api-key").map(HeaderValue::as_bytes);
    api_key == Some(expected.as_bytes())
        || bearer(headers).map(str::as_bytes) == Some(expected.as_bytes())
}

/// The limiter's 429, shaped like Azure's.
fn throttled(d: &Decision) -> Response<MockBody> {
    let secs = d.reset_secs();
    let mut resp = json_response(StatusCode::TOO_MANY_REQUESTS, &reply::throttled_body(secs));
    let headers = resp.headers_mut();
    headers.insert("retry-after", HeaderValue::from(secs));
    headers.insert("retry-after-ms", HeaderValue::from(d.reset_ms()));
    resp
}

/// Add the headers every API response carries, then the scripted ones, and
/// count throttled answers.
fn finish(
    shared: &Shared,
    mut resp: Response<MockBody>,
    decision: Option<&Decision>,
    scripted_headers: &[(String, String)],
) -> Response<MockBody> {
    let headers = resp.headers_mut();
    headers.insert(X_MOCK_BACKEND, shared.backend_header.clone());
    if let Some(d) = decision {
        let reset = HeaderValue::from(d.reset_secs());
        for (name, value) in [
            (
                "x-ratelimit-limit-requests",
                HeaderValue::from(d.limit_requests),
            ),
            (
                "x-ratelimit-limit-tokens",
                HeaderValue::from(d.limit_tokens),
            ),
            (
                "x-ratelimit-remaining-requests",
                HeaderValue::from(d.remaining_requests),
            ),
            (
                "x-ratelimit-remaining-tokens",
                HeaderValue::from(d.remaining_tokens),
            ),
            ("x-ratelimit-reset-requests", reset.clone()),
            ("x-ratelimit-reset-tokens", reset),
        ] {
            headers.insert(name, value);
        }
    }
    apply_headers(headers, scripted_headers);
    if resp.status() == StatusCode::TOO_MANY_REQUESTS {
        bump(&shared.counters.hits_429);
    }
    resp
}

/// Scripted headers replace built-in headers of the same name; repeated
/// names in the script are all kept.
fn apply_headers(headers: &mut HeaderMap, scripted: &[(String, String)]) {
    let parsed: Vec<(HeaderName, HeaderValue)> = scripted
        .iter()
        .filter_map(|(k, v)| {
            match (
                HeaderName::from_bytes(k.as_bytes()),
                HeaderValue::from_str(v),
            ) {
                (Ok(k), Ok(v)) => Some((k, v)),
                _ => {
                    tracing::warn!(name = %k, "ignoring invalid scripted header");
                    None
                }
            }
        })
        .collect();
    for (name, _) in &parsed {
        headers.remove(name);
    }
    for (name, value) in parsed {
        headers.append(name, value);
    }
}

fn scripted(shared: &Arc<Shared>, req: &ApiRequest<'_>, reply: &Reply) -> Response<MockBody> {
    let status = if reply.status == 0 {
        StatusCode::OK
    } else {
        match StatusCode::from_u16(reply.status) {
            Ok(status) => status,
            Err(_) => {
                let msg = format!(
                    "scripted status {} is not a valid HTTP status",
                    reply.status
                );
                return json_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &openai::error_body(500, &msg),
                );
            }
        }
    };
    match &reply.body {
        ReplyBody::Auto => auto(shared, req, status),
        ReplyBody::Json { value } => json_response(status, value),
        ReplyBody::Raw { text, content_type } => bytes_response(
            status,
            content_type
                .as_deref()
                .map_or_else(|| HeaderValue::from_static(TEXT), content_type_value),
            Bytes::from(text.clone()),
        ),
        ReplyBody::Stream {
            chunks,
            interval_ms,
            break_after,
            content_type,
            done,
        } => {
            let plan = SsePlan {
                frames: chunk_frames(shared, req),
                chunks: *chunks,
                interval: Duration::from_millis(*interval_ms),
                break_after: *break_after,
                include_usage: req.probe.include_usage(),
                done: *done,
            };
            sse_response(shared, status, content_type.as_deref(), plan)
        }
    }
}

/// The built-in behaviour for the request's path.
fn auto(shared: &Arc<Shared>, req: &ApiRequest<'_>, status: StatusCode) -> Response<MockBody> {
    if status == StatusCode::TOO_MANY_REQUESTS {
        return json_response(status, &reply::throttled_body(1));
    }
    if status.as_u16() >= 400 {
        let msg = format!("mock error {}", status.as_u16());
        return json_response(status, &openai::error_body(status.as_u16(), &msg));
    }
    let operation = req.route.operation.as_str();
    if operation == "chat/completions" && req.probe.streaming() {
        let plan = SsePlan {
            frames: chunk_frames(shared, req),
            chunks: shared.cfg.stream_chunks,
            interval: shared.cfg.chunk_interval,
            break_after: None,
            include_usage: req.probe.include_usage(),
            done: true,
        };
        return sse_response(shared, status, None, plan);
    }
    let created = unix_now();
    let ctx = Ctx {
        greeting: &shared.greeting,
        model: &req.model,
        id: shared.id(),
        created,
        body_len: req.body_len,
    };
    let value = match operation {
        "models" if req.parts.method == Method::GET => {
            openai::model_list(created, &shared.cfg.name)
        }
        "chat/completions" => openai::chat_completion(&ctx),
        "completions" => openai::completion(&ctx),
        "embeddings" => openai::embeddings(&ctx, &req.probe),
        "responses" => openai::response(&ctx),
        _ => serde_json::json!({"ok": true}),
    };
    json_response(status, &value)
}

/// The per-stream parts of an SSE response's frames.
fn chunk_frames(shared: &Shared, req: &ApiRequest<'_>) -> ChunkFrames {
    ChunkFrames::new(&req.model, shared.id(), unix_now(), req.body_len)
}

fn sse_response(
    shared: &Arc<Shared>,
    status: StatusCode,
    content_type: Option<&str>,
    plan: SsePlan,
) -> Response<MockBody> {
    let body = MockBody::Sse(Box::new(SseBody::new(plan, Arc::clone(shared))));
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        content_type.map_or_else(
            || HeaderValue::from_static(EVENT_STREAM),
            content_type_value,
        ),
    );
    resp.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    resp
}

/// A scripted content type; the built-in ones are `HeaderValue::from_static`.
fn content_type_value(ct: &str) -> HeaderValue {
    HeaderValue::from_str(ct).unwrap_or_else(|_| HeaderValue::from_static(TEXT))
}

fn bytes_response(
    status: StatusCode,
    content_type: HeaderValue,
    body: Bytes,
) -> Response<MockBody> {
    let mut resp = Response::new(MockBody::full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, content_type);
    resp
}

fn json_bytes_response(status: StatusCode, body: Vec<u8>) -> Response<MockBody> {
    bytes_response(status, HeaderValue::from_static(JSON), Bytes::from(body))
}

fn json_response(status: StatusCode, value: &Value) -> Response<MockBody> {
    match serde_json::to_vec(value) {
        Ok(bytes) => json_bytes_response(status, bytes),
        Err(err) => bytes_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            HeaderValue::from_static(TEXT),
            Bytes::from(err.to_string()),
        ),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}

/// `POST /_mock/script` accepts an array of replies or a single reply.
#[derive(Deserialize)]
#[serde(untagged)]
enum ScriptBody {
    Many(Vec<Reply>),
    One(Reply),
}

async fn control(shared: &Shared, req: Request<Incoming>) -> Response<MockBody> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => return control_error(StatusCode::BAD_REQUEST, &err.to_string()),
    };
    let ok = || json_response(StatusCode::OK, &serde_json::json!({"ok": true}));
    let mut resp = match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/_mock/state") => match serde_json::to_vec(&shared.state()) {
            Ok(bytes) => json_bytes_response(StatusCode::OK, bytes),
            Err(err) => control_error(StatusCode::INTERNAL_SERVER_ERROR, &err.to_string()),
        },
        (&Method::POST, "/_mock/script") => match serde_json::from_slice::<ScriptBody>(&body) {
            Ok(ScriptBody::Many(replies)) => {
                shared.push_script(replies);
                ok()
            }
            Ok(ScriptBody::One(reply)) => {
                shared.push_script(vec![reply]);
                ok()
            }
            Err(err) => control_error(StatusCode::BAD_REQUEST, &err.to_string()),
        },
        (&Method::POST, "/_mock/default") => match parse_default(&body) {
            Ok(reply) => {
                shared.set_default(reply);
                ok()
            }
            Err(err) => control_error(StatusCode::BAD_REQUEST, &err.to_string()),
        },
        (&Method::POST, "/_mock/reset") => {
            shared.reset();
            ok()
        }
        (&Method::POST, "/_mock/identity") => match (
            &shared.identity,
            serde_json::from_slice::<crate::IdentityControl>(&body),
        ) {
            (None, _) => control_error(StatusCode::NOT_FOUND, "this mock plays no token service"),
            (Some(identity), Ok(c)) => {
                identity.control(&c);
                ok()
            }
            (Some(_), Err(err)) => control_error(StatusCode::BAD_REQUEST, &err.to_string()),
        },
        _ => control_error(StatusCode::NOT_FOUND, "unknown control endpoint"),
    };
    resp.headers_mut()
        .insert(X_MOCK_BACKEND, shared.backend_header.clone());
    resp
}

/// An empty body means "back to the built-in behaviour", like `null`.
fn parse_default(body: &[u8]) -> serde_json::Result<Option<Reply>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    serde_json::from_slice(body)
}

fn control_error(status: StatusCode, message: &str) -> Response<MockBody> {
    json_response(status, &serde_json::json!({"error": message}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_or_bearer_authorizes() {
        let mut h = HeaderMap::new();
        assert!(authorized(None, &h));
        assert!(!authorized(Some("k"), &h));
        h.insert("api-key", HeaderValue::from_static("wrong"));
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        assert!(authorized(Some("k"), &h));
        h.insert("api-key", HeaderValue::from_static("k"));
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer wrong"));
        assert!(authorized(Some("k"), &h));
        h.insert("api-key", HeaderValue::from_static("kk"));
        assert!(!authorized(Some("k"), &h));
    }

    #[test]
    fn scripted_headers_replace_and_repeat() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static(JSON));
        apply_headers(
            &mut h,
            &[
                ("Content-Type".into(), "text/html".into()),
                ("x-a".into(), "1".into()),
                ("x-a".into(), "2".into()),
                ("bad header".into(), "x".into()),
            ],
        );
        assert_eq!(h.get(CONTENT_TYPE).unwrap(), "text/html");
        assert_eq!(h.get_all("x-a").iter().count(), 2);
        assert_eq!(h.len(), 3);
    }

    #[test]
    fn hex_encodes() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    }
}
