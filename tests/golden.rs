//! Stored state survives upgrades: state in each stored format (format 2, whose Redis keys and
//! SQL rows name a quota by its identity and whose values carry the values they were counted
//! under and the format; format 1, whose keys named the quota's values and which this release
//! does not read, its documented migration) is checked in under `tests/fixtures/`, and each test loads it into a fresh server and checks that the current code decides on it as documented: a key that had
//! spent 7 of 10 still has 3, for every algorithm and a running block. A change of a stored
//! format must keep reading these, or ship a documented migration (and new fixtures beside the
//! old ones).
//!
//! The fixtures were written by `write_golden_fixtures` (ignored: run it by hand, against the
//! release whose format they keep, with `cargo nextest run --all-features --run-ignored only
//! -E 'test(write_golden_fixtures)'`).
#![cfg(all(feature = "redis", feature = "postgres", feature = "mysql"))]

mod support;

use std::num::NonZeroU32;
use std::time::Duration;

use support::sql::{MariaDbServer, PgServer};
use support::{RedisServer, cost, key, prepare};
use tollgate::backend::Backend;
use tollgate::backend::mysql::MysqlBackend;
use tollgate::backend::postgres::PostgresBackend;
use tollgate::backend::redis::{RedisBackend, redis};
use tollgate::backend::remote::{Fleet, TestClock};
use tollgate::{Policy, Quota};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// The policies the fixtures hold, each spent 7 of 10 by `alice` (and `blocked` refused once,
/// into a one-hour block).
fn policies() -> Vec<Policy> {
    vec![
        Policy::new("gcra", Quota::per_hour(10)),
        Policy::new("fixed", Quota::per_hour(10).fixed_window()),
        Policy::new("sliding", Quota::per_hour(10).sliding_window()),
        Policy::new(
            "sliding12",
            Quota::per_hour(10)
                .sliding_window()
                .resolution(Duration::from_secs(300)),
        ),
        Policy::new("blocked", Quota::per_hour(1)).block_for(Duration::from_secs(3600)),
    ]
}

/// Spends 7 of 10 on every rate policy, and gets `blocked` blocked, at the test clock's time.
async fn write_state<B: Backend>(b: &B) {
    let alice = key("alice");
    for policy in policies() {
        let p = prepare(b, &policy);
        if policy.name() == "blocked" {
            assert!(b.decide(&p, &alice, cost(1)).await.unwrap().is_allowed());
            assert!(!b.decide(&p, &alice, cost(1)).await.unwrap().is_allowed());
            continue;
        }
        for _ in 0..7 {
            assert!(b.decide(&p, &alice, cost(1)).await.unwrap().is_allowed());
        }
    }
}

/// A second after the fixtures were written: each rate policy has 3 left (3 pass, the next is
/// refused), and the block still holds.
async fn check_state<B: Backend>(b: &B, store: &str) {
    let alice = key("alice");
    for policy in policies() {
        let p = prepare(b, &policy);
        let name = policy.name();
        if name == "blocked" {
            let d = b.decide(&p, &alice, cost(1)).await.unwrap();
            assert!(!d.is_allowed(), "{store} {name}: the block holds");
            let left = d.retry_after().unwrap();
            assert!(left > Duration::from_secs(3500), "{store} {name}: {left:?}");
            continue;
        }
        let d = b.decide(&p, &alice, cost(3)).await.unwrap();
        assert!(d.is_allowed(), "{store} {name}: 3 left of 10: {d:?}");
        assert_eq!(d.quotas()[0].remaining, 0, "{store} {name}");
        let d = b.decide(&p, &alice, NonZeroU32::MIN).await.unwrap();
        assert!(!d.is_allowed(), "{store} {name}: all 10 spent: {d:?}");
        // Another client starts afresh.
        let d = b.decide(&p, &key("bob"), cost(1)).await.unwrap();
        assert_eq!(d.quotas()[0].remaining, 9, "{store} {name}");
    }
}

fn one() -> Fleet {
    Fleet::Size(NonZeroU32::MIN)
}

fn redis(server: &RedisServer, clock: &TestClock) -> RedisBackend {
    RedisBackend::builder()
        .url(server.url())
        .fleet(one())
        .deny_cache_capacity(0)
        .test_clock(clock.clone())
        .build()
        .unwrap()
}

async fn postgres(server: &PgServer, clock: &TestClock) -> PostgresBackend {
    let b = PostgresBackend::builder()
        .url(server.url())
        .timeout(Duration::from_secs(5))
        .fleet(one())
        .deny_cache_capacity(0)
        .sweep(None, 1000)
        .test_clock(clock.clone())
        .build()
        .unwrap();
    b.migrate().await.unwrap();
    b
}

