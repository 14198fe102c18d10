//! `spillgate check`: validate a config and show the routing it resolves to, so an
//! operator sees which backend serves which model, in which tier and with what share,
//! under which retry policy and with which credential, before traffic does. With
//! `--probe`, each Entra ID credential is asked for a token, so an unreachable identity
//! endpoint or a credential Entra ID refuses (a wrong secret, an unknown client, a missing
//! federated credential) shows up before the gateway starts. A missing role does not:
//! Entra ID issues tokens whatever roles the identity has, and only the backend refuses
//! them (401).

use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;

use spillgate_core::config::{
    AuthConfig, BackendConfig, BackendKind, Config, EntraAuth, RetryPolicy,
};
use spillgate_core::routing::Pool;

use crate::entra::{FetchToken, SdkFetcher};
use crate::upstream::{Upstream, UpstreamClient};

/// How each backend authenticates, one line each; backends that share an Entra ID
/// credential (one token) say so.
fn credential_lines(out: &mut String, backends: &[BackendConfig]) {
    let _ = writeln!(out, "backend credentials:");
    let width = backends.iter().map(|b| b.name.len()).max().unwrap_or(0);
    for b in backends {
        let how = match (&b.entra, &b.api_key, b.kind) {
            (Some(a), _, _) => {
                let shared: Vec<&str> = backends
                    .iter()
                    .filter(|o| o.name != b.name && o.entra.as_ref() == Some(a))
                    .map(|o| &*o.name)
                    .collect();
                let shared = if shared.is_empty() {
                    String::new()
                } else {
                    format!("; one token shared with {}", shared.join(", "))
                };
                format!(
                    "Entra ID token (Authorization: Bearer): {}, scope {}{shared}",
                    a.credential.describe(),
                    a.scope
                )
            }
            (None, Some(_), BackendKind::Azure) => "API key (api-key header)".to_string(),
            (None, Some(_), BackendKind::Openai) => "API key (Authorization: Bearer)".to_string(),
            (None, None, _) => "none".to_string(),
        };
        let _ = writeln!(out, "  {:<width$}  {how}", b.name);
    }
}

/// Each distinct Entra ID credential of `config` with the backends that use it.
fn entra_credentials(config: &Config) -> Vec<(&EntraAuth, Vec<&str>)> {
    let mut out: Vec<(&EntraAuth, Vec<&str>)> = Vec::new();
    for b in &config.backends {
        let Some(a) = &b.entra else { continue };
        match out.iter_mut().find(|(x, _)| *x == a) {
            Some((_, names)) => names.push(&b.name),
            None => out.push((a, vec![&b.name])),
        }
    }
    out
}

/// `spillgate check --probe`: asks each Entra ID credential for a token (the token itself
/// is never shown) and reports what happened. Returns the report and whether every
/// credential produced a token.
pub async fn probe(config: &Config) -> (String, bool) {
    let upstream: Arc<dyn Upstream> = Arc::new(UpstreamClient::new(&config.timeouts));
    probe_with(config, upstream).await
}

/// [`probe`] over a given client (tests script the identity endpoints).
pub async fn probe_with(config: &Config, upstream: Arc<dyn Upstream>) -> (String, bool) {
    let mut out = String::new();
    let mut all_ok = true;
    if let Some(redis) = &config.state {
        let _ = writeln!(out, "probing the shared state store:");
        let _ = writeln!(out, "  Redis at {}", redis.display_url());
        match crate::store::ping_redis(redis).await {
            Ok(version) => {
                let _ = writeln!(out, "    OK: connected, {version}, scripts load");
            }
            Err(e) => {
                all_ok = false;
                let _ = writeln!(out, "    FAILED: {e}");
            }
        }
    }
    let creds = entra_credentials(config);
    if creds.is_empty() {
        if config.state.is_none() {
            let _ = writeln!(
                out,
                "no backend uses an Entra ID credential and state is in memory: nothing to probe"
            );
        }
        return (out, all_ok);
    }
    let _ = writeln!(out, "probing Entra ID credentials:");
    for (auth, names) in creds {
        let fetcher = SdkFetcher::new(auth.clone(), Arc::clone(&upstream));
        let _ = writeln!(
            out,
            "  {} for {} (backends {})",
            auth.credential.describe(),
            auth.scope,
            names.join(", ")
        );
        let _ = writeln!(out, "    token endpoint: {}", fetcher.endpoint());
        match tokio::time::timeout(Duration::from_secs(100), fetcher.fetch()).await {
            Ok(Ok(t)) => {
                let secs = t.expires_in.as_secs();
                let _ = writeln!(
                    out,
                    "    OK: token obtained, valid for {}h {:02}m",
                    secs / 3600,
                    secs % 3600 / 60
                );
            }
            Ok(Err(e)) => {
                all_ok = false;
                let _ = writeln!(out, "    FAILED: {e}");
            }
            Err(_) => {
                all_ok = false;
                let _ = writeln!(out, "    FAILED: no answer within 100 s");
            }
        }
    }
    (out, all_ok)
}

