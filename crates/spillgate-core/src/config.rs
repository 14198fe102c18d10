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

use crate::routing::RoutingTable;

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
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileServer {
    pub listen: Option<String>,
    pub max_body_bytes: Option<u64>,
    pub max_header_bytes: Option<u64>,
    pub max_headers: Option<u64>,
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
    pub max: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRouting {
    pub when_all_cooling: Option<AllCoolingPolicy>,
    #[serde(default, with = "humantime_serde")]
    pub max_wait: Option<Duration>,
    pub max_attempts: Option<u64>,
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
    pub deployments: Option<BTreeMap<String, String>>,
}

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
#[derive(Clone, PartialEq, Eq)]
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
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub max_header_bytes: usize,
    pub max_headers: usize,
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
    pub connect: Duration,
    pub first_byte: Duration,
    pub idle: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CooldownPolicy {
    pub default_429: Duration,
    pub default_5xx: Duration,
    pub default_connect: Duration,
    pub max: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingPolicy {
    pub when_all_cooling: AllCoolingPolicy,
    pub max_wait: Duration,
    /// Upper bound on upstream attempts for one request; `None` = one per backend.
    pub max_attempts: Option<u32>,
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
    /// Model name (what clients ask for) -> name on this backend. `None` = serves any
    /// model under its own name.
    pub deployments: Option<BTreeMap<String, String>>,
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

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
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
            default_429: Duration::from_secs(10),
            default_5xx: Duration::from_secs(10),
            default_connect: Duration::from_secs(10),
            max: Duration::from_secs(300),
        }
    }
}

impl Default for RoutingPolicy {
    fn default() -> Self {
        RoutingPolicy {
            when_all_cooling: AllCoolingPolicy::Reject,
            max_wait: Duration::from_secs(5),
            max_attempts: None,
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
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

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
            1000,
            "server.max_headers",
            &mut errors,
        ),
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
        connect: file.timeouts.connect.unwrap_or(d.connect),
        first_byte: file.timeouts.first_byte.unwrap_or(d.first_byte),
        idle: file.timeouts.idle.unwrap_or(d.idle),
    };
    for (name, v) in [
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
        default_429: file.cooldown.default_429.unwrap_or(d.default_429),
        default_5xx: file.cooldown.default_5xx.unwrap_or(d.default_5xx),
        default_connect: file.cooldown.default_connect.unwrap_or(d.default_connect),
        max: file.cooldown.max.unwrap_or(d.max),
    };
    if cooldown.max.is_zero() {
        errors.push("cooldown.max", "must be greater than 0");
    }
    for (name, v) in [
        ("cooldown.default_429", cooldown.default_429),
        ("cooldown.default_5xx", cooldown.default_5xx),
        ("cooldown.default_connect", cooldown.default_connect),
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
        Some(n) => Some(u32::try_from(n.min(1000)).unwrap_or(1000)),
    };
    let routing = RoutingPolicy {
        when_all_cooling: file.routing.when_all_cooling.unwrap_or(d.when_all_cooling),
        max_wait: file.routing.max_wait.unwrap_or(d.max_wait),
        max_attempts,
    };
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
                if b.kind == BackendKind::Azure {
                    errors.push(
                        p("api_key"),
                        "is required for kind = \"azure\" (e.g. \"env:AOAI_KEY\")",
                    );
                }
                None
            }
        };
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
        backends.push(BackendConfig {
            name: Arc::from(b.name.as_str()),
            kind: b.kind,
            url,
            priority,
            weight,
            api_key,
            deployments: b.deployments,
        });
    }

    if !errors.0.is_empty() {
        return Err(ConfigErrors(errors.0));
    }
    let table = Arc::new(RoutingTable::build(&backends));
    Ok(Config {
        server,
        auth,
        timeouts,
        cooldown,
        routing,
        log,
        backends,
        table,
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

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret::new("sk-very-secret".into());
        assert_eq!(format!("{s:?}"), "Secret(***)");
    }
}
