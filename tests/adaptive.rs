//! Adaptive concurrency limits in a deterministic simulation: tokio's paused clock, a simulated
//! upstream (workers, a service time with spread, an unbounded queue in front of them, as a
//! real backend's), and open-loop arrivals at a fixed rate. Each scenario asserts ranges, per
//! phase, on what the limit lets through.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tollgate::adaptive::{AdaptiveLimit, Aimd, Algorithm, Gradient, Window};

/// xorshift64*: the simulation's spread, the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A simulated upstream: `workers` requests served at once, each taking the service time
/// (`service_ms` ± 50 %, uniformly), the rest waiting in line. With `fail_over`, a request
/// that finds more than that many in the upstream fails at once instead (an upstream that
/// answers 503 when overloaded).
struct Upstream {
    workers: Arc<Semaphore>,
    service_us: AtomicU64,
    rng: Mutex<Rng>,
    inside: AtomicU32,
    fail_over: Option<u32>,
    /// One in this many requests is answered in 1 ms (a cache hit: a lucky fast sample).
    lucky_every: u32,
    /// The service time's spread: uniformly within ± this share of it.
    spread: f64,
    count: AtomicU32,
}

impl Upstream {
    fn new(workers: u32, service_ms: u64) -> Arc<Self> {
        Arc::new(Upstream {
            workers: Arc::new(Semaphore::new(workers as usize)),
            service_us: AtomicU64::new(service_ms * 1000),
            rng: Mutex::new(Rng(0x9E37_79B9_7F4A_7C15)),
            inside: AtomicU32::new(0),
            fail_over: None,
            lucky_every: 0,
            spread: 0.5,
            count: AtomicU32::new(0),
        })
    }

    /// Serves one request: `Err` for an overload failure.
    async fn call(&self) -> Result<(), ()> {
        let inside = self.inside.fetch_add(1, Ordering::Relaxed) + 1;
        struct Out<'a>(&'a AtomicU32);
        impl Drop for Out<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let _out = Out(&self.inside);
        if self.fail_over.is_some_and(|c| inside > c) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            return Err(());
        }
        let n = self.count.fetch_add(1, Ordering::Relaxed);
        if self.lucky_every > 0 && n.is_multiple_of(self.lucky_every) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            return Ok(());
        }
        let _worker = self.workers.acquire().await.unwrap();
        let spread = 1.0 - self.spread + 2.0 * self.spread * self.rng.lock().unwrap().next();
        let us = self.service_us.load(Ordering::Relaxed) as f64 * spread;
        tokio::time::sleep(Duration::from_micros(us as u64)).await;
        Ok(())
    }

    /// Takes `n` workers away (they leave once free).
    fn remove_workers(self: &Arc<Self>, n: u32) {
        let workers = self.workers.clone();
        tokio::spawn(async move { workers.acquire_many(n).await.unwrap().forget() });
    }

    fn add_workers(&self, n: u32) {
        self.workers.add_permits(n as usize);
    }
}

/// One second of the run.
#[derive(Debug, Default, Clone)]
struct Second {
    /// Answered 2xx within the SLO.
    good: u32,
    rejected: u32,
    failed: u32,
    latencies_us: Vec<u64>,
    limit: u32,
    /// Requests of the critical partition sent, and answered within the SLO.
    critical: u32,
    critical_good: u32,
}

impl Second {
    fn p99_ms(&self) -> f64 {
        let mut l = self.latencies_us.clone();
        if l.is_empty() {
            return 0.0;
        }
        l.sort_unstable();
        l[(l.len() * 99 / 100).min(l.len() - 1)] as f64 / 1000.0
    }
}

/// What a phase does to the upstream when it starts.
type Change = Box<dyn Fn(&Arc<Upstream>)>;

/// A phase: from `at` seconds, `rate` arrivals a second, and what to do to the upstream then.
struct Phase {
    at: u64,
    rate: u32,
    change: Option<Change>,
}

fn phase(at: u64, rate: u32) -> Phase {
    Phase {
        at,
        rate,
        change: None,
    }
}

/// Runs `phases` for `secs` seconds of simulated time with `limit` (`None`: no limit) in front
/// of `upstream`, a client timeout of 1 s, an SLO of `slo_ms`; per second's numbers.
async fn run(
    limit: Option<AdaptiveLimit>,
    upstream: Arc<Upstream>,
    phases: Vec<Phase>,
    secs: u64,
    slo_ms: u64,
) -> Vec<Second> {
    run_split(limit, upstream, phases, secs, slo_ms, 0).await
}

/// [`run`], every `critical_every`-th request in the `critical` partition (0: none).
async fn run_split(
    limit: Option<AdaptiveLimit>,
    upstream: Arc<Upstream>,
    phases: Vec<Phase>,
    secs: u64,
    slo_ms: u64,
    critical_every: u64,
) -> Vec<Second> {
    run_with(limit, upstream, phases, secs, slo_ms, critical_every, None).await
}

/// [`run_split`], a request over the limit waiting up to `queue` for a slot when given (the
/// limit must queue); latency is from arrival, waiting included.
async fn run_with(
    limit: Option<AdaptiveLimit>,
    upstream: Arc<Upstream>,
    phases: Vec<Phase>,
    secs: u64,
    slo_ms: u64,
    critical_every: u64,
    queue: Option<Duration>,
) -> Vec<Second> {
    let mut n = 0u64;
    let stats = Arc::new(Mutex::new(vec![Second::default(); secs as usize]));
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut next = start;
    let mut phases = phases.into_iter().peekable();
    let mut rate = 1;
    while next < end {
        let elapsed = next - start;
        while phases
            .peek()
            .is_some_and(|p| Duration::from_secs(p.at) <= elapsed)
        {
            let p = phases.next().unwrap();
            rate = p.rate;
            if let Some(change) = &p.change {
                change(&upstream);
            }
        }
        tokio::time::sleep_until(next).await;
        let second = (elapsed.as_secs() as usize).min(secs as usize - 1);
        if let Some(limit) = &limit {
            stats.lock().unwrap()[second].limit = limit.limit();
        }
        let (limit, upstream, stats) = (limit.clone(), upstream.clone(), stats.clone());
        n += 1;
        let critical = critical_every > 0 && n.is_multiple_of(critical_every);
        if critical {
            stats.lock().unwrap()[second].critical += 1;
        }
        tokio::spawn(async move {
            let t0 = Instant::now();
            let permit = match &limit {
                Some(l) => match match (queue, critical) {
                    (Some(wait), true) => l.acquire_in("critical", wait).await,
                    (Some(wait), false) => l.acquire(wait).await,
                    (None, true) => l.try_acquire_in("critical"),
                    (None, false) => l.try_acquire(),
                } {
                    Some(p) => Some(p),
                    None => {
                        stats.lock().unwrap()[second].rejected += 1;
                        return;
                    }
                },
                None => None,
            };
            let answer = tokio::time::timeout(Duration::from_secs(1), upstream.call()).await;
            let took = t0.elapsed();
            let done = ((start.elapsed().as_secs()) as usize).min(stats.lock().unwrap().len() - 1);
            match answer {
                Ok(Ok(())) => {
                    if let Some(p) = permit {
                        p.success();
                    }
                    let mut s = stats.lock().unwrap();
                    s[done].latencies_us.push(took.as_micros() as u64);
                    if took <= Duration::from_millis(slo_ms) {
                        s[done].good += 1;
                        if critical {
                            s[second].critical_good += 1;
                        }
                    }
                }
                _ => {
                    if let Some(p) = permit {
                        p.dropped();
                    }
                    stats.lock().unwrap()[done].failed += 1;
                }
            }
        });
        next += Duration::from_secs_f64(1.0 / f64::from(rate));
    }
    // Let the last requests end.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Arc::try_unwrap(stats)
        .map(|m| m.into_inner().unwrap())
        .unwrap_or_else(|a| a.lock().unwrap().clone())
}

