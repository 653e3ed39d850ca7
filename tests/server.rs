//! The `tollgate-server` binary, started as envoyproxy/ratelimit is deployed: its
//! `RUNTIME_ROOT` / `RUNTIME_SUBDIRECTORY` layout written as the kubelet writes a ConfigMap
//! (files behind a `..data` symlink, swapped on an update), its Redis variables, and asked
//! over gRPC and `/json`. The environment of `deploy/kubernetes/deployment.yaml` is the one the
//! binary runs with here (ports and addresses changed to the test's).
#![cfg(feature = "server")]

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::RedisServer;
use support::ask;
use support::server::ServerProcess;

/// envoyproxy/ratelimit's rules as they are: per API key, 5 a day (a fixed window: no
/// boundary passes during a test but at midnight UTC).
const RULES_V1: &str = "domain: edge
descriptors:
  - key: api_key
    rate_limit:
      unit: day
      requests_per_unit: 5
";

/// A ConfigMap's volume as the kubelet writes it: the files in a timestamped directory,
/// `..data` a symlink to it (swapped by a rename on an update), and each file a symlink
/// through `..data`.
fn write_configmap(dir: &Path, version: &str, files: &[(&str, &str)]) {
    let stamp = format!("..2026_12_01_{version}");
    std::fs::create_dir_all(dir.join(&stamp)).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(&stamp).join(name), text).unwrap();
    }
    let tmp = dir.join("..data_tmp");
    std::os::unix::fs::symlink(&stamp, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for (name, _) in files {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("..data/{name}"), &link).unwrap();
        }
    }
}

