//! The Redis backend against real `redis-server` processes started by the tests.
#![cfg(feature = "redis")]

mod support;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use governor::clock::FakeRelativeClock;
use support::conformance::*;
use support::{RedisServer, cost, key, no_refill, prepare};
use tollgate::backend::redis::{FailurePolicy, RedisBackend, TestClock};
use tollgate::backend::{Backend, Decision, LocalBackend, Outcome};
use tollgate::key::Global;
use tollgate::{BackendErrorKind, Key, Policy, Quota, RateLimitLayer};

/// A backend of a fleet of one (no announcement key beside the buckets the tests count).
fn backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::builder()
        .url(server.url())
        .fleet(tollgate::backend::remote::Fleet::Size(
            std::num::NonZeroU32::MIN,
        ))
        .build()
        .unwrap()
}

/// A backend for concurrency tests: a generous timeout for a loaded machine, and no deny
/// cache, so that every decision really reaches Redis.
fn uncached(server: &RedisServer) -> tollgate::backend::redis::RedisBackendBuilder {
    RedisBackend::builder()
        .url(server.url())
        .timeout(Duration::from_secs(2))
        .deny_cache_capacity(0)
}

// ---------------------------------------------------------------------------------------------
// Conformance: the same scripted sequences against the local and the Redis backend.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn conformance_local() {
    for vectors in [redis_cell_vectors(), refill_vectors()] {
        let clock = FakeRelativeClock::default();
        let backend = LocalBackend::builder().clock(clock.clone()).build();
        let start = std::cell::Cell::new(0u64);
        let set = |ms: u64| {
            clock.advance(Duration::from_millis(ms - start.get()));
            start.set(ms);
        };
        run_vectors(&backend, set, vectors, "local").await;
    }
}

/// The window vectors on the local backend, its clock reading the Unix epoch when built.
#[tokio::test]
async fn conformance_local_windows() {
    for vectors in window_vectors() {
        let clock = FakeRelativeClock::default();
        let backend = LocalBackend::builder()
            .clock(clock.clone())
            .clock_epoch(Duration::ZERO)
            .build();
        let start = std::cell::Cell::new(0u64);
        let set = |ms: u64| {
            clock.advance(Duration::from_millis(ms - start.get()));
            start.set(ms);
        };
        run_vectors(&backend, set, vectors, "local").await;
    }
}

/// Random sequences (times, costs) on both backends give the same states, decision by
/// decision: the Redis script and `window.rs` compute the same numbers to the microsecond.
#[tokio::test]
async fn windows_agree_with_the_local_backend_on_random_sequences() {
    let server = RedisServer::start();
    agree_with_local(|clock| at_time(&server, &clock)).await;
}

#[tokio::test]
async fn conformance_redis() {
    let server = RedisServer::start();
    let backends = std::cell::RefCell::new(Vec::new());
    let make = |clock: TestClock| {
        let b = RedisBackend::builder()
            .url(server.url())
            .test_clock(clock)
            .build()
            .unwrap();
        backends.borrow_mut().push(b.clone());
        b
    };
    remote_vectors(make, "redis").await;
    // The denials were answered by the deny cache while their time had not come, by Redis
    // otherwise: the outcome is the same either way.
    for b in backends.borrow().iter() {
        assert_eq!(b.stats().errors, 0);
    }
}

/// Reservations, peeks and resets, as on every backend.
#[tokio::test]
async fn modes_redis() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let b = at_time(&server, &clock);
    modes(&b, |by| clock.advance(by), "redis").await;
}

#[tokio::test]
async fn modes_local() {
    let clock = FakeRelativeClock::default();
    let b = LocalBackend::builder()
        .clock(clock.clone())
        .clock_epoch(Duration::ZERO)
        .build();
    modes(&b, |by| clock.advance(by), "local").await;
}

/// Wait mode: requests that pass at once hold no waiter's slot while Redis answers; the local
/// backend, which answers at once, does the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_redis() {
    let server = RedisServer::start();
    waiters(uncached(&server).build().unwrap(), "redis").await;
    waiters(backend(&server), "redis-cached").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_local() {
    waiters(LocalBackend::new(), "local").await;
}

/// The window vectors again without the deny cache: every step is Redis's own answer.
#[tokio::test]
async fn conformance_redis_windows_uncached() {
    let server = RedisServer::start();
    for vectors in window_vectors() {
        let clock = aligned_test_clock();
        let backend = uncached(&server).test_clock(clock.clone()).build().unwrap();
        let start = std::cell::Cell::new(0u64);
        let set = |ms: u64| {
            clock.advance(Duration::from_millis(ms - start.get()));
            start.set(ms);
        };
        run_vectors(&backend, set, vectors, "redis uncached").await;
        assert_eq!(backend.stats().deny_cache_hits, 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Windows on Redis: mixed with GCRA, under concurrency, in storage, in the deny cache.
// ---------------------------------------------------------------------------------------------

/// A backend on `server` whose script time is `clock`, without the deny cache.
fn at_time(server: &RedisServer, clock: &TestClock) -> RedisBackend {
    uncached(server).test_clock(clock.clone()).build().unwrap()
}

fn remaining(d: &Decision) -> Vec<u32> {
    d.quotas().iter().map(|q| q.remaining).collect()
}

fn outcomes(d: &Decision) -> Vec<Outcome> {
    d.quotas().iter().map(|q| q.outcome).collect()
}

fn denied_ms(ms: u64) -> Outcome {
    Outcome::Denied {
        retry_after: Duration::from_millis(ms),
    }
}

/// GCRA, a fixed and a sliding window in one policy: whichever denies, the others take
/// nothing and are reported as they are.
#[tokio::test]
async fn windows_and_gcra_mix_all_or_nothing() {
    use Outcome::Allowed;
    let server = RedisServer::start();
    let clock = aligned_test_clock();
    let b = at_time(&server, &clock);
    let policy = Policy::new("mix", Quota::per_second(1).burst(3))
        .and(Quota::per_minute(4).fixed_window())
        .and(
            Quota::per_minute(6)
                .sliding_window()
                .resolution(Duration::from_secs(10)),
        );
    let p = prepare(&b, &policy);
    let k = key("tenant");
    let decide = |c: u32| b.decide(&p, &k, cost(c));
    for left in [[2, 3, 5], [1, 2, 4], [0, 1, 3]] {
        let d = decide(1).await.unwrap();
        assert!(d.is_allowed(), "{d:?}");
        assert_eq!(remaining(&d), left);
    }
    // GCRA denies: the windows keep their units.
    let d = decide(1).await.unwrap();
    assert_eq!(outcomes(&d), [denied_ms(1000), Allowed, Allowed]);
    assert_eq!(remaining(&d), [0, 1, 3]);
    clock.advance(Duration::from_secs(1));
    let d = decide(1).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(remaining(&d), [0, 0, 2]);
    // The fixed window denies until the minute ends: GCRA and the sliding window keep theirs.
    clock.advance(Duration::from_secs(1));
    let d = decide(1).await.unwrap();
    assert_eq!(outcomes(&d), [Allowed, denied_ms(58_000), Allowed]);
    assert_eq!(remaining(&d), [1, 0, 2]);
    // A new minute: the fixed window is empty, the sliding window still counts the 4 of its
    // first sub-window in full, so a cost of 3 waits until 1 of them has slid out (2.5 s).
    clock.advance(Duration::from_secs(58));
    let d = decide(3).await.unwrap();
    assert_eq!(outcomes(&d), [Allowed, Allowed, denied_ms(2500)]);
    assert_eq!(remaining(&d), [3, 4, 2]);
    // Nothing was taken by the denials: every quota has exactly what the allowed requests left.
    let d = decide(2).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(remaining(&d), [1, 2, 0]);
    assert_eq!(b.stats().errors, 0);
}

/// Concurrent decisions on one key, from two backends with their own connections, never
/// admit more than a window's limit (the script time is fixed, so no boundary passes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_admit_exactly_their_limit_under_concurrency() {
    let server = RedisServer::start();
    let clock = aligned_test_clock();
    clock.advance(Duration::from_secs(7));
    let fixed = Policy::new("fixed-hot", Quota::per_hour(50).fixed_window());
    let sliding = Policy::new(
        "sliding-hot",
        Quota::per_minute(30)
            .sliding_window()
            .resolution(Duration::from_secs(5)),
    );
    let replicas: Vec<_> = (0..2)
        .map(|_| {
            let b = at_time(&server, &clock);
            let f = Arc::new(prepare(&b, &fixed));
            let s = Arc::new(prepare(&b, &sliding));
            (b, f, s)
        })
        .collect();
    let mut tasks = Vec::new();
    for i in 0..600 {
        let (b, f, s) = replicas[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let p = if i % 3 == 0 { s } else { f };
            let d = b.decide(&p, &key("hot"), cost(1)).await.unwrap();
            (i % 3 == 0, d.is_allowed())
        }));
    }
    let (mut fixed_allowed, mut sliding_allowed) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            (true, allowed) => sliding_allowed += usize::from(allowed),
            (false, allowed) => fixed_allowed += usize::from(allowed),
        }
    }
    assert_eq!((fixed_allowed, sliding_allowed), (50, 30));
    let calls: u64 = replicas.iter().map(|(b, ..)| b.stats().calls).sum();
    assert!(calls < 600, "concurrent decisions shared calls: {calls}");
}

