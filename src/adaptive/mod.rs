//! Concurrency limits that adapt to latency and drops: they protect the service, where a rate
//! limit shares it. [`AdaptiveLayer`] puts one in front of a service (issue 46), [`Upstreams`]
//! in front of the services it calls; when it is full it sheds fairly (issue 60): by
//! [`Criticality`] (sheddable first, critical last) and between flows (the flow holding the most
//! slots first), see [`Ask`] and `docs/adaptive.md`, "Fair shedding".
//!
//! An [`AdaptiveLimit`] admits a request when fewer than its limit are in flight
//! ([`try_acquire`](AdaptiveLimit::try_acquire)), and learns from how each one ended: its
//! [`Permit`]'s [`success`](Permit::success) is a sample of the round-trip time,
//! [`dropped`](Permit::dropped) a sign of overload (a timeout, an error that means overload, a
//! 429 or 503 from upstream), and a permit dropped without either (a cancelled request) gives
//! its slot back and is no sample. Samples are gathered in windows (at least `min_samples`,
//! and 2 × the last window's RTT long, between 100 ms and 1 s by default: Netflix's
//! `WindowedLimit`; a window starts with its first sample), and at each window's end an
//! [`Algorithm`] moves the limit: [`Gradient`] (the default, on latency) or [`Aimd`] (on
//! drops). The limit stays in `[min, max]` whatever the samples.
//!
//! No request waits on a lock: admission is a compare-and-swap on the count in flight, a
//! sample a few atomic adds, and the window is closed by the one request that finds it due and
//! wins a `try_lock` (the others go on).
//!
//! ```
//! use std::time::Duration;
//! use tollgate::adaptive::{AdaptiveLimit, Gradient};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tollgate::ConfigError> {
//! let limit = AdaptiveLimit::builder()
//!     .initial(20)
//!     .range(4, 200)
//!     .gradient(Gradient::new().tolerance(2.0))
//!     .build()?;
//! match limit.try_acquire() {
//!     Some(permit) => {
//!         // ... call the service ...
//!         permit.success();
//!     }
//!     None => { /* over the limit: answer 503 at once */ }
//! }
//! assert_eq!(limit.in_flight(), 0);
//! # Ok(()) }
//! ```

mod algorithm;
#[cfg(feature = "serde")]
mod config;
mod layer;
mod outbound;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use algorithm::{Aimd, Algorithm, Gradient, Window};
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub use config::{AdaptiveConfig, PartitionConfig, QueueConfig};
pub use layer::{
    Adaptive, AdaptiveFuture, AdaptiveLayer, CriticalityBy, FlowBy, Overload, PartitionBy,
};
pub use outbound::{OutboundPermit, Refused, Upstreams};

use tokio::time::Instant;

use crate::ConfigError;
use crate::criticality::{Criticality, LEVELS};

/// A concurrency limit that adapts (see the [module docs](self)). Cheap to clone: clones share
/// the limit.
#[derive(Clone)]
pub struct AdaptiveLimit {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AdaptiveLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveLimit")
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

struct Inner {
    /// The limit in force (the algorithm's, rounded, in `[min, max]`).
    limit: AtomicU32,
    in_flight: AtomicU32,
    min: u32,
    max: u32,
    min_samples: u32,
    min_window: Duration,
    max_window: Duration,
    origin: Instant,
    /// The window being gathered: its end (ns from `origin`), samples, dropped, the sum of the
    /// RTTs not dropped (ns), the fastest (ns), the most in flight at a start.
    window_end: AtomicU64,
    samples: AtomicU32,
    dropped: AtomicU32,
    rtt_sum: AtomicU64,
    rtt_min: AtomicU64,
    max_in_flight: AtomicU32,
    /// The sum of the dropped samples' RTTs (ns): a window of drops only has their mean.
    drop_sum: AtomicU64,
    /// The algorithm and the fractional limit, taken by the request that closes a window.
    state: Mutex<State>,
    /// The partitions given (guaranteed shares), then the one of every other request.
    partitions: Box<[Part]>,
    /// Requests waiting for a slot, when the limit queues ([`AdaptiveLimitBuilder::queue`]).
    queue: Option<Queue>,
    /// Per criticality level, lowest first: in flight, the most in flight lately, counts.
    levels: [Level; 3],
    /// The flows' lanes (a flow's key hashed to one), `per_level` for each level in turn:
    /// flows are fair to each other inside their level.
    lanes: Box<[Lane]>,
    per_level: usize,
    /// Windows closed so far: a lane refused in this window or the last is asking.
    epoch: AtomicU32,
    /// When the levels' peaks last moved on (ns from `origin`): at each window's end, or, when
    /// no window ends (nothing admitted ends), each longest window: a level above that went
    /// quiet keeps slots back for two longest windows at most.
    peaks_at: AtomicU64,
    /// The flows' hash (random per limit: a client cannot aim its keys at another's lane).
    hasher: std::hash::RandomState,
    /// The share of the limit the heaviest flow leaves to the others.
    headroom: f64,
    /// The `limit` label of the metrics.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    name: Arc<str>,
}

/// A partition: its guaranteed share of the limit once the limit is reached, its requests in
/// flight, and its counts.
struct Part {
    name: Arc<str>,
    share: f64,
    in_flight: AtomicU32,
    /// Admitted, rejected, ended in success, dropped (overload), cancelled (no sample).
    counts: [AtomicU64; 5],
    #[cfg(feature = "metrics")]
    counters: std::sync::OnceLock<[metrics::Counter; 5]>,
}

/// What happened to a request, per partition.
#[derive(Clone, Copy)]
enum Event {
    Admitted = 0,
    Rejected = 1,
    Succeeded = 2,
    Dropped = 3,
    Cancelled = 4,
}

#[cfg(feature = "metrics")]
const EVENTS: [&str; 5] = ["admitted", "rejected", "succeeded", "dropped", "cancelled"];

impl Part {
    fn new(name: &str, share: f64) -> Self {
        Part {
            name: name.into(),
            share,
            in_flight: AtomicU32::new(0),
            counts: Default::default(),
            #[cfg(feature = "metrics")]
            counters: std::sync::OnceLock::new(),
        }
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn count(&self, event: Event, limit: &Arc<str>) {
        self.counts[event as usize].fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.counters(limit)[event as usize].increment(1);
    }

    /// The partition's counters, each outcome's made at once (so that every one has a series,
    /// at 0 until it happens).
    #[cfg(feature = "metrics")]
    fn counters(&self, limit: &Arc<str>) -> &[metrics::Counter; 5] {
        self.counters.get_or_init(|| {
            EVENTS.map(|outcome| {
                let counter = metrics::counter!(
                    "tollgate_adaptive_requests_total",
                    "limit" => metrics::SharedString::from(limit.clone()),
                    "partition" => metrics::SharedString::from(self.name.clone()),
                    "outcome" => outcome
                );
                counter.increment(0);
                counter
            })
        })
    }
}

/// A partition's requests in flight and counts so far ([`AdaptiveLimit::partitions`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionStats {
    /// Its name (`other` for requests of no partition given).
    pub name: Arc<str>,
    /// Its guaranteed share of the limit once the limit is reached.
    pub share: f64,
    /// Requests of it holding a slot now.
    pub in_flight: u32,
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused (over the limit, and over its guarantee).
    pub rejected: u64,
    /// Admitted requests that ended in success (a sample).
    pub succeeded: u64,
    /// Admitted requests that showed overload (a drop).
    pub dropped: u64,
    /// Admitted requests cancelled before their answer (no sample).
    pub cancelled: u64,
}

/// A criticality level's requests in flight, the most in flight lately, and counts.
struct Level {
    in_flight: AtomicU32,
    /// The most in flight (or asking, when refused) in this window, and in the last.
    peak: AtomicU32,
    last_peak: AtomicU32,
    /// Admitted, rejected, rejected as over its flow's share.
    counts: [AtomicU64; 3],
    #[cfg(feature = "metrics")]
    counters: std::sync::OnceLock<[metrics::Counter; 3]>,
}

impl Level {
    fn new() -> Self {
        Level {
            in_flight: AtomicU32::new(0),
            peak: AtomicU32::new(0),
            last_peak: AtomicU32::new(0),
            counts: Default::default(),
            #[cfg(feature = "metrics")]
            counters: std::sync::OnceLock::new(),
        }
    }

