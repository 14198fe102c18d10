//! The mock's HTTP behaviour as a client sees it.

// Test code: failing loudly is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{eventually, get, post, read_until_end, send, sse_data, start};
use http::{Method, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};
use spillgate_mock::{stream_text, Limits, MockBackend, MockConfig, Reply, ReplyBody};

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

/// `chat(model)` asking for a stream.
fn stream_chat(model: &str) -> Value {
    let mut body = chat(model);
    body["stream"] = json!(true);
    body
}

async fn backend_with(cfg: MockConfig) -> MockBackend {
    MockBackend::start(cfg).await.unwrap()
}

async fn backend(name: &str) -> MockBackend {
    backend_with(MockConfig::named(name)).await
}

/// A backend whose default stream lasts about 5 s (1000 chunks, 5 ms apart),
/// and a stream from it whose response head has arrived.
async fn slow_stream() -> (MockBackend, http::Response<Incoming>) {
    let b = backend_with(MockConfig {
        stream_chunks: 1000,
        chunk_interval: Duration::from_millis(5),
        ..MockConfig::default()
    })
    .await;
    let resp = start(
        Method::POST,
        &format!("{}/v1/chat/completions", b.url()),
        &[],
        &stream_chat("m").to_string(),
    )
    .await;
    (b, resp)
}

#[tokio::test]
async fn default_chat_completion_has_openai_shape() {
    let b = backend("alpha").await;
    assert!(b.url().starts_with("http://127.0.0.1:"));
    assert!(!b.url().ends_with('/'));

    let r = post(&format!("{}/v1/chat/completions", b.url()), &chat("gpt-4o")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-mock-backend"), Some("alpha"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(r.header("x-ratelimit-remaining-requests").is_none());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], "gpt-4o");
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "Hello from alpha");
    let usage = &v["usage"];
    let (p, c) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(p > 0 && c > 0);
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), p + c);

    assert_eq!(b.hits(), 1);
    assert_eq!(b.hits_429(), 0);
    let reqs = b.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].method, "POST");
    assert_eq!(reqs[0].path, "/v1/chat/completions");
    assert_eq!(reqs[0].deployment.as_deref(), Some("gpt-4o"));
    assert_eq!(reqs[0].body, chat("gpt-4o").to_string());
    assert_eq!(reqs[0].header("Content-Type"), Some("application/json"));
    assert_eq!(reqs[0].body_sha256.len(), 64);
}

#[tokio::test]
async fn azure_classic_path_names_the_deployment() {
    let b = backend("az").await;
    let url = format!(
        "{}/openai/deployments/my-dep/chat/completions?api-version=2024-10-21",
        b.url()
    );
    let r = send(
        Method::POST,
        &url,
        &[("api-key", "secret")],
        &json!({"messages": []}).to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["model"], "my-dep");
    let req = &b.requests()[0];
    assert_eq!(req.deployment.as_deref(), Some("my-dep"));
    assert_eq!(req.query.as_deref(), Some("api-version=2024-10-21"));
    assert_eq!(req.header("api-key"), Some("secret"));

    // Azure v1 takes the model from the body.
    let r = post(
        &format!("{}/openai/v1/chat/completions", b.url()),
        &chat("m1"),
    )
    .await;
    assert_eq!(r.json()["model"], "m1");
    assert_eq!(b.requests()[1].deployment.as_deref(), Some("m1"));
}

#[tokio::test]
async fn other_operations() {
    let b = backend("ops").await;
    let r = post(
        &format!("{}/v1/completions", b.url()),
        &json!({"model": "m", "prompt": "x"}),
    )
    .await;
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Hello from ops");

    let r = post(
        &format!("{}/v1/embeddings", b.url()),
        &json!({"model": "e", "input": ["a", "b", "c"]}),
    )
    .await;
    let v = r.json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(data[2]["index"], 2);
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 8);
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    // The SDKs ask for base64: 8 little-endian f32 = 32 bytes = 44 base64 chars.
    let r = post(
        &format!("{}/v1/embeddings", b.url()),
        &json!({"model": "e", "input": "a", "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(r.json()["data"][0]["embedding"].as_str().unwrap().len(), 44);

    let r = post(
        &format!("{}/v1/responses", b.url()),
        &json!({"model": "r", "input": "x"}),
    )
    .await;
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], "r");
    assert_eq!(v["output"][0]["content"][0]["text"], "Hello from ops");
    assert!(v["usage"]["total_tokens"].as_u64().unwrap() > 0);

    for path in ["/v1/models", "/openai/models"] {
        let r = get(&format!("{}{path}", b.url())).await;
        let v = r.json();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["object"], "model");
    }

    let r = post(&format!("{}/v1/whatever", b.url()), &json!({})).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json(), json!({"ok": true}));
    assert_eq!(r.header("x-mock-backend"), Some("ops"));
    assert_eq!(b.hits(), 7);
}

