//! The mock as a Microsoft Entra ID token service, for testing backends that take
//! `Authorization: Bearer <token>` instead of an API key.
//!
//! With [`MockIdentity`] set, the mock also answers the two token endpoints a gateway
//! talks to, on loopback, with the response shapes the Azure SDKs parse:
//!
//! * `GET /msi/token?api-version=2019-08-01&resource=...`: the managed identity endpoint
//!   of App Service, Functions and Container Apps (`IDENTITY_ENDPOINT`), which requires
//!   the platform's secret in `x-identity-header` (`IDENTITY_HEADER`);
//! * `POST /{tenant}/oauth2/v2.0/token`: Entra ID's token endpoint for the
//!   client-credentials grant (client secret or federated assertion), under any
//!   authority host pointed at the mock.
//!
//! Its API then accepts bearer tokens it issued (and not revoked), besides the API key if
//! one is expected, so a test can revoke tokens to see a gateway renew them. Identity
//! requests are recorded apart from API requests and do not count as API hits; a switch
//! makes the token endpoints fail (503) to play an identity service that is down.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::state::{lock, RecordedRequest};

/// Token service settings.
#[derive(Clone, Debug)]
pub struct MockIdentity {
    /// The `x-identity-header` value the managed identity endpoint requires (`None`:
    /// any, but the header must be present).
    pub identity_header: Option<String>,
    /// The client secret the client-credentials grant requires (`None`: any secret or
    /// assertion is accepted).
    pub client_secret: Option<String>,
    /// How long issued tokens are valid.
    pub lifetime: Duration,
}

impl Default for MockIdentity {
    fn default() -> Self {
        MockIdentity {
            identity_header: None,
            client_secret: None,
            lifetime: Duration::from_secs(3600),
        }
    }
}

/// What `GET /_mock/state` says about the token service.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct IdentityView {
    /// Token requests received (answered or not).
    pub requests: u64,
    /// Tokens issued.
    pub issued: u64,
    /// Whether the token endpoints answer 503.
    pub failing: bool,
    /// Every token request, as received (secrets included: this is a test double).
    pub recorded: Vec<RecordedRequest>,
}

/// `POST /_mock/identity`: switches the token service.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct IdentityControl {
    /// Token endpoints answer 503 while set.
    pub failing: Option<bool>,
    /// Every token issued so far is refused by the API from now on.
    #[serde(default)]
    pub revoke: bool,
}

pub(crate) struct IdentityState {
    pub cfg: MockIdentity,
    requests: AtomicU64,
    failing: AtomicBool,
    /// Token -> whether it is still accepted.
    issued: Mutex<HashMap<String, bool>>,
    next: AtomicU64,
    recorded: Mutex<Vec<RecordedRequest>>,
}

/// The paths the token service answers.
pub(crate) fn is_token_path(method: &Method, path: &str) -> bool {
    (method == Method::GET && path == "/msi/token")
        || (method == Method::POST && path.ends_with("/oauth2/v2.0/token"))
}

impl IdentityState {
    pub fn new(cfg: MockIdentity) -> IdentityState {
        IdentityState {
            cfg,
            requests: AtomicU64::new(0),
            failing: AtomicBool::new(false),
            issued: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            recorded: Mutex::new(Vec::new()),
        }
    }

    /// Whether `token` was issued here and is still accepted.
    pub fn accepts(&self, token: &str) -> bool {
        lock(&self.issued).get(token).copied().unwrap_or(false)
    }

    pub fn control(&self, c: &IdentityControl) {
        if let Some(f) = c.failing {
            self.failing.store(f, Ordering::Relaxed);
        }
        if c.revoke {
            for accepted in lock(&self.issued).values_mut() {
                *accepted = false;
            }
        }
    }

    pub fn view(&self) -> IdentityView {
        IdentityView {
            requests: self.requests.load(Ordering::Relaxed),
            issued: u64::try_from(lock(&self.issued).len()).unwrap_or(u64::MAX),
            failing: self.failing.load(Ordering::Relaxed),
            recorded: lock(&self.recorded).clone(),
        }
    }

    pub fn reset(&self) {
        self.requests.store(0, Ordering::Relaxed);
        self.failing.store(false, Ordering::Relaxed);
        lock(&self.issued).clear();
        lock(&self.recorded).clear();
    }

