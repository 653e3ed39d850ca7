//! Outbound: [`Upstreams`], one adaptive limit per upstream a client calls, learning from what
//! each answers (latency, `429`/`503`, `Retry-After`, timeouts), as Vector's adaptive request
//! concurrency does for its sinks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use super::{AdaptiveLimit, AdaptiveLimitBuilder, Ask, Permit};
use crate::ConfigError;
use crate::client::{Throttle, ThrottleBuilder, ThrottleTicket, Throttled};

type Make = dyn Fn(&str) -> AdaptiveLimitBuilder + Send + Sync;

/// One [`AdaptiveLimit`] per upstream (a host, a service, any name), made on first use from a
/// builder the caller gives. A call takes a slot of its upstream's limit
/// ([`try_acquire`](Self::try_acquire)) and ends it with what the upstream answered
/// ([`OutboundPermit::observe`]): a `429` or `503` (or gRPC `RESOURCE_EXHAUSTED` /
/// `UNAVAILABLE`) is a drop, and its `Retry-After` (or `grpc-retry-pushback-ms`) pauses the
/// upstream: calls to it are refused at once until then, without reaching it. A timeout is a
/// drop ([`OutboundPermit::dropped`]); any other answer is a sample of its latency. Each attempt
/// of a retried call takes its own permit: its own sample.
///
/// Finding an upstream's limit takes no lock (a lock-free snapshot of the map); adding one
/// copies the map under a lock, once per upstream. At most 1 024 upstreams by default
/// ([`max_upstreams`](Self::max_upstreams)); calls to more share the limit named `other` (a
/// name no upstream may have). Where the builder fails for an upstream's name, calls to it are
/// refused with the reason ([`Refused::Invalid`]), never put under another's limit.
///
/// ```
/// use std::time::Duration;
/// use tollgate::adaptive::{AdaptiveLimit, Upstreams};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // Each upstream starts at 10 calls at once, between 2 and 100.
/// let upstreams = Upstreams::new(|name| {
///     AdaptiveLimit::builder().name(name).initial(10).range(2, 100)
/// })?;
/// let permit = upstreams.try_acquire("api.partner.example:443").expect("under the limit");
/// // ... make the call ...
/// let answer = http::Response::builder().status(503).header("retry-after", "2").body(())?;
/// permit.observe(answer.status(), answer.headers());
/// // The partner asked for 2 s: calls to it are refused until then.
/// let refused = upstreams.try_acquire("api.partner.example:443").unwrap_err();
/// assert!(refused.retry_after() > Some(Duration::from_secs(1)));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Upstreams {
    inner: Arc<UpInner>,
}

/// Each upstream's limit by name, or why it has none.
type Map = HashMap<Box<str>, Result<Arc<Upstream>, Refused>>;

struct UpInner {
    /// Each upstream's limit, or why it has none (its builder failed).
    map: ArcSwap<Map>,
    /// The throttle each upstream gets, named after it ([`Upstreams::throttle`]).
    throttle: arc_swap::ArcSwapOption<ThrottleBuilder>,
    make: Box<Make>,
    /// Held while a new upstream is added (a copy of the map swapped in).
    grow: Mutex<()>,
    /// The most upstreams with a limit of their own (read when one is added).
    max: AtomicUsize,
    origin: Instant,
}

struct Upstream {
    limit: AdaptiveLimit,
    /// Client-side adaptive throttling of its calls, when asked for.
    throttle: Option<Throttle>,
    /// The end of the pause the upstream asked for (ns from the origin; 0: none).
    paused_until: AtomicU64,
}

