//! Run with: `cargo run --example distributed --features redis` (or `--features postgres`,
//! `--features mysql`). `BACKEND=redis|postgres|mysql` picks the shared store (default
//! `redis`); `PORT` the port (default 3000).
//!
//! - `redis`: `REDIS_URL` (default `redis://127.0.0.1:6379`; `rediss://` for TLS, built with
//!   `--features redis-tls`); `REDIS_CLUSTER_NODES`, comma-separated `redis://host:port` URLs,
//!   selects Redis Cluster instead; `REDIS_CA_CERT`, a PEM file, names a CA to trust besides
//!   the system's.
//! - `postgres`: `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! - `mysql`: `DATABASE_URL` (default `mysql://root@127.0.0.1:3306/test`).
//!
//! The SQL stores run their migration at start (idempotent: a table and a function or
//! procedure, created if missing).
//!
//! `ON_FAILURE=open|closed|fallback` (default `open`) is what requests get while the store
//! cannot decide: let through unlimited, refused with `503`, or limited by each instance
//! alone at its share of the limit. With `fallback` the instances announce themselves in the
//! store (every second) and know how many they are, so that two instances admit about one
//! limit together while the store is down, not two.
//!
//! What to expect: the same routes and policy as `quickstart`, but the buckets live in the
//! shared store, so every instance started against the same store shares one limit:
//!
//! ```text
//! $ PORT=3000 cargo run --example distributed --features redis &
//! $ PORT=3001 cargo run --example distributed --features redis &
//! $ for i in $(seq 6); do
//! >   curl -s -o /dev/null -w '%{http_code} ' localhost:3000/api/hello
//! >   curl -s -o /dev/null -w '%{http_code} ' localhost:3001/api/hello
//! > done
//! 200 200 200 200 200 200 200 200 200 200 429 429
//! $ curl -i localhost:3000/             # unlimited
//! ```
//!
//! `/api/hello` is limited per client IP to 5 requests per second with bursts of 10; no proxy
//! is trusted. The app starts even when the store is down, and then gets the failure policy
//! (by default it fails open: requests pass unlimited) until it answers; limits apply again
//! within about a second of the store coming back. The log (INFO and above, on stdout) has one warning naming the cause when the store
//! fails (`connection refused`, `authentication failed`) and one line when it answers again,
//! not a line per request. URLs are printed with their password masked or left out.

use std::net::SocketAddr;

use axum::{Router, routing::get};
use tollgate::backend::Backend;
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
use tollgate::backend::remote::FailurePolicy;
use tollgate::key::ClientIp;
use tollgate::{Policy, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
    let backend = std::env::var("BACKEND").unwrap_or_else(|_| "redis".into());
    #[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
    let on_failure = failure_policy(std::env::var("ON_FAILURE").ok().as_deref())?;
    match backend.as_str() {
        #[cfg(feature = "redis")]
        "redis" => serve(redis(on_failure)?).await,
        #[cfg(feature = "postgres")]
        "postgres" => serve(postgres(on_failure).await?).await,
        #[cfg(feature = "mysql")]
        "mysql" => serve(mysql(on_failure).await?).await,
        #[allow(unreachable_patterns)] // every store compiled in
        "redis" | "postgres" | "mysql" => {
            Err(format!("BACKEND={backend} needs a build with `--features {backend}`").into())
        }
        other => Err(format!("unknown BACKEND={other:?}: use redis, postgres or mysql").into()),
    }
}

/// `ON_FAILURE`: `open` (the default), `closed` or `fallback`.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
pub(crate) fn failure_policy(value: Option<&str>) -> Result<FailurePolicy, String> {
    match value.map(str::trim) {
        None | Some("open") => Ok(FailurePolicy::FailOpen),
        Some("closed") => Ok(FailurePolicy::FailClosed),
        Some("fallback") => Ok(FailurePolicy::FallbackLocal),
        Some(other) => Err(format!(
            "unknown ON_FAILURE={other:?}: use open, closed or fallback"
        )),
    }
}

#[cfg(feature = "redis")]
fn redis(
    on_failure: FailurePolicy,
) -> Result<tollgate::backend::redis::RedisBackend, tollgate::ConfigError> {
    use tollgate::backend::redis::RedisBackend;
    let backend = match std::env::var("REDIS_CLUSTER_NODES") {
        Ok(nodes) if !nodes.trim().is_empty() => {
            let nodes: Vec<String> = nodes
                .split(',')
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect();
            RedisBackend::builder().cluster_nodes(nodes)
        }
        _ => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            RedisBackend::builder().url(url)
        }
    }
    .on_failure(on_failure);
    let backend = match std::env::var_os("REDIS_CA_CERT") {
        Some(path) => {
            let pem = std::fs::read(&path).map_err(|e| tollgate::ConfigError::Invalid {
                option: "REDIS_CA_CERT",
                reason: format!("{}: {e}", std::path::Path::new(&path).display()),
            })?;
            backend.tls_ca_pem(pem)
        }
        None => backend,
    }
    .build()?;
    // Never print the URL itself: it may hold the password.
    println!("Redis: {}", backend.endpoint());
    Ok(backend)
}

#[cfg(feature = "postgres")]
async fn postgres(
    on_failure: FailurePolicy,
) -> Result<tollgate::backend::postgres::PostgresBackend, Box<dyn std::error::Error>> {
    use tollgate::backend::postgres::PostgresBackend;
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let backend = (PostgresBackend::builder().url(url))
        .on_failure(on_failure)
        .build()?;
    println!("PostgreSQL: {}", backend.endpoint());
    // Creates the table and the function if missing. If the database is down, the app still
    // starts (failing open) and the log says why.
    if let Err(err) = backend.migrate().await {
        tracing::warn!(%err, "migration failed; run it again once the database answers");
    }
    Ok(backend)
}

#[cfg(feature = "mysql")]
async fn mysql(
    on_failure: FailurePolicy,
) -> Result<tollgate::backend::mysql::MysqlBackend, Box<dyn std::error::Error>> {
    use tollgate::backend::mysql::MysqlBackend;
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let backend = (MysqlBackend::builder().url(url))
        .on_failure(on_failure)
        .build()?;
    println!("MySQL: {}", backend.endpoint());
    if let Err(err) = backend.migrate().await {
        tracing::warn!(%err, "migration failed; run it again once the database answers");
    }
    Ok(backend)
}

/// The quickstart's routes, limited on `backend`.
pub(crate) fn app<B: Backend>(backend: B) -> Result<Router, tollgate::ConfigError> {
    let limit = RateLimitLayer::builder()
        .policy(Policy::new("api", Quota::per_second(5).burst(10)))
        .key(ClientIp::new())
        .backend(backend)
        .build()?;
    Ok(Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route_layer(limit)
        .route("/", get(|| async { "unlimited\n" })))
}

/// Serves the app on `PORT`.
#[allow(dead_code)]
async fn serve<B: Backend>(backend: B) -> Result<(), Box<dyn std::error::Error>> {
    let app = app(backend)?;
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("0.0.0.0:{port}")).await?;
    println!("listening on http://{}", listener.local_addr()?);
    // Record the peer address, which `ClientIp` reads.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
