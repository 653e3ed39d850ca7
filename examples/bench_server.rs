//! Run with: cargo run --release --example bench_server
//!
//! The server the HTTP load benchmark (`scripts/bench-http.sh`) measures: axum, `GET /hello`
//! answers `ok`, on `127.0.0.1:3000` (`PORT` picks another port). Then, e.g.
//! `curl -i -H 'x-key: alice' localhost:3000/hello` shows `ok` with `RateLimit` headers.
//!
//! Environment:
//! - `BACKEND=none|local|tower_governor|redis|redis_approx|postgres|mysql` (default `local`):
//!   - `none`: bare axum;
//!   - `local`: tollgate's `RateLimitLayer` on the in-process backend, default configuration
//!     (IETF `RateLimit`/`RateLimit-Policy` headers on every response);
//!   - `tower_governor`: tower_governor 0.8's `GovernorLayer`, same key, default configuration
//!     (no rate-limit headers on allowed responses: that is its default);
//!   - `tower_governor_headers`: the same with `.use_headers()`, which adds
//!     `x-ratelimit-limit` and `x-ratelimit-remaining` to allowed responses: the peer's
//!     configuration that, like tollgate's default, sends two rate-limit fields per response;
//!   - `redis`: tollgate on the Redis backend (`REDIS_URL`, default `redis://127.0.0.1:6379`;
//!     build with `--features redis`), fail-open (`ON_FAILURE`, below), deny cache on;
//!   - `redis_approx`: tollgate on the approximate Redis mode (`REDIS_URL` as for `redis`;
//!     `APPROX=async` (default) or `sync` picks the variant): decisions in process, counts
//!     kept in step with Redis. It counts windows only: without `QUOTA`, the never-reached
//!     limit is a sliding window of one second (`QUOTA="1000000000/s sliding"`, what the
//!     `local_sliding` mode of `scripts/bench-http.sh` runs on the local backend);
//!   - `postgres`, `mysql`: tollgate on the SQL backends (`DATABASE_URL`, default
//!     `postgres://postgres@127.0.0.1:5432/test` and `mysql://root@127.0.0.1:3306/test`; build
//!     with `--features postgres` or `--features mysql`), default configuration, migrated at
//!     start.
//! - The key is the `x-key` request header, falling back to the client IP.
//! - `HEADERS=ietf|legacy|both|none` (default `ietf`): tollgate's header style, to measure what
//!   the headers cost.
//! - The quota is so large (1 000 000 per second sustained, a burst of 3.6 billion) that nothing
//!   is ever denied, so every mode does the same work per request.
//! - `QUOTA=<quota>`: the server's quota instead, in the configuration syntax, e.g.
//!   `QUOTA="20/s sliding"`, `QUOTA="1000/min fixed"`, `QUOTA="5/s burst 10"`: with every
//!   backend (tower_governor has GCRA only: a window quota is refused for it).
//!   `QUOTA="1000000 concurrent"` measures the in-flight cap (a slot held and given back per
//!   request).
//! - `SETTLE=keep|refund` (tollgate modes): the policy settles after the response; `keep`
//!   charges every answer (`charge_when` matches it: nothing more is sent to the store),
//!   `refund` none (`charge_when` never matches: every request's unit is given back, one more
//!   store call per request, batched like decisions).
//! - `METRICS=1` (a build with `--features metrics`): install a Prometheus recorder, so that
//!   tollgate's metrics are recorded (to measure what they cost per request).
//! - `ON_FAILURE=open|closed|local` (Redis; default `open`): the failure policy.
//! - `STATS=1` (remote backends): print the backend's counters to stderr every
//!   second, e.g. to see how many decisions share a script call.
//! - `DENY_KEY=<value>`: that one key (an `x-key` value, or an IP address) gets one request per
//!   hour with a burst of 1, to measure a flood of denied requests (tollgate modes only).
//!
//! # How `DENY_KEY` works: one layer, a key-dependent cost
//!
//! Stacking a second layer for the denied key would make every request pay for two key
//! extractions and two decisions, and answer with two sets of headers. Instead the one policy
//! charges the deny key the whole bucket: the bucket holds `N` units and refills `N` per hour,
//! so a request costing `N` passes once, and the next one fits an hour later — exactly a
//! burst of 1 at 1 per hour, while every other key costs 1 unit and is never limited. The
//! cost function runs only when `DENY_KEY` is set.

