//! The in-process backend: GCRA buckets from the `governor` crate, and fixed and sliding
//! windows.
//!
//! Each GCRA quota of a policy is a keyed governor [`RateLimiter`] over a bounded store owned by
//! this crate; each window quota a map of small per-key counters decided with the arithmetic
//! every store shares (see `docs/algorithms.md`). Limits are per process: behind a load
//! balancer with `n` replicas a client gets up to `n` times the quota. Use the Redis backend
//! for one shared limit.
//!
//! # Guarantees
//!
//! - **Atomic per key and quota.** Concurrent requests on one key never take more units than
//!   the bucket holds: each GCRA bucket is one `AtomicU64` (the theoretical arrival time)
//!   updated by compare-and-swap; each window counter is behind its own mutex, held for a few
//!   arithmetic operations (never across an await).
//! - **Windows on the Unix epoch.** Fixed and sliding windows are aligned to the Unix epoch of
//!   the backend's clock ([`clock_epoch`](LocalBackendBuilder::clock_epoch), by default the
//!   system time when the backend is built, then advanced by the monotonic clock), so that a
//!   daily window ends at 00:00 UTC on every replica, as in Redis.
//! - **Single-quota policies: a denied request consumes nothing.**
//! - **Multi-quota policies are all-or-nothing: a refused request takes nothing.** Window
//!   quotas (this crate's own counters) are checked first, so that a request one of them
//!   refuses touches nothing. Then the quotas are charged one by one (GCRA first: governor
//!   cannot test a bucket without updating it, governor#117), and when one refuses (a later
//!   GCRA quota, or a window or slot another request took meanwhile), what the quotas before
//!   it took is given back: units to each bucket and window, the slot to a concurrent quota.
//!   Each quota is updated atomically on its own, not all together: for the few instructions
//!   between a charge and its give-back, a request racing on the same key may see those units
//!   taken and be refused, never let through beyond a limit. The Redis and SQL stores decide
//!   all quotas in one atomic step.
//! - **Monotonic time.** The default clock is [`MonotonicClock`] (`std::time::Instant`), not
//!   the TSC-based quanta clock that can go backwards between cores (governor#299). Tests
//!   inject [`FakeRelativeClock`] with
//!   [`LocalBackend::builder`].
//! - **Bounded memory.** A bucket whose theoretical arrival time has passed is indistinguishable
//!   from a fresh one, as is a window counter whose window (fixed) or every sub-window (sliding)
//!   has passed, and is evicted by a sweep every
//!   [`sweep_interval`](LocalBackendBuilder::sweep_interval) (60 s by default), run by a task
//!   the backend spawns on the Tokio runtime it is first used in; no thread of yours is needed.
//!   At most [`max_keys`](LocalBackendBuilder::max_keys) buckets (1 000 000 by default, summed
//!   over all quotas; concurrent inserts may overshoot by a few) are tracked. When the table is
//!   full and a new key needs a bucket, a sweep starts (on a blocking thread, at most once a
//!   second) and the **least used buckets are evicted** to make room at once: of the quota
//!   holding the most buckets, about an eighth, those that used no more than the lightest
//!   eighth of a sample (GCRA: the arrival time nearest now; windows: the smallest count),
//!   spread evenly over the table in one pass. The new key is then limited like any other: a
//!   flood of fresh keys neither keeps new clients out nor lets them through unlimited. What
//!   it can do: an evicted key starts afresh, and the keys a flood evicts are those that used
//!   no more than the flooding keys themselves, so a flood of keys that spend `k` units each
//!   gives back at most about `k` units to keys that had used as little. Slots in flight and
//!   blocks are never evicted; only when the table holds nothing else is a new key turned away:
//!   denied (`Retry-After: 1`) by default, or let through unlimited with
//!   [`when_full`](LocalBackendBuilder::when_full). Evictions are counted
//!   ([`evicted_keys`](LocalBackend::evicted_keys), `tollgate_local_evicted_keys_total`), and
//!   both evictions and keys turned away ([`full_table_refusals`](LocalBackend::full_table_refusals))
//!   are warned about at most once a minute, with the count since the last warning. A bucket
//!   costs about 86 bytes with its key (GCRA, fixed window), 153 for a sliding window
//!   (measured: `benches/memory.rs`). A sliding window's bucket holds only the sub-windows
//!   the key counted in (8 bytes each), and counts against the cap as one more bucket for
//!   every 16 of them, so that `max_keys` bounds bytes whatever the resolution: at most about
//!   160 bytes per bucket of the cap (160 MB at the default). IP keys and byte keys of up to
//!   29 bytes are stored inline, longer ones (up to [`Key::MAX_LEN`] bytes) on the heap and
//!   add their length (the worst case at the default cap, with 256-byte keys, is about
//!   330 MB of GCRA buckets); lower `max_keys` when keys come from clients.
//! - **Header timing.** `remaining`, `retry_after` and `reset_after` (the time until the next
//!   unit is back) are exact; for allowed requests `reset_after` is read from the bucket's
//!   stored time right after the decision, so it may be early by the time the decision took.
//!
//! ```
//! use std::time::Duration;
//! use governor::clock::FakeRelativeClock;
//! use tollgate::backend::{Backend, LocalBackend};
//! use tollgate::{Key, Policy, Quota};
//!
//! # tokio_test_block_on(async {
//! let clock = FakeRelativeClock::default();
//! let backend = LocalBackend::builder().clock(clock.clone()).build();
//! let policy = Policy::new("api", Quota::per_second(1).burst(2));
//! let prepared = backend.prepare(&policy, &policy.validate().unwrap()).unwrap();
//! let key = Key::from_bytes("alice").unwrap();
//! let one = std::num::NonZeroU32::MIN;
//!
//! assert!(backend.decide(&prepared, &key, one).await.unwrap().is_allowed());
//! assert!(backend.decide(&prepared, &key, one).await.unwrap().is_allowed());
//! let denied = backend.decide(&prepared, &key, one).await.unwrap();
//! assert_eq!(denied.retry_after(), Some(Duration::from_secs(1)));
//! clock.advance(Duration::from_secs(1));
//! assert!(backend.decide(&prepared, &key, one).await.unwrap().is_allowed());
//! # });
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
//! # }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::{Ready, ready};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use dashmap::DashMap;
// Randomly seeded per process: keys come from clients, so the hash must resist flooding.
use dashmap::mapref::entry::Entry;
use foldhash::quality::RandomState;
use governor::RateLimiter;
use governor::middleware::{NoOpMiddleware, StateInformationMiddleware};
use governor::nanos::Nanos;
use governor::state::StateStore;
use governor::state::keyed::ShrinkableKeyedStateStore;

