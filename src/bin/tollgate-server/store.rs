//! The store the server decides on (`BACKEND`), built from the settings without connecting:
//! a store that is down at start is a store that fails, which the failure policy answers for
//! (no crash loop); connections are made, and SQL tables created, in the background as soon
//! as the store answers.

use std::sync::Arc;
use std::time::Duration;

use tollgate::backend::remote::FailurePolicy;
use tollgate::backend::{Backend, LocalBackend};
use tollgate::rls::quota::DemandBoard;
use tollgate::{Key, Policy, Quota};

use crate::settings::{OnFailure, RedisSettings, StoreKind, StoreSettings};

/// What one entry of the deny cache is counted as, to turn envoyproxy/ratelimit's
/// `LOCAL_CACHE_SIZE_IN_BYTES` into a number of entries (a key of up to 64 bytes, its expiry
/// and the map's own share, rounded up).
pub(crate) const DENY_CACHE_ENTRY_BYTES: usize = 128;

/// Whether the store answers, as the last check saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreState {
    /// Not checked yet.
    Unknown,
    Up,
    /// Why not.
    Down(String),
}

/// The store's health, checked in the background by asking it to forget a key of its own
/// (a real round trip on every store: a `DEL`, a `DELETE`), and what requests get meanwhile.
pub(crate) struct StoreHealth {
    pub(crate) name: &'static str,
    pub(crate) on_failure: OnFailure,
    state: std::sync::Mutex<StoreState>,
}

impl StoreHealth {
    pub(crate) fn new(name: &'static str, on_failure: OnFailure) -> Arc<Self> {
        Arc::new(StoreHealth {
            name,
            on_failure,
            state: std::sync::Mutex::new(StoreState::Unknown),
        })
    }

    pub(crate) fn state(&self) -> StoreState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records a check; logs a change.
    fn set(&self, now: StoreState) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if *s == now {
            return;
        }
        match &now {
            StoreState::Up => tracing::info!(store = self.name, "store answers"),
            StoreState::Down(why) => tracing::warn!(
                store = self.name,
                reason = %why,
                on_failure = self.on_failure.as_str(),
                "store does not answer; requests get the failure policy meanwhile"
            ),
            StoreState::Unknown => {}
        }
        *s = now;
    }

    /// Whether requests can be decided now: the store answers, or the failure policy decides
    /// without it (`fallback`, `open`). With `closed`, a store down means every call fails.
    pub(crate) fn usable(&self) -> bool {
        match self.state() {
            StoreState::Up | StoreState::Unknown => true,
            StoreState::Down(_) => self.on_failure != OnFailure::Closed,
        }
    }
}

/// Checks `backend` every `every`, for as long as the process runs; `first` runs once before
/// the first check (creating a SQL table where it is missing), again after each failed one
/// until it succeeds.
pub(crate) fn watch<B: Backend + Clone>(
    backend: B,
    health: Arc<StoreHealth>,
    every: Duration,
    first: Option<Setup>,
) {
    let policy = Policy::new("tollgate-server.health", Quota::per_second(1));
    let prepared = match policy.validate().and_then(|p| backend.prepare(&policy, &p)) {
        Ok(p) => p,
        Err(e) => {
            health.set(StoreState::Down(format!(
                "cannot prepare the health check: {e}"
            )));
            return;
        }
    };
    let key = Key::from_bytes(b"tollgate-server:health").unwrap_or_else(|_| Key::global());
    tokio::spawn(async move {
        let mut setup = first;
        loop {
            if let Some(s) = &setup {
                match tokio::time::timeout(every.max(Duration::from_secs(1)), s()).await {
                    Ok(Ok(())) => setup = None,
                    Ok(Err(e)) => health.set(StoreState::Down(e)),
                    Err(_) => health.set(StoreState::Down("setting up timed out".to_owned())),
                }
            }
            if setup.is_none() {
                let check = backend.reset(&prepared, &key);
                let state = match tokio::time::timeout(Duration::from_secs(2), check).await {
                    Ok(Ok(())) => StoreState::Up,
                    Ok(Err(e)) => StoreState::Down(e.to_string()),
                    Err(_) => StoreState::Down("no answer within 2 s".to_owned()),
                };
                health.set(state);
            }
            tokio::time::sleep(every).await;
        }
    });
}

/// A setup step run before the store is used (a SQL table created where missing).
pub(crate) type Setup = Box<
    dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync,
>;