async fn mysql(server: &MariaDbServer, clock: &TestClock) -> MysqlBackend {
    let b = MysqlBackend::builder()
        .url(server.url())
        .timeout(Duration::from_secs(5))
        .fleet(one())
        .deny_cache_capacity(0)
        .sweep(None, 1000)
        .test_clock(clock.clone())
        .build()
        .unwrap();
    b.migrate().await.unwrap();
    b
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// Loads a Redis fixture: `<key hex> <value hex>` per line, strings only (the policies above
/// hold no slots); returns how many keys it set.
async fn load_redis_fixture(server: &RedisServer, name: &str) -> usize {
    let mut conn = redis_connection(server).await;
    let fixture = std::fs::read_to_string(format!("{FIXTURES}/{name}")).unwrap();
    let mut loaded = 0;
    for line in fixture
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (k, v) = line.split_once(' ').unwrap();
        let _: () = redis::cmd("SET")
            .arg(unhex(k))
            .arg(unhex(v))
            .query_async(&mut conn)
            .await
            .unwrap();
        loaded += 1;
    }
    loaded
}

/// Redis, format 2 (this release): every quota's state, and the block, are read.
#[tokio::test]
async fn redis_state_of_format_2_is_read() {
    let server = RedisServer::start();
    let loaded = load_redis_fixture(&server, "redis-format-2.txt").await;
    assert_eq!(loaded, 6, "one key per quota, and the block's");
    let clock = TestClock::new();
    clock.advance(Duration::from_secs(1));
    check_state(&redis(&server, &clock), "redis").await;
}

/// Redis, format 1 (tollgate up to 0.3, whose keys named a quota's values): its keys are not
/// read; the documented migration is that every key starts afresh once (docs/redis.md,
/// "Upgrading"), and the old keys expire by themselves, untouched.
#[tokio::test]
async fn redis_state_of_format_1_starts_afresh() {
    let server = RedisServer::start();
    assert_eq!(load_redis_fixture(&server, "redis-format-1.txt").await, 6);
    let clock = TestClock::new();
    clock.advance(Duration::from_secs(1));
    afresh(&redis(&server, &clock), "redis").await;
    let mut conn = redis_connection(&server).await;
    let old: Vec<String> = redis::cmd("KEYS")
        .arg("tollgate:*}:0*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(old.len(), 5, "format 1's keys are left to expire: {old:?}");
}

/// PostgreSQL: the rows as `INSERT` statements, of format 2 (read) and of format 1 (not read:
/// every key starts afresh once, as on Redis; docs/sql.md, "Upgrading").
#[tokio::test]
async fn postgres_state_of_format_2_is_read_and_of_format_1_starts_afresh() {
    for (file, read) in [
        ("postgres-format-2.sql", true),
        ("postgres-format-1.sql", false),
    ] {
        let server = PgServer::start();
        let clock = TestClock::new();
        clock.advance(Duration::from_secs(1));
        let b = postgres(&server, &clock).await;
        let rows = std::fs::read_to_string(format!("{FIXTURES}/{file}")).unwrap();
        server.psql(&rows);
        assert_eq!(
            server.psql("SELECT count(*) FROM tollgate_buckets").trim(),
            "6"
        );
        if read {
            check_state(&b, "postgres").await;
        } else {
            afresh(&b, "postgres").await;
        }
    }
}

/// MySQL: the rows as `INSERT` statements, as for PostgreSQL.
#[tokio::test]
async fn mysql_state_of_format_2_is_read_and_of_format_1_starts_afresh() {
    for (file, read) in [("mysql-format-2.sql", true), ("mysql-format-1.sql", false)] {
        let server = MariaDbServer::start();
        let clock = TestClock::new();
        clock.advance(Duration::from_secs(1));
        let b = mysql(&server, &clock).await;
        let rows = std::fs::read_to_string(format!("{FIXTURES}/{file}")).unwrap();
        server.sql(&format!("USE test; {rows}"));
        assert_eq!(
            server
                .sql("SELECT count(*) FROM test.tollgate_buckets")
                .trim(),
            "6"
        );
        if read {
            check_state(&b, "mysql").await;
        } else {
            afresh(&b, "mysql").await;
        }
    }
}

/// Every rate policy of the fixtures starts afresh: 9 left after one request.
async fn afresh<B: Backend>(b: &B, store: &str) {
    for policy in policies().iter().filter(|p| p.block().is_none()) {
        let p = prepare(b, policy);
        let d = b.decide(&p, &key("alice"), cost(1)).await.unwrap();
        assert_eq!(
            d.quotas()[0].remaining,
            9,
            "{store} {}: {d:?}",
            policy.name()
        );
    }
}

/// Runs a kept script (`tests/fixtures/gcra-format-<n>.lua`) as an instance of its release
/// would: the test hook's time, one policy of one GCRA quota (emission interval 86 400 s in
/// ns, burst 10; kind 0, which format 2 reads as strategy keep), one run of one decision
/// costing 1 (see the script's header), on `key`, `times` times; returns how many it admitted.
async fn run_old_script(
    server: &RedisServer,
    script: &str,
    key: &str,
    clock: &TestClock,
    times: usize,
) -> usize {
    let mut conn = redis_connection(server).await;
    let old = std::fs::read_to_string(format!("{FIXTURES}/{script}")).unwrap();
    let emission = format!("{:x}", 86_400_000_000_000u64);
    let mut admitted = 0;
    for _ in 0..times {
        let reply: Vec<i64> = redis::cmd("EVAL")
            .arg(&old)
            .arg(1)
            .arg(key)
            .arg(clock.now_ns().to_string())
            .arg("1")
            .arg("1")
            .arg("0")
            .arg(&emission)
            .arg("a")
            .arg("0")
            .arg("1")
            .arg("1")
            .arg("1")
            .arg("1")
            .arg("0")
            .arg("0")
            .query_async(&mut conn)
            .await
            .unwrap();
        if reply[0] == 0 {
            admitted += 1;
        }
    }
    admitted
}

/// A rolling upgrade on Redis: an instance still running format 2's script (kept in
/// `tests/fixtures/gcra-format-2.lua`, with the arguments it takes) and one running this release
/// decide on one key: one limit, 10 in all, whoever asks. A later change of the script must
/// keep this (or ship a documented migration).
#[tokio::test]
async fn the_script_of_format_2_and_this_one_keep_one_limit() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let b = redis(&server, &clock);
    let p = prepare(&b, &Policy::new("roll", support::no_refill(10)));
    for _ in 0..4 {
        assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    }
    let keys = server.cmd(&["KEYS", "tollgate:{roll:*"]);
    assert!(
        keys.starts_with("*1\r\n") && keys.contains("tollgate:{roll:bk}:2.g0"),
        "{keys:?}"
    );
    let admitted = run_old_script(
        &server,
        "gcra-format-2.lua",
        "tollgate:{roll:bk}:2.g0",
        &clock,
        8,
    )
    .await;
    assert_eq!(
        admitted, 6,
        "format 2's script sees the 4 this release took"
    );
    let d = b.decide(&p, &key("k"), cost(1)).await.unwrap();
    assert!(
        !d.is_allowed(),
        "this release sees the 6 format 2's script took"
    );
}

