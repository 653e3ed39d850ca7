//! Responses: rate-limit headers on every response, and the rejection itself.
//!
//! Allowed and denied responses carry the fields of the IETF draft
//! [draft-ietf-httpapi-ratelimit-headers]: `RateLimit-Policy` (static per policy, built once)
//! and `RateLimit` (per response), one item per quota:
//!
//! ```text
//! RateLimit-Policy: "api";q=10;w=2
//! RateLimit: "api";r=7;t=1
//! ```
//!
//! - `q` is the bucket size (burst) and `w` the seconds an empty bucket takes to fill,
//!   rounded up to whole seconds (at least 1), as the draft allows no fractions. So `q / w` is
//!   the sustained rate when the bucket fills in whole seconds (`10/s burst 20`: `q=20;w=2`),
//!   and less than it otherwise (`5/s burst 1`: `q=1;w=1`): a client pacing itself by
//!   `q / w` is never denied, and `q` is never more than it may send at once.
//! - `r` is how many more cost-1 requests would pass right now.
//! - `t` is the draft's "time until additional quota is made available": the seconds, rounded
//!   up, until `r` grows by one (for GCRA, until the next unit is back in the bucket), on
//!   every response alike; `t=0` when the bucket is full (nothing more will come).
//!
//! Denied requests get `429 Too Many Requests` with `Retry-After` in whole seconds, rounded up
//! and never 0: when the request's whole cost fits again. Their `RateLimit` field lists only
//! the quotas that refused the request, so `Retry-After` is never earlier than any `t` it
//! comes with (a quota that allowed would otherwise show a `t` of its own, unrelated to the
//! wait). A request whose cost is larger than a quota's burst can never pass: it gets
//! `413 Content Too Large`, without `Retry-After`, with the quota's real state in `RateLimit`
//! (nothing was taken). gRPC requests (`content-type: application/grpc*`, including
//! `application/grpc-web*`) get a trailers-only response with `grpc-status: 8`
//! (`RESOURCE_EXHAUSTED`), which tonic clients see as `Status::resource_exhausted`, or `3`
//! (`INVALID_ARGUMENT`) for a request that can never pass; the response's `content-type` is
//! the request's gRPC flavour. gRPC rejections carry the wait in the forms gRPC clients read:
//! `grpc-retry-pushback-ms` (gRPC's retry design; `-1`, "do not retry", for a request that can
//! never pass) and a `google.rpc.RetryInfo` in `grpc-status-details-bin`, besides
//! `Retry-After`.
//!
//! Shadow policies send no rate-limit fields (their limits are not enforced), unless
//! [`Policy::shadow_headers`] asks for them.
//!
//! [draft-ietf-httpapi-ratelimit-headers]: https://datatracker.ietf.org/doc/draft-ietf-httpapi-ratelimit-headers/

mod cache;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};

use smallvec::SmallVec;

use crate::backend::{Decision, Outcome, QuotaState};
use crate::quota::QuotaParams;
use crate::{KeyError, Policy, Quota};

/// Which rate-limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit` (the IETF draft). The default.
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (seconds), for the
    /// quota with the fewest remaining units.
    Legacy,
    /// Both of the above.
    Both,
    /// No rate-limit headers (`Retry-After` is still sent on rejections).
    None,
}

impl HeaderStyle {
    fn ietf(self) -> bool {
        matches!(self, HeaderStyle::Ietf | HeaderStyle::Both)
    }
    fn legacy(self) -> bool {
        matches!(self, HeaderStyle::Legacy | HeaderStyle::Both)
    }
}

/// Why a request was rejected, given to a custom rejection response.
#[derive(Debug)]
#[non_exhaustive]
pub enum RejectionKind<'a> {
    /// A quota denied the request.
    RateLimited(&'a Decision),
    /// No key could be extracted and the layer is set to reject such requests.
    MissingKey(&'a KeyError),
    /// The backend failed and could not decide.
    BackendUnavailable,
}

/// A rejection, as seen by a custom response function.
#[derive(Debug)]
pub struct Rejection<'a> {
    /// Why.
    pub kind: RejectionKind<'a>,
    /// The policy's name.
    pub policy: &'a str,
    /// The status tollgate would answer with: 429, 413 for a request that can never pass (its
    /// cost is larger than a quota's burst), 503 when the backend failed, 500 when the server
    /// records no peer address, or the missing-key status.
    pub status: StatusCode,
    /// When the client may retry, if known.
    pub retry_after: Option<Duration>,
    /// The names of the policy's quotas as the headers show them, by quota index (empty when
    /// no decision was made).
    pub quota_names: &'a [Box<str>],
}