    fn issue(&self, mock_name: &str) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let token = format!("mock-entra-token-{mock_name}-{n}-{:016x}", seed(n));
        lock(&self.issued).insert(token.clone(), true);
        token
    }

    /// Answers a token request: `(status, JSON body)`.
    pub fn respond(
        &self,
        mock_name: &str,
        parts: &Parts,
        body: &Bytes,
        record: RecordedRequest,
        now_unix: u64,
    ) -> (StatusCode, serde_json::Value) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        lock(&self.recorded).push(record);
        if self.failing.load(Ordering::Relaxed) {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({
                    "error": "temporarily_unavailable",
                    "error_description": "AADSTS90033: The mock token service is unavailable.",
                    "error_codes": [90033],
                }),
            );
        }
        let lifetime = self.cfg.lifetime.as_secs();
        if parts.method == Method::GET {
            // The managed identity endpoint: the platform secret, then a resource.
            let header = parts
                .headers
                .get("x-identity-header")
                .and_then(|v| v.to_str().ok());
            let header_ok = match (&self.cfg.identity_header, header) {
                (_, None) => false,
                (None, Some(_)) => true,
                (Some(want), Some(got)) => want == got,
            };
            if !header_ok {
                return (
                    StatusCode::UNAUTHORIZED,
                    json!({"statusCode": 401, "message": "Unauthorized: x-identity-header is missing or wrong."}),
                );
            }
            let query: HashMap<String, String> = parts
                .uri
                .query()
                .map(|q| {
                    url_pairs(q.as_bytes())
                        .into_iter()
                        .collect::<HashMap<_, _>>()
                })
                .unwrap_or_default();
            let Some(resource) = query.get("resource") else {
                return (
                    StatusCode::BAD_REQUEST,
                    json!({"statusCode": 400, "message": "resource is required"}),
                );
            };
            let token = self.issue(mock_name);
            return (
                StatusCode::OK,
                json!({
                    "access_token": token,
                    "expires_on": (now_unix + lifetime).to_string(),
                    "resource": resource,
                    "token_type": "Bearer",
                    "client_id": query.get("client_id").cloned().unwrap_or_else(|| "00000000-0000-0000-0000-000000000000".to_string()),
                }),
            );
        }
        // The client-credentials grant.
        let form: HashMap<String, String> = url_pairs(body).into_iter().collect();
        if form.get("grant_type").map(String::as_str) != Some("client_credentials")
            || !form.contains_key("scope")
            || !form.contains_key("client_id")
        {
            return (
                StatusCode::BAD_REQUEST,
                json!({
                    "error": "invalid_request",
                    "error_description": "AADSTS900144: The request body must contain grant_type, client_id and scope.",
                    "error_codes": [900144],
                }),
            );
        }
        let secret_ok = match (&self.cfg.client_secret, form.get("client_secret")) {
            (Some(want), Some(got)) => want == got,
            (Some(_), None) => false,
            (None, got) => got.is_some() || form.contains_key("client_assertion"),
        };
        if !secret_ok {
            return (
                StatusCode::UNAUTHORIZED,
                json!({
                    "error": "invalid_client",
                    "error_description": "AADSTS7000215: Invalid client secret provided. Ensure the secret being sent in the request is the client secret value, not the client secret ID.",
                    "error_codes": [7000215],
                }),
            );
        }
        let token = self.issue(mock_name);
        (
            StatusCode::OK,
            json!({
                "token_type": "Bearer",
                "expires_in": lifetime,
                "ext_expires_in": lifetime,
                "access_token": token,
            }),
        )
    }
}

/// A per-token number that makes issued tokens differ between mocks and runs.
fn seed(n: u64) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    // Truncation is fine: only variety is wanted.
    #[allow(clippy::cast_possible_truncation)]
    let t = t as u64;
    t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `application/x-www-form-urlencoded` pairs (also query strings).
fn url_pairs(input: &[u8]) -> Vec<(String, String)> {
    input
        .split(|b| *b == b'&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut it = p.splitn(2, |b| *b == b'=');
            let k = decode(it.next().unwrap_or_default());
            let v = decode(it.next().unwrap_or_default());
            (k, v)
        })
        .collect()
}

fn decode(s: &[u8]) -> String {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < s.len() => {
                let hex = std::str::from_utf8(&s[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_pairs_decode() {
        let p = url_pairs(b"grant_type=client_credentials&scope=https%3A%2F%2Fcognitiveservices.azure.com%2F.default&x=a+b&y=%zz");
        assert_eq!(p[0], ("grant_type".into(), "client_credentials".into()));
        assert_eq!(
            p[1].1,
            "https://cognitiveservices.azure.com/.default".to_string()
        );
        assert_eq!(p[2].1, "a b");
        assert_eq!(p[3].1, "%zz");
        assert!(is_token_path(&Method::POST, "/tenant/oauth2/v2.0/token"));
        assert!(is_token_path(&Method::GET, "/msi/token"));
        assert!(!is_token_path(&Method::POST, "/v1/chat/completions"));
    }
}
