//! Run with: `cargo run --release --example rls_load --features rls` (against a rate limit
//! service already running: `scripts/bench-rls.sh` starts one per mode and runs this).
//!
//! A load generator for Envoy's rate limit service: `CONCURRENCY` calls in flight (64) over
//! `CONNECTIONS` HTTP/2 connections (4) to `ADDR` (`http://127.0.0.1:8081`), each call one
//! descriptor `remote_address` of domain `edge`, the addresses cycling over `KEYS` distinct
//! values (10 000); `WARMUP` (2 s) unmeasured, then `DURATION` (10 s) measured. Prints one
//! line: `calls/s <n> ok <n> over <n> errors <n>`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn secs(name: &str, default: f64) -> Duration {
    let v: String = env(name, format!("{default}s"));
    Duration::from_secs_f64(v.trim_end_matches('s').parse().unwrap_or(default))
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    over: AtomicU64,
    errors: AtomicU64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: String = env("ADDR", "http://127.0.0.1:8081".to_owned());
    let connections: usize = env("CONNECTIONS", 4).max(1);
    let concurrency: usize = env("CONCURRENCY", 64).max(1);
    let keys: u64 = env("KEYS", 10_000).max(1);
    let (warmup, duration) = (secs("WARMUP", 2.0), secs("DURATION", 10.0));
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections {
        // One connection each: a channel made by `connect` is one HTTP/2 connection.
        channels.push(
            tonic::transport::Endpoint::from_shared(addr.clone())?
                .connect()
                .await?,
        );
    }
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let mut tasks = Vec::with_capacity(concurrency);
    for t in 0..concurrency {
        let mut client = RateLimitServiceClient::new(channels[t % connections].clone());
        let (counting, stop, counts) = (counting.clone(), stop.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = t as u64;
            while !stop.load(Ordering::Relaxed) {
                let n = i % keys;
                i += concurrency as u64;
                let address = format!("10.{}.{}.{}", n >> 16 & 255, n >> 8 & 255, n & 255);
                let request = RateLimitRequest {
                    domain: "edge".into(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: "remote_address".into(),
                            value: address,
                        }],
                        ..Default::default()
                    }],
                    hits_addend: 1,
                };
                let answer = client.should_rate_limit(request).await;
                if !counting.load(Ordering::Relaxed) {
                    continue;
                }
                let counter = match answer.map(|r| r.into_inner().overall_code()) {
                    Ok(Code::OverLimit) => &counts.over,
                    Ok(_) => &counts.ok,
                    Err(_) => &counts.errors,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(warmup).await;
    counting.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    counting.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let (ok, over, errors) = (
        counts.ok.load(Ordering::Relaxed),
        counts.over.load(Ordering::Relaxed),
        counts.errors.load(Ordering::Relaxed),
    );
    println!(
        "calls/s {:.0} ok {ok} over {over} errors {errors}",
        (ok + over + errors) as f64 / elapsed
    );
    Ok(())
}
