//! A limiter for code that is not a request handler: jobs, queue consumers, loops calling a
//! partner's API. The same [`Policy`], [`Key`]s and backends as the layer, without tower.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::{Duration, Instant};
//! use tollgate::backend::LocalBackend;
//! use tollgate::limiter::Limiter;
//! use tollgate::{Key, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A partner allows 20 calls per second, in bursts of at most 2.
//! let limiter = Limiter::new(Policy::new("partner", Quota::per_second(20).burst(2)), LocalBackend::new())?;
//! let partner = Key::from_bytes("api.partner.example")?;
//! let one = NonZeroU32::MIN;
//!
//! let started = Instant::now();
//! for _ in 0..4 {
//!     // Waits for its turn (up to a second), then goes on: 2 at once, then one every 50 ms.
//!     limiter.acquire(&partner, one, Duration::from_secs(1)).await?;
//! }
//! assert!(started.elapsed() >= Duration::from_millis(100));
//!
//! // Check without waiting, look without taking, forgive.
//! assert!(!limiter.check(&partner, one).await?.is_allowed());
//! assert!(!limiter.peek(&partner, one).await?.is_allowed());
//! limiter.reset(&partner).await?;
//! assert!(limiter.check(&partner, one).await?.is_allowed());
//! # Ok(()) }
//! ```
//!
//! # Waiting is a reservation
//!
//! [`acquire`](Limiter::acquire) does not poll. It asks the backend once to take the units now
//! if the wait they imply is within the maximum ([`Mode::Reserve`]): for a GCRA quota the
//! backend moves the bucket's theoretical arrival time as if the request happened when it will
//! go on, and answers that wait; the caller then sleeps once. So waiters are served first come,
//! first served, exactly at the quota's rate even under contention, and processes sharing a
//! Redis or SQL backend share one rate without a thundering herd: every backend (local, Redis,
//! PostgreSQL, MySQL) reserves the same way, checked by one conformance test.
//!
//! Window quotas (fixed and sliding) cannot count into a window that has not begun: with one in
//! the policy, `acquire` takes the units when every quota has them now, and otherwise sleeps
//! until the denial's `retry_after` and asks again (polling: several waiters may wake at once,
//! and one gets the room). Prefer GCRA quotas for outbound limits.
//!
//! # Permits: requests in flight, and a cost known at the end
//!
//! [`admit`](Limiter::admit) is what the layer does for a request: it takes the units now (or
//! refuses), holds a slot of the policy's concurrent quota if it has one
//! ([`Quota::concurrent`](crate::Quota::concurrent)), and returns a [`Permit`]. Dropping the
//! permit ends the work: its slot is given back. [`Permit::settle`] ends it with the work's
//! real cost, the difference from the admitted cost debited or refunded (the tokens a call
//! used, say), on the stores that settle (the local backend and Redis).
//!
//! ```
//! use std::num::NonZeroU32;
//! use tollgate::backend::LocalBackend;
//! use tollgate::limiter::Limiter;
//! use tollgate::{Key, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Two jobs at once per tenant, and 1000 tokens an hour.
//! let policy = Policy::new("jobs", Quota::concurrent(2)).and(Quota::per_hour(1000));
//! let limiter = Limiter::new(policy, LocalBackend::new())?;
//! let tenant = Key::from_bytes("tenant-7")?;
//! let one = NonZeroU32::MIN;
//!
//! let first = limiter.admit(&tenant, one).await?;
//! let second = limiter.admit(&tenant, one).await?;
//! assert!(limiter.admit(&tenant, one).await.is_err(), "two in flight");
//! drop(first); // done: its slot is back
//! let third = limiter.admit(&tenant, one).await?;
//! // The second job used 400 tokens: 399 more than admitted.
//! second.settle(400).await?;
//! third.settle(1).await?;
//! // 402 tokens used (the refusal took none); a peek says what one more would leave.
//! let d = limiter.peek(&tenant, one).await?;
//! assert_eq!(d.quotas()[1].remaining, 1000 - 402 - 1);
//! # Ok(()) }
//! ```
//!
//! # Following the upstream's own limit
//!
//! [`obey`](Limiter::obey) reads the answer to a call made for a key: a `429` or `503` with
//! `Retry-After`, gRPC's pushback, or, before any refusal, a `RateLimit` field saying a policy
//! has nothing left (`r=0;t=N`; the older `X-RateLimit-Remaining: 0` with its reset) pauses
//! the key for that long. [`acquire`](Limiter::acquire) then waits the pause out before it
//! reserves (or answers [`AcquireError::Paused`] when the pause is longer than its wait), and
//! [`admit`](Limiter::admit) refuses with it; [`check`](Limiter::check),
//! [`peek`](Limiter::peek) and [`reserve`](Limiter::reserve) ask the backend only. Pauses
//! are per limiter (its clones share them), in memory, for at most 65 536 keys at once.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::Duration;
//! use tollgate::backend::LocalBackend;
//! use tollgate::limiter::{AcquireError, Limiter};
//! use tollgate::{Key, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limiter = Limiter::new(Policy::new("partner", Quota::per_second(50)), LocalBackend::new())?;
//! let partner = Key::from_bytes("api.partner.example")?;
//! // The partner's answer to a call: its own limit has nothing left for 30 s.
//! let answer = http::Response::builder()
//!     .header("ratelimit", r#""default";r=0;t=30"#)
//!     .body(())?;
//! let paused = limiter.obey(&partner, &answer).unwrap(); // what is left of the 30 s
//! assert!(paused > Duration::from_secs(29));
//! let err = limiter.acquire(&partner, NonZeroU32::MIN, Duration::from_secs(1)).await;
//! assert!(matches!(err, Err(AcquireError::Paused(_))), "not before the partner's reset");
//! # Ok(()) }
//! ```
//!
//! **Cancellation.** A reservation is taken before the sleep: if the future of `acquire` is
//! dropped while it sleeps (a timeout, a cancelled task), the units stay spent. Giving them back
//! is not safe in general, since later reservations were counted after them; the cost is that a
//! cancelled waiter's units go unused.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::next_lease;
use crate::backend::{Backend, Decision, Mode};
use crate::settle::{Landing, refund_at, send, took};
use crate::wait::Pauses;
use crate::{BackendError, ConfigError, Key, Policy};

