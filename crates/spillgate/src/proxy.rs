//! The request path: authenticate, read the model, pick a backend, forward, and fail over
//! at once on 429 / 5xx / connect errors.
//!
//! The body is buffered once (bounded by `server.max_body_bytes`) so that every attempt
//! sends the same bytes; the response is streamed back unbuffered, so SSE reaches the
//! client chunk by chunk. Failover happens only before the first response byte is sent:
//! after that the response belongs to the client, and a backend that breaks mid-stream
//! ends the client's stream without a fabricated end marker.

use spillgate_core::outcome::millis;
use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use http_body_util::{BodyExt, Limited};
use spillgate_core::capacity::{parse_headers as parse_ratelimit, Admission, Reserve};
use spillgate_core::config::{is_safe_name, AllCoolingPolicy, BackendKind, Step};
use spillgate_core::outcome::{cooldown_duration, retry_hint, CoolReason, Cooldown, Outcome};
use spillgate_core::request::{
    classify_path, inspect_body, set_model, upstream_target, ApiRoute, BodyError, BodyInfo,
    ClientShape, RequestParts,
};
use spillgate_core::retry::{AttemptResult, BudgetState};
use spillgate_core::routing::{BackendId, RouteId};

use crate::app::{App, BackendRt, Snapshot};
use crate::auth::{Client, CLIENT_CREDENTIAL_HEADERS};
use crate::coalesce::Joined;
use crate::entra::{BearerToken, Refusal, TokenError};
use crate::errors::GatewayError;
use crate::front::{self, ClientBody, Reply, ReplyBody};
use crate::h1;
use crate::metrics::{Label, Labels};
use crate::state::{BackendState, CapacityProbe, Cooled, Probe, ProbeGuard, Reservation};
use crate::store::{ProbeClaim, StateStore, StoreBudget};
use crate::upstream::{AttemptError, SharedHeaders, UpstreamHeaders, UpstreamRequest, Upstreamed};
use crate::whole::{take_whole, Resumed, Taken};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use smallvec::SmallVec;

// Header names are constants: a `&str` name is parsed and classified on every use.
pub const HEADER_BACKEND: HeaderName = HeaderName::from_static("x-spillgate-backend");
pub const HEADER_ATTEMPTS: HeaderName = HeaderName::from_static("x-spillgate-attempts");
/// The answer's `Content-Type`, looked up by its place among the common names.
static CONTENT_TYPE: h1::Common = h1::Common::new("content-type");
pub const HEADER_MODEL: HeaderName = HeaderName::from_static("x-spillgate-model");
pub const HEADER_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// How many headers a response gets from the gateway on its way to the client: its
/// request id, backend, attempts and model. A backend's answer given as a map (HTTP/2)
/// is made room for them.
pub(crate) const ADDED_RESPONSE_HEADERS: usize = 4;
const HEADER_UPSTREAM_REQUEST_ID: HeaderName = HeaderName::from_static("x-upstream-request-id");

/// Connection-scoped headers (RFC 9110 §7.6.1) that a proxy must not forward, hop-by-hop
/// by themselves; the names a `Connection` header lists are too (see
/// [`connection_listed`] and [`unreturned_names`]).
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The names of a backend's response `headers` that are hop-by-hop or [`not_returned`].
/// The `Connection` values are looked up (which hashes the name) only when a name in the
/// map says there are some: most heads have none. The lists are asked only about the
/// names [`RESPONSE_FILTER`] lets through.
fn unreturned_names(headers: &HeaderMap) -> SmallVec<[HeaderName; 4]> {
    let mut connection = false;
    let mut names: SmallVec<[HeaderName; 4]> = headers
        .keys()
        .filter(|name| {
            connection |= *name == header::CONNECTION;
            let name = name.as_str();
            RESPONSE_FILTER.passes(name.as_bytes())
                && (HOP_BY_HOP.contains(&name) || not_returned(name))
        })
        .cloned()
        .collect();
    if connection {
        let listed = headers.get_all(header::CONNECTION);
        for name in headers.keys() {
            if !names.contains(name)
                && listed
                    .iter()
                    .any(|v| h1::has_token(v.as_bytes(), name.as_str()))
            {
                names.push(name.clone());
            }
        }
    }
    names
}

/// A quick first test of a lower-case header name against lists of names: the pairs of
/// first letter and length that occur in them, and one prefix. A name it stops is in
/// none of the lists; one it lets through is looked up in them. Most names a client or
/// a backend sends are stopped, where each was compared with every listed name in turn:
/// with the sixteen headers of the OpenAI SDK's requests, 164 fewer instructions a
/// request (callgrind, the `sdk` case of `bench/instructions.sh`).
struct NameFilter {
    /// Bit `len` of entry `first & 31`: a listed name starts with `first` and is `len`
    /// long (under 64).
    by_first: [u64; 32],
    /// Any name that starts with it passes.
    prefix: &'static str,
}

impl NameFilter {
    /// Over `hop_by_hop`, each of `lists`, and `prefix`.
    const fn of(hop_by_hop: &[&str], lists: &[&[&str]], prefix: &'static str) -> NameFilter {
        let mut filter = NameFilter {
            by_first: [0; 32],
            prefix,
        };
        filter.add(hop_by_hop);
        let mut l = 0;
        while l < lists.len() {
            filter.add(lists[l]);
            l += 1;
        }
        filter
    }

    const fn add(&mut self, names: &[&str]) {
        let mut k = 0;
        while k < names.len() {
            let name = names[k].as_bytes();
            // Every listed name is under 64 bytes: refused at compile time otherwise.
            assert!(!name.is_empty() && name.len() < 64);
            self.by_first[(name[0] & 31) as usize] |= 1 << name.len();
            k += 1;
        }
    }

    /// Whether `name`, in any case, may be in the lists (or starts with the prefix).
    fn passes(&self, name: &[u8]) -> bool {
        let listed = match name.first() {
            // `& 31` is the same for a letter in either case.
            Some(&first) if name.len() < 64 => {
                self.by_first[usize::from(first & 31)] >> name.len() & 1 == 1
            }
            _ => false,
        };
        let prefix = self.prefix.as_bytes();
        listed
            || (!prefix.is_empty()
                && name
                    .get(..prefix.len())
                    .is_some_and(|p| p.iter().zip(prefix).all(|(&a, &b)| hyphen_fold(a) == b)))
    }
}

/// The lists of the client's header names that never go upstream, besides the hop-by-hop
/// ones, the `x-forwarded-*` family and those a `Connection` header lists: what
/// [`not_forwarded`] and [`FORWARD_FILTER`] are both made from.
const NOT_FORWARDED: [&[&str]; 3] = [
    &CLIENT_CREDENTIAL_HEADERS,
    &NOT_FORWARDED_EITHER,
    &CLIENT_ONLY_HEADERS,
];

/// The lists of a backend's response header names that never reach the client, besides
/// the hop-by-hop ones and those a `Connection` header lists: what [`not_returned`],
/// [`RESPONSE_FILTER`] and [`RELAY_RULES`] are made from.
const NOT_RETURNED: [&[&str]; 2] = [&BACKEND_ONLY_HEADERS, &GATEWAY_HEADERS];

/// The names of the client's headers that never go upstream (besides the hop-by-hop
/// ones and those a `Connection` header lists): see [`Forwarded`].
fn not_forwarded(n: &str) -> bool {
    NOT_FORWARDED.iter().any(|list| list.contains(&n)) || n.starts_with(FORWARDING_PREFIX)
}

/// The names of a backend's response headers that never reach the client (besides the
/// hop-by-hop ones and those a `Connection` header lists): see [`response_headers`].
fn not_returned(n: &str) -> bool {
    NOT_RETURNED.iter().any(|list| list.contains(&n))
}

/// Request headers that go to no backend: a backend has its own answer to `Expect`,
/// and the client's cookies are for the gateway's origin, not the backend's.
const NOT_FORWARDED_EITHER: [&str; 2] = ["expect", "cookie"];

/// The family of forwarding headers (`x-forwarded-for`, `-proto`, `-host`...).
const FORWARDING_PREFIX: &str = "x-forwarded-";

/// [`not_forwarded`]'s and the hop-by-hop names, for the client's header names of no
/// common name (see [`Forwarded`]).
const FORWARD_FILTER: NameFilter = NameFilter::of(&HOP_BY_HOP, &NOT_FORWARDED, FORWARDING_PREFIX);

/// [`not_returned`]'s and the hop-by-hop names, for [`unreturned_names`].
const RESPONSE_FILTER: NameFilter = NameFilter::of(&HOP_BY_HOP, &NOT_RETURNED, "");

/// Bit `i`: a client's header of `h1`'s common name `i` never goes upstream. The
/// hop-by-hop names and [`not_forwarded`]'s (its lists' and the forwarding family's)
/// that are common names (the others are found by [`FORWARD_FILTER`] and
/// [`not_forwarded`]); `Host` and `Content-Length`, which
/// the sender writes itself; `x-request-id`, which the gateway's id replaces.
const FORWARD_DROPS: u128 = {
    /// `mask` with the bits of `names` that are common names.
    const fn add(mut mask: u128, names: &[&str]) -> u128 {
        let mut k = 0;
        while k < names.len() {
            let i = h1::common_at(names[k]);
            if i < h1::COMMON_NAME_TEXTS.len() {
                mask |= 1 << i;
            }
            k += 1;
        }
        mask
    }
    assert!(h1::COMMON_NAME_TEXTS.len() <= 128);
    let mut mask = add(0, &HOP_BY_HOP);
    let mut list = 0;
    while list < NOT_FORWARDED.len() {
        mask = add(mask, NOT_FORWARDED[list]);
        list += 1;
    }
    // The common names of the forwarding family.
    let prefix = FORWARDING_PREFIX.as_bytes();
    let mut i = 0;
    while i < h1::COMMON_NAME_TEXTS.len() {
        let name = h1::COMMON_NAME_TEXTS[i].as_bytes();
        let mut k = 0;
        while k < prefix.len() && k < name.len() && name[k] == prefix[k] {
            k += 1;
        }
        if k == prefix.len() {
            mask |= 1 << i;
        }
        i += 1;
    }
    add(mask, &["host", "content-length", "x-request-id"])
};

/// A client's request headers as they go upstream, lent to each attempt: its header
/// lines as they came (in their own case and order), less the hop-by-hop ones and those
/// a `Connection` header lists, the client's credentials and cookies, the forwarding
/// family and the other [`not_forwarded`] names, and `Host` and the framing headers
/// (the [`Upstream`](crate::upstream::Upstream) writes its own); then the gateway's id
/// for the request (the client's own when it sent a sane one), so that the two logs can
/// be matched. Each attempt writes its backend's credential after them. Built into a
/// map, filtered and dropped, the client's headers were about 1,900 instructions of a
/// JSON request, 8,000 with the OpenAI SDK's sixteen headers (callgrind).
pub struct Forwarded {
    lines: h1::RawHeaders,
    request_id: RequestId,
}

/// A request's id (see `server::serve`): the client's own, sharing its head's bytes, or
/// sixteen hex digits of the gateway's, held inline. As a `HeaderValue` those digits
/// took an allocation of their own, and its free, a request that came without an id.
#[derive(Debug, Clone)]
pub enum RequestId {
    Client(HeaderValue),
    Own([u8; 16]),
}

impl RequestId {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            RequestId::Client(v) => v.as_bytes(),
            RequestId::Own(digits) => digits,
        }
    }

    /// As text, for the logs: a client's id is taken only when it is plain ASCII, and
    /// the gateway's is hex digits, so the fallback is never taken.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or("-")
    }

    /// As a header value, for a header map (an error's answer, HTTP/2).
    pub fn to_value(&self) -> HeaderValue {
        match self {
            RequestId::Client(v) => v.clone(),
            // Hex digits, which a header value always takes: the fallback is never taken.
            RequestId::Own(digits) => {
                HeaderValue::from_bytes(digits).unwrap_or(HeaderValue::from_static("-"))
            }
        }
    }
}

impl Forwarded {
    pub fn new(lines: h1::RawHeaders, request_id: RequestId) -> Forwarded {
        Forwarded { lines, request_id }
    }

    /// The client's headers, all of them, as they came.
    pub fn lines(&self) -> &h1::RawHeaders {
        &self.lines
    }

    /// Gives each header that goes upstream, in order, to `f`, less any of the name of
    /// `credential` (written after them, in their place).
    pub fn each_header(&self, credential: Option<&HeaderName>, f: &mut impl FnMut(&[u8], &[u8])) {
        self.each_client_header(credential, |_, name, value| f(name, value));
        f(
            HEADER_REQUEST_ID.as_str().as_bytes(),
            self.request_id.as_bytes(),
        );
    }

    /// The headers [`Forwarded::each_header`] gives, in a map (for HTTP/2): the names
    /// of `h1`'s common names theirs, the values sharing the client's head.
    pub fn to_map(&self, credential: Option<&HeaderName>) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.lines.len() + 2);
        self.each_client_header(credential, |common, name, value| {
            let name = match common {
                Some(i) => h1::common_header_name(i),
                None => HeaderName::from_bytes(name).ok(),
            };
            if let (Some(name), Ok(value)) = (name, self.lines.share(value)) {
                map.append(name, value);
            }
        });
        map.insert(HEADER_REQUEST_ID, self.request_id.to_value());
        map
    }

    /// Gives each of the client's headers that goes upstream, in order, to `f`, with
    /// where its name is in `h1`'s common names; less any of `credential`'s name.
    fn each_client_header<'s>(
        &'s self,
        credential: Option<&HeaderName>,
        mut f: impl FnMut(Option<usize>, &'s [u8], &'s [u8]),
    ) {
        let listed = connection_listed(&self.lines);
        let credential = credential.map(|name| {
            let name = name.as_str().as_bytes();
            (name, h1::common_index(name))
        });
        for (common, name, value) in self.lines.fields() {
            let dropped = match common {
                Some(i) => FORWARD_DROPS >> i & 1 == 1,
                None => FORWARD_FILTER.passes(name) && not_forwarded_in_any_case(name),
            };
            if dropped || listed.iter().any(|t| t.eq_ignore_ascii_case(name)) {
                continue;
            }
            let of_credential = credential.is_some_and(|(c, c_common)| match (common, c_common) {
                (None, None) => h1::same_ignoring_case(name, c),
                (a, b) => a == b,
            });
            if !of_credential {
                f(common, name, value);
            }
        }
    }
}