impl Rejection<'_> {
    /// The names of the quotas that denied the request (the draft's `violated-policies`).
    pub fn violated(&self) -> impl Iterator<Item = &str> {
        let quotas = match self.kind {
            RejectionKind::RateLimited(d) => d.quotas(),
            _ => &[],
        };
        quotas
            .iter()
            .filter(|q| q.outcome != Outcome::Allowed)
            .filter_map(|q| self.quota_names.get(q.index).map(|n| &**n))
    }
}

/// A function building the response for a rejection.
pub type RejectFn = Arc<dyn Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync>;

/// The body of rejections.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum RejectionBody {
    /// A short `text/plain` message. The default.
    #[default]
    Text,
    /// An RFC 9457 `application/problem+json` document with the draft's `quota-exceeded`
    /// problem type and `violated-policies`.
    ProblemJson,
    /// A response of your own; tollgate still adds `Retry-After` (unless set) and its
    /// rate-limit headers.
    Custom(RejectFn),
}

impl fmt::Debug for RejectionBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectionBody::Text => f.write_str("Text"),
            RejectionBody::ProblemJson => f.write_str("ProblemJson"),
            RejectionBody::Custom(_) => f.write_str("Custom(<fn>)"),
        }
    }
}

/// A policy's header material, built once.
#[derive(Debug, Clone)]
pub(crate) struct PolicyHeaders {
    /// Unique per policy built (clones share it): the header cache's key.
    id: u64,
    /// `"name";q=..;w=..` items, comma-separated.
    policy: HeaderValue,
    /// The same, as text (the rate limit service writes it into a string).
    #[cfg(feature = "rls")]
    policy_text: Box<str>,
    /// `"label";r=` per quota.
    prefixes: Vec<Box<str>>,
    /// The quota labels.
    pub(crate) labels: Vec<Box<str>>,
}

impl PolicyHeaders {
    pub(crate) fn new(policy: &Policy, params: &[QuotaParams]) -> Self {
        let mut value = String::new();
        let mut prefixes = Vec::with_capacity(params.len());
        let mut labels = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let label = policy.quota_label(i);
            if i > 0 {
                value.push_str(", ");
            }
            if p.is_concurrent() {
                // Requests in flight: no window (a lease is not one the client can pace by).
                value.push_str(&format!(
                    "\"{label}\";q={};qu=\"concurrent-requests\"",
                    p.burst
                ));
            } else {
                let w = ceil_secs(p.window()).max(1);
                let bytes = policy.quotas().get(i).is_some_and(Quota::counts_bytes);
                let unit = if bytes { ";qu=\"content-bytes\"" } else { "" };
                value.push_str(&format!("\"{label}\";q={}{unit};w={w}", p.burst));
            }
            prefixes.push(format!("\"{label}\";r=").into_boxed_str());
            labels.push(label.into_boxed_str());
        }
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        PolicyHeaders {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            // Labels are visible ASCII without quotes or backslashes (checked by
            // `Policy::validate`), so the value is always valid.
            policy: HeaderValue::from_str(&value).unwrap_or(HeaderValue::from_static("")),
            #[cfg(feature = "rls")]
            policy_text: value.into_boxed_str(),
            prefixes,
            labels,
        }
    }
}

/// Headers to add to a response, computed from a decision. Kept small: it travels in the
/// response future.
#[derive(Debug, Default)]
pub(crate) struct HeaderAdds {
    /// `RateLimit-Policy` and `RateLimit`.
    ietf: Option<(HeaderValue, HeaderValue)>,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    legacy: Option<Box<[HeaderValue; 3]>>,
    /// The backend's headers for the response ([`Decision::response_headers`]).
    passed: Option<crate::backend::ResponseHeaders>,
}

