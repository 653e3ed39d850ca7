//! One store for both SQL databases: what differs between them (the driver, the SQL text,
//! how a reply and an error read) is a [`Dialect`]; the rest (the pool, retries after a
//! conflict, the sweep, the fleet's rows, reset) is [`SqlStore`]'s, written once.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::sweep::{SweepBatch, Sweeper};
use super::{Args, Prepared};
use crate::backend::Decision;
use crate::backend::remote::{CallError, Job, Store};
use crate::quota::QuotaParams;
use crate::{BackendError, ConfigError, Key, Policy};

/// A statement that failed: its error, and whether the database rolled it back whole for a
/// conflict with another transaction (a serialization failure, a deadlock, a lock wait
/// timeout: nothing was taken), so that sending it again charges once.
pub(crate) struct Failed {
    pub(crate) error: CallError,
    pub(crate) conflict: bool,
}

impl From<CallError> for Failed {
    fn from(error: CallError) -> Self {
        Failed {
            error,
            conflict: false,
        }
    }
}

/// What one SQL database does its own way. Each method is one round trip (or a few on one
/// connection) and nothing else: retries, counters and the failure policy are the store's.
pub(crate) trait Dialect: Send + Sync + Sized + 'static {
    /// The store's kind, as the `backend` label of metrics: `postgres`, `mysql`.
    const KIND: &'static str;
    /// The database's name in messages: `PostgreSQL`, `MySQL`.
    const NAME: &'static str;
    /// The most slots of one concurrent quota a key's row holds.
    const MAX_SLOTS: u32 = u32::MAX;

    /// The driver's pool of connections.
    type Pool: Clone + Send + Sync + 'static;
    /// A connection from the pool.
    type Conn: Send;
    /// The quoted names of the table and the routine, and the statements using them.
    type Names: Send + Sync + 'static;

    /// A connection from `pool`, within `connect_timeout`.
    fn connect(
        pool: &Self::Pool,
        connect_timeout: Duration,
    ) -> impl Future<Output = Result<Self::Conn, CallError>> + Send + '_;

    /// The size of a pool handed over, when the driver tells it.
    fn pool_size(pool: &Self::Pool) -> Option<usize>;

    /// Drops the pool's idle connections, so that the next call makes a new one.
    fn drop_idle(_pool: &Self::Pool) {}

    /// The table's quoted name.
    fn table(names: &Self::Names) -> &str;

    /// The migration's SQL.
    fn migration(names: &Self::Names) -> String;

    /// Runs the migration, safe from many instances at once.
    fn migrate<'a>(
        conn: &'a mut Self::Conn,
        names: &'a Self::Names,
    ) -> impl Future<Output = Result<(), CallError>> + Send + 'a;

    /// One call of the routine deciding `args`, answering its integers.
    fn decide<'a>(
        conn: &'a mut Self::Conn,
        names: &'a Self::Names,
        args: &'a Args,
        now_ns: Option<i64>,
    ) -> impl Future<Output = Result<Vec<i64>, Failed>> + Send + 'a;

    /// `SELECT 1`.
    fn ping(conn: &mut Self::Conn) -> impl Future<Output = Result<(), CallError>> + Send + '_;

    /// Writes the fleet's row `own` until `ttl_us` from now on the database's clock, and counts
    /// the live rows strictly between `low` and `high` (this one included).
    fn announce<'a>(
        conn: &'a mut Self::Conn,
        names: &'a Self::Names,
        rows: &'a FleetRows,
        ttl_us: i64,
    ) -> impl Future<Output = Result<i64, CallError>> + Send + 'a;

    /// Deletes the rows `keys`, answering how many were.
    fn delete<'a>(
        conn: &'a mut Self::Conn,
        names: &'a Self::Names,
        keys: Vec<Vec<u8>>,
    ) -> impl Future<Output = Result<u64, CallError>> + Send + 'a;

    /// Deletes at most `n` expired rows, answering how many were.
    fn sweep<'a>(
        conn: &'a mut Self::Conn,
        names: &'a Self::Names,
        n: u32,
    ) -> impl Future<Output = Result<u64, Failed>> + Send + 'a;
}

