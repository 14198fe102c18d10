//! Request priority: which requests are low priority, how many tokens a request will
//! take from a deployment's quota, and the actual usage its response reports.
//!
//! Low-priority requests are admitted only from spare capacity (see
//! `spillgate_core::capacity`); every request, while in flight, holds a reservation of its
//! estimated tokens so that concurrent requests are not all admitted against the same
//! remaining count. The estimate counts prompt tokens with a real tokenizer (tiktoken's
//! o200k_base, the GPT-4o family's) plus the completion allowance, as Azure charges quota
//! at admission. The response's `usage` corrects the tracked capacity when the backend
//! sends no rate-limit headers; for streams the gateway asks the backend for the usage
//! chunk (`stream_options.include_usage`) and removes it again when the client did not
//! ask for it.

use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};

use crate::coalesce::Joined;
use crate::h1::Values;
use http_body::{Body as HttpBody, Frame, SizeHint};
use serde::Deserialize;
use spillgate_core::request::{is_json_space, Limits, LIMIT_NAMES};
use tiktoken_rs::CoreBPE;

/// Whether a request is treated as low priority: request priority is on (`[priority]`)
/// and the request asks for it. The one rule for routing and for the metrics.
pub fn treated_as_low(
    config: &spillgate_core::config::Config,
    headers: &impl Values,
    query: Option<&str>,
) -> bool {
    config.priority.is_some() && is_low(headers, query)
}

static HEADER_PRIORITY: crate::h1::Common = crate::h1::Common::new("x-priority");

/// Whether a request asks to be low priority: `x-priority: low` or `priority=low`.
pub fn is_low(headers: &impl Values, query: Option<&str>) -> bool {
    let header = headers
        .first(&HEADER_PRIORITY)
        .is_some_and(|v| v.trim_ascii().eq_ignore_ascii_case(b"low"));
    let param = query.is_some_and(|q| {
        q.split('&').any(|kv| {
            kv.split_once('=')
                .is_some_and(|(k, v)| k == "priority" && v.eq_ignore_ascii_case("low"))
        })
    });
    header || param
}

fn tokenizer() -> Option<&'static CoreBPE> {
    static BPE: OnceLock<Option<CoreBPE>> = OnceLock::new();
    BPE.get_or_init(|| match tiktoken_rs::o200k_base() {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!(error = %e, "tokenizer unavailable; estimating 4 bytes per token");
            None
        }
    })
    .as_ref()
}

/// Text longer than this is estimated at 4 bytes per token rather than tokenized, to
/// bound the CPU one request can cost.
const TOKENIZE_LIMIT: usize = 256 * 1024;

fn count_text(text: &str) -> u64 {
    match tokenizer() {
        Some(bpe) if text.len() <= TOKENIZE_LIMIT => bpe.encode_ordinary(text).len() as u64,
        _ => (text.len() as u64).div_ceil(4),
    }
}

#[derive(Deserialize, Default)]
struct EstimateProbe {
    #[serde(default)]
    messages: Vec<serde_json::Value>,
    #[serde(default)]
    input: Option<serde_json::Value>,
    #[serde(default)]
    prompt: Option<serde_json::Value>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
    n: Option<u64>,
    best_of: Option<u64>,
}

/// Every string inside a JSON value (message contents, content parts, inputs).
fn collect_text(v: &serde_json::Value, out: &mut String) {
    match v {
        serde_json::Value::String(s) => {
            out.push_str(s);
            out.push('\n');
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_text(x, out)),
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                // Image data and URLs are not text tokens.
                if k != "image_url" && k != "url" && k != "data" {
                    collect_text(x, out);
                }
            }
        }
        _ => {}
    }
}

/// The tokens a request may take from a deployment's quota: prompt tokens plus the
/// completion allowance (`max_tokens`, `max_completion_tokens` or `max_output_tokens`,
/// else `default_max_tokens`) times `n` / `best_of`. Embeddings get no completion.
pub fn estimate_tokens(body: &[u8], operation: &str, default_max_tokens: u64) -> u64 {
    let probe: EstimateProbe = serde_json::from_slice(body).unwrap_or_default();
    let mut text = String::new();
    for m in &probe.messages {
        collect_text(m, &mut text);
    }
    for v in [&probe.input, &probe.prompt].into_iter().flatten() {
        collect_text(v, &mut text);
    }
    // A few tokens of framing per message, as the chat format adds them.
    let prompt = if text.is_empty() && probe.messages.is_empty() {
        (body.len() as u64).div_ceil(4)
    } else {
        count_text(&text) + 4 * probe.messages.len() as u64
    };
    if operation.starts_with("embeddings") {
        return prompt.max(1);
    }
    let completion = probe
        .max_tokens
        .or(probe.max_completion_tokens)
        .or(probe.max_output_tokens)
        .unwrap_or(default_max_tokens);
    let copies = probe.best_of.or(probe.n).unwrap_or(1).clamp(1, 128);
    prompt
        .saturating_add(completion.saturating_mul(copies))
        .max(1)
}

/// A cheap estimate for every request when `[priority]` is off: body bytes / 4 plus the
/// completion allowance (`max_tokens` x `n`, 0 when unset). Each field is read on its
/// own: one of the wrong type counts as unset, and of duplicates the first counts. Good enough to pass over a
/// deployment whose tracked capacity clearly cannot take the request.
pub fn cheap_estimate(body: &[u8], operation: &str) -> u64 {
    if operation.starts_with("embeddings") {
        return cheap_estimate_of(body.len(), operation, [None; 4]);
    }
    // Four numbers read with a skip-scan: this runs on every request whose body was not
    // parsed for its model.
    let limits = top_level_members(body, LIMIT_NAMES.map(str::as_bytes)).map(|v| {
        let mut de = serde_json::Deserializer::from_slice(v?);
        u64::deserialize(&mut de).ok()
    });
    cheap_estimate_of(body.len(), operation, limits)
}

/// [`cheap_estimate`] of a body of `len` bytes whose limits are already read (by
/// `inspect_body`, in the pass that finds the model). That pass reads member names
/// unescaped (`"\u006e"` is `n`); [`cheap_estimate`]'s scan does not recognise escaped
/// names, so the two differ for such a body (a client-chosen spelling nobody sends).
pub fn cheap_estimate_of(len: usize, operation: &str, limits: Limits) -> u64 {
    let prompt = (len as u64).div_ceil(4);
    if operation.starts_with("embeddings") {
        return prompt.max(1);
    }
    let [max_tokens, max_completion, max_output, n] = limits;
    let completion = max_tokens.or(max_completion).or(max_output).unwrap_or(0);
    prompt
        .saturating_add(completion.saturating_mul(n.unwrap_or(1).clamp(1, 128)))
        .max(1)
}

/// Loads the tokenizer now (it takes a moment), so the first request does not pay for it.
pub fn warm_up() {
    let _ = tokenizer();
}

/// Whether a request may carry `stream_options`: chat and text completions, and on Azure
/// classic paths only from api-version 2024-09-01 on (older ones reject the field).
pub fn stream_usage_supported(operation: &str, api_version: Option<&str>) -> bool {
    matches!(operation, "chat/completions" | "completions")
        && api_version.is_none_or(|v| v >= "2024-09-01")
}

