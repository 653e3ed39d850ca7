//! The approximate Redis mode: several instances (backends) on one real Redis, driven over the
//! limit, hold the over-admission bound the docs state; under the limit they deny nothing;
//! without Redis they keep deciding and resynchronize when it returns.
#![cfg(feature = "redis")]

mod support;

use std::time::{Duration, Instant};

use std::num::NonZeroU32;
use support::{RedisCluster, RedisServer, cost, key, prepare};

use tollgate::backend::Backend;
use tollgate::backend::redis::{ApproxBackend, ApproxPolicy, Approximate, RedisBackend, TestClock};
use tollgate::backend::remote::Fleet;
use tollgate::{ConfigError, Key, Policy, Quota};

/// The limit: 100 per second, in sub-windows of 100 ms.
const LIMIT: u32 = 100;
const WINDOW_US: u64 = 1_000_000;
const SLICE_US: u64 = 100_000;
/// Long enough that calls do not time out on a machine busy with other tests.
const TIMEOUT: Duration = Duration::from_millis(200);
const FLUSH_US: u64 = 5_000;

fn policy() -> Policy {
    Policy::new(
        "api",
        Quota::per_second(LIMIT)
            .sliding_window()
            .resolution(Duration::from_micros(SLICE_US)),
    )
}

/// The asynchronous variant without allowances: every admitted unit is sent (the tests of how
/// counts are kept in step use it; allowances have tests of their own).
fn in_step() -> Approximate {
    Approximate::asynchronous().allowance(0.0)
}

/// An instance of a fleet of 3 (as configured: no announcements).
fn instance(url: &str, clock: &TestClock, mode: Approximate) -> ApproxBackend {
    RedisBackend::builder()
        .url(url)
        .fleet(Fleet::Size(NonZeroU32::new(3).unwrap()))
        .timeout(TIMEOUT)
        .circuit_breaker(2, Duration::from_millis(50))
        .test_clock(clock.clone())
        .build_approximate(mode.flush_every(Duration::from_micros(FLUSH_US)))
        .unwrap()
}

/// Moves the clock to the start of the next window of `window_us`.
fn to_window_start(clock: &TestClock, window_us: u64) {
    clock.advance(Duration::from_micros(
        window_us - clock_us(clock) % window_us,
    ));
}

/// Two instances on one Redis, each with `policy` prepared.
fn pair(
    server: &RedisServer,
    clock: &TestClock,
    mode: Approximate,
    policy: &Policy,
) -> [(ApproxBackend, ApproxPolicy); 2] {
    [0, 1].map(|_| {
        let b = instance(&server.url(), clock, mode);
        let p = prepare(&b, policy);
        (b, p)
    })
}

/// The names of the approximate mode's counters in Redis whose names match `pattern`.
fn counters(server: &RedisServer, pattern: &str) -> Vec<String> {
    server
        .cmd(&["KEYS", pattern])
        .lines()
        .filter(|l| l.contains(":2.a"))
        .map(str::to_owned)
        .collect()
}

/// The one counter matching `pattern`.
fn counter(server: &RedisServer, pattern: &str) -> String {
    let mut all = counters(server, pattern);
    assert_eq!(all.len(), 1, "{all:?}");
    all.remove(0)
}

/// A command's integer reply (`:n`, or a bulk string holding a number; 0 for nil).
fn number(server: &RedisServer, args: &[&str]) -> i64 {
    let reply = server.cmd(args);
    let last = reply.lines().last().unwrap_or("");
    last.trim_start_matches(':').trim().parse().unwrap_or(0)
}

/// Admissions of the fleet, per instance, at simulated microseconds.
struct Log {
    /// (time, instance) of every admitted unit, in time order.
    admitted: Vec<(u64, usize)>,
    limit: u32,
    slice_us: u64,
    window_us: u64,
}

impl Log {
    /// The fleet's sliding-window estimate at `t` (the algorithm's own measure, on the true
    /// fleet-wide counts of each sub-window), as exact mode would compute it.
    fn estimate(&self, t: u64) -> f64 {
        let slice_us = self.slice_us;
        let slice = t / slice_us;
        let n = self.window_us / slice_us;
        let mut counts = vec![0u64; n as usize + 1];
        for &(at, _) in &self.admitted {
            let s = at / slice_us;
            if at <= t && s + n >= slice {
                counts[(s + n - slice) as usize] += 1;
            }
        }
        let r = t % slice_us;
        counts[0] as f64 * (slice_us - r) as f64 / slice_us as f64
            + counts[1..].iter().sum::<u64>() as f64
    }

    /// Units instance `other_than` did not admit itself in `(t - d, t]`.
    fn others_within(&self, t: u64, d: u64, other_than: usize) -> u64 {
        self.admitted
            .iter()
            .filter(|&&(at, i)| at + d > t && at <= t && i != other_than)
            .count() as u64
    }
}

/// Drives `n` instances, each offered one request every `every_us` for `secs` simulated
/// seconds, flushing every 5 ms; returns the log.
async fn drive(
    instances: &[(ApproxBackend, ApproxPolicy)],
    clock: &TestClock,
    every_us: u64,
    secs: u64,
) -> Log {
    let k = key("client");
    let mut log = Log {
        admitted: Vec::new(),
        limit: LIMIT,
        slice_us: SLICE_US,
        window_us: WINDOW_US,
    };
    let start = clock_us(clock);
    let steps = secs * 1_000_000 / every_us;
    for step in 0..steps {
        let now = start + step * every_us;
        for (i, (b, p)) in instances.iter().enumerate() {
            if b.decide(p, &k, cost(1)).await.unwrap().is_allowed() {
                log.admitted.push((clock_us(clock), i));
            }
        }
        let next = start + (step + 1) * every_us;
        if next / FLUSH_US != now / FLUSH_US {
            for (b, _) in instances {
                b.flush().await;
            }
        }
        clock.advance(Duration::from_micros(next - clock_us(clock)));
    }
    log
}

/// A decision's future is ready on its first poll: nothing waits on the network.
fn ready_at_once(mut f: tollgate::backend::redis::ApproxFuture) -> tollgate::backend::Decision {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    match std::pin::Pin::new(&mut f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(d) => d.unwrap(),
        Poll::Pending => panic!("the decision waited"),
    }
}

fn clock_us(clock: &TestClock) -> u64 {
    clock.now_ns() / 1000
}

/// Every admission is checked: the fleet's estimate right after it is within `L + A`, `A`
/// the units other instances admitted in the `d` before it (the staleness bound), and within
/// `N × L` (the bound that always holds). Returns the largest over-admission seen.
/// The staleness bound is checked when `slack` is given: on the simulated clock, where `D`
/// holds by construction (in real time it is a matter of scheduling).
fn check_bounds(log: &Log, n: usize, d: u64, slack: Option<f64>) -> f64 {
    let limit = f64::from(log.limit);
    let mut worst: f64 = 0.0;
    for &(t, i) in &log.admitted {
        let e = log.estimate(t);
        let a = log.others_within(t, d, i) as f64;
        if let Some(slack) = slack {
            assert!(
                e <= limit + a + slack + 1e-9,
                "at {t}: estimate {e} over {limit} + {a} unseen"
            );
        }
        assert!(e <= n as f64 * limit + 1e-9, "at {t}: {e} over N x L");
        worst = worst.max(e - limit);
    }
    worst
}

async fn fleet(
    url: &str,
    clock: &TestClock,
    n: usize,
    mode: Approximate,
) -> Vec<(ApproxBackend, ApproxPolicy)> {
    (0..n)
        .map(|_| {
            let b = instance(url, clock, mode);
            let p = prepare(&b, &policy());
            (b, p)
        })
        .collect()
}

#[tokio::test]
async fn gcra_quotas_are_refused_when_the_layer_is_built() {
    let b = RedisBackend::builder()
        .url("redis://127.0.0.1:1")
        .build_approximate(Approximate::asynchronous())
        .unwrap();
    let p = Policy::new("api", Quota::per_minute(60)).and(Quota::per_second(5).fixed_window());
    let err = b.prepare(&p, &p.validate().unwrap()).unwrap_err();
    assert!(matches!(err, ConfigError::InvalidQuota { .. }), "{err}");
    assert!(err.to_string().contains("sliding"), "{err}");
}

