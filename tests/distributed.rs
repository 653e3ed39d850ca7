//! The `distributed` example as two instances sharing one Redis, over real HTTP: with
//! `ON_FAILURE=fallback`, once Redis is killed the two together admit about one limit (each
//! its share), not one each.
#![cfg(feature = "redis")]

#[allow(dead_code)]
#[path = "../examples/distributed.rs"]
mod example;
mod support;

use support::RedisServer;
use tollgate::backend::redis::{FailurePolicy, RedisBackend};

fn instance(server: &RedisServer, on_failure: &str) -> RedisBackend {
    let on_failure = example::failure_policy(Some(on_failure)).unwrap();
    assert_eq!(on_failure, FailurePolicy::FallbackLocal);
    RedisBackend::builder()
        .url(server.url())
        .on_failure(on_failure)
        .build()
        .unwrap()
}

async fn hello(client: &reqwest::Client, base: &str) -> u16 {
    let res = client
        .get(format!("{base}/api/hello"))
        .send()
        .await
        .unwrap();
    res.status().as_u16()
}

#[test]
fn on_failure_takes_three_values_and_defaults_to_open() {
    use example::failure_policy;
    assert_eq!(failure_policy(None), Ok(FailurePolicy::FailOpen));
    assert_eq!(failure_policy(Some("open")), Ok(FailurePolicy::FailOpen));
    assert_eq!(
        failure_policy(Some("closed")),
        Ok(FailurePolicy::FailClosed)
    );
    assert_eq!(
        failure_policy(Some("fallback")),
        Ok(FailurePolicy::FallbackLocal)
    );
    let err = failure_policy(Some("local")).unwrap_err();
    assert!(err.contains("open, closed or fallback"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_falling_back_admit_one_limit_together() {
    let mut server = RedisServer::start();
    let (a, b) = (instance(&server, "fallback"), instance(&server, "fallback"));
    let base_a = format!(
        "http://{}",
        support::serve(example::app(a.clone()).unwrap()).await
    );
    let base_b = format!(
        "http://{}",
        support::serve(example::app(b.clone()).unwrap()).await
    );
    let client = reqwest::Client::new();
    // Shared while Redis answers: one request on each, and both instances count two.
    assert_eq!(hello(&client, &base_a).await, 200);
    assert_eq!(hello(&client, &base_b).await, 200);
    support::eventually("the instances count each other", || {
        a.stats().fleet_size == 2 && b.stats().fleet_size == 2
    })
    .await;

    server.kill();
    // Every request now is decided by its instance alone (a refused connection fails at once),
    // at its share: 5/s burst 10 is, per instance, 3/s burst 5.
    let mut ok = 0;
    let started = std::time::Instant::now();
    for _ in 0..15 {
        ok += u32::from(hello(&client, &base_a).await == 200);
        ok += u32::from(hello(&client, &base_b).await == 200);
    }
    let took = started.elapsed().as_secs_f64();
    eprintln!("{ok} of 30 allowed by the two instances in {took:.2} s");
    // One limit (10), plus what refills while the 30 requests run (at 3/s each, 6/s for the
    // two): each instance on the whole quota would have let 20 through, and 10/s more.
    let refilled = (6.0 * took).ceil() as u32;
    assert!(
        ok >= 10 && ok <= 10 + refilled + 1,
        "{ok} allowed by the two in {took:.2} s"
    );
    assert!(a.stats().fallback_local >= 15 && b.stats().fallback_local >= 15);
}
