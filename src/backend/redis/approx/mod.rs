//! The approximate mode: decisions made in this process, from window counts kept in step with
//! Redis, so that no denied request touches the network (and, in the asynchronous variant, no
//! request at all).
//!
//! The exact [`RedisBackend`](super::RedisBackend) asks Redis for every decision: one round trip
//! per request, the price of a limit no fleet can overshoot. This mode trades a bounded
//! over-admission for near-local speed. Each instance keeps, per key and window quota, the
//! counts of the window's sub-windows: the fleet's counts as Redis last told them, plus its own
//! units Redis has not confirmed yet. It decides from those counts with the same window
//! arithmetic as every other backend (`docs/algorithms.md`), then:
//!
//! - **[`Approximate::synchronous`]**: an allowed request goes on once its units are added to
//!   the Redis counter of its sub-window (`INCRBY`), and the reply (the fleet's count of that
//!   sub-window) refreshes the instance's view. The background task sends at once, one
//!   pipeline for every request queued meanwhile (one `INCRBY` per key and sub-window,
//!   however many requests), and the requests go on when it is answered, or after the
//!   timeout, or at once when the call fails. Denied requests never touch the network, except
//!   that requests on a key the instance has not read yet, or not since before the last
//!   sub-window, wait for one read of its counts first (so such a request may wait twice the
//!   timeout).
//! - **[`Approximate::asynchronous`]**: nothing waits. Allowed units are queued and sent in
//!   batches ([`flush_every`](Approximate::flush_every), or sooner once
//!   [`flush_after`](Approximate::flush_after) units are queued), in pipelines of 256 keys;
//!   an admission that leaves a quota less than half of its limit has the batch sent at
//!   once (and so does a key's first request, for its read), so that near the limit, where
//!   the others' units matter, instances hear of each other within a round trip. Keys far
//!   from their limits, most keys most of the time, keep the batching.
//!
//! In both, the counts of a key are read from Redis (`MGET` of its sub-windows) when the
//! instance first sees the key, when it comes back to it after a whole sub-window without it,
//! and again in every sub-window it is used in, once the
//! *settle time* has passed into the sub-window (the [timeout](super::RedisBackendBuilder::timeout), plus
//! the flush interval in the asynchronous variant, at most half a sub-window): by then the
//! increments other instances made at the end of the last sub-window have landed.
//!
//! Only window quotas can be counted this way: [fixed](crate::Quota::fixed_window) and
//! [sliding](crate::Quota::sliding_window) windows, whose
//! [resolution](crate::Quota::resolution) is the sub-window. A policy with a GCRA quota is
//! refused when the layer is built (`"10/s burst 20"` can be written `"20/2s sliding 100ms"`).
//!
//! # Concurrent quotas
//!
//! A slot cannot be approximate: a policy's concurrent quotas ([`Quota::concurrent`]) are
//! decided at the store, by the exact backend ([`RedisBackend`](super::RedisBackend), built from
//! the same builder, on a connection of its own made when a policy first has one), with leases
//! and releases as in the exact mode; the policy's window quotas stay approximate. A request
//! is decided by its windows first, here; when they allow it, its slot is asked at the store
//! (a round trip, in both variants), and when the slot refuses, what the windows took is given
//! back and the refusal is the slot's. A failing Redis answers the slot by the exact backend's
//! failure policy ([`on_failure`](super::RedisBackendBuilder::on_failure), by default
//! the local fallback at the instance's share).
//!
//! [`Quota::concurrent`]: crate::Quota::concurrent
//!
//! Penalties (`Policy::block_for`, `Quota::block_for`) mean what they mean on every store: a
//! refusal by a quota that blocks blocks the key, and every request on it is refused until the
//! block ends, whatever its cost or mode. The instance that starts a block refuses at once,
//! writes it to Redis with its next flush (`SET <prefix>:{<policy>:<key>}:blk <end> PX <left>
//! NX`: a running block is not extended, and it expires with itself) and, with allowances on,
//! announces the key; the others find the block with their next read of the key (before their
//! first decision on it in the synchronous variant, a flush after it in the asynchronous one)
//! and refuse until it ends. Block ends are times on the instances' clocks (keep them in
//! sync, as for the windows).
//!
//! Settlements after the response (`Policy::charge_when`, `Policy::cost_from`, a `Limiter`'s
//! `Permit::settle`) go into the counts, with the meaning they have on every store: a debit
//! counts more units into the current sub-window, past the limit into debt; a refund gives
//! back units this instance counted into the sub-window of their admission, if it is still in
//! the window: units not sent yet are not sent, units Redis counts are taken off the view at
//! once and off Redis's counter by the next flush (`INCRBY` by a negative number, with the
//! counter's expiry). While that decrement is in flight the view counts the units again
//! (denying early, never admitting more), as increments in flight do. A refund never gives
//! back more than this instance counted in that sub-window; a counter Redis lost (a restart)
//! may go below zero by what was refunded, which reads as zero.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::backend::Backend;
//! use tollgate::backend::redis::{Approximate, RedisBackend};
//! use tollgate::{Key, Policy, Quota, RateLimitLayer, key::ClientIp};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::builder()
//!     .url("redis://127.0.0.1:1") // nothing listens here: decisions go on regardless
//!     .build_approximate(Approximate::asynchronous().flush_every(Duration::from_millis(5)))?;
//! // 600 a minute, counted in sub-windows of 5 s.
//! let policy = Policy::new(
//!     "api",
//!     Quota::per_minute(600).sliding_window().resolution(Duration::from_secs(5)),
//! );
//! let prepared = backend.prepare(&policy, &policy.validate()?)?;
//! let alice = Key::from_bytes("alice")?;
//! let one = std::num::NonZeroU32::MIN;
//! // Decided in this process, at once, from the counts it holds.
//! let decision = backend.decide(&prepared, &alice, one).await?;
//! assert!(decision.is_allowed());
//! assert_eq!(decision.quotas()[0].remaining, 599);
//!
//! // In a layer, like any backend.
//! let layer = RateLimitLayer::builder()
//!     .policy(policy)
//!     .key(ClientIp::new())
//!     .backend(backend)
//!     .build()?;
//! # drop(layer);
//! # Ok(()) }
//! ```
//!
//! # How far over the limit a fleet can go
//!
//! `N` instances share a limit of `L` units per window `W`, counted in sub-windows of `r`. An
//! instance counts its own units at once, and another instance's units once it hears of them:
//! through a read (at most `r + settle` after they were admitted, if it keeps deciding on the
//! key) or, in the synchronous variant, through the reply to any of its own increments. Call
//! `D` that delay (`r + settle`, plus the flush interval `f` in the asynchronous variant).
//!
//! - **Always** (any traffic, Redis up or down, even when Redis loses its data): every
//!   instance admits at most `L` in any window by its own count (a read never lowers what it
//!   counts of its own units), so a fleet admits at most **`N × L`** per window.
//! - **Staleness bound**: an instance admits only when what it has heard of, plus its own
//!   units, leaves room; what it has not heard of is what the others admitted in the last `D`.
//!   So the count of any window never exceeds **`L + A`**, where `A` is what the *other*
//!   instances admitted in the `D` before the decision, once the instance has read the key.
//!   (The asynchronous variant decides a key new to it from its own counts until its first
//!   read returns, a flush later: in those milliseconds only the `N × L` bound holds. The
//!   synchronous variant reads first.) Under a sustained overload spread
//!   over the fleet, what frees up in `D` is about `L × D / W`, and each instance can spend it
//!   before hearing of the others: over-admission about **`(N − 1) × L × D / W`**, that is
//!   `(N − 1) × L × (1/k + settle/W)` with `k = W / r` sub-windows. A minute with 5 s
//!   sub-windows and 4 instances: about 25 % in the worst spread; 1 s sub-windows, 5 %.
//!   The synchronous variant does better than this in practice: each of its increments
//!   brings back the fleet's count of the current sub-window.
//! - **False denials**: the view only counts too much while increments are in flight (their
//!   units are in `mine` until the reply) or when a call that timed out had reached Redis and
//!   is sent again: at most the units of calls in flight or lost. Otherwise an instance denies
//!   only what exact mode, counting the same units, would deny.
//!
//! The measurements (`tests/redis_approx.rs`, BENCHMARKS.md) drive several instances over the
//! limit and check every window's count against these bounds.
//!
//! Windows are aligned to the Unix epoch of each instance's clock: instances whose clocks
//! disagree by `δ` count a request into different sub-windows for `δ` around each boundary.
//! Keep clocks synchronized (NTP) well within a sub-window.
//!
//! # Allowances
//!
//! With many keys, most far below their limits, each key sees less than one request per
//! flush, and keeping every key in step would cost Redis about a command per request. An
//! instance that admits no more of a key than its part of the limit cannot push the fleet
//! over it, whatever the others do, and needs Redis only to go further. So each instance
//! holds, per key and window quota, an **allowance**: `⌊f × L / N⌋` units, with `N` the
//! fleet's size as counted (each instance announces itself in `<prefix>:fleet` every second,
//! as for the [local fallback](crate::backend::remote::Fleet); or
//! `Fleet::Size`) and `f` the
//! [`allowance`](Approximate::allowance) share (½ for the asynchronous variant, 0 for the
//! synchronous one).
//!
//! - **Within its allowance** a key is *quiet* on this instance: it is decided from the counts
//!   held (its own units, and the fleet's if it read them before) and nothing is sent or read.
//!   A key this instance's units keep within `⌊f × L / N⌋` costs Redis nothing.
//! - **Past it**, the instance *announces* the key (`XADD` to the stream `<prefix>:hot`, with
//!   the next flush), sends the units it holds and keeps the key in step as described above,
//!   for a window; then it takes an allowance again if its units are back within it, or
//!   announces the key again.
//! - Every instance holding keys reads the announcements every 100 ms (`XREAD`, one command
//!   for all keys). A key announced is kept in step for a window: an instance holding it quiet
//!   sends its units with its next decision on it, and reads the fleet's counts; a key new to
//!   it starts in step.
//! - Before the fleet is counted (an announced fleet, in its first milliseconds or with Redis
//!   down from the start), and while announcements cannot be read or sent (before the first
//!   read, a Redis before 5.0 without streams, a user without `XADD` or `XREAD`: logged as a
//!   warning), there is no allowance: every key is kept in step, as with `allowance(0.0)`.
//!
//! What this adds to the bounds above: units the *other* instances admitted within their
//! allowances and had not sent when the decision was made, at most each one's allowance.
//!
//! - **Always**: `N × L` per window, as before: each instance still admits at most `L` by its
//!   own count.
//! - **All instances quiet on a key** (the common case): the fleet admits at most
//!   `N × ⌊f × L / N⌋ ≤ f × L`, within the limit, without Redis.
//! - **Staleness bound**: after any admission the window's count is at most
//!   **`L + A + Q`**, `Q` the units the other instances hold unsent within their allowances:
//!   at most `Σ ⌊f × L / Nⱼ⌋ ≤ (N − 1) × ⌊f × L / N⌋` over the others, each counting `Nⱼ`
//!   instances. An instance that reads the key's announcement sends its units at its next
//!   decision on the key, so `Q` lasts until then; it only persists for instances that stopped
//!   deciding on the key (and admit nothing more of it).
//! - **A fleet that grows while it runs**: an instance that has not counted the newcomers yet
//!   keeps the larger allowance of the smaller fleet (`Nⱼ` above is what each instance counts).
//!   Newcomers are counted within a second (the announcement interval): until then the quiet
//!   units of a key may reach `f × L × N / N_before` (twice as many instances: `2 f × L`,
//!   the limit with the default `f = ½`).
//!
//! The stream keeps about 100 000 announcements and expires two windows after its last one;
//! an instance that falls further behind misses some (those keys are then quiet on it until
//! announced again). Allowances need the commands `EVAL`, `TIME`, `ZADD`, `ZREMRANGEBYSCORE`,
//! `ZCARD`, `PEXPIRE` (the fleet's count), `XADD` and `XREAD` (docs/redis.md has the ACL).
//! [`ApproxStats`] counts allowances granted, exhausted (the key announced) and recalled (by
//! another instance's announcement), and the announcements sent and read.
//!
//! # When Redis fails
//!
//! Decisions go on from the counts held: an instance then counts the others' units only as far
//! as it heard of them, so the fleet tends to `N × L` per window while Redis is away. Units
//! admitted meanwhile are kept and sent once Redis answers again (the circuit breaker of
//! [`circuit_breaker`](super::RedisBackendBuilder::circuit_breaker) stops the attempts in
//! between; only the background task probes), and the counts are read afresh. In the
//! synchronous variant a request waits at most the timeout (twice on a key not read yet), and
//! none waits while the breaker is open. The failure policy does not apply: there is always a
//! local answer. When Redis comes back without the counters (a restart without persistence, a
//! failover), each instance keeps counting its own units, and a counter found gone gets its
//! expiry set again.
//!
//! # Memory
//!
//! One entry per key in use: about 340 bytes for a key seen once, with its key and table
//! overhead, at any resolution (`cargo bench --bench memory --features redis`), plus 40 bytes
//! for each further sub-window with numbers in it (counted here, read from Redis, or owed to
//! it), and its Redis key name once the key is sent or read, or looked up while keys are
//! announced. (It was 28.5 KB per key at a thousand sub-windows, when every sub-window of the
//! window was held.) Entries
//! whose windows have passed are swept every second, also while Redis is down, and about
//! [`max_keys`](Approximate::max_keys) are held at most (1 000 000 by default; concurrent
//! inserts may overshoot by a few). While that many are held, a request on a new key is
//! decided through Redis, as the synchronous variant decides, and its counts are not kept:
//! the key's counts are read, the request decided from them, and when allowed its increment
//! is waited for, a round trip or two per request (at most the timeout each), and a sweep is
//! started (at most every 100 ms). A flood of new keys so neither keeps new clients out nor
//! lets them through unlimited; keys held keep their counts. Only when Redis cannot be asked
//! (the circuit breaker open, or the read failing) is such a request denied for a second
//! ([`ApproxStats::refused_full`]). Each counter in
//! Redis expires once every window holding its sub-window has passed, plus 2 s: its first
//! increment from each instance carries a `PEXPIRE`.

