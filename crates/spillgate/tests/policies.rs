//! Retry policies, routes, budgets, deadlines, circuit breaking and recovery, tested on
//! the whole gateway (router, attempt loop, state) in memory: backends are scripted
//! behind the `Upstream` trait and tokio's clock is paused, so every wait is exact and
//! no test sleeps for real.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed setup step should abort the test loudly"
)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, StatusCode};
use http_body_util::BodyExt;
use spillgate::app::App;
use spillgate::upstream::{AttemptError, Upstream, UpstreamRequest};
use tokio::time::Instant;
use tower::ServiceExt;

const KEY: &str = "client-key";
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;

/// A scripted reply of a fake backend.
#[derive(Clone, Debug)]
struct R {
    /// 0 = no answer at all (connection refused).
    status: u16,
    headers: Vec<(&'static str, String)>,
    delay: Duration,
}

fn ok() -> R {
    st(200)
}
fn st(status: u16) -> R {
    R {
        status,
        headers: Vec::new(),
        delay: Duration::ZERO,
    }
}
impl R {
    fn header(mut self, k: &'static str, v: &str) -> R {
        self.headers.push((k, v.to_string()));
        self
    }
    fn delay(mut self, d: Duration) -> R {
        self.delay = d;
        self
    }
}

#[derive(Debug, Clone)]
struct Call {
    backend: String,
    path: String,
    body: Bytes,
    /// When the attempt started, since the test began.
    at: Duration,
}

#[derive(Default)]
struct FakeState {
    scripts: HashMap<String, VecDeque<R>>,
    defaults: HashMap<String, R>,
    calls: Vec<Call>,
}

/// Backends by host name (`b0`, `b1`, ...): scripted replies first, then a default
/// (200 unless set).
#[derive(Clone)]
struct Fake {
    state: Arc<Mutex<FakeState>>,
    start: Instant,
}

impl Fake {
    fn new() -> Fake {
        Fake {
            state: Arc::default(),
            start: Instant::now(),
        }
    }
    fn script(&self, backend: &str, replies: Vec<R>) {
        self.state
            .lock()
            .unwrap()
            .scripts
            .entry(backend.to_string())
            .or_default()
            .extend(replies);
    }
    fn default(&self, backend: &str, reply: R) {
        self.state
            .lock()
            .unwrap()
            .defaults
            .insert(backend.to_string(), reply);
    }
    fn calls(&self) -> Vec<Call> {
        self.state.lock().unwrap().calls.clone()
    }
    fn order(&self) -> Vec<String> {
        self.calls().into_iter().map(|c| c.backend).collect()
    }
    fn hits(&self, backend: &str) -> usize {
        self.calls().iter().filter(|c| c.backend == backend).count()
    }
}

impl Upstream for Fake {
    fn send<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<http::Response<Body>, AttemptError>> {
        let req = req.to_http().unwrap();
        let host = req.uri().host().unwrap_or("?");
        let backend = host.strip_suffix(".test").unwrap_or(host).to_string();
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default();
        let at = Instant::now() - self.start;
        let state = Arc::clone(&self.state);
        Box::pin(async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let reply = {
                let mut s = state.lock().unwrap();
                s.calls.push(Call {
                    backend: backend.clone(),
                    path,
                    body,
                    at,
                });
                s.scripts
                    .get_mut(&backend)
                    .and_then(VecDeque::pop_front)
                    .or_else(|| s.defaults.get(&backend).cloned())
                    .unwrap_or_else(ok)
            };
            let answer = async {
                tokio::time::sleep(reply.delay).await;
                if reply.status == 0 {
                    return Err(AttemptError::Connect("connection refused".into()));
                }
                let mut resp = http::Response::builder().status(reply.status);
                for (k, v) in &reply.headers {
                    resp = resp.header(*k, v);
                }
                Ok(resp
                    .body(Body::from(format!("{{\"from\":\"{backend}\"}}")))
                    .unwrap())
            };
            match tokio::time::timeout(timeout, answer).await {
                Ok(r) => r,
                Err(_) => Err(AttemptError::FirstByteTimeout(timeout)),
            }
        })
    }
}

/// The gateway over fake backends `b0..bN` (Azure kind, url `http://bN.test`), with
/// `backends` lines appended to each `[[backends]]` (e.g. `priority = 2`).
struct Gw {
    fake: Fake,
    app: Arc<App>,
    router: spillgate::server::Gateway,
}

fn gateway(backends: &[&str], extra: &str) -> Gw {
    let mut text = format!("[auth]\nclient_keys = [\"env:K\"]\n{extra}\n");
    for (i, b) in backends.iter().enumerate() {
        text.push_str(&format!(
            "[[backends]]\nname = \"b{i}\"\nkind = \"azure\"\nurl = \"http://b{i}.test\"\napi_key = \"env:K\"\n{b}\n"
        ));
    }
    let config =
        spillgate_core::config::load(&text, &|_| Some(KEY.to_string()), &|_| Err(String::new()))
            .unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    let fake = Fake::new();
    let app = App::with_upstream(config, Arc::new(fake.clone())).unwrap();
    let router = spillgate::server::router(Arc::clone(&app));
    Gw { fake, app, router }
}

