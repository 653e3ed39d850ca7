//! Run with: `cargo run --example distributed --features redis`
//! (`PORT` picks the port, default 3000; `REDIS_URL` the Redis server, default
//! `redis://127.0.0.1:6379`; `REDIS_CLUSTER_NODES`, comma-separated `redis://host:port` URLs,
//! selects Redis Cluster instead).
//!
//! What to expect: the same routes and policy as `quickstart`, but the buckets live in Redis,
//! so every instance started against the same Redis shares one limit:
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
//! is trusted. The app starts even when Redis is down, and then fails open (requests pass
//! unlimited) until Redis answers; limits apply again within about a second of Redis coming
//! back. The log (INFO and above, on stdout) has one warning naming the cause when Redis fails
//! (`connection refused`, `authentication failed`) and one line when it answers again, not a
//! line per request. The Redis URL is printed with its password masked
//! (`redis://:***@host:6379`).

use std::net::SocketAddr;

use axum::{Router, routing::get};
use tollgate::backend::redis::{FailurePolicy, RedisBackend};
use tollgate::key::ClientIp;
use tollgate::{Policy, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
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
    .on_failure(FailurePolicy::FailOpen)
    .build()?;
    // Never print the URL itself: it may hold the password.
    println!("Redis: {}", backend.endpoint());

    let limit = RateLimitLayer::builder()
        .policy(Policy::new("api", Quota::per_second(5).burst(10)))
        .key(ClientIp::new())
        .backend(backend)
        .build()?;

    let app = Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route_layer(limit)
        .route("/", get(|| async { "unlimited\n" }));

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