use std::net::{IpAddr, SocketAddr};

use axum::Router;
use axum::routing::get;
use http::{HeaderValue, Request};
use tollgate::backend::{Backend, LocalBackend};
use tollgate::key::{ClientIp, Header, KeyExtractor, KeyExtractorExt, Or};
use tollgate::settle::ChargeWhen;
use tollgate::{
    ConfigError, HeaderStyle, Key, Policy, Quota, RateLimitLayer, RateLimitLayerBuilder,
    RequestInfo,
};
use tower_governor::GovernorError;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

/// Units per hour and bucket size: 1 per microsecond sustained.
const UNITS: u32 = 3_600_000_000;

type BenchKey = Or<Header, ClientIp>;

/// `x-key`, else the client IP (no trusted proxies: forwarding headers are ignored).
fn bench_key() -> BenchKey {
    Header::new("x-key").or(ClientIp::new())
}

/// The server's quota: `QUOTA`, or one so large that nothing is ever denied.
fn quota() -> Result<Quota, ConfigError> {
    match std::env::var("QUOTA") {
        Ok(q) => q.parse(),
        Err(_) if std::env::var("BACKEND").as_deref() == Ok("redis_approx") => {
            Ok(Quota::per_second(1_000_000_000).sliding_window())
        }
        Err(_) => Ok(Quota::per_hour(UNITS).burst(UNITS)),
    }
}

/// The policy: `quota` for every key; `deny_key` is charged the whole bucket (or window), so
/// that after its first request it is denied.
fn policy(quota: Quota, deny_key: Option<Key>) -> Policy {
    let policy = Policy::new("bench", quota);
    let policy = match std::env::var("SETTLE").as_deref() {
        Ok("keep") => policy.charge_when(ChargeWhen::not_server_error()),
        Ok("refund") => policy.charge_when(ChargeWhen::status([599])),
        _ => policy,
    };
    let Some(deny_key) = deny_key else {
        return policy;
    };
    let key = bench_key();
    let all = quota.burst_size();
    policy.cost_fn(move |req: &RequestInfo<'_>| match key.extract(req) {
        // By value: the IP of the fallback is in a key space of its own.
        Ok(k) if k.same_value(&deny_key) => all,
        _ => 1,
    })
}

/// The tollgate layer on any backend: the one place a Redis backend plugs in.
fn tollgate_layer<Bk: Backend>(
    backend: Bk,
    deny_key: Option<Key>,
) -> Result<RateLimitLayer<BenchKey, Bk>, ConfigError> {
    let headers = match std::env::var("HEADERS").as_deref() {
        Ok("none") => HeaderStyle::None,
        Ok("legacy") => HeaderStyle::Legacy,
        Ok("both") => HeaderStyle::Both,
        _ => HeaderStyle::Ietf,
    };
    RateLimitLayerBuilder::new()
        .backend(backend)
        .key(bench_key())
        .policy(policy(quota()?, deny_key))
        .headers(headers)
        .build()
}

/// tower_governor's key: the `x-key` header, else the peer IP (as `ConnectInfo`).
#[derive(Clone)]
struct XKeyOrIp;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum GovKey {
    Header(HeaderValue),
    Ip(IpAddr),
}

impl tower_governor::key_extractor::KeyExtractor for XKeyOrIp {
    type Key = GovKey;

