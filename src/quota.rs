//! Quotas: how many requests per period, and how big a burst.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::error::ConfigError;

/// A rate and a burst size: `Quota::per_second(10).burst(20)` allows a sustained 10 requests per
/// second and up to 20 at once after a quiet spell.
///
/// Rates read as what they do: `per_second(100)` is one hundred per second. The quota is a
/// [GCRA] (generic cell rate algorithm) bucket: it holds `burst` units, one unit comes back every
/// `period / count`, and a request of cost `c` passes when `c` units are in the bucket.
///
/// Zero counts, zero bursts and zero periods are not panics: they are reported by
/// [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build) as a [`ConfigError`].
///
/// ```
/// use std::time::Duration;
/// use tollgate::Quota;
///
/// let q = Quota::per_second(5).burst(10);
/// assert_eq!(q.burst_size(), 10);
/// assert_eq!(q.emission_interval(), Some(Duration::from_millis(200)));
///
/// // 3 requests every 10 seconds, burst defaults to the count.
/// let q = Quota::new(3, Duration::from_secs(10));
/// assert_eq!(q.burst_size(), 3);
/// ```
///
/// [GCRA]: https://en.wikipedia.org/wiki/Generic_cell_rate_algorithm
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quota {
    count: u32,
    period: Duration,
    burst: Option<u32>,
    algorithm: Algorithm,
    /// A sliding window's sub-window length, as given (checked by `params`).
    resolution: Option<Duration>,
    /// [`LEASED`]: `period` is a concurrent quota's lease (set by `concurrent` and `lease`;
    /// checked by `params`); [`BYTES`]: the quota counts bytes of content (`bytes`), for the
    /// `RateLimit-Policy` unit. One byte, so that `Quota` stays small to copy.
    flags: u8,
    name: Option<QuotaName>,
    /// How long a key is refused once this quota refuses it (`block_for`), in ns (a zero block
    /// is kept as 1 ns, which validation refuses as it does any block under a millisecond;
    /// one beyond `u64` ns as `u64::MAX`, refused as longer than a year): 8 bytes, so that
    /// `Quota` stays small to copy.
    block_ns: Option<std::num::NonZeroU64>,
}

/// [`Quota`]'s flag: its period is a concurrent quota's lease.
const LEASED: u8 = 1;
/// [`Quota`]'s flag: it counts bytes of content.
const BYTES: u8 = 2;

/// How a quota counts (see `docs/algorithms.md` for the three side by side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// A GCRA bucket (the default): it holds `burst` units, and one comes back every
    /// `period / count`. Smooth: no window edges.
    #[default]
    Gcra,
    /// A fixed window: a counter per key that starts from zero at each window boundary,
    /// aligned to the Unix epoch ("5 000 per hour, resets on the hour"). Up to twice the
    /// limit can pass around a boundary (the end of one window and the start of the next).
    FixedWindow,
    /// A sliding-window counter: the count of the last `period`, estimated from the counts of
    /// epoch-aligned sub-windows, the oldest weighted by how much of it is still inside the
    /// window. With one sub-window (the default) it is the two-counter form.
    SlidingWindow,
    /// Requests in flight: a slot per request, held from admission until its response body
    /// ends or is dropped ([`Quota::concurrent`]). Not a rate: its count is the number of
    /// slots, and its period the longest a slot is held in a shared store (its lease).
    Concurrent,
}

/// A quota's own name, inline so that [`Quota`] stays `Copy`: up to
/// [`Quota::MAX_NAME_LEN`] bytes; a longer name is kept cut short and marked, and
/// `Policy::validate` reports it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct QuotaName {
    len: u8,
    too_long: bool,
    bytes: [u8; Quota::MAX_NAME_LEN],
}

impl QuotaName {
    fn new(name: &str) -> Self {
        let mut bytes = [0; Quota::MAX_NAME_LEN];
        // Cut at a character boundary, so that the stored name is still a `str`.
        let mut len = name.len().min(Quota::MAX_NAME_LEN);
        while !name.is_char_boundary(len) {
            len -= 1;
        }
        bytes[..len].copy_from_slice(&name.as_bytes()[..len]);
        QuotaName {
            len: len as u8,
            too_long: len < name.len(),
            bytes,
        }
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl std::fmt::Debug for QuotaName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())?;
        if self.too_long {
            f.write_str("…")?;
        }
        Ok(())
    }
}

impl Quota {
    /// `count` requests per `period`; the burst defaults to `count`.
    pub const fn new(count: u32, period: Duration) -> Self {
        Quota {
            count,
            period,
            burst: None,
            algorithm: Algorithm::Gcra,
            resolution: None,
            flags: 0,
            name: None,
            block_ns: None,
        }
    }

    /// A penalty on this quota: once it refuses a key, the key is refused (by the whole policy)
    /// for `duration`, whatever the quotas hold; refusals meanwhile do not extend it, and
    /// `Retry-After` is the block's end. Refusals by the policy's other quotas start no block.
    /// [`Policy::block_for`](crate::Policy::block_for) blocks on every quota's refusal
    /// instead. The quotas of one policy that block, block for the same duration (checked
    /// when the layer is built). In the configuration syntax: `"5/15min fixed block 1h"`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Policy, Quota};
    ///
    /// // Bursts of 10/s are refused and that is all; past 1 000 a day, a key is shut out
    /// // for an hour.
    /// let api = Policy::new("api", Quota::per_second(10))
    ///     .and(Quota::per_day(1000).fixed_window().block_for(Duration::from_secs(3600)));
    /// assert_eq!(api.quotas()[1].block(), Some(Duration::from_secs(3600)));
    /// assert_eq!(api.quotas()[1].to_string(), "1000/d fixed block 1h");
    /// ```
    pub const fn block_for(mut self, duration: Duration) -> Self {
        let ns = duration.as_nanos();
        let ns = if ns > u64::MAX as u128 {
            u64::MAX
        } else {
            ns as u64
        };
        self.block_ns = Some(match std::num::NonZeroU64::new(ns) {
            Some(ns) => ns,
            None => std::num::NonZeroU64::MIN,
        });
        self
    }

    /// The penalty set with [`block_for`](Self::block_for), if any.
    pub const fn block(&self) -> Option<Duration> {
        match self.block_ns {
            Some(ns) => Some(Duration::from_nanos(ns.get())),
            None => None,
        }
    }