use super::throttle::OnceAMinute;
use super::window::Settlement;
use super::{Backend, Decision, Mode, Outcome, QuotaState, ResetFuture};
use crate::quota::QuotaParams;
use window::WindowStore;

mod block;
mod window;
use crate::{BackendError, ConfigError, Key, Policy};
use block::Blocks;

/// The governor crate this backend is built on, for its clocks ([`Clock`],
/// [`FakeRelativeClock`] in tests) without matching its version by hand.
pub use governor;
pub use governor::clock::{Clock, FakeRelativeClock, MonotonicClock, Reference};

type Limiter<C> = RateLimiter<Key, Store, Stamped<C>, StateInformationMiddleware>;

/// The backend's clock as its governor limiters see it: nanoseconds since the backend's origin,
/// each reading also kept for the thread that made it, so that the decision governor just made
/// is reported (its reset, its wait) from the same reading, without reading the clock and
/// converting its time again.
#[derive(Clone)]
struct Stamped<C: Clock> {
    clock: C,
    origin: C::Instant,
}

impl<C: Clock> Clock for Stamped<C> {
    type Instant = Nanos;

    #[inline]
    fn now(&self) -> Nanos {
        let now = self.clock.now().duration_since(self.origin);
        LAST_NOW.set(now.as_u64());
        now
    }
}

/// The in-process GCRA backend. Cheap to clone: clones share their buckets.
///
/// See the [module docs](self) for what it guarantees.
pub struct LocalBackend<C: Clock = MonotonicClock> {
    inner: Arc<Inner<C>>,
}

impl<C: Clock> Clone for LocalBackend<C> {
    fn clone(&self) -> Self {
        LocalBackend {
            inner: self.inner.clone(),
        }
    }
}

impl<C: Clock> fmt::Debug for LocalBackend<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBackend")
            .field("tracked_keys", &self.tracked_keys())
            .field("max_keys", &self.inner.max_keys)
            .field("when_full", &self.inner.when_full)
            .field("sweep_interval", &self.inner.sweep_interval)
            .finish()
    }
}

struct Inner<C: Clock> {
    clock: C,
    max_keys: usize,
    when_full: WhenFull,
    /// New keys turned away (or let through) because the table was full, in all.
    full_refusals: AtomicU64,
    /// The count at the last warning, and the warning itself, at most once a minute.
    warned_refusals: AtomicU64,
    warned: OnceAMinute,
    /// Buckets evicted to make room, in all; the count at the last warning, and the warning.
    evicted: AtomicU64,
    warned_evictions: AtomicU64,
    warned_evicting: OnceAMinute,
    sweep_interval: Duration,
    /// Buckets tracked over all stores of this backend.
    tracked: Arc<AtomicUsize>,
    /// Limiters by (policy name, quota index, parameters), so that layers sharing a backend
    /// and a policy name share buckets, as they would in Redis.
    limiters: Mutex<HashMap<LimiterId, Registered<C>>>,
    sweeper_started: AtomicBool,
    /// Nanoseconds (on `clock`) after which a capacity-triggered sweep may run again.
    next_forced_sweep: AtomicU64,
    origin: C::Instant,
    /// The Unix time, in microseconds, at `origin`.
    epoch_us: u64,
}

/// A quota's counters, held weakly so that dropped policies free their buckets: a GCRA
/// limiter, its store and the instant it counts its time from, or a window store.
enum Registered<C: Clock> {
    Gcra(Weak<Limiter<C>>, Weak<StoreMap>, Nanos),
    Window(Weak<WindowStore>),
    /// A policy's blocks (`block_for`), under the policy's name and `BLOCKS`.
    Blocks(Weak<Blocks>),
}

impl<C: Clock> Registered<C> {
    fn is_alive(&self) -> bool {
        match self {
            Registered::Gcra(l, _, _) => l.strong_count() > 0,
            Registered::Window(w) => w.strong_count() > 0,
            Registered::Blocks(b) => b.strong_count() > 0,
        }
    }

    fn upgrade(&self) -> Option<Counter<C>> {
        Some(match self {
            Registered::Gcra(l, s, start) => Counter::Gcra {
                limiter: l.upgrade()?,
                store: s.upgrade()?,
                start: *start,
            },
            Registered::Window(w) => Counter::Window(w.upgrade()?),
            Registered::Blocks(_) => return None,
        })
    }
}

/// The refusal of a key blocked for `left_us` more.
fn blocked<C: Clock>(policy: &LocalPolicy<C>, left_us: u64) -> Decision {
    let params: smallvec::SmallVec<[QuotaParams; 2]> =
        policy.limiters.iter().map(|q| q.params).collect();
    Decision::blocked(&params, Duration::from_micros(left_us))
}

/// The index of a policy's blocks among its registered counters (its quotas are 0..n).
const BLOCKS: usize = usize::MAX;

#[derive(Clone, PartialEq, Eq, Hash)]
struct LimiterId {
    policy: Arc<str>,
    index: usize,
    params: QuotaParams,
}

/// Builds a [`LocalBackend`].
pub struct LocalBackendBuilder<C: Clock = MonotonicClock> {
    clock: C,
    epoch: Option<Duration>,
    max_keys: usize,
    when_full: WhenFull,
    sweep_interval: Duration,
}

impl LocalBackend {
    /// A backend with the default clock, 1 000 000 keys at most and a sweep every 60 s.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Starts configuring a backend.
    pub fn builder() -> LocalBackendBuilder {
        LocalBackendBuilder {
            clock: MonotonicClock,
            epoch: None,
            max_keys: 1_000_000,
            when_full: WhenFull::Deny,
            sweep_interval: Duration::from_secs(60),
        }
    }
}

impl Default for LocalBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> LocalBackendBuilder<C> {
    /// Uses `clock` for time, e.g. governor's `FakeRelativeClock` in tests.
    pub fn clock<C2: Clock>(self, clock: C2) -> LocalBackendBuilder<C2> {
        LocalBackendBuilder {
            clock,
            epoch: self.epoch,
            max_keys: self.max_keys,
            when_full: self.when_full,
            sweep_interval: self.sweep_interval,
        }
    }

    /// The Unix time (since 1970-01-01 UTC) the clock reads when the backend is built; by
    /// default the system's time then. Fixed and sliding windows are aligned to the Unix epoch
    /// of this clock, so that they start at the same instants on every replica (with clocks
    /// in sync) and in Redis: a day's window starts at 00:00 UTC. Tests with a fake clock set
    /// it (e.g. `Duration::ZERO`) to place windows exactly.
    pub fn clock_epoch(mut self, unix_time: Duration) -> Self {
        self.epoch = Some(unix_time);
        self
    }

