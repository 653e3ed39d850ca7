//! What every remote backend shares: timeouts, the failure policy, the circuit breaker with
//! its background probe, the local deny cache and the batching of concurrent decisions.
//!
//! A remote backend (Redis, PostgreSQL, MySQL) is only its protocol: how a batch of decisions
//! becomes one atomic call to its store (a Lua script, a SQL function or procedure), and how
//! the reply becomes [`Decision`](crate::backend::Decision)s. Everything else, read from the decision down to the wire,
//! is here and behaves the same on every store:
//!
//! 1. **Deny cache.** A key the store denied until `T` is answered locally until `T`: exact,
//!    see [`deny_cache`](self#local-deny-cache).
//! 2. **Circuit breaker.** After a number of failed calls in a row the store is not called;
//!    requests get the [`FailurePolicy`] at once, and a background probe closes the breaker on
//!    the store's first answer.
//! 3. **Batching.** Concurrent decisions queue for one task of the backend, which sends what is
//!    queued as one call as soon as a call slot is free; each decision keeps its own timeout.
//! 4. **The store's call**, bounded by the backend's timeout; a call that may have run is never
//!    sent again (it would charge twice).
//! 5. **Failure policy** for a decision the store could not make: fail open, fail closed, or
//!    fall back to a per-instance [`LocalBackend`](crate::backend::LocalBackend).
//!
//! The modules read one way, from the decision down to the wire, none importing one above it:
//! `backend` (prepare, decide: deny cache, breaker, batched or alone) → `future` (what a
//! request waits on) → `batch` (the queue and the calls) → `inner` (what becomes of a call's
//! outcome: breaker, health, counters, failure policy) → `store` (the `Store` trait a backend
//! implements, and the decisions it is handed), with `options`, `deny_cache`, `breaker`,
//! `health` and `clock` below them.
//!
//! ```
//! use tollgate::backend::remote::FailurePolicy;
//!
//! // The same failure policies for every remote backend; the local fallback, at each
//! // instance's share, is the default.
//! assert_eq!(FailurePolicy::default(), FailurePolicy::FallbackLocal);
//! ```
//!
//! # Local deny cache
//!
//! Once the store denied a key with a retry time `T`, the instance answers that key itself
//! until `T`, so that a denied client hammering the API costs the store nothing. This is exact:
//! for every algorithm, the earliest time a denied request can pass never moves earlier
//! whatever other instances do (a GCRA bucket's theoretical arrival time only moves later, a
//! window's count only grows until it ends, a sliding window's estimate only falls with time
//! and rises with counts), so the store's retry time stays a valid bound. The argument needs
//! the buckets to be changed by tollgate only: deleting them by hand (or a store losing them)
//! may leave the cache denying a client the store would allow, for at most the retry time it
//! had given. See each backend's docs for details.

// With only the rate limit service's client, the stores' key layout and settlement details
// go unused.
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]

mod backend;
mod batch;
mod breaker;
mod clock;
mod deny_cache;
mod future;
mod health;
mod inner;
pub(crate) mod keys;
mod options;
pub(crate) mod redact;
pub(crate) mod reply;
mod store;

pub(crate) use backend::{Remote, RemotePolicy};
#[doc(hidden)]
pub use clock::TestClock;
pub use future::RemoteFuture;
pub use health::StoreFailure;
#[cfg(feature = "redis")]
pub(crate) use inner::{MemoryState, MemoryWatch};
pub(crate) use options::Options;
pub use options::{FailurePolicy, Fleet, RemoteStats, TimeSource};
#[cfg(feature = "redis")]
pub(crate) use store::Memory;
pub(crate) use store::{CallError, Job, Store};

/// The most decisions in one call: bounds how long one call keeps the store busy.
pub(crate) const MAX_BATCH: usize = 128;

/// The longest timeout and probe interval: longer ones are not useful for a rate limiter, and
/// the cap keeps every deadline computed from them far from overflowing.
pub(crate) const MAX_DURATION: std::time::Duration = std::time::Duration::from_secs(3600);

