//! Active health checks: a cheap request to a backend on an interval, for backends where
//! an operator would rather find out before a client does. Off unless a backend has a
//! `health_check`. A failed check cools the backend (reason "health") for one interval;
//! the log says when a backend turns unhealthy and when it is healthy again, not every
//! check. On a backend with an Entra ID credential, a 401 is about the token, not the
//! backend's health: it asks for a renewal (as a 401 to a request does) and cools the
//! backend with reason "auth".

use std::sync::{Arc, Weak};

use bytes::Bytes;
use spillgate_core::outcome::{CoolReason, Cooldown};
use spillgate_core::retry::AttemptResult;

use crate::app::{App, BackendRt};
use crate::entra::{BearerToken, Refusal, TokenSource};

/// Starts one task per backend that has a health check. Tasks hold a weak reference and
/// end when the gateway is dropped.
pub fn spawn(app: &Arc<App>) {
    let snap = app.snapshot.load();
    for b in &snap.backends {
        if b.cfg.health_check.is_some() {
            start(app, &b.cfg.name);
        }
    }
}

/// Starts the one task for `name`; any older task for it stops at its next check.
fn start(app: &Arc<App>, name: &Arc<str>) {
    let generation = match app.health_tasks.lock() {
        Ok(mut t) => {
            let g = t.entry(Arc::clone(name)).or_insert(0);
            *g += 1;
            *g
        }
        Err(_) => return,
    };
    tokio::spawn(run(Arc::downgrade(app), Arc::clone(name), generation));
}

/// After a reload: starts checks for backends that have one now and had none before.
pub fn spawn_missing(app: &Arc<App>, old: &crate::app::Snapshot) {
    let snap = app.snapshot.load();
    for b in &snap.backends {
        let had = old
            .backends
            .iter()
            .any(|o| o.cfg.name == b.cfg.name && o.cfg.health_check.is_some());
        if b.cfg.health_check.is_some() && !had {
            start(app, &b.cfg.name);
        }
    }
}

fn request(
    b: &BackendRt,
    bearer: Option<&crate::entra::BearerToken>,
) -> Option<http::Request<Bytes>> {
    let hc = b.cfg.health_check.as_ref()?;
    let uri = http::Uri::builder()
        .scheme(b.scheme.clone())
        .authority(b.authority.clone())
        .path_and_query(format!("{}{}", b.base_path, hc.path))
        .build()
        .ok()?;
    let mut builder = http::Request::builder().method(hc.method.as_str()).uri(uri);
    if let Some(h) = builder.headers_mut() {
        match bearer {
            Some(t) => {
                h.insert(http::header::AUTHORIZATION, t.header().clone());
            }
            None => {
                if let Some((name, value)) = &b.credential {
                    h.insert(name.clone(), value.clone());
                }
            }
        }
        if hc.body.is_some() {
            h.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
        }
    }
    builder
        .body(Bytes::from(hc.body.clone().unwrap_or_default()))
        .ok()
}

async fn run(app: Weak<App>, name: Arc<str>, generation: u64) {
    let mut healthy = true;
    loop {
        let Some(a) = app.upgrade() else { return };
        let current = a
            .health_tasks
            .lock()
            .map(|t| t.get(&name).copied() == Some(generation))
            .unwrap_or(false);
        if !current {
            return;
        }
        let snap = a.snapshot.load_full();
        let Some(b) = snap.backends.iter().find(|b| b.cfg.name == name) else {
            return;
        };
        let Some(hc) = b.cfg.health_check.clone() else {
            return;
        };
        // Without a token there is nothing to check: the backend is already cooling
        // for that reason, and its token source says why.
        let token = match &b.entra {
            Some(source) => match source.current() {
                Some(t) => Some(t),
                None => {
                    drop(snap);
                    drop(a);
                    tokio::time::sleep(hc.interval).await;
                    continue;
                }
            },
            None => None,
        };
        let Some(req) = request(b, token.as_deref()) else {
            tracing::error!(backend = %name, path = %hc.path, "health check request cannot be built; checks stopped");
            return;
        };
        let result = a.upstream.send_http(&req, hc.timeout).await;
        let refused = matches!(&result, Ok(r) if r.status() == http::StatusCode::UNAUTHORIZED);
        if let (true, Some(source), Some(t)) = (refused, &b.entra, &token) {
            b.state.set_last_status(401);
            let cooldown = (hc.interval, snap.config.cooldown.default_auth);
            if token_refused(&a, b, source, t, healthy, cooldown) {
                healthy = false;
            }
            drop(result);
            drop(snap);
            drop(a);
            tokio::time::sleep(hc.interval).await;
            continue;
        }
        let (ok, detail) = match result {
            Ok(resp) => {
                let status = resp.status().as_u16();
                (
                    hc.expect.matches(AttemptResult::Status(status)),
                    format!("status {status}"),
                )
            }
            Err(e) => (false, e.to_string()),
        };
        if ok {
            if !healthy {
                tracing::info!(backend = %name, "health check passes again");
            }
        } else {
            let now = a.clock.now_ms();
            let until_ms = now.saturating_add(spillgate_core::outcome::millis(hc.interval));
            let cooldown = Cooldown {
                until_ms,
                reason: CoolReason::Health,
            };
            let cooled = b.state.cool_at(cooldown, now);
            if cooled.extended {
                a.store.cooled(&b.cfg.name, None, cooldown);
            }
            // Counted when a cooldown starts, as the proxy counts its own.
            if cooled.started {
                a.metrics.cooldown_started(&b.cfg.name, "health");
            }
            if healthy {
                tracing::warn!(backend = %name, result = %detail, "health check failed; backend cooling until it passes");
            }
        }
        healthy = ok;
        drop(snap);
        drop(a);
        tokio::time::sleep(hc.interval).await;
    }
}

/// A health check's token was refused (401): the same rules as for a request. A token
/// less than a minute old is not renewed and the backend is cooled for the whole
/// `cooldown.default_auth`; otherwise a renewal is asked for and the backend cooled until
/// the new token arrives (at most one interval). A refusal of a token already replaced
/// cools nothing: the next check uses the new one. Says whether the backend was cooled.
/// `cooldown`: the check interval and `cooldown.default_auth`.
fn token_refused(
    app: &App,
    b: &BackendRt,
    source: &std::sync::Arc<TokenSource>,
    token: &BearerToken,
    was_healthy: bool,
    (interval, default_auth): (std::time::Duration, std::time::Duration),
) -> bool {
    match source.refused(token) {
        Refusal::Replaced(_) => return false,
        Refusal::TooRecent { age } => {
            if app.cool_for_refused_token(b, default_auth) {
                tracing::warn!(
                    backend = %b.cfg.name,
                    credential = source.label(),
                    token_age_s = age.as_secs(),
                    "the backend refused a recent Entra ID token to its health check (401): does the identity have the \"Cognitive Services OpenAI User\" role on this resource?"
                );
            }
        }
        Refusal::Renewing | Refusal::Unavailable(_) => {
            app.cool_for_auth(b, interval);
            if was_healthy {
                tracing::warn!(
                    backend = %b.cfg.name,
                    credential = source.label(),
                    "the backend refused the Entra ID token to its health check (401); backend cooling (auth) until a new token is obtained"
                );
            }
        }
    }
    true
}
