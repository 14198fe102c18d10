//! Request-priority throughputs against simulated Azure limits.
//!
//! `cargo bench -p spillgate --bench priority` runs each scenario for minutes of
//! simulated time (tokio's clock paused, so it takes seconds) and prints a markdown table:
//! what low- and high-priority traffic got, against the deployment's limit and the reserve
//! kept for high priority. Under `cargo test --benches` it runs a short smoke pass.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "benchmark driver"
)]

use std::time::Duration;

use bytes::Bytes;
use spillgate::sim::{drive, longest_zero_run, Second, SimLimits, SimUpstream};

const KEY: &str = "bench-key";

fn body() -> Bytes {
    Bytes::from_static(spillgate::sim::SAMPLE_CHAT)
}

fn gateway(
    backends: &[(&str, u32)],
    sim: SimUpstream,
    reserve_tokens: u64,
    reserve_requests: u64,
) -> spillgate::server::Gateway {
    spillgate::sim::gateway(
        sim,
        backends,
        &spillgate::sim::priority_config(reserve_tokens, reserve_requests),
        KEY,
    )
    .unwrap()
    .1
}

fn limits(tpm: u64, rpm: u64) -> Option<SimLimits> {
    Some(SimLimits::per_minute(tpm, rpm))
}

fn rate(seen: &[Second], from: usize, to: usize, f: impl Fn(&Second) -> u64) -> f64 {
    let to = to.min(seen.len());
    seen[from..to].iter().map(f).sum::<u64>() as f64 / (to - from).max(1) as f64
}

async fn run(secs: u64) {
    let cost = spillgate::sim::request_cost(&body()) as f64;
    let latency = Duration::from_millis(300);
    println!("| scenario | traffic | served req/s | of capacity | notes |");
    println!("|---|---|---:|---:|---|");

    // Single priority: only low, offered at 2x capacity; 60k TPM, 30% reserve.
    let sim = SimUpstream::new(&[("ptu", limits(60_000, 600), latency)]);
    let seen = drive(
        gateway(&[("ptu", 1)], sim.clone(), 3_000, 30),
        secs,
        |_| (0.0, 20.0),
        body(),
        KEY,
    )
    .await;
    let capacity = 1_000.0 / cost;
    let low = rate(&seen, 10, secs as usize, |s| s.low_ok);
    println!(
        "| single priority | low only, 20 req/s offered | {low:.2} | {:.0}% ({:.0}% of limit - reserve) | longest second-run with nothing served: {} s; backend 429s: {} |",
        100.0 * low / capacity,
        100.0 * low / (capacity * 0.7),
        longest_zero_run(&seen, 10, |s| s.low_ok),
        sim.backend("ptu").unwrap().stats().throttled
    );

    // Cycle: 30 s phases of high 6 req/s + low flood, then the flood alone.
    let sim = SimUpstream::new(&[("ptu", limits(60_000, 600), latency)]);
    let phase = |t: f64| ((t / 30.0) as u64).is_multiple_of(2);
    let seen = drive(
        gateway(&[("ptu", 1)], sim.clone(), 3_000, 30),
        secs.max(60),
        |t| if phase(t) { (6.0, 20.0) } else { (0.0, 20.0) },
        body(),
        KEY,
    )
    .await;
    let high_429: u64 = seen.iter().map(|s| s.high_429).sum();
    println!(
        "| cycle, high phase | high 6 req/s + low 20 req/s | high {:.2}, low {:.2} | {:.0}% | high-priority 429s: {high_429} |",
        rate(&seen, 5, 30, |s| s.high_ok),
        rate(&seen, 5, 30, |s| s.low_ok),
        100.0 * (rate(&seen, 5, 30, |s| s.high_ok) + rate(&seen, 5, 30, |s| s.low_ok)) / capacity
    );
    println!(
        "| cycle, low phase | low 20 req/s | {:.2} | {:.0}% | |",
        rate(&seen, 35, 60, |s| s.low_ok),
        100.0 * rate(&seen, 35, 60, |s| s.low_ok) / capacity
    );

    // Spill: small PTU (30k TPM) at priority 1, large pay-as-you-go (240k) at priority 2.
    let sim = SimUpstream::new(&[
        ("ptu", limits(30_000, 300), latency),
        ("paygo", limits(240_000, 2_400), latency),
    ]);
    let seen = drive(
        gateway(&[("ptu", 1), ("paygo", 2)], sim.clone(), 3_000, 3),
        secs,
        |_| (2.0, 20.0),
        body(),
        KEY,
    )
    .await;
    let on = |b: &'static str| {
        rate(&seen, 5, secs as usize, move |s| {
            s.by_backend.get(b).copied().unwrap_or(0)
        })
    };
    let spill_line = format!(
        "| spill | high 2 req/s + low 20 req/s | {:.2} (ptu {:.2}, paygo {:.2}) | ptu {:.0}% | low refused: {}, high 429s: {} |",
        on("ptu") + on("paygo"),
        on("ptu"),
        on("paygo"),
        100.0 * on("ptu") / (500.0 / cost),
        seen.iter().map(|s| s.low_refused).sum::<u64>(),
        seen.iter().map(|s| s.high_429).sum::<u64>()
    );
    println!("{spill_line}");

    // Pass-over: high priority only at 2.5x the PTU, no [priority] table.
    let sim = SimUpstream::new(&[
        ("ptu", limits(60_000, 600), latency),
        ("paygo", limits(600_000, 6_000), latency),
    ]);
    let (_, router) =
        spillgate::sim::gateway(sim.clone(), &[("ptu", 1), ("paygo", 2)], "", KEY).unwrap();
    let seen = drive(router, secs, |_| (25.0, 0.0), body(), KEY).await;
    let ok: u64 = seen.iter().map(|s| s.high_ok).sum();
    let (ptu, paygo) = (
        sim.backend("ptu").unwrap().stats(),
        sim.backend("paygo").unwrap().stats(),
    );
    let attempts = ptu.served + ptu.throttled + paygo.served + paygo.throttled;
    println!(
        "| pass-over | high 25 req/s, ptu takes 9.7 | {:.2} (ptu {:.2}) | ptu {:.0}% | {:.4} upstream attempts per success, {} upstream 429s |",
        ok as f64 / secs as f64,
        ptu.served as f64 / secs as f64,
        100.0 * ptu.served as f64 / secs as f64 / capacity,
        attempts as f64 / ok.max(1) as f64,
        ptu.throttled + paygo.throttled
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not: a short smoke run.
    let full = std::env::args().any(|a| a == "--bench");
    let secs = if full { 600 } else { 40 };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    println!(
        "priority admission, {secs} s of simulated time per scenario (request ~{} tokens):\n",
        spillgate::sim::request_cost(&body())
    );
    rt.block_on(run(secs));
}