/// Whether a header name of no common name, in any case, is hop-by-hop or
/// [`not_forwarded`]: asked only of the few names [`FORWARD_FILTER`] lets through. An
/// underscore counts as a hyphen: servers that read headers as CGI variables (WSGI,
/// PHP) take `Api_Key` for `api-key` and `X_Forwarded_For` for `x-forwarded-for`, so
/// those spellings stay behind too.
fn not_forwarded_in_any_case(name: &[u8]) -> bool {
    let folded: Vec<u8> = name.iter().map(|&b| hyphen_fold(b)).collect();
    let folded = String::from_utf8_lossy(&folded);
    HOP_BY_HOP.contains(&&*folded) || not_forwarded(&folded)
}

/// A byte of a header name as the lists spell it: lower case, `_` as `-`.
fn hyphen_fold(b: u8) -> u8 {
    match b {
        b'_' => b'-',
        b => b.to_ascii_lowercase(),
    }
}

/// The names a head's `Connection` headers list, hop-by-hop like those of [`HOP_BY_HOP`]
/// (looked for only when it has one: most heads have none).
fn connection_listed(lines: &h1::RawHeaders) -> SmallVec<[&[u8]; 4]> {
    if !lines.seen().connection {
        return SmallVec::new();
    }
    h1::Values::values(lines, &header::CONNECTION)
        .flat_map(h1::tokens)
        .filter(|t| !t.is_empty())
        .collect()
}

/// Client headers that must not reach a backend: an OpenAI organization or project would
/// pick which account the gateway's key bills; forwarding headers (these and every
/// `x-forwarded-*`) would leak the client's network; `x-priority` is the gateway's own.
const CLIENT_ONLY_HEADERS: [&str; 5] = [
    "openai-organization",
    "openai-project",
    "forwarded",
    "x-real-ip",
    "x-priority",
];

/// Backend response headers that are the backend account's business, not the client's.
const BACKEND_ONLY_HEADERS: [&str; 3] = ["openai-organization", "openai-project", "set-cookie"];

/// The gateway's own response headers, which a backend's answer (another gateway's, say)
/// may carry too: the client gets the gateway's, or none.
const GATEWAY_HEADERS: [&str; 3] = [
    "x-spillgate-backend",
    "x-spillgate-attempts",
    "x-spillgate-model",
];

/// The backend's response headers as they go to the client, filtered in place: the
/// headers kept are neither copied nor hashed again, as they were when a new map was
/// built (removals move the last header into the gap, so the order may change). Hop-by-hop,
/// backend-only and the gateway's own headers stay behind. `extra` is room for the
/// headers the gateway adds.
fn response_headers(mut headers: HeaderMap, extra: usize) -> HeaderMap {
    let unwanted = unreturned_names(&headers);
    for name in &unwanted {
        headers.remove(name);
    }
    // The gateway's own id is the client's x-request-id; the backend's stays available
    // for support requests to its provider.
    if let header::Entry::Occupied(e) = headers.entry(HEADER_REQUEST_ID) {
        let (_, ids) = e.remove_entry_mult();
        let ids: Vec<HeaderValue> = ids.collect();
        for id in ids {
            headers.append(HEADER_UPSTREAM_REQUEST_ID, id);
        }
    }
    headers.reserve(extra);
    headers
}

/// What becomes of a backend's response header on its way to the client, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Keep,
    /// Not passed on.
    Drop,
    /// Passed on as `x-upstream-request-id`.
    Rename,
    /// Passed on, and the client gets no `Date` of the gateway's.
    Date,
}

/// [`Rule`]s by `h1`'s common names (any other name is kept): what
/// [`response_headers`] and the listener's head writer do to a map, for a response
/// relayed as it came. Hop-by-hop and backend-only headers stay behind; the framing
/// headers are the client connection's own; the gateway's own headers are its, not a
/// backend's.
const RELAY_RULES: [Rule; h1::COMMON_NAME_TEXTS.len()] = {
    let mut rules = [Rule::Keep; h1::COMMON_NAME_TEXTS.len()];
    /// `names`' rules set to `Drop`. A name missing from the common names is an index
    /// past the end: refused at compile time.
    const fn drop_all(rules: &mut [Rule; h1::COMMON_NAME_TEXTS.len()], names: &[&str]) {
        let mut k = 0;
        while k < names.len() {
            rules[h1::common_at(names[k])] = Rule::Drop;
            k += 1;
        }
    }
    drop_all(&mut rules, &HOP_BY_HOP);
    drop_all(&mut rules, &["content-length"]);
    let mut list = 0;
    while list < NOT_RETURNED.len() {
        drop_all(&mut rules, NOT_RETURNED[list]);
        list += 1;
    }
    rules[h1::common_at("x-request-id")] = Rule::Rename;
    rules[h1::common_at("date")] = Rule::Date;
    rules
};

/// A backend's HTTP/1.1 answer on its way to the client: its header lines go out as they
/// came (in their own case and order), less those [`RELAY_RULES`] keep back, then the
/// gateway's own. The same headers as [`response_headers`] leaves in a map, without
/// building one.
pub struct Relay<B> {
    head: RelayHead,
    body: ReplyBody<B>,
}

/// A [`Relay`]'s status and what its head is written from.
pub struct RelayHead {
    status: StatusCode,
    lines: h1::RawHeaders,
    /// The body's length as its `Content-Length` gave it; `None` when there was none,
    /// or when the body changes length on the way (the usage chunk taken out).
    length: Option<u64>,
    backend: HeaderValue,
    attempts: HeaderValue,
    /// The served model's name: one `is_safe_name` allows (the request's, checked when
    /// it was read, or a configured one), so a header value as it is. Made a
    /// `HeaderValue` only for a header map: checking its bytes again for every relayed
    /// answer was about 100 instructions (callgrind).
    model: Option<Bytes>,
    request_id: Option<RequestId>,
}

impl<B> Relay<B> {
    /// The gateway's id for the request, sent back in `x-request-id`.
    pub fn set_request_id(&mut self, id: RequestId) {
        self.head.request_id = Some(id);
    }

    pub fn body(&self) -> &ReplyBody<B> {
        &self.body
    }

    pub fn into_parts(self) -> (RelayHead, ReplyBody<B>) {
        (self.head, self.body)
    }
}

impl RelayHead {
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body's length as the backend declared it, if it still holds.
    pub fn length(&self) -> Option<u64> {
        self.length
    }

    /// Writes the header lines; says whether a `Date` was among them.
    pub fn write_headers(&self, out: &mut Vec<u8>) -> bool {
        self.each_header(|name, value| h1::raw_line(out, name, value))
    }

    /// The headers as a map, with the declared length (for a relay that is not written
    /// to a client connection, which would frame it itself).
    pub fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        self.each_header(|name, value| {
            if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
                map.append(n, v);
            }
        });
        if let Some(n) = self.length {
            map.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        map
    }

    /// Gives each header that goes to the client, in order, to `f`; says whether a
    /// `Date` was among them.
    fn each_header(&self, mut f: impl FnMut(&[u8], &[u8])) -> bool {
        let listed = connection_listed(&self.lines);
        let renamed = HEADER_UPSTREAM_REQUEST_ID;
        let mut dated = false;
        for (common, name, value) in self.lines.fields() {
            let rule = common.map_or(Rule::Keep, |i| RELAY_RULES[i]);
            if rule == Rule::Drop || listed.iter().any(|t| t.eq_ignore_ascii_case(name)) {
                continue;
            }
            let name = match rule {
                Rule::Rename => renamed.as_str().as_bytes(),
                _ => name,
            };
            dated |= rule == Rule::Date;
            f(name, value);
        }
        let own = [
            (&HEADER_BACKEND, Some(self.backend.as_bytes())),
            (&HEADER_ATTEMPTS, Some(self.attempts.as_bytes())),
            (&HEADER_MODEL, self.model.as_ref().map(Bytes::as_ref)),
            (
                &HEADER_REQUEST_ID,
                self.request_id.as_ref().map(RequestId::as_bytes),
            ),
        ];
        for (name, value) in own {
            if let Some(v) = value {
                f(name.as_str().as_bytes(), v);
            }
        }
        dated
    }
}

/// A relay of `lines` (a head without its status line) with `length` declared, and the
/// gateway's backend and attempts headers.
#[cfg(test)]
pub(crate) fn test_relay<B>(lines: &[u8], length: Option<u64>, body: B) -> Relay<B> {
    Relay {
        head: RelayHead {
            status: StatusCode::OK,
            lines: h1::raw_headers(lines),
            length,
            backend: HeaderValue::from_static("b"),
            attempts: HeaderValue::from_static("1"),
            model: None,
            request_id: None,
        },
        body: ReplyBody::Stream(body),
    }
}

/// The response headers the gateway reads after every attempt (retry hints and rate
/// limits), in the order of [`Signals`]' slots.
const SIGNAL_HEADERS: [&str; 9] = [
    "retry-after-ms",
    "x-ms-retry-after-ms",
    "retry-after",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-limit-requests",
    "x-ratelimit-reset-tokens",
    "x-ratelimit-reset-requests",
];

/// The values of [`SIGNAL_HEADERS`] in one response, found in one pass over its headers
/// (a lookup by `&str` name parses and hashes the name each time, nine times a response).
/// The first value of a repeated header counts, as with `HeaderMap::get`.
struct Signals<'a>([Option<&'a str>; SIGNAL_HEADERS.len()]);

/// Where each of [`SIGNAL_HEADERS`] is in `h1`'s common names, which a response's
/// headers as they came know theirs by.
const SIGNAL_COMMON: [usize; SIGNAL_HEADERS.len()] = {
    let mut at = [0; SIGNAL_HEADERS.len()];
    let mut i = 0;
    while i < SIGNAL_HEADERS.len() {
        at[i] = h1::common_at(SIGNAL_HEADERS[i]);
        // A name missing from the list would read past its end: refused at compile time.
        assert!(at[i] < h1::COMMON_NAME_TEXTS.len());
        i += 1;
    }
    at
};

/// `value` as text when it is what `HeaderValue::to_str` accepts (visible ASCII,
/// spaces and tabs), else `None`.
fn visible_str(value: &[u8]) -> Option<&str> {
    if value
        .iter()
        .all(|&b| b == b'\t' || (b' '..0x7f).contains(&b))
    {
        std::str::from_utf8(value).ok()
    } else {
        None
    }
}

impl<'a> Signals<'a> {
    fn read(headers: &'a UpstreamHeaders) -> Self {
        let mut found = [None; SIGNAL_HEADERS.len()];
        let mut note = |common: Option<usize>, value: &'a [u8]| {
            let Some(c) = common else { return };
            if let Some(i) = SIGNAL_COMMON.iter().position(|&s| s == c) {
                if found[i].is_none() {
                    found[i] = Some(visible_str(value));
                }
            }
        };
        match headers {
            UpstreamHeaders::Wire(raw) => raw.fields().for_each(|(c, _, v)| note(c, v)),
            // HTTP/2 answers and in-memory backends: each name looked up as `h1` does.
            UpstreamHeaders::Map(map) => map
                .iter()
                .for_each(|(n, v)| note(h1::common_index(n.as_str().as_bytes()), v.as_bytes())),
        }
        Signals(found.map(Option::flatten))
    }

    fn get(&self, name: &str) -> Option<&'a str> {
        let i = SIGNAL_HEADERS.iter().position(|s| *s == name);
        debug_assert!(i.is_some(), "{name} is not in SIGNAL_HEADERS");
        self.0[i?]
    }
}

/// The one log line of a request the gateway answers itself before any upstream call.
fn rejected(err: GatewayError) -> Response {
    tracing::info!(
        status = err.status.as_u16(),
        code = err.code,
        "request rejected"
    );
    err.into_response()
}

/// A client-supplied string, shortened for a log line.
fn truncate(s: &str) -> &str {
    match s.char_indices().nth(64) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// What the request asks for, once its body is read.
struct Classified<'a> {
    shape: ClientShape,
    operation: &'a str,
    query: Option<&'a str>,
    model: String,
    /// The body as read for its model, without the model: that is `model`.
    body_info: Option<BodyInfo>,
}

/// The value of `x-spillgate-model` for a `model` read from `body` at `info`'s span (its
/// quotes included), sharing the body's bytes rather than a copy of its own; `None` when
/// the text there is not the model as it is (an escape in it).
fn model_header(body: &Bytes, info: &BodyInfo, model: &str) -> Option<Bytes> {
    let (start, end) = info.model_span?;
    let text = body.get(start + 1..end.checked_sub(1)?)?;
    if text != model.as_bytes() {
        return None;
    }
    Some(body.slice_ref(text))
}

fn missing_model(method: &Method, path: &str) -> GatewayError {
    if method == Method::GET || method == Method::DELETE || method == Method::HEAD {
        GatewayError::not_found(format!(
            "`{method} {path}` is not served by this gateway: it routes requests by model, and this request names none."
        ))
    } else {
        GatewayError::bad_request(
            "missing_model",
            "You must provide a model parameter: the gateway routes requests by the `model` field of the JSON body.",
        )
    }
}

