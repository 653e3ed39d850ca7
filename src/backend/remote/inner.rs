//! The part of a remote backend that outlives a request: the store, its health and circuit
//! breaker, the counters, and what becomes of a call's outcome (the deny cache learns from it,
//! failures get the failure policy). The batching task and the backend's `decide` both hand
//! their calls' outcomes here.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::breaker::Breaker;
use super::clock::Clock;
use super::deny_cache::Budget;
use super::health::{Change, Health, StoreFailure};
use super::options::{FailurePolicy, Fleet};
use super::redact::Secrets;
use super::store::{CallError, Job, PolicyInner, Store};
use crate::backend::throttle::OnceAMinute;
use crate::backend::{DecidedBy, Decision, LocalBackend, Mode};
use crate::{BackendError, BackendErrorKind, Key};

pub(crate) struct Inner<S: Store> {
    pub(crate) store: S,
    /// The store in a phrase for logs: `Redis at redis://127.0.0.1:6379`.
    pub(crate) who: String,
    /// Passwords of the configured URLs, removed from every error text shown.
    pub(crate) secrets: Secrets,
    pub(crate) health: Health,
    pub(crate) timeout: Duration,
    pub(crate) on_failure: FailurePolicy,
    pub(crate) breaker: Breaker,
    pub(crate) budget: Arc<Budget>,
    pub(crate) clock: Clock,
    pub(crate) local: Option<LocalBackend>,
    pub(crate) warmed: AtomicBool,
    /// The warning of a refused decision, at most once a minute (a store refusing every
    /// write, its memory full, must not log a line per request).
    pub(crate) refusal_warned: OnceAMinute,
    /// The store's memory as the watch last read it.
    pub(crate) memory: MemoryState,
    pub(crate) counters: Counters,
    pub(crate) batching: bool,
    /// How often the store's memory is read ([`watch_memory`]), `None` for never.
    pub(crate) memory_watch: Option<Duration>,
    pub(crate) fleet: FleetSize,
}

/// The store's memory as the watch last read it ([`watch_memory`]).
#[derive(Default)]
pub(crate) struct MemoryState {
    pub(crate) used: std::sync::atomic::AtomicU64,
    pub(crate) max: std::sync::atomic::AtomicU64,
    /// Keys evicted since the first read.
    pub(crate) evicted: std::sync::atomic::AtomicU64,
}

/// Reads the store's memory every `every` until the backend is dropped or the store has no
/// report (a SQL store): see [`MemoryWatch`].
pub(crate) async fn watch_memory<S: Store>(inner: std::sync::Weak<Inner<S>>, every: Duration) {
    let mut watch = MemoryWatch::default();
    loop {
        tokio::time::sleep(every).await;
        let Some(this) = inner.upgrade() else { return };
        let read = tokio::time::timeout(
            this.timeout.max(Duration::from_secs(1)),
            this.store.memory(),
        );
        match read.await {
            Ok(Ok(Some(memory))) => watch.seen(&memory, &this.memory, S::KIND, &this.who),
            Ok(Ok(None)) => return,
            Ok(Err(err)) => watch.unreadable(&this.secrets.scrub(&err.text), &this.who),
            Err(_elapsed) => {}
        }
    }
}

/// What a store's memory readings tell the operator: its use and limit, and the keys it
/// evicted since the first reading, as stats ([`MemoryState`]) and metrics; and a warning,
/// once until it changes, when it evicts keys (counts of rate limits lost: a key at its limit
/// starts afresh), when it is at 90 % of its limit under `noeviction` (writes are refused
/// when full), and when its policy evicts keys at all. (The Redis backend and the approximate
/// mode each keep one.)
#[derive(Default)]
pub(crate) struct MemoryWatch {
    first_evicted: Option<u64>,
    last_evicted: u64,
    warned_full: bool,
    warned_policy: bool,
    unreadable: bool,
}

impl MemoryWatch {
    /// The store does not tell its memory (an ACL user without `INFO`), or failed to: said
    /// once.
    pub(crate) fn unreadable(&mut self, err: &str, who: &str) {
        if !self.unreadable {
            self.unreadable = true;
            tracing::info!(error = %err, "tollgate: {who} does not tell its memory (INFO); evictions and a full memory are not watched");
        }
    }