fn pttl(server: &RedisServer, key: &str) -> i64 {
    server
        .cmd(&["PTTL", key])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap()
}

/// A stored value's numbers (see `gcra.lua`): a little-endian f64, then little-endian u32s,
/// then the values it was counted under and the format (17 bytes, left out).
fn stored_numbers(server: &RedisServer, key: &str) -> (f64, Vec<u32>) {
    let v = server.get_bytes(key).expect(key);
    assert_eq!(v.last(), Some(&2), "format 2: {v:?}");
    let v = &v[..v.len() - 17];
    assert_eq!((v.len() - 8) % 4, 0, "{v:?}");
    let first = f64::from_le_bytes(v[..8].try_into().unwrap());
    let rest = v[8..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (first, rest)
}

/// What a window keeps in Redis, and that it goes away by itself (on Redis's own clock).
#[tokio::test]
async fn window_keys_hold_their_counts_and_expire() {
    let server = RedisServer::start();
    let b = backend(&server);
    let policy = Policy::new("store", Quota::per_second(3).fixed_window()).and(
        Quota::per_second(10)
            .sliding_window()
            .resolution(Duration::from_millis(500)),
    );
    let p = prepare(&b, &policy);
    // Start just after a second begins (on this machine's clock, which Redis shares): the keys
    // cannot expire between the decision and the checks below.
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let into_second = Duration::from_nanos(u64::from(since_epoch.subsec_nanos()));
    tokio::time::sleep(Duration::from_millis(1010) - into_second).await;
    let d = b.decide(&p, &key("k"), cost(2)).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(remaining(&d), [1, 8]);
    let (fixed, sliding) = ("tollgate:{store:bk}:2.f0", "tollgate:{store:bk}:2.s1");
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    // The window index, the count; the index being whole seconds since the epoch here.
    let (window, count) = stored_numbers(&server, fixed);
    assert!((window as u64).abs_diff(unix.as_secs()) <= 1, "{window}");
    assert_eq!(window.fract(), 0.0);
    assert_eq!(count, [2]);
    // The newest sub-window's index, then c_oldest c_middle c_newest.
    let (slice, counts) = stored_numbers(&server, sliding);
    assert_eq!(counts, [0, 0, 2]);
    assert!(
        (slice as u64).abs_diff(unix.as_millis() as u64 / 500) <= 2,
        "{slice}"
    );
    // The fixed window's key lives until the window's end; the sliding window's until its
    // counts have slid out: the end of the sub-window and two more.
    let (fixed_ttl, sliding_ttl) = (pttl(&server, fixed), pttl(&server, sliding));
    assert!((500..=1000).contains(&fixed_ttl), "{fixed_ttl}");
    assert!((1000..=1500).contains(&sliding_ttl), "{sliding_ttl}");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(server.cmd(&["DBSIZE"]).trim(), ":0", "nothing left behind");
}

/// Window denials are answered by the deny cache with the numbers Redis would give.
#[tokio::test]
async fn deny_cache_answers_window_denials_as_redis_would() {
    let server = RedisServer::start();
    let clock = aligned_test_clock();
    let b = RedisBackend::builder()
        .url(server.url())
        .test_clock(clock.clone())
        .build()
        .unwrap();
    let fixed = prepare(&b, &Policy::new("f", Quota::per_minute(2).fixed_window()));
    let k = key("flood");
    clock.advance(Duration::from_secs(10));
    for _ in 0..2 {
        assert!(b.decide(&fixed, &k, cost(1)).await.unwrap().is_allowed());
    }
    let d = b.decide(&fixed, &k, cost(1)).await.unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_secs(50)));
    let calls = b.stats().decisions;
    clock.advance(Duration::from_secs(20));
    for c in [1, 2, 1] {
        let d = b.decide(&fixed, &k, cost(c)).await.unwrap();
        assert_eq!(outcomes(&d), [denied_ms(30_000)]);
        assert_eq!(d.quotas()[0].reset_after, Duration::from_secs(30));
        assert_eq!(remaining(&d), [0]);
    }
    assert_eq!(b.stats().decisions, calls, "answered by the cache");
    // More than the limit goes to Redis, which says it never fits.
    assert!(b.decide(&fixed, &k, cost(3)).await.unwrap().never_fits());
    // At the window's end, Redis decides again, and allows.
    clock.advance(Duration::from_secs(30));
    assert!(b.decide(&fixed, &k, cost(2)).await.unwrap().is_allowed());
    assert_eq!(b.stats().decisions, calls + 2);

    // A sliding window: 10 per second, at 25 % of the next second 7.5 count.
    let sliding = prepare(
        &b,
        &Policy::new("s", Quota::per_second(10).sliding_window()),
    );
    for _ in 0..10 {
        assert!(b.decide(&sliding, &k, cost(1)).await.unwrap().is_allowed());
    }
    clock.advance(Duration::from_millis(1250));
    for _ in 0..2 {
        assert!(b.decide(&sliding, &k, cost(1)).await.unwrap().is_allowed());
    }
    let d = b.decide(&sliding, &k, cost(1)).await.unwrap();
    assert_eq!(outcomes(&d), [denied_ms(50)]);
    let (calls, hits) = (b.stats().decisions, b.stats().deny_cache_hits);
    clock.advance(Duration::from_millis(30));
    let d = b.decide(&sliding, &k, cost(1)).await.unwrap();
    assert_eq!(outcomes(&d), [denied_ms(20)]);
    assert_eq!(d.quotas()[0].reset_after, Duration::from_millis(20));
    assert_eq!(b.stats().deny_cache_hits, hits + 1);
    // A larger cost needs the counts, which only Redis has.
    let d = b.decide(&sliding, &k, cost(9)).await.unwrap();
    assert_eq!(outcomes(&d), [denied_ms(1220)]);
    assert_eq!(b.stats().decisions, calls + 1);
    clock.advance(Duration::from_millis(20));
    assert!(b.decide(&sliding, &k, cost(1)).await.unwrap().is_allowed());
}