/// Serves one API request; `request_id` goes upstream in `x-request-id`. Every request
/// is counted in `spillgate_requests_total` once: by the attempt loop's end when it ran,
/// else here, as the gateway's own answer (backend and model `-`).
///
/// Not an `async fn`: one would hold the request twice (its argument, and the copy its
/// body moves it into) besides its parts, and each byte of the future is copied as it
/// is written into the connection's slot for it; the `async` block holds the parts
/// only.
pub fn handle(
    app: Arc<App>,
    req: front::Request<ClientBody>,
    request_id: RequestId,
) -> impl Future<Output = Reply<Body>> + Send {
    let front::Request {
        method,
        uri,
        headers,
        body,
        ..
    } = req;
    // Made now, not where the attempts begin: the future then holds the headers once.
    let forwarded = Forwarded::new(headers, request_id);
    async move {
        let started = crate::now::now();
        let snap = app.snapshot.load_full();
        let low = crate::priority::treated_as_low(&snap.config, forwarded.lines(), uri.query());
        let local = |response: Response| {
            record_local(&app, response.status().as_u16(), low);
            Reply::Response(response)
        };
        let path = uri.path();
        let route = classify_path(method.as_str(), path);

        // Authenticate before reading the body: an unauthenticated client costs no buffering.
        // An unknown path is answered 404 without a key.
        let client = match (&route, snap.client_keys.authenticate(forwarded.lines())) {
            (ApiRoute::NotFound, _) => Client::Anonymous,
            (_, Some(c)) => c,
            (_, None) => {
                return local(reject_unread(rejected(GatewayError::unauthorized()), body).await)
            }
        };
        let (shape, deployment, operation) = match route {
            ApiRoute::NotFound => {
                let resp = rejected(GatewayError::not_found(format!(
                    "Unknown path `{}`.",
                    truncate(path)
                )));
                return local(reject_unread(resp, body).await);
            }
            ApiRoute::ListModels => return local(list_models(&snap)),
            ApiRoute::Invalid(why) => {
                let resp = rejected(GatewayError::bad_request("invalid_path", why));
                return local(reject_unread(resp, body).await);
            }
            ApiRoute::Operation {
                shape,
                deployment,
                operation,
            } => (shape, deployment, operation),
        };

        let body = match read_body(
            body,
            snap.config.server.max_body_bytes,
            snap.config.timeouts.client_body,
        )
        .await
        {
            Ok(b) => b,
            Err(e) => {
                // The rest of the body is not read: the connection cannot be reused.
                let mut resp = rejected(e);
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return local(resp);
            }
        };

        // With request priority on, streams ask the backend for their usage chunk (removed
        // again on the way back when the client did not ask for it).
        let priority = snap.config.priority.as_ref();
        let api_version = uri
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("api-version=")));
        let usage_ok = crate::priority::stream_usage_supported(operation, api_version);
        let (body, strip_usage) = match priority
            .filter(|_| usage_ok)
            .and_then(|_| crate::priority::request_stream_usage(&body))
        {
            Some(b) => (Bytes::from(b), true),
            None => (body, false),
        };

        let (model, body_info) = match deployment {
            Some(d) => (d.to_string(), None),
            None => match inspect_body(&body) {
                // The model moves out of the body's description into the request's
                // `model` (see `Classified::body_info`).
                Ok(mut info) => match info.model.take() {
                    Some(m) if !is_safe_name(&m) => {
                        tracing::info!(model = ?truncate(&m), status = 400, code = "invalid_model", "request rejected: invalid model name");
                        return local(GatewayError::bad_request(
                            "invalid_model",
                            "`model` may contain only letters, digits, '-', '_', '.' and ':' (at most 256 characters).",
                        )
                        .into_response());
                    }
                    Some(m) => (m, Some(info)),
                    None => return local(rejected(missing_model(&method, path))),
                },
                Err(e @ BodyError::InvalidJson(_)) => {
                    return local(rejected(GatewayError::bad_request(
                        "invalid_json",
                        e.to_string(),
                    )))
                }
                Err(e @ BodyError::ModelNotString) => {
                    return local(rejected(GatewayError::bad_request(
                        "invalid_model",
                        e.to_string(),
                    )))
                }
            },
        };
        let req = Classified {
            shape,
            operation,
            query: uri.query(),
            model,
            body_info,
        };

        let table = &snap.config.table;
        let Some(route_id) = table.route_for(&req.model, &snap.config.backends) else {
            tracing::info!(model = %req.model, client = client.name(), status = 404, code = "model_not_found", "no backend serves this model");
            return local(GatewayError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!(
                    "The model `{}` is not served by this gateway. `GET /v1/models` lists the models it serves.",
                    req.model
                ),
            )
            .into_response());
        };

        let mut guard = DisconnectGuard {
            model: &req.model,
            started,
            answered: false,
        };
        let est_tokens = match priority {
            Some(p) => crate::priority::estimate_tokens(&body, operation, p.default_max_tokens),
            // The body-model shapes read the limits with the model; Azure classic paths
            // scan for them.
            None => match &req.body_info {
                Some(info) => {
                    crate::priority::cheap_estimate_of(body.len(), operation, info.limits)
                }
                None => crate::priority::cheap_estimate(&body, operation),
            },
        };
        let ctx = Ctx {
            app: &app,
            snap: &snap,
            method: &method,
            upstream_headers: &forwarded,
            req: &req,
            body,
            route_id,
            started,
            low,
            est_tokens,
            strip_usage,
            store_budget: StoreBudget::new(app.store.request_budget()),
        };
        let outcome = attempt_loop(&ctx).await;
        guard.answered = true;
        if ctx.low {
            // Per model (the toolkit's per-deployment thresholds); admitted means it reached a
            // backend.
            let decision = match &outcome {
                Ended::PriorityRefused { .. } => Some("refused"),
                Ended::Served { .. } => Some("admitted"),
                Ended::Exhausted { attempts, .. }
                | Ended::BudgetExhausted { attempts, .. }
                | Ended::DeadlineExceeded { attempts, .. } => (*attempts > 0).then_some("admitted"),
            };
            if let Some(d) = decision {
                app.metrics
                    .low_priority
                    .get_or_create(&vec![
                        ("decision", d.into()),
                        (
                            "model",
                            ctx.snap
                                .config
                                .table
                                .model_label(&ctx.req.model)
                                .to_string()
                                .into(),
                        ),
                    ])
                    .inc();
            }
        }
        finish(outcome, &ctx, &client, &app)
    }
}

/// Logs a request whose client went away before it was answered. The client connection
/// ([`crate::front`]) drops the handler future when the client disconnects, which also
/// drops (and so cancels) the upstream request in flight; this guard's `Drop` is the only
/// place that sees it happen.
struct DisconnectGuard<'a> {
    model: &'a str,
    started: tokio::time::Instant,
    answered: bool,
}

impl Drop for DisconnectGuard<'_> {
    fn drop(&mut self) {
        if !self.answered {
            tracing::info!(
                model = %self.model,
                waited_ms = self.started.elapsed().as_secs_f64() * 1000.0,
                "client went away before the response; upstream request cancelled"
            );
        }
    }
}

/// Largest unread body drained before an early answer; above it the connection is closed.
const DRAIN_LIMIT: usize = 64 * 1024;

/// Answers a request whose body was never read (401, unknown path). If the server closed
/// the connection while the client was still sending, the kernel would reset it and the
/// client could lose the answer; so a small body is read and dropped first (bounded in
/// size and time), and a large one gets `Connection: close` instead.
async fn reject_unread(mut resp: Response, body: ClientBody) -> Response {
    if declared_len(&body) > DRAIN_LIMIT as u64 {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return resp;
    }
    let drained = tokio::time::timeout(
        Duration::from_secs(1),
        Limited::new(body, DRAIN_LIMIT).collect(),
    )
    .await;
    if !matches!(drained, Ok(Ok(_))) {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// The least a request body can hold: the length its `Content-Length` declared (read by
/// the connection, which refused conflicting values), 0 when chunked. Its size hint: the
/// headers were read for it once already.
fn declared_len(body: &ClientBody) -> u64 {
    http_body::Body::size_hint(body).lower()
}

/// Reads the whole request body, refusing it with 413 before any upstream call when it is
/// larger than the limit.
async fn read_body(body: ClientBody, max: usize, timeout: Duration) -> Result<Bytes, GatewayError> {
    let too_large = || {
        GatewayError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("The request body is larger than this gateway's limit of {max} bytes (server.max_body_bytes)."),
        )
    };
    if declared_len(&body) > max as u64 {
        return Err(too_large());
    }
    // A client that declares a body and then trickles it (or stops) must not hold a
    // connection and its buffer forever. Tried once first: a body that is all here, as
    // most are, needs no timer (nor the clock read that sets one).
    let mut collect = std::pin::pin!(collect_body(body, max));
    let read =
        match std::future::poll_fn(|cx| Poll::Ready(Future::poll(collect.as_mut(), cx))).await {
            Poll::Ready(read) => Ok(read),
            Poll::Pending => tokio::time::timeout(timeout, collect).await,
        };
    match read {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(BodyRead::TooLarge)) => Err(too_large()),
        Ok(Err(BodyRead::Broken)) => Err(GatewayError::bad_request(
            "incomplete_body",
            "The request body could not be read completely.",
        )),
        Err(_) => Err(GatewayError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_body_timeout",
            format!(
                "The request body did not arrive within {} ms (timeouts.client_body).",
                timeout.as_millis()
            ),
        )),
    }
}

/// Why a request body could not be collected.
#[derive(Debug, PartialEq, Eq)]
enum BodyRead {
    /// More than the limit arrived.
    TooLarge,
    /// The body ended early or could not be decoded.
    Broken,
}

/// The whole body, at most `max` bytes of data (trailers are dropped). A body that
/// arrives as one piece, as most do, is that piece itself: nothing is copied or gathered
/// into a list first.
async fn collect_body(mut body: ClientBody, max: usize) -> Result<Bytes, BodyRead> {
    let mut whole = Joined::Empty;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(|_| BodyRead::Broken)?.into_data() else {
            continue;
        };
        if whole.len() + data.len() > max {
            return Err(BodyRead::TooLarge);
        }
        if !data.is_empty() {
            // A copy started by a second piece has room for twice the first, within
            // the limit.
            let room = (2 * whole.len()).min(max);
            whole.push(data, room);
        }
    }
    Ok(whole.take().unwrap_or_default())
}

fn list_models(snap: &Snapshot) -> Response {
    let mut resp = Response::new(Body::from(snap.models_json.clone()));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Everything one request's attempts share.
struct Ctx<'a> {
    app: &'a App,
    snap: &'a Snapshot,
    method: &'a Method,
    /// The client's headers that go upstream, with the gateway's id for the request in
    /// `x-request-id`.
    upstream_headers: &'a Forwarded,
    req: &'a Classified<'a>,
    body: Bytes,
    route_id: RouteId,
    started: tokio::time::Instant,
    /// A low-priority request: admitted only from spare capacity.
    low: bool,
    /// Tokens the request may take from a deployment's quota (0 without `[priority]`).
    est_tokens: u64,
    /// The gateway added `include_usage`: remove the usage chunk on the way back.
    strip_usage: bool,
    /// What this request may still wait on the shared store (probe claims).
    store_budget: StoreBudget,
}

/// A model to try and the route that serves it: the requested model first, then the
/// route's fallbacks.
#[derive(Clone, Copy)]
struct Candidate<'a> {
    model: &'a str,
    route: RouteId,
}

/// How the attempts for one request ended.
enum Ended {
    /// A backend's response, to stream to the client.
    Served {
        backend: BackendId,
        model: usize,
        attempts: u32,
        response: Upstreamed,
        /// The deployment's reservation when no rate-limit headers settled it: it ends,
        /// corrected by the usage, when the body ends.
        reservation: Option<Reservation>,
        /// When the gateway had the answer's head, or gave up on the backends left.
        answered_at: tokio::time::Instant,
    },
    /// Nothing usable: every candidate failed, was tried, or is cooling down.
    Exhausted {
        attempts: u32,
        failures: Vec<Outcome>,
    },
    /// The retry budget refused another attempt.
    BudgetExhausted { attempts: u32, state: BudgetState },
    /// The request's deadline passed before a response.
    DeadlineExceeded { attempts: u32, deadline: Duration },
    /// A low-priority request with no spare capacity anywhere it may go.
    PriorityRefused {
        attempts: u32,
        retry_after: Duration,
    },
}

/// What to do next in the attempt loop.
enum Next {
    /// Select a backend (the first attempt, or moving on).
    Select,
    /// Try the same backend again after `wait` (already paid from the retry budget),
    /// keeping its probe slots; `outcome` is what the last try got.
    Same {
        backend: BackendId,
        model: usize,
        tries: u32,
        wait: Duration,
        probes: Probes,
        outcome: Outcome,
    },
}

/// The probe slots an attempt holds (resource and deployment level, and the
/// low-priority capacity probe). Held for their `Drop`, which frees the slots when the
/// attempt is over; only an attempt that holds a slot may declare its backend recovered.
#[derive(Debug, Default)]
struct Probes {
    resource: Option<ProbeGuard>,
    deployment: Option<ProbeGuard>,
    _capacity: Option<CapacityProbe>,
}

/// Takes the probe slots a recovering resource or deployment needs, or `None` when
/// another request is probing either.
fn take_probes(backend: &BackendRt, deployment: &Arc<BackendState>) -> Option<Probes> {
    let resource = match backend.state.acquire_probe() {
        Probe::NotNeeded => None,
        Probe::Acquired(g) => Some(g),
        Probe::Busy => return None,
    };
    let dep = match deployment.acquire_probe() {
        Probe::NotNeeded => None,
        Probe::Acquired(g) => Some(g),
        Probe::Busy => return None,
    };
    Some(Probes {
        resource,
        deployment: dep,
        _capacity: None,
    })
}

/// Longest a cluster-wide probe slot is held: a probe that takes longer (a long
/// completion) lets another instance probe too, and a crashed instance's slot frees
/// itself.
const CLUSTER_PROBE_TTL: Duration = Duration::from_secs(30);

/// With a shared store, makes the probe slots this instance took the cluster's too: one
/// probe per recovering backend across every instance. `false` when another instance
/// is probing (the backend is left alone for a moment). Without an answer in time the
/// instance decides alone, and so does the rest of the request (its store budget).
/// `now` is read again after the call, which may have waited.
async fn claim_cluster_probes(
    ctx: &Ctx<'_>,
    backend: &BackendRt,
    model: &str,
    probes: &mut Probes,
    now: &mut u64,
) -> bool {
    let store = &ctx.app.store;
    if !store.shared() || (probes.resource.is_none() && probes.deployment.is_none()) {
        return true;
    }
    let dep_name = backend.cfg.deployment_for(model).unwrap_or(model);
    let ttl = ctx.snap.config.timeouts.first_byte.min(CLUSTER_PROBE_TTL);
    let mut wanted = Vec::with_capacity(2);
    if probes.resource.is_some() {
        wanted.push(None);
    }
    if probes.deployment.is_some() {
        wanted.push(Some(dep_name));
    }
    let claim = store
        .claim_probes(&backend.cfg.name, &wanted, ttl, &ctx.store_budget)
        .await;
    *now = ctx.app.clock.now_ms();
    let now = *now;
    match claim {
        ProbeClaim::Local => true,
        ProbeClaim::Busy => {
            let until = now + millis(crate::store::REMOTE_PROBE_BUSY);
            for g in probes.resource.iter().chain(probes.deployment.iter()) {
                g.state().remote_probe_busy(until);
            }
            false
        }
        ProbeClaim::Claimed(claims) => {
            let slots = [&mut probes.resource, &mut probes.deployment];
            let held = slots.into_iter().filter(|s| s.is_some());
            for (slot, claim) in held.zip(claims) {
                match (slot.as_mut(), claim) {
                    (Some(guard), Some(cluster)) => guard.attach(cluster),
                    (Some(guard), None) => {
                        // Another instance's probe found it well: not a probe any more.
                        guard.state().remote_recovered(now);
                        *slot = None;
                    }
                    (None, _) => {}
                }
            }
            true
        }
    }
}

