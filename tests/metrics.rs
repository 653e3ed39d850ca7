//! Metrics (feature `metrics`): a known number of requests gives exactly those counts, by
//! policy, outcome and quota; the local backend's tracked keys; Redis errors, latency, the
//! circuit breaker, the deny cache and the failure policies.
//!
//! Each test records into its own `DebuggingRecorder` on its thread (a current-thread runtime,
//! so that the backends' tasks record there too).

mod support;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use support::recorded::{Recorded, count, recorded, value};
use tollgate::backend::redis::{FailurePolicy, RedisBackend};
use tollgate::backend::{Backend, LocalBackend};
use tollgate::key::{Global, Header};
use tollgate::{KeyExtractor, OnMissingKey, Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

fn decisions(s: &Recorded, policy: &str, outcome: &str, quota: &str) -> u64 {
    count(
        s,
        "tollgate_decisions_total",
        &[("policy", policy), ("outcome", outcome), ("quota", quota)],
    )
}

/// Sends `n` requests through a layer built from `builder` parts; returns the statuses.
async fn send<K: KeyExtractor + Clone, Bk: Backend>(
    layer: RateLimitLayer<K, Bk>,
    requests: impl IntoIterator<Item = Request<()>>,
) -> Vec<u16> {
    let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
    }));
    let mut out = Vec::new();
    for req in requests {
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        out.push(res.status().as_u16());
    }
    out
}

fn plain(n: usize) -> Vec<Request<()>> {
    (0..n).map(|_| Request::new(())).collect()
}

#[test]
fn decisions_are_counted_exactly_by_policy_outcome_and_quota() {
    let s = recorded(|| async {
        // Two quotas: the second (burst 3) refuses first.
        let policy = Policy::new("api", Quota::per_hour(100))
            .and(Quota::per_hour(3).named("hourly"))
            .cost_fn(|req| if req.uri().path() == "/big" { 200 } else { 1 });
        let layer = RateLimitLayer::builder()
            .key(Global)
            .policy(policy)
            .build()
            .unwrap();
        let mut reqs = plain(10);
        reqs.push(Request::get("/big").body(()).unwrap());
        let statuses = send(layer, reqs).await;
        assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 3);

        let shadow = RateLimitLayer::builder()
            .key(Global)
            .policy(Policy::new("new", Quota::per_hour(2)).shadow(true))
            .build()
            .unwrap();
        assert!(send(shadow, plain(5)).await.iter().all(|&s| s == 200));

        // Shadow mode counts every refusal as shadow_denied (the request passes), even one
        // that could never fit; free requests are counted too.
        let shadow_big = RateLimitLayer::builder()
            .key(Global)
            .policy(
                Policy::new("shadow-big", Quota::per_hour(2))
                    .shadow(true)
                    .cost_fn(|req| if req.uri().path() == "/free" { 0 } else { 5 }),
            )
            .build()
            .unwrap();
        let reqs =
            ["/free", "/big", "/free", "/big"].map(|path| Request::get(path).body(()).unwrap());
        assert!(send(shadow_big, reqs).await.iter().all(|&s| s == 200));

        let keyed = RateLimitLayer::builder()
            .key(Header::new("x-api-key"))
            .policy(Policy::new("keyed", Quota::per_hour(9)))
            .on_missing_key(OnMissingKey::Allow)
            .build()
            .unwrap();
        send(keyed, plain(4)).await;
    });
    assert_eq!(decisions(&s, "api", "allowed", ""), 3);
    assert_eq!(decisions(&s, "api", "denied", "hourly"), 7);
    assert_eq!(decisions(&s, "api", "never_fits", "api-0"), 1);
    assert_eq!(decisions(&s, "api", "denied", "api-0"), 0);
    // The third request left "hourly" empty: under a tenth of its limit.
    assert_eq!(
        count(
            &s,
            "tollgate_near_limit_total",
            &[("policy", "api"), ("quota", "hourly")]
        ),
        1
    );
    assert_eq!(decisions(&s, "new", "allowed", ""), 2);
    assert_eq!(decisions(&s, "new", "shadow_denied", "new"), 3);
    assert_eq!(decisions(&s, "keyed", "missing_key", ""), 4);
    assert_eq!(decisions(&s, "shadow-big", "free", ""), 2);
    assert_eq!(
        decisions(&s, "shadow-big", "shadow_denied", "shadow-big"),
        2
    );
    assert_eq!(decisions(&s, "shadow-big", "never_fits", "shadow-big"), 0);
    // Nothing a client sends becomes a label.
    for (key, _) in &s.0 {
        for label in key.key().labels() {
            assert!(
                ["policy", "outcome", "quota", "backend", "kind", "state"].contains(&label.key()),
                "{key:?}"
            );
        }
    }
}

