//! Backends: where buckets live and decisions are made.
//!
//! A [`Backend`] knows nothing about HTTP: it is given a prepared policy, a [`Key`] and a cost,
//! and answers with a [`Decision`]. The layer turns decisions into responses and headers, and
//! never knows which backend it talks to.
//!
//! - [`LocalBackend`] (feature `local`, on by default): in-process GCRA buckets from the
//!   [`governor`](https://docs.rs/governor) crate. Limits are per instance.
//! - [`RedisBackend`](redis::RedisBackend) (feature `redis`): buckets in Redis or Redis
//!   Cluster, one limit shared by every instance.
//! - [`PostgresBackend`](postgres::PostgresBackend) (feature `postgres`) and
//!   [`MysqlBackend`](mysql::MysqlBackend) (feature `mysql`): buckets in a SQL database, one
//!   limit shared by every instance.
//!
//! The remote backends share their resilience (timeouts, failure policy, circuit breaker,
//! deny cache, batching): [`remote`].

#[cfg(feature = "local")]
pub mod local;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "redis",
        feature = "postgres",
        feature = "mysql",
        feature = "rls-client"
    )))
)]
pub mod remote;
#[cfg(feature = "rls-client")]
#[cfg_attr(docsrs, doc(cfg(feature = "rls-client")))]
pub mod rls;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod sql;
#[cfg_attr(not(feature = "local"), allow(dead_code))]
pub(crate) mod window;

use std::future::Future;
use std::num::NonZeroU32;
use std::time::Duration;

use smallvec::SmallVec;

use crate::quota::QuotaParams;
use crate::{BackendError, ConfigError, Key, Policy};

#[cfg(feature = "local")]
pub use local::{LocalBackend, WhenFull};