    /// At most `slots` requests in flight per key: a request holds a slot from admission until
    /// its response body ends (or is dropped, or the request is cancelled), and a request that
    /// finds every slot taken is refused (`429`, `Retry-After: 1`). A slot is one request
    /// whatever the request's cost.
    ///
    /// In a shared store a slot is a lease that expires after [`lease`](Self::lease)
    /// ([`DEFAULT_LEASE`](Self::DEFAULT_LEASE) unless set), so that an instance that dies
    /// cannot hold slots longer than that; the local backend holds it exactly as long as the
    /// request. Combines with rate quotas in one policy (at most one concurrent quota per
    /// policy). The `RateLimit-Policy` field says `qu="concurrent-requests"`, and `RateLimit`'s
    /// `r` is the slots left.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Policy, Quota};
    ///
    /// // At most 2 exports at once per key, and 100 an hour.
    /// let policy = Policy::new("exports", Quota::concurrent(2)).and(Quota::per_hour(100));
    /// assert!(policy.validate().is_ok());
    /// assert_eq!("2 concurrent".parse(), Ok(Quota::concurrent(2)));
    /// assert_eq!(
    ///     "2 concurrent lease 30s".parse(),
    ///     Ok(Quota::concurrent(2).lease(Duration::from_secs(30)))
    /// );
    /// ```
    pub const fn concurrent(slots: u32) -> Self {
        let mut q = Self::new(slots, Self::DEFAULT_LEASE);
        q.algorithm = Algorithm::Concurrent;
        q.flags |= LEASED;
        q
    }