/// Every outcome feature is served: settling after the response, concurrent quotas and
/// penalties, per policy or per quota (each has its own tests below).
#[tokio::test]
async fn outcome_features_are_served() {
    let b = RedisBackend::builder()
        .url("redis://127.0.0.1:1")
        .build_approximate(Approximate::asynchronous())
        .unwrap();
    for quotas in [
        &["10/min fixed", "2 concurrent"][..],
        &["10/min fixed block 1h"],
        &["10/min fixed", "100/h sliding 1min block 10min"],
    ] {
        let mut q = quotas.iter().map(|q| q.parse::<Quota>().unwrap());
        let first = q.next().unwrap();
        let p = q.fold(Policy::new("api", first), Policy::and);
        let p = p.charge_when(tollgate::settle::ChargeWhen::status([401]));
        assert!(b.prepare(&p, &p.validate().unwrap()).is_ok(), "{quotas:?}");
    }
}

/// Three instances, each offered 10 times the limit: the fleet stays within the stated bound,
/// and near the limit.
/// `quiet` is what the others may have admitted within their allowances and not sent yet,
/// added to the staleness bound.
async fn over_the_limit(mode: Approximate, d_us: u64, quiet: f64) -> (f64, usize) {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let n = 3;
    let instances = fleet(&server.url(), &clock, n, mode).await;
    // 3 instances x 1 request per ms: 3 000/s offered against 100/s, for 4 s.
    let log = drive(&instances, &clock, 1_000, 4).await;
    let worst = check_bounds(&log, n, d_us, Some(quiet));
    let admitted = log.admitted.len();
    // Not far under the limit either: in 4 s, at least 4 windows' worth.
    assert!(admitted >= 4 * LIMIT as usize, "admitted {admitted}");
    (worst, admitted)
}

#[tokio::test]
async fn asynchronous_fleets_stay_within_the_bound() {
    // D = r + settle + f, settle = timeout + f; plus one step of the drive.
    // The settle time is the timeout plus the flush interval, at most half a sub-window.
    let settle = (TIMEOUT.as_micros() as u64 + FLUSH_US).min(SLICE_US / 2);
    let d = SLICE_US + settle + FLUSH_US + 1_000;
    // The steady-state estimate of the docs: (N - 1) x L x D / W.
    let model = 2.0 * f64::from(LIMIT) * d as f64 / WINDOW_US as f64;
    let (worst, admitted) = over_the_limit(in_step(), d, 0.0).await;
    eprintln!(
        "asynchronous, in step: {admitted} admitted in 4 s, worst over-admission {worst:.1} \
         (model {model:.1})"
    );
    assert!(
        worst <= model + 1.0,
        "worst {worst} above the model {model}"
    );
    // With allowances (half of a share of 100 / 3: 16 each), the others may hold up to 16
    // each unsent: the bound is `L + A + 2 x 16`.
    let quiet = 2.0 * (f64::from(LIMIT) * 0.5 / 3.0).floor();
    let (worst, admitted) = over_the_limit(Approximate::asynchronous(), d, quiet).await;
    eprintln!(
        "asynchronous, allowances: {admitted} admitted in 4 s, worst over-admission {worst:.1} \
         (model {model:.1} + {quiet})"
    );
    assert!(
        worst <= model + quiet + 1.0,
        "worst {worst} above the model {model} + {quiet}"
    );
}

#[tokio::test]
async fn synchronous_fleets_stay_within_the_bound() {
    let settle = (TIMEOUT.as_micros() as u64).min(SLICE_US / 2);
    let d = SLICE_US + settle + FLUSH_US + 1_000;
    let (worst, admitted) = over_the_limit(Approximate::synchronous(), d, 0.0).await;
    let model = 2.0 * f64::from(LIMIT) * d as f64 / WINDOW_US as f64;
    eprintln!(
        "synchronous: {admitted} admitted in 4 s, worst over-admission {worst:.1} (model {model:.1})"
    );
    assert!(
        worst <= model + 1.0,
        "worst {worst} above the model {model}"
    );
}

#[tokio::test]
async fn under_the_limit_nothing_is_denied() {
    let server = RedisServer::start();
    for mode in [
        Approximate::asynchronous(),
        in_step(),
        Approximate::synchronous(),
    ] {
        let clock = TestClock::new();
        let instances = fleet(&server.url(), &clock, 3, mode).await;
        server.cmd(&["FLUSHALL"]);
        // 3 instances x one request per 40 ms: 75 a second against 100.
        let log = drive(&instances, &clock, 40_000, 3).await;
        assert_eq!(log.admitted.len(), 3 * 75, "{mode:?}");
    }
}

#[tokio::test]
async fn instances_learn_each_others_counts_from_redis() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let fixed = Policy::new("f", Quota::per_second(10).fixed_window());
    let [(a, pa), (b, pb)] = pair(&server, &clock, in_step(), &fixed);
    let k = key("k");
    // Start on a window boundary.
    to_window_start(&clock, 1_000_000);
    for _ in 0..7 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    a.flush().await;
    // B's first decision is blind (it never waits), and queues a read.
    assert!(b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    b.flush().await;
    // B now counts A's 7 and its own 1: two more pass, the third does not.
    let d = b.decide(&pb, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 1, "{d:?}");
    assert!(b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    b.flush().await;
    assert_eq!(counters(&server, "*2.a0.1000000x0*").len(), 1);
    // In the next window everything starts again.
    clock.advance(Duration::from_secs(1));
    assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    let s = a.stats();
    assert_eq!(s.units_sent, 7);
    assert_eq!(s.keys, 1);
}

#[tokio::test]
async fn a_synchronous_key_waits_for_its_first_read_and_each_increment() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let fixed = Policy::new("f", Quota::per_second(5).fixed_window());
    let [(a, pa), (b, pb)] = pair(&server, &clock, Approximate::synchronous(), &fixed);
    let k = key("k");
    to_window_start(&clock, 1_000_000);
    for _ in 0..3 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    // No flush: A's increments were written before its requests went on, and B's first
    // request reads them.
    let d = b.decide(&pb, &k, cost(1)).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.quotas()[0].remaining, 1);
    // A hears of B's unit through the reply to its own increment.
    let d = a.decide(&pa, &k, cost(1)).await.unwrap();
    assert!(d.is_allowed());
    assert!(!a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    assert_eq!(a.stats().units_sent, 4);
}

