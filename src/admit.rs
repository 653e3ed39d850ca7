//! Admission, the first stage of a request: its key, its policy, the backend's decision and the
//! verdict (pass, wait or reject). Shadow policies are decided here: a shadow policy never holds
//! a request back, and its refusals are logged and counted instead of answered.
//!
//! In-memory backends decide at once, in [`Shared::admit`]; a store's decision goes on in the
//! response future as [`Admitting`].

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};

use crate::backend::{Backend, DecidedBy, Decision, Mode};
use crate::charge::Taken;
use crate::key::{KeyError, KeyExtractor, OnMissingKey};
use crate::metrics::{Outcome as Counted, PolicyMetrics};
use crate::prepared::Prepared;
use crate::report::RateLimitStatus;
use crate::request::grpc_content_type;
use crate::response::{self, HeaderAdds, Rejection, RejectionKind, Responder};
use crate::rules::LiveRules;
use crate::settle::Settle;
use crate::wait::{Pauses, Place, WaitMode};
use crate::{BackendError, Key, RequestInfo};

/// Everything the services of one layer share.
pub(crate) struct Shared<K, Bk: Backend> {
    pub(crate) key: K,
    pub(crate) backend: Arc<Bk>,
    pub(crate) policies: Policies<Bk>,
    pub(crate) responder: Responder,
    pub(crate) on_missing_key: OnMissingKey,
    /// Wait mode: hold requests until allowed instead of rejecting them.
    pub(crate) wait_mode: Option<WaitMode>,
    /// Keys the wrapped service asked to slow down, when obeyed.
    pub(crate) pauses: Option<Arc<Pauses>>,
    /// Whether allowed requests carry the decision in their extensions.
    pub(crate) decision_ext: bool,
}

/// The policy of a layer: one, or chosen by live rules.
pub(crate) enum Policies<Bk: Backend> {
    Fixed(Arc<Prepared<Bk::Policy>>),
    Rules(Arc<LiveRules<Bk>>),
}

impl<Bk: Backend> Policies<Bk> {
    /// Runs `f` with the policy for this request. The rules are read through an atomic
    /// pointer: no lock, no allocation.
    #[inline]
    pub(crate) fn with<R>(
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
    /// Pass, nothing having been taken (a shadow policy's refusal, a store failing open, a
    /// key the backend does not track): nothing to settle.
    Unsettled(HeaderAdds),
    /// Pass, with the decision for the request's extensions (`decision_in_extensions`).
    PassWith(HeaderAdds, Box<RateLimitStatus>),
    /// Pass after a wait (a reservation in wait mode). Boxed: a rare verdict, kept from making
    /// every verdict larger to move.
    Wait(HeaderAdds, Box<WaitPlan>),
    Reject(Box<Response<Bytes>>),
}

impl Verdict {
    /// Whether units were taken for the request (it passes, now or after a wait), so that
    /// its answer or its drop settles them.
    #[inline]
    pub(crate) fn took(&self) -> bool {
        matches!(
            self,
            Verdict::Pass(_) | Verdict::PassWith(..) | Verdict::Wait(..)
        )
    }

    /// The verdict, with the waiter's place `place` held while it waits (given back at once
    /// otherwise).
    fn holding(self, place: Option<Place>) -> Self {
        match self {
            Verdict::Wait(adds, mut waited) => {
                waited.place = place;
                Verdict::Wait(adds, waited)
            }
            other => other,
        }
    }
}

/// How long a request waits before it goes on, holding a waiter's place meanwhile, and its
/// decision for its extensions when asked for.
pub(crate) struct WaitPlan {
    pub(crate) wait: Duration,
    pub(crate) place: Option<Place>,
    pub(crate) status: Option<Box<RateLimitStatus>>,
}

/// A layer's [`Shared`] state behind a trait object whose methods carry the `Bk: Backend`
/// bound, so that the public types need none on their definitions.
pub(crate) struct Erased<K, Bk>(Arc<dyn Layered<K, Bk>>);

/// What hides a layer's [`Shared`] state: implemented by it alone.
pub(crate) trait Layered<K, Bk>: Send + Sync + 'static {
    /// The shared state.
    fn get(&self) -> &Shared<K, Bk>
    where
        Bk: Backend;

