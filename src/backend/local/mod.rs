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
mod cap;
mod decide;
mod give_back;
mod peek;
mod store;
mod window;

use crate::{BackendError, ConfigError, Key, Policy};
use block::Blocks;
pub use cap::WhenFull;
use cap::{Refusal, track_add, track_sub};
use decide::{entry, gcra_state, gcra_wait, swap, until};
use store::{LAST_NOW, LAST_TAT, Store, StoreMap, evict_lightest, measure};

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
    /// A concurrent quota's stores, one per version of its values, sharing one slot map:
    /// while any lives, a new version shares its slots.
    Slots(Vec<Weak<WindowStore>>),
    /// A policy's blocks (`block_for`), under the policy's name and `BLOCKS`.
    Blocks(Weak<Blocks>),
}

impl<C: Clock> Registered<C> {
    fn is_alive(&self) -> bool {
        match self {
            Registered::Gcra(l, _, _) => l.strong_count() > 0,
            Registered::Window(w) => w.strong_count() > 0,
            Registered::Slots(versions) => versions.iter().any(|w| w.strong_count() > 0),
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
            Registered::Slots(versions) => {
                Counter::Window((versions.iter().filter_map(Weak::upgrade)).max_by_key(|s| s.seq)?)
            }
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

/// The identity of a policy's blocks among its registered counters (no quota's: those are
/// digits, or a name after `-`).
const BLOCKS: &str = "blocks";

/// A quota's counters in the registry: the policy's name, the quota's identity in it
/// (`Policy::quota_id`) and its values. A concurrent quota's slots and a policy's blocks are
/// registered without values: every version of the policy shares them.
#[derive(Clone, PartialEq, Eq, Hash)]
struct LimiterId {
    policy: Arc<str>,
    quota: Box<str>,
    params: Option<QuotaParams>,
}

/// The order stores are made in, for a changed quota to find its latest earlier store.
static STORE_SEQ: AtomicU64 = AtomicU64::new(0);

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
                Counter::Gcra { limiter, store, .. } => {
                    limiter.retain_recent();
                    limiter.shrink_to_fit();
                    store.sweep_earlier(self.elapsed_ns());
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

impl<C> LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    /// The counter of quota `index` of `policy`: the one registered for the same policy,
    /// quota and values (layers sharing a backend and a policy share buckets, as they would in
    /// Redis), or a new one that inherits the keys of the quota's latest store under other
    /// values of the same algorithm (see [`OnChange`](crate::quota::OnChange)); a concurrent
    /// quota's slots are shared by all its versions.
    fn quota_counter(
        &self,
        map: &mut HashMap<LimiterId, Registered<C>>,
        policy: &Policy,
        index: usize,
        p: &QuotaParams,
    ) -> Result<PreparedQuota<C>, ConfigError> {
        let quota: Box<str> = policy.quota_id(index).into();
        let concurrent = p.is_concurrent();
        let id = LimiterId {
            policy: policy.name().into(),
            quota: quota.clone(),
            params: (!concurrent).then_some(*p),
        };
        let registered = map.get(&id).and_then(Registered::upgrade);
        let seq = STORE_SEQ.fetch_add(1, Ordering::Relaxed);
        if concurrent {
            let store = match registered {
                Some(Counter::Window(store)) if store.params() == p => store,
                Some(Counter::Window(store)) => {
                    Arc::new(store.sharing_slots(*p, seq).unwrap_or_else(
                        // Registered under a concurrent quota's id: always slots.
                        || unreachable_slots(*p, self.inner.tracked.clone(), seq),
                    ))
                }
                _ => Arc::new(unreachable_slots(*p, self.inner.tracked.clone(), seq)),
            };
            let mut versions = match map.remove(&id) {
                Some(Registered::Slots(versions)) => versions,
                _ => Vec::new(),
            };
            versions.retain(|w| w.strong_count() > 0);
            if !versions
                .iter()
                .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&store)))
            {
                versions.push(Arc::downgrade(&store));
            }
            map.insert(id, Registered::Slots(versions));
            return Ok(PreparedQuota {
                params: *p,
                counter: Counter::Window(store),
            });
        }
        // The latest store of this quota under any values of the same algorithm.
        let same_kind = |other: &QuotaParams| {
            std::mem::discriminant(&other.kind) == std::mem::discriminant(&p.kind)
        };
        let seq_of = |c: &Counter<C>| match c {
            Counter::Gcra { store, .. } => store.seq,
            Counter::Window(store) => store.seq,
        };
        let latest = (map.iter())
            .filter(|(k, _)| k.policy == id.policy && k.quota == quota)
            .filter(|(k, _)| k.params.as_ref().is_some_and(same_kind))
            .filter_map(|(_, r)| r.upgrade())
            .max_by_key(seq_of);
        // The registered store of these values, unless a later one holds the keys (a change
        // back to earlier values starts a new store that inherits from the latest).
        if let Some(counter) = registered
            && latest
                .as_ref()
                .is_none_or(|l| seq_of(l) <= seq_of(&counter))
        {
            return Ok(PreparedQuota {
                params: *p,
                counter,
            });
        }
        let on_change = policy.change_strategy();
        if let Some(store) = WindowStore::new(*p, self.inner.tracked.clone(), seq) {
            if let Some(Counter::Window(from)) = latest {
                store
                    .earlier
                    .store(Some(Arc::new(store::Earlier { from, on_change })));
            }
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
        let store = StoreMap::new(
            self.inner.tracked.clone(),
            (p.emission_ns, p.burst.get()),
            seq,
        );
        if let Some(Counter::Gcra { store: from, .. }) = latest {
            store
                .earlier
                .store(Some(Arc::new(store::Earlier { from, on_change })));
        }
        let store = Arc::new(store);
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
        store.start.store(start.as_u64(), Ordering::Relaxed);
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
    }
}

/// A concurrent quota's new slot store.
fn unreachable_slots(p: QuotaParams, tracked: Arc<AtomicUsize>, seq: u64) -> WindowStore {
    // `new` makes a store for every kind but GCRA, and `p` is a concurrent quota's.
    WindowStore::new(p, tracked, seq).unwrap_or_else(|| unreachable!("a concurrent quota's store"))
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
            .map(|(index, p)| self.quota_counter(&mut map, policy, index, p))
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
            // Blocks are the policy's whatever their length: a running block stays when the
            // length changes, and new ones last the new length.
            let id = LimiterId {
                policy: policy.name().into(),
                quota: BLOCKS.into(),
                params: None,
            };
            if let Some(Registered::Blocks(b)) = map.get(&id)
                && let Some(blocks) = b.upgrade()
            {
                blocks.set_length(block_us);
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

    /// The Unix time its windows are counted on: the clock's epoch and its time since.
    fn unix_time(&self) -> Duration {
        Duration::from_micros(self.inner.now_us())
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
            // Here and under the quota's earlier values: a key reset right after a change
            // must not inherit what it used before.
            match &quota.counter {
                Counter::Gcra { store, .. } => store.remove(key),
                Counter::Window(store) => store.remove(key),
            }
        }
        if let Some(blocks) = &policy.blocks {
            blocks.remove(key);
        }
        Box::pin(std::future::ready(Ok(())))
    }
}