/// The environment `deploy/kubernetes/deployment.yaml` gives the container.
fn manifest_env() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes/deployment.yaml"),
    )
    .unwrap();
    let doc: serde_json::Value = serde_norway::from_str(&text).unwrap();
    let container = &doc["spec"]["template"]["spec"]["containers"][0];
    (container["env"].as_array().unwrap().iter())
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                e["value"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// The manifest's environment with the test's Redis and rules directory.
fn deployed(
    redis_url: &str,
    runtime_root: &Path,
    extra: &[(&str, &str)],
) -> Vec<(&'static str, String)> {
    let mut env: Vec<(&'static str, String)> = Vec::new();
    for (k, v) in manifest_env() {
        let v = match k.as_str() {
            // The manifest's `redis:6379` Service is the test's server (envoyproxy/ratelimit's
            // `host:port` form, no scheme).
            "REDIS_URL" => redis_url.trim_start_matches("redis://").to_owned(),
            "RUNTIME_ROOT" => runtime_root.display().to_string(),
            // The container's ports are the test's free ones.
            "PORT" | "GRPC_PORT" => continue,
            _ => v,
        };
        env.push((Box::leak(k.into_boxed_str()), v));
    }
    for (k, v) in extra {
        env.retain(|(n, _)| n != k);
        env.push((Box::leak((*k).to_owned().into_boxed_str()), (*v).to_owned()));
    }
    env
}

/// The manifest's deployment over `redis_url`, with `extra` variables, its rules (`RULES_V1`)
/// written as a ConfigMap: the runtime root (removed when dropped), the rules' directory, the
/// server.
fn deploy(
    redis_url: &str,
    extra: &[(&str, &str)],
) -> (tempfile::TempDir, std::path::PathBuf, ServerProcess) {
    let root = tempfile::tempdir().unwrap();
    let config = runtime_dir(root.path());
    write_configmap(&config, "v1", &[("edge.yaml", RULES_V1)]);
    let server = ServerProcess::start(&deployed(redis_url, root.path(), extra));
    (root, config, server)
}

/// The rules directory of the manifest's layout (`RUNTIME_ROOT/ratelimit/config`), made.
fn runtime_dir(root: &Path) -> std::path::PathBuf {
    let env = manifest_env();
    let sub = env
        .iter()
        .find(|(k, _)| k == "RUNTIME_SUBDIRECTORY")
        .map(|(_, v)| v.clone());
    let dir = root.join(sub.unwrap_or_default()).join("config");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn wait_for(what: &str, limit: Duration, mut ok: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if ok().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within {limit:?}");
}

/// Exact limits over gRPC and `/json` (one count); a ConfigMap update reloads the rules and
/// keeps what each key used; an invalid update is kept out, said in `/healthcheck` and the
/// log, and counted in `/metrics`; SIGTERM makes `/healthcheck` 503 while calls are still
/// answered, then the process exits 0.
#[tokio::test]
async fn deployed_as_envoyproxy_ratelimit_is() {
    let redis = RedisServer::start();
    let (_root, config, mut server) = deploy(
        &redis.url(),
        &[("RULES_RELOAD_MS", "100"), ("DRAIN_SECONDS", "1.5")],
    );
    let body = server.ready().await;
    assert!(body.starts_with("OK"), "{body}");
    assert!(
        server.log().contains("\"level\":\"INFO\""),
        "LOG_FORMAT=json: {}",
        server.log()
    );

    let mut grpc = server.grpc().await;
    let a = [("api_key", "a")];
    for left in [4, 3, 2] {
        assert_eq!(ask(&mut grpc, "edge", &a).await, ("OK".into(), left));
    }
    let call = r#"{"domain":"edge","descriptors":[{"entries":[{"key":"api_key","value":"a"}]}]}"#;
    let (status, answer) = server.json(call).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["overallCode"], "OK");
    assert_eq!(answer["statuses"][0]["limitRemaining"], 1);
    assert_eq!(answer["statuses"][0]["currentLimit"]["requestsPerUnit"], 5);
    assert_eq!(answer["statuses"][0]["currentLimit"]["unit"], "DAY");
    assert_eq!(server.json(call).await.0, 200);
    let (status, answer) = server.json(call).await;
    assert_eq!(status, 429, "{answer}");
    assert_eq!(answer["overallCode"], "OVER_LIMIT");
    assert_eq!(ask(&mut grpc, "edge", &a).await.0, "OVER_LIMIT");
    // Another key: its own 5. A bad request: 400.
    assert_eq!(
        ask(&mut grpc, "edge", &[("api_key", "b")]).await,
        ("OK".into(), 4)
    );
    assert_eq!(server.json("{\"domain\": 7}").await.0, 400);
    // The count is in Redis (envoyproxy/ratelimit's variables reached it).
    assert_ne!(redis.cmd(&["DBSIZE"]).trim(), ":0");

    // The ConfigMap is updated: 8 a day. `a` used 5: 3 more.
    write_configmap(
        &config,
        "v2",
        &[("edge.yaml", &RULES_V1.replace(": 5", ": 8"))],
    );
    wait_for("the reload", Duration::from_secs(10), async || {
        server
            .get("/rlconfig")
            .await
            .is_some_and(|(_, b)| b.contains("8/d"))
    })
    .await;
    let after: Vec<_> = [
        ask(&mut grpc, "edge", &a).await,
        ask(&mut grpc, "edge", &a).await,
        ask(&mut grpc, "edge", &a).await,
        ask(&mut grpc, "edge", &a).await,
    ]
    .into_iter()
    .map(|(code, _)| code)
    .collect();
    assert_eq!(after, ["OK", "OK", "OK", "OVER_LIMIT"]);

    // An invalid update is kept out: the old rules stay, the health check says why (and stays
    // 200: the rules served are fine), the log and the metrics too.
    write_configmap(
        &config,
        "v3",
        &[("edge.yaml", "domain: edge\ndescriptors:\n  - key: [")],
    );
    let (_, body) = server
        .wait_health(|s, b| s == 200 && b.contains("not reloaded"))
        .await;
    assert!(body.contains("edge.yaml"), "{body}");
    assert!(
        server.log().contains("rules not reloaded"),
        "{}",
        server.log()
    );
    let (_, rules) = server.get("/rlconfig").await.unwrap();
    assert!(rules.contains("edge.api_key: 8/d"), "{rules}");
    assert_eq!(
        ask(&mut grpc, "edge", &[("api_key", "b")]).await,
        ("OK".into(), 6)
    );
    let (status, metrics) = server.get("/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("tollgate_server_rules_reloads_total{outcome=\"error\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("tollgate_decisions_total"), "{metrics}");

    // An Envoy's RLQS stream on the same port and rules.
    let q: &[(&str, &str)] = &[("api_key", "q")];
    let mut stream = support::rlqs::Stream::open(server.grpc_port).await;
    let got = stream.report("edge", &[(q, 1, 0, 0)]).await;
    assert!(
        matches!(
            got[&support::rlqs::key(q)],
            support::rlqs::Action::TokenBucket(..)
        ),
        "{got:?}"
    );

    // SIGTERM: unhealthy at once, still answering calls while the load balancers move away,
    // then the quota stream ended (UNAVAILABLE: its Envoy opens it again elsewhere) and a
    // clean exit, not held by the stream.
    server.sigterm();
    let (status, body) = server.wait_health(|s, _| s == 503).await;
    assert_eq!(status, 503);
    assert!(body.contains("draining"), "{body}");
    assert_eq!(
        ask(&mut grpc, "edge", &[("api_key", "c")]).await,
        ("OK".into(), 7)
    );
    let ended = tokio::time::timeout(Duration::from_secs(5), stream.answers.message())
        .await
        .expect("the stream ended after the drain");
    assert_eq!(ended.unwrap_err().code(), tonic::Code::Unavailable);
    let exit = server
        .wait_exit(Duration::from_secs(5))
        .await
        .expect("exits after the drain");
    assert!(exit.success(), "{exit:?}");
}

/// Redis down at start: the server starts, is ready (the local fallback decides: no crash
/// loop, no request waiting out a timeout), says the store is down; once Redis is up, calls
/// are counted there. With `ON_FAILURE=closed`, the same outage makes it unready instead.
#[tokio::test]
async fn redis_down_at_start() {
    let mut redis = RedisServer::start();
    redis.kill();
    let (root, _, mut server) = deploy(&redis.url(), &[("STORE_CHECK_MS", "100")]);
    let (status, body) = server.wait_health(|_, b| b.contains("store redis")).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("ON_FAILURE=fallback"), "{body}");
    let mut grpc = server.grpc().await;
    let a = [("api_key", "a")];
    for _ in 0..3 {
        let start = Instant::now();
        assert_eq!(ask(&mut grpc, "edge", &a).await.0, "OK");
        // Decided by the fallback, not after a long store timeout (100 ms by default; the
        // circuit breaker skips the store once open).
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }

    let mut closed = ServerProcess::start(&deployed(
        &redis.url(),
        root.path(),
        &[("STORE_CHECK_MS", "100"), ("ON_FAILURE", "closed")],
    ));
    let (status, body) = closed.wait_health(|_, b| b.contains("store redis")).await;
    assert_eq!(status, 503, "{body}");
    // Its gRPC calls fail with UNAVAILABLE, for Envoy's failure_mode_deny to decide.
    let mut c = closed.grpc().await;
    let err = c
        .should_rate_limit(support::request("edge", &a))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);

    // Redis comes up: healthy without a word about the store, counting in Redis.
    redis.restart();
    let body = server
        .wait_health(|s, b| s == 200 && !b.contains("store"))
        .await
        .1;
    assert!(body.starts_with("OK"), "{body}");
    wait_for(
        "a call counted in Redis",
        Duration::from_secs(10),
        async || {
            let _ = ask(&mut grpc, "edge", &a).await;
            redis.cmd(&["DBSIZE"]).trim() != ":0"
        },
    )
    .await;
    closed.wait_health(|s, _| s == 200).await;
}

/// Rules that do not load at start: the server runs, unready, and says why; a fixed file makes
/// it ready without a restart. A wrong variable stops it with a message naming it.
#[tokio::test]
async fn bad_rules_at_start_and_bad_settings() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, "domain: edge\ndescriptors: [").unwrap();
    let mut server = ServerProcess::start(&[
        ("RULES_FILE", file.display().to_string()),
        ("RULES_RELOAD_MS", "100".into()),
    ]);
    let (status, body) = server
        .wait_health(|_, b| b.contains("rules not loaded"))
        .await;
    assert_eq!(status, 503, "{body}");
    std::fs::write(&file, RULES_V1).unwrap();
    server.ready().await;

    let mut bad = ServerProcess::start(&[
        ("RULES_FILE", file.display().to_string()),
        ("BACKEND", "memcached".into()),
    ]);
    let exit = bad.wait_exit(Duration::from_secs(10)).await.expect("exits");
    assert_eq!(exit.code(), Some(2));
    assert!(
        bad.log().contains("BACKEND: \"memcached\""),
        "{}",
        bad.log()
    );

    // The version a deployment pins (envoyproxy/ratelimit #128).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate-server"))
        .arg("--version")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("tollgate-server {}\n", env!("CARGO_PKG_VERSION"))
    );
}

