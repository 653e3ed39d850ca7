//! The arithmetic of the window algorithms, once, for every store that computes in Rust: the
//! local backend decides with it, and the Redis backend reads its script's replies with it.
//! The Redis script carries the same formulas in Lua, in the same floating-point operations in
//! the same order, so that both give the same answers to the bit (the conformance suite in
//! `tests/redis.rs` holds them to it).
//!
//! Times are integer microseconds since the Unix epoch of the deciding clock, so windows start
//! at the same instants on every replica and in Redis.
//!
//! **Fixed window** of `W` µs and limit `L`: the window holding `now` is `now / W`; its counter
//! starts from zero. A request of cost `k` passes when `count + k <= L`.
//!
//! **Sliding window** of `n` sub-windows of `S` µs (the window is `n * S`) and limit `L`: the
//! counts of the sub-window holding `now` and of the `n` before it are kept. With `r = now % S`
//! the time into the current sub-window, the oldest of them still overlaps the window by
//! `S - r`, and the estimate is
//!
//! ```text
//! E = c_oldest * (S - r) / S + (the other n counts)
//! ```
//!
//! computed in `f64`, in that order. A request of cost `k` passes when `E + k <= L`.
//! `remaining` is `floor(L - E)`: the cost-1 requests that would pass now.

use std::num::NonZeroU32;
use std::time::Duration;

use smallvec::SmallVec;

use super::{Outcome, QuotaState};
use crate::quota::QuotaParams;

/// How a fixed window's time is cut: into windows of a length from the Unix epoch, or into a
/// calendar's periods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FixedClock {
    /// Windows of this many microseconds, from the epoch.
    Epoch(u64),
    /// A calendar's periods (their index: their start in seconds since the epoch).
    #[cfg(feature = "calendar")]
    Calendar(crate::quota::CalendarClock),
}

/// The fixed window holding a time: its index (`now / W` from the epoch; a calendar's, its
/// start in seconds), its start and its end (µs since the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FixedAt {
    pub(crate) index: u64,
    pub(crate) start_us: u64,
    pub(crate) end_us: u64,
}

impl FixedClock {
    /// The clock of a fixed window or calendar quota (`None` for other kinds).
    pub(crate) fn of(params: &QuotaParams) -> Option<Self> {
        match params.kind {
            crate::quota::QuotaKind::FixedWindow { window_us } => {
                Some(FixedClock::Epoch(window_us))
            }
            #[cfg(feature = "calendar")]
            crate::quota::QuotaKind::Calendar { calendar } => {
                Some(FixedClock::Calendar(calendar.clock()))
            }
            _ => None,
        }
    }

    /// The window holding `now_us`.
    #[inline]
    pub(crate) fn at(&self, now_us: u64) -> FixedAt {
        match *self {
            FixedClock::Epoch(window_us) => {
                let index = now_us / window_us;
                FixedAt {
                    index,
                    start_us: index * window_us,
                    end_us: (index + 1) * window_us,
                }
            }
            #[cfg(feature = "calendar")]
            FixedClock::Calendar(calendar) => match calendar.window_us(now_us) {
                Some((start_us, end_us)) => FixedAt {
                    index: start_us / 1_000_000,
                    start_us,
                    end_us,
                },
                // Settings that are not valid are refused when the layer is built, and the
                // calendar covers every time up to 9999: past that, days from the epoch.
                None => FixedClock::Epoch(86_400_000_000).at(now_us),
            },
        }
    }
}

/// A fixed window's counter: which window it counts, and how much it has counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FixedState {
    /// The index of the window counted ([`FixedAt::index`]).
    pub(crate) window: u64,
    pub(crate) count: u32,
}

impl FixedState {
    /// Decides a request of `cost` at `now_us` in a window of `window_us`, counting it when it
    /// passes; the state is moved to the current window first.
    pub(crate) fn decide(
        &mut self,
        index: usize,
        params: &QuotaParams,
        at: FixedAt,
        now_us: u64,
        cost: NonZeroU32,
    ) -> QuotaState {
        self.advance(at.index);
        let limit = params.burst.get();
        let code = if cost.get() > limit {
            Code::NeverFits
        } else if u64::from(self.count) + u64::from(cost.get()) <= u64::from(limit) {
            self.count += cost.get();
            Code::Allowed
        } else {
            Code::Denied
        };
        fixed_state(index, params, code, self.count, at.end_us - now_us)
    }

    /// Settles `units` at `now_us`: a debit counts them in the current window (past the limit
    /// if need be: refused until the window ends); a refund of units counted at `admitted_us`
    /// takes them off that window's count, if it is still the current one (never below zero).
    pub(crate) fn settle(
        &mut self,
        index: usize,
        params: &QuotaParams,
        at: FixedAt,
        now_us: u64,
        settlement: Settlement,
    ) -> QuotaState {
        self.advance(at.index);
        match settlement {
            Settlement::Debit(units) => self.count = self.count.saturating_add(units),
            Settlement::Refund { units, admitted_us } => {
                if (at.start_us..at.end_us).contains(&admitted_us) {
                    self.count = self.count.saturating_sub(units);
                }
            }
        }
        fixed_state(index, params, Code::Allowed, self.count, at.end_us - now_us)
    }

