//! State shared between the request handlers and the [`crate::MockBackend`]
//! handle: counters, recorded requests, the reply script and the limiter.
//!
//! Locks are plain `std` mutexes, never held across an await. On the request
//! path each is held only briefly (a push to the request log, a pop from the
//! script or a clone of the default reply, a limiter window update), so that
//! the mock stays cheap under benchmark load. Reading the log (`requests()`,
//! `state()`) clones all of it under the lock, which blocks recording for that
//! long; long benchmark runs turn recording off.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use http::HeaderValue;
use serde::{Deserialize, Serialize};

use crate::config::MockConfig;
use crate::limiter::Limiter;
use crate::openai::Greeting;
use crate::reply::Reply;

/// One request as the mock received it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    /// Lower-case names, every header as received.
    pub headers: Vec<(String, String)>,
    /// Lossy UTF-8 of the body; empty when `record_bodies` is off.
    pub body: String,
    /// Hex SHA-256 of the raw body bytes (always computed, so that tests can
    /// check that a body was forwarded byte for byte even without recording it).
    pub body_sha256: String,
    /// The deployment from an Azure classic path, else the body's `model`.
    pub deployment: Option<String>,
}

impl RecordedRequest {
    /// The first value of header `name` (compared case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A snapshot of the mock's state, as served by `GET /_mock/state`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MockState {
    pub name: String,
    pub hits: u64,
    pub hits_429: u64,
    pub streams_completed: u64,
    pub streams_cancelled: u64,
    /// API requests whose client disconnected before the response head was sent.
    #[serde(default)]
    pub requests_abandoned: u64,
    pub requests: Vec<RecordedRequest>,
    /// The token service, when the mock plays one.
    #[serde(default)]
    pub identity: Option<crate::IdentityView>,
}

/// Lock a mutex, ignoring poisoning: every critical section here leaves the
/// data consistent, so a panic elsewhere must not take the mock down.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records per segment of the request log.
const LOG_SEGMENT: usize = 4096;

/// Append-only list of recorded requests, stored in fixed-size segments so
/// that a push never reallocates (and copies) the whole log while handlers
/// wait on the lock, which a plain `Vec` would do at benchmark volumes.
#[derive(Default)]
pub(crate) struct RequestLog {
    segments: Vec<Vec<RecordedRequest>>,
}

impl RequestLog {
    fn push(&mut self, req: RecordedRequest) {
        match self.segments.last_mut() {
            Some(segment) if segment.len() < LOG_SEGMENT => segment.push(req),
            _ => {
                let mut segment = Vec::with_capacity(LOG_SEGMENT);
                segment.push(req);
                self.segments.push(segment);
            }
        }
    }

    fn to_vec(&self) -> Vec<RecordedRequest> {
        self.segments.iter().flatten().cloned().collect()
    }