/// A store of rate-limit buckets.
///
/// Implementations must be safe to call from many tasks at once, and a decision must be atomic
/// per key: two concurrent requests on the same key never both take the last unit.
pub trait Backend: Send + Sync + 'static {
    /// A policy prepared for this backend (pre-computed parameters, handles to buckets).
    type Policy: Send + Sync + 'static;

    /// The future of a decision. Backends that decide in memory return an immediately ready
    /// future (`std::future::Ready`), which the layer resolves without allocating.
    type Future: Future<Output = Result<Decision, BackendError>> + Send + Unpin + 'static;

    /// Prepares `policy`, whose quotas have already been validated into `params` (one per
    /// quota, in order). Called when a layer is built and when policies are replaced at run
    /// time, never per request.
    fn prepare(&self, policy: &Policy, params: &[QuotaParams])
    -> Result<Self::Policy, ConfigError>;

    /// Decides whether a request of `cost` units on `key` may pass all quotas of `policy`, and
    /// takes the units from every bucket when it may.
    fn decide(&self, policy: &Self::Policy, key: &Key, cost: NonZeroU32) -> Self::Future;

    /// A request of `cost` units on `key` as `mode` says: [`Mode::Decide`] is
    /// [`decide`](Self::decide); [`Mode::Reserve`] takes the units if the wait they imply is
    /// within a maximum (the decision's [`wait`](Decision::wait) says how long to wait before
    /// going on); [`Mode::Peek`] answers what a decision would say, taking nothing.
    fn decide_with(
        &self,
        policy: &Self::Policy,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> Self::Future;

    /// Forgets `key`'s buckets under `policy`: its next request finds them full (an operator
    /// forgiving a client), and its block (a penalty) is lifted. Requests in flight keep the
    /// slots of a concurrent quota: they still run, and give their slots back when they end;
    /// the cap on requests in flight holds through a reset. The same on every store of this
    /// crate (in the conformance suite). The default answers that the backend cannot.
    fn reset(&self, policy: &Self::Policy, key: &Key) -> ResetFuture {
        let _ = (policy, key);
        Box::pin(std::future::ready(Err(BackendError::new(
            crate::BackendErrorKind::Protocol,
            "this backend cannot reset keys",
        ))))
    }

    /// This backend's clock, in nanoseconds from a fixed origin of its own: how a settlement
    /// measures how long ago its request was admitted ([`Mode::Refund`]'s `admitted_ago`), so
    /// that a backend deciding on an injected clock (a test's
    /// [`ManualClock`](https://docs.rs/tollgate/latest/tollgate/testing/struct.ManualClock.html))
    /// is given that clock's times, not the system's. The default reads the system's monotonic
    /// clock; a backend of your own with a clock of its own should read that one.
    fn now_ns(&self) -> u64 {
        static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let origin = ORIGIN.get_or_init(std::time::Instant::now);
        u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The Unix time now on this backend's clock: the one its calendar windows are counted on,
    /// so that what shows a reset as a time of day (the [status endpoint](crate::status))
    /// agrees with the decisions (an injected clock's time in tests, the store's where the
    /// backend keeps in step with it). The default reads the system's wall clock.
    fn unix_time(&self) -> Duration {
        system_unix_time()
    }

    /// Names the store the buckets live in, for logs, without credentials: layers built on
    /// backends naming the same store share the buckets of their same-named policies, and
    /// `build()` warns when two layers built separately do. `None` (the default) when unknown.
    fn store_id(&self) -> Option<String> {
        None
    }
}

/// The system's wall clock as a Unix time (zero before the epoch): [`Backend::unix_time`]'s
/// default, and the stores' where no clock of their own is set.
pub(crate) fn system_unix_time() -> Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// The future of [`Backend::reset`]: rare, so boxed.
pub type ResetFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<(), BackendError>> + Send + 'static>>;

/// The longest wait a reservation accepts: longer ones count as a day.
const MAX_RESERVE: Duration = Duration::from_secs(86_400);

/// How [`Backend::decide_with`] treats a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Mode {
    /// Take the units if they are there now, as [`Backend::decide`].
    #[default]
    Decide,
    /// Take the units now if the wait they imply is at most `max_wait`: a reservation. The
    /// decision is allowed with a [`wait`](Decision::wait) (zero when the units are there
    /// now), and the caller waits that long before going on. Reservations are first come,
    /// first served and exact under contention: the bucket counts the request at the time it
    /// will go on, so that `n` callers sharing one bucket go on one emission interval apart.
    ///
    /// GCRA quotas reserve; window quotas cannot count into a window that has not begun, so
    /// a policy with a window quota reserves only what every quota has now, waiting for
    /// nothing (its denial's `retry_after` then tells when to ask again).
    Reserve {
        /// The longest wait the caller accepts (at most a day: longer counts as a day).
        max_wait: Duration,
    },
    /// What [`Decide`](Mode::Decide) would answer now, taking nothing.
    Peek,
    /// A settlement: give back `cost` units taken `admitted_ago` (the response showed that the
    /// request does not count, or cost less than admitted). A bucket never fills past full,
    /// and a window gives units back only to the (sub-)window that counted them: units whose
    /// time has passed are gone. Always allowed; the states are the quotas' after the refund.
    Refund {
        /// How long ago the units were taken.
        admitted_ago: Duration,
    },
    /// A settlement: take `cost` more units whatever the bucket holds (the response showed that
    /// the request cost more than admitted). A bucket taken past empty is in debt: requests
    /// are refused until it is repaid, and their `retry_after` says when. Always allowed; the
    /// states are the buckets' after the debit.
    Debit,
    /// [`Decide`](Mode::Decide), and the request holds a slot of every concurrent quota
    /// ([`Quota::concurrent`](crate::Quota::concurrent)) under the lease `lease` (an id unique
    /// to the request) until [`Release`](Mode::Release) gives it back, or, in a shared store,
    /// the quota's lease time passes.
    Hold {
        /// The request's lease id.
        lease: u64,
    },
    /// The end of a request: give back the slot it holds under `lease` in every concurrent
    /// quota; rate quotas are untouched. A lease already given back (or expired) gives back
    /// nothing. Always allowed; the states are the concurrent quotas' after the release.
    Release {
        /// The lease id the request was admitted with ([`Hold`](Mode::Hold)).
        lease: u64,
    },
}

