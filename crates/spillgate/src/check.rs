//! `spillgate check`: validate a config and show the routing it resolves to, so an
//! operator sees which backend serves which model, in which tier and with what share,
//! before traffic does.

use std::fmt::Write;

use spillgate_core::config::{AuthConfig, Config};
use spillgate_core::routing::Pool;

fn pool_lines(out: &mut String, config: &Config, model: &str, pool: &Pool) {
    for tier in &pool.tiers {
        let total: u32 = tier.members.iter().map(|(_, w)| *w).sum();
        for (id, weight) in &tier.members {
            let b = &config.backends[*id];
            let share = f64::from(*weight) * 100.0 / f64::from(total.max(1));
            let deployment = b.deployment_for(model).unwrap_or(model);
            let _ = writeln!(
                out,
                "  priority {:<3} {:<24} weight {:<4} ({:>5.1}% of tier)  {} {}  as {:?}",
                tier.priority,
                b.name,
                weight,
                share,
                b.kind.as_str(),
                b.url,
                deployment
            );
        }
    }
}

/// The routing table as text: one block per model, tiers in order.
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
    let _ = writeln!(
        out,
        "when all backends are cooling: {}; cooldown defaults 429={:?} 5xx={:?} connect={:?} max={:?}",
        config.routing.when_all_cooling.as_str(),
        config.cooldown.default_429,
        config.cooldown.default_5xx,
        config.cooldown.default_connect,
        config.cooldown.max
    );
    for (model, pool) in &config.table.by_model {
        let _ = writeln!(out, "\nmodel {model:?}:");
        pool_lines(&mut out, config, model, pool);
    }
    if !config.table.any_model.is_empty() {
        let _ = writeln!(out, "\nany other model (served under its own name):");
        pool_lines(&mut out, config, "<model>", &config.table.any_model);
    } else {
        let _ = writeln!(out, "\nany other model: not served (404)");
    }
    out
}
