//! What the rate-limit fields say, response after response: one meaning of `t` (the time until
//! more quota is available), `Retry-After` never earlier than a `t` it comes with, the real
//! state of a bucket a request can never fit, and nothing for shadow policies.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use governor::clock::FakeRelativeClock;
use http::{Request, Response};
use http_body_util::Full;
use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

type Svc = tollgate::RateLimit<
    tower::util::ServiceFn<
        fn(Request<Full<Bytes>>) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>,
    >,
    Global,
    LocalBackend<FakeRelativeClock>,
>;

fn ok(_req: Request<Full<Bytes>>) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>> {
    std::future::ready(Ok(Response::new(Full::default())))
}

/// A service limited by `policy`, on a clock the test moves.
fn service(policy: Policy) -> (Svc, FakeRelativeClock) {
    let clock = FakeRelativeClock::default();
    let layer = RateLimitLayer::builder()
        .key(Global)
        .backend(LocalBackend::builder().clock(clock.clone()).build())
        .policy(policy)
        .build()
        .unwrap();
    let inner = tower::service_fn(ok as fn(_) -> _);
    (layer.layer(inner), clock)
}

struct Seen {
    status: u16,
    ratelimit: Option<String>,
    retry_after: Option<u64>,
}

async fn send(svc: &mut Svc) -> Seen {
    let req = Request::get("/").body(Full::default()).unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    let h = res.headers();
    Seen {
        status: res.status().as_u16(),
        ratelimit: h.get("ratelimit").map(|v| v.to_str().unwrap().to_owned()),
        retry_after: h
            .get("retry-after")
            .map(|v| v.to_str().unwrap().parse().unwrap()),
    }
}

/// Every `t=` in a `RateLimit` value.
fn resets(value: &str) -> Vec<u64> {
    value
        .split(',')
        .map(|item| {
            let t = item.split(";t=").nth(1).unwrap();
            t.trim().parse().unwrap()
        })
        .collect()
}

/// With 60/min, the 60th response and the 61st (a 429) agree: one unit comes back in a second.
#[tokio::test]
async fn t_means_the_same_on_allowed_and_denied_responses() {
    let (mut svc, clock) = service(Policy::new("api", Quota::per_minute(60)));
    let first = send(&mut svc).await;
    assert_eq!(first.ratelimit.as_deref(), Some(r#""api";r=59;t=1"#));
    for _ in 1..59 {
        send(&mut svc).await;
    }
    let last = send(&mut svc).await;
    assert_eq!(last.status, 200);
    assert_eq!(last.ratelimit.as_deref(), Some(r#""api";r=0;t=1"#));
    let denied = send(&mut svc).await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.ratelimit.as_deref(), Some(r#""api";r=0;t=1"#));
    assert_eq!(denied.retry_after, Some(1));
    // Half a second on, the next unit is half a second away: rounded up, still 1.
    clock.advance(Duration::from_millis(500));
    let denied = send(&mut svc).await;
    assert_eq!(denied.ratelimit.as_deref(), Some(r#""api";r=0;t=1"#));
    // A full bucket has nothing more to come: t=0.
    clock.advance(Duration::from_secs(120));
    let fresh = send(&mut svc).await;
    assert_eq!(fresh.ratelimit.as_deref(), Some(r#""api";r=59;t=1"#));
}

/// `[100/h, 1/s burst 1]`: a 429 lists the quota that refused, whose `t` is not after
/// `Retry-After`; the hourly quota's `t` (36 s) would have been.
#[tokio::test]
async fn retry_after_is_never_earlier_than_a_t_it_comes_with() {
    let policy = Policy::new("p", Quota::per_hour(100)).and(Quota::per_second(1).burst(1));
    let (mut svc, clock) = service(policy);
    let ok = send(&mut svc).await;
    assert_eq!(
        ok.ratelimit.as_deref(),
        Some(r#""p-0";r=99;t=36, "p-1";r=0;t=1"#)
    );
    let denied = send(&mut svc).await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.ratelimit.as_deref(), Some(r#""p-1";r=0;t=1"#));
    assert_eq!(denied.retry_after, Some(1));
    // Over many steps of the clock, every 429's Retry-After is at least each of its t.
    for step in 0..200u64 {
        clock.advance(Duration::from_millis(137 * (step % 11)));
        let seen = send(&mut svc).await;
        if let Some(retry) = seen.retry_after {
            for t in resets(seen.ratelimit.as_deref().unwrap()) {
                assert!(retry >= t, "step {step}: Retry-After {retry} < t={t}");
            }
        }
    }
}

/// A cost above the burst reports the bucket as it is (not "empty, resets now") and says the
/// request will never pass: 413, no `Retry-After`.
#[tokio::test]
async fn a_cost_above_the_burst_reports_the_real_state() {
    let (mut svc, _clock) = service(
        Policy::new("c", Quota::per_second(10))
            .cost_fn(|req| if req.uri().path() == "/big" { 11 } else { 1 }),
    );
    send(&mut svc).await;
    send(&mut svc).await;
    let req = Request::get("/big").body(Full::default()).unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), 413);
    assert!(res.headers().get("retry-after").is_none());
    assert_eq!(res.headers()["ratelimit"], r#""c";r=8;t=1"#);
    // Nothing was taken.
    assert_eq!(
        send(&mut svc).await.ratelimit.as_deref(),
        Some(r#""c";r=7;t=1"#)
    );
}

/// A shadow policy is not enforced: its fields would make clients back off for nothing.
#[tokio::test]
async fn shadow_policies_send_no_fields_unless_asked() {
    let (mut svc, _clock) = service(Policy::new("s", Quota::per_hour(2)).shadow(true));
    for _ in 0..4 {
        let seen = send(&mut svc).await;
        assert_eq!(seen.status, 200);
        assert_eq!(seen.ratelimit, None);
        assert_eq!(seen.retry_after, None);
    }
    let (mut svc, _clock) = service(
        Policy::new("s", Quota::per_hour(2))
            .shadow(true)
            .shadow_headers(true),
    );
    assert_eq!(
        send(&mut svc).await.ratelimit.as_deref(),
        Some(r#""s";r=1;t=1800"#)
    );
}
