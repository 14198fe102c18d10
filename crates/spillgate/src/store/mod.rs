//! Where what the gateway learns about its backends goes, besides its own memory.
//!
//! Every request decides from this instance's local view (`state.rs`): atomics and short
//! mutexes, read without waiting on anything. A [`StateStore`] is told what this instance
//! observes (a cooldown started, a deployment's remaining capacity) and keeps the local
//! view in step with other instances:
//!
//! - [`MemoryStore`] (the default) keeps everything to this instance. Its methods do
//!   nothing, so a single gateway pays nothing for the abstraction.
//! - [`RedisStore`] (`[state] redis_url`) writes each observation through to Redis from a
//!   background task (the request never waits for it), and merges what other instances
//!   write into the local view as their events arrive, re-reading everything every
//!   `state.poll` in case an event was lost. The one decision made cluster-wide on the
//!   request path is who probes a recovering backend: one Redis call, bounded by
//!   `state.timeout` (a few milliseconds) for all of a request's claims together; past
//!   it, after a claim that got no answer, or without Redis, the request decides alone,
//!   as a single instance would.

mod redis;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use spillgate_core::outcome::Cooldown;

use crate::app::App;
use crate::state::BackendState;

pub use self::redis::{ping as ping_redis, ClusterProbe, RedisStore};

/// After the cluster says another instance is probing a backend: how long this one
/// leaves it alone before asking again.
pub const REMOTE_PROBE_BUSY: Duration = Duration::from_millis(100);

/// What a cluster-wide probe claim decided, for all the slots asked at once.
#[derive(Debug)]
pub enum ProbeClaim {
    /// Per slot asked, in order: this request's (released when dropped), or already
    /// recovered by another instance's probe (`None`: no probe needed there).
    Claimed(Vec<Option<ClusterProbe>>),
    /// Another instance is probing (one of) them: nothing was taken.
    Busy,
    /// No shared answer (no shared store, or it is unreachable or slow): the instance
    /// decides alone.
    Local,
}

/// What one request may still spend waiting on the shared store: `state.timeout` for all
/// its probe claims together (a request may meet several recovering backends, and retry),
/// and nothing more once a claim got no shared answer. Then the rest of the request
/// decides locally instead of waiting on a slow Redis again.
#[derive(Debug)]
pub struct StoreBudget {
    left_us: AtomicU64,
}

impl StoreBudget {
    pub fn new(total: Duration) -> StoreBudget {
        StoreBudget {
            left_us: AtomicU64::new(u64::try_from(total.as_micros()).unwrap_or(u64::MAX)),
        }
    }

    pub fn left(&self) -> Duration {
        Duration::from_micros(self.left_us.load(Ordering::Relaxed))
    }

    /// Takes `d` off what is left.
    pub fn spend(&self, d: Duration) {
        let d = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let _ = self
            .left_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                Some(l.saturating_sub(d))
            });
    }

    /// Nothing more for this request.
    pub fn exhaust(&self) {
        self.left_us.store(0, Ordering::Relaxed);
    }
}

/// How the store is doing, for `/readyz`, `/admin/state` and `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct StoreStatus {
    pub kind: &'static str,
    /// `None` for a store with nothing to connect to.
    pub connected: Option<bool>,
    /// The address without credentials.
    pub url: Option<String>,
    pub prefix: Option<String>,
    /// This instance's id in shared state and events.
    pub instance: Option<String>,
    /// When the connection last came up or went down (unix ms).
    pub since_ms: Option<u64>,
    pub last_error: Option<String>,
    /// Observations written to the shared store.
    pub sent: u64,
    /// Updates from other instances that changed the local view.
    pub received: u64,
    /// Values read from the store that were refused.
    pub rejected: u64,
    /// Store operations that failed.
    pub errors: u64,
    /// Observations not written because the write queue was full.
    pub dropped: u64,
    /// Probe claims decided locally: the store was unreachable, did not answer in time, or
    /// the request had spent its time on it.
    pub local_decisions: u64,
}

