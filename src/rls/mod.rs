//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`),
//! deciding with any tollgate [`Backend`]: gateways (Envoy, Istio, Gloo, Emissary) ask it over
//! gRPC, with the same policies, algorithms and stores as the layers in the services behind
//! them. Feature `rls`.
//!
//! [`RlsService`] serves one domain's rules ([`RlsConfig`], envoyproxy/ratelimit's YAML as it
//! is, with tollgate's quotas as an extension), or several ([`RlsService::with_domains`]: one
//! file per domain, as envoyproxy/ratelimit's directory of them); a request for a domain not
//! served is `OK`, counted nowhere. Per request, as Envoy and envoyproxy/ratelimit
//! mean it:
//!
//! - each descriptor (its entries in order) is matched against the rule tree, at each level
//!   `key` and `value`, then the first `value` with a `*` that matches (in the rules' order,
//!   each `*` any characters), then `key` alone; a descriptor no rule names, or whose rule has no
//!   limit, is `OK` and counted nowhere, as is one whose rule is `unlimited`, or whose named
//!   limit another matched rule `replaces`; a rule of 0 requests per unit refuses, counting
//!   nothing;
//! - its cost is the descriptor's `hits_addend` when given, else the request's (0 meaning 1);
//!   a `hits_addend` of 0 checks: nothing is taken, and it is `OVER_LIMIT` when not one unit
//!   is left; a rule with `debit` takes its cost whatever is left (past the limit the key is
//!   in debt, refused until it is paid back) and never gives it back, which a charge sent
//!   after the response needs; a descriptor with `is_negative_hits` gives its cost back
//!   instead (a refund of units taken now, never refused, never past full);
//! - the bucket is the rule's policy (named after its path `<domain>.<key>[=<value>]…`, see
//!   [`RlsConfig::policies`]) and the descriptor's key: one entry's value as
//!   [`Key::ip`] when it is an IP address, IPv6 grouped by /64 as
//!   [`ClientIp`](crate::key::ClientIp) groups it for a layer ([`RlsService::ipv6_prefix`]
//!   changes it), else [`Key::from_bytes`]; several entries' values as a [`Key::composite`] of
//!   those keys (up to four; more are one key of their values, each length-prefixed); bytes
//!   longer than [`Key::MAX_LEN`] are counted by their SHA-256 (never a failed call, which
//!   Envoy would let through unlimited). A layer with a policy of the same name and such keys,
//!   on the same store, shares the limit;
//! - the descriptors of one request are decided together, all or nothing: their decisions are
//!   asked for at once (a shared store's batching sends them in one round trip), and when one
//!   is over its limit, or the store fails, what the others took (but a `debit`) is given
//!   back, before the answer; a call dropped
//!   before its answer (Envoy's timeout, a `grpc-timeout`) takes nothing either: what its
//!   decisions took is given back, those still in flight once they land;
//! - one status per descriptor, in order: `code`, `current_limit` (`name`: the rule's `name`,
//!   empty without one; `requests_per_unit` and `unit`: a rule's own, or for a quota whose
//!   period is not a unit its rate in the smallest unit at least as long, rounded),
//!   `limit_remaining` (`u32::MAX` for an `unlimited` rule, as envoyproxy/ratelimit answers)
//!   and `duration_until_reset` (for a rule of 0 requests, the end of its unit's window
//!   counted from the Unix epoch); `overall_code` is `OVER_LIMIT` when one is;
//! - an empty `domain` or descriptor list is refused with `INVALID_ARGUMENT`, as
//!   envoyproxy/ratelimit refuses it (Envoy's failure mode then decides);
//! - a rule in `shadow_mode` is decided and counted, and always `OK` (its store failing too);
//! - `response_headers_to_add` carries the IETF `RateLimit` and `RateLimit-Policy` fields of
//!   the counted descriptors ([`RlsService::headers`] turns them off), and `Retry-After` when
//!   over the limit, so that Envoy passes them to the client;
//! - a store that fails answers gRPC `UNAVAILABLE` (so that Envoy's `failure_mode_deny`
//!   decides), unless the backend's own failure policy (fail open, fail closed, the local
//!   fallback at the fleet's share) answered first.
//!
//! ```
//! use tollgate::backend::LocalBackend;
//! use tollgate::rls::{RlsConfig, RlsService};
//!
//! let rules = RlsConfig::from_yaml(
//!     "domain: edge\ndescriptors:\n  - key: remote_address\n    quota: \"5/s burst 10\"\n",
//! )?;
//! let service = RlsService::new(LocalBackend::new(), rules)?;
//! // tonic::transport::Server::builder().add_service(service.into_server()).serve(addr)
//! let _server = service.into_server();
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