/// gRPC over TLS, and mutual TLS: a client with a certificate from the configured CA is
/// served; one without is refused.
#[tokio::test]
async fn grpc_tls_and_mtls() {
    use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let tls = support::TlsFiles::new();
    let file = |name: &str| tls.dir.path().join(name).display().to_string();
    let rules = tls.dir.path().join("rules.yaml");
    std::fs::write(&rules, RULES_V1).unwrap();
    let rules = rules.display().to_string();
    let mut server = ServerProcess::start(&[
        ("RULES_FILE", rules),
        ("GRPC_SERVER_USE_TLS", "true".into()),
        ("GRPC_SERVER_TLS_CERT", file("server.crt")),
        ("GRPC_SERVER_TLS_KEY", file("server.key")),
        ("GRPC_CLIENT_TLS_CACERT", file("ca.crt")),
    ]);
    server.ready().await;
    let tls_files = &tls;
    let endpoint = |identity: bool| {
        let mut tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&tls_files.ca_pem))
            .domain_name("localhost");
        if identity {
            tls = tls.identity(tonic::transport::Identity::from_pem(
                &tls_files.client_cert_pem,
                &tls_files.client_key_pem,
            ));
        }
        tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{}", server.grpc_port))
            .unwrap()
            .tls_config(tls)
            .unwrap()
    };
    let channel = endpoint(true).connect().await.unwrap();
    let mut client = RateLimitServiceClient::new(channel);
    assert_eq!(
        ask(&mut client, "edge", &[("api_key", "a")]).await,
        ("OK".into(), 4)
    );
    // Without a client certificate: no connection, or the call fails.
    let refused = match endpoint(false).connect().await {
        Err(_) => true,
        Ok(channel) => RateLimitServiceClient::new(channel)
            .should_rate_limit(support::request("edge", &[("api_key", "a")]))
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");
}

