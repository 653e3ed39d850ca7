//! The rate-limit service: key → policy → backend → pass or reject.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use tower_service::Service;

use crate::backend::{Backend, DecidedBy, Decision, Mode};
use crate::body::{BodyMode, KeepBody};
use crate::future::{DecideLater, ResponseFuture, Then};
use crate::key::{KeyError, KeyExtractor, OnMissingKey};
use crate::metrics::{Outcome as Counted, PolicyMetrics};
use crate::request::grpc_content_type;
use crate::response::{self, HeaderAdds, PolicyHeaders, Rejection, RejectionKind, Responder};
use crate::rules::LiveRules;
use crate::wait::{Pauses, Slot, Waiting};
use crate::{BackendError, ConfigError, Key, Policy, RequestInfo};

/// Rate-limits requests to the inner service. Made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Rejections are responses (`429`, gRPC `RESOURCE_EXHAUSTED`); the error type is the inner
/// service's, untouched.
///
/// `M` is the layer's [`BodyMode`]: responses keep the inner service's body type by default.
///
/// The type has no bounds of its own (as in tower, they are on the impls), so it can be named
/// in structs generic over the backend.
pub struct RateLimit<S, K, Bk, M = KeepBody> {
    inner: S,
    shared: Erased<K, Bk>,
    mode: PhantomData<fn() -> M>,
}

/// A layer's [`Shared`] state with its backend's types hidden, so that the public types need
/// no `Bk: Backend` bound on their definitions. Only [`Erased::new`] makes one, from a
/// `Shared<K, Bk>`, so [`get`](Erased::get) always finds it.
pub(crate) struct Erased<K, Bk> {
    any: Arc<dyn Any + Send + Sync>,
    types: PhantomData<fn() -> (K, Bk)>,
}

impl<K, Bk> Clone for Erased<K, Bk> {
    fn clone(&self) -> Self {
        Erased {
            any: self.any.clone(),
            types: PhantomData,
        }
    }
}

impl<K, Bk> Erased<K, Bk> {
    pub(crate) fn downgrade(&self) -> std::sync::Weak<dyn Any + Send + Sync> {
        Arc::downgrade(&self.any)
    }

    /// Whether `other` is this layer's state.
    pub(crate) fn is(&self, other: &Arc<dyn Any + Send + Sync>) -> bool {
        Arc::ptr_eq(&self.any, other)
    }
}

impl<K: KeyExtractor, Bk: Backend> Erased<K, Bk> {
    pub(crate) fn new(shared: Shared<K, Bk>) -> Self {
        Erased {
            any: Arc::new(shared),
            types: PhantomData,
        }
    }

    /// The shared state (a type-id comparison, no allocation).
    pub(crate) fn get(&self) -> Option<&Shared<K, Bk>> {
        self.any.downcast_ref()
    }

    /// The shared state, for a future that outlives the service's borrow.
    pub(crate) fn arc(&self) -> Option<Arc<Shared<K, Bk>>> {
        self.any.clone().downcast().ok()
    }
}

/// Everything the services of one layer share.
pub(crate) struct Shared<K, Bk: Backend> {
    pub(crate) key: K,
    pub(crate) backend: Arc<Bk>,
    pub(crate) policies: Policies<Bk>,
    pub(crate) responder: Responder,
    pub(crate) on_missing_key: OnMissingKey,
    /// Wait mode: hold requests until allowed instead of rejecting them.
    pub(crate) waiting: Option<Waiting>,
    /// Keys the wrapped service asked to slow down, when obeyed.
    pub(crate) pauses: Option<Arc<Pauses>>,
}

/// A policy with its backend-prepared form, header material and counters.
pub(crate) struct Prepared<P> {
    pub(crate) policy: Policy,
    pub(crate) backend: P,
    pub(crate) headers: PolicyHeaders,
    pub(crate) metrics: PolicyMetrics,
    /// Whether every quota is GCRA, so that a reservation can wait (window quotas cannot count
    /// into a window that has not begun: a reservation on them waits for nothing).
    pub(crate) reserves: bool,
}

