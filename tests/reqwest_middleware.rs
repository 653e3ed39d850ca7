//! The reqwest-middleware adapter against a real server.
#![cfg(all(feature = "reqwest", feature = "local"))]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use tollgate::backend::LocalBackend;
use tollgate::limiter::{AcquireError, Limiter};
use tollgate::middleware::RateLimitMiddleware;
use tollgate::{Key, Policy, Quota};

async fn upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let app = Router::new().route(
        "/",
        get(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { "ok" }
        }),
    );
    (support::serve(app).await, hits)
}

fn client(mw: RateLimitMiddleware<LocalBackend>) -> reqwest_middleware::ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(mw)
        .build()
}

fn limiter(quota: Quota) -> Limiter<LocalBackend> {
    Limiter::new(Policy::new("partner", quota), LocalBackend::new()).unwrap()
}

/// Failing fast: past the burst, calls fail before reaching the server, with the wait.
#[tokio::test]
async fn fail_fast_refuses_before_sending() {
    let (addr, hits) = upstream().await;
    let c = client(RateLimitMiddleware::new(limiter(
        Quota::per_second(1).burst(2),
    )));
    let url = format!("http://{addr}/");
    for _ in 0..2 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    let err = c.get(&url).send().await.unwrap_err();
    let reqwest_middleware::Error::Middleware(inner) = &err else {
        panic!("{err:?}")
    };
    let Some(AcquireError::TooLong(d)) = inner.downcast_ref::<AcquireError>() else {
        panic!("{inner:?}")
    };
    assert!(
        d.retry_after().unwrap() > Duration::from_millis(500),
        "{d:?}"
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "the refused call was not sent"
    );
    // Another host is another key: `localhost` is not `127.0.0.1`.
    let other = format!("http://localhost:{}/", addr.port());
    assert_eq!(c.get(&other).send().await.unwrap().status(), 200);
}