    /// The shared state, for a future that outlives the service's borrow.
    fn arc(self: Arc<Self>) -> Arc<Shared<K, Bk>>
    where
        Bk: Backend;
}

impl<K: KeyExtractor, Bk: Backend> Layered<K, Bk> for Shared<K, Bk> {
    #[inline]
    fn get(&self) -> &Shared<K, Bk> {
        self
    }

    fn arc(self: Arc<Self>) -> Arc<Shared<K, Bk>> {
        self
    }
}

impl<K, Bk> Clone for Erased<K, Bk> {
    fn clone(&self) -> Self {
        Erased(self.0.clone())
    }
}

impl<K, Bk> Erased<K, Bk> {
    /// A weak handle, to tell whether the layer is still alive.
    pub(crate) fn downgrade(&self) -> std::sync::Weak<dyn Send + Sync> {
        let weak: std::sync::Weak<dyn Layered<K, Bk>> = Arc::downgrade(&self.0);
        weak
    }

    /// Whether `other` is this layer's state.
    pub(crate) fn is(&self, other: &Arc<dyn Send + Sync>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(other))
    }
}

impl<K: KeyExtractor, Bk: Backend> Erased<K, Bk> {
    pub(crate) fn new(shared: Shared<K, Bk>) -> Self {
        Erased(Arc::new(shared))
    }

    /// The shared state.
    #[inline]
    pub(crate) fn get(&self) -> &Shared<K, Bk> {
        self.0.get()
    }

    /// The shared state, for a future that outlives the service's borrow.
    pub(crate) fn arc(&self) -> Arc<Shared<K, Bk>> {
        self.0.clone().arc()
    }
}

/// A request's admission: the verdict now, or a decision a store is still making.
pub(crate) enum Admission<Bk: Backend> {
    Now(Verdict),
    /// Boxed: only stores that answer over the network come here, and keeping their decision
    /// inline would make every admission larger to move.
    Later(Box<Later<Bk>>),
}

/// A decision still to be made, once [`Shared::admit`] has returned.
pub(crate) struct Later<Bk: Backend> {
    prepared: Arc<Prepared<Bk::Policy>>,
    step: Step<Bk>,
    /// A waiter's place, in wait mode, from the first refusal or pause on.
    place: Option<Place>,
}

enum Step<Bk: Backend> {
    /// The store is deciding; in wait mode, with the key and cost to reserve for if it
    /// refuses the request for less than the longest wait.
    Deciding(Bk::Future, Option<(Key, NonZeroU32)>),
    /// Wait mode, on a key the wrapped service paused: the pause is waited out, then the
    /// units reserved within what is left of the longest wait.
    Pausing(Pin<Box<tokio::time::Sleep>>, Key, NonZeroU32, Duration),
    /// The request went away, its decision handed over ([`Admitting::abandon`]): never
    /// polled again.
    Abandoned,
}

/// Admission in the response future, for a decision a store makes over the network.
pub(crate) struct Admitting<K, Bk: Backend> {
    shared: Arc<Shared<K, Bk>>,
    later: Box<Later<Bk>>,
}

impl<K, Bk: Backend> Admitting<K, Bk> {
    pub(crate) fn new(shared: Arc<Shared<K, Bk>>, later: Box<Later<Bk>>) -> Self {
        Admitting { shared, later }
    }

    /// The decision the store is still making, taken out when the request goes away before it
    /// lands, so that what it takes can be undone ([`see_through`](crate::settle::see_through)).
    /// A request waiting out a pause has asked for nothing yet.
    pub(crate) fn abandon(&mut self) -> Option<Bk::Future> {
        match std::mem::replace(&mut self.later.step, Step::Abandoned) {
            Step::Deciding(decision, _) => Some(decision),
            Step::Pausing(..) | Step::Abandoned => None,
        }
    }