    /// The state at `now_us` without deciding anything.
    pub(crate) fn peek(
        mut self,
        index: usize,
        params: &QuotaParams,
        at: FixedAt,
        now_us: u64,
    ) -> QuotaState {
        self.advance(at.index);
        fixed_state(
            index,
            params,
            Code::NeverFits,
            self.count,
            at.end_us - now_us,
        )
    }

    fn advance(&mut self, window: u64) {
        if self.window != window {
            self.window = window;
            self.count = 0;
        }
    }

    /// Whether the counter is of a window that has ended (indistinguishable from none).
    pub(crate) fn is_idle(&self, at: FixedAt) -> bool {
        self.window < at.index || self.count == 0
    }
}

/// What a window said of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    Allowed,
    Denied,
    NeverFits,
}

/// A fixed window's state after a decision: `count` counted, `until_end_us` left in the
/// window. More quota comes at the window's end (`t`), unless nothing is counted.
pub(crate) fn fixed_state(
    index: usize,
    params: &QuotaParams,
    code: Code,
    count: u32,
    until_end_us: u64,
) -> QuotaState {
    let limit = params.burst.get();
    let remaining = limit.saturating_sub(count);
    let until_end = Duration::from_micros(until_end_us);
    let reset_after = if count == 0 {
        Duration::ZERO
    } else {
        until_end
    };
    QuotaState {
        index,
        outcome: match code {
            Code::Allowed => Outcome::Allowed,
            Code::Denied => Outcome::Denied {
                retry_after: until_end,
            },
            Code::NeverFits => Outcome::NeverFits,
        },
        limit,
        remaining,
        reset_after,
    }
}

/// The state of a concurrent quota holding `held` slots: its free slots; never a time until
/// more (a slot comes back when a request ends, not at a time).
pub(crate) fn in_flight_state(
    index: usize,
    params: &QuotaParams,
    held: u64,
    allowed: bool,
) -> QuotaState {
    let slots = params.burst.get();
    QuotaState {
        index,
        outcome: if allowed {
            Outcome::Allowed
        } else {
            // A slot comes back when a request ends: ask again in a second.
            Outcome::Denied {
                retry_after: IN_FLIGHT_RETRY,
            }
        },
        limit: slots,
        remaining: slots.saturating_sub(u32::try_from(held).unwrap_or(u32::MAX)),
        reset_after: if allowed {
            Duration::ZERO
        } else {
            IN_FLIGHT_RETRY
        },
    }
}

/// When a request refused by a full concurrent quota is told to try again.
pub(crate) const IN_FLIGHT_RETRY: Duration = Duration::from_secs(1);

/// A settlement of a window quota's count (see [`Mode::Refund`](super::Mode::Refund) and
/// [`Mode::Debit`](super::Mode::Debit)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settlement {
    /// Count `units` more now.
    Debit(u32),
    /// Give back `units` counted at `admitted_us`.
    Refund { units: u32, admitted_us: u64 },
}

/// Sub-windows with counts (8 bytes each) that count as one more key against the local
/// store's cap.
pub(crate) const PAIRS_PER_KEY: usize = 16;

/// A sliding window's counts, as the local store keeps them: only the sub-windows that counted
/// something, oldest first, each as its index modulo 2³² and its count. A key that counted in
/// one sub-window costs one pair, whatever the window's resolution: the memory a key takes
/// follows what it used, not the number of sub-windows (a thousand sub-windows used to cost
/// 4 KB per key). The arithmetic is the dense one's ([`estimate`], [`wait_us`]) on the
/// sub-windows in the window, to the bit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlidingState {
    /// `n`: the window is `n` sub-windows, plus the oldest one sliding out.
    slices: u32,
    /// What its counts take of the local store's key cap beyond the entry itself (see
    /// [`cap_units`](Self::cap_units)), as last counted there.
    pub(crate) charged: u32,
    counts: SmallVec<[(u32, u32); 1]>,
}

impl SlidingState {
    /// A sliding window of `slices` sub-windows with nothing counted.
    pub(crate) fn new(slices: u32) -> Self {
        SlidingState {
            slices,
            charged: 0,
            counts: SmallVec::new(),
        }
    }

    /// The sub-window `slice`, or the newest counted if that is later (a clock read before
    /// it counts into it, as the dense state did).
    fn now(&self, slice: u64) -> u32 {
        let now = slice as u32;
        match self.counts.last() {
            Some(&(newest, _)) if (newest.wrapping_sub(now) as i32) > 0 => newest,
            _ => now,
        }
    }

