//! Backend state shared through Redis by several gateway instances.
//!
//! Layout (all under `state.prefix`, `spillgate` by default; `{target}` is the backend
//! name, or `backend/deployment` for one deployment):
//!
//! | key | value | written by |
//! |---|---|---|
//! | `{prefix}:cool:{target}` | `{until_ms}:{reason}`, expires after the deadline | the cooldown script: the later deadline wins |
//! | `{prefix}:cap:{target}` | `{observed_ms};{tokens};{requests}` | the capacity script: the newest observation wins |
//! | `{prefix}:probe:{target}` | a probe token, or `recovered` | the probe scripts: `SET NX PX` semantics |
//! | `{prefix}:budget:{route}` | hash: instance id → `{requests}:{retries}:{at_ms}` | the budget script |
//! | `{prefix}:events` | pub/sub channel | the scripts above, in the same atomic step |
//!
//! One background task owns the connection. It connects (and reconnects, with backoff),
//! subscribes to the event channel, re-publishes this instance's live cooldowns and
//! capacity and reads the shared state back in full (so instances converge within a
//! poll interval of Redis returning), then serves: events are merged into the local
//! view as they arrive, observations queued by requests are written, and the shared
//! state is re-read every `state.poll`. The request path never waits on this task:
//! observations go into a coalescing queue (one pending write per key; a full queue
//! drops, never blocks), and the only Redis call a request makes, the probe claim, has
//! its own timeout of a few milliseconds (`state.timeout`, for all of a request's
//! claims together).
//!
//! What is read from Redis only ever updates state this instance has: the backends of its
//! config and the deployments its config or its own requests named. A deployment a
//! request names for the first time reads the shared value at the next poll.
//!
//! The connection is supervised here rather than by the client library's connection
//! manager, because the gateway must know when the link goes and comes back: to log it
//! once each way, to decide alone while it is down, and to re-sync when it returns.

use spillgate_core::outcome::millis;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, IntoConnectionInfo, Script};
use spillgate_core::config::RedisConfig;
use spillgate_core::outcome::Cooldown;
use spillgate_core::shared::{self, BudgetShare, Event, SharedCapacity, Target};
use tokio::sync::Notify;

use super::{ProbeClaim, StateStore, StoreBudget, StoreStatus};
use crate::app::App;
use crate::state::BackendState;

/// Longest any background operation may take before the link is taken for lost.
const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);

/// Reconnection backoff: from this, doubling, up to `RECONNECT_MAX`, with jitter.
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// Most pending writes per kind; past it new observations are dropped (and counted).
/// The keys are bounded by the config (backends, their tracked deployments), so this is
/// only reached when Redis is far behind.
const MAX_PENDING: usize = 4096;

/// Capacity observations expire from Redis after this (they are stale long before).
const CAPACITY_TTL_MS: u64 = 600_000;

/// How long a successful probe's `recovered` mark stays, for instances that missed the
/// event.
const RECOVERED_MARK_MS: u64 = 10_000;

/// The longest a probe key may live; one with a longer (or no) expiry is not ours.
const PROBE_KEY_MAX_MS: u64 = 60_000;

/// A shown invalid value is followed by at most one more warning in this long.
const INVALID_WARN_EVERY_MS: u64 = 60_000;

/// Records a cooldown; the later deadline wins. A stored deadline that is over, or later
/// than any configurable cooldown, or not a deadline at all, does not block a real one.
/// A new cooldown also ends the `recovered` mark (or a stale probe) of its target. The
/// script touches no key but its own two before it publishes, so a wrong-typed key
/// elsewhere cannot keep the event from going out.
const COOL_SCRIPT: &str = r"
local new = tonumber(ARGV[1])
local now = tonumber(ARGV[4])
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'string' then
  local t = tonumber(string.match(cur, '^(%d+):'))
  if t and t > now and t <= now + tonumber(ARGV[5]) and t >= new then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[6], ARGV[7])
return 1
";

/// Records a capacity observation unless a newer one is stored (one dated far in the
/// future is garbage and replaced).
const CAPACITY_SCRIPT: &str = r"
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'string' then
  local t = tonumber(string.match(cur, '^(%d+);'))
  if t and t >= tonumber(ARGV[1]) and t <= tonumber(ARGV[4]) + 5000 then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('PUBLISH', ARGV[5], ARGV[6])
return 1
";

/// Claims the probe slots of KEYS (a backend and/or its deployment), all or none: 0 when
/// another instance holds one, else per key 1 (now ours) or 2 (another instance's probe
/// succeeded: no probe needed). A value that is not ours to respect (wrong type, no
/// expiry, an expiry longer than any we set) is replaced.
const CLAIM_SCRIPT: &str = r"
local codes = {}
for i, k in ipairs(KEYS) do
  codes[i] = 1
  local cur = redis.pcall('GET', k)
  if type(cur) == 'string' then
    local ttl = redis.call('PTTL', k)
    if ttl > 0 and ttl <= tonumber(ARGV[3]) then
      if cur == 'recovered' then
        codes[i] = 2
      elseif cur ~= ARGV[1] then
        return 0
      end
    end
  end
end
for i, k in ipairs(KEYS) do
  if codes[i] == 1 then
    redis.call('SET', k, ARGV[1], 'PX', ARGV[2])
  end
end
return codes
";

/// Deletes KEYS[1] if it still holds ARGV[1]: a probe slot given back if it is still
/// ours, a refused value unless something else was written meanwhile.
const RELEASE_SCRIPT: &str = r"
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
";

/// A probe succeeded: marks the target recovered and tells everyone, if the slot is still
/// this probe's. A cooldown since (from any instance) deleted it, and a newer probe may
/// hold it: then the probe's answer is out of date and nothing is marked.
const RECOVERED_SCRIPT: &str = r"
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], 'recovered', 'PX', ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
";

/// Stores this instance's share of a route's retry budget and returns the others'
/// (dropping those not renewed since ARGV[4]: their instance stopped or lost Redis).
const BUDGET_SCRIPT: &str = r"
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
local out = {}
local oldest = tonumber(ARGV[4])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local at = tonumber(string.match(all[i + 1], ':(%d+)$'))
    if at == nil or at < oldest then
      redis.call('HDEL', KEYS[1], all[i])
    elseif #out < 1000 then
      out[#out + 1] = all[i + 1]
    end
  end
end
return out
";

struct Scripts {
    cool: Script,
    capacity: Script,
    claim: Script,
    release: Script,
    recovered: Script,
    budget: Script,
}

impl Scripts {
    fn new() -> Scripts {
        Scripts {
            cool: Script::new(COOL_SCRIPT),
            capacity: Script::new(CAPACITY_SCRIPT),
            claim: Script::new(CLAIM_SCRIPT),
            release: Script::new(RELEASE_SCRIPT),
            recovered: Script::new(RECOVERED_SCRIPT),
            budget: Script::new(BUDGET_SCRIPT),
        }
    }

    fn all(&self) -> [&Script; 6] {
        [
            &self.cool,
            &self.capacity,
            &self.claim,
            &self.release,
            &self.recovered,
            &self.budget,
        ]
    }
}

/// What a finished probe leaves to write.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ProbeOp {
    Release(String),
    Recovered(String),
}