    fn clear(&mut self) {
        self.segments.clear();
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub hits: AtomicU64,
    pub hits_429: AtomicU64,
    pub streams_completed: AtomicU64,
    pub streams_cancelled: AtomicU64,
    pub requests_abandoned: AtomicU64,
}

impl Counters {
    fn reset(&self) {
        for c in [
            &self.hits,
            &self.hits_429,
            &self.streams_completed,
            &self.streams_cancelled,
            &self.requests_abandoned,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Replies that replace the built-in behaviour. One lock for both, so that a
/// request takes one lock to find its reply.
#[derive(Default)]
pub(crate) struct Overrides {
    /// Scripted replies, used once each, in order.
    script: VecDeque<Reply>,
    /// Used when the script is empty, until replaced.
    default_reply: Option<Arc<Reply>>,
}

pub(crate) struct Shared {
    pub cfg: MockConfig,
    /// `x-mock-backend` value, built once rather than per response.
    pub backend_header: HeaderValue,
    /// The generated content, fixed by the name.
    pub greeting: Greeting,
    pub counters: Counters,
    /// Source of unique response ids.
    pub next_id: AtomicU64,
    pub requests: Mutex<RequestLog>,
    /// Whether API requests are recorded at all (see `MockBackend::set_recording`).
    pub recording: AtomicBool,
    pub overrides: Mutex<Overrides>,
    pub limiter: Option<Limiter>,
    pub identity: Option<crate::identity::IdentityState>,
}

impl Shared {
    pub fn new(cfg: MockConfig) -> Shared {
        let limiter = cfg.limits.map(Limiter::new);
        let identity = cfg
            .identity
            .clone()
            .map(crate::identity::IdentityState::new);
        let backend_header =
            HeaderValue::from_str(&cfg.name).unwrap_or_else(|_| HeaderValue::from_static("mock"));
        Shared {
            backend_header,
            greeting: Greeting::new(&cfg.name),
            cfg,
            counters: Counters::default(),
            next_id: AtomicU64::new(1),
            requests: Mutex::new(RequestLog::default()),
            recording: AtomicBool::new(true),
            overrides: Mutex::new(Overrides::default()),
            limiter,
            identity,
        }
    }

    pub fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// The reply that overrides the built-in behaviour for the next request:
    /// the head of the script, else the default reply.
    pub fn next_override(&self) -> Option<Arc<Reply>> {
        let mut overrides = lock(&self.overrides);
        if let Some(reply) = overrides.script.pop_front() {
            drop(overrides);
            return Some(Arc::new(reply));
        }
        overrides.default_reply.clone()
    }

    pub fn push_script(&self, replies: Vec<Reply>) {
        lock(&self.overrides).script.extend(replies);
    }

    pub fn set_default(&self, reply: Option<Reply>) {
        lock(&self.overrides).default_reply = reply.map(Arc::new);
    }

    pub fn record(&self, req: RecordedRequest) {
        lock(&self.requests).push(req);
    }

    pub fn recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    pub fn set_recording(&self, on: bool) {
        self.recording.store(on, Ordering::Relaxed);
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.requests).to_vec()
    }

    pub fn state(&self) -> MockState {
        MockState {
            name: self.cfg.name.clone(),
            hits: Self::get(&self.counters.hits),
            hits_429: Self::get(&self.counters.hits_429),
            streams_completed: Self::get(&self.counters.streams_completed),
            streams_cancelled: Self::get(&self.counters.streams_cancelled),
            requests_abandoned: Self::get(&self.counters.requests_abandoned),
            requests: self.requests(),
            identity: self.identity.as_ref().map(|i| i.view()),
        }
    }

    pub fn reset(&self) {
        self.counters.reset();
        lock(&self.requests).clear();
        *lock(&self.overrides) = Overrides::default();
        if let Some(limiter) = &self.limiter {
            limiter.reset();
        }
        if let Some(identity) = &self.identity {
            identity.reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(i: usize) -> RecordedRequest {
        RecordedRequest {
            method: "POST".into(),
            path: format!("/{i}"),
            query: None,
            headers: Vec::new(),
            body: String::new(),
            body_sha256: String::new(),
            deployment: None,
        }
    }

    #[test]
    fn request_log_keeps_order_across_segments() {
        let mut log = RequestLog::default();
        let n = LOG_SEGMENT * 2 + 3;
        for i in 0..n {
            log.push(req(i));
        }
        assert_eq!(log.segments.len(), 3);
        let all = log.to_vec();
        assert_eq!(all.len(), n);
        assert!(all
            .iter()
            .enumerate()
            .all(|(i, r)| r.path == format!("/{i}")));
        log.clear();
        assert!(log.to_vec().is_empty());
    }

    #[test]
    fn overrides_come_from_script_then_default() {
        let shared = Shared::new(MockConfig::default());
        assert!(shared.next_override().is_none());
        shared.set_default(Some(Reply::status(500)));
        shared.push_script(vec![Reply::status(418)]);
        assert_eq!(shared.next_override().map(|r| r.status), Some(418));
        assert_eq!(shared.next_override().map(|r| r.status), Some(500));
        shared.reset();
        assert!(shared.next_override().is_none());
    }
}