fn gradient_limit() -> AdaptiveLimit {
    AdaptiveLimit::builder()
        .initial(10)
        .range(2, 500)
        .build()
        .unwrap()
}

/// The worst of seconds `from..to`: least goodput, highest p99, most rejections.
fn worst(s: &[Second], from: usize, to: usize) -> (u32, f64, u32) {
    let part = &s[from..to];
    (
        part.iter().map(|x| x.good).min().unwrap(),
        part.iter().map(Second::p99_ms).fold(0.0, f64::max),
        part.iter().map(|x| x.rejected).max().unwrap(),
    )
}

fn show(s: &[Second]) -> String {
    s.iter()
        .enumerate()
        .map(|(i, x)| {
            format!(
                "{i}s good {} rej {} fail {} p99 {:.0} ms limit {}\n",
                x.good,
                x.rejected,
                x.failed,
                x.p99_ms(),
                x.limit
            )
        })
        .collect()
}

/// Steady overload, 1.5× capacity (16 workers of 20 ms: 800 a second): the limit holds the
/// goodput near capacity and the latency near the no-load one, where no limit lets the queue
/// grow until every request times out.
#[tokio::test(start_paused = true)]
async fn steady_overload_keeps_goodput_and_latency() {
    let s = run(
        Some(gradient_limit()),
        Upstream::new(16, 20),
        vec![phase(0, 1200)],
        30,
        80,
    )
    .await;
    let (good, p99, _) = worst(&s, 10, 30);
    assert!(good >= 720, "goodput {good} of 800\n{}", show(&s));
    assert!(
        p99 <= 60.0,
        "p99 {p99} ms (no-load p99 30 ms)\n{}",
        show(&s)
    );
    // Without a limit the queue grows without end.
    let none = run(None, Upstream::new(16, 20), vec![phase(0, 1200)], 30, 80).await;
    let (good, _, _) = worst(&none, 20, 30);
    assert!(good < 100, "no limit: goodput {good}\n{}", show(&none));
}

/// A minute of steady overload (1.5×): the limit comes to rest below the tolerance, grown by
/// the headroom left rather than by a full √limit, and it does not drift upward with a
/// baseline that creeps while the latency sits in the tolerance's upper half (it would carry
/// the limit, and the queue, up with it: 20 to 27 over 20 s in the benchmark).
#[tokio::test(start_paused = true)]
async fn the_limit_comes_to_rest_under_steady_overload() {
    let s = run(
        Some(gradient_limit()),
        Upstream::new(16, 20),
        vec![phase(0, 1200)],
        60,
        80,
    )
    .await;
    let mean_limit = |from: usize, to: usize| {
        s[from..to].iter().map(|x| f64::from(x.limit)).sum::<f64>() / (to - from) as f64
    };
    let (early, late) = (mean_limit(10, 20), mean_limit(50, 60));
    assert!(
        late <= early * 1.1 && late <= 22.0,
        "limit {early:.1} at 10–20 s, {late:.1} at 50–60 s\n{}",
        show(&s)
    );
    // Resting below the tolerance, not sawing above it by √limit: p99 38 ms here, 42 with a
    // full √limit step whenever the latency is within the tolerance (the benchmark: 39 and 46).
    let (good, p99, _) = worst(&s, 10, 60);
    assert!(good >= 720 && p99 <= 40.0, "{good}, {p99} ms\n{}", show(&s));
}

/// Mean goodput a second, and the highest p99 (ms), over seconds `from..to`.
fn mean(s: &[Second], from: usize, to: usize) -> (f64, f64) {
    let part = &s[from..to];
    (
        part.iter().map(|x| f64::from(x.good)).sum::<f64>() / part.len() as f64,
        part.iter().map(Second::p99_ms).fold(0.0, f64::max),
    )
}

/// A short queue under overload (2× capacity, the gradient limit, an SLO of 80 ms from
/// arrival): refusing at once, or waiting up to 50 ms for a slot in FIFO or LIFO order. LIFO
/// serves fresh requests and lets the oldest reach their deadline, so its goodput and p99 stay
/// near refusing's; FIFO makes every admitted request wait the whole queue. The evidence
/// behind the default (refuse at once) and behind LIFO for a queue: `docs/adaptive.md`.
#[tokio::test(start_paused = true)]
async fn a_short_queue_lifo_against_fifo() {
    use tollgate::adaptive::QueueOrder;
    let limit = |order: Option<QueueOrder>| {
        let b = AdaptiveLimit::builder().initial(10).range(2, 500);
        match order {
            Some(o) => b.queue(64, o),
            None => b,
        }
        .build()
        .unwrap()
    };
    let mut rows = Vec::new();
    for (name, order) in [
        ("refuse", None),
        ("fifo", Some(QueueOrder::Fifo)),
        ("lifo", Some(QueueOrder::Lifo)),
    ] {
        let queue = order.map(|_| Duration::from_millis(50));
        let s = run_with(
            Some(limit(order)),
            Upstream::new(16, 20),
            vec![phase(0, 1600)],
            30,
            80,
            0,
            queue,
        )
        .await;
        let (good, p99) = mean(&s, 10, 30);
        eprintln!("{name}: goodput {good:.0}/s of 800, worst p99 {p99:.1} ms");
        rows.push((name, good, p99, s));
    }
    let (refuse, fifo, lifo) = (&rows[0], &rows[1], &rows[2]);
    assert!(
        refuse.1 >= 720.0,
        "refuse {}
{}",
        refuse.1,
        show(&refuse.3)
    );
    assert!(
        lifo.1 >= 0.95 * refuse.1 && lifo.1 > fifo.1 + 50.0 && lifo.2 < fifo.2,
        "lifo {:.0}/s p99 {:.1} ms, fifo {:.0}/s p99 {:.1} ms",
        lifo.1,
        lifo.2,
        fifo.1,
        fifo.2
    );
}

/// The capacity halved for 20 s, then restored: goodput near each phase's capacity from 10 s
/// after each change, and latency near the no-load one.
#[tokio::test(start_paused = true)]
async fn capacity_halved_then_restored() {
    let mut halve = phase(20, 1200);
    halve.change = Some(Box::new(|u| u.remove_workers(8)));
    let mut restore = phase(40, 1200);
    restore.change = Some(Box::new(|u| u.add_workers(8)));
    let s = run(
        Some(gradient_limit()),
        Upstream::new(16, 20),
        vec![phase(0, 1200), halve, restore],
        60,
        80,
    )
    .await;
    let text = show(&s);
    let (good, p99, _) = worst(&s, 10, 20);
    assert!(
        good >= 720 && p99 <= 60.0,
        "before: {good}, {p99} ms\n{text}"
    );
    let (good, p99, _) = worst(&s, 30, 40);
    assert!(
        good >= 360 && p99 <= 60.0,
        "halved: {good} of 400, {p99} ms\n{text}"
    );
    let (good, p99, _) = worst(&s, 50, 60);
    assert!(
        good >= 720 && p99 <= 60.0,
        "restored: {good}, {p99} ms\n{text}"
    );
}