/// A policy on a backend, for code that is not a request handler. Cheap to clone: clones share
/// the prepared policy and the backend's buckets.
pub struct Limiter<B: Backend> {
    inner: Arc<Inner<B>>,
}

struct Inner<B: Backend> {
    backend: B,
    policy: B::Policy,
    name: String,
    /// Whether the policy has a concurrent quota (its permits hold a slot).
    holds_slots: bool,
    /// Keys an upstream asked to slow down, until when ([`Limiter::obey`]).
    pauses: Pauses,
    /// An adaptive concurrency limit per key ([`Limiter::adapt`]).
    adaptive: std::sync::OnceLock<crate::adaptive::Upstreams>,
}

impl<B: Backend> Clone for Limiter<B> {
    fn clone(&self) -> Self {
        Limiter {
            inner: self.inner.clone(),
        }
    }
}

impl<B: Backend> fmt::Debug for Limiter<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("policy", &self.inner.name)
            .finish_non_exhaustive()
    }
}

/// Why [`Limiter::acquire`] did not get its units.
#[derive(Debug)]
#[non_exhaustive]
pub enum AcquireError {
    /// The units would come later than the longest wait: nothing was taken. The decision
    /// says when they would (its [`retry_after`](Decision::retry_after)).
    TooLong(Decision),
    /// The cost is larger than a quota's burst: it can never be acquired.
    NeverFits(Decision),
    /// The backend could not decide (and its failure policy is to fail closed).
    Backend(BackendError),
    /// The upstream asked to slow down (`429` or `503` with `Retry-After`, gRPC
    /// `grpc-retry-pushback-ms`, a `RateLimit` field with nothing left) and the key is paused
    /// for this long yet, longer than the wait allowed ([`Limiter::obey`]; the reqwest
    /// middleware's `obey_retry_after`, feature `reqwest`). Nothing was taken.
    Paused(Duration),
    /// The key's adaptive concurrency limit is reached, or its upstream asked to wait
    /// ([`Limiter::adapt`]). Nothing was taken.
    Overloaded(crate::adaptive::Refused),
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireError::TooLong(d) => match d.retry_after() {
                Some(wait) => write!(f, "rate limited: the units come back in {wait:?}"),
                None => f.write_str("rate limited"),
            },
            AcquireError::NeverFits(_) => f.write_str("the cost is larger than a quota's burst"),
            AcquireError::Backend(err) => write!(f, "the backend could not decide: {err}"),
            AcquireError::Paused(left) => {
                write!(
                    f,
                    "the upstream asked to slow down: paused for {left:?} more"
                )
            }
            AcquireError::Overloaded(refused) => write!(f, "{refused}"),
        }
    }
}