impl std::fmt::Debug for Upstreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstreams")
            .field("upstreams", &self.inner.map.load().len())
            .field("max", &self.inner.max.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Why a call was refused before it was made ([`Upstreams::try_acquire`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refused {
    /// The upstream's limit is reached: as many calls as it takes now are in flight.
    OverLimit,
    /// The upstream asked callers to wait (`Retry-After`, gRPC pushback): this much is left.
    Paused(Duration),
    /// The upstream's throttle refused the call: it has lately accepted too few of the calls
    /// made to it ([`Upstreams::throttle`]).
    Throttled(Throttled),
    /// The upstream has no limit: the builder given to [`Upstreams::new`] failed for its name,
    /// or the name is `other` (the name the upstreams past
    /// [`max_upstreams`](Upstreams::max_upstreams) share). A mistake in the program, refused
    /// on every call rather than put silently under another upstream's limit.
    Invalid(ConfigError),
}

impl Refused {
    /// How long to wait before calling again, when the upstream said.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Refused::OverLimit | Refused::Invalid(_) | Refused::Throttled(_) => None,
            Refused::Paused(left) => Some(*left),
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::OverLimit => {
                f.write_str("the upstream's adaptive concurrency limit is reached")
            }
            Refused::Paused(left) => write!(
                f,
                "the upstream asked to wait: {:.3} s left",
                left.as_secs_f64()
            ),
            Refused::Invalid(e) => write!(f, "the upstream has no adaptive limit: {e}"),
            Refused::Throttled(t) => t.fmt(f),
        }
    }
}

impl std::error::Error for Refused {}

/// The name calls share once [`Upstreams::max_upstreams`] are known.
const OTHER: &str = "other";

impl Upstreams {
    /// Upstreams whose limits `make` builds, given each upstream's name (use it as the limit's
    /// [`name`](AdaptiveLimitBuilder::name) to see each in the metrics; the names are bounded
    /// by [`max_upstreams`](Self::max_upstreams)). The builder's settings are checked here,
    /// once, for the upstream named `other`.
    pub fn new(
        make: impl Fn(&str) -> AdaptiveLimitBuilder + Send + Sync + 'static,
    ) -> Result<Self, ConfigError> {
        let other = make(OTHER).build()?;
        let mut map = HashMap::new();
        map.insert(OTHER.into(), Ok(Arc::new(Upstream::new(other, None))));
        Ok(Upstreams {
            inner: Arc::new(UpInner {
                map: ArcSwap::from_pointee(map),
                throttle: arc_swap::ArcSwapOption::empty(),
                make: Box::new(make),
                grow: Mutex::new(()),
                max: AtomicUsize::new(1024),
                origin: Instant::now(),
            }),
        })
    }

    /// The most upstreams with a limit of their own (default 1 024, at least 1); calls to
    /// upstreams past it share `other`'s. Clones share the setting.
    pub fn max_upstreams(self, max: usize) -> Self {
        self.inner.max.store(max.max(1), Ordering::Relaxed);
        self
    }

    /// Adds client-side adaptive throttling ([`Throttle`]) to every upstream: each gets its
    /// own, built from `throttle` with the upstream's name, and a call its throttle refuses is
    /// [`Refused::Throttled`], never sent. Set it before the first call: upstreams already
    /// called keep what they had (`other` gets one now). The builder is checked here.
    pub fn throttle(self, throttle: ThrottleBuilder) -> Result<Self, ConfigError> {
        let other = throttle.clone().name(OTHER).build()?;
        {
            let _grow = self.inner.grow.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.throttle.store(Some(Arc::new(throttle)));
            let map = self.inner.map.load();
            if let Some(Ok(up)) = map.get(OTHER) {
                let mut grown = HashMap::clone(&map);
                let with = Upstream::new(up.limit.clone(), Some(other));
                grown.insert(OTHER.into(), Ok(Arc::new(with)));
                self.inner.map.store(Arc::new(grown));
            }
        }
        Ok(self)
    }

    /// A slot of `upstream`'s limit for one call, or why not: its limit is reached, it asked
    /// to wait, its throttle refused the call, or it has no limit ([`Refused::Invalid`]: its
    /// builder failed, or it is named `other`).
    ///
    /// The call is admitted at the current [`Criticality`](crate::criticality::Criticality)
    /// (the inbound request's, when its layer sets one), so that a full upstream limit sheds
    /// the same traffic first as the service that called.
    pub fn try_acquire(&self, upstream: &str) -> Result<OutboundPermit, Refused> {
        self.try_acquire_as(upstream, Ask::new())
    }

    /// [`try_acquire`](Self::try_acquire) as `ask` says: a flow (the tenant the call is made
    /// for, so that one tenant's calls cannot take all of an upstream's slots), a criticality,
    /// a partition of the upstream's limit.
    pub fn try_acquire_as(&self, upstream: &str, ask: Ask<'_>) -> Result<OutboundPermit, Refused> {
        let up = self.upstream(upstream)?;
        let until = up.paused_until.load(Ordering::Relaxed);
        if until != 0 {
            let now = self.now_ns();
            if now < until {
                return Err(Refused::Paused(Duration::from_nanos(until - now)));
            }
        }
        let Some(permit) = up.limit.try_acquire_as(ask) else {
            return Err(Refused::OverLimit);
        };
        // Throttled after the slot is found free: a call the limit refuses is not one the
        // upstream refused. A throttled call gives its slot back, no sample.
        let ticket = match &up.throttle {
            Some(t) => Some(t.admit().map_err(Refused::Throttled)?),
            None => None,
        };
        Ok(OutboundPermit {
            permit: Some(permit),
            ticket,
            upstream: up,
            origin: self.inner.origin,
        })
    }

    /// The limit of `upstream`, if a call to it was made and its limit was built (or of
    /// `other`).
    pub fn limit(&self, upstream: &str) -> Option<AdaptiveLimit> {
        let map = self.inner.map.load();
        let up = map.get(upstream)?.as_ref().ok()?;
        Some(up.limit.clone())
    }

    /// The upstreams with a limit of their own, `other` included.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .inner
            .map
            .load()
            .iter()
            .filter(|(_, up)| up.is_ok())
            .map(|(k, _)| k.to_string())
            .collect();
        names.sort();
        names
    }

    fn now_ns(&self) -> u64 {
        let since = Instant::now().saturating_duration_since(self.inner.origin);
        u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
    }

    fn upstream(&self, name: &str) -> Result<Arc<Upstream>, Refused> {
        if name == OTHER {
            return Err(Refused::Invalid(ConfigError::Invalid {
                option: "upstream",
                reason: "`other` is the name the upstreams past `max_upstreams` share: \
                         give this upstream another name"
                    .into(),
            }));
        }
        if let Some(up) = self.inner.map.load().get(name) {
            return up.clone();
        }
        let _grow = self.inner.grow.lock().unwrap_or_else(|e| e.into_inner());
        let map = self.inner.map.load();
        if let Some(up) = map.get(name) {
            return up.clone();
        }
        // Counted without `other` and the upstreams whose builder failed.
        let own = map.values().filter(|up| up.is_ok()).count() - 1;
        if own >= self.inner.max.load(Ordering::Relaxed) {
            return map[OTHER].clone();
        }
        // A builder that depends on the name may fail for one: that upstream is refused with
        // the reason on every call (kept, so that the builder runs once a name).
        let throttle = (self.inner.throttle.load_full())
            .map(|b| ThrottleBuilder::clone(&b).name(name).build());
        let up = match ((self.inner.make)(name).build(), throttle.transpose()) {
            (Ok(limit), Ok(throttle)) => Ok(Arc::new(Upstream::new(limit, throttle))),
            (_, Err(e)) | (Err(e), _) => {
                tracing::error!(
                    target: "tollgate::adaptive",
                    upstream = name,
                    error = %e,
                    "the upstream's adaptive limit could not be built: its calls are refused"
                );
                Err(Refused::Invalid(e))
            }
        };
        let mut grown = HashMap::clone(&map);
        grown.insert(name.into(), up.clone());
        self.inner.map.store(Arc::new(grown));
        up
    }
}

