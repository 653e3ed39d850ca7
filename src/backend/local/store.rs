//! The governor state store: one atomic theoretical arrival time per key, counted against the
//! backend's key cap.

use super::*;

thread_local! {
    /// The arrival time the store last wrote on this thread: governor reports remaining units,
    /// not the time, and `decide` reads it right after the check it made on this thread.
    pub(super) static LAST_TAT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The time a limiter last read on this thread ([`Stamped`]), in nanoseconds since the
    /// backend's origin: the `now` of the decision `decide` just had governor make.
    pub(super) static LAST_NOW: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Governor state store: one atomic theoretical arrival time per key, counted against the
/// backend's key cap.
pub(super) struct Store(pub(super) Arc<StoreMap>);

pub(super) struct StoreMap {
    pub(super) map: DashMap<Key, AtomicU64, RandomState>,
    pub(super) tracked: Arc<AtomicUsize>,
    /// The instant (ns since the backend's origin) its limiter counts the stored times from:
    /// a stored time `t` is `start + t` on the backend's clock.
    pub(super) start: AtomicU64,
    /// The quota's emission interval (ns) and burst, which the stored times are counted in.
    pub(super) values: (u64, u32),
    /// When it was made, among the backend's stores: the latest of a quota's is the one a
    /// store for changed values inherits from.
    pub(super) seq: u64,
    /// The store of the quota's earlier values, whose buckets are moved here (converted as
    /// the policy's `OnChange` says) when their keys are first seen here; dropped by the
    /// sweep once it holds nothing.
    pub(super) earlier: arc_swap::ArcSwapOption<Earlier<StoreMap>>,
}

/// A store of a quota's earlier values, and what its keys keep when they move.
pub(super) struct Earlier<S> {
    pub(super) from: Arc<S>,
    pub(super) on_change: crate::quota::OnChange,
}

/// A store that may have a store of its quota's earlier values.
pub(super) trait Versioned: Sized {
    fn earlier(&self) -> &arc_swap::ArcSwapOption<Earlier<Self>>;
}

impl Versioned for StoreMap {
    fn earlier(&self) -> &arc_swap::ArcSwapOption<Earlier<Self>> {
        &self.earlier
    }
}

/// The stores of `store`'s quota's earlier values, latest first.
pub(super) fn earlier_stores<S: Versioned>(store: &S) -> Vec<Arc<S>> {
    let mut chain = Vec::new();
    let mut next = store.earlier().load_full();
    while let Some(e) = next {
        next = e.from.earlier().load_full();
        chain.push(e.from.clone());
    }
    chain
}

impl StoreMap {
    pub(super) fn new(tracked: Arc<AtomicUsize>, values: (u64, u32), seq: u64) -> Self {
        StoreMap {
            map: DashMap::with_hasher(RandomState::default()),
            tracked,
            start: AtomicU64::new(0),
            values,
            seq,
            earlier: arc_swap::ArcSwapOption::empty(),
        }
    }

    /// The instant (ns since the backend's origin) its stored times count from.
    pub(super) fn start(&self) -> u64 {
        self.start.load(Ordering::Relaxed)
    }

    /// The stores of the quota's earlier values, latest first.
    pub(super) fn earlier_stores(&self) -> Vec<Arc<StoreMap>> {
        earlier_stores(self)
    }

    /// Forgets `key`'s bucket, here and under the quota's earlier values.
    pub(super) fn remove(&self, key: &Key) {
        let forget = |store: &StoreMap| {
            if store.map.remove(key).is_some() {
                track_sub(&store.tracked, 1);
            }
        };
        forget(self);
        for store in self.earlier_stores() {
            forget(&store);
        }
    }

    /// `key`'s arrival time at `now` (ns since the backend's origin), 0 (full) without a
    /// bucket.
    pub(super) fn tat(&self, key: &Key, now: u64) -> u64 {
        self.get(key, now)
            .map_or(0, |tat| tat.load(Ordering::Acquire))
    }

    /// `key`'s bucket, if it has one here or had one under the quota's earlier values (moved
    /// here at `now`).
    pub(super) fn get(
        &self,
        key: &Key,
        now: u64,
    ) -> Option<dashmap::mapref::one::Ref<'_, Key, AtomicU64>> {
        match self.map.get(key) {
            Some(tat) => Some(tat),
            None if self.earlier_holds(key) => Some(self.bucket(key, now)),
            None => None,
        }
    }

    /// `key`'s bucket, made on its first request: fresh, or what it held under the quota's
    /// earlier values, converted at `now`.
    #[inline]
    pub(super) fn bucket(
        &self,
        key: &Key,
        now: u64,
    ) -> dashmap::mapref::one::Ref<'_, Key, AtomicU64> {
        entry(&self.map, key, &self.tracked, || {
            AtomicU64::new(self.inherit(key, now))
        })
    }

    /// Whether a store of the quota's earlier values holds a bucket of `key`.
    pub(super) fn earlier_holds(&self, key: &Key) -> bool {
        let earlier = self.earlier.load();
        earlier
            .as_ref()
            .is_some_and(|e| e.from.map.contains_key(key) || e.from.earlier_holds(key))
    }

    /// The stored time a new bucket of `key` starts from at `now`: 0 (full), or the debt it
    /// had under the quota's earlier values (taken from their store), converted.
    fn inherit(&self, key: &Key, now: u64) -> u64 {
        let earlier = self.earlier.load();
        let Some(e) = earlier.as_ref() else {
            return 0;
        };
        let tat = e.from.take(key, now);
        if tat <= now {
            return 0;
        }
        match e
            .on_change
            .carry_debt(tat - now, e.from.values, self.values)
        {
            0 => 0,
            debt => (now + debt).saturating_sub(self.start()).max(1),
        }
    }

    /// Removes `key`'s bucket and returns its arrival time on the backend's clock (0: none).
    fn take(&self, key: &Key, now: u64) -> u64 {
        let stored = match self.map.remove(key) {
            Some((_, tat)) => {
                track_sub(&self.tracked, 1);
                tat.into_inner()
            }
            None => self.inherit(key, now),
        };
        if stored == 0 {
            0
        } else {
            stored + self.start()
        }
    }

    /// Drops the buckets of the earlier stores that are full again at `now`, and the stores
    /// once they hold nothing.
    pub(super) fn sweep_earlier(&self, now: u64) {
        let earlier = self.earlier.load();
        let Some(e) = earlier.as_ref() else {
            return;
        };
        let from = &e.from;
        let below = now.saturating_sub(from.start());
        let mut removed = 0;
        from.map.retain(|_, tat| {
            let keep = *tat.get_mut() > below;
            removed += usize::from(!keep);
            keep
        });
        from.map.shrink_to_fit();
        track_sub(&from.tracked, removed);
        from.sweep_earlier(now);
        if from.map.is_empty() && from.earlier.load().is_none() {
            self.earlier.store(None);
        }
    }

    /// Evicts about an eighth of the buckets (`needed` at least), the least used (their
    /// arrival times nearest `now`, the limiter's time); returns how many it evicted.
    pub(super) fn evict(&self, needed: usize, now: u64) -> usize {
        let weight = |tat: &AtomicU64| tat.load(Ordering::Relaxed).saturating_sub(now);
        let evicted = evict_lightest(&self.map, needed, |v| weight(v), |v| (weight(v), 1));
        track_sub(&self.tracked, evicted);
        evicted
    }
}

