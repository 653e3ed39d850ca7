//! The options of every remote backend, its failure policy and its counters.

use std::num::NonZeroU32;
use std::time::Duration;

use super::clock::TestClock;
use super::health::StoreFailure;

/// What a request gets while a remote store cannot decide (an error, a timeout, or an open
/// circuit breaker).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Let the request through and count it in the stats' `fail_open` (the store starting to
    /// fail is logged as a warning, once, not per request). The decision carries no quota
    /// state, so no remaining counts are sent. A store failing (or full, or refusing writes)
    /// then means no limit: a client that can make the store fail (by filling it with fresh
    /// keys) lifts every limit. It was the default before the local fallback.
    FailOpen,
    /// Return a [`BackendError`](crate::BackendError): the layer answers `503 Service Unavailable` with
    /// `Retry-After: 1` (gRPC: `UNAVAILABLE`). Choose this where letting requests through
    /// unlimited is worse than refusing them, e.g. for an expensive upstream.
    FailClosed,
    /// Decide with an in-process [`LocalBackend`](crate::backend::LocalBackend) holding the
    /// policy at this instance's **share**: each quota's count and burst (a concurrent quota's
    /// slots) divided by the number of instances sharing the store, rounded up. So `n`
    /// instances together admit about one quota while the store is down, not `n` (at most the
    /// quota rounded up to a multiple of `n`, from clients spread over the instances; a client
    /// whose requests all reach one instance gets that instance's share). The number of
    /// instances is the [`Fleet`]'s: announced in the store (the default) or configured.
    ///
    /// The local buckets only see the requests the store could not decide, and nothing is
    /// copied between them and the store in either direction. They live as long as the
    /// backend: a client's local bucket is full at its first outage; at a later one it holds
    /// what was left at the end of the previous outage, refilled at the share's rate since
    /// (full again if enough time passed). When the fleet's size changed between outages, the
    /// buckets at the new share start full.
    ///
    /// The default: a store failing never means no limit, and never takes the application
    /// down with it.
    #[default]
    FallbackLocal,
}

/// How a remote backend knows how many instances share its store: what
/// [`FailurePolicy::FallbackLocal`] divides each quota by. Only a backend with that failure
/// policy announces itself or counts.
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use tollgate::backend::remote::Fleet;
///
/// // The default: announced every second, an instance gone is forgotten after 3 s.
/// assert_eq!(Fleet::default(), Fleet::Announced { every: Duration::from_secs(1) });
/// // Or a size you know (a fixed deployment): no announcements.
/// let three = Fleet::Size(NonZeroU32::new(3).unwrap());
/// # let _ = three;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fleet {
    /// Every instance announces itself in the store every `every` (at least 100 ms, at most an
    /// hour), in an entry that expires after three times that, and counts the entries alive
    /// (the store's clock decides). An instance that starts is counted by every other within
    /// `every`; one that stops (or cannot reach the store) is forgotten within `3 × every`
    /// plus `every`. The count is of every backend built with the same store and key prefix
    /// (each built backend is one instance: build one per process and clone it): give services
    /// that share a store but not their limits prefixes of their own. `Fleet::Size(1)` keeps
    /// the fallback at the whole quota per instance, as before the fleet was counted.
    /// Three failed announcements in a row are logged as a warning (a store user without the
    /// commands or rights: see docs/redis.md's ACL). While the store is down the count is the last one read; before the first
    /// read (a store down from the start) an instance counts itself alone, and falls back to
    /// the whole quota. On Redis the entries are a sorted set, `<prefix>:fleet`; on PostgreSQL
    /// and MySQL rows of the backend's table, keyed `<prefix>:fleet:<instance>`.
    Announced {
        /// How often each instance announces itself and reads the count.
        every: Duration,
    },
    /// A fixed number of instances, configured (a deployment whose size is known); nothing is
    /// announced.
    Size(NonZeroU32),
}

impl Fleet {
    /// The fleet with its announcement interval within bounds.
    pub(crate) fn bounded(self) -> Self {
        match self {
            Fleet::Announced { every } => Fleet::Announced {
                every: every.clamp(Duration::from_millis(100), super::MAX_DURATION),
            },
            size => size,
        }
    }
}

impl Default for Fleet {
    fn default() -> Self {
        Fleet::Announced {
            every: Duration::from_secs(1),
        }
    }
}

