//! The decision in handlers: a layer built with `decision_in_extensions(true)` puts a
//! `RateLimitStatus` in the requests it lets through, read by the axum extractor; without it
//! the extractor says how to get one, and `Option<RateLimitStatus>` is `None`.

mod support;

use axum::{Json, Router, routing::get};
use std::time::Duration;
use tollgate::key::Global;

use tollgate::testing::{Fields, ManualClock};
use tollgate::{Policy, Quota, RateLimitLayer, RateLimitStatus};

fn app(decision: bool) -> Router {
    let limit = RateLimitLayer::builder()
        .key(Global)
        .policy(
            Policy::new("api", Quota::per_hour(10).named("hourly")).and(
                Quota::per_day(2000)
                    .fixed_window()
                    .bytes()
                    .named("daily-bytes"),
            ),
        )
        .decision_in_extensions(decision)
        .build()
        .unwrap();
    Router::new()
        .route(
            "/status",
            get(|status: RateLimitStatus| async move {
                Json(serde_json::json!({
                    "policy": &*status.policy,
                    "quotas": status.quotas.iter().map(|q| serde_json::json!({
                        "name": &*q.name, "limit": q.limit, "remaining": q.remaining,
                        "reset": q.reset.as_secs(), "unit": q.unit,
                    })).collect::<Vec<_>>(),
                }))
            }),
        )
        .route(
            "/maybe",
            get(|status: Option<RateLimitStatus>| async move {
                status.map_or("none".to_owned(), |s| s.quotas[0].remaining.to_string())
            }),
        )
        .route_layer(limit)
}

