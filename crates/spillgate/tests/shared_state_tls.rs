//! `rediss://`: the gateway reaches a TLS-only `redis-server` with a password, verifies its
//! certificate against the system's roots (here a test CA named by `SSL_CERT_FILE`, which is
//! why this test has its own process), and shares state through it.
//!
//! Needs `redis-server` (built with TLS, as Debian's is) and the `openssl` command to make
//! the certificates; without either it says SKIPPED and passes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed setup step should abort the test loudly"
)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use spillgate_mock::{
    free_port, redis_server_binary, test_certificates, MockBackend, MockConfig, Reply,
};

const PASSWORD: &str = "tls-test-password-0123";

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `redis-server` binary, and a new directory with the test certificates in it; `None`
/// (the test then skips, saying why) without the binary or the `openssl` command.
fn tls_setup() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let Some(bin) = redis_server_binary() else {
        eprintln!("SKIPPED: redis-server is not installed (./test.sh installs it)");
        return None;
    };
    let dir = std::env::temp_dir().join(format!("spillgate-tls-{}", free_port().unwrap()));
    std::fs::create_dir_all(&dir).unwrap();
    if !test_certificates(&dir).unwrap() {
        eprintln!("SKIPPED: the openssl command is missing or failed");
        return None;
    }
    Some((bin, dir))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_share_state_over_tls_with_a_password() {
    let Some((bin, dir)) = tls_setup() else {
        return;
    };
    let (port, _redis) = start_tls_redis(&bin, &dir, || free_port().unwrap()).await;

    let (x, y) = (
        MockBackend::start(MockConfig::named("x")).await.unwrap(),
        MockBackend::start(MockConfig::named("y")).await.unwrap(),
    );
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[auth]\nclient_keys = [\"env:CLIENT\"]\n[admin]\nenabled = false\n\
         [state]\nredis_url = \"rediss://127.0.0.1:{port}/0\"\npassword = \"env:REDIS_PASSWORD\"\ntimeout = \"100ms\"\n\
         [[backends]]\nname = \"x\"\nkind = \"azure\"\nurl = \"{}\"\npriority = 1\napi_key = \"env:K\"\ndeployments = {{ \"gpt-4o\" = \"gpt-4o\" }}\n\
         [[backends]]\nname = \"y\"\nkind = \"azure\"\nurl = \"{}\"\npriority = 2\napi_key = \"env:K\"\n",
        x.url(),
        y.url()
    );
    let config = || {
        spillgate_core::config::load(
            &text,
            &|v| match v {
                "REDIS_PASSWORD" => Some(PASSWORD.to_string()),
                _ => Some("key".to_string()),
            },
            &|_| Err("no files".into()),
        )
        .unwrap()
    };
    // Until the server answers; its certificate is not signed by a system root, so the
    // gateway refuses it.
    let state = config().state.unwrap();
    let t0 = Instant::now();
    let refused = loop {
        match spillgate::store::ping_redis(&state).await {
            Err(e) if e.contains("refused") && t0.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other,
        }
    };
    assert!(
        refused.as_ref().is_err_and(|e| e.to_lowercase().contains("certificate")
            || e.contains("UnknownIssuer")),
        "{refused:?}"
    );
    // The system roots, as rustls-native-certs reads them, are now the test CA.
    std::env::set_var("SSL_CERT_FILE", dir.join("ca.crt"));
    // What `spillgate check --probe` does.
    let mut probed = Err(String::new());
    for _ in 0..50 {
        probed = spillgate::store::ping_redis(config().state.as_ref().unwrap()).await;
        if probed.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        probed.as_ref().is_ok_and(|v| v.starts_with("Redis ")),
        "{probed:?}"
    );

    let a = spillgate::server::start(spillgate::app::App::new(config()).unwrap())
        .await
        .unwrap();
    let b = spillgate::server::start(spillgate::app::App::new(config()).unwrap())
        .await
        .unwrap();
    let t0 = Instant::now();
    while [&a, &b]
        .iter()
        .any(|g| g.app.store.status().connected != Some(true))
    {
        let st = a.app.store.status();
        assert!(t0.elapsed() < Duration::from_secs(10), "{st:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    x.push_script(vec![Reply::throttled(20)]);
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = |addr| {
        http::Request::post(format!(
            "http://{addr}/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
        ))
        .header("api-key", "key")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            b"{\"messages\":[]}",
        )))
        .unwrap()
    };
    assert_eq!(client.request(req(a.addr)).await.unwrap().status(), 200);
    let t0 = Instant::now();
    while b.app.snapshot.load().backends[0]
        .cooldown_for("gpt-4o", b.app.clock.now_ms())
        .is_none()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "B did not learn the cooldown over TLS"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(client.request(req(b.addr)).await.unwrap().status(), 200);
    assert_eq!(x.hits(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_port_something_else_took_is_passed_over() {
    let Some((bin, dir)) = tls_setup() else {
        return;
    };
    // The first port picked is held by a listener that accepts and answers nothing: a
    // connection to it succeeds, but the server cannot bind it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let mut picks = vec![taken_port];
    let (port, mut redis) = start_tls_redis(&bin, &dir, || {
        picks.pop().unwrap_or_else(|| free_port().unwrap())
    })
    .await;
    assert_ne!(port, taken_port);
    assert!(redis.0.try_wait().unwrap().is_none(), "the server runs");
    assert!(
        std::fs::read_to_string(dir.join(format!("redis-{port}.log")))
            .unwrap()
            .contains("Ready to accept connections")
    );
    assert!(
        std::fs::read_to_string(dir.join(format!("redis-{taken_port}.log")))
            .unwrap()
            .contains("Could not create server TCP listening socket")
    );
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TLS-only `redis-server` with [`PASSWORD`] on a port `pick` gives (a free one), the
/// certificates in `dir`. The port was free when picked and something else may take it
/// before the server binds it: the server then exits without saying it is ready, and
/// another port is tried. An answer on the port would not tell the two apart (the other
/// process answers too).
async fn start_tls_redis(
    bin: &std::path::Path,
    dir: &std::path::Path,
    mut pick: impl FnMut() -> u16,
) -> (u16, Killed) {
    let mut logs = String::new();
    for _ in 0..3 {
        let port = pick();
        let log_path = dir.join(format!("redis-{port}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Killed(
            Command::new(bin)
                .args([
                    "--port",
                    "0",
                    "--tls-port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                ])
                .args([
                    "--tls-cert-file",
                    "server.crt",
                    "--tls-key-file",
                    "server.key",
                ])
                .args(["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"])
                .args([
                    "--requirepass",
                    PASSWORD,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .current_dir(dir)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        // Redis logs this once its listeners are bound, and exits when one cannot be.
        for _ in 0..200 {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            if text.contains("Ready to accept connections") {
                return (port, child);
            }
            if child.0.try_wait().unwrap().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        logs.push_str(&format!("--- port {port}:\n{text}\n"));
    }
    panic!("redis-server did not start on any of 3 free ports; its logs:\n{logs}");
}
