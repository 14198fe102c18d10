//! The shapes clients speak and the shapes backends take.
//!
//! Clients use the official SDKs unchanged, so a request arrives in one of three shapes:
//! Azure classic (`/openai/deployments/{d}/{op}?api-version=`), Azure v1 (`/openai/v1/{op}`,
//! model in the body) or OpenAI (`/v1/{op}`, model in the body). Any of them may be served
//! by either kind of backend, so this module finds the model a request asks for and builds
//! the path, query and body the chosen backend expects. Only names from the config and
//! operation paths checked segment by segment reach the upstream URL: nothing from the
//! client can pick where a request goes.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::config::{is_proper_segment, is_safe_name, AzureApi, BackendKind, NAME_BYTES};

/// The shape of a client request, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientShape {
    /// `/openai/deployments/{deployment}/{operation}`: the model is the deployment name.
    AzureDeployment,
    /// `/openai/v1/{operation}`: the model is in the body.
    AzureV1,
    /// `/v1/{operation}`: the model is in the body.
    OpenAi,
}

/// What a request path asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiRoute<'a> {
    /// An API operation to forward.
    Operation {
        shape: ClientShape,
        /// The deployment named in an Azure classic path.
        deployment: Option<&'a str>,
        /// `chat/completions`, `embeddings`, ...: checked to be safe path segments.
        operation: &'a str,
    },
    /// `GET /v1/models` and its Azure spellings, answered from config.
    ListModels,
    /// A path under an API prefix that is malformed (unsafe segment, empty operation).
    Invalid(&'static str),
    /// Not an API path.
    NotFound,
}

/// Operation paths are relative paths of safe segments (`chat/completions`,
/// `audio/transcriptions`); `..`, empty segments and odd characters are refused so the
/// upstream path cannot be steered.
///
/// One pass over the bytes with a table of the bytes a name may hold: splitting the
/// `str` on `'/'` searched for each separator with `memchr`, about 490 instructions for
/// `chat/completions` on every request. A test holds it to the segment-by-segment
/// definition.
fn is_safe_operation(op: &str) -> bool {
    // The operations nearly every request names, known safe: compared whole, not read
    // byte by byte (about 180 instructions for `chat/completions`).
    if COMMON_OPERATIONS.contains(&op) {
        return true;
    }
    let bytes = op.as_bytes();
    if bytes.len() > 256 {
        return false;
    }
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'/' {
            if !is_proper_segment(&bytes[start..i]) {
                return false;
            }
            start = i + 1;
        } else if !NAME_BYTES[usize::from(b)] {
            return false;
        }
    }
    is_proper_segment(&bytes[start..])
}

/// The operations nearly every request names, which [`is_safe_operation`] accepts
/// without reading them byte by byte (a test holds each to the definition).
const COMMON_OPERATIONS: [&str; 4] = ["chat/completions", "completions", "embeddings", "responses"];

/// Classifies a request path (without the query string).
pub fn classify_path<'a>(method: &str, path: &'a str) -> ApiRoute<'a> {
    let is_get = method.eq_ignore_ascii_case("GET");
    if is_get && matches!(path, "/v1/models" | "/openai/v1/models" | "/openai/models") {
        return ApiRoute::ListModels;
    }
    if let Some(rest) = path.strip_prefix("/openai/deployments/") {
        let Some((deployment, operation)) = rest.split_once('/') else {
            return ApiRoute::Invalid("the path needs an operation after the deployment name");
        };
        if !is_safe_name(deployment) {
            return ApiRoute::Invalid(
                "the deployment name may contain only letters, digits, '-', '_', '.' and ':'",
            );
        }
        if !is_safe_operation(operation) {
            return ApiRoute::Invalid("the operation path is not valid");
        }
        return ApiRoute::Operation {
            shape: ClientShape::AzureDeployment,
            deployment: Some(deployment),
            operation,
        };
    }
    for (prefix, shape) in [
        ("/openai/v1/", ClientShape::AzureV1),
        ("/v1/", ClientShape::OpenAi),
    ] {
        if let Some(operation) = path.strip_prefix(prefix) {
            if !is_safe_operation(operation) {
                return ApiRoute::Invalid("the operation path is not valid");
            }
            return ApiRoute::Operation {
                shape,
                deployment: None,
                operation,
            };
        }
    }
    ApiRoute::NotFound
}

/// The parts of a JSON request body the gateway needs, read without building a tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyInfo {
    /// The `model` string, unescaped.
    pub model: Option<String>,
    /// Byte range of the `model` value (quotes included) in the body, for splicing.
    pub model_span: Option<(usize, usize)>,
    /// Whether the body is a JSON object at all (only then can `model` be added).
    pub is_object: bool,
    /// The top-level completion limits, read in the same pass (see [`Limits`]).
    pub limits: Limits,
}

/// A request's top-level `max_tokens`, `max_completion_tokens`, `max_output_tokens` and
/// `n`, in that order: each a non-negative integer, else unset (a value of another type
/// counts as unset; of duplicates, the first counts; names are compared unescaped).
pub type Limits = [Option<u64>; 4];

/// The names of [`Limits`]' members, in its order.
pub const LIMIT_NAMES: [&str; 4] = [
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
];

/// What one pass over a JSON object reads: `model` as it lies in the body, and the
/// completion limits. Every other member is skipped (still checked to be valid JSON).
struct Probe<'a> {
    model: Option<&'a RawValue>,
    limits: Limits,
}

