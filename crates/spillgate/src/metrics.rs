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
///
/// Each thread also keeps the handles it used in a map of its own ([`LOCAL`]): the shared
/// map's read lock was two atomic read-modify-write instructions per update, and such
/// an instruction costs 15-20 cycles however uncontended (a JSON request made five
/// updates). A thread's map is keyed by the cache's id as well, unique to the cache: a
/// reloaded config's caches never find an old one's handles, which stay in the map,
/// unused, until it is full and starts again ([`LOCAL_HANDLES`]).
pub struct HandleCache<M> {
    id: u64,
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
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        HandleCache {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            map: std::sync::RwLock::new(HashMap::default()),
        }
    }
}

/// A handle of either kind the request path updates, as a thread's map holds it.
#[derive(Clone)]
pub enum LocalHandle {
    Counter(Counter),
    Histogram(Histogram),
}

/// A metric type a [`HandleCache`] holds.
pub trait Handle: Clone {
    fn local(self) -> LocalHandle;
    fn from_local(h: &LocalHandle) -> Option<&Self>;
}

impl Handle for Counter {
    fn local(self) -> LocalHandle {
        LocalHandle::Counter(self)
    }
    fn from_local(h: &LocalHandle) -> Option<&Self> {
        match h {
            LocalHandle::Counter(c) => Some(c),
            LocalHandle::Histogram(_) => None,
        }
    }
}

impl Handle for Histogram {
    fn local(self) -> LocalHandle {
        LocalHandle::Histogram(self)
    }
    fn from_local(h: &LocalHandle) -> Option<&Self> {
        match h {
            LocalHandle::Histogram(h) => Some(h),
            LocalHandle::Counter(_) => None,
        }
    }
}

/// A thread's map holds at most this many handles; past it, it starts again empty. Only
/// config reloads make it grow past what one snapshot's caches hold (their handles stay
/// in it under their old caches' ids until then). The keys are bounded by the config
/// (backends, clients, status classes, priorities, models named in it): far fewer.
const LOCAL_HANDLES: usize = 4096;

type LocalMap = HashMap<(u64, u64), LocalHandle, BuildHasherDefault<KeyHasher>>;

thread_local! {
    /// This thread's handles, by cache id and key.
    static LOCAL: std::cell::RefCell<LocalMap> = std::cell::RefCell::new(HashMap::default());
}

impl<M: Handle> HandleCache<M> {
    /// Runs `f` on the handle for `key`, made by `make` (a `get_or_create` on the family)
    /// the first time.
    pub fn with<R>(&self, key: u64, make: impl FnOnce() -> M, mut f: impl FnMut(&M) -> R) -> R {
        let local = (self.id, key);
        // `try_with`: while the thread's storage is torn down, the shared map serves.
        let found = LOCAL
            .try_with(|map| {
                let map = map.try_borrow().ok()?;
                Some(f(M::from_local(map.get(&local)?)?))
            })
            .ok()
            .flatten();
        if let Some(r) = found {
            return r;
        }
        let m = self.shared(key, make);
        let r = f(&m);
        let _ = LOCAL.try_with(|map| {
            if let Ok(mut map) = map.try_borrow_mut() {
                if map.len() >= LOCAL_HANDLES {
                    map.clear();
                }
                map.insert(local, m.local());
            }
        });
        r
    }

    /// The handle for `key` from the shared map, made by `make` the first time.
    fn shared(&self, key: u64, make: impl FnOnce() -> M) -> M {
        if let Ok(map) = self.map.read() {
            if let Some(m) = map.get(&key) {
                return m.clone();
            }
        }
        let m = make();
        match self.map.write() {
            Ok(mut map) => map.entry(key).or_insert(m).clone(),
            Err(_) => m,
        }
    }
}

/// Hashes the `u64` keys of [`HandleCache`] and the `(id, key)` pairs of a thread's map:
/// each `u64` mixed into the state by a multiply, then the high half folded into the low
/// one (the table picks buckets by the low bits, which a product alone leaves depending
/// on the key's low bits only).
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
        let x = (self.0.rotate_left(29) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn handles_update_their_own_series_from_every_thread() {
        let family: Family<Labels, Counter> = Family::default();
        let series = |name: &'static str| family.get_or_create(&vec![("backend", name.into())]);
        let (a, b) = (HandleCache::<Counter>::default(), HandleCache::default());
        let made = Cell::new(0);
        let make = |name| {
            made.set(made.get() + 1);
            series(name).clone()
        };
        // The same key in two caches: two series, never mixed up.
        for _ in 0..3 {
            a.with(7, || make("a"), |c| c.inc());
            b.with(7, || make("b"), |c| c.inc_by(10));
        }
        assert_eq!(series("a").get(), 3);
        assert_eq!(series("b").get(), 30);
        assert_eq!(made.get(), 2);
        // Found in this thread's own map, each under its cache.
        let local = |cache: &HandleCache<Counter>| {
            LOCAL.with(|m| {
                matches!(
                    m.borrow().get(&(cache.id, 7)),
                    Some(LocalHandle::Counter(_))
                )
            })
        };
        assert!(local(&a) && local(&b));
        // Another thread: its own map is empty, the shared one has the handles.
        std::thread::scope(|s| {
            s.spawn(|| {
                a.with(7, || panic!("made again"), |c| c.inc());
                a.with(7, || panic!("made again"), |c| c.inc());
            });
        });
        assert_eq!(series("a").get(), 5);
        // A cache made later (a reloaded config's) knows none of them.
        let c = HandleCache::<Counter>::default();
        c.with(7, || series("c").clone(), |c| c.inc());
        assert_eq!(series("c").get(), 1);
        assert_eq!(series("a").get(), 5);
    }

    #[test]
    fn a_full_thread_map_starts_again_and_keeps_counting_right() {
        let family: Family<Labels, Counter> = Family::default();
        let cache = HandleCache::<Counter>::default();
        let label = |i: u64| vec![("n", Label::Owned(i.to_string()))];
        let n = LOCAL_HANDLES as u64 + 10;
        for round in 0..2 {
            for i in 0..n {
                cache.with(i, || family.get_or_create(&label(i)).clone(), |c| c.inc());
            }
            for i in [0, 1, n / 2, n - 1] {
                assert_eq!(family.get_or_create(&label(i)).get(), round + 1, "key {i}");
            }
            assert!(LOCAL.with(|m| m.borrow().len()) <= LOCAL_HANDLES);
        }
        // A histogram cache keeps its handles the same way.
        let histograms: Family<Labels, Histogram> = Family::new_with_constructor(latency_histogram);
        let h = HandleCache::<Histogram>::default();
        for _ in 0..2 {
            h.with(
                0,
                || histograms.get_or_create(&label(0)).clone(),
                |h| h.observe(0.5),
            );
        }
        let mut out = String::new();
        let mut registry = Registry::default();
        registry.register("h", "h", histograms.clone());
        encode(&mut out, &registry).unwrap();
        assert!(out.contains("h_count{n=\"0\"} 2"), "{out}");
    }
}
