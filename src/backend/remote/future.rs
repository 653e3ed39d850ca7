//! The future of a remote decision.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use super::batch::Answer;
use crate::backend::Decision;
use crate::{BackendError, BackendErrorKind};

type Call = Pin<Box<dyn Future<Output = Result<Decision, BackendError>> + Send>>;

/// The future of a remote backend's decision (Redis, PostgreSQL, MySQL).
///
/// Decisions made without a round trip (a cached denial, an open circuit breaker) are ready at
/// once and allocate nothing; batched decisions wait for their share of a call without boxing;
/// the others box the call.
#[must_use = "futures do nothing unless polled"]
pub struct RemoteFuture {
    state: State,
}

enum State {
    Ready(Option<Result<Decision, BackendError>>),
    Batched(Answer),
    Call(Call),
}

impl RemoteFuture {
    pub(crate) fn ready(result: Result<Decision, BackendError>) -> Self {
        RemoteFuture {
            state: State::Ready(Some(result)),
        }
    }

    pub(crate) fn batched(answer: Answer) -> Self {
        RemoteFuture {
            state: State::Batched(answer),
        }
    }

    pub(crate) fn call(fut: Call) -> Self {
        RemoteFuture {
            state: State::Call(fut),
        }
    }
}

impl Future for RemoteFuture {
    type Output = Result<Decision, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            State::Ready(result) => match result.take() {
                Some(r) => Poll::Ready(r),
                None => Poll::Ready(Err(BackendError::from_kind(BackendErrorKind::Protocol))),
            },
            State::Batched(answer) => {
                // The batching task always answers, unless it is gone (its runtime shut down).
                let decision = ready!(Pin::new(answer).poll(cx)).unwrap_or_else(|_| {
                    Err(BackendError::new(
                        BackendErrorKind::Unavailable,
                        "the batched call was abandoned",
                    ))
                });
                // Polled again, it answers an error instead of polling a finished receiver.
                self.state = State::Ready(None);
                Poll::Ready(decision)
            }
            State::Call(fut) => fut.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for RemoteFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Ready(_) => "Ready",
            State::Batched(_) => "Batched",
            State::Call(_) => "Call",
        };
        f.debug_struct("RemoteFuture")
            .field("state", &state)
            .finish()
    }
}