    /// The most this level had in flight (or asking) in this window or the last: 0 when it was
    /// not active.
    fn recent_peak(&self) -> u32 {
        (self.peak.load(Ordering::Relaxed)).max(self.last_peak.load(Ordering::Relaxed))
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn count(&self, what: usize, level: Criticality, limit: &Arc<str>) {
        self.counts[what].fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.counters(level, limit)[what].increment(1);
    }

    /// The level's counters, made at once (each with a series from the start).
    #[cfg(feature = "metrics")]
    fn counters(&self, level: Criticality, limit: &Arc<str>) -> &[metrics::Counter; 3] {
        self.counters.get_or_init(|| {
            let name = || metrics::SharedString::from(limit.clone());
            let made = [
                metrics::counter!("tollgate_adaptive_criticality_total",
                    "limit" => name(), "criticality" => level.as_str(), "outcome" => "admitted"),
                metrics::counter!("tollgate_adaptive_criticality_total",
                    "limit" => name(), "criticality" => level.as_str(), "outcome" => "rejected"),
                metrics::counter!("tollgate_adaptive_over_share_total",
                    "limit" => name(), "criticality" => level.as_str()),
            ];
            for counter in &made {
                counter.increment(0);
            }
            made
        })
    }
}

/// A lane of flows: its slots in flight, and the last window one of its requests was refused
/// in (plus one: 0 is never).
struct Lane {
    held: AtomicU32,
    asked: AtomicU32,
    /// The mark of the flow that took it empty (a hint: flows sharing it share its count).
    mark: AtomicU32,
}

const ADMITTED: usize = 0;
const REJECTED: usize = 1;
const OVER_SHARE: usize = 2;

/// A criticality level's requests in flight and counts so far ([`AdaptiveLimit::levels`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelStats {
    /// The level.
    pub criticality: Criticality,
    /// Its requests holding a slot now.
    pub in_flight: u32,
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused (for whatever reason, over its flow's share included).
    pub rejected: u64,
    /// Requests refused because their flow held more than its share of a full limit.
    pub over_share: u64,
}

/// Who asks for a slot ([`AdaptiveLimit::try_acquire_as`], [`AdaptiveLimit::acquire_as`]): its
/// partition, criticality and flow, each optional.
///
/// - **Partition**: see [`AdaptiveLimitBuilder::partition`] (none: `other`).
/// - **Criticality**: when the limit is full, sheddable requests are refused first, then
///   default ones, critical ones last (none: [`Criticality::current`], else default).
/// - **Flow** (a tenant, a client): while the limit has room nobody is refused; near it, the
///   flow holding the most slots is refused first, so that one flow cannot take the slots of
///   the others (none: no fairness for this request).
///
/// ```
/// use tollgate::adaptive::{AdaptiveLimit, Ask};
/// use tollgate::criticality::Criticality;
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let limit = AdaptiveLimit::builder().initial(8).range(8, 8).build()?;
/// let ask = Ask::new().flow("tenant-7").criticality(Criticality::Sheddable);
/// let permit = limit.try_acquire_as(ask).expect("room");
/// permit.success();
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Ask<'a> {
    partition: Option<&'a str>,
    criticality: Option<Criticality>,
    flow: Option<&'a str>,
}

impl<'a> Ask<'a> {
    /// No partition, the current criticality, no flow.
    pub fn new() -> Self {
        Ask::default()
    }

    /// In partition `name`.
    pub fn partition(mut self, name: &'a str) -> Self {
        self.partition = Some(name);
        self
    }

    /// At criticality `level`.
    pub fn criticality(mut self, level: Criticality) -> Self {
        self.criticality = Some(level);
        self
    }

    /// Of flow `key` (hashed to one of the limit's lanes; never stored).
    pub fn flow(mut self, key: &'a str) -> Self {
        self.flow = Some(key);
        self
    }
}

/// An ask resolved against a limit: its partition's index, its level, its flow's lane.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim {
    pub(crate) at: usize,
    pub(crate) level: Criticality,
    /// Its flow: the lanes it may use, and its mark.
    pub(crate) flow: Option<Flow>,
}

/// A flow as a limit sees it: the two lanes it may use (a flow that finds one lane another's
/// takes the other), and a mark (a few bits of its hash, never 0) by which it knows the lane it
/// holds slots in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flow {
    hand: [u32; 2],
    mark: u32,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shed {
    /// No slot for its level (the limit, less what the levels above it keep).
    Full,
    /// Its flow holds the most slots of a limit near full.
    OverShare,
}

struct State {
    algorithm: Box<dyn Algorithm>,
    limit: f64,
}

/// Builds an [`AdaptiveLimit`].
pub struct AdaptiveLimitBuilder {
    initial: u32,
    min: u32,
    max: u32,
    min_samples: u32,
    min_window: Duration,
    max_window: Duration,
    algorithm: Option<Box<dyn Algorithm>>,
    gradient: Option<Gradient>,
    partitions: Vec<(String, f64)>,
    name: String,
    queue: Option<(usize, QueueOrder)>,
    lanes: usize,
    headroom: f64,
}

