//! The running gateway's shared parts: the routing snapshot (config plus everything
//! precomputed from it), per-backend live state, the upstream client and the clock.
//!
//! Everything a request needs from the config is computed once when the config loads
//! (upstream scheme/authority, the credential header, pools), so the hot path does no
//! string building for it. The snapshot sits behind `ArcSwap`: requests read it without a
//! lock, and a reload can swap it while in-flight requests finish on the old one.

use std::sync::{Arc, Mutex};

use anyhow::Context;
use arc_swap::ArcSwap;
use http::uri::{Authority, Scheme};
use http::{HeaderName, HeaderValue};
use spillgate_core::config::{AuthConfig, BackendConfig, BackendKind, Config};
use spillgate_core::retry::RetryBudget;

use crate::auth::ClientKeys;
use crate::state::{BackendState, Clock};
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
    /// `x-spillgate-backend` value, built once.
    pub name_header: HeaderValue,
    pub state: Arc<BackendState>,
}

impl BackendRt {
    fn new(cfg: BackendConfig, state: Arc<BackendState>) -> anyhow::Result<BackendRt> {
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
        Ok(BackendRt {
            cfg,
            scheme,
            authority,
            base_path,
            credential,
            name_header,
            state,
        })
    }
}

/// Live state of one route: its retry budget.
#[derive(Debug)]
pub struct RouteRt {
    pub budget: Mutex<RetryBudget>,
}

/// An immutable view of one loaded config.
#[derive(Debug)]
pub struct Snapshot {
    pub config: Config,
    pub backends: Vec<BackendRt>,
    /// Per route of `config.table.routes`, same order.
    pub routes: Vec<RouteRt>,
    pub client_keys: ClientKeys,
}

impl Snapshot {
    /// Builds a snapshot; backends keep the live state they had in `previous` when their
    /// name is unchanged.
    pub fn build(config: Config, previous: Option<&Snapshot>) -> anyhow::Result<Snapshot> {
        let backends = config
            .backends
            .iter()
            .map(|b| {
                let state = previous
                    .and_then(|p| p.backends.iter().find(|o| o.cfg.name == b.name))
                    .map(|o| Arc::clone(&o.state))
                    .unwrap_or_else(|| {
                        Arc::new(BackendState::new(
                            b.breaker.as_ref().map(|c| c.policy.window),
                        ))
                    });
                BackendRt::new(b.clone(), state)
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
                let b = r.retry.budget;
                RouteRt {
                    budget: Mutex::new(RetryBudget::new(b.ratio, b.min_per_second, b.window)),
                }
            })
            .collect();
        Ok(Snapshot {
            config,
            backends,
            routes,
            client_keys,
        })
    }
}

/// Everything the request handlers share.
pub struct App {
    pub snapshot: ArcSwap<Snapshot>,
    pub upstream: Arc<dyn Upstream>,
    pub clock: Clock,
}

impl App {
    /// The gateway with the real HTTP client.
    pub fn new(config: Config) -> anyhow::Result<Arc<App>> {
        let client = UpstreamClient::new(&config.timeouts);
        Self::with_upstream(config, Arc::new(client))
    }

    /// The gateway sending through `upstream` (tests use in-memory backends).
    pub fn with_upstream(config: Config, upstream: Arc<dyn Upstream>) -> anyhow::Result<Arc<App>> {
        let snapshot = Snapshot::build(config, None)?;
        Ok(Arc::new(App {
            snapshot: ArcSwap::from_pointee(snapshot),
            upstream,
            clock: Clock::new(),
        }))
    }
}
