//! The Redis backend on a real three-primary Redis Cluster started by the tests.
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::{RedisCluster, cost, prepare};
use tollgate::backend::Backend;
use tollgate::backend::redis::{RedisBackend, TestClock};
use tollgate::{Key, Policy, Quota};

/// A backend of a fleet of one (no announcement key beside the buckets the tests count).
fn cluster_backend(cluster: &RedisCluster) -> RedisBackend {
    RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_secs(2))
        .fleet(tollgate::backend::remote::Fleet::Size(
            std::num::NonZeroU32::MIN,
        ))
        .build()
        .unwrap()
}

/// One cluster for all tests of this binary would be faster, but nextest runs each test in its
/// own process; this file keeps to one test per concern, sharing one cluster per test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_multi_quota_keys_and_shared_exact_limits() {
    let cluster = RedisCluster::start();
    let b = cluster_backend(&cluster);
    let policy = Policy::new("multi", Quota::per_day(1).burst(5)).and(Quota::per_day(1).burst(3));
    let p = prepare(&b, &policy);

    // Many clients, spread over all slots: every multi-quota script runs (no CROSSSLOT), and
    // each client gets exactly its quota.
    for i in 0..60 {
        let k = Key::from_bytes(format!("client-{i}")).unwrap();
        for left in [2, 1, 0] {
            let d = b.decide(&p, &k, cost(1)).await.unwrap();
            assert!(d.is_allowed(), "client {i}: {d:?}");
            assert_eq!(d.quotas()[1].remaining, left);
        }
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert!(!d.is_allowed());
        assert_eq!(
            d.quotas()[0].remaining,
            2,
            "all-or-nothing on the cluster too"
        );
    }
    assert_eq!(b.stats().errors, 0, "{:?}", b.stats());
    // The buckets are spread over the three primaries.
    let per_node: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| {
            n.cmd(&["DBSIZE"])
                .trim()
                .trim_start_matches(':')
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(per_node.iter().sum::<usize>(), 120, "{per_node:?}");
    assert!(per_node.iter().all(|n| *n > 0), "{per_node:?}");

    // Two backends with their own cluster connections hammer one key: exactly the burst.
    let policy = Policy::new("hot", Quota::per_day(1).burst(40));
    let replicas: Vec<_> = (0..2)
        .map(|_| {
            let b = RedisBackend::builder()
                .cluster_nodes(cluster.urls())
                .timeout(Duration::from_secs(2))
                .deny_cache_capacity(0)
                .build()
                .unwrap();
            let p = Arc::new(prepare(&b, &policy));
            (b, p)
        })
        .collect();
    let mut tasks = Vec::new();
    for i in 0..300 {
        let (b, p) = replicas[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let k = Key::from_bytes("hot").unwrap();
            b.decide(&p, &k, cost(1)).await.unwrap().is_allowed()
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += usize::from(t.await.unwrap());
    }
    assert_eq!(allowed, 40);

    // SCRIPT FLUSH on every node: scripts are loaded again where needed.
    for n in &cluster.nodes {
        assert_eq!(n.cmd(&["SCRIPT", "FLUSH"]).trim(), "+OK");
    }
    let k = Key::from_bytes("after-flush").unwrap();
    let d = b.decide(&p_fresh(&b), &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 9);
    assert_eq!(b.stats().errors, 0);
}

/// Fixed and sliding windows mixed with GCRA on the cluster: each decision's keys share one
/// slot (no CROSSSLOT), clients spread over the primaries, all-or-nothing holds, and
/// concurrent decisions on one key admit exactly a window's limit. The script time is fixed
/// (no window boundary passes during the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_windows_mixed_with_gcra() {
    let cluster = RedisCluster::start();
    let clock = TestClock::new();
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_secs(2))
        .test_clock(clock.clone())
        .fleet(tollgate::backend::remote::Fleet::Size(
            std::num::NonZeroU32::MIN,
        ))
        .build()
        .unwrap();
    let policy = Policy::new("win", Quota::per_day(1).burst(5))
        .and(Quota::per_hour(3).fixed_window())
        .and(
            Quota::per_hour(4)
                .sliding_window()
                .resolution(Duration::from_secs(600)),
        );
    let p = prepare(&b, &policy);
    for i in 0..30 {
        let k = Key::from_bytes(format!("client-{i}")).unwrap();
        for left in [[4, 2, 3], [3, 1, 2], [2, 0, 1]] {
            let d = b.decide(&p, &k, cost(1)).await.unwrap();
            assert!(d.is_allowed(), "client {i}: {d:?}");
            let remaining: Vec<u32> = d.quotas().iter().map(|q| q.remaining).collect();
            assert_eq!(remaining, left, "client {i}");
        }
        // The fixed window denies; GCRA and the sliding window keep their units.
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert!(!d.is_allowed());
        let remaining: Vec<u32> = d.quotas().iter().map(|q| q.remaining).collect();
        assert_eq!(remaining, [2, 0, 1], "client {i}: {d:?}");
    }
    assert_eq!(b.stats().errors, 0, "{:?}", b.stats());
    let per_node: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| {
            n.cmd(&["DBSIZE"])
                .trim()
                .trim_start_matches(':')
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(per_node.iter().sum::<usize>(), 90, "{per_node:?}");
    assert!(per_node.iter().all(|n| *n > 0), "{per_node:?}");

    // Two backends with their own connections hammer one key of a fixed window.
    let hot = Policy::new("hot-window", Quota::per_day(40).fixed_window());
    let replicas: Vec<_> = (0..2)
        .map(|_| {
            let b = RedisBackend::builder()
                .cluster_nodes(cluster.urls())
                .timeout(Duration::from_secs(2))
                .deny_cache_capacity(0)
                .test_clock(clock.clone())
                .build()
                .unwrap();
            let p = Arc::new(prepare(&b, &hot));
            (b, p)
        })
        .collect();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (b, p) = replicas[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let k = Key::from_bytes("hot").unwrap();
            b.decide(&p, &k, cost(1)).await.unwrap().is_allowed()
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += usize::from(t.await.unwrap());
    }
    assert_eq!(allowed, 40);
}