use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use foldhash::quality::RandomState;
use smallvec::SmallVec;

use super::conn::Conn;
use crate::backend::remote::{Fleet, MemoryState, MemoryWatch, Options, TestClock, keys};
use crate::backend::throttle::OnceAMinute;
use crate::backend::window::Code;
use crate::backend::{Backend, Decision, Mode, ResetFuture};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind, ConfigError, Key, Policy};

mod announce;
mod counts;
mod flush;
mod slots;

use slots::Slots;

use counts::{Counts, Spec};

/// Shards of a policy's key table (a power of two).
const ENTRY_SHARDS: usize = 256;

/// How the approximate mode keeps its counts in step with Redis; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Approximate {
    writes: Writes,
    flush_every: Duration,
    flush_after: usize,
    max_keys: usize,
    /// The part of its share an instance admits per key without telling Redis, in thousandths.
    allowance: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writes {
    Sync,
    Async,
}

impl Approximate {
    /// Allowed requests add their units to Redis before they go on (one round trip each);
    /// denied ones never touch the network.
    pub fn synchronous() -> Self {
        Approximate {
            writes: Writes::Sync,
            flush_every: Duration::from_millis(5),
            flush_after: 1024,
            max_keys: 1_000_000,
            allowance: 0,
        }
    }

    /// No request waits on the network: allowed units are sent in batches, every
    /// [`flush_every`](Self::flush_every) (5 ms by default) or once
    /// [`flush_after`](Self::flush_after) units (1 024) are queued; and each key far from its
    /// limit is admitted within an [allowance](Self::allowance) of half this instance's share
    /// without telling Redis at all.
    pub fn asynchronous() -> Self {
        Approximate {
            writes: Writes::Async,
            allowance: 500,
            ..Self::synchronous()
        }
    }

    /// The part of its share of each limit that an instance admits per key and window without
    /// telling Redis: `share` × limit / instances, rounded down, with the instances counted by
    /// the [fleet](super::RedisBackendBuilder::fleet). `share` is between 0 and 1: `0.5` for
    /// [`asynchronous`](Self::asynchronous), `0` (every admitted unit is sent) for
    /// [`synchronous`](Self::synchronous).
    ///
    /// A key whose units on this instance stay within its allowance costs Redis nothing. One
    /// that goes past it is announced to the other instances, which send what they admitted of
    /// it, and is kept in step as without allowances for a window. See the
    /// [module docs](self#allowances) for the bound this adds.
    pub fn allowance(mut self, share: f64) -> Self {
        let share = if share.is_nan() {
            0.0
        } else {
            share.clamp(0.0, 1.0)
        };
        self.allowance = (share * 1000.0).round() as u16;
        self
    }