    /// The verdict, once the store has answered (`headers`: the request's, for the form of a
    /// rejection).
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>, headers: &HeaderMap) -> Poll<Verdict> {
        let (shared, later) = (&*self.shared, &mut *self.later);
        let prepared = &*later.prepared;
        loop {
            match &mut later.step {
                Step::Pausing(sleep, key, cost, max_wait) => {
                    ready!(sleep.as_mut().poll(cx));
                    let mode = Mode::Reserve {
                        max_wait: *max_wait,
                    };
                    let decision = shared
                        .backend
                        .decide_with(&prepared.backend, key, *cost, mode);
                    later.step = Step::Deciding(decision, None);
                }
                Step::Deciding(decision, retry) => {
                    let result = ready!(Pin::new(decision).poll(cx));
                    // Wait mode: refused now, but the units come within the longest wait and
                    // a waiter's place is free: reserve them.
                    if let Some((key, cost)) = retry.take()
                        && let Some(waiting) = &shared.wait_mode
                        && let Some((place, max_wait)) =
                            waiting.after_refusal(prepared.reserves, &result)
                    {
                        let mode = Mode::Reserve { max_wait };
                        let decision =
                            shared
                                .backend
                                .decide_with(&prepared.backend, &key, cost, mode);
                        later.step = Step::Deciding(decision, None);
                        later.place = Some(place);
                        continue;
                    }
                    let verdict = shared.verdict(prepared, &result, headers);
                    return Poll::Ready(verdict.holding(later.place.take()));
                }
                // Only after `abandon`, which the request's drop calls.
                Step::Abandoned => return Poll::Pending,
            }
        }
    }
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

impl<K: KeyExtractor, Bk: Backend> Shared<K, Bk> {
    /// Admits `req`: its key, its policy, the backend's decision and the verdict, or the
    /// decision still to be made; and what the request settles once answered.
    #[inline]
    pub(crate) fn admit<B>(&self, req: &Request<B>) -> (Admission<Bk>, Option<Box<Settle<Bk>>>) {
        let info = RequestInfo::new(req);
        // 1. key
        let key = self.key.extract(&info);
        // 2. policy
        (self.policies).with(&info, key.as_ref().ok(), |prepared| {
            let key = match &key {
                Ok(key) => key,
                Err(err) => {
                    let verdict = self.missing_key(prepared, err, info.headers());
                    return (Admission::Now(verdict), None);
                }
            };
            let taken = Taken::of(prepared.policy.cost_of(&info));
            // A request of cost 0 is free, unless its policy holds slots (a slot is one request
            // whatever its cost) or settles (its response may report a cost): then it is
            // admitted at one unit, given back when it is settled.
            if taken.cost == 0 && !prepared.holds_slots && prepared.policy.settle_rules().is_none()
            {
                prepared.metrics.record(Counted::Free, None);
                let pass = Admission::Now(Verdict::Pass(HeaderAdds::new()));
                return (
                    pass,
                    Settle::new(&self.backend, self.pauses.as_ref(), prepared, None, key),
                );
            }
            let cost = taken.units;
            // 3. decision
            let settle = Settle::new(
                &self.backend,
                self.pauses.as_ref(),
                prepared,
                Some(taken),
                key,
            );
            let lease = Settle::lease(&settle);
            (self.decide(prepared, key, cost, lease, &info), settle)
        })
    }

