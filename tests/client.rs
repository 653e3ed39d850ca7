//! The client layers over real sockets: `RetryLayer` and `ThrottleLayer` on hyper's client
//! against an axum upstream, and `ThrottleLayer` on a tonic channel against a tonic server
//! refusing with `RESOURCE_EXHAUSTED` (tollgate's own layer).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::any;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::client::{RetryBudget, RetryLayer, RetrySafe, Throttle, ThrottleLayer, Throttled};
use tower::{Service, ServiceBuilder, ServiceExt};

type Body = Full<Bytes>;

/// An upstream answering each request by `answer(n)` (n from 0), counting what it received.
async fn upstream(answer: fn(u64) -> u16) -> (String, Arc<AtomicU64>) {
    let seen = Arc::new(AtomicU64::new(0));
    let count = seen.clone();
    let app = Router::new().route(
        "/",
        any(move || {
            let n = count.fetch_add(1, Ordering::SeqCst);
            async move {
                let status = http::StatusCode::from_u16(answer(n)).unwrap();
                (status, format!("answer {n}"))
            }
        }),
    );
    (support::serve_app(app).await, seen)
}

fn hyper_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn request(url: &str, method: http::Method) -> http::Request<Body> {
    http::Request::builder()
        .method(method)
        .uri(format!("{url}/"))
        .body(Full::new(Bytes::from_static(b"payload")))
        .unwrap()
}

/// Status and body of a call's answer.
async fn answer<B>(res: http::Response<B>) -> (u16, String)
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// An idempotent call answered 503 twice is retried to its 200; a `POST` is not retried
/// unless marked safe; a `Retry-After` is waited out.
#[tokio::test]
async fn retries_reach_the_answer_that_succeeds() {
    let (url, seen) = upstream(|n| if n % 3 == 2 { 200 } else { 503 }).await;
    let budget = RetryBudget::new();
    let mut client = ServiceBuilder::new()
        .layer(
            RetryLayer::new(budget.clone())
                .backoff(Duration::from_millis(1), Duration::from_millis(5)),
        )
        .service(hyper_client());

    let res = client
        .ready()
        .await
        .unwrap()
        .call(request(&url, http::Method::GET))
        .await
        .unwrap();
    assert_eq!(answer(res).await, (200, "answer 2".into()));
    assert_eq!(seen.load(Ordering::SeqCst), 3);

    let res = client
        .ready()
        .await
        .unwrap()
        .call(request(&url, http::Method::POST))
        .await
        .unwrap();
    assert_eq!(
        answer(res).await,
        (503, "answer 3".into()),
        "a POST is not retried"
    );

    let mut post = request(&url, http::Method::POST);
    post.extensions_mut().insert(RetrySafe);
    let res = client.ready().await.unwrap().call(post).await.unwrap();
    assert_eq!(
        answer(res).await,
        (200, "answer 5".into()),
        "unless marked safe"
    );
    assert_eq!(budget.counts(), (3, 3));
}

/// With the budget spent, a call that would be retried gets its original answer (the
/// upstream's 503 and its body), and the upstream receives no retry.
#[tokio::test]
async fn a_spent_budget_gives_the_original_answer() {
    let (url, seen) = upstream(|_| 503).await;
    let budget = RetryBudget::builder()
        .ratio(0.1)
        .min_per_second(0.0)
        .build()
        .unwrap();
    let mut client = ServiceBuilder::new()
        .layer(
            RetryLayer::new(budget.clone())
                .backoff(Duration::from_millis(1), Duration::from_millis(2)),
        )
        .service(hyper_client());
    for i in 0..100u64 {
        let res = client
            .ready()
            .await
            .unwrap()
            .call(request(&url, http::Method::GET))
            .await
            .unwrap();
        let (status, body) = answer(res).await;
        assert_eq!(status, 503);
        assert!(body.starts_with("answer "), "{i}: {body}");
    }
    let (calls, retries) = budget.counts();
    assert_eq!(calls, 100);
    assert!(retries <= 10, "10 % of the calls: {retries}");
    assert_eq!(seen.load(Ordering::SeqCst), 100 + retries);
}

