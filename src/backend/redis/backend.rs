//! The backend: prepare policies, decide, and degrade as configured when Redis fails.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use smallvec::SmallVec;

use super::batch::{Batcher, Reply, timed_out};
use super::breaker::Breaker;
use super::clock::Clock;
use super::conn::Conn;
use super::deny_cache::{Budget, DenyCache};
use super::future::RedisFuture;
use super::health::{Change, Health, RedisFailure};
use super::redact::Secrets;
use super::{keys, script};
use crate::backend::DecidedBy;
use crate::backend::local::LocalPolicy;
use crate::backend::{Backend, Decision, LocalBackend};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind, ConfigError, Key, Policy};

/// What a request gets while Redis cannot decide (an error, a timeout, or an open circuit
/// breaker).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Let the request through and count it in [`RedisStats::fail_open`] (Redis starting to
    /// fail is logged as a warning, once, not per request). The decision carries no quota state, so no remaining
    /// counts are sent. The default: a rate limiter should not take an application down with
    /// it.
    #[default]
    FailOpen,
    /// Return a [`BackendError`]: the layer answers `503 Service Unavailable` with
    /// `Retry-After: 1` (gRPC: `UNAVAILABLE`). Choose this where letting requests through
    /// unlimited is worse than refusing them, e.g. for an expensive upstream.
    FailClosed,
    /// Decide with an in-process [`LocalBackend`] holding the same policy: limits hold per
    /// instance (with `n` replicas a client gets up to `n` times the quota) until Redis is back.
    /// The local buckets only see the requests Redis could not decide, and nothing is copied
    /// between them and Redis in either direction. They live as long as the backend: a client's
    /// local bucket is full at its first outage; at a later one it holds what was left at the
    /// end of the previous outage, refilled at the quota's rate since (full again if enough
    /// time passed).
    FallbackLocal,
}

/// Counters of a [`RedisBackend`], from [`RedisBackend::stats`]. All counts are since the
/// backend was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisStats {
    /// Decisions sent to Redis (requests, not script calls).
    pub redis_calls: u64,
    /// Script calls those took: concurrent decisions on a single node share one call.
    pub script_calls: u64,
    /// Script calls that failed (an error, a timeout, a reply that could not be read), each
    /// counted once however many decisions it carried; plus single decisions Redis refused
    /// inside a call that succeeded (a key of the wrong type). Requests that got the failure
    /// policy are counted in [`fail_open`](Self::fail_open),
    /// [`fail_closed`](Self::fail_closed) or [`fallback_local`](Self::fallback_local).
    pub redis_errors: u64,
    /// Of those, script calls that timed out. A batched call runs until the last deadline of
    /// its decisions; a request whose own deadline passed earlier, or while it was still
    /// queued, gets the failure policy without counting here.
    pub timeouts: u64,
    /// Requests let through by [`FailurePolicy::FailOpen`].
    pub fail_open: u64,
    /// Requests refused by [`FailurePolicy::FailClosed`].
    pub fail_closed: u64,
    /// Requests decided by the local backend under [`FailurePolicy::FallbackLocal`].
    pub fallback_local: u64,
    /// Requests denied by the local deny cache without a Redis call.
    pub deny_cache_hits: u64,
    /// Denials held in the deny caches now.
    pub deny_cache_entries: usize,
    /// Whether the circuit breaker is open (Redis is not being called).
    pub breaker_open: bool,
    /// How many times the circuit breaker opened.
    pub breaker_trips: u64,
    /// Why Redis is failing, when the last call or probe failed (the real cause: a refused
    /// connection or a wrong password, rather than the timeouts requests may see); `None`
    /// while Redis answers, and before the first call.
    pub failing: Option<RedisFailure>,
}