fn usable(backend: &BackendRt, model: &str, now: u64) -> bool {
    backend.state.is_usable(now)
        && backend
            .deployment_state(model)
            .is_some_and(|d| d.is_usable(now))
}

/// A backend chosen for an attempt, with what it holds for the attempt's duration.
struct Pick {
    id: BackendId,
    model: usize,
    /// The state of the deployment that serves the model there, as the choice found it:
    /// not looked up again by name.
    deployment: Arc<BackendState>,
    probes: Probes,
    reservation: Option<Reservation>,
}

/// The low-priority reserve that applies to `model` for this request, if any.
fn low_reserve<'a>(
    ctx: &'a Ctx<'_>,
    model: &str,
) -> Option<(Reserve, &'a spillgate_core::capacity::CapacityPolicy)> {
    if !ctx.low {
        return None;
    }
    let p = ctx.snap.config.priority.as_ref()?;
    p.reserve_for(model).map(|r| (r, &p.capacity))
}

/// Picks the next backend over the candidate models in order: the requested model's pool
/// first, then each fallback's. A recovering backend (or deployment) is taken only with
/// its probe slot; a low-priority request only where capacity admits it. The first pass
/// also passes over deployments whose tracked capacity cannot cover the request (as if
/// they had answered 429); when that leaves nothing, a second pass tries them anyway,
/// since the tracked numbers are estimates. The capacity check and the reservation are
/// one step, so concurrent requests cannot all take the same remaining capacity.
async fn select_backend<'s>(
    ctx: &Ctx<'s>,
    chain: &[Candidate<'_>],
    tried: &[(BackendId, &'s str)],
    mut now: u64,
    rng: &mut fastrand::Rng,
) -> Option<Pick> {
    let backends = &ctx.snap.backends;
    for strict in [true, false] {
        let mut busy: Vec<BackendId> = Vec::new();
        for (ci, c) in chain.iter().enumerate() {
            let pool = &ctx.snap.config.table.routes[c.route].pool;
            let reserve = low_reserve(ctx, c.model);
            loop {
                let pick = pool.select_scored(
                    |id| {
                        let b = &backends[id];
                        let dep = b.cfg.deployment_for(c.model)?;
                        if tried.contains(&(id, dep))
                            || busy.contains(&id)
                            || !b.state.is_usable(now)
                        {
                            return None;
                        }
                        let state = b.deployments.get(dep);
                        if !state.is_usable(now) {
                            return None;
                        }
                        let admitted = reserve.is_none_or(|(r, p)| {
                            !matches!(
                                state.admit_low(ctx.est_tokens, r, p, now),
                                Admission::Refuse(_)
                            )
                        });
                        (admitted && (!strict || state.covers(ctx.est_tokens, now)))
                            .then_some(state)
                    },
                    |state| state.headroom(now),
                    rng,
                );
                let Some((id, dep)) = pick else { break };
                // Another request may have taken a probe slot or the capacity since the
                // check: then this backend is busy for now.
                let Some(mut probes) = take_probes(&backends[id], &dep) else {
                    busy.push(id);
                    continue;
                };
                let claimed =
                    claim_cluster_probes(ctx, &backends[id], c.model, &mut probes, &mut now).await;
                // Busy elsewhere, or cooled by what arrived during the claim.
                if !claimed || !backends[id].state.is_ready(now) || !dep.is_ready(now) {
                    busy.push(id);
                    continue;
                }
                let Some((reservation, admission)) =
                    dep.try_reserve(ctx.est_tokens, reserve, strict, now)
                else {
                    busy.push(id);
                    continue;
                };
                if admission == Admission::Probe {
                    match dep.acquire_capacity_probe() {
                        Some(p) => probes._capacity = Some(p),
                        None => {
                            busy.push(id);
                            continue;
                        }
                    }
                }
                return Some(Pick {
                    id,
                    model: ci,
                    deployment: dep,
                    probes,
                    reservation: Some(reservation),
                });
            }
        }
    }
    None
}

/// For a low-priority request that found no backend: when the soonest candidate that is
/// not cooling will have capacity to spare, if capacity is why it was refused.
fn priority_refusal<'s>(
    ctx: &Ctx<'s>,
    chain: &[Candidate<'_>],
    tried: &[(BackendId, &'s str)],
    now: u64,
) -> Option<Duration> {
    if !ctx.low {
        return None;
    }
    candidates(ctx, chain)
        .filter(|(id, ci)| !was_tried(ctx, tried, *id, chain[*ci].model))
        .filter_map(|(id, ci)| {
            let model = chain[ci].model;
            let b = &ctx.snap.backends[id];
            if !usable(b, model, now) {
                return None;
            }
            let (reserve, policy) = low_reserve(ctx, model)?;
            match b
                .deployment_state(model)?
                .admit_low(ctx.est_tokens, reserve, policy, now)
            {
                Admission::Refuse(wait) => Some(wait),
                _ => None,
            }
        })
        .min()
        .map(refusal_retry_after)
}

/// The `Retry-After` of a low-priority refusal whose capacity returns in `wait_ms`: at
/// least a second.
fn refusal_retry_after(wait_ms: u64) -> Duration {
    Duration::from_millis(wait_ms.max(1_000))
}

/// Whether this request already tried `model`'s deployment on backend `id`.
fn was_tried(ctx: &Ctx<'_>, tried: &[(BackendId, &str)], id: BackendId, model: &str) -> bool {
    ctx.snap.backends[id]
        .cfg
        .deployment_for(model)
        .is_some_and(|d| tried.contains(&(id, d)))
}

/// Every `(backend, model)` pair that could serve the request: the pool of the requested
/// model, then the pools of its fallbacks, each member serving its model.
fn candidates<'a>(
    ctx: &'a Ctx<'_>,
    chain: &'a [Candidate<'_>],
) -> impl Iterator<Item = (BackendId, usize)> + 'a {
    chain.iter().enumerate().flat_map(move |(ci, c)| {
        ctx.snap.config.table.routes[c.route]
            .pool
            .members()
            .filter(move |id| ctx.snap.backends[*id].cfg.deployment_for(c.model).is_some())
            .map(move |id| (id, ci))
    })
}

/// The fallback chain of a request: its model and route, then each fallback model that
/// some route serves. On the stack up to four: most requests have no fallback.
fn fallback_chain<'a>(ctx: &'a Ctx<'_>) -> SmallVec<[Candidate<'a>; 4]> {
    std::iter::once(Candidate {
        model: &ctx.req.model,
        route: ctx.route_id,
    })
    .chain(
        ctx.snap.routes[ctx.route_id]
            .fallbacks
            .iter()
            .map(|(model, route)| Candidate {
                model,
                route: *route,
            }),
    )
    .collect()
}

/// The model of the request's `i`th candidate: its own (0), then its fallbacks'.
fn candidate_model<'a>(ctx: &'a Ctx<'_>, i: usize) -> &'a str {
    i.checked_sub(1)
        .and_then(|f| ctx.snap.routes[ctx.route_id].fallbacks.get(f))
        .map_or(ctx.req.model.as_str(), |(model, _)| model)
}

/// Reads and drops what is left of a response the client will not get, so its
/// connection can go back to the pool (bounded in size and time, off the request path).
fn discard(response: Option<Upstreamed>) {
    // The body only: the head is let go of now.
    if let Some(Upstreamed { body, .. }) = response {
        tokio::spawn(async move {
            let body = Limited::new(body, DRAIN_LIMIT);
            let _ = tokio::time::timeout(Duration::from_secs(1), body.collect()).await;
        });
    }
}

/// Takes one extra attempt from the route's retry budget, or says why not.
fn pay_retry(ctx: &Ctx<'_>) -> Result<(), BudgetState> {
    let budget = &ctx.snap.routes[ctx.route_id].budget;
    budget
        .lock()
        .map(|mut b| {
            let now = ctx.app.clock.now_ms();
            if b.try_withdraw(now) {
                Ok(())
            } else {
                Err(b.state(now))
            }
        })
        .unwrap_or(Ok(()))
}

