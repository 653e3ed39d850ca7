//! The engine of every remote backend: prepare policies, decide, and degrade as configured when
//! the store fails. A backend is this engine around its [`Store`].

use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use smallvec::SmallVec;

use super::batch::Batcher;
use super::breaker::Breaker;
use super::clock::{Clock, TestClock};
use super::deny_cache::{Budget, DenyCache};
use super::future::RemoteFuture;
use super::health::{Change, Health, StoreFailure};
use super::redact::Secrets;
use super::store::{CallError, Job, Store};
use crate::backend::local::LocalPolicy;
use crate::backend::{DecidedBy, Decision, LocalBackend};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind, ConfigError, Key, Policy};

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
    /// Return a [`BackendError`]: the layer answers `503 Service Unavailable` with
    /// `Retry-After: 1` (gRPC: `UNAVAILABLE`). Choose this where letting requests through
    /// unlimited is worse than refusing them, e.g. for an expensive upstream.
    FailClosed,
    /// Decide with an in-process [`LocalBackend`] holding the same policy: limits hold per
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

/// The engine around a store. Cheap to clone: clones share the store, breaker and counters.
pub(crate) struct Remote<S: Store> {
    pub(crate) inner: Arc<Inner<S>>,
}

impl<S: Store> Clone for Remote<S> {
    fn clone(&self) -> Self {
        Remote {
            inner: self.inner.clone(),
        }
    }
}

pub(crate) struct Inner<S: Store> {
    pub(crate) store: S,
    /// The store in a phrase for logs: `Redis at redis://127.0.0.1:6379`.
    who: String,
    /// Passwords of the configured URLs, removed from every error text shown.
    secrets: Secrets,
    health: Health,
    pub(crate) timeout: Duration,
    on_failure: FailurePolicy,
    breaker: Breaker,
    budget: Arc<Budget>,
    pub(crate) clock: Clock,
    local: Option<LocalBackend>,
    warmed: AtomicBool,
    pub(crate) counters: Counters,
    pub(crate) batcher: Batcher<S>,
    batching: bool,
}

#[derive(Default)]
pub(crate) struct Counters {
    decisions: AtomicU64,
    pub(crate) calls: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    fail_open: AtomicU64,
    fail_closed: AtomicU64,
    fallback_local: AtomicU64,
    deny_cache_hits: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A policy prepared for a remote backend: its quotas, the store's part, its own deny cache
/// and, with [`FailurePolicy::FallbackLocal`], its local twin.
pub(crate) struct RemotePolicy<S: Store> {
    pub(crate) inner: Arc<PolicyInner<S>>,
}

pub(crate) struct PolicyInner<S: Store> {
    pub(crate) params: SmallVec<[QuotaParams; 2]>,
    pub(crate) store: S::Prepared,
    deny: DenyCache,
    deny_hits: crate::metrics::DenyCacheHits,
    local: Option<LocalPolicy>,
}

impl<S: Store> RemotePolicy<S> {
    /// The policy's quotas.
    pub(crate) fn params(&self) -> &[QuotaParams] {
        &self.inner.params
    }

    /// The store's part.
    pub(crate) fn store(&self) -> &S::Prepared {
        &self.inner.store
    }

    /// Forgets the cached denial of `key` (its buckets were reset).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn forget(&self, key: &Key) {
        self.inner.deny.forget(key);
    }

    /// Denials cached for this policy now.
    pub(crate) fn deny_cache_len(&self) -> usize {
        self.inner.deny.len()
    }
}

impl<S: Store> Remote<S> {
    /// An engine around `store`; `who` names it in logs (passwords masked), `secrets` are
    /// removed from every error text shown.
    pub(crate) fn new(store: S, who: String, secrets: Secrets, opts: Options) -> Self {
        let local = (opts.on_failure == FailurePolicy::FallbackLocal).then(LocalBackend::new);
        Remote {
            inner: Arc::new(Inner {
                store,
                who,
                secrets,
                health: Health::default(),
                timeout: opts.timeout,
                on_failure: opts.on_failure,
                breaker: Breaker::new(S::KIND, opts.breaker_threshold, opts.probe_interval),
                budget: Arc::new(Budget {
                    capacity: opts.deny_cache_capacity,
                    used: AtomicUsize::new(0),
                }),
                clock: match opts.test_clock {
                    Some(c) => Clock::Test(c),
                    None => Clock::Real(std::time::Instant::now()),
                },
                local,
                warmed: AtomicBool::new(false),
                counters: Counters::default(),
                batcher: Batcher::default(),
                batching: opts.batching,
            }),
        }
    }

    /// The store.
    pub(crate) fn store(&self) -> &S {
        &self.inner.store
    }

