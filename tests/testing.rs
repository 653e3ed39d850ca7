//! The test kit as a user's tests use it: an axum app behind the layer, a `ManualClock` driving
//! every algorithm of the local backend (GCRA, fixed and sliding windows, penalties), and the
//! rate-limit fields read back with `Fields`. No test here sleeps.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use axum::routing::get;
use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::testing::{Fields, ManualClock};
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::ServiceExt;

const SEC: Duration = Duration::from_secs(1);

/// A layer on `clock`, keyed globally.
fn limit(clock: &ManualClock, policy: Policy) -> RateLimitLayer<Global, LocalBackend<ManualClock>> {
    RateLimitLayer::builder()
        .backend(clock.backend())
        .key(Global)
        .policy(policy)
        .build()
        .unwrap()
}

fn app(clock: &ManualClock, policy: Policy) -> Router {
    Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(limit(clock, policy))
}

async fn call(app: &Router) -> (StatusCode, Fields) {
    let res: Response<Body> = app
        .clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    (res.status(), Fields::of(&res).unwrap())
}

/// Spends the quota until refused; returns how many were allowed and the refusal's fields.
async fn exhaust(app: &Router) -> (u32, Fields) {
    for allowed in 0..1000 {
        let (status, fields) = call(app).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            return (allowed, fields);
        }
        assert_eq!(status, StatusCode::OK);
    }
    panic!("never refused");
}

#[tokio::test]
async fn gcra_refills_as_the_clock_moves() {
    let clock = ManualClock::new();
    let app = app(&clock, Policy::new("api", Quota::per_second(5).burst(10)));
    let (status, first) = call(&app).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (first.remaining(), first.quota(), first.window()),
        (Some(9), Some(10), Some(2 * SEC))
    );
    let (allowed, refused) = exhaust(&app).await;
    assert_eq!(allowed, 9);
    assert_eq!(refused.retry_after, Some(SEC)); // 200 ms, rounded up
    assert_eq!(refused.remaining(), Some(0));

    clock.advance(Duration::from_millis(199));
    assert_eq!(call(&app).await.0, StatusCode::TOO_MANY_REQUESTS);
    clock.advance(Duration::from_millis(1));
    let (status, fields) = call(&app).await;
    assert_eq!((status, fields.remaining()), (StatusCode::OK, Some(0)));

    clock.advance(2 * SEC); // full again
    assert_eq!(call(&app).await.1.remaining(), Some(9));
    assert_eq!(clock.elapsed(), Duration::from_millis(2200));
}

#[tokio::test]
async fn a_fixed_window_resets_at_its_end() {
    let clock = ManualClock::new();
    let app = app(
        &clock,
        Policy::new("api", Quota::per_minute(3).fixed_window()),
    );
    let (allowed, refused) = exhaust(&app).await;
    assert_eq!(allowed, 3);
    // The clock starts on a window's first instant.
    assert_eq!(refused.retry_after, Some(60 * SEC));
    assert_eq!(refused.reset(), Some(60 * SEC));

    clock.advance(59 * SEC);
    let (status, fields) = call(&app).await;
    assert_eq!(
        (status, fields.retry_after),
        (StatusCode::TOO_MANY_REQUESTS, Some(SEC))
    );
    clock.advance(SEC);
    let (status, fields) = call(&app).await;
    assert_eq!((status, fields.remaining()), (StatusCode::OK, Some(2)));
}

#[tokio::test]
async fn a_sliding_window_lets_requests_back_as_the_last_window_slides_out() {
    let clock = ManualClock::new();
    let app = app(
        &clock,
        Policy::new("api", Quota::per_minute(4).sliding_window()),
    );
    assert_eq!(exhaust(&app).await.0, 4);
    // Right after the window ends the last one still weighs fully...
    clock.advance(60 * SEC);
    let (status, refused) = call(&app).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // ...and its `Retry-After` is honest: waiting that long is enough.
    clock.advance(refused.retry_after.unwrap());
    assert_eq!(call(&app).await.0, StatusCode::OK);
    // Two windows on, nothing is left of it.
    clock.advance(120 * SEC);
    assert_eq!(call(&app).await.1.remaining(), Some(3));
}

