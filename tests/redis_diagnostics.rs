//! What the Redis backend tells the operator: no password in errors, logs or `Debug`; the real
//! cause of a failure (a refused connection, a wrong password) logged once, not a timeout per
//! request; a failure policy starting and stopping to apply logged once per change.
//!
//! Logs are captured on the test's thread: the tests use the current-thread runtime, on which
//! the backend's own tasks (warm-up, batching, probe) run too.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use support::{Logs, RedisServer, closed_port, cost, eventually, key, no_refill, prepare};
use tollgate::backend::Backend;
use tollgate::backend::redis::{FailurePolicy, RedisBackend, RedisFailure};
use tollgate::{BackendErrorKind, Policy, Quota};

const SECRET: &str = "hunter2-s3cret";

// ---------------------------------------------------------------------------------------------
// Secrets
// ---------------------------------------------------------------------------------------------

/// URLs redis-rs refuses, each holding the password: the build error names the URL, masked.
#[test]
fn build_errors_never_show_the_password() {
    let urls = [
        // A database that is not a number.
        format!("redis://:{SECRET}@127.0.0.1:6379/notadb"),
        format!("redis://user:{SECRET}@127.0.0.1:6379/notadb"),
        // TLS with a database that is not a number.
        format!("rediss://:{SECRET}@127.0.0.1:6379/notadb"),
        // Not a Redis scheme.
        format!("http://:{SECRET}@127.0.0.1:6379/0"),
        // Unparsable: a bad port, an unclosed IPv6 bracket, an unescaped `@` in the password.
        format!("redis://:{SECRET}@127.0.0.1:notaport/0"),
        format!("redis://:{SECRET}@[::1/0"),
        format!("redis://:{SECRET}@x@127.0.0.1:6379/notadb"),
        // The password in the query of a Unix socket URL.
        format!("redis+unix:///tmp/no.sock?db=x&pass={SECRET}"),
    ];
    for url in &urls {
        let err = RedisBackend::builder()
            .url(url.as_str())
            .build()
            .expect_err(url);
        for shown in [err.to_string(), format!("{err:?}")] {
            assert!(!shown.contains(SECRET), "{shown}");
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("***"), "the URL is named, masked: {shown}");
        }
    }
    let err = RedisBackend::builder()
        .cluster_nodes([
            format!("redis://:{SECRET}@127.0.0.1:7000"),
            format!("redis://:{SECRET}@127.0.0.1:notaport"),
        ])
        .build()
        .expect_err("an unparsable node");
    assert!(!err.to_string().contains(SECRET), "{err}");
}

/// `Debug` of the builder and the backend, and the backend's endpoint, show the URL masked.
#[test]
fn debug_and_endpoint_never_show_the_password() {
    let url = format!("redis://admin:{SECRET}@127.0.0.1:6379/2");
    let builder = RedisBackend::builder().url(url.as_str());
    let shown = format!("{builder:?}");
    assert!(!shown.contains(SECRET), "{shown}");
    assert!(
        shown.contains("redis://admin:***@127.0.0.1:6379/2"),
        "{shown}"
    );
    let backend = builder.build().unwrap();
    assert_eq!(backend.endpoint(), "redis://admin:***@127.0.0.1:6379/2");
    let shown = format!("{backend:?}");
    assert!(!shown.contains(SECRET), "{shown}");

    let cluster = RedisBackend::builder()
        .cluster_nodes([
            format!("redis://:{SECRET}@10.0.0.1:7000"),
            format!("redis://:{SECRET}@10.0.0.2:7000"),
        ])
        .build()
        .unwrap();
    assert_eq!(
        cluster.endpoint(),
        "redis://:***@10.0.0.1:7000, redis://:***@10.0.0.2:7000"
    );
    assert!(!format!("{cluster:?}").contains(SECRET));
}

// ---------------------------------------------------------------------------------------------
// The real cause, once
// ---------------------------------------------------------------------------------------------