#[tokio::test]
async fn without_redis_decisions_go_on_locally_and_resynchronize() {
    let mut server = RedisServer::start();
    let clock = TestClock::new();
    let fixed = Policy::new("f", Quota::per_minute(50).fixed_window());
    let [(a, pa), (b, pb)] = pair(&server, &clock, in_step(), &fixed);
    let k = key("k");
    to_window_start(&clock, 60_000_000);
    server.kill();
    // Every decision is ready at once: nothing waits on the network.
    for _ in 0..20 {
        let da = ready_at_once(a.decide(&pa, &k, cost(1)));
        let db = ready_at_once(b.decide(&pb, &k, cost(1)));
        assert!(da.is_allowed() && db.is_allowed());
        a.flush().await;
        b.flush().await;
    }
    assert!(a.stats().breaker_open, "{:?}", a.stats());
    server.restart();
    // Once Redis answers, the units admitted meanwhile reach it, and each instance counts the
    // other's.
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.stats().units_sent < 20 || b.stats().units_sent < 20 {
        assert!(Instant::now() < deadline, "{:?} {:?}", a.stats(), b.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.flush().await;
        b.flush().await;
    }
    assert_eq!(number(&server, &["GET", &counter(&server, "*")]), 40);
    // A hears of all of B's units, at the latest through the reply to its next increment.
    a.decide(&pa, &k, cost(1)).await.unwrap();
    a.flush().await;
    let d = a.decide(&pa, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 50 - 42, "{d:?}");
}

#[tokio::test]
async fn a_synchronous_request_waits_at_most_the_timeout_and_not_once_the_breaker_opens() {
    let clock = TestClock::new();
    let timeout = Duration::from_millis(200);
    let a = RedisBackend::builder()
        .url(format!("redis://127.0.0.1:{}", support::closed_port()))
        .timeout(timeout)
        .circuit_breaker(2, Duration::from_secs(60))
        .test_clock(clock.clone())
        .build_approximate(Approximate::synchronous())
        .unwrap();
    let p = prepare(&a, &Policy::new("f", Quota::per_second(100).fixed_window()));
    let k = key("k");
    // The first request: a read and an increment, both refused at once by the closed port;
    // the breaker opens after the second failure.
    let started = Instant::now();
    assert!(a.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    assert!(
        started.elapsed() < 2 * timeout + Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert!(a.stats().breaker_open, "{:?}", a.stats());
    // From then on allowed requests go on at once: nothing waits for a dead Redis.
    for _ in 0..50 {
        assert!(ready_at_once(a.decide(&p, &k, cost(1))).is_allowed());
    }
}

#[tokio::test]
async fn counts_are_shared_on_a_cluster() {
    let cluster = RedisCluster::start();
    let clock = TestClock::new();
    let mk = || {
        RedisBackend::builder()
            .cluster_nodes(cluster.urls())
            .timeout(Duration::from_millis(500))
            .test_clock(clock.clone())
            .build_approximate(in_step())
            .unwrap()
    };
    let (a, b) = (mk(), mk());
    let fixed = Policy::new("f", Quota::per_second(10).fixed_window());
    let (pa, pb) = (prepare(&a, &fixed), prepare(&b, &fixed));
    to_window_start(&clock, 1_000_000);
    // Keys spread over the slots of every node.
    for i in 0..20 {
        let k = key(&format!("client-{i}"));
        for _ in 0..6 {
            assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
        }
        assert!(b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    }
    a.flush().await;
    b.flush().await;
    assert_eq!(a.stats().failed_calls, 0, "{:?}", a.stats());
    assert_eq!(a.stats().units_sent, 120);
    for i in 0..20 {
        let k = key(&format!("client-{i}"));
        b.decide(&pb, &k, cost(1)).await.unwrap();
    }
    b.flush().await;
    for i in 0..20 {
        let k = key(&format!("client-{i}"));
        let d = b.decide(&pb, &k, cost(1)).await.unwrap();
        assert_eq!(d.quotas()[0].remaining, 10 - 9, "client-{i}: {d:?}");
    }
}

/// Three servers, each with its own layer on the approximate mode, on one Redis; clients drive
/// each over the limit through real TCP connections, in real time. Every admission the
/// handlers saw is checked against the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_layers_on_one_redis_driven_over_the_limit_hold_the_bound() {
    layers_over_the_limit(Approximate::asynchronous()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_layers_in_step_on_one_redis_driven_over_the_limit_hold_the_bound() {
    layers_over_the_limit(in_step()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_layers_on_one_redis_driven_over_the_limit_hold_the_bound() {
    layers_over_the_limit(Approximate::synchronous()).await;
}

async fn layers_over_the_limit(mode: Approximate) {
    use std::sync::{Arc, Mutex};
    use std::time::{SystemTime, UNIX_EPOCH};
    use tollgate::RateLimitLayer;
    use tollgate::key::Header;

    let server = RedisServer::start();
    let (limit, slice_us, window_us) = (50u32, 100_000u64, 1_000_000u64);
    let flush = Duration::from_millis(5);
    let admitted: Arc<Mutex<Vec<(u64, usize)>>> = Arc::default();
    let mut addrs = Vec::new();
    for i in 0..3 {
        let backend = RedisBackend::builder()
            .url(server.url())
            .timeout(TIMEOUT)
            .build_approximate(mode.flush_every(flush))
            .unwrap();
        let layer = RateLimitLayer::builder()
            .policy(Policy::new(
                "api",
                Quota::per_second(limit)
                    .sliding_window()
                    .resolution(Duration::from_micros(slice_us)),
            ))
            .key(Header::new("x-key"))
            .backend(backend)
            .build()
            .unwrap();
        let seen = admitted.clone();
        let app = axum::Router::new()
            .route(
                "/",
                axum::routing::get(move || {
                    let seen = seen.clone();
                    async move {
                        let us = SystemTime::now()
                            .duration_since(UNIX_EPOCH)
                            .unwrap()
                            .as_micros() as u64;
                        seen.lock().unwrap().push((us, i));
                        "ok"
                    }
                }),
            )
            .layer(layer);
        addrs.push(support::serve(app).await);
    }
    let client = reqwest::Client::new();
    let until = Instant::now() + Duration::from_millis(2500);
    let mut tasks = Vec::new();
    for addr in &addrs {
        for _ in 0..3 {
            let (client, url) = (client.clone(), format!("http://{addr}/"));
            tasks.push(tokio::spawn(async move {
                let (mut ok, mut limited) = (0, 0);
                while Instant::now() < until {
                    let r = client
                        .get(&url)
                        .header("x-key", "alice")
                        .send()
                        .await
                        .unwrap();
                    match r.status().as_u16() {
                        200 => ok += 1,
                        429 => limited += 1,
                        s => panic!("status {s}"),
                    }
                }
                (ok, limited)
            }));
        }
    }
    let (mut ok, mut limited) = (0, 0);
    for t in tasks {
        let (o, l) = t.await.unwrap();
        ok += o;
        limited += l;
    }
    let mut admitted = admitted.lock().unwrap().clone();
    admitted.sort_unstable();
    assert_eq!(admitted.len(), ok);
    assert!(
        limited > 10 * ok,
        "not driven over the limit: {ok} passed, {limited} limited"
    );
    let log = Log {
        admitted,
        limit,
        slice_us,
        window_us,
    };
    // In real time, on a machine busy with other tests, how stale an instance's counts get is
    // a matter of scheduling: `N x L` is checked here, `L + A` on the simulated clock above.
    let d = slice_us + 2 * 5_000 + 20_000;
    let worst = check_bounds(&log, 3, d, None);
    eprintln!(
        "layers ({mode:?}): {ok} passed and {limited} limited in 2.5 s; worst over-admission {worst:.1}"
    );
    // At least the limit's worth over the run: the fleet is not starved; and far from what
    // three instances deciding alone would admit (50 each per second: 375 and more in 2.5 s).
    assert!(ok >= 2 * limit as usize, "{ok}");
    assert!(
        ok < 7 * limit as usize,
        "{ok}: the instances do not hear of each other"
    );
}

#[tokio::test]
async fn every_counter_expires_and_reset_clears_the_key() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let sliding = Policy::new(
        "s",
        Quota::per_second(10)
            .sliding_window()
            .resolution(Duration::from_millis(250)),
    );
    let [(a, pa), (b, pb)] = pair(&server, &clock, in_step(), &sliding);
    let k = key("k");
    for _ in 0..6 {
        for (x, p) in [(&a, &pa), (&b, &pb)] {
            x.decide(p, &k, cost(1)).await.unwrap();
            x.flush().await;
        }
        clock.advance(Duration::from_millis(100));
    }
    let keys = counters(&server, "*");
    assert!(keys.len() >= 2, "{keys:?}");
    for name in &keys {
        let ttl = number(&server, &["PTTL", name]);
        // A counter outlives every window holding its sub-window (the 4 sub-windows, the one
        // weighed before them, one more), plus 2 s for clocks: 6 x 250 ms + 2 s.
        assert!(ttl > 0 && ttl <= 3_500, "{name}: {ttl}");
    }
    // A admits 3 more without sending them, then resets the key: they are forgotten too.
    for _ in 0..3 {
        a.decide(&pa, &k, cost(1)).await.unwrap();
    }
    a.reset(&pa, &k).await.unwrap();
    a.flush().await;
    b.flush().await;
    let total: i64 = counters(&server, "*")
        .iter()
        .map(|name| number(&server, &["GET", name]))
        .sum();
    assert_eq!(total, 0, "counters left after the reset");
    // B hears of the reset at its next read, due once the settle time (here 125 ms, half a
    // sub-window) has passed into a sub-window.
    to_window_start(&clock, 250_000);
    clock.advance(Duration::from_millis(200));
    b.decide(&pb, &k, cost(1)).await.unwrap();
    b.flush().await;
    // With A's 6 units still counted, B (6 of its own) would be over the limit of 10; after
    // the reset only its own confirmed units count.
    let d = b.decide(&pb, &k, cost(1)).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    for name in counters(&server, "*") {
        let ttl = number(&server, &["PTTL", &name]);
        assert!(ttl > 0, "{name}: {ttl}");
    }
}

#[tokio::test]
async fn synchronous_requests_on_a_key_not_read_yet_all_wait_for_the_fleet_counts() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let fixed = Policy::new("f", Quota::per_minute(10).fixed_window());
    let [(a, pa), (b, pb)] = pair(&server, &clock, Approximate::synchronous(), &fixed);
    let k = key("k");
    to_window_start(&clock, 60_000_000);
    for _ in 0..10 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    clock.advance(Duration::from_secs(30));
    // Ten requests at once on B, which has never seen the key: none decides blind.
    let decisions =
        futures_util::future::join_all((0..10).map(|_| b.decide(&pb, &k, cost(1)))).await;
    let allowed = decisions
        .into_iter()
        .filter(|d| d.as_ref().unwrap().is_allowed())
        .count();
    assert_eq!(allowed, 0);
}

#[tokio::test]
async fn when_redis_loses_its_data_counters_expire_again_and_own_units_still_count() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let fixed = Policy::new("f", Quota::per_minute(10).fixed_window());
    let a = instance(&server.url(), &clock, in_step());
    let pa = prepare(&a, &fixed);
    let k = key("k");
    to_window_start(&clock, 60_000_000);
    for _ in 0..6 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    a.flush().await;
    // A restart without persistence, a failover to a replica that had nothing.
    server.cmd(&["FLUSHALL"]);
    assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    a.flush().await; // recreates the counter (1), without an expiry
    a.flush().await; // the expiry it owes
    let name = counter(&server, "*");
    let ttl = number(&server, &["PTTL", &name]);
    assert!(ttl > 0, "{name}: {ttl}");
    // A read now says 1, but A's own 7 confirmed units still count: 3 more pass, not 9.
    clock.advance(Duration::from_secs(1));
    let mut allowed = 0;
    for _ in 0..12 {
        if a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed() {
            allowed += 1;
        }
        a.flush().await;
    }
    assert_eq!(allowed, 3);
}

#[tokio::test]
async fn windows_of_decades_decide_without_panicking() {
    let server = RedisServer::start();
    let clock = TestClock::new(); // about 31.7 years after the epoch
    let year = Duration::from_secs(365 * 86_400);
    let long = Policy::new(
        "long",
        Quota::new(5, 60 * year)
            .sliding_window()
            .resolution(30 * year),
    );
    for mode in [
        Approximate::asynchronous(),
        in_step(),
        Approximate::synchronous(),
    ] {
        let a = instance(&server.url(), &clock, mode);
        let p = prepare(&a, &long);
        let k = key("k");
        for _ in 0..5 {
            assert!(a.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
        }
        a.flush().await;
        assert!(!a.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
        assert_eq!(a.stats().failed_calls, 0, "{:?}", a.stats());
        // The units went to the current sub-window's counter, and were confirmed there.
        assert_eq!(a.stats().units_sent, 5, "{mode:?}");
        let name = counter(&server, "*");
        let slice = (clock_us(&clock) / (30 * year).as_micros() as u64).to_string();
        assert!(name.ends_with(&format!(":{slice}")), "{name}");
        assert_eq!(number(&server, &["GET", &name]), 5);
        server.cmd(&["FLUSHALL"]);
    }
}

#[tokio::test]
async fn a_flush_cancelled_midway_loses_no_units_and_reads_again() {
    use std::future::Future;
    use std::task::{Context, Waker};
    let server = RedisServer::start();
    let clock = TestClock::new();
    let a = instance(&server.url(), &clock, in_step());
    let p = prepare(&a, &Policy::new("f", Quota::per_minute(100).fixed_window()));
    let k = key("k");
    to_window_start(&clock, 60_000_000);
    // The background task is kept out of the way: Redis is paused, and A's flush is polled
    // once (its call sent) and dropped, as a caller's timeout would.
    server.pause();
    for _ in 0..5 {
        assert!(ready_at_once(a.decide(&p, &k, cost(1))).is_allowed());
    }
    {
        let mut f = Box::pin(a.flush());
        let _ = f.as_mut().poll(&mut Context::from_waker(Waker::noop()));
    }
    server.resume();
    let reads = a.stats().reads;
    support::eventually("the units sent again", || a.stats().units_sent >= 5).await;
    a.flush().await;
    // Nothing lost: the dropped call may have reached Redis too (then counted twice, which only
    // denies early).
    let n = number(&server, &["GET", &counter(&server, "*")]);
    assert!((5..=10).contains(&n), "{n}");
    // And the key's read, cancelled with the call, was made again.
    assert!(a.stats().reads > reads, "{:?}", a.stats());
}

#[tokio::test]
async fn a_command_redis_refuses_fails_alone() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let a = instance(&server.url(), &clock, in_step());
    let p = prepare(&a, &Policy::new("f", Quota::per_minute(100).fixed_window()));
    to_window_start(&clock, 60_000_000);
    let (bad, good) = (key("bad"), key("good"));
    a.decide(&p, &bad, cost(1)).await.unwrap();
    a.flush().await;
    // A key of another type where the counter of `bad` is.
    let name = counter(&server, "*bad*");
    server.cmd(&["DEL", &name]);
    server.cmd(&["LPUSH", &name, "x"]);
    let sent = a.stats().units_sent;
    for _ in 0..3 {
        a.decide(&p, &bad, cost(1)).await.unwrap();
        a.decide(&p, &good, cost(1)).await.unwrap();
    }
    a.flush().await;
    a.flush().await;
    let s = a.stats();
    // `good`'s 3 units went through in the same pipelines, `bad`'s were dropped, not resent.
    assert_eq!(s.units_sent, sent + 3, "{s:?}");
    assert_eq!(s.failed_calls, 0, "{s:?}");
    assert!(!s.breaker_open);
}

#[test]
fn the_background_task_starts_again_in_a_new_runtime() {
    let server = RedisServer::start();
    let rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let b = RedisBackend::builder()
        .url(server.url())
        .build_approximate(in_step())
        .unwrap();
    let p = prepare(&b, &Policy::new("f", Quota::per_minute(100).fixed_window()));
    let k = key("k");
    rt().block_on(async {
        b.decide(&p, &k, cost(1)).await.unwrap();
        support::eventually("the first unit sent", || b.stats().units_sent == 1).await;
    });
    // That runtime is gone, and its task with it; the next decision starts another.
    rt().block_on(async {
        b.decide(&p, &k, cost(1)).await.unwrap();
        support::eventually("the second unit sent", || b.stats().units_sent == 2).await;
    });
}

#[tokio::test]
async fn keys_whose_windows_passed_are_swept_while_redis_is_down() {
    let clock = TestClock::new();
    let b = RedisBackend::builder()
        .url(format!("redis://127.0.0.1:{}", support::closed_port()))
        .timeout(TIMEOUT)
        .circuit_breaker(1, Duration::from_secs(60))
        .test_clock(clock.clone())
        .build_approximate(in_step())
        .unwrap();
    let p = prepare(&b, &Policy::new("f", Quota::per_second(10).fixed_window()));
    for i in 0..500 {
        b.decide(&p, &key(&format!("client-{i}")), cost(1))
            .await
            .unwrap();
    }
    support::eventually("the breaker opens", || b.stats().breaker_open).await;
    assert_eq!(b.stats().keys, 500);
    // Their windows pass: nothing of theirs matters, and nothing is kept for them.
    clock.advance(Duration::from_secs(2));
    support::eventually("the keys swept", || b.stats().keys == 0).await;
}

#[tokio::test]
async fn a_full_key_table_with_redis_away_denies_new_keys_until_a_sweep_makes_room() {
    let clock = TestClock::new();
    let b = RedisBackend::builder()
        .url(format!("redis://127.0.0.1:{}", support::closed_port()))
        .timeout(TIMEOUT)
        .test_clock(clock.clone())
        .build_approximate(in_step().max_keys(100))
        .unwrap();
    let p = prepare(&b, &Policy::new("f", Quota::per_second(10).fixed_window()));
    for i in 0..100 {
        let d = ready_at_once(b.decide(&p, &key(&format!("client-{i}")), cost(1)));
        assert!(d.is_allowed());
    }
    // Full, and Redis out of reach: a new key, which would be decided through Redis, is
    // denied for a second; the keys held keep their counts.
    let d = b.decide(&p, &key("newcomer"), cost(1)).await.unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
    let d = ready_at_once(b.decide(&p, &key("client-7"), cost(1)));
    assert!(d.is_allowed());
    assert_eq!(d.quotas()[0].remaining, 8);
    assert_eq!(b.stats().refused_full, 1);
    // Once their window has passed, the sweep (started at once by the refusal) makes room.
    clock.advance(Duration::from_secs(2));
    let _ = b.decide(&p, &key("newcomer"), cost(1)).await;
    support::eventually("room made", || b.stats().keys < 100).await;
    let d = ready_at_once(b.decide(&p, &key("newcomer"), cost(1)));
    assert!(d.is_allowed(), "{d:?}");
    // A policy dropped takes its keys with it (once no queued work holds them).
    drop(p);
    clock.advance(Duration::from_secs(2));
    support::eventually("the dropped policy's keys gone", || b.stats().keys == 0).await;
}

/// Issue 35, finding 3, in the approximate mode: at `max_keys`, a flood of fresh keys does not
/// keep new clients out: a new key that finds no room is decided through Redis (read, then its
/// increment waited for), as the synchronous variant decides, and not held. Keys held keep
/// their counts; nothing is let through unlimited.
#[tokio::test]
async fn a_full_key_table_decides_new_keys_through_redis() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(TIMEOUT)
        .test_clock(clock.clone())
        .build_approximate(in_step().max_keys(100))
        .unwrap();
    let p = prepare(&b, &Policy::new("f", Quota::per_minute(5).fixed_window()));
    to_window_start(&clock, 60_000_000);
    let spent: Vec<Key> = (0..10).map(|i| key(&format!("spent-{i}"))).collect();
    for k in &spent {
        for _ in 0..5 {
            assert!(b.decide(&p, k, cost(1)).await.unwrap().is_allowed());
        }
    }
    b.flush().await;
    for round in 0..20 {
        for i in 0..100 {
            let d = b
                .decide(&p, &key(&format!("fresh-{round}-{i}")), cost(1))
                .await;
            let d = d.unwrap();
            assert!(d.is_allowed(), "a new client refused: {d:?}");
            assert_eq!(d.quotas()[0].remaining, 4);
        }
        b.flush().await;
        for k in &spent {
            assert!(
                !b.decide(&p, k, cost(1)).await.unwrap().is_allowed(),
                "{k:?}"
            );
        }
    }
    // A key past the cap is limited by Redis's count: four more, then refused.
    let late = key("fresh-19-99");
    for left in (0..4).rev() {
        let d = b.decide(&p, &late, cost(1)).await.unwrap();
        assert!(d.is_allowed(), "{d:?}");
        assert_eq!(d.quotas()[0].remaining, left);
    }
    assert!(!b.decide(&p, &late, cost(1)).await.unwrap().is_allowed());
    let s = b.stats();
    assert_eq!(s.refused_full, 0);
    assert!(s.overflowed >= 1_900, "{s:?}");
    assert_eq!(s.keys, 100, "{s:?}");
    // Redis counted every unit: 10 × 5 spent, 2 000 fresh, 4 more.
    let sum = "local t = 0 for _, k in ipairs(redis.call('KEYS', '*2.a*')) do \
               t = t + tonumber(redis.call('GET', k)) end return t";
    assert_eq!(
        number(&server, &["EVAL", sum, "0"]),
        2_054,
        "{:?}",
        b.stats()
    );
}

/// Both variants on `server`, each under its own prefix and on a test clock aligned on a day
/// (the conformance suite's windows start there).
fn both_variants(
    server: &RedisServer,
    prefix: &str,
) -> [(&'static str, ApproxBackend, TestClock); 2] {
    [
        ("asynchronous", in_step()),
        ("synchronous", Approximate::synchronous()),
    ]
    .map(|(name, mode)| {
        let clock = support::conformance::aligned_test_clock();
        let b = RedisBackend::builder()
            .url(server.url())
            .prefix(format!("{prefix}-{name}"))
            .timeout(TIMEOUT)
            .test_clock(clock.clone())
            .build_approximate(mode)
            .unwrap();
        (name, b, clock)
    })
}

/// Penalties (`block_for`, `Quota::block_for`) on the approximate mode: the meaning they have
/// on every store (`support::conformance::window_blocks`), in both variants.
#[tokio::test]
async fn blocks_approximate() {
    let server = RedisServer::start();
    for (name, b, clock) in both_variants(&server, "blocks") {
        support::conformance::window_blocks(&b, |by| clock.advance(by), name).await;
    }
}

/// A block one instance starts is honoured by the others: written to Redis with the next
/// flush, where each finds it at its next read of the key.
#[tokio::test]
async fn a_block_is_honoured_by_the_fleet() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let policy =
        Policy::new("b", Quota::per_minute(2).fixed_window()).block_for(Duration::from_secs(600));
    let [(a, pa), (b, pb)] = pair(&server, &clock, in_step(), &policy);
    to_window_start(&clock, 60_000_000);
    let k = key("guesser");
    for _ in 0..2 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    let d = a.decide(&pa, &k, cost(1)).await.unwrap();
    assert!(d.is_blocked(), "{d:?}");
    a.flush().await;
    // B has not seen the key: its first decision reads it (and is blind in the asynchronous
    // variant); once read, B refuses for what is left of the block, in the next window too.
    b.decide(&pb, &k, cost(1)).await.unwrap();
    b.flush().await;
    clock.advance(Duration::from_secs(60));
    let d = b.decide(&pb, &k, cost(1)).await.unwrap();
    assert!(d.is_blocked(), "{d:?}");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(540)), "{d:?}");
    let ttl = number(&server, &["PTTL", &counters_like(&server, "*blk")]);
    assert!(
        ttl > 500_000,
        "the block expires with itself in Redis: {ttl}"
    );
    // A reset lifts it, as on every store.
    a.reset(&pa, &k).await.unwrap();
    assert!(!server.cmd(&["KEYS", "*blk"]).contains("blk"));
    assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
}

/// The one Redis key matching `pattern`.
fn counters_like(server: &RedisServer, pattern: &str) -> String {
    let keys = server.cmd(&["KEYS", pattern]);
    let keys: Vec<&str> = keys
        .lines()
        .filter(|l| !l.starts_with(['*', '$']))
        .collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    keys[0].to_owned()
}

/// Concurrent quotas on the approximate mode: decided at the store (a slot cannot be
/// approximate), with the meaning they have on every store (`support::conformance::leases`).
#[tokio::test]
async fn leases_approximate() {
    let server = RedisServer::start();
    for (name, b, clock) in both_variants(&server, "leases") {
        support::conformance::leases(&b, |by| clock.advance(by), name).await;
    }
}

/// A policy of windows and a concurrent quota: the windows decided here, the slot at the
/// store; all or nothing (a request the slot refuses takes no window units), and the slot
/// given back when the request ends.
#[tokio::test]
async fn windows_and_a_slot_together() {
    use tollgate::backend::Mode;
    let server = RedisServer::start();
    let clock = support::conformance::aligned_test_clock();
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(TIMEOUT)
        .test_clock(clock.clone())
        .build_approximate(in_step())
        .unwrap();
    let policy = Policy::new("mixed", Quota::per_minute(5).fixed_window())
        .and(Quota::concurrent(1).lease(Duration::from_secs(60)));
    let p = prepare(&b, &policy);
    let k = key("k");
    let ask = |mode| b.decide_with(&p, &k, cost(1), mode);
    let d = ask(Mode::Hold { lease: 1 }).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.quotas().len(), 2, "both quotas reported: {d:?}");
    assert_eq!(
        (d.quotas()[0].index, d.quotas()[0].remaining),
        (0, 4),
        "{d:?}"
    );
    assert_eq!(
        (d.quotas()[1].index, d.quotas()[1].remaining),
        (1, 0),
        "{d:?}"
    );
    // The slot is held: refused by it, and the window's unit given back.
    let d = ask(Mode::Hold { lease: 2 }).await.unwrap();
    assert!(!d.is_allowed(), "{d:?}");
    assert_eq!(d.quotas()[0].index, 1, "the slot refused: {d:?}");
    // A peek counts its own request: 5 less the one held and the one asked.
    let d = ask(Mode::Peek).await.unwrap();
    assert_eq!(
        d.quotas()[0].remaining,
        3,
        "nothing taken by the refusal: {d:?}"
    );
    // The first request ends: its slot comes back.
    let d = ask(Mode::Release { lease: 1 }).await.unwrap();
    assert_eq!(
        (d.quotas()[0].index, d.quotas()[0].remaining),
        (1, 1),
        "{d:?}"
    );
    let d = ask(Mode::Hold { lease: 3 }).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.quotas()[0].remaining, 3, "{d:?}");
    ask(Mode::Release { lease: 3 }).await.unwrap();
    // A window refusal takes no slot.
    for lease in 4..7 {
        assert!(ask(Mode::Hold { lease }).await.unwrap().is_allowed());
        ask(Mode::Release { lease }).await.unwrap();
    }
    let d = ask(Mode::Hold { lease: 7 }).await.unwrap();
    assert!(!d.is_allowed() && d.quotas()[0].index == 0, "{d:?}");
    let d = ask(Mode::Peek).await;
    assert_eq!(d.unwrap().quotas()[0].remaining, 0);
    // No slot held: the slot's sorted set is empty (and so gone).
    let slots = server.cmd(&["EVAL", "return #redis.call('KEYS', '*c60000x1*')", "0"]);
    assert_eq!(slots.trim(), ":0", "no slot held");
}

