//! Envoy's rate limit quota service (RLQS,
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`) on the
//! rules and the backend of an [`RlsService`]: a fleet of Envoys enforces a shared limit with
//! no call per request.
//!
//! Each Envoy's `rate_limit_quota` filter puts requests into buckets (a bucket id: a map of
//! entries its configuration builds from the request), enforces the assignment the server
//! gave each bucket, and streams usage reports: per bucket, the requests it allowed and
//! denied over the last few seconds (every 5 s in Envoy 1.40). [`RlqsService`] answers every
//! report with an assignment for every bucket of the stream:
//!
//! - the report's `domain` names the rules (as an RLS call's does); a bucket id's entries are
//!   matched as a descriptor's, in whatever order reaches a rule (a bucket id is a map), so
//!   that a bucket and the RLS descriptor with the same entries count in one bucket of the
//!   store. A bucket that matches no rule (or has more than 16 entries, or is of a domain not
//!   served), or whose rule is `unlimited` or in `shadow_mode`, is `ALLOW_ALL`; a rule of 0
//!   requests is `DENY_ALL`;
//! - the allowed requests reported are charged to the rule's bucket in the store (a debit:
//!   past the limit the bucket is in debt), so that RLS calls, the layers and the fleets of
//!   one rule count together, and rules of an hour, a day or a month hold across the fleet:
//!   when what is left comes back later than the next report (5 s), the bucket is `DENY_ALL`
//!   until it does;
//! - otherwise the stream gets a token bucket (`fill_interval` 1 s, the only one Envoy 1.40
//!   enforces) holding its share of the rule: the rule's rate (its count over its period, in
//!   whole tokens per second) split between the streams that report the bucket by their
//!   demand (allowed + denied per second since their last report, as the server timed it),
//!   max-min fair, the shares adding up to the rate (see `share`), and what the store has left
//!   now (the burst, `max_tokens`) in the same proportion as the rate's shares; a stream
//!   whose demand is not known yet (its first report) counts as asking for an equal share. A
//!   rate below one token per second cannot be split (a token bucket adds at least one per
//!   second): every stream then gets at least one, and the store's count stops the fleet;
//! - assignments live 20 s (`assignment_time_to_live`) and every bucket the stream holds is
//!   answered in every answer, so none expires while the stream reports;
//! - a bucket whose rule was removed is answered `abandon_action` once (never a bucket's first
//!   report, which would make a report per request), and forgotten;
//! - a stream that closes leaves its buckets' splits (the others get its share at their next
//!   report), as does a stream that has not reported a bucket for 30 s;
//! - a stream holds at most [`RlqsService::max_buckets`] buckets (4096 by default): reports of
//!   more get no assignment (the filter's `no_assignment_behavior` decides for them), logged
//!   once per stream and counted in `tollgate_rlqs_buckets_refused_total`.
//!
//! How far over a limit a fleet can go: shares are recomputed when a stream reports, and
//! streams report 5 s apart, not together; a split that changes (a stream joins, demand
//! moves, a rule changes) reaches each stream at its next report. Until then the streams hold
//! shares computed at different moments, which together can exceed the limit by at most what
//! the streams whose share shrank were given for that gap: at most one report gap (5 s) of
//! their old shares. Charges reach the store at each report, so a long window's count is
//! behind by at most a gap of the fleet's use.
//!
//! ```
//! use tollgate::backend::LocalBackend;
//! use tollgate::rls::{RlsConfig, RlsService};
//!
//! let rules = RlsConfig::from_yaml(
//!     "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: second, requests_per_unit: 100 }\n",
//! )?;
//! let rls = RlsService::new(LocalBackend::new(), rules)?;
//! // One gRPC server, both services, the same rules and counts:
//! // tonic::transport::Server::builder()
//! //     .add_service(rls.quota_service().into_server())
//! //     .add_service(rls.into_server())
//! let _quota = rls.quota_service().into_server();
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::{
    BucketAction, bucket_action,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::r#type::v3::{
    RateLimitStrategy, TokenBucket, rate_limit_strategy::BlanketRule, rate_limit_strategy::Strategy,
};
use envoy_types::pb::google::protobuf::UInt32Value;
use smallvec::SmallVec;