#[tokio::test]
async fn a_penalty_lasts_its_time_then_ends() {
    let clock = ManualClock::new();
    let app = app(
        &clock,
        Policy::new("login", Quota::per_minute(2)).block_for(Duration::from_secs(600)),
    );
    let (allowed, refused) = exhaust(&app).await;
    assert_eq!(allowed, 2);
    assert_eq!(refused.retry_after, Some(600 * SEC));
    // The quota alone would let a request in after 30 s; the block holds for its 10 minutes.
    clock.advance(300 * SEC);
    let (status, still) = call(&app).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(still.retry_after, Some(300 * SEC));
    clock.advance(300 * SEC);
    assert_eq!(call(&app).await.0, StatusCode::OK);
}

#[tokio::test]
async fn fields_name_each_quota_of_a_policy() {
    let clock = ManualClock::new();
    let app = app(
        &clock,
        Policy::new("api", Quota::per_second(10).named("burst")).and(Quota::per_hour(100)),
    );
    let (_, fields) = call(&app).await;
    let policy = fields.policy.as_ref().unwrap();
    assert_eq!(policy.items.len(), 2);
    assert_eq!(fields.rate_limit.as_ref().unwrap().items.len(), 2);
    assert_eq!(fields.remaining(), Some(9));
    let second = &fields.rate_limit.as_ref().unwrap().items[1];
    assert_eq!(fields.item(&second.policy), Some(second));
    assert_eq!(second.remaining, 99);
    assert_eq!(fields.item("no such policy"), None);
}

#[test]
fn invalid_fields_are_errors_and_absent_ones_none() {
    let res = |name: &str, value: &str| Response::builder().header(name, value).body(()).unwrap();
    assert!(Fields::of(&res("ratelimit", "\"api\";r=-1")).is_err());
    assert!(Fields::of(&res("ratelimit-policy", "not a list (")).is_err());
    assert!(Fields::of(&res("retry-after", "soon")).is_err());
    let none = Fields::of(&res("content-type", "text/plain")).unwrap();
    assert_eq!(none, Fields::default());
    assert_eq!(
        (none.remaining(), none.reset(), none.quota()),
        (None, None, None)
    );
}

#[tokio::test]
async fn a_backend_built_later_starts_where_the_clock_is() {
    // Windows stay aligned to the clock's start: a backend built 30 s in sees the first
    // window's second half.
    let clock = ManualClock::new();
    clock.advance(30 * SEC);
    let app = app(
        &clock,
        Policy::new("api", Quota::per_minute(1).fixed_window()),
    );
    assert_eq!(call(&app).await.0, StatusCode::OK);
    assert_eq!(call(&app).await.1.retry_after, Some(30 * SEC));
}

/// A refund goes to the window its request was admitted in, on the test's clock: a success
/// admitted in one minute and answered in the next gives nothing back to the next minute, so
/// three failures there use it up.
#[tokio::test]
async fn a_refund_is_timed_on_the_manual_clock() {
    use std::sync::Arc;
    use tollgate::settle::ChargeWhen;
    let clock = ManualClock::new();
    let policy = Policy::new("logins", "3/min fixed".parse::<Quota>().unwrap())
        .charge_when(ChargeWhen::status([401]));
    let limit = limit(&clock, policy);
    let (entered, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (inside, gate) = (entered.clone(), release.clone());
    let app = Router::new()
        .route(
            "/slow-success",
            get(move || {
                let (inside, gate) = (inside.clone(), gate.clone());
                async move {
                    inside.notify_one();
                    gate.notified().await;
                    "welcome"
                }
            }),
        )
        .route("/fail", get(|| async { StatusCode::UNAUTHORIZED }))
        .layer(limit);
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    clock.advance(Duration::from_secs(50));
    // Admitted at 0:50, answered at 1:05.
    let success = tokio::spawn(app.clone().oneshot(get("/slow-success")));
    entered.notified().await;
    clock.advance(Duration::from_secs(15));
    let fail = || async {
        app.clone()
            .oneshot(get("/fail"))
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    let mut seen = vec![fail().await, fail().await];
    release.notify_one();
    assert_eq!(success.await.unwrap().unwrap().status(), StatusCode::OK);
    seen.extend([fail().await, fail().await]);
    assert_eq!(seen, [401, 401, 401, 429]);
}
