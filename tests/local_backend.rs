//! The local backend's guarantees, on an injected clock (no sleeping).

mod support;

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use tollgate::backend::{Backend, Decision, LocalBackend, Mode, Outcome};
use tollgate::{Key, Policy, Quota};

fn cost(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn key(s: &str) -> Key {
    Key::from_bytes(s).unwrap()
}

struct Setup {
    clock: FakeRelativeClock,
    backend: LocalBackend<FakeRelativeClock>,
}

fn setup() -> Setup {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder().clock(clock.clone()).build();
    Setup { clock, backend }
}

fn prepare(
    b: &LocalBackend<FakeRelativeClock>,
    p: &Policy,
) -> <LocalBackend<FakeRelativeClock> as Backend>::Policy {
    b.prepare(p, &p.validate().unwrap()).unwrap()
}

async fn decide(
    s: &Setup,
    p: &<LocalBackend<FakeRelativeClock> as Backend>::Policy,
    k: &Key,
    n: u32,
) -> Decision {
    s.backend.decide(p, k, cost(n)).await.unwrap()
}

/// The redis-cell `CL.THROTTLE` vectors: max_burst 4 (5 requests fit) at 1 per second.
#[tokio::test]
async fn redis_cell_vectors() {
    let s = setup();
    let p = prepare(
        &s.backend,
        &Policy::new("cell", Quota::per_second(1).burst(5)),
    );
    let k = key("user123");
    // A volume of 6 can never fit.
    let d = decide(&s, &p, &k, 6).await;
    assert!(d.never_fits());
    assert_eq!(d.retry_after(), None);
    for expected in [4, 3, 2, 1, 0] {
        let d = decide(&s, &p, &k, 1).await;
        assert!(d.is_allowed());
        assert_eq!(d.quotas()[0].remaining, expected);
        assert_eq!(d.quotas()[0].limit, 5);
    }
    let d = decide(&s, &p, &k, 1).await;
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
    s.clock.advance(Duration::from_secs(3));
    let d = decide(&s, &p, &k, 1).await;
    assert!(d.is_allowed());
    assert_eq!(d.quotas()[0].remaining, 2);
}

#[tokio::test]
async fn denied_single_quota_requests_consume_nothing() {
    let s = setup();
    let p = prepare(&s.backend, &Policy::new("p", Quota::per_second(1).burst(3)));
    let k = key("k");
    assert!(decide(&s, &p, &k, 3).await.is_allowed());
    for _ in 0..100 {
        let d = decide(&s, &p, &k, 1).await;
        assert!(!d.is_allowed());
    }
    // Exactly one emission interval later, exactly one unit is back despite 100 denials.
    s.clock.advance(Duration::from_secs(1));
    assert!(decide(&s, &p, &k, 1).await.is_allowed());
    assert!(!decide(&s, &p, &k, 1).await.is_allowed());
}

#[tokio::test]
async fn cost_counts_and_denied_remaining_is_what_would_fit() {
    let s = setup();
    let p = prepare(
        &s.backend,
        &Policy::new("p", Quota::per_second(1).burst(10)),
    );
    let k = key("k");
    let d = decide(&s, &p, &k, 7).await;
    assert_eq!(d.quotas()[0].remaining, 3);
    let d = decide(&s, &p, &k, 5).await;
    assert!(!d.is_allowed());
    // 3 units are there: 3 cost-1 requests would pass; cost 5 waits 2 s.
    assert_eq!(d.quotas()[0].remaining, 3);
    assert_eq!(d.retry_after(), Some(Duration::from_secs(2)));
}

/// What the docs promise for multi-quota policies on the local backend: quotas are checked in
/// order and checking stops at the first denial; units taken from earlier quotas stay taken.
#[tokio::test]
async fn multi_quota_guarantee() {
    let s = setup();
    let policy = Policy::new("m", Quota::per_second(1).burst(5)).and(Quota::per_hour(3));
    let p = prepare(&s.backend, &policy);
    let k = key("k");
    for _ in 0..3 {
        assert!(decide(&s, &p, &k, 1).await.is_allowed());
    }
    // The hourly quota denies the 4th, reported alone; the per-second quota gets back the
    // unit it took: all or nothing.
    let d = decide(&s, &p, &k, 1).await;
    assert!(!d.is_allowed());
    assert_eq!(d.quotas().len(), 1);
    assert_eq!(d.quotas()[0].index, 1);
    assert!(matches!(d.quotas()[0].outcome, Outcome::Denied { .. }));
    let alone = prepare(&s.backend, &Policy::new("m", Quota::per_second(1).burst(5)));
    let peeked = s
        .backend
        .decide_with(&alone, &k, cost(1), Mode::Peek)
        .await
        .unwrap();
    assert_eq!(
        peeked.quotas()[0].remaining,
        1,
        "3 taken of 5, none by the refusal"
    );
    // Never more than either quota allows: nothing passes until the hour has refilled.
    for _ in 0..10 {
        s.clock.advance(Duration::from_secs(1));
        assert!(!decide(&s, &p, &k, 1).await.is_allowed());
    }
    // A denial by the first quota touches nothing else.
    let s = setup();
    let policy = Policy::new("m2", Quota::per_hour(1)).and(Quota::per_hour(2));
    let p = prepare(&s.backend, &policy);
    assert!(decide(&s, &p, &k, 1).await.is_allowed());
    let d = decide(&s, &p, &k, 1).await;
    assert_eq!(d.quotas().len(), 1, "stopped at the first quota");
}

#[tokio::test]
async fn idle_keys_are_evicted_by_the_sweep() {
    let s = setup();
    let p = prepare(
        &s.backend,
        &Policy::new("p", Quota::per_second(10).burst(10)),
    );
    for i in 0..1000 {
        decide(&s, &p, &key(&format!("k{i}")), 1).await;
    }
    assert_eq!(s.backend.tracked_keys(), 1000);
    s.backend.sweep();
    assert_eq!(s.backend.tracked_keys(), 1000, "buckets not yet full stay");
    s.clock.advance(Duration::from_secs(1));
    s.backend.sweep();
    assert_eq!(s.backend.tracked_keys(), 0);
}

#[tokio::test]
async fn the_key_table_is_bounded() {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder()
        .clock(clock.clone())
        .max_keys(10)
        .build();
    let s = Setup { clock, backend };
    let p = prepare(&s.backend, &Policy::new("p", Quota::per_hour(2)));
    for i in 0..10 {
        assert!(decide(&s, &p, &key(&format!("k{i}")), 1).await.is_allowed());
    }
    // k0 spends its limit: of all the keys, it used the most.
    assert!(decide(&s, &p, &key("k0"), 1).await.is_allowed());
    // Full: a new key is served, limited, and the table does not grow past its cap (the
    // least used buckets make room)...
    for i in 0..100 {
        let d = decide(&s, &p, &key(&format!("new{i}")), 1).await;
        assert!(d.is_allowed(), "{d:?}");
        assert_eq!(d.quotas()[0].remaining, 1);
        assert!(s.backend.tracked_keys() <= 10);
    }
    assert!(s.backend.evicted_keys() >= 100);
    assert_eq!(s.backend.full_table_refusals(), 0);
    // ...while the key that used the most keeps its state, and new keys their limits.
    assert!(!decide(&s, &p, &key("k0"), 1).await.is_allowed());
    assert!(decide(&s, &p, &key("new99"), 1).await.is_allowed());
    assert!(!decide(&s, &p, &key("new99"), 1).await.is_allowed());
}

/// A table full of slots in flight (never evicted: their requests give them back) is the one
/// thing a new key can find no room in.
fn fill_with_slots(
    backend: &LocalBackend<FakeRelativeClock>,
    n: usize,
) -> <LocalBackend<FakeRelativeClock> as Backend>::Policy {
    let slots = prepare(backend, &Policy::new("slots", Quota::concurrent(1)));
    for i in 0..n {
        let k = key(&format!("slot{i}"));
        let d = futures_ready(backend.decide_with(&slots, &k, cost(1), Mode::Hold { lease: 0 }));
        assert!(d.unwrap().is_allowed());
    }
    // Keep it: a dropped policy's counters go with it.
    slots
}

#[tokio::test]
async fn same_policy_name_shares_buckets_on_one_backend() {
    let s = setup();
    let policy = Policy::new("shared", Quota::per_hour(2));
    let a = prepare(&s.backend, &policy);
    let b = prepare(&s.backend, &policy);
    let k = key("k");
    assert!(decide(&s, &a, &k, 1).await.is_allowed());
    assert!(decide(&s, &b, &k, 1).await.is_allowed());
    assert!(!decide(&s, &a, &k, 1).await.is_allowed());
    // A different policy name is a different bucket.
    let c = prepare(&s.backend, &Policy::new("other", Quota::per_hour(2)));
    assert!(decide(&s, &c, &k, 1).await.is_allowed());
}

#[tokio::test]
async fn concurrent_decisions_on_one_key_are_exact() {
    let backend = LocalBackend::new();
    let policy = Policy::new("p", Quota::per_day(1).burst(1000));
    let p = std::sync::Arc::new(
        backend
            .prepare(&policy, &policy.validate().unwrap())
            .unwrap(),
    );
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let backend = backend.clone();
            let p = p.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                let k = Key::from_bytes("hot").unwrap();
                (0..1000)
                    .filter(|_| {
                        rt.block_on(backend.decide(&p, &k, cost(1)))
                            .unwrap()
                            .is_allowed()
                    })
                    .count()
            })
        })
        .collect();
    let allowed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(allowed, 1000);
}

