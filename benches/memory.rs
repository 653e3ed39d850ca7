//! Memory per tracked key in the local backend, counted by a global allocator.
//!
//! Run with: `cargo bench --bench memory`
//!
//! Prints, for 1 000 000 distinct IPv4 keys on a one-quota policy:
//! - the heap bytes per tracked key after inserting them all (issue target: ≤ 128);
//! - the heap left once the clock has passed the bucket window and a sweep has run (should be
//!   back near the baseline);
//! - the same for each window algorithm (fixed, sliding, sliding with twelve sub-windows);
//! - and, for a backend capped at 100 000 keys, that a flood of 1 000 000 new keys stays
//!   within the cap.
//!
//! Without `--bench` (as `cargo test --benches` runs it) it does the same with 20 000 keys, as
//! a smoke test. Time is a fake clock: nothing sleeps.

use std::alloc::System;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use tollgate::backend::{Backend, LocalBackend};
use tollgate::{Key, Policy, Quota};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes currently allocated on the heap by this process.
fn heap() -> i64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64 + s.bytes_reallocated as i64
}

fn key(i: usize) -> Key {
    Key::ip(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i as u32)))
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let n = if full { 1_000_000 } else { 20_000 };
    let one = NonZeroU32::MIN;
    let policy = Policy::new("mem", Quota::per_second(10).burst(20));
    let params = policy.validate().unwrap();

    // 1. Bytes per tracked key, and back to baseline after the window and a sweep.
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder()
        .clock(clock.clone())
        .max_keys(2 * n)
        .build();
    let prepared = backend.prepare(&policy, &params).unwrap();
    let baseline = heap();
    let started = std::time::Instant::now();
    for i in 0..n {
        let d = backend
            .decide(&prepared, &key(i), one)
            .into_inner()
            .unwrap();
        assert!(d.is_allowed());
    }
    let below_cap_ns = started.elapsed().as_nanos() as f64 / n as f64;
    assert_eq!(backend.tracked_keys(), n);
    let filled = heap();
    let per_key = (filled - baseline) as f64 / n as f64;
    println!(
        "local backend: {n} IPv4 keys tracked: {:.1} MiB over baseline, {per_key:.1} bytes/key (target <= 128)",
        (filled - baseline) as f64 / (1 << 20) as f64
    );

    // A bucket is forgettable once it is full again: burst / rate = 2 s here.
    clock.advance(Duration::from_secs(3));
    backend.sweep();
    let swept = heap();
    assert_eq!(backend.tracked_keys(), 0);
    println!(
        "after the window and a sweep: {} keys tracked, {} bytes over baseline ({:.2} bytes/key inserted)",
        backend.tracked_keys(),
        swept - baseline,
        (swept - baseline) as f64 / n as f64
    );

    // 1b. The same for each window algorithm: bytes per key, and back to baseline once the
    // windows have passed.
    for quota in [
        Quota::per_second(10).fixed_window(),
        Quota::per_second(10).sliding_window(),
        Quota::per_minute(100)
            .sliding_window()
            .resolution(Duration::from_secs(5)),
        // A thousand sub-windows: a key seen once costs what it costs with one.
        Quota::per_hour(1000)
            .sliding_window()
            .resolution(Duration::from_millis(3600)),
    ] {
        let policy = Policy::new("mem", quota);
        let params = policy.validate().unwrap();
        let backend = LocalBackend::builder()
            .clock(clock.clone())
            .max_keys(2 * n)
            .build();
        let prepared = backend.prepare(&policy, &params).unwrap();
        let baseline = heap();
        for i in 0..n {
            let d = backend
                .decide(&prepared, &key(i), one)
                .into_inner()
                .unwrap();
            assert!(d.is_allowed());
        }
        let per_key = (heap() - baseline) as f64 / n as f64;
        clock.advance(Duration::from_secs(7201));
        backend.sweep();
        assert_eq!(backend.tracked_keys(), 0);
        println!(
            "local backend, \"{quota}\": {per_key:.1} bytes/key; after its windows and a sweep, {} bytes over baseline",
            heap() - baseline
        );
    }

    // 2. A flood of new keys against a capped table stays within the cap, each new key served
    // (the least used buckets evicted to make room), and what a new key costs at the cap
    // against what it costs below it.
    let cap = n / 10;
    let capped = LocalBackend::builder()
        .clock(clock.clone())
        .max_keys(cap)
        .build();
    let prepared = capped.prepare(&policy, &params).unwrap();
    let before = heap();
    let mut denied = 0usize;
    let started = std::time::Instant::now();
    for i in 0..n {
        let d = capped.decide(&prepared, &key(i), one).into_inner().unwrap();
        denied += usize::from(!d.is_allowed());
    }
    let at_cap_ns = started.elapsed().as_nanos() as f64 / n as f64;
    let flooded = heap();
    assert!(capped.tracked_keys() <= cap);
    assert_eq!(denied, 0, "new keys are served at the cap");
    println!(
        "flood of {n} new keys, max_keys {cap}: {} tracked, {denied} denied, {} evicted, {:.1} MiB over baseline",
        capped.tracked_keys(),
        capped.evicted_keys(),
        (flooded - before) as f64 / (1 << 20) as f64
    );
    println!(
        "a new key: {below_cap_ns:.0} ns below the cap, {at_cap_ns:.0} ns at it (eviction included): {:.2}x",
        at_cap_ns / below_cap_ns
    );
    assert!(
        ((flooded - before) as f64) < 2.0 * per_key * cap as f64 + 1_048_576.0,
        "the capped table grew past its bound"
    );

    #[cfg(feature = "redis")]
    approximate(n / 10);
}

/// Part 3: the approximate Redis mode's bytes per key, by sub-windows, for keys seen once
/// each, with Redis out of reach (nothing listens: decisions go on from the counts held,
/// which is what is measured).
#[cfg(feature = "redis")]
fn approximate(n: usize) {
    use tollgate::backend::redis::{Approximate, RedisBackend};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        for (name, quota) in [
            ("100/s fixed", Quota::per_second(100).fixed_window()),
            (
                "100/s sliding 1s (1 sub-window)",
                Quota::per_second(100).sliding_window(),
            ),
            (
                "100/min sliding 1s (60 sub-windows)",
                Quota::per_minute(100)
                    .sliding_window()
                    .resolution(Duration::from_secs(1)),
            ),
            (
                "1000/h sliding 3600ms (1 000 sub-windows)",
                Quota::per_hour(1000)
                    .sliding_window()
                    .resolution(Duration::from_millis(3600)),
            ),
        ] {
            let backend = RedisBackend::builder()
                .url("redis://127.0.0.1:1")
                .build_approximate(Approximate::asynchronous())
                .unwrap();
            let policy = Policy::new("mem", quota);
            let prepared = backend
                .prepare(&policy, &policy.validate().unwrap())
                .unwrap();
            let one = NonZeroU32::MIN;
            // The first decision makes the backend's own structures.
            backend.decide(&prepared, &key(n + 1), one).await.unwrap();
            let baseline = heap();
            for i in 0..n {
                backend.decide(&prepared, &key(i), one).await.unwrap();
            }
            let per_key = (heap() - baseline) as f64 / n as f64;
            println!("approximate mode, \"{name}\": {per_key:.1} bytes/key ({n} keys seen once)");
        }
    });
}