/// envoyproxy/ratelimit's TLS variables reach Redis: `REDIS_URL` as `host:port`, `REDIS_TLS`,
/// `REDIS_TLS_CACERT`. Two servers over one Redis with TLS share one count (a server that
/// could not reach it would decide alone, with a fresh bucket).
#[tokio::test]
async fn redis_over_tls_from_envoyproxy_variables() {
    let tls = support::TlsFiles::new();
    let redis = RedisServer::start_tls(&tls, false);
    let rules = tls.dir.path().join("rules.yaml");
    std::fs::write(&rules, RULES_V1).unwrap();
    let env = [
        ("RULES_FILE", rules.display().to_string()),
        ("BACKEND", "redis".to_owned()),
        (
            "REDIS_URL",
            redis.tls_url().trim_start_matches("rediss://").to_owned(),
        ),
        ("REDIS_TLS", "true".to_owned()),
        (
            "REDIS_TLS_CACERT",
            tls.dir.path().join("ca.crt").display().to_string(),
        ),
        // Fail closed: a Redis not reached is an error here, not a fallback's answer.
        ("ON_FAILURE", "closed".to_owned()),
    ];
    let mut a = ServerProcess::start(&env);
    let mut b = ServerProcess::start(&env);
    a.ready().await;
    b.ready().await;
    let (mut ga, mut gb) = (a.grpc().await, b.grpc().await);
    let key = [("api_key", "tls")];
    assert_eq!(ask(&mut ga, "edge", &key).await, ("OK".into(), 4));
    assert_eq!(ask(&mut ga, "edge", &key).await, ("OK".into(), 3));
    assert_eq!(ask(&mut gb, "edge", &key).await, ("OK".into(), 2));
}

/// `BACKEND=postgres` with the database down at start: ready (the fallback decides), and once
/// PostgreSQL answers, the table is created in the background and calls are counted there (two
/// servers share one count).
#[tokio::test]
async fn postgres_down_at_start_then_its_table_is_made() {
    let mut pg = support::sql::PgServer::start();
    pg.kill();
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, RULES_V1).unwrap();
    let env = [
        ("RULES_FILE", rules.display().to_string()),
        ("BACKEND", "postgres".to_owned()),
        ("DATABASE_URL", pg.url()),
        ("STORE_CHECK_MS", "100".to_owned()),
    ];
    let mut a = ServerProcess::start(&env);
    let (status, body) = a.wait_health(|_, b| b.contains("store postgres")).await;
    assert_eq!(status, 200, "{body}");
    pg.restart();
    a.wait_health(|s, b| s == 200 && !b.contains("store")).await;
    let mut b = ServerProcess::start(&env);
    b.wait_health(|s, b| s == 200 && !b.contains("store")).await;
    let (mut ga, mut gb) = (a.grpc().await, b.grpc().await);
    let key = [("api_key", "pg")];
    assert_eq!(ask(&mut ga, "edge", &key).await, ("OK".into(), 4));
    assert_eq!(ask(&mut gb, "edge", &key).await, ("OK".into(), 3));
}
