//! Redis services that restrict what scripts may do: `TIME` refused (managed services refuse it
//! in scripts; here it is renamed away entirely), and a script cache that is lost while
//! serving. Two instances over HTTP on one real `redis-server` keep one limit through both.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use axum::{Router, routing::get};
use support::{RedisServer, cost, key, no_refill, prepare, serve_app};
use tollgate::backend::Backend;
use tollgate::backend::redis::{Approximate, FailurePolicy, RedisBackend, RedisClock};
use tollgate::backend::remote::TimeSource;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};

/// An HTTP instance limiting `/api` by `policy` on Redis at `url` with `clock`; its backend, to
/// read its stats.
async fn instance(url: &str, policy: Policy, clock: RedisClock) -> (String, RedisBackend) {
    let backend = RedisBackend::builder()
        .url(url)
        .clock(clock)
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .key(Global)
        .backend(backend.clone())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/api", get(|| async { "ok" }))
        .route_layer(layer);
    (serve_app(app).await, backend)
}

/// Sends `n` requests in turn to `a` and `b`, answering their statuses.
async fn alternate(a: &str, b: &str, n: usize) -> Vec<u16> {
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for i in 0..n {
        let base = if i % 2 == 0 { a } else { b };
        let res = client.get(format!("{base}/api")).send().await.unwrap();
        statuses.push(res.status().as_u16());
    }
    statuses
}

/// Sends `n` requests at once, half to `a` and half to `b`, answering their statuses.
async fn at_once(a: &str, b: &str, n: usize) -> Vec<u16> {
    let client = reqwest::Client::new();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let url = format!("{}/api", if i % 2 == 0 { a } else { b });
            let client = client.clone();
            tokio::spawn(async move { client.get(url).send().await.unwrap().status().as_u16() })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    statuses
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

/// A Redis where `TIME` does not exist: the backend finds out on its first decision, decides
/// on the instances' clocks from then on (said in its stats), and two instances keep one
/// limit, for GCRA and for a fixed window; no request gets the failure policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_without_time_keeps_one_limit_across_instances() {
    let server = RedisServer::start_with(&["--rename-command", "TIME", ""]);
    assert!(server.cmd(&["TIME"]).starts_with("-ERR unknown command"));
    for policy in [
        Policy::new("gcra", no_refill(10)),
        Policy::new("fixed", Quota::per_hour(10).fixed_window()),
        Policy::new("sliding", Quota::per_hour(10).sliding_window()),
    ] {
        let (a, ba) = instance(&server.url(), policy.clone(), RedisClock::Auto).await;
        let (b, bb) = instance(&server.url(), policy, RedisClock::Auto).await;
        let statuses = alternate(&a, &b, 30).await;
        assert_eq!(count(&statuses, 200), 10, "{statuses:?}");
        assert_eq!(count(&statuses, 429), 20, "{statuses:?}");
        for backend in [&ba, &bb] {
            let stats = backend.stats();
            assert_eq!(stats.time_source, TimeSource::Instances, "{stats:?}");
            assert_eq!(stats.fail_open + stats.fallback_local, 0, "{stats:?}");
        }
    }
    // The keys expire on their own (relative expiries, with no TIME to make them absolute):
    // a GCRA bucket's key lives until the bucket is full again, not for ever.
    let keys = server.cmd(&["KEYS", "tollgate:{gcra:*"]);
    let gcra: Vec<&str> = keys
        .lines()
        .filter(|l| !l.starts_with('*') && !l.starts_with('$'))
        .collect();
    assert_eq!(gcra.len(), 1, "{keys:?}");
    let ttl = server.cmd(&["PTTL", gcra[0]]);
    let ms: i64 = ttl.trim().trim_start_matches(':').parse().unwrap();
    assert!(ms > 0, "{ttl:?}");
}

/// Each clock chosen explicitly works on a stock Redis and is what the stats say: Redis's
/// read in the script, Redis's read outside it, the instances'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_clock_chosen_keeps_one_limit() {
    let server = RedisServer::start();
    for (clock, source) in [
        (RedisClock::Script, TimeSource::Store),
        (RedisClock::Synced, TimeSource::StoreSynced),
        (RedisClock::Instances, TimeSource::Instances),
    ] {
        let name = format!("{clock:?}");
        let policy = Policy::new(name.as_str(), no_refill(6));
        let (a, ba) = instance(&server.url(), policy.clone(), clock).await;
        let (b, _) = instance(&server.url(), policy, clock).await;
        let statuses = alternate(&a, &b, 16).await;
        assert_eq!(count(&statuses, 200), 6, "{clock:?}: {statuses:?}");
        assert_eq!(ba.stats().time_source, source);
    }
}

