//! Client authentication: the "subscription keys" of the APIM seeds.
//!
//! The official SDKs send the key as `api-key` (Azure clients) or `Authorization: Bearer`
//! (OpenAI clients); APIM users may still send `Ocp-Apim-Subscription-Key`. All are
//! accepted and none is ever forwarded upstream. Keys are compared in constant time so the
//! comparison does not reveal how much of a guess was right.

use std::sync::Arc;

use crate::h1::{Common, Values};
use sha2::{Digest, Sha256};
use spillgate_core::config::ClientKey;
use subtle::ConstantTimeEq;

/// The configured client keys, or none when authentication is off. Only SHA-256 digests
/// are kept: comparisons are fixed-length (so timing reveals neither content nor length)
/// and a debug print of the gateway's state cannot show a key.
#[derive(Clone)]
pub struct ClientKeys {
    keys: Option<Vec<(Arc<str>, [u8; 32])>>,
}

impl std::fmt::Debug for ClientKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.keys {
            None => f.write_str("ClientKeys(none)"),
            Some(k) => {
                let names: Vec<&str> = k.iter().map(|(n, _)| &**n).collect();
                write!(f, "ClientKeys({names:?})")
            }
        }
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Who a request came from, for logs (the key's source name, never the key).
#[derive(Debug, Clone)]
pub enum Client {
    Anonymous,
    /// A configured client key's name, and the key's place in the list (from 1).
    Named(Arc<str>, u32),
}

impl Client {
    pub fn name(&self) -> &str {
        match self {
            Client::Anonymous => "-",
            Client::Named(n, _) => n,
        }
    }

    /// 0 for an anonymous client, else the key's place in the configured list (from 1):
    /// stable for a config snapshot, for keys of metric handles.
    pub fn index(&self) -> u32 {
        match self {
            Client::Anonymous => 0,
            Client::Named(_, i) => *i,
        }
    }

    /// The client as a metrics label value (its name shared, not copied).
    pub fn label(&self) -> crate::metrics::Label {
        match self {
            Client::Anonymous => "-".into(),
            Client::Named(n, _) => n.into(),
        }
    }
}

/// Headers that carry client credentials; removed before forwarding.
pub const CLIENT_CREDENTIAL_HEADERS: [&str; 3] =
    ["authorization", "api-key", "ocp-apim-subscription-key"];

// Statics, not constants: the values found borrow the name they were found by.
static HEADER_API_KEY: Common = Common::new("api-key");
static HEADER_AUTHORIZATION: Common = Common::new("authorization");
static HEADER_APIM_KEY: http::HeaderName =
    http::HeaderName::from_static("ocp-apim-subscription-key");

impl ClientKeys {
    pub fn none() -> ClientKeys {
        ClientKeys { keys: None }
    }

    pub fn new(keys: &[ClientKey]) -> ClientKeys {
        ClientKeys {
            keys: Some(
                keys.iter()
                    .map(|k| (Arc::clone(&k.name), digest(k.key.expose().as_bytes())))
                    .collect(),
            ),
        }
    }

    /// The client that sent these headers, or `None` when no configured key matches.
    pub fn authenticate(&self, headers: &impl Values) -> Option<Client> {
        let Some(keys) = &self.keys else {
            return Some(Client::Anonymous);
        };
        let presented = headers
            .first(&HEADER_API_KEY)
            .or_else(|| {
                headers.first(&HEADER_AUTHORIZATION).and_then(|v| {
                    (v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ")).then(|| &v[7..])
                })
            })
            .or_else(|| headers.values(&HEADER_APIM_KEY).next())?;
        let presented = digest(presented.trim_ascii());
        let mut found = None;
        // Check every key, without an early exit, so timing does not tell which matched.
        for (i, (name, key)) in (1u32..).zip(keys) {
            if bool::from(key.ct_eq(&presented)) {
                found = Some(Client::Named(Arc::clone(name), i));
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;
    use spillgate_core::config::Secret;

    fn keys() -> ClientKeys {
        ClientKeys::new(&[
            ClientKey {
                name: Arc::from("TEAM_A"),
                key: Secret::new("key-a".into()),
            },
            ClientKey {
                name: Arc::from("TEAM_B"),
                key: Secret::new("key-b".into()),
            },
        ])
    }

    fn h(name: &'static str, value: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(name, value.parse().unwrap());
        m
    }

    #[test]
    fn accepts_every_sdk_form() {
        let k = keys();
        assert_eq!(
            k.authenticate(&h("api-key", "key-a")).unwrap().name(),
            "TEAM_A"
        );
        assert_eq!(
            k.authenticate(&h("authorization", "Bearer key-b"))
                .unwrap()
                .name(),
            "TEAM_B"
        );
        assert_eq!(
            k.authenticate(&h("authorization", "bearer key-b"))
                .unwrap()
                .name(),
            "TEAM_B"
        );
        assert_eq!(
            k.authenticate(&h("ocp-apim-subscription-key", "key-a"))
                .unwrap()
                .name(),
            "TEAM_A"
        );
    }

    #[test]
    fn rejects_wrong_missing_and_partial_keys() {
        let k = keys();
        assert!(k.authenticate(&HeaderMap::new()).is_none());
        assert!(k.authenticate(&h("api-key", "key-")).is_none());
        assert!(k.authenticate(&h("api-key", "key-c")).is_none());
        assert!(k.authenticate(&h("authorization", "Basic key-a")).is_none());
        assert!(k.authenticate(&h("authorization", "Bearer ")).is_none());
    }

    #[test]
    fn debug_never_shows_a_key() {
        let shown = format!("{:?}", keys());
        assert!(
            !shown.contains("key-a") && !shown.contains("key-b"),
            "{shown}"
        );
        assert!(shown.contains("TEAM_A"));
    }

    #[test]
    fn none_mode_lets_everyone_in() {
        assert!(matches!(
            ClientKeys::none().authenticate(&HeaderMap::new()),
            Some(Client::Anonymous)
        ));
    }
}