impl Mode {
    /// The longest wait of a reservation, in nanoseconds (zero for the other modes).
    #[cfg_attr(not(feature = "local"), allow(dead_code))]
    pub(crate) fn max_wait_ns(self) -> u64 {
        match self {
            // At most a day: a longer wait is not a rate limiter's, and unbounded waits would
            // push a bucket's arrival time past what the stores can hold.
            Mode::Reserve { max_wait } => {
                u64::try_from(max_wait.min(MAX_RESERVE).as_nanos()).unwrap_or(u64::MAX)
            }
            _ => 0,
        }
    }

    /// How the stores' scripts and procedures receive this mode: `(arg, op)`, op 0 a decision
    /// (`arg` a reservation's longest wait in ns, 0 for a decision), 1 a peek, 2 a decision
    /// holding a slot under the lease id `arg`, 3 a refund of units taken `arg` µs ago, 4 a
    /// debit, 5 the release of the lease `arg`.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn op_arg(self) -> (u64, u64) {
        match self {
            Mode::Peek => (0, 1),
            Mode::Hold { lease } => (lease, 2),
            Mode::Refund { admitted_ago } => (
                u64::try_from(admitted_ago.as_micros()).unwrap_or(u64::MAX),
                3,
            ),
            Mode::Debit => (0, 4),
            Mode::Release { lease } => (lease, 5),
            Mode::Decide | Mode::Reserve { .. } => (self.max_wait_ns(), 0),
        }
    }

    /// Whether this is a settlement ([`Refund`](Mode::Refund), [`Debit`](Mode::Debit) or
    /// [`Release`](Mode::Release)).
    pub fn is_settlement(self) -> bool {
        matches!(
            self,
            Mode::Refund { .. } | Mode::Debit | Mode::Release { .. }
        )
    }
}

/// What a backend decided for one request, quota by quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    quotas: SmallVec<[QuotaState; 2]>,
    by: DecidedBy,
    /// Refused because the key is blocked (`Policy::block_for`).
    blocked: bool,
    wait: Duration,
    /// Headers the store asks to add to the response (an RLS server's
    /// `response_headers_to_add`), where the backend was told to pass them on.
    headers: Option<ResponseHeaders>,
}

/// Headers a backend passes on to the response of a request it decided (see
/// [`Decision::response_headers`]): shared, so that a decision cloned (or replayed from a
/// cache) carries them without copying.
pub type ResponseHeaders = std::sync::Arc<[(http::HeaderName, http::HeaderValue)]>;

/// Who made a [`Decision`]: the store, or a failure policy standing in for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DecidedBy {
    /// The backend's store (or a cache of its answers): the normal case.
    #[default]
    Store,
    /// The store failed and the request is let through unlimited (fail open).
    FailOpen,
    /// The store failed and a local backend decided instead.
    FallbackLocal,
}

impl Decision {
    /// A decision made of the states of the quotas that were evaluated, in policy order. The
    /// request is allowed when every state is allowed.
    ///
    /// A request that can never fit (a state [`Outcome::NeverFits`]) is reported by the first
    /// such quota alone on every backend of this crate (see [`quotas`](Self::quotas)); a
    /// backend of your own should do the same.
    pub fn new(quotas: impl IntoIterator<Item = QuotaState>) -> Self {
        Decision {
            quotas: quotas.into_iter().collect(),
            by: DecidedBy::Store,
            blocked: false,
            wait: Duration::ZERO,
            headers: None,
        }
    }

    /// [`new`](Self::new) for states already gathered as a decision keeps them: moved as they
    /// are, not collected one by one again.
    #[cfg_attr(not(feature = "local"), allow(dead_code))]
    #[inline]
    pub(crate) fn from_states(quotas: SmallVec<[QuotaState; 2]>) -> Self {
        Decision {
            quotas,
            by: DecidedBy::Store,
            blocked: false,
            wait: Duration::ZERO,
            headers: None,
        }
    }

