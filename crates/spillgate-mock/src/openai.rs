//! The built-in OpenAI / Azure OpenAI behaviour: which deployment and
//! operation a path names, what a request body asks for, and response bodies
//! that the official SDKs accept.

use bytes::Bytes;
use serde::{Deserialize, Serialize, Serializer};
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
fn hello(name: &str) -> String {
    format!("Hello from {name}")
}

/// A backend's greeting and its token count. Both depend only on the
/// backend's name, so they are computed once when the backend starts.
pub(crate) struct Greeting {
    pub text: String,
    pub tokens: u64,
}

impl Greeting {
    pub fn new(name: &str) -> Greeting {
        let text = hello(name);
        let tokens = text_tokens(&text);
        Greeting { text, tokens }
    }
}

/// Content of SSE chunk `i`. Chunk 0 carries the greeting so that a stream
/// is attributable to a backend; later chunks carry their index so that a
/// test can spot lost or reordered chunks. (`ChunkContent` is the same
/// content without building a string.)
fn stream_piece(name: &str, i: usize) -> String {
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
    pub greeting: &'a Greeting,
    pub model: &'a str,
    pub id: u64,
    pub created: u64,
    pub body_len: usize,
}

pub(crate) fn chat_completion(ctx: &Ctx<'_>) -> Value {
    let content = ctx.greeting.text.as_str();
    let completion = ctx.greeting.tokens;
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
    let text = ctx.greeting.text.as_str();
    let completion = ctx.greeting.tokens;
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
    let text = ctx.greeting.text.as_str();
    let input = prompt_tokens(ctx.body_len);
    let output = ctx.greeting.tokens;
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

/// Builds the `data: ...` frames of one SSE stream. What is the same in every
/// frame (id, model, created, prompt tokens) is fixed when the stream starts,
/// and each frame is serialized straight into the buffer that goes on the wire.
///
/// The JSON is byte for byte what `serde_json::json!` built before (see the
/// tests). `json!` objects are `BTreeMap`s (serde_json's `preserve_order`
/// feature is off in this workspace), so their keys came out sorted: the
/// field order below is alphabetical and must stay so.
pub(crate) struct ChunkFrames {
    id: String,
    model: String,
    created: u64,
    prompt_tokens: u64,
    /// Length of the largest frame so far, to size the next buffer.
    capacity: usize,
}

/// A `chat.completion.chunk`: a content chunk (one choice, no usage) or the
/// final usage chunk (no choices).
#[derive(Serialize)]
struct ChunkJson<'a> {
    choices: &'a [ChoiceJson<'a>],
    created: u64,
    id: &'a str,
    model: &'a str,
    object: &'static str,
    /// Always `null`.
    system_fingerprint: (),
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageJson>,
}

#[derive(Serialize)]
struct ChoiceJson<'a> {
    delta: DeltaJson<'a>,
    finish_reason: Option<&'static str>,
    index: u32,
    /// Always `null`.
    logprobs: (),
}

#[derive(Serialize)]
struct DeltaJson<'a> {
    content: ChunkContent<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
}

#[derive(Serialize)]
struct UsageJson {
    completion_tokens: u64,
    prompt_tokens: u64,
    total_tokens: u64,
}

/// `stream_piece` without the string: the greeting, or `" {i}"` written
/// straight into the output.
enum ChunkContent<'a> {
    Greeting(&'a str),
    Index(usize),
}

impl Serialize for ChunkContent<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ChunkContent::Greeting(text) => serializer.serialize_str(text),
            ChunkContent::Index(i) => serializer.collect_str(&format_args!(" {i}")),
        }
    }
}

const SSE_PREFIX: &[u8] = b"data: ";
const SSE_SUFFIX: &[u8] = b"\n\n";

impl ChunkFrames {
    pub fn new(model: &str, id: u64, created: u64, body_len: usize) -> ChunkFrames {
        ChunkFrames {
            id: format!("chatcmpl-mock{id}"),
            model: model.to_owned(),
            created,
            prompt_tokens: prompt_tokens(body_len),
            capacity: 256,
        }
    }

    /// The frame of content chunk `i`; `last` adds `finish_reason: "stop"`.
    pub fn content(
        &mut self,
        greeting: &Greeting,
        i: usize,
        last: bool,
    ) -> serde_json::Result<Bytes> {
        let (content, role) = if i == 0 {
            (ChunkContent::Greeting(&greeting.text), Some("assistant"))
        } else {
            (ChunkContent::Index(i), None)
        };
        let choice = ChoiceJson {
            delta: DeltaJson { content, role },
            finish_reason: last.then_some("stop"),
            index: 0,
            logprobs: (),
        };
        self.frame(std::slice::from_ref(&choice), None)
    }