/// Tries backends until one gives an answer the route's retry policy does not retry.
/// Moving to another backend never waits; waiting happens only between tries of the same
/// backend (per the retry policy), or for the soonest recovery under `wait`.
async fn attempt_loop(ctx: &Ctx<'_>) -> Ended {
    let snap = ctx.snap;
    let app = ctx.app;
    let route = &snap.config.table.routes[ctx.route_id];
    let policy = &route.retry;
    let routing = snap.config.routing;
    let first_byte = snap.config.timeouts.first_byte;
    let chain = fallback_chain(ctx);
    let deadline = route.deadline.or(routing.deadline);
    let deadline_at = deadline.map(|d| ctx.started + d);
    let max_attempts = routing.max_attempts.unwrap_or(u32::MAX);
    let remaining = || deadline_at.map(|d| d.saturating_duration_since(crate::now::now()));
    // Compared, not subtracted: a subtraction of instants is 37 instructions
    // (callgrind), and with a deadline set this is asked at each attempt's start and
    // again after a wait.
    let deadline_passed = || deadline_at.is_some_and(|d| crate::now::now() >= d);

    let mut rng = fastrand::Rng::new();
    // On the stack for the first four attempts.
    let mut tried: SmallVec<[(BackendId, &str); 4]> = SmallVec::new();
    let mut failures: Vec<Outcome> = Vec::new();
    let mut attempts: u32 = 0;
    let mut waited = Duration::ZERO;
    let mut lazy_body_info: Option<BodyInfo> = None;
    let mut next = Next::Select;
    // The last attempt's answer when it was the backend's own verdict (a 4xx under a
    // `>=300` policy, say): if the backends run out, the client gets it as it is.
    let mut last_answer: Option<(BackendId, usize, Upstreamed)> = None;
    // A failover is counted when the next attempt starts, not when there is none.
    let mut pending_failover: Option<(BackendId, Label)> = None;

    loop {
        if deadline_passed() {
            return Ended::DeadlineExceeded {
                attempts,
                deadline: deadline.unwrap_or_default(),
            };
        }
        if attempts >= max_attempts {
            return give_up(attempts, failures, last_answer);
        }
        let now = app.clock.now_ms();
        let (pick, tries_before, forced) = match std::mem::replace(&mut next, Next::Select) {
            Next::Same {
                backend,
                model,
                tries,
                wait,
                probes,
                outcome,
            } => {
                // The wait never outlasts the deadline.
                let wake = crate::now::now() + wait;
                tokio::time::sleep_until(deadline_at.map_or(wake, |d| d.min(wake))).await;
                if deadline_passed() {
                    return Ended::DeadlineExceeded {
                        attempts,
                        deadline: deadline.unwrap_or_default(),
                    };
                }
                // The backend may have been cooled, tripped or filled by other requests
                // meanwhile: then the request moves on instead.
                let now = app.clock.now_ms();
                let b = &snap.backends[backend];
                let m = chain[model].model;
                let ready = b
                    .deployment_state(m)
                    .filter(|d| b.state.is_ready(now) && d.is_ready(now));
                let reserved = ready.and_then(|d| {
                    d.try_reserve(ctx.est_tokens, low_reserve(ctx, m), false, now)
                        .map(|(r, _)| (d, r))
                });
                match reserved {
                    Some((deployment, reservation)) => (
                        Pick {
                            id: backend,
                            model,
                            deployment,
                            probes,
                            reservation: Some(reservation),
                        },
                        tries,
                        false,
                    ),
                    None => {
                        failures.push(outcome);
                        continue;
                    }
                }
            }
            Next::Select => match select_backend(ctx, &chain, &tried, now, &mut rng).await {
                Some(pick) => {
                    if attempts > 0 {
                        // Every attempt after the first is paid from the route's budget.
                        if let Err(state) = pay_retry(ctx) {
                            tracing::warn!(model = %ctx.req.model, route = %route.name, budget = %state, "retry budget exhausted; no further attempts");
                            return Ended::BudgetExhausted { attempts, state };
                        }
                    }
                    (pick, 0, false)
                }
                None => {
                    if let Some(retry_after) = priority_refusal(ctx, &chain, &tried, now) {
                        tracing::info!(model = %ctx.req.model, est_tokens = ctx.est_tokens, retry_after_ms = retry_after.as_millis() as u64, "low-priority request refused: no spare capacity");
                        return Ended::PriorityRefused {
                            attempts,
                            retry_after,
                        };
                    }
                    // Every untried candidate is cooling down, probed by another request,
                    // or none is left.
                    let untried: Vec<(BackendId, usize)> = candidates(ctx, &chain)
                        .filter(|(id, ci)| !was_tried(ctx, &tried, *id, chain[*ci].model))
                        .collect();
                    let busy_soon = untried
                        .iter()
                        .any(|(id, ci)| {
                            snap.backends[*id]
                                .cooldown_for(chain[*ci].model, now)
                                .is_none()
                        })
                        .then_some(now + 50);
                    let soonest = untried
                        .iter()
                        .filter_map(|(id, ci)| {
                            snap.backends[*id].cooldown_for(chain[*ci].model, now)
                        })
                        .map(|c| c.until_ms)
                        .chain(busy_soon)
                        .min();
                    match (routing.when_all_cooling, soonest) {
                        (_, None) | (AllCoolingPolicy::Reject, _) => {
                            return give_up(attempts, failures, last_answer)
                        }
                        (AllCoolingPolicy::Wait, Some(until)) => {
                            // Waiters are spread over up to 100 ms after the recovery so
                            // they do not all arrive in the same instant.
                            let until = until + rng.u64(0..100);
                            let wait = Duration::from_millis(until.saturating_sub(now));
                            let within_deadline = remaining().is_none_or(|r| wait < r);
                            if waited + wait > routing.max_wait || !within_deadline {
                                return give_up(attempts, failures, last_answer);
                            }
                            tracing::debug!(model = %ctx.req.model, wait_ms = wait.as_millis() as u64, "all candidates cooling; waiting for the soonest");
                            tokio::time::sleep_until(app.clock.instant_at(until)).await;
                            waited += wait;
                            continue;
                        }
                        (AllCoolingPolicy::ForwardFirst, Some(_)) => {
                            let Some((id, ci)) = untried.first().copied() else {
                                return give_up(attempts, failures, last_answer);
                            };
                            let m = chain[ci].model;
                            let Some(dep) = snap.backends[id].deployment_state(m) else {
                                return give_up(attempts, failures, last_answer);
                            };
                            // Forwarding anyway never lets low priority past its reserve.
                            if let Some((r, p)) = low_reserve(ctx, m) {
                                if let Admission::Refuse(w) =
                                    dep.admit_low(ctx.est_tokens, r, p, now)
                                {
                                    return Ended::PriorityRefused {
                                        attempts,
                                        retry_after: refusal_retry_after(w),
                                    };
                                }
                            }
                            let reservation = dep
                                .try_reserve(ctx.est_tokens, None, false, now)
                                .map(|(r, _)| r);
                            (
                                Pick {
                                    id,
                                    model: ci,
                                    deployment: dep,
                                    probes: Probes::default(),
                                    reservation,
                                },
                                0,
                                true,
                            )
                        }
                    }
                }
            },
        };
        let Pick {
            id,
            model: ci,
            deployment,
            mut probes,
            mut reservation,
        } = pick;
        if let Some((from, reason)) = pending_failover.take() {
            if from != id {
                app.metrics
                    .failovers
                    .get_or_create(&vec![
                        ("backend", (&snap.backends[from].cfg.name).into()),
                        ("reason", reason),
                    ])
                    .inc();
            }
        }

        let backend = &snap.backends[id];
        let model = chain[ci].model;
        // A backend with an Entra ID credential needs a token before anything is sent.
        // Without one it is passed over like a backend that cannot be reached, but no
        // upstream attempt was made.
        let token_wait = || remaining().map_or(TOKEN_WAIT, |r| r.min(TOKEN_WAIT));
        let mut token = match &backend.entra {
            None => None,
            Some(source) => match source.bearer(token_wait()).await {
                Ok(t) => Some(t),
                Err(e) => {
                    no_token(app, backend, source, &e);
                    if let Some(dep) = backend.cfg.deployment_for(model) {
                        if !tried.contains(&(id, dep)) {
                            tried.push((id, dep));
                        }
                    }
                    pending_failover = auth_failed(&mut failures, id);
                    continue;
                }
            },
        };
        if attempts == 0 {
            // The budget counts requests that reach a backend, in one-second slots. A
            // wait for a token may have taken seconds since `now`: then the clock is read
            // afresh. Choosing a backend takes at most a store round trip (milliseconds).
            let at = if token.is_some() {
                app.clock.now_ms()
            } else {
                now
            };
            if let Ok(mut b) = snap.routes[ctx.route_id].budget.lock() {
                b.deposit(at);
            }
        }
        attempts += 1;
        let Some(dep_name) = backend.cfg.deployment_for(model) else {
            failures.push(Outcome::ConnectError);
            continue;
        };
        if !tried.contains(&(id, dep_name)) {
            tried.push((id, dep_name));
        }

        let prepared = prepare_attempt(backend, model, ctx, &mut lazy_body_info);
        let upstream_req = match upstream_request(&prepared, backend, ctx, token.as_deref()) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(backend = %backend.cfg.name, error = %e, "could not build the upstream request");
                failures.push(Outcome::ConnectError);
                continue;
            }
        };
        // The deadline may cut the first-byte timeout short; when it is what fires, the
        // request is over, and the backend is not to blame.
        let left = remaining();
        let mut deadline_bound = left.is_some_and(|r| r < first_byte);
        let timeout = left.map_or(first_byte, |r| r.min(first_byte));
        let mut result = match app.upstream.client() {
            Some(client) => client.relay_inline(upstream_req, timeout).await,
            None => app.upstream.relay(upstream_req, timeout).await,
        };
        // A 401 to a token: it may have been revoked or its identity's roles changed.
        // The token is renewed (once, however many requests were refused with it; not at
        // all when it is less than a minute old) and the same backend tried again, within
        // the attempt limit and the retry budget; a 401 to the new token cools the backend.
        // Other backends on the same credential keep using the token meanwhile.
        let mut token_refused: Option<Arc<BearerToken>> = None;
        if let (Some(source), Some(used)) = (&backend.entra, token.clone()) {
            if matches!(&result, Ok(r) if r.status == StatusCode::UNAUTHORIZED) {
                backend.state.set_last_status(401);
                record_attempt(ctx, id, AttemptResult::Status(401));
                discard(result.ok());
                match source.refused(&used) {
                    Refusal::Replaced(_) | Refusal::Renewing => {}
                    Refusal::TooRecent { age } => {
                        refused_token(app, backend, age, &snap.config.cooldown, &mut rng);
                        pending_failover = auth_failed(&mut failures, id);
                        continue;
                    }
                    Refusal::Unavailable(message) => {
                        no_token(app, backend, source, &TokenError::Unavailable(message));
                        pending_failover = auth_failed(&mut failures, id);
                        continue;
                    }
                }
                if attempts >= max_attempts {
                    // No attempt left for the retry; the renewal goes on for later requests.
                    failures.push(Outcome::ConnectError);
                    continue;
                }
                let fresh = match source.renewed(&used, token_wait()).await {
                    Ok(t) => t,
                    Err(e) => {
                        no_token(app, backend, source, &e);
                        pending_failover = auth_failed(&mut failures, id);
                        continue;
                    }
                };
                if deadline_passed() {
                    return Ended::DeadlineExceeded {
                        attempts,
                        deadline: deadline.unwrap_or_default(),
                    };
                }
                if let Err(state) = pay_retry(ctx) {
                    tracing::warn!(model = %ctx.req.model, route = %route.name, budget = %state, "retry budget exhausted; no further attempts");
                    return Ended::BudgetExhausted { attempts, state };
                }
                let prepared = prepare_attempt(backend, model, ctx, &mut lazy_body_info);
                let req = match upstream_request(&prepared, backend, ctx, Some(&fresh)) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(backend = %backend.cfg.name, error = %e, "could not build the upstream request");
                        failures.push(Outcome::ConnectError);
                        continue;
                    }
                };
                token = Some(Arc::clone(&fresh));
                attempts += 1;
                tracing::debug!(backend = %backend.cfg.name, "retrying with a renewed Entra ID token");
                let left = remaining();
                deadline_bound = left.is_some_and(|r| r < first_byte);
                result = app
                    .upstream
                    .relay(req, left.map_or(first_byte, |r| r.min(first_byte)))
                    .await;
                if matches!(&result, Ok(r) if r.status == StatusCode::UNAUTHORIZED) {
                    token_refused = Some(fresh);
                }
            }
        }
        drop(token);
        // When the answer (or the failure) came: also when a served request's time to
        // its answer ends (see `finish`).
        let answered_at = crate::now::now();
        let now = app.clock.ms_at(answered_at);
        let (attempt, outcome, hint, response) = match result {
            Ok(resp) => {
                let status = resp.status.as_u16();
                backend.state.set_last_status(status);
                deployment.set_last_status(status);
                let signals = Signals::read(&resp.headers);
                let hint =
                    retry_hint(|n| signals.get(n), now).map(|h| h.min(snap.config.cooldown.max));
                // What the response says about the deployment's capacity. When it says
                // something, the reservation ends here (the backend has counted the
                // request); otherwise it ends with the body, corrected by its usage.
                let h = parse_ratelimit(|n| signals.get(n));
                if !h.is_empty() {
                    let policy = snap
                        .config
                        .priority
                        .as_ref()
                        .map(|p| p.capacity)
                        .unwrap_or_default();
                    deployment.observe_capacity(&h, &policy, now);
                    app.store
                        .capacity_observed(&backend.cfg.name, dep_name, &deployment);
                    if let Some(r) = reservation.take() {
                        r.settle(None, now);
                    }
                }
                (
                    AttemptResult::Status(status),
                    Outcome::from_status(status),
                    hint,
                    Some(resp),
                )
            }
            Err(AttemptError::FirstByteTimeout(_)) if deadline_bound => {
                tracing::info!(backend = %backend.cfg.name, model, "request deadline reached while waiting for the backend");
                return Ended::DeadlineExceeded {
                    attempts,
                    deadline: deadline.unwrap_or_default(),
                };
            }
            Err(e) => {
                backend.state.set_last_status(0);
                tracing::warn!(backend = %backend.cfg.name, error = %e, "upstream attempt failed");
                (
                    AttemptResult::ConnectError,
                    Outcome::ConnectError,
                    None,
                    None,
                )
            }
        };
        record_attempt(ctx, id, attempt);
        if let (Some(refused), Some(source)) = (token_refused, &backend.entra) {
            // The backend refused the newer token too. When it is recent (the usual case),
            // the identity lacks access to this resource; a replacement that was already
            // old gets the usual renewal instead. Either way the backend is taken out and
            // the request moves on; the client never sees a 401 that is about the
            // gateway's identity.
            match source.refused(&refused) {
                Refusal::TooRecent { age } => {
                    refused_token(app, backend, age, &snap.config.cooldown, &mut rng);
                }
                Refusal::Replaced(_) | Refusal::Renewing | Refusal::Unavailable(_) => {
                    let e = TokenError::Unavailable(Arc::from("the backend refused the token"));
                    no_token(app, backend, source, &e);
                }
            }
            discard(response);
            pending_failover = auth_failed(&mut failures, id);
            continue;
        }
        if record_breaker(
            backend,
            attempt,
            hint,
            now,
            &snap.config.cooldown,
            &mut rng,
            &*app.store,
        ) {
            app.metrics.cooldown_started(&backend.cfg.name, "tripped");
        }
        if !outcome.fails_over() {
            // It answered (a success or the client's own error). Only the request holding
            // a probe slot ends a recovery: a request sent before the cooldown began and
            // answered after it must not.
            if let Some(g) = probes.resource.as_mut() {
                g.recovered();
            }
            if let Some(g) = probes.deployment.as_mut() {
                g.recovered();
            }
        }

        let step = if forced {
            Step::Return
        } else {
            match policy.next(attempt, hint, tries_before + 1, attempts - 1, rng.f64()) {
                // A wait that would outlast the deadline: move on instead.
                Step::RetrySame(wait) if remaining().is_some_and(|r| wait >= r) => Step::Switch,
                s => s,
            }
        };
        // A backend retried for this same request is not cooled yet: it is cooled when the
        // request gives up on it.
        if !matches!(step, Step::RetrySame(_)) {
            if let Some(reason) = CoolReason::from_outcome(outcome) {
                if snap.config.cooldown.on.matches(attempt) {
                    // Throttling and errors are the deployment's; a failed connection is
                    // the whole resource's.
                    let target = if reason == CoolReason::ConnectError {
                        &backend.state
                    } else {
                        &deployment
                    };
                    // Counted when a cooldown starts, not when a running one is extended.
                    let started = cool(
                        backend,
                        model,
                        target,
                        reason,
                        hint,
                        now,
                        &snap.config.cooldown,
                        response.as_ref().map(|r| r.status.as_u16()),
                        &mut rng,
                        &*app.store,
                    );
                    if started {
                        app.metrics
                            .cooldown_started(&backend.cfg.name, reason.as_str());
                    }
                }
            }
        }
        match step {
            // Not retried, or retries used up: the backend's own answer goes back (as
            // APIM's retry policy returns its last response).
            Step::Return | Step::GiveUp => match response {
                Some(response) => {
                    return Ended::Served {
                        backend: id,
                        model: ci,
                        attempts,
                        response,
                        reservation,
                        answered_at,
                    }
                }
                None => {
                    failures.push(outcome);
                    return give_up(attempts, failures, last_answer);
                }
            },
            Step::Switch => {
                pending_failover = Some((id, outcome_label(attempt)));
                failures.push(outcome);
                match response {
                    Some(r) if !outcome.fails_over() => {
                        discard(last_answer.take().map(|(_, _, r)| r));
                        last_answer = Some((id, ci, r));
                    }
                    other => {
                        discard(other);
                        discard(last_answer.take().map(|(_, _, r)| r));
                    }
                }
            }
            Step::RetrySame(wait) => {
                discard(response);
                // Paid before waiting: a spent budget ends the request now, not after.
                if let Err(state) = pay_retry(ctx) {
                    tracing::warn!(model = %ctx.req.model, route = %route.name, budget = %state, "retry budget exhausted; no further attempts");
                    return Ended::BudgetExhausted { attempts, state };
                }
                tracing::debug!(backend = %backend.cfg.name, wait_ms = wait.as_millis() as u64, tries = tries_before + 1, "retrying the same backend");
                next = Next::Same {
                    backend: id,
                    model: ci,
                    tries: tries_before + 1,
                    wait,
                    probes,
                    outcome,
                };
            }
        }
    }
}

/// How a request ends when no backend is left: the last answer when it was a backend's
/// own verdict, else the gateway's error.
fn give_up(
    attempts: u32,
    failures: Vec<Outcome>,
    last_answer: Option<(BackendId, usize, Upstreamed)>,
) -> Ended {
    match last_answer {
        Some((backend, model, response)) => Ended::Served {
            backend,
            model,
            attempts,
            response,
            reservation: None,
            answered_at: crate::now::now(),
        },
        None => Ended::Exhausted { attempts, failures },
    }
}

/// Feeds the backend's circuit breaker and trips it when its rule says so; says whether
/// it tripped.
fn record_breaker(
    backend: &BackendRt,
    attempt: AttemptResult,
    hint: Option<Duration>,
    now: u64,
    cooldown: &spillgate_core::config::CooldownPolicy,
    rng: &mut fastrand::Rng,
    store: &dyn StateStore,
) -> bool {
    let Some(cfg) = &backend.cfg.breaker else {
        return false;
    };
    let failed = cfg.condition.matches(attempt);
    let Some((total, fails)) = backend.state.breaker_record(cfg.policy.window, now, failed) else {
        return false;
    };
    if !cfg.policy.should_trip(total, fails) {
        return false;
    }
    backend.state.breaker_clear();
    let d = cfg.policy.trip_for(hint);
    let until_ms = now.saturating_add(millis(d + jitter(d, cooldown, rng)));
    let trip = Cooldown {
        until_ms,
        reason: CoolReason::Tripped,
    };
    if backend.state.cool(trip) {
        store.cooled(&backend.cfg.name, None, trip);
    }
    tracing::warn!(
        backend = %backend.cfg.name,
        failures = fails,
        requests = total,
        trip_ms = millis(d),
        "circuit breaker tripped"
    );
    true
}

