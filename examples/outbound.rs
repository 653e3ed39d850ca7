//! Run with: `cargo run --example outbound` (`--features redis` for `BACKEND=redis`).
//!
//! Workers calling an upstream through a client wrapped in tollgate's wait mode: the calls this
//! process makes keep to a shared rate, each worker waiting its turn instead of failing.
//!
//! Environment:
//! - `UPSTREAM_URL`: the URL to call (`GET`); when unset, the example starts its own stand-in
//!   upstream on a free local port, which counts the calls it gets.
//! - `RATE` (default `20/s`): the rate in the configuration syntax (`"20/s"`, `"5/s burst 1"`,
//!   `"1000/min"`).
//! - `WORKERS` (default 8): concurrent workers; `CALLS` (default 100): calls this process makes
//!   in all.
//! - `BACKEND=local|redis` (default `local`), with `REDIS_URL` (default
//!   `redis://127.0.0.1:6379`): on Redis, every process started against the same Redis shares
//!   the rate, so two of them together keep to `RATE`.
//!
//! It prints one final line: `calls=<made> failed=<failed> elapsed_ms=<ms>`. With the defaults,
//! 100 calls at 20 per second with a burst of 20 take about 4 seconds.
//!
//! The client also paces itself from the upstream's own limit: when an answer's `RateLimit`
//! field says nothing is left (`r=0;t=N`, or the older `X-RateLimit-Remaining: 0`), the next
//! call waits `N` seconds, and a `Retry-After` on a `429` is obeyed the same way
//! (`obey_retry_after`). Against an upstream that sends the fields (another tollgate, GitHub),
//! sequential calls (`WORKERS=1`) never run into its `429`, whatever `RATE` says.
//!
//! ```text
//! $ cargo run -q --example outbound
//! calls=100 failed=0 elapsed_ms=4003
//! $ RATE="10/s burst 1" CALLS=20 cargo run -q --example outbound
//! calls=20 failed=0 elapsed_ms=1901
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::backend::Backend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rate: Quota = std::env::var("RATE")
        .unwrap_or_else(|_| "20/s".into())
        .parse()?;
    let workers: u64 = env_number("WORKERS", 8)?.max(1);
    let calls: u64 = env_number("CALLS", 100)?;
    let upstream = match std::env::var("UPSTREAM_URL") {
        Ok(url) => url,
        Err(_) => format!("http://{}/", stand_in().await?),
    };
    let backend = std::env::var("BACKEND").unwrap_or_else(|_| "local".into());
    let tally = match backend.as_str() {
        "local" => {
            run(
                tollgate::backend::LocalBackend::new(),
                rate,
                workers,
                calls,
                upstream,
            )
            .await?
        }
        #[cfg(feature = "redis")]
        "redis" => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            let redis = tollgate::backend::redis::RedisBackend::builder()
                .url(url)
                .timeout(Duration::from_secs(1))
                .build()?;
            run(redis, rate, workers, calls, upstream).await?
        }
        #[cfg(not(feature = "redis"))]
        "redis" => return Err("BACKEND=redis needs a build with `--features redis`".into()),
        other => return Err(format!("unknown BACKEND={other:?}: use local or redis").into()),
    };
    println!(
        "calls={} failed={} elapsed_ms={}",
        tally.calls,
        tally.failed,
        tally.elapsed.as_millis()
    );
    Ok(())
}

/// What a run did: calls made, calls that failed (an error, or an answer other than 2xx, such
/// as the upstream's `429`), and the time it took.
pub(crate) struct Tally {
    pub(crate) calls: u64,
    pub(crate) failed: u64,
    pub(crate) elapsed: Duration,
}

/// `calls` calls from `workers` workers through one client limited to `rate` on `backend`.
pub(crate) async fn run<B: Backend>(
    backend: B,
    rate: Quota,
    workers: u64,
    calls: u64,
    upstream: String,
) -> Result<Tally, Box<dyn std::error::Error>> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    // One key for the whole partner; wait up to a minute for a turn, every worker may wait.
    let limit = RateLimitLayer::builder()
        .policy(Policy::new("upstream", rate))
        .key(Global)
        .backend(backend)
        .wait(Duration::from_secs(60), workers as usize)
        .obey_retry_after(true)
        .build()?
        .wrap_body();
    let limited = limit.layer(client);
    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (mut svc, next, failed, url) = (
            limited.clone(),
            next.clone(),
            failed.clone(),
            upstream.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < calls {
                let req = Request::get(url.as_str()).body(Empty::new());
                let ok = match req {
                    Ok(req) => match svc.ready().await {
                        Ok(svc) => match svc.call(req).await {
                            Ok(res) => {
                                let ok = res.status().is_success();
                                let _ = res.into_body().collect().await;
                                ok
                            }
                            Err(_) => false,
                        },
                        Err(_) => false,
                    },
                    Err(_) => false,
                };
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    Ok(Tally {
        calls,
        failed: failed.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    })
}

/// A stand-in upstream on a free local port: answers `ok`.
async fn stand_in() -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = Router::new().route("/", get(|| async { "ok" }));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(addr)
}

fn env_number(name: &str, default: u64) -> Result<u64, Box<dyn std::error::Error>> {
    match std::env::var(name) {
        Ok(v) => Ok(v.trim().parse().map_err(|e| format!("{name}={v:?}: {e}"))?),
        Err(_) => Ok(default),
    }
}
