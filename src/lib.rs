//! Rate limiting for [tower] services: axum routers, tonic servers, anything that speaks
//! `http::Request`.
//!
//! A [`RateLimitLayer`] wraps a service. For every request it
//!
//! 1. extracts a **key** ([`key`]): the client IP behind trusted proxies, an API key header, a
//!    user id from an extension, a closure, or one global key;
//! 2. takes the **policy**: one or more [`Quota`]s that must all pass, and a cost — one
//!    [`Policy`] for the layer, or one picked per request by [`rules`] that can be replaced
//!    while serving;
//! 3. asks a **backend** ([`backend`]) for a decision: in process with [governor]'s GCRA
//!    ([`LocalBackend`](backend::LocalBackend), the default), or in Redis, PostgreSQL or MySQL
//!    for a limit shared by every replica (features `redis`, `postgres`, `mysql`);
//! 4. passes the request on, or answers `429 Too Many Requests` (gRPC: `RESOURCE_EXHAUSTED`)
//!    with `Retry-After`; both carry the IETF `RateLimit` and `RateLimit-Policy` headers
//!    ([`response`]).
//!
//! ```
//! use axum::{Router, routing::get};
//! use tollgate::{Policy, Quota, RateLimitLayer, key::ClientIp};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let limit = RateLimitLayer::builder()
//!     .policy(Policy::new("api", Quota::per_second(5).burst(10)))
//!     .key(ClientIp::new())
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/api/hello", get(|| async { "hello" }))
//!     .route_layer(limit)
//!     .route("/", get(|| async { "unlimited" }));
//! // axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>())
//! # Ok(()) }
//! ```
//!
//! Code that is not a request handler (a job, a loop calling a partner's API) uses the same
//! policies and backends through a [`Limiter`](limiter::Limiter): check, peek, reset, and
//! acquire, waiting its turn up to a maximum.
//!
//! Protection, beside limits: [`adaptive`] finds how much the service can take and refuses
//! the rest, fairly between tenants and by [`criticality`] (sheddable first, critical last,
//! the level passed on to the calls a request makes); [`client`] keeps its clients from
//! multiplying an overload (adaptive throttling, retry budgets); [`deadline`] drops work whose
//! caller has given up and passes the time left on.
//!
//! # Where to put the layer
//!
//! `Router::route_layer` limits only requests that match a route; `Router::layer` (or a layer
//! around the whole router) sees every request, so requests that end in `404` spend quota too.
//!
//! # Which layers share buckets
//!
//! A bucket belongs to a store, a policy name with its quotas, and a [`Key`]. Clones of a
//! layer share buckets; layers built separately share them when their backends are the same
//! store ([`Backend::store_id`](backend::Backend::store_id): one
//! [`LocalBackend`](backend::LocalBackend) and its clones, or one Redis server and key prefix,
//! from any process) and their policies have the same name and quotas. Each `build()` without
//! `.backend(...)` makes its own local backend, so separately built layers do not share
//! locally, but would on Redis: give policies that must stay apart different names. `build()`
//! warns when two layers built separately in one process share a policy's buckets.
//!
//! # Feature flags
//!
//! | feature | default | what |
//! |---|---|---|
//! | `local` | yes | [`LocalBackend`](backend::LocalBackend): in-process GCRA on governor |
//! | `axum` | yes | [`PeerIp`](key::PeerIp)/[`ClientIp`](key::ClientIp) read axum's `ConnectInfo<SocketAddr>`; rejections in axum's body type ([`body`]) |
//! | `tonic` | no | [`PeerIp`](key::PeerIp)/[`ClientIp`](key::ClientIp) read tonic's `TcpConnectInfo`; rejections in tonic's body type ([`body`]) |
//! | `serde` | no | [`RuleSet`](rules::RuleSet), [`Policy`] and [`Quota`] from TOML / YAML / JSON; the settings of the adaptive limit, the [client layers](client) and [deadlines](deadline) |
//! | `redis` | no | [`RedisBackend`](backend::redis::RedisBackend): one limit shared by every instance, on Redis or Redis Cluster (implies `local`) |
//! | `redis-tls` | no | `rediss://` URLs for the Redis backend, through rustls |
//! | `postgres` | no | [`PostgresBackend`](backend::postgres::PostgresBackend): one limit shared by every instance, in PostgreSQL or YugabyteDB (implies `local`) |
//! | `mysql` | no | [`MysqlBackend`](backend::mysql::MysqlBackend): one limit shared by every instance, in MySQL or MariaDB (implies `local`) |
//! | `reqwest` | no | [`RateLimitMiddleware`](middleware::RateLimitMiddleware): outbound reqwest calls through reqwest-middleware, waiting or failing fast; [`ThrottleMiddleware`](middleware::ThrottleMiddleware) and [`RetryMiddleware`](middleware::RetryMiddleware) |
//! | `metrics` | no | counters, gauges and histograms on the `metrics` facade, for any exporter ([`metrics`]) |
//! | `testing` | no | `tollgate::testing`: a manual clock for the local backend and the rate-limit fields of a response, for your own tests (implies `local`) |
//!
//! [tower]: https://docs.rs/tower
//! [governor]: https://docs.rs/governor
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod adaptive;
mod admit;
pub mod backend;
pub mod body;
mod call;
mod charge;
pub mod client;
pub mod cors;
pub mod criticality;
pub mod deadline;
mod error;
pub mod fields;
pub mod future;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;
pub mod key;
mod layer;
pub mod limiter;
pub mod metrics;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod middleware;
mod policy;
mod prepared;
pub mod quota;
mod report;
mod request;
pub mod response;
#[cfg(feature = "rls")]
pub mod rls;
pub mod rules;
mod service;
pub mod settle;
pub mod status;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod wait;

pub use body::ResponseBody;
pub use error::{BackendError, BackendErrorKind, ConfigError};
pub use key::{Key, KeyError, KeyExtractor, OnMissingKey};
pub use layer::{RateLimitLayer, RateLimitLayerBuilder, Unset};
pub use policy::Policy;
pub use quota::{OnChange, Quota, QuotaParams};
pub use request::RequestInfo;
pub use response::{HeaderStyle, Rejection, RejectionKind};
pub use service::RateLimit;
pub use settle::Charge;
pub use status::{QuotaStatus, RateLimitStatus};
