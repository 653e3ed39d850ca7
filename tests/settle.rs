//! Settling after the response, over a real TCP listener, on a clock the test moves: failures
//! counted and successes refunded, costs read from the response (debit into debt, refund of
//! the difference), server errors free, cancelled requests by their rule, and stores that do
//! not settle yet refusing such policies when the layer is built (tests/redis.rs).

mod support;

use std::time::Duration;

use axum::extract::Query;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::{Router, routing::get, routing::post};
use governor::clock::FakeRelativeClock;
use tollgate::backend::LocalBackend;
use tollgate::key::Header;
use tollgate::settle::{Cancelled, ChargeWhen, CostFrom};
use tollgate::{Charge, Policy, Quota, RateLimitLayer};

/// Serves `app` limited by `policy` (keyed by `x-user`) on a fake clock.
async fn serve(policy: Policy, app: Router) -> (String, FakeRelativeClock) {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder().clock(clock.clone()).build();
    let limit = RateLimitLayer::builder()
        .key(Header::new("x-user"))
        .backend(backend)
        .policy(policy)
        .build()
        .unwrap();
    let addr = support::serve(app.route_layer(limit)).await;
    (format!("http://{addr}"), clock)
}

/// `POST /login` with `password`: 200 for `wonderland`, 401 otherwise.
fn login_app() -> Router {
    Router::new().route(
        "/login",
        post(|body: String| async move {
            if body == "wonderland" {
                StatusCode::OK
            } else {
                StatusCode::UNAUTHORIZED
            }
        }),
    )
}

async fn login(base: &str, user: &str, password: &'static str) -> (u16, Option<String>) {
    let res = reqwest::Client::new()
        .post(format!("{base}/login"))
        .header("x-user", user)
        .body(password)
        .send()
        .await
        .unwrap();
    let retry = res
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    (res.status().as_u16(), retry)
}

#[tokio::test]
async fn only_failed_logins_count_and_a_locked_key_is_refused_before_the_handler() {
    let policy = Policy::new("login", Quota::new(5, Duration::from_secs(900)))
        .charge_when(ChargeWhen::status([401, 403]));
    let (base, clock) = serve(policy, login_app()).await;
    // Successes are free, however many.
    for _ in 0..20 {
        assert_eq!(login(&base, "alice", "wonderland").await.0, 200);
    }
    for _ in 0..5 {
        assert_eq!(login(&base, "alice", "guess").await.0, 401);
    }
    // Five failures: refused, even with the right password, which is not checked.
    let (status, retry) = login(&base, "alice", "wonderland").await;
    assert_eq!(status, 429);
    assert_eq!(
        retry.as_deref(),
        Some("180"),
        "one failure's worth: 900 s / 5"
    );
    // Another user is untouched.
    assert_eq!(login(&base, "bob", "guess").await.0, 401);
    // One failure's time later, one attempt is back.
    clock.advance(Duration::from_secs(180));
    assert_eq!(login(&base, "alice", "wonderland").await.0, 200);
    assert_eq!(login(&base, "alice", "guess").await.0, 401);
    assert_eq!(login(&base, "alice", "wonderland").await.0, 429);
}

/// `POST /generate?tokens=N`: reports `N` in `x-tokens-used`, or as a [`Charge`] with
/// `ext=true`.
fn tokens_app() -> Router {
    #[derive(serde::Deserialize)]
    struct Q {
        tokens: u32,
        #[serde(default)]
        ext: bool,
    }
    Router::new().route(
        "/generate",
        post(|Query(q): Query<Q>| async move {
            let mut res = "generated".into_response();
            if q.ext {
                res.extensions_mut().insert(Charge(q.tokens));
            } else {
                res.headers_mut()
                    .insert("x-tokens-used", HeaderValue::from(q.tokens));
            }
            res
        }),
    )
}

async fn generate(base: &str, query: &str) -> (u16, HeaderMap) {
    let res = reqwest::Client::new()
        .post(format!("{base}/generate?{query}"))
        .header("x-user", "key-1")
        .send()
        .await
        .unwrap();
    (res.status().as_u16(), res.headers().clone())
}