use super::config::{self, Limit};
use super::share::{Demand, Streams};
use super::{Compiled, Inner, RlsService, descriptor_key, proto_duration};
use crate::backend::{Backend, Decision, Mode};
use crate::metrics;

/// How long an assignment lives in Envoy: long enough to outlive a missed report or two
/// (Envoy 1.40 reports every 5 s; an assignment of 5 s or less expires before the next
/// answer), short enough that a server gone leaves the fleet on its fallback soon.
pub(crate) const TTL: Duration = Duration::from_secs(20);

/// The time to the next report of a stream (Envoy 1.40's interval): a bucket spent for longer
/// is `DENY_ALL`; one whose units come back sooner is given a token bucket.
const HORIZON: Duration = Duration::from_secs(5);

/// The most buckets one stream holds by default.
const MAX_BUCKETS: usize = 4096;

/// A bucket of the fleet: its domain and its entries, sorted.
pub(crate) type BucketKey = Arc<(String, Vec<(String, String)>)>;

/// What every stream of a service shares: the split of each bucket.
pub(crate) struct QuotaState {
    streams: Streams<BucketKey>,
    next_stream: AtomicU64,
    max_buckets: AtomicUsize,
    open: AtomicU64,
    /// Set by [`RlqsService::close`]: every stream ends.
    closing: tokio::sync::watch::Sender<bool>,
    /// This server among the fleet's (random).
    server: u64,
    /// Where the servers of a fleet share their streams' demand ([`RlqsService::share_demand`]).
    board: std::sync::OnceLock<DemandBoard>,
}

impl Default for QuotaState {
    fn default() -> Self {
        QuotaState {
            streams: Streams::default(),
            next_stream: AtomicU64::new(1),
            max_buckets: AtomicUsize::new(MAX_BUCKETS),
            open: AtomicU64::new(0),
            closing: tokio::sync::watch::Sender::new(false),
            server: {
                use std::hash::{BuildHasher, Hasher};
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u32(std::process::id());
                h.write_u128(
                    (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH))
                        .unwrap_or_default()
                        .as_nanos(),
                );
                h.finish()
            },
            board: std::sync::OnceLock::new(),
        }
    }
}

/// Envoy's rate limit quota service on the rules and the backend of an [`RlsService`] (see
/// the [module docs](self)): made by [`RlsService::quota_service`], it serves the domains the
/// RLS service serves, follows their reloads, and counts in the same buckets. Cheap to clone.
pub struct RlqsService<B: Backend> {
    inner: Arc<Inner<B>>,
}

impl<B: Backend> Clone for RlqsService<B> {
    fn clone(&self) -> Self {
        RlqsService {
            inner: self.inner.clone(),
        }
    }
}

impl<B: Backend> RlsService<B> {
    /// Envoy's rate limit quota service on these rules and this backend: the same domains,
    /// reloads ([`replace`](Self::replace)) and counts. Every call returns a handle to the
    /// same service (one split of each bucket between its streams).
    pub fn quota_service(&self) -> RlqsService<B> {
        RlqsService {
            inner: self.inner.clone(),
        }
    }
}

impl<B: Backend> RlqsService<B> {
    /// The most buckets one stream holds by default.
    pub const MAX_BUCKETS: usize = MAX_BUCKETS;

    /// The most buckets one stream holds (4096 by default, at least 1; for this service and
    /// its clones): reports of more get no assignment, so that the filter's
    /// `no_assignment_behavior` decides for them. Every answer carries every bucket of the
    /// stream: a cap of `n` bounds an answer to about `n` × 100 bytes.
    pub fn max_buckets(self, n: usize) -> Self {
        (self.inner.quota.max_buckets).store(n.max(1), Ordering::Relaxed);
        self
    }