    /// The counts in the window of sub-window `now` (its position from the oldest, 0 to `n`),
    /// oldest first.
    fn in_window(&self, now: u32) -> impl Iterator<Item = (usize, u32)> + Clone + '_ {
        let n = self.slices;
        self.counts.iter().filter_map(move |&(at, count)| {
            let age = now.wrapping_sub(at);
            (age <= n && count > 0).then(|| ((n - age) as usize, count))
        })
    }

    /// Drops the counts that left the window of sub-window `now`.
    fn prune(&mut self, now: u32) {
        let n = self.slices;
        let gone = (self.counts.iter())
            .take_while(|&&(at, _)| now.wrapping_sub(at) > n)
            .count();
        if gone > 0 {
            self.counts.drain(..gone);
        }
    }

    /// Counts `units` into sub-window `now` (the newest).
    fn add(&mut self, now: u32, units: u32) {
        match self.counts.last_mut() {
            Some((at, count)) if *at == now => *count = count.saturating_add(units),
            _ => self.counts.push((now, units)),
        }
    }

    fn kept(&self) -> usize {
        self.slices as usize + 1
    }

    /// Decides a request of `cost` at `now_us`, counting it when it passes.
    pub(crate) fn decide(
        &mut self,
        index: usize,
        params: &QuotaParams,
        slice_us: u64,
        now_us: u64,
        cost: NonZeroU32,
    ) -> QuotaState {
        let now = self.now(now_us / slice_us);
        self.prune(now);
        let limit = params.burst.get();
        let r = now_us % slice_us;
        let e = estimate_by(self.in_window(now), slice_us, r);
        let cost_n = cost.get();
        let code = if cost_n > limit {
            Code::NeverFits
        } else if e + f64::from(cost_n) <= f64::from(limit) {
            self.add(now, cost_n);
            Code::Allowed
        } else {
            Code::Denied
        };
        let kept = self.kept();
        sliding_state_by(
            index,
            params,
            code,
            self.in_window(now),
            kept,
            slice_us,
            r,
            cost,
        )
    }

    /// Settles `units` at `now_us`: a debit counts them in the newest sub-window (past the
    /// limit if need be: refused until they slide out); a refund of units counted at
    /// `admitted_us` takes them off that sub-window's count, if it is still in the window
    /// (never below zero).
    pub(crate) fn settle(
        &mut self,
        index: usize,
        params: &QuotaParams,
        slice_us: u64,
        now_us: u64,
        settlement: Settlement,
    ) -> QuotaState {
        let now = self.now(now_us / slice_us);
        self.prune(now);
        match settlement {
            Settlement::Debit(units) => self.add(now, units),
            Settlement::Refund { units, admitted_us } => {
                let at = (admitted_us / slice_us) as u32;
                if now.wrapping_sub(at) <= self.slices
                    && let Some(i) = self.counts.iter().position(|&(s, _)| s == at)
                {
                    let left = self.counts[i].1.saturating_sub(units);
                    if left == 0 {
                        self.counts.remove(i);
                    } else {
                        self.counts[i].1 = left;
                    }
                }
            }
        }
        let r = now_us % slice_us;
        let kept = self.kept();
        let counts = self.in_window(now);
        sliding_state_by(
            index,
            params,
            Code::Allowed,
            counts,
            kept,
            slice_us,
            r,
            NonZeroU32::MIN,
        )
    }

    /// What a request of `cost` at `now_us` would get, changing nothing and allocating
    /// nothing.
    pub(crate) fn check(
        &self,
        index: usize,
        params: &QuotaParams,
        slice_us: u64,
        now_us: u64,
        cost: NonZeroU32,
    ) -> QuotaState {
        let now = self.now(now_us / slice_us);
        let r = now_us % slice_us;
        let limit = params.burst.get();
        let code = if cost.get() > limit {
            Code::NeverFits
        } else if estimate_by(self.in_window(now), slice_us, r) + f64::from(cost.get())
            <= f64::from(limit)
        {
            Code::Allowed
        } else {
            Code::Denied
        };
        let kept = self.kept();
        sliding_state_by(
            index,
            params,
            code,
            self.in_window(now),
            kept,
            slice_us,
            r,
            cost,
        )
    }

    /// The state at `now_us` without deciding anything.
    pub(crate) fn peek(
        &self,
        index: usize,
        params: &QuotaParams,
        slice_us: u64,
        now_us: u64,
    ) -> QuotaState {
        let now = self.now(now_us / slice_us);
        let r = now_us % slice_us;
        let (kept, counts) = (self.kept(), self.in_window(now));
        sliding_state_by(
            index,
            params,
            Code::NeverFits,
            counts,
            kept,
            slice_us,
            r,
            NonZeroU32::MAX,
        )
    }

    /// A window of `slices` sub-windows holding `count` units in the sub-window of `now_us`:
    /// what a key carries over from a changed quota.
    #[cfg(feature = "local")]
    pub(crate) fn carried(slices: u32, slice_us: u64, now_us: u64, count: u32) -> Self {
        let mut state = SlidingState::new(slices);
        if count > 0 {
            state.add((now_us / slice_us) as u32, count);
        }
        state
    }

    /// The units the window holds at `now_us`: its estimate.
    #[cfg(feature = "local")]
    pub(crate) fn used(&self, slice_us: u64, now_us: u64) -> f64 {
        let now = self.now(now_us / slice_us);
        estimate_by(self.in_window(now), slice_us, now_us % slice_us)
    }

    /// Whether every count has left the window (indistinguishable from nothing counted).
    pub(crate) fn is_idle(&self, slice_us: u64, now_us: u64) -> bool {
        self.in_window(self.now(now_us / slice_us)).next().is_none()
    }

    /// The units counted in the sub-windows kept (its weight when the local store must evict).
    pub(crate) fn total(&self) -> u64 {
        self.counts.iter().map(|&(_, c)| u64::from(c)).sum()
    }

    /// The sub-windows with counts held: what the state costs beyond its fixed part.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.counts.len()
    }

    /// What its counts take of a key cap beyond the entry itself, in keys: one more for every
    /// [`PAIRS_PER_KEY`] sub-windows held (8 bytes each: about what an entry costs), so that a
    /// cap on keys bounds the bytes they take whatever the window's resolution.
    pub(crate) fn cap_units(&self) -> u32 {
        (self.counts.len() / PAIRS_PER_KEY) as u32
    }

    /// The counts of the window of `now_us` as the dense state kept them, oldest first.
    #[cfg(test)]
    pub(crate) fn dense(&self, slice_us: u64, now_us: u64) -> Vec<u32> {
        let mut dense = vec![0; self.kept()];
        for (m, c) in self.in_window(self.now(now_us / slice_us)) {
            dense[m] = c;
        }
        dense
    }
}

