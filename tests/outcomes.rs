//! The `outcomes` example over real HTTP, on the local backend and as two instances sharing
//! Redis: failed logins counted and a locked key refused before the password is checked,
//! tokens charged from the response into debt, and at most two exports in flight per API key
//! (one failure count, one token budget and one in-flight cap across both instances).

#[allow(dead_code)]
#[path = "../examples/outcomes.rs"]
mod example;
mod support;

use reqwest::StatusCode;
use support::serve_app;
use tollgate::backend::{Backend, LocalBackend};

async fn serve<B: Backend + Clone>(backend: B) -> String {
    serve_app(example::app(backend).unwrap()).await
}

async fn login(base: &str, user: &str, password: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/login"))
        .json(&serde_json::json!({ "user": user, "password": password }))
        .send()
        .await
        .unwrap()
}

/// The example's whole story on one backend; `bases` are instances sharing it (one or more).
async fn story(bases: &[String]) {
    let at = |i: usize| &bases[i % bases.len()];
    // Successful logins are free, however many.
    for i in 0..8 {
        assert_eq!(login(at(i), "alice", "wonderland").await.status(), 200);
    }
    for i in 0..5 {
        assert_eq!(login(at(i), "alice", "guess").await.status(), 401);
    }
    // Five failures: refused before the password is checked, even the right one.
    let locked = login(at(5), "alice", "wonderland").await;
    assert_eq!(locked.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = locked.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((170..=180).contains(&retry), "{retry}");
    // Another user from the same address is not locked.
    assert_eq!(login(at(6), "bob", "guess").await.status(), 401);

    // Tokens: admitted at cost 1, then charged what the response reports.
    let generate = |i: usize, tokens: u32| {
        reqwest::Client::new()
            .post(format!("{}/generate?tokens={tokens}", at(i)))
            .header("x-api-key", "k1")
            .send()
    };
    let first = generate(0, 900).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-tokens-used"], "900");
    assert_eq!(generate(1, 900).await.unwrap().status(), 200);
    // 1800 of 1000 charged: in debt for about 48 s.
    let refused = generate(2, 1).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((45..=49).contains(&retry), "{retry}");
    // Another key has its own tokens.
    let other = reqwest::Client::new()
        .post(format!("{}/generate?tokens=5", at(3)))
        .header("x-api-key", "k2")
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 200);

    // Exports: two in flight per key; a third at the same time is refused.
    let export = |i: usize| {
        let url = format!("{}/export?ms=3000", at(i));
        tokio::spawn(async move {
            reqwest::Client::new()
                .get(url)
                .header("x-api-key", "k1")
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    let (a, b) = (export(0), export(1));
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(export(2).await.unwrap(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(a.await.unwrap(), 200);
    assert_eq!(b.await.unwrap(), 200);
    // Both slots are back.
    let (a, b) = (export(0), export(1));
    assert_eq!(a.await.unwrap(), 200);
    assert_eq!(b.await.unwrap(), 200);
}

#[tokio::test]
async fn the_outcomes_example_on_the_local_backend() {
    story(&[serve(LocalBackend::new()).await]).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn two_instances_of_the_outcomes_example_share_redis() {
    use tollgate::backend::redis::RedisBackend;
    let server = support::RedisServer::start();
    let instance = || RedisBackend::builder().url(server.url()).build().unwrap();
    let bases = [serve(instance()).await, serve(instance()).await];
    story(&bases).await;
}

/// An instance killed mid-export (here: cut off from Redis, as a crashed process is) never
/// gives its slot back; the other instance gets it once the slot's lease has expired.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instances_export_slots_come_back_after_the_lease() {
    use std::time::{Duration, Instant};
    use support::proxy::{Fault, FaultProxy};
    use tollgate::backend::redis::RedisBackend;
    let server = support::RedisServer::start();
    let proxy = FaultProxy::start(server.port).await;
    let lease = Duration::from_secs(2);
    let instance = |url: String| {
        let backend = RedisBackend::builder().url(url).build().unwrap();
        example::app_with_lease(backend, lease).unwrap()
    };
    let doomed = serve_app(instance(proxy.url())).await;
    let survivor = serve_app(instance(server.url())).await;
    let export = |base: &str, ms: u64| {
        let url = format!("{base}/export?ms={ms}");
        async move {
            reqwest::Client::new()
                .get(url)
                .header("x-api-key", "k1")
                .send()
                .await
                .map(|r| r.status())
        }
    };
    // Each instance runs a long export, the survivor's a second later: both slots of `k1` are
    // taken, the survivor's lease ending a second after the other's.
    let started = Instant::now();
    let _hung = tokio::spawn(export(&doomed, 60_000));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _running = tokio::spawn(export(&survivor, 60_000));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        export(&survivor, 1).await.unwrap(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // The first instance dies: it never reaches Redis again.
    proxy.set(Fault::Stall);
    // Its slot comes back when its lease expires, 2 s after its export began: before the
    // survivor's own lease could free one (3 s).
    let mut back = None;
    while started.elapsed() < Duration::from_secs(6) {
        if export(&survivor, 1).await.unwrap() == StatusCode::OK {
            back = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = back.expect("the dead instance's slot never came back");
    assert!(
        back >= Duration::from_millis(1900) && back < Duration::from_millis(2900),
        "a slot came back {back:?} after the first export began"
    );
}
