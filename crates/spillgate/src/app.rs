//! The running gateway's shared parts: the routing snapshot (config plus everything
//! precomputed from it), per-backend live state, the upstream client and the clock.
//!
//! Everything a request needs from the config is computed once when the config loads
//! (upstream scheme/authority, the credential header, pools, resolved fallbacks), so the
//! hot path does not parse or rebuild it; metric labels share the config's names. The snapshot sits behind `ArcSwap`: requests read it without a
//! lock, and a reload can swap it while in-flight requests finish on the old one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use http::uri::{Authority, Scheme};
use http::{HeaderName, HeaderValue};
use spillgate_core::config::{AuthConfig, BackendConfig, BackendKind, Config};
use spillgate_core::retry::RetryBudget;
use spillgate_core::routing::RouteId;

use crate::auth::ClientKeys;
use crate::entra::{CredentialEvents, Credentials, TokenSource};
use spillgate_core::outcome::{CoolReason, Cooldown};

use crate::state::{BackendState, Clock};
use crate::store::StateStore;
use crate::upstream::{Upstream, UpstreamClient};

/// One backend, ready for the request path.
#[derive(Debug)]
pub struct BackendRt {
    pub cfg: BackendConfig,
    pub scheme: Scheme,
    pub authority: Authority,
    /// The base URL's path without a trailing slash (`""` for Azure, `/v1` for OpenAI).
    pub base_path: String,
    /// The credential header this backend expects, marked sensitive so it is never
    /// printed by `Debug` or HPACK-indexed.
    pub credential: Option<(HeaderName, HeaderValue)>,
    /// With an Entra ID credential: where its bearer token comes from (shared by the
    /// backends with the same credential).
    pub entra: Option<Arc<TokenSource>>,
    /// `x-spillgate-backend` value, built once.
    pub name_header: HeaderValue,
    /// The resource as a whole: connection failures, breaker trips, health checks.
    pub state: Arc<BackendState>,
    /// Each deployment on it: Azure enforces quota per deployment, so a 429 (or 5xx)
    /// from one deployment must not idle the others.
    pub deployments: Arc<DeploymentStates>,
}

/// Most deployments tracked per backend. A backend without a `deployments` map serves
/// whatever model names clients send; past this many, further names share one state, so
/// a client cannot grow the map without bound.
const MAX_TRACKED_DEPLOYMENTS: usize = 256;

/// Live state per deployment name of one backend.
#[derive(Debug, Default)]
pub struct DeploymentStates {
    /// Looked up by the deployment's name for each candidate a request's backend choice
    /// considers, and for its attempts; the name may be the model a client named: hashed
    /// by foldhash, seeded per process. With the standard library's
    /// SipHash the lookup was about 270 instructions of a JSON request, 166 of them
    /// hashing (callgrind).
    by_name: RwLock<HashMap<String, Arc<BackendState>, foldhash::fast::RandomState>>,
    overflow: Arc<BackendState>,
}

impl DeploymentStates {
    fn with_names<'a>(names: impl Iterator<Item = &'a str>) -> DeploymentStates {
        let by_name = names
            .map(|n| (n.to_string(), Arc::new(BackendState::default())))
            .collect();
        DeploymentStates {
            by_name: RwLock::new(by_name),
            overflow: Arc::new(BackendState::default()),
        }
    }

    /// The state of deployment `name`, created on first use.
    pub fn get(&self, name: &str) -> Arc<BackendState> {
        if let Ok(map) = self.by_name.read() {
            if let Some(s) = map.get(name) {
                return Arc::clone(s);
            }
        }
        match self.by_name.write() {
            Ok(mut map) => {
                if let Some(s) = map.get(name) {
                    return Arc::clone(s);
                }
                if map.len() >= MAX_TRACKED_DEPLOYMENTS {
                    return Arc::clone(&self.overflow);
                }
                let s = Arc::new(BackendState::default());
                map.insert(name.to_string(), Arc::clone(&s));
                s
            }
            Err(_) => Arc::clone(&self.overflow),
        }
    }

    /// The state of deployment `name` if it is tracked already; never creates one (for
    /// what other instances say: only requests and the config add names).
    pub fn find(&self, name: &str) -> Option<Arc<BackendState>> {
        self.by_name.read().ok()?.get(name).cloned()
    }

    /// Every tracked deployment and its state, sorted by name.
    pub fn all(&self) -> Vec<(String, Arc<BackendState>)> {
        let mut v: Vec<_> = self
            .by_name
            .read()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), Arc::clone(v))).collect())
            .unwrap_or_default();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// A new map for `names`, keeping the live state of names that `self` already tracks.
    fn carried<'a>(&self, names: impl Iterator<Item = &'a str>) -> DeploymentStates {
        let old = self.by_name.read().map(|m| m.clone()).unwrap_or_default();
        let by_name = names
            .map(|n| (n.to_string(), old.get(n).cloned().unwrap_or_default()))
            .collect();
        DeploymentStates {
            by_name: RwLock::new(by_name),
            overflow: Arc::new(BackendState::default()),
        }
    }
}