    /// The backend's decision on `key` under `policy`, for `cost` units (holding a slot under
    /// `lease` when the policy has a concurrent quota).
    #[inline]
    fn decide(
        &self,
        prepared: &Arc<Prepared<Bk::Policy>>,
        key: &Key,
        cost: NonZeroU32,
        lease: Option<u64>,
        info: &RequestInfo<'_>,
    ) -> Admission<Bk> {
        // Wait mode and pauses apply to enforced policies only: a shadow policy never holds a
        // request back.
        let enforced = !prepared.policy.is_shadow();
        let waits = self.wait_mode.as_ref().filter(|_| enforced);
        let paused = (self.pauses.as_ref().filter(|_| enforced)).and_then(|p| p.remaining(key));
        if let Some(pause) = paused {
            return self.paused(prepared, key, cost, pause, info.headers());
        }
        // In wait mode a request first asks for its units now (a reservation that waits for
        // nothing: all-or-nothing on every store); only one refused for less than the longest
        // wait takes a waiter's place and reserves. So requests that pass at once never hold a
        // place, even while a store answers.
        // A request that holds an in-flight slot (a concurrent quota) cannot wait for one: it
        // is taken now or refused.
        let backend = &self.backend;
        let mut decision = match (waits, lease) {
            (_, Some(lease)) => {
                backend.decide_with(&prepared.backend, key, cost, Mode::Hold { lease })
            }
            (Some(_), None) => backend.decide_with(&prepared.backend, key, cost, NOW),
            (None, None) => backend.decide(&prepared.backend, key, cost),
        };
        let result = match poll_now(&mut decision) {
            Poll::Ready(result) => result,
            Poll::Pending => {
                let retry = waits.map(|_| (key.clone(), cost));
                return later(prepared, Step::Deciding(decision, retry), None);
            }
        };
        let Some((place, max_wait)) =
            waits.and_then(|w| w.after_refusal(prepared.reserves, &result))
        else {
            return Admission::Now(self.verdict(prepared, &result, info.headers()));
        };
        let mode = Mode::Reserve { max_wait };
        let mut decision = self.backend.decide_with(&prepared.backend, key, cost, mode);
        match poll_now(&mut decision) {
            Poll::Ready(result) => Admission::Now(
                self.verdict(prepared, &result, info.headers())
                    .holding(Some(place)),
            ),
            Poll::Pending => later(prepared, Step::Deciding(decision, None), Some(place)),
        }
    }

    /// A request on a key the wrapped service asked to slow down for `pause` more: in wait
    /// mode, when the pause fits the longest wait and a waiter's place is free, it waits the
    /// pause out and then reserves; otherwise `429` with the time left, as if its policy's
    /// first quota denied it.
    fn paused(
        &self,
        prepared: &Arc<Prepared<Bk::Policy>>,
        key: &Key,
        cost: NonZeroU32,
        pause: Duration,
        headers: &HeaderMap,
    ) -> Admission<Bk> {
        // A request holding a slot does not wait (it holds its slot from its admission on).
        if let Some(waiting) =
            (self.wait_mode.as_ref()).filter(|w| pause <= w.max_wait && !prepared.holds_slots)
            && let Some(place) = waiting.enter()
        {
            let sleep = Box::pin(tokio::time::sleep(pause));
            let step = Step::Pausing(sleep, key.clone(), cost, waiting.max_wait - pause);
            return later(prepared, step, Some(place));
        }
        let params = prepared
            .policy
            .validate()
            .ok()
            .and_then(|p| p.first().copied());
        let decision = match params {
            Some(p) => Decision::new([crate::backend::QuotaState::denied(0, &p, cost, pause)]),
            None => Decision::new([]),
        };
        Admission::Now(self.verdict(prepared, &Ok(decision), headers))
    }
}

fn later<Bk: Backend>(
    prepared: &Arc<Prepared<Bk::Policy>>,
    step: Step<Bk>,
    place: Option<Place>,
) -> Admission<Bk> {
    Admission::Later(Box::new(Later {
        prepared: prepared.clone(),
        step,
        place,
    }))
}

/// Counts an enforced policy's answer in its metrics (a shadow policy's: in
/// [`Shared::shadow`]).
#[inline]
fn count<P>(prepared: &Prepared<P>, result: &Result<Decision, BackendError>) {
    count_in(&prepared.metrics, result);
}

/// Counts an enforced policy's answer in `m`: allowed, near the limit, denied, never fits,
/// or how the failure policy answered.
#[inline]
pub(crate) fn count_in(m: &PolicyMetrics, result: &Result<Decision, BackendError>) {
    let decision = match result {
        Ok(decision) if decision.is_allowed() => return count_allowed(m, decision),
        Ok(decision) => decision,
        Err(_) => return m.record(Counted::FailClosed, None),
    };
    let outcome = if decision.never_fits() {
        Counted::NeverFits
    } else if decision.made_by() == DecidedBy::FallbackLocal {
        Counted::FallbackDenied
    } else {
        Counted::Denied
    };
    m.record(outcome, decision.tightest().map(|q| q.index));
}