/// The estimate `c_oldest * (S - r) / S + rest`, in this order of `f64` operations (the Redis
/// script computes the same).
#[cfg(test)]
pub(crate) fn estimate(counts: &[u32], slice_us: u64, r: u64) -> f64 {
    estimate_by(dense(counts), slice_us, r)
}

/// The nonzero counts of a dense window, with their positions.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
fn dense(counts: &[u32]) -> impl Iterator<Item = (usize, u32)> + Clone + '_ {
    counts.iter().copied().enumerate().filter(|&(_, c)| c > 0)
}

/// [`estimate`] of the counts `counts` gives with their positions (0 the oldest), ascending.
pub(crate) fn estimate_by(
    counts: impl Iterator<Item = (usize, u32)>,
    slice_us: u64,
    r: u64,
) -> f64 {
    let (mut oldest, mut rest) = (0u32, 0u64);
    for (m, c) in counts {
        if m == 0 {
            oldest = c;
        } else {
            rest += u64::from(c);
        }
    }
    f64::from(oldest) * (slice_us - r) as f64 / slice_us as f64 + rest as f64
}

/// A sliding window's state after a decision, from its counts (moved to the current sub-window
/// and including this request when it passed), `r` µs into the current sub-window.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn sliding_state(
    index: usize,
    params: &QuotaParams,
    code: Code,
    counts: &[u32],
    slice_us: u64,
    r: u64,
    cost: NonZeroU32,
) -> QuotaState {
    sliding_state_by(
        index,
        params,
        code,
        dense(counts),
        counts.len(),
        slice_us,
        r,
        cost,
    )
}

/// [`sliding_state`] of the window of `kept` sub-windows whose counts `counts` gives with
/// their positions, ascending.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sliding_state_by(
    index: usize,
    params: &QuotaParams,
    code: Code,
    counts: impl Iterator<Item = (usize, u32)> + Clone,
    kept: usize,
    slice_us: u64,
    r: u64,
    cost: NonZeroU32,
) -> QuotaState {
    let limit = params.burst.get();
    let e = estimate_by(counts.clone(), slice_us, r);
    let remaining = remaining(limit, e);
    // More quota comes when one more request of cost 1 fits: the wait of a request of cost
    // `remaining + 1`, which does not fit now. Nothing more comes when nothing is counted.
    let reset_after = if remaining >= limit {
        Duration::ZERO
    } else {
        Duration::from_micros(wait_us_by(
            counts.clone(),
            kept,
            slice_us,
            r,
            limit,
            remaining + 1,
        ))
    };
    let outcome = match code {
        Code::Allowed => Outcome::Allowed,
        Code::NeverFits => Outcome::NeverFits,
        Code::Denied => Outcome::Denied {
            retry_after: Duration::from_micros(wait_us_by(
                counts,
                kept,
                slice_us,
                r,
                limit,
                cost.get(),
            )),
        },
    };
    QuotaState {
        index,
        outcome,
        limit,
        remaining,
        reset_after,
    }
}

/// `floor(L - E)`, at least 0: the cost-1 requests that would pass now.
pub(crate) fn remaining(limit: u32, e: f64) -> u32 {
    let r = (f64::from(limit) - e).floor();
    if r <= 0.0 { 0 } else { r as u32 }
}

/// Microseconds from now until a request of `cost` (at most the limit) fits, if nothing else
/// is counted meanwhile: sub-window by sub-window, the oldest count still in the window slides
/// out linearly, and at each boundary it leaves and the next becomes the oldest.
///
/// Linear in the sub-windows: the sum of the counts after the oldest is kept as it goes, not
/// summed again for each sub-window (as the Redis script does).
#[cfg(test)]
pub(crate) fn wait_us(counts: &[u32], slice_us: u64, r: u64, limit: u32, cost: u32) -> u64 {
    wait_us_by(dense(counts), counts.len(), slice_us, r, limit, cost)
}

