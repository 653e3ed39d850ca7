//! Run with: `cargo run --example observability --features metrics` (`PORT` sets the port,
//! default 3000).
//!
//! The quickstart's server (`GET /` unlimited, `GET /api/hello` 5 per second with bursts of 10
//! per client IP) plus `GET /metrics`: tollgate's counters in the Prometheus text format,
//! through the `metrics` facade and its Prometheus exporter. What to expect:
//!
//! ```text
//! $ for i in $(seq 12); do curl -s -o /dev/null localhost:3000/api/hello; done
//! $ curl -s localhost:3000/metrics | grep tollgate_
//! tollgate_decisions_total{policy="api",outcome="allowed",quota=""} 10
//! tollgate_decisions_total{policy="api",outcome="denied",quota="api"} 2
//! tollgate_near_limit_total{policy="api",quota="api"} 1
//! tollgate_local_tracked_keys 1
//! ```
//!
//! Decisions are also logged at debug (`RUST_LOG=tollgate=debug`), one event each; warnings
//! (a backend going down, a full key table) once per change of state.

use std::net::SocketAddr;

use axum::{Router, routing::get};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tollgate::key::ClientIp;
use tollgate::{Policy, Quota, RateLimitLayer};

/// The store latency histogram's buckets, seconds, as `docs/observability.md` recommends: half
/// a millisecond (a nearby Redis) to 250 ms (past the default 100 ms call timeout), with 80 ms
/// at `TollgateStoreSlow`'s threshold.
const LATENCY_BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.08, 0.1, 0.25,
];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "tollgate=info".into()),
        )
        .init();
    // One exporter: every tollgate metric from now on is in `prometheus.render()`. The store's
    // latency as a histogram with buckets (the exporter's default is a summary, which the
    // dashboard's latency panels and `TollgateStoreSlow` cannot read); this example's local
    // backend calls no store, a Redis or SQL backend does.
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("tollgate_backend_latency_seconds".into()),
            &LATENCY_BUCKETS,
        )?
        .install_recorder()?;

    let limit = RateLimitLayer::builder()
        .policy(Policy::new("api", Quota::per_second(5).burst(10)))
        .key(ClientIp::new())
        .build()?;

    let app = Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route_layer(limit)
        .route("/", get(|| async { "unlimited\n" }))
        .route("/metrics", get(move || async move { prometheus.render() }));

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
