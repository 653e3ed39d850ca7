//! What a remote backend is made of: a [`Store`], the protocol to one kind of database.

use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use smallvec::SmallVec;

use super::deny_cache::DenyCache;
use super::health::StoreFailure;
use crate::backend::{Decision, Mode};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind, ConfigError, Key, Policy};

/// The protocol to one kind of store: everything else (timeouts, breaker, deny cache,
/// batching, failure policy) is [`Remote`](super::Remote)'s.
pub(crate) trait Store: Send + Sync + Sized + 'static {
    /// The store's kind, as the `backend` label of metrics: `redis`, `postgres`, `mysql`.
    const KIND: &'static str;

    /// Whether the store settles requests after their response (refunds, debits, and the
    /// slots of concurrent quotas: [`Mode::is_settlement`](crate::backend::Mode::is_settlement)
    /// and [`Mode::Hold`](crate::backend::Mode::Hold)).
    const SETTLES: bool = false;

    /// What the store needs of a prepared policy (key prefixes, formatted arguments).
    type Prepared: Send + Sync + 'static;

    /// Prepares a policy (once per layer build or policy swap, never per request).
    fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<Self::Prepared, ConfigError>;

    /// Decides `jobs` in one atomic call per decision (one round trip for all), answering each
    /// in order: `Err` for the whole call when the store could not be asked or did not answer
    /// (nothing of the call may be sent again: it may have run), a decision's own `Err` when
    /// the store answered but refused that decision. `now_ns` is the test clock's time, if any,
    /// to decide at instead of the store's clock.
    fn call<'a>(
        &'a self,
        jobs: &'a [Job<Self>],
        now_ns: Option<u64>,
    ) -> impl Future<Output = Result<Vec<Result<Decision, BackendError>>, CallError>> + Send + 'a;

    /// A cheap round trip (`PING`, `SELECT 1`) for the circuit breaker's probe and warm-up.
    fn ping(&self) -> impl Future<Output = Result<(), CallError>> + Send + '_;

    /// Whether concurrent decisions may share one call (a Redis Cluster cannot: the keys of a
    /// call must share a slot).
    fn can_batch(&self) -> bool;

    /// Calls in flight at once per backend while batching.
    fn calls_in_flight(&self) -> usize;

    /// Drops the connections the store holds, so that the next call or probe makes new ones:
    /// called when the circuit breaker opens and after each failed probe. A connection whose
    /// packets vanish (a black-holed path, a peer gone without a reset) gives no error, only
    /// timeouts, until the kernel gives up on it many minutes later; a new one works as soon
    /// as the store is reachable again.
    fn reconnect(&self) {}

    /// How long the warm-up's first connection and round trip may take, for a decision
    /// timeout of `timeout`: long enough for the driver to report why it cannot connect.
    fn warm_up_timeout(&self, timeout: Duration) -> Duration;

    /// Announces instance `id` until `ttl` from now on the store's clock, forgets the
    /// instances whose announcements expired, and counts those left (this one included), in
    /// one call (MySQL: two statements on one connection). See
    /// [`Fleet::Announced`](super::Fleet::Announced).
    fn announce(
        &self,
        id: u64,
        ttl: Duration,
    ) -> impl Future<Output = Result<u32, CallError>> + Send + '_;

    /// Whose clock the store's decisions read now.
    fn time_source(&self) -> super::TimeSource {
        super::TimeSource::Store
    }

    /// The store's memory as it reports it, for the memory watch; `None` (the default) for a
    /// store that has no such report, which ends the watch.
    fn memory(&self) -> impl Future<Output = Result<Option<Memory>, CallError>> + Send + '_ {
        std::future::ready(Ok(None))
    }
}

/// A store's memory, as its report says (Redis `INFO memory` and `INFO stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Memory {
    /// Bytes in use.
    pub(crate) used: u64,
    /// The limit in bytes, 0 for none.
    pub(crate) max: u64,
    /// What the store does at its limit (`noeviction`, `allkeys-lru`, ...).
    pub(crate) policy: String,
    /// Keys evicted since the store started.
    pub(crate) evicted: u64,
}

impl Memory {
    /// Reads the fields of `INFO` texts (`name:value` lines); `None` without `used_memory`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn from_info<'a>(texts: impl IntoIterator<Item = &'a str>) -> Option<Memory> {
        let mut memory = Memory::default();
        let mut used = None;
        for line in texts.into_iter().flat_map(str::lines) {
            let Some((name, value)) = line.trim_end().split_once(':') else {
                continue;
            };
            match name {
                "used_memory" => used = value.parse().ok(),
                "maxmemory" => memory.max = value.parse().unwrap_or(0),
                "maxmemory_policy" => memory.policy = value.to_owned(),
                "evicted_keys" => memory.evicted = value.parse().unwrap_or(0),
                _ => {}
            }
        }
        memory.used = used?;
        Some(memory)
    }

    /// The memory of a store of several nodes (a Redis Cluster's primaries) as one: the
    /// fullest node's use and limit (by the share of its limit it uses; by its use where none
    /// has a limit), an evicting policy if any node has one, and the keys all of them evicted.
    /// `None` without a node.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn fullest(nodes: impl IntoIterator<Item = Memory>) -> Option<Memory> {
        let share = |m: &Memory| {
            if m.max == 0 {
                0.0
            } else {
                m.used as f64 / m.max as f64
            }
        };
        let mut all = None::<Memory>;
        for node in nodes {
            let Some(fullest) = &mut all else {
                all = Some(node);
                continue;
            };
            fullest.evicted = fullest.evicted.saturating_add(node.evicted);
            if node.policy != "noeviction" && !node.policy.is_empty() {
                fullest.policy = node.policy.clone();
            }
            let (a, b) = (share(&node), share(fullest));
            let fuller = if a != b {
                a > b
            } else {
                node.used > fullest.used
            };
            if fuller {
                (fullest.used, fullest.max) = (node.used, node.max);
            }
        }
        all
    }
}

