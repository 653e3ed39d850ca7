//! Calendar periods (feature `calendar`): the windows a daily, weekly, monthly or yearly quota
//! counts in, aligned to a local time of day in an IANA time zone and, for weeks, months and
//! years, to an anchor day. Computed on the instance with `jiff` and its bundled time-zone
//! database.
//!
//! Rules:
//! - A boundary is a local wall-clock time: the period's day (a day; a week's first day; the
//!   month's anchor day; the year's month and day) at the time of day (midnight by default).
//! - An anchor day past the month's end is its last day (31 resets on 28 or 29 February and
//!   30 April, as Stripe's billing anchors do); 29 February in a year without one is 28.
//! - A boundary at a local time that does not exist (a spring-forward gap) moves later by the
//!   gap's length (02:30 on New York's spring-forward night is 03:30 EDT); one that happens
//!   twice (a fall-back fold) is the first. This is Temporal's and `java.time`'s "compatible"
//!   rule.
//! - Windows tile time: each starts where the one before ends. A period whose boundary
//!   coincides with the next one's (Pacific/Apia skipped 30 December 2011) has no window.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jiff::civil::{Date, Time, Weekday as JiffWeekday};
use jiff::tz::TimeZone;
use jiff::{Span, Timestamp};

/// The calendar a [`Quota::calendar`](crate::Quota::calendar) counts by: a period (a day, a
/// week, a month or a year), the day it starts on (a week's first day, a month's anchor day, a
/// year's month and day), the local time of day it starts at, and an IANA time zone.
///
/// A window starts at the period's day at the time of day, in the zone, and ends where the
/// next starts: a day that DST shortens is 23 hours long, one it lengthens 25. The rules, for
/// every store alike:
/// - a monthly anchor past the month's end is its last day: `monthly_on(31)` resets on 28 or
///   29 February and 30 April, as Stripe's billing anchors do; a yearly anchor of 29 February
///   is 28 February in other years;
/// - a start at a local time that does not exist (a spring-forward gap) moves later by the
///   gap's length (02:30 on New York's spring-forward night is 03:30 EDT), and one that
///   happens twice (a fall-back fold) is the first: the "compatible" rule of Temporal and
///   `java.time`;
/// - windows tile time: each starts where the one before ends; a period whose start is the
///   next one's (Samoa skipped 30 December 2011) has no window.
///
/// Defaults: the first of the month, Monday, 1 January, midnight, UTC. A calendar is small to
/// copy: each distinct one (period, anchor, time and zone) is kept once for the process's
/// life. Settings out of range (an anchor of 32, a time of 25:00, a zone that does not exist)
/// are reported, naming the word, when the layer is built.
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use tollgate::Quota;
/// use tollgate::quota::Calendar;
///
/// // 100 000 a month from the 15th, at 09:00 in Berlin.
/// let billing = Calendar::monthly_on(15).at(9, 0).in_zone("Europe/Berlin");
/// let pro = Quota::calendar(100_000, billing);
/// assert_eq!(pro.to_string(), "100000/month on 15 at 09:00 tz Europe/Berlin");
/// assert_eq!("100000/month on 15 at 09:00 tz Europe/Berlin".parse(), Ok(pro));
///
/// // 2026-11-28 12:00 UTC is in the window from 15 November 09:00 CET to 15 December.
/// let now = UNIX_EPOCH + Duration::from_secs(1_795_867_200);
/// let window = billing.window(now).unwrap();
/// assert_eq!(window.start, UNIX_EPOCH + Duration::from_secs(1_794_729_600));
/// assert_eq!(window.end, UNIX_EPOCH + Duration::from_secs(1_797_321_600));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    /// Its place in [`CALENDARS`]: one per settings.
    id: u32,
}

/// A day of the week, for [`Calendar::weekly_from`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Weekday {
    Monday,
    Tuesday,
    Wednesday,
    Thursday,
    Friday,
    Saturday,
    Sunday,
}

impl Weekday {
    const ALL: [Weekday; 7] = [
        Weekday::Monday,
        Weekday::Tuesday,
        Weekday::Wednesday,
        Weekday::Thursday,
        Weekday::Friday,
        Weekday::Saturday,
        Weekday::Sunday,
    ];

    /// The day's English name in lowercase, as the quota syntax writes it.
    pub const fn name(self) -> &'static str {
        match self {
            Weekday::Monday => "monday",
            Weekday::Tuesday => "tuesday",
            Weekday::Wednesday => "wednesday",
            Weekday::Thursday => "thursday",
            Weekday::Friday => "friday",
            Weekday::Saturday => "saturday",
            Weekday::Sunday => "sunday",
        }
    }

    /// The day named `name` (its English name or first three letters, any case).
    pub(crate) fn named(name: &str) -> Option<Self> {
        let name = name.to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|d| d.name() == name || (name.len() == 3 && d.name().starts_with(&name)))
    }

    fn to_jiff(self) -> JiffWeekday {
        match self {
            Weekday::Monday => JiffWeekday::Monday,
            Weekday::Tuesday => JiffWeekday::Tuesday,
            Weekday::Wednesday => JiffWeekday::Wednesday,
            Weekday::Thursday => JiffWeekday::Thursday,
            Weekday::Friday => JiffWeekday::Friday,
            Weekday::Saturday => JiffWeekday::Saturday,
            Weekday::Sunday => JiffWeekday::Sunday,
        }
    }
}

