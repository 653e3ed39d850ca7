//! The MySQL backend against real MariaDB servers started by the tests.
#![cfg(feature = "mysql")]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::conformance::{agree_with_local, remote_vectors};
use support::outage::{self, TIMEOUT, allowed_of_concurrent};
use support::sql::MariaDbServer;
use support::{closed_port, cost, key, no_refill, prepare};
use tollgate::backend::mysql::{MysqlBackend, MysqlBackendBuilder};
use tollgate::backend::remote::{FailurePolicy, TestClock};
use tollgate::backend::{Backend, Outcome};
use tollgate::{Policy, Quota};

/// A backend for `server` with a generous timeout for a loaded machine, no deny cache (every
/// decision reaches the database) and no background sweep.
fn builder(server: &MariaDbServer) -> MysqlBackendBuilder {
    MysqlBackend::builder()
        .url(server.url())
        .timeout(Duration::from_secs(5))
        .deny_cache_capacity(0)
        .sweep(None, 1000)
        // A fleet of one: no announcement rows beside the buckets the tests count.
        .fleet(tollgate::backend::remote::Fleet::Size(
            std::num::NonZeroU32::MIN,
        ))
}

async fn migrated(b: MysqlBackendBuilder) -> MysqlBackend {
    let b = b.build().unwrap();
    b.migrate().await.unwrap();
    b
}

#[tokio::test]
async fn conformance_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let make = |clock: TestClock| {
        MysqlBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(5))
            .test_clock(clock)
            .build()
            .unwrap()
    };
    remote_vectors(make, "mysql").await;
}

#[tokio::test]
async fn conformance_mysql_uncached() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    remote_vectors(
        |clock| builder(&server).test_clock(clock).build().unwrap(),
        "mysql uncached",
    )
    .await;
}

/// Random sequences agree with the local backend decision by decision (windows in the same
/// floating-point operations, GCRA in integer nanoseconds).
#[tokio::test]
async fn agrees_with_the_local_backend_on_random_sequences() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    agree_with_local(|clock| builder(&server).test_clock(clock).build().unwrap()).await;
}

/// Reservations, peeks and resets, as on every backend.
#[tokio::test]
async fn modes_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::modes(&b, |by| clock.advance(by), "mysql").await;
}

/// Wait mode: requests that pass at once hold no waiter's slot while MariaDB answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_mysql() {
    let server = MariaDbServer::start();
    let b = migrated(builder(&server)).await;
    support::conformance::waiters(b, "mysql").await;
}

/// Two instances (two pools) and 500 concurrent requests on one key: exactly the burst passes,
/// for every algorithm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_backends_on_separate_pools_allow_exactly_the_burst() {
    let server = MariaDbServer::start();
    let a = migrated(builder(&server)).await;
    let b = builder(&server).build().unwrap();
    for (i, quota) in [
        no_refill(100),
        Quota::per_day(100).fixed_window(),
        Quota::per_day(100).sliding_window(),
    ]
    .into_iter()
    .enumerate()
    {
        let policy = Policy::new(format!("exact{i}"), quota);
        let allowed = allowed_of_concurrent(&[a.clone(), b.clone()], &policy, 500).await;
        assert_eq!(allowed, 100, "{quota}");
    }
    let s = a.stats();
    assert!(
        s.calls < s.decisions,
        "concurrent decisions share calls: {s:?}"
    );
    assert_eq!(s.errors, 0, "{s:?}");
}