    /// A reading of the store's memory.
    pub(crate) fn seen(
        &mut self,
        memory: &super::store::Memory,
        m: &MemoryState,
        kind: &'static str,
        who: &str,
    ) {
        self.unreadable = false;
        m.used.store(memory.used, Ordering::Relaxed);
        m.max.store(memory.max, Ordering::Relaxed);
        let base = *self.first_evicted.get_or_insert(memory.evicted);
        let evicted = memory.evicted.saturating_sub(base);
        m.evicted.store(evicted, Ordering::Relaxed);
        crate::metrics::store_memory(
            kind,
            memory.used,
            memory.max,
            evicted.saturating_sub(self.last_evicted),
        );
        let evicts = memory.max > 0 && memory.policy != "noeviction" && !memory.policy.is_empty();
        if evicts && !self.warned_policy {
            self.warned_policy = true;
            tracing::warn!(policy = %memory.policy, "tollgate: {who} evicts keys when its memory is full (maxmemory-policy {}): a rate limit's count it evicts starts afresh; `noeviction` keeps counts (see docs/redis.md)", memory.policy);
        }
        if evicted > self.last_evicted {
            tracing::warn!(
                evicted = evicted - self.last_evicted,
                total = evicted,
                "tollgate: {who} evicted keys: counts of rate limits may have been dropped (a key at its limit starts afresh)",
            );
            self.last_evicted = evicted;
        }
        let full = memory.max > 0 && memory.used.saturating_mul(10) >= memory.max.saturating_mul(9);
        if full && !self.warned_full && !evicts {
            self.warned_full = true;
            tracing::warn!(
                used = memory.used,
                max = memory.max,
                "tollgate: {who} is at 90 % of its maxmemory: when full it refuses writes, and decisions that take something get the failure policy",
            );
        } else if self.warned_full && memory.used.saturating_mul(10) < memory.max.saturating_mul(8)
        {
            self.warned_full = false;
        }
    }
}

/// How many instances share the store, as this one knows it (see [`Fleet`]).
pub(crate) struct FleetSize {
    pub(crate) fleet: Fleet,
    /// The last count (the configured size for `Fleet::Size`); 1 before the first.
    pub(crate) size: AtomicU32,
    /// This instance's id in the announcements.
    pub(crate) id: u64,
}

impl FleetSize {
    pub(crate) fn new(fleet: Fleet, id: Option<u64>) -> Self {
        FleetSize {
            fleet,
            size: AtomicU32::new(match fleet {
                Fleet::Size(n) => n.get(),
                Fleet::Announced { .. } => 1,
            }),
            id: id.unwrap_or_else(crate::backend::next_lease),
        }
    }

    pub(crate) fn get(&self) -> u32 {
        self.size.load(Ordering::Relaxed).max(1)
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) decisions: AtomicU64,
    pub(crate) calls: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) fail_open: AtomicU64,
    pub(crate) fail_closed: AtomicU64,
    pub(crate) fallback_local: AtomicU64,
    pub(crate) deny_cache_hits: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
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
    pub(crate) async fn call_alone(
        self: &Arc<Self>,
        jobs: &[Job<S>],
    ) -> Result<Decision, CallOrDecision> {
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
                if self.refusal_warned.now(self.clock.now_ns()) {
                    tracing::warn!(err = %text, on_failure = ?self.on_failure, "tollgate: {} refused a decision (at most one warning a minute; `stats().errors` counts them)", self.who);
                } else {
                    tracing::debug!(err = %text, "tollgate: {} refused a decision", self.who);
                }
                Err(err)
            }
            Err(CallOrDecision::Call(err)) => Err(self.backend_error(&err)),
        };
        match result {
            Ok(decision) if job.mode == Mode::Peek => Ok(decision),
            Ok(decision) => {
                if decision.is_allowed() {
                    // The counts a cached denial of this key reports have just changed.
                    p.deny.forget(key);
                } else {
                    p.deny.insert(key, cost, job.sent_ns, &decision, &p.params);
                }
                Ok(decision)
            }
            Err(err) => self.degrade(p, key, cost, job.mode, err),
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
    pub(crate) fn backend_error(&self, err: &CallError) -> BackendError {
        let text = self.secrets.scrub(&err.text).into_owned();
        BackendError::new(err.kind(), text)
    }

    /// A call carrying `decisions` decisions failed: counted once, and one failure for the
    /// circuit breaker, however many requests shared the call (a frozen store fails a call of
    /// 100 decisions once, not 100 times).
    pub(crate) fn call_failed(self: &Arc<Self>, err: &CallError, decisions: usize) {
        bump(&self.counters.errors);
        let kind = err.kind();
        crate::metrics::backend_error(S::KIND, kind);
        if kind == BackendErrorKind::Timeout {
            bump(&self.counters.timeouts);
        }
        // Logged at warn once per change of cause (here), not once per call.
        self.failed(err);
        // A reply the store gave (an error, a malformed reply) says nothing about whether it
        // is reachable: only timeouts and connection errors trip the breaker.
        if kind != BackendErrorKind::Protocol && self.breaker.failure(self.clock.now_ns()) {
            self.store.reconnect();
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
    pub(crate) fn degrade(
        &self,
        p: &PolicyInner<S>,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
        err: BackendError,
    ) -> Result<Decision, BackendError> {
        // A settlement that cannot be made is not retried nor degraded, whatever the failure
        // policy: its outcome is a failed call's (lost, or made late by a store that received
        // it). The local fallback never saw the request.
        if mode.is_settlement() {
            return Err(err);
        }
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
            (FailurePolicy::FallbackLocal, Some(local), Some(twin)) => {
                bump(&self.counters.fallback_local);
                let twin = twin.at(local, self.fleet.get());
                let cost = twin.cost(cost);
                (crate::backend::Backend::decide_with(local, &twin.local, key, cost, mode)
                    .into_inner())
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
                    // password), not at every probe. The next probe gets a new connection.
                    Err(err) => {
                        inner.failed(&err);
                        inner.store.reconnect();
                    }
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
