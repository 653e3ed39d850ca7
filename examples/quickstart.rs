//! Run with: `cargo run --example quickstart` (set `PORT` to change the port, default 3000).
//!
//! What to expect:
//!
//! ```text
//! $ curl -i localhost:3000/            # unlimited
//! $ curl -i localhost:3000/api/hello   # 200 with `ratelimit-policy: "api";q=10;w=2`
//!                                      #     and `ratelimit: "api";r=9;t=1`
//! $ for i in $(seq 12); do curl -s -o /dev/null -w '%{http_code}\n' localhost:3000/api/hello; done
//! # ten 200s, then 429 with `retry-after: 1`
//! $ curl -s localhost:3000/rate_limit  # your quota, without spending it
//! {"resources":{"api":{"limit":10,"remaining":0,"reset":1764152401,"used":10,"unit":"requests"}},"rate":{...}}
//! ```
//!
//! `/api/hello` is limited per client IP to 5 requests per second with bursts of 10. No proxy
//! is trusted, so `X-Forwarded-For` and friends are ignored: the key is the TCP peer address.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::{get, get_service};
use tollgate::key::ClientIp;
use tollgate::{Policy, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limit = RateLimitLayer::builder()
        .policy(Policy::new("api", Quota::per_second(5).burst(10)))
        .key(ClientIp::new())
        .build()?;

    let app = Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route_layer(limit.clone())
        .route("/", get(|| async { "unlimited\n" }))
        // The caller's quota as JSON (GitHub's shape), unlimited itself: asking spends nothing.
        .route("/rate_limit", get_service(limit.status_service()));

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