impl Upstream {
    fn new(limit: AdaptiveLimit, throttle: Option<Throttle>) -> Self {
        Upstream {
            limit,
            throttle,
            paused_until: AtomicU64::new(0),
        }
    }
}

/// A call's slot of its upstream's limit ([`Upstreams::try_acquire`]). End it with what the
/// upstream answered ([`observe`](Self::observe)), or [`dropped`](Self::dropped) for a
/// timeout; dropped without either (the call was cancelled, or failed before reaching the
/// upstream), it gives its slot back and is no sample.
#[derive(Debug)]
#[must_use = "a permit holds a slot until it is ended or dropped"]
pub struct OutboundPermit {
    permit: Option<Permit>,
    /// The call's ticket of its upstream's throttle, if it has one.
    ticket: Option<ThrottleTicket>,
    upstream: Arc<Upstream>,
    origin: Instant,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl OutboundPermit {
    /// The upstream answered with `status` and `headers` (the response's head, or a gRPC
    /// trailers-only answer's): a `429`, a `503`, or gRPC `RESOURCE_EXHAUSTED` (8) or
    /// `UNAVAILABLE` (14) is a drop, and pauses the upstream for its `Retry-After` or
    /// `grpc-retry-pushback-ms` (at most an hour); anything else is a sample of the call's
    /// latency. Returns whether it was a drop.
    pub fn observe(mut self, status: StatusCode, headers: &HeaderMap) -> bool {
        if let Some(ticket) = self.ticket.take() {
            ticket.observe(status, headers);
        }
        let overload = super::layer::default_overload(status, headers);
        if overload {
            if let Some(wait) = pause_of(status, headers) {
                let wait = wait.min(Duration::from_secs(3600));
                let until = Instant::now().saturating_duration_since(self.origin) + wait;
                let until = u64::try_from(until.as_nanos()).unwrap_or(u64::MAX).max(1);
                self.upstream
                    .paused_until
                    .fetch_max(until, Ordering::Relaxed);
            }
            if let Some(p) = self.permit.take() {
                p.dropped();
            }
        } else if let Some(p) = self.permit.take() {
            p.success();
        }
        overload
    }

    /// The call succeeded: its time since admission is a sample.
    pub fn success(mut self) {
        if let Some(ticket) = self.ticket.take() {
            ticket.accepted();
        }
        if let Some(p) = self.permit.take() {
            p.success();
        }
    }

    /// The call showed overload without an answer (a timeout, a connection refused or reset).
    pub fn dropped(mut self) {
        if let Some(ticket) = self.ticket.take() {
            ticket.not_accepted();
        }
        if let Some(p) = self.permit.take() {
            p.dropped();
        }
    }
}

impl Drop for OutboundPermit {
    /// Cancelled, or failed before reaching the upstream: no sample for the limit, and nothing
    /// for the throttle.
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            ticket.forget();
        }
    }
}