/// A random extra delay of up to 10% of a cooldown, at most `cooldown.max_jitter`, so
/// that many requests and instances do not all come back at the same instant.
fn jitter(
    d: Duration,
    policy: &spillgate_core::config::CooldownPolicy,
    rng: &mut fastrand::Rng,
) -> Duration {
    let cap = (d / 10).min(policy.max_jitter);
    if cap.is_zero() {
        return Duration::ZERO;
    }
    Duration::from_millis(rng.u64(0..=millis(cap)))
}

#[expect(
    clippy::too_many_arguments,
    reason = "one log line needs every field; a struct would only rename them"
)]
fn cool(
    backend: &BackendRt,
    model: &str,
    target: &BackendState,
    reason: CoolReason,
    hint: Option<Duration>,
    now: u64,
    policy: &spillgate_core::config::CooldownPolicy,
    status: Option<u16>,
    rng: &mut fastrand::Rng,
    store: &dyn StateStore,
) -> bool {
    let d = cooldown_duration(reason, hint, policy);
    let until_ms = now.saturating_add(millis(d + jitter(d, policy, rng)));
    let cooldown = Cooldown { until_ms, reason };
    let Cooled { started, extended } = target.cool_at(cooldown, now);
    let resource = std::ptr::eq(target, &*backend.state);
    let scope = if resource { "backend" } else { "deployment" };
    if extended {
        let deployment = (!resource).then(|| backend.cfg.deployment_for(model).unwrap_or(model));
        store.cooled(&backend.cfg.name, deployment, cooldown);
    }
    tracing::info!(
        backend = %backend.cfg.name,
        deployment = backend.cfg.deployment_for(model).unwrap_or(model),
        scope,
        reason = reason.as_str(),
        status = status.unwrap_or(0),
        cooldown_ms = millis(d),
        from_header = hint.is_some(),
        extended,
        "backend cooling down"
    );
    started
}

/// Longest a request waits for an Entra ID token that is being fetched (at start, or
/// after the last one expired); the fetch itself goes on in the background.
const TOKEN_WAIT: Duration = Duration::from_secs(10);

/// A request found no token for `backend`: the backend cools (until the source's next try,
/// or briefly while a slow fetch goes on) and the request moves on. The source logs the
/// cause once per run of failures; this line is per request, so it is a debug line.
fn no_token(app: &App, backend: &BackendRt, source: &crate::entra::TokenSource, e: &TokenError) {
    let d = source.retry_in().unwrap_or_default() + crate::app::AUTH_COOLDOWN_GRACE;
    app.cool_for_auth(backend, d);
    tracing::debug!(backend = %backend.cfg.name, error = %e, "no Entra ID token for the backend; moving on");
}

/// `backend` refused an Entra ID token that a renewal would not improve (newly obtained,
/// or younger than [`crate::entra::MIN_RENEWAL_AGE`]): it is cooled (reason "auth",
/// `cooldown.default_auth`) for its whole time, whatever tokens arrive meanwhile.
fn refused_token(
    app: &App,
    backend: &BackendRt,
    token_age: Duration,
    policy: &spillgate_core::config::CooldownPolicy,
    rng: &mut fastrand::Rng,
) {
    let d = cooldown_duration(CoolReason::Auth, None, policy);
    let d = d + jitter(d, policy, rng);
    if app.cool_for_refused_token(backend, d) {
        tracing::warn!(
            backend = %backend.cfg.name,
            credential = backend.entra.as_ref().map_or("", |s| s.label()),
            token_age_s = token_age.as_secs(),
            cooldown_ms = millis(d),
            "the backend refused a recent Entra ID token (401): does the identity have the \"Cognitive Services OpenAI User\" role on this resource?"
        );
    }
}

/// What an attempt on `backend` sends of its own: the target for the backend's kind and
/// deployment, and the body (with the backend's model when it takes it in the body).
fn prepare_attempt(
    backend: &BackendRt,
    model: &str,
    ctx: &Ctx<'_>,
    lazy_body_info: &mut Option<BodyInfo>,
) -> anyhow::Result<Prepared> {
    let req = ctx.req;
    let deployment = backend
        .cfg
        .deployment_for(model)
        .ok_or_else(|| anyhow::anyhow!("backend does not serve the model"))?;
    // Azure classic requests carry the model in the path; their body is only read when a
    // backend needs the model in the body (an OpenAI-kind backend).
    let (info, body_model) = match (&req.body_info, backend.cfg.kind) {
        // Read when the request was classified; its model was taken into `req.model`.
        (Some(i), _) => (Some(i), Some(req.model.as_str())),
        (None, BackendKind::Openai) => {
            if lazy_body_info.is_none() {
                *lazy_body_info = Some(inspect_body(&ctx.body).unwrap_or(BodyInfo {
                    model: None,
                    model_span: None,
                    is_object: false,
                    limits: [None; 4],
                }));
            }
            let info = lazy_body_info.as_ref();
            (info, info.and_then(|i| i.model.as_deref()))
        }
        (None, _) => (None, None),
    };
    let target = upstream_target(
        &RequestParts {
            shape: req.shape,
            operation: req.operation,
            query: req.query,
            body_model,
            body_is_object: info.is_some_and(|i| i.is_object),
        },
        backend.cfg.kind,
        &backend.base_path,
        deployment,
        (backend.cfg.azure_api, &backend.cfg.api_version),
    );
    let body = match (&target.body_model, info) {
        (Some(name), Some(info)) => match set_model(&ctx.body, info, name) {
            Some(b) => Bytes::from(b),
            None => ctx.body.clone(),
        },
        _ => ctx.body.clone(),
    };
    Ok(Prepared {
        target: target.path_and_query,
        body,
    })
}

/// What an attempt's request has of its own: its target (path and query) and its body
/// (the client's, or a copy with the backend's model).
struct Prepared {
    target: String,
    body: Bytes,
}

/// The request to `backend` of an attempt `prepared` for it: the client's forwarded
/// headers, lent, and the backend's credential (`bearer`, the Entra ID token, else its
/// key). The error is why it could not be built.
fn upstream_request<'a>(
    prepared: &'a anyhow::Result<Prepared>,
    backend: &'a BackendRt,
    ctx: &'a Ctx<'_>,
    bearer: Option<&'a BearerToken>,
) -> anyhow::Result<UpstreamRequest<'a>> {
    let prepared = prepared.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let credential = match bearer {
        Some(t) => Some((&header::AUTHORIZATION, t.header())),
        None => backend
            .credential
            .as_ref()
            .map(|(name, value)| (name, value)),
    };
    Ok(UpstreamRequest::new(
        ctx.method,
        (&backend.scheme, &backend.authority),
        &prepared.target,
        SharedHeaders::Forwarded(ctx.upstream_headers),
        credential,
        prepared.body.clone(),
    )?)
}

/// Counts an answered request: by backend, status class, priority and (bounded) model;
/// and for low priority, whether it was admitted.
/// Counts a request the backend at `backend` (an index of the snapshot's backends)
/// answered with `status`; `None` when the gateway answered itself.
fn record_request(ctx: &Ctx<'_>, backend: Option<usize>, status: u16) {
    let table = &ctx.snap.config.table;
    let model = table
        .model_index(&ctx.req.model)
        .map_or(0, |i| i as u64 + 1);
    let key = (backend.map_or(0xffff, |b| b as u64) << 40)
        | ((model & 0xff_ffff) << 16)
        | (u64::from(status / 100) << 1)
        | u64::from(ctx.low);
    let make = || {
        let backend = backend.map_or(Label::from("-"), |b| {
            (&ctx.snap.backends[b].cfg.name).into()
        });
        ctx.app
            .metrics
            .requests
            .get_or_create(&vec![
                ("backend", backend),
                ("status_class", crate::metrics::status_class(status)),
                ("priority", if ctx.low { "low" } else { "high" }.into()),
                (
                    "model",
                    table.model_label(&ctx.req.model).to_string().into(),
                ),
            ])
            .clone()
    };
    ctx.snap.handles.requests.with(key, make, |c| c.inc());
}

/// Counts a request the gateway answered itself before choosing a backend (401, 400,
/// 404, 408, 413, the model list): rare, so looked up by its labels.
fn record_local(app: &App, status: u16, low: bool) {
    app.metrics
        .requests
        .get_or_create(&vec![
            ("backend", "-".into()),
            ("status_class", crate::metrics::status_class(status)),
            ("priority", if low { "low" } else { "high" }.into()),
            ("model", "-".into()),
        ])
        .inc();
}

/// An attempt that ended for want of a usable token: a connect failure, and the request
/// fails over with reason `auth`.
fn auth_failed(failures: &mut Vec<Outcome>, id: BackendId) -> Option<(BackendId, Label)> {
    failures.push(Outcome::ConnectError);
    Some((id, Label::from("auth")))
}

/// An attempt's `outcome` metric label.
fn outcome_label(attempt: AttemptResult) -> Label {
    match attempt {
        AttemptResult::ConnectError => Label::from("connect"),
        AttemptResult::Status(429) => Label::from("429"),
        AttemptResult::Status(s) => crate::metrics::status_class(s),
    }
}

/// Counts an upstream attempt at the backend at index `id` and its outcome.
fn record_attempt(ctx: &Ctx<'_>, id: usize, attempt: AttemptResult) {
    let code = match attempt {
        AttemptResult::ConnectError => 1,
        AttemptResult::Status(429) => 2,
        AttemptResult::Status(s) => 3 + u64::from(s / 100),
    };
    let outcome = outcome_label(attempt);
    let make = || {
        ctx.app
            .metrics
            .attempts
            .get_or_create(&vec![
                ("backend", (&ctx.snap.backends[id].cfg.name).into()),
                ("outcome", outcome),
            ])
            .clone()
    };
    ctx.snap
        .handles
        .attempts
        .with((id as u64) << 16 | code, make, |c| c.inc());
}