    /// How long a [`concurrent`](Self::concurrent) quota's slot is held at most in a shared
    /// store: a slot whose request still runs after this is given back (and the request's end
    /// then gives back nothing more). Whole milliseconds, at least one. Only for concurrent
    /// quotas.
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.period = lease;
        self.flags |= LEASED;
        self
    }

    /// Counts bytes of content rather than requests: the `RateLimit-Policy` field says
    /// `qu="content-bytes"` for it (the IETF draft's unit). The quota counts whatever each
    /// request costs: pair it with a cost in bytes, e.g.
    /// [`CostFrom::response_bytes`](crate::settle::CostFrom::response_bytes) for the bytes a
    /// response sends, or a [`cost_fn`](crate::Policy::cost_fn) reading a request's
    /// `Content-Length`. In the quota syntax, the word `bytes`: `"10000000/h bytes"`.
    ///
    /// ```
    /// use tollgate::settle::CostFrom;
    /// use tollgate::{Policy, Quota};
    ///
    /// // 10 MB an hour per key, charged what each response sends.
    /// let downloads = Policy::new("downloads", Quota::per_hour(10_000_000).bytes())
    ///     .cost_from(CostFrom::response_bytes());
    /// assert_eq!("10000000/h bytes".parse(), Ok(Quota::per_hour(10_000_000).bytes()));
    /// # assert!(downloads.validate().is_ok());
    /// ```
    pub const fn bytes(mut self) -> Self {
        self.flags |= BYTES;
        self
    }

    /// Whether the quota counts bytes of content ([`bytes`](Self::bytes)).
    pub const fn counts_bytes(&self) -> bool {
        self.flags & BYTES != 0
    }

    /// The lease of a [`concurrent`](Self::concurrent) quota's slot when none is set: five
    /// minutes.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(300);

    /// This quota's share on one of `instances` instances sharing it: its count and burst (a
    /// concurrent quota's slots) divided by `instances`, rounded up (so at least 1 of a valid
    /// quota). The fleet together admits at most the quota rounded up to a multiple of
    /// `instances`.
    #[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
    pub(crate) const fn share(mut self, instances: u32) -> Self {
        if instances > 1 {
            self.count = self.count.div_ceil(instances);
            if let Some(burst) = self.burst {
                self.burst = Some(burst.div_ceil(instances));
            }
        }
        self
    }

    /// `count` requests per second.
    pub const fn per_second(count: u32) -> Self {
        Self::new(count, Duration::from_secs(1))
    }

    /// `count` requests per minute.
    pub const fn per_minute(count: u32) -> Self {
        Self::new(count, Duration::from_secs(60))
    }

    /// `count` requests per hour.
    pub const fn per_hour(count: u32) -> Self {
        Self::new(count, Duration::from_secs(3600))
    }

    /// `count` requests per day (86 400 s).
    pub const fn per_day(count: u32) -> Self {
        Self::new(count, Duration::from_secs(86_400))
    }

    /// Sets the bucket size: how many requests may pass at once after a quiet spell (GCRA
    /// only: a window's limit is its count, and a burst on a window is refused by `build()`).
    pub const fn burst(mut self, burst: u32) -> Self {
        self.burst = Some(burst);
        self
    }

    /// Counts in fixed windows of `period`, aligned to the Unix epoch: `count` requests per
    /// window, the counter back to zero at each boundary ([`Algorithm::FixedWindow`]).
    ///
    /// ```
    /// use tollgate::{Policy, Quota};
    ///
    /// // 10/s burst 20, and at most 10 000 a day, resetting at 00:00 UTC.
    /// let policy = Policy::new("api", Quota::per_second(10).burst(20))
    ///     .and(Quota::per_day(10_000).fixed_window());
    /// assert!(policy.validate().is_ok());
    /// assert_eq!("10000/d fixed".parse(), Ok(Quota::per_day(10_000).fixed_window()));
    /// ```
    pub const fn fixed_window(mut self) -> Self {
        self.algorithm = Algorithm::FixedWindow;
        self
    }

    /// Counts in a sliding window of `period` ([`Algorithm::SlidingWindow`]), kept as one
    /// sub-window unless [`resolution`](Self::resolution) says otherwise.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::Quota;
    ///
    /// // 100 per minute, kept as twelve 5-second counts.
    /// let q = Quota::per_minute(100).sliding_window().resolution(Duration::from_secs(5));
    /// assert_eq!("100/min sliding 5s".parse(), Ok(q));
    /// ```
    pub const fn sliding_window(mut self) -> Self {
        self.algorithm = Algorithm::SlidingWindow;
        self
    }

    /// A sliding window's sub-window length: the window is kept as `period / resolution`
    /// counts (which must be a whole number, at most [`MAX_SUB_WINDOWS`](Self::MAX_SUB_WINDOWS)),
    /// the oldest weighted by its overlap with the window. Finer is closer to an exact sliding
    /// log and costs one counter per sub-window per key. Only for sliding windows.
    pub const fn resolution(mut self, resolution: Duration) -> Self {
        self.resolution = Some(resolution);
        self
    }

    /// The most sub-windows a sliding window may be kept as.
    pub const MAX_SUB_WINDOWS: u32 = 1000;

    /// How this quota counts.
    pub const fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The sub-window length given with [`resolution`](Self::resolution), if any.
    pub const fn sub_window(&self) -> Option<Duration> {
        self.resolution
    }

    /// The longest quota name, in bytes.
    pub const MAX_NAME_LEN: usize = 32;

    /// Names this quota in the `RateLimit` headers. Without a name, a policy with one quota uses
    /// the policy's name, and a policy with several uses `<policy>-<index>`.
    ///
    /// Any string will do here (from a configuration file, say); a name that is not 1 to
    /// [`MAX_NAME_LEN`](Self::MAX_NAME_LEN) visible ASCII characters without `"` or `\` is
    /// reported by `build()`. In TOML / YAML / JSON, a named quota is written as a table:
    /// `{ rate = "100/h", name = "hourly" }`.
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(QuotaName::new(name));
        self
    }

    /// The number of requests per period.
    pub const fn count(&self) -> u32 {
        self.count
    }

    /// The period over which [`count`](Self::count) requests are allowed; for a
    /// [`concurrent`](Self::concurrent) quota, its lease.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The bucket size: the explicit burst, or the count when none was set.
    pub const fn burst_size(&self) -> u32 {
        match self.burst {
            Some(b) => b,
            None => self.count,
        }
    }

    /// The name given with [`named`](Self::named), if any.
    pub fn name(&self) -> Option<&str> {
        self.name.as_ref().map(QuotaName::as_str)
    }

    /// Whether the name given was longer than [`MAX_NAME_LEN`](Self::MAX_NAME_LEN) (it is
    /// then refused by `build()`).
    pub(crate) fn name_too_long(&self) -> bool {
        self.name.is_some_and(|n| n.too_long)
    }

    /// Time for one unit to come back (`period / count`), or `None` when the count is zero.
    pub fn emission_interval(&self) -> Option<Duration> {
        if self.count == 0 {
            None
        } else {
            Some(self.period / self.count)
        }
    }

    /// Checks the quota and returns its parameters in integer nanoseconds.
    pub(crate) fn params(&self, policy: &str) -> Result<QuotaParams, ConfigError> {
        let bad = |reason: &'static str| ConfigError::InvalidQuota {
            policy: policy.to_owned(),
            quota: Box::new(*self),
            reason,
        };
        if self.count == 0 {
            return Err(bad("the count is zero; use a positive number of requests"));
        }
        if self.algorithm == Algorithm::Concurrent {
            return self.concurrent_params(bad);
        }
        if self.flags & LEASED != 0 {
            return Err(bad(
                "a lease is only for concurrent quotas, and a concurrent quota is not a window \
                 (`Quota::concurrent(n)`, without `fixed_window` or `sliding_window`)",
            ));
        }
        if self.period.is_zero() {
            return Err(bad("the period is zero"));
        }
        if self.algorithm != Algorithm::Gcra {
            return self.window_params(bad);
        }
        if self.resolution.is_some() {
            return Err(bad(
                "a resolution is only for sliding windows (add `.sliding_window()`)",
            ));
        }
        let burst = NonZeroU32::new(self.burst_size()).ok_or_else(|| bad("the burst is zero"))?;
        let emission = self.period.as_nanos() / u128::from(self.count);
        if emission == 0 {
            return Err(bad(
                "more than one request per nanosecond cannot be represented",
            ));
        }
        // The bucket's time span (burst * emission) is capped well inside u64 nanoseconds
        // (~584 years): the backends add it to the current time, and to one more emission
        // interval, and must never overflow.
        const MAX_WINDOW_NS: u128 = 100 * 365 * 24 * 3600 * 1_000_000_000;
        if emission * u128::from(burst.get()) > MAX_WINDOW_NS {
            return Err(bad(
                "burst * period / count is longer than 100 years, the longest bucket supported",
            ));
        }
        // Fits: at most MAX_WINDOW_NS.
        let emission = u64::try_from(emission).map_err(|_| bad("the period is too long"))?;
        Ok(QuotaParams {
            emission_ns: emission,
            burst,
            kind: QuotaKind::Gcra,
        })
    }

    /// The parameters of a concurrent quota: its slots and its lease, in whole milliseconds.
    fn concurrent_params(
        &self,
        bad: impl Fn(&'static str) -> ConfigError,
    ) -> Result<QuotaParams, ConfigError> {
        if self.burst.is_some() {
            return Err(bad(
                "a burst is only for GCRA quotas: a concurrent quota's limit is its slots",
            ));
        }
        if self.resolution.is_some() {
            return Err(bad("a resolution is only for sliding windows"));
        }
        if self.counts_bytes() {
            return Err(bad(
                "a concurrent quota counts requests in flight, not bytes",
            ));
        }
        let ns = self.period.as_nanos();
        if ns == 0 || !ns.is_multiple_of(1_000_000) {
            return Err(bad(
                "a lease must be a positive whole number of milliseconds",
            ));
        }
        const MAX_LEASE_MS: u128 = 365 * 24 * 3600 * 1000;
        if ns / 1_000_000 > MAX_LEASE_MS {
            return Err(bad(
                "the lease is longer than a year, the longest supported",
            ));
        }
        let slots = NonZeroU32::new(self.count).ok_or_else(|| bad("the count is zero"))?;
        Ok(QuotaParams {
            emission_ns: u64::try_from(ns).unwrap_or(u64::MAX),
            burst: slots,
            kind: QuotaKind::Concurrent {
                lease_ms: (ns / 1_000_000) as u64,
            },
        })
    }

    /// The parameters of a fixed or sliding window, in whole microseconds.
    fn window_params(
        &self,
        bad: impl Fn(&'static str) -> ConfigError,
    ) -> Result<QuotaParams, ConfigError> {
        if self.burst.is_some() {
            return Err(bad(
                "a burst is only for GCRA quotas: a window's limit is its count",
            ));
        }
        let limit = NonZeroU32::new(self.count).ok_or_else(|| bad("the count is zero"))?;
        let ns = self.period.as_nanos();
        if !ns.is_multiple_of(1000) {
            return Err(bad("a window must be a whole number of microseconds"));
        }
        const MAX_WINDOW_US: u128 = 100 * 365 * 24 * 3600 * 1_000_000;
        let window_us = ns / 1000;
        if window_us > MAX_WINDOW_US {
            return Err(bad(
                "the window is longer than 100 years, the longest supported",
            ));
        }
        let window_us = window_us as u64;
        let emission_ns = u64::try_from(ns / u128::from(self.count))
            .unwrap_or(u64::MAX)
            .max(1);
        let kind = match self.algorithm {
            Algorithm::SlidingWindow => {
                let slice_us = match self.resolution {
                    None => window_us,
                    Some(r) => {
                        let r = r.as_nanos();
                        if r == 0 || !r.is_multiple_of(1000) {
                            return Err(bad(
                                "the resolution must be a positive whole number of microseconds",
                            ));
                        }
                        // Beyond u64 microseconds is beyond the window (at most a century).
                        let r = u64::try_from(r / 1000).unwrap_or(u64::MAX);
                        if r > window_us || !window_us.is_multiple_of(r) {
                            return Err(bad("the resolution must divide the window evenly"));
                        }
                        r
                    }
                };
                let slices = u32::try_from(window_us / slice_us).unwrap_or(u32::MAX);
                if slices > Self::MAX_SUB_WINDOWS {
                    return Err(bad(
                        "more sub-windows than Quota::MAX_SUB_WINDOWS (1000); use a coarser resolution",
                    ));
                }
                QuotaKind::SlidingWindow { slice_us, slices }
            }
            _ => {
                if self.resolution.is_some() {
                    return Err(bad(
                        "a resolution is only for sliding windows (use `.sliding_window()`)",
                    ));
                }
                QuotaKind::FixedWindow { window_us }
            }
        };
        Ok(QuotaParams {
            emission_ns,
            burst: limit,
            kind,
        })
    }
}

/// A validated quota in integer time units, as backends use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuotaParams {
    /// Nanoseconds for one unit to come back (`period / count`), at least 1. For a window,
    /// its length over its limit (informative).
    pub emission_ns: u64,
    /// Bucket size in units (GCRA), or a window's limit; at least 1.
    pub burst: NonZeroU32,
    /// How the quota counts, with the algorithm's own parameters.
    pub kind: QuotaKind,
}

