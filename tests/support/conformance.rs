//! The conformance suite shared by every backend: scripted sequences of requests with the
//! exact states every backend must answer (the local backend on a fake clock, the remote ones on
//! a test clock), and random sequences compared decision by decision with the local backend.

use std::time::Duration;

use governor::clock::FakeRelativeClock;
use tollgate::backend::remote::TestClock;
use tollgate::backend::{Backend, LocalBackend, Outcome};
use tollgate::{Policy, Quota};

use super::{cost, key, prepare};

/// One step: advance the clock to `at_ms`, ask for `cost`, expect this.
pub struct Step {
    pub at_ms: u64,
    pub cost: u32,
    pub expect: Expect,
    pub remaining: u32,
    pub reset_after: Duration,
}

pub enum Expect {
    Allowed,
    Denied {
        retry_after_ms: u64,
    },
    /// A wait that is not a whole number of milliseconds.
    DeniedUs {
        retry_after_us: u64,
    },
    NeverFits,
}

pub fn step(at_ms: u64, cost: u32, expect: Expect, remaining: u32, reset_after_ms: u64) -> Step {
    step_us(at_ms, cost, expect, remaining, reset_after_ms * 1000)
}

/// A step whose `reset_after` is given in microseconds.
pub fn step_us(at_ms: u64, cost: u32, expect: Expect, remaining: u32, reset_after_us: u64) -> Step {
    Step {
        at_ms,
        cost,
        expect,
        remaining,
        reset_after: Duration::from_micros(reset_after_us),
    }
}

/// The redis-cell `CL.THROTTLE` test vectors: `max_burst` 4 (so 5 requests fit) at 1 per
/// second. `reset_after` is the time until more quota is available (the next unit back; 0 when
/// the bucket is full), the header's `t`, on every outcome; redis-cell reports the time until
/// the bucket is full instead. A request that can never fit reports the bucket as it is.
pub fn redis_cell_vectors() -> (Policy, Vec<Step>) {
    use Expect::*;
    let steps = vec![
        step(0, 6, NeverFits, 5, 0),
        step(0, 1, Allowed, 4, 1000),
        step(0, 1, Allowed, 3, 1000),
        step(0, 1, Allowed, 2, 1000),
        step(0, 1, Allowed, 1, 1000),
        step(0, 1, Allowed, 0, 1000),
        step(
            0,
            1,
            Denied {
                retry_after_ms: 1000,
            },
            0,
            1000,
        ),
        step(3000, 1, Allowed, 2, 1000),
        step(3100, 1, Allowed, 1, 900),
        step(4000, 1, Allowed, 1, 1000),
        step(8000, 1, Allowed, 4, 1000),
        step(9500, 1, Allowed, 4, 1000),
        step(9500, 2, Allowed, 2, 1000),
        step(
            9500,
            5,
            Denied {
                retry_after_ms: 3000,
            },
            2,
            1000,
        ),
    ];
    (Policy::new("cell", Quota::per_second(1).burst(5)), steps)
}

/// Costs, partial refills and sub-second emission intervals: 10 per second, burst 3.
pub fn refill_vectors() -> (Policy, Vec<Step>) {
    use Expect::*;
    let steps = vec![
        step(0, 2, Allowed, 1, 100),
        step(
            0,
            2,
            Denied {
                retry_after_ms: 100,
            },
            1,
            100,
        ),
        step(50, 2, Denied { retry_after_ms: 50 }, 1, 50),
        step(100, 2, Allowed, 0, 100),
        step(150, 1, Denied { retry_after_ms: 50 }, 0, 50),
        step(400, 3, Allowed, 0, 100),
        step(1000, 1, Allowed, 2, 100),
        step(1000, 4, NeverFits, 2, 100),
    ];
    (Policy::new("refill", Quota::per_second(10).burst(3)), steps)
}

// Window vectors, computed by hand from the definitions in `src/backend/window.rs`. Step times
// count from an instant that starts every window (the Unix epoch, or a whole number of days
// after it): windows are aligned to the epoch.

/// A fixed window of 3 per second: never-fits on an empty window, cost 2, the last unit just
/// before the boundary, a full window just after it, larger costs, and an empty window again.
pub fn fixed_window_vectors() -> (Policy, Vec<Step>) {
    use Expect::*;
    let steps = vec![
        // Nothing counted: all 3 remain, and no more will come (`t` = 0).
        step(0, 4, NeverFits, 3, 0),
        step(100, 2, Allowed, 1, 900),
        // The window ends at 1000 ms.
        step(
            100,
            2,
            Denied {
                retry_after_ms: 900,
            },
            1,
            900,
        ),
        step(
            500,
            2,
            Denied {
                retry_after_ms: 500,
            },
            1,
            500,
        ),
        // The last unit, a millisecond before the boundary.
        step(999, 1, Allowed, 0, 1),
        step(999, 1, Denied { retry_after_ms: 1 }, 0, 1),
        // A new window: all 3 at once.
        step(1000, 3, Allowed, 0, 1000),
        step(
            1000,
            1,
            Denied {
                retry_after_ms: 1000,
            },
            0,
            1000,
        ),
        // A larger cost waits for the same boundary.
        step(
            1200,
            2,
            Denied {
                retry_after_ms: 800,
            },
            0,
            800,
        ),
        // More than the limit never fits, and reports the window as it is.
        step(1500, 4, NeverFits, 0, 500),
        // Two windows later nothing is counted.
        step(2500, 4, NeverFits, 3, 0),
        step(2500, 1, Allowed, 2, 500),
    ];
    (
        Policy::new("fixed", Quota::per_second(3).fixed_window()),
        steps,
    )
}

/// A sliding window of 10 per second kept as one sub-window (two counts): the previous
/// second's count weighs `10 * (1 - f)`, `f` the fraction of the current second gone.
pub fn sliding_one_vectors() -> (Policy, Vec<Step>) {
    use Expect::*;
    let steps = vec![
        step(5000, 11, NeverFits, 10, 0),
        // E = 10: one more fits once 1 of them has slid out, 0.1 s into the next second.
        step(5000, 10, Allowed, 0, 1100),
        step(
            5000,
            1,
            Denied {
                retry_after_ms: 1100,
            },
            0,
            1100,
        ),
        // 25 % into the next second, 7.5 still count: 2 more pass; one more fits once 0.5 has
        // slid out, 50 ms later.
        step(6250, 1, Allowed, 1, 50),
        step(6250, 1, Allowed, 0, 50),
        step(6250, 1, Denied { retry_after_ms: 50 }, 0, 50),
        // 9 fit when this second's 2 weigh 1: half way through the next one.
        step(
            6250,
            9,
            Denied {
                retry_after_ms: 1250,
            },
            0,
            50,
        ),
        // 7.2 + 2 counted.
        step(6280, 1, Denied { retry_after_ms: 20 }, 0, 20),
        // 7 + 2: one fits, leaving E = 10 exactly.
        step(6300, 1, Allowed, 0, 100),
        // Half way through the next second, 3 * 0.5 = 1.5 count: 8 remain; 10 fit at the
        // boundary, 9 once 1 of the 1.5 has slid out (two thirds into the second, rounded up
        // to the microsecond: 166.667 ms from now).
        step_us(
            7500,
            10,
            Denied {
                retry_after_ms: 500,
            },
            8,
            166_667,
        ),
        step_us(
            7500,
            9,
            DeniedUs {
                retry_after_us: 166_667,
            },
            8,
            166_667,
        ),
        // A new second with nothing in the previous one: the whole limit.
        step(8000, 10, Allowed, 0, 1100),
    ];
    (
        Policy::new("sliding1", Quota::per_second(10).sliding_window()),
        steps,
    )
}