/// The upstream of issue 55's finding 2: 8 workers of 15–25 ms (no-load p99 25 ms).
fn eight_workers() -> Arc<Upstream> {
    let mut upstream = Upstream::new(8, 20);
    Arc::get_mut(&mut upstream).unwrap().spread = 0.25;
    upstream
}

/// The mean latency (ms) of the answers of seconds `from..to`.
fn mean_latency_ms(s: &[Second], from: usize, to: usize) -> f64 {
    let all: Vec<u64> = s[from..to]
        .iter()
        .flat_map(|x| x.latencies_us.iter().copied())
        .collect();
    all.iter().sum::<u64>() as f64 / all.len().max(1) as f64 / 1000.0
}

/// The mean limit over seconds `from..to`.
fn mean_limit(s: &[Second], from: usize, to: usize) -> f64 {
    s[from..to].iter().map(|x| f64::from(x.limit)).sum::<f64>() / (to - from) as f64
}

/// A replica restarted into a busy fleet: the builder's defaults (initial 20) in front of a
/// service that holds 8 at once, at 1.5× its capacity from the first request. The limit
/// starts above capacity, so every window queues and the first window's latency is not the
/// no-load one; the probe (a window at a lower limit now and then) finds the baseline, and the
/// limit comes to rest near `tolerance ×` the capacity with the latency near the no-load one.
/// Before the probe: the limit rested at 17–19 for 120 s, latency 2.2× the no-load.
#[tokio::test(start_paused = true)]
async fn a_limit_started_above_capacity_under_load_finds_the_baseline() {
    let limit = AdaptiveLimit::builder().build().unwrap();
    let s = run(Some(limit), eight_workers(), vec![phase(0, 600)], 120, 80).await;
    let text = show(&s);
    let (good, p99, _) = worst(&s, 10, 120);
    let (mean_good, _) = mean(&s, 10, 120);
    let rest = mean_limit(&s, 10, 120);
    eprintln!("rest {rest:.1}, mean good {mean_good:.0}, worst good {good}, worst p99 {p99:.1}");
    assert!(rest <= 11.5, "the limit rests at {rest:.1}\n{text}");
    // The mean latency about `tolerance ×` the no-load one (20 ms), as the docs say (was
    // 2.2×), the p99 within 1.6× the no-load p99 of 25 ms (was 2×: 47–52 ms); a probe's second
    // keeps 0.85 of the capacity, the mean 0.95.
    let latency = mean_latency_ms(&s, 10, 120);
    eprintln!("mean latency {latency:.1} ms");
    assert!(
        latency <= 20.0 * 1.4,
        "mean latency {latency:.1} ms\n{text}"
    );
    assert!(p99 <= 40.0, "{p99} ms\n{text}");
    assert!(
        mean_good >= 380.0 && good >= 340,
        "{mean_good} and {good} of 400\n{text}"
    );
}

/// The same service, its capacity halved (8 workers to 4) after a minute at 1.5× its first
/// capacity (3× the halved one): the limit follows it down to near `tolerance ×` 4, the
/// latency near the no-load one.
#[tokio::test(start_paused = true)]
async fn a_limit_follows_a_halved_capacity_down() {
    let mut halve = phase(60, 600);
    halve.change = Some(Box::new(|u| u.remove_workers(4)));
    let limit = AdaptiveLimit::builder().build().unwrap();
    let s = run(
        Some(limit),
        eight_workers(),
        vec![phase(0, 600), halve],
        120,
        80,
    )
    .await;
    let text = show(&s);
    let before = mean_limit(&s, 20, 60);
    let after = mean_limit(&s, 80, 120);
    let (good, p99, _) = worst(&s, 80, 120);
    let (mean_good, _) = mean(&s, 80, 120);
    eprintln!(
        "before {before:.1}, after {after:.1}, mean good {mean_good:.0}, worst good {good}, worst p99 {p99:.1}"
    );
    assert!(
        before <= 11.5,
        "the limit rests at {before:.1} for 8 workers\n{text}"
    );
    assert!(
        after <= 6.0,
        "the limit rests at {after:.1} for 4 workers\n{text}"
    );
    assert!(p99 <= 45.0, "{p99} ms\n{text}");
    assert!(
        mean_good >= 190.0 && good >= 170,
        "{mean_good} and {good} of 200\n{text}"
    );
}

/// A limit built a second before its traffic, then 3× overload at once with a tenth of it
/// critical (a server started, then loaded, as in the benchmark): goodput near capacity from
/// the load's second second (0.9 in every second, 0.95 on average, a probe of the baseline
/// included), and the limit not below 14 (the capacity is 16) once it climbed, but for the
/// probes' windows at half of it.
#[tokio::test(start_paused = true)]
async fn a_cold_start_under_overload_climbs_to_capacity() {
    let limit = AdaptiveLimit::builder()
        .initial(10)
        .range(2, 500)
        .partition("critical", 0.8)
        .build()
        .unwrap();
    let s = run_split(
        Some(limit.clone()),
        Upstream::new(16, 20),
        vec![phase(0, 1), phase(1, 2400)],
        16,
        80,
        10,
    )
    .await;
    let text = show(&s);
    let (good, p99, _) = worst(&s, 3, 16);
    let (mean_good, _) = mean(&s, 3, 16);
    assert!(
        mean_good >= 760.0 && good >= 720 && p99 <= 60.0,
        "{mean_good}, {good} of 800, {p99} ms\n{text}"
    );
    // The limit as it was at each second's last arrival: under 14 only where that arrival
    // fell in a probe's windows (half the limit for about 150 ms, at most twice in these
    // seconds), and 16 or more on average.
    let low = s[2..16].iter().filter(|x| x.limit < 14).count();
    assert!(
        low <= 2 && mean_limit(&s, 2, 16) >= 16.0,
        "the limit fell under overload\n{text}"
    );
}

