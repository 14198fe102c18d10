//! Several gateway instances sharing backend state through a real `redis-server` (started
//! by each test on a free loopback port, persistence off, killed at the end): a cooldown
//! one instance learns spares the backend on the others, capacity and retry budgets are
//! shared, a recovering backend gets one probe cluster-wide, bad values in Redis are not
//! trusted, and Redis dying or missing never costs a request.
//!
//! Without `redis-server` installed each test says SKIPPED and passes; `./test.sh`
//! installs it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed setup step should abort the test loudly"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use spillgate::app::App;
use spillgate::server::{start, Running};
use spillgate_core::outcome::CoolReason;
use spillgate_mock::{Limits, MockBackend, MockConfig, RedisServer, Reply};

const CLIENT_KEY: &str = "client-key-shared-state";
const MODEL: &str = "gpt-4o";
const CHAT: &str =
    r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":10}"#;

macro_rules! redis_or_skip {
    ($e:expr) => {
        match $e {
            Some(r) => r,
            None => {
                eprintln!("SKIPPED: redis-server is not installed (./test.sh installs it)");
                return;
            }
        }
    };
}

async fn mock(name: &str) -> MockBackend {
    MockBackend::start(MockConfig::named(name)).await.unwrap()
}

/// A gateway config: `backends` as (name, priority) served by `mocks` (in order), each
/// with a `deployments` map for the test's model, the shared state at `redis_url`, and
/// `extra` TOML.
fn config(
    backends: &[(&str, u32)],
    mocks: &[&MockBackend],
    redis_url: Option<&str>,
    extra: &str,
) -> spillgate_core::config::Config {
    config_with(backends, mocks, redis_url, extra, true)
}

/// [`config`], with or without `deployments` maps (without, a backend learns its
/// deployments from requests, and from Redis).
fn config_with(
    backends: &[(&str, u32)],
    mocks: &[&MockBackend],
    redis_url: Option<&str>,
    extra: &str,
    mapped: bool,
) -> spillgate_core::config::Config {
    let mut text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[auth]\nclient_keys = [\"env:CLIENT\"]\n[admin]\nenabled = false\n{extra}\n"
    );
    if let Some(url) = redis_url {
        // The most request-path timeout a config may set (the machine running the tests
        // is shared), unless the test sets its own.
        let timeout = if extra.contains("# default timeout") {
            String::new()
        } else {
            "timeout = \"100ms\"\n".to_string()
        };
        text.push_str(&format!(
            "[state]\nredis_url = \"{url}\"\n{timeout}poll = \"200ms\"\n"
        ));
    }
    for ((name, priority), m) in backends.iter().zip(mocks) {
        text.push_str(&format!(
            "[[backends]]\nname = \"{name}\"\nkind = \"azure\"\nurl = \"{}\"\npriority = {priority}\napi_key = \"env:BACKEND\"\n",
            m.url()
        ));
        if mapped {
            text.push_str(&format!("deployments = {{ \"{MODEL}\" = \"{MODEL}\" }}\n"));
        }
    }
    spillgate_core::config::load(
        &text,
        &|v| match v {
            "CLIENT" => Some(CLIENT_KEY.to_string()),
            "BACKEND" => Some("backend-key".to_string()),
            _ => None,
        },
        &|_| Err("no files".into()),
    )
    .unwrap_or_else(|e| panic!("config: {e}\n{text}"))
}

async fn gateway(config: spillgate_core::config::Config) -> Running {
    start(App::new(config).unwrap()).await.unwrap()
}

