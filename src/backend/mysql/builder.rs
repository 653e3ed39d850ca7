//! Configuring a [`MysqlBackend`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints};

use super::MysqlBackend;
use super::store::{MysqlStore, Names, my_sweep};
use crate::ConfigError;
use crate::backend::remote::redact::{self, Secrets};
use crate::backend::remote::{Options, Remote, keys, options_methods};
use crate::backend::sql;

/// Configures a [`MysqlBackend`]: where the database is, the table, and how to behave when it
/// fails. Methods take and return the builder by value.
///
/// | option | default |
/// |---|---|
/// | connection | none: [`url`](Self::url) or [`pool`](Self::pool) |
/// | [`table`](Self::table), [`schema`](Self::schema) | `tollgate_buckets`, the connection's database |
/// | [`prefix`](Self::prefix) | `tollgate` |
/// | [`pool_size`](Self::pool_size) | 8 connections, 4 calls in flight |
/// | [`sweep`](Self::sweep) | every 10 s, batches of 1 000 rows |
/// | [`timeout`](Self::timeout) | 100 ms |
/// | [`on_failure`](Self::on_failure) | [`FailOpen`](crate::backend::remote::FailurePolicy::FailOpen) |
/// | [`circuit_breaker`](Self::circuit_breaker) | open after 5 consecutive failed calls, probe every 500 ms |
/// | [`deny_cache_capacity`](Self::deny_cache_capacity) | 65 536 denials |
/// | [`batching`](Self::batching) | on |
#[must_use = "call `.build()` to get a backend"]
pub struct MysqlBackendBuilder {
    target: Option<Target>,
    schema: Option<String>,
    table: String,
    prefix: String,
    pool_size: usize,
    sweep_every: Option<Duration>,
    sweep_batch: u32,
    opts: Options,
}

enum Target {
    Url(String),
    Pool(Pool),
}

impl MysqlBackend {
    /// Starts configuring a backend; see [`MysqlBackendBuilder`] for the defaults.
    pub fn builder() -> MysqlBackendBuilder {
        MysqlBackendBuilder {
            target: None,
            schema: None,
            table: "tollgate_buckets".to_owned(),
            prefix: "tollgate".to_owned(),
            pool_size: 8,
            sweep_every: Some(sql::SWEEP_EVERY),
            sweep_batch: sql::SWEEP_BATCH,
            opts: Options::default(),
        }
    }
}

options_methods!(MysqlBackendBuilder, "MySQL");

