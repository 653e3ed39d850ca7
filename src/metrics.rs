//! Metrics for an operator's dashboard, on the [`metrics`](https://docs.rs/metrics) facade
//! (feature `metrics`): install any exporter for it (Prometheus, StatsD, ...) and tollgate's
//! counters appear. With the feature off nothing of this is compiled in.
//!
//! | metric | type | labels | meaning |
//! |---|---|---|---|
//! | `tollgate_decisions_total` | counter | `policy`, `outcome`, `quota` | every request the layer saw, by what happened to it (below) |
//! | `tollgate_near_limit_total` | counter | `policy`, `quota` | allowed requests after which the tightest quota had less than a tenth of its limit left |
//! | `tollgate_local_tracked_keys` | gauge | — | buckets and window counters the local backends of the process hold (Redis fallbacks included) |
//! | `tollgate_local_evicted_keys_total` | counter | — | buckets the local backends evicted from a full table to make room for new keys |
//! | `tollgate_backend_errors_total` | counter | `backend`, `kind` | failed calls to a remote store (`kind`: `timeout`, `unavailable`, `protocol`) |
//! | `tollgate_backend_latency_seconds` | histogram | `backend` | time from a decision's start to the store's answer, for decisions the store answered |
//! | `tollgate_circuit_breaker_transitions_total` | counter | `backend`, `state` | the breaker opening (`open`) and closing (`closed`) |
//! | `tollgate_circuit_breaker_open` | gauge | `backend` | 1 while the breaker is open, else 0 |
//! | `tollgate_rls_requests_total` | counter | `domain`, `code` | calls to the rate limit service ([`rls`](crate::rls)), by answer: `ok`, `over_limit`, `unavailable`; `domain` is the one served, or `other` (its descriptors' decisions are in `tollgate_decisions_total` under their rules' policies) |
//! | `tollgate_rlqs_streams` | gauge | — | streams of the rate limit quota service ([`RlqsService`](crate::rls::RlqsService)) open now: one per Envoy (per worker thread) |
//! | `tollgate_rlqs_reports_total` | counter | `domain` | usage reports of a domain served (an Envoy sends one every 5 s) |
//! | `tollgate_rlqs_assignments_total` | counter | `action` | assignments answered for reported buckets: `token_bucket` (a share), `allow_all` (no rule, `unlimited`, shadow), `deny_all` (spent, a rule of 0, or no share now), `abandon` (its rule removed) |
//! | `tollgate_rlqs_buckets_refused_total` | counter | — | reported buckets past a stream's cap ([`RlqsService::max_buckets`](crate::rls::RlqsService::max_buckets)), given no assignment |
//! | `tollgate_deny_cache_hits_total` | counter | `policy` | denials answered from the deny cache, without a round trip |
//! | `tollgate_adaptive_requests_total` | counter | `limit`, `partition`, `outcome` | requests an [`AdaptiveLimit`](crate::adaptive::AdaptiveLimit) saw, by partition (those given, and `other`) and `outcome`: `admitted`, `rejected`, then for the admitted `succeeded`, `dropped` (overload) or `cancelled` (no sample) |
//! | `tollgate_adaptive_criticality_total` | counter | `limit`, `criticality`, `outcome` | requests an [`AdaptiveLimit`](crate::adaptive::AdaptiveLimit) saw, by [criticality](crate::criticality::Criticality) (`critical`, `default`, `sheddable`) and `outcome` (`admitted`, `rejected`) |
//! | `tollgate_adaptive_over_share_total` | counter | `limit`, `criticality` | requests refused because their flow held the most slots of a limit near full ([`AdaptiveLayer::flow_by`](crate::adaptive::AdaptiveLayer::flow_by)); no flow key is a label |
//! | `tollgate_adaptive_limit` | gauge | `limit` | the adaptive limit, set when the limit is built and when a window of samples closes (with no traffic it keeps its last value: read it with the requests' rate) |
//! | `tollgate_adaptive_limit_min` | gauge | `limit` | the least the adaptive limit may be (its range's minimum), set with `tollgate_adaptive_limit`: a limit pinned there under traffic is an alert |
//! | `tollgate_adaptive_limit_max` | gauge | `limit` | the most the adaptive limit may be (its range's maximum), set with `tollgate_adaptive_limit` (a limit whose minimum is its maximum is fixed, never "pinned") |
//! | `tollgate_adaptive_in_flight` | gauge | `limit` | requests holding a slot, when a window closes |
//! | `tollgate_adaptive_rtt_seconds` | gauge | `limit`, `kind` | the window's mean RTT (`sample`) and the algorithm's no-load RTT (`baseline`, the gradient's) |
//! | `tollgate_client_throttled_total` | counter | `upstream` | calls a client's [`Throttle`](crate::client::Throttle) refused, never sent (`upstream`: the throttle's name) |
//! | `tollgate_client_retries_total` | counter | `upstream`, `outcome` | retries a client's [`RetryBudget`](crate::client::RetryBudget) was asked for: `taken`, or `refused` (the caller got the answer it would have retried) |
//! | `tollgate_deadline_dropped_total` | counter | `stage` | requests dropped at their caller's deadline ([`DeadlineLayer`](crate::deadline::DeadlineLayer)): `before_start` (it had passed when they came), `in_flight` (it passed while they waited or ran) |
//! | `tollgate_fleet_size` | gauge | `backend` | instances sharing the store as the last count read ([`Fleet`](crate::backend::remote::Fleet); with the local fallback only) |
//! | `tollgate_store_time_source` | gauge | `backend`, `source` | 1 for the clock decisions read (`store`: the store's own, in the call; `store_synced`: the store's, read outside its scripts; `instances`: each instance's), set when the backend finds out ([`RedisClock`](crate::backend::redis::RedisClock)) |
//! | `tollgate_store_memory_used_bytes` | gauge | `backend` | the store's memory in use, as its memory watch last read it (Redis `used_memory`) |
//! | `tollgate_store_memory_max_bytes` | gauge | `backend` | the store's memory limit (Redis `maxmemory`; 0: none) |
//! | `tollgate_store_evicted_keys_total` | counter | `backend` | keys the store evicted since the watch first read it (Redis `evicted_keys`): rate limits' counts lost |
//! | `tollgate_approx_store_calls_total` | counter | `outcome` | the approximate mode's calls to Redis (pipelines: a flush, an increment, a first read), `ok` or `failed` |
//! | `tollgate_approx_store_writes_total` | counter | — | increments Redis confirmed (one `INCRBY` of a key's sub-window each) |
//! | `tollgate_approx_units_sent_total` | counter | — | units those increments added |
//! | `tollgate_approx_store_reads_total` | counter | — | reads of a key's counts (one per key and call) |
//! | `tollgate_approx_keys` | gauge | — | keys the approximate mode holds counts for, over all its backends |
//! | `tollgate_approx_allowances_total` | counter | `event` | [allowances](crate::backend::redis::approx#allowances): `granted` (a key admitted without telling Redis), `exhausted` (used up: the key announced, its units sent), `recalled` (given back: another instance announced the key) |
//! | `tollgate_approx_announcements_total` | counter | `direction` | keys announced past their allowance: `sent` by this instance, `read` from the fleet's (this instance's own included) |
//! | `tollgate_approx_over_limit_units_total` | counter | — | an estimate of over-admission: per key and window, how far over the limit the fleet's count was, as this instance read it (the fleet's counts come back with each read and increment; each instance that reads an excess counts it, so sum it over one instance, or take the largest, not the fleet's sum) |
//!
//! Per second, the approximate mode's writes and reads are the rates of their counters
//! (`rate(tollgate_approx_store_writes_total[1m])`); writes per request are the writes' rate over
//! `tollgate_decisions_total`'s.
//!
//! `outcome` is one of:
//!
//! | outcome | the request |
//! |---|---|
//! | `allowed` | passed |
//! | `denied` | was refused (`429`); `quota` names the quota that refused it |
//! | `never_fits` | costs more than a quota's limit (`413`); `quota` names it |
//! | `shadow_denied` | would have been refused (or could never pass), and passed: shadow mode; `quota` names the quota |
//! | `missing_key` | had no key: refused or let through as [`OnMissingKey`](crate::OnMissingKey) says |
//! | `no_peer_address` | could not be keyed by IP because the server records no peer address (`500`) |
//! | `fail_open` | passed unlimited: the store failed and the failure policy is fail-open |
//! | `fallback_allowed`, `fallback_denied` | decided by the local fallback while the store failed |
//! | `fail_closed` | was refused (`503`): the store failed |
//! | `shadow_error` | passed: the store failed, in shadow mode |
//! | `free` | cost 0: passed without being counted against any quota |
//!
//! **Cardinality is bounded by the configuration**, never by clients: `policy` is a policy's
//! name, `quota` a quota's label as the `RateLimit` header shows it (`""` where no quota applies),
//! `outcome`, `kind` and `state` fixed sets, `backend` the store's kind (`redis`). No label
//! carries a key, an address, a path or anything else a client sends.
//!
//! Counters are made on a policy's first request, against the recorder installed then:
//! install the exporter before serving (building layers first is fine). That first request
//! also makes, at 0, the series of every outcome an enforced policy can count (`denied`,
//! `never_fits` and `fallback_denied` for each quota, the others with `quota=""`; shadow
//! outcomes appear when they happen), and an adaptive limit's series (its gauges, and each
//! partition's outcomes) are made at 0 when it is built: a panel or alert on an outcome that
//! has not happened reads 0, not "No data". The tracked-keys gauge
//! counts changes, so it reads right only when the exporter was installed before the first
//! key was tracked.
//!
//! ```
//! # #[cfg(feature = "metrics")] {
//! use metrics_util::debugging::DebuggingRecorder;
//! use tollgate::{Policy, Quota, RateLimitLayer, key::Global};
//! use tower::{Layer, Service, ServiceExt};
//!
//! let recorder = DebuggingRecorder::new();
//! let snapshot = recorder.snapshotter();
//! metrics::with_local_recorder(&recorder, || {
//!     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//!         let layer = RateLimitLayer::builder()
//!             .key(Global)
//!             .policy(Policy::new("api", Quota::per_hour(1)))
//!             .build()
//!             .unwrap();
//!         let mut svc = layer.layer(tower::service_fn(|_req: http::Request<()>| async {
//!             Ok::<_, std::convert::Infallible>(http::Response::new(
//!                 http_body_util::Full::<bytes::Bytes>::default(),
//!             ))
//!         }));
//!         for _ in 0..3 {
//!             svc.ready().await.unwrap().call(http::Request::new(())).await.unwrap();
//!         }
//!     })
//! });
//! let counts: Vec<String> = snapshot
//!     .snapshot()
//!     .into_vec()
//!     .into_iter()
//!     .filter(|(key, ..)| key.key().name() == "tollgate_decisions_total")
//!     .map(|(key, _, _, value)| {
//!         let labels: Vec<String> = key.key().labels().map(|l| l.value().to_owned()).collect();
//!         format!("{} {:?}", labels.join(","), value)
//!     })
//!     .collect();
//! assert!(counts.contains(&"api,allowed, Counter(1)".to_owned()), "{counts:?}");
//! assert!(counts.contains(&"api,denied,api Counter(2)".to_owned()), "{counts:?}");
//! # }
//! ```