/// Through a layer: a request holds its slot while it runs, and gives it back when its
/// response is done, on the approximate mode as on every store.
#[tokio::test]
async fn a_layer_holds_and_gives_back_slots() {
    use axum::body::Body;
    use tower::{Layer, ServiceExt};
    let server = RedisServer::start();
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(TIMEOUT)
        .build_approximate(in_step())
        .unwrap();
    let policy = Policy::new("exports", Quota::per_minute(100).fixed_window())
        .and(Quota::concurrent(1).lease(Duration::from_secs(60)));
    let layer = tollgate::RateLimitLayer::builder()
        .policy(policy)
        .key(tollgate::key::Global)
        .backend(b)
        .build()
        .unwrap();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let svc = layer.layer(tower::service_fn({
        let gate = gate.clone();
        move |req: http::Request<Body>| {
            let gate = gate.clone();
            async move {
                if req.uri().path() == "/slow" {
                    let _ = gate.acquire().await;
                }
                Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
            }
        }
    }));
    let call = |path: &'static str| {
        let svc = svc.clone();
        async move {
            let req = http::Request::builder()
                .uri(path)
                .body(Body::empty())
                .unwrap();
            svc.oneshot(req).await.unwrap().status()
        }
    };
    for _ in 0..3 {
        assert_eq!(call("/fast").await, 200, "the slot comes back after each");
    }
    let slow = tokio::spawn(call("/slow"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        call("/fast").await,
        429,
        "the slot is held while /slow runs"
    );
    gate.add_permits(1);
    assert_eq!(slow.await.unwrap(), 200);
    assert_eq!(call("/fast").await, 200, "given back when /slow was done");
}

