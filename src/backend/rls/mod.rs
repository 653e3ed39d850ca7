//! A [`Backend`](crate::backend::Backend) that asks an Envoy rate limit service (RLS v3,
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`) for every decision: the
//! limiter a platform already runs for its gateways (`tollgate-server`, envoyproxy/ratelimit,
//! limitador) decides for the services behind them too, with the same rules. Feature
//! `rls-client`.
//!
//! Everything the layer and [`Limiter`](crate::limiter::Limiter) do works on top: keys, policies,
//! costs, the `RateLimit` fields, outcomes, metrics, and what the remote stores have (it is
//! one of them, see [`remote`](crate::backend::remote)):
//!
//! - **A request** becomes a call in the backend's domain: by default one descriptor with one
//!   entry, the policy's name and the key's value (an IP key written as Envoy's
//!   `remote_address` writes it, a byte key as its text), and `hits_addend` the cost;
//!   [`RlsBackendBuilder::descriptors`] maps a request to any descriptors. Several descriptors
//!   are refused together when one is over its limit, as the server answers.
//! - **An answer** becomes the decision: `OK` admits, `OVER_LIMIT` refuses, another code is a
//!   failed call. The tightest status's `current_limit`, `limit_remaining` and
//!   `duration_until_reset` are the decision's limit, remaining units and reset (the
//!   `RateLimit` field's `r` and `t`, and `Retry-After`); where the statuses say nothing
//!   (limitador answers with none), its `X-RateLimit-Limit`, `X-RateLimit-Remaining` and
//!   `X-RateLimit-Reset` headers (limitador's `-H DRAFT_VERSION_03`) are read instead. A
//!   reset is capped at an hour. The `RateLimit-Policy` field is the local policy's: give the
//!   policy the server rule's quota (it is the fallback's limit too).
//! - **Refusals are cached until their reset** ([`deny_cache_capacity`](RlsBackendBuilder::deny_cache_capacity),
//!   65 536 keys by default, the least used evicted): a key refused until `T` is answered in
//!   the process until `T`, with the server's fields and `Retry-After` counted down, without a
//!   call. A refusal with no reset (a server that sends none) is not cached.
//! - **A deadline that holds**: every decision has the backend's timeout (20 ms by default,
//!   Envoy's), enforced in the process whatever the connection does (a server that never
//!   answers, packets dropped); then the [failure policy](crate::backend::remote::FailurePolicy):
//!   fail open, fail closed, or the local fallback at this instance's share (the share is the
//!   [`Fleet`](crate::backend::remote::Fleet) size you set: an RLS server has no place for
//!   instances to announce themselves, so the default is 1, the whole quota). After 5 failed
//!   calls in a row the circuit breaker stops calling, and a probe (a call with no
//!   descriptor: any answer is alive) closes it; the connection is then made anew, its
//!   addresses resolved again.
//! - **Several servers**: each target address is resolved (a headless service's name gives
//!   every replica), and calls are balanced over the addresses on HTTP/2 connections.
//! - **Charges after the response** (`settle`): a debit is a second call whose `hits_addend`
//!   is the units charged; a refund is sent as `is_negative_hits` only where the server gives
//!   units back ([`RlsBackendBuilder::negative_hits`]: tollgate's does; envoyproxy/ratelimit
//!   and limitador would count them as hits), else not sent.
//!
//! Not here: calls are not coalesced. An RLS call of `n` hits is all or nothing (the server
//! admits all `n` or none), so folding `n` identical requests into one call would refuse all
//! of them where the last units would have admitted some; each request is its own call
//! (concurrent calls share the HTTP/2 connections). Concurrent quotas are refused: the
//! protocol has no call that ends a request. TLS to the service is not supported yet.
//!
//! The server's `response_headers_to_add` go on to the response only where asked
//! ([`RlsBackendBuilder::pass_response_headers`]): all of them, or the names you list. They
//! are added to allowed and refused responses alike, after tollgate's fields and never over a
//! header the response already has; a refusal answered from the cache repeats the headers of
//! the answer it repeats, as the server wrote them (a header counting down, as limitador's
//! `X-RateLimit-Reset`, is not counted down: the `RateLimit` field and `Retry-After` are).
//!
//! ```
//! use tollgate::backend::rls::RlsBackend;
//! use tollgate::backend::remote::FailurePolicy;
//! use tollgate::{Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The gateways' rules in tollgate-server: `remote_address` limited to 5/s burst 10.
//! let backend = RlsBackend::builder()
//!     .url("http://127.0.0.1:8081")
//!     .domain("edge")
//!     .on_failure(FailurePolicy::FallbackLocal)
//!     .build()?;
//! // The policy's name is the descriptor's key; its quota is the fallback's and the
//! // `RateLimit-Policy` field's.
//! let policy = Policy::new("remote_address", Quota::per_second(5).burst(10));
//! let layer = tollgate::RateLimitLayer::builder()
//!     .backend(backend)
//!     .key(tollgate::key::PeerIp::new())
//!     .policy(policy)
//!     .build()?;
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```

mod store;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

use crate::backend::remote::{Options, Remote, RemotePolicy};
use crate::{ConfigError, Key};
use store::RlsStore;

/// What a request becomes on the wire: its policy's name and key to the descriptors of one
/// call (see [`RlsBackendBuilder::descriptors`]).
pub type Descriptors = Arc<dyn Fn(&str, &Key) -> Vec<RateLimitDescriptor> + Send + Sync>;

/// A [`Backend`](crate::backend::Backend) asking an Envoy rate limit service (see the
/// [module docs](self)). Cheap to clone: clones share the connections, the breaker, the deny
/// cache and the counters.
#[derive(Clone)]
pub struct RlsBackend {
    remote: Remote<RlsStore>,
}

/// A policy prepared for the [`RlsBackend`].
pub struct RlsPolicy {
    inner: RemotePolicy<RlsStore>,
}

impl std::fmt::Debug for RlsPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlsPolicy")
            .field("quotas", &self.inner.params())
            .field("deny_cache_entries", &self.inner.deny_cache_len())
            .finish()
    }
}

impl std::fmt::Debug for RlsBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = self.remote.store();
        f.debug_struct("RlsBackend")
            .field("endpoint", &store.endpoint)
            .field("domain", &store.domain)
            .field("timeout", &self.remote.timeout())
            .field("on_failure", &self.remote.on_failure())
            .field("stats", &self.stats())
            .finish()
    }
}

impl RlsBackend {
    /// Starts configuring a backend; see [`RlsBackendBuilder`] for the defaults.
    pub fn builder() -> RlsBackendBuilder {
        RlsBackendBuilder {
            urls: Vec::new(),
            domain: None,
            descriptors: None,
            negative_hits: false,
            pass: PassHeaders::None,
            opts: Options {
                timeout: Duration::from_millis(20),
                fleet: crate::backend::remote::Fleet::Size(std::num::NonZeroU32::MIN),
                memory_watch: None,
                ..Options::default()
            },
        }
    }

    /// The backend's counters now: calls, errors, timeouts, answers from the deny cache.
    pub fn stats(&self) -> crate::backend::remote::RemoteStats {
        self.remote.stats()
    }

    /// The servers asked, as given.
    pub fn endpoint(&self) -> &str {
        &self.remote.store().endpoint
    }
}

/// Configures an [`RlsBackend`]. Defaults: no server (give [`url`](Self::url)), no domain
/// (give [`domain`](Self::domain)), one descriptor `(policy name, key)` per request, a 20-ms
/// timeout, the local fallback at the whole quota (a fleet of 1: set
/// [`fleet`](Self::fleet)), a deny cache of 65 536 keys, refunds not sent.
pub struct RlsBackendBuilder {
    urls: Vec<String>,
    domain: Option<String>,
    descriptors: Option<Descriptors>,
    negative_hits: bool,
    pass: PassHeaders,
    opts: Options,
}

impl std::fmt::Debug for RlsBackendBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlsBackendBuilder")
            .field("urls", &self.urls)
            .field("domain", &self.domain)
            .field("descriptors", &self.descriptors.as_ref().map(|_| "custom"))
            .field("negative_hits", &self.negative_hits)
            .field("pass_response_headers", &self.pass)
            .field("opts", &self.opts)
            .finish()
    }
}

crate::backend::remote::options_methods!(RlsBackendBuilder, "the rate limit service");

impl RlsBackendBuilder {
    /// A server to ask: `http://host:port` (plain HTTP/2; TLS is not supported yet). Call it
    /// once per server, or name a host that resolves to several: calls are balanced over
    /// every address. Resolved when the first call is made, and again after the circuit
    /// breaker opened.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.urls.push(url.into());
        self
    }

    /// The rate limit domain every call names (the rules' `domain`).
    pub fn domain(mut self, domain: impl Into<String>) -> Self {
        self.domain = Some(domain.into());
        self
    }

    /// What a request becomes: its policy's name and key to the descriptors of its call
    /// (their `hits_addend` left out: the request's cost is the call's). At least one; a
    /// request mapped to none is a configuration error answered as a failed call. The default:
    /// one descriptor, one entry `(policy name, key value)`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tollgate::backend::rls::{RlsBackend, descriptor};
    ///
    /// // Envoy's gateway rules key tenants under a route: `route=api`, then `tenant=<key>`.
    /// let backend = RlsBackend::builder()
    ///     .url("http://ratelimit:8081")
    ///     .domain("edge")
    ///     .descriptors(Arc::new(|_policy, key| {
    ///         vec![descriptor(&[("route", "api"), ("tenant", &key.to_string())])]
    ///     }))
    ///     .build();
    /// # let _ = backend;
    /// ```
    pub fn descriptors(mut self, map: Descriptors) -> Self {
        self.descriptors = Some(map);
        self
    }

    /// Whether refunds (units given back after the response) are sent, as descriptors with
    /// `is_negative_hits` (default off). Only for a server that gives units back for them,
    /// as tollgate's does: envoyproxy/ratelimit and limitador would count them as more hits.
    pub fn negative_hits(mut self, on: bool) -> Self {
        self.negative_hits = on;
        self
    }

    /// Which of the server's `response_headers_to_add` go on to the request's response
    /// (default [`PassHeaders::None`]): see the [module docs](self).
    ///
    /// ```
    /// use tollgate::backend::rls::{PassHeaders, RlsBackend};
    ///
    /// let backend = RlsBackend::builder()
    ///     .url("http://ratelimit:8081")
    ///     .domain("edge")
    ///     .pass_response_headers(PassHeaders::only(["x-ratelimit-limit", "x-ratelimit-remaining"])?)
    ///     .build()?;
    /// # let _ = backend;
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    pub fn pass_response_headers(mut self, pass: PassHeaders) -> Self {
        self.pass = pass;
        self
    }

    /// Checks the options and builds the backend; nothing connects until the first call.
    pub fn build(self) -> Result<RlsBackend, ConfigError> {
        let domain = self.domain.ok_or_else(|| ConfigError::Invalid {
            option: "domain",
            reason: "no rate limit domain: call `domain(..)`".into(),
        })?;
        if domain.is_empty() {
            return Err(ConfigError::Invalid {
                option: "domain",
                reason: "the rate limit domain must not be empty".into(),
            });
        }
        let store = RlsStore::new(
            self.urls,
            domain,
            self.descriptors,
            self.negative_hits,
            self.pass,
            &self.opts,
        )?;
        let who = format!("the rate limit service at {}", store.endpoint);
        Ok(RlsBackend {
            remote: Remote::new(store, who, Default::default(), self.opts),
        })
    }
}

