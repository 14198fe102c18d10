//! The built-in OpenAI / Azure OpenAI behaviour: which deployment and
//! operation a path names, what a request body asks for, and response bodies
//! that the official SDKs accept.

use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// Dimensions of the generated embeddings.
const EMBEDDING_DIMS: usize = 8;

/// Completion tokens reported when `max_tokens` is absent (OpenAI's legacy default).
const DEFAULT_MAX_TOKENS: u64 = 16;

/// Where a request path points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Route {
    /// Deployment from an Azure classic path (`/openai/deployments/{d}/...`).
    pub deployment: Option<String>,
    /// The operation, e.g. `chat/completions`, without surrounding slashes.
    pub operation: String,
}

pub(crate) fn route(path: &str) -> Route {
    let path = path.trim_end_matches('/');
    if let Some(rest) = path.strip_prefix("/openai/deployments/") {
        let (deployment, operation) = rest.split_once('/').unwrap_or((rest, ""));
        return Route {
            deployment: Some(deployment.to_owned()),
            operation: operation.to_owned(),
        };
    }
    let operation = ["/openai/v1/", "/v1/", "/openai/"]
        .iter()
        .find_map(|prefix| path.strip_prefix(prefix))
        .unwrap_or_else(|| path.trim_start_matches('/'));
    Route {
        deployment: None,
        operation: operation.to_owned(),
    }
}

/// The fields of a request body that change the mock's answer. Everything
/// else is ignored, which keeps parsing cheap.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Probe {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub input: Option<Value>,
    pub encoding_format: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct StreamOptions {
    pub include_usage: Option<bool>,
}

impl Probe {
    /// Parse what is parseable; a body that is not a JSON object is treated
    /// as empty because the mock answers anyway.
    pub fn parse(body: &[u8]) -> Probe {
        if body.is_empty() {
            return Probe::default();
        }
        serde_json::from_slice(body).unwrap_or_default()
    }

    pub fn streaming(&self) -> bool {
        self.stream == Some(true)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    pub fn max_tokens(&self) -> u64 {
        self.max_tokens
            .or(self.max_completion_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS)
    }
}

/// Tokens the limiter charges for a request: a rough prompt size plus the
/// completion budget, as Azure estimates before running the model.
pub(crate) fn estimated_tokens(body_len: usize, probe: &Probe) -> u64 {
    prompt_tokens(body_len).saturating_add(probe.max_tokens())
}

/// Prompt tokens reported in `usage`: about four bytes per token.
pub(crate) fn prompt_tokens(body_len: usize) -> u64 {
    u64::try_from(body_len / 4).unwrap_or(u64::MAX).max(1)
}

fn text_tokens(text: &str) -> u64 {
    u64::try_from(text.len().div_ceil(4))
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The answer of the non-streaming operations.
pub(crate) fn hello(name: &str) -> String {
    format!("Hello from {name}")
}

/// Content of SSE chunk `i`. Chunk 0 carries the greeting so that a stream
/// is attributable to a backend; later chunks carry their index so that a
/// test can spot lost or reordered chunks.
pub(crate) fn stream_piece(name: &str, i: usize) -> String {
    if i == 0 {
        hello(name)
    } else {
        format!(" {i}")
    }
}

/// The text a client assembles from a complete stream of `chunks` chunks.
pub fn stream_text(name: &str, chunks: usize) -> String {
    (0..chunks).map(|i| stream_piece(name, i)).collect()
}

fn usage(prompt: u64, completion: u64) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt.saturating_add(completion),
    })
}

/// What every generated response needs to know about its request.
pub(crate) struct Ctx<'a> {
    pub name: &'a str,
    pub model: &'a str,
    pub id: u64,
    pub created: u64,
    pub body_len: usize,
}

pub(crate) fn chat_completion(ctx: &Ctx<'_>) -> Value {
    let content = hello(ctx.name);
    let completion = text_tokens(&content);
    json!({
        "id": format!("chatcmpl-mock{}", ctx.id),
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": null,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content, "refusal": null},
            "logprobs": null,
            "finish_reason": "stop",
        }],
        "usage": usage(prompt_tokens(ctx.body_len), completion),
    })
}

pub(crate) fn completion(ctx: &Ctx<'_>) -> Value {
    let text = hello(ctx.name);
    let completion = text_tokens(&text);
    json!({
        "id": format!("cmpl-mock{}", ctx.id),
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "stop"}],
        "usage": usage(prompt_tokens(ctx.body_len), completion),
    })
}

pub(crate) fn response(ctx: &Ctx<'_>) -> Value {
    let text = hello(ctx.name);
    let input = prompt_tokens(ctx.body_len);
    let output = text_tokens(&text);
    json!({
        "id": format!("resp_mock{}", ctx.id),
        "object": "response",
        "created_at": ctx.created,
        "status": "completed",
        "model": ctx.model,
        "output": [{
            "type": "message",
            "id": format!("msg_mock{}", ctx.id),
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }],
        "parallel_tool_calls": false,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input.saturating_add(output),
        },
    })
}

/// How many embeddings an `input` asks for: a string or a token array is one,
/// an array of strings or of token arrays is one per element.
fn embedding_inputs(input: Option<&Value>) -> Vec<Value> {
    match input {
        Some(Value::Array(items))
            if !items.is_empty() && items.iter().all(|v| v.is_string() || v.is_array()) =>
        {
            items.clone()
        }
        Some(v) => vec![v.clone()],
        None => vec![Value::Null],
    }
}