/// What identifies a calendar: its settings as given (checked once, when interned).
#[derive(Clone, PartialEq, Eq, Hash)]
struct Spec {
    period: Period,
    /// The time of day: hour, minute, second as given (checked by `Rules::new`).
    at: (u8, u8, u8),
    zone: Box<str>,
}

/// A calendar kept for the process's life: its settings, its rules when they are valid, and
/// the window last computed (`start_s << 32 | length_s`, 0 when none), so that the requests
/// of one window compute it once.
#[cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
struct Entry {
    spec: Spec,
    /// The calendar it is.
    calendar: Calendar,
    rules: Result<Rules, String>,
    last: AtomicU64,
    /// The boundary nearest the time last asked of [`Calendar::around_us`] and the lengths of
    /// the windows on each side, with the range of times it is the nearest for.
    around: Mutex<Option<Around>>,
}

/// A boundary and the windows on each side of it, in seconds, valid for times in
/// `[from_us, to_us)` (between the midpoints of those windows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Around {
    /// The boundary, in seconds since the Unix epoch.
    pub(crate) boundary_s: u64,
    /// The length of the window that ends at it, in seconds.
    pub(crate) before_s: u64,
    /// The length of the window that starts at it, in seconds.
    pub(crate) after_s: u64,
    from_us: u64,
    to_us: u64,
}

/// Every calendar made: each settings once, by id and by settings. Read when a quota is
/// checked, shown or prepared, never per request (a backend keeps the [`CalendarClock`]).
#[derive(Default)]
struct Registry {
    entries: Vec<&'static Entry>,
    ids: HashMap<Spec, u32>,
}

static CALENDARS: LazyLock<RwLock<Registry>> = LazyLock::new(RwLock::default);

/// A calendar's windows as a backend computes them, per request: the last one computed is
/// kept, so that the requests of one window compute it once.
#[derive(Clone, Copy)]
pub(crate) struct CalendarClock(&'static Entry);

impl PartialEq for CalendarClock {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for CalendarClock {}

impl std::fmt::Debug for CalendarClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CalendarClock({:?})", self.0.spec.zone)
    }
}

