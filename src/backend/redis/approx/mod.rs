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
//! A policy whose limits change (a rule swap, a reloaded configuration) keeps its counts: the
//! counters are named by the policy, the quota's identity (its name, or its place) and its
//! window's shape (`<prefix>:{<policy>:<key>}:2.a<quota>.<sub-window µs>x<sub-windows>:<n>`),
//! not its limit, and a new version of a policy whose quotas count in the same counters shares
//! this instance's counts of its keys, so that the new limit applies at once to what the fleet
//! and this instance counted. That is [`OnChange::Keep`](crate::quota::OnChange::Keep) without
//! the clamp (counts past a lowered limit refuse until they slide out); the other strategies
//! would have every instance rewrite shared counters, and are refused when the policy is
//! prepared. A changed period or resolution counts afresh.
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
mod backend_impl;
mod counts;
mod decide;
mod entry;
mod flush;
mod future;
mod shared;
mod slots;

use decide::Increments;
use entry::{Entry, EntryState, Held, Now, counter_key};
pub use future::ApproxFuture;
use future::FutureInner;
use shared::{Shared, Waiting};

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
    /// Its keys' counts; shared with the versions of the policy whose quotas count in the
    /// same Redis counters (a changed limit), so that a key's counts follow the new limit at
    /// once, without a read.
    entries: Arc<DashMap<Key, Held, RandomState>>,
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
        // Keys shared with another version of the policy stay held there.
        if Arc::strong_count(&self.entries) == 1 {
            self.held.fetch_sub(self.entries.len(), Ordering::Relaxed);
            crate::metrics::approx_keys(-(self.entries.len() as f64));
        }
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
                no_time: Default::default(),
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