mod config;
pub mod quota;
mod share;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
pub use envoy_types;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{
    Duration as ProtoDuration, ListValue, Struct as ProtoStruct, Value as ProtoValue, value::Kind,
};
use smallvec::SmallVec;

pub use config::RlsConfig;
use config::{Limit, Named};
pub use quota::RlqsService;

use crate::admit::{count_in, count_shadow};
use crate::backend::{Backend, Decision, Mode};
use crate::metrics::{self, PolicyMetrics, RlsCode, metrics_str::Label};
use crate::response::{PolicyHeaders, ceil_secs, write_ietf};
use crate::settle::{refund_at, see_through, send, took};
use crate::{ConfigError, Key};

/// Envoy's rate limit service on a tollgate [`Backend`] (see the [module docs](self)). Cheap
/// to clone: clones share the rules and the backend.
pub struct RlsService<B: Backend> {
    inner: Arc<Inner<B>>,
}

impl<B: Backend> Clone for RlsService<B> {
    fn clone(&self) -> Self {
        RlsService {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<B: Backend> {
    backend: B,
    domains: ArcSwap<Domains<B>>,
    headers: AtomicBool,
    /// The prefix length IPv6 values are grouped by (as `ClientIp` groups them).
    v6_prefix: AtomicU8,
    /// Whether answers carry `dynamic_metadata`.
    dynamic_metadata: AtomicBool,
    /// The rate limit quota service's streams (see [`RlsService::quota_service`]).
    quota: quota::QuotaState,
}

/// The domains served, each with its rules.
struct Domains<B: Backend> {
    by_name: HashMap<String, Arc<Compiled<B>>, foldhash::fast::RandomState>,
    /// The `domain` label of every other domain.
    other: Label,
}

impl<B: Backend> Domains<B> {
    fn new(compiled: impl IntoIterator<Item = Compiled<B>>) -> Result<Self, ConfigError> {
        let mut by_name = HashMap::default();
        for c in compiled {
            let domain = c.config.domain().to_owned();
            if by_name.insert(domain.clone(), Arc::new(c)).is_some() {
                return Err(ConfigError::Invalid {
                    option: "rls config",
                    reason: format!("domain {domain:?} given twice: one set of rules per domain"),
                });
            }
        }
        Ok(Domains {
            by_name,
            other: Label::new("other"),
        })
    }
}

/// Rules prepared for the backend.
struct Compiled<B: Backend> {
    config: RlsConfig,
    prepared: Vec<B::Policy>,
    headers: Vec<PolicyHeaders>,
    /// Per policy: `tollgate_decisions_total` and the decision's debug event.
    metrics: Vec<PolicyMetrics>,
    /// The `domain` label: the domain served.
    domain: Label,
    /// Per policy: its rate in units per second (its tightest quota's count over period),
    /// what the quota service splits between a fleet's streams.
    rates: Vec<f64>,
}

impl<B: Backend> Compiled<B> {
    fn new(backend: &B, config: RlsConfig) -> Result<Self, ConfigError> {
        let mut prepared = Vec::with_capacity(config.policies().len());
        let mut headers = Vec::with_capacity(config.policies().len());
        let mut metrics = Vec::with_capacity(config.policies().len());
        let mut rates = Vec::with_capacity(config.policies().len());
        for policy in config.policies() {
            let params = policy.validate()?;
            let rate = (params.iter())
                .map(|q| 1e9 / q.emission_ns.max(1) as f64)
                .fold(f64::INFINITY, f64::min);
            rates.push(if rate.is_finite() { rate } else { 0.0 });
            prepared.push(backend.prepare(policy, &params)?);
            let h = PolicyHeaders::new(policy, &params);
            metrics.push(PolicyMetrics::new(policy, &h.labels));
            headers.push(h);
        }
        Ok(Compiled {
            domain: Label::new(config.domain()),
            config,
            prepared,
            headers,
            metrics,
            rates,
        })
    }
}

impl<B: Backend> RlsService<B> {
    /// Serves `config`'s domain, deciding on `backend`.
    pub fn new(backend: B, config: RlsConfig) -> Result<Self, ConfigError> {
        Self::with_domains(backend, [config])
    }

    /// Serves several domains, each with its rules (envoyproxy/ratelimit's directory of
    /// files, one domain each), deciding on `backend`. A domain given twice is an error.
    pub fn with_domains(
        backend: B,
        configs: impl IntoIterator<Item = RlsConfig>,
    ) -> Result<Self, ConfigError> {
        let compiled = (configs.into_iter())
            .map(|c| Compiled::new(&backend, c))
            .collect::<Result<Vec<_>, _>>()?;
        let domains = Domains::new(compiled)?;
        Ok(RlsService {
            inner: Arc::new(Inner {
                backend,
                domains: ArcSwap::from_pointee(domains),
                headers: AtomicBool::new(true),
                v6_prefix: AtomicU8::new(crate::key::ip::DEFAULT_V6_PREFIX),
                dynamic_metadata: AtomicBool::new(false),
                quota: quota::QuotaState::default(),
            }),
        })
    }

    /// Whether responses carry the IETF `RateLimit` and `RateLimit-Policy` fields (on by
    /// default; for this service and its clones); `Retry-After` on `OVER_LIMIT` either way.
    pub fn headers(self, send: bool) -> Self {
        self.inner.headers.store(send, Ordering::Relaxed);
        self
    }

    /// Groups IPv6 addresses by this prefix length (1 to 128; 64 by default) when a
    /// descriptor's value is one, as [`ClientIp`](crate::key::ClientIp) and
    /// [`PeerIp`](crate::key::PeerIp) do (their default is the same /64): a layer keying by
    /// the client's address then counts against the same bucket as the service, and a client
    /// rotating addresses inside its /64 keeps one bucket. 128 keys each address alone (for
    /// this service and its clones).
    pub fn ipv6_prefix(self, prefix: u8) -> Result<Self, ConfigError> {
        crate::key::ip::check_prefix(prefix)?;
        self.inner.v6_prefix.store(prefix, Ordering::Relaxed);
        Ok(self)
    }

    /// Whether answers carry `dynamic_metadata` (off by default, as envoyproxy/ratelimit's
    /// `RESPONSE_DYNAMIC_METADATA`; for this service and its clones): a `Struct` with the
    /// request's `domain`, its `descriptors` (each `entries` as `"key=value"` strings, and its
    /// `hitsAddend` and `limit` when given), the request's `hitsAddend` when not 0, and
    /// `metadata`: the rules' `metadata` of the descriptors that passed (neither over the limit
    /// nor unlimited), merged in order (maps merged key by key, the first value kept). Envoy
    /// stores it as the filter's dynamic metadata (`envoy.filters.http.ratelimit`), for the
    /// filters after it and the access log.
    pub fn dynamic_metadata(self, send: bool) -> Self {
        self.inner.dynamic_metadata.store(send, Ordering::Relaxed);
        self
    }

    /// Replaces the rules of `config`'s domain (adding the domain if it is not served),
    /// atomically: requests decided from now on use `config`; the other domains are
    /// untouched. Checked and prepared first (an invalid config changes nothing); live keys
    /// keep what they used (see [`OnChange`](crate::OnChange)).
    pub fn replace(&self, config: RlsConfig) -> Result<(), ConfigError> {
        let compiled = Arc::new(Compiled::new(&self.inner.backend, config)?);
        let domain = compiled.config.domain().to_owned();
        self.inner.domains.rcu(|now| {
            let mut by_name = now.by_name.clone();
            by_name.insert(domain.clone(), compiled.clone());
            Domains {
                by_name,
                other: now.other.clone(),
            }
        });
        Ok(())
    }

    /// Replaces every domain's rules at once, atomically: the domains served from now on are
    /// those of `configs` (checked and prepared first: an invalid one changes nothing).
    pub fn replace_all(
        &self,
        configs: impl IntoIterator<Item = RlsConfig>,
    ) -> Result<(), ConfigError> {
        let compiled = (configs.into_iter())
            .map(|c| Compiled::new(&self.inner.backend, c))
            .collect::<Result<Vec<_>, _>>()?;
        self.inner.domains.store(Arc::new(Domains::new(compiled)?));
        Ok(())
    }

    /// The rules served now, one per domain, in the order of their domains' names.
    pub fn configs(&self) -> Vec<RlsConfig> {
        let domains = self.inner.domains.load();
        let mut configs: Vec<RlsConfig> = (domains.by_name.values())
            .map(|c| c.config.clone())
            .collect();
        configs.sort_by(|a, b| a.domain().cmp(b.domain()));
        configs
    }

    /// The tonic service to add to a server.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }
}

/// The key of a descriptor's entries (see the [module docs](self)). Never fails: bytes longer
/// than [`Key::MAX_LEN`] are counted by their SHA-256 instead (a client's long header value
/// must not fail the call, which Envoy would then let through unlimited).
fn descriptor_key(entries: &[Entry], v6_prefix: u8, shared: &[(usize, &str)]) -> Key {
    fn bytes(b: &[u8]) -> Key {
        match Key::from_bytes(b) {
            Ok(key) => key,
            Err(_) => {
                use sha2::{Digest, Sha256};
                let mut hashed = [0u8; 34];
                hashed[..2].copy_from_slice(b"#\0");
                hashed[2..].copy_from_slice(&Sha256::digest(b));
                Key::from_bytes(hashed).unwrap_or_else(|_| Key::global())
            }
        }
    }
    let one = |v: &str| match v.parse::<std::net::IpAddr>() {
        Ok(ip) => crate::key::ip::group(ip, v6_prefix),
        Err(_) => bytes(v.as_bytes()),
    };
    // An entry a `share_threshold` pattern matched counts as the pattern.
    fn value_at<'a>(at: usize, e: &'a Entry, shared: &[(usize, &'a str)]) -> &'a str {
        (shared.iter().find(|(i, _)| *i == at)).map_or(e.value.as_str(), |(_, p)| p)
    }
    match entries {
        [e] => one(value_at(0, e, shared)),
        es if es.len() <= Key::MAX_PARTS => {
            let keys: Vec<Key> = (es.iter().enumerate())
                .map(|(i, e)| one(value_at(i, e, shared)))
                .collect();
            // At most `MAX_PARTS` valid keys: a valid composite.
            Key::composite(&keys).unwrap_or_else(|_| Key::global())
        }
        es => {
            let mut all = Vec::new();
            for (i, e) in es.iter().enumerate() {
                let v = value_at(i, e, shared);
                all.extend_from_slice(&(v.len() as u64).to_be_bytes());
                all.extend_from_slice(v.as_bytes());
            }
            bytes(&all)
        }
    }
}

/// A counted descriptor of a request: its place, policy, key, cost, and what was decided.
struct Counted {
    at: usize,
    policy: usize,
    key: Key,
    /// `None`: checked only (a `hits_addend` of 0).
    cost: Option<NonZeroU32>,
    /// `is_negative_hits`: the cost is given back, not taken.
    negative: bool,
    /// The rule's `quota_mode`.
    quota_mode: bool,
    /// The rule's `metadata`.
    metadata: Option<Arc<ProtoStruct>>,
    shadow: bool,
    /// Taken whatever is left, and never given back (the rule's `debit`).
    debit: bool,
    /// The rule's `name`, if it has one (what `replaces` refers to).
    named: Option<Arc<str>>,
    per_unit: (u32, i32),
    decision: Option<Decision>,
    /// When its units were taken ([`Backend::now_ns`]), until they are given back or kept.
    taken_at: Option<u64>,
    /// Given back: the request was refused as a whole.
    given_back: bool,
}

impl Counted {
    /// What is asked of the store: the units taken, or only checked.
    fn ask(&self) -> (NonZeroU32, Mode) {
        match self.cost {
            // Negative hits give back units taken by earlier calls (Envoy's `is_negative_hits`):
            // a refund of units taken now, which the current window holds.
            Some(cost) if self.negative => (
                cost,
                Mode::Refund {
                    admitted_ago: Duration::ZERO,
                },
            ),
            Some(cost) => (cost, Mode::Decide),
            None => (NonZeroU32::MIN, Mode::Peek),
        }
    }

    /// Whether it gives units back (negative hits) rather than asking for them.
    fn refunds(&self) -> bool {
        self.negative && self.cost.is_some()
    }

    /// Whether what it took goes back when the request is refused as a whole, or dropped.
    fn gives_back(&self) -> bool {
        !self.debit && self.ask().1 == Mode::Decide
    }
}

fn status(code: Code) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        ..Default::default()
    }
}

/// The answer's `dynamic_metadata` (see [`RlsService::dynamic_metadata`]), with the rules'
/// `metadata` of the descriptors that passed, in order.
fn answer_metadata<'a>(
    req: &RateLimitRequest,
    passed: impl Iterator<Item = &'a ProtoStruct>,
) -> ProtoStruct {
    fn value(kind: Kind) -> ProtoValue {
        ProtoValue { kind: Some(kind) }
    }
    let mut fields = HashMap::new();
    fields.insert(
        "domain".to_owned(),
        value(Kind::StringValue(req.domain.clone())),
    );
    let descriptors = (req.descriptors.iter()).map(|d| {
        let mut f = HashMap::new();
        let entries = (d.entries.iter())
            .map(|e| value(Kind::StringValue(format!("{}={}", e.key, e.value))))
            .collect();
        f.insert(
            "entries".to_owned(),
            value(Kind::ListValue(ListValue { values: entries })),
        );
        if let Some(limit) = &d.limit {
            let text = format!(
                "requests_per_unit:{} unit:{}",
                limit.requests_per_unit,
                limit.unit().as_str_name()
            );
            f.insert("limit".to_owned(), value(Kind::StringValue(text)));
        }
        if let Some(hits) = &d.hits_addend {
            f.insert(
                "hitsAddend".to_owned(),
                value(Kind::NumberValue(hits.value as f64)),
            );
        }
        value(Kind::StructValue(ProtoStruct { fields: f }))
    });
    let descriptors = ListValue {
        values: descriptors.collect(),
    };
    fields.insert(
        "descriptors".to_owned(),
        value(Kind::ListValue(descriptors)),
    );
    if req.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_owned(),
            value(Kind::NumberValue(f64::from(req.hits_addend))),
        );
    }
    let mut merged = ProtoStruct::default();
    for m in passed {
        merge(&mut merged, m);
    }
    if !merged.fields.is_empty() {
        fields.insert("metadata".to_owned(), value(Kind::StructValue(merged)));
    }
    ProtoStruct { fields }
}

