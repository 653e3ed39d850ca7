//! Calendar periods (feature `calendar`, issue 48): the windows a daily, weekly, monthly or
//! yearly quota counts in, aligned to a local time of day in an IANA time zone and, for months
//! and years, to an anchor day. Computed on the instance with `jiff` and its bundled time-zone
//! database; the stores are given the window's bounds. This slice holds the arithmetic and its
//! properties; quotas, the syntax and the stores use it next.
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

#![cfg_attr(not(test), allow(dead_code))]

use jiff::civil::{Date, Time, Weekday};
use jiff::tz::TimeZone;
use jiff::{Span, Timestamp};

/// The period a calendar window spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Period {
    /// Every day.
    Day,
    /// Every week, starting on `first`.
    Week { first: Weekday },
    /// Every month, on day `anchor` (1 to 31, clamped to the month's last day).
    Month { anchor: i8 },
    /// Every year, on `month`/`day` (29 February is 28 February in other years).
    Year { month: i8, day: i8 },
}

/// A calendar: a period, the local time of day its windows start, and the zone.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Calendar {
    period: Period,
    at: Time,
    zone: TimeZone,
}

/// A window: `[start, end)`, microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) start_us: i64,
    pub(crate) end_us: i64,
}

const EPOCH: Date = Date::constant(1970, 1, 1);

impl Calendar {
    /// A calendar in `zone` (an IANA name, `UTC` included), its windows starting at `at`.
    pub(crate) fn new(period: Period, at: Time, zone: &str) -> Result<Self, String> {
        match period {
            Period::Month { anchor } if !(1..=31).contains(&anchor) => {
                return Err(format!("day {anchor} of the month: use 1 to 31"));
            }
            Period::Year { month, day } if Date::new(2000, month, day).is_err() => {
                return Err(format!("{month}/{day}: no such day of the year"));
            }
            _ => {}
        }
        let zone = TimeZone::get(zone).map_err(|e| format!("time zone {zone:?}: {e}"))?;
        Ok(Calendar { period, at, zone })
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
                Date::new(year, month, anchor.min(first.days_in_month())).ok()
            }
            Period::Year { month, day } => {
                let year = i16::try_from(k).ok()?;
                let first = Date::new(year, month, 1).ok()?;
                Date::new(year, month, day.min(first.days_in_month())).ok()
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
    pub(crate) fn window(&self, now_us: i64) -> Option<Window> {
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
        let c = Calendar::new(Period::Month { anchor: 31 }, Time::midnight(), "UTC").unwrap();
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
        let c = Calendar::new(Period::Day, Time::midnight(), "America/New_York").unwrap();
        let spring = c.window(us("America/New_York", 2026, 3, 8, 12, 0)).unwrap();
        assert_eq!(spring.end_us - spring.start_us, 23 * HOUR);
        let fall = c
            .window(us("America/New_York", 2026, 11, 1, 12, 0))
            .unwrap();
        assert_eq!(fall.end_us - fall.start_us, 25 * HOUR);
        // Lord Howe moves its clocks by half an hour.
        let c = Calendar::new(Period::Day, Time::midnight(), "Australia/Lord_Howe").unwrap();
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
        let c = Calendar::new(Period::Day, time(2, 30, 0, 0), "America/New_York").unwrap();
        // 2026-03-08 02:30 does not exist in New York: 03:30 EDT.
        let w = c.window(us("America/New_York", 2026, 3, 8, 12, 0)).unwrap();
        assert_eq!(
            local("America/New_York", w.start_us),
            date(2026, 3, 8).at(3, 30, 0, 0)
        );
        let c = Calendar::new(Period::Day, time(1, 30, 0, 0), "America/New_York").unwrap();
        // 2026-11-01 01:30 happens twice: the first (EDT, 05:30 UTC).
        let w = c
            .window(us("America/New_York", 2026, 11, 1, 12, 0))
            .unwrap();
        assert_eq!(w.start_us, us("UTC", 2026, 11, 1, 5, 30));
    }

    #[test]
    fn apias_skipped_day_has_no_window() {
        // Samoa skipped 30 December 2011: the day of the 29th ends where the 31st starts.
        let c = Calendar::new(Period::Day, Time::midnight(), "Pacific/Apia").unwrap();
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
        let c = Calendar::new(
            Period::Week {
                first: Weekday::Monday,
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
            let err = Calendar::new(period, Time::midnight(), zone).unwrap_err();
            assert!(err.contains(word), "{err}");
        }
    }

    fn period() -> impl Strategy<Value = Period> {
        prop_oneof![
            Just(Period::Day),
            (0i8..7).prop_map(|d| Period::Week {
                first: Weekday::from_monday_zero_offset(d).unwrap()
            }),
            (1i8..=31).prop_map(|anchor| Period::Month { anchor }),
            prop_oneof![Just((2i8, 29i8)), (1i8..=12, 1i8..=28)]
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
            let c = Calendar::new(period, at, zone).unwrap();
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
                    prop_assert_eq!(day.day(), anchor.min(day.days_in_month()));
                }
                Period::Year { month, day: d } => {
                    prop_assert_eq!((day.month(), day.day()), (month, d.min(day.days_in_month())));
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
