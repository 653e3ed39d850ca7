//! The call, the second stage of a request: the inner service, at once or after a wait that wait
//! mode decided.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::Request;
use tower_service::Service;

use crate::backend::Backend;
use crate::response::HeaderAdds;
use crate::settle::Settle;
use crate::wait::Place;

/// The service that was polled ready, for a request that goes on later: a fresh clone takes its
/// place (tower's rule: a clone that was never polled ready must not be called).
#[inline]
pub(crate) fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// A request held before its call (wait mode): its units are reserved, and it goes on when the
/// sleep ends.
pub(crate) struct Wait<S, ReqBody, Bk: Backend> {
    sleep: Pin<Box<tokio::time::Sleep>>,
    call: Option<Call<S, ReqBody, Bk>>,
    // Given back when the request goes on, or when it is dropped while waiting.
    _place: Option<Place>,
}

/// A call to make: the ready service and its request, with what admission decided for the
/// response.
pub(crate) struct Call<S, ReqBody, Bk: Backend> {
    pub(crate) inner: S,
    pub(crate) req: Request<ReqBody>,
    pub(crate) adds: HeaderAdds,
    pub(crate) settle: Option<Box<Settle<Bk>>>,
}

impl<S, ReqBody, Bk: Backend> Wait<S, ReqBody, Bk> {
    pub(crate) fn new(wait: Duration, place: Option<Place>, call: Call<S, ReqBody, Bk>) -> Self {
        Wait {
            sleep: Box::pin(tokio::time::sleep(wait)),
            call: Some(call),
            _place: place,
        }
    }

    /// The call, once the wait is over (`None` if asked again after that).
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Call<S, ReqBody, Bk>>>
    where
        S: Service<Request<ReqBody>>,
    {
        ready!(self.sleep.as_mut().poll(cx));
        Poll::Ready(self.call.take())
    }
}
