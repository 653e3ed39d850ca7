//! The response future of [`RateLimit`](crate::RateLimit).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::admit::{Note, Prepared, Shared, Verdict};
use crate::backend::Backend;
use crate::body::{BodyMode, KeepBody};
use crate::response::{HeaderAdds, add_headers};
use crate::wait::Slot;

pin_project! {
    /// The future returned by [`RateLimit`](crate::RateLimit): waits for the backend's
    /// decision when it is not immediate, then calls the inner service or answers the
    /// rejection.
    pub struct ResponseFuture<S, ReqBody, K, Bk, M = KeepBody>
    where
        S: Service<Request<ReqBody>>,
        Bk: Backend,
    {
        #[pin]
        state: State<S, ReqBody, K, Bk>,
        mode: PhantomData<fn() -> M>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, K, Bk>
    where
        S: Service<Request<ReqBody>>,
        Bk: Backend,
    {
        // Boxed: only asynchronous backends (Redis) come here, and they pay a network round
        // trip anyway, while keeping the request and a service clone inline would make every
        // future larger and slower to move.
        Deciding {
            deciding: Box<Deciding<S, ReqBody, K, Bk>>,
        },
        // Wait mode: the request's units are reserved; it goes on when the sleep ends.
        Waiting {
            waiting: Box<Waiting<S, ReqBody>>,
        },
        // Wait mode on a paused key: the pause is waited out, then the units reserved.
        Pausing {
            pausing: Box<Pausing<S, ReqBody, K, Bk>>,
        },
        Called {
            #[pin]
            fut: S::Future,
            adds: Option<HeaderAdds>,
            note: Option<Box<Note>>,
        },
        Rejected {
            response: Option<Box<Response<Bytes>>>,
        },
    }
}

struct Deciding<S, ReqBody, K, Bk: Backend> {
    decision: Bk::Future,
    // The service that was polled ready, and the request for it.
    inner: Option<(S, Request<ReqBody>)>,
    shared: Arc<Shared<K, Bk>>,
    policy: Arc<Prepared<Bk::Policy>>,
    then: Then,
}

/// What a decision still being made carries to the rest of the request: a waiter's slot in
/// wait mode (held until the request goes on), what reads the wrapped service's answer for
/// a request to slow down, and in wait mode, until a reservation is made, the key and cost
/// to reserve for if the store refuses the request for less than the longest wait.
pub(crate) struct Then {
    pub(crate) slot: Option<Slot>,
    pub(crate) note: Option<Box<Note>>,
    pub(crate) retry: Option<(crate::Key, std::num::NonZeroU32)>,
}

/// A reservation to make once a pause the wrapped service asked for has passed.
pub(crate) struct DecideLater<K, Bk: Backend> {
    pub(crate) shared: Arc<Shared<K, Bk>>,
    pub(crate) policy: Arc<Prepared<Bk::Policy>>,
    pub(crate) key: crate::Key,
    pub(crate) cost: std::num::NonZeroU32,
    /// What is left of the longest wait.
    pub(crate) max_wait: Duration,
}

struct Pausing<S, ReqBody, K, Bk: Backend> {
    sleep: Pin<Box<tokio::time::Sleep>>,
    inner: Option<(S, Request<ReqBody>)>,
    later: DecideLater<K, Bk>,
    then: Then,
}

struct Waiting<S, ReqBody> {
    sleep: Pin<Box<tokio::time::Sleep>>,
    inner: Option<(S, Request<ReqBody>)>,
    adds: Option<HeaderAdds>,
    // Given back when the request goes on, or when it is dropped while waiting.
    _slot: Option<Slot>,
    note: Option<Box<Note>>,
}

impl<S, ReqBody, K, Bk, M> ResponseFuture<S, ReqBody, K, Bk, M>
where
    S: Service<Request<ReqBody>>,
    Bk: Backend,
{
    pub(crate) fn called(fut: S::Future, adds: HeaderAdds, note: Option<Box<Note>>) -> Self {
        ResponseFuture {
            state: State::Called {
                fut,
                adds: Some(adds),
                note,
            },
            mode: PhantomData,
        }
    }

    pub(crate) fn rejected(response: Box<Response<Bytes>>) -> Self {
        ResponseFuture {
            state: State::Rejected {
                response: Some(response),
            },
            mode: PhantomData,
        }
    }

    pub(crate) fn deciding(
        decision: Bk::Future,
        inner: S,
        req: Request<ReqBody>,
        shared: Arc<Shared<K, Bk>>,
        policy: Arc<Prepared<Bk::Policy>>,
        then: Then,
    ) -> Self {
        ResponseFuture {
            state: State::Deciding {
                deciding: Box::new(Deciding {
                    decision,
                    inner: Some((inner, req)),
                    shared,
                    policy,
                    then,
                }),
            },
            mode: PhantomData,
        }
    }

    pub(crate) fn pausing(
        pause: Duration,
        inner: S,
        req: Request<ReqBody>,
        later: DecideLater<K, Bk>,
        then: Then,
    ) -> Self {
        ResponseFuture {
            state: State::Pausing {
                pausing: Box::new(Pausing {
                    sleep: Box::pin(tokio::time::sleep(pause)),
                    inner: Some((inner, req)),
                    later,
                    then,
                }),
            },
            mode: PhantomData,
        }
    }

    pub(crate) fn waiting(
        wait: Duration,
        inner: S,
        req: Request<ReqBody>,
        adds: HeaderAdds,
        slot: Option<Slot>,
        note: Option<Box<Note>>,
    ) -> Self {
        ResponseFuture {
            state: State::Waiting {
                waiting: Box::new(Waiting {
                    sleep: Box::pin(tokio::time::sleep(wait)),
                    inner: Some((inner, req)),
                    adds: Some(adds),
                    _slot: slot,
                    note,
                }),
            },
            mode: PhantomData,
        }
    }
}

impl<S, ReqBody, ResBody, K, Bk, M> Future for ResponseFuture<S, ReqBody, K, Bk, M>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    Bk: Backend,
    M: BodyMode<ResBody>,
{
    type Output = Result<Response<M::Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Deciding { deciding } => {
                    let d = &mut **deciding;
                    let result = ready!(Pin::new(&mut d.decision).poll(cx));
                    // Wait mode: refused now, but the units come within the longest wait and a
                    // waiter's slot is free: reserve them.
                    // (`retry` is set in wait mode only, for enforced policies.)
                    if let Some((key, cost)) = d.then.retry.take()
                        && let Some(waiting) = &d.shared.waiting
                        && let Some((slot, max_wait)) =
                            waiting.after_refusal(d.policy.reserves, &result)
                    {
                        let mode = crate::backend::Mode::Reserve { max_wait };
                        let backend = &d.shared.backend;
                        d.decision = backend.decide_with(&d.policy.backend, &key, cost, mode);
                        d.then.slot = Some(slot);
                        continue;
                    }
                    let Some((_, req)) = &d.inner else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let verdict = d.shared.verdict(&d.policy, result, req.headers());
                    let next = match verdict {
                        Verdict::Pass(adds) => match d.inner.take() {
                            Some((mut svc, req)) => State::Called {
                                fut: svc.call(req),
                                adds: Some(adds),
                                note: d.then.note.take(),
                            },
                            None => panic!("ResponseFuture polled after completion"),
                        },
                        Verdict::Wait(adds, wait) => match d.inner.take() {
                            Some((svc, req)) => State::Waiting {
                                waiting: Box::new(Waiting {
                                    sleep: Box::pin(tokio::time::sleep(wait)),
                                    inner: Some((svc, req)),
                                    adds: Some(adds),
                                    _slot: d.then.slot.take(),
                                    note: d.then.note.take(),
                                }),
                            },
                            None => panic!("ResponseFuture polled after completion"),
                        },
                        Verdict::Reject(res) => State::Rejected {
                            response: Some(res),
                        },
                    };
                    state.set(next);
                }
                StateProj::Pausing { pausing } => {
                    let p = &mut **pausing;
                    ready!(p.sleep.as_mut().poll(cx));
                    let Some((svc, req)) = p.inner.take() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let (shared, policy) = (p.later.shared.clone(), p.later.policy.clone());
                    let mode = crate::backend::Mode::Reserve {
                        max_wait: p.later.max_wait,
                    };
                    let decision = (shared.backend).decide_with(
                        &policy.backend,
                        &p.later.key,
                        p.later.cost,
                        mode,
                    );
                    let then = Then {
                        slot: p.then.slot.take(),
                        note: p.then.note.take(),
                        retry: None,
                    };
                    let next = State::Deciding {
                        deciding: Box::new(Deciding {
                            decision,
                            inner: Some((svc, req)),
                            shared,
                            policy,
                            then,
                        }),
                    };
                    state.set(next);
                }
                StateProj::Waiting { waiting } => {
                    let w = &mut **waiting;
                    ready!(w.sleep.as_mut().poll(cx));
                    let (Some((mut svc, req)), Some(adds)) = (w.inner.take(), w.adds.take()) else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let note = w.note.take();
                    state.set(State::Called {
                        fut: svc.call(req),
                        adds: Some(adds),
                        note,
                    });
                }
                StateProj::Called { fut, adds, note } => {
                    let res = ready!(fut.poll(cx))?;
                    if let Some(note) = note.take() {
                        note.pauses.note(&note.key, &res);
                    }
                    let mut res = res.map(M::pass);
                    if let Some(adds) = adds.take() {
                        add_headers(res.headers_mut(), adds);
                    }
                    return Poll::Ready(Ok(res));
                }
                StateProj::Rejected { response } => {
                    let res = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok((*res).map(M::reject)));
                }
            }
        }
    }
}
