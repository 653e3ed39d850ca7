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