/// Which of a rate limit service's `response_headers_to_add` an [`RlsBackend`] passes on to
/// the response ([`RlsBackendBuilder::pass_response_headers`]).
///
/// A header whose name or value is not valid HTTP is left out, and so are those no service
/// may set for a response it did not write: `content-length`, `transfer-encoding`, and the
/// hop-by-hop headers (`connection`, `keep-alive`, `proxy-connection`, `te`, `trailer`,
/// `upgrade`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PassHeaders {
    /// None (the default): the server's headers are read for limitador's fields only.
    #[default]
    None,
    /// Every header the server adds, as Envoy's `ratelimit` filter passes them.
    All,
    /// The headers of these names (compared without case).
    Only(Vec<http::HeaderName>),
}

impl PassHeaders {
    /// [`PassHeaders::Only`] these names; an invalid name is a configuration error.
    pub fn only<I, S>(names: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let names = (names.into_iter())
            .map(|n| {
                let n = n.as_ref();
                http::HeaderName::try_from(n).map_err(|e| ConfigError::Invalid {
                    option: "pass_response_headers",
                    reason: format!("{n:?} is not a header name: {e}"),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PassHeaders::Only(names))
    }

    /// The decision with the answer's headers this passes (none: the decision as it is).
    pub(crate) fn apply(
        &self,
        decision: crate::backend::Decision,
        answer: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse,
    ) -> crate::backend::Decision {
        if *self == PassHeaders::None || answer.response_headers_to_add.is_empty() {
            return decision;
        }
        let passed: Vec<_> = (answer.response_headers_to_add.iter())
            .filter_map(|h| {
                let name = http::HeaderName::try_from(h.key.as_str()).ok()?;
                let value = http::HeaderValue::try_from(h.value.as_str()).ok()?;
                let wanted = match self {
                    PassHeaders::Only(names) => names.contains(&name),
                    _ => true,
                };
                (wanted && !forbidden(&name)).then_some((name, value))
            })
            .collect();
        if passed.is_empty() {
            return decision;
        }
        decision.with_response_headers(passed.into())
    }
}

/// Headers a rate limit service may not set on a response it did not write.
fn forbidden(name: &http::HeaderName) -> bool {
    use http::header;
    [
        header::CONTENT_LENGTH,
        header::TRANSFER_ENCODING,
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
    ]
    .contains(name)
        || name == "keep-alive"
        || name == "proxy-connection"
}

/// A descriptor of `key=value` entries (a helper for [`RlsBackendBuilder::descriptors`]).
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    RateLimitDescriptor {
        entries: (entries.iter())
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A key's value as a descriptor entry's: an IP key as Envoy's `remote_address` writes the
/// address (an IPv4-mapped IPv6 address as IPv4), a byte key as its text (bytes that are not
/// UTF-8 as the key's escaped form), the global key as `*`.
pub fn key_value(key: &Key) -> String {
    if let Some(ip) = key.as_ip() {
        return match ip {
            std::net::IpAddr::V6(v6) => v6
                .to_ipv4_mapped()
                .map_or_else(|| v6.to_string(), |v4| v4.to_string()),
            v4 => v4.to_string(),
        };
    }
    match key.value_bytes().map(std::str::from_utf8) {
        Some(Ok(text)) => text.to_owned(),
        _ => key.to_string(),
    }
}

impl crate::backend::Backend for RlsBackend {
    type Policy = RlsPolicy;
    type Future = crate::backend::remote::RemoteFuture;

    fn prepare(
        &self,
        policy: &crate::Policy,
        params: &[crate::quota::QuotaParams],
    ) -> Result<RlsPolicy, ConfigError> {
        if policy.holds_slots() {
            return Err(ConfigError::Invalid {
                option: "policy",
                reason: format!(
                    "policy {:?} has a concurrent quota: the rate limit service protocol has no \
                     call that ends a request, so no slot could be given back",
                    policy.name()
                ),
            });
        }
        Ok(RlsPolicy {
            inner: self.remote.prepare(policy, params)?,
        })
    }

    fn decide(&self, policy: &RlsPolicy, key: &Key, cost: std::num::NonZeroU32) -> Self::Future {
        (self.remote).decide(&policy.inner, key, cost, crate::backend::Mode::Decide)
    }

    fn decide_with(
        &self,
        policy: &RlsPolicy,
        key: &Key,
        cost: std::num::NonZeroU32,
        mode: crate::backend::Mode,
    ) -> Self::Future {
        self.remote.decide(&policy.inner, key, cost, mode)
    }

    /// Forgets the key's cached refusal (the server's counts are the server's).
    fn reset(&self, policy: &RlsPolicy, key: &Key) -> crate::backend::ResetFuture {
        policy.inner.forget(key);
        Box::pin(std::future::ready(Ok(())))
    }

    fn now_ns(&self) -> u64 {
        self.remote.now_ns()
    }

    /// The servers and the domain: backends naming the same share limits.
    fn store_id(&self) -> Option<String> {
        let store = self.remote.store();
        Some(format!("rls {} domain {:?}", store.endpoint, store.domain))
    }
}