impl Gw {
    async fn send(&self, path: &str, body: &str) -> (StatusCode, HeaderMap, String) {
        let req = http::Request::post(path)
            .header("api-key", KEY)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = self
            .router
            .clone()
            .oneshot(req)
            .await
            .unwrap()
            .into_response();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    async fn chat(&self) -> (StatusCode, HeaderMap, String) {
        self.send("/v1/chat/completions", CHAT).await
    }

    async fn chat_model(&self, model: &str) -> (StatusCode, HeaderMap, String) {
        let body = CHAT.replace("gpt-4o", model);
        self.send("/v1/chat/completions", &body).await
    }

    /// The backend that served a chat request (`x-spillgate-backend`; empty if none did).
    async fn served_by(&self) -> String {
        let (_, headers, _) = self.chat().await;
        h(&headers, "x-spillgate-backend").to_string()
    }

    /// The backend that served a chat request for `model`.
    async fn served_by_model(&self, model: &str) -> String {
        let (_, headers, _) = self.chat_model(model).await;
        h(&headers, "x-spillgate-backend").to_string()
    }
}

fn h<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn secs(c: &Call) -> f64 {
    c.at.as_secs_f64()
}

// ---------------------------------------------------------------------------------------
// Seed 001: three URLs, 3 tries each, 5xx retried on the same URL, 429 moves on at once.
// ---------------------------------------------------------------------------------------

const SEED_001: &str = r#"
[retry]
condition = [">=300"]
count = 8
per_backend = 3
switch_on = ["429"]
interval = "1s"
max_interval = "10s"
delta = "1s"
first_fast_retry = false
"#;

#[tokio::test(start_paused = true)]
async fn seed_001_all_failing_makes_nine_calls_then_stops() {
    let gw = gateway(&["priority = 1", "priority = 2", "priority = 3"], SEED_001);
    for b in ["b0", "b1", "b2"] {
        gw.fake.default(b, st(500));
    }
    let (status, headers, body) = gw.chat().await;
    // Retries used up: the last backend's own answer goes back, as APIM's retry does.
    assert_eq!(status, 500);
    assert_eq!(h(&headers, "x-spillgate-attempts"), "9");
    assert_eq!(body, r#"{"from":"b2"}"#);
    assert_eq!(
        gw.fake.order(),
        ["b0", "b0", "b0", "b1", "b1", "b1", "b2", "b2", "b2"]
    );
    // Waits between tries of one backend follow the backoff (1 s, then 2 s +-20%);
    // moving to the next backend is immediate. Compared as durations: in seconds as
    // floats, a wait of exactly 2.2 s (the bound, reached now and then as the timer
    // rounds up to the millisecond) came out as 2.200000000000001.
    let c = gw.fake.calls();
    for base in [0, 3, 6] {
        let first = c[base + 1].at - c[base].at;
        let second = c[base + 2].at - c[base + 1].at;
        assert_eq!(
            first,
            Duration::from_secs(1),
            "first retry waits interval: {first:?}"
        );
        assert!(
            (Duration::from_millis(1_800)..=Duration::from_millis(2_200)).contains(&second),
            "second retry waits 2 s +-20%: {second:?}"
        );
    }
    assert_eq!(secs(&c[3]), secs(&c[2]), "switching to b1 does not wait");
    assert_eq!(secs(&c[6]), secs(&c[5]), "switching to b2 does not wait");
}

#[tokio::test(start_paused = true)]
async fn seed_001_429_moves_on_at_once_and_5xx_retries_in_place() {
    let gw = gateway(&["priority = 1", "priority = 2", "priority = 3"], SEED_001);
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "20")]);
    gw.fake.script("b1", vec![st(500), st(503), ok()]);
    let (status, headers, body) = gw.chat().await;
    assert_eq!(status, 200);
    assert_eq!(body, r#"{"from":"b1"}"#);
    assert_eq!(h(&headers, "x-spillgate-backend"), "b1");
    assert_eq!(h(&headers, "x-spillgate-attempts"), "4");
    assert_eq!(gw.fake.order(), ["b0", "b1", "b1", "b1"]);
    let c = gw.fake.calls();
    assert_eq!(secs(&c[1]), secs(&c[0]), "429: no wait");
    // Every attempt sent the same body.
    assert!(c.iter().all(|x| x.body == c[0].body));
}

#[tokio::test(start_paused = true)]
async fn seed_001_a_400_is_retried_under_ge_300_and_ends_with_the_last_answer() {
    let gw = gateway(&["priority = 1", "priority = 2"], SEED_001);
    gw.fake.default("b0", st(400));
    gw.fake.default("b1", st(404));
    let (status, headers, _) = gw.chat().await;
    assert_eq!(status, 404);
    assert_eq!(gw.fake.order(), ["b0", "b0", "b0", "b1", "b1", "b1"]);
    assert_eq!(h(&headers, "x-spillgate-attempts"), "6");
}

#[tokio::test(start_paused = true)]
async fn seed_000_switches_immediately_without_waiting() {
    let gw = gateway(&["priority = 1", "priority = 2", "priority = 3"], "");
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "10")]);
    gw.fake.script("b1", vec![st(503)]);
    let t0 = Instant::now();
    let (status, headers, _) = gw.chat().await;
    assert_eq!(status, 200);
    assert_eq!(h(&headers, "x-spillgate-backend"), "b2");
    assert_eq!(gw.fake.order(), ["b0", "b1", "b2"]);
    assert_eq!(t0.elapsed(), Duration::ZERO, "no server-side sleep");
}

#[tokio::test(start_paused = true)]
async fn a_longer_retry_after_overrides_the_backoff() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[retry]\nper_backend = 2\ninterval = \"1s\"\n",
    );
    gw.fake
        .script("b0", vec![st(503).header("retry-after", "7"), ok()]);
    let (status, headers, _) = gw.chat().await;
    assert_eq!(status, 200);
    assert_eq!(h(&headers, "x-spillgate-backend"), "b0");
    let c = gw.fake.calls();
    assert_eq!(c[1].at - c[0].at, Duration::from_secs(7));
}