/// [`wait_us`] of the window of `kept` sub-windows whose nonzero counts `counts` gives with
/// their positions (0 the oldest), ascending: the sub-windows without counts are passed over
/// in one step each run, so the walk is linear in the counts held, not in the sub-windows.
fn wait_us_by(
    counts: impl Iterator<Item = (usize, u32)> + Clone,
    kept: usize,
    slice_us: u64,
    r: u64,
    limit: u32,
    cost: u32,
) -> u64 {
    let s = slice_us;
    let (limit, cost) = (u64::from(limit), u64::from(cost));
    // Where a sub-window `m` without counts starts to be waited for: its start (the time into
    // the current one, for the oldest).
    let empty_at = |m: usize| (m as u64 * s).saturating_sub(r);
    // The counts after the sub-window looked at: all of them to begin with.
    let mut after: u64 = counts.clone().map(|(_, c)| u64::from(c)).sum();
    let mut next = 0;
    for (m, old) in counts {
        // Empty sub-windows before this one: the first fits if any does.
        if next < m && after + cost <= limit {
            return empty_at(next);
        }
        let old = u64::from(old);
        after -= old;
        next = m + 1;
        if after + cost > limit {
            continue;
        }
        // The segment: the m-th sub-window from the current one, from position `from` (the
        // time into it) to its end; position p in it is `m * S + p - r` from now.
        let from = if m == 0 { r } else { 0 };
        let need = limit - cost - after;
        // Fits at position p when old * (S - p) / S + after + cost <= limit.
        let fits = |p: u64| {
            old as f64 * (s - p) as f64 / s as f64 + after as f64 + cost as f64 <= limit as f64
        };
        let p = s as f64 - need as f64 * s as f64 / old as f64;
        let mut p = if p <= from as f64 {
            from
        } else {
            p.ceil() as u64
        };
        // Floating-point rounding can leave the first candidate a microsecond late (long
        // sub-windows) or short: step back while the one before fits, then on while it does
        // not. The Redis script does the same.
        for _ in 0..4 {
            if p > from && fits(p - 1) {
                p -= 1;
            } else {
                break;
            }
        }
        for _ in 0..4 {
            if p >= s || fits(p) {
                break;
            }
            p += 1;
        }
        if p < s {
            return m as u64 * s + p - r;
        }
    }
    if next < kept && after + cost <= limit {
        return empty_at(next);
    }
    // Every count has slid out.
    (kept as u64 * s).saturating_sub(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;

    /// The sliding state as it was before #35 (dense: every sub-window of the window held),
    /// with the wait computed sub-window by sub-window: the reference the sparse state must
    /// agree with to the bit.
    #[derive(Clone)]
    struct Dense {
        slice: u64,
        counts: Vec<u32>,
    }

    impl Dense {
        fn new(slices: u32) -> Self {
            Dense {
                slice: 0,
                counts: vec![0; slices as usize + 1],
            }
        }

        fn advance(&mut self, slice: u64) {
            let kept = self.counts.len() as u64;
            let by = slice.saturating_sub(self.slice);
            if by >= kept {
                self.counts.iter_mut().for_each(|c| *c = 0);
            } else if by > 0 {
                let by = by as usize;
                self.counts.rotate_left(by);
                let len = self.counts.len();
                self.counts[len - by..].iter_mut().for_each(|c| *c = 0);
            }
            self.slice = self.slice.max(slice);
        }

        fn state(&self, p: &QuotaParams, code: Code, s: u64, now: u64, cost: u32) -> QuotaState {
            let limit = p.burst.get();
            let r = now % s;
            let e = estimate(&self.counts, s, r);
            let remaining = remaining(limit, e);
            let reset_after = if remaining >= limit {
                Duration::ZERO
            } else {
                Duration::from_micros(dense_wait(&self.counts, s, r, limit, remaining + 1))
            };
            let outcome = match code {
                Code::Allowed => Outcome::Allowed,
                Code::NeverFits => Outcome::NeverFits,
                Code::Denied => Outcome::Denied {
                    retry_after: Duration::from_micros(dense_wait(&self.counts, s, r, limit, cost)),
                },
            };
            QuotaState {
                index: 0,
                outcome,
                limit,
                remaining,
                reset_after,
            }
        }

        fn decide(&mut self, p: &QuotaParams, s: u64, now: u64, cost: u32) -> QuotaState {
            self.advance(now / s);
            let limit = p.burst.get();
            let e = estimate(&self.counts, s, now % s);
            let code = if cost > limit {
                Code::NeverFits
            } else if e + f64::from(cost) <= f64::from(limit) {
                let newest = self.counts.len() - 1;
                self.counts[newest] = self.counts[newest].saturating_add(cost);
                Code::Allowed
            } else {
                Code::Denied
            };
            self.state(p, code, s, now, cost)
        }

        fn settle(&mut self, p: &QuotaParams, s: u64, now: u64, st: Settlement) -> QuotaState {
            self.advance(now / s);
            let newest = self.counts.len() - 1;
            match st {
                Settlement::Debit(units) => {
                    self.counts[newest] = self.counts[newest].saturating_add(units)
                }
                Settlement::Refund { units, admitted_us } => {
                    let ago = self.slice.checked_sub(admitted_us / s);
                    if let Some(at) =
                        ago.and_then(|ago| newest.checked_sub(usize::try_from(ago).ok()?))
                    {
                        self.counts[at] = self.counts[at].saturating_sub(units);
                    }
                }
            }
            self.state(p, Code::Allowed, s, now, 1)
        }
    }

    /// The wait as it was computed before #35: every sub-window in turn.
    fn dense_wait(counts: &[u32], s: u64, r: u64, limit: u32, cost: u32) -> u64 {
        let n = counts.len();
        let mut rest: u64 = counts.iter().skip(1).map(|&c| u64::from(c)).sum();
        for (m, &old) in counts.iter().enumerate() {
            let old = u64::from(old);
            if m > 0 {
                rest = rest.saturating_sub(old);
            }
            let (limit, cost) = (u64::from(limit), u64::from(cost));
            if rest + cost > limit {
                continue;
            }
            let from = if m == 0 { r } else { 0 };
            let need = limit - cost - rest;
            if old == 0 {
                return m as u64 * s + from - r;
            }
            let fits = |p: u64| {
                old as f64 * (s - p) as f64 / s as f64 + rest as f64 + cost as f64 <= limit as f64
            };
            let p = s as f64 - need as f64 * s as f64 / old as f64;
            let mut p = if p <= from as f64 {
                from
            } else {
                p.ceil() as u64
            };
            for _ in 0..4 {
                if p > from && fits(p - 1) {
                    p -= 1;
                } else {
                    break;
                }
            }
            for _ in 0..4 {
                if p >= s || fits(p) {
                    break;
                }
                p += 1;
            }
            if p < s {
                return m as u64 * s + p - r;
            }
        }
        (n as u64 * s).saturating_sub(r)
    }

    proptest::proptest! {
        /// Issue 35, finding 4: the sparse state (only the sub-windows that counted) answers
        /// every decision, settlement, check and peek exactly as the dense one did, and holds
        /// no more pairs than sub-windows it counted in.
        #[test]
        fn the_sparse_window_agrees_with_the_dense_one(
            limit in 1u32..60,
            slices in proptest::sample::select(vec![1u32, 2, 3, 8, 12, 60, 1000]),
            ops in proptest::collection::vec((0u64..4_000_000, 0u8..10, 1u32..8), 1..120),
        ) {
            let q = Quota::new(limit, Duration::from_secs(60))
                .sliding_window()
                .resolution(Duration::from_micros(60_000_000 / u64::from(slices)));
            let p = params(q);
            let crate::quota::QuotaKind::SlidingWindow { slice_us, slices } = p.kind else {
                unreachable!("a sliding quota")
            };
            let mut sparse = SlidingState::new(slices);
            let mut dense = Dense::new(slices);
            let mut now = 1_700_000_000_000_000u64;
            let mut admitted = Vec::new();
            for (step, op, cost) in ops {
                now += step;
                let c = NonZeroU32::new(cost).unwrap();
                let (a, b) = match op {
                    0..=5 => {
                        let a = sparse.decide(0, &p, slice_us, now, c);
                        if a.outcome == Outcome::Allowed {
                            admitted.push((now, cost));
                        }
                        (a, dense.decide(&p, slice_us, now, cost))
                    }
                    6 => {
                        let st = Settlement::Debit(cost);
                        (sparse.settle(0, &p, slice_us, now, st), dense.settle(&p, slice_us, now, st))
                    }
                    7 => {
                        let (at, units) = admitted.pop().unwrap_or((now, cost));
                        let st = Settlement::Refund { units, admitted_us: at };
                        (sparse.settle(0, &p, slice_us, now, st), dense.settle(&p, slice_us, now, st))
                    }
                    8 => {
                        let mut d = dense.clone();
                        d.advance(now / slice_us);
                        let e = estimate(&d.counts, slice_us, now % slice_us);
                        let code = if cost > limit {
                            Code::NeverFits
                        } else if e + f64::from(cost) <= f64::from(limit) {
                            Code::Allowed
                        } else {
                            Code::Denied
                        };
                        (sparse.check(0, &p, slice_us, now, c), d.state(&p, code, slice_us, now, cost))
                    }
                    _ => {
                        let mut d = dense.clone();
                        d.advance(now / slice_us);
                        let peeked = d.state(&p, Code::NeverFits, slice_us, now, u32::MAX);
                        (sparse.peek(0, &p, slice_us, now), peeked)
                    }
                };
                proptest::prop_assert_eq!(a, b);
                let mut d = dense.clone();
                d.advance(now / slice_us);
                proptest::prop_assert_eq!(sparse.dense(slice_us, now), d.counts.clone());
                // What it holds: the sub-windows with counts in the window (after a change;
                // a check or a peek leaves those that slid out for the next change).
                let counted = d.counts.iter().filter(|&&c| c > 0).count();
                if op <= 7 {
                    proptest::prop_assert_eq!(sparse.held(), counted);
                }
                proptest::prop_assert!(sparse.held() <= slices as usize + 1);
            }
        }
    }

    fn params(q: Quota) -> QuotaParams {
        q.params("p").unwrap()
    }

    #[test]
    fn fixed_windows_reset_on_the_boundary() {
        let p = params(Quota::per_second(3).fixed_window());
        let mut s = FixedState::default();
        let one = NonZeroU32::MIN;
        let at = |ms: u64| 10_000_000 + ms * 1000;
        for left in [2, 1, 0] {
            let q = s.decide(
                0,
                &p,
                FixedClock::Epoch(1_000_000).at(at(100)),
                at(100),
                one,
            );
            assert_eq!((q.outcome, q.remaining), (Outcome::Allowed, left));
            assert_eq!(q.reset_after, Duration::from_millis(900));
        }
        let q = s.decide(
            0,
            &p,
            FixedClock::Epoch(1_000_000).at(at(999)),
            at(999),
            one,
        );
        assert_eq!(
            q.outcome,
            Outcome::Denied {
                retry_after: Duration::from_millis(1)
            }
        );
        let q = s.decide(
            0,
            &p,
            FixedClock::Epoch(1_000_000).at(at(1000)),
            at(1000),
            one,
        );
        assert_eq!((q.outcome, q.remaining), (Outcome::Allowed, 2));
        let q = s.decide(
            0,
            &p,
            FixedClock::Epoch(1_000_000).at(at(1000)),
            at(1000),
            NonZeroU32::new(4).unwrap(),
        );
        assert_eq!((q.outcome, q.remaining), (Outcome::NeverFits, 2));
    }

    #[test]
    fn a_fixed_window_refunds_only_the_window_that_counted() {
        let p = params(Quota::per_second(3).fixed_window());
        let mut s = FixedState::default();
        let one = NonZeroU32::MIN;
        let w = 1_000_000;
        let at = |ms: u64| 10_000_000 + ms * 1000;
        s.decide(0, &p, FixedClock::Epoch(w).at(at(100)), at(100), one);
        s.decide(0, &p, FixedClock::Epoch(w).at(at(200)), at(200), one);
        // A refund in the same window gives one back.
        let refund = |units, admitted_us| Settlement::Refund { units, admitted_us };
        let q = s.settle(
            0,
            &p,
            FixedClock::Epoch(w).at(at(300)),
            at(300),
            refund(1, at(100)),
        );
        assert_eq!(q.remaining, 2);
        // Never below zero.
        let q = s.settle(
            0,
            &p,
            FixedClock::Epoch(w).at(at(300)),
            at(300),
            refund(5, at(200)),
        );
        assert_eq!((q.remaining, q.reset_after), (3, Duration::ZERO));
        // Counted in this window, refunded in the next: that window's count is untouched.
        s.decide(0, &p, FixedClock::Epoch(w).at(at(900)), at(900), one);
        s.decide(0, &p, FixedClock::Epoch(w).at(at(1100)), at(1100), one);
        let q = s.settle(
            0,
            &p,
            FixedClock::Epoch(w).at(at(1200)),
            at(1200),
            refund(1, at(900)),
        );
        assert_eq!(q.remaining, 2);
        // A debit counts past the limit, until the window ends.
        let q = s.settle(
            0,
            &p,
            FixedClock::Epoch(w).at(at(1300)),
            at(1300),
            Settlement::Debit(10),
        );
        assert_eq!(q.remaining, 0);
        assert!(
            s.decide(0, &p, FixedClock::Epoch(w).at(at(1999)), at(1999), one)
                .outcome
                != Outcome::Allowed
        );
        assert_eq!(
            s.decide(0, &p, FixedClock::Epoch(w).at(at(2000)), at(2000), one)
                .outcome,
            Outcome::Allowed
        );
    }

    #[test]
    fn a_sliding_window_refunds_the_sub_window_that_counted() {
        // 4 per second in sub-windows of 250 ms.
        let p = params(
            Quota::per_second(4)
                .sliding_window()
                .resolution(Duration::from_millis(250)),
        );
        let (slice_us, slices) = match p.kind {
            crate::quota::QuotaKind::SlidingWindow { slice_us, slices } => (slice_us, slices),
            _ => unreachable!("a sliding quota"),
        };
        let mut s = SlidingState::new(slices);
        let one = NonZeroU32::MIN;
        let at = |ms: u64| 10_000_000 + ms * 1000;
        s.decide(0, &p, slice_us, at(0), one);
        s.decide(0, &p, slice_us, at(300), one);
        let dense = s.dense(slice_us, at(400));
        let newest = dense.len() - 1;
        assert_eq!(&dense[newest - 1..], &[1, 1]);
        // The unit counted at 0 ms is given back to its own sub-window, later.
        let refund = Settlement::Refund {
            units: 1,
            admitted_us: at(0),
        };
        s.settle(0, &p, slice_us, at(400), refund);
        assert_eq!(&s.dense(slice_us, at(400))[newest - 1..], &[0, 1]);
        assert_eq!(s.held(), 1, "a sub-window refunded to zero is not kept");
        // A refund for a sub-window that has slid out changes nothing, not the counts now.
        s.decide(0, &p, slice_us, at(5_000), one);
        let old = Settlement::Refund {
            units: 1,
            admitted_us: at(300),
        };
        s.settle(0, &p, slice_us, at(5_100), old);
        assert_eq!(s.dense(slice_us, at(5_100)).iter().sum::<u32>(), 1);
        assert_eq!(s.dense(slice_us, at(5_100))[newest], 1);
    }

    #[test]
    fn the_largest_limits_never_overflow() {
        let p = params(Quota::new(u32::MAX, Duration::from_secs(3600)).fixed_window());
        let mut s = FixedState::default();
        let big = |n: u32| NonZeroU32::new(n).unwrap();
        assert_eq!(
            s.decide(
                0,
                &p,
                FixedClock::Epoch(3_600_000_000).at(7),
                7,
                big(3_000_000_000)
            )
            .outcome,
            Outcome::Allowed
        );
        assert_ne!(
            s.decide(
                0,
                &p,
                FixedClock::Epoch(3_600_000_000).at(8),
                8,
                big(2_000_000_000)
            )
            .outcome,
            Outcome::Allowed
        );
        assert_eq!(s.count, 3_000_000_000);
        let q = s.decide(
            0,
            &p,
            FixedClock::Epoch(3_600_000_000).at(9),
            9,
            big(u32::MAX - 3_000_000_000),
        );
        assert_eq!((q.outcome, q.remaining), (Outcome::Allowed, 0));
    }

    #[test]
    fn sliding_windows_weigh_the_previous_window() {
        // 10 per second, one sub-window: the previous second's 10 weigh 10 * (1 - f).
        let p = params(Quota::per_second(10).sliding_window());
        let s_us = 1_000_000;
        let mut s = SlidingState::new(1);
        let one = NonZeroU32::MIN;
        for _ in 0..10 {
            assert_eq!(
                s.decide(0, &p, s_us, 5 * s_us, one).outcome,
                Outcome::Allowed
            );
        }
        // 25 % into the next second, 7.5 still count: 2 more pass.
        let now = 6 * s_us + s_us / 4;
        let q = s.decide(0, &p, s_us, now, one);
        assert_eq!((q.outcome, q.remaining), (Outcome::Allowed, 1));
        let q = s.decide(0, &p, s_us, now, one);
        assert_eq!((q.outcome, q.remaining), (Outcome::Allowed, 0));
        let q = s.decide(0, &p, s_us, now, one);
        // 7.5 + 2 = 9.5 counted; one more fits once 0.5 has slid out: 0.5 / 10 of a second.
        assert_eq!(
            q.outcome,
            Outcome::Denied {
                retry_after: Duration::from_millis(50)
            }
        );
        assert_eq!(q.reset_after, Duration::from_millis(50));
        // A request of 9 needs 8.5 to slide out... more than the 7.5 there: it waits for the
        // end of the sub-window and then the current counts' own weight.
        let q = s.decide(0, &p, s_us, now, NonZeroU32::new(9).unwrap());
        let Outcome::Denied { retry_after } = q.outcome else {
            panic!("{q:?}")
        };
        // At 7 s, the two requests of this second weigh 2 * (1 - f); 9 fit when 2(1-f) <= 1:
        // half way through, 7.5 s, 1.25 s from now.
        assert_eq!(retry_after, Duration::from_millis(1250));
    }

    #[test]
    fn waits_are_exact_for_long_sub_windows() {
        // Sub-windows of a week to a year, where `ceil` of the float alone can be a µs late.
        let mut seed = 5u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..20_000 {
            let s = 604_800_000_000 + next(3_000_000_000_000_000);
            let limit = 1 + next(1_000_000) as u32;
            let counts = [
                1 + next(u64::from(limit)) as u32,
                next(u64::from(limit) / 2 + 1) as u32,
            ];
            let r = next(s);
            let cost = 1 + next(u64::from(limit)) as u32;
            let wait = wait_us(&counts, s, r, limit, cost);
            let fits_after = |d: u64| {
                // The estimate `d` µs from now, with the counts moved on as time passes.
                let (slice, pos) = ((r + d) / s, (r + d) % s);
                let shifted: Vec<u32> = counts.iter().skip(slice as usize).copied().collect();
                estimate(&shifted, s, pos) + f64::from(cost) <= f64::from(limit)
            };
            assert!(fits_after(wait), "fits at the wait");
            assert!(wait == 0 || !fits_after(wait - 1), "not a µs earlier");
        }
    }

    #[test]
    fn checking_agrees_with_deciding_and_changes_nothing() {
        let p = params(
            Quota::per_minute(7)
                .sliding_window()
                .resolution(Duration::from_secs(20)),
        );
        let s_us = 20_000_000;
        let mut s = SlidingState::new(3);
        let mut now = 1_700_000_000_000_000u64;
        let mut seed = 3u64;
        for _ in 0..2000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            now += (seed >> 40) % 15_000_000;
            let cost = NonZeroU32::new(1 + ((seed >> 20) % 4) as u32).unwrap();
            let before = s.clone();
            let checked = s.check(0, &p, s_us, now, cost);
            assert_eq!(s, before, "check changes nothing");
            let decided = s.decide(0, &p, s_us, now, cost);
            assert_eq!(checked.outcome, decided.outcome);
            if decided.outcome != Outcome::Allowed {
                assert_eq!(checked, decided);
            }
        }
    }

    #[test]
    fn waits_are_exact_at_the_microsecond() {
        // A retry at the computed time passes; a microsecond earlier it does not.
        let p = params(
            Quota::per_minute(7)
                .sliding_window()
                .resolution(Duration::from_secs(20)),
        );
        let (s_us, n) = (20_000_000, 3);
        let mut seed = 99u64;
        for round in 0..300 {
            let mut s = SlidingState::new(n);
            let mut now = 1_700_000_000_000_000u64;
            let mut waited = 0;
            for _ in 0..40 {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                now += (seed >> 40) % 9_000_000;
                let cost = NonZeroU32::new(1 + ((seed >> 20) % 3) as u32).unwrap();
                if let Outcome::Denied { retry_after } = s.decide(0, &p, s_us, now, cost).outcome {
                    let at = now + retry_after.as_micros() as u64;
                    let mut early = s.clone();
                    assert_ne!(
                        early.decide(0, &p, s_us, at - 1, cost).outcome,
                        Outcome::Allowed,
                        "round {round}"
                    );
                    let mut on_time = s.clone();
                    assert_eq!(
                        on_time.decide(0, &p, s_us, at, cost).outcome,
                        Outcome::Allowed,
                        "round {round}"
                    );
                    waited += 1;
                }
            }
            assert!(waited > 0 || round > 0);
        }
    }
}