/// Merges `from` into `into`: a key already there keeps its value, but two maps are merged.
fn merge(into: &mut ProtoStruct, from: &ProtoStruct) {
    for (k, v) in &from.fields {
        match into.fields.get_mut(k) {
            None => {
                into.fields.insert(k.clone(), v.clone());
            }
            Some(ProtoValue {
                kind: Some(Kind::StructValue(mine)),
            }) => {
                if let Some(Kind::StructValue(theirs)) = &v.kind {
                    merge(mine, theirs);
                }
            }
            Some(_) => {}
        }
    }
}

/// What is left of the current window of length `unit`, windows counted from the Unix epoch
/// on the system's clock (a whole unit at a window's first instant).
fn window_left(unit: Duration) -> Duration {
    let now = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH))
        .unwrap_or_default()
        .as_nanos();
    let unit_ns = unit.as_nanos().max(1);
    let left = unit_ns - now % unit_ns;
    Duration::from_nanos(u64::try_from(left).unwrap_or(u64::MAX))
}

fn proto_duration(d: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: d.subsec_nanos() as i32,
    }
}

#[tonic::async_trait]
impl<B: Backend> RateLimitService for RlsService<B> {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let req = request.into_inner();
        let backend = &self.inner.backend;
        // Refused as envoyproxy/ratelimit refuses them (an error: Envoy's failure mode decides).
        if req.domain.is_empty() || req.descriptors.is_empty() {
            let domains = self.inner.domains.load();
            let label = (domains.by_name.get(&req.domain)).map_or(&domains.other, |c| &c.domain);
            metrics::rls_request(label, RlsCode::InvalidArgument);
            return Err(tonic::Status::invalid_argument(if req.domain.is_empty() {
                "rate limit domain must not be empty"
            } else {
                "rate limit descriptor list must not be empty"
            }));
        }
        let v6_prefix = self.inner.v6_prefix.load(Ordering::Relaxed);
        let mut statuses: Vec<DescriptorStatus> =
            req.descriptors.iter().map(|_| status(Code::Ok)).collect();
        // Another domain: every descriptor OK, counted nowhere.
        let rules = {
            let domains = self.inner.domains.load();
            match domains.by_name.get(&req.domain) {
                Some(rules) => rules.clone(),
                None => {
                    metrics::rls_request(&domains.other, RlsCode::Ok);
                    return Ok(tonic::Response::new(RateLimitResponse {
                        overall_code: Code::Ok as i32,
                        statuses,
                        ..Default::default()
                    }));
                }
            }
        };
        let mut counted: Vec<Counted> = Vec::new();
        // Descriptors whose rule refuses every request (`requests_per_unit: 0`), by place.
        let mut refused: Vec<(usize, &Named)> = Vec::new();
        {
            let request_cost = req.hits_addend.max(1);
            let mut replaced: Vec<&str> = Vec::new();
            for (at, d) in req.descriptors.iter().enumerate() {
                let entries = (d.entries.iter()).map(|e| (e.key.as_str(), e.value.as_str()));
                let mut shared: SmallVec<[(usize, &str); 2]> = SmallVec::new();
                let found = config::find(rules.config.root(), entries, |at, pattern| {
                    shared.push((at, pattern));
                });
                let Some(rule) = found else {
                    continue;
                };
                let Some(limit) = &rule.limit else { continue };
                replaced.extend(limit.replaces().iter().map(String::as_str));
                match limit {
                    // As envoyproxy/ratelimit answers: no limit, everything left.
                    Limit::Unlimited { .. } => statuses[at].limit_remaining = u32::MAX,
                    Limit::Refused(named) => refused.push((at, named)),
                    Limit::Counted {
                        policy,
                        named,
                        debit,
                    } => {
                        let hits =
                            (d.hits_addend.as_ref()).map_or(u64::from(request_cost), |h| h.value);
                        counted.push(Counted {
                            at,
                            policy: *policy,
                            key: descriptor_key(&d.entries, v6_prefix, &shared),
                            quota_mode: named.quota_mode,
                            metadata: named.metadata.clone(),
                            cost: NonZeroU32::new(u32::try_from(hits).unwrap_or(u32::MAX)),
                            negative: d.is_negative_hits,
                            shadow: named.shadow,
                            debit: *debit,
                            named: named.name.clone(),
                            per_unit: named.per_unit,
                            decision: None,
                            taken_at: None,
                            given_back: false,
                        });
                    }
                }
            }
            // A named limit another matched limit replaces is left out.
            if rules.config.has_replaces() {
                let kept = |named: &Option<Arc<str>>| {
                    named.as_deref().is_none_or(|n| !replaced.contains(&n))
                };
                counted.retain(|c| kept(&c.named));
                refused.retain(|(_, r)| kept(&r.name));
            }
        }
        // All together: every descriptor's decision is asked for at once (a shared store's
        // batching sends them in one round trip), and all or nothing: when one is over its
        // limit, or the store fails, what the others took is given back. A call dropped
        // before its answer (Envoy's timeout) gives back what it took too.
        let mut asking = Asking {
            inner: &self.inner,
            rules: &rules,
            in_flight: (counted.iter())
                .map(|c| {
                    let (cost, mode) = c.ask();
                    Some(backend.decide_with(&rules.prepared[c.policy], &c.key, cost, mode))
                })
                .collect(),
            counted,
        };
        let mut failed = None;
        std::future::poll_fn(|cx| asking.poll_landed(cx, &mut failed)).await;
        if let Some(e) = failed {
            for refund in asking.give_back() {
                let _ = refund.await;
            }
            metrics::rls_request(&rules.domain, RlsCode::Unavailable);
            return Err(tonic::Status::unavailable(format!("rate limit store: {e}")));
        }
        // A check refuses when not one unit is left; a rule's refusal, unless in shadow mode.
        // The request is over when a descriptor that is not in `quota_mode` is, or when every
        // one in `quota_mode` is (envoyproxy/ratelimit's soft limit).
        let (mut hard, mut quota, mut quota_over) = (false, 0usize, 0usize);
        let mut tally = |shadow: bool, quota_mode: bool, refused: bool| {
            let refused = refused && !shadow;
            if quota_mode {
                quota += 1;
                quota_over += usize::from(refused);
            } else {
                hard |= refused;
            }
        };
        for (_, r) in &refused {
            tally(r.shadow, r.quota_mode, true);
        }
        for c in asking.counted.iter().filter(|c| !c.refunds()) {
            let refused = c.decision.as_ref().is_some_and(|d| !d.is_allowed());
            tally(c.shadow, c.quota_mode, refused);
        }
        let over = hard || (quota > 0 && quota == quota_over);
        // A `debit` rule takes what it refused too (in tasks of their own: a call dropped
        // meanwhile still makes them).
        for debit in asking.debit_refused() {
            let _ = debit.await;
        }
        if over {
            for refund in asking.give_back() {
                let _ = refund.await;
            }
        }
        let counted = asking.done();
        let mut policy_fields = String::new();
        let mut limit_fields = String::new();
        let mut retry = Duration::ZERO;
        let headers_on = self.inner.headers.load(Ordering::Relaxed);
        for c in &counted {
            let Some(d) = &c.decision else { continue };
            let refused = !d.is_allowed() && !c.shadow;
            let s = &mut statuses[c.at];
            s.code = if refused { Code::OverLimit } else { Code::Ok } as i32;
            s.current_limit = Some(RateLimit {
                name: c.named.as_deref().unwrap_or_default().to_owned(),
                requests_per_unit: c.per_unit.0,
                unit: c.per_unit.1,
            });
            // What is left now: a check (`hits_addend` 0) or a decision given back holds the
            // units its state counts as taken.
            let back = match c.cost {
                None if d.is_allowed() => 1,
                Some(cost) if c.given_back => cost.get(),
                _ => 0,
            };
            if let Some(q) = d.tightest() {
                s.limit_remaining = q.remaining.saturating_add(back).min(q.limit);
                s.duration_until_reset = Some(proto_duration(q.reset_after));
            }
            if refused {
                retry = retry.max(d.retry_after().unwrap_or_default());
            }
            if headers_on && !c.shadow {
                let fields = (&mut policy_fields, &mut limit_fields);
                write_ietf(&rules.headers[c.policy], d, back, fields.0, fields.1);
            }
        }
        for &(at, r) in &refused {
            let s = &mut statuses[at];
            s.code = if r.shadow { Code::Ok } else { Code::OverLimit } as i32;
            // The end of the unit's window, aligned to the Unix epoch as envoyproxy/ratelimit
            // aligns it.
            let until_reset = window_left(r.unit);
            s.duration_until_reset = Some(proto_duration(until_reset));
            s.current_limit = Some(RateLimit {
                name: r.name.as_deref().unwrap_or_default().to_owned(),
                requests_per_unit: r.per_unit.0,
                unit: r.per_unit.1,
            });
            if !r.shadow {
                retry = retry.max(until_reset);
            }
        }
        let mut headers = Vec::with_capacity(3);
        let header = |key: &str, value: String| HeaderValue {
            key: key.to_owned(),
            value,
            ..Default::default()
        };
        if !policy_fields.is_empty() {
            headers.push(header("ratelimit-policy", policy_fields));
            headers.push(header("ratelimit", limit_fields));
        }
        if over {
            headers.push(header("retry-after", ceil_secs(retry).max(1).to_string()));
        }
        let code = if over {
            RlsCode::OverLimit
        } else {
            RlsCode::Ok
        };
        metrics::rls_request(&rules.domain, code);
        let dynamic_metadata = self
            .inner
            .dynamic_metadata
            .load(Ordering::Relaxed)
            .then(|| {
                // The rules' metadata of the descriptors that passed, in their order.
                let mut passed: Vec<(usize, &ProtoStruct)> = (counted.iter())
                    .filter_map(|c| Some((c.at, c.metadata.as_deref()?)))
                    .chain(
                        (refused.iter()).filter_map(|(at, r)| Some((*at, r.metadata.as_deref()?))),
                    )
                    .filter(|(at, _)| statuses[*at].code == Code::Ok as i32)
                    .collect();
                passed.sort_by_key(|(at, _)| *at);
                answer_metadata(&req, passed.into_iter().map(|(_, m)| m))
            });
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            response_headers_to_add: headers,
            dynamic_metadata,
            ..Default::default()
        }))
    }
}

