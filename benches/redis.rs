//! Redis backend decision throughput and latency, against a `redis-server` this bench starts.
//!
//! Run with: `cargo bench --bench redis --features redis` (needs `redis-server` on `PATH`).
//! `scripts/bench-redis-ceiling.sh` runs `redis-benchmark` with `EVALSHA` of the same script on
//! the same machine: the ceiling these numbers are to be compared with.

#![allow(missing_docs)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tollgate::backend::Backend;
use tollgate::backend::redis::RedisBackend;
use tollgate::{Key, Policy, Quota};

const ONE: NonZeroU32 = NonZeroU32::MIN;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn backend(url: &str, deny_cache: usize) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .timeout(Duration::from_secs(1))
        .deny_cache_capacity(deny_cache)
        .build()
        .expect("backend")
}

/// A quota that never denies during the bench.
fn roomy() -> Policy {
    Policy::new("bench", Quota::per_second(1_000_000).burst(1_000_000_000))
}

/// `iters` decisions spread over `callers` concurrent tasks; returns the wall time.
async fn concurrent(
    b: &RedisBackend,
    p: &Arc<<RedisBackend as Backend>::Policy>,
    callers: u64,
    iters: u64,
    same_key: bool,
) -> Duration {
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(callers as usize);
    for c in 0..callers {
        let (b, p) = (b.clone(), p.clone());
        let n = iters / callers + u64::from(c < iters % callers);
        tasks.push(tokio::spawn(async move {
            let key = if same_key {
                Key::from_bytes("flood").expect("key")
            } else {
                Key::from_bytes(format!("caller-{c}")).expect("key")
            };
            for _ in 0..n {
                let _ = b.decide(&p, &key, ONE).await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    started.elapsed()
}

fn decide(c: &mut Criterion) {
    let server = support::RedisServer::start();
    let rt = runtime();
    let b = backend(&server.url(), 65_536);
    let p = Arc::new(
        rt.block_on(async { b.prepare(&roomy(), &roomy().validate().expect("policy")) })
            .expect("prepare"),
    );

    let mut g = c.benchmark_group("redis/decide");
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_secs(1));
    g.sample_size(10);
    for callers in [1u64, 16, 64, 256] {
        g.bench_function(format!("{callers}_callers"), |bench| {
            bench.to_async(&rt).iter_custom(|iters| {
                let (b, p) = (b.clone(), p.clone());
                async move { concurrent(&b, &p, callers, iters, false).await }
            });
        });
    }
    g.finish();

    // Latency percentiles under 64 concurrent callers, printed once.
    rt.block_on(async {
        let mut tasks = Vec::new();
        for c in 0..64 {
            let (b, p) = (b.clone(), p.clone());
            tasks.push(tokio::spawn(async move {
                let key = Key::from_bytes(format!("lat-{c}")).expect("key");
                let mut lat = Vec::with_capacity(500);
                for _ in 0..500 {
                    let t = Instant::now();
                    let _ = b.decide(&p, &key, ONE).await;
                    lat.push(t.elapsed());
                }
                lat
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap_or_default());
        }
        all.sort();
        let pct = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len() - 1)];
        println!(
            "redis/decide latency, 64 callers, {} decisions: p50 {:?}  p99 {:?}  max {:?}",
            all.len(),
            pct(0.50),
            pct(0.99),
            all[all.len() - 1]
        );
    });
    let s = b.stats();
    println!("stats: {s:?}");
}

fn deny_cache(c: &mut Criterion) {
    let server = support::RedisServer::start();
    let rt = runtime();
    let denied = Policy::new("flood", Quota::per_hour(1).burst(1));
    let mut g = c.benchmark_group("redis/denied_flood_64_callers");
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_secs(1));
    g.sample_size(10);
    for (name, capacity) in [("deny_cache_on", 65_536), ("deny_cache_off", 0)] {
        let b = backend(&server.url(), capacity);
        let p = Arc::new(
            rt.block_on(async { b.prepare(&denied, &denied.validate().expect("policy")) })
                .expect("prepare"),
        );
        g.bench_function(name, |bench| {
            bench.to_async(&rt).iter_custom(|iters| {
                let (b, p) = (b.clone(), p.clone());
                async move { concurrent(&b, &p, 64, iters, true).await }
            });
        });
        let s = b.stats();
        println!(
            "{name}: redis calls {} deny-cache hits {}",
            s.decisions, s.deny_cache_hits
        );
    }
    g.finish();
}

criterion_group!(benches, decide, deny_cache);
criterion_main!(benches);
