//! spillgate: one OpenAI / Azure OpenAI endpoint in front of many backends, with strict
//! priority tiers and throttle-aware failover.
//!
//! The binary (`main.rs`) is a thin CLI over this library; integration tests start the
//! same gateway in-process through [`server::start`].

pub mod admin;
pub mod app;
pub mod auth;
pub mod check;
pub mod coalesce;
pub mod demo;
pub mod entra;
pub mod errors;
pub mod front;
pub mod h1;
pub mod health;
pub mod idle;
pub mod metrics;
pub mod now;
pub mod priority;
pub mod proxy;
pub mod reload;
pub mod server;
pub mod sim;
pub mod state;
pub mod store;
pub mod upstream;
pub mod whole;

#[cfg(test)]
mod test_logs;

use spillgate_core::config::{Config, ConfigErrors};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`; a poisoned lock (a panic while it was held) is used as it is. For the
/// locks whose every critical section leaves the data consistent and is never held
/// across an await: a panic in one request must not take the others down with it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Loads a config file's text, resolving `env:` secrets from the process environment and
/// `file:` secrets from disk.
pub fn load_config(text: &str) -> Result<Config, ConfigErrors> {
    spillgate_core::config::load(text, &|var| std::env::var(var).ok(), &|path| {
        std::fs::read_to_string(path).map_err(|e| e.to_string())
    })
}
