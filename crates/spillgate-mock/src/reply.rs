//! Scripted replies: what a test tells the mock to answer instead of (or on
//! top of) the built-in OpenAI behaviour.
//!
//! The types are serde-friendly because out-of-process tests (Python) send
//! them as JSON to the control API, e.g.
//! `{"status": 429, "headers": {"retry-after": "1"}, "body": {"type": "auto"}}`.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::config::DEFAULT_STREAM_CHUNKS;

/// One reply the mock sends for one API request.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Reply {
    /// HTTP status; 0 means "the status the built-in behaviour would use" (200).
    pub status: u16,
    /// Extra response headers. They replace built-in headers of the same name.
    /// In JSON either `[["name", "value"], ...]` (keeps duplicates and order)
    /// or `{"name": "value"}`.
    #[serde(deserialize_with = "deserialize_headers")]
    pub headers: Vec<(String, String)>,
    /// What to send as the body.
    pub body: ReplyBody,
    /// Wait this long before sending the response headers (on top of the
    /// backend's configured latency).
    pub delay_ms: u64,
}

/// The body of a [`Reply`].
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ReplyBody {
    /// The built-in behaviour for the request's path (a chat completion, an
    /// SSE stream when the request asked for one, ...). With an error status
    /// (>= 400) the body is an Azure-shaped error object instead, so that
    /// `Reply::status(503)` looks like a real failure.
    #[default]
    Auto,
    /// A JSON document, sent with `content-type: application/json`.
    Json {
        #[serde(default)]
        value: serde_json::Value,
    },
    /// Arbitrary text, e.g. deliberately malformed JSON.
    /// `content_type` defaults to `text/plain; charset=utf-8`.
    Raw {
        #[serde(default)]
        text: String,
        #[serde(default)]
        content_type: Option<String>,
    },
    /// An SSE stream of `chunks` `chat.completion.chunk` frames, `interval_ms`
    /// apart, then a usage frame when the request asked for
    /// `stream_options.include_usage`, then `data: [DONE]` when `done`.
    ///
    /// With `break_after = Some(k)` the server sends `min(k, chunks)` chunks
    /// and then aborts the connection (no usage, no `[DONE]`, no terminating
    /// HTTP chunk) so that the client sees an incomplete body. With
    /// `k < chunks` no chunk carries `finish_reason: "stop"`; with
    /// `k >= chunks` every chunk goes out and the last one does carry it, so
    /// only what follows the content is missing.
    /// `content_type` defaults to `text/event-stream`.
    Stream {
        #[serde(default = "default_chunks")]
        chunks: usize,
        #[serde(default)]
        interval_ms: u64,
        #[serde(default)]
        break_after: Option<usize>,
        #[serde(default)]
        content_type: Option<String>,
        #[serde(default = "default_true")]
        done: bool,
    },
}

fn default_chunks() -> usize {
    DEFAULT_STREAM_CHUNKS
}

fn default_true() -> bool {
    true
}

/// Accept headers as a list of pairs or as a JSON object, because the object
/// form is what a Python test naturally writes.
fn deserialize_headers<'de, D>(de: D) -> Result<Vec<(String, String)>, D::Error>
where
    D: Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        List(Vec<(String, String)>),
        Map(BTreeMap<String, String>),
        Null(()),
    }
    Ok(match Repr::deserialize(de)? {
        Repr::List(list) => list,
        Repr::Map(map) => map.into_iter().collect(),
        Repr::Null(()) => Vec::new(),
    })
}

/// The message Azure OpenAI sends with a 429.
pub(crate) fn throttled_message(retry_after_secs: u64) -> String {
    format!(
        "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version \
         2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. \
         Please retry after {retry_after_secs} seconds."
    )
}

/// Azure's 429 JSON body.
pub(crate) fn throttled_body(retry_after_secs: u64) -> serde_json::Value {
    serde_json::json!({
        "error": {
            "code": "429",
            "message": throttled_message(retry_after_secs),
        }
    })
}

impl Reply {
    /// The built-in behaviour with another status (see [`ReplyBody::Auto`]).
    pub fn status(code: u16) -> Reply {
        Reply {
            status: code,
            ..Reply::default()
        }
    }

