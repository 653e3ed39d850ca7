//! The rate-limit service. [`call`](RateLimit::call) reads as a request's whole path:
//! admit ([`admit`](crate::admit): key → policy → the backend's decision → verdict), call (the
//! inner service, after a wait where wait mode decided one: [`call`](crate::call)), settle (what
//! the answer says, in the response future: [`settle`](crate::settle)).

use std::fmt;
use std::marker::PhantomData;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::admit::{Admission, Admitting, Erased};
use crate::backend::Backend;
use crate::body::{BodyMode, KeepBody};
use crate::call::take_ready;
use crate::future::{Ready, ResponseFuture};
use crate::key::KeyExtractor;

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
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policy", &self.shared.get().policies.default_name())
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
        // 1. admit: key → policy → the backend's decision → verdict (with what the request
        // settles when answered)
        let (admission, settle) = self.shared.get().admit(&req);
        // 2. call the inner service: at once, after a wait, or once a store has decided;
        // 3. settle: in the response future, when the inner service answers
        match admission {
            Admission::Now(verdict) => {
                ResponseFuture::admitted(verdict, Ready::borrowed(&mut self.inner), req, settle)
            }
            Admission::Later(later) => {
                let admitting = Admitting::new(self.shared.arc(), later);
                ResponseFuture::admitting(admitting, take_ready(&mut self.inner), req, settle)
            }
        }
    }
}