/// A deadlock the database resolves by rolling the call back (1213) is sent again, and the
/// bucket is charged once. The procedure locks its keys in ascending order, so calls never
/// deadlock on each other: another transaction forces it, holding the higher key of a
/// two-quota policy while the call holds the lower one and waits, then asking for the lower
/// one. That transaction has inserted many rows, so the database rolls the call back (the
/// lighter transaction), which waits again, and decides once the transaction commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlocks_are_retried_and_stay_exact() {
    use tollgate::backend::mysql::mysql_async::{self, prelude::Queryable};

    let server = MariaDbServer::start();
    // A long timeout (and so a long lock wait on the server): on a loaded machine the checks
    // below can take seconds to see the call waiting.
    let slow = builder(&server).timeout(Duration::from_secs(30));
    let b = migrated(slow.on_failure(FailurePolicy::FailClosed)).await;
    let policy = Policy::new("conflicts", no_refill(10)).and(no_refill(10));
    let p = Arc::new(prepare(&b, &policy));
    assert!(
        b.decide(&p, &key("hot"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    let keys = server.sql("SELECT HEX(k) FROM tollgate_buckets ORDER BY k");
    let keys: Vec<&str> = keys.lines().collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    server.sql("CREATE TABLE heavy (i INT PRIMARY KEY)");

    let pool = mysql_async::Pool::new(server.url().as_str());
    let mut other = pool.get_conn().await.unwrap();
    other.query_drop("START TRANSACTION").await.unwrap();
    other
        .query_drop(
            "INSERT INTO heavy WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s \
             WHERE i < 1000) SELECT i FROM s",
        )
        .await
        .unwrap();
    let lock =
        |hex: &str| format!("SELECT n FROM tollgate_buckets WHERE k = UNHEX('{hex}') FOR UPDATE");
    other.query_drop(lock(keys[1])).await.unwrap();

    let (b2, p2) = (b.clone(), p.clone());
    let call = tokio::spawn(async move { b2.decide(&p2, &key("hot"), cost(1)).await });
    // The call holds the lower key and waits for the higher one.
    let started = Instant::now();
    while server
        .sql("SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'")
        != "1"
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the call never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    other.query_drop(lock(keys[0])).await.unwrap();
    // The call was the deadlock's victim (had the transaction been, the statement above
    // would have failed), and hears of it a moment later.
    support::eventually("the call is sent again", || b.conflicts_retried() == 1).await;
    other.query_drop("COMMIT").await.unwrap();
    let d = call.await.unwrap().unwrap();
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.quotas()[0].remaining, 8);
    assert_eq!(d.quotas()[1].remaining, 8);
    // Charged once: the rolled-back attempt took nothing.
    let d = b.decide(&p, &key("hot"), cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 7);
    assert_eq!(d.quotas()[1].remaining, 7);
    assert_eq!(b.stats().errors, 0, "{:?}", b.stats());
    drop(other);
    pool.disconnect().await.unwrap();
}

#[tokio::test]
async fn multi_quota_is_all_or_nothing() {
    let server = MariaDbServer::start();
    let b = migrated(builder(&server)).await;
    let p = prepare(&b, &Policy::new("multi", no_refill(5)).and(no_refill(3)));
    let k = key("tenant");
    for left in [2, 1, 0] {
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.quotas()[1].remaining, left);
    }
    for _ in 0..3 {
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.quotas()[0].outcome, Outcome::Allowed);
        assert_eq!(d.quotas()[0].remaining, 2, "untouched by denials");
    }
    // A window and GCRA in one policy; a cost too large for one quota takes nothing.
    let p2 = prepare(
        &b,
        &Policy::new("mixed", no_refill(10)).and(Quota::per_day(4).fixed_window()),
    );
    assert!(b.decide(&p2, &k, cost(3)).await.unwrap().is_allowed());
    let d = b.decide(&p2, &k, cost(3)).await.unwrap();
    assert!(!d.is_allowed());
    assert_eq!(d.quotas()[0].remaining, 7);
    let d = b.decide(&p2, &k, cost(5)).await.unwrap();
    assert!(d.never_fits());
    // Reported by the quota it can never fit alone (4 a day, 3 used), and nothing taken.
    assert_eq!((d.quotas().len(), d.quotas()[0].index), (1, 1), "{d:?}");
    assert_eq!(d.quotas()[0].remaining, 1);
    let d = b
        .decide_with(&p2, &k, cost(1), tollgate::backend::Mode::Peek)
        .await
        .unwrap();
    assert_eq!(
        d.quotas()[0].remaining,
        6,
        "the first quota untouched: {d:?}"
    );
    let rows = server.sql("SELECT count(*) FROM tollgate_buckets");
    assert_eq!(rows, "4");
}