/// A process whose approximate mode decides slots through the exact backend is one instance
/// of the fleet, not two: both announce it under one id.
#[tokio::test]
async fn the_exact_backend_for_slots_is_the_same_instance() {
    let server = RedisServer::start();
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(TIMEOUT)
        .build_approximate(Approximate::asynchronous())
        .unwrap();
    let policy = Policy::new("mixed", Quota::per_minute(50).fixed_window())
        .and(Quota::concurrent(2).lease(Duration::from_secs(60)));
    let p = prepare(&b, &policy);
    let lease = tollgate::backend::Mode::Hold { lease: 1 };
    assert!(
        b.decide_with(&p, &key("k"), cost(1), lease)
            .await
            .unwrap()
            .is_allowed()
    );
    // Both have announced (each every second) by now.
    support::eventually("the fleet counted", || b.stats().fleet_size >= 1).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(number(&server, &["ZCARD", "tollgate:fleet"]), 1);
    assert_eq!(b.stats().fleet_size, 1);
}

/// A peek answers what a decision would, with the request counted: the same as the exact mode
/// and every other backend, in both variants, for both windows.
#[tokio::test]
async fn a_peek_is_the_decision_untaken() {
    use tollgate::backend::Mode;
    let server = RedisServer::start();
    for mode in [
        Approximate::asynchronous(),
        in_step(),
        Approximate::synchronous(),
    ] {
        for quota in [
            Quota::per_hour(3).fixed_window(),
            Quota::per_hour(3).sliding_window(),
        ] {
            let clock = TestClock::new();
            let b = instance(&server.url(), &clock, mode);
            let p = prepare(&b, &Policy::new("peek", quota));
            let k = key(&format!("peek-{mode:?}-{quota}"));
            let ctx = format!("{mode:?} {quota}");
            let peek = |c: u32| b.decide_with(&p, &k, cost(c), Mode::Peek);
            let two = peek(2).await.unwrap();
            assert_eq!(two.quotas()[0].remaining, 1, "{ctx}: {two:?}");
            for step in 0..3u32 {
                let peeked = peek(1).await.unwrap();
                let decided = b.decide(&p, &k, cost(1)).await.unwrap();
                assert_eq!(peeked, decided, "{ctx} step {step}");
                assert_eq!(
                    decided.quotas()[0].remaining,
                    2 - step,
                    "{ctx}: {decided:?}"
                );
            }
            let peeked = peek(1).await.unwrap();
            assert!(!peeked.is_allowed(), "{ctx}: {peeked:?}");
            assert_eq!(peeked, b.decide(&p, &k, cost(1)).await.unwrap(), "{ctx}");
        }
    }
}