#[tokio::test]
async fn a_reported_cost_is_debited_into_debt_and_repaid_over_time() {
    // 1000 tokens per minute: one token every 60 ms.
    let policy = Policy::new("tokens", Quota::per_minute(1000))
        .cost_from(CostFrom::header("x-tokens-used".parse().unwrap()));
    let (base, clock) = serve(policy, tokens_app()).await;
    assert_eq!(generate(&base, "tokens=600").await.0, 200);
    assert_eq!(generate(&base, "tokens=600").await.0, 200);
    // 1200 used of 1000: 200 tokens of debt, refused until repaid (12 s), and one more token
    // for the request itself.
    let (status, headers) = generate(&base, "tokens=1").await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "13", "{headers:?}");
    clock.advance(Duration::from_secs(12));
    assert_eq!(
        generate(&base, "tokens=1").await.0,
        429,
        "the debt is repaid, not the unit"
    );
    clock.advance(Duration::from_millis(60));
    assert_eq!(generate(&base, "tokens=1").await.0, 200);
}

#[tokio::test]
async fn a_smaller_reported_cost_refunds_the_difference() {
    // The estimate taken at admission is the request's cost (100); the response reports 1.
    let policy = Policy::new("tokens", Quota::per_day(1000))
        .cost(100)
        .cost_from(CostFrom::extension());
    let (base, _clock) = serve(policy, tokens_app()).await;
    for _ in 0..100 {
        assert_eq!(generate(&base, "tokens=1&ext=true").await.0, 200);
    }
    // 100 units used: 900 left, so nine requests of 100 pass at admission, not a tenth.
    for _ in 0..9 {
        assert_eq!(generate(&base, "tokens=100&ext=true").await.0, 200);
    }
    assert_eq!(generate(&base, "tokens=1&ext=true").await.0, 429);
}

#[tokio::test]
async fn a_response_without_a_reported_cost_keeps_the_estimate() {
    let policy = Policy::new("tokens", Quota::per_day(3))
        .cost_from(CostFrom::header("x-tokens-used".parse().unwrap()));
    let app = Router::new().route("/generate", post(|| async { "no header" }));
    let (base, _clock) = serve(policy, app).await;
    for _ in 0..3 {
        assert_eq!(generate(&base, "").await.0, 200);
    }
    assert_eq!(generate(&base, "").await.0, 429);
}

#[tokio::test]
async fn server_errors_are_refunded() {
    let policy = Policy::new("api", Quota::per_day(2)).charge_when(ChargeWhen::not_server_error());
    let app = Router::new().route(
        "/generate",
        post(
            |Query(q): Query<std::collections::HashMap<String, u16>>| async move {
                StatusCode::from_u16(q["status"]).unwrap()
            },
        ),
    );
    let (base, _clock) = serve(policy, app).await;
    for _ in 0..10 {
        assert_eq!(generate(&base, "status=503").await.0, 503);
    }
    assert_eq!(generate(&base, "status=200").await.0, 200);
    assert_eq!(generate(&base, "status=404").await.0, 404);
    assert_eq!(generate(&base, "status=503").await.0, 429);
}

/// A request whose future is dropped before the handler answers (a client that went away).
async fn cancelled(rule: Cancelled) -> Vec<u16> {
    let policy = Policy::new("api", Quota::per_day(1))
        .charge_when(ChargeWhen::status([200]))
        .on_cancel(rule);
    let app = Router::new()
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                "late"
            }),
        )
        .route("/fast", get(|| async { "ok" }));
    let (base, _clock) = serve(policy, app).await;
    let client = reqwest::Client::new();
    let slow = client
        .get(format!("{base}/slow"))
        .header("x-user", "u")
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(slow.is_err(), "the slow request times out on the client");
    // The server sees the connection close and drops the request's future.
    let mut seen = Vec::new();
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let res = client
            .get(format!("{base}/fast"))
            .header("x-user", "u")
            .send()
            .await
            .unwrap();
        seen.push(res.status().as_u16());
    }
    seen
}

#[tokio::test]
async fn a_cancelled_request_is_charged_by_default() {
    assert_eq!(cancelled(Cancelled::Charge).await, [429, 429]);
}

#[tokio::test]
async fn a_cancelled_request_can_be_refunded() {
    assert_eq!(cancelled(Cancelled::Refund).await, [200, 429]);
}