/// The rows of the fleet's announcements ([`Fleet::Announced`](crate::backend::remote::Fleet)):
/// this instance's key, and the bounds (exclusive) of every instance's, `<prefix>:fleet:<id>`.
/// No client's row starts so: theirs are `<prefix>:{...`.
pub(crate) struct FleetRows {
    pub(crate) own: Vec<u8>,
    pub(crate) low: Vec<u8>,
    pub(crate) high: Vec<u8>,
}

impl FleetRows {
    pub(crate) fn new(prefix: &str, id: u64) -> Self {
        FleetRows {
            own: format!("{prefix}:fleet:{id:016x}").into_bytes(),
            low: format!("{prefix}:fleet:").into_bytes(),
            high: format!("{prefix}:fleet;").into_bytes(),
        }
    }
}

/// A SQL database as a remote backend's [`Store`].
pub(crate) struct SqlStore<D: Dialect> {
    pub(crate) pool: D::Pool,
    /// Where the database is, password masked.
    pub(crate) endpoint: String,
    pub(crate) prefix: String,
    pub(crate) names: Arc<D::Names>,
    /// Calls in flight at once while batching.
    pub(crate) in_flight: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) sweeper: Arc<Sweeper>,
    /// Calls sent again after the database rolled them back for a conflict.
    pub(crate) conflicts: AtomicU64,
}

/// How many times a statement the database rolled back for a conflict is sent again, with a
/// random pause of up to `attempt` × 2 ms, within the decision's timeout.
pub(crate) const RETRIES: u32 = 3;

/// Retries after conflicts: [`again`](Self::again) pauses before the next attempt, or gives
/// the error back when it is not a conflict or the attempts are spent.
struct Retries<'a> {
    attempt: u32,
    counted: Option<&'a AtomicU64>,
}

impl<'a> Retries<'a> {
    fn new(counted: Option<&'a AtomicU64>) -> Self {
        Retries {
            attempt: 0,
            counted,
        }
    }

    async fn again(&mut self, failed: Failed) -> Result<(), CallError> {
        if !failed.conflict || self.attempt >= RETRIES {
            return Err(failed.error);
        }
        self.attempt += 1;
        if let Some(counter) = self.counted {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        tokio::time::sleep(jitter(self.attempt)).await;
        Ok(())
    }
}

/// A random pause before retry `attempt` (1-based).
fn jitter(attempt: u32) -> Duration {
    use std::hash::BuildHasher;
    let r = std::collections::hash_map::RandomState::new().hash_one(attempt);
    Duration::from_micros(200 + r % (2_000 * u64::from(attempt)))
}

/// The sweep's batch: deletes at most `n` expired rows on a connection of its own (a deadlock
/// with a decision, rare, is sent again).
pub(crate) fn sweep_batch<D: Dialect>(
    pool: D::Pool,
    names: Arc<D::Names>,
    connect_timeout: Duration,
) -> SweepBatch {
    Box::new(move |n| {
        let (pool, names) = (pool.clone(), names.clone());
        Box::pin(async move {
            let mut conn = D::connect(&pool, connect_timeout).await?;
            let mut retries = Retries::new(None);
            loop {
                match D::sweep(&mut conn, &names, n).await {
                    Ok(deleted) => return Ok(deleted),
                    Err(failed) => retries.again(failed).await?,
                }
            }
        })
    })
}

impl<D: Dialect> SqlStore<D> {
    async fn conn(&self) -> Result<D::Conn, CallError> {
        D::connect(&self.pool, self.connect_timeout).await
    }

    /// Creates the table and the routine if missing (see each database's `migrate`).
    pub(crate) async fn migrate(&self) -> Result<(), BackendError> {
        let mut conn = self.conn().await?;
        Ok(D::migrate(&mut conn, &self.names).await?)
    }

    /// Deletes the rows of `key` under a policy's quotas, but for slots in flight.
    pub(crate) async fn reset(&self, p: &Prepared, key: &Key) -> Result<u64, BackendError> {
        let keys = super::reset_keys(p, key);
        let mut conn = self.conn().await?;
        Ok(D::delete(&mut conn, &self.names, keys).await?)
    }