impl Calendar {
    fn entry(&self) -> &'static Entry {
        let calendars = CALENDARS.read().unwrap_or_else(|e| e.into_inner());
        // Every id was given by `intern`, which pushed its entry.
        calendars.entries[self.id as usize]
    }

    /// The calendar's windows, for a backend to compute per request.
    pub(crate) fn clock(&self) -> CalendarClock {
        CalendarClock(self.entry())
    }

    fn intern(spec: Spec) -> Self {
        let mut calendars = CALENDARS.write().unwrap_or_else(|e| e.into_inner());
        if let Some(&id) = calendars.ids.get(&spec) {
            return Calendar { id };
        }
        let (h, m, s) = spec.at;
        let rules = i8::try_from(h)
            .ok()
            .zip(i8::try_from(m).ok())
            .zip(i8::try_from(s).ok())
            .and_then(|((h, m), s)| Time::new(h, m, s, 0).ok())
            .ok_or_else(|| format!("the time of day {h:02}:{m:02}:{s:02}: use 00:00 to 23:59:59"))
            .and_then(|at| Rules::new(spec.period, at, &spec.zone));
        // Ids are not reused: each distinct settings is one entry for the process's life.
        let id = u32::try_from(calendars.entries.len()).unwrap_or(u32::MAX);
        let entry: &'static Entry = Box::leak(Box::new(Entry {
            spec: spec.clone(),
            calendar: Calendar { id },
            rules,
            last: AtomicU64::new(0),
            around: Mutex::new(None),
        }));
        calendars.entries.push(entry);
        calendars.ids.insert(spec, id);
        Calendar { id }
    }

    fn with(self, change: impl FnOnce(&mut Spec)) -> Self {
        let mut spec = self.entry().spec.clone();
        change(&mut spec);
        Self::intern(spec)
    }

    fn of(period: Period) -> Self {
        Self::intern(Spec {
            period,
            at: (0, 0, 0),
            zone: "UTC".into(),
        })
    }

    /// Every day, from midnight.
    pub fn daily() -> Self {
        Self::of(Period::Day)
    }

    /// Every week, from Monday.
    pub fn weekly() -> Self {
        Self::weekly_from(Weekday::Monday)
    }

    /// Every week, from `first`.
    pub fn weekly_from(first: Weekday) -> Self {
        Self::of(Period::Week {
            first: first.to_jiff(),
        })
    }

    /// Every month, from the first.
    pub fn monthly() -> Self {
        Self::monthly_on(1)
    }

    /// Every month, from day `anchor` (1 to 31; past the month's end, its last day).
    pub fn monthly_on(anchor: u8) -> Self {
        Self::of(Period::Month {
            anchor: i16::from(anchor),
        })
    }

    /// Every year, from 1 January.
    pub fn yearly() -> Self {
        Self::yearly_on(1, 1)
    }

    /// Every year, from `month`/`day` (29 February is 28 February in other years).
    pub fn yearly_on(month: u8, day: u8) -> Self {
        Self::of(Period::Year {
            month: i16::from(month),
            day: i16::from(day),
        })
    }

    /// Windows start at `hour:minute` local time (midnight by default).
    pub fn at(self, hour: u8, minute: u8) -> Self {
        self.at_second(hour, minute, 0)
    }

    /// Windows start at `hour:minute:second` local time.
    pub fn at_second(self, hour: u8, minute: u8, second: u8) -> Self {
        self.with(|s| s.at = (hour, minute, second))
    }

    /// In the IANA time zone `zone` (`"Europe/Berlin"`, `"America/New_York"`, `"UTC"`, the
    /// default), from the time-zone database bundled with the crate.
    pub fn in_zone(self, zone: &str) -> Self {
        self.with(|s| s.zone = zone.into())
    }

    /// The same calendar with its monthly anchor `day` (unchanged unless it is monthly).
    pub(crate) fn with_month_day(self, day: u8) -> Self {
        match self.entry().spec.period {
            Period::Month { .. } => self.with(|s| {
                s.period = Period::Month {
                    anchor: i16::from(day),
                }
            }),
            _ => self,
        }
    }

    /// The zone's name, as given.
    pub fn zone(&self) -> &str {
        &self.entry().spec.zone
    }

    /// What is wrong with the settings, if anything.
    pub(crate) fn error(&self) -> Option<&'static str> {
        self.entry().rules.as_ref().err().map(String::as_str)
    }

    /// The window holding `at`: `start..end`, where `end` is the next window's start (`None`
    /// for settings that are not valid, or a time outside the years -9999 to 9999).
    pub fn window(&self, at: SystemTime) -> Option<Range<SystemTime>> {
        let us = match at.duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_micros()).ok()?,
            Err(e) => i64::try_from(e.duration().as_micros())
                .ok()?
                .checked_neg()?,
        };
        let w = self.entry().rules.as_ref().ok()?.window(us)?;
        let time = |us: i64| {
            let d = Duration::from_micros(us.unsigned_abs());
            if us >= 0 {
                UNIX_EPOCH + d
            } else {
                UNIX_EPOCH - d
            }
        };
        Some(time(w.start_us)..time(w.end_us))
    }

    /// The window holding `at` as its start and end in the calendar's zone, written as RFC
    /// 9557 times (RFC 3339 with the zone's name: `2026-12-15T09:00:00+01:00[Europe/Berlin]`),
    /// for the status endpoint.
    pub(crate) fn window_text(&self, at: SystemTime) -> Option<(String, String)> {
        let rules = self.entry().rules.as_ref().ok()?;
        let us = i64::try_from(at.duration_since(UNIX_EPOCH).ok()?.as_micros()).ok()?;
        let w = rules.window(us)?;
        let text = |us: i64| -> Option<String> {
            let t = Timestamp::from_microsecond(us).ok()?;
            Some(t.to_zoned(rules.zone.clone()).to_string())
        };
        Some((text(w.start_us)?, text(w.end_us)?))
    }

    /// Longer than any window of the calendar (its nominal length and two days), in µs: a
    /// bound on what a store may answer.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn longest_us(&self) -> u64 {
        (self.nominal().as_secs() + 2 * 86_400) * 1_000_000
    }

    /// The period's nominal length, what `RateLimit-Policy`'s `w` says of it: a day 86 400 s,
    /// a week 604 800 s, a month 30 days, a year 365 days. `RateLimit`'s `t` and
    /// `Retry-After` are exact.
    pub fn nominal(&self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self.entry().spec.period {
            Period::Day => DAY,
            Period::Week { .. } => 7 * DAY,
            Period::Month { .. } => 30 * DAY,
            Period::Year { .. } => 365 * DAY,
        })
    }

    /// The period's word in the quota syntax.
    pub(crate) fn unit(&self) -> &'static str {
        match self.entry().spec.period {
            Period::Day => "day",
            Period::Week { .. } => "week",
            Period::Month { .. } => "month",
            Period::Year { .. } => "year",
        }
    }
}

impl CalendarClock {
    /// The window holding `now_us` (µs since the Unix epoch) as `(start_us, end_us)`; the
    /// last one computed is kept, so that the requests of one window compute it once. `None`
    /// for settings that are not valid (refused when the layer is built) or a time past 9999.
    #[inline]
    pub(crate) fn window_us(&self, now_us: u64) -> Option<(u64, u64)> {
        let last = self.0.last.load(Ordering::Relaxed);
        let start = (last >> 32) * 1_000_000;
        let end = start + (last & 0xFFFF_FFFF) * 1_000_000;
        if start <= now_us && now_us < end {
            return Some((start, end));
        }
        self.compute(now_us)
    }