/// Threads sampling at once, with quiet spells between bursts (so windows start at their first
/// sample as well as where the last closed): every sample is counted in exactly one window.
#[test]
fn samples_from_threads_at_once_land_in_exactly_one_window() {
    struct Record(Arc<Mutex<Vec<Window>>>);
    impl Algorithm for Record {
        fn update(&mut self, limit: f64, w: &Window) -> f64 {
            self.0.lock().unwrap().push(*w);
            limit
        }
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let limit = AdaptiveLimit::builder()
        .initial(64)
        .range(64, 64)
        .min_samples(1)
        .window(Duration::from_micros(200), Duration::from_millis(1))
        .algorithm(Record(seen.clone()))
        .build()
        .unwrap();
    let quiet = || std::thread::sleep(Duration::from_millis(2));
    let (threads, each) = (4u32, 4_000u32);
    std::thread::scope(|s| {
        for _ in 0..threads {
            let limit = limit.clone();
            s.spawn(move || {
                for i in 0..each {
                    limit.try_acquire().expect("under the limit").success();
                    if i % 500 == 499 {
                        quiet();
                    }
                }
            });
        }
    });
    // The open window, after a quiet spell: a sample closes it if it holds any, and starts a
    // new one if not, which a second sample a window's length later closes.
    let windows = || seen.lock().unwrap().len();
    let before = windows();
    quiet();
    limit.try_acquire().unwrap().success();
    let mut extra = 1;
    if windows() == before {
        quiet();
        limit.try_acquire().unwrap().success();
        extra = 2;
    }
    let seen = seen.lock().unwrap();
    let counted: u32 = seen.iter().map(|w| w.samples).sum();
    assert_eq!(counted, threads * each + extra, "{} windows", seen.len());
    assert!(seen.len() > 8, "{} windows", seen.len());
}

/// A window starts with its first sample. Traffic that begins after a quiet spell (the
/// window's end long passed) is gathered for a whole `min_window`, not cut at the
/// `min_samples`-th answer: those are the first burst's fastest, and their mean, taken as the
/// baseline, is below what a request costs, so the limit would shrink while nothing queues
/// (the benchmark's first seconds at 3× did that: a baseline of 15.8 ms for requests of 20).
#[tokio::test(start_paused = true)]
async fn a_window_after_a_quiet_spell_is_a_whole_window() {
    struct Record(Arc<Mutex<Vec<Window>>>);
    impl Algorithm for Record {
        fn update(&mut self, limit: f64, w: &Window) -> f64 {
            self.0.lock().unwrap().push(*w);
            limit
        }
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let limit = AdaptiveLimit::builder()
        .initial(50)
        .range(1, 100)
        .algorithm(Record(seen.clone()))
        .build()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A request every millisecond for 300 ms, each answered in 10 ms.
    let mut tasks = Vec::new();
    for _ in 0..300 {
        let permit = limit.try_acquire().expect("under the limit");
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            permit.success();
        }));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seen = seen.lock().unwrap();
    let first = seen.first().expect("a window closed");
    assert!(
        first.samples >= 90,
        "the first window closed after {} samples: {seen:?}",
        first.samples
    );
}

/// Low load (0.3× capacity): nothing refused, and the limit does not run away while the
/// service is app-limited.
#[tokio::test(start_paused = true)]
async fn low_load_refuses_nothing_and_the_limit_stays_put() {
    let limit = gradient_limit();
    let s = run(
        Some(limit.clone()),
        Upstream::new(16, 20),
        vec![phase(0, 240)],
        30,
        80,
    )
    .await;
    let rejected: u32 = s.iter().map(|x| x.rejected).sum();
    assert_eq!(rejected, 0, "{}", show(&s));
    assert!(
        limit.limit() <= 20,
        "limit {} at low load\n{}",
        limit.limit(),
        show(&s)
    );
}

/// A latency spike without a capacity change: the service takes twice as long per request
/// from 20 s. The limit finds the new baseline instead of shrinking to its floor for good:
/// goodput back near the new capacity (400 a second).
#[tokio::test(start_paused = true)]
async fn a_latency_spike_finds_a_new_baseline() {
    let mut slower = phase(20, 1200);
    slower.change = Some(Box::new(|u| u.service_us.store(40_000, Ordering::Relaxed)));
    let s = run(
        Some(gradient_limit()),
        Upstream::new(16, 20),
        vec![phase(0, 1200), slower],
        60,
        160,
    )
    .await;
    let (good, _, _) = worst(&s, 40, 60);
    assert!(good >= 340, "goodput {good} of 400\n{}", show(&s));
}

/// One request in 100 answered in 1 ms (a cache hit): the baseline is a window's mean, not
/// one lucky sample, so the limit does not collapse.
#[tokio::test(start_paused = true)]
async fn a_lucky_fast_sample_does_not_poison_the_baseline() {
    let mut upstream = Upstream::new(16, 20);
    Arc::get_mut(&mut upstream).unwrap().lucky_every = 100;
    let s = run(
        Some(gradient_limit()),
        upstream,
        vec![phase(0, 1200)],
        30,
        80,
    )
    .await;
    let (good, _, _) = worst(&s, 10, 30);
    assert!(good >= 720, "goodput {good}\n{}", show(&s));
}

/// Every request a drop (an upstream that is down, every call timing out): the default
/// gradient shrinks the limit to its minimum, where a window of drops only used to leave it
/// where it was (its mean latency, of no sample, was 0). Drops that take a second each (client
/// timeouts) shrink it too, in windows of their length.
#[tokio::test(start_paused = true)]
async fn a_window_of_drops_only_shrinks_the_gradient_limit() {
    for (took, secs, below) in [(10u64, 2u64, 10u32), (1000, 20, 10)] {
        let limit = AdaptiveLimit::builder()
            .initial(50)
            .range(1, 50)
            .build()
            .unwrap();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(secs) {
            let permits: Vec<_> = std::iter::from_fn(|| limit.try_acquire()).collect();
            assert!(!permits.is_empty());
            tokio::time::sleep(Duration::from_millis(took)).await;
            for p in permits {
                p.dropped();
            }
        }
        assert!(
            limit.limit() < below,
            "drops of {took} ms for {secs} s: limit {}",
            limit.limit()
        );
        // And on to the minimum.
        for _ in 0..200 {
            let permits: Vec<_> = std::iter::from_fn(|| limit.try_acquire()).collect();
            tokio::time::sleep(Duration::from_millis(took)).await;
            permits.into_iter().for_each(|p| p.dropped());
        }
        assert_eq!(limit.limit(), 1, "drops of {took} ms");
    }
}

/// Errors as drops: an upstream that fails at once what it cannot serve (16 at a time, no
/// queue). AIMD finds the capacity from the failures: most requests admitted succeed.
#[tokio::test(start_paused = true)]
async fn errors_are_drops_for_aimd() {
    let mut upstream = Upstream::new(16, 20);
    Arc::get_mut(&mut upstream).unwrap().fail_over = Some(16);
    let limit = AdaptiveLimit::builder()
        .initial(10)
        .range(2, 500)
        .algorithm(Aimd::new())
        .build()
        .unwrap();
    let s = run(Some(limit.clone()), upstream, vec![phase(0, 1200)], 30, 80).await;
    let text = show(&s);
    let (good, _, _) = worst(&s, 10, 30);
    assert!(good >= 680, "goodput {good} of 800\n{text}");
    let failed: u32 = s[10..].iter().map(|x| x.failed).sum();
    let good_total: u32 = s[10..].iter().map(|x| x.good).sum();
    // AIMD probes past the capacity by one slot a window, and backs off: some fail.
    assert!(
        failed * 5 < good_total,
        "{failed} failed, {good_total} good\n{text}"
    );
    assert!(
        (12..=24).contains(&limit.limit()),
        "limit {}\n{text}",
        limit.limit()
    );
}