/// The algorithm of validated [`QuotaParams`], with its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QuotaKind {
    /// A GCRA bucket of `burst` units, one back every `emission_ns`.
    Gcra,
    /// A fixed window of `window_us` microseconds, aligned to the Unix epoch.
    FixedWindow {
        /// The window's length in microseconds.
        window_us: u64,
    },
    /// A sliding window of `slices * slice_us` microseconds, kept as `slices` epoch-aligned
    /// sub-windows of `slice_us`.
    SlidingWindow {
        /// One sub-window's length in microseconds.
        slice_us: u64,
        /// How many sub-windows make the window (1 to [`Quota::MAX_SUB_WINDOWS`]).
        slices: u32,
    },
    /// Requests in flight: `burst` slots, each held as a lease of at most `lease_ms`
    /// milliseconds in a shared store ([`Quota::concurrent`]).
    Concurrent {
        /// The longest a slot is held, in milliseconds.
        lease_ms: u64,
    },
}

impl QuotaParams {
    /// A GCRA quota's parameters.
    pub const fn gcra(emission_ns: u64, burst: NonZeroU32) -> Self {
        QuotaParams {
            emission_ns,
            burst,
            kind: QuotaKind::Gcra,
        }
    }

    /// The quota's window: for GCRA the time for an empty bucket to fill (`burst *
    /// emission`), for a window its length.
    pub fn window(&self) -> Duration {
        match self.kind {
            QuotaKind::Gcra => Duration::from_nanos(self.emission_ns * u64::from(self.burst.get())),
            QuotaKind::FixedWindow { window_us } => Duration::from_micros(window_us),
            QuotaKind::SlidingWindow { slice_us, slices } => {
                Duration::from_micros(slice_us * u64::from(slices))
            }
            QuotaKind::Concurrent { lease_ms } => Duration::from_millis(lease_ms),
        }
    }

    /// Whether this is a [`concurrent`](Quota::concurrent) quota (requests in flight).
    #[inline]
    pub fn is_concurrent(&self) -> bool {
        matches!(self.kind, QuotaKind::Concurrent { .. })
    }