/// Counts a shadow policy's answer in `m`: allowed, or what it would have refused, or a store
/// that failed.
#[cfg(feature = "rls")]
pub(crate) fn count_shadow(m: &PolicyMetrics, result: &Result<Decision, BackendError>) {
    match result {
        Ok(decision) if decision.is_allowed() => count_allowed(m, decision),
        Ok(decision) => m.record(Counted::ShadowDenied, decision.tightest().map(|q| q.index)),
        Err(_) => m.record(Counted::ShadowError, None),
    }
}

/// Counts an allowed decision, and whether it came near the limit.
#[inline]
fn count_allowed(m: &PolicyMetrics, decision: &Decision) {
    let outcome = match decision.made_by() {
        DecidedBy::FailOpen => Counted::FailOpen,
        DecidedBy::FallbackLocal => Counted::FallbackAllowed,
        _ => Counted::Allowed,
    };
    m.record(outcome, None);
    // Near the limit: the tightest quota (`Decision::tightest` of an allowed decision) has
    // less than a tenth of it left.
    let tightest = (decision.quotas().iter()).min_by_key(|q| (q.remaining, q.limit));
    if let Some(q) = tightest
        && u64::from(q.remaining) * 10 < u64::from(q.limit)
    {
        m.near_limit(q.index);
    }
}

