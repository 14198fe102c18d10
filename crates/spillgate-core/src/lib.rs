//! spillgate's routing rules, free of I/O: configuration and its validation, pools and
//! selection, request shapes, and what an upstream answer means for a backend.
//!
//! Time (`now`, unix milliseconds) and randomness (a seeded [`fastrand::Rng`]) are
//! parameters, so every rule here is a plain unit test.

pub mod breaker;
pub mod capacity;
pub mod config;
pub mod outcome;
pub mod request;
pub mod retry;
pub mod routing;
pub mod shared;

pub use fastrand;
