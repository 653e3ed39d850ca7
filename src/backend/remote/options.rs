//! The options of every remote backend, its failure policy and its counters.

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
    /// state, so no remaining counts are sent. The default: a rate limiter should not take an
    /// application down with it.
    #[default]
    FailOpen,
    /// Return a [`BackendError`](crate::BackendError): the layer answers `503 Service Unavailable` with
    /// `Retry-After: 1` (gRPC: `UNAVAILABLE`). Choose this where letting requests through
    /// unlimited is worse than refusing them, e.g. for an expensive upstream.
    FailClosed,
    /// Decide with an in-process [`LocalBackend`](crate::backend::LocalBackend) holding the same policy: limits hold per
    /// instance (with `n` replicas a client gets up to `n` times the quota) until the store is
    /// back. The local buckets only see the requests the store could not decide, and nothing
    /// is copied between them and the store in either direction. They live as long as the
    /// backend: a client's local bucket is full at its first outage; at a later one it holds
    /// what was left at the end of the previous outage, refilled at the quota's rate since
    /// (full again if enough time passed).
    FallbackLocal,
}

/// Counters of a remote backend (PostgreSQL, MySQL; the Redis backend reports the same as
/// `RedisStats`). All counts are since the backend was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RemoteStats {
    /// Decisions sent to the store (requests, not calls).
    pub decisions: u64,
    /// Calls those took: concurrent decisions share calls.
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
    /// Whether the circuit breaker is open (the store is not being called).
    pub breaker_open: bool,
    /// How many times the circuit breaker opened.
    pub breaker_trips: u64,
    /// Why the store is failing, when the last call or probe failed (the real cause: a
    /// refused connection or a wrong password, rather than the timeouts requests may see);
    /// `None` while it answers, and before the first call.
    pub failing: Option<StoreFailure>,
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
    pub(crate) test_clock: Option<TestClock>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_millis(100),
            on_failure: FailurePolicy::FailOpen,
            breaker_threshold: 5,
            probe_interval: Duration::from_millis(500),
            deny_cache_capacity: 65_536,
            batching: true,
            test_clock: None,
        }
    }
}
