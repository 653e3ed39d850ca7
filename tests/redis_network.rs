//! The Redis backend behind a hostile network: a fault-injecting proxy between the backend and
//! a real `redis-server` delays, stalls, resets and loses replies.
#![cfg(feature = "redis")]

mod support;

use std::future::Future;
use std::time::{Duration, Instant};

use support::proxy::{Fault, FaultProxy};
use support::{RedisServer, cost, key, no_refill, prepare};
use tollgate::backend::Backend;
use tollgate::backend::redis::{FailurePolicy, RedisBackend, RedisPolicy};
use tollgate::{Key, Policy};

const TIMEOUT: Duration = Duration::from_millis(200);
/// What a request may wait beyond the timeout: scheduling on a loaded machine.
const MARGIN: Duration = Duration::from_millis(300);

fn backend(proxy: &FaultProxy, on_failure: FailurePolicy, breaker: u32) -> RedisBackend {
    RedisBackend::builder()
        .url(proxy.url())
        .timeout(TIMEOUT)
        .on_failure(on_failure)
        .circuit_breaker(breaker, Duration::from_millis(100))
        .deny_cache_capacity(0)
        .build()
        .unwrap()
}

async fn timed<T>(f: impl Future<Output = T>) -> T {
    let started = Instant::now();
    let out = f.await;
    assert!(
        started.elapsed() <= TIMEOUT + MARGIN,
        "waited {:?}",
        started.elapsed()
    );
    out
}

/// Until the backend decides through Redis again (a decision with quota state).
async fn resumes(b: &RedisBackend, p: &RedisPolicy, k: &Key) {
    let started = Instant::now();
    loop {
        if let Ok(d) = b.decide(p, k, cost(1)).await
            && !d.quotas().is_empty()
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "did not resume: {:?}",
            b.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn delays_stalls_and_half_open_connections_cost_at_most_the_timeout() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port).await;
    let b = backend(&proxy, FailurePolicy::FailClosed, 3);
    let p = prepare(&b, &Policy::new("net", no_refill(10_000)));
    let k = key("k");
    // Connected (and the script loaded) first: a new connection's handshake takes several
    // round trips.
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    proxy.set(Fault::Delay(Duration::from_millis(30)));
    assert!(timed(b.decide(&p, &k, cost(1))).await.unwrap().is_allowed());
    for fault in [
        Fault::Delay(Duration::from_millis(400)),
        Fault::Stall,
        Fault::HalfOpen,
    ] {
        proxy.set(fault);
        for _ in 0..6 {
            assert!(timed(b.decide(&p, &k, cost(1))).await.is_err(), "{fault:?}");
        }
        let s = b.stats();
        assert!(s.breaker_open, "{fault:?}: {s:?}");
        proxy.set(Fault::Pass);
        resumes(&b, &p, &k).await;
        assert!(!b.stats().breaker_open);
    }
}

#[tokio::test]
async fn resets_fail_fast_and_the_backend_reconnects() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port).await;
    let b = backend(&proxy, FailurePolicy::FailOpen, 3);
    let p = prepare(&b, &Policy::new("reset", no_refill(10_000)));
    let k = key("k");
    assert_eq!(b.decide(&p, &k, cost(1)).await.unwrap().quotas().len(), 1);
    proxy.set(Fault::Reset);
    for _ in 0..10 {
        // Fail open: allowed without state, never waiting past the timeout.
        let d = timed(b.decide(&p, &k, cost(1))).await.unwrap();
        assert!(d.quotas().is_empty());
    }
    proxy.set(Fault::Pass);
    resumes(&b, &p, &k).await;
}

