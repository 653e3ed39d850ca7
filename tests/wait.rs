//! Wait mode: the layer holds requests until their policy allows them, over real TCP, around a
//! server and around a client.
#![cfg(feature = "local")]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

fn layer(quota: Quota, max_wait: Duration, waiters: usize) -> RateLimitLayer<Global, LocalBackend> {
    RateLimitLayer::builder()
        .policy(Policy::new("smooth", quota))
        .key(Global)
        .wait(max_wait, waiters)
        .build()
        .unwrap()
}

/// A burst of requests to a server in wait mode is smoothed to the rate: all pass, spaced by
/// the emission interval, none rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_smooths_a_burst_instead_of_rejecting_it() {
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer(
            Quota::per_second(20).burst(1),
            Duration::from_secs(2),
            100,
        ));
    let addr = support::serve(app).await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (client, url) = (client.clone(), format!("http://{addr}/"));
        tasks.push(tokio::spawn(async move {
            let status = client.get(url).send().await.unwrap().status();
            (status, started.elapsed())
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        let (status, at) = t.await.unwrap();
        assert_eq!(status, 200);
        done.push(at);
    }
    done.sort();
    // Bounded from a due time, not from the first answer (whose own delivery a busy machine
    // can delay, shortening the gap: 8 requests failed this way under load): the last of
    // eight is served with the 8th unit, due 7 × 50 ms after the first decision, which comes
    // after `started`; 5 ms for the two clocks' rounding.
    assert!(done[7] >= Duration::from_millis(345), "{done:?}");
}

/// A request whose units come later than the longest wait is rejected at once; beyond the
/// waiters' limit, requests are decided at once.
#[tokio::test]
async fn waits_and_waiters_are_bounded() {
    let inner = tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    });
    // One unit per second, burst 1: the first passes, the second waits a second.
    let mut svc = layer(
        Quota::per_second(1).burst(1),
        Duration::from_millis(1500),
        1,
    )
    .wrap_body()
    .layer(inner);
    svc.ready().await.unwrap();
    assert_eq!(svc.call(Request::new(())).await.unwrap().status(), 200);
    // The second reserves the next unit and waits for it, holding the only waiter's slot.
    svc.ready().await.unwrap();
    let waiting = svc.call(Request::new(()));
    // The third finds no slot: decided at once, and there is nothing now.
    svc.ready().await.unwrap();
    let started = Instant::now();
    let third = svc.call(Request::new(())).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    // Decided at once: waiting would take the second until the next unit; 500 ms is a margin
    // for a busy machine.
    assert!(started.elapsed() < Duration::from_millis(500));
    // Dropping the waiting request gives its slot back (its unit stays spent): the next
    // request may wait again, for the unit after it (2 s away: longer than 1.5 s, rejected).
    drop(waiting);
    svc.ready().await.unwrap();
    let res = svc.call(Request::new(())).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(retry, 2, "behind the dropped waiter's spent unit");
}

