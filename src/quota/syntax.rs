//! The quota syntax: `"5/s burst 10"`, `"100/min sliding 10s"`, `"10 concurrent"` parsed
//! ([`FromStr`](std::str::FromStr)) and written ([`Display`](std::fmt::Display)), and a quota in
//! configuration files (serde).

use std::time::Duration;

use super::{Algorithm, Quota};
use crate::error::ConfigError;

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
        // A calendar period: `week`, `month`, `year`, or `day` with a calendar option (`day`
        // alone is 24 hours from the epoch).
        let calendar = matches!(first, "week" | "month" | "year")
            || (first == "day" && words.peek().is_some_and(|w| CALENDAR_WORDS.contains(w)));
        if calendar {
            #[cfg(feature = "calendar")]
            return parse_calendar(count as u32, first, words).map_err(|e| bad(&e));
            #[cfg(not(feature = "calendar"))]
            return Err(bad(&format!(
                "a calendar period (`{first}`) needs the crate's `calendar` feature"
            )));
        }
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

/// The words that make `/day` a calendar day.
const CALENDAR_WORDS: [&str; 4] = ["calendar", "at", "tz", "on"];

/// A calendar quota's period and options, after `count/`: `month on 15 at 09:00 tz
/// Europe/Berlin`, then `fixed` (what it is anyway), `bytes` and `block <duration>`.
#[cfg(feature = "calendar")]
fn parse_calendar<'a>(
    count: u32,
    period: &str,
    mut words: impl Iterator<Item = &'a str>,
) -> Result<Quota, String> {
    use super::{Calendar, Weekday};
    let mut on = None;
    let mut at = None;
    let mut zone = None;
    let mut rest = Vec::new();
    let mut marked = false;
    while let Some(word) = words.next() {
        let mut value = |what: &str| {
            words
                .next()
                .ok_or_else(|| format!("`{word}` without {what}"))
        };
        match word {
            "on" if on.is_none() => on = Some(value("a day")?),
            "at" if at.is_none() => at = Some(value("a time of day (e.g. `09:00`)")?),
            "tz" if zone.is_none() => zone = Some(value("a time zone (e.g. `Europe/Berlin`)")?),
            "calendar" if !marked => marked = true,
            "on" | "at" | "tz" | "calendar" => return Err(format!("{word:?} given twice")),
            "burst" | "sliding" | "gcra" => {
                return Err(format!(
                    "{word:?}: a calendar quota is a fixed window, its limit its count and its \
                     windows the calendar's periods"
                ));
            }
            _ => rest.push(word),
        }
    }
    let mut calendar = match (period, on) {
        ("day", None) => Calendar::daily(),
        ("day", Some(_)) => {
            return Err("`on` is for weeks, months and years (a day starts every day)".into());
        }
        ("week", None) => Calendar::weekly(),
        ("week", Some(day)) => Calendar::weekly_from(Weekday::named(day).ok_or_else(|| {
            format!("`on {day}`: a week starts on a day's name (`monday` to `sunday`)")
        })?),
        ("month", None) => Calendar::monthly(),
        ("month", Some(day)) => Calendar::monthly_on(
            day.parse::<u8>()
                .ok()
                .filter(|d| (1..=31).contains(d))
                .ok_or_else(|| format!("`on {day}`: a month starts on a day from 1 to 31"))?,
        ),
        (_, None) => Calendar::yearly(),
        (_, Some(day)) => {
            let md = day
                .split_once('-')
                .and_then(|(m, d)| Some((m.parse::<u8>().ok()?, d.parse::<u8>().ok()?)));
            let (m, d) = md.ok_or_else(|| {
                format!("`on {day}`: a year starts on a month and day, e.g. `on 04-06`")
            })?;
            Calendar::yearly_on(m, d)
        }
    };
    if let Some(text) = at {
        let (h, m, s) = parse_time_of_day(text).map_err(|e| format!("`at {text}`: {e}"))?;
        calendar = calendar.at_second(h, m, s);
    }
    if let Some(zone) = zone {
        calendar = calendar.in_zone(zone);
        if let Some(reason) = calendar.error() {
            return Err(format!("`tz {zone}`: {reason}"));
        }
    }
    if let Some(reason) = calendar.error() {
        return Err(reason.to_owned());
    }
    let mut q = Quota::calendar(count, calendar);
    let mut rest = rest.into_iter();
    while let Some(word) = rest.next() {
        match word {
            "fixed" => {}
            "bytes" if !q.counts_bytes() => q = q.bytes(),
            "block" if q.block_ns.is_none() => {
                let d = rest.next().ok_or("`block` without a duration")?;
                let d = parse_duration(d, false).map_err(|e| format!("the block {d:?}: {e}"))?;
                q = q.block_for(d);
            }
            "bytes" | "block" => return Err(format!("{word:?} given twice")),
            _ => {
                return Err(format!(
                    "unknown word {word:?} after a calendar period (expected `on <day>`, \
                     `at HH:MM`, `tz <IANA zone>`, `bytes` or `block <duration>`)"
                ));
            }
        }
    }
    Ok(q)
}

/// A time of day, `HH:MM` or `HH:MM:SS`.
#[cfg(feature = "calendar")]
pub(crate) fn parse_time_of_day(text: &str) -> Result<(u8, u8, u8), String> {
    let parts: Vec<&str> = text.split(':').collect();
    let n = |i: usize| parts.get(i).map_or(Some(0), |p| p.parse::<u8>().ok());
    match (parts.len(), n(0), n(1), n(2)) {
        (2 | 3, Some(h), Some(m), Some(s)) if h < 24 && m < 60 && s < 60 => Ok((h, m, s)),
        _ => Err("a time of day is `HH:MM` or `HH:MM:SS`, 00:00 to 23:59:59".to_owned()),
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

/// A duration in a configuration file (`"500ms"`, `"1s"`, `"15min"`), as the quota syntax
/// writes it.
#[cfg(feature = "serde")]
fn parse_config_duration(text: &str) -> Result<Duration, String> {
    parse_duration(text.trim(), false)
}

/// [`parse_config_duration`] for the setting `option`: an error names it and the text.
#[cfg(feature = "serde")]
pub(crate) fn config_duration(
    option: &'static str,
    text: &str,
) -> Result<Duration, crate::ConfigError> {
    parse_config_duration(text).map_err(|e| crate::ConfigError::Invalid {
        option,
        reason: format!("the duration {text:?}: {e}"),
    })
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
        #[cfg(feature = "calendar")]
        if let Some(calendar) = self.calendar {
            write!(f, "{}/{calendar}", self.count)?;
            if self.algorithm != Algorithm::FixedWindow {
                f.write_str(" sliding")?;
            }
            if self.counts_bytes() {
                f.write_str(" bytes")?;
            }
            if let Some(b) = self.block() {
                write!(f, " block {}", DisplayDuration(b))?;
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
    use crate::quota::QuotaKind;

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
