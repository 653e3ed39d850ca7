//! The local deny cache: once the store denied a key, answer it here until the retry time.
//!
//! # Why it never denies what the store would allow
//!
//! For every algorithm the store's script or SQL runs, the earliest time at which a denied request fits never
//! moves earlier, whatever other requests, replicas or clients do:
//!
//! - **GCRA** keeps one number per bucket, its theoretical arrival time (TAT), and a request of
//!   cost `c` fits at time `now` exactly when `now >= TAT + (c - 1)·T - τ`. Every change the store
//!   makes to a TAT moves it *later* (an allowed request sets it to `max(TAT, now) + c·T`), and
//!   a bucket whose key expired is one whose TAT has passed, which is the same as a fresh one.
//!   A larger cost `c'` fits `(c' - c)·T` later still, so its exact wait is computed too.
//! - **Fixed window**: within a window the count only grows, so a denied request stays denied
//!   until the window's end, which is the `retry_after` the store gives (for every larger cost
//!   too); the key expires at that same instant.
//! - **Sliding window**: with nothing more counted, the estimate `E` only falls as time passes
//!   (the oldest count slides out linearly, and leaves when it reaches zero weight), and more
//!   counts only raise it; the key expires when every count has slid out, which is an empty
//!   window. So `retry_after` is again a bound that stays valid. Two things the cache cannot
//!   recompute without the counts (which stay in the store): `remaining`, which grows at
//!   `reset_after`, and the wait of a larger cost. So a denial by a sliding window is cached
//!   only until its `reset_after` (for a denied cost-1 request, that is its `retry_after`:
//!   the flood case is fully covered), and answers only requests of the same cost.
//!
//! So when the store says at time `t_r` that the request must wait `W`, it is denied until
//! `t_r + W`. The cache stores `t_send + W`, where `t_send` (taken before the call left) is not
//! later than `t_r`, and answers requests of the same cost until then, their waits shrinking
//! with the time elapsed since `t_send`, exactly as the store would report them. A larger cost is
//! answered only when every quota of the policy denied, none is a sliding window and the cost
//! fits every burst (otherwise a quota that had room, or a cost that can never fit, could be
//! reported differently from the store); a smaller cost may fit sooner and always goes to the store.
//!
//! # What gives back
//!
//! Units and slots given back break the argument: a refund (a settlement after the response,
//! or a [`Limiter`](crate::limiter::Limiter)'s permit settled for less) moves a TAT earlier or
//! lowers a count, and a release frees a slot, possibly by another instance that shares the
//! store, which this cache cannot see. So for a policy whose keys can be given something
//! back (it settles, it holds slots, or a `Limiter` decides it: `Policy::gives_back`) the cache
//! holds only blocks, which nothing given back lifts; every other denial goes to the store.
//! A policy without either is never given anything back through the layer or a `Limiter`; a
//! program that calls [`Backend::decide_with`](crate::backend::Backend::decide_with) with
//! `Mode::Refund` or `Mode::Release` itself on such a policy should build the backends that
//! share it with `deny_cache_capacity(0)`.
//!
//! The argument needs the keys to be changed only by this script. It breaks when someone
//! deletes the keys by hand, or resets a key from another instance (`reset` forgets the
//! denial on the instance that resets it only), or when the store loses them (a restart without persistence, a
//! failover to a replica that had not received the last writes): the store would then allow again
//! while the cache still denies, for at most the retry time it had given.
//!
//! Entries belong to one prepared policy (each prepared remote policy owns its
//! cache), so when a policy is replaced at run time, for instance by one with a higher limit,
//! the old denials no longer apply.
//!
//! # Memory
//!
//! All caches of one backend share one capacity. When it is reached, expired entries of the
//! cache being written are swept (at most every 100 ms); if there is still no room, the denial
//! is simply not cached. Expired entries are also dropped when they are looked up.

use std::hash::RandomState;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use smallvec::SmallVec;

use crate::Key;
use crate::backend::{Decision, Outcome, QuotaState};
use crate::quota::{QuotaKind, QuotaParams};

/// The denials of one prepared policy.
#[derive(Debug)]
pub(crate) struct DenyCache {
    /// Only blocks are held: units or slots may be given back to the policy's keys (a refund,
    /// a release, possibly by another instance), which makes any other denial stale at once.
    blocks_only: bool,
    map: DashMap<Key, Entry, RandomState>,
    budget: Arc<Budget>,
    next_sweep_ns: AtomicU64,
}

