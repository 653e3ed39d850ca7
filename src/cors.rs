//! Browsers: the rate-limit fields across origins, and `429`s a page can read.
//!
//! A single-page app calling its API on another origin reads a response only when the response
//! carries the CORS headers, and reads its fields only when they are exposed. Two things make a
//! `429` from tollgate readable there:
//!
//! 1. **Layer order: CORS outside, the limit inside.** The layer added last wraps the others
//!    (axum's `Router::layer`, tower's `ServiceBuilder` top to bottom is outside to inside).
//!    With tower-http's `CorsLayer` outside, every response of the rate limit, allowed or
//!    refused, passes through it and gets `Access-Control-Allow-Origin`; and a preflight
//!    `OPTIONS` is answered by the `CorsLayer` itself, never reaching the limit: it spends no
//!    quota. With the limit outside, a refusal never reaches the `CorsLayer`: the browser
//!    reports a network error and the page cannot say "try again in 8 s".
//! 2. **Expose the fields.** `RateLimit`, `RateLimit-Policy` and `Retry-After` are not
//!    readable from cross-origin JavaScript unless `Access-Control-Expose-Headers` names
//!    them: [`EXPOSE_HEADERS`] lists every field tollgate sends.
//!
//! ```
//! use axum::{Router, routing::get};
//! use http::HeaderValue;
//! use tollgate::{Policy, Quota, RateLimitLayer};
//! use tower_http::cors::CorsLayer;
//!
//! let limit = RateLimitLayer::builder()
//!     .policy(Policy::new("api", Quota::per_second(5).burst(10)))
//!     .build()
//!     .unwrap();
//! let cors = CorsLayer::new()
//!     .allow_origin(HeaderValue::from_static("https://app.example"))
//!     .expose_headers(tollgate::cors::EXPOSE_HEADERS);
//! let app: Router = Router::new()
//!     .route("/api/hello", get(|| async { "hello" }))
//!     .layer(limit) // inside: its 429s pass through the CORS layer
//!     .layer(cors); // outside: answers preflights, adds the CORS headers to every response
//! ```

use http::HeaderName;

/// Every response field tollgate may send, for `Access-Control-Expose-Headers` (tower-http's
/// `CorsLayer::expose_headers` takes it as it is): the IETF `RateLimit` and `RateLimit-Policy`,
/// `Retry-After`, and the legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset`.
/// (`Retry-After` is not a CORS-safelisted response header either.)
pub const EXPOSE_HEADERS: [HeaderName; 6] = [
    HeaderName::from_static("ratelimit"),
    HeaderName::from_static("ratelimit-policy"),
    http::header::RETRY_AFTER,
    HeaderName::from_static("x-ratelimit-limit"),
    HeaderName::from_static("x-ratelimit-remaining"),
    HeaderName::from_static("x-ratelimit-reset"),
];
