//! End-to-end behaviour of the gateway against in-process mock backends on loopback:
//! failover, tiers, cooldowns, streaming, credentials, limits and translation between
//! the Azure and OpenAI request shapes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed setup step should abort the test loudly"
)]

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use spillgate::app::App;
use spillgate::server::{start, Running};
use spillgate_mock::{MockBackend, MockConfig, Reply};

const CLIENT_KEY: &str = "client-secret-key-123";
const BACKEND_KEYS: [&str; 4] = [
    "backend-key-aaaaaaaa",
    "backend-key-bbbbbbbb",
    "backend-key-cccccccc",
    "backend-key-dddddddd",
];
const CHAT: &str =
    r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hello, which backend are you?"}]}"#;

/// One backend to start: (name, kind, priority, weight, deployments).
struct B {
    name: &'static str,
    kind: &'static str,
    priority: u32,
    weight: u32,
    deployments: Option<&'static str>,
}

fn b(name: &'static str, priority: u32) -> B {
    B {
        name,
        kind: "azure",
        priority,
        weight: 1,
        deployments: None,
    }
}

struct Env {
    mocks: Vec<MockBackend>,
    gw: Running,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Env {
    async fn start(backends: Vec<B>, extra: &str) -> Env {
        Self::start_full(backends, "", extra).await
    }

    /// With extra lines in the `[server]` table.
    async fn start_with_server(backends: Vec<B>, server: &str) -> Env {
        Self::start_full(backends, server, "").await
    }

    async fn start_full(backends: Vec<B>, server: &str, extra: &str) -> Env {
        let mut mocks = Vec::new();
        for (i, spec) in backends.iter().enumerate() {
            let cfg = MockConfig {
                name: spec.name.to_string(),
                expect_api_key: Some(BACKEND_KEYS[i].to_string()),
                stream_chunks: 5,
                ..MockConfig::default()
            };
            mocks.push(MockBackend::start(cfg).await.unwrap());
        }
        Self::start_with(backends, mocks, server, extra).await
    }

    async fn start_with(
        backends: Vec<B>,
        mocks: Vec<MockBackend>,
        server: &str,
        extra: &str,
    ) -> Env {
        let config = config_for(&backends, &mocks, server, extra);
        let gw = start(App::new(config).unwrap()).await.unwrap();
        let client = Client::builder(TokioExecutor::new()).build_http();
        Env { mocks, gw, client }
    }

    fn request(&self, method: &str, path: &str, _body: &str) -> http::request::Builder {
        http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.gw.addr))
            .header("content-type", "application/json")
            .header("api-key", CLIENT_KEY)
    }

    async fn send(
        &self,
        req: http::request::Builder,
        body: &str,
    ) -> (StatusCode, HeaderMap, Bytes) {
        let resp = self
            .client
            .request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
            .await
            .unwrap();
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        (parts.status, parts.headers, bytes)
    }

    async fn post(&self, path: &str, body: &str) -> (StatusCode, HeaderMap, Bytes) {
        self.send(self.request("POST", path, body), body).await
    }

    async fn chat(&self) -> (StatusCode, HeaderMap, Bytes) {
        self.post("/v1/chat/completions", CHAT).await
    }

    async fn azure_chat(&self, deployment: &str) -> (StatusCode, HeaderMap, Bytes) {
        self.post(
            &format!("/openai/deployments/{deployment}/chat/completions?api-version=2024-10-21"),
            CHAT,
        )
        .await
    }

    fn hits(&self) -> Vec<u64> {
        self.mocks.iter().map(MockBackend::hits).collect()
    }
}

/// The gateway config for `backends` served by `mocks` (backend i by mock i).
fn config_for(
    backends: &[B],
    mocks: &[MockBackend],
    server: &str,
    extra: &str,
) -> spillgate_core::config::Config {
    let urls: Vec<String> = mocks.iter().map(MockBackend::url).collect();
    config_at(backends, &urls, server, extra)
}

/// The gateway config for `backends` at `urls` (backend i at url i).
fn config_at(
    backends: &[B],
    urls: &[String],
    server: &str,
    extra: &str,
) -> spillgate_core::config::Config {
    let mut text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmax_body_bytes = 4096\n{server}\n[auth]\nclient_keys = [\"env:CLIENT\"]\n{extra}\n"
    );
    for (i, spec) in backends.iter().enumerate() {
        let url = if spec.kind == "openai" {
            format!("{}/v1", urls[i])
        } else {
            urls[i].clone()
        };
        text.push_str(&format!(
            "[[backends]]\nname = \"{}\"\nkind = \"{}\"\nurl = \"{url}\"\npriority = {}\nweight = {}\napi_key = \"env:KEY{i}\"\n",
            spec.name, spec.kind, spec.priority, spec.weight
        ));
        if let Some(d) = spec.deployments {
            text.push_str(&format!("deployments = {d}\n"));
        }
    }
    spillgate_core::config::load(
        &text,
        &|v| match v {
            "CLIENT" => Some(CLIENT_KEY.to_string()),
            k => k
                .strip_prefix("KEY")
                .and_then(|n| n.parse::<usize>().ok())
                .map(|n| BACKEND_KEYS[n].to_string()),
        },
        &|_| Err("no files".into()),
    )
    .unwrap_or_else(|e| panic!("config: {e}\n{text}"))
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
}

fn sha(body: &[u8]) -> String {
    Sha256::digest(body)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn json(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)))
}

// ---------------------------------------------------------------------------------------
// Failover
// ---------------------------------------------------------------------------------------

async fn failover_case(first_reply: Reply) {
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    env.mocks[0].push_script(vec![first_reply]);
    let (status, h, body) = env.azure_chat("gpt-4o").await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(header(&h, "x-spillgate-backend"), "p2");
    assert_eq!(header(&h, "x-spillgate-attempts"), "2");
    assert_eq!(env.hits(), vec![1, 1]);
    // The second backend got exactly the bytes the first one got.
    let first = &env.mocks[0].requests()[0];
    let second = &env.mocks[1].requests()[0];
    assert_eq!(first.body_sha256, second.body_sha256);
    assert_eq!(second.body_sha256, sha(CHAT.as_bytes()));
    // The failed backend is cooling: the next request goes straight to p2.
    let (status, h, _) = env.azure_chat("gpt-4o").await;
    assert_eq!(status, 200);
    assert_eq!(header(&h, "x-spillgate-attempts"), "1");
    assert_eq!(env.hits(), vec![1, 2]);
}

#[tokio::test]
async fn failover_on_429() {
    failover_case(Reply::throttled(20)).await;
}

#[tokio::test]
async fn failover_on_500() {
    failover_case(Reply::status(500)).await;
}

#[tokio::test]
async fn failover_on_503() {
    failover_case(Reply::status(503).with_header("retry-after", "5")).await;
}