/// Capacity shared by the caches of one backend.
#[derive(Debug)]
pub(crate) struct Budget {
    pub(crate) capacity: usize,
    /// Entries held by all caches: every insertion and every removal adjusts it by exactly
    /// the entries it added or removed.
    pub(crate) used: AtomicUsize,
}

impl Budget {
    /// Gives back `n` units. Saturating: were the count ever to drift below the true number of
    /// entries, wrapping would leave it near `usize::MAX` and turn the cache off for good;
    /// stopping at zero only lets the caches hold a few entries more than the capacity.
    fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |used| {
                Some(used.saturating_sub(n))
            });
    }
}

#[derive(Debug)]
struct Entry {
    /// Until when (clock ns) the key is denied.
    until_ns: u64,
    /// When the denied call was sent (clock ns).
    sent_ns: u64,
    /// The cost that was denied: requests costing less may fit sooner and are not answered.
    cost: NonZeroU32,
    /// Whether requests costing more may be answered too (see the module docs).
    larger: bool,
    /// A block (`Policy::block_for`): every request of the key is refused until it ends,
    /// whatever its cost.
    blocked: bool,
    states: SmallVec<[QuotaState; 2]>,
    /// The headers the store's answer passed on ([`Decision::response_headers`]), repeated as
    /// they were.
    headers: Option<crate::backend::ResponseHeaders>,
}

impl DenyCache {
    /// The cache of a policy; `gives_back`: whether units or slots may be given back to its
    /// keys after admission, so that only blocks are held (see the module docs).
    pub(crate) fn new(budget: Arc<Budget>, gives_back: bool) -> Self {
        DenyCache {
            blocks_only: gives_back,
            map: DashMap::with_hasher(RandomState::new()),
            budget,
            next_sweep_ns: AtomicU64::new(0),
        }
    }

    /// The cached denial of `key` for a request of `cost` at `now_ns`, with its waits counted
    /// from now.
    pub(crate) fn get(
        &self,
        key: &Key,
        cost: NonZeroU32,
        now_ns: u64,
        params: &[QuotaParams],
    ) -> Option<Decision> {
        if self.budget.capacity == 0 {
            return None;
        }
        let expired = {
            let entry = self.map.get(key)?;
            if now_ns < entry.until_ns {
                let other_cost = if entry.blocked {
                    false
                } else {
                    cost < entry.cost || (cost > entry.cost && !entry.larger)
                };
                if other_cost || (cost > entry.cost && params.iter().any(|p| cost > p.burst)) {
                    return None;
                }
                return Some(replay(&entry, cost, now_ns, params));
            }
            true
        };
        if expired
            && self
                .map
                .remove_if(key, |_, e| now_ns >= e.until_ns)
                .is_some()
        {
            self.budget.release(1);
        }
        None
    }

