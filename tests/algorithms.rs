//! The three algorithms through the layer, over a real TCP listener, as a client sees them:
//! `RateLimit-Policy`, `RateLimit`, `Retry-After` and the status, step by step on a clock the
//! test moves. Windows are aligned to the Unix epoch of the backend's clock (here: zero at the
//! start of the test).

mod support;

use std::time::Duration;

use axum::{Router, routing::get};
use governor::clock::FakeRelativeClock;
use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};

/// Serves `/` limited by `policy` on a fake clock; returns the URL and the clock.
async fn serve(policy: Policy) -> (String, FakeRelativeClock) {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder()
        .clock(clock.clone())
        .clock_epoch(Duration::ZERO)
        .build();
    let limit = RateLimitLayer::builder()
        .key(Global)
        .backend(backend)
        .policy(policy)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(limit);
    let addr = support::serve(app).await;
    (format!("http://{addr}/"), clock)
}

/// `(status, RateLimit, Retry-After)` of one request.
async fn get_once(url: &str) -> (u16, String, Option<u64>) {
    let res = reqwest::get(url).await.unwrap();
    let h = res.headers();
    (
        res.status().as_u16(),
        h.get("ratelimit")
            .map_or(String::new(), |v| v.to_str().unwrap().to_owned()),
        h.get("retry-after")
            .map(|v| v.to_str().unwrap().parse().unwrap()),
    )
}

async fn policy_header(url: &str) -> String {
    let res = reqwest::get(url).await.unwrap();
    res.headers()["ratelimit-policy"]
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn fixed_windows_reset_on_the_boundary() {
    let (url, clock) = serve(Policy::new(
        "api",
        Quota::new(3, Duration::from_secs(10)).fixed_window(),
    ))
    .await;
    clock.advance(Duration::from_secs(20));
    assert_eq!(policy_header(&url).await, r#""api";q=3;w=10"#);
    assert_eq!(
        get_once(&url).await,
        (200, r#""api";r=1;t=10"#.into(), None)
    );
    assert_eq!(
        get_once(&url).await,
        (200, r#""api";r=0;t=10"#.into(), None)
    );
    // The window is full until its end: Retry-After is the boundary.
    assert_eq!(
        get_once(&url).await,
        (429, r#""api";r=0;t=10"#.into(), Some(10))
    );
    clock.advance(Duration::from_millis(9_500));
    assert_eq!(
        get_once(&url).await,
        (429, r#""api";r=0;t=1"#.into(), Some(1))
    );
    // The last unit just before the boundary is refused; just after, a full window.
    clock.advance(Duration::from_millis(499));
    assert_eq!(get_once(&url).await.0, 429);
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        get_once(&url).await,
        (200, r#""api";r=2;t=10"#.into(), None)
    );
    assert_eq!(get_once(&url).await.0, 200);
    assert_eq!(get_once(&url).await.0, 200);
    assert_eq!(get_once(&url).await.0, 429);
}

#[tokio::test]
async fn sliding_windows_weigh_the_previous_window() {
    let (url, clock) = serve(Policy::new("api", Quota::per_second(10).sliding_window())).await;
    clock.advance(Duration::from_secs(5));
    // policy_header spends one request.
    assert_eq!(policy_header(&url).await, r#""api";q=10;w=1"#);
    for _ in 0..9 {
        assert_eq!(get_once(&url).await.0, 200);
    }
    // The ten count in full until this second ends, then slide out over the next one: one
    // more fits 0.1 s into it, 1.1 s from now.
    assert_eq!(
        get_once(&url).await,
        (429, r#""api";r=0;t=2"#.into(), Some(2))
    );
    // 25 % into the next second, 7.5 of the ten still count.
    clock.advance(Duration::from_millis(1250));
    assert_eq!(get_once(&url).await, (200, r#""api";r=1;t=1"#.into(), None));
    assert_eq!(get_once(&url).await, (200, r#""api";r=0;t=1"#.into(), None));
    // 9.5 counted: one more fits in 50 ms (Retry-After rounds up to 1).
    assert_eq!(
        get_once(&url).await,
        (429, r#""api";r=0;t=1"#.into(), Some(1))
    );
    clock.advance(Duration::from_millis(50));
    assert_eq!(get_once(&url).await.0, 200);
}

/// 100 per minute at a 5 s resolution: twelve counts, the oldest weighted by its overlap.
#[tokio::test]
async fn sliding_windows_with_sub_windows() {
    let quota = Quota::per_minute(100)
        .sliding_window()
        .resolution(Duration::from_secs(5));
    let (url, clock) = serve(Policy::new("api", quota)).await;
    clock.advance(Duration::from_secs(600));
    assert_eq!(policy_header(&url).await, r#""api";q=100;w=60"#);
    for _ in 0..99 {
        assert_eq!(get_once(&url).await.0, 200);
    }
    let (status, ratelimit, retry) = get_once(&url).await;
    // All hundred sit in the sub-window 600-605 s, which leaves the window from 660 s to
    // 665 s: the first unit is back 660.05 s, 60.05 s from now.
    assert_eq!((status, retry), (429, Some(61)));
    assert_eq!(ratelimit, r#""api";r=0;t=61"#);
    clock.advance(Duration::from_millis(60_050));
    assert_eq!(get_once(&url).await, (200, r#""api";r=0;t=1"#.into(), None));
}

/// One policy mixing all three: each quota's item tells its own truth, and a 429 lists the one
/// that refused.
#[tokio::test]
async fn one_policy_mixes_algorithms() {
    let policy = Policy::new("mix", Quota::per_second(5).burst(5))
        .and(Quota::new(6, Duration::from_secs(60)).fixed_window())
        .and(Quota::per_minute(100).sliding_window());
    let (url, clock) = serve(policy).await;
    clock.advance(Duration::from_secs(120));
    assert_eq!(
        policy_header(&url).await,
        r#""mix-0";q=5;w=1, "mix-1";q=6;w=60, "mix-2";q=100;w=60"#
    );
    assert_eq!(
        get_once(&url).await,
        // The sliding window's two count in full for this minute; one of them has slid out
        // half way through the next: 90 s.
        (
            200,
            r#""mix-0";r=3;t=1, "mix-1";r=4;t=60, "mix-2";r=98;t=90"#.into(),
            None
        )
    );
    for _ in 0..4 {
        clock.advance(Duration::from_secs(1));
        assert_eq!(get_once(&url).await.0, 200);
    }
    // Six in this minute: the fixed window refuses until the minute ends.
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        get_once(&url).await,
        (429, r#""mix-1";r=0;t=55"#.into(), Some(55))
    );
}
