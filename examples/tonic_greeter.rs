//! Run with: cargo run --example tonic_greeter --features tonic
//!
//! Serves the standard `helloworld.Greeter/SayHello` gRPC service on `127.0.0.1:50051`
//! (`PORT` picks another port), limited per peer IP to 1 call per second with bursts of 5.
//! No `protoc` is needed: the generated code is checked in (`examples/proto/helloworld.rs`).
//!
//! In a second terminal, call it seven times in a row with the bundled client:
//!
//! ```text
//! $ cargo run --example tonic_greeter --features tonic -- client
//! 1: ok: "Hello Tonic!"  ratelimit: "greeter";r=4;t=1
//! 2: ok: "Hello Tonic!"  ratelimit: "greeter";r=3;t=2
//! ...
//! 5: ok: "Hello Tonic!"  ratelimit: "greeter";r=0;t=5
//! 6: ResourceExhausted: "rate limit exceeded"  retry-after: 1
//! 7: ResourceExhausted: "rate limit exceeded"  retry-after: 1
//! ```
//!
//! or with `grpcurl` (`-plaintext -proto examples/proto/helloworld.proto -d '{"name":"Tonic"}'
//! 127.0.0.1:50051 helloworld.Greeter/SayHello`): the sixth call within a second fails with
//! `Code: ResourceExhausted`, and one more call is allowed every second after that.

use std::net::{Ipv4Addr, SocketAddr};

use tollgate::key::PeerIp;
use tollgate::{Policy, Quota, RateLimitLayer};
use tonic::transport::Server;
use tonic::{Request, Response, Status};

#[path = "proto/helloworld.rs"]
mod helloworld;

use helloworld::greeter_client::GreeterClient;
use helloworld::greeter_server::{Greeter, GreeterServer};
use helloworld::{HelloReply, HelloRequest};

#[derive(Debug, Default)]
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = match std::env::var("PORT") {
        Ok(p) => p.parse()?,
        Err(_) => 50051,
    };
    if std::env::args().nth(1).as_deref() == Some("client") {
        return client(port).await;
    }

    // tonic records the peer address of every TCP connection (`TcpConnectInfo`), which
    // `PeerIp` reads with the `tonic` feature.
    let limit = RateLimitLayer::builder()
        .policy(Policy::new("greeter", Quota::per_second(1).burst(5)))
        .key(PeerIp::new())
        .build()?;

    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    println!("helloworld.Greeter listening on {addr} (5 calls at once, then 1 per second per IP)");
    Server::builder()
        .layer(limit)
        .add_service(GreeterServer::new(MyGreeter))
        .serve(addr)
        .await?;
    Ok(())
}

/// Calls `SayHello` seven times and prints what came back.
async fn client(port: u16) -> Result<(), Box<dyn std::error::Error>> {
    let mut client = GreeterClient::connect(format!("http://127.0.0.1:{port}")).await?;
    for i in 1..=7 {
        let request = Request::new(HelloRequest {
            name: "Tonic".into(),
        });
        match client.say_hello(request).await {
            Ok(res) => {
                let limit = res
                    .metadata()
                    .get("ratelimit")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned();
                println!(
                    "{i}: ok: {:?}  ratelimit: {limit}",
                    res.into_inner().message
                );
            }
            Err(status) => {
                let retry = status
                    .metadata()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-");
                println!(
                    "{i}: {:?}: {:?}  retry-after: {retry}",
                    status.code(),
                    status.message()
                );
            }
        }
    }
    Ok(())
}
