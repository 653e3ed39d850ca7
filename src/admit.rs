//! Admission: a request's key, its policy, the backend's decision, and the verdict (pass, wait
//! or reject), with shadow policies decided here.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};

use crate::backend::{Backend, DecidedBy, Decision};
use crate::key::{KeyError, OnMissingKey};
use crate::metrics::{Outcome as Counted, PolicyMetrics};
use crate::request::grpc_content_type;
use crate::response::{self, HeaderAdds, PolicyHeaders, Rejection, RejectionKind, Responder};
use crate::rules::LiveRules;
use crate::wait::{Pauses, Waiting};
use crate::{BackendError, ConfigError, Key, Policy, RequestInfo};

/// Everything the services of one layer share.
pub(crate) struct Shared<K, Bk: Backend> {
    pub(crate) key: K,
    pub(crate) backend: Arc<Bk>,
    pub(crate) policies: Policies<Bk>,
    pub(crate) responder: Responder,
    pub(crate) on_missing_key: OnMissingKey,
    /// Wait mode: hold requests until allowed instead of rejecting them.
    pub(crate) waiting: Option<Waiting>,
    /// Keys the wrapped service asked to slow down, when obeyed.
    pub(crate) pauses: Option<Arc<Pauses>>,
}

/// A policy with its backend-prepared form, header material and counters.
pub(crate) struct Prepared<P> {
    pub(crate) policy: Policy,
    pub(crate) backend: P,
    pub(crate) headers: PolicyHeaders,
    pub(crate) metrics: PolicyMetrics,
    /// Whether every quota is GCRA, so that a reservation can wait (window quotas cannot count
    /// into a window that has not begun: a reservation on them waits for nothing).
    pub(crate) reserves: bool,
}

impl<P> Prepared<P> {
    /// `policy` validated and prepared for `backend`, with its header material and counters.
    pub(crate) fn new<Bk: Backend<Policy = P>>(
        backend: &Bk,
        policy: Policy,
    ) -> Result<Self, ConfigError> {
        let params = policy.validate()?;
        let prepared = backend.prepare(&policy, &params)?;
        let headers = PolicyHeaders::new(&policy, &params);
        Ok(Prepared {
            metrics: PolicyMetrics::new(&policy, &headers.labels),
            reserves: params
                .iter()
                .all(|p| p.kind == crate::quota::QuotaKind::Gcra),
            headers,
            backend: prepared,
            policy,
        })
    }
}

/// The policy of a layer: one, or chosen by live rules.
pub(crate) enum Policies<Bk: Backend> {
    Fixed(Arc<Prepared<Bk::Policy>>),
    Rules(Arc<LiveRules<Bk>>),
}

impl<Bk: Backend> Policies<Bk> {
    /// Runs `f` with the policy for this request. The rules are read through an atomic
    /// pointer: no lock, no allocation.
    pub(crate) fn with<R>(
        &self,
        req: &RequestInfo<'_>,
        key: Option<&Key>,
        f: impl FnOnce(&Arc<Prepared<Bk::Policy>>) -> R,
    ) -> R {
        match self {
            Policies::Fixed(p) => f(p),
            Policies::Rules(live) => f(live.current.load().select(req, key)),
        }
    }

    /// The name of the default policy, for logs.
    pub(crate) fn default_name(&self) -> String {
        match self {
            Policies::Fixed(p) => p.policy.name().to_owned(),
            Policies::Rules(live) => live.current.load().default_name().to_owned(),
        }
    }
}

/// What to do with a request once the backend has answered.
pub(crate) enum Verdict {
    Pass(HeaderAdds),
    /// Pass after waiting this long (a reservation in wait mode).
    Wait(HeaderAdds, Duration),
    Reject(Box<Response<Bytes>>),
}

/// Counts a backend's answer in the policy's metrics.
#[inline]
pub(crate) fn count<P>(prepared: &Prepared<P>, result: &Result<Decision, BackendError>) {
    let m = &prepared.metrics;
    let shadow = prepared.policy.is_shadow();
    let decision = match result {
        Ok(decision) => decision,
        Err(_) if shadow => return m.record(Counted::ShadowError, None),
        Err(_) => return m.record(Counted::FailClosed, None),
    };
    let fallback = decision.made_by() == DecidedBy::FallbackLocal;
    if decision.is_allowed() {
        let outcome = match decision.made_by() {
            DecidedBy::FailOpen => Counted::FailOpen,
            _ if fallback => Counted::FallbackAllowed,
            _ => Counted::Allowed,
        };
        m.record(outcome, None);
        // Near the limit: the tightest quota has less than a tenth of it left.
        if let Some(q) = decision.tightest()
            && u64::from(q.remaining) * 10 < u64::from(q.limit)
        {
            m.near_limit(q.index);
        }
        return;
    }
    let quota = decision.tightest().map(|q| q.index);
    // A shadow policy lets every refusal through: counted as such, whatever the reason.
    let outcome = if shadow {
        Counted::ShadowDenied
    } else if decision.never_fits() {
        Counted::NeverFits
    } else if fallback {
        Counted::FallbackDenied
    } else {
        Counted::Denied
    };
    m.record(outcome, quota);
}

/// What the response future needs to read the wrapped service's answer for a request to slow
/// down.
pub(crate) struct Note {
    pub(crate) key: Key,
    pub(crate) pauses: Arc<Pauses>,
}

