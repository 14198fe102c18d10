//! Microsoft Entra ID tokens for backends that authenticate without keys.
//!
//! Many Azure OpenAI resources have key authentication disabled; the gateway then calls
//! them with `Authorization: Bearer <token>`, a token its own identity (managed identity,
//! AKS workload identity, a service principal, or a developer's Azure CLI login) obtains
//! from Entra ID. Tokens live about an hour, so each credential has a [`TokenSource`]: a
//! cache that one background task keeps fresh, renewing the token five minutes before it
//! expires. Requests read the current token without waiting or locking; only when there
//! is none (at start, or after it expired) do they wait, all on the same single fetch.
//! Backends with the same credential and scope share one source, so one token.
//!
//! A backend that refuses a token (401) never takes it away from the other backends: the
//! token stays current, and only the refused request waits for a newer one. Each token
//! is renewed at most once for refusals, and not at all when it is less than a minute
//! old (a token that new is as good as any the identity service would issue: the backend
//! refuses the identity, not the token).
//!
//! The flows themselves (the managed identity endpoints, the client-credentials and
//! federated-assertion grants, running `az`) are the official `azure_identity` crate's.
//! Two things it does not do the way a gateway needs, handled here:
//!
//! * It caches tokens per credential object by the wall clock until five minutes before
//!   they expire, and version 1.0 has no way to bypass that cache. A backend that answers
//!   401 must get a *new* token, so every fetch here uses a new credential object and the
//!   cache in this module is the only one.
//! * It accepts only `https` authority hosts. A local token service (or a test double)
//!   on a loopback address speaks plain HTTP, so the transport below carries requests for
//!   a configured `http://` loopback authority over HTTP.
//!
//! Identity requests go through the gateway's own [`Upstream`] client (hyper + rustls),
//! so the crate is built without its default HTTP stack, and tests that script backends
//! in memory can script the identity endpoints the same way.

use std::collections::HashMap;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use azure_core::credentials::TokenCredential;
use azure_core::http::{AsyncRawResponse, ClientOptions, HttpClient, RetryOptions, Transport};
use azure_identity::Executor;
use futures_util::FutureExt;
use http::HeaderValue;
use http_body_util::{BodyExt, Limited};
use spillgate_core::config::{EntraAuth, EntraCredential, ManagedIdentityId, Secret};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::lock;
use crate::upstream::{AttemptError, Upstream};

/// Tokens are renewed this long before they expire (when they live long enough).
pub const REFRESH_AHEAD: Duration = Duration::from_secs(300);
/// A token is not used in the last seconds of its life: a request sent then could reach
/// the backend after it expired.
const EXPIRY_MARGIN: Duration = Duration::from_secs(10);
/// Longest a whole fetch may take (the managed identity credential on a VM retries IMDS
/// for up to 72 s by Microsoft's guidance).
const FETCH_TIMEOUT: Duration = Duration::from_secs(90);
/// Longest one HTTP request to an identity endpoint may take, headers and body.
const IDENTITY_REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// Largest identity response read.
const IDENTITY_BODY_LIMIT: usize = 256 * 1024;
/// A backend that refuses a token younger than this does not get a newer one: the
/// refusal is not about the token's freshness (most likely the identity lacks its role on
/// that resource), and renewing on every such refusal would only load the identity
/// service. The backend is cooled instead.
pub const MIN_RENEWAL_AGE: Duration = Duration::from_secs(60);
/// Longest an error message from an identity service is kept (logs, `/admin/state`).
const MESSAGE_LIMIT: usize = 600;

/// A token ready to send: the whole `Authorization` value, marked sensitive so `Debug`
/// and HTTP/2 header compression never expose it. This type's own `Debug` and `Display`
/// show only its expiry.
pub struct BearerToken {
    header: HeaderValue,
    expires_at: Instant,
    obtained_at: Instant,
    /// 1 for the first token of its source, +1 for each one after: a refusal names the
    /// token it was about by this number.
    generation: u64,
}

impl BearerToken {
    /// `Bearer <token>` as a header value, or `None` when the token has characters a
    /// header cannot carry.
    fn new(token: &Secret, obtained_at: Instant, expires_at: Instant) -> Option<BearerToken> {
        let mut header = HeaderValue::from_str(&format!("Bearer {}", token.expose())).ok()?;
        header.set_sensitive(true);
        Some(BearerToken {
            header,
            expires_at,
            obtained_at,
            generation: 0,
        })
    }

    /// The `Authorization` header value.
    pub fn header(&self) -> &HeaderValue {
        &self.header
    }

    fn usable_at(&self, now: Instant) -> bool {
        now + EXPIRY_MARGIN < self.expires_at
    }
}

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BearerToken(***, {self})")
    }
}

impl fmt::Display for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let left = self
            .expires_at
            .saturating_duration_since(Instant::now())
            .as_secs();
        write!(f, "token expiring in {left} s")
    }
}

/// What a fetch brings back: the token (never printed) and how long it is valid from now.
pub struct FetchedToken {
    pub token: Secret,
    pub expires_in: Duration,
}

/// Why no token could be fetched, as a message fit for logs: secrets removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchError(pub String);

impl fmt::Display for FetchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One way of obtaining a token. [`SdkFetcher`] is the real one; tests may script their own.
#[async_trait::async_trait]
pub trait FetchToken: Send + Sync {
    async fn fetch(&self) -> Result<FetchedToken, FetchError>;
    /// Where tokens come from, for log lines (`https://login.microsoftonline.com/...`).
    fn endpoint(&self) -> String;
}

/// Why a request got no token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The last fetch failed and the next one is not due yet.
    #[error("no Entra ID token: {0}")]
    Unavailable(Arc<str>),
    /// The fetch in flight did not finish in time (it goes on in the background).
    #[error("no Entra ID token within {0:?}")]
    Timeout(Duration),
}

/// What to do after a backend refused a token (401): see [`TokenSource::refused`].
#[derive(Debug)]
pub enum Refusal {
    /// A newer token is in hand already: retry with it.
    Replaced(Arc<BearerToken>),
    /// A newer token is being fetched: [`TokenSource::renewed`] waits for it.
    Renewing,
    /// The refused token is younger than [`MIN_RENEWAL_AGE`]: a new one would be no
    /// different. The backend refuses the identity; cool it.
    TooRecent { age: Duration },
    /// A renewal for this token was tried already and failed; the next fetch is not due
    /// yet. The message is the last error.
    Unavailable(Arc<str>),
}

/// What the gateway wants to hear from a token source: when its backends lose and regain
/// a token. Kept behind a trait so the source does not know about the gateway's state.
pub trait CredentialEvents: Send + Sync {
    /// No token can be had before `next_try`: cool the backends using `source`. Returns
    /// their names, for the log line.
    fn unavailable(&self, source: &TokenSource, next_try: Duration) -> Vec<Arc<str>>;
    /// A token was obtained: backends cooled for the lack of one may take traffic again.
    fn obtained(&self, source: &TokenSource);
}

/// The state of a credential, for `/admin/state`, `/readyz` and `spillgate check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CredentialStatus {
    /// A token is in hand, valid for this long.
    Ready { expires_in: Duration },
    /// No token yet, and no failure either: the first fetch is under way.
    Pending,
    /// The last `failures` fetches failed; `message` is the last error.
    Failing {
        message: Arc<str>,
        failures: u32,
        /// The token still in use meanwhile, if one is.
        token_left: Option<Duration>,
    },
}

struct Failure {
    message: Arc<str>,
    failures: u32,
}

/// A renewal asked for because a backend refused the token of `generation`, when
/// `fetches` fetches had finished: the next fetch to finish is its answer.
#[derive(Clone, Copy)]
struct Forced {
    generation: u64,
    fetches: u64,
}

