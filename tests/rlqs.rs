//! Envoy's rate limit quota service (RLQS) over a real gRPC connection: the protocol as a
//! stream sees it (splits, counts shared with RLS, rule changes, the edges of the protocol).
//! The same service behind real Envoys is in `tests/envoy.rs`.
#![cfg(feature = "rls")]

mod support;

use std::time::Duration;

use support::rlqs::{Action, Stream, Usage, key};
use tollgate::backend::LocalBackend;
use tollgate::rls::envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use tollgate::rls::{RlsConfig, RlsService};

const RULES: &str = r#"
domain: edge
descriptors:
  - key: name
    value: api
    descriptors:
      - key: tenant
        rate_limit: { unit: second, requests_per_unit: 1200 }
  - key: plan
    value: free
    rate_limit: { unit: hour, requests_per_unit: 100 }
  - key: open
    rate_limit: { unlimited: true }
  - key: blocked
    rate_limit: { unit: second, requests_per_unit: 0 }
"#;

/// Serves `service`'s RLS and RLQS on a free port.
async fn serve(service: &RlsService<LocalBackend>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.quota_service().into_server())
            .add_service(service.clone().into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    port
}

/// A service on [`RULES`] and the local store, served.
async fn start() -> (RlsService<LocalBackend>, u16) {
    let service =
        RlsService::new(LocalBackend::new(), RlsConfig::from_yaml(RULES).unwrap()).unwrap();
    let port = serve(&service).await;
    (service, port)
}

const T1: &[(&str, &str)] = &[("tenant", "t1"), ("name", "api")];

