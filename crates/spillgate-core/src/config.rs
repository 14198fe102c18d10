//! Configuration: what operators write (`File*` types, parsed strictly from TOML) and what
//! the gateway runs on ([`Config`], validated).
//!
//! The two-step shape exists so that every mistake in a user's file is reported with the
//! path of the field that holds it (`backends[2].priority: must be >= 1, got 0`), all at
//! once, before anything starts; and so that the runtime never sees an invalid value.
//! Secrets are never written inline: they are references (`env:VAR`, `file:/path`)
//! resolved here through a caller-supplied lookup, which keeps this module free of I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::breaker::BreakerPolicy;
use crate::capacity::{CapacityPolicy, Reserve};
use crate::retry::{AttemptResult, Backoff, Condition, ConditionSet};
use crate::routing::{pool_from, pool_of_all, ModelPattern, Route, RoutingTable};

/// One problem found in a config file, with the path of the field it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() || self.path == "." {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found in a config file (at least one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl ConfigErrors {
    fn one(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigErrors(vec![ConfigError {
            path: path.into(),
            message: message.into(),
        }])
    }
}

// ---------------------------------------------------------------------------------------
// What the user writes.
// ---------------------------------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: FileServer,
    #[serde(default)]
    pub auth: FileAuth,
    #[serde(default)]
    pub timeouts: FileTimeouts,
    #[serde(default)]
    pub cooldown: FileCooldown,
    #[serde(default)]
    pub routing: FileRouting,
    #[serde(default)]
    pub log: FileLog,
    #[serde(default)]
    pub backends: Vec<FileBackend>,
    #[serde(default)]
    pub routes: Vec<FileRoute>,
    /// The retry policy of routes that do not set their own (and of the implicit route).
    pub retry: Option<FileRetry>,
    /// The circuit breaker of backends that do not set their own. Off when absent.
    pub circuit_breaker: Option<FileBreaker>,
    /// Request priority: low-priority admission from tracked spare capacity.
    pub priority: Option<FilePriority>,
    #[serde(default)]
    pub admin: FileAdmin,
    /// Where backend state lives: this instance's memory (default) or a Redis shared by
    /// several instances.
    #[serde(default)]
    pub state: FileState,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileState {
    pub redis_url: Option<String>,
    pub username: Option<String>,
    pub password: Option<String>,
    pub prefix: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub poll: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileAdmin {
    pub enabled: Option<bool>,
    pub listen: Option<String>,
    pub token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePriority {
    #[serde(default, with = "humantime_serde")]
    pub stale_after: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub tokens_window: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub requests_window: Option<Duration>,
    pub default_max_tokens: Option<u64>,
    #[serde(default)]
    pub models: Vec<FilePriorityModel>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePriorityModel {
    pub models: Vec<String>,
    pub low_priority_tpm_threshold: u64,
    pub low_priority_rp10s_threshold: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRoute {
    pub name: Option<String>,
    pub models: Vec<String>,
    pub backends: Vec<FileRouteBackend>,
    pub fallback: Option<Vec<String>>,
    #[serde(default, with = "humantime_serde")]
    pub deadline: Option<Duration>,
    pub retry: Option<FileRetry>,
}

/// A pool member: a backend's name (with its own priority and weight), or a table that
/// sets them for this route.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum FileRouteBackend {
    Name(String),
    Member(FileRouteMember),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRouteMember {
    pub name: String,
    pub priority: Option<i64>,
    pub weight: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRetry {
    pub condition: Option<Vec<String>>,
    pub count: Option<u64>,
    pub per_backend: Option<u64>,
    pub switch_on: Option<Vec<String>>,
    #[serde(default, with = "humantime_serde")]
    pub interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub max_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub delta: Option<Duration>,
    pub first_fast_retry: Option<bool>,
    pub budget: Option<FileBudget>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileBudget {
    pub ratio: Option<f64>,
    pub min_per_second: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    pub window: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileBreaker {
    pub failures: Option<u64>,
    pub ratio: Option<f64>,
    pub min_requests: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    pub window: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub trip: Option<Duration>,
    pub accept_retry_after: Option<bool>,
    pub condition: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHealthCheck {
    pub path: String,
    pub method: Option<String>,
    pub body: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub timeout: Option<Duration>,
    pub expect: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileServer {
    pub listen: Option<String>,
    pub max_body_bytes: Option<u64>,
    pub max_header_bytes: Option<u64>,
    pub max_headers: Option<u64>,
    pub max_connections: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    pub drain_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub config_poll: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub shutdown_delay: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileAuth {
    pub mode: Option<AuthMode>,
    pub client_keys: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// Clients must present one of `client_keys` (the default).
    Keys,
    /// No client authentication: for local use only.
    None,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTimeouts {
    #[serde(default, with = "humantime_serde")]
    pub client_header: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub client_body: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub client_send: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub connect: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub first_byte: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub idle: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileCooldown {
    #[serde(default, with = "humantime_serde")]
    pub default_429: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub default_5xx: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub default_connect: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub default_auth: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub max: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub max_jitter: Option<Duration>,
    pub on: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRouting {
    pub when_all_cooling: Option<AllCoolingPolicy>,
    #[serde(default, with = "humantime_serde")]
    pub max_wait: Option<Duration>,
    pub max_attempts: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    pub deadline: Option<Duration>,
}

/// What to do when every backend that could serve a request is cooling down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AllCoolingPolicy {
    /// Answer 429 at once with `Retry-After` set to the soonest recovery (the default).
    Reject,
    /// The seeds' behaviour: send the request to the first backend anyway and return
    /// whatever it answers.
    ForwardFirst,
    /// Wait for the soonest recovery when it is within `routing.max_wait`, else reject.
    Wait,
}

impl AllCoolingPolicy {
    /// The name as written in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            AllCoolingPolicy::Reject => "reject",
            AllCoolingPolicy::ForwardFirst => "forward-first",
            AllCoolingPolicy::Wait => "wait",
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLog {
    pub format: Option<LogFormat>,
    pub level: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileBackend {
    pub name: String,
    pub kind: BackendKind,
    pub url: String,
    #[serde(default)]
    pub priority: Option<i64>,
    #[serde(default)]
    pub weight: Option<i64>,
    pub api_key: Option<String>,
    /// An Entra ID credential instead of `api_key`.
    pub auth: Option<FileBackendAuth>,
    pub deployments: Option<BTreeMap<String, String>>,
    pub circuit_breaker: Option<FileBreaker>,
    pub health_check: Option<FileHealthCheck>,
    pub azure_api: Option<AzureApi>,
    pub api_version: Option<String>,
}

/// `auth = { entra = "...", ... }`: how the gateway obtains Microsoft Entra ID tokens for a
/// backend. Which of the other keys apply depends on `entra`; validation says which.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileBackendAuth {
    pub entra: EntraKind,
    pub client_id: Option<String>,
    pub object_id: Option<String>,
    pub resource_id: Option<String>,
    pub tenant_id: Option<String>,
    pub client_secret: Option<String>,
    pub token_file: Option<String>,
    pub authority_host: Option<String>,
    pub scope: Option<String>,
}

/// The kinds of Entra ID credential a backend can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EntraKind {
    /// The managed identity of the Azure resource the gateway runs on (VM, App Service,
    /// Container Apps, Functions): system-assigned, or user-assigned with an id.
    ManagedIdentity,
    /// AKS workload identity: a federated Kubernetes service account token.
    WorkloadIdentity,
    /// A service principal with a client secret.
    ClientSecret,
    /// The Azure CLI's login (`az login`), for running on a developer machine.
    Developer,
}

impl EntraKind {
    /// The name as written in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            EntraKind::ManagedIdentity => "managed-identity",
            EntraKind::WorkloadIdentity => "workload-identity",
            EntraKind::ClientSecret => "client-secret",
            EntraKind::Developer => "developer",
        }
    }
}

/// Which Azure OpenAI API a backend is called with when the client's request does not
/// already name a deployment in its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AzureApi {
    /// `/openai/deployments/{deployment}/{operation}?api-version=...`: every resource.
    #[default]
    Classic,
    /// `/openai/v1/{operation}`, deployment as `model`: resources with the v1 API.
    V1,
}

pub const DEFAULT_AZURE_API_VERSION: &str = "2024-10-21";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// An Azure OpenAI resource: `https://NAME.openai.azure.com`, `api-key` auth.
    Azure,
    /// OpenAI or any OpenAI-compatible server: base URL with `/v1`, bearer auth.
    Openai,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Azure => "azure",
            BackendKind::Openai => "openai",
        }
    }
}

// ---------------------------------------------------------------------------------------
// What the gateway runs on.
// ---------------------------------------------------------------------------------------

/// A resolved secret. Its `Debug` never shows the value, so it cannot leak through logs.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Self {
        Secret(value)
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// The scope Azure OpenAI (and the other Azure AI services) accept tokens for.
pub const DEFAULT_ENTRA_SCOPE: &str = "https://cognitiveservices.azure.com/.default";

/// A backend's Entra ID credential and the scope its tokens are requested for. Backends
/// whose `EntraAuth` is equal share one token.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntraAuth {
    pub credential: EntraCredential,
    pub scope: String,
}

/// A user-assigned managed identity, by one of its three ids.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ManagedIdentityId {
    ClientId(String),
    ObjectId(String),
    ResourceId(String),
}

/// A validated Entra ID credential.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EntraCredential {
    /// System-assigned when `id` is `None`.
    ManagedIdentity { id: Option<ManagedIdentityId> },
    /// Values left out come from `AZURE_TENANT_ID`, `AZURE_CLIENT_ID` and
    /// `AZURE_FEDERATED_TOKEN_FILE` (set by the AKS workload identity webhook).
    WorkloadIdentity {
        tenant_id: Option<String>,
        client_id: Option<String>,
        token_file: Option<String>,
        authority_host: Option<String>,
    },
    ClientSecret {
        tenant_id: String,
        client_id: String,
        client_secret: Secret,
        /// Where the secret came from (`env:NAME` / `file:/path`), for display.
        secret_from: String,
        authority_host: Option<String>,
    },
    /// The Azure CLI's current login, optionally in another tenant.
    Developer { tenant_id: Option<String> },
}

impl EntraCredential {
    pub fn kind(&self) -> EntraKind {
        match self {
            EntraCredential::ManagedIdentity { .. } => EntraKind::ManagedIdentity,
            EntraCredential::WorkloadIdentity { .. } => EntraKind::WorkloadIdentity,
            EntraCredential::ClientSecret { .. } => EntraKind::ClientSecret,
            EntraCredential::Developer { .. } => EntraKind::Developer,
        }
    }

    /// One line for operators: which identity, never a secret.
    pub fn describe(&self) -> String {
        match self {
            EntraCredential::ManagedIdentity { id: None } => {
                "managed identity (system-assigned)".to_string()
            }
            EntraCredential::ManagedIdentity { id: Some(id) } => {
                let (k, v) = match id {
                    ManagedIdentityId::ClientId(v) => ("client_id", v),
                    ManagedIdentityId::ObjectId(v) => ("object_id", v),
                    ManagedIdentityId::ResourceId(v) => ("resource_id", v),
                };
                format!("managed identity (user-assigned, {k} {v})")
            }
            EntraCredential::WorkloadIdentity {
                tenant_id,
                client_id,
                token_file,
                ..
            } => format!(
                "workload identity (tenant {}, client {}, token file {})",
                tenant_id.as_deref().unwrap_or("from AZURE_TENANT_ID"),
                client_id.as_deref().unwrap_or("from AZURE_CLIENT_ID"),
                token_file
                    .as_deref()
                    .unwrap_or("from AZURE_FEDERATED_TOKEN_FILE"),
            ),
            EntraCredential::ClientSecret {
                tenant_id,
                client_id,
                secret_from,
                ..
            } => format!(
                "service principal with client secret (tenant {tenant_id}, client {client_id}, secret from {secret_from})"
            ),
            EntraCredential::Developer { tenant_id: None } => {
                "developer login (Azure CLI)".to_string()
            }
            EntraCredential::Developer {
                tenant_id: Some(t),
            } => format!("developer login (Azure CLI, tenant {t})"),
        }
    }

    /// The authority host set in the config, for the kinds that talk to Entra directly.
    pub fn authority_host(&self) -> Option<&str> {
        match self {
            EntraCredential::WorkloadIdentity { authority_host, .. }
            | EntraCredential::ClientSecret { authority_host, .. } => authority_host.as_deref(),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub auth: AuthConfig,
    pub timeouts: Timeouts,
    pub cooldown: CooldownPolicy,
    pub routing: RoutingPolicy,
    pub log: LogConfig,
    pub backends: Vec<BackendConfig>,
    /// Pools per model, built once when the config loads.
    pub table: Arc<RoutingTable>,
    /// Request priority; `None` = every request is treated as high priority.
    pub priority: Option<PriorityConfig>,
    pub admin: AdminConfig,
    /// Shared state; `None` = this instance's memory only.
    pub state: Option<RedisConfig>,
}

/// A Redis shared by several gateway instances (`[state]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://` (plain) or `rediss://` (TLS).
    pub tls: bool,
    pub host: String,
    pub port: u16,
    pub db: i64,
    /// ACL user name (Redis 6+); `None` = the default user.
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// Where the password came from (`REDIS_PASSWORD` or a file path): for `check`.
    pub password_from: Option<Arc<str>>,
    /// Prepended to every key and to the event channel, so several gateway clusters (or
    /// other programs) can share one Redis.
    pub prefix: String,
    /// Longest a request may wait on Redis, all its probe claims together (at most
    /// [`MAX_STATE_TIMEOUT`]); past it the instance decides alone.
    pub timeout: Duration,
    /// Longest a connection attempt may take.
    pub connect_timeout: Duration,
    /// How often shared state is read back in full (events carry changes as they happen;
    /// this catches what a lost event missed).
    pub poll: Duration,
}

impl RedisConfig {
    /// The address without credentials, for logs and views: `rediss://host:6380/0`.
    pub fn display_url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!("{scheme}://{host}:{}/{}", self.port, self.db)
    }
}

pub const DEFAULT_STATE_PREFIX: &str = "spillgate";

/// Largest `state.timeout`: it is spent on the request path (the probe claim), so it must
/// stay small next to an upstream round trip.
pub const MAX_STATE_TIMEOUT: Duration = Duration::from_millis(100);

/// The separate admin listener: metrics, state, dashboard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// `None` when disabled.
    pub listen: Option<SocketAddr>,
    /// When set, admin requests need `Authorization: Bearer <token>`.
    pub token: Option<Secret>,
}

pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";

/// Low-priority admission: reserves per model and how capacity is estimated.
#[derive(Debug, Clone, PartialEq)]
pub struct PriorityConfig {
    pub capacity: CapacityPolicy,
    /// Completion tokens assumed for a request without `max_tokens`.
    pub default_max_tokens: u64,
    /// `(models, reserve)` in config order; the first match wins.
    pub reserves: Vec<(Vec<ModelPattern>, Reserve)>,
}

impl PriorityConfig {
    /// The capacity kept for high-priority traffic on deployments of `model`, if any.
    pub fn reserve_for(&self, model: &str) -> Option<Reserve> {
        self.reserves
            .iter()
            .find(|(pats, _)| pats.iter().any(|p| p.matches(model)))
            .map(|(_, r)| *r)
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    /// Open client connections at most; further ones wait in the accept queue.
    pub max_connections: usize,
    /// On shutdown, how long in-flight requests and streams may take to finish.
    pub drain_timeout: Duration,
    /// How often the config file is checked for changes; zero: on SIGHUP only.
    pub config_poll: Duration,
    /// On shutdown, how long to keep accepting (with `/readyz` answering 503) before
    /// refusing new connections, so load balancers stop sending first.
    pub shutdown_delay: Duration,
}

#[derive(Debug, Clone)]
pub enum AuthConfig {
    None,
    Keys(Vec<ClientKey>),
}

#[derive(Debug, Clone)]
pub struct ClientKey {
    /// Where the key came from (`SPILLGATE_KEY_TEAM_A`): names the client in logs, never
    /// the key itself.
    pub name: Arc<str>,
    pub key: Secret,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// A client must send its request head within this.
    pub client_header: Duration,
    /// A client must send its whole body within this (408 otherwise).
    pub client_body: Duration,
    /// A client that makes no room for a response's next bytes within this (it reads
    /// nothing) is disconnected.
    pub client_send: Duration,
    pub connect: Duration,
    pub first_byte: Duration,
    pub idle: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CooldownPolicy {
    /// Outcomes that cool a backend (the others fail over, per the retry policy, without
    /// taking the backend out for other requests).
    pub on: ConditionSet,
    pub default_429: Duration,
    pub default_5xx: Duration,
    pub default_connect: Duration,
    /// After a backend rejects (401) a token that was just refreshed.
    pub default_auth: Duration,
    pub max: Duration,
    /// Cooldown ends are pushed back by a random 0-10% of the cooldown, at most this
    /// much, so many requests (and gateway instances) do not return to a recovering
    /// backend in the same millisecond.
    pub max_jitter: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingPolicy {
    pub when_all_cooling: AllCoolingPolicy,
    pub max_wait: Duration,
    /// Upper bound on upstream attempts for one request; `None` = no bound of its own
    /// (the pool, the fallbacks and the retry policy bound the attempts).
    pub max_attempts: Option<u32>,
    /// Default overall deadline for one request (all attempts and waits, until the
    /// response headers); routes may set their own.
    pub deadline: Option<Duration>,
}

/// Bounds on extra upstream attempts: `ratio` of recent requests plus `min_per_second`,
/// over `window`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetPolicy {
    pub ratio: f64,
    pub min_per_second: u32,
    pub window: Duration,
}

impl Default for BudgetPolicy {
    fn default() -> Self {
        BudgetPolicy {
            ratio: 0.2,
            min_per_second: 5,
            window: Duration::from_secs(10),
        }
    }
}

/// A route's retry policy (APIM `retry` semantics; see `retry.rs` for the waiting rule).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Outcomes that are retried at all; anything else goes back to the client.
    pub condition: ConditionSet,
    /// Most retries (attempts after the first) for one request.
    pub count: u32,
    /// Attempts on one backend before moving to the next.
    pub per_backend: u32,
    /// Outcomes that move to the next backend at once, whatever `per_backend` says.
    pub switch_on: ConditionSet,
    /// The wait between tries of the same backend. Moving to another backend never waits.
    pub backoff: Backoff,
    pub budget: BudgetPolicy,
}

impl Default for RetryPolicy {
    /// The gateway's own behaviour: 429, 5xx and connect errors move at once to the next
    /// backend, each backend tried once.
    fn default() -> Self {
        RetryPolicy {
            condition: ConditionSet::default_failover(),
            count: 1000,
            per_backend: 1,
            switch_on: ConditionSet(vec![Condition::Status(429)]),
            backoff: Backoff::none(),
            budget: BudgetPolicy::default(),
        }
    }
}

/// What to do after an attempt, by the retry policy alone (budget, deadline and which
/// backends are left are the caller's to check).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The outcome is not retried: it goes back to the client.
    Return,
    /// Retries are used up: stop.
    GiveUp,
    /// Try the same backend again after this wait.
    RetrySame(Duration),
    /// Move to the next backend, at once.
    Switch,
}

impl RetryPolicy {
    /// `tries_on_backend` counts attempts already made on this backend for this request
    /// (at least 1); `retries_used` counts retries already made for the request. `hint`
    /// is the backend's `Retry-After`, which lengthens the wait when it is longer.
    /// `unit` is a uniform random draw in `[0, 1)`.
    pub fn next(
        &self,
        result: AttemptResult,
        hint: Option<Duration>,
        tries_on_backend: u32,
        retries_used: u32,
        unit: f64,
    ) -> Step {
        if !self.condition.matches(result) {
            return Step::Return;
        }
        if retries_used >= self.count {
            return Step::GiveUp;
        }
        if self.switch_on.matches(result) || tries_on_backend >= self.per_backend {
            return Step::Switch;
        }
        let wait = self.backoff.delay(tries_on_backend.saturating_sub(1), unit);
        Step::RetrySame(hint.map_or(wait, |h| h.max(wait)))
    }
}

/// A backend's circuit breaker: the rule plus what counts as a failure.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    pub policy: BreakerPolicy,
    pub condition: ConditionSet,
}

/// An active health check: a cheap request on an interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub method: String,
    /// Appended to the backend's base URL (`/openai/models?api-version=...`).
    pub path: String,
    pub body: Option<String>,
    pub interval: Duration,
    pub timeout: Duration,
    /// Statuses that count as healthy.
    pub expect: ConditionSet,
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    pub format: LogFormat,
    pub level: String,
}