#[test]
fn the_local_backend_reports_its_tracked_keys() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let gauge = || {
        let snapshot = snapshotter.snapshot().into_vec();
        let found = snapshot
            .iter()
            .find(|(key, ..)| key.key().name() == "tollgate_local_tracked_keys");
        match found {
            Some((.., DebugValue::Gauge(v))) => v.into_inner(),
            other => panic!("{other:?}"),
        }
    };
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let backend = LocalBackend::new();
        let layer = RateLimitLayer::builder()
            .key(Header::new("k"))
            .backend(backend.clone())
            .policy(Policy::new("p", Quota::per_second(5)))
            .build()
            .unwrap();
        let reqs = (0..7).map(|i| {
            Request::get("/")
                .header("k", format!("client-{}", i % 3))
                .body(())
                .unwrap()
        });
        rt.block_on(send(layer.clone(), reqs));
        assert_eq!(backend.tracked_keys(), 3);
        assert_eq!(gauge(), 3.0);
        // The layer gone, its buckets go with it (the snapshot drained the gauge to a delta).
        drop(layer);
        assert_eq!(backend.tracked_keys(), 0);
        assert_eq!(gauge(), -3.0);
    });
}

#[test]
fn redis_failures_are_counted_by_kind_and_failure_policy() {
    let server = support::RedisServer::start();
    let url = server.url();
    let closed = format!("redis://127.0.0.1:{}", support::closed_port());
    let s = recorded(|| async move {
        // Redis answers: latency recorded, decisions allowed and denied, then the deny cache.
        let backend = RedisBackend::builder().url(&url).build().unwrap();
        let layer = RateLimitLayer::builder()
            .key(Global)
            .backend(backend)
            .policy(Policy::new("shared", Quota::per_hour(2)))
            .build()
            .unwrap();
        let statuses = send(layer, plain(6)).await;
        assert_eq!(statuses, [200, 200, 429, 429, 429, 429]);

        // Redis unreachable, under each failure policy.
        for (name, on_failure) in [
            ("open", FailurePolicy::FailOpen),
            ("closed", FailurePolicy::FailClosed),
            ("fallback", FailurePolicy::FallbackLocal),
        ] {
            let backend = RedisBackend::builder()
                .url(&closed)
                .on_failure(on_failure)
                .circuit_breaker(3, Duration::from_secs(60))
                .build()
                .unwrap();
            let layer = RateLimitLayer::builder()
                .key(Global)
                .backend(backend)
                .policy(Policy::new(name, Quota::per_hour(2)))
                .build()
                .unwrap();
            send(layer, plain(5)).await;
        }
    });
    assert_eq!(decisions(&s, "shared", "allowed", ""), 2);
    assert_eq!(decisions(&s, "shared", "denied", "shared"), 4);
    let hits = count(
        &s,
        "tollgate_deny_cache_hits_total",
        &[("policy", "shared")],
    );
    assert!(
        hits >= 1,
        "the flood after the first denial comes from the cache"
    );
    match value(
        &s,
        "tollgate_backend_latency_seconds",
        &[("backend", "redis")],
    ) {
        Some(DebugValue::Histogram(h)) => assert_eq!(h.len() as u64, 6 - hits),
        other => panic!("{other:?}"),
    }
    assert_eq!(decisions(&s, "open", "fail_open", ""), 5);
    assert_eq!(decisions(&s, "closed", "fail_closed", ""), 5);
    assert_eq!(decisions(&s, "fallback", "fallback_allowed", ""), 2);
    assert_eq!(decisions(&s, "fallback", "fallback_denied", "fallback"), 3);
    // Each backend fails 3 calls, then its breaker opens and stays open.
    let errors = count(
        &s,
        "tollgate_backend_errors_total",
        &[("backend", "redis"), ("kind", "unavailable")],
    );
    assert!(errors >= 9, "{errors}");
    assert_eq!(
        count(
            &s,
            "tollgate_circuit_breaker_transitions_total",
            &[("backend", "redis"), ("state", "open")]
        ),
        3
    );
    assert_eq!(
        value(&s, "tollgate_circuit_breaker_open", &[("backend", "redis")]),
        Some(&DebugValue::Gauge(1.0.into()))
    );
}