/// `config` with a request-path timeout beyond what a config file may set: for tests
/// where a claim must not time out on a loaded machine, or must take a measurable time.
fn with_timeout(
    mut config: spillgate_core::config::Config,
    timeout: Duration,
) -> spillgate_core::config::Config {
    config.state.as_mut().unwrap().timeout = timeout;
    config
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn chat_with(
    client: &Client<HttpConnector, Full<Bytes>>,
    gw: &Running,
    low: bool,
) -> (StatusCode, HeaderMap, Bytes) {
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{}/v1/chat/completions", gw.addr))
        .header("content-type", "application/json")
        .header("api-key", CLIENT_KEY);
    if low {
        req = req.header("x-priority", "low");
    }
    let resp = client
        .request(
            req.body(Full::new(Bytes::from_static(CHAT.as_bytes())))
                .unwrap(),
        )
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

async fn chat(
    client: &Client<HttpConnector, Full<Bytes>>,
    gw: &Running,
) -> (StatusCode, HeaderMap, Bytes) {
    chat_with(client, gw, false).await
}

fn served_by(h: &HeaderMap) -> &str {
    h.get("x-spillgate-backend")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
}

/// Polls `f` every 10 ms until it holds or `limit` passes; returns how long it took.
async fn wait_for(what: &str, limit: Duration, f: impl Fn() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    t0.elapsed()
}

fn connected(gw: &Running) -> bool {
    gw.app.store.status().connected == Some(true)
}

async fn wait_connected(gws: &[&Running]) -> Duration {
    wait_for(
        "gateways connected to Redis",
        Duration::from_secs(10),
        || gws.iter().all(|g| connected(g)),
    )
    .await
}

/// The cooldown gateway `gw` knows for `backend` serving the test's model (the resource's
/// or the deployment's, whichever ends later).
fn cooling(gw: &Running, backend: usize) -> Option<spillgate_core::outcome::Cooldown> {
    let snap = gw.app.snapshot.load();
    snap.backends[backend].cooldown_for(MODEL, gw.app.clock.now_ms())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooldown_seen_by_one_instance_spares_the_backend_on_another() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let (x, y) = (mock("x").await, mock("y").await);
    let backends = [("x", 1), ("y", 2)];
    let a = gateway(config(&backends, &[&x, &y], Some(&redis.url()), "")).await;
    let b = gateway(config(&backends, &[&x, &y], Some(&redis.url()), "")).await;
    wait_connected(&[&a, &b]).await;
    let c = client();

    x.push_script(vec![Reply::throttled(20)]);
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(served_by(&h), "y", "A fails over at once");
    assert_eq!(x.hits(), 1);
    let on_a = cooling(&a, 0).expect("A cools x");
    assert_eq!(on_a.reason, CoolReason::Throttled);

    let took = wait_for("B learns x's cooldown", Duration::from_secs(2), || {
        cooling(&b, 0).is_some()
    })
    .await;
    println!("B saw A's cooldown after {} ms", took.as_millis());
    assert_eq!(cooling(&b, 0), Some(on_a), "the same deadline and reason");

    for _ in 0..100 {
        let (status, h, _) = chat(&c, &b).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(served_by(&h), "y");
    }
    assert_eq!(x.hits(), 1, "B sent nothing to the throttled backend");
    assert_eq!(y.hits(), 101);
    let st = b.app.store.status();
    assert!(st.received >= 1, "{st:?}");
    assert_eq!(st.rejected, 0, "{st:?}");
    // The store's counts are Prometheus counters.
    let metrics = b.app.metrics.render(&b.app);
    assert!(
        metrics.contains("# TYPE spillgate_state_store_operations counter"),
        "{metrics}"
    );
    let received = format!(
        "spillgate_state_store_operations_total{{store=\"redis\",kind=\"received\"}} {}",
        st.received
    );
    assert!(metrics.contains(&received), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn low_priority_on_one_instance_uses_the_capacity_another_observed() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let (x, y) = (mock("x").await, mock("y").await);
    let backends = [("x", 1), ("y", 2)];
    let priority = "[priority]\ndefault_max_tokens = 10\n[[priority.models]]\nmodels = [\"*\"]\nlow_priority_tpm_threshold = 5000\nlow_priority_rp10s_threshold = 5\n";
    let a = gateway(config(&backends, &[&x, &y], Some(&redis.url()), priority)).await;
    let b = gateway(config(&backends, &[&x, &y], Some(&redis.url()), priority)).await;
    wait_connected(&[&a, &b]).await;
    let c = client();

    // A high-priority request through A: x says it has little left (below the reserve).
    x.push_script(vec![Reply::status(200)
        .with_header("x-ratelimit-remaining-tokens", "1000")
        .with_header("x-ratelimit-limit-tokens", "60000")
        .with_header("x-ratelimit-remaining-requests", "3")]);
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "x"));

    let dep = |gw: &Running| {
        gw.app.snapshot.load().backends[0]
            .deployment_state(MODEL)
            .unwrap()
            .capacity()
    };
    let took = wait_for("B learns x's capacity", Duration::from_secs(2), || {
        dep(&b).observed_ms.is_some()
    })
    .await;
    println!(
        "B saw A's capacity observation after {} ms",
        took.as_millis()
    );
    assert_eq!(dep(&b).tokens.map(|t| t.remaining), Some(1000));

    // Low priority through B: x's spare capacity is below the reserve, so it spills to y
    // without touching x.
    for _ in 0..5 {
        let (status, h, _) = chat_with(&c, &b, true).await;
        assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    }
    assert_eq!(x.hits(), 1, "B kept low priority off x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovering_backend_gets_one_probe_across_instances() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let (x, y) = (mock("x").await, mock("y").await);
    let backends = [("x", 1), ("y", 2)];
    let extra = "[circuit_breaker]\nfailures = 1\nwindow = \"10s\"\ntrip = \"1s\"\ncondition = [\"500-599\"]\n[cooldown]\ndefault_5xx = \"1s\"\n";
    // A claim that timed out would be decided locally (a second probe): 1 s is never
    // reached, even on a loaded machine.
    let cfg = || {
        with_timeout(
            config(&backends, &[&x, &y], Some(&redis.url()), extra),
            Duration::from_secs(1),
        )
    };
    let a = gateway(cfg()).await;
    // B serves its connections on per-core threads, as the binary does: its probe claims
    // run there, while its Redis connection lives on the main runtime.
    let b = spillgate::server::start_on(
        App::new(cfg()).unwrap(),
        Some(spillgate::server::ConnectionThreads::start(2).unwrap()),
    )
    .await
    .unwrap();
    wait_connected(&[&a, &b]).await;
    let c = client();

    // Through A, x fails: its breaker trips (and the deployment cools).
    x.push_script(vec![Reply::status(500)]);
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    let tripped = |gw: &Running| {
        gw.app.snapshot.load().backends[0]
            .state
            .cooldown(gw.app.clock.now_ms())
            .is_some_and(|c| c.reason == CoolReason::Tripped)
    };
    assert!(tripped(&a));
    wait_for("B learns the trip", Duration::from_secs(2), || tripped(&b)).await;

    // The trip ends on both (same deadline).
    wait_for("the trip ends", Duration::from_secs(5), || {
        cooling(&a, 0).is_none() && cooling(&b, 0).is_none()
    })
    .await;
    assert!(b.app.snapshot.load().backends[0].state.is_recovering());

    // Concurrent traffic through both instances while the probe is in flight (x takes
    // 800 ms to answer it): x sees exactly one request.
    x.push_script(vec![Reply::status(200).with_delay_ms(800)]);
    let before = x.hits();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let c = c.clone();
        let addr = if i % 2 == 0 { a.addr } else { b.addr };
        tasks.push(tokio::spawn(async move {
            let req = http::Request::builder()
                .method("POST")
                .uri(format!("http://{addr}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("api-key", CLIENT_KEY)
                .body(Full::new(Bytes::from_static(CHAT.as_bytes())))
                .unwrap();
            let resp = c.request(req).await.unwrap();
            let backend = served_by(resp.headers()).to_string();
            (resp.status(), backend)
        }));
    }
    let mut by_x = 0;
    for t in tasks {
        let (status, backend) = t.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        by_x += usize::from(backend == "x");
    }
    assert_eq!(x.hits() - before, 1, "one probe across both instances");
    assert_eq!(by_x, 1);

    // The probe answered well: both instances take x back fully.
    wait_for("B learns the recovery", Duration::from_secs(2), || {
        !b.app.snapshot.load().backends[0].state.is_recovering()
    })
    .await;
    let (status, h, _) = chat(&c, &b).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "x"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_is_the_clusters() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let (x, y) = (mock("x").await, mock("y").await);
    x.set_default(Some(Reply::status(500)));
    let backends = [("x", 1), ("y", 2)];
    // 5 retries in 5 s for the whole cluster; x fails every time but is never cooled, so
    // every request pays one retry to reach y.
    let extra = "[retry]\nbudget = { ratio = 0.0, min_per_second = 1, window = \"5s\" }\n[cooldown]\non = []\n";
    let a = gateway(config(&backends, &[&x, &y], Some(&redis.url()), extra)).await;
    let b = gateway(config(&backends, &[&x, &y], Some(&redis.url()), extra)).await;
    wait_connected(&[&a, &b]).await;
    let c = client();
    for _ in 0..5 {
        let (status, h, _) = chat(&c, &a).await;
        assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    }
    let retries_seen_by_b = || {
        let snap = b.app.snapshot.load();
        let st = snap.routes[0]
            .budget
            .lock()
            .unwrap()
            .state(b.app.clock.now_ms());
        st.retries
    };
    wait_for("B learns A's retries", Duration::from_secs(3), || {
        retries_seen_by_b() >= 5
    })
    .await;
    let (status, _, body) = chat(&c, &b).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("retry_budget_exhausted"), "{body}");
    assert!(body.contains("5 retries used of 5 allowed"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_in_redis_are_bounded_not_trusted() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let now_ms = spillgate_core::outcome::unix_ms(std::time::SystemTime::now());
    let ten_years = now_ms + 10 * 365 * 24 * 3_600_000;
    for args in [
        // A deadline ten years ahead on x, garbage on y, a capacity that is not one on z,
        // a deadline no integer can hold on w.
        vec![
            "SET".to_string(),
            format!("spillgate:cool:x/{MODEL}"),
            format!("{ten_years}:429"),
        ],
        vec![
            "SET".to_string(),
            "spillgate:cool:y".to_string(),
            "banana".to_string(),
        ],
        vec![
            "SET".to_string(),
            format!("spillgate:cap:z/{MODEL}"),
            // Observed now, so only the refusal of its counters can keep it out.
            format!("{now_ms};-1,2,3;x"),
        ],
        vec![
            "SET".to_string(),
            format!("spillgate:cool:w/{MODEL}"),
            "99999999999999999999999:429".to_string(),
        ],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let reply = redis.command(&args).await.unwrap();
        assert!(reply.starts_with("+OK"), "{reply}");
    }
    let mocks = [
        mock("x").await,
        mock("y").await,
        mock("z").await,
        mock("w").await,
    ];
    let backends = [("x", 1), ("y", 2), ("z", 3), ("w", 4)];
    let refs: Vec<&MockBackend> = mocks.iter().collect();
    // Short cooldowns: the longest this config produces is 3 s (max, plus 1 s).
    let extra = "[cooldown]\nmax = \"2s\"\ndefault_429 = \"1s\"\ndefault_5xx = \"1s\"\ndefault_connect = \"1s\"\nmax_jitter = \"0s\"\n";
    let a = gateway(config(&backends, &refs, Some(&redis.url()), extra)).await;
    let c = client();
    wait_connected(&[&a]).await;
    let connected_at = Instant::now();
    let longest = spillgate::store::longest_cooldown(&a.app.snapshot.load().config);
    assert_eq!(longest, Duration::from_secs(3));
    wait_for(
        "the bad values are read and refused",
        Duration::from_secs(3),
        || a.app.store.status().rejected >= 4,
    )
    .await;
    // Ten years ahead is no cooldown any config here produces: not taken, not even cut
    // to the longest one, and deleted, so it cannot keep x out at every poll.
    assert!(cooling(&a, 0).is_none(), "a far-future deadline is refused");
    let x_key = format!("spillgate:cool:x/{MODEL}");
    wait_for_value(&redis, &x_key, Duration::from_secs(2), |v| {
        v.starts_with("$-1")
    })
    .await;
    wait_for_value(&redis, "spillgate:cool:y", Duration::from_secs(2), |v| {
        v.starts_with("$-1")
    })
    .await;
    // Once the longest real cooldown would have ended (and polls went by), x serves.
    tokio::time::sleep(
        (longest + Duration::from_millis(500)).saturating_sub(connected_at.elapsed()),
    )
    .await;
    assert!(cooling(&a, 0).is_none());
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "x"));
    // Written again while the gateway runs: refused and deleted again.
    let rejected = a.app.store.status().rejected;
    let reply = redis
        .command(&["SET", &x_key, &format!("{ten_years}:429")])
        .await
        .unwrap();
    assert!(reply.starts_with("+OK"), "{reply}");
    wait_for_value(&redis, &x_key, Duration::from_secs(2), |v| {
        v.starts_with("$-1")
    })
    .await;
    assert!(a.app.store.status().rejected > rejected);
    assert!(cooling(&a, 0).is_none());
    let now = a.app.clock.now_ms();
    assert!(cooling(&a, 1).is_none(), "garbage is ignored");
    assert!(
        cooling(&a, 3).is_none(),
        "an impossible deadline is ignored"
    );
    let z = a.app.snapshot.load().backends[2]
        .deployment_state(MODEL)
        .unwrap()
        .capacity();
    assert_eq!(z.observed_ms, None, "an invalid capacity is ignored");

    // A real cooldown replaces the unreadable deadline in Redis.
    mocks[3].push_script(vec![Reply::throttled(5)]);
    mocks[0].set_default(Some(Reply::throttled(5)));
    mocks[1].set_default(Some(Reply::throttled(5)));
    mocks[2].set_default(Some(Reply::throttled(5)));
    let _ = chat(&c, &a).await;
    let key = format!("spillgate:cool:w/{MODEL}");
    let stored = wait_for_value(&redis, &key, Duration::from_secs(2), |v| {
        v.contains(":429") && !v.contains("99999999999999999999999")
    })
    .await;
    let until: u64 = stored
        .lines()
        .nth(1)
        .and_then(|l| l.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(until > now && until < now + 10_000, "{stored}");
}

/// Polls `GET key` until its raw reply satisfies `f`; returns the reply.
async fn wait_for_value(
    redis: &RedisServer,
    key: &str,
    limit: Duration,
    f: impl Fn(&str) -> bool,
) -> String {
    let t0 = Instant::now();
    loop {
        let v = redis.command(&["GET", key]).await.unwrap_or_default();
        if f(&v) {
            return v;
        }
        assert!(t0.elapsed() < limit, "{key}: got {v:?} after {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_costs_no_request_and_state_re_syncs() {
    let mut redis = redis_or_skip!(RedisServer::start().await.unwrap());
    // Backends that send rate-limit headers on every answer: each response is written
    // through to Redis, so the kill lands in the middle of state traffic.
    let limited = |name: &str| MockConfig {
        limits: Some(Limits {
            rpm: 1_000_000,
            tpm: 1_000_000_000,
            window: Duration::from_secs(10),
        }),
        latency: Duration::from_millis(5),
        ..MockConfig::named(name)
    };
    let x = MockBackend::start(limited("x")).await.unwrap();
    let y = MockBackend::start(limited("y")).await.unwrap();
    let z = MockBackend::start(limited("z")).await.unwrap();
    let backends = [("x", 1), ("y", 2), ("z", 3)];
    let a = Arc::new(gateway(config(&backends, &[&x, &y, &z], Some(&redis.url()), "")).await);
    let b = Arc::new(gateway(config(&backends, &[&x, &y, &z], Some(&redis.url()), "")).await);
    wait_connected(&[&a, &b]).await;

    // Load: 8 workers alternating between the instances for 3 s; Redis is killed (-9)
    // after 1 s.
    let c = client();
    let stop_at = Instant::now() + Duration::from_secs(3);
    let mut workers = Vec::new();
    for w in 0..8 {
        let (c, a, b) = (c.clone(), Arc::clone(&a), Arc::clone(&b));
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut i = w;
            while Instant::now() < stop_at {
                let gw = if i % 2 == 0 { &a } else { &b };
                i += 1;
                let t0 = Instant::now();
                let (status, _, _) = chat(&c, gw).await;
                out.push((t0, t0.elapsed(), status));
            }
            out
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed_at = Instant::now();
    redis.kill();
    let mut results = Vec::new();
    for w in workers {
        results.extend(w.await.unwrap());
    }
    let gateway_5xx = results
        .iter()
        .filter(|(_, _, s)| s.is_server_error())
        .count();
    let not_ok: Vec<_> = results
        .iter()
        .filter(|(_, _, s)| *s != StatusCode::OK)
        .map(|(_, _, s)| *s)
        .collect();
    let mut all: Vec<Duration> = results.iter().map(|(_, d, _)| *d).collect();
    all.sort();
    let mut during: Vec<Duration> = results
        .iter()
        .filter(|(t, _, _)| *t >= killed_at)
        .map(|(_, d, _)| *d)
        .collect();
    during.sort();
    let p99 = percentile(&all, 0.99);
    let p99_during = percentile(&during, 0.99);
    println!(
        "chaos: {} requests ({} after the kill), 5xx: {gateway_5xx}, p50 {:?}, p99 {:?}, p99 after the kill {:?}, max {:?}",
        results.len(),
        during.len(),
        percentile(&all, 0.5),
        p99,
        p99_during,
        all.last().copied().unwrap_or_default()
    );
    assert_eq!(gateway_5xx, 0);
    assert!(not_ok.is_empty(), "{not_ok:?}");
    assert!(during.len() > 50, "the load went on after the kill");
    assert!(
        p99_during < Duration::from_millis(500),
        "p99 after the kill: {p99_during:?}"
    );
    assert!(!connected(&a) && !connected(&b), "both noticed");

    // While Redis is down, A learns that x throttles; B cannot know.
    x.push_script(vec![Reply::throttled(30)]);
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    assert!(cooling(&a, 0).is_some() && cooling(&b, 0).is_none());

    // Redis comes back empty on the same port: both reconnect, A re-publishes what it
    // learnt, and B has it within seconds.
    let restarted = Instant::now();
    redis.restart().await.unwrap();
    wait_connected(&[&a, &b]).await;
    let reconnect = restarted.elapsed();
    wait_for(
        "B learns A's cooldown from the outage",
        Duration::from_secs(5),
        || cooling(&b, 0).is_some(),
    )
    .await;
    let resync = restarted.elapsed();
    assert_eq!(
        cooling(&b, 0).map(|c| c.until_ms),
        cooling(&a, 0).map(|c| c.until_ms)
    );

    // And a cooldown set on A after the restart reaches B as it happens.
    y.push_script(vec![Reply::throttled(20)]);
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "z"));
    let fresh = wait_for("B learns the new cooldown", Duration::from_secs(2), || {
        cooling(&b, 1).is_some()
    })
    .await;
    println!(
        "after restart: connected in {} ms, outage cooldown re-synced in {} ms, a new cooldown reached B in {} ms",
        reconnect.as_millis(),
        resync.as_millis(),
        fresh.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_starts_without_redis_and_connects_when_it_appears() {
    let mut redis = redis_or_skip!(RedisServer::unstarted().unwrap());
    let (x, y) = (mock("x").await, mock("y").await);
    let backends = [("x", 1), ("y", 2)];
    let a = gateway(config_with(
        &backends,
        &[&x, &y],
        Some(&redis.url()),
        "",
        false,
    ))
    .await;
    let c = client();
    // It serves, and learns on its own.
    x.push_script(vec![Reply::throttled(30)]);
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    assert!(!connected(&a));
    let st = a.app.store.status();
    assert!(st.last_error.is_some(), "{st:?}");
    let readyz = client()
        .request(
            http::Request::builder()
                .uri(format!("http://{}/readyz", a.addr))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(readyz.status(), StatusCode::OK, "ready without Redis");
    let body = readyz.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v["state_store"],
        serde_json::json!({"kind": "redis", "connected": false})
    );

    redis.restart().await.unwrap();
    let took = wait_connected(&[&a]).await;
    println!("connected {} ms after Redis appeared", took.as_millis());
    // What it learnt before is in Redis now.
    let key = format!("spillgate:cool:x/{MODEL}");
    let stored = wait_for_value(&redis, &key, Duration::from_secs(2), |v| v.contains(":429")).await;
    // A second instance started now (no deployments map) tracks no deployment before
    // its requests name one: what Redis lists does not create local state. Its first
    // request for the model starts tracking it, and the next poll reads the shared
    // cooldown.
    let b = gateway(config_with(
        &backends,
        &[&x, &y],
        Some(&redis.url()),
        "",
        false,
    ))
    .await;
    wait_connected(&[&b]).await;
    let tracked = |gw: &Running| gw.app.snapshot.load().backends[0].deployments.all().len();
    assert_eq!(tracked(&b), 0, "{stored}");
    let (status, _, _) = chat(&c, &b).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(tracked(&b), 1);
    let took = wait_for("B reads x's cooldown", Duration::from_secs(2), || {
        cooling(&b, 0).is_some()
    })
    .await;
    println!(
        "a deployment B started tracking read its shared cooldown within {} ms",
        took.as_millis()
    );
    let hits = x.hits();
    for _ in 0..5 {
        let (status, h, _) = chat(&c, &b).await;
        assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    }
    assert_eq!(x.hits(), hits);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_redis_names_does_not_create_deployment_state() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let (x, y) = (mock("x").await, mock("y").await);
    let backends = [("x", 1), ("y", 2)];
    let until = spillgate_core::outcome::unix_ms(std::time::SystemTime::now()) + 20_000;
    // 300 made-up deployments of x: cooldowns, capacity, and the list of deployments an
    // earlier version kept.
    for i in 0..300 {
        for args in [
            vec![
                "SET".to_string(),
                format!("spillgate:cool:x/made-up-{i}"),
                format!("{until}:429"),
            ],
            vec![
                "HSET".to_string(),
                "spillgate:targets".to_string(),
                format!("x/made-up-{i}"),
                until.to_string(),
            ],
        ] {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            redis.command(&args).await.unwrap();
        }
    }
    let a = gateway(config_with(
        &backends,
        &[&x, &y],
        Some(&redis.url()),
        "",
        false,
    ))
    .await;
    wait_connected(&[&a]).await;
    // And their events, as if another instance sent them.
    for i in 300..600 {
        let event = format!("c someone x made-up-{i} {until}:429");
        let reply = redis
            .command(&["PUBLISH", "spillgate:events", &event])
            .await
            .unwrap();
        assert!(reply.starts_with(":1"), "{reply}");
    }
    // Two polls later, still nothing tracked.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tracked = || {
        a.app.snapshot.load().backends[0]
            .deployments
            .all()
            .into_iter()
            .map(|(d, _)| d)
            .collect::<Vec<_>>()
    };
    let names = tracked();
    assert!(
        names.is_empty(),
        "{} deployments tracked, e.g. {:?}",
        names.len(),
        names.first()
    );
    // The names requests bring are tracked as before, and take the shared state.
    let c = client();
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "x"));
    assert_eq!(tracked(), [MODEL]);
    let reply = redis
        .command(&[
            "SET",
            &format!("spillgate:cool:x/{MODEL}"),
            &format!("{until}:429"),
        ])
        .await
        .unwrap();
    assert!(reply.starts_with("+OK"), "{reply}");
    wait_for(
        "A reads the cooldown of a deployment it tracks",
        Duration::from_secs(2),
        || cooling(&a, 0).is_some(),
    )
    .await;
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_stops_answering_delays_no_request() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let (x, y) = (mock("x").await, mock("y").await);
    let backends = [("x", 1), ("y", 2)];
    // The default request-path timeout (5 ms); a breaker so a probe is due after the stall
    // starts: the one decision that asks Redis on the request path.
    let extra = "# default timeout\n[circuit_breaker]\nfailures = 1\ntrip = \"1s\"\ncondition = [\"500-599\"]\n[cooldown]\ndefault_5xx = \"1s\"\n";
    let a = gateway(config(&backends, &[&x, &y], Some(&redis.url()), extra)).await;
    let b = gateway(config(&backends, &[&x, &y], Some(&redis.url()), extra)).await;
    wait_connected(&[&a, &b]).await;
    let c = client();
    x.push_script(vec![Reply::status(500)]);
    let (status, _, _) = chat(&c, &a).await;
    assert_eq!(status, StatusCode::OK);
    wait_for("B learns the trip", Duration::from_secs(2), || {
        cooling(&b, 0).is_some()
    })
    .await;

    // Redis stops answering (SIGSTOP: connections stay open, nothing comes back).
    redis.pause().unwrap();
    let t0 = Instant::now();
    let mut worst = Duration::ZERO;
    let mut n = 0;
    while t0.elapsed() < Duration::from_secs(3) {
        for gw in [&a, &b] {
            let s = Instant::now();
            let (status, _, _) = chat(&c, gw).await;
            worst = worst.max(s.elapsed());
            assert_eq!(status, StatusCode::OK);
            n += 1;
        }
    }
    let local = a.app.store.status().local_decisions + b.app.store.status().local_decisions;
    println!(
        "stalled Redis: {n} requests, slowest {} ms, probe claims decided locally: {local}",
        worst.as_millis()
    );
    assert!(
        worst < Duration::from_millis(250),
        "slowest request {worst:?}"
    );
    assert!(
        local >= 1,
        "the probe claim timed out and was decided locally"
    );
    // The link is taken for lost once a background read gets no answer.
    wait_for("the stall is noticed", Duration::from_secs(3), || {
        !connected(&a) && !connected(&b)
    })
    .await;

    redis.resume().unwrap();
    let took = wait_connected(&[&a, &b]).await;
    println!("reconnected {} ms after Redis resumed", took.as_millis());
}

/// A TCP proxy to `target` that closes every connection `life` after accepting it;
/// counts the connections it accepted.
async fn dropping_proxy(target: u16, life: Duration) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                else {
                    return;
                };
                let _ = tokio::time::timeout(
                    life,
                    tokio::io::copy_bidirectional(&mut inbound, &mut outbound),
                )
                .await;
            });
        }
    });
    (port, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_drops_every_connection_is_not_hammered() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    // Every connection lives 300 ms: long enough to connect and re-sync, then it drops.
    let (port, accepted) = dropping_proxy(redis.port(), Duration::from_millis(300)).await;
    let (x, y) = (mock("x").await, mock("y").await);
    let a = gateway(config(
        &[("x", 1), ("y", 2)],
        &[&x, &y],
        Some(&format!("redis://127.0.0.1:{port}/0")),
        "",
    ))
    .await;
    wait_connected(&[&a]).await;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Two connections (commands, events) per attempt. Reconnecting at once after each
    // drop would make about 4 s / 300 ms = 13 attempts; backing off (100 ms, 200 ms,
    // 400 ms, ... up to 2 s between them) makes about 5.
    let attempts = accepted.load(std::sync::atomic::Ordering::Relaxed) / 2;
    println!(
        "connections dropping after 300 ms: {attempts} attempts in {} ms",
        t0.elapsed().as_millis()
    );
    assert!(attempts >= 2, "it does reconnect");
    assert!(attempts <= 8, "{attempts} attempts in 4 s");
    // And it still serves.
    let (status, _, _) = chat(&client(), &a).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_on_a_stalled_redis_once() {
    let redis = redis_or_skip!(RedisServer::start().await.unwrap());
    let (x, y, z) = (mock("x").await, mock("y").await, mock("z").await);
    let backends = [("x", 1), ("y", 2), ("z", 3)];
    let extra = "[circuit_breaker]\nfailures = 1\nwindow = \"10s\"\ntrip = \"1s\"\ncondition = [\"500-599\"]\n[cooldown]\ndefault_5xx = \"1s\"\n";
    // A claim timeout long enough to measure how many a request waits for.
    let timeout = Duration::from_millis(300);
    let a = gateway(with_timeout(
        config(&backends, &[&x, &y, &z], Some(&redis.url()), extra),
        timeout,
    ))
    .await;
    wait_connected(&[&a]).await;
    let c = client();
    // x and y trip on one request; z serves it.
    x.push_script(vec![Reply::status(500)]);
    y.push_script(vec![Reply::status(500)]);
    let (status, h, _) = chat(&c, &a).await;
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "z"));
    wait_for("the trips end", Duration::from_secs(5), || {
        cooling(&a, 0).is_none() && cooling(&a, 1).is_none()
    })
    .await;
    // Both recover: x's probe fails again, y's succeeds. With Redis stalled, the probe
    // claim for x gets no answer within the timeout; the claim for y is then not even
    // tried: the request decides locally.
    x.push_script(vec![Reply::status(500)]);
    redis.pause().unwrap();
    let t0 = Instant::now();
    let (status, h, _) = chat(&c, &a).await;
    let took = t0.elapsed();
    redis.resume().unwrap();
    assert_eq!((status, served_by(&h)), (StatusCode::OK, "y"));
    println!(
        "a request meeting two recovering backends with Redis stalled took {} ms (claim timeout {} ms)",
        took.as_millis(),
        timeout.as_millis()
    );
    assert!(took >= timeout, "{took:?}");
    assert!(
        took < 2 * timeout,
        "waited on Redis more than once: {took:?}"
    );
    assert_eq!(a.app.store.status().local_decisions, 2);
}