/// Against an upstream refusing everything, the throttle keeps most calls from being sent;
/// against one accepting everything, 32 calls at a time, it refuses none.
#[tokio::test]
async fn the_throttle_sends_little_to_a_refusing_upstream_and_all_to_a_healthy_one() {
    let (url, seen) = upstream(|_| 503).await;
    let mut client = ServiceBuilder::new()
        .layer(ThrottleLayer::new(Throttle::new()))
        .service(hyper_client());
    let mut throttled = 0;
    for _ in 0..500 {
        match client
            .ready()
            .await
            .unwrap()
            .call(request(&url, http::Method::GET))
            .await
        {
            Ok(res) => assert_eq!(res.status(), 503),
            Err(e) => {
                assert!(e.is::<Throttled>(), "{e}");
                throttled += 1;
            }
        }
    }
    assert_eq!(seen.load(Ordering::SeqCst) + throttled, 500);
    assert!(throttled > 400, "most never sent: {throttled}");

    let (url, seen) = upstream(|_| 200).await;
    let client = ServiceBuilder::new()
        .layer(ThrottleLayer::new(Throttle::new()))
        .service(hyper_client());
    let calls = (0..32).map(|_| {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move {
            for _ in 0..50 {
                let res = client
                    .clone()
                    .oneshot(request(&url, http::Method::GET))
                    .await;
                assert_eq!(res.expect("never throttled").status(), 200);
            }
        })
    });
    for c in calls.collect::<Vec<_>>() {
        c.await.unwrap();
    }
    assert_eq!(seen.load(Ordering::SeqCst), 1600);
}

#[path = "../examples/proto/helloworld.rs"]
mod helloworld;

struct Greeter;

#[tonic::async_trait]
impl helloworld::greeter_server::Greeter for Greeter {
    async fn say_hello(
        &self,
        request: tonic::Request<helloworld::HelloRequest>,
    ) -> Result<tonic::Response<helloworld::HelloReply>, tonic::Status> {
        Ok(tonic::Response::new(helloworld::HelloReply {
            message: format!("Hello {}!", request.into_inner().name),
        }))
    }
}

