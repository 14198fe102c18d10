//! The `spillgate-mock` binary as an out-of-process test would use it.

// Test code: failing loudly is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{get, post, send};
use http::{Method, StatusCode};
use serde_json::json;

#[tokio::test]
async fn binary_prints_its_url_and_serves_the_control_api() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_spillgate-mock"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--name",
            "proc",
            "--stream-chunks",
            "3",
            "--rpm",
            "6",
            "--window-secs",
            "10",
            "--expect-api-key-env",
            "SPILLGATE_MOCK_TEST_KEY",
            "--no-record-bodies",
        ])
        .env("SPILLGATE_MOCK_TEST_KEY", "sekret")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let url = line
        .trim_end()
        .strip_prefix("spillgate-mock listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let chat = json!({"model": "d", "messages": []}).to_string();
    let api = format!("{url}/v1/chat/completions");
    let r = send(Method::POST, &api, &[], &chat).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(Method::POST, &api, &[("api-key", "sekret")], &chat).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-mock-backend"), Some("proc"));
    // 6 rpm over 10 s: one request per window.
    let r = send(Method::POST, &api, &[("api-key", "sekret")], &chat).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);

    let r = post(&format!("{url}/_mock/script"), &json!([{"status": 503}])).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = send(Method::POST, &api, &[("api-key", "sekret")], &chat).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);

    let state = get(&format!("{url}/_mock/state")).await.json();
    assert_eq!(state["name"], "proc");
    assert_eq!(state["hits"], 4);
    assert_eq!(state["hits_429"], 1);
    assert_eq!(state["requests"][1]["body"], "");

    stop(&mut child).await;
}

/// Stop the child the way a test harness would (SIGTERM where available) and
/// check that it exits promptly.
async fn stop(child: &mut std::process::Child) {
    #[cfg(unix)]
    {
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        for _ in 0..200 {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "exit status {status}");
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    #[cfg(unix)]
    panic!("spillgate-mock did not exit on SIGTERM");
}