    /// The most buckets tracked at once, over all quotas (at least 1; 1 000 000 by default): a
    /// bound on memory of about 160 bytes each (a sliding window's bucket counts as one more
    /// for every 16 sub-windows it holds counts in), plus the length of keys longer than 29
    /// bytes. See the [module docs](self) for what happens when the table is full.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// What a new key gets when the table is full and nothing in it can be evicted (it holds
    /// only slots in flight and blocks): denied (the default) or let through unlimited. Keys
    /// already tracked keep their limits either way. Otherwise the least used buckets make
    /// room (see the [module docs](self)).
    pub fn when_full(mut self, action: WhenFull) -> Self {
        self.when_full = action;
        self
    }

    /// How often idle buckets are evicted.
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every.max(Duration::from_millis(10));
        self
    }

    /// Builds the backend.
    pub fn build(self) -> LocalBackend<C> {
        let origin = self.clock.now();
        let epoch = self.epoch.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
        });
        LocalBackend {
            inner: Arc::new(Inner {
                clock: self.clock,
                max_keys: self.max_keys,
                when_full: self.when_full,
                full_refusals: AtomicU64::new(0),
                warned_refusals: AtomicU64::new(0),
                warned: OnceAMinute::default(),
                evicted: AtomicU64::new(0),
                warned_evictions: AtomicU64::new(0),
                warned_evicting: OnceAMinute::default(),
                sweep_interval: self.sweep_interval,
                tracked: Arc::new(AtomicUsize::new(0)),
                limiters: Mutex::new(HashMap::new()),
                sweeper_started: AtomicBool::new(false),
                next_forced_sweep: AtomicU64::new(0),
                origin,
                epoch_us: u64::try_from(epoch.as_micros()).unwrap_or(u64::MAX),
            }),
        }
    }
}

impl<C: Clock> LocalBackend<C> {
    /// How many buckets are tracked now, over all quotas.
    pub fn tracked_keys(&self) -> usize {
        self.inner.tracked.load(Ordering::Relaxed)
    }

    /// How many requests of new keys found the table full with nothing to evict (and were
    /// denied or let through, as [`when_full`](LocalBackendBuilder::when_full) says), since
    /// the backend was built.
    pub fn full_table_refusals(&self) -> u64 {
        self.inner.full_refusals.load(Ordering::Relaxed)
    }

    /// How many buckets were evicted to make room for new keys in a full table, since the
    /// backend was built (see [`max_keys`](LocalBackendBuilder::max_keys)), in the cap's
    /// units: a sliding window's bucket that held counts in many sub-windows counts as the
    /// several it took of the cap.
    pub fn evicted_keys(&self) -> u64 {
        self.inner.evicted.load(Ordering::Relaxed)
    }
}

impl<C: Clock + Send + Sync + 'static> LocalBackend<C>
where
    C::Instant: Send + Sync,
{
    /// Evicts every bucket that is full again (indistinguishable from a fresh one). The
    /// backend does this by itself every `sweep_interval`; call it to force one.
    pub fn sweep(&self) {
        self.inner.sweep();
    }

    fn start_sweeper(&self) {
        if self.inner.sweeper_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            // No runtime yet: try again when the next policy is prepared. Until then the
            // capacity check still sweeps when the table is full.
            self.inner.sweeper_started.store(false, Ordering::Release);
            return;
        };
        let weak = Arc::downgrade(&self.inner);
        let every = self.inner.sweep_interval;
        handle.spawn(async move {
            // If the runtime shuts down (or the task ends), let the next `prepare` start a
            // sweeper on whatever runtime it runs in.
            let _restart = RestartSweeper(weak.clone());
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                // Stop when the backend is gone.
                let Some(inner) = weak.upgrade() else { break };
                inner.sweep();
            }
        });
    }
}

struct RestartSweeper<C: Clock>(Weak<Inner<C>>);

impl<C: Clock> Drop for RestartSweeper<C> {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.sweeper_started.store(false, Ordering::Release);
        }
    }
}

impl<C: Clock> Inner<C> {
    fn sweep(&self) {
        let (limiters, blocks): (Vec<Counter<C>>, Vec<Arc<Blocks>>) = {
            let mut map = self.limiters.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, r| r.is_alive());
            let blocks = map.values().filter_map(|r| match r {
                Registered::Blocks(b) => b.upgrade(),
                _ => None,
            });
            let blocks = blocks.collect();
            (
                map.values().filter_map(Registered::upgrade).collect(),
                blocks,
            )
        };
        let now_us = self.now_us();
        for blocks in blocks {
            blocks.sweep(now_us);
        }
        for counter in limiters {
            match counter {
                Counter::Gcra { limiter, .. } => {
                    limiter.retain_recent();
                    limiter.shrink_to_fit();
                }
                Counter::Window(store) => store.sweep(now_us),
            }
        }
    }

    /// Microseconds since the Unix epoch, on this backend's clock: windows start at the same
    /// instants here as on every other replica and in Redis.
    fn now_us(&self) -> u64 {
        self.us_at(self.elapsed_ns())
    }

    /// [`now_us`](Self::now_us) at `elapsed_ns` after the origin.
    fn us_at(&self, elapsed_ns: u64) -> u64 {
        self.epoch_us.saturating_add(elapsed_ns / 1000)
    }

    fn elapsed_ns(&self) -> u64 {
        self.clock.now().duration_since(self.origin).as_u64()
    }

    /// Called when the table is full: sweep now, at most once a second, off the request
    /// path when a Tokio runtime is there to run it.
    fn sweep_when_full(self: &Arc<Self>)
    where
        C: Send + Sync + 'static,
        C::Instant: Send + Sync,
    {
        let now = self.elapsed_ns();
        let next = self.next_forced_sweep.load(Ordering::Relaxed);
        let due = now >= next
            && self
                .next_forced_sweep
                .compare_exchange(
                    next,
                    now + 1_000_000_000,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok();
        if due {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    let inner = self.clone();
                    handle.spawn_blocking(move || inner.sweep());
                }
                Err(_) => self.sweep(),
            }
        }
    }
}

/// A prepared policy for the [`LocalBackend`]: one governor limiter per quota.
pub struct LocalPolicy<C: Clock = MonotonicClock> {
    limiters: Vec<PreparedQuota<C>>,
    /// Whether window quotas are checked before any quota is charged and charged last (a
    /// policy of several quotas with a window among them).
    windows: bool,
    /// The quotas' indices in the order they are charged: GCRA quotas first when `windows`.
    order: Box<[usize]>,
    /// The smallest burst: a request costing more can never pass.
    min_burst: u32,
    /// The policy's blocks, when it has `block_for`.
    blocks: Option<Arc<Blocks>>,
    /// The quotas whose refusals start a block, a bit each; 0 for all of them.
    block_mask: u64,
}