impl std::fmt::Debug for AdaptiveLimitBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveLimitBuilder")
            .field("initial", &self.initial)
            .field("min", &self.min)
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl AdaptiveLimit {
    /// A builder: initial limit 20, range 1 to 1000, the [`Gradient`], windows of at least 10
    /// samples and between 100 ms and 1 s (twice the last window's RTT).
    pub fn builder() -> AdaptiveLimitBuilder {
        AdaptiveLimitBuilder {
            initial: 20,
            min: 1,
            max: 1000,
            min_samples: 10,
            min_window: Duration::from_millis(100),
            max_window: Duration::from_secs(1),
            algorithm: None,
            gradient: None,
            partitions: Vec::new(),
            name: "default".into(),
            queue: None,
            lanes: 256,
            headroom: 0.125,
        }
    }

    /// A slot for one request of no partition given, at the current criticality
    /// ([`Criticality::current`], else default), if fewer than the limit are in flight. The
    /// slot is given back when the permit is ended or dropped.
    pub fn try_acquire(&self) -> Option<Permit> {
        self.try_acquire_as(Ask::new())
    }

    /// A slot for one request of partition `name` (see
    /// [`partition`](AdaptiveLimitBuilder::partition)): while fewer than the limit are in
    /// flight, any request is admitted (a partition borrows what the others leave); once the
    /// limit is reached, only a partition under its guaranteed share of it is. A name not
    /// given is `other`, which has no guarantee: shed first.
    pub fn try_acquire_in(&self, name: &str) -> Option<Permit> {
        self.try_acquire_as(Ask::new().partition(name))
    }

    /// A slot for one request as `ask` says (its partition, criticality and flow), if its
    /// level and flow may take one now (see [`Ask`]).
    pub fn try_acquire_as(&self, ask: Ask<'_>) -> Option<Permit> {
        self.acquire_at(self.claim(ask))
    }

    /// A slot for one request of no partition given: at once if there is one, else, when the
    /// limit queues ([`queue`](AdaptiveLimitBuilder::queue)), the first that a request ending
    /// gives to it within `deadline` (`None` once the deadline passes, or at once when the
    /// queue is full or the limit does not queue). The time waiting is not part of the
    /// request's sample. Dropping the future leaves the queue.
    pub async fn acquire(&self, deadline: Duration) -> Option<Permit> {
        self.acquire_as(Ask::new(), deadline).await
    }

    /// [`acquire`](Self::acquire) for a request of partition `name` (see
    /// [`try_acquire_in`](Self::try_acquire_in)).
    pub async fn acquire_in(&self, name: &str, deadline: Duration) -> Option<Permit> {
        self.acquire_as(Ask::new().partition(name), deadline).await
    }

    /// [`acquire`](Self::acquire) as `ask` says. The queue serves the highest criticality
    /// first, and within it the flow holding the fewest slots; when it is full, a newcomer of a
    /// higher level, or of a flow holding fewer slots, takes the place of the waiter of the
    /// lowest level and the heaviest flow (which is refused).
    pub async fn acquire_as(&self, ask: Ask<'_>, deadline: Duration) -> Option<Permit> {
        let claim = self.claim(ask);
        self.acquire_waiting(claim, deadline).await
    }

    /// Requests waiting in the queue now (0 without one).
    pub fn waiting(&self) -> usize {
        (self.inner.queue.as_ref()).map_or(0, |q| q.waiting.load(Ordering::Relaxed))
    }

    /// Whether the limit queues requests over it ([`AdaptiveLimitBuilder::queue`]).
    pub fn queues(&self) -> bool {
        self.inner.queue.is_some()
    }

    /// `ask` resolved while the request (which its names may borrow) is at hand: its
    /// partition's index, its level, its flow's lane. No allocation.
    pub(crate) fn claim(&self, ask: Ask<'_>) -> Claim {
        let inner = &self.inner;
        let at = match ask.partition {
            Some(name) => self.partition_of(name),
            None => inner.partitions.len() - 1,
        };
        let level = (ask.criticality)
            .or_else(Criticality::current)
            .unwrap_or_default();
        let flow = ask.flow.map(|key| {
            let hash = std::hash::BuildHasher::hash_one(&inner.hasher, key);
            let n = inner.per_level as u64;
            Flow {
                hand: [(hash % n) as u32, ((hash >> 20) % n) as u32],
                mark: ((hash >> 40) as u32) | 1,
            }
        });
        Claim { at, level, flow }
    }

    fn partition_of(&self, name: &str) -> usize {
        let parts = &self.inner.partitions;
        (parts[..parts.len() - 1].iter())
            .position(|p| &*p.name == name)
            .unwrap_or(parts.len() - 1)
    }

    /// [`acquire_as`](Self::acquire_as) for a resolved claim.
    pub(crate) async fn acquire_waiting(&self, claim: Claim, deadline: Duration) -> Option<Permit> {
        let first = match self.take(claim) {
            Ok(p) => return Some(p),
            Err(shed) => shed,
        };
        let inner = &self.inner;
        let refuse = |shed: Shed| {
            inner.refused(claim, shed);
            None
        };
        let Some(queue) = &inner.queue else {
            return refuse(first);
        };
        let until = Instant::now() + deadline;
        // A waiter woken whose slot another took first waits again, first in line.
        let mut again = false;
        let mut last = first;
        loop {
            // Waiting is asking: the heaviest flow leaves this one the headroom, the levels
            // below keep its slot back.
            inner.asking(claim);
            let (id, rx) = match queue.join(again, claim, inner) {
                Some(joined) => joined,
                None => return refuse(last),
            };
            // Leaves the line however this ends (a slot, the deadline, the future dropped).
            let mut leave = Leave {
                inner,
                queue,
                id,
                woken: false,
            };
            // A slot given back between the first try and joining woke nobody: try again. (The
            // fence pairs with the one in `Permit::release`: either this try sees the slot, or
            // the request giving it back sees this waiter.)
            std::sync::atomic::fence(Ordering::SeqCst);
            match self.take(claim) {
                Ok(p) => return Some(p),
                Err(shed) => last = shed,
            }
            match tokio::time::timeout_at(until, rx).await {
                Ok(Ok(())) => {
                    // The wake is this waiter's: taken, or lost to a request that came first.
                    leave.woken = true;
                    match self.take(claim) {
                        Ok(p) => return Some(p),
                        Err(shed) => last = shed,
                    }
                    // Refused as the heaviest flow: the slot may be another waiter's, of a
                    // lighter flow or a lower level; the wake goes on down the line (only down:
                    // it cannot come back).
                    if last == Shed::OverShare {
                        queue.wake_below(inner, claim);
                    }
                    again = true;
                }
                // Put out of a full line by a newcomer before it.
                Ok(Err(_)) => {
                    leave.woken = true;
                    return refuse(last);
                }
                Err(_) => return refuse(last),
            }
        }
    }

    /// [`try_acquire_as`](Self::try_acquire_as) for a resolved claim: a refusal is counted.
    pub(crate) fn acquire_at(&self, claim: Claim) -> Option<Permit> {
        match self.take(claim) {
            Ok(p) => Some(p),
            Err(shed) => {
                self.inner.refused(claim, shed);
                None
            }
        }
    }

    /// A slot if one is free for `claim` (a refusal is not counted here: the layer's first
    /// try before it queues).
    ///
    /// The rule: a request may take a slot while fewer than its ceiling are in flight: the
    /// limit, less the slots the levels above its own used lately and do not hold now. Of
    /// that, a request of the flow holding the most slots leaves the last `headroom` to the
    /// other flows. Past its ceiling, a partition under its guarantee is still admitted
    /// (partitions' guarantees come first, as before flows and levels).
    pub(crate) fn take(&self, claim: Claim) -> Result<Permit, Shed> {
        let inner = &self.inner;
        let part = &inner.partitions[claim.at];
        let mut total = inner.in_flight.load(Ordering::Relaxed);
        let mut shed;
        // The lane its flow takes, if it has one.
        let lane = claim.flow.map(|flow| (inner.pick(claim.level, flow), flow));
        let mut fresh = false;
        loop {
            shed = Shed::Full;
            let limit = inner.limit.load(Ordering::Relaxed);
            let ceiling = limit.saturating_sub(inner.reserve_above(claim.level, limit));
            // Kept back for the levels above on what they used a while ago: move the peaks on
            // (once), so that a level above that went quiet cannot hold slots forever.
            if total >= ceiling && total < limit && !fresh {
                fresh = true;
                if inner.peaks_stale() {
                    continue;
                }
            }
            let room = total < ceiling
                && match lane {
                    // Near the ceiling, the heaviest flow stops.
                    Some((lane, flow)) if total + inner.headroom_of(limit) >= ceiling => {
                        let heaviest = inner.heaviest(claim.level, lane, flow);
                        if heaviest {
                            shed = Shed::OverShare;
                        }
                        !heaviest
                    }
                    _ => true,
                };
            if room {
                match inner.in_flight.compare_exchange_weak(
                    total,
                    total + 1,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        part.in_flight.fetch_add(1, Ordering::AcqRel);
                        total += 1;
                        break;
                    }
                    Err(actual) => {
                        total = actual;
                        continue;
                    }
                }
            }
            // Past its ceiling: only within the partition's guarantee.
            let guaranteed = (f64::from(limit) * part.share).ceil() as u32;
            let held = part.in_flight.load(Ordering::Relaxed);
            if held >= guaranteed {
                return Err(shed);
            }
            if part
                .in_flight
                .compare_exchange_weak(held, held + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                total = inner.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
                break;
            }
            total = inner.in_flight.load(Ordering::Relaxed);
        }
        let level = &inner.levels[claim.level as usize];
        let held = level.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        level.peak.fetch_max(held, Ordering::Relaxed);
        if let Some((lane, flow)) = lane {
            let l = inner.lane(claim.level, lane);
            // The first slot in an empty lane: the flow's lane now.
            if l.held.fetch_add(1, Ordering::AcqRel) == 0 {
                l.mark.store(flow.mark, Ordering::Relaxed);
            }
        }
        part.count(Event::Admitted, &inner.name);
        level.count(ADMITTED, claim.level, &inner.name);
        Ok(Permit {
            limit: self.clone(),
            start: Instant::now(),
            in_flight: total,
            partition: claim.at,
            level: claim.level,
            lane: lane.map(|(lane, _)| lane),
            ended: false,
        })
    }

    /// Each criticality level's requests in flight and counts, lowest first.
    pub fn levels(&self) -> Vec<LevelStats> {
        (LEVELS.iter().zip(self.inner.levels.iter()))
            .map(|(&criticality, l)| LevelStats {
                criticality,
                in_flight: l.in_flight.load(Ordering::Relaxed),
                admitted: l.counts[ADMITTED].load(Ordering::Relaxed),
                rejected: l.counts[REJECTED].load(Ordering::Relaxed),
                over_share: l.counts[OVER_SHARE].load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Each partition's requests in flight and counts, the partitions given first, then
    /// `other`.
    pub fn partitions(&self) -> Vec<PartitionStats> {
        (self.inner.partitions.iter())
            .map(|p| {
                let n = |e: Event| p.counts[e as usize].load(Ordering::Relaxed);
                PartitionStats {
                    name: p.name.clone(),
                    share: p.share,
                    in_flight: p.in_flight.load(Ordering::Relaxed),
                    admitted: n(Event::Admitted),
                    rejected: n(Event::Rejected),
                    succeeded: n(Event::Succeeded),
                    dropped: n(Event::Dropped),
                    cancelled: n(Event::Cancelled),
                }
            })
            .collect()
    }

    /// The limit now.
    pub fn limit(&self) -> u32 {
        self.inner.limit.load(Ordering::Relaxed)
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> u32 {
        self.inner.in_flight.load(Ordering::Relaxed)
    }

    /// A sample of `rtt`, taken at `now` (nanoseconds from the origin).
    fn sample(&self, rtt: Duration, now: u64, in_flight: u32, dropped: bool) {
        let inner = &self.inner;
        let ns = u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX);
        if dropped {
            inner.dropped.fetch_add(1, Ordering::Relaxed);
            inner.drop_sum.fetch_add(ns, Ordering::Relaxed);
        } else {
            inner.rtt_sum.fetch_add(ns, Ordering::Relaxed);
            inner.rtt_min.fetch_min(ns, Ordering::Relaxed);
        }
        inner.max_in_flight.fetch_max(in_flight, Ordering::Relaxed);
        let samples = inner.samples.fetch_add(1, Ordering::AcqRel) + 1;
        if samples == 1 && now >= inner.window_end.load(Ordering::Relaxed) {
            // A window starts with its first sample. After a quiet spell (a server started,
            // then loaded) its end has long passed, and it would close at its
            // `min_samples`-th answer: the fastest few of the first burst, whose mean is
            // below what a request costs.
            let length = u64::try_from(inner.min_window.as_nanos()).unwrap_or(u64::MAX);
            inner
                .window_end
                .store(now.saturating_add(length), Ordering::Relaxed);
        }
        if samples >= inner.min_samples && now >= inner.window_end.load(Ordering::Relaxed) {
            // One request closes the window; the others go on.
            if let Ok(mut state) = inner.state.try_lock() {
                inner.close(&mut state, now);
            }
        }
    }
}

impl Inner {
    /// The slots kept back from `level`: what the levels above it used lately and do not hold,
    /// and, when they used any, the headroom too (a limit cut at a window's end leaves the
    /// levels above room, not only what they held).
    fn reserve_above(&self, level: Criticality, limit: u32) -> u32 {
        let (mut reserve, mut active) = (0u32, false);
        for above in &self.levels[level as usize + 1..] {
            let peak = above.recent_peak();
            let held = above.in_flight.load(Ordering::Relaxed);
            reserve = reserve.saturating_add(peak.saturating_sub(held));
            active |= peak > 0;
        }
        if active {
            reserve.saturating_add(self.headroom_of(limit))
        } else {
            reserve
        }
    }

    /// The slots the heaviest flow leaves to the others at this limit (at least 1).
    fn headroom_of(&self, limit: u32) -> u32 {
        ((f64::from(limit) * self.headroom).ceil() as u32).max(1)
    }

    /// The lane `lane` of `level`.
    fn lane(&self, level: Criticality, lane: u32) -> &Lane {
        &self.lanes[level as usize * self.per_level + lane as usize]
    }

    /// The lane `flow` takes: the one of its two it holds slots in, else an empty one (which
    /// becomes its), else the one holding fewer slots (shared with another flow).
    fn pick(&self, level: Criticality, flow: Flow) -> u32 {
        let [a, b] = flow.hand;
        let (la, lb) = (self.lane(level, a), self.lane(level, b));
        let (ha, hb) = (
            la.held.load(Ordering::Relaxed),
            lb.held.load(Ordering::Relaxed),
        );
        let mine = |l: &Lane, h: u32| h > 0 && l.mark.load(Ordering::Relaxed) == flow.mark;
        if mine(la, ha) {
            a
        } else if mine(lb, hb) {
            b
        } else if ha == 0 || ha <= hb {
            // Empty (a first), else the one holding fewer.
            a
        } else {
            b
        }
    }

    /// Whether `flow`, taking `lane`, is over its share of a limit near full: no
    /// other lane of its level holds more, and a lighter flow of its level is asking (holds
    /// slots, or was refused or queued in this window or the last): max-min, the lighter flow
    /// may grow to it first. A flow alone in its level, or tied at the top with no lighter flow
    /// asking, may take the level's room; a newcomer refused then is asking, and the heaviest
    /// leave it the headroom from then on. Lanes marked as the flow's own (it holds slots in
    /// them) are not compared.
    fn heaviest(&self, level: Criticality, lane: u32, flow: Flow) -> bool {
        let held = self.lane(level, lane).held.load(Ordering::Relaxed);
        if held == 0 {
            return false;
        }
        let recent = self.epoch.load(Ordering::Relaxed);
        let from = level as usize * self.per_level;
        let mut lighter = false;
        for (i, other) in self.lanes[from..from + self.per_level].iter().enumerate() {
            let h = other.held.load(Ordering::Relaxed);
            // Its own lanes: the one it takes, one it holds slots in, its other one if empty.
            let own = i == lane as usize
                || (h > 0 && other.mark.load(Ordering::Relaxed) == flow.mark)
                || (h == 0 && flow.hand.contains(&(i as u32)));
            if own {
                continue;
            }
            if h > held {
                return false;
            }
            if h < held && !lighter {
                let asked = other.asked.load(Ordering::Relaxed);
                lighter = h > 0 || (asked != 0 && asked >= recent);
            }
        }
        lighter
    }

    /// The levels' peaks move on: this window's becomes the last, the next starts at what is
    /// held.
    fn move_peaks(&self) {
        for level in &self.levels {
            let held = level.in_flight.load(Ordering::Relaxed);
            let peak = level.peak.swap(held, Ordering::Relaxed);
            level.last_peak.store(peak, Ordering::Relaxed);
        }
    }

    /// Moves the peaks on if no window has in a longest window's time; whether it did.
    fn peaks_stale(&self) -> bool {
        let since = Instant::now().saturating_duration_since(self.origin);
        let now = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        let at = self.peaks_at.load(Ordering::Relaxed);
        let longest = u64::try_from(self.max_window.as_nanos()).unwrap_or(u64::MAX);
        if now.saturating_sub(at) < longest {
            return false;
        }
        // One request moves them.
        if (self.peaks_at)
            .compare_exchange(at, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.epoch.fetch_add(1, Ordering::Relaxed);
            self.move_peaks();
        }
        true
    }

    /// Counts a refusal: its partition's, its level's (and the level's demand seen, so that the
    /// levels below keep room for it next time).
    fn refused(&self, claim: Claim, shed: Shed) {
        self.partitions[claim.at].count(Event::Rejected, &self.name);
        let level = &self.levels[claim.level as usize];
        level.count(REJECTED, claim.level, &self.name);
        if shed == Shed::OverShare {
            level.count(OVER_SHARE, claim.level, &self.name);
        }
        self.asking(claim);
    }

    /// A request of `claim` asks and found no slot (refused, or waiting in the queue): its level's
    /// demand seen (so that the levels below keep room for it next time), and its flow asking
    /// (so that the heaviest flow leaves it the headroom).
    fn asking(&self, claim: Claim) {
        let level = &self.levels[claim.level as usize];
        let asking = level.in_flight.load(Ordering::Relaxed).saturating_add(1);
        level.peak.fetch_max(asking, Ordering::Relaxed);
        if let Some(flow) = claim.flow {
            // The window it asked in, plus one (0 is never): asking in this window or the next;
            // on the lane it would take.
            let epoch = self.epoch.load(Ordering::Relaxed).wrapping_add(1).max(1);
            let lane = self.pick(claim.level, flow);
            (self.lane(claim.level, lane).asked).store(epoch, Ordering::Relaxed);
        }
    }

    /// The limit and its range, as gauges (when the limit is built, and at each window's end).
    #[cfg(feature = "metrics")]
    fn set_range_gauges(&self, name: &metrics::SharedString, limit: f64) {
        metrics::gauge!("tollgate_adaptive_limit", "limit" => name.clone()).set(limit);
        metrics::gauge!("tollgate_adaptive_limit_min", "limit" => name.clone())
            .set(f64::from(self.min));
        metrics::gauge!("tollgate_adaptive_limit_max", "limit" => name.clone())
            .set(f64::from(self.max));
    }

    /// Ends the window at `now`: its numbers to the algorithm, the new limit in force, the next
    /// window started.
    fn close(&self, state: &mut State, now: u64) {
        // Checked again under the lock: another request may have closed it.
        if now < self.window_end.load(Ordering::Relaxed) {
            return;
        }
        let samples = self.samples.swap(0, Ordering::AcqRel);
        if samples == 0 {
            return;
        }
        let dropped = self.dropped.swap(0, Ordering::AcqRel).min(samples);
        let sum = self.rtt_sum.swap(0, Ordering::AcqRel);
        let fastest = self.rtt_min.swap(u64::MAX, Ordering::AcqRel);
        let max_in_flight = self.max_in_flight.swap(0, Ordering::AcqRel);
        let drop_sum = self.drop_sum.swap(0, Ordering::AcqRel);
        let timed = samples - dropped;
        // The mean of the samples not dropped; of the drops when every sample was one.
        let mean = if timed > 0 {
            sum / u64::from(timed)
        } else {
            drop_sum / u64::from(samples)
        };
        let window = Window {
            rtt: Duration::from_nanos(mean),
            min_rtt: Duration::from_nanos(if fastest == u64::MAX { 0 } else { fastest }),
            max_in_flight,
            samples,
            dropped,
        };
        let next = state.algorithm.update(state.limit, &window);
        let (min, max) = (f64::from(self.min), f64::from(self.max));
        let before = state.limit;
        state.limit = if next.is_finite() {
            next.clamp(min, max)
        } else {
            state.limit
        };
        let limit = state.limit.round() as u32;
        self.limit.store(limit, Ordering::Relaxed);
        // Unless a request found them stale and moved them on at this very moment.
        let at = self.peaks_at.load(Ordering::Relaxed);
        if (self.peaks_at)
            .compare_exchange(at, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.epoch.fetch_add(1, Ordering::Relaxed);
            self.move_peaks();
        }
        // A limit that grew has room for waiters: wake one for each slot free now (a slot given
        // back wakes one too, but a queue must not wait out its deadline beside free slots).
        if let Some(queue) = &self.queue {
            let free = limit.saturating_sub(self.in_flight.load(Ordering::Acquire));
            let waiting = queue.waiting.load(Ordering::Acquire);
            for _ in 0..(free as usize).min(waiting) {
                queue.wake_one(self);
            }
        }
        // A move of a fifth or more in one window is news.
        if (state.limit - before).abs() >= before * 0.2 {
            tracing::info!(
                target: "tollgate::adaptive",
                limit = %self.name,
                from = before.round(),
                to = state.limit.round(),
                rtt_ms = window.rtt.as_secs_f64() * 1000.0,
                dropped = window.dropped,
                "adaptive limit moved"
            );
        }
        #[cfg(feature = "metrics")]
        {
            let name = metrics::SharedString::from(self.name.clone());
            self.set_range_gauges(&name, state.limit.round());
            metrics::gauge!("tollgate_adaptive_in_flight", "limit" => name.clone())
                .set(f64::from(self.in_flight.load(Ordering::Relaxed)));
            metrics::gauge!("tollgate_adaptive_rtt_seconds", "limit" => name.clone(), "kind" => "sample")
                .set(window.rtt.as_secs_f64());
            if let Some(baseline) = state.algorithm.baseline() {
                metrics::gauge!("tollgate_adaptive_rtt_seconds", "limit" => name, "kind" => "baseline")
                    .set(baseline.as_secs_f64());
            }
        }
        // The next window: twice this one's RTT, within the bounds (but for the floor while the
        // algorithm probes: a probe lasts what it needs).
        let twice = Duration::from_nanos(mean) * 2;
        let length = if state.algorithm.probing() {
            twice.min(self.max_window)
        } else {
            twice.clamp(self.min_window, self.max_window)
        };
        let length = u64::try_from(length.as_nanos()).unwrap_or(u64::MAX);
        self.window_end
            .store(now.saturating_add(length), Ordering::Relaxed);
    }
}

impl AdaptiveLimitBuilder {
    /// The limit to start at (clamped to the range).
    pub fn initial(mut self, limit: u32) -> Self {
        self.initial = limit;
        self
    }

    /// The range the limit stays in, `min` at least 1.
    pub fn range(mut self, min: u32, max: u32) -> Self {
        self.min = min;
        self.max = max;
        self
    }

    /// The algorithm that moves the limit ([`Gradient`] by default).
    pub fn algorithm(mut self, algorithm: impl Algorithm) -> Self {
        self.algorithm = Some(Box::new(algorithm));
        self.gradient = None;
        self
    }

    /// The default algorithm, [`Gradient`], with these settings (its floor is the range's
    /// minimum).
    pub fn gradient(mut self, gradient: Gradient) -> Self {
        self.gradient = Some(gradient);
        self.algorithm = None;
        self
    }

    /// A partition of the requests (a route group, a tenant's tier, a priority) with a share of
    /// the limit it is guaranteed once the limit is reached (0 to 1; the shares given sum to 1
    /// at most). Spare capacity is borrowed while the limit is not reached; at the limit a
    /// partition under its share is still admitted, one over it is refused, and requests of no
    /// partition given (`other`, with no guarantee) are shed first: give critical traffic the
    /// share it needs. At most 16 partitions; the names label the metrics.
    pub fn partition(mut self, name: &str, share: f64) -> Self {
        self.partitions.push((name.to_owned(), share));
        self
    }

    /// The name of the limit in metrics (`limit` label; `default` unless given).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// The fewest samples a window needs before it closes (at least 1).
    pub fn min_samples(mut self, samples: u32) -> Self {
        self.min_samples = samples;
        self
    }

    /// The shortest and longest a window lasts (it is twice the last window's RTT between;
    /// the first after a quiet spell lasts the shortest, from its first sample).
    pub fn window(mut self, min: Duration, max: Duration) -> Self {
        self.min_window = min;
        self.max_window = max;
        self
    }

    /// Requests over the limit wait for a slot ([`AdaptiveLimit::acquire`], and the layer's
    /// [`queue_deadline`](AdaptiveLayer::queue_deadline)), at most `max_waiting` at once (more
    /// are refused at once), served in `order` as slots are given back. Without it (the
    /// default) a request over the limit is refused at once. See `docs/adaptive.md`, "A
    /// short queue", for LIFO against FIFO, measured.
    pub fn queue(mut self, max_waiting: usize, order: QueueOrder) -> Self {
        self.queue = Some((max_waiting, order));
        self
    }

    /// How many lanes flows are hashed into, per criticality level (256 by default, 1 to
    /// 65 536); each flow into two, taking the one it holds slots in, else an empty one, else
    /// the one holding fewer. Flows that share a lane share its count and its share. A lane
    /// takes 12 bytes, for each of the 3 levels (9 KiB by default), and a request near the
    /// limit reads its level's; with a few hundred flows asking at once, more lanes keep them
    /// apart.
    pub fn flow_lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes;
        self
    }

    /// The share of the limit (0 to 0.5; 0.125 by default, at least one slot) that the flow
    /// holding the most slots leaves to lighter flows that are asking: within that many slots
    /// of its level's ceiling (the limit, less what the levels above keep back) its requests
    /// are refused, so that a lighter flow finds a slot free. A level above that is active
    /// keeps it back from the levels below as well.
    pub fn flow_headroom(mut self, share: f64) -> Self {
        self.headroom = share;
        self
    }

    /// The limit, or what is wrong with its settings.
    pub fn build(self) -> Result<AdaptiveLimit, ConfigError> {
        let bad = |option: &'static str, reason: String| ConfigError::Invalid { option, reason };
        if self.min == 0 || self.min > self.max {
            return Err(bad(
                "range",
                format!(
                    "{}..{}: the minimum must be at least 1 and at most the maximum",
                    self.min, self.max
                ),
            ));
        }
        if self.min_samples == 0 {
            return Err(bad("min_samples", "0: a window needs a sample".into()));
        }
        if self.min_window.is_zero() || self.min_window > self.max_window {
            return Err(bad(
                "window",
                format!(
                    "{:?}..{:?}: the shortest must be more than 0 and at most the longest",
                    self.min_window, self.max_window
                ),
            ));
        }
        if let Some((0, _)) = self.queue {
            return Err(bad("queue", "0 waiting: at least 1 (or no queue)".into()));
        }
        if self.lanes == 0 || self.lanes > 65_536 {
            return Err(bad(
                "flow_lanes",
                format!("{}: from 1 to 65536 lanes", self.lanes),
            ));
        }
        if !(self.headroom.is_finite() && (0.0..=0.5).contains(&self.headroom)) {
            return Err(bad(
                "flow_headroom",
                format!("{}: a share of the limit from 0 to 0.5", self.headroom),
            ));
        }
        if self.partitions.len() > 16 {
            return Err(bad(
                "partition",
                format!("{} partitions: 16 at most", self.partitions.len()),
            ));
        }
        let mut sum = 0.0;
        for (i, (name, share)) in self.partitions.iter().enumerate() {
            if !(share.is_finite() && *share > 0.0 && *share <= 1.0) {
                return Err(bad(
                    "partition",
                    format!("{name:?}: share {share} is not in (0, 1]"),
                ));
            }
            if name.is_empty()
                || name == "other"
                || self.partitions[..i].iter().any(|(n, _)| n == name)
            {
                return Err(bad(
                    "partition",
                    format!("{name:?}: names must be given once, not empty, and not `other`"),
                ));
            }
            sum += share;
        }
        if sum > 1.0 + 1e-9 {
            return Err(bad(
                "partition",
                format!("the shares sum to {sum}: at most 1"),
            ));
        }
        let partitions: Box<[Part]> = (self.partitions.iter())
            .map(|(name, share)| Part::new(name, *share))
            .chain([Part::new("other", 0.0)])
            .collect();
        let algorithm = match self.algorithm {
            Some(a) => a,
            None => Box::new(self.gradient.unwrap_or_default().floor(self.min)),
        };
        algorithm.check()?;
        let initial = self.initial.clamp(self.min, self.max);
        let min_window = u64::try_from(self.min_window.as_nanos()).unwrap_or(u64::MAX);
        let limit = AdaptiveLimit {
            inner: Arc::new(Inner {
                limit: AtomicU32::new(initial),
                in_flight: AtomicU32::new(0),
                min: self.min,
                max: self.max,
                min_samples: self.min_samples,
                min_window: self.min_window,
                max_window: self.max_window,
                origin: Instant::now(),
                window_end: AtomicU64::new(min_window),
                samples: AtomicU32::new(0),
                dropped: AtomicU32::new(0),
                rtt_sum: AtomicU64::new(0),
                rtt_min: AtomicU64::new(u64::MAX),
                max_in_flight: AtomicU32::new(0),
                drop_sum: AtomicU64::new(0),
                state: Mutex::new(State {
                    algorithm,
                    limit: f64::from(initial),
                }),
                partitions,
                name: self.name.into(),
                queue: self.queue.map(|(max, order)| Queue::new(max, order)),
                levels: [Level::new(), Level::new(), Level::new()],
                lanes: (0..self.lanes * LEVELS.len())
                    .map(|_| Lane {
                        held: AtomicU32::new(0),
                        asked: AtomicU32::new(0),
                        mark: AtomicU32::new(0),
                    })
                    .collect(),
                per_level: self.lanes,
                epoch: AtomicU32::new(0),
                peaks_at: AtomicU64::new(0),
                hasher: std::hash::RandomState::new(),
                headroom: self.headroom,
            }),
        };
        // The gauges from the start (against the recorder installed now), not only from the
        // first window's end: a dashboard shows the limit before traffic comes.
        #[cfg(feature = "metrics")]
        {
            let inner = &limit.inner;
            let name = metrics::SharedString::from(inner.name.clone());
            inner.set_range_gauges(&name, f64::from(initial));
            for part in inner.partitions.iter() {
                part.counters(&inner.name);
            }
            for (level, l) in LEVELS.iter().zip(inner.levels.iter()) {
                l.counters(*level, &inner.name);
            }
        }
        Ok(limit)
    }
}

/// The order a queue gives slots in ([`AdaptiveLimitBuilder::queue`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueOrder {
    /// The request that came last is served first: under overload the ones served are fresh
    /// (their clients still wait), and those that waited longest reach their deadline.
    Lifo,
    /// First come, first served: under overload every request waits about the whole queue.
    Fifo,
}