#[tokio::test]
async fn window_quotas_count_only_failures_too() {
    for quota in ["5/15min fixed", "5/15min sliding 1min"] {
        let policy = Policy::new("login", quota.parse::<Quota>().unwrap())
            .charge_when(ChargeWhen::status([401]));
        let (base, _clock) = serve(policy, login_app()).await;
        for _ in 0..10 {
            assert_eq!(login(&base, "alice", "wonderland").await.0, 200, "{quota}");
        }
        for _ in 0..5 {
            assert_eq!(login(&base, "alice", "guess").await.0, 401, "{quota}");
        }
        assert_eq!(login(&base, "alice", "wonderland").await.0, 429, "{quota}");
    }
}

#[tokio::test]
async fn a_debit_on_a_fixed_window_lasts_until_the_window_ends() {
    let policy = Policy::new("tokens", "1000/min fixed".parse::<Quota>().unwrap())
        .cost_from(CostFrom::header("x-tokens-used".parse().unwrap()));
    let (base, clock) = serve(policy, tokens_app()).await;
    assert_eq!(generate(&base, "tokens=1500").await.0, 200);
    let (status, headers) = generate(&base, "tokens=1").await;
    assert_eq!(status, 429);
    // The window ends on the minute (the fake clock starts at the epoch of the backend).
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{headers:?}");
    clock.advance(Duration::from_secs(retry));
    assert_eq!(generate(&base, "tokens=1").await.0, 200);
}

/// An inner service answering with an error instead of a response settles by the cancellation
/// rule (here: refunded), as a dropped request does.
#[tokio::test]
async fn an_inner_error_settles_by_the_cancellation_rule() {
    use tower::{Layer, Service, ServiceExt};
    for (rule, second) in [(Cancelled::Refund, true), (Cancelled::Charge, false)] {
        let layer = RateLimitLayer::builder()
            .key(tollgate::key::Global)
            .policy(
                Policy::new("api", Quota::per_day(1))
                    .charge_when(ChargeWhen::status([200]))
                    .on_cancel(rule),
            )
            .build()
            .unwrap();
        let mut svc = layer.layer(tower::service_fn(|_: http::Request<()>| async {
            Err::<http::Response<http_body_util::Full<bytes::Bytes>>, _>("inner failure")
        }));
        let first = svc
            .ready()
            .await
            .unwrap()
            .call(http::Request::new(()))
            .await;
        assert_eq!(first.unwrap_err(), "inner failure");
        let again = svc
            .ready()
            .await
            .unwrap()
            .call(http::Request::new(()))
            .await;
        // Refunded: the next request is admitted (and fails inside again); charged: refused.
        assert_eq!(again.is_err(), second, "{rule:?}");
    }
}