    /// The usage frame sent after `chunks` content chunks when the request
    /// asked for `include_usage`.
    pub fn usage(&mut self, chunks: usize) -> serde_json::Result<Bytes> {
        let completion_tokens = u64::try_from(chunks).unwrap_or(u64::MAX);
        let usage = UsageJson {
            completion_tokens,
            prompt_tokens: self.prompt_tokens,
            total_tokens: self.prompt_tokens.saturating_add(completion_tokens),
        };
        self.frame(&[], Some(usage))
    }

    fn frame(
        &mut self,
        choices: &[ChoiceJson<'_>],
        usage: Option<UsageJson>,
    ) -> serde_json::Result<Bytes> {
        let chunk = ChunkJson {
            choices,
            created: self.created,
            id: &self.id,
            model: &self.model,
            object: "chat.completion.chunk",
            system_fingerprint: (),
            usage,
        };
        let mut buf = Vec::with_capacity(self.capacity);
        buf.extend_from_slice(SSE_PREFIX);
        serde_json::to_writer(&mut buf, &chunk)?;
        buf.extend_from_slice(SSE_SUFFIX);
        self.capacity = self.capacity.max(buf.len());
        Ok(Bytes::from(buf))
    }
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

    /// The frames as they were built before `ChunkFrames`: a `json!` tree per
    /// chunk, then `to_string()` and `format!`.
    fn json_chunk_frame(
        name: &str,
        model: &str,
        id: u64,
        created: u64,
        i: usize,
        last: bool,
    ) -> String {
        let content = stream_piece(name, i);
        let delta = if i == 0 {
            json!({"role": "assistant", "content": content})
        } else {
            json!({"content": content})
        };
        let frame = json!({
            "id": format!("chatcmpl-mock{id}"),
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": null,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": null,
                "finish_reason": if last { Value::from("stop") } else { Value::Null },
            }],
        });
        format!("data: {frame}\n\n")
    }

    fn json_usage_frame(
        model: &str,
        id: u64,
        created: u64,
        body_len: usize,
        chunks: usize,
    ) -> String {
        let frame = json!({
            "id": format!("chatcmpl-mock{id}"),
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": null,
            "choices": [],
            "usage": usage(
                prompt_tokens(body_len),
                u64::try_from(chunks).unwrap_or(u64::MAX),
            ),
        });
        format!("data: {frame}\n\n")
    }

    #[test]
    fn chunk_frames_match_the_json_macro_bytes() {
        let cases = [
            ("b1", "gpt-4o", 1, 1_700_000_000, 0, 4),
            ("b1", "gpt-4o", 1, 1_700_000_000, 5, 0),
            // Names and models that need escaping, and large numbers.
            (
                "na\"me\\ é\n",
                "m\u{1}\"x",
                u64::MAX,
                u64::MAX,
                123_456,
                usize::MAX,
            ),
            ("", "", 0, 0, 3, 1),
        ];
        for (name, model, id, created, body_len, chunks) in cases {
            let greeting = Greeting::new(name);
            let mut frames = ChunkFrames::new(model, id, created, body_len);
            for (i, last) in [
                (0, false),
                (0, true),
                (1, false),
                (9, true),
                (12_345, false),
            ] {
                let got = frames.content(&greeting, i, last).unwrap();
                let want = json_chunk_frame(name, model, id, created, i, last);
                assert_eq!(
                    std::str::from_utf8(&got).unwrap(),
                    want,
                    "chunk {i} last={last}"
                );
            }
            let got = frames.usage(chunks).unwrap();
            let want = json_usage_frame(model, id, created, body_len, chunks);
            assert_eq!(std::str::from_utf8(&got).unwrap(), want, "usage");
        }
    }

    #[test]
    fn greeting_is_hello_and_its_tokens() {
        let g = Greeting::new("alpha");
        assert_eq!(g.text, "Hello from alpha");
        assert_eq!(g.tokens, text_tokens("Hello from alpha"));
    }

    #[test]
    fn stream_text_concatenates_pieces() {
        assert_eq!(stream_text("b1", 3), "Hello from b1 1 2");
        assert_eq!(stream_text("b1", 0), "");
    }
}