    fn extract<T>(&self, req: &Request<T>) -> Result<GovKey, GovernorError> {
        if let Some(v) = req.headers().get("x-key") {
            return Ok(GovKey::Header(v.clone()));
        }
        req.extensions()
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
            .map(|ci| GovKey::Ip(ci.0.ip()))
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

/// Serves `app` on `listener`, recording the peer address (which both keys fall back to).
async fn serve<S>(listener: tokio::net::TcpListener, app: S) -> std::io::Result<()>
where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    axum::serve(
        listener,
        axum::ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<
            SocketAddr,
        >(app),
    )
    .await
}

/// Serves `app` with `layer` applied where `outer` says: around the whole router, or on its
/// routes (`Router::layer`, which boxes the layered service and its future per request).
macro_rules! serve_layered {
    ($listener:expr, $app:expr, $layer:expr, $outer:expr) => {{
        let layer = $layer;
        if $outer {
            // `with_state` turns the handlers into services once; a `Router` called as a plain
            // service without it converts them on every request.
            let svc = tower::Layer::layer(&layer, $app.with_state::<()>(()));
            serve($listener, svc).await
        } else {
            serve($listener, $app.layer(layer)).await
        }
    }};
}

/// An adaptive concurrency layer (the gradient) whose range keeps the benchmark's few
/// connections admitted.
fn adaptive_layer() -> Result<tollgate::adaptive::AdaptiveLayer, ConfigError> {
    let limit = tollgate::adaptive::AdaptiveLimit::builder()
        .initial(64)
        .range(64, 10_000)
        .build()?;
    Ok(tollgate::adaptive::AdaptiveLayer::new(limit))
}

/// The emission interval and burst tower_governor takes for a GCRA quota.
fn governor_quota(quota: Quota) -> Result<(u64, u32), Box<dyn std::error::Error>> {
    if quota.algorithm() != tollgate::quota::Algorithm::Gcra {
        return Err(format!("QUOTA={quota}: tower_governor has GCRA quotas only").into());
    }
    let params = Policy::new("bench", quota)
        .validate()?
        .first()
        .copied()
        .ok_or("no quota")?;
    Ok((params.emission_ns, params.burst.get()))
}

/// With `STATS=1`, prints `stats()` to stderr every second (how the backend's decisions went:
/// calls, batching, failures).
#[allow(dead_code)]
fn print_stats(stats: impl Fn() -> String + Send + 'static) {
    if std::env::var_os("STATS").is_some() {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                eprintln!("{}", stats());
            }
        });
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = match std::env::var("PORT") {
        Ok(p) => p.parse()?,
        Err(_) => 3000,
    };
    let backend = std::env::var("BACKEND").unwrap_or_else(|_| "local".to_owned());
    let outer = match std::env::var("LAYER").as_deref() {
        Ok("outer") => true,
        Ok("route") | Err(_) => false,
        Ok(other) => return Err(format!("unknown LAYER={other:?}: use route or outer").into()),
    };
    let deny_key = std::env::var("DENY_KEY")
        .ok()
        .map(|v| match v.parse::<IpAddr>() {
            Ok(ip) => Ok(Key::ip(ip)),
            Err(_) => Key::from_bytes(v),
        });
    let deny_key = deny_key.transpose()?;
    if deny_key.is_some()
        && matches!(
            backend.as_str(),
            "none" | "tower_governor" | "tower_governor_headers"
        )
    {
        return Err("DENY_KEY is only supported with the tollgate backends".into());
    }

    // Kept alive for the server's life: the recorder tollgate's metrics go to.
    #[cfg(feature = "metrics")]
    let _prometheus = match std::env::var("METRICS").as_deref() {
        Ok("1") => Some(metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?),
        _ => None,
    };
    let app = Router::new().route("/hello", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let placement = if outer { "outer" } else { "route" };
    println!(
        "bench_server ({backend}, layer {placement}) on http://{}/hello",
        listener.local_addr()?
    );
    match backend.as_str() {
        "none" => serve(listener, app).await?,
        "local" => serve_layered!(
            listener,
            app,
            tollgate_layer(LocalBackend::new(), deny_key)?,
            outer
        )?,
        // The adaptive concurrency layer alone, and inside the local rate limit: its cost per
        // request (a range wide enough that the benchmark's 8 connections are never refused).
        "adaptive" => serve_layered!(listener, app, adaptive_layer()?, outer)?,
        "local_adaptive" => serve_layered!(
            listener,
            app.layer(adaptive_layer()?),
            tollgate_layer(LocalBackend::new(), deny_key)?,
            outer
        )?,
        "tower_governor" => {
            let (emission_ns, burst) = governor_quota(quota()?)?;
            let config = GovernorConfigBuilder::default()
                .per_nanosecond(emission_ns)
                .burst_size(burst)
                .key_extractor(XKeyOrIp)
                .finish()
                .ok_or("invalid tower_governor configuration")?;
            serve_layered!(listener, app, GovernorLayer::new(config), outer)?
        }
        "tower_governor_headers" => {
            let (emission_ns, burst) = governor_quota(quota()?)?;
            let config = GovernorConfigBuilder::default()
                .per_nanosecond(emission_ns)
                .burst_size(burst)
                .key_extractor(XKeyOrIp)
                .use_headers()
                .finish()
                .ok_or("invalid tower_governor configuration")?;
            serve_layered!(listener, app, GovernorLayer::new(config), outer)?
        }
        #[cfg(feature = "redis")]
        "redis" => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            use tollgate::backend::redis::FailurePolicy;
            let on_failure = match std::env::var("ON_FAILURE").as_deref() {
                Ok("closed") => FailurePolicy::FailClosed,
                Ok("local") => FailurePolicy::FallbackLocal,
                Ok("open") | Err(_) => FailurePolicy::FailOpen,
                Ok(other) => {
                    return Err(
                        format!("unknown ON_FAILURE={other:?}: open, closed or local").into(),
                    );
                }
            };
            let backend = tollgate::backend::redis::RedisBackend::builder()
                .url(url)
                .on_failure(on_failure)
                .build()?;
            let stats = backend.clone();
            print_stats(move || format!("{:?}", stats.stats()));
            serve_layered!(listener, app, tollgate_layer(backend, deny_key)?, outer)?
        }
        #[cfg(feature = "redis")]
        "redis_approx" => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            use tollgate::backend::redis::Approximate;
            let mode = match std::env::var("APPROX").as_deref() {
                Ok("sync") => Approximate::synchronous(),
                Ok("async") | Err(_) => Approximate::asynchronous(),
                Ok(other) => {
                    return Err(format!("unknown APPROX={other:?}: async or sync").into());
                }
            };
            let backend = tollgate::backend::redis::RedisBackend::builder()
                .url(url)
                .build_approximate(mode)?;
            let stats = backend.clone();
            print_stats(move || format!("{:?}", stats.stats()));
            serve_layered!(listener, app, tollgate_layer(backend, deny_key)?, outer)?
        }
        #[cfg(feature = "postgres")]
        "postgres" => {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let backend = tollgate::backend::postgres::PostgresBackend::builder()
                .url(url)
                .build()?;
            backend.migrate().await?;
            let stats = backend.clone();
            print_stats(move || format!("{:?}", stats.stats()));
            serve_layered!(listener, app, tollgate_layer(backend, deny_key)?, outer)?
        }
        #[cfg(feature = "mysql")]
        "mysql" => {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
            let backend = tollgate::backend::mysql::MysqlBackend::builder()
                .url(url)
                .build()?;
            backend.migrate().await?;
            let stats = backend.clone();
            print_stats(move || format!("{:?}", stats.stats()));
            serve_layered!(listener, app, tollgate_layer(backend, deny_key)?, outer)?
        }
        #[allow(unreachable_patterns)] // every store compiled in
        "redis" | "redis_approx" | "postgres" | "mysql" => {
            let feature = backend.trim_end_matches("_approx");
            return Err(
                format!("BACKEND={backend} needs a build with `--features {feature}`").into(),
            );
        }
        other => {
            return Err(format!(
                "unknown BACKEND={other:?}: use none, local, tower_governor, \
                 tower_governor_headers, redis, redis_approx, postgres or mysql"
            )
            .into());
        }
    }
    Ok(())
}