#[tokio::test]
async fn failover_on_connection_refused() {
    // A port that refuses connections, and that nothing else (another test's server
    // among them) can take while this test runs: a socket bound to it that does not
    // listen. A port bound and closed again could be taken and answer.
    let dead = tokio::net::TcpSocket::new_v4().unwrap();
    dead.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let dead_addr = dead.local_addr().unwrap();
    let live = MockBackend::start(MockConfig {
        name: "p2".into(),
        expect_api_key: Some(BACKEND_KEYS[1].into()),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    // Backend 0 points at the dead port.
    let config = config_at(
        &[b("dead", 1), b("p2", 2)],
        &[format!("http://{dead_addr}"), live.url()],
        "",
        "",
    );
    let gw = start(App::new(config).unwrap()).await.unwrap();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("http://{}/v1/chat/completions", gw.addr))
        .header("api-key", CLIENT_KEY)
        .body(Full::new(Bytes::from_static(CHAT.as_bytes())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-spillgate-backend"), "p2");
    assert_eq!(header(resp.headers(), "x-spillgate-attempts"), "2");
    assert_eq!(live.requests()[0].body_sha256, sha(CHAT.as_bytes()));
    // The dead backend is cooling for the connect default.
    let snap = gw.app.snapshot.load();
    let now = gw.app.clock.now_ms();
    let c = snap.backends[0]
        .state
        .cooldown(now)
        .expect("dead backend cooling");
    assert_eq!(c.reason.as_str(), "connect");
}

#[tokio::test]
async fn first_byte_timeout_fails_over() {
    let env = Env::start(
        vec![b("slow", 1), b("fast", 2)],
        "[timeouts]\nfirst_byte = \"200ms\"\n",
    )
    .await;
    env.mocks[0].push_script(vec![Reply::status(200).with_delay_ms(5_000)]);
    let (status, h, _) = env.chat().await;
    assert_eq!(status, 200);
    assert_eq!(header(&h, "x-spillgate-backend"), "fast");
}

// ---------------------------------------------------------------------------------------
// Tiers, weights and cooldowns
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn strict_tiers_then_spill() {
    let env = Env::start(vec![b("p1a", 1), b("p1b", 1), b("p2", 2)], "").await;
    for _ in 0..60 {
        assert_eq!(env.chat().await.0, 200);
    }
    let h = env.hits();
    assert_eq!(
        h[2], 0,
        "priority 2 must get nothing while priority 1 is ready: {h:?}"
    );
    assert_eq!(h[0] + h[1], 60);
    assert!(
        h[0] > 10 && h[1] > 10,
        "random choice inside the tier: {h:?}"
    );

    // Both priority-1 backends throttle with a short precise hint: traffic spills...
    env.mocks[0].push_script(vec![
        Reply::throttled(1).with_header("retry-after-ms", "300")
    ]);
    env.mocks[1].push_script(vec![
        Reply::throttled(1).with_header("retry-after-ms", "300")
    ]);
    let before = env.hits();
    for _ in 0..2 {
        let (s, h, _) = env.chat().await;
        assert_eq!(s, 200);
        assert_eq!(header(&h, "x-spillgate-backend"), "p2");
    }
    let (s, h, _) = env.chat().await;
    assert_eq!(s, 200);
    assert_eq!(header(&h, "x-spillgate-backend"), "p2");
    let after = env.hits();
    assert_eq!(
        after[0] + after[1] - before[0] - before[1],
        2,
        "each p1 backend tried once"
    );
    // The return to priority 1 is tested with paused time in tests/policies.rs.
}

#[tokio::test]
async fn weights_split_traffic_inside_a_tier() {
    let mut heavy = b("heavy", 1);
    heavy.weight = 3;
    let env = Env::start(vec![b("light", 1), heavy], "").await;
    for _ in 0..200 {
        assert_eq!(env.chat().await.0, 200);
    }
    let h = env.hits();
    // Expected 50 / 150; binomial sd ~6, so 30..70 is ~3.3 sd either way.
    assert!((30..=70).contains(&h[0]), "{h:?}");
}

#[tokio::test]
async fn all_throttled_answers_429_with_the_soonest_recovery() {
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    env.mocks[0].push_script(vec![Reply::throttled(30)]);
    env.mocks[1].push_script(vec![Reply::throttled(12)]);
    let (status, h, body) = env.chat().await;
    assert_eq!(status, 429);
    let ra: u64 = header(&h, "retry-after").parse().unwrap();
    // 12 s plus up to 1 s of jitter, rounded up to whole seconds.
    assert!((11..=13).contains(&ra), "soonest is 12 s, got {ra}");
    let ra_ms: u64 = header(&h, "retry-after-ms").parse().unwrap();
    assert!((11_000..=13_000).contains(&ra_ms), "{ra_ms}");
    assert_eq!(header(&h, "x-spillgate-attempts"), "2");
    let v = json(&body);
    assert_eq!(v["error"]["code"], "all_backends_throttled");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    // While they cool, requests are answered at once without touching any backend.
    let (status, h, _) = env.chat().await;
    assert_eq!(status, 429);
    assert_eq!(header(&h, "x-spillgate-attempts"), "0");
    assert_eq!(env.hits(), vec![1, 1]);
}

#[tokio::test]
async fn mixed_failures_answer_503() {
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    env.mocks[0].push_script(vec![Reply::throttled(30)]);
    env.mocks[1].push_script(vec![Reply::status(502)]);
    let (status, h, body) = env.chat().await;
    assert_eq!(status, 503);
    assert_eq!(json(&body)["error"]["code"], "no_backend_available");
    assert!(header(&h, "retry-after").parse::<u64>().unwrap() >= 9);
}

#[tokio::test]
async fn forward_first_policy_sends_to_the_first_backend_anyway() {
    let env = Env::start(
        vec![b("p1", 1), b("p2", 2)],
        "[routing]\nwhen_all_cooling = \"forward-first\"\n",
    )
    .await;
    env.mocks[0].push_script(vec![Reply::throttled(30)]);
    env.mocks[1].push_script(vec![Reply::throttled(30)]);
    assert_eq!(env.chat().await.0, 429);
    // Both cooling: the next request still goes to the first backend, whose answer
    // (here a success) is returned.
    let (status, h, _) = env.chat().await;
    assert_eq!(status, 200);
    assert_eq!(header(&h, "x-spillgate-backend"), "p1");
    assert_eq!(env.hits(), vec![2, 1]);
}

#[tokio::test]
async fn client_errors_are_returned_not_retried_and_do_not_cool() {
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    let err = serde_json::json!({"error": {"code": "content_filter", "message": "filtered"}});
    env.mocks[0].push_script(vec![Reply::json(400, err.clone()), Reply::status(404)]);
    let (status, h, body) = env.chat().await;
    assert_eq!(status, 400);
    assert_eq!(json(&body), err);
    assert_eq!(header(&h, "x-spillgate-backend"), "p1");
    assert_eq!(header(&h, "x-spillgate-attempts"), "1");
    assert_eq!(env.chat().await.0, 404);
    assert_eq!(env.chat().await.0, 200);
    assert_eq!(env.hits(), vec![3, 0]);
}

#[tokio::test]
async fn retry_after_http_date_sets_the_cooldown() {
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    let at = std::time::SystemTime::now() + Duration::from_secs(40);
    env.mocks[0].push_script(vec![
        Reply::status(429).with_header("retry-after", &httpdate::fmt_http_date(at))
    ]);
    assert_eq!(env.chat().await.0, 200);
    let snap = env.gw.app.snapshot.load();
    let now = env.gw.app.clock.now_ms();
    let left = snap.backends[0]
        .cooldown_for("gpt-4o", now)
        .unwrap()
        .until_ms
        - now;
    assert!(
        (38_000..=41_000).contains(&left),
        "40 s plus at most 1 s of jitter: {left}"
    );
}

#[tokio::test]
async fn garbage_retry_after_uses_the_default_and_huge_is_clamped() {
    let env = Env::start(
        vec![b("p1", 1), b("p2", 1), b("p3", 2)],
        "[cooldown]\ndefault_429 = \"7s\"\nmax = \"60s\"\n",
    )
    .await;
    env.mocks[0].set_default(Some(Reply::status(429).with_header("retry-after", "soon")));
    env.mocks[1].set_default(Some(Reply::status(429).with_header("retry-after", "86400")));
    // Two requests are enough to hit both priority-1 backends once each.
    assert_eq!(env.chat().await.0, 200);
    assert_eq!(env.chat().await.0, 200);
    let snap = env.gw.app.snapshot.load();
    let now = env.gw.app.clock.now_ms();
    let left = |i: usize| {
        snap.backends[i]
            .cooldown_for("gpt-4o", now)
            .map(|c| c.until_ms - now)
            .unwrap_or(0)
    };
    assert!(
        (6_000..=7_700).contains(&left(0)),
        "default 7 s, got {}",
        left(0)
    );
    assert!(
        (59_000..=61_000).contains(&left(1)),
        "clamped to 60 s, got {}",
        left(1)
    );
}

// ---------------------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------------------

/// Appends the rest of `body` to `text`.
async fn append_text(body: &mut hyper::body::Incoming, text: &mut String) {
    while let Some(frame) = body.frame().await {
        if let Ok(d) = frame.unwrap().into_data() {
            text.push_str(&String::from_utf8_lossy(&d));
        }
    }
}

/// Replaces `env`'s gateway with one serving on two connection threads, as the binary
/// does (one per core).
async fn on_connection_threads(env: &mut Env, backends: &[B], server: &str) {
    let config = config_for(backends, &env.mocks, server, "");
    let workers = spillgate::server::ConnectionThreads::start(2).unwrap();
    env.gw = spillgate::server::start_on(App::new(config).unwrap(), Some(workers))
        .await
        .unwrap();
}

/// A chat request on a new client connection (closed after the answer), so that new
/// connections reach every connection thread.
async fn chat_on_a_new_connection(
    env: &Env,
) -> Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error> {
    let client = Client::builder(TokioExecutor::new()).build_http();
    let req = env
        .request("POST", "/v1/chat/completions", CHAT)
        .header("connection", "close")
        .body(Full::new(Bytes::from(CHAT)))
        .unwrap();
    client.request(req).await
}

async fn open_stream(env: &Env) -> hyper::body::Incoming {
    let body = r#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = env
        .request("POST", "/v1/chat/completions", body)
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = env.client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "content-type"), "text/event-stream");
    resp.into_body()
}

#[tokio::test]
async fn sse_chunks_arrive_as_the_backend_sends_them() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    env.mocks[0].push_script(vec![Reply::stream(5, 150)]);
    let mut body = open_stream(&env).await;
    let mut received = Vec::new();
    // The first frame reaches the client while the backend is still producing.
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    received.extend_from_slice(&first);
    assert!(std::str::from_utf8(&first).unwrap().starts_with("data: "));
    assert_eq!(
        env.mocks[0].streams_completed(),
        0,
        "first chunk came before the stream ended"
    );
    while let Some(frame) = body.frame().await {
        if let Ok(d) = frame.unwrap().into_data() {
            received.extend_from_slice(&d);
        }
    }
    let text = String::from_utf8(received).unwrap();
    assert_eq!(text.matches("data: {").count(), 5);
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(env.mocks[0].streams_completed(), 1);
}