#[test]
fn the_approximate_mode_reports_its_calls_writes_reads_and_keys() {
    use tollgate::backend::redis::Approximate;
    let server = support::RedisServer::start();
    let url = server.url();
    let s = recorded(|| async move {
        let backend = RedisBackend::builder()
            .url(&url)
            .build_approximate(Approximate::asynchronous().allowance(0.0))
            .unwrap();
        let layer = RateLimitLayer::builder()
            .key(Header::new("k"))
            .backend(backend.clone())
            .policy(Policy::new(
                "approx",
                Quota::per_minute(100).sliding_window(),
            ))
            .build()
            .unwrap();
        let reqs = (0..9).map(|i| {
            Request::get("/")
                .header("k", format!("client-{}", i % 3))
                .body(())
                .unwrap()
        });
        let statuses = send(layer.clone(), reqs).await;
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
        backend.flush().await;
        let stats = backend.stats();
        assert_eq!(stats.keys, 3);
        assert_eq!(stats.units_sent, 9);
        std::mem::forget(layer); // the keys stay held for the snapshot
    });
    let calls = count(
        &s,
        "tollgate_approx_store_calls_total",
        &[("outcome", "ok")],
    );
    assert!(calls >= 1, "{calls}"); // one pipeline may carry every key
    assert_eq!(
        count(
            &s,
            "tollgate_approx_store_calls_total",
            &[("outcome", "failed")]
        ),
        0
    );
    assert_eq!(count(&s, "tollgate_approx_units_sent_total", &[]), 9);
    let writes = count(&s, "tollgate_approx_store_writes_total", &[]);
    assert!((3..=9).contains(&writes), "{writes}");
    assert!(count(&s, "tollgate_approx_store_reads_total", &[]) >= 3);
    match value(&s, "tollgate_approx_keys", &[]) {
        Some(DebugValue::Gauge(v)) => assert_eq!(v.into_inner(), 3.0),
        other => panic!("{other:?}"),
    }
}

/// Allowances granted, exhausted and recalled, announcements sent and read, and the estimate
/// of over-admission: two instances, one key pushed past the limit by units one of them held
/// within its allowance.
#[test]
fn the_approximate_mode_reports_allowances_and_over_admission() {
    use std::num::NonZeroU32;
    use tollgate::backend::redis::{Approximate, Fleet, TestClock};
    let server = support::RedisServer::start();
    let url = server.url();
    let s = recorded(|| async move {
        let clock = TestClock::new();
        let make = || {
            RedisBackend::builder()
                .url(&url)
                .test_clock(clock.clone())
                .fleet(Fleet::Size(NonZeroU32::new(2).unwrap()))
                .build_approximate(Approximate::asynchronous())
                .unwrap()
        };
        let (a, b) = (make(), make());
        // 20 per hour: an allowance of 5 per instance.
        let policy = Policy::new("allow", Quota::per_hour(20).fixed_window());
        let (pa, pb) = (support::prepare(&a, &policy), support::prepare(&b, &policy));
        let y = support::key("y");
        // Allowances start once an instance has read the announcements (its first flush).
        a.flush().await;
        b.flush().await;
        for _ in 0..4 {
            assert!(
                b.decide(&pb, &y, support::cost(1))
                    .await
                    .unwrap()
                    .is_allowed()
            );
        }
        // A goes past its allowance at its 6th unit, then fills the limit by what it knows.
        let mut admitted = 0;
        for _ in 0..30 {
            if a.decide(&pa, &y, support::cost(1))
                .await
                .unwrap()
                .is_allowed()
            {
                admitted += 1;
            }
            a.flush().await;
        }
        assert_eq!(admitted, 20);
        // B reads the announcement, sends its 4 and one more: the count is 25 of 20.
        b.flush().await;
        assert!(
            b.decide(&pb, &y, support::cost(1))
                .await
                .unwrap()
                .is_allowed()
        );
        b.flush().await;
        assert_eq!(a.stats().allowances_exhausted, 1);
        assert_eq!(b.stats().allowances_recalled, 1);
    });
    // Both instances read the announcement (A its own).
    for (name, label, expected) in [
        ("tollgate_approx_allowances_total", ("event", "granted"), 2),
        (
            "tollgate_approx_allowances_total",
            ("event", "exhausted"),
            1,
        ),
        ("tollgate_approx_allowances_total", ("event", "recalled"), 1),
        (
            "tollgate_approx_announcements_total",
            ("direction", "sent"),
            1,
        ),
        (
            "tollgate_approx_announcements_total",
            ("direction", "read"),
            2,
        ),
    ] {
        assert_eq!(count(&s, name, &[label]), expected, "{name} {label:?}");
    }
    // B's increment brought back 25: 5 over, seen once by B.
    assert_eq!(count(&s, "tollgate_approx_over_limit_units_total", &[]), 5);
}