/// One pending write per key: a later value replaces the pending one when `newer` says
/// so; a new key is taken only while fewer than `MAX_PENDING` are waiting. False when the
/// write was dropped.
fn keep_newest<K: std::hash::Hash + Eq, V>(
    map: &mut HashMap<K, V>,
    key: K,
    value: V,
    newer: impl FnOnce(&V, &V) -> bool,
) -> bool {
    if let Some(old) = map.get_mut(&key) {
        if newer(&value, old) {
            *old = value;
        }
        return true;
    }
    if map.len() >= MAX_PENDING {
        return false;
    }
    map.insert(key, value);
    true
}

/// Writes waiting for the background task, one per key: a newer observation of the same
/// key replaces (or merges into) the pending one. Probe outcomes are kept per slot and
/// token: each script acts only on its own token, so outcomes of different probes never
/// replace one another.
#[derive(Default)]
struct Pending {
    cooldowns: HashMap<Target, Cooldown>,
    capacity: HashMap<Target, SharedCapacity>,
    probes: HashMap<(Target, String), ProbeOp>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.cooldowns.is_empty() && self.capacity.is_empty() && self.probes.is_empty()
    }
}

/// The queue between requests and the background writer.
#[derive(Default)]
struct WriteQueue {
    pending: Mutex<Pending>,
    wake: Notify,
    dropped: AtomicU64,
}

impl WriteQueue {
    fn push(&self, f: impl FnOnce(&mut Pending) -> bool) {
        let queued = match self.pending.lock() {
            Ok(mut p) => f(&mut p),
            Err(_) => false,
        };
        if queued {
            self.wake.notify_one();
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn cooldown(&self, t: Target, c: Cooldown) {
        self.push(|p| {
            keep_newest(&mut p.cooldowns, t, c, |new, old| {
                new.until_ms > old.until_ms
            })
        });
    }

    fn capacity(&self, t: Target, c: SharedCapacity) {
        self.push(|p| {
            keep_newest(&mut p.capacity, t, c, |new, old| {
                new.observed_ms >= old.observed_ms
            })
        });
    }

    fn probe(&self, t: Target, op: ProbeOp) {
        self.push(|p| {
            let token = match &op {
                ProbeOp::Release(k) | ProbeOp::Recovered(k) => k.clone(),
            };
            // A recovery implies the release of the same slot: it is not undone by it.
            keep_newest(&mut p.probes, (t, token), op, |_, old| {
                !matches!(old, ProbeOp::Recovered(_))
            })
        });
    }

    fn take(&self) -> Pending {
        self.pending
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default()
    }
}

/// This instance's cluster-wide probe slot of one backend or deployment. Dropping it gives
/// the slot back (queued, never blocking); after [`ClusterProbe::recovered`] it marks the
/// backend recovered for every instance instead.
pub struct ClusterProbe {
    queue: Arc<WriteQueue>,
    target: Target,
    token: String,
    recovered: bool,
}

impl ClusterProbe {
    pub fn recovered(&mut self) {
        self.recovered = true;
    }
}

impl std::fmt::Debug for ClusterProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterProbe")
            .field("target", &self.target)
            .field("recovered", &self.recovered)
            .finish()
    }
}

impl Drop for ClusterProbe {
    fn drop(&mut self) {
        let token = std::mem::take(&mut self.token);
        let op = if self.recovered {
            ProbeOp::Recovered(token)
        } else {
            ProbeOp::Release(token)
        };
        self.queue.probe(self.target.clone(), op);
    }
}

#[derive(Default)]
struct Stats {
    sent: AtomicU64,
    received: AtomicU64,
    rejected: AtomicU64,
    errors: AtomicU64,
    local_decisions: AtomicU64,
    last_invalid_warn_ms: AtomicU64,
    last_error_warn_ms: AtomicU64,
    last_claim_warn_ms: AtomicU64,
}

/// Whether a warning last given at `last` (unix ms) may be given again now; claims the
/// slot when it may, so concurrent callers warn once.
fn warn_slot(last: &AtomicU64, now: u64) -> bool {
    let prev = last.load(Ordering::Relaxed);
    now.saturating_sub(prev) >= INVALID_WARN_EVERY_MS
        && last
            .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

#[derive(Default)]
struct Link {
    since_ms: Option<u64>,
    last_error: Option<String>,
}

/// Backend state shared through Redis (see the module docs).
pub struct RedisStore {
    cfg: RedisConfig,
    client: redis::Client,
    /// This instance's id: its own events are skipped, its budget share is its field.
    instance: String,
    channel: String,
    /// The live connection; `None` while Redis is unreachable.
    conn: ArcSwapOption<MultiplexedConnection>,
    /// Connected and re-synced (what views report as connected).
    synced: AtomicBool,
    queue: Arc<WriteQueue>,
    scripts: Scripts,
    started: AtomicBool,
    probe_seq: AtomicU64,
    stats: Stats,
    link: Mutex<Link>,
}

/// Why serving a connection ended.
enum Ended {
    Lost(String),
    Stopped,
}

fn describe(e: &redis::RedisError) -> String {
    // Errors carry the command at most, never the password.
    e.to_string()
}

/// Whether an error means the connection is gone (rather than one command failing).
fn is_link_error(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// How long a connection must stay up before the reconnection backoff starts over from
/// `RECONNECT_MIN`. A Redis that accepts connections and drops them at once (a proxy
/// whose server is gone, a server refusing clients) is then not hammered with
/// reconnections and full re-syncs.
const STABLE_AFTER: Duration = Duration::from_secs(10);

/// The waits between connection attempts: doubling, at most `RECONNECT_MAX`, so Redis is
/// found again within about two seconds of coming back.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff {
            next: RECONNECT_MIN,
        }
    }

    /// The wait before the next attempt, after one that failed (`up: None`) or after a
    /// connection that was lost after being up for `up`. Only a connection that stayed up
    /// for `STABLE_AFTER` starts the backoff over (and is retried at once).
    fn wait(&mut self, up: Option<Duration>) -> Duration {
        if up.is_some_and(|u| u >= STABLE_AFTER) {
            self.next = RECONNECT_MIN;
            return Duration::ZERO;
        }
        let d = self.next;
        self.next = (d * 2).clamp(RECONNECT_MIN, RECONNECT_MAX);
        d
    }
}

