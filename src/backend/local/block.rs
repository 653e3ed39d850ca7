//! The local backend's penalties (`Policy::block_for`): per key, the instant its block ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use foldhash::quality::RandomState;

use super::{entry, swap, track_sub};
use crate::Key;

/// The blocks of one policy: per key, the Unix time (µs) its block ends, counted against the
/// backend's key cap and swept once ended.
pub(super) struct Blocks {
    /// How long a block lasts, in µs (the policy's latest: a changed length applies to the
    /// blocks that start from then on).
    block_us: AtomicU64,
    until: DashMap<Key, AtomicU64, RandomState>,
    tracked: Arc<AtomicUsize>,
}

impl Blocks {
    pub(super) fn new(block_us: u64, tracked: Arc<AtomicUsize>) -> Self {
        Blocks {
            block_us: AtomicU64::new(block_us),
            until: DashMap::with_hasher(RandomState::default()),
            tracked,
        }
    }

    /// How long `key` is still blocked at `now_us` (µs), if it is.
    #[inline]
    pub(super) fn left(&self, key: &Key, now_us: u64) -> Option<u64> {
        let until = self.until.get(key)?.load(Ordering::Acquire);
        until.checked_sub(now_us).filter(|&left| left > 0)
    }

    /// Blocks `key` from `now_us` (a block still running is kept as it is, not extended);
    /// returns how long it is blocked.
    pub(super) fn start(&self, key: &Key, now_us: u64) -> u64 {
        let until = entry(&self.until, key, &self.tracked, || AtomicU64::new(0));
        let end = swap(&until, |until| {
            let end = if until > now_us {
                until
            } else {
                now_us.saturating_add(self.block_us.load(Ordering::Relaxed))
            };
            (end, end)
        });
        end - now_us
    }

    /// Sets how long the blocks that start from now on last.
    pub(super) fn set_length(&self, block_us: u64) {
        self.block_us.store(block_us, Ordering::Relaxed);
    }

    /// Forgets `key`'s block (an operator forgiving a client).
    pub(super) fn remove(&self, key: &Key) {
        if self.until.remove(key).is_some() {
            track_sub(&self.tracked, 1);
        }
    }

    /// Drops the blocks that have ended at `now_us`.
    pub(super) fn sweep(&self, now_us: u64) {
        let mut removed = 0;
        self.until.retain(|_, until| {
            let ended = *until.get_mut() <= now_us;
            removed += usize::from(ended);
            !ended
        });
        self.until.shrink_to_fit();
        track_sub(&self.tracked, removed);
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        track_sub(&self.tracked, self.until.len());
    }
}