/// Migrating twice changes nothing; a custom schema and table hold their own buckets.
#[tokio::test]
async fn migration_is_idempotent_and_names_are_configurable() {
    let server = MariaDbServer::start();
    server.sql("CREATE DATABASE limits");
    let b = migrated(builder(&server).schema("limits").table("buckets")).await;
    b.migrate().await.unwrap();
    let p = prepare(&b, &Policy::new("m", no_refill(2)));
    assert!(b.decide(&p, &key("k"), cost(2)).await.unwrap().is_allowed());
    b.migrate().await.unwrap();
    assert!(!b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert_eq!(server.sql("SELECT count(*) FROM limits.buckets"), "1");
    // Nothing in the connection's own database.
    assert_eq!(
        server.sql("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = 'test'"),
        "0"
    );
    assert!(b.migration_sql().contains("`limits`.`buckets_decide_2`"));
    // Instances starting together migrate one after another.
    let others: Vec<MysqlBackend> = (0..3)
        .map(|_| {
            builder(&server)
                .schema("limits")
                .table("buckets")
                .build()
                .unwrap()
        })
        .collect();
    let (rx, ry, rz, rb) = tokio::join!(
        others[0].migrate(),
        others[1].migrate(),
        others[2].migrate(),
        b.migrate()
    );
    for r in [rx, ry, rz, rb] {
        r.unwrap();
    }
    assert!(!b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    // Bad names are configuration errors.
    for bad in ["a-b", "x`; DROP TABLE t; --", ""] {
        assert!(builder(&server).table(bad).build().is_err(), "{bad:?}");
        assert!(builder(&server).schema(bad).build().is_err(), "{bad:?}");
    }
}

/// Instances migrating while others decide: the procedure, unchanged, is left alone, so no
/// decision fails; a procedure that differs (here: missing) is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_again_while_deciding_fails_nothing() {
    let server = MariaDbServer::start();
    let b = migrated(builder(&server).on_failure(FailurePolicy::FailClosed)).await;
    let p = Arc::new(prepare(&b, &Policy::new("busy", no_refill(10_000))));
    let deciding = {
        let (b, p) = (b.clone(), p.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while n < 300 {
                b.decide(&p, &key("k"), cost(1)).await.unwrap();
                n += 1;
            }
        })
    };
    for _ in 0..10 {
        migrated(builder(&server)).await;
    }
    deciding.await.unwrap();
    assert_eq!(b.stats().errors, 0, "{:?}", b.stats());

    server.sql("DROP PROCEDURE tollgate_buckets_decide_2");
    assert!(b.decide(&p, &key("k"), cost(1)).await.is_err());
    b.migrate().await.unwrap();
    let d = b.decide(&p, &key("k"), cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 10_000 - 301);
}