struct Inner {
    /// When the refresher fetches next (`None`: at once).
    next_fetch_at: Option<Instant>,
    failure: Option<Failure>,
    /// The generation of the last token obtained (0: none yet).
    generation: u64,
    /// The last renewal a refusal asked for.
    forced: Option<Forced>,
    /// This run of failures has left the backends without a token (and said so).
    unavailable: bool,
}

/// The cache of one credential's token, kept fresh by one background task.
///
/// Invariants: only the refresher task fetches, so at most one fetch per credential is in
/// flight; `current` is written only with `inner` locked, so a request that finds no
/// token under the lock is sure to be woken by the fetch that brings one; `current` is
/// only ever replaced by a newer token, never cleared.
pub struct TokenSource {
    auth: EntraAuth,
    label: Arc<str>,
    endpoint: Arc<str>,
    fetcher: Arc<dyn FetchToken>,
    current: ArcSwapOption<BearerToken>,
    inner: Mutex<Inner>,
    /// Tells the refresher to look again (a fetch may have become due).
    wake: Arc<Notify>,
    /// Counts finished fetches; waiting requests watch it.
    fetched: watch::Sender<u64>,
    events: OnceLock<Arc<dyn CredentialEvents>>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
    /// Whether the refresher task runs; it clears this when it ends for any reason (a
    /// panic included), so the next request starts a new one.
    alive: Arc<AtomicBool>,
}

impl fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenSource")
            .field("credential", &self.label)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl Drop for TokenSource {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
    }
}

/// The wait before the `n`th retry in a row: 1 s, 2 s, 4 s, ... up to a minute.
fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

/// When a token that is valid for `lifetime` from `now` is renewed: five minutes before
/// it expires, or halfway through its life when it lives less than ten minutes.
fn refresh_at(now: Instant, lifetime: Duration) -> Instant {
    if lifetime > 2 * REFRESH_AHEAD {
        now + (lifetime - REFRESH_AHEAD)
    } else {
        now + (lifetime / 2).max(Duration::from_secs(1))
    }
}

/// Waits (up to `max_wait`) until the fetch count in `rx` passes `seen`.
async fn wait_past(
    rx: &mut tokio::sync::watch::Receiver<u64>,
    seen: u64,
    max_wait: Duration,
) -> Result<(), TokenError> {
    match tokio::time::timeout(max_wait, rx.wait_for(|n| *n > seen)).await {
        Err(_) => Err(TokenError::Timeout(max_wait)),
        Ok(Err(_)) => Err(TokenError::Unavailable(Arc::from("token renewal stopped"))),
        Ok(Ok(_)) => Ok(()),
    }
}

impl TokenSource {
    pub fn new(auth: EntraAuth, fetcher: Arc<dyn FetchToken>) -> Arc<TokenSource> {
        let label = Arc::from(format!("{} for {}", auth.credential.describe(), auth.scope));
        let endpoint = Arc::from(fetcher.endpoint());
        Arc::new(TokenSource {
            auth,
            label,
            endpoint,
            fetcher,
            current: ArcSwapOption::empty(),
            inner: Mutex::new(Inner {
                next_fetch_at: None,
                failure: None,
                generation: 0,
                forced: None,
                unavailable: false,
            }),
            wake: Arc::new(Notify::new()),
            fetched: watch::Sender::new(0),
            events: OnceLock::new(),
            task: Mutex::new(None),
            alive: Arc::new(AtomicBool::new(false)),
        })
    }

    pub fn auth(&self) -> &EntraAuth {
        &self.auth
    }

    /// Which credential, for operators: `managed identity (system-assigned) for <scope>`.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Where its tokens come from.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whom to tell when the backends lose or regain a token; set once.
    pub fn set_events(&self, events: Arc<dyn CredentialEvents>) {
        let _ = self.events.set(events);
    }

    /// The current token when it is still good to send: no wait, no lock.
    pub fn current(&self) -> Option<Arc<BearerToken>> {
        self.current
            .load_full()
            .filter(|t| t.usable_at(Instant::now()))
    }

    pub fn status(&self) -> CredentialStatus {
        let token_left = self
            .current()
            .map(|t| t.expires_at.saturating_duration_since(Instant::now()));
        let inner = lock(&self.inner);
        match (&inner.failure, token_left) {
            (Some(f), token_left) => CredentialStatus::Failing {
                message: Arc::clone(&f.message),
                failures: f.failures,
                token_left,
            },
            (None, Some(expires_in)) => CredentialStatus::Ready { expires_in },
            (None, None) => CredentialStatus::Pending,
        }
    }

    /// How long until the next fetch when the last one failed and no token is in hand.
    pub fn retry_in(&self) -> Option<Duration> {
        if self.current().is_some() {
            return None;
        }
        let inner = lock(&self.inner);
        inner.failure.as_ref()?;
        inner
            .next_fetch_at
            .map(|t| t.saturating_duration_since(Instant::now()))
    }

    /// Starts the background task that fetches the first token and keeps it fresh, if it
    /// is not running (and a tokio runtime is at hand). A task that ended (it panicked,
    /// or was aborted) is replaced.
    pub fn start(self: &Arc<Self>) {
        let mut task = lock(&self.task);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            // A task that ended before this one started may have cleared the flag late.
            self.alive.store(true, Ordering::Release);
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if task.is_some() {
            tracing::error!(credential = %self.label, "the Entra ID token refresher had stopped; restarting it");
        }
        self.alive.store(true, Ordering::Release);
        let handle = rt.spawn(refresher(
            Arc::downgrade(self),
            Arc::clone(&self.wake),
            Arc::clone(&self.alive),
        ));
        *task = Some(handle.abort_handle());
    }

    /// The token to send now. Returns at once while the current token is valid; without
    /// one, waits (up to `max_wait`) for the fetch that brings one, which every waiting
    /// request shares. Fails at once while the last fetch failed and the next is not due.
    pub async fn bearer(
        self: &Arc<Self>,
        max_wait: Duration,
    ) -> Result<Arc<BearerToken>, TokenError> {
        if let Some(t) = self.current() {
            if !self.alive.load(Ordering::Acquire) {
                self.start();
            }
            return Ok(t);
        }
        self.start();
        self.wait_for_fetch(max_wait).await
    }

    /// A backend refused `rejected` (401). The token stays current for every other
    /// backend; this says what the refused request may do:
    ///
    /// * a newer token is in hand: [`Refusal::Replaced`], retry with it;
    /// * `rejected` is younger than [`MIN_RENEWAL_AGE`]: [`Refusal::TooRecent`], nothing
    ///   is fetched;
    /// * a renewal for `rejected` was tried and failed: [`Refusal::Unavailable`], nothing
    ///   is fetched before the next try the failure scheduled;
    /// * otherwise a renewal is started, or joined when one is on the way:
    ///   [`Refusal::Renewing`], and [`TokenSource::renewed`] waits for it. However many
    ///   requests are refused with the same token, it is renewed once.
    pub fn refused(self: &Arc<Self>, rejected: &BearerToken) -> Refusal {
        self.start();
        let age = {
            let mut inner = lock(&self.inner);
            if let Some(t) = self
                .current()
                .filter(|t| t.generation > rejected.generation)
            {
                return Refusal::Replaced(t);
            }
            let now = Instant::now();
            let age = now.saturating_duration_since(rejected.obtained_at);
            if age < MIN_RENEWAL_AGE {
                return Refusal::TooRecent { age };
            }
            let fetches = *self.fetched.borrow();
            match inner.forced {
                Some(f) if f.generation >= rejected.generation && fetches > f.fetches => {
                    return Refusal::Unavailable(self.last_error(&inner));
                }
                Some(f) if f.generation >= rejected.generation => return Refusal::Renewing,
                _ => {}
            }
            inner.forced = Some(Forced {
                generation: rejected.generation,
                fetches,
            });
            // Due now, whatever backoff a failing renewal set: a refused token is worth
            // one early try. A fetch in flight is the answer, with no second one.
            inner.next_fetch_at = Some(now);
            age
        };
        tracing::info!(
            credential = %self.label,
            token_age_s = age.as_secs(),
            "a backend refused the Entra ID token (401); fetching a new one"
        );
        self.wake.notify_one();
        Refusal::Renewing
    }