/// Eviction needs no thread or task of the user's: the backend's own task sweeps.
#[tokio::test(start_paused = true)]
async fn the_backend_sweeps_by_itself() {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder()
        .clock(clock.clone())
        .sweep_interval(Duration::from_secs(30))
        .build();
    let s = Setup { clock, backend };
    let p = prepare(&s.backend, &Policy::new("p", Quota::per_second(10)));
    for i in 0..100 {
        decide(&s, &p, &key(&format!("k{i}")), 1).await;
    }
    assert_eq!(s.backend.tracked_keys(), 100);
    s.clock.advance(Duration::from_secs(5));
    // Let the sweeper's timer fire (Tokio's clock is paused and auto-advances).
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(s.backend.tracked_keys(), 0);
}

/// A cost larger than the burst never fits, however large (no overflow inside governor).
#[tokio::test]
async fn huge_costs_never_fit_and_never_panic() {
    let s = setup();
    let p = prepare(&s.backend, &Policy::new("p", Quota::per_hour(100)));
    for n in [101, 1 << 20, u32::MAX / 2, u32::MAX - 1, u32::MAX] {
        let d = decide(&s, &p, &key("k"), n).await;
        assert!(d.never_fits(), "cost {n}: {d:?}");
    }
    // Nothing was taken.
    let d = decide(&s, &p, &key("k"), 100).await;
    assert!(d.is_allowed());
}

