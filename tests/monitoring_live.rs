//! The shipped dashboard and rules against a real Prometheus (issue 47): Debian's `prometheus`
//! binary, started here on a free port with a one-second scrape, scrapes a tollgate server
//! under load (Redis exact with its local fallback, a fail-open route, the local backend with
//! a small key table, the approximate mode, the rate limit service and an adaptive limit).
//! The store-failing alert goes pending, then firing, when Redis is killed, and resolves when it
//! is back; then every panel's expression, every recording rule and every alert's query
//! returns series through Prometheus's HTTP API.

use std::num::NonZeroU32;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde_json::Value;
use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit};
use tollgate::backend::LocalBackend;
use tollgate::backend::redis::{Approximate, FailurePolicy, Fleet, RedisBackend};
use tollgate::key::Header;
use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::rls::{RlsConfig, RlsService};
use tollgate::{Policy, Quota, RateLimitLayer};

mod support;

#[allow(dead_code)]
#[path = "../examples/monitoring.rs"]
mod generator;

/// Prometheus on a free port, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts Prometheus scraping `target` (`host:port`, path `/metrics`) every second, with the
/// shipped rules generated for short windows (`--rate-window 10s --for 5s`).
async fn prometheus(target: &str) -> Prometheus {
    let dir = tempfile::tempdir().unwrap();
    let settings = generator::Settings {
        rate_window: "10s".into(),
        for_all: Some("5s".into()),
        ..generator::Settings::default()
    };
    for (name, text) in generator::files(&settings) {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
         rule_files: [tollgate-rules.yaml, tollgate-alerts.yaml]\n\
         scrape_configs:\n  - job_name: api\n    static_configs:\n      - targets: ['{target}']\n"
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let port = free_port();
    let bin = std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
    let child = Command::new(&bin)
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e} (install Debian's `prometheus`)"));
    let p = Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    };
    let client = reqwest::Client::new();
    for _ in 0..300 {
        if let Ok(r) = client.get(format!("{}/-/ready", p.url)).send().await
            && r.status().is_success()
        {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("prometheus did not start");
}

/// Prometheus's JSON answer to `GET <path>?<params>`.
async fn api(p: &Prometheus, path: &str, params: &[(&str, String)]) -> Value {
    (reqwest::Client::new().get(format!("{}{path}", p.url)))
        .query(params)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A query's result vector.
async fn query(p: &Prometheus, expr: &str) -> Vec<Value> {
    let res = api(p, "/api/v1/query", &[("query", expr.to_owned())]).await;
    assert_eq!(res["status"], "success", "{expr}: {res}");
    res["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The state of alert `name` (`pending`, `firing`), if it is active.
async fn alert_state(p: &Prometheus, name: &str) -> Option<String> {
    let res = api(p, "/api/v1/alerts", &[]).await;
    (res["data"]["alerts"].as_array()?.iter())
        .find(|a| a["labels"]["alertname"] == name)
        .map(|a| a["state"].as_str().unwrap_or_default().to_owned())
}

/// Waits up to `secs` for alert `name` to be in `state` (`None`: inactive).
async fn wait_alert(p: &Prometheus, name: &str, state: Option<&str>, secs: u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        let now = alert_state(p, name).await;
        if now.as_deref() == state {
            return;
        }
        assert!(
            Instant::now() < until,
            "{name}: {now:?}, not {state:?} within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The main panels' queries over the run, from Prometheus (`query_range`, a point a second),
/// saved to `target/observability-run.json` with the times Redis was killed and restarted:
/// `scripts/plot-observability.py` draws `docs/observability.png` from it.
async fn save_run(p: &Prometheus, start: f64, killed: f64, restarted: f64) {
    let end = unix_now();
    let panels = [
        (
            "decisions",
            "sum by (outcome) (rate(tollgate_decisions_total{policy=~\"shared|open\"}[5s]))",
        ),
        (
            "errors",
            "sum by (kind) (rate(tollgate_backend_errors_total[5s]))",
        ),
        (
            "breaker",
            "max by (backend) (tollgate_circuit_breaker_open)",
        ),
        (
            "p99",
            "histogram_quantile(0.99, sum by (le) (rate(tollgate_backend_latency_seconds_bucket[5s])))",
        ),
        (
            "alert",
            "max by (alertstate) (ALERTS{alertname=\"TollgateStoreFailing\"})",
        ),
    ];
    let mut out = serde_json::Map::new();
    for (name, expr) in panels {
        let params = [
            ("query", expr.to_owned()),
            ("start", format!("{start:.3}")),
            ("end", format!("{end:.3}")),
            ("step", "1".to_owned()),
        ];
        let res = api(p, "/api/v1/query_range", &params).await;
        out.insert(
            name.into(),
            serde_json::json!({ "expr": expr, "result": res["data"]["result"] }),
        );
    }
    out.insert("start".into(), start.into());
    out.insert("killed".into(), killed.into());
    out.insert("restarted".into(), restarted.into());
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/target/observability-run.json");
    let _ = std::fs::write(path, serde_json::to_string(&Value::Object(out)).unwrap());
}

fn rls_request(ip: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "remote_address".into(),
                value: ip.into(),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_runs_every_query_and_the_store_alert_fires_and_resolves() {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("tollgate_backend_latency_seconds".into()),
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.08, 0.1, 0.25,
            ],
        )
        .unwrap()
        .install_recorder()
        .unwrap();
    let mut redis = support::RedisServer::start_with(&["--maxmemory", "64mb"]);
    let url = redis.url();

    // Redis exact, with its local fallback (the default) and a breaker; and a fail-open one.
    let exact = RedisBackend::builder()
        .url(&url)
        .timeout(Duration::from_secs(1))
        .circuit_breaker(3, Duration::from_millis(500))
        .watch_memory(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    let open = RedisBackend::builder()
        .url(&url)
        .timeout(Duration::from_secs(1))
        .on_failure(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    fn layer<B: tollgate::backend::Backend>(
        policy: Policy,
        backend: B,
    ) -> RateLimitLayer<Header, B> {
        RateLimitLayer::builder()
            .key(Header::new("x-key"))
            .backend(backend)
            .policy(policy)
            .build()
            .unwrap()
    }
    let local = LocalBackend::builder().max_keys(8).build();
    let limit = AdaptiveLimit::builder()
        .name("api")
        .min_samples(1)
        .window(Duration::from_millis(10), Duration::from_millis(100))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/shared", get(|| async { "ok" }))
        // 10 a second per key against 2: denials, most answered by the deny cache.
        .route_layer(layer(
            Policy::new("shared", Quota::per_second(2).burst(2)),
            exact.clone(),
        ))
        .merge(
            Router::new()
                .route("/open", get(|| async { "ok" }))
                .route_layer(layer(
                    Policy::new("open", Quota::per_second(20).burst(10)),
                    open,
                )),
        )
        .merge(
            Router::new()
                .route("/local", get(|| async { "ok" }))
                .route_layer(layer(
                    // A request marked `x-big` costs more than the whole burst: never fits.
                    Policy::new("local", Quota::per_second(5).burst(5)).cost_fn(|req| {
                        if req.headers().contains_key("x-big") {
                            50
                        } else {
                            1
                        }
                    }),
                    local,
                )),
        )
        .merge(
            Router::new()
                .route("/adaptive", get(|| async { "ok" }))
                .route_layer(AdaptiveLayer::new(limit)),
        )
        .merge(
            Router::new()
                .route("/deadline", get(|| async { "ok" }))
                .route_layer(
                    tollgate::deadline::DeadlineLayer::new()
                        .header(http::HeaderName::from_static("x-request-timeout-ms")),
                ),
        )
        .route(
            "/metrics",
            get(move || {
                let h = handle.clone();
                async move { h.render() }
            }),
        );
    let target = support::serve(app).await;
    let base = format!("http://{target}");

    // The approximate mode: two instances over one key past its limit (as tests/metrics.rs),
    // so its allowances, announcements and over-limit estimate have series.
    let approx = || {
        RedisBackend::builder()
            .url(&url)
            .fleet(Fleet::Size(NonZeroU32::new(2).unwrap()))
            .build_approximate(Approximate::asynchronous())
            .unwrap()
    };
    {
        use tollgate::backend::Backend;
        let (a, b) = (approx(), approx());
        let policy = Policy::new("approx", Quota::per_hour(20).fixed_window());
        let (pa, pb) = (support::prepare(&a, &policy), support::prepare(&b, &policy));
        let y = support::key("y");
        a.flush().await;
        b.flush().await;
        for _ in 0..4 {
            let _ = b.decide(&pb, &y, support::cost(1)).await;
        }
        for _ in 0..30 {
            let _ = a.decide(&pa, &y, support::cost(1)).await;
            a.flush().await;
        }
        b.flush().await;
        let _ = b.decide(&pb, &y, support::cost(1)).await;
        b.flush().await;
    }

    // The rate limit service, asked by a client.
    let rls = RlsService::new(
        LocalBackend::new(),
        RlsConfig::from_yaml(
            "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: { unit: second, requests_per_unit: 2 }\n",
        )
        .unwrap(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rls_addr = listener.local_addr().unwrap();
    // Its quota service (RLQS) on the same port, a stream holding at most one bucket.
    let quota = rls.quota_service().max_buckets(1);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(quota.into_server())
            .add_service(rls.into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut rls_client = RateLimitServiceClient::connect(format!("http://{rls_addr}"))
        .await
        .unwrap();
    let mut quota_stream = support::rlqs::Stream::open(rls_addr.port()).await;

    // A client of an upstream that refuses everything: its throttle refuses, its budget runs out.
    let throttle = tollgate::client::Throttle::builder()
        .name("partner")
        .build()
        .unwrap();
    let budget = tollgate::client::RetryBudget::builder()
        .name("partner")
        .build()
        .unwrap();

    // Load: every route, several keys, 10 rounds a second, until the test ends.
    let load = tokio::spawn({
        let base = base.clone();
        async move {
            let client = reqwest::Client::new();
            let mut n = 0u64;
            loop {
                n += 1;
                for path in ["shared", "open", "adaptive"] {
                    for k in 0..3 {
                        let _ = (client.get(format!("{base}/{path}")))
                            .header("x-key", format!("k{k}"))
                            .send()
                            .await;
                    }
                }
                // The local table holds 8 keys: 12 keep it evicting.
                let _ = (client.get(format!("{base}/local")))
                    .header("x-key", format!("l{}", n % 12))
                    .send()
                    .await;
                if n.is_multiple_of(5) {
                    let _ = (client.get(format!("{base}/local")))
                        .header("x-key", "big")
                        .header("x-big", "1")
                        .send()
                        .await;
                }
                let _ = rls_client.should_rate_limit(rls_request("10.0.0.1")).await;
                // A caller whose deadline has passed; the client's throttle and budget.
                let _ = (client.get(format!("{base}/deadline")))
                    .header("x-request-timeout-ms", "0")
                    .send()
                    .await;
                for _ in 0..5 {
                    if let Ok(ticket) = throttle.admit() {
                        ticket.not_accepted();
                    }
                    budget.deposit();
                    let _ = budget.withdraw();
                }
                if n.is_multiple_of(10) {
                    // A report a second, of two buckets: the second past the stream's cap.
                    let a: &[(&str, &str)] = &[("remote_address", "10.0.0.1")];
                    let b: &[(&str, &str)] = &[("remote_address", "10.0.0.2")];
                    quota_stream
                        .report("edge", &[(a, 10, 2, 1), (b, 1, 0, 0)])
                        .await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });

    let p = prometheus(&target.to_string()).await;
    let started = unix_now();
    // Healthy: the store alert stays silent while series build up.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(alert_state(&p, "TollgateStoreFailing").await, None);
    assert!(!query(&p, "tollgate:decisions:rate").await.is_empty());

    // Redis dies: the fallback decides, the alert goes pending, then firing.
    let killed = unix_now();
    redis.kill();
    wait_alert(&p, "TollgateStoreFailing", Some("pending"), 30).await;
    wait_alert(&p, "TollgateStoreFailing", Some("firing"), 30).await;
    wait_alert(&p, "TollgateFailOpen", Some("firing"), 30).await;
    // Back: the store decides again, and once the window has passed the alert resolves.
    let restarted = unix_now();
    redis.restart();
    wait_alert(&p, "TollgateStoreFailing", None, 60).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    save_run(&p, started, killed, restarted).await;

    // Every expression returns series.
    let mut empty = Vec::new();
    let dash = generator::dashboard(&generator::Settings::default());
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            let expr = generator::filled(t["expr"].as_str().unwrap());
            if query(&p, &expr).await.is_empty() {
                empty.push(format!("panel {:?}: {expr}", panel["title"]));
            }
        }
    }
    let settings = generator::Settings {
        rate_window: "1m".into(),
        ..generator::Settings::default()
    };
    for (record, expr) in generator::recording_rules(&settings) {
        if query(&p, &expr).await.is_empty() {
            empty.push(format!("rule {record}: {expr}"));
        }
    }
    for a in generator::alerts(&settings) {
        if query(&p, &a.query).await.is_empty() {
            empty.push(format!("alert {}: {}", a.name, a.query));
        }
    }
    load.abort();
    if !empty.is_empty() {
        // What the server exported, to tell a missing family from a query that misses it.
        let text = reqwest::get(format!("{base}/metrics"))
            .await
            .unwrap()
            .text()
            .await;
        eprintln!("the server's metrics:\n{}", text.unwrap_or_default());
    }
    assert!(empty.is_empty(), "no series:\n{}", empty.join("\n"));
}
