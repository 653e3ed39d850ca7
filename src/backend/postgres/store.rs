//! The PostgreSQL protocol of the backend: a pool of connections, the migration, one function
//! call per batch of decisions, and the sweep.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Pool, PoolError};
use tokio_postgres::error::SqlState;

use crate::backend::Decision;
use crate::backend::remote::{CallError, Job, Store, StoreFailure};
use crate::backend::sql::{self, Args, Prepared};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind, ConfigError, Key, Policy};

/// The migration template (`src/backend/sql/postgres.sql`).
const MIGRATION: &str = include_str!("../sql/postgres.sql");

/// The PostgreSQL side of the backend.
pub(crate) struct PgStore {
    pub(crate) pool: Pool,
    /// Where the database is, password masked.
    pub(crate) endpoint: String,
    pub(crate) prefix: String,
    pub(crate) names: Names,
    pub(crate) in_flight: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) sweeper: Arc<sql::Sweeper>,
    /// Calls sent again after a serialization failure or a deadlock.
    pub(crate) conflicts: std::sync::atomic::AtomicU64,
}

/// The quoted names of the table and the function, and the statements using them.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub(crate) table: String,
    pub(crate) function: String,
    pub(crate) unlogged: bool,
    decide: String,
    pub(crate) sweep: String,
    reset: String,
    announce: String,
}

impl Names {
    pub(crate) fn new(schema: Option<&str>, table: &str, unlogged: bool) -> Self {
        let qualify = |name: &str| match schema {
            Some(schema) => format!("\"{schema}\".\"{name}\""),
            None => format!("\"{name}\""),
        };
        let t = qualify(table);
        let f = qualify(&format!("{table}_decide"));
        Names {
            decide: format!("SELECT {f}($1::bytea[], $2::bigint[], $3::bigint[], $4::bigint)"),
            sweep: format!(
                "DELETE FROM {t} WHERE k IN (SELECT k FROM {t} WHERE expires_us < \
                 (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint) \
                 LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            reset: format!("DELETE FROM {t} WHERE k = ANY($1::bytea[])"),
            // The others alive, read in the statement's snapshot (without this instance's
            // row as written by it), plus this one.
            announce: format!(
                "WITH now AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint                  AS us), up AS (INSERT INTO {t} (k, expires_us) SELECT $1::bytea, us + $2::bigint                  FROM now ON CONFLICT (k) DO UPDATE SET expires_us = EXCLUDED.expires_us                  RETURNING 1) SELECT count(*) + 1 FROM {t}, now WHERE k > $3::bytea                  AND k < $4::bytea AND k <> $1::bytea AND expires_us > now.us"
            ),
            table: t,
            function: f,
            unlogged,
        }
    }

    /// The migration's SQL, for this table and function.
    pub(crate) fn migration(&self) -> String {
        MIGRATION
            .replace("{table}", &self.table)
            .replace("{decide}", &self.function)
            .replace("{unlogged}", if self.unlogged { "UNLOGGED " } else { "" })
    }
}

/// The kind of failure a PostgreSQL error is.
pub(crate) fn failure(err: &tokio_postgres::Error) -> StoreFailure {
    if let Some(code) = err.code() {
        return match *code {
            SqlState::INVALID_PASSWORD
            | SqlState::INVALID_AUTHORIZATION_SPECIFICATION
            | SqlState::INSUFFICIENT_PRIVILEGE => StoreFailure::Authentication,
            SqlState::CANNOT_CONNECT_NOW
            | SqlState::TOO_MANY_CONNECTIONS
            | SqlState::ADMIN_SHUTDOWN
            | SqlState::CRASH_SHUTDOWN => StoreFailure::Unavailable,
            _ => StoreFailure::ErrorReply,
        };
    }
    if err.is_closed() {
        return StoreFailure::Connection;
    }
    // Connection errors carry the I/O error as their source.
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound => {
                    StoreFailure::ConnectionRefused
                }
                std::io::ErrorKind::TimedOut => StoreFailure::Timeout,
                _ => StoreFailure::Connection,
            };
        }
        source = e.source();
    }
    let text = err.to_string();
    if text.contains("timeout") || text.contains("timed out") {
        StoreFailure::Timeout
    } else if text.contains("connect") {
        StoreFailure::Connection
    } else {
        StoreFailure::ErrorReply
    }
}

fn pg_error(err: tokio_postgres::Error) -> CallError {
    CallError::new(failure(&err), display(&err))
}

