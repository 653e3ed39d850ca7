//! Outbound adaptive concurrency over real HTTP (issue 46): the reqwest middleware and a tower
//! client (hyper's) against a real axum upstream on a TCP port.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use http::Extensions;
use reqwest_middleware::{Middleware, Next};
use tokio::sync::Semaphore;
use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit, Refused, Upstreams};
use tollgate::middleware::AdaptiveMiddleware;

mod support;

/// The upstream: counts its calls; `/flaky` answers 503 to every odd call, `/busy` 429 with
/// `Retry-After: 30`, `/slow` waits for a permit of the gate.
#[derive(Clone)]
struct Upstream {
    calls: Arc<AtomicU32>,
    gate: Arc<Semaphore>,
}

async fn upstream() -> (String, Upstream) {
    let up = Upstream {
        calls: Arc::default(),
        gate: Arc::new(Semaphore::new(0)),
    };
    let app = Router::new()
        .route(
            "/flaky",
            get(|State(up): State<Upstream>| async move {
                if up.calls.fetch_add(1, Ordering::SeqCst) % 2 == 0 {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::OK
                }
            }),
        )
        .route(
            "/busy",
            get(|State(up): State<Upstream>| async move {
                up.calls.fetch_add(1, Ordering::SeqCst);
                let mut h = HeaderMap::new();
                h.insert("retry-after", "30".parse().unwrap());
                (StatusCode::TOO_MANY_REQUESTS, h)
            }),
        )
        .route(
            "/slow",
            get(|State(up): State<Upstream>| async move {
                up.calls.fetch_add(1, Ordering::SeqCst);
                up.gate.acquire().await.unwrap().forget();
                "ok"
            }),
        )
        .with_state(up.clone());
    (support::serve_app(app).await, up)
}

fn upstreams(min: u32, max: u32) -> Upstreams {
    Upstreams::new(move |name| {
        AdaptiveLimit::builder()
            .name(name)
            .initial(min)
            .range(min, max)
    })
    .unwrap()
}

/// Retries once a call answered 503: an outer middleware, as reqwest-retry is.
struct RetryOnce;

#[async_trait::async_trait]
impl Middleware for RetryOnce {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let again = req.try_clone().unwrap();
        let res = next.clone().run(req, extensions).await?;
        if res.status() == 503 {
            return next.run(again, extensions).await;
        }
        Ok(res)
    }
}

fn refusal(err: reqwest_middleware::Error) -> Refused {
    match err {
        reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<Refused>().unwrap().clone(),
        other => panic!("not refused by the middleware: {other}"),
    }
}

/// Each attempt of a retried call is its own sample: the 503 a drop, the retry's 200 a success.
#[tokio::test]
async fn a_retried_attempt_is_its_own_sample() {
    let (base, up) = upstream().await;
    let adaptive = AdaptiveMiddleware::new(upstreams(4, 10));
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryOnce)
        .with(adaptive.clone())
        .build();
    let res = client.get(format!("{base}/flaky")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(up.calls.load(Ordering::SeqCst), 2);
    let host = base.trim_start_matches("http://");
    let stats = &adaptive.upstreams().limit(host).unwrap().partitions()[0];
    assert_eq!(
        (stats.admitted, stats.dropped, stats.succeeded),
        (2, 1, 1),
        "{stats:?}"
    );
}

