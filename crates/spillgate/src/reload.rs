//! Hot reload: a changed config file (or SIGHUP) takes effect for new requests at once.
//!
//! The APIM policy's operators waited up to 60 s for a cached backend list to expire;
//! here the file is checked every second (and at once on SIGHUP). A valid file becomes the
//! new routing snapshot (`ArcSwap`: requests in flight finish on the old one); backends and
//! routes whose names did not change keep their live state (cooldowns, breaker windows,
//! capacity, retry budgets). An invalid file is refused with the same field-path errors as
//! at start, logged once, and the running config stays.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};
use spillgate_core::config::Config;

use crate::app::{App, Snapshot};

/// Why a reload did not take effect.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: String },
    #[error("{0}")]
    Invalid(spillgate_core::config::ConfigErrors),
    #[error("{0}")]
    Build(String),
}

/// Settings read only at start: a reload that changes them warns that a restart is needed.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut v = Vec::new();
    let (o, n) = (&old.server, &new.server);
    if o.listen != n.listen {
        v.push("server.listen");
    }
    if o.max_connections != n.max_connections {
        v.push("server.max_connections");
    }
    if o.drain_timeout != n.drain_timeout {
        v.push("server.drain_timeout");
    }
    if o.config_poll != n.config_poll {
        v.push("server.config_poll");
    }
    if o.max_header_bytes != n.max_header_bytes || o.max_headers != n.max_headers {
        v.push("server.max_header_bytes / max_headers");
    }
    if old.timeouts.connect != new.timeouts.connect {
        v.push("timeouts.connect");
    }
    if old.timeouts.client_header != new.timeouts.client_header {
        v.push("timeouts.client_header");
    }
    if old.timeouts.client_send != new.timeouts.client_send {
        v.push("timeouts.client_send");
    }
    if old.log.format != new.log.format || old.log.level != new.log.level {
        v.push("log");
    }
    if old.admin != new.admin {
        v.push("admin");
    }
    if old.state != new.state {
        v.push("state");
    }
    v
}

/// Makes `config` the running one; returns the new version.
pub fn apply_config(app: &Arc<App>, config: Config) -> Result<u64, ReloadError> {
    let old = app.snapshot.load_full();
    let needs_restart = restart_only_changes(&old.config, &config);
    let snap = Snapshot::build(config, Some(&old), &app.credentials)
        .map_err(|e| ReloadError::Build(format!("{e:#}")))?;
    let version = snap.version;
    let names: Vec<String> = snap
        .backends
        .iter()
        .map(|b| b.cfg.name.to_string())
        .collect();
    app.snapshot.store(Arc::new(snap));
    app.start_credentials();
    crate::health::spawn_missing(app, &old);
    tracing::info!(version, backends = ?names, "config reloaded");
    if !needs_restart.is_empty() {
        tracing::warn!(settings = ?needs_restart, "these settings changed but take effect only after a restart");
    }
    Ok(version)
}

/// Reads, validates and applies a config file.
pub fn apply_file(app: &Arc<App>, path: &Path) -> Result<u64, ReloadError> {
    apply_bytes(app, path, read(path)?)
}

fn read(path: &Path) -> Result<Vec<u8>, ReloadError> {
    std::fs::read(path).map_err(|e| ReloadError::Read {
        path: path.display().to_string(),
        error: e.to_string(),
    })
}

/// Validates and applies the content read from `path`.
fn apply_bytes(app: &Arc<App>, path: &Path, bytes: Vec<u8>) -> Result<u64, ReloadError> {
    let text = String::from_utf8(bytes).map_err(|e| ReloadError::Read {
        path: path.display().to_string(),
        error: e.to_string(),
    })?;
    let config = crate::load_config(&text).map_err(ReloadError::Invalid)?;
    apply_config(app, config)
}

/// Watches `path` (checked every `interval`, and at once on SIGHUP) for the gateway's
/// lifetime. `loaded` is the config text the gateway started with: the baseline, so an
/// edit made while the gateway was starting is not missed.
pub fn spawn(app: &Arc<App>, path: PathBuf, interval: Duration, loaded: Option<&str>) {
    let weak = Arc::downgrade(app);
    let seen = match loaded {
        Some(text) => Some(Sha256::digest(text.as_bytes()).into()),
        None => read(&path).ok().map(|b| Sha256::digest(&b).into()),
    };
    // Registered now, before the task first runs: a SIGHUP must never find no handler
    // (its default action ends the process).
    #[cfg(unix)]
    let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    #[cfg(not(unix))]
    let hup = None;
    tokio::spawn(watch(weak, path, interval, seen, hup));
}

#[cfg(unix)]
type Hangup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangup = Option<()>;

async fn watch(
    app: Weak<App>,
    path: PathBuf,
    interval: Duration,
    mut seen: Option<[u8; 32]>,
    mut hup: Hangup,
) {
    // The last refused content (`Some(None)`: the file could not be read): an invalid
    // file is reported once, not every second.
    let mut refused: Option<Option<[u8; 32]>> = None;
    loop {
        // A zero interval: no polling, SIGHUP only.
        let tick = if interval.is_zero() {
            Duration::from_secs(86_400)
        } else {
            interval
        };
        #[cfg(unix)]
        let forced = match hup.as_mut() {
            Some(h) => tokio::select! {
                _ = tokio::time::sleep(tick) => false,
                _ = h.recv() => true,
            },
            None => {
                tokio::time::sleep(tick).await;
                false
            }
        };
        #[cfg(not(unix))]
        let forced = {
            tokio::time::sleep(tick).await;
            false
        };
        let Some(app) = app.upgrade() else { return };
        // Read once: what is hashed is what is applied.
        let content = read(&path);
        let now = content.as_ref().ok().map(|b| Sha256::digest(b).into());
        if now == seen && !forced {
            continue;
        }
        seen = now;
        if forced {
            tracing::info!(path = %path.display(), "SIGHUP: reloading the config");
        }
        match content.and_then(|bytes| apply_bytes(&app, &path, bytes)) {
            Ok(_) => refused = None,
            Err(e) => {
                if refused != Some(now) || forced {
                    let text = e.to_string().replace('\n', "; ");
                    tracing::error!(path = %path.display(), errors = %text, "config change refused; the running config stays");
                }
                refused = Some(now);
            }
        }
    }
}