    /// The timeout of a decision.
    pub(crate) fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The failure policy.
    pub(crate) fn on_failure(&self) -> FailurePolicy {
        self.inner.on_failure
    }

    /// The counters now.
    pub(crate) fn stats(&self) -> RemoteStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteStats {
            decisions: get(&c.decisions),
            calls: get(&c.calls),
            errors: get(&c.errors),
            timeouts: get(&c.timeouts),
            fail_open: get(&c.fail_open),
            fail_closed: get(&c.fail_closed),
            fallback_local: get(&c.fallback_local),
            deny_cache_hits: get(&c.deny_cache_hits),
            deny_cache_entries: self.inner.budget.used.load(Ordering::Relaxed),
            breaker_open: self.inner.breaker.is_open(),
            breaker_trips: self.inner.breaker.trips(),
            failing: self.inner.health.failing(),
        }
    }

    /// Prepares `policy`: the store's part, a deny cache, and the local twin for the fallback.
    /// Starts connecting in the background (once) so that the first request does not pay for
    /// the connection.
    pub(crate) fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<RemotePolicy<S>, ConfigError> {
        if params.is_empty() {
            return Err(ConfigError::QuotaCount {
                policy: policy.name().to_owned(),
                count: 0,
            });
        }
        let local = match &self.inner.local {
            Some(local) => Some(crate::backend::Backend::prepare(local, policy, params)?),
            None => None,
        };
        let store = self.inner.store.prepare(policy, params)?;
        self.warm_up();
        Ok(RemotePolicy {
            inner: Arc::new(PolicyInner {
                params: params.iter().copied().collect(),
                store,
                deny: DenyCache::new(self.inner.budget.clone()),
                deny_hits: crate::metrics::DenyCacheHits::new(policy.name()),
                local,
            }),
        })
    }

    /// Decides a request: from the deny cache, by the failure policy while the breaker is
    /// open, or by the store (batched when it can be).
    pub(crate) fn decide(
        &self,
        policy: &RemotePolicy<S>,
        key: &Key,
        cost: NonZeroU32,
    ) -> RemoteFuture {
        let p = &policy.inner;
        let inner = &self.inner;
        let now_ns = inner.clock.now_ns();
        if let Some(decision) = p.deny.get(key, cost, now_ns, &p.params) {
            bump(&inner.counters.deny_cache_hits);
            p.deny_hits.hit();
            return RemoteFuture::ready(Ok(decision));
        }
        if inner.breaker.blocks(now_ns) {
            let err = match inner.health.failing() {
                Some(cause) => BackendError::new(
                    BackendErrorKind::Unavailable,
                    format!("circuit breaker open; {} failing: {cause}", S::KIND),
                ),
                None => BackendError::new(BackendErrorKind::Unavailable, "circuit breaker open"),
            };
            return RemoteFuture::ready(inner.degrade(p, key, cost, err));
        }
        bump(&inner.counters.decisions);
        let now = tokio::time::Instant::now();
        let job = Job {
            policy: p.clone(),
            key: key.clone(),
            cost,
            sent_ns: now_ns,
            // The builders cap the timeout at an hour, so this cannot overflow; were it to,
            // an immediate timeout is better than a panic.
            deadline: now.checked_add(inner.timeout).unwrap_or(now),
        };
        // Batched: the decision joins the batching task's queue now, and the future only waits
        // for its answer: nothing boxed.
        let job = if inner.batching && inner.store.can_batch() {
            match Batcher::submit(inner, job) {
                Ok(answer) => return RemoteFuture::batched(answer),
                Err(job) => job,
            }
        } else {
            job
        };
        let inner = inner.clone();
        RemoteFuture::call(Box::pin(async move {
            let jobs = [job];
            let outcome = inner.call_alone(&jobs).await;
            inner.finish(&jobs[0], outcome)
        }))
    }

    /// Starts connecting in the background, once, when called inside a Tokio runtime.
    fn warm_up(&self) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.inner.warmed.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        handle.spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            // Long enough for the driver to report why it could not connect (refused, a wrong
            // password), rather than this timeout hiding the cause.
            let limit = inner.store.warm_up_timeout(inner.timeout);
            let result = tokio::time::timeout(limit, inner.store.ping()).await;
            match result.unwrap_or_else(|_elapsed| Err(CallError::timed_out())) {
                Ok(()) => inner.answered(),
                Err(err) => inner.failed(&err),
            }
        });
    }
}

impl<S: Store> fmt::Debug for Remote<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remote")
            .field("store", &self.inner.who)
            .field("timeout", &self.inner.timeout)
            .field("on_failure", &self.inner.on_failure)
            .field("stats", &self.stats())
            .finish()
    }
}