fn p_fresh(b: &RedisBackend) -> <RedisBackend as Backend>::Policy {
    prepare(b, &Policy::new("fresh", Quota::per_second(5).burst(10)))
}

#[tokio::test]
async fn an_existing_cluster_connection_can_be_used() {
    let cluster = RedisCluster::start();
    let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
    let conn = client.get_async_connection().await.unwrap();
    let b = RedisBackend::builder()
        .cluster_connection(conn)
        .build()
        .unwrap();
    let p = p_fresh(&b);
    let d = b
        .decide(&p, &Key::ip("192.0.2.7".parse().unwrap()), cost(1))
        .await
        .unwrap();
    assert_eq!(d.quotas()[0].remaining, 9);
}

/// A primary of a cluster with replicas is killed during traffic: requests get the failure
/// policy, each within the timeout, and decisions flow again once its replica is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_fails_over_to_its_replica() {
    use std::time::Instant;
    use tollgate::backend::redis::FailurePolicy;
    let mut cluster = RedisCluster::start_with_replicas(1);
    let timeout = Duration::from_millis(500);
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(timeout)
        .on_failure(FailurePolicy::FailClosed)
        .circuit_breaker(3, Duration::from_millis(200))
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let p = prepare(
        &b,
        &Policy::new("failover", Quota::per_day(1000).burst(1000)),
    );
    let k = Key::from_bytes("k").unwrap();
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    // The primary holding the key (the node that has it, and is a primary).
    let primary = cluster
        .nodes
        .iter()
        .position(|n| {
            n.cmd(&["KEYS", "tollgate:*"]).contains("failover")
                && n.cmd(&["ROLE"]).contains("master")
        })
        .expect("the key's primary");
    cluster.nodes[primary].kill();
    let killed = Instant::now();
    let mut failed = 0;
    let recovered = loop {
        let started = Instant::now();
        let result = b.decide(&p, &k, cost(1)).await;
        assert!(
            started.elapsed() < timeout + Duration::from_millis(500),
            "waited {:?}",
            started.elapsed()
        );
        match result {
            Ok(d) if !d.quotas().is_empty() => break killed.elapsed(),
            _ => failed += 1,
        }
        if killed.elapsed() >= Duration::from_secs(20) {
            let alive = (primary + 1) % cluster.nodes.len();
            panic!(
                "no failover within 20 s: {:?}\n{}",
                b.stats(),
                cluster.nodes[alive].cmd(&["CLUSTER", "NODES"])
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("failover: decisions again after {recovered:?}, {failed} requests failed meanwhile");
    assert!(failed > 0, "the primary's death was noticed");
    // The data was replicated before the kill: the bucket continues (or, if the last write
    // had not reached the replica, starts over); either way decisions are exact from here.
    let d = b.decide(&p, &k, cost(1)).await.unwrap();
    assert!(d.is_allowed());
}

/// Settlements and slots of concurrent quotas on the cluster: the same states as on every
/// backend (the conformance suite's `settlements`), each decision's keys, the sorted set of
/// leases among them, in one slot.
#[tokio::test]
async fn cluster_settlements() {
    let cluster = RedisCluster::start();
    let clock = support::conformance::aligned_test_clock();
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_secs(2))
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::settlements(&b, |by| clock.advance(by), "redis cluster").await;
}

/// Penalties on the cluster: the block's key in the slot of its decision's other keys.
#[tokio::test]
async fn cluster_blocks() {
    let cluster = RedisCluster::start();
    let clock = TestClock::new();
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_secs(2))
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::blocks(&b, |by| clock.advance(by), "redis cluster").await;
}