/// The requests waiting for a slot: each a sender its waiter listens on, by id.
struct Queue {
    max: usize,
    lifo: bool,
    /// How many wait (read without the lock by a request giving its slot back).
    waiting: AtomicUsize,
    /// The line.
    line: Mutex<Line>,
}

/// The waiters, and the order keys given so far.
struct Line {
    /// The last order key given at the back (increasing from 1), and at the front (decreasing
    /// from -1): each waiter's key is its own, and its id.
    back: i64,
    front: i64,
    waiters: Vec<Waiter>,
}

/// One request waiting: its place in the order (its id), its level and flow, and the sender it
/// listens on (dropped when a newcomer puts it out of a full line).
struct Waiter {
    order: i64,
    level: Criticality,
    flow: Option<Flow>,
    tx: tokio::sync::oneshot::Sender<()>,
}

impl Queue {
    fn new(max: usize, order: QueueOrder) -> Self {
        Queue {
            max,
            lifo: order == QueueOrder::Lifo,
            waiting: AtomicUsize::new(0),
            line: Mutex::new(Line {
                back: 0,
                front: 0,
                waiters: Vec::new(),
            }),
        }
    }

    /// How a waiter ranks for the next slot: the higher level, then the flow holding fewer
    /// slots, then the order (the newest for LIFO, the oldest for FIFO). The greatest is
    /// served first; the least is put out of a full line.
    fn rank(&self, inner: &Inner, level: Criticality, flow: Option<Flow>, order: i64) -> Rank {
        let held = flow.map_or(0, |f| {
            let lane = inner.pick(level, f);
            inner.lane(level, lane).held.load(Ordering::Relaxed)
        });
        (
            level,
            std::cmp::Reverse(held),
            if self.lifo { order } else { -order },
        )
    }