/// The decisions of one request's descriptors, asked for at once. Dropped before it is done
/// (the call went away), it gives back what its decisions took, including those still in
/// flight once they land.
struct Asking<'a, B: Backend> {
    inner: &'a Arc<Inner<B>>,
    rules: &'a Arc<Compiled<B>>,
    counted: Vec<Counted>,
    /// Per counted descriptor: its decision until it lands.
    in_flight: Vec<Option<B::Future>>,
}

impl<B: Backend> Asking<'_, B> {
    /// Polls the decisions in flight; ready once every one has landed. The first store error
    /// is put in `failed`.
    fn poll_landed(
        &mut self,
        cx: &mut std::task::Context<'_>,
        failed: &mut Option<crate::BackendError>,
    ) -> std::task::Poll<()> {
        let mut landed = true;
        for (c, slot) in self.counted.iter_mut().zip(&mut self.in_flight) {
            let Some(fut) = slot else { continue };
            let std::task::Poll::Ready(result) = std::pin::Pin::new(fut).poll(cx) else {
                landed = false;
                continue;
            };
            *slot = None;
            if c.refunds() {
                // Negative hits are no decision: not counted. A refund that fails leaves the
                // units taken, and fails nothing.
                match result {
                    Ok(d) => c.decision = Some(d),
                    Err(error) => tracing::debug!(%error, "negative hits not given back"),
                }
                continue;
            }
            if c.ask().1 == Mode::Decide && took(&result) {
                c.taken_at = Some(self.inner.backend.now_ns());
            }
            let metrics = &self.rules.metrics[c.policy];
            if c.shadow {
                // A shadow rule's failure fails nothing: OK, as its refusals are.
                count_shadow(metrics, &result);
                c.decision = result.ok();
                continue;
            }
            count_in(metrics, &result);
            match result {
                Ok(d) => c.decision = Some(d),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if landed {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    }

    /// Gives back what the decisions took (the request refused as a whole); the answer's
    /// `limit_remaining` counts it back. Made at once on an in-memory store, else in tasks of
    /// their own, returned: the answer waits for them (the next call sees the units back),
    /// while a call dropped meanwhile leaves them running. A refund that fails leaves the
    /// units taken: refused requests never admit more.
    fn give_back(&mut self) -> Vec<tokio::task::JoinHandle<()>> {
        let backend = &self.inner.backend;
        let mut running = Vec::new();
        for c in self.counted.iter_mut().filter(|c| !c.debit) {
            let (Some(cost), Some(at)) = (c.cost, c.taken_at.take()) else {
                continue;
            };
            c.given_back = true;
            let prepared = &self.rules.prepared[c.policy];
            let name = self.rules.config.policies()[c.policy].name();
            running.extend(send(
                backend,
                prepared,
                name,
                &c.key,
                cost,
                refund_at(backend, at),
            ));
        }
        running
    }

    /// Takes what the `debit` rules' decisions refused (a debit: past the limit), each in a
    /// task of its own when the store is remote, returned for the answer to wait for.
    fn debit_refused(&mut self) -> Vec<tokio::task::JoinHandle<()>> {
        let backend = &self.inner.backend;
        let mut running = Vec::new();
        let refused = (self.counted.iter())
            .filter(|c| c.debit && c.decision.as_ref().is_some_and(|d| !d.is_allowed()));
        for c in refused {
            let Some(cost) = c.cost else { continue };
            let prepared = &self.rules.prepared[c.policy];
            let name = self.rules.config.policies()[c.policy].name();
            running.extend(send(backend, prepared, name, &c.key, cost, Mode::Debit));
        }
        running
    }

    /// Every decision landed and the answer is being made: nothing left to give back.
    fn done(mut self) -> Vec<Counted> {
        for c in &mut self.counted {
            c.taken_at = None;
        }
        std::mem::take(&mut self.counted)
    }
}

impl<B: Backend> Drop for Asking<'_, B> {
    fn drop(&mut self) {
        self.give_back();
        let decisions = self.in_flight.iter_mut().zip(&self.counted);
        for (fut, c) in decisions.filter(|(_, c)| c.gives_back()) {
            let (Some(fut), Some(cost)) = (fut.take(), c.cost) else {
                continue;
            };
            let (inner, rules) = (self.inner.clone(), self.rules.clone());
            let (policy, key) = (c.policy, c.key.clone());
            see_through(fut, move |result| {
                if took(&result) {
                    let (backend, name) = (&inner.backend, rules.config.policies()[policy].name());
                    let refund = refund_at(backend, backend.now_ns());
                    let _ = send(backend, &rules.prepared[policy], name, &key, cost, refund);
                }
            });
        }
    }
}
