//! A minimal HTTP client for the tests, on hyper-util's legacy client.

#![allow(dead_code)]

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

pub async fn start(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> http::Response<Incoming> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if !body.is_empty() {
        req = req.header("content-type", "application/json");
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    client().request(req).await.unwrap()
}

pub async fn send(method: Method, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let resp = start(method, url, headers, body).await;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Resp {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post(url: &str, body: &Value) -> Resp {
    send(Method::POST, url, &[], &body.to_string()).await
}

pub async fn get(url: &str) -> Resp {
    send(Method::GET, url, &[], "").await
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| {
            frame
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data frame: {frame:?}"))
                .to_owned()
        })
        .collect()
}

/// Read a streaming body frame by frame; returns the data received and
/// whether the body ended with an error instead of cleanly.
pub async fn read_until_end(resp: http::Response<Incoming>) -> (String, bool) {
    let mut body = resp.into_body();
    let mut data = Vec::new();
    loop {
        match body.frame().await {
            None => return (String::from_utf8(data).unwrap(), false),
            Some(Err(_)) => return (String::from_utf8(data).unwrap(), true),
            Some(Ok(frame)) => {
                if let Ok(chunk) = frame.into_data() {
                    data.extend_from_slice(&chunk);
                }
            }
        }
    }
}

/// Wait (briefly) until `cond` holds.
pub async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if cond() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    cond()
}