    #[cold]
    fn compute(&self, now_us: u64) -> Option<(u64, u64)> {
        let rules = self.0.rules.as_ref().ok()?;
        let w = rules.window(i64::try_from(now_us).ok()?)?;
        let (start, end) = (
            u64::try_from(w.start_us).ok()?,
            u64::try_from(w.end_us).ok()?,
        );
        // Kept when it is whole seconds that fit: every boundary is, from 1970 to 2106.
        if start.is_multiple_of(1_000_000) && end.is_multiple_of(1_000_000) {
            let (s, len) = (start / 1_000_000, (end - start) / 1_000_000);
            if let (Ok(s), Ok(len)) = (u32::try_from(s), u32::try_from(len)) {
                let packed = u64::from(s) << 32 | u64::from(len);
                self.0.last.store(packed, Ordering::Relaxed);
            }
        }
        Some((start, end))
    }

    /// The boundary nearest `now_us` and the windows on each side, for a store that decides
    /// by its own clock which of the two holds its time (see `docs/algorithms.md`): the
    /// instance's and the store's clocks may differ by up to half a window (11.5 hours for a
    /// day) and still agree on the windows. Kept, with the range of times it is the nearest
    /// for. `None` for settings that are not valid or times past 2106.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn around_us(&self, now_us: u64) -> Option<Around> {
        let mut around = self.0.around.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = *around
            && (a.from_us..a.to_us).contains(&now_us)
        {
            return Some(a);
        }
        let rules = self.0.rules.as_ref().ok()?;
        let now = i64::try_from(now_us).ok()?;
        let w = rules.window(now)?;
        let (before, after) = if now - w.start_us <= w.end_us - now {
            (rules.window(w.start_us - 1)?, w)
        } else {
            (w, rules.window(w.end_us)?)
        };
        let s = |us: i64| u64::try_from(us / 1_000_000).ok().filter(|s| *s < 1 << 32);
        let boundary_s = s(after.start_us)?;
        let a = Around {
            boundary_s,
            before_s: boundary_s - s(before.start_us)?,
            after_s: s(after.end_us)? - boundary_s,
            from_us: u64::try_from((before.start_us + before.end_us) / 2).ok()?,
            to_us: u64::try_from((after.start_us + after.end_us) / 2).ok()?,
        };
        *around = Some(a);
        Some(a)
    }

    /// The instance's time of a call to a shared store, in µs since the epoch: `now_ns` when
    /// given (a test clock's, or a time read elsewhere), else the wall clock's.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn call_us(now_ns: Option<u64>) -> u64 {
        match now_ns {
            Some(ns) => ns / 1000,
            None => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
        }
    }

    /// The boundary nearest `now_us` (a call's time, [`call_us`](Self::call_us)) and the
    /// windows on each side, for a shared store to pick from. Never fails: for a time past
    /// 2106 (or settings refused when built), days from the epoch. Every length is under
    /// 2^25 s (a year and a day is 3.2e7 s).
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn around_call(&self, now_us: u64) -> Around {
        const DAY: u64 = 86_400;
        self.around_us(now_us).unwrap_or(Around {
            boundary_s: (now_us / 1_000_000 + DAY / 2) / DAY * DAY,
            before_s: DAY,
            after_s: DAY,
            from_us: 0,
            to_us: 0,
        })
    }

    /// A number that tells this calendar from others (its settings' hash, 20 bits), which
    /// a store keeps with a count to see that a quota's calendar changed.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn id(&self) -> u64 {
        // FNV-1a over the settings' text: the same on every instance and release.
        let text = self.0.calendar.to_string();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in text.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        h & 0xF_FFFF
    }
}

impl std::fmt::Debug for Calendar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Calendar({self})")
    }
}

/// The calendar in the quota syntax, after the count's slash: `month on 15 at 09:00 tz
/// Europe/Berlin`, defaults left out (a calendar day with no other option says `day
/// calendar`: `day` alone is 24 hours from the epoch).
impl std::fmt::Display for Calendar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let spec = &self.entry().spec;
        f.write_str(self.unit())?;
        match spec.period {
            Period::Day => {}
            Period::Week { first } => {
                if first != JiffWeekday::Monday {
                    let i = first.to_monday_zero_offset().clamp(0, 6) as usize;
                    write!(f, " on {}", Weekday::ALL[i].name())?;
                }
            }
            Period::Month { anchor } => {
                if anchor != 1 {
                    write!(f, " on {anchor}")?;
                }
            }
            Period::Year { month, day } => {
                if (month, day) != (1, 1) {
                    write!(f, " on {month:02}-{day:02}")?;
                }
            }
        }
        let (h, m, s) = spec.at;
        if (h, m, s) != (0, 0, 0) {
            write!(f, " at {h:02}:{m:02}")?;
            if s != 0 {
                write!(f, ":{s:02}")?;
            }
        }
        if &*spec.zone != "UTC" {
            write!(f, " tz {}", spec.zone)?;
        }
        if spec.period == Period::Day && (h, m, s) == (0, 0, 0) && &*spec.zone == "UTC" {
            f.write_str(" calendar")?;
        }
        Ok(())
    }
}