/// Evicts from `map` about an eighth of its entries (`needed` at least, a quarter at most),
/// those that used the least: entries whose weight (`weigh`, read shared; `weigh_mut` under
/// the map's write lock, with what the entry takes of the key cap) is at most that of the
/// lightest eighth of a sample, spread evenly over the map (each of its shards gives up its
/// share, so that none keeps growing while another is emptied). One pass over the map, its
/// shards write-locked one at a time. Returns how much of the key cap it freed.
pub(super) fn evict_lightest<V>(
    map: &DashMap<Key, V, RandomState>,
    needed: usize,
    weigh: impl Fn(&V) -> u64,
    mut weigh_mut: impl FnMut(&mut V) -> (u64, usize),
) -> usize {
    let len = map.len();
    if len == 0 {
        return 0;
    }
    let budget = (len / 8).max(needed).min(len.div_ceil(4));
    let mut sample: Vec<u64> = map.iter().take(256).map(|e| weigh(e.value())).collect();
    sample.sort_unstable();
    let at = (sample.len() * budget).div_ceil(len).saturating_sub(1);
    let Some(&threshold) = sample.get(at.min(sample.len().saturating_sub(1))) else {
        return 0;
    };
    let (mut visited, mut evicted, mut freed) = (0usize, 0usize, 0usize);
    map.retain(|_, v| {
        visited += 1;
        // This entry's share of the budget, so far: evictions spread over the whole map.
        let share = (visited * budget).div_ceil(len);
        if evicted >= share {
            return true;
        }
        let (weight, units) = weigh_mut(v);
        let evict = weight <= threshold;
        evicted += usize::from(evict);
        freed += if evict { units } else { 0 };
        !evict
    });
    freed
}

pub(super) fn measure<T, E>(
    tat: &AtomicU64,
    f: impl Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
) -> Result<T, E> {
    let mut prev = tat.load(Ordering::Acquire);
    loop {
        let (result, next) = f((prev != 0).then(|| Nanos::from(prev)))?;
        match tat.compare_exchange_weak(prev, next.as_u64(), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                LAST_TAT.set(next.as_u64());
                return Ok(result);
            }
            Err(actual) => prev = actual,
        }
    }
}

impl StateStore for Store {
    type Key = Key;

    fn measure_and_replace<T, F, E>(&self, key: &Key, f: F) -> Result<T, E>
    where
        F: Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
    {
        // Governor read the clock (kept by `Stamped`) just before.
        measure(&self.0.bucket(key, LAST_NOW.get()), f)
    }
}

impl ShrinkableKeyedStateStore<Key> for Store {
    fn retain_recent(&self, drop_below: Nanos) {
        let drop_below = drop_below.as_u64();
        let mut removed = 0;
        self.0.map.retain(|_, tat| {
            let keep = tat.load(Ordering::Relaxed) > drop_below;
            removed += usize::from(!keep);
            keep
        });
        track_sub(&self.0.tracked, removed);
    }

    fn shrink_to_fit(&self) {
        self.0.map.shrink_to_fit();
    }

    fn len(&self) -> usize {
        self.0.map.len()
    }

    fn is_empty(&self) -> bool {
        self.0.map.is_empty()
    }
}

impl Drop for StoreMap {
    fn drop(&mut self) {
        track_sub(&self.tracked, self.map.len());
    }
}