/// Refusals that need no bucket (a cost the policy can never fit, a new key when the table is
/// full) are made before any quota is charged, so an oversized request sent again and again
/// cannot drain the earlier quotas of a multi-quota policy.
#[tokio::test]
async fn refusals_before_charging_leave_every_quota_untouched() {
    let s = setup();
    let policy = Policy::new("m", Quota::per_hour(10)).and(Quota::per_hour(5));
    let p = prepare(&s.backend, &policy);
    let k = key("k");
    for _ in 0..3 {
        let d = decide(&s, &p, &k, 6).await;
        assert!(d.never_fits(), "{d:?}");
        assert_eq!(d.quotas().len(), 1);
        assert_eq!(d.quotas()[0].index, 1, "the quota the cost can never fit");
    }
    // All 10 and all 5 units are still there.
    let d = decide(&s, &p, &k, 5).await;
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.quotas()[0].remaining, 5);
    assert_eq!(d.quotas()[1].remaining, 0);

    // Room for one more bucket (the rest held by slots in flight, which are never evicted),
    // but a new key needs two: refused before the first quota takes a bucket (and a unit)
    // for it.
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder()
        .clock(clock.clone())
        .max_keys(3)
        .build();
    let _slots = fill_with_slots(&backend, 2);
    let s = Setup { clock, backend };
    let p = prepare(&s.backend, &policy);
    let d = decide(&s, &p, &key("b"), 1).await;
    assert!(!d.is_allowed(), "table full: {d:?}");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
    assert_eq!(d.quotas().len(), 1);
    assert_eq!(s.backend.tracked_keys(), 2, "nothing was added for b");
}

/// The longest bucket a quota may have (100 years) is served without overflow, however long
/// the process has run.
#[tokio::test]
async fn the_longest_buckets_never_overflow() {
    let s = setup();
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    let p = prepare(&s.backend, &Policy::new("p", Quota::new(1, century)));
    s.clock.advance(century * 2);
    let k = key("k");
    assert!(decide(&s, &p, &k, 1).await.is_allowed());
    let d = decide(&s, &p, &k, 1).await;
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), Some(century));
}

/// On a denial, the quota a client should watch (the legacy `X-RateLimit-*` headers) is the
/// one that denied, with the longest wait, even when an allowing quota has as few units left.
#[tokio::test]
async fn the_tightest_quota_of_a_denial_is_the_denying_one() {
    let s = setup();
    let policy = Policy::new("m", Quota::per_second(1).burst(2)).and(Quota::per_hour(3));
    let p = prepare(&s.backend, &policy);
    let k = key("k");
    for _ in 0..2 {
        assert!(decide(&s, &p, &k, 1).await.is_allowed());
    }
    s.clock.advance(Duration::from_secs(2));
    assert!(decide(&s, &p, &k, 1).await.is_allowed());
    let d = decide(&s, &p, &k, 1).await;
    assert!(!d.is_allowed());
    // The per-second quota allowed it with 0 left; the hourly one denied it.
    assert_eq!(d.quotas()[0].remaining, 0);
    let tightest = d.tightest().unwrap();
    assert_eq!(tightest.index, 1, "{d:?}");
    assert_eq!(tightest.limit, 3);
    assert_eq!(Some(tightest.reset_after), d.retry_after());
    // Allowed: the quota with the fewest units left.
    let s = setup();
    let p = prepare(&s.backend, &policy);
    let d = decide(&s, &p, &k, 2).await;
    assert_eq!(d.tightest().unwrap().index, 0, "{d:?}");
}