/// Sleeps `d` plus up to a quarter of it, so instances that lost Redis together do not
/// come back in step.
async fn sleep_jittered(d: Duration) {
    if d.is_zero() {
        return;
    }
    let jitter = fastrand::u64(0..=millis(d) / 4);
    tokio::time::sleep(d + Duration::from_millis(jitter)).await;
}

fn now_unix_ms() -> u64 {
    spillgate_core::outcome::unix_ms(std::time::SystemTime::now())
}

impl RedisStore {
    pub fn new(cfg: RedisConfig) -> anyhow::Result<RedisStore> {
        let client = client_for(&cfg)?;
        let instance = format!("{:012x}", fastrand::u64(..) & 0xffff_ffff_ffff);
        Ok(RedisStore {
            channel: format!("{}:events", cfg.prefix),
            cfg,
            client,
            instance,
            conn: ArcSwapOption::empty(),
            synced: AtomicBool::new(false),
            queue: Arc::new(WriteQueue::default()),
            scripts: Scripts::new(),
            started: AtomicBool::new(false),
            probe_seq: AtomicU64::new(0),
            stats: Stats::default(),
            link: Mutex::new(Link::default()),
        })
    }

    fn key(&self, kind: &str, t: &Target) -> String {
        format!("{}:{kind}:{}", self.cfg.prefix, t.path())
    }