/// Around a client: the layer wraps a hyper-util `Client` calling a real upstream, and the
/// upstream sees the calls at the quota's rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_keeps_the_upstream_at_the_rate() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let started = Instant::now();
    let record = seen.clone();
    let upstream = Router::new().route(
        "/",
        get(move || {
            let record = record.clone();
            async move {
                record.lock().unwrap().push(started.elapsed());
                "ok"
            }
        }),
    );
    let addr = support::serve(upstream).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let limited = layer(Quota::per_second(25).burst(2), Duration::from_secs(5), 64)
        .wrap_body()
        .layer(client);
    let failed = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..12 {
        let (mut svc, failed) = (limited.clone(), failed.clone());
        let uri = format!("http://{addr}/");
        tasks.push(tokio::spawn(async move {
            let req = Request::get(uri).body(Empty::new()).unwrap();
            let res = svc.ready().await.unwrap().call(req).await.unwrap();
            if res.status() != 200 {
                failed.fetch_add(1, Ordering::Relaxed);
            }
            let _ = res.into_body().collect().await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0);
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen.len(), 12);
    // 12 calls at 25 per second with a burst of 2, the bucket full when the test starts (the
    // times are since then): the k-th call after the burst is let go no sooner than k × 40 ms,
    // and arrives no sooner (scheduling may delay an arrival, never advance it; a delayed one
    // may arrive close to the next, so the bound is on each from the start, not on the gaps).
    for (i, at) in seen.iter().enumerate().skip(2) {
        let earliest = Duration::from_millis(40 * (i as u64 - 1));
        assert!(*at >= earliest, "call {i} at {at:?}: {seen:?}");
    }
}

/// Around a client, an upstream's `429` with `Retry-After` pauses the key: without wait mode
/// further calls are answered `429` without reaching the upstream; in wait mode they wait it
/// out, then go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_retry_after_pauses_the_key() {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let upstream = Router::new().route(
        "/",
        get(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Response::builder()
                        .status(429)
                        .header("retry-after", "1")
                        .body(axum::body::Body::from("slow down"))
                        .unwrap()
                } else {
                    Response::new(axum::body::Body::from("ok"))
                }
            }
        }),
    );
    let addr = support::serve(upstream).await;
    let client = || {
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http::<Empty<Bytes>>()
    };
    let get = |svc: &mut _| {
        let svc: &mut tollgate::RateLimit<_, Global, LocalBackend, tollgate::body::WrapBody> = svc;
        let req = Request::get(format!("http://{addr}/"))
            .body(Empty::new())
            .unwrap();
        svc.call(req)
    };
    let roomy = Quota::per_second(1000).burst(1000);
    let rejecting = RateLimitLayer::builder()
        .policy(Policy::new("partner", roomy))
        .key(Global)
        .obey_retry_after(true)
        .build()
        .unwrap()
        .wrap_body();
    let mut svc = rejecting.layer(client());
    svc.ready().await.unwrap();
    assert_eq!(
        get(&mut svc).await.unwrap().status(),
        429,
        "the upstream's own answer"
    );
    svc.ready().await.unwrap();
    let paused = get(&mut svc).await.unwrap();
    assert_eq!(paused.status(), 429);
    assert_eq!(paused.headers()["retry-after"], "1");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "the upstream was not called"
    );

    // In wait mode the key's next call waits out the pause, then reaches the upstream.
    hits.store(0, Ordering::SeqCst);
    let waiting = RateLimitLayer::builder()
        .policy(Policy::new("partner", roomy))
        .key(Global)
        .obey_retry_after(true)
        .wait(Duration::from_secs(3), 16)
        .build()
        .unwrap()
        .wrap_body();
    let mut svc = waiting.layer(client());
    svc.ready().await.unwrap();
    assert_eq!(get(&mut svc).await.unwrap().status(), 429);
    let started = Instant::now();
    svc.ready().await.unwrap();
    assert_eq!(get(&mut svc).await.unwrap().status(), 200);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

/// After a pause the upstream asked for, waiting calls go on at the policy's rate from the
/// pause's end, not all at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_pause_waiters_go_on_at_the_rate() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let started = Instant::now();
    let record = seen.clone();
    let upstream = Router::new().route(
        "/",
        get(move || {
            let record = record.clone();
            async move {
                let mut seen = record.lock().unwrap();
                seen.push(started.elapsed());
                if seen.len() == 1 {
                    Response::builder()
                        .status(429)
                        .header("retry-after", "1")
                        .body(axum::body::Body::empty())
                        .unwrap()
                } else {
                    Response::new(axum::body::Body::from("ok"))
                }
            }
        }),
    );
    let addr = support::serve(upstream).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let limited = RateLimitLayer::builder()
        .policy(Policy::new("partner", Quota::per_second(10).burst(2)))
        .key(Global)
        .obey_retry_after(true)
        .wait(Duration::from_secs(5), 64)
        .build()
        .unwrap()
        .wrap_body()
        .layer(client);
    let get = |mut svc: tollgate::RateLimit<_, Global, LocalBackend, tollgate::body::WrapBody>| {
        let uri = format!("http://{addr}/");
        async move {
            let req = Request::get(uri).body(Empty::<Bytes>::new()).unwrap();
            svc.ready().await.unwrap().call(req).await.unwrap().status()
        }
    };
    assert_eq!(get(limited.clone()).await, 429);
    let mut tasks = Vec::new();
    for _ in 0..6 {
        tasks.push(tokio::spawn(get(limited.clone())));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let seen = seen.lock().unwrap().clone();
    let mut after: Vec<Duration> = seen[1..].to_vec();
    after.sort();
    // The first two (the burst) at the pause's end, then one every 100 ms.
    assert!(after[0] >= Duration::from_millis(950), "{seen:?}");
    // The last is due 400 ms after the pause's end (bounded from that due time, as the first
    // is, not from the gap after the first answer, which a delayed wake-up can shorten).
    assert!(after[5] >= Duration::from_millis(950 + 380), "{seen:?}");
}

/// A shadow policy is never enforced, in wait mode either: nothing waits.
#[tokio::test]
async fn a_shadow_policy_holds_nothing_back() {
    let inner = tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    });
    let mut svc = RateLimitLayer::builder()
        .policy(Policy::new("shadow", Quota::per_second(1).burst(1)).shadow(true))
        .key(Global)
        .wait(Duration::from_secs(5), 16)
        .build()
        .unwrap()
        .wrap_body()
        .layer(inner);
    let started = Instant::now();
    for _ in 0..3 {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(Request::new(()))
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }
    // Nothing held back: holding back would take a second per request (1 a second, burst 1),
    // two in all; a second is a margin for a busy machine.
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}
