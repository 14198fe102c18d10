//! Simulated Azure OpenAI deployments, in memory, for scenario tests and benchmarks.
//!
//! Each deployment enforces a TPM and an RPM limit as token buckets over a short window
//! (Azure grants quota per minute and enforces it over windows of a few seconds): a
//! bucket holds `limit * window / 60 s` and refills continuously. A request costs its
//! estimated tokens (body bytes / 4 plus `max_tokens`, near Azure's count at admission);
//! over the limit it gets 429 with `Retry-After` / `retry-after-ms` at once, otherwise,
//! after the backend's latency, 200 with
//! `x-ratelimit-remaining-*`, `-limit-*` and `-reset-*` headers and a `usage` object. Time
//! is tokio's, so scenarios run with paused time in milliseconds of real time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::upstream::{AttemptError, Upstream, UpstreamRequest};

/// Response headers of a simulated answer.
type Headers = Vec<(&'static str, String)>;

/// Limits of one simulated deployment.
#[derive(Debug, Clone, Copy)]
pub struct SimLimits {
    pub tpm: u64,
    pub rpm: u64,
    /// Enforcement window: the bucket holds this much of a minute's quota.
    pub window: Duration,
}

impl SimLimits {
    /// `tpm` tokens and `rpm` requests per minute, enforced over 10 s as Azure does.
    pub fn per_minute(tpm: u64, rpm: u64) -> SimLimits {
        SimLimits {
            tpm,
            rpm,
            window: Duration::from_secs(10),
        }
    }
}

/// The chat request the tests and benchmarks drive through the simulation: about 100
/// tokens by [`request_cost`] (their rates and thresholds are sized on it).
pub const SAMPLE_CHAT: &[u8] = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"Summarise the quarterly report in three bullet points."}],"max_tokens":70}"#;

/// Longest run of seconds, from `from` to the last whole second (the last one may be
/// cut short), in which `f` is zero.
pub fn longest_zero_run(seconds: &[Second], from: usize, f: impl Fn(&Second) -> u64) -> usize {
    let (mut best, mut run) = (0, 0);
    for s in &seconds[from..seconds.len().saturating_sub(1)] {
        if f(s) == 0 {
            run += 1;
            best = best.max(run);
        } else {
            run = 0;
        }
    }
    best
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    capacity: f64,
    per_ms: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: u64, window: Duration, now: Instant) -> Bucket {
        let capacity = (per_minute as f64 * window.as_secs_f64() / 60.0).max(1.0);
        Bucket {
            level: capacity,
            capacity,
            per_ms: per_minute as f64 / 60_000.0,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let ms = now.saturating_duration_since(self.at).as_secs_f64() * 1000.0;
        self.level = (self.level + ms * self.per_ms).min(self.capacity);
        self.at = now;
    }

    /// Milliseconds until `amount` is available.
    fn wait_for(&self, amount: f64) -> u64 {
        if self.level >= amount {
            0
        } else {
            ((amount - self.level) / self.per_ms).ceil() as u64
        }
    }

    /// Milliseconds until full.
    fn until_full(&self) -> u64 {
        ((self.capacity - self.level) / self.per_ms).ceil() as u64
    }
}

/// Counters of one simulated backend, also per second for time series.
#[derive(Debug, Clone, Default)]
pub struct SimStats {
    pub served: u64,
    pub throttled: u64,
    pub tokens: u64,
    /// `(served, throttled)` per second since the simulation started.
    pub per_second: Vec<(u64, u64)>,
}

#[derive(Debug)]
struct Deployment {
    tokens: Bucket,
    requests: Bucket,
}

/// One simulated backend (an Azure resource), reached as host `name`.
#[derive(Debug)]
pub struct SimBackend {
    pub name: String,
    limits: Option<SimLimits>,
    latency: Duration,
    deployments: Mutex<HashMap<String, Deployment>>,
    stats: Mutex<SimStats>,
    epoch: Instant,
}