impl<K, Bk: Backend> Shared<K, Bk> {
    /// The answer for a request without a key, as `on_missing_key` says.
    pub(crate) fn missing_key(
        &self,
        prepared: &Prepared<Bk::Policy>,
        err: &KeyError,
        headers: &HeaderMap,
    ) -> Verdict {
        let policy = prepared.policy.name();
        // No peer address: the server's setup, not the client's request, is at fault. A 500
        // with a generic body (whatever `on_missing_key` says), and the explanation in the log.
        let no_peer = *err == KeyError::NoPeerAddr;
        if no_peer {
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    "tollgate: no peer address in the request extensions, so requests cannot be \
                     keyed by IP and are answered 500; with axum, serve with \
                     `into_make_service_with_connect_info::<SocketAddr>()` (logged once)"
                );
            }
            prepared.metrics.record(Counted::NoPeerAddress, None);
        } else {
            prepared.metrics.record(Counted::MissingKey, None);
        }
        // `Allow` is an explicit choice to let keyless requests through (a server on a Unix
        // socket has no peer address at all): kept, with the log above.
        let status = match self.on_missing_key {
            OnMissingKey::Allow => {
                tracing::trace!(policy, reason = %err, "no rate-limit key; allowed");
                return Verdict::Pass(HeaderAdds::new());
            }
            OnMissingKey::Reject(_) if no_peer => StatusCode::INTERNAL_SERVER_ERROR,
            OnMissingKey::Reject(status) => status,
        };
        if prepared.policy.is_shadow() {
            tracing::info!(
                policy,
                shadow = true,
                reason = %err,
                "request without a rate-limit key would have been rejected (shadow mode)"
            );
            return Verdict::Pass(HeaderAdds::new());
        }
        tracing::debug!(policy, reason = %err, "no rate-limit key; rejected");
        let rejection = Rejection {
            kind: RejectionKind::MissingKey(err),
            policy,
            status,
            retry_after: None,
            quota_names: &[],
        };
        self.reject(&rejection, headers, HeaderAdds::new())
    }

    /// Turns a backend's answer into a verdict, logging rejections and failures. A shadow
    /// policy's answer is decided here, once, apart: it lets everything through.
    #[inline]
    pub(crate) fn verdict(
        &self,
        prepared: &Prepared<Bk::Policy>,
        result: &Result<Decision, BackendError>,
        headers: &HeaderMap,
    ) -> Verdict {
        if prepared.policy.is_shadow() {
            return self.shadow(prepared, result);
        }
        count(prepared, result);
        if let Ok(decision) = result
            && decision.is_allowed()
            && !decision.quotas().is_empty()
        {
            let style = self.responder.style;
            let adds = response::rate_limit_headers(style, &prepared.headers, decision);
            return match decision.wait() {
                Duration::ZERO if !self.decision_ext => Verdict::Pass(adds),
                wait => self.passing(prepared, decision, adds, wait),
            };
        }
        self.refused(prepared, result, headers)
    }

    /// [`verdict`](Self::verdict) for an allowed request that waits first, or carries its
    /// decision in its extensions.
    #[inline(never)]
    fn passing(
        &self,
        prepared: &Prepared<Bk::Policy>,
        decision: &Decision,
        adds: HeaderAdds,
        wait: Duration,
    ) -> Verdict {
        let status = self.decision_ext.then(|| {
            let name = prepared.policy.name();
            let labels = &prepared.headers.labels;
            Box::new(RateLimitStatus::new(
                name,
                labels,
                &prepared.quota_units,
                decision,
            ))
        });
        match (wait, status) {
            (Duration::ZERO, Some(status)) => Verdict::PassWith(adds, status),
            (Duration::ZERO, None) => Verdict::Pass(adds),
            (wait, status) => Verdict::Wait(
                adds,
                Box::new(WaitPlan {
                    wait,
                    place: None,
                    status,
                }),
            ),
        }
    }

    /// [`verdict`](Self::verdict) for an enforced policy's refusal or failure (or an allowed
    /// decision without quota states: nothing taken).
    #[inline(never)]
    fn refused(
        &self,
        prepared: &Prepared<Bk::Policy>,
        result: &Result<Decision, BackendError>,
        headers: &HeaderMap,
    ) -> Verdict {
        let policy = prepared.policy.name();
        let (decision, adds) = match result {
            Ok(decision) => {
                let style = self.responder.style;
                let adds = response::rate_limit_headers(style, &prepared.headers, decision);
                if decision.is_allowed() {
                    // Without quota states: let through, nothing taken (failing open, or a
                    // key the local backend's full table does not track).
                    return Verdict::Unsettled(adds);
                }
                (decision, adds)
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
                    retry_after: Some(Duration::from_secs(1)),
                    quota_names: &prepared.headers.labels,
                };
                return self.reject(&rejection, headers, HeaderAdds::new());
            }
        };
        let retry_after = decision.retry_after();
        tracing::debug!(
            policy,
            retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
            never_fits = decision.never_fits(),
            "request rate limited"
        );
        // A cost larger than a quota's burst can never pass: not "too many", but too large,
        // and no `Retry-After`.
        let status = if decision.never_fits() {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        let rejection = Rejection {
            kind: RejectionKind::RateLimited(decision),
            policy,
            status,
            retry_after,
            quota_names: &prepared.headers.labels,
        };
        self.reject(&rejection, headers, adds)
    }

    /// The verdict of a shadow policy: every request passes. Refusals and failures are
    /// logged and counted as such; the fields go out on allowed responses only when asked
    /// for, since they would make clients back off for nothing.
    #[inline(never)]
    fn shadow(
        &self,
        prepared: &Prepared<Bk::Policy>,
        result: &Result<Decision, BackendError>,
    ) -> Verdict {
        let policy = prepared.policy.name();
        let m = &prepared.metrics;
        match result {
            Ok(decision) if decision.is_allowed() => {
                count_allowed(m, decision);
                if !prepared.policy.sends_shadow_headers() {
                    return Verdict::Pass(HeaderAdds::new());
                }
                let style = self.responder.style;
                Verdict::Pass(response::rate_limit_headers(
                    style,
                    &prepared.headers,
                    decision,
                ))
            }
            Ok(decision) => {
                m.record(Counted::ShadowDenied, decision.tightest().map(|q| q.index));
                tracing::info!(
                    policy,
                    shadow = true,
                    retry_after_ms = decision.retry_after().map(|d| d.as_millis() as u64),
                    "request would have been rate limited (shadow mode)"
                );
                Verdict::Unsettled(HeaderAdds::new())
            }
            Err(error) => {
                m.record(Counted::ShadowError, None);
                tracing::debug!(
                    policy,
                    shadow = true,
                    %error,
                    "rate-limit backend failed; allowed (shadow mode)"
                );
                Verdict::Unsettled(HeaderAdds::new())
            }
        }
    }

    /// The rejection's response, in the request's protocol (`headers`: the request's).
    fn reject(&self, rejection: &Rejection<'_>, headers: &HeaderMap, adds: HeaderAdds) -> Verdict {
        let grpc = grpc_content_type(headers);
        Verdict::Reject(Box::new(self.responder.reject(rejection, grpc, adds)))
    }
}