impl MysqlBackendBuilder {
    /// The database, as a URL (`mysql://user:password@host:3306/db`, with mysql_async's query
    /// parameters if you like, e.g. `?socket=/run/mysqld/mysqld.sock`), without TLS. The
    /// password is never shown: errors, logs, `Debug` and [`MysqlBackend::endpoint`] mask it.
    ///
    /// The pool's size is [`pool_size`](Self::pool_size)'s (the URL's `pool_min` and
    /// `pool_max` are replaced), connections are not reset when they return to the pool (the
    /// backend leaves no session state behind), and their `innodb_lock_wait_timeout` is the
    /// [timeout](Self::timeout) rounded up to whole seconds, so that the server stops waiting
    /// for a row lock soon after the backend gave up.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.target = Some(Target::Url(url.into()));
        self
    }

    /// A pool you made (for TLS, or to share it with your application). Its options apply;
    /// its connections must be in autocommit mode (the default). mysql_async does not tell a
    /// pool's size: set [`pool_size`](Self::pool_size) to its most connections, so that
    /// batches are sent on up to half of them. [`timeout`](Self::timeout) still bounds every
    /// decision.
    pub fn pool(mut self, pool: Pool) -> Self {
        self.target = Some(Target::Pool(pool));
        self
    }

    /// The database (MySQL's schema) holding the table (default: none, the connection's
    /// database, as in the URL's path). A plain identifier, quoted when used.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The table holding the buckets (default `tollgate_buckets`); the procedure deciding is
    /// named after it (`tollgate_buckets_decide`). A plain identifier of at most 48 bytes.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The first part of every bucket's key (default `tollgate`), as for the Redis backend:
    /// backends with different prefixes share a table without sharing buckets.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Connections in the pool made from [`url`](Self::url), or in the [`pool`](Self::pool)
    /// given (default 8, at least 2). Batches
    /// are sent on up to half of them at once (so that the probe, the sweep and a reset find a
    /// connection); each call holds its connection for one round trip (more after a
    /// conflict: see the module docs).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(2);
        self
    }

    /// How often the background sweep deletes the rows of idle buckets (those equal to a
    /// fresh bucket), in batches of `batch` rows (default every 10 s, 1 000 rows; at most 100
    /// batches per sweep). `None` turns it off (sweep yourself with
    /// [`MysqlBackend::sweep`], or with the SQL in the module docs).
    pub fn sweep(mut self, every: Option<Duration>, batch: u32) -> Self {
        self.sweep_every = every.map(|e| e.max(Duration::from_millis(10)));
        self.sweep_batch = batch.max(1);
        self
    }

    /// Checks the options and builds the backend. Nothing is connected yet, so this neither
    /// blocks nor fails when the database is down; call [`MysqlBackend::migrate`] once at
    /// start (or run the SQL of [`MysqlBackend::migration_sql`] yourself).
    pub fn build(self) -> Result<MysqlBackend, ConfigError> {
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
                    reason: "no MySQL configured: call `url(..)` or `pool(..)`".to_owned(),
                });
            }
            Some(Target::Url(url)) => {
                let secrets = Secrets::of([url.as_str()]);
                let invalid = |reason: String| ConfigError::Invalid {
                    option: "url",
                    reason: format!("{:?}: {}", redact::url(&url), secrets.scrub(&reason)),
                };
                let opts = Opts::from_url(&url).map_err(|e| invalid(e.to_string()))?;
                let endpoint = describe(&opts);
                let constraints = PoolConstraints::new(self.pool_size, self.pool_size)
                    .ok_or_else(|| invalid("bad pool size".to_owned()))?;
                let pool_opts = opts
                    .pool_opts()
                    .clone()
                    .with_constraints(constraints)
                    .with_reset_connection(false);
                // A call waiting for a row lock longer than the timeout is given up by the
                // backend: the server stops waiting soon after (whole seconds, at least 1).
                let t = self.opts.timeout;
                let wait = (t.as_secs() + u64::from(t.subsec_nanos() > 0)).max(1);
                let mut init = opts.init().to_vec();
                init.push(format!("SET SESSION innodb_lock_wait_timeout = {wait}"));
                let opts = OptsBuilder::from_opts(opts).pool_opts(pool_opts).init(init);
                let pool = Pool::new(opts);
                let who = format!("MySQL at {endpoint}");
                (pool, endpoint, who, secrets, self.pool_size / 2)
            }
            Some(Target::Pool(pool)) => (
                pool,
                "pool".to_owned(),
                "MySQL (through the pool given)".to_owned(),
                Secrets::default(),
                self.pool_size / 2,
            ),
        };
        let names = Names::new(self.schema.as_deref(), &self.table);
        let sweeper = Arc::new(sql::Sweeper::new(
            self.sweep_every,
            self.sweep_batch,
            my_sweep(pool.clone(), names.sweep.clone(), connect_timeout),
        ));
        let store = MysqlStore {
            pool,
            endpoint,
            prefix: self.prefix,
            names,
            in_flight: in_flight.max(1),
            connect_timeout,
            sweeper,
            conflicts: Default::default(),
        };
        Ok(MysqlBackend {
            remote: Remote::new(store, who, secrets, self.opts),
        })
    }
}

/// Where options point, without the password: `mysql://user@host:3306/db`, or
/// `mysql://user@/path/to/socket/db` for a Unix socket.
fn describe(opts: &Opts) -> String {
    let at = match opts.socket() {
        Some(socket) => socket.to_owned(),
        None => format!("{}:{}", opts.ip_or_hostname(), opts.tcp_port()),
    };
    format!(
        "mysql://{}@{}/{}",
        opts.user().unwrap_or(""),
        at,
        opts.db_name().unwrap_or("")
    )
}

impl fmt::Debug for MysqlBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match &self.target {
            None => "none".to_owned(),
            Some(Target::Url(url)) => redact::url(url),
            Some(Target::Pool(..)) => "pool".to_owned(),
        };
        f.debug_struct("MysqlBackendBuilder")
            .field("target", &target)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("prefix", &self.prefix)
            .field("pool_size", &self.pool_size)
            .field("opts", &self.opts)
            .finish()
    }
}
