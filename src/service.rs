//! The rate-limit service: admit (key → policy → backend → verdict, in [`admit`](crate::admit)),
//! then call the inner service, in its response future.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{Request, Response};
use tower_service::Service;

use crate::RequestInfo;
use crate::admit::{Note, Prepared, Shared, Verdict};
use crate::backend::{Backend, Mode};
use crate::body::{BodyMode, KeepBody};
use crate::future::{DecideLater, ResponseFuture, Then};
use crate::key::KeyExtractor;
use crate::metrics::Outcome as Counted;
use crate::response::HeaderAdds;
use crate::wait::{Slot, Waiting};

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
                    Err(err) => {
                        return Step::Done(shared.missing_key(policy, err, info.headers()), None);
                    }
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
                let Some((slot, max_wait)) =
                    waits.and_then(|w| w.after_refusal(policy.reserves, &result))
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