/// How a failed call is reported to the layer.
fn error_kind(failure: StoreFailure) -> BackendErrorKind {
    match failure {
        StoreFailure::Timeout => BackendErrorKind::Timeout,
        StoreFailure::ErrorReply => BackendErrorKind::Protocol,
        _ => BackendErrorKind::Unavailable,
    }
}

impl<S: Store> Inner<S> {
    /// The result of one call, decision by decision: for a failed call, its error for each.
    pub(crate) fn split(
        &self,
        outcome: Result<Vec<Result<Decision, BackendError>>, CallError>,
        decisions: usize,
    ) -> Vec<Result<Decision, CallOrDecision>> {
        match outcome {
            Ok(answers) => {
                let mut answers: Vec<_> = answers
                    .into_iter()
                    .map(|a| a.map_err(CallOrDecision::Decision))
                    .collect();
                // A short reply: the decisions without an answer fail on their own.
                while answers.len() < decisions {
                    answers.push(Err(CallOrDecision::Decision(BackendError::new(
                        BackendErrorKind::Protocol,
                        "the store's reply holds fewer decisions than the call",
                    ))));
                }
                answers
            }
            Err(err) => (0..decisions)
                .map(|_| Err(CallOrDecision::Call(err.clone())))
                .collect(),
        }
    }

    /// Runs one decision's call alone (no batching), within the backend's timeout.
    async fn call_alone(self: &Arc<Self>, jobs: &[Job<S>]) -> Result<Decision, CallOrDecision> {
        bump(&self.counters.calls);
        let now = self.clock.script_time();
        let outcome = match tokio::time::timeout(self.timeout, self.store.call(jobs, now)).await {
            Ok(outcome) => outcome,
            Err(_elapsed) => Err(CallError::timed_out()),
        };
        match &outcome {
            Ok(_) => self.call_answered(),
            Err(err) => self.call_failed(err, 1),
        }
        let mut answers = self.split(outcome, 1);
        answers.swap_remove(0)
    }

    /// Turns the store's answer into the decision: the deny cache learns from it, and failures
    /// degrade as configured. The breaker and the call counters have already heard of the call
    /// that carried it (once per call, not once per decision).
    pub(crate) fn finish(
        &self,
        job: &Job<S>,
        outcome: Result<Decision, CallOrDecision>,
    ) -> Result<Decision, BackendError> {
        let (p, key, cost) = (&*job.policy, &job.key, job.cost);
        let result = match outcome {
            Ok(decision) => {
                let took = self.clock.now_ns().saturating_sub(job.sent_ns);
                crate::metrics::backend_latency(S::KIND, took as f64 / 1e9);
                Ok(decision)
            }
            Err(CallOrDecision::Decision(err)) => {
                // The store answered the call but refused this decision (or the reply does not
                // fit the policy): this decision's own error, counted here.
                bump(&self.counters.errors);
                let text = self.secrets.scrub(&err.to_string()).into_owned();
                tracing::warn!(err = %text, on_failure = ?self.on_failure, "tollgate: {} refused a decision", self.who);
                Err(err)
            }
            Err(CallOrDecision::Call(err)) => Err(self.backend_error(&err)),
        };
        match result {
            Ok(decision) => {
                if decision.is_allowed() {
                    // The counts a cached denial of this key reports have just changed.
                    p.deny.forget(key);
                } else {
                    p.deny.insert(key, cost, job.sent_ns, &decision, &p.params);
                }
                Ok(decision)
            }
            Err(err) => self.degrade(p, key, cost, err),
        }
    }

    /// A call got the store's answer: it is reachable, whatever the answer says.
    pub(crate) fn call_answered(&self) {
        self.breaker.success();
        self.answered();
    }

    /// Requests answered by the failure policy so far.
    fn degraded(&self) -> u64 {
        let c = &self.counters;
        [&c.fail_open, &c.fail_closed, &c.fallback_local]
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .fold(0, u64::saturating_add)
    }

    fn meanwhile(&self) -> (&'static str, &'static str) {
        match self.on_failure {
            FailurePolicy::FailOpen => (
                "let through unlimited by fail-open",
                "requests are let through unlimited (fail open)",
            ),
            FailurePolicy::FailClosed => (
                "refused by fail-closed",
                "requests are refused (fail closed)",
            ),
            FailurePolicy::FallbackLocal => (
                "limited per instance by the local fallback",
                "requests are limited per instance (local fallback)",
            ),
        }
    }

    /// A call or probe got the store's answer: if it was failing, say once that it is back.
    pub(crate) fn answered(&self) {
        if let Some(Change::Recovered { degraded }) = self.health.answered(self.degraded()) {
            let (meanwhile, _) = self.meanwhile();
            tracing::info!(
                degraded,
                "tollgate: {} answers again; shared limits apply again \
                 ({degraded} requests were {meanwhile} meanwhile)",
                self.who
            );
        }
    }