/// 100 per minute kept as twelve 5-second sub-windows (thirteen counts).
pub fn sliding_many_vectors() -> (Policy, Vec<Step>) {
    use Expect::*;
    let q = Quota::per_minute(100)
        .sliding_window()
        .resolution(Duration::from_secs(5));
    let steps = vec![
        step(0, 101, NeverFits, 100, 0),
        // The 40 of sub-window 0 count in full until 60 s, then slide out over 5 s: 61 fit
        // once 1 of them has, at 60.125 s.
        step(0, 40, Allowed, 60, 60_125),
        step(12_000, 30, Allowed, 30, 48_125),
        step(
            12_000,
            31,
            Denied {
                retry_after_ms: 48_125,
            },
            30,
            48_125,
        ),
        step(
            30_000,
            31,
            Denied {
                retry_after_ms: 30_125,
            },
            30,
            30_125,
        ),
        // At 60 s sub-window 0 is the oldest, in full.
        step(60_000, 1, Allowed, 29, 125),
        // Half of it has slid out: 20 + 31 counted.
        step(62_500, 29, Allowed, 20, 125),
        // A millisecond before the boundary, 40 * 0.0002 + 60 = 60.008 count: 39 remain, 40
        // fit at the boundary, when sub-window 0 is gone.
        step(64_999, 40, Denied { retry_after_ms: 1 }, 39, 1),
        // Just after the boundary: 0 (sub-window 1) + 30 + 30 + 40 = 100; one more fits once
        // 1 of sub-window 2's 30 has slid out, 1/6 of 5 s (rounded up to the microsecond).
        step_us(65_000, 40, Allowed, 0, 5_166_667),
    ];
    (Policy::new("sliding12", q), steps)
}

pub async fn run_vectors<B, F>(backend: &B, set_time_ms: F, vectors: (Policy, Vec<Step>), who: &str)
where
    B: Backend,
    F: Fn(u64),
{
    let (policy, steps) = vectors;
    let prepared = prepare(backend, &policy);
    let k = key(&format!("conformance-{}", policy.name()));
    for (i, s) in steps.iter().enumerate() {
        set_time_ms(s.at_ms);
        let d = backend.decide(&prepared, &k, cost(s.cost)).await.unwrap();
        let q = d.quotas()[0];
        let ctx = format!("{who} {} step {i}: {d:?}", policy.name());
        match s.expect {
            Expect::Allowed => assert_eq!(q.outcome, Outcome::Allowed, "{ctx}"),
            Expect::Denied { retry_after_ms } => assert_eq!(
                q.outcome,
                Outcome::Denied {
                    retry_after: Duration::from_millis(retry_after_ms)
                },
                "{ctx}"
            ),
            Expect::DeniedUs { retry_after_us } => assert_eq!(
                q.outcome,
                Outcome::Denied {
                    retry_after: Duration::from_micros(retry_after_us)
                },
                "{ctx}"
            ),
            Expect::NeverFits => {
                assert_eq!(q.outcome, Outcome::NeverFits, "{ctx}");
                assert_eq!(d.retry_after(), None, "{ctx}");
            }
        }
        assert_eq!(q.limit, policy.quotas()[0].burst_size(), "{ctx}");
        assert_eq!(q.remaining, s.remaining, "{ctx}");
        // `t` never points past `Retry-After`.
        if let Some(wait) = d.retry_after() {
            assert!(q.reset_after <= wait, "{ctx}");
        }
        assert_eq!(q.reset_after, s.reset_after, "{ctx}");
    }
}

pub fn window_vectors() -> [(Policy, Vec<Step>); 3] {
    [
        fixed_window_vectors(),
        sliding_one_vectors(),
        sliding_many_vectors(),
    ]
}

/// A test clock for the script at a whole number of days after the Unix epoch, so that step
/// times count from the start of every window (as the local backend's clock from the epoch).
pub fn aligned_test_clock() -> TestClock {
    let clock = TestClock::new();
    let day = 86_400_000_000_000u64;
    let start = 1_000_000_000_000_000u64; // TestClock::new()
    clock.advance(Duration::from_nanos(start.div_ceil(day) * day - start));
    clock
}

/// Every vector set (GCRA and windows) on a remote backend made by `make` at a test clock
/// aligned on a day: the same states as the local backend, step by step.
pub async fn remote_vectors<B: Backend>(make: impl Fn(TestClock) -> B, who: &str) {
    let all = [redis_cell_vectors(), refill_vectors()]
        .into_iter()
        .chain(window_vectors());
    for vectors in all {
        let clock = aligned_test_clock();
        let backend = make(clock.clone());
        let start = std::cell::Cell::new(0u64);
        let set = |ms: u64| {
            clock.advance(Duration::from_millis(ms - start.get()));
            start.set(ms);
        };
        run_vectors(&backend, set, vectors, who).await;
    }
}

/// Random sequences (times, costs) on the local backend and on one made by `make` give the
/// same states, decision by decision: the store computes the same numbers to the microsecond.
pub async fn agree_with_local<B: Backend>(make: impl Fn(TestClock) -> B) {
    // Windows that divide a day: both clocks start at a whole number of days.
    let quotas = [
        Quota::per_second(3).fixed_window(),
        Quota::per_minute(40).fixed_window(),
        Quota::per_second(10).sliding_window(),
        Quota::per_minute(7)
            .sliding_window()
            .resolution(Duration::from_secs(20)),
        Quota::per_minute(100)
            .sliding_window()
            .resolution(Duration::from_secs(5)),
        Quota::per_second(7).burst(5),
    ];
    let mut seed = 7u64;
    let mut next = move |n: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    for (i, quota) in quotas.into_iter().enumerate() {
        let policy = Policy::new(format!("random{i}"), quota);
        let local_clock = FakeRelativeClock::default();
        let local = LocalBackend::builder()
            .clock(local_clock.clone())
            .clock_epoch(Duration::ZERO)
            .build();
        let remote_clock = aligned_test_clock();
        let remote = make(remote_clock.clone());
        let (lp, rp) = (prepare(&local, &policy), prepare(&remote, &policy));
        let window = u64::try_from(quota.period().as_micros()).unwrap();
        let k = key("random");
        for n in 0..400 {
            let by = match next(10) {
                0 => 0,
                1..=6 => next(window / 7 + 1),
                7 | 8 => next(1000),
                _ => next(2 * window + 1),
            };
            local_clock.advance(Duration::from_micros(by));
            remote_clock.advance(Duration::from_micros(by));
            let c = cost(1 + next(u64::from(quota.count()) / 3 + 2) as u32);
            let l = local.decide(&lp, &k, c).await.unwrap();
            let r = remote.decide(&rp, &k, c).await.unwrap();
            assert_eq!(l, r, "{policy:?} step {n}, cost {c}");
        }
    }
}