    /// Shares this server's streams' demand with the other servers of a fleet through
    /// `board`, and splits each bucket between every server's streams, so that the
    /// assignments of all the servers add up to the limit (several servers behind one load
    /// balancer, on one store). Without it a server splits between its own streams only: `n`
    /// servers would hand out up to `n` times a rule's rate (a long window's count in a
    /// shared store still holds). Set once; later calls change nothing.
    pub fn share_demand(self, board: DemandBoard) -> Self {
        let _ = self.inner.quota.board.set(board);
        self
    }

    /// Streams open now.
    pub fn streams(&self) -> u64 {
        self.inner.quota.open.load(Ordering::Relaxed)
    }

    /// Ends every stream, now and from now on, with `UNAVAILABLE` (a server about to stop:
    /// the Envoys open their streams again, to another server, at their next report). A
    /// stream is long-lived: a graceful shutdown that waits for calls in flight would wait for
    /// the streams until Envoy hangs up.
    pub fn close(&self) {
        self.inner.quota.closing.send_replace(true);
    }

    /// The tonic service to add to a server.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
    }
}

/// Where the servers of a fleet tell each other, per bucket, the demand of their streams
/// ([`RlqsService::share_demand`]): each server writes its own and reads the others' at each
/// report. Cheap to clone.
///
/// When the board cannot be read, the others' last demand read holds for 30 s (the time
/// a stream's demand counts without a report); after that a server splits between its own
/// streams. A server that stops is forgotten 30 s after its last write: until then its
/// streams' demand (its Envoys now reporting to another server) is counted twice, which
/// lowers the shares, never raises them.
#[derive(Clone)]
pub struct DemandBoard {
    inner: Arc<dyn Board>,
}

impl std::fmt::Debug for DemandBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DemandBoard").finish_non_exhaustive()
    }
}

/// What a board does: writes this server's demands per bucket, and reads every other
/// server's (fresh ones only), in the buckets' order.
trait Board: Send + Sync + 'static {
    fn exchange(
        &self,
        server: u64,
        mine: Vec<(BucketKey, Vec<Demand>)>,
    ) -> Pin<Box<dyn Future<Output = Vec<Vec<Demand>>> + Send + '_>>;
}

#[cfg(feature = "redis")]
mod redis_board {
    use super::*;
    use crate::backend::redis::RedisBackend;

    /// How long a board key lives without a write.
    const KEY_TTL_MS: u64 = 60_000;

    /// The longest a board's exchange waits for Redis.
    const WAIT: Duration = Duration::from_secs(1);

    /// A demand board in Redis: a hash per bucket (`<prefix>rlqs:<sha256 of the bucket>`),
    /// a field per server holding when it wrote and its streams' demands.
    pub(super) struct RedisBoard {
        pub(super) backend: RedisBackend,
        /// Per bucket: the others' demand as last read, and when.
        pub(super) last: std::sync::Mutex<HashMap<BucketKey, (Instant, Vec<Demand>)>>,
    }