impl HeaderAdds {
    pub(crate) fn new() -> Self {
        Self::default()
    }
}

const X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn int_value(n: u64) -> HeaderValue {
    HeaderValue::from(n)
}

#[inline]
pub(crate) fn rate_limit_headers(
    style: HeaderStyle,
    headers: &PolicyHeaders,
    decision: &Decision,
) -> HeaderAdds {
    let mut adds = if style == HeaderStyle::None {
        HeaderAdds::new()
    } else {
        fields(style, headers, decision)
    };
    // Whatever the style: the backend was asked to pass them.
    adds.passed = decision.shared_response_headers().cloned();
    adds
}

/// The fields of [`rate_limit_headers`], for a style that sends some.
fn fields(style: HeaderStyle, headers: &PolicyHeaders, decision: &Decision) -> HeaderAdds {
    let mut out = HeaderAdds::new();
    // A decision without quota states (a backend failing open) has nothing to report.
    if decision.quotas().is_empty() {
        return out;
    }
    if style.ietf() {
        let value = reported(decision, |quotas| {
            let items = quotas
                .iter()
                .map(|q| (q.index, q.remaining, ceil_secs(q.reset_after)));
            match cache::ValueKey::new(headers.id, items) {
                Some(key) => cache::value(key, || ietf_value(headers, quotas)),
                None => ietf_value(headers, quotas),
            }
        });
        if let Some(value) = value {
            out.ietf = Some((cache::policy(headers.id, &headers.policy), value));
        }
    }
    if style.legacy()
        && let Some(q) = decision.tightest()
    {
        out.legacy = Some(Box::new([
            int_value(u64::from(q.limit)),
            int_value(u64::from(q.remaining)),
            int_value(ceil_secs(q.reset_after)),
        ]));
    }
    out
}

/// Calls `f` with the quotas a decision's `RateLimit` field reports: every quota of an allowed
/// decision; the quotas that refused of a denial (their `t` is never later than the request's
/// `Retry-After`, which an allowing quota's `t` could be).
fn reported<R>(decision: &Decision, f: impl FnOnce(&[QuotaState]) -> R) -> R {
    if decision.is_allowed() {
        f(decision.quotas())
    } else {
        let refusing: SmallVec<[QuotaState; 2]> = (decision.quotas().iter())
            .filter(|q| q.outcome != Outcome::Allowed)
            .copied()
            .collect();
        f(&refusing)
    }
}

/// Appends a decision's `RateLimit-Policy` and `RateLimit` items to `policy` and `limit`
/// (comma-separated after what they hold), as [`rate_limit_headers`] makes them for
/// [`HeaderStyle::Ietf`], without header values in between: what the rate limit service
/// sends as text. `back` units are added to each quota's remaining units, up to its limit
/// (a check's unit, or units given back after the decision). Nothing for a decision without
/// quota states.
#[cfg(feature = "rls")]
pub(crate) fn write_ietf(
    headers: &PolicyHeaders,
    decision: &Decision,
    back: u32,
    policy: &mut String,
    limit: &mut String,
) {
    if decision.quotas().is_empty() {
        return;
    }
    let sep = |s: &mut String| {
        if !s.is_empty() {
            s.push_str(", ");
        }
    };
    sep(policy);
    policy.push_str(&headers.policy_text);
    reported(decision, |quotas| {
        // Per item at most: ", " + prefix + u32 digits (10) + ";t=" + u64 digits (20).
        let bound: usize = (quotas.iter())
            .map(|q| headers.prefixes.get(q.index).map_or(0, |p| p.len() + 35))
            .sum();
        limit.reserve(bound + 2);
        sep(limit);
        let mut num = itoa::Buffer::new();
        let mut first = true;
        for q in quotas {
            let Some(prefix) = headers.prefixes.get(q.index) else {
                continue;
            };
            if !first {
                limit.push_str(", ");
            }
            first = false;
            limit.push_str(prefix);
            limit.push_str(num.format(q.remaining.saturating_add(back).min(q.limit)));
            limit.push_str(";t=");
            limit.push_str(num.format(ceil_secs(q.reset_after)));
        }
    });
}

