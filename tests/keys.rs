//! Keys end to end, over a real TCP listener: fallback chains never share buckets, and long
//! client-supplied values can be keyed by their hash.

mod support;

use axum::{Router, routing::get};
use http::Request;
use tollgate::key::{ClientIp, Extension, Header, KeyExtractor, KeyExtractorExt};
use tollgate::{Policy, Quota, RateLimitLayer};

/// Serves `/` behind `limit`, behind an "authentication" layer that puts the `x-user` header's
/// value in the request extensions as a `String`.
async fn serve(
    limit: RateLimitLayer<impl KeyExtractor + Clone, tollgate::backend::LocalBackend>,
) -> String {
    let auth = tower::util::MapRequestLayer::new(|mut req: Request<axum::body::Body>| {
        let user = req
            .headers()
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if let Some(user) = user {
            req.extensions_mut().insert(user);
        }
        req
    });
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(limit)
        .layer(auth);
    let addr = support::serve(app).await;
    format!("http://{addr}/")
}

async fn status(url: &str, headers: &[(&str, &str)]) -> u16 {
    let mut req = reqwest::Client::new().get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap().status().as_u16()
}

/// An anonymous client sending `x-api-key: alice` must not spend the budget of the
/// authenticated user `alice`.
#[tokio::test]
async fn a_fallback_key_never_spends_another_extractors_budget() {
    let limit = RateLimitLayer::builder()
        .key(Extension::<String>::new().or(Header::new("x-api-key")))
        .policy(Policy::new("api", Quota::per_hour(2)))
        .build()
        .unwrap();
    let url = serve(limit).await;
    assert_eq!(status(&url, &[("x-api-key", "alice")]).await, 200);
    assert_eq!(status(&url, &[("x-api-key", "alice")]).await, 200);
    assert_eq!(status(&url, &[("x-api-key", "alice")]).await, 429);
    // The user alice still has her two requests.
    assert_eq!(status(&url, &[("x-user", "alice")]).await, 200);
    assert_eq!(status(&url, &[("x-user", "alice")]).await, 200);
    assert_eq!(status(&url, &[("x-user", "alice")]).await, 429);
}

/// An 847-byte bearer token is a key once hashed; unhashed it is refused (not silently keyed by
/// the fallback's IP).
#[tokio::test]
async fn long_tokens_are_keyed_by_their_hash() {
    let token = format!("Bearer {}", "a".repeat(840));
    let other = format!("Bearer {}", "b".repeat(840));
    let hashed = RateLimitLayer::builder()
        .key(
            Header::new("authorization")
                .hashed(*b"0123456789abcdef")
                .or(ClientIp::new()),
        )
        .policy(Policy::new("api", Quota::per_hour(1)))
        .build()
        .unwrap();
    let url = serve(hashed).await;
    assert_eq!(status(&url, &[("authorization", &token)]).await, 200);
    assert_eq!(status(&url, &[("authorization", &token)]).await, 429);
    // Another token, and the IP fallback, have buckets of their own.
    assert_eq!(status(&url, &[("authorization", &other)]).await, 200);
    assert_eq!(status(&url, &[]).await, 200);

    let plain = RateLimitLayer::builder()
        .key(Header::new("authorization").or(ClientIp::new()))
        .policy(Policy::new("api", Quota::per_hour(1)))
        .build()
        .unwrap();
    let url = serve(plain).await;
    // Too long: refused with the missing-key status, not counted against the IP.
    assert_eq!(status(&url, &[("authorization", &token)]).await, 400);
    assert_eq!(status(&url, &[]).await, 200);
}
