//! `spillgate demo`: the product working on a laptop with no Azure account.
//!
//! Starts, in one process, three simulated Azure OpenAI resources with Azure-like
//! per-deployment limits (a small "PTU" at priority 1 and two pay-as-you-go resources at
//! priority 2, all answering 429 + Retry-After when over their limits and sending
//! `x-ratelimit-remaining-*`), and the gateway in front of them. With `--load` it drives
//! a load that ramps above the PTU's capacity and back down, and prints a per-backend
//! table every second: traffic spills to priority 2 while the PTU is throttled and
//! returns when it recovers.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use spillgate_mock::{Limits, MockBackend, MockConfig};

use crate::app::App;

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Drive traffic through the gateway and print a live per-backend table.
    #[arg(long)]
    pub load: bool,
    /// How long `--load` runs, in seconds.
    #[arg(long, default_value_t = 40)]
    pub seconds: u64,
    /// Highest offered load during `--load`, in requests per second.
    #[arg(long, default_value_t = 45)]
    pub peak_rps: u32,
    /// Exit when the load ends instead of serving on until Ctrl-C.
    #[arg(long, requires = "load")]
    pub exit: bool,
    /// Where the gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
}

const CLIENT_KEY: &str = "sk-spillgate-demo";
const BACKEND_KEY: &str = "demo-backend-key";

struct SimBackend {
    name: &'static str,
    priority: u32,
    rpm: u32,
    tpm: u32,
    deployment: Option<&'static str>,
}

const SIMULATED: [SimBackend; 3] = [
    SimBackend {
        name: "ptu-eastus",
        priority: 1,
        rpm: 900,
        tpm: 900_000,
        deployment: Some("gpt4o-ptu"),
    },
    SimBackend {
        name: "paygo-canada",
        priority: 2,
        rpm: 1200,
        tpm: 1_200_000,
        deployment: None,
    },
    SimBackend {
        name: "paygo-france",
        priority: 2,
        rpm: 1200,
        tpm: 1_200_000,
        deployment: None,
    },
];

/// The gateway config for the simulated backends, as a user would write it.
fn demo_config(listen: SocketAddr, urls: &[String]) -> String {
    let mut text = format!(
        "[server]\nlisten = \"{listen}\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[auth]\nclient_keys = [\"env:SPILLGATE_DEMO_CLIENT_KEY\"]\n\n[cooldown]\ndefault_429 = \"1s\"\n"
    );
    for (sim, url) in SIMULATED.iter().zip(urls) {
        text.push_str(&format!(
            "\n[[backends]]\nname = \"{}\"\nkind = \"azure\"\nurl = \"{url}\"\npriority = {}\napi_key = \"env:SPILLGATE_DEMO_BACKEND_KEY\"\n",
            sim.name, sim.priority
        ));
        if let Some(d) = sim.deployment {
            text.push_str(&format!("deployments = {{ \"gpt-4o\" = \"{d}\" }}\n"));
        }
    }
    text
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let mut mocks = Vec::new();
    for sim in &SIMULATED {
        let cfg = MockConfig {
            name: sim.name.to_string(),
            latency: Duration::from_millis(30),
            limits: Some(Limits {
                rpm: sim.rpm,
                tpm: sim.tpm,
                window: Duration::from_secs(1),
            }),
            expect_api_key: Some(BACKEND_KEY.to_string()),
            record_bodies: false,
            ..MockConfig::default()
        };
        mocks.push(MockBackend::start(cfg).await?);
    }
    let urls: Vec<String> = mocks.iter().map(MockBackend::url).collect();
    let text = demo_config(args.listen, &urls);
    let client_key =
        std::env::var("SPILLGATE_DEMO_CLIENT_KEY").unwrap_or_else(|_| CLIENT_KEY.to_string());
    let config = spillgate_core::config::load(
        &text,
        &|var| match var {
            "SPILLGATE_DEMO_CLIENT_KEY" => Some(client_key.clone()),
            "SPILLGATE_DEMO_BACKEND_KEY" => Some(BACKEND_KEY.to_string()),
            _ => None,
        },
        &|_| Err("not used".into()),
    )
    .map_err(|e| anyhow::anyhow!("demo config: {e}"))?;
    let app = App::new(config)?;
    let running = crate::server::start(Arc::clone(&app))
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (is something else using it? try --listen 127.0.0.1:0)",
                args.listen
            )
        })?;
    let gw = format!("http://{}", running.addr);
    let admin = crate::admin::start(Arc::clone(&app)).await?;

    println!("spillgate demo: three simulated Azure OpenAI resources and the gateway in front of them.\n");
    println!("  {:<14} {:>8}  {:>9}  url", "backend", "priority", "limit");
    for (sim, url) in SIMULATED.iter().zip(&urls) {
        println!(
            "  {:<14} {:>8}  {:>5} RPM  {url}",
            sim.name, sim.priority, sim.rpm
        );
    }
    println!("\nGateway: {gw}   client key: {client_key}");
    if let Some(a) = &admin {
        println!(
            "Dashboard: http://{}/   (metrics: http://{}/metrics)\n",
            a.addr, a.addr
        );
    }
    println!("The config it runs (spillgate.toml):\n");
    for line in text.lines() {
        println!("    {line}");
    }
    println!("\nTry it:");
    println!(
        "  curl -si {gw}/v1/chat/completions -H 'Authorization: Bearer {client_key}' -H 'Content-Type: application/json' \\\n    -d '{{\"model\":\"gpt-4o\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'"
    );
    println!("\n  # Python, official SDK (pip install openai):");
    println!("  from openai import OpenAI, AzureOpenAI");
    println!("  client = OpenAI(base_url=\"{gw}/v1\", api_key=\"{client_key}\")");
    println!("  # or: AzureOpenAI(azure_endpoint=\"{gw}\", api_key=\"{client_key}\", api_version=\"2024-10-21\")");
    println!("  print(client.chat.completions.create(model=\"gpt-4o\", messages=[{{\"role\": \"user\", \"content\": \"hi\"}}]))");
    println!("\nThe `x-spillgate-backend` response header says which backend answered.");

    if args.load {
        println!(
            "\nDriving load for {} s (peak {} req/s; the PTU takes {} req/s)...\n",
            args.seconds,
            args.peak_rps,
            SIMULATED[0].rpm / 60
        );
        drive_load(&app, &mocks, running.addr, &client_key, &args).await?;
        if args.exit {
            running.shutdown().await;
            for m in mocks {
                m.shutdown().await;
            }
            return Ok(());
        }
        println!("\nThe gateway is still running at {gw} for the snippets above. Ctrl-C stops.");
    } else {
        println!("\nRun `spillgate demo --load` to watch traffic spill to priority 2 and come back. Ctrl-C stops.");
    }
    let _ = tokio::signal::ctrl_c().await;
    running.shutdown().await;
    Ok(())
}