    /// The same decision, reported as every backend reports it: a request that can never fit
    /// by the first quota it cannot fit alone, whatever the others said (what they have is of
    /// no use to a request that can never pass; the local backend refuses it before looking
    /// at them). For stores that evaluate every quota.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn never_fits_alone(mut self) -> Self {
        if self.quotas.len() > 1
            && let Some(q) = self.quotas.iter().find(|q| q.outcome == Outcome::NeverFits)
        {
            let q = *q;
            self.quotas.clear();
            self.quotas.push(q);
        }
        self
    }

    /// A refusal because the key is blocked for `left` more (a penalty,
    /// [`Policy::block_for`](crate::Policy::block_for)): reported by every quota of the policy
    /// (`params`, in policy order), each with nothing remaining and `retry_after` and
    /// `reset_after` both at the block's end: nothing of any quota can be had meanwhile.
    pub fn blocked(params: &[QuotaParams], left: Duration) -> Self {
        let states = params.iter().enumerate().map(|(index, p)| QuotaState {
            index,
            outcome: Outcome::Denied { retry_after: left },
            limit: p.burst.get(),
            remaining: 0,
            reset_after: left,
        });
        Decision {
            blocked: true,
            ..Decision::new(states)
        }
    }

    /// Whether the request was refused because its key is blocked
    /// ([`Policy::block_for`](crate::Policy::block_for)).
    #[inline]
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// The same decision, made by `by` (a failure policy of a remote backend).
    pub fn decided_by(mut self, by: DecidedBy) -> Self {
        self.by = by;
        self
    }

    /// The same decision, with headers to add to the request's response (allowed or
    /// refused), as an RLS server's `response_headers_to_add` asks
    /// ([`RlsBackendBuilder::pass_response_headers`](crate::backend::rls::RlsBackendBuilder::pass_response_headers)).
    /// The layer adds each after its own fields, unless the response already has a header of
    /// that name (the `RateLimit` fields, `Retry-After`, or the service's own).
    pub fn with_response_headers(mut self, headers: ResponseHeaders) -> Self {
        self.headers = (!headers.is_empty()).then_some(headers);
        self
    }

    /// The headers the backend passes on to the response (none unless it was asked to: see
    /// [`with_response_headers`](Self::with_response_headers)).
    #[inline]
    pub fn response_headers(&self) -> &[(http::HeaderName, http::HeaderValue)] {
        self.headers.as_deref().unwrap_or(&[])
    }

    /// The shared headers of [`response_headers`](Self::response_headers), if any.
    #[inline]
    pub(crate) fn shared_response_headers(&self) -> Option<&ResponseHeaders> {
        self.headers.as_ref()
    }

    /// The same decision, allowed after waiting `wait` (a reservation).
    pub fn after(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// For an allowed reservation ([`Mode::Reserve`]), how long the caller waits before going
    /// on: its units are taken, counted at that time. Zero otherwise.
    #[inline]
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// Who made the decision.
    #[inline]
    pub fn made_by(&self) -> DecidedBy {
        self.by
    }

    /// Whether the request may pass.
    #[inline]
    pub fn is_allowed(&self) -> bool {
        self.quotas.iter().all(|q| q.outcome == Outcome::Allowed)
    }

    /// The evaluated quotas. A backend that stops at the first denying quota (the local
    /// backend) reports only that quota: what the quotas before it took was given back, so
    /// their states as the decision saw them no longer hold. A cost larger than a
    /// quota's burst is reported by that quota alone, on every backend (see
    /// [`new`](Self::new)).
    #[inline]
    pub fn quotas(&self) -> &[QuotaState] {
        &self.quotas
    }

    /// How long until the request could pass: the longest wait over the denying quotas.
    /// `None` when allowed, or when it can never pass because its cost exceeds a burst.
    pub fn retry_after(&self) -> Option<Duration> {
        let mut wait = None;
        for q in &self.quotas {
            match q.outcome {
                Outcome::Allowed => {}
                Outcome::Denied { retry_after } => {
                    wait = Some(wait.map_or(retry_after, |w: Duration| w.max(retry_after)));
                }
                Outcome::NeverFits => return None,
            }
        }
        wait
    }

    /// Whether the request's cost exceeds the burst of some quota: it can never pass.
    #[inline]
    pub fn never_fits(&self) -> bool {
        self.quotas.iter().any(|q| q.outcome == Outcome::NeverFits)
    }

    /// The quota a client should watch: for a denial, the denying quota with the longest
    /// wait (the one `Retry-After` comes from); otherwise the quota with the fewest remaining
    /// units.
    pub fn tightest(&self) -> Option<&QuotaState> {
        if self.is_allowed() {
            self.quotas.iter().min_by_key(|q| (q.remaining, q.limit))
        } else {
            // A quota the request can never fit first, then the longest wait.
            self.quotas
                .iter()
                .filter(|q| q.outcome != Outcome::Allowed)
                .max_by_key(|q| match q.outcome {
                    Outcome::Denied { retry_after } => (false, retry_after),
                    _ => (true, Duration::ZERO),
                })
        }
    }
}

