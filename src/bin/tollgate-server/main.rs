//! `tollgate-server`: Envoy's rate limit service (`envoy.service.ratelimit.v3`) as a server
//! a platform team deploys where envoyproxy/ratelimit runs today: its rules as they are, its
//! environment variables where they mean the same, every tollgate store.
//!
//! ```text
//! cargo install tollgate --features server
//! RULES_FILE=rules.yaml BACKEND=redis REDIS_URL=127.0.0.1:6379 tollgate-server
//! ```
//!
//! - gRPC on `GRPC_PORT` (8081): the rate limit service, the rate limit quota service (RLQS:
//!   `envoy.service.rate_limit_quota.v3`, on the same rules and store) and gRPC health
//!   (`grpc.health.v1`);
//! - HTTP on `PORT` (8080): `/healthcheck`, `/metrics` (Prometheus), `/json` (the rate limit
//!   service over HTTP) and `/rlconfig` (the rules as loaded).
//!
//! Every variable, the endpoints, the deployment files and how to move from
//! envoyproxy/ratelimit or limitador: `docs/server.md`. The library's
//! [`tollgate::rls::RlsService`] does the deciding; this binary is its shell:
//! configuration, rules reloaded from files, health, metrics, drain.

mod http;
mod rules;
mod settings;
mod store;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tollgate::backend::Backend;
use tollgate::rls::envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use tollgate::rls::quota::DemandBoard;
use tollgate::rls::{RlqsService, RlsService};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tonic_health::ServingStatus;

use crate::settings::Settings;

/// After the drain, how long calls in flight have to finish and clients to close their
/// connections before the process exits anyway.
const FINISH: Duration = Duration::from_secs(10);