// ---------------------------------------------------------------------------------------
// Budget and deadline
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn retry_budget_bounds_upstream_attempts_in_a_total_outage() {
    // Every backend answers 503 and cools for no time at all, so without a budget each
    // request would try all three: 3 upstream attempts per request.
    let gw = gateway(
        &["", "", ""],
        "[cooldown]\ndefault_5xx = \"0s\"\n[retry]\nbudget = { ratio = 0.2, min_per_second = 1, window = \"10s\" }\n",
    );
    for b in ["b0", "b1", "b2"] {
        gw.fake.default(b, st(503));
    }
    let requests = 3000u32; // 100 per second for 30 s
    let mut budget_errors = 0;
    let mut last_message = String::new();
    for _ in 0..requests {
        let (status, _, body) = gw.chat().await;
        assert_eq!(status, 503);
        if body.contains("retry_budget_exhausted") {
            budget_errors += 1;
            last_message = body;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let attempts = gw.fake.calls().len() as f64;
    let retries = attempts - f64::from(requests);
    // 20% of requests plus 1/s: about 600 + 30 extra attempts over 30 s; without the
    // budget there would be 6000.
    assert!(
        retries <= 0.2 * f64::from(requests) + 30.0 + 10.0,
        "{retries} retries"
    );
    assert!(
        retries >= 0.2 * f64::from(requests) * 0.8,
        "the budget is used, not zero: {retries}"
    );
    assert!(
        budget_errors > 2000,
        "most requests are refused by the budget: {budget_errors}"
    );
    // The error says why and shows the budget's state.
    assert!(last_message.contains("retries used of"), "{last_message}");
    assert!(
        last_message.contains("allowed in the last 10 s"),
        "{last_message}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_covers_all_attempts_and_waits() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[routing]\ndeadline = \"5s\"\n[retry]\nper_backend = 3\ninterval = \"2s\"\n",
    );
    gw.fake.default("b0", st(500));
    gw.fake.default("b1", ok().delay(Duration::from_secs(60)));
    let t0 = Instant::now();
    let (status, headers, body) = gw.chat().await;
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("deadline_exceeded"));
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(5),
        "answered exactly at the deadline"
    );
    // b0 at 0 s and 2 s; its third try would come at 4 s + wait: the deadline cuts in.
    assert!(gw.fake.hits("b0") >= 2);
    assert!(h(&headers, "x-spillgate-attempts").parse::<u32>().unwrap() >= 3);
}

// ---------------------------------------------------------------------------------------
// Circuit breaking and recovery
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn breaker_trips_after_n_failures_and_a_single_probe_tests_recovery() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[cooldown]\ndefault_5xx = \"0s\"\n[circuit_breaker]\nfailures = 3\nwindow = \"10s\"\ntrip = \"30s\"\n",
    );
    gw.fake.script("b0", vec![st(500), st(500), st(500)]);
    for _ in 0..3 {
        let (status, headers, _) = gw.chat().await;
        assert_eq!(status, 200);
        assert_eq!(h(&headers, "x-spillgate-backend"), "b1");
    }
    assert_eq!(gw.fake.hits("b0"), 3);
    // Tripped: b0 gets nothing for 30 s although its cooldowns were 0 s.
    for _ in 0..20 {
        gw.chat().await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(gw.fake.hits("b0"), 3, "tripped backend left alone");
    let snap = gw.app.snapshot.load();
    let c = snap.backends[0]
        .state
        .cooldown(gw.app.clock.now_ms())
        .unwrap();
    assert_eq!(c.reason.as_str(), "tripped");

    // After the trip (30 s plus up to 1 s of jitter), 50 requests arrive at once while
    // the probe is slow: b0 gets exactly one of them.
    tokio::time::sleep(Duration::from_secs(12)).await;
    gw.fake
        .script("b0", vec![ok().delay(Duration::from_secs(2))]);
    let before_b1 = gw.fake.hits("b1");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        tasks.push(spawn_chat(&gw, false, "gpt-4o").await);
    }
    let mut served = Vec::new();
    for t in tasks {
        served.push(t.await.unwrap().1);
    }
    assert_eq!(gw.fake.hits("b0"), 4, "exactly one probe");
    assert_eq!(served.iter().filter(|b| *b == "b0").count(), 1);
    assert_eq!(served.iter().filter(|b| *b == "b1").count(), 49);
    assert_eq!(gw.fake.hits("b1") - before_b1, 49);
    // The probe answered well: b0 is fully back for everyone.
    for _ in 0..10 {
        assert_eq!(gw.served_by().await, "b0");
    }
}

#[tokio::test(start_paused = true)]
async fn after_a_cooldown_only_one_probe_goes_until_it_answers() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[cooldown]\nmax_jitter = \"0s\"\n",
    );
    gw.fake.script(
        "b0",
        vec![
            st(429).header("retry-after", "5"),
            ok().delay(Duration::from_secs(3)),
        ],
    );
    gw.chat().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    // First request after the cooldown is the probe (slow); others go to b1 meanwhile.
    let probe = spawn_chat(&gw, false, "gpt-4o").await;
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..5 {
        assert_eq!(gw.served_by().await, "b1", "the probe is in flight");
    }
    assert_eq!(probe.await.unwrap().1, "b0");
    assert_eq!(gw.served_by().await, "b0", "back after the probe answered");
}