impl<P> Prepared<P> {
    /// `policy` validated and prepared for `backend`, with its header material and counters.
    pub(crate) fn new<Bk: Backend<Policy = P>>(
        backend: &Bk,
        policy: Policy,
    ) -> Result<Self, ConfigError> {
        let params = policy.validate()?;
        let prepared = backend.prepare(&policy, &params)?;
        let headers = PolicyHeaders::new(&policy, &params);
        Ok(Prepared {
            metrics: PolicyMetrics::new(&policy, &headers.labels),
            reserves: params
                .iter()
                .all(|p| p.kind == crate::quota::QuotaKind::Gcra),
            headers,
            backend: prepared,
            policy,
        })
    }
}

/// The policy of a layer: one, or chosen by live rules.
pub(crate) enum Policies<Bk: Backend> {
    Fixed(Arc<Prepared<Bk::Policy>>),
    Rules(Arc<LiveRules<Bk>>),
}

impl<Bk: Backend> Policies<Bk> {
    /// Runs `f` with the policy for this request. The rules are read through an atomic
    /// pointer: no lock, no allocation.
    fn with<R>(
        &self,
        req: &RequestInfo<'_>,
        key: Option<&Key>,
        f: impl FnOnce(&Arc<Prepared<Bk::Policy>>) -> R,
    ) -> R {
        match self {
            Policies::Fixed(p) => f(p),
            Policies::Rules(live) => f(live.current.load().select(req, key)),
        }
    }

    /// The name of the default policy, for logs.
    pub(crate) fn default_name(&self) -> String {
        match self {
            Policies::Fixed(p) => p.policy.name().to_owned(),
            Policies::Rules(live) => live.current.load().default_name().to_owned(),
        }
    }
}

/// What to do with a request once the backend has answered.
pub(crate) enum Verdict {
    Pass(HeaderAdds),
    /// Pass after waiting this long (a reservation in wait mode).
    Wait(HeaderAdds, Duration),
    Reject(Box<Response<Bytes>>),
}

impl<S, K, Bk, M> RateLimit<S, K, Bk, M> {
    pub(crate) fn from_shared(inner: S, shared: Erased<K, Bk>) -> Self {
        RateLimit {
            inner,
            shared,
            mode: PhantomData,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K, Bk, M> Clone for RateLimit<S, K, Bk, M> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            mode: PhantomData,
        }
    }
}

impl<S: fmt::Debug, K: KeyExtractor, Bk: Backend, M> fmt::Debug for RateLimit<S, K, Bk, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policy = self.shared.get().map(|s| s.policies.default_name());
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policy", &policy.unwrap_or_default())
            .finish()
    }
}