#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub name: Arc<str>,
    pub kind: BackendKind,
    /// Base URL without a trailing slash: `https://x.openai.azure.com` for Azure, the SDK's
    /// `base_url` (`https://api.openai.com/v1`) for OpenAI-kind.
    pub url: Arc<str>,
    pub priority: u32,
    pub weight: u32,
    pub api_key: Option<Secret>,
    /// An Entra ID credential, used instead of `api_key` (never both).
    pub entra: Option<EntraAuth>,
    /// Model name (what clients ask for) -> name on this backend. `None` = serves any
    /// model under its own name.
    pub deployments: Option<BTreeMap<String, String>>,
    pub breaker: Option<BreakerConfig>,
    pub health_check: Option<HealthCheck>,
    pub azure_api: AzureApi,
    /// `api-version` for Azure classic requests made from other shapes.
    pub api_version: String,
}

impl BackendConfig {
    /// The name this backend knows `model` by, or `None` when it does not serve it.
    pub fn deployment_for<'a>(&'a self, model: &'a str) -> Option<&'a str> {
        match &self.deployments {
            None => Some(model),
            Some(map) => map.get(model).map(String::as_str),
        }
    }
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;
pub const DEFAULT_MAX_HEADER_BYTES: u64 = 64 * 1024;
pub const DEFAULT_MAX_HEADERS: u64 = 100;
/// The most `server.max_headers` may be set to.
pub const MAX_HEADERS_LIMIT: u64 = 1000;

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            client_header: Duration::from_secs(30),
            client_body: Duration::from_secs(60),
            client_send: Duration::from_secs(60),
            connect: Duration::from_secs(5),
            // A non-streamed completion sends its headers only when generation ends, so
            // "first byte" must allow for long generations.
            first_byte: Duration::from_secs(300),
            idle: Duration::from_secs(120),
        }
    }
}

impl Default for CooldownPolicy {
    fn default() -> Self {
        CooldownPolicy {
            on: ConditionSet::default_failover(),
            default_429: Duration::from_secs(10),
            default_5xx: Duration::from_secs(10),
            default_connect: Duration::from_secs(10),
            default_auth: Duration::from_secs(30),
            max: Duration::from_secs(300),
            max_jitter: Duration::from_secs(1),
        }
    }
}