/// A request that can never fit is reported by the quota it cannot fit alone, as on every
/// store, and takes nothing.
#[tokio::test]
async fn a_never_fitting_request_reports_that_quota_alone() {
    let server = RedisServer::start();
    for mode in [
        Approximate::asynchronous(),
        in_step(),
        Approximate::synchronous(),
    ] {
        let clock = TestClock::new();
        let b = instance(&server.url(), &clock, mode);
        let policy = Policy::new("nf", Quota::per_hour(5).fixed_window())
            .and(Quota::per_minute(3).sliding_window());
        let p = prepare(&b, &policy);
        let k = key(&format!("nf-{mode:?}"));
        assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
        let d = b.decide(&p, &k, cost(4)).await.unwrap();
        assert!(d.never_fits(), "{mode:?}: {d:?}");
        let [q] = d.quotas() else {
            panic!("{mode:?}: {d:?}")
        };
        assert_eq!(
            (q.index, q.limit, q.remaining),
            (1, 3, 2),
            "{mode:?}: {d:?}"
        );
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert_eq!(d.quotas()[1].remaining, 1, "nothing taken: {mode:?}: {d:?}");
    }
}

/// Redis's count of commands it has run (INFO's `total_commands_processed`).
fn commands(server: &RedisServer) -> i64 {
    server
        .cmd(&["INFO", "stats"])
        .lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

/// An instance that believes the fleet has `n` instances.
fn instance_of(url: &str, clock: &TestClock, mode: Approximate, n: u32) -> ApproxBackend {
    RedisBackend::builder()
        .url(url)
        .fleet(Fleet::Size(NonZeroU32::new(n).unwrap()))
        .timeout(TIMEOUT)
        .test_clock(clock.clone())
        .build_approximate(mode.flush_every(Duration::from_micros(FLUSH_US)))
        .unwrap()
}

/// Many keys, each far below its limit on every instance: admitted without a single counter
/// in Redis, whose only work is each flush's read of the announced keys.
#[tokio::test]
async fn keys_far_below_their_limits_cost_redis_nothing() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let instances = fleet(&server.url(), &clock, 3, Approximate::asynchronous()).await;
    // Allowances start once an instance has read the announcements (its first flush).
    for (b, _) in &instances {
        b.flush().await;
    }
    let before = commands(&server);
    let (keys, rounds) = (300, 5);
    for round in 0..rounds {
        for k in 0..keys {
            for (b, p) in &instances {
                let d = b.decide(p, &key(&format!("k{k}")), cost(1)).await.unwrap();
                assert!(d.is_allowed(), "round {round}, key {k}");
            }
        }
        for (b, _) in &instances {
            b.flush().await;
        }
        clock.advance(Duration::from_millis(150));
    }
    let requests = (3 * keys * rounds) as i64;
    // Less the `INFO` that reads the count.
    let used = commands(&server) - before - 1;
    assert!(
        counters(&server, "*").is_empty(),
        "{:?}",
        counters(&server, "*")
    );
    // 3 instances x 5 flushes, one read of the announcements each, and each instance's first
    // read of Redis's clock (where its reading starts).
    assert!(used <= 18, "{used} commands for {requests} requests");
    for (b, _) in &instances {
        let s = b.stats();
        assert_eq!(s.units_sent, 0, "{s:?}");
        assert_eq!(s.allowances_granted, keys as u64, "{s:?}");
        assert_eq!(s.allowances_exhausted + s.announced, 0, "{s:?}");
    }
    eprintln!("{requests} requests, {used} Redis commands");
}