    /// Joins the line (`first`: served next among its equals, for a waiter woken whose slot
    /// was taken), or `None` when it is full of waiters who rank as high as it.
    fn join(
        &self,
        first: bool,
        claim: Claim,
        inner: &Inner,
    ) -> Option<(i64, tokio::sync::oneshot::Receiver<()>)> {
        let mut line = self.line.lock().unwrap_or_else(|e| e.into_inner());
        // Served next among equals: the back (LIFO), the front (FIFO); a newcomer at the back.
        let order = if first && !self.lifo {
            line.front -= 1;
            line.front
        } else {
            line.back += 1;
            line.back
        };
        if line.waiters.len() >= self.max {
            // Full: the newcomer takes the place of the lowest-ranked waiter, if it ranks
            // above it by level or by its flow's slots (never by its order alone).
            let mine = self.rank(inner, claim.level, claim.flow, order);
            let (at, lowest) = (line.waiters.iter().enumerate())
                .map(|(i, w)| (i, self.rank(inner, w.level, w.flow, w.order)))
                .min_by(|a, b| a.1.cmp(&b.1))?;
            if (mine.0, mine.1) <= (lowest.0, lowest.1) {
                return None;
            }
            // Its sender dropped: the waiter sees it and is refused.
            line.waiters.swap_remove(at);
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        line.waiters.push(Waiter {
            order,
            level: claim.level,
            flow: claim.flow,
            tx,
        });
        self.waiting.fetch_add(1, Ordering::AcqRel);
        Some((order, rx))
    }

    /// Wakes the highest-ranked waiter that still waits.
    fn wake_one(&self, inner: &Inner) {
        self.wake(inner, None);
    }

    /// Wakes the highest-ranked waiter that still waits and ranks below `claim` by level and
    /// its flow's slots (a wake passed down the line, which cannot come back up).
    fn wake_below(&self, inner: &Inner, claim: Claim) {
        let mine = self.rank(inner, claim.level, claim.flow, 0);
        self.wake(inner, Some((mine.0, mine.1)));
    }

    fn wake(&self, inner: &Inner, below: Option<(Criticality, std::cmp::Reverse<u32>)>) {
        let mut line = self.line.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let best = (line.waiters.iter().enumerate())
                .map(|(i, w)| (i, self.rank(inner, w.level, w.flow, w.order)))
                .filter(|(_, r)| below.is_none_or(|b| (r.0, r.1) < b))
                .max_by(|a, b| a.1.cmp(&b.1));
            let Some((at, _)) = best else {
                return;
            };
            let waiter = line.waiters.swap_remove(at);
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            if waiter.tx.send(()).is_ok() {
                return;
            }
        }
    }
}