/// Priorities under 3× overload: a `critical` partition (a tenth of the traffic: 240 a second,
/// 30 % of the capacity) guaranteed half the limit keeps 95 % or more of its requests answered within the SLO, while the rest
/// absorbs the shedding; without the partition, critical requests are shed like any other.
#[tokio::test(start_paused = true)]
async fn under_overload_the_critical_partition_is_kept() {
    let partitioned = AdaptiveLimit::builder()
        .initial(10)
        .range(2, 500)
        .partition("critical", 0.5)
        .build()
        .unwrap();
    let s = run_split(
        Some(partitioned.clone()),
        Upstream::new(16, 20),
        vec![phase(0, 2400)],
        30,
        80,
        10,
    )
    .await;
    let sent: u32 = s[10..28].iter().map(|x| x.critical).sum();
    let good: u32 = s[10..28].iter().map(|x| x.critical_good).sum();
    assert!(
        f64::from(good) >= 0.95 * f64::from(sent),
        "critical: {good} of {sent}\n{}",
        show(&s)
    );
    let (total_good, _, _) = worst(&s, 10, 28);
    assert!(total_good >= 700, "goodput {total_good}\n{}", show(&s));
    let stats = partitioned.partitions();
    assert_eq!(&*stats[0].name, "critical");
    assert_eq!(&*stats[1].name, "other");
    assert!(
        stats[1].rejected > 10 * stats[0].rejected.max(1),
        "{stats:?}"
    );
    // The same load without partitions: critical requests shed with the rest.
    let s = run_split(
        Some(gradient_limit()),
        Upstream::new(16, 20),
        vec![phase(0, 2400)],
        30,
        80,
        10,
    )
    .await;
    let sent: u32 = s[10..28].iter().map(|x| x.critical).sum();
    let good: u32 = s[10..28].iter().map(|x| x.critical_good).sum();
    assert!(f64::from(good) < 0.6 * f64::from(sent), "{good} of {sent}");
}

/// The limit stays in its range, a finite number, whatever the samples (an algorithm that
/// returns NaN or infinities included).
#[test]
fn the_limit_stays_in_range_whatever_the_algorithm_says() {
    struct Wild(u32);
    impl Algorithm for Wild {
        fn update(&mut self, _limit: f64, _w: &Window) -> f64 {
            self.0 += 1;
            [f64::NAN, f64::INFINITY, -1e300, 1e300, -5.0, 0.0][self.0 as usize % 6]
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let limit = AdaptiveLimit::builder()
            .initial(10)
            .range(3, 50)
            .min_samples(1)
            .algorithm(Wild(0))
            .build()
            .unwrap();
        for _ in 0..60 {
            let p = limit.try_acquire().unwrap();
            tokio::time::advance(Duration::from_millis(150)).await;
            p.success();
            assert!((3..=50).contains(&limit.limit()), "{}", limit.limit());
        }
    });
}

/// A cancelled request (its permit dropped) gives its slot back and is no sample; the limit
/// admits exactly its limit at once, and configuration errors are errors.
#[test]
fn slots_are_given_back_and_bad_settings_refused() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    /// Counts the windows it is given, and their samples.
    struct Spy(Arc<AtomicU32>, Arc<AtomicU32>);
    impl Algorithm for Spy {
        fn update(&mut self, limit: f64, w: &Window) -> f64 {
            self.0.fetch_add(1, Ordering::Relaxed);
            self.1.fetch_add(w.samples, Ordering::Relaxed);
            limit
        }
    }
    rt.block_on(async {
        let (windows, samples) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let limit = AdaptiveLimit::builder()
            .initial(3)
            .min_samples(1)
            .algorithm(Spy(windows.clone(), samples.clone()))
            .build()
            .unwrap();
        // Past the first window's end.
        tokio::time::advance(Duration::from_secs(2)).await;
        let held: Vec<_> = (0..3).map(|_| limit.try_acquire().unwrap()).collect();
        assert!(limit.try_acquire().is_none());
        assert_eq!(limit.in_flight(), 3);
        tokio::time::advance(Duration::from_millis(10)).await;
        drop(held);
        assert_eq!(limit.in_flight(), 0);
        assert_eq!(limit.partitions()[0].cancelled, 3);
        // A success starts a window (none was: the cancelled requests were no samples), and
        // one a window's length (100 ms) later closes it, with those two samples only.
        limit.try_acquire().unwrap().success();
        assert_eq!(windows.load(Ordering::Relaxed), 0);
        tokio::time::advance(Duration::from_millis(100)).await;
        limit.try_acquire().unwrap().success();
        assert_eq!(windows.load(Ordering::Relaxed), 1);
        assert_eq!(samples.load(Ordering::Relaxed), 2);
    });
    for (builder, word) in [
        (AdaptiveLimit::builder().range(0, 10), "range"),
        (AdaptiveLimit::builder().range(10, 5), "range"),
        (AdaptiveLimit::builder().min_samples(0), "min_samples"),
        (
            AdaptiveLimit::builder().window(Duration::ZERO, Duration::from_secs(1)),
            "window",
        ),
        // The algorithms' settings out of range are refused, not clamped (issue 55).
        (
            AdaptiveLimit::builder().gradient(Gradient::new().tolerance(0.9)),
            "`tolerance`: 0.9",
        ),
        (
            AdaptiveLimit::builder().gradient(Gradient::new().smoothing(f64::NAN)),
            "`smoothing`: NaN",
        ),
        (
            AdaptiveLimit::builder().algorithm(Aimd::new().backoff(1.2)),
            "`backoff`: 1.2",
        ),
    ] {
        let err = builder.build().unwrap_err().to_string();
        assert!(err.contains(word), "{err}");
    }
}

/// Real concurrency: threads at once acquiring and ending permits never let more than the
/// limit in, and every slot comes back.
#[test]
fn threads_at_once_never_exceed_the_limit() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let limit = AdaptiveLimit::builder()
        .initial(8)
        .range(8, 8)
        .min_samples(1)
        .build()
        .unwrap();
    let peak = Arc::new(AtomicU32::new(0));
    std::thread::scope(|s| {
        for _ in 0..8 {
            let (limit, peak) = (limit.clone(), peak.clone());
            s.spawn(move || {
                for i in 0..20_000u32 {
                    if let Some(p) = limit.try_acquire() {
                        peak.fetch_max(limit.in_flight(), Ordering::Relaxed);
                        if i % 3 == 0 {
                            p.dropped();
                        } else if i % 3 == 1 {
                            p.success();
                        }
                    }
                }
            });
        }
    });
    assert!(peak.load(Ordering::Relaxed) <= 8);
    assert_eq!(limit.in_flight(), 0);
}