/// Offered load at `t` of a run of `total` seconds: up to the peak and back down, so the
/// PTU is exceeded in the middle and not at either end.
fn offered_rps(t: f64, total: f64, peak: f64) -> f64 {
    let x = (t / total).clamp(0.0, 1.0);
    let low = peak * 0.2;
    let shape = if x < 0.35 {
        x / 0.35
    } else if x < 0.65 {
        1.0
    } else {
        (1.0 - x) / 0.35
    };
    low + (peak - low) * shape.clamp(0.0, 1.0)
}

#[derive(Default)]
struct ClientCounts {
    ok: AtomicU64,
    throttled: AtomicU64,
    other: AtomicU64,
    by_backend: std::sync::Mutex<BTreeMap<String, u64>>,
}

async fn drive_load(
    app: &Arc<App>,
    mocks: &[MockBackend],
    addr: SocketAddr,
    key: &str,
    args: &DemoArgs,
) -> anyhow::Result<()> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let counts = Arc::new(ClientCounts::default());
    let body = Bytes::from_static(br#"{"model":"gpt-4o","messages":[{"role":"user","content":"Summarise the benefits of priority tiers."}],"max_tokens":50}"#);
    let uri: http::Uri = format!("http://{addr}/v1/chat/completions").parse()?;
    let auth = format!("Bearer {key}");
    let tty = std::io::stdout().is_terminal();
    let started = tokio::time::Instant::now();
    let total = args.seconds.max(1) as f64;
    let mut last_hits: Vec<(u64, u64)> = mocks.iter().map(|m| (m.hits(), m.hits_429())).collect();
    let mut last = (0u64, 0u64, 0u64);
    let mut next_report = started + Duration::from_secs(1);
    let mut sent = 0u64;
    let mut ideal = 0.0f64;
    let mut last_t = 0.0f64;
    let mut inflight = tokio::task::JoinSet::new();
    let mut p1_served = 0u64;
    let mut all_served = 0u64;

    while started.elapsed().as_secs_f64() < total {
        let t = started.elapsed().as_secs_f64();
        let rps = offered_rps(t, total, f64::from(args.peak_rps));
        // Requests due so far: the running integral of the offered rate; the fractional
        // remainder carries over to the next slice.
        ideal += rps * (t - last_t);
        last_t = t;
        while (sent as f64) < ideal {
            sent += 1;
            let req = http::Request::post(uri.clone())
                .header("authorization", &auth)
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))?;
            let client = client.clone();
            let counts = Arc::clone(&counts);
            if inflight.len() < 512 {
                inflight.spawn(async move {
                    match client.request(req).await {
                        Ok(resp) => {
                            let status = resp.status().as_u16();
                            let backend = resp
                                .headers()
                                .get(crate::proxy::HEADER_BACKEND)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_string);
                            let _ = resp.into_body().collect().await;
                            match status {
                                200..=299 => counts.ok.fetch_add(1, Ordering::Relaxed),
                                429 => counts.throttled.fetch_add(1, Ordering::Relaxed),
                                _ => counts.other.fetch_add(1, Ordering::Relaxed),
                            };
                            if let (Some(b), true) = (backend, status < 300) {
                                if let Ok(mut m) = counts.by_backend.lock() {
                                    *m.entry(b).or_default() += 1;
                                }
                            }
                        }
                        Err(_) => {
                            counts.other.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        }
        while inflight.try_join_next().is_some() {}

        if tokio::time::Instant::now() >= next_report {
            next_report += Duration::from_secs(1);
            let now = app.clock.now_ms();
            let snap = app.snapshot.load();
            let ok = counts.ok.load(Ordering::Relaxed);
            let thr = counts.throttled.load(Ordering::Relaxed);
            let oth = counts.other.load(Ordering::Relaxed);
            if tty {
                print!("\x1b[2J\x1b[H");
            }
            println!(
                "t={:>3}s  offered {:>5.1} req/s | client got: {:>3} ok, {:>2} 429, {:>2} other",
                started.elapsed().as_secs(),
                rps,
                ok - last.0,
                thr - last.1,
                oth - last.2
            );
            last = (ok, thr, oth);
            for (i, m) in mocks.iter().enumerate() {
                let (h, h429) = (m.hits(), m.hits_429());
                let served = (h - last_hits[i].0) - (h429 - last_hits[i].1);
                let b = &snap.backends[i];
                if b.cfg.priority == 1 {
                    p1_served += served;
                }
                all_served += served;
                // The state of the demo model's deployment on this backend.
                let state = match b.cooldown_for("gpt-4o", now) {
                    None => "ready".to_string(),
                    Some(c) => format!(
                        "COOLING {}ms ({})",
                        c.until_ms.saturating_sub(now),
                        c.reason.as_str()
                    ),
                };
                let bar = "#".repeat(usize::try_from(served / 2).unwrap_or(0).min(40));
                println!(
                    "  p{} {:<14} {:>3} req/s served  {:>3} 429s  {:<20} {bar}",
                    b.cfg.priority,
                    b.cfg.name,
                    served,
                    h429 - last_hits[i].1,
                    state
                );
                last_hits[i] = (h, h429);
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    while inflight.join_next().await.is_some() {}

    let ok = counts.ok.load(Ordering::Relaxed);
    let thr = counts.throttled.load(Ordering::Relaxed);
    let oth = counts.other.load(Ordering::Relaxed);
    println!("\nSummary: {sent} requests sent; {ok} succeeded, {thr} got 429 from the gateway, {oth} other.");
    if let Ok(m) = counts.by_backend.lock() {
        for (b, n) in m.iter() {
            println!("  served by {b:<14} {n}");
        }
    }
    if all_served > 0 {
        println!(
            "  priority 1 served {:.0}% of the successful requests; the rest spilled to priority 2 while it was throttled.",
            p1_served as f64 * 100.0 / all_served as f64
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_ramps_above_the_ptu_and_back() {
        let ptu_rps = f64::from(SIMULATED[0].rpm) / 60.0;
        assert!(offered_rps(0.0, 40.0, 45.0) < ptu_rps);
        assert!(offered_rps(20.0, 40.0, 45.0) > ptu_rps * 2.0);
        assert!(offered_rps(40.0, 40.0, 45.0) < ptu_rps);
    }

    #[test]
    fn demo_config_is_valid() {
        let urls = vec![
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".into(),
            "http://127.0.0.1:3".into(),
        ];
        let text = demo_config("127.0.0.1:0".parse().unwrap(), &urls);
        let c = spillgate_core::config::load(&text, &|_| Some("k".into()), &|_| Err(String::new()))
            .unwrap();
        assert_eq!(c.backends.len(), 3);
        let route = c.table.route_for("gpt-4o", &c.backends).unwrap();
        assert_eq!(c.table.routes[route].pool.tiers.len(), 2);
    }
}
