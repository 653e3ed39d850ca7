//! One window quota's counts for one key on one instance, and the decision made from them.
//!
//! Each sub-window of the window holds two numbers: `fleet`, the fleet's count as Redis last
//! told it (a read, or the reply to one of this instance's increments), and `mine`, this
//! instance's units not yet known to be in `fleet` (admitted, and either not yet sent or sent
//! without a reply yet). Their sum is this instance's view of the count, and it never exceeds
//! the true count by more than the units of increments in flight (counted in `mine` until their
//! reply comes back, though Redis may already have added them); it falls short of it by what
//! other instances admitted since this one last heard from Redis.

use std::num::NonZeroU32;

use smallvec::SmallVec;

use crate::backend::QuotaState;
use crate::backend::window::{self, Code};
use crate::quota::{QuotaKind, QuotaParams};

/// A window quota as the approximate mode counts it.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    /// The quota's place in the policy.
    pub(crate) index: usize,
    pub(crate) params: QuotaParams,
    /// One sub-window in µs (the whole window for a fixed window).
    pub(crate) slice_us: u64,
    /// Sub-windows held: the window's and the one before (sliding), or one (fixed).
    pub(crate) kept: usize,
    /// The Redis key suffix naming the quota: `<index>a<sub-window µs>x<sub-windows>x<limit>`.
    pub(crate) suffix: Box<[u8]>,
}

impl Spec {
    /// The spec of a window quota; `None` for GCRA.
    pub(crate) fn new(index: usize, params: QuotaParams) -> Option<Self> {
        let (slice_us, kept) = match params.kind {
            QuotaKind::FixedWindow { window_us } => (window_us, 1),
            QuotaKind::SlidingWindow { slice_us, slices } => (slice_us, slices as usize + 1),
            _ => return None,
        };
        let slices = kept.saturating_sub(1);
        let suffix = format!("{index}a{slice_us}x{slices}x{}", params.burst)
            .into_bytes()
            .into_boxed_slice();
        Some(Spec {
            index,
            params,
            slice_us,
            kept,
            suffix,
        })
    }

    fn sliding(&self) -> bool {
        matches!(self.params.kind, QuotaKind::SlidingWindow { .. })
    }

    /// The sub-window holding `now_us`.
    pub(crate) fn slice_at(&self, now_us: u64) -> u64 {
        now_us / self.slice_us
    }

    /// How long a sub-window's Redis counter is kept: until it has left every window, plus a
    /// margin for clocks that disagree (in ms).
    pub(crate) fn ttl_ms(&self) -> u64 {
        (self.slice_us.saturating_mul(self.kept as u64 + 1) / 1000).saturating_add(2_000)
    }
}

/// One quota's counts for one key.
#[derive(Debug, Clone)]
pub(crate) struct Counts {
    /// The newest sub-window held; `counts[kept - 1]` is its count.
    slice: u64,
    fleet: SmallVec<[u32; 4]>,
    mine: SmallVec<[u32; 4]>,
    /// Units of `mine` not sent yet (queued for the next flush, or back from a failed one).
    unsent: SmallVec<[u32; 4]>,
    /// Units of this instance Redis confirmed, per sub-window: a read never counts less (Redis
    /// may have lost them: a restart without persistence, a failover).
    own: SmallVec<[u32; 4]>,
    /// Units of this instance Redis refused to count (its memory full, a key of another type in
    /// the way), per sub-window: counted here only, on top of the fleet's count.
    kept: SmallVec<[u32; 4]>,
    /// Units refunded that Redis counts (or will: increments in flight) and is still to be
    /// told of, per sub-window: taken off the view until their decrement is sent.
    back: SmallVec<[u32; 4]>,
    /// Per sub-window, whether this instance set the Redis counter to expire: 0 not yet (its
    /// next increment carries a `PEXPIRE`), 1 set, 2 owed (an increment without one created
    /// the counter afresh: Redis lost it, or it was reset; the next flush sends one).
    ttl: SmallVec<[u32; 4]>,
    /// The newest sub-window when the counts were last read from Redis; `None` before the first
    /// read.
    read: Option<u64>,
    /// The window (numbered from the epoch) whose excess over the limit was last seen, and
    /// that excess: an estimate of over-admission, counted once per window.
    over: (u64, u32),
}

