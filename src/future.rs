//! The response future of [`RateLimit`](crate::RateLimit).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::admit::{Admitting, Verdict, WaitPlan};
use crate::backend::Backend;
use crate::body::{BodyMode, KeepBody};
use crate::call::{Call, Wait, take_ready};
use crate::response::HeaderAdds;
use crate::settle::{Settle, see_through, settle, took};

pin_project! {
    /// The future returned by [`RateLimit`](crate::RateLimit): a request's stages after
    /// [`call`](tower_service::Service::call) returned. It waits for a store's decision when
    /// it was not immediate (admit), waits where wait mode says so and calls the inner service
    /// (call), then reads the answer and adds the rate-limit fields (settle); or it answers
    /// the rejection.
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
        // Boxed, like `Waiting`: only stores that answer over the network come here, and they
        // pay a round trip anyway, while keeping the request and a service clone inline would
        // make every future larger and slower to move.
        Admitting {
            admitting: Box<Pending<S, ReqBody, K, Bk>>,
        },
        Waiting {
            wait: Box<Wait<S, ReqBody, Bk>>,
        },
        Calling {
            #[pin]
            fut: S::Future,
            adds: Option<HeaderAdds>,
            settle: Option<Box<Settle<Bk>>>,
        },
        Refused {
            response: Option<Box<Response<Bytes>>>,
        },
    }
}

/// A request whose admission a store is still deciding, and the ready service for it.
struct Pending<S, ReqBody, K, Bk: Backend> {
    admitting: Admitting<K, Bk>,
    call: Option<(S, Request<ReqBody>)>,
    settle: Option<Box<Settle<Bk>>>,
}

impl<S, ReqBody, K, Bk: Backend> Drop for Pending<S, ReqBody, K, Bk> {
    /// The request went away while a store was deciding its admission: the decision is seen
    /// through, and what it took is undone once it lands (its slot given back, its units by
    /// the cancellation rule), as for a request dropped after its admission.
    fn drop(&mut self) {
        if let Some(settle) = self.settle.take()
            && let Some(decision) = self.admitting.abandon()
        {
            see_through(decision, move |result| {
                let mut settle = Some(settle);
                if took(&result) {
                    Settle::arm(&mut settle);
                }
                // Dropped armed: settled as cancelled.
                drop(settle);
            });
        }
    }
}

impl<S, ReqBody, K, Bk, M> ResponseFuture<S, ReqBody, K, Bk, M>
where
    S: Service<Request<ReqBody>>,
    Bk: Backend,
{
    fn new(state: State<S, ReqBody, K, Bk>) -> Self {
        ResponseFuture {
            state,
            mode: PhantomData,
        }
    }

    /// Admission is still being decided by a store.
    pub(crate) fn admitting(
        admitting: Admitting<K, Bk>,
        inner: S,
        req: Request<ReqBody>,
        settle: Option<Box<Settle<Bk>>>,
    ) -> Self {
        let call = Some((inner, req));
        let admitting = Box::new(Pending {
            admitting,
            call,
            settle,
        });
        Self::new(State::Admitting { admitting })
    }

    /// The request is refused with `response`.
    fn refused(response: Box<Response<Bytes>>) -> Self {
        Self::new(State::Refused {
            response: Some(response),
        })
    }

    /// What follows an admission, for every verdict: the call (at once, or after the wait
    /// admission decided), or the refusal. `inner` is the service that was polled ready, for
    /// `req`.
    #[inline]
    pub(crate) fn admitted(
        verdict: Verdict,
        inner: Ready<'_, S>,
        mut req: Request<ReqBody>,
        mut settle: Option<Box<Settle<Bk>>>,
    ) -> Self {
        // Units were taken for the request: from here on its answer, or its drop, settles them.
        if verdict.took() {
            Settle::arm(&mut settle);
        }
        match verdict {
            Verdict::Pass(adds) => Self::calling(inner.call(req), adds, settle),
            Verdict::PassWith(adds, status) => {
                req.extensions_mut().insert(*status);
                Self::calling(inner.call(req), adds, settle)
            }
            // Nothing was taken: the response settles nothing (it may still note a pause).
            Verdict::Unsettled(adds) => Self::calling(inner.call(req), adds, settle),
            Verdict::Wait(adds, plan) => {
                Self::waiting(*plan, inner.into_owned(), req, adds, settle)
            }
            Verdict::Reject(response) => Self::refused(response),
        }
    }

    /// The request waits as its plan says, then calls `inner`.
    #[inline(never)]
    fn waiting(
        plan: WaitPlan,
        inner: S,
        mut req: Request<ReqBody>,
        adds: HeaderAdds,
        settle: Option<Box<Settle<Bk>>>,
    ) -> Self {
        let WaitPlan {
            wait,
            place,
            status,
        } = plan;
        if let Some(status) = status {
            req.extensions_mut().insert(*status);
        }
        let call = Call {
            inner,
            req,
            adds,
            settle,
        };
        Self::new(State::Waiting {
            wait: Box::new(Wait::new(wait, place, call)),
        })
    }

    /// The inner service is called.
    fn calling(fut: S::Future, adds: HeaderAdds, settle: Option<Box<Settle<Bk>>>) -> Self {
        Self::new(State::Calling {
            fut,
            adds: Some(adds),
            settle,
        })
    }
}

/// The service that was polled ready for a request: the layer's own (borrowed, called at once,
/// with the way to take it for a call made later) or one taken already.
pub(crate) enum Ready<'a, S> {
    Borrowed(&'a mut S, fn(&mut S) -> S),
    Owned(S),
}

impl<'a, S: Clone> Ready<'a, S> {
    /// The layer's service, polled ready.
    #[inline]
    pub(crate) fn borrowed(inner: &'a mut S) -> Self {
        Ready::Borrowed(inner, take_ready::<S>)
    }
}

impl<S> Ready<'_, S> {
    /// Calls the service now.
    #[inline]
    fn call<ReqBody>(self, req: Request<ReqBody>) -> S::Future
    where
        S: Service<Request<ReqBody>>,
    {
        match self {
            Ready::Borrowed(inner, _) => inner.call(req),
            Ready::Owned(mut inner) => inner.call(req),
        }
    }

    /// The service, for a call made later: the ready one, a fresh clone taking its place in
    /// the layer ([`take_ready`]).
    fn into_owned(self) -> S {
        match self {
            Ready::Borrowed(inner, take) => take(inner),
            Ready::Owned(inner) => inner,
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
        let this = self.project();
        let mut state = this.state;
        loop {
            let next = match state.as_mut().project() {
                StateProj::Admitting { admitting } => {
                    let p = &mut **admitting;
                    let Some((_, req)) = &p.call else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let verdict = ready!(p.admitting.poll(cx, req.headers()));
                    let Some((inner, req)) = p.call.take() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    Self::admitted(verdict, Ready::Owned(inner), req, p.settle.take()).state
                }
                StateProj::Waiting { wait } => {
                    let Some(mut call) = ready!(wait.poll(cx)) else {
                        panic!("ResponseFuture polled after completion");
                    };
                    State::Calling {
                        fut: call.inner.call(call.req),
                        adds: Some(call.adds),
                        settle: call.settle,
                    }
                }
                StateProj::Calling {
                    fut,
                    adds,
                    settle: s,
                } => {
                    let res = ready!(fut.poll(cx))?;
                    return Poll::Ready(Ok(settle::<_, M, Bk>(res, adds.take(), s.take())));
                }
                StateProj::Refused { response } => {
                    let res = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok((*res).map(M::reject)));
                }
            };
            state.set(next);
        }
    }
}
