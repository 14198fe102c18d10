//! Upstream 429s wasted by several gateway instances, with and without shared state.
//!
//! `cargo bench -p spillgate --bench shared_state` runs three gateway instances behind a
//! round-robin "load balancer" (the driver sends request i to instance i mod 3) in front
//! of two mock Azure deployments on loopback: a priority-1 deployment that allows 20
//! requests per one-second window (answering 429 with `Retry-After` and
//! `retry-after-ms` over it, and `x-ratelimit-*` headers under it) and an unlimited
//! priority-2 deployment. The same load (45 requests/s, more than twice what priority 1
//! allows) goes through the instances twice: each keeping its own state, then sharing
//! it through a real `redis-server`. Every 429 the priority-1 deployment sends is an
//! upstream attempt wasted: the client still gets its answer from priority 2, later.
//!
//! Real time (Redis is a real process): 15 s per run. Under `cargo test --benches` it
//! runs a 2-second smoke pass of each. Without `redis-server` the shared run is skipped.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "benchmark driver"
)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use spillgate::app::App;
use spillgate_mock::{Limits, MockBackend, MockConfig, RedisServer};

const KEY: &str = "bench-key";
const INSTANCES: usize = 3;
const RATE: f64 = 45.0;
const BODY: &str = r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":16}"#;

fn config(
    ptu: &MockBackend,
    paygo: &MockBackend,
    redis: Option<&str>,
) -> spillgate_core::config::Config {
    let state = redis.map_or(String::new(), |url| {
        format!("[state]\nredis_url = \"{url}\"\nprefix = \"bench\"\n")
    });
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[auth]\nclient_keys = [\"env:K\"]\n[admin]\nenabled = false\n{state}\
         [[backends]]\nname = \"ptu\"\nkind = \"azure\"\nurl = \"{}\"\npriority = 1\napi_key = \"env:K\"\n\
         [[backends]]\nname = \"paygo\"\nkind = \"azure\"\nurl = \"{}\"\npriority = 2\napi_key = \"env:K\"\n",
        ptu.url(),
        paygo.url()
    );
    spillgate_core::config::load(&text, &|_| Some(KEY.to_string()), &|_| {
        Err("no files".into())
    })
    .unwrap()
}

struct Report {
    name: &'static str,
    requests: u64,
    ok: u64,
    other: u64,
    attempts: u64,
    wasted_429: u64,
}

async fn run(name: &'static str, redis: Option<&RedisServer>, seconds: u64) -> Report {
    let ptu = MockBackend::start(MockConfig {
        limits: Some(Limits {
            rpm: 1_200,
            tpm: 100_000_000,
            window: Duration::from_secs(1),
        }),
        latency: Duration::from_millis(20),
        ..MockConfig::named("ptu")
    })
    .await
    .unwrap();
    let paygo = MockBackend::start(MockConfig {
        latency: Duration::from_millis(20),
        ..MockConfig::named("paygo")
    })
    .await
    .unwrap();
    ptu.set_recording(false);
    paygo.set_recording(false);
    let url = redis.map(RedisServer::url);
    let mut gws = Vec::new();
    for _ in 0..INSTANCES {
        let app = App::new(config(&ptu, &paygo, url.as_deref())).unwrap();
        gws.push(spillgate::server::start(app).await.unwrap());
    }
    if redis.is_some() {
        let t0 = Instant::now();
        while !gws
            .iter()
            .all(|g| g.app.store.status().connected == Some(true))
        {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "instances did not connect to Redis"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let addrs: Vec<_> = gws.iter().map(|g| g.addr).collect();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let (ok, other) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let start = Instant::now();
    let step = Duration::from_millis(10);
    let mut sent = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    while start.elapsed() < Duration::from_secs(seconds) {
        let due = (start.elapsed().as_secs_f64() * RATE) as u64;
        while sent < due {
            let addr = addrs[sent as usize % INSTANCES];
            sent += 1;
            let (client, ok, other) = (client.clone(), Arc::clone(&ok), Arc::clone(&other));
            tasks.spawn(async move {
                let req = http::Request::post(format!(
                    "http://{addr}/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
                ))
                .header("api-key", KEY)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(BODY.as_bytes())))
                .unwrap();
                let status = match client.request(req).await {
                    Ok(r) => {
                        let s = r.status();
                        let _ = r.into_body().collect().await;
                        s
                    }
                    Err(_) => http::StatusCode::BAD_GATEWAY,
                };
                if status == http::StatusCode::OK {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    other.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        while tasks.try_join_next().is_some() {}
        tokio::time::sleep(step).await;
    }
    while tasks.join_next().await.is_some() {}
    let report = Report {
        name,
        requests: sent,
        ok: ok.load(Ordering::Relaxed),
        other: other.load(Ordering::Relaxed),
        attempts: ptu.hits() + paygo.hits(),
        wasted_429: ptu.hits_429() + paygo.hits_429(),
    };
    for g in gws {
        g.shutdown().await;
    }
    report
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let seconds = if full { 15 } else { 2 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let reports = rt.block_on(async {
        let mut reports = vec![run("3 instances, own state each", None, seconds).await];
        match RedisServer::start().await.unwrap() {
            Some(redis) => {
                reports.push(run("3 instances, shared through Redis", Some(&redis), seconds).await);
            }
            None => println!("SKIPPED the shared run: redis-server is not installed"),
        }
        reports
    });
    println!(
        "\nshared state, {seconds} s: {RATE} req/s round-robin over {INSTANCES} instances; priority 1 allows 20 requests per 1 s window (429 + Retry-After over it), priority 2 unlimited\n"
    );
    println!("| setup | client requests | answered 200 | other answers | upstream attempts | wasted upstream 429s | 429s per 1,000 requests |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &reports {
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.1} |",
            r.name,
            r.requests,
            r.ok,
            r.other,
            r.attempts,
            r.wasted_429,
            1000.0 * r.wasted_429 as f64 / r.requests.max(1) as f64
        );
    }
    if let [alone, shared] = &reports[..] {
        println!(
            "\nwasted upstream 429s: {} without Redis, {} with Redis ({:.1}x fewer)",
            alone.wasted_429,
            shared.wasted_429,
            alone.wasted_429 as f64 / shared.wasted_429.max(1) as f64
        );
    }
    // Every client got its answer either way: the 429s are the gateway's cost, not theirs.
    for r in &reports {
        assert_eq!(
            r.other, 0,
            "{}: {} requests not answered 200",
            r.name, r.other
        );
    }
}