    fn key(prefix: &str, bucket: &BucketKey) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(bucket.0.as_bytes());
        for (k, v) in &bucket.1 {
            for part in [k, v] {
                h.update((part.len() as u64).to_be_bytes());
                h.update(part.as_bytes());
            }
        }
        let digest = h.finalize();
        let mut hex = String::with_capacity(64);
        for b in digest {
            use std::fmt::Write;
            let _ = write!(hex, "{b:02x}");
        }
        format!("{prefix}rlqs:{hex}")
    }

    fn now_ms() -> u64 {
        (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH))
            .unwrap_or_default()
            .as_millis() as u64
    }

    /// `<ms> <demand>...`, a demand as requests per second or `u` (unknown).
    fn encode(at_ms: u64, demands: &[Demand]) -> String {
        let mut out = at_ms.to_string();
        for d in demands {
            match d {
                Demand::Known(rate) => out.push_str(&format!(" {rate:.3}")),
                Demand::Unknown => out.push_str(" u"),
            }
        }
        out
    }

    /// The demands of a field written within the staleness limit of `now_ms`; nothing for a
    /// field that is old or unreadable.
    pub(super) fn decode(text: &str, now_ms: u64) -> Vec<Demand> {
        let mut parts = text.split(' ');
        let Some(at) = parts.next().and_then(|t| t.parse::<u64>().ok()) else {
            return Vec::new();
        };
        if now_ms.saturating_sub(at) >= super::super::share::STALE.as_millis() as u64 {
            return Vec::new();
        }
        parts
            .filter_map(|p| match p {
                "u" => Some(Demand::Unknown),
                n => n.parse::<f64>().ok().map(Demand::Known),
            })
            .collect()
    }

    impl Board for RedisBoard {
        fn exchange(
            &self,
            server: u64,
            mine: Vec<(BucketKey, Vec<Demand>)>,
        ) -> Pin<Box<dyn Future<Output = Vec<Vec<Demand>>> + Send + '_>> {
            Box::pin(async move {
                let store = self.backend.remote.store();
                let field = format!("{server:016x}");
                let at = now_ms();
                // One pipeline per bucket (one key: one slot of a cluster), all at once.
                let calls = mine.iter().map(|(bucket, demands)| {
                    let mut pipe = redis::pipe();
                    let key = key(&store.prefix, bucket);
                    pipe.hset(&key, &field, encode(at, demands))
                        .ignore()
                        .pexpire(&key, KEY_TTL_MS as i64)
                        .ignore()
                        .hgetall(&key);
                    async move {
                        let pipe = pipe;
                        tokio::time::timeout(WAIT, store.conn.pipeline(&pipe)).await
                    }
                });
                let replies = futures_util::future::join_all(calls).await;
                let now = Instant::now();
                let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
                let mut out = Vec::with_capacity(mine.len());
                for ((bucket, _), reply) in mine.iter().zip(replies) {
                    let read = match reply {
                        Ok(Ok(values)) => values.into_iter().next().and_then(|v| {
                            redis::from_redis_value::<HashMap<String, String>>(v).ok()
                        }),
                        Ok(Err(error)) => {
                            tracing::debug!(%error, "rate limit quota: the demand board failed");
                            None
                        }
                        Err(_) => None,
                    };
                    match read {
                        Some(fields) => {
                            let others: Vec<Demand> = (fields.iter())
                                .filter(|(f, _)| **f != field)
                                .flat_map(|(_, text)| decode(text, at))
                                .collect();
                            last.insert(bucket.clone(), (now, others.clone()));
                            out.push(others);
                        }
                        // Unread: the last read holds while fresh.
                        None => out.push(
                            (last.get(bucket))
                                .filter(|(when, _)| {
                                    now.saturating_duration_since(*when)
                                        < super::super::share::STALE
                                })
                                .map(|(_, d)| d.clone())
                                .unwrap_or_default(),
                        ),
                    }
                }
                // Forget buckets not read for long (bounded by the buckets in use).
                if last.len() > 1024 {
                    last.retain(|_, (when, _)| {
                        now.saturating_duration_since(*when) < super::super::share::STALE
                    });
                }
                out
            })
        }
    }
}

impl DemandBoard {
    /// A board in the Redis (or Redis Cluster) of `backend`: a small hash per bucket under
    /// the backend's key prefix (`<prefix>rlqs:<sha256>`, expiring a minute after its last
    /// write), written and read in one round trip per bucket at each report, with a 1-s
    /// deadline.
    #[cfg(feature = "redis")]
    pub fn redis(backend: &crate::backend::redis::RedisBackend) -> Self {
        DemandBoard {
            inner: Arc::new(redis_board::RedisBoard {
                backend: backend.clone(),
                last: std::sync::Mutex::new(HashMap::new()),
            }),
        }
    }
}

/// A bucket a stream holds.
struct Held {
    /// As the stream sent it (answers carry it back).
    id: BucketId,
    /// Whether its rule counts it (a rule removed then abandons it).
    counted: bool,
    /// The last answer for it, sent again with the answers to reports that leave it out.
    action: bucket_action::BucketAction,
    seen: Instant,
}

