//! What `RlsBackend` costs and saves, against a running rate limit service (`RLS_URL`, domain
//! `DOMAIN`, default `edge`): used by `scripts/bench-rls-client.sh`. Prints one line per
//! measurement:
//!
//! - `flood`: one key over its limit (the rule `client`, e.g. 10 an hour), `FLOOD` decisions
//!   (10 000) one after another: how many reached the service (the rest answered by the deny
//!   cache);
//! - `latency`: `SAMPLES` decisions (5 000) for fresh keys one at a time, through the backend
//!   and as the same `ShouldRateLimit` calls made directly on a tonic client: p50 and p99 of
//!   each, and the p99 added;
//! - `throughput`: decisions per second through the backend for `DURATION` seconds (5), `CONCURRENCY`
//!   (64) in flight, fresh keys; with `REDIS_URL` set, the same through a `RedisBackend`, side
//!   by side;
//! - `hung` (with `HUNG_URL`: a server that accepts and never answers): `SAMPLES / 10`
//!   decisions with a 20-ms deadline, failing open: the worst decision time.
//!
//! ```text
//! RLS_URL=http://127.0.0.1:8081 cargo run --release --example rls_client_bench --features rls-client,redis
//! ```

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate::backend::Backend;
use tollgate::backend::remote::FailurePolicy;
use tollgate::backend::rls::{RlsBackend, descriptor};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::{Key, Policy, Quota};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Decisions per second through `backend` for `secs`, `concurrency` in flight, fresh keys.
async fn throughput<B: Backend + Clone>(
    backend: B,
    policy: Policy,
    secs: u64,
    concurrency: usize,
) -> f64
where
    B::Policy: Send + Sync,
{
    let p = Arc::new(
        backend
            .prepare(&policy, &policy.validate().unwrap())
            .unwrap(),
    );
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (backend, p, done) = (backend.clone(), p.clone(), done.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < until {
                    let key = Key::from_bytes(format!("t{t}-{i}")).unwrap();
                    let _ = backend.decide(&p, &key, NonZeroU32::MIN).await;
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / secs as f64
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url: String = env_or("RLS_URL", "http://127.0.0.1:8081".to_owned());
    let domain: String = env_or("DOMAIN", "edge".to_owned());
    let flood: u64 = env_or("FLOOD", 10_000);
    let samples: usize = env_or("SAMPLES", 5_000);
    let secs: u64 = env_or("DURATION", 5);
    let concurrency: usize = env_or("CONCURRENCY", 64);
    let policy = Policy::new("client", Quota::per_hour(10).fixed_window());
    let backend = RlsBackend::builder()
        .url(&url)
        .domain(&domain)
        .timeout(Duration::from_millis(200))
        .on_failure(FailurePolicy::FailClosed)
        .build()?;
    let p = backend.prepare(&policy, &policy.validate()?)?;

    // A denial flood: one key, over its limit after 10.
    let key = Key::from_bytes(format!("flood-{}", std::process::id()))?;
    let (mut allowed, mut refused) = (0u64, 0u64);
    let before = backend.stats().calls;
    for _ in 0..flood {
        match backend.decide(&p, &key, NonZeroU32::MIN).await {
            Ok(d) if d.is_allowed() => allowed += 1,
            Ok(_) => refused += 1,
            Err(e) => return Err(format!("flood: {e}").into()),
        }
    }
    let calls = backend.stats().calls - before;
    println!(
        "flood: {flood} decisions, {allowed} admitted, {refused} refused; {calls} calls to the \
         service ({:.2}% of the decisions; {:.2}% fewer)",
        100.0 * calls as f64 / flood as f64,
        100.0 - 100.0 * calls as f64 / flood as f64
    );

    // Latency, one at a time, fresh keys: through the backend, and the same calls direct.
    let mut client = RateLimitServiceClient::connect(url.clone()).await?;
    let run = std::process::id();
    let mut direct = Vec::with_capacity(samples);
    let mut through = Vec::with_capacity(samples);
    for i in 0..samples {
        let value = format!("l{run}-{i}");
        let start = Instant::now();
        client
            .should_rate_limit(RateLimitRequest {
                domain: domain.clone(),
                descriptors: vec![descriptor(&[("client", &format!("d-{value}"))])],
                hits_addend: 1,
            })
            .await?;
        direct.push(start.elapsed());
        let key = Key::from_bytes(format!("b-{value}"))?;
        let start = Instant::now();
        backend.decide(&p, &key, NonZeroU32::MIN).await?;
        through.push(start.elapsed());
    }
    direct.sort();
    through.sort();
    println!(
        "latency: direct p50 {:.3} ms p99 {:.3} ms; through RlsBackend p50 {:.3} ms p99 {:.3} ms; \
         p99 added {:.3} ms",
        ms(percentile(&direct, 0.5)),
        ms(percentile(&direct, 0.99)),
        ms(percentile(&through, 0.5)),
        ms(percentile(&through, 0.99)),
        ms(percentile(&through, 0.99)) - ms(percentile(&direct, 0.99)),
    );

    let per_s = throughput(backend.clone(), policy.clone(), secs, concurrency).await;
    println!("throughput: RlsBackend {per_s:.0} decisions/s ({concurrency} in flight)");
    #[cfg(feature = "redis")]
    if let Ok(redis_url) = std::env::var("REDIS_URL") {
        let redis = tollgate::backend::redis::RedisBackend::builder()
            .url(redis_url)
            .build()?;
        let per_s = throughput(redis, policy.clone(), secs, concurrency).await;
        println!("throughput: RedisBackend {per_s:.0} decisions/s ({concurrency} in flight)");
    }

    if let Ok(hung) = std::env::var("HUNG_URL") {
        let backend = RlsBackend::builder()
            .url(hung)
            .domain(&domain)
            .timeout(Duration::from_millis(20))
            .on_failure(FailurePolicy::FailOpen)
            .circuit_breaker(u32::MAX, Duration::from_secs(1))
            .build()?;
        let p = backend.prepare(&policy, &policy.validate()?)?;
        let mut worst = Duration::ZERO;
        let mut times = Vec::new();
        for i in 0..samples / 10 {
            let key = Key::from_bytes(format!("h{i}"))?;
            let start = Instant::now();
            let d = backend.decide(&p, &key, NonZeroU32::MIN).await?;
            assert!(d.is_allowed());
            worst = worst.max(start.elapsed());
            times.push(start.elapsed());
        }
        times.sort();
        println!(
            "hung: {} decisions with a 20-ms deadline (breaker off): p50 {:.3} ms, p99 {:.3} ms, \
             worst {:.3} ms ({:.3} ms past the deadline)",
            times.len(),
            ms(percentile(&times, 0.5)),
            ms(percentile(&times, 0.99)),
            ms(worst),
            ms(worst) - 20.0
        );
    }
    Ok(())
}