/// The pause an overload answer asks for: `Retry-After` (seconds or an HTTP date), or gRPC's
/// `grpc-retry-pushback-ms` (a negative one, "do not retry", is none).
fn pause_of(status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        return crate::wait::retry_after(headers);
    }
    let ms = headers.get("grpc-retry-pushback-ms")?.to_str().ok()?;
    ms.trim().parse::<u64>().ok().map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Upstreams {
        Upstreams::new(|name| AdaptiveLimit::builder().name(name).initial(2).range(1, 10)).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_throttled_upstream_refuses_calls_before_they_are_made() {
        let ups = Upstreams::new(|n| AdaptiveLimit::builder().name(n).initial(50).range(50, 50))
            .unwrap()
            .throttle(Throttle::builder())
            .unwrap();
        let mut throttled = 0;
        for _ in 0..300 {
            match ups.try_acquire("down") {
                Ok(p) => {
                    p.observe(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new());
                }
                Err(Refused::Throttled(t)) => {
                    assert!(t.probability() > 0.0);
                    throttled += 1;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(throttled > 200, "{throttled}");
        // Another upstream, healthy: never throttled; a cancelled call counts for nothing.
        for _ in 0..300 {
            ups.try_acquire("up").unwrap().success();
            drop(ups.try_acquire("up").unwrap());
        }
        assert_eq!(ups.limit("up").unwrap().in_flight(), 0);
        let bad = Upstreams::new(|n| AdaptiveLimit::builder().name(n))
            .unwrap()
            .throttle(Throttle::builder().k(0.1));
        assert!(bad.unwrap_err().to_string().contains("k"));
    }

    #[tokio::test(start_paused = true)]
    async fn each_upstream_has_its_own_limit() {
        let ups = limits();
        let a1 = ups.try_acquire("a").unwrap();
        let _a2 = ups.try_acquire("a").unwrap();
        assert_eq!(ups.try_acquire("a").unwrap_err(), Refused::OverLimit);
        // Another upstream is not held back by the first.
        let _b = ups.try_acquire("b").unwrap();
        a1.success();
        assert!(ups.try_acquire("a").is_ok());
        assert_eq!(ups.names(), ["a", "b", "other"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_pauses_the_upstream_until_then() {
        let ups = limits();
        let p = ups.try_acquire("a").unwrap();
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, "3".parse().unwrap());
        assert!(p.observe(StatusCode::TOO_MANY_REQUESTS, &h));
        let left = ups.try_acquire("a").unwrap_err().retry_after().unwrap();
        assert_eq!(left, Duration::from_secs(3));
        assert!(ups.try_acquire("b").is_ok(), "only that upstream");
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(ups.try_acquire("a").is_ok());
        let stats = ups.limit("a").unwrap().partitions();
        assert_eq!(stats[0].dropped, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_most_upstreams_calls_share_other() {
        let ups = limits().max_upstreams(2);
        for name in ["a", "b", "c", "d"] {
            drop(ups.try_acquire(name).unwrap());
        }
        // `other`, then two of their own; `d` shares `other`.
        assert_eq!(ups.names().len(), 3, "{:?}", ups.names());
        assert!(ups.limit("d").is_none());
        let other = ups.limit("other").unwrap();
        assert_eq!(other.partitions()[0].cancelled, 2);
    }

    /// An upstream that times out on every call loses concurrency with the default gradient,
    /// down to its minimum (a window of drops only used to leave the limit where it was).
    #[tokio::test(start_paused = true)]
    async fn an_upstream_timing_out_on_every_call_loses_concurrency() {
        let ups =
            Upstreams::new(|name| AdaptiveLimit::builder().name(name).initial(20).range(1, 20))
                .unwrap();
        for _ in 0..200 {
            let permits: Vec<_> = std::iter::from_fn(|| ups.try_acquire("down").ok()).collect();
            tokio::time::sleep(Duration::from_millis(500)).await;
            permits.into_iter().for_each(OutboundPermit::dropped);
        }
        assert_eq!(ups.limit("down").unwrap().limit(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_builder_that_fails_for_a_name_and_the_name_other_are_refused() {
        // The builder is checked for `other` at `new`; here it fails for one name only.
        let ups = Upstreams::new(|name| {
            let max = if name == "tiny" { 0 } else { 10 };
            AdaptiveLimit::builder().name(name).initial(2).range(1, max)
        })
        .unwrap();
        for _ in 0..2 {
            match ups.try_acquire("tiny").unwrap_err() {
                Refused::Invalid(ConfigError::Invalid { option, reason }) => {
                    assert_eq!(option, "range");
                    assert!(reason.contains("1..0"), "{reason}");
                }
                other => panic!("{other:?}"),
            }
        }
        let e = ups.try_acquire("other").unwrap_err();
        assert!(e.to_string().contains("`other`"), "{e}");
        // Neither took a slot of `other`, nor counts as an upstream of its own.
        let other = ups.limit("other").unwrap().partitions()[0].clone();
        assert_eq!((other.admitted, other.rejected), (0, 0));
        assert!(ups.limit("tiny").is_none());
        assert_eq!(ups.names(), ["other"]);
        assert!(ups.try_acquire("fine").is_ok());
    }

    #[test]
    fn many_threads_add_upstreams_at_once_and_none_is_lost() {
        // Four threads at once: a limit of four never refuses.
        let ups =
            Upstreams::new(|name| AdaptiveLimit::builder().name(name).initial(4).range(4, 10))
                .unwrap();
        std::thread::scope(|s| {
            for t in 0..4 {
                let ups = &ups;
                s.spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build()
                        .unwrap();
                    rt.block_on(async {
                        for i in 0..50 {
                            let p = ups.try_acquire(&format!("u{}", (i + t) % 50)).unwrap();
                            p.success();
                        }
                    });
                });
            }
        });
        assert_eq!(ups.names().len(), 51);
        let admitted: u64 = (0..50)
            .map(|i| ups.limit(&format!("u{i}")).unwrap().partitions()[0].admitted)
            .sum();
        assert_eq!(admitted, 200);
    }
}