/// A rolling upgrade from format 1 (`upgrade_from_format_1`): an instance still running format
/// 1's script (`tests/fixtures/gcra-format-1.lua`) and one running this release keep one limit
/// on one key, whichever starts; and format 1's fixture state is read (3 left of 10, the block
/// holding). Without the option, format 1's keys are not read (above).
#[tokio::test]
async fn while_upgrading_from_format_1_both_keep_one_limit() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let upgrading = |clock: &TestClock| {
        RedisBackend::builder()
            .url(server.url())
            .fleet(one())
            .test_clock(clock.clone())
            .upgrade_from_format_1(true)
            .build()
            .unwrap()
    };
    let b = upgrading(&clock);
    let p = prepare(&b, &Policy::new("roll", support::no_refill(10)));
    let old_key = format!("tollgate:{{roll:bk}}:0g{}x10", 86_400_000_000_000u64);
    // This release first, then the old one, then this one again.
    for _ in 0..4 {
        assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    }
    assert_eq!(
        run_old_script(&server, "gcra-format-1.lua", &old_key, &clock, 3).await,
        3
    );
    for _ in 0..3 {
        assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    }
    assert!(!b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert_eq!(
        run_old_script(&server, "gcra-format-1.lua", &old_key, &clock, 2).await,
        0
    );
    // The old one first on another key.
    let old_key = format!("tollgate:{{roll:bj}}:0g{}x10", 86_400_000_000_000u64);
    assert_eq!(
        run_old_script(&server, "gcra-format-1.lua", &old_key, &clock, 9).await,
        9
    );
    assert!(b.decide(&p, &key("j"), cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&p, &key("j"), cost(1)).await.unwrap().is_allowed());

    // Format 1's fixture state, read.
    let server = RedisServer::start();
    assert_eq!(load_redis_fixture(&server, "redis-format-1.txt").await, 6);
    let clock = TestClock::new();
    clock.advance(Duration::from_secs(1));
    let b = RedisBackend::builder()
        .url(server.url())
        .fleet(one())
        .test_clock(clock.clone())
        .upgrade_from_format_1(true)
        .build()
        .unwrap();
    check_state(&b, "redis upgrading from format 1").await;
}

