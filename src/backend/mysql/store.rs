//! The MySQL protocol of the backend: a pool of connections, the migration, one procedure call
//! per batch of decisions, and the sweep.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Pool};

use crate::backend::Decision;
use crate::backend::remote::{CallError, Job, Store, StoreFailure};
use crate::backend::sql::{self, Args, Prepared};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind, ConfigError, Key, Policy};

/// The migration template (`src/backend/sql/mysql.sql`).
const MIGRATION: &str = include_str!("../sql/mysql.sql");

/// The line separating the template's statements.
const SEPARATOR: &str = "-- statement";

/// The named lock instances take turns on to migrate.
const MIGRATE_LOCK: &str = "tollgate_migrate";

/// The MySQL side of the backend.
pub(crate) struct MysqlStore {
    pub(crate) pool: Pool,
    /// Where the database is, password masked.
    pub(crate) endpoint: String,
    pub(crate) prefix: String,
    pub(crate) names: Names,
    pub(crate) in_flight: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) sweeper: Arc<sql::Sweeper>,
    /// Calls sent again after a deadlock or a lock wait timeout.
    pub(crate) conflicts: AtomicU64,
}

/// The quoted names of the table and the procedure, and the statements using them.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub(crate) table: String,
    pub(crate) procedure: String,
    schema: Option<String>,
    procedure_name: String,
    decide: String,
    pub(crate) sweep: String,
    reset: String,
    announce: String,
    count: String,
}

impl Names {
    pub(crate) fn new(schema: Option<&str>, table: &str) -> Self {
        let qualify = |name: &str| match schema {
            Some(schema) => format!("`{schema}`.`{name}`"),
            None => format!("`{name}`"),
        };
        let t = qualify(table);
        let p = qualify(&format!("{table}_decide"));
        Names {
            decide: format!("CALL {p}(?, ?)"),
            sweep: format!(
                "DELETE FROM {t} WHERE expires_us < \
                 TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) LIMIT ?"
            ),
            reset: format!("DELETE FROM {t} WHERE k = ?"),
            announce: format!(
                "INSERT INTO {t} (k, expires_us) VALUES (?, TIMESTAMPDIFF(MICROSECOND,                  '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) + ?)                  ON DUPLICATE KEY UPDATE expires_us = VALUES(expires_us)"
            ),
            count: format!(
                "SELECT COUNT(*) FROM {t} WHERE k > ? AND k < ? AND expires_us >                  TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
            ),
            table: t,
            procedure: p,
            schema: schema.map(str::to_owned),
            procedure_name: format!("{table}_decide"),
        }
    }

    /// The migration's SQL, for this table and procedure: statements separated by lines
    /// holding only `-- statement`.
    pub(crate) fn migration(&self) -> String {
        MIGRATION
            .replace("{table}", &self.table)
            .replace("{decide}", &self.procedure)
    }

    /// The migration's statements, one by one.
    fn statements(&self) -> Vec<String> {
        let sql = self.migration();
        let mut out = Vec::new();
        let mut current = String::new();
        for line in sql.lines() {
            if line.trim_end() == SEPARATOR {
                out.push(std::mem::take(&mut current));
            } else {
                current.push_str(line);
                current.push('\n');
            }
        }
        out.push(current);
        out.retain(|s| {
            s.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--"))
        });
        out
    }
}

/// The call's `spec` (see `mysql.sql`): every distinct key once, ascending, then each decision's
/// cost and quotas, keys in lowercase hexadecimal.
pub(crate) fn spec(args: &Args) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let hex = |out: &mut String, key: &[u8]| {
        for b in key {
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        }
    };
    let mut sorted: Vec<&[u8]> = args.keys.iter().map(Vec::as_slice).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let len: usize = args.keys.iter().map(|k| 2 * k.len() + 40).sum::<usize>() * 2;
    let mut out = String::with_capacity(len);
    for (i, key) in sorted.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        hex(&mut out, key);
    }
    let mut at = 0;
    for d in args.decisions.chunks_exact(4) {
        let (n, cost, max_wait, peek) = (usize::try_from(d[0]).unwrap_or(0), d[1], d[2], d[3]);
        let _ = write!(out, ";{cost},{max_wait},{peek}");
        for q in at..at + n {
            let p = &args.quotas[4 * q..4 * q + 4];
            let _ = write!(out, "|{},{},{},{},", p[0], p[1], p[2], p[3]);
            hex(&mut out, &args.keys[q]);
        }
        at += n;
    }
    out
}