/// One stream: the buckets it holds. Dropped (the stream closed, or the server stopped), it
/// leaves their splits.
struct Stream<B: Backend> {
    inner: Arc<Inner<B>>,
    id: u64,
    held: HashMap<BucketKey, Held, foldhash::fast::RandomState>,
    /// Reports of buckets past the cap, not answered yet logged.
    warned: bool,
}

impl<B: Backend> Drop for Stream<B> {
    fn drop(&mut self) {
        let quota = &self.inner.quota;
        quota.streams.leave(self.id, self.held.keys());
        quota.open.fetch_sub(1, Ordering::Relaxed);
        metrics::rlqs_streams(quota.open.load(Ordering::Relaxed));
    }
}

/// A counted bucket of a report, asked of the store.
struct Charge {
    bucket: BucketKey,
    policy: usize,
    key: crate::Key,
    allowed: u64,
    demand: Demand,
    shadow: bool,
}

fn blanket(rule: BlanketRule) -> bucket_action::BucketAction {
    strategy(Strategy::BlanketRule(rule as i32))
}

fn strategy(s: Strategy) -> bucket_action::BucketAction {
    bucket_action::BucketAction::QuotaAssignmentAction(bucket_action::QuotaAssignmentAction {
        assignment_time_to_live: Some(proto_duration(TTL)),
        rate_limit_strategy: Some(RateLimitStrategy { strategy: Some(s) }),
    })
}

/// A token bucket of `max_tokens`, `per_second` added every second.
fn token_bucket(max_tokens: u32, per_second: u32) -> bucket_action::BucketAction {
    strategy(Strategy::TokenBucket(TokenBucket {
        max_tokens,
        tokens_per_fill: Some(UInt32Value { value: per_second }),
        fill_interval: Some(proto_duration(Duration::from_secs(1))),
    }))
}

/// An assignment's `action` label.
fn kind(action: &bucket_action::BucketAction) -> &'static str {
    match action {
        bucket_action::BucketAction::AbandonAction(_) => "abandon",
        bucket_action::BucketAction::QuotaAssignmentAction(a) => {
            match a
                .rate_limit_strategy
                .as_ref()
                .and_then(|s| s.strategy.as_ref())
            {
                Some(Strategy::TokenBucket(_)) => "token_bucket",
                Some(Strategy::BlanketRule(r)) if *r == BlanketRule::DenyAll as i32 => "deny_all",
                _ => "allow_all",
            }
        }
    }
}

fn abandon() -> bucket_action::BucketAction {
    bucket_action::BucketAction::AbandonAction(bucket_action::AbandonAction {})
}

/// A report's `time_elapsed` (none, or negative, is no time).
fn elapsed(d: Option<&envoy_types::pb::google::protobuf::Duration>) -> Duration {
    d.map_or(Duration::ZERO, |d| {
        let secs = u64::try_from(d.seconds).unwrap_or(0);
        let nanos = u32::try_from(d.nanos).unwrap_or(0).min(999_999_999);
        Duration::new(secs, nanos)
    })
}

/// Charges what a stream allowed to the rule's bucket (a debit: taken whatever is left), then
/// reads what the bucket has left for the next request.
async fn charge_and_read<B: Backend>(
    backend: &B,
    prepared: &B::Policy,
    key: &crate::Key,
    allowed: u64,
) -> Result<Decision, crate::BackendError> {
    if let Some(cost) = NonZeroU32::new(u32::try_from(allowed).unwrap_or(u32::MAX)) {
        backend
            .decide_with(prepared, key, cost, Mode::Debit)
            .await?;
    }
    backend
        .decide_with(prepared, key, NonZeroU32::MIN, Mode::Peek)
        .await
}