impl Counts {
    pub(crate) fn new(spec: &Spec) -> Self {
        let zeros = || smallvec::smallvec![0; spec.kept];
        Counts {
            slice: 0,
            fleet: zeros(),
            mine: zeros(),
            unsent: zeros(),
            own: zeros(),
            kept: zeros(),
            back: zeros(),
            ttl: zeros(),
            read: None,
            over: (0, 0),
        }
    }

    /// Moves on to the sub-window `slice`: counts that left the window are dropped (units not
    /// sent for them no longer matter to anyone), the sub-windows since count zero.
    pub(crate) fn advance(&mut self, slice: u64) {
        let kept = self.fleet.len() as u64;
        let by = slice.saturating_sub(self.slice);
        if by == 0 {
            return;
        }
        for v in [
            &mut self.fleet,
            &mut self.mine,
            &mut self.unsent,
            &mut self.own,
            &mut self.kept,
            &mut self.back,
            &mut self.ttl,
        ] {
            if by >= kept {
                v.iter_mut().for_each(|c| *c = 0);
            } else {
                let by = by as usize;
                v.rotate_left(by);
                let len = v.len();
                v[len - by..].iter_mut().for_each(|c| *c = 0);
            }
        }
        self.slice = slice;
    }

    /// The oldest sub-window held (fewer than `kept` near the epoch: nothing is held before 0).
    fn oldest(&self) -> u64 {
        (self.slice + 1).saturating_sub(self.fleet.len() as u64)
    }

    /// Where sub-window `slice` is held, if it is: the newest at the last index, each older
    /// one a place before it.
    fn slot(&self, slice: u64) -> Option<usize> {
        let back = self.slice.checked_sub(slice)?;
        let last = self.fleet.len() - 1;
        (back <= last as u64).then(|| last - back as usize)
    }

    /// The sub-window held at index `i`, if any (none before the epoch).
    fn slice_of(&self, i: usize) -> Option<u64> {
        let back = (self.fleet.len() - 1 - i) as u64;
        self.slice.checked_sub(back)
    }

    /// This instance's view of the counts, oldest first.
    fn view(&self) -> SmallVec<[u32; 4]> {
        (self
            .fleet
            .iter()
            .zip(&self.mine)
            .zip(&self.kept)
            .zip(&self.back))
        .map(|(((f, m), k), b)| f.saturating_add(*m).saturating_add(*k).saturating_sub(*b))
        .collect()
    }

    /// What the quota says of `cost` at `now_us` (the counts already moved to `now_us`).
    pub(crate) fn code(&self, spec: &Spec, now_us: u64, cost: NonZeroU32) -> Code {
        let limit = spec.params.burst.get();
        if cost.get() > limit {
            return Code::NeverFits;
        }
        let view = self.view();
        let used = if spec.sliding() {
            window::estimate(&view, spec.slice_us, now_us % spec.slice_us)
        } else {
            f64::from(view[0])
        };
        if used + f64::from(cost.get()) <= f64::from(limit) {
            Code::Allowed
        } else {
            Code::Denied
        }
    }

    /// This instance's own units in the window at `now_us` (confirmed or not), weighed as the
    /// window weighs them: what it spent of its allowance.
    pub(crate) fn own_estimate(&self, spec: &Spec, now_us: u64) -> f64 {
        let mut own = (self
            .own
            .iter()
            .zip(&self.mine)
            .zip(&self.kept)
            .zip(&self.back))
        .map(|(((o, m), k), b)| o.saturating_add(*m).saturating_add(*k).saturating_sub(*b));
        let oldest = f64::from(own.next().unwrap_or(0));
        if !spec.sliding() {
            return oldest;
        }
        let rest: u64 = own.map(u64::from).sum();
        let r = now_us % spec.slice_us;
        oldest * (spec.slice_us - r) as f64 / spec.slice_us as f64 + rest as f64
    }

