//! Backends with Microsoft Entra ID credentials, end to end: the real `azure_identity`
//! flows against a mock token service on loopback (the mock backend plays it), the token
//! sent as `Authorization: Bearer` to the right backends only, backends cooled with
//! reason "auth" while the token service is down, a 401 answered by one renewal and one
//! retry, and no secret or token in logs or answers. Timing (renewal ahead of expiry,
//! many requests at expiry) runs on paused time over scripted in-memory endpoints.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed setup step should abort the test loudly"
)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[path = "../src/test_logs.rs"]
mod test_logs;
use test_logs::Logs;

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use spillgate::app::App;
use spillgate::server::{start, Running};
use spillgate::upstream::{AttemptError, Upstream, UpstreamRequest};
use spillgate_mock::{IdentityControl, MockBackend, MockConfig, MockIdentity};
use tower::ServiceExt;

const CLIENT_KEY: &str = "client-key-for-entra-tests-0001";
const SP_SECRET: &str = "sp-client-secret-value-9f3c2a71";
const BACKEND_KEY: &str = "backend-api-key-77aa1c";

fn chat(model: &str) -> String {
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#)
}

fn env(var: &str) -> Option<String> {
    match var {
        "CLIENT" => Some(CLIENT_KEY.into()),
        "SP_SECRET" => Some(SP_SECRET.into()),
        "KEY" => Some(BACKEND_KEY.into()),
        _ => None,
    }
}

fn load(text: &str) -> spillgate_core::config::Config {
    spillgate_core::config::load(text, &env, &|_| Err("no files".into()))
        .unwrap_or_else(|e| panic!("config: {e}\n{text}"))
}

/// A service principal with a client secret, its authority host the mock at `idp`.
fn sp_auth(idp: &MockBackend) -> String {
    format!(
        "auth = {{ entra = \"client-secret\", tenant_id = \"tenant-1\", client_id = \"app-1\", client_secret = \"env:SP_SECRET\", authority_host = \"{}\" }}",
        idp.url()
    )
}

/// A mock that plays the token service (requiring `SP_SECRET`) and a backend that
/// accepts only the tokens it issued.
async fn token_service(name: &str) -> MockBackend {
    MockBackend::start(MockConfig {
        identity: Some(MockIdentity {
            client_secret: Some(SP_SECRET.into()),
            ..MockIdentity::default()
        }),
        ..MockConfig::named(name)
    })
    .await
    .unwrap()
}

async fn keyed_backend(name: &str) -> MockBackend {
    MockBackend::start(MockConfig {
        expect_api_key: Some(BACKEND_KEY.into()),
        ..MockConfig::named(name)
    })
    .await
    .unwrap()
}

fn gateway_toml(backends: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[auth]\nclient_keys = [\"env:CLIENT\"]\n[admin]\nenabled = false\n{backends}"
    )
}

struct Gw {
    running: Running,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Gw {
    async fn start(toml: &str) -> Gw {
        let app = App::new(load(toml)).unwrap();
        Gw {
            running: start(app).await.unwrap(),
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    fn app(&self) -> &Arc<App> {
        &self.running.app
    }

    async fn send(&self, method: &str, path: &str, body: &str) -> (StatusCode, HeaderMap, String) {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.running.addr))
            .header("content-type", "application/json")
            .header("api-key", CLIENT_KEY)
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }

    async fn chat(&self, model: &str) -> (StatusCode, HeaderMap, String) {
        self.send("POST", "/v1/chat/completions", &chat(model))
            .await
    }

    /// `/admin/state`'s entry for backend `name`.
    fn backend_state(&self, name: &str) -> Value {
        let state = spillgate::admin::state(self.app());
        state["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["name"] == name)
            .cloned()
            .unwrap()
    }

    fn metrics(&self) -> String {
        self.app().metrics.render(self.app())
    }
}

fn h<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn header_of<'a>(r: &'a spillgate_mock::RecordedRequest, name: &str) -> Option<&'a str> {
    r.header(name)
}