impl<S, K, Bk, M, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, K, Bk, M>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor,
    Bk: Backend,
    M: BodyMode<ResBody>,
{
    type Response = Response<M::Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, K, Bk, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let Some(shared) = self.shared.get() else {
            // Unreachable: `Erased` is only ever made from a `Shared<K, Bk>`.
            return ResponseFuture::called(self.inner.call(req), HeaderAdds::new(), None);
        };
        let (step, key) = {
            let info = RequestInfo::new(&req);
            // 1. key
            let key = shared.key.extract(&info);
            // 2. policy
            let step = shared.policies.with(&info, key.as_ref().ok(), |policy| {
                let key = match &key {
                    Ok(key) => key,
                    Err(err) => return shared.missing_key(policy, err, info.headers()),
                };
                let Some(cost) = NonZeroU32::new(policy.policy.cost_of(&info)) else {
                    policy.metrics.record(Counted::Free, None);
                    return Step::Done(Verdict::Pass(HeaderAdds::new()), None);
                };
                // Wait mode and pauses apply to enforced policies only: a shadow policy never
                // holds a request back.
                let waits = shared
                    .waiting
                    .as_ref()
                    .filter(|_| !policy.policy.is_shadow());
                // The wrapped service asked to slow down for this key: wait out the pause,
                // then reserve (wait mode), or answer for it.
                let pause = (shared.pauses.as_ref())
                    .filter(|_| !policy.policy.is_shadow())
                    .and_then(|p| p.remaining(key));
                if let Some(pause) = pause {
                    let slot = waits
                        .filter(|w| pause <= w.max_wait)
                        .and_then(Waiting::enter);
                    return match (slot, waits) {
                        (Some(slot), Some(w)) => {
                            let left = w.max_wait - pause;
                            Step::PauseFirst(pause, left, policy.clone(), cost, Some(slot))
                        }
                        _ => Step::Done(shared.paused(policy, cost, pause, info.headers()), None),
                    };
                }
                // 3. backend. In-memory backends answer at once; others go on in the
                // response future. In wait mode a request first asks for its units now (a
                // reservation that waits for nothing: all-or-nothing on every store); only one
                // refused for less than the longest wait takes a waiter's slot and reserves. So
                // requests that pass at once never hold a slot, even while a store answers.
                let mut decision = match waits {
                    Some(_) => shared.backend.decide_with(&policy.backend, key, cost, NOW),
                    None => shared.backend.decide(&policy.backend, key, cost),
                };
                let result = match poll_now(&mut decision) {
                    Poll::Ready(result) => result,
                    Poll::Pending => {
                        let retry = waits.map(|_| cost);
                        return Step::Pending(decision, policy.clone(), None, retry);
                    }
                };
                let Some((slot, max_wait)) = waits.and_then(|_| shared.may_wait(policy, &result))
                else {
                    return Step::Done(shared.verdict(policy, result, info.headers()), None);
                };
                let mode = Mode::Reserve { max_wait };
                let mut decision = shared.backend.decide_with(&policy.backend, key, cost, mode);
                match poll_now(&mut decision) {
                    Poll::Ready(result) => {
                        Step::Done(shared.verdict(policy, result, info.headers()), Some(slot))
                    }
                    Poll::Pending => Step::Pending(decision, policy.clone(), Some(slot), None),
                }
            });
            (step, key)
        };
        // The wrapped service's answer for this key is read for requests to slow down.
        let note = match (&shared.pauses, &key) {
            (Some(pauses), Ok(key)) => Some(Box::new(Note {
                key: key.clone(),
                pauses: pauses.clone(),
            })),
            _ => None,
        };
        // 4. pass, wait or reject
        match step {
            Step::Done(Verdict::Pass(adds), _) => {
                ResponseFuture::called(self.inner.call(req), adds, note)
            }
            Step::Done(Verdict::Reject(res), _) => ResponseFuture::rejected(res),
            Step::Done(Verdict::Wait(adds, wait), slot) => {
                // The service that was polled ready waits with the request (tower's
                // ready-clone rule); a fresh clone takes its place.
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::waiting(wait, ready, req, adds, slot, note)
            }
            Step::Pending(decision, policy, slot, retry) => {
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                match self.shared.arc() {
                    Some(shared) => {
                        let retry = retry.zip(key.ok()).map(|(cost, key)| (key, cost));
                        let then = Then { slot, note, retry };
                        ResponseFuture::deciding(decision, ready, req, shared, policy, then)
                    }
                    // Unreachable, as above.
                    None => ResponseFuture::called({ ready }.call(req), HeaderAdds::new(), None),
                }
            }
            Step::PauseFirst(pause, left, policy, cost, slot) => {
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                match (self.shared.arc(), key) {
                    (Some(shared), Ok(key)) => {
                        let then = Then {
                            slot,
                            note,
                            retry: None,
                        };
                        let later = DecideLater {
                            shared,
                            policy,
                            key,
                            cost,
                            max_wait: left,
                        };
                        ResponseFuture::pausing(pause, ready, req, later, then)
                    }
                    // Unreachable: a pause needs a key, and `Erased` a `Shared`.
                    _ => ResponseFuture::called({ ready }.call(req), HeaderAdds::new(), None),
                }
            }
        }
    }
}

/// Counts a backend's answer in the policy's metrics.
#[inline]
fn count<P>(prepared: &Prepared<P>, result: &Result<Decision, BackendError>) {
    let m = &prepared.metrics;
    let shadow = prepared.policy.is_shadow();
    let decision = match result {
        Ok(decision) => decision,
        Err(_) if shadow => return m.record(Counted::ShadowError, None),
        Err(_) => return m.record(Counted::FailClosed, None),
    };
    let fallback = decision.made_by() == DecidedBy::FallbackLocal;
    if decision.is_allowed() {
        let outcome = match decision.made_by() {
            DecidedBy::FailOpen => Counted::FailOpen,
            _ if fallback => Counted::FallbackAllowed,
            _ => Counted::Allowed,
        };
        m.record(outcome, None);
        // Near the limit: the tightest quota has less than a tenth of it left.
        if let Some(q) = decision.tightest()
            && u64::from(q.remaining) * 10 < u64::from(q.limit)
        {
            m.near_limit(q.index);
        }
        return;
    }
    let quota = decision.tightest().map(|q| q.index);
    // A shadow policy lets every refusal through: counted as such, whatever the reason.
    let outcome = if shadow {
        Counted::ShadowDenied
    } else if decision.never_fits() {
        Counted::NeverFits
    } else if fallback {
        Counted::FallbackDenied
    } else {
        Counted::Denied
    };
    m.record(outcome, quota);
}

