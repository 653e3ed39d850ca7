//! What a sliding window's resolution costs per decision: the local backend deciding on a key
//! at its limit (`"1000/h sliding <resolution>"`, the key's units all in its newest
//! sub-window, the worst case of the wait's walk over the sub-windows) at 10, 100 and 1 000
//! sub-windows, next to a GCRA quota and a fixed window on the same backend, in one run.
//!
//! Run with: `cargo bench --bench sliding --features local`
//!
//! Prints nanoseconds per decision (the median of 7 rounds) and the ratio to the GCRA
//! decision. A refused decision computes the wait twice (`Retry-After` and the time until one
//! more unit comes), each a walk over the sub-windows, linear since the fix of #35.
//! Without `--bench` (as `cargo test --benches` runs it) it runs a few rounds as a smoke test.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use governor::clock::FakeRelativeClock;
use tollgate::backend::{Backend, LocalBackend};
use tollgate::{Key, Policy, Quota};

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, per_round) = if full { (7, 200_000) } else { (1, 200) };
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder()
        .clock(clock.clone())
        .clock_epoch(Duration::from_secs(1_700_000_000))
        .build();
    let hour = Duration::from_secs(3600);
    let mut cases: Vec<(String, Quota)> = vec![
        ("gcra 1000/h".to_owned(), Quota::per_hour(1000)),
        (
            "fixed 1000/h".to_owned(),
            Quota::per_hour(1000).fixed_window(),
        ),
    ];
    for slices in [10u32, 100, 1000] {
        let quota = Quota::per_hour(1000)
            .sliding_window()
            .resolution(hour / slices);
        cases.push((format!("sliding, {slices} sub-windows"), quota));
    }
    let key = Key::from_bytes("hot").unwrap();
    let one = NonZeroU32::MIN;
    let mut gcra_ns = 0.0;
    println!(
        "{:<28} {:>12} {:>10}",
        "quota (key at its limit)", "ns/decision", "vs gcra"
    );
    for (i, (name, quota)) in cases.iter().enumerate() {
        let policy = Policy::new(format!("bench{i}"), *quota);
        let p = backend
            .prepare(&policy, &policy.validate().unwrap())
            .unwrap();
        // Spend the limit at once: every unit in the newest sub-window.
        let fill = NonZeroU32::new(1000).unwrap();
        let d = ready(backend.decide(&p, &key, fill));
        assert!(d.is_allowed(), "{name}: {d:?}");
        assert!(!ready(backend.decide(&p, &key, one)).is_allowed(), "{name}");
        let mut samples = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            for _ in 0..per_round {
                std::hint::black_box(ready(backend.decide(&p, &key, one)));
            }
            samples.push(start.elapsed().as_nanos() as f64 / per_round as f64);
        }
        samples.sort_by(f64::total_cmp);
        let ns = samples[samples.len() / 2];
        if i == 0 {
            gcra_ns = ns;
        }
        println!("{name:<28} {ns:>12.0} {:>9.2}x", ns / gcra_ns);
    }
}

/// The local backend answers at once.
fn ready<F>(mut f: F) -> tollgate::backend::Decision
where
    F: std::future::Future<Output = Result<tollgate::backend::Decision, tollgate::BackendError>>
        + Unpin,
{
    let waker = std::task::Waker::noop();
    match std::pin::Pin::new(&mut f).poll(&mut std::task::Context::from_waker(waker)) {
        std::task::Poll::Ready(Ok(d)) => d,
        _ => panic!("the local backend answers at once"),
    }
}