/// GCRA stores its theoretical arrival time as seconds and nanoseconds since the epoch, exact;
/// a value in another format under the key (the text of tollgate 0.1, or anything another
/// program wrote) counts as nothing stored, and keys of the old layout are not read.
#[tokio::test]
async fn gcra_stores_its_time_exactly_and_takes_foreign_values_for_nothing() {
    let server = RedisServer::start();
    let clock = TestClock::new(); // 1 000 000 s after the epoch
    clock.advance(Duration::from_nanos(123));
    let b = at_time(&server, &clock);
    let p = prepare(&b, &Policy::new("api", Quota::per_minute(1).burst(10)));
    let name = "tollgate:{api:balice}:2.g0";
    // A full bucket in older layouts' keys (0.1's text, format 1's values in the name): not
    // this version's, not read.
    server.cmd(&["SET", "tollgate:{api:balice}:0:60000000000x10", "1000600 0"]);
    server.cmd(&["SET", "tollgate:{api:balice}:0g60000000000x10", "\x01"]);
    let d = b.decide(&p, &key("alice"), cost(1)).await.unwrap();
    assert_eq!(remaining(&d), [9]);
    let stored = server.get_bytes(name).unwrap();
    let mut expected = 1_000_060u32.to_le_bytes().to_vec();
    expected.extend_from_slice(&123u32.to_le_bytes());
    // Then the values it was counted under (emission interval, burst, 0) and the format.
    expected.extend_from_slice(&60e9f64.to_le_bytes());
    expected.extend_from_slice(&10u32.to_le_bytes());
    expected.extend_from_slice(&0u32.to_le_bytes());
    expected.push(2);
    assert_eq!(stored, expected, "TAT = now + 60 s");
    for foreign in ["1000600 0", "garbage", "12345678901234567890"] {
        server.cmd(&["SET", name, foreign]);
        let d = b.decide(&p, &key("alice"), cost(1)).await.unwrap();
        assert_eq!(remaining(&d), [9], "{foreign:?} is nothing stored");
    }
}

// ---------------------------------------------------------------------------------------------
// Exactness on Redis's own clock.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn one_request_on_a_fresh_burst_10_bucket_leaves_exactly_9_and_the_key_expires() {
    let server = RedisServer::start();
    let b = backend(&server);
    let p = prepare(&b, &Policy::new("api", Quota::per_second(5).burst(10)));
    let d = b.decide(&p, &key("alice"), cost(1)).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.quotas()[0].remaining, 9);
    assert_eq!(d.quotas()[0].reset_after, Duration::from_millis(200));
    // The key lives until the bucket is full again: 200 ms, to the millisecond since the epoch
    // rounded up (`PTTL` counts from the current millisecond rounded down: up to 201).
    let pttl: i64 = server
        .cmd(&["PTTL", "tollgate:{api:balice}:2.g0"])
        .trim_start_matches(':')
        .trim()
        .parse()
        .unwrap();
    assert!((1..=201).contains(&pttl), "PTTL {pttl}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        server.cmd(&["EXISTS", "tollgate:{api:balice}:2.g0"]).trim(),
        ":0"
    );
    assert_eq!(server.cmd(&["DBSIZE"]).trim(), ":0", "nothing left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_backends_with_separate_connections_allow_exactly_the_burst() {
    let server = RedisServer::start();
    let policy = Policy::new("shared", no_refill(50));
    let replicas: Vec<_> = (0..2)
        .map(|_| {
            let b = uncached(&server).build().unwrap();
            let p = Arc::new(prepare(&b, &policy));
            (b, p)
        })
        .collect();
    let mut tasks = Vec::new();
    for i in 0..400 {
        let (b, p) = replicas[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            b.decide(&p, &key("hot"), cost(1))
                .await
                .unwrap()
                .is_allowed()
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += usize::from(t.await.unwrap());
    }
    assert_eq!(allowed, 50);
    let calls: u64 = replicas.iter().map(|(b, _)| b.stats().decisions).sum();
    assert_eq!(calls, 400);
    // Concurrent decisions shared script calls (a few calls in flight per backend at a time).
    let script_calls: u64 = replicas.iter().map(|(b, _)| b.stats().calls).sum();
    assert!(
        script_calls < 400,
        "{script_calls} script calls for 400 decisions"
    );
}

/// Makes `n` concurrent cost-1 decisions on key `k`; returns how many were allowed.
async fn allowed_of_concurrent(
    b: &RedisBackend,
    p: &Arc<<RedisBackend as Backend>::Policy>,
    n: usize,
) -> usize {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (b, p) = (b.clone(), p.clone());
            tokio::spawn(
                async move { b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed() },
            )
        })
        .collect();
    let mut allowed = 0;
    for t in tasks {
        allowed += usize::from(t.await.unwrap());
    }
    allowed
}