/// The settlement rules in a policy's table, as in a rules file: read, applied and written
/// back; mistakes named.
#[cfg(feature = "serde")]
#[tokio::test]
async fn settlement_rules_in_config() {
    let policy: Policy = toml::from_str(
        r#"
        name = "login"
        quotas = ["5/15min"]
        charge_when = [401, 403]
        on_cancel = "refund"
        "#,
    )
    .unwrap();
    assert!(policy.settles());
    // Round trip.
    let text = toml::to_string(&policy).unwrap();
    assert!(
        text.contains("charge_when = [401, 403]") && text.contains("on_cancel = \"refund\""),
        "{text}"
    );
    // Applied: failures count, successes do not.
    let (base, _clock) = serve(policy, login_app()).await;
    for _ in 0..10 {
        assert_eq!(login(&base, "alice", "wonderland").await.0, 200);
    }
    for _ in 0..5 {
        assert_eq!(login(&base, "alice", "guess").await.0, 401);
    }
    assert_eq!(login(&base, "alice", "wonderland").await.0, 429);

    for (table, cost_from) in [
        (
            r#"cost_from = "header x-tokens-used""#,
            "header x-tokens-used",
        ),
        (r#"cost_from = "extension""#, "extension"),
        (
            r#"cost_from = "trailer x-tokens-used""#,
            "trailer x-tokens-used",
        ),
        (r#"cost_from = "response bytes""#, "response bytes"),
    ] {
        let p: Policy =
            toml::from_str(&format!("name = \"t\"\nquotas = [\"1000/min\"]\n{table}")).unwrap();
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["cost_from"], cost_from);
        assert!(json.get("charge_when").is_none() && json.get("on_cancel").is_none());
    }
    let p: Policy =
        serde_json::from_str(r#"{"name": "api", "quotas": ["10/s"], "charge_when": "not 5xx"}"#)
            .unwrap();
    assert_eq!(serde_json::to_value(&p).unwrap()["charge_when"], "not 5xx");
    let p: Policy = serde_json::from_str(
        r#"{"name": "login", "quotas": ["5/min"], "charge_when": "grpc 16 7"}"#,
    )
    .unwrap();
    assert_eq!(
        serde_json::to_value(&p).unwrap()["charge_when"],
        "grpc 16 7"
    );

    let err = |text: &str| {
        toml::from_str::<Policy>(&format!("name = \"p\"\nquotas = [\"5/min\"]\n{text}"))
            .unwrap_err()
            .to_string()
    };
    assert!(err("charge_when = [401, 700]").contains("700 is not an HTTP status code"));
    assert!(err("charge_when = []").contains("matches no response"));
    assert!(err(r#"charge_when = "5xx""#).contains(r#"expected a list of status codes"#));
    assert!(err(r#"cost_from = "body bytes""#).contains(r#"expected "header <name>""#));
    assert!(err(r#"charge_when = "grpc 16 99""#).contains("99"));
    assert!(err(r#"cost_from = "header bad name""#).contains("expected \"header <name>\""));
    assert!(err(r#"on_cancel = "forgive""#).contains(r#"expected "charge" or "refund""#));
    assert!(err(r#"on_cancel = "refund""#).contains("applies to policies that settle"));
    // A predicate cannot be written.
    let closure = Policy::new("p", Quota::per_minute(5))
        .charge_when(ChargeWhen::predicate(|r| r.status().is_client_error()));
    assert!(
        toml::to_string(&closure)
            .unwrap_err()
            .to_string()
            .contains("predicate")
    );
}

/// Concurrent failures on one key: exactly the budget reaches the handler, whatever the
/// interleaving of admissions and settlements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_failures_spend_exactly_the_budget() {
    let policy = Policy::new("login", Quota::new(5, Duration::from_secs(900)))
        .charge_when(ChargeWhen::status([401]));
    let (base, _clock) = serve(policy, login_app()).await;
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let base = base.clone();
            // Every other one with the right password: refunded, if admitted.
            let password = if i % 2 == 0 { "guess" } else { "wonderland" };
            tokio::spawn(async move { login(&base, "alice", password).await.0 })
        })
        .collect();
    let mut seen = std::collections::HashMap::new();
    for t in tasks {
        *seen.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    let failures = seen.get(&401).copied().unwrap_or(0);
    assert!(failures <= 5, "{seen:?}");
    // Whatever passed, exactly 5 failures are counted in all: the rest of the budget is gone
    // once the remaining failures are tried one by one.
    let mut more = 0;
    while login(&base, "alice", "guess").await.0 == 401 {
        more += 1;
        assert!(more <= 5, "{seen:?}");
    }
    assert_eq!(failures + more, 5, "{seen:?}");
}

async fn get_status(base: &str) -> (u16, HeaderMap) {
    let res = reqwest::Client::new()
        .get(format!("{base}/"))
        .header("x-user", "u")
        .send()
        .await
        .unwrap();
    (res.status().as_u16(), res.headers().clone())
}

#[tokio::test]
async fn a_refused_key_is_blocked_for_the_penalty() {
    let policy = Policy::new("api", Quota::per_second(2)).block_for(Duration::from_secs(60));
    let app = Router::new().route("/", get(|| async { "ok" }));
    let (base, clock) = serve(policy, app).await;
    assert_eq!(get_status(&base).await.0, 200);
    assert_eq!(get_status(&base).await.0, 200);
    let (status, headers) = get_status(&base).await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "60");
    assert_eq!(headers["ratelimit"], r#""api";r=0;t=60"#);
    // Half a minute on, the quota is full again but the key is still blocked.
    clock.advance(Duration::from_secs(30));
    let (status, headers) = get_status(&base).await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "30");
    clock.advance(Duration::from_secs(30));
    assert_eq!(get_status(&base).await.0, 200);
}

#[cfg(feature = "serde")]
#[test]
fn penalties_in_config() {
    let policy: Policy =
        serde_json::from_str(r#"{"name":"api","quotas":["2/s"],"block_for":"15min"}"#).unwrap();
    assert_eq!(policy.block(), Some(Duration::from_secs(900)));
    let back = serde_json::to_string(&policy).unwrap();
    assert!(back.contains(r#""block_for":"15min""#), "{back}");
    let err = serde_json::from_str::<Policy>(r#"{"name":"api","quotas":["2/s"],"block_for":"15"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no unit"), "{err}");
    for (policy, why) in [
        (
            Policy::new("api", Quota::per_second(2))
                .block_for(Duration::from_secs(60))
                .shadow(true),
            "shadow",
        ),
        (
            Policy::new("api", Quota::per_second(2)).block_for(Duration::ZERO),
            "milliseconds",
        ),
        (
            Policy::new("api", Quota::per_second(2)).block_for(Duration::from_secs(400 * 86_400)),
            "a year",
        ),
    ] {
        let err = policy.validate().unwrap_err().to_string();
        assert!(err.contains(why) && err.contains("block_for"), "{err}");
    }
}

/// A body of `n` bytes in chunks of 100, streamed.
fn streamed(n: usize) -> axum::body::Body {
    let chunks = (0..n.div_ceil(100)).map(move |i| {
        let len = (n - i * 100).min(100);
        Ok::<_, std::convert::Infallible>(bytes::Bytes::from(vec![b'x'; len]))
    });
    axum::body::Body::from_stream(tokio_stream::iter(chunks))
}

#[tokio::test]
async fn a_content_bytes_quota_charges_the_bytes_sent() {
    // 1000 bytes an hour, charged what each response's body turns out to be.
    let policy =
        Policy::new("bytes", Quota::per_hour(1000).bytes()).cost_from(CostFrom::response_bytes());
    let app = Router::new().route(
        "/download",
        get(
            |Query(q): Query<std::collections::HashMap<String, usize>>| async move {
                streamed(q.get("n").copied().unwrap_or(0))
            },
        ),
    );
    let (base, _clock) = serve(policy, app).await;
    let fetch = |n: usize| {
        let url = format!("{base}/download?n={n}");
        async move {
            let res = reqwest::Client::new()
                .get(url)
                .header("x-user", "u")
                .send()
                .await
                .unwrap();
            let status = res.status().as_u16();
            let body = res.bytes().await.unwrap();
            (status, body.len())
        }
    };
    assert_eq!(fetch(450).await, (200, 450));
    assert_eq!(fetch(450).await, (200, 450));
    // 900 of 1000 spent (each admitted at 1, then charged its bytes): 100 left.
    let (status, headers) = get_status_of(&base, "/download?n=1").await;
    assert_eq!(status, 200);
    assert_eq!(headers["ratelimit"], r#""bytes";r=99;t=4"#);
    assert_eq!(
        headers["ratelimit-policy"],
        r#""bytes";q=1000;qu="content-bytes";w=3600"#
    );
    assert_eq!(fetch(500).await, (200, 500));
    // Now in debt.
    assert_eq!(fetch(1).await.0, 429);
}

async fn get_status_of(base: &str, path: &str) -> (u16, HeaderMap) {
    let res = reqwest::Client::new()
        .get(format!("{base}{path}"))
        .header("x-user", "u")
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    res.bytes().await.unwrap();
    (status, headers)
}

#[tokio::test]
async fn a_cost_in_a_trailer_is_charged_when_the_body_ends() {
    use http_body_util::StreamBody;
    let policy = Policy::new("tokens", Quota::per_hour(100)).cost_from(CostFrom::trailer(
        http::HeaderName::from_static("x-tokens-used"),
    ));
    let app = Router::new().route(
        "/generate",
        get(|| async {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("x-tokens-used", http::HeaderValue::from_static("60"));
            let frames = [
                Ok::<_, std::convert::Infallible>(http_body::Frame::data(
                    bytes::Bytes::from_static(b"some tokens"),
                )),
                Ok(http_body::Frame::trailers(trailers)),
            ];
            axum::body::Body::new(StreamBody::new(tokio_stream::iter(frames)))
        }),
    );
    let (base, _clock) = serve(policy, app).await;
    assert_eq!(get_status_of(&base, "/generate").await.0, 200);
    // 60 charged: 40 left, and this one takes 1 at admission.
    let (status, headers) = get_status_of(&base, "/generate").await;
    assert_eq!(status, 200);
    assert_eq!(headers["ratelimit"], r#""tokens";r=39;t=36"#);
    // 120 of 100: in debt.
    assert_eq!(get_status_of(&base, "/generate").await.0, 429);
}

/// A response whose body the client abandons after `seen` bytes, under `rule`; then the
/// `RateLimit` of the next request.
async fn abandoned(rule: Cancelled) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Charged the bytes sent when the body ends; by `rule` when it does not.
    let policy = Policy::new("bytes", Quota::per_hour(1000))
        .cost_from(CostFrom::response_bytes())
        .on_cancel(rule);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::convert::Infallible>>(1);
    let rx = std::sync::Arc::new(tokio::sync::Mutex::new(Some(rx)));
    let app = Router::new()
        .route(
            "/slow",
            get(move || {
                let rx = rx.clone();
                async move {
                    let rx = rx.lock().await.take().unwrap();
                    axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                }
            }),
        )
        .route("/fast", get(|| async { "ok" }));
    let (base, _clock) = serve(policy, app).await;
    // A raw client that reads the head and 500 bytes of the body, then hangs up.
    let mut conn = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    conn.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\nx-user: u\r\n\r\n")
        .await
        .unwrap();
    tx.send(Ok(bytes::Bytes::from(vec![b'x'; 500])))
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let mut seen = 0;
    while seen < 500 {
        seen += conn.read(&mut buf).await.unwrap();
    }
    drop(conn);
    // The server drops the body once it sees the connection closed.
    tx.closed().await;
    let (status, headers) = get_status_of(&base, "/fast").await;
    assert_eq!(status, 200);
    headers["ratelimit"].to_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_body_dropped_before_its_end_settles_by_the_cancellation_rule() {
    // Refunded: only this request's admission is taken.
    assert_eq!(abandoned(Cancelled::Refund).await, r#""bytes";r=999;t=4"#);
    // Charged what was taken at admission (1), not the bytes it had sent.
    assert_eq!(abandoned(Cancelled::Charge).await, r#""bytes";r=998;t=4"#);
}

#[cfg(feature = "serde")]
#[test]
fn content_length_costs_in_config() {
    let policy: Policy = toml::from_str(
        "name = \"uploads\"\nquotas = [\"100000/h bytes\"]\ncost = \"content-length or 50000\"",
    )
    .unwrap();
    let back = toml::to_string(&policy).unwrap();
    assert!(
        back.contains(r#"cost = "content-length or 50000""#),
        "{back}"
    );
    let plain: Policy = toml::from_str("name = \"api\"\nquotas = [\"10/s\"]\ncost = 3").unwrap();
    assert!(toml::to_string(&plain).unwrap().contains("cost = 3"));
    let err = |cost: &str| {
        toml::from_str::<Policy>(&format!(
            "name = \"p\"\nquotas = [\"5/min\"]\ncost = {cost}"
        ))
        .unwrap_err()
        .to_string()
    };
    assert!(err(r#""content-length""#).contains("content-length or N"));
    assert!(err(r#""content-length or lots""#).contains("content-length or N"));
    assert!(err(r#""body""#).contains("a number of units"));
    assert!(err("-1").contains("a number of units"));
}

/// Uploads charged their `Content-Length` on a byte quota, over HTTP: the field says
/// `qu="content-bytes"`, and an upload of unstated size costs what the policy says.
#[tokio::test]
async fn uploads_cost_their_content_length() {
    let limit = RateLimitLayer::builder()
        .key(Header::new("x-api-key"))
        .policy(Policy::new("uploads", Quota::per_hour(1000).bytes()).cost_from_content_length(800))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/upload",
            post(|body: axum::body::Bytes| async move { body.len().to_string() }),
        )
        .layer(limit);
    let base = format!("http://{}", support::serve(app).await);
    let client = reqwest::Client::new();
    let upload = |key: &'static str, body: reqwest::Body| {
        client
            .post(format!("{base}/upload"))
            .header("x-api-key", key)
            .body(body)
            .send()
    };
    let first = upload("k1", vec![0u8; 600].into()).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["ratelimit"], r#""uploads";r=400;t=4"#);
    assert!(
        (first.headers()["ratelimit-policy"].to_str().unwrap()).contains(r#"qu="content-bytes""#)
    );
    // 600 more do not fit in the 400 left; 400 do.
    let refused = upload("k1", vec![0u8; 600].into()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        upload("k1", vec![0u8; 400].into()).await.unwrap().status(),
        200
    );
    // A chunked body states no length: it costs the policy's 800.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    conn.write_all(
        b"POST /upload HTTP/1.1\r\nhost: x\r\nx-api-key: k2\r\ntransfer-encoding: chunked\r\n\
          connection: close\r\n\r\na\r\n0123456789\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("ratelimit: \"uploads\";r=200;t=4"),
        "{answer}"
    );
}

/// A layer on the local backend, keyed globally.
fn local_layer(
    policy: Policy,
) -> RateLimitLayer<tollgate::key::Global, LocalBackend<FakeRelativeClock>> {
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    RateLimitLayer::builder()
        .key(tollgate::key::Global)
        .backend(backend)
        .policy(policy)
        .build()
        .unwrap()
}

/// A service answering `respond()` to every request.
fn answering<B, F>(
    respond: F,
) -> impl tower::Service<
    http::Request<String>,
    Response = http::Response<B>,
    Error = std::convert::Infallible,
    Future: Send,
> + Clone
where
    F: Fn() -> http::Response<B> + Clone + Send + 'static,
{
    tower::service_fn(move |_req: http::Request<String>| {
        let respond = respond.clone();
        async move { Ok::<_, std::convert::Infallible>(respond()) }
    })
}

/// A layer over a service answering `respond()`, on the local backend, keyed globally.
fn layered<B, F>(
    policy: Policy,
    respond: F,
) -> impl tower::Service<
    http::Request<String>,
    Response = http::Response<B>,
    Error = std::convert::Infallible,
> + Clone
where
    B: tollgate::body::RateLimitBody + Send + 'static,
    F: Fn() -> http::Response<B> + Clone + Send + 'static,
{
    tower::Layer::layer(&local_layer(policy), answering(respond))
}

/// The same with `wrap_body`.
fn wrapped<B, F>(
    policy: Policy,
    respond: F,
) -> impl tower::Service<
    http::Request<String>,
    Response = http::Response<tollgate::body::ResponseBody<B>>,
    Error = std::convert::Infallible,
> + Clone
where
    B: http_body::Body + Send + 'static,
    F: Fn() -> http::Response<B> + Clone + Send + 'static,
{
    tower::Layer::layer(&local_layer(policy).wrap_body(), answering(respond))
}

/// The statuses of `n` requests through `svc`, each response then given to `end`.
async fn statuses<S, B>(svc: &S, n: usize, end: impl Fn(http::Response<B>)) -> Vec<u16>
where
    S: tower::Service<http::Request<String>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let mut seen = Vec::new();
    for _ in 0..n {
        let res = svc
            .clone()
            .oneshot(http::Request::new(String::new()))
            .await
            .unwrap();
        seen.push(res.status().as_u16());
        end(res);
    }
    seen
}

/// A handler answering `Full<Bytes>` (a body that cannot hold the guard, finished with its
/// head) is charged its bytes, not nothing.
#[tokio::test]
async fn a_full_body_is_charged_its_bytes() {
    use http_body_util::Full;
    let policy =
        Policy::new("bytes", Quota::per_hour(1000).bytes()).cost_from(CostFrom::response_bytes());
    let svc = layered(policy, || {
        http::Response::new(Full::new(bytes::Bytes::from(vec![b'x'; 450])))
    });
    // 450 + 450 + 450 of 1000: the third goes into debt, the fourth is refused.
    assert_eq!(statuses(&svc, 4, drop).await, [200, 200, 200, 429]);
}

/// An empty body has ended, whether or not the server polls it (hyper drops an empty body
/// unpolled): a gRPC answer with `grpc-status: 0` and no body is free under a policy that
/// charges failures only, with `wrap_body` and through its conversion to axum's body.
#[tokio::test]
async fn an_empty_body_dropped_unpolled_has_ended_not_been_cancelled() {
    use http_body_util::Full;
    let policy =
        || Policy::new("grpc", Quota::per_minute(3)).charge_when(ChargeWhen::grpc_status([16]));
    fn ok<B>(body: B) -> http::Response<B> {
        let mut res = http::Response::new(body);
        res.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("0"));
        res
    }
    // With `wrap_body`, an empty `Full`.
    let wrapped = wrapped(policy(), || ok(Full::new(bytes::Bytes::new())));
    let seen = statuses(&wrapped, 5, drop).await;
    assert_eq!(seen, [200; 5], "wrap_body");
    // Converted to axum's body, then dropped unpolled.
    let converted = self::wrapped(policy(), || ok(axum::body::Body::empty()));
    let seen = statuses(&converted, 5, |res| drop(res.map(axum::body::Body::from))).await;
    assert_eq!(seen, [200; 5], "wrap_body, converted to axum's body");
}

/// A request of cost 0 is still a request where its policy holds slots or settles: it holds a
/// slot of a concurrent quota (the unit it is admitted at goes back when it ends), and its
/// response's reported cost is charged.
#[tokio::test]
async fn a_request_of_cost_zero_holds_its_slot_and_settles() {
    use std::sync::Arc;
    use tower::ServiceExt;
    // A slot whatever the cost: a second free request waits for the first's slot.
    let policy = Policy::new("free-slots", Quota::concurrent(1))
        .and(Quota::per_hour(10))
        .cost(0);
    let (entered, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let layer = local_layer(policy);
    let (inside, gate) = (entered.clone(), release.clone());
    let svc = tower::Layer::layer(
        &layer,
        tower::service_fn(move |_req: http::Request<String>| {
            let (inside, gate) = (inside.clone(), gate.clone());
            async move {
                inside.notify_one();
                gate.notified().await;
                Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
            }
        }),
    );
    let first = tokio::spawn(svc.clone().oneshot(http::Request::new(String::new())));
    entered.notified().await;
    let second = svc.clone().oneshot(http::Request::new(String::new()));
    let second = tokio::time::timeout(Duration::from_secs(5), second).await;
    let second = second
        .expect("refused at once, not let in beside the first")
        .unwrap();
    assert_eq!(second.status(), 429, "the slot is held by the first");
    release.notify_one();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), 200);
    drop(first);
    let third = tokio::spawn(svc.clone().oneshot(http::Request::new(String::new())));
    entered.notified().await;
    release.notify_one();
    let third = third.await.unwrap().unwrap();
    // The hourly quota has 9 left while this one runs: the first's unit came back.
    let field = third.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(field.contains(r#""free-slots-1";r=9;"#), "{field}");

    // Charged what the response reports, nothing up front: 60 tokens a response, 100 an hour.
    let policy = Policy::new("tokens", Quota::per_hour(100))
        .cost(0)
        .cost_from(CostFrom::header(http::HeaderName::from_static("x-tokens")));
    let svc = layered(policy, || {
        let mut res = http::Response::new(axum::body::Body::empty());
        res.headers_mut()
            .insert("x-tokens", HeaderValue::from_static("60"));
        res
    });
    // 60, then 120 (into debt), then refused.
    assert_eq!(statuses(&svc, 3, drop).await, [200, 200, 429]);
}

/// A request without a body under `cost_from_content_length` costs 0 and still holds its slot.
#[tokio::test]
async fn a_get_without_a_body_holds_its_slot_under_a_byte_quota() {
    use tower::ServiceExt;
    let policy = Policy::new("uploads", Quota::concurrent(1))
        .and(Quota::per_minute(1_000_000).bytes())
        .cost_from_content_length(0);
    let svc = layered(policy, || http::Response::new(streamed(300)));
    let held = svc
        .clone()
        .oneshot(http::Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    // Its body not read yet: the slot is held.
    let refused = svc
        .clone()
        .oneshot(http::Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    drop(held);
    let after = svc
        .clone()
        .oneshot(http::Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(after.status(), 200);
}
