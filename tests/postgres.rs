//! The PostgreSQL backend against real PostgreSQL servers started by the tests.
#![cfg(feature = "postgres")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::conformance::{agree_with_local, remote_vectors};
use support::outage::{self, TIMEOUT, allowed_of_concurrent};
use support::sql::PgServer;
use support::{closed_port, cost, key, no_refill, prepare};
use tollgate::backend::postgres::{PostgresBackend, PostgresBackendBuilder};
use tollgate::backend::remote::{FailurePolicy, TestClock};
use tollgate::backend::{Backend, Outcome};
use tollgate::{Policy, Quota};

/// A backend for `server` with a generous timeout for a loaded machine, no deny cache (every
/// decision reaches the database) and no background sweep.
fn builder(server: &PgServer) -> PostgresBackendBuilder {
    PostgresBackend::builder()
        .url(server.url())
        .timeout(Duration::from_secs(5))
        .deny_cache_capacity(0)
        .sweep(None, 1000)
        // A fleet of one: no announcement rows beside the buckets the tests count.
        .fleet(tollgate::backend::remote::Fleet::Size(
            std::num::NonZeroU32::MIN,
        ))
}

async fn migrated(b: PostgresBackendBuilder) -> PostgresBackend {
    let b = b.build().unwrap();
    b.migrate().await.unwrap();
    b
}

#[tokio::test]
async fn conformance_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let make = |clock: TestClock| {
        PostgresBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(5))
            .test_clock(clock)
            .build()
            .unwrap()
    };
    remote_vectors(make, "postgres").await;
}

#[tokio::test]
async fn conformance_postgres_uncached() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    remote_vectors(
        |clock| builder(&server).test_clock(clock).build().unwrap(),
        "postgres uncached",
    )
    .await;
}

/// Random sequences agree with the local backend decision by decision (windows in the same
/// floating-point operations, GCRA in integer nanoseconds).
#[tokio::test]
async fn agrees_with_the_local_backend_on_random_sequences() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    agree_with_local(|clock| builder(&server).test_clock(clock).build().unwrap()).await;
}

/// Reservations, peeks and resets, as on every backend.
#[tokio::test]
async fn modes_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::modes(&b, |by| clock.advance(by), "postgres").await;
}

/// Wait mode: requests that pass at once hold no waiter's slot while PostgreSQL answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_postgres() {
    let server = PgServer::start();
    let b = migrated(builder(&server)).await;
    support::conformance::waiters(b, "postgres").await;
}

/// Two instances (two pools) and 500 concurrent requests on one key: exactly the burst passes,
/// for every algorithm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_backends_on_separate_pools_allow_exactly_the_burst() {
    let server = PgServer::start();
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

/// Conflicts the database resolves by rolling a call back (sessions under REPEATABLE READ:
/// a call that waited for another fails with 40001) are sent again, and the limit stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serialization_failures_are_retried_and_stay_exact() {
    let server = PgServer::start();
    server.psql("ALTER DATABASE postgres SET default_transaction_isolation = 'repeatable read'");
    let a = migrated(builder(&server).on_failure(FailurePolicy::FailClosed)).await;
    let b = builder(&server)
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let policy = Policy::new("conflicts", no_refill(40));
    let (pa, pb) = (
        Arc::new(prepare(&a, &policy)),
        Arc::new(prepare(&b, &policy)),
    );
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (be, p) = if i % 2 == 0 {
            (a.clone(), pa.clone())
        } else {
            (b.clone(), pb.clone())
        };
        tasks.push(tokio::spawn(async move {
            be.decide(&p, &key("hot"), cost(1)).await
        }));
    }
    let (mut allowed, mut denied, mut failed) = (0, 0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(d) if d.is_allowed() => allowed += 1,
            Ok(_) => denied += 1,
            Err(_) => failed += 1,
        }
    }
    let retried = a.conflicts_retried() + b.conflicts_retried();
    assert!(allowed <= 40, "over the limit: {allowed}");
    // What the bucket holds now is what was taken: nothing charged twice.
    server.psql("ALTER DATABASE postgres SET default_transaction_isolation = 'read committed'");
    let c = migrated(builder(&server)).await;
    let left = c
        .decide(&prepare(&c, &policy), &key("hot"), cost(1))
        .await
        .unwrap();
    assert_eq!(
        allowed + left.quotas()[0].remaining as usize + usize::from(left.is_allowed()),
        40,
        "allowed {allowed}, denied {denied}, failed {failed}, retried {retried}: {left:?}"
    );
}