/// A [`Backend`] keeping buckets in Redis or Redis Cluster: one limit shared by every instance
/// of an application. Cheap to clone: clones share connections, breaker and counters.
///
/// See the [module docs](super) for guarantees and failure modes, and
/// [`RedisBackend::builder`] for the options.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) conn: Conn,
    /// Where Redis is, passwords masked: for [`RedisBackend::endpoint`] and `Debug`.
    pub(crate) endpoint: String,
    /// The same in a phrase for logs: `Redis at redis://127.0.0.1:6379`.
    pub(crate) who: String,
    /// Passwords of the configured URLs, removed from every error text shown.
    pub(crate) secrets: Secrets,
    pub(crate) health: Health,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) on_failure: FailurePolicy,
    pub(crate) breaker: Breaker,
    pub(crate) budget: Arc<Budget>,
    pub(crate) clock: Clock,
    pub(crate) local: Option<LocalBackend>,
    pub(crate) warmed: AtomicBool,
    pub(crate) counters: Counters,
    pub(crate) batcher: Batcher,
    pub(crate) batching: bool,
}

#[derive(Default)]
pub(crate) struct Counters {
    calls: AtomicU64,
    pub(crate) script_calls: AtomicU64,
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

impl RedisBackend {
    /// The backend's counters now.
    pub fn stats(&self) -> RedisStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RedisStats {
            redis_calls: get(&c.calls),
            script_calls: get(&c.script_calls),
            redis_errors: get(&c.errors),
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

    /// Where the backend connects, with passwords replaced by `***`, for logs: the URL
    /// (`redis://:***@10.0.0.5:6379/0`), the cluster nodes' URLs separated by `, `, or
    /// `connection manager` / `cluster connection` for a connection you handed over.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// Starts connecting in the background, once, when called inside a Tokio runtime, so that
    /// the first request does not pay for the connection.
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
            // Long enough for redis-rs to report why it could not connect (refused, a wrong
            // password), rather than this timeout hiding the cause.
            let result = tokio::time::timeout(inner.warm_up_timeout(), inner.conn.ping()).await;
            match result.unwrap_or_else(|_elapsed| Err(timed_out())) {
                Ok(()) => inner.answered(),
                Err(err) => inner.failed(&err),
            }
        });
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("conn", &self.inner.conn)
            .field("endpoint", &self.inner.endpoint)
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("on_failure", &self.inner.on_failure)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A policy prepared for the [`RedisBackend`]: its quotas as script arguments, its key prefix,
/// its own deny cache and, with [`FailurePolicy::FallbackLocal`], its local twin.
pub struct RedisPolicy {
    inner: Arc<PolicyInner>,
}

pub(crate) struct PolicyInner {
    params: SmallVec<[QuotaParams; 2]>,
    pub(crate) key_prefix: Vec<u8>,
    /// Per quota: `<index><algorithm><parameters>` (see `keys::quota_suffixes`).
    pub(crate) key_suffixes: Vec<Box<[u8]>>,
    /// The policy's entry in the script's arguments (`script::policy_args`).
    pub(crate) args: Vec<Vec<u8>>,
    /// Integers per decision in the script's reply (`script::reply_len`).
    pub(crate) reply_len: usize,
    deny: DenyCache,
    deny_hits: crate::metrics::DenyCacheHits,
    local: Option<LocalPolicy>,
}

impl fmt::Debug for RedisPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPolicy")
            .field(
                "key_prefix",
                &String::from_utf8_lossy(&self.inner.key_prefix),
            )
            .field("quotas", &self.inner.params)
            .field("deny_cache_entries", &self.inner.deny.len())
            .finish()
    }
}

impl Backend for RedisBackend {
    type Policy = RedisPolicy;
    type Future = RedisFuture;

    fn prepare(&self, policy: &Policy, params: &[QuotaParams]) -> Result<RedisPolicy, ConfigError> {
        if params.is_empty() {
            return Err(ConfigError::QuotaCount {
                policy: policy.name().to_owned(),
                count: 0,
            });
        }
        let local = match &self.inner.local {
            Some(local) => Some(local.prepare(policy, params)?),
            None => None,
        };
        self.warm_up();
        Ok(RedisPolicy {
            inner: Arc::new(PolicyInner {
                params: params.iter().copied().collect(),
                key_prefix: keys::policy_prefix(&self.inner.prefix, policy.name()),
                key_suffixes: keys::quota_suffixes(params),
                args: script::policy_args(params),
                reply_len: script::reply_len(params),
                deny: DenyCache::new(self.inner.budget.clone()),
                deny_hits: crate::metrics::DenyCacheHits::new(policy.name()),
                local,
            }),
        })
    }