fn finish(ended: Ended, ctx: &Ctx<'_>, client: &Client, app: &Arc<App>) -> Reply<Body> {
    // The attempts' end: read by the attempt loop when a backend answered.
    let finished_at = match &ended {
        Ended::Served { answered_at, .. } => *answered_at,
        _ => crate::now::now(),
    };
    let elapsed = finished_at.saturating_duration_since(ctx.started);
    let elapsed_ms = elapsed.as_secs_f64() * 1000.0;
    let snap = ctx.snap;
    let req = ctx.req;
    let route = &snap.config.table.routes[ctx.route_id];
    match ended {
        Ended::Served {
            backend,
            model,
            attempts,
            response,
            reservation,
            ..
        } => {
            let b = &snap.backends[backend];
            let served_model = candidate_model(ctx, model);
            let Upstreamed {
                status,
                headers,
                body,
            } = response;
            let content_type = headers.first(&CONTENT_TYPE).unwrap_or_default();
            let sse = content_type.starts_with(b"text/event-stream");
            let json_body = content_type.starts_with(b"application/json");
            // The body changes length when the usage chunk is taken out.
            let strip = ctx.strip_usage && sse;
            // The request's own model, read from its body: the body's bytes.
            let own = req
                .body_info
                .as_ref()
                .filter(|_| model == 0)
                .and_then(|info| model_header(&ctx.body, info, &req.model));
            // Both names are ones `is_safe_name` allows: valid header values.
            debug_assert!(is_safe_name(served_model) && is_safe_name(&req.model));
            let model_value =
                own.unwrap_or_else(|| Bytes::copy_from_slice(served_model.as_bytes()));
            tracing::info!(
                model = %req.model,
                served_model,
                route = %route.name,
                client = client.name(),
                backend = %b.cfg.name,
                status = status.as_u16(),
                attempts,
                priority = if ctx.low { "low" } else { "high" },
                ttfb_ms = elapsed_ms,
                "request"
            );
            let idle = snap.config.timeouts.idle;
            let priority_label = if ctx.low { "low" } else { "high" };
            record_request(ctx, Some(backend), status.as_u16());
            b.state.count_served();
            let by_priority = |family: &Family<Labels, Histogram>| {
                family
                    .get_or_create(&vec![("priority", priority_label.into())])
                    .clone()
            };
            let handles = &snap.handles;
            handles.ttfb.with(
                u64::from(ctx.low),
                || by_priority(&app.metrics.ttfb),
                |h| h.observe(elapsed.as_secs_f64()),
            );
            let tokens_key = (backend as u64) << 32 | u64::from(client.index());
            let tokens_family = || {
                app.metrics
                    .tokens
                    .get_or_create(&vec![
                        ("backend", (&b.cfg.name).into()),
                        ("client", client.label()),
                    ])
                    .clone()
            };
            let duration_family = || by_priority(&app.metrics.duration);
            // A body that came whole with its head (nearly every non-streamed answer) is
            // read and settled now; a stream is not looked at before the client gets it.
            // Its duration then ends when the gateway has it whole, not when the client's
            // connection has taken it: for a body of one read (at most 64 KiB), the same
            // moment, unless the client has stopped reading.
            let taken = if sse {
                Taken::Partial(Resumed::new(body))
            } else {
                take_whole(body)
            };
            let body = match taken {
                // Read whole now: it ends when the answer does. The metrics are updated
                // through the thread's handles, not clones of them (a clone and its drop
                // are two atomic instructions each).
                Taken::Whole(bytes) => {
                    let used = crate::priority::whole_json_usage(json_body, &bytes);
                    if let Some(r) = reservation {
                        r.settle(used, app.clock.ms_at(finished_at));
                    }
                    // Looked up with no usage too: the series is there from the first
                    // answer, as for a stream.
                    handles.tokens.with(tokens_key, tokens_family, |c| {
                        if let Some(u) = used {
                            c.inc_by(u);
                        }
                    });
                    handles
                        .duration
                        .with(u64::from(ctx.low), duration_family, |h| {
                            h.observe(elapsed.as_secs_f64())
                        });
                    ReplyBody::Whole(bytes)
                }
                // When the body ends: its duration, the tokens its usage reports, and
                // (with request priority) the release of the deployment's reservation,
                // corrected by that usage.
                Taken::Partial(body) => {
                    let duration = handles.duration.with(
                        u64::from(ctx.low),
                        duration_family,
                        Histogram::clone,
                    );
                    let tokens = handles
                        .tokens
                        .with(tokens_key, tokens_family, Counter::clone);
                    // Only a reservation needs the clock's base (an atomic count each way).
                    let app_end = reservation.as_ref().map(|_| Arc::clone(app));
                    let started = ctx.started;
                    let on_usage = move |used: Option<u64>| {
                        let end = crate::now::now();
                        if let (Some(r), Some(app)) = (reservation, app_end) {
                            r.settle(used, app.clock.ms_at(end));
                        }
                        if let Some(u) = used {
                            tokens.inc_by(u);
                        }
                        duration.observe(end.saturating_duration_since(started).as_secs_f64());
                    };
                    // The layers nest directly, boxed once at the top: each `Body::new`
                    // between them added a dynamic call and an error conversion to every
                    // poll of a chunk.
                    let body = crate::coalesce::Coalesce::new(crate::priority::UsageTap::new(
                        body, sse, json_body, strip, on_usage,
                    ));
                    ReplyBody::Stream(Body::new(crate::idle::IdleTimeout::new(idle, body)))
                }
            };
            match headers {
                UpstreamHeaders::Wire(lines) => Reply::Relay(Relay {
                    head: RelayHead {
                        status,
                        length: if strip { None } else { lines.declared_length() },
                        lines,
                        backend: b.name_header.clone(),
                        attempts: attempts_value(attempts),
                        model: Some(model_value),
                        request_id: None,
                    },
                    body,
                }),
                UpstreamHeaders::Map(map) => {
                    let mut headers = response_headers(map, ADDED_RESPONSE_HEADERS);
                    if strip {
                        headers.remove(header::CONTENT_LENGTH);
                    }
                    headers.insert(HEADER_BACKEND, b.name_header.clone());
                    headers.insert(HEADER_ATTEMPTS, attempts_value(attempts));
                    if let Ok(v) = HeaderValue::from_maybe_shared(model_value) {
                        headers.insert(HEADER_MODEL, v);
                    }
                    let mut resp = Response::new(body.into_body());
                    *resp.status_mut() = status;
                    *resp.headers_mut() = headers;
                    Reply::Response(resp)
                }
            }
        }
        other => {
            let now = ctx.app.clock.now_ms();
            let (attempts, err) = match other {
                Ended::Exhausted { attempts, failures } => (attempts, exhausted_error(ctx, &failures, now)),
                Ended::BudgetExhausted { attempts, state } => (
                    attempts,
                    GatewayError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "service_unavailable_error",
                        "retry_budget_exhausted",
                        format!(
                            "The backends for model `{}` are failing and this gateway's retry budget is spent ({state}); no further attempts were made. Retry after the time in the Retry-After header.",
                            req.model
                        ),
                    )
                    .with_retry_after(soonest_recovery(ctx, now)),
                ),
                Ended::DeadlineExceeded { attempts, deadline } => (
                    attempts,
                    GatewayError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout_error",
                        "deadline_exceeded",
                        format!(
                            "No backend answered model `{}` within the request deadline of {} ms ({attempts} attempt(s)).",
                            req.model,
                            deadline.as_millis()
                        ),
                    ),
                ),
                        Ended::PriorityRefused { attempts, retry_after } => (
                    attempts,
                    GatewayError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "rate_limit_error",
                        "low_priority_refused",
                        format!(
                            "This low-priority request was refused by the gateway, not by a backend: no backend serving model `{}` has capacity to spare above the reserve kept for high-priority traffic. Retry after the time in the Retry-After header.",
                            req.model
                        ),
                    )
                    .with_retry_after(retry_after),
                ),
                Ended::Served { .. } => unreachable_served(),
            };
            tracing::info!(
                model = %req.model,
                route = %route.name,
                client = client.name(),
                backend = "-",
                status = err.status.as_u16(),
                code = err.code,
                attempts,
                ttfb_ms = elapsed_ms,
                "request: no backend answer"
            );
            record_request(ctx, None, err.status.as_u16());
            let mut resp = err.into_response();
            resp.headers_mut()
                .insert(HEADER_ATTEMPTS, attempts_value(attempts));
            Reply::Response(resp)
        }
    }
}

/// The attempts header's value. Nearly every request takes one attempt, so single
/// digits are static values rather than a new allocation per response.
fn attempts_value(attempts: u32) -> HeaderValue {
    const DIGITS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match DIGITS.get(attempts as usize) {
        Some(d) => HeaderValue::from_static(d),
        None => HeaderValue::from(attempts),
    }
}

/// `finish` matches `Served` first; this arm only satisfies the compiler.
fn unreachable_served() -> (u32, GatewayError) {
    (
        0,
        GatewayError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal",
            "internal error",
        ),
    )
}

/// The cooldowns of every candidate of the request (its pool and its fallbacks'), with
/// the number of candidates.
fn candidate_cooldowns(ctx: &Ctx<'_>, now_ms: u64) -> (usize, Vec<Cooldown>) {
    let chain = fallback_chain(ctx);
    let mut n = 0;
    let mut cooldowns = Vec::new();
    for (id, ci) in candidates(ctx, &chain) {
        n += 1;
        if let Some(c) = ctx.snap.backends[id].cooldown_for(chain[ci].model, now_ms) {
            cooldowns.push(c);
        }
    }
    (n, cooldowns)
}

/// Time until the soonest cooldown among the request's candidates ends; 1 s when none is
/// cooling.
fn soonest_recovery(ctx: &Ctx<'_>, now_ms: u64) -> Duration {
    soonest_of(&candidate_cooldowns(ctx, now_ms).1, now_ms)
}

fn soonest_of(cooldowns: &[Cooldown], now_ms: u64) -> Duration {
    cooldowns
        .iter()
        .map(|c| c.until_ms - now_ms)
        .min()
        .map_or(Duration::from_secs(1), Duration::from_millis)
}