#[tokio::test(start_paused = true)]
async fn a_failed_probe_cools_the_backend_again() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[cooldown]\nmax_jitter = \"0s\"\n",
    );
    gw.fake.script(
        "b0",
        vec![
            st(429).header("retry-after", "5"),
            st(429).header("retry-after", "5"),
        ],
    );
    gw.chat().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_, headers, _) = gw.chat().await;
    assert_eq!(
        h(&headers, "x-spillgate-attempts"),
        "2",
        "probe failed, moved on"
    );
    for _ in 0..3 {
        assert_eq!(gw.served_by().await, "b1");
    }
    assert_eq!(gw.fake.hits("b0"), 2);
}

#[tokio::test(start_paused = true)]
async fn active_health_checks_cool_a_failing_backend() {
    let gw = gateway(
        &[
            "priority = 1\nhealth_check = { path = \"/openai/models?api-version=2024-10-21\", interval = \"10s\" }",
            "priority = 2",
        ],
        "",
    );
    gw.fake.default("b0", st(500));
    spillgate::health::spawn(&gw.app);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let calls = gw.fake.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].path, "/openai/models?api-version=2024-10-21");
    // No client request has touched b0, yet it is cooling and traffic goes to b1.
    assert_eq!(gw.served_by().await, "b1");
    assert_eq!(gw.fake.hits("b0"), 1);
    let snap = gw.app.snapshot.load();
    assert_eq!(
        snap.backends[0]
            .state
            .cooldown(gw.app.clock.now_ms())
            .unwrap()
            .reason
            .as_str(),
        "health"
    );
    // It checks again each interval.
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert_eq!(gw.fake.hits("b0"), 3);
}

// ---------------------------------------------------------------------------------------
// Routes
// ---------------------------------------------------------------------------------------

/// Seed 004's content-based routing: gpt-35-turbo-16k to the PTU first, everything else
/// to pay-as-you-go; gpt-4o* by glob with a fallback to gpt-4o-mini.
const ROUTES: &str = r#"
[[routes]]
models = ["gpt-35-turbo-16k"]
backends = [{ name = "b0", priority = 1 }, { name = "b1", priority = 2 }]

[[routes]]
models = ["gpt-4o*"]
backends = [{ name = "b1", priority = 1 }, { name = "b2", priority = 2 }]
fallback = ["gpt-4o-mini"]

[[routes]]
models = ["*"]
backends = ["b2"]
"#;

#[tokio::test(start_paused = true)]
async fn routes_send_each_model_to_its_pool() {
    let gw = gateway(
        &[
            "deployments = { \"gpt-35-turbo-16k\" = \"turbo16k-ptu\" }",
            "",
            "deployments = { \"gpt-4o\" = \"gpt4o-paygo\", \"gpt-4o-mini\" = \"mini-paygo\", \"ada\" = \"ada\" }",
        ],
        ROUTES,
    );
    let (_, headers, _) = gw.chat_model("gpt-35-turbo-16k").await;
    assert_eq!(h(&headers, "x-spillgate-backend"), "b0");
    assert_eq!(h(&headers, "x-spillgate-model"), "gpt-35-turbo-16k");
    assert_eq!(
        gw.served_by_model("gpt-4o").await,
        "b1",
        "glob route, its own tier 1"
    );
    assert_eq!(gw.served_by_model("ada").await, "b2", "catch-all route");
    let paths: Vec<String> = gw.fake.calls().into_iter().map(|c| c.path).collect();
    assert_eq!(
        paths[0],
        "/openai/deployments/turbo16k-ptu/chat/completions?api-version=2024-10-21"
    );
    // Per-pool tiers: b1 is priority 2 for turbo-16k but priority 1 for gpt-4o.
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "30")]);
    assert_eq!(gw.served_by_model("gpt-35-turbo-16k").await, "b1");
}

#[tokio::test(start_paused = true)]
async fn unknown_models_get_404_listing_nothing_secret() {
    let gw = gateway(
        &["deployments = { \"gpt-4o\" = \"d\" }"],
        "[[routes]]\nmodels = [\"gpt-4o*\"]\nbackends = [\"b0\"]\n",
    );
    let (status, _, body) = gw.chat_model("gpt-5").await;
    assert_eq!(status, 404);
    assert!(body.contains("model_not_found"));
    assert!(
        !body.contains("b0") && !body.contains(".test") && !body.contains(KEY),
        "{body}"
    );
    // Matched by the glob, but no backend of the pool serves it: 404 too.
    let (status, _, _) = gw.chat_model("gpt-4o-mini").await;
    assert_eq!(status, 404);
    assert!(gw.fake.calls().is_empty());
}

#[tokio::test(start_paused = true)]
async fn fallback_model_serves_when_every_backend_of_the_model_is_cooling() {
    let gw = gateway(
        &[
            "deployments = { \"gpt-4o\" = \"gpt4o-a\" }",
            "deployments = { \"gpt-4o\" = \"gpt4o-b\" }",
            "deployments = { \"gpt-4o-mini\" = \"mini-c\" }\nazure_api = \"v1\"",
        ],
        r#"
[[routes]]
models = ["gpt-4o"]
backends = ["b0", "b1"]
fallback = ["gpt-4o-mini"]

[[routes]]
models = ["gpt-4o-mini"]
backends = ["b2"]
"#,
    );
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "60")]);
    gw.fake
        .script("b1", vec![st(429).header("retry-after", "60")]);
    let (status, headers, _) = gw.chat_model("gpt-4o").await;
    assert_eq!(status, 200);
    assert_eq!(h(&headers, "x-spillgate-backend"), "b2");
    assert_eq!(h(&headers, "x-spillgate-model"), "gpt-4o-mini");
    let last = gw.fake.calls().pop().unwrap();
    let sent: serde_json::Value = serde_json::from_slice(&last.body).unwrap();
    assert_eq!(
        sent["model"], "mini-c",
        "the model name is rewritten for the fallback"
    );
    // Azure-shaped clients get the fallback deployment in the path.
    let (status, headers, _) = gw
        .send(
            "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            CHAT,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(h(&headers, "x-spillgate-model"), "gpt-4o-mini");
    assert_eq!(
        gw.fake.calls().pop().unwrap().path,
        "/openai/deployments/mini-c/chat/completions?api-version=2024-10-21"
    );
}