impl SimBackend {
    pub fn stats(&self) -> SimStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn record(&self, now: Instant, served: bool, tokens: u64) {
        if let Ok(mut s) = self.stats.lock() {
            let sec =
                usize::try_from(now.saturating_duration_since(self.epoch).as_secs()).unwrap_or(0);
            if s.per_second.len() <= sec {
                s.per_second.resize(sec + 1, (0, 0));
            }
            if served {
                s.served += 1;
                s.tokens += tokens;
                s.per_second[sec].0 += 1;
            } else {
                s.throttled += 1;
                s.per_second[sec].1 += 1;
            }
        }
    }

    /// Whether a request of `tokens` would be served now, without taking anything: what an
    /// oracle that knows every backend's remaining capacity would ask.
    pub fn would_admit(&self, deployment: &str, tokens: u64) -> bool {
        let Some(l) = self.limits else {
            return true;
        };
        let now = Instant::now();
        let Ok(deps) = self.deployments.lock() else {
            return true;
        };
        match deps.get(deployment) {
            None => {
                let (t, r) = (
                    Bucket::new(l.tpm, l.window, now),
                    Bucket::new(l.rpm, l.window, now),
                );
                t.level >= tokens as f64 && r.level >= 1.0
            }
            Some(d) => {
                let (mut t, mut r) = (d.tokens, d.requests);
                t.refill(now);
                r.refill(now);
                t.level >= tokens as f64 && r.level >= 1.0
            }
        }
    }

    /// Decides one request: `Ok(headers)` to serve, `Err(headers)` to throttle.
    fn admit(&self, deployment: &str, tokens: u64, now: Instant) -> Result<Headers, Headers> {
        let Some(l) = self.limits else {
            return Ok(Vec::new());
        };
        let Ok(mut deps) = self.deployments.lock() else {
            return Ok(Vec::new());
        };
        let d = deps
            .entry(deployment.to_string())
            .or_insert_with(|| Deployment {
                tokens: Bucket::new(l.tpm, l.window, now),
                requests: Bucket::new(l.rpm, l.window, now),
            });
        d.tokens.refill(now);
        d.requests.refill(now);
        let cost = tokens as f64;
        if d.tokens.level < cost || d.requests.level < 1.0 {
            let wait = d
                .tokens
                .wait_for(cost.min(d.tokens.capacity))
                .max(d.requests.wait_for(1.0))
                .max(1);
            return Err(vec![
                ("retry-after", wait.div_ceil(1000).max(1).to_string()),
                ("retry-after-ms", wait.to_string()),
                (
                    "x-ratelimit-remaining-tokens",
                    (d.tokens.level as u64).to_string(),
                ),
                (
                    "x-ratelimit-remaining-requests",
                    (d.requests.level as u64).to_string(),
                ),
            ]);
        }
        d.tokens.level -= cost;
        d.requests.level -= 1.0;
        Ok(vec![
            (
                "x-ratelimit-limit-tokens",
                (d.tokens.capacity as u64).to_string(),
            ),
            (
                "x-ratelimit-limit-requests",
                (d.requests.capacity as u64).to_string(),
            ),
            (
                "x-ratelimit-remaining-tokens",
                (d.tokens.level as u64).to_string(),
            ),
            (
                "x-ratelimit-remaining-requests",
                (d.requests.level as u64).to_string(),
            ),
            (
                "x-ratelimit-reset-tokens",
                format!("{}ms", d.tokens.until_full()),
            ),
            (
                "x-ratelimit-reset-requests",
                format!("{}ms", d.requests.until_full()),
            ),
        ])
    }
}

/// The simulated backends, as the gateway's upstream: a request goes to the backend
/// named by its URL's host.
#[derive(Debug, Clone, Default)]
pub struct SimUpstream {
    backends: Arc<HashMap<String, Arc<SimBackend>>>,
}

/// What a simulated request costs: body bytes / 4 plus `max_tokens` (16 if unset).
pub fn request_cost(body: &[u8]) -> u64 {
    #[derive(serde::Deserialize, Default)]
    struct P {
        max_tokens: Option<u64>,
    }
    let p: P = serde_json::from_slice(body).unwrap_or_default();
    (body.len() as u64).div_ceil(4) + p.max_tokens.unwrap_or(16)
}