impl Default for RoutingPolicy {
    fn default() -> Self {
        RoutingPolicy {
            when_all_cooling: AllCoolingPolicy::Reject,
            max_wait: Duration::from_secs(5),
            max_attempts: None,
            deadline: None,
        }
    }
}

/// Parses TOML text into the file model, reporting the path of the first field that does
/// not fit (unknown field, wrong type) and its line.
pub fn parse_file(text: &str) -> Result<FileConfig, ConfigErrors> {
    let de = toml::Deserializer::new(text);
    serde_path_to_error::deserialize(de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        let line = inner
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        let mut message = inner.message().trim().to_string();
        if let Some(line) = line {
            message.push_str(&format!(" (line {line})"));
        }
        ConfigErrors::one(path, message)
    })
}

/// Parses and validates a whole config. `lookup_env` reads an environment variable and
/// `read_file` a file (for `file:` secrets); both are parameters so this stays pure.
pub fn load(
    text: &str,
    lookup_env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&str) -> Result<String, String>,
) -> Result<Config, ConfigErrors> {
    let file = parse_file(text)?;
    validate(file, lookup_env, read_file)
}

struct Errors(Vec<ConfigError>);

impl Errors {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }
}

/// Resolves a secret reference: `env:VAR` or `file:/path`. Inline values are refused so
/// that keys never sit in config files or in the examples users copy.
fn resolve_secret(
    reference: &str,
    path: &str,
    errors: &mut Errors,
    lookup_env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&str) -> Result<String, String>,
) -> Option<(Arc<str>, Secret)> {
    if let Some(var) = reference.strip_prefix("env:") {
        if var.is_empty() {
            errors.push(path, "`env:` needs a variable name, e.g. env:MY_KEY");
            return None;
        }
        match lookup_env(var) {
            Some(v) if !v.trim().is_empty() => Some((Arc::from(var), Secret(v.trim().to_string()))),
            Some(_) => {
                errors.push(path, format!("environment variable {var} is empty"));
                None
            }
            None => {
                errors.push(path, format!("environment variable {var} is not set"));
                None
            }
        }
    } else if let Some(file) = reference.strip_prefix("file:") {
        match read_file(file) {
            Ok(v) if !v.trim().is_empty() => Some((Arc::from(file), Secret(v.trim().to_string()))),
            Ok(_) => {
                errors.push(path, format!("secret file {file} is empty"));
                None
            }
            Err(e) => {
                errors.push(path, format!("cannot read secret file {file}: {e}"));
                None
            }
        }
    } else {
        errors.push(
            path,
            "must be a reference such as \"env:VAR_NAME\" or \"file:/path\"; inline secrets are not accepted",
        );
        None
    }
}

/// An id as Entra writes them (tenant, client, object ids): letters, digits, `-` and `.`
/// (tenant domain names such as `contoso.onmicrosoft.com` too).
fn is_entra_id(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 256
        && v.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'.')
}

/// A token scope such as `https://cognitiveservices.azure.com/.default`: the characters the
/// Azure SDK accepts in one.
fn is_scope(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 512
        && v.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_' | b':' | b'/'))
}

/// An Entra authority host: `https://login.microsoftonline.us` and the like. Plain `http`
/// is accepted for a loopback address only (a local token service or a test double).
fn authority_host(raw: &str, path: &str, errors: &mut Errors) -> Option<String> {
    let parsed = match url::Url::parse(raw) {
        Ok(u) => u,
        Err(e) => {
            errors.push(path, format!("not a valid URL ({e}): {raw:?}"));
            return None;
        }
    };
    let loopback = match parsed.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    let ok_scheme = parsed.scheme() == "https" || (parsed.scheme() == "http" && loopback);
    if !ok_scheme {
        errors.push(
            path,
            format!(
                "must be an https URL such as \"https://login.microsoftonline.us\" (http only for a loopback address), got {raw:?}"
            ),
        );
        return None;
    }
    if !parsed.path().trim_end_matches('/').is_empty()
        || parsed.query().is_some()
        || parsed.fragment().is_some()
        || !parsed.username().is_empty()
    {
        errors.push(
            path,
            "must be the authority's scheme, host and port only, without a path",
        );
        return None;
    }
    Some(raw.trim_end_matches('/').to_string())
}

/// Validates `auth = { entra = ... }`: which keys each kind takes, the ids' shapes, the
/// client secret reference and the scope.
fn validate_entra(
    a: &FileBackendAuth,
    path: &str,
    errors: &mut Errors,
    lookup_env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&str) -> Result<String, String>,
) -> Option<EntraAuth> {
    let kind = a.entra;
    let n_before = errors.0.len();
    let field = |f: &str| format!("{path}.{f}");
    // Keys that do not apply to this kind are errors, not silently ignored.
    let given: [(&str, bool); 8] = [
        ("client_id", a.client_id.is_some()),
        ("object_id", a.object_id.is_some()),
        ("resource_id", a.resource_id.is_some()),
        ("tenant_id", a.tenant_id.is_some()),
        ("client_secret", a.client_secret.is_some()),
        ("token_file", a.token_file.is_some()),
        ("authority_host", a.authority_host.is_some()),
        ("scope", a.scope.is_some()),
    ];
    let allowed: &[&str] = match kind {
        EntraKind::ManagedIdentity => &["client_id", "object_id", "resource_id", "scope"],
        EntraKind::WorkloadIdentity => &[
            "client_id",
            "tenant_id",
            "token_file",
            "authority_host",
            "scope",
        ],
        EntraKind::ClientSecret => &[
            "client_id",
            "tenant_id",
            "client_secret",
            "authority_host",
            "scope",
        ],
        EntraKind::Developer => &["tenant_id", "scope"],
    };
    for (name, set) in given {
        if set && !allowed.contains(&name) {
            errors.push(
                field(name),
                format!("does not apply to entra = \"{}\"", kind.as_str()),
            );
        }
    }
    for (name, value) in [
        ("client_id", &a.client_id),
        ("object_id", &a.object_id),
        ("tenant_id", &a.tenant_id),
    ] {
        if let Some(v) = value {
            if !is_entra_id(v) {
                errors.push(
                    field(name),
                    format!("is not an Entra ID (letters, digits, '-' and '.'), got {v:?}"),
                );
            }
        }
    }
    if let Some(r) = &a.resource_id {
        if !r.starts_with('/') || r.len() > 1024 || r.chars().any(char::is_whitespace) {
            errors.push(
                field("resource_id"),
                "must be an Azure resource id such as \"/subscriptions/.../userAssignedIdentities/NAME\"",
            );
        }
    }
    let scope = a
        .scope
        .clone()
        .unwrap_or_else(|| DEFAULT_ENTRA_SCOPE.to_string());
    if !is_scope(&scope) {
        errors.push(
            field("scope"),
            format!("is not a token scope such as \"{DEFAULT_ENTRA_SCOPE}\", got {scope:?}"),
        );
    }
    let authority = a
        .authority_host
        .as_deref()
        .filter(|_| allowed.contains(&"authority_host"))
        .and_then(|h| authority_host(h, &field("authority_host"), errors));
    let credential = match kind {
        EntraKind::ManagedIdentity => {
            let ids = [
                a.client_id.clone().map(ManagedIdentityId::ClientId),
                a.object_id.clone().map(ManagedIdentityId::ObjectId),
                a.resource_id.clone().map(ManagedIdentityId::ResourceId),
            ];
            let mut ids = ids.into_iter().flatten();
            let id = ids.next();
            if ids.next().is_some() {
                errors.push(
                    path,
                    "name a user-assigned identity by one of client_id, object_id or resource_id, not several",
                );
            }
            Some(EntraCredential::ManagedIdentity { id })
        }
        EntraKind::WorkloadIdentity => {
            for (key, var, value) in [
                ("tenant_id", "AZURE_TENANT_ID", &a.tenant_id),
                ("client_id", "AZURE_CLIENT_ID", &a.client_id),
                ("token_file", "AZURE_FEDERATED_TOKEN_FILE", &a.token_file),
            ] {
                if value.is_none() && lookup_env(var).is_none_or(|v| v.trim().is_empty()) {
                    errors.push(
                        field(key),
                        format!("is required: set it, or run where {var} is set (the AKS workload identity webhook sets it)"),
                    );
                }
            }
            Some(EntraCredential::WorkloadIdentity {
                tenant_id: a.tenant_id.clone(),
                client_id: a.client_id.clone(),
                token_file: a.token_file.clone(),
                authority_host: authority,
            })
        }
        EntraKind::ClientSecret => {
            for (key, value) in [
                ("tenant_id", &a.tenant_id),
                ("client_id", &a.client_id),
                ("client_secret", &a.client_secret),
            ] {
                if value.is_none() {
                    errors.push(field(key), "is required for entra = \"client-secret\"");
                }
            }
            let secret = a.client_secret.as_deref().and_then(|r| {
                resolve_secret(r, &field("client_secret"), errors, lookup_env, read_file)
                    .map(|(_, s)| (r.to_string(), s))
            });
            match (&a.tenant_id, &a.client_id, secret) {
                (Some(t), Some(c), Some((from, secret))) => Some(EntraCredential::ClientSecret {
                    tenant_id: t.clone(),
                    client_id: c.clone(),
                    client_secret: secret,
                    secret_from: from,
                    authority_host: authority,
                }),
                _ => None,
            }
        }
        EntraKind::Developer => Some(EntraCredential::Developer {
            tenant_id: a.tenant_id.clone(),
        }),
    };
    if errors.0.len() > n_before {
        return None;
    }
    credential.map(|credential| EntraAuth { credential, scope })
}

fn positive_u32(value: Option<i64>, default: u32, path: &str, errors: &mut Errors) -> u32 {
    match value {
        None => default,
        Some(v) if v < 1 => {
            errors.push(path, format!("must be >= 1, got {v}"));
            default
        }
        Some(v) => match u32::try_from(v) {
            Ok(v) => v,
            Err(_) => {
                errors.push(path, format!("must be <= {}, got {v}", u32::MAX));
                default
            }
        },
    }
}

fn limit(
    value: Option<u64>,
    default: u64,
    min: u64,
    max: u64,
    path: &str,
    errors: &mut Errors,
) -> usize {
    let v = value.unwrap_or(default);
    if v < min || v > max {
        errors.push(path, format!("must be between {min} and {max}, got {v}"));
    }
    usize::try_from(v.clamp(min, max)).unwrap_or(usize::MAX)
}

/// A name that is safe to put in a URL path segment: Azure deployment names and model
/// names use letters, digits, `-`, `_`, `.` and `:` (fine-tuned model ids).
pub fn is_safe_name(name: &str) -> bool {
    is_proper_segment(name.as_bytes())
        && name.len() <= 256
        && name.bytes().all(|b| NAME_BYTES[usize::from(b)])
}

/// Whether a path segment is neither empty nor a dot segment (`.`, `..`), which a URL
/// path would resolve.
pub(crate) fn is_proper_segment(segment: &[u8]) -> bool {
    !matches!(segment, b"" | b"." | b"..")
}

/// The bytes [`is_safe_name`] allows: letters, digits, `-`, `_`, `.` and `:`.
pub(crate) const NAME_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b':');
        b += 1;
    }
    table
};