    /// Records that the store denied `key` for `cost`, in a call sent at `sent_ns`.
    pub(crate) fn insert(
        &self,
        key: &Key,
        cost: NonZeroU32,
        sent_ns: u64,
        decision: &Decision,
        params: &[QuotaParams],
    ) {
        if self.budget.capacity == 0
            || decision.never_fits()
            || (self.blocks_only && !decision.is_blocked())
        {
            return;
        }
        let Some(mut wait) = decision.retry_after() else {
            return;
        };
        // A block refuses every cost until its end (its state is the first quota's, whatever
        // that quota's algorithm): held until then, for any cost.
        let blocked = decision.is_blocked();
        // A sliding window's `remaining` grows at its `reset_after`, which only the store can tell
        // the next value of: hold its denial until then (module docs).
        let mut larger = blocked || decision.quotas().len() == params.len();
        for s in decision.quotas().iter().filter(|_| !blocked) {
            let sliding = matches!(
                params.get(s.index).map(|p| p.kind),
                Some(QuotaKind::SlidingWindow { .. })
            );
            match s.outcome {
                Outcome::Denied { .. } if sliding => {
                    wait = wait.min(s.reset_after);
                    larger = false;
                }
                Outcome::Denied { .. } => {}
                _ => larger = false,
            }
        }
        if wait.is_zero() {
            return;
        }
        let until_ns = sent_ns.saturating_add(u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX));
        let reserved = !self.map.contains_key(key);
        if reserved && !self.reserve(sent_ns) {
            return;
        }
        let entry = Entry {
            until_ns,
            sent_ns,
            cost,
            larger,
            blocked,
            states: decision.quotas().iter().copied().collect(),
            headers: decision.shared_response_headers().cloned(),
        };
        let replaced = self.map.insert(key.clone(), entry).is_some();
        // Keep `used` equal to the number of entries when another task raced us.
        match (reserved, replaced) {
            (true, true) => self.budget.release(1),
            (false, false) => {
                self.budget.used.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// Forgets `key`'s denial: the store has just allowed a request on it (a smaller cost), so
    /// the counts the cached denial reports are out of date.
    pub(crate) fn forget(&self, key: &Key) {
        if self.budget.capacity != 0 && self.map.remove(key).is_some() {
            self.budget.release(1);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Takes one unit of the shared capacity, sweeping this cache first when it is exhausted.
    fn reserve(&self, now_ns: u64) -> bool {
        if self.budget.used.fetch_add(1, Ordering::AcqRel) < self.budget.capacity {
            return true;
        }
        self.budget.release(1);
        let next = self.next_sweep_ns.load(Ordering::Relaxed);
        if now_ns >= next
            && self
                .next_sweep_ns
                .compare_exchange(
                    next,
                    now_ns + 100_000_000,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            // Count what this sweep removes, not the change in length: other tasks insert and
            // remove (and account for it themselves) while it runs.
            let mut removed = 0;
            self.map.retain(|_, e| {
                let keep = now_ns < e.until_ns;
                removed += usize::from(!keep);
                keep
            });
            self.budget.release(removed);
            if self.budget.used.fetch_add(1, Ordering::AcqRel) < self.budget.capacity {
                return true;
            }
            self.budget.release(1);
        }
        false
    }
}

impl Drop for DenyCache {
    fn drop(&mut self) {
        self.budget.release(self.map.len());
    }
}

/// The stored decision as it stands at `now_ns` for a request of `cost` (the denied cost, or
/// a larger one when the entry allows it): the denials' waits shrink with the time elapsed
/// since the call was sent; the other quotas are reported as the store reported them.
fn replay(entry: &Entry, cost: NonZeroU32, now_ns: u64, params: &[QuotaParams]) -> Decision {
    let decision = replay_states(entry, cost, now_ns, params);
    match &entry.headers {
        Some(headers) => decision.with_response_headers(headers.clone()),
        None => decision,
    }
}

/// The quota states of [`replay`].
fn replay_states(entry: &Entry, cost: NonZeroU32, now_ns: u64, params: &[QuotaParams]) -> Decision {
    let elapsed = now_ns.saturating_sub(entry.sent_ns);
    // A wait that was running stays at least 1 ns until the entry expires.
    let shrink = |d: Duration| {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(ns.saturating_sub(elapsed).max(u64::from(ns > 0)))
    };
    if entry.blocked
        && let Some(left) = entry.states.first()
    {
        return Decision::blocked(params, shrink(left.reset_after));
    }
    let extra_units = u64::from(cost.get().saturating_sub(entry.cost.get()));
    Decision::new(entry.states.iter().map(|s| {
        let Outcome::Denied { retry_after } = s.outcome else {
            return *s;
        };
        let Some(p) = params.get(s.index) else {
            return *s;
        };
        match p.kind {
            QuotaKind::Gcra => {
                let t = p.emission_ns.max(1);
                let wait = u64::try_from(retry_after.as_nanos())
                    .unwrap_or(u64::MAX)
                    .saturating_sub(elapsed)
                    .saturating_add(extra_units.saturating_mul(t))
                    .max(1);
                QuotaState::denied(s.index, p, cost, Duration::from_nanos(wait))
            }
            // Fixed (and calendar): denied until the window's end whatever the cost (entries
            // are never kept past it), and the count, so `remaining`, cannot fall before then.
            // Sliding: the same cost only, never past `reset_after`, so `remaining` is
            // unchanged. Both waits point at the same instants as when the store gave them.
            // A concurrent quota: told to ask again after a fixed time, shrinking the same way.
            _ => QuotaState {
                outcome: Outcome::Denied {
                    retry_after: shrink(retry_after),
                },
                reset_after: shrink(s.reset_after),
                ..*s
            },
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(capacity: usize) -> (DenyCache, [QuotaParams; 1], Decision) {
        let budget = Arc::new(Budget {
            capacity,
            used: AtomicUsize::new(0),
        });
        let params = [QuotaParams::gcra(
            1_000_000_000,
            NonZeroU32::new(5).unwrap(),
        )];
        let denied = Decision::new([QuotaState {
            index: 0,
            outcome: Outcome::Denied {
                retry_after: Duration::from_secs(2),
            },
            limit: 5,
            remaining: 0,
            reset_after: Duration::from_secs(5),
        }]);
        (DenyCache::new(budget, false), params, denied)
    }

    #[test]
    fn answers_until_the_retry_time() {
        let (cache, p, denied) = setup(10);
        let key = Key::from_bytes("k").unwrap();
        let one = NonZeroU32::MIN;
        cache.insert(&key, one, 0, &denied, &p);
        let hit = cache.get(&key, one, 500_000_000, &p).unwrap();
        assert_eq!(hit.retry_after(), Some(Duration::from_millis(1500)));
        // A bigger request waits one more emission interval per extra unit.
        let two = NonZeroU32::new(2).unwrap();
        let hit = cache.get(&key, two, 500_000_000, &p).unwrap();
        assert_eq!(hit.retry_after(), Some(Duration::from_millis(2500)));
        assert_eq!(hit.quotas()[0].remaining, 0);
        assert!(cache.get(&key, one, 2_000_000_000, &p).is_none());
        assert_eq!(cache.len(), 0, "expired entries are dropped on lookup");
    }

    fn window_params() -> [QuotaParams; 2] {
        let policy = crate::Policy::new("w", crate::Quota::per_minute(10).fixed_window()).and(
            crate::Quota::per_second(4)
                .sliding_window()
                .resolution(Duration::from_millis(250)),
        );
        let p = policy.validate().unwrap();
        [p[0], p[1]]
    }

    fn denied(
        index: usize,
        limit: u32,
        remaining: u32,
        retry_ms: u64,
        reset_ms: u64,
    ) -> QuotaState {
        QuotaState {
            index,
            outcome: Outcome::Denied {
                retry_after: Duration::from_millis(retry_ms),
            },
            limit,
            remaining,
            reset_after: Duration::from_millis(reset_ms),
        }
    }

    #[test]
    fn fixed_window_denials_hold_until_the_window_ends_for_any_cost() {
        let (cache, _, _) = setup(10);
        let p = window_params();
        let key = Key::from_bytes("k").unwrap();
        // Both quotas denied: the fixed one until its end in 20 s, the sliding one for 300 ms.
        let d = Decision::new([denied(0, 10, 0, 20_000, 20_000), denied(1, 4, 0, 300, 300)]);
        cache.insert(&key, NonZeroU32::MIN, 0, &d, &p);
        let hit = cache.get(&key, NonZeroU32::MIN, 100_000_000, &p).unwrap();
        assert_eq!(hit.quotas()[0], denied(0, 10, 0, 19_900, 19_900));
        assert_eq!(hit.quotas()[1], denied(1, 4, 0, 200, 200));
        // Held only until the sliding window's `reset_after`, and for the same cost only.
        assert!(
            cache
                .get(&key, NonZeroU32::new(2).unwrap(), 1, &p)
                .is_none()
        );
        assert!(cache.get(&key, NonZeroU32::MIN, 300_000_000, &p).is_none());

        // A fixed window alone: larger costs too, until the window's end; not a cost beyond
        // the limit (the store reports those as never fitting).
        let p = [p[0]];
        let d = Decision::new([denied(0, 10, 2, 20_000, 20_000)]);
        cache.insert(&key, NonZeroU32::new(3).unwrap(), 0, &d, &p);
        let hit = cache
            .get(&key, NonZeroU32::new(5).unwrap(), 19_000_000_000, &p)
            .unwrap();
        assert_eq!(hit.quotas()[0], denied(0, 10, 2, 1000, 1000));
        assert!(
            cache
                .get(&key, NonZeroU32::new(11).unwrap(), 1, &p)
                .is_none()
        );
        assert!(
            cache
                .get(&key, NonZeroU32::new(3).unwrap(), 20_000_000_000, &p)
                .is_none()
        );
    }

    #[test]
    fn sliding_denials_are_held_until_remaining_changes() {
        let (cache, _, _) = setup(10);
        let p = window_params();
        let key = Key::from_bytes("k").unwrap();
        // A cost-3 request denied by the sliding window with one unit left: one more unit is
        // back in 40 ms, the request fits in 400 ms. The fixed window had room.
        let allowed = QuotaState {
            index: 0,
            outcome: Outcome::Allowed,
            limit: 10,
            remaining: 5,
            reset_after: Duration::from_secs(30),
        };
        let d = Decision::new([allowed, denied(1, 4, 1, 400, 40)]);
        let three = NonZeroU32::new(3).unwrap();
        cache.insert(&key, three, 0, &d, &p);
        let hit = cache.get(&key, three, 30_000_000, &p).unwrap();
        assert_eq!(hit.quotas(), [allowed, denied(1, 4, 1, 370, 10)]);
        assert!(cache.get(&key, three, 40_000_000, &p).is_none());
    }

    #[test]
    fn smaller_costs_go_to_redis() {
        let (cache, p, denied) = setup(10);
        let key = Key::from_bytes("k").unwrap();
        cache.insert(&key, NonZeroU32::new(3).unwrap(), 0, &denied, &p);
        assert!(cache.get(&key, NonZeroU32::MIN, 1, &p).is_none());
    }

    #[test]
    fn bounded() {
        let (cache, p, denied) = setup(2);
        let one = NonZeroU32::MIN;
        for i in 0..5u8 {
            cache.insert(&Key::from_bytes([i]).unwrap(), one, 0, &denied, &p);
        }
        assert_eq!(cache.len(), 2);
        // Once the first entries expired, the sweep makes room.
        cache.insert(
            &Key::from_bytes("late").unwrap(),
            one,
            3_000_000_000,
            &denied,
            &p,
        );
        assert!(
            cache
                .get(&Key::from_bytes("late").unwrap(), one, 3_000_000_001, &p)
                .is_some()
        );
        assert_eq!(cache.len(), 1);
    }

    /// Were the shared count ever below the true number of entries, a removal must stop it at
    /// zero: wrapping around would leave it near `usize::MAX`, and no denial would be cached
    /// again.
    #[test]
    fn the_count_never_wraps_below_zero() {
        let (cache, p, denied) = setup(2);
        let one = NonZeroU32::MIN;
        let k = Key::from_bytes("k").unwrap();
        cache.insert(&k, one, 0, &denied, &p);
        cache.budget.used.store(0, Ordering::Relaxed);
        // The entry expired: the lookup removes it and gives its unit back.
        assert!(cache.get(&k, one, 3_000_000_000, &p).is_none());
        assert_eq!(cache.budget.used.load(Ordering::Relaxed), 0);
        let late = Key::from_bytes("late").unwrap();
        cache.insert(&late, one, 3_000_000_000, &denied, &p);
        assert!(cache.get(&late, one, 3_000_000_001, &p).is_some());
    }

    /// Lookups remove expired entries while sweeps run on other threads: the shared count
    /// stays equal to the number of entries (a sweep counts what it removes itself, not the
    /// change in length, which includes the lookups' removals).
    #[test]
    fn the_count_stays_exact_under_concurrent_sweeps() {
        let (cache, p, denied) = setup(32);
        let one = NonZeroU32::MIN;
        let clock = AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (cache, p, denied, clock) = (&cache, &p, &denied, &clock);
                s.spawn(move || {
                    for i in 0..20_000u64 {
                        // 1 ms per operation: entries (denied for 2 s) expire, and sweeps
                        // (at most every 100 ms) run often.
                        let now = clock.fetch_add(1_000_000, Ordering::Relaxed);
                        let k = Key::from_bytes(((i * 7 + t) % 64).to_le_bytes()).unwrap();
                        if i % 2 == 0 {
                            cache.insert(&k, one, now, denied, p);
                        } else {
                            let _ = cache.get(&k, one, now, p);
                        }
                    }
                });
            }
        });
        assert_eq!(cache.budget.used.load(Ordering::Relaxed), cache.len());
    }
}