/// The `RateLimit` value, `"label";r=<remaining>;t=<seconds>` per quota, formatted on the
/// stack when it fits (it does for one or two quotas with short labels).
fn ietf_value(headers: &PolicyHeaders, quotas: &[QuotaState]) -> Option<HeaderValue> {
    const STACK: usize = 128;
    // Per item at most: ", " + prefix + u32 digits (10) + ";t=" + u64 digits (20).
    let bound: usize = quotas
        .iter()
        .map(|q| headers.prefixes.get(q.index).map_or(0, |p| p.len() + 35))
        .sum();
    if bound <= STACK {
        let mut buf = [0u8; STACK];
        let len = write_items(&mut buf, headers, quotas);
        HeaderValue::from_bytes(buf.get(..len)?).ok()
    } else {
        let mut buf = vec![0u8; bound];
        let len = write_items(&mut buf, headers, quotas);
        buf.truncate(len);
        HeaderValue::from_maybe_shared(Bytes::from(buf)).ok()
    }
}

/// Writes the `RateLimit` items into `buf`, which holds at least 35 bytes plus the prefix per
/// item; returns the length written (short, never a panic, if `buf` were too small).
fn write_items(buf: &mut [u8], headers: &PolicyHeaders, quotas: &[QuotaState]) -> usize {
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        if let Some(dst) = buf.get_mut(at..at + bytes.len()) {
            dst.copy_from_slice(bytes);
            at += bytes.len();
        }
    };
    let mut num = itoa::Buffer::new();
    for (i, q) in quotas.iter().enumerate() {
        let Some(prefix) = headers.prefixes.get(q.index) else {
            continue;
        };
        if i > 0 {
            put(b", ");
        }
        put(prefix.as_bytes());
        put(num.format(q.remaining).as_bytes());
        put(b";t=");
        put(num.format(ceil_secs(q.reset_after)).as_bytes());
    }
    at
}

#[inline]
pub(crate) fn add_headers(map: &mut http::HeaderMap, adds: HeaderAdds) {
    if let Some((policy, limit)) = adds.ietf {
        // Appended, not replaced: with nested layers (a global limit and a route limit) each
        // adds its items, and the draft lets a list span several fields.
        map.append(RATELIMIT_POLICY, policy);
        map.append(RATELIMIT, limit);
    }
    if let Some(legacy) = adds.legacy {
        let [limit, remaining, reset] = *legacy;
        map.entry(X_LIMIT).or_insert(limit);
        map.entry(X_REMAINING).or_insert(remaining);
        map.entry(X_RESET).or_insert(reset);
    }
    if let Some(passed) = adds.passed {
        add_passed(map, &passed);
    }
}

/// The backend's headers, each unless the response already has its name: tollgate's fields
/// and `Retry-After` (or the service's own header) win over a server's, and several values of
/// one name from the server are all added.
#[inline(never)]
fn add_passed(map: &mut http::HeaderMap, passed: &[(HeaderName, HeaderValue)]) {
    let mut added: SmallVec<[&HeaderName; 4]> = SmallVec::new();
    for (name, value) in passed {
        if added.contains(&name) || !map.contains_key(name) {
            map.append(name.clone(), value.clone());
            added.push(name);
        }
    }
}

/// An answer a layer writes itself rather than the service (a request over the adaptive
/// limit, one past its deadline): for a gRPC request (`grpc`, its content type) a
/// trailers-only answer with `grpc_status` and `message`, else `status` with `text`.
pub(crate) fn local_answer<B: crate::body::RateLimitBody>(
    grpc: Option<HeaderValue>,
    grpc_status: &'static str,
    message: &'static str,
    status: StatusCode,
    text: &'static str,
) -> Response<B> {
    match grpc {
        Some(content_type) => {
            let mut res = Response::new(B::rejection(Bytes::new()));
            let h = res.headers_mut();
            h.insert(header::CONTENT_TYPE, content_type);
            h.insert("grpc-status", HeaderValue::from_static(grpc_status));
            h.insert("grpc-message", HeaderValue::from_static(message));
            res
        }
        None => {
            let mut res = Response::new(B::rejection(Bytes::from_static(text.as_bytes())));
            *res.status_mut() = status;
            res.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            res
        }
    }
}