    /// After [`TokenSource::refused`] said [`Refusal::Renewing`] or
    /// [`Refusal::Replaced`]: a token newer than `rejected`, waiting (up to `max_wait`)
    /// for the renewal under way. Fails when that renewal fails.
    pub async fn renewed(
        &self,
        rejected: &BearerToken,
        max_wait: Duration,
    ) -> Result<Arc<BearerToken>, TokenError> {
        let newer = || {
            self.current()
                .filter(|t| t.generation > rejected.generation)
        };
        // Subscribed before looking, so a fetch that ends after the look is seen.
        let mut rx = self.fetched.subscribe();
        let target = {
            let inner = lock(&self.inner);
            if let Some(t) = newer() {
                return Ok(t);
            }
            let done = *rx.borrow_and_update();
            match inner.forced {
                Some(f) if f.generation >= rejected.generation && done <= f.fetches => f.fetches,
                _ => return Err(TokenError::Unavailable(self.last_error(&inner))),
            }
        };
        wait_past(&mut rx, target, max_wait).await?;
        newer().ok_or_else(|| TokenError::Unavailable(self.last_error(&lock(&self.inner))))
    }

    fn last_error(&self, inner: &Inner) -> Arc<str> {
        inner.failure.as_ref().map_or_else(
            || Arc::from("the identity service returned no usable token"),
            |f| Arc::clone(&f.message),
        )
    }

    async fn wait_for_fetch(&self, max_wait: Duration) -> Result<Arc<BearerToken>, TokenError> {
        // Subscribed before looking, so a fetch that ends after the look is seen.
        let mut rx = self.fetched.subscribe();
        let seen = *rx.borrow_and_update();
        {
            let mut inner = lock(&self.inner);
            let now = Instant::now();
            if let Some(t) = self.current() {
                return Ok(t);
            }
            match (&inner.failure, inner.next_fetch_at) {
                // Failing, and the next try is scheduled: no token for now.
                (Some(f), Some(at)) if at > now => {
                    return Err(TokenError::Unavailable(Arc::clone(&f.message)));
                }
                _ => inner.next_fetch_at = Some(now),
            }
        }
        self.wake.notify_one();
        wait_past(&mut rx, seen, max_wait).await?;
        self.current()
            .ok_or_else(|| TokenError::Unavailable(self.last_error(&lock(&self.inner))))
    }

    /// Fetches when a fetch is due; returns when to look again.
    async fn tick(&self) -> Instant {
        let now = Instant::now();
        {
            let inner = lock(&self.inner);
            if let Some(at) = inner.next_fetch_at {
                if at > now {
                    return at;
                }
            }
        }
        // A panic in the SDK or the transport is a failed fetch, not the end of renewals.
        let fetch = AssertUnwindSafe(self.fetcher.fetch()).catch_unwind();
        let result = match tokio::time::timeout(FETCH_TIMEOUT, fetch).await {
            Ok(Ok(r)) => r,
            Ok(Err(panic)) => {
                let message = redact(&panic_message(panic.as_ref()), &[]);
                tracing::error!(
                    credential = %self.label,
                    endpoint = %self.endpoint,
                    panic = %message,
                    "the Entra ID token fetch panicked; counted as a failed fetch"
                );
                Err(FetchError(format!("the token fetch panicked: {message}")))
            }
            Err(_) => Err(FetchError(format!(
                "no answer from the identity service within {} s",
                FETCH_TIMEOUT.as_secs()
            ))),
        };
        let now = Instant::now();
        let result = result.and_then(|t| {
            BearerToken::new(&t.token, now, now + t.expires_in)
                .map(|b| (b, t.expires_in))
                .ok_or_else(|| {
                    FetchError(
                        "the identity service returned a token that is not a valid header value"
                            .to_string(),
                    )
                })
        });
        let next = match result {
            Ok((token, lifetime)) => self.obtained(token, lifetime, now),
            Err(e) => self.failed(e, now),
        };
        self.fetched.send_modify(|n| *n += 1);
        next
    }

    fn obtained(&self, mut token: BearerToken, lifetime: Duration, now: Instant) -> Instant {
        let next = refresh_at(now, lifetime);
        let (recovered, was_unavailable) = {
            let mut inner = lock(&self.inner);
            inner.generation += 1;
            token.generation = inner.generation;
            self.current.store(Some(Arc::new(token)));
            inner.next_fetch_at = Some(next);
            (inner.failure.take(), std::mem::take(&mut inner.unavailable))
        };
        match recovered {
            Some(f) if was_unavailable => tracing::info!(
                credential = %self.label,
                endpoint = %self.endpoint,
                failures = f.failures,
                expires_in_s = lifetime.as_secs(),
                "Entra ID token obtained again; the backends using it are available again"
            ),
            Some(f) => tracing::info!(
                credential = %self.label,
                failures = f.failures,
                expires_in_s = lifetime.as_secs(),
                "Entra ID token obtained again"
            ),
            None => tracing::debug!(
                credential = %self.label,
                expires_in_s = lifetime.as_secs(),
                "Entra ID token obtained"
            ),
        }
        if let Some(events) = self.events.get() {
            events.obtained(self);
        }
        next
    }

    fn failed(&self, error: FetchError, now: Instant) -> Instant {
        let valid = self.current.load_full().filter(|t| t.usable_at(now));
        let (next, first, failures, announce) = {
            let mut inner = lock(&self.inner);
            let failures = inner.failure.as_ref().map_or(1, |f| f.failures + 1);
            let mut next = now + backoff(failures);
            if let Some(t) = &valid {
                // Retry before the token in hand runs out.
                next = next.min(t.expires_at - EXPIRY_MARGIN).max(now);
            }
            let first = inner.failure.is_none();
            inner.failure = Some(Failure {
                message: Arc::from(error.0.as_str()),
                failures,
            });
            inner.next_fetch_at = Some(next);
            // The first failure of the run that leaves the backends without a token is
            // said at error level, whether or not an earlier one of the run was said.
            let announce = valid.is_none() && !inner.unavailable;
            if valid.is_none() {
                inner.unavailable = true;
            }
            (next, first, failures, announce)
        };
        let retry_ms = spillgate_core::outcome::millis(next.saturating_duration_since(now));
        let cooled = match (&valid, self.events.get()) {
            (None, Some(events)) => events.unavailable(self, next.saturating_duration_since(now)),
            _ => Vec::new(),
        };
        // Once per run of failures: a warning when a renewal fails while the token in hand
        // is valid, an error when the backends lose their token (at the first failure, or
        // later when the token runs out before a renewal succeeds); retries log at debug.
        if announce {
            tracing::error!(
                credential = %self.label,
                endpoint = %self.endpoint,
                error = %error,
                failures,
                backends = %cooled.join(","),
                retry_in_ms = retry_ms,
                "could not obtain an Entra ID token; the backends using it are unavailable until one is obtained"
            );
        } else if let (true, Some(t)) = (first, &valid) {
            tracing::warn!(
                credential = %self.label,
                endpoint = %self.endpoint,
                error = %error,
                token_left_s = t.expires_at.saturating_duration_since(now).as_secs(),
                retry_in_ms = retry_ms,
                "could not renew the Entra ID token; the current one stays in use while it is valid"
            );
        } else {
            tracing::debug!(credential = %self.label, failures, error = %error, retry_in_ms = retry_ms, "Entra ID token fetch failed again");
        }
        next
    }
}