impl<'de> Deserialize<'de> for Probe<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ProbeVisitor)
    }
}

struct ProbeVisitor;

impl<'de> serde::de::Visitor<'de> for ProbeVisitor {
    type Value = Probe<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Probe<'de>, A::Error> {
        // `model` twice is an error, as it always was; a limit twice keeps the first.
        let mut model: Option<Option<&'de RawValue>> = None;
        let mut limits: [Option<Option<u64>>; 4] = [None; 4];
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Model => {
                    if model.is_some() {
                        return Err(serde::de::Error::duplicate_field("model"));
                    }
                    model = Some(map.next_value()?);
                }
                Key::Limit(i) => {
                    let raw: &'de RawValue = map.next_value()?;
                    if limits[i].is_none() {
                        // A valid JSON value (checked by the parser): only a run of digits
                        // reads as a number, as in a serde parse into `u64` (which refuses
                        // `-0`, `1e2` and `1.0` too).
                        limits[i] = Some(raw.get().parse::<u64>().ok());
                    }
                }
                Key::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(Probe {
            model: model.flatten(),
            limits: limits.map(Option::flatten),
        })
    }
}

/// A member name of the probed object, told apart as it is read: the name is never
/// copied (a `Cow<str>` key is always deserialized owned, one allocation a member).
/// Escaped names are compared unescaped, as serde compares field names.
enum Key {
    Model,
    Limit(usize),
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl serde::de::Visitor<'_> for KeyVisitor {
            type Value = Key;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a member name")
            }

            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Key, E> {
                Ok(if name == "model" {
                    Key::Model
                } else if let Some(i) = LIMIT_NAMES.iter().position(|n| *n == name) {
                    Key::Limit(i)
                } else {
                    Key::Other
                })
            }
        }
        d.deserialize_identifier(KeyVisitor)
    }
}

/// Why a body could not be read for its model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("`model` must be a string")]
    ModelNotString,
}

/// Reads `model` from a JSON body. A body that is not a JSON object yields `is_object:
/// false` and no model (e.g. multipart uploads); a JSON object that fails to parse is an
/// error the client should see.
pub fn inspect_body(body: &[u8]) -> Result<BodyInfo, BodyError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Ok(BodyInfo {
            model: None,
            model_span: None,
            is_object: false,
            limits: [None; 4],
        });
    }
    // UTF-8 checked once for the whole body: neither the quick pass nor the parser
    // checks each string again. A body that fails it gets the parser's own error. With
    // SIMD (simdutf8): the standard library's check is fast for ASCII only, and took
    // about 10 instructions a byte for a prompt in Japanese.
    let text = simdutf8::basic::from_utf8(body).ok();
    if let Some(quick) = text.and_then(quick::probe) {
        return Ok(quick);
    }
    parsed_body(body, text)
}

/// [`inspect_body`] by the parser, for a JSON object (`text` is `body` when it is valid
/// UTF-8).
fn parsed_body(body: &[u8], text: Option<&str>) -> Result<BodyInfo, BodyError> {
    let probe: Probe<'_> = match text {
        Some(text) => serde_json::from_str(text),
        None => serde_json::from_slice(body),
    }
    .map_err(|e| BodyError::InvalidJson(e.to_string()))?;
    let Some(raw) = probe.model else {
        return Ok(BodyInfo {
            model: None,
            model_span: None,
            is_object: true,
            limits: probe.limits,
        });
    };
    let text = raw.get();
    let model: Cow<'_, str> = serde_json::from_str(text).map_err(|_| BodyError::ModelNotString)?;
    // The raw value borrows from `body`; its offset is the distance between the two
    // pointers, computed on addresses without any unsafe code.
    let start = (text.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
    let span = (start + text.len() <= body.len()).then_some((start, start + text.len()));
    Ok(BodyInfo {
        model: Some(model.into_owned()),
        model_span: span,
        is_object: true,
        limits: probe.limits,
    })
}

/// Where the text of a JSON string (what follows its opening quote) first needs a look:
/// its first quote, backslash or control byte, found eight bytes at a time. A quote
/// there ends a string without escapes.
pub fn string_stop(text: &[u8]) -> Option<usize> {
    quick::stop(text)
}

/// JSON whitespace: space, tab, CR, LF; not form feed, which `is_ascii_whitespace` also
/// takes and JSON does not.
pub fn is_json_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The usual request body read in one pass without the parser, for [`inspect_body`]: a
/// parse with serde_json cost about 2,700 instructions for a 130-byte chat request. It
/// vouches only for what it fully checks, and leaves everything else to the parser
/// (which then gives its own answer or error): whatever it reads, the parser reads the
/// same from the same body.
mod quick {
    use std::ops::Range;

    use super::{BodyInfo, LIMIT_NAMES};

    /// Nesting past this is left to the parser (which skips the members it does not
    /// read without a depth limit): the quick pass recurses, and stops here.
    const MAX_DEPTH: usize = 64;