/// What `--help` prints.
const HELP: &str = "\
tollgate-server: Envoy's rate limit service (envoy.service.ratelimit.v3), configured by
environment variables (envoyproxy/ratelimit's names where they mean the same).

  rules   RULES_FILE | RULES_DIR | RUNTIME_ROOT + RUNTIME_SUBDIRECTORY (+ RUNTIME_APPDIRECTORY)
  store   BACKEND=local|redis|redis_approx|postgres|mysql, REDIS_URL, REDIS_TYPE, REDIS_AUTH,
          REDIS_TLS, DATABASE_URL, ON_FAILURE=fallback|open|closed, STORE_TIMEOUT_MS
  ports   GRPC_PORT (8081: RLS, RLQS, gRPC health), PORT (8080: /healthcheck /metrics /json /rlconfig)
  more    LOG_LEVEL, LOG_FORMAT=json, USE_PROMETHEUS, GRPC_SERVER_USE_TLS, DRAIN_SECONDS, ...

Every variable: docs/server.md (https://github.com/tollgate-rs/tollgate/blob/main/docs/server.md).
";

fn main() -> std::process::ExitCode {
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("--version" | "-V") => {
            println!("tollgate-server {}", env!("CARGO_PKG_VERSION"));
            return std::process::ExitCode::SUCCESS;
        }
        Some("--help" | "-h") => {
            print!("{HELP}");
            return std::process::ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!(
                "tollgate-server: unknown argument {other:?}: it is configured by environment variables (--help)"
            );
            return std::process::ExitCode::from(2);
        }
    }
    let settings = match settings::read(|k| std::env::var(k).ok()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tollgate-server: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    init_logs(&settings.log);
    for (var, why) in settings::NOT_SUPPORTED {
        if std::env::var_os(var).is_some_and(|v| !v.is_empty()) {
            tracing::warn!(variable = var, "{var} is set but not used here: {why}");
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(start(settings)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("tollgate-server: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logs(log: &settings::LogSettings) {
    let filter = tracing_subscriber::EnvFilter::try_new(&log.filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if log.json {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn start(settings: Settings) -> Result<(), Box<dyn std::error::Error>> {
    let redis_tls = settings::redis_tls_files(|k| std::env::var(k).ok());
    let store_settings = settings.store.clone();
    let run = Start { settings };
    store::build(&store_settings, &redis_tls, run)?.await
}

/// Hands the store built to [`run`].
struct Start {
    settings: Settings,
}

impl store::Run for Start {
    fn run<B: Backend + Clone>(
        self,
        backend: B,
        setup: Option<store::Setup>,
        board: Option<DemandBoard>,
    ) -> store::RunResult {
        Box::pin(run(self.settings, backend, setup, board))
    }
}

/// The server on `backend`, until SIGTERM (or Ctrl-C) and the drain after it.
async fn run<B: Backend + Clone>(
    settings: Settings,
    backend: B,
    setup: Option<store::Setup>,
    board: Option<DemandBoard>,
) -> Result<(), Box<dyn std::error::Error>> {
    let prometheus = if settings.prometheus {
        let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .map_err(|e| format!("cannot install the Prometheus recorder: {e}"))?;
        let upkeep = handle.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                upkeep.run_upkeep();
            }
        });
        Some(handle)
    } else {
        None
    };

    let store_health =
        store::StoreHealth::new(settings.store.kind.name(), settings.store.on_failure);
    store::watch(
        backend.clone(),
        store_health.clone(),
        settings.store_check,
        setup,
    );

    // The service starts with no domain; the rules are swapped in as the watcher reads them.
    let service = RlsService::with_domains(backend, [])?
        .headers(settings.headers)
        .dynamic_metadata(settings.dynamic_metadata);
    let status = Arc::new(http::Status {
        rules: rules::SharedRules::default(),
        store: store_health,
        draining: Default::default(),
        prometheus,
    });
    watch_rules(&settings, &status.rules, &service);

    let grpc_listener = tokio::net::TcpListener::bind(settings.grpc)
        .await
        .map_err(|e| format!("GRPC_PORT: cannot listen on {}: {e}", settings.grpc))?;
    let http_listener = tokio::net::TcpListener::bind(settings.http)
        .await
        .map_err(|e| format!("PORT: cannot listen on {}: {e}", settings.http))?;

    let (reporter, health_service) = tonic_health::server::health_reporter();
    follow_health(reporter.clone(), status.clone()).await;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut finishing = stop_rx.clone();
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };

    // Envoy's rate limit quota service on the same rules, store and port.
    // Several servers on one Redis split each bucket between all their streams.
    let mut quota = service.quota_service();
    if let Some(board) = board {
        quota = quota.share_demand(board);
    }
    let mut grpc = tonic::transport::Server::builder();
    if let Some(tls) = &settings.tls {
        grpc = grpc.tls_config(tls_config(tls)?)?;
    }
    let grpc = grpc
        .add_service(health_service)
        .add_service(service.clone().into_server())
        .add_service(quota.clone().into_server())
        .serve_with_incoming_shutdown(
            // Nagle's algorithm off, as tonic's own `serve` sets it: an answer is sent when it
            // is written, not held back for the next (Envoy waits 20-50 ms at most).
            tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
            stopped(),
        );
    let app = http::router(status.clone(), service);
    let http_listener = axum::serve::ListenerExt::tap_io(http_listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let http = axum::serve(http_listener, app).with_graceful_shutdown(stopped());

    tracing::info!(
        grpc = %settings.grpc,
        http = %settings.http,
        tls = settings.tls.is_some(),
        store = settings.store.kind.name(),
        on_failure = settings.store.on_failure.as_str(),
        rules = %rules::source_name(&settings.rules),
        "tollgate-server {} listening",
        env!("CARGO_PKG_VERSION")
    );

    let drain = settings.drain;
    let draining = status.clone();
    let quota_streams = quota.clone();
    tokio::spawn(async move {
        signal().await;
        draining.draining.store(true, Ordering::Relaxed);
        metrics::gauge!("tollgate_server_draining").set(1.0);
        set_grpc_health(&reporter, false).await;
        tracing::info!(
            "stopping: unhealthy for {:.1} s (DRAIN_SECONDS) while load balancers stop sending, \
             then calls in flight are answered",
            drain.as_secs_f64()
        );
        tokio::select! {
            _ = tokio::time::sleep(drain) => {}
            _ = signal() => tracing::info!("second signal: stopping now"),
        }
        // The quota streams end (their Envoys open them again elsewhere), then the calls in
        // flight are answered.
        quota_streams.close();
        let _ = stop_tx.send(true);
    });

    let servers = async {
        let (g, h) = tokio::join!(grpc, http);
        g.map_err(|e| format!("gRPC server: {e}"))?;
        h.map_err(|e| format!("HTTP server: {e}"))
    };
    tokio::pin!(servers);
    // Until the stop: the servers run. After it, calls in flight get `FINISH` to be answered
    // and clients to hang up; a connection held open longer does not hold the exit.
    tokio::select! {
        done = &mut servers => done?,
        _ = async {
            let _ = finishing.wait_for(|stop| *stop).await;
            tokio::time::sleep(FINISH).await;
        } => tracing::warn!(
            "connections still open {} s after the drain: closing them",
            FINISH.as_secs()
        ),
    }
    tracing::info!("stopped");
    Ok(())
}

/// Reads the rules now, and again every `reload_every`, swapping changed rules in.
fn watch_rules<B: Backend>(
    settings: &Settings,
    state: &rules::SharedRules,
    service: &RlsService<B>,
) {
    let load = {
        let source = settings.rules.clone();
        let state = state.clone();
        let service = service.clone();
        move || {
            let outcome = rules::reload(&source, &state, |configs| {
                service.replace_all(configs).map_err(|e| e.to_string())
            });
            match outcome {
                None => {}
                Some(Ok(domains)) => {
                    metrics::counter!("tollgate_server_rules_reloads_total", "outcome" => "ok")
                        .increment(1);
                    metrics::gauge!("tollgate_server_rules_loaded").set(1.0);
                    tracing::info!(
                        ?domains,
                        "rules loaded from {}",
                        rules::source_name(&source)
                    );
                }
                Some(Err(e)) => {
                    metrics::counter!("tollgate_server_rules_reloads_total", "outcome" => "error")
                        .increment(1);
                    let loaded = state.lock().map(|s| s.loaded.is_some()).unwrap_or(false);
                    if loaded {
                        tracing::warn!("rules not reloaded, the old ones stay: {e}");
                    } else {
                        metrics::gauge!("tollgate_server_rules_loaded").set(0.0);
                        tracing::error!("no rules loaded (unhealthy until they are): {e}");
                    }
                }
            }
        }
    };
    load();
    let every = settings.reload_every;
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            // Reading files blocks: off the runtime's workers.
            let load = load.clone();
            let _ = tokio::task::spawn_blocking(load).await;
        }
    });
}

/// Keeps gRPC health (`grpc.health.v1`, overall and for the rate limit service) as
/// `/healthcheck` says.
async fn follow_health(reporter: tonic_health::server::HealthReporter, status: Arc<http::Status>) {
    let mut serving = status.health().0;
    set_grpc_health(&reporter, serving).await;
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if status.draining.load(Ordering::Relaxed) {
                return;
            }
            let (now, _) = status.health();
            metrics::gauge!("tollgate_server_store_up").set(
                if matches!(status.store.state(), store::StoreState::Down(_)) {
                    0.0
                } else {
                    1.0
                },
            );
            if now != serving {
                serving = now;
                set_grpc_health(&reporter, now).await;
            }
        }
    });
}

