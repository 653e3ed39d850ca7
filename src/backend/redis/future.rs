//! The future of a Redis decision.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::task::ready;

use redis::RedisResult;
use tokio::sync::oneshot;

use super::backend::Call as Sent;
use super::batch::{Reply, abandoned};
use crate::BackendError;
use crate::backend::Decision;

type Call = Pin<Box<dyn Future<Output = Result<Decision, BackendError>> + Send>>;

/// The future returned by [`RedisBackend::decide`](crate::backend::Backend::decide).
///
/// Decisions made without a round trip (a cached denial, a cost larger than the burst, an open
/// circuit breaker) are ready at once and allocate nothing; batched decisions (a single node)
/// wait for their share of a call without boxing; the others box the Redis call.
#[must_use = "futures do nothing unless polled"]
pub struct RedisFuture {
    state: State,
}

enum State {
    Ready(Option<Result<Decision, BackendError>>),
    Batched {
        answer: oneshot::Receiver<RedisResult<Reply>>,
        sent: Sent,
    },
    Call(Call),
}

impl RedisFuture {
    pub(crate) fn ready(result: Result<Decision, BackendError>) -> Self {
        RedisFuture {
            state: State::Ready(Some(result)),
        }
    }

    pub(crate) fn batched(answer: oneshot::Receiver<RedisResult<Reply>>, sent: Sent) -> Self {
        RedisFuture {
            state: State::Batched { answer, sent },
        }
    }

    pub(crate) fn call(fut: Call) -> Self {
        RedisFuture {
            state: State::Call(fut),
        }
    }
}

impl Future for RedisFuture {
    type Output = Result<Decision, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            State::Ready(result) => match result.take() {
                Some(r) => Poll::Ready(r),
                None => Poll::Ready(Err(BackendError::from_kind(
                    crate::BackendErrorKind::Protocol,
                ))),
            },
            State::Batched { answer, sent } => {
                let outcome =
                    ready!(Pin::new(answer).poll(cx)).unwrap_or_else(|_| Err(abandoned()));
                let decision = sent.finish(outcome);
                // Polled again, it answers an error instead of polling a finished receiver.
                self.state = State::Ready(None);
                Poll::Ready(decision)
            }
            State::Call(fut) => fut.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for RedisFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Ready(_) => "Ready",
            State::Batched { .. } => "Batched",
            State::Call(_) => "Call",
        };
        f.debug_struct("RedisFuture")
            .field("state", &state)
            .finish()
    }
}