/// An upstream that answers `429` with `Retry-After` is not called again until then: later
/// calls fail at once with the time left, without reaching it. Another upstream (the same
/// server under another name) is not paused.
#[tokio::test]
async fn an_upstream_asking_to_wait_is_not_called_until_then() {
    let (base, up) = upstream().await;
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(AdaptiveMiddleware::new(upstreams(4, 10)))
        .build();
    let res = client.get(format!("{base}/busy")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    let err = client
        .get(format!("{base}/flaky"))
        .send()
        .await
        .unwrap_err();
    let left = refusal(err).retry_after().expect("paused");
    assert!(left > Duration::from_secs(29) && left <= Duration::from_secs(30));
    assert_eq!(
        up.calls.load(Ordering::SeqCst),
        1,
        "not called while paused"
    );
    let other = base.replace("127.0.0.1", "localhost");
    let res = client.get(format!("{other}/flaky")).send().await.unwrap();
    assert_eq!(res.status(), 200, "another upstream is called");
    assert_eq!(up.calls.load(Ordering::SeqCst), 2);
}

/// At its upstream's limit a call fails before it is sent; once the call in flight ends,
/// the next goes.
#[tokio::test]
async fn over_the_limit_a_call_fails_before_it_is_sent() {
    let (base, up) = upstream().await;
    let adaptive = AdaptiveMiddleware::new(upstreams(1, 1));
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(adaptive.clone())
        .build();
    let first = tokio::spawn(client.get(format!("{base}/slow")).send());
    let host = base.trim_start_matches("http://").to_owned();
    while up.calls.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let err = client.get(format!("{base}/slow")).send().await.unwrap_err();
    assert_eq!(refusal(err), Refused::OverLimit);
    assert_eq!(
        up.calls.load(Ordering::SeqCst),
        1,
        "the refused call was not sent"
    );
    up.gate.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    up.gate.add_permits(1);
    let res = client.get(format!("{base}/slow")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let limit = adaptive.upstreams().limit(&host).unwrap();
    let stats = &limit.partitions()[0];
    assert_eq!((stats.admitted, stats.rejected), (2, 1), "{stats:?}");
    assert_eq!(limit.in_flight(), 0);
}

/// The tower client side: `AdaptiveLayer` around hyper's client answers a call over the limit
/// with a 503 of its own, and counts the upstream's 503 as a drop.
#[tokio::test]
async fn a_tower_client_is_limited_by_the_same_layer() {
    use http_body_util::Empty;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use tower::{Service, ServiceBuilder, ServiceExt};

    let (base, up) = upstream().await;
    let limit = AdaptiveLimit::builder()
        .initial(1)
        .range(1, 1)
        .build()
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let svc = ServiceBuilder::new()
        .layer(AdaptiveLayer::new(limit.clone()))
        .map_response(|r: http::Response<_>| r.map(tollgate::ResponseBody::new))
        .service(client);
    let get = |path: &str| {
        http::Request::get(format!("{base}{path}"))
            .body(Empty::new())
            .unwrap()
    };
    let mut first_svc = svc.clone();
    let first_req = get("/slow");
    let first = tokio::spawn(async move { first_svc.ready().await?.call(first_req).await });
    while up.calls.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let refused = svc.clone().oneshot(get("/slow")).await.unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(up.calls.load(Ordering::SeqCst), 1);
    up.gate.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    // `/flaky`'s first answer (its count is odd now: 1 call made) is 200, then 503.
    let ok = svc.clone().oneshot(get("/flaky")).await.unwrap();
    let busy = svc.clone().oneshot(get("/flaky")).await.unwrap();
    assert_eq!((ok.status().as_u16(), busy.status().as_u16()), (200, 503));
    let stats = &limit.partitions()[0];
    assert_eq!(
        (
            stats.admitted,
            stats.rejected,
            stats.succeeded,
            stats.dropped
        ),
        (3, 1, 2, 1),
        "{stats:?}"
    );
}

/// `Limiter::adapt`: work for a key takes a slot of the key's adaptive limit; over it, or
/// while the upstream asked to wait, `admit` refuses before anything is taken; the answer
/// observed is the sample (a 503 a drop, with its pause), a permit dropped a success; a
/// refusal by the quota gives the slot back as no sample. Calls to a real upstream.
#[tokio::test]
async fn the_limiter_adapts_per_key_to_its_upstreams_answers() {
    use std::num::NonZeroU32;
    use tollgate::backend::LocalBackend;
    use tollgate::limiter::{AcquireError, Limiter};
    use tollgate::{Key, Policy, Quota};

    let (base, up) = upstream().await;
    let limiter = Limiter::new(
        Policy::new("partner", Quota::per_hour(2)),
        LocalBackend::new(),
    )
    .unwrap()
    .adapt(upstreams(1, 1))
    .unwrap();
    // Given once: a second set of limits, on a clone too, is refused, not ignored.
    let again = limiter.clone().adapt(upstreams(5, 5)).unwrap_err();
    assert!(again.to_string().contains("given once"), "{again}");
    let (a, b) = (Key::from_bytes("a").unwrap(), Key::from_bytes("b").unwrap());
    let one = NonZeroU32::MIN;
    let client = reqwest::Client::new();

    let mut first = limiter.admit(&a, one).await.unwrap();
    assert!(matches!(
        limiter.admit(&a, one).await,
        Err(AcquireError::Overloaded(Refused::OverLimit))
    ));
    // `/flaky` answers 503 first, with no Retry-After: a drop, no pause.
    let res = client.get(format!("{base}/flaky")).send().await.unwrap();
    assert!(first.observe(res.status(), res.headers()));
    drop(first);
    // `/busy`: 429 with Retry-After 30, for key b: b paused, a not.
    let mut second = limiter.admit(&b, one).await.unwrap();
    let res = client.get(format!("{base}/busy")).send().await.unwrap();
    assert!(second.observe(res.status(), res.headers()));
    drop(second);
    match limiter.admit(&b, one).await {
        Err(AcquireError::Overloaded(Refused::Paused(left))) => {
            assert!(left > Duration::from_secs(29));
        }
        other => panic!("{other:?}"),
    }
    let third = limiter.admit(&a, one).await.unwrap();
    drop(third);
    // The quota (2 an hour per key) is spent: refused by it, the adaptive slot comes back
    // unsampled.
    assert!(matches!(
        limiter.admit(&a, one).await,
        Err(AcquireError::TooLong(_))
    ));
    assert_eq!(up.calls.load(Ordering::SeqCst), 2);
    let ups = limiter.adaptive_limits().unwrap();
    let a = &ups.limit("a").unwrap().partitions()[0];
    assert_eq!(
        (a.admitted, a.rejected, a.dropped, a.succeeded, a.cancelled),
        (3, 1, 1, 1, 1),
        "{a:?}"
    );
    let b = &ups.limit("b").unwrap().partitions()[0];
    assert_eq!((b.admitted, b.dropped), (1, 1), "{b:?}");
}