use crate::Policy;

/// What happened to a request, as `tollgate_decisions_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) enum Outcome {
    Allowed,
    Denied,
    NeverFits,
    ShadowDenied,
    MissingKey,
    NoPeerAddress,
    FailOpen,
    FallbackAllowed,
    FallbackDenied,
    FailClosed,
    ShadowError,
    // The last: `Outcome::COUNT` counts up to it.
    Free,
}

impl Outcome {
    /// How many outcomes there are: `outcome as usize` is below it.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const COUNT: usize = Outcome::Free as usize + 1;

    /// The `outcome` label (also in the debug event of each decision).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::NeverFits => "never_fits",
            Outcome::ShadowDenied => "shadow_denied",
            Outcome::MissingKey => "missing_key",
            Outcome::NoPeerAddress => "no_peer_address",
            Outcome::FailOpen => "fail_open",
            Outcome::FallbackAllowed => "fallback_allowed",
            Outcome::FallbackDenied => "fallback_denied",
            Outcome::FailClosed => "fail_closed",
            Outcome::ShadowError => "shadow_error",
            Outcome::Free => "free",
        }
    }
}

/// A policy's counters, made on first use (only its name without the feature).
pub(crate) struct PolicyMetrics {
    policy: std::sync::Arc<str>,
    #[cfg(feature = "metrics")]
    inner: imp::Handles,
}

