//! The `Limiter` for code that is not a request handler: waiting is a reservation, exact and
//! first come, first served, on the local backend and shared through Redis.

mod support;

use std::time::{Duration, Instant};

use support::{cost, key};
use tollgate::backend::LocalBackend;
use tollgate::limiter::{AcquireError, Limiter};
use tollgate::{Policy, Quota};

/// Concurrent callers go on one emission interval apart, in the order they asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_go_on_at_the_rate_first_come_first_served() {
    let limiter = Limiter::new(
        Policy::new("partner", Quota::per_second(20).burst(1)),
        LocalBackend::new(),
    )
    .unwrap();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let l = limiter.clone();
        tasks.push(tokio::spawn(async move {
            l.acquire(&key("partner"), cost(1), Duration::from_secs(2))
                .await
                .unwrap();
            started.elapsed()
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    done.sort();
    // 8 units at 20 per second, a burst of 1: the last goes on 350 ms after the first.
    assert!(done[7] >= Duration::from_millis(345), "{done:?}");
    for (k, at) in done.iter().enumerate() {
        // Each at its own time: the k-th goes on no sooner than k x 50 ms after the start
        // (scheduling may delay a wake-up, never advance it; a delayed one can land close to
        // the next, so the gaps between arrivals are not bounded, their times are).
        let due = Duration::from_millis(50 * k as u64);
        assert!(*at + Duration::from_millis(2) >= due, "{k}: {done:?}");
    }
}

/// A wait longer than the maximum is refused at once, taking nothing; a cost above the burst
/// never fits.
#[tokio::test]
async fn too_long_is_refused_at_once_and_takes_nothing() {
    let limiter = Limiter::new(
        Policy::new("slow", Quota::per_second(1).burst(1)),
        LocalBackend::new(),
    )
    .unwrap();
    let k = key("k");
    limiter.acquire(&k, cost(1), Duration::ZERO).await.unwrap();
    let started = Instant::now();
    let err = limiter
        .acquire(&k, cost(1), Duration::from_millis(200))
        .await
        .unwrap_err();
    // Refused at once: waiting would have taken the 200 ms allowed at least (the unit comes
    // in a second), a margin for a busy machine.
    assert!(started.elapsed() < Duration::from_millis(200), "no waiting");
    let AcquireError::TooLong(d) = &err else {
        panic!("{err:?}")
    };
    assert!(
        d.retry_after().unwrap() > Duration::from_millis(800),
        "{d:?}"
    );
    assert!(err.to_string().contains("rate limited"), "{err}");
    // Nothing taken: the bucket is as it was.
    let peek = limiter.peek(&k, cost(1)).await.unwrap();
    assert!(
        peek.retry_after().unwrap() <= d.retry_after().unwrap(),
        "{peek:?}"
    );
    let err = limiter
        .acquire(&k, cost(2), Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(matches!(err, AcquireError::NeverFits(_)), "{err:?}");
    // A reset forgives the client.
    limiter.reset(&k).await.unwrap();
    assert!(limiter.check(&k, cost(1)).await.unwrap().is_allowed());
}

/// A cancelled wait leaves its reservation spent (documented): the next caller waits behind it.
#[tokio::test]
async fn a_cancelled_wait_keeps_its_reservation() {
    let limiter = Limiter::new(
        Policy::new("cancel", Quota::per_second(10).burst(1)),
        LocalBackend::new(),
    )
    .unwrap();
    let k = key("k");
    limiter.acquire(&k, cost(1), Duration::ZERO).await.unwrap();
    let cancelled = tokio::time::timeout(
        Duration::from_millis(20),
        limiter.acquire(&k, cost(1), Duration::from_secs(1)),
    )
    .await;
    assert!(cancelled.is_err(), "it was waiting its 100 ms");
    let next = limiter
        .reserve(&k, cost(1), Duration::from_secs(1))
        .await
        .unwrap();
    assert!(next.wait() > Duration::from_millis(150), "{next:?}");
}

/// Window quotas are polled: an acquire waits for the window's end, then takes its room.
#[tokio::test]
async fn window_quotas_are_asked_again_when_the_window_has_room() {
    let limiter = Limiter::new(
        Policy::new(
            "window",
            Quota::new(2, Duration::from_millis(200)).fixed_window(),
        ),
        LocalBackend::new(),
    )
    .unwrap();
    let k = key("k");
    for _ in 0..2 {
        limiter.acquire(&k, cost(1), Duration::ZERO).await.unwrap();
    }
    // Within the window's 200 ms, whatever is left of it.
    limiter
        .acquire(&k, cost(1), Duration::from_millis(500))
        .await
        .unwrap();
}

/// Two processes' limiters on one Redis share the rate: together they keep to it.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_limiters_on_one_redis_share_the_rate() {
    use tollgate::backend::redis::RedisBackend;
    let server = support::RedisServer::start();
    let make = || {
        let b = RedisBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        Limiter::new(Policy::new("shared", Quota::per_second(20).burst(1)), b).unwrap()
    };
    let (a, b) = (make(), make());
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..10 {
        let l = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            l.acquire(&key("partner"), cost(1), Duration::from_secs(3))
                .await
                .unwrap();
            started.elapsed()
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    done.sort();
    // 10 units at 20 per second: the k-th is due k × 50 ms after the first decision, which
    // comes after `started` (bounded from due times, not from gaps between answers, which a
    // delayed wake-up can shorten); 5 ms for the two clocks' rounding.
    for (k, at) in done.iter().enumerate() {
        assert!(
            *at + Duration::from_millis(5) >= Duration::from_millis(50) * k as u32,
            "{done:?}"
        );
    }
}

/// Permits on `backend`: two in flight, a third refused; a dropped permit gives its slot back;
/// a settled one charges its real cost (into debt) and gives its slot back.
async fn permits<B: tollgate::backend::Backend>(backend: B, who: &str) {
    let policy = Policy::new("jobs", Quota::concurrent(2)).and(Quota::per_hour(10));
    let limiter = Limiter::new(policy, backend).unwrap();
    let k = key("tenant");
    let first = limiter.admit(&k, cost(1)).await.unwrap();
    let second = limiter.admit(&k, cost(1)).await.unwrap();
    assert_eq!(second.decision().quotas()[0].remaining, 0, "{who}");
    match limiter.admit(&k, cost(1)).await {
        Err(AcquireError::TooLong(d)) => assert_eq!(d.retry_after(), Some(Duration::from_secs(1))),
        other => panic!("{who}: {other:?}"),
    }
    drop(first);
    // Given back at once in memory, in a task of its own for a store.
    let mut third = None;
    for _ in 0..100 {
        match limiter.admit(&k, cost(1)).await {
            Ok(permit) => {
                third = Some(permit);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let third = third.unwrap_or_else(|| panic!("{who}: the dropped permit's slot came back"));
    // The second job cost 12 in all: the hourly quota is 4 in debt.
    second.settle(12).await.unwrap();
    third.settle(1).await.unwrap();
    let d = limiter.peek(&k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 2, "{who}: every slot back: {d:?}");
    assert!(!d.is_allowed(), "{who}: in debt: {d:?}");
    match limiter.admit(&k, cost(1)).await {
        Err(AcquireError::TooLong(d)) => {
            // 5 units over (4 in debt, and this one): 5 × 6 min, less the time the test took.
            let wait = d.retry_after().unwrap();
            assert!(
                wait > Duration::from_secs(1790) && wait <= Duration::from_secs(1800),
                "{who}: {d:?}"
            )
        }
        other => panic!("{who}: {other:?}"),
    }
}

#[tokio::test]
async fn permits_local() {
    permits(LocalBackend::new(), "local").await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn permits_redis() {
    let server = support::RedisServer::start();
    let backend = tollgate::backend::redis::RedisBackend::builder()
        .url(server.url())
        .build()
        .unwrap();
    permits(backend, "redis").await;
}

/// A client loop on a `Limiter` that obeys its upstream's answers: the upstream (tollgate, 2
/// calls a second) says `r=0;t=1` on its second call of each second, the limiter pauses the
/// key, and sequential calls never get a `429`; without `obey`, the same loop does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limiter_obeying_its_upstreams_fields_is_never_refused() {
    let upstream = tollgate::RateLimitLayer::builder()
        .key(tollgate::key::Global)
        .policy(Policy::new("partner", Quota::per_second(2)))
        .build()
        .unwrap();
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(upstream);
    let url = format!("http://{}/", support::serve(app).await);
    let client = reqwest::Client::new();
    let key = key("partner");
    let one = std::num::NonZeroU32::MIN;

    // Our own limit would allow every call at once: only the upstream's fields pace us.
    let limiter = Limiter::new(
        Policy::new("out", Quota::per_second(1000)),
        LocalBackend::new(),
    )
    .unwrap();
    let started = Instant::now();
    for _ in 0..6 {
        limiter
            .acquire(&key, one, Duration::from_secs(5))
            .await
            .unwrap();
        let res = client.get(&url).send().await.unwrap();
        assert_eq!(res.status(), 200);
        limiter.obey_parts(&key, res.status(), res.headers());
    }
    // Two pauses of `t=1`, after the 2nd and the 4th call.
    assert!(
        started.elapsed() >= Duration::from_millis(1800),
        "{:?}",
        started.elapsed()
    );

    // The 6th call was the second of its second: the key is paused now, so `admit` refuses
    // and a short `acquire` does not wait.
    assert!(matches!(
        limiter.admit(&key, one).await,
        Err(AcquireError::Paused(_))
    ));
    assert!(matches!(
        limiter.acquire(&key, one, Duration::from_millis(10)).await,
        Err(AcquireError::Paused(_))
    ));

    // The same calls not obeying, at once, run into the upstream's 429.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { client.get(&url).send().await.unwrap().status() })
        })
        .collect();
    let mut refused = 0;
    for call in calls {
        if call.await.unwrap() == 429 {
            refused += 1;
        }
    }
    assert!(refused >= 3, "{refused}");
}
