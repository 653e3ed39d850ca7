//! The layer with tower-http's `CorsLayer`, over a real TCP listener: with CORS outside and the
//! limit inside, allowed and refused responses carry the CORS headers and expose the rate-limit
//! fields, and preflights are answered without spending quota; the other way round, a refusal
//! carries none (what the docs warn about).

mod support;

use axum::http::{HeaderValue, Method};
use axum::{Router, routing::get};
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower_http::cors::CorsLayer;

const ORIGIN: &str = "http://localhost:8080";

fn limit() -> RateLimitLayer<Global, tollgate::backend::LocalBackend> {
    RateLimitLayer::builder()
        .key(Global)
        .policy(Policy::new("api", Quota::per_hour(2)))
        .build()
        .unwrap()
}

fn cors() -> CorsLayer {
    CorsLayer::new()
        .allow_origin(HeaderValue::from_static(ORIGIN))
        .allow_methods([Method::GET])
        .expose_headers(tollgate::cors::EXPOSE_HEADERS)
}

async fn fetch(base: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(format!("{base}/api/hello"))
        .header("origin", ORIGIN)
        .send()
        .await
        .unwrap()
}

async fn preflight(base: &str) -> reqwest::Response {
    reqwest::Client::new()
        .request(reqwest::Method::OPTIONS, format!("{base}/api/hello"))
        .header("origin", ORIGIN)
        .header("access-control-request-method", "GET")
        .send()
        .await
        .unwrap()
}

fn exposed(res: &reqwest::Response) -> Vec<String> {
    res.headers()
        .get("access-control-expose-headers")
        .map(|v| {
            v.to_str()
                .unwrap()
                .split(',')
                .map(|s| s.trim().to_lowercase())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn refusals_carry_cors_headers_and_preflights_spend_nothing() {
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .layer(limit())
        .layer(cors());
    let base = format!("http://{}", support::serve(app).await);
    // Preflights are the CorsLayer's: answered, however many, without spending the quota.
    for _ in 0..5 {
        let res = preflight(&base).await;
        assert!(res.status().is_success(), "{}", res.status());
        assert_eq!(res.headers()["access-control-allow-origin"], ORIGIN);
        assert!(res.headers().get("ratelimit").is_none());
    }
    for remaining in [1, 0] {
        let res = fetch(&base).await;
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["access-control-allow-origin"], ORIGIN);
        assert_eq!(
            res.headers()["ratelimit"],
            format!("\"api\";r={remaining};t=1800").as_str()
        );
        for field in ["ratelimit", "ratelimit-policy", "retry-after"] {
            assert!(
                exposed(&res).contains(&field.to_owned()),
                "{:?}",
                exposed(&res)
            );
        }
    }
    let refused = fetch(&base).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["access-control-allow-origin"], ORIGIN);
    assert_eq!(refused.headers()["retry-after"], "1800");
    assert!(exposed(&refused).contains(&"retry-after".to_owned()));
}

#[tokio::test]
async fn with_the_limit_outside_cors_a_refusal_is_unreadable() {
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .layer(cors())
        .layer(limit());
    let base = format!("http://{}", support::serve(app).await);
    assert!(
        fetch(&base)
            .await
            .headers()
            .contains_key("access-control-allow-origin")
    );
    // The preflight spends quota here, and the refusal has no CORS headers: a browser reports
    // a network error.
    preflight(&base).await;
    let refused = fetch(&base).await;
    assert_eq!(refused.status(), 429);
    assert!(
        !refused
            .headers()
            .contains_key("access-control-allow-origin")
    );
}