impl<B: Backend> Stream<B> {
    fn new(inner: Arc<Inner<B>>) -> Self {
        let id = inner.quota.next_stream.fetch_add(1, Ordering::Relaxed);
        let open = inner.quota.open.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::rlqs_streams(open);
        Stream {
            inner,
            id,
            held: HashMap::default(),
            warned: false,
        }
    }

    /// The answer to one report: every bucket the stream holds.
    async fn answer(
        &mut self,
        report: RateLimitQuotaUsageReports,
    ) -> Result<RateLimitQuotaResponse, tonic::Status> {
        if report.domain.is_empty() {
            return Err(tonic::Status::invalid_argument(
                "rate limit quota domain must not be empty",
            ));
        }
        let now = Instant::now();
        let rules: Option<Arc<Compiled<B>>> =
            (self.inner.domains.load().by_name.get(&report.domain)).cloned();
        if let Some(rules) = &rules {
            metrics::rlqs_report(&rules.domain);
        }
        let v6_prefix = self.inner.v6_prefix.load(Ordering::Relaxed);
        let max = self.inner.quota.max_buckets.load(Ordering::Relaxed);
        // Each bucket of the report once (a repeated one counts its usage once: the last).
        let mut reported: HashMap<BucketKey, _, foldhash::fast::RandomState> = HashMap::default();
        let mut refused = 0u64;
        for mut usage in report.bucket_quota_usages {
            let Some(id) = usage.bucket_id.take() else {
                continue;
            };
            if id.bucket.is_empty() {
                continue;
            }
            let mut entries: Vec<(String, String)> = id
                .bucket
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            entries.sort_unstable();
            let bucket: BucketKey = Arc::new((report.domain.clone(), entries));
            if !self.held.contains_key(&bucket)
                && !reported.contains_key(&bucket)
                && self.held.len() + reported.len() >= max
            {
                refused += 1;
                continue;
            }
            reported.insert(bucket, (id, usage));
        }
        if refused > 0 {
            metrics::rlqs_buckets_refused(refused);
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    stream = self.id,
                    max,
                    "a rate limit quota stream reports more buckets than a stream may hold: \
                     those past the cap get no assignment (its no_assignment_behavior decides)"
                );
            }
        }
        let mut actions: Vec<(BucketKey, BucketId, bucket_action::BucketAction, bool)> =
            Vec::with_capacity(reported.len());
        let mut charges: Vec<(Charge, BucketId)> = Vec::new();
        for (bucket, (id, usage)) in reported {
            let first = !self.held.contains_key(&bucket);
            let counted_before = self.held.get(&bucket).is_some_and(|h| h.counted);
            let found = rules.as_ref().and_then(|rules| {
                let pairs: SmallVec<[(&str, &str); 4]> = (bucket.1.iter())
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                let (_, ordered) = config::find_unordered(rules.config.root(), &pairs)?;
                // The same walk in that order, for the entries a `share_threshold` pattern
                // keys by (as an RLS descriptor in that order is keyed).
                let mut shared: SmallVec<[(usize, &str); 2]> = SmallVec::new();
                let rule = config::find(rules.config.root(), ordered.iter().copied(), |at, p| {
                    shared.push((at, p))
                })?;
                let limit = rule.limit.as_ref()?;
                Some(match limit {
                    Limit::Unlimited { .. } => Err(BlanketRule::AllowAll),
                    Limit::Refused(named) if named.shadow => Err(BlanketRule::AllowAll),
                    Limit::Refused(_) => Err(BlanketRule::DenyAll),
                    Limit::Counted { policy, named, .. } => {
                        let entries: Vec<Entry> = (ordered.iter())
                            .map(|(k, v)| Entry {
                                key: (*k).to_owned(),
                                value: (*v).to_owned(),
                            })
                            .collect();
                        Ok((
                            *policy,
                            descriptor_key(&entries, v6_prefix, &shared),
                            named.shadow,
                        ))
                    }
                })
            });
            match found {
                Some(Ok((policy, key, shadow))) => {
                    // The time the counts cover: since this stream's last report of the
                    // bucket, as the server saw it (Envoy 1.40 truncates `time_elapsed` to
                    // whole seconds: 5.9 s of requests reported as 5 would read as 18 % more
                    // demand, and a share the stream cannot use); the report's own for a
                    // bucket the stream did not report here before.
                    let since = (self.held.get(&bucket))
                        .map(|h| now.saturating_duration_since(h.seen))
                        .filter(|since| *since >= Duration::from_secs(1));
                    let demand = Demand::from_report(
                        usage.num_requests_allowed,
                        usage.num_requests_denied,
                        since.unwrap_or_else(|| elapsed(usage.time_elapsed.as_ref())),
                    );
                    let charge = Charge {
                        bucket,
                        policy,
                        key,
                        allowed: usage.num_requests_allowed,
                        demand,
                        shadow,
                    };
                    charges.push((charge, id));
                }
                Some(Err(rule)) => actions.push((bucket, id, blanket(rule), false)),
                // No rule: allowed, as RLS allows an unknown descriptor; a bucket whose rule
                // went away is abandoned (never at its first report).
                None if counted_before && !first => {
                    actions.push((bucket, id, abandon(), false));
                }
                None => actions.push((bucket, id, blanket(BlanketRule::AllowAll), false)),
            }
        }
        // The store: every counted bucket's charge and read at once, and the other servers'
        // demand for them.
        if let Some(rules) = &rules {
            let quota = &self.inner.quota;
            let backend = &self.inner.backend;
            let reads = futures_util::future::join_all(charges.iter().map(|(c, _)| {
                charge_and_read(backend, &rules.prepared[c.policy], &c.key, c.allowed)
            }));
            // The other servers' demand, by charge (none for a shadow rule's, never split).
            let elsewhere = async {
                let mut by_charge = vec![Vec::new(); charges.len()];
                let Some(board) = quota.board.get() else {
                    return by_charge;
                };
                let (at, mine): (Vec<usize>, Vec<_>) = (charges.iter().enumerate())
                    .filter(|(_, (c, _))| !c.shadow)
                    .map(|(i, (c, _))| {
                        quota.streams.record(&c.bucket, self.id, c.demand, now);
                        (i, (c.bucket.clone(), quota.streams.demands(&c.bucket, now)))
                    })
                    .unzip();
                let others = board.inner.exchange(quota.server, mine).await;
                for (i, d) in at.into_iter().zip(others) {
                    by_charge[i] = d;
                }
                by_charge
            };
            let (results, elsewhere) = futures_util::future::join(reads, elsewhere).await;
            for (((c, id), result), others) in charges.into_iter().zip(results).zip(elsewhere) {
                let last = self.held.get(&c.bucket).map(|h| &h.action);
                let action = self.assign(rules, &c, result, last, &others, now);
                actions.push((c.bucket, id, action, true));
            }
        }
        // The answer: the buckets reported, then every other bucket held, as last answered.
        let mut answer = Vec::with_capacity(actions.len() + self.held.len());
        // Buckets that leave this stream's place in their split.
        let mut leaving = Vec::new();
        for (bucket, id, action, counted) in actions {
            answer.push(BucketAction {
                bucket_id: Some(id.clone()),
                bucket_action: Some(action),
            });
            metrics::rlqs_assignment(kind(&action));
            if matches!(action, bucket_action::BucketAction::AbandonAction(_)) {
                self.held.remove(&bucket);
                leaving.push(bucket);
                continue;
            }
            if !counted && self.held.get(&bucket).is_some_and(|h| h.counted) {
                leaving.push(bucket.clone());
            }
            self.held.insert(
                bucket,
                Held {
                    id,
                    counted,
                    action,
                    seen: now,
                },
            );
        }
        // Buckets not reported for long: the filter dropped them; so does the stream.
        let stale: Vec<BucketKey> = (self.held.iter())
            .filter(|(_, h)| now.saturating_duration_since(h.seen) >= super::share::STALE)
            .map(|(b, _)| b.clone())
            .collect();
        for bucket in &stale {
            self.held.remove(bucket);
        }
        leaving.extend(stale);
        self.inner.quota.streams.leave(self.id, &leaving);
        for h in self.held.values().filter(|h| h.seen != now) {
            answer.push(BucketAction {
                bucket_id: Some(h.id.clone()),
                bucket_action: Some(h.action),
            });
        }
        Ok(RateLimitQuotaResponse {
            bucket_action: answer,
        })
    }

    /// A counted bucket's assignment for this stream, from what the store has left.
    fn assign(
        &self,
        rules: &Compiled<B>,
        c: &Charge,
        read: Result<Decision, crate::BackendError>,
        last: Option<&bucket_action::BucketAction>,
        elsewhere: &[Demand],
        now: Instant,
    ) -> bucket_action::BucketAction {
        if c.shadow {
            // Charged, never refused.
            return blanket(BlanketRule::AllowAll);
        }
        let rate = rules.rates[c.policy];
        let left = match read {
            // A read says what is left after a request of one: one more is left now.
            Ok(d) if d.is_allowed() => {
                (d.tightest()).map_or(0, |q| q.remaining.saturating_add(1).min(q.limit))
            }
            // Spent past the next report (or for good): denied until it comes back.
            Ok(d) if d.retry_after().is_none_or(|wait| wait > HORIZON) => {
                return blanket(BlanketRule::DenyAll);
            }
            Ok(_) => 0,
            Err(error) => {
                // The store failed (and its failure policy did not answer): the last
                // assignment holds; a new bucket is split by the rule's rate alone.
                tracing::debug!(%error, "rate limit quota: the store failed; the last split holds");
                if let Some(last) = last {
                    return *last;
                }
                0
            }
        };
        let per_second = rate.floor().clamp(0.0, f64::from(u32::MAX)) as u32;
        let [rate_share, burst_share] = (self.inner.quota.streams).report(
            &c.bucket,
            self.id,
            c.demand,
            now,
            elsewhere,
            [per_second, left],
        );
        if rate_share == 0 && burst_share == 0 && per_second > 0 {
            // Nothing for this stream until the split changes.
            return blanket(BlanketRule::DenyAll);
        }
        if per_second == 0 && burst_share == 0 {
            // A rate below a token per second, nothing left now: denied until units come
            // back (the store says when), then given out as burst.
            return blanket(BlanketRule::DenyAll);
        }
        token_bucket(rate_share.max(burst_share).max(1), rate_share.max(1))
    }
}

