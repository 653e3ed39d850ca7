//! The rate-limit service: key → policy → backend → pass or reject.

use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tower_service::Service;

use crate::backend::{Backend, Decision};
use crate::body::ResponseBody;
use crate::future::ResponseFuture;
use crate::key::{KeyError, KeyExtractor};
use crate::layer::OnMissingKey;
use crate::response::{self, HeaderAdds, PolicyHeaders, Rejection, RejectionKind, Responder};
use crate::{BackendError, Policy, RequestInfo};

/// Rate-limits requests to the inner service. Made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Rejections are responses (`429`, gRPC `RESOURCE_EXHAUSTED`); the error type is the inner
/// service's, untouched.
pub struct RateLimit<S, K, Bk: Backend> {
    inner: S,
    shared: Arc<Shared<K, Bk>>,
}

/// Everything the services of one layer share.
pub(crate) struct Shared<K, Bk: Backend> {
    pub(crate) key: K,
    pub(crate) backend: Bk,
    pub(crate) policy: Arc<Prepared<Bk::Policy>>,
    pub(crate) responder: Responder,
    pub(crate) on_missing_key: OnMissingKey,
}

/// A policy with its backend-prepared form and header material.
pub(crate) struct Prepared<P> {
    pub(crate) policy: Policy,
    pub(crate) backend: P,
    pub(crate) headers: PolicyHeaders,
}

/// What to do with a request once the backend has answered.
pub(crate) enum Verdict {
    Pass(HeaderAdds),
    Reject(Response<Bytes>),
}

impl<S, K, Bk: Backend> RateLimit<S, K, Bk> {
    pub(crate) fn from_shared(inner: S, shared: Arc<Shared<K, Bk>>) -> Self {
        RateLimit { inner, shared }
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

impl<S: Clone, K, Bk: Backend> Clone for RateLimit<S, K, Bk> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, K, Bk: Backend> fmt::Debug for RateLimit<S, K, Bk> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policy", &self.shared.policy.policy.name())
            .finish()
    }
}

impl<S, K, Bk, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, K, Bk>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor,
    Bk: Backend,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, K, Bk>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let shared = &self.shared;
        let info = RequestInfo::new(&req);
        let grpc = info.is_grpc();
        let policy = &shared.policy;
        let key = match shared.key.extract(&info) {
            Ok(key) => key,
            Err(err) => return self.missing_key(req, &err, grpc),
        };
        let Some(cost) = NonZeroU32::new(policy.policy.cost_of(&info)) else {
            return ResponseFuture::called(self.inner.call(req), HeaderAdds::new());
        };
        let mut decision = shared.backend.decide(&policy.backend, &key, cost);
        // Local backends answer at once: then the inner service, polled ready, is called
        // right here. Otherwise the decision goes on in the response future with a clone of
        // the inner service, and the ready one stays in the future (tower's ready-clone rule).
        match Pin::new(&mut decision).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(result) => match shared.verdict(policy, result, grpc) {
                Verdict::Pass(adds) => ResponseFuture::called(self.inner.call(req), adds),
                Verdict::Reject(res) => ResponseFuture::rejected(res),
            },
            Poll::Pending => {
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::deciding(decision, ready, req, shared.clone(), grpc)
            }
        }
    }
}

impl<S, K, Bk: Backend> RateLimit<S, K, Bk> {
    fn missing_key<ReqBody, ResBody>(
        &mut self,
        req: Request<ReqBody>,
        err: &KeyError,
        grpc: bool,
    ) -> ResponseFuture<S, ReqBody, K, Bk>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    {
        if *err == KeyError::NoPeerAddr {
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    "tollgate: no peer address in the request extensions; with axum, serve with \
                     `into_make_service_with_connect_info::<SocketAddr>()` (logged once)"
                );
            }
        }
        let policy = self.shared.policy.policy.name();
        match self.shared.on_missing_key {
            OnMissingKey::Allow => {
                tracing::trace!(policy, reason = %err, "no rate-limit key; allowed");
                ResponseFuture::called(self.inner.call(req), HeaderAdds::new())
            }
            OnMissingKey::Reject(status) => {
                tracing::debug!(policy, reason = %err, "no rate-limit key; rejected");
                let rejection = Rejection {
                    kind: RejectionKind::MissingKey(err),
                    policy,
                    status,
                    retry_after: None,
                };
                let res = self
                    .shared
                    .responder
                    .reject(&rejection, grpc, HeaderAdds::new());
                ResponseFuture::rejected(res)
            }
        }
    }
}

impl<K, Bk: Backend> Shared<K, Bk> {
    /// Turns a backend's answer into a verdict, logging rejections and failures.
    pub(crate) fn verdict(
        &self,
        prepared: &Prepared<Bk::Policy>,
        result: Result<Decision, BackendError>,
        grpc: bool,
    ) -> Verdict {
        let policy = prepared.policy.name();
        match result {
            Ok(decision) if decision.is_allowed() => Verdict::Pass(response::rate_limit_headers(
                self.responder.style,
                &prepared.headers,
                &decision,
            )),
            Ok(decision) if prepared.policy.is_shadow() => {
                tracing::info!(
                    policy,
                    shadow = true,
                    retry_after_ms = decision.retry_after().map(|d| d.as_millis() as u64),
                    "request would have been rate limited (shadow mode)"
                );
                Verdict::Pass(HeaderAdds::new())
            }
            Ok(decision) => {
                let retry_after = decision.retry_after();
                tracing::debug!(
                    policy,
                    retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
                    never_fits = decision.never_fits(),
                    "request rate limited"
                );
                let adds = response::rate_limit_headers(
                    self.responder.style,
                    &prepared.headers,
                    &decision,
                );
                let rejection = Rejection {
                    kind: RejectionKind::RateLimited(&decision),
                    policy,
                    status: StatusCode::TOO_MANY_REQUESTS,
                    retry_after,
                };
                Verdict::Reject(self.responder.reject(&rejection, grpc, adds))
            }
            Err(error) => {
                tracing::warn!(policy, %error, "rate-limit backend failed; answering 503");
                let rejection = Rejection {
                    kind: RejectionKind::BackendUnavailable,
                    policy,
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    retry_after: Some(std::time::Duration::from_secs(1)),
                };
                Verdict::Reject(self.responder.reject(&rejection, grpc, HeaderAdds::new()))
            }
        }
    }
}
