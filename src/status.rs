//! The decision in handlers: what the limit said of the request, for a response body or a log
//! line (GitHub's `X-RateLimit-*` bodies are the best-known shape).
//!
//! A layer built with
//! [`decision_in_extensions(true)`](crate::RateLimitLayerBuilder::decision_in_extensions) puts a
//! [`RateLimitStatus`] in the extensions of every request it lets through: the policy, and per
//! quota its name, limit, remaining units, time until more and unit. With the `axum` feature it
//! is an extractor (and `Option<RateLimitStatus>` one that never refuses). Off by default: the
//! status is built (and allocated) only for layers that ask for it.
//!
//! ```
//! use axum::{Json, Router, routing::get};
//! use tollgate::{Policy, Quota, RateLimitLayer, RateLimitStatus};
//!
//! async fn hello(status: RateLimitStatus) -> Json<serde_json::Value> {
//!     let quota = &status.quotas[0];
//!     tracing::info!(policy = %status.policy, remaining = quota.remaining, "hello");
//!     Json(serde_json::json!({
//!         "message": "hello",
//!         "rate": { "limit": quota.limit, "remaining": quota.remaining,
//!                   "reset": quota.reset.as_secs() },
//!     }))
//! }
//!
//! let limit = RateLimitLayer::builder()
//!     .policy(Policy::new("api", Quota::per_second(5).burst(10)))
//!     .decision_in_extensions(true)
//!     .build()
//!     .unwrap();
//! let app: Router = Router::new().route("/hello", get(hello)).route_layer(limit);
//! ```

pub use crate::report::{QuotaStatus, RateLimitStatus};

use crate::backend::Decision;

/// A quota status endpoint: answers, for the caller's key, the state of the layer's policy
/// (the one its rules pick for this request), without spending anything (a peek), as JSON in
/// GitHub's `GET /rate_limit` shape:
///
/// ```json
/// {"resources": {"api": {"limit": 10, "remaining": 7, "reset": 1764152400, "used": 3,
///                        "unit": "requests"}},
///  "rate": {"limit": 10, "remaining": 7, "reset": 1764152400, "used": 3, "unit": "requests"}}
/// ```
///
/// One resource per quota, by its name in the `RateLimit` field; `reset` is the Unix time
/// (seconds, rounded up) when more units come, `rate` the tightest quota. A calendar quota
/// ([`Quota::calendar`](crate::Quota::calendar)) also says when its window started and ends,
/// in its time zone, as RFC 9557 times: `"window_start": "2026-11-15T09:00:00+01:00[Europe/Berlin]",
/// "window_end": "2026-12-15T09:00:00+01:00[Europe/Berlin]"`. A request without a
/// key gets `400`, a store that fails `503`, each with a `message`. Serve it outside the limit
/// (asking is free): from [`RateLimitLayer::status_service`](crate::RateLimitLayer::status_service).
///
/// ```
/// use axum::{Router, routing::{get, get_service}};
/// use tollgate::{Policy, Quota, RateLimitLayer};
///
/// let limit = RateLimitLayer::builder()
///     .policy(Policy::new("api", Quota::per_second(5).burst(10)))
///     .build()
///     .unwrap();
/// let app: Router = Router::new()
///     .route("/api/hello", get(|| async { "hello" }))
///     .route_layer(limit.clone())
///     .route("/rate_limit", get_service(limit.status_service()));
/// ```
///
/// # Who may read a key's status
///
/// The endpoint answers for the key the layer's key extractor finds in the request, so it is
/// exactly as private as that key. A key the client cannot choose (the peer address, an
/// identity your authentication put in the request's extensions, read with
/// [`key::Extension`](crate::key::Extension), behind the same authentication) answers the
/// caller about itself only. A key taken from a header the client sets freely (a user or
/// merchant id, not a secret) lets anyone read anyone's usage: there, say who may read which
/// key with [`authorize`](Self::authorize), which answers `403` to the others.
///
/// ```
/// use axum::{Router, routing::get_service};
/// use tollgate::{Key, Policy, Quota, RateLimitLayer, RequestInfo, key::Header};
///
/// // Limited per merchant id (not a secret); each merchant authenticates with its token.
/// let limit = RateLimitLayer::builder()
///     .key(Header::new("x-merchant-id"))
///     .policy(Policy::new("api", Quota::per_minute(600)))
///     .build()
///     .unwrap();
/// // Your authentication: the merchant a bearer token belongs to.
/// fn merchant_of(token: &str) -> Option<&'static str> {
///     (token == "Bearer s3cr3t").then_some("merchant-9")
/// }
/// // Only a caller whose token is the merchant's may read its status.
/// fn owns(req: &RequestInfo<'_>, key: &Key) -> bool {
///     let token = req.headers().get("authorization").and_then(|v| v.to_str().ok());
///     let merchant = token.and_then(merchant_of).and_then(|m| Key::from_bytes(m).ok());
///     merchant.is_some_and(|m| m.same_value(key))
/// }
/// let status = limit.status_service().authorize(owns);
/// let app: Router = Router::new().route("/rate_limit", get_service(status));
/// ```
pub struct StatusService<K, Bk> {
    shared: crate::admit::Erased<K, Bk>,
    authorize: Option<Authorize>,
}