/// An error and its causes, in one line (tokio-postgres's `Display` alone says `db error`).
fn display(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    if let Some(db) = err
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(|e| e.as_db_error())
    {
        return format!("{}: {} ({})", db.severity(), db.message(), db.code().code());
    }
    let mut source = err.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

pub(crate) fn pool_error(err: PoolError) -> CallError {
    match err {
        PoolError::Backend(e) => pg_error(e),
        PoolError::Timeout(_) => CallError::new(
            StoreFailure::Timeout,
            "no connection to PostgreSQL within the timeout",
        ),
        PoolError::Closed => CallError::new(StoreFailure::Connection, "the pool is closed"),
        other => CallError::new(StoreFailure::Connection, display(&other)),
    }
}

/// Whether the database rolled the call back for a conflict with another transaction
/// (nothing was taken): sent again.
fn is_conflict(err: &tokio_postgres::Error) -> bool {
    matches!(
        err.code(),
        Some(&SqlState::T_R_SERIALIZATION_FAILURE | &SqlState::T_R_DEADLOCK_DETECTED)
    )
}

impl PgStore {
    /// Runs the migration in one transaction, under an advisory lock so that instances
    /// starting together do not race on `CREATE OR REPLACE FUNCTION`.
    pub(crate) async fn migrate(&self) -> Result<(), BackendError> {
        let mut client = self
            .pool
            .get()
            .await
            .map_err(|e| to_backend(pool_error(e)))?;
        let tx = client
            .transaction()
            .await
            .map_err(|e| to_backend(pg_error(e)))?;
        // Quiet: a second run's "already exists, skipping" notices are not news. Durable
        // whatever the connection's setting (`durable(false)`): a schema must not be lost.
        tx.batch_execute(
            "SET LOCAL client_min_messages = warning; \
             SET LOCAL synchronous_commit = on; \
             SELECT pg_advisory_xact_lock(7106514057406054501)",
        )
        .await
        .map_err(|e| to_backend(pg_error(e)))?;
        tx.batch_execute(&self.names.migration())
            .await
            .map_err(|e| to_backend(pg_error(e)))?;
        tx.commit().await.map_err(|e| to_backend(pg_error(e)))
    }

    /// Deletes the rows of `key` under `policy`'s quotas, but for slots in flight.
    pub(crate) async fn reset(&self, p: &Prepared, key: &Key) -> Result<u64, BackendError> {
        let keys = sql::reset_keys(p, key);
        let client = self
            .pool
            .get()
            .await
            .map_err(|e| to_backend(pool_error(e)))?;
        client
            .execute(&self.names.reset, &[&keys])
            .await
            .map_err(|e| to_backend(pg_error(e)))
    }
}

pub(crate) fn to_backend(err: CallError) -> BackendError {
    let kind = match err.failure {
        StoreFailure::Timeout => BackendErrorKind::Timeout,
        StoreFailure::ErrorReply => BackendErrorKind::Protocol,
        _ => BackendErrorKind::Unavailable,
    };
    BackendError::new(kind, err.text.to_string())
}

impl Store for PgStore {
    const KIND: &'static str = "postgres";
    const SETTLES: bool = true;
    type Prepared = Prepared;

    fn prepare(&self, policy: &Policy, params: &[QuotaParams]) -> Result<Prepared, ConfigError> {
        sql::Sweeper::start(&self.sweeper);
        Ok(Prepared::new(&self.prefix, policy, params))
    }

    async fn call(
        &self,
        jobs: &[Job<Self>],
        now_ns: Option<u64>,
    ) -> Result<Vec<Result<Decision, BackendError>>, CallError> {
        let args = Args::of(jobs);
        let now = now_ns.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        let client = self.pool.get().await.map_err(pool_error)?;
        let stmt = client
            .prepare_cached(&self.names.decide)
            .await
            .map_err(pg_error)?;
        let mut attempt = 0;
        let row = loop {
            match client
                .query_one(&stmt, &[&args.keys, &args.quotas, &args.decisions, &now])
                .await
            {
                Ok(row) => break row,
                // Rolled back whole: nothing was taken, so sending it again charges once.
                Err(err) if is_conflict(&err) && attempt < sql::RETRIES => {
                    attempt += 1;
                    self.conflicts
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(sql::jitter(attempt)).await;
                }
                Err(err) => return Err(pg_error(err)),
            }
        };
        let reply: Vec<i64> = row.try_get(0).map_err(pg_error)?;
        Ok(sql::decisions(&reply, jobs))
    }

    async fn ping(&self) -> Result<(), CallError> {
        let client = self.pool.get().await.map_err(pool_error)?;
        client.simple_query("SELECT 1").await.map_err(pg_error)?;
        Ok(())
    }

    async fn announce(&self, id: u64, ttl: Duration) -> Result<u32, CallError> {
        let (own, low, high) = sql::fleet_rows(&self.prefix, id);
        let ttl_us = i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX);
        let client = self.pool.get().await.map_err(pool_error)?;
        let row = (client
            .query_one(&self.names.announce, &[&own, &ttl_us, &low, &high])
            .await)
            .map_err(pg_error)?;
        let n: i64 = row.try_get(0).map_err(pg_error)?;
        Ok(sql::instances(n))
    }

    fn can_batch(&self) -> bool {
        true
    }

    /// Drops the idle connections of the pool (those in use go when they come back broken).
    fn reconnect(&self) {
        self.pool.retain(|_, _| false);
    }

    fn calls_in_flight(&self) -> usize {
        self.in_flight
    }

    fn warm_up_timeout(&self, timeout: Duration) -> Duration {
        self.connect_timeout.saturating_add(timeout)
    }
}

/// The sweep's batch on `pool`: `sql` deletes at most `$1` expired rows.
pub(crate) fn pg_sweep(pool: Pool, sql: String) -> sql::SweepBatch {
    let sql: Arc<str> = sql.into();
    Box::new(move |n| {
        let (pool, sql) = (pool.clone(), sql.clone());
        Box::pin(async move {
            let client = pool.get().await.map_err(|e| to_backend(pool_error(e)))?;
            client
                .execute(&*sql, &[&i64::from(n)])
                .await
                .map_err(|e| to_backend(pg_error(e)))
        })
    })
}
