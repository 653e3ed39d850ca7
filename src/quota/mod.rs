//! Quotas: how many requests per period, and how big a burst.

use std::time::Duration;

#[cfg(feature = "calendar")]
mod calendar;
#[cfg(feature = "calendar")]
pub(crate) use calendar::CalendarClock;
#[cfg(feature = "calendar")]
pub use calendar::{Calendar, Weekday};
mod change;
mod params;
mod syntax;

pub use change::OnChange;
pub use params::{QuotaKind, QuotaParams};
#[cfg(feature = "serde")]
pub(crate) use syntax::config_duration;
#[cfg(feature = "calendar")]
pub(crate) use syntax::parse_time_of_day;
#[cfg(feature = "serde")]
pub(crate) use syntax::serde_duration;

/// A rate and a burst size: `Quota::per_second(10).burst(20)` allows a sustained 10 requests per
/// second and up to 20 at once after a quiet spell.
///
/// Rates read as what they do: `per_second(100)` is one hundred per second. The quota is a
/// [GCRA] (generic cell rate algorithm) bucket: it holds `burst` units, one unit comes back every
/// `period / count`, and a request of cost `c` passes when `c` units are in the bucket.
///
/// Zero counts, zero bursts and zero periods are not panics: they are reported by
/// [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build) as a [`ConfigError`](crate::ConfigError).
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
    /// The calendar of a calendar quota ([`Quota::calendar`]): a fixed window whose windows
    /// are its periods.
    #[cfg(feature = "calendar")]
    calendar: Option<Calendar>,
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
            #[cfg(feature = "calendar")]
            calendar: None,
        }
    }

    /// `count` requests per window of `calendar`: a day, week, month or year aligned to a
    /// local time of day in a time zone and, for months, to a billing day (see [`Calendar`]
    /// for the rules at month ends and DST changes). A fixed window whose windows are the
    /// calendar's: the count starts from zero at each window's start, and `RateLimit`'s `t` and
    /// `Retry-After` are the exact seconds to it. In the quota syntax: `"1000/month"`,
    /// `"100000/month on 15 at 09:00 tz Europe/Berlin"`, `"50/day at 06:00 tz
    /// America/New_York"`, `"500/week on sunday"`, `"12/year on 04-06 tz Europe/London"`.
    ///
    /// ```
    /// use tollgate::quota::Calendar;
    /// use tollgate::{Policy, Quota};
    ///
    /// // The free plan: 1 000 a month, from the first at midnight UTC; and 10/s.
    /// let free = Policy::new("free", Quota::per_second(10))
    ///     .and(Quota::calendar(1000, Calendar::monthly()));
    /// assert!(free.validate().is_ok());
    /// assert_eq!("1000/month".parse(), Ok(Quota::calendar(1000, Calendar::monthly())));
    /// // An anchor past 31 is reported, naming it.
    /// let bad = Policy::new("bad", Quota::calendar(10, Calendar::monthly_on(32)));
    /// assert!(bad.validate().unwrap_err().to_string().contains("day 32"));
    /// ```
    #[cfg(feature = "calendar")]
    pub fn calendar(count: u32, calendar: Calendar) -> Self {
        let mut q = Self::new(count, calendar.nominal());
        q.algorithm = Algorithm::FixedWindow;
        q.calendar = Some(calendar);
        q
    }

    /// The quota with its calendar replaced (a calendar quota only).
    #[cfg(feature = "calendar")]
    pub(crate) fn with_calendar(mut self, calendar: Calendar) -> Self {
        if self.calendar.is_some() {
            self.calendar = Some(calendar);
        }
        self
    }

    /// The calendar of a [`calendar`](Self::calendar) quota.
    #[cfg(feature = "calendar")]
    pub const fn calendar_period(&self) -> Option<Calendar> {
        self.calendar
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
    #[cfg(any(
        feature = "redis",
        feature = "postgres",
        feature = "mysql",
        feature = "rls-client"
    ))]
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