/// Whether the caller of a status request may read a key's status.
type Authorize = std::sync::Arc<dyn Fn(&crate::RequestInfo<'_>, &crate::Key) -> bool + Send + Sync>;

impl<K, Bk> StatusService<K, Bk> {
    pub(crate) fn new(shared: crate::admit::Erased<K, Bk>) -> Self {
        StatusService {
            shared,
            authorize: None,
        }
    }

    /// Answers only callers that `may_read` the status of the key their request names (given
    /// the request and the key the layer's extractor found in it), `403` with a `message` to
    /// the others, reading nothing. See [who may read a key's status](Self#who-may-read-a-keys-status).
    pub fn authorize<F>(mut self, may_read: F) -> Self
    where
        F: Fn(&crate::RequestInfo<'_>, &crate::Key) -> bool + Send + Sync + 'static,
    {
        self.authorize = Some(std::sync::Arc::new(may_read));
        self
    }
}

impl<K, Bk> Clone for StatusService<K, Bk> {
    fn clone(&self) -> Self {
        StatusService {
            shared: self.shared.clone(),
            authorize: self.authorize.clone(),
        }
    }
}

impl<K, Bk> std::fmt::Debug for StatusService<K, Bk> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatusService")
    }
}

type StatusFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<http::Response<String>, std::convert::Infallible>>
            + Send,
    >,
>;

impl<K, Bk, B> tower_service::Service<http::Request<B>> for StatusService<K, Bk>
where
    K: crate::KeyExtractor,
    Bk: crate::backend::Backend,
{
    type Response = http::Response<String>;
    type Error = std::convert::Infallible;
    type Future = StatusFuture;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        use crate::backend::Mode;
        let shared = self.shared.arc();
        let info = crate::RequestInfo::new(&req);
        let key = shared.key.extract(&info);
        let prepared = shared
            .policies
            .with(&info, key.as_ref().ok(), std::sync::Arc::clone);
        let key = match key {
            Ok(key) => key,
            Err(err) => {
                let message = format!("{{\"message\":{:?}}}", err.to_string());
                return Box::pin(std::future::ready(Ok(json(
                    http::StatusCode::BAD_REQUEST,
                    message,
                ))));
            }
        };
        if let Some(may_read) = &self.authorize
            && !may_read(&info, &key)
        {
            let message = "{\"message\":\"not allowed to read this key's rate limit\"}";
            return Box::pin(std::future::ready(Ok(json(
                http::StatusCode::FORBIDDEN,
                message.to_owned(),
            ))));
        }
        let peek = (shared.backend).decide_with(
            &prepared.backend,
            &key,
            std::num::NonZeroU32::MIN,
            Mode::Peek,
        );
        Box::pin(async move {
            let body = match peek.await {
                // The reset and the window on the backend's clock, read as it answered.
                Ok(decision) => resources(&prepared, &decision, shared.backend.unix_time()),
                Err(_) => {
                    let message = "{\"message\":\"the rate-limit store is unavailable\"}";
                    return Ok(json(
                        http::StatusCode::SERVICE_UNAVAILABLE,
                        message.to_owned(),
                    ));
                }
            };
            Ok(json(http::StatusCode::OK, body))
        })
    }
}