    /// A call or probe failed: if the store was answering, or failing for another reason, say
    /// once why, and what requests get until it answers again. Calls and requests failing for
    /// the same reason afterwards log nothing more (they are counted in the stats).
    pub(crate) fn failed(&self, err: &CallError) {
        let cause = err.failure;
        let Some(Change::Failing { again }) = self.health.failed(cause, self.degraded()) else {
            return;
        };
        let error = self.secrets.scrub(&err.text).into_owned();
        let now = if again { "now " } else { "" };
        let headline = match cause {
            StoreFailure::ErrorReply => format!("{now}answers with errors"),
            cause => format!("{now}unreachable: {cause}"),
        };
        let (_, until) = self.meanwhile();
        tracing::warn!(
            %error,
            %cause,
            "tollgate: {} {headline}; {until} until it answers",
            self.who
        );
    }

    /// A `BackendError` for a failed call, with no password in its text.
    fn backend_error(&self, err: &CallError) -> BackendError {
        let text = self.secrets.scrub(&err.text).into_owned();
        BackendError::new(error_kind(err.failure), text)
    }

    /// A call carrying `decisions` decisions failed: counted once, and one failure for the
    /// circuit breaker, however many requests shared the call (a frozen store fails a call of
    /// 100 decisions once, not 100 times).
    pub(crate) fn call_failed(self: &Arc<Self>, err: &CallError, decisions: usize) {
        bump(&self.counters.errors);
        let kind = error_kind(err.failure);
        crate::metrics::backend_error(S::KIND, kind);
        if kind == BackendErrorKind::Timeout {
            bump(&self.counters.timeouts);
        }
        // Logged at warn once per change of cause (here), not once per call.
        self.failed(err);
        // A reply the store gave (an error, a malformed reply) says nothing about whether it
        // is reachable: only timeouts and connection errors trip the breaker.
        if kind != BackendErrorKind::Protocol && self.breaker.failure(self.clock.now_ns()) {
            tracing::debug!(
                failures = self.breaker.threshold,
                "tollgate: {} calls failed repeatedly; circuit breaker open, probing every {:?}",
                S::KIND,
                self.breaker.probe_interval
            );
            Inner::start_probe(self);
        } else {
            let err = self.secrets.scrub(&err.text).into_owned();
            tracing::debug!(%err, decisions, on_failure = ?self.on_failure, "tollgate: {} call failed", S::KIND);
        }
    }

    /// The answer for a request the store could not decide.
    fn degrade(
        &self,
        p: &PolicyInner<S>,
        key: &Key,
        cost: NonZeroU32,
        err: BackendError,
    ) -> Result<Decision, BackendError> {
        // A request that can never pass is refused whatever the failure policy; its bucket's
        // state is unknown while the store cannot be asked, and is shown as full.
        if let Some(decision) = super::never_fits(&p.params, cost) {
            return Ok(decision);
        }
        match (self.on_failure, &self.local, &p.local) {
            (FailurePolicy::FailClosed, _, _) => {
                bump(&self.counters.fail_closed);
                Err(err)
            }
            (FailurePolicy::FallbackLocal, Some(local), Some(policy)) => {
                bump(&self.counters.fallback_local);
                (crate::backend::Backend::decide(local, policy, key, cost).into_inner())
                    .map(|d| d.decided_by(DecidedBy::FallbackLocal))
            }
            _ => {
                bump(&self.counters.fail_open);
                tracing::trace!(%err, "tollgate: {} unavailable; request allowed (fail-open)", S::KIND);
                Ok(Decision::new([]).decided_by(DecidedBy::FailOpen))
            }
        }
    }

    /// Probes the store in the background until it answers, then closes the breaker.
    fn start_probe(this: &Arc<Self>) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            // No runtime to probe from: close at once, the next calls will test the store.
            this.breaker.close();
            return;
        };
        let weak: Weak<Self> = Arc::downgrade(this);
        let every = this.breaker.probe_interval;
        handle.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                // The probe must meet the same timeout as a decision: a store slow enough to
                // fail decisions must not close the breaker just to reopen it.
                let answer = tokio::time::timeout(inner.timeout, inner.store.ping()).await;
                match answer.unwrap_or_else(|_elapsed| Err(CallError::timed_out())) {
                    Ok(()) => {
                        inner.breaker.close();
                        tracing::debug!(
                            "tollgate: {} answers again; circuit breaker closed",
                            S::KIND
                        );
                        inner.answered();
                        return;
                    }
                    // Logged when the cause changes (a restarted store that now wants a
                    // password), not at every probe.
                    Err(err) => inner.failed(&err),
                }
            }
        });
    }
}

/// Why a decision got no answer: its call failed, or the store refused this decision alone.
pub(crate) enum CallOrDecision {
    Call(CallError),
    Decision(BackendError),
}