impl PolicyMetrics {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(policy: &Policy, labels: &[Box<str>]) -> Self {
        PolicyMetrics {
            policy: policy.name().into(),
            #[cfg(feature = "metrics")]
            inner: imp::Handles::new(policy, labels),
        }
    }

    fn policy_name(&self) -> &str {
        &self.policy
    }

    /// Counts a request: `quota` is the index of the quota that refused it, if one did. Also
    /// the one debug event per decision (`tollgate::decision`), for logs.
    #[inline]
    pub(crate) fn record(&self, outcome: Outcome, quota: Option<usize>) {
        tracing::debug!(
            target: "tollgate::decision",
            policy = %self.policy_name(),
            outcome = outcome.label(),
            quota,
            "rate-limit decision"
        );
        #[cfg(feature = "metrics")]
        self.inner.record(outcome, quota);
    }

    /// Counts an allowed request after which quota `quota` ran close to its limit.
    #[inline]
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn near_limit(&self, quota: usize) {
        #[cfg(feature = "metrics")]
        self.inner.near_limit(quota);
    }
}

/// Adds `delta` to `tollgate_local_tracked_keys`.
#[inline]
#[cfg_attr(
    not(all(feature = "metrics", feature = "local")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn tracked_keys(delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tollgate_local_tracked_keys").increment(delta);
}

/// Counts `n` buckets the local backend evicted from its full table.
#[inline]
#[cfg_attr(
    not(all(feature = "metrics", feature = "local")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn local_evictions(n: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_local_evicted_keys_total").increment(n);
}

/// Sets `tollgate_fleet_size` for `backend`.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn fleet_size(backend: &'static str, size: u32) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tollgate_fleet_size", "backend" => backend).set(f64::from(size));
}

/// Sets `tollgate_store_time_source` for `backend`: 1 for `source`, 0 for the others.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn time_source(backend: &'static str, source: &'static str) {
    #[cfg(feature = "metrics")]
    for other in ["store", "store_synced", "instances"] {
        let on = if other == source { 1.0 } else { 0.0 };
        metrics::gauge!("tollgate_store_time_source", "backend" => backend, "source" => other)
            .set(on);
    }
}

