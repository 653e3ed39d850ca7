//! Requests in flight per key (`Quota::concurrent`), over a real TCP listener: a slot is held
//! from admission until the response body ends, is dropped, or the request is cancelled; a
//! request that finds every slot taken is refused before the handler runs; a refusal takes
//! nothing from the policy's other quotas; and under contention the cap holds exactly.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::{Router, routing::get};
use bytes::Bytes;
use tokio::sync::{Mutex, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tollgate::backend::LocalBackend;
use tollgate::key::Header;
use tollgate::{Policy, Quota, RateLimitLayer};

type Chunks = mpsc::Receiver<Result<Bytes, Infallible>>;

/// Handlers that wait until the test lets them answer, counting how many run at once; and the
/// chunks of one streamed response.
#[derive(Clone)]
struct Gate {
    open: Arc<Semaphore>,
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    stream: Arc<Mutex<Option<Chunks>>>,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            open: Arc::new(Semaphore::new(0)),
            running: Arc::default(),
            most: Arc::default(),
            stream: Arc::default(),
        }
    }
}

async fn held(State(gate): State<Gate>) -> &'static str {
    let now = gate.running.fetch_add(1, Ordering::SeqCst) + 1;
    gate.most.fetch_max(now, Ordering::SeqCst);
    gate.open.acquire().await.unwrap().forget();
    gate.running.fetch_sub(1, Ordering::SeqCst);
    "done"
}

