//! Run with: `cargo run --example rls --features rls` (add `redis`, `postgres` or `mysql` to
//! the features for the shared stores).
//!
//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`) on
//! `127.0.0.1:8081` (`PORT` picks another), with the gRPC health service
//! (`grpc.health.v1`). Its rules are `examples/rls.yaml` (`RULES_FILE` reads others, in
//! envoyproxy/ratelimit's format): domain `edge`; `remote_address`, any value: 5 a second,
//! bursts of 10, per address; `generic_key` = `expensive`: 2 a second, bursts of 2. Buckets
//! are in this process (`BACKEND=local`, the default) or in a shared store, where several of
//! these servers, and the layers of the services behind the gateway, share one limit:
//!
//! - `BACKEND=redis`: `REDIS_URL` (default `redis://127.0.0.1:6379`), or a Redis Cluster's
//!   nodes in `REDIS_CLUSTER_NODES` (comma-separated URLs); the deny cache is on;
//! - `BACKEND=redis_approx`: the approximate mode on the same (`APPROX=async`, the default, or
//!   `sync`); window quotas only (`rate_limit` rules are fixed windows);
//! - `BACKEND=postgres` or `mysql`: `DATABASE_URL` (default
//!   `postgres://postgres@127.0.0.1:5432/test`, `mysql://root@127.0.0.1:3306/test`), the
//!   table made if missing.
//!
//! `ON_FAILURE` is what a call gets while the store cannot decide: `fallback` (the default,
//! this instance at its share), `open`, or `closed` (`UNAVAILABLE`: Envoy's
//! `failure_mode_deny` decides). `RULES_DIR` serves every `.yaml` file of a directory, one
//! domain each (envoyproxy/ratelimit's layout), instead of one `RULES_FILE`. Changed rules
//! are read again within a second (live keys keep what they used).
//! `RESPONSE_DYNAMIC_METADATA=true` (envoyproxy/ratelimit's name) sends the rules' `metadata`
//! back as the answer's dynamic metadata. `HEADERS=off` leaves the IETF `RateLimit` fields out
//! of the answers. Ctrl-C or SIGTERM stops it gracefully (calls in flight are answered).
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

/// Where the rules come from: `RULES_DIR` (every `.yaml` or `.yml` file in it, one domain
/// each, as envoyproxy/ratelimit reads its directory), `RULES_FILE` (one file), or the file
/// shipped beside this example.
fn rule_files() -> Result<Vec<std::path::PathBuf>, Box<dyn std::error::Error>> {
    if let Ok(dir) = std::env::var("RULES_DIR") {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| format!("RULES_DIR {dir}: {e}"))? {
            let path = entry?.path();
            let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
            if yaml && path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        return Ok(files);
    }
    Ok(std::env::var("RULES_FILE")
        .map(Into::into)
        .into_iter()
        .collect())
}

/// The rules, one per domain (see [`rule_files`]).
pub(crate) fn rules() -> Result<Vec<RlsConfig>, Box<dyn std::error::Error>> {
    let files = rule_files()?;
    if files.is_empty() && std::env::var("RULES_DIR").is_err() {
        return Ok(vec![RlsConfig::from_yaml(include_str!("rls.yaml"))?]);
    }
    let mut configs = Vec::with_capacity(files.len());
    for path in files {
        let text = std::fs::read_to_string(&path)?;
        let config = RlsConfig::from_yaml(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        configs.push(config);
    }
    Ok(configs)
}

fn port() -> u16 {
    std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(8081)
}

/// With `RULES_FILE` or `RULES_DIR`, reads the rules again when a file changes, comes or
/// goes (checked every second) and swaps them all in at once; rules that do not load are
/// reported and change nothing.
fn watch_rules<B: Backend>(service: RlsService<B>) {
    if std::env::var("RULES_FILE").is_err() && std::env::var("RULES_DIR").is_err() {
        return;
    }
    tokio::spawn(async move {
        let seen = || {
            let files = rule_files().unwrap_or_default();
            (files.into_iter())
                .map(|f| {
                    let modified = std::fs::metadata(&f).and_then(|m| m.modified()).ok();
                    (f, modified)
                })
                .collect::<Vec<_>>()
        };
        let mut last = seen();
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let now = seen();
            if now == last {
                continue;
            }
            last = now;
            let loaded = rules().map_err(|e| e.to_string()).and_then(|configs| {
                let domains: Vec<String> = configs.iter().map(|c| c.domain().into()).collect();
                (service.replace_all(configs).map_err(|e| e.to_string())).map(|()| domains)
            });
            match loaded {
                Ok(domains) => println!("rules reloaded: domains {domains:?}"),
                Err(e) => eprintln!("rules not reloaded (the old ones stay): {e}"),
            }
        }
    });
}