impl<K, Bk: Backend> Shared<K, Bk> {
    /// The answer for a request whose key the wrapped service asked to slow down for `pause`
    /// more: `429` with the time left, as if its policy's first quota denied it.
    pub(crate) fn paused(
        &self,
        prepared: &Prepared<Bk::Policy>,
        cost: NonZeroU32,
        pause: Duration,
        headers: &HeaderMap,
    ) -> Verdict {
        let params = prepared
            .policy
            .validate()
            .ok()
            .and_then(|p| p.first().copied());
        let decision = match params {
            Some(p) => Decision::new([crate::backend::QuotaState::denied(0, &p, cost, pause)]),
            None => Decision::new([]),
        };
        self.verdict(prepared, Ok(decision), headers)
    }

    /// The answer for a request without a key, as `on_missing_key` says.
    pub(crate) fn missing_key(
        &self,
        prepared: &Prepared<Bk::Policy>,
        err: &KeyError,
        headers: &HeaderMap,
    ) -> Verdict {
        let policy = prepared.policy.name();
        if *err == KeyError::NoPeerAddr {
            // The server's setup, not the client's request, is at fault: a 500 with a generic
            // body (whatever `on_missing_key` says), and the explanation in the log.
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    "tollgate: no peer address in the request extensions, so requests cannot be \
                     keyed by IP and are answered 500; with axum, serve with \
                     `into_make_service_with_connect_info::<SocketAddr>()` (logged once)"
                );
            }
            // `Allow` is an explicit choice to let keyless requests through (a server on a
            // Unix socket has no peer address at all): kept, with the log above.
            prepared.metrics.record(Counted::NoPeerAddress, None);
            if prepared.policy.is_shadow() || self.on_missing_key == OnMissingKey::Allow {
                return Verdict::Pass(HeaderAdds::new());
            }
            let rejection = Rejection {
                kind: RejectionKind::MissingKey(err),
                policy,
                status: StatusCode::INTERNAL_SERVER_ERROR,
                retry_after: None,
                quota_names: &[],
            };
            let res =
                self.responder
                    .reject(&rejection, grpc_content_type(headers), HeaderAdds::new());
            return Verdict::Reject(Box::new(res));
        }
        prepared.metrics.record(Counted::MissingKey, None);
        match self.on_missing_key {
            OnMissingKey::Allow => {
                tracing::trace!(policy, reason = %err, "no rate-limit key; allowed");
                Verdict::Pass(HeaderAdds::new())
            }
            OnMissingKey::Reject(_) if prepared.policy.is_shadow() => {
                tracing::info!(
                    policy,
                    shadow = true,
                    reason = %err,
                    "request without a rate-limit key would have been rejected (shadow mode)"
                );
                Verdict::Pass(HeaderAdds::new())
            }
            OnMissingKey::Reject(status) => {
                tracing::debug!(policy, reason = %err, "no rate-limit key; rejected");
                let rejection = Rejection {
                    kind: RejectionKind::MissingKey(err),
                    policy,
                    status,
                    retry_after: None,
                    quota_names: &[],
                };
                let res = self.responder.reject(
                    &rejection,
                    grpc_content_type(headers),
                    HeaderAdds::new(),
                );
                Verdict::Reject(Box::new(res))
            }
        }
    }

    /// Turns a backend's answer into a verdict, logging rejections and failures.
    pub(crate) fn verdict(
        &self,
        prepared: &Prepared<Bk::Policy>,
        result: Result<Decision, BackendError>,
        headers: &HeaderMap,
    ) -> Verdict {
        let policy = prepared.policy.name();
        count(prepared, &result);
        match result {
            Ok(decision) if decision.is_allowed() => {
                // A shadow policy is not enforced: its fields would make clients back off for
                // nothing, unless asked for.
                if prepared.policy.is_shadow() && !prepared.policy.sends_shadow_headers() {
                    return Verdict::Pass(HeaderAdds::new());
                }
                let adds = response::rate_limit_headers(
                    self.responder.style,
                    &prepared.headers,
                    &decision,
                );
                match decision.wait() {
                    Duration::ZERO => Verdict::Pass(adds),
                    wait => Verdict::Wait(adds, wait),
                }
            }
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
                // A cost larger than a quota's burst can never pass: not "too many", but too
                // large, and no `Retry-After`.
                let status = if decision.never_fits() {
                    StatusCode::PAYLOAD_TOO_LARGE
                } else {
                    StatusCode::TOO_MANY_REQUESTS
                };
                let rejection = Rejection {
                    kind: RejectionKind::RateLimited(&decision),
                    policy,
                    status,
                    retry_after,
                    quota_names: &prepared.headers.labels,
                };
                Verdict::Reject(Box::new(self.responder.reject(
                    &rejection,
                    grpc_content_type(headers),
                    adds,
                )))
            }
            Err(error) if prepared.policy.is_shadow() => {
                tracing::debug!(
                    policy,
                    shadow = true,
                    %error,
                    "rate-limit backend failed; allowed (shadow mode)"
                );
                Verdict::Pass(HeaderAdds::new())
            }
            Err(error) => {
                // Backends log their failures once per change of state (the Redis backend: a
                // warning naming the cause when it starts failing, one line when it answers
                // again); a line per rejected request would flood the log during an outage.
                tracing::debug!(policy, %error, "rate-limit backend failed; answering 503");
                let rejection = Rejection {
                    kind: RejectionKind::BackendUnavailable,
                    policy,
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    retry_after: Some(std::time::Duration::from_secs(1)),
                    quota_names: &prepared.headers.labels,
                };
                Verdict::Reject(Box::new(self.responder.reject(
                    &rejection,
                    grpc_content_type(headers),
                    HeaderAdds::new(),
                )))
            }
        }
    }
}