async fn text_of(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

async fn json_of(url: &str) -> serde_json::Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

#[tokio::test]
async fn handlers_see_the_decision() {
    let base = format!("http://{}", support::serve(app(true)).await);
    let body = json_of(&format!("{base}/status")).await;
    assert_eq!(body["policy"], "api");
    assert_eq!(body["quotas"][0]["name"], "hourly");
    assert_eq!(body["quotas"][0]["limit"], 10);
    assert_eq!(body["quotas"][0]["remaining"], 9);
    assert_eq!(body["quotas"][0]["unit"], "requests");
    assert_eq!(body["quotas"][1]["name"], "daily-bytes");
    assert_eq!(body["quotas"][1]["remaining"], 1999);
    assert_eq!(body["quotas"][1]["unit"], "content-bytes");
    let text = text_of(&format!("{base}/maybe")).await;
    assert_eq!(text, "8");
}

#[tokio::test]
async fn without_the_option_the_extractor_says_how_to_get_it() {
    let base = format!("http://{}", support::serve(app(false)).await);
    let res = reqwest::get(format!("{base}/status")).await.unwrap();
    assert_eq!(res.status(), 500);
    assert!(
        res.text()
            .await
            .unwrap()
            .contains("decision_in_extensions(true)")
    );
    let text = text_of(&format!("{base}/maybe")).await;
    assert_eq!(text, "none");
}

/// With `serde`, the status is a JSON body as it is.
#[cfg(feature = "serde")]
#[tokio::test]
async fn the_status_serializes() {
    let limit = RateLimitLayer::builder()
        .key(Global)
        .policy(Policy::new("api", Quota::per_hour(10)))
        .decision_in_extensions(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/json",
            get(|status: RateLimitStatus| async move { Json(status) }),
        )
        .route_layer(limit);
    let base = format!("http://{}", support::serve(app).await);
    let body = json_of(&format!("{base}/json")).await;
    // The time until the next unit: 360 s, less the moments since the decision.
    let reset = body["quotas"][0]["reset"].as_f64().unwrap();
    assert!(reset > 359.0 && reset <= 360.0, "{body}");
    let mut body = body;
    body["quotas"][0]["reset"] = 360.into();
    assert_eq!(
        body,
        serde_json::json!({"policy": "api", "quotas": [
            {"name": "api", "limit": 10, "remaining": 9, "reset": 360, "unit": "requests"}
        ]})
    );
}

/// `/api/hello` behind `limit`, and its status endpoint at `/rate_limit`; the base URL.
async fn serve_with_status<K, Bk>(limit: RateLimitLayer<K, Bk>) -> String
where
    K: tollgate::key::KeyExtractor + Clone + Send + Sync + 'static,
    Bk: tollgate::backend::Backend,
{
    use axum::routing::get_service;
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .route_layer(limit.clone())
        .route("/rate_limit", get_service(limit.status_service()));
    format!("http://{}", support::serve(app).await)
}

/// A GET of `url` with the API key `k`.
async fn keyed(client: &reqwest::Client, url: &str) -> reqwest::Response {
    client
        .get(url)
        .header("x-api-key", "k")
        .send()
        .await
        .unwrap()
}

/// The quota status endpoint: the caller's state, without spending, in GitHub's shape.
#[tokio::test]
async fn the_status_endpoint_reports_without_spending() {
    let limit = RateLimitLayer::builder()
        .key(tollgate::key::Header::new("x-api-key"))
        .policy(
            Policy::new("api", Quota::per_hour(10).named("hourly"))
                .and(Quota::concurrent(2).named("inflight")),
        )
        .build()
        .unwrap();
    let base = serve_with_status(limit).await;
    let client = reqwest::Client::new();
    let status = || async {
        let res = keyed(&client, &format!("{base}/rate_limit")).await;
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["content-type"], "application/json");
        res.json::<serde_json::Value>().await.unwrap()
    };
    let fresh = status().await;
    assert_eq!(fresh["resources"]["hourly"]["remaining"], 10, "{fresh}");
    assert_eq!(fresh["resources"]["hourly"]["used"], 0, "{fresh}");
    for _ in 0..3 {
        let res = keyed(&client, &format!("{base}/api/hello")).await;
        res.text().await.unwrap();
    }
    // Asking twice spends nothing.
    for _ in 0..2 {
        let body = status().await;
        let hourly = &body["resources"]["hourly"];
        assert_eq!(hourly["limit"], 10, "{body}");
        assert_eq!(hourly["remaining"], 7, "{body}");
        assert_eq!(hourly["used"], 3, "{body}");
        assert_eq!(hourly["unit"], "requests", "{body}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let reset = hourly["reset"].as_u64().unwrap();
        assert!(reset > now && reset <= now + 361, "{reset} vs {now}");
        assert_eq!(body["resources"]["inflight"]["unit"], "concurrent-requests");
        assert_eq!(body["resources"]["inflight"]["remaining"], 2, "{body}");
        // The tightest quota.
        assert_eq!(body["rate"], body["resources"]["hourly"], "{body}");
    }
    // Without a key: 400, with a message.
    let res = client
        .get(format!("{base}/rate_limit"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400);
    let body: serde_json::Value = res.json().await.unwrap();
    assert!(body["message"].as_str().unwrap().contains("key"), "{body}");
}

/// While a key is blocked, the status endpoint lists every quota of its policy, each with
/// nothing left until the block ends.
#[tokio::test]
async fn a_blocked_key_reports_every_quota() {
    let limit = RateLimitLayer::builder()
        .key(Global)
        .policy(
            Policy::new("api", Quota::per_hour(2).named("hourly"))
                .and(Quota::per_day(100).fixed_window().named("daily"))
                .block_for(Duration::from_secs(600)),
        )
        .build()
        .unwrap();
    let base = serve_with_status(limit).await;
    for expected in [200, 200, 429] {
        let res = reqwest::get(format!("{base}/api/hello")).await.unwrap();
        assert_eq!(res.status(), expected);
    }
    let body = json_of(&format!("{base}/rate_limit")).await;
    for name in ["hourly", "daily"] {
        let quota = &body["resources"][name];
        assert_eq!(quota["remaining"], 0, "{name}: {body}");
    }
}

/// Where keys are not secrets, `authorize` decides who reads which key's status: the owner of
/// a merchant id reads its usage, anyone else gets `403` and learns nothing.
#[tokio::test]
async fn only_authorized_callers_read_a_keys_status() {
    use axum::routing::get_service;
    use tollgate::{Key, RequestInfo};
    let limit = RateLimitLayer::builder()
        .key(tollgate::key::Header::new("x-merchant-id"))
        .policy(Policy::new("api", Quota::per_hour(10).named("hourly")))
        .build()
        .unwrap();
    let owns = |req: &RequestInfo<'_>, key: &Key| {
        let token = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let merchant = match token {
            Some("Bearer nine") => "merchant-9",
            Some("Bearer ten") => "merchant-10",
            _ => return false,
        };
        Key::from_bytes(merchant).is_ok_and(|m| m.same_value(key))
    };
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .route_layer(limit.clone())
        .route(
            "/rate_limit",
            get_service(limit.status_service().authorize(owns)),
        );
    let base = format!("http://{}", support::serve(app).await);
    let client = reqwest::Client::new();
    let get = |path: &str, merchant: &str, token: Option<&str>| {
        let mut req = client
            .get(format!("{base}{path}"))
            .header("x-merchant-id", merchant);
        if let Some(token) = token {
            req = req.header("authorization", token);
        }
        req.send()
    };
    for _ in 0..3 {
        assert_eq!(
            get("/api/hello", "merchant-9", None)
                .await
                .unwrap()
                .status(),
            200
        );
    }
    let own = get("/rate_limit", "merchant-9", Some("Bearer nine"))
        .await
        .unwrap();
    assert_eq!(own.status(), 200);
    let body: serde_json::Value = own.json().await.unwrap();
    assert_eq!(body["resources"]["hourly"]["remaining"], 7, "{body}");
    for token in [Some("Bearer ten"), None] {
        let other = get("/rate_limit", "merchant-9", token).await.unwrap();
        assert_eq!(other.status(), 403, "{token:?}");
        let text = other.text().await.unwrap();
        assert!(!text.contains("remaining"), "{text}");
    }
}

/// The status endpoint reads the backend's clock, as the decision does: on a manual clock at
/// 2025-03-09 01:00 EST (the day New York moves to EDT), a `2/day tz America/New_York` quota's
/// `RateLimit` has `t=79200`, and the endpoint's `reset` is that clock's time plus 79 200 s, its
/// window that clock's day, not the real time's.
#[cfg(feature = "calendar")]
#[tokio::test]
async fn the_status_endpoint_reads_the_backends_clock() {
    let clock = ManualClock::new();
    // 67 days and 6 hours after 2025-01-01 00:00 UTC: 2025-03-09 06:00 UTC, 01:00 EST.
    let at = Duration::from_secs(67 * 86_400 + 6 * 3600);
    clock.advance(at);
    let quota: Quota = "2/day tz America/New_York".parse().unwrap();
    let limit = RateLimitLayer::builder()
        .key(tollgate::key::Header::new("x-api-key"))
        .policy(Policy::new("plan", quota))
        .backend(clock.backend())
        .build()
        .unwrap();
    let base = serve_with_status(limit).await;
    let client = reqwest::Client::new();
    let res = keyed(&client, &format!("{base}/api/hello")).await;
    let fields = Fields::of(&http_response(&res)).unwrap();
    let t = fields.rate_limit.unwrap().items[0].reset;
    assert_eq!(t, Some(Duration::from_secs(79_200)));
    let body: serde_json::Value = (keyed(&client, &format!("{base}/rate_limit")).await)
        .json()
        .await
        .unwrap();
    let plan = &body["resources"]["plan"];
    let now = (ManualClock::START + at).as_secs();
    assert_eq!(plan["reset"], now + 79_200, "{body}");
    assert_eq!(plan["remaining"], 1, "{body}");
    assert_eq!(
        plan["window_start"], "2025-03-09T00:00:00-05:00[America/New_York]",
        "{body}"
    );
    assert_eq!(
        plan["window_end"], "2025-03-10T00:00:00-04:00[America/New_York]",
        "{body}"
    );
}

/// The head of a reqwest response as an `http` one, for [`Fields::of`].
#[cfg(feature = "calendar")]
fn http_response(res: &reqwest::Response) -> http::Response<()> {
    let mut out = http::Response::new(());
    *out.headers_mut() = res.headers().clone();
    out
}