fn json(status: http::StatusCode, body: String) -> http::Response<String> {
    let mut res = http::Response::new(body);
    *res.status_mut() = status;
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    res.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    res
}

/// The JSON of a peek's `decision`: what the key has now, per quota. A peek reports what a
/// request of one unit would leave: one more is there now when it would pass (a concurrent
/// quota's peek reports its free slots as they are).
fn resources<P>(
    prepared: &crate::prepared::Prepared<P>,
    decision: &Decision,
    now: std::time::Duration,
) -> String {
    use std::fmt::Write;
    let status = RateLimitStatus::new(
        prepared.policy.name(),
        &prepared.headers.labels,
        &prepared.quota_units,
        decision,
    );
    let mut out = String::from("{\"resources\":{");
    let mut tightest: Option<String> = None;
    let mut least = u64::MAX;
    for (i, (q, state)) in status.quotas.iter().zip(decision.quotas()).enumerate() {
        let concurrent = q.unit == "concurrent-requests";
        let now_there = match state.outcome {
            crate::backend::Outcome::Allowed if !concurrent => (q.remaining + 1).min(q.limit),
            _ => q.remaining,
        };
        // A calendar window ends on a whole second: the instant the backend's clock computed,
        // not rounded up past it by the microseconds between its clock and this one.
        #[cfg(feature = "calendar")]
        let calendar = q.reset > std::time::Duration::ZERO
            && (prepared.policy.quotas().get(state.index))
                .is_some_and(|quota| quota.calendar_period().is_some());
        #[cfg(not(feature = "calendar"))]
        let calendar = false;
        let reset = if calendar {
            (now + q.reset + std::time::Duration::from_millis(500)).as_secs()
        } else {
            crate::response::ceil_secs(now + q.reset)
        };
        let mut one = format!(
            "{{\"limit\":{},\"remaining\":{now_there},\"reset\":{reset},\"used\":{},\"unit\":\"{}\"",
            q.limit,
            q.limit - now_there,
            q.unit
        );
        // A calendar quota's window, in its zone: when the plan's period started and ends.
        #[cfg(feature = "calendar")]
        if let Some((start, end)) = (prepared.policy.quotas().get(state.index))
            .and_then(|quota| quota.calendar_period())
            .and_then(|calendar| calendar.window_text(std::time::UNIX_EPOCH + now))
        {
            // RFC 9557 times: digits, `-`, `:`, `+`, `T`, `[`, `]` and a zone's name (letters,
            // `/`, `_`, `-`, `+`, digits): nothing to escape in JSON.
            let _ = write!(
                one,
                ",\"window_start\":\"{start}\",\"window_end\":\"{end}\""
            );
        }
        one.push('}');
        if i > 0 {
            out.push(',');
        }
        // Names are visible ASCII without quotes or backslashes (checked when built).
        let _ = write!(out, "\"{}\":{one}", q.name);
        let share = u64::from(now_there) * 1_000_000 / u64::from(q.limit.max(1));
        if share < least {
            least = share;
            tightest = Some(one);
        }
    }
    out.push('}');
    if let Some(rate) = tightest {
        let _ = write!(out, ",\"rate\":{rate}");
    }
    out.push('}');
    out
}