/// Instances on one cluster count each other through `<prefix>:fleet`, and a stopped one is
/// forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_on_a_cluster_count_each_other() {
    use tollgate::backend::redis::{FailurePolicy, Fleet};
    let cluster = RedisCluster::start();
    let make = || {
        RedisBackend::builder()
            .cluster_nodes(cluster.urls())
            .on_failure(FailurePolicy::FallbackLocal)
            .fleet(Fleet::Announced {
                every: Duration::from_millis(100),
            })
            .build()
            .unwrap()
    };
    let policy = Policy::new("fleet", Quota::per_second(10));
    let (a, b, c) = (make(), make(), make());
    let _pa = prepare(&a, &policy);
    let _pb = prepare(&b, &policy);
    let pc = prepare(&c, &policy);
    support::eventually("three instances count each other", || {
        [&a, &b, &c].iter().all(|x| x.stats().fleet_size == 3)
    })
    .await;
    drop((pc, c));
    support::eventually("a stopped instance is forgotten", || {
        a.stats().fleet_size == 2 && b.stats().fleet_size == 2
    })
    .await;
}

/// Live quota changes on the cluster: the conformance suite's cases.
#[tokio::test]
async fn cluster_quota_changes() {
    let cluster = RedisCluster::start();
    let clock = support::conformance::aligned_test_clock();
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_secs(2))
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::changes(&b, |by| clock.advance(by), "redis cluster").await;
}

/// A fleet's rolling change of a quota: two instances, one limit each, one cluster (issue 45).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_rolling_change_keeps_the_higher_limit() {
    let cluster = RedisCluster::start();
    let clock = TestClock::new();
    let b = || {
        RedisBackend::builder()
            .cluster_nodes(cluster.urls())
            .timeout(Duration::from_secs(2))
            .deny_cache_capacity(0)
            .test_clock(clock.clone())
            .build()
            .unwrap()
    };
    support::conformance::rolling_change(&b(), &b(), "redis cluster").await;
}

/// Calendar quotas at their boundaries on the cluster: the conformance suite's cases.
#[cfg(feature = "calendar")]
#[tokio::test]
async fn cluster_calendar_quotas() {
    let cluster = RedisCluster::start();
    let clock = TestClock::new();
    let start = clock.now_ns() / 1_000_000_000;
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_secs(2))
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::calendar(&b, start, |by| clock.advance(by), "redis cluster").await;
}