/// A shared store's memory as its watch read it: in use and the limit (bytes, gauges), and
/// keys evicted since the last read (a counter).
#[cfg_attr(
    not(all(
        feature = "metrics",
        any(
            feature = "redis",
            feature = "postgres",
            feature = "mysql",
            feature = "rls-client"
        )
    )),
    allow(unused_variables, dead_code)
)]
pub(crate) fn store_memory(backend: &'static str, used: u64, max: u64, evicted: u64) {
    #[cfg(feature = "metrics")]
    {
        metrics::gauge!("tollgate_store_memory_used_bytes", "backend" => backend).set(used as f64);
        metrics::gauge!("tollgate_store_memory_max_bytes", "backend" => backend).set(max as f64);
        metrics::counter!("tollgate_store_evicted_keys_total", "backend" => backend)
            .increment(evicted);
    }
}

/// Counts a call of the approximate mode to Redis.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn approx_call(ok: bool) {
    #[cfg(feature = "metrics")]
    {
        let outcome = if ok { "ok" } else { "failed" };
        metrics::counter!("tollgate_approx_store_calls_total", "outcome" => outcome).increment(1);
    }
}

/// Counts what a call of the approximate mode confirmed: `writes` increments adding `units`,
/// and `reads` keys read.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn approx_synced(writes: u64, units: u64, reads: u64) {
    #[cfg(feature = "metrics")]
    {
        if writes > 0 {
            metrics::counter!("tollgate_approx_store_writes_total").increment(writes);
            metrics::counter!("tollgate_approx_units_sent_total").increment(units);
        }
        if reads > 0 {
            metrics::counter!("tollgate_approx_store_reads_total").increment(reads);
        }
    }
}

