//! The `outcomes` example over real HTTP, on the local backend and as two instances sharing
//! Redis: failed logins counted and a locked key refused before the password is checked,
//! tokens charged from the response into debt, and at most two exports in flight per API key
//! (one failure count, one token budget and one in-flight cap across both instances).

#[allow(dead_code)]
#[path = "../examples/outcomes.rs"]
mod example;
mod support;

use std::net::SocketAddr;

use reqwest::StatusCode;
use tollgate::backend::{Backend, LocalBackend};

async fn serve<B: Backend + Clone>(backend: B) -> String {
    let app = example::app(backend).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap()
    });
    format!("http://{addr}")
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
