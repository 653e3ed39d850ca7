//! Does evicting a million idle keys stall requests? Decision latency on the local backend
//! while a sweep evicts 1 000 000 idle buckets, against the same decisions with no sweep.
//!
//! Run with: `cargo bench --bench sweep --features local`
//!
//! One thread makes decisions on 100 000 busy keys, timing each one; meanwhile (in the second
//! measurement) another thread runs `LocalBackend::sweep()` over a table that also holds
//! 1 000 000 idle keys, which it evicts. Prints p50 / p99 / p99.9 / max of the decisions of
//! each run, and how long the sweep took. The sweep holds one shard of the map at a time
//! (dashmap's shards: 4 × the number of cores), so a decision waits at most for one shard.
//!
//! Without `--bench` (as `cargo test --benches` runs it) it does the same with 20 000 idle
//! keys, as a smoke test.

use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tollgate::backend::{Backend, LocalBackend};
use tollgate::{Key, Policy, Quota};

fn key(i: usize) -> Key {
    Key::ip(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i as u32)))
}

fn percentiles(mut ns: Vec<u64>) -> String {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize];
    format!(
        "{} decisions: p50 {} ns, p99 {} ns, p99.9 {} ns, max {} µs",
        ns.len(),
        at(0.5),
        at(0.99),
        at(0.999),
        ns[ns.len() - 1] / 1000
    )
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let idle = if full { 1_000_000 } else { 20_000 };
    let busy = 100_000;
    let one = NonZeroU32::MIN;
    // A bucket is idle 1 ms after its request; the busy keys get a quota that keeps them busy.
    let short = Policy::new("short", Quota::per_second(1000).burst(1));
    // One unit an hour, a burst of 1 000: each decision moves the bucket an hour on.
    let long = Policy::new("long", Quota::per_hour(1).burst(1000));
    let backend = LocalBackend::builder()
        .max_keys(2 * idle + 2 * busy)
        // No background sweep: this program sweeps when it wants to.
        .sweep_interval(Duration::from_secs(3600))
        .build();
    let short_p = backend.prepare(&short, &short.validate().unwrap()).unwrap();
    let long_p = backend.prepare(&long, &long.validate().unwrap()).unwrap();
    for i in 0..busy {
        let d = backend.decide(&long_p, &key(i), one).into_inner().unwrap();
        assert!(d.is_allowed());
    }

    for sweeping in [false, true] {
        for i in 0..idle {
            let d = backend
                .decide(&short_p, &key(busy + i), one)
                .into_inner()
                .unwrap();
            assert!(d.is_allowed());
        }
        std::thread::sleep(Duration::from_millis(5));
        let tracked = backend.tracked_keys();
        let done = AtomicBool::new(false);
        let mut latencies = Vec::with_capacity(4_000_000);
        let mut swept_in = Duration::ZERO;
        let mut evicted = 0;
        std::thread::scope(|scope| {
            if sweeping {
                scope.spawn(|| {
                    // Let the decisions get going first.
                    std::thread::sleep(Duration::from_millis(50));
                    let before = backend.tracked_keys();
                    let start = Instant::now();
                    backend.sweep();
                    swept_in = start.elapsed();
                    evicted = before - backend.tracked_keys();
                    std::thread::sleep(Duration::from_millis(50));
                    done.store(true, Ordering::Release);
                });
            } else {
                scope.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    done.store(true, Ordering::Release);
                });
            }
            let mut i = 0;
            while !done.load(Ordering::Acquire) {
                i = (i + 7919) % busy;
                let start = Instant::now();
                let d = backend.decide(&long_p, &key(i), one).into_inner().unwrap();
                latencies.push(start.elapsed().as_nanos() as u64);
                assert!(d.is_allowed());
            }
        });
        if sweeping {
            println!(
                "during a sweep of {tracked} buckets ({evicted} idle, evicted in {:.1} ms): {}",
                swept_in.as_secs_f64() * 1000.0,
                percentiles(latencies)
            );
        } else {
            println!(
                "no sweep, {tracked} buckets tracked: {}",
                percentiles(latencies)
            );
            // Start the sweeping run from the same table.
            backend.sweep();
        }
    }
}