/// A call waiting for a row another transaction holds fails with a serialization failure once
/// that transaction commits (sessions under REPEATABLE READ): it is sent again, and charged
/// once.
#[tokio::test]
async fn a_forced_serialization_failure_is_sent_again_and_charged_once() {
    let server = PgServer::start();
    server.psql("ALTER DATABASE postgres SET default_transaction_isolation = 'repeatable read'");
    let b = migrated(builder(&server).on_failure(FailurePolicy::FailClosed)).await;
    let p = prepare(&b, &Policy::new("forced", no_refill(10)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    let mut holder = server.psql_spawn(
        "BEGIN; UPDATE tollgate_buckets SET n = n \
         WHERE position('forced' IN convert_from(k, 'UTF8')) > 0; \
         SELECT pg_sleep(0.5); COMMIT;",
    );
    // Until the holder has the row.
    support::eventually("the other transaction holds the row", || {
        server.psql("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND granted")
            != "0"
    })
    .await;
    let d = b.decide(&p, &key("k"), cost(1)).await.unwrap();
    assert!(holder.wait().unwrap().success());
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.quotas()[0].remaining, 8, "charged once: {d:?}");
    assert!(b.conflicts_retried() >= 1);
}

#[tokio::test]
async fn multi_quota_is_all_or_nothing() {
    let server = PgServer::start();
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
    let rows = server.psql("SELECT count(*) FROM tollgate_buckets");
    assert_eq!(rows, "4");
}

/// Migrating twice changes nothing; a custom schema and table hold their own buckets.
#[tokio::test]
async fn migration_is_idempotent_and_names_are_configurable() {
    let server = PgServer::start();
    server.psql("CREATE SCHEMA limits");
    let b = migrated(
        builder(&server)
            .schema("limits")
            .table("buckets")
            .unlogged(true),
    )
    .await;
    b.migrate().await.unwrap();
    let p = prepare(&b, &Policy::new("m", no_refill(2)));
    assert!(b.decide(&p, &key("k"), cost(2)).await.unwrap().is_allowed());
    b.migrate().await.unwrap();
    assert!(!b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert_eq!(server.psql("SELECT count(*) FROM limits.buckets"), "1");
    assert_eq!(
        server.psql("SELECT relpersistence FROM pg_class WHERE relname = 'buckets'"),
        "u"
    );
    assert!(
        b.migration_sql()
            .contains("\"limits\".\"buckets_decide_2\"")
    );
    // Instances starting together migrate one after another.
    let (x, y) = (b.clone(), b.clone());
    let (rx, ry) = tokio::join!(x.migrate(), y.migrate());
    rx.unwrap();
    ry.unwrap();
    // Bad names are configuration errors.
    for bad in ["a-b", "x\"; DROP TABLE t; --", ""] {
        assert!(builder(&server).table(bad).build().is_err(), "{bad:?}");
    }
}

/// Rows of idle buckets are swept; busy ones stay; a reset forgets a client.
#[tokio::test]
async fn idle_rows_are_swept_and_keys_reset() {
    let server = PgServer::start();
    let b = migrated(builder(&server)).await;
    let fast = prepare(&b, &Policy::new("fast", Quota::per_second(1000).burst(1)));
    let slow = prepare(&b, &Policy::new("slow", no_refill(5)));
    for i in 0..50 {
        b.decide(&fast, &key(&format!("k{i}")), cost(1))
            .await
            .unwrap();
    }
    b.decide(&slow, &key("k"), cost(5)).await.unwrap();
    assert_eq!(server.psql("SELECT count(*) FROM tollgate_buckets"), "51");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(b.sweep().await.unwrap(), 50);
    assert_eq!(server.psql("SELECT count(*) FROM tollgate_buckets"), "1");
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
    let auto = PostgresBackend::builder()
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

fn failing(url: &str, on_failure: FailurePolicy) -> PostgresBackend {
    PostgresBackend::builder()
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
    let mut server = PgServer::start();
    migrated(builder(&server)).await;
    let url = server.url();
    outage::killed_and_restarted(&mut server, |on_failure| failing(&url, on_failure)).await;
}

/// Instances on one database count each other, and fall back to their share of each quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_count_each_other_and_fall_back_to_their_share() {
    let mut server = PgServer::start();
    migrated(builder(&server)).await;
    let url = server.url();
    let make = |fleet| {
        PostgresBackend::builder()
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
    let server = PgServer::start();
    migrated(builder(&server)).await;
    outage::frozen(&server, &failing(&server.url(), FailurePolicy::FailOpen)).await;
}

/// Building never connects; a database that refuses connections is reported as such, and no
/// password is ever shown.
#[tokio::test]
async fn down_at_start_refused_and_no_password_shown() {
    let url = format!("postgres://app:s3cret-pw@127.0.0.1:{}/app", closed_port());
    let b = PostgresBackend::builder()
        .url(&url)
        .timeout(Duration::from_millis(200))
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    assert_eq!(
        b.endpoint(),
        format!("postgres://app@127.0.0.1:{}/app", closed_port_of(&url))
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
/// costs at most the timeout, and once the path heals the backend drops its dead connections
/// and decides again.
#[tokio::test]
async fn a_black_holed_connection_is_replaced() {
    use support::proxy::FaultProxy;
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let proxy = FaultProxy::start(server.port).await;
    let b = PostgresBackend::builder()
        .url(format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
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

impl outage::Remote for PostgresBackend {
    fn stats(&self) -> tollgate::backend::remote::RemoteStats {
        PostgresBackend::stats(self)
    }
}

/// A URL the driver refuses is shown in the error with its user name, its password masked.
#[test]
fn url_errors_show_user_names_and_hide_passwords() {
    for (url, shown) in [
        (
            "postgres://app@127.0.0.1:5432/x?sslmode=sometimes",
            "postgres://app@127.0.0.1:5432/x?sslmode=sometimes",
        ),
        (
            "postgres://app:hunter2@127.0.0.1:5432/x?sslmode=sometimes",
            "postgres://app:***@127.0.0.1:5432/x?sslmode=sometimes",
        ),
    ] {
        let err = PostgresBackend::builder()
            .url(url)
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains(shown), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}

/// Settlements and slots, as on every backend that settles.
#[tokio::test]
async fn settlements_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let clock = support::conformance::aligned_test_clock();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::settlements(&b, |by| clock.advance(by), "postgres").await;
}

/// Penalties, as on every backend that blocks.
#[tokio::test]
async fn blocks_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::blocks(&b, |by| clock.advance(by), "postgres").await;
}

/// Leases expire: a killed instance's slots come back.
#[tokio::test]
async fn leases_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::leases(&b, |by| clock.advance(by), "postgres").await;
}

/// Units and slots given back by another instance are seen at once, whatever this one's deny
/// cache holds.
#[tokio::test]
async fn the_deny_cache_sees_what_other_instances_give_back() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    // With their deny caches, which the other tests here leave off.
    let cached = || builder(&server).deny_cache_capacity(1000).build().unwrap();
    support::conformance::others_give_back(&cached(), &cached(), "postgres").await;
}

/// Issue 35: a flood of fresh keys on every algorithm: new clients served, spent keys refused,
/// and what each fresh key costs the table (printed: BENCHMARKS.md has the numbers).
#[tokio::test]
async fn a_flood_of_fresh_keys_limits_every_key() {
    let server = PgServer::start();
    let b = migrated(builder(&server)).await;
    for quota in support::conformance::FLOOD_QUOTAS {
        let before: i64 = server
            .psql("SELECT pg_total_relation_size('tollgate_buckets')")
            .parse()
            .unwrap();
        let n = 2_000;
        let name = support::conformance::flood(&b, quota, n, "postgres").await;
        let after: i64 = server
            .psql("SELECT pg_total_relation_size('tollgate_buckets')")
            .parse()
            .unwrap();
        let tuple = server.psql(&format!(
            "SELECT round(avg(pg_column_size(t.*))) FROM tollgate_buckets t \
             WHERE k LIKE '%{name}%fresh%'::bytea"
        ));
        eprintln!(
            "postgres, \"{quota}\": {tuple} bytes per row, {} bytes per key with pages and index",
            (after - before) / n as i64
        );
    }
}

/// Live quota changes: the conformance suite's cases.
#[tokio::test]
async fn quota_changes_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let clock = support::conformance::aligned_test_clock();
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::changes(&b, |by| clock.advance(by), "postgres").await;
}

/// A fleet's rolling change of a quota: two instances, one limit each, one store (issue 45).
#[tokio::test]
async fn a_rolling_change_keeps_the_higher_limit_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let b = || builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::rolling_change(&b(), &b(), "postgres").await;
}

/// Calendar quotas at their boundaries on PostgreSQL (the instance computes the windows around
/// its time, the database's time picks one): the conformance suite's cases, without and with
/// the deny cache. Each row expires at its window's end, and is swept past it.
#[cfg(feature = "calendar")]
#[tokio::test]
async fn calendar_quotas_postgres() {
    let server = PgServer::start();
    migrated(builder(&server)).await;
    let clock = TestClock::new();
    let start = clock.now_ns() / 1_000_000_000;
    let b = builder(&server).test_clock(clock.clone()).build().unwrap();
    support::conformance::calendar(&b, start, |by| clock.advance(by), "postgres").await;
    // The monthly plan's window ends on 31 March 2026, 09:00 EDT; the daily ones (in Berlin
    // last) on 9 March, 23:00 UTC.
    assert_eq!(
        server.psql(
            "SELECT string_agg(expires_us::text, ',' ORDER BY expires_us) FROM tollgate_buckets"
        ),
        "1773097200000000,1773097200000000,1774962000000000"
    );
    // Those ends are past on the database's clock: the sweep deletes the rows.
    assert_eq!(b.sweep().await.unwrap(), 3);
    assert_eq!(server.psql("SELECT count(*) FROM tollgate_buckets"), "0");
    let clock = TestClock::new();
    let cached = builder(&server)
        .deny_cache_capacity(1000)
        .test_clock(clock.clone())
        .build()
        .unwrap();
    support::conformance::calendar(&cached, start, |by| clock.advance(by), "postgres-cached").await;

    // The database's time picks the window of the two the instance sends (here by hand: the
    // days around 9 March's midnight in New York, 23 hours then 24; calendar id 7, limit 3):
    // 2 hours after the boundary it counts in the day after, 3 hours before it in the day
    // before (the clocks may differ by up to half a window), past both in the nearer.
    let mar_9: i64 = 1_773_028_800;
    let numbers = format!(
        "5, {}, 3, {}",
        mar_9 << 20 | 7,
        (23 * 3600_i64) << 32 | 86_400
    );
    // `call(key, now (s), cost, arg, op)`.
    let call = |key: &str, now_s: i64, cost: u32, arg: i64, op: u8| {
        server.psql(&format!(
            "SELECT tollgate_buckets_decide_2(ARRAY['\\x{key}'::bytea], ARRAY[{numbers}]::bigint[], \
             ARRAY[1, {cost}, {arg}, {op}]::bigint[], {}::bigint)",
            now_s * 1_000_000_000
        ))
    };
    assert_eq!(call("01", mar_9 + 2 * 3600, 1, 0, 0), "{0,1,79200000000}");
    assert_eq!(call("02", mar_9 - 3 * 3600, 1, 0, 0), "{0,1,10800000000}");
    assert_eq!(call("03", mar_9 + 25 * 3600, 1, 0, 0), "{0,1,1}");
    // Each row keeps its window's end, its count and its values (id, limit, 0), and expires
    // at that end.
    assert_eq!(
        server.psql(
            "SELECT string_agg(concat_ws(' ', encode(k, 'hex'), a, n, c, expires_us), ';' \
             ORDER BY k) FROM tollgate_buckets WHERE octet_length(k) = 1"
        ),
        "01 1773115200 1 {7,3,0,2} 1773115200000000;\
         02 1773028800 1 {7,3,0,2} 1773028800000000;\
         03 1773115200 1 {7,3,0,2} 1773115200000000"
    );
    // Settlements in key 01's window, 2 hours into it: a debit of 2; a refund of a unit taken
    // 3 hours ago (before the window) is not given back, of one taken an hour ago is; a peek
    // takes nothing; then one more fits, and no more.
    let (at, hour) = (mar_9 + 2 * 3600, 3_600_000_000);
    assert_eq!(call("01", at, 2, 0, 4), "{0,3,79200000000}");
    assert_eq!(call("01", at, 1, 3 * hour, 3), "{0,3,79200000000}");
    assert_eq!(call("01", at, 1, hour, 3), "{0,2,79200000000}");
    assert_eq!(call("01", at, 1, 0, 1), "{0,3,79200000000}");
    assert_eq!(call("01", at, 1, 0, 0), "{0,3,79200000000}");
    assert_eq!(call("01", at, 1, 0, 0), "{1,3,79200000000}");
}