/// A waiter's rank: level, fewer slots held by its flow, order.
type Rank = (Criticality, std::cmp::Reverse<u32>, i64);

/// Leaves the line when dropped, if still in it.
/// A waiter that stops waiting (a slot, its deadline, its future dropped) without having seen
/// a wake sent to it passes that wake on, so that a slot given back is never left to nobody.
struct Leave<'a> {
    inner: &'a Inner,
    queue: &'a Queue,
    id: i64,
    /// Whether this waiter saw the wake it was sent.
    woken: bool,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut line = self.queue.line.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = line.waiters.iter().position(|w| w.order == self.id) {
            line.waiters.swap_remove(at);
            self.queue.waiting.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        drop(line);
        // Out of the line without an entry: a request ending sent this waiter its slot's wake.
        let inner = self.inner;
        if !self.woken
            && inner.in_flight.load(Ordering::Acquire) < inner.limit.load(Ordering::Relaxed)
        {
            self.queue.wake_one(inner);
        }
    }
}

/// One admitted request's slot. End it with [`success`](Self::success) (a sample of its
/// round-trip time) or [`dropped`](Self::dropped) (a sign of overload); dropped without
/// either (the request was cancelled, or failed before any real work), it gives its slot back
/// and is no sample.
#[derive(Debug)]
#[must_use = "a permit holds a slot until it is ended or dropped"]
pub struct Permit {
    limit: AdaptiveLimit,
    start: Instant,
    in_flight: u32,
    partition: usize,
    level: Criticality,
    lane: Option<u32>,
    ended: bool,
}