/// For a streaming request without `stream_options.include_usage: true`, the body with
/// it set, so the backend reports usage; `None` when nothing needs to change. The field
/// is spliced in, so every other byte of the body stays as the client sent it.
pub fn request_stream_usage(body: &[u8]) -> Option<Vec<u8>> {
    // Most bodies are settled by reading two fields, without building the whole tree;
    // the full parse below is for the rest (options to edit, or anything unusual).
    let is_object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    if let (true, Ok(probe)) = (is_object, serde_json::from_slice::<StreamProbe>(body)) {
        if !probe.stream {
            return None;
        }
        if !probe.stream_options {
            return splice_include_usage(body);
        }
    }
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let obj = v.as_object()?;
    if obj.get("stream") != Some(&serde_json::Value::Bool(true)) {
        return None;
    }
    if !obj.contains_key("stream_options") {
        return splice_include_usage(body);
    }
    let mut v = v;
    let obj = v.as_object_mut()?;
    let asked = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    if asked {
        return None;
    }
    match obj
        .get_mut("stream_options")
        .and_then(serde_json::Value::as_object_mut)
    {
        Some(opts) => {
            opts.insert("include_usage".into(), serde_json::Value::Bool(true));
        }
        None => {
            obj.insert(
                "stream_options".into(),
                serde_json::json!({"include_usage": true}),
            );
        }
    }
    serde_json::to_vec(&v).ok()
}

/// The two fields [`request_stream_usage`] decides on; every other field is skipped.
#[derive(Deserialize)]
struct StreamProbe {
    /// `"stream": true` exactly.
    #[serde(default, deserialize_with = "is_true")]
    stream: bool,
    /// Whether `stream_options` is there at all (even `null`).
    #[serde(default, deserialize_with = "present")]
    stream_options: bool,
}

fn is_true<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(serde_json::Value::deserialize(d)? == serde_json::Value::Bool(true))
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    serde::de::IgnoredAny::deserialize(d).map(|_| true)
}

/// `body` (a JSON object) with `"stream_options":{"include_usage":true}` as its first
/// member; every other byte as it was.
fn splice_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| *b == b'{')?;
    let mut out = Vec::with_capacity(body.len() + 40);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(br#""stream_options":{"include_usage":true},"#);
    out.extend_from_slice(&body[open + 1..]);
    Some(out)
}

#[derive(Debug, PartialEq, Deserialize)]
struct Usage {
    total_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

impl Usage {
    /// From its counts in the order of [`USAGE_COUNTS`].
    fn from_counts([total, prompt, completion, input, output]: [Option<u64>; 5]) -> Usage {
        Usage {
            total_tokens: total,
            prompt_tokens: prompt,
            completion_tokens: completion,
            input_tokens: input,
            output_tokens: output,
        }
    }