/// Redis ran the script, the reply was lost with the connection: the call is not sent again
/// (it would charge twice). Every lost call charged exactly once.
#[tokio::test]
async fn a_call_that_may_have_run_is_never_sent_again() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port).await;
    // A breaker that never opens here: every call goes out.
    let b = backend(&proxy, FailurePolicy::FailClosed, 1000);
    let p = prepare(&b, &Policy::new("once", no_refill(100)));
    let k = key("k");
    assert_eq!(
        b.decide(&p, &k, cost(1)).await.unwrap().quotas()[0].remaining,
        99
    );
    proxy.set(Fault::LoseReplyTo("EVALSHA"));
    for _ in 0..5 {
        assert!(timed(b.decide(&p, &k, cost(1))).await.is_err());
    }
    proxy.set(Fault::Pass);
    let started = Instant::now();
    let d = loop {
        match b.decide(&p, &k, cost(1)).await {
            Ok(d) => break d,
            Err(_) if started.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(err) => panic!("did not resume: {err}"),
        }
    };
    // 1 before, 5 lost (each ran once), this one.
    assert_eq!(d.quotas()[0].remaining, 100 - 1 - 5 - 1, "{d:?}");
}

/// The resident memory of this process, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Thousands of failed calls (resets, every call going out) leave memory flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_flat_while_the_network_fails() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port).await;
    let b = backend(&proxy, FailurePolicy::FailOpen, u32::MAX);
    let roomy = tollgate::Quota::per_second(1_000_000);
    let p = std::sync::Arc::new(prepare(&b, &Policy::new("leak", roomy)));
    let run = |n: usize| {
        let (b, p) = (b.clone(), p.clone());
        async move {
            let mut tasks = Vec::new();
            for i in 0..n {
                let (b, p) = (b.clone(), p.clone());
                tasks.push(tokio::spawn(async move {
                    let _ = b.decide(&p, &key(&format!("k{}", i % 100)), cost(1)).await;
                }));
                if tasks.len() == 64 {
                    for t in tasks.drain(..) {
                        t.await.unwrap();
                    }
                }
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
    };
    proxy.set(Fault::Reset);
    run(2_000).await; // warm up: connections, buffers, allocator
    let before = rss();
    run(6_000).await;
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 16 << 20,
        "grew by {} KiB: {:?}",
        grown >> 10,
        b.stats()
    );
    assert!(b.stats().errors > 100, "{:?}", b.stats());
}

/// Redis Sentinel: a primary, a replica and three sentinels; the primary is killed during
/// traffic, the failure policy answers meanwhile, and limiting resumes on the promoted replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_resumes_on_the_promoted_replica() {
    let mut primary = RedisServer::start();
    let port = primary.port.to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let sentinels = support::Sentinels::start(primary.port, 3);
    let b = RedisBackend::builder()
        .sentinel("mymaster", sentinels.urls())
        .timeout(Duration::from_millis(300))
        .on_failure(FailurePolicy::FailClosed)
        .circuit_breaker(3, Duration::from_millis(200))
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    assert!(
        b.endpoint()
            .starts_with("sentinel mymaster at redis://127.0.0.1:")
    );
    let p = prepare(&b, &Policy::new("sentinel", no_refill(1000)));
    let k = key("k");
    let d = b.decide(&p, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 999);
    // The replica has the bucket before the primary dies.
    support::eventually("replicated", || replica.cmd(&["DBSIZE"]).trim() == ":1").await;
    primary.kill();
    let killed = Instant::now();
    let mut failed = 0;
    let recovered = loop {
        let started = Instant::now();
        let result = b.decide(&p, &k, cost(1)).await;
        assert!(
            started.elapsed() <= Duration::from_millis(300) + MARGIN,
            "waited {:?}",
            started.elapsed()
        );
        match result {
            Ok(d) if !d.quotas().is_empty() => break (killed.elapsed(), d),
            _ => failed += 1,
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "no failover: {:?}",
            b.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "sentinel failover: decisions again after {:?}, {failed} requests failed meanwhile",
        recovered.0
    );
    assert!(failed > 0);
    // On the promoted replica, with the bucket it had replicated.
    assert_eq!(recovered.1.quotas()[0].remaining, 998, "{:?}", recovered.1);
    assert!(replica.cmd(&["ROLE"]).contains("master"));
}