    /// How long queued work waits to be sent with more (at least 1 ms, at most 10 s): the
    /// asynchronous variant's increments, and both variants' reads and resent units.
    pub fn flush_every(mut self, every: Duration) -> Self {
        self.flush_every = every.clamp(Duration::from_millis(1), Duration::from_secs(10));
        self
    }

    /// How many queued units send a batch before [`flush_every`](Self::flush_every) has
    /// passed (at least 1).
    pub fn flush_after(mut self, units: usize) -> Self {
        self.flush_after = units.max(1);
        self
    }

    /// How many keys (summed over policies) the instance holds counts for, at most (1 000 000
    /// by default; at least 1; concurrent inserts may overshoot by a few). While the table is
    /// full, a request on a new key is decided through Redis without its counts being kept
    /// (read, decided, its increment waited for: counted in [`ApproxStats::overflowed`]), and
    /// a sweep starts (at most every 100 ms); keys already held keep their counts. While Redis
    /// cannot be asked, such a request is denied (`Retry-After: 1`, counted in
    /// [`ApproxStats::refused_full`]). Keys come from clients: this bounds the memory a flood
    /// of new keys can take, without keeping new clients out.
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys.max(1);
        self
    }

    /// Whether allowed requests wait for their increment.
    pub fn is_synchronous(&self) -> bool {
        self.writes == Writes::Sync
    }
}

/// Counters of an [`ApproxBackend`], from [`ApproxBackend::stats`], since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ApproxStats {
    /// Calls to Redis (pipelines: a flush, a request's increment, a first read).
    pub calls: u64,
    /// Of those, calls that failed or timed out.
    pub failed_calls: u64,
    /// Units Redis confirmed adding.
    pub units_sent: u64,
    /// Units Redis refused to add (its memory full, a key of another type in the way): still
    /// counted by the instance that admitted them, never by the others.
    pub units_refused: u64,
    /// Keys whose counts were read.
    pub reads: u64,
    /// Whether the circuit breaker is open (only the background task tries Redis).
    pub breaker_open: bool,
    /// How many times the circuit breaker opened.
    pub breaker_trips: u64,
    /// Keys this instance holds counts for now.
    pub keys: usize,
    /// Redis's memory in use as the memory watch last read it
    /// ([`watch_memory`](super::RedisBackendBuilder::watch_memory)); 0 before the first read.
    pub memory_used: u64,
    /// Redis's `maxmemory` (0: none), as last read.
    pub memory_max: u64,
    /// Keys Redis evicted since the first read (counts of rate limits lost).
    pub evicted_keys: u64,
    /// Requests on new keys denied because [`max_keys`](Approximate::max_keys) were held while
    /// Redis could not be asked (the circuit breaker open).
    pub refused_full: u64,
    /// Requests on new keys decided through Redis, a round trip each, because
    /// [`max_keys`](Approximate::max_keys) were held.
    pub overflowed: u64,
    /// How many instances share the limits, as this one counts them (0 before the first count
    /// of an [announced](crate::backend::remote::Fleet::Announced) fleet: no allowances then).
    pub fleet_size: u32,
    /// Allowances taken: a key this instance admits without telling Redis, until it uses its
    /// allowance up or another instance announces it.
    pub allowances_granted: u64,
    /// Allowances used up: the key was announced, and its units sent.
    pub allowances_exhausted: u64,
    /// Allowances given back because another instance announced the key.
    pub allowances_recalled: u64,
    /// Keys this instance announced to the others, as Redis took them in (one announcement per
    /// key and window at most).
    pub announced: u64,
    /// Announcements of other instances (and this one's own) read.
    pub announcements_read: u64,
}

/// The approximate Redis mode, as a [`Backend`]: built by
/// [`RedisBackendBuilder::build_approximate`](super::RedisBackendBuilder::build_approximate).
/// Cheap to clone: clones share counts, connection and background task.
///
/// See the [module docs](self) for what it guarantees.
#[derive(Clone)]
pub struct ApproxBackend {
    shared: Arc<Shared>,
}

/// A policy prepared for an [`ApproxBackend`]: its window quotas, and the counts of its keys.
#[derive(Clone)]
pub struct ApproxPolicy {
    inner: Arc<PolicyShared>,
    /// The policy's concurrent quotas, decided at the store by the exact backend.
    slots: Option<Arc<Slots>>,
}

impl fmt::Debug for ApproxPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApproxPolicy")
            .field("name", &self.inner.name)
            .field("quotas", &self.inner.specs.len())
            .field("keys", &self.inner.entries.len())
            .finish()
    }
}

pub(crate) struct PolicyShared {
    name: String,
    specs: Box<[Spec]>,
    /// The longest of its windows, in µs: how long an announced key stays in step.
    window_us: u64,
    /// `<prefix>:{<policy>:`
    key_prefix: Vec<u8>,
    entries: DashMap<Key, Held, RandomState>,
    /// The backend's count of keys held, which this policy's keys leave when it is dropped.
    held: Arc<AtomicUsize>,
    /// Every quota of the policy, its concurrent ones included (a blocked key's refusal lists
    /// them all).
    all_params: Box<[QuotaParams]>,
    /// How long a refusal blocks the key, in µs (`Policy::block_for`, `Quota::block_for`); 0
    /// for no block.
    block_us: u64,
    /// The quotas whose refusals start a block, a bit each; 0 for all of them.
    block_mask: u64,
}

impl Drop for PolicyShared {
    fn drop(&mut self) {
        self.held.fetch_sub(self.entries.len(), Ordering::Relaxed);
        crate::metrics::approx_keys(-(self.entries.len() as f64));
    }
}

impl PolicyShared {
    /// The refusal of a key blocked for `left_us` more.
    fn blocked(&self, left_us: u64) -> Decision {
        Decision::blocked(&self.all_params, std::time::Duration::from_micros(left_us))
    }

    /// Whether a refusal with these `codes` (one per quota) starts a block: a quota that
    /// blocks refused (not because the cost can never fit it).
    fn blocks(&self, codes: &[Code]) -> bool {
        (self.specs.iter().zip(codes))
            .any(|(spec, code)| *code == Code::Denied && self.blocks_on(spec.index))
    }

    /// Whether a refusal by quota `index` (of the whole policy) starts a block.
    fn blocks_on(&self, index: usize) -> bool {
        self.block_us > 0 && Policy::blocks_on(self.block_mask, index)
    }

    /// When (µs) every count of a key decided at `now_us` will have left its windows: the
    /// earliest a sweep may forget it, if nothing else happens to it.
    fn idle_at(&self, now_us: u64) -> u64 {
        self.specs
            .iter()
            .map(|spec| (spec.slice_at(now_us) + spec.kept as u64).saturating_mul(spec.slice_us))
            .max()
            .unwrap_or(0)
    }
}

/// A key's entry as its policy's table holds it.
pub(crate) struct Held {
    entry: Arc<Entry>,
    /// Until when (µs) the key surely has counts in a window ([`PolicyShared::idle_at`] of
    /// its last decision): a sweep passes it by without reading the entry, which at a million
    /// keys is a cache miss each.
    busy_until_us: AtomicU64,
}

/// One key's counts under one policy.
pub(crate) struct Entry {
    key: Key,
    /// `<prefix>:{<policy>:<key>}:`, the hash-tagged start of its Redis keys, and its hash (to
    /// look it up among the keys announced by other instances): made the first time the key
    /// is sent, read or looked up among announcements (which a quiet key is only while some
    /// key of the fleet is announced).
    base: OnceLock<(Box<[u8]>, u64)>,
    state: Mutex<EntryState>,
}

struct EntryState {
    quotas: SmallVec<[Counts; 1]>,
    /// In the queue of the next flush.
    queued: bool,
    /// A read of its counts is on its way.
    reading: bool,
    /// Replies to increments taken in so far: a read during which another was taken in may
    /// be older than the counts held (the two calls may have run in either order).
    confirmations: u64,
    /// Within its allowance: its units are held back, its counts not read.
    quiet: bool,
    /// Until when (µs) the key stays in step: announced by this instance or another.
    hot_until_us: u64,
    /// Until when (µs) the key is blocked (`block_for`), as this instance knows: a block it
    /// started, or one it read from Redis.
    blocked_until_us: u64,
    /// A block this instance started and has not written to Redis yet.
    block_owed: bool,
}