    /// Time for one unit to come back.
    pub fn emission_interval(&self) -> Duration {
        Duration::from_nanos(self.emission_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_what_they_do() {
        let p = Quota::per_second(100).params("p").unwrap();
        assert_eq!(p.emission_ns, 10_000_000);
        assert_eq!(p.burst.get(), 100);
        let p = Quota::per_hour(1000).burst(5).params("p").unwrap();
        assert_eq!(p.emission_ns, 3_600_000_000);
        assert_eq!(p.burst.get(), 5);
    }

    #[test]
    fn zero_values_are_errors() {
        for q in [
            Quota::per_second(0),
            Quota::per_second(1).burst(0),
            Quota::new(1, Duration::ZERO),
            Quota::new(u32::MAX, Duration::from_nanos(1)),
        ] {
            let err = q.params("api").unwrap_err().to_string();
            assert!(err.contains("api"), "{err}");
        }
    }

    #[test]
    fn meaningless_combinations_are_errors_naming_the_policy_and_quota() {
        for (q, what) in [
            (Quota::per_hour(5000).fixed_window().burst(10), "burst"),
            (Quota::per_hour(5000).sliding_window().burst(10), "burst"),
            (
                Quota::per_second(5).resolution(Duration::from_millis(100)),
                "resolution",
            ),
            (
                Quota::per_second(5)
                    .fixed_window()
                    .resolution(Duration::from_millis(100)),
                "resolution",
            ),
            (
                Quota::per_minute(5)
                    .sliding_window()
                    .resolution(Duration::from_secs(7)),
                "divide",
            ),
            (
                Quota::per_minute(5)
                    .sliding_window()
                    .resolution(Duration::from_millis(10)),
                "sub-windows",
            ),
            (
                Quota::new(5, Duration::from_nanos(1500)).fixed_window(),
                "microseconds",
            ),
        ] {
            let err = q.params("api").unwrap_err().to_string();
            assert!(err.contains("policy `api`"), "{err}");
            assert!(err.contains(&q.to_string()), "{err}");
            assert!(err.contains(what), "{q}: {err}");
        }
        let p = Quota::per_minute(100)
            .sliding_window()
            .resolution(Duration::from_secs(5))
            .params("p")
            .unwrap();
        assert_eq!(
            p.kind,
            QuotaKind::SlidingWindow {
                slice_us: 5_000_000,
                slices: 12
            }
        );
        assert_eq!(p.window(), Duration::from_secs(60));
        assert_eq!(p.burst.get(), 100);
        let p = Quota::per_day(3).fixed_window().params("p").unwrap();
        assert_eq!(
            p.kind,
            QuotaKind::FixedWindow {
                window_us: 86_400_000_000
            }
        );
    }

    #[test]
    fn names_are_any_string_and_quotas_stay_copy() {
        let owned = String::from("hourly");
        let q = Quota::per_hour(100).named(&owned);
        drop(owned);
        let copy = q;
        assert_eq!(q.name(), Some("hourly"));
        assert_eq!(copy, q);
        let long = "n".repeat(Quota::MAX_NAME_LEN + 1);
        assert!(Quota::per_hour(1).named(&long).name_too_long());
        assert!(!Quota::per_hour(1).named(&long[1..]).name_too_long());
    }

    #[cfg(feature = "serde")]
    #[test]
    fn names_survive_configuration_files() {
        let q: Quota = serde_json::from_str(r#"{"rate":"100/h burst 5","name":"hourly"}"#).unwrap();
        assert_eq!(q, Quota::per_hour(100).burst(5).named("hourly"));
        assert_eq!(
            serde_json::to_string(&q).unwrap(),
            r#"{"rate":"100/h burst 5","name":"hourly"}"#
        );
        let blocking: Quota = serde_json::from_str(r#""1000/d fixed block 1h""#).unwrap();
        assert_eq!(blocking.block(), Some(Duration::from_secs(3600)));
        assert_eq!(
            serde_json::to_string(&blocking).unwrap(),
            r#""1000/d fixed block 1h""#
        );
        let plain: Quota = serde_json::from_str(r#""5/s""#).unwrap();
        assert_eq!(serde_json::to_string(&plain).unwrap(), r#""5/s""#);
        #[derive(serde::Deserialize)]
        struct File {
            quotas: Vec<Quota>,
        }
        let f: File =
            toml::from_str(r#"quotas = ["5/s burst 10", { rate = "1000/h", name = "hourly" }]"#)
                .unwrap();
        assert_eq!(f.quotas[1].name(), Some("hourly"));
        assert_eq!(f.quotas[0].name(), None);
        assert!(
            serde_json::from_str::<Quota>(r#"{"rate":"1/s","nmae":"x"}"#).is_err(),
            "unknown fields are errors"
        );
        let f: File = toml::from_str(
            r#"quotas = ["5000/h fixed", "100/min sliding 5s",
                { rate = "100/min", algorithm = "sliding", resolution = "5s", name = "m" },
                { rate = "1/d", algorithm = "fixed" }]"#,
        )
        .unwrap();
        let sliding = Quota::per_minute(100)
            .sliding_window()
            .resolution(Duration::from_secs(5));
        assert_eq!(f.quotas[0], Quota::per_hour(5000).fixed_window());
        assert_eq!(f.quotas[1], sliding);
        assert_eq!(f.quotas[2], sliding.named("m"));
        assert_eq!(f.quotas[3], Quota::per_day(1).fixed_window());
        assert_eq!(
            serde_json::from_str::<Quota>(r#"{"rate":"100/min sliding","resolution":"5s"}"#)
                .unwrap(),
            sliding
        );
        for bad in [
            r#"{"rate":"1/s fixed","algorithm":"sliding"}"#,
            r#"{"rate":"1/s","resolution":"5s"}"#,
            r#"{"rate":"1/s","algorithm":"leaky"}"#,
        ] {
            assert!(serde_json::from_str::<Quota>(bad).is_err(), "{bad}");
        }
        assert_eq!(
            serde_json::to_string(&sliding).unwrap(),
            r#""100/min sliding 5s""#
        );
    }

    #[test]
    fn buckets_longer_than_a_century_are_errors() {
        let year = Duration::from_secs(365 * 24 * 3600);
        assert!(Quota::new(1, year * 100).params("p").is_ok());
        assert!(Quota::new(2, year * 100).burst(2).params("p").is_ok());
        for q in [
            Quota::new(1, year * 101),
            Quota::new(1, year * 60).burst(2),
            Quota::new(1, Duration::from_nanos(u64::MAX / 2)).burst(2),
            Quota::new(1, Duration::MAX),
        ] {
            let err = q.params("p").unwrap_err().to_string();
            assert!(err.contains("100 years"), "{q:?}: {err}");
        }
    }
}

/// Parses `"100/s"`, `"1000/h"`, `"5/min burst 10"`, `"3/10s"`, `"10/500ms"`: a count, a slash,
/// a period (an optional number and a unit: `ms`, `s`, `m`/`min`, `h`, `d`, or their long
/// names), an optional `burst N`, and an optional algorithm: `fixed`, `sliding` with an optional
/// resolution (`sliding 5s`), or `gcra` (the default).
///
/// ```
/// use std::time::Duration;
/// use tollgate::Quota;
///
/// assert_eq!("100/s".parse(), Ok(Quota::per_second(100)));
/// assert_eq!("5/min burst 10".parse(), Ok(Quota::per_minute(5).burst(10)));
/// assert_eq!("3/10s".parse(), Ok(Quota::new(3, Duration::from_secs(10))));
/// assert_eq!("5000/h fixed".parse(), Ok(Quota::per_hour(5000).fixed_window()));
/// assert_eq!("100/min sliding".parse(), Ok(Quota::per_minute(100).sliding_window()));
/// assert!("5 per second".parse::<Quota>().is_err());
/// ```
impl std::str::FromStr for Quota {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::Invalid {
            option: "quota",
            reason: format!(
                "{s:?}: {reason} (expected e.g. \"100/s\", \"1000/h\", \"5/min burst 10\", \
                 \"5000/h fixed\", \"100/min sliding 5s\", \"2 concurrent\")"
            ),
        };
        if !s.contains('/') && s.split_whitespace().nth(1) == Some("concurrent") {
            return parse_concurrent(s).map_err(|e| bad(&e));
        }
        let (count, after) =
            s.split_once('/')
                .ok_or_else(|| match s.split_whitespace().nth(1) {
                    Some(word) if closest(word, &["concurrent"]).is_some() => bad(&format!(
                        "missing `/`, or {word:?}: did you mean `concurrent`?"
                    )),
                    _ => bad("missing `/`"),
                })?;
        let count =
            parse_number(count.trim(), "count", u128::from(u32::MAX)).map_err(|e| bad(&e))?;
        // The period: a unit, or a number and a unit (`/s`, `/10s`, `/ 30 min`); then keywords.
        let mut words = after.split_whitespace().peekable();
        let first = words
            .next()
            .ok_or_else(|| bad("missing the period after `/`"))?;
        let period = match words.peek() {
            Some(unit) if first.bytes().all(|b| b.is_ascii_digit()) && !is_keyword(unit) => {
                let period = format!("{first}{unit}");
                words.next();
                period
            }
            _ => first.to_owned(),
        };
        let period = parse_duration(&period, true).map_err(|e| bad(&e))?;
        // At most `u32::MAX`, checked just above.
        let mut q = Quota::new(count as u32, period);
        let mut algorithm = None;
        while let Some(word) = words.next() {
            match word {
                "burst" if q.burst.is_none() => {
                    let b = words
                        .next()
                        .ok_or_else(|| bad("`burst` without a number"))?;
                    let b = parse_number(b, "burst", u128::from(u32::MAX)).map_err(|e| bad(&e))?;
                    q = q.burst(b as u32);
                }
                "fixed" | "sliding" | "gcra" if algorithm.is_none() => {
                    algorithm = Some(word);
                    q = match word {
                        "fixed" => q.fixed_window(),
                        "sliding" => q.sliding_window(),
                        _ => q,
                    };
                    // A resolution may follow `sliding`.
                    if word == "sliding"
                        && let Some(next) = words.peek()
                        && !is_keyword(next)
                    {
                        let r = parse_duration(next, false)
                            .map_err(|e| bad(&format!("the resolution {next:?}: {e}")))?;
                        q = q.resolution(r);
                        words.next();
                    }
                }
                "bytes" if !q.counts_bytes() => q = q.bytes(),
                "block" if q.block_ns.is_none() => {
                    let d = words
                        .next()
                        .ok_or_else(|| bad("`block` without a duration"))?;
                    let d = parse_duration(d, false)
                        .map_err(|e| bad(&format!("the block {d:?}: {e}")))?;
                    q = q.block_for(d);
                }
                "burst" | "fixed" | "sliding" | "gcra" | "bytes" | "block" => {
                    return Err(bad(&format!("{word:?} given twice (or two algorithms)")));
                }
                _ => return Err(bad(&unknown_word(word))),
            }
        }
        Ok(q)
    }
}

/// `"N concurrent"`, optionally followed by `lease <duration>`.
fn parse_concurrent(s: &str) -> Result<Quota, String> {
    let mut words = s.split_whitespace();
    let slots = words.next().unwrap_or_default();
    let slots = parse_number(slots, "number of slots", u128::from(u32::MAX))?;
    words.next(); // `concurrent`
    let mut q = Quota::concurrent(slots as u32);
    match (words.next(), words.next(), words.next()) {
        (None, _, _) => {}
        (Some("lease"), Some(text), None) => {
            let lease = parse_duration(text, false).map_err(|e| format!("the lease: {e}"))?;
            let ns = lease.as_nanos();
            if ns == 0 || !ns.is_multiple_of(1_000_000) {
                return Err(format!(
                    "the lease {text:?}: a lease must be a positive whole number of milliseconds"
                ));
            }
            q = q.lease(lease);
        }
        (Some("lease"), None, _) => return Err("`lease` without a duration".to_owned()),
        (Some("lease"), Some(_), Some("lease")) => return Err("`lease` given twice".to_owned()),
        (Some("lease"), Some(_), Some(word)) => {
            return Err(format!(
                "unknown word {word:?} after the lease (nothing may follow `lease <duration>`)"
            ));
        }
        (Some(word), _, _) => {
            let mut reason =
                format!("unknown word {word:?} after `concurrent` (expected `lease <duration>`)");
            if closest(word, &["lease"]).is_some() {
                reason.push_str("; did you mean `lease`?");
            }
            return Err(reason);
        }
    }
    Ok(q)
}

/// The keywords that may follow a quota's rate.
const KEYWORDS: [&str; 6] = ["burst", "fixed", "sliding", "gcra", "bytes", "block"];

fn is_keyword(word: &str) -> bool {
    KEYWORDS.contains(&word)
}

/// Why a word after the rate is not understood, with the keyword it is closest to when it
/// looks like a misspelling of one (`fixd`, `brust`, `slidng`).
fn unknown_word(word: &str) -> String {
    let mut reason = format!(
        "unknown word {word:?} after the rate (expected `burst N`, `fixed`, `sliding` with an \
         optional resolution, `gcra`, `bytes`, or `block <duration>`)"
    );
    if let Some(near) = closest(word, &KEYWORDS) {
        reason.push_str(&format!("; did you mean `{near}`?"));
    }
    reason
}

/// The candidate `word` is a likely misspelling of: within two edits, a transposition counting
/// as one (and not a whole other word: at least half of it kept).
fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let word = word.to_ascii_lowercase();
    candidates
        .iter()
        .map(|c| (strsim::osa_distance(&word, c), *c))
        .filter(|(d, c)| *d <= 2 && *d * 2 <= c.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// A whole number of the quota syntax, named `what` in errors: digits only, at most `max`.
fn parse_number(text: &str, what: &str, max: u128) -> Result<u128, String> {
    if text.is_empty() {
        return Err(format!("missing the {what}"));
    }
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("the {what} {text:?} is not a number"));
    }
    match text.parse::<u128>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(format!("the {what} {text} is too large (at most {max})")),
    }
}

/// Parses a duration of the quota syntax: a number (optional in a period: `/s` is `/1s`) and
/// a unit.
fn parse_duration(text: &str, number_optional: bool) -> Result<Duration, String> {
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (n, unit) = text.split_at(digits);
    let n = if n.is_empty() && number_optional {
        1
    } else if n.is_empty() {
        return Err(format!(
            "{text:?} is not a duration (a number and a unit, e.g. `30s`, `15min`, `1h`)"
        ));
    } else {
        // Up to u64 seconds of nanoseconds: a `Duration` holds more than u64 nanoseconds,
        // and a period that is not whole microseconds is written in nanoseconds.
        parse_number(n, "period", u128::from(u64::MAX) * 1_000_000_000)
            .map_err(|_| format!("{text:?} is too long"))?
    };
    const UNITS: [&str; 7] = ["ns", "us", "ms", "s", "min", "h", "d"];
    let unit_ns: u64 = match unit.trim() {
        "ns" | "nanosecond" | "nanoseconds" => 1,
        "us" | "µs" | "microsecond" | "microseconds" => 1_000,
        "ms" | "millisecond" | "milliseconds" => 1_000_000,
        "s" | "sec" | "second" | "seconds" => 1_000_000_000,
        "m" | "min" | "minute" | "minutes" => 60_000_000_000,
        "h" | "hr" | "hour" | "hours" => 3_600_000_000_000,
        "d" | "day" | "days" => 86_400_000_000_000,
        "" => {
            return Err(format!(
                "{text:?} has no unit (one of {})",
                UNITS.join(", ")
            ));
        }
        other => {
            let long = [
                "second",
                "minute",
                "hour",
                "day",
                "millisecond",
                "microsecond",
            ];
            let near = closest(other, &long).or_else(|| closest(other, &UNITS));
            let hint = near.map_or(String::new(), |n| format!("; did you mean `{n}`?"));
            return Err(format!(
                "unknown unit {other:?} in {text:?} (one of {}, or their names){hint}",
                UNITS.join(", ")
            ));
        }
    };
    // In u128: a `Duration` holds more than u64 nanoseconds (a quota of a million per 1000
    // years is written `1000000/365000d`), up to u64 seconds.
    let ns = n
        .checked_mul(u128::from(unit_ns))
        .ok_or_else(|| format!("{text:?} is too long"))?;
    let secs = u64::try_from(ns / 1_000_000_000).map_err(|_| format!("{text:?} is too long"))?;
    Ok(Duration::new(secs, (ns % 1_000_000_000) as u32))
}

/// Formats as [`FromStr`](std::str::FromStr) parses: `"5/s burst 10"`.
impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.algorithm == Algorithm::Concurrent {
            write!(f, "{} concurrent", self.count)?;
            if self.period != Self::DEFAULT_LEASE {
                write!(f, " lease {}", DisplayDuration(self.period))?;
            }
            return Ok(());
        }
        let (n, unit) = in_units(self.period);
        write!(f, "{}/", self.count)?;
        if n != 1 {
            write!(f, "{n}")?;
        }
        f.write_str(unit)?;
        if let Some(b) = self.burst {
            write!(f, " burst {b}")?;
        }
        match self.algorithm {
            Algorithm::Gcra => {}
            Algorithm::FixedWindow => f.write_str(" fixed")?,
            Algorithm::SlidingWindow => f.write_str(" sliding")?,
            Algorithm::Concurrent => {}
        }
        if let Some(r) = self.resolution {
            write!(f, " {}", DisplayDuration(r))?;
        }
        if self.counts_bytes() {
            f.write_str(" bytes")?;
        }
        if let Some(b) = self.block() {
            write!(f, " block {}", DisplayDuration(b))?;
        }
        Ok(())
    }
}

/// A duration as a count of the largest unit of the quota syntax that divides it: `(5, "s")`.
fn in_units(d: Duration) -> (u128, &'static str) {
    let ns = d.as_nanos();
    if ns == 0 {
        return (0, "s");
    }
    [
        (86_400_000_000_000u128, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "min"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
    ]
    .into_iter()
    .find(|(u, _)| ns >= *u && ns.is_multiple_of(*u))
    .map_or((ns, "ns"), |(u, name)| (ns / u, name))
}

/// A duration as the quota syntax writes it: `5s`, `500ms`, `90s`.
struct DisplayDuration(Duration);

impl std::fmt::Display for DisplayDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, unit) = in_units(self.0);
        write!(f, "{n}{unit}")
    }
}

/// A duration in configuration files, as the quota syntax writes it: `"15min"`, `"30s"`,
/// `"500ms"`.
#[cfg(feature = "serde")]
pub(crate) mod serde_duration {
    use std::time::Duration;