// ---------------------------------------------------------------------------------------
// What a failure takes out, and for whom
// ---------------------------------------------------------------------------------------

const TWO_DEPLOYMENTS: &str =
    "priority = 1\ndeployments = { \"gpt-4o\" = \"chat\", \"emb\" = \"emb\" }";

#[tokio::test(start_paused = true)]
async fn a_429_cools_only_that_deployment_not_the_resource() {
    let gw = gateway(&[TWO_DEPLOYMENTS, "priority = 2"], "");
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "30")]);
    assert_eq!(gw.served_by_model("emb").await, "b1", "emb throttled on b0");
    // Azure's quota is per deployment: b0's chat deployment still has its own.
    assert_eq!(gw.served_by_model("gpt-4o").await, "b0");
    assert_eq!(gw.served_by_model("emb").await, "b1", "emb still cooling");
}

#[tokio::test(start_paused = true)]
async fn a_connection_failure_cools_the_whole_resource() {
    let gw = gateway(&[TWO_DEPLOYMENTS, "priority = 2"], "");
    gw.fake.script("b0", vec![st(0)]);
    assert_eq!(gw.served_by_model("emb").await, "b1");
    assert_eq!(
        gw.served_by_model("gpt-4o").await,
        "b1",
        "the resource is unreachable"
    );
    assert_eq!(gw.fake.hits("b0"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_fires_does_not_blame_the_backend() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[routing]\ndeadline = \"1s\"\n",
    );
    gw.fake
        .script("b0", vec![ok().delay(Duration::from_secs(2))]);
    let (status, _, body) = gw.chat().await;
    assert_eq!(status, 504, "{body}");
    let snap = gw.app.snapshot.load();
    assert_eq!(
        snap.backends[0].cooldown_for("gpt-4o", gw.app.clock.now_ms()),
        None
    );
    assert_eq!(gw.served_by().await, "b0", "b0 was never cooled");
}

#[tokio::test(start_paused = true)]
async fn cooldown_on_decides_which_failures_take_a_backend_out() {
    // Plain 500s fail over but do not take the backend out for everyone else.
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[cooldown]\non = [\"429\", \"502\", \"503\", \"504\", \"connect-error\"]\n",
    );
    gw.fake.script("b0", vec![st(500)]);
    assert_eq!(gw.served_by().await, "b1");
    assert_eq!(gw.served_by().await, "b0", "a 500 did not cool b0");
    gw.fake.script("b0", vec![st(503)]);
    gw.chat().await;
    assert_eq!(gw.served_by().await, "b1", "a 503 did");
}

#[tokio::test(start_paused = true)]
async fn a_connect_error_outside_the_retry_condition_ends_the_request() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[retry]\ncondition = [\"429\"]\n",
    );
    gw.fake.script("b0", vec![st(0)]);
    let (status, headers, body) = gw.chat().await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(h(&headers, "x-spillgate-attempts"), "1");
    assert_eq!(gw.fake.hits("b1"), 0);
}

// ---------------------------------------------------------------------------------------
// Spill, return and waiting
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn traffic_returns_to_priority_1_when_its_cooldown_ends() {
    let gw = gateway(&["priority = 1", "priority = 2"], "");
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "5")]);
    for _ in 0..3 {
        assert_eq!(gw.served_by().await, "b1");
    }
    tokio::time::sleep(Duration::from_millis(4_900)).await;
    assert_eq!(gw.served_by().await, "b1", "still cooling at 4.9 s");
    // 5 s plus at most 0.5 s of jitter.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for _ in 0..3 {
        assert_eq!(gw.served_by().await, "b0", "back on priority 1");
    }
}

#[tokio::test(start_paused = true)]
async fn wait_policy_waits_for_the_soonest_recovery_within_the_bound() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[routing]\nwhen_all_cooling = \"wait\"\nmax_wait = \"5s\"\n[cooldown]\nmax_jitter = \"0s\"\n",
    );
    gw.fake
        .script("b0", vec![st(429).header("retry-after-ms", "2000")]);
    gw.fake
        .script("b1", vec![st(429).header("retry-after-ms", "3000")]);
    // First request: both fail; each was tried once, so it is answered 429.
    assert_eq!(gw.chat().await.0, 429);
    // Second request: both cooling; it waits for b0's recovery (2 s, plus up to 100 ms
    // of spread) and is served there.
    let t0 = Instant::now();
    let (status, headers, _) = gw.chat().await;
    assert_eq!(status, 200);
    assert_eq!(h(&headers, "x-spillgate-backend"), "b0");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited <= Duration::from_millis(2_100),
        "{waited:?}"
    );
    // A wait longer than max_wait is not taken: answered at once.
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "30")]);
    gw.fake
        .script("b1", vec![st(429).header("retry-after", "30")]);
    assert_eq!(gw.chat().await.0, 429);
    let t0 = Instant::now();
    let (status, headers, _) = gw.chat().await;
    assert_eq!(status, 429);
    assert_eq!(h(&headers, "x-spillgate-attempts"), "0");
    assert_eq!(t0.elapsed(), Duration::ZERO);
}

