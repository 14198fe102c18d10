//! The `spillgate` command: run the gateway, check a config, or run the demo.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use spillgate_core::config::{AuthConfig, LogFormat};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "spillgate",
    version,
    about = "Priority-tiered, throttle-aware gateway for OpenAI and Azure OpenAI"
)]
struct Cli {
    /// Config file (TOML) for running the gateway.
    #[arg(long, short, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (the default when no command is given).
    Run,
    /// Validate a config file and print the routing table it resolves to.
    Check {
        /// Also obtain a token from each Entra ID credential and connect to the shared
        /// state store (Redis), and report the results (exits 1 when one fails).
        #[arg(long)]
        probe: bool,
    },
    /// Start three simulated backends and the gateway in front of them; no Azure needed.
    Demo(spillgate::demo::DemoArgs),
}

/// The Azure SDK's own modules, quieted to warnings unless a filter names them: they log
/// every identity request (and every failed one), where the gateway logs a failing
/// credential once per run of failures.
const SDK_TARGETS: [&str; 4] = [
    "azure_core",
    "azure_identity",
    "typespec_client_core",
    "typespec",
];

fn with_sdk_quiet(filter: &str) -> String {
    let mut f = filter.to_string();
    for t in SDK_TARGETS {
        if !filter.contains(t) {
            f.push_str(&format!(",{t}=warn"));
        }
    }
    f
}

fn init_logging(format: LogFormat, level: &str) -> Result<(), ExitCode> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => {
            EnvFilter::try_new(with_sdk_quiet(&v)).map_err(|e| (format!("RUST_LOG: {e}"), v))
        }
        _ => EnvFilter::try_new(with_sdk_quiet(level))
            .map_err(|e| (format!("log.level: {e}"), level.to_string())),
    };
    let filter = match filter {
        Ok(f) => f,
        Err((msg, value)) => {
            eprintln!("error: {msg} (got {value:?}; e.g. \"info\" or \"spillgate=debug\")");
            return Err(ExitCode::from(2));
        }
    };
    // Colours only for a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.init(),
    }
    Ok(())
}

fn read_config(
    path: &Option<PathBuf>,
) -> Result<(spillgate_core::config::Config, String), ExitCode> {
    let Some(path) = path else {
        eprintln!("error: --config FILE is required (see README.md, \"Configuration\")");
        return Err(ExitCode::from(2));
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", path.display());
            return Err(ExitCode::from(2));
        }
    };
    spillgate::load_config(&text)
        .map(|c| (c, text.clone()))
        .map_err(|errors| {
            eprintln!("error: {} is not valid:", path.display());
            for e in &errors.0 {
                eprintln!("  {e}");
            }
            ExitCode::from(2)
        })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Run) {
        Command::Check { probe } => match read_config(&cli.config) {
            Ok((config, _)) => {
                print!("{}", spillgate::check::render(&config));
                println!("\nconfig OK");
                if !probe {
                    return ExitCode::SUCCESS;
                }
                let mut ok = true;
                let code = run_async(async {
                    let (report, all_ok) = spillgate::check::probe(&config).await;
                    print!("\n{report}");
                    ok = all_ok;
                    Ok(())
                });
                if code != ExitCode::SUCCESS {
                    return code;
                }
                if ok {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                }
            }
            Err(code) => code,
        },
        Command::Run => {
            let config_path = cli.config.clone();
            let (config, loaded_text) = match read_config(&cli.config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if let Err(code) = init_logging(config.log.format, &config.log.level) {
                return code;
            }
            run_async(async move {
                if matches!(config.auth, AuthConfig::None) {
                    tracing::warn!("CLIENT AUTHENTICATION IS OFF ([auth] mode = \"none\"): anyone who can reach this port can use every backend. Use this for local development only.");
                }
                let app = spillgate::app::App::new(config)?;
                let admin = spillgate::admin::start(std::sync::Arc::clone(&app)).await?;
                // One connection thread per core, each accepting and serving its own
                // connections; this runtime keeps the background work (health checks,
                // reloads, token renewals, admin).
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                let workers = spillgate::server::ConnectionThreads::start(cores)?;
                let running =
                    spillgate::server::start_on(std::sync::Arc::clone(&app), Some(workers)).await?;
                if let Some(path) = &config_path {
                    let poll = app.snapshot.load().config.server.config_poll;
                    spillgate::reload::spawn(&app, path.clone(), poll, Some(&loaded_text));
                }
                // Tests and scripts read these lines to find the ports when listening on :0.
                println!("spillgate listening on http://{}", running.addr);
                if let Some(a) = &admin {
                    println!("spillgate admin on http://{}", a.addr);
                }
                tracing::info!(addr = %running.addr, admin = ?admin.as_ref().map(|a| a.addr), "listening");
                shutdown_signal().await;
                tracing::info!("shutting down");
                // A second signal while draining: stop now.
                tokio::spawn(async {
                    shutdown_signal().await;
                    tracing::warn!("second signal: exiting without waiting for the drain");
                    std::process::exit(130);
                });
                running.shutdown().await;
                if let Some(a) = admin {
                    a.stop();
                }
                Ok(())
            })
        }
        Command::Demo(args) => {
            if let Err(code) = init_logging(LogFormat::Text, "warn") {
                return code;
            }
            run_async(spillgate::demo::run(args))
        }
    }
}

fn run_async(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
