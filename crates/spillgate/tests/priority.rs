//! Request priority end to end: the gateway in memory in front of simulated Azure
//! deployments that enforce TPM/RPM like Azure and send `x-ratelimit-*` headers, driven
//! for minutes of paused tokio time.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed setup step should abort the test loudly"
)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use spillgate::app::App;
use spillgate::sim::{drive, longest_zero_run, Second, SimLimits, SimUpstream};
use tower::ServiceExt;

const KEY: &str = "client-key";

/// ~100 tokens per request in the simulation: prompt bytes / 4 plus max_tokens.
fn body() -> Bytes {
    Bytes::from_static(spillgate::sim::SAMPLE_CHAT)
}

fn cost() -> u64 {
    spillgate::sim::request_cost(&body())
}

fn limits(tpm: u64, rpm: u64) -> Option<SimLimits> {
    Some(SimLimits::per_minute(tpm, rpm))
}

const LATENCY: Duration = Duration::from_millis(300);

fn gateway(
    backends: &[(&str, u32)],
    sim: SimUpstream,
    reserve_tokens: u64,
    reserve_requests: u64,
) -> (Arc<App>, spillgate::server::Gateway) {
    spillgate::sim::gateway(
        sim,
        backends,
        &spillgate::sim::priority_config(reserve_tokens, reserve_requests),
        KEY,
    )
    .unwrap()
}

fn total(seconds: &[Second], f: impl Fn(&Second) -> u64) -> u64 {
    seconds.iter().map(f).sum()
}

#[tokio::test(start_paused = true)]
async fn single_priority_low_traffic_uses_the_spare_capacity_without_blackouts() {
    // 60k TPM / 600 RPM: 1,000 tokens and 10 requests per second. Reserve 30% for high.
    let sim = SimUpstream::new(&[("ptu", limits(60_000, 600), LATENCY)]);
    let (_, router) = gateway(&[("ptu", 1)], sim.clone(), 3_000, 30);
    // Only low-priority traffic, offered at twice the deployment's capacity, for 3 min.
    let secs = 180;
    let seen = drive(router, secs, |_| (0.0, 20.0), body(), KEY).await;
    let served = sim.backend("ptu").unwrap().stats();
    let limit_tokens_per_s = 60_000.0 / 60.0;
    let reserve_share = 0.3;
    let low_tokens_per_s =
        total(&seen[10..], |s| s.low_ok) as f64 * cost() as f64 / (secs - 10) as f64;
    println!(
        "low-only: {:.0} tokens/s served of {:.0} limit ({:.0} after the reserve); backend 429s: {}",
        low_tokens_per_s,
        limit_tokens_per_s,
        limit_tokens_per_s * (1.0 - reserve_share),
        served.throttled
    );
    assert!(
        low_tokens_per_s >= 0.9 * limit_tokens_per_s * (1.0 - reserve_share),
        "low-priority throughput {low_tokens_per_s:.0} tokens/s is below 90% of the spare capacity"
    );
    // The seed's 60 s blackout: here no second (after warm-up) passes with nothing served
    // for longer than the stale-data probe interval (5 s).
    let blackout = longest_zero_run(&seen, 10, |s| s.low_ok);
    assert!(
        blackout <= 5,
        "{blackout} s without a low-priority request served"
    );
    assert_eq!(total(&seen, |s| s.other), 0);
}