async fn streamed(State(gate): State<Gate>) -> Body {
    let rx = gate
        .stream
        .lock()
        .await
        .take()
        .expect("one stream per test");
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

async fn serve(policy: Policy, gate: Gate) -> String {
    let limit = RateLimitLayer::builder()
        .key(Header::new("x-api-key"))
        .backend(LocalBackend::new())
        .policy(policy)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/export", get(held))
        .route("/fast", get(|| async { "ok" }))
        .route("/stream", get(streamed))
        .with_state(gate)
        .route_layer(limit);
    format!("http://{}", support::serve(app).await)
}

fn spawn_get(base: &str, path: &str, key: &str) -> JoinHandle<reqwest::Response> {
    let (url, key) = (format!("{base}{path}"), key.to_owned());
    tokio::spawn(async move {
        reqwest::Client::new()
            .get(url)
            .header("x-api-key", key)
            .send()
            .await
            .unwrap()
    })
}

async fn fetch(base: &str, path: &str, key: &str) -> reqwest::Response {
    spawn_get(base, path, key).await.unwrap()
}

/// Waits until `n` handlers are running (requests the test has spawned and not awaited).
async fn until_running(gate: &Gate, n: usize) {
    for _ in 0..1000 {
        if gate.running.load(Ordering::SeqCst) == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "expected {n} running handlers, saw {}",
        gate.running.load(Ordering::SeqCst)
    );
}

/// Asks for `path` on `key` until it is admitted (the previous holder's slot comes back once
/// its response has gone out); panics if that never happens.
async fn until_admitted(base: &str, path: &str, key: &str) -> reqwest::Response {
    for _ in 0..200 {
        let res = fetch(base, path, key).await;
        if res.status() != StatusCode::TOO_MANY_REQUESTS {
            return res;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{path} on {key} never admitted again");
}

#[tokio::test]
async fn a_third_request_in_flight_is_refused_until_one_ends() {
    let gate = Gate::default();
    let base = serve(Policy::new("exports", Quota::concurrent(2)), gate.clone()).await;
    let first = spawn_get(&base, "/export", "k");
    until_running(&gate, 1).await;
    let second = spawn_get(&base, "/export", "k");
    until_running(&gate, 2).await;

    let third = fetch(&base, "/export", "k").await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.headers()["retry-after"], "1");
    assert_eq!(
        third.headers()["ratelimit-policy"],
        r#""exports";q=2;qu="concurrent-requests""#
    );
    assert_eq!(third.headers()["ratelimit"], r#""exports";r=0;t=1"#);
    assert_eq!(
        gate.running.load(Ordering::SeqCst),
        2,
        "refused before the handler"
    );

    // Another key has slots of its own.
    let other = spawn_get(&base, "/export", "other");
    until_running(&gate, 3).await;

    gate.open.add_permits(1);
    let done = first.await.unwrap();
    assert_eq!(done.status(), StatusCode::OK);
    done.text().await.unwrap();
    // The first request's slot came back: one more is admitted, and then the key is full again.
    let fourth = spawn_get(&base, "/export", "k");
    until_running(&gate, 3).await;
    assert_eq!(
        fetch(&base, "/export", "k").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    gate.open.add_permits(3);
    for res in [second, other, fourth] {
        let res = res.await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers()["ratelimit"].to_str().unwrap().contains(";r="));
    }
    // Every slot is back.
    let a = spawn_get(&base, "/export", "k");
    let b = spawn_get(&base, "/export", "k");
    until_running(&gate, 2).await;
    gate.open.add_permits(2);
    assert_eq!(a.await.unwrap().status(), StatusCode::OK);
    assert_eq!(b.await.unwrap().status(), StatusCode::OK);
}

#[tokio::test]
async fn the_first_admitted_reports_the_free_slots() {
    let gate = Gate::default();
    let base = serve(Policy::new("exports", Quota::concurrent(3)), gate.clone()).await;
    let res = fetch(&base, "/fast", "k").await;
    assert_eq!(res.headers()["ratelimit"], r#""exports";r=2;t=0"#);
    res.text().await.unwrap();
    // Its slot is back once its body is read.
    let res = until_admitted(&base, "/fast", "k").await;
    assert_eq!(res.headers()["ratelimit"], r#""exports";r=2;t=0"#);
}

#[tokio::test]
async fn a_slot_is_held_until_a_streamed_body_ends() {
    let gate = Gate::default();
    let (tx, rx) = mpsc::channel(4);
    *gate.stream.lock().await = Some(rx);
    let base = serve(Policy::new("exports", Quota::concurrent(1)), gate.clone()).await;
    let mut streaming = fetch(&base, "/stream", "k").await;
    assert_eq!(streaming.status(), StatusCode::OK);
    tx.send(Ok(Bytes::from_static(b"part one"))).await.unwrap();
    assert_eq!(
        streaming.chunk().await.unwrap().as_deref(),
        Some(&b"part one"[..])
    );
    // The head has been sent and the body still streams: the slot is held.
    let refused = fetch(&base, "/fast", "k").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    tx.send(Ok(Bytes::from_static(b"part two"))).await.unwrap();
    drop(tx);
    while streaming.chunk().await.unwrap().is_some() {}
    assert_eq!(
        until_admitted(&base, "/fast", "k").await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_client_that_goes_away_gives_its_slot_back() {
    let gate = Gate::default();
    let base = serve(Policy::new("exports", Quota::concurrent(1)), gate.clone()).await;
    let gone = tokio::spawn({
        let url = format!("{base}/export");
        async move {
            reqwest::Client::new()
                .get(url)
                .header("x-api-key", "k")
                .timeout(Duration::from_millis(300))
                .send()
                .await
        }
    });
    until_running(&gate, 1).await;
    assert_eq!(
        fetch(&base, "/fast", "k").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert!(gone.await.unwrap().is_err(), "the client timed out");
    // The server drops the request's future when the connection closes: the slot comes back
    // (the handler itself never answered).
    assert_eq!(
        until_admitted(&base, "/fast", "k").await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_refusal_for_slots_takes_nothing_from_the_rate_quota() {
    let gate = Gate::default();
    let policy = Policy::new("exports", Quota::concurrent(1)).and(Quota::per_hour(3));
    let base = serve(policy, gate.clone()).await;
    let first = spawn_get(&base, "/export", "k");
    until_running(&gate, 1).await;
    for _ in 0..10 {
        let res = fetch(&base, "/export", "k").await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        // The refusing quota alone is reported.
        assert_eq!(res.headers()["ratelimit"], r#""exports-0";r=0;t=1"#);
    }
    gate.open.add_permits(1);
    let res = first.await.unwrap();
    assert_eq!(
        res.headers()["ratelimit"],
        r#""exports-0";r=0;t=0, "exports-1";r=2;t=1200"#
    );
    res.text().await.unwrap();
    // Ten refusals later, the hourly quota still has its two units.
    let res = until_admitted(&base, "/fast", "k").await;
    assert_eq!(res.status(), StatusCode::OK);
    let res = until_admitted(&base, "/fast", "k").await;
    assert_eq!(res.status(), StatusCode::OK);
    // The third is refused by the hourly quota (once the slot of the second is back).
    let mut res = fetch(&base, "/fast", "k").await;
    while res.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .contains("exports-0")
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
        res = fetch(&base, "/fast", "k").await;
    }
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        res.headers()["ratelimit"].to_str().unwrap(),
        r#""exports-1";r=0;t=1200"#
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_contention_the_cap_holds_and_every_slot_comes_back() {
    let gate = Gate::default();
    let base = serve(Policy::new("exports", Quota::concurrent(3)), gate.clone()).await;
    // Release the handlers as they come, so that slots are taken and given back throughout.
    gate.open.add_permits(1_000);
    let requests: Vec<_> = (0..200).map(|_| spawn_get(&base, "/export", "k")).collect();
    let mut ok = 0;
    for res in requests {
        let res = res.await.unwrap();
        match res.status() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
        res.text().await.unwrap();
    }
    assert!(ok >= 3, "{ok} admitted");
    assert!(gate.most.load(Ordering::SeqCst) <= 3, "at most 3 at once");
    // Nothing leaked: three can run at once again.
    let left = gate.open.available_permits() as u32;
    gate.open.acquire_many(left).await.unwrap().forget();
    let three: Vec<_> = (0..3).map(|_| spawn_get(&base, "/export", "k")).collect();
    until_running(&gate, 3).await;
    gate.open.add_permits(3);
    for res in three {
        assert_eq!(res.await.unwrap().status(), StatusCode::OK);
    }
}

#[test]
fn more_than_one_concurrent_quota_is_a_configuration_error() {
    let err = Policy::new("p", Quota::concurrent(2))
        .and(Quota::concurrent(5))
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("more than one concurrent quota"), "{err}");
}

#[test]
fn concurrent_quotas_in_configuration() {
    let policy: Policy =
        serde_json::from_str(r#"{"name":"exports","quotas":["2 concurrent lease 30s","100/h"]}"#)
            .unwrap();
    assert!(policy.holds_slots());
    assert_eq!(
        policy.quotas()[0],
        Quota::concurrent(2).lease(Duration::from_secs(30))
    );
    let err = serde_json::from_str::<Policy>(r#"{"name":"x","quotas":["2 concurent"]}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("did you mean `concurrent`"), "{err}");
}