/// What a panic carried, when it is text.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".to_string())
}

/// Clears the source's `alive` flag when the refresher ends, however it ends.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The background task of one source: fetch when due, sleep until the next fetch is due
/// or a request asks. Ends when the source is dropped.
async fn refresher(source: Weak<TokenSource>, wake: Arc<Notify>, alive: Arc<AtomicBool>) {
    let _alive = AliveGuard(alive);
    loop {
        let next = {
            let Some(s) = source.upgrade() else { return };
            s.tick().await
        };
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = wake.notified() => {}
        }
    }
}

/// The token sources of a running gateway, one per distinct credential and scope. Kept
/// across reloads: a backend whose credential did not change keeps its token.
pub struct Credentials {
    upstream: Arc<dyn Upstream>,
    sources: Mutex<HashMap<EntraAuth, Weak<TokenSource>>>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials").finish_non_exhaustive()
    }
}

impl Credentials {
    /// Sources whose identity requests go through `upstream`.
    pub fn new(upstream: Arc<dyn Upstream>) -> Credentials {
        Credentials {
            upstream,
            sources: Mutex::new(HashMap::new()),
        }
    }

    /// The source for `auth`: the live one if a backend already uses it, else a new one.
    pub fn source(&self, auth: &EntraAuth) -> Arc<TokenSource> {
        let mut sources = lock(&self.sources);
        sources.retain(|_, s| s.strong_count() > 0);
        if let Some(s) = sources.get(auth).and_then(Weak::upgrade) {
            return s;
        }
        let fetcher = Arc::new(SdkFetcher::new(auth.clone(), Arc::clone(&self.upstream)));
        let s = TokenSource::new(auth.clone(), fetcher);
        sources.insert(auth.clone(), Arc::downgrade(&s));
        s
    }
}

// ---------------------------------------------------------------------------------------
// Fetching with azure_identity.
// ---------------------------------------------------------------------------------------

const MANAGED_IDENTITY_IMDS: &str = "http://169.254.169.254/metadata/identity/oauth2/token";
const PUBLIC_AUTHORITY: &str = "https://login.microsoftonline.com";

/// Fetches tokens with the `azure_identity` credential the config names, over the
/// gateway's HTTP client.
pub struct SdkFetcher {
    auth: EntraAuth,
    upstream: Arc<dyn Upstream>,
    /// Runs `az` for the developer credential; `None`: the crate's own (tokio).
    executor: Option<Arc<dyn Executor>>,
}

/// A variable of the process environment (where the platform puts managed identity and
/// workload identity settings), when set and not empty.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl SdkFetcher {
    pub fn new(auth: EntraAuth, upstream: Arc<dyn Upstream>) -> SdkFetcher {
        SdkFetcher {
            auth,
            upstream,
            executor: None,
        }
    }

    /// Runs the developer credential's `az` through `executor` (tests script it).
    pub fn with_executor(mut self, executor: Arc<dyn Executor>) -> SdkFetcher {
        self.executor = Some(executor);
        self
    }

    fn authority(&self) -> String {
        self.auth
            .credential
            .authority_host()
            .map(str::to_string)
            .or_else(|| env("AZURE_AUTHORITY_HOST"))
            .unwrap_or_else(|| PUBLIC_AUTHORITY.to_string())
            .trim_end_matches('/')
            .to_string()
    }

    /// Values that must never appear in a message: the client secret and the managed
    /// identity endpoint's secret header.
    fn secrets(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let EntraCredential::ClientSecret { client_secret, .. } = &self.auth.credential {
            v.push(client_secret.expose().to_string());
        }
        if let Some(h) = env("IDENTITY_HEADER") {
            v.push(h);
        }
        v
    }

    fn client_options(&self) -> ClientOptions {
        let mut plain_http = None;
        let mut options = ClientOptions::default();
        if let Some(host) = self.auth.credential.authority_host() {
            // azure_identity takes https authorities only; a loopback http authority (the
            // config allows no other) is given to it as https and carried over http.
            let host = match host.strip_prefix("http://") {
                Some(rest) => {
                    plain_http = Some(rest.to_ascii_lowercase());
                    format!("https://{rest}")
                }
                None => host.to_string(),
            };
            let mut cloud = azure_core::cloud::CustomConfiguration::default();
            cloud.authority_host = host;
            options.cloud = Some(Arc::new(cloud.into()));
        }
        options.transport = Some(Transport::new(Arc::new(IdentityTransport {
            upstream: Arc::clone(&self.upstream),
            plain_http,
        })));
        // This module schedules the retries (with backoff, logging once); the VM
        // managed identity credential keeps its own IMDS retry policy regardless.
        options.retry = RetryOptions::none();
        options
    }

    /// A new credential object for each fetch (see the module docs on its cache).
    fn credential(&self) -> azure_core::Result<Arc<dyn TokenCredential>> {
        let client_options = self.client_options();
        Ok(match &self.auth.credential {
            EntraCredential::ManagedIdentity { id } => {
                azure_identity::ManagedIdentityCredential::new(Some(
                    azure_identity::ManagedIdentityCredentialOptions {
                        user_assigned_id: id.as_ref().map(|id| match id {
                            ManagedIdentityId::ClientId(v) => {
                                azure_identity::UserAssignedId::ClientId(v.clone())
                            }
                            ManagedIdentityId::ObjectId(v) => {
                                azure_identity::UserAssignedId::ObjectId(v.clone())
                            }
                            ManagedIdentityId::ResourceId(v) => {
                                azure_identity::UserAssignedId::ResourceId(v.clone())
                            }
                        }),
                        client_options,
                    },
                ))?
            }
            EntraCredential::WorkloadIdentity {
                tenant_id,
                client_id,
                token_file,
                ..
            } => azure_identity::WorkloadIdentityCredential::new(Some(
                azure_identity::WorkloadIdentityCredentialOptions {
                    credential_options: azure_identity::ClientAssertionCredentialOptions {
                        client_options,
                    },
                    client_id: client_id.clone(),
                    tenant_id: tenant_id.clone(),
                    token_file_path: token_file.as_ref().map(Into::into),
                },
            ))?,
            EntraCredential::ClientSecret {
                tenant_id,
                client_id,
                client_secret,
                ..
            } => azure_identity::ClientSecretCredential::new(
                tenant_id,
                client_id.clone(),
                azure_core::credentials::Secret::new(client_secret.expose().to_string()),
                Some(azure_identity::ClientSecretCredentialOptions { client_options }),
            )?,
            EntraCredential::Developer { tenant_id } => azure_identity::AzureCliCredential::new(
                Some(azure_identity::AzureCliCredentialOptions {
                    tenant_id: tenant_id.clone(),
                    executor: self.executor.clone(),
                    ..Default::default()
                }),
            )?,
        })
    }
}

#[async_trait::async_trait]
impl FetchToken for SdkFetcher {
    async fn fetch(&self) -> Result<FetchedToken, FetchError> {
        let secrets = self.secrets();
        let fail = |e: azure_core::Error| FetchError(redact(&e.to_string(), &secrets));
        let credential = self.credential().map_err(fail)?;
        let token = credential
            .get_token(&[self.auth.scope.as_str()], None)
            .await
            .map_err(fail)?;
        let left = token.expires_on - azure_core::time::OffsetDateTime::now_utc();
        let ms = u64::try_from(left.whole_milliseconds()).unwrap_or(0);
        if ms == 0 {
            return Err(FetchError(
                "the identity service returned a token that has already expired".to_string(),
            ));
        }
        Ok(FetchedToken {
            token: Secret::new(token.token.secret().to_string()),
            expires_in: Duration::from_millis(ms),
        })
    }