#[tokio::test]
async fn sse_bytes_pass_through_unchanged_whatever_the_framing() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    let odd = "data:{\"a\":1}\r\n\r\n: comment\n\ndata: [DONE]\n\n";
    env.mocks[0].push_script(vec![Reply::raw(200, odd, Some("text/plain"))]);
    let (status, h, body) = env.chat().await;
    assert_eq!(status, 200);
    assert_eq!(header(&h, "content-type"), "text/plain");
    assert_eq!(body, odd.as_bytes());
}

/// The binary serves connections on one thread per core, each with its own upstream pool:
/// requests, streams and the drain at shutdown work the same there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_served_on_per_core_threads_work_end_to_end() {
    let mut env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    on_connection_threads(&mut env, &[b("p1", 1), b("p2", 2)], "").await;
    for _ in 0..20 {
        // A new client connection each time, so both threads get some.
        let resp = chat_on_a_new_connection(&env).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(header(resp.headers(), "x-spillgate-backend"), "p1");
    }
    env.mocks[0].push_script(vec![Reply::stream(5, 20)]);
    let mut body = open_stream(&env).await;
    let mut text = String::new();
    append_text(&mut body, &mut text).await;
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(env.hits(), vec![21, 0]);
    tokio::time::timeout(Duration::from_secs(10), env.gw.shutdown())
        .await
        .expect("drained");
}

/// With a connection limit below the number of connection threads, every new connection
/// is still served once a slot frees, whichever thread's listener the kernel gives it to;
/// and a stream in flight on a connection thread finishes while the gateway drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_listeners_share_the_connection_limit_and_drain_streams() {
    let mut env = Env::start(vec![b("p1", 1)], "").await;
    on_connection_threads(&mut env, &[b("p1", 1)], "max_connections = 1").await;
    for i in 0..20 {
        // A new connection each time: with a slot taken by a listener that waits in
        // accept, one that landed on the other listener would wait forever.
        let resp = tokio::time::timeout(Duration::from_secs(10), chat_on_a_new_connection(&env))
            .await
            .unwrap_or_else(|_| panic!("connection {i} was never served"))
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    env.mocks[0].push_script(vec![Reply::stream(5, 100)]);
    let mut body = open_stream(&env).await;
    let Env {
        gw, mocks: _mocks, ..
    } = env;
    let drain = tokio::spawn(gw.shutdown());
    let mut text = String::new();
    append_text(&mut body, &mut text).await;
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    tokio::time::timeout(Duration::from_secs(10), drain)
        .await
        .expect("drained")
        .unwrap();
}

/// A backend that sends a whole stream at once (a fast local server, a cached answer)
/// gets it to the client in a few writes, not one write per chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_chunks_that_arrive_together_leave_together() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    env.mocks[0].push_script(vec![Reply::stream(100, 0)]);
    let mut body = open_stream(&env).await;
    let (mut frames, mut text) = (0, String::new());
    while let Some(frame) = body.frame().await {
        if let Ok(d) = frame.unwrap().into_data() {
            frames += 1;
            text.push_str(&String::from_utf8_lossy(&d));
        }
    }
    assert_eq!(text.matches("data: {").count(), 100);
    assert!(text.ends_with("data: [DONE]\n\n"));
    // Frame by frame it would be 102 (100 chunks, the usage chunk, [DONE]).
    assert!(frames <= 20, "{frames} frames for a stream sent in one go");
}

#[tokio::test]
async fn mid_stream_break_ends_the_client_stream_without_done() {
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    env.mocks[0].push_script(vec![Reply::broken_stream(10, 20, 3)]);
    let mut body = open_stream(&env).await;
    let mut text = String::new();
    let mut errored = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(d) = f.into_data() {
                    text.push_str(&String::from_utf8_lossy(&d));
                }
            }
            Err(_) => {
                errored = true;
                break;
            }
        }
    }
    assert!(errored, "the client must see the stream break, got: {text}");
    assert_eq!(text.matches("data: {").count(), 3);
    assert!(!text.contains("[DONE]"));
    // No failover after the first byte: the second backend was never called.
    assert_eq!(env.hits(), vec![1, 0]);
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_stream() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    env.mocks[0].push_script(vec![Reply::stream(50, 50)]);
    let mut body = open_stream(&env).await;
    body.frame().await.unwrap().unwrap();
    drop(body);
    for _ in 0..100 {
        if env.mocks[0].streams_cancelled() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(env.mocks[0].streams_cancelled(), 1);
    assert_eq!(env.mocks[0].streams_completed(), 0);
}

// ---------------------------------------------------------------------------------------
// Credentials and limits
// ---------------------------------------------------------------------------------------

/// Collects every log line the gateway writes during a test.
#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn credentials_are_kept_apart_and_never_logged() {
    let logs = LogBuf::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let mut p2 = b("p2", 2);
    p2.kind = "openai";
    let env = Env::start(vec![b("p1", 1), p2], "").await;
    env.mocks[0].push_script(vec![Reply::throttled(20)]);
    let req = env
        .request("POST", "/v1/chat/completions", CHAT)
        .header("authorization", format!("Bearer {CLIENT_KEY}"))
        .header("cookie", "session=abc")
        .header("connection", "x-hop")
        .header("x-hop", "1")
        .header("x-custom", "kept");
    let (status, h, body) = env.send(req, CHAT).await;
    assert_eq!(status, 200);

    // Each backend received its own credential in its own form, never the client's.
    let r0 = &env.mocks[0].requests()[0];
    assert_eq!(r0.header("api-key"), Some(BACKEND_KEYS[0]));
    assert_eq!(r0.header("authorization"), None);
    let r1 = &env.mocks[1].requests()[0];
    assert_eq!(
        r1.header("authorization"),
        Some(format!("Bearer {}", BACKEND_KEYS[1]).as_str())
    );
    assert_eq!(r1.header("api-key"), None);
    for r in env.mocks.iter().flat_map(|m| m.requests()) {
        let all = format!("{:?} {}", r.headers, r.body);
        assert!(
            !all.contains(CLIENT_KEY),
            "client key reached a backend: {all}"
        );
        assert_eq!(r.header("cookie"), None);
        assert_eq!(r.header("x-hop"), None);
        assert_eq!(r.header("x-custom"), Some("kept"));
    }
    // Backend keys never come back to the client or into the logs.
    let response_text = format!("{h:?} {}", String::from_utf8_lossy(&body));
    let log_text = String::from_utf8_lossy(&logs.0.lock().unwrap()).to_string();
    assert!(
        log_text.contains("backend cooling down"),
        "logs were captured: {log_text}"
    );
    for key in &BACKEND_KEYS[..2] {
        assert!(!response_text.contains(key));
        assert!(!log_text.contains(key), "backend key in logs");
    }
    assert!(!log_text.contains(CLIENT_KEY), "client key in logs");
    assert!(!log_text.contains("Hello, which backend"), "prompt in logs");
}