struct PreparedQuota<C: Clock> {
    params: QuotaParams,
    counter: Counter<C>,
}

/// Where a quota counts: a governor GCRA limiter, or window counters.
enum Counter<C: Clock> {
    Gcra {
        limiter: Arc<Limiter<C>>,
        store: Arc<StoreMap>,
        /// The instant governor counts the stored times from (its clock reading when the
        /// limiter was made), so that times computed here are governor's exactly: a refund
        /// clamped at now leaves a bucket full now, not a moment later.
        start: Nanos,
    },
    Window(Arc<WindowStore>),
}

impl<C: Clock> fmt::Debug for LocalPolicy<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalPolicy")
            .field("quotas", &self.limiters.len())
            .finish()
    }
}

impl<C> Backend for LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    type Policy = LocalPolicy<C>;
    type Future = Ready<Result<Decision, BackendError>>;

    fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<LocalPolicy<C>, ConfigError> {
        self.start_sweeper();
        let mut map = self
            .inner
            .limiters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let limiters = params
            .iter()
            .enumerate()
            .map(|(index, p)| {
                let id = LimiterId {
                    policy: policy.name().into(),
                    index,
                    params: *p,
                };
                if let Some(counter) = map.get(&id).and_then(Registered::upgrade) {
                    return Ok(PreparedQuota {
                        params: *p,
                        counter,
                    });
                }
                if let Some(store) = WindowStore::new(*p, self.inner.tracked.clone()) {
                    let store = Arc::new(store);
                    map.insert(id, Registered::Window(Arc::downgrade(&store)));
                    return Ok(PreparedQuota {
                        params: *p,
                        counter: Counter::Window(store),
                    });
                }
                let quota = governor::Quota::with_period(p.emission_interval())
                    .ok_or_else(|| ConfigError::Invalid {
                        option: "quota",
                        reason: "zero emission interval".to_owned(),
                    })?
                    .allow_burst(p.burst);
                let store = Arc::new(StoreMap {
                    map: DashMap::with_hasher(RandomState::default()),
                    tracked: self.inner.tracked.clone(),
                });
                let clock = Stamped {
                    clock: self.inner.clock.clone(),
                    origin: self.inner.origin,
                };
                let limiter = RateLimiter::<Key, Store, Stamped<C>, NoOpMiddleware<Nanos>>::new(
                    quota,
                    Store(store.clone()),
                    clock,
                );
                // The instant governor counts its stored times from: `new` reads the clock
                // once, and the reading is kept for this thread (see `Stamped`).
                let start = Nanos::from(LAST_NOW.get());
                let limiter = Arc::new(limiter.with_middleware::<StateInformationMiddleware>());
                map.insert(
                    id,
                    Registered::Gcra(Arc::downgrade(&limiter), Arc::downgrade(&store), start),
                );
                Ok(PreparedQuota {
                    params: *p,
                    counter: Counter::Gcra {
                        limiter,
                        store,
                        start,
                    },
                })
            })
            .collect::<Result<_, ConfigError>>()?;
        let limiters: Vec<PreparedQuota<C>> = limiters;
        let is_window = |q: &PreparedQuota<C>| matches!(q.counter, Counter::Window(_));
        let windows = limiters.len() > 1 && limiters.iter().any(is_window);
        let mut order: Vec<usize> = (0..limiters.len()).collect();
        if windows {
            // Stable: GCRA quotas first, then windows, each in policy order.
            order.sort_by_key(|&i| is_window(&limiters[i]));
        }
        // A concurrent quota takes one slot whatever the cost.
        let min_burst = (limiters.iter())
            .filter(|q| !q.params.is_concurrent())
            .map(|q| q.params.burst.get())
            .min()
            .unwrap_or(u32::MAX);
        let blocks = policy.block().map(|block| {
            let block_us = u64::try_from(block.as_micros()).unwrap_or(u64::MAX);
            let id = LimiterId {
                policy: policy.name().into(),
                index: BLOCKS,
                params: QuotaParams::gcra(block_us.max(1), NonZeroU32::MIN),
            };
            if let Some(Registered::Blocks(b)) = map.get(&id)
                && let Some(blocks) = b.upgrade()
            {
                return blocks;
            }
            let blocks = Arc::new(Blocks::new(block_us, self.inner.tracked.clone()));
            map.insert(id, Registered::Blocks(Arc::downgrade(&blocks)));
            blocks
        });
        Ok(LocalPolicy {
            limiters,
            windows,
            order: order.into_boxed_slice(),
            min_burst,
            blocks,
            block_mask: policy.block_mask(),
        })
    }

    /// The backend's own clock (an injected one in tests).
    fn now_ns(&self) -> u64 {
        self.inner.elapsed_ns()
    }

    /// This backend and its clones: `local@<address>`.
    fn store_id(&self) -> Option<String> {
        Some(format!("local@{:p}", Arc::as_ptr(&self.inner)))
    }

    fn decide(&self, policy: &LocalPolicy<C>, key: &Key, cost: NonZeroU32) -> Self::Future {
        self.decide_holding(policy, key, cost, false)
    }

    fn decide_with(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> Self::Future {
        match mode {
            Mode::Decide => self.decide(policy, key, cost),
            // The local backend's slots need no lease: a request's end gives its slot back.
            Mode::Hold { .. } => self.decide_holding(policy, key, cost, true),
            Mode::Peek => match &policy.blocks {
                None => ready(Ok(self.peek(policy, key, cost))),
                Some(blocks) => ready(Ok(self.blocking(policy, blocks, key, cost, false, || {
                    self.peek(policy, key, cost)
                }))),
            },
            Mode::Reserve { max_wait } => {
                if !self.inner.sweeper_started.load(Ordering::Relaxed) {
                    self.start_sweeper();
                }
                ready(Ok(match &policy.blocks {
                    None => self.reserve(policy, key, cost, max_wait),
                    Some(blocks) => self.blocking(policy, blocks, key, cost, true, || {
                        self.reserve(policy, key, cost, max_wait)
                    }),
                }))
            }
            Mode::Refund { .. } | Mode::Debit => ready(Ok(self.settle(policy, key, cost, mode))),
            Mode::Release { .. } => ready(Ok(self.release(policy, key))),
        }
    }

    fn reset(&self, policy: &LocalPolicy<C>, key: &Key) -> ResetFuture {
        for quota in &policy.limiters {
            match &quota.counter {
                Counter::Gcra { store, .. } => {
                    if store.map.remove(key).is_some() {
                        track_sub(&store.tracked, 1);
                    }
                }
                Counter::Window(store) => store.remove(key),
            }
        }
        if let Some(blocks) = &policy.blocks {
            blocks.remove(key);
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

impl<C> LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    /// A decision ([`Mode::Decide`]), taking a slot of every concurrent quota when `hold`
    /// ([`Mode::Hold`]; without it a concurrent quota is only checked).
    #[inline]
    fn decide_holding(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        hold: bool,
    ) -> Ready<Result<Decision, BackendError>> {
        ready(Ok(match &policy.blocks {
            None => self.decide_now(policy, key, cost, hold),
            Some(blocks) => self.blocking(policy, blocks, key, cost, true, || {
                self.decide_now(policy, key, cost, hold)
            }),
        }))
    }

    /// A decision (`decide`) on a policy with a penalty: a blocked key is refused until its
    /// block ends (a peek, `starts: false`, says so too); a refusal starts a block, unless the
    /// decision only peeks.
    #[inline(never)]
    fn blocking(
        &self,
        policy: &LocalPolicy<C>,
        blocks: &Blocks,
        key: &Key,
        cost: NonZeroU32,
        starts: bool,
        decide: impl FnOnce() -> Decision,
    ) -> Decision {
        let now_us = self.inner.now_us();
        if let Some(left) = blocks.left(key, now_us) {
            return blocked(policy, left);
        }
        let decision = decide();
        if !starts {
            return decision;
        }
        self.penalize(policy, blocks, key, cost, decision, now_us)
    }

    /// `decision`, or a block from `now_us` when it refused the request: not when the request
    /// can never fit (its cost, not its rate, is at fault), nor when the key table is full and
    /// nothing can be evicted to make room for the block.
    fn penalize(
        &self,
        policy: &LocalPolicy<C>,
        blocks: &Blocks,
        key: &Key,
        cost: NonZeroU32,
        decision: Decision,
        now_us: u64,
    ) -> Decision {
        let inner = &self.inner;
        let full = || inner.tracked.load(Ordering::Relaxed) >= inner.max_keys;
        if decision.is_allowed()
            || decision.never_fits()
            || !self.refused_by_a_blocking_quota(policy, &decision, key, cost, now_us)
            || (full() && (!inner.evict(1) || full()))
        {
            return decision;
        }
        blocked(policy, blocks.start(key, now_us))
    }

    /// Whether a quota that blocks (`Quota::block_for`) refuses the request `decision`
    /// refused: the quota that refused it, or another one the decision did not get to (it
    /// stops at the first refusal), asked now. Every quota blocks when the block is the
    /// policy's.
    fn refused_by_a_blocking_quota(
        &self,
        policy: &LocalPolicy<C>,
        decision: &Decision,
        key: &Key,
        cost: NonZeroU32,
        now_us: u64,
    ) -> bool {
        let mask = policy.block_mask;
        let blocks = |i: usize| Policy::blocks_on(mask, i);
        let denied = |s: &QuotaState| matches!(s.outcome, Outcome::Denied { .. });
        if decision
            .quotas()
            .iter()
            .any(|s| denied(s) && blocks(s.index))
        {
            return true;
        }
        (policy.limiters.iter().enumerate())
            .filter(|(i, q)| {
                blocks(*i)
                    && !decision.quotas().iter().any(|s| s.index == *i)
                    && !q.params.is_concurrent()
            })
            .any(|(i, q)| denied(&q.would(i, key, cost, &self.inner, now_us)))
    }

    // Always inlined: a policy without a penalty decides here, from `decide` (where `hold` is
    // known), as before penalties came; the one other caller is the penalty's cold path.
    #[inline(always)]
    fn decide_now(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        hold: bool,
    ) -> Decision {
        if !self.inner.sweeper_started.load(Ordering::Relaxed) {
            // Built outside a runtime: start sweeping from the first request inside one.
            self.start_sweeper();
        }
        // Refusals that need no bucket come first, before any bucket is charged: a request
        // that can never fit, or a new key when the table is full, must not use up the
        // earlier quotas of a multi-quota policy.
        match self.refuse_before_charging(policy, key, cost) {
            None => {}
            Some(Refusal::Deny(refused)) => return Decision::new([refused]),
            // Untracked, so unlimited: a decision without quota states carries no headers.
            Some(Refusal::Allow) => return Decision::new([]),
        }
        let inner = &*self.inner;
        // One reading of the time for every window quota of the decision.
        let now_us = std::cell::OnceCell::new();
        let now_us = || *now_us.get_or_init(|| inner.now_us());
        // Window quotas are this crate's own counters: in a policy of several quotas, a
        // request one of them refuses is refused before any quota is charged. They are then
        // charged last, after the GCRA quotas (which governor cannot test without charging).
        if policy.windows {
            for (index, quota) in policy.limiters.iter().enumerate() {
                if let Counter::Window(store) = &quota.counter {
                    let state = store.check(index, key, now_us(), cost);
                    if state.outcome != Outcome::Allowed {
                        return Decision::new([state]);
                    }
                }
            }
        }
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for &index in &policy.order {
            let Some(quota) = policy.limiters.get(index) else {
                continue;
            };
            let params = &quota.params;
            let state = match &quota.counter {
                Counter::Window(store) => store.decide(index, key, now_us(), cost, hold),
                Counter::Gcra { limiter, start, .. } => match limiter.check_key_n(key, cost) {
                    Ok(Ok(snapshot)) => {
                        // The bucket's new arrival time, as the store just wrote it.
                        let tat = LAST_TAT.get();
                        let mut state =
                            QuotaState::allowed(index, params, until(*start, tat, LAST_NOW.get()));
                        // governor's count is exact; ours may be one more right at a boundary.
                        state.remaining = snapshot.remaining_burst_capacity().min(state.limit);
                        state
                    }
                    Ok(Err(not_until)) => QuotaState::denied(
                        index,
                        params,
                        cost,
                        not_until.wait_time_from(Nanos::from(LAST_NOW.get())),
                    ),
                    Err(_insufficient) => quota.peek(index, key, inner),
                },
            };
            if state.outcome != Outcome::Allowed {
                // All or nothing: what the quotas before this one took goes back.
                if !states.is_empty() {
                    let added = |i: usize| match policy.limiters.get(i) {
                        Some(q) if matches!(q.counter, Counter::Gcra { .. }) => {
                            q.params.emission_ns.saturating_mul(u64::from(cost.get()))
                        }
                        _ => u64::from(cost.get()),
                    };
                    self.undo(policy, key, &states, hold, added, now_us);
                }
                // Reported alone: the states of the quotas before it no longer hold.
                return Decision::new([state]);
            }
            states.push(state);
        }
        // Reported in policy order.
        if policy.windows {
            states.sort_unstable_by_key(|s| s.index);
        }
        Decision::from_states(states)
    }
}

impl<C> LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    /// What `decide` would answer now, changing nothing: every quota in order, up to the first
    /// that refuses.
    fn peek(&self, policy: &LocalPolicy<C>, key: &Key, cost: NonZeroU32) -> Decision {
        let inner = &*self.inner;
        // As `decide`: a quota the cost can never fit answers alone.
        if let Some((index, quota)) =
            (policy.limiters.iter().enumerate()).find(|(_, quota)| quota.never_fits(cost))
        {
            return Decision::new([quota.peek(index, key, inner)]);
        }
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for (index, quota) in policy.limiters.iter().enumerate() {
            let state = quota.would(index, key, cost, inner, inner.now_us());
            let stop = state.outcome != Outcome::Allowed;
            states.push(state);
            if stop {
                break;
            }
        }
        Decision::from_states(states)
    }

    /// A reservation (see [`Mode::Reserve`]): window quotas must have room now; GCRA quotas
    /// take the cost if it fits within `max_wait`, counted as of the time the request goes on
    /// (the longest wait over them). The waits are worked out first from the buckets as they
    /// are, then each bucket is charged by compare-and-swap, checking its wait again: a
    /// reservation on a bucket another request changed meanwhile waits for it too (and is
    /// refused if that is beyond `max_wait`, what it took from the quotas before given back).
    /// In that race, the quotas charged before the wait grew were charged as of the earlier
    /// time: a request after it may pass them up to that difference early.
    fn reserve(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        max_wait: Duration,
    ) -> Decision {
        match self.refuse_before_charging(policy, key, cost) {
            None => {}
            Some(Refusal::Deny(refused)) => return Decision::new([refused]),
            Some(Refusal::Allow) => return Decision::new([]),
        }
        let inner = &*self.inner;
        let now_us = inner.now_us();
        // A window quota cannot count a request into a window that has not begun: a policy
        // with one reserves only what every quota has now.
        let windows = (policy.limiters.iter()).any(|q| matches!(q.counter, Counter::Window(_)));
        let max_wait = if windows {
            0
        } else {
            Mode::Reserve { max_wait }.max_wait_ns()
        };
        // Windows first: they cannot count into a window that has not begun.
        let mut wait = 0u64;
        for (index, quota) in policy.limiters.iter().enumerate() {
            match &quota.counter {
                Counter::Window(store) => {
                    let state = store.check(index, key, now_us, cost);
                    if state.outcome != Outcome::Allowed {
                        return Decision::new([state]);
                    }
                }
                Counter::Gcra { store, start, .. } => {
                    let tat = store.tat(key);
                    let rel = until(*start, tat, inner.elapsed_ns());
                    let w = gcra_wait(&quota.params, cost, rel);
                    if w > max_wait {
                        return Decision::new([gcra_state(
                            index,
                            &quota.params,
                            cost,
                            rel,
                            Duration::ZERO,
                        )]);
                    }
                    wait = wait.max(w);
                }
            }
        }
        let mut steps = smallvec::SmallVec::<[(usize, u64); 2]>::new();
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for (index, quota) in policy.limiters.iter().enumerate() {
            let state = match &quota.counter {
                Counter::Window(store) => store.decide(index, key, now_us, cost, false),
                Counter::Gcra { store, start, .. } => {
                    let p = &quota.params;
                    let now = inner.elapsed_ns().saturating_sub(start.as_u64());
                    let step = p.emission_ns.saturating_mul(u64::from(cost.get()));
                    let longest = std::cell::Cell::new(wait);
                    let bucket = entry(&store.map, key, &store.tracked, || AtomicU64::new(0));
                    let charged = measure(&bucket, |tat| {
                        let tat = tat.map_or(0, |t| t.as_u64());
                        let w = gcra_wait(p, cost, Duration::from_nanos(tat.saturating_sub(now)));
                        let w = w.max(wait);
                        if w > max_wait {
                            return Err(w);
                        }
                        longest.set(w);
                        let next = tat.max(now.saturating_add(w)).saturating_add(step);
                        Ok(((next, next - tat), Nanos::from(next.max(1))))
                    });
                    match charged {
                        Ok((next, added)) => {
                            wait = longest.get();
                            steps.push((index, added));
                            QuotaState::allowed(
                                index,
                                p,
                                Duration::from_nanos(next.saturating_sub(now)),
                            )
                        }
                        Err(w) => QuotaState::denied(index, p, cost, Duration::from_nanos(w)),
                    }
                }
            };
            if state.outcome != Outcome::Allowed {
                // All or nothing: what the quotas before this one took goes back (a bucket
                // what this reservation added to it, its wait included).
                if !states.is_empty() {
                    let added = |i| {
                        let gcra = steps.iter().find(|(at, _)| *at == i);
                        gcra.map_or(u64::from(cost.get()), |s| s.1)
                    };
                    self.undo(policy, key, &states, false, added, || now_us);
                }
                return Decision::new([state]);
            }
            states.push(state);
        }
        Decision::from_states(states).after(Duration::from_nanos(wait))
    }

    /// The state of the first quota that refuses `cost` on `key` without looking at its
    /// bucket: one the cost can never fit (governor's `t * (cost - 1)` would also overflow
    /// for huge costs), or, when the buckets `key` still lacks would not fit in the table,
    /// the first quota lacking one.
    #[inline]
    fn refuse_before_charging(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
    ) -> Option<Refusal> {
        let inner = &self.inner;
        let quotas = policy.limiters.len();
        // Only near the cap is it worth looking the key up before charging.
        if cost.get() <= policy.min_burst
            && inner.tracked.load(Ordering::Relaxed).saturating_add(quotas) <= inner.max_keys
        {
            return None;
        }
        self.refuse_before_charging_slow(policy, key, cost)
    }

    /// [`refuse_before_charging`](Self::refuse_before_charging), for a request that can never
    /// fit or a table near its cap.
    #[cold]
    fn refuse_before_charging_slow(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
    ) -> Option<Refusal> {
        if let Some((index, quota)) =
            (policy.limiters.iter().enumerate()).find(|(_, quota)| quota.never_fits(cost))
        {
            return Some(Refusal::Deny(quota.peek(index, key, &self.inner)));
        }
        let inner = &self.inner;
        let quotas = policy.limiters.len();
        if inner.tracked.load(Ordering::Relaxed).saturating_add(quotas) <= inner.max_keys {
            return None;
        }
        let mut lacking =
            (policy.limiters.iter().enumerate()).filter(|(_, quota)| !quota.counter.contains(key));
        let (first, quota) = lacking.next()?;
        let needed = 1 + lacking.count();
        let overflows =
            || inner.tracked.load(Ordering::Relaxed).saturating_add(needed) > inner.max_keys;
        if !overflows() {
            return None;
        }
        inner.sweep_when_full();
        // Other requests evict and insert at the same time: the room one eviction makes may
        // be taken before this request uses it, so try again a few times.
        for _ in 0..4 {
            if !overflows() {
                return None;
            }
            if !inner.evict(needed) && inner.evictable() == 0 {
                break;
            }
        }
        if !overflows() {
            return None;
        }
        inner.count_full_refusal();
        Some(match inner.when_full {
            WhenFull::Deny => Refusal::Deny(QuotaState::denied(
                first,
                &quota.params,
                cost,
                Duration::from_secs(1),
            )),
            WhenFull::Allow => Refusal::Allow,
        })
    }
}

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
enum Refusal {
    Deny(QuotaState),
    Allow,
}

impl<C: Clock> Inner<C> {
    /// Makes room for `needed` more buckets in a full table by evicting the least used ones
    /// of the quota holding the most: about an eighth of them, those that used no more than
    /// the lightest eighth of a sample (see [`evict_lightest`]).
    /// Slots in flight and blocks are never evicted. Returns whether it evicted anything.
    #[cold]
    fn evict(&self, needed: usize) -> bool {
        let counters: Vec<Counter<C>> = {
            let map = self.limiters.lock().unwrap_or_else(|p| p.into_inner());
            map.values().filter_map(Registered::upgrade).collect()
        };
        let mut by_size: Vec<(usize, &Counter<C>)> =
            counters.iter().map(|c| (c.evictable(), c)).collect();
        by_size.sort_unstable_by_key(|(len, _)| std::cmp::Reverse(*len));
        let mut evicted = 0;
        for (len, counter) in by_size {
            if evicted >= needed || len == 0 {
                break;
            }
            evicted += match counter {
                Counter::Gcra { store, start, .. } => {
                    let now = self.elapsed_ns().saturating_sub(start.as_u64());
                    store.evict(needed - evicted.min(needed), now)
                }
                Counter::Window(store) => store.evict(needed - evicted.min(needed), self.now_us()),
            };
        }
        if evicted > 0 {
            self.count_evictions(evicted);
        }
        evicted > 0
    }

    /// How many buckets could be evicted now (all but slots in flight and blocks).
    fn evictable(&self) -> usize {
        let map = self.limiters.lock().unwrap_or_else(|p| p.into_inner());
        (map.values().filter_map(Registered::upgrade))
            .map(|c| c.evictable())
            .sum()
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
    fn count_full_refusal(&self) {
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

/// The wait of a request of `cost` on a GCRA bucket whose theoretical arrival time is `tat`
/// from now: it fits when `tat + T × (cost − burst) ≤ 0` (the Redis script's test).
fn gcra_wait(p: &QuotaParams, cost: NonZeroU32, tat: Duration) -> u64 {
    let t = u128::from(p.emission_ns);
    let tat = tat.as_nanos();
    let w = (tat + t * u128::from(cost.get())).saturating_sub(t * u128::from(p.burst.get()));
    u64::try_from(w).unwrap_or(u64::MAX)
}

/// What a decision of `cost` on a GCRA bucket whose theoretical arrival time is `tat` from now
/// would answer: allowed (the TAT after it), or denied with its wait.
impl<C> LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    /// Gives back what a decision took from the quotas of `charged` (their states, allowed)
    /// before a later quota refused it, so that a refused request takes nothing: units back to
    /// every GCRA bucket and window (into the window they were counted in), and the slot of a
    /// concurrent quota when the decision held one. Each give-back is an atomic step of its
    /// own: a request racing this one may see the units taken for the few instructions between
    /// the charge and the give-back (and be refused for it), never the other way round.
    #[cold]
    #[inline(never)]
    fn undo(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        charged: &[QuotaState],
        hold: bool,
        added: impl Fn(usize) -> u64,
        now_us: impl Fn() -> u64,
    ) {
        for state in charged {
            let Some(quota) = policy.limiters.get(state.index) else {
                continue;
            };
            match &quota.counter {
                Counter::Gcra { store, start, .. } => {
                    let at = self.inner.elapsed_ns().saturating_sub(start.as_u64());
                    give_back(store, key, added(state.index), at);
                }
                Counter::Window(store) if quota.params.is_concurrent() => {
                    if hold {
                        store.release(state.index, key);
                    }
                }
                Counter::Window(store) => {
                    let now_us = now_us();
                    let refund = Settlement::Refund {
                        units: u32::try_from(added(state.index)).unwrap_or(u32::MAX),
                        admitted_us: now_us,
                    };
                    store.settle(state.index, key, now_us, refund);
                }
            }
        }
    }

    /// A request's end ([`Mode::Release`]): its slot back in every concurrent quota of `policy`.
    fn release(&self, policy: &LocalPolicy<C>, key: &Key) -> Decision {
        let states = policy.limiters.iter().enumerate();
        Decision::new(states.filter_map(|(index, quota)| match &quota.counter {
            Counter::Window(store) => store.release(index, key),
            Counter::Gcra { .. } => None,
        }))
    }

    /// A settlement ([`Mode::Refund`] or [`Mode::Debit`]) of `cost` units on every quota of
    /// `policy` that counts units (not requests in flight, whose state is reported as it is).
    fn settle(&self, policy: &LocalPolicy<C>, key: &Key, cost: NonZeroU32, mode: Mode) -> Decision {
        let inner = &*self.inner;
        let now = inner.elapsed_ns();
        let now_us = inner.us_at(now);
        let admitted_ago = match mode {
            Mode::Refund { admitted_ago } => Some(admitted_ago),
            _ => None,
        };
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for (index, quota) in policy.limiters.iter().enumerate() {
            let p = &quota.params;
            let state = match &quota.counter {
                Counter::Window(store) => {
                    let settlement = match admitted_ago {
                        Some(ago) => Settlement::Refund {
                            units: cost.get(),
                            admitted_us: now_us
                                .saturating_sub(u64::try_from(ago.as_micros()).unwrap_or(u64::MAX)),
                        },
                        None => Settlement::Debit(cost.get()),
                    };
                    store.settle(index, key, now_us, settlement)
                }
                Counter::Gcra { store, start, .. } => {
                    let step = p.emission_ns.saturating_mul(u64::from(cost.get()));
                    // The limiter's time, never later than governor's (see `start`).
                    let at = now.saturating_sub(start.as_u64());
                    let settled = match admitted_ago {
                        // A key without a bucket is full: nothing to give back. A bucket
                        // never fills past full (an arrival time before now).
                        Some(_) => give_back(store, key, step, at),
                        None => {
                            let tat = entry(&store.map, key, &store.tracked, || AtomicU64::new(0));
                            swap(&tat, |tat| {
                                let next = tat.max(at).saturating_add(step);
                                (next, next)
                            })
                        }
                    };
                    QuotaState::allowed(index, p, until(*start, settled, now))
                }
            };
            states.push(state);
        }
        Decision::from_states(states)
    }
}

/// Takes `step` nanoseconds off `key`'s GCRA arrival time, never below `at` (the limiter's
/// time now: a bucket never fills past full); returns the arrival time after it. A key without
/// a bucket is full: nothing to give back.
fn give_back(store: &StoreMap, key: &Key, step: u64, at: u64) -> u64 {
    store.map.get(key).map_or(0, |tat| {
        swap(&tat, |tat| {
            let next = tat.saturating_sub(step).max(at);
            (next, next)
        })
    })
}

/// Replaces `cell`'s value with the one `f` makes of it, atomically (compare-and-swap, again
/// if another thread changed it meanwhile); returns what `f` returned with it. Nothing is
/// written when the value stays the same.
fn swap<R>(cell: &AtomicU64, mut f: impl FnMut(u64) -> (R, u64)) -> R {
    let mut prev = cell.load(Ordering::Acquire);
    loop {
        let (result, next) = f(prev);
        if next == prev {
            return result;
        }
        match cell.compare_exchange_weak(prev, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return result,
            Err(actual) => prev = actual,
        }
    }
}

/// `key`'s entry in `map`, made (and counted in `tracked`) on its first request.
fn entry<'a, V>(
    map: &'a DashMap<Key, V, RandomState>,
    key: &Key,
    tracked: &AtomicUsize,
    fresh: impl FnOnce() -> V,
) -> dashmap::mapref::one::Ref<'a, Key, V> {
    if let Some(v) = map.get(key) {
        return v;
    }
    match map.entry(key.clone()) {
        Entry::Occupied(e) => e.into_ref().downgrade(),
        Entry::Vacant(e) => {
            track_add(tracked, 1);
            e.insert(fresh()).downgrade()
        }
    }
}

fn gcra_state(
    index: usize,
    p: &QuotaParams,
    cost: NonZeroU32,
    tat: Duration,
    _: Duration,
) -> QuotaState {
    let w = gcra_wait(p, cost, tat);
    if w == 0 {
        let step = Duration::from_nanos(p.emission_ns.saturating_mul(u64::from(cost.get())));
        QuotaState::allowed(index, p, tat.saturating_add(step))
    } else {
        QuotaState::denied(index, p, cost, Duration::from_nanos(w))
    }
}

/// How far from `now` (nanoseconds since the backend's origin) a theoretical arrival time `tat`
/// (governor's nanoseconds since the limiter's `start`) lies: zero when passed.
fn until(start: Nanos, tat: u64, now: u64) -> Duration {
    let elapsed = now.saturating_sub(start.as_u64());
    Duration::from_nanos(tat.saturating_sub(elapsed))
}

impl<C: Clock> PreparedQuota<C> {
    /// Whether a request of `cost` can never pass this quota: it exceeds the burst (a
    /// concurrent quota takes one slot whatever the cost).
    #[inline]
    fn never_fits(&self, cost: NonZeroU32) -> bool {
        cost > self.params.burst && !self.params.is_concurrent()
    }

    /// The state of `key`'s bucket or window for a request that can never fit it, read
    /// without changing anything.
    /// What this quota would say of `cost` now (windows at `now_us`), changing nothing.
    fn would(
        &self,
        index: usize,
        key: &Key,
        cost: NonZeroU32,
        inner: &Inner<C>,
        now_us: u64,
    ) -> QuotaState {
        match &self.counter {
            Counter::Window(store) => store.would(index, key, now_us, cost),
            Counter::Gcra { store, start, .. } => {
                let tat = store.tat(key);
                let rel = until(*start, tat, inner.elapsed_ns());
                gcra_state(index, &self.params, cost, rel, Duration::ZERO)
            }
        }
    }

    fn peek(&self, index: usize, key: &Key, inner: &Inner<C>) -> QuotaState {
        match &self.counter {
            Counter::Gcra { store, start, .. } => {
                let tat = store.tat(key);
                QuotaState::never_fits(index, &self.params, until(*start, tat, inner.elapsed_ns()))
            }
            Counter::Window(store) => store.peek(index, key, inner.now_us()),
        }
    }
}

impl<C: Clock> Counter<C> {
    /// How many of its buckets could be evicted (a concurrent quota's: none).
    fn evictable(&self) -> usize {
        match self {
            Counter::Gcra { store, .. } => store.map.len(),
            Counter::Window(store) if store.holds_slots() => 0,
            Counter::Window(store) => store.len(),
        }
    }

    /// Whether `key` has a bucket or counter here.
    fn contains(&self, key: &Key) -> bool {
        match self {
            Counter::Gcra { store, .. } => store.map.contains_key(key),
            Counter::Window(store) => store.contains(key),
        }
    }
}

/// Counts `n` more tracked buckets (and in the `tollgate_local_tracked_keys` gauge).
fn track_add(tracked: &AtomicUsize, n: usize) {
    tracked.fetch_add(n, Ordering::Relaxed);
    crate::metrics::tracked_keys(n as f64);
}

/// Counts `n` fewer tracked buckets.
fn track_sub(tracked: &AtomicUsize, n: usize) {
    if n > 0 {
        tracked.fetch_sub(n, Ordering::Relaxed);
        crate::metrics::tracked_keys(-(n as f64));
    }
}

thread_local! {
    /// The arrival time the store last wrote on this thread: governor reports remaining units,
    /// not the time, and `decide` reads it right after the check it made on this thread.
    static LAST_TAT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The time a limiter last read on this thread ([`Stamped`]), in nanoseconds since the
    /// backend's origin: the `now` of the decision `decide` just had governor make.
    static LAST_NOW: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Governor state store: one atomic theoretical arrival time per key, counted against the
/// backend's key cap.
struct Store(Arc<StoreMap>);

struct StoreMap {
    map: DashMap<Key, AtomicU64, RandomState>,
    tracked: Arc<AtomicUsize>,
}

impl StoreMap {
    /// `key`'s arrival time, 0 (full) without a bucket.
    fn tat(&self, key: &Key) -> u64 {
        self.map
            .get(key)
            .map_or(0, |tat| tat.load(Ordering::Acquire))
    }

    /// Evicts about an eighth of the buckets (`needed` at least), the least used (their
    /// arrival times nearest `now`, the limiter's time); returns how many it evicted.
    fn evict(&self, needed: usize, now: u64) -> usize {
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

fn measure<T, E>(
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
        measure(
            &entry(&self.0.map, key, &self.0.tracked, || AtomicU64::new(0)),
            f,
        )
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