#[tokio::test(start_paused = true)]
async fn cycle_high_priority_is_never_refused_while_its_reserve_holds() {
    let sim = SimUpstream::new(&[("ptu", limits(60_000, 600), LATENCY)]);
    let (_, router) = gateway(&[("ptu", 1)], sim.clone(), 3_000, 30);
    // 30 s phases: high at 6 req/s (~60% of capacity) with a low-priority flood, then the
    // flood alone.
    let phase = |t: f64| ((t / 30.0) as u64).is_multiple_of(2);
    let seen = drive(
        router,
        120,
        |t| if phase(t) { (6.0, 20.0) } else { (0.0, 20.0) },
        body(),
        KEY,
    )
    .await;
    let high_429 = total(&seen, |s| s.high_429);
    let high_ok = total(&seen, |s| s.high_ok);
    assert_eq!(
        high_429, 0,
        "high-priority requests got 429s ({high_ok} served)"
    );
    assert!((6 * 60 - 2..=6 * 60 + 2).contains(&high_ok), "{high_ok}");
    // Low priority uses what is left: some during high phases, most of the capacity alone.
    let low_in =
        |from: usize, to: usize| total(&seen[from..to], |s| s.low_ok) as f64 / (to - from) as f64;
    // High phases are [0, 30) and [60, 90) s; measure after each phase's first 5 s.
    let low_with_high = low_in(65, 90);
    let low_alone = low_in(35, 60);
    let capacity_rps = 1_000.0 / cost() as f64;
    println!("cycle: low {low_with_high:.1} req/s beside high, {low_alone:.1} req/s alone (capacity {capacity_rps:.1} req/s)");
    assert!(
        low_with_high > 0.5,
        "low priority still gets the leftovers: {low_with_high}"
    );
    assert!(low_alone >= 0.9 * 0.7 * capacity_rps, "{low_alone} req/s");
    assert!(low_alone > low_with_high);
}

#[tokio::test(start_paused = true)]
async fn low_priority_spills_to_a_tier_with_headroom() {
    // A small PTU at priority 1 and a large pay-as-you-go deployment at priority 2.
    let sim = SimUpstream::new(&[
        ("ptu", limits(30_000, 300), LATENCY),
        ("paygo", limits(240_000, 2_400), LATENCY),
    ]);
    let (_, router) = gateway(&[("ptu", 1), ("paygo", 2)], sim.clone(), 3_000, 3);
    let seen = drive(router, 60, |_| (2.0, 20.0), body(), KEY).await;
    let refused = total(&seen, |s| s.low_refused);
    let low_ok = total(&seen, |s| s.low_ok);
    let on_paygo = total(&seen, |s| s.by_backend.get("paygo").copied().unwrap_or(0));
    let on_ptu = total(&seen, |s| s.by_backend.get("ptu").copied().unwrap_or(0));
    println!(
        "spill: {low_ok} low served ({on_ptu} on ptu, {on_paygo} on paygo), {refused} refused"
    );
    assert!(on_paygo > 300, "low priority spilled to tier 2: {on_paygo}");
    assert!(on_ptu > 200, "and the PTU is kept busy too: {on_ptu}");
    // Tier 2 has room for all of it: (almost) nothing is refused.
    assert!(refused <= low_ok / 100, "{refused} refused of {low_ok}");
    assert_eq!(total(&seen, |s| s.high_429), 0);
}

#[tokio::test(start_paused = true)]
async fn a_refused_low_priority_request_says_why_and_when() {
    let sim = SimUpstream::new(&[("ptu", limits(6_000, 60), Duration::ZERO)]);
    let (_, router) = gateway(&[("ptu", 1)], sim, 500, 3);
    let send = |low: bool| {
        let router = router.clone();
        async move {
            let mut req = http::Request::post("/v1/chat/completions").header("api-key", KEY);
            if low {
                req = req.header("x-priority", "low");
            }
            let resp = router
                .oneshot(req.body(Body::from(body())).unwrap())
                .await
                .unwrap()
                .into_response();
            let (parts, b) = resp.into_parts();
            (
                parts.status,
                parts.headers,
                b.collect().await.unwrap().to_bytes(),
            )
        }
    };
    // 1,000-token bucket, 500 reserved: after a few requests, low priority must wait.
    let mut refused = None;
    for _ in 0..12 {
        let (status, headers, b) = send(true).await;
        if status == 429 {
            refused = Some((headers, b));
            break;
        }
    }
    let (headers, b) = refused.expect("low priority refused once capacity is down to the reserve");
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["code"], "low_priority_refused");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not by a backend"));
    let ra: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=10).contains(&ra), "{ra}");
    assert!(headers.contains_key("retry-after-ms"));
    // After the advertised wait, low priority gets in again.
    tokio::time::sleep(Duration::from_millis(
        headers["retry-after-ms"].to_str().unwrap().parse().unwrap(),
    ))
    .await;
    let (status, _, _) = send(true).await;
    assert_eq!(status, 200);
    // Refused again at once; high priority is never held back by the reserve.
    let (status, _, _) = send(true).await;
    assert_eq!(status, 429);
    let (status, _, b) = send(false).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
}

