//! The layer in front of a tonic server, called by a real tonic client over real sockets.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tollgate::key::PeerIp;
use tollgate::{OnMissingKey, Policy, Quota, RateLimitLayer};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status};
use tower::ServiceExt;

#[path = "../examples/proto/helloworld.rs"]
mod helloworld;

use helloworld::greeter_client::GreeterClient;
use helloworld::greeter_server::{Greeter, GreeterServer};
use helloworld::{HelloReply, HelloRequest};

struct MyGreeter;

#[tonic::async_trait]
impl Greeter for MyGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let name = request.into_inner().name;
        Ok(Response::new(HelloReply {
            message: format!("Hello {name}!"),
        }))
    }
}

/// Burst 5 like the example, refilling slowly enough (1 a minute) that a slow CI machine
/// cannot see a unit come back in the middle of a test.
fn layer(on_missing_key: OnMissingKey) -> RateLimitLayer<PeerIp, tollgate::backend::LocalBackend> {
    RateLimitLayer::builder()
        .policy(Policy::new("greeter", Quota::per_minute(1).burst(5)))
        .key(PeerIp::new())
        .on_missing_key(on_missing_key)
        .build()
        .unwrap()
}

/// Serves the greeter behind the default layer on `127.0.0.1:<free port>`.
async fn serve_tcp() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::builder()
        .layer(layer(OnMissingKey::default()))
        .add_service(GreeterServer::new(MyGreeter));
    tokio::spawn(server.serve_with_incoming(TcpListenerStream::new(listener)));
    addr
}

async fn connect(addr: SocketAddr, from: Option<IpAddr>) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .local_address(from)
        .connect()
        .await
        .unwrap()
}

fn hello(name: &str) -> Request<HelloRequest> {
    Request::new(HelloRequest { name: name.into() })
}

fn meta<'a>(map: &'a tonic::metadata::MetadataMap, name: &str) -> Option<&'a str> {
    map.get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test]
async fn burst_passes_with_headers_then_resource_exhausted() {
    let addr = serve_tcp().await;
    let mut client = GreeterClient::new(connect(addr, None).await);

    for remaining in (0..5).rev() {
        let res = client.say_hello(hello("Tonic")).await.unwrap();
        assert_eq!(
            meta(res.metadata(), "ratelimit-policy"),
            Some(r#""greeter";q=5;w=300"#)
        );
        let ratelimit = meta(res.metadata(), "ratelimit").unwrap().to_owned();
        assert!(
            ratelimit.starts_with(&format!(r#""greeter";r={remaining};t="#)),
            "{ratelimit}"
        );
        assert_eq!(res.into_inner().message, "Hello Tonic!");
    }

    let status = client.say_hello(hello("Tonic")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "rate limit exceeded");
    let retry: u64 = meta(status.metadata(), "retry-after")
        .expect("retry-after on the rejection")
        .parse()
        .unwrap();
    // One unit comes back a minute after the burst began: within a second of 60 s.
    assert!((59..=60).contains(&retry), "retry-after {retry}");
    assert!(
        meta(status.metadata(), "ratelimit")
            .unwrap()
            .starts_with(r#""greeter";r=0;t="#)
    );
    // The wait, in the forms gRPC clients read: the retry pushback, in milliseconds...
    let pushback: u64 = meta(status.metadata(), "grpc-retry-pushback-ms")
        .expect("pushback on the rejection")
        .parse()
        .unwrap();
    assert!((58_000..=60_000).contains(&pushback), "pushback {pushback}");
    // ...and google.rpc.RetryInfo in the rich status details.
    use tonic_types::StatusExt;
    let info = status
        .get_details_retry_info()
        .expect("RetryInfo in the status details");
    let delay = info.retry_delay.expect("a delay");
    assert!(
        delay.as_millis().abs_diff(u128::from(pushback)) <= 1,
        "{delay:?} vs {pushback}"
    );
}

/// A request that can never pass tells gRPC clients not to retry: a negative pushback.
#[tokio::test]
async fn a_request_that_never_fits_stops_retries() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("greeter", Quota::per_minute(1).burst(5)).cost(6))
        .key(PeerIp::new())
        .build()
        .unwrap();
    let server = Server::builder()
        .layer(layer)
        .add_service(GreeterServer::new(MyGreeter));
    tokio::spawn(server.serve_with_incoming(TcpListenerStream::new(listener)));
    let mut client = GreeterClient::new(connect(addr, None).await);
    let status = client.say_hello(hello("big")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(
        meta(status.metadata(), "grpc-retry-pushback-ms"),
        Some("-1")
    );
    assert!(meta(status.metadata(), "retry-after").is_none());
}

#[tokio::test]
async fn other_peer_ips_keep_their_own_bucket() {
    let addr = serve_tcp().await;
    let mut first = GreeterClient::new(connect(addr, None).await);
    for _ in 0..5 {
        first.say_hello(hello("a")).await.unwrap();
    }
    assert_eq!(
        first.say_hello(hello("a")).await.unwrap_err().code(),
        Code::ResourceExhausted
    );

    // A new connection from the same IP shares the bucket: the key is the IP, not the socket.
    let mut again = GreeterClient::new(connect(addr, None).await);
    assert_eq!(
        again.say_hello(hello("a")).await.unwrap_err().code(),
        Code::ResourceExhausted
    );

    // Another loopback address is another peer: a full burst of its own.
    let mut other = GreeterClient::new(connect(addr, Some("127.0.0.2".parse().unwrap())).await);
    for _ in 0..5 {
        other.say_hello(hello("b")).await.unwrap();
    }
    assert_eq!(
        other.say_hello(hello("b")).await.unwrap_err().code(),
        Code::ResourceExhausted
    );
}

/// A plain (non-gRPC) HTTP/2 request to the same server is answered as HTTP: `429` with
/// `Retry-After` and a text body, not a gRPC status.
#[tokio::test]
async fn non_grpc_requests_get_http_429() {
    let addr = serve_tcp().await;
    let channel = connect(addr, None).await;
    let mut client = GreeterClient::new(channel.clone());
    for _ in 0..5 {
        client.say_hello(hello("a")).await.unwrap();
    }

    let req = http::Request::post(format!("http://{addr}/helloworld.Greeter/SayHello"))
        .header("content-type", "application/json")
        .body(tonic::body::Body::empty())
        .unwrap();
    let res = channel.oneshot(req).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().get("grpc-status").is_none());
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((59..=60).contains(&retry), "retry-after {retry}");
    assert!(res.headers().contains_key("ratelimit"));
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"Too Many Requests"), "{body:?}");
}

