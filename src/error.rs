//! Errors: configuration mistakes found by `build()`, and backend failures.

use std::fmt;

use crate::Quota;

/// A configuration mistake, reported by
/// [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build) and backend builders.
///
/// Every variant says which policy or option is wrong and why; nothing in tollgate panics on
/// configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A quota has a zero count, burst or period, does not fit in integer time, or combines
    /// settings that mean nothing together (a burst on a window, a resolution on anything but
    /// a sliding window).
    InvalidQuota {
        /// The policy holding the quota.
        policy: String,
        /// The offending quota (boxed: a quota is larger than the rest of the error).
        quota: Box<Quota>,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A policy name is empty or has characters that cannot appear in a header string.
    InvalidPolicyName {
        /// The offending name.
        name: String,
    },
    /// A policy has no quota, or more than [`Policy::MAX_QUOTAS`](crate::Policy::MAX_QUOTAS).
    QuotaCount {
        /// The policy.
        policy: String,
        /// How many quotas it has.
        count: usize,
    },
    /// The builder was not given a policy.
    MissingPolicy,
    /// Any other invalid option.
    Invalid {
        /// The option.
        option: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::InvalidQuota {
                policy,
                quota,
                reason,
            } => write!(f, "policy `{policy}`: invalid quota \"{quota}\": {reason}"),
            ConfigError::InvalidPolicyName { name } => write!(
                f,
                "invalid policy name {name:?}: use 1 to 64 visible ASCII characters, without `\"` or `\\`"
            ),
            ConfigError::QuotaCount { policy, count } => write!(
                f,
                "policy `{policy}` has {count} quotas; a policy needs 1 to {} quotas",
                crate::Policy::MAX_QUOTAS
            ),
            ConfigError::MissingPolicy => f.write_str(
                "no policy configured: call `.policy(Policy::new(..))` before `build()`",
            ),
            ConfigError::Invalid { option, reason } => write!(f, "invalid `{option}`: {reason}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A backend could not reach a decision (for example Redis timed out).
///
/// The layer never turns this into a `Service::Error`: it answers `503 Service Unavailable` and
/// logs it at `debug` only. A backend logs its own failures, once per change of state (the
/// Redis backend warns with the cause when Redis starts failing and says when it answers
/// again), so that an outage does not write a line per request. Backends with their own failure policy (the Redis backend's fail-open or
/// local fallback) handle failures themselves and only return this error when told to fail
/// closed.
#[derive(Debug)]
pub struct BackendError {
    kind: BackendErrorKind,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// What kind of failure a [`BackendError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendErrorKind {
    /// The store did not answer within the timeout.
    Timeout,
    /// The store is unreachable (connection refused, circuit breaker open, ...).
    Unavailable,
    /// The store answered something unexpected.
    Protocol,
}

impl BackendError {
    /// A new error of `kind` caused by `source`.
    pub fn new(
        kind: BackendErrorKind,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        BackendError {
            kind,
            source: Some(source.into()),
        }
    }

    /// A new error of `kind` with no underlying cause.
    pub fn from_kind(kind: BackendErrorKind) -> Self {
        BackendError { kind, source: None }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> BackendErrorKind {
        self.kind
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            BackendErrorKind::Timeout => "rate-limit backend timed out",
            BackendErrorKind::Unavailable => "rate-limit backend unavailable",
            BackendErrorKind::Protocol => "rate-limit backend protocol error",
        };
        match &self.source {
            Some(s) => write!(f, "{what}: {s}"),
            None => f.write_str(what),
        }
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The error type of the client layers and [`PropagateDeadline`](crate::deadline::PropagateDeadline):
/// the inner service's error, boxed, or one of theirs
/// ([`Throttled`](crate::client::Throttled), [`DeadlineExceeded`](crate::deadline::DeadlineExceeded)),
/// found with `err.is::<T>()`.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
