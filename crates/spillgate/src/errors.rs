//! Errors the gateway itself answers with, in OpenAI's JSON error shape
//! (`{"error":{"message","type","param","code"}}`), so the official SDKs raise their usual
//! exception types with a readable message.

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::{header, HeaderValue, StatusCode};

/// A response the gateway makes up (as opposed to one a backend sent).
#[derive(Debug, Clone)]
pub struct GatewayError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<Duration>,
}

impl GatewayError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        GatewayError {
            status,
            kind,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "Access denied: a valid spillgate client key is required in the `api-key` header or as `Authorization: Bearer <key>`.",
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message,
        )
    }

    pub fn with_retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    pub fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.code,
            }
        });
        let mut resp = Response::new(Body::from(body.to_string()));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(d) = self.retry_after {
            // Whole seconds, rounded up so a client never comes back early; the exact
            // value in milliseconds for clients (like the OpenAI SDKs) that read it.
            let ms = d.as_millis().max(1);
            let secs = ms.div_ceil(1000);
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                h.insert(header::RETRY_AFTER, v);
            }
            if let Ok(v) = HeaderValue::from_str(&ms.to_string()) {
                h.insert("retry-after-ms", v);
            }
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn renders_openai_shape_and_retry_headers() {
        let r = GatewayError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "all_backends_throttled",
            "busy",
        )
        .with_retry_after(Duration::from_millis(2300))
        .into_response();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "3");
        assert_eq!(r.headers()["retry-after-ms"], "2300");
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "all_backends_throttled");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["message"], "busy");
    }
}
