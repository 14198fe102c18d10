//! How a mock backend behaves when nothing is scripted.

use std::time::Duration;

/// Name of a backend when none is given.
pub const DEFAULT_NAME: &str = "mock";

/// Content chunks of an SSE stream when none are given: the built-in stream
/// of [`MockConfig::default`], the binary's `--stream-chunks` and a scripted
/// [`crate::ReplyBody::Stream`] without `chunks`.
pub const DEFAULT_STREAM_CHUNKS: usize = 10;

/// Configuration of one mock backend.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// Echoed in every response as `x-mock-backend: <name>` and in the
    /// generated content (`"Hello from <name>"`), so a test can tell which
    /// backend answered.
    pub name: String,
    /// Added before answering every API request.
    pub latency: Duration,
    /// Content chunks in a built-in SSE stream.
    pub stream_chunks: usize,
    /// Pause between SSE chunks.
    pub chunk_interval: Duration,
    /// Per-deployment rate limits; `None` = unlimited.
    pub limits: Option<Limits>,
    /// If set, a request is answered 401 unless its `api-key` header or its
    /// `Authorization: Bearer` token equals this key.
    pub expect_api_key: Option<String>,
    /// Keep request bodies in the recorded requests. When off, a record keeps
    /// the headers and the body's SHA-256 (which is computed either way) but
    /// an empty body. To keep no records at all, as long benchmark runs need,
    /// turn recording off with [`crate::MockBackend::set_recording`].
    pub record_bodies: bool,
    /// Also serve Entra ID token endpoints, and accept the tokens issued there.
    pub identity: Option<crate::MockIdentity>,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            name: DEFAULT_NAME.to_owned(),
            latency: Duration::ZERO,
            stream_chunks: DEFAULT_STREAM_CHUNKS,
            chunk_interval: Duration::ZERO,
            limits: None,
            expect_api_key: None,
            record_bodies: true,
            identity: None,
        }
    }
}

impl MockConfig {
    /// The default configuration with another name.
    pub fn named(name: &str) -> MockConfig {
        MockConfig {
            name: name.to_owned(),
            ..MockConfig::default()
        }
    }
}

/// Rate limits, enforced per deployment (or model) over fixed windows.
///
/// Azure states quotas per minute but enforces them over short windows, so a
/// window of `window` allows `ceil(rpm * window / 60 s)` requests and
/// `ceil(tpm * window / 60 s)` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Requests per minute.
    pub rpm: u32,
    /// Tokens per minute.
    pub tpm: u32,
    /// Length of one enforcement window.
    pub window: Duration,
}