/// Polls `f` every 20 ms for up to `secs` seconds.
async fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The bearer tokens the backends received.
fn tokens_seen(mocks: &[&MockBackend]) -> Vec<String> {
    let mut v: Vec<String> = mocks
        .iter()
        .flat_map(|m| m.requests())
        .filter_map(|r| {
            r.header("authorization")
                .and_then(|a| a.strip_prefix("Bearer "))
                .map(str::to_string)
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

fn assert_no_secrets(what: &str, text: &str, secrets: &[String]) {
    for s in secrets {
        assert!(
            !text.contains(s.as_str()),
            "{what} contains a secret or token ({s})"
        );
    }
}

#[tokio::test]
async fn bearer_tokens_go_to_entra_backends_only_and_one_token_serves_a_shared_credential() {
    let (logs, _guard) = Logs::capture();
    let idp = token_service("sp-a").await;
    let keyed = keyed_backend("keyed").await;
    let other = MockBackend::start(MockConfig::named("sp-b")).await.unwrap();
    let gw = Gw::start(&gateway_toml(&format!(
        "[[backends]]\nname = \"keyed\"\nkind = \"azure\"\nurl = \"{}\"\napi_key = \"env:KEY\"\ndeployments = {{ \"m-key\" = \"m-key\" }}\n\
         [[backends]]\nname = \"sp-a\"\nkind = \"azure\"\nurl = \"{}\"\n{}\ndeployments = {{ \"m-a\" = \"dep-a\" }}\n\
         [[backends]]\nname = \"sp-b\"\nkind = \"openai\"\nurl = \"{}/v1\"\n{}\ndeployments = {{ \"m-b\" = \"m-b\" }}\n",
        keyed.url(),
        idp.url(),
        sp_auth(&idp),
        other.url(),
        sp_auth(&idp),
    )))
    .await;
    let mut answers = String::new();
    for model in ["m-key", "m-a", "m-b", "m-key", "m-a", "m-b"] {
        let (status, headers, body) = gw.chat(model).await;
        assert_eq!(status, StatusCode::OK, "{model}: {body}");
        answers.push_str(&format!("{headers:?}{body}"));
    }
    assert_eq!((keyed.hits(), idp.hits(), other.hits()), (2, 2, 2));

    // The keyed backend: its key, no bearer token.
    for r in keyed.requests() {
        assert_eq!(header_of(&r, "api-key"), Some(BACKEND_KEY));
        assert_eq!(header_of(&r, "authorization"), None);
    }
    // The Entra backends: a bearer token from the token service, no api-key header; one
    // token for both, since they share the credential.
    let tokens = tokens_seen(&[&idp, &other]);
    assert_eq!(tokens.len(), 1, "{tokens:?}");
    assert!(tokens[0].starts_with("mock-entra-token-sp-a-"));
    for r in idp.requests().iter().chain(other.requests().iter()) {
        assert_eq!(header_of(r, "api-key"), None, "{r:?}");
        assert_eq!(
            header_of(r, "authorization"),
            Some(format!("Bearer {}", tokens[0]).as_str())
        );
    }
    assert_eq!(
        idp.requests()[0].path,
        "/openai/deployments/dep-a/chat/completions"
    );

    // One token request, the client-credentials grant with the secret, to the tenant's
    // token endpoint; the secret went there and nowhere else.
    let id = idp.identity_requests();
    assert_eq!(id.len(), 1, "{id:#?}");
    assert_eq!(id[0].method, "POST");
    assert_eq!(id[0].path, "/tenant-1/oauth2/v2.0/token");
    for part in [
        "grant_type=client_credentials",
        "client_id=app-1",
        &format!("client_secret={SP_SECRET}"),
        "scope=https%3A%2F%2Fcognitiveservices.azure.com%2F.default",
    ] {
        assert!(id[0].body.contains(part), "{part} in {}", id[0].body);
    }
    assert!(!format!("{:?}", id[0]).contains(CLIENT_KEY));
    for r in keyed
        .requests()
        .iter()
        .chain(idp.requests().iter())
        .chain(other.requests().iter())
    {
        let text = format!("{r:?}");
        assert!(
            !text.contains(SP_SECRET) && !text.contains(CLIENT_KEY),
            "{text}"
        );
    }

    // /admin/state shows the credential and its token's state, never the token.
    let st = gw.backend_state("sp-a");
    assert_eq!(st["token"], "ready");
    assert_eq!(st["credential"]["entra"], "client-secret");
    assert!(st["credential"]["endpoint"]
        .as_str()
        .unwrap()
        .ends_with("/tenant-1/oauth2/v2.0/token"));
    assert!(gw.backend_state("keyed").get("credential").is_none());

    let mut secrets = tokens.clone();
    secrets.extend([SP_SECRET.to_string(), BACKEND_KEY.to_string()]);
    let state = spillgate::admin::state(gw.app()).to_string();
    let (_, _, readyz) = gw.send("GET", "/readyz", "").await;
    assert_no_secrets("a response", &answers, &secrets);
    assert_no_secrets("/admin/state", &state, &secrets);
    assert_no_secrets("/readyz", &readyz, &secrets);
    assert_no_secrets("/metrics", &gw.metrics(), &secrets);
    assert_no_secrets("the log", &logs.text(), &secrets);
    assert!(!logs.text().contains(CLIENT_KEY));
}

#[tokio::test]
async fn token_service_down_cools_the_backend_for_auth_while_others_serve() {
    let (logs, _guard) = Logs::capture();
    let idp = token_service("sp").await;
    idp.identity_control(IdentityControl {
        failing: Some(true),
        revoke: false,
    });
    let keyed = keyed_backend("keyed").await;
    let gw = Gw::start(&gateway_toml(&format!(
        "[[backends]]\nname = \"sp\"\nkind = \"azure\"\nurl = \"{}\"\npriority = 1\n{}\n\
         [[backends]]\nname = \"keyed\"\nkind = \"azure\"\nurl = \"{}\"\napi_key = \"env:KEY\"\npriority = 2\n",
        idp.url(),
        sp_auth(&idp),
        keyed.url(),
    )))
    .await;
    eventually(5, "the first token request", || {
        !idp.identity_requests().is_empty()
    })
    .await;
    eventually(5, "the auth cooldown", || {
        gw.backend_state("sp")["reason"] == "auth"
    })
    .await;

    // Priority 1 has no token: priority 2 serves, and the client sees nothing of it.
    for _ in 0..3 {
        let (status, headers, body) = gw.chat("gpt-4o").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(h(&headers, "x-spillgate-backend"), "keyed");
        assert_eq!(h(&headers, "x-spillgate-attempts"), "1");
    }
    assert_eq!(idp.hits(), 0);

    let st = gw.backend_state("sp");
    assert_eq!(st["state"], "cooling");
    assert_eq!(st["reason"], "auth");
    assert_eq!(st["token"], "missing");
    let error = st["credential"]["error"].as_str().unwrap();
    assert!(error.contains("AADSTS90033"), "{error}");
    let (status, _, readyz) = gw.send("GET", "/readyz", "").await;
    assert_eq!(status, StatusCode::OK);
    let readyz: Value = serde_json::from_str(&readyz).unwrap();
    assert_eq!(readyz["backends_without_token"], serde_json::json!(["sp"]));
    assert!(
        !readyz.to_string().contains("AADSTS"),
        "/readyz names backends, not identity errors"
    );
    assert!(
        gw.metrics()
            .contains(r#"spillgate_cooldowns_total{backend="sp",reason="auth"} 1"#),
        "{}",
        gw.metrics()
    );

    // Retried in the background (after 1 s), logged once for the whole run of failures,
    // with the credential, the endpoint and the service's message.
    eventually(5, "a retry", || idp.identity_requests().len() >= 2).await;
    let text = logs.text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("could not obtain an Entra ID token"))
        .collect();
    assert_eq!(lines.len(), 1, "{text}");
    let line = lines[0];
    assert!(line.contains("ERROR"), "{line}");
    assert!(
        line.contains("client secret (tenant tenant-1, client app-1, secret from env:SP_SECRET)"),
        "{line}"
    );
    assert!(
        line.contains(&format!("{}/tenant-1/oauth2/v2.0/token", idp.url())),
        "{line}"
    );
    assert!(line.contains("AADSTS90033"), "{line}");
    assert!(line.contains("backends=sp"), "{line}");

    // The service is back: the next retry brings a token, the cooldown ends, and
    // priority 1 serves again with it.
    idp.identity_control(IdentityControl {
        failing: Some(false),
        revoke: false,
    });
    eventually(10, "a token", || gw.backend_state("sp")["token"] == "ready").await;
    let (status, headers, _) = gw.chat("gpt-4o").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h(&headers, "x-spillgate-backend"), "sp");
    assert!(logs.text().contains("Entra ID token obtained again"));
    let mut secrets = tokens_seen(&[&idp]);
    assert_eq!(secrets.len(), 1);
    secrets.push(SP_SECRET.to_string());
    assert_no_secrets("the log", &logs.text(), &secrets);
}

#[tokio::test]
async fn a_401_to_a_recent_token_cools_the_backend_without_a_renewal() {
    let (logs, _guard) = Logs::capture();
    let idp = token_service("sp").await;
    let keyed = keyed_backend("keyed").await;
    let gw = Gw::start(&gateway_toml(&format!(
        "[[backends]]\nname = \"sp\"\nkind = \"azure\"\nurl = \"{}\"\npriority = 1\n{}\n\
         [[backends]]\nname = \"keyed\"\nkind = \"azure\"\nurl = \"{}\"\napi_key = \"env:KEY\"\npriority = 2\n",
        idp.url(),
        sp_auth(&idp),
        keyed.url(),
    )))
    .await;
    let (status, headers, _) = gw.chat("gpt-4o").await;
    assert_eq!(
        (status, h(&headers, "x-spillgate-backend")),
        (StatusCode::OK, "sp")
    );
    assert_eq!(idp.identity_requests().len(), 1);

    // The backend refuses the token, seconds after it was issued: a new token would be
    // no different (the identity lacks the role), so none is fetched. The backend is
    // cooled for "auth" and the request moves on; the client sees a plain 200.
    idp.identity_control(IdentityControl {
        failing: None,
        revoke: true,
    });
    let (status, headers, body) = gw.chat("gpt-4o").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(h(&headers, "x-spillgate-backend"), "keyed");
    assert_eq!(h(&headers, "x-spillgate-attempts"), "2");
    assert_eq!(idp.identity_requests().len(), 1, "no renewal");
    assert_eq!(idp.hits(), 2);
    let st = gw.backend_state("sp");
    assert_eq!(
        (st["state"].as_str(), st["reason"].as_str()),
        (Some("cooling"), Some("auth"))
    );
    assert_eq!(st["token"], "ready", "the token stays in use");
    let (_, headers, _) = gw.chat("gpt-4o").await;
    assert_eq!(h(&headers, "x-spillgate-backend"), "keyed", "sp is cooling");
    assert_eq!(idp.hits(), 2);
    assert!(
        logs.text().contains("Cognitive Services OpenAI User"),
        "{}",
        logs.text()
    );
    assert!(gw
        .metrics()
        .contains(r#"spillgate_cooldowns_total{backend="sp",reason="auth"} 1"#));
    let mut secrets = tokens_seen(&[&idp]);
    assert_eq!(secrets.len(), 1, "{secrets:?}");
    secrets.push(SP_SECRET.to_string());
    assert_no_secrets("the log", &logs.text(), &secrets);
    assert_no_secrets(
        "/admin/state",
        &spillgate::admin::state(gw.app()).to_string(),
        &secrets,
    );
}

#[tokio::test]
async fn check_probe_reports_each_credential() {
    // Every test captures: see `Logs`.
    let (_logs, _guard) = Logs::capture();
    let idp = token_service("sp").await;
    let toml = gateway_toml(&format!(
        "[[backends]]\nname = \"sp\"\nkind = \"azure\"\nurl = \"{}\"\n{}\n[[backends]]\nname = \"sp-2\"\nkind = \"azure\"\nurl = \"{}\"\n{}\n[[backends]]\nname = \"keyed\"\nkind = \"azure\"\nurl = \"{}\"\napi_key = \"env:KEY\"\n",
        idp.url(),
        sp_auth(&idp),
        idp.url(),
        sp_auth(&idp),
        idp.url(),
    ));
    let config = load(&toml);
    let shown = spillgate::check::render(&config);
    assert!(shown.contains("backend credentials:"), "{shown}");
    assert!(shown.contains("keyed  API key (api-key header)"), "{shown}");
    assert!(
        shown.contains("Entra ID token (Authorization: Bearer): service principal with client secret (tenant tenant-1, client app-1, secret from env:SP_SECRET), scope https://cognitiveservices.azure.com/.default; one token shared with sp-2"),
        "{shown}"
    );
    assert!(!shown.contains(SP_SECRET));

    let (report, ok) = spillgate::check::probe(&config).await;
    assert!(ok, "{report}");
    assert!(report.contains("(backends sp, sp-2)"), "{report}");
    assert!(
        report.contains("OK: token obtained, valid for 1h 00m")
            || report.contains("OK: token obtained, valid for 0h 59m"),
        "{report}"
    );
    assert_eq!(
        idp.identity_requests().len(),
        1,
        "one credential, one probe"
    );

    idp.identity_control(IdentityControl {
        failing: Some(true),
        revoke: false,
    });
    let (report, ok) = spillgate::check::probe(&config).await;
    assert!(!ok);
    assert!(
        report.contains("FAILED: ") && report.contains("AADSTS90033"),
        "{report}"
    );
    // A wrong secret: Entra's own message, never the secret.
    idp.identity_control(IdentityControl {
        failing: Some(false),
        revoke: false,
    });
    let wrong = toml.replace("env:SP_SECRET", "env:KEY");
    let (report, ok) = spillgate::check::probe(&load(&wrong)).await;
    assert!(!ok);
    assert!(report.contains("AADSTS7000215"), "{report}");
    assert!(
        !report.contains(BACKEND_KEY) && !report.contains(SP_SECRET),
        "{report}"
    );
}

// ---------------------------------------------------------------------------------------
// Timing, on paused time: the token endpoint and the backend are scripted in memory
// behind the gateway's `Upstream`, and the real client-secret flow runs against them.
// ---------------------------------------------------------------------------------------

/// A token answer: after this delay, a token valid for this many seconds (`None`: the
/// token service answers 503).
type Step = (Duration, Option<u64>);

/// `login.test` answers token requests (`tok-1`, `tok-2`, ... after each step's delay,
/// valid for its lifetime); any other host is a backend answering 200 after `latency`,
/// recording the `Authorization` header it got, or 401 to a revoked token and on a host
/// that refuses every token (its identity lacks the role).
#[derive(Clone, Default)]
struct Scripted {
    token_calls: Arc<AtomicUsize>,
    /// Scripted token answers, in order; the last one repeats.
    steps: Arc<Mutex<(VecDeque<Step>, Option<Step>)>>,
    /// Backend requests as they arrived: host and `Authorization`.
    seen: Arc<Mutex<Vec<(String, String)>>>,
    revoked: Arc<Mutex<Vec<String>>>,
    refusing: Arc<Mutex<Vec<String>>>,
    /// How long each backend host takes to answer (none: at once).
    latency: Arc<Mutex<Vec<(String, Duration)>>>,
}

impl Scripted {
    fn step(&self, delay: Duration, lifetime_s: u64) {
        self.steps
            .lock()
            .unwrap()
            .0
            .push_back((delay, Some(lifetime_s)));
    }
    fn failing_step(&self, delay: Duration) {
        self.steps.lock().unwrap().0.push_back((delay, None));
    }
    fn token_calls(&self) -> usize {
        self.token_calls.load(Ordering::SeqCst)
    }
    /// The `Authorization` values backends got, in order.
    fn auths(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(_, a)| a.clone())
            .collect()
    }
    /// How many requests `host` got with `auth`.
    fn count(&self, host: &str, auth: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(h, a)| h == host && a == auth)
            .count()
    }
    /// Backends refuse every token issued so far.
    fn revoke_all(&self) {
        let n = self.token_calls();
        self.revoked
            .lock()
            .unwrap()
            .extend((1..=n).map(|i| format!("Bearer tok-{i}")));
    }
    fn refuse_all_on(&self, host: &str) {
        self.refusing.lock().unwrap().push(host.to_string());
    }
    fn set_latency(&self, host: &str, d: Duration) {
        self.latency.lock().unwrap().push((host.to_string(), d));
    }
}

impl Upstream for Scripted {
    fn send<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<http::Response<Body>, AttemptError>> {
        let req = req.to_http().unwrap();
        let this = self.clone();
        Box::pin(async move {
            let host = req.uri().host().unwrap_or_default().to_string();
            if host == "login.test" {
                let n = this.token_calls.fetch_add(1, Ordering::SeqCst) + 1;
                let (delay, lifetime) = {
                    let mut steps = this.steps.lock().unwrap();
                    if let Some(next) = steps.0.pop_front() {
                        steps.1 = Some(next);
                    }
                    steps.1.unwrap()
                };
                tokio::time::sleep(delay).await;
                let (status, body) = match lifetime {
                    Some(lifetime) => (
                        200,
                        format!(
                            r#"{{"token_type":"Bearer","expires_in":{lifetime},"access_token":"tok-{n}"}}"#
                        ),
                    ),
                    None => (
                        503,
                        r#"{"error":"temporarily_unavailable","error_description":"AADSTS90033: The token service is unavailable.","error_codes":[90033]}"#.to_string(),
                    ),
                };
                return Ok(http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap());
            }
            let auth = req
                .headers()
                .get("authorization")
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default();
            this.seen.lock().unwrap().push((host.clone(), auth.clone()));
            let refused = this.revoked.lock().unwrap().contains(&auth)
                || this.refusing.lock().unwrap().contains(&host);
            let latency = this
                .latency
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find(|(h, _)| *h == host)
                .map_or(Duration::ZERO, |(_, d)| *d);
            tokio::time::sleep(latency).await;
            let (status, body) = if refused {
                (
                    401,
                    r#"{"error":{"code":"PermissionDenied","message":"Principal does not have access to API/Operation."}}"#,
                )
            } else {
                (200, r#"{"ok":true}"#)
            };
            Ok(http::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap())
        })
    }
}

const SCRIPTED_AUTH: &str = "auth = { entra = \"client-secret\", tenant_id = \"t\", client_id = \"c\", client_secret = \"env:SP_SECRET\", authority_host = \"https://login.test\" }";

/// A gateway over `up`, on paused time, and a way to send it chat requests.
struct Paused {
    app: Arc<App>,
    router: spillgate::server::Gateway,
}

impl Paused {
    fn start(up: &Scripted, backends: &str) -> Paused {
        let app = App::with_upstream(load(&gateway_toml(backends)), Arc::new(up.clone())).unwrap();
        let router = spillgate::server::router(Arc::clone(&app));
        Paused { app, router }
    }

    /// Sends a request for `model`: status, serving backend and attempts.
    fn chat(&self, model: &str) -> tokio::task::JoinHandle<(StatusCode, String, String)> {
        let answer = self.chat_with_body(model);
        tokio::spawn(async move {
            let (status, backend, attempts, _) = answer.await.unwrap();
            (status, backend, attempts)
        })
    }

    /// [`Paused::chat`], with the response body.
    fn chat_with_body(
        &self,
        model: &str,
    ) -> tokio::task::JoinHandle<(StatusCode, String, String, String)> {
        let r = self.router.clone();
        let body = chat(model);
        tokio::spawn(async move {
            let req = http::Request::post("/v1/chat/completions")
                .header("api-key", CLIENT_KEY)
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap();
            let resp = r.oneshot(req).await.unwrap().into_response();
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            (
                parts.status,
                h(&parts.headers, "x-spillgate-backend").to_string(),
                h(&parts.headers, "x-spillgate-attempts").to_string(),
                String::from_utf8_lossy(&body).into_owned(),
            )
        })
    }

    fn backend_state(&self, name: &str) -> Value {
        spillgate::admin::state(&self.app)["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["name"] == name)
            .cloned()
            .unwrap()
    }
}

/// Lets spawned tasks run until they block, without moving the paused clock.
async fn settle() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn tokens_are_renewed_ahead_and_requests_at_expiry_share_one_fetch() {
    // Every test captures: see `Logs`.
    let (_logs, _guard) = Logs::capture();
    let up = Scripted::default();
    // The first token takes 2 s to come and lives an hour.
    up.step(Duration::from_secs(2), 3600);
    let config = load(&gateway_toml(
        "[[backends]]\nname = \"b\"\nkind = \"azure\"\nurl = \"http://b.test\"\nauth = { entra = \"client-secret\", tenant_id = \"t\", client_id = \"c\", client_secret = \"env:SP_SECRET\", authority_host = \"https://login.test\" }\n",
    ));
    let app = App::with_upstream(config, Arc::new(up.clone())).unwrap();
    let router = spillgate::server::router(Arc::clone(&app));
    let t0 = tokio::time::Instant::now();
    let send_many = |n: usize| {
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let r = router.clone();
                tokio::spawn(async move {
                    let req = http::Request::post("/v1/chat/completions")
                        .header("api-key", CLIENT_KEY)
                        .header("content-type", "application/json")
                        .body(Body::from(chat("gpt-4o")))
                        .unwrap();
                    r.oneshot(req).await.unwrap().into_response().status()
                })
            })
            .collect();
        async move {
            for t in tasks {
                assert_eq!(t.await.unwrap(), StatusCode::OK);
            }
        }
    };

    // A hundred requests at start wait for the one first fetch.
    send_many(100).await;
    assert_eq!(up.token_calls(), 1);
    assert_eq!(t0.elapsed(), Duration::from_secs(2));
    assert!(up.auths().iter().all(|a| a == "Bearer tok-1"));

    // Renewed five minutes before expiry, with no request asking; requests during the
    // renewal (10 s) do not wait for it.
    up.step(Duration::from_secs(10), 120);
    tokio::time::sleep_until(t0 + Duration::from_secs(2 + 3600 - 300) - Duration::from_millis(10))
        .await;
    assert_eq!(up.token_calls(), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(up.token_calls(), 2, "renewed in the background");
    let before = tokio::time::Instant::now();
    send_many(10).await;
    assert_eq!(
        before.elapsed(),
        Duration::ZERO,
        "no request waited for the renewal"
    );
    assert_eq!(up.auths().last().unwrap(), "Bearer tok-1");
    tokio::time::sleep(Duration::from_secs(10)).await;

    // tok-2 (fetched 3302-3312 s) lives two minutes: renewed halfway, at 3372 s, and
    // that renewal takes 80 s, so tok-2 runs out (at 3422 s, with the 10 s margin)
    // while it is in flight. A hundred requests arriving then (3445 s, within the 10 s a
    // request waits for a token) wait for it: one token request between them.
    up.step(Duration::from_secs(80), 3600);
    tokio::time::sleep_until(t0 + Duration::from_secs(3445)).await;
    assert_eq!(up.token_calls(), 3);
    send_many(100).await;
    assert_eq!(
        up.token_calls(),
        3,
        "the hundred requests shared the fetch in flight"
    );
    // They were answered when it ended, at 3452 s (the SDK's clock makes the token's
    // lifetime a few microseconds short of 120 s).
    let done = t0 + Duration::from_secs(3452);
    let now = tokio::time::Instant::now();
    assert!(
        now <= done && done - now < Duration::from_millis(10),
        "{:?}",
        done - now
    );
    assert_eq!(up.auths().last().unwrap(), "Bearer tok-3");
}

const TWO_BACKENDS: &str = "[[backends]]\nname = \"sp\"\nkind = \"azure\"\nurl = \"http://sp.test\"\npriority = 1\nAUTH\n\
     [[backends]]\nname = \"keyed\"\nkind = \"azure\"\nurl = \"http://keyed.test\"\napi_key = \"env:KEY\"\npriority = 2\n";

fn two_backends() -> String {
    TWO_BACKENDS.replace("AUTH", SCRIPTED_AUTH)
}

#[tokio::test(start_paused = true)]
async fn overlapping_refusals_of_a_revoked_token_make_one_renewal() {
    // Every test captures: see `Logs`.
    let (_logs, _guard) = Logs::capture();
    let up = Scripted::default();
    up.step(Duration::ZERO, 3600);
    let gw = Paused::start(&up, &two_backends());
    let (status, backend, _) = gw.chat("gpt-4o").await.unwrap();
    assert_eq!((status, backend.as_str()), (StatusCode::OK, "sp"));
    assert_eq!(up.token_calls(), 1);

    // Two minutes later the token is revoked. The backend holds each request for 1 s, so
    // twenty requests sent together are all at the backend with the old token at once,
    // and all refused together; ten more sent half a second later are refused after
    // the renewal (0.2 s) has brought the new token.
    tokio::time::sleep(Duration::from_secs(120)).await;
    up.revoke_all();
    up.set_latency("sp.test", Duration::from_secs(1));
    up.step(Duration::from_millis(200), 3600);
    let t0 = tokio::time::Instant::now();
    let mut tasks: Vec<_> = (0..20).map(|_| gw.chat("gpt-4o")).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        up.count("sp.test", "Bearer tok-1"),
        21,
        "twenty requests at the backend with the revoked token, none answered yet"
    );
    tasks.extend((0..10).map(|_| gw.chat("gpt-4o")));
    for t in tasks {
        assert_eq!(
            t.await.unwrap(),
            (StatusCode::OK, "sp".to_string(), "2".to_string())
        );
    }
    assert_eq!(
        up.token_calls(),
        2,
        "one renewal for thirty refusals of the same token"
    );
    assert_eq!(up.count("sp.test", "Bearer tok-1"), 31);
    assert_eq!(up.count("sp.test", "Bearer tok-2"), 30);
    assert_eq!(up.count("keyed.test", ""), 0);
    // The first twenty: refused at 1 s, retried at 1.2 s, answered at 2.2 s; the last
    // ten: refused at 1.5 s, retried at once, answered at 2.5 s.
    assert_eq!(t0.elapsed(), Duration::from_millis(2500));

    // Two minutes on, the identity loses its role on sp: the (old) token is refused, a
    // new one is fetched, and refused too. sp is cooled for "auth" and the request moves
    // to the next backend.
    tokio::time::sleep(Duration::from_secs(120)).await;
    up.refuse_all_on("sp.test");
    let r = gw.chat("gpt-4o").await.unwrap();
    assert_eq!(r, (StatusCode::OK, "keyed".to_string(), "3".to_string()));
    assert_eq!(up.token_calls(), 3);
    assert_eq!(up.count("sp.test", "Bearer tok-3"), 1);
    let st = gw.backend_state("sp");
    assert_eq!(
        (st["state"].as_str(), st["reason"].as_str()),
        (Some("cooling"), Some("auth")),
        "{st}"
    );
    let r = gw.chat("gpt-4o").await.unwrap();
    assert_eq!(r, (StatusCode::OK, "keyed".to_string(), "1".to_string()));
    assert_eq!(up.token_calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_401_on_one_backend_leaves_the_shared_token_to_the_others() {
    // Every test captures: see `Logs`.
    let (_logs, _guard) = Logs::capture();
    let up = Scripted::default();
    up.step(Duration::ZERO, 3600);
    // Backend a refuses every token (its identity lacks the role), answering in 1 s;
    // b, on the same credential, accepts them at once.
    up.refuse_all_on("a.test");
    up.set_latency("a.test", Duration::from_secs(1));
    let gw = Paused::start(
        &up,
        &format!(
            "[[backends]]\nname = \"a\"\nkind = \"azure\"\nurl = \"http://a.test\"\n{SCRIPTED_AUTH}\ndeployments = {{ \"m-a\" = \"m-a\" }}\n\
             [[backends]]\nname = \"b\"\nkind = \"azure\"\nurl = \"http://b.test\"\n{SCRIPTED_AUTH}\ndeployments = {{ \"m-b\" = \"m-b\" }}\n"
        ),
    );
    let (status, backend, _) = gw.chat("m-b").await.unwrap();
    assert_eq!((status, backend.as_str()), (StatusCode::OK, "b"));
    tokio::time::sleep(Duration::from_secs(120)).await;

    // A request to a is refused (at 1 s): the token is renewed, which takes 5 s and
    // fails.
    up.failing_step(Duration::from_secs(5));
    let t0 = tokio::time::Instant::now();
    let refused = gw.chat("m-a");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(up.token_calls(), 2, "the renewal is under way");
    // Meanwhile b's requests are served with the current token, without waiting.
    for _ in 0..5 {
        let before = tokio::time::Instant::now();
        let (status, backend, attempts) = gw.chat("m-b").await.unwrap();
        assert_eq!(
            (status, backend.as_str(), attempts.as_str()),
            (StatusCode::OK, "b", "1")
        );
        assert_eq!(before.elapsed(), Duration::ZERO, "no wait for the renewal");
        assert_eq!(up.auths().last().unwrap(), "Bearer tok-1");
    }
    // One more request to a leaves at 5.5 s, before the renewal fails (6 s), and is
    // refused after it (6.5 s): that refusal fetches nothing before the retry the
    // failure scheduled (7 s).
    tokio::time::sleep_until(t0 + Duration::from_millis(5500)).await;
    let late = gw.chat("m-a");
    let (status, _, _) = refused.await.unwrap();
    assert_ne!(status, StatusCode::OK);
    assert_eq!(t0.elapsed(), Duration::from_secs(6));
    let (status, _, _) = late.await.unwrap();
    assert_ne!(status, StatusCode::OK);
    assert_eq!(t0.elapsed(), Duration::from_millis(6500));
    assert_eq!(up.token_calls(), 2, "one renewal for the refused token");
    assert_eq!(up.count("a.test", "Bearer tok-1"), 2);

    // a is cooled for "auth"; b is not, and keeps serving with the token.
    let a = gw.backend_state("a");
    assert_eq!(
        (a["state"].as_str(), a["reason"].as_str()),
        (Some("cooling"), Some("auth"))
    );
    let b = gw.backend_state("b");
    assert_eq!(b["state"], "ready", "{b}");
    assert_eq!(b["token"], "ready", "{b}");
    for _ in 0..3 {
        let before = tokio::time::Instant::now();
        let (status, backend, _) = gw.chat("m-b").await.unwrap();
        assert_eq!((status, backend.as_str()), (StatusCode::OK, "b"));
        assert_eq!(before.elapsed(), Duration::ZERO);
        assert_eq!(up.auths().last().unwrap(), "Bearer tok-1");
    }
}

#[tokio::test(start_paused = true)]
async fn a_backend_refusing_a_recent_token_stays_out_for_its_whole_cooldown() {
    // Every test captures: see `Logs`.
    let (_logs, _guard) = Logs::capture();
    let up = Scripted::default();
    // The first token lives 40 s, so it is renewed at 20 s; the next lives an hour.
    up.step(Duration::ZERO, 40);
    up.step(Duration::ZERO, 3600);
    up.refuse_all_on("sp.test");
    let gw = Paused::start(
        &up,
        &format!(
            "[cooldown]\ndefault_auth = \"30s\"\nmax_jitter = \"0s\"\n{}",
            two_backends()
        ),
    );
    let t0 = tokio::time::Instant::now();
    // sp refuses a token seconds old: no renewal, sp cooled for 30 s, keyed serves.
    let r = gw.chat("gpt-4o").await.unwrap();
    assert_eq!(r, (StatusCode::OK, "keyed".to_string(), "2".to_string()));
    assert_eq!(up.token_calls(), 1);

    // The token is renewed at 20 s: that does not end sp's cooldown.
    tokio::time::sleep_until(t0 + Duration::from_secs(25)).await;
    assert_eq!(up.token_calls(), 2);
    let st = gw.backend_state("sp");
    assert_eq!(
        (st["state"].as_str(), st["reason"].as_str()),
        (Some("cooling"), Some("auth")),
        "{st}"
    );
    let r = gw.chat("gpt-4o").await.unwrap();
    assert_eq!(r, (StatusCode::OK, "keyed".to_string(), "1".to_string()));
    assert_eq!(up.count("sp.test", "Bearer tok-1"), 1);
    assert_eq!(up.count("sp.test", "Bearer tok-2"), 0);

    // After its 30 s, sp is tried again, refuses the new token (11 s old), and is
    // cooled again, with no renewal.
    tokio::time::sleep_until(t0 + Duration::from_secs(31)).await;
    let r = gw.chat("gpt-4o").await.unwrap();
    assert_eq!(r, (StatusCode::OK, "keyed".to_string(), "2".to_string()));
    assert_eq!(up.count("sp.test", "Bearer tok-2"), 1);
    assert_eq!(up.token_calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_retry_after_a_401_keeps_to_max_attempts_and_the_retry_budget() {
    // Every test captures: see `Logs`.
    let (_logs, _guard) = Logs::capture();
    for (limit, code) in [
        ("[routing]\nmax_attempts = 1\n", ""),
        (
            "[retry]\nbudget = { ratio = 0.0, min_per_second = 0 }\n",
            "retry_budget_exhausted",
        ),
    ] {
        let up = Scripted::default();
        up.step(Duration::ZERO, 3600);
        let gw = Paused::start(&up, &format!("{limit}{}", two_backends()));
        let r = gw.chat("gpt-4o").await.unwrap();
        assert_eq!(r, (StatusCode::OK, "sp".to_string(), "1".to_string()));
        tokio::time::sleep(Duration::from_secs(120)).await;
        up.revoke_all();
        // Refused, and no attempt left for the retry: the request ends there.
        let (status, _, attempts, body) = gw.chat_with_body("gpt-4o").await.unwrap();
        assert_eq!(
            (status, attempts.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "1"),
            "{limit}{body}"
        );
        assert!(body.contains(code), "{limit}{body}");
        assert_eq!(up.count("sp.test", "Bearer tok-1"), 2, "{limit}");
        assert_eq!(up.count("keyed.test", ""), 0, "{limit}");
        // The renewal went on regardless: the next request gets the new token.
        settle().await;
        assert_eq!(up.token_calls(), 2, "{limit}");
        let r = gw.chat("gpt-4o").await.unwrap();
        assert_eq!(
            r,
            (StatusCode::OK, "sp".to_string(), "1".to_string()),
            "{limit}"
        );
        assert_eq!(up.count("sp.test", "Bearer tok-2"), 1, "{limit}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_401_to_a_health_check_renews_the_token_and_cools_for_auth() {
    // Every test captures: see `Logs`.
    let (_logs, _guard) = Logs::capture();
    let up = Scripted::default();
    up.step(Duration::ZERO, 3600);
    let gw = Paused::start(
        &up,
        &format!(
            "[[backends]]\nname = \"sp\"\nkind = \"azure\"\nurl = \"http://sp.test\"\n{SCRIPTED_AUTH}\nhealth_check = {{ path = \"/openai/models?api-version=2024-10-21\", interval = \"10s\" }}\n"
        ),
    );
    spillgate::health::spawn(&gw.app);
    let t0 = tokio::time::Instant::now();
    // Checks every 10 s pass with the token.
    tokio::time::sleep_until(t0 + Duration::from_secs(65)).await;
    assert!(up.count("sp.test", "Bearer tok-1") >= 5);
    assert_eq!(gw.backend_state("sp")["state"], "ready");

    // The token is revoked: the check at 70 s is refused, which asks for a renewal (3 s)
    // and cools the backend for "auth" until the new token is in hand.
    up.revoke_all();
    up.step(Duration::from_secs(3), 3600);
    tokio::time::sleep_until(t0 + Duration::from_secs(71)).await;
    settle().await;
    assert_eq!(up.token_calls(), 2);
    let st = gw.backend_state("sp");
    assert_eq!(
        (st["state"].as_str(), st["reason"].as_str()),
        (Some("cooling"), Some("auth")),
        "{st}"
    );
    tokio::time::sleep_until(t0 + Duration::from_secs(74)).await;
    settle().await;
    assert_ne!(gw.backend_state("sp")["state"], "cooling");
    tokio::time::sleep_until(t0 + Duration::from_secs(81)).await;
    settle().await;
    assert_eq!(
        up.count("sp.test", "Bearer tok-2"),
        1,
        "the next check uses the new token"
    );

    // A refusal of a token 17 s old renews nothing and cools the backend for
    // `cooldown.default_auth`.
    up.refuse_all_on("sp.test");
    tokio::time::sleep_until(t0 + Duration::from_secs(91)).await;
    settle().await;
    assert_eq!(up.count("sp.test", "Bearer tok-2"), 2);
    assert_eq!(up.token_calls(), 2);
    let st = gw.backend_state("sp");
    assert_eq!(
        (st["state"].as_str(), st["reason"].as_str()),
        (Some("cooling"), Some("auth")),
        "{st}"
    );
    let left = st["cooling_ms"].as_u64().unwrap();
    assert!(left > 25_000 && left <= 30_000, "{st}");
}