/// Counters of a remote backend (Redis, as `RedisStats`; PostgreSQL; MySQL). All counts are
/// since the backend was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RemoteStats {
    /// Decisions sent to the store (requests, not calls).
    pub decisions: u64,
    /// Calls those took (Redis: script calls): concurrent decisions share calls.
    pub calls: u64,
    /// Calls that failed (an error, a timeout, a reply that could not be read), each counted
    /// once however many decisions it carried; plus single decisions the store refused inside
    /// a call that succeeded. Requests that got the failure policy are counted in
    /// [`fail_open`](Self::fail_open), [`fail_closed`](Self::fail_closed) or
    /// [`fallback_local`](Self::fallback_local).
    pub errors: u64,
    /// Of those, calls that timed out. A batched call runs until the last deadline of its
    /// decisions; a request whose own deadline passed earlier, or while it was still queued,
    /// gets the failure policy without counting here.
    pub timeouts: u64,
    /// Requests let through by [`FailurePolicy::FailOpen`].
    pub fail_open: u64,
    /// Requests refused by [`FailurePolicy::FailClosed`].
    pub fail_closed: u64,
    /// Requests decided by the local backend under [`FailurePolicy::FallbackLocal`].
    pub fallback_local: u64,
    /// Requests denied by the local deny cache without a call.
    pub deny_cache_hits: u64,
    /// Denials held in the deny caches now.
    pub deny_cache_entries: usize,
    /// How many instances share the store as this one knows it ([`Fleet`]): the configured
    /// size with `Fleet::Size(n)`; with `Fleet::Announced`, 1 until the first count, and always
    /// 1 unless the failure policy is [`FallbackLocal`](FailurePolicy::FallbackLocal).
    pub fleet_size: u32,
    /// Whether the circuit breaker is open (the store is not being called).
    pub breaker_open: bool,
    /// How many times the circuit breaker opened.
    pub breaker_trips: u64,
    /// Why the store is failing, when the last call or probe failed (the real cause: a
    /// refused connection or a wrong password, rather than the timeouts requests may see);
    /// `None` while it answers, and before the first call.
    pub failing: Option<StoreFailure>,
    /// Whose clock decisions read: the store's own (the default on every store), or, on a
    /// Redis that refuses `TIME` in scripts, Redis's read outside them or the instances'
    /// ([`RedisClock`](crate::backend::redis::RedisClock)).
    pub time_source: TimeSource,
    /// The store's memory in use, in bytes, as last read (Redis `used_memory`; 0 before the
    /// first read, or for a store that does not say).
    pub memory_used: u64,
    /// The store's memory limit, in bytes (Redis `maxmemory`; 0 for none, or not read).
    pub memory_max: u64,
    /// Keys the store evicted (Redis `evicted_keys`) since this backend first read it: each
    /// may have been a count of a rate limit, which then started afresh.
    pub evicted_keys: u64,
}

/// Whose clock a remote store's decisions read ([`RemoteStats::time_source`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TimeSource {
    /// The store's own, read in the call that decides (Redis `TIME` in the script, SQL
    /// `clock_timestamp()` / `SYSDATE(6)`): one clock for every instance.
    #[default]
    Store,
    /// The store's, read outside its scripts and kept as an offset from the instance's clock
    /// (a Redis that refuses `TIME` in scripts): one clock to within half a round trip.
    StoreSynced,
    /// Each instance's own (a Redis that refuses `TIME`): one limit to within the instances'
    /// clock skew.
    Instances,
}

impl TimeSource {
    /// Its name in metrics: `store`, `store_synced`, `instances`.
    pub fn as_str(self) -> &'static str {
        match self {
            TimeSource::Store => "store",
            TimeSource::StoreSynced => "store_synced",
            TimeSource::Instances => "instances",
        }
    }
}

/// The options every remote backend's builder has.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) timeout: Duration,
    pub(crate) on_failure: FailurePolicy,
    pub(crate) breaker_threshold: u32,
    pub(crate) probe_interval: Duration,
    pub(crate) deny_cache_capacity: usize,
    pub(crate) batching: bool,
    pub(crate) fleet: Fleet,
    pub(crate) test_clock: Option<TestClock>,
    /// How often the store's memory is read (Redis `INFO`), `None` for never.
    pub(crate) memory_watch: Option<Duration>,
    /// This instance's id in the fleet's announcements, when two backends of one process
    /// announce it (the approximate mode and the exact backend deciding its slots): one
    /// member, counted once. `None`: a fresh one.
    pub(crate) fleet_id: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_millis(100),
            on_failure: FailurePolicy::FallbackLocal,
            breaker_threshold: 5,
            probe_interval: Duration::from_millis(500),
            deny_cache_capacity: 65_536,
            batching: true,
            fleet: Fleet::default(),
            test_clock: None,
            memory_watch: Some(Duration::from_secs(10)),
            fleet_id: None,
        }
    }
}