/// How the service answers a rejection.
#[derive(Clone, Debug)]
pub(crate) struct Responder {
    pub(crate) style: HeaderStyle,
    pub(crate) body: RejectionBody,
}

impl Responder {
    /// The response for `rejection`; `grpc` is the request's gRPC content type, if any.
    pub(crate) fn reject(
        &self,
        rejection: &Rejection<'_>,
        grpc: Option<&HeaderValue>,
        adds: HeaderAdds,
    ) -> Response<Bytes> {
        let retry = rejection.retry_after.map(|d| ceil_secs(d).max(1));
        let mut res = if let Some(content_type) = grpc {
            grpc_response(rejection, content_type)
        } else {
            match &self.body {
                RejectionBody::Text => text_response(rejection, retry),
                RejectionBody::ProblemJson => problem_response(rejection, retry),
                RejectionBody::Custom(f) => f(rejection),
            }
        };
        if let Some(secs) = retry {
            res.headers_mut()
                .entry(header::RETRY_AFTER)
                .or_insert(int_value(secs));
        }
        add_headers(res.headers_mut(), adds);
        res
    }
}

fn text_response(rejection: &Rejection<'_>, retry: Option<u64>) -> Response<Bytes> {
    let text = match (&rejection.kind, retry) {
        (RejectionKind::RateLimited(d), _) if d.never_fits() => {
            "Too Many Requests: this request costs more than the rate limit ever allows\n"
                .to_owned()
        }
        (RejectionKind::RateLimited(_), Some(s)) => {
            format!("Too Many Requests: retry in {s} s\n")
        }
        (RejectionKind::RateLimited(_), None) => "Too Many Requests\n".to_owned(),
        (RejectionKind::MissingKey(KeyError::NoPeerAddr), _) => {
            "Internal Server Error\n".to_owned()
        }
        (RejectionKind::MissingKey(e), _) => format!("{e}\n"),
        (RejectionKind::BackendUnavailable, _) => "Rate limiter unavailable\n".to_owned(),
    };
    let mut res = Response::new(Bytes::from(text));
    *res.status_mut() = rejection.status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

fn problem_response(rejection: &Rejection<'_>, retry: Option<u64>) -> Response<Bytes> {
    // Quota names cannot contain `"` or `\` (see `Policy::validate`), and the details below
    // are fixed texts or key errors without quotes, so everything embeds safely. RFC 9457: the
    // title of `about:blank` is the status phrase; the explanation goes in `detail`.
    let phrase = rejection.status.canonical_reason().unwrap_or("Error");
    let (ty, title, detail): (&str, &str, String) = match rejection.kind {
        RejectionKind::RateLimited(d) if d.never_fits() => (
            "about:blank",
            phrase,
            "this request costs more than the rate limit ever allows: it can never pass".into(),
        ),
        RejectionKind::RateLimited(_) => (
            "https://iana.org/assignments/http-problem-types#quota-exceeded",
            "Request cannot be satisfied as assigned quota has been exceeded",
            String::new(),
        ),
        RejectionKind::MissingKey(KeyError::NoPeerAddr) => ("about:blank", phrase, String::new()),
        RejectionKind::MissingKey(e) => ("about:blank", phrase, escape_json(&e.to_string())),
        RejectionKind::BackendUnavailable => (
            "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity",
            "Rate limiter unavailable",
            String::new(),
        ),
    };
    let mut json = format!(
        r#"{{"type":"{ty}","title":"{title}","status":{}"#,
        rejection.status.as_u16(),
    );
    if !detail.is_empty() {
        json.push_str(&format!(r#","detail":"{detail}""#));
    }
    if let RejectionKind::RateLimited(_) = rejection.kind {
        json.push_str(r#","violated-policies":["#);
        for (i, name) in rejection.violated().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push('"');
            json.push_str(name);
            json.push('"');
        }
        json.push(']');
    }
    if let Some(s) = retry {
        json.push_str(&format!(r#","retry-after":{s}"#));
    }
    json.push('}');
    let mut res = Response::new(Bytes::from(json));
    *res.status_mut() = rejection.status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    res
}

/// A trailers-only gRPC response: HTTP 200 with the status in the headers and no body, in the
/// request's gRPC flavour (`content_type`: gRPC-web clients read it the same way).
fn grpc_response(rejection: &Rejection<'_>, content_type: &HeaderValue) -> Response<Bytes> {
    let (code, message) = match rejection.kind {
        RejectionKind::RateLimited(d) if d.never_fits() => {
            (3u8, "request costs more than the rate limit ever allows")
        }
        RejectionKind::RateLimited(_) => (8, "rate limit exceeded"),
        RejectionKind::MissingKey(KeyError::NoPeerAddr) => (13, "internal error"),
        RejectionKind::MissingKey(_) => (grpc_code(rejection.status), "no rate-limit key"),
        RejectionKind::BackendUnavailable => (14, "rate limiter unavailable"),
    };
    let mut res = Response::new(Bytes::new());
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, content_type.clone());
    h.insert("grpc-status", HeaderValue::from(u16::from(code)));
    h.insert("grpc-message", HeaderValue::from_static(message));
    // Retry hints in the forms gRPC clients read: the pushback of gRPC's retry design (a
    // negative value tells a client not to retry at all: the request can never pass), and
    // `google.rpc.RetryInfo` in the rich status details.
    let never = matches!(rejection.kind, RejectionKind::RateLimited(d) if d.never_fits());
    if never {
        h.insert(GRPC_PUSHBACK, HeaderValue::from_static("-1"));
    } else if let Some(wait) = rejection.retry_after {
        let ms = u64::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(u64::MAX);
        h.insert(GRPC_PUSHBACK, HeaderValue::from(ms));
        if let Ok(details) = HeaderValue::from_str(&status_details(code, message, wait)) {
            h.insert(GRPC_DETAILS, details);
        }
    }
    res
}

const GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
const GRPC_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");

/// A `google.rpc.Status` with one detail, a `google.rpc.RetryInfo` holding `wait`, protobuf
/// encoded and base64'd (unpadded, as gRPC's binary metadata is): what
/// `grpc-status-details-bin` carries, and what `tonic-types`' `StatusExt::get_details_retry_info`
/// and the other languages' rich-error helpers decode.
fn status_details(code: u8, message: &str, wait: Duration) -> String {
    use base64::Engine as _;
    // protobuf: a field's key is (number << 3) | wire type (0: varint, 2: length-delimited).
    fn varint(out: &mut Vec<u8>, mut n: u64) {
        while n >= 0x80 {
            out.push((n as u8) | 0x80);
            n >>= 7;
        }
        out.push(n as u8);
    }
    fn bytes_field(out: &mut Vec<u8>, number: u8, bytes: &[u8]) {
        out.push(number << 3 | 2);
        varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }
    // google.protobuf.Duration { seconds = 1; nanos = 2 }
    let mut duration = Vec::new();
    if wait.as_secs() > 0 {
        duration.push(1 << 3);
        varint(&mut duration, wait.as_secs());
    }
    if wait.subsec_nanos() > 0 {
        duration.push(2 << 3);
        varint(&mut duration, u64::from(wait.subsec_nanos()));
    }
    // google.rpc.RetryInfo { retry_delay = 1 }
    let mut retry_info = Vec::new();
    bytes_field(&mut retry_info, 1, &duration);
    // google.protobuf.Any { type_url = 1; value = 2 }
    let mut any = Vec::new();
    bytes_field(&mut any, 1, b"type.googleapis.com/google.rpc.RetryInfo");
    bytes_field(&mut any, 2, &retry_info);
    // google.rpc.Status { code = 1; message = 2; details = 3 }
    let mut status = vec![1 << 3];
    varint(&mut status, u64::from(code));
    bytes_field(&mut status, 2, message.as_bytes());
    bytes_field(&mut status, 3, &any);
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(status)
}

/// `s` with the characters JSON strings cannot hold as they are escaped.
fn escape_json(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// The gRPC code closest to an HTTP status, for missing-key rejections.
fn grpc_code(status: StatusCode) -> u8 {
    match status.as_u16() {
        400 => 3,
        401 => 16,
        403 => 7,
        429 => 8,
        503 => 14,
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;
    use crate::backend::{Outcome, QuotaState};

    #[test]
    fn ceil_secs_rounds_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_nanos(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
    }

    #[test]
    fn ietf_syntax() {
        let policy = Policy::new("api", Quota::per_second(5).burst(10)).and(Quota::per_hour(1000));
        let params = policy.validate().unwrap();
        let h = PolicyHeaders::new(&policy, &params);
        assert_eq!(
            h.policy.to_str().unwrap(),
            r#""api-0";q=10;w=2, "api-1";q=1000;w=3600"#
        );
        let d = Decision::new([
            QuotaState {
                index: 0,
                outcome: Outcome::Allowed,
                limit: 10,
                remaining: 9,
                reset_after: Duration::from_millis(200),
            },
            QuotaState {
                index: 1,
                outcome: Outcome::Allowed,
                limit: 1000,
                remaining: 999,
                reset_after: Duration::from_millis(3600),
            },
        ]);
        let mut map = http::HeaderMap::new();
        add_headers(&mut map, rate_limit_headers(HeaderStyle::Both, &h, &d));
        let get = |n: &str| map.get(n).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(
            get("ratelimit").unwrap(),
            r#""api-0";r=9;t=1, "api-1";r=999;t=4"#
        );
        assert_eq!(get("x-ratelimit-remaining").unwrap(), "9");
        assert_eq!(get("x-ratelimit-limit").unwrap(), "10");
        let none = rate_limit_headers(HeaderStyle::None, &h, &d);
        assert!(none.ietf.is_none() && none.legacy.is_none());
    }

    fn allowed(index: usize, remaining: u32, reset_ms: u64) -> QuotaState {
        QuotaState {
            index,
            outcome: Outcome::Allowed,
            limit: 1000,
            remaining,
            reset_after: Duration::from_millis(reset_ms),
        }
    }

    fn ratelimit(h: &PolicyHeaders, d: &Decision) -> String {
        let adds = rate_limit_headers(HeaderStyle::Ietf, h, d);
        let (policy, value) = adds.ietf.unwrap();
        assert_eq!(policy, h.policy);
        value.to_str().unwrap().to_owned()
    }

    #[test]
    fn cached_values_are_what_formatting_gives() {
        // Two policies whose numbers collide: each must get its own labels back.
        let a = Policy::new("a", Quota::per_second(5).burst(10)).and(Quota::per_hour(1000));
        let b = Policy::new("b", Quota::per_second(5).burst(10));
        let ha = PolicyHeaders::new(&a, &a.validate().unwrap());
        let hb = PolicyHeaders::new(&b, &b.validate().unwrap());
        // Repeats (hits), changes (misses) and slot collisions, in a mixed order.
        let mut seed = 7u64;
        for _ in 0..5000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (seed >> 33) as u32 % 12;
            let t = (seed >> 50) % 4000;
            let two = Decision::new([allowed(0, r, t), allowed(1, 999 - r, t * 3)]);
            let one = Decision::new([allowed(0, r, t)]);
            assert_eq!(
                ratelimit(&ha, &two),
                ietf_value(&ha, two.quotas()).unwrap().to_str().unwrap()
            );
            assert_eq!(
                ratelimit(&hb, &one),
                format!(r#""b";r={r};t={}"#, t.div_ceil(1000))
            );
            // The same numbers under policy `a`, denied after its first quota.
            assert_eq!(
                ratelimit(&ha, &one),
                format!(r#""a-0";r={r};t={}"#, t.div_ceil(1000))
            );
        }
    }

    #[test]
    fn values_of_many_quotas_are_formatted_uncached() {
        let mut policy = Policy::new("m", Quota::per_second(1));
        for _ in 0..3 {
            policy = policy.and(Quota::per_minute(100));
        }
        let h = PolicyHeaders::new(&policy, &policy.validate().unwrap());
        let d = Decision::new((0..4).map(|i| allowed(i, 7, 1500)));
        assert_eq!(
            ratelimit(&h, &d),
            r#""m-0";r=7;t=2, "m-1";r=7;t=2, "m-2";r=7;t=2, "m-3";r=7;t=2"#
        );
    }
}