/// A tonic client through the throttle: a server whose limit is spent answers
/// `RESOURCE_EXHAUSTED` (trailers-only, read by the throttle), and most later calls fail in
/// the client with the throttle's error, never reaching the server.
#[tokio::test]
async fn a_tonic_client_is_throttled_by_resource_exhausted() {
    use tollgate::{Policy, Quota, RateLimitLayer};
    let received = Arc::new(AtomicU64::new(0));
    let count = received.clone();
    let limit = RateLimitLayer::builder()
        .policy(Policy::new("greeter", Quota::per_hour(1).burst(5)))
        .key(tollgate::key::Global)
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .layer(
            ServiceBuilder::new()
                .map_request(move |r: http::Request<_>| {
                    count.fetch_add(1, Ordering::SeqCst);
                    r
                })
                .layer(limit),
        )
        .add_service(helloworld::greeter_server::GreeterServer::new(Greeter));
    tokio::spawn(
        server.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let throttled = ServiceBuilder::new()
        .layer(ThrottleLayer::new(Throttle::new()))
        .service(channel);
    let mut client = helloworld::greeter_client::GreeterClient::new(throttled);
    let (mut ok, mut exhausted, mut local) = (0, 0, 0);
    for _ in 0..300 {
        let req = tonic::Request::new(helloworld::HelloRequest { name: "x".into() });
        match client.say_hello(req).await {
            Ok(_) => ok += 1,
            Err(s) if s.code() == tonic::Code::ResourceExhausted => exhausted += 1,
            Err(s) => {
                assert!(s.message().contains("throttled by the client"), "{s:?}");
                local += 1;
            }
        }
    }
    assert_eq!(ok, 5);
    assert_eq!(received.load(Ordering::SeqCst), ok + exhausted);
    assert!(
        local > 200,
        "most calls never sent: {local} throttled, {exhausted} refused"
    );
}

/// The reqwest middleware: retries to the 200 within the budget, a spent budget gives the
/// original answer, and the throttle keeps most calls to a refusing upstream from being sent.
#[cfg(feature = "reqwest")]
#[tokio::test]
async fn the_reqwest_middleware_retries_and_throttles() {
    use tollgate::middleware::{RetryMiddleware, ThrottleMiddleware};

    let (url, seen) = upstream(|n| if n % 3 == 2 { 200 } else { 503 }).await;
    let policy = RetryLayer::new(RetryBudget::new())
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy.clone()))
        .build();
    let res = client.get(format!("{url}/")).send().await.unwrap();
    assert_eq!(
        (res.status().as_u16(), res.text().await.unwrap()),
        (200, "answer 2".into())
    );
    let res = client.post(format!("{url}/")).send().await.unwrap();
    assert_eq!(res.status(), 503, "a POST is not retried");
    let res = client
        .post(format!("{url}/"))
        .with_extension(RetrySafe)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "unless marked safe");
    assert_eq!(seen.load(Ordering::SeqCst), 6);

    let (url, seen) = upstream(|_| 503).await;
    let spent = RetryBudget::builder().min_per_second(0.0).build().unwrap();
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(
            RetryLayer::new(spent.clone())
                .backoff(Duration::from_millis(1), Duration::from_millis(2)),
        ))
        .with(ThrottleMiddleware::per_host(|host| {
            Throttle::builder().name(host).build().unwrap()
        }))
        .build();
    let mut throttled = 0;
    for _ in 0..300 {
        match client.get(format!("{url}/")).send().await {
            Ok(res) => assert_eq!(res.status(), 503, "the original answer"),
            Err(reqwest_middleware::Error::Middleware(e)) if e.is::<Throttled>() => throttled += 1,
            Err(e) => panic!("{e}"),
        }
    }
    let (calls, retries) = spent.counts();
    assert_eq!(calls, 300);
    assert!(retries <= 30, "{retries}");
    assert!(throttled > 200, "{throttled}");
    assert!(
        seen.load(Ordering::SeqCst) < 100,
        "{}",
        seen.load(Ordering::SeqCst)
    );
}