/// Redis wants another password: the log says "authentication failed", once, however many
/// requests and probes fail; the password is in no log line and no error. Once the server
/// accepts the password, the backend connects again by itself (a new connection: redis-rs's
/// own never retries after a refused password) and says so once.
#[tokio::test]
async fn a_wrong_password_is_logged_once_as_an_authentication_failure() {
    let (logs, _guard) = Logs::capture();
    let server = RedisServer::start();
    assert!(
        server
            .cmd(&["CONFIG", "SET", "requirepass", "the-right-one"])
            .starts_with("+OK")
    );
    let b = RedisBackend::builder()
        .url(format!("redis://:{SECRET}@127.0.0.1:{}", server.port))
        .timeout(Duration::from_secs(2))
        .on_failure(FailurePolicy::FailClosed)
        .circuit_breaker(5, Duration::from_millis(20))
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("auth", no_refill(100)));

    for i in 0..20 {
        let err = b
            .decide(&p, &key(&format!("c{i}")), cost(1))
            .await
            .expect_err("no decision without the right password");
        assert_eq!(err.kind(), BackendErrorKind::Unavailable, "{err}");
        assert!(!err.to_string().contains(SECRET), "{err}");
    }
    let s = b.stats();
    assert!(
        s.breaker_open,
        "refused credentials trip the breaker: {s:?}"
    );
    assert_eq!(s.failing, Some(RedisFailure::Authentication), "{s:?}");
    // Let the probe fail a few more times.
    let trips = s.breaker_trips;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let warnings = logs.lines("WARN");
    assert_eq!(
        warnings.len(),
        1,
        "one warning, not one per request:\n{}",
        logs.text()
    );
    let endpoint = format!("redis://:***@127.0.0.1:{}", server.port);
    assert!(
        warnings[0].contains(&format!(
            "Redis at {endpoint} unreachable: authentication failed"
        )),
        "{}",
        warnings[0]
    );
    assert!(warnings[0].contains("requests are refused (fail closed)"));

    // The server takes this password now: the probe's next connection gets in.
    let set = std::process::Command::new("redis-cli")
        .args(["-p", &server.port.to_string(), "--no-auth-warning"])
        .args([
            "-a",
            "the-right-one",
            "CONFIG",
            "SET",
            "requirepass",
            SECRET,
        ])
        .output()
        .expect("cannot run `redis-cli` (Debian: apt-get install redis-tools)");
    assert!(
        String::from_utf8_lossy(&set.stdout).contains("OK"),
        "{set:?}"
    );
    eventually("the breaker closes", || !b.stats().breaker_open).await;
    let d = b.decide(&p, &key("after"), cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 99);
    let s = b.stats();
    assert_eq!(s.failing, None, "{s:?}");
    assert_eq!(s.breaker_trips, trips, "{s:?}");

    let infos = logs.lines("INFO");
    assert_eq!(infos.len(), 1, "{}", logs.text());
    assert!(
        infos[0].contains(&format!("Redis at {endpoint} answers again")),
        "{}",
        infos[0]
    );
    assert!(
        infos[0].contains("(20 requests were refused by fail-closed meanwhile)"),
        "{}",
        infos[0]
    );
    assert_eq!(logs.lines("WARN").len(), 1, "{}", logs.text());
    assert!(!logs.text().contains(SECRET), "{}", logs.text());
    assert!(!logs.text().contains("hunter2"), "{}", logs.text());
}

/// Redis wants a password and none is configured: every command is refused with `NOAUTH`
/// (the connection itself succeeds; large commands also get the connection closed). Logged
/// once as an authentication failure, with Redis's own words; the breaker opens instead of
/// every request calling Redis.
#[tokio::test]
async fn a_missing_password_is_logged_once_as_an_authentication_failure() {
    let (logs, _guard) = Logs::capture();
    let server = RedisServer::start();
    assert!(
        server
            .cmd(&["CONFIG", "SET", "requirepass", "the-right-one"])
            .starts_with("+OK")
    );
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(Duration::from_secs(2))
        .circuit_breaker(5, Duration::from_millis(20))
        .on_failure(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("noauth", no_refill(5)));
    for i in 0..20 {
        let d = b.decide(&p, &key(&format!("c{i}")), cost(1)).await.unwrap();
        assert!(d.quotas().is_empty(), "failed open: {d:?}");
    }
    let s = b.stats();
    assert!(s.breaker_open, "{s:?}");
    assert_eq!(
        s.failing,
        Some(RedisFailure::Authentication),
        "{s:?}\n{}",
        logs.text()
    );
    let warnings = logs.lines("WARN");
    assert_eq!(warnings.len(), 1, "{}", logs.text());
    assert!(
        warnings[0].contains("unreachable: authentication failed"),
        "{}",
        warnings[0]
    );
    // Redis's own words: `NOAUTH` for a small command, or, for the script call (a large one
    // from a client that has not authenticated), a protocol error before closing the
    // connection; whichever came first.
    assert!(
        warnings[0].contains("NOAUTH") || warnings[0].contains("unauthenticated"),
        "{}",
        warnings[0]
    );
}