impl SimUpstream {
    /// Backends by name: `(name, limits, latency)`.
    pub fn new(specs: &[(&str, Option<SimLimits>, Duration)]) -> SimUpstream {
        let epoch = Instant::now();
        let backends = specs
            .iter()
            .map(|(name, limits, latency)| {
                (
                    name.to_string(),
                    Arc::new(SimBackend {
                        name: name.to_string(),
                        limits: *limits,
                        latency: *latency,
                        deployments: Mutex::new(HashMap::new()),
                        stats: Mutex::new(SimStats::default()),
                        epoch,
                    }),
                )
            })
            .collect();
        SimUpstream {
            backends: Arc::new(backends),
        }
    }

    pub fn backend(&self, name: &str) -> Option<Arc<SimBackend>> {
        self.backends.get(name).cloned()
    }
}

fn deployment_of(path: &str, body: &[u8]) -> String {
    if let Some(rest) = path.strip_prefix("/openai/deployments/") {
        return rest.split('/').next().unwrap_or("").to_string();
    }
    #[derive(serde::Deserialize, Default)]
    struct M {
        model: Option<String>,
    }
    serde_json::from_slice::<M>(body)
        .unwrap_or_default()
        .model
        .unwrap_or_default()
}

impl Upstream for SimUpstream {
    fn send<'a>(
        &'a self,
        req: UpstreamRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<http::Response<Body>, AttemptError>> {
        let backend = self.backends.get(req.authority().host()).cloned();
        let target = req.path_and_query();
        let path = target
            .split_once('?')
            .map_or(target, |(p, _)| p)
            .to_string();
        let body = req.body().clone();
        Box::pin(async move {
            let Some(b) = backend else {
                return Err(AttemptError::Connect("no such simulated backend".into()));
            };
            // Azure charges a request when it arrives, then generates: admission first,
            // the latency after (a 429 comes back at once).
            let now = Instant::now();
            let tokens = request_cost(&body);
            let deployment = deployment_of(&path, &body);
            let admitted = b.admit(&deployment, tokens, now);
            if admitted.is_ok() {
                if b.latency > timeout {
                    tokio::time::sleep(timeout).await;
                    return Err(AttemptError::FirstByteTimeout(timeout));
                }
                tokio::time::sleep(b.latency).await;
            }
            let (status, headers, json) = match admitted {
                Ok(h) => {
                    b.record(now, true, tokens);
                    let json = serde_json::json!({
                        "id": "chatcmpl-sim", "object": "chat.completion", "created": 0, "model": deployment,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("Hello from {}", b.name)}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": tokens.saturating_sub(1), "completion_tokens": 1, "total_tokens": tokens},
                    });
                    (200, h, json)
                }
                Err(h) => {
                    b.record(now, false, 0);
                    let json = serde_json::json!({"error": {"code": "429", "message": "Rate limit of your current pricing tier exceeded."}});
                    (429, h, json)
                }
            };
            let mut resp = http::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .header("x-sim-backend", b.name.as_str());
            for (k, v) in headers {
                resp = resp.header(k, v);
            }
            resp.body(Body::from(json.to_string()))
                .map_err(|e| AttemptError::Request(e.to_string()))
        })
    }
}

/// What the clients saw in one second of a driven load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Second {
    pub high_ok: u64,
    /// High-priority requests answered 429 (by the gateway or a backend).
    pub high_429: u64,
    pub low_ok: u64,
    /// Low-priority requests the gateway refused for priority.
    pub low_refused: u64,
    /// Low-priority requests answered 429 for another reason.
    pub low_429: u64,
    pub other: u64,
    /// Successful requests per backend (`x-spillgate-backend`).
    pub by_backend: std::collections::BTreeMap<String, u64>,
}