/// Reservations, peeks and resets, the same on every backend: a GCRA quota of 10 per second
/// with a burst of 2 (a unit every 100 ms), at times set by `advance` (from a fresh clock).
pub async fn modes<B: Backend>(backend: &B, advance: impl Fn(Duration), who: &str) {
    use tollgate::backend::{Decision, Mode};
    let ms = Duration::from_millis;
    let k = key("modes");
    // A request of `c` units on `p` in `mode`, and a reservation waiting at most `max` ms.
    let ask = |p: &B::Policy, c: u32, mode: Mode| backend.decide_with(p, &k, cost(c), mode);
    let reserve = |p: &B::Policy, max: u64| {
        backend.decide_with(p, &k, cost(1), Mode::Reserve { max_wait: ms(max) })
    };
    // Allowed, going on after `wait` ms.
    let goes = |d: &Decision, wait: u64| {
        assert_eq!((d.is_allowed(), d.wait()), (true, ms(wait)), "{who}: {d:?}");
    };
    let policy = Policy::new("modes", Quota::per_second(10).burst(2));
    let p = prepare(backend, &policy);
    // A peek on a fresh bucket: allowed, nothing taken (twice the same answer).
    for _ in 0..2 {
        let d = ask(&p, 1, Mode::Peek).await.unwrap();
        goes(&d, 0);
        assert_eq!(
            d.quotas()[0].remaining,
            1,
            "{who}: a peek reports what a decision would leave"
        );
    }
    // Reservations within 350 ms: the burst now, then one every 100 ms, first come first
    // served, each counted when it goes on.
    for want in [0, 0, 100, 200, 300] {
        goes(&reserve(&p, 350).await.unwrap(), want);
    }
    // The next would wait 400 ms: refused, with the wait, and nothing taken.
    let d = reserve(&p, 350).await.unwrap();
    assert!(!d.is_allowed(), "{who}: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(400)), "{who}: {d:?}");
    let peeked = ask(&p, 1, Mode::Peek).await.unwrap();
    assert_eq!(peeked.retry_after(), Some(ms(400)), "{who}: {peeked:?}");
    // A plain decision is a reservation that waits for nothing.
    let d = backend.decide(&p, &k, cost(1)).await.unwrap();
    assert_eq!(d.retry_after(), Some(ms(400)), "{who}: {d:?}");
    // 250 ms later the reservations made so far have gone on; one more waits 150 ms.
    advance(ms(250));
    goes(&reserve(&p, 150).await.unwrap(), 150);
    // A cost larger than the burst never fits, whatever the wait.
    let max = Mode::Reserve {
        max_wait: ms(10_000),
    };
    let d = ask(&p, 3, max).await.unwrap();
    assert!(d.never_fits(), "{who}: {d:?}");
    // A reset forgets the key: full again.
    backend.reset(&p, &k).await.unwrap();
    let zero = Mode::Reserve {
        max_wait: Duration::ZERO,
    };
    goes(&ask(&p, 2, zero).await.unwrap(), 0);

    // Two GCRA quotas: the reservation waits for the slower, and is counted then on both.
    let two =
        Policy::new("modes2", Quota::per_second(10).burst(1)).and(Quota::per_second(2).burst(1));
    let p2 = prepare(backend, &two);
    goes(&reserve(&p2, 1000).await.unwrap(), 0);
    goes(&reserve(&p2, 1000).await.unwrap(), 500);
    // The fast quota was charged as of 500 ms from now: its next unit is at 600 ms.
    let d = ask(&p2, 1, Mode::Peek).await.unwrap();
    assert_eq!(
        d.quotas()[0].outcome,
        Outcome::Denied {
            retry_after: ms(600)
        },
        "{who}: {d:?}"
    );

    // With a window quota in the policy, a reservation waits for nothing: counting a request
    // that goes on later into the current window would let the next admit its whole limit.
    let mixed = Policy::new("modes4", Quota::per_second(10).burst(1))
        .and(Quota::per_minute(100).fixed_window());
    let p4 = prepare(backend, &mixed);
    goes(&reserve(&p4, 1000).await.unwrap(), 0);
    let d = reserve(&p4, 1000).await.unwrap();
    assert!(!d.is_allowed(), "{who}: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(100)), "{who}: {d:?}");

    // A peek on a window quota answers what a decision would, as on GCRA: the state after
    // counting the request (the check right after it must agree to the bit).
    for (name, quota) in [
        ("peek-fixed", Quota::per_hour(3).fixed_window()),
        ("peek-sliding", Quota::per_hour(3).sliding_window()),
    ] {
        let pw = prepare(backend, &Policy::new(name, quota));
        let two = ask(&pw, 2, Mode::Peek).await.unwrap();
        assert_eq!(two.quotas()[0].remaining, 1, "{who} {name}: {two:?}");
        let peeked = ask(&pw, 1, Mode::Peek).await.unwrap();
        let checked = backend.decide(&pw, &k, cost(1)).await.unwrap();
        assert_eq!(
            peeked, checked,
            "{who} {name}: a peek is the decision, untaken"
        );
        assert_eq!(
            checked.quotas()[0].remaining,
            2,
            "{who} {name}: {checked:?}"
        );
        let peeked = ask(&pw, 3, Mode::Peek).await.unwrap();
        assert!(!peeked.is_allowed(), "{who} {name}: {peeked:?}");
        assert_eq!(
            peeked,
            backend.decide(&pw, &k, cost(3)).await.unwrap(),
            "{who} {name}: a refusal peeked is the refusal"
        );
    }

    // A request that can never fit (a cost above a quota's limit) reports that quota alone,
    // whatever the others say: `"nf-2";r=2` on a 413, on every store.
    let nf = Policy::new("nf", Quota::per_second(10).burst(4))
        .and(Quota::per_hour(5).fixed_window())
        .and(Quota::per_minute(3).sliding_window());
    let pn = prepare(backend, &nf);
    assert!(backend.decide(&pn, &k, cost(1)).await.unwrap().is_allowed());
    let d = backend.decide(&pn, &k, cost(4)).await.unwrap();
    assert!(d.never_fits(), "{who}: {d:?}");
    let [q] = d.quotas() else {
        panic!("{who}: a never-fitting request reports the quota it cannot fit alone: {d:?}");
    };
    assert_eq!(
        (q.index, q.outcome, q.limit, q.remaining),
        (2, Outcome::NeverFits, 3, 2),
        "{who}: {d:?}"
    );
    let peeked = ask(&pn, 4, Mode::Peek).await.unwrap();
    assert_eq!(peeked, d, "{who}: peeked");

    // A fixed window reserves nothing it does not have now.
    let fixed = Policy::new("modes3", Quota::per_minute(2).fixed_window());
    let p3 = prepare(backend, &fixed);
    for _ in 0..2 {
        goes(&reserve(&p3, 120_000).await.unwrap(), 0);
    }
    let d = reserve(&p3, 120_000).await.unwrap();
    assert!(!d.is_allowed(), "{who}: {d:?}");
}

/// Wait mode on `backend`, over TCP: 8 concurrent requests on a burst of 3 at 4 per second,
/// at most 3 waiters for at most 2 s. 3 pass at once, 3 wait for the next units (250, 500 and
/// 750 ms) and 2 are refused, on every store however long it takes to answer: requests that
/// pass at once never hold a waiter's slot. (The 8 decisions must all be made within a unit's
/// 250 ms, else one more unit has come back meanwhile: at 10 per second a loaded CI machine's
/// PostgreSQL spread them over 110 ms once, and 7 passed.)
pub async fn waiters<B: Backend + Clone>(backend: B, who: &str) {
    use axum::{Router, routing::get};
    let layer = tollgate::RateLimitLayer::builder()
        .policy(Policy::new(
            format!("waiters-{who}"),
            Quota::per_second(4).burst(3),
        ))
        .key(tollgate::key::Global)
        .backend(backend)
        .wait(Duration::from_secs(2), 3)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer);
    let addr = super::serve(app).await;
    let client = reqwest::Client::new();
    // Connections first, so that the requests go out together.
    for _ in 0..8 {
        let _ = client.get(format!("http://{addr}/nothing")).send().await;
    }
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (client, url) = (client.clone(), format!("http://{addr}/"));
        tasks.push(tokio::spawn(async move {
            let status = client.get(url).send().await.unwrap().status().as_u16();
            (status, started.elapsed())
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    answers.sort_by_key(|(_, at)| *at);
    let count = |s: u16| answers.iter().filter(|(status, _)| *status == s).count();
    assert_eq!((count(200), count(429)), (6, 2), "{who}: {answers:?}");
    // The waiters went on after their units' time: sleeps never end early.
    let mut passed: Vec<_> = (answers.iter())
        .filter(|(s, _)| *s == 200)
        .map(|(_, at)| *at)
        .collect();
    passed.sort();
    assert!(
        passed[5] >= Duration::from_millis(740) && passed[4] >= Duration::from_millis(490),
        "{who}: {answers:?}"
    );
}

/// Settlements (refunds, debits) and slots of concurrent quotas, the same on every backend that
/// settles, at times set by `advance` (from a clock at a whole number of days after the Unix
/// epoch, so that windows start at step 0): a refund never fills a bucket past full and goes
/// only to the window that counted the units; a debit leaves the key in debt until it is
/// repaid; a slot is held until its release, a release given twice gives back one slot, and a
/// refusal for slots takes nothing from the policy's other quotas.
pub async fn settlements<B: Backend>(backend: &B, advance: impl Fn(Duration), who: &str) {
    use tollgate::backend::{Decision, Mode};
    let ms = Duration::from_millis;
    let k = key("settle");
    let refund = |ago: u64| Mode::Refund {
        admitted_ago: ms(ago),
    };
    // (allowed, remaining, retry_after) of the first quota, and of the second when there is one.
    let seen = |d: &Decision| {
        d.quotas()
            .iter()
            .map(|q| (q.outcome == Outcome::Allowed, q.remaining))
            .collect::<Vec<_>>()
    };

    // GCRA, a unit every 100 ms, burst 2.
    let gcra = prepare(
        backend,
        &Policy::new("settle-gcra", Quota::per_second(10).burst(2)),
    );
    let ask = |p, c: u32, mode: Mode| backend.decide_with(p, &k, cost(c), mode);
    ask(&gcra, 2, Mode::Decide).await.unwrap();
    let d = ask(&gcra, 1, refund(0)).await.unwrap();
    assert_eq!(seen(&d), [(true, 1)], "{who}: refund of one: {d:?}");
    let d = ask(&gcra, 5, refund(0)).await.unwrap();
    assert_eq!(seen(&d), [(true, 2)], "{who}: never past full: {d:?}");
    let d = ask(&gcra, 5, Mode::Debit).await.unwrap();
    assert_eq!(seen(&d), [(true, 0)], "{who}: debit into debt: {d:?}");
    // 500 ms of debt: a unit of the burst of 2 fits again after 400 ms.
    let d = ask(&gcra, 1, Mode::Decide).await.unwrap();
    assert_eq!(d.retry_after(), Some(ms(400)), "{who}: in debt: {d:?}");
    advance(ms(400));
    assert!(
        ask(&gcra, 1, Mode::Decide).await.unwrap().is_allowed(),
        "{who}: repaid"
    );

    // A fixed window of 3 a second (the clock is 400 ms into one).
    let fixed = prepare(
        backend,
        &Policy::new("settle-fixed", Quota::per_second(3).fixed_window()),
    );
    ask(&fixed, 3, Mode::Decide).await.unwrap();
    let d = ask(&fixed, 1, refund(100)).await.unwrap();
    assert_eq!(seen(&d), [(true, 1)], "{who}: refund in its window: {d:?}");
    advance(ms(600));
    // The next window: units taken in the last one are not given back to this one.
    ask(&fixed, 2, Mode::Decide).await.unwrap();
    let d = ask(&fixed, 1, refund(700)).await.unwrap();
    assert_eq!(
        seen(&d),
        [(true, 1)],
        "{who}: refund of a past window: {d:?}"
    );
    let d = ask(&fixed, 4, Mode::Debit).await.unwrap();
    assert_eq!(seen(&d), [(true, 0)], "{who}: {d:?}");
    let d = ask(&fixed, 1, Mode::Decide).await.unwrap();
    assert_eq!(
        d.retry_after(),
        Some(ms(1000)),
        "{who}: in debt to the window's end: {d:?}"
    );

    // A sliding window of 4 a second in two sub-windows of 500 ms (the clock is on a second).
    let sliding = prepare(
        backend,
        &Policy::new(
            "settle-sliding",
            Quota::per_second(4).sliding_window().resolution(ms(500)),
        ),
    );
    ask(&sliding, 2, Mode::Decide).await.unwrap();
    advance(ms(500));
    ask(&sliding, 2, Mode::Decide).await.unwrap();
    // A refund of the first sub-window's units, still in the window.
    let d = ask(&sliding, 1, refund(500)).await.unwrap();
    assert_eq!(seen(&d), [(true, 1)], "{who}: {d:?}");
    advance(ms(500));
    // The first sub-window has left the window: a refund of its units gives back nothing.
    let d = ask(&sliding, 1, refund(1000)).await.unwrap();
    assert_eq!(seen(&d), [(true, 2)], "{who}: {d:?}");
    let d = ask(&sliding, 1, refund(500)).await.unwrap();
    assert_eq!(seen(&d), [(true, 3)], "{who}: {d:?}");

    // Two slots, with 5 requests an hour beside them.
    let policy = Policy::new("settle-slots", Quota::concurrent(2)).and(Quota::per_hour(5));
    let slots = prepare(backend, &policy);
    let hold = |lease| Mode::Hold { lease };
    let release = |lease| Mode::Release { lease };
    let d = ask(&slots, 1, hold(1)).await.unwrap();
    assert_eq!(seen(&d), [(true, 1), (true, 4)], "{who}: {d:?}");
    let d = ask(&slots, 3, hold(2)).await.unwrap();
    assert_eq!(
        seen(&d),
        [(true, 0), (true, 1)],
        "{who}: a slot whatever the cost: {d:?}"
    );
    let d = ask(&slots, 1, hold(3)).await.unwrap();
    assert!(!d.is_allowed(), "{who}: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(1000)), "{who}: {d:?}");
    // A plain decision checks the slots and takes none.
    let d = ask(&slots, 1, Mode::Decide).await.unwrap();
    assert!(!d.is_allowed(), "{who}: {d:?}");
    let d = ask(&slots, 1, release(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 1, "{who}: {d:?}");
    // The refusals took nothing from the hourly quota: one unit is left for this one.
    let d = ask(&slots, 1, hold(4)).await.unwrap();
    assert_eq!(seen(&d), [(true, 0), (true, 0)], "{who}: {d:?}");
    for lease in [2, 4] {
        ask(&slots, 1, release(lease)).await.unwrap();
    }
    // A peek (as a plain decision) reports the slots free now, taking none.
    let d = ask(&slots, 1, Mode::Peek).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 2, "{who}: every slot back: {d:?}");
    // Refunds and debits leave the slots alone; releases leave the hourly quota alone.
    let d = ask(&slots, 2, refund(0)).await.unwrap();
    assert_eq!(seen(&d), [(true, 2), (true, 2)], "{who}: {d:?}");

    // A reset forgets the hourly quota's units but not the slots of requests still in flight:
    // they still run, and the cap holds through it.
    let policy = Policy::new("reset-slots", Quota::concurrent(1)).and(Quota::per_hour(2));
    let slots = prepare(backend, &policy);
    assert!(
        ask(&slots, 1, hold(11)).await.unwrap().is_allowed(),
        "{who}"
    );
    backend.reset(&slots, &k).await.unwrap();
    let d = ask(&slots, 1, hold(12)).await.unwrap();
    assert!(
        !d.is_allowed(),
        "{who}: the slot in flight outlives the reset: {d:?}"
    );
    ask(&slots, 1, release(11)).await.unwrap();
    let d = ask(&slots, 1, hold(12)).await.unwrap();
    assert_eq!(
        seen(&d),
        [(true, 0), (true, 1)],
        "{who}: the units were forgotten: {d:?}"
    );
    ask(&slots, 1, release(12)).await.unwrap();

    count_edges(backend, who).await;
}

/// A window's count has the same range on every store: it saturates at 2^32 - 1, so that a
/// debt past a limit near it is kept (as a full window), never wrapped round to a small count.
async fn count_edges<B: Backend>(backend: &B, who: &str) {
    use tollgate::backend::Mode;
    let k = key("edges");
    let day = Duration::from_secs(86_400);
    for (name, quota) in [
        ("edge-fixed", Quota::new(4_000_000_000, day).fixed_window()),
        (
            "edge-sliding",
            Quota::new(4_000_000_000, day).sliding_window(),
        ),
        ("edge-max", Quota::new(u32::MAX, day).fixed_window()),
    ] {
        let p = prepare(backend, &Policy::new(name, quota));
        let ask = |c: u32, mode: Mode| backend.decide_with(&p, &k, cost(c), mode);
        let limit = quota.count();
        assert!(
            ask(1, Mode::Decide).await.unwrap().is_allowed(),
            "{who} {name}"
        );
        let d = ask(2_199_999_999, Mode::Debit).await.unwrap();
        assert_eq!(
            d.quotas()[0].remaining,
            limit - 2_200_000_000,
            "{who} {name}: {d:?}"
        );
        let d = ask(2_200_000_000, Mode::Debit).await.unwrap();
        assert_eq!(d.quotas()[0].remaining, 0, "{who} {name}: in debt: {d:?}");
        let d = ask(1, Mode::Decide).await.unwrap();
        assert!(
            !d.is_allowed(),
            "{who} {name}: a debt past 2^32 is kept: {d:?}"
        );
        // The count saturated at 2^32 - 1: a refund of 1 takes it below that, not below 2^32.
        let refund = Mode::Refund {
            admitted_ago: Duration::ZERO,
        };
        ask(1, refund).await.unwrap();
        let d = ask(1, Mode::Decide).await.unwrap();
        assert_eq!(d.is_allowed(), limit == u32::MAX, "{who} {name}: {d:?}");
    }
}

/// The last half second of a one-second block on key `k` (policy `p`, which allows 2 of a
/// cost-1 key): `k` is refused for the 500 ms left in every one of `modes`, asking does not
/// extend it; `other` is not blocked, and a cost it can never fit (3) starts no block; once
/// the 500 ms pass, `k` is allowed with one unit left.
async fn last_half_of_a_block<B: Backend>(
    backend: &B,
    p: &B::Policy,
    (k, other): (&tollgate::Key, &tollgate::Key),
    modes: &[(u32, tollgate::backend::Mode)],
    advance: &impl Fn(Duration),
    who: &str,
) {
    use tollgate::backend::Mode;
    let ms = Duration::from_millis;
    let ask = |k, c: u32, mode: Mode| backend.decide_with(p, k, cost(c), mode);
    for &(c, mode) in modes {
        let d = ask(k, c, mode).await.unwrap();
        assert!(d.is_blocked(), "{who}: {mode:?}: {d:?}");
        assert_eq!(d.retry_after(), Some(ms(500)), "{who}: {mode:?}: {d:?}");
    }
    let d = ask(other, 3, Mode::Decide).await.unwrap();
    assert!(d.never_fits() && !d.is_blocked(), "{who}: {d:?}");
    assert!(
        ask(other, 1, Mode::Decide).await.unwrap().is_allowed(),
        "{who}"
    );
    advance(ms(500));
    let d = ask(k, 1, Mode::Decide).await.unwrap();
    assert!(d.is_allowed(), "{who}: {d:?}");
    assert_eq!(d.quotas()[0].remaining, 1, "{who}: {d:?}");
}

/// Penalties (`Policy::block_for`), the same on every backend that blocks, at times set by
/// `advance`: a refusal blocks the key for the block's length whatever its quotas hold, the
/// requests meanwhile do not extend it, a request that can never fit starts none, and other
/// keys are not touched.
pub async fn blocks<B: Backend>(backend: &B, advance: impl Fn(Duration), who: &str) {
    use tollgate::backend::Mode;
    let ms = Duration::from_millis;
    // A unit every 100 ms, burst 2; blocked for a second once refused.
    let policy = Policy::new("blocks", Quota::per_second(10).burst(2)).block_for(ms(1000));
    let p = prepare(backend, &policy);
    let (k, other) = (key("blocked"), key("other"));
    let ask = |k, c: u32, mode: Mode| backend.decide_with(&p, k, cost(c), mode);
    for _ in 0..2 {
        assert!(
            ask(&k, 1, Mode::Decide).await.unwrap().is_allowed(),
            "{who}"
        );
    }
    let d = ask(&k, 1, Mode::Decide).await.unwrap();
    assert!(d.is_blocked(), "{who}: the refusal starts the block: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(1000)), "{who}: {d:?}");
    assert_eq!(
        (d.quotas()[0].remaining, d.quotas()[0].reset_after),
        (0, ms(1000)),
        "{who}: `t` is the block's end: {d:?}"
    );
    // Half a second later the bucket is full again, but the key is still blocked, for what is
    // left of the block, whatever the cost or the mode; asking does not extend it.
    advance(ms(500));
    let modes = [
        (1, Mode::Decide),
        (2, Mode::Decide),
        (1, Mode::Peek),
        (
            1,
            Mode::Reserve {
                max_wait: ms(10_000),
            },
        ),
    ];
    // Then the block is over, the bucket full.
    last_half_of_a_block(backend, &p, (&k, &other), &modes, &advance, who).await;
    // A reservation refused for its wait blocks too.
    ask(&k, 1, Mode::Decide).await.unwrap();
    let d = ask(&k, 1, Mode::Reserve { max_wait: ms(50) })
        .await
        .unwrap();
    assert!(d.is_blocked(), "{who}: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(1000)), "{who}: {d:?}");

    // A block on one quota (`Quota::block_for`): only that quota's refusal starts it. 10/s
    // burst 2 refuses and that is all; 3/s blocks for a second.
    let per_quota = Policy::new("quota-blocks", Quota::per_second(10).burst(2))
        .and(Quota::per_second(3).block_for(ms(1000)));
    per_quota_block(backend, &per_quota, advance, who).await;
}

/// Leases, on the shared stores (the local backend needs none): a slot whose request still
/// runs after the lease time is given back (so a killed instance cannot hold slots longer),
/// and that request's release, when it comes, gives back nothing more. One slot, a lease of a
/// second, at times set by `advance`.
pub async fn leases<B: Backend>(backend: &B, advance: impl Fn(Duration), who: &str) {
    use tollgate::backend::Mode;
    let policy = Policy::new("lease", Quota::concurrent(1).lease(Duration::from_secs(1)));
    let p = prepare(backend, &policy);
    let k = key("k");
    let ask = |mode| backend.decide_with(&p, &k, cost(1), mode);
    let hold = |lease| Mode::Hold { lease };
    assert!(ask(hold(1)).await.unwrap().is_allowed(), "{who}");
    assert!(!ask(hold(2)).await.unwrap().is_allowed(), "{who}");
    advance(Duration::from_millis(999));
    assert!(!ask(hold(2)).await.unwrap().is_allowed(), "{who}");
    advance(Duration::from_millis(1));
    // Lease 1 expired: its slot is free again, and lease 2 takes it.
    let d = ask(hold(2)).await.unwrap();
    assert!(d.is_allowed(), "{who}: {d:?}");
    // Lease 1's request ends: nothing to give back; lease 2 still holds the slot.
    let d = ask(Mode::Release { lease: 1 }).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 0, "{who}: {d:?}");
    assert!(!ask(hold(3)).await.unwrap().is_allowed(), "{who}");
    let d = ask(Mode::Release { lease: 2 }).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 1, "{who}: {d:?}");
    // Lease ids are 64 bits, all of them.
    assert!(ask(hold(u64::MAX)).await.unwrap().is_allowed(), "{who}");
    let d = ask(Mode::Release { lease: u64::MAX }).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 1, "{who}: {d:?}");
}

/// What another instance gives back is seen by this one's deny cache: two backends (`a`, `b`)
/// on one store, each with its deny cache. `a` is refused, then `b` gives a unit or a slot
/// back, and `a`'s next request is allowed at once (a cached refusal would keep refusing it
/// for the rest of the wait the store gave): for a `Limiter` whose permit settles for less, a
/// policy that settles after the response, and a concurrent quota's slot.
pub async fn others_give_back<B: Backend + Clone>(a: &B, b: &B, who: &str) {
    use tollgate::backend::Mode;
    use tollgate::limiter::Limiter;
    use tollgate::settle::ChargeWhen;
    let k = key("given-back");
    let quarter = Duration::from_secs(900);

    // Limiters: `b` admits twice and settles one for nothing.
    let policy = Policy::new("given-back-permits", Quota::new(2, quarter));
    let (la, lb) = (
        Limiter::new(policy.clone(), a.clone()).unwrap(),
        Limiter::new(policy, b.clone()).unwrap(),
    );
    let first = lb.admit(&k, cost(1)).await.unwrap();
    let _second = lb.admit(&k, cost(1)).await.unwrap();
    for _ in 0..2 {
        assert!(
            la.admit(&k, cost(1)).await.is_err(),
            "{who}: both units taken"
        );
    }
    first.settle(0).await.unwrap();
    let permit = la.admit(&k, cost(1)).await;
    assert!(
        permit.is_ok(),
        "{who}: the unit given back by the other instance: {permit:?}"
    );

    // A policy that settles after the response: `b` refunds an admission.
    let policy = Policy::new("given-back-settles", Quota::new(2, quarter))
        .charge_when(ChargeWhen::status([401]));
    let (pa, pb) = (prepare(a, &policy), prepare(b, &policy));
    for _ in 0..2 {
        assert!(
            b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed(),
            "{who}"
        );
    }
    for _ in 0..2 {
        assert!(
            !a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed(),
            "{who}"
        );
    }
    let refund = Mode::Refund {
        admitted_ago: Duration::ZERO,
    };
    b.decide_with(&pb, &k, cost(1), refund).await.unwrap();
    let d = a.decide(&pa, &k, cost(1)).await.unwrap();
    assert!(
        d.is_allowed(),
        "{who}: the refund of the other instance: {d:?}"
    );

    // A slot released by the other instance.
    let policy = Policy::new("given-back-slots", Quota::concurrent(1));
    let (pa, pb) = (prepare(a, &policy), prepare(b, &policy));
    let hold = |lease| Mode::Hold { lease };
    assert!(
        b.decide_with(&pb, &k, cost(1), hold(1))
            .await
            .unwrap()
            .is_allowed(),
        "{who}"
    );
    for lease in [2, 3] {
        let d = a.decide_with(&pa, &k, cost(1), hold(lease)).await.unwrap();
        assert!(!d.is_allowed(), "{who}: {d:?}");
    }
    b.decide_with(&pb, &k, cost(1), Mode::Release { lease: 1 })
        .await
        .unwrap();
    let d = a.decide_with(&pa, &k, cost(1), hold(4)).await.unwrap();
    assert!(
        d.is_allowed(),
        "{who}: the slot the other instance released: {d:?}"
    );
}

/// The quotas a flood of fresh keys is tried on: one of each algorithm, and a sliding window
/// of a thousand sub-windows (the resolution a store must not make every key pay for).
pub const FLOOD_QUOTAS: [&str; 4] = ["5/h", "5/h fixed", "5/h sliding 1min", "5/h sliding 3600ms"];

/// Issue 35: a flood of `n` fresh keys (one request each) on `quota`, after ten keys spent
/// their limit: every fresh key is served with its whole limit less one, and no spent key is
/// let through, whatever the flood did to the store. Returns the policy's name, for the
/// caller to measure what the store holds for it.
pub async fn flood<B: Backend>(backend: &B, quota: &str, n: usize, who: &str) -> String {
    let name = format!(
        "flood{}",
        quota.len() * 31 + quota.bytes().map(usize::from).sum::<usize>()
    );
    let policy = Policy::new(name.clone(), quota.parse::<Quota>().unwrap());
    let p = prepare(backend, &policy);
    let spent: Vec<_> = (0..10).map(|i| key(&format!("spent-{i}"))).collect();
    for k in &spent {
        for _ in 0..5 {
            let d = backend.decide(&p, k, cost(1)).await.unwrap();
            assert!(d.is_allowed(), "{who} {quota}: {d:?}");
        }
    }
    for i in 0..n {
        let d = backend
            .decide(&p, &key(&format!("fresh-{i:06}")), cost(1))
            .await
            .unwrap();
        assert!(d.is_allowed(), "{who} {quota}: a new client refused: {d:?}");
        assert_eq!(d.quotas()[0].remaining, 4, "{who} {quota}");
        if i % 1000 == 999 {
            for k in &spent {
                let d = backend.decide(&p, k, cost(1)).await.unwrap();
                assert!(
                    !d.is_allowed(),
                    "{who} {quota}: {k:?} let through during a flood"
                );
            }
        }
    }
    name
}

/// Penalties on window quotas, which every store serves, the approximate mode included: the
/// same meaning as [`blocks`] (GCRA there). `advance` moves the backend's clock, which starts
/// on a window boundary (the local backend's epoch at 0, a remote one at
/// [`aligned_test_clock`]).
pub async fn window_blocks<B: Backend>(backend: &B, advance: impl Fn(Duration), who: &str) {
    use tollgate::backend::Mode;
    let ms = Duration::from_millis;
    // 2 a second in fixed windows; blocked for a second once refused.
    let policy =
        Policy::new("window-blocks", Quota::new(2, ms(1000)).fixed_window()).block_for(ms(1000));
    let p = prepare(backend, &policy);
    let (k, other) = (key("blocked"), key("other"));
    let ask = |k, c: u32, mode: Mode| backend.decide_with(&p, k, cost(c), mode);
    for _ in 0..2 {
        let d = ask(&k, 1, Mode::Decide).await.unwrap();
        assert!(d.is_allowed(), "{who}: {d:?}");
    }
    let d = ask(&k, 1, Mode::Decide).await.unwrap();
    assert!(d.is_blocked(), "{who}: the refusal starts the block: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(1000)), "{who}: {d:?}");
    assert_eq!(
        (d.quotas()[0].remaining, d.quotas()[0].reset_after),
        (0, ms(1000)),
        "{who}: `t` is the block's end: {d:?}"
    );
    // Half a second later: still blocked, for what is left, whatever the cost or the mode.
    advance(ms(500));
    let modes = [(1, Mode::Decide), (2, Mode::Decide), (1, Mode::Peek)];
    // Then the block is over, and so is the window.
    last_half_of_a_block(backend, &p, (&k, &other), &modes, &advance, who).await;

    // A block on one quota: only its refusal starts it. 2 per 100 ms refuses and that is all;
    // 3 a second blocks for a second.
    let per_quota = Policy::new("window-quota-blocks", Quota::new(2, ms(100)).fixed_window())
        .and(Quota::new(3, ms(1000)).fixed_window().block_for(ms(1000)));
    per_quota_block(backend, &per_quota, advance, who).await;
}

/// A block on the second of two quotas (`Quota::block_for`), the first refusing two in 100 ms
/// and the second three a second: only the second's refusal starts the block, of a second.
async fn per_quota_block<B: Backend>(
    backend: &B,
    policy: &Policy,
    advance: impl Fn(Duration),
    who: &str,
) {
    use tollgate::backend::Mode;
    let ms = Duration::from_millis;
    let q = prepare(backend, policy);
    let k = key("per-quota");
    let ask = |c: u32| backend.decide_with(&q, &k, cost(c), Mode::Decide);
    for _ in 0..2 {
        assert!(ask(1).await.unwrap().is_allowed(), "{who}");
    }
    // The first quota refuses (its burst is spent), the second has room: no block.
    let d = ask(1).await.unwrap();
    assert!(!d.is_allowed() && !d.is_blocked(), "{who}: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(100)), "{who}: {d:?}");
    advance(ms(100));
    assert!(ask(1).await.unwrap().is_allowed(), "{who}");
    advance(ms(100));
    // Now the second quota refuses (its 3 spent): blocked for a second.
    let d = ask(1).await.unwrap();
    assert!(
        d.is_blocked(),
        "{who}: the blocking quota's refusal starts the block: {d:?}"
    );
    assert_eq!(d.retry_after(), Some(ms(1000)), "{who}: {d:?}");
    advance(ms(900));
    let d = ask(1).await.unwrap();
    assert!(d.is_blocked(), "{who}: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(100)), "{who}: {d:?}");
    advance(ms(100));
    assert!(
        ask(1).await.unwrap().is_allowed(),
        "{who}: the block is over"
    );
}

/// Live quota changes (`Policy::on_change`), the same on every store: a key that spent 5 of
/// a quota whose values then change keeps, resets, scales or adds as its strategy says, for
/// GCRA, fixed and sliding windows (a changed period too), a concurrent quota's slots stay
/// held, a running block stays, and a changed algorithm starts afresh. The clock stands still
/// (`advance` moves it only where said), on a window boundary. `p_old` stays alive while the
/// new policy is prepared, as a rule swap does.
pub async fn changes<B: Backend>(backend: &B, advance: impl Fn(Duration), who: &str) {
    use tollgate::OnChange::{self, *};
    use tollgate::backend::Mode;
    let ms = Duration::from_millis;
    let min = Duration::from_secs(60);
    let hour = Duration::from_secs(3600);
    // (strategy, quota before, quota after, remaining after one more request)
    let cases: [(OnChange, Quota, Quota, u32); 20] = [
        (Keep, Quota::per_hour(1000), Quota::per_hour(900), 894),
        (Reset, Quota::per_hour(1000), Quota::per_hour(900), 899),
        (
            Proportional,
            Quota::per_hour(1000),
            Quota::per_hour(900),
            894,
        ),
        (Additive, Quota::per_hour(1000), Quota::per_hour(900), 899),
        (Keep, Quota::per_hour(1000), Quota::per_hour(2000), 1994),
        (
            Proportional,
            Quota::per_hour(1000),
            Quota::per_hour(2000),
            1989,
        ),
        (Additive, Quota::per_hour(1000), Quota::per_hour(2000), 1994),
        // Only the burst changes: the debt is kept to the nanosecond.
        (
            Keep,
            Quota::per_hour(1000),
            Quota::per_hour(1000).burst(10),
            4,
        ),
        (
            Keep,
            Quota::new(100, hour).fixed_window(),
            Quota::new(90, hour).fixed_window(),
            84,
        ),
        (
            Reset,
            Quota::new(100, hour).fixed_window(),
            Quota::new(90, hour).fixed_window(),
            89,
        ),
        (
            Proportional,
            Quota::new(100, hour).fixed_window(),
            Quota::new(50, hour).fixed_window(),
            46,
        ),
        (
            Additive,
            Quota::new(100, hour).fixed_window(),
            Quota::new(90, hour).fixed_window(),
            89,
        ),
        (
            Additive,
            Quota::new(100, hour).fixed_window(),
            Quota::new(200, hour).fixed_window(),
            194,
        ),
        // A changed window length: the count moves into the new window of now.
        (
            Keep,
            Quota::new(100, hour).fixed_window(),
            Quota::new(100, min).fixed_window(),
            94,
        ),
        (
            Keep,
            Quota::new(100, min).sliding_window(),
            Quota::new(90, min).sliding_window(),
            84,
        ),
        (
            Reset,
            Quota::new(100, min).sliding_window(),
            Quota::new(90, min).sliding_window(),
            89,
        ),
        (
            Proportional,
            Quota::new(100, min).sliding_window(),
            Quota::new(50, min).sliding_window(),
            46,
        ),
        (
            Keep,
            Quota::new(100, min).sliding_window(),
            Quota::new(100, min)
                .sliding_window()
                .resolution(Duration::from_secs(10)),
            94,
        ),
        // Lowered below what was used: clamped to the new limit.
        (
            Keep,
            Quota::new(100, hour).fixed_window(),
            Quota::new(3, hour).fixed_window(),
            0,
        ),
        (Keep, Quota::per_hour(1000), Quota::per_hour(4).burst(4), 0),
    ];
    for (i, (strategy, before, after, left)) in cases.into_iter().enumerate() {
        let name = format!("change-{i}");
        let old = prepare(
            backend,
            &Policy::new(name.as_str(), before).on_change(strategy),
        );
        let k = key("spender");
        let d = backend.decide(&old, &k, cost(5)).await.unwrap();
        assert!(d.is_allowed(), "{who} case {i}: {d:?}");
        let new = prepare(
            backend,
            &Policy::new(name.as_str(), after).on_change(strategy),
        );
        let d = backend.decide(&new, &k, cost(1)).await.unwrap();
        assert_eq!(
            (d.is_allowed(), d.quotas()[0].remaining),
            (left > 0, left),
            "{who} case {i}: {strategy:?} {before} -> {after}: {d:?}"
        );
        // Another key starts afresh under the new values.
        let d = backend.decide(&new, &key("fresh"), cost(1)).await.unwrap();
        assert_eq!(
            d.quotas()[0].remaining,
            after.count().min(after.burst_size()) - 1,
            "{who} case {i}: {d:?}"
        );
        drop(old);
    }

    // The default is keep; a changed algorithm starts afresh.
    let old = prepare(backend, &Policy::new("change-alg", Quota::per_minute(10)));
    let k = key("spender");
    backend.decide(&old, &k, cost(5)).await.unwrap();
    let kept = prepare(backend, &Policy::new("change-alg", Quota::per_minute(20)));
    let d = backend.decide(&kept, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 14, "{who}: keep by default: {d:?}");
    let windowed = Policy::new("change-alg", Quota::per_minute(20).fixed_window());
    let fresh = prepare(backend, &windowed);
    let d = backend.decide(&fresh, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 19, "{who}: a new algorithm: {d:?}");
    drop((old, kept));

    // Named quotas are known by name: reordered, each keeps its own.
    let a = Quota::per_hour(100).named("hourly");
    let b = Quota::per_day(1000).named("daily");
    let old = prepare(backend, &Policy::new("change-named", a).and(b));
    backend.decide(&old, &k, cost(5)).await.unwrap();
    let swapped = Policy::new("change-named", Quota::per_day(2000).named("daily"))
        .and(Quota::per_hour(100).named("hourly"));
    let new = prepare(backend, &swapped);
    let d = backend.decide(&new, &k, cost(1)).await.unwrap();
    let left: Vec<u32> = d.quotas().iter().map(|q| q.remaining).collect();
    assert_eq!(left, [1994, 94], "{who}: {d:?}");
    drop(old);

    // A concurrent quota's slots stay held: 1 of 2 held, then 3 slots leave 2 to take.
    let old = prepare(backend, &Policy::new("change-slots", Quota::concurrent(2)));
    let hold = |lease| Mode::Hold { lease };
    let d = backend
        .decide_with(&old, &k, cost(1), hold(1))
        .await
        .unwrap();
    assert!(d.is_allowed(), "{who}: {d:?}");
    let new = prepare(backend, &Policy::new("change-slots", Quota::concurrent(3)));
    for lease in [2, 3] {
        let d = backend
            .decide_with(&new, &k, cost(1), hold(lease))
            .await
            .unwrap();
        assert!(d.is_allowed(), "{who}: slot {lease}: {d:?}");
    }
    let d = backend
        .decide_with(&new, &k, cost(1), hold(4))
        .await
        .unwrap();
    assert!(!d.is_allowed(), "{who}: three held: {d:?}");
    // The first request ends under the old policy: its slot comes back to the new one.
    backend
        .decide_with(&old, &k, cost(1), Mode::Release { lease: 1 })
        .await
        .unwrap();
    let d = backend
        .decide_with(&new, &k, cost(1), hold(5))
        .await
        .unwrap();
    assert!(d.is_allowed(), "{who}: the slot given back: {d:?}");
    drop(old);

    // A running block stays when the block's length changes; new blocks last the new length.
    let blocking =
        |len: u64| Policy::new("change-block", Quota::per_second(1).burst(1)).block_for(ms(len));
    let old = prepare(backend, &blocking(1000));
    backend.decide(&old, &k, cost(1)).await.unwrap();
    let d = backend.decide(&old, &k, cost(1)).await.unwrap();
    assert!(d.is_blocked(), "{who}: {d:?}");
    let new = prepare(backend, &blocking(5000));
    advance(ms(500));
    let d = backend.decide(&new, &k, cost(1)).await.unwrap();
    assert!(d.is_blocked(), "{who}: the block runs on: {d:?}");
    assert_eq!(d.retry_after(), Some(ms(500)), "{who}: {d:?}");
    drop(old);
}

/// A fleet's rolling change of a quota (issue 45): two instances on one store (`a` serving
/// 10 a minute, `b` 12), asked in turn for one key while time stands still. With the default
/// strategy (`Keep`) they admit 12 in all, the higher of the two limits, and 2 more once `a`
/// has spent 10; `Proportional` converts with rounding that only refuses sooner (at most 12);
/// `Reset` and `Additive` forgive once, at the key's first conversion, then hold the higher
/// limit too. GCRA, fixed and sliding windows.
pub async fn rolling_change<B: Backend>(a: &B, b: &B, who: &str) {
    use tollgate::Key;
    use tollgate::OnChange::{self, *};
    let per_minute = |n: u32, window: u8| {
        let q = Quota::per_minute(n);
        match window {
            0 => q,
            1 => q.fixed_window(),
            _ => q.sliding_window(),
        }
    };
    // What each admits: on a fresh key, then once `a` has spent its 10. A key converted by
    // the change remembers the values it came from, and converts back to them as `Keep`
    // does: it is forgiven once (`Reset`: the 1 taken before, then the higher limit, 12), not
    // at every call. `Proportional` rounds towards refusing.
    let strategies: [(
        OnChange,
        std::ops::RangeInclusive<usize>,
        std::ops::RangeInclusive<usize>,
    ); 4] = [
        (Keep, 12..=12, 2..=2),
        (Proportional, 8..=12, 0..=2),
        (Reset, 13..=13, 12..=12),
        (Additive, 12..=12, 2..=2),
    ];
    for window in 0..3 {
        for (strategy, fresh, after) in strategies.clone() {
            let name = format!("rolling-{window}-{strategy:?}");
            let low = Policy::new(name.as_str(), per_minute(10, window)).on_change(strategy);
            let high = Policy::new(name.as_str(), per_minute(12, window)).on_change(strategy);
            let (pa, pb) = (prepare(a, &low), prepare(b, &high));
            let alternate = |k: Key, from: usize| {
                let (pa, pb) = (&pa, &pb);
                async move {
                    let mut admitted = 0;
                    for i in from..from + 30 {
                        let d = if i % 2 == 0 {
                            a.decide(pa, &k, cost(1)).await.unwrap()
                        } else {
                            b.decide(pb, &k, cost(1)).await.unwrap()
                        };
                        admitted += usize::from(d.is_allowed());
                    }
                    admitted
                }
            };
            let got = alternate(key("fresh"), 0).await;
            assert!(
                fresh.contains(&got),
                "{who} {name}: {got} admitted on a fresh key, not {fresh:?}"
            );
            // `a` spends its 10 first, then `b` asks first.
            let spent = key("spent");
            for _ in 0..10 {
                assert!(a.decide(&pa, &spent, cost(1)).await.unwrap().is_allowed());
            }
            let got = alternate(spent, 1).await;
            assert!(
                after.contains(&got),
                "{who} {name}: {got} more after 10 spent, not {after:?}"
            );
        }
    }
}

/// Calendar quotas at and around their boundaries, the same on every store: a monthly quota
/// anchored on the 31st at 09:00 in New York (clamped to 28 February; a window 31 days less
/// the hour DST takes), a refund only into the window that counted it, and a daily quota over
/// the 23-hour day DST starts on. `start_s` is the backend's clock in Unix seconds now;
/// `advance` moves it on.
#[cfg(feature = "calendar")]
pub async fn calendar<B: Backend>(
    backend: &B,
    start_s: u64,
    advance: impl Fn(Duration),
    who: &str,
) {
    use tollgate::backend::Mode;
    let now = std::cell::Cell::new(start_s);
    let at = |t: u64| {
        assert!(t >= now.get(), "{who}: the test goes forward in time");
        advance(Duration::from_secs(t - now.get()));
        now.set(t);
    };
    let s = Duration::from_secs;
    let plan = Policy::new(
        "plan",
        "3/month on 31 at 09:00 tz America/New_York"
            .parse()
            .unwrap(),
    );
    let p = prepare(backend, &plan);
    let k = key("cal-tenant");
    let decide = |mode: Mode| backend.decide_with(&p, &k, cost(1), mode);
    // 2026-02-27 12:00 EST: the window from 31 January 09:00 to 28 February 09:00 EST.
    let feb_28 = 1_772_287_200;
    at(1_772_211_600);
    for left in [2, 1, 0] {
        let d = decide(Mode::Decide).await.unwrap();
        let q = d.quotas()[0];
        assert_eq!(q.outcome, Outcome::Allowed, "{who}: {d:?}");
        assert_eq!((q.remaining, q.reset_after), (left, s(75_600)), "{who}");
    }
    let d = decide(Mode::Decide).await.unwrap();
    assert_eq!(d.retry_after(), Some(s(75_600)), "{who}: {d:?}");
    // A second before the boundary: refused for that second.
    at(feb_28 - 1);
    let d = decide(Mode::Decide).await.unwrap();
    assert_eq!(d.retry_after(), Some(s(1)), "{who}: {d:?}");
    assert_eq!(d.quotas()[0].reset_after, s(1), "{who}: {d:?}");
    // At the boundary: a new window, to 31 March 09:00 EDT, 31 days less an hour.
    at(feb_28);
    let d = decide(Mode::Decide).await.unwrap();
    let q = d.quotas()[0];
    assert_eq!(q.outcome, Outcome::Allowed, "{who}: {d:?}");
    assert_eq!(
        (q.remaining, q.reset_after),
        (2, s(31 * 86_400 - 3600)),
        "{who}"
    );
    // Units taken before the boundary are not given back; those taken since, are.
    at(feb_28 + 1);
    let refund = |ago: u64| {
        decide(Mode::Refund {
            admitted_ago: s(ago),
        })
    };
    let d = refund(2).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 2, "{who}: {d:?}");
    let d = refund(1).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 3, "{who}: {d:?}");
    // A peek (the status endpoint's view) answers as a decision would, taking nothing.
    let d = decide(Mode::Peek).await.unwrap();
    let q = d.quotas()[0];
    assert_eq!(
        (q.remaining, q.reset_after),
        (2, s(31 * 86_400 - 3601)),
        "{who}: {d:?}"
    );
    let d = decide(Mode::Peek).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 2, "{who}: {d:?}");

    // The day DST starts in New York (8 March 2026) is 23 hours long; the next, 24.
    let daily = Policy::new("daily", "2/day tz America/New_York".parse().unwrap());
    let p = prepare(backend, &daily);
    let decide = || backend.decide(&p, &k, cost(1));
    let mar_9 = 1_773_028_800;
    at(1_772_946_000);
    let d = decide().await.unwrap();
    assert_eq!(d.quotas()[0].reset_after, s(23 * 3600), "{who}: {d:?}");
    at(mar_9 - 1);
    let d = decide().await.unwrap();
    assert_eq!(
        (d.quotas()[0].remaining, d.quotas()[0].reset_after),
        (0, s(1)),
        "{who}"
    );
    let d = decide().await.unwrap();
    assert_eq!(d.retry_after(), Some(s(1)), "{who}: {d:?}");
    at(mar_9);
    let d = decide().await.unwrap();
    let q = d.quotas()[0];
    assert_eq!(
        (q.outcome, q.remaining, q.reset_after),
        (Outcome::Allowed, 1, s(86_400)),
        "{who}"
    );

    // The daily quota moves to Berlin's days while the key has 1 counted in New York's day
    // (9 March, 04:00 UTC is 05:00 in Berlin): kept, it is counted in Berlin's day, which
    // ends at 23:00 UTC, in 19 hours; reset, it is forgotten.
    use tollgate::OnChange;
    let berlin = |name, on_change| {
        Policy::new(name, "2/day tz Europe/Berlin".parse().unwrap()).on_change(on_change)
    };
    let kept = prepare(backend, &berlin("daily", OnChange::Keep));
    let d = backend.decide(&kept, &k, cost(1)).await.unwrap();
    let q = d.quotas()[0];
    assert_eq!(
        (q.outcome, q.remaining, q.reset_after),
        (Outcome::Allowed, 0, s(19 * 3600)),
        "{who}"
    );
    let d = backend.decide(&kept, &k, cost(1)).await.unwrap();
    assert_eq!(d.retry_after(), Some(s(19 * 3600)), "{who}: {d:?}");
    let daily = Policy::new("daily-2", "2/day tz America/New_York".parse().unwrap());
    backend
        .decide(&prepare(backend, &daily), &k, cost(1))
        .await
        .unwrap();
    let reset = prepare(backend, &berlin("daily-2", OnChange::Reset));
    let d = backend.decide(&reset, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 1, "{who}: {d:?}");
}
