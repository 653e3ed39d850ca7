//! Run with: `ADMIN_TOKEN=secret cargo run --example rules_admin --features serde`
//! (`PORT` picks the port, default 3000; without `ADMIN_TOKEN` the admin API is off).
//!
//! Per-merchant limits with tiers, from `examples/rules.toml`, changed live over an admin API:
//! API routes are keyed by the `x-merchant-id` header (falling back to the client IP); the
//! rules give `merchant-1` the "pro" tier, `merchant-2` "enterprise", and everyone else
//! "free" (2/s burst 5); `/api/search` has a stricter policy of its own.
//!
//! ```text
//! $ curl -si -H 'x-merchant-id: merchant-9' localhost:3000/api/orders | grep -i ^ratelimit
//! ratelimit-policy: "free-0";q=5;w=3, "free-1";q=1000;w=3600
//! ratelimit: "free-0";r=4;t=1, "free-1";r=999;t=4
//!
//! # Read the rules, move merchant-9 to the pro tier, write them back:
//! $ curl -s -H 'authorization: Bearer secret' localhost:3000/admin/rules > rules.json
//! $ jq '.tiers["merchant-9"] = "pro"' rules.json |
//!     curl -s -X PUT -H 'authorization: Bearer secret' -H 'content-type: application/json' \
//!          --data-binary @- localhost:3000/admin/rules
//! rules replaced
//!
//! $ curl -si -H 'x-merchant-id: merchant-9' localhost:3000/api/orders | grep -i ^ratelimit
//! ratelimit-policy: "pro-0";q=50;w=3, "pro-1";q=50000;w=3600
//! ratelimit: "pro-0";r=49;t=1, "pro-1";r=49999;t=1
//!
//! # A typo is refused, naming the rule and the value, and changes nothing:
//! $ jq '.rules[0].tier = "por"' rules.json |
//!     curl -s -X PUT -H 'authorization: Bearer secret' -H 'content-type: application/json' \
//!          --data-binary @- localhost:3000/admin/rules
//! invalid rules: invalid `rules`: rules[0] (priority 10): tier "por" is not a tier of the rule
//! set (its tiers are "enterprise", "pro"); a tier is a value of `tiers`, or declared in
//! `declared_tiers` while no tenant is in it
//!
//! # A wrong token, or an invalid rule set, changes nothing:
//! $ curl -si -X PUT -H 'authorization: Bearer nope' localhost:3000/admin/rules   # 401
//! $ curl -si -X PUT -H 'authorization: Bearer secret' -H 'content-type: application/json' \
//!        -d '{"default":"gold","policies":[]}' localhost:3000/admin/rules        # 422
//! ```
//!
//! The merchant id is taken from a header as the client sends it, to keep the example short:
//! in production, key by the merchant an authentication layer has verified
//! (`tollgate::key::Extension<MerchantId>`), or any client could claim another's tier.

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use tollgate::RateLimitLayer;
use tollgate::key::{ClientIp, Header, KeyExtractorExt};
use tollgate::rules::{RuleSet, RulesHandle};

/// The rules shipped with the example.
pub(crate) fn default_rules() -> Result<RuleSet, Box<dyn std::error::Error>> {
    let text = match std::env::var("RULES_FILE") {
        Ok(path) => std::fs::read_to_string(path)?,
        Err(_) => include_str!("rules.toml").to_owned(),
    };
    let rules: RuleSet = toml::from_str(&text)?;
    rules.validate()?;
    Ok(rules)
}

/// The application: API routes under the rules, and the admin API when a token is given.
pub(crate) fn app(
    rules: RuleSet,
    admin_token: Option<String>,
) -> Result<Router, tollgate::ConfigError> {
    let limit = RateLimitLayer::builder()
        .rules(rules)
        .key(Header::new("x-merchant-id").or(ClientIp::new()))
        .build()?;
    let handle = limit.rules_handle().expect("built with rules");
    let api = Router::new()
        .route("/api/orders", get(|| async { "[]\n" }))
        .route("/api/search", get(|| async { "no results\n" }))
        .route_layer(limit);
    let mut app = Router::new().merge(api);
    if let Some(token) = admin_token.filter(|t| !t.is_empty()) {
        let admin = Router::new()
            .route("/admin/rules", get(get_rules).put(put_rules))
            .with_state(Admin { handle, token });
        app = app.merge(admin);
    }
    Ok(app)
}

#[derive(Clone)]
struct Admin {
    handle: RulesHandle,
    token: String,
}

impl Admin {
    /// Checks `Authorization: Bearer <token>`, comparing in constant time.
    fn authorize(&self, headers: &HeaderMap) -> Result<(), Box<Response>> {
        let given = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        let (a, b) = (given.as_bytes(), self.token.as_bytes());
        let same =
            a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0;
        if same {
            Ok(())
        } else {
            Err(Box::new(
                (
                    StatusCode::UNAUTHORIZED,
                    [("www-authenticate", "Bearer")],
                    "missing or wrong bearer token\n",
                )
                    .into_response(),
            ))
        }
    }
}

async fn get_rules(State(admin): State<Admin>, headers: HeaderMap) -> Response {
    if let Err(denied) = admin.authorize(&headers) {
        return *denied;
    }
    Json(admin.handle.current()).into_response()
}

async fn put_rules(State(admin): State<Admin>, headers: HeaderMap, body: String) -> Response {
    if let Err(denied) = admin.authorize(&headers) {
        return *denied;
    }
    let rules: RuleSet = match serde_json::from_str(&body) {
        Ok(rules) => rules,
        Err(e) => {
            return (
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("invalid rules: {e}\n"),
            )
                .into_response();
        }
    };
    match admin.handle.replace(rules) {
        Ok(()) => (StatusCode::OK, "rules replaced\n").into_response(),
        Err(e) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid rules: {e}\n"),
        )
            .into_response(),
    }
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let token = std::env::var("ADMIN_TOKEN").ok();
    if token.is_none() {
        println!("ADMIN_TOKEN is not set: the admin API is off");
    }
    let app = app(default_rules()?, token)?;
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
