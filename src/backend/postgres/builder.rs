//! Configuring a [`PostgresBackend`].

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};

use super::PostgresBackend;
use super::store::{Names, PgStore, pg_sweep};
use crate::ConfigError;
use crate::backend::remote::redact::{self, Secrets};
use crate::backend::remote::{Options, Remote, keys, options_methods};
use crate::backend::sql;

/// Configures a [`PostgresBackend`]: where the database is, the table, and how to behave when
/// it fails. Methods take and return the builder by value.
///
/// | option | default |
/// |---|---|
/// | connection | none: [`url`](Self::url) or [`pool`](Self::pool) |
/// | [`table`](Self::table), [`schema`](Self::schema) | `tollgate_buckets`, the connection's `search_path` |
/// | [`unlogged`](Self::unlogged) | `false` |
/// | [`durable`](Self::durable) | `false`: `synchronous_commit = off` on the backend's connections |
/// | [`prefix`](Self::prefix) | `tollgate` |
/// | [`pool_size`](Self::pool_size) | 8 connections, 4 calls in flight |
/// | [`sweep`](Self::sweep) | every 10 s, batches of 1 000 rows |
/// | [`timeout`](Self::timeout) | 100 ms |
/// | [`on_failure`](Self::on_failure) | [`FailOpen`](crate::backend::remote::FailurePolicy::FailOpen) |
/// | [`circuit_breaker`](Self::circuit_breaker) | open after 5 consecutive failed calls, probe every 500 ms |
/// | [`deny_cache_capacity`](Self::deny_cache_capacity) | 65 536 denials |
/// | [`batching`](Self::batching) | on |
#[must_use = "call `.build()` to get a backend"]
pub struct PostgresBackendBuilder {
    target: Option<Target>,
    schema: Option<String>,
    table: String,
    unlogged: bool,
    prefix: String,
    pool_size: usize,
    sweep_every: Option<Duration>,
    sweep_batch: u32,
    durable: bool,
    opts: Options,
}

enum Target {
    Url(String),
    Pool(Pool),
}

impl PostgresBackend {
    /// Starts configuring a backend; see [`PostgresBackendBuilder`] for the defaults.
    pub fn builder() -> PostgresBackendBuilder {
        PostgresBackendBuilder {
            target: None,
            schema: None,
            table: "tollgate_buckets".to_owned(),
            unlogged: false,
            prefix: "tollgate".to_owned(),
            pool_size: 8,
            sweep_every: Some(sql::SWEEP_EVERY),
            sweep_batch: sql::SWEEP_BATCH,
            durable: false,
            opts: Options::default(),
        }
    }
}

options_methods!(PostgresBackendBuilder, "PostgreSQL");