    /// How much more over the limit than seen before in this window the count is now, by the
    /// fleet's counts held (the units Redis confirmed and read) alone.
    pub(crate) fn over_limit(&mut self, spec: &Spec, now_us: u64) -> u32 {
        self.advance(spec.slice_at(now_us));
        let window = self.slice / (self.fleet.len().saturating_sub(1).max(1) as u64);
        let fleet = if spec.sliding() {
            window::estimate(&self.fleet, spec.slice_us, now_us % spec.slice_us)
        } else {
            f64::from(self.fleet[0])
        };
        let excess = (fleet - f64::from(spec.params.burst.get())).max(0.0) as u32;
        if self.over.0 != window {
            self.over = (window, 0);
        }
        let new = excess.saturating_sub(self.over.1);
        self.over.1 = self.over.1.max(excess);
        new
    }

    /// Counts `cost` admitted units into the current sub-window, to be sent by the next flush.
    pub(crate) fn admit(&mut self, cost: u32) {
        let newest = self.fleet.len() - 1;
        self.mine[newest] = self.mine[newest].saturating_add(cost);
        self.unsent[newest] = self.unsent[newest].saturating_add(cost);
    }

    /// Gives back `units` this instance counted into sub-window `slice` (a refund after the
    /// response): units not sent yet are simply not sent; units Redis counts, or will (in
    /// flight), are taken off the view at once and off Redis's counter by the next flush. A
    /// sub-window that has left the window gives back nothing, and never more than this
    /// instance counted there.
    pub(crate) fn refund(&mut self, slice: u64, units: u32) {
        let Some(i) = self.slot(slice) else {
            return;
        };
        let unsent = units.min(self.unsent[i]);
        self.unsent[i] -= unsent;
        self.mine[i] -= unsent.min(self.mine[i]);
        // Redis has (or will have) the rest of this instance's units there.
        let counted = self.own[i].saturating_add(self.mine[i] - self.unsent[i].min(self.mine[i]));
        let back = (units - unsent).min(counted.saturating_sub(self.back[i]));
        self.back[i] = self.back[i].saturating_add(back);
        // Units Redis refused, counted here only, go back here.
        let kept = (units - unsent - back).min(self.kept[i]);
        self.kept[i] -= kept;
    }

    /// The quota's state after a decision with `code`, from the view at `now_us` with `extra`
    /// units more in the current sub-window (a peek's request, counted as a decision would).
    pub(crate) fn state(
        &self,
        spec: &Spec,
        code: Code,
        now_us: u64,
        cost: NonZeroU32,
        extra: u32,
    ) -> QuotaState {
        let mut view = self.view();
        if let Some(newest) = view.last_mut() {
            *newest = newest.saturating_add(extra);
        }
        let r = now_us % spec.slice_us;
        if spec.sliding() {
            window::sliding_state(
                spec.index,
                &spec.params,
                code,
                &view,
                spec.slice_us,
                r,
                cost,
            )
        } else {
            window::fixed_state(spec.index, &spec.params, code, view[0], spec.slice_us - r)
        }
    }

    /// Takes the units to send: `(sub-window, units, whether the counter's expiry is sent
    /// with them)` for each sub-window with units, or an expiry owed (then with zero units:
    /// `INCRBY` by 0 reads the count), and units refunded as negative ones (always with the
    /// expiry, so that a counter Redis lost is not made again without one). Units sent stay
    /// in `mine` until [`confirmed`](Self::confirmed).
    pub(crate) fn take_unsent(&mut self) -> SmallVec<[(u64, i64, bool); 2]> {
        let mut out = SmallVec::new();
        for i in 0..self.unsent.len() {
            let (units, back, ttl) = (self.unsent[i], self.back[i], self.ttl[i]);
            let Some(slice) = self.slice_of(i) else {
                continue;
            };
            if units > 0 || ttl == 2 {
                out.push((slice, i64::from(units), ttl != 1));
                self.unsent[i] = 0;
            }
            if back > 0 {
                out.push((slice, -i64::from(back), true));
                self.back[i] = 0;
            }
        }
        out
    }