/// The second rolling restart of the upgrade (docs/redis.md): instances upgrading from format
/// 1 beside instances that no longer do, on one key, alternating: one limit, 4 of 4 a minute
/// and no more, for GCRA, fixed and sliding windows, whichever starts (the upgrading one read
/// format 1's key, which only it writes, and forgot what the others counted).
#[tokio::test]
async fn upgrading_and_default_instances_keep_one_limit() {
    let server = RedisServer::start();
    let clock = TestClock::new();
    let backend = |upgrade: bool| {
        RedisBackend::builder()
            .url(server.url())
            .fleet(one())
            .deny_cache_capacity(0)
            .test_clock(clock.clone())
            .upgrade_from_format_1(upgrade)
            .build()
            .unwrap()
    };
    let (upgrading, default) = (backend(true), backend(false));
    let quotas = [
        ("gcra", Quota::per_minute(4)),
        ("fixed", Quota::per_minute(4).fixed_window()),
        ("sliding", Quota::per_minute(4).sliding_window()),
    ];
    for (name, quota) in quotas {
        for upgrading_first in [true, false] {
            let policy = Policy::new(name, quota);
            let (a, b) = (prepare(&upgrading, &policy), prepare(&default, &policy));
            let k = key(&format!("k{upgrading_first}"));
            let mut admitted = 0;
            for i in 0..6 {
                let d = if (i % 2 == 0) == upgrading_first {
                    upgrading.decide(&a, &k, cost(1)).await.unwrap()
                } else {
                    default.decide(&b, &k, cost(1)).await.unwrap()
                };
                admitted += usize::from(d.is_allowed());
            }
            assert_eq!(admitted, 4, "{name}, upgrading first: {upgrading_first}");
        }
    }
}

async fn redis_connection(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(server.url()).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

/// Writes the fixtures from the code as it is: run by hand, for the release whose format they
/// keep (see the module docs).
#[tokio::test]
#[ignore = "writes tests/fixtures: run by hand for a release's formats"]
async fn write_golden_fixtures() {
    let clock = TestClock::new();

    let server = RedisServer::start();
    write_state(&redis(&server, &clock)).await;
    let mut conn = redis_connection(&server).await;
    let mut keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    keys.sort();
    let mut out = String::from(
        "# Stored format 2: Redis state (tests/golden.rs): key and value, hexadecimal, written\n\
         # at TestClock::new()'s time; every policy spent 7 of 10 by `alice`, `blocked` blocked.\n",
    );
    for k in keys {
        let v: Vec<u8> = redis::cmd("GET")
            .arg(&k)
            .query_async(&mut conn)
            .await
            .unwrap();
        out.push_str(&format!("{} {}\n", hex(&k), hex(&v)));
    }
    std::fs::write(format!("{FIXTURES}/redis-format-2.txt"), out).unwrap();

    let server = PgServer::start();
    write_state(&postgres(&server, &clock).await).await;
    let rows = server.psql(
        "SELECT format('INSERT INTO tollgate_buckets (k, a, n, c, expires_us) \
         VALUES (%L, %s, %s, %L, %s);', k, a, n, c, expires_us) \
         FROM tollgate_buckets ORDER BY k",
    );
    std::fs::write(
        format!("{FIXTURES}/postgres-format-2.sql"),
        format!(
            "-- Stored format 2: PostgreSQL rows (tests/golden.rs)\n{}\n",
            rows.trim_end()
        ),
    )
    .unwrap();

    let server = MariaDbServer::start();
    write_state(&mysql(&server, &clock).await).await;
    let rows = server.sql(
        "SELECT CONCAT('INSERT INTO tollgate_buckets (k, a, n, c, expires_us) VALUES (0x', \
         HEX(k), ', ', a, ', ', n, ', ', QUOTE(c), ', ', expires_us, ');') \
         FROM test.tollgate_buckets ORDER BY k",
    );
    std::fs::write(
        format!("{FIXTURES}/mysql-format-2.sql"),
        format!(
            "-- Stored format 2: MySQL rows (tests/golden.rs)\n{}\n",
            rows.trim_end()
        ),
    )
    .unwrap();
}