/// Whether `body`, a procedure's body as the database keeps it (from `BEGIN` to the end of the
/// statement, with MariaDB the comments after `END` too), is the one `create` (a `CREATE
/// PROCEDURE` statement) makes, up to white space.
fn same_body(create: &str, body: &str) -> bool {
    let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let Some(begin) = create.find("\nBEGIN\n") else {
        return false;
    };
    let tail = &create[begin + 1..];
    let body = words(body);
    body == words(tail)
        || tail
            .rfind("\nEND\n")
            .is_some_and(|end| body == words(&tail[..end + 4]))
}

/// Whether a statement of the migration drops or creates the procedure.
fn is_procedure(statement: &str) -> bool {
    statement
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("--"))
        .is_some_and(|l| l.starts_with("DROP PROCEDURE") || l.starts_with("CREATE PROCEDURE"))
}

/// Reads the reply's comma-separated integers.
fn integers(reply: &str) -> Result<Vec<i64>, CallError> {
    reply
        .split(',')
        .map(|n| n.trim().parse::<i64>())
        .collect::<Result<_, _>>()
        .map_err(|_| {
            CallError::new(
                StoreFailure::ErrorReply,
                format!("the procedure's reply is not a list of integers: {reply:.80?}"),
            )
        })
}

/// The kind of failure a MySQL error is.
pub(crate) fn failure(err: &mysql_async::Error) -> StoreFailure {
    use mysql_async::{DriverError, Error, IoError};
    match err {
        Error::Server(e) => match e.code {
            // Access denied (user, database), command or routine denied.
            1044 | 1045 | 1142 | 1143 | 1370 | 1227 => StoreFailure::Authentication,
            // Too many connections, shutting down, server going away, killed.
            1040 | 1053 | 1077 | 1927 => StoreFailure::Unavailable,
            _ => StoreFailure::ErrorReply,
        },
        Error::Io(IoError::Io(io)) => match io.kind() {
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound => {
                StoreFailure::ConnectionRefused
            }
            std::io::ErrorKind::TimedOut => StoreFailure::Timeout,
            _ => StoreFailure::Connection,
        },
        #[allow(unreachable_patterns)]
        Error::Io(_) => StoreFailure::Connection,
        Error::Driver(
            DriverError::ConnectionClosed
            | DriverError::PoolDisconnected
            | DriverError::PacketOutOfOrder
            | DriverError::UnexpectedPacket { .. },
        ) => StoreFailure::Connection,
        Error::Driver(DriverError::UnknownAuthPlugin { .. })
        | Error::Driver(DriverError::CleartextPluginDisabled)
        | Error::Driver(DriverError::MysqlOldPasswordDisabled) => StoreFailure::Authentication,
        Error::Driver(_) | Error::Other(_) | Error::Url(_) => StoreFailure::ErrorReply,
    }
}

pub(crate) fn my_error(err: mysql_async::Error) -> CallError {
    CallError::new(failure(&err), display(&err))
}

/// An error and its causes, in one line.
fn display(err: &mysql_async::Error) -> String {
    match err {
        mysql_async::Error::Server(e) => {
            return format!("ERROR {} ({}): {}", e.code, e.state, e.message);
        }
        mysql_async::Error::Io(mysql_async::IoError::Io(e)) => return format!("I/O error: {e}"),
        _ => {}
    }
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    let mut last = text.clone();
    while let Some(e) = source {
        let s = e.to_string();
        if !last.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        last = s;
        source = e.source();
    }
    text
}