/// The limit split between streams by demand: a new stream gets an equal share (not nothing,
/// and the first stream not everything), shares follow demand max-min fair and add up to the
/// limit, and a stream that closes returns its share. Entries match in any order.
#[tokio::test]
async fn streams_split_a_bucket_by_demand() {
    let (service, port) = start().await;
    let mut a = Stream::open(port).await;
    let mut b = Stream::open(port).await;
    // A's first report (at its first request): the whole rate, unknown demand.
    let got = a.report("edge", &[(T1, 1, 0, 0)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(1200, 1200));
    // B joins: half each... B's share now, A's at its next report.
    let got = b.report("edge", &[(T1, 1, 0, 0)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(600, 600));
    // A asked for 1000/s, B for 100/s: B gets what it asks and the headroom's half, A the rest.
    let got = a.report("edge", &[(T1, 3000, 2000, 5)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(600, 600));
    let got = b.report("edge", &[(T1, 500, 0, 5)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(150, 150));
    let got = a.report("edge", &[(T1, 3000, 2000, 5)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(1050, 1050));
    assert_eq!(service.quota_service().streams(), 2);
    // B hangs up: A gets the whole limit at its next report.
    drop(b);
    for _ in 0..100 {
        if service.quota_service().streams() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(service.quota_service().streams(), 1);
    let got = a.report("edge", &[(T1, 3000, 2000, 5)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(1200, 1200));
}

/// What a stream gets for buckets no rule counts, and every bucket of the stream in every
/// answer: no rule, another domain, `unlimited` are ALLOW_ALL; a rule of 0 is DENY_ALL; a
/// bucket left out of a report is answered again as it was.
#[tokio::test]
async fn buckets_without_a_counting_rule() {
    let (_service, port) = start().await;
    let mut s = Stream::open(port).await;
    let none: &[(&str, &str)] = &[("route", "/x")];
    let open: &[(&str, &str)] = &[("open", "yes")];
    let blocked: &[(&str, &str)] = &[("blocked", "1.2.3.4")];
    let got = s
        .report(
            "edge",
            &[(none, 1, 0, 0), (open, 1, 0, 0), (blocked, 1, 0, 0)],
        )
        .await;
    assert_eq!(got[&key(none)], Action::AllowAll);
    assert_eq!(got[&key(open)], Action::AllowAll);
    assert_eq!(got[&key(blocked)], Action::DenyAll);
    // A report of one bucket: every bucket of the stream is answered.
    let got = s.report("edge", &[(T1, 1, 0, 0)]).await;
    assert_eq!(got.len(), 4, "{got:?}");
    assert_eq!(got[&key(blocked)], Action::DenyAll);
    // Another domain: allowed, counted nowhere.
    let mut other = Stream::open(port).await;
    let got = other.report("elsewhere", &[(T1, 1, 0, 0)]).await;
    assert_eq!(got[&key(T1)], Action::AllowAll);
}

/// The counts are the store's: what a fleet allowed is charged to the rule's bucket, so that
/// an RLS call on the same descriptor sees it, and a long window spent is DENY_ALL until it
/// resets, for every stream. What RLS callers take leaves less for the fleet.
#[tokio::test]
async fn charges_share_the_count_with_rls() {
    let (_service, port) = start().await;
    let free: &[(&str, &str)] = &[("plan", "free")];
    let mut s = Stream::open(port).await;
    // 100 an hour: the first report's request charged, 99 left, given as burst; the rate
    // (under a token a second) as one token.
    let got = s.report("edge", &[(free, 1, 0, 0)]).await;
    assert_eq!(got[&key(free)], Action::TokenBucket(99, 1));
    // RLS calls on the same descriptor take 9 more.
    let mut rls = support::rls_client(port).await;
    for _ in 0..9 {
        let (code, _) = support::ask(&mut rls, "edge", &[("plan", "free")]).await;
        assert_eq!(code, "OK");
    }
    // The stream allowed 80 since: 10 left in the hour.
    let got = s.report("edge", &[(free, 80, 0, 5)]).await;
    assert_eq!(got[&key(free)], Action::TokenBucket(10, 1));
    // 10 more: spent for the hour. DENY_ALL, and RLS refuses too.
    let got = s.report("edge", &[(free, 10, 7, 5)]).await;
    assert_eq!(got[&key(free)], Action::DenyAll);
    let (code, _) = support::ask(&mut rls, "edge", &[("plan", "free")]).await;
    assert_eq!(code, "OVER_LIMIT");
    // A second stream's first report: denied as well.
    let mut t = Stream::open(port).await;
    let got = t.report("edge", &[(free, 1, 0, 0)]).await;
    assert_eq!(got[&key(free)], Action::DenyAll);
}

/// A rules change re-splits at the next report; a rule removed is abandoned once (and the
/// bucket forgotten: its next report is a first one, allowed), never at a first report.
#[tokio::test]
async fn a_rules_change_resplits_and_a_removed_rule_abandons() {
    let (service, port) = start().await;
    let mut s = Stream::open(port).await;
    let got = s.report("edge", &[(T1, 1, 0, 0)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(1200, 1200));
    service
        .replace(RlsConfig::from_yaml(&RULES.replace("1200", "300")).unwrap())
        .unwrap();
    let got = s.report("edge", &[(T1, 100, 0, 5)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(300, 300));
    // The tenant rule removed.
    let without =
        "domain: edge\ndescriptors:\n  - key: open\n    rate_limit: { unlimited: true }\n";
    service
        .replace(RlsConfig::from_yaml(without).unwrap())
        .unwrap();
    let got = s.report("edge", &[(T1, 100, 0, 5)]).await;
    assert_eq!(got[&key(T1)], Action::Abandon);
    // Envoy re-creates the bucket: a first report, allowed (not abandoned again).
    let got = s.report("edge", &[(T1, 1, 0, 0)]).await;
    assert_eq!(got[&key(T1)], Action::AllowAll);
    // A first report of a bucket no rule counts is never abandoned either.
    let mut t = Stream::open(port).await;
    let got = t.report("edge", &[(T1, 1, 0, 0)]).await;
    assert_eq!(got[&key(T1)], Action::AllowAll);
}

/// The protocol's edges: a bucket id of hundreds of entries is allowed (no rule has that
/// many levels); thousands of buckets from one stream are held up to the cap, the rest get no
/// assignment; an empty domain ends the stream with INVALID_ARGUMENT; bytes that are no
/// report end it too, and the service goes on serving.
#[tokio::test]
async fn the_protocols_edges() {
    let (_service, port) = start().await;
    let mut s = Stream::open(port).await;
    let many: Vec<(String, String)> = (0..300)
        .map(|i| (format!("k{i}"), format!("v{i}")))
        .collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let got = s.report("edge", &[(&many, 1, 0, 0)]).await;
    assert_eq!(got[&key(&many)], Action::AllowAll);

    // 5 000 tenants from one stream, cap 4 096: the first 4 095 more are held.
    let tenants: Vec<String> = (0..5_000).map(|i| format!("t{i}")).collect();
    let buckets: Vec<[(&str, &str); 2]> = (tenants.iter())
        .map(|t| [("name", "api"), ("tenant", t.as_str())])
        .collect();
    let usages: Vec<Usage<'_>> = buckets.iter().map(|b| (&b[..], 1, 0, 0)).collect();
    let got = s.report("edge", &usages).await;
    assert_eq!(got.len(), 4_096);
    assert!(
        got.values()
            .filter(|a| **a == Action::TokenBucket(1200, 1200))
            .count()
            == 4_095
    );
    // Held buckets keep being answered; the others still get nothing.
    let got = s.report("edge", &usages[4_500..]).await;
    assert_eq!(got.len(), 4_096);

    // An empty domain: the stream ends with INVALID_ARGUMENT.
    let mut bad = Stream::open(port).await;
    bad.send
        .send(RateLimitQuotaUsageReports::default())
        .await
        .unwrap();
    let err = bad.answers.message().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");

    // Garbage on the wire: the stream ends with an error, and nothing else is hurt.
    let code = support::grpc_garbage(
        port,
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
    )
    .await;
    assert_ne!(code, tonic::Code::Ok, "garbage must not be answered as OK");
    let mut after = Stream::open(port).await;
    let got = after.report("edge", &[(T1, 1, 0, 0)]).await;
    assert!(matches!(got[&key(T1)], Action::TokenBucket(..)));
}

/// A stream that stays open and never reports again holds its share for 30 s (its Envoy's
/// assignment lives 20 s), then the others' reports find it gone and split without it.
#[tokio::test]
async fn a_stream_that_never_reports_again_gives_its_share_back() {
    let (service, port) = start().await;
    let mut quiet = Stream::open(port).await;
    let mut busy = Stream::open(port).await;
    quiet.report("edge", &[(T1, 1, 0, 0)]).await;
    let got = busy.report("edge", &[(T1, 5_000, 1_000, 5)]).await;
    assert_eq!(got[&key(T1)], Action::TokenBucket(600, 600));
    // The server measures the time a report covers (20 s here: 1 400 requests a second).
    tokio::time::sleep(Duration::from_secs(20)).await;
    let got = busy.report("edge", &[(T1, 24_000, 4_000, 20)]).await;
    assert_eq!(
        got[&key(T1)],
        Action::TokenBucket(600, 600),
        "still held at 20 s"
    );
    tokio::time::sleep(Duration::from_secs(11)).await;
    let got = busy.report("edge", &[(T1, 15_400, 0, 11)]).await;
    assert_eq!(
        got[&key(T1)],
        Action::TokenBucket(1200, 1200),
        "given back after 30 s"
    );
    // The stream is still open: its next report joins the split again.
    assert_eq!(service.quota_service().streams(), 2);
    drop(quiet);
}