/// The state of one quota's bucket after a decision.
///
/// Every backend builds its states with the constructors below, from the bucket's theoretical
/// arrival time or the wait it computed, so that `remaining` and `reset_after` mean the same
/// on every backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaState {
    /// The quota's position in the policy.
    pub index: usize,
    /// What this quota said.
    pub outcome: Outcome,
    /// The bucket size (burst).
    pub limit: u32,
    /// How many cost-1 requests would pass right now, after this decision.
    pub remaining: u32,
    /// The time until more quota becomes available: until `remaining` grows by one (for GCRA,
    /// the next unit back in the bucket). Zero when the bucket is full: nothing more will
    /// come. This is the `RateLimit` header's `t`; for a denied quota it is never later than
    /// the request's `retry_after`, so `Retry-After` never points before it.
    pub reset_after: Duration,
}

impl QuotaState {
    /// An allowed quota whose bucket, after the decision, has its theoretical arrival time
    /// `tat` from now (zero or less: full).
    #[inline]
    pub fn allowed(index: usize, params: &QuotaParams, tat: Duration) -> Self {
        let (remaining, reset_after) = bucket_state(params, tat);
        QuotaState {
            index,
            outcome: Outcome::Allowed,
            limit: params.burst.get(),
            remaining,
            reset_after,
        }
    }

    /// A quota that denied a request of `cost` units, which would fit after `wait`.
    ///
    /// The request lacks `ceil(wait / emission)` units, so that many fewer than `cost` are in
    /// the bucket: that is how many cost-1 requests would pass now; and the next unit comes
    /// back `wait` modulo the emission interval from now. Every backend (and the Redis deny
    /// cache) builds denials here, so they cannot drift apart.
    pub fn denied(index: usize, params: &QuotaParams, cost: NonZeroU32, wait: Duration) -> Self {
        let t = params.emission_ns.max(1);
        let wait_ns = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        let available = u64::from(cost.get()).saturating_sub(wait_ns.div_ceil(t));
        let remaining = u32::try_from(available)
            .unwrap_or(0)
            .min(cost.get() - 1)
            .min(params.burst.get());
        QuotaState {
            index,
            outcome: Outcome::Denied { retry_after: wait },
            limit: params.burst.get(),
            remaining,
            reset_after: Duration::from_nanos(next_unit(wait_ns, t)),
        }
    }

    /// A quota whose burst is smaller than the request's cost, with its bucket as it is
    /// (nothing was taken): theoretical arrival time `tat` from now.
    pub fn never_fits(index: usize, params: &QuotaParams, tat: Duration) -> Self {
        let (remaining, reset_after) = bucket_state(params, tat);
        QuotaState {
            index,
            outcome: Outcome::NeverFits,
            limit: params.burst.get(),
            remaining,
            reset_after,
        }
    }
}

/// `remaining` and `reset_after` of a GCRA bucket whose theoretical arrival time is `tat` from
/// now: a full bucket holds `burst * T` of time, and a unit comes back every `T`.
#[inline]
fn bucket_state(params: &QuotaParams, tat: Duration) -> (u32, Duration) {
    let t = params.emission_ns.max(1);
    let burst = params.burst.get();
    let tat = u64::try_from(tat.as_nanos()).unwrap_or(u64::MAX);
    let full = t.saturating_mul(u64::from(burst));
    let remaining = u32::try_from(full.saturating_sub(tat) / t)
        .unwrap_or(u32::MAX)
        .min(burst);
    let reset = if remaining == burst {
        0
    } else {
        next_unit(tat, t)
    };
    (remaining, Duration::from_nanos(reset))
}