/// Waiters are woken when the limit grows, not only when a slot is given back: with 2 in
/// flight and 2 waiting, one request ends and its window makes the limit 5; both waiters are
/// served at once, where the second used to wait out its deadline beside free slots.
#[tokio::test(start_paused = true)]
async fn waiters_are_woken_when_the_limit_grows() {
    use tollgate::adaptive::QueueOrder;
    struct Grow;
    impl Algorithm for Grow {
        fn update(&mut self, _limit: f64, _w: &Window) -> f64 {
            5.0
        }
    }
    let limit = AdaptiveLimit::builder()
        .initial(2)
        .range(1, 10)
        .min_samples(1)
        .window(Duration::from_millis(1), Duration::from_millis(1))
        .algorithm(Grow)
        .queue(4, QueueOrder::Fifo)
        .build()
        .unwrap();
    // A sample starts the window; the next, 5 ms on, closes it.
    limit.try_acquire().unwrap().success();
    let (first, _second) = (limit.try_acquire().unwrap(), limit.try_acquire().unwrap());
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let limit = limit.clone();
            tokio::spawn(async move { limit.acquire(Duration::from_secs(10)).await })
        })
        .collect();
    while limit.waiting() < 2 {
        tokio::task::yield_now().await;
    }
    tokio::time::advance(Duration::from_millis(5)).await;
    first.success();
    assert_eq!(limit.limit(), 5);
    let start = Instant::now();
    let mut permits = Vec::new();
    for w in waiters {
        permits.push(
            w.await
                .unwrap()
                .expect("served, not refused at its deadline"),
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!((limit.in_flight(), limit.waiting()), (3, 0));
}

/// A waiter whose future is dropped after the wake was sent to it, before it could take the
/// slot (a client gone at that instant), passes the wake on: the next in line gets the slot at
/// once, not at its deadline.
#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_after_its_wake_passes_it_on() {
    use tollgate::adaptive::QueueOrder;
    let limit = AdaptiveLimit::builder()
        .initial(1)
        .range(1, 1)
        .queue(4, QueueOrder::Lifo)
        .build()
        .unwrap();
    let held = limit.try_acquire().unwrap();
    let second = tokio::spawn({
        let limit = limit.clone();
        async move { limit.acquire(Duration::from_secs(10)).await.is_some() }
    });
    while limit.waiting() < 1 {
        tokio::task::yield_now().await;
    }
    // Joined last, served first (LIFO): the slot's wake goes to it.
    let first = tokio::spawn({
        let limit = limit.clone();
        async move { limit.acquire(Duration::from_secs(10)).await }
    });
    while limit.waiting() < 2 {
        tokio::task::yield_now().await;
    }
    let started = Instant::now();
    drop(held);
    // Woken, but gone before it runs.
    first.abort();
    assert!(second.await.unwrap(), "the second waiter got the slot");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "not at its deadline"
    );
    assert_eq!((limit.in_flight(), limit.waiting()), (0, 0));
}

