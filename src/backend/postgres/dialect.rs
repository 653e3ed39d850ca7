//! PostgreSQL's side of the SQL store: its SQL, the function call deciding a batch, and how
//! its errors read.

use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError};
use tokio_postgres::error::SqlState;

use crate::backend::remote::{CallError, StoreFailure};
use crate::backend::sql::{Args, Dialect, Failed, FleetRows, qualified};

/// The migration template (`src/backend/sql/postgres.sql`).
const MIGRATION: &str = include_str!("../sql/postgres.sql");

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
        let (t, f) = qualified(schema, table, '"');
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

fn pool_error(err: PoolError) -> CallError {
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

/// A failed statement; a serialization failure or a deadlock rolled it back whole (nothing
/// was taken): a conflict, sent again.
fn failed(err: tokio_postgres::Error) -> Failed {
    let conflict = matches!(
        err.code(),
        Some(&SqlState::T_R_SERIALIZATION_FAILURE | &SqlState::T_R_DEADLOCK_DETECTED)
    );
    Failed {
        error: pg_error(err),
        conflict,
    }
}

/// PostgreSQL, through deadpool-postgres and tokio-postgres.
pub(crate) struct Postgres;

impl Dialect for Postgres {
    const KIND: &'static str = "postgres";
    const NAME: &'static str = "PostgreSQL";
    type Pool = Pool;
    type Conn = Object;
    type Names = Names;

    /// The pool's own timeouts bound the wait (`wait_timeout`, `create_timeout`).
    async fn connect(pool: &Pool, _connect_timeout: Duration) -> Result<Object, CallError> {
        pool.get().await.map_err(pool_error)
    }

    fn pool_size(pool: &Pool) -> Option<usize> {
        Some(pool.status().max_size)
    }

    /// Drops the idle connections of the pool (those in use go when they come back broken).
    fn drop_idle(pool: &Pool) {
        pool.retain(|_, _| false);
    }

    fn table(names: &Names) -> &str {
        &names.table
    }

    fn migration(names: &Names) -> String {
        names.migration()
    }

    /// Runs the migration in one transaction, under an advisory lock so that instances
    /// starting together do not race on `CREATE OR REPLACE FUNCTION`.
    async fn migrate(conn: &mut Object, names: &Names) -> Result<(), CallError> {
        let tx = conn.transaction().await.map_err(pg_error)?;
        // Quiet: a second run's "already exists, skipping" notices are not news. Durable
        // whatever the connection's setting (`durable(false)`): a schema must not be lost.
        tx.batch_execute(
            "SET LOCAL client_min_messages = warning; \
             SET LOCAL synchronous_commit = on; \
             SELECT pg_advisory_xact_lock(7106514057406054501)",
        )
        .await
        .map_err(pg_error)?;
        tx.batch_execute(&names.migration())
            .await
            .map_err(pg_error)?;
        tx.commit().await.map_err(pg_error)
    }

    async fn decide(
        conn: &mut Object,
        names: &Names,
        args: &Args,
        now_ns: Option<i64>,
    ) -> Result<Vec<i64>, Failed> {
        let stmt = conn.prepare_cached(&names.decide).await.map_err(pg_error)?;
        let row = conn
            .query_one(&stmt, &[&args.keys, &args.quotas, &args.decisions, &now_ns])
            .await
            .map_err(failed)?;
        Ok(row.try_get(0).map_err(pg_error)?)
    }

    async fn ping(conn: &mut Object) -> Result<(), CallError> {
        conn.simple_query("SELECT 1").await.map_err(pg_error)?;
        Ok(())
    }

    async fn announce(
        conn: &mut Object,
        names: &Names,
        rows: &FleetRows,
        ttl_us: i64,
    ) -> Result<i64, CallError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&rows.own, &ttl_us, &rows.low, &rows.high];
        let row = (conn.query_one(&names.announce, &params).await).map_err(pg_error)?;
        row.try_get(0).map_err(pg_error)
    }

    async fn delete(
        conn: &mut Object,
        names: &Names,
        keys: Vec<Vec<u8>>,
    ) -> Result<u64, CallError> {
        conn.execute(&names.reset, &[&keys]).await.map_err(pg_error)
    }

    async fn sweep(conn: &mut Object, names: &Names, n: u32) -> Result<u64, Failed> {
        conn.execute(&names.sweep, &[&i64::from(n)])
            .await
            .map_err(failed)
    }
}