/// A first decision in wait mode: the units now, or a refusal that says how long they take.
const NOW: Mode = Mode::Reserve {
    max_wait: Duration::ZERO,
};

/// Polls a decision once, without a waker: in-memory backends are ready at once.
#[inline]
fn poll_now<F: Future + Unpin>(decision: &mut F) -> Poll<F::Output> {
    Pin::new(decision).poll(&mut Context::from_waker(Waker::noop()))
}

/// Where a request stands once `call` has asked the backend.
enum Step<F, P> {
    Done(Verdict, Option<Slot>),
    /// The decision is being made; in wait mode, with the cost to reserve if it refuses for
    /// less than the longest wait.
    Pending(F, Arc<Prepared<P>>, Option<Slot>, Option<NonZeroU32>),
    /// Wait mode, on a key the wrapped service paused: sleep this long, then reserve within
    /// the wait that is left.
    PauseFirst(
        Duration,
        Duration,
        Arc<Prepared<P>>,
        NonZeroU32,
        Option<Slot>,
    ),
}

/// What the response future needs to read the wrapped service's answer for a request to slow
/// down.
pub(crate) struct Note {
    pub(crate) key: Key,
    pub(crate) pauses: Arc<Pauses>,
}

impl<K, Bk: Backend> Shared<K, Bk> {
    /// Wait mode: whether a request refused now waits for its units instead, and if so a
    /// waiter's slot for it and the longest wait. It does when its policy can reserve (GCRA
    /// quotas only) and is enforced, the store refused it (not a failure, not a cost above a
    /// burst) for less than the longest wait, and a slot is free.
    pub(crate) fn may_wait(
        &self,
        prepared: &Prepared<Bk::Policy>,
        result: &Result<Decision, BackendError>,
    ) -> Option<(Slot, Duration)> {
        let waiting = self.waiting.as_ref()?;
        if !prepared.reserves || prepared.policy.is_shadow() {
            return None;
        }
        // `None` when allowed, or when the cost can never fit.
        let wait = result.as_ref().ok()?.retry_after()?;
        if wait > waiting.max_wait {
            return None;
        }
        Some((waiting.enter()?, waiting.max_wait))
    }

    /// The answer for a request whose key the wrapped service asked to slow down for `pause`
    /// more: `429` with the time left, as if its policy's first quota denied it.
    fn paused(
        &self,
        prepared: &Prepared<Bk::Policy>,
        cost: NonZeroU32,
        pause: Duration,
        headers: &HeaderMap,
    ) -> Verdict {
        let params = prepared
            .policy
            .validate()
            .ok()
            .and_then(|p| p.first().copied());
        let decision = match params {
            Some(p) => Decision::new([crate::backend::QuotaState::denied(0, &p, cost, pause)]),
            None => Decision::new([]),
        };
        self.verdict(prepared, Ok(decision), headers)
    }