impl BackendRt {
    fn new(
        cfg: BackendConfig,
        state: Arc<BackendState>,
        deployments: Arc<DeploymentStates>,
        credentials: &Credentials,
    ) -> anyhow::Result<BackendRt> {
        let uri: http::Uri = cfg
            .url
            .parse()
            .with_context(|| format!("backend {}: url does not parse as a URI", cfg.name))?;
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTPS);
        let authority = uri
            .authority()
            .cloned()
            .with_context(|| format!("backend {}: url has no host", cfg.name))?;
        let base_path = uri.path().trim_end_matches('/').to_string();
        let credential = match &cfg.api_key {
            None => None,
            Some(key) => {
                let (name, value) = match cfg.kind {
                    BackendKind::Azure => {
                        (HeaderName::from_static("api-key"), key.expose().to_string())
                    }
                    BackendKind::Openai => (
                        http::header::AUTHORIZATION,
                        format!("Bearer {}", key.expose()),
                    ),
                };
                let mut value = HeaderValue::from_str(&value).map_err(|_| {
                    anyhow::anyhow!(
                        "backend {}: api_key contains characters not allowed in a header",
                        cfg.name
                    )
                })?;
                value.set_sensitive(true);
                Some((name, value))
            }
        };
        let name_header = HeaderValue::from_str(&cfg.name).map_err(|_| {
            anyhow::anyhow!("backend {}: name is not a valid header value", cfg.name)
        })?;
        let entra = cfg.entra.as_ref().map(|a| credentials.source(a));
        Ok(BackendRt {
            cfg,
            scheme,
            authority,
            base_path,
            credential,
            entra,
            name_header,
            state,
            deployments,
        })
    }

    /// Whether this backend takes its token from `source`.
    pub fn uses(&self, source: &TokenSource) -> bool {
        self.entra
            .as_ref()
            .is_some_and(|s| std::ptr::eq(Arc::as_ptr(s), source))
    }

    /// The state of the deployment that serves `model` here.
    pub fn deployment_state(&self, model: &str) -> Option<Arc<BackendState>> {
        self.cfg
            .deployment_for(model)
            .map(|d| self.deployments.get(d))
    }

    /// When `model` on this backend can take traffic again: the later of the resource's
    /// and the deployment's cooldowns.
    pub fn cooldown_for(&self, model: &str, now_ms: u64) -> Option<Cooldown> {
        let resource = self.state.cooldown(now_ms);
        let deployment = self
            .deployment_state(model)
            .and_then(|d| d.cooldown(now_ms));
        match (resource, deployment) {
            (Some(a), Some(b)) => Some(if b.until_ms > a.until_ms { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}

/// Live state of one route: its retry budget (kept across reloads by route name).
#[derive(Debug)]
pub struct RouteRt {
    pub budget: Arc<Mutex<RetryBudget>>,
    /// The route's fallback models, each with the route that serves it (resolved once
    /// per config; fallbacks no route serves are left out).
    pub fallbacks: Vec<(String, RouteId)>,
}

/// An immutable view of one loaded config.
#[derive(Debug)]
pub struct Snapshot {
    pub config: Config,
    pub backends: Vec<BackendRt>,
    /// Per route of `config.table.routes`, same order.
    pub routes: Vec<RouteRt>,
    pub client_keys: ClientKeys,
    /// The `GET /v1/models` answer, built once per config.
    pub models_json: bytes::Bytes,
    /// 1 for the config loaded at start, +1 for each reload that took effect.
    pub version: u64,
    /// When this config took effect (unix milliseconds).
    pub loaded_at_ms: u64,
    /// Metric handles for the request path, keyed by this snapshot's indices.
    pub handles: crate::metrics::RequestHandles,
}

impl Snapshot {
    /// Builds a snapshot; backends keep the live state they had in `previous` when their
    /// name is unchanged, and the token of their Entra ID credential when it is unchanged.
    pub fn build(
        config: Config,
        previous: Option<&Snapshot>,
        credentials: &Credentials,
    ) -> anyhow::Result<Snapshot> {
        let backends = config
            .backends
            .iter()
            .map(|b| {
                let known = || {
                    b.deployments
                        .iter()
                        .flat_map(|m| m.values().map(String::as_str))
                };
                // State is kept for a backend that did not change where it points: same
                // name, kind and URL. A changed deployment map keeps the deployments that
                // are still configured and drops the others.
                let old = previous.and_then(|p| {
                    p.backends.iter().find(|o| {
                        o.cfg.name == b.name && o.cfg.kind == b.kind && o.cfg.url == b.url
                    })
                });
                let (state, deployments) = match old {
                    Some(old) if old.cfg.deployments == b.deployments => {
                        (Arc::clone(&old.state), Arc::clone(&old.deployments))
                    }
                    Some(old) => (
                        Arc::clone(&old.state),
                        Arc::new(old.deployments.carried(known())),
                    ),
                    None => (
                        Arc::new(BackendState::default()),
                        Arc::new(DeploymentStates::with_names(known())),
                    ),
                };
                BackendRt::new(b.clone(), state, deployments, credentials)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let client_keys = match &config.auth {
            AuthConfig::None => ClientKeys::none(),
            AuthConfig::Keys(keys) => ClientKeys::new(keys),
        };
        let routes = config
            .table
            .routes
            .iter()
            .map(|r| {
                let kept =
                    previous.and_then(|p| {
                        let i =
                            p.config.table.routes.iter().position(|o| {
                                o.name == r.name && o.retry.budget == r.retry.budget
                            })?;
                        Some(Arc::clone(&p.routes[i].budget))
                    });
                let b = r.retry.budget;
                RouteRt {
                    budget: kept.unwrap_or_else(|| {
                        Arc::new(Mutex::new(RetryBudget::new(
                            b.ratio,
                            b.min_per_second,
                            b.window,
                        )))
                    }),
                    fallbacks: r
                        .fallback
                        .iter()
                        .filter_map(|f| {
                            let route = config.table.route_for(f, &config.backends)?;
                            Some((f.clone(), route))
                        })
                        .collect(),
                }
            })
            .collect();
        let data: Vec<_> = config
            .table
            .model_names()
            .map(|m| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": "spillgate"}))
            .collect();
        let models_json =
            bytes::Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string());
        Ok(Snapshot {
            config,
            backends,
            routes,
            client_keys,
            models_json,
            version: previous.map_or(1, |p| p.version + 1),
            loaded_at_ms: spillgate_core::outcome::unix_ms(std::time::SystemTime::now()),
            handles: Default::default(),
        })
    }
}

/// Everything the request handlers share.
pub struct App {
    pub snapshot: ArcSwap<Snapshot>,
    pub upstream: Arc<dyn Upstream>,
    pub clock: Clock,
    /// Set when shutdown starts: readiness turns false so load balancers stop sending.
    draining: std::sync::atomic::AtomicBool,
    /// Prometheus metrics; they outlive config reloads.
    pub metrics: crate::metrics::Metrics,
    /// The live health-check task of each backend, by generation: a task whose
    /// generation is no longer current stops, so reloads never leave two running.
    pub health_tasks: Mutex<HashMap<Arc<str>, u64>>,
    /// The token sources of the backends with Entra ID credentials.
    pub credentials: Credentials,
    /// Where observations go besides the local view: this instance only, or Redis
    /// (`[state]`, read at start).
    pub store: Arc<dyn StateStore>,
    /// Backends cooled because they refused a token that a renewal would not improve,
    /// by name: their state and until when (unix ms). A token obtained ends a cooldown
    /// for the lack of one, never one of these before its time.
    refused_token: Mutex<HashMap<Arc<str>, RefusedUntil>>,
}

/// A backend's state and the end of its cooldown for a refused token (unix ms).
type RefusedUntil = (Weak<BackendState>, u64);

/// A token source that cannot get a token cools its backends for a little longer than
/// until its next try, so the cooldown does not end (and start again) around each retry;
/// a token obtained ends the cooldown at once (but not one for a refused token: see
/// [`App::cool_for_refused_token`]).
pub(crate) const AUTH_COOLDOWN_GRACE: Duration = Duration::from_secs(10);

impl App {
    /// The gateway with the real HTTP client.
    pub fn new(config: Config) -> anyhow::Result<Arc<App>> {
        let client = UpstreamClient::new(&config.timeouts);
        Self::with_upstream(config, Arc::new(client))
    }

    /// The gateway sending through `upstream` (tests use in-memory backends).
    pub fn with_upstream(config: Config, upstream: Arc<dyn Upstream>) -> anyhow::Result<Arc<App>> {
        if config.priority.is_some() {
            crate::priority::warm_up();
        }
        let credentials = Credentials::new(Arc::clone(&upstream));
        let store = crate::store::from_config(&config)?;
        let snapshot = Snapshot::build(config, None, &credentials)?;
        let app = Arc::new(App {
            snapshot: ArcSwap::from_pointee(snapshot),
            upstream,
            clock: Clock::new(),
            draining: std::sync::atomic::AtomicBool::new(false),
            metrics: crate::metrics::Metrics::new(),
            health_tasks: Mutex::new(HashMap::new()),
            credentials,
            store,
            refused_token: Mutex::new(HashMap::new()),
        });
        app.start_credentials();
        app.start_store();
        Ok(app)
    }

    /// Connects the running config's token sources to the backends' state and starts
    /// fetching their first tokens (when a runtime is at hand; else on first use). Sources
    /// that already run are left as they are.
    pub fn start_credentials(self: &Arc<Self>) {
        let snap = self.snapshot.load();
        for source in snap.backends.iter().filter_map(|b| b.entra.as_ref()) {
            source.set_events(Arc::new(AppEvents(Arc::downgrade(self))));
            source.start();
        }
    }

    /// Starts the state store's background work when a runtime is at hand (else when the
    /// server starts); later calls do nothing.
    pub fn start_store(self: &Arc<Self>) {
        Arc::clone(&self.store).start(self);
    }

    /// Cools `backend` for lack of a usable token, for `d` (a cooldown that starts is
    /// counted in the metrics).
    pub fn cool_for_auth(&self, backend: &BackendRt, d: Duration) {
        let now = self.clock.now_ms();
        let until_ms = now.saturating_add(spillgate_core::outcome::millis(d));
        let cooled = backend.state.cool_at(
            Cooldown {
                until_ms,
                reason: CoolReason::Auth,
            },
            now,
        );
        if cooled.started {
            self.metrics.cooldown_started(&backend.cfg.name, "auth");
            tracing::debug!(backend = %backend.cfg.name, reason = "auth", cooldown_ms = d.as_millis() as u64, "backend cooling down");
        }
    }

    /// Cools `backend` for `d` because it refused a token that a renewal would not
    /// improve (a token newly obtained, or one less than a minute old): most likely its
    /// identity lacks the role on that resource. Reason "auth", like a cooldown for the
    /// lack of a token, but a token obtained meanwhile does not end it. Says whether this
    /// started a cooldown (counted in the metrics).
    pub fn cool_for_refused_token(&self, backend: &BackendRt, d: Duration) -> bool {
        let now = self.clock.now_ms();
        let until_ms = now.saturating_add(spillgate_core::outcome::millis(d));
        let cooled = {
            // Held while cooling, so `obtained` sees the cooldown and its record together.
            let mut refused = crate::lock(&self.refused_token);
            refused.retain(|_, (state, until)| *until > now && state.strong_count() > 0);
            let cooled = backend.state.cool_at(
                Cooldown {
                    until_ms,
                    reason: CoolReason::Auth,
                },
                now,
            );
            let state = Arc::downgrade(&backend.state);
            let entry = refused
                .entry(Arc::clone(&backend.cfg.name))
                .or_insert_with(|| (state.clone(), 0));
            if !entry.0.ptr_eq(&state) {
                *entry = (state, 0);
            }
            entry.1 = entry.1.max(until_ms);
            cooled
        };
        if cooled.started {
            self.metrics.cooldown_started(&backend.cfg.name, "auth");
        }
        cooled.started
    }

    pub fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

/// Tells the gateway's backends when their token source loses or regains a token.
struct AppEvents(Weak<App>);

impl CredentialEvents for AppEvents {
    fn unavailable(&self, source: &TokenSource, next_try: Duration) -> Vec<Arc<str>> {
        let Some(app) = self.0.upgrade() else {
            return Vec::new();
        };
        let snap = app.snapshot.load();
        snap.backends
            .iter()
            .filter(|b| b.uses(source))
            .map(|b| {
                app.cool_for_auth(b, next_try + AUTH_COOLDOWN_GRACE);
                Arc::clone(&b.cfg.name)
            })
            .collect()
    }

    /// Ends the cooldowns set for the lack of a token. A backend that refused a token a
    /// renewal would not improve stays out for its whole cooldown: a new token changes
    /// nothing about its identity's roles.
    fn obtained(&self, source: &TokenSource) {
        let Some(app) = self.0.upgrade() else { return };
        let now = app.clock.now_ms();
        let snap = app.snapshot.load();
        let refused = crate::lock(&app.refused_token);
        for b in snap.backends.iter().filter(|b| b.uses(source)) {
            let refusing = refused.get(&b.cfg.name).is_some_and(|(state, until)| {
                *until > now && std::ptr::eq(state.as_ptr(), Arc::as_ptr(&b.state))
            });
            if !refusing {
                b.state.end_cooldown(CoolReason::Auth, now);
            }
        }
    }
}