    /// Reads `text` when it is a JSON object the parser would accept, with no escape in
    /// a top-level member name or in `model`, `model` a string and at most once, no
    /// nesting past [`MAX_DEPTH`] and nothing but whitespace after it. `None` for
    /// anything else.
    pub(super) fn probe(text: &str) -> Option<BodyInfo> {
        let body = text.as_bytes();
        let mut quick = BodyInfo {
            model: None,
            model_span: None,
            is_object: true,
            limits: [None; 4],
        };
        let mut seen = [false; 4];
        let start = ws(body, 0);
        if body.get(start) != Some(&b'{') {
            return None;
        }
        let mut member = |key: &[u8], escapes: bool, value: Range<usize>| {
            // The parser compares names unescaped.
            if escapes {
                return None;
            }
            if key == b"model" {
                // A second `model` is the parser's error; an escape or another type, its
                // reading or error.
                let raw = &body[value.clone()];
                if quick.model.is_some() || raw.first() != Some(&b'"') || raw.contains(&b'\\') {
                    return None;
                }
                // Between quotes (ASCII), so on character boundaries.
                quick.model = Some(text.get(value.start + 1..value.end - 1)?.to_owned());
                quick.model_span = Some((value.start, value.end));
            } else if let Some(k) = LIMIT_NAMES.iter().position(|n| n.as_bytes() == key) {
                // The first of duplicates counts; a number only when it is all digits.
                if !seen[k] {
                    seen[k] = true;
                    quick.limits[k] = text.get(value)?.parse().ok();
                }
            }
            Some(())
        };
        let end = container(body, start, 1, b'}', Some(&mut member))?;
        (ws(body, end) == body.len()).then_some(quick)
    }

    /// Past the JSON whitespace from `i`.
    fn ws(b: &[u8], mut i: usize) -> usize {
        while b.get(i).is_some_and(|&c| super::is_json_space(c)) {
            i += 1;
        }
        i
    }

    /// What [`container`] tells of each member of an object: its name (without its
    /// quotes), whether the name has escapes, and where its value lies. `None` stops the
    /// pass.
    type Member<'a> = &'a mut dyn FnMut(&[u8], bool, Range<usize>) -> Option<()>;

    /// Past the value at `i`, `depth` containers deep; `None` when it is not valid JSON.
    fn value(b: &[u8], i: usize, depth: usize) -> Option<usize> {
        match *b.get(i)? {
            b'"' => string(b, i).map(|(end, _)| end),
            b'{' => container(b, i, depth + 1, b'}', None),
            b'[' => container(b, i, depth + 1, b']', None),
            b't' => literal(b, i, b"true"),
            b'f' => literal(b, i, b"false"),
            b'n' => literal(b, i, b"null"),
            b'-' | b'0'..=b'9' => number(b, i),
            _ => None,
        }
    }

    /// Past the object (`close` `}`, each member told to `member` when there is one) or
    /// array (`]`) at `i`.
    fn container(
        b: &[u8],
        i: usize,
        depth: usize,
        close: u8,
        mut member: Option<Member<'_>>,
    ) -> Option<usize> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut i = ws(b, i + 1);
        if b.get(i) == Some(&close) {
            return Some(i + 1);
        }
        loop {
            if close == b'}' {
                if b.get(i) != Some(&b'"') {
                    return None;
                }
                let (end, escapes) = string(b, i)?;
                let key = i + 1..end - 1;
                i = ws(b, end);
                if b.get(i) != Some(&b':') {
                    return None;
                }
                let start = ws(b, i + 1);
                i = value(b, start, depth)?;
                if let Some(member) = member.as_mut() {
                    member(&b[key], escapes, start..i)?;
                }
            } else {
                i = value(b, i, depth)?;
            }
            i = ws(b, i);
            match *b.get(i)? {
                b',' => i = ws(b, i + 1),
                c if c == close => return Some(i + 1),
                _ => return None,
            }
        }
    }

    /// Past the string whose opening quote is at `i`, and whether it has escapes. Each
    /// escape must be one JSON has; no control byte may be in it.
    fn string(b: &[u8], i: usize) -> Option<(usize, bool)> {
        let mut j = i + 1;
        let mut escapes = false;
        loop {
            j += stop(b.get(j..)?)?;
            match b[j] {
                b'"' => return Some((j + 1, escapes)),
                b'\\' => {
                    escapes = true;
                    j += match *b.get(j + 1)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                        b'u' if b.get(j + 2..j + 6)?.iter().all(u8::is_ascii_hexdigit) => 6,
                        _ => return None,
                    };
                }
                // A control byte.
                _ => return None,
            }
        }
    }

    /// Where the first quote, backslash or control byte of `s` is. Eight bytes are
    /// tested at a time, as one word: `(w - ONES * b) & !w & HIGH` marks the bytes of
    /// `w` below `b`, and the lowest mark is the first such byte (a byte is marked
    /// wrongly only above one rightly marked). Quotes and backslashes are the zero bytes
    /// of the word XOR-ed with them; control bytes are those below 0x20. Two words are
    /// taken a turn, in slices of known length: a prompt's long strings cost about a
    /// third fewer instructions than word by word, with a bounds check each (words are
    /// tested on their own, so a wrong mark never crosses from one into the other).
    pub(super) fn stop(s: &[u8]) -> Option<usize> {
        const ONES: u64 = 0x0101_0101_0101_0101;
        const HIGH: u64 = ONES << 7;
        let below = |w: u64, b: u8| w.wrapping_sub(ONES * u64::from(b)) & !w;
        let marks = |word: [u8; 8]| {
            let w = u64::from_le_bytes(word);
            (below(w ^ (ONES * u64::from(b'"')), 1)
                | below(w ^ (ONES * u64::from(b'\\')), 1)
                | below(w, 0x20))
                & HIGH
        };
        let first = |m: u64| (m.trailing_zeros() / 8) as usize;
        let mut at = 0;
        let mut pairs = s.chunks_exact(16);
        for pair in &mut pairs {
            let (a, b) = pair.split_at(8);
            // Never fails (two halves of 16 bytes). Kept in this form: `as_chunks` into
            // word pairs or 16-byte arrays read as a `u128` counted 2-6% more
            // instructions in bench/body.sh.
            let (Ok(a), Ok(b)) = (<[u8; 8]>::try_from(a), <[u8; 8]>::try_from(b)) else {
                break;
            };
            let (ma, mb) = (marks(a), marks(b));
            if ma | mb != 0 {
                return Some(at + if ma != 0 { first(ma) } else { 8 + first(mb) });
            }
            at += 16;
        }
        let rest = &s[at..];
        if let Some(word) = rest.get(..8).and_then(|w| <[u8; 8]>::try_from(w).ok()) {
            let m = marks(word);
            if m != 0 {
                return Some(at + first(m));
            }
            at += 8;
        }
        s[at..]
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
            .map(|p| at + p)
    }

    /// Past `word` at `i`.
    fn literal(b: &[u8], i: usize, word: &[u8]) -> Option<usize> {
        b.get(i..)?.starts_with(word).then_some(i + word.len())
    }

    /// Past the number at `i`: `-`, then `0` or digits not starting with `0`, then a
    /// fraction and an exponent, each optional and each with at least one digit.
    fn number(b: &[u8], i: usize) -> Option<usize> {
        let digits =
            |from: usize| from + b[from..].iter().take_while(|c| c.is_ascii_digit()).count();
        let mut j = i + usize::from(b[i] == b'-');
        j = match *b.get(j)? {
            b'0' => j + 1,
            b'1'..=b'9' => digits(j),
            _ => return None,
        };
        if b.get(j) == Some(&b'.') {
            let end = digits(j + 1);
            if end == j + 1 {
                return None;
            }
            j = end;
        }
        if let Some(b'e' | b'E') = b.get(j) {
            j += 1;
            if let Some(b'+' | b'-') = b.get(j) {
                j += 1;
            }
            let end = digits(j);
            if end == j {
                return None;
            }
            j = end;
        }
        Some(j)
    }
}

