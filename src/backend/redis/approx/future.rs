//! The future of a decision: ready at once but for a synchronous variant's increment or a
//! key's first read.

use super::*;

/// The future of an [`ApproxBackend`] decision: ready at once, except a synchronous
/// variant's allowed request (its increment) and a key's first request there (its read).
pub struct ApproxFuture {
    pub(super) inner: FutureInner,
}

pub(super) enum FutureInner {
    Ready(Option<Decision>),
    Waiting(Pin<Box<dyn Future<Output = Decision> + Send>>),
    /// A decision that asks the exact backend too (a policy's concurrent quotas).
    Slots(Pin<Box<dyn Future<Output = Result<Decision, BackendError>> + Send>>),
}

impl ApproxFuture {
    pub(super) fn slots(
        f: impl Future<Output = Result<Decision, BackendError>> + Send + 'static,
    ) -> Self {
        ApproxFuture {
            inner: FutureInner::Slots(Box::pin(f)),
        }
    }
}

impl fmt::Debug for ApproxFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.inner {
            FutureInner::Ready(_) => "ApproxFuture::Ready",
            FutureInner::Waiting(_) => "ApproxFuture::Waiting",
            FutureInner::Slots(_) => "ApproxFuture::Slots",
        })
    }
}

impl Future for ApproxFuture {
    type Output = Result<Decision, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.inner {
            FutureInner::Ready(d) => match d.take() {
                Some(d) => Poll::Ready(Ok(d)),
                None => Poll::Ready(Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    "decision polled after it completed",
                ))),
            },
            FutureInner::Waiting(f) => f.as_mut().poll(cx).map(Ok),
            FutureInner::Slots(f) => f.as_mut().poll(cx),
        }
    }
}