    pub(crate) fn ser<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.collect_str(&super::DisplayDuration(*d)),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn de<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text: String = serde::Deserialize::deserialize(d)?;
        super::parse_duration(text.trim(), false)
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("the duration {text:?}: {e}")))
    }
}

/// A quota in a configuration file as a table:
/// `{ rate = "100/min", algorithm = "sliding", resolution = "5s", name = "minute" }`.
#[cfg(feature = "serde")]
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaTable {
    rate: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    /// `gcra`, `fixed` or `sliding`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    algorithm: Option<String>,
    /// A sliding window's sub-window length, e.g. `5s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    resolution: Option<String>,
}

/// Written as its rate (`"5/s burst 10"`), or as a table when it has a name:
/// `{ rate = "5/s burst 10", name = "burst" }`. A name longer than
/// [`MAX_NAME_LEN`](Quota::MAX_NAME_LEN), which `build()` refuses, is an error here too, rather
/// than written cut short (which would read back valid, under another name).
#[cfg(feature = "serde")]
impl serde::Serialize for Quota {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.name_too_long() {
            return Err(serde::ser::Error::custom(format!(
                "quota {self}: its name is longer than {} bytes (kept cut short: {:?})",
                Quota::MAX_NAME_LEN,
                self.name().unwrap_or_default()
            )));
        }
        match self.name() {
            None => s.collect_str(self),
            Some(name) => QuotaTable {
                rate: self.to_string(),
                name: Some(name.to_owned()),
                algorithm: None,
                resolution: None,
            }
            .serialize(s),
        }
    }
}