/// The decision for a request whose cost exceeds the burst (or a window's limit) of some quota,
/// made without the store (when it cannot be asked), reporting only the quotas it can never
/// fit, as full buckets (empty windows).
pub(crate) fn never_fits(
    params: &[crate::quota::QuotaParams],
    cost: std::num::NonZeroU32,
) -> Option<crate::backend::Decision> {
    let states: smallvec::SmallVec<[crate::backend::QuotaState; 2]> = params
        .iter()
        .enumerate()
        // A concurrent quota takes one slot whatever the cost.
        .filter(|(_, p)| cost > p.burst && !p.is_concurrent())
        .map(|(index, p)| {
            crate::backend::QuotaState::never_fits(index, p, std::time::Duration::ZERO)
        })
        .collect();
    (!states.is_empty()).then(|| crate::backend::Decision::new(states).never_fits_alone())
}

/// The builder options every remote backend has, as builder methods on `$builder` (whose
/// `opts` field is an [`Options`]); `$store` names the store in the docs.
#[allow(unused_macros)]
macro_rules! options_methods {
    ($builder:ty, $store:literal) => {
        impl $builder {
            #[doc = concat!("How long a decision may wait for ", $store, " (default 100 ms, at most an hour), counted from the")]
            /// moment it is asked for (a batched decision gets its whole timeout however long
            /// it queued). A decision that does not get its answer in time gets the
            /// [failure policy](Self::on_failure).
            pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
                self.opts.timeout = timeout.min($crate::backend::remote::MAX_DURATION);
                self
            }

            #[doc = concat!("What requests get while ", $store, " cannot decide (default")]
            /// [`FallbackLocal`](crate::backend::remote::FailurePolicy::FallbackLocal): each
            /// instance at its share of every quota).
            pub fn on_failure(mut self, policy: $crate::backend::remote::FailurePolicy) -> Self {
                self.opts.on_failure = policy;
                self
            }

            #[doc = concat!("How many instances share ", $store, ", for the local fallback's share of each quota")]
            /// (default: [announced](crate::backend::remote::Fleet::Announced) every second).
            pub fn fleet(mut self, fleet: $crate::backend::remote::Fleet) -> Self {
                self.opts.fleet = $crate::backend::remote::Fleet::bounded(fleet);
                self
            }

            /// The circuit breaker (default: open after 5 consecutive failed calls, probe every
            #[doc = concat!("500 ms): after `consecutive_failures` failed calls in a row, stop calling ", $store, " and")]
            /// apply the failure policy at once; probe every `probe_interval` (at least 10 ms,
            /// at most an hour) and resume on the first answer.
            ///
            /// A batched call counts once however many requests it carried. Timeouts and
            /// connection errors count; errors the store answers with (a refused key) do not.
            pub fn circuit_breaker(
                mut self,
                consecutive_failures: u32,
                probe_interval: std::time::Duration,
            ) -> Self {
                self.opts.breaker_threshold = consecutive_failures.max(1);
                self.opts.probe_interval = probe_interval.clamp(
                    std::time::Duration::from_millis(10),
                    $crate::backend::remote::MAX_DURATION,
                );
                self
            }

            /// The most denials kept in the local deny cache, over all policies (default
            /// 65 536); `0` turns the cache off.
            pub fn deny_cache_capacity(mut self, capacity: usize) -> Self {
                self.opts.deny_cache_capacity = capacity;
                self
            }

            /// Whether concurrent decisions share calls (default `true`): requests queue their
            /// decisions for a task of the backend, which sends what is queued as one call as
            /// soon as a call slot is free.
            pub fn batching(mut self, on: bool) -> Self {
                self.opts.batching = on;
                self
            }

            #[doc = concat!("**Tests only.** Makes ", $store, " decide at `clock`'s time instead of its own clock,")]
            /// and the deny cache use it instead of the monotonic clock, so that a test can
            /// script time as with governor's `FakeRelativeClock`. Stored buckets still expire
            /// on the store's real clock.
            #[doc(hidden)]
            pub fn test_clock(mut self, clock: $crate::backend::remote::TestClock) -> Self {
                self.opts.test_clock = Some(clock);
                self
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use options_methods;

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::never_fits;
    use crate::quota::QuotaParams;

    fn params(per_second: u64, burst: u32) -> QuotaParams {
        QuotaParams::gcra(1_000_000_000 / per_second, NonZeroU32::new(burst).unwrap())
    }

    #[test]
    fn never_fits_is_decided_without_the_store() {
        let p = [params(1, 5), params(1, 2)];
        assert!(never_fits(&p, NonZeroU32::new(2).unwrap()).is_none());
        let d = never_fits(&p, NonZeroU32::new(3).unwrap()).unwrap();
        assert!(d.never_fits());
        assert_eq!(d.quotas().len(), 1);
        assert_eq!(d.quotas()[0].index, 1);
    }
}