impl Permit {
    /// The request succeeded: its time since admission is a sample.
    pub fn success(mut self) {
        self.end(false);
    }

    /// The request showed overload (a timeout, an overload error, a 429 or 503 upstream).
    pub fn dropped(mut self) {
        self.end(true);
    }

    /// Requests in flight when this one was admitted, itself included.
    pub fn in_flight_at_start(&self) -> u32 {
        self.in_flight
    }

    fn end(&mut self, dropped: bool) {
        self.ended = true;
        self.release();
        let event = if dropped {
            Event::Dropped
        } else {
            Event::Succeeded
        };
        let inner = &self.limit.inner;
        inner.partitions[self.partition].count(event, &inner.name);
        // One clock read: the sample's end is also the window's time.
        let now = Instant::now();
        let since_origin = now.saturating_duration_since(inner.origin);
        let ns = u64::try_from(since_origin.as_nanos()).unwrap_or(u64::MAX);
        self.limit.sample(
            now.saturating_duration_since(self.start),
            ns,
            self.in_flight,
            dropped,
        );
    }

    fn release(&self) {
        let inner = &self.limit.inner;
        inner.partitions[self.partition]
            .in_flight
            .fetch_sub(1, Ordering::AcqRel);
        inner.levels[self.level as usize]
            .in_flight
            .fetch_sub(1, Ordering::AcqRel);
        if let Some(lane) = self.lane {
            (inner.lane(self.level, lane).held).fetch_sub(1, Ordering::AcqRel);
        }
        inner.in_flight.fetch_sub(1, Ordering::AcqRel);
        // The slot to the next in line, if any waits (the fence: see `acquire_waiting`).
        if let Some(queue) = &inner.queue
            && {
                std::sync::atomic::fence(Ordering::SeqCst);
                queue.waiting.load(Ordering::Acquire) > 0
            }
        {
            queue.wake_one(inner);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.ended {
            self.release();
            let inner = &self.limit.inner;
            inner.partitions[self.partition].count(Event::Cancelled, &inner.name);
        }
    }
}