impl EntryState {
    fn new(policy: &PolicyShared) -> Self {
        EntryState {
            quotas: policy.specs.iter().map(Counts::new).collect(),
            queued: false,
            reading: false,
            confirmations: 0,
            quiet: false,
            hot_until_us: 0,
            blocked_until_us: 0,
            block_owed: false,
        }
    }
}

impl Entry {
    fn lock(&self) -> std::sync::MutexGuard<'_, EntryState> {
        // The state is a few counters updated by arithmetic that does not panic: a poisoned
        // lock still holds usable counts.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hash-tagged start of the key's Redis keys, and its hash.
    fn base(&self, policy: &PolicyShared, s: &Shared) -> &(Box<[u8]>, u64) {
        self.base.get_or_init(|| {
            let mut base = Vec::new();
            keys::key_base(&policy.key_prefix, &self.key, &mut base);
            let hash = s.hasher.hash_one(&base[..]);
            (base.into_boxed_slice(), hash)
        })
    }

    /// The Redis key of the key's block (`block_for`): `<prefix>:{<policy>:<key>}:blk`.
    fn block_key(&self, policy: &PolicyShared, s: &Shared) -> Vec<u8> {
        let mut k = self.base(policy, s).0.to_vec();
        k.extend_from_slice(b"blk");
        k
    }

    /// The Redis key of quota `spec`'s sub-window `slice`.
    fn redis_key(&self, policy: &PolicyShared, s: &Shared, spec: &Spec, slice: u64) -> Vec<u8> {
        counter_key(&self.base(policy, s).0, spec, slice)
    }
}

/// The Redis key of quota `spec`'s sub-window `slice` for the key whose keys start with
/// `base` (`<prefix>:{<policy>:<key>}:`).
fn counter_key(base: &[u8], spec: &Spec, slice: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(base.len() + spec.suffix.len() + 21);
    k.extend_from_slice(base);
    k.extend_from_slice(&spec.suffix);
    k.push(b':');
    k.extend_from_slice(itoa::Buffer::new().format(slice).as_bytes());
    k
}

/// Time in µs since the Unix epoch.
enum Now {
    Real { epoch_us: u64, origin: Instant },
    Test(TestClock),
}

impl Now {
    fn us(&self) -> u64 {
        match self {
            Now::Real { epoch_us, origin } => {
                epoch_us + u64::try_from(origin.elapsed().as_micros()).unwrap_or(u64::MAX / 2)
            }
            Now::Test(c) => c.now_ns() / 1000,
        }
    }
}

pub(crate) struct Shared {
    conn: Conn,
    endpoint: String,
    prefix: String,
    opts: Options,
    mode: Approximate,
    now: Now,
    /// Entries with something to send or read, for the next flush.
    dirty: Mutex<Vec<(Arc<PolicyShared>, Arc<Entry>)>>,
    /// Units queued since the last flush.
    queued_units: AtomicUsize,
    wake: Arc<tokio::sync::Notify>,
    policies: Mutex<Vec<Weak<PolicyShared>>>,
    started: AtomicBool,
    /// Flushes begun, and (watched by waiting requests) the newest one answered.
    flushes_started: AtomicU64,
    flushed: tokio::sync::watch::Sender<u64>,
    /// Synchronous requests waiting for a flush: the task then sends at once.
    waiters: AtomicUsize,
    /// One flush at a time (the task's, or [`ApproxBackend::flush`]): flushes are answered in
    /// the order they began, which waiting requests rely on.
    flushing: tokio::sync::Mutex<()>,
    /// An admission left a quota near its limit: the task sends at once.
    urgent: AtomicBool,
    /// Keys held (all policies), requests refused because there were `max_keys`, and whether
    /// the task should sweep at once.
    keys: Arc<AtomicUsize>,
    /// Redis's memory as the watch last read it (see `RedisBackendBuilder::watch_memory`).
    memory: MemoryState,
    /// The exact backend that decides concurrent quotas (its connection made when a policy
    /// first uses it).
    exact: super::RedisBackend,
    refused_full: AtomicU64,
    /// Requests on new keys decided through Redis because `max_keys` were held, and the
    /// warning of it.
    overflowed: AtomicU64,
    full_warned: OnceAMinute,
    sweep_now: AtomicBool,
    /// A sweep runs (on a blocking thread).
    sweeping: AtomicBool,
    /// The memory watch has been started (once: it outlives a restarted flush task).
    memory_watched: AtomicBool,
    // The circuit breaker, on the monotonic clock.
    origin: Instant,
    failures: AtomicU32,
    open_until_ns: AtomicU64,
    trips: AtomicU64,
    // Counters.
    calls: AtomicU64,
    failed_calls: AtomicU64,
    units_sent: AtomicU64,
    units_refused: AtomicU64,
    /// The warning of refused units, at most once a minute.
    refused_warned: OnceAMinute,
    reads: AtomicU64,
    // Allowances.
    /// The fleet's size as counted (0: not yet), and this instance's id in the count.
    fleet_size: AtomicU32,
    fleet_id: u64,
    /// When the next announcement of this instance and poll of the announced keys are due
    /// (monotonic ns).
    next_count_ns: AtomicU64,
    next_poll_ns: AtomicU64,
    /// Keys announced by any instance (`base` hashed), until when they stay in step (µs).
    hot: DashMap<u64, u64, RandomState>,
    hot_keys: AtomicUsize,
    hasher: RandomState,
    /// Keys this instance announces with the next flush: `base`, window (µs).
    marks: Mutex<Vec<(Box<[u8]>, u64)>>,
    /// The last announcement read (a stream id), empty before the first poll.
    cursor: Mutex<String>,
    /// Whether announcements work: the last read of the stream succeeded and the last
    /// announcement sent did not fail. Without them no key is quiet (an instance could not
    /// tell the others to send theirs).
    stream_ok: AtomicBool,
    /// Announcements failed in a row, and when they may be sent again (monotonic ns).
    mark_failures: AtomicU32,
    /// Reads of the announcements failed in a row.
    poll_failures: AtomicU32,
    next_marks_ns: AtomicU64,
    /// The longest window of the policies prepared, in µs.
    longest_window_us: AtomicU64,
    granted: AtomicU64,
    exhausted: AtomicU64,
    recalled: AtomicU64,
    announced: AtomicU64,
    announcements_read: AtomicU64,
}

