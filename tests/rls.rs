//! The rate limit service over real gRPC: a tonic server on a TCP port, Envoy's generated
//! client stubs (`envoy-types`) asking it.
#![cfg(feature = "rls")]

mod support;

#[allow(dead_code)]
#[path = "../examples/rls.rs"]
mod example;

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use tollgate::backend::{Decision, LocalBackend, Mode};
use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, rate_limit::Unit,
};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use tollgate::rls::envoy_types::pb::google::protobuf::UInt64Value;
use tollgate::rls::{RlsConfig, RlsService};

const EXAMPLE_RULES: &str = include_str!("../examples/rls.yaml");

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// Serves `service` on a free port; a client connected to it.
async fn serve<B: tollgate::backend::Backend>(service: RlsService<B>) -> Client {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// The example's rules on a local backend whose clock stands still.
async fn example() -> (Client, FakeRelativeClock) {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder().clock(clock.clone()).build();
    let config = RlsConfig::from_yaml(EXAMPLE_RULES).unwrap();
    (
        serve(RlsService::new(backend, config).unwrap()).await,
        clock,
    )
}

/// One descriptor, `remote_address` = `ip`.
fn address(ip: &str) -> Vec<RateLimitDescriptor> {
    vec![descriptor(&[("remote_address", ip)])]
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    support::rls_descriptor(entries)
}

async fn ask(
    client: &mut Client,
    descriptors: Vec<RateLimitDescriptor>,
    hits: u32,
) -> RateLimitResponse {
    ask_in(client, "edge", descriptors, hits).await
}

async fn ask_in(
    client: &mut Client,
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
    hits: u32,
) -> RateLimitResponse {
    client
        .should_rate_limit(RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: hits,
        })
        .await
        .unwrap()
        .into_inner()
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    (r.response_headers_to_add.iter())
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

/// The done-when of the issue: exactly 10 OK, then OVER_LIMIT, for one `remote_address`, with
/// the statuses and the fields Envoy passes on.
#[tokio::test]
async fn ten_ok_then_over_limit_for_one_address() {
    let (mut client, clock) = example().await;
    let addr = || address("10.0.0.1");
    for left in (0..10).rev() {
        let r = ask(&mut client, addr(), 0).await;
        assert_eq!(r.overall_code(), Code::Ok);
        let s = &r.statuses[0];
        assert_eq!(s.code(), Code::Ok);
        assert_eq!(s.limit_remaining, left);
        let limit = s.current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit()), (5, Unit::Second));
        assert_eq!(limit.name, "", "unnamed, as envoyproxy/ratelimit answers");
        assert_eq!(
            header(&r, "ratelimit-policy"),
            Some(r#""edge.remote_address";q=10;w=2"#)
        );
        assert!(header(&r, "retry-after").is_none());
    }
    let r = ask(&mut client, addr(), 0).await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(r.statuses[0].code(), Code::OverLimit);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let reset = r.statuses[0].duration_until_reset.unwrap();
    assert_eq!((reset.seconds, reset.nanos), (0, 200_000_000));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    assert_eq!(
        header(&r, "ratelimit"),
        Some(r#""edge.remote_address";r=0;t=1"#)
    );
    // Another address has its own bucket; a unit comes back after 200 ms.
    let other = ask(&mut client, address("10.0.0.2"), 0).await;
    assert_eq!(other.statuses[0].limit_remaining, 9);
    clock.advance(Duration::from_millis(200));
    assert_eq!(ask(&mut client, addr(), 0).await.overall_code(), Code::Ok);
}

/// `hits_addend` is the cost: the request's (0 meaning 1), a descriptor's own overriding it,
/// a descriptor's 0 checking without counting.
/// The example's server as it runs: its rules, the gRPC health service reporting the rate
/// limit service serving, and the done-when over it: 10 OK then OVER_LIMIT for one address.
#[tokio::test]
async fn the_example_serves_its_rules_and_its_health() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let service = RlsService::with_domains(backend, example::rules().unwrap()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(example::serve_on(service, listener, async {
        let _ = stopped.await;
    }));
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let status = health
        .check(HealthCheckRequest {
            service: "envoy.service.ratelimit.v3.RateLimitService".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status();
    assert_eq!(status, ServingStatus::Serving);
    let mut client = RateLimitServiceClient::connect(url).await.unwrap();
    let mut codes = Vec::new();
    for _ in 0..11 {
        let r = ask(&mut client, address("10.0.0.1"), 0).await;
        codes.push(r.overall_code());
        if r.overall_code() == Code::OverLimit {
            assert_eq!(header(&r, "retry-after"), Some("1"));
        }
    }
    assert_eq!(codes[..10], [Code::Ok; 10]);
    assert_eq!(codes[10], Code::OverLimit);
    // Stopped, it ends (gracefully: no call was in flight).
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

/// A client's long value (a header Envoy puts in a descriptor) is counted like any other,
/// by its hash: never a failed call, which Envoy would let through unlimited.
#[tokio::test]
async fn long_values_are_counted_not_refused() {
    let rules = "domain: edge\ndescriptors:\n  - key: api_key\n    quota: \"3/h\"\n";
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    for long in ["k".repeat(300), "k".repeat(299) + "j", "x".repeat(100_000)] {
        let mut codes = Vec::new();
        for _ in 0..4 {
            let r = ask(&mut client, vec![descriptor(&[("api_key", &long)])], 0).await;
            codes.push(r.overall_code());
        }
        assert_eq!(
            codes,
            [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit],
            "{}",
            long.len()
        );
    }
}

/// A check (`hits_addend` 0) takes nothing and refuses when not one unit is left, the whole
/// request with it; its `limit_remaining` and its `RateLimit` field agree.
#[tokio::test]
async fn a_check_refuses_a_spent_key() {
    let (mut client, _clock) = example().await;
    let check = |ip: &str| {
        let mut d = descriptor(&[("remote_address", ip)]);
        d.hits_addend = Some(UInt64Value { value: 0 });
        d
    };
    let r = ask(&mut client, vec![check("10.0.0.1")], 0).await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 10);
    assert_eq!(
        header(&r, "ratelimit"),
        Some("\"edge.remote_address\";r=10;t=1")
    );
    let r = ask(&mut client, address("10.0.0.1"), 10).await;
    assert_eq!(r.overall_code(), Code::Ok);
    // Spent: the check refuses, and the request's other descriptor gives back its unit.
    let both = vec![
        check("10.0.0.1"),
        descriptor(&[("generic_key", "expensive")]),
    ];
    let r = ask(&mut client, both, 0).await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(
        (r.statuses[0].code(), r.statuses[1].code()),
        (Code::OverLimit, Code::Ok)
    );
    assert_eq!(r.statuses[1].limit_remaining, 2, "given back");
    assert_eq!(
        header(&r, "ratelimit"),
        Some("\"edge.remote_address\";r=0;t=1, \"edge.generic_key=expensive\";r=2;t=1"),
    );
}

/// Charging what the upstream reports, as Envoy does it: a check on the request path, the
/// charge when the stream ends. A `debit` rule takes a charge whatever is left, so that a
/// key that spent more than it had is refused by the next check; without it, a charge that
/// does not fit takes nothing.
#[tokio::test]
async fn a_debit_rule_takes_the_charge_after_the_response() {
    let rules = "domain: llm\ndescriptors:\n  - key: user\n    quota: \"10/h\"\n    \
                 debit: true\n  - key: team\n    quota: \"10/h\"\n";
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(backend, config).unwrap()).await;
    let call = |key: &str, hits: u64| {
        let mut d = descriptor(&[(key, "a")]);
        d.hits_addend = Some(UInt64Value { value: hits });
        vec![d]
    };
    for key in ["user", "team"] {
        let c = &mut client;
        assert_eq!(
            ask_in(c, "llm", call(key, 0), 1).await.overall_code(),
            Code::Ok
        );
        let r = ask_in(c, "llm", call(key, 8), 1).await;
        assert_eq!(r.statuses[0].limit_remaining, 2);
        assert_eq!(
            ask_in(c, "llm", call(key, 0), 1).await.overall_code(),
            Code::Ok
        );
        // 5 more than the 2 left: refused either way (the answer Envoy ignores at the end of
        // a stream), and taken by the debit rule only.
        let r = ask_in(c, "llm", call(key, 5), 1).await;
        assert_eq!(r.overall_code(), Code::OverLimit);
        let next = ask_in(c, "llm", call(key, 0), 1).await;
        if key == "user" {
            assert_eq!(next.overall_code(), Code::OverLimit, "in debt");
            assert_eq!(next.statuses[0].limit_remaining, 0);
        } else {
            assert_eq!(next.overall_code(), Code::Ok, "nothing taken");
            assert_eq!(next.statuses[0].limit_remaining, 2);
        }
    }
    // A debit is never given back: in a call another descriptor refuses, it keeps its units.
    let both = vec![call("user", 1).remove(0), call("team", 3).remove(0)];
    let r = ask_in(&mut client, "llm", both, 1).await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    let err = RlsConfig::from_yaml("domain: d\ndescriptors:\n  - key: k\n    debit: true\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("debit") && err.contains("d.k"), "{err}");
}

/// envoyproxy/ratelimit's matching: an empty `value` is any value, a `value` with a `*` any
/// value the pattern matches (a `*` anywhere, each standing for any characters), the first such
/// in the rules' order; an exact value before both.
#[tokio::test]
async fn values_match_as_envoyproxy_ratelimit_matches_them() {
    let rules = r#"
domain: edge
descriptors:
  - key: path
    value: ""
    rate_limit: { unit: hour, requests_per_unit: 5 }
  - key: path
    value: "/api/admin/*"
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: path
    value: "/api/*"
    rate_limit: { unit: hour, requests_per_unit: 3 }
  - key: path
    value: "/api/health"
    rate_limit: { unlimited: true }
  - key: path
    value: "/v*/*/action"
    rate_limit: { unit: hour, requests_per_unit: 2 }
"#;
    let config = RlsConfig::from_yaml(rules).unwrap();
    let names: Vec<&str> = config.policies().iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "edge.path",
            "edge.path=/api/admin/*",
            "edge.path=/api/*",
            "edge.path=/v*/*/action"
        ]
    );
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    for (path, limit) in [
        ("/static/a.css", Some(5)),
        ("/api/users", Some(3)),
        ("/api/admin/users", Some(1)),
        ("/api/health", None),
        ("/v1/orders/action", Some(2)),
        ("/v2/a/b/action", Some(2)),
        ("/v1/orders/other", Some(5)),
        ("/v/action", Some(5)),
    ] {
        let r = ask(&mut client, vec![descriptor(&[("path", path)])], 1).await;
        let got = r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit);
        assert_eq!(got, limit, "{path}");
    }
    let twice = "domain: d\ndescriptors:\n  - key: k\n    value: \"a*\"\n    quota: \"1/s\"\n  \
                 - key: k\n    value: \"a*\"\n    quota: \"2/s\"\n";
    let err = RlsConfig::from_yaml(twice).unwrap_err().to_string();
    assert!(err.contains("twice"), "{err}");

    // The first pattern in the rules' order is taken, not the longest (as upstream).
    let in_order = rules.replace(
        "    value: \"/api/admin/*\"\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n  - key: path\n    value: \"/api/*\"\n    rate_limit: { unit: hour, requests_per_unit: 3 }",
        "    value: \"/api/*\"\n    rate_limit: { unit: hour, requests_per_unit: 3 }\n  - key: path\n    value: \"/api/admin/*\"\n    rate_limit: { unit: hour, requests_per_unit: 1 }",
    );
    assert_ne!(in_order, rules);
    let config = RlsConfig::from_yaml(&in_order).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let r = ask(
        &mut client,
        vec![descriptor(&[("path", "/api/admin/users")])],
        1,
    )
    .await;
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        3
    );
}