/// The answer when no backend could serve: 429 when throttling is all there is, 503 when
/// some backend failed; `Retry-After` is the soonest recovery among the candidates.
fn exhausted_error(ctx: &Ctx<'_>, failures: &[Outcome], now_ms: u64) -> GatewayError {
    let (n, cooldowns) = candidate_cooldowns(ctx, now_ms);
    let throttled_only = failures.iter().all(|o| *o == Outcome::Throttled)
        && cooldowns.iter().all(|c| c.reason == CoolReason::Throttled);
    let model = &ctx.req.model;
    let err = if throttled_only {
        GatewayError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "all_backends_throttled",
            format!(
                "All {n} backend(s) serving model `{model}` are over their rate limits. Retry after the time in the Retry-After header."
            ),
        )
    } else {
        let no_token = cooldowns
            .iter()
            .filter(|c| c.reason == CoolReason::Auth)
            .count();
        let why = if no_token > 0 {
            format!(
                "failing or cooling down, {no_token} of them for lack of a usable Entra ID token"
            )
        } else {
            "failing or cooling down".to_string()
        };
        GatewayError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable_error",
            "no_backend_available",
            format!(
                "No backend serving model `{model}` could take the request ({n} configured; {why}). Retry after the time in the Retry-After header."
            ),
        )
    };
    err.with_retry_after(soonest_of(&cooldowns, now_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gateway's own id is written as its digits wherever it goes: upstream, in a
    /// relayed answer's lines, as a header value and in the logs.
    #[test]
    fn a_request_id_of_the_gateways_reads_the_same_every_way() {
        let own = RequestId::Own(*b"0123456789abcdef");
        assert_eq!(own.as_bytes(), b"0123456789abcdef");
        assert_eq!(own.as_str(), "0123456789abcdef");
        assert_eq!(own.to_value(), "0123456789abcdef");
        let client = RequestId::Client(HeaderValue::from_static("client-1"));
        assert_eq!(client.as_str(), "client-1");
        assert_eq!(client.to_value(), "client-1");
        let forwarded = Forwarded::new(h1::raw_headers(b"Host: x\r\n\r\n"), own.clone());
        let mut sent = Vec::new();
        forwarded.each_header(None, &mut |n, v| sent.push((n.to_vec(), v.to_vec())));
        assert!(
            sent.contains(&(b"x-request-id".to_vec(), b"0123456789abcdef".to_vec())),
            "{sent:?}"
        );
        assert_eq!(
            forwarded.to_map(None)[HEADER_REQUEST_ID],
            "0123456789abcdef"
        );
        let mut relay = test_relay(b"Content-Length: 0\r\n\r\n", Some(0), ());
        relay.set_request_id(own);
        let mut lines = Vec::new();
        relay.head.write_headers(&mut lines);
        let lines = String::from_utf8(lines).unwrap();
        assert!(
            lines.contains("x-request-id: 0123456789abcdef\r\n"),
            "{lines}"
        );
    }

    fn body_of(pieces: &[&'static str]) -> ClientBody {
        let frames: Vec<Result<http_body::Frame<Bytes>, std::io::Error>> = pieces
            .iter()
            .map(|p| Ok(http_body::Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        ClientBody::new(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
    }

    #[tokio::test]
    async fn bodies_are_collected_whole_and_within_their_limit() {
        assert_eq!(collect_body(body_of(&[]), 4).await, Ok(Bytes::new()));
        let one = collect_body(body_of(&["abcd"]), 4).await;
        assert_eq!(one, Ok(Bytes::from_static(b"abcd")));
        let many = collect_body(body_of(&["ab", "", "c", "d"]), 4).await;
        assert_eq!(many, Ok(Bytes::from_static(b"abcd")));
        assert_eq!(
            collect_body(body_of(&["abcde"]), 4).await,
            Err(BodyRead::TooLarge)
        );
        assert_eq!(
            collect_body(body_of(&["ab", "cde"]), 4).await,
            Err(BodyRead::TooLarge)
        );
        let broken = ClientBody::new(http_body_util::StreamBody::new(futures_util::stream::iter(
            vec![
                Ok(http_body::Frame::data(Bytes::from_static(b"ab"))),
                Err(std::io::Error::other("cut")),
            ],
        )));
        assert_eq!(collect_body(broken, 4).await, Err(BodyRead::Broken));
    }

    #[test]
    fn the_model_header_shares_the_body_only_when_it_holds_the_model_as_it_is() {
        let header_of = |json: &'static str| {
            let body = Bytes::from_static(json.as_bytes());
            let info = inspect_body(&body).unwrap();
            let model = info.model.clone().unwrap();
            (model_header(&body, &info, &model), model)
        };
        let json = r#"{"messages":[],"model":"gpt-4o","stream":true}"#;
        let (plain, model) = header_of(json);
        assert_eq!(model, "gpt-4o");
        let plain = plain.unwrap();
        assert_eq!(plain, "gpt-4o");
        assert!(HeaderValue::from_maybe_shared(plain.clone()).is_ok());
        // The value's bytes are the body's own, not a copy.
        assert!(json.as_bytes().as_ptr_range().contains(&plain.as_ptr()));
        // The parser's reading of an escaped name: the text differs, so no shared value.
        let (escaped, model) = header_of(r#"{"model":"gpt\u002d4o"}"#);
        assert_eq!(model, "gpt-4o");
        assert_eq!(escaped, None);
    }

    #[test]
    fn attempts_values_are_their_decimal_numbers() {
        for n in [0, 1, 9, 10, 42, u32::MAX] {
            assert_eq!(attempts_value(n), n.to_string().as_str(), "{n}");
        }
    }

    #[test]
    fn signals_cover_every_header_the_parsers_read() {
        let asked = std::cell::RefCell::new(Vec::new());
        let record = |n: &str| {
            asked.borrow_mut().push(n.to_string());
            None
        };
        let _ = retry_hint(record, 0);
        let _ = parse_ratelimit(record);
        let asked = asked.into_inner();
        assert!(asked.len() >= 9, "{asked:?}");
        for n in &asked {
            assert!(
                SIGNAL_HEADERS.contains(&n.as_str()),
                "{n} is read but not in SIGNAL_HEADERS"
            );
        }
    }

    #[test]
    fn signals_read_what_a_header_lookup_reads() {
        let mut h = HeaderMap::new();
        h.append("content-type", HeaderValue::from_static("application/json"));
        h.append(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from_static("900"),
        );
        h.append(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from_static("1"),
        );
        h.append("retry-after", HeaderValue::from_static("7"));
        h.append("x-ms-retry-after-ms", HeaderValue::from_static("1500"));
        h.append("x-ms-region", HeaderValue::from_static("Sweden Central"));
        h.append(
            "x-ratelimit-limit-requests",
            HeaderValue::from_bytes(b"\xff").unwrap(),
        );
        let map = UpstreamHeaders::Map(h.clone());
        // The same head as it came, names in any case.
        let wire = UpstreamHeaders::Wire(h1::raw_headers(
            b"Content-Type: application/json\r\nX-RateLimit-Remaining-Tokens: 900\r\n\
              x-ratelimit-remaining-tokens: 1\r\nRetry-After: 7\r\nX-MS-Retry-After-Ms: 1500\r\n\
              x-ms-region: Sweden Central\r\nX-Ratelimit-Limit-Requests: \xff\r\n\r\n",
        ));
        for headers in [&map, &wire] {
            let s = Signals::read(headers);
            for n in SIGNAL_HEADERS {
                assert_eq!(s.get(n), h.get(n).and_then(|v| v.to_str().ok()), "{n}");
            }
            assert_eq!(s.get("x-ratelimit-remaining-tokens"), Some("900"));
        }
        let s = Signals::read(&wire);
        assert_eq!(
            retry_hint(|n| s.get(n), 0),
            Some(Duration::from_millis(1500))
        );
    }

    /// A header map of `pairs`, in order, repeated names appended.
    fn header_map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        h
    }

    /// The headers a client gets of a backend's answer, as `(name, value)` pairs in
    /// lower case, sorted: through a map (`response_headers`, the gateway's own inserted,
    /// then the listener's writer, which leaves out the framing headers) and relayed as
    /// they came.
    fn client_headers(lines: &[u8], strip: bool, model: bool) -> [Vec<(String, String)>; 2] {
        let sorted = |mut pairs: Vec<(String, String)>| {
            pairs.sort();
            pairs
        };
        let own = |name: &HeaderName, value: &'static str| {
            (name.clone(), HeaderValue::from_static(value))
        };
        let own = [
            own(&HEADER_BACKEND, "tier1"),
            own(&HEADER_ATTEMPTS, "2"),
            own(&HEADER_MODEL, "gpt-4o"),
            own(&HEADER_REQUEST_ID, "req-1"),
        ];
        let raw = h1::raw_headers(lines);
        let mut map = response_headers(raw.to_map(), ADDED_RESPONSE_HEADERS);
        if strip {
            map.remove(header::CONTENT_LENGTH);
        }
        for (name, value) in &own {
            if model || *name != HEADER_MODEL {
                map.insert(name.clone(), value.clone());
            }
        }
        let through_map = map
            .iter()
            .filter(|(n, _)| {
                ![
                    header::CONNECTION,
                    header::TRANSFER_ENCODING,
                    header::CONTENT_LENGTH,
                ]
                .contains(n)
            })
            .map(|(n, v)| (n.as_str().to_string(), v.to_str().unwrap().to_string()))
            .collect();
        let relay = RelayHead {
            status: StatusCode::OK,
            length: None,
            lines: raw,
            backend: own[0].1.clone(),
            attempts: own[1].1.clone(),
            model: model.then(|| Bytes::copy_from_slice(own[2].1.as_bytes())),
            request_id: Some(RequestId::Client(own[3].1.clone())),
        };
        let mut relayed = Vec::new();
        relay.each_header(|n, v| {
            relayed.push((
                String::from_utf8(n.to_ascii_lowercase()).unwrap(),
                String::from_utf8(v.to_vec()).unwrap(),
            ));
        });
        [sorted(through_map), sorted(relayed)]
    }

    /// A relayed answer's client gets the headers the map path gives it: hop-by-hop
    /// ones (and those `Connection` names, in any case), backend-only ones, the framing
    /// and a backend's own `x-spillgate-*` stay behind, its `x-request-id` is renamed,
    /// and the gateway's headers follow.
    #[test]
    fn relayed_answers_carry_the_headers_a_map_would() {
        let heads: [&[u8]; 5] = [
            b"Content-Type: application/json\r\nContent-Length: 5\r\n\r\n",
            b"Content-Type: text/event-stream\r\nConnection: keep-alive, X-Hop, apim-request-id\r\n\
              X-HOP: 1\r\nApim-Request-Id: a\r\nKeep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\n\
              Content-Length: 9\r\nSet-Cookie: a=1\r\nset-cookie: b=2\r\nOpenAI-Organization: org\r\n\
              openai-project: p\r\nX-Request-ID: up-1\r\nx-request-id: up-2\r\n\
              X-Upstream-Request-Id: mine\r\nDate: Tue, 01 Jan 2030 00:00:00 GMT\r\n\
              x-ratelimit-remaining-tokens: 900\r\nX-Spillgate-Backend: other\r\n\
              x-spillgate-attempts: 9\r\nX-Spillgate-Model: m\r\nTE: trailers\r\nTrailer: x\r\n\
              Upgrade: h2c\r\nProxy-Connection: close\r\nProxy-Authenticate: Basic\r\n\
              Proxy-Authorization: Basic eA==\r\nX-Custom: v\r\nX-Custom: w\r\n\r\n",
            b"Connection: close\r\nContent-Length: 0\r\nVary: Accept\r\n\r\n",
            b"connection: ,x-other , \r\nX-Other: 1\r\nx-kept: 2\r\n\r\n",
            b"\r\n",
        ];
        for lines in heads {
            for (strip, model) in [(false, true), (true, true), (false, false)] {
                let [through_map, relayed] = client_headers(lines, strip, model);
                assert_eq!(relayed, through_map, "{}", String::from_utf8_lossy(lines));
            }
        }
        // What that means for the second head.
        let [_, relayed] = client_headers(heads[1], false, true);
        let names: Vec<&str> = relayed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "content-type",
                "date",
                "x-custom",
                "x-custom",
                "x-ratelimit-remaining-tokens",
                "x-request-id",
                "x-spillgate-attempts",
                "x-spillgate-backend",
                "x-spillgate-model",
                "x-upstream-request-id",
                "x-upstream-request-id",
                "x-upstream-request-id",
            ]
        );
    }

    #[test]
    fn backend_only_and_hop_by_hop_headers_stay_behind_and_its_request_id_is_renamed() {
        let mut h = header_map(&[
            ("content-type", "application/json"),
            ("connection", "keep-alive, x-hop"),
            ("keep-alive", "timeout=5"),
            ("x-hop", "1"),
            ("transfer-encoding", "chunked"),
            ("set-cookie", "a=1"),
            ("openai-organization", "org"),
            ("openai-project", "proj"),
            ("x-request-id", "up-1"),
            ("x-ratelimit-remaining-tokens", "900"),
        ]);
        h.append("x-request-id", HeaderValue::from_static("up-2"));
        h.append("set-cookie", HeaderValue::from_static("b=2"));
        let out = response_headers(h, 4);
        let mut names: Vec<_> = out.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "content-type",
                "x-ratelimit-remaining-tokens",
                "x-upstream-request-id"
            ]
        );
        let ids: Vec<_> = out.get_all("x-upstream-request-id").iter().collect();
        assert_eq!(ids, ["up-1", "up-2"]);
        assert_eq!(out["x-ratelimit-remaining-tokens"], "900");
    }

    /// What the lists say of a name the filter lets through: for a request (see
    /// [`not_forwarded_in_any_case`]) and for a response (see [`unreturned_names`]).
    fn forward_listed(n: &str) -> bool {
        HOP_BY_HOP.contains(&n) || not_forwarded(n)
    }
    fn response_listed(n: &str) -> bool {
        HOP_BY_HOP.contains(&n) || not_returned(n)
    }

    #[test]
    fn the_name_filters_let_every_listed_name_through_and_stop_the_usual_ones() {
        let mut names: Vec<String> = [
            &HOP_BY_HOP[..],
            NOT_FORWARDED.concat().as_slice(),
            NOT_RETURNED.concat().as_slice(),
            &h1::COMMON_NAME_TEXTS,
            &[
                "x-forwarded-",
                "x-forwarded",
                "x-forwarded-for-",
                "a",
                "",
                "1x",
                "-",
            ],
        ]
        .concat()
        .into_iter()
        .map(String::from)
        .collect();
        // Each name one byte shorter, longer and changed at each end: near misses.
        for n in names.clone() {
            names.push(format!("{n}x"));
            names.push(format!("x{n}"));
            if let Some(rest) = n.get(1..) {
                names.push(rest.to_string());
                names.push(format!("z{rest}"));
            }
        }
        names.push("x".repeat(64));
        names.push(format!("x-forwarded-{}", "y".repeat(80)));
        for n in &names {
            if forward_listed(n) {
                assert!(
                    FORWARD_FILTER.passes(n.as_bytes()),
                    "{n} stopped on the way upstream"
                );
            }
            if response_listed(n) {
                assert!(
                    RESPONSE_FILTER.passes(n.as_bytes()),
                    "{n} stopped on the way back"
                );
            }
        }
        // What it is for: the names heads are made of are decided without the lists.
        for n in [
            "host",
            "content-type",
            "content-length",
            "user-agent",
            "accept",
            "accept-encoding",
            "x-stainless-lang",
            "x-stainless-package-version",
            "x-stainless-retry-count",
            "x-request-id",
        ] {
            assert!(!FORWARD_FILTER.passes(n.as_bytes()), "{n}");
        }
        for n in [
            "content-type",
            "date",
            "x-request-id",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-remaining-requests",
            "apim-request-id",
            "x-ms-region",
        ] {
            assert!(!RESPONSE_FILTER.passes(n.as_bytes()), "{n}");
        }
    }

    proptest::proptest! {
        #[test]
        fn the_name_filters_never_stop_a_listed_name(n in "(x-forwarded-)?[a-z0-9-]{0,60}") {
            proptest::prop_assert!(!forward_listed(&n) || FORWARD_FILTER.passes(n.as_bytes()));
            proptest::prop_assert!(!response_listed(&n) || RESPONSE_FILTER.passes(n.as_bytes()));
        }
    }

    /// The headers `lines` (a request head without its start line) sends upstream with
    /// the request id `req-1` and no credential, names in lower case.
    fn forwarded(lines: &[u8]) -> Vec<(String, String)> {
        let forwarded = Forwarded::new(
            h1::raw_headers(lines),
            RequestId::Client(HeaderValue::from_static("req-1")),
        );
        let mut sent = Vec::new();
        forwarded.each_header(None, &mut |n, v| {
            sent.push((
                String::from_utf8(n.to_ascii_lowercase()).unwrap(),
                String::from_utf8(v.to_vec()).unwrap(),
            ))
        });
        sent
    }

    /// The headers of `lines` in the map an HTTP/2 upstream gets, as [`forwarded`] gives
    /// them.
    fn forwarded_map(lines: &[u8]) -> Vec<(String, String)> {
        let forwarded = Forwarded::new(
            h1::raw_headers(lines),
            RequestId::Client(HeaderValue::from_static("req-1")),
        );
        forwarded
            .to_map(None)
            .iter()
            .map(|(n, v)| (n.as_str().to_string(), v.to_str().unwrap().to_string()))
            .collect()
    }

    /// What goes upstream of `lines`, by the lists themselves: each header whose name
    /// (in lower case) is neither hop-by-hop nor [`not_forwarded`] (with `_` read as
    /// `-`), nor `host`, `content-length` or `x-request-id`, nor listed by a `Connection`
    /// header; then the request id.
    fn forwarded_by_the_lists(lines: &[u8]) -> Vec<(String, String)> {
        let raw = h1::raw_headers(lines);
        let headers: Vec<(String, String)> = raw
            .fields()
            .map(|(_, n, v)| {
                (
                    String::from_utf8(n.to_ascii_lowercase()).unwrap(),
                    String::from_utf8(v.to_vec()).unwrap(),
                )
            })
            .collect();
        let listed: Vec<String> = headers
            .iter()
            .filter(|(n, _)| n == "connection")
            .flat_map(|(_, v)| v.split(','))
            .map(|t| t.trim().to_ascii_lowercase())
            .collect();
        let mut sent: Vec<(String, String)> = headers
            .iter()
            .filter(|(n, _)| {
                // The lists' names in any spelling with `_` for `-`.
                let hyphens = n.replace('_', "-");
                !(HOP_BY_HOP.contains(&hyphens.as_str())
                    || not_forwarded(&hyphens)
                    || ["host", "content-length", "x-request-id"].contains(&n.as_str())
                    || listed.contains(n))
            })
            .cloned()
            .collect();
        sent.push(("x-request-id".into(), "req-1".into()));
        sent
    }

    #[test]
    fn client_network_and_credentials_stay_behind() {
        let lines = b"Api-Key: k\r\nAUTHORIZATION: Bearer k\r\nOcp-Apim-Subscription-Key: k\r\n\
            Forwarded: for=10.0.0.1\r\nX-Forwarded-For: 10.0.0.1\r\nX-FORWARDED-Port: 443\r\n\
            x-forwarded-prefix: /team-a\r\nX-Real-IP: 10.0.0.1\r\nX-Priority: low\r\n\
            OpenAI-Organization: org\r\nOpenAI-Project: p\r\nCookie: a=1\r\nExpect: 100-continue\r\n\
            Host: gw.example\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\
            Connection: keep-alive, X-Hop\r\nX-HOP: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n\
            Proxy-Authorization: Basic eA==\r\nX-Request-Id: client-1\r\n\
            User-Agent: OpenAI/Python\r\nx-forwarded: kept: not a forwarding header family\r\n\
            X-Stainless-Lang: python\r\nApi_Key: k\r\nX_Forwarded_For: 10.0.0.1\r\n\
            x_forwarded_port: 443\r\nX_Custom: kept\r\n\r\n";
        let sent = forwarded(lines);
        assert_eq!(
            sent,
            [
                ("user-agent", "OpenAI/Python"),
                ("x-forwarded", "kept: not a forwarding header family"),
                ("x-stainless-lang", "python"),
                ("x_custom", "kept"),
                ("x-request-id", "req-1"),
            ]
            .map(|(n, v)| (n.to_string(), v.to_string()))
        );
        assert_eq!(sent, forwarded_by_the_lists(lines));
    }

    proptest::proptest! {
        /// Whatever a client sends, in whatever case, what goes upstream is what the
        /// lists say: the masks and filters that decide it without the lists drop no
        /// more and no less (a header let through could leak a client's credential or
        /// network upstream).
        #[test]
        fn what_goes_upstream_is_what_the_lists_say(
            picks in proptest::collection::vec((0usize..1000, 0u32..u32::MAX, 0usize..4), 0..24),
        ) {
            let mut pool: Vec<String> = [
                &HOP_BY_HOP[..],
                NOT_FORWARDED.concat().as_slice(),
                &h1::COMMON_NAME_TEXTS,
                &[
                    "x-forwarded-port", "x-forwarded-", "x-forwarded", "x-custom", "x-hop", "a",
                    "ocp-apim-subscription-keys", "api_key", "x_forwarded_for", "x_forwarded_port",
                    "x-forwarded_prefix", "ocp_apim_subscription_key", "keep_alive", "x_custom",
                    "content_length", "openai_organization",
                ],
            ]
            .concat()
            .into_iter()
            .map(String::from)
            .collect();
            pool.sort();
            pool.dedup();
            let mut lines = Vec::new();
            for (pick, case, value) in picks {
                let name = &pool[pick % pool.len()];
                // Each letter upper-cased or not by a bit of `case`.
                let name: String = name
                    .chars()
                    .enumerate()
                    .map(|(i, c)| if case >> (i % 32) & 1 == 1 { c.to_ascii_uppercase() } else { c })
                    .collect();
                let value = if name.eq_ignore_ascii_case("connection") {
                    ["close", "X-Hop, keep-alive", " ,x-custom", "User-Agent"][value].to_string()
                } else {
                    format!("v{value}")
                };
                lines.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
            }
            lines.extend_from_slice(b"\r\n");
            let sent = forwarded(&lines);
            proptest::prop_assert_eq!(&sent, &forwarded_by_the_lists(&lines));
            // Over HTTP/2 the same headers, in a map.
            let mut in_map = forwarded_map(&lines);
            let mut sent = sent;
            in_map.sort();
            sent.sort();
            proptest::prop_assert_eq!(in_map, sent);
        }
    }
}