    /// The server (or cluster) and key prefix, password masked: every backend, in any
    /// process, that names the same store shares its buckets.
    fn store_id(&self) -> Option<String> {
        Some(format!(
            "{} prefix {:?}",
            self.endpoint(),
            self.inner.prefix
        ))
    }

    fn decide(&self, policy: &RedisPolicy, key: &Key, cost: NonZeroU32) -> RedisFuture {
        let p = &policy.inner;
        // A cost larger than a burst still goes to Redis (a rare request), so that the answer
        // reports the bucket's real state; the script takes nothing for it.
        let inner = &self.inner;
        let now_ns = inner.clock.now_ns();
        if let Some(decision) = p.deny.get(key, cost, now_ns, &p.params) {
            bump(&inner.counters.deny_cache_hits);
            p.deny_hits.hit();
            return RedisFuture::ready(Ok(decision));
        }
        if inner.breaker.blocks(now_ns) {
            let err = match inner.health.failing() {
                Some(cause) => BackendError::new(
                    BackendErrorKind::Unavailable,
                    format!("circuit breaker open; Redis failing: {cause}"),
                ),
                None => BackendError::new(BackendErrorKind::Unavailable, "circuit breaker open"),
            };
            return RedisFuture::ready(inner.degrade(p, key, cost, err));
        }
        bump(&inner.counters.calls);
        let call = Call {
            inner: inner.clone(),
            policy: policy.inner.clone(),
            key: key.clone(),
            cost,
            sent_ns: now_ns,
        };
        // On a single node the decision joins the batching task's queue now, and the future
        // only waits for its answer: nothing boxed.
        if let Conn::Single(_) = &inner.conn
            && inner.batching
            && let Some(answer) = Batcher::submit(inner, &call.policy, key, cost.get())
        {
            return RedisFuture::batched(answer, call);
        }
        RedisFuture::call(Box::pin(async move {
            let outcome = call.inner.run_alone(&call.policy, &call.key, cost).await;
            call.finish(outcome)
        }))
    }
}

/// A decision sent to Redis, and what is needed to finish it when the answer comes.
pub(crate) struct Call {
    inner: Arc<Inner>,
    policy: Arc<PolicyInner>,
    key: Key,
    cost: NonZeroU32,
    /// When the decision was sent, for the deny cache.
    sent_ns: u64,
}

impl Call {
    /// Turns Redis's answer into the decision: the deny cache learns from it, and failures
    /// degrade as configured. The breaker and the call counters have already heard of the call
    /// that carried it (once per call, not once per decision).
    pub(crate) fn finish(
        &self,
        outcome: redis::RedisResult<Reply>,
    ) -> Result<Decision, BackendError> {
        let (inner, p, key, cost) = (&self.inner, &self.policy, &self.key, self.cost);
        if outcome.is_ok() {
            let took = inner.clock.now_ns().saturating_sub(self.sent_ns);
            crate::metrics::backend_latency("redis", took as f64 / 1e9);
        }
        let result = match outcome {
            Ok(reply) => script::decision(&reply, &p.params, cost).inspect_err(|err| {
                // Redis answered the call but refused this decision's keys (or the reply does
                // not fit the policy): this decision's own error, counted here.
                bump(&inner.counters.errors);
                let err = inner.secrets.scrub(&err.to_string()).into_owned();
                tracing::warn!(%err, on_failure = ?inner.on_failure, "tollgate: Redis refused a decision");
            }),
            Err(err) => Err(inner.backend_error(err)),
        };
        match result {
            Ok(decision) => {
                if decision.is_allowed() {
                    // The counts a cached denial of this key reports have just changed.
                    p.deny.forget(key);
                } else {
                    p.deny.insert(key, cost, self.sent_ns, &decision, &p.params);
                }
                Ok(decision)
            }
            Err(err) => inner.degrade(p, key, cost, err),
        }
    }
}