    fn endpoint(&self) -> String {
        match &self.auth.credential {
            EntraCredential::ManagedIdentity { .. } => {
                match (env("IDENTITY_ENDPOINT"), env("IDENTITY_HEADER")) {
                    (Some(e), Some(_)) => format!("{e} (App Service / Container Apps identity endpoint)"),
                    (Some(e), None) => format!("{e} (IDENTITY_ENDPOINT without IDENTITY_HEADER: not a managed identity source this gateway supports)"),
                    (None, _) => format!("{MANAGED_IDENTITY_IMDS} (Azure Instance Metadata Service)"),
                }
            }
            EntraCredential::WorkloadIdentity { tenant_id, .. } => {
                let tenant = tenant_id
                    .clone()
                    .or_else(|| env("AZURE_TENANT_ID"))
                    .unwrap_or_default();
                format!("{}/{tenant}/oauth2/v2.0/token", self.authority())
            }
            EntraCredential::ClientSecret { tenant_id, .. } => {
                format!("{}/{tenant_id}/oauth2/v2.0/token", self.authority())
            }
            EntraCredential::Developer { .. } => {
                "the Azure CLI (az account get-access-token)".to_string()
            }
        }
    }
}

/// `message` with every secret replaced, anything shaped like a JWT replaced, line breaks
/// flattened and the length bounded: what an identity service or the SDK said, safe to log.
pub fn redact(message: &str, secrets: &[String]) -> String {
    let mut m = message.to_string();
    for s in secrets {
        // Short values would blank out ordinary words; no real secret is that short.
        if s.len() >= 4 {
            m = m.replace(s.as_str(), "***");
        }
    }
    // Tokens sit between spaces, quotes, or the punctuation of form bodies, JSON and
    // URLs (`assertion=eyJ...&`, `{"access_token":"eyJ..."}`).
    let separator = |c: char| c.is_whitespace() || "\"'=&,:;{}()[]<>".contains(c);
    let mut out = String::with_capacity(m.len());
    for word in m.split_inclusive(separator) {
        let core = word.trim_end_matches(separator);
        if looks_like_jwt(core) {
            out.push_str("***");
            out.push_str(&word[core.len()..]);
        } else {
            out.push_str(word);
        }
    }
    let flat: String = out
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let flat = flat
        .split(' ')
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    match flat.char_indices().nth(MESSAGE_LIMIT) {
        Some((i, _)) => format!("{}...", &flat[..i]),
        None => flat,
    }
}

