//! Run with: `cargo run --example rls_client --features rls-client,axum`, beside a running
//! rate limit service (`cargo run --example rls --features rls`, or `tollgate-server`).
//!
//! An axum app on `127.0.0.1:3000` (`PORT`) whose `/api/hello` is limited per client address
//! by asking the rate limit service at `RLS_URL` (default `http://127.0.0.1:8081`), as Envoy
//! would: domain `DOMAIN` (default `edge`), one descriptor `remote_address = <the client's
//! address>` (the TCP peer's IP alone, an IPv4-mapped address written as IPv4), which
//! `examples/rls.yaml` limits to 5 a second, bursts of 10. Answers carry the `RateLimit`
//! fields and `Retry-After` from the service's answer; a client refused is answered from the
//! process until its reset, without a call.
//!
//! Each call has a deadline of `DEADLINE_MS` (default 20, Envoy's). With the service
//! unreachable (or too slow), `ON_FAILURE` decides: `open` admits, `closed` answers 503,
//! `fallback` (the default) limits locally at this instance's share (`INSTANCES`, default 1,
//! of the quota below).
//!
//! `PASS_HEADERS` passes the service's `response_headers_to_add` on to the responses: `all`,
//! or a comma-separated list of names (default: none; limitador's `X-RateLimit-*` headers are
//! read for the fields either way).
//!
//! ```text
//! $ for i in $(seq 14); do curl -s -o /dev/null -w '%{http_code} ' localhost:3000/api/hello; done
//! 200 200 200 200 200 200 200 200 200 200 200 429 429 429
//! $ curl -si localhost:3000/api/hello | grep -i -e ratelimit -e retry
//! retry-after: 1
//! ratelimit-policy: "remote_address";q=10;w=2
//! ratelimit: "remote_address";r=0;t=1
//! ```
//!
//! (Bursts of 10, and a unit back every 200 ms while curl runs.)

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tollgate::backend::remote::{FailurePolicy, Fleet};
use tollgate::backend::rls::{PassHeaders, RlsBackend};
use tollgate::key::PeerIp;
use tollgate::{Policy, Quota, RateLimitLayer};

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let url = env_or("RLS_URL", "http://127.0.0.1:8081");
    let domain = env_or("DOMAIN", "edge");
    let port: u16 = env_or("PORT", "3000")
        .parse()
        .map_err(|e| format!("PORT: {e}"))?;
    let deadline: u64 = env_or("DEADLINE_MS", "20")
        .parse()
        .map_err(|e| format!("DEADLINE_MS: {e}"))?;
    let instances: u32 = env_or("INSTANCES", "1")
        .parse()
        .map_err(|e| format!("INSTANCES: {e}"))?;
    let on_failure = match env_or("ON_FAILURE", "fallback").as_str() {
        "open" => FailurePolicy::FailOpen,
        "closed" => FailurePolicy::FailClosed,
        "fallback" => FailurePolicy::FallbackLocal,
        other => return Err(format!("ON_FAILURE={other:?}: open, closed or fallback").into()),
    };
    let pass = match env_or("PASS_HEADERS", "").as_str() {
        "" | "none" => PassHeaders::None,
        "all" => PassHeaders::All,
        names => PassHeaders::only(names.split(',').map(str::trim))
            .map_err(|e| format!("PASS_HEADERS: {e}"))?,
    };
    let backend = RlsBackend::builder()
        .url(&url)
        .pass_response_headers(pass)
        .domain(&domain)
        .timeout(Duration::from_millis(deadline))
        .on_failure(on_failure)
        .fleet(Fleet::Size(
            NonZeroU32::new(instances).ok_or("INSTANCES: at least 1")?,
        ))
        .build()?;
    // The policy's name is the descriptor's key; its quota is the rule's (examples/rls.yaml),
    // for `RateLimit-Policy` and the local fallback.
    let limit = RateLimitLayer::builder()
        .backend(backend)
        .key(PeerIp::new().ipv6_prefix(128))
        .policy(Policy::new(
            "remote_address",
            Quota::per_second(5).burst(10),
        ))
        .build()?;
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route_layer(limit);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tracing::info!(
        "http://127.0.0.1:{port}/api/hello, limited by {url} (domain {domain:?}, \
         deadline {deadline} ms, on failure {on_failure:?})"
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