    /// A JSON body with the given status.
    pub fn json(code: u16, value: serde_json::Value) -> Reply {
        Reply {
            status: code,
            body: ReplyBody::Json { value },
            ..Reply::default()
        }
    }

    /// A raw text body with the given status and content type.
    pub fn raw(code: u16, text: &str, content_type: Option<&str>) -> Reply {
        Reply {
            status: code,
            body: ReplyBody::Raw {
                text: text.to_owned(),
                content_type: content_type.map(str::to_owned),
            },
            ..Reply::default()
        }
    }

    /// A complete SSE stream of `chunks` chunks, `interval_ms` apart.
    pub fn stream(chunks: usize, interval_ms: u64) -> Reply {
        Reply {
            body: ReplyBody::Stream {
                chunks,
                interval_ms,
                break_after: None,
                content_type: None,
                done: true,
            },
            ..Reply::default()
        }
    }

    /// An SSE stream that aborts the connection after `break_after` chunks.
    pub fn broken_stream(chunks: usize, interval_ms: u64, break_after: usize) -> Reply {
        Reply {
            body: ReplyBody::Stream {
                chunks,
                interval_ms,
                break_after: Some(break_after),
                content_type: None,
                done: true,
            },
            ..Reply::default()
        }
    }

    /// Azure's throttling answer: 429, `Retry-After: N` and the Azure 429 JSON body.
    pub fn throttled(retry_after_secs: u64) -> Reply {
        Reply::json(429, throttled_body(retry_after_secs))
            .with_header("retry-after", &retry_after_secs.to_string())
    }

    /// Add a response header.
    pub fn with_header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Wait `ms` milliseconds before sending the response headers.
    pub fn with_delay_ms(mut self, ms: u64) -> Reply {
        self.delay_ms = ms;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_json_uses_defaults() {
        let r: Reply = serde_json::from_str(r#"{"status": 503}"#).unwrap();
        assert_eq!(r, Reply::status(503));
        let r: Reply = serde_json::from_str("{}").unwrap();
        assert_eq!(r, Reply::default());
    }

    #[test]
    fn headers_accept_map_list_and_null() {
        let r: Reply = serde_json::from_str(r#"{"headers": {"retry-after": "2"}}"#).unwrap();
        assert_eq!(r.headers, vec![("retry-after".into(), "2".into())]);
        let r: Reply = serde_json::from_str(r#"{"headers": [["a", "1"], ["a", "2"]]}"#).unwrap();
        assert_eq!(r.headers.len(), 2);
        let r: Reply = serde_json::from_str(r#"{"headers": null}"#).unwrap();
        assert!(r.headers.is_empty());
    }

    #[test]
    fn stream_body_defaults() {
        let r: Reply = serde_json::from_str(r#"{"body": {"type": "stream"}}"#).unwrap();
        assert_eq!(r, Reply::stream(10, 0));
        let r: Reply =
            serde_json::from_str(r#"{"body": {"type": "stream", "chunks": 3, "break_after": 1}}"#)
                .unwrap();
        assert_eq!(r, Reply::broken_stream(3, 0, 1));
    }

    #[test]
    fn round_trips_through_json() {
        let replies = vec![
            Reply::throttled(3).with_delay_ms(5),
            Reply::raw(200, "{not json", Some("application/json")),
            Reply::broken_stream(4, 1, 2),
            Reply::status(500).with_header("x-a", "b"),
        ];
        let text = serde_json::to_string(&replies).unwrap();
        let back: Vec<Reply> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, replies);
    }

    #[test]
    fn throttled_has_azure_shape() {
        let r = Reply::throttled(7);
        assert_eq!(r.status, 429);
        assert_eq!(r.headers, vec![("retry-after".into(), "7".into())]);
        let ReplyBody::Json { value } = r.body else {
            panic!("json body expected")
        };
        assert_eq!(value["error"]["code"], "429");
        let msg = value["error"]["message"].as_str().unwrap();
        assert!(msg.ends_with("Please retry after 7 seconds."), "{msg}");
    }
}