/// Three base64url segments, the first starting like a JSON header (`eyJ`).
fn looks_like_jwt(s: &str) -> bool {
    let s = s.strip_prefix("Bearer ").unwrap_or(s);
    let parts: Vec<&str> = s.split('.').collect();
    parts.len() == 3
        && parts[0].starts_with("eyJ")
        && parts[..2].iter().all(|p| p.len() >= 4)
        && parts.iter().all(|p| {
            p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Sends the `azure_identity` requests through the gateway's upstream client.
struct IdentityTransport {
    upstream: Arc<dyn Upstream>,
    /// `host:port` of a loopback authority configured as `http://`.
    plain_http: Option<String>,
}

impl fmt::Debug for IdentityTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdentityTransport")
            .field("plain_http", &self.plain_http)
            .finish_non_exhaustive()
    }
}

fn sdk_error(kind: azure_core::error::ErrorKind, message: String) -> azure_core::Error {
    azure_core::Error::with_message(kind, message)
}

#[async_trait::async_trait]
impl HttpClient for IdentityTransport {
    async fn execute_request(
        &self,
        request: &azure_core::http::Request,
    ) -> azure_core::Result<AsyncRawResponse> {
        use azure_core::error::ErrorKind;
        let mut url = request.url().clone();
        let origin = match (url.host_str(), url.port_or_known_default()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            _ => String::new(),
        };
        if url.scheme() == "https"
            && self
                .plain_http
                .as_deref()
                .is_some_and(|p| p == origin.to_ascii_lowercase())
        {
            let _ = url.set_scheme("http");
        }
        let body = match request.body() {
            azure_core::http::Body::Bytes(b) => b.clone(),
            azure_core::http::Body::SeekableStream(_) => {
                return Err(sdk_error(
                    ErrorKind::Other,
                    "streamed request bodies are not supported".to_string(),
                ))
            }
        };
        let method = http::Method::from_bytes(request.method().as_str().as_bytes())
            .map_err(|e| sdk_error(ErrorKind::Other, e.to_string()))?;
        let mut builder = http::Request::builder().method(method).uri(url.as_str());
        if let Some(h) = builder.headers_mut() {
            for (name, value) in request.headers().iter() {
                let (Ok(n), Ok(mut v)) = (
                    http::HeaderName::from_bytes(name.as_str().as_bytes()),
                    HeaderValue::from_str(value.as_str()),
                ) else {
                    continue;
                };
                v.set_sensitive(true);
                h.insert(n, v);
            }
        }
        let req = builder
            .body(body)
            .map_err(|e| sdk_error(ErrorKind::Other, e.to_string()))?;
        let sent = self
            .upstream
            .send_http(&req, IDENTITY_REQUEST_TIMEOUT)
            .await;
        let resp = sent.map_err(|e| {
            let kind = match e {
                AttemptError::Connect(_) => ErrorKind::Connection,
                _ => ErrorKind::Io,
            };
            sdk_error(kind, format!("request to {origin} failed: {e}"))
        })?;
        let (parts, body) = resp.into_parts();
        let bytes = tokio::time::timeout(
            IDENTITY_REQUEST_TIMEOUT,
            Limited::new(body, IDENTITY_BODY_LIMIT).collect(),
        )
        .await
        .map_err(|_| {
            sdk_error(
                ErrorKind::Io,
                format!("response from {origin} did not arrive in time"),
            )
        })?
        .map_err(|e| sdk_error(ErrorKind::Io, format!("response from {origin}: {e}")))?
        .to_bytes();
        let mut headers = azure_core::http::headers::Headers::new();
        for (name, value) in &parts.headers {
            if let Ok(v) = value.to_str() {
                headers.insert(name.as_str().to_string(), v.to_string());
            }
        }
        Ok(AsyncRawResponse::from_bytes(
            parts.status.as_u16().into(),
            headers,
            bytes,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::UpstreamRequest;
    use spillgate_core::config::DEFAULT_ENTRA_SCOPE;
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// One scripted fetch: how long it takes and what it returns (a token's lifetime, or
    /// an error).
    type Step = (Duration, Result<Duration, &'static str>);

    /// A fetcher that plays a script (then repeats its last step), numbering the tokens
    /// it hands out: `tok-1`, `tok-2`, ...
    struct Scripted {
        calls: AtomicUsize,
        script: Mutex<VecDeque<Step>>,
        last: Mutex<Option<Step>>,
    }

    impl Scripted {
        fn new(script: Vec<Step>) -> Arc<Scripted> {
            Arc::new(Scripted {
                calls: AtomicUsize::new(0),
                script: Mutex::new(script.into()),
                last: Mutex::new(None),
            })
        }
        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
        fn push(&self, step: Step) {
            self.script.lock().unwrap().push_back(step);
        }
    }

    #[async_trait::async_trait]
    impl FetchToken for Scripted {
        async fn fetch(&self) -> Result<FetchedToken, FetchError> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
            let step = {
                let next = self.script.lock().unwrap().pop_front();
                let mut last = self.last.lock().unwrap();
                if let Some(s) = next {
                    *last = Some(s);
                }
                last.expect("a scripted step")
            };
            tokio::time::sleep(step.0).await;
            match step.1 {
                Err("PANIC") => panic!("the identity transport fell over"),
                Ok(lifetime) => Ok(FetchedToken {
                    token: Secret::new(format!("tok-{n}")),
                    expires_in: lifetime,
                }),
                Err(e) => Err(FetchError(e.to_string())),
            }
        }
        fn endpoint(&self) -> String {
            "http://identity.test/token".to_string()
        }
    }

    #[derive(Default)]
    struct Events {
        unavailable: Mutex<Vec<Duration>>,
        obtained: AtomicUsize,
    }

    impl CredentialEvents for Events {
        fn unavailable(&self, _: &TokenSource, next_try: Duration) -> Vec<Arc<str>> {
            self.unavailable.lock().unwrap().push(next_try);
            vec![Arc::from("b1")]
        }
        fn obtained(&self, _: &TokenSource) {
            self.obtained.fetch_add(1, Ordering::SeqCst);
        }
    }

    const HOUR: Duration = Duration::from_secs(3600);

    fn source(script: Vec<Step>) -> (Arc<TokenSource>, Arc<Scripted>, Arc<Events>) {
        let fetcher = Scripted::new(script);
        let auth = EntraAuth {
            credential: EntraCredential::ManagedIdentity { id: None },
            scope: DEFAULT_ENTRA_SCOPE.to_string(),
        };
        let s = TokenSource::new(auth, Arc::clone(&fetcher) as Arc<dyn FetchToken>);
        let events = Arc::new(Events::default());
        s.set_events(Arc::clone(&events) as Arc<dyn CredentialEvents>);
        (s, fetcher, events)
    }

    fn value(t: &BearerToken) -> &str {
        t.header().to_str().unwrap()
    }

    /// Lets spawned tasks run until they block, without moving the paused clock.
    async fn settle() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn many_first_requests_share_one_fetch() {
        let (_logs, _guard) = Logs::capture();
        let (s, f, _) = source(vec![(Duration::from_secs(1), Ok(HOUR))]);
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let s = Arc::clone(&s);
                tokio::spawn(async move { s.bearer(Duration::from_secs(10)).await })
            })
            .collect();
        for t in tasks {
            assert_eq!(value(&t.await.unwrap().unwrap()), "Bearer tok-1");
        }
        assert_eq!(f.calls(), 1, "one fetch for a hundred waiting requests");
        assert_eq!(t0.elapsed(), Duration::from_secs(1));
        assert!(matches!(s.status(), CredentialStatus::Ready { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn renews_five_minutes_ahead_while_requests_keep_the_old_token() {
        let (_logs, _guard) = Logs::capture();
        // The renewal takes 30 s: requests meanwhile must not wait for it.
        let (s, f, _) = source(vec![
            (Duration::ZERO, Ok(HOUR)),
            (Duration::from_secs(30), Ok(HOUR)),
        ]);
        let t0 = Instant::now();
        assert_eq!(
            value(&s.bearer(Duration::from_secs(1)).await.unwrap()),
            "Bearer tok-1"
        );
        tokio::time::sleep_until(t0 + HOUR - REFRESH_AHEAD - Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(f.calls(), 1, "nothing renewed before its time");
        tokio::time::sleep_until(t0 + HOUR - REFRESH_AHEAD + Duration::from_secs(1)).await;
        settle().await;
        assert_eq!(
            f.calls(),
            2,
            "renewed in the background, with no request asking"
        );
        // The renewal is in flight: the current token is served at once.
        let before = Instant::now();
        let t = s.bearer(Duration::from_secs(60)).await.unwrap();
        assert_eq!(value(&t), "Bearer tok-1");
        assert_eq!(before.elapsed(), Duration::ZERO);
        tokio::time::sleep(Duration::from_secs(30)).await;
        settle().await;
        assert_eq!(value(&s.current().unwrap()), "Bearer tok-2");
        assert_eq!(f.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hundred_requests_at_expiry_trigger_one_fetch() {
        let (_logs, _guard) = Logs::capture();
        // A two-minute token is renewed halfway (60 s); the renewal takes 80 s, so the
        // token runs out (at 110 s, keeping the 10 s margin) while it is in flight.
        let (s, f, _) = source(vec![
            (Duration::ZERO, Ok(Duration::from_secs(120))),
            (Duration::from_secs(80), Ok(HOUR)),
        ]);
        let t0 = Instant::now();
        s.bearer(Duration::from_secs(1)).await.unwrap();
        tokio::time::sleep_until(t0 + Duration::from_secs(115)).await;
        assert!(s.current().is_none(), "the token is past use");
        assert_eq!(f.calls(), 2);
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let s = Arc::clone(&s);
                tokio::spawn(async move { s.bearer(Duration::from_secs(60)).await })
            })
            .collect();
        for t in tasks {
            assert_eq!(value(&t.await.unwrap().unwrap()), "Bearer tok-2");
        }
        assert_eq!(f.calls(), 2, "the requests waited on the fetch in flight");
        assert_eq!(Instant::now() - t0, Duration::from_secs(140));
        // And with no fetch in flight (no refresher running): a hundred requests at
        // expiry, one fetch.
        let (s, f, _) = source(vec![(Duration::ZERO, Ok(HOUR))]);
        let t0 = Instant::now();
        s.bearer(Duration::from_secs(1)).await.unwrap();
        // Stop the refresher: only requests fetch from here on.
        if let Some(task) = lock(&s.task).take() {
            task.abort();
        }
        tokio::time::sleep_until(t0 + HOUR).await;
        assert!(s.current().is_none());
        f.push((Duration::from_secs(2), Ok(HOUR)));
        // Requests start a new refresher; all hundred share its one fetch.
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let s = Arc::clone(&s);
                tokio::spawn(async move { s.bearer(Duration::from_secs(10)).await })
            })
            .collect();
        for t in tasks {
            assert_eq!(value(&t.await.unwrap().unwrap()), "Bearer tok-2");
        }
        assert_eq!(f.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_remembered_and_retried_with_backoff() {
        let (_logs, _guard) = Logs::capture();
        let (s, f, events) = source(vec![(Duration::ZERO, Err("identity endpoint down"))]);
        let e = s.bearer(Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(
            e,
            TokenError::Unavailable(Arc::from("identity endpoint down"))
        );
        assert_eq!(f.calls(), 1);
        assert_eq!(
            *events.unavailable.lock().unwrap(),
            vec![Duration::from_secs(1)]
        );
        // While the retry is not due, requests fail at once and fetch nothing.
        for _ in 0..10 {
            assert!(matches!(
                s.bearer(Duration::from_secs(5)).await,
                Err(TokenError::Unavailable(_))
            ));
        }
        assert_eq!(f.calls(), 1);
        assert_eq!(s.retry_in(), Some(Duration::from_secs(1)));
        // Retries after 1 s, 2 s, 4 s.
        tokio::time::sleep(Duration::from_millis(1001)).await;
        settle().await;
        assert_eq!(f.calls(), 2);
        tokio::time::sleep(Duration::from_millis(2001)).await;
        settle().await;
        assert_eq!(f.calls(), 3);
        assert!(matches!(
            s.status(),
            CredentialStatus::Failing {
                failures: 3,
                token_left: None,
                ..
            }
        ));
        // The service comes back: the next retry brings a token, and the events say so.
        f.push((Duration::ZERO, Ok(HOUR)));
        tokio::time::sleep(Duration::from_millis(4001)).await;
        settle().await;
        assert_eq!(f.calls(), 4);
        assert_eq!(
            value(&s.bearer(Duration::ZERO).await.unwrap()),
            "Bearer tok-4"
        );
        assert_eq!(events.obtained.load(Ordering::SeqCst), 1);
        assert_eq!(events.unavailable.lock().unwrap().len(), 3);
        assert!(matches!(s.status(), CredentialStatus::Ready { .. }));
        assert_eq!(s.retry_in(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_renewal_keeps_the_token_in_use() {
        let (_logs, _guard) = Logs::capture();
        let (s, f, events) = source(vec![
            (Duration::ZERO, Ok(HOUR)),
            (
                Duration::ZERO,
                Err("AADSTS70021: no matching federated identity record found"),
            ),
        ]);
        let t0 = Instant::now();
        s.bearer(Duration::from_secs(1)).await.unwrap();
        tokio::time::sleep_until(t0 + HOUR - REFRESH_AHEAD + Duration::from_secs(10)).await;
        settle().await;
        assert!(f.calls() >= 3, "the renewal is retried");
        assert_eq!(
            value(&s.bearer(Duration::ZERO).await.unwrap()),
            "Bearer tok-1"
        );
        assert!(
            events.unavailable.lock().unwrap().is_empty(),
            "backends keep serving"
        );
        assert!(matches!(
            s.status(),
            CredentialStatus::Failing {
                token_left: Some(_),
                ..
            }
        ));
        // Retries never wait past the token's end: once it is gone, the backends lose it.
        tokio::time::sleep_until(t0 + HOUR).await;
        settle().await;
        assert!(s.current().is_none());
        assert!(!events.unavailable.lock().unwrap().is_empty());
    }

    use crate::test_logs::Logs;

    fn renew(
        s: &Arc<TokenSource>,
        refused: &Arc<BearerToken>,
    ) -> tokio::task::JoinHandle<Result<Arc<BearerToken>, TokenError>> {
        let (s, r) = (Arc::clone(s), Arc::clone(refused));
        tokio::spawn(async move {
            match s.refused(&r) {
                Refusal::Replaced(t) => Ok(t),
                Refusal::Renewing => s.renewed(&r, Duration::from_secs(30)).await,
                other => panic!("{other:?}"),
            }
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_token_is_renewed_once_for_all_refusals() {
        let (_logs, _guard) = Logs::capture();
        let (s, f, _) = source(vec![
            (Duration::ZERO, Ok(HOUR)),
            (Duration::from_millis(500), Ok(HOUR)),
        ]);
        let refused = s.bearer(Duration::from_secs(1)).await.unwrap();
        tokio::time::sleep(MIN_RENEWAL_AGE).await;
        let tasks: Vec<_> = (0..50).map(|_| renew(&s, &refused)).collect();
        for t in tasks {
            assert_eq!(value(&t.await.unwrap().unwrap()), "Bearer tok-2");
        }
        assert_eq!(f.calls(), 2);
        // A late refusal of the old token gets the new one, with no fetch.
        match s.refused(&refused) {
            Refusal::Replaced(t) => assert_eq!(value(&t), "Bearer tok-2"),
            other => panic!("{other:?}"),
        }
        settle().await;
        assert_eq!(f.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_token_stays_in_use_for_every_other_request() {
        let (_logs, _guard) = Logs::capture();
        // The renewal takes 5 s and fails.
        let (s, f, events) = source(vec![
            (Duration::ZERO, Ok(HOUR)),
            (
                Duration::from_secs(5),
                Err("AADSTS90033: service unavailable"),
            ),
        ]);
        let t1 = s.bearer(Duration::from_secs(1)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(120)).await;
        let refused = renew(&s, &t1);
        settle().await;
        assert_eq!(f.calls(), 2, "the refusal started a renewal");
        // Meanwhile the token is served at once to everyone else.
        for _ in 0..10 {
            let before = Instant::now();
            let t = s.bearer(Duration::from_secs(10)).await.unwrap();
            assert_eq!(value(&t), "Bearer tok-1");
            assert_eq!(before.elapsed(), Duration::ZERO);
        }
        // Only the refused request learns that the renewal failed; the token stays, and
        // the backends using it stay available.
        let e = refused.await.unwrap().unwrap_err();
        assert_eq!(
            e,
            TokenError::Unavailable(Arc::from("AADSTS90033: service unavailable"))
        );
        assert!(events.unavailable.lock().unwrap().is_empty());
        assert_eq!(
            value(&s.bearer(Duration::ZERO).await.unwrap()),
            "Bearer tok-1"
        );
        // Further refusals of that token fetch nothing ahead of the scheduled retry.
        for _ in 0..20 {
            assert!(matches!(s.refused(&t1), Refusal::Unavailable(_)));
        }
        settle().await;
        assert_eq!(f.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_recent_token_refused_is_not_renewed() {
        let (_logs, _guard) = Logs::capture();
        let (s, f, _) = source(vec![(Duration::ZERO, Ok(HOUR))]);
        let t1 = s.bearer(Duration::from_secs(1)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        for _ in 0..5 {
            match s.refused(&t1) {
                Refusal::TooRecent { age } => assert_eq!(age, Duration::from_secs(30)),
                other => panic!("{other:?}"),
            }
        }
        settle().await;
        assert_eq!(f.calls(), 1);
        // Past a minute, the same refusal renews it.
        tokio::time::sleep(Duration::from_secs(31)).await;
        assert!(matches!(s.refused(&t1), Refusal::Renewing));
        settle().await;
        assert_eq!(f.calls(), 2);
        assert_eq!(value(&s.current().unwrap()), "Bearer tok-2");
    }

    #[tokio::test(start_paused = true)]
    async fn losing_the_token_is_an_error_once_and_regaining_it_an_info_once() {
        let (logs, _guard) = Logs::capture();
        // A two-minute token (renewed from 60 s), then renewals that fail.
        let (s, f, events) = source(vec![
            (Duration::ZERO, Ok(Duration::from_secs(120))),
            (
                Duration::ZERO,
                Err("AADSTS700024: client assertion is not within its valid time range"),
            ),
        ]);
        let t0 = Instant::now();
        s.bearer(Duration::from_secs(1)).await.unwrap();
        tokio::time::sleep_until(t0 + Duration::from_secs(100)).await;
        settle().await;
        assert!(f.calls() >= 3);
        assert_eq!(
            logs.lines("WARN", "could not renew the Entra ID token")
                .len(),
            1
        );
        assert!(logs.lines("ERROR", "could not obtain").is_empty());
        assert!(events.unavailable.lock().unwrap().is_empty());
        // The token runs out (110 s, with the margin) before a renewal succeeds: the
        // backends are cooled, and that is said once, at error level.
        tokio::time::sleep_until(t0 + Duration::from_secs(200)).await;
        settle().await;
        assert!(s.current().is_none());
        assert!(events.unavailable.lock().unwrap().len() >= 2);
        let errors = logs.lines("ERROR", "could not obtain an Entra ID token");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("backends=b1"), "{}", errors[0]);
        assert!(
            errors[0].contains("http://identity.test/token"),
            "{}",
            errors[0]
        );
        assert!(errors[0].contains("AADSTS700024"), "{}", errors[0]);
        assert!(
            errors[0].contains("managed identity (system-assigned)"),
            "{}",
            errors[0]
        );
        assert_eq!(logs.lines("WARN", "could not renew").len(), 1);
        // Back: one info line.
        f.push((Duration::ZERO, Ok(HOUR)));
        tokio::time::sleep(Duration::from_secs(61)).await;
        settle().await;
        assert!(s.current().is_some());
        let back = logs.lines("INFO", "Entra ID token obtained again");
        assert_eq!(back.len(), 1, "{back:?}");
        assert!(back[0].contains("available again"), "{}", back[0]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_fetch_is_a_failure_and_renewals_go_on() {
        let (logs, _guard) = Logs::capture();
        let (s, f, _) = source(vec![
            (Duration::ZERO, Err("PANIC")),
            (Duration::ZERO, Ok(HOUR)),
        ]);
        let e = s.bearer(Duration::from_secs(5)).await.unwrap_err();
        assert!(
            matches!(&e, TokenError::Unavailable(m) if m.contains("panicked") && m.contains("fell over")),
            "{e:?}"
        );
        assert_eq!(
            logs.lines("ERROR", "Entra ID token fetch panicked").len(),
            1
        );
        // The refresher lives on and retries after 1 s.
        tokio::time::sleep(Duration::from_millis(1001)).await;
        settle().await;
        assert_eq!(f.calls(), 2);
        assert_eq!(value(&s.current().unwrap()), "Bearer tok-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refresher_that_ended_is_restarted() {
        let (_logs, _guard) = Logs::capture();
        let (s, f, _) = source(vec![(Duration::ZERO, Ok(HOUR))]);
        let t0 = Instant::now();
        s.bearer(Duration::from_secs(1)).await.unwrap();
        // The task ends (as it would after a panic outside a fetch).
        lock(&s.task).as_ref().unwrap().abort();
        settle().await;
        assert!(lock(&s.task).as_ref().unwrap().is_finished());
        // The next request, served the valid token at once, starts a new one; it renews
        // the token on time.
        assert_eq!(
            value(&s.bearer(Duration::ZERO).await.unwrap()),
            "Bearer tok-1"
        );
        assert!(!lock(&s.task).as_ref().unwrap().is_finished());
        tokio::time::sleep_until(t0 + HOUR - REFRESH_AHEAD + Duration::from_secs(1)).await;
        settle().await;
        assert_eq!(f.calls(), 2);
        // And `start` replaces a finished task too.
        lock(&s.task).as_ref().unwrap().abort();
        settle().await;
        s.start();
        assert!(!lock(&s.task).as_ref().unwrap().is_finished());
    }

    /// The developer credential runs `az` through azure_identity's default executor. It
    /// must not be a tokio child process: the gateway's tokio is built without process
    /// support (see the workspace's Cargo.toml). A tokio child process needs the
    /// runtime's I/O driver, and panics on a runtime without one, as this one is.
    #[test]
    fn the_default_executor_runs_a_program_without_a_tokio_process_driver() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let args: [&std::ffi::OsStr; 2] = ["-c".as_ref(), "echo token".as_ref()];
        let out = rt
            .block_on(azure_identity::new_executor().run("/bin/sh".as_ref(), &args))
            .unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout, b"token\n");
    }

    #[test]
    fn tokens_never_print() {
        let t = BearerToken::new(
            &Secret::new("eyJsecret.token.value".into()),
            Instant::now(),
            Instant::now() + HOUR,
        )
        .unwrap();
        let shown = format!("{t:?} {t} {:?}", t.header());
        assert!(!shown.contains("secret"), "{shown}");
        assert!(t.header().is_sensitive());
    }

    #[test]
    fn redact_removes_secrets_tokens_and_line_breaks() {
        let jwt = "eyJ0eXAiOiJKV1QiLCJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJodHRwczovL2NvZ25pdGl2ZXNlcnZpY2VzIn0.c2lnbmF0dXJl";
        let m = redact(
            &format!("AADSTS7000215: Invalid client secret 'hunter2-secret' provided.\n  token \"{jwt}\" Bearer {jwt}"),
            &["hunter2-secret".to_string()],
        );
        assert_eq!(
            m,
            "AADSTS7000215: Invalid client secret '***' provided. token \"***\" Bearer ***"
        );
        // Inside form bodies, JSON and brackets too.
        let m = redact(
            &format!("request body grant_type=client_credentials&client_assertion={jwt}&client_id=c1 {{\"access_token\":\"{jwt}\",\"x\":1}} ({jwt}) [{jwt}] <{jwt}> a:{jwt};{jwt},"),
            &[],
        );
        assert!(!m.contains("eyJ"), "{m}");
        assert_eq!(
            m,
            "request body grant_type=client_credentials&client_assertion=***&client_id=c1 {\"access_token\":\"***\",\"x\":1} (***) [***] <***> a:***;***,"
        );
        let long = "x ".repeat(1000);
        assert!(redact(&long, &[]).len() < 700);
    }

    #[test]
    fn refresh_is_five_minutes_ahead_or_halfway() {
        let now = Instant::now();
        assert_eq!(refresh_at(now, HOUR), now + HOUR - REFRESH_AHEAD);
        assert_eq!(
            refresh_at(now, Duration::from_secs(300)),
            now + Duration::from_secs(150)
        );
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(4));
        assert_eq!(backoff(30), Duration::from_secs(60));
    }

    /// Plays `az account get-access-token` for the developer credential.
    #[derive(Debug)]
    struct FakeAz {
        code: i32,
        stdout: String,
        stderr: &'static str,
        commands: Mutex<Vec<String>>,
    }

    #[async_trait::async_trait]
    impl Executor for FakeAz {
        async fn run(
            &self,
            _program: &std::ffi::OsStr,
            args: &[&std::ffi::OsStr],
        ) -> std::io::Result<std::process::Output> {
            use std::os::unix::process::ExitStatusExt;
            self.commands.lock().unwrap().push(
                args.iter()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(" "),
            );
            Ok(std::process::Output {
                status: std::process::ExitStatus::from_raw(self.code << 8),
                stdout: self.stdout.clone().into_bytes(),
                stderr: self.stderr.as_bytes().to_vec(),
            })
        }
    }

    struct NoNetwork;
    impl Upstream for NoNetwork {
        fn send<'a>(
            &'a self,
            _: UpstreamRequest<'a>,
            _: Duration,
        ) -> futures_util::future::BoxFuture<
            'a,
            Result<http::Response<axum::body::Body>, AttemptError>,
        > {
            Box::pin(async { Err(AttemptError::Connect("no network in this test".into())) })
        }
    }

    #[tokio::test]
    async fn developer_credential_runs_the_azure_cli() {
        let (_logs, _guard) = Logs::capture();
        let expires = azure_core::time::OffsetDateTime::now_utc().unix_timestamp() + 3600;
        let az = Arc::new(FakeAz {
            code: 0,
            stdout: format!(
                r#"{{"accessToken":"cli-token","expires_on":{expires},"tokenType":"Bearer"}}"#
            ),
            stderr: "",
            commands: Mutex::new(Vec::new()),
        });
        let auth = EntraAuth {
            credential: EntraCredential::Developer {
                tenant_id: Some("contoso.onmicrosoft.com".into()),
            },
            scope: DEFAULT_ENTRA_SCOPE.to_string(),
        };
        let f = SdkFetcher::new(auth.clone(), Arc::new(NoNetwork))
            .with_executor(Arc::clone(&az) as Arc<dyn Executor>);
        let t = f.fetch().await.unwrap();
        assert_eq!(t.token.expose(), "cli-token");
        assert!(t.expires_in > Duration::from_secs(3590) && t.expires_in <= HOUR);
        let cmd = az.commands.lock().unwrap().join("\n");
        assert!(
            cmd.contains("az account get-access-token")
                && cmd.contains(DEFAULT_ENTRA_SCOPE)
                && cmd.contains("--tenant contoso.onmicrosoft.com"),
            "{cmd}"
        );
        assert_eq!(f.endpoint(), "the Azure CLI (az account get-access-token)");
        // Not logged in: the CLI's own message is the error.
        let az = Arc::new(FakeAz {
            code: 1,
            stdout: String::new(),
            stderr: "ERROR: Please run 'az login' to setup account.",
            commands: Mutex::new(Vec::new()),
        });
        let f = SdkFetcher::new(auth, Arc::new(NoNetwork)).with_executor(az as Arc<dyn Executor>);
        let e = f.fetch().await.err().unwrap();
        assert!(e.0.contains("Please run 'az login'"), "{e}");
    }
}