    /// Redis refused an increment of `units` for `slice` (its memory full, a key of another
    /// type in the way): they are not sent again, and stay counted here only (a store that
    /// refuses to count never makes this instance admit more).
    pub(crate) fn refused(&mut self, slice: u64, units: i64) {
        let Some(i) = self.slot(slice) else {
            return;
        };
        // A refused refund: its units stay counted (this instance may deny early, never
        // admit more).
        let Ok(units) = u32::try_from(units) else {
            return;
        };
        let units = units.min(self.mine[i]);
        self.mine[i] -= units;
        self.kept[i] = self.kept[i].saturating_add(units);
    }

    /// Redis added `units` to sub-window `slice`, making it `count` (and set its expiry when
    /// `ttl` was sent with them).
    pub(crate) fn confirmed(&mut self, slice: u64, units: i64, count: u32, ttl: bool) {
        let Ok(units) = u32::try_from(units) else {
            // A refund: Redis took the units off its counter (never below this instance's
            // other units here: the count is what Redis says now).
            if let Some(i) = self.slot(slice) {
                let back = u32::try_from(units.unsigned_abs()).unwrap_or(u32::MAX);
                self.own[i] = self.own[i].saturating_sub(back);
                self.fleet[i] = count.max(self.own[i]);
                if ttl {
                    self.ttl[i] = 1;
                }
            }
            return;
        };
        if let Some(i) = self.slot(slice) {
            self.own[i] = self.own[i].saturating_add(units);
            // Never below this instance's own units: Redis may have lost some.
            self.fleet[i] = self.fleet[i].max(count).max(self.own[i]);
            self.mine[i] = self.mine[i].saturating_sub(units);
            if ttl {
                self.ttl[i] = 1;
            } else if units > 0 && count <= units {
                // This increment created the counter, without an expiry.
                self.ttl[i] = 2;
            }
        }
    }

    /// Whether a flush owes Redis something: units, or an expiry.
    pub(crate) fn owes(&self) -> bool {
        self.unsent.iter().any(|&u| u > 0)
            || self.back.iter().any(|&b| b > 0)
            || self.ttl.contains(&2)
    }

    /// Sending `units` for `slice` failed: they are sent again by a later flush. (A call that
    /// timed out may have reached Redis: the units are then counted twice there, which can only
    /// deny early, never admit more.)
    pub(crate) fn failed(&mut self, slice: u64, units: i64) {
        if let Some(i) = self.slot(slice) {
            let n = u32::try_from(units.unsigned_abs()).unwrap_or(u32::MAX);
            if units < 0 {
                self.back[i] = self.back[i].saturating_add(n);
            } else {
                self.unsent[i] = self.unsent[i].saturating_add(n);
            }
        }
    }

    /// The sub-windows a read asks for: from the oldest held to the current one.
    pub(crate) fn read_range(&self) -> (u64, usize) {
        let oldest = self.oldest();
        (oldest, (self.slice - oldest) as usize + 1)
    }

    /// Redis's counts of the sub-windows from `first` on, read as of current sub-window
    /// `as_of`. With `fresh` (no increment of this key was confirmed since the read was sent)
    /// they replace the fleet's counts held, so that a reset elsewhere is seen; otherwise a
    /// confirmed increment may be newer, and the larger count is kept. Never below this
    /// instance's own confirmed units.
    pub(crate) fn read_reply(&mut self, first: u64, counts: &[u32], as_of: u64, fresh: bool) {
        for (k, &c) in counts.iter().enumerate() {
            if let Some(i) = self.slot(first + k as u64) {
                let c = c.max(self.own[i]);
                self.fleet[i] = if fresh { c } else { self.fleet[i].max(c) };
            }
        }
        self.read = Some(self.read.map_or(as_of, |r| r.max(as_of)));
    }

    /// Whether a read is due at `now_us`: never read, or [stale](Self::stale), or not since the
    /// current sub-window began and `settle_us` have passed in it (time for the increments
    /// other instances made at the end of the last one to reach Redis).
    pub(crate) fn read_due(&self, spec: &Spec, now_us: u64, settle_us: u64) -> bool {
        match self.read {
            None => true,
            Some(_) if self.stale(spec, now_us) => true,
            Some(read) => read < self.slice && now_us % spec.slice_us >= settle_us,
        }
    }