async fn set_grpc_health(reporter: &tonic_health::server::HealthReporter, serving: bool) {
    let s = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    reporter.set_service_status("", s).await;
    type Rls = RateLimitServiceServer<RlsService<tollgate::backend::LocalBackend>>;
    type Rlqs = RateLimitQuotaServiceServer<RlqsService<tollgate::backend::LocalBackend>>;
    reporter
        .set_service_status(<Rls as tonic::server::NamedService>::NAME, s)
        .await;
    reporter
        .set_service_status(<Rlqs as tonic::server::NamedService>::NAME, s)
        .await;
}

fn tls_config(
    tls: &settings::TlsSettings,
) -> Result<tonic::transport::ServerTlsConfig, Box<dyn std::error::Error>> {
    let read = |var: &str, p: &std::path::Path| {
        std::fs::read(p).map_err(|e| format!("{var} {}: {e}", p.display()))
    };
    let mut config =
        tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(
            read("GRPC_SERVER_TLS_CERT", &tls.cert)?,
            read("GRPC_SERVER_TLS_KEY", &tls.key)?,
        ));
    if let Some(ca) = &tls.client_ca {
        config = config.client_ca_root(tonic::transport::Certificate::from_pem(read(
            "GRPC_CLIENT_TLS_CACERT",
            ca,
        )?));
    }
    Ok(config)
}

/// SIGTERM (what Kubernetes and systemd send) or Ctrl-C.
async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