/// How a failed call is reported: a timeout, Redis out of reach, or a reply Redis did give (an
/// error, or one that could not be read).
///
/// A cluster that cannot serve the slot (no connected node, `CLUSTERDOWN`, `MASTERDOWN`,
/// `LOADING`, `TRYAGAIN` still there after the retries) is out of reach too: these trip the
/// circuit breaker like a dead single node. So does a refused password (`WRONGPASS`,
/// `NOAUTH`, `NOPERM`): no call can succeed until the credentials or ACLs change, and calling
/// again only opens more connections.
pub(crate) fn error_kind(err: &redis::RedisError) -> BackendErrorKind {
    match RedisFailure::of(err) {
        RedisFailure::Timeout => BackendErrorKind::Timeout,
        RedisFailure::ErrorReply => BackendErrorKind::Protocol,
        _ => BackendErrorKind::Unavailable,
    }
}

impl Inner {
    /// Runs the script for one decision alone (a cluster, or batching off), within the
    /// backend's timeout.
    async fn run_alone(
        self: &Arc<Self>,
        p: &Arc<PolicyInner>,
        key: &Key,
        cost: NonZeroU32,
    ) -> redis::RedisResult<Reply> {
        let keys = keys::bucket_keys(&p.key_prefix, key, &p.key_suffixes);
        // The same `EVALSHA` as a batched call (see `gcra.lua`), holding one decision.
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script::SCRIPT.get_hash())
            .arg(keys.len())
            .arg(&keys);
        match self.clock.script_time() {
            Some(ns) => cmd.arg(ns),
            None => cmd.arg(""),
        };
        // One policy; one run of one decision of policy 1.
        cmd.arg(1)
            .arg(&p.args)
            .arg(1)
            .arg(1)
            .arg(1)
            .arg(script::hex(u64::from(cost.get())).as_bytes());
        bump(&self.counters.script_calls);
        let result = match tokio::time::timeout(self.timeout, self.conn.eval(&cmd)).await {
            Ok(reply) => reply.map(Reply::whole),
            Err(_elapsed) => Err(timed_out()),
        };
        match &result {
            Ok(_) => self.call_answered(),
            Err(err) => self.call_failed(err, 1),
        }
        result
    }

    /// A script call got Redis's answer: Redis is reachable, whatever the answer says.
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

    /// A call or probe got Redis's answer: if Redis was failing, say once that it is back.
    pub(crate) fn answered(&self) {
        if let Some(Change::Recovered { degraded }) = self.health.answered(self.degraded()) {
            let meanwhile = match self.on_failure {
                FailurePolicy::FailOpen => "let through unlimited by fail-open",
                FailurePolicy::FailClosed => "refused by fail-closed",
                FailurePolicy::FallbackLocal => "limited per instance by the local fallback",
            };
            tracing::info!(
                degraded,
                "tollgate: {} answers again; shared limits apply again \
                 ({degraded} requests were {meanwhile} meanwhile)",
                self.who
            );
        }
    }

    /// A call or probe failed: if Redis was answering, or failing for another reason, say once
    /// why, and what requests get until it answers again. Calls and requests failing for the
    /// same reason afterwards log nothing more (they are counted in the stats).
    pub(crate) fn failed(&self, err: &redis::RedisError) {
        let cause = RedisFailure::of(err);
        let Some(Change::Failing { again }) = self.health.failed(cause, self.degraded()) else {
            return;
        };
        let error = self.secrets.scrub(&err.to_string()).into_owned();
        let now = if again { "now " } else { "" };
        let headline = match cause {
            RedisFailure::ErrorReply => format!("{now}answers with errors"),
            cause => format!("{now}unreachable: {cause}"),
        };
        let until = match self.on_failure {
            FailurePolicy::FailOpen => "requests are let through unlimited (fail open)",
            FailurePolicy::FailClosed => "requests are refused (fail closed)",
            FailurePolicy::FallbackLocal => "requests are limited per instance (local fallback)",
        };
        tracing::warn!(
            %error,
            %cause,
            "tollgate: {} {headline}; {until} until it answers",
            self.who
        );
    }

    /// A `BackendError` for a failed call, with no password in its text: the redis-rs error
    /// itself when its text holds none (so that it can be downcast), its scrubbed text
    /// otherwise.
    fn backend_error(&self, err: redis::RedisError) -> BackendError {
        let kind = error_kind(&err);
        if self.secrets.is_empty() {
            return BackendError::new(kind, err);
        }
        let text = err.to_string();
        match self.secrets.scrub(&text) {
            std::borrow::Cow::Borrowed(_) => BackendError::new(kind, err),
            std::borrow::Cow::Owned(scrubbed) => BackendError::new(kind, scrubbed),
        }
    }

    /// A script call carrying `decisions` decisions failed: counted once, and one failure for
    /// the circuit breaker, however many requests shared the call (a frozen Redis fails a call
    /// of 100 decisions once, not 100 times).
    pub(crate) fn call_failed(self: &Arc<Self>, err: &redis::RedisError, decisions: usize) {
        bump(&self.counters.errors);
        let kind = error_kind(err);
        crate::metrics::backend_error("redis", kind);
        if kind == BackendErrorKind::Timeout {
            bump(&self.counters.timeouts);
        }
        // Logged at warn once per change of cause (here), not once per call.
        self.failed(err);
        // A reply Redis gave (an error, a malformed reply) says nothing about whether Redis is
        // reachable: only timeouts and connection errors trip the breaker.
        if kind != BackendErrorKind::Protocol && self.breaker.failure(self.clock.now_ns()) {
            tracing::debug!(
                failures = self.breaker.threshold,
                "tollgate: Redis calls failed repeatedly; circuit breaker open, probing every {:?}",
                self.breaker.probe_interval
            );
            Inner::start_probe(self);
        } else {
            let err = self.secrets.scrub(&err.to_string()).into_owned();
            tracing::debug!(%err, decisions, on_failure = ?self.on_failure, "tollgate: Redis call failed");
        }
    }

    /// The answer for a request Redis could not decide.
    fn degrade(
        &self,
        p: &PolicyInner,
        key: &Key,
        cost: NonZeroU32,
        err: BackendError,
    ) -> Result<Decision, BackendError> {
        // A request that can never pass is refused whatever the failure policy; its bucket's
        // state is unknown while Redis cannot be asked, and is shown as full.
        if let Some(decision) = script::never_fits(&p.params, cost) {
            return Ok(decision);
        }
        match (self.on_failure, &self.local, &p.local) {
            (FailurePolicy::FailClosed, _, _) => {
                bump(&self.counters.fail_closed);
                Err(err)
            }
            (FailurePolicy::FallbackLocal, Some(local), Some(policy)) => {
                bump(&self.counters.fallback_local);
                (local.decide(policy, key, cost).into_inner())
                    .map(|d| d.decided_by(DecidedBy::FallbackLocal))
            }
            _ => {
                bump(&self.counters.fail_open);
                tracing::trace!(%err, "tollgate: Redis unavailable; request allowed (fail-open)");
                Ok(Decision::new([]).decided_by(DecidedBy::FailOpen))
            }
        }
    }

    /// The warm-up connection may take longer than a decision's timeout (a TLS or cluster
    /// handshake); nothing waits for it. It gets a connection attempt and a `PING`'s time, so
    /// that redis-rs's own error (refused, a wrong password, its connection timeout) comes
    /// first.
    fn warm_up_timeout(&self) -> Duration {
        super::builder::connect_timeout(self.timeout)
            .saturating_add(self.timeout.max(Duration::from_millis(250)))
    }

    /// Probes Redis in the background until it answers, then closes the breaker.
    fn start_probe(this: &Arc<Inner>) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            // No runtime to probe from: close at once, the next calls will test Redis.
            this.breaker.close();
            return;
        };
        let weak: Weak<Inner> = Arc::downgrade(this);
        let every = this.breaker.probe_interval;
        handle.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                // The probe must meet the same timeout as a decision: a Redis slow enough to
                // fail decisions must not close the breaker just to reopen it.
                let answer = tokio::time::timeout(inner.timeout, inner.conn.ping()).await;
                match answer.unwrap_or_else(|_elapsed| Err(timed_out())) {
                    Ok(()) => {
                        inner.breaker.close();
                        tracing::debug!("tollgate: Redis answers again; circuit breaker closed");
                        inner.answered();
                        return;
                    }
                    // Logged when the cause changes (a restarted Redis that now wants a
                    // password), not at every probe.
                    Err(err) => inner.failed(&err),
                }
            }
        });
    }
}
