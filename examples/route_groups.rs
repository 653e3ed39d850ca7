//! Run with: `cargo run --example route_groups` (set `PORT` to change the port, default 3000).
//!
//! Different limits per route group:
//!
//! - `POST /login`: 5 per minute per client IP (brute-force protection);
//! - `GET /api/items`: 10 per second, burst 20, and 1000 per hour, per API key (`x-api-key`),
//!   falling back to the client IP for anonymous calls;
//! - `GET /health`: unlimited.
//!
//! ```text
//! $ curl -i -X POST localhost:3000/login                       # ratelimit: "login";r=4;t=12
//! $ curl -i -H 'x-api-key: k1' localhost:3000/api/items        # ratelimit: "api-0";r=19;t=1, "api-1";r=999;t=4
//! $ curl -i localhost:3000/health                              # no rate-limit headers
//! ```
//!
//! The API key is taken as the client sends it: a client that invents a new key per request
//! gets a new bucket each time. In production, key by an identity an authentication layer has
//! checked (`tollgate::key::Extension<UserId>`), or validate keys before this layer.

use std::net::SocketAddr;

use axum::{
    Router,
    routing::{get, post},
};
use tollgate::key::{ClientIp, Header, KeyExtractorExt};
use tollgate::{Policy, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let login_limit = RateLimitLayer::builder()
        .policy(Policy::new("login", Quota::per_minute(5)))
        .key(ClientIp::new())
        .problem_json()
        .build()?;
    let api_limit = RateLimitLayer::builder()
        .policy(Policy::new("api", Quota::per_second(10).burst(20)).and(Quota::per_hour(1000)))
        .key(Header::new("x-api-key").or(ClientIp::new()))
        .build()?;

    let login = Router::new()
        .route("/login", post(|| async { "welcome\n" }))
        .route_layer(login_limit);
    let api = Router::new()
        .route("/api/items", get(|| async { "[]\n" }))
        .route_layer(api_limit);
    let app = Router::new()
        .merge(login)
        .merge(api)
        .route("/health", get(|| async { "ok\n" }));

    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("0.0.0.0:{port}")).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