/// Rows of idle buckets are swept; busy ones stay; a reset forgets a client.
#[tokio::test]
async fn idle_rows_are_swept_and_keys_reset() {
    let server = MariaDbServer::start();
    let b = migrated(builder(&server)).await;
    let fast = prepare(&b, &Policy::new("fast", Quota::per_second(1000).burst(1)));
    let slow = prepare(&b, &Policy::new("slow", no_refill(5)));
    for i in 0..50 {
        b.decide(&fast, &key(&format!("k{i}")), cost(1))
            .await
            .unwrap();
    }
    b.decide(&slow, &key("k"), cost(5)).await.unwrap();
    assert_eq!(server.sql("SELECT count(*) FROM tollgate_buckets"), "51");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(b.sweep().await.unwrap(), 50);
    assert_eq!(server.sql("SELECT count(*) FROM tollgate_buckets"), "1");
    assert_eq!(b.swept(), 50);
    assert!(
        !b.decide(&slow, &key("k"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    assert_eq!(b.reset(&slow, &key("k")).await.unwrap(), 1);
    assert!(
        b.decide(&slow, &key("k"), cost(5))
            .await
            .unwrap()
            .is_allowed()
    );

    // The background sweep does the same by itself.
    let auto = MysqlBackend::builder()
        .url(server.url())
        .sweep(Some(Duration::from_millis(50)), 10)
        .build()
        .unwrap();
    let p = prepare(
        &auto,
        &Policy::new("fast", Quota::per_second(1000).burst(1)),
    );
    for i in 0..30 {
        auto.decide(&p, &key(&format!("a{i}")), cost(1))
            .await
            .unwrap();
    }
    support::eventually("the background sweep deletes idle rows", || {
        auto.swept() >= 30
    })
    .await;
}

fn failing(url: &str, on_failure: FailurePolicy) -> MysqlBackend {
    MysqlBackend::builder()
        .url(url)
        .timeout(TIMEOUT)
        .on_failure(on_failure)
        .circuit_breaker(3, Duration::from_millis(100))
        .sweep(None, 1)
        .build()
        .unwrap()
}

/// The database killed mid-stream and restarted, under each failure policy: answers within the
/// timeout meanwhile, shared limits again after the restart.
#[tokio::test]
async fn killed_database_gets_the_failure_policy_and_recovers() {
    let mut server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let url = server.url();
    outage::killed_and_restarted(&mut server, |on_failure| failing(&url, on_failure)).await;
}

/// Instances on one database count each other, and fall back to their share of each quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_count_each_other_and_fall_back_to_their_share() {
    let mut server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let url = server.url();
    let make = |fleet| {
        MysqlBackend::builder()
            .url(url.clone())
            .timeout(TIMEOUT)
            .on_failure(FailurePolicy::FallbackLocal)
            .circuit_breaker(3, Duration::from_millis(100))
            .sweep(None, 1)
            .fleet(fleet)
            .build()
            .unwrap()
    };
    outage::fleet_shares(&mut server, make, |b| b.stats().fleet_size).await;
}

/// A frozen database (connections open, nothing answers) costs each request the timeout at
/// most.
#[tokio::test]
async fn frozen_database_costs_at_most_the_timeout() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    outage::frozen(&server, &failing(&server.url(), FailurePolicy::FailOpen)).await;
}

/// Building never connects; a database that refuses connections is reported as such, and no
/// password is ever shown.
#[tokio::test]
async fn down_at_start_refused_and_no_password_shown() {
    let url = format!("mysql://app:s3cret-pw@127.0.0.1:{}/app", closed_port());
    let b = MysqlBackend::builder()
        .url(&url)
        .timeout(Duration::from_millis(200))
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    assert_eq!(
        b.endpoint(),
        format!("mysql://app@127.0.0.1:{}/app", closed_port_of(&url))
    );
    let p = prepare(&b, &Policy::new("down", no_refill(1)));
    let err = b.decide(&p, &key("k"), cost(1)).await.unwrap_err();
    assert!(!err.to_string().contains("s3cret"), "{err}");
    assert!(!format!("{b:?}").contains("s3cret"));
    let err = b.migrate().await.unwrap_err();
    assert!(!err.to_string().contains("s3cret"), "{err}");
    support::eventually("the cause is known", || b.stats().failing.is_some()).await;
    assert_eq!(
        b.stats().failing.unwrap().to_string(),
        "connection refused",
        "{:?}",
        b.stats()
    );
}

fn closed_port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// A black-holed path to the database (packets vanish, connections stay open): each request
/// costs at most the timeout, and once the path heals the backend replaces its pool and
/// decides again.
#[tokio::test]
async fn a_black_holed_connection_is_replaced() {
    use support::proxy::FaultProxy;
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let proxy = FaultProxy::start(server.port).await;
    let b = MysqlBackend::builder()
        // Over TCP through the proxy: mysql_async would otherwise switch to the server's Unix
        // socket when it finds itself on the same host.
        .url(format!(
            "mysql://root@127.0.0.1:{}/test?prefer_socket=false",
            proxy.port
        ))
        .timeout(TIMEOUT)
        .on_failure(FailurePolicy::FailClosed)
        .circuit_breaker(3, Duration::from_millis(100))
        .sweep(None, 1)
        .build()
        .unwrap();
    outage::black_holed(&proxy, &b).await;
}

impl outage::Remote for MysqlBackend {
    fn stats(&self) -> tollgate::backend::remote::RemoteStats {
        MysqlBackend::stats(self)
    }
}

/// A URL the driver refuses is shown in the error with its user name, its password masked.
#[test]
fn url_errors_show_user_names_and_hide_passwords() {
    let err = MysqlBackend::builder()
        .url("postgres://postgres@127.0.0.1:5432/x")
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("postgres://postgres@127.0.0.1:5432/x"),
        "{err}"
    );
    assert!(err.contains("scheme `postgres'"), "{err}");
    assert!(!err.contains("***"), "{err}");
    let err = MysqlBackend::builder()
        .url("postgres://app:hunter2@127.0.0.1:5432/x")
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("postgres://app:***@127.0.0.1:5432/x"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}
/// Settlements and slots, as on every backend that settles.
#[tokio::test]
async fn settlements_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let clock = support::conformance::aligned_test_clock();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::settlements(&b, |by| clock.advance(by), "mysql").await;
}

