//! Routing quality: how well the gateway uses the backends' quota, against plain
//! round-robin (what nginx does) and an oracle that knows every backend's remaining
//! capacity.
//!
//! `cargo bench -p spillgate --bench routing` drives the same ramped load through each
//! strategy in front of simulated Azure deployments (`spillgate::sim`: TPM/RPM token
//! buckets over a 10 s window, 429 + Retry-After, `x-ratelimit-*` headers): a priority-1
//! "PTU" and two priority-2 pay-as-you-go deployments. Time is tokio's, paused, so ten
//! simulated minutes take seconds. It prints a markdown table and writes
//! `bench/routing.svg`: requests per second per backend over time for spillgate and for
//! round-robin. Under `cargo test --benches` it runs a short smoke pass.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "benchmark driver"
)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use spillgate::sim::{SimLimits, SimUpstream};
use spillgate::upstream::Upstream;
use tokio::time::Instant;
use tower::ServiceExt;

const KEY: &str = "bench-key";
/// (name, priority, TPM): the PTU takes ~9.7 requests/s of this size, each pay-as-you-go
/// deployment ~19.4.
const BACKENDS: [(&str, u32, u64); 3] = [
    ("ptu", 1, 60_000),
    ("paygo-a", 2, 120_000),
    ("paygo-b", 2, 120_000),
];
const LATENCY: Duration = Duration::from_millis(200);

fn body() -> Bytes {
    Bytes::from_static(spillgate::sim::SAMPLE_CHAT)
}

fn sim() -> SimUpstream {
    let specs: Vec<_> = BACKENDS
        .iter()
        .map(|(n, _, tpm)| (*n, Some(SimLimits::per_minute(*tpm, tpm / 100)), LATENCY))
        .collect();
    SimUpstream::new(&specs)
}

/// Offered load at `t` of `total` seconds: 4 req/s, up to 36 (nearly four times the PTU) and
/// back down, then a quiet tail, so the spill-over and the return both show.
fn offered(t: f64, total: f64) -> f64 {
    let x = t / total;
    let (low, peak) = (4.0, 36.0);
    let shape = if x < 0.15 {
        0.0
    } else if x < 0.4 {
        (x - 0.15) / 0.25
    } else if x < 0.6 {
        1.0
    } else if x < 0.85 {
        (0.85 - x) / 0.25
    } else {
        0.0
    };
    low + (peak - low) * shape
}

/// Per second: requests offered, served, and answered 429 to the client.
#[derive(Default, Clone, Copy)]
struct Sec {
    offered: u64,
    ok: u64,
    throttled: u64,
}

/// How a strategy sends one request: the status the client sees.
type Sender = Arc<dyn Fn(Bytes) -> futures_util::future::BoxFuture<'static, u16> + Send + Sync>;

async fn drive(seconds: u64, send: Sender) -> Vec<Sec> {
    let out = Arc::new(Mutex::new(vec![Sec::default(); seconds as usize + 1]));
    let start = Instant::now();
    let step = Duration::from_millis(10);
    let (mut due, mut sent) = (0.0f64, 0u64);
    let mut tasks = tokio::task::JoinSet::new();
    while start.elapsed() < Duration::from_secs(seconds) {
        let t = start.elapsed().as_secs_f64();
        due += offered(t, seconds as f64) * step.as_secs_f64();
        let sec = start.elapsed().as_secs() as usize;
        while (sent as f64) < due {
            sent += 1;
            let (send, out) = (Arc::clone(&send), Arc::clone(&out));
            out.lock().unwrap()[sec].offered += 1;
            tasks.spawn(async move {
                let status = send(body()).await;
                let mut o = out.lock().unwrap();
                match status {
                    200 => o[sec].ok += 1,
                    _ => o[sec].throttled += 1,
                }
            });
        }
        while tasks.try_join_next().is_some() {}
        tokio::time::sleep(step).await;
    }
    while tasks.join_next().await.is_some() {}
    let r = out.lock().unwrap().clone();
    r
}

fn request_to(backend: &str, body: Bytes) -> http::Request<Bytes> {
    http::Request::post(format!(
        "http://{backend}/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
    ))
    .header("api-key", "k")
    .body(body)
    .unwrap()
}