// ---------------------------------------------------------------------------------------
// Regressions found by review: reservations and probes released on every path, state
// re-checked before a same-backend retry, the deadline kept through waits, fallbacks on
// the same resource, atomic admission, waiters behind a probe, forward-first and
// admission, breakers added by reload.
// ---------------------------------------------------------------------------------------

async fn spawn_chat(gw: &Gw, low: bool, model: &str) -> tokio::task::JoinHandle<(u16, String)> {
    let router = gw.router.clone();
    let body = CHAT.replace("gpt-4o", model);
    tokio::spawn(async move {
        let mut req = http::Request::post("/v1/chat/completions").header("api-key", KEY);
        if low {
            req = req.header("x-priority", "low");
        }
        let resp = router
            .oneshot(req.body(Body::from(body)).unwrap())
            .await
            .unwrap()
            .into_response();
        let b = resp
            .headers()
            .get("x-spillgate-backend")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let status = resp.status().as_u16();
        let _ = resp.into_body().collect().await;
        (status, b)
    })
}

// A client that goes away while the upstream attempt is in flight gives its reservation back.
#[tokio::test(start_paused = true)]
async fn a_cancelled_request_gives_its_reservation_back() {
    let gw = gateway(
        &["priority = 1"],
        "[priority]\n[[priority.models]]\nmodels = [\"gpt-4o\"]\nlow_priority_tpm_threshold = 1000\nlow_priority_rp10s_threshold = 60\n",
    );
    let full = |r: R| {
        r.header("x-ratelimit-remaining-tokens", "100000")
            .header("x-ratelimit-limit-tokens", "100000")
            .header("x-ratelimit-remaining-requests", "100")
            .header("x-ratelimit-limit-requests", "100")
    };
    gw.fake
        .default("b0", full(ok()).delay(Duration::from_secs(5)));
    // 50 clients that give up after 100 ms (SDK timeout, user closes the tab...).
    for _ in 0..50 {
        let router = gw.router.clone();
        let req = http::Request::post("/v1/chat/completions")
            .header("api-key", KEY)
            .body(Body::from(CHAT))
            .unwrap();
        let _ = tokio::time::timeout(Duration::from_millis(100), router.oneshot(req)).await;
    }
    tokio::time::sleep(Duration::from_secs(120)).await;
    let snap = gw.app.snapshot.load();
    let dep = snap.backends[0].deployment_state("gpt-4o").unwrap();
    let cap = dep.capacity();
    println!(
        "after 120 s idle: inflight_tokens={} inflight_requests={}",
        cap.inflight_tokens, cap.inflight_requests
    );
    // A fresh observation says the deployment is completely idle and full ...
    gw.fake.default("b0", full(ok()));
    let (s, _, _) = gw.chat().await;
    assert_eq!(s, 200);
    // ... so a low-priority request is admitted. With the 50 reservations leaked, only
    // 50 of the 100 requests would look free, short of the 60 kept for high priority
    // plus its own: it would be refused for priority, forever.
    let (s, backend) = spawn_chat(&gw, true, "gpt-4o").await.await.unwrap();
    println!("low-priority after idle: {s} {backend}");
    assert_eq!(cap.inflight_requests, 0, "reservations leaked");
    assert_eq!(cap.inflight_tokens, 0, "reserved tokens leaked");
    assert_eq!(
        (s, backend.as_str()),
        (200, "b0"),
        "the low-priority request is admitted"
    );
}

// A same-backend retry after a slow attempt never waits past the deadline.
#[tokio::test(start_paused = true)]
async fn same_backend_waits_never_outlast_the_deadline() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[routing]\ndeadline = \"5s\"\n[retry]\nper_backend = 2\ninterval = \"4s\"\n",
    );
    gw.fake.default("b0", st(500).delay(Duration::from_secs(3)));
    let t0 = Instant::now();
    let (status, _, body) = gw.chat().await;
    println!("status {status} after {:?}: {body}", t0.elapsed());
    assert!(
        t0.elapsed() <= Duration::from_secs(5),
        "deadline 5 s, answered after {:?}",
        t0.elapsed()
    );
}

// A same-backend retry does not go to a backend the breaker tripped meanwhile.
#[tokio::test(start_paused = true)]
async fn a_same_backend_retry_respects_a_trip_in_between() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[circuit_breaker]\nfailures = 2\ntrip = \"60s\"\n[retry]\nper_backend = 4\ninterval = \"1s\"\n",
    );
    gw.fake.default("b0", st(500));
    let (status, headers, _) = gw.chat().await;
    println!("status {status}, order {:?}", gw.fake.order());
    let snap = gw.app.snapshot.load();
    println!(
        "b0 cooldown: {:?}",
        snap.backends[0].state.cooldown(gw.app.clock.now_ms())
    );
    assert_eq!(
        gw.fake.hits("b0"),
        2,
        "tried again after it tripped; attempts={}",
        h(&headers, "x-spillgate-attempts")
    );
}