impl std::error::Error for AcquireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AcquireError::Backend(err) => Some(err),
            _ => None,
        }
    }
}

impl From<BackendError> for AcquireError {
    fn from(err: BackendError) -> Self {
        AcquireError::Backend(err)
    }
}

impl<B: Backend> Limiter<B> {
    /// `policy` on `backend`: the same checks as the layer's `build()` (quotas, names).
    pub fn new(policy: Policy, backend: B) -> Result<Self, ConfigError> {
        // Permits settle: a refund may make a denial of another caller stale.
        let policy = policy.given_back();
        let params = policy.validate()?;
        let prepared = backend.prepare(&policy, &params)?;
        Ok(Limiter {
            inner: Arc::new(Inner {
                backend,
                policy: prepared,
                name: policy.name().to_owned(),
                holds_slots: policy.holds_slots(),
                pauses: Pauses::default(),
                adaptive: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Reads an upstream's answer to a call made for `key`, and pauses the key as it asks (see
    /// [the module docs](self#following-the-upstreams-own-limit)); answers how long `key` is
    /// paused now, if it is. An answer that asks nothing (or a field that cannot be read)
    /// pauses nothing; a pause is at most an hour, and a shorter one never cuts a longer one
    /// short.
    pub fn obey<T>(&self, key: &Key, answer: &http::Response<T>) -> Option<Duration> {
        self.obey_parts(key, answer.status(), answer.headers())
    }

    /// [`obey`](Self::obey) for an answer given as its status and headers (a reqwest
    /// response, say).
    pub fn obey_parts(
        &self,
        key: &Key,
        status: http::StatusCode,
        headers: &http::HeaderMap,
    ) -> Option<Duration> {
        let pauses = &self.inner.pauses;
        pauses.note_answer(key, status, headers);
        pauses.remaining(key)
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.inner.backend
    }

    /// Decides once: takes `cost` units from `key`'s buckets if they are there now.
    pub async fn check(&self, key: &Key, cost: NonZeroU32) -> Result<Decision, BackendError> {
        let i = &self.inner;
        i.backend.decide(&i.policy, key, cost).await
    }

    /// What [`check`](Self::check) would answer now, taking nothing.
    pub async fn peek(&self, key: &Key, cost: NonZeroU32) -> Result<Decision, BackendError> {
        let i = &self.inner;
        i.backend
            .decide_with(&i.policy, key, cost, Mode::Peek)
            .await
    }

    /// Forgets `key`'s buckets: its next request finds them full (an operator forgiving a
    /// client). Permits still held keep their slots of a concurrent quota, and give them back
    /// when dropped (see [`Backend::reset`]).
    pub async fn reset(&self, key: &Key) -> Result<(), BackendError> {
        let i = &self.inner;
        i.backend.reset(&i.policy, key).await
    }

    /// Takes `cost` units if they are there within `max_wait`, without waiting: an allowed
    /// decision's [`wait`](Decision::wait) is how long the caller must wait before going on
    /// (see the [module docs](self)). [`acquire`](Self::acquire) is this, then the sleep.
    pub async fn reserve(
        &self,
        key: &Key,
        cost: NonZeroU32,
        max_wait: Duration,
    ) -> Result<Decision, BackendError> {
        let i = &self.inner;
        let mode = Mode::Reserve { max_wait };
        i.backend.decide_with(&i.policy, key, cost, mode).await
    }

    /// Admits work of `cost` units on `key` now, or refuses it ([`AcquireError::TooLong`]
    /// with the refusal, [`AcquireError::NeverFits`]): the units are taken, and a slot of the
    /// policy's concurrent quota is held, until the [`Permit`] is dropped or settled (see the
    /// [module docs](self)).
    pub async fn admit(&self, key: &Key, cost: NonZeroU32) -> Result<Permit<B>, AcquireError> {
        let i = &self.inner;
        if let Some(left) = i.pauses.remaining(key) {
            return Err(AcquireError::Paused(left));
        }
        // A slot of the key's adaptive limit first (in memory): refused, nothing is taken;
        // taken and the quota refuses, it goes back as no sample.
        let adaptive = match i.adaptive.get() {
            Some(upstreams) => {
                Some((upstreams.try_acquire(&key.to_string())).map_err(AcquireError::Overloaded)?)
            }
            None => None,
        };
        let lease = next_lease();
        let decision = (i.backend).decide_with(&i.policy, key, cost, Mode::Hold { lease });
        // Dropped before the store answers, the slot it may take is given back when it does.
        let release = (i.holds_slots).then(|| (self.clone(), key.clone()));
        let decision = Landing::new(decision, move |result| {
            if let Some((limiter, key)) = release
                && took(&result)
            {
                limiter.release(&key, lease);
            }
        })
        .await?;
        if decision.never_fits() {
            return Err(AcquireError::NeverFits(decision));
        }
        if !decision.is_allowed() {
            return Err(AcquireError::TooLong(decision));
        }
        Ok(Permit {
            limiter: self.clone(),
            key: key.clone(),
            cost,
            lease,
            admitted: i.backend.now_ns(),
            decision,
            open: i.holds_slots,
            adaptive,
        })
    }

    /// Adapts how much work runs at once per key to what each key's upstream shows, with an
    /// adaptive limit per key from `upstreams` (named by the key as it displays):
    /// [`admit`](Self::admit) then takes a slot of the key's limit too, and refuses with
    /// [`AcquireError::Overloaded`] over it or while the upstream asked to wait. End a permit
    /// with what the upstream answered ([`Permit::observe`]), or
    /// [`Permit::overloaded`] for a timeout; a permit settled or dropped otherwise is a
    /// sample of the work's time. Clones share the limits. Given once: a second call (on this
    /// limiter or a clone) is refused with a [`ConfigError`], rather than ignored.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use tollgate::adaptive::{AdaptiveLimit, Upstreams};
    /// use tollgate::backend::LocalBackend;
    /// use tollgate::limiter::{AcquireError, Limiter};
    /// use tollgate::{Key, Policy, Quota};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let upstreams = Upstreams::new(|name| AdaptiveLimit::builder().name(name).initial(1).range(1, 50))?;
    /// let limiter = Limiter::new(Policy::new("partner", Quota::per_second(100)), LocalBackend::new())?
    ///     .adapt(upstreams)?;
    /// let partner = Key::from_bytes("api.partner.example")?;
    /// let mut permit = limiter.admit(&partner, NonZeroU32::MIN).await?;
    /// // One call at once for now: a second is refused before it is made.
    /// let second = limiter.admit(&partner, NonZeroU32::MIN).await;
    /// assert!(matches!(second, Err(AcquireError::Overloaded(_))));
    /// let answer = http::Response::builder().status(200).body(())?;
    /// permit.observe(answer.status(), answer.headers());
    /// # Ok(()) }
    /// ```
    pub fn adapt(self, upstreams: crate::adaptive::Upstreams) -> Result<Self, ConfigError> {
        match self.inner.adaptive.set(upstreams) {
            Ok(()) => Ok(self),
            Err(_) => Err(ConfigError::Invalid {
                option: "adapt",
                reason: format!(
                    "the limiter of policy {:?} already has its adaptive limits: they are given once",
                    self.inner.name
                ),
            }),
        }
    }

    /// The adaptive limits per key, when [`adapt`](Self::adapt) gave them.
    pub fn adaptive_limits(&self) -> Option<&crate::adaptive::Upstreams> {
        self.inner.adaptive.get()
    }

    /// Waits until `cost` units of `key` are this caller's, for at most `max_wait`: one
    /// reservation, then one sleep (see the [module docs](self)). Answers the decision that
    /// let it go on; with [`AcquireError::TooLong`] at once, without waiting, when the units
    /// come later than that.
    pub async fn acquire(
        &self,
        key: &Key,
        cost: NonZeroU32,
        max_wait: Duration,
    ) -> Result<Decision, AcquireError> {
        let deadline = tokio::time::Instant::now() + max_wait.min(Duration::from_secs(86_400));
        // The upstream's pause first: waited out within the wait, else refused at once.
        if let Some(paused) = self.inner.pauses.remaining(key) {
            if tokio::time::Instant::now() + paused > deadline {
                return Err(AcquireError::Paused(paused));
            }
            tokio::time::sleep(paused).await;
        }
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let decision = self.reserve(key, cost, left).await?;
            if decision.is_allowed() {
                tokio::time::sleep(decision.wait()).await;
                return Ok(decision);
            }
            if decision.never_fits() {
                return Err(AcquireError::NeverFits(decision));
            }
            match decision.retry_after() {
                // A window quota with no room now (or a bucket another caller took first):
                // ask again when it said, if that is within the wait.
                Some(wait) if wait <= left => tokio::time::sleep(wait).await,
                _ => return Err(AcquireError::TooLong(decision)),
            }
        }
    }
}

/// Work admitted by [`Limiter::admit`]: its units taken, its slot of a concurrent quota held
/// until it is dropped (the work is over) or [settled](Permit::settle).
#[must_use = "dropping a permit ends its work at once: its slot is given back"]
pub struct Permit<B: Backend> {
    limiter: Limiter<B>,
    key: Key,
    cost: NonZeroU32,
    lease: u64,
    /// When the work was admitted, on the backend's clock ([`Backend::now_ns`]).
    admitted: u64,
    decision: Decision,
    /// Whether the slot is still held (not yet given back by `settle` or the drop).
    open: bool,
    /// The slot of the key's adaptive limit, until the work's end is known ([`Limiter::adapt`]).
    adaptive: Option<crate::adaptive::OutboundPermit>,
}

impl<B: Backend> Permit<B> {
    /// The decision that admitted the work.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Ends the work, which cost `cost` units in all: the difference from the admitted cost is
    /// taken (into debt if need be) or given back (never past full), then the slot is given
    /// back. Every store settles (local, Redis, Redis Cluster, PostgreSQL, MySQL, the
    /// approximate Redis mode); the slot is given back either way.
    pub async fn settle(mut self, cost: u32) -> Result<(), BackendError> {
        if let Some(p) = self.adaptive.take() {
            p.success();
        }
        let i = &self.limiter.inner;
        let admitted = self.cost.get();
        let settlement = match cost.cmp(&admitted) {
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => {
                NonZeroU32::new(cost - admitted).map(|n| (n, Mode::Debit))
            }
            std::cmp::Ordering::Less => {
                NonZeroU32::new(admitted - cost).map(|n| (n, refund_at(&i.backend, self.admitted)))
            }
        };
        let settled = match settlement {
            Some((units, mode)) => i
                .backend
                .decide_with(&i.policy, &self.key, units, mode)
                .await
                .map(drop),
            None => Ok(()),
        };
        if !std::mem::replace(&mut self.open, false) {
            return settled;
        }
        let release = Mode::Release { lease: self.lease };
        let released = i
            .backend
            .decide_with(&i.policy, &self.key, NonZeroU32::MIN, release);
        released.await.map(drop).and(settled)
    }
}

impl<B: Backend> Permit<B> {
    /// What the work's upstream answered ([`Limiter::adapt`]): a `429` or `503` (or gRPC
    /// `RESOURCE_EXHAUSTED` / `UNAVAILABLE`) is a drop for the key's adaptive limit, and its
    /// `Retry-After` pauses the key there; anything else is a sample of the work's time.
    /// Returns whether it was a drop (false without an adaptive limit, or once told).
    pub fn observe(&mut self, status: http::StatusCode, headers: &http::HeaderMap) -> bool {
        self.adaptive
            .take()
            .is_some_and(|p| p.observe(status, headers))
    }

    /// The work showed overload without an answer (a timeout, a connection refused): a drop
    /// for the key's adaptive limit ([`Limiter::adapt`]).
    pub fn overloaded(&mut self) {
        if let Some(p) = self.adaptive.take() {
            p.dropped();
        }
    }
}

impl<B: Backend> Drop for Permit<B> {
    /// The work is over: its slot is given back (at once in memory, else in a task of its own),
    /// and its time is a sample of the key's adaptive limit if nothing else was said.
    fn drop(&mut self) {
        if let Some(p) = self.adaptive.take() {
            p.success();
        }
        if self.open {
            self.limiter.release(&self.key, self.lease);
        }
    }
}

impl<B: Backend> Limiter<B> {
    /// Gives back the slot held under `lease` on `key` (at once in memory, else in a task of
    /// its own).
    fn release(&self, key: &Key, lease: u64) {
        let i = &self.inner;
        let release = Mode::Release { lease };
        send(
            &i.backend,
            &i.policy,
            &i.name,
            key,
            NonZeroU32::MIN,
            release,
        );
    }
}

impl<B: Backend> fmt::Debug for Permit<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("policy", &self.limiter.inner.name)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}
