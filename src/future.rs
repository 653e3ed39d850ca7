//! The response future of [`RateLimit`](crate::RateLimit).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::backend::Backend;
use crate::body::ResponseBody;
use crate::response::{HeaderAdds, add_headers};
use crate::service::{Prepared, Shared, Verdict};

pin_project! {
    /// The future returned by [`RateLimit`](crate::RateLimit): waits for the backend's
    /// decision when it is not immediate, then calls the inner service or answers the
    /// rejection.
    pub struct ResponseFuture<S, ReqBody, K, Bk>
    where
        S: Service<Request<ReqBody>>,
        Bk: Backend,
    {
        #[pin]
        state: State<S, ReqBody, K, Bk>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, K, Bk>
    where
        S: Service<Request<ReqBody>>,
        Bk: Backend,
    {
        Deciding {
            decision: Bk::Future,
            // The service that was polled ready, and the request for it.
            inner: Option<(S, Request<ReqBody>)>,
            shared: Arc<Shared<K, Bk>>,
            policy: Arc<Prepared<Bk::Policy>>,
            grpc: bool,
        },
        Called {
            #[pin]
            fut: S::Future,
            adds: Option<HeaderAdds>,
        },
        Rejected {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqBody, K, Bk> ResponseFuture<S, ReqBody, K, Bk>
where
    S: Service<Request<ReqBody>>,
    Bk: Backend,
{
    pub(crate) fn called(fut: S::Future, adds: HeaderAdds) -> Self {
        ResponseFuture {
            state: State::Called {
                fut,
                adds: Some(adds),
            },
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        ResponseFuture {
            state: State::Rejected {
                response: Some(response),
            },
        }
    }

    pub(crate) fn deciding(
        decision: Bk::Future,
        inner: S,
        req: Request<ReqBody>,
        shared: Arc<Shared<K, Bk>>,
        policy: Arc<Prepared<Bk::Policy>>,
        grpc: bool,
    ) -> Self {
        ResponseFuture {
            state: State::Deciding {
                decision,
                inner: Some((inner, req)),
                shared,
                policy,
                grpc,
            },
        }
    }
}

impl<S, ReqBody, ResBody, K, Bk> Future for ResponseFuture<S, ReqBody, K, Bk>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    Bk: Backend,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Deciding {
                    decision,
                    inner,
                    shared,
                    policy,
                    grpc,
                } => {
                    let result = ready!(Pin::new(decision).poll(cx));
                    let next = match shared.verdict(policy, result, *grpc) {
                        Verdict::Pass(adds) => match inner.take() {
                            Some((mut svc, req)) => State::Called {
                                fut: svc.call(req),
                                adds: Some(adds),
                            },
                            None => panic!("ResponseFuture polled after completion"),
                        },
                        Verdict::Reject(res) => State::Rejected {
                            response: Some(res),
                        },
                    };
                    state.set(next);
                }
                StateProj::Called { fut, adds } => {
                    let mut res = ready!(fut.poll(cx))?.map(ResponseBody::inner);
                    if let Some(adds) = adds.take() {
                        add_headers(res.headers_mut(), adds);
                    }
                    return Poll::Ready(Ok(res));
                }
                StateProj::Rejected { response } => {
                    let res = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(res.map(ResponseBody::full)));
                }
            }
        }
    }
}
