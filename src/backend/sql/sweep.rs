//! The background sweep of expired rows: a row is worth keeping until its bucket is full
//! again (its column `expires_us`); past that, the sweep deletes it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::BackendError;

/// The defaults of the sweep of expired rows.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(10);
pub(crate) const SWEEP_BATCH: u32 = 1_000;
/// The most batches one sweep deletes before waiting for the next (bounds its load).
pub(crate) const SWEEP_ROUNDS: u32 = 100;

/// One batch of the sweep: deletes at most `n` expired rows, answering how many it deleted.
pub(crate) type SweepBatch = Box<
    dyn Fn(u32) -> futures_util::future::BoxFuture<'static, Result<u64, BackendError>>
        + Send
        + Sync,
>;

/// The background sweep of expired rows: every `every`, batches of `batch` rows until a batch
/// comes back short (at most [`SWEEP_ROUNDS`] batches, so that a flood's rows are deleted over
/// several sweeps rather than in one long burst of load).
pub(crate) struct Sweeper {
    every: Option<Duration>,
    batch: u32,
    started: AtomicBool,
    swept: AtomicU64,
    run: SweepBatch,
}

impl Sweeper {
    /// A sweeper running `run`; `every: None` never sweeps in the background.
    pub(crate) fn new(every: Option<Duration>, batch: u32, run: SweepBatch) -> Self {
        Sweeper {
            every,
            batch: batch.max(1),
            started: Default::default(),
            swept: Default::default(),
            run,
        }
    }

    /// Rows deleted so far.
    pub(crate) fn swept(&self) -> u64 {
        self.swept.load(Ordering::Relaxed)
    }

    /// Deletes expired rows now, in batches, until a batch comes back short; answers how many.
    pub(crate) async fn sweep(&self, rounds: u32) -> Result<u64, BackendError> {
        let mut total = 0;
        for _ in 0..rounds.max(1) {
            let n = (self.run)(self.batch).await?;
            total += n;
            self.swept.fetch_add(n, Ordering::Relaxed);
            if n < u64::from(self.batch) {
                break;
            }
        }
        Ok(total)
    }

    /// Starts the background sweep, once, when called inside a Tokio runtime. The task ends
    /// when the sweeper is dropped (with its backend).
    pub(crate) fn start(this: &Arc<Sweeper>) {
        let Some(every) = this.every else { return };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if this.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(this);
        handle.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(sweeper) = weak.upgrade() else {
                    return;
                };
                match sweeper.sweep(SWEEP_ROUNDS).await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(rows = n, "tollgate: swept expired buckets"),
                    Err(err) => tracing::debug!(%err, "tollgate: sweeping expired buckets failed"),
                }
            }
        });
    }
}