    fn connected(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    fn set_link(&self, since_ms: Option<u64>, error: Option<String>) {
        if let Ok(mut l) = self.link.lock() {
            if since_ms.is_some() {
                l.since_ms = since_ms;
            }
            if error.is_some() {
                l.last_error = error;
            }
        }
    }

    /// A value read from Redis was refused: counted, and logged at most once a
    /// minute (a corrupted key is read every poll).
    fn invalid(&self, key: &str, why: &str) {
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        if warn_slot(&self.stats.last_invalid_warn_ms, now_unix_ms()) {
            tracing::warn!(
                key,
                problem = why,
                "ignored an invalid value in Redis (shown once a minute)"
            );
        } else {
            tracing::debug!(key, problem = why, "ignored an invalid value in Redis");
        }
    }

    /// Opens the command connection and the event subscription.
    async fn connect(&self) -> Result<(MultiplexedConnection, redis::aio::PubSub), String> {
        let limit = self.cfg.connect_timeout;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(limit))
            .set_response_timeout(Some(BACKGROUND_TIMEOUT));
        let mut conn = match tokio::time::timeout(
            limit + BACKGROUND_TIMEOUT,
            self.client
                .get_multiplexed_async_connection_with_config(&config),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(describe(&e)),
            Err(_) => return Err(format!("no connection within {limit:?}")),
        };
        let mut pubsub = match tokio::time::timeout(limit, self.client.get_async_pubsub()).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(describe(&e)),
            Err(_) => return Err(format!("no subscription connection within {limit:?}")),
        };
        match tokio::time::timeout(BACKGROUND_TIMEOUT, pubsub.subscribe(&self.channel)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(describe(&e)),
            Err(_) => return Err("SUBSCRIBE got no answer".to_string()),
        }
        for s in self.scripts.all() {
            match tokio::time::timeout(BACKGROUND_TIMEOUT, s.load_async(&mut conn)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(describe(&e)),
                Err(_) => return Err("SCRIPT LOAD got no answer".to_string()),
            }
        }
        Ok((conn, pubsub))
    }

    /// The connection's whole life: connect, re-sync, serve, and again when it is lost.
    async fn supervise(self: Arc<Self>, app: Weak<App>) {
        let url = self.cfg.display_url();
        let mut backoff = Backoff::new();
        // Whether the current outage was reported (one warning per outage).
        let mut reported = false;
        let mut ever = false;
        loop {
            if app.strong_count() == 0 {
                return;
            }
            let (conn, pubsub) = match self.connect().await {
                Ok(c) => c,
                Err(e) => {
                    if !reported {
                        tracing::warn!(redis = %url, error = %e, "cannot reach Redis: serving from this instance's own state and retrying in the background");
                        reported = true;
                        self.set_link(Some(now_unix_ms()), None);
                    } else {
                        tracing::debug!(redis = %url, error = %e, "Redis still unreachable");
                    }
                    self.set_link(None, Some(e));
                    sleep_jittered(backoff.wait(None)).await;
                    continue;
                }
            };
            let up_since = tokio::time::Instant::now();
            self.conn.store(Some(Arc::new(conn.clone())));
            let resync = match app.upgrade() {
                Some(a) => self.resync(&a, conn.clone()).await,
                None => return,
            };
            let ended = match resync {
                Err(e) => Ended::Lost(e),
                Ok(()) => {
                    self.synced.store(true, Ordering::Release);
                    self.set_link(Some(now_unix_ms()), None);
                    if reported {
                        tracing::info!(redis = %url, "connection to Redis is back; shared state re-synced");
                    } else if !ever {
                        tracing::info!(redis = %url, prefix = %self.cfg.prefix, instance = %self.instance, "sharing backend state through Redis");
                    }
                    reported = false;
                    ever = true;
                    self.serve(&app, conn, pubsub).await
                }
            };
            self.synced.store(false, Ordering::Release);
            self.conn.store(None);
            match ended {
                Ended::Stopped => return,
                Ended::Lost(e) => {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    self.set_link(Some(now_unix_ms()), Some(e.clone()));
                    if !reported {
                        tracing::warn!(redis = %url, error = %e, "lost the connection to Redis: serving from this instance's own state and reconnecting");
                        reported = true;
                    }
                    if let Some(a) = app.upgrade() {
                        forget_remote_budgets(&a);
                    }
                    sleep_jittered(backoff.wait(Some(up_since.elapsed()))).await;
                }
            }
        }
    }

    /// After (re)connecting: tells Redis what this instance knows that is still live
    /// (what it learnt while Redis was away, or everything after Redis lost its data),
    /// then reads back what the others know.
    async fn resync(&self, app: &Arc<App>, mut conn: MultiplexedConnection) -> Result<(), String> {
        self.rebase_clock(app);
        let snap = app.snapshot.load_full();
        let now = app.clock.now_ms();
        for (target, state) in targets(&snap) {
            if let Some(c) = state.cooldown(now) {
                if shared::is_shared(c.reason) {
                    self.queue.cooldown(target.clone(), c);
                }
            }
            if target.deployment.is_some() {
                if let Some(c) = SharedCapacity::of(&state.capacity()) {
                    self.queue.capacity(target, c);
                }
            }
        }
        drop(snap);
        self.flush(app, &mut conn).await?;
        self.poll(app, &mut conn).await
    }

    async fn serve(
        &self,
        app: &Weak<App>,
        mut conn: MultiplexedConnection,
        pubsub: redis::aio::PubSub,
    ) -> Ended {
        let mut events = pubsub.into_on_message();
        let mut tick = tokio::time::interval(self.cfg.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is immediate; the re-sync has just read everything.
        tick.tick().await;
        loop {
            tokio::select! {
                msg = events.next() => {
                    let Some(msg) = msg else {
                        return Ended::Lost("the event subscription closed".to_string());
                    };
                    let Some(app) = app.upgrade() else { return Ended::Stopped };
                    self.on_event(&app, msg.get_payload_bytes());
                }
                _ = tick.tick() => {
                    let Some(app) = app.upgrade() else { return Ended::Stopped };
                    if let Err(e) = self.poll(&app, &mut conn).await {
                        return Ended::Lost(e);
                    }
                }
                _ = self.queue.wake.notified() => {
                    let Some(app) = app.upgrade() else { return Ended::Stopped };
                    if let Err(e) = self.flush(&app, &mut conn).await {
                        return Ended::Lost(e);
                    }
                }
            }
        }
    }

    /// Runs one background operation: a link error (or no answer in time) ends the
    /// connection; any other error is counted and logged, and the caller moves on.
    async fn op<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<Option<T>, String> {
        match tokio::time::timeout(BACKGROUND_TIMEOUT, fut).await {
            Ok(Ok(v)) => Ok(Some(v)),
            Ok(Err(e)) if is_link_error(&e) => Err(format!("{what}: {}", describe(&e))),
            Ok(Err(e)) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                let msg = format!("{what}: {}", describe(&e));
                if warn_slot(&self.stats.last_error_warn_ms, now_unix_ms()) {
                    tracing::warn!(error = %msg, "a Redis operation failed (shown once a minute)");
                } else {
                    tracing::debug!(error = %msg, "a Redis operation failed");
                }
                self.set_link(None, Some(msg));
                Ok(None)
            }
            Err(_) => Err(format!("{what}: no answer within {BACKGROUND_TIMEOUT:?}")),
        }
    }

    /// Runs a script that stores and publishes, counting the write when it took (the
    /// scripts answer 1 then, 0 when a newer value stood).
    async fn write(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = redis::RedisResult<i64>>,
    ) -> Result<(), String> {
        if self.op(what, fut).await? == Some(1) {
            self.stats.sent.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Brings the clock in line with the system clock before shared deadlines are read or
    /// written (see `Clock`): a step of the system clock after start would otherwise skew
    /// every deadline this instance shares.
    fn rebase_clock(&self, app: &App) {
        let moved = app.clock.rebase();
        if moved.unsigned_abs() >= 1_000 {
            tracing::info!(
                moved_ms = moved,
                "the system clock was stepped; shared deadlines follow it"
            );
        }
    }

    /// Writes what requests queued. Probe outcomes go first: a cooldown queued with them
    /// is newer than the probe's answer, or at least not older, and must end any
    /// `recovered` mark the probe leaves.
    async fn flush(&self, app: &Arc<App>, conn: &mut MultiplexedConnection) -> Result<(), String> {
        let pending = self.queue.take();
        if pending.is_empty() {
            return Ok(());
        }
        for ((target, _), op) in pending.probes {
            let key = self.key("probe", &target);
            match op {
                ProbeOp::Release(token) => {
                    let _: Option<i64> = self
                        .op(
                            "probe release",
                            self.scripts.release.key(key).arg(token).invoke_async(conn),
                        )
                        .await?;
                }
                ProbeOp::Recovered(token) => {
                    let event =
                        shared::encode_event(&self.instance, &Event::Recovered(target.clone()));
                    self.write(
                        "probe recovered",
                        self.scripts
                            .recovered
                            .key(key)
                            .arg(token)
                            .arg(RECOVERED_MARK_MS)
                            .arg(&self.channel)
                            .arg(event)
                            .invoke_async(conn),
                    )
                    .await?;
                }
            }
        }
        let now = app.clock.now_ms();
        let max_ahead = max_ahead_ms(&app.snapshot.load().config);
        for (target, c) in pending.cooldowns {
            if c.until_ms <= now {
                continue;
            }
            let event = shared::encode_event(
                &self.instance,
                &Event::Cooled(target.clone(), shared::encode_cooldown(c)),
            );
            let ttl = c.until_ms - now + 60_000;
            self.write(
                "cooldown",
                self.scripts
                    .cool
                    .key(self.key("cool", &target))
                    .key(self.key("probe", &target))
                    .arg(c.until_ms)
                    .arg(c.reason.as_str())
                    .arg(ttl)
                    .arg(now)
                    .arg(max_ahead.saturating_add(shared::MAX_SKEW_MS))
                    .arg(&self.channel)
                    .arg(event)
                    .invoke_async(conn),
            )
            .await?;
        }
        for (target, c) in pending.capacity {
            let value = shared::encode_capacity(&c);
            let event = shared::encode_event(
                &self.instance,
                &Event::Capacity(target.clone(), value.clone()),
            );
            self.write(
                "capacity",
                self.scripts
                    .capacity
                    .key(self.key("cap", &target))
                    .arg(c.observed_ms)
                    .arg(value)
                    .arg(CAPACITY_TTL_MS)
                    .arg(now)
                    .arg(&self.channel)
                    .arg(event)
                    .invoke_async(conn),
            )
            .await?;
        }
        Ok(())
    }

    /// Reads the shared cooldown and capacity of every state this instance has (its
    /// config's backends, the deployments it tracks) into the local view, deletes
    /// cooldowns no config produces, and trades retry-budget shares.
    async fn poll(&self, app: &Arc<App>, conn: &mut MultiplexedConnection) -> Result<(), String> {
        self.rebase_clock(app);
        let snap = app.snapshot.load_full();
        let targets = targets(&snap);
        if !targets.is_empty() {
            let mut cmd = redis::cmd("MGET");
            for (t, _) in &targets {
                cmd.arg(self.key("cool", t));
            }
            for (t, _) in &targets {
                cmd.arg(self.key("cap", t));
            }
            let values: Option<Vec<Option<Vec<u8>>>> =
                self.op("read", cmd.query_async(conn)).await?;
            let values = values.unwrap_or_default();
            let now = app.clock.now_ms();
            let max_ahead = max_ahead_ms(&snap.config);
            let (cools, caps) = values.split_at(values.len().min(targets.len()));
            let mut refused = Vec::new();
            for ((t, state), v) in targets.iter().zip(cools) {
                if let Some(v) = v {
                    let key = self.key("cool", t);
                    if !self.apply_cooldown(&key, state, v, now, max_ahead) {
                        refused.push((key, v));
                    }
                }
            }
            for ((t, state), v) in targets.iter().zip(caps) {
                if let (Some(v), Some(_)) = (v, &t.deployment) {
                    self.apply_capacity(&self.key("cap", t), state, v, now);
                }
            }
            // A refused deadline would be read (and refused) again at every poll, and a
            // far-future one would stay until it expired, if ever: gone, unless a real
            // cooldown replaced it meanwhile.
            for (key, v) in refused {
                let _: Option<i64> = self
                    .op(
                        "delete refused",
                        self.scripts
                            .release
                            .key(key)
                            .arg(v.as_slice())
                            .invoke_async(conn),
                    )
                    .await?;
            }
        }
        // Retry budgets: this instance's counts out, the others' in.
        let poll_ms = millis(self.cfg.poll);
        let stale = (3 * poll_ms).max(3_000);
        for (route, rt) in snap.config.table.routes.iter().zip(&snap.routes) {
            let now = app.clock.now_ms();
            let (requests, retries) = rt
                .budget
                .lock()
                .map(|b| b.local_counts(now))
                .unwrap_or_default();
            let share = shared::encode_budget(BudgetShare { requests, retries }, now);
            let key = format!("{}:budget:{}", self.cfg.prefix, route.name);
            let window = millis(route.retry.budget.window);
            let others: Option<Vec<Vec<u8>>> = self
                .op(
                    "budget",
                    self.scripts
                        .budget
                        .key(&key)
                        .arg(&self.instance)
                        .arg(share)
                        .arg(window.saturating_add(stale))
                        .arg(now.saturating_sub(stale))
                        .invoke_async(conn),
                )
                .await?;
            let Some(others) = others else { continue };
            let sum = shared::sum_budget(others.iter().filter_map(|v| {
                let text = std::str::from_utf8(v).ok();
                match text.map(|t| shared::decode_budget(t, now, stale)) {
                    Some(Ok(share)) => share,
                    Some(Err(e)) => {
                        self.invalid(&key, &e.0);
                        None
                    }
                    None => {
                        self.invalid(&key, "not text");
                        None
                    }
                }
            }));
            if let Ok(mut b) = rt.budget.lock() {
                b.set_remote(sum.requests, sum.retries);
            }
        }
        Ok(())
    }

    /// Merges a shared cooldown into `state`. `false` when the value was refused (not a
    /// cooldown, or a deadline further ahead than any configured cooldown).
    fn apply_cooldown(
        &self,
        key: &str,
        state: &BackendState,
        v: &[u8],
        now: u64,
        max_ahead: u64,
    ) -> bool {
        let Ok(text) = std::str::from_utf8(v) else {
            self.invalid(key, "not text");
            return false;
        };
        match shared::decode_cooldown(text, now, max_ahead) {
            Ok(Some(c)) => {
                if state.cool_at(c, now).extended {
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Ok(None) => true,
            Err(e) => {
                self.invalid(key, &e.0);
                false
            }
        }
    }

    fn apply_capacity(&self, key: &str, state: &BackendState, v: &[u8], now: u64) {
        let Ok(text) = std::str::from_utf8(v) else {
            self.invalid(key, "not text");
            return;
        };
        match shared::decode_capacity(text, now) {
            Ok(Some(c)) => {
                if state.merge_remote_capacity(&c) {
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(None) => {}
            Err(e) => self.invalid(key, &e.0),
        }
    }

    /// Merges another instance's event into the local view.
    fn on_event(&self, app: &Arc<App>, payload: &[u8]) {
        let channel = self.channel.as_str();
        let Ok(text) = std::str::from_utf8(payload) else {
            self.invalid(channel, "event is not text");
            return;
        };
        let (origin, event) = match shared::decode_event(text) {
            Ok(e) => e,
            Err(e) => {
                self.invalid(channel, &e.0);
                return;
            }
        };
        if origin == self.instance {
            return;
        }
        let snap = app.snapshot.load();
        let target = match &event {
            Event::Cooled(t, _) | Event::Capacity(t, _) | Event::Recovered(t) => t,
        };
        // Events about backends or deployments this config does not have are not ours.
        let Some(state) = state_of(&snap, target) else {
            return;
        };
        let now = app.clock.now_ms();
        match &event {
            Event::Cooled(_, v) => {
                let max_ahead = max_ahead_ms(&snap.config);
                self.apply_cooldown(channel, &state, v.as_bytes(), now, max_ahead);
            }
            Event::Capacity(_, v) => self.apply_capacity(channel, &state, v.as_bytes(), now),
            Event::Recovered(_) => {
                if state.remote_recovered(now) {
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// The client for `cfg`: the address from the URL, the credentials from their references.
fn client_for(cfg: &RedisConfig) -> anyhow::Result<redis::Client> {
    let info = cfg
        .display_url()
        .into_connection_info()
        .map_err(|e| anyhow::anyhow!("state.redis_url: {e}"))?;
    let mut settings = info.redis_settings().clone();
    if let Some(u) = &cfg.username {
        settings = settings.set_username(u);
    }
    if let Some(p) = &cfg.password {
        settings = settings.set_password(p.expose());
    }
    let info = info.set_redis_settings(settings);
    redis::Client::open(info).map_err(|e| anyhow::anyhow!("state.redis_url: {e}"))
}

/// Connects to `cfg`'s Redis as the gateway would and asks for its version (for
/// `spillgate check --probe`). The error says what failed, never the password.
pub async fn ping(cfg: &RedisConfig) -> Result<String, String> {
    let client = client_for(cfg).map_err(|e| e.to_string())?;
    let limit = cfg.connect_timeout;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(BACKGROUND_TIMEOUT));
    let mut conn = match tokio::time::timeout(
        limit + BACKGROUND_TIMEOUT,
        client.get_multiplexed_async_connection_with_config(&config),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(describe(&e)),
        Err(_) => return Err(format!("no connection within {limit:?}")),
    };
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .map_err(|e| describe(&e))?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map_or("version unknown".to_string(), |v| {
            format!("Redis {}", v.trim())
        });
    // The scripts the gateway runs must load (some managed Redis offerings restrict Lua).
    let mut conn2 = conn.clone();
    for s in Scripts::new().all() {
        s.load_async(&mut conn2).await.map_err(|e| describe(&e))?;
    }
    Ok(version)
}

/// How far ahead a shared deadline may be: the longest cooldown `config` produces.
fn max_ahead_ms(config: &spillgate_core::config::Config) -> u64 {
    millis(crate::store::longest_cooldown(config))
}

/// Every state of `snap` that is shared: each backend as a whole and each deployment it
/// tracks.
fn targets(snap: &crate::app::Snapshot) -> Vec<(Target, Arc<BackendState>)> {
    let mut out = Vec::new();
    for b in &snap.backends {
        out.push((
            Target {
                backend: b.cfg.name.to_string(),
                deployment: None,
            },
            Arc::clone(&b.state),
        ));
        for (d, state) in b.deployments.all() {
            out.push((
                Target {
                    backend: b.cfg.name.to_string(),
                    deployment: Some(d),
                },
                state,
            ));
        }
    }
    out
}

/// The local state an event's target names, if this instance has it. Never creates one:
/// what other instances (or anyone with access to Redis) say cannot fill this instance's
/// bounded set of tracked deployments; a deployment this instance starts tracking later
/// reads the shared value at the next poll.
fn state_of(snap: &crate::app::Snapshot, t: &Target) -> Option<Arc<BackendState>> {
    let b = snap.backends.iter().find(|b| *b.cfg.name == *t.backend)?;
    match &t.deployment {
        None => Some(Arc::clone(&b.state)),
        Some(d) => b.deployments.find(d),
    }
}

/// Without Redis each instance bounds its own retries again.
fn forget_remote_budgets(app: &App) {
    for rt in &app.snapshot.load().routes {
        if let Ok(mut b) = rt.budget.lock() {
            b.set_remote(0, 0);
        }
    }
}

#[async_trait::async_trait]
impl StateStore for RedisStore {
    fn shared(&self) -> bool {
        true
    }

    fn start(self: Arc<Self>, app: &Arc<App>) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        handle.spawn(self.supervise(Arc::downgrade(app)));
    }

    fn cooled(&self, backend: &str, deployment: Option<&str>, cooldown: Cooldown) {
        if !shared::is_shared(cooldown.reason) {
            return;
        }
        self.queue.cooldown(
            Target {
                backend: backend.to_string(),
                deployment: deployment.map(str::to_string),
            },
            cooldown,
        );
    }

    fn capacity_observed(&self, backend: &str, deployment: &str, state: &BackendState) {
        if let Some(c) = SharedCapacity::of(&state.capacity()) {
            self.queue.capacity(
                Target {
                    backend: backend.to_string(),
                    deployment: Some(deployment.to_string()),
                },
                c,
            );
        }
    }

    fn request_budget(&self) -> Duration {
        self.cfg.timeout
    }

    async fn claim_probes(
        &self,
        backend: &str,
        wanted: &[Option<&str>],
        ttl: Duration,
        budget: &StoreBudget,
    ) -> ProbeClaim {
        let limit = budget.left();
        let conn = match self.conn.load_full() {
            Some(c) if !limit.is_zero() => c,
            _ => {
                // Redis is unreachable, or this request already waited its share on it.
                budget.exhaust();
                self.stats.local_decisions.fetch_add(1, Ordering::Relaxed);
                return ProbeClaim::Local;
            }
        };
        let mut conn = (*conn).clone();
        let targets: Vec<Target> = wanted
            .iter()
            .map(|d| Target {
                backend: backend.to_string(),
                deployment: d.map(str::to_string),
            })
            .collect();
        let token = format!(
            "{}-{}",
            self.instance,
            self.probe_seq.fetch_add(1, Ordering::Relaxed)
        );
        let ttl_ms = millis(ttl).clamp(1_000, PROBE_KEY_MAX_MS);
        let mut claim = self.scripts.claim.prepare_invoke();
        for t in &targets {
            claim.key(self.key("probe", t));
        }
        claim.arg(&token).arg(ttl_ms).arg(PROBE_KEY_MAX_MS);
        let started = tokio::time::Instant::now();
        let answer =
            tokio::time::timeout(limit, claim.invoke_async::<redis::Value>(&mut conn)).await;
        budget.spend(started.elapsed());
        let codes: Option<Vec<i64>> = match answer {
            Ok(Ok(redis::Value::Int(0))) => return ProbeClaim::Busy,
            Ok(Ok(v)) => redis::from_redis_value(v).ok(),
            Ok(Err(e)) => {
                tracing::debug!(error = %describe(&e), "probe claim failed; deciding locally");
                None
            }
            Err(_) => {
                // The claim may still land: give the slots back, so they are not held.
                for t in &targets {
                    self.queue.probe(t.clone(), ProbeOp::Release(token.clone()));
                }
                // Connected, yet no answer within the whole `state.timeout`: while Redis
                // stays this slow, every instance probes recovering backends on its own.
                if limit >= self.cfg.timeout
                    && self.connected()
                    && warn_slot(&self.stats.last_claim_warn_ms, now_unix_ms())
                {
                    tracing::warn!(
                        timeout = ?self.cfg.timeout,
                        "a probe claim got no answer from Redis within state.timeout: recovering backends are probed by each instance on its own while Redis is this slow (shown once a minute)"
                    );
                }
                None
            }
        };
        match codes {
            Some(codes) if codes.len() == targets.len() => ProbeClaim::Claimed(
                targets
                    .into_iter()
                    .zip(codes)
                    .map(|(target, code)| {
                        (code == 1).then(|| ClusterProbe {
                            queue: Arc::clone(&self.queue),
                            target,
                            token: token.clone(),
                            recovered: false,
                        })
                    })
                    .collect(),
            ),
            _ => {
                // No shared answer: the rest of this request decides locally.
                budget.exhaust();
                self.stats.local_decisions.fetch_add(1, Ordering::Relaxed);
                ProbeClaim::Local
            }
        }
    }

    fn status(&self) -> StoreStatus {
        let (since_ms, last_error) = self
            .link
            .lock()
            .map(|l| (l.since_ms, l.last_error.clone()))
            .unwrap_or_default();
        StoreStatus {
            kind: "redis",
            connected: Some(self.connected()),
            url: Some(self.cfg.display_url()),
            prefix: Some(self.cfg.prefix.clone()),
            instance: Some(self.instance.clone()),
            since_ms,
            last_error,
            sent: self.stats.sent.load(Ordering::Relaxed),
            received: self.stats.received.load(Ordering::Relaxed),
            rejected: self.stats.rejected.load(Ordering::Relaxed),
            errors: self.stats.errors.load(Ordering::Relaxed),
            dropped: self.queue.dropped.load(Ordering::Relaxed),
            local_decisions: self.stats.local_decisions.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(b: &str, d: Option<&str>) -> Target {
        Target {
            backend: b.into(),
            deployment: d.map(Into::into),
        }
    }

    #[test]
    fn the_queue_coalesces_per_key() {
        let q = Arc::new(WriteQueue::default());
        let c = |until_ms| Cooldown {
            until_ms,
            reason: spillgate_core::outcome::CoolReason::Throttled,
        };
        q.cooldown(t("a", None), c(100));
        q.cooldown(t("a", None), c(50));
        q.cooldown(t("a", Some("d")), c(70));
        q.cooldown(t("a", None), c(200));
        let cap = |observed_ms| SharedCapacity {
            observed_ms,
            tokens: None,
            requests: None,
        };
        q.capacity(t("a", Some("d")), cap(5));
        q.capacity(t("a", Some("d")), cap(3));
        // A finished probe that recovered is not undone by its own release.
        let mut p = ClusterProbe {
            queue: Arc::clone(&q),
            target: t("a", None),
            token: "tok".into(),
            recovered: false,
        };
        p.recovered();
        drop(p);
        q.probe(t("a", None), ProbeOp::Release("tok".into()));
        // Nor by the release of another probe's slot (a claim that timed out, say): each
        // outcome stays, and each script acts on its own token only.
        q.probe(t("a", None), ProbeOp::Release("other".into()));
        let pending = q.take();
        assert_eq!(pending.cooldowns.len(), 2);
        assert_eq!(pending.cooldowns[&t("a", None)].until_ms, 200);
        assert_eq!(pending.capacity[&t("a", Some("d"))].observed_ms, 5);
        assert_eq!(pending.probes.len(), 2);
        assert_eq!(
            pending.probes[&(t("a", None), "tok".to_string())],
            ProbeOp::Recovered("tok".into())
        );
        assert_eq!(
            pending.probes[&(t("a", None), "other".to_string())],
            ProbeOp::Release("other".into())
        );
        assert!(q.take().is_empty());
    }

    #[test]
    fn reconnection_backs_off_to_two_seconds_and_warnings_are_rate_limited() {
        let mut b = Backoff::new();
        let ms: Vec<u64> = (0..9).map(|_| millis(b.wait(None))).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 2000, 2000, 2000, 2000]);
        // A connection that drops soon after it came up does not start the backoff over
        // (a Redis that accepts and drops at once is not retried every 100 ms).
        let mut b = Backoff::new();
        let up = Some(Duration::from_millis(50));
        let ms: Vec<u64> = (0..6).map(|_| millis(b.wait(up))).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 2000]);
        assert_eq!(
            millis(b.wait(Some(STABLE_AFTER - Duration::from_millis(1)))),
            2000
        );
        // One that stayed up is retried at once, and the backoff starts over.
        assert_eq!(b.wait(Some(STABLE_AFTER)), Duration::ZERO);
        assert_eq!(millis(b.wait(None)), 100);
        let last = AtomicU64::new(0);
        assert!(warn_slot(&last, 1_000_000));
        assert!(!warn_slot(&last, 1_000_000 + INVALID_WARN_EVERY_MS - 1));
        assert!(warn_slot(&last, 1_000_000 + INVALID_WARN_EVERY_MS));
    }

    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let q = WriteQueue::default();
        let c = Cooldown {
            until_ms: 1,
            reason: spillgate_core::outcome::CoolReason::Throttled,
        };
        for i in 0..MAX_PENDING + 10 {
            q.cooldown(t(&format!("b{i}"), None), c);
        }
        assert_eq!(q.dropped.load(Ordering::Relaxed), 10);
        // An update of a key already pending still lands.
        q.cooldown(t("b0", None), Cooldown { until_ms: 9, ..c });
        assert_eq!(q.dropped.load(Ordering::Relaxed), 10);
        assert_eq!(q.take().cooldowns[&t("b0", None)].until_ms, 9);
    }

    // With a real `redis-server` (skipped without one; `./test.sh` installs it).

    use spillgate_mock::RedisServer;

    async fn redis() -> Option<RedisServer> {
        let r = RedisServer::start().await.unwrap();
        if r.is_none() {
            eprintln!("SKIPPED: redis-server is not installed (./test.sh installs it)");
        }
        r
    }

    fn config(url: Option<&str>) -> spillgate_core::config::Config {
        let state = url.map_or(String::new(), |u| {
            format!("[state]\nredis_url = \"{u}\"\ntimeout = \"20ms\"\n")
        });
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[auth]\nclient_keys = [\"env:K\"]\n[admin]\nenabled = false\n{state}\
             [[backends]]\nname = \"x\"\nkind = \"azure\"\nurl = \"http://127.0.0.1:9\"\napi_key = \"env:K\"\ndeployments = {{ \"gpt-4o\" = \"gpt-4o\" }}\n"
        );
        spillgate_core::config::load(&text, &|_| Some("k".into()), &|_| Err("no files".into()))
            .unwrap()
    }

    /// A store on `redis`, connected by hand (no background task), and an app (with the
    /// in-memory store) for its clock and backends.
    async fn connected(redis: &RedisServer) -> (Arc<RedisStore>, MultiplexedConnection, Arc<App>) {
        let store = Arc::new(RedisStore::new(config(Some(&redis.url())).state.unwrap()).unwrap());
        let (conn, _) = store.connect().await.unwrap();
        store.conn.store(Some(Arc::new(conn.clone())));
        store.synced.store(true, Ordering::Release);
        (store, conn, App::new(config(None)).unwrap())
    }

    async fn get(conn: &mut MultiplexedConnection, key: &str) -> Option<String> {
        redis::cmd("GET").arg(key).query_async(conn).await.unwrap()
    }

    fn cooldown(until_ms: u64) -> Cooldown {
        Cooldown {
            until_ms,
            reason: spillgate_core::outcome::CoolReason::Throttled,
        }
    }

    async fn claim(store: &RedisStore, budget: &StoreBudget) -> ProbeClaim {
        store
            .claim_probes("x", &[None], Duration::from_secs(5), budget)
            .await
    }

    fn claimed(c: ProbeClaim) -> ClusterProbe {
        match c {
            ProbeClaim::Claimed(mut v) if v.len() == 1 => v.pop().flatten().expect("a probe"),
            other => panic!("not claimed: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_probe_answer_overtaken_by_a_cooldown_marks_nothing() {
        let Some(redis) = redis().await else { return };
        let (store, mut conn, app) = connected(&redis).await;
        let budget = StoreBudget::new(Duration::from_secs(1));
        let mut probe = claimed(claim(&store, &budget).await);
        assert!(get(&mut conn, "spillgate:probe:x").await.is_some());
        // Another instance's 429 while the probe is in flight: its cooldown ends the slot.
        let other = Arc::new(RedisStore::new(config(Some(&redis.url())).state.unwrap()).unwrap());
        other
            .queue
            .cooldown(t("x", None), cooldown(app.clock.now_ms() + 2_000));
        other.flush(&app, &mut conn.clone()).await.unwrap();
        assert_eq!(get(&mut conn, "spillgate:probe:x").await, None);
        // The probe then answers well: its answer is older than the cooldown.
        probe.recovered();
        drop(probe);
        store.flush(&app, &mut conn.clone()).await.unwrap();
        assert_eq!(
            get(&mut conn, "spillgate:probe:x").await,
            None,
            "no recovered mark over a newer cooldown"
        );
        // So when that cooldown ends, the backend gets a probe again (not full traffic).
        claimed(claim(&store, &budget).await);
    }

    #[tokio::test]
    async fn probe_outcomes_are_written_before_the_cooldowns_queued_with_them() {
        let Some(redis) = redis().await else { return };
        let (store, mut conn, app) = connected(&redis).await;
        let mut events = {
            let mut ps = store.client.get_async_pubsub().await.unwrap();
            ps.subscribe("spillgate:events").await.unwrap();
            ps.into_on_message()
        };
        let budget = StoreBudget::new(Duration::from_secs(1));
        let mut probe = claimed(claim(&store, &budget).await);
        // Probe OK, then a 429 from the same backend, in one batch.
        probe.recovered();
        drop(probe);
        store
            .queue
            .cooldown(t("x", None), cooldown(app.clock.now_ms() + 2_000));
        store.flush(&app, &mut conn.clone()).await.unwrap();
        assert_eq!(
            get(&mut conn, "spillgate:probe:x").await,
            None,
            "no recovered mark"
        );
        // Others hear of the recovery, then of the cooldown that ends it.
        let mut kinds = String::new();
        for _ in 0..2 {
            let msg = tokio::time::timeout(Duration::from_secs(2), events.next())
                .await
                .unwrap()
                .unwrap();
            kinds.push_str(&msg.get_payload::<String>().unwrap()[..1]);
        }
        assert_eq!(kinds, "rc");
    }

    #[tokio::test]
    async fn writes_publish_whatever_other_keys_hold() {
        let Some(redis) = redis().await else { return };
        let (store, mut conn, app) = connected(&redis).await;
        // A string where earlier versions kept a hash of deployments.
        let _: () = redis::cmd("SET")
            .arg("spillgate:targets")
            .arg("not a hash")
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut events = {
            let mut ps = store.client.get_async_pubsub().await.unwrap();
            ps.subscribe("spillgate:events").await.unwrap();
            ps.into_on_message()
        };
        let now = app.clock.now_ms();
        store
            .queue
            .cooldown(t("x", Some("gpt-4o")), cooldown(now + 2_000));
        store.queue.capacity(
            t("x", Some("gpt-4o")),
            SharedCapacity {
                observed_ms: now,
                tokens: None,
                requests: None,
            },
        );
        store.flush(&app, &mut conn.clone()).await.unwrap();
        let mut kinds = String::new();
        for _ in 0..2 {
            let msg = tokio::time::timeout(Duration::from_secs(2), events.next())
                .await
                .expect("the event was published")
                .unwrap();
            kinds.push_str(&msg.get_payload::<String>().unwrap()[..1]);
        }
        assert_eq!(kinds, "ck");
        assert_eq!(store.status().errors, 0);
        assert_eq!(store.status().sent, 2);
    }

    #[tokio::test]
    async fn a_poll_rebases_the_clock_on_the_system_clock() {
        let Some(redis) = redis().await else { return };
        let (store, mut conn, app) = connected(&redis).await;
        // The system clock was stepped 60 s forward since start: the gateway's clock is a
        // minute behind every other instance's.
        let wall = now_unix_ms();
        app.clock.step_for_test(wall - 60_000);
        store.poll(&app, &mut conn).await.unwrap();
        let off = now_unix_ms().abs_diff(app.clock.now_ms());
        assert!(off < 1_000, "{off} ms off the system clock after a poll");
    }

    #[tokio::test]
    async fn a_request_waits_on_a_stalled_redis_once_and_it_is_said_once() {
        let Some(redis) = redis().await else { return };
        let (store, _conn, _app) = connected(&redis).await;
        let (logs, _log) = crate::test_logs::Logs::capture();
        redis.pause().unwrap();
        // A request meeting two recovering backends: the first claim waits the whole
        // timeout, the second none.
        let budget = StoreBudget::new(store.request_budget());
        let t0 = tokio::time::Instant::now();
        assert!(matches!(claim(&store, &budget).await, ProbeClaim::Local));
        assert!(t0.elapsed() >= store.cfg.timeout);
        assert_eq!(budget.left(), Duration::ZERO);
        let t1 = tokio::time::Instant::now();
        assert!(matches!(claim(&store, &budget).await, ProbeClaim::Local));
        assert!(t1.elapsed() < store.cfg.timeout / 2, "{:?}", t1.elapsed());
        // More requests, each waiting once: one warning for all of them.
        for _ in 0..3 {
            let budget = StoreBudget::new(store.request_budget());
            assert!(matches!(claim(&store, &budget).await, ProbeClaim::Local));
        }
        redis.resume().unwrap();
        assert_eq!(store.status().local_decisions, 5);
        let warnings = logs.lines("WARN", "state.timeout");
        assert_eq!(warnings.len(), 1, "{}", logs.text());
        // Without a connection, the local decision is counted too.
        store.conn.store(None);
        let budget = StoreBudget::new(store.request_budget());
        assert!(matches!(claim(&store, &budget).await, ProbeClaim::Local));
        assert_eq!(store.status().local_decisions, 6);
    }

    #[test]
    fn a_request_budget_is_spent_and_exhausted() {
        let b = StoreBudget::new(Duration::from_millis(5));
        b.spend(Duration::from_millis(2));
        assert_eq!(b.left(), Duration::from_millis(3));
        b.spend(Duration::from_millis(7));
        assert_eq!(b.left(), Duration::ZERO);
        let b = StoreBudget::new(Duration::from_millis(5));
        b.exhaust();
        assert_eq!(b.left(), Duration::ZERO);
    }
}