/// Waiting: concurrent calls go on at the rate, all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_keeps_the_server_at_the_rate() {
    let (addr, hits) = upstream().await;
    let mw = RateLimitMiddleware::new(limiter(Quota::per_second(20).burst(1)))
        .wait(Duration::from_secs(2))
        .key(|_req| Key::from_bytes("partner").ok());
    let c = client(mw);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let (c, url) = (c.clone(), format!("http://{addr}/"));
        tasks.push(tokio::spawn(async move {
            c.get(url).send().await.unwrap().status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    // 6 calls at 20 per second, burst 1: the last goes 250 ms after the first.
    assert!(
        started.elapsed() >= Duration::from_millis(245),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(hits.load(Ordering::SeqCst), 6);
}

/// An upstream that answers its first call with `status` and `Retry-After: retry_after`, and
/// 200 after.
async fn refusing_once(
    status: u16,
    retry_after: String,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let app = Router::new().route(
        "/",
        get(move || {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            let retry_after = retry_after.clone();
            async move {
                let status = if first {
                    http::StatusCode::from_u16(status).unwrap()
                } else {
                    http::StatusCode::OK
                };
                (status, [("retry-after", retry_after)], "answer")
            }
        }),
    );
    (support::serve(app).await, hits)
}

/// How long a call failed by a pause says the key is paused yet.
fn paused(err: reqwest_middleware::Error) -> Duration {
    let reqwest_middleware::Error::Middleware(inner) = &err else {
        panic!("{err:?}")
    };
    match inner.downcast_ref::<AcquireError>() {
        Some(AcquireError::Paused(left)) => *left,
        _ => panic!("{inner:?}"),
    }
}

/// With `obey_retry_after`, an upstream's `429` with `Retry-After` pauses the key: failing
/// fast, the next call fails at once with the time left and is not sent; waiting, it goes
/// out when the pause ends.
#[tokio::test]
async fn an_upstreams_retry_after_pauses_the_key() {
    let (addr, hits) = refusing_once(429, "1".to_owned()).await;
    let url = format!("http://{addr}/");
    let fast =
        client(RateLimitMiddleware::new(limiter(Quota::per_second(100))).obey_retry_after(true));
    assert_eq!(fast.get(&url).send().await.unwrap().status(), 429);
    let left = paused(fast.get(&url).send().await.unwrap_err());
    assert!(
        left > Duration::from_millis(500) && left <= Duration::from_secs(1),
        "{left:?}"
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "the paused call was not sent"
    );

    // Waiting: the call after the 429 goes out once the second has passed.
    let (addr, hits) = refusing_once(429, "1".to_owned()).await;
    let url = format!("http://{addr}/");
    let waiting = client(
        RateLimitMiddleware::new(limiter(Quota::per_second(100)))
            .wait(Duration::from_secs(2))
            .obey_retry_after(true),
    );
    let started = Instant::now();
    assert_eq!(waiting.get(&url).send().await.unwrap().status(), 429);
    assert_eq!(waiting.get(&url).send().await.unwrap().status(), 200);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(hits.load(Ordering::SeqCst), 2);

    // A pause longer than the wait fails at once.
    let (addr, _) = refusing_once(503, "30".to_owned()).await;
    let url = format!("http://{addr}/");
    let short = client(
        RateLimitMiddleware::new(limiter(Quota::per_second(100)))
            .wait(Duration::from_secs(2))
            .obey_retry_after(true),
    );
    assert_eq!(short.get(&url).send().await.unwrap().status(), 503);
    let err = short.get(&url).send().await.unwrap_err();
    assert!(err.to_string().contains("paused"), "{err}");
}

/// `Retry-After` as an HTTP date pauses until then; without `obey_retry_after`, and on a
/// success, nothing is paused.
#[tokio::test]
async fn retry_after_dates_pause_and_nothing_else_does() {
    let at = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(20));
    let (addr, _) = refusing_once(429, at).await;
    let url = format!("http://{addr}/");
    let c =
        client(RateLimitMiddleware::new(limiter(Quota::per_second(100))).obey_retry_after(true));
    assert_eq!(c.get(&url).send().await.unwrap().status(), 429);
    let left = paused(c.get(&url).send().await.unwrap_err());
    assert!(left > Duration::from_secs(15), "{left:?}");

    // Not obeyed: the next call goes out.
    let (addr, hits) = refusing_once(429, "30".to_owned()).await;
    let url = format!("http://{addr}/");
    let c = client(RateLimitMiddleware::new(limiter(Quota::per_second(100))));
    assert_eq!(c.get(&url).send().await.unwrap().status(), 429);
    assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    assert_eq!(hits.load(Ordering::SeqCst), 2);

    // A 200 carrying `Retry-After` pauses nothing.
    let (addr, hits) = refusing_once(200, "30".to_owned()).await;
    let url = format!("http://{addr}/");
    let c =
        client(RateLimitMiddleware::new(limiter(Quota::per_second(100))).obey_retry_after(true));
    for _ in 0..3 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    assert_eq!(hits.load(Ordering::SeqCst), 3);
}

/// A client pacing from its upstream's `RateLimit` fields: the upstream, itself limited by
/// tollgate (2 a second, burst 2), says `r=0;t=1` on the call that empties its bucket, and the
/// waiting client pauses until then: sequential calls never run into the upstream's `429`.
#[tokio::test]
async fn a_client_paces_from_the_upstreams_ratelimit_field() {
    let limit = tollgate::RateLimitLayer::builder()
        .key(tollgate::key::Global)
        .policy(Policy::new("upstream", Quota::per_second(2)))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(limit);
    let url = format!("http://{}/", support::serve(app).await);
    let c = client(
        RateLimitMiddleware::new(limiter(Quota::per_second(100)))
            .wait(Duration::from_secs(3))
            .obey_retry_after(true),
    );
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(c.get(&url).send().await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200; 6], "no 429 from the upstream");
}