#[tokio::test]
async fn default_stream_has_chunks_and_done() {
    let b = backend_with(MockConfig {
        name: "s".into(),
        stream_chunks: 4,
        chunk_interval: Duration::from_millis(1),
        ..MockConfig::default()
    })
    .await;
    let r = post(
        &format!("{}/v1/chat/completions", b.url()),
        &stream_chat("gpt-4o"),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("x-mock-backend"), Some("s"));
    let frames = sse_data(&r.text());
    assert_eq!(frames.len(), 5, "{frames:?}");
    assert_eq!(frames[4], "[DONE]");
    let chunks: Vec<Value> = frames[..4]
        .iter()
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    let mut text = String::new();
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "gpt-4o");
        assert_eq!(c["id"], chunks[0]["id"]);
        assert_eq!(c["choices"][0]["index"], 0);
        let finish = &c["choices"][0]["finish_reason"];
        assert_eq!(*finish, if i == 3 { json!("stop") } else { Value::Null });
        text.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap());
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(text, stream_text("s", 4));
    assert!(c_has_no_usage(&chunks));
    assert!(eventually(|| b.streams_completed() == 1).await);
    assert_eq!(b.streams_cancelled(), 0);
}

fn c_has_no_usage(chunks: &[Value]) -> bool {
    chunks.iter().all(|c| c.get("usage").is_none())
}

#[tokio::test]
async fn include_usage_adds_a_usage_frame() {
    let b = backend_with(MockConfig {
        stream_chunks: 2,
        ..MockConfig::default()
    })
    .await;
    let mut body = stream_chat("m");
    body["stream_options"] = json!({"include_usage": true});
    let r = post(&format!("{}/v1/chat/completions", b.url()), &body).await;
    let frames = sse_data(&r.text());
    assert_eq!(frames.len(), 4, "{frames:?}");
    assert_eq!(frames[3], "[DONE]");
    let usage: Value = serde_json::from_str(&frames[2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 2);
    assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn script_runs_in_order_then_default() {
    let b = backend("sc").await;
    let url = format!("{}/v1/chat/completions", b.url());
    b.push_script(vec![
        Reply::status(500),
        Reply::throttled(3),
        Reply::json(418, json!({"teapot": true})).with_header("x-extra", "1"),
        Reply::raw(200, "{broken", Some("application/json")),
    ]);
    let r = post(&url, &chat("m")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.json()["error"]["code"], "500");
    assert_eq!(r.header("x-mock-backend"), Some("sc"));

    let r = post(&url, &chat("m")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("3"));
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("Please retry after 3 seconds."), "{msg}");

    let r = post(&url, &chat("m")).await;
    assert_eq!(r.status.as_u16(), 418);
    assert_eq!(r.header("x-extra"), Some("1"));
    assert_eq!(r.json(), json!({"teapot": true}));

    let r = post(&url, &chat("m")).await;
    assert_eq!(r.text(), "{broken");

    // Script exhausted: built-in behaviour.
    let r = post(&url, &chat("m")).await;
    assert_eq!(r.json()["object"], "chat.completion");

    // A default reply applies until cleared; the script still comes first.
    b.set_default(Some(Reply::status(503)));
    b.push_script(vec![Reply::status(0).with_header("x-first", "yes")]);
    let r = post(&url, &chat("m")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-first"), Some("yes"));
    for _ in 0..2 {
        assert_eq!(post(&url, &chat("m")).await.status.as_u16(), 503);
    }
    b.set_default(None);
    assert_eq!(post(&url, &chat("m")).await.status, StatusCode::OK);
    assert_eq!(b.hits(), 9);
    assert_eq!(b.hits_429(), 1);

    b.reset();
    assert_eq!(b.hits(), 0);
    assert_eq!(b.hits_429(), 0);
    assert!(b.requests().is_empty());
}

#[tokio::test]
async fn limiter_answers_429_with_azure_headers() {
    let b = backend_with(MockConfig {
        name: "lim".into(),
        // 12 rpm over 10 s windows: 2 requests per window.
        limits: Some(Limits {
            rpm: 12,
            tpm: 1_000_000,
            window: Duration::from_secs(10),
        }),
        ..MockConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", b.url());
    let r = post(&url, &chat("a")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("2"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("1"));
    let reset: u64 = r
        .header("x-ratelimit-reset-requests")
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=10).contains(&reset));
    assert!(r.header("x-ratelimit-remaining-tokens").is_some());
    assert!(r.header("x-ratelimit-limit-tokens").is_some());
    assert!(r.header("x-ratelimit-reset-tokens").is_some());

    assert_eq!(post(&url, &chat("a")).await.status, StatusCode::OK);
    let r = post(&url, &chat("a")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("x-mock-backend"), Some("lim"));
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry));
    let retry_ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!(retry_ms > 0 && retry_ms <= 10_000);
    assert_eq!(r.json()["error"]["code"], "429");
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));

    // Other deployments have their own allowance; scripts bypass the limiter.
    assert_eq!(post(&url, &chat("b")).await.status, StatusCode::OK);
    b.push_script(vec![Reply::status(0)]);
    assert_eq!(post(&url, &chat("a")).await.status, StatusCode::OK);
    assert_eq!(b.hits(), 5);
    assert_eq!(b.hits_429(), 1);
}

