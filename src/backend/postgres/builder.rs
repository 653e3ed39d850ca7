//! Configuring a [`PostgresBackend`].

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};

use super::PostgresBackend;
use super::dialect::{Names, Postgres};
use crate::ConfigError;
use crate::backend::remote::Options;
use crate::backend::sql::{self, Config, FromUrl};

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
    sql: Config<Pool>,
    unlogged: bool,
    durable: bool,
    opts: Options,
}

impl PostgresBackend {
    /// Starts configuring a backend; see [`PostgresBackendBuilder`] for the defaults.
    pub fn builder() -> PostgresBackendBuilder {
        PostgresBackendBuilder {
            sql: Config::default(),
            unlogged: false,
            durable: false,
            opts: Options::default(),
        }
    }
}

sql::builder_methods! { PostgresBackendBuilder, PostgresBackend, Pool, "function", "PostgreSQL";
    /// The database, as a URL (`postgres://user:password@host:5432/db`) or a key-value string
    /// (`host=... user=... dbname=...`), without TLS. The password is never shown: errors,
    /// logs, `Debug` and [`PostgresBackend::endpoint`] mask it.
    url;
    /// A pool you made (for TLS, or to share it with your application). Its size and
    /// timeouts apply; [`timeout`](Self::timeout) still bounds every decision.
    pool;
    /// The table's schema (default: none, the connection's `search_path` decides). A plain
    /// identifier, quoted when used.
    schema;
    /// Connections in the pool made from [`url`](Self::url) (default 8, at least 2). Batches
    /// are sent on up to half of them at once (so that the probe, the sweep and a reset find a
    /// connection); each call holds its connection for one round trip.
    pool_size;
}

impl PostgresBackendBuilder {
    /// Whether [`migrate`](PostgresBackend::migrate) creates the table `UNLOGGED` (default
    /// `false`): no write-ahead log for the buckets, so decisions are cheaper, but a crash of
    /// the database empties the table (every bucket starts full again) and replicas do not
    /// have it. Has no effect on a table that already exists.
    pub fn unlogged(mut self, on: bool) -> Self {
        self.unlogged = on;
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
        let (unlogged, durable, size) = (self.unlogged, self.durable, self.sql.pool_size);
        let timeout = self.opts.timeout;
        let remote = self.sql.build::<Postgres>(
            self.opts,
            |schema, table| Names::new(schema, table, unlogged),
            |url, connect| pool(url, size, durable, timeout, connect),
        )?;
        Ok(PostgresBackend { remote })
    }
}

/// A pool of `size` connections to `url`, and where it points.
fn pool(
    url: &str,
    size: usize,
    durable: bool,
    timeout: Duration,
    connect_timeout: Duration,
) -> FromUrl<Pool> {
    let mut config = tokio_postgres::Config::from_str(url).map_err(|e| e.to_string())?;
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
    let mut pool = Pool::builder(manager).max_size(size);
    if !durable {
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
        .wait_timeout(Some(timeout))
        .create_timeout(Some(connect_timeout))
        .build()
        .map_err(|e| e.to_string())?;
    Ok((pool, endpoint))
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
        let mut d = f.debug_struct("PostgresBackendBuilder");
        self.sql.fields(&mut d);
        d.field("unlogged", &self.unlogged)
            .field("durable", &self.durable)
            .field("opts", &self.opts)
            .finish()
    }
}
