//! Prometheus metrics, served on the admin listener's `/metrics`.
//!
//! Counters and histograms are updated on the request path; the state of each backend
//! (cooling seconds left, tracked remaining capacity) is read when scraped. Label values
//! are bounded: backend and client names come from the config, models are the configured
//! names (anything else is `other`), statuses are classes, reasons a fixed set. No request
//! ids, no prompts.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::app::App;

pub type Labels = Vec<(&'static str, Label)>;

/// A label value without copying on the request path: fixed text, or a name the config
/// already holds (shared). Compared and hashed by its text, whichever form it has.
#[derive(Debug, Clone)]
pub enum Label {
    Static(&'static str),
    Shared(Arc<str>),
    Owned(String),
}

impl Label {
    pub fn as_str(&self) -> &str {
        match self {
            Label::Static(s) => s,
            Label::Shared(s) => s,
            Label::Owned(s) => s,
        }
    }
}

impl From<&'static str> for Label {
    fn from(s: &'static str) -> Label {
        Label::Static(s)
    }
}

impl From<&Arc<str>> for Label {
    fn from(s: &Arc<str>) -> Label {
        Label::Shared(Arc::clone(s))
    }
}

impl From<String> for Label {
    fn from(s: String) -> Label {
        Label::Owned(s)
    }
}

impl PartialEq for Label {
    fn eq(&self, other: &Label) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Label {}

impl Hash for Label {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// Latency buckets in seconds: 5 ms to 5 minutes (completions can take minutes).
const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

pub struct Metrics {
    registry: Registry,
    /// Scrapes refill the state gauges from scratch; one at a time, or two scrapes at
    /// once erase each other's series.
    render_lock: std::sync::Mutex<()>,
    pub requests: Family<Labels, Counter>,
    pub attempts: Family<Labels, Counter>,
    pub failovers: Family<Labels, Counter>,
    pub cooldowns: Family<Labels, Counter>,
    pub tokens: Family<Labels, Counter>,
    pub low_priority: Family<Labels, Counter>,
    pub duration: Family<Labels, Histogram>,
    pub ttfb: Family<Labels, Histogram>,
    cooling: Family<Labels, Gauge<f64, AtomicU64>>,
    remaining_tokens: Family<Labels, Gauge>,
    remaining_requests: Family<Labels, Gauge>,
    store_connected: Family<Labels, Gauge>,
    store_events: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Counts a cooldown that started for `backend` (not one that was only extended).
    pub fn cooldown_started(&self, backend: &Arc<str>, reason: &'static str) {
        self.cooldowns
            .get_or_create(&vec![
                ("backend", backend.into()),
                ("reason", reason.into()),
            ])
            .inc();
    }

    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("spillgate");
        let m = Metrics {
            registry: Registry::default(),
            render_lock: std::sync::Mutex::new(()),
            requests: Family::default(),
            attempts: Family::default(),
            failovers: Family::default(),
            cooldowns: Family::default(),
            tokens: Family::default(),
            low_priority: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
            ttfb: Family::new_with_constructor(latency_histogram),
            cooling: Family::default(),
            remaining_tokens: Family::default(),
            remaining_requests: Family::default(),
            store_connected: Family::default(),
            store_events: Family::default(),
        };
        registry.register(
            "requests",
            "Client requests answered, by backend ('-' when none), status class, priority and model",
            m.requests.clone(),
        );
        registry.register(
            "upstream_attempts",
            "Requests sent to backends, by backend and outcome (2xx, 3xx, 4xx, 429, 5xx, connect)",
            m.attempts.clone(),
        );
        registry.register(
            "failovers",
            "Requests moved from a backend to the next candidate, by the backend left and why",
            m.failovers.clone(),
        );
        registry.register(
            "cooldowns",
            "Cooldowns entered, by backend and reason (429, 5xx, connect, tripped, health, auth)",
            m.cooldowns.clone(),
        );
        registry.register(
            "tokens",
            "Tokens used (from the responses' usage), by backend and client",
            m.tokens.clone(),
        );
        registry.register(
            "low_priority_requests",
            "Low-priority requests by model: admitted (reached a backend) or refused for priority",
            m.low_priority.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to the end of its response body, by priority",
            m.duration.clone(),
        );
        registry.register(
            "time_to_first_byte_seconds",
            "Time from a request's arrival to its response headers, by priority",
            m.ttfb.clone(),
        );
        registry.register(
            "backend_cooldown_seconds",
            "Seconds left of a backend's (deployment '*') or a deployment's cooldown; 0 when ready",
            m.cooling.clone(),
        );
        registry.register(
            "capacity_remaining_tokens",
            "Tokens a deployment has left, as tracked from its rate-limit headers",
            m.remaining_tokens.clone(),
        );
        registry.register(
            "capacity_remaining_requests",
            "Requests a deployment has left in its short window, as tracked",
            m.remaining_requests.clone(),
        );
        registry.register(
            "state_store_connected",
            "1 while the shared state store (Redis) is connected, 0 while the gateway decides alone; absent without a shared store",
            m.store_connected.clone(),
        );
        registry.register(
            "state_store_operations",
            "Shared state store operations since start: sent (observations written), received (other instances' updates applied), rejected (invalid values read), errors, dropped (write queue full), local_decisions (probe claims decided without Redis)",
            m.store_events.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The exposition text, with the per-backend state read now.
    pub fn render(&self, app: &App) -> String {
        let _one_at_a_time = self.render_lock.lock();
        let snap = app.snapshot.load();
        let now = app.clock.now_ms();
        self.cooling.clear();
        self.remaining_tokens.clear();
        self.remaining_requests.clear();
        for b in &snap.backends {
            let name = Label::from(&b.cfg.name);
            let left = |st: &crate::state::BackendState| {
                st.cooldown(now)
                    .map_or(0.0, |c| (c.until_ms - now) as f64 / 1000.0)
            };
            self.cooling
                .get_or_create(&vec![("backend", name.clone()), ("deployment", "*".into())])
                .set(left(&b.state));
            // Only configured deployment names become label values: a backend without a
            // map tracks whatever model names clients send.
            let configured = |dep: &str| match &b.cfg.deployments {
                Some(map) => map.values().any(|v| v == dep),
                None => snap.config.table.model_label(dep) != "other",
            };
            for (dep, st) in b.deployments.all() {
                if !configured(&dep) {
                    continue;
                }
                let labels = vec![("backend", name.clone()), ("deployment", dep.into())];
                self.cooling.get_or_create(&labels).set(left(&st));
                let (tokens, requests) = st.capacity().available(now);
                if let Some(t) = tokens {
                    self.remaining_tokens
                        .get_or_create(&labels)
                        .set(i64::try_from(t).unwrap_or(i64::MAX));
                }
                if let Some(r) = requests {
                    self.remaining_requests
                        .get_or_create(&labels)
                        .set(i64::try_from(r).unwrap_or(i64::MAX));
                }
            }
        }
        let store = app.store.status();
        self.store_connected.clear();
        if let Some(connected) = store.connected {
            self.store_connected
                .get_or_create(&vec![("store", store.kind.into())])
                .set(i64::from(connected));
            for (kind, n) in store.counters() {
                // The store counts; the counter catches up with it (the store is chosen at
                // start, so its series never go away).
                let c = self
                    .store_events
                    .get_or_create(&vec![("store", store.kind.into()), ("kind", kind.into())]);
                let seen = c.get();
                if n > seen {
                    c.inc_by(n - seen);
                }
            }
        }
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Handles to one family's series, found by a small key the caller packs from indices
/// (backend, status class, priority...) rather than by building and SipHashing a label
/// vector on every update, the biggest cost of a metric update on the request path. A
/// handle shares its value with its series in the family, so what `/metrics` shows is the
/// same either way. Held by a config snapshot, so the indices in the keys are stable.
pub struct HandleCache<M> {
    map: std::sync::RwLock<HashMap<u64, M, BuildHasherDefault<KeyHasher>>>,
}

impl<M> std::fmt::Debug for HandleCache<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.map.read().map_or(0, |m| m.len());
        write!(f, "HandleCache({n} handles)")
    }
}

impl<M> Default for HandleCache<M> {
    fn default() -> Self {
        HandleCache {
            map: std::sync::RwLock::new(HashMap::default()),
        }
    }
}

impl<M: Clone> HandleCache<M> {
    /// Runs `f` on the handle for `key`, made by `make` (a `get_or_create` on the family)
    /// the first time.
    pub fn with<R>(&self, key: u64, make: impl FnOnce() -> M, f: impl FnOnce(&M) -> R) -> R {
        if let Ok(map) = self.map.read() {
            if let Some(m) = map.get(&key) {
                return f(m);
            }
        }
        let m = make();
        let r = f(&m);
        if let Ok(mut map) = self.map.write() {
            map.entry(key).or_insert(m);
        }
        r
    }
}

/// Hashes the `u64` keys of [`HandleCache`]: a multiply, then the high half folded into
/// the low one (the table picks buckets by the low bits, which a product alone leaves
/// depending on the key's low bits only).
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = x ^ (x >> 32);
    }
}

/// The request-path metric handles of one config snapshot.
#[derive(Debug, Default)]
pub struct RequestHandles {
    pub requests: HandleCache<Counter>,
    pub attempts: HandleCache<Counter>,
    pub ttfb: HandleCache<Histogram>,
    pub duration: HandleCache<Histogram>,
    pub tokens: HandleCache<Counter>,
}

/// `2xx`, `4xx`, ... for a status.
pub fn status_class(status: u16) -> Label {
    match status / 100 {
        1 => "1xx".into(),
        2 => "2xx".into(),
        3 => "3xx".into(),
        4 => "4xx".into(),
        5 => "5xx".into(),
        c => format!("{c}xx").into(),
    }
}