impl PostgresBackendBuilder {
    /// The database, as a URL (`postgres://user:password@host:5432/db`) or a key-value string
    /// (`host=... user=... dbname=...`), without TLS. The password is never shown: errors,
    /// logs, `Debug` and [`PostgresBackend::endpoint`] mask it.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.target = Some(Target::Url(url.into()));
        self
    }

    /// A pool you made (for TLS, or to share it with your application). Its size and
    /// timeouts apply; [`timeout`](Self::timeout) still bounds every decision.
    pub fn pool(mut self, pool: Pool) -> Self {
        self.target = Some(Target::Pool(pool));
        self
    }

    /// The table's schema (default: none, the connection's `search_path` decides). A plain
    /// identifier, quoted when used.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The table holding the buckets (default `tollgate_buckets`); the function deciding is
    /// named after it (`tollgate_buckets_decide`). A plain identifier of at most 48 bytes.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Whether [`migrate`](PostgresBackend::migrate) creates the table `UNLOGGED` (default
    /// `false`): no write-ahead log for the buckets, so decisions are cheaper, but a crash of
    /// the database empties the table (every bucket starts full again) and replicas do not
    /// have it. Has no effect on a table that already exists.
    pub fn unlogged(mut self, on: bool) -> Self {
        self.unlogged = on;
        self
    }

    /// The first part of every bucket's key (default `tollgate`), as for the Redis backend:
    /// backends with different prefixes share a table without sharing buckets.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Connections in the pool made from [`url`](Self::url) (default 8, at least 2). Batches
    /// are sent on up to half of them at once (so that the probe, the sweep and a reset find a
    /// connection); each call holds its connection for one round trip.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(2);
        self
    }

    /// How often the background sweep deletes the rows of idle buckets (those equal to a
    /// fresh bucket), in batches of `batch` rows (default every 10 s, 1 000 rows; at most 100
    /// batches per sweep). `None` turns it off (sweep yourself with
    /// [`PostgresBackend::sweep`], or with the SQL in the module docs).
    pub fn sweep(mut self, every: Option<Duration>, batch: u32) -> Self {
        self.sweep_every = every.map(|e| e.max(Duration::from_millis(10)));
        self.sweep_batch = batch.max(1);
        self
    }

    /// Whether the backend's own connections wait for each decision's write to reach disk
    /// (default `false`: they run with `synchronous_commit = off`). A rate limiter does not
    /// need it: with it off, a crash of the database can lose the last few hundred
    /// milliseconds of bucket updates (those buckets come back a little fuller), never
    /// corrupts anything, and each decision saves a write-ahead-log flush, which on a disk that
    /// really syncs is most of its cost. `true` keeps the server's setting. Applies to pools
    /// made from [`url`](Self::url) (set it on your own pool's connections otherwise).
    pub fn durable(mut self, on: bool) -> Self {
        self.durable = on;
        self
    }

    /// Checks the options and builds the backend. Nothing is connected yet, so this neither
    /// blocks nor fails when the database is down; call [`PostgresBackend::migrate`] once at
    /// start (or run the SQL of [`PostgresBackend::migration_sql`] yourself).
    pub fn build(self) -> Result<PostgresBackend, ConfigError> {
        keys::validate_prefix(&self.prefix)?;
        sql::identifier("table", &self.table)?;
        if let Some(schema) = &self.schema {
            sql::identifier("schema", schema)?;
        }
        let connect_timeout = self
            .opts
            .timeout
            .saturating_mul(5)
            .clamp(Duration::from_millis(250), Duration::from_secs(2));
        let (pool, endpoint, who, secrets, in_flight) = match self.target {
            None => {
                return Err(ConfigError::Invalid {
                    option: "connection",
                    reason: "no PostgreSQL configured: call `url(..)` or `pool(..)`".to_owned(),
                });
            }
            Some(Target::Url(url)) => {
                let secrets = Secrets::of([url.as_str()]);
                let mut config =
                    tokio_postgres::Config::from_str(&url).map_err(|e| ConfigError::Invalid {
                        option: "url",
                        reason: format!(
                            "{:?}: {}",
                            redact::url(&url),
                            secrets.scrub(&e.to_string())
                        ),
                    })?;
                config.connect_timeout(connect_timeout);
                if config.get_application_name().is_none() {
                    config.application_name("tollgate");
                }
                let endpoint = describe(&config);
                let manager = Manager::from_config(
                    config,
                    tokio_postgres::NoTls,
                    ManagerConfig {
                        recycling_method: RecyclingMethod::Fast,
                    },
                );
                let mut pool = Pool::builder(manager).max_size(self.pool_size);
                if !self.durable {
                    pool = pool.post_create(Hook::async_fn(|client, _| {
                        Box::pin(async move {
                            client
                                .batch_execute("SET synchronous_commit = off")
                                .await
                                .map_err(HookError::Backend)
                        })
                    }));
                }
                let pool = pool
                    .runtime(Runtime::Tokio1)
                    .wait_timeout(Some(self.opts.timeout))
                    .create_timeout(Some(connect_timeout))
                    .build()
                    .map_err(|e| ConfigError::Invalid {
                        option: "url",
                        reason: e.to_string(),
                    })?;
                let who = format!("PostgreSQL at {endpoint}");
                (pool, endpoint, who, secrets, self.pool_size / 2)
            }
            Some(Target::Pool(pool)) => {
                let size = pool.status().max_size;
                let in_flight = (size / 2).max(1);
                (
                    pool,
                    "pool".to_owned(),
                    "PostgreSQL (through the pool given)".to_owned(),
                    Secrets::default(),
                    in_flight,
                )
            }
        };
        let names = Names::new(self.schema.as_deref(), &self.table, self.unlogged);
        let sweeper = Arc::new(sql::Sweeper::new(
            self.sweep_every,
            self.sweep_batch,
            pg_sweep(pool.clone(), names.sweep.clone()),
        ));
        let store = PgStore {
            pool,
            endpoint,
            prefix: self.prefix,
            names,
            in_flight: in_flight.max(1),
            connect_timeout,
            sweeper,
            conflicts: Default::default(),
        };
        Ok(PostgresBackend {
            remote: Remote::new(store, who, secrets, self.opts),
        })
    }
}

/// Where a configuration points, without its password: `postgres://user@host:5432/db`.
fn describe(config: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .zip(config.get_ports().iter().chain(std::iter::repeat(&5432)))
        .map(|(host, port)| match host {
            tokio_postgres::config::Host::Tcp(h) => format!("{h}:{port}"),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    format!(
        "postgres://{}@{}/{}",
        config.get_user().unwrap_or(""),
        hosts.join(","),
        config.get_dbname().unwrap_or("")
    )
}

impl fmt::Debug for PostgresBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match &self.target {
            None => "none".to_owned(),
            Some(Target::Url(url)) => redact::url(url),
            Some(Target::Pool(_)) => "pool".to_owned(),
        };
        f.debug_struct("PostgresBackendBuilder")
            .field("target", &target)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("unlogged", &self.unlogged)
            .field("prefix", &self.prefix)
            .field("pool_size", &self.pool_size)
            .field("opts", &self.opts)
            .finish()
    }
}