/// Nothing listens at the port: at the default 100 ms timeout, the log says "connection
/// refused" (not "timed out"), once, and the stats name the cause.
#[tokio::test]
async fn a_closed_port_is_logged_once_as_a_refused_connection() {
    let (logs, _guard) = Logs::capture();
    let port = closed_port();
    let b = RedisBackend::builder()
        .url(format!("redis://127.0.0.1:{port}"))
        .on_failure(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("refused", no_refill(5)));
    for i in 0..20 {
        let d = b.decide(&p, &key(&format!("c{i}")), cost(1)).await.unwrap();
        assert!(
            d.is_allowed() && d.quotas().is_empty(),
            "failed open: {d:?}"
        );
    }
    let s = b.stats();
    assert_eq!(s.fail_open, 20, "{s:?}");
    assert_eq!(s.timeouts, 0, "refused at once, not timed out: {s:?}");
    assert_eq!(s.failing, Some(RedisFailure::ConnectionRefused), "{s:?}");

    let warnings = logs.lines("WARN");
    assert_eq!(warnings.len(), 1, "{}", logs.text());
    assert!(
        warnings[0].contains(&format!(
            "Redis at redis://127.0.0.1:{port} unreachable: connection refused; \
             requests are let through unlimited (fail open) until it answers"
        )),
        "{}",
        warnings[0]
    );
}

// ---------------------------------------------------------------------------------------------
// A failure policy starting and stopping to apply
// ---------------------------------------------------------------------------------------------

/// Redis dies while requests keep coming, under each failure policy: one warning when the
/// failure policy starts to apply, none per request (17 requests, most of them answered by the
/// open breaker), and one info line when Redis answers again, counting what the policy answered.
#[tokio::test]
async fn an_outage_logs_one_warning_and_one_recovery_under_each_policy() {
    for (policy, meanwhile) in [
        (FailurePolicy::FailClosed, "refused by fail-closed"),
        (
            FailurePolicy::FailOpen,
            "let through unlimited by fail-open",
        ),
        (
            FailurePolicy::FallbackLocal,
            "limited per instance by the local fallback",
        ),
    ] {
        let (logs, _guard) = Logs::capture();
        let mut server = RedisServer::start();
        let b = RedisBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(2))
            .on_failure(policy)
            .circuit_breaker(5, Duration::from_millis(20))
            .deny_cache_capacity(0)
            .build()
            .unwrap();
        let p = prepare(&b, &Policy::new("outage", no_refill(1000)));
        let d = b.decide(&p, &key("warm"), cost(1)).await.unwrap();
        assert_eq!(d.quotas().len(), 1, "decided by Redis: {d:?}");

        server.kill();
        for i in 0..17 {
            let d = b.decide(&p, &key(&format!("c{i}")), cost(1)).await;
            match policy {
                FailurePolicy::FailClosed => assert!(d.is_err(), "{d:?}"),
                _ => assert!(d.unwrap().is_allowed()),
            }
        }
        let s = b.stats();
        assert!(s.breaker_open, "{policy:?}: {s:?}");
        assert_eq!(s.fail_open + s.fail_closed + s.fallback_local, 17, "{s:?}");
        let warnings = logs.lines("WARN");
        assert_eq!(warnings.len(), 1, "{policy:?}:\n{}", logs.text());
        assert!(
            warnings[0].contains("unreachable: connection"),
            "{}",
            warnings[0]
        );
        assert!(logs.lines("INFO").is_empty(), "{}", logs.text());

        server.restart();
        eventually("the breaker closes", || !b.stats().breaker_open).await;
        let d = b.decide(&p, &key("back"), cost(1)).await.unwrap();
        assert_eq!(d.quotas().len(), 1, "decided by Redis again: {d:?}");

        let infos = logs.lines("INFO");
        assert_eq!(infos.len(), 1, "{policy:?}:\n{}", logs.text());
        assert!(
            infos[0].contains(&format!(
                "answers again; shared limits apply again (17 requests were {meanwhile} meanwhile)"
            )),
            "{}",
            infos[0]
        );
        assert_eq!(logs.lines("WARN").len(), 1, "{policy:?}:\n{}", logs.text());
    }
}