/// Serves `service` on `PORT` until Ctrl-C or SIGTERM.
async fn serve<B: Backend>(service: RlsService<B>) -> Result<(), Box<dyn std::error::Error>> {
    let service = (service.headers(std::env::var("HEADERS").as_deref() != Ok("off")))
        .dynamic_metadata(std::env::var("RESPONSE_DYNAMIC_METADATA").as_deref() == Ok("true"));
    watch_rules(service.clone());
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port()));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let domains: Vec<String> = (service.configs().iter())
        .map(|c| c.domain().to_owned())
        .collect();
    println!("rate limit service on {addr} (domains {domains:?})");
    serve_on(service, listener, stopped()).await?;
    Ok(())
}

/// The server: `service` and the gRPC health service reporting it serving, on `listener`,
/// until `stop` (calls in flight are answered first).
pub(crate) async fn serve_on<B: Backend>(
    service: RlsService<B>,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<RateLimitServiceServer<RlsService<B>>>()
        .await;
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(
            // Nagle's algorithm off, as `serve` (the bare mode's) sets it.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop,
        )
        .await
}

/// Ctrl-C, or SIGTERM (what Kubernetes and systemd send).
async fn stopped() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
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
        .serve_with_shutdown(addr, stopped())
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

/// `ON_FAILURE`: `open`, `closed` (the call fails with `UNAVAILABLE`, and Envoy's
/// `failure_mode_deny` decides) or `fallback` (the default: this instance at its share).
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
fn failure_policy() -> Result<tollgate::backend::remote::FailurePolicy, Box<dyn std::error::Error>>
{
    use tollgate::backend::remote::FailurePolicy;
    Ok(match std::env::var("ON_FAILURE").as_deref() {
        Ok("open") => FailurePolicy::FailOpen,
        Ok("closed") => FailurePolicy::FailClosed,
        Ok("fallback") | Ok("local") | Err(_) => FailurePolicy::FallbackLocal,
        Ok(other) => {
            return Err(
                format!("unknown ON_FAILURE={other:?}: use open, closed or fallback").into(),
            );
        }
    })
}

/// `BACKEND=redis` or `redis_approx`: the nodes of `REDIS_CLUSTER_NODES` (comma-separated
/// URLs) when set, else `REDIS_URL`.
#[cfg(feature = "redis")]
fn redis() -> Result<tollgate::backend::redis::RedisBackendBuilder, Box<dyn std::error::Error>> {
    use tollgate::backend::redis::RedisBackend;
    let builder = match std::env::var("REDIS_CLUSTER_NODES") {
        Ok(nodes) if !nodes.trim().is_empty() => RedisBackend::builder().cluster_nodes(
            (nodes.split(','))
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect::<Vec<_>>(),
        ),
        _ => RedisBackend::builder()
            .url(std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())),
    };
    Ok(builder.on_failure(failure_policy()?))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("client") {
        return client().await;
    }
    // Logs as a deployed server writes them (`RUST_LOG`, warnings by default). Without a
    // subscriber, the spans h2 opens per call are formatted for the `log` crate instead: 12 %
    // of this example's instructions per call, which tollgate-server does not spend.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let config = rules()?;
    match std::env::var("BACKEND").as_deref() {
        // The floor of `scripts/bench-rls.sh`: the same server answering OK, deciding nothing.
        Ok("none") => serve_bare().await,
        Err(_) | Ok("local") => {
            serve(RlsService::with_domains(
                tollgate::backend::LocalBackend::new(),
                config,
            )?)
            .await
        }
        #[cfg(feature = "redis")]
        Ok("redis") => serve(RlsService::with_domains(redis()?.build()?, config)?).await,
        #[cfg(feature = "redis")]
        Ok("redis_approx") => {
            use tollgate::backend::redis::Approximate;
            let mode = match std::env::var("APPROX").as_deref() {
                Ok("sync") => Approximate::synchronous(),
                Ok("async") | Err(_) => Approximate::asynchronous(),
                Ok(other) => return Err(format!("unknown APPROX={other:?}: async or sync").into()),
            };
            serve(RlsService::with_domains(
                redis()?.build_approximate(mode)?,
                config,
            )?)
            .await
        }
        #[cfg(feature = "postgres")]
        Ok("postgres") => {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let backend = tollgate::backend::postgres::PostgresBackend::builder()
                .url(url)
                .on_failure(failure_policy()?)
                .build()?;
            backend.migrate().await?;
            serve(RlsService::with_domains(backend, config)?).await
        }
        #[cfg(feature = "mysql")]
        Ok("mysql") => {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
            let backend = tollgate::backend::mysql::MysqlBackend::builder()
                .url(url)
                .on_failure(failure_policy()?)
                .build()?;
            backend.migrate().await?;
            serve(RlsService::with_domains(backend, config)?).await
        }
        Ok(other) => Err(format!(
            "BACKEND={other:?}: use local, redis or redis_approx (built with the `redis` \
             feature), postgres, mysql (with theirs), or none"
        )
        .into()),
    }
}