fn validate_url(kind: BackendKind, raw: &str, path: &str, errors: &mut Errors) -> Arc<str> {
    let parsed = match url::Url::parse(raw) {
        Ok(u) => u,
        Err(e) => {
            errors.push(path, format!("not a valid URL ({e}): {raw:?}"));
            return Arc::from(raw);
        }
    };
    if parsed.scheme() != "http" && parsed.scheme() != "https" {
        errors.push(
            path,
            format!("scheme must be http or https, got {:?}", parsed.scheme()),
        );
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        errors.push(path, "URL has no host");
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        errors.push(path, "URL must not have a query or fragment");
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        errors.push(path, "URL must not carry credentials; use api_key");
    }
    let trimmed_path = parsed.path().trim_end_matches('/');
    if kind == BackendKind::Azure && !trimmed_path.is_empty() {
        errors.push(
            path,
            format!(
                "an Azure backend's url is the resource endpoint only (e.g. https://NAME.openai.azure.com), without a path; got path {:?}",
                parsed.path()
            ),
        );
    }
    let base = format!(
        "{}://{}{}",
        parsed.scheme(),
        &parsed[url::Position::BeforeHost..url::Position::AfterPort],
        trimmed_path
    );
    Arc::from(base)
}

fn conditions(items: &[String], path: &str, errors: &mut Errors) -> ConditionSet {
    match ConditionSet::parse(items) {
        Ok(c) => c,
        Err((i, e)) => {
            errors.push(format!("{path}[{i}]"), e);
            ConditionSet::default()
        }
    }
}

fn small_u32(
    value: Option<u64>,
    default: u32,
    min: u32,
    max: u32,
    path: &str,
    errors: &mut Errors,
) -> u32 {
    match value {
        None => default,
        Some(v) if v < u64::from(min) || v > u64::from(max) => {
            errors.push(path, format!("must be between {min} and {max}, got {v}"));
            default
        }
        Some(v) => u32::try_from(v).unwrap_or(default),
    }
}

fn validate_retry(
    file: Option<&FileRetry>,
    inherited: &RetryPolicy,
    path: &str,
    errors: &mut Errors,
) -> RetryPolicy {
    let Some(r) = file else {
        return inherited.clone();
    };
    // Fields a route's block leaves out come from the top-level [retry] (or the defaults).
    let d = inherited.clone();
    let condition = r.condition.as_ref().map_or(d.condition.clone(), |c| {
        conditions(c, &format!("{path}.condition"), errors)
    });
    let switch_on = r.switch_on.as_ref().map_or(d.switch_on.clone(), |c| {
        conditions(c, &format!("{path}.switch_on"), errors)
    });
    let count = small_u32(r.count, d.count, 0, 1000, &format!("{path}.count"), errors);
    let per_backend = small_u32(
        r.per_backend,
        d.per_backend,
        1,
        50,
        &format!("{path}.per_backend"),
        errors,
    );
    let no_wait_fields = r.interval.is_none()
        && r.delta.is_none()
        && r.max_interval.is_none()
        && r.first_fast_retry.is_none();
    let backoff = if no_wait_fields {
        d.backoff
    } else if r.interval.is_none() && (r.delta.is_some() || r.max_interval.is_some()) {
        errors.push(
            format!("{path}.interval"),
            "is required when delta or max_interval is set",
        );
        Backoff::none()
    } else {
        match Backoff::try_new(
            r.interval.unwrap_or(Duration::ZERO),
            r.delta,
            r.max_interval,
            r.first_fast_retry.unwrap_or(false),
        ) {
            Ok(b) => b,
            Err(e) => {
                errors.push(format!("{path}.max_interval"), e.to_string());
                Backoff::none()
            }
        }
    };
    let budget = match &r.budget {
        None => d.budget,
        Some(b) => {
            let bd = BudgetPolicy::default();
            let ratio = b.ratio.unwrap_or(bd.ratio);
            if !(0.0..=10.0).contains(&ratio) {
                errors.push(
                    format!("{path}.budget.ratio"),
                    format!("must be between 0 and 10, got {ratio}"),
                );
            }
            let window = b.window.unwrap_or(bd.window);
            if window < Duration::from_secs(1) || window > Duration::from_secs(3600) {
                errors.push(format!("{path}.budget.window"), "must be between 1s and 1h");
            }
            BudgetPolicy {
                ratio,
                min_per_second: small_u32(
                    b.min_per_second,
                    bd.min_per_second,
                    0,
                    100_000,
                    &format!("{path}.budget.min_per_second"),
                    errors,
                ),
                window,
            }
        }
    };
    RetryPolicy {
        condition,
        count,
        per_backend,
        switch_on,
        backoff,
        budget,
    }
}

fn validate_breaker(b: &FileBreaker, path: &str, errors: &mut Errors) -> BreakerConfig {
    let failures = small_u32(
        b.failures,
        0,
        0,
        100_000,
        &format!("{path}.failures"),
        errors,
    );
    if let Some(r) = b.ratio {
        if !(r > 0.0 && r <= 1.0) {
            errors.push(
                format!("{path}.ratio"),
                format!("must be above 0 and at most 1, got {r}"),
            );
        }
    }
    if failures == 0 && b.ratio.is_none() {
        errors.push(
            path,
            "set failures (a count) or ratio (a share of requests), or both",
        );
    }
    let window = b.window.unwrap_or(Duration::from_secs(10));
    if window < Duration::from_secs(1) || window > Duration::from_secs(3600) {
        errors.push(format!("{path}.window"), "must be between 1s and 1h");
    }
    let trip = b.trip.unwrap_or(Duration::from_secs(30));
    if trip.is_zero() {
        errors.push(format!("{path}.trip"), "must be greater than 0");
    }
    let condition = b.condition.as_ref().map_or_else(
        || ConditionSet(vec![Condition::Class(5), Condition::ConnectError]),
        |c| conditions(c, &format!("{path}.condition"), errors),
    );
    BreakerConfig {
        policy: BreakerPolicy {
            failures,
            ratio: b.ratio,
            min_requests: small_u32(
                b.min_requests,
                10,
                1,
                1_000_000,
                &format!("{path}.min_requests"),
                errors,
            ),
            window,
            trip,
            accept_retry_after: b.accept_retry_after.unwrap_or(true),
        },
        condition,
    }
}

fn validate_health_check(h: &FileHealthCheck, path: &str, errors: &mut Errors) -> HealthCheck {
    let method = h
        .method
        .clone()
        .unwrap_or_else(|| "GET".to_string())
        .to_ascii_uppercase();
    if !matches!(method.as_str(), "GET" | "POST" | "HEAD") {
        errors.push(
            format!("{path}.method"),
            format!("must be GET, POST or HEAD, got {method:?}"),
        );
    }
    if !h.path.starts_with('/') || h.path.contains("://") || h.path.contains(['\r', '\n', ' ']) {
        errors.push(
            format!("{path}.path"),
            "must be a path starting with '/', appended to the backend's url",
        );
    }
    let interval = h.interval.unwrap_or(Duration::from_secs(30));
    if interval < Duration::from_secs(1) {
        errors.push(format!("{path}.interval"), "must be at least 1s");
    }
    let timeout = h.timeout.unwrap_or(Duration::from_secs(5));
    if timeout.is_zero() {
        errors.push(format!("{path}.timeout"), "must be greater than 0");
    }
    let expect = h.expect.as_ref().map_or_else(
        || ConditionSet(vec![Condition::Class(2)]),
        |c| conditions(c, &format!("{path}.expect"), errors),
    );
    HealthCheck {
        method,
        path: h.path.clone(),
        body: h.body.clone(),
        interval,
        timeout,
        expect,
    }
}

fn validate_pattern(p: &str) -> bool {
    let plain: String = p.chars().filter(|c| *c != '*' && *c != '?').collect();
    !p.is_empty() && p.len() <= 256 && (plain.is_empty() || plain.split('/').all(is_safe_name))
}

fn validate_routes(
    routes: Vec<FileRoute>,
    backends: &[BackendConfig],
    default_retry: &RetryPolicy,
    errors: &mut Errors,
) -> Vec<Route> {
    let mut out = Vec::with_capacity(routes.len());
    for (i, r) in routes.into_iter().enumerate() {
        let p = |f: &str| format!("routes[{i}].{f}");
        if r.models.is_empty() {
            errors.push(p("models"), "must list at least one model name or pattern");
        }
        let mut patterns = Vec::new();
        for (j, m) in r.models.iter().enumerate() {
            if validate_pattern(m) {
                patterns.push(ModelPattern::parse(m));
            } else {
                errors.push(
                    format!("routes[{i}].models[{j}]"),
                    format!("{m:?} is not a model name or pattern (letters, digits, '-', '_', '.', ':', and '*' or '?')"),
                );
            }
        }
        if r.backends.is_empty() {
            errors.push(p("backends"), "must list at least one backend");
        }
        let mut members = Vec::new();
        for (j, m) in r.backends.iter().enumerate() {
            let path = format!("routes[{i}].backends[{j}]");
            let (name, priority, weight) = match m {
                FileRouteBackend::Name(n) => (n.as_str(), None, None),
                FileRouteBackend::Member(m) => (m.name.as_str(), m.priority, m.weight),
            };
            let Some(id) = backends.iter().position(|b| &*b.name == name) else {
                errors.push(path, format!("no backend is named {name:?}"));
                continue;
            };
            if members.iter().any(|(b, _, _)| *b == id) {
                errors.push(
                    path,
                    format!("backend {name:?} is listed twice in this route"),
                );
                continue;
            }
            let priority = positive_u32(
                priority,
                backends[id].priority,
                &format!("{path}.priority"),
                errors,
            );
            let weight = positive_u32(
                weight,
                backends[id].weight,
                &format!("{path}.weight"),
                errors,
            );
            members.push((id, priority, weight));
        }
        let fallback = r.fallback.unwrap_or_default();
        for (j, f) in fallback.iter().enumerate() {
            if !is_safe_name(f) {
                errors.push(
                    format!("routes[{i}].fallback[{j}]"),
                    format!("{f:?} is not a model name"),
                );
            }
        }
        if r.deadline.is_some_and(|d| d.is_zero()) {
            errors.push(p("deadline"), "must be greater than 0");
        }
        let retry = validate_retry(r.retry.as_ref(), default_retry, &p("retry"), errors);
        out.push(Route {
            name: r.name.unwrap_or_else(|| format!("routes[{i}]")),
            patterns,
            pool: pool_from(&members),
            fallback,
            retry,
            deadline: r.deadline,
        });
    }
    out
}

fn validate_priority(p: FilePriority, errors: &mut Errors) -> PriorityConfig {
    let d = CapacityPolicy::default();
    let capacity = CapacityPolicy {
        tokens_window: p.tokens_window.unwrap_or(d.tokens_window),
        requests_window: p.requests_window.unwrap_or(d.requests_window),
        stale_after: p.stale_after.unwrap_or(d.stale_after),
    };
    for (name, v) in [
        ("priority.tokens_window", capacity.tokens_window),
        ("priority.requests_window", capacity.requests_window),
        ("priority.stale_after", capacity.stale_after),
    ] {
        if v < Duration::from_millis(100) || v > Duration::from_secs(3600) {
            errors.push(name, "must be between 100ms and 1h");
        }
    }
    let default_max_tokens = p.default_max_tokens.unwrap_or(1000);
    if default_max_tokens > 10_000_000 {
        errors.push("priority.default_max_tokens", "must be at most 10000000");
    }
    let mut reserves = Vec::new();
    for (i, m) in p.models.into_iter().enumerate() {
        if m.models.is_empty() {
            errors.push(
                format!("priority.models[{i}].models"),
                "must list at least one model name or pattern",
            );
        }
        let mut pats = Vec::new();
        for (j, name) in m.models.iter().enumerate() {
            if validate_pattern(name) {
                pats.push(ModelPattern::parse(name));
            } else {
                errors.push(
                    format!("priority.models[{i}].models[{j}]"),
                    format!("{name:?} is not a model name or pattern"),
                );
            }
        }
        reserves.push((
            pats,
            Reserve {
                tokens: m.low_priority_tpm_threshold,
                requests: m.low_priority_rp10s_threshold,
            },
        ));
    }
    PriorityConfig {
        capacity,
        default_max_tokens,
        reserves,
    }
}