/// Decisions of one call on the same (hot) key read the bucket once and write it once: Redis
/// does one `GET` and one `SET` per call, not per request, and the limit stays exact, for every
/// algorithm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_is_read_and_written_once_per_call() {
    let server = RedisServer::start();
    // The script's time is fixed: no window boundary passes during the test.
    let clock = aligned_test_clock();
    clock.advance(Duration::from_secs(30));
    let quotas = [
        no_refill(100),
        Quota::per_hour(100).fixed_window(),
        Quota::per_hour(100)
            .sliding_window()
            .resolution(Duration::from_secs(60)),
    ];
    for (i, quota) in quotas.into_iter().enumerate() {
        let b = at_time(&server, &clock);
        let p = Arc::new(prepare(&b, &Policy::new(format!("hot{i}"), quota)));
        server.cmd(&["CONFIG", "RESETSTAT"]);
        assert_eq!(allowed_of_concurrent(&b, &p, 400).await, 100, "{quota:?}");
        let stats = b.stats();
        assert!(stats.calls < 400, "{stats:?}");
        let info = server.cmd(&["INFO", "commandstats"]);
        // `cmdstat_<cmd>:calls=N,usec=...,failed_calls=F`: the calls that ran.
        let calls = |cmd: &str| -> u64 {
            let line = info
                .lines()
                .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
                .unwrap_or_else(|| panic!("no {cmd} in {info}"));
            let field = |name: &str| -> u64 {
                line.split([':', ','])
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            field("calls") - field("failed_calls")
        };
        // (The first calls may find no script loaded: those fail with NOSCRIPT and are sent
        // again.)
        assert_eq!(calls("evalsha"), stats.calls, "{info}");
        assert_eq!(calls("get"), stats.calls, "{info}");
        // Calls made once the bucket was empty deny everything and write nothing.
        assert!(calls("set") <= stats.calls, "{info}");
    }
}

/// Decisions batched into one call are still each atomic and all-or-nothing, with their own
/// costs and policies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_decisions_keep_their_own_costs_and_policies() {
    let server = RedisServer::start();
    let b = uncached(&server).build().unwrap();
    let small = Arc::new(prepare(&b, &Policy::new("small", no_refill(10))));
    let multi = Arc::new(prepare(
        &b,
        &Policy::new("multi", no_refill(100)).and(Quota::per_day(1).burst(30)),
    ));
    let mut tasks = Vec::new();
    for i in 0..300u32 {
        let b = b.clone();
        let (p, c) = if i % 2 == 0 {
            (small.clone(), 1)
        } else {
            (multi.clone(), 1 + i % 3)
        };
        tasks.push(tokio::spawn(async move {
            let d = b.decide(&p, &key("k"), cost(c)).await.unwrap();
            (i % 2 == 0, c, d.is_allowed())
        }));
    }
    let (mut small_units, mut multi_units) = (0, 0);
    for t in tasks {
        let (is_small, c, allowed) = t.await.unwrap();
        if allowed {
            if is_small {
                small_units += c;
            } else {
                multi_units += c;
            }
        }
    }
    assert_eq!(small_units, 10);
    // The 30-unit daily quota bounds the multi policy; nothing denied took any unit, so the
    // units that passed fill it exactly unless the last requests were too big to fit.
    assert!((28..=30).contains(&multi_units), "{multi_units}");
    let left = b.decide(&multi, &key("k"), cost(1)).await.unwrap();
    // Units taken are exactly the units allowed (plus this check's own, when it passed).
    assert_eq!(
        multi_units + left.quotas()[1].remaining + u32::from(left.is_allowed()),
        30,
        "{left:?}"
    );
    assert!(b.stats().calls < 301, "{:?}", b.stats());
}

#[tokio::test]
async fn multi_quota_is_all_or_nothing() {
    let server = RedisServer::start();
    let b = backend(&server);
    let p = prepare(&b, &Policy::new("multi", no_refill(5)).and(no_refill(3)));
    let k = key("tenant");
    for left in [2, 1, 0] {
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.quotas()[1].remaining, left);
    }
    // The second quota is empty: the first one must not lose units to the denied requests.
    for _ in 0..3 {
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.quotas().len(), 2, "every quota is reported");
        assert_eq!(d.quotas()[0].outcome, Outcome::Allowed);
        assert_eq!(d.quotas()[0].remaining, 2, "untouched by denials");
        assert!(matches!(d.quotas()[1].outcome, Outcome::Denied { .. }));
    }
    // Both keys of the decision share one hash tag.
    let keys = server.cmd(&["KEYS", "*"]);
    assert!(keys.contains("tollgate:{multi:btenant}:2.g0"), "{keys}");
    assert!(keys.contains("tollgate:{multi:btenant}:2.g1"), "{keys}");

    // A cost that fits the first quota but not the second takes nothing from the first.
    let p2 = prepare(&b, &Policy::new("multi2", no_refill(10)).and(no_refill(4)));
    assert!(b.decide(&p2, &k, cost(3)).await.unwrap().is_allowed());
    let d = b.decide(&p2, &k, cost(3)).await.unwrap();
    assert!(!d.is_allowed());
    assert_eq!(d.quotas()[0].remaining, 7);
    let d = b.decide(&p2, &k, cost(1)).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.quotas()[0].remaining, 6);
}