/// Whether the database rolled the call back for a conflict with another transaction (a
/// deadlock, 1213, or a lock wait timeout, 1205, both rolled back whole by the procedure:
/// nothing was taken): sent again.
fn is_conflict(err: &mysql_async::Error) -> bool {
    matches!(err, mysql_async::Error::Server(e) if e.code == 1213 || e.code == 1205)
}

pub(crate) fn to_backend(err: CallError) -> BackendError {
    let kind = match err.failure {
        StoreFailure::Timeout => BackendErrorKind::Timeout,
        StoreFailure::ErrorReply => BackendErrorKind::Protocol,
        _ => BackendErrorKind::Unavailable,
    };
    BackendError::new(kind, err.text.to_string())
}

/// A connection from `pool`, within `connect_timeout` (mysql_async has no connect timeout of
/// its own: a connection attempt to a host that drops packets would wait for the system's).
pub(crate) async fn connection(pool: &Pool, connect_timeout: Duration) -> Result<Conn, CallError> {
    match tokio::time::timeout(connect_timeout, pool.get_conn()).await {
        Ok(conn) => conn.map_err(my_error),
        Err(_) => Err(CallError::new(
            StoreFailure::Timeout,
            "no connection to MySQL within the connect timeout",
        )),
    }
}

impl MysqlStore {
    async fn conn(&self) -> Result<Conn, CallError> {
        connection(&self.pool, self.connect_timeout).await
    }

    /// Runs the migration's statements under a named lock (`GET_LOCK`), so that instances
    /// starting together do not race on `DROP PROCEDURE` / `CREATE PROCEDURE`.
    pub(crate) async fn migrate(&self) -> Result<(), BackendError> {
        let mut conn = self.conn().await.map_err(to_backend)?;
        let got: Option<Option<i64>> = conn
            .exec_first("SELECT GET_LOCK(?, 10)", (MIGRATE_LOCK,))
            .await
            .map_err(|e| to_backend(my_error(e)))?;
        if got.flatten() != Some(1) {
            return Err(BackendError::new(
                BackendErrorKind::Timeout,
                "another instance held the migration lock for 10 s",
            ));
        }
        let result = self.migrate_locked(&mut conn).await;
        let released = conn
            .exec_drop("DO RELEASE_LOCK(?)", (MIGRATE_LOCK,))
            .await
            .map_err(|e| to_backend(my_error(e)));
        result.and(released)
    }

    /// The migration, under the lock. The procedure is replaced only when its body differs
    /// from this version's: `DROP PROCEDURE` then `CREATE PROCEDURE` leaves a moment without
    /// it, when calls from running instances would fail.
    async fn migrate_locked(&self, conn: &mut Conn) -> Result<(), BackendError> {
        let statements = self.names.statements();
        let installed: Option<Option<String>> = conn
            .exec_first(
                "SELECT ROUTINE_DEFINITION FROM information_schema.ROUTINES \
                 WHERE ROUTINE_SCHEMA = COALESCE(?, DATABASE()) AND ROUTINE_NAME = ? \
                 AND ROUTINE_TYPE = 'PROCEDURE'",
                (self.names.schema.as_deref(), &self.names.procedure_name),
            )
            .await
            .map_err(|e| to_backend(my_error(e)))?;
        let current = installed
            .flatten()
            .is_some_and(|body| statements.last().is_some_and(|s| same_body(s, &body)));
        for statement in &statements {
            if current && is_procedure(statement) {
                continue;
            }
            conn.query_drop(statement)
                .await
                .map_err(|e| to_backend(my_error(e)))?;
        }
        Ok(())
    }

    /// Deletes the rows of `key` under `policy`'s quotas, but for slots in flight.
    pub(crate) async fn reset(&self, p: &Prepared, key: &Key) -> Result<u64, BackendError> {
        let keys = sql::reset_keys(p, key);
        let mut conn = self.conn().await.map_err(to_backend)?;
        let mut deleted = 0;
        for k in keys {
            conn.exec_drop(&self.names.reset, (k,))
                .await
                .map_err(|e| to_backend(my_error(e)))?;
            deleted += conn.affected_rows();
        }
        Ok(deleted)
    }
}