/// A table that is full of what cannot be evicted (slots in flight) turns new keys away
/// visibly: counted, warned about at most once a minute (not once per request), and, when
/// asked, let through unlimited instead of denied.
#[tokio::test]
async fn a_full_table_is_counted_warned_about_and_configurable() {
    use tollgate::backend::WhenFull;
    let (logs, _guard) = support::Logs::capture();

    let policy = Policy::new("p", Quota::per_hour(10));
    for when_full in [WhenFull::Deny, WhenFull::Allow] {
        let clock = FakeRelativeClock::default();
        let backend = LocalBackend::builder()
            .clock(clock.clone())
            .max_keys(1)
            .when_full(when_full)
            .build();
        let _slots = fill_with_slots(&backend, 1);
        let s = Setup { clock, backend };
        let p = prepare(&s.backend, &policy);
        for i in 0..20 {
            let d = decide(&s, &p, &key(&format!("new-{i}")), 1).await;
            match when_full {
                WhenFull::Deny => assert_eq!(d.retry_after(), Some(Duration::from_secs(1))),
                _ => {
                    assert!(d.is_allowed());
                    assert!(d.quotas().is_empty(), "untracked: no headers");
                }
            }
        }
        assert_eq!(s.backend.full_table_refusals(), 20);
        assert_eq!(s.backend.tracked_keys(), 1);
        // A minute later, the next refusal warns again, with the count since the last one.
        s.clock.advance(Duration::from_secs(61));
        decide(&s, &p, &key("later"), 1).await;
        assert_eq!(s.backend.full_table_refusals(), 21);
    }
    let text = logs.text();
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("table is full"))
        .collect();
    assert_eq!(
        warnings.len(),
        4,
        "two per backend, not one per request:\n{text}"
    );
    assert!(
        warnings[0].contains("denied") && warnings[0].contains("new_keys=1"),
        "{text}"
    );
    assert!(warnings[1].contains("new_keys=20"), "{text}");
    assert!(warnings[2].contains("let through unlimited"), "{text}");
}