/// Counts an allowance of the approximate mode `granted`, `exhausted` or `recalled`.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn approx_allowance(event: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_approx_allowances_total", "event" => event).increment(1);
}

/// Counts keys the approximate mode announced (`sent`) or read announced (`read`).
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn approx_announcements(direction: &'static str, n: u64) {
    #[cfg(feature = "metrics")]
    if n > 0 {
        metrics::counter!("tollgate_approx_announcements_total", "direction" => direction)
            .increment(n);
    }
}

/// Adds `units` to `tollgate_approx_over_limit_units_total`.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn approx_over_limit(units: u64) {
    #[cfg(feature = "metrics")]
    if units > 0 {
        metrics::counter!("tollgate_approx_over_limit_units_total").increment(units);
    }
}

/// Adds `delta` to `tollgate_approx_keys`.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn approx_keys(delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tollgate_approx_keys").increment(delta);
}

/// Counts a failed call to a remote store.
#[inline]
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn backend_error(backend: &'static str, kind: crate::BackendErrorKind) {
    #[cfg(feature = "metrics")]
    {
        let kind = match kind {
            crate::BackendErrorKind::Timeout => "timeout",
            crate::BackendErrorKind::Protocol => "protocol",
            _ => "unavailable",
        };
        metrics::counter!("tollgate_backend_errors_total", "backend" => backend, "kind" => kind)
            .increment(1);
    }
}

/// Records the time a remote store took to answer a decision.
#[inline]
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn backend_latency(backend: &'static str, seconds: f64) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("tollgate_backend_latency_seconds", "backend" => backend).record(seconds);
}

/// Counts a call to the rate limit service (`tollgate_rls_requests_total`): `domain` is the
/// domain it serves, or `other` (a bounded label whatever clients send), `code` the answer's
/// (`ok`, `over_limit`, `unavailable`).
#[cfg_attr(
    not(all(feature = "metrics", feature = "rls")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn rls_request(domain: &metrics_str::Label, code: RlsCode) {
    // The domain's handle for the code, made on first use: registering per call (a recorder's
    // lookup by name and labels) cost more than the rest of the metrics.
    #[cfg(feature = "metrics")]
    domain.1[code as usize]
        .get_or_init(|| {
            metrics::counter!(
                "tollgate_rls_requests_total",
                "domain" => domain.0.clone(),
                "code" => code.as_str()
            )
        })
        .increment(1);
}

/// Sets `tollgate_rlqs_streams`: the rate limit quota service's streams open now.
#[cfg_attr(
    not(all(feature = "metrics", feature = "rls")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn rlqs_streams(open: u64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tollgate_rlqs_streams").set(open as f64);
}

/// Counts a usage report of a domain served (`tollgate_rlqs_reports_total`); reports come
/// every few seconds per stream, so the handle is looked up each time.
#[cfg_attr(
    not(all(feature = "metrics", feature = "rls")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn rlqs_report(domain: &metrics_str::Label) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_rlqs_reports_total", "domain" => domain.0.clone()).increment(1);
}

/// Counts an assignment answered for a reported bucket (`tollgate_rlqs_assignments_total`),
/// by `action`: `token_bucket`, `allow_all`, `deny_all`, `abandon`.
#[cfg_attr(
    not(all(feature = "metrics", feature = "rls")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn rlqs_assignment(action: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_rlqs_assignments_total", "action" => action).increment(1);
}

/// Counts reported buckets past a stream's cap, given no assignment
/// (`tollgate_rlqs_buckets_refused_total`).
#[cfg_attr(
    not(all(feature = "metrics", feature = "rls")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn rlqs_buckets_refused(n: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_rlqs_buckets_refused_total").increment(n);
}

/// Counts a request dropped at its deadline (`tollgate_deadline_dropped_total`), by `stage`:
/// `before_start` (its deadline had passed when it came), `in_flight` (it passed while the
/// request waited or ran).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn deadline_dropped(stage: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_deadline_dropped_total", "stage" => stage).increment(1);
}

/// Counts a call a client's throttle refused (`tollgate_client_throttled_total`).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn client_throttled(upstream: &std::sync::Arc<str>) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tollgate_client_throttled_total",
        "upstream" => metrics::SharedString::from(upstream.clone())
    )
    .increment(1);
}

/// Counts a retry a client's budget was asked for (`tollgate_client_retries_total`), by
/// `outcome`: `taken`, or `refused` by the budget.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn client_retry(upstream: &std::sync::Arc<str>, taken: bool) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tollgate_client_retries_total",
        "upstream" => metrics::SharedString::from(upstream.clone()),
        "outcome" => if taken { "taken" } else { "refused" }
    )
    .increment(1);
}