impl Store for MysqlStore {
    const KIND: &'static str = "mysql";
    const SETTLES: bool = true;
    type Prepared = Prepared;

    fn prepare(&self, policy: &Policy, params: &[QuotaParams]) -> Result<Prepared, ConfigError> {
        // A concurrent quota's leases are kept as text in the key's row (`c`, 11 100 bytes):
        // room for this many, at their longest (`-9223372036854775808:<16 digits>,`).
        const MAX_SLOTS: u32 = 256;
        if let Some(p) = params
            .iter()
            .find(|p| p.is_concurrent() && p.burst.get() > MAX_SLOTS)
        {
            return Err(ConfigError::Invalid {
                option: "Quota::concurrent",
                reason: format!(
                    "policy `{}`: {} slots; the MySQL store holds at most {MAX_SLOTS} per key",
                    policy.name(),
                    p.burst
                ),
            });
        }
        sql::Sweeper::start(&self.sweeper);
        Ok(Prepared::new(&self.prefix, policy, params))
    }

    async fn call(
        &self,
        jobs: &[Job<Self>],
        now_ns: Option<u64>,
    ) -> Result<Vec<Result<Decision, BackendError>>, CallError> {
        let spec = spec(&Args::of(jobs));
        let now = now_ns.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        let mut conn = self.conn().await?;
        let mut attempt = 0;
        let reply = loop {
            match conn
                .exec_first::<String, _, _>(&self.names.decide, (&spec, now))
                .await
            {
                Ok(Some(reply)) => break reply,
                Ok(None) => {
                    return Err(CallError::new(
                        StoreFailure::ErrorReply,
                        "the procedure answered no row",
                    ));
                }
                // Rolled back whole: nothing was taken, so sending it again charges once.
                Err(err) if is_conflict(&err) && attempt < sql::RETRIES => {
                    attempt += 1;
                    self.conflicts.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(sql::jitter(attempt)).await;
                }
                Err(err) => return Err(my_error(err)),
            }
        };
        Ok(sql::decisions(&integers(&reply)?, jobs))
    }

    async fn ping(&self) -> Result<(), CallError> {
        let mut conn = self.conn().await?;
        conn.query_drop("SELECT 1").await.map_err(my_error)
    }

    /// Two statements on one connection (autocommit): the count follows the announcement.
    async fn announce(&self, id: u64, ttl: Duration) -> Result<u32, CallError> {
        let (own, low, high) = sql::fleet_rows(&self.prefix, id);
        let ttl_us = i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX);
        let mut conn = self.conn().await?;
        (conn.exec_drop(&self.names.announce, (own, ttl_us)).await).map_err(my_error)?;
        let n: Option<i64> =
            (conn.exec_first(&self.names.count, (low, high)).await).map_err(my_error)?;
        Ok(sql::instances(n.unwrap_or(0)))
    }

    fn can_batch(&self) -> bool {
        true
    }

    fn calls_in_flight(&self) -> usize {
        self.in_flight
    }

    fn warm_up_timeout(&self, timeout: Duration) -> Duration {
        self.connect_timeout.saturating_add(timeout)
    }
}