    fn total(&self) -> Option<u64> {
        self.total_tokens.or_else(|| {
            let a = self.prompt_tokens.or(self.input_tokens)?;
            let b = self.completion_tokens.or(self.output_tokens).unwrap_or(0);
            Some(a.saturating_add(b))
        })
    }
}

/// The `usage` total of a JSON document, if it has one. Only the `usage` member is
/// parsed; the rest of the document is skipped over: by [`last_member_usage`] when
/// `usage` is its last member (as Azure writes it), else by [`sole_top_level_usage`]
/// from the end or [`top_level_members`] from the start (this runs on every response).
/// The first `"usage"` in the document is found once, for all of them: without one there
/// is no member of that name they would recognise (none reads a key written with escapes).
pub fn usage_total(json: &[u8]) -> Option<u64> {
    let first = USAGE_FROM_START.find(json)?;
    if let Some(usage) = last_member_usage(json, first) {
        return usage.total();
    }
    let value =
        sole_top_level_usage(json, first).or_else(|| top_level_members(json, [b"usage"])[0])?;
    match plain_usage(value) {
        Plain::Read(usage, _) => usage.total(),
        Plain::Unsure => parsed_usage(value)?.total(),
    }
}

/// The usage of `json` when the only `"usage"` in it (the first, at `at`) is the key of
/// the last member of the top-level object, and its value is an object [`plain_usage`]
/// reads; `None` when it is not so. Found by two vectorized searches, the second from just after what the
/// first found: one pass over the document, without stepping through it byte by byte
/// (memchr's search from the end goes byte by byte, and cost more than both).
///
/// On well-formed JSON, a `"usage"` whose first quote is not escaped is a string
/// `usage` (its last quote follows a letter, so ends a string; its first one then opens
/// it). Followed by a colon, it is a key; when its value is followed by `}` and the end
/// of the document, that brace closes the object the key is in, and so that object is
/// the document.
fn last_member_usage(json: &[u8], at: usize) -> Option<Usage> {
    // Another one: which is the key whose value counts is for the scans to say.
    if escaped(json, at) || USAGE_FROM_START.find(&json[at + 1..]).is_some() {
        return None;
    }
    let value = member_value(&json[at + USAGE_NAME.len()..])?;
    let Plain::Read(usage, end) = plain_usage(value) else {
        return None;
    };
    let rest = json_trim_start(&value[end..]);
    (rest.first() == Some(&b'}') && json_trim_start(&rest[1..]).is_empty()).then_some(usage)
}

/// What [`plain_usage`] made of a `usage` value.
enum Plain {
    /// Read: as the parser reads it, when the object is well-formed JSON; and where
    /// the object ends (past its closing brace).
    Read(Usage, usize),
    /// Not the plain shape it reads: left to the parser.
    Unsure,
}

/// The names of [`Usage`]'s members, in the order of [`Usage::from_counts`].
const USAGE_COUNTS: [&[u8]; 5] = [
    b"total_tokens",
    b"prompt_tokens",
    b"completion_tokens",
    b"input_tokens",
    b"output_tokens",
];

/// Reads a `usage` value (and what follows it in the document, which is not looked at)
/// of the shape backends send: an object whose counts are plain integers or `null`, its
/// other members (`prompt_tokens_details`...) skipped over unread. Anything else (a key
/// with escapes, a count written `1.0`, a repeated count) is `Unsure`, for the parser
/// to settle: a parse of the usage object cost several times this scan. On well-formed
/// JSON it reads what the parser reads. It does not check the syntax of what it skips:
/// in a malformed object (a trailing comma, a bad literal in a skipped member) it may
/// read the counts the parser would refuse; the usage is then counted, not lost.
fn plain_usage(value: &[u8]) -> Plain {
    match compact_usage(value) {
        Some((usage, end)) => Plain::Read(usage, end),
        None => scanned_usage(value),
    }
}

/// [`plain_usage`] by the member scan, which takes any spacing and skips any value.
fn scanned_usage(value: &[u8]) -> Plain {
    if json_trim_start(value).first() != Some(&b'{') {
        return Plain::Unsure;
    }
    let mut counts: [Option<Option<u64>>; 5] = [None; 5];
    let mut sure = true;
    let scanned = scan_members(value, |key, rest| {
        // Folded over the bytes without a branch (vectorized): a short key costs less
        // than a call to `memchr`, which `contains` makes.
        if key.iter().fold(false, |seen, &b| seen | (b == b'\\')) {
            sure = false;
        } else if let Some(i) = USAGE_COUNTS.iter().position(|n| *n == key) {
            match (counts[i], plain_count(rest)) {
                (None, Some(n)) => counts[i] = Some(n),
                _ => sure = false,
            }
        }
        sure
    });
    match (scanned, sure) {
        (Some(Scanned::Ended(end)), true) => {
            Plain::Read(Usage::from_counts(counts.map(Option::flatten)), end)
        }
        _ => Plain::Unsure,
    }
}

/// A `usage` object as serializers write it, without spaces: members whose values are
/// counts (plain integers or `null`) or objects of counts (Azure's `*_details`). Read
/// front to back in one pass that knows the shape, where the member scan looked for each
/// key's end with `memchr2` and then stepped through the value byte by byte
/// (`usage_total` of the mock's answer went from 1,475 to 1,024 instructions, of an Azure
/// answer with details from 2,789 to 2,382). `None` for anything else, a repeated count
/// included: the member scan then reads it as before. Where it reads, the scan reads the
/// same (a test checks it).
fn compact_usage(value: &[u8]) -> Option<(Usage, usize)> {
    let mut counts: [Option<Option<u64>>; 5] = [None; 5];
    let end = compact_object(value, 0, |key, at| {
        match USAGE_COUNTS.iter().position(|n| *n == key) {
            Some(k) => {
                let (n, after) = compact_count(value, at)?;
                counts[k].replace(n).is_none().then_some(after)
            }
            // An object of counts, skipped unread.
            None if value.get(at) == Some(&b'{') => {
                compact_object(value, at, |_, at| Some(compact_count(value, at)?.1))
            }
            None => Some(compact_count(value, at)?.1),
        }
    })?;
    Some((Usage::from_counts(counts.map(Option::flatten)), end))
}

/// Past the compact object that opens at `i`: `member` is given each key and where its
/// value starts, and says where the value ends. `None` when it is not such an object or
/// `member` gives `None`.
fn compact_object(
    json: &[u8],
    mut i: usize,
    mut member: impl FnMut(&[u8], usize) -> Option<usize>,
) -> Option<usize> {
    if json.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    if json.get(i) != Some(&b'}') {
        loop {
            let (key, at) = compact_key(json, i)?;
            i = member(key, at)?;
            match json.get(i)? {
                b',' => i += 1,
                b'}' => break,
                _ => return None,
            }
        }
    }
    Some(i + 1)
}

/// The key whose opening quote is at `i`, when it has no escapes (nor control bytes,
/// which JSON does not allow in a string) and a colon right after it; and where its
/// value starts.
fn compact_key(json: &[u8], i: usize) -> Option<(&[u8], usize)> {
    if json.get(i) != Some(&b'"') {
        return None;
    }
    let start = i + 1;
    // A backslash or a control byte stops it too: escapes are for the member scan.
    let end = start + spillgate_core::request::string_stop(json.get(start..)?)?;
    (json[end] == b'"' && json.get(end + 1) == Some(&b':')).then(|| (&json[start..end], end + 2))
}

/// The count at `i` (a plain integer or `null`) and where it ends; `None` for any other
/// value. What follows it is for the caller to check.
fn compact_count(json: &[u8], i: usize) -> Option<(Option<u64>, usize)> {
    let rest = json.get(i..)?;
    if rest.starts_with(b"null") {
        return Some((None, i + 4));
    }
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    // A leading zero is not JSON; no digits, `decimal`'s `None`.
    if digits > 1 && rest[0] == b'0' {
        return None;
    }
    Some((Some(crate::h1::decimal(&rest[..digits])?), i + digits))
}

/// A count's value: `Some(None)` for `null`, `Some(Some(n))` for a plain integer (digits,
/// no leading zero, no fraction or exponent, within `u64`); `None` for anything else.
fn plain_count(rest: &[u8]) -> Option<Option<u64>> {
    let rest = json_trim_start(rest);
    let (n, end) = compact_count(rest, 0)?;
    rest.get(end)
        .is_some_and(|&b| b == b',' || b == b'}' || is_json_space(b))
        .then_some(n)
}

/// `bytes` without the JSON whitespace it starts with.
fn json_trim_start(bytes: &[u8]) -> &[u8] {
    let n = bytes.iter().take_while(|&&b| is_json_space(b)).count();
    &bytes[n..]
}

/// A `usage` value read by the JSON parser: `None` when it is `null` or does not parse
/// as one.
fn parsed_usage(value: &[u8]) -> Option<Usage> {
    // A short rest (usage last, as models put it) is read as text when it is UTF-8:
    // checked once, the parser then skips the check of each key. A long one is not
    // checked whole for the few bytes the parser reads.
    let text = (value.len() <= 1024)
        .then(|| std::str::from_utf8(value).ok())
        .flatten();
    let usage = match text {
        Some(text) => Option::<Usage>::deserialize(&mut serde_json::Deserializer::from_str(text)),
        None => Option::<Usage>::deserialize(&mut serde_json::Deserializer::from_slice(value)),
    };
    usage.ok()?
}

/// When the first `"usage"` in `json` (at `first`) is a key of the top-level object: the
/// bytes from its value to the end of `json`. Found by a scan from the end of the document back to
/// the key, which is short: models' answers put `usage` last (Azure) or nearly (OpenAI,
/// before `service_tier` and `system_fingerprint`), where the forward scan reads the whole
/// answer. `None` when this cannot tell: the caller then scans from the start.
fn sole_top_level_usage(json: &[u8], first: usize) -> Option<&[u8]> {
    // From the end: outside strings, counting how deep in objects and arrays. A quote is
    // a string's edge unless an odd number of backslashes precede it; a string is stepped
    // over from its closing quote to its opening one with `memrchr`, not byte by byte.
    let mut depth = 0usize;
    let mut i = json.len();
    while i > 0 {
        i -= 1;
        match json[i] {
            b'"' if !escaped(json, i) => {
                let close = i;
                loop {
                    i = memchr::memrchr(b'"', &json[..i])?;
                    if !escaped(json, i) {
                        break;
                    }
                }
                // A key of the top-level object, and no `"usage"` anywhere before it (so
                // no earlier member of that name either: the first one counts).
                if depth == 1 && &json[i..=close] == USAGE_NAME {
                    if let Some(value) = member_value(&json[close + 1..]) {
                        return (first == i).then_some(value);
                    }
                }
            }
            b'}' | b']' => depth += 1,
            b'{' | b'[' => depth = depth.checked_sub(1)?,
            _ => {}
        }
    }
    None
}

/// After a string, what follows its `:` when it is a member's key (whitespace allowed
/// before the colon); `None` when it is not.
fn member_value(after_string: &[u8]) -> Option<&[u8]> {
    let colon = after_string.iter().position(|b| !b.is_ascii_whitespace())?;
    (after_string[colon] == b':').then(|| &after_string[colon + 1..])
}

/// Whether the byte at `i` is escaped: an odd number of backslashes right before it.
fn escaped(json: &[u8], i: usize) -> bool {
    json[..i].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

/// For each of `keys`, the bytes from the value of that top-level member of the JSON
/// object `json` to the end of `json` (`None` when absent; the first of duplicates
/// counts). One pass that skips strings with their escapes, so a key inside a string or
/// in a nested object never matches: a fraction of the cost of a full parse. A key
/// written with escapes (`"\u0075sage"`) is not recognised.
fn top_level_members<'a, const N: usize>(
    json: &'a [u8],
    keys: [&[u8]; N],
) -> [Option<&'a [u8]>; N] {
    let mut found = [None; N];
    let mut left = N;
    let _ = scan_members(json, |key, rest| {
        if let Some(i) = keys.iter().position(|k| *k == key) {
            if found[i].is_none() {
                found[i] = Some(rest);
                left -= 1;
            }
        }
        left > 0
    });
    found
}

/// How [`scan_members`] ended.
enum Scanned {
    /// Its callback said to stop.
    Stopped,
    /// At the end of the object: this far into `json` (past the closing brace).
    Ended(usize),
}

/// Calls `member(key, rest)` for each member of the object `json` starts with (`rest`
/// starts at the member's value) while it returns true. `Some` when it was stopped or the
/// object ended; `None` when `json` ended first or is not an object.
fn scan_members<'a>(
    json: &'a [u8],
    mut member: impl FnMut(&[u8], &'a [u8]) -> bool,
) -> Option<Scanned> {
    let mut depth = 0usize;
    let mut i = 0;
    while let Some(&c) = json.get(i) {
        match c {
            b'"' => {
                let start = i + 1;
                let mut j = start;
                let end = loop {
                    let k = j + memchr::memchr2(b'"', b'\\', json.get(j..)?)?;
                    if json[k] == b'"' {
                        break k;
                    }
                    j = k + 2;
                };
                i = end + 1;
                if depth == 1 {
                    if let Some(value) = member_value(json.get(i..)?) {
                        if !member(&json[start..end], value) {
                            return Some(Scanned::Stopped);
                        }
                    }
                }
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(Scanned::Ended(i + 1));
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Largest non-streamed response body kept aside to read its `usage`.
const JSON_TAP_LIMIT: usize = 4 * 1024 * 1024;
/// Room the copy of a JSON body that came in pieces starts with (kept until the body
/// ends).
const JSON_TAP_ROOM: usize = 4096;

/// The usage of a non-streamed body taken whole (see [`crate::whole`]): what a
/// [`UsageTap`] reads at the end of the same body.
pub fn whole_json_usage(json_body: bool, body: &[u8]) -> Option<u64> {
    if json_body && body.len() <= JSON_TAP_LIMIT {
        usage_total(body)
    } else {
        None
    }
}

/// Adds a chunk of a JSON body to `json`, which gives up past [`JSON_TAP_LIMIT`] bytes.
fn keep_json(json: &mut Option<Joined>, data: &Bytes) {
    if let Some(j) = json {
        if j.len() + data.len() > JSON_TAP_LIMIT {
            *json = None;
        } else {
            j.push(data.clone(), JSON_TAP_ROOM);
        }
    }
}

/// Passes a response body through while reading its `usage`. For SSE it reads event by
/// event (`\n\n`-separated). Without `strip_usage_chunk` every chunk goes on as it came
/// (only the unfinished tail of an event is kept aside, to read); with it, complete events
/// are passed on and the usage-only chunk the gateway asked for is dropped.
pub struct UsageTap<B, F: FnOnce(Option<u64>)> {
    inner: B,
    sse: bool,
    /// Keep a copy of a JSON body to read its `usage` at the end.
    json_body: bool,
    strip_usage_chunk: bool,
    pending: BytesMut,
    /// A copy of a JSON body (most come in one chunk, kept as it came) to read its
    /// `usage` at the end; `None` once the body passed [`JSON_TAP_LIMIT`]: it is not read
    /// (a copy with a gap could be misread).
    json: Option<Joined>,
    usage: Option<u64>,
    /// Called once with the usage total the response reported (or `None`); held inline,
    /// so the gateway's closure costs no allocation of its own.
    on_usage: Option<F>,
}

impl<B, F: FnOnce(Option<u64>)> UsageTap<B, F> {
    pub fn new(inner: B, sse: bool, json_body: bool, strip_usage_chunk: bool, on_usage: F) -> Self {
        UsageTap {
            inner,
            sse,
            json_body,
            strip_usage_chunk,
            pending: BytesMut::new(),
            json: Some(Joined::Empty),
            usage: None,
            on_usage: Some(on_usage),
        }
    }

    fn finish(&mut self) {
        if !self.sse && self.usage.is_none() {
            self.usage = self.json.as_ref().and_then(|j| usage_total(j.as_slice()));
        }
        if let Some(f) = self.on_usage.take() {
            f(self.usage);
        }
    }

    /// Reads the usage of one complete event; true when it is the usage-only chunk that
    /// `strip_usage_chunk` drops.
    fn read_event(&mut self, event: &[u8]) -> bool {
        let Some(payload) = sse_data(event) else {
            return false;
        };
        if !has_usage_key(payload) {
            return false;
        }
        let Some(total) = usage_total(payload) else {
            return false;
        };
        self.usage = Some(total);
        self.strip_usage_chunk && is_usage_only_chunk(payload)
    }

    /// Passes on the complete events of `data` (after the tail `pending` held), reading
    /// their usage and leaving out the usage-only chunk; the unfinished tail stays in
    /// `pending`. Chunks without usage (all but the last few of a stream) go on as they
    /// came, without a copy.
    fn pass_events(&mut self, data: Bytes) -> Bytes {
        let buf = if self.pending.is_empty() {
            data
        } else {
            self.pending.extend_from_slice(&data);
            self.pending.split().freeze()
        };
        let end = last_event_end(&buf);
        self.pending.extend_from_slice(&buf[end..]);
        let complete = buf.slice(..end);
        if !has_usage_key(&complete) {
            return complete;
        }
        let mut out = BytesMut::with_capacity(complete.len());
        let mut rest: &[u8] = &complete;
        while let Some(e) = find_event_end(rest) {
            if !self.read_event(&rest[..e]) {
                out.extend_from_slice(&rest[..e]);
            }
            rest = &rest[e..];
        }
        out.extend_from_slice(rest);
        out.freeze()
    }

    /// Reads the events `data` completes without holding any byte back: only the
    /// unfinished tail stays in `pending`.
    fn observe(&mut self, data: &[u8]) {
        if self.pending.is_empty() {
            let end = last_event_end(data);
            self.read_events(&data[..end]);
            self.pending.extend_from_slice(&data[end..]);
        } else {
            self.pending.extend_from_slice(data);
            let end = last_event_end(&self.pending);
            let complete = self.pending.split_to(end);
            self.read_events(&complete);
        }
    }

    /// Reads the usage of a run of complete events; most runs carry none and are
    /// settled by one search.
    fn read_events(&mut self, complete: &[u8]) {
        if !has_usage_key(complete) {
            return;
        }
        let mut rest = complete;
        while let Some(e) = find_event_end(rest) {
            self.read_event(&rest[..e]);
            rest = &rest[e..];
        }
    }
}

/// The name of the `usage` member, as it is written in JSON.
const USAGE_NAME: &[u8] = b"\"usage\"";
/// The search for [`USAGE_NAME`], built once.
static USAGE_FROM_START: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(USAGE_NAME));
/// What marks the one chunk of a stream worth parsing: [`USAGE_NAME`] as a key.
const USAGE_KEY: &[u8] = b"\"usage\":";

/// Whether `data` contains [`USAGE_KEY`]. The searcher is built once: `memmem::find`
/// builds one per call, which cost more than the search on a stream's small chunks.
fn has_usage_key(data: &[u8]) -> bool {
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(USAGE_KEY));
    FINDER.find(data).is_some()
}

/// End (exclusive) of the first complete event: after its blank line (`\n\n` or
/// `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\n', buf).find_map(|i| blank_line_ends_at(buf, i))
}

/// End (exclusive) of the last complete event, 0 when none is complete: everything
/// before it is whole events.
fn last_event_end(buf: &[u8]) -> usize {
    memchr::memrchr_iter(b'\n', buf)
        .find_map(|i| blank_line_ends_at(buf, i))
        .unwrap_or(0)
}

/// Whether the line feed at `i` ends a blank line (after `\n` or `\r\n\r`): the
/// end of an event, returned as the index after it.
fn blank_line_ends_at(buf: &[u8], i: usize) -> Option<usize> {
    let blank = (i >= 1 && buf[i - 1] == b'\n') || (i >= 3 && &buf[i - 3..i] == b"\r\n\r");
    blank.then_some(i + 1)
}

/// The `data:` payload of a one-line SSE event.
fn sse_data(event: &[u8]) -> Option<&[u8]> {
    let line = event.strip_prefix(b"data:")?;
    let line = line.strip_prefix(b" ").unwrap_or(line);
    let end = line
        .iter()
        .position(|c| *c == b'\n' || *c == b'\r')
        .unwrap_or(line.len());
    Some(&line[..end])
}

/// The chunk `include_usage` adds: empty `choices` and a `usage` object.
fn is_usage_only_chunk(payload: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| {
            v.get("choices")
                .and_then(|c| c.as_array())
                .map(Vec::is_empty)
        })
        .unwrap_or(false)
}

impl<B, F> HttpBody for UsageTap<B, F>
where
    B: HttpBody<Data = Bytes> + Unpin,
    F: FnOnce(Option<u64>) + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    let rest = if this.strip_usage_chunk {
                        this.pending.split().freeze()
                    } else {
                        // Already passed on as it came.
                        Bytes::new()
                    };
                    this.finish();
                    if rest.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(rest))));
                }
                Poll::Ready(Some(Err(e))) => {
                    this.finish();
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(d) => d,
                        Err(frame) => return Poll::Ready(Some(Ok(frame))),
                    };
                    if !this.sse {
                        if this.json_body {
                            keep_json(&mut this.json, &data);
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    if !this.strip_usage_chunk {
                        this.observe(&data);
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    let out = this.pass_events(data);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                    // Only a partial event so far (or a dropped usage chunk): read on.
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream() && (!self.strip_usage_chunk || self.pending.is_empty())
    }

    fn size_hint(&self) -> SizeHint {
        if self.sse && self.strip_usage_chunk {
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

impl<B, F: FnOnce(Option<u64>)> Drop for UsageTap<B, F> {
    fn drop(&mut self) {
        // hyper stops polling a body once it has the bytes its content-length declared,
        // and a client may go away mid-response: either way the end is seen here, and the
        // usage (read from what did arrive) and the reservation are still settled.
        if self.on_usage.is_some() {
            self.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;
    use http_body_util::{BodyExt, StreamBody};
    use proptest::strategy::Strategy;
    use std::sync::{Arc, Mutex};

    /// What a full parse finds: the top-level `usage` object's total.
    fn usage_by_full_parse(json: &[u8]) -> Option<u64> {
        let v: serde_json::Value = serde_json::from_slice(json).ok()?;
        let u = v.as_object()?.get("usage")?.clone();
        serde_json::from_value::<Option<Usage>>(u).ok()??.total()
    }

    #[test]
    fn usage_is_read_from_the_top_level_member_only() {
        let cases: [(&str, Option<u64>); 10] = [
            (
                r#"{"id":"x","usage":{"prompt_tokens":19,"completion_tokens":4,"total_tokens":23}}"#,
                Some(23),
            ),
            (
                r#"{ "usage" : {"input_tokens":5,"output_tokens":2} , "id":1}"#,
                Some(7),
            ),
            (r#"{"usage":null}"#, None),
            (r#"{"choices":[{"usage":{"total_tokens":9}}]}"#, None),
            (
                r#"{"meta":{"usage":{"total_tokens":9}},"usage":{"total_tokens":3}}"#,
                Some(3),
            ),
            (
                r#"{"text":"\"usage\":{\"total_tokens\":9}","usage":{"total_tokens":4}}"#,
                Some(4),
            ),
            (r#"{"a\"usage":{"total_tokens":9}}"#, None),
            (r#"{"k":"\\","usage":{"total_tokens":6}}"#, Some(6)),
            (r#"["usage",{"total_tokens":1}]"#, None),
            (r#"{"text":"unterminated"#, None),
        ];
        for (json, want) in cases {
            assert_eq!(usage_total(json.as_bytes()), want, "{json}");
            assert_eq!(usage_by_full_parse(json.as_bytes()), want, "{json}");
        }
    }

    /// [`sole_top_level_usage`] as [`usage_total`] calls it.
    fn sole(json: &[u8]) -> Option<&[u8]> {
        sole_top_level_usage(json, USAGE_FROM_START.find(json)?)
    }

    #[test]
    fn a_sole_top_level_usage_is_found_from_the_end() {
        let found = [
            r#"{"choices":[{"message":{"content":"}{]["}}],"id":"x","usage":{"total_tokens":35}}"#,
            r#"{"id":"x","usage":{"total_tokens":35},"service_tier":"default","system_fingerprint":"fp_\"}"}"#,
            "{\n  \"usage\" :\t{\"total_tokens\": 35}\n}\n",
            // Strings that end in an escaped backslash, or hold escaped quotes and braces.
            r#"{"usage":{"total_tokens":35},"s":"a\\","t":"\"}{\\\"","u":["\\"]}"#,
            // What the mock backend answers.
            r#"{"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"message":{"content":"Hello from b","refusal":null,"role":"assistant"}}],"created":1795255243,"id":"chatcmpl-mock1","model":"gpt-4o","object":"chat.completion","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":32,"total_tokens":35}}"#,
        ];
        for json in found {
            let value = sole(json.as_bytes());
            assert!(
                value.is_some_and(|v| v.trim_ascii_start().starts_with(b"{\"")),
                "{json}"
            );
            assert_eq!(usage_total(json.as_bytes()), Some(35), "{json}");
        }
        // Left to the scan from the start.
        let not_found = [
            r#"{"a":{"usage":{"total_tokens":1}}}"#,
            r#"{"a":"usage"}"#,
            r#"{"a":"x\"usage\":1"}"#,
            r#"[{"usage":{"total_tokens":1}}]"#,
            // The last top-level one is not the first.
            r#"{"usage":{"total_tokens":1},"usage":{"total_tokens":2}}"#,
            r#"{"a":"usage","usage":{"total_tokens":2}}"#,
            r#"{"a":"\"usage"}"#,
        ];
        for json in not_found {
            assert_eq!(sole(json.as_bytes()), None, "{json}");
        }
        // Two of them: the first counts, as in a scan from the start.
        assert_eq!(
            usage_total(br#"{"usage":{"total_tokens":1},"usage":{"total_tokens":2}}"#),
            Some(1)
        );
        // A nested one after the top-level one is passed over from the end.
        let nested_after = br#"{"usage":{"total_tokens":1},"b":{"usage":{"total_tokens":2}}}"#;
        assert!(sole(nested_after).is_some());
        assert_eq!(usage_total(nested_after), Some(1));
    }

    /// A `usage` written last, as Azure writes it, is read without a scan; anything else
    /// is left to the scans, which read it as before.
    #[test]
    fn a_last_usage_member_is_read_without_a_scan() {
        let fast =
            |json: &[u8]| last_member_usage(json, USAGE_FROM_START.find(json)?).map(|u| u.total());
        let azure = br#"{"choices":[{"message":{"content":"the \"usage\": {\"total_tokens\":9}}"}}],"id":"x","usage":{"completion_tokens":4,"prompt_tokens":32,"total_tokens":36}}"#;
        assert_eq!(fast(azure), Some(Some(36)));
        let pretty = b"{\n  \"id\": \"x\",\n  \"usage\" : {\n    \"completion_tokens\": 4,\n    \"prompt_tokens\": 5\n  }\n}\n";
        assert_eq!(fast(pretty), Some(Some(9)));
        // Left to the scans: nested, not last, twice, a count to parse, not an object.
        let cases: [(&[u8], Option<u64>); 6] = [
            (br#"{"a":{"usage":{"total_tokens":1}}}"#, None),
            (br#"{"a":[{"usage":{"total_tokens":1}}]}"#, None),
            (br#"{"usage":{"total_tokens":1},"b":2}"#, Some(1)),
            (
                br#"{"usage":{"total_tokens":1},"usage":{"total_tokens":2}}"#,
                Some(1),
            ),
            (br#"{"a":1,"usage":{"total_\u0074okens":1}}"#, Some(1)),
            (br#"["usage",{"usage":{"total_tokens":1}}]"#, None),
        ];
        for (json, total) in cases {
            let text = String::from_utf8_lossy(json);
            assert!(fast(json).is_none(), "{text}");
            assert_eq!(usage_total(json), total, "{text}");
        }
    }

    /// What Azure and OpenAI send, details included, is read by the compact pass; spaced
    /// out, it is left to the member scan.
    #[test]
    fn backends_usage_objects_take_the_compact_reading() {
        let azure = br#"{"completion_tokens":10,"completion_tokens_details":{"accepted_prediction_tokens":0,"audio_tokens":0,"reasoning_tokens":0,"rejected_prediction_tokens":0},"prompt_tokens":19,"prompt_tokens_details":{"audio_tokens":0,"cached_tokens":0},"total_tokens":29}}"#;
        let (usage, end) = compact_usage(azure).expect("Azure's usage");
        assert_eq!((usage.total(), end), (Some(29), azure.len() - 1));
        let responses = br#"{"input_tokens":5,"input_tokens_details":{"cached_tokens":0},"output_tokens":2,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":7}"#;
        assert_eq!(
            compact_usage(responses).map(|(u, _)| u.total()),
            Some(Some(7))
        );
        let spaced = br#"{"prompt_tokens": 4, "total_tokens": 6}"#;
        assert!(compact_usage(spaced).is_none());
        assert!(matches!(plain_usage(spaced), Plain::Read(u, _) if u.total() == Some(6)));
    }

    #[test]
    fn plain_usage_reads_what_backends_send_and_leaves_the_rest_to_the_parser() {
        let read = |json: &str| match plain_usage(json.as_bytes()) {
            Plain::Read(u, _) => Some(u.total()),
            Plain::Unsure => None,
        };
        // Azure's and OpenAI's shapes, details skipped; `null` counts; what follows the
        // object is not looked at.
        let azure = r#"{"completion_tokens":10,"completion_tokens_details":{"accepted_prediction_tokens":0,"audio_tokens":0,"reasoning_tokens":0,"rejected_prediction_tokens":0},"prompt_tokens":19,"prompt_tokens_details":{"audio_tokens":0,"cached_tokens":0},"total_tokens":29}}"#;
        assert_eq!(read(azure), Some(Some(29)));
        assert_eq!(
            read(" {\n \"prompt_tokens\" : 4 ,\"completion_tokens\":null}\n,\"x\":[}"),
            Some(Some(4))
        );
        assert_eq!(
            read(r#"{"input_tokens":5,"output_tokens":2}"#),
            Some(Some(7))
        );
        assert_eq!(read(r#"{"total_tokens":null}"#), Some(None));
        assert_eq!(
            read(r#"{"note":"a \"total_tokens\": 9","total_tokens":3}"#),
            Some(Some(3))
        );
        // Left to the parser.
        for unsure in [
            r#"{"total_tokens":1.0}"#,
            r#"{"total_tokens":1e3}"#,
            r#"{"total_tokens":-1}"#,
            r#"{"total_tokens":01}"#,
            r#"{"total_tokens":"5"}"#,
            r#"{"total_tokens":18446744073709551616}"#,
            r#"{"total_tokens":1,"total_tokens":2}"#,
            r#"{"total_\u0074okens":1}"#,
            r#"{"total_tokens":nul}"#,
            r#"{"total_tokens":1"#,
            r#"{"total_tokens":1,"#,
            r#"{"total_tokens":1 "#,
            r#"{"total_tokens":1,"x":"}"#,
            "{\"total_tokens\":\x0c1}",
            "\x0c{\"total_tokens\":1}",
            r#"[1,2,3,4,5]"#,
            "null",
        ] {
            assert_eq!(read(unsure), None, "{unsure}");
        }
        // Malformed where it is skipped: the counts are read all the same.
        assert_eq!(read(r#"{"total_tokens":5,"x":tru}"#), Some(Some(5)));
        // And the parser reads them as it always did.
        assert_eq!(
            usage_total(br#"{"usage":{"total_tokens":1,"total_tokens":2}}"#),
            None
        );
        assert_eq!(
            usage_total(br#"{"usage":{"total_\u0074okens":7}}"#),
            Some(7)
        );
        assert_eq!(usage_total(br#"{"usage":{"total_tokens":1.0}}"#), None);
        assert_eq!(usage_total(br#"{"usage":null}"#), None);
        let huge = format!(
            r#"{{"usage":{{"prompt_tokens":{},"completion_tokens":2}}}}"#,
            u64::MAX
        );
        assert_eq!(usage_total(huge.as_bytes()), Some(u64::MAX));
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let key = prop_oneof![
            Just("usage".to_string()),
            Just("total_tokens".to_string()),
            Just("prompt_tokens".to_string()),
            "[a-z\"\\\\:{}\\[\\], ]{0,8}",
        ];
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            (0u64..1000).prop_map(serde_json::Value::from),
            "[a-z\"\\\\:{}\\[\\], ]{0,12}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 40, 6, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::vec((key.clone(), inner), 0..5)
                    .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn a_json_body_past_the_tap_limit_is_not_read_for_usage() {
        let mut c = Some(Joined::Empty);
        keep_json(&mut c, &Bytes::from(vec![b' '; JSON_TAP_LIMIT - 10]));
        keep_json(&mut c, &Bytes::from(vec![b' '; 20]));
        keep_json(
            &mut c,
            &Bytes::from_static(br#"{"usage":{"total_tokens":5}}"#),
        );
        assert!(c.is_none());
        let mut small = Some(Joined::Empty);
        keep_json(&mut small, &Bytes::from_static(br#"{"usage":"#));
        keep_json(&mut small, &Bytes::from_static(br#"{"total_tokens":5}}"#));
        assert!(
            matches!(&small, Some(j @ Joined::Many(_)) if usage_total(j.as_slice()) == Some(5))
        );
    }

    /// The cheap estimate as a full parse computes it.
    fn cheap_by_full_parse(body: &[u8]) -> u64 {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
        let completion = num("max_tokens")
            .or(num("max_completion_tokens"))
            .or(num("max_output_tokens"))
            .unwrap_or(0);
        (body.len() as u64)
            .div_ceil(4)
            .saturating_add(completion.saturating_mul(num("n").unwrap_or(1).clamp(1, 128)))
            .max(1)
    }

    #[test]
    fn cheap_estimate_reads_the_top_level_limits() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"\"n\": 99"}],"max_tokens":70,"n":2}"#;
        assert_eq!(
            cheap_estimate(body, "chat/completions"),
            (body.len() as u64).div_ceil(4) + 140
        );
        let nested = br#"{"tools":[{"max_tokens":900}],"max_completion_tokens":10}"#;
        assert_eq!(
            cheap_estimate(nested, "chat/completions"),
            (nested.len() as u64).div_ceil(4) + 10
        );
        let odd = br#"{"max_tokens":"70","max_output_tokens":5,"n":-1}"#;
        assert_eq!(
            cheap_estimate(odd, "responses"),
            (odd.len() as u64).div_ceil(4) + 5
        );
        assert_eq!(
            cheap_estimate(body, "embeddings"),
            (body.len() as u64).div_ceil(4)
        );
        // Duplicates: the first counts, in both readings.
        let twice = br#"{"max_tokens":"x","n":3,"max_tokens":9,"n":1,"max_completion_tokens":4}"#;
        assert_eq!(
            cheap_estimate(twice, "chat/completions"),
            (twice.len() as u64).div_ceil(4) + 12
        );
        for b in [&body[..], &nested[..], &odd[..], &twice[..]] {
            let info = spillgate_core::request::inspect_body(b).unwrap();
            assert_eq!(
                cheap_estimate_of(b.len(), "chat/completions", info.limits),
                cheap_estimate(b, "chat/completions"),
                "{}",
                String::from_utf8_lossy(b)
            );
        }
        // Escaped member names: read by the model pass only.
        let escaped = br#"{"\u006e":5,"max_tokens":10}"#;
        let info = spillgate_core::request::inspect_body(escaped).unwrap();
        let prompt = (escaped.len() as u64).div_ceil(4);
        assert_eq!(
            cheap_estimate_of(escaped.len(), "chat/completions", info.limits),
            prompt + 50
        );
        assert_eq!(cheap_estimate(escaped, "chat/completions"), prompt + 10);
        for b in [&body[..], &nested[..], &odd[..]] {
            assert_eq!(
                cheap_estimate(b, "chat/completions"),
                cheap_by_full_parse(b)
            );
        }
    }

    /// A count as written and whether it is a plain one: digits (no leading zero) or
    /// `null`; else a number the parser reads otherwise or refuses.
    fn usage_count() -> impl proptest::strategy::Strategy<Value = (String, bool)> {
        use proptest::prelude::*;
        prop_oneof![
            4 => any::<u64>().prop_map(|n| (n.to_string(), true)),
            1 => Just(("null".to_string(), true)),
            1 => prop_oneof![Just("01"), Just("1.5"), Just("-1"), Just("1e3"), Just("18446744073709551616"), Just("true")]
                .prop_map(|v| (v.to_string(), false)),
        ]
    }

    /// A member name, now and then with a backslash (an escape, or not JSON).
    fn key() -> impl proptest::strategy::Strategy<Value = String> {
        proptest::prop_oneof![8 => "[a-z_]{0,8}", 1 => "[a-z_\\\\]{0,6}"]
    }

    proptest::proptest! {
        #[test]
        fn cheap_estimate_agrees_with_a_full_parse(
            v in json_value(),
            limits in proptest::collection::vec((0usize..4, 0u64..100_000), 0..4),
        ) {
            let mut v = v;
            if let Some(obj) = v.as_object_mut() {
                for (k, n) in limits {
                    let key = ["max_tokens", "max_completion_tokens", "max_output_tokens", "n"][k];
                    obj.insert(key.into(), n.into());
                }
            }
            let body = serde_json::to_vec(&v).unwrap();
            proptest::prop_assert_eq!(cheap_estimate(&body, "chat/completions"), cheap_by_full_parse(&body));
            // The limits read with the model give the same estimate.
            if let Ok(info) = spillgate_core::request::inspect_body(&body) {
                proptest::prop_assert_eq!(
                    cheap_estimate_of(body.len(), "chat/completions", info.limits),
                    cheap_by_full_parse(&body)
                );
            }
        }

        /// On any document, compact or pretty, the skip-scan reads what a full parse reads.
        #[test]
        fn usage_total_agrees_with_a_full_parse(
            v in json_value(),
            usage in proptest::option::of((0u64..1000, 0u64..1000, proptest::option::of(0u64..5000))),
            pretty in proptest::bool::ANY,
        ) {
            let mut v = v;
            if let (Some((p, c, t)), Some(obj)) = (usage, v.as_object_mut()) {
                let mut u = serde_json::json!({"prompt_tokens": p, "completion_tokens": c});
                if let Some(t) = t {
                    u["total_tokens"] = t.into();
                }
                obj.insert("usage".into(), u);
            }
            let json = if pretty { serde_json::to_vec_pretty(&v) } else { serde_json::to_vec(&v) }.unwrap();
            proptest::prop_assert_eq!(usage_total(&json), usage_by_full_parse(&json));
        }

        /// The compact reading reads what the member scan reads, where it reads; and it
        /// reads every compact object of counts and objects of counts.
        #[test]
        fn the_compact_reading_agrees_with_the_member_scan(
            members in proptest::collection::vec(proptest::prop_oneof![
                6 => (0usize..5, usage_count()).prop_map(|(i, v)| {
                    (format!("\"{}\":{}", std::str::from_utf8(USAGE_COUNTS[i]).unwrap(), v.0), v.1, Some(i))
                }),
                // Count names in a details object are skipped, not counted.
                3 => ("[a-z_]{0,8}", proptest::collection::vec((proptest::prop_oneof![
                    3 => key(),
                    1 => proptest::sample::select(&USAGE_COUNTS[..])
                        .prop_map(|n| String::from_utf8_lossy(n).into_owned()),
                ], usage_count()), 0..4)).prop_map(|(k, inner)| {
                    let plain = inner.iter().all(|(k, v)| v.1 && !k.contains('\\'));
                    let inner: Vec<String> = inner.into_iter().map(|(k, v)| format!("\"{k}\":{}", v.0)).collect();
                    (format!("\"{k}_details\":{{{}}}", inner.join(",")), plain, None)
                }),
                3 => (key(), usage_count()).prop_map(|(k, v)| {
                    let plain = v.1 && !k.contains('\\');
                    (format!("\"{k}\":{}", v.0), plain, None)
                }),
                1 => proptest::strategy::Just((r#""s":"text""#.to_string(), false, None)),
                1 => proptest::strategy::Just((r#""a" : 1"#.to_string(), false, None)),
            ], 0..6),
            tail in proptest::prop_oneof![proptest::strategy::Just(""), proptest::strategy::Just("}"), proptest::strategy::Just(",\"x\":[}"), proptest::strategy::Just(" ")],
        ) {
            let json = format!("{{{}}}{tail}", members.iter().map(|m| m.0.as_str()).collect::<Vec<_>>().join(","));
            let mut seen = [false; 5];
            let plain = members.iter().all(|(_, plain, count)| {
                *plain && count.is_none_or(|i| !std::mem::replace(&mut seen[i], true))
            });
            let compact = compact_usage(json.as_bytes());
            if let Some((usage, end)) = &compact {
                match scanned_usage(json.as_bytes()) {
                    Plain::Read(u, e) => {
                        proptest::prop_assert_eq!((usage, *end), (&u, e), "{}", json);
                    }
                    Plain::Unsure => proptest::prop_assert!(false, "the scan is unsure of {}", json),
                }
            }
            proptest::prop_assert_eq!(compact.is_some(), plain, "{}", json);
        }

        /// Whatever a well-formed `usage` value holds, the scan reads it as the parser
        /// does or leaves it to the parser.
        #[test]
        fn plain_usage_never_disagrees_with_the_parser(
            v in json_value(),
            counts in proptest::collection::vec((0usize..5, proptest::option::of(0u64..u64::MAX)), 0..4),
            pretty in proptest::bool::ANY,
        ) {
            let mut v = v;
            if let Some(obj) = v.as_object_mut() {
                for (i, n) in counts {
                    let name = std::str::from_utf8(USAGE_COUNTS[i]).unwrap();
                    obj.insert(name.into(), n.into());
                }
            }
            let json = if pretty { serde_json::to_vec_pretty(&v) } else { serde_json::to_vec(&v) }.unwrap();
            if let Plain::Read(usage, _) = plain_usage(&json) {
                let parsed = serde_json::from_value::<Option<Usage>>(v).ok().flatten();
                proptest::prop_assert_eq!(Some(usage), parsed);
            }
        }
    }

    #[test]
    fn low_priority_by_header_or_parameter() {
        let mut h = HeaderMap::new();
        assert!(!is_low(&h, None));
        assert!(is_low(&h, Some("api-version=1&priority=low")));
        assert!(!is_low(&h, Some("priority=lowish")));
        h.insert("x-priority", "Low".parse().unwrap());
        assert!(is_low(&h, None));
        h.insert("x-priority", "high".parse().unwrap());
        assert!(!is_low(&h, None));
    }

    #[test]
    fn estimates_count_prompt_and_completion() {
        let chat = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hello there, how are you today?"}],"max_tokens":100}"#;
        let t = estimate_tokens(chat, "chat/completions", 1000);
        // 8 text tokens + 4 framing + 100 completion.
        assert!((108..=116).contains(&t), "{t}");
        let no_max = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        assert!(estimate_tokens(no_max, "chat/completions", 1000) > 1000);
        let n3 = br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":10,"n":3}"#;
        assert!((30..=40).contains(&estimate_tokens(n3, "chat/completions", 1000)));
        let emb = br#"{"input":["one two three","four five"],"model":"e"}"#;
        let e = estimate_tokens(emb, "embeddings", 1000);
        assert!((4..=8).contains(&e), "{e}");
        let parts = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"describe"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}],"max_tokens":1}"#;
        assert!(estimate_tokens(parts, "chat/completions", 1000) < 20);
        // Not JSON: bytes / 4.
        assert_eq!(
            estimate_tokens(b"--multipart-body--", "audio/transcriptions", 0),
            5
        );
    }

    #[test]
    fn stream_usage_is_requested_only_when_missing() {
        let b = request_stream_usage(br#"{"stream":true,"messages":[]}"#).unwrap();
        assert_eq!(
            b, br#"{"stream_options":{"include_usage":true},"stream":true,"messages":[]}"#,
            "spliced in, order kept"
        );
        assert!(stream_usage_supported("chat/completions", None));
        assert!(stream_usage_supported(
            "chat/completions",
            Some("2024-10-21")
        ));
        assert!(stream_usage_supported(
            "completions",
            Some("2024-09-01-preview")
        ));
        assert!(!stream_usage_supported(
            "chat/completions",
            Some("2024-06-01")
        ));
        assert!(!stream_usage_supported("responses", None));
        assert_eq!(
            cheap_estimate(br#"{"max_tokens":100,"n":2}"#, "chat/completions"),
            6 + 200
        );
        let b = request_stream_usage(br#"{"stream":true,"stream_options":{"x":1}}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"x": 1, "include_usage": true})
        );
        assert_eq!(
            request_stream_usage(br#"{"stream":true,"stream_options":{"include_usage":true}}"#),
            None
        );
        assert_eq!(request_stream_usage(br#"{"stream":false}"#), None);
        assert_eq!(request_stream_usage(b"not json"), None);
        // Unusual shapes take the full parse and keep its answers.
        assert_eq!(request_stream_usage(b"[true]"), None);
        assert_eq!(request_stream_usage(br#"{"stream":"true"}"#), None);
        let b = request_stream_usage(br#"{"stream":true,"stream_options":null}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true})
        );
        let b = request_stream_usage(br#"{"stream":false,"stream":true}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true})
        );
    }

    async fn run_tap(chunks: Vec<&str>, sse: bool, strip: bool) -> (String, Option<u64>) {
        let frames: Vec<_> = chunks
            .into_iter()
            .map(|c| {
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::copy_from_slice(c.as_bytes())))
            })
            .collect();
        let stream = futures_util::stream::iter(frames);
        let seen = Arc::new(Mutex::new(None));
        let seen2 = Arc::clone(&seen);
        let tap = UsageTap::new(StreamBody::new(stream), sse, !sse, strip, move |u| {
            *seen2.lock().unwrap() = Some(u)
        });
        let out = tap.collect().await.unwrap().to_bytes();
        let usage = seen.lock().unwrap().take().flatten();
        (String::from_utf8(out.to_vec()).unwrap(), usage)
    }

    const CHUNK: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    #[tokio::test]
    async fn sse_usage_chunk_removed_when_the_client_did_not_ask() {
        let (out, usage) = run_tap(vec![CHUNK, USAGE, DONE], true, true).await;
        assert_eq!(out, format!("{CHUNK}{DONE}"));
        assert_eq!(usage, Some(12));
        // Frames split across network chunks are reassembled, bytes unchanged.
        let (out, usage) = run_tap(
            vec![
                "data: {\"choices\":[{\"de",
                "lta\":{}}]}\n",
                "\n",
                USAGE,
                "data: [DO",
                "NE]\n\n",
            ],
            true,
            true,
        )
        .await;
        assert_eq!(
            out,
            "data: {\"choices\":[{\"delta\":{}}]}\n\ndata: [DONE]\n\n"
        );
        assert_eq!(usage, Some(12));
    }

    #[tokio::test]
    async fn sse_usage_kept_when_the_client_asked() {
        let (out, usage) = run_tap(vec![CHUNK, USAGE, DONE], true, false).await;
        assert_eq!(out, format!("{CHUNK}{USAGE}{DONE}"));
        assert_eq!(usage, Some(12));
        // The usage chunk split across network chunks, with CRLF line ends, is still read.
        let usage_crlf = USAGE.replace("\n\n", "\r\n\r\n");
        let (a, b) = usage_crlf.split_at(30);
        let (out, usage) = run_tap(vec![CHUNK, a, b, DONE], true, false).await;
        assert_eq!(out, format!("{CHUNK}{a}{b}{DONE}"));
        assert_eq!(usage, Some(12));
    }

    #[tokio::test]
    async fn sse_chunks_pass_as_they_came_when_nothing_is_dropped() {
        // A partial event is not held back: each network chunk goes on at once.
        let parts = ["data: {\"choices\":[{\"de", "lta\":{}}]}\n", "\n", DONE];
        let stream = futures_util::stream::iter(parts.map(|c| {
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(c.as_bytes())))
        }));
        let mut tap = UsageTap::new(StreamBody::new(stream), true, false, false, |_| {});
        for part in parts {
            let frame = tap.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), part.as_bytes());
        }
        assert!(tap.frame().await.is_none());
    }

    #[test]
    fn event_ends_are_found_for_both_line_endings() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y\n\n"), Some(9));
        assert_eq!(find_event_end(b"data: x\r\n\r\nmore"), Some(11));
        assert_eq!(find_event_end(b"a\r\n\r\nb\n\n"), Some(5));
        assert_eq!(find_event_end(b"a\nb\r\nc\n"), None);
        assert_eq!(find_event_end(b"\n"), None);
        assert_eq!(find_event_end(b""), None);
        assert_eq!(last_event_end(b"data: x\n\ndata: y\n\ndata: z"), 18);
        assert_eq!(last_event_end(b"a\r\n\r\nb\r\n"), 5);
        assert_eq!(last_event_end(b"data: x\n"), 0);
        assert_eq!(last_event_end(b""), 0);
    }

    #[test]
    fn chunks_without_usage_pass_without_a_copy_and_split_events_are_joined() {
        let mut tap = UsageTap::new(
            http_body_util::Empty::<Bytes>::new(),
            true,
            false,
            true,
            |_| {},
        );
        let chunk = Bytes::from_static(b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: {\"us");
        let out = tap.pass_events(chunk.clone());
        assert_eq!(&out[..], &chunk[..30]);
        assert_eq!(
            out.as_ptr(),
            chunk.as_ptr(),
            "passed on as a slice of the input"
        );
        let usage = "age\":null}\n\ndata: {\"choices\":[],\"usage\":{\"total_tokens\":7}}\n\ndata: [DONE]\n\n";
        let out = tap.pass_events(Bytes::from(usage));
        // The event split over two chunks is whole again; the usage-only chunk is left out.
        assert_eq!(&out[..], b"data: {\"usage\":null}\n\ndata: [DONE]\n\n");
        assert_eq!(tap.usage, Some(7));
        assert!(tap.pending.is_empty());
    }

    #[tokio::test]
    async fn usage_is_reported_when_the_body_is_dropped_after_its_last_bytes() {
        // hyper stops at the declared content-length and drops the body without
        // polling for its end.
        let body = r#"{"usage":{"total_tokens":42}}"#;
        let stream = futures_util::stream::iter(vec![Ok::<_, std::convert::Infallible>(
            Frame::data(Bytes::from_static(body.as_bytes())),
        )]);
        let seen = Arc::new(Mutex::new(None));
        let seen2 = Arc::clone(&seen);
        let mut tap = UsageTap::new(StreamBody::new(stream), false, true, false, move |u| {
            *seen2.lock().unwrap() = Some(u)
        });
        let frame = tap.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), body.as_bytes());
        drop(tap);
        assert_eq!(*seen.lock().unwrap(), Some(Some(42)));
    }

    #[tokio::test]
    async fn json_usage_is_read_and_bytes_pass_through() {
        let body = r#"{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        let (out, usage) = run_tap(vec![&body[..10], &body[10..]], false, false).await;
        assert_eq!(out, body);
        assert_eq!(usage, Some(7));
        let (_, usage) = run_tap(vec!["{\"no\":1}"], false, false).await;
        assert_eq!(usage, None);
    }
}