/// The `code` label of `tollgate_rls_requests_total`: how a call was answered.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "rls"), allow(dead_code))]
pub(crate) enum RlsCode {
    Ok,
    OverLimit,
    Unavailable,
    InvalidArgument,
}

impl RlsCode {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            RlsCode::Ok => "ok",
            RlsCode::OverLimit => "over_limit",
            RlsCode::Unavailable => "unavailable",
            RlsCode::InvalidArgument => "invalid_argument",
        }
    }
}

/// A label value made once (the service's domain).
pub(crate) mod metrics_str {
    #![cfg_attr(not(feature = "rls"), allow(dead_code))]

    /// A label value, shared, with the domain's counter for each
    /// [`RlsCode`](super::RlsCode).
    #[derive(Clone, Debug)]
    pub(crate) struct Label(
        #[cfg(feature = "metrics")] pub(crate) metrics::SharedString,
        #[cfg(not(feature = "metrics"))] pub(crate) (),
        #[cfg(feature = "metrics")] pub(crate) [std::sync::OnceLock<metrics::Counter>; 4],
    );

    impl Label {
        #[cfg_attr(not(feature = "metrics"), allow(unused_variables, dead_code))]
        pub(crate) fn new(value: &str) -> Self {
            #[cfg(feature = "metrics")]
            return Label(
                metrics::SharedString::from(value.to_owned()),
                Default::default(),
            );
            #[cfg(not(feature = "metrics"))]
            Label(())
        }
    }
}

/// Records a circuit breaker opening (`open`) or closing.
#[cfg_attr(
    not(all(feature = "metrics", feature = "redis")),
    allow(unused_variables, dead_code)
)]
pub(crate) fn breaker(backend: &'static str, open: bool) {
    #[cfg(feature = "metrics")]
    {
        let state = if open { "open" } else { "closed" };
        metrics::counter!(
            "tollgate_circuit_breaker_transitions_total",
            "backend" => backend,
            "state" => state
        )
        .increment(1);
        metrics::gauge!("tollgate_circuit_breaker_open", "backend" => backend).set(if open {
            1.0
        } else {
            0.0
        });
    }
}

/// A policy's deny-cache hits (`tollgate_deny_cache_hits_total`), made on first use.
/// Zero-sized without the feature.
#[cfg_attr(not(all(feature = "metrics", feature = "redis")), allow(dead_code))]
pub(crate) struct DenyCacheHits {
    #[cfg(feature = "metrics")]
    policy: std::sync::Arc<str>,
    #[cfg(feature = "metrics")]
    counter: std::sync::OnceLock<metrics::Counter>,
}

#[cfg_attr(not(all(feature = "metrics", feature = "redis")), allow(dead_code))]
impl DenyCacheHits {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(policy: &str) -> Self {
        DenyCacheHits {
            #[cfg(feature = "metrics")]
            policy: policy.into(),
            #[cfg(feature = "metrics")]
            counter: std::sync::OnceLock::new(),
        }
    }

    /// Counts a denial answered from the cache.
    #[inline]
    pub(crate) fn hit(&self) {
        #[cfg(feature = "metrics")]
        self.counter
            .get_or_init(|| {
                let policy = metrics::SharedString::from(self.policy.clone());
                metrics::counter!("tollgate_deny_cache_hits_total", "policy" => policy)
            })
            .increment(1);
    }
}

