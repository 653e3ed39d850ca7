//! The key cap: what a new key gets when the table is full (`WhenFull`), and the eviction of
//! the least used buckets that makes room.

use super::*;

/// What a new key gets when the local backend's table is full and holds nothing it can evict
/// (only slots in flight and blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WhenFull {
    /// Denied, `Retry-After: 1` (the default): new clients are turned away until a request
    /// ends or a block passes.
    #[default]
    Deny,
    /// Let through without a bucket, unlimited and without rate-limit headers, until a
    /// request ends or a block passes.
    Allow,
}

/// A decision made before any bucket is charged.
pub(super) enum Refusal {
    Deny(QuotaState),
    Allow,
}

impl<C: Clock> Inner<C> {
    /// Makes room for `needed` more buckets in a full table by evicting the least used ones
    /// of the quota holding the most: about an eighth of them, those that used no more than
    /// the lightest eighth of a sample (see [`evict_lightest`]).
    /// Slots in flight and blocks are never evicted. Returns whether it evicted anything.
    #[cold]
    pub(super) fn evict(&self, needed: usize) -> bool {
        let mut stores = self.stores();
        stores.sort_unstable_by_key(|s| std::cmp::Reverse(s.evictable()));
        let mut evicted = 0;
        for store in stores {
            if evicted >= needed || store.evictable() == 0 {
                break;
            }
            let want = needed - evicted.min(needed);
            evicted += match store {
                Evictable::Gcra(store) => {
                    let now = self.elapsed_ns().saturating_sub(store.start());
                    store.evict(want, now)
                }
                Evictable::Window(store) => store.evict(want, self.now_us()),
            };
        }
        if evicted > 0 {
            self.count_evictions(evicted);
        }
        evicted > 0
    }

    /// How many buckets could be evicted now (all but slots in flight and blocks).
    pub(super) fn evictable(&self) -> usize {
        self.stores().iter().map(Evictable::evictable).sum()
    }

    /// Every store holding buckets: the registered ones, and the stores of earlier values
    /// their keys have not all left yet (still counted against the cap), each once.
    fn stores(&self) -> Vec<Evictable> {
        let counters: Vec<Counter<C>> = {
            let map = self.limiters.lock().unwrap_or_else(|p| p.into_inner());
            map.values().filter_map(Registered::upgrade).collect()
        };
        let mut seen = std::collections::HashSet::new();
        let mut stores = Vec::new();
        for counter in counters {
            match counter {
                Counter::Gcra { store, .. } => {
                    for s in std::iter::once(store.clone()).chain(store.earlier_stores()) {
                        if seen.insert(Arc::as_ptr(&s) as usize) {
                            stores.push(Evictable::Gcra(s));
                        }
                    }
                }
                Counter::Window(store) => {
                    for s in std::iter::once(store.clone()).chain(store.earlier_stores()) {
                        if seen.insert(Arc::as_ptr(&s) as usize) {
                            stores.push(Evictable::Window(s));
                        }
                    }
                }
            }
        }
        stores
    }

    /// When `throttle` lets a warning through now: how much of the `total` counted came since
    /// the last one (`at_last`, set to `total`).
    fn since_warning(
        &self,
        total: u64,
        at_last: &AtomicU64,
        throttle: &OnceAMinute,
    ) -> Option<u64> {
        throttle
            .now(self.elapsed_ns())
            .then(|| total - at_last.swap(total, Ordering::Relaxed))
    }

    /// Counts `n` evicted buckets, and warns at most once a minute.
    fn count_evictions(&self, n: usize) {
        let total = self.evicted.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        crate::metrics::local_evictions(n as u64);
        let Some(since) = self.since_warning(total, &self.warned_evictions, &self.warned_evicting)
        else {
            return;
        };
        tracing::warn!(
            max_keys = self.max_keys,
            evicted = since,
            total,
            "tollgate: the local rate-limit table is full; the least used buckets are evicted \
             to make room for new keys (at most one warning a minute; raise `max_keys`)"
        );
    }

    /// Counts a new key that found the table full, and warns at most once a minute.
    pub(super) fn count_full_refusal(&self) {
        let total = self.full_refusals.fetch_add(1, Ordering::Relaxed) + 1;
        let Some(since) = self.since_warning(total, &self.warned_refusals, &self.warned) else {
            return;
        };
        tracing::warn!(
            max_keys = self.max_keys,
            new_keys = since,
            total,
            when_full = ?self.when_full,
            "tollgate: the local rate-limit table is full; new keys are {} (at most one warning \
             a minute; raise `max_keys` or lower `sweep_interval`)",
            match self.when_full {
                WhenFull::Deny => "denied",
                WhenFull::Allow => "let through unlimited",
            }
        );
    }
}

/// A store whose buckets the key cap can evict.
enum Evictable {
    Gcra(Arc<StoreMap>),
    Window(Arc<WindowStore>),
}

impl Evictable {
    /// How many of its buckets could be evicted (a concurrent quota's: none).
    fn evictable(&self) -> usize {
        match self {
            Evictable::Gcra(store) => store.map.len(),
            Evictable::Window(store) if store.holds_slots() => 0,
            Evictable::Window(store) => store.len(),
        }
    }
}

impl<C: Clock> Counter<C> {
    /// Whether `key` has a bucket or counter here, or under the quota's earlier values (a key
    /// moving here takes no more of the key cap).
    pub(super) fn contains(&self, key: &Key) -> bool {
        match self {
            Counter::Gcra { store, .. } => store.map.contains_key(key) || store.earlier_holds(key),
            Counter::Window(store) => store.contains(key) || store.earlier_holds(key),
        }
    }
}

/// Counts `n` more tracked buckets (and in the `tollgate_local_tracked_keys` gauge).
pub(super) fn track_add(tracked: &AtomicUsize, n: usize) {
    tracked.fetch_add(n, Ordering::Relaxed);
    crate::metrics::tracked_keys(n as f64);
}

/// Counts `n` fewer tracked buckets.
pub(super) fn track_sub(tracked: &AtomicUsize, n: usize) {
    if n > 0 {
        tracked.fetch_sub(n, Ordering::Relaxed);
        crate::metrics::tracked_keys(-(n as f64));
    }
}
