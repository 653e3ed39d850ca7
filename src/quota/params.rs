//! A quota checked: [`QuotaParams`], its numbers in integer time units as the stores use them,
//! and the checks that make them.

use std::num::NonZeroU32;
use std::time::Duration;

use super::{Algorithm, LEASED, Quota};
use crate::error::ConfigError;

impl Quota {
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
        #[cfg(feature = "calendar")]
        if let Some(calendar) = self.calendar {
            if let Some(reason) = calendar.error() {
                return Err(bad(reason));
            }
            if self.algorithm != Algorithm::FixedWindow || self.resolution.is_some() {
                return Err(bad(
                    "a calendar quota is a fixed window: its windows are the calendar's periods",
                ));
            }
            return Ok(QuotaParams {
                emission_ns: u64::try_from(calendar.nominal().as_nanos() / u128::from(self.count))
                    .unwrap_or(u64::MAX)
                    .max(1),
                burst: limit,
                kind: QuotaKind::Calendar { calendar },
            });
        }
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
    /// A fixed window whose windows are a calendar's periods ([`Quota::calendar`]): a day,
    /// week, month or year in a time zone, computed on the instance.
    #[cfg(feature = "calendar")]
    Calendar {
        /// The calendar.
        calendar: super::Calendar,
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
            #[cfg(feature = "calendar")]
            QuotaKind::Calendar { calendar } => calendar.nominal(),
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