#[tokio::test(start_paused = true)]
async fn stale_capacity_lets_one_probe_through() {
    // A deployment whose refill the gateway cannot see (no reset headers: a flat
    // remaining): the probe refreshes stale data instead of refusing forever.
    let sim = SimUpstream::new(&[("ptu", limits(6_000, 60), Duration::from_millis(500))]);
    let (app, router) = gateway(&[("ptu", 1)], sim.clone(), 500, 3);
    // Drain to below the reserve.
    let seen = drive(router.clone(), 3, |_| (0.0, 10.0), body(), KEY).await;
    assert!(total(&seen, |s| s.low_refused) > 0);
    // Forget the refill: pretend the data is old and shows nothing left.
    let snap = app.snapshot.load();
    let dep = snap.backends[0].deployment_state("gpt-4o").unwrap();
    let nothing = spillgate_core::capacity::RateLimitHeaders {
        remaining_tokens: Some(0),
        remaining_requests: Some(0),
        limit_tokens: Some(1_000),
        limit_requests: Some(10),
        reset_tokens: Some(Duration::from_secs(3_600)),
        reset_requests: Some(Duration::from_secs(3_600)),
    };
    dep.observe_capacity(
        &nothing,
        &snap.config.priority.as_ref().unwrap().capacity,
        app.clock.now_ms(),
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    // 10 low-priority requests at once: exactly one goes as the probe.
    let before = sim.backend("ptu").unwrap().stats().served;
    let seen = drive(
        router,
        1,
        |t| if t < 0.05 { (0.0, 200.0) } else { (0.0, 0.0) },
        body(),
        KEY,
    )
    .await;
    let after = sim.backend("ptu").unwrap().stats().served;
    assert_eq!(after - before, 1, "one probe");
    assert_eq!(total(&seen, |s| s.low_ok), 1);
    assert_eq!(total(&seen, |s| s.low_refused), 9);
}

#[tokio::test(start_paused = true)]
async fn requests_in_flight_count_against_the_capacity() {
    // Slow answers (2 s): many requests are in flight before any response tells the
    // gateway how much is left.
    let sim = SimUpstream::new(&[("ptu", limits(6_000, 600), Duration::from_secs(2))]);
    let (_, router) = gateway(&[("ptu", 1)], sim.clone(), 500, 3);
    // One request teaches the gateway the deployment's capacity (1,000 tokens).
    drive(
        router.clone(),
        3,
        |t| if t < 0.01 { (0.0, 100.0) } else { (0.0, 0.0) },
        body(),
        KEY,
    )
    .await;
    // Then 15 low-priority requests at once: only what fits above the 500-token reserve
    // may go, counting the ones already sent.
    let seen = drive(
        router.clone(),
        3,
        |t| if t < 0.05 { (0.0, 300.0) } else { (0.0, 0.0) },
        body(),
        KEY,
    )
    .await;
    let admitted = total(&seen, |s| s.low_ok + s.low_429);
    // The gateway reserves its own estimate (tokenized prompt + max_tokens) per request.
    let est = spillgate::priority::estimate_tokens(&body(), "chat/completions", 1000);
    let fit = (1_000 - cost() - 500) / est;
    assert!(
        admitted <= fit + 1,
        "{admitted} admitted; about {fit} fit above the reserve"
    );
    assert!(admitted >= 1);
    assert_eq!(
        sim.backend("ptu").unwrap().stats().throttled,
        0,
        "no low-priority request hit the backend's limit"
    );
    // And the reserve is there for high priority.
    let seen = drive(
        router,
        3,
        |t| if t < 0.03 { (100.0, 0.0) } else { (0.0, 0.0) },
        body(),
        KEY,
    )
    .await;
    assert_eq!(total(&seen, |s| s.high_ok), 3);
}

#[tokio::test(start_paused = true)]
async fn deployments_that_cannot_take_a_request_are_passed_over_not_tried() {
    // High-priority traffic at 2.5x the PTU's rate; no [priority] table: the pass-over rule
    // holds for every request. The PTU should stay as busy as possible while no attempt
    // is spent on a 429 its headers already predicted.
    let sim = SimUpstream::new(&[
        ("ptu", limits(60_000, 600), LATENCY),
        ("paygo", limits(600_000, 6_000), LATENCY),
    ]);
    let (_, router) =
        spillgate::sim::gateway(sim.clone(), &[("ptu", 1), ("paygo", 2)], "", KEY).unwrap();
    let secs = 120;
    let seen = drive(router, secs, |_| (25.0, 0.0), body(), KEY).await;
    let ok = total(&seen, |s| s.high_ok);
    let ptu = sim.backend("ptu").unwrap().stats();
    let paygo = sim.backend("paygo").unwrap().stats();
    let attempts = ptu.served + ptu.throttled + paygo.served + paygo.throttled;
    let per_success = attempts as f64 / ok as f64;
    let ptu_rps = ptu.served as f64 / secs as f64;
    let ptu_capacity = 1_000.0 / cost() as f64;
    println!(
        "pass-over: {per_success:.4} attempts per success ({} upstream 429s); ptu {ptu_rps:.2} req/s of {ptu_capacity:.2}",
        ptu.throttled + paygo.throttled
    );
    assert_eq!(total(&seen, |s| s.high_429 + s.other), 0);
    assert!(per_success <= 1.001, "{per_success} attempts per success");
    // As busy as an oracle would keep it: its whole refill rate (plus the initial bucket).
    assert!(
        ptu_rps >= 0.98 * ptu_capacity,
        "ptu {ptu_rps:.2} req/s of {ptu_capacity:.2}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_gateways_own_answers_are_counted_once_with_their_priority() {
    let sim = SimUpstream::new(&[("ptu", limits(600_000, 6_000), Duration::ZERO)]);
    let (app, router) = gateway(&[("ptu", 1)], sim, 0, 0);
    let send = |req: http::request::Builder, body: Bytes| {
        let router = router.clone();
        async move {
            router
                .oneshot(req.body(Body::from(body)).unwrap())
                .await
                .unwrap()
                .into_response()
                .status()
        }
    };
    let post = || http::Request::post("/v1/chat/completions");
    // No key (401), and a body that is not JSON (400): both low priority.
    let status = send(post().header("x-priority", "low"), body()).await;
    assert_eq!(status, 401);
    let broken = Bytes::from_static(br#"{"model":"#);
    let status = send(
        post().header("api-key", KEY).header("x-priority", "low"),
        broken,
    )
    .await;
    assert_eq!(status, 400);
    // The model list (high priority), and one request a backend answers.
    let models = http::Request::get("/v1/models").header("api-key", KEY);
    assert_eq!(send(models, Bytes::new()).await, 200);
    assert_eq!(send(post().header("api-key", KEY), body()).await, 200);
    let metrics = app.metrics.render(&app);
    let count = |labels: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("spillgate_requests_total{{{labels}}} ")))
            .map(|v| v.trim().to_string())
    };
    assert_eq!(
        count(r#"backend="-",status_class="4xx",priority="low",model="-""#).as_deref(),
        Some("2"),
        "{metrics}"
    );
    assert_eq!(
        count(r#"backend="-",status_class="2xx",priority="high",model="-""#).as_deref(),
        Some("1"),
        "{metrics}"
    );
    // The backend's answer is counted by the proxy, under its backend, and only there.
    let answered: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("spillgate_requests_total{") && l.contains("status_class=\"2xx\"")
        })
        .collect();
    assert_eq!(answered.len(), 2, "{metrics}");
    assert!(
        answered
            .iter()
            .any(|l| l.contains("backend=\"ptu\"") && l.ends_with(" 1")),
        "{metrics}"
    );
}