/// A backend on `server` whose memory watch reads every 20 ms, once it has read it (a key
/// decided first, so that it is connected).
async fn watched(server: &RedisServer) -> RedisBackend {
    let b = RedisBackend::builder()
        .url(server.url())
        .watch_memory(Some(Duration::from_millis(20)))
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("watched", no_refill(10)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    // The first read: evictions are counted from it.
    let start = std::time::Instant::now();
    while b.stats().memory_used == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", b.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    b
}

/// Redis's memory is watched: its use and limit and the keys it evicts are in the stats, and
/// the operator is warned when its policy evicts keys at all, when it evicts some (counts of
/// rate limits lost), and, under `noeviction`, when it is nearly full.
#[tokio::test]
async fn evictions_and_a_full_memory_are_reported() {
    let (logs, _guard) = Logs::capture();
    // Evicting: a flood of keys fills 4 MB, and Redis drops the least recently used.
    let server =
        RedisServer::start_with(&["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]);
    let b = watched(&server).await;
    for i in 0..100 {
        server.cmd(&["SETRANGE", &format!("junk:{i}"), "200000", "x"]);
    }
    let start = std::time::Instant::now();
    while b.stats().evicted_keys == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", b.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = b.stats();
    assert_eq!(stats.memory_max, 4 * 1024 * 1024, "{stats:?}");
    assert!(stats.memory_used > 0, "{stats:?}");
    let warnings = logs.lines("WARN").join("\n");
    assert!(
        warnings.contains("maxmemory-policy allkeys-lru"),
        "{warnings}"
    );
    assert!(warnings.contains("evicted keys"), "{warnings}");

    // Not evicting: nearly full is warned of, once.
    let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    let _b = watched(&server).await;
    let info = server.cmd(&["INFO", "memory"]);
    let used: u64 = (info.lines())
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    server.cmd(&[
        "CONFIG",
        "SET",
        "maxmemory",
        &(used + used / 20).to_string(),
    ]);
    let start = std::time::Instant::now();
    while !logs.text().contains("at 90 % of its maxmemory") {
        assert!(start.elapsed() < Duration::from_secs(10), "{}", logs.text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(logs.text().matches("at 90 % of its maxmemory").count(), 1);
}

/// A Redis Cluster's memory is watched too: every primary is read, and the fullest one is
/// reported, with the keys all of them evicted and the warnings of any of them.
#[tokio::test]
async fn a_clusters_memory_is_watched_on_every_primary() {
    let (logs, _guard) = Logs::capture();
    let cluster = support::RedisCluster::start();
    // One primary has a limit and evicts; the others have none.
    let limited = &cluster.nodes[1];
    limited.cmd(&["CONFIG", "SET", "maxmemory", "64mb"]);
    limited.cmd(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .watch_memory(Some(Duration::from_millis(20)))
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("watched", no_refill(10)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    support::eventually("the memory read", || b.stats().memory_max > 0).await;
    let stats = b.stats();
    assert_eq!(
        stats.memory_max,
        64 * 1024 * 1024,
        "the limited node is the fullest"
    );
    assert!(stats.memory_used > 0, "{stats:?}");
    let warnings = logs.lines("WARN").join("\n");
    assert!(
        warnings.contains("maxmemory-policy allkeys-lru"),
        "{warnings}"
    );
}

/// The approximate mode watches its Redis's memory as the exact backend does.
#[tokio::test]
async fn the_approximate_mode_watches_redis_memory() {
    let (logs, _guard) = Logs::capture();
    let server =
        RedisServer::start_with(&["--maxmemory", "32mb", "--maxmemory-policy", "allkeys-lru"]);
    let b = RedisBackend::builder()
        .url(server.url())
        .watch_memory(Some(Duration::from_millis(20)))
        .build_approximate(tollgate::backend::redis::Approximate::asynchronous())
        .unwrap();
    let p = prepare(
        &b,
        &Policy::new("watched", Quota::per_minute(10).fixed_window()),
    );
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    support::eventually("the memory read", || b.stats().memory_max > 0).await;
    let stats = b.stats();
    assert_eq!(stats.memory_max, 32 * 1024 * 1024, "{stats:?}");
    assert!(stats.memory_used > 0, "{stats:?}");
    let warnings = logs.lines("WARN").join("\n");
    assert!(
        warnings.contains("Redis (approximate mode) evicts keys"),
        "{warnings}"
    );
}