/// Sends requests through `router` for `seconds` of (tokio) time at the rates
/// `rates(t) -> (high per second, low per second)`, each request a task of its own, and
/// returns what the clients saw per second (by the second each request was sent).
pub async fn drive(
    router: crate::server::Gateway,
    seconds: u64,
    rates: impl Fn(f64) -> (f64, f64),
    body: Bytes,
    key: &str,
) -> Vec<Second> {
    use tower::ServiceExt;
    let out: Arc<Mutex<Vec<Second>>> =
        Arc::new(Mutex::new(vec![
            Second::default();
            usize::try_from(seconds).unwrap_or(0) + 1
        ]));
    let start = Instant::now();
    let step = Duration::from_millis(10);
    let (mut due_high, mut due_low) = (0.0f64, 0.0f64);
    let (mut sent_high, mut sent_low) = (0u64, 0u64);
    let mut tasks = tokio::task::JoinSet::new();
    while start.elapsed() < Duration::from_secs(seconds) {
        let t = start.elapsed().as_secs_f64();
        let (h, l) = rates(t);
        due_high += h * step.as_secs_f64();
        due_low += l * step.as_secs_f64();
        let sec = usize::try_from(start.elapsed().as_secs()).unwrap_or(0);
        let mut batch = Vec::new();
        while (sent_high as f64) < due_high {
            sent_high += 1;
            batch.push(false);
        }
        while (sent_low as f64) < due_low {
            sent_low += 1;
            batch.push(true);
        }
        for low in batch {
            let mut req = http::Request::post("/v1/chat/completions")
                .header("api-key", key)
                .header("content-type", "application/json");
            if low {
                req = req.header("x-priority", "low");
            }
            let Ok(req) = req.body(Body::from(body.clone())) else {
                continue;
            };
            let router = router.clone();
            let out = Arc::clone(&out);
            tasks.spawn(async move {
                let Ok(reply) = router.oneshot(req).await;
                let resp = reply.into_response();
                let status = resp.status().as_u16();
                let backend = resp
                    .headers()
                    .get(crate::proxy::HEADER_BACKEND)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                let refused =
                    status == 429 && body.windows(20).any(|w| w == b"low_priority_refused");
                if let Ok(mut o) = out.lock() {
                    let i = sec.min(o.len() - 1);
                    let s = &mut o[i];
                    match (low, status) {
                        (false, 200) => s.high_ok += 1,
                        (false, 429) => s.high_429 += 1,
                        (true, 200) => s.low_ok += 1,
                        (true, 429) if refused => s.low_refused += 1,
                        (true, 429) => s.low_429 += 1,
                        _ => s.other += 1,
                    }
                    if let (200, Some(b)) = (status, backend) {
                        *s.by_backend.entry(b).or_default() += 1;
                    }
                }
            });
        }
        while tasks.try_join_next().is_some() {}
        tokio::time::sleep(step).await;
    }
    while tasks.join_next().await.is_some() {}
    let result = out.lock().map(|o| o.clone()).unwrap_or_default();
    result
}

/// The gateway over simulated backends `(name, priority)` (Azure kind, reached as
/// `http://{name}`), with `extra` config appended (e.g. a `[priority]` table) and clients
/// authenticating with `key`.
pub fn gateway(
    sim: SimUpstream,
    backends: &[(&str, u32)],
    extra: &str,
    key: &str,
) -> anyhow::Result<(Arc<crate::app::App>, crate::server::Gateway)> {
    let mut text = format!("[auth]\nclient_keys = [\"env:K\"]\n{extra}\n");
    for (name, priority) in backends {
        text.push_str(&format!(
            "[[backends]]\nname = \"{name}\"\nkind = \"azure\"\nurl = \"http://{name}\"\npriority = {priority}\napi_key = \"env:K\"\n"
        ));
    }
    let config =
        spillgate_core::config::load(&text, &|_| Some(key.to_string()), &|_| Err(String::new()))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    let app = crate::app::App::with_upstream(config, Arc::new(sim))?;
    let router = crate::server::router(Arc::clone(&app));
    Ok((app, router))
}

/// A `[priority]` table reserving `tokens` and `requests` for high priority on `gpt-4o`.
pub fn priority_config(tokens: u64, requests: u64) -> String {
    format!(
        "[priority]\nstale_after = \"5s\"\n[[priority.models]]\nmodels = [\"gpt-4o\"]\nlow_priority_tpm_threshold = {tokens}\nlow_priority_rp10s_threshold = {requests}\n"
    )
}