fn validate(
    file: FileConfig,
    lookup_env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&str) -> Result<String, String>,
) -> Result<Config, ConfigErrors> {
    let mut errors = Errors(Vec::new());

    // [server]
    let listen_raw = file.server.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
    let listen = match listen_raw.parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => {
            errors.push(
                "server.listen",
                format!(
                    "must be an IP address and port such as \"127.0.0.1:8080\", got {listen_raw:?}"
                ),
            );
            SocketAddr::from(([127, 0, 0, 1], 8080))
        }
    };
    let server = ServerConfig {
        listen,
        max_body_bytes: limit(
            file.server.max_body_bytes,
            DEFAULT_MAX_BODY_BYTES,
            1024,
            1 << 30,
            "server.max_body_bytes",
            &mut errors,
        ),
        max_header_bytes: limit(
            file.server.max_header_bytes,
            DEFAULT_MAX_HEADER_BYTES,
            8192,
            1 << 20,
            "server.max_header_bytes",
            &mut errors,
        ),
        max_headers: limit(
            file.server.max_headers,
            DEFAULT_MAX_HEADERS,
            8,
            MAX_HEADERS_LIMIT,
            "server.max_headers",
            &mut errors,
        ),
        max_connections: limit(
            file.server.max_connections,
            10_000,
            1,
            1_000_000,
            "server.max_connections",
            &mut errors,
        ),
        drain_timeout: file.server.drain_timeout.unwrap_or(Duration::from_secs(30)),
        config_poll: file.server.config_poll.unwrap_or(Duration::from_secs(1)),
        shutdown_delay: file.server.shutdown_delay.unwrap_or(Duration::ZERO),
    };

    // [auth]
    let auth = match (file.auth.mode, file.auth.client_keys) {
        (Some(AuthMode::None), Some(keys)) if !keys.is_empty() => {
            errors.push(
                "auth.client_keys",
                "must not be set together with mode = \"none\" (choose one)",
            );
            AuthConfig::None
        }
        (Some(AuthMode::None), _) => AuthConfig::None,
        (_, None) => {
            errors.push(
                "auth.client_keys",
                "is required: list client keys as [\"env:VAR\", ...], or set mode = \"none\" for local use",
            );
            AuthConfig::Keys(Vec::new())
        }
        (_, Some(keys)) => {
            if keys.is_empty() {
                errors.push(
                    "auth.client_keys",
                    "must list at least one key, or set mode = \"none\"",
                );
            }
            let mut out = Vec::new();
            let mut seen = BTreeSet::new();
            for (i, reference) in keys.iter().enumerate() {
                let path = format!("auth.client_keys[{i}]");
                if let Some((name, key)) =
                    resolve_secret(reference, &path, &mut errors, lookup_env, read_file)
                {
                    if !seen.insert(key.expose().to_string()) {
                        errors.push(
                            &path,
                            format!("the key from {name} is the same as an earlier one"),
                        );
                    }
                    out.push(ClientKey { name, key });
                }
            }
            AuthConfig::Keys(out)
        }
    };

    // [timeouts]
    let d = Timeouts::default();
    let timeouts = Timeouts {
        client_header: file.timeouts.client_header.unwrap_or(d.client_header),
        client_body: file.timeouts.client_body.unwrap_or(d.client_body),
        client_send: file.timeouts.client_send.unwrap_or(d.client_send),
        connect: file.timeouts.connect.unwrap_or(d.connect),
        first_byte: file.timeouts.first_byte.unwrap_or(d.first_byte),
        idle: file.timeouts.idle.unwrap_or(d.idle),
    };
    for (name, v) in [
        ("timeouts.client_header", timeouts.client_header),
        ("timeouts.client_body", timeouts.client_body),
        ("timeouts.client_send", timeouts.client_send),
        ("timeouts.connect", timeouts.connect),
        ("timeouts.first_byte", timeouts.first_byte),
        ("timeouts.idle", timeouts.idle),
    ] {
        if v.is_zero() {
            errors.push(name, "must be greater than 0");
        }
    }

    // [cooldown]
    let d = CooldownPolicy::default();
    let cooldown = CooldownPolicy {
        on: file.cooldown.on.as_ref().map_or_else(
            || d.on.clone(),
            |c| conditions(c, "cooldown.on", &mut errors),
        ),
        default_429: file.cooldown.default_429.unwrap_or(d.default_429),
        default_5xx: file.cooldown.default_5xx.unwrap_or(d.default_5xx),
        default_connect: file.cooldown.default_connect.unwrap_or(d.default_connect),
        // The default follows a smaller `max`; a value the user sets is checked below.
        default_auth: file
            .cooldown
            .default_auth
            .unwrap_or_else(|| d.default_auth.min(file.cooldown.max.unwrap_or(d.max))),
        max: file.cooldown.max.unwrap_or(d.max),
        max_jitter: file.cooldown.max_jitter.unwrap_or(d.max_jitter),
    };
    if cooldown.max_jitter > Duration::from_secs(60) {
        errors.push("cooldown.max_jitter", "must be at most 60s");
    }
    if cooldown.max.is_zero() {
        errors.push("cooldown.max", "must be greater than 0");
    }
    for (name, v) in [
        ("cooldown.default_429", cooldown.default_429),
        ("cooldown.default_5xx", cooldown.default_5xx),
        ("cooldown.default_connect", cooldown.default_connect),
        ("cooldown.default_auth", cooldown.default_auth),
    ] {
        if v > cooldown.max {
            errors.push(
                name,
                format!(
                    "must not exceed cooldown.max ({}), got {}",
                    humantime::format_duration(cooldown.max),
                    humantime::format_duration(v)
                ),
            );
        }
    }

    // [routing]
    let d = RoutingPolicy::default();
    let max_attempts = match file.routing.max_attempts {
        None => None,
        Some(0) => {
            errors.push("routing.max_attempts", "must be >= 1, got 0");
            None
        }
        Some(n) if n > 1000 => {
            errors.push(
                "routing.max_attempts",
                format!("must be at most 1000, got {n}"),
            );
            None
        }
        Some(n) => u32::try_from(n).ok(),
    };
    let routing = RoutingPolicy {
        when_all_cooling: file.routing.when_all_cooling.unwrap_or(d.when_all_cooling),
        max_wait: file.routing.max_wait.unwrap_or(d.max_wait),
        max_attempts,
        deadline: file.routing.deadline,
    };
    if routing.deadline.is_some_and(|d| d.is_zero()) {
        errors.push("routing.deadline", "must be greater than 0");
    }
    let default_retry = validate_retry(
        file.retry.as_ref(),
        &RetryPolicy::default(),
        "retry",
        &mut errors,
    );
    let default_breaker = file
        .circuit_breaker
        .as_ref()
        .map(|b| validate_breaker(b, "circuit_breaker", &mut errors));
    if routing.max_wait > Duration::from_secs(600) {
        errors.push("routing.max_wait", "must be at most 10m");
    }

    // [log]
    let log = LogConfig {
        format: file.log.format.unwrap_or_default(),
        level: file.log.level.unwrap_or_else(|| "info".to_string()),
    };

    // [[backends]]
    if file.backends.is_empty() {
        errors.push("backends", "at least one [[backends]] entry is required");
    }
    let mut backends = Vec::with_capacity(file.backends.len());
    let mut names = BTreeSet::new();
    for (i, b) in file.backends.into_iter().enumerate() {
        let p = |field: &str| format!("backends[{i}].{field}");
        if b.name.trim().is_empty() {
            errors.push(p("name"), "must not be empty");
        } else if !b
            .name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        {
            errors.push(
                p("name"),
                format!(
                    "may contain only letters, digits, '-', '_' and '.', got {:?}",
                    b.name
                ),
            );
        } else if !names.insert(b.name.clone()) {
            errors.push(p("name"), format!("duplicate backend name {:?}", b.name));
        }
        let url = validate_url(b.kind, &b.url, &p("url"), &mut errors);
        let priority = positive_u32(b.priority, 1, &p("priority"), &mut errors);
        let weight = positive_u32(b.weight, 1, &p("weight"), &mut errors);
        let api_key = match &b.api_key {
            Some(r) => {
                resolve_secret(r, &p("api_key"), &mut errors, lookup_env, read_file).map(|(_, s)| s)
            }
            None => {
                if b.kind == BackendKind::Azure && b.auth.is_none() {
                    errors.push(
                        p("api_key"),
                        "is required for kind = \"azure\" (e.g. \"env:AOAI_KEY\"), unless the backend has an Entra ID credential: auth = { entra = \"managed-identity\" }",
                    );
                }
                None
            }
        };
        let entra = b.auth.as_ref().and_then(|a| {
            if b.api_key.is_some() {
                errors.push(
                    p("auth"),
                    "must not be set together with api_key: a backend uses either a key or an Entra ID credential",
                );
            }
            validate_entra(a, &p("auth"), &mut errors, lookup_env, read_file)
        });
        if let Some(map) = &b.deployments {
            if map.is_empty() {
                errors.push(
                    p("deployments"),
                    "is empty: list model = \"deployment\" pairs, or leave it out to serve every model",
                );
            }
            for (model, dep) in map {
                if !is_safe_name(model) {
                    errors.push(
                        format!("backends[{i}].deployments.{model:?}"),
                        "model names may contain only letters, digits, '-', '_', '.' and ':'",
                    );
                }
                if !is_safe_name(dep) {
                    errors.push(
                        format!("backends[{i}].deployments.{model}"),
                        format!("deployment name may contain only letters, digits, '-', '_', '.' and ':', got {dep:?}"),
                    );
                }
            }
        }
        let breaker = match &b.circuit_breaker {
            Some(cb) => Some(validate_breaker(cb, &p("circuit_breaker"), &mut errors)),
            None => default_breaker.clone(),
        };
        let health_check = b
            .health_check
            .as_ref()
            .map(|h| validate_health_check(h, &p("health_check"), &mut errors));
        if b.kind == BackendKind::Openai && (b.azure_api.is_some() || b.api_version.is_some()) {
            errors.push(
                p(if b.azure_api.is_some() {
                    "azure_api"
                } else {
                    "api_version"
                }),
                "applies to kind = \"azure\" only",
            );
        }
        let api_version = b
            .api_version
            .unwrap_or_else(|| DEFAULT_AZURE_API_VERSION.to_string());
        if api_version.is_empty()
            || api_version.len() > 40
            || !api_version
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-')
        {
            errors.push(
                p("api_version"),
                format!("is not an api-version like \"2024-10-21\": {api_version:?}"),
            );
        }
        backends.push(BackendConfig {
            name: Arc::from(b.name.as_str()),
            kind: b.kind,
            url,
            priority,
            weight,
            api_key,
            entra,
            deployments: b.deployments,
            breaker,
            health_check,
            azure_api: b.azure_api.unwrap_or_default(),
            api_version,
        });
    }

    // Checked before the routes, whose errors end validation early: every mistake in
    // these sections is reported together with the rest.
    let priority = file.priority.map(|p| validate_priority(p, &mut errors));
    let admin = AdminConfig {
        listen: if file.admin.enabled == Some(false) {
            None
        } else {
            let raw = file.admin.listen.as_deref().unwrap_or(DEFAULT_ADMIN_LISTEN);
            match raw.parse::<SocketAddr>() {
                Ok(a) if a == server.listen && a.port() != 0 => {
                    errors.push("admin.listen", "must differ from server.listen: the admin endpoints never share the public port");
                    None
                }
                Ok(a) => Some(a),
                Err(_) => {
                    errors.push("admin.listen", format!("must be an IP address and port such as \"127.0.0.1:9090\", got {raw:?}"));
                    None
                }
            }
        },
        token: file.admin.token.as_deref().and_then(|t| {
            resolve_secret(t, "admin.token", &mut errors, lookup_env, read_file).map(|(_, s)| s)
        }),
    };
    let state = validate_state(file.state, &mut errors, lookup_env, read_file);
    let routes = if file.routes.is_empty() {
        vec![Route {
            name: "default".to_string(),
            patterns: vec![ModelPattern::Glob("*".to_string())],
            pool: pool_of_all(&backends),
            fallback: Vec::new(),
            retry: default_retry,
            deadline: None,
        }]
    } else {
        validate_routes(file.routes, &backends, &default_retry, &mut errors)
    };
    if !errors.0.is_empty() {
        return Err(ConfigErrors(errors.0));
    }
    let table = RoutingTable::new(routes, &backends);
    // Every fallback model must be served by some pool.
    for (i, r) in table.routes.iter().enumerate() {
        for (j, f) in r.fallback.iter().enumerate() {
            if table.route_for(f, &backends).is_none() {
                errors.push(
                    format!("routes[{i}].fallback[{j}]"),
                    format!("no route has a backend serving model {f:?}"),
                );
            }
        }
    }
    if !errors.0.is_empty() {
        return Err(ConfigErrors(errors.0));
    }
    let table = Arc::new(table);
    if !errors.0.is_empty() {
        return Err(ConfigErrors(errors.0));
    }
    Ok(Config {
        server,
        auth,
        timeouts,
        cooldown,
        routing,
        log,
        backends,
        table,
        priority,
        admin,
        state,
    })
}