    fn missing_key<F>(
        &self,
        prepared: &Prepared<Bk::Policy>,
        err: &KeyError,
        headers: &HeaderMap,
    ) -> Step<F, Bk::Policy> {
        let policy = prepared.policy.name();
        if *err == KeyError::NoPeerAddr {
            // The server's setup, not the client's request, is at fault: a 500 with a generic
            // body (whatever `on_missing_key` says), and the explanation in the log.
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    "tollgate: no peer address in the request extensions, so requests cannot be \
                     keyed by IP and are answered 500; with axum, serve with \
                     `into_make_service_with_connect_info::<SocketAddr>()` (logged once)"
                );
            }
            // `Allow` is an explicit choice to let keyless requests through (a server on a
            // Unix socket has no peer address at all): kept, with the log above.
            prepared.metrics.record(Counted::NoPeerAddress, None);
            if prepared.policy.is_shadow() || self.on_missing_key == OnMissingKey::Allow {
                return Step::Done(Verdict::Pass(HeaderAdds::new()), None);
            }
            let rejection = Rejection {
                kind: RejectionKind::MissingKey(err),
                policy,
                status: StatusCode::INTERNAL_SERVER_ERROR,
                retry_after: None,
                quota_names: &[],
            };
            let res =
                self.responder
                    .reject(&rejection, grpc_content_type(headers), HeaderAdds::new());
            return Step::Done(Verdict::Reject(Box::new(res)), None);
        }
        prepared.metrics.record(Counted::MissingKey, None);
        match self.on_missing_key {
            OnMissingKey::Allow => {
                tracing::trace!(policy, reason = %err, "no rate-limit key; allowed");
                Step::Done(Verdict::Pass(HeaderAdds::new()), None)
            }
            OnMissingKey::Reject(_) if prepared.policy.is_shadow() => {
                tracing::info!(
                    policy,
                    shadow = true,
                    reason = %err,
                    "request without a rate-limit key would have been rejected (shadow mode)"
                );
                Step::Done(Verdict::Pass(HeaderAdds::new()), None)
            }
            OnMissingKey::Reject(status) => {
                tracing::debug!(policy, reason = %err, "no rate-limit key; rejected");
                let rejection = Rejection {
                    kind: RejectionKind::MissingKey(err),
                    policy,
                    status,
                    retry_after: None,
                    quota_names: &[],
                };
                let res = self.responder.reject(
                    &rejection,
                    grpc_content_type(headers),
                    HeaderAdds::new(),
                );
                Step::Done(Verdict::Reject(Box::new(res)), None)
            }
        }
    }

    /// Turns a backend's answer into a verdict, logging rejections and failures.
    pub(crate) fn verdict(
        &self,
        prepared: &Prepared<Bk::Policy>,
        result: Result<Decision, BackendError>,
        headers: &HeaderMap,
    ) -> Verdict {
        let policy = prepared.policy.name();
        count(prepared, &result);
        match result {
            Ok(decision) if decision.is_allowed() => {
                // A shadow policy is not enforced: its fields would make clients back off for
                // nothing, unless asked for.
                if prepared.policy.is_shadow() && !prepared.policy.sends_shadow_headers() {
                    return Verdict::Pass(HeaderAdds::new());
                }
                let adds = response::rate_limit_headers(
                    self.responder.style,
                    &prepared.headers,
                    &decision,
                );
                match decision.wait() {
                    Duration::ZERO => Verdict::Pass(adds),
                    wait => Verdict::Wait(adds, wait),
                }
            }
            Ok(decision) if prepared.policy.is_shadow() => {
                tracing::info!(
                    policy,
                    shadow = true,
                    retry_after_ms = decision.retry_after().map(|d| d.as_millis() as u64),
                    "request would have been rate limited (shadow mode)"
                );
                Verdict::Pass(HeaderAdds::new())
            }
            Ok(decision) => {
                let retry_after = decision.retry_after();
                tracing::debug!(
                    policy,
                    retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
                    never_fits = decision.never_fits(),
                    "request rate limited"
                );
                let adds = response::rate_limit_headers(
                    self.responder.style,
                    &prepared.headers,
                    &decision,
                );
                // A cost larger than a quota's burst can never pass: not "too many", but too
                // large, and no `Retry-After`.
                let status = if decision.never_fits() {
                    StatusCode::PAYLOAD_TOO_LARGE
                } else {
                    StatusCode::TOO_MANY_REQUESTS
                };
                let rejection = Rejection {
                    kind: RejectionKind::RateLimited(&decision),
                    policy,
                    status,
                    retry_after,
                    quota_names: &prepared.headers.labels,
                };
                Verdict::Reject(Box::new(self.responder.reject(
                    &rejection,
                    grpc_content_type(headers),
                    adds,
                )))
            }
            Err(error) if prepared.policy.is_shadow() => {
                tracing::debug!(
                    policy,
                    shadow = true,
                    %error,
                    "rate-limit backend failed; allowed (shadow mode)"
                );
                Verdict::Pass(HeaderAdds::new())
            }
            Err(error) => {
                // Backends log their failures once per change of state (the Redis backend: a
                // warning naming the cause when it starts failing, one line when it answers
                // again); a line per rejected request would flood the log during an outage.
                tracing::debug!(policy, %error, "rate-limit backend failed; answering 503");
                let rejection = Rejection {
                    kind: RejectionKind::BackendUnavailable,
                    policy,
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    retry_after: Some(std::time::Duration::from_secs(1)),
                    quota_names: &prepared.headers.labels,
                };
                Verdict::Reject(Box::new(self.responder.reject(
                    &rejection,
                    grpc_content_type(headers),
                    HeaderAdds::new(),
                )))
            }
        }
    }
}