/// Read from a string (`"5/s burst 10"`) or a table (`{ rate = "100/min", algorithm =
/// "sliding", resolution = "5s", name = "minute" }`); a misspelt field or keyword is an error
/// naming it and what is allowed.
#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Quota {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(QuotaVisitor)
    }
}

#[cfg(feature = "serde")]
struct QuotaVisitor;

#[cfg(feature = "serde")]
impl<'de> serde::de::Visitor<'de> for QuotaVisitor {
    type Value = Quota;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "a quota: a string such as \"5/min burst 10\", or a table with `rate` and optional \
             `name`, `algorithm` and `resolution`",
        )
    }

    fn visit_str<E: serde::de::Error>(self, rate: &str) -> Result<Quota, E> {
        rate.parse().map_err(E::custom)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Quota, A::Error> {
        use serde::de::Error;
        let t: QuotaTable =
            serde::Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
        // The table's fields are written into the rate, so that both forms parse alike and a
        // field contradicting the rate (`rate = "1/s fixed", algorithm = "sliding"`) is an
        // error, never a silent choice.
        let mut rate = t.rate;
        if let Some(algorithm) = &t.algorithm {
            const ALGORITHMS: [&str; 3] = ["gcra", "fixed", "sliding"];
            if !ALGORITHMS.contains(&algorithm.as_str()) {
                let hint = closest(algorithm, &ALGORITHMS)
                    .map_or(String::new(), |n| format!("; did you mean `{n}`?"));
                return Err(A::Error::custom(format!(
                    "quota {rate:?}: unknown algorithm {algorithm:?} (expected `gcra`, `fixed` \
                     or `sliding`){hint}"
                )));
            }
            rate.push(' ');
            rate.push_str(algorithm);
        }
        if let Some(resolution) = &t.resolution {
            let sliding = t.algorithm.as_deref() == Some("sliding")
                || (t.algorithm.is_none() && rate.split_whitespace().any(|w| w == "sliding"));
            if !sliding {
                return Err(A::Error::custom(format!(
                    "quota {rate:?}: `resolution` needs `algorithm = \"sliding\"`"
                )));
            }
            rate.push(' ');
            rate.push_str(resolution);
        }
        let quota: Quota = rate.parse().map_err(A::Error::custom)?;
        Ok(match t.name {
            Some(name) => quota.named(&name),
            None => quota,
        })
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    #[test]
    fn concurrent_quotas_parse_and_check() {
        let q: Quota = "2 concurrent".parse().unwrap();
        assert_eq!(q, Quota::concurrent(2));
        assert_eq!(q.algorithm(), Algorithm::Concurrent);
        assert_eq!(q.to_string(), "2 concurrent");
        let p = q.params("p").unwrap();
        assert_eq!(p.burst.get(), 2);
        assert_eq!(p.kind, QuotaKind::Concurrent { lease_ms: 300_000 });
        assert!(p.is_concurrent());
        let q: Quota = "2 concurrent lease 1500ms".parse().unwrap();
        assert_eq!(q.period(), Duration::from_millis(1500));
        assert_eq!(q.to_string(), "2 concurrent lease 1500ms");
        for (bad, why) in [
            ("0 concurrent", "zero"),
            ("2 concurrent lease", "without a duration"),
            ("2 concurrent leas 5s", "did you mean `lease`"),
            ("2 concurrent lease 5", "no unit"),
            ("2 concurrent lease soon", "\"soon\" is not a duration"),
            ("2 concurrent lease 10s lease 20s", "`lease` given twice"),
            (
                "2 concurrent lease 10s burst",
                "unknown word \"burst\" after the lease",
            ),
            (
                "2 concurrent lease 0ms",
                "the lease \"0ms\": a lease must be a positive",
            ),
            ("2 concurrent lease 1500us", "the lease \"1500us\""),
            (
                "5/min block soon",
                "the block \"soon\": \"soon\" is not a duration",
            ),
            ("x concurrent", "not a number"),
        ] {
            let err = match bad.parse::<Quota>() {
                Ok(q) => q.params("p").unwrap_err().to_string(),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(why), "{bad}: {err}");
        }
        for (q, why) in [
            (Quota::concurrent(2).burst(3), "burst"),
            (Quota::concurrent(2).lease(Duration::ZERO), "milliseconds"),
            (
                Quota::concurrent(2).lease(Duration::from_micros(1500)),
                "milliseconds",
            ),
            (
                Quota::per_second(2).lease(Duration::from_secs(1)),
                "only for concurrent",
            ),
        ] {
            let err = q.params("p").unwrap_err().to_string();
            assert!(err.contains(why), "{q:?}: {err}");
        }
    }

    #[test]
    fn round_trips() {
        for s in [
            "100/s",
            "1000/h",
            "5/min burst 10",
            "3/10s",
            "10/500ms",
            "7/d",
            "1/90s",
            "5000/h fixed",
            "100/min sliding",
            "100/min sliding 5s",
            "10/s burst 20 gcra",
            "2 concurrent",
            "3 concurrent lease 30s",
            "1000000/h bytes",
            "100/min sliding 5s bytes",
            "5/15min fixed block 1h",
            "10/s burst 20 block 30s",
        ] {
            let q: Quota = s.parse().unwrap();
            assert_eq!(q.to_string().parse::<Quota>().unwrap(), q, "{s}");
        }
        // Periods beyond u64 nanoseconds (~584 years), in days or in nanoseconds.
        for q in [
            Quota::new(1_000_000, Duration::from_secs(365_000 * 86_400)),
            Quota::new(1_000_000, Duration::new(31_536_000_000, 1)).burst(1),
        ] {
            assert_eq!(q.to_string().parse::<Quota>().unwrap(), q, "{q}");
        }
        assert_eq!(
            "5/15min fixed block 1h".parse::<Quota>().unwrap(),
            Quota::new(5, Duration::from_secs(900))
                .fixed_window()
                .block_for(Duration::from_secs(3600))
        );
        for bad in ["5/min block", "5/min block 1h block 2h", "5/min block soon"] {
            assert!(bad.parse::<Quota>().is_err(), "{bad}");
        }
        assert_eq!("1000/h".parse::<Quota>().unwrap(), Quota::per_hour(1000));
        assert_eq!(
            "2 / 30 min".parse::<Quota>().unwrap(),
            Quota::new(2, Duration::from_secs(1800))
        );
    }

    #[test]
    fn errors_name_the_word_that_is_wrong() {
        let cases = [
            ("5/min fixd", "\"fixd\"", Some("fixed")),
            ("5/min brust 10", "\"brust\"", Some("burst")),
            ("100/min slidng 5s", "\"slidng\"", Some("sliding")),
            (
                "100/min sliding 5sx",
                "the resolution \"5sx\": unknown unit \"sx\"",
                None,
            ),
            ("5/fortnight", "unknown unit \"fortnight\"", None),
            ("5/minuets", "unknown unit \"minuets\"", Some("minute")),
            ("5/s burst 10 burst 3", "\"burst\" given twice", None),
            ("4294967296/s", "the count 4294967296 is too large", None),
            (
                "5/s burst 4294967296",
                "the burst 4294967296 is too large",
                None,
            ),
            ("99999999999999999999999/s", "too large", None),
            ("5/99999999999999999d", "too long", None),
            ("5/999999999999999999999d", "too long", None),
            ("x/s", "the count \"x\" is not a number", None),
            ("5/", "missing the period", None),
            ("5/10 burst 2", "has no unit", None),
        ];
        for (input, names, hint) in cases {
            let e = input.parse::<Quota>().unwrap_err().to_string();
            assert!(e.contains(names), "{input}: {e}");
            assert!(e.contains(&format!("{input:?}")), "{input}: {e}");
            match hint {
                Some(h) => assert!(e.contains(&format!("did you mean `{h}`?")), "{input}: {e}"),
                None => assert!(!e.contains("did you mean"), "{input}: {e}"),
            }
            if names.contains("\"") && !names.contains("unit") {
                assert!(!e.contains("unit"), "{input}: blames the period: {e}");
            }
        }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn configuration_errors_name_the_field_that_is_wrong() {
        let json = r#"{ "rate": "100/min", "algoritm": "sliding" }"#;
        let toml_text = "q = { rate = \"100/min\", algoritm = \"sliding\" }";
        let yaml = "rate: 100/min\nalgoritm: sliding\n";
        #[derive(Debug, serde::Deserialize)]
        struct File {
            #[allow(dead_code)]
            q: Quota,
        }
        let errors = [
            serde_json::from_str::<Quota>(json).unwrap_err().to_string(),
            toml::from_str::<File>(toml_text).unwrap_err().to_string(),
            serde_norway::from_str::<Quota>(yaml)
                .unwrap_err()
                .to_string(),
        ];
        for e in errors {
            assert!(e.contains("unknown field `algoritm`"), "{e}");
            assert!(e.contains("`algorithm`") && e.contains("`rate`"), "{e}");
            assert!(!e.contains("untagged"), "{e}");
        }
        let e = serde_json::from_str::<Quota>(r#"{ "rate": "100/min", "algorithm": "slidng" }"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown algorithm \"slidng\""), "{e}");
        assert!(e.contains("did you mean `sliding`?"), "{e}");
        let e = serde_json::from_str::<Quota>(r#""5/min fixd""#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"fixd\"") && e.contains("`fixed`"), "{e}");
        let e = serde_json::from_str::<Quota>("5").unwrap_err().to_string();
        assert!(e.contains("a quota: a string"), "{e}");
        // Both forms still read.
        let q: Quota =
            serde_json::from_str(r#"{ "rate": "100/min", "algorithm": "sliding" }"#).unwrap();
        assert_eq!(q, Quota::per_minute(100).sliding_window());
        let q: Quota = serde_norway::from_str("100/min sliding 5s").unwrap();
        assert_eq!(
            q,
            Quota::per_minute(100)
                .sliding_window()
                .resolution(Duration::from_secs(5))
        );
    }

    #[test]
    fn errors_name_the_input() {
        for s in [
            "",
            "5",
            "x/s",
            "5/fortnight",
            "5/s burst x",
            "5/99999999999999999d",
        ] {
            let e = s.parse::<Quota>().unwrap_err().to_string();
            assert!(e.contains(&format!("{s:?}")), "{e}");
        }
    }
}
