//! Limits that depend on the response: failed logins, tokens a response reports, and requests
//! in flight.
//!
//! Run with: `cargo run --example outcomes` (set `PORT` to change the port, default 3000).
//! With `BACKEND=redis` (built with `--features redis`; `REDIS_URL`, default
//! `redis://127.0.0.1:6379`) the limits live in Redis, shared by every instance started
//! against it.
//!
//! - `POST /login`, JSON `{"user": "...", "password": "..."}`: 200 for `alice` with
//!   `wonderland`, 401 otherwise. Policy `login`: 5 failed logins per 15 minutes per (client
//!   IP, user); successful logins are free; after 5 failures the key gets 429 with
//!   `Retry-After` before the password is checked, even the right one.
//! - `POST /generate?tokens=N` (default 100): 200 with `x-tokens-used: N`, a stand-in for an
//!   LLM call. Policy `tokens`: 1000 tokens per minute per `x-api-key`, admitted at cost 1 and
//!   charged what `x-tokens-used` says when the response comes; a key in debt gets 429 until
//!   it is repaid.
//! - `GET /export?ms=M` (default 500): answers after M milliseconds. Policy `exports`: at most
//!   2 in flight per `x-api-key`; a third at the same time gets 429. In Redis a slot is a lease
//!   of `EXPORT_LEASE` (default `5min`, the quota syntax's durations: `30s`, `2min`): the
//!   slots of an instance killed mid-export come back after it.
//!
//! What to expect:
//!
//! ```text
//! $ login() { curl -s -o /dev/null -w '%{http_code} ' localhost:3000/login \
//! >   -H 'content-type: application/json' -d "{\"user\":\"alice\",\"password\":\"$1\"}"; }
//! $ login wonderland; login wonderland; login wonderland    # successes are free
//! 200 200 200
//! $ for i in 1 2 3 4 5; do login guess; done; login wonderland
//! 401 401 401 401 401 429
//!
//! $ curl -si -X POST 'localhost:3000/generate?tokens=900' -H 'x-api-key: k1' | grep -i ratelimit
//! ratelimit-policy: "tokens";q=1000;w=60
//! ratelimit: "tokens";r=999;t=1
//! $ curl -s -o /dev/null -w '%{http_code}\n' -X POST 'localhost:3000/generate?tokens=900' -H 'x-api-key: k1'
//! 200        # admitted at cost 1: 100 tokens left, then charged 900 more: the key is in debt
//! $ curl -si -X POST 'localhost:3000/generate?tokens=1' -H 'x-api-key: k1' | grep -iE '^(HTTP|retry-after)'
//! HTTP/1.1 429 Too Many Requests
//! retry-after: 49
//!
//! $ for i in 1 2 3; do curl -s -o /dev/null -w '%{http_code}\n' 'localhost:3000/export?ms=2000' \
//! >   -H 'x-api-key: k1' & done; wait
//! 429
//! 200
//! 200
//! ```
//!
//! Requests are keyed by the TCP peer address (no proxy is trusted) and by headers; a request
//! without `x-api-key` on `/generate` or `/export` gets 400.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request};
use axum::http::{HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing::get, routing::post};
use serde::Deserialize;
use tollgate::backend::Backend;
use tollgate::key::{ClientIp, Extension, Header, KeyError, ToKey};
use tollgate::settle::{ChargeWhen, CostFrom};
use tollgate::{Key, Policy, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
    let lease = match std::env::var("EXPORT_LEASE") {
        Ok(v) => format!("2 concurrent lease {v}")
            .parse::<Quota>()
            .map_err(|e| format!("EXPORT_LEASE={v:?}: {e}"))?
            .period(),
        Err(_) => Quota::DEFAULT_LEASE,
    };
    let backend = std::env::var("BACKEND").unwrap_or_else(|_| "local".into());
    match backend.as_str() {
        "local" => serve(tollgate::backend::LocalBackend::new(), lease).await,
        #[cfg(feature = "redis")]
        "redis" => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            let redis = tollgate::backend::redis::RedisBackend::builder()
                .url(url)
                .build()?;
            println!("Redis: {}", redis.endpoint());
            serve(redis, lease).await
        }
        #[cfg(not(feature = "redis"))]
        "redis" => Err("BACKEND=redis needs a build with `--features redis`".into()),
        other => Err(format!("unknown BACKEND={other:?}: use local or redis").into()),
    }
}