async fn status_of(sim: &SimUpstream, backend: &str, body: Bytes) -> u16 {
    let req = request_to(backend, body);
    match sim.send_http(&req, Duration::from_secs(60)).await {
        Ok(r) => {
            let s = r.status().as_u16();
            let _ = r.into_body().collect().await;
            s
        }
        Err(_) => 502,
    }
}

/// spillgate with the three backends in two tiers, default settings.
fn spillgate(sim: &SimUpstream) -> Sender {
    let backends: Vec<(&str, u32)> = BACKENDS.iter().map(|(n, p, _)| (*n, *p)).collect();
    let (_, router) = spillgate::sim::gateway(sim.clone(), &backends, "", KEY).unwrap();
    Arc::new(move |body: Bytes| {
        let router = router.clone();
        Box::pin(async move {
            let req = http::Request::post("/v1/chat/completions")
                .header("api-key", KEY)
                .body(Body::from(body))
                .unwrap();
            let resp = router.oneshot(req).await.unwrap().into_response();
            let s = resp.status().as_u16();
            let _ = resp.into_body().collect().await;
            s
        })
    })
}

/// Plain round-robin over all backends, as an nginx upstream does; nginx does not retry a
/// 429 on the next upstream by default, so the client gets it.
fn round_robin(sim: &SimUpstream) -> Sender {
    let next = Arc::new(AtomicU64::new(0));
    let sim = sim.clone();
    Arc::new(move |body: Bytes| {
        let i = next.fetch_add(1, Ordering::Relaxed) as usize % BACKENDS.len();
        let sim = sim.clone();
        Box::pin(async move { status_of(&sim, BACKENDS[i].0, body).await })
    })
}

/// The ideal: knows every backend's remaining capacity and sends each request to the
/// highest-priority backend that can take it; the client gets 429 only when none can.
fn oracle(sim: &SimUpstream) -> Sender {
    let sim = sim.clone();
    Arc::new(move |body: Bytes| {
        let sim = sim.clone();
        Box::pin(async move {
            let cost = spillgate::sim::request_cost(&body);
            let mut tiers: Vec<u32> = BACKENDS.iter().map(|(_, p, _)| *p).collect();
            tiers.dedup();
            for p in tiers {
                let open: Vec<&str> = BACKENDS
                    .iter()
                    .filter(|(n, q, _)| {
                        *q == p && sim.backend(n).unwrap().would_admit("gpt-4o", cost)
                    })
                    .map(|(n, _, _)| *n)
                    .collect();
                if !open.is_empty() {
                    let pick = open[fastrand::usize(..open.len())];
                    return status_of(&sim, pick, body).await;
                }
            }
            429
        })
    })
}

struct Report {
    name: &'static str,
    ptu_share_under: f64,
    ptu_use_over: f64,
    client_429: f64,
    attempts_per_success: f64,
    per_backend: Vec<Vec<u64>>,
    offered: Vec<u64>,
}

async fn run(name: &'static str, make: fn(&SimUpstream) -> Sender, seconds: u64) -> Report {
    let sim = sim();
    let seen = drive(seconds, make(&sim)).await;
    let stats: Vec<_> = BACKENDS
        .iter()
        .map(|(n, _, _)| sim.backend(n).unwrap().stats())
        .collect();
    let cost = spillgate::sim::request_cost(&body()) as f64;
    let ptu_rate = BACKENDS[0].2 as f64 / 60.0 / cost;
    let served_at = |b: usize, s: usize| stats[b].per_second.get(s).map_or(0, |x| x.0);
    // Seconds whose offered load the PTU alone could carry: its share of what was served.
    let (mut under_ptu, mut under_all, mut over_ptu, mut over_secs) = (0u64, 0u64, 0u64, 0u64);
    for (s, sec) in seen.iter().enumerate().take(seconds as usize).skip(5) {
        let total: u64 = (0..BACKENDS.len()).map(|b| served_at(b, s)).sum();
        if (sec.offered as f64) < 0.9 * ptu_rate {
            under_ptu += served_at(0, s);
            under_all += total;
        } else if (sec.offered as f64) > 1.5 * ptu_rate {
            over_ptu += served_at(0, s);
            over_secs += 1;
        }
    }
    let offered: u64 = seen.iter().map(|s| s.offered).sum();
    let ok: u64 = seen.iter().map(|s| s.ok).sum();
    let throttled: u64 = seen.iter().map(|s| s.throttled).sum();
    let attempts: u64 = stats.iter().map(|s| s.served + s.throttled).sum();
    Report {
        name,
        ptu_share_under: under_ptu as f64 / under_all.max(1) as f64,
        ptu_use_over: over_ptu as f64 / (over_secs.max(1) as f64 * ptu_rate),
        client_429: throttled as f64 / offered.max(1) as f64,
        attempts_per_success: attempts as f64 / ok.max(1) as f64,
        per_backend: (0..BACKENDS.len())
            .map(|b| (0..seconds as usize).map(|s| served_at(b, s)).collect())
            .collect(),
        offered: seen.iter().map(|s| s.offered).collect(),
    }
}

