//! The PostgreSQL backend (feature `postgres`): one limit shared by every instance of an
//! application, kept in a PostgreSQL table, for teams that run PostgreSQL (or YugabyteDB,
//! which speaks its protocol) and no Redis.
//!
//! ```no_run
//! use std::num::NonZeroU32;
//! use tollgate::backend::{Backend, postgres::PostgresBackend};
//! use tollgate::{Key, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = PostgresBackend::builder()
//!     .url("postgres://postgres@127.0.0.1:5432/test")
//!     .build()?;
//! backend.migrate().await?; // idempotent: creates the table and the function if missing
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
//! use tollgate::backend::postgres::PostgresBackend;
//! use tollgate::backend::remote::FailurePolicy;
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let backend = PostgresBackend::builder()
//!     .url("postgres://app:secret@127.0.0.1:1/app") // a port where nothing listens
//!     .table("rate_limits")
//!     .timeout(Duration::from_millis(50))
//!     .on_failure(FailurePolicy::FailClosed)
//!     .build()?;
//! assert_eq!(backend.endpoint(), "postgres://app@127.0.0.1:1/app"); // no password
//! assert!(backend.migration_sql().contains(r#"CREATE TABLE IF NOT EXISTS "rate_limits""#));
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! - **One round trip, atomic.** A decision (or a batch of concurrent ones) is one call of the
//!   function `<table>_decide_2`, one statement and so one transaction: every quota of the
//!   policy, all-or-nothing, whatever its [algorithm](crate::quota::Algorithm), with the same
//!   arithmetic as the local and Redis backends (one conformance suite runs against all three).
//! - **Exact under concurrency,** without `SERIALIZABLE`. The function first locks every row
//!   of the call, in ascending key order, with one upsert (`INSERT … ON CONFLICT DO UPDATE …
//!   WHERE false` locks each existing row; a row it inserts is its own until commit), then
//!   reads the clock and the rows in a new statement (under `READ COMMITTED` each statement of
//!   a volatile function sees everything committed before it, so the last write of every
//!   locked row), decides, and writes. Calls on one key are serialized by its row lock, each
//!   deciding from the state the previous one left, and calls lock in one order, so they never
//!   deadlock on each other. Under `REPEATABLE READ` or `SERIALIZABLE` sessions (or
//!   YugabyteDB's snapshot isolation) it stays exact, but a call that waited for another fails
//!   with a serialization error; serialization failures (`40001`) and deadlocks (`40P01`, e.g.
//!   with your own transactions on the table) are rolled back whole, so they are sent again up
//!   to 3 times after a random pause of a few milliseconds, within the timeout, then get the
//!   failure policy.
//! - **The database's clock.** Time is `clock_timestamp()` read after the locks are granted, in
//!   integer microseconds (GCRA keeps nanoseconds: `now_us × 1000`), never the instances'.
//! - **Nothing grows without bound.** A row is worth keeping until its bucket is full again
//!   (its column `expires_us`); a background task deletes rows past it every 10 seconds, in
//!   batches of 1 000 that skip locked rows (see [`sweep`](PostgresBackendBuilder::sweep)).
//!
//! # Schema
//!
//! [`PostgresBackend::migrate`] runs this, with the table's and function's names
//! ([`PostgresBackend::migration_sql`] gives it for your own migrations): one table,
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS tollgate_buckets (
//!     k bytea PRIMARY KEY CHECK (octet_length(k) <= 512), -- bucket key
//!     a bigint NOT NULL DEFAULT 0,   -- GCRA: TAT (ns since the epoch); windows: window index
//!     n bigint NOT NULL DEFAULT 0,   -- fixed window: count
//!     c bigint[],                    -- sliding window: the sub-windows' counts
//!     expires_us bigint NOT NULL DEFAULT 0 -- when the row equals a fresh bucket
//! );
//! ```
//!
//! and the PL/pgSQL function `tollgate_buckets_decide_2(keys bytea[], quotas bigint[], decisions
//! bigint[], now_ns bigint) RETURNS bigint[]`. Keys are the Redis backend's
//! (`<prefix>:{<policy>:<client key>}:<quota>`), or `<prefix>:#` and their SHA-256 when longer
//! than 512 bytes. The sweep is
//!
//! ```sql
//! DELETE FROM tollgate_buckets WHERE k IN (
//!     SELECT k FROM tollgate_buckets
//!     WHERE expires_us < (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
//!     LIMIT 1000 FOR UPDATE SKIP LOCKED)
//! ```
//!
//! There is no index but the primary key (so that updates are HOT): each sweep reads the table
//! until it has found a batch of expired rows. [`unlogged`](PostgresBackendBuilder::unlogged)
//! creates the table `UNLOGGED`, cheaper to write, emptied by a crash.
//!
//! # When the database fails
//!
//! Exactly as for the Redis backend (feature `redis`), through the
//! same code ([`remote`](crate::backend::remote)): every decision is bounded by a
//! [timeout](PostgresBackendBuilder::timeout) (100 ms), failures get the
//! [`FailurePolicy`](crate::backend::remote::FailurePolicy), a circuit breaker stops calling
//! a database that keeps failing and probes it with `SELECT 1`, a call that may have run is
//! never sent again (a timed-out call may still commit and take its units), and the log says
//! once when the database starts failing (with the cause: refused, authentication, ...) and
//! once when it answers again. Connections come from a pool (deadpool); one that broke is
//! replaced on the next call. Denials are cached locally as on Redis (exact; see
//! [the deny cache](crate::backend::remote#local-deny-cache)).
//!
//! No TLS: [`url`](PostgresBackendBuilder::url) connects in clear (a local or private
//! network, or a Unix socket). For TLS, build a deadpool-postgres pool with a TLS connector
//! and hand it over with [`pool`](PostgresBackendBuilder::pool).

mod builder;
mod dialect;

pub use builder::PostgresBackendBuilder;
/// The deadpool-postgres crate the backend's pools come from, for
/// [`pool`](PostgresBackendBuilder::pool).
pub use deadpool_postgres;
/// The tokio-postgres crate the backend speaks through.
pub use tokio_postgres;

crate::backend::sql::sql_backend! {
    /// A [`Backend`](crate::backend::Backend) keeping buckets in a PostgreSQL table: one limit
    /// shared by every instance of an application. Cheap to clone: clones share the pool,
    /// breaker and counters.
    ///
    /// See the [module docs](self) for guarantees, schema and failure modes.
    PostgresBackend,
    /// A policy prepared for the [`PostgresBackend`].
    PostgresPolicy,
    dialect::Postgres;
    /// Creates the table and the function if missing, and replaces the function by this
    /// version's: idempotent, safe to run from every instance at start (they take turns on an
    /// advisory lock).
    migrate;
    /// The SQL [`migrate`](Self::migrate) runs, for teams that run their own migrations.
    migration_sql;
    /// Calls sent again after the database rolled them back for a conflict (a serialization
    /// failure or a deadlock), since the backend was built.
    conflicts_retried;
    /// Where the backend connects, password left out: `postgres://user@host:5432/db`, or
    /// `pool` for a pool you handed over.
    endpoint;
}