/// The sweep's batch on `pool`: `sql` deletes at most `?` expired rows. A deadlock with a
/// decision (rare: the sweep's scan locks rows in another order) is retried.
pub(crate) fn my_sweep(pool: Pool, sql: String, connect_timeout: Duration) -> sql::SweepBatch {
    let sql: Arc<str> = sql.into();
    Box::new(move |n| {
        let (pool, sql) = (pool.clone(), sql.clone());
        Box::pin(async move {
            let mut conn = connection(&pool, connect_timeout)
                .await
                .map_err(to_backend)?;
            let mut attempt = 0;
            loop {
                match conn.exec_drop(&*sql, (n,)).await {
                    Ok(()) => return Ok(conn.affected_rows()),
                    Err(err) if is_conflict(&err) && attempt < sql::RETRIES => {
                        attempt += 1;
                        tokio::time::sleep(sql::jitter(attempt)).await;
                    }
                    Err(err) => return Err(to_backend(my_error(err))),
                }
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_lists_keys_once_ascending_then_decisions() {
        let args = Args {
            keys: vec![b"k1".to_vec(), b"k0".to_vec(), b"k1".to_vec()],
            quotas: vec![0, 200_000_000, 10, 0, 2, 1000, 5, 3, 0, 200_000_000, 10, 0],
            decisions: vec![2, 1, 0, 0, 1, 3, 5_000, 1],
        };
        assert_eq!(
            spec(&args),
            "6b30,6b31;1,0,0|0,200000000,10,0,6b31|2,1000,5,3,6b30;3,5000,1|0,200000000,10,0,6b31"
        );
    }

    #[test]
    fn migration_splits_into_statements() {
        let names = Names::new(Some("db"), "buckets");
        let statements = names.statements();
        assert_eq!(statements.len(), 3, "{statements:#?}");
        assert!(statements[0].contains("CREATE TABLE IF NOT EXISTS `db`.`buckets`"));
        assert!(statements[1].contains("DROP PROCEDURE IF EXISTS `db`.`buckets_decide`"));
        assert!(statements[2].contains("CREATE PROCEDURE `db`.`buckets_decide`"));
        assert!(!names.migration().contains('{'));
        let procedure: Vec<bool> = statements.iter().map(|s| is_procedure(s)).collect();
        assert_eq!(procedure, [false, true, true]);
        let body = &statements[2][statements[2].find("\nBEGIN\n").unwrap() + 1..];
        let body = &body[..body.rfind("\nEND\n").unwrap() + 4];
        assert!(same_body(
            &statements[2],
            &format!("  {}\n", body.replace('\n', "\r\n"))
        ));
        assert!(!same_body(
            &statements[2],
            &body.replace("COMMIT", "ROLLBACK")
        ));
    }

    #[test]
    fn errors_are_classified() {
        let server = |code| {
            mysql_async::Error::Server(mysql_async::ServerError {
                code,
                message: "m".to_owned(),
                state: "HY000".to_owned(),
            })
        };
        let io =
            |kind| mysql_async::Error::Io(mysql_async::IoError::Io(std::io::Error::from(kind)));
        assert_eq!(failure(&server(1045)), StoreFailure::Authentication);
        assert_eq!(failure(&server(1370)), StoreFailure::Authentication);
        assert_eq!(failure(&server(1040)), StoreFailure::Unavailable);
        assert_eq!(failure(&server(1053)), StoreFailure::Unavailable);
        assert_eq!(failure(&server(1305)), StoreFailure::ErrorReply);
        assert!(is_conflict(&server(1213)) && is_conflict(&server(1205)));
        assert!(!is_conflict(&server(1305)));
        use std::io::ErrorKind;
        assert_eq!(
            failure(&io(ErrorKind::ConnectionRefused)),
            StoreFailure::ConnectionRefused
        );
        assert_eq!(failure(&io(ErrorKind::TimedOut)), StoreFailure::Timeout);
        assert_eq!(
            failure(&io(ErrorKind::ConnectionReset)),
            StoreFailure::Connection
        );
        assert_eq!(
            display(&io(ErrorKind::ConnectionRefused)),
            "I/O error: connection refused"
        );
        assert_eq!(
            failure(&mysql_async::DriverError::ConnectionClosed.into()),
            StoreFailure::Connection
        );
    }

    #[test]
    fn replies_are_integers() {
        assert_eq!(integers("0,5,-1").unwrap(), vec![0, 5, -1]);
        assert!(integers("0,x").is_err());
        assert!(integers("").is_err());
    }
}