/// Two panels (spillgate, round-robin) of requests per second per backend over time.
fn svg(reports: &[&Report], seconds: u64) -> String {
    let (w, h, pad) = (900.0, 220.0, 36.0);
    let colors = ["#2e90fa", "#12b76a", "#f79009"];
    let max = reports
        .iter()
        .flat_map(|r| r.offered.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        (h + pad) * reports.len() as f64 + 20.0
    );
    for (i, r) in reports.iter().enumerate() {
        let top = i as f64 * (h + pad) + 24.0;
        out.push_str(&format!(
            "<text x=\"40\" y=\"{}\" font-weight=\"bold\">{}: requests per second served by each backend (grey: offered)</text>\n",
            top - 6.0,
            r.name
        ));
        out.push_str(&format!(
            "<rect x=\"40\" y=\"{top}\" width=\"{}\" height=\"{h}\" fill=\"none\" stroke=\"#ccc\"/>\n",
            w - 60.0
        ));
        let x = |s: usize| 40.0 + s as f64 * (w - 60.0) / seconds as f64;
        let y = |v: f64| top + h - v * h / max;
        let line = |vals: &[u64], color: &str, width: f64| {
            let pts: Vec<String> = vals
                .iter()
                .enumerate()
                .map(|(s, v)| format!("{:.1},{:.1}", x(s), y(*v as f64)))
                .collect();
            format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\" points=\"{}\"/>\n",
                pts.join(" ")
            )
        };
        out.push_str(&line(&r.offered[..seconds as usize], "#bbb", 1.5));
        for (b, vals) in r.per_backend.iter().enumerate() {
            out.push_str(&line(vals, colors[b], 2.0));
            out.push_str(&format!(
                "<text x=\"{}\" y=\"{}\" fill=\"{}\">{} (priority {})</text>\n",
                w - 190.0,
                top + 16.0 + b as f64 * 15.0,
                colors[b],
                BACKENDS[b].0,
                BACKENDS[b].1
            ));
        }
        out.push_str(&format!(
            "<text x=\"4\" y=\"{}\">{max:.0}</text><text x=\"4\" y=\"{}\">0</text>\n",
            top + 10.0,
            top + h
        ));
    }
    out.push_str("</svg>\n");
    out
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let seconds = if full { 600 } else { 60 };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let reports = rt.block_on(async {
        vec![
            run("spillgate", spillgate, seconds).await,
            run("round-robin (nginx)", round_robin, seconds).await,
            run("oracle", oracle, seconds).await,
        ]
    });
    println!(
        "routing quality, {seconds} s simulated: load 4 -> 36 -> 4 req/s; ptu 9.7 req/s at priority 1, two pay-as-you-go at 19.4 req/s each at priority 2\n"
    );
    println!("| strategy | priority-1 share while it can carry the load | priority-1 use while over its capacity | client-visible 429s | upstream attempts per success |");
    println!("|---|---:|---:|---:|---:|");
    for r in &reports {
        println!(
            "| {} | {:.1}% | {:.1}% | {:.2}% | {:.4} |",
            r.name,
            100.0 * r.ptu_share_under,
            100.0 * r.ptu_use_over,
            100.0 * r.client_429,
            r.attempts_per_success
        );
    }
    if full {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/routing.svg");
        std::fs::write(&path, svg(&[&reports[0], &reports[1]], seconds)).unwrap();
        println!("\nplot: {}", path.display());
    }
    // The smoke pass checks the headline properties so the benchmark cannot silently rot.
    let s = &reports[0];
    assert!(s.attempts_per_success < 1.01, "{}", s.attempts_per_success);
    assert!(s.ptu_share_under > 0.95, "{}", s.ptu_share_under);
}