/// The period a calendar window spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Period {
    /// Every day.
    Day,
    /// Every week, starting on `first`.
    Week { first: JiffWeekday },
    /// Every month, on day `anchor` (1 to 31, clamped to the month's last day). Kept as given
    /// (wide enough for any `u8`), so that an error names the value the user wrote.
    Month { anchor: i16 },
    /// Every year, on `month`/`day` (29 February is 28 February in other years).
    Year { month: i16, day: i16 },
}

/// A calendar: a period, the local time of day its windows start, and the zone.
#[derive(Debug, Clone, PartialEq)]
struct Rules {
    period: Period,
    at: Time,
    zone: TimeZone,
}

/// A window: `[start, end)`, microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    start_us: i64,
    end_us: i64,
}

const EPOCH: Date = Date::constant(1970, 1, 1);

/// `month`/`day` of `year`, if there is such a day.
fn year_day(year: i16, month: i16, day: i16) -> Option<Date> {
    Date::new(year, i8::try_from(month).ok()?, i8::try_from(day).ok()?).ok()
}

impl Rules {
    /// A calendar in `zone` (an IANA name, `UTC` included), its windows starting at `at`.
    fn new(period: Period, at: Time, zone: &str) -> Result<Self, String> {
        match period {
            Period::Month { anchor } if !(1..=31).contains(&anchor) => {
                return Err(format!("day {anchor} of the month: use 1 to 31"));
            }
            Period::Year { month, day } if year_day(2000, month, day).is_none() => {
                return Err(format!("{month}/{day}: no such day of the year"));
            }
            _ => {}
        }
        let zone = TimeZone::get(zone).map_err(|e| format!("time zone {zone:?}: {e}"))?;
        Ok(Rules { period, at, zone })
    }

    /// The day period `k` starts on (before the time of day).
    fn day_of(&self, k: i64) -> Option<Date> {
        match self.period {
            Period::Day => EPOCH.checked_add(Span::new().try_days(k).ok()?).ok(),
            Period::Week { first } => {
                // The first `first` on or after the epoch, then k weeks on.
                let shift = (i64::from(first.to_monday_zero_offset())
                    - i64::from(EPOCH.weekday().to_monday_zero_offset()))
                .rem_euclid(7);
                EPOCH
                    .checked_add(Span::new().try_days(shift + 7 * k).ok()?)
                    .ok()
            }
            Period::Month { anchor } => {
                let year = i16::try_from(k.div_euclid(12)).ok()?;
                let month = i8::try_from(k.rem_euclid(12) + 1).ok()?;
                let first = Date::new(year, month, 1).ok()?;
                let anchor = i8::try_from(anchor).ok()?;
                Date::new(year, month, anchor.min(first.days_in_month())).ok()
            }
            Period::Year { month, day } => {
                let year = i16::try_from(k).ok()?;
                let first = year_day(year, month, 1)?;
                let day = i8::try_from(day).ok()?;
                year_day(year, month, i16::from(day.min(first.days_in_month())))
            }
        }
    }

    /// The period whose nominal day is `date`'s, or the last before it.
    fn index_of(&self, date: Date) -> Option<i64> {
        let days = i64::from(date.since(EPOCH).ok()?.get_days());
        Some(match self.period {
            Period::Day => days,
            Period::Week { .. } => {
                let first = self.day_of(0)?;
                i64::from(date.since(first).ok()?.get_days()).div_euclid(7)
            }
            Period::Month { .. } => i64::from(date.year()) * 12 + i64::from(date.month()) - 1,
            Period::Year { .. } => i64::from(date.year()),
        })
    }

    /// Where period `k` starts: its day at the time of day, in the zone (see the module's
    /// rules for times that do not exist or happen twice).
    fn boundary(&self, k: i64) -> Option<i64> {
        let dt = self.day_of(k)?.to_datetime(self.at);
        let ts = self.zone.to_ambiguous_timestamp(dt).compatible().ok()?;
        Some(ts.as_microsecond())
    }