/// A client's headers as raw bytes, in any case and with `_` for `-` (hyper's client would
/// send them in lower case): what never goes upstream stays behind, and the one body
/// length that counts is the gateway's own.
#[tokio::test]
async fn headers_that_stay_behind_stay_behind_in_any_spelling() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = Env::start(vec![b("p1", 1)], "").await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw.example\r\nContent-Type: application/json\r\n\
         API-KEY: {CLIENT_KEY}\r\nAUTHORIZATION: Bearer {CLIENT_KEY}\r\n\
         Ocp-Apim-Subscription-Key: {CLIENT_KEY}\r\nApi_Key: {CLIENT_KEY}\r\n\
         X-FORWARDED-FOR: 10.0.0.1\r\nX_Forwarded_Port: 443\r\nForwarded: for=10.0.0.1\r\n\
         COOKIE: s=1\r\nConnection: X-Hop\r\nX-HOP: 1\r\nX-Priority: low\r\n\
         OpenAI-Organization: org\r\nX-Request-ID: client-1\r\nContent-Length: 9999\r\n\
         Transfer-Encoding: chunked\r\nX-Custom: kept\r\n\r\n{:x}\r\n{CHAT}\r\n0\r\n\r\n",
        CHAT.len()
    );
    let mut sock = tokio::net::TcpStream::connect(env.gw.addr).await.unwrap();
    sock.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    // A length beside a transfer coding: answered, then closed.
    tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.contains("x-request-id: client-1\r\n"), "{answer}");

    let r = &env.mocks[0].requests()[0];
    let sent = format!("{:?}", r.headers);
    assert!(
        !sent.contains(CLIENT_KEY),
        "a client key went upstream: {sent}"
    );
    for name in [
        "x-forwarded-for",
        "x_forwarded_port",
        "forwarded",
        "api_key",
        "ocp-apim-subscription-key",
        "authorization",
        "cookie",
        "connection",
        "x-hop",
        "x-priority",
        "openai-organization",
        "transfer-encoding",
    ] {
        assert_eq!(r.header(name), None, "{name} went upstream: {sent}");
    }
    assert_eq!(r.header("api-key"), Some(BACKEND_KEYS[0]));
    assert_eq!(r.header("x-request-id"), Some("client-1"));
    assert_eq!(r.header("x-custom"), Some("kept"));
    assert_eq!(
        r.header("content-length"),
        Some(CHAT.len().to_string().as_str())
    );
    assert_ne!(r.header("host"), Some("gw.example"));
    let once = |name: &str| r.headers.iter().filter(|(k, _)| k == name).count();
    assert_eq!(
        (once("host"), once("content-length"), once("api-key")),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn wrong_or_missing_client_key_is_refused_before_any_upstream_call() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    let req = http::Request::post(format!("http://{}/v1/chat/completions", env.gw.addr))
        .header("api-key", "nope");
    let (status, _, body) = env.send(req, CHAT).await;
    assert_eq!(status, 401);
    assert_eq!(json(&body)["error"]["code"], "invalid_api_key");
    let req = http::Request::post(format!("http://{}/v1/chat/completions", env.gw.addr));
    assert_eq!(env.send(req, CHAT).await.0, 401);
    assert_eq!(env.hits(), vec![0]);
}

#[tokio::test]
async fn oversized_body_gets_413_before_any_upstream_call() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    let big = format!(r#"{{"model":"gpt-4o","input":"{}"}}"#, "x".repeat(5000));
    let (status, _, body) = env.post("/v1/embeddings", &big).await;
    assert_eq!(status, 413);
    assert_eq!(json(&body)["error"]["code"], "request_too_large");
    assert_eq!(env.hits(), vec![0]);
}