fn pool_lines(out: &mut String, backends: &[BackendConfig], model: Option<&str>, pool: &Pool) {
    for tier in &pool.tiers {
        let members: Vec<_> = tier
            .members
            .iter()
            .filter(|(id, _)| model.is_none_or(|m| backends[*id].deployment_for(m).is_some()))
            .collect();
        let total: u32 = members.iter().map(|(_, w)| *w).sum();
        for (id, weight) in members {
            let b = &backends[*id];
            let share = f64::from(*weight) * 100.0 / f64::from(total.max(1));
            let serves = match (model, &b.deployments) {
                (Some(m), _) => format!("as {:?}", b.deployment_for(m).unwrap_or(m)),
                (None, None) => "any model, under its own name".to_string(),
                (None, Some(map)) => map
                    .iter()
                    .map(|(k, v)| format!("{k} as {v:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            let _ = writeln!(
                out,
                "    priority {:<3} {:<22} weight {:<4} ({:>5.1}% of tier)  {} {}  {serves}",
                tier.priority,
                b.name,
                weight,
                share,
                b.kind.as_str(),
                b.url,
            );
        }
    }
}

fn retry_line(r: &RetryPolicy) -> String {
    let wait = if r.per_backend > 1 {
        format!(
            "{} tries per backend (waits from {:?}{}), moves on at once on {}",
            r.per_backend,
            r.backoff.interval(),
            r.backoff
                .max_interval()
                .map_or(String::new(), |m| format!(" up to {m:?}")),
            r.switch_on
        )
    } else {
        "moves to the next backend at once".to_string()
    };
    format!(
        "retry on {}: at most {} retries, {wait}; budget {:.0}% of requests + {}/s over {:?}",
        r.condition,
        r.count,
        r.budget.ratio * 100.0,
        r.budget.min_per_second,
        r.budget.window
    )
}

/// Where backend state lives.
fn state_line(config: &Config) -> String {
    match &config.state {
        None => "backend state: this instance's memory (no [state] redis_url)".to_string(),
        Some(r) => {
            let user = r
                .username
                .as_deref()
                .map_or(String::new(), |u| format!(", user {u}"));
            let password = r
                .password_from
                .as_deref()
                .map_or(", no password".to_string(), |from| {
                    format!(", password from {from}")
                });
            format!(
                "backend state: shared through Redis at {} (key prefix {:?}{user}{password}); requests wait at most {:?} on it, full re-read every {:?}",
                r.display_url(),
                r.prefix,
                r.timeout,
                r.poll
            )
        }
    }
}

/// The routing table as text: routes with their policies and pools, then the models
/// clients can list and where each goes.
pub fn render(config: &Config) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "listen: {}", config.server.listen);
    match &config.auth {
        AuthConfig::None => {
            let _ = writeln!(
                out,
                "client auth: NONE (any client is accepted; for local use only)"
            );
        }
        AuthConfig::Keys(keys) => {
            let names: Vec<&str> = keys.iter().map(|k| &*k.name).collect();
            let _ = writeln!(
                out,
                "client auth: {} key(s) from {}",
                keys.len(),
                names.join(", ")
            );
        }
    }
    credential_lines(&mut out, &config.backends);
    let _ = writeln!(out, "{}", state_line(config));
    let c = &config.cooldown;
    let _ = writeln!(
        out,
        "when all backends are cooling: {}; cooldown defaults 429={:?} 5xx={:?} connect={:?} max={:?}",
        config.routing.when_all_cooling.as_str(),
        c.default_429,
        c.default_5xx,
        c.default_connect,
        c.max
    );
    for b in &config.backends {
        if let Some(br) = &b.breaker {
            let _ = writeln!(
                out,
                "circuit breaker on {}: {} failures{} on {} within {:?} trip it for {:?}",
                b.name,
                br.policy.failures,
                br.policy.ratio.map_or(String::new(), |r| format!(
                    " (or {:.0}% of >= {} requests)",
                    r * 100.0,
                    br.policy.min_requests
                )),
                br.condition,
                br.policy.window,
                br.policy.trip
            );
        }
        if let Some(h) = &b.health_check {
            let _ = writeln!(
                out,
                "health check on {}: {} {} every {:?}",
                b.name, h.method, h.path, h.interval
            );
        }
    }
    let table = &config.table;
    for r in &table.routes {
        let patterns: Vec<&str> = r.patterns.iter().map(|p| p.as_str()).collect();
        let _ = writeln!(
            out,
            "\nroute {:?} for models {}:",
            r.name,
            patterns.join(", ")
        );
        let _ = writeln!(out, "  {}", retry_line(&r.retry));
        if !r.fallback.is_empty() {
            let _ = writeln!(
                out,
                "  fallback when every backend is cooling: {}",
                r.fallback.join(", ")
            );
        }
        if let Some(d) = r.deadline.or(config.routing.deadline) {
            let _ = writeln!(out, "  deadline: {d:?}");
        }
        pool_lines(&mut out, &config.backends, None, &r.pool);
    }
    let mut any = false;
    for model in table.model_names() {
        if !any {
            let _ = writeln!(out, "\nmodels clients can list (GET /v1/models):");
            any = true;
        }
        match table.route_for(model, &config.backends) {
            Some(id) => {
                let _ = writeln!(out, "  {model:?} -> route {:?}", table.routes[id].name);
                pool_lines(
                    &mut out,
                    &config.backends,
                    Some(model),
                    &table.routes[id].pool,
                );
            }
            None => {
                let _ = writeln!(out, "  {model:?} -> no route serves it (404)");
            }
        }
    }
    out
}