/// Penalties, as on every backend that blocks.
#[tokio::test]
async fn blocks_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::blocks(&b, |by| clock.advance(by), "mysql").await;
}

/// Leases expire: a killed instance's slots come back.
#[tokio::test]
async fn leases_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::leases(&b, |by| clock.advance(by), "mysql").await;
}

/// A concurrent quota larger than a row can hold leases for is refused when the layer is built.
#[tokio::test]
async fn too_many_slots_for_a_row_are_refused() {
    let url = format!("mysql://root@127.0.0.1:{}/test", closed_port());
    let b = MysqlBackend::builder().url(url).build().unwrap();
    let err = tollgate::RateLimitLayer::builder()
        .key(tollgate::key::Global)
        .backend(b)
        .policy(Policy::new("exports", Quota::concurrent(1000)))
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("256") && err.contains("exports"), "{err}");
}

/// Units and slots given back by another instance are seen at once, whatever this one's deny
/// cache holds.
#[tokio::test]
async fn the_deny_cache_sees_what_other_instances_give_back() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    // With their deny caches, which the other tests here leave off.
    let cached = || builder(&server).deny_cache_capacity(1000).build().unwrap();
    support::conformance::others_give_back(&cached(), &cached(), "mysql").await;
}

/// Issue 35: a flood of fresh keys on every algorithm: new clients served, spent keys refused,
/// and what each fresh key costs the table (printed: BENCHMARKS.md has the numbers).
#[tokio::test]
async fn a_flood_of_fresh_keys_limits_every_key() {
    let server = MariaDbServer::start();
    let b = migrated(builder(&server)).await;
    for quota in support::conformance::FLOOD_QUOTAS {
        let n = 2_000;
        let name = support::conformance::flood(&b, quota, n, "mysql").await;
        let row = server.sql(&format!(
            "SELECT ROUND(AVG(LENGTH(k) + IFNULL(LENGTH(c), 0) + 24)) FROM tollgate_buckets \
             WHERE k LIKE '%{name}%fresh%'"
        ));
        eprintln!("mysql, \"{quota}\": {row} bytes of data per row");
    }
}

/// Live quota changes: the conformance suite's cases.
#[tokio::test]
async fn quota_changes_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let clock = support::conformance::aligned_test_clock();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::changes(&b, |by| clock.advance(by), "mysql").await;
}

/// A fleet's rolling change of a quota: two instances, one limit each, one store (issue 45).
#[tokio::test]
async fn a_rolling_change_keeps_the_higher_limit_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = || builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::rolling_change(&b(), &b(), "mysql").await;
}