#[cfg(feature = "metrics")]
mod imp {
    use std::sync::{Arc, OnceLock};

    use metrics::{Counter, SharedString};

    use super::Outcome;
    use crate::Policy;

    /// The counters of one policy: one per outcome and quota (the last slot: no quota), made
    /// on first use so that an exporter installed after the layer was built still gets them.
    pub(super) struct Handles {
        policy: SharedString,
        quotas: Vec<SharedString>,
        decisions: Box<[OnceLock<Counter>]>,
        near: Box<[OnceLock<Counter>]>,
    }

    impl Handles {
        pub(super) fn new(policy: &Policy, labels: &[Box<str>]) -> Self {
            let slots = labels.len() + 1;
            Handles {
                policy: SharedString::from(Arc::<str>::from(policy.name())),
                quotas: labels
                    .iter()
                    .map(|l| SharedString::from(Arc::<str>::from(&**l)))
                    .collect(),
                decisions: (0..Outcome::COUNT * slots)
                    .map(|_| OnceLock::new())
                    .collect(),
                near: (0..labels.len()).map(|_| OnceLock::new()).collect(),
            }
        }

        fn quota_label(&self, quota: Option<usize>) -> SharedString {
            quota
                .and_then(|q| self.quotas.get(q).cloned())
                .unwrap_or_else(|| SharedString::const_str(""))
        }

        #[inline]
        pub(super) fn record(&self, outcome: Outcome, quota: Option<usize>) {
            let slots = self.quotas.len() + 1;
            let slot = quota
                .filter(|&q| q < self.quotas.len())
                .unwrap_or(slots - 1);
            let index = outcome as usize * slots + slot;
            let Some(cell) = self.decisions.get(index) else {
                return;
            };
            match cell.get() {
                Some(counter) => counter.increment(1),
                None => self.first(cell, outcome, slot),
            }
        }

        /// The first count of a series: its counter made, then every known series at 0.
        #[cold]
        fn first(&self, cell: &OnceLock<Counter>, outcome: Outcome, slot: usize) {
            cell.get_or_init(|| self.counter(outcome, slot))
                .increment(1);
            self.prime();
        }

        /// The counter of `outcome` with the quota in `slot` (the last: none).
        fn counter(&self, outcome: Outcome, slot: usize) -> Counter {
            metrics::counter!(
                "tollgate_decisions_total",
                "policy" => self.policy.clone(),
                "outcome" => outcome.label(),
                "quota" => self.quota_label(Some(slot))
            )
        }

        /// Makes, at 0, the series of every outcome an enforced policy can count (those of a
        /// quota for each quota), so that a dashboard's panel of an outcome that has not
        /// happened yet shows 0, not "No data" (Prometheus's advice). Called by the first
        /// count of each series: after the first request, against the recorder installed
        /// then. Shadow outcomes appear when they happen.
        fn prime(&self) {
            use Outcome::*;
            let none = self.quotas.len();
            let unquoted = [
                Allowed,
                MissingKey,
                NoPeerAddress,
                FailOpen,
                FallbackAllowed,
                FailClosed,
                Free,
            ];
            let quoted = [Denied, NeverFits, FallbackDenied];
            let series = (unquoted.into_iter().map(|o| (o, none))).chain(
                quoted
                    .into_iter()
                    .flat_map(|o| (0..none).map(move |q| (o, q))),
            );
            for (outcome, slot) in series {
                if let Some(cell) = self.decisions.get(outcome as usize * (none + 1) + slot) {
                    cell.get_or_init(|| {
                        let counter = self.counter(outcome, slot);
                        counter.increment(0);
                        counter
                    });
                }
            }
        }

        pub(super) fn near_limit(&self, quota: usize) {
            let Some(cell) = self.near.get(quota) else {
                return;
            };
            cell.get_or_init(|| {
                metrics::counter!(
                    "tollgate_near_limit_total",
                    "policy" => self.policy.clone(),
                    "quota" => self.quota_label(Some(quota))
                )
            })
            .increment(1);
        }
    }
}