/// Many threads on one key never get more than a window's limit through, for either window
/// algorithm, and a multi-quota policy mixing them with GCRA never exceeds its tightest quota.
#[test]
fn windows_are_exact_under_concurrency() {
    use std::sync::atomic::{AtomicU32, Ordering};
    for quota in [
        Quota::per_day(500).fixed_window(),
        Quota::per_day(500).sliding_window(),
        Quota::per_day(600)
            .sliding_window()
            .resolution(Duration::from_secs(3600)),
    ] {
        let backend = LocalBackend::builder()
            .clock(FakeRelativeClock::default())
            .clock_epoch(Duration::from_secs(1_700_000_000))
            .build();
        let policy = Policy::new("c", quota).and(Quota::per_day(450).burst(450));
        let p = prepare(&backend, &policy);
        let allowed = AtomicU32::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..300 {
                        let d = futures_ready(backend.decide(&p, &key("hot"), cost(1))).unwrap();
                        if d.is_allowed() {
                            allowed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        // The tightest quota is the GCRA one: 450.
        assert_eq!(allowed.load(Ordering::Relaxed), 450, "{quota}");
        let alone = prepare(&backend, &Policy::new("w", quota));
        let allowed = AtomicU32::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..300 {
                        let d =
                            futures_ready(backend.decide(&alone, &key("hot"), cost(1))).unwrap();
                        if d.is_allowed() {
                            allowed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(
            allowed.load(Ordering::Relaxed),
            quota.count(),
            "{quota}: exactly the limit"
        );
    }
}

/// The local backend answers at once: its future is ready when made.
fn futures_ready<F: std::future::Future + Unpin>(mut f: F) -> F::Output {
    let waker = std::task::Waker::noop();
    match std::pin::Pin::new(&mut f).poll(&mut std::task::Context::from_waker(waker)) {
        std::task::Poll::Ready(out) => out,
        std::task::Poll::Pending => panic!("the local backend is never pending"),
    }
}

/// A request a window quota refuses takes nothing from any quota of the policy, whatever the
/// order of the quotas: window quotas are checked before anything is charged.
#[tokio::test]
async fn a_window_refusal_charges_no_quota() {
    for window_first in [false, true] {
        let s = setup();
        let (gcra, window) = (Quota::per_hour(10), Quota::per_hour(2).fixed_window());
        let policy = if window_first {
            Policy::new("m", window).and(gcra)
        } else {
            Policy::new("m", gcra).and(window)
        };
        let p = prepare(&s.backend, &policy);
        let k = key("k");
        assert!(decide(&s, &p, &k, 1).await.is_allowed());
        assert!(decide(&s, &p, &k, 1).await.is_allowed());
        for _ in 0..5 {
            let d = decide(&s, &p, &k, 1).await;
            assert!(!d.is_allowed());
            assert_eq!(d.quotas().len(), 1, "only the window that refused: {d:?}");
        }
        // The GCRA bucket (shared with a one-quota policy of the same name, index and
        // parameters) lost only the two allowed units.
        let gcra_index = usize::from(window_first);
        if gcra_index == 0 {
            let alone = prepare(&s.backend, &Policy::new("m", gcra));
            let d = decide(&s, &alone, &k, 1).await;
            assert_eq!(d.quotas()[0].remaining, 7, "{d:?}");
        }
        // An allowed decision reports every quota, in policy order.
        s.clock.advance(Duration::from_secs(3600));
        let d = decide(&s, &p, &k, 1).await;
        assert!(d.is_allowed());
        let indices: Vec<usize> = d.quotas().iter().map(|q| q.index).collect();
        assert_eq!(indices, [0, 1]);
    }
}

/// Two threads admitting on the same key at once, on many keys: a request a later quota
/// refuses gives back what the earlier ones took, so no slot is kept once every admitted
/// request has ended, and a request refused for want of a slot spends no rate unit. Threads
/// really run at once (a barrier per key), over 1 000 keys each time.
#[test]
fn multi_quota_decisions_are_all_or_nothing_under_races() {
    // Rounds of 1 000 keys: the race is lost on a few keys per thousand.
    for _round in 0..8 {
        slots_race();
        units_race();
    }
}

/// A policy of `quotas`, named "race".
fn parse(quotas: &[&str]) -> Policy {
    let mut quotas = quotas.iter().map(|q| q.parse::<Quota>().unwrap());
    let first = quotas.next().unwrap();
    quotas.fold(Policy::new("race", first), Policy::and)
}

fn hold(lease: u64) -> Mode {
    Mode::Hold { lease }
}

fn slots_race() {
    use std::sync::Barrier;
    // 1. Slots: the fixed window of 1 refuses one of the two; its slot goes back.
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let policy = parse(&["100 concurrent", "1000/d sliding 1h", "1/d fixed"]);
    let p = prepare(&backend, &policy);
    let keys: Vec<Key> = (0..1000).map(|i| key(&format!("k{i}"))).collect();
    let barrier = Barrier::new(2);
    let admitted = std::sync::atomic::AtomicU32::new(0);
    std::thread::scope(|scope| {
        for t in 0..2u64 {
            let (backend, p, keys, barrier, admitted) = (&backend, &p, &keys, &barrier, &admitted);
            scope.spawn(move || {
                for (i, k) in keys.iter().enumerate() {
                    barrier.wait();
                    let lease = i as u64 * 2 + t;
                    let d = futures_ready(backend.decide_with(p, k, cost(1), hold(lease))).unwrap();
                    if d.is_allowed() {
                        admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let released = Mode::Release { lease };
                        futures_ready(backend.decide_with(p, k, cost(1), released)).unwrap();
                    }
                }
            });
        }
    });
    assert_eq!(
        admitted.into_inner(),
        1000,
        "one per key, by the fixed window"
    );
    let slots = prepare(&backend, &parse(&["100 concurrent"]));
    let held: Vec<&Key> = (keys.iter())
        .filter(|k| {
            let d = futures_ready(backend.decide_with(&slots, k, cost(1), Mode::Peek)).unwrap();
            d.quotas()[0].remaining != 100
        })
        .collect();
    assert!(
        held.is_empty(),
        "{} keys keep a slot: {:?}",
        held.len(),
        &held[..held.len().min(5)]
    );
}

fn units_race() {
    use std::sync::Barrier;
    let keys: Vec<Key> = (0..1000).map(|i| key(&format!("k{i}"))).collect();
    let barrier = Barrier::new(2);

    // 2. Units: the slot refuses one of the two; the rate quotas it passed get their unit back.
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let policy = parse(&["1 concurrent", "1000/h", "2000/h", "3000/h"]);
    let p = prepare(&backend, &policy);
    std::thread::scope(|scope| {
        for t in 0..2u64 {
            let (backend, p, keys, barrier) = (&backend, &p, &keys, &barrier);
            scope.spawn(move || {
                for (i, k) in keys.iter().enumerate() {
                    barrier.wait();
                    // Held to the end of the round, so that the other thread races a held slot.
                    let lease = i as u64 * 2 + t;
                    let d = futures_ready(backend.decide_with(p, k, cost(1), hold(lease))).unwrap();
                    barrier.wait();
                    if d.is_allowed() {
                        let released = Mode::Release { lease };
                        futures_ready(backend.decide_with(p, k, cost(1), released)).unwrap();
                    }
                }
            });
        }
    });
    for (i, limit) in [(1, 1000), (2, 2000), (3, 3000)] {
        let rate = prepare(
            &backend,
            &parse(&["1 concurrent", "1000/h", "2000/h", "3000/h"]),
        );
        for k in &keys {
            let d = futures_ready(backend.decide_with(&rate, k, cost(1), Mode::Peek)).unwrap();
            let state = d.quotas().iter().find(|q| q.index == i).unwrap();
            // The peek reports the state after a request of 1: one taken by the admitted one.
            assert_eq!(state.remaining, limit - 2, "quota {i} of {k:?}: {d:?}");
        }
    }
}

/// Issue 35, finding 3: at the key cap, a flood of fresh keys neither locks new clients out
/// (they are served, limited as any key) nor lifts the limit of a key that used more than the
/// flood's keys do (the least used buckets are the ones evicted), on every algorithm.
#[test]
fn a_flood_of_fresh_keys_neither_locks_out_nor_lifts_limits() {
    for quota in [
        "5/min",
        "5/min fixed",
        "5/min sliding 10s",
        "5/min sliding 1s",
    ] {
        let clock = FakeRelativeClock::default();
        let backend = LocalBackend::builder()
            .clock(clock.clone())
            .clock_epoch(Duration::from_secs(600))
            .max_keys(200)
            .build();
        let p = prepare(&backend, &parse(&[quota]));
        let ask = |k: &Key| futures_ready(backend.decide(&p, k, cost(1))).unwrap();
        // Victims spend their limit (or two units of it), then a flood of 20 000 fresh keys
        // (100 times the table) passes between each of their attempts.
        let spent: Vec<Key> = (0..20).map(|i| key(&format!("spent{i}"))).collect();
        let halfway: Vec<Key> = (0..20).map(|i| key(&format!("halfway{i}"))).collect();
        for v in &spent {
            for _ in 0..5 {
                assert!(ask(v).is_allowed(), "{quota}");
            }
        }
        for v in &halfway {
            for _ in 0..2 {
                assert!(ask(v).is_allowed(), "{quota}");
            }
        }
        let mut more = 0;
        for round in 0..10 {
            for i in 0..2_000 {
                let d = ask(&key(&format!("flood{round}-{i}")));
                assert!(d.is_allowed(), "{quota}: a new client refused: {d:?}");
                assert_eq!(d.quotas()[0].remaining, 4, "{quota}: a new client's limit");
            }
            for v in &spent {
                let d = ask(v);
                assert!(
                    !d.is_allowed(),
                    "{quota}: {v:?} let through again after a flood"
                );
            }
            // Three more for each key halfway, over the rounds: never a fourth.
            if round < 3 {
                for v in &halfway {
                    let d = ask(v);
                    assert!(d.is_allowed(), "{quota}: {v:?}");
                    more += 1;
                }
            } else {
                for v in &halfway {
                    assert!(!ask(v).is_allowed(), "{quota}: {v:?} past its limit");
                }
            }
            clock.advance(Duration::from_millis(100));
        }
        assert_eq!(more, 60);
        assert!(backend.tracked_keys() <= 200, "{quota}");
        assert!(
            backend.evicted_keys() >= 19_000,
            "{quota}: {}",
            backend.evicted_keys()
        );
        assert_eq!(backend.full_table_refusals(), 0, "{quota}");
        // Once their window has passed, the victims are served again.
        clock.advance(Duration::from_secs(61));
        for v in &spent {
            assert!(ask(v).is_allowed(), "{quota}");
        }
    }
}

/// Threads flooding fresh keys while others hammer a few spent keys, at a table cap of 64: the
/// evictions race the decisions, no new key is turned away and no spent key let through.
#[test]
fn evictions_racing_decisions_never_lift_a_limit() {
    use std::sync::atomic::{AtomicU32, Ordering};
    for quota in ["10/h", "10/h fixed", "10/h sliding 1min"] {
        let backend = LocalBackend::builder()
            .clock(FakeRelativeClock::default())
            .max_keys(64)
            .build();
        let p = prepare(&backend, &parse(&[quota]));
        let victims: Vec<Key> = (0..16).map(|i| key(&format!("v{i}"))).collect();
        for v in &victims {
            for _ in 0..10 {
                assert!(
                    futures_ready(backend.decide(&p, v, cost(1)))
                        .unwrap()
                        .is_allowed()
                );
            }
        }
        let admitted = AtomicU32::new(0);
        std::thread::scope(|scope| {
            for t in 0..2 {
                let (backend, p) = (&backend, &p);
                scope.spawn(move || {
                    for i in 0..20_000 {
                        let k = key(&format!("f{t}-{i}"));
                        let d = futures_ready(backend.decide(p, &k, cost(1))).unwrap();
                        assert!(d.is_allowed(), "{quota}: {d:?}");
                    }
                });
            }
            for t in 0..2 {
                let (backend, p, victims, admitted) = (&backend, &p, &victims, &admitted);
                scope.spawn(move || {
                    for round in 0..5_000 {
                        let v = &victims[(round * 7 + t) % victims.len()];
                        if futures_ready(backend.decide(p, v, cost(1)))
                            .unwrap()
                            .is_allowed()
                        {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.into_inner(), 0, "{quota}");
        assert!(backend.evicted_keys() > 10_000, "{quota}");
        assert_eq!(backend.full_table_refusals(), 0, "{quota}");
        assert!(backend.tracked_keys() <= 64 + 8, "{quota}");
    }
}

/// A full table does not spare a client its penalty: the block it earns makes its own room.
#[test]
fn a_full_table_still_blocks() {
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .max_keys(50)
        .build();
    let policy = parse(&["2/min"]).block_for(Duration::from_secs(3600));
    let p = prepare(&backend, &policy);
    let ask = |k: &Key| futures_ready(backend.decide(&p, k, cost(1))).unwrap();
    let attacker = key("attacker");
    assert!(ask(&attacker).is_allowed());
    assert!(ask(&attacker).is_allowed());
    for i in 0..200 {
        assert!(ask(&key(&format!("fresh{i}"))).is_allowed());
    }
    for i in 0.. {
        if backend.tracked_keys() >= 50 {
            break;
        }
        assert!(ask(&key(&format!("filler{i}"))).is_allowed());
    }
    let d = ask(&attacker);
    assert!(d.is_blocked(), "{d:?}");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(3600)));
}

/// Issue 35, finding 4: the key cap bounds memory, not only entries: a sliding window's key
/// that holds counts in many sub-windows counts as one more key for every 16 of them (8 bytes
/// each, about an entry's cost), and gives them back as they slide out.
#[test]
fn a_sliding_key_counts_against_the_cap_by_what_it_holds() {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder()
        .clock(clock.clone())
        .clock_epoch(Duration::ZERO)
        .max_keys(1_000)
        .build();
    // 1 000 sub-windows of 3.6 s.
    let p = prepare(&backend, &parse(&["1000/h sliding 3600ms"]));
    let ask = |k: &Key| futures_ready(backend.decide(&p, k, cost(1))).unwrap();
    let k = key("busy");
    for _ in 0..48 {
        assert!(ask(&k).is_allowed());
        clock.advance(Duration::from_millis(3600));
    }
    assert_eq!(backend.tracked_keys(), 1 + 48 / 16);
    // A key seen once is one key.
    assert!(ask(&key("once")).is_allowed());
    assert_eq!(backend.tracked_keys(), 1 + 3 + 1);
    // Past the window (and its oldest sub-window), every count has slid out: the next request
    // holds one sub-window again.
    clock.advance(Duration::from_secs(3605));
    assert!(ask(&k).is_allowed());
    assert_eq!(backend.tracked_keys(), 1 + 1);
    backend.sweep();
    assert_eq!(backend.tracked_keys(), 1);
    drop(p);
    assert_eq!(backend.tracked_keys(), 0);
}

/// Live quota changes on the local backend: the conformance suite's cases.
#[tokio::test]
async fn quota_changes_keep_what_keys_used() {
    let clock = governor::clock::FakeRelativeClock::default();
    let backend = tollgate::backend::LocalBackend::builder()
        .clock(clock.clone())
        .clock_epoch(std::time::Duration::ZERO)
        .build();
    support::conformance::changes(&backend, |by| clock.advance(by), "local").await;
}

/// A backend with a stopped clock and room for `max_keys`.
fn capped(max_keys: usize) -> LocalBackend<FakeRelativeClock> {
    LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .max_keys(max_keys)
        .build()
}

/// The same quota in each algorithm, `n` an hour.
fn hourly(n: u32) -> [Quota; 3] {
    let hour = Duration::from_secs(3600);
    [
        Quota::per_hour(n),
        Quota::new(n, hour).fixed_window(),
        Quota::new(n, hour)
            .sliding_window()
            .resolution(Duration::from_secs(60)),
    ]
}

/// A rule swapped back (X, then Y, then X again, each prepared before the one it replaces is
/// dropped) keeps what the key used under Y: X's old store is not reused as it was.
#[tokio::test]
async fn a_change_back_to_earlier_values_keeps_what_keys_used() {
    for (x, y) in hourly(100).into_iter().zip(hourly(200)) {
        let b = capped(1000);
        let k = key("k");
        let px = prepare(&b, &Policy::new("p", x));
        assert!(b.decide(&px, &k, cost(90)).await.unwrap().is_allowed());
        let py = prepare(&b, &Policy::new("p", y));
        drop(px);
        assert!(b.decide(&py, &k, cost(100)).await.unwrap().is_allowed());
        let px = prepare(&b, &Policy::new("p", x));
        drop(py);
        // 190 used, kept under 100: nothing left.
        let d = b.decide(&px, &k, cost(50)).await.unwrap();
        assert!(!d.is_allowed(), "{x:?}: {d:?}");
        assert_eq!(d.quotas()[0].remaining, 0, "{x:?}");
    }
}

/// A full table across a quota change: the buckets still held under the old values count
/// against the cap, and are evicted like any other, so that keys old and new are served.
#[tokio::test]
async fn a_full_table_across_a_change_serves_old_and_new_keys() {
    let day = Duration::from_secs(86_400);
    for (x, y) in [
        (Quota::per_day(100), Quota::per_day(200)),
        (
            Quota::new(100, day).fixed_window(),
            Quota::new(200, day).fixed_window(),
        ),
    ] {
        let b = capped(100);
        let px = prepare(&b, &Policy::new("p", x));
        for i in 0..100 {
            let d = b
                .decide(&px, &key(&format!("k{i}")), cost(1))
                .await
                .unwrap();
            assert!(d.is_allowed());
        }
        let py = prepare(&b, &Policy::new("p", y));
        drop(px);
        b.sweep();
        let d = b.decide(&py, &key("k50"), cost(1)).await.unwrap();
        assert!(d.is_allowed(), "{x:?}: an old key moving over");
        assert_eq!(d.quotas()[0].remaining, 198, "{x:?}: it keeps its unit");
        let d = b.decide(&py, &key("new"), cost(1)).await.unwrap();
        assert!(d.is_allowed(), "{x:?}: a new key");
        assert_eq!(b.full_table_refusals(), 0, "{x:?}");
        assert!(b.tracked_keys() <= 100, "{x:?}: {}", b.tracked_keys());
    }
}

/// `reset` right after a change forgets what the key used under the old values too.
#[tokio::test]
async fn reset_after_a_change_forgets_the_old_values_too() {
    for (x, y) in hourly(10).into_iter().zip(hourly(20)) {
        let b = capped(1000);
        let k = key("k");
        let px = prepare(&b, &Policy::new("p", x));
        assert!(b.decide(&px, &k, cost(10)).await.unwrap().is_allowed());
        let py = prepare(&b, &Policy::new("p", y));
        drop(px);
        b.reset(&py, &k).await.unwrap();
        let d = b.decide(&py, &k, cost(1)).await.unwrap();
        assert_eq!(d.quotas()[0].remaining, 19, "{x:?}");
    }
}

/// A concurrent quota's slots are shared by every live version of it, also when the latest
/// version goes before an older one: three in flight never pass a limit of two.
#[tokio::test]
async fn slots_stay_shared_when_the_latest_version_goes_first() {
    let b = capped(1000);
    let k = key("k");
    let hold = |lease| Mode::Hold { lease };
    let px = prepare(&b, &Policy::new("c", Quota::concurrent(2)));
    for lease in 0..2 {
        let d = b.decide_with(&px, &k, cost(1), hold(lease)).await.unwrap();
        assert!(d.is_allowed());
    }
    let py = prepare(&b, &Policy::new("c", Quota::concurrent(3)));
    drop(py);
    let again = prepare(&b, &Policy::new("c", Quota::concurrent(2)));
    let d = b.decide_with(&again, &k, cost(1), hold(9)).await.unwrap();
    assert!(!d.is_allowed(), "two held under the older version: {d:?}");
}

/// The slot entries two versions of a concurrent quota share are given back to the key cap
/// once, when the last version goes, whichever goes first (the shared map accounts for
/// itself: two versions dropped at once on two threads cannot both leave it counted).
#[tokio::test]
async fn slots_shared_by_versions_leave_nothing_counted_when_they_go() {
    for older_first in [true, false] {
        let b = capped(1000);
        let px = prepare(&b, &Policy::new("c", Quota::concurrent(2)));
        let py = prepare(&b, &Policy::new("c", Quota::concurrent(3)));
        let held = b.decide_with(&px, &key("k"), cost(1), Mode::Hold { lease: 1 });
        assert!(held.await.unwrap().is_allowed());
        assert_eq!(b.tracked_keys(), 1);
        let (first, last) = if older_first { (px, py) } else { (py, px) };
        drop(first);
        assert_eq!(
            b.tracked_keys(),
            1,
            "the slot is still held by the other version"
        );
        drop(last);
        assert_eq!(b.tracked_keys(), 0);
    }
}

/// Calendar quotas at their boundaries on the local backend: the conformance suite's cases.
#[cfg(feature = "calendar")]
#[tokio::test]
async fn calendar_quotas_local() {
    let clock = tollgate::testing::ManualClock::new();
    let backend = clock.backend();
    let start = tollgate::testing::ManualClock::START.as_secs();
    support::conformance::calendar(&backend, start, |by| clock.advance(by), "local").await;
}

/// A calendar quota under threads at once, on many keys, across a boundary its windows'
/// cache has to move past: each key admits exactly its limit in each window.
#[cfg(feature = "calendar")]
#[test]
fn a_calendar_quota_admits_its_limit_exactly_under_threads_at_once() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let clock = tollgate::testing::ManualClock::new();
    let backend = clock.backend();
    // 2026-03-07 23:59:50 in New York: ten seconds before the day's end.
    let start = tollgate::testing::ManualClock::START.as_secs();
    clock.advance(Duration::from_secs(1_772_946_000 - 10 - start));
    let policy = Policy::new("daily", "300/day tz America/New_York".parse().unwrap());
    let p = support::prepare(&backend, &policy);
    let keys: Vec<Key> = (0..16).map(|i| key(&format!("tenant-{i}"))).collect();
    let run = || {
        let allowed: Vec<AtomicU32> = keys.iter().map(|_| AtomicU32::new(0)).collect();
        std::thread::scope(|scope| {
            for t in 0..4 {
                let (keys, allowed, p, backend) = (&keys, &allowed, &p, &backend);
                scope.spawn(move || {
                    for i in 0..2000 {
                        let k = (i + t) % keys.len();
                        let d = futures_ready(backend.decide(p, &keys[k], cost(1))).unwrap();
                        if d.is_allowed() {
                            allowed[k].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        allowed
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect::<Vec<_>>()
    };
    // 8 000 asks over 16 keys, 500 each: 300 pass per key.
    assert_eq!(run(), vec![300; 16]);
    // Past midnight: a new day for every key, 23 hours long.
    clock.advance(Duration::from_secs(10));
    assert_eq!(run(), vec![300; 16]);
    let d = futures_ready(backend.decide(&p, &keys[0], cost(1))).unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_secs(23 * 3600)));
}