    /// The window `now_us` is in, or `None` out of the range of dates the arithmetic covers
    /// (years -9999 to 9999).
    fn window(&self, now_us: i64) -> Option<Window> {
        let now = Timestamp::from_microsecond(now_us).ok()?;
        let local = self.zone.to_datetime(now).date();
        let mut k = self.index_of(local)?;
        // The last boundary at or before now (a period's day can sort after now's, or a
        // boundary's resolution move it past now).
        while self.boundary(k)? > now_us {
            k -= 1;
        }
        while self.boundary(k + 1)? <= now_us {
            k += 1;
        }
        // b(k) <= now < b(k + 1): a period whose boundary equals the next one's (a skipped
        // day) is passed over by the loop above, so the window is never empty.
        Some(Window {
            start_us: self.boundary(k)?,
            end_us: self.boundary(k + 1)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::civil::{date, time};
    use proptest::prelude::*;

    const ZONES: [&str; 8] = [
        "UTC",
        "America/New_York",
        "Europe/Berlin",
        "Asia/Kolkata",
        "Asia/Kathmandu",
        "Australia/Lord_Howe",
        "Pacific/Apia",
        "America/Sao_Paulo",
    ];

    fn us(zone: &str, y: i16, m: i8, d: i8, h: i8, min: i8) -> i64 {
        let tz = TimeZone::get(zone).unwrap();
        (tz.to_ambiguous_timestamp(date(y, m, d).at(h, min, 0, 0)))
            .compatible()
            .unwrap()
            .as_microsecond()
    }

    fn local(zone: &str, at_us: i64) -> jiff::civil::DateTime {
        let tz = TimeZone::get(zone).unwrap();
        tz.to_datetime(Timestamp::from_microsecond(at_us).unwrap())
    }

    const HOUR: i64 = 3_600_000_000;

    #[test]
    fn a_monthly_anchor_of_31_is_clamped_to_each_months_last_day() {
        let c = Rules::new(Period::Month { anchor: 31 }, Time::midnight(), "UTC").unwrap();
        let w = c.window(us("UTC", 2025, 2, 10, 12, 0)).unwrap();
        assert_eq!(w.start_us, us("UTC", 2025, 1, 31, 0, 0));
        assert_eq!(w.end_us, us("UTC", 2025, 2, 28, 0, 0));
        let w = c.window(us("UTC", 2024, 2, 29, 0, 0)).unwrap();
        assert_eq!(w.start_us, us("UTC", 2024, 2, 29, 0, 0), "leap year");
        assert_eq!(w.end_us, us("UTC", 2024, 3, 31, 0, 0));
        let w = c.window(us("UTC", 2025, 4, 30, 23, 59)).unwrap();
        assert_eq!(w.start_us, us("UTC", 2025, 4, 30, 0, 0));
    }

    #[test]
    fn dst_days_are_23_and_25_hours_long() {
        let c = Rules::new(Period::Day, Time::midnight(), "America/New_York").unwrap();
        let spring = c.window(us("America/New_York", 2026, 3, 8, 12, 0)).unwrap();
        assert_eq!(spring.end_us - spring.start_us, 23 * HOUR);
        let fall = c
            .window(us("America/New_York", 2026, 11, 1, 12, 0))
            .unwrap();
        assert_eq!(fall.end_us - fall.start_us, 25 * HOUR);
        // Lord Howe moves its clocks by half an hour.
        let c = Rules::new(Period::Day, Time::midnight(), "Australia/Lord_Howe").unwrap();
        let lens: Vec<i64> = [(2026, 4, 5), (2026, 10, 4)]
            .into_iter()
            .map(|(y, m, d)| {
                let w = c.window(us("Australia/Lord_Howe", y, m, d, 12, 0)).unwrap();
                (w.end_us - w.start_us) / (HOUR / 2)
            })
            .collect();
        assert_eq!(lens, [49, 47], "24.5 h and 23.5 h, in half hours");
    }

    #[test]
    fn a_boundary_in_a_gap_moves_later_and_in_a_fold_is_the_first() {
        let c = Rules::new(Period::Day, time(2, 30, 0, 0), "America/New_York").unwrap();
        // 2026-03-08 02:30 does not exist in New York: 03:30 EDT.
        let w = c.window(us("America/New_York", 2026, 3, 8, 12, 0)).unwrap();
        assert_eq!(
            local("America/New_York", w.start_us),
            date(2026, 3, 8).at(3, 30, 0, 0)
        );
        let c = Rules::new(Period::Day, time(1, 30, 0, 0), "America/New_York").unwrap();
        // 2026-11-01 01:30 happens twice: the first (EDT, 05:30 UTC).
        let w = c
            .window(us("America/New_York", 2026, 11, 1, 12, 0))
            .unwrap();
        assert_eq!(w.start_us, us("UTC", 2026, 11, 1, 5, 30));
    }

    #[test]
    fn apias_skipped_day_has_no_window() {
        // Samoa skipped 30 December 2011: the day of the 29th ends where the 31st starts.
        let c = Rules::new(Period::Day, Time::midnight(), "Pacific/Apia").unwrap();
        let w = c.window(us("Pacific/Apia", 2011, 12, 29, 12, 0)).unwrap();
        assert_eq!(
            local("Pacific/Apia", w.end_us),
            date(2011, 12, 31).at(0, 0, 0, 0)
        );
        assert_eq!(w.end_us - w.start_us, 24 * HOUR);
        // At the boundary the window is the 31st's, a whole day, not an empty one for the 30th.
        let next = c.window(w.end_us).unwrap();
        assert_eq!(next.start_us, w.end_us);
        assert_eq!(next.end_us - next.start_us, 24 * HOUR);
    }

    #[test]
    fn weeks_start_on_their_first_day_and_bad_settings_are_refused() {
        let c = Rules::new(
            Period::Week {
                first: JiffWeekday::Monday,
            },
            Time::midnight(),
            "Europe/Berlin",
        )
        .unwrap();
        // Thursday 2026-11-26: the week of Monday the 23rd.
        let w = c.window(us("Europe/Berlin", 2026, 11, 26, 9, 0)).unwrap();
        assert_eq!(
            local("Europe/Berlin", w.start_us),
            date(2026, 11, 23).at(0, 0, 0, 0)
        );
        assert_eq!(
            local("Europe/Berlin", w.end_us),
            date(2026, 11, 30).at(0, 0, 0, 0)
        );
        for (period, zone, word) in [
            (Period::Month { anchor: 0 }, "UTC", "day 0"),
            (Period::Month { anchor: 32 }, "UTC", "day 32"),
            (Period::Year { month: 2, day: 30 }, "UTC", "2/30"),
            (Period::Day, "Mars/Olympus_Mons", "Mars/Olympus_Mons"),
        ] {
            let err = Rules::new(period, Time::midnight(), zone).unwrap_err();
            assert!(err.contains(word), "{err}");
        }
    }

    #[test]
    fn the_quota_syntax_reads_and_writes_calendars() {
        use crate::Quota;
        for (text, quota) in [
            (
                "1000/month",
                Quota::calendar(1000, super::Calendar::monthly()),
            ),
            (
                "100000/month on 15 at 09:00 tz Europe/Berlin",
                Quota::calendar(
                    100_000,
                    super::Calendar::monthly_on(15)
                        .at(9, 0)
                        .in_zone("Europe/Berlin"),
                ),
            ),
            (
                "50/day calendar",
                Quota::calendar(50, super::Calendar::daily()),
            ),
            (
                "50/day at 06:30:15 tz America/New_York",
                Quota::calendar(
                    50,
                    super::Calendar::daily()
                        .at_second(6, 30, 15)
                        .in_zone("America/New_York"),
                ),
            ),
            (
                "500/week on sunday",
                Quota::calendar(500, super::Calendar::weekly_from(super::Weekday::Sunday)),
            ),
            ("7/week", Quota::calendar(7, super::Calendar::weekly())),
            (
                "12/year on 04-06 tz Europe/London",
                Quota::calendar(
                    12,
                    super::Calendar::yearly_on(4, 6).in_zone("Europe/London"),
                ),
            ),
            (
                "10/month bytes block 1h",
                Quota::calendar(10, super::Calendar::monthly())
                    .bytes()
                    .block_for(std::time::Duration::from_secs(3600)),
            ),
        ] {
            assert_eq!(text.parse::<Quota>(), Ok(quota), "{text}");
            assert_eq!(quota.to_string(), text);
            assert!(quota.params("p").is_ok(), "{text}");
        }
        // Other spellings of the same.
        let same = [
            ("5/month on 1 fixed", "5/month"),
            ("5/day tz UTC", "5/day calendar"),
            ("5/week on Mon", "5/week"),
            ("5/month at 00:00", "5/month"),
        ];
        for (text, canonical) in same {
            assert_eq!(text.parse::<Quota>().unwrap().to_string(), canonical);
        }
        // `day` alone is still 24 hours from the epoch.
        assert_eq!("5/day".parse(), Ok(Quota::per_day(5)));
        for (text, word) in [
            ("5/month on 32", "on 32"),
            ("5/month on 0", "on 0"),
            ("5/month at 24:00", "at 24:00"),
            ("5/month at 9", "at 9"),
            ("5/month tz Mars/Olympus_Mons", "Mars/Olympus_Mons"),
            ("5/month tz", "`tz` without"),
            ("5/week on someday", "on someday"),
            ("5/year on 02-30", "2/30"),
            ("5/day on 3", "`on` is for weeks"),
            ("5/month burst 10", "burst"),
            ("5/month sliding", "sliding"),
            ("5/month on 3 on 4", "given twice"),
            ("5/month soon", "soon"),
        ] {
            let err = text.parse::<Quota>().unwrap_err().to_string();
            assert!(err.contains(word), "{text}: {err}");
        }
        // Settings out of range made by the builder are reported when checked.
        let bad = Quota::calendar(5, super::Calendar::monthly_on(40));
        let err = bad.params("plan").unwrap_err().to_string();
        assert!(err.contains("day 40") && err.contains("plan"), "{err}");
        // Values of 128 and more are reported as written, not as 127 (issue 55).
        let bad = Quota::calendar(5, super::Calendar::monthly_on(200));
        let err = bad.params("plan").unwrap_err().to_string();
        assert!(err.contains("on 200") && err.contains("day 200"), "{err}");
        let bad = Quota::calendar(5, super::Calendar::yearly_on(200, 1));
        let err = bad.params("plan").unwrap_err().to_string();
        assert!(err.contains("200/1") && !err.contains("127"), "{err}");
        let bad = Quota::calendar(5, super::Calendar::yearly_on(1, 255));
        let err = bad.params("plan").unwrap_err().to_string();
        assert!(err.contains("1/255"), "{err}");
        let bad = Quota::calendar(5, super::Calendar::daily().at(25, 0));
        assert!(bad.params("p").unwrap_err().to_string().contains("25:00"));
    }

    #[test]
    fn the_boundary_nearest_now_and_its_windows() {
        let c = super::Calendar::daily().in_zone("America/New_York").clock();
        let mar_8 = us("America/New_York", 2026, 3, 8, 0, 0) as u64;
        let mar_9 = us("America/New_York", 2026, 3, 9, 0, 0) as u64;
        // Nearer the 9th's midnight: the 8th (23 h) before it, the 9th (24 h) after.
        let a = c.around_us(mar_9 - 3_600_000_000).unwrap();
        assert_eq!(a.boundary_s * 1_000_000, mar_9);
        assert_eq!((a.before_s, a.after_s), (23 * 3600, 24 * 3600));
        // Nearer the 8th's: the 7th before it.
        let a = c.around_us(mar_8 + 3_600_000_000).unwrap();
        assert_eq!(a.boundary_s * 1_000_000, mar_8);
        assert_eq!((a.before_s, a.after_s), (24 * 3600, 23 * 3600));
        // The window is cached and right on both sides of a boundary.
        assert_eq!(c.window_us(mar_9 - 1), Some((mar_8, mar_9)));
        assert_eq!(c.window_us(mar_9).map(|w| w.0), Some(mar_9));
        assert_eq!(c.window_us(mar_9 - 1), Some((mar_8, mar_9)));
    }

    fn period() -> impl Strategy<Value = Period> {
        prop_oneof![
            Just(Period::Day),
            (0i8..7).prop_map(|d| Period::Week {
                first: JiffWeekday::from_monday_zero_offset(d).unwrap()
            }),
            (1i16..=31).prop_map(|anchor| Period::Month { anchor }),
            prop_oneof![Just((2i16, 29i16)), (1i16..=12, 1i16..=28)]
                .prop_map(|(month, day)| Period::Year { month, day }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Over 2000–2100 in zones with DST, half- and quarter-hour offsets, Lord Howe's
        /// half-hour DST and Apia's skipped day: the window holds now; windows tile time (the
        /// next starts where this one ends, the one before ends where it starts); the time to
        /// the reset reaches 0 exactly at the boundary; each boundary is its period's day at
        /// the time of day, anchors clamped, resolved by the stated rule.
        #[test]
        fn windows_tile_time_and_start_at_the_anchor(
            zone in proptest::sample::select(ZONES.to_vec()),
            period in period(),
            hour in 0i8..24,
            minute in proptest::sample::select(vec![0i8, 15, 30, 45]),
            now_s in 946_684_800i64..4_133_980_800,
        ) {
            let at = Time::new(hour, minute, 0, 0).unwrap();
            let c = Rules::new(period, at, zone).unwrap();
            let now = now_s * 1_000_000 + 123_456;
            let w = c.window(now).unwrap();
            prop_assert!(w.start_us <= now && now < w.end_us, "{w:?} {now}");
            let next = c.window(w.end_us).unwrap();
            prop_assert_eq!(next.start_us, w.end_us);
            let before = c.window(w.start_us - 1).unwrap();
            prop_assert_eq!(before.end_us, w.start_us);
            let last = c.window(w.end_us - 1).unwrap();
            prop_assert_eq!(last, w, "t reaches 0 at the end, not before");
            // The start is its period's day at the time of day, as the rule resolves it.
            let tz = TimeZone::get(zone).unwrap();
            let start_local = tz.to_datetime(Timestamp::from_microsecond(w.start_us).unwrap());
            let k = c.index_of(start_local.date()).unwrap();
            let expected = (k - 2..=k + 1).filter_map(|k| c.boundary(k)).any(|b| b == w.start_us);
            prop_assert!(expected, "{w:?} starts at no boundary");
            let day = (k - 2..=k + 1)
                .find(|k| c.boundary(*k) == Some(w.start_us))
                .and_then(|k| c.day_of(k))
                .unwrap();
            match period {
                Period::Month { anchor } => {
                    prop_assert_eq!(i16::from(day.day()), anchor.min(i16::from(day.days_in_month())));
                }
                Period::Year { month, day: d } => {
                    prop_assert_eq!(
                        (i16::from(day.month()), i16::from(day.day())),
                        (month, d.min(i16::from(day.days_in_month())))
                    );
                }
                Period::Week { first } => prop_assert_eq!(day.weekday(), first),
                Period::Day => {}
            }
            // Where the local time exists, the window starts at the time of day.
            let wanted = tz.to_ambiguous_timestamp(day.to_datetime(at));
            if matches!(wanted.offset(), jiff::tz::AmbiguousOffset::Unambiguous { .. }) {
                prop_assert_eq!(start_local.time(), at);
            }
        }
    }
}