/// A cost larger than a burst never fits, reports the bucket's real state (not "empty"), and
/// takes nothing; while Redis is down it is still refused, whatever the failure policy.
#[tokio::test]
async fn cost_larger_than_burst_never_fits_and_reports_the_real_state() {
    let server = RedisServer::start();
    let b = backend(&server);
    let p = prepare(&b, &Policy::new("big", no_refill(5)).and(no_refill(2)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    let d = b.decide(&p, &key("k"), cost(3)).await.unwrap();
    assert!(d.never_fits());
    assert_eq!(d.retry_after(), None);
    let refusing: Vec<_> = d
        .quotas()
        .iter()
        .filter(|q| q.outcome != Outcome::Allowed)
        .collect();
    assert_eq!(refusing.len(), 1);
    assert_eq!(refusing[0].index, 1);
    assert_eq!(
        refusing[0].remaining, 1,
        "one of two units left, as in Redis"
    );
    // And it took nothing.
    let d = b.decide(&p, &key("k"), cost(1)).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.quotas()[1].remaining, 0);

    drop(server);
    let d = b.decide(&p, &key("k"), cost(3)).await.unwrap();
    assert!(d.never_fits(), "refused without Redis too: {d:?}");
}

#[tokio::test]
async fn script_flush_is_survived() {
    let server = RedisServer::start();
    let b = backend(&server);
    let p = prepare(&b, &Policy::new("flush", no_refill(10)));
    assert_eq!(
        b.decide(&p, &key("k"), cost(1)).await.unwrap().quotas()[0].remaining,
        9
    );
    assert_eq!(server.cmd(&["SCRIPT", "FLUSH"]).trim(), "+OK");
    let d = b.decide(&p, &key("k"), cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 8, "state kept, script reloaded");
    assert_eq!(b.stats().errors, 0);
}

#[tokio::test]
async fn deny_cache_answers_until_the_retry_time_then_asks_redis() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let b = RedisBackend::builder()
        .url(server.url())
        .test_clock(clock.clone())
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("deny", Quota::per_second(1).burst(2)));
    let k = key("flood");
    for _ in 0..2 {
        assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    }
    let first = b.decide(&p, &k, cost(1)).await.unwrap();
    assert_eq!(first.retry_after(), Some(Duration::from_secs(1)));
    let calls = b.stats().decisions;
    clock.advance(Duration::from_millis(600));
    for _ in 0..100 {
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert_eq!(d.retry_after(), Some(Duration::from_millis(400)));
    }
    let s = b.stats();
    assert_eq!(s.decisions, calls, "a denied flood costs Redis nothing");
    assert_eq!(s.deny_cache_hits, 100);
    assert_eq!(s.deny_cache_entries, 1);
    // Other keys are not affected.
    assert!(
        b.decide(&p, &key("other"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    // At the retry time, Redis decides again, and allows.
    clock.advance(Duration::from_millis(400));
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    assert_eq!(b.stats().decisions, calls + 2);
}

#[tokio::test]
async fn deny_cache_is_scoped_to_the_prepared_policy() {
    let server = RedisServer::start();
    let b = backend(&server);
    let k = key("upgraded");
    let small = prepare(&b, &Policy::new("plan", no_refill(2)));
    for _ in 0..2 {
        assert!(b.decide(&small, &k, cost(1)).await.unwrap().is_allowed());
    }
    assert!(!b.decide(&small, &k, cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&small, &k, cost(1)).await.unwrap().is_allowed());
    assert_eq!(b.stats().deny_cache_hits, 1);
    // The application raises the limit at run time: the old denial must not apply.
    let big = prepare(&b, &Policy::new("plan", no_refill(10)));
    let d = b.decide(&big, &k, cost(1)).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    // A changed quota keeps what the key used (`OnChange::Keep`, as on the local backend):
    // 2 used, 1 more.
    assert_eq!(d.quotas()[0].remaining, 7);
    // The same quota under the same name shares the bucket, whoever prepared it.
    let again = prepare(&b, &Policy::new("plan", no_refill(10)));
    assert_eq!(
        b.decide(&again, &k, cost(1)).await.unwrap().quotas()[0].remaining,
        6
    );
}

/// Raising a rate (not just a burst) applies at once to a client that was denied, even when
/// the old bucket's timestamp lies far in the future.
#[tokio::test]
async fn raising_a_rate_applies_at_once() {
    let server = RedisServer::start();
    let b = backend(&server);
    let k = key("merchant");
    let daily = prepare(&b, &Policy::new("tier", Quota::per_day(1)));
    assert!(b.decide(&daily, &k, cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&daily, &k, cost(1)).await.unwrap().is_allowed());
    // The one request of the day carries over (`OnChange::Keep`): 99 left of the hour's 100,
    // at once, not after the day's emission interval.
    let hourly = prepare(&b, &Policy::new("tier", Quota::per_hour(100)));
    for _ in 0..99 {
        assert!(b.decide(&hourly, &k, cost(1)).await.unwrap().is_allowed());
    }
    assert!(!b.decide(&hourly, &k, cost(1)).await.unwrap().is_allowed());
}

// ---------------------------------------------------------------------------------------------
// Failures.
// ---------------------------------------------------------------------------------------------

const TIMEOUT: Duration = Duration::from_millis(100);

fn failing_backend(server: &RedisServer, on_failure: FailurePolicy) -> RedisBackend {
    RedisBackend::builder()
        .url(server.url())
        .timeout(TIMEOUT)
        .on_failure(on_failure)
        .circuit_breaker(3, Duration::from_millis(100))
        .build()
        .unwrap()
}

/// Decides and checks that no request waits past the timeout (plus scheduling slack for a
/// loaded 2-core CI machine, far less than a second timeout).
async fn timed<F: Future<Output = T>, T>(f: F) -> T {
    let started = Instant::now();
    let out = f.await;
    let took = started.elapsed();
    assert!(
        took < TIMEOUT + Duration::from_millis(60),
        "a request waited {took:?}"
    );
    out
}

/// Polls until a decision comes from Redis again (bounded).
async fn until_redis_decides(b: &RedisBackend, p: &<RedisBackend as Backend>::Policy, k: &Key) {
    let started = Instant::now();
    loop {
        let d = timed(b.decide(p, k, cost(1))).await;
        if let Ok(d) = d
            && d.quotas().len() == 1
            && !b.stats().breaker_open
        {
            let calls = b.stats().decisions;
            // Make sure it is Redis answering, not a fallback.
            let again = b.decide(p, k, cost(1)).await.unwrap();
            if b.stats().decisions > calls && again.quotas().len() == 1 {
                return;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "shared limiting did not resume: {:?}",
            b.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn killed_redis_fails_open_opens_the_breaker_and_recovers() {
    let mut server = RedisServer::start();
    let b = failing_backend(&server, FailurePolicy::FailOpen);
    let p = prepare(
        &b,
        &Policy::new("outage", Quota::per_second(100).burst(100)),
    );
    let k = key("k");
    assert_eq!(b.decide(&p, &k, cost(1)).await.unwrap().quotas().len(), 1);

    server.kill();
    for _ in 0..20 {
        let d = timed(b.decide(&p, &k, cost(1))).await.unwrap();
        assert!(d.is_allowed());
        assert!(
            d.quotas().is_empty(),
            "fail-open decisions carry no quota state"
        );
    }
    let s = b.stats();
    assert_eq!(s.fail_open, 20);
    assert!(s.breaker_open, "{s:?}");
    assert_eq!(s.breaker_trips, 1);
    assert!(
        s.errors >= 3 && s.errors < 20,
        "breaker stops the calls: {s:?}"
    );

    // While the breaker is open, answers are immediate (at most one of them may be a trial
    // call, bounded by the timeout).
    let started = Instant::now();
    for _ in 0..100 {
        b.decide(&p, &k, cost(1)).await.unwrap();
    }
    assert!(started.elapsed() < 3 * TIMEOUT, "{:?}", started.elapsed());

    server.restart();
    until_redis_decides(&b, &p, &k).await;
}

#[tokio::test]
async fn killed_redis_fails_closed() {
    let mut server = RedisServer::start();
    let b = failing_backend(&server, FailurePolicy::FailClosed);
    let p = prepare(&b, &Policy::new("closed", no_refill(100)));
    let k = key("k");
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    server.kill();
    for _ in 0..10 {
        let err = timed(b.decide(&p, &k, cost(1))).await.unwrap_err();
        assert!(
            matches!(
                err.kind(),
                BackendErrorKind::Unavailable | BackendErrorKind::Timeout
            ),
            "{err}"
        );
    }
    let s = b.stats();
    assert_eq!(s.fail_closed, 10);
    assert!(s.breaker_open);
    server.restart();
    until_redis_decides(&b, &p, &k).await;
}

#[tokio::test]
async fn killed_redis_falls_back_to_local_limits() {
    let mut server = RedisServer::start();
    let b = failing_backend(&server, FailurePolicy::FallbackLocal);
    let p = prepare(&b, &Policy::new("fallback", no_refill(3)));
    let k = key("k");
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    server.kill();
    let mut allowed = 0;
    for _ in 0..10 {
        let d = timed(b.decide(&p, &k, cost(1))).await.unwrap();
        assert_eq!(d.quotas().len(), 1, "local decisions carry quota state");
        allowed += usize::from(d.is_allowed());
    }
    assert_eq!(
        allowed, 3,
        "the local twin enforces the same quota per instance"
    );
    assert_eq!(b.stats().fallback_local, 10);
    server.restart();
    until_redis_decides(&b, &p, &k).await;
}

/// Instances on one Redis count each other, and fall back to their share of each quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_count_each_other_and_fall_back_to_their_share() {
    let mut server = RedisServer::start();
    let url = server.url();
    let make = |fleet| {
        RedisBackend::builder()
            .url(url.clone())
            .timeout(TIMEOUT)
            .on_failure(FailurePolicy::FallbackLocal)
            .circuit_breaker(3, Duration::from_millis(100))
            .fleet(fleet)
            .build()
            .unwrap()
    };
    support::outage::fleet_shares(&mut server, make, |b| b.stats().fleet_size).await;
}

#[tokio::test]
async fn frozen_redis_costs_at_most_the_timeout() {
    let server = RedisServer::start();
    let b = failing_backend(&server, FailurePolicy::FailOpen);
    let p = prepare(&b, &Policy::new("frozen", no_refill(100)));
    let k = key("k");
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    server.pause();
    for _ in 0..5 {
        assert!(timed(b.decide(&p, &k, cost(1))).await.unwrap().is_allowed());
    }
    let s = b.stats();
    assert!(s.timeouts >= 3, "{s:?}");
    assert!(s.breaker_open, "{s:?}");
    server.resume();
    until_redis_decides(&b, &p, &k).await;
}

#[tokio::test]
async fn building_while_redis_is_down_neither_blocks_nor_fails() {
    // Find a free port, then leave it empty.
    let mut server = RedisServer::start();
    server.kill();
    let started = Instant::now();
    let b = failing_backend(&server, FailurePolicy::FailOpen);
    let p = prepare(&b, &Policy::new("late", no_refill(5)));
    // Neither blocks: a build that waited for the store would wait out its timeout (100 ms)
    // or a retry's backoff; under that, whatever the machine's load, it did not wait.
    assert!(started.elapsed() < TIMEOUT, "{:?}", started.elapsed());
    let k = key("k");
    for _ in 0..5 {
        assert!(timed(b.decide(&p, &k, cost(1))).await.unwrap().is_allowed());
    }
    // Redis comes up: limits start to apply without rebuilding anything.
    server.restart();
    until_redis_decides(&b, &p, &k).await;
}

// ---------------------------------------------------------------------------------------------
// End to end: two "replicas" (separate layers, backends and listeners) share one limit.
// ---------------------------------------------------------------------------------------------

async fn replica(redis_url: &str) -> String {
    replica_with(redis_url, Policy::new("e2e", no_refill(10))).await
}

async fn replica_with(redis_url: &str, policy: Policy) -> String {
    let backend = RedisBackend::builder().url(redis_url).build().unwrap();
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .key(Global)
        .backend(backend)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .route_layer(layer)
        .route("/", get(|| async { "free" }));
    support::serve_app(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_behind_a_load_balancer_share_one_limit() {
    let server = RedisServer::start();
    let a = replica(&server.url()).await;
    let b = replica(&server.url()).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut statuses = Vec::new();
    for i in 0..30 {
        let base = if i % 2 == 0 { &a } else { &b };
        let res = client
            .get(format!("{base}/api/hello"))
            .send()
            .await
            .unwrap();
        if res.status() == 200 {
            assert_eq!(res.headers()["ratelimit-policy"], r#""e2e";q=10;w=864000"#);
        } else {
            assert_eq!(res.status(), 429);
            assert!(res.headers().contains_key("retry-after"));
        }
        statuses.push(res.status().as_u16());
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        10,
        "{statuses:?}"
    );
    assert!(statuses[..10].iter().all(|s| *s == 200), "{statuses:?}");
    let res = client.get(format!("{a}/")).send().await.unwrap();
    assert_eq!(res.status(), 200);
}

/// Windows over real TCP on two replicas sharing Redis: one count, and headers that agree with
/// Redis's clock: a day's fixed window ends at the next 00:00 UTC, whichever replica answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_windows_and_their_headers() {
    let server = RedisServer::start();
    let client = reqwest::Client::new();
    let fixed = Policy::new("daily", Quota::per_day(4).fixed_window());
    let (a, b) = (
        replica_with(&server.url(), fixed.clone()).await,
        replica_with(&server.url(), fixed).await,
    );
    let mut statuses = Vec::new();
    let mut resets = Vec::new();
    for i in 0..6 {
        let base = if i % 2 == 0 { &a } else { &b };
        let res = client
            .get(format!("{base}/api/hello"))
            .send()
            .await
            .unwrap();
        let h = res.headers();
        assert_eq!(h["ratelimit-policy"], r#""daily";q=4;w=86400"#);
        let ratelimit = h["ratelimit"].to_str().unwrap().to_owned();
        let t: u64 = ratelimit.split(";t=").nth(1).unwrap().parse().unwrap();
        resets.push(t);
        if res.status() == 429 {
            assert_eq!(
                h["retry-after"].to_str().unwrap(),
                t.to_string(),
                "{ratelimit}"
            );
        }
        statuses.push(res.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429]);
    let until_midnight = 86_400
        - std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            % 86_400;
    for t in &resets {
        assert!(
            t.abs_diff(until_midnight) <= 2,
            "t={t}, midnight in {until_midnight} s"
        );
    }

    let sliding = Policy::new("minute", Quota::per_minute(3).sliding_window());
    let (a, b) = (
        replica_with(&server.url(), sliding.clone()).await,
        replica_with(&server.url(), sliding).await,
    );
    let mut allowed = 0;
    for i in 0..6 {
        let base = if i % 2 == 0 { &a } else { &b };
        let res = client
            .get(format!("{base}/api/hello"))
            .send()
            .await
            .unwrap();
        let h = res.headers();
        assert_eq!(h["ratelimit-policy"], r#""minute";q=3;w=60"#);
        if res.status() == 200 {
            allowed += 1;
        } else {
            let ratelimit = h["ratelimit"].to_str().unwrap();
            let t: u64 = ratelimit.split(";t=").nth(1).unwrap().parse().unwrap();
            let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
            assert!(retry >= t && t >= 1, "{ratelimit}, Retry-After {retry}");
            assert!(retry <= 120, "within two windows: {retry}");
        }
    }
    assert_eq!(allowed, 3);
}

#[test]
fn decisions_are_send_and_the_future_is_unpin() {
    fn check<F: Future<Output = Result<Decision, tollgate::BackendError>> + Send + Unpin>() {}
    check::<<RedisBackend as Backend>::Future>();
}

#[tokio::test]
async fn an_existing_connection_manager_can_be_used() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
    let b = RedisBackend::builder()
        .connection_manager(manager)
        .prefix("myapp:rl")
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("api", no_refill(3)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert!(
        server
            .cmd(&["KEYS", "*"])
            .contains("myapp:rl:{api:bk}:2.g0"),
        "keys under the custom prefix"
    );
}

/// A decision whose key Redis refuses fails alone: the decisions sharing its script call go
/// on, and nothing is taken for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_key_fails_only_its_own_decision() {
    let server = RedisServer::start();
    let b = uncached(&server)
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let p = Arc::new(prepare(&b, &Policy::new("iso", no_refill(1000))));
    // Another program wrote a list where the "bad" bucket lives.
    let bad_key = "tollgate:{iso:bbad}:2.g0";
    server.cmd(&["RPUSH", bad_key, "x"]);
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (b, p) = (b.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let k = if i % 10 == 0 { "bad" } else { "good" };
            (
                k,
                b.decide(&p, &key(k), cost(1)).await.map(|d| d.is_allowed()),
            )
        }));
    }
    let (mut good, mut bad_errors) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            ("good", Ok(true)) => good += 1,
            ("bad", Err(e)) => {
                assert_eq!(e.kind(), tollgate::BackendErrorKind::Protocol, "{e}");
                bad_errors += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((good, bad_errors), (180, 20));
    assert!(b.stats().calls < 200, "{:?}", b.stats());
    // Refused keys say nothing about Redis being reachable: the breaker stays closed, even
    // after more refusals in a row than its threshold.
    for _ in 0..10 {
        assert!(b.decide(&p, &key("bad"), cost(1)).await.is_err());
    }
    assert!(!b.stats().breaker_open, "{:?}", b.stats());
    assert!(
        b.decide(&p, &key("good"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    // The list is untouched.
    assert_eq!(server.cmd(&["LLEN", bad_key]).trim(), ":1");
}

/// Without batching (e.g. behind a sharding proxy), every decision is its own call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_can_be_turned_off() {
    let server = RedisServer::start();
    let b = uncached(&server).batching(false).build().unwrap();
    let p = Arc::new(prepare(&b, &Policy::new("solo", no_refill(30))));
    assert_eq!(allowed_of_concurrent(&b, &p, 100).await, 30);
    let s = b.stats();
    assert_eq!(s.calls, s.decisions, "{s:?}");
}

/// A cached denial is forgotten once Redis allows a smaller request on the key: the next
/// denial reports Redis's counts, not the stale cached ones (for every algorithm).
#[tokio::test]
async fn the_deny_cache_forgets_a_key_redis_has_since_allowed() {
    let server = RedisServer::start();
    for (i, quota) in [
        Quota::per_hour(10),
        Quota::per_hour(10).fixed_window(),
        Quota::new(10, Duration::from_secs(7200)).sliding_window(),
    ]
    .into_iter()
    .enumerate()
    {
        let clock = TestClock::new();
        let b = RedisBackend::builder()
            .url(server.url())
            .test_clock(clock.clone())
            .build()
            .unwrap();
        let p = prepare(&b, &Policy::new(format!("forget-{i}"), quota));
        let k = key("k");
        for c in [4, 4] {
            assert!(
                b.decide(&p, &k, cost(c)).await.unwrap().is_allowed(),
                "{quota}"
            );
        }
        let denied = b.decide(&p, &k, cost(3)).await.unwrap();
        assert_eq!(remaining(&denied), [2], "{quota}");
        // A smaller request goes to Redis and passes: the cached counts are out of date.
        assert!(
            b.decide(&p, &k, cost(2)).await.unwrap().is_allowed(),
            "{quota}"
        );
        let again = b.decide(&p, &k, cost(3)).await.unwrap();
        assert!(!again.is_allowed(), "{quota}");
        assert_eq!(
            remaining(&again),
            [0],
            "{quota}: Redis's count, not the cached one"
        );
    }
}

/// Settlements and slots, as on every backend that settles.
#[tokio::test]
async fn settlements_redis() {
    let server = RedisServer::start();
    let clock = aligned_test_clock();
    let b = at_time(&server, &clock);
    settlements(&b, |by| clock.advance(by), "redis").await;
}

#[tokio::test]
async fn settlements_local() {
    let clock = FakeRelativeClock::default();
    let b = LocalBackend::builder()
        .clock(clock.clone())
        .clock_epoch(Duration::ZERO)
        .build();
    settlements(&b, |by| clock.advance(by), "local").await;
}

/// A slot is a lease: one whose request still runs after the lease time is given back (so a
/// killed instance cannot hold slots longer), and that request's release, when it comes, gives
/// back nothing more.
#[tokio::test]
async fn a_lease_that_expires_while_its_request_runs_frees_its_slot_once() {
    use tollgate::backend::Mode;
    let server = RedisServer::start();
    let clock = TestClock::new();
    let b = at_time(&server, &clock);
    leases(&b, |by| clock.advance(by), "redis").await;
    let policy = Policy::new("lease", Quota::concurrent(1).lease(Duration::from_secs(1)));
    let p = prepare(&b, &policy);
    let k = key("k");
    let ask = |mode| b.decide_with(&p, &k, cost(1), mode);
    // The key expires with its newest lease: nothing is left behind in Redis.
    assert!(ask(Mode::Hold { lease: 4 }).await.unwrap().is_allowed());
    let keys = server.cmd(&["KEYS", "*"]);
    let name = (keys.lines())
        .find(|k| k.contains(":2.c0"))
        .unwrap_or_else(|| panic!("no lease key in {keys:?}"));
    assert!(server.cmd(&["TYPE", name]).contains("zset"));
    let ttl = server.cmd(&["PTTL", name]);
    let ttl: i64 = ttl.trim().trim_start_matches(':').parse().unwrap();
    // At the test clock's time keys live a minute longer (see gcra.lua).
    assert!((60_001..=61_000).contains(&ttl), "{ttl}");
}

/// A refund makes a cached denial of its key stale: the next request asks Redis again.
#[tokio::test]
async fn a_refund_forgets_the_cached_denial() {
    use tollgate::backend::Mode;
    let server = RedisServer::start();
    let b = backend(&server);
    let p = prepare(&b, &Policy::new("refunded", no_refill(1)));
    let k = key("k");
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    let hits = b.stats().deny_cache_hits;
    assert!(!b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    assert_eq!(b.stats().deny_cache_hits, hits + 1, "the denial is cached");
    let refund = Mode::Refund {
        admitted_ago: Duration::ZERO,
    };
    b.decide_with(&p, &k, cost(1), refund).await.unwrap();
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
}

/// Penalties, as on every backend that blocks.
#[tokio::test]
async fn blocks_redis() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let b = at_time(&server, &clock);
    blocks(&b, |by| clock.advance(by), "redis").await;
}

#[tokio::test]
async fn blocks_local() {
    let clock = FakeRelativeClock::default();
    let b = LocalBackend::builder().clock(clock.clone()).build();
    blocks(&b, |by| clock.advance(by), "local").await;
}

/// Penalties on window quotas: one meaning on the local backend and Redis (and the
/// approximate mode, in `tests/redis_approx.rs`).
#[tokio::test]
async fn window_blocks_local_and_redis() {
    let clock = FakeRelativeClock::default();
    let b = LocalBackend::builder()
        .clock(clock.clone())
        .clock_epoch(Duration::ZERO)
        .build();
    window_blocks(&b, |by| clock.advance(by), "local").await;
    let server = RedisServer::start();
    let clock = aligned_test_clock();
    let b = at_time(&server, &clock);
    window_blocks(&b, |by| clock.advance(by), "redis").await;
}

/// A blocked key is answered by the deny cache until its block ends, without a call to Redis,
/// whatever the cost.
#[tokio::test]
async fn the_deny_cache_answers_a_blocked_key() {
    let server = RedisServer::start();
    let b = backend(&server);
    let policy = Policy::new("cached-block", no_refill(1)).block_for(Duration::from_secs(60));
    let p = prepare(&b, &policy);
    let k = key("k");
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    let d = b.decide(&p, &k, cost(1)).await.unwrap();
    assert!(d.is_blocked(), "{d:?}");
    let calls = b.stats().calls;
    for c in [1, 1, 1] {
        let d = b.decide(&p, &k, cost(c)).await.unwrap();
        assert!(d.is_blocked(), "{d:?}");
        let left = d.retry_after().unwrap();
        assert!(
            left > Duration::from_secs(59) && left <= Duration::from_secs(60),
            "{left:?}"
        );
    }
    assert_eq!(b.stats().calls, calls, "no call to Redis");
}

/// A request whose future is dropped while its decision is at the store (the client went away
/// while Redis was slow): the decision still lands, and what it took is undone once it does,
/// its slot given back, its units refunded when the policy refunds cancelled requests.
#[tokio::test]
async fn a_request_dropped_while_its_decision_is_at_the_store_takes_nothing() {
    use axum::body::Body;
    use tollgate::settle::{Cancelled, ChargeWhen};
    use tower::{Layer, ServiceExt};
    let server = RedisServer::start();
    let hour = Duration::from_secs(3600);
    for policy in [
        Policy::new("slot", Quota::concurrent(1).lease(Duration::from_secs(60))),
        Policy::new("refunded", Quota::new(1, hour))
            .charge_when(ChargeWhen::status([200]))
            .on_cancel(Cancelled::Refund),
    ] {
        let name = policy.name().to_owned();
        let layer = RateLimitLayer::builder()
            .policy(policy)
            .key(Global)
            .backend(uncached(&server).build().unwrap())
            .build()
            .unwrap();
        let svc = layer.layer(tower::service_fn(|_req: http::Request<Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
        }));
        let call = || svc.clone().oneshot(http::Request::new(Body::empty()));
        // Redis frozen: the decision is sent, and the request goes away before it lands.
        server.pause();
        let dropped = tokio::time::timeout(Duration::from_millis(100), call()).await;
        assert!(dropped.is_err(), "{name}: answered while Redis was frozen");
        server.resume();
        let start = Instant::now();
        loop {
            let status = call().await.unwrap().status();
            if status == 200 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "{name}: still {status} 5 s after Redis answered again"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The same for a `Limiter::admit` future dropped while the store decides: the slot it took is
/// given back when the decision lands.
#[tokio::test]
async fn a_dropped_admit_gives_its_slot_back_once_the_decision_lands() {
    use tollgate::limiter::Limiter;
    let server = RedisServer::start();
    let policy = Policy::new("admit", Quota::concurrent(1).lease(Duration::from_secs(60)));
    let limiter = Limiter::new(policy, uncached(&server).build().unwrap()).unwrap();
    let k = key("k");
    server.pause();
    let dropped = tokio::time::timeout(Duration::from_millis(100), limiter.admit(&k, cost(1)));
    assert!(dropped.await.is_err());
    server.resume();
    let start = Instant::now();
    let permit = loop {
        match limiter.admit(&k, cost(1)).await {
            Ok(permit) => break permit,
            Err(err) => assert!(
                start.elapsed() < Duration::from_secs(5),
                "the slot is still held 5 s after Redis answered again: {err}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Exactly once: the slot is held by this permit alone.
    assert!(limiter.admit(&k, cost(1)).await.is_err());
    drop(permit);
}

/// Units and slots given back by another instance are seen at once, whatever this one's deny
/// cache holds.
#[tokio::test]
async fn the_deny_cache_sees_what_other_instances_give_back() {
    let server = RedisServer::start();
    others_give_back(&backend(&server), &backend(&server), "redis").await;
}

/// Issue 35: a flood of fresh keys on every algorithm: new clients served, spent keys refused,
/// and what each fresh key costs Redis (`MEMORY USAGE`, printed: docs/redis.md has the table).
#[tokio::test]
async fn a_flood_of_fresh_keys_limits_every_key() {
    let server = RedisServer::start();
    let b = backend(&server);
    for quota in support::conformance::FLOOD_QUOTAS {
        let n = 2_000;
        let name = support::conformance::flood(&b, quota, n, "redis").await;
        let sum = format!(
            "local t, n = 0, 0 for _, k in ipairs(redis.call('KEYS', '*{name}:*fresh*')) do \
             t = t + redis.call('MEMORY', 'USAGE', k) n = n + 1 end return math.floor(t / n)"
        );
        let reply = server.cmd(&["EVAL", &sum, "0"]);
        eprintln!(
            "redis, \"{quota}\": {} bytes per key",
            reply.trim().trim_start_matches(':')
        );
    }
}

/// Live quota changes: the conformance suite's cases, with and without the deny cache.
#[tokio::test]
async fn quota_changes_redis() {
    let server = RedisServer::start();
    let clock = support::conformance::aligned_test_clock();
    let b = at_time(&server, &clock);
    support::conformance::changes(&b, |by| clock.advance(by), "redis").await;
    server.cmd(&["FLUSHALL"]);
    let clock = support::conformance::aligned_test_clock();
    let cached = RedisBackend::builder()
        .url(server.url())
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::changes(&cached, |by| clock.advance(by), "redis-cached").await;
}

/// A fleet's rolling change of a quota: two instances, one limit each, one store (issue 45).
#[tokio::test]
async fn a_rolling_change_keeps_the_higher_limit_redis() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    support::conformance::rolling_change(
        &at_time(&server, &clock),
        &at_time(&server, &clock),
        "redis",
    )
    .await;
}

/// Calendar quotas at their boundaries on Redis (the instance computes the windows around
/// its time, Redis's time picks one): the conformance suite's cases, with and without the
/// deny cache.
#[cfg(feature = "calendar")]
#[tokio::test]
async fn calendar_quotas_redis() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let start = clock.now_ns() / 1_000_000_000;
    let b = at_time(&server, &clock);
    support::conformance::calendar(&b, start, |by| clock.advance(by), "redis").await;
    server.cmd(&["FLUSHALL"]);
    let clock = TestClock::new();
    let cached = RedisBackend::builder()
        .url(server.url())
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::calendar(&cached, start, |by| clock.advance(by), "redis-cached").await;
}