/// `[state]`: the Redis several instances share, when set.
fn validate_state(
    s: FileState,
    errors: &mut Errors,
    lookup_env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&str) -> Result<String, String>,
) -> Option<RedisConfig> {
    let Some(raw) = s.redis_url else {
        for (set, key) in [
            (s.username.is_some(), "username"),
            (s.password.is_some(), "password"),
            (s.prefix.is_some(), "prefix"),
            (s.timeout.is_some(), "timeout"),
            (s.connect_timeout.is_some(), "connect_timeout"),
            (s.poll.is_some(), "poll"),
        ] {
            if set {
                errors.push(
                    format!("state.{key}"),
                    "has no effect without state.redis_url (state is kept in memory)",
                );
            }
        }
        return None;
    };
    let path = "state.redis_url";
    let url = match url::Url::parse(&raw) {
        Ok(u) => u,
        Err(e) => {
            errors.push(
                path,
                format!("is not a URL ({e}); expected redis://host:6379/0 or rediss://host:6380/0"),
            );
            return None;
        }
    };
    let tls = match url.scheme() {
        "redis" => false,
        "rediss" => true,
        other => {
            errors.push(
                path,
                format!("must start with redis:// or rediss:// (TLS), got {other}://"),
            );
            return None;
        }
    };
    let mut ok = true;
    if !url.username().is_empty() || url.password().is_some() {
        // The URL is logged and shown; the password must come by reference.
        errors.push(
            path,
            "must not hold a user name or password: set state.username and state.password = \"env:VAR\"",
        );
        ok = false;
    }
    if url.query().is_some() || url.fragment().is_some() {
        errors.push(
            path,
            "must not have a query or fragment: use the [state] keys",
        );
        ok = false;
    }
    let host = match url.host() {
        Some(url::Host::Domain(d)) if !d.is_empty() => d.to_string(),
        Some(url::Host::Ipv4(a)) => a.to_string(),
        Some(url::Host::Ipv6(a)) => a.to_string(),
        _ => {
            errors.push(path, "has no host");
            return None;
        }
    };
    let port = url.port().unwrap_or(if tls { 6380 } else { 6379 });
    let db = match url.path().trim_start_matches('/') {
        "" => 0,
        d => match d.parse::<i64>() {
            Ok(n) if (0..=10_000).contains(&n) => n,
            _ => {
                errors.push(
                    path,
                    format!("the path must be a database number such as /0, got /{d}"),
                );
                ok = false;
                0
            }
        },
    };
    let username = match s.username {
        Some(u) if u.is_empty() || u.len() > 256 || u.chars().any(char::is_whitespace) => {
            errors.push("state.username", "must be a non-empty name without spaces");
            ok = false;
            None
        }
        u => u,
    };
    let (password_from, password) = match s.password.as_deref() {
        Some(r) => match resolve_secret(r, "state.password", errors, lookup_env, read_file) {
            Some((from, p)) => (Some(from), Some(p)),
            None => {
                ok = false;
                (None, None)
            }
        },
        None => (None, None),
    };
    let prefix = s.prefix.unwrap_or_else(|| DEFAULT_STATE_PREFIX.to_string());
    let prefix_ok = !prefix.is_empty()
        && prefix.len() <= 64
        && prefix.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'{' | b'}')
        });
    if !prefix_ok {
        errors.push(
            "state.prefix",
            format!(
                "must be 1 to 64 letters, digits, '-', '_', '.', ':', '{{' or '}}', got {prefix:?}"
            ),
        );
        ok = false;
    }
    let mut duration = |v: Option<Duration>,
                        default: Duration,
                        min: Duration,
                        max: Duration,
                        key: &str,
                        note: &str| {
        let d = v.unwrap_or(default);
        if d < min || d > max {
            errors.push(
                format!("state.{key}"),
                format!("must be between {min:?} and {max:?}{note}, got {d:?}"),
            );
            ok = false;
        }
        d
    };
    let timeout = duration(
        s.timeout,
        Duration::from_millis(5),
        Duration::from_millis(1),
        MAX_STATE_TIMEOUT,
        "timeout",
        " (the longest a request waits on Redis in all)",
    );
    let connect_timeout = duration(
        s.connect_timeout,
        Duration::from_secs(1),
        Duration::from_millis(10),
        Duration::from_secs(30),
        "connect_timeout",
        "",
    );
    let poll = duration(
        s.poll,
        Duration::from_secs(1),
        Duration::from_millis(50),
        Duration::from_secs(10),
        "poll",
        "",
    );
    ok.then_some(RedisConfig {
        tls,
        host,
        port,
        db,
        username,
        password,
        password_from,
        prefix,
        timeout,
        connect_timeout,
        poll,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }
    fn no_files(_: &str) -> Result<String, String> {
        Err("no such file".into())
    }
    const VARS: &[(&str, &str)] = &[
        ("SPILLGATE_KEY_TEAM_A", "client-a"),
        ("SPILLGATE_KEY_TEAM_B", "client-b"),
        ("AOAI_PTU_EASTUS_KEY", "k1"),
        ("AOAI_PAYGO_CANADA_KEY", "k2"),
    ];

    const EXAMPLE: &str = r#"
[server]
listen = "127.0.0.1:8080"

[auth]
client_keys = ["env:SPILLGATE_KEY_TEAM_A", "env:SPILLGATE_KEY_TEAM_B"]

[[backends]]
name = "ptu-eastus"
kind = "azure"
url = "https://ptu-eastus.openai.azure.com"
priority = 1
api_key = "env:AOAI_PTU_EASTUS_KEY"
deployments = { "gpt-4o" = "gpt4o-ptu" }

[[backends]]
name = "paygo-canada"
kind = "azure"
url = "https://paygo-canada.openai.azure.com"
priority = 2
weight = 2
api_key = "env:AOAI_PAYGO_CANADA_KEY"
"#;

    fn load_with(text: &str) -> Result<Config, ConfigErrors> {
        load(text, &env(VARS), &no_files)
    }

    fn messages(text: &str) -> Vec<String> {
        match load_with(text) {
            Ok(_) => panic!("expected errors"),
            Err(e) => e.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn the_documented_example_loads() {
        let c = load_with(EXAMPLE).unwrap();
        assert_eq!(c.backends.len(), 2);
        assert_eq!(c.backends[0].deployment_for("gpt-4o"), Some("gpt4o-ptu"));
        assert_eq!(c.backends[0].deployment_for("other"), None);
        assert_eq!(c.backends[1].deployment_for("other"), Some("other"));
        assert_eq!(c.backends[1].weight, 2);
        assert_eq!(&*c.backends[0].url, "https://ptu-eastus.openai.azure.com");
        match &c.auth {
            AuthConfig::Keys(k) => {
                assert_eq!(k.len(), 2);
                assert_eq!(&*k[0].name, "SPILLGATE_KEY_TEAM_A");
            }
            AuthConfig::None => panic!("auth"),
        }
        assert_eq!(c.cooldown, CooldownPolicy::default());
    }

    #[test]
    fn priority_zero_names_the_field_path() {
        let text = EXAMPLE.replace("priority = 2", "priority = 0");
        assert_eq!(
            messages(&text),
            vec!["backends[1].priority: must be >= 1, got 0"]
        );
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_path() {
        let text = EXAMPLE.replace("weight = 2", "wieght = 2");
        let m = messages(&text);
        assert_eq!(m.len(), 1);
        assert!(
            m[0].starts_with("backends[1].wieght: unknown field `wieght`, expected one of"),
            "{m:?}"
        );
        assert!(m[0].contains("line"), "{m:?}");
        let m = messages("[servr]\nlisten = \"x\"\n");
        assert!(m[0].contains("unknown field `servr`"), "{m:?}");
    }

    #[test]
    fn wrong_types_and_kinds_name_the_path() {
        let m = messages(&EXAMPLE.replace("priority = 2", "priority = \"high\""));
        assert!(
            m[0].starts_with("backends[1].priority: invalid type"),
            "{m:?}"
        );
        let m = messages(&EXAMPLE.replace(
            "kind = \"azure\"\nurl = \"https://paygo",
            "kind = \"bedrock\"\nurl = \"https://paygo",
        ));
        assert!(
            m[0].starts_with("backends[1].kind: unknown variant `bedrock`"),
            "{m:?}"
        );
    }

    #[test]
    fn missing_env_var_is_named() {
        let text = EXAMPLE.replace("env:AOAI_PAYGO_CANADA_KEY", "env:AOAI_MISSING");
        assert_eq!(
            messages(&text),
            vec!["backends[1].api_key: environment variable AOAI_MISSING is not set"]
        );
    }

    #[test]
    fn inline_secrets_are_refused() {
        let text = EXAMPLE.replace("env:AOAI_PAYGO_CANADA_KEY", "sk-abc123");
        let m = messages(&text);
        assert!(
            m[0].starts_with("backends[1].api_key: must be a reference"),
            "{m:?}"
        );
        assert!(
            !m[0].contains("sk-abc123"),
            "the secret must not be echoed: {m:?}"
        );
    }

    #[test]
    fn file_secrets_resolve() {
        let text = EXAMPLE.replace("env:AOAI_PAYGO_CANADA_KEY", "file:/run/secrets/k");
        let c = load(&text, &env(VARS), &|p| {
            assert_eq!(p, "/run/secrets/k");
            Ok("from-file\n".into())
        })
        .unwrap();
        assert_eq!(
            c.backends[1].api_key.as_ref().unwrap().expose(),
            "from-file"
        );
    }

    #[test]
    fn all_errors_are_reported_at_once() {
        let text = r#"
[server]
listen = "nope"
[auth]
mode = "keys"
[[backends]]
name = "a"
kind = "azure"
url = "https://a.openai.azure.com/openai"
priority = 0
weight = -3
[[backends]]
name = "a"
kind = "openai"
url = "ftp://x"
"#;
        let m = messages(text);
        let expect = [
            "server.listen: must be an IP address",
            "auth.client_keys: is required",
            "backends[0].url: an Azure backend's url is the resource endpoint only",
            "backends[0].priority: must be >= 1, got 0",
            "backends[0].weight: must be >= 1, got -3",
            "backends[0].api_key: is required for kind = \"azure\"",
            "backends[1].name: duplicate backend name \"a\"",
            "backends[1].url: scheme must be http or https",
        ];
        for e in expect {
            assert!(
                m.iter().any(|x| x.starts_with(e)),
                "missing {e:?} in {m:#?}"
            );
        }
        assert_eq!(m.len(), expect.len(), "{m:#?}");
    }

    #[test]
    fn admin_errors_come_with_route_errors() {
        let text = r#"
[server]
listen = "127.0.0.1:8080"
[auth]
mode = "none"
[admin]
listen = "127.0.0.1:8080"
[[backends]]
name = "a"
kind = "openai"
url = "http://127.0.0.1:9/v1"
[[routes]]
models = ["gpt-4o"]
backends = [{ name = "missing" }]
"#;
        let m = messages(text);
        assert!(
            m.iter().any(|x| x.starts_with("admin.listen: must differ")),
            "{m:#?}"
        );
        assert!(
            m.iter().any(|x| x.starts_with("routes[0].backends[0]")),
            "{m:#?}"
        );
    }

    #[test]
    fn auth_none_needs_no_keys_and_openai_needs_no_key() {
        let text = r#"
[auth]
mode = "none"
[[backends]]
name = "vllm"
kind = "openai"
url = "http://127.0.0.1:8000/v1/"
"#;
        let c = load_with(text).unwrap();
        assert!(matches!(c.auth, AuthConfig::None));
        assert_eq!(&*c.backends[0].url, "http://127.0.0.1:8000/v1");
        assert_eq!(c.backends[0].priority, 1);
        assert_eq!(c.backends[0].weight, 1);
    }

    #[test]
    fn durations_parse_and_are_checked() {
        let text = format!("{EXAMPLE}\n[cooldown]\ndefault_429 = \"20s\"\nmax = \"15s\"\n[timeouts]\nconnect = \"250ms\"\n");
        let m = messages(&text);
        assert_eq!(
            m,
            vec!["cooldown.default_429: must not exceed cooldown.max (15s), got 20s"]
        );
        let text = format!("{EXAMPLE}\n[timeouts]\nconnect = \"250ms\"\n[routing]\nwhen_all_cooling = \"forward-first\"\n");
        let c = load_with(&text).unwrap();
        assert_eq!(c.timeouts.connect, Duration::from_millis(250));
        assert_eq!(c.routing.when_all_cooling, AllCoolingPolicy::ForwardFirst);
        let m = messages(&format!("{EXAMPLE}\n[timeouts]\nconnect = \"soon\"\n"));
        assert!(m[0].starts_with("timeouts.connect:"), "{m:?}");
        // A client's send timeout: 60 s unless set, and never 0.
        assert_eq!(
            load_with(EXAMPLE).unwrap().timeouts.client_send,
            Duration::from_secs(60)
        );
        let c = load_with(&format!("{EXAMPLE}\n[timeouts]\nclient_send = \"5m\"\n")).unwrap();
        assert_eq!(c.timeouts.client_send, Duration::from_secs(300));
        let m = messages(&format!("{EXAMPLE}\n[timeouts]\nclient_send = \"0s\"\n"));
        assert_eq!(m, vec!["timeouts.client_send: must be greater than 0"]);
    }

    #[test]
    fn deployment_names_must_be_path_safe() {
        let text = EXAMPLE.replace("\"gpt4o-ptu\"", "\"../admin\"");
        let m = messages(&text);
        assert!(
            m[0].starts_with("backends[0].deployments.gpt-4o: deployment name may contain only"),
            "{m:?}"
        );
    }

    const ROUTES: &str = r#"
[retry]
count = 2

[[routes]]
name = "turbo-16k-on-ptu"
models = ["gpt-35-turbo-16k"]
backends = [{ name = "ptu-eastus", priority = 1 }, { name = "paygo-canada", priority = 2 }]

[[routes]]
models = ["gpt-4o*"]
backends = ["ptu-eastus", "paygo-canada"]
fallback = ["gpt-35-turbo-16k"]
deadline = "60s"
[routes.retry]
condition = [">=300"]
count = 8
per_backend = 3
switch_on = ["429"]
interval = "1s"
max_interval = "10s"
delta = "1s"

[[routes]]
models = ["*"]
backends = [{ name = "paygo-canada", weight = 3 }]

[circuit_breaker]
failures = 5
window = "10s"
trip = "30s"
"#;

    #[test]
    fn routes_retry_and_breaker_load() {
        let text = format!(
            "{}\n{ROUTES}",
            EXAMPLE.replace("deployments = { \"gpt-4o\" = \"gpt4o-ptu\" }", "")
        );
        let c = load_with(&text).unwrap();
        let t = &c.table;
        assert_eq!(t.routes.len(), 3);
        assert_eq!(t.routes[0].name, "turbo-16k-on-ptu");
        assert_eq!(t.routes[1].name, "routes[1]");
        assert_eq!(t.route_for("gpt-35-turbo-16k", &c.backends), Some(0));
        assert_eq!(t.route_for("gpt-4o-mini", &c.backends), Some(1));
        assert_eq!(t.route_for("ada", &c.backends), Some(2));
        // Routes without a retry block inherit [retry]; the top-level block inherits defaults;
        // a route's own block inherits what it leaves out.
        assert_eq!(t.routes[0].retry.count, 2);
        assert_eq!(t.routes[0].retry.per_backend, 1);
        let r = &t.routes[1].retry;
        assert_eq!((r.count, r.per_backend), (8, 3));
        assert!(r.condition.matches(AttemptResult::Status(400)));
        assert_eq!(r.backoff.delay(1, 0.5), Duration::from_secs(2));
        assert_eq!(t.routes[1].deadline, Some(Duration::from_secs(60)));
        assert_eq!(t.routes[2].pool.tiers[0].members, vec![(1, 3)]);
        let b = c.backends[0].breaker.as_ref().unwrap();
        assert_eq!(b.policy.failures, 5);
        assert!(b.condition.matches(AttemptResult::Status(502)));
        assert!(!b.condition.matches(AttemptResult::Status(429)));
    }

    #[test]
    fn a_route_retry_block_inherits_what_it_leaves_out() {
        let text = format!(
            "{EXAMPLE}\n[retry]\ncondition = [\">=300\"]\nper_backend = 3\ninterval = \"2s\"\n[[routes]]\nmodels = [\"*\"]\nbackends = [\"paygo-canada\"]\n[routes.retry]\ncount = 5\n"
        );
        let c = load_with(&text).unwrap();
        let r = &c.table.routes[0].retry;
        assert_eq!(r.count, 5, "its own");
        assert_eq!(r.per_backend, 3, "from [retry]");
        assert!(
            r.condition.matches(AttemptResult::Status(404)),
            "from [retry]"
        );
        assert_eq!(r.backoff.interval(), Duration::from_secs(2), "from [retry]");
    }

    #[test]
    fn route_errors_name_their_paths() {
        let text = format!(
            "{EXAMPLE}\n{}",
            ROUTES
                .replace(
                    "name = \"paygo-canada\", weight = 3",
                    "name = \"paygo-canda\""
                )
                .replace(
                    "condition = [\">=300\"]",
                    "condition = [\">=300\", \"6xx\"]"
                )
                .replace("max_interval = \"10s\"", "max_interval = \"500ms\"")
                .replace(
                    "fallback = [\"gpt-35-turbo-16k\"]",
                    "fallback = [\"gpt-9\"]"
                )
                .replace("failures = 5", "failures = 0")
        );
        let m = messages(&text);
        let expect = [
            "routes[2].backends[0]: no backend is named \"paygo-canda\"",
            "routes[1].retry.condition[1]: \"6xx\" is not a condition",
            "routes[1].retry.max_interval: max_interval (500ms) must not be shorter than interval (1s)",
            "circuit_breaker: set failures (a count) or ratio",
        ];
        for e in expect {
            assert!(
                m.iter().any(|x| x.starts_with(e)),
                "missing {e:?} in {m:#?}"
            );
        }
        // Fallbacks are checked once the routes themselves are valid.
        let text = format!(
            "{EXAMPLE}\n{}",
            ROUTES
                .replace(
                    "fallback = [\"gpt-35-turbo-16k\"]",
                    "fallback = [\"gpt-9\"]"
                )
                .replace("models = [\"*\"]", "models = [\"ada*\"]")
        );
        let m = messages(&text);
        assert!(
            m.iter().any(|x| x.starts_with(
                "routes[1].fallback[0]: no route has a backend serving model \"gpt-9\""
            )),
            "{m:#?}"
        );
    }

    #[test]
    fn priority_reserves_load_per_model() {
        let text = format!(
            "{EXAMPLE}\n[priority]\nstale_after = \"5s\"\n[[priority.models]]\nmodels = [\"embedding100k\"]\nlow_priority_tpm_threshold = 30000\nlow_priority_rp10s_threshold = 3\n[[priority.models]]\nmodels = [\"gpt-4o*\"]\nlow_priority_tpm_threshold = 5000\nlow_priority_rp10s_threshold = 1\n"
        );
        let c = load_with(&text).unwrap();
        let p = c.priority.unwrap();
        assert_eq!(p.capacity.stale_after, Duration::from_secs(5));
        assert_eq!(
            p.reserve_for("embedding100k"),
            Some(Reserve {
                tokens: 30_000,
                requests: 3
            })
        );
        assert_eq!(
            p.reserve_for("gpt-4o-mini"),
            Some(Reserve {
                tokens: 5_000,
                requests: 1
            })
        );
        assert_eq!(p.reserve_for("ada"), None);
        let m = messages(&format!("{EXAMPLE}\n[priority]\nstale_after = \"1ms\"\n[[priority.models]]\nmodels = [\"a b\"]\nlow_priority_tpm_threshold = 1\nlow_priority_rp10s_threshold = 1\n"));
        assert!(
            m.iter()
                .any(|x| x.starts_with("priority.stale_after: must be between")),
            "{m:?}"
        );
        assert!(
            m.iter()
                .any(|x| x.starts_with("priority.models[0].models[0]:")),
            "{m:?}"
        );
    }

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret::new("sk-very-secret".into());
        assert_eq!(format!("{s:?}"), "Secret(***)");
    }

    const ENTRA: &str = r#"
[auth]
mode = "none"
[[backends]]
name = "keyed"
kind = "azure"
url = "https://a.openai.azure.com"
api_key = "env:AOAI_PTU_EASTUS_KEY"
[[backends]]
name = "mi"
kind = "azure"
url = "https://b.openai.azure.com"
auth = { entra = "managed-identity" }
[[backends]]
name = "mi-too"
kind = "azure"
url = "https://c.openai.azure.com"
auth = { entra = "managed-identity" }
[[backends]]
name = "uami"
kind = "azure"
url = "https://d.openai.azure.com"
auth = { entra = "managed-identity", client_id = "11111111-2222-3333-4444-555555555555" }
[[backends]]
name = "sp"
kind = "azure"
url = "https://e.openai.azure.com"
auth = { entra = "client-secret", tenant_id = "contoso.onmicrosoft.com", client_id = "abc", client_secret = "env:SP_SECRET", authority_host = "https://login.microsoftonline.us/" }
[[backends]]
name = "aks"
kind = "openai"
url = "https://f.openai.azure.com/openai/v1"
auth = { entra = "workload-identity", scope = "https://ai.azure.com/.default" }
[[backends]]
name = "laptop"
kind = "azure"
url = "https://g.openai.azure.com"
auth = { entra = "developer" }
"#;

    fn entra_env(k: &str) -> Option<String> {
        match k {
            "AOAI_PTU_EASTUS_KEY" => Some("k1".into()),
            "SP_SECRET" => Some("the-client-secret-value".into()),
            "AZURE_TENANT_ID" | "AZURE_CLIENT_ID" => Some("x".into()),
            "AZURE_FEDERATED_TOKEN_FILE" => Some("/var/run/token".into()),
            _ => None,
        }
    }

    fn entra_messages(text: &str) -> Vec<String> {
        match load(text, &entra_env, &no_files) {
            Ok(_) => panic!("expected errors"),
            Err(e) => e.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn entra_credentials_load_beside_keys() {
        let c = load(ENTRA, &entra_env, &no_files).unwrap();
        let b = &c.backends;
        assert!(b[0].api_key.is_some() && b[0].entra.is_none());
        let mi = b[1].entra.clone().unwrap();
        assert_eq!(mi.scope, DEFAULT_ENTRA_SCOPE);
        assert_eq!(mi.credential, EntraCredential::ManagedIdentity { id: None });
        assert!(b[1].api_key.is_none());
        // The same credential and scope: one token for both backends.
        assert_eq!(b[2].entra, b[1].entra);
        assert_eq!(
            b[3].entra.as_ref().unwrap().credential,
            EntraCredential::ManagedIdentity {
                id: Some(ManagedIdentityId::ClientId(
                    "11111111-2222-3333-4444-555555555555".into()
                ))
            }
        );
        assert_ne!(b[3].entra, b[1].entra);
        match &b[4].entra.as_ref().unwrap().credential {
            EntraCredential::ClientSecret {
                tenant_id,
                client_secret,
                secret_from,
                authority_host,
                ..
            } => {
                assert_eq!(tenant_id, "contoso.onmicrosoft.com");
                assert_eq!(client_secret.expose(), "the-client-secret-value");
                assert_eq!(secret_from, "env:SP_SECRET");
                assert_eq!(
                    authority_host.as_deref(),
                    Some("https://login.microsoftonline.us")
                );
            }
            other => panic!("{other:?}"),
        }
        let aks = b[5].entra.as_ref().unwrap();
        assert_eq!(aks.scope, "https://ai.azure.com/.default");
        assert_eq!(aks.credential.kind(), EntraKind::WorkloadIdentity);
        assert_eq!(
            b[6].entra.as_ref().unwrap().credential,
            EntraCredential::Developer { tenant_id: None }
        );
        // Neither the parsed config nor a credential's description shows the secret.
        let shown = format!(
            "{c:?} {}",
            b[4].entra.as_ref().unwrap().credential.describe()
        );
        assert!(!shown.contains("the-client-secret-value"), "{shown}");
        assert!(shown.contains("env:SP_SECRET"));
    }

    #[test]
    fn entra_mistakes_name_their_paths() {
        let base = "[auth]\nmode = \"none\"\n[[backends]]\nname = \"a\"\nkind = \"azure\"\nurl = \"https://a.openai.azure.com\"\n";
        let with = |line: &str| format!("{base}{line}\n");
        let cases: &[(&str, &str)] = &[
            (
                "api_key = \"env:AOAI_PTU_EASTUS_KEY\"\nauth = { entra = \"managed-identity\" }",
                "backends[0].auth: must not be set together with api_key",
            ),
            (
                "",
                "backends[0].api_key: is required for kind = \"azure\" (e.g. \"env:AOAI_KEY\"), unless the backend has an Entra ID credential",
            ),
            (
                "auth = { entra = \"managed-identity\", tenant_id = \"t\" }",
                "backends[0].auth.tenant_id: does not apply to entra = \"managed-identity\"",
            ),
            (
                "auth = { entra = \"managed-identity\", client_id = \"a\", object_id = \"b\" }",
                "backends[0].auth: name a user-assigned identity by one of client_id, object_id or resource_id",
            ),
            (
                "auth = { entra = \"client-secret\", tenant_id = \"t\", client_id = \"c\" }",
                "backends[0].auth.client_secret: is required for entra = \"client-secret\"",
            ),
            (
                "auth = { entra = \"client-secret\", tenant_id = \"t\", client_id = \"c\", client_secret = \"s3cr3t-inline\" }",
                "backends[0].auth.client_secret: must be a reference such as",
            ),
            (
                "auth = { entra = \"client-secret\", tenant_id = \"t\", client_id = \"c\", client_secret = \"env:NOPE\" }",
                "backends[0].auth.client_secret: environment variable NOPE is not set",
            ),
            (
                "auth = { entra = \"client-secret\", tenant_id = \"t@x\", client_id = \"c\", client_secret = \"env:SP_SECRET\" }",
                "backends[0].auth.tenant_id: is not an Entra ID",
            ),
            (
                "auth = { entra = \"client-secret\", tenant_id = \"t\", client_id = \"c\", client_secret = \"env:SP_SECRET\", authority_host = \"http://login.example.com\" }",
                "backends[0].auth.authority_host: must be an https URL",
            ),
            (
                "auth = { entra = \"developer\", scope = \"not a scope\" }",
                "backends[0].auth.scope: is not a token scope",
            ),
            (
                "auth = { entra = \"developer\", client_secret = \"env:SP_SECRET\" }",
                "backends[0].auth.client_secret: does not apply to entra = \"developer\"",
            ),
            (
                "auth = { entra = \"certificate\" }",
                "backends[0].auth.entra: unknown variant `certificate`, expected one of `managed-identity`, `workload-identity`, `client-secret`, `developer`",
            ),
            (
                "auth = { entra = \"developer\", tenant = \"t\" }",
                "backends[0].auth.tenant: unknown field `tenant`",
            ),
        ];
        for (line, expected) in cases {
            let m = entra_messages(&with(line));
            assert!(
                m.iter().any(|x| x.starts_with(expected)),
                "{line}: expected {expected:?} in {m:#?}"
            );
            assert!(
                !m.iter()
                    .any(|x| x.contains("s3cr3t-inline") || x.contains("the-client-secret-value")),
                "{m:?}"
            );
        }
        // A loopback authority may be plain http (a local token service).
        let ok = with("auth = { entra = \"client-secret\", tenant_id = \"t\", client_id = \"c\", client_secret = \"env:SP_SECRET\", authority_host = \"http://127.0.0.1:8400\" }");
        load(&ok, &entra_env, &no_files).unwrap();
        // Workload identity without the webhook's variables, and no values in the file.
        let m = match load(
            &with("auth = { entra = \"workload-identity\" }"),
            &|_| None,
            &no_files,
        ) {
            Ok(_) => panic!("expected errors"),
            Err(e) => e.0.iter().map(ToString::to_string).collect::<Vec<_>>(),
        };
        assert_eq!(m.len(), 3, "{m:#?}");
        assert!(m[0].starts_with("backends[0].auth.tenant_id: is required: set it, or run where AZURE_TENANT_ID is set"), "{m:#?}");
    }

    #[test]
    fn auth_cooldown_follows_max_unless_set() {
        let c = load_with(&format!("{EXAMPLE}\n[cooldown]\nmax = \"15s\"\n")).unwrap();
        assert_eq!(c.cooldown.default_auth, Duration::from_secs(15));
        let c = load_with(EXAMPLE).unwrap();
        assert_eq!(c.cooldown.default_auth, Duration::from_secs(30));
        assert_eq!(
            messages(&format!(
                "{EXAMPLE}\n[cooldown]\nmax = \"15s\"\ndefault_auth = \"1m\"\n"
            )),
            vec!["cooldown.default_auth: must not exceed cooldown.max (15s), got 1m"]
        );
    }

    #[test]
    fn state_defaults_to_memory_and_reads_a_redis_section() {
        assert_eq!(load_with(EXAMPLE).unwrap().state, None);
        let vars = |k: &str| match k {
            "REDIS_PASSWORD" => Some("s3cret".to_string()),
            k => env(VARS)(k),
        };
        let c = load(
            &format!(
                "{EXAMPLE}\n[state]\nredis_url = \"rediss://cache.example.net:6380/2\"\nusername = \"gw\"\npassword = \"env:REDIS_PASSWORD\"\nprefix = \"prod-gw\"\ntimeout = \"10ms\"\n"
            ),
            &vars,
            &no_files,
        )
        .unwrap();
        let r = c.state.unwrap();
        assert!(r.tls);
        assert_eq!(
            (r.host.as_str(), r.port, r.db),
            ("cache.example.net", 6380, 2)
        );
        assert_eq!(r.username.as_deref(), Some("gw"));
        assert_eq!(r.password.as_ref().map(Secret::expose), Some("s3cret"));
        assert_eq!(r.password_from.as_deref(), Some("REDIS_PASSWORD"));
        assert_eq!(r.prefix, "prod-gw");
        assert_eq!(r.timeout, Duration::from_millis(10));
        assert_eq!(r.poll, Duration::from_secs(1));
        assert_eq!(r.display_url(), "rediss://cache.example.net:6380/2");
        assert!(!format!("{r:?}").contains("s3cret"));
        let plain = load_with(&format!(
            "{EXAMPLE}\n[state]\nredis_url = \"redis://10.0.0.5\"\n"
        ))
        .unwrap()
        .state
        .unwrap();
        assert_eq!(plain.display_url(), "redis://10.0.0.5:6379/0");
        assert_eq!(plain.prefix, DEFAULT_STATE_PREFIX);
    }

    #[test]
    fn state_errors_name_their_field() {
        let m = messages(&format!(
            "{EXAMPLE}\n[state]\nredis_url = \"redis://user:hunter2@h:6379/x\"\nprefix = \"a b\"\ntimeout = \"5s\"\npassword = \"hunter2\"\n"
        ));
        assert_eq!(m.len(), 5, "{m:#?}");
        assert!(
            m[0].starts_with("state.redis_url: must not hold a user name or password"),
            "{m:#?}"
        );
        assert!(
            m[1].starts_with("state.redis_url: the path must be a database number"),
            "{m:#?}"
        );
        assert!(
            m[2].starts_with("state.password: must be a reference"),
            "{m:#?}"
        );
        assert!(m[3].starts_with("state.prefix: must be 1 to 64"), "{m:#?}");
        assert!(
            m[4].starts_with(
                "state.timeout: must be between 1ms and 100ms (the longest a request waits on Redis in all), got 5s"
            ),
            "{m:#?}"
        );
        assert!(m.iter().all(|l| !l.contains("hunter2")), "{m:#?}");
        assert_eq!(
            messages(&format!("{EXAMPLE}\n[state]\nredis_url = \"http://h\"\n")),
            vec!["state.redis_url: must start with redis:// or rediss:// (TLS), got http://"]
        );
        assert_eq!(
            messages(&format!("{EXAMPLE}\n[state]\nprefix = \"x\"\n")),
            vec!["state.prefix: has no effect without state.redis_url (state is kept in memory)"]
        );
        assert_eq!(
            messages(&format!("{EXAMPLE}\n[state]\nredis_ur = \"redis://h\"\n"))[0]
                .split(',')
                .next()
                .unwrap(),
            "state.redis_ur: unknown field `redis_ur`"
        );
    }
}