    /// Whether the counts held are too old to decide from: never read, or last read before the
    /// previous sub-window (the key was not used for a whole sub-window, during which the
    /// others' units went unheard of).
    pub(crate) fn stale(&self, spec: &Spec, now_us: u64) -> bool {
        self.read
            .is_none_or(|read| read.saturating_add(1) < spec.slice_at(now_us))
    }

    /// Whether every count has left the window and nothing is owed to Redis.
    pub(crate) fn is_idle(&self, spec: &Spec, now_us: u64) -> bool {
        spec.slice_at(now_us) >= self.slice.saturating_add(self.fleet.len() as u64)
            || (self.fleet.iter().all(|&c| c == 0)
                && self.mine.iter().all(|&c| c == 0)
                && self.kept.iter().all(|&c| c == 0)
                && self.back.iter().all(|&c| c == 0)
                && self.unsent.iter().all(|&c| c == 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;
    use crate::backend::Outcome;

    fn spec(q: Quota) -> Spec {
        Spec::new(0, q.params("p").unwrap()).unwrap()
    }

    const ONE: NonZeroU32 = NonZeroU32::MIN;

    #[test]
    fn gcra_has_no_spec() {
        assert!(Spec::new(0, Quota::per_second(5).params("p").unwrap()).is_none());
    }

    #[test]
    fn own_units_and_the_fleet_add_up() {
        // 10 per second, sub-windows of 100 ms.
        let s = spec(
            Quota::per_second(10)
                .sliding_window()
                .resolution(std::time::Duration::from_millis(100)),
        );
        let mut c = Counts::new(&s);
        let now = 50_000_000; // on a sub-window boundary
        c.advance(s.slice_at(now));
        // Redis says the fleet counted 6 in the last second (the sub-window before, full weight).
        let (first, n) = c.read_range();
        let mut fleet = vec![0; n];
        fleet[n - 2] = 6;
        c.read_reply(first, &fleet, c.slice, true);
        for _ in 0..4 {
            assert_eq!(c.code(&s, now, ONE), Code::Allowed);
            c.admit(1);
        }
        assert_eq!(c.code(&s, now, ONE), Code::Denied);
        let q = c.state(&s, Code::Denied, now, ONE, 0);
        assert_eq!(q.remaining, 0);
        assert!(matches!(q.outcome, Outcome::Denied { .. }));
        // The 4 are sent and confirmed: Redis counted 9 in this sub-window (5 from others).
        let sent = c.take_unsent();
        assert_eq!(sent.as_slice(), &[(c.slice, 4, true)]);
        c.confirmed(c.slice, 4, 9, true);
        // 6 + 9: still denied, and nothing is owed.
        assert_eq!(c.code(&s, now, ONE), Code::Denied);
        assert!(c.take_unsent().is_empty());
        // A failed send comes back for the next flush.
        c.admit(0);
        c.failed(c.slice, 3);
        // The counter's expiry is set: the units go without one.
        assert_eq!(c.take_unsent().as_slice(), &[(c.slice, 3, false)]);
    }

    #[test]
    fn counts_slide_out_and_reads_fall_due_after_the_settle_time() {
        let s = spec(Quota::per_second(3).fixed_window());
        let mut c = Counts::new(&s);
        let t0 = 7_000_000;
        c.advance(s.slice_at(t0));
        assert!(c.read_due(&s, t0, 10_000), "never read");
        c.read_reply(c.read_range().0, &[0], c.slice, true);
        for _ in 0..3 {
            assert_eq!(c.code(&s, t0, ONE), Code::Allowed);
            c.admit(1);
        }
        assert_eq!(c.code(&s, t0, ONE), Code::Denied);
        assert!(!c.read_due(&s, t0, 10_000));
        let t1 = t0 + 1_000_000;
        c.advance(s.slice_at(t1));
        assert_eq!(c.code(&s, t1, ONE), Code::Allowed);
        assert!(!c.read_due(&s, t1 + 9_999, 10_000), "settling");
        assert!(c.read_due(&s, t1 + 10_000, 10_000));
        // A reply for a sub-window that left the window changes nothing.
        c.confirmed(s.slice_at(t0), 3, 100, true);
        assert_eq!(c.code(&s, t1, ONE), Code::Allowed);
        assert!(c.is_idle(&s, t1 + 1_000_000));
    }
}
