//! A policy as a layer holds it: validated, prepared for its backend, with its header material
//! and counters. The request's stages (admission, settlement), the live rules and the status
//! endpoint all read it; it depends only on what lies below them (the policy, the backend, the
//! header and metric material).

use crate::backend::Backend;
use crate::metrics::PolicyMetrics;
use crate::response::PolicyHeaders;
use crate::{ConfigError, Policy};

/// A policy with its backend-prepared form, header material and counters.
pub(crate) struct Prepared<P> {
    pub(crate) policy: Policy,
    pub(crate) backend: P,
    pub(crate) headers: PolicyHeaders,
    pub(crate) metrics: PolicyMetrics,
    /// Whether every quota is GCRA, so that a reservation can wait (window quotas cannot count
    /// into a window that has not begun: a reservation on them waits for nothing).
    pub(crate) reserves: bool,
    /// Whether the policy has a concurrent quota: its requests hold a slot until they end.
    pub(crate) holds_slots: bool,
    /// Per quota, its parameters and whether it counts bytes: for a [`RateLimitStatus`].
    pub(crate) quota_units: Box<[(crate::quota::QuotaParams, bool)]>,
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
            holds_slots: params.iter().any(|p| p.is_concurrent()),
            quota_units: (params.iter().zip(policy.quotas()))
                .map(|(p, q)| (*p, q.counts_bytes()))
                .collect(),
            reserves: params
                .iter()
                .all(|p| p.kind == crate::quota::QuotaKind::Gcra),
            headers,
            backend: prepared,
            policy,
        })
    }
}