/// 16 tasks at once, each asking `limit` `calls` times (waiting at most `wait` in its queue)
/// and, when admitted, yielding once and ending as a success, or dropped (cancelled) every
/// `cancel_every`th call: the most requests seen in flight.
async fn from_16_tasks(
    limit: &AdaptiveLimit,
    calls: u32,
    wait: Duration,
    cancel_every: u32,
) -> u32 {
    let peak = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (limit, peak) = (limit.clone(), peak.clone());
            tokio::spawn(async move {
                for i in 0..calls {
                    if let Some(p) = limit.acquire(wait).await {
                        peak.fetch_max(limit.in_flight(), Ordering::Relaxed);
                        tokio::task::yield_now().await;
                        if (i + t) % cancel_every == 0 {
                            drop(p);
                        } else {
                            p.success();
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    peak.load(Ordering::Relaxed)
}

/// Many tasks on several threads at once through a limit of 4 with a queue: never more than 4
/// in flight, every request either served or refused (admitted + rejected = all), and nothing
/// left in flight or in line at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_under_real_concurrency_never_exceeds_the_limit() {
    use tollgate::adaptive::QueueOrder;
    for order in [QueueOrder::Lifo, QueueOrder::Fifo] {
        let limit = AdaptiveLimit::builder()
            .initial(4)
            .range(4, 4)
            .queue(8, order)
            .build()
            .unwrap();
        let peak = from_16_tasks(&limit, 100, Duration::from_millis(2), 7).await;
        assert!(peak <= 4, "{order:?}");
        assert_eq!((limit.in_flight(), limit.waiting()), (0, 0), "{order:?}");
        let other = &limit.partitions()[0];
        assert_eq!(
            other.admitted + other.rejected,
            1600,
            "{order:?}: {other:?}"
        );
    }
}

/// A queue under real concurrency while the limit grows and shrinks every window (2, then 6,
/// then 2 ...): the waiters woken when it grows take only free slots (never more than the
/// highest limit in flight), every request is served or refused, and nothing is left in flight
/// or in line.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_with_a_limit_that_grows_and_shrinks_under_real_concurrency() {
    use tollgate::adaptive::QueueOrder;
    struct Swing;
    impl Algorithm for Swing {
        fn update(&mut self, limit: f64, _w: &Window) -> f64 {
            if limit < 4.0 { 6.0 } else { 2.0 }
        }
    }
    for order in [QueueOrder::Lifo, QueueOrder::Fifo] {
        let limit = AdaptiveLimit::builder()
            .initial(2)
            .range(1, 6)
            .min_samples(1)
            .window(Duration::from_micros(200), Duration::from_micros(200))
            .algorithm(Swing)
            .queue(16, order)
            .build()
            .unwrap();
        let peak = from_16_tasks(&limit, 200, Duration::from_millis(5), 5).await;
        assert!(peak <= 6, "{order:?}");
        assert_eq!((limit.in_flight(), limit.waiting()), (0, 0), "{order:?}");
        let other = &limit.partitions()[0];
        assert_eq!(
            other.admitted + other.rejected,
            3200,
            "{order:?}: {other:?}"
        );
        assert!(
            other.admitted > 0 && other.succeeded > 0,
            "{order:?}: {other:?}"
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Whatever the samples (RTTs from 0 to an hour, drops, in flight), the built-in
    /// algorithms keep the limit a whole number within `[min, max]`, and every slot comes back.
    #[test]
    fn the_limit_stays_in_its_range(
        min in 1u32..20,
        span in 0u32..200,
        aimd in proptest::bool::ANY,
        samples in proptest::collection::vec((0u64..3_600_000_000, proptest::bool::ANY, 1u32..40), 1..300),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let max = min + span;
            let builder = AdaptiveLimit::builder().initial(min).range(min, max).min_samples(1);
            let limit = if aimd {
                builder.algorithm(Aimd::new()).build().unwrap()
            } else {
                builder.gradient(Gradient::new()).build().unwrap()
            };
            for (us, dropped, held) in samples {
                let permits: Vec<_> = (0..held).filter_map(|_| limit.try_acquire()).collect();
                tokio::time::advance(Duration::from_micros(us)).await;
                for (i, p) in permits.into_iter().enumerate() {
                    if dropped && i == 0 { p.dropped() } else { p.success() }
                }
                let l = limit.limit();
                assert!((min..=max).contains(&l), "{l} not in {min}..={max}");
                assert_eq!(limit.in_flight(), 0);
            }
        });
    }
}

mod support;

#[allow(dead_code)]
#[path = "../examples/adaptive.rs"]
mod example;

/// `examples/adaptive.rs` as it serves: with a static cap of 1 and a slow service, of three
/// requests at once one is served and the others answered 503 at once, while `/critical` is
/// still admitted at the limit; with `LIMIT=none` every request waits its turn. Its settings'
/// errors name the variable.
#[tokio::test]
async fn the_example_serves_as_documented() {
    let settings = |limit: &str| example::Settings {
        capacity: 1,
        service_ms: 300,
        schedule: Vec::new(),
        limit: limit.into(),
        critical_share: 0.5,
        fair: true,
        queue: None,
        tolerance: None,
    };
    let (app, limit) = example::app(&settings("static")).unwrap();
    let limit = limit.unwrap();
    let base = support::serve_app(app).await;
    let client = reqwest::Client::new();
    let first = tokio::spawn(client.get(&base).send());
    for _ in 0..500 {
        if limit.in_flight() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused = client.get(&base).send().await.unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let critical = client.get(format!("{base}/critical")).send().await.unwrap();
    assert_eq!(critical.status(), 200);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    let text = client
        .get(format!("{base}/limit"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.starts_with("limit 1, in flight 0"), "{text}");
    assert!(
        text.contains("critical: in flight 0, admitted 1, rejected 0"),
        "{text}"
    );
    assert!(
        text.contains("default: in flight 0, admitted 2, rejected 1 (0 over their share)"),
        "{text}"
    );

    let (app, none) = example::app(&settings("none")).unwrap();
    assert!(none.is_none());
    let base = support::serve_app(app).await;
    let calls: Vec<_> = (0..3)
        .map(|_| tokio::spawn(client.get(&base).send()))
        .collect();
    for c in calls {
        assert_eq!(c.await.unwrap().unwrap().status(), 200);
    }

    for (name, value, word) in [
        ("CAPACITY_SCHEDULE", "8@x", "CAPACITY_SCHEDULE"),
        ("LIMIT", "sometimes", "LIMIT"),
        ("CAPACITY", "0", "CAPACITY"),
        ("FAIR", "maybe", "FAIR"),
        ("QUEUE", "long", "QUEUE"),
        ("TOLERANCE", "0.5", "TOLERANCE"),
    ] {
        let err =
            example::Settings::from_vars(|n| (n == name).then(|| value.to_owned())).unwrap_err();
        assert!(err.contains(word), "{err}");
    }
    let s = example::Settings::from_vars(|n| {
        (n == "CAPACITY_SCHEDULE").then(|| "8@20s, 16@0s,16@40s".to_owned())
    })
    .unwrap();
    assert_eq!(
        (s.capacity, s.service_ms, s.limit.as_str(), s.fair, s.queue),
        (16, 20, "adaptive", true, None)
    );
    let q = example::Settings::from_vars(|n| match n {
        "QUEUE" => Some("on".into()),
        "FAIR" => Some("off".into()),
        _ => None,
    })
    .unwrap();
    assert_eq!((q.fair, q.queue), (false, Some(Duration::from_millis(30))));
    let secs: Vec<(u32, u64)> = s
        .schedule
        .iter()
        .map(|(c, at)| (*c, at.as_secs()))
        .collect();
    assert_eq!(secs, [(16, 0), (8, 20), (16, 40)]);
}

mod over_http {
    use super::*;
    use axum::Router;
    use axum::routing::get;
    use tollgate::adaptive::AdaptiveLayer;

    /// A service that holds each request until `release` gives it a permit (or 10 s pass).
    fn held(release: Arc<Semaphore>) -> Router {
        Router::new().route(
            "/",
            get(move || {
                let release = release.clone();
                async move {
                    support::held_until(&release).await;
                    "ok"
                }
            }),
        )
    }

    fn fixed(n: u32) -> AdaptiveLimit {
        AdaptiveLimit::builder()
            .initial(n)
            .range(n, n)
            .build()
            .unwrap()
    }

    use support::wait_for;

    /// With a queue: a request over the limit waits for the slot of the one in flight and is
    /// served; one whose deadline passes is answered 503; one whose client goes away leaves
    /// the line. Every slot and place in line comes back.
    #[tokio::test]
    async fn a_queued_request_waits_for_a_slot_until_its_deadline() {
        use tollgate::adaptive::QueueOrder;
        let release = Arc::new(Semaphore::new(0));
        let limit = AdaptiveLimit::builder()
            .initial(1)
            .range(1, 1)
            .queue(4, QueueOrder::Lifo)
            .build()
            .unwrap();
        let layer = AdaptiveLayer::new(limit.clone()).queue_deadline(Duration::from_secs(5));
        let base = support::serve_app(held(release.clone()).layer(layer)).await;
        let client = reqwest::Client::new();
        let first = tokio::spawn(client.get(&base).send());
        wait_for(|| limit.in_flight() == 1).await;
        let second = tokio::spawn(client.get(&base).send());
        wait_for(|| limit.waiting() == 1).await;
        // A client that gives up while waiting leaves the line.
        let gone = tokio::spawn(client.get(&base).send());
        wait_for(|| limit.waiting() == 2).await;
        gone.abort();
        wait_for(|| limit.waiting() == 1).await;
        release.add_permits(1);
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        // The second got the first's slot: it is served, not refused.
        wait_for(|| limit.in_flight() == 1 && limit.waiting() == 0).await;
        release.add_permits(1);
        assert_eq!(second.await.unwrap().unwrap().status(), 200);
        assert_eq!((limit.in_flight(), limit.waiting()), (0, 0));

        // A deadline that passes: 503, as without a queue.
        let short = AdaptiveLayer::new(limit.clone()).queue_deadline(Duration::from_millis(100));
        let base = support::serve_app(held(release.clone()).layer(short)).await;
        let first = tokio::spawn(client.get(&base).send());
        wait_for(|| limit.in_flight() == 1).await;
        let late = client.get(&base).send().await.unwrap();
        assert_eq!(late.status(), 503);
        release.add_permits(1);
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        let other = &limit.partitions()[0];
        assert_eq!((other.admitted, other.rejected), (3, 1), "{other:?}");
        assert_eq!((limit.in_flight(), limit.waiting()), (0, 0));
    }

    /// Over real HTTP: two requests held, a third answered 503 at once with `Retry-After`, a
    /// gRPC one `UNAVAILABLE`; once they end, every slot is back and requests pass again.
    #[tokio::test]
    async fn over_the_limit_answers_503_with_retry_after_or_grpc_unavailable() {
        let release = Arc::new(Semaphore::new(0));
        let limit = fixed(2);
        let app = held(release.clone()).layer(AdaptiveLayer::new(limit.clone()));
        let base = support::serve_app(app).await;
        let client = reqwest::Client::new();
        let held: Vec<_> = (0..2)
            .map(|_| tokio::spawn(client.get(&base).send()))
            .collect();
        wait_for(|| limit.in_flight() == 2).await;
        let res = client.get(&base).send().await.unwrap();
        assert_eq!(res.status(), 503);
        assert_eq!(res.headers()["retry-after"], "1");
        let res = client
            .get(&base)
            .header("content-type", "application/grpc")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["grpc-status"], "14");
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "1000");
        release.add_permits(2);
        for h in held {
            assert_eq!(h.await.unwrap().unwrap().status(), 200);
        }
        assert_eq!(limit.in_flight(), 0);
        let ok = tokio::spawn(client.get(&base).send());
        wait_for(|| limit.in_flight() == 1).await;
        release.add_permits(1);
        assert_eq!(ok.await.unwrap().unwrap().status(), 200);
    }

    /// A request the client gives up on (its connection closed mid-call) gives its slot back,
    /// and is no sample.
    #[tokio::test]
    async fn a_cancelled_request_gives_its_slot_back() {
        let release = Arc::new(Semaphore::new(0));
        let limit = fixed(1);
        let app = held(release).layer(AdaptiveLayer::new(limit.clone()));
        let base = support::serve_app(app).await;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(200))
            .build()
            .unwrap();
        assert!(client.get(&base).send().await.is_err());
        // The server drops the call when the connection closes.
        wait_for(|| limit.in_flight() == 0).await;
        let other = &limit.partitions()[0];
        assert_eq!((other.cancelled, other.succeeded, other.dropped), (1, 0, 0));
    }

    /// Inside a rate limit, a request the quota refuses never takes a slot: the one slot is
    /// held, and the next request is a 429 from the quota, not a 503.
    #[tokio::test]
    async fn a_request_refused_by_a_quota_takes_no_slot() {
        let release = Arc::new(Semaphore::new(0));
        let limit = fixed(1);
        let quota = tollgate::RateLimitLayer::builder()
            .policy(tollgate::Policy::new("api", support::no_refill(1)))
            .key(tollgate::key::Global)
            .build()
            .unwrap();
        let app = held(release.clone())
            .layer(AdaptiveLayer::new(limit.clone()))
            .layer(quota);
        let base = support::serve_app(app).await;
        let client = reqwest::Client::new();
        let first = tokio::spawn(client.get(&base).send());
        wait_for(|| limit.in_flight() == 1).await;
        let res = client.get(&base).send().await.unwrap();
        assert_eq!(res.status(), 429);
        assert_eq!(limit.in_flight(), 1);
        release.add_permits(1);
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        assert_eq!(limit.in_flight(), 0);
    }

    /// Partitions over real HTTP: with the limit (2) reached by ordinary requests, a request
    /// to `/critical` is still admitted within its guaranteed half, an ordinary one is refused,
    /// and a second critical one too (its guarantee is held); the counts say who was refused.
    #[tokio::test]
    async fn the_critical_partition_is_admitted_at_the_limit() {
        let release = Arc::new(Semaphore::new(0));
        let limit = AdaptiveLimit::builder()
            .initial(2)
            .range(2, 2)
            .partition("critical", 0.5)
            .build()
            .unwrap();
        let held_routes = held(release.clone());
        let app = Router::new()
            .merge(held_routes.clone())
            .nest("/critical", held_routes)
            .layer(AdaptiveLayer::new(limit.clone()).partition_by(|req| {
                req.uri()
                    .path()
                    .starts_with("/critical")
                    .then_some("critical")
            }));
        let base = support::serve_app(app).await;
        let client = reqwest::Client::new();
        let ordinary: Vec<_> = (0..2)
            .map(|_| tokio::spawn(client.get(&base).send()))
            .collect();
        wait_for(|| limit.in_flight() == 2).await;
        assert_eq!(client.get(&base).send().await.unwrap().status(), 503);
        let critical = tokio::spawn(client.get(format!("{base}/critical")).send());
        wait_for(|| limit.in_flight() == 3).await;
        let second = client
            .get(format!("{base}/critical/"))
            .send()
            .await
            .unwrap();
        assert_eq!(second.status(), 503);
        release.add_permits(3);
        for h in ordinary.into_iter().chain([critical]) {
            assert_eq!(h.await.unwrap().unwrap().status(), 200);
        }
        let stats = limit.partitions();
        let counts = |i: usize| (stats[i].admitted, stats[i].rejected, stats[i].succeeded);
        assert_eq!((&*stats[0].name, counts(0)), ("critical", (1, 1, 1)));
        assert_eq!((&*stats[1].name, counts(1)), ("other", (2, 1, 2)));
        assert_eq!(limit.in_flight(), 0);
    }

    /// With the sample at the body's end, a gRPC stream's status in its trailers counts: a
    /// stream that ends with `UNAVAILABLE` (14) or `RESOURCE_EXHAUSTED` (8) is a drop, one that
    /// ends with `OK` a success (they all used to count as successes).
    #[tokio::test]
    async fn a_grpc_stream_ending_in_overload_in_its_trailers_is_a_drop() {
        use tokio_stream::StreamExt;
        let limit = fixed(4);
        let app = Router::new()
            .route(
                "/{status}",
                get(
                    |axum::extract::Path(status): axum::extract::Path<String>| async move {
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", status.parse().unwrap());
                        let frames = [
                            http_body::Frame::data(bytes::Bytes::from_static(b"\0\0\0\0\0")),
                            http_body::Frame::trailers(trailers),
                        ];
                        let stream =
                            tokio_stream::iter(frames).map(Ok::<_, std::convert::Infallible>);
                        let body = axum::body::Body::new(http_body_util::StreamBody::new(stream));
                        ([("content-type", "application/grpc")], body)
                    },
                ),
            )
            .layer(AdaptiveLayer::new(limit.clone()).sample_at_body_end(true));
        let base = support::serve_app(app).await;
        let client = reqwest::Client::new();
        for status in ["14", "8", "0", "5"] {
            let res = client.get(format!("{base}/{status}")).send().await.unwrap();
            assert_eq!(res.status(), 200);
            res.bytes().await.unwrap();
        }
        wait_for(|| limit.in_flight() == 0).await;
        let other = &limit.partitions()[0];
        assert_eq!((other.dropped, other.succeeded), (2, 2), "{other:?}");
    }

    /// Partitions named at run time, from a header's value (issue 55, 5): with the limit (2)
    /// reached, `x-tier: gold` is admitted within its guarantee, a tier the limit was not
    /// given is `other` and refused, and a thousand made-up tiers add no partition.
    #[tokio::test]
    async fn a_partition_named_by_a_header_at_the_limit() {
        let release = Arc::new(Semaphore::new(0));
        let limit = AdaptiveLimit::builder()
            .initial(2)
            .range(2, 2)
            .partition("gold", 0.5)
            .partition("silver", 0.25)
            .build()
            .unwrap();
        let layer = AdaptiveLayer::new(limit.clone())
            .partition_by_header(http::HeaderName::from_static("x-tier"));
        let base = support::serve_app(held(release.clone()).layer(layer)).await;
        let client = reqwest::Client::new();
        let ordinary: Vec<_> = (0..2)
            .map(|_| tokio::spawn(client.get(&base).send()))
            .collect();
        wait_for(|| limit.in_flight() == 2).await;
        let gold = tokio::spawn(client.get(&base).header("x-tier", "gold").send());
        wait_for(|| limit.in_flight() == 3).await;
        for i in 0..1000 {
            let res = client
                .get(&base)
                .header("x-tier", format!("tier-{i}"))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 503);
        }
        release.add_permits(3);
        for h in ordinary.into_iter().chain([gold]) {
            assert_eq!(h.await.unwrap().unwrap().status(), 200);
        }
        let stats = limit.partitions();
        let names: Vec<_> = stats.iter().map(|p| p.name.to_string()).collect();
        assert_eq!(names, ["gold", "silver", "other"]);
        assert_eq!((stats[0].admitted, stats[0].rejected), (1, 0));
        assert_eq!((stats[2].admitted, stats[2].rejected), (2, 1000));
        assert_eq!(limit.in_flight(), 0);
    }

    /// A service answering 503 (overloaded) to everything is sampled as drops: AIMD backs
    /// off, and so does the default gradient (every window of drops only).
    #[tokio::test]
    async fn a_503_from_the_service_is_a_drop() {
        for aimd in [true, false] {
            let builder = AdaptiveLimit::builder()
                .initial(10)
                .range(1, 10)
                .min_samples(1)
                .window(Duration::from_millis(1), Duration::from_millis(2));
            let limit = if aimd {
                builder.algorithm(Aimd::new())
            } else {
                builder
            }
            .build()
            .unwrap();
            let app = Router::new()
                .route(
                    "/",
                    get(|| async { (axum::http::StatusCode::SERVICE_UNAVAILABLE, "busy") }),
                )
                .layer(AdaptiveLayer::new(limit.clone()));
            let base = support::serve_app(app).await;
            let client = reqwest::Client::new();
            for _ in 0..20 {
                assert_eq!(client.get(&base).send().await.unwrap().status(), 503);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(limit.limit() < 10, "aimd {aimd}: {}", limit.limit());
            assert_eq!(limit.partitions()[0].dropped, 20);
        }
    }
}
