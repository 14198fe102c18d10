//! Log capture for tests: the crate's unit tests, and `tests/entra.rs` through `#[path]`.
// Each includer uses part of it.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

/// Log lines written while the guard lives (this thread; tokio tests run their tasks on
/// it), at debug level, the Azure SDK's lines included.
///
/// A test that runs code which logs should hold one even when it reads no logs: `tracing`
/// caches whether a log statement is enabled the first time it runs, from the subscribers
/// that exist then, so a test without a subscriber could otherwise hide a line from a
/// test that reads it, when both run at once.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

impl Logs {
    pub fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .finish();
        (logs.clone(), tracing::subscriber::set_default(subscriber))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// The lines at `level` that contain `text`.
    pub fn lines(&self, level: &str, text: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains(level) && l.contains(text))
            .map(str::to_string)
            .collect()
    }
}
