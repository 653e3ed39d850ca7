//! The MySQL backend (feature `mysql`): one limit shared by every instance of an application,
//! kept in a MySQL or MariaDB table, for teams that run MySQL (8.0.17 or later) or MariaDB
//! (10.6 or later) and no Redis.
//!
//! ```no_run
//! use std::num::NonZeroU32;
//! use tollgate::backend::{Backend, mysql::MysqlBackend};
//! use tollgate::{Key, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = MysqlBackend::builder()
//!     .url("mysql://root@127.0.0.1:3306/test")
//!     .build()?;
//! backend.migrate().await?; // idempotent: creates the table and the procedure if missing
//! let policy = Policy::new("api", Quota::per_second(5).burst(10));
//! let prepared = backend.prepare(&policy, &policy.validate()?)?;
//! let decision = backend.decide(&prepared, &Key::from_bytes("alice")?, NonZeroU32::MIN).await?;
//! assert_eq!(decision.quotas()[0].remaining, 9); // on a fresh bucket
//! # Ok(()) }
//! ```
//!
//! Building connects nothing, so an application starts even when the database is down:
//!
//! ```
//! use std::time::Duration;
//! use tollgate::backend::mysql::MysqlBackend;
//! use tollgate::backend::remote::FailurePolicy;
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let backend = MysqlBackend::builder()
//!     .url("mysql://app:secret@127.0.0.1:1/app") // a port where nothing listens
//!     .table("rate_limits")
//!     .timeout(Duration::from_millis(50))
//!     .on_failure(FailurePolicy::FailClosed)
//!     .build()?;
//! assert_eq!(backend.endpoint(), "mysql://app@127.0.0.1:1/app"); // no password
//! assert!(backend.migration_sql().contains("CREATE TABLE IF NOT EXISTS `rate_limits`"));
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! - **One round trip, atomic.** A decision (or a batch of concurrent ones) is one call of the
//!   stored procedure `<table>_decide_2`, which runs one transaction of its own: every quota of
//!   the policy, all-or-nothing, whatever its [algorithm](crate::quota::Algorithm), with the
//!   same arithmetic as the local and Redis backends (one conformance suite runs against all
//!   of them).
//! - **Exact under concurrency,** without `SERIALIZABLE`. The procedure runs its transaction
//!   under `READ COMMITTED` and first locks every row of the call, in ascending key order,
//!   with one upsert per key (`INSERT … ON DUPLICATE KEY UPDATE` takes an exclusive record
//!   lock on an existing row; a row it inserts is its own until commit), then reads the clock
//!   and the rows with locking reads (`SELECT … FOR UPDATE`: the last committed version, which
//!   only the lock's holder can write), decides, writes and commits. Calls on one key are
//!   serialized by its row lock, each deciding from the state the previous one left, and calls
//!   lock in one order, so they never deadlock on each other. A deadlock with another
//!   transaction (your own on the table, or the sweep) or a lock wait timeout (errors 1213 and
//!   1205) rolls the call back whole, so it is sent again up to 3 times after a random pause
//!   of a few milliseconds, within the timeout, then gets the failure policy.
//! - **The database's clock.** Time is `SYSDATE(6)` read in UTC after the locks are granted, in
//!   integer microseconds (GCRA keeps nanoseconds: `now_us × 1000`), never the instances'.
//! - **Nothing grows without bound.** A row is worth keeping until its bucket is full again
//!   (its column `expires_us`); a background task deletes rows past it every 10 seconds, in
//!   batches of 1 000 (see [`sweep`](MysqlBackendBuilder::sweep)).
//!
//! # Schema
//!
//! [`MysqlBackend::migrate`] runs this, with the table's and procedure's names
//! ([`MysqlBackend::migration_sql`] gives it for your own migrations: statements separated by
//! lines holding only `-- statement`, no `DELIMITER`): one table,
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS tollgate_buckets (
//!     k VARBINARY(512) NOT NULL,  -- bucket key
//!     a BIGINT NOT NULL DEFAULT 0, -- GCRA: TAT (ns since the epoch); windows: window index
//!     n BIGINT NOT NULL DEFAULT 0, -- fixed window: count; sliding: the counts' sum
//!     c VARCHAR(11100) CHARACTER SET ascii COLLATE ascii_bin NULL, -- sliding: the counts
//!     expires_us BIGINT NOT NULL DEFAULT 0, -- when the row equals a fresh bucket
//!     PRIMARY KEY (k)
//! ) ENGINE = InnoDB;
//! ```
//!
//! and the procedure `tollgate_buckets_decide_2(IN spec LONGTEXT, IN now_ns BIGINT)`, which
//! answers one row of one column, the decisions' integers. Keys are the Redis backend's
//! (`<prefix>:{<policy>:<client key>}:<quota>`), or `<prefix>:#` and their SHA-256 when longer
//! than 512 bytes. Instances migrating together take turns on the named lock
//! `GET_LOCK('tollgate_migrate')`. A migration replaces the procedure only when its body
//! differs from this version's, by `DROP` then `CREATE`: calls made in between fail (and get
//! the failure policy), so after an upgrade of tollgate, migrate before serving, or from one
//! place. The sweep is
//!
//! ```sql
//! DELETE FROM tollgate_buckets
//! WHERE expires_us < TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))
//! LIMIT 1000
//! ```
//!
//! There is no index but the primary key: each sweep reads the table until it has found a
//! batch of expired rows.
//!
//! # When the database fails
//!
//! Exactly as for the Redis backend (feature `redis`), through the
//! same code ([`remote`](crate::backend::remote)): every decision is bounded by a
//! [timeout](MysqlBackendBuilder::timeout) (100 ms), failures get the
//! [`FailurePolicy`](crate::backend::remote::FailurePolicy), a circuit breaker stops calling
//! a database that keeps failing and probes it with `SELECT 1`, a call that may have run is
//! never sent again (a timed-out call may still commit and take its units), and the log says
//! once when the database starts failing (with the cause: refused, authentication, ...) and
//! once when it answers again. Connections come from a mysql_async pool (a connection attempt
//! gives up after 5 times the timeout, between 250 ms and 2 s); one that broke is replaced on
//! the next call. Denials are cached locally as on Redis (exact; see
//! [the deny cache](crate::backend::remote#local-deny-cache)).
//!
//! No TLS: [`url`](MysqlBackendBuilder::url) connects in clear (a local or private network,
//! or a Unix socket). For TLS, build a mysql_async pool with TLS options (its `rustls-tls` or
//! `native-tls-tls` feature) and hand it over with [`pool`](MysqlBackendBuilder::pool).

mod builder;
mod dialect;

pub use builder::MysqlBackendBuilder;
/// The mysql_async crate the backend speaks through and its pools come from, for
/// [`pool`](MysqlBackendBuilder::pool).
pub use mysql_async;

crate::backend::sql::sql_backend! {
    /// A [`Backend`](crate::backend::Backend) keeping buckets in a MySQL or MariaDB table: one
    /// limit shared by every instance of an application. Cheap to clone: clones share the
    /// pool, breaker and counters.
    ///
    /// See the [module docs](self) for guarantees, schema and failure modes.
    MysqlBackend,
    /// A policy prepared for the [`MysqlBackend`].
    MysqlPolicy,
    dialect::Mysql;
    /// Creates the table if missing and replaces the procedure by this version's when it
    /// differs: idempotent, safe to run from every instance at start (they take turns on a
    /// named lock), and while other instances decide (when nothing changed, the procedure is
    /// left alone).
    migrate;
    /// The SQL [`migrate`](Self::migrate) runs, for teams that run their own migrations: its
    /// statements are separated by lines holding only `-- statement` (send each alone; the
    /// procedure's body holds semicolons).
    migration_sql;
    /// Calls sent again after the database rolled them back for a conflict (a deadlock or a
    /// lock wait timeout), since the backend was built.
    conflicts_retried;
    /// Where the backend connects, password left out: `mysql://user@host:3306/db`, or `pool`
    /// for a pool you handed over.
    endpoint;
}
