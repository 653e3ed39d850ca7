//! Run with: `cargo run --example rls --features rls` (add `redis` to the features for
//! `BACKEND=redis`).
//!
//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`) on
//! `127.0.0.1:8081` (`PORT` picks another), with the gRPC health service
//! (`grpc.health.v1`). Its rules are `examples/rls.yaml` (`RULES_FILE` reads others, in
//! envoyproxy/ratelimit's format): domain `edge`; `remote_address`, any value: 5 a second,
//! bursts of 10, per address; `generic_key` = `expensive`: 2 a second, bursts of 2. Buckets
//! are in this process (`BACKEND=local`, the default) or in Redis (`BACKEND=redis`,
//! `REDIS_URL`, default `redis://127.0.0.1:6379`), where several of these servers, and the
//! layers of the services behind the gateway, share one limit. A changed `RULES_FILE` is read
//! again within a second (live keys keep what they used). `HEADERS=off` leaves the IETF
//! `RateLimit` fields out of the answers. Ctrl-C stops it gracefully.
//!
//! Point Envoy at it (see `docs/envoy.md`), or ask it with the bundled client, eleven times
//! for one address:
//!
//! ```text
//! $ cargo run --example rls --features rls -- client
//! 1: OK remaining 9  ratelimit: "edge.remote_address";r=9;t=1
//! ...
//! 10: OK remaining 0  ratelimit: "edge.remote_address";r=0;t=1
//! 11: OVER_LIMIT remaining 0  ratelimit: "edge.remote_address";r=0;t=1  retry-after: 1
//! ```

use std::net::{Ipv4Addr, SocketAddr};

use tollgate::backend::Backend;
use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus,
};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use tollgate::rls::{RlsConfig, RlsService};

/// The rules: `RULES_FILE`, or the file shipped beside this example.
fn rules() -> Result<RlsConfig, Box<dyn std::error::Error>> {
    let text = match std::env::var("RULES_FILE") {
        Ok(path) => std::fs::read_to_string(path)?,
        Err(_) => include_str!("rls.yaml").to_owned(),
    };
    Ok(RlsConfig::from_yaml(&text)?)
}

fn port() -> u16 {
    std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(8081)
}

/// With `RULES_FILE`, reads the file again when it changes (checked every second) and swaps
/// the rules in; a file that does not parse is reported and changes nothing.
fn watch_rules<B: Backend>(service: RlsService<B>) {
    let Ok(path) = std::env::var("RULES_FILE") else {
        return;
    };
    tokio::spawn(async move {
        let modified = || std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        let mut seen = modified();
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let now = modified();
            if now == seen {
                continue;
            }
            seen = now;
            let read = std::fs::read_to_string(&path).map_err(|e| e.to_string());
            let config =
                read.and_then(|text| RlsConfig::from_yaml(&text).map_err(|e| e.to_string()));
            match config.and_then(|c| service.replace(c).map_err(|e| e.to_string())) {
                Ok(()) => println!("rules reloaded from {path}"),
                Err(e) => eprintln!("rules in {path} not loaded (the old ones stay): {e}"),
            }
        }
    });
}

/// Serves `service` until Ctrl-C, with the health service reporting it serving.
async fn serve<B: Backend>(service: RlsService<B>) -> Result<(), Box<dyn std::error::Error>> {
    let service = service.headers(std::env::var("HEADERS").as_deref() != Ok("off"));
    watch_rules(service.clone());
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port()));
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<RateLimitServiceServer<RlsService<B>>>()
        .await;
    println!(
        "rate limit service on {addr} (domain {:?})",
        service.config().domain()
    );
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(service.into_server())
        .serve_with_shutdown(addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// `BACKEND=none`: a bare rate limit service on the same server, answering every descriptor
/// OK without deciding (what `scripts/bench-rls.sh` measures tollgate against).
struct Bare;

#[tonic::async_trait]
impl RateLimitService for Bare {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let statuses = (request.into_inner().descriptors.iter())
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect();
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses,
            ..Default::default()
        }))
    }
}

async fn serve_bare() -> Result<(), Box<dyn std::error::Error>> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port()));
    println!("bare rate limit service on {addr}");
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(Bare))
        .serve_with_shutdown(addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Asks eleven times for one address, printing each answer.
async fn client() -> Result<(), Box<dyn std::error::Error>> {
    let mut client =
        RateLimitServiceClient::connect(format!("http://127.0.0.1:{}", port())).await?;
    for i in 1..=11 {
        let r = client
            .should_rate_limit(RateLimitRequest {
                domain: "edge".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "remote_address".into(),
                        value: "10.0.0.1".into(),
                    }],
                    ..Default::default()
                }],
                hits_addend: 1,
            })
            .await?
            .into_inner();
        let headers: Vec<String> = (r.response_headers_to_add.iter())
            .filter(|h| h.key != "ratelimit-policy")
            .map(|h| format!("{}: {}", h.key, h.value))
            .collect();
        println!(
            "{i}: {} remaining {}  {}",
            r.overall_code().as_str_name(),
            r.statuses.first().map_or(0, |s| s.limit_remaining),
            headers.join("  ")
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("client") {
        return client().await;
    }
    let config = rules()?;
    match std::env::var("BACKEND").as_deref() {
        // The floor of `scripts/bench-rls.sh`: the same server answering OK, deciding nothing.
        Ok("none") => serve_bare().await,
        Err(_) | Ok("local") => {
            serve(RlsService::new(
                tollgate::backend::LocalBackend::new(),
                config,
            )?)
            .await
        }
        #[cfg(feature = "redis")]
        Ok("redis") => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            let backend = tollgate::backend::redis::RedisBackend::builder()
                .url(url)
                .build()?;
            serve(RlsService::new(backend, config)?).await
        }
        Ok(other) => Err(format!(
            "BACKEND={other:?}: use local, redis (built with the `redis` feature), or none"
        )
        .into()),
    }
}