/// Returns `body` with its `model` set to `name`: the existing value replaced in place, or
/// a `"model"` member added first when there was none. Every other byte is kept as sent.
pub fn set_model(body: &[u8], info: &BodyInfo, name: &str) -> Option<Vec<u8>> {
    let quoted = serde_json::to_string(name).ok()?;
    if let Some((s, e)) = info.model_span {
        let mut out = Vec::with_capacity(body.len() + quoted.len());
        out.extend_from_slice(&body[..s]);
        out.extend_from_slice(quoted.as_bytes());
        out.extend_from_slice(&body[e..]);
        return Some(out);
    }
    if !info.is_object {
        return None;
    }
    let open = body.iter().position(|b| *b == b'{')?;
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + quoted.len() + 10);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(b"\"model\":");
    out.extend_from_slice(quoted.as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// Where and how to send a request to one backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTarget {
    /// Path and query, appended to the backend's base URL.
    pub path_and_query: String,
    /// `Some(name)` when the body's `model` must be set to `name` for this backend.
    pub body_model: Option<String>,
}

/// Query parameters the gateway consumes itself and never forwards.
fn forwardable_query(query: &str, keep_api_version: bool) -> String {
    // Most requests have none: nothing to split (about 130 instructions each).
    if query.is_empty() {
        return String::new();
    }
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .filter(|kv| {
            let key = kv.split('=').next().unwrap_or("");
            key != "priority" && (keep_api_version || key != "api-version")
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The parts of a client request that decide its upstream form.
#[derive(Debug, Clone, Copy)]
pub struct RequestParts<'a> {
    pub shape: ClientShape,
    pub operation: &'a str,
    pub query: Option<&'a str>,
    /// The model named in the body, if any.
    pub body_model: Option<&'a str>,
    pub body_is_object: bool,
}

/// Builds the upstream path for a request in `shape`, `operation`, `query`, sent to a
/// backend of `kind` whose base URL path is `base_path` (e.g. `/v1`) and that knows the
/// model as `deployment`. `body_model` is the model name the client put in the body, if
/// any, so that an unchanged body is left untouched.
pub fn upstream_target(
    req: &RequestParts<'_>,
    kind: BackendKind,
    base_path: &str,
    deployment: &str,
    azure: (AzureApi, &str),
) -> UpstreamTarget {
    let RequestParts {
        shape,
        operation,
        query,
        body_model,
        body_is_object,
    } = *req;
    // The path's pieces joined, then the query: one allocation of the right size (this
    // runs for every attempt; a formatter cost several times more). Exactly the size:
    // a string that fills its allocation becomes the URI's bytes without another one.
    let with_query = |pieces: &[&str], q: String| {
        let query = if q.is_empty() { 0 } else { 1 + q.len() };
        let len = pieces.iter().map(|p| p.len()).sum::<usize>() + query;
        let mut p = String::with_capacity(len);
        for piece in pieces {
            p.push_str(piece);
        }
        if !q.is_empty() {
            p.push('?');
            p.push_str(&q);
        }
        p
    };
    let needs_model =
        || (body_is_object && body_model != Some(deployment)).then(|| deployment.to_string());
    let (api, api_version) = azure;
    // The Responses API has no deployment-scoped classic path: it is served under v1.
    let responses = operation == "responses" || operation.starts_with("responses/");
    match (kind, shape) {
        // Azure classic in, Azure classic out: the deployment in the path is all that
        // changes; the body is forwarded byte for byte, never parsed.
        (BackendKind::Azure, ClientShape::AzureDeployment) => UpstreamTarget {
            path_and_query: with_query(
                &[
                    base_path,
                    "/openai/deployments/",
                    deployment,
                    "/",
                    operation,
                ],
                forwardable_query(query.unwrap_or(""), true),
            ),
            body_model: None,
        },
        // Body-model shapes to an Azure resource's v1 API: the deployment as `model`.
        (BackendKind::Azure, ClientShape::AzureV1 | ClientShape::OpenAi)
            if api == AzureApi::V1 || responses =>
        {
            UpstreamTarget {
                path_and_query: with_query(
                    &[base_path, "/openai/v1/", operation],
                    forwardable_query(query.unwrap_or(""), false),
                ),
                body_model: needs_model(),
            }
        }
        // Body-model shapes to a classic Azure resource: the deployment in the path, the
        // backend's api-version; Azure reads the model from the path.
        (BackendKind::Azure, ClientShape::AzureV1 | ClientShape::OpenAi) => {
            let mut q = forwardable_query(query.unwrap_or(""), false);
            if !q.is_empty() {
                q.push('&');
            }
            q.push_str("api-version=");
            q.push_str(api_version);
            UpstreamTarget {
                path_and_query: with_query(
                    &[
                        base_path,
                        "/openai/deployments/",
                        deployment,
                        "/",
                        operation,
                    ],
                    q,
                ),
                body_model: None,
            }
        }
        // Anything to an OpenAI-compatible server: `{base_url}/{operation}`, model in the
        // body; Azure's api-version means nothing there.
        (BackendKind::Openai, _) => UpstreamTarget {
            path_and_query: with_query(
                &[base_path, "/", operation],
                forwardable_query(query.unwrap_or(""), false),
            ),
            body_model: needs_model(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn classifies_every_shape() {
        assert_eq!(
            classify_path("POST", "/openai/deployments/gpt4o/chat/completions"),
            ApiRoute::Operation {
                shape: ClientShape::AzureDeployment,
                deployment: Some("gpt4o"),
                operation: "chat/completions"
            }
        );
        assert_eq!(
            classify_path("POST", "/openai/v1/responses"),
            ApiRoute::Operation {
                shape: ClientShape::AzureV1,
                deployment: None,
                operation: "responses"
            }
        );
        assert_eq!(
            classify_path("POST", "/v1/embeddings"),
            ApiRoute::Operation {
                shape: ClientShape::OpenAi,
                deployment: None,
                operation: "embeddings"
            }
        );
        assert_eq!(classify_path("GET", "/v1/models"), ApiRoute::ListModels);
        assert_eq!(classify_path("GET", "/openai/models"), ApiRoute::ListModels);
        assert_eq!(classify_path("GET", "/"), ApiRoute::NotFound);
        assert_eq!(classify_path("POST", "/admin"), ApiRoute::NotFound);
    }

    #[test]
    fn path_traversal_is_refused() {
        for p in [
            "/openai/deployments/../x/chat/completions",
            "/openai/deployments/gpt4o/../../admin",
            "/openai/deployments/gpt4o/chat//completions",
            "/v1/../admin",
            "/v1/",
            "/openai/deployments/gpt4o",
            "/openai/deployments/a%2F..%2Fb/chat/completions",
            "/v1/chat/completions@evil.example",
        ] {
            assert!(
                matches!(classify_path("POST", p), ApiRoute::Invalid(_)),
                "{p}"
            );
        }
    }

    #[test]
    fn reads_model_and_its_span() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"model\""}], "model" : "gpt-4o", "stream":true}"#;
        let info = inspect_body(body).unwrap();
        assert_eq!(info.model.as_deref(), Some("gpt-4o"));
        let (s, e) = info.model_span.unwrap();
        assert_eq!(&body[s..e], br#""gpt-4o""#);
        let out = set_model(body, &info, "gpt4o-ptu").unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"messages":[{"role":"user","content":"hi \"model\""}], "model" : "gpt4o-ptu", "stream":true}"#
        );
    }

    #[test]
    fn escaped_model_names_are_unescaped() {
        let info = inspect_body(br#"{"model":"gpt\u002d4o"}"#).unwrap();
        assert_eq!(info.model.as_deref(), Some("gpt-4o"));
    }

    #[test]
    fn escaped_member_names_count_as_their_unescaped_names() {
        let body = br#"{"mod\u0065l":"gpt-4o","\u006e":2,"max_tokens":7}"#;
        let info = inspect_body(body).unwrap();
        assert_eq!(info.model.as_deref(), Some("gpt-4o"));
        assert_eq!(info.limits, [Some(7), None, None, Some(2)]);
        // And a second, escaped `model` is the duplicate it unescapes to.
        let err = inspect_body(br#"{"model":"a","\u006dodel":"b"}"#).unwrap_err();
        assert!(
            matches!(err, BodyError::InvalidJson(ref m) if m.contains("duplicate")),
            "{err}"
        );
    }

    #[test]
    fn adds_model_when_absent() {
        let body = br#"  {"input":"x"}"#;
        let info = inspect_body(body).unwrap();
        assert_eq!(info.model, None);
        assert!(info.is_object);
        assert_eq!(
            set_model(body, &info, "m").unwrap(),
            br#"  {"model":"m","input":"x"}"#
        );
        let info = inspect_body(b"{ }").unwrap();
        assert_eq!(set_model(b"{ }", &info, "m").unwrap(), br#"{"model":"m" }"#);
    }

    #[test]
    fn limits_are_read_with_the_model() {
        let body = br#"{"max_tokens":70,"tools":[{"n":5}],"model":"m","n":"2","max_output_tokens":1.5,"max_tokens":9}"#;
        let info = inspect_body(body).unwrap();
        assert_eq!(info.model.as_deref(), Some("m"));
        // Nested members are not the request's; a string or a fraction is no limit; the
        // first of duplicates counts.
        assert_eq!(info.limits, [Some(70), None, None, None]);
        let odd =
            br#"{"max_tokens":-0,"n":-1,"max_output_tokens":1e2,"max_completion_tokens":1.0}"#;
        assert_eq!(inspect_body(odd).unwrap().limits, [None; 4]);
        for text in ["-0", "-1", "1e2", "1.0", "18446744073709551616"] {
            assert!(serde_json::from_str::<u64>(text).is_err(), "{text}");
        }
        let info = inspect_body(br#"{"model":null,"max_completion_tokens":3,"n":2}"#).unwrap();
        assert_eq!(
            (info.model, info.limits),
            (None, [None, Some(3), None, Some(2)])
        );
        // A repeated model stays an error, as does invalid JSON anywhere in the body.
        for bad in [
            &br#"{"model":"a","model":"b"}"#[..],
            br#"{"model":"a","n":}"#,
        ] {
            assert!(matches!(inspect_body(bad), Err(BodyError::InvalidJson(_))));
        }
    }

    #[test]
    fn bad_bodies() {
        assert!(matches!(
            inspect_body(b"{\"model\":"),
            Err(BodyError::InvalidJson(_))
        ));
        assert_eq!(
            inspect_body(br#"{"model":5}"#),
            Err(BodyError::ModelNotString)
        );
        let info = inspect_body(b"--boundary\r\n").unwrap();
        assert!(!info.is_object);
        assert_eq!(set_model(b"--boundary", &info, "m"), None);
        assert!(!inspect_body(b"").unwrap().is_object);
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "a test table row: one argument per column"
    )]
    fn target(
        shape: ClientShape,
        op: &str,
        query: Option<&str>,
        body_model: Option<&str>,
        kind: BackendKind,
        base: &str,
        dep: &str,
        api: AzureApi,
    ) -> (String, Option<String>) {
        let t = upstream_target(
            &RequestParts {
                shape,
                operation: op,
                query,
                body_model,
                body_is_object: true,
            },
            kind,
            base,
            dep,
            (api, "2024-10-21"),
        );
        // Built in an allocation of exactly its size (see `with_query`).
        assert_eq!(t.path_and_query.capacity(), t.path_and_query.len());
        (t.path_and_query, t.body_model)
    }

    #[test]
    fn queries_keep_what_goes_upstream() {
        assert_eq!(forwardable_query("", true), "");
        assert_eq!(forwardable_query("&&", true), "");
        assert_eq!(forwardable_query("priority=low", true), "");
        assert_eq!(
            forwardable_query("a=1&&priority=low&api-version=x&b", true),
            "a=1&api-version=x&b"
        );
        assert_eq!(
            forwardable_query("a=1&&priority=low&api-version=x&b", false),
            "a=1&b"
        );
    }

    #[test]
    fn targets_for_each_kind_and_shape() {
        use AzureApi::{Classic, V1};
        use BackendKind::*;
        use ClientShape::*;
        let q = Some("api-version=2024-06-01&priority=low");
        // Azure classic to Azure: deployment swapped, the client's api-version kept,
        // priority dropped, body untouched (whatever it names).
        for api in [Classic, V1] {
            assert_eq!(
                target(
                    AzureDeployment,
                    "chat/completions",
                    q,
                    Some("gpt-4o"),
                    Azure,
                    "",
                    "gpt4o-ptu",
                    api
                ),
                (
                    "/openai/deployments/gpt4o-ptu/chat/completions?api-version=2024-06-01".into(),
                    None
                )
            );
        }
        // OpenAI shape to a classic Azure resource: deployment path, the backend's
        // api-version, body untouched (Azure reads the path).
        assert_eq!(
            target(
                OpenAi,
                "chat/completions",
                Some("priority=low"),
                Some("gpt-4o"),
                Azure,
                "",
                "gpt4o-ptu",
                Classic
            ),
            (
                "/openai/deployments/gpt4o-ptu/chat/completions?api-version=2024-10-21".into(),
                None
            )
        );
        // ... to a v1 resource: v1 path, deployment as model.
        assert_eq!(
            target(
                OpenAi,
                "chat/completions",
                None,
                Some("gpt-4o"),
                Azure,
                "",
                "gpt4o-ptu",
                V1
            ),
            (
                "/openai/v1/chat/completions".into(),
                Some("gpt4o-ptu".into())
            )
        );
        // The Responses API is v1-only on Azure.
        assert_eq!(
            target(
                AzureV1,
                "responses",
                None,
                Some("gpt-4o"),
                Azure,
                "",
                "gpt4o-ptu",
                Classic
            ),
            ("/openai/v1/responses".into(), Some("gpt4o-ptu".into()))
        );
        // Azure classic to OpenAI kind: base path kept, api-version dropped, model added.
        assert_eq!(
            target(
                AzureDeployment,
                "chat/completions",
                q,
                None,
                Openai,
                "/v1",
                "gpt-4o",
                Classic
            ),
            ("/v1/chat/completions".into(), Some("gpt-4o".into()))
        );
        // OpenAI to OpenAI, same name: untouched.
        assert_eq!(
            target(
                OpenAi,
                "embeddings",
                None,
                Some("m"),
                Openai,
                "/v1",
                "m",
                Classic
            ),
            ("/v1/embeddings".into(), None)
        );
    }

    /// The parser's reading of a JSON object body, for comparison with the quick pass.
    fn by_parser(body: &[u8]) -> Result<BodyInfo, BodyError> {
        parsed_body(body, std::str::from_utf8(body).ok())
    }

    /// Bodies clients send take the quick pass, and it reads them as the parser does.
    #[test]
    fn usual_bodies_are_read_without_the_parser_and_as_it_reads_them() {
        let bodies: [&str; 8] = [
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Summarise the quarterly report in three bullet points."}],"max_tokens":70}"#,
            "{\n  \"messages\": [\n    {\"role\": \"system\", \"content\": \"Be brief.\\n\\tOK? \\\"quoted\\\" \\u00e9\\ud83d\\ude00\"},\n    {\"role\": \"user\", \"content\": \"h\u{e9}llo \u{1F600} \u{7f}\"}\n  ],\n  \"model\": \"gpt-4o-mini\",\n  \"temperature\": 0.2,\n  \"top_p\": 1e-3,\n  \"n\": 2,\n  \"max_completion_tokens\": 512\n}\n",
            r#"{"model":"text-embedding-3-small","input":["one","two",["nested",{"deep":[1,-2,3.5e+10,0,-0.0,true,false,null]}]],"dimensions":256,"encoding_format":"float"}"#,
            r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],"tool_choice":"auto","max_tokens":"70","n":1.0}"#,
            r#"{"model":"o3","input":"hi","max_output_tokens":18446744073709551615,"max_tokens":18446744073709551616,"n":-1}"#,
            r#"{"messages":[],"max_tokens":5,"max_tokens":6,"n":null,"n":3}"#,
            r#"{}"#,
            " \t\r\n{ \"model\" : \"m\" , \"a\" : {} } \n",
        ];
        for body in bodies {
            let quick = quick::probe(body).unwrap_or_else(|| panic!("not taken: {body}"));
            assert_eq!(Ok(quick), by_parser(body.as_bytes()), "{body}");
        }
    }

    /// What the quick pass leaves to the parser: what it does not vouch for, and what
    /// is not JSON at all (the parser's error is what the client sees).
    #[test]
    fn the_quick_pass_leaves_the_unusual_and_the_invalid_to_the_parser() {
        let deep = format!(r#"{{"a":{}1{}}}"#, "[".repeat(64), "]".repeat(64));
        let unusual = [
            r#"{"model":"gpt-\u0034o"}"#,
            r#"{"mod\u0065l":"gpt-4o"}"#,
            // A top-level name with an escape: the parser compares names unescaped.
            " \t\r\n{ \"model\" : \"m\" , \"a\\\\b\" : {} } \n",
            r#"{"model":"a","model":"b"}"#,
            r#"{"model":5}"#,
            r#"{"model":null}"#,
            deep.as_str(),
        ];
        for body in unusual {
            assert!(quick::probe(body).is_none(), "{body}");
        }
        let invalid = [
            r#"{"model":"a",}"#,
            r#"{"model":"a"} x"#,
            r#"{"model":"a""#,
            r#"{"n":01}"#,
            r#"{"n":1.}"#,
            r#"{"n":1e}"#,
            r#"{"n":-}"#,
            r#"{"n":.5}"#,
            r#"{"n":+1}"#,
            r#"{"s":"bad \x escape"}"#,
            r#"{"s":"\u12g4"}"#,
            "{\"s\":\"a\u{1}b\"}",
            "{\"s\":\"tab\there\"}",
            r#"{"a":[1,]}"#,
            r#"{"a":[1 2]}"#,
            r#"{"a":{"b"}}"#,
            r#"{"a":{1:2}}"#,
            r#"{"a":tru}"#,
            r#"{"a":nul}"#,
            r#"{"a" "b"}"#,
            "{\"a\":1}\u{c}",
            r#"{"a":1"#,
        ];
        for body in invalid {
            assert!(quick::probe(body).is_none(), "{body}");
            assert!(by_parser(body.as_bytes()).is_err(), "{body}");
        }
    }

    /// A JSON value for the quick pass's property test: every kind, nested, with
    /// strings that need escapes.
    fn any_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|n| n.into()),
            any::<u64>().prop_map(|n| n.into()),
            (-1e6f64..1e6).prop_map(|f| f.into()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| f.into()),
            "(\\PC|[\"\\\\\u{0}-\u{1f}\u{7f}])*".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                prop::collection::btree_map("[a-z_\"\\\\]{0,6}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// The one-pass operation check agrees with checking each `/`-separated segment
        /// as a name; and the name check with its definition.
        #[test]
        fn the_operation_check_is_the_segment_by_segment_one(
            op in prop_oneof![
                "[a-z/.:_-]{0,12}",
                prop::collection::vec(
                    prop::sample::select(vec!["", ".", "..", "...", "a", "chat", "a.b", "x:y", "%2e", "\u{e9}"]),
                    1..5,
                )
                .prop_map(|s| s.join("/")),
                prop::collection::vec(any::<char>(), 0..8)
                    .prop_map(|c| c.into_iter().collect::<String>()),
                "[a-z]{250,260}",
                "[a-z]{1,3}/[a-z]{250,256}",
                prop::sample::select(COMMON_OPERATIONS.to_vec()).prop_map(String::from),
            ],
        ) {
            // Written out here, not with the table both checks use.
            let name = |s: &str| {
                !matches!(s, "" | "." | "..")
                    && s.len() <= 256
                    && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
            };
            for segment in op.split('/') {
                prop_assert_eq!(is_safe_name(segment), name(segment), "{:?}", segment);
            }
            let by_segments = op.len() <= 256 && op.split('/').all(name);
            prop_assert_eq!(is_safe_operation(&op), by_segments, "{:?}", op);
        }

        /// The word-at-a-time search finds what a byte-by-byte one finds.
        #[test]
        fn the_string_scan_stops_where_a_byte_scan_stops(
            bytes in prop::collection::vec(prop_oneof![
                4 => 0x20u8..0x7f,
                1 => 0x1eu8..0x22,
                1 => any::<u8>(),
                1 => Just(b'"'),
                1 => Just(b'\\'),
            ], 0..40),
        ) {
            let naive = bytes.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20);
            prop_assert_eq!(quick::stop(&bytes), naive);
        }

        /// The same for long strings, whose stops are rare and mostly past the first
        /// words (prompts).
        #[test]
        fn the_string_scan_stops_where_a_byte_scan_stops_in_long_strings(
            bytes in prop::collection::vec(prop_oneof![
                200 => 0x20u8..0x7f,
                20 => 0x80u8..=0xff,
                1 => 0x00u8..0x20,
                1 => Just(b'"'),
                1 => Just(b'\\'),
            ], 0..400),
        ) {
            let naive = bytes.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20);
            prop_assert_eq!(quick::stop(&bytes), naive);
        }

        /// Whatever the quick pass reads from a body (well-formed or with one byte
        /// changed, added or taken out), the parser reads the same; and it takes the
        /// body whenever it is well-formed JSON of the usual shape.
        #[test]
        fn the_quick_pass_reads_what_the_parser_reads(
            // `model` is added below, a string or not at all.
            members in prop::collection::vec((prop_oneof![
                Just("max_tokens".to_string()),
                Just("n".to_string()),
                Just("max_completion_tokens".to_string()),
                "[a-z_]{1,8}",
            ], any_json()), 0..6),
            model in proptest::option::of("[a-zA-Z0-9._:-]{0,12}"),
            pretty in any::<bool>(),
            edit in proptest::option::of((any::<prop::sample::Index>(), 0u8..3, any::<u8>())),
        ) {
            let mut members: Vec<(String, serde_json::Value)> =
                members.into_iter().filter(|(k, _)| k != "model").collect();
            if let Some(m) = &model {
                members.push(("model".into(), m.clone().into()));
            }
            let object = serde_json::Value::Object(members.into_iter().collect());
            let mut body = if pretty {
                serde_json::to_vec_pretty(&object)
            } else {
                serde_json::to_vec(&object)
            }
            .unwrap();
            let plain = edit.is_none();
            if let Some((at, how, byte)) = edit {
                let i = at.index(body.len() + 1);
                match how {
                    0 => body.insert(i, byte),
                    1 if i < body.len() => { body.remove(i); }
                    _ if i < body.len() => body[i] = byte,
                    _ => body.push(byte),
                }
            }
            let Ok(text) = std::str::from_utf8(&body) else { return Ok(()) };
            match quick::probe(text) {
                Some(quick) => prop_assert_eq!(Ok(quick), by_parser(&body)),
                // serde_json writes no escape in these names and values, and no
                // nesting this deep: a well-formed body is always taken.
                None => prop_assert!(!plain, "not taken: {}", text),
            }
        }

        #[test]
        fn inspect_never_panics(body in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = inspect_body(&body);
        }

        /// JSON-like input (objects with `model` members, escapes, nesting, truncation):
        /// inspection never panics, and a reported span always holds the model's quoted text.
        #[test]
        fn inspect_json_like(
            pre in r#"[ \t]{0,2}\{("[a-z]{1,5}"[ ]?:[ ]?("[a-z\\"]{0,6}"|[0-9]{1,3}|\[\]|\{\}|null)[ ]?,[ ]?){0,3}"#,
            model in r#"[a-z0-9.:\\u-]{0,12}"#,
            post in r#"(,"[a-z]{1,5}":[0-9]{1,3}){0,2}\}?"#,
        ) {
            let body = format!(r#"{pre}"model":"{model}"{post}"#);
            if let Ok(info) = inspect_body(body.as_bytes()) {
                if let Some((s, e)) = info.model_span {
                    let quoted = &body.as_bytes()[s..e];
                    prop_assert_eq!(quoted.first(), Some(&b'"'));
                    prop_assert_eq!(quoted.last(), Some(&b'"'));
                }
            }
        }

        #[test]
        fn rewrite_keeps_valid_json(model in "[a-z0-9.:-]{1,20}", name in "[a-z0-9.:_-]{1,20}", extra in "[a-z ]{0,20}") {
            let v = serde_json::json!({"messages": [{"role": "user", "content": extra}], "model": model, "n": 1});
            let body = serde_json::to_vec(&v).unwrap();
            let info = inspect_body(&body).unwrap();
            let out = set_model(&body, &info, &name).unwrap();
            let parsed: serde_json::Value = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(parsed["model"].as_str(), Some(name.as_str()));
            prop_assert_eq!(&parsed["messages"], &v["messages"]);
        }

        #[test]
        fn classify_never_panics(path in "/[a-z/._%-]{0,60}") {
            let _ = classify_path("POST", &path);
        }
    }
}