// A fallback to another deployment on the same resource is tried in the same request.
#[tokio::test(start_paused = true)]
async fn a_fallback_deployment_on_the_same_resource_is_tried() {
    const CHAT_PATH: &str = "/openai/deployments/chat/chat/completions?api-version=2024-10-21";
    const MINI_PATH: &str = "/openai/deployments/mini/chat/completions?api-version=2024-10-21";
    let gw = gateway(
        &["deployments = { \"gpt-4o\" = \"chat\", \"gpt-4o-mini\" = \"mini\" }"],
        "[[routes]]\nmodels = [\"gpt-4o\"]\nbackends = [\"b0\"]\nfallback = [\"gpt-4o-mini\"]\n[[routes]]\nmodels = [\"gpt-4o-mini\"]\nbackends = [\"b0\"]\n",
    );
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "30")]);
    let paths = || -> Vec<String> { gw.fake.calls().into_iter().map(|c| c.path).collect() };
    let (status, headers, body) = gw.chat().await;
    assert_eq!(status, 200, "fallback gpt-4o-mini on b0 was available");
    assert_eq!(h(&headers, "x-spillgate-backend"), "b0");
    assert_eq!(h(&headers, "x-spillgate-model"), "gpt-4o-mini");
    assert_eq!(body, r#"{"from":"b0"}"#);
    assert_eq!(paths(), [CHAT_PATH, MINI_PATH], "chat throttled, then mini");
    // While chat cools, the next request goes to the fallback deployment directly.
    let (status2, headers2, _) = gw.chat().await;
    assert_eq!(status2, 200);
    assert_eq!(h(&headers2, "x-spillgate-model"), "gpt-4o-mini");
    assert_eq!(paths(), [CHAT_PATH, MINI_PATH, MINI_PATH]);
}

// A success of a request sent before the cooldown does not end the recovery: one probe.
#[tokio::test(start_paused = true)]
async fn in_flight_successes_do_not_end_a_recovery() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[cooldown]\nmax_jitter = \"0s\"\n",
    );
    gw.fake.script(
        "b0",
        vec![
            ok().delay(Duration::from_secs(2)),
            st(429).header("retry-after", "5"),
        ],
    );
    let a = spawn_chat(&gw, false, "gpt-4o").await;
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (s, _, _) = gw.chat().await; // b0: 429 (cools 5 s), served by b1
    assert_eq!(s, 200);
    assert_eq!(a.await.unwrap().1, "b0"); // the slow 200 lands at 2 s, during the cooldown
    tokio::time::sleep(Duration::from_secs(4)).await; // cooldown over
    gw.fake.default("b0", ok().delay(Duration::from_secs(2)));
    let before = gw.fake.hits("b0");
    let mut tasks = Vec::new();
    for _ in 0..20 {
        tasks.push(spawn_chat(&gw, false, "gpt-4o").await);
    }
    for t in tasks {
        t.await.unwrap();
    }
    let n = gw.fake.hits("b0") - before;
    println!("requests sent to b0 when its cooldown ended: {n}");
    assert_eq!(n, 1, "one probe");
}

// Admission and reservation are one step: concurrent low-priority requests cannot all take the same free slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn concurrent_low_priority_requests_cannot_share_one_free_slot() {
    let gw = gateway(
        &["priority = 1"],
        "[priority]\n[[priority.models]]\nmodels = [\"gpt-4o\"]\nlow_priority_tpm_threshold = 0\nlow_priority_rp10s_threshold = 0\n",
    );
    let hdr = |r: R| {
        r.header("x-ratelimit-remaining-tokens", "100000000")
            .header("x-ratelimit-limit-tokens", "100000000")
            .header("x-ratelimit-remaining-requests", "10")
            .header("x-ratelimit-limit-requests", "10")
            .header("x-ratelimit-reset-requests", "3600")
    };
    gw.fake.script("b0", vec![hdr(ok())]);
    gw.fake
        .default("b0", hdr(ok()).delay(Duration::from_secs(2)));
    gw.chat().await; // teaches 10 requests left
    let before = gw.fake.hits("b0");
    let mut tasks = Vec::new();
    for _ in 0..400 {
        tasks.push(spawn_chat(&gw, true, "gpt-4o").await);
    }
    let mut ok = 0;
    for t in tasks {
        if t.await.unwrap().0 == 200 {
            ok += 1;
        }
    }
    let sent = gw.fake.hits("b0") - before;
    println!("admitted {sent} low-priority requests against 10 free (200s: {ok})");
    assert!(sent <= 10);
    // The first to arrive found 10 free (no reserve kept), and every admitted request
    // was answered 200 by the only backend.
    assert!(sent >= 1, "nothing admitted against 10 free");
    assert_eq!(
        ok, sent,
        "admitted requests succeed, refused ones are not 200"
    );
}

// `when_all_cooling = "wait"`: waiters behind a probe keep waiting instead of failing.
#[tokio::test(start_paused = true)]
async fn waiters_wait_behind_a_probe_instead_of_failing() {
    let gw = gateway(
        &["priority = 1"],
        "[routing]\nwhen_all_cooling = \"wait\"\nmax_wait = \"30s\"\n[cooldown]\nmax_jitter = \"0s\"\n",
    );
    gw.fake
        .script("b0", vec![st(429).header("retry-after", "2")]);
    assert_eq!(gw.chat().await.0, 429);
    gw.fake
        .default("b0", ok().delay(Duration::from_millis(500)));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..5 {
        tasks.push(spawn_chat(&gw, false, "gpt-4o").await);
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().0);
    }
    println!("after {:?}: {statuses:?}", t0.elapsed());
    assert!(statuses.iter().all(|s| *s == 200));
}

