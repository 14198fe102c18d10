//! A scriptable OpenAI / Azure OpenAI backend for testing, demonstrating and
//! benchmarking the gateway without real model endpoints.
//!
//! A [`MockBackend`] serves the OpenAI (`/v1/...`), Azure v1
//! (`/openai/v1/...`) and Azure classic
//! (`/openai/deployments/{deployment}/...`) paths with responses the official
//! SDKs accept: chat completions (JSON or SSE), completions, embeddings,
//! responses and model lists. On top of that a test can
//!
//! * queue scripted [`Reply`]s (errors, 429s, raw bodies, slow or broken
//!   streams) and replace the default behaviour,
//! * enforce Azure-like per-deployment [`Limits`] with realistic 429s and
//!   `x-ratelimit-*` headers,
//! * inspect every received request ([`RecordedRequest`]) and counters such
//!   as completed and client-cancelled streams,
//! * serve Entra ID token endpoints too ([`MockIdentity`]) and accept the
//!   bearer tokens issued there.
//!
//! For gateways that share state, [`RedisServer`] runs a real `redis-server` on a free
//! loopback port for the duration of a test.
//!
//! Everything is also reachable over HTTP under `/_mock/` (`GET state`,
//! `POST script`, `POST default`, `POST reset`, `POST identity`) for tests that run the
//! `spillgate-mock` binary out of process.

mod body;
mod config;
mod handler;
mod identity;
mod limiter;
mod openai;
mod redis;
mod reply;
mod server;
mod state;
mod tls;

pub use config::{Limits, MockConfig, DEFAULT_NAME, DEFAULT_STREAM_CHUNKS};
pub use identity::{IdentityControl, IdentityView, MockIdentity};
pub use openai::stream_text;
pub use redis::{free_port, redis_server_binary, RedisServer};
pub use reply::{Reply, ReplyBody};
pub use server::MockBackend;
pub use state::{MockState, RecordedRequest};
pub use tls::test_certificates;