/// A retry storm on tokio's paused clock: clients offered 10× what an upstream of 16 workers ×
/// 20 ms (800 a second) can take, each call retried up to 3 times. With the budget and the
/// throttle the upstream receives about twice what it accepts, retries stay under 10 % of the
/// calls, and it accepts about all it can; naive retries (no budget, no backoff) multiply
/// what it receives.
#[tokio::test(start_paused = true)]
async fn a_storm_on_the_paused_clock_is_held_to_twice_what_the_upstream_accepts() {
    use tower::util::BoxCloneService;
    type Svc =
        BoxCloneService<http::Request<String>, http::Response<()>, tollgate::client::BoxError>;

    async fn storm(guarded: bool) -> (u64, u64, u64, u64) {
        let workers = Arc::new(tokio::sync::Semaphore::new(16));
        let (received, accepted) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let upstream = {
            let (received, accepted) = (received.clone(), accepted.clone());
            tower::service_fn(move |_req: http::Request<String>| {
                let (workers, received, accepted) =
                    (workers.clone(), received.clone(), accepted.clone());
                async move {
                    received.fetch_add(1, Ordering::Relaxed);
                    let status = match workers.try_acquire() {
                        Ok(_worker) => {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            accepted.fetch_add(1, Ordering::Relaxed);
                            200
                        }
                        Err(_) => 503,
                    };
                    Ok::<_, tollgate::client::BoxError>(
                        http::Response::builder().status(status).body(()).unwrap(),
                    )
                }
            })
        };
        // Ten clients, each with its own budget and throttle.
        let clients: Vec<(Svc, RetryBudget)> = (0..10)
            .map(|_| {
                if guarded {
                    let budget = RetryBudget::new();
                    let svc = ServiceBuilder::new()
                        .layer(RetryLayer::new(budget.clone()))
                        .layer(ThrottleLayer::new(Throttle::new()))
                        .service(upstream.clone());
                    (BoxCloneService::new(svc), budget)
                } else {
                    let budget = RetryBudget::builder().ratio(1000.0).build().unwrap();
                    let svc = ServiceBuilder::new()
                        .layer(
                            RetryLayer::new(budget.clone()).backoff(Duration::ZERO, Duration::ZERO),
                        )
                        .service(upstream.clone());
                    (BoxCloneService::new(svc), budget)
                }
            })
            .collect();
        // 8 000 a second for 3 s: 8 calls a millisecond.
        let mut calls = Vec::new();
        for ms in 0..3000u64 {
            for i in 0..8 {
                let (svc, _) = &clients[((ms * 8 + i) % 10) as usize];
                calls.push(tokio::spawn(
                    svc.clone().oneshot(http::Request::new(String::new())),
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for c in calls {
            let _ = c.await.unwrap();
        }
        let retries: u64 = clients.iter().map(|(_, b)| b.counts().1).sum();
        (
            24_000,
            retries,
            received.load(Ordering::Relaxed),
            accepted.load(Ordering::Relaxed),
        )
    }

    let (calls, retries, received, accepted) = storm(true).await;
    let ratio = received as f64 / accepted as f64;
    assert!(ratio <= 2.3, "received {received}, accepted {accepted}");
    assert!(retries * 10 <= calls, "{retries} retries of {calls} calls");
    // 800 a second for 3 s, less the first windows the throttle takes to learn.
    assert!(accepted >= 2_000, "{accepted} accepted");

    let (_, _, received, accepted) = storm(false).await;
    assert!(
        received as f64 / accepted as f64 > 10.0,
        "naive: received {received}, accepted {accepted}"
    );
}

struct Flaky(Arc<AtomicU64>);

#[tonic::async_trait]
impl helloworld::greeter_server::Greeter for Flaky {
    async fn say_hello(
        &self,
        request: tonic::Request<helloworld::HelloRequest>,
    ) -> Result<tonic::Response<helloworld::HelloReply>, tonic::Status> {
        if self.0.fetch_add(1, Ordering::SeqCst) < 2 {
            return Err(tonic::Status::unavailable("warming up"));
        }
        Ok(tonic::Response::new(helloworld::HelloReply {
            message: format!("Hello {}!", request.into_inner().name),
        }))
    }
}

/// A tonic client retried within the budget: its body buffered (`BufferLayer`), an
/// `UNAVAILABLE` answer retried to the success; with the budget spent, the caller gets the
/// server's `UNAVAILABLE`.
#[tokio::test]
async fn a_tonic_client_is_retried_through_the_buffer() {
    let calls = Arc::new(AtomicU64::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(helloworld::greeter_server::GreeterServer::new(Flaky(
                calls.clone(),
            )))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let stack = |budget: RetryBudget| {
        ServiceBuilder::new()
            .layer(tollgate::client::BufferLayer::new(64 * 1024))
            .layer(
                RetryLayer::new(budget)
                    .safe(|_| true)
                    .backoff(Duration::from_millis(1), Duration::from_millis(5)),
            )
            .map_request(|r: http::Request<Full<Bytes>>| r.map(tonic::body::Body::new))
            .service(channel.clone())
    };
    let mut client = helloworld::greeter_client::GreeterClient::new(stack(RetryBudget::new()));
    let reply = client
        .say_hello(helloworld::HelloRequest {
            name: "again".into(),
        })
        .await
        .unwrap();
    assert_eq!(reply.into_inner().message, "Hello again!");
    assert_eq!(calls.load(Ordering::SeqCst), 3, "two retries");

    calls.store(0, Ordering::SeqCst);
    let spent = RetryBudget::builder().min_per_second(0.0).build().unwrap();
    let mut client = helloworld::greeter_client::GreeterClient::new(stack(spent));
    let err = client
        .say_hello(helloworld::HelloRequest { name: "x".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no budget, no retry");
}