/// Serves over a Unix socket, where tonic records no `TcpConnectInfo`: `PeerIp` finds no key.
async fn uds_client(on_missing_key: OnMissingKey) -> GreeterClient<Channel> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let path: PathBuf = std::env::temp_dir().join(format!(
        "tollgate-grpc-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let server = Server::builder()
        .layer(layer(on_missing_key))
        .add_service(GreeterServer::new(MyGreeter));
    tokio::spawn(server.serve_with_incoming(UnixListenerStream::new(listener)));

    // The URI is required but unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .unwrap();
    GreeterClient::new(channel)
}

/// No peer address is the server's setup, not the client's fault: gRPC `INTERNAL` with a
/// generic message (the explanation is logged), whatever the missing-key status.
#[tokio::test]
async fn no_connect_info_is_an_internal_error_by_default() {
    let mut client = uds_client(OnMissingKey::default()).await;
    let status = client.say_hello(hello("a")).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert_eq!(status.message(), "internal error");
    assert!(status.metadata().get("ratelimit").is_none());
}

/// `OnMissingKey::Allow` lets such calls through, unlimited and without rate-limit headers.
#[tokio::test]
async fn no_connect_info_allowed_when_configured() {
    let mut client = uds_client(OnMissingKey::Allow).await;
    for _ in 0..8 {
        let res = client.say_hello(hello("uds")).await.unwrap();
        assert!(res.metadata().get("ratelimit").is_none());
        assert_eq!(res.into_inner().message, "Hello uds!");
    }
}

/// Answers `alice` and refuses everyone else with UNAUTHENTICATED.
struct LoginGreeter;

#[tonic::async_trait]
impl Greeter for LoginGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        match request.into_inner().name.as_str() {
            "alice" => Ok(Response::new(HelloReply {
                message: "welcome".to_owned(),
            })),
            _ => Err(Status::unauthenticated("who are you?")),
        }
    }
}

/// Brute-force protection over gRPC: only UNAUTHENTICATED answers count (their status is in
/// the trailers, read when the response's body ends), and a key with two of them is refused
/// before the service runs.
#[tokio::test]
async fn only_unauthenticated_answers_count() {
    use tollgate::settle::ChargeWhen;
    let limit = RateLimitLayer::builder()
        .policy(Policy::new("login", Quota::per_hour(2)).charge_when(ChargeWhen::grpc_status([16])))
        .key(PeerIp::new())
        .build()
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::builder()
        .layer(limit)
        .add_service(GreeterServer::new(LoginGreeter));
    tokio::spawn(server.serve_with_incoming(TcpListenerStream::new(listener)));
    let mut client = GreeterClient::new(connect(addr, None).await);
    // Successes are free: their status (OK) comes in the trailers, and refunds the unit.
    for _ in 0..5 {
        client.say_hello(hello("alice")).await.unwrap();
    }
    for _ in 0..2 {
        let err = client.say_hello(hello("mallory")).await.unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated);
    }
    let err = client.say_hello(hello("alice")).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
}