/// The adaptive limit's metrics: requests by partition and outcome, exactly; the limit, in
/// flight and the RTTs (sample and the gradient's baseline) once a window closes.
#[test]
fn adaptive_limits_are_counted_by_partition_and_outcome() {
    use tollgate::adaptive::AdaptiveLimit;
    let s = recorded(|| async {
        tokio::time::pause();
        let limit = AdaptiveLimit::builder()
            .name("api")
            .initial(2)
            .range(2, 2)
            .min_samples(1)
            .partition("critical", 0.5)
            .build()
            .unwrap();
        let a = limit.try_acquire().unwrap();
        let b = limit.try_acquire().unwrap();
        assert!(limit.try_acquire().is_none());
        let c = limit.try_acquire_in("critical").unwrap();
        assert!(limit.try_acquire_in("critical").is_none());
        tokio::time::advance(Duration::from_millis(150)).await;
        // The first sample starts a window; one a window's length (100 ms) later closes it.
        a.success();
        drop(c);
        tokio::time::advance(Duration::from_millis(100)).await;
        b.dropped();
    });
    let requests = |partition: &str, outcome: &str| {
        count(
            &s,
            "tollgate_adaptive_requests_total",
            &[
                ("limit", "api"),
                ("partition", partition),
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(requests("other", "admitted"), 2);
    assert_eq!(requests("other", "rejected"), 1);
    assert_eq!(requests("other", "succeeded"), 1);
    assert_eq!(requests("other", "dropped"), 1);
    assert_eq!(requests("critical", "admitted"), 1);
    assert_eq!(requests("critical", "rejected"), 1);
    assert_eq!(requests("critical", "cancelled"), 1);
    let gauge = |name: &str, labels: &[(&str, &str)]| match value(&s, name, labels) {
        Some(DebugValue::Gauge(v)) => v.into_inner(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(gauge("tollgate_adaptive_limit", &[("limit", "api")]), 2.0);
    assert_eq!(
        gauge("tollgate_adaptive_limit_min", &[("limit", "api")]),
        2.0
    );
    let sample = gauge(
        "tollgate_adaptive_rtt_seconds",
        &[("limit", "api"), ("kind", "sample")],
    );
    assert!((sample - 0.15).abs() < 1e-6, "{sample}");
    let baseline = gauge(
        "tollgate_adaptive_rtt_seconds",
        &[("limit", "api"), ("kind", "baseline")],
    );
    assert!((baseline - 0.15).abs() < 1e-6, "{baseline}");
}

/// Outcomes that have not happened yet have a series at 0 from a policy's first request (the
/// dashboard's "never fits" and "failure policy" panels read 0, not "No data"), and an
/// adaptive limit's gauges and counters exist from its build, before any request.
#[test]
fn known_outcomes_are_exported_at_zero_from_the_start() {
    use tollgate::adaptive::AdaptiveLimit;
    let s = recorded(|| async {
        let layer = RateLimitLayer::builder()
            .key(Global)
            .policy(
                Policy::new("api", Quota::per_hour(100)).and(Quota::per_minute(5).named("burst")),
            )
            .build()
            .unwrap();
        assert_eq!(send(layer, plain(1)).await, [200]);
        let _limit = AdaptiveLimit::builder()
            .name("quiet")
            .range(2, 40)
            .partition("critical", 0.5)
            .build()
            .unwrap();
    });
    let zero = |labels: &[(&str, &str)]| match value(&s, "tollgate_decisions_total", labels) {
        Some(DebugValue::Counter(0)) => {}
        other => panic!("{labels:?}: {other:?}"),
    };
    assert_eq!(decisions(&s, "api", "allowed", ""), 1);
    for outcome in [
        "fail_open",
        "fallback_allowed",
        "fail_closed",
        "missing_key",
        "free",
    ] {
        zero(&[("policy", "api"), ("outcome", outcome), ("quota", "")]);
    }
    for outcome in ["denied", "never_fits", "fallback_denied"] {
        for quota in ["api-0", "burst"] {
            zero(&[("policy", "api"), ("outcome", outcome), ("quota", quota)]);
        }
    }
    for partition in ["critical", "other"] {
        for outcome in ["admitted", "rejected", "succeeded", "dropped", "cancelled"] {
            let labels = [
                ("limit", "quiet"),
                ("partition", partition),
                ("outcome", outcome),
            ];
            match value(&s, "tollgate_adaptive_requests_total", &labels) {
                Some(DebugValue::Counter(0)) => {}
                other => panic!("{labels:?}: {other:?}"),
            }
        }
    }
    for (name, expect) in [
        ("tollgate_adaptive_limit", 20.0),
        ("tollgate_adaptive_limit_min", 2.0),
        ("tollgate_adaptive_limit_max", 40.0),
    ] {
        match value(&s, name, &[("limit", "quiet")]) {
            Some(DebugValue::Gauge(v)) => assert_eq!(v.into_inner(), expect, "{name}"),
            other => panic!("{name}: {other:?}"),
        }
    }
}