// forward-first does not send a low-priority request past its reserve.
#[tokio::test(start_paused = true)]
async fn forward_first_never_lets_low_priority_past_its_reserve() {
    let gw = gateway(
        &["priority = 1"],
        "[routing]\nwhen_all_cooling = \"forward-first\"\n[priority]\n[[priority.models]]\nmodels = [\"gpt-4o\"]\nlow_priority_tpm_threshold = 50000\nlow_priority_rp10s_threshold = 50\n",
    );
    // Observed: nothing to spare for low priority, and the deployment cooling (e.g. a 503).
    gw.fake.script(
        "b0",
        vec![st(503)
            .header("x-ratelimit-remaining-tokens", "1000")
            .header("x-ratelimit-limit-tokens", "100000")
            .header("x-ratelimit-remaining-requests", "5")
            .header("x-ratelimit-limit-requests", "100")],
    );
    gw.chat().await;
    let before = gw.fake.hits("b0");
    let (s, _) = spawn_chat(&gw, true, "gpt-4o").await.await.unwrap();
    println!(
        "low priority under forward-first: {s}, upstream calls {}",
        gw.fake.hits("b0") - before
    );
    assert_eq!(
        gw.fake.hits("b0") - before,
        0,
        "low priority must not pass admission"
    );
}

// A breaker added by hot reload trips.
#[tokio::test(start_paused = true)]
async fn a_breaker_added_by_reload_trips() {
    let gw = gateway(
        &["priority = 1", "priority = 2"],
        "[cooldown]\ndefault_5xx = \"0s\"\n",
    );
    let text = "[auth]\nclient_keys = [\"env:K\"]\n[cooldown]\ndefault_5xx = \"0s\"\n[circuit_breaker]\nfailures = 3\nwindow = \"10s\"\ntrip = \"30s\"\n[[backends]]\nname = \"b0\"\nkind = \"azure\"\nurl = \"http://b0.test\"\napi_key = \"env:K\"\npriority = 1\n[[backends]]\nname = \"b1\"\nkind = \"azure\"\nurl = \"http://b1.test\"\napi_key = \"env:K\"\npriority = 2\n";
    let config =
        spillgate_core::config::load(text, &|_| Some(KEY.to_string()), &|_| Err(String::new()))
            .unwrap();
    spillgate::reload::apply_config(&gw.app, config).unwrap();
    gw.fake.default("b0", st(500));
    for _ in 0..10 {
        gw.chat().await;
    }
    println!(
        "b0 hits after 10 requests with a 3-failure breaker: {}",
        gw.fake.hits("b0")
    );
    assert_eq!(gw.fake.hits("b0"), 3);
}

#[tokio::test(start_paused = true)]
async fn without_rate_limit_headers_reservations_end_with_the_body() {
    // The fake sends no x-ratelimit-* headers: each reservation is held until its body
    // ends, and then given back.
    let gw = gateway(
        &["priority = 1"],
        "[priority]\n[[priority.models]]\nmodels = [\"gpt-4o\"]\nlow_priority_tpm_threshold = 1\nlow_priority_rp10s_threshold = 1\n",
    );
    for _ in 0..5 {
        assert_eq!(gw.chat().await.0, 200);
    }
    let snap = gw.app.snapshot.load();
    let c = snap.backends[0]
        .deployment_state("gpt-4o")
        .unwrap()
        .capacity();
    assert_eq!((c.inflight_tokens, c.inflight_requests), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn cooldown_ends_are_jittered() {
    // Ten backends throttled at the same instant with the same Retry-After: their
    // cooldowns end spread over up to 10% (1 s) after it, not all at once.
    let specs: Vec<String> = (0..10).map(|i| format!("priority = {}", i + 1)).collect();
    let refs: Vec<&str> = specs.iter().map(String::as_str).collect();
    let gw = gateway(&refs, "");
    for i in 0..10 {
        gw.fake
            .script(&format!("b{i}"), vec![st(429).header("retry-after", "10")]);
    }
    assert_eq!(gw.chat().await.0, 429);
    let snap = gw.app.snapshot.load();
    let now = gw.app.clock.now_ms();
    let ends: Vec<u64> = snap
        .backends
        .iter()
        .map(|b| b.cooldown_for("gpt-4o", now).unwrap().until_ms - now)
        .collect();
    assert!(
        ends.iter().all(|e| (10_000..=11_000).contains(e)),
        "{ends:?}"
    );
    let distinct: std::collections::BTreeSet<_> = ends.iter().collect();
    assert!(distinct.len() >= 5, "spread out: {ends:?}");
}

#[tokio::test(start_paused = true)]
async fn inside_a_tier_the_deployment_with_more_headroom_is_preferred() {
    let gw = gateway(&["priority = 1", "priority = 1"], "");
    let with = |remaining: &str| {
        ok().header("x-ratelimit-remaining-tokens", remaining)
            .header("x-ratelimit-limit-tokens", "100000")
            .header("x-ratelimit-reset-tokens", "3600")
    };
    gw.fake.default("b0", with("5000"));
    gw.fake.default("b1", with("95000"));
    // Learn both, then count where traffic goes.
    while gw.fake.hits("b0") == 0 || gw.fake.hits("b1") == 0 {
        gw.chat().await;
    }
    let (b0, b1) = (gw.fake.hits("b0"), gw.fake.hits("b1"));
    for _ in 0..400 {
        gw.chat().await;
    }
    let (b0, b1) = (gw.fake.hits("b0") - b0, gw.fake.hits("b1") - b1);
    // Two weighted draws keep the roomier one unless both land on b0: 3/4 to b1.
    assert!(b1 > 2 * b0, "b0 {b0}, b1 {b1}");
}