/// A key past one instance's allowance is announced: that instance sends its units and keeps
/// the key in step; another holding units of the key within its allowance sends them at its
/// next decision on it, once it has read the announcement.
#[tokio::test]
async fn a_key_past_its_allowance_is_announced_and_the_others_send_theirs() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    to_window_start(&clock, WINDOW_US);
    // 100/s, a fleet of 3, half a share each: 16 units per key without telling Redis.
    let [(a, pa), (b, pb)] = pair(&server, &clock, Approximate::asynchronous(), &policy());
    // Allowances start once an instance has read the announcements (its first flush).
    a.flush().await;
    b.flush().await;
    let k = key("hot");
    for _ in 0..10 {
        assert!(b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    }
    for _ in 0..16 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    a.flush().await;
    b.flush().await;
    assert!(
        counters(&server, "*hot*").is_empty(),
        "within the allowances: nothing sent"
    );
    // The 17th unit goes past A's allowance.
    assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    a.flush().await;
    let sent = number(&server, &["GET", &counter(&server, "*hot*")]);
    assert_eq!(sent, 17);
    assert_eq!(number(&server, &["XLEN", "tollgate:hot"]), 1);
    assert_eq!(
        (a.stats().allowances_exhausted, a.stats().announced),
        (1, 1)
    );
    // B reads the announcement with its next flush, and sends its 10 with its next decision.
    b.flush().await;
    let d = b.decide(&pb, &k, cost(1)).await.unwrap();
    assert!(d.is_allowed());
    b.flush().await;
    assert_eq!(number(&server, &["GET", &counter(&server, "*hot*")]), 28);
    let s = b.stats();
    assert_eq!(
        (s.allowances_recalled, s.announcements_read),
        (1, 1),
        "{s:?}"
    );
    // And B now decides from the fleet's count: 28 of 100 used.
    clock.advance(Duration::from_micros(SLICE_US));
    b.flush().await;
    let d = b.decide(&pb, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 100 - 29);
    // Other keys keep their allowances.
    assert!(
        b.decide(&pb, &key("cold"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    b.flush().await;
    assert!(counters(&server, "*cold*").is_empty());
}

/// A fleet that grows while it runs: instances that have not counted the newcomers yet keep the
/// larger allowance of a smaller fleet. Three instances counting 1, 2 and 3 flood one key; every
/// admission stays within `L + A` plus the allowances the others believe they have.
#[tokio::test]
async fn a_growing_fleet_stays_within_the_allowances_each_instance_believes() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let believed = [1u32, 2, 3];
    let instances: Vec<_> = believed
        .iter()
        .map(|&n| {
            let b = instance_of(&server.url(), &clock, Approximate::asynchronous(), n);
            let p = prepare(&b, &policy());
            (b, p)
        })
        .collect();
    let log = drive(&instances, &clock, 1_000, 4).await;
    // The others' allowances, at most: 50 (believing 1) and 25 (believing 2).
    let allowance = |n: u32| (f64::from(LIMIT) * 0.5 / f64::from(n)).floor();
    let quiet = allowance(1) + allowance(2);
    let settle = (TIMEOUT.as_micros() as u64 + FLUSH_US).min(SLICE_US / 2);
    let d = SLICE_US + settle + FLUSH_US + 1_000;
    let worst = check_bounds(&log, 3, d, Some(quiet));
    eprintln!(
        "growing fleet: {} admitted in 4 s, worst over-admission {worst:.1} (bound L + A + {quiet})",
        log.admitted.len()
    );
}

/// Where announcements cannot work (here a key of another type holds the stream's name; a
/// Redis before 5.0 or a user without `XADD` / `XREAD` fail the same way), no key is quiet:
/// every admitted unit is sent, as without allowances, since the others could never be told.
#[tokio::test]
async fn without_announcements_every_key_is_kept_in_step() {
    let server = RedisServer::start();
    server.cmd(&["SET", "tollgate:hot", "not a stream"]);
    let clock = TestClock::new();
    let [(a, pa), _] = pair(&server, &clock, Approximate::asynchronous(), &policy());
    a.flush().await;
    for _ in 0..5 {
        assert!(
            a.decide(&pa, &key("k"), cost(1))
                .await
                .unwrap()
                .is_allowed()
        );
    }
    a.flush().await;
    let s = a.stats();
    assert_eq!((s.allowances_granted, s.units_sent), (0, 5), "{s:?}");
    // Once the stream can be used again, keys new to the instance are quiet.
    server.cmd(&["DEL", "tollgate:hot"]);
    a.flush().await;
    assert!(
        a.decide(&pa, &key("new"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    a.flush().await;
    assert_eq!(a.stats().allowances_granted, 1, "{:?}", a.stats());
}

/// A Redis whose memory is full refuses the increments: the units stay counted by the instance
/// that admitted them, so a full Redis never lets more through than the limit (it let every
/// request through: the refused units were counted nowhere).
#[tokio::test]
async fn a_full_redis_never_lets_more_through() {
    for (name, mode) in [
        ("synchronous", Approximate::synchronous()),
        ("asynchronous", Approximate::asynchronous()),
    ] {
        let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
        let reply = server.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
        assert!(reply.contains("OK"), "{reply}");
        let b = RedisBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(2))
            .fleet(Fleet::Size(NonZeroU32::MIN))
            .build_approximate(mode)
            .unwrap();
        let p = prepare(
            &b,
            &Policy::new("full", Quota::per_minute(3).fixed_window()),
        );
        let mut allowed = 0;
        for _ in 0..10 {
            if b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed() {
                allowed += 1;
            }
            // Each increment sent, and refused, before the next decision.
            b.flush().await;
        }
        assert_eq!(allowed, 3, "{name}: {:?}", b.stats());
        assert!(b.stats().units_refused >= 1, "{name}: {:?}", b.stats());
    }
}

/// Settling after the response, as on every store: a debit counts into the current window
/// (past the limit, into debt), a refund gives back the units of the window that counted them
/// (nothing once it has passed), on this instance at once and, through Redis, on the others.
#[tokio::test]
async fn settlements_go_into_the_counts_sent() {
    use tollgate::backend::Mode;
    for (name, mode) in [
        ("synchronous", Approximate::synchronous()),
        ("asynchronous", in_step()),
    ] {
        let server = RedisServer::start();
        let clock = TestClock::new();
        to_window_start(&clock, WINDOW_US);
        let (a, b) = (
            instance(&server.url(), &clock, mode),
            instance(&server.url(), &clock, mode),
        );
        let policy = Policy::new("settled", Quota::per_second(10).fixed_window());
        let (pa, pb) = (prepare(&a, &policy), prepare(&b, &policy));
        let k = key("k");
        let refund = |ago_ms| Mode::Refund {
            admitted_ago: Duration::from_millis(ago_ms),
        };
        let remaining = |d: tollgate::backend::Decision| d.quotas()[0].remaining;
        let d = a.decide(&pa, &k, cost(4)).await.unwrap();
        assert_eq!(remaining(d), 6, "{name}");
        // Sent, then given back: Redis's counter too.
        a.flush().await;
        let d = a.decide_with(&pa, &k, cost(4), refund(0)).await.unwrap();
        assert_eq!(remaining(d), 10, "{name}: the refund at once here");
        let d = a.decide_with(&pa, &k, cost(12), Mode::Debit).await.unwrap();
        assert_eq!(remaining(d), 0, "{name}: in debt");
        assert!(
            !a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed(),
            "{name}"
        );
        a.flush().await;
        // The other instance reads 12 of 10.
        b.decide(&pb, &k, cost(1)).await.unwrap();
        b.flush().await;
        let d = b.decide(&pb, &k, cost(1)).await.unwrap();
        assert!(!d.is_allowed(), "{name}: the debt is the fleet's: {d:?}");
        // The next window: a refund of the last one's units gives nothing back.
        clock.advance(Duration::from_micros(WINDOW_US));
        let d = a.decide(&pa, &k, cost(9)).await.unwrap();
        assert_eq!(remaining(d), 1, "{name}");
        let d = a.decide_with(&pa, &k, cost(5), refund(1500)).await.unwrap();
        assert_eq!(remaining(d), 1, "{name}: nothing from a passed window");
        let d = a.decide_with(&pa, &k, cost(5), refund(0)).await.unwrap();
        assert_eq!(remaining(d), 6, "{name}: from this window");
        let d = a.decide_with(&pa, &k, cost(20), refund(0)).await.unwrap();
        assert_eq!(remaining(d), 10, "{name}: never more than counted here");
        a.flush().await;
        clock.advance(Duration::from_millis(100));
        // The fleet's counter went down too, and not below zero.
        b.flush().await;
        let d = b.decide(&pb, &k, cost(10)).await.unwrap();
        assert!(d.is_allowed(), "{name}: {d:?}");
    }
}

/// The brute-force recipe on the approximate mode: only failed logins count (successes are
/// refunded after the response), behind the layer.
#[tokio::test]
async fn only_failures_count_behind_the_layer() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU16, Ordering};
    use tollgate::settle::ChargeWhen;
    use tower::{Layer, ServiceExt};
    let server = RedisServer::start();
    let backend = RedisBackend::builder()
        .url(server.url())
        .timeout(TIMEOUT)
        .build_approximate(Approximate::synchronous())
        .unwrap();
    let policy = Policy::new("logins", Quota::per_minute(2).fixed_window())
        .charge_when(ChargeWhen::status([401]));
    let layer = tollgate::RateLimitLayer::builder()
        .key(tollgate::key::Global)
        .backend(backend)
        .policy(policy)
        .build()
        .unwrap();
    let answer = Arc::new(AtomicU16::new(200));
    let status = answer.clone();
    let svc = layer.layer(tower::service_fn(move |_req: http::Request<String>| {
        let status = status.load(Ordering::Relaxed);
        async move {
            let mut res = http::Response::new(axum::body::Body::empty());
            *res.status_mut() = http::StatusCode::from_u16(status).unwrap();
            Ok::<_, std::convert::Infallible>(res)
        }
    }));
    let mut seen = Vec::new();
    for answer_with in [200, 200, 200, 200, 401, 401, 401, 200] {
        answer.store(answer_with, Ordering::Relaxed);
        let res = svc
            .clone()
            .oneshot(http::Request::new(String::new()))
            .await
            .unwrap();
        seen.push(res.status().as_u16());
    }
    assert_eq!(seen, [200, 200, 200, 200, 401, 401, 429, 429]);
}

/// Admissions, debits and refunds on one key from tasks running at once, while the background
/// task flushes: whatever the interleaving, each request's units come back, so Redis's counter
/// ends at exactly zero (never below: a refund is never sent for more than was counted) and
/// the key has its whole limit again, here and on another instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_settlements_leave_the_counts_exact() {
    use tollgate::backend::Mode;
    let server = RedisServer::start();
    let clock = TestClock::new();
    to_window_start(&clock, WINDOW_US);
    let b = instance(&server.url(), &clock, in_step());
    let policy = Policy::new("conc", Quota::per_second(100_000).fixed_window());
    let p = prepare(&b, &policy);
    let refund = Mode::Refund {
        admitted_ago: Duration::ZERO,
    };
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (b, p) = (b.clone(), p.clone());
            tokio::spawn(async move {
                for i in 0..200 {
                    let k = key("k");
                    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
                    b.decide_with(&p, &k, cost(2), Mode::Debit).await.unwrap();
                    b.decide_with(&p, &k, cost(3), refund).await.unwrap();
                    if i % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    b.flush().await;
    b.flush().await;
    // The sum of the policy's counters in Redis.
    let sum = server.cmd(&[
        "EVAL",
        "local s = 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do \
         if redis.call('TYPE', k).ok == 'string' then s = s + tonumber(redis.call('GET', k)) end \
         end return s",
        "0",
        "*conc*",
    ]);
    assert_eq!(sum.trim(), ":0", "Redis's count");
    let whole = cost(100_000);
    let d = b
        .decide_with(&p, &key("k"), whole, Mode::Peek)
        .await
        .unwrap();
    assert!(d.is_allowed(), "here: {d:?}");
    let other = instance(&server.url(), &clock, Approximate::synchronous());
    let po = prepare(&other, &policy);
    let d = other.decide(&po, &key("k"), whole).await.unwrap();
    assert!(d.is_allowed(), "on another instance: {d:?}");
}

/// A changed limit keeps the fleet's counts (`on_change = "keep"`, the one strategy the
/// approximate mode takes: the others are refused when the policy is prepared), and applies to
/// them at once: 5 spent of 100 per hour (fixed) or per minute (sliding), then 90 leaves 84
/// after one more, 200 leaves 194. A changed period or resolution counts afresh.
#[tokio::test]
async fn a_changed_limit_keeps_the_fleets_counts() {
    use tollgate::OnChange;
    let server = RedisServer::start();
    let hour = Duration::from_secs(3600);
    let min = Duration::from_secs(60);
    for (name, b, _clock) in both_variants(&server, "changes") {
        let cases = [
            (
                Quota::new(100, hour).fixed_window(),
                Quota::new(90, hour).fixed_window(),
                84,
            ),
            (
                Quota::new(100, hour).fixed_window(),
                Quota::new(200, hour).fixed_window(),
                194,
            ),
            (
                Quota::new(100, min).sliding_window(),
                Quota::new(90, min).sliding_window(),
                84,
            ),
            // Another window's shape: fresh counters.
            (
                Quota::new(100, hour).fixed_window(),
                Quota::new(100, min).fixed_window(),
                99,
            ),
        ];
        for (i, (before, after, left)) in cases.into_iter().enumerate() {
            let policy = format!("change-{i}");
            let old = prepare(&b, &Policy::new(policy.as_str(), before));
            let k = key("spender");
            assert!(b.decide(&old, &k, cost(5)).await.unwrap().is_allowed());
            // No flush: the new policy counts from this instance's counts at once.
            let new = prepare(&b, &Policy::new(policy.as_str(), after));
            let d = b.decide(&new, &k, cost(1)).await.unwrap();
            assert_eq!(d.quotas()[0].remaining, left, "{name} case {i}: {d:?}");
            drop(old);
        }
        let reset =
            Policy::new("reset", Quota::per_minute(10).fixed_window()).on_change(OnChange::Reset);
        let err = b.prepare(&reset, &reset.validate().unwrap()).unwrap_err();
        assert!(err.to_string().contains("keep"), "{err}");
    }
}