/// The synced clock is Redis's: a fixed window's reset, read through the synced clock,
/// agrees with the one Redis's own clock gives to within a second.
#[tokio::test]
async fn the_synced_clock_agrees_with_redis() {
    let server = RedisServer::start();
    let policy = Policy::new("minute", Quota::per_minute(5).fixed_window());
    let synced = RedisBackend::builder()
        .url(server.url())
        .clock(RedisClock::Synced)
        .build()
        .unwrap();
    let script = RedisBackend::builder()
        .url(server.url())
        .clock(RedisClock::Script)
        .build()
        .unwrap();
    let ps = prepare(&synced, &policy);
    let pr = prepare(&script, &policy);
    let a = synced.decide(&ps, &key("k"), cost(1)).await.unwrap();
    let b = script.decide(&pr, &key("k"), cost(1)).await.unwrap();
    assert_eq!(b.quotas()[0].remaining, 3, "one window, one count");
    let (ra, rb) = (a.quotas()[0].reset_after, b.quotas()[0].reset_after);
    let diff = ra.abs_diff(rb);
    assert!(diff < Duration::from_secs(1), "{ra:?} against {rb:?}");
}

/// The script cache lost in the middle of a burst (`SCRIPT FLUSH`, as a failover to a replica
/// that never saw the script, or Redis 8 evicting it): the script is loaded again, no request
/// fails or gets the failure policy, and two instances admit exactly the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_flush_in_a_burst_keeps_the_limit() {
    let server = RedisServer::start();
    let policy = Policy::new("flush", no_refill(20));
    let (a, ba) = instance(&server.url(), policy.clone(), RedisClock::Auto).await;
    let (b, bb) = instance(&server.url(), policy, RedisClock::Auto).await;
    let first = alternate(&a, &b, 8).await;
    assert_eq!(count(&first, 200), 8);
    assert_eq!(server.cmd(&["SCRIPT", "FLUSH"]).trim(), "+OK");
    let rest = at_once(&a, &b, 40).await;
    assert_eq!(count(&rest, 200), 12, "{rest:?}");
    assert_eq!(count(&rest, 429), 28, "{rest:?}");
    for backend in [&ba, &bb] {
        let stats = backend.stats();
        assert_eq!(stats.errors, 0, "{stats:?}");
        assert_eq!(stats.fail_open + stats.fallback_local, 0, "{stats:?}");
    }
}

/// The approximate mode on a Redis without `TIME`: its fleet's announcements and its stream's
/// first read fall back to the instances' clocks (its windows always use them), so the
/// instances learn each other's counts, the fleet is counted, and keys past their allowances
/// are announced and read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_approximate_mode_works_without_time() {
    let server = RedisServer::start_with(&["--rename-command", "TIME", ""]);
    let policy = Policy::new("f", Quota::per_minute(10).fixed_window());
    let pair = |mode: Approximate| {
        [0, 1].map(|_| {
            let b = RedisBackend::builder()
                .url(server.url())
                .on_failure(FailurePolicy::FallbackLocal)
                .build_approximate(mode.flush_every(Duration::from_millis(5)))
                .unwrap();
            let p = prepare(&b, &policy);
            (b, p)
        })
    };
    // Kept in step: every unit sent.
    let [(a, pa), (b, pb)] = pair(Approximate::asynchronous().allowance(0.0));
    let k = key("k");
    for _ in 0..7 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    a.flush().await;
    // B's first decision is blind and queues a read of the fleet's counts.
    assert!(b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    b.flush().await;
    let d = b.decide(&pb, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 1, "B counts A's 7: {d:?}");
    // With allowances: the fleet is counted, and a key A drives past its allowance is
    // announced and read by B.
    let [(a, pa), (b, pb)] = pair(Approximate::asynchronous());
    let hot = key("hot");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        // Work for both (the fleet is counted with their flushes), until each has counted
        // the other and B has read what A announced.
        assert!(b.decide(&pb, &hot, cost(1)).await.is_ok());
        for _ in 0..4 {
            let _ = a.decide(&pa, &hot, cost(1)).await.unwrap();
        }
        a.flush().await;
        b.flush().await;
        let (sa, sb) = (a.stats(), b.stats());
        if sa.fleet_size == 2 && sb.fleet_size == 2 && sb.announcements_read > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{sa:?}\n{sb:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The first requests on a Redis without `TIME` arrive at once: each of their calls fails on
/// `TIME`, one finds out (the others wait for it), and every call is sent again on the
/// instances' clocks: exactly the limit admitted, none given the failure policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_requests_find_out_once_and_keep_the_limit() {
    let server = RedisServer::start_with(&["--rename-command", "TIME", ""]);
    let policy = Policy::new("burst", no_refill(10));
    let (a, ba) = instance(&server.url(), policy.clone(), RedisClock::Auto).await;
    let (b, bb) = instance(&server.url(), policy, RedisClock::Auto).await;
    let statuses = at_once(&a, &b, 40).await;
    assert_eq!(count(&statuses, 200), 10, "{statuses:?}");
    assert_eq!(count(&statuses, 429), 30, "{statuses:?}");
    for backend in [&ba, &bb] {
        let stats = backend.stats();
        assert_eq!(stats.time_source, TimeSource::Instances, "{stats:?}");
        assert_eq!(stats.fail_open + stats.fallback_local, 0, "{stats:?}");
    }
}