fn failure_policy(on: OnFailure) -> FailurePolicy {
    match on {
        OnFailure::Fallback => FailurePolicy::FallbackLocal,
        OnFailure::Open => FailurePolicy::FailOpen,
        OnFailure::Closed => FailurePolicy::FailClosed,
    }
}

/// The backend `BACKEND` names, handed to `run` (generic over the backend's type).
pub(crate) trait Run {
    /// `board`: where several servers on one Redis share their quota streams' demand.
    fn run<B: Backend + Clone>(
        self,
        backend: B,
        setup: Option<Setup>,
        board: Option<DemandBoard>,
    ) -> RunResult;
}

/// What `run` returns.
pub(crate) type RunResult =
    std::pin::Pin<Box<dyn Future<Output = Result<(), Box<dyn std::error::Error>>>>>;

/// Builds the store of `settings` (nothing connects yet) and hands it to `run`.
pub(crate) fn build(
    settings: &StoreSettings,
    redis_tls: &crate::settings::RedisTlsFiles,
    run: impl Run,
) -> Result<RunResult, Box<dyn std::error::Error>> {
    let deny_cache = settings
        .deny_cache_bytes
        .map(|bytes| bytes / DENY_CACHE_ENTRY_BYTES);
    macro_rules! remote_options {
        ($builder:expr) => {{
            let mut b = $builder.on_failure(failure_policy(settings.on_failure));
            if let Some(t) = settings.timeout {
                b = b.timeout(t);
            }
            if let Some(n) = deny_cache {
                b = b.deny_cache_capacity(n);
            }
            b
        }};
    }
    let redis = |r: &RedisSettings| -> Result<_, Box<dyn std::error::Error>> {
        use tollgate::backend::redis::RedisBackend;
        let mut b = match r {
            RedisSettings::Single(url) => RedisBackend::builder().url(url.clone()),
            RedisSettings::Cluster(nodes) => RedisBackend::builder().cluster_nodes(nodes.clone()),
            RedisSettings::Sentinel { master, sentinels } => {
                RedisBackend::builder().sentinel(master.clone(), sentinels.clone())
            }
        };
        if let Some(ca) = &redis_tls.ca {
            b = b.tls_ca_pem(
                std::fs::read(ca).map_err(|e| format!("REDIS_TLS_CACERT {}: {e}", ca.display()))?,
            );
        }
        if let Some((cert, key)) = &redis_tls.client {
            let read = |var: &str, p: &std::path::Path| {
                std::fs::read(p).map_err(|e| format!("{var} {}: {e}", p.display()))
            };
            b = b.tls_client_cert(
                read("REDIS_TLS_CLIENT_CERT", cert)?,
                read("REDIS_TLS_CLIENT_KEY", key)?,
            );
        }
        if let Some(t) = settings.timeout {
            b = b.timeout(t);
        }
        Ok(b)
    };
    // A SQL store: its table created before the first check, and again until it is.
    macro_rules! sql {
        ($builder:expr) => {{
            let backend = remote_options!($builder).build()?;
            let b = backend.clone();
            let migrate = setup(move || {
                let b = b.clone();
                async move { b.migrate().await }
            });
            run.run(backend, Some(migrate), None)
        }};
    }
    Ok(match &settings.kind {
        StoreKind::Local => run.run(LocalBackend::new(), None, None),
        StoreKind::Redis(r) => {
            let backend = remote_options!(redis(r)?).build()?;
            let board = DemandBoard::redis(&backend);
            run.run(backend, None, Some(board))
        }
        StoreKind::RedisApprox(r, sync) => {
            use tollgate::backend::redis::Approximate;
            let mode = if *sync {
                Approximate::synchronous()
            } else {
                Approximate::asynchronous()
            };
            // The board on a connection of its own (the approximate mode's is its own).
            let board = DemandBoard::redis(&redis(r)?.build()?);
            run.run(redis(r)?.build_approximate(mode)?, None, Some(board))
        }
        StoreKind::Postgres(url) => {
            sql!(tollgate::backend::postgres::PostgresBackend::builder().url(url.clone()))
        }
        StoreKind::Mysql(url) => {
            sql!(tollgate::backend::mysql::MysqlBackend::builder().url(url.clone()))
        }
    })
}

/// A [`Setup`] from a function making the step's future.
fn setup<F, Fut>(make: F) -> Setup
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), tollgate::BackendError>> + Send + 'static,
{
    Box::new(move || {
        let step = make();
        Box::pin(async move { step.await.map_err(|e| e.to_string()) })
    })
}