impl ApproxBackend {
    pub(crate) fn new(
        conn: Conn,
        endpoint: String,
        prefix: String,
        opts: Options,
        mode: Approximate,
        exact: super::RedisBackend,
    ) -> Self {
        let now = match &opts.test_clock {
            Some(c) => Now::Test(c.clone()),
            None => Now::Real {
                epoch_us: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(0)),
                origin: Instant::now(),
            },
        };
        ApproxBackend {
            shared: Arc::new(Shared {
                conn,
                endpoint,
                prefix,
                mode,
                now,
                dirty: Mutex::new(Vec::new()),
                queued_units: AtomicUsize::new(0),
                wake: Arc::new(tokio::sync::Notify::new()),
                policies: Mutex::new(Vec::new()),
                started: AtomicBool::new(false),
                flushes_started: AtomicU64::new(0),
                flushed: tokio::sync::watch::Sender::new(0),
                waiters: AtomicUsize::new(0),
                flushing: tokio::sync::Mutex::new(()),
                urgent: AtomicBool::new(false),
                keys: Arc::new(AtomicUsize::new(0)),
                memory: MemoryState::default(),
                exact,
                refused_full: AtomicU64::new(0),
                overflowed: AtomicU64::new(0),
                full_warned: OnceAMinute::default(),
                sweep_now: AtomicBool::new(false),
                sweeping: AtomicBool::new(false),
                memory_watched: AtomicBool::new(false),
                origin: Instant::now(),
                failures: AtomicU32::new(0),
                open_until_ns: AtomicU64::new(0),
                trips: AtomicU64::new(0),
                calls: AtomicU64::new(0),
                failed_calls: AtomicU64::new(0),
                units_sent: AtomicU64::new(0),
                units_refused: AtomicU64::new(0),
                refused_warned: OnceAMinute::default(),
                reads: AtomicU64::new(0),
                fleet_size: AtomicU32::new(match opts.fleet {
                    Fleet::Size(n) => n.get(),
                    Fleet::Announced { .. } => 0,
                }),
                fleet_id: opts.fleet_id.unwrap_or_else(crate::backend::next_lease),
                next_count_ns: AtomicU64::new(0),
                next_poll_ns: AtomicU64::new(0),
                hot: DashMap::with_hasher(RandomState::default()),
                hot_keys: AtomicUsize::new(0),
                hasher: RandomState::default(),
                marks: Mutex::new(Vec::new()),
                cursor: Mutex::new(String::new()),
                stream_ok: AtomicBool::new(false),
                mark_failures: AtomicU32::new(0),
                poll_failures: AtomicU32::new(0),
                next_marks_ns: AtomicU64::new(0),
                longest_window_us: AtomicU64::new(0),
                granted: AtomicU64::new(0),
                exhausted: AtomicU64::new(0),
                recalled: AtomicU64::new(0),
                announced: AtomicU64::new(0),
                announcements_read: AtomicU64::new(0),
                opts,
            }),
        }
    }

    /// The mode this backend runs in.
    pub fn mode(&self) -> Approximate {
        self.shared.mode
    }

    /// The Redis endpoint, with any password masked.
    pub fn endpoint(&self) -> &str {
        &self.shared.endpoint
    }

    /// The backend's counters.
    pub fn stats(&self) -> ApproxStats {
        let s = &self.shared;
        let keys = s.keys.load(Ordering::Relaxed);
        ApproxStats {
            calls: s.calls.load(Ordering::Relaxed),
            failed_calls: s.failed_calls.load(Ordering::Relaxed),
            units_sent: s.units_sent.load(Ordering::Relaxed),
            units_refused: s.units_refused.load(Ordering::Relaxed),
            reads: s.reads.load(Ordering::Relaxed),
            breaker_open: s.breaker_open(),
            breaker_trips: s.trips.load(Ordering::Relaxed),
            keys,
            memory_used: s.memory.used.load(Ordering::Relaxed),
            memory_max: s.memory.max.load(Ordering::Relaxed),
            evicted_keys: s.memory.evicted.load(Ordering::Relaxed),
            refused_full: s.refused_full.load(Ordering::Relaxed),
            overflowed: s.overflowed.load(Ordering::Relaxed),
            fleet_size: s.fleet_size.load(Ordering::Relaxed),
            allowances_granted: s.granted.load(Ordering::Relaxed),
            allowances_exhausted: s.exhausted.load(Ordering::Relaxed),
            allowances_recalled: s.recalled.load(Ordering::Relaxed),
            announced: s.announced.load(Ordering::Relaxed),
            announcements_read: s.announcements_read.load(Ordering::Relaxed),
        }
    }

    /// Sends what is queued now and reads the counts due, without waiting for the background
    /// task (which does the same every [`flush_every`](Approximate::flush_every)): for tests
    /// that step time by hand, and for a clean shutdown (units admitted since the last flush
    /// reach Redis). Returns once the calls are answered or have failed.
    pub async fn flush(&self) {
        flush::flush(&self.shared, true).await;
    }
}

impl Shared {
    fn now_ns_mono(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The time a key's counts must be into a sub-window before they are read again.
    fn settle_us(&self, spec: &Spec) -> u64 {
        let mut settle = self.opts.timeout;
        if self.mode.writes == Writes::Async {
            settle += self.mode.flush_every;
        }
        u64::try_from(settle.as_micros())
            .unwrap_or(u64::MAX)
            .min(spec.slice_us / 2)
    }

    fn breaker_open(&self) -> bool {
        self.failures.load(Ordering::Relaxed) >= self.opts.breaker_threshold
    }

    /// Whether the background task may call Redis now: the breaker is closed, or its probe is
    /// due.
    fn may_call(&self) -> bool {
        !self.breaker_open() || self.now_ns_mono() >= self.open_until_ns.load(Ordering::Relaxed)
    }

    /// How long until the breaker's probe is due (zero if it is, or the breaker is closed).
    fn until_probe(&self) -> Duration {
        let at = self.open_until_ns.load(Ordering::Relaxed);
        Duration::from_nanos(at.saturating_sub(self.now_ns_mono()))
    }

    fn call_ok(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        crate::metrics::approx_call(true);
        if self.failures.swap(0, Ordering::Relaxed) >= self.opts.breaker_threshold {
            tracing::info!(endpoint = %self.endpoint, "Redis answers again: approximate counts resume syncing");
        }
    }

    fn call_failed(&self, err: &dyn fmt::Display) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.failed_calls.fetch_add(1, Ordering::Relaxed);
        crate::metrics::approx_call(false);
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= self.opts.breaker_threshold {
            let probe = u64::try_from(self.opts.probe_interval.as_nanos()).unwrap_or(u64::MAX);
            self.open_until_ns
                .store(self.now_ns_mono().saturating_add(probe), Ordering::Relaxed);
            // A connection that stopped answering may never recover by itself.
            self.conn.reconnect();
            if failures == self.opts.breaker_threshold {
                self.trips.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(endpoint = %self.endpoint, error = %err,
                    "Redis failing: approximate mode decides from local counts until it answers");
            }
        }
    }

    /// Queues `entry` for the next flush, unless it is already queued.
    fn enqueue(&self, policy: &Arc<PolicyShared>, entry: &Arc<Entry>, st: &mut EntryState) {
        if st.queued {
            return;
        }
        st.queued = true;
        let first = {
            let mut dirty = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
            dirty.push((policy.clone(), entry.clone()));
            dirty.len() == 1
        };
        if first {
            self.wake.notify_one();
        }
    }

    fn start(self: &Arc<Self>) {
        if self.started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self
            .started
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // If the task ends (its runtime shut down), the next decision starts another.
            let restart = Restart(Arc::downgrade(self));
            let wake = self.wake.clone();
            handle.spawn(async move {
                let restart = restart;
                flush::run(restart.0.clone(), wake).await;
            });
            if let Some(every) = self.opts.memory_watch
                && !self.memory_watched.swap(true, Ordering::Relaxed)
            {
                handle.spawn(watch_memory(Arc::downgrade(self), every));
            }
        }
    }
}

/// Reads Redis's memory every `every` until the backend is dropped, as the exact backend does
/// (see `RedisBackendBuilder::watch_memory`).
async fn watch_memory(shared: Weak<Shared>, every: Duration) {
    // If the task ends (its runtime shut down), the next decision starts another.
    struct Unwatched(Weak<Shared>);
    impl Drop for Unwatched {
        fn drop(&mut self) {
            if let Some(s) = self.0.upgrade() {
                s.memory_watched.store(false, Ordering::Relaxed);
            }
        }
    }
    let _unwatched = Unwatched(shared.clone());
    let mut watch = MemoryWatch::default();
    loop {
        tokio::time::sleep(every).await;
        let Some(s) = shared.upgrade() else { return };
        let wait = s.opts.timeout.max(Duration::from_secs(1));
        match tokio::time::timeout(wait, super::backend::read_memory(&s.conn)).await {
            Ok(Ok(memory)) => watch.seen(&memory, &s.memory, "redis", "Redis (approximate mode)"),
            Ok(Err(err)) => watch.unreadable(&err.text, "Redis (approximate mode)"),
            Err(_elapsed) => {}
        }
    }
}

/// Marks the background task as gone when it ends, however it ends.
struct Restart(Weak<Shared>);

impl Drop for Restart {
    fn drop(&mut self) {
        if let Some(s) = self.0.upgrade() {
            s.started.store(false, Ordering::Release);
        }
    }
}

/// Counts a synchronous request waiting for a flush, until it is done or dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl fmt::Debug for ApproxBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApproxBackend")
            .field("endpoint", &self.shared.endpoint)
            .field("prefix", &self.shared.prefix)
            .field("mode", &self.shared.mode)
            .field("timeout", &self.shared.opts.timeout)
            .finish()
    }
}

/// The future of an [`ApproxBackend`] decision: ready at once, except a synchronous
/// variant's allowed request (its increment) and a key's first request there (its read).
pub struct ApproxFuture {
    inner: FutureInner,
}

