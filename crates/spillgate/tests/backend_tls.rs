//! HTTPS backends (what Azure OpenAI is): the gateway verifies the backend's certificate
//! against the system's roots (here a test CA named by `SSL_CERT_FILE`, which is why this
//! test has its own process), speaks HTTP/1.1 or HTTP/2 as the backend picks by ALPN, and
//! keeps its connections for the next requests.
//!
//! The backend is the mock behind a TLS server written here (rustls), which counts the
//! connections it accepts. Needs the `openssl` command to make the certificates; without
//! it the test says SKIPPED and passes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed setup step should abort the test loudly"
)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use spillgate_mock::{free_port, test_certificates, MockBackend, MockConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{crypto::ring, ServerConfig};

/// What the TLS server saw: connections accepted, and of those whose first bytes came,
/// how many began with HTTP/2's preface.
#[derive(Default)]
struct Seen {
    accepted: AtomicUsize,
    http2: AtomicUsize,
    http1: AtomicUsize,
}

/// A TLS server on loopback offering only `alpn`, passing each connection's bytes to
/// `to`.
async fn tls_front(dir: &Path, alpn: &[u8], to: SocketAddr) -> (u16, Arc<Seen>) {
    let certs = CertificateDer::pem_file_iter(dir.join("server.crt"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    config.alpn_protocols = vec![alpn.to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Seen::default());
    let counter = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            counter.accepted.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            let seen = Arc::clone(&counter);
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut backend) = TcpStream::connect(to).await else {
                    return;
                };
                // Which protocol the gateway speaks: HTTP/2 begins with its preface (24
                // bytes; an HTTP/1.1 request line and headers are longer).
                let mut first = [0u8; 24];
                if tls.read_exact(&mut first).await.is_err() {
                    return;
                }
                let counted = if &first == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" {
                    &seen.http2
                } else {
                    &seen.http1
                };
                counted.fetch_add(1, Ordering::SeqCst);
                if backend.write_all(&first).await.is_err() {
                    return;
                }
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut backend).await;
            });
        }
    });
    (port, seen)
}

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
const STREAM: &str = r#"{"messages":[{"role":"user","content":"hi"}],"stream":true}"#;

async fn post(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    body: &'static str,
) -> (u16, String) {
    let req = http::Request::post(format!(
        "http://{addr}/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
    ))
    .header("content-type", "application/json")
    .body(Full::new(Bytes::from_static(body.as_bytes())))
    .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_backends_over_http1_and_http2_keep_their_connections() {
    let dir = std::env::temp_dir().join(format!("spillgate-backend-tls-{}", free_port().unwrap()));
    std::fs::create_dir_all(&dir).unwrap();
    if !test_certificates(&dir).unwrap() {
        eprintln!("SKIPPED: the openssl command is missing or failed");
        return;
    }
    // The system roots, as rustls-native-certs reads them when the gateway starts, are
    // now the test CA.
    std::env::set_var("SSL_CERT_FILE", dir.join("ca.crt"));
    let mock = MockBackend::start(MockConfig::named("m")).await.unwrap();
    let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Full<Bytes>>();
    for alpn in [&b"http/1.1"[..], b"h2"] {
        let (port, seen) = tls_front(&dir, alpn, mock.addr()).await;
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[auth]\nmode = \"none\"\n[admin]\nenabled = false\n\
             [[backends]]\nname = \"m\"\nkind = \"azure\"\nurl = \"https://127.0.0.1:{port}\"\napi_key = \"env:K\"\n"
        );
        let config = spillgate_core::config::load(&text, &|_| Some("key".into()), &|_| {
            Err("no files".into())
        })
        .unwrap();
        let gw = spillgate::server::start(spillgate::app::App::new(config).unwrap())
            .await
            .unwrap();
        let what = String::from_utf8_lossy(alpn);
        for _ in 0..3 {
            let (status, body) = post(&client, gw.addr, CHAT).await;
            assert_eq!(status, 200, "{what}: {body}");
            assert!(body.contains("Hello from m"), "{what}: {body}");
        }
        let (status, body) = post(&client, gw.addr, STREAM).await;
        assert_eq!(status, 200, "{what}: {body}");
        assert!(body.trim_end().ends_with("data: [DONE]"), "{what}: {body}");
        assert!(body.matches("data: ").count() > 3, "{what}: {body}");
        // One request at a time: one connection, kept.
        assert_eq!(seen.accepted.load(Ordering::SeqCst), 1, "{what}");
        let many = (0..6).map(|_| post(&client, gw.addr, CHAT));
        for (status, body) in futures_util::future::join_all(many).await {
            assert_eq!(status, 200, "{what}: {body}");
        }
        // The protocol spoken is the one the backend picked, on every connection.
        let (h2, h1) = (
            seen.http2.load(Ordering::SeqCst),
            seen.http1.load(Ordering::SeqCst),
        );
        if alpn == b"h2" {
            // HTTP/2 carries requests at once on the one connection.
            assert_eq!(seen.accepted.load(Ordering::SeqCst), 1, "{what}");
            assert_eq!((h2, h1), (1, 0), "{what}");
        } else {
            assert_eq!(h2, 0, "{what}");
            assert_eq!(h1, seen.accepted.load(Ordering::SeqCst), "{what}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