impl StoreStatus {
    /// The counters, by the name `/admin/state` and the metric's `kind` label give them.
    pub fn counters(&self) -> [(&'static str, u64); 6] {
        [
            ("sent", self.sent),
            ("received", self.received),
            ("rejected", self.rejected),
            ("errors", self.errors),
            ("dropped", self.dropped),
            ("local_decisions", self.local_decisions),
        ]
    }

    /// As JSON; `detail` (the admin port) adds the address, prefix and counters.
    pub fn json(&self, detail: bool) -> serde_json::Value {
        let mut v = serde_json::json!({
            "kind": self.kind,
            "connected": self.connected,
        });
        if detail {
            v["url"] = serde_json::json!(self.url);
            v["prefix"] = serde_json::json!(self.prefix);
            v["instance"] = serde_json::json!(self.instance);
            v["since_ms"] = serde_json::json!(self.since_ms);
            v["last_error"] = serde_json::json!(self.last_error);
            for (name, n) in self.counters() {
                v[name] = serde_json::json!(n);
            }
        }
        v
    }
}

/// Where observations about backends go besides the local view (see the module docs).
/// Observations are reported after they are applied locally; a store must never block
/// the caller.
#[async_trait::async_trait]
pub trait StateStore: Send + Sync {
    /// Whether other instances share the state (the probe claim is worth a call).
    fn shared(&self) -> bool {
        false
    }

    /// Starts background work, once a runtime is at hand; calling it again does nothing.
    fn start(self: Arc<Self>, _app: &Arc<App>) {}

    /// A cooldown this instance started or extended (`deployment: None`: the whole
    /// backend).
    fn cooled(&self, _backend: &str, _deployment: Option<&str>, _cooldown: Cooldown) {}

    /// This instance took in a deployment's rate-limit headers.
    fn capacity_observed(&self, _backend: &str, _deployment: &str, _state: &BackendState) {}

    /// What one request may spend waiting on this store (see [`StoreBudget`]).
    fn request_budget(&self) -> Duration {
        Duration::ZERO
    }

    /// Asks, in one step, for the cluster's probe slots of a recovering backend (`None`)
    /// and/or deployments, each for at most `ttl`: all of them or none. Waits at most what
    /// is left of the request's `budget`, and takes the wait off it.
    async fn claim_probes(
        &self,
        _backend: &str,
        _targets: &[Option<&str>],
        _ttl: Duration,
        _budget: &StoreBudget,
    ) -> ProbeClaim {
        ProbeClaim::Local
    }

    fn status(&self) -> StoreStatus;
}

/// This instance's memory only: the local view is the whole state.
#[derive(Debug, Default)]
pub struct MemoryStore;

#[async_trait::async_trait]
impl StateStore for MemoryStore {
    fn status(&self) -> StoreStatus {
        StoreStatus {
            kind: "memory",
            ..StoreStatus::default()
        }
    }
}

/// The store a config asks for.
pub fn from_config(config: &spillgate_core::config::Config) -> anyhow::Result<Arc<dyn StateStore>> {
    Ok(match &config.state {
        None => Arc::new(MemoryStore),
        Some(redis) => Arc::new(RedisStore::new(redis.clone())?),
    })
}

/// The longest cooldown `config` can produce: the bound for deadlines read from a shared
/// store (anything later, past the clock skew allowed between instances, is refused).
pub fn longest_cooldown(config: &spillgate_core::config::Config) -> Duration {
    let c = &config.cooldown;
    let mut longest = c
        .max
        .max(c.default_429)
        .max(c.default_5xx)
        .max(c.default_connect);
    for b in &config.backends {
        if let Some(br) = &b.breaker {
            longest = longest.max(br.policy.trip);
        }
        if let Some(h) = &b.health_check {
            longest = longest.max(h.interval);
        }
    }
    longest + c.max_jitter + Duration::from_secs(1)
}
