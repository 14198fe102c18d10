//! `spillgate-mock`: runs one mock OpenAI / Azure OpenAI backend as its own
//! process, for tests written in other languages and for benchmarks. Tests
//! script it over HTTP under `/_mock/`.
//!
//! After binding it prints exactly one line,
//! `spillgate-mock listening on http://127.0.0.1:PORT`, so that a parent
//! process can start it on port 0 and learn the port.

use std::io::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use spillgate_mock::{Limits, MockBackend, MockConfig, DEFAULT_NAME, DEFAULT_STREAM_CHUNKS};

#[derive(Debug, Parser)]
#[command(name = "spillgate-mock", version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Backend name, echoed in `x-mock-backend` and in generated content.
    #[arg(long, default_value = DEFAULT_NAME)]
    name: String,
    /// Latency added before every answer.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Content chunks in a default SSE stream.
    #[arg(long, default_value_t = DEFAULT_STREAM_CHUNKS)]
    stream_chunks: usize,
    /// Pause between SSE chunks.
    #[arg(long, default_value_t = 0)]
    chunk_interval_ms: u64,
    /// Requests per minute per deployment (enables the limiter).
    #[arg(long)]
    rpm: Option<u32>,
    /// Tokens per minute per deployment (enables the limiter).
    #[arg(long)]
    tpm: Option<u32>,
    /// Length of the limiter's enforcement window.
    #[arg(long, default_value_t = 10)]
    window_secs: u64,
    /// Name of an environment variable holding the API key to require
    /// (the key itself is not taken on the command line, where `ps` shows it).
    #[arg(long)]
    expect_api_key_env: Option<String>,
    /// Do not keep request bodies in the recorded requests.
    #[arg(long)]
    no_record_bodies: bool,
    /// Do not record requests at all (for long benchmark runs, where the
    /// records would grow without bound).
    #[arg(long)]
    no_record_requests: bool,
    /// Also serve Entra ID token endpoints (`GET /msi/token`, `POST
    /// /{tenant}/oauth2/v2.0/token`) and accept the tokens issued there.
    #[arg(long)]
    identity: bool,
    /// Name of an environment variable holding the `x-identity-header` value the
    /// managed identity endpoint requires.
    #[arg(long, requires = "identity")]
    identity_header_env: Option<String>,
    /// Name of an environment variable holding the client secret the token endpoint
    /// requires.
    #[arg(long, requires = "identity")]
    identity_client_secret_env: Option<String>,
    /// Lifetime of issued tokens.
    #[arg(long, default_value_t = 3600, requires = "identity")]
    token_lifetime_secs: u64,
}

impl Args {
    fn config(&self) -> anyhow::Result<MockConfig> {
        let limits = if self.rpm.is_some() || self.tpm.is_some() {
            Some(Limits {
                // A limit that was not given does not constrain.
                rpm: self.rpm.unwrap_or(u32::MAX),
                tpm: self.tpm.unwrap_or(u32::MAX),
                window: Duration::from_secs(self.window_secs),
            })
        } else {
            None
        };
        let expect_api_key = match &self.expect_api_key_env {
            Some(var) => Some(
                std::env::var(var).with_context(|| format!("reading the API key from ${var}"))?,
            ),
            None => None,
        };
        let from_env = |var: &Option<String>| -> anyhow::Result<Option<String>> {
            var.as_ref()
                .map(|v| std::env::var(v).with_context(|| format!("reading ${v}")))
                .transpose()
        };
        let identity = if self.identity {
            Some(spillgate_mock::MockIdentity {
                identity_header: from_env(&self.identity_header_env)?,
                client_secret: from_env(&self.identity_client_secret_env)?,
                lifetime: Duration::from_secs(self.token_lifetime_secs),
            })
        } else {
            None
        };
        Ok(MockConfig {
            name: self.name.clone(),
            latency: Duration::from_millis(self.latency_ms),
            stream_chunks: self.stream_chunks,
            chunk_interval: Duration::from_millis(self.chunk_interval_ms),
            limits,
            expect_api_key,
            record_bodies: !self.no_record_bodies,
            identity,
        })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs go to stderr: stdout carries only the "listening" line.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();

    let args = Args::parse();
    let backend = MockBackend::start_on(args.config()?, args.listen).await?;
    backend.set_recording(!args.no_record_requests);
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "spillgate-mock listening on {}", backend.url())?;
        stdout.flush()?;
    }
    wait_for_signal().await?;
    backend.shutdown().await;
    Ok(())
}

#[cfg(unix)]
async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        res = tokio::signal::ctrl_c() => res.context("waiting for ctrl-c")?,
        _ = term.recv() => {}
    }
    Ok(())
}

#[cfg(not(unix))]
async fn wait_for_signal() -> anyhow::Result<()> {
    tokio::signal::ctrl_c().await.context("waiting for ctrl-c")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_need_rpm_or_tpm() {
        let args = Args::parse_from(["spillgate-mock", "--name", "a"]);
        let cfg = args.config().unwrap();
        assert!(cfg.limits.is_none());
        assert!(cfg.record_bodies);

        let args = Args::parse_from([
            "spillgate-mock",
            "--rpm",
            "60",
            "--window-secs",
            "5",
            "--no-record-bodies",
            "--chunk-interval-ms",
            "3",
        ]);
        let cfg = args.config().unwrap();
        let limits = cfg.limits.unwrap();
        assert_eq!(limits.rpm, 60);
        assert_eq!(limits.tpm, u32::MAX);
        assert_eq!(limits.window, Duration::from_secs(5));
        assert!(!cfg.record_bodies);
        assert_eq!(cfg.chunk_interval, Duration::from_millis(3));
    }

    #[test]
    fn missing_key_variable_is_an_error() {
        let args = Args::parse_from([
            "spillgate-mock",
            "--expect-api-key-env",
            "SPILLGATE_MOCK_TEST_SURELY_UNSET_VAR",
        ]);
        assert!(args.config().is_err());
    }
}