    /// The table's quoted name.
    pub(crate) fn table(&self) -> &str {
        D::table(&self.names)
    }

    /// The migration's SQL.
    pub(crate) fn migration(&self) -> String {
        D::migration(&self.names)
    }

    /// Calls sent again after a conflict, since the backend was built.
    pub(crate) fn conflicts_retried(&self) -> u64 {
        self.conflicts.load(Ordering::Relaxed)
    }
}

impl<D: Dialect> Store for SqlStore<D> {
    const KIND: &'static str = D::KIND;
    const SETTLES: bool = true;
    type Prepared = Prepared;

    fn prepare(&self, policy: &Policy, params: &[QuotaParams]) -> Result<Prepared, ConfigError> {
        if let Some(p) = params
            .iter()
            .find(|p| p.is_concurrent() && p.burst.get() > D::MAX_SLOTS)
        {
            return Err(ConfigError::Invalid {
                option: "Quota::concurrent",
                reason: format!(
                    "policy `{}`: {} slots; the {} store holds at most {} per key",
                    policy.name(),
                    p.burst,
                    D::NAME,
                    D::MAX_SLOTS
                ),
            });
        }
        Sweeper::start(&self.sweeper);
        Ok(Prepared::new(&self.prefix, policy, params))
    }

    async fn call(
        &self,
        jobs: &[Job<Self>],
        now_ns: Option<u64>,
    ) -> Result<Vec<Result<Decision, BackendError>>, CallError> {
        // A calendar's windows from the instance's time (the test clock's when set).
        let args = Args::of(jobs, now_ns);
        let now = now_ns.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
        let mut conn = self.conn().await?;
        // Rolled back whole: nothing was taken, so sending it again charges once.
        let mut retries = Retries::new(Some(&self.conflicts));
        let reply = loop {
            match D::decide(&mut conn, &self.names, &args, now).await {
                Ok(reply) => break reply,
                Err(failed) => retries.again(failed).await?,
            }
        };
        Ok(super::decisions(&reply, jobs))
    }

    async fn ping(&self) -> Result<(), CallError> {
        D::ping(&mut self.conn().await?).await
    }

    async fn announce(&self, id: u64, ttl: Duration) -> Result<u32, CallError> {
        let rows = FleetRows::new(&self.prefix, id);
        let ttl_us = i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX);
        let mut conn = self.conn().await?;
        let n = D::announce(&mut conn, &self.names, &rows, ttl_us).await?;
        Ok(u32::try_from(n).unwrap_or(if n < 0 { 0 } else { u32::MAX }))
    }

    fn can_batch(&self) -> bool {
        true
    }

    fn reconnect(&self) {
        D::drop_idle(&self.pool);
    }

    fn calls_in_flight(&self) -> usize {
        self.in_flight
    }

    fn warm_up_timeout(&self, timeout: Duration) -> Duration {
        self.connect_timeout.saturating_add(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fleet_rows_bound_every_instance_and_no_client() {
        let rows = FleetRows::new("tg", 0xab);
        assert_eq!(rows.own, b"tg:fleet:00000000000000ab");
        assert!(rows.low < rows.own && rows.own < rows.high);
        let client = b"tg:{api:alice}:0g".to_vec();
        assert!(!(rows.low < client && client < rows.high));
    }

    #[tokio::test(start_paused = true)]
    async fn conflicts_are_sent_again_three_times_then_fail() {
        let counted = AtomicU64::new(0);
        let mut retries = Retries::new(Some(&counted));
        let conflict = || Failed {
            error: CallError::new(crate::backend::remote::StoreFailure::ErrorReply, "deadlock"),
            conflict: true,
        };
        for _ in 0..RETRIES {
            assert!(retries.again(conflict()).await.is_ok());
        }
        assert!(retries.again(conflict()).await.is_err());
        assert_eq!(counted.load(Ordering::Relaxed), u64::from(RETRIES));
        let other: Failed =
            CallError::new(crate::backend::remote::StoreFailure::ErrorReply, "no").into();
        assert!(Retries::new(None).again(other).await.is_err());
    }
}