/// Calendar quotas at their boundaries on MySQL / MariaDB (the instance computes the windows
/// around its time, the database's time picks one; no time zone tables): the conformance
/// suite's cases, without and with the deny cache. Each row expires at its window's end, and
/// is swept past it.
#[cfg(feature = "calendar")]
#[tokio::test]
async fn calendar_quotas_mysql() {
    let server = MariaDbServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let start = clock.now_ns() / 1_000_000_000;
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::calendar(&b, start, |by| clock.advance(by), "mysql").await;
    // The monthly plan's window ends on 31 March 2026, 09:00 EDT; the daily ones (in Berlin
    // last) on 9 March, 23:00 UTC.
    assert_eq!(
        server.sql(
            "SELECT GROUP_CONCAT(expires_us ORDER BY expires_us SEPARATOR ',') FROM tollgate_buckets"
        ),
        "1773097200000000,1773097200000000,1774962000000000"
    );
    // Those ends are past on the database's clock: the sweep deletes the rows.
    assert_eq!(b.sweep().await.unwrap(), 3);
    assert_eq!(server.sql("SELECT COUNT(*) FROM tollgate_buckets"), "0");
    let clock = TestClock::new();
    let cached = builder(&server)
        .deny_cache_capacity(1000)
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::calendar(&cached, start, |by| clock.advance(by), "mysql-cached").await;

    // The database's time picks the window of the two the instance sends (here by hand: the
    // days around 9 March's midnight in New York, 23 hours then 24; calendar id 7, limit 3):
    // 2 hours after the boundary it counts in the day after, 3 hours before it in the day
    // before (the clocks may differ by up to half a window), past both in the nearer.
    let mar_9: i64 = 1_773_028_800;
    let numbers = format!("5,{},3,{}", mar_9 << 20 | 7, (23 * 3600_i64) << 32 | 86_400);
    // `call(key, now (s), cost, arg, op)`.
    let call = |key: &str, now_s: i64, cost: u32, arg: i64, op: u8| {
        server.sql(&format!(
            "CALL tollgate_buckets_decide_2('{key};{cost},{arg},{op}|{numbers},{key}', {})",
            now_s * 1_000_000_000
        ))
    };
    assert_eq!(call("01", mar_9 + 2 * 3600, 1, 0, 0), "0,1,79200000000");
    assert_eq!(call("02", mar_9 - 3 * 3600, 1, 0, 0), "0,1,10800000000");
    assert_eq!(call("03", mar_9 + 25 * 3600, 1, 0, 0), "0,1,1");
    // Each row keeps its window's end, its count and its values (id, limit, 0), and expires
    // at that end.
    assert_eq!(
        server.sql(
            "SELECT GROUP_CONCAT(CONCAT_WS(' ', HEX(k), a, n, c, expires_us) ORDER BY k \
             SEPARATOR ';') FROM tollgate_buckets WHERE LENGTH(k) = 1"
        ),
        "01 1773115200 1 ;7,3,0,2 1773115200000000;\
         02 1773028800 1 ;7,3,0,2 1773028800000000;\
         03 1773115200 1 ;7,3,0,2 1773115200000000"
    );
    // Settlements in key 01's window, 2 hours into it: a debit of 2; a refund of a unit taken
    // 3 hours ago (before the window) is not given back, of one taken an hour ago is; a peek
    // takes nothing; then one more fits, and no more.
    let (at, hour) = (mar_9 + 2 * 3600, 3_600_000_000);
    assert_eq!(call("01", at, 2, 0, 4), "0,3,79200000000");
    assert_eq!(call("01", at, 1, 3 * hour, 3), "0,3,79200000000");
    assert_eq!(call("01", at, 1, hour, 3), "0,2,79200000000");
    assert_eq!(call("01", at, 1, 0, 1), "0,3,79200000000");
    assert_eq!(call("01", at, 1, 0, 0), "0,3,79200000000");
    assert_eq!(call("01", at, 1, 0, 0), "1,3,79200000000");
}