/// A deterministic vector derived from the input, so that different inputs
/// give different embeddings and a test can detect mixed-up responses.
fn embedding_vector(input: &Value) -> [f32; EMBEDDING_DIMS] {
    let digest = Sha256::digest(input.to_string().as_bytes());
    let mut out = [0.0f32; EMBEDDING_DIMS];
    for (slot, byte) in out.iter_mut().zip(digest.iter()) {
        *slot = f32::from(*byte) / 255.0;
    }
    out
}

pub(crate) fn embeddings(ctx: &Ctx<'_>, probe: &Probe) -> Value {
    let base64 = probe.encoding_format.as_deref() == Some("base64");
    let data: Vec<Value> = embedding_inputs(probe.input.as_ref())
        .iter()
        .enumerate()
        .map(|(index, input)| {
            let vector = embedding_vector(input);
            let embedding = if base64 {
                // The SDKs ask for base64 by default: little-endian f32s.
                let bytes: Vec<u8> = vector.iter().flat_map(|f| f.to_le_bytes()).collect();
                Value::String(base64_encode(&bytes))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let prompt = prompt_tokens(ctx.body_len);
    json!({
        "object": "list",
        "data": data,
        "model": ctx.model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    })
}

pub(crate) fn model_list(created: u64, name: &str) -> Value {
    let models: Vec<Value> = ["gpt-4o", "gpt-4o-mini", "text-embedding-3-small"]
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": created, "owned_by": name}))
        .collect();
    json!({"object": "list", "data": models})
}

/// One SSE `chat.completion.chunk` frame's JSON.
pub(crate) fn chat_chunk(ctx: &Ctx<'_>, i: usize, last: bool) -> Value {
    let content = stream_piece(ctx.name, i);
    let delta = if i == 0 {
        json!({"role": "assistant", "content": content})
    } else {
        json!({"content": content})
    };
    json!({
        "id": format!("chatcmpl-mock{}", ctx.id),
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": null,
        "choices": [{
            "index": 0,
            "delta": delta,
            "logprobs": null,
            "finish_reason": if last { Value::from("stop") } else { Value::Null },
        }],
    })
}

/// The final usage frame sent when the request asked for `include_usage`.
pub(crate) fn chat_usage_chunk(ctx: &Ctx<'_>, chunks: usize) -> Value {
    json!({
        "id": format!("chatcmpl-mock{}", ctx.id),
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": null,
        "choices": [],
        "usage": usage(
            prompt_tokens(ctx.body_len),
            u64::try_from(chunks).unwrap_or(u64::MAX),
        ),
    })
}

/// Azure-shaped error body for an error status.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    json!({"error": {"code": status.to_string(), "message": message}})
}

pub(crate) const UNAUTHORIZED_MESSAGE: &str = "Access denied due to invalid subscription key or \
     wrong API endpoint. Make sure to provide a valid key for an active subscription and use a \
     correct regional API endpoint for your resource.";

/// Standard base64 with padding; small enough not to warrant a dependency.
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b = [
            group[0],
            group.get(1).copied().unwrap_or(0),
            group.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (k, shift) in [18u32, 12, 6, 0].iter().enumerate() {
            if k <= group.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let r = route("/openai/deployments/gpt-4o/chat/completions");
        assert_eq!(r.deployment.as_deref(), Some("gpt-4o"));
        assert_eq!(r.operation, "chat/completions");
        for p in [
            "/openai/v1/chat/completions",
            "/v1/chat/completions/",
            "/chat/completions",
        ] {
            let r = route(p);
            assert_eq!(r.deployment, None);
            assert_eq!(r.operation, "chat/completions", "{p}");
        }
        assert_eq!(route("/openai/models").operation, "models");
        assert_eq!(route("/openai/v1/models").operation, "models");
        assert_eq!(route("/openai/deployments/x").operation, "");
    }

    #[test]
    fn probe_reads_relevant_fields_only() {
        let p = Probe::parse(
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},
                "messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5}"#,
        );
        assert_eq!(p.model.as_deref(), Some("m"));
        assert!(p.streaming());
        assert!(p.include_usage());
        assert_eq!(p.max_tokens(), 5);
        let p = Probe::parse(b"not json");
        assert!(!p.streaming());
        assert_eq!(p.max_tokens(), 16);
        assert_eq!(estimated_tokens(40, &p), 26);
    }

    #[test]
    fn base64_matches_reference() {
        assert_eq!(base64_encode(b""), "");
        assert_eq!(base64_encode(b"f"), "Zg==");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_encode(b"foo"), "Zm9v");
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn embedding_input_counts() {
        assert_eq!(embedding_inputs(Some(&json!("a"))).len(), 1);
        assert_eq!(embedding_inputs(Some(&json!(["a", "b"]))).len(), 2);
        assert_eq!(embedding_inputs(Some(&json!([1, 2, 3]))).len(), 1);
        assert_eq!(embedding_inputs(Some(&json!([[1], [2]]))).len(), 2);
        assert_eq!(embedding_inputs(None).len(), 1);
    }

    #[test]
    fn stream_text_concatenates_pieces() {
        assert_eq!(stream_text("b1", 3), "Hello from b1 1 2");
        assert_eq!(stream_text("b1", 0), "");
    }
}