/// The user a login is for, read from its JSON body before the limit (see `login_user`).
#[derive(Clone)]
struct LoginUser(String);

impl ToKey for LoginUser {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::from_bytes(&self.0)
    }
}

#[derive(Deserialize)]
struct Login {
    user: String,
    password: String,
}

/// Reads the login's user into the request's extensions, so that the `login` limit can key by
/// it; the body is put back for the handler. A body that is not a login is left to the handler
/// to refuse (and, keyless, gets 400 from the limit first).
async fn login_user(req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 16 * 1024).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    if let Ok(login) = serde_json::from_slice::<Login>(&bytes) {
        parts.extensions.insert(LoginUser(login.user));
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

async fn login(Json(login): Json<Login>) -> StatusCode {
    if login.user == "alice" && login.password == "wonderland" {
        StatusCode::OK
    } else {
        StatusCode::UNAUTHORIZED
    }
}

#[derive(Deserialize)]
struct Tokens {
    tokens: Option<u32>,
}

const TOKENS_USED: HeaderName = HeaderName::from_static("x-tokens-used");

async fn generate(Query(q): Query<Tokens>) -> impl IntoResponse {
    let tokens = q.tokens.unwrap_or(100);
    (
        [(TOKENS_USED, tokens.to_string())],
        format!("generated {tokens} tokens\n"),
    )
}

#[derive(Deserialize)]
struct Export {
    ms: Option<u64>,
}

async fn export(Query(q): Query<Export>) -> Bytes {
    let ms = q.ms.unwrap_or(500);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Bytes::from(format!("exported after {ms} ms\n"))
}

/// The three routes, each with its limit, on `backend`.
#[allow(dead_code)] // the tests' entry (tests/outcomes.rs)
pub(crate) fn app<B: Backend + Clone>(backend: B) -> Result<Router, tollgate::ConfigError> {
    app_with_lease(backend, Quota::DEFAULT_LEASE)
}

/// [`app`], an export's slot a lease of `lease` in a shared store.
pub(crate) fn app_with_lease<B: Backend + Clone>(
    backend: B,
    lease: Duration,
) -> Result<Router, tollgate::ConfigError> {
    // 5 failed logins per 15 minutes per (client IP, user); successes are free.
    let login_limit = RateLimitLayer::builder()
        .key((ClientIp::new(), Extension::<LoginUser>::new()))
        .backend(backend.clone())
        .policy(
            Policy::new("login", Quota::new(5, Duration::from_secs(15 * 60)))
                .charge_when(ChargeWhen::status([401])),
        )
        .build()?;
    // 1000 tokens a minute per API key, charged what the response reports.
    let token_limit = RateLimitLayer::builder()
        .key(Header::new("x-api-key"))
        .backend(backend.clone())
        .policy(
            Policy::new("tokens", Quota::per_minute(1000)).cost_from(CostFrom::header(TOKENS_USED)),
        )
        .build()?;
    // At most 2 exports in flight per API key.
    let export_limit = RateLimitLayer::builder()
        .key(Header::new("x-api-key"))
        .backend(backend)
        .policy(Policy::new("exports", Quota::concurrent(2).lease(lease)))
        .build()?;

    Ok(Router::new()
        .route(
            "/login",
            post(login)
                .layer(login_limit)
                .layer(middleware::from_fn(login_user)),
        )
        .route("/generate", post(generate).layer(token_limit))
        .route("/export", get(export).layer(export_limit)))
}

async fn serve<B: Backend + Clone>(
    backend: B,
    lease: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let app = app_with_lease(backend, lease)?;
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
