//! Configuring a [`MysqlBackend`].

use std::fmt;
use std::time::Duration;

use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints};

use super::MysqlBackend;
use super::dialect::{Mysql, Names};
use crate::ConfigError;
use crate::backend::remote::Options;
use crate::backend::sql::{self, Config, FromUrl};

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
    sql: Config<Pool>,
    opts: Options,
}

impl MysqlBackend {
    /// Starts configuring a backend; see [`MysqlBackendBuilder`] for the defaults.
    pub fn builder() -> MysqlBackendBuilder {
        MysqlBackendBuilder {
            sql: Config::default(),
            opts: Options::default(),
        }
    }
}

sql::builder_methods! { MysqlBackendBuilder, MysqlBackend, Pool, "procedure", "MySQL";
    /// The database, as a URL (`mysql://user:password@host:3306/db`, with mysql_async's query
    /// parameters if you like, e.g. `?socket=/run/mysqld/mysqld.sock`), without TLS. The
    /// password is never shown: errors, logs, `Debug` and [`MysqlBackend::endpoint`] mask it.
    ///
    /// The pool's size is [`pool_size`](Self::pool_size)'s (the URL's `pool_min` and
    /// `pool_max` are replaced), connections are not reset when they return to the pool (the
    /// backend leaves no session state behind), and their `innodb_lock_wait_timeout` is the
    /// [timeout](Self::timeout) rounded up to whole seconds, so that the server stops waiting
    /// for a row lock soon after the backend gave up.
    url;
    /// A pool you made (for TLS, or to share it with your application). Its options apply;
    /// its connections must be in autocommit mode (the default). mysql_async does not tell a
    /// pool's size: set [`pool_size`](Self::pool_size) to its most connections, so that
    /// batches are sent on up to half of them. [`timeout`](Self::timeout) still bounds every
    /// decision.
    pool;
    /// The database (MySQL's schema) holding the table (default: none, the connection's
    /// database, as in the URL's path). A plain identifier, quoted when used.
    schema;
    /// Connections in the pool made from [`url`](Self::url), or in the [`pool`](Self::pool)
    /// given (default 8, at least 2). Batches are sent on up to half of them at once (so that
    /// the probe, the sweep and a reset find a connection); each call holds its connection
    /// for one round trip (more after a conflict: see the module docs).
    pool_size;
}

impl MysqlBackendBuilder {
    /// Checks the options and builds the backend. Nothing is connected yet, so this neither
    /// blocks nor fails when the database is down; call [`MysqlBackend::migrate`] once at
    /// start (or run the SQL of [`MysqlBackend::migration_sql`] yourself).
    pub fn build(self) -> Result<MysqlBackend, ConfigError> {
        let (size, timeout) = (self.sql.pool_size, self.opts.timeout);
        let remote = self
            .sql
            .build::<Mysql>(self.opts, Names::new, |url, _| pool(url, size, timeout))?;
        Ok(MysqlBackend { remote })
    }
}

/// A pool of `size` connections to `url`, and where it points.
fn pool(url: &str, size: usize, timeout: Duration) -> FromUrl<Pool> {
    let opts = Opts::from_url(url).map_err(|e| e.to_string())?;
    let endpoint = describe(&opts);
    let constraints = PoolConstraints::new(size, size).ok_or("bad pool size")?;
    let pool_opts = opts
        .pool_opts()
        .clone()
        .with_constraints(constraints)
        .with_reset_connection(false);
    // A call waiting for a row lock longer than the timeout is given up by the backend: the
    // server stops waiting soon after (whole seconds, at least 1).
    let wait = (timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0)).max(1);
    let mut init = opts.init().to_vec();
    init.push(format!("SET SESSION innodb_lock_wait_timeout = {wait}"));
    let opts = OptsBuilder::from_opts(opts).pool_opts(pool_opts).init(init);
    Ok((Pool::new(opts), endpoint))
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
        let mut d = f.debug_struct("MysqlBackendBuilder");
        self.sql.fields(&mut d);
        d.field("opts", &self.opts).finish()
    }
}