/// A `*` inside a value limits the values it matches (upstream's README, example 9): 1 a
/// minute for `/api/123/action`, the route no longer unlimited.
#[tokio::test]
async fn a_wildcard_inside_a_value_limits_what_it_matches() {
    let rules = "domain: edge\ndescriptors:\n  - key: path\n    value: /api/*/action\n    \
                 rate_limit: { unit: minute, requests_per_unit: 1 }\n";
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let path = |p: &str| vec![descriptor(&[("path", p)])];
    let codes = [
        ask(&mut client, path("/api/123/action"), 0)
            .await
            .overall_code(),
        ask(&mut client, path("/api/123/action"), 0)
            .await
            .overall_code(),
        ask(&mut client, path("/api/456/action"), 0)
            .await
            .overall_code(),
        ask(&mut client, path("/api/456/action"), 0)
            .await
            .overall_code(),
    ];
    assert_eq!(
        codes,
        [Code::Ok, Code::OverLimit, Code::Ok, Code::OverLimit]
    );
    // Not matched: counted nowhere.
    let r = ask(&mut client, path("/api/123/other"), 0).await;
    assert!(r.statuses[0].current_limit.is_none());
}

/// `share_threshold`: the values a wildcard matches share one bucket (upstream's example 11);
/// without it each value has its own. Refused without a `*` in the value.
#[tokio::test]
async fn share_threshold_puts_the_values_a_wildcard_matches_in_one_bucket() {
    let rules = r#"
domain: edge
descriptors:
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: path
    value: /own/*
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: tenant
    value: t-*
    share_threshold: true
    descriptors:
      - key: method
        rate_limit: { unit: minute, requests_per_unit: 1 }
"#;
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let one = |k: &str, v: &str| vec![descriptor(&[(k, v)])];
    let mut codes = Vec::new();
    for f in ["files/a", "files/b", "files/c"] {
        codes.push(ask(&mut client, one("files", f), 0).await.overall_code());
    }
    assert_eq!(codes, [Code::Ok, Code::Ok, Code::OverLimit]);
    let mut codes = Vec::new();
    for p in ["/own/a", "/own/b", "/own/c"] {
        codes.push(ask(&mut client, one("path", p), 0).await.overall_code());
    }
    assert_eq!(codes, [Code::Ok; 3]);
    // Shared at a level above the limit: every tenant's GETs count together.
    let nested = |t: &str| vec![descriptor(&[("tenant", t), ("method", "GET")])];
    assert_eq!(
        ask(&mut client, nested("t-1"), 0).await.overall_code(),
        Code::Ok
    );
    assert_eq!(
        ask(&mut client, nested("t-2"), 0).await.overall_code(),
        Code::OverLimit
    );
    let bad = "domain: d\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n    \
               quota: \"1/s\"\n";
    let err = RlsConfig::from_yaml(bad).unwrap_err().to_string();
    assert!(
        err.contains("share_threshold") && err.contains("d.k=v"),
        "{err}"
    );
}

/// `quota_mode` (envoyproxy/ratelimit's soft limit): a quota-mode descriptor over its limit is
/// `OVER_LIMIT`, but the request is refused only when every quota-mode descriptor of it is,
/// or another descriptor is.
#[tokio::test]
async fn quota_mode_refuses_only_when_every_quota_is_spent() {
    let rules = r#"
domain: edge
descriptors:
  - key: plan
    value: monthly
    quota_mode: true
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: plan
    value: daily
    quota_mode: true
    rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: user
    rate_limit: { unit: hour, requests_per_unit: 10 }
  - key: strict
    rate_limit: { unit: hour, requests_per_unit: 0 }
"#;
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let call = || {
        vec![
            descriptor(&[("plan", "monthly")]),
            descriptor(&[("plan", "daily")]),
            descriptor(&[("user", "u1")]),
        ]
    };
    let codes = |r: &RateLimitResponse| {
        (
            r.overall_code(),
            r.statuses.iter().map(|s| s.code()).collect::<Vec<_>>(),
        )
    };
    let r = ask(&mut client, call(), 0).await;
    assert_eq!(codes(&r), (Code::Ok, vec![Code::Ok; 3]));
    // `monthly` spent, `daily` not: soft, OK.
    let r = ask(&mut client, call(), 0).await;
    assert_eq!(
        codes(&r),
        (Code::Ok, vec![Code::OverLimit, Code::Ok, Code::Ok])
    );
    assert!(header(&r, "retry-after").is_none());
    // Both spent: refused.
    let r = ask(&mut client, call(), 0).await;
    assert_eq!(
        codes(&r),
        (
            Code::OverLimit,
            vec![Code::OverLimit, Code::OverLimit, Code::Ok]
        )
    );
    // The user's limit took 2 (the refused call gave its unit back).
    let mut check = descriptor(&[("user", "u1")]);
    check.hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(
        ask(&mut client, vec![check], 0).await.statuses[0].limit_remaining,
        8
    );
    // A descriptor not in quota mode over its limit refuses, whatever the quotas say.
    let r = ask(
        &mut client,
        vec![
            descriptor(&[("plan", "daily")]),
            descriptor(&[("strict", "x")]),
        ],
        0,
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
}

/// A rule's `metadata` comes back in the answer's dynamic metadata (with
/// `RlsService::dynamic_metadata`, off by default as upstream's `RESPONSE_DYNAMIC_METADATA`),
/// merged from the descriptors that passed; `value_to_metric` is accepted.
#[tokio::test]
async fn metadata_comes_back_for_the_descriptors_that_passed() {
    use tollgate::rls::envoy_types::pb::google::protobuf::{Value, value::Kind};
    let rules = r#"
domain: edge
descriptors:
  - key: service
    value: llm
    value_to_metric: true
    metadata: { name: llm, tier: { gold: true } }
    rate_limit: { unit: hour, requests_per_unit: 3 }
  - key: user
    metadata: { name: per-user, tier: { limit: 5 } }
    rate_limit: { unit: hour, requests_per_unit: 5 }
"#;
    let config = RlsConfig::from_yaml(rules).unwrap();
    let off = RlsService::new(LocalBackend::new(), config.clone()).unwrap();
    let mut off = serve(off).await;
    let call = || {
        vec![
            descriptor(&[("service", "llm")]),
            descriptor(&[("user", "u1")]),
        ]
    };
    assert!(ask(&mut off, call(), 0).await.dynamic_metadata.is_none());

    let on = RlsService::new(LocalBackend::new(), config).unwrap();
    let mut on = serve(on.dynamic_metadata(true)).await;
    let field = |s: &tollgate::rls::envoy_types::pb::google::protobuf::Struct, k: &str| {
        s.fields.get(k).and_then(|v| v.kind.clone())
    };
    let text = |v: Option<Kind>| match v {
        Some(Kind::StringValue(t)) => t,
        other => panic!("{other:?}"),
    };
    let inner = |v: Option<Kind>| match v {
        Some(Kind::StructValue(s)) => s,
        other => panic!("{other:?}"),
    };
    let m = ask(&mut on, call(), 3).await.dynamic_metadata.unwrap();
    assert_eq!(text(field(&m, "domain")), "edge");
    assert_eq!(field(&m, "hitsAddend"), Some(Kind::NumberValue(3.0)));
    let Some(Kind::ListValue(list)) = field(&m, "descriptors") else {
        panic!("{m:?}")
    };
    let first = inner(list.values[0].kind.clone());
    let Some(Kind::ListValue(entries)) = field(&first, "entries") else {
        panic!("{first:?}")
    };
    assert_eq!(
        entries.values,
        [Value {
            kind: Some(Kind::StringValue("service=llm".into()))
        }]
    );
    // Both passed: merged in order, the first value kept, maps merged.
    let merged = inner(field(&m, "metadata"));
    assert_eq!(text(field(&merged, "name")), "llm");
    let tier = inner(field(&merged, "tier"));
    assert_eq!(field(&tier, "gold"), Some(Kind::BoolValue(true)));
    assert_eq!(field(&tier, "limit"), Some(Kind::NumberValue(5.0)));
    // The service is over its limit now: its status is OVER_LIMIT, the user's OK (given back,
    // as the call is refused): the user's metadata only, as upstream merges the descriptors
    // that are not over.
    let m = ask(
        &mut on,
        vec![
            descriptor(&[("service", "llm")]),
            descriptor(&[("user", "u2")]),
        ],
        0,
    )
    .await
    .dynamic_metadata
    .unwrap();
    let merged = inner(field(&m, "metadata"));
    assert_eq!(text(field(&merged, "name")), "per-user");
    assert!(field(&inner(field(&merged, "tier")), "gold").is_none());
}

/// `replaces` as envoyproxy/ratelimit reads it: only a named limit is replaced, an
/// `unlimited` rule's `replaces` counts too, and an empty name or a limit replacing itself is
/// refused when loaded. Rules whose paths read the same are refused too.
#[tokio::test]
async fn replaces_only_named_limits_and_unlimited_rules_replace_too() {
    let rules = r#"
domain: api
descriptors:
  - key: user
    rate_limit: { unit: hour, requests_per_unit: 1, name: per_user }
  - key: plan
    value: premium
    rate_limit: { unlimited: true, replaces: [{ name: per_user }] }
  - key: tenant
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: region
    rate_limit: { unit: hour, requests_per_unit: 5, replaces: [{ name: api.tenant }] }
"#;
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let premium = || {
        vec![
            descriptor(&[("user", "u1")]),
            descriptor(&[("plan", "premium")]),
        ]
    };
    for _ in 0..3 {
        let r = ask_in(&mut client, "api", premium(), 1).await;
        assert_eq!(r.overall_code(), Code::Ok, "per_user is replaced: {r:?}");
    }
    // The unnamed tenant limit is not replaced by a name that reads like its policy's.
    let both = || {
        vec![
            descriptor(&[("tenant", "t1")]),
            descriptor(&[("region", "eu")]),
        ]
    };
    assert_eq!(
        ask_in(&mut client, "api", both(), 1).await.overall_code(),
        Code::Ok
    );
    assert_eq!(
        ask_in(&mut client, "api", both(), 1).await.overall_code(),
        Code::OverLimit
    );
    for (yaml, word) in [
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: hour, \
             requests_per_unit: 1, name: a, replaces: [{ name: a }] }\n",
            "itself",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: hour, \
             requests_per_unit: 1, replaces: [{ name: \"\" }] }\n",
            "empty name",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a.b\n    quota: \"1/s\"\n  - key: a\n    \
             descriptors:\n      - key: b\n        quota: \"1/s\"\n",
            "reads the same",
        ),
    ] {
        let err = RlsConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(word), "{word}: {err}");
    }
}

/// `current_limit` of a tollgate quota whose period is not a unit: its rate in the smallest
/// unit at least as long, up to a year.
#[tokio::test]
async fn current_limit_uses_the_nearest_unit() {
    let rules = "domain: d\ndescriptors:\n  - key: a\n    quota: \"100/7d\"\n  \
                 - key: b\n    quota: \"3/10s\"\n  - key: c\n    quota: \"1000/40d\"\n";
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    for (key, want) in [
        ("a", (100, Unit::Week)),
        ("b", (18, Unit::Minute)),
        ("c", (9125, Unit::Year)),
    ] {
        let r = ask_in(&mut client, "d", vec![descriptor(&[(key, "x")])], 1).await;
        let l = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((l.requests_per_unit, l.unit()), want, "{key}");
    }
}

/// Several domains on one service (envoyproxy/ratelimit's directory of files, one domain
/// each): each request is decided by its domain's rules; another domain is OK and uncounted;
/// one domain's rules are replaced without touching the others, and all at once.
#[tokio::test]
async fn one_service_serves_several_domains() {
    let edge = RlsConfig::from_yaml(EXAMPLE_RULES).unwrap();
    let api = |n: u32| {
        let yaml = format!(
            "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: hour, \
             requests_per_unit: {n} }}\n"
        );
        RlsConfig::from_yaml(&yaml).unwrap()
    };
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let service = RlsService::with_domains(backend, [edge.clone(), api(2)]).unwrap();
    let mut client = serve(service.clone()).await;
    let user = || vec![descriptor(&[("user", "u1")])];
    let codes = |rs: Vec<RateLimitResponse>| -> Vec<Code> {
        rs.iter().map(RateLimitResponse::overall_code).collect()
    };
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(ask_in(&mut client, "api", user(), 1).await);
    }
    assert_eq!(codes(answers), [Code::Ok, Code::Ok, Code::OverLimit]);
    let r = ask(&mut client, address("10.0.0.1"), 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 9, "edge's own rules");
    let r = ask_in(&mut client, "elsewhere", user(), 1).await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert!(r.statuses[0].current_limit.is_none());
    // api raised to 3: one more for u1 (it keeps the 2 it used); edge untouched.
    service.replace(api(3)).unwrap();
    assert_eq!(
        ask_in(&mut client, "api", user(), 1).await.overall_code(),
        Code::Ok
    );
    let r = ask(&mut client, address("10.0.0.1"), 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 8);
    // All at once: api alone from now on.
    service.replace_all([api(3)]).unwrap();
    let domains: Vec<String> = (service.configs().iter())
        .map(|c| c.domain().to_owned())
        .collect();
    assert_eq!(domains, ["api"]);
    let r = ask(&mut client, address("10.0.0.1"), 1).await;
    assert!(r.statuses[0].current_limit.is_none(), "edge is not served");
    let err = RlsService::with_domains(LocalBackend::new(), [edge.clone(), edge])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("\"edge\" given twice"), "{err}");
}

#[tokio::test]
async fn hits_addend_is_the_cost() {
    let (mut client, _clock) = example().await;
    let addr = |hits: Option<u64>| {
        let mut d = descriptor(&[("remote_address", "10.0.0.1")]);
        d.hits_addend = hits.map(|value| UInt64Value { value });
        vec![d]
    };
    assert_eq!(
        ask(&mut client, addr(None), 3).await.statuses[0].limit_remaining,
        7
    );
    assert_eq!(
        ask(&mut client, addr(Some(2)), 3).await.statuses[0].limit_remaining,
        5
    );
    assert_eq!(
        ask(&mut client, addr(Some(0)), 3).await.statuses[0].limit_remaining,
        5
    );
    assert_eq!(
        ask(&mut client, addr(None), 0).await.statuses[0].limit_remaining,
        4
    );
    // More than is left: over, nothing taken.
    let r = ask(&mut client, addr(Some(5)), 0).await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(
        ask(&mut client, addr(Some(4)), 0).await.statuses[0].limit_remaining,
        0
    );
}

/// Descriptors no rule names are OK and counted nowhere; so is another domain; a rule with a
/// value matches that value only.
#[tokio::test]
async fn unknown_descriptors_are_ok_and_uncounted() {
    let (mut client, _clock) = example().await;
    let unknown = vec![
        descriptor(&[("path", "/api")]),
        descriptor(&[("generic_key", "cheap")]),
        descriptor(&[("remote_address", "10.0.0.1"), ("path", "/api")]),
    ];
    for _ in 0..20 {
        let r = ask(&mut client, unknown.clone(), 0).await;
        assert_eq!(r.overall_code(), Code::Ok);
        assert_eq!(r.statuses.len(), 3);
        assert!(
            r.statuses.iter().all(|s| s.current_limit.is_none()),
            "{r:?}"
        );
        assert!(r.response_headers_to_add.is_empty());
    }
    let r = ask_in(&mut client, "other", address("10.0.0.1"), 100).await;
    assert_eq!(r.overall_code(), Code::Ok);
    // The address was never counted.
    let r = ask(&mut client, address("10.0.0.1"), 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 9);
}

/// The descriptors of one request are decided together: when the expensive route is over its
/// limit, the address is not charged for the refused request.
#[tokio::test]
async fn descriptors_of_one_request_are_all_or_nothing() {
    let (mut client, _clock) = example().await;
    let both = || {
        vec![
            descriptor(&[("remote_address", "10.0.0.1")]),
            descriptor(&[("generic_key", "expensive")]),
        ]
    };
    for left in [1, 0] {
        let r = ask(&mut client, both(), 0).await;
        assert_eq!(r.overall_code(), Code::Ok);
        assert_eq!(r.statuses[1].limit_remaining, left);
    }
    for _ in 0..3 {
        let r = ask(&mut client, both(), 0).await;
        assert_eq!(r.overall_code(), Code::OverLimit);
        assert_eq!(
            (r.statuses[0].code(), r.statuses[1].code()),
            (Code::Ok, Code::OverLimit)
        );
        // The two admitted took 2 of the address's 10; the refused ones nothing.
        assert_eq!(r.statuses[0].limit_remaining, 8, "{r:?}");
    }
    let r = ask(&mut client, address("10.0.0.1"), 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 7);
}

/// A local backend whose answers for one key come only once `gate` opens, as a remote store's
/// late reply: the units are taken when asked, the answer is what waits.
#[derive(Clone)]
struct LateFor {
    local: LocalBackend<FakeRelativeClock>,
    late: tollgate::Key,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl tollgate::backend::Backend for LateFor {
    type Policy = <LocalBackend<FakeRelativeClock> as tollgate::backend::Backend>::Policy;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<Decision, tollgate::BackendError>>
                + Send
                + 'static,
        >,
    >;

    fn prepare(
        &self,
        policy: &tollgate::Policy,
        params: &[tollgate::quota::QuotaParams],
    ) -> Result<Self::Policy, tollgate::ConfigError> {
        self.local.prepare(policy, params)
    }

    fn decide(&self, policy: &Self::Policy, key: &tollgate::Key, cost: NonZeroU32) -> Self::Future {
        self.decide_with(policy, key, cost, Mode::Decide)
    }

    fn decide_with(
        &self,
        policy: &Self::Policy,
        key: &tollgate::Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> Self::Future {
        let decision = self.local.decide_with(policy, key, cost, mode);
        let gate = (*key == self.late).then(|| self.gate.clone());
        Box::pin(async move {
            if let Some(gate) = gate {
                drop(gate.acquire().await);
            }
            decision.await
        })
    }

    fn now_ns(&self) -> u64 {
        self.local.now_ns()
    }
}

/// A call dropped while its decisions are in flight (Envoy's timeout) takes nothing: the
/// descriptor whose answer landed gives its units back at once, the one whose answer is late
/// once it lands.
#[tokio::test]
async fn a_call_dropped_mid_decision_gives_back_what_it_took() {
    let clock = FakeRelativeClock::default();
    let backend = LateFor {
        local: LocalBackend::builder().clock(clock).build(),
        late: tollgate::Key::from_bytes("expensive").unwrap(),
        gate: std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let config = RlsConfig::from_yaml(EXAMPLE_RULES).unwrap();
    let service = RlsService::new(backend.clone(), config).unwrap();
    let both = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![
            descriptor(&[("remote_address", "10.0.0.1")]),
            descriptor(&[("generic_key", "expensive")]),
        ],
        hits_addend: 1,
    };
    let call = service.should_rate_limit(tonic::Request::new(both));
    let timed_out = tokio::time::timeout(Duration::from_millis(20), call).await;
    assert!(timed_out.is_err(), "the expensive route's answer is late");
    // What is left, checked only (a `hits_addend` of 0 takes nothing).
    let left = |entries: &[(&str, &str)]| {
        let service = service.clone();
        let mut d = descriptor(entries);
        d.hits_addend = Some(UInt64Value { value: 0 });
        async move {
            let request = RateLimitRequest {
                domain: "edge".into(),
                descriptors: vec![d],
                hits_addend: 1,
            };
            let r = service.should_rate_limit(tonic::Request::new(request));
            r.await.unwrap().into_inner().statuses[0].limit_remaining
        }
    };
    assert_eq!(left(&[("remote_address", "10.0.0.1")]).await, 10);
    // The late answer lands: the gate opens (for it, and for the checks after it).
    backend.gate.add_permits(1000);
    let mut expensive = 0;
    for _ in 0..100 {
        expensive = left(&[("generic_key", "expensive")]).await;
        if expensive == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(expensive, 2, "the late decision's unit was given back");
}

/// All or nothing under concurrency: 40 calls at once, each for a shared address and the
/// expensive route (5 an hour): exactly 5 are admitted, and the address keeps exactly their 5
/// units, the 35 refused calls' given back whatever order they landed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_are_all_or_nothing() {
    let rules = "domain: edge\ndescriptors:\n  - key: remote_address\n    quota: \"100/h\"\n  \
                 - key: generic_key\n    value: expensive\n    quota: \"5/h\"\n";
    let config = RlsConfig::from_yaml(rules).unwrap();
    let client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let both = || {
        vec![
            descriptor(&[("remote_address", "10.0.0.1")]),
            descriptor(&[("generic_key", "expensive")]),
        ]
    };
    let calls: Vec<_> = (0..40)
        .map(|_| {
            let mut client = client.clone();
            let descriptors = both();
            tokio::spawn(async move { ask(&mut client, descriptors, 1).await.overall_code() })
        })
        .collect();
    let mut ok = 0;
    for call in calls {
        ok += usize::from(call.await.unwrap() == Code::Ok);
    }
    assert_eq!(ok, 5);
    let mut check = descriptor(&[("remote_address", "10.0.0.1")]);
    check.hits_addend = Some(UInt64Value { value: 0 });
    let mut client = client;
    let r = ask(&mut client, vec![check], 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 95);
}

/// Configurations from envoyproxy/ratelimit's README, written here, load unchanged and mean
/// what they mean there: nested descriptors, `unlimited`, `shadow_mode`, `replaces`.
#[tokio::test]
async fn envoyproxy_ratelimit_configs_load_unchanged() {
    let messaging = r#"
domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5

  # Only allow 100 messages a day to any unique phone number
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
"#;
    let config = RlsConfig::from_yaml(messaging).unwrap();
    let names: Vec<&str> = config.policies().iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "messaging.message_type=marketing.to_number",
            "messaging.to_number"
        ]
    );
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let mut client = serve(RlsService::new(backend, config).unwrap()).await;
    let marketing = || {
        vec![descriptor(&[
            ("message_type", "marketing"),
            ("to_number", "2061111111"),
        ])]
    };
    for _ in 0..5 {
        let r = ask_in(&mut client, "messaging", marketing(), 0).await;
        assert_eq!(r.overall_code(), Code::Ok);
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit()), (5, Unit::Day));
    }
    let r = ask_in(&mut client, "messaging", marketing(), 0).await;
    assert_eq!(r.overall_code(), Code::OverLimit);

    let per_ip = r#"
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10

  # Black list IP
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0

  # An unlimited address
  - key: remote_address
    value: 50.0.0.6
    rate_limit:
      unlimited: true
"#;
    // The block list (a count of 0) refuses every request for its address, counting nothing;
    // the unlimited address is never counted; any other gets 10 a second.
    let config = RlsConfig::from_yaml(per_ip).unwrap();
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let mut client = serve(RlsService::new(backend, config).unwrap()).await;
    let ask_ip = |ip: &'static str| RateLimitRequest {
        domain: "edge_proxy_per_ip".into(),
        descriptors: vec![descriptor(&[("remote_address", ip)])],
        hits_addend: 0,
    };
    for _ in 0..20 {
        let r = client
            .should_rate_limit(ask_ip("50.0.0.6"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code(), Code::Ok);
        assert!(r.statuses[0].current_limit.is_none());
    }
    for _ in 0..3 {
        let r = client
            .should_rate_limit(ask_ip("50.0.0.5"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code(), Code::OverLimit);
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit()), (0, Unit::Second));
        assert_eq!(header(&r, "retry-after"), Some("1"));
    }
    let mut codes = Vec::new();
    for _ in 0..11 {
        let r = client.should_rate_limit(ask_ip("50.0.0.7")).await.unwrap();
        codes.push(r.into_inner().overall_code());
    }
    assert_eq!(codes[..10], [Code::Ok; 10]);
    assert_eq!(codes[10], Code::OverLimit);

    let shadow_and_replaces = r#"
domain: example
descriptors:
  - key: key1
    rate_limit:
      unit: minute
      requests_per_unit: 1
      name: one_a_minute
  - key: key2
    rate_limit:
      unit: minute
      requests_per_unit: 3
      replaces:
        - name: one_a_minute
  - key: key3
    shadow_mode: true
    rate_limit:
      unit: second
      requests_per_unit: 1
"#;
    let config = RlsConfig::from_yaml(shadow_and_replaces).unwrap();
    let backend = LocalBackend::builder()
        .clock(FakeRelativeClock::default())
        .build();
    let mut client = serve(RlsService::new(backend, config).unwrap()).await;
    let both = RateLimitRequest {
        domain: "example".into(),
        descriptors: vec![descriptor(&[("key1", "a")]), descriptor(&[("key2", "a")])],
        hits_addend: 0,
    };
    // key2's limit replaces key1's: three pass, counted by key2 alone.
    for _ in 0..3 {
        let r = client
            .should_rate_limit(both.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code(), Code::Ok, "{r:?}");
        assert!(r.statuses[0].current_limit.is_none());
    }
    let r = client.should_rate_limit(both).await.unwrap().into_inner();
    assert_eq!(r.overall_code(), Code::OverLimit);
    // Shadow mode: decided, always OK.
    let shadow = RateLimitRequest {
        domain: "example".into(),
        descriptors: vec![descriptor(&[("key3", "x")])],
        hits_addend: 0,
    };
    for left in [0, 0, 0] {
        let r = client
            .should_rate_limit(shadow.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code(), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, left);
    }
}

/// Invalid rules are refused naming the rule and the word.
#[test]
fn invalid_rules_name_the_rule_and_the_word() {
    let cases = [
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n",
            "fortnight",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_uint: 1 }\n",
            "requests_per_uint",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    quota: \"5 concurrent\"\n",
            "concurrent",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    quota: \"5/s bursty 10\"\n",
            "bursty",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n    quota: \"1/s\"\n  - key: k\n    value: v\n    quota: \"2/s\"\n",
            "twice",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    shadow_mode: true\n",
            "shadow_mode",
        ),
    ];
    for (yaml, word) in cases {
        let err = RlsConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(word), "{word}: {err}");
        if word != "requests_per_uint" {
            assert!(err.contains("d.k"), "names the rule: {err}");
        }
    }
}

/// Hourly limits: nothing comes back while a test against a real store runs.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
const HOURLY: &str = "domain: edge\ndescriptors:\n  - key: remote_address\n    quota: \"10/h\"\n  \
                      - key: generic_key\n    value: expensive\n    quota: \"2/h\"\n  \
                      - key: user\n    rate_limit: { unit: hour, requests_per_unit: 5 }\n";

/// Two rate limit services on one shared store count one limit: 10 for an address in all,
/// whichever is asked; and a request refused as a whole takes nothing on the store.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
async fn two_services_share_one_limit<A, B>(a: A, b: B)
where
    A: tollgate::backend::Backend,
    B: tollgate::backend::Backend,
{
    let config = || RlsConfig::from_yaml(HOURLY).unwrap();
    let mut a = serve(RlsService::new(a, config()).unwrap()).await;
    let mut b = serve(RlsService::new(b, config()).unwrap()).await;
    let mut ok = 0;
    for i in 0..14 {
        let client = if i % 2 == 0 { &mut a } else { &mut b };
        if ask(client, address("10.0.0.1"), 0).await.overall_code() == Code::Ok {
            ok += 1;
        }
    }
    assert_eq!(ok, 10);
    let both = || {
        vec![
            descriptor(&[("remote_address", "10.0.0.2")]),
            descriptor(&[("generic_key", "expensive")]),
        ]
    };
    let codes: Vec<Code> = [
        ask(&mut a, both(), 0).await,
        ask(&mut b, both(), 0).await,
        ask(&mut a, both(), 0).await,
        ask(&mut b, both(), 0).await,
    ]
    .iter()
    .map(|r| r.overall_code())
    .collect();
    assert_eq!(
        codes,
        [Code::Ok, Code::Ok, Code::OverLimit, Code::OverLimit]
    );
    // Two of the address's 10 taken, by the two admitted; the refused took nothing.
    let mut check = descriptor(&[("remote_address", "10.0.0.2")]);
    check.hits_addend = Some(UInt64Value { value: 0 });
    let left = |r: RateLimitResponse| r.statuses[0].limit_remaining;
    assert_eq!(left(ask(&mut b, vec![check.clone()], 0).await), 8);
    assert_eq!(left(ask(&mut a, vec![check.clone()], 0).await), 8);
    // Negative hits give units back on the store, whichever service is asked: a bucket
    // (GCRA) and a fixed window.
    let mut give_back = descriptor(&[("remote_address", "10.0.0.2")]);
    give_back.hits_addend = Some(UInt64Value { value: 2 });
    give_back.is_negative_hits = true;
    assert_eq!(left(ask(&mut a, vec![give_back], 0).await), 10);
    assert_eq!(left(ask(&mut b, vec![check], 0).await), 10);
    let user = || vec![descriptor(&[("user", "u1")])];
    ask(&mut a, user(), 1).await;
    ask(&mut b, user(), 1).await;
    let mut give_back = user();
    give_back[0].is_negative_hits = true;
    ask(&mut b, give_back, 2).await;
    // 5 left (also when an hour began meanwhile: the new window has all 5).
    let mut check = user();
    check[0].hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(left(ask(&mut a, check, 0).await), 5);
}

/// Two services on one SQL database of `$server`, through `$backend`'s builder.
macro_rules! two_services_on_sql {
    ($feature:literal, $name:ident, $backend:path, $server:path) => {
        #[cfg(feature = $feature)]
        #[tokio::test]
        async fn $name() {
            let server = <$server>::start();
            let backend = || {
                <$backend>::builder()
                    .url(server.url())
                    .timeout(Duration::from_secs(5))
                    .build()
                    .unwrap()
            };
            let a = backend();
            a.migrate().await.unwrap();
            two_services_share_one_limit(a, backend()).await;
        }
    };
}

two_services_on_sql!(
    "postgres",
    two_services_on_one_postgres_share_a_limit,
    tollgate::backend::postgres::PostgresBackend,
    support::sql::PgServer
);
two_services_on_sql!(
    "mysql",
    two_services_on_one_mysql_share_a_limit,
    tollgate::backend::mysql::MysqlBackend,
    support::sql::MariaDbServer
);

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use support::RedisServer;
    use tollgate::backend::redis::{FailurePolicy, RedisBackend};

    fn redis(server: &RedisServer) -> RedisBackend {
        RedisBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap()
    }

    fn rules() -> RlsConfig {
        RlsConfig::from_yaml(EXAMPLE_RULES).unwrap()
    }

    /// Two rate limit services on one Redis share a descriptor's limit: 10 in all, whichever
    /// is asked.
    #[tokio::test]
    async fn two_servers_on_one_redis_share_a_limit() {
        let server = RedisServer::start();
        two_services_share_one_limit(redis(&server), redis(&server)).await;
    }

    /// The same on a Redis Cluster (the two descriptors' keys on different nodes).
    #[tokio::test]
    async fn two_servers_on_one_redis_cluster_share_a_limit() {
        let cluster = support::RedisCluster::start();
        let backend = || {
            RedisBackend::builder()
                .cluster_nodes(cluster.urls())
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap()
        };
        two_services_share_one_limit(backend(), backend()).await;
    }

    /// envoyproxy/ratelimit's own rules (fixed windows) on the approximate mode: decided in
    /// this process at its share of the fleet's count, which is all of it for one instance.
    #[tokio::test]
    async fn the_approximate_mode_serves_window_rules() {
        use tollgate::backend::redis::Approximate;
        let server = RedisServer::start();
        let config = RlsConfig::from_yaml(
            "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      \
             unit: hour\n      requests_per_unit: 10\n",
        )
        .unwrap();
        for mode in [Approximate::synchronous(), Approximate::asynchronous()] {
            let backend = RedisBackend::builder()
                .url(server.url())
                .build_approximate(mode)
                .unwrap();
            let mut client = serve(RlsService::new(backend, config.clone()).unwrap()).await;
            let ip = if mode == Approximate::synchronous() {
                "10.0.0.1"
            } else {
                "10.0.0.2"
            };
            let mut codes = Vec::new();
            for _ in 0..12 {
                codes.push(ask(&mut client, address(ip), 0).await.overall_code());
            }
            let ok = codes.iter().filter(|c| **c == Code::Ok).count();
            assert_eq!(ok, 10, "{codes:?}");
            assert_eq!(codes[10..], [Code::OverLimit, Code::OverLimit]);
            // Negative hits give 3 back: 3 more, then over again.
            let mut give_back = address(ip);
            give_back[0].is_negative_hits = true;
            ask(&mut client, give_back, 3).await;
            // The refund reaches Redis with the next flush (every 5 ms; later on a busy
            // machine), and a decision made at Redis (the synchronous mode, a key in step)
            // sees it then: 3 admitted within 5 s, refusals taking nothing meanwhile, then over.
            let mut admitted = 0;
            for _ in 0..500 {
                if admitted == 3 {
                    break;
                }
                if ask(&mut client, address(ip), 0).await.overall_code() == Code::Ok {
                    admitted += 1;
                } else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            assert_eq!(admitted, 3, "{mode:?}");
            let r = ask(&mut client, address(ip), 0).await;
            assert_eq!(r.overall_code(), Code::OverLimit, "{mode:?}");
        }
        // The GCRA quotas of the example cannot be served approximately: said when loaded.
        let backend = RedisBackend::builder()
            .url(server.url())
            .build_approximate(Approximate::asynchronous())
            .unwrap();
        let err = RlsService::new(backend, rules()).err().unwrap().to_string();
        assert!(err.contains("sliding"), "{err}");
    }

    /// A layer in a service and the rate limit service, on one Redis, with the policy the
    /// rules name and the client's address as the key, count against one limit.
    #[tokio::test]
    async fn a_layer_and_the_service_share_a_limit() {
        let server = RedisServer::start();
        let config = rules();
        let policy = config.policies()[0].clone();
        assert_eq!(policy.name(), "edge.remote_address");
        let layer = tollgate::RateLimitLayer::builder()
            .backend(redis(&server))
            .policy(policy)
            .key(tollgate::key::PeerIp::new())
            .build()
            .unwrap();
        let app = axum::Router::new()
            .route("/", axum::routing::get(|| async { "ok" }))
            .layer(layer);
        let base = support::serve_app(app).await;
        let mut client = serve(RlsService::new(redis(&server), config).unwrap()).await;
        // Four through the layer (the service behind the gateway), from 127.0.0.1.
        for _ in 0..4 {
            assert_eq!(reqwest::get(&base).await.unwrap().status(), 200);
        }
        // The gateway asks for the same address: 6 left, then over.
        let addr = || address("127.0.0.1");
        let r = ask(&mut client, addr(), 0).await;
        assert_eq!(r.statuses[0].limit_remaining, 5, "{r:?}");
        for _ in 0..5 {
            assert_eq!(ask(&mut client, addr(), 0).await.overall_code(), Code::Ok);
        }
        assert_eq!(
            ask(&mut client, addr(), 0).await.overall_code(),
            Code::OverLimit
        );
        assert_eq!(reqwest::get(&base).await.unwrap().status(), 429);
    }

    /// Envoy's timeout over real gRPC on a real Redis: a call whose store answers late is
    /// dropped by the server at its `grpc-timeout`, and what its decisions take when they land
    /// is given back.
    #[tokio::test]
    async fn a_call_that_times_out_takes_nothing() {
        use support::proxy::{Fault, FaultProxy};
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port).await;
        let backend = RedisBackend::builder()
            .url(proxy.url())
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        // Hourly limits: nothing comes back by the time the test looks.
        let config = RlsConfig::from_yaml(
            "domain: edge\ndescriptors:\n  - key: remote_address\n    quota: \"10/h\"\n  \
             - key: generic_key\n    value: expensive\n    quota: \"2/h\"\n",
        )
        .unwrap();
        let mut client = serve(RlsService::new(backend, config).unwrap()).await;
        // Connected (the first call also loads the script) before the store slows down.
        let peek = |entries: &[(&str, &str)]| {
            let mut d = descriptor(entries);
            d.hits_addend = Some(UInt64Value { value: 0 });
            vec![d]
        };
        let r = ask(&mut client, peek(&[("remote_address", "10.0.0.1")]), 1).await;
        assert_eq!(r.statuses[0].limit_remaining, 10);
        proxy.set(Fault::Delay(Duration::from_millis(300)));
        let mut request = tonic::Request::new(RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![
                descriptor(&[("remote_address", "10.0.0.1")]),
                descriptor(&[("generic_key", "expensive")]),
            ],
            hits_addend: 1,
        });
        request.set_timeout(Duration::from_millis(50));
        let err = client.should_rate_limit(request).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Cancelled, "{err}");
        proxy.set(Fault::Pass);
        // The decisions land at the store 300 ms late, and are given back after.
        let mut left = (0, 0);
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let a = ask(&mut client, peek(&[("remote_address", "10.0.0.1")]), 1).await;
            let e = ask(&mut client, peek(&[("generic_key", "expensive")]), 1).await;
            left = (a.statuses[0].limit_remaining, e.statuses[0].limit_remaining);
            if left == (10, 2) {
                break;
            }
        }
        assert_eq!(left, (10, 2), "what the dropped call took was given back");
    }

    /// A store that cannot be asked: gRPC `UNAVAILABLE` when the failure policy fails closed
    /// (Envoy's `failure_mode_deny` decides), the failure policy's answer otherwise.
    #[tokio::test]
    async fn a_store_outage_answers_unavailable_or_the_failure_policy() {
        let port = support::closed_port();
        let down = |on_failure| {
            RedisBackend::builder()
                .url(format!("redis://127.0.0.1:{port}"))
                .timeout(Duration::from_millis(200))
                .on_failure(on_failure)
                .build()
                .unwrap()
        };
        let addr = || address("10.0.0.1");
        let mut closed =
            serve(RlsService::new(down(FailurePolicy::FailClosed), rules()).unwrap()).await;
        let err = closed
            .should_rate_limit(RateLimitRequest {
                domain: "edge".into(),
                descriptors: addr(),
                hits_addend: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
        let mut open =
            serve(RlsService::new(down(FailurePolicy::FailOpen), rules()).unwrap()).await;
        assert_eq!(ask(&mut open, addr(), 0).await.overall_code(), Code::Ok);
        let mut local =
            serve(RlsService::new(down(FailurePolicy::FallbackLocal), rules()).unwrap()).await;
        let mut ok = 0;
        for _ in 0..12 {
            if ask(&mut local, addr(), 0).await.overall_code() == Code::Ok {
                ok += 1;
            }
        }
        assert_eq!(ok, 10, "the local fallback at one instance's share");
    }
}

/// The service's metrics: `tollgate_rls_requests_total` by domain (the one served, or
/// `other`) and code, and each descriptor's decision in `tollgate_decisions_total` under its
/// rule's policy.
#[cfg(feature = "metrics")]
#[test]
fn calls_and_decisions_are_counted() {
    use support::recorded::{count, recorded};
    let snapshot = recorded(|| async {
        let (mut client, _clock) = example().await;
        for _ in 0..11 {
            ask(&mut client, address("10.0.0.1"), 0).await;
        }
        ask_in(&mut client, "elsewhere", address("10.0.0.1"), 0).await;
        // A store that cannot be asked, failing open: counted as the layer counts it.
        #[cfg(feature = "redis")]
        {
            use tollgate::backend::redis::{FailurePolicy, RedisBackend};
            let backend = RedisBackend::builder()
                .url(format!("redis://127.0.0.1:{}", support::closed_port()))
                .timeout(Duration::from_millis(200))
                .on_failure(FailurePolicy::FailOpen)
                .build()
                .unwrap();
            let config = RlsConfig::from_yaml(EXAMPLE_RULES).unwrap();
            let mut open = serve(RlsService::new(backend, config).unwrap()).await;
            let r = ask(&mut open, address("10.0.0.9"), 0).await;
            assert_eq!(r.overall_code(), Code::Ok);
        }
    });
    let count = |name: &str, labels: &[(&str, &str)]| count(&snapshot, name, labels);
    let calls = "tollgate_rls_requests_total";
    // The ten allowed, and the one failing open on Redis.
    let ok = if cfg!(feature = "redis") { 11 } else { 10 };
    assert_eq!(count(calls, &[("domain", "edge"), ("code", "ok")]), ok);
    assert_eq!(
        count(calls, &[("domain", "edge"), ("code", "over_limit")]),
        1
    );
    assert_eq!(count(calls, &[("domain", "other"), ("code", "ok")]), 1);
    let decisions = "tollgate_decisions_total";
    let policy = ("policy", "edge.remote_address");
    assert_eq!(count(decisions, &[policy, ("outcome", "allowed")]), 10);
    assert_eq!(count(decisions, &[policy, ("outcome", "denied")]), 1);
    #[cfg(feature = "redis")]
    assert_eq!(count(decisions, &[policy, ("outcome", "fail_open")]), 1);
}

/// Rules envoyproxy/ratelimit loads load here: descriptor values are what Envoy sends, so a
/// path longer than a policy name, a value with a space and one that is not ASCII are all
/// served, under names that stay readable, bounded, and the same on every server.
#[tokio::test]
async fn rules_with_any_values_load_under_bounded_names() {
    let rules = r#"
domain: istio-ingressgateway-ratelimit
descriptors:
  - key: header_match
    value: tenant-gold
    descriptors:
      - key: path
        value: /api/v1/organizations/projects/exports
        rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: lane
    value: slow lane
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: city
    value: Zürich
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: city
    value: Zurich
    rate_limit: { unit: minute, requests_per_unit: 2 }
"#;
    let config = RlsConfig::from_yaml(rules).unwrap();
    let names: Vec<&str> = config.policies().iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "istio-ingressgateway-ratelimit.header_match=tenant-~1b7a7463e0bb",
            "istio-ingressgateway-ratelimit.lane=slow_lane~9a7e499a5135",
            "istio-ingressgateway-ratelimit.city=Z_rich~9929a371615b",
            "istio-ingressgateway-ratelimit.city=Zurich",
        ]
    );
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let domain = "istio-ingressgateway-ratelimit";
    let nested = || {
        vec![descriptor(&[
            ("header_match", "tenant-gold"),
            ("path", "/api/v1/organizations/projects/exports"),
        ])]
    };
    for d in [
        nested(),
        vec![descriptor(&[("lane", "slow lane")])],
        vec![descriptor(&[("city", "Zürich")])],
    ] {
        let first = ask_in(&mut client, domain, d.clone(), 0).await;
        assert_eq!(first.overall_code(), Code::Ok, "{d:?}");
        let policy = header(&first, "ratelimit-policy").unwrap();
        assert!(policy.ends_with(";q=1;w=60"), "{policy}");
        let second = ask_in(&mut client, domain, d.clone(), 0).await;
        assert_eq!(second.overall_code(), Code::OverLimit, "{d:?}");
    }
    // `Zürich` and `Zurich` are two rules, each with its own limit.
    let r = ask_in(
        &mut client,
        domain,
        vec![descriptor(&[("city", "Zurich")])],
        0,
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 1);
}

/// IPv6 addresses are grouped by /64, as `ClientIp` and `PeerIp` group them: a client rotating
/// addresses inside its /64 keeps one bucket, and a layer keying by the client's address
/// counts against the service's bucket. `ipv6_prefix` changes it, and refuses what is not a
/// prefix length.
#[tokio::test]
async fn ipv6_addresses_are_grouped_as_the_layers_group_them() {
    let clock = FakeRelativeClock::default();
    let backend = LocalBackend::builder().clock(clock.clone()).build();
    let config = RlsConfig::from_yaml(EXAMPLE_RULES).unwrap();
    let service = RlsService::new(backend.clone(), config.clone()).unwrap();
    let mut client = serve(service).await;
    // The layer of a service behind the gateway, on the same buckets: 4 requests.
    let layer = tollgate::RateLimitLayer::builder()
        .backend(backend)
        .policy(config.policies()[0].clone())
        .key(tollgate::key::PeerIp::new())
        .build()
        .unwrap();
    let inner = tower::service_fn(|_req: http::Request<()>| async {
        let body = http_body_util::Full::new(bytes::Bytes::from_static(b"ok"));
        Ok::<_, std::convert::Infallible>(http::Response::new(body))
    });
    let mut svc = tower::Layer::layer(&layer, inner);
    for _ in 0..4 {
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert("[2001:db8::1]:443".parse::<std::net::SocketAddr>().unwrap());
        let res = tower::ServiceExt::oneshot(&mut svc, req).await.unwrap();
        assert_eq!(res.status(), 200);
    }
    // Another address of the same /64 at the gateway: 6 left, 5 after it.
    let r = ask(&mut client, address("2001:db8::ffff:1"), 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 5, "{r:?}");
    for _ in 0..5 {
        let r = ask(&mut client, address("2001:db8::2"), 0).await;
        assert_eq!(r.overall_code(), Code::Ok);
    }
    let r = ask(&mut client, address("2001:db8::3"), 0).await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    // Another /64 has its own bucket.
    let r = ask(&mut client, address("2001:db8:0:1::1"), 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 9);

    // Each address alone.
    let config = RlsConfig::from_yaml(EXAMPLE_RULES).unwrap();
    let service = RlsService::new(LocalBackend::new(), config).unwrap();
    let mut client = serve(service.ipv6_prefix(128).unwrap()).await;
    assert_eq!(
        ask(&mut client, address("2001:db8::1"), 9).await.statuses[0].limit_remaining,
        1
    );
    assert_eq!(
        ask(&mut client, address("2001:db8::2"), 0).await.statuses[0].limit_remaining,
        9
    );
    let config = RlsConfig::from_yaml(EXAMPLE_RULES).unwrap();
    for bad in [0, 129] {
        let service = RlsService::new(LocalBackend::new(), config.clone()).unwrap();
        let err = service.ipv6_prefix(bad).err().unwrap().to_string();
        assert!(err.contains("ipv6_prefix"), "{err}");
    }
}

/// Envoy's `is_negative_hits` gives units back: with 10 and 4 taken, 3 negative hits leave 9;
/// a refund never fills past full, is never refused, and a negative check takes nothing.
#[tokio::test]
async fn negative_hits_give_units_back() {
    let (mut client, _clock) = example().await;
    let addr = |hits: Option<u64>, negative: bool| {
        let mut d = descriptor(&[("remote_address", "10.0.0.1")]);
        d.hits_addend = hits.map(|value| UInt64Value { value });
        d.is_negative_hits = negative;
        vec![d]
    };
    let r = ask(&mut client, addr(Some(4), false), 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 6);
    let r = ask(&mut client, addr(Some(3), true), 0).await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 9);
    // The request's `hits_addend` when the descriptor has none; past full is full.
    let r = ask(&mut client, addr(None, true), 5).await;
    assert_eq!(r.statuses[0].limit_remaining, 10);
    let r = ask(&mut client, addr(Some(0), true), 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 10);
    // Spent, then given back: admitted again.
    assert_eq!(
        ask(&mut client, addr(Some(10), false), 0)
            .await
            .overall_code(),
        Code::Ok
    );
    assert_eq!(
        ask(&mut client, addr(None, false), 0).await.overall_code(),
        Code::OverLimit
    );
    ask(&mut client, addr(Some(2), true), 0).await;
    let r = ask(&mut client, addr(Some(2), false), 0).await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 0);
}

/// What envoyproxy/ratelimit answers, where tollgate used to answer otherwise: an `unlimited`
/// descriptor has `u32::MAX` left; a block-list rule (`requests_per_unit: 0`) resets at its
/// window's end, and `Retry-After` says so; an unnamed rule's `current_limit.name` is empty
/// (its policy is in `RateLimit-Policy`); an empty domain or descriptor list is an error.
#[tokio::test]
async fn answers_match_envoyproxy_ratelimit() {
    let rules = r#"
domain: edge
descriptors:
  - key: remote_address
    value: 50.0.0.5
    rate_limit: { unit: hour, requests_per_unit: 0 }
  - key: remote_address
    value: 50.0.0.6
    rate_limit: { unlimited: true }
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 10 }
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 3, name: per_user }
"#;
    let config = RlsConfig::from_yaml(rules).unwrap();
    let mut client = serve(RlsService::new(LocalBackend::new(), config).unwrap()).await;
    let r = ask(&mut client, address("50.0.0.6"), 0).await;
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
    assert!(r.statuses[0].current_limit.is_none());

    let hour_left = || {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        3600 - now % 3600
    };
    let before = hour_left();
    let r = ask(&mut client, address("50.0.0.5"), 0).await;
    let after = hour_left();
    assert_eq!(r.overall_code(), Code::OverLimit);
    let reset = r.statuses[0].duration_until_reset.unwrap();
    // Seconds left in this hour (a new hour may begin between the two readings).
    let secs = reset.seconds as u64 + u64::from(reset.nanos > 0);
    assert!(
        secs == before || secs == after || secs == 3600,
        "{reset:?}, {before}, {after}"
    );
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert_eq!(retry, secs);

    let r = ask(&mut client, address("10.0.0.1"), 0).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().name, "");
    let r = ask(&mut client, vec![descriptor(&[("user", "u1")])], 0).await;
    assert_eq!(
        r.statuses[0].current_limit.as_ref().unwrap().name,
        "per_user"
    );

    for (domain, descriptors, message) in [
        ("", address("10.0.0.1"), "domain must not be empty"),
        ("edge", vec![], "descriptor list must not be empty"),
    ] {
        let err = client
            .should_rate_limit(RateLimitRequest {
                domain: domain.into(),
                descriptors,
                hits_addend: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains(message), "{err:?}");
    }
}

/// tollgate's `quota:` extension with a calendar period: `duration_until_reset` is the exact
/// time to the tenant's billing day in its zone, `current_limit` the plan per month; a
/// `rate_limit` with `unit: month` keeps envoyproxy/ratelimit's 30 days from the epoch.
#[cfg(feature = "calendar")]
#[tokio::test]
async fn a_calendar_quota_resets_on_its_billing_day() {
    use tollgate::testing::ManualClock;
    let rules = "domain: d\ndescriptors:\n  - key: tenant\n    \
                 quota: \"2/month on 31 at 09:00 tz America/New_York\"\n  \
                 - key: legacy\n    rate_limit:\n      unit: month\n      requests_per_unit: 2\n";
    let config = RlsConfig::from_yaml(rules).unwrap();
    let clock = ManualClock::new();
    let mut client = serve(RlsService::new(clock.backend(), config).unwrap()).await;
    // 2026-02-27 12:00 EST: the month ends on 28 February, 09:00 EST.
    clock.advance(Duration::from_secs(
        1_772_211_600 - ManualClock::START.as_secs(),
    ));
    let until = Duration::from_secs(1_772_287_200 - 1_772_211_600);
    let r = ask_in(&mut client, "d", vec![descriptor(&[("tenant", "acme")])], 1).await;
    let s = &r.statuses[0];
    assert_eq!(s.code(), Code::Ok);
    let reset = s.duration_until_reset.unwrap();
    assert_eq!(
        Duration::new(reset.seconds as u64, reset.nanos as u32),
        until
    );
    let l = s.current_limit.as_ref().unwrap();
    assert_eq!((l.requests_per_unit, l.unit()), (2, Unit::Month));
    ask_in(&mut client, "d", vec![descriptor(&[("tenant", "acme")])], 1).await;
    let r = ask_in(&mut client, "d", vec![descriptor(&[("tenant", "acme")])], 1).await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    let reset = r.statuses[0].duration_until_reset.unwrap();
    assert_eq!(reset.seconds as u64, until.as_secs());
    // `unit: month`: 30 days from the epoch (2026-02-27 12:00 EST is 12 days and 17 hours
    // into such a window), as envoyproxy/ratelimit counts them.
    let r = ask_in(&mut client, "d", vec![descriptor(&[("legacy", "x")])], 1).await;
    let reset = r.statuses[0].duration_until_reset.unwrap();
    let month = 30 * 86_400;
    assert_eq!(reset.seconds as u64, month - 1_772_211_600 % month);
}