#[tokio::test]
async fn unknown_model_and_bad_paths() {
    let mut p1 = b("p1", 1);
    p1.deployments = Some(r#"{ "gpt-4o" = "gpt4o-ptu" }"#);
    let env = Env::start(vec![p1], "").await;
    let (status, _, body) = env
        .post("/v1/chat/completions", r#"{"model":"gpt-5","messages":[]}"#)
        .await;
    assert_eq!(status, 404);
    let v = json(&body);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(
        !v.to_string().contains("127.0.0.1"),
        "no backend URLs in errors"
    );
    assert_eq!(env.azure_chat("gpt-5").await.0, 404);
    assert_eq!(
        env.post("/v1/chat/completions", r#"{"messages":[]}"#)
            .await
            .0,
        400
    );
    assert_eq!(
        env.post("/v1/chat/completions", r#"{"model":"#).await.0,
        400
    );
    assert_eq!(
        env.post("/openai/deployments/x/../../admin", CHAT).await.0,
        400
    );
    assert_eq!(env.post("/admin", CHAT).await.0, 404);
    assert_eq!(env.hits(), vec![0]);
    // GET /v1/models lists the configured models.
    let (status, _, body) = env.send(env.request("GET", "/v1/models", ""), "").await;
    assert_eq!(status, 200);
    assert_eq!(json(&body)["data"][0]["id"], "gpt-4o");
}

#[tokio::test]
async fn health_and_readiness() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    let get = |p: &str| http::Request::get(format!("http://{}{p}", env.gw.addr));
    assert_eq!(env.send(get("/healthz"), "").await.0, 200);
    let (s, _, body) = env.send(get("/readyz"), "").await;
    assert_eq!(s, 200);
    assert_eq!(json(&body)["backends"][0]["state"], "ready");
    env.mocks[0].push_script(vec![Reply::throttled(30)]);
    assert_eq!(env.chat().await.0, 429);
    // Still ready: the gateway answers (429 with Retry-After) even when every backend is
    // throttled; the throttled deployment shows in the body.
    let (s, _, body) = env.send(get("/readyz"), "").await;
    assert_eq!(s, 200);
    let v = json(&body);
    assert_eq!(v["ready"], true);
    // Its only deployment is cooling: nothing can serve right now.
    assert_eq!(v["any_backend_ready"], false);
    assert_eq!(v["backends"][0]["state"], "ready");
    let dep = &v["backends"][0]["deployments"][0];
    assert_eq!(dep["name"], "gpt-4o");
    assert_eq!(dep["state"], "cooling");
    assert_eq!(dep["reason"], "429");
    assert!(!v.to_string().contains("127.0.0.1"));
    // Draining (shutdown has begun): not ready, so load balancers stop sending.
    env.gw.app.start_draining();
    let (s, _, body) = env.send(get("/readyz"), "").await;
    assert_eq!(s, 503);
    assert_eq!(json(&body)["draining"], true);
}

// ---------------------------------------------------------------------------------------
// Shape translation
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn openai_shape_to_azure_backend_uses_the_deployment_name() {
    let mut p1 = b("ptu", 1);
    p1.deployments = Some(r#"{ "gpt-4o" = "gpt4o-ptu" }"#);
    let env = Env::start(vec![p1], "").await;
    // An OpenAI-shaped client, a classic Azure resource (the default): the deployment
    // path with the backend's api-version; the body goes as sent.
    let (status, _, body) = env.post("/v1/chat/completions?priority=low", CHAT).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let r = &env.mocks[0].requests()[0];
    assert_eq!(r.path, "/openai/deployments/gpt4o-ptu/chat/completions");
    assert_eq!(
        r.query.as_deref(),
        Some("api-version=2024-10-21"),
        "priority is consumed by the gateway"
    );
    assert_eq!(r.body_sha256, sha(CHAT.as_bytes()));
    // Azure classic client, same backend: deployment swapped in the path, body untouched.
    let (status, _, _) = env.azure_chat("gpt-4o").await;
    assert_eq!(status, 200);
    let r = &env.mocks[0].requests()[1];
    assert_eq!(r.path, "/openai/deployments/gpt4o-ptu/chat/completions");
    assert_eq!(r.query.as_deref(), Some("api-version=2024-10-21"));
    assert_eq!(r.body_sha256, sha(CHAT.as_bytes()));
}

#[tokio::test]
async fn openai_shape_to_a_v1_azure_backend_puts_the_deployment_in_the_body() {
    let mut p1 = b("ptu", 1);
    p1.deployments = Some("{ \"gpt-4o\" = \"gpt4o-ptu\" }\nazure_api = \"v1\"");
    let env = Env::start(vec![p1], "").await;
    let (status, _, _) = env.post("/v1/chat/completions", CHAT).await;
    assert_eq!(status, 200);
    let r = &env.mocks[0].requests()[0];
    assert_eq!(r.path, "/openai/v1/chat/completions");
    assert_eq!(r.query, None);
    assert_eq!(json(r.body.as_bytes())["model"], "gpt4o-ptu");
}

#[tokio::test]
async fn azure_shape_to_openai_backend_puts_the_model_in_the_body() {
    let mut p1 = b("vllm", 1);
    p1.kind = "openai";
    p1.deployments = Some(r#"{ "gpt-4o" = "llama-3.1-8b" }"#);
    let env = Env::start(vec![p1], "").await;
    let body = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, _) = env
        .post(
            "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            body,
        )
        .await;
    assert_eq!(status, 200);
    let r = &env.mocks[0].requests()[0];
    assert_eq!(r.path, "/v1/chat/completions");
    assert_eq!(
        r.query, None,
        "api-version means nothing to an OpenAI-compatible server"
    );
    let v = json(r.body.as_bytes());
    assert_eq!(v["model"], "llama-3.1-8b");
    assert_eq!(v["messages"][0]["content"], "hi");
}

#[tokio::test]
async fn a_failed_backend_is_not_retried_for_the_same_request_even_when_ready() {
    // `Retry-After: 0` makes p1 ready again at once; the request must still move on.
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    env.mocks[0].set_default(Some(Reply::status(429).with_header("retry-after", "0")));
    let (status, h, _) = env.chat().await;
    assert_eq!(status, 200);
    assert_eq!(header(&h, "x-spillgate-backend"), "p2");
    assert_eq!(header(&h, "x-spillgate-attempts"), "2");
    assert_eq!(env.hits(), vec![1, 1]);
    // A later request tries p1 again: its cooldown is over.
    assert_eq!(env.chat().await.0, 200);
    assert_eq!(env.hits(), vec![2, 2]);
}

#[tokio::test]
async fn client_disconnect_while_waiting_for_headers_cancels_the_upstream_request() {
    let logs = LogBuf::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let env = Env::start(vec![b("slow", 1)], "").await;
    env.mocks[0].push_script(vec![Reply::status(200).with_delay_ms(5_000)]);
    // A raw client that closes its socket once the backend has the request, as a browser
    // tab or a killed process does.
    let mut sock = tokio::net::TcpStream::connect(env.gw.addr).await.unwrap();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\napi-key: {CLIENT_KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHAT}",
        CHAT.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut sock, raw.as_bytes())
        .await
        .unwrap();
    for _ in 0..100 {
        if env.mocks[0].hits() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(env.mocks[0].hits(), 1);
    drop(sock);
    let mut seen = false;
    for _ in 0..100 {
        if String::from_utf8_lossy(&logs.0.lock().unwrap()).contains("client went away") {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        seen,
        "the gateway noticed the disconnect and dropped the upstream request"
    );
    // The backend saw its request abandoned: the connection closed before its answer,
    // which it would have sent 5 s after the request arrived.
    for _ in 0..250 {
        if env.mocks[0].requests_abandoned() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        env.mocks[0].requests_abandoned(),
        1,
        "the upstream request was cancelled, not left to finish"
    );
}

// ---------------------------------------------------------------------------------------
// Shutdown and client limits
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn shutdown_lets_streams_finish_and_refuses_new_connections() {
    let env = Env::start(vec![b("p1", 1)], "").await;
    env.mocks[0].push_script(vec![Reply::stream(10, 60)]);
    let mut body = open_stream(&env).await;
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    let addr = env.gw.addr;
    let app = Arc::clone(&env.gw.app);
    let Env { mocks, gw, client } = env;
    let shutdown = tokio::spawn(gw.shutdown());
    // Draining: readiness says so, and new connections are refused.
    for _ in 0..100 {
        if app.draining() && tokio::net::TcpStream::connect(addr).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(app.draining());
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "new connections refused"
    );
    // The stream in progress completes, [DONE] included.
    let mut text = String::from_utf8(first.to_vec()).unwrap();
    append_text(&mut body, &mut text).await;
    assert_eq!(text.matches("data: {").count(), 10);
    assert!(text.ends_with("data: [DONE]\n\n"));
    shutdown.await.unwrap();
    assert_eq!(mocks[0].streams_completed(), 1);
    drop(client);
}

#[tokio::test]
async fn a_client_that_trickles_its_body_gets_408() {
    let env = Env::start(vec![b("p1", 1)], "[timeouts]\nclient_body = \"300ms\"\n").await;
    let mut sock = tokio::net::TcpStream::connect(env.gw.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\napi-key: {CLIENT_KEY}\r\ncontent-length: 1000\r\n\r\n{{\"model\""
    );
    tokio::io::AsyncWriteExt::write_all(&mut sock, head.as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut sock, &mut buf),
    )
    .await
    .expect("answered within the body timeout")
    .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_body_timeout"), "{text}");
    assert_eq!(env.hits(), vec![0]);
}

/// A chat request as a client writes it on the wire, with the client key.
fn raw_chat() -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\napi-key: {CLIENT_KEY}\r\ncontent-length: {}\r\n\r\n{CHAT}",
        CHAT.len()
    )
}

#[tokio::test]
async fn connections_beyond_the_limit_wait_for_a_free_slot() {
    let env = Env::start_with_server(vec![b("p1", 1)], "max_connections = 1").await;
    let request = raw_chat();
    let read_head = |mut sock: tokio::net::TcpStream| async move {
        let mut buf = vec![0u8; 8192];
        let n = tokio::io::AsyncReadExt::read(&mut sock, &mut buf)
            .await
            .unwrap();
        (sock, String::from_utf8_lossy(&buf[..n]).to_string())
    };
    // Connection A is served and stays open (keep-alive).
    let mut a = tokio::net::TcpStream::connect(env.gw.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut a, request.as_bytes())
        .await
        .unwrap();
    let (a, text) = read_head(a).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // Connection B waits while A holds the only slot...
    let mut b_sock = tokio::net::TcpStream::connect(env.gw.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut b_sock, request.as_bytes())
        .await
        .unwrap();
    let waiting = tokio::spawn(read_head(b_sock));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "B must not be served while A holds the only slot"
    );
    assert_eq!(env.hits(), vec![1]);
    // ...and is served once A closes.
    drop(a);
    let (_, text) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .unwrap()
        .unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(env.hits(), vec![2]);
}

/// A gateway told to stop while a connection it accepted waits for a free slot stops:
/// the waiting connection is closed unanswered, the one holding the slot is closed once
/// idle, and the backend sees no request for the one that waited.
#[tokio::test]
async fn a_stop_while_a_connection_waits_for_a_slot_drains() {
    let env = Env::start_with_server(vec![b("p1", 1)], "max_connections = 1").await;
    let request = raw_chat();
    let send = |addr| {
        let request = request.clone();
        async move {
            let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
            tokio::io::AsyncWriteExt::write_all(&mut sock, request.as_bytes())
                .await
                .unwrap();
            sock
        }
    };
    let mut a = send(env.gw.addr).await;
    let mut buf = vec![0u8; 8192];
    let n = tokio::io::AsyncReadExt::read(&mut a, &mut buf)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let mut waiting = send(env.gw.addr).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let Env { mocks, gw, .. } = env;
    tokio::time::timeout(Duration::from_secs(10), gw.shutdown())
        .await
        .expect("the stop did not finish while a connection waited for a slot");
    // Each connection is closed by the gateway, within a bound, with nothing sent.
    for (sock, which) in [(&mut waiting, "waiting"), (&mut a, "idle")] {
        let n = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::io::AsyncReadExt::read(sock, &mut buf),
        )
        .await
        .unwrap_or_else(|_| panic!("the {which} connection was left open"))
        .unwrap_or(0);
        assert_eq!(n, 0, "{which}: {}", String::from_utf8_lossy(&buf[..n]));
    }
    assert_eq!(mocks[0].hits(), 1);
}

// ---------------------------------------------------------------------------------------
// Request priority over real HTTP
// ---------------------------------------------------------------------------------------

const PRIORITY: &str = "[priority]\n[[priority.models]]\nmodels = [\"gpt-4o\"]\nlow_priority_tpm_threshold = 100\nlow_priority_rp10s_threshold = 5\n";

#[tokio::test]
async fn low_priority_is_refused_from_the_backends_rate_limit_headers() {
    // 60 RPM over 10 s windows: 10 requests per window; 5 are kept for high priority.
    let mock = MockBackend::start(MockConfig {
        name: "ptu".into(),
        expect_api_key: Some(BACKEND_KEYS[0].into()),
        limits: Some(spillgate_mock::Limits {
            rpm: 60,
            tpm: 600_000,
            window: Duration::from_secs(10),
        }),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let env = Env::start_with(vec![b("ptu", 1)], vec![mock], "", PRIORITY).await;
    let low = || env.request("POST", "/v1/chat/completions?priority=low", CHAT);
    let mut served = 0;
    let mut refusal = None;
    for _ in 0..10 {
        let (status, h, body) = env.send(low(), CHAT).await;
        if status == 200 {
            served += 1;
        } else {
            refusal = Some((status, h, body));
            break;
        }
    }
    let (status, h, body) = refusal.expect("refused once the reserve is reached");
    assert_eq!(status, 429);
    assert_eq!(json(&body)["error"]["code"], "low_priority_refused");
    assert!(header(&h, "retry-after").parse::<u64>().unwrap() >= 1);
    assert!(
        (4..=5).contains(&served),
        "{served} low-priority requests before the reserve"
    );
    // The gateway refused it: the backend never saw it, and high priority still goes.
    assert_eq!(env.mocks[0].hits(), served as u64);
    assert_eq!(env.mocks[0].hits_429(), 0);
    let (status, _, _) = env.chat().await;
    assert_eq!(status, 200);
    // The priority parameter and header are the gateway's: never forwarded.
    for r in env.mocks[0].requests() {
        assert_eq!(r.query.as_deref(), Some("api-version=2024-10-21"));
        assert_eq!(r.header("x-priority"), None);
    }
}

#[tokio::test]
async fn stream_usage_is_requested_and_removed_when_the_client_did_not_ask() {
    let env = Env::start(vec![b("ptu", 1)], PRIORITY).await;
    let stream = r#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, body) = env.post("/v1/chat/completions", stream).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        !text.contains("\"usage\""),
        "no usage chunk the client did not ask for: {text}"
    );
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(text.matches("data: {").count(), 5);
    let sent = json(env.mocks[0].requests()[0].body.as_bytes());
    assert_eq!(
        sent["stream_options"]["include_usage"], true,
        "the gateway asked the backend"
    );
    // A client that asks gets it, unchanged.
    let asked =
        r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#;
    let (_, _, body) = env.post("/v1/chat/completions", asked).await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert_eq!(text.matches("\"usage\"").count(), 1, "{text}");
    assert_eq!(
        env.mocks[0].requests()[1].body,
        asked,
        "body forwarded as sent"
    );
}

// ---------------------------------------------------------------------------------------
// Operating it: reload, admin state, request ids
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn reload_under_load_keeps_state_and_loses_nothing() {
    let env = Env::start(vec![b("p1", 1), b("p2", 1)], "").await;
    // p1 is cooling before the reload; the cooldown must survive it.
    env.mocks[0].push_script(vec![Reply::throttled(60)]);
    while env.mocks[0].hits() == 0 {
        assert_eq!(env.chat().await.0, 200);
    }
    let app = Arc::clone(&env.gw.app);
    let now = app.clock.now_ms();
    assert!(app.snapshot.load().backends[0]
        .cooldown_for("gpt-4o", now)
        .is_some());

    // Load runs, sequentially and without pause, from before the reload to well after it.
    let addr = env.gw.addr;
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (done, stop) = (Arc::clone(&done), Arc::clone(&stop));
        tokio::spawn(async move {
            let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
            let mut statuses = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
                    .header("api-key", CLIENT_KEY)
                    .body(Full::new(Bytes::from_static(CHAT.as_bytes())))
                    .unwrap();
                let resp = client.request(req).await.unwrap();
                statuses.push(resp.status().as_u16());
                let _ = resp.into_body().collect().await;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            statuses
        })
    };
    let wait_for = |n: u64| {
        let done = Arc::clone(&done);
        async move {
            while done.load(std::sync::atomic::Ordering::Relaxed) < n {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    wait_for(20).await;
    // New weights and a new backend p3.
    let p3 = MockBackend::start(MockConfig {
        name: "p3".into(),
        expect_api_key: Some(BACKEND_KEYS[2].into()),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let mut b2 = b("p2", 1);
    b2.weight = 3;
    let new_backends = vec![b("p1", 1), b2, b("p3", 1)];
    let urls = vec![env.mocks[0].url(), env.mocks[1].url(), p3.url()];
    let config = config_at(&new_backends, &urls, "", "");
    let before = done.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(spillgate::reload::apply_config(&app, config).unwrap(), 2);
    // p1 cools, p2 has 3/4 of the rest and p3 1/4: 80 requests leave p3 empty-handed
    // with probability 0.75^80.
    wait_for(before + 80).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses = load.await.unwrap();
    assert!(
        statuses.iter().all(|s| *s == 200),
        "no request failed across the reload: {statuses:?}"
    );
    assert!(p3.hits() > 0, "the new backend takes traffic");
    let snap = app.snapshot.load();
    assert_eq!(snap.version, 2);
    assert_eq!(snap.backends[1].cfg.weight, 3);
    assert!(
        snap.backends[0]
            .cooldown_for("gpt-4o", app.clock.now_ms())
            .is_some(),
        "p1's cooldown survived the reload"
    );
    // An invalid config is refused and the running one stays.
    let dir = std::env::temp_dir().join(format!("spillgate-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(
        &path,
        "[auth]\nmode = \"none\"\n[[backends]]\nname = \"x\"\nkind = \"openai\"\nurl = \"http://127.0.0.1:1/v1\"\npriority = 0\n",
    )
    .unwrap();
    let err = spillgate::reload::apply_file(&app, &path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("backends[0].priority: must be >= 1, got 0"),
        "{err}"
    );
    assert_eq!(app.snapshot.load().version, 2);
    assert_eq!(env.chat().await.0, 200);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_config_file_is_watched_and_a_bad_edit_is_reported_once() {
    let logs = LogBuf::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let mock = MockBackend::start(MockConfig::named("p1")).await.unwrap();
    let dir = std::env::temp_dir().join(format!("spillgate-watch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("client"), CLIENT_KEY).unwrap();
    std::fs::write(dir.join("backend"), "k").unwrap();
    let text = |weight: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[auth]\nclient_keys = [\"file:{}\"]\n[[backends]]\nname = \"p1\"\nkind = \"azure\"\nurl = \"{}\"\napi_key = \"file:{}\"\nweight = {weight}\n",
            dir.join("client").display(),
            mock.url(),
            dir.join("backend").display()
        )
    };
    let path = dir.join("spillgate.toml");
    std::fs::write(&path, text("1")).unwrap();
    let app = App::new(spillgate::load_config(&std::fs::read_to_string(&path).unwrap()).unwrap())
        .unwrap();
    spillgate::reload::spawn(&app, path.clone(), Duration::from_millis(20), None);
    std::fs::write(&path, text("5")).unwrap();
    let mut version = 1;
    for _ in 0..200 {
        version = app.snapshot.load().version;
        if version == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(version, 2, "the edit took effect");
    assert_eq!(app.snapshot.load().backends[0].cfg.weight, 5);
    // A bad edit: refused, logged once however many times the file is checked.
    std::fs::write(&path, text("0")).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(app.snapshot.load().version, 2);
    let log = String::from_utf8_lossy(&logs.0.lock().unwrap()).to_string();
    assert_eq!(log.matches("config change refused").count(), 1, "{log}");
    assert!(
        log.contains("backends[0].weight: must be >= 1, got 0"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn admin_state_shows_backends_versions_and_needs_its_token() {
    let env = Env::start(vec![b("p1", 1), b("p2", 2)], "").await;
    env.mocks[0].push_script(vec![Reply::throttled(30)]);
    assert_eq!(env.chat().await.0, 200);
    let app = Arc::clone(&env.gw.app);
    let get = |token: Option<&str>| {
        let mut req = http::Request::get("/admin/state");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let router = spillgate::admin::router(Arc::clone(&app));
        async move {
            let resp =
                tower::ServiceExt::oneshot(router, req.body(axum::body::Body::empty()).unwrap())
                    .await
                    .unwrap();
            let status = resp.status();
            (status, resp.into_body().collect().await.unwrap().to_bytes())
        }
    };
    let (status, body) = get(None).await;
    assert_eq!(status, 200);
    let v = json(&body);
    assert_eq!(v["config"]["version"], 1);
    assert_eq!(v["backends"][0]["name"], "p1");
    assert_eq!(v["backends"][0]["priority"], 1);
    assert_eq!(v["backends"][0]["deployments"][0]["state"], "cooling");
    assert_eq!(v["backends"][0]["deployments"][0]["reason"], "429");
    assert_eq!(v["backends"][0]["deployments"][0]["last_status"], 429);
    assert_eq!(v["backends"][1]["deployments"][0]["last_status"], 200);
    assert_eq!(v["routes"][0]["tiers"][1]["backends"][0]["name"], "p2");
    assert!(!v.to_string().contains(BACKEND_KEYS[0]));
    // With a token configured (at start: [admin] is read once), it is required, on
    // /metrics too, and a reload cannot take it away from a running listener.
    let mut with_token = app.snapshot.load_full().config.clone();
    with_token.admin.token = Some(spillgate_core::config::Secret::new("admin-secret".into()));
    let guarded = App::new(with_token.clone()).unwrap();
    let get2 = |path: &'static str, token: Option<&'static str>| {
        let router = spillgate::admin::router(Arc::clone(&guarded));
        async move {
            let mut req = http::Request::get(path);
            if let Some(t) = token {
                req = req.header("authorization", format!("bearer {t}"));
            }
            let resp =
                tower::ServiceExt::oneshot(router, req.body(axum::body::Body::empty()).unwrap())
                    .await
                    .unwrap();
            resp.status()
        }
    };
    assert_eq!(get2("/admin/state", None).await, 401);
    assert_eq!(get2("/metrics", Some("wrong")).await, 401);
    assert_eq!(get2("/admin/state", Some("admin-secret")).await, 200);
    assert_eq!(get2("/metrics", Some("admin-secret")).await, 200);
    let router = spillgate::admin::router(Arc::clone(&guarded));
    let mut without = with_token;
    without.admin.token = None;
    spillgate::reload::apply_config(&guarded, without).unwrap();
    let resp = tower::ServiceExt::oneshot(
        router,
        http::Request::get("/admin/state")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 401, "the running listener keeps its token");
    let _ = get;
}

#[tokio::test]
async fn every_response_carries_a_request_id_that_the_log_lines_share() {
    let logs = LogBuf::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let env = Env::start(vec![b("p1", 1)], "").await;
    let (_, h, _) = env.chat().await;
    let generated = header(&h, "x-request-id").to_string();
    assert_eq!(generated.len(), 16);
    let req = env
        .request("POST", "/v1/chat/completions", CHAT)
        .header("x-request-id", "client-abc.123");
    let (_, h, _) = env.send(req, CHAT).await;
    assert_eq!(
        header(&h, "x-request-id"),
        "client-abc.123",
        "a sane client id is kept"
    );
    // The backend got the same id, once.
    let sent = env.mocks[0].requests();
    assert_eq!(sent[0].header("x-request-id"), Some(generated.as_str()));
    assert_eq!(sent[1].header("x-request-id"), Some("client-abc.123"));
    assert_eq!(
        sent[1]
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("x-request-id"))
            .count(),
        1,
        "{:?}",
        sent[1].headers
    );
    let req = env
        .request("POST", "/v1/chat/completions", CHAT)
        .header("x-request-id", "bad id\twith spaces");
    let (_, h, _) = env.send(req, CHAT).await;
    let replaced = header(&h, "x-request-id");
    assert_ne!(replaced, "bad id\twith spaces");
    // Replaced by a generated id, not dropped.
    assert_eq!(replaced.len(), 16, "{replaced:?}");
    assert!(
        replaced.bytes().all(|b| b.is_ascii_hexdigit()),
        "{replaced:?}"
    );
    let log = String::from_utf8_lossy(&logs.0.lock().unwrap()).to_string();
    assert!(log.contains(&format!("request_id={generated}")), "{log}");
    assert!(log.contains("request_id=client-abc.123"), "{log}");
}

#[tokio::test]
async fn during_the_shutdown_delay_readyz_says_503_before_connections_are_refused() {
    let env = Env::start_with_server(vec![b("p1", 1)], "shutdown_delay = \"400ms\"").await;
    let addr = env.gw.addr;
    let Env { mocks, gw, client } = env;
    let shutdown = tokio::spawn(gw.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Still accepting, and saying it is going away.
    let resp = client
        .request(
            http::Request::get(format!("http://{addr}/readyz"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    shutdown.await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "refused after the delay"
    );
    drop(mocks);
}

/// `timeouts.idle` bounds the silence between two chunks of a response body, not its
/// length: a stream whose chunks come closer than that runs to its end, one that stalls
/// longer is cut after the chunks it had.
#[tokio::test]
async fn the_idle_timeout_cuts_a_stalled_stream_and_spares_a_long_one() {
    let stream = r#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    // 6 chunks 500 ms apart: about 3 s, three times the longer idle time.
    for (idle, complete) in [("1s", true), ("150ms", false)] {
        let mock = MockBackend::start(MockConfig {
            name: "p1".into(),
            expect_api_key: Some(BACKEND_KEYS[0].into()),
            stream_chunks: 6,
            chunk_interval: Duration::from_millis(500),
            ..MockConfig::default()
        })
        .await
        .unwrap();
        let extra = format!("[timeouts]\nidle = \"{idle}\"\n");
        let env = Env::start_with(vec![b("p1", 1)], vec![mock], "", &extra).await;
        let resp = env
            .client
            .request(
                env.request("POST", "/v1/chat/completions", stream)
                    .body(Full::new(Bytes::from(stream)))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "idle {idle}");
        let mut body = resp.into_body();
        let (mut got, mut failed) = (Vec::new(), false);
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => got.extend_from_slice(f.data_ref().map_or(&[][..], |d| &d[..])),
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        let text = String::from_utf8_lossy(&got);
        let done = text.contains("data: [DONE]");
        assert_eq!((done, failed), (complete, !complete), "idle {idle}: {text}");
        // The chunks that came before the silence reached the client.
        assert!(text.starts_with("data: {"), "idle {idle}: {text}");
    }
}

/// Tokens are counted per backend and per client key: each key's requests in its own series.
#[tokio::test]
async fn tokens_are_counted_per_client_key() {
    let mock = MockBackend::start(MockConfig::named("m")).await.unwrap();
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[admin]\nenabled = false\n[auth]\nclient_keys = [\"env:TEAM_A\", \"env:TEAM_B\"]\n\
         [[backends]]\nname = \"m\"\nkind = \"azure\"\nurl = \"{}\"\napi_key = \"env:K\"\n",
        mock.url()
    );
    let config = spillgate_core::config::load(&text, &|v| Some(format!("key-of-{v}")), &|_| {
        Err("no files".into())
    })
    .unwrap();
    let gw = start(App::new(config).unwrap()).await.unwrap();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    for key in ["key-of-TEAM_A", "key-of-TEAM_B", "key-of-TEAM_A"] {
        let req = http::Request::post(format!(
            "http://{}/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            gw.addr
        ))
        .header("api-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(CHAT.as_bytes())))
        .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.into_body().collect().await.unwrap();
    }
    let metrics = gw.app.metrics.render(&gw.app);
    let tokens = |client: &str| -> f64 {
        let prefix = format!("spillgate_tokens_total{{backend=\"m\",client=\"{client}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no series for {client}:\n{metrics}"))
            .parse()
            .unwrap()
    };
    let (a, b) = (tokens("TEAM_A"), tokens("TEAM_B"));
    assert!(b > 0.0, "{metrics}");
    assert_eq!(a, 2.0 * b, "same requests, twice as many from A");
}

/// A backend in memory whose JSON answer (`body`: [`ANSWER`] has a usage of 12 tokens)
/// comes as one frame, or split in two frames.
struct Answers {
    split: bool,
    body: &'static str,
}

const ANSWER: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}"#;

impl spillgate::upstream::Upstream for Answers {
    fn send<'a>(
        &'a self,
        _: spillgate::upstream::UpstreamRequest<'a>,
        _: Duration,
    ) -> futures_util::future::BoxFuture<
        'a,
        Result<http::Response<axum::body::Body>, spillgate::upstream::AttemptError>,
    > {
        let body = if self.split {
            let (a, b) = self.body.split_at(30);
            let frames = [a, b].map(|p| {
                Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from_static(
                    p.as_bytes(),
                )))
            });
            axum::body::Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
                frames,
            )))
        } else {
            axum::body::Body::from(self.body)
        };
        let resp = http::Response::builder()
            .header("content-type", "application/json")
            .body(body)
            .unwrap();
        Box::pin(async move { Ok(resp) })
    }
}

/// An answer that is all there when its head comes is settled at once: its tokens and its
/// duration are counted before the client has read any of it. One that is not, when the
/// client has read it all. Either way the client gets the whole body, and each is
/// counted once.
#[tokio::test]
async fn an_answer_that_came_whole_is_settled_before_the_client_reads_it() {
    for split in [false, true] {
        let answers = Answers {
            split,
            body: ANSWER,
        };
        let (app, resp) = answered_in_memory(answers).await;
        let counted = || tokens_of(&app, "mem") == Some(12);
        // The requests whose duration was observed (none before the first).
        let timed = || -> u64 {
            app.metrics
                .render(&app)
                .lines()
                .find_map(|l| {
                    l.strip_prefix("spillgate_request_duration_seconds_count{priority=\"high\"} ")
                })
                .map_or(0, |v| v.parse().unwrap())
        };
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(
            counted(),
            !split,
            "split {split}: counted before the body is read"
        );
        assert_eq!(
            timed(),
            u64::from(!split),
            "split {split}: timed before the body is read"
        );
        assert_eq!(
            resp.into_body().collect().await.unwrap().to_bytes(),
            ANSWER.as_bytes()
        );
        assert!(counted(), "split {split}: counted once the body is read");
        assert_eq!(
            timed(),
            1,
            "split {split}: timed once, when the body is read"
        );
    }
}

/// A whole answer without a usage still shows its backend's and client's token series, at
/// 0, as a stream's does: a dashboard has the series from the first answer.
#[tokio::test]
async fn a_whole_answer_without_usage_shows_its_token_series_at_zero() {
    let answers = Answers {
        split: false,
        body: r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[]}"#,
    };
    let (app, resp) = answered_in_memory(answers).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        tokens_of(&app, "mem"),
        Some(0),
        "{}",
        app.metrics.render(&app)
    );
}

/// The value of `backend`'s token series in `app`'s metrics (its first client's), if
/// there is one.
fn tokens_of(app: &App, backend: &str) -> Option<u64> {
    let prefix = format!("spillgate_tokens_total{{backend=\"{backend}\",");
    app.metrics
        .render(app)
        .lines()
        .find(|l| l.starts_with(&prefix))?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()
}

/// A gateway whose one backend, `mem`, is `answers`, and its answer to one chat request
/// (the body not read yet).
async fn answered_in_memory(answers: Answers) -> (Arc<App>, axum::response::Response) {
    use tower::ServiceExt;
    let text = "[admin]\nenabled = false\n[auth]\nmode = \"none\"\n\
        [[backends]]\nname = \"mem\"\nkind = \"openai\"\nurl = \"http://mem.test/v1\"\n";
    let config =
        spillgate_core::config::load(text, &|_| None, &|_| Err("no files".into())).unwrap();
    let app = App::with_upstream(config, Arc::new(answers)).unwrap();
    let req = http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(CHAT))
        .unwrap();
    let resp = spillgate::server::router(Arc::clone(&app))
        .oneshot(req)
        .await
        .unwrap()
        .into_response();
    (app, resp)
}

/// A JSON answer whose body comes in two writes: its first part reaches the client before
/// the rest is sent (nothing waits for the whole body), the client gets it all with its
/// length, and its usage is counted as for a body that came whole with its head.
#[tokio::test]
async fn a_json_body_in_pieces_is_passed_on_as_it_comes_and_its_usage_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let body = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}"#;
    let (first, rest) = body.split_at(40);
    let (go_on, rest_may_go) = tokio::sync::oneshot::channel::<()>();
    let backend = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        // The request's head and body: read until the body's last byte.
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"}") {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request came whole");
            got.extend_from_slice(&buf[..n]);
        }
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{first}",
            body.len()
        );
        sock.write_all(head.as_bytes()).await.unwrap();
        rest_may_go.await.unwrap();
        sock.write_all(rest.as_bytes()).await.unwrap();
    });
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[admin]\nenabled = false\n[auth]\nmode = \"none\"\n\
         [[backends]]\nname = \"raw\"\nkind = \"openai\"\nurl = \"http://127.0.0.1:{port}/v1\"\n"
    );
    let config =
        spillgate_core::config::load(&text, &|_| None, &|_| Err("no files".into())).unwrap();
    let gw = start(App::new(config).unwrap()).await.unwrap();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("http://{}/v1/chat/completions", gw.addr))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(CHAT.as_bytes())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()["content-length"],
        body.len().to_string().as_str()
    );
    let mut resp_body = resp.into_body();
    let mut part = Vec::new();
    while part.len() < first.len() {
        let frame = tokio::time::timeout(Duration::from_secs(10), resp_body.frame())
            .await
            .expect("the first part is passed on before the rest is sent")
            .unwrap()
            .unwrap();
        if let Ok(data) = frame.into_data() {
            part.extend_from_slice(&data);
        }
    }
    assert_eq!(&part[..], first.as_bytes());
    go_on.send(()).unwrap();
    let all = resp_body.collect().await.unwrap().to_bytes();
    assert_eq!([&part[..], &all[..]].concat(), body.as_bytes());
    backend.await.unwrap();
    // Counted when the gateway lets go of the body, which may be just after the client
    // has its last byte.
    let counted = || tokens_of(&gw.app, "raw") == Some(12);
    for _ in 0..100 {
        if counted() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(counted(), "{}", gw.app.metrics.render(&gw.app));
}
