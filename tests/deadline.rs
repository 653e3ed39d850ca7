//! Deadlines over real sockets: a request past its caller's deadline is answered and its work
//! dropped (before it starts, while it runs, while it waits in an adaptive limit's queue),
//! and the time left travels to the calls it makes.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit, QueueOrder};
use tollgate::deadline::{Deadline, DeadlineExceeded, DeadlineLayer, PropagateDeadlineLayer};
use tower::{ServiceBuilder, ServiceExt};

const HEADER: http::HeaderName = http::HeaderName::from_static("x-request-timeout-ms");

/// A handler that works `ms`, counting the work started and finished.
fn worker(ms: u64, started: Arc<AtomicU64>, finished: Arc<AtomicU64>) -> Router {
    Router::new().route(
        "/",
        get(move || async move {
            started.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            finished.fetch_add(1, Ordering::SeqCst);
            "done"
        }),
    )
}

async fn get_with(url: &str, timeout_ms: Option<&str>) -> (u16, Duration) {
    let mut req = reqwest::Client::new().get(url);
    if let Some(ms) = timeout_ms {
        req = req.header(HEADER, ms);
    }
    let start = Instant::now();
    let res = req.send().await.unwrap();
    (res.status().as_u16(), start.elapsed())
}

#[tokio::test]
async fn work_past_the_callers_deadline_is_dropped() {
    let (started, finished) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let app =
        worker(300, started.clone(), finished.clone()).layer(DeadlineLayer::new().header(HEADER));
    let url = support::serve_app(app).await;

    // No time left: answered at once, never started.
    let (status, _) = get_with(&url, Some("0")).await;
    assert_eq!((status, started.load(Ordering::SeqCst)), (504, 0));

    // 50 ms: started, dropped at the deadline, answered then.
    let (status, took) = get_with(&url, Some("50")).await;
    assert_eq!(status, 504);
    assert!(took < Duration::from_millis(250), "{took:?}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(started.load(Ordering::SeqCst), 1);
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the work was dropped with the request"
    );

    // Enough time, or none stated: served.
    assert_eq!(get_with(&url, Some("5000")).await.0, 200);
    assert_eq!(get_with(&url, None).await.0, 200);
    assert_eq!(get_with(&url, Some("not a number")).await.0, 200);
    assert_eq!(finished.load(Ordering::SeqCst), 3);
}

/// A request waiting in an adaptive limit's queue is dropped when its deadline passes there,
/// and never takes a slot.
#[tokio::test]
async fn a_request_waiting_in_the_queue_is_dropped_at_its_deadline() {
    let (started, finished) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let limit = AdaptiveLimit::builder()
        .initial(1)
        .range(1, 1)
        .queue(8, QueueOrder::Fifo)
        .build()
        .unwrap();
    let app = worker(400, started.clone(), finished.clone())
        .layer(AdaptiveLayer::new(limit.clone()).queue_deadline(Duration::from_secs(5)))
        .layer(DeadlineLayer::new().header(HEADER));
    let url = support::serve_app(app).await;
    let holder = tokio::spawn({
        let url = url.clone();
        async move { get_with(&url, None).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, took) = get_with(&url, Some("100")).await;
    assert_eq!(status, 504, "dropped in the queue");
    assert!(took < Duration::from_millis(300), "{took:?}");
    assert_eq!(holder.await.unwrap().0, 200);
    assert_eq!(
        started.load(Ordering::SeqCst),
        1,
        "the dropped request never started"
    );
    assert_eq!(limit.in_flight(), 0);
    assert_eq!(limit.waiting(), 0, "and left the queue");
}

/// A service with a deadline calls another: the callee is told the time left, less the
/// margin; a call with no time left is not sent.
#[tokio::test]
async fn the_time_left_travels_to_the_calls_a_request_makes() {
    let seen = Arc::new(AtomicU64::new(u64::MAX));
    let callee_seen = seen.clone();
    let callee = Router::new().route(
        "/",
        get(move |headers: http::HeaderMap| async move {
            let ms = headers
                .get(HEADER)
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(0);
            callee_seen.store(ms, Ordering::SeqCst);
            "callee"
        }),
    );
    let callee_url = support::serve_app(callee).await;
    let client = ServiceBuilder::new()
        .layer(
            PropagateDeadlineLayer::new()
                .header(HEADER)
                .margin(Duration::from_millis(20)),
        )
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    let caller = Router::new()
        .route(
            "/",
            get(move || {
                let client = client.clone();
                let url = format!("{callee_url}/");
                async move {
                    let req = http::Request::get(&url).body(Full::default()).unwrap();
                    let res = client.oneshot(req).await.unwrap();
                    let body = res.into_body().collect().await.unwrap().to_bytes();
                    String::from_utf8(body.to_vec()).unwrap()
                }
            }),
        )
        .layer(DeadlineLayer::new().header(HEADER));
    let url = support::serve_app(caller).await;
    assert_eq!(get_with(&url, Some("1000")).await.0, 200);
    let told = seen.load(Ordering::SeqCst);
    assert!((800..=980).contains(&told), "the callee was told {told} ms");

    // No time left: not sent.
    let client = ServiceBuilder::new()
        .layer(PropagateDeadlineLayer::new().header(HEADER))
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    seen.store(u64::MAX, Ordering::SeqCst);
    let mut req = http::Request::get(format!("{url}/"))
        .body(Full::default())
        .unwrap();
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(2)));
    let err = client.oneshot(req).await.unwrap_err();
    assert!(err.is::<DeadlineExceeded>(), "{err}");
}

#[path = "../examples/proto/helloworld.rs"]
mod helloworld;

struct SlowGreeter(Arc<AtomicU64>);

#[tonic::async_trait]
impl helloworld::greeter_server::Greeter for SlowGreeter {
    async fn say_hello(
        &self,
        request: tonic::Request<helloworld::HelloRequest>,
    ) -> Result<tonic::Response<helloworld::HelloReply>, tonic::Status> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(tonic::Response::new(helloworld::HelloReply {
            message: format!("Hello {}!", request.into_inner().name),
        }))
    }
}

/// A tonic call whose deadline (the header, as a gateway sets it) is shorter than the work:
/// `DEADLINE_EXCEEDED` from the layer, and the work dropped. (A `grpc-timeout` is enforced by
/// tonic's server itself too, which answers `CANCELLED` at the same instant.)
#[tokio::test]
async fn grpc_calls_past_their_timeout_are_dropped() {
    let finished = Arc::new(AtomicU64::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .layer(DeadlineLayer::new().header(HEADER))
        .add_service(helloworld::greeter_server::GreeterServer::new(SlowGreeter(
            finished.clone(),
        )));
    tokio::spawn(
        server.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut client = helloworld::greeter_client::GreeterClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let mut req = tonic::Request::new(helloworld::HelloRequest { name: "x".into() });
    req.metadata_mut()
        .insert("x-request-timeout-ms", "50".parse().unwrap());
    let err = client.say_hello(req).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert_eq!(err.message(), "the caller's deadline passed");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(finished.load(Ordering::SeqCst), 0);
    let ok = client
        .say_hello(helloworld::HelloRequest { name: "y".into() })
        .await
        .unwrap();
    assert_eq!(ok.into_inner().message, "Hello y!");
}
