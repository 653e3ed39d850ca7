//! MySQL's side of the SQL store: its SQL, the procedure call deciding a batch, the migration
//! that replaces the procedure only when it changed, and how its errors read.

use std::fmt::Write as _;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Pool};

use crate::backend::remote::{CallError, StoreFailure};
use crate::backend::sql::{Args, Dialect, Failed, FleetRows, qualified};

/// The migration template (`src/backend/sql/mysql.sql`).
const MIGRATION: &str = include_str!("../sql/mysql.sql");

/// The line separating the template's statements.
const SEPARATOR: &str = "-- statement";

/// The named lock instances take turns on to migrate.
const MIGRATE_LOCK: &str = "tollgate_migrate";

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
        let (t, p) = qualified(schema, table, '`');
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
            procedure_name: format!("{table}_decide_2"),
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
fn spec(args: &Args) -> String {
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
fn failure(err: &mysql_async::Error) -> StoreFailure {
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

fn my_error(err: mysql_async::Error) -> CallError {
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

/// A failed statement; a deadlock or a lock wait timeout rolled it back whole (nothing was
/// taken): a conflict, sent again.
fn failed(err: mysql_async::Error) -> Failed {
    Failed {
        conflict: is_conflict(&err),
        error: my_error(err),
    }
}

/// MySQL and MariaDB, through mysql_async.
pub(crate) struct Mysql;

impl Dialect for Mysql {
    const KIND: &'static str = "mysql";
    const NAME: &'static str = "MySQL";
    /// A concurrent quota's leases are kept as text in the key's row (`c`, 11 100 bytes):
    /// room for this many, at their longest (`-9223372036854775808:<16 digits>,`).
    const MAX_SLOTS: u32 = 256;
    type Pool = Pool;
    type Conn = Conn;
    type Names = Names;

    /// mysql_async has no connect timeout of its own: a connection attempt to a host that
    /// drops packets would wait for the system's.
    async fn connect(pool: &Pool, connect_timeout: Duration) -> Result<Conn, CallError> {
        match tokio::time::timeout(connect_timeout, pool.get_conn()).await {
            Ok(conn) => conn.map_err(my_error),
            Err(_) => Err(CallError::new(
                StoreFailure::Timeout,
                "no connection to MySQL within the connect timeout",
            )),
        }
    }

    /// mysql_async does not tell a pool's size.
    fn pool_size(_pool: &Pool) -> Option<usize> {
        None
    }

    fn table(names: &Names) -> &str {
        &names.table
    }

    fn migration(names: &Names) -> String {
        names.migration()
    }

    /// Runs the migration's statements under a named lock (`GET_LOCK`), so that instances
    /// starting together do not race on `DROP PROCEDURE` / `CREATE PROCEDURE`.
    async fn migrate(conn: &mut Conn, names: &Names) -> Result<(), CallError> {
        let got: Option<Option<i64>> = conn
            .exec_first("SELECT GET_LOCK(?, 10)", (MIGRATE_LOCK,))
            .await
            .map_err(my_error)?;
        if got.flatten() != Some(1) {
            return Err(CallError::new(
                StoreFailure::Timeout,
                "another instance held the migration lock for 10 s",
            ));
        }
        let result = migrate_locked(conn, names).await;
        let released = conn
            .exec_drop("DO RELEASE_LOCK(?)", (MIGRATE_LOCK,))
            .await
            .map_err(my_error);
        result.and(released)
    }

    async fn decide(
        conn: &mut Conn,
        names: &Names,
        args: &Args,
        now_ns: Option<i64>,
    ) -> Result<Vec<i64>, Failed> {
        let spec = spec(args);
        match conn
            .exec_first::<String, _, _>(&names.decide, (&spec, now_ns))
            .await
        {
            Ok(Some(reply)) => Ok(integers(&reply)?),
            Ok(None) => Err(CallError::new(
                StoreFailure::ErrorReply,
                "the procedure answered no row",
            )
            .into()),
            Err(err) => Err(failed(err)),
        }
    }

    async fn ping(conn: &mut Conn) -> Result<(), CallError> {
        conn.query_drop("SELECT 1").await.map_err(my_error)
    }

    /// Two statements on one connection (autocommit): the count follows the announcement.
    async fn announce(
        conn: &mut Conn,
        names: &Names,
        rows: &FleetRows,
        ttl_us: i64,
    ) -> Result<i64, CallError> {
        (conn.exec_drop(&names.announce, (&rows.own, ttl_us)).await).map_err(my_error)?;
        let n: Option<i64> =
            (conn.exec_first(&names.count, (&rows.low, &rows.high)).await).map_err(my_error)?;
        Ok(n.unwrap_or(0))
    }

    async fn delete(conn: &mut Conn, names: &Names, keys: Vec<Vec<u8>>) -> Result<u64, CallError> {
        let mut deleted = 0;
        for k in keys {
            conn.exec_drop(&names.reset, (k,)).await.map_err(my_error)?;
            deleted += conn.affected_rows();
        }
        Ok(deleted)
    }

    /// A deadlock with a decision (rare: the sweep's scan locks rows in another order) is a
    /// conflict, sent again.
    async fn sweep(conn: &mut Conn, names: &Names, n: u32) -> Result<u64, Failed> {
        conn.exec_drop(&names.sweep, (n,)).await.map_err(failed)?;
        Ok(conn.affected_rows())
    }
}

/// The migration, under the lock. The procedure is replaced only when its body differs from
/// this version's: `DROP PROCEDURE` then `CREATE PROCEDURE` leaves a moment without it, when
/// calls from running instances would fail.
async fn migrate_locked(conn: &mut Conn, names: &Names) -> Result<(), CallError> {
    let statements = names.statements();
    let installed: Option<Option<String>> = conn
        .exec_first(
            "SELECT ROUTINE_DEFINITION FROM information_schema.ROUTINES \
             WHERE ROUTINE_SCHEMA = COALESCE(?, DATABASE()) AND ROUTINE_NAME = ? \
             AND ROUTINE_TYPE = 'PROCEDURE'",
            (names.schema.as_deref(), &names.procedure_name),
        )
        .await
        .map_err(my_error)?;
    let current = installed
        .flatten()
        .is_some_and(|body| statements.last().is_some_and(|s| same_body(s, &body)));
    for statement in &statements {
        if current && is_procedure(statement) {
            continue;
        }
        conn.query_drop(statement).await.map_err(my_error)?;
    }
    Ok(())
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
        assert!(statements[1].contains("DROP PROCEDURE IF EXISTS `db`.`buckets_decide_2`"));
        assert!(statements[2].contains("CREATE PROCEDURE `db`.`buckets_decide_2`"));
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