enum FutureInner {
    Ready(Option<Decision>),
    Waiting(Pin<Box<dyn Future<Output = Decision> + Send>>),
    /// A decision that asks the exact backend too (a policy's concurrent quotas).
    Slots(Pin<Box<dyn Future<Output = Result<Decision, BackendError>> + Send>>),
}

impl ApproxFuture {
    fn slots(f: impl Future<Output = Result<Decision, BackendError>> + Send + 'static) -> Self {
        ApproxFuture {
            inner: FutureInner::Slots(Box::pin(f)),
        }
    }
}

impl fmt::Debug for ApproxFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.inner {
            FutureInner::Ready(_) => "ApproxFuture::Ready",
            FutureInner::Waiting(_) => "ApproxFuture::Waiting",
            FutureInner::Slots(_) => "ApproxFuture::Slots",
        })
    }
}

impl Future for ApproxFuture {
    type Output = Result<Decision, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.inner {
            FutureInner::Ready(d) => match d.take() {
                Some(d) => Poll::Ready(Ok(d)),
                None => Poll::Ready(Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    "decision polled after it completed",
                ))),
            },
            FutureInner::Waiting(f) => f.as_mut().poll(cx).map(Ok),
            FutureInner::Slots(f) => f.as_mut().poll(cx),
        }
    }
}

/// Increments a flush sends for one key: quota, sub-window, units (negative for a refund),
/// and whether the counter's expiry is set with them.
type Increments = SmallVec<[(usize, u64, i64, bool); 2]>;

impl Shared {
    /// Counts `units` Redis refused to add, and whether to warn of it now: the first time,
    /// then at most once a minute.
    pub(crate) fn refused_units(&self, units: u64) -> bool {
        self.units_refused.fetch_add(units, Ordering::Relaxed);
        (self.refused_warned).now(self.now_ns_mono())
    }

    /// Blocks the key of `entry` from `now_us` for the policy's block: here at once, in Redis
    /// with the next flush (where every instance that reads the key finds it), and announced,
    /// so that the others read it soon.
    fn start_block(
        &self,
        policy: &Arc<PolicyShared>,
        entry: &Arc<Entry>,
        st: &mut EntryState,
        now_us: u64,
    ) {
        st.blocked_until_us = now_us.saturating_add(policy.block_us);
        st.block_owed = true;
        if self.mode.allowance > 0 {
            self.mark(policy, entry, st, now_us);
        }
        self.enqueue(policy, entry, st);
    }

    /// Decides from the counts held, counting the units when allowed and queueing them for
    /// the next flush. Returns the decision, and whether it waits for that flush (the
    /// synchronous variant's allowed requests, while Redis answers).
    fn decide_here(
        &self,
        policy: &Arc<PolicyShared>,
        entry: &Arc<Entry>,
        cost: NonZeroU32,
        mode: Mode,
    ) -> (Decision, bool) {
        let now_us = self.now.us();
        let sync = self.mode.writes == Writes::Sync && !self.breaker_open();
        let mut st = entry.lock();
        if st.blocked_until_us > now_us {
            return (policy.blocked(st.blocked_until_us - now_us), false);
        }
        let mut codes: SmallVec<[Code; 2]> = SmallVec::new();
        for (spec, c) in policy.specs.iter().zip(st.quotas.iter_mut()) {
            c.advance(spec.slice_at(now_us));
            codes.push(c.code(spec, now_us, cost));
        }
        let allowed = codes.iter().all(|c| *c == Code::Allowed);
        if !allowed && mode != Mode::Peek && policy.blocks(&codes) {
            self.start_block(policy, entry, &mut st, now_us);
            return (policy.blocked(policy.block_us), false);
        }
        let take = mode != Mode::Peek && allowed;
        // A peek answers what the decision would: the state with the request counted.
        let extra = if mode == Mode::Peek && allowed {
            cost.get()
        } else {
            0
        };
        if take {
            for c in st.quotas.iter_mut() {
                c.admit(cost.get());
            }
        }
        let quiet = self.mode.allowance > 0 && self.quiet(policy, entry, &mut st, now_us);
        if take && !quiet {
            self.queue_units(cost);
        }
        let decision = Decision::new(
            policy
                .specs
                .iter()
                .zip(st.quotas.iter())
                .zip(&codes)
                .map(|((spec, c), code)| c.state(spec, *code, now_us, cost, extra)),
        )
        .never_fits_alone();
        if quiet {
            // Within its allowance: nothing to send or read.
            return (decision, false);
        }
        // Near the limit, the others' units matter most: an admission that leaves less than
        // half of a quota sends at once instead of waiting for the batch; and so does a key
        // this instance has not read yet, decided from its own counts until the read returns.
        let near_limit = || {
            decision
                .quotas()
                .iter()
                .any(|q| u64::from(q.remaining) * 2 < u64::from(q.limit))
        };
        let unread = || {
            !st.reading
                && policy
                    .specs
                    .iter()
                    .zip(st.quotas.iter())
                    .any(|(spec, c)| c.stale(spec, now_us))
        };
        let blocked = self.breaker_open();
        if !sync && !blocked && ((take && near_limit()) || unread()) {
            self.urgent.store(true, Ordering::Relaxed);
            self.wake.notify_one();
        }
        let read_due = !st.reading
            && policy
                .specs
                .iter()
                .zip(st.quotas.iter())
                .any(|(spec, c)| c.read_due(spec, now_us, self.settle_us(spec)));
        // Units held back while quiet go with the next flush, whatever this decision did.
        if read_due || take || st.quotas.iter().any(Counts::owes) {
            self.enqueue(policy, entry, &mut st);
        }
        (decision, take && sync)
    }

    /// Counts `units` queued for the next flush, and wakes the task when they reach
    /// [`flush_after`](Approximate::flush_after).
    fn queue_units(&self, units: NonZeroU32) {
        let units = units.get() as usize;
        let queued = self.queued_units.fetch_add(units, Ordering::Relaxed);
        if queued < self.mode.flush_after && queued + units >= self.mode.flush_after {
            self.wake.notify_one();
        }
    }

    /// A settlement ([`Mode::Refund`], [`Mode::Debit`]) of `units` on the key's counts, as
    /// every store makes it: a debit counts more units into the current sub-window, past the
    /// limit into debt; a refund gives back units this instance counted into the sub-window
    /// of their admission, if it is still in the window. Both go to Redis with the next flush
    /// (a key within its allowance keeps them here, as its admissions). Always allowed; the
    /// states are the quotas' after it.
    fn settle_here(
        &self,
        policy: &Arc<PolicyShared>,
        entry: &Arc<Entry>,
        units: NonZeroU32,
        mode: Mode,
    ) -> Decision {
        let now_us = self.now.us();
        let mut st = entry.lock();
        for (spec, c) in policy.specs.iter().zip(st.quotas.iter_mut()) {
            c.advance(spec.slice_at(now_us));
            match mode {
                Mode::Debit => c.admit(units.get()),
                Mode::Refund { admitted_ago } => {
                    let ago = u64::try_from(admitted_ago.as_micros()).unwrap_or(u64::MAX);
                    c.refund(spec.slice_at(now_us.saturating_sub(ago)), units.get());
                }
                _ => {}
            }
        }
        let decision = Decision::new(
            (policy.specs.iter().zip(st.quotas.iter()))
                .map(|(spec, c)| c.state(spec, Code::Allowed, now_us, units, 0)),
        );
        if !st.quiet && st.quotas.iter().any(Counts::owes) {
            if mode == Mode::Debit {
                self.queue_units(units);
            }
            self.enqueue(policy, entry, &mut st);
        }
        decision
    }

    /// This instance's allowance of a quota per key: its part of its share of the limit, 0
    /// while the fleet has not been counted.
    fn allowance(&self, spec: &Spec) -> u32 {
        let n = self.fleet_size.load(Ordering::Relaxed);
        if n == 0 || !self.stream_ok.load(Ordering::Relaxed) {
            return 0;
        }
        let part = u64::from(spec.params.burst.get()) * u64::from(self.mode.allowance) / 1000;
        u32::try_from(part / u64::from(n)).unwrap_or(u32::MAX)
    }

