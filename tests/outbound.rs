//! The `outbound` example against an upstream that is itself limited by tollgate and sends the
//! `RateLimit` fields: sequential calls pace themselves from them and never get its `429`,
//! while a client that does not read them does.

#[allow(dead_code)]
#[path = "../examples/outbound.rs"]
mod example;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::{Router, routing::get};
use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};

/// An upstream allowing 4 calls per second (bursts of 4) to everyone, counting the `429`s it
/// answers.
async fn upstream() -> (String, Arc<AtomicU64>) {
    let refused = Arc::new(AtomicU64::new(0));
    let counted = refused.clone();
    let limit = RateLimitLayer::builder()
        .key(Global)
        .policy(Policy::new("partner", Quota::per_second(4)))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limit)
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let counted = counted.clone();
            async move {
                let res: Response = next.run(req).await;
                if res.status() == 429 {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
                res
            }
        }));
    (format!("http://{}/", support::serve(app).await), refused)
}

#[tokio::test(flavor = "multi_thread")]
async fn sequential_calls_pace_from_the_upstreams_fields_and_never_get_its_429() {
    let (url, refused) = upstream().await;
    // The client's own rate would allow all 12 at once: only the upstream's fields pace it.
    let rate: Quota = "1000/s".parse().unwrap();
    let tally = example::run(LocalBackend::new(), rate, 1, 12, url)
        .await
        .unwrap();
    assert_eq!((tally.calls, tally.failed), (12, 0));
    assert_eq!(refused.load(Ordering::Relaxed), 0);
    // Two pauses of `t=1` (after the 4th and the 8th call): it waited instead of failing.
    assert!(
        tally.elapsed >= Duration::from_millis(1900),
        "{:?}",
        tally.elapsed
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_calls_without_pacing_run_into_the_429() {
    // The check that the upstream really refuses what the example avoided: the same 12 calls
    // straight through a plain client, at once.
    let (url, refused) = upstream().await;
    let client = reqwest::Client::new();
    let calls = (0..12).map(|_| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.get(&url).send().await.unwrap().status() })
    });
    let mut too_many = 0;
    for call in calls.collect::<Vec<_>>() {
        if call.await.unwrap() == 429 {
            too_many += 1;
        }
    }
    assert!(too_many >= 4, "{too_many}");
    assert_eq!(refused.load(Ordering::Relaxed), too_many);
}