#[tonic::async_trait]
impl<B: Backend> RateLimitQuotaService for RlqsService<B> {
    type StreamRateLimitQuotasStream = Pin<
        Box<
            dyn futures_util::Stream<Item = Result<RateLimitQuotaResponse, tonic::Status>>
                + Send
                + 'static,
        >,
    >;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<Self::StreamRateLimitQuotasStream>, tonic::Status> {
        let reports = request.into_inner();
        let stream = Stream::new(self.inner.clone());
        // One answer per report, made when the answer is wanted; the stream (and its shares)
        // goes when Envoy hangs up, the report stream fails (garbage), or the server stops.
        let closing = self.inner.quota.closing.subscribe();
        let answers =
            futures_util::stream::unfold(Some((reports, stream, closing)), |state| async move {
                let (mut reports, mut stream, mut closing) = state?;
                let next = tokio::select! {
                    next = reports.message() => next,
                    _ = closing.wait_for(|closing| *closing) => {
                        let status = tonic::Status::unavailable("the server is stopping");
                        return Some((Err(status), None));
                    }
                };
                match next {
                    Ok(Some(report)) => match stream.answer(report).await {
                        Ok(answer) => Some((Ok(answer), Some((reports, stream, closing)))),
                        Err(status) => Some((Err(status), None)),
                    },
                    Ok(None) => None,
                    Err(status) => {
                        tracing::debug!(%status, "rate limit quota stream ended");
                        Some((Err(status), None))
                    }
                }
            });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}
