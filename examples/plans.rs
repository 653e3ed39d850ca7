//! Run with: `cargo run --example plans --features serde,calendar`
//! (`PORT` picks the port, default 3000; `RULES_FILE` another rules file than
//! `examples/plans.toml`).
//!
//! API plans by the calendar: a free plan of 1 000 requests a month and a pro plan of
//! 100 000, each tenant's month starting on its own billing day in its own time zone (the
//! rules file's `billing` table), and `/rate_limit` saying when each tenant's month started and when it
//! resets. Tenants are named by the `x-tenant` header.
//!
//! ```text
//! $ curl -si -H 'x-tenant: acme' localhost:3000/api/reports | grep -i '^ratelimit'
//! ratelimit-policy: "pro";q=100000;w=2592000
//! ratelimit: "pro";r=99999;t=1386058
//!
//! $ curl -s -H 'x-tenant: acme' localhost:3000/rate_limit | jq .rate
//! {
//!   "limit": 100000,
//!   "remaining": 99999,
//!   "reset": 1797289200,
//!   "used": 1,
//!   "unit": "requests",
//!   "window_start": "2026-11-15T00:00:00+01:00[Europe/Berlin]",
//!   "window_end": "2026-12-15T00:00:00+01:00[Europe/Berlin]"
//! }
//!
//! $ curl -s -H 'x-tenant: globex' localhost:3000/rate_limit | jq -r .rate.window_end
//! 2026-11-30T09:00:00-05:00[America/New_York]
//! ```
//!
//! `w` in `RateLimit-Policy` is the period's nominal length (a month: 30 days); `t`, and
//! `Retry-After` once the month's requests are spent, are the exact seconds to the tenant's
//! next billing day. The tenant is taken from a header as the client sends it, to keep the
//! example short: in production, key by the tenant an authentication layer has verified
//! (`tollgate::key::Extension<TenantId>`), or any client could spend another's plan.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::{get, get_service};
use tollgate::backend::{Backend, LocalBackend};
use tollgate::key::Header;
use tollgate::rules::RuleSet;
use tollgate::{ConfigError, RateLimitLayer};

/// The plans shipped with the example, or those of `RULES_FILE`.
pub(crate) fn plans() -> Result<RuleSet, Box<dyn std::error::Error>> {
    let text = match std::env::var("RULES_FILE") {
        Ok(path) => std::fs::read_to_string(path)?,
        Err(_) => include_str!("plans.toml").to_owned(),
    };
    let rules: RuleSet = toml::from_str(&text)?;
    rules.validate()?;
    Ok(rules)
}

/// The application on `backend`: the API under the tenants' plans, and the status endpoint.
pub(crate) fn app<B: Backend + Clone>(rules: RuleSet, backend: B) -> Result<Router, ConfigError> {
    let limit = RateLimitLayer::builder()
        .rules(rules)
        .key(Header::new("x-tenant"))
        .backend(backend)
        .build()?;
    Ok(Router::new()
        .route("/api/reports", get(|| async { "[]\n" }))
        .route_layer(limit.clone())
        .route("/rate_limit", get_service(limit.status_service())))
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = match std::env::var("PORT") {
        Ok(p) => p.parse().map_err(|_| format!("PORT={p:?} is not a port"))?,
        Err(_) => 3000,
    };
    let app = app(plans()?, LocalBackend::new())?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("plans on http://{addr}: try `curl -si -H 'x-tenant: acme' {addr}/api/reports`");
    axum::serve(listener, app).await?;
    Ok(())
}