#[tokio::test]
async fn limiter_counts_tokens() {
    let b = backend_with(MockConfig {
        // 600 tpm over 10 s: 100 tokens per window.
        limits: Some(Limits {
            rpm: 1000,
            tpm: 600,
            window: Duration::from_secs(10),
        }),
        ..MockConfig::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", b.url());
    let mut body = chat("t");
    body["max_tokens"] = json!(60);
    let r = post(&url, &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let remaining: u64 = r
        .header("x-ratelimit-remaining-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!(remaining < 40, "{remaining}");
    let r = post(&url, &body).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    // A smaller request still fits.
    body["max_tokens"] = json!(1);
    assert_eq!(post(&url, &body).await.status, StatusCode::OK);
}

#[tokio::test]
async fn break_after_leaves_the_body_incomplete() {
    let b = backend("br").await;
    b.push_script(vec![Reply::broken_stream(5, 0, 2)]);
    let resp = start(
        Method::POST,
        &format!("{}/v1/chat/completions", b.url()),
        &[],
        &chat("m").to_string(),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (data, errored) = read_until_end(resp).await;
    assert!(errored, "the body must end with an error: {data:?}");
    let frames = sse_data(&data);
    assert_eq!(frames.len(), 2, "{frames:?}");
    assert!(!data.contains("[DONE]"));
    assert!(!data.contains("\"stop\""));
    // A deliberate break is neither completed nor cancelled.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(b.streams_completed(), 0);
    assert_eq!(b.streams_cancelled(), 0);
}

#[tokio::test]
async fn scripted_stream_without_done() {
    let b = backend("nd").await;
    b.push_script(vec![Reply {
        body: ReplyBody::Stream {
            chunks: 2,
            interval_ms: 0,
            break_after: None,
            content_type: Some("text/plain".into()),
            done: false,
        },
        ..Reply::default()
    }]);
    let r = post(&format!("{}/v1/chat/completions", b.url()), &chat("m")).await;
    assert_eq!(r.header("content-type"), Some("text/plain"));
    let frames = sse_data(&r.text());
    assert_eq!(frames.len(), 2);
    assert!(eventually(|| b.streams_completed() == 1).await);
}

#[tokio::test]
async fn client_going_away_cancels_the_stream() {
    let (b, resp) = slow_stream().await;
    let mut body = resp.into_body();
    let first = http_body_util::BodyExt::frame(&mut body).await;
    assert!(first.is_some());
    drop(body);
    assert!(
        eventually(|| b.streams_cancelled() == 1).await,
        "cancelled={} completed={}",
        b.streams_cancelled(),
        b.streams_completed()
    );
    assert_eq!(b.streams_completed(), 0);
}

#[tokio::test]
async fn wrong_api_key_gets_401() {
    let b = backend_with(MockConfig {
        expect_api_key: Some("k1".into()),
        ..MockConfig::default()
    })
    .await;
    let url = format!("{}/openai/deployments/d/chat/completions", b.url());
    let body = chat("m").to_string();
    let r = send(Method::POST, &url, &[], &body).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["error"]["code"], "401");
    let r = send(Method::POST, &url, &[("api-key", "nope")], &body).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(Method::POST, &url, &[("api-key", "k1")], &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = send(Method::POST, &url, &[("authorization", "Bearer k1")], &body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(b.hits(), 4);
}

#[tokio::test]
async fn control_api_over_http() {
    let b = backend("ctl").await;
    let base = b.url();
    let script = json!([
        {"status": 429, "headers": {"retry-after": "2"}},
        {"body": {"type": "json", "value": {"x": 1}}},
        {"body": {"type": "stream", "chunks": 3, "break_after": 1}}
    ]);
    let r = post(&format!("{base}/_mock/script"), &script).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let r = post(&format!("{base}/_mock/default"), &json!({"status": 502})).await;
    assert_eq!(r.status, StatusCode::OK);

    let url = format!("{base}/v1/chat/completions");
    let r = post(&url, &chat("m")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("2"));
    assert_eq!(post(&url, &chat("m")).await.json(), json!({"x": 1}));
    let resp = start(Method::POST, &url, &[], &chat("m").to_string()).await;
    let (_, errored) = read_until_end(resp).await;
    assert!(errored);
    assert_eq!(post(&url, &chat("m")).await.status.as_u16(), 502);

    let r = post(&format!("{base}/_mock/default"), &Value::Null).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(post(&url, &chat("m")).await.status, StatusCode::OK);
    // An empty body clears the default too.
    post(&format!("{base}/_mock/default"), &json!({"status": 500})).await;
    let r = send(Method::POST, &format!("{base}/_mock/default"), &[], "").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(post(&url, &chat("m")).await.status, StatusCode::OK);

    let state = get(&format!("{base}/_mock/state")).await.json();
    assert_eq!(state["name"], "ctl");
    assert_eq!(state["hits"], 6);
    assert_eq!(state["hits_429"], 1);
    assert_eq!(state["streams_cancelled"], 0);
    assert_eq!(state["requests"].as_array().unwrap().len(), 6);
    assert_eq!(state["requests"][0]["deployment"], "m");

    let r = post(&format!("{base}/_mock/script"), &json!({"status": "bad"})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        get(&format!("{base}/_mock/nope")).await.status,
        StatusCode::NOT_FOUND
    );

    let r = post(&format!("{base}/_mock/reset"), &json!({})).await;
    assert_eq!(r.status, StatusCode::OK);
    let state = get(&format!("{base}/_mock/state")).await.json();
    assert_eq!(state["hits"], 0);
    assert_eq!(state["requests"], json!([]));
    // Control requests are not API hits.
    assert_eq!(b.hits(), 0);
}

#[tokio::test]
async fn record_bodies_off_keeps_the_hash() {
    let b = backend_with(MockConfig {
        record_bodies: false,
        ..MockConfig::default()
    })
    .await;
    post(&format!("{}/v1/chat/completions", b.url()), &chat("m")).await;
    let req = &b.requests()[0];
    assert!(req.body.is_empty());
    // sha256 of the exact bytes sent, computed independently.
    use sha2::Digest;
    let expected = sha2::Sha256::digest(chat("m").to_string().as_bytes());
    let expected: String = expected.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(req.body_sha256, expected);
    assert_eq!(req.deployment.as_deref(), Some("m"));

    // With recording off nothing more is kept, but hits still count.
    b.set_recording(false);
    post(&format!("{}/v1/chat/completions", b.url()), &chat("m")).await;
    assert_eq!(b.requests().len(), 1);
    assert_eq!(b.hits(), 2);
}

#[tokio::test]
async fn latency_and_delay_are_applied() {
    let b = backend_with(MockConfig {
        latency: Duration::from_millis(30),
        ..MockConfig::default()
    })
    .await;
    b.push_script(vec![Reply::status(0).with_delay_ms(30)]);
    let url = format!("{}/v1/chat/completions", b.url());
    let t = std::time::Instant::now();
    post(&url, &chat("m")).await;
    assert!(t.elapsed() >= Duration::from_millis(60));
    let t = std::time::Instant::now();
    post(&url, &chat("m")).await;
    let e = t.elapsed();
    assert!(
        e >= Duration::from_millis(30) && e < Duration::from_millis(60),
        "{e:?}"
    );
}

#[tokio::test]
async fn serves_http2_with_prior_knowledge() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    let b = backend("h2").await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("{}/v1/chat/completions", b.url()))
        .body(Full::new(Bytes::from(chat("m").to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello from h2");
}

#[tokio::test]
async fn shutdown_stops_serving() {
    let b = backend("gone").await;
    let addr = b.addr();
    assert_eq!(
        get(&format!("{}/v1/models", b.url())).await.status,
        StatusCode::OK
    );
    b.shutdown().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());

    // Dropping a backend also stops it, including streams in progress.
    let (b, resp) = slow_stream().await;
    drop(b);
    let (data, errored) = tokio::time::timeout(Duration::from_secs(5), read_until_end(resp))
        .await
        .unwrap();
    assert!(errored);
    assert!(!data.contains("[DONE]"));
}

#[tokio::test]
async fn token_service_issues_tokens_its_api_accepts() {
    let b = backend_with(MockConfig {
        identity: Some(spillgate_mock::MockIdentity {
            identity_header: Some("platform-secret".into()),
            client_secret: Some("sp-secret".into()),
            lifetime: Duration::from_secs(600),
        }),
        ..MockConfig::named("idp")
    })
    .await;
    let base = b.url();
    let api = format!("{base}/openai/deployments/d/chat/completions");
    let body = chat("m").to_string();
    // Nothing but an issued token gets through.
    let r = send(Method::POST, &api, &[], &body).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(
        Method::POST,
        &api,
        &[("authorization", "Bearer made-up")],
        &body,
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);

    // The App Service-style managed identity endpoint wants its header.
    let msi = format!(
        "{base}/msi/token?api-version=2019-08-01&resource=https://cognitiveservices.azure.com"
    );
    let r = send(Method::GET, &msi, &[], "").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(
        Method::GET,
        &msi,
        &[("x-identity-header", "platform-secret")],
        "",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let j = r.json();
    assert_eq!(j["token_type"], "Bearer");
    assert_eq!(j["resource"], "https://cognitiveservices.azure.com");
    let expires: u64 = j["expires_on"].as_str().unwrap().parse().unwrap();
    assert!(expires > 1_700_000_000);
    let msi_token = j["access_token"].as_str().unwrap().to_string();

    // The client-credentials grant wants the right secret.
    let grant = |secret: &str| {
        format!("grant_type=client_credentials&client_id=app&client_secret={secret}&scope=https%3A%2F%2Fcognitiveservices.azure.com%2F.default")
    };
    let token_url = format!("{base}/tenant-1/oauth2/v2.0/token");
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let r = send(Method::POST, &token_url, &form, &grant("wrong")).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["error"], "invalid_client");
    let r = send(Method::POST, &token_url, &form, &grant("sp-secret")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json()["expires_in"], 600);
    let sp_token = r.json()["access_token"].as_str().unwrap().to_string();
    assert_ne!(sp_token, msi_token);

    for t in [&msi_token, &sp_token] {
        let auth = format!("Bearer {t}");
        let r = send(Method::POST, &api, &[("authorization", &auth)], &body).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let state = b.state();
    let id = state.identity.unwrap();
    assert_eq!((id.requests, id.issued), (4, 2));
    assert_eq!(state.hits, 4, "token requests are not API hits");

    // Revoked tokens are refused; a failing service answers 503.
    let r = post(
        &format!("{base}/_mock/identity"),
        &json!({"revoke": true, "failing": true}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let auth = format!("Bearer {sp_token}");
    let r = send(Method::POST, &api, &[("authorization", &auth)], &body).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(Method::POST, &token_url, &form, &grant("sp-secret")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(b.identity_requests().len(), 5);
}
