//! What the rate limit said of a request, as data: [`RateLimitStatus`] and [`QuotaStatus`],
//! built at admission for the handlers ([`crate::status`] is their public home, with the
//! module docs and the status endpoint). Plain data below the request's stages, so that
//! admission can make it without reaching up into the endpoint.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Decision;
use crate::quota::QuotaParams;

/// What the rate limit said of an allowed request, in its extensions (see the
/// [module docs](crate::status)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct RateLimitStatus {
    /// The policy's name.
    #[cfg_attr(feature = "serde", serde(serialize_with = "text"))]
    pub policy: Arc<str>,
    /// Its quotas, as the decision left them: every one for an allowed request and for a
    /// blocked key; for a refusal, the quota that refused (the local backend) or every one
    /// (the shared stores).
    pub quotas: Vec<QuotaStatus>,
}

/// One quota of a [`RateLimitStatus`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct QuotaStatus {
    /// The quota's name, as in the `RateLimit` field.
    #[cfg_attr(feature = "serde", serde(serialize_with = "text"))]
    pub name: Arc<str>,
    /// Its size (burst, window limit or slots).
    pub limit: u32,
    /// Units left after this request (the `RateLimit` field's `r`).
    pub remaining: u32,
    /// Time until more units are available (the `RateLimit` field's `t`, exact here).
    #[cfg_attr(feature = "serde", serde(serialize_with = "secs"))]
    pub reset: Duration,
    /// What it counts: `requests`, `content-bytes` or `concurrent-requests` (the IETF units).
    pub unit: &'static str,
}

#[cfg(feature = "serde")]
fn text<S: serde::Serializer>(t: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(t)
}

#[cfg(feature = "serde")]
fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl RateLimitStatus {
    /// The status of `decision` under a policy named `policy` whose quotas are `quotas`
    /// (name, parameters, whether it counts bytes).
    pub(crate) fn new(
        policy: &str,
        names: &[Box<str>],
        quotas: &[(QuotaParams, bool)],
        decision: &Decision,
    ) -> Self {
        let quotas = decision.quotas().iter().filter_map(|q| {
            let (params, bytes) = quotas.get(q.index)?;
            let unit = if params.is_concurrent() {
                "concurrent-requests"
            } else if *bytes {
                "content-bytes"
            } else {
                "requests"
            };
            Some(QuotaStatus {
                name: names
                    .get(q.index)
                    .map_or_else(|| "".into(), |n| Arc::from(&**n)),
                limit: q.limit,
                remaining: q.remaining,
                reset: q.reset_after,
                unit,
            })
        });
        RateLimitStatus {
            policy: policy.into(),
            quotas: quotas.collect(),
        }
    }
}

/// The status of the request, from its extensions; without one (a layer built without
/// `decision_in_extensions(true)`, a request no layer limited), `500` saying so.
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for RateLimitStatus {
    type Rejection = (http::StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<RateLimitStatus>().cloned().ok_or((
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "no rate-limit status in the request: build the layer with \
             `.decision_in_extensions(true)` and put it in front of this handler",
        ))
    }
}

/// The status of the request when there is one.
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for RateLimitStatus {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<RateLimitStatus>().cloned())
    }
}
