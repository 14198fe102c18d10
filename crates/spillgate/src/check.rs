//! `spillgate check`: validate a config and show the routing it resolves to, so an
//! operator sees which backend serves which model, in which tier and with what share,
//! under which retry policy, before traffic does.

use std::fmt::Write;

use spillgate_core::config::{AuthConfig, BackendConfig, Config, RetryPolicy};
use spillgate_core::routing::Pool;

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