    /// Whether the key stays (or becomes) quiet after a decision at `now_us`: within its
    /// allowance on every quota, and not announced. A quiet key that goes past its allowance is
    /// announced (its units are then sent, and its counts read); one another instance announced
    /// is recalled. A key in step becomes quiet again once its announcement has run out (a
    /// window) and its units here are back within the allowance.
    fn quiet(
        &self,
        policy: &PolicyShared,
        entry: &Entry,
        st: &mut EntryState,
        now_us: u64,
    ) -> bool {
        st.hot_until_us = self.announced_until(policy, entry, st, now_us);
        let allowances: SmallVec<[u32; 2]> = policy
            .specs
            .iter()
            .map(|spec| self.allowance(spec))
            .collect();
        if allowances.contains(&0) {
            // No allowance (the fleet not counted yet, or a limit smaller than the fleet): kept
            // in step, units held until now sent with the next flush.
            st.quiet = false;
            return false;
        }
        let hot = st.hot_until_us > now_us;
        let within = || {
            (policy.specs.iter().zip(st.quotas.iter()).zip(&allowances))
                .all(|((spec, c), &a)| c.own_estimate(spec, now_us) <= f64::from(a))
        };
        if st.quiet {
            if hot {
                st.quiet = false;
                self.recalled.fetch_add(1, Ordering::Relaxed);
                crate::metrics::approx_allowance("recalled");
            } else if within() {
                return true;
            } else {
                st.quiet = false;
                self.exhausted.fetch_add(1, Ordering::Relaxed);
                crate::metrics::approx_allowance("exhausted");
                self.mark(policy, entry, st, now_us);
            }
            return false;
        }
        if hot || st.queued || st.reading {
            return false;
        }
        if within() {
            st.quiet = true;
            self.granted.fetch_add(1, Ordering::Relaxed);
            crate::metrics::approx_allowance("granted");
            return true;
        }
        // Past its allowance: a key new here whose first request already is, or one still
        // past it a window after it was announced (announced again, so that instances new to
        // it since keep it in step too).
        self.mark(policy, entry, st, now_us);
        false
    }

    /// Whether a key not quiet may become so at this decision: allowances on for every quota,
    /// and the key not announced.
    fn may_be_quiet(
        &self,
        policy: &PolicyShared,
        entry: &Entry,
        st: &EntryState,
        now_us: u64,
    ) -> bool {
        self.mode.allowance > 0
            && policy.specs.iter().all(|spec| self.allowance(spec) > 0)
            && self.announced_until(policy, entry, st, now_us) <= now_us
    }

    /// Until when (µs) the key is kept in step: as this instance last knew, or, once that has
    /// passed, as the announcements read since say.
    fn announced_until(
        &self,
        policy: &PolicyShared,
        entry: &Entry,
        st: &EntryState,
        now_us: u64,
    ) -> u64 {
        if st.hot_until_us > now_us || self.hot_keys.load(Ordering::Relaxed) == 0 {
            return st.hot_until_us;
        }
        self.hot
            .get(&entry.base(policy, self).1)
            .map_or(st.hot_until_us, |until| st.hot_until_us.max(*until))
    }

    /// Announces the key with the next flush, and keeps it in step for its policy's longest
    /// window.
    fn mark(&self, policy: &PolicyShared, entry: &Entry, st: &mut EntryState, now_us: u64) {
        st.hot_until_us = now_us.saturating_add(policy.window_us);
        let base = entry.base(policy, self).0.clone();
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded while Redis is away: a key left out is still kept in step here, and the
        // others hear of it when it is announced again (a window later).
        if marks.len() < announce::MAX_PENDING {
            marks.push((base, policy.window_us));
        }
        drop(marks);
        self.urgent.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// The counts of a new key for a request that found `max_keys` held, made for this request
    /// alone and not kept: the key is kept in step (never quiet: its units go to Redis with
    /// the next flush, whatever its allowance), read before the decision and, when allowed,
    /// its increment waited for, so that it is limited by Redis's count as the synchronous
    /// variant limits any key: a flood of new keys neither keeps new clients out nor lets them
    /// through unlimited, and costs a round trip per request past the cap. A sweep starts, to
    /// make room.
    #[cold]
    fn overflow(&self, policy: &PolicyShared, key: &Key, now_us: u64) -> Arc<Entry> {
        self.overflowed.fetch_add(1, Ordering::Relaxed);
        if self.full_warned.now(self.now_ns_mono()) {
            tracing::warn!(
                max_keys = self.mode.max_keys,
                "approximate mode: key table full; requests on new keys are decided through \
                 Redis, a round trip each, until a sweep makes room (at most one warning a \
                 minute; raise `max_keys`)"
            );
        }
        if !self.sweep_now.swap(true, Ordering::Relaxed) {
            self.wake.notify_one();
        }
        let mut st = EntryState::new(policy);
        st.hot_until_us = now_us.saturating_add(policy.window_us);
        Arc::new(Entry {
            key: key.clone(),
            base: OnceLock::new(),
            state: Mutex::new(st),
        })
    }

    /// The answer to a request on a new key while `max_keys` are held and Redis cannot be
    /// asked (the circuit breaker open, or the read failed): denied for a second on every
    /// quota, and a sweep now.
    fn refuse_full(&self, policy: &PolicyShared) -> Decision {
        if self
            .refused_full
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(100_000)
        {
            tracing::warn!(
                max_keys = self.mode.max_keys,
                "approximate mode: key table full, requests on new keys are denied"
            );
        }
        if !self.sweep_now.swap(true, Ordering::Relaxed) {
            self.wake.notify_one();
        }
        let second = std::time::Duration::from_secs(1);
        Decision::new(policy.specs.iter().map(|spec| crate::backend::QuotaState {
            index: spec.index,
            outcome: crate::backend::Outcome::Denied {
                retry_after: second,
            },
            limit: spec.params.burst.get(),
            remaining: 0,
            reset_after: second,
        }))
    }

    /// Waits (at most the timeout) until a flush that began after this call has been
    /// answered: the units just queued were sent with it, coalesced with those of every
    /// request queued meanwhile (one `INCRBY` per key and sub-window).
    async fn flushed(&self) {
        let mut done = self.flushed.subscribe();
        // SeqCst, with the flush's increment: the units queued before this load are either
        // taken by a flush counted in `started`, or by a later one.
        let started = self.flushes_started.load(Ordering::SeqCst);
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(&self.waiters);
        self.wake.notify_one();
        let _ = tokio::time::timeout(self.opts.timeout, done.wait_for(|&d| d > started)).await;
    }
}

impl ApproxBackend {
    /// The decision of `policy`'s window quotas (all of them but its concurrent ones).
    fn windows(
        &self,
        policy: &ApproxPolicy,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> ApproxFuture {
        // No slots in this mode: a release gives back nothing.
        if matches!(mode, Mode::Release { .. }) {
            return ApproxFuture {
                inner: FutureInner::Ready(Some(Decision::new([]))),
            };
        }
        let shared = &self.shared;
        shared.start();
        let p = &policy.inner;
        let now_us = shared.now.us();
        // A decision that may take units keeps the key from the sweep until its windows
        // pass; a peek takes nothing, and leaves the hint as it was.
        let hold = |held: &Held| {
            if mode != Mode::Peek {
                (held.busy_until_us).store(p.idle_at(now_us), Ordering::Relaxed);
            }
            held.entry.clone()
        };
        // Past the cap, a new key is decided through Redis, not held (see `overflow`).
        let mut overflow = false;
        let entry = match p.entries.get(key) {
            Some(held) => hold(&held),
            None if p.held.load(Ordering::Relaxed) >= shared.mode.max_keys => {
                if shared.breaker_open() {
                    return ApproxFuture {
                        inner: FutureInner::Ready(Some(shared.refuse_full(p))),
                    };
                }
                overflow = true;
                shared.overflow(p, key, now_us)
            }
            None => {
                let held = p.entries.entry(key.clone()).or_insert_with(|| {
                    p.held.fetch_add(1, Ordering::Relaxed);
                    crate::metrics::approx_keys(1.0);
                    Held {
                        entry: Arc::new(Entry {
                            key: key.clone(),
                            base: OnceLock::new(),
                            state: Mutex::new(EntryState::new(p)),
                        }),
                        busy_until_us: AtomicU64::new(0),
                    }
                });
                hold(&held)
            }
        };
        if mode.is_settlement() {
            let settled = shared.settle_here(p, &entry, cost, mode);
            return ApproxFuture {
                inner: FutureInner::Ready(Some(settled)),
            };
        }
        let sync = shared.mode.writes == Writes::Sync && !shared.breaker_open();
        // A key that is or may become quiet (within its allowance) decides at once; every
        // other key reads before deciding, as without allowances.
        let stale = || {
            let st = entry.lock();
            !st.quiet
                && !shared.may_be_quiet(p, &entry, &st, now_us)
                && p.specs
                    .iter()
                    .zip(st.quotas.iter())
                    .any(|(spec, c)| c.stale(spec, now_us))
        };
        if ((sync && mode != Mode::Peek) || overflow) && stale() {
            // A key this instance has not read yet, or not since before the last sub-window:
            // its decisions wait for the fleet's counts (each request reads, so that none
            // decides from stale counts while another's read is on its way). A key past the
            // cap also waits for its increment: its next request reads it back.
            let (shared, policy) = (shared.clone(), p.clone());
            return ApproxFuture {
                inner: FutureInner::Waiting(Box::pin(async move {
                    flush::read_now(&shared, &policy, &entry).await;
                    let now_us = shared.now.us();
                    let unread = || {
                        let st = entry.lock();
                        (policy.specs.iter().zip(st.quotas.iter()))
                            .any(|(spec, c)| c.stale(spec, now_us))
                    };
                    if overflow && unread() {
                        // Past the cap, nothing to decide from but Redis's count.
                        return shared.refuse_full(&policy);
                    }
                    let (decision, wait) = shared.decide_here(&policy, &entry, cost, mode);
                    if wait || (overflow && decision.is_allowed()) {
                        shared.flushed().await;
                    }
                    decision
                })),
            };
        }
        let (decision, wait) = shared.decide_here(p, &entry, cost, mode);
        if !wait {
            return ApproxFuture {
                inner: FutureInner::Ready(Some(decision)),
            };
        }
        let shared = shared.clone();
        ApproxFuture {
            inner: FutureInner::Waiting(Box::pin(async move {
                shared.flushed().await;
                decision
            })),
        }
    }
}

impl Backend for ApproxBackend {
    type Policy = ApproxPolicy;
    type Future = ApproxFuture;

    fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<ApproxPolicy, ConfigError> {
        if params.is_empty() {
            return Err(ConfigError::QuotaCount {
                policy: policy.name().to_owned(),
                count: 0,
            });
        }
        let mut specs = Vec::with_capacity(params.len());
        let mut slots = Vec::new();
        for (i, p) in params.iter().enumerate() {
            if p.is_concurrent() {
                slots.push(i);
                continue;
            }
            let Some(spec) = Spec::new(i, *p) else {
                return Err(ConfigError::InvalidQuota {
                    policy: policy.name().to_owned(),
                    quota: Box::new(policy.quotas()[i]),
                    reason: "the approximate Redis mode counts windows: use a fixed or sliding \
                             window (e.g. \"20/2s sliding 100ms\" for \"10/s burst 20\")",
                });
            };
            specs.push(spec);
        }
        let window_us = specs
            .iter()
            .map(|s| {
                s.slice_us
                    .saturating_mul(s.kept.saturating_sub(1).max(1) as u64)
            })
            .max()
            .unwrap_or(0);
        self.shared
            .longest_window_us
            .fetch_max(window_us, Ordering::Relaxed);
        let inner = Arc::new(PolicyShared {
            name: policy.name().to_owned(),
            specs: specs.into_boxed_slice(),
            window_us,
            key_prefix: keys::policy_prefix(&self.shared.prefix, policy.name()),
            // Many small shards: the sweep holds each shard's lock while it walks it, and
            // requests on that shard wait (8 shards of a million keys held them for tens of
            // milliseconds each).
            entries: DashMap::with_hasher_and_shard_amount(RandomState::default(), ENTRY_SHARDS),
            held: self.shared.keys.clone(),
            block_us: (policy.block()).map_or(0, |b| {
                u64::try_from(b.as_micros()).unwrap_or(u64::MAX).max(1)
            }),
            block_mask: policy.block_mask(),
            all_params: params.into(),
        });
        let mut policies = self
            .shared
            .policies
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        policies.retain(|p| p.strong_count() > 0);
        policies.push(Arc::downgrade(&inner));
        let slots = if slots.is_empty() {
            None
        } else {
            Some(Arc::new(self.slots(policy, &slots)?))
        };
        Ok(ApproxPolicy { inner, slots })
    }

    fn decide(&self, policy: &ApproxPolicy, key: &Key, cost: NonZeroU32) -> ApproxFuture {
        self.decide_with(policy, key, cost, Mode::Decide)
    }

    /// Window quotas reserve nothing ahead: [`Mode::Reserve`] is answered as
    /// [`Mode::Decide`] (a denial's `retry_after` tells when to ask again). A policy's
    /// concurrent quotas are decided by the exact backend once its windows allow the request
    /// (see the [module docs](self#concurrent-quotas)).
    fn decide_with(
        &self,
        policy: &ApproxPolicy,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> ApproxFuture {
        match (&policy.slots, mode) {
            (None, _) | (Some(_), Mode::Refund { .. } | Mode::Debit) => {
                self.windows(policy, key, cost, mode)
            }
            (Some(slots), Mode::Release { .. }) => {
                let (slots, key) = (slots.clone(), key.clone());
                ApproxFuture::slots(async move {
                    let d = slots.backend.decide_with(&slots.policy, &key, cost, mode);
                    Ok(Decision::new(slots.renumber(d.await?)))
                })
            }
            (Some(slots), _) => {
                let windows = self.windows(policy, key, cost, mode);
                let (this, policy, slots, key) =
                    (self.clone(), policy.clone(), slots.clone(), key.clone());
                ApproxFuture::slots(async move {
                    this.with_slots(windows, &policy, &slots, &key, cost, mode)
                        .await
                })
            }
        }
    }

    /// Clears the key's counters in Redis and forgets its local counts, including units not
    /// sent yet. Other instances learn of it at their next read of the key (their own
    /// confirmed units stay counted).
    fn reset(&self, policy: &ApproxPolicy, key: &Key) -> ResetFuture {
        let shared = self.shared.clone();
        let p = policy.inner.clone();
        let key = key.clone();
        Box::pin(async move {
            // Forgotten here first, with the units it had not sent (a flush already under way
            // may still land its own after the reset).
            if let Some((_, old)) = p.entries.remove(&key) {
                p.held.fetch_sub(1, Ordering::Relaxed);
                crate::metrics::approx_keys(-1.0);
                let mut st = old.entry.lock();
                st.quotas = p.specs.iter().map(Counts::new).collect();
            }
            let mut base = Vec::new();
            keys::key_base(&p.key_prefix, &key, &mut base);
            // The current sub-window's counter is set to zero rather than deleted, so that it
            // keeps an expiry (instances set one with their first increment in a sub-window).
            let now_us = shared.now.us();
            let mut pipe = redis::pipe();
            for spec in p.specs.iter() {
                let newest = spec.slice_at(now_us);
                let older = newest.saturating_sub(spec.kept as u64)..newest;
                if !older.is_empty() {
                    let del = pipe.cmd("DEL").ignore();
                    for slice in older {
                        del.arg(counter_key(&base, spec, slice));
                    }
                }
                pipe.cmd("SET")
                    .arg(counter_key(&base, spec, newest))
                    .arg(0)
                    .arg("PX")
                    .arg(spec.ttl_ms())
                    .ignore();
            }
            if p.block_us > 0 {
                // The key's block goes too, as on every store.
                let mut blk = base.clone();
                blk.extend_from_slice(b"blk");
                pipe.cmd("DEL").arg(blk).ignore();
            }
            match tokio::time::timeout(shared.opts.timeout, shared.conn.pipeline(&pipe)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(BackendError::new(BackendErrorKind::Unavailable, e)),
                Err(_) => Err(BackendError::from_kind(BackendErrorKind::Timeout)),
            }
        })
    }

    fn store_id(&self) -> Option<String> {
        Some(format!(
            "{} prefix {:?} (approximate)",
            self.shared.endpoint, self.shared.prefix
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_their_bounds() {
        let a = Approximate::asynchronous()
            .flush_every(Duration::ZERO)
            .flush_after(0);
        assert!(!a.is_synchronous());
        assert_eq!(a.flush_every, Duration::from_millis(1));
        assert_eq!(a.flush_after, 1);
        assert!(Approximate::synchronous().is_synchronous());
    }
}