/// Nanoseconds until the next unit comes back, `ns` from now being a whole number of units
/// later than it (units come back every `t` ns): `ns` modulo `t`, or `t` when it divides.
#[inline]
fn next_unit(ns: u64, t: u64) -> u64 {
    if ns == 0 { 0 } else { (ns - 1) % t + 1 }
}

/// One quota's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The units were taken.
    Allowed,
    /// Not enough units now; the same request would pass after `retry_after`.
    Denied {
        /// Time until the request's cost fits.
        retry_after: Duration,
    },
    /// The cost is larger than the burst: this request can never pass.
    NeverFits,
}

/// Warnings given at most once a minute.
#[cfg(any(
    feature = "local",
    feature = "redis",
    feature = "postgres",
    feature = "mysql"
))]
pub(crate) mod throttle {
    /// A warning given at most once a minute: the first time, then once a minute at most, so
    /// that a store refusing every request does not log a line per request.
    #[derive(Debug, Default)]
    pub(crate) struct OnceAMinute {
        /// When it was last given (ns on the caller's clock, plus one; 0: never).
        last_ns: std::sync::atomic::AtomicU64,
    }

    impl OnceAMinute {
        /// Whether to give the warning at `now_ns` (a monotonic reading of the caller's clock):
        /// true for one caller at a time, at most once a minute.
        pub(crate) fn now(&self, now_ns: u64) -> bool {
            let now = now_ns.saturating_add(1);
            use std::sync::atomic::Ordering::{AcqRel, Relaxed};
            let last = self.last_ns.load(Relaxed);
            (last == 0 || now >= last.saturating_add(60_000_000_000))
                && (self.last_ns)
                    .compare_exchange(last, now, AcqRel, Relaxed)
                    .is_ok()
        }
    }
}

/// A lease id unique to a request: a counter from a random start per process, so that the
/// instances sharing a store do not give out the same ids.
pub(crate) fn next_lease() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: std::sync::OnceLock<AtomicU64> = std::sync::OnceLock::new();
    let next = NEXT.get_or_init(|| {
        let start = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        AtomicU64::new(start)
    });
    // Never 0, which the stores read as no lease.
    next.fetch_add(1, Ordering::Relaxed).max(1)
}

/// The error for a policy that settles on a store that does not settle yet.
#[cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn unsupported(policy: &crate::Policy, store: &str) -> crate::ConfigError {
    // What the policy asks for that the store lacks: slots and blocks first, which a store
    // that settles may still lack; settling only when it is all the policy asks for.
    let blocking = (policy.quotas().iter()).find(|q| q.block().is_some());
    let (option, what) = if policy.holds_slots() {
        ("Quota::concurrent", "caps requests in flight".to_owned())
    } else if let Some(quota) = blocking.filter(|_| policy.block_mask() != 0) {
        (
            "Quota::block_for",
            format!("blocks keys once its quota \"{quota}\" refuses"),
        )
    } else if policy.block().is_some() {
        (
            "Policy::block_for",
            "blocks keys once refused (`block_for`)".to_owned(),
        )
    } else {
        (
            "Policy::charge_when / Policy::cost_from",
            "settles requests after their response".to_owned(),
        )
    };
    crate::ConfigError::Invalid {
        option,
        reason: format!(
            "policy `{}` {what}, which {store} does not do yet (the local backend, Redis in its \
             exact mode, Redis Cluster, PostgreSQL and MySQL do)",
            policy.name()
        ),
    }
}

/// The error for a calendar quota on a store that does not count calendars (`None` when the
/// policy has none).
#[cfg(feature = "calendar")]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn calendar_unsupported(
    policy: &crate::Policy,
    params: &[QuotaParams],
    store: &str,
    why: &str,
) -> Option<crate::ConfigError> {
    let i =
        (params.iter()).position(|p| matches!(p.kind, crate::quota::QuotaKind::Calendar { .. }))?;
    Some(crate::ConfigError::Invalid {
        option: "Quota::calendar",
        reason: format!(
            "policy `{}`: quota \"{}\": {store} does not count calendar quotas: {why}",
            policy.name(),
            policy.quotas()[i]
        ),
    })
}