/// Why a call failed: the cause (for the breaker, the stats and the logs) and the driver's
/// text (scrubbed of passwords before it is shown).
#[derive(Debug, Clone)]
pub(crate) struct CallError {
    pub(crate) failure: StoreFailure,
    pub(crate) text: Arc<str>,
}

impl CallError {
    pub(crate) fn new(failure: StoreFailure, text: impl fmt::Display) -> Self {
        CallError {
            failure,
            text: text.to_string().into(),
        }
    }

    /// A call that outlasted the backend's timeout.
    pub(crate) fn timed_out() -> Self {
        CallError::new(StoreFailure::Timeout, "the call timed out")
    }

    /// How the failure is reported to the layer.
    pub(crate) fn kind(&self) -> BackendErrorKind {
        match self.failure {
            StoreFailure::Timeout => BackendErrorKind::Timeout,
            StoreFailure::ErrorReply => BackendErrorKind::Protocol,
            _ => BackendErrorKind::Unavailable,
        }
    }
}

impl From<CallError> for BackendError {
    fn from(err: CallError) -> Self {
        BackendError::new(err.kind(), err.text.to_string())
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A policy prepared for a remote backend: its quotas, the store's part, its own deny cache and,
/// with [`FailurePolicy::FallbackLocal`](super::FailurePolicy::FallbackLocal), its local twin.
pub(crate) struct PolicyInner<S: Store> {
    pub(crate) params: SmallVec<[QuotaParams; 2]>,
    pub(crate) store: S::Prepared,
    pub(crate) deny: DenyCache,
    pub(crate) deny_hits: crate::metrics::DenyCacheHits,
    pub(crate) local: Option<Twin>,
}

/// The policy's local twin for [`FailurePolicy::FallbackLocal`](super::FailurePolicy::FallbackLocal):
/// the policy at this instance's share of a fleet's size, prepared again when the size changed.
pub(crate) struct Twin {
    policy: Policy,
    at: arc_swap::ArcSwap<TwinAt>,
}

/// The twin prepared for a fleet of `instances`.
pub(crate) struct TwinAt {
    pub(crate) instances: u32,
    pub(crate) local: crate::backend::local::LocalPolicy,
    /// The share's smallest burst (of its rate quotas): a request costing more is charged
    /// this much, so that a request the whole quota allows is never "too large" for a share.
    max_cost: NonZeroU32,
}

impl TwinAt {
    /// `cost`, at most what the share can ever take at once.
    pub(crate) fn cost(&self, cost: NonZeroU32) -> NonZeroU32 {
        cost.min(self.max_cost)
    }
}

impl Twin {
    /// The twin of `policy` on `backend` for a fleet of `instances`.
    pub(crate) fn new(
        backend: &crate::backend::LocalBackend,
        policy: &Policy,
        instances: u32,
    ) -> Result<Self, ConfigError> {
        Ok(Twin {
            policy: policy.clone(),
            at: arc_swap::ArcSwap::from_pointee(Self::prepare(backend, policy, instances)?),
        })
    }

    fn prepare(
        backend: &crate::backend::LocalBackend,
        policy: &Policy,
        instances: u32,
    ) -> Result<TwinAt, ConfigError> {
        let share = policy.share(instances);
        let params = share.validate()?;
        let local = crate::backend::Backend::prepare(backend, &share, &params)?;
        let max_cost = (params.iter())
            .filter(|p| !p.is_concurrent())
            .map(|p| p.burst)
            .min()
            .unwrap_or(NonZeroU32::MAX);
        Ok(TwinAt {
            instances,
            local,
            max_cost,
        })
    }

    /// The twin as last prepared.
    pub(crate) fn current(&self) -> arc_swap::Guard<Arc<TwinAt>> {
        self.at.load()
    }

    /// The twin for a fleet of `instances`, prepared now if the size changed (its buckets
    /// start full). A share that cannot be prepared keeps the last (a share of a valid policy
    /// is valid, but for a period stretched past the longest one allowed). Of two requests
    /// preparing at once, one twin is kept.
    pub(crate) fn at(&self, backend: &crate::backend::LocalBackend, instances: u32) -> Arc<TwinAt> {
        let current = self.at.load_full();
        if current.instances == instances {
            return current;
        }
        let Ok(next) = Self::prepare(backend, &self.policy, instances) else {
            return current;
        };
        let next = Arc::new(next);
        let was = self.at.compare_and_swap(&current, next.clone());
        if Arc::ptr_eq(&*was, &current) {
            next
        } else {
            // Another request prepared one first: its twin is the one kept.
            arc_swap::Guard::into_inner(was)
        }
    }
}

/// One decision sent to the store, and whom to answer.
pub(crate) struct Job<S: Store> {
    pub(crate) policy: Arc<PolicyInner<S>>,
    pub(crate) key: Key,
    pub(crate) cost: NonZeroU32,
    /// Decide, reserve (with the longest wait) or peek.
    pub(crate) mode: Mode,
    /// When the decision was sent (the backend's clock), for the deny cache.
    pub(crate) sent_ns: u64,
    /// When the request gives up: a decision still queued at its deadline is answered at once,
    /// one in a call at its deadline even if the call goes on for later decisions.
    pub(crate) deadline: Instant,
}

impl<S: Store> Job<S> {
    /// The store's part of the prepared policy.
    pub(crate) fn prepared(&self) -> &S::Prepared {
        &self.policy.store
    }

    /// The policy's quotas.
    pub(crate) fn params(&self) -> &[QuotaParams] {
        &self.policy.params
    }
}
