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
    /// The Redis key suffix naming the quota's counters, stored format 2:
    /// `2.a<quota>.<sub-window µs>x<sub-windows>`, the quota its identity in the policy
    /// (`Policy::quota_id`, escaped) and the window's shape, not its limit: a changed limit
    /// keeps the fleet's counts, and applies to them at once; a changed period or resolution
    /// counts afresh.
    pub(crate) suffix: Box<[u8]>,
}

impl Spec {
    /// The spec of a window quota whose identity in its policy is `id`; `None` for GCRA.
    pub(crate) fn new(index: usize, id: &str, params: QuotaParams) -> Option<Self> {
        let (slice_us, kept) = match params.kind {
            QuotaKind::FixedWindow { window_us } => (window_us, 1),
            QuotaKind::SlidingWindow { slice_us, slices } => (slice_us, slices as usize + 1),
            _ => return None,
        };
        let slices = kept.saturating_sub(1);
        let mut suffix = b"2.a".to_vec();
        crate::backend::remote::keys::escape(id.as_bytes(), &mut suffix);
        suffix.extend_from_slice(format!(".{slice_us}x{slices}").as_bytes());
        let suffix = suffix.into_boxed_slice();
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

/// One sub-window's numbers, for a sub-window with something in them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Cell {
    /// The sub-window (numbered from the epoch).
    slice: u64,
    /// The fleet's count as Redis last told it.
    fleet: u32,
    /// This instance's units not yet known to be in `fleet`.
    mine: u32,
    /// Units of `mine` not sent yet (queued for the next flush, or back from a failed one).
    unsent: u32,
    /// Units of this instance Redis confirmed: a read never counts less (Redis may have lost
    /// them: a restart without persistence, a failover).
    own: u32,
    /// Units of this instance Redis refused to count (its memory full, a key of another type
    /// in the way): counted here only, on top of the fleet's count.
    kept: u32,
    /// Units refunded that Redis counts (or will: increments in flight) and is still to be
    /// told of: taken off the view until their decrement is sent.
    back: u32,
    /// Whether this instance set the Redis counter to expire: 0 not yet (its next increment
    /// carries a `PEXPIRE`), 1 set, 2 owed (an increment without one created the counter
    /// afresh: Redis lost it, or it was reset; the next flush sends one).
    ttl: u32,
}

impl Cell {
    /// This instance's view of the sub-window's count.
    fn view(&self) -> u32 {
        (self.fleet)
            .saturating_add(self.mine)
            .saturating_add(self.kept)
            .saturating_sub(self.back)
    }

    /// This instance's own units in it, confirmed or not.
    fn own_units(&self) -> u32 {
        (self.own)
            .saturating_add(self.mine)
            .saturating_add(self.kept)
            .saturating_sub(self.back)
    }

    /// Whether it holds nothing worth keeping: no count, nothing owed to Redis. (An expiry
    /// already set is forgotten with it: a later increment there sends it again.)
    fn is_empty(&self) -> bool {
        self.fleet == 0
            && self.mine == 0
            && self.unsent == 0
            && self.own == 0
            && self.kept == 0
            && self.back == 0
            && self.ttl != 2
    }
}

/// One quota's counts for one key: only the sub-windows of its window with something in them
/// (counted here, read from Redis, or owed to it), oldest first, so that a key costs memory by
/// the sub-windows it (or the fleet) used, not by the window's resolution.
#[derive(Debug, Clone)]
pub(crate) struct Counts {
    /// The newest sub-window: the current one as of the last decision.
    slice: u64,
    /// Sub-windows in the window: its own and the one before (sliding), or one (fixed).
    span: u32,
    cells: SmallVec<[Cell; 1]>,
    /// The newest sub-window when the counts were last read from Redis; `None` before the first
    /// read.
    read: Option<u64>,
    /// The window (numbered from the epoch) whose excess over the limit was last seen, and
    /// that excess: an estimate of over-admission, counted once per window.
    over: (u64, u32),
}

impl Counts {
    pub(crate) fn new(spec: &Spec) -> Self {
        Counts {
            slice: 0,
            span: u32::try_from(spec.kept).unwrap_or(u32::MAX).max(1),
            cells: SmallVec::new(),
            read: None,
            over: (0, 0),
        }
    }

    /// Moves on to the sub-window `slice`: counts that left the window are dropped (units not
    /// sent for them no longer matter to anyone).
    pub(crate) fn advance(&mut self, slice: u64) {
        if slice <= self.slice {
            return;
        }
        self.slice = slice;
        let oldest = self.oldest();
        let gone = self.cells.iter().take_while(|c| c.slice < oldest).count();
        if gone > 0 {
            self.cells.drain(..gone);
        }
    }

    /// The oldest sub-window held (fewer than `span` near the epoch: nothing is held before 0).
    fn oldest(&self) -> u64 {
        (self.slice + 1).saturating_sub(u64::from(self.span))
    }

    /// Whether sub-window `slice` is in the window held.
    fn holds(&self, slice: u64) -> bool {
        slice <= self.slice && slice >= self.oldest()
    }

    /// Sub-window `slice`'s cell, if it has one.
    fn cell(&mut self, slice: u64) -> Option<&mut Cell> {
        let at = self.cells.partition_point(|c| c.slice < slice);
        self.cells.get_mut(at).filter(|c| c.slice == slice)
    }

    /// Sub-window `slice`'s cell, made if it is in the window and has none; `None` outside
    /// the window.
    fn cell_or_new(&mut self, slice: u64) -> Option<&mut Cell> {
        if !self.holds(slice) {
            return None;
        }
        let at = self.cells.partition_point(|c| c.slice < slice);
        if self.cells.get(at).is_none_or(|c| c.slice != slice) {
            let cell = Cell {
                slice,
                ..Cell::default()
            };
            self.cells.insert(at, cell);
        }
        self.cells.get_mut(at)
    }

    /// Forgets the cells that hold nothing any more.
    fn tidy(&mut self) {
        self.cells.retain(|c| !c.is_empty());
    }

    /// A sub-window's place in the window: 0 the oldest, `span - 1` the newest.
    fn position(&self, slice: u64) -> usize {
        (u64::from(self.span) - 1 - (self.slice - slice)) as usize
    }

    /// `value` of each cell, with its place in the window, oldest first.
    fn by_position<'a>(
        &'a self,
        value: impl Fn(&Cell) -> u32 + Clone + 'a,
    ) -> impl Iterator<Item = (usize, u32)> + Clone + 'a {
        (self.cells.iter())
            .filter(|c| self.holds(c.slice))
            .map(move |c| (self.position(c.slice), value(c)))
            .filter(|&(_, v)| v > 0)
    }

    /// `value` of the oldest sub-window of the window, and the sum over the others, weighed as
    /// the window weighs them at `now_us`: a sliding window's estimate, or a fixed window's
    /// count.
    fn weigh(&self, spec: &Spec, now_us: u64, value: impl Fn(&Cell) -> u32 + Clone) -> f64 {
        if spec.sliding() {
            window::estimate_by(
                self.by_position(value),
                spec.slice_us,
                now_us % spec.slice_us,
            )
        } else {
            f64::from(self.by_position(value).map(|(_, v)| v).next().unwrap_or(0))
        }
    }

    /// What the quota says of `cost` at `now_us` (the counts already moved to `now_us`).
    pub(crate) fn code(&self, spec: &Spec, now_us: u64, cost: NonZeroU32) -> Code {
        let limit = spec.params.burst.get();
        if cost.get() > limit {
            return Code::NeverFits;
        }
        let used = self.weigh(spec, now_us, Cell::view);
        if used + f64::from(cost.get()) <= f64::from(limit) {
            Code::Allowed
        } else {
            Code::Denied
        }
    }

    /// This instance's own units in the window at `now_us` (confirmed or not), weighed as the
    /// window weighs them: what it spent of its allowance.
    pub(crate) fn own_estimate(&self, spec: &Spec, now_us: u64) -> f64 {
        self.weigh(spec, now_us, Cell::own_units)
    }

    /// How much more over the limit than seen before in this window the count is now, by the
    /// fleet's counts held (the units Redis confirmed and read) alone.
    pub(crate) fn over_limit(&mut self, spec: &Spec, now_us: u64) -> u32 {
        self.advance(spec.slice_at(now_us));
        let window = self.slice / (u64::from(self.span).saturating_sub(1).max(1));
        let fleet = self.weigh(spec, now_us, |c| c.fleet);
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
        if cost == 0 {
            return;
        }
        if let Some(c) = self.cell_or_new(self.slice) {
            c.mine = c.mine.saturating_add(cost);
            c.unsent = c.unsent.saturating_add(cost);
        }
    }

    /// Gives back `units` this instance counted into sub-window `slice` (a refund after the
    /// response): units not sent yet are simply not sent; units Redis counts, or will (in
    /// flight), are taken off the view at once and off Redis's counter by the next flush. A
    /// sub-window that has left the window gives back nothing, and never more than this
    /// instance counted there.
    pub(crate) fn refund(&mut self, slice: u64, units: u32) {
        if !self.holds(slice) {
            return;
        }
        let Some(c) = self.cell(slice) else {
            return;
        };
        let unsent = units.min(c.unsent);
        c.unsent -= unsent;
        c.mine -= unsent.min(c.mine);
        // Redis has (or will have) the rest of this instance's units there.
        let counted = c.own.saturating_add(c.mine - c.unsent.min(c.mine));
        let back = (units - unsent).min(counted.saturating_sub(c.back));
        c.back = c.back.saturating_add(back);
        // Units Redis refused, counted here only, go back here.
        let kept = (units - unsent - back).min(c.kept);
        c.kept -= kept;
        self.tidy();
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
        let newest = self.slice;
        // The cells are in order: the newest sub-window's, if any, is the last.
        let has_newest = self.cells.last().is_some_and(|c| c.slice == newest);
        let view = move |c: &Cell| {
            let more = if c.slice == newest { extra } else { 0 };
            c.view().saturating_add(more)
        };
        let last = self.span as usize - 1;
        let counts = (self.by_position(view))
            .chain(std::iter::once((last, extra)).filter(move |&(_, e)| !has_newest && e > 0));
        let r = now_us % spec.slice_us;
        if spec.sliding() {
            let kept = self.span as usize;
            window::sliding_state_by(
                spec.index,
                &spec.params,
                code,
                counts,
                kept,
                spec.slice_us,
                r,
                cost,
            )
        } else {
            let count = counts.map(|(_, v)| v).next().unwrap_or(0);
            window::fixed_state(spec.index, &spec.params, code, count, spec.slice_us - r)
        }
    }

    /// Takes the units to send: `(sub-window, units, whether the counter's expiry is sent
    /// with them)` for each sub-window with units, or an expiry owed (then with zero units:
    /// `INCRBY` by 0 reads the count), and units refunded as negative ones (always with the
    /// expiry, so that a counter Redis lost is not made again without one). Units sent stay
    /// in `mine` until [`confirmed`](Self::confirmed).
    pub(crate) fn take_unsent(&mut self) -> SmallVec<[(u64, i64, bool); 2]> {
        let mut out = SmallVec::new();
        let oldest = self.oldest();
        for c in self.cells.iter_mut().filter(|c| c.slice >= oldest) {
            if c.unsent > 0 || c.ttl == 2 {
                out.push((c.slice, i64::from(c.unsent), c.ttl != 1));
                c.unsent = 0;
            }
            if c.back > 0 {
                out.push((c.slice, -i64::from(c.back), true));
                c.back = 0;
            }
        }
        out
    }

    /// Redis refused an increment of `units` for `slice` (its memory full, a key of another
    /// type in the way): they are not sent again, and stay counted here only (a store that
    /// refuses to count never makes this instance admit more).
    pub(crate) fn refused(&mut self, slice: u64, units: i64) {
        // A refused refund: its units stay counted (this instance may deny early, never
        // admit more).
        let Ok(units) = u32::try_from(units) else {
            return;
        };
        if !self.holds(slice) {
            return;
        }
        if let Some(c) = self.cell(slice) {
            let units = units.min(c.mine);
            c.mine -= units;
            c.kept = c.kept.saturating_add(units);
        }
    }

    /// Redis added `units` to sub-window `slice`, making it `count` (and set its expiry when
    /// `ttl` was sent with them).
    pub(crate) fn confirmed(&mut self, slice: u64, units: i64, count: u32, ttl: bool) {
        let Some(c) = self.cell_or_new(slice) else {
            return;
        };
        match u32::try_from(units) {
            Err(_) => {
                // A refund: Redis took the units off its counter (never below this instance's
                // other units here: the count is what Redis says now).
                let back = u32::try_from(units.unsigned_abs()).unwrap_or(u32::MAX);
                c.own = c.own.saturating_sub(back);
                c.fleet = count.max(c.own);
                if ttl {
                    c.ttl = 1;
                }
            }
            Ok(units) => {
                c.own = c.own.saturating_add(units);
                // Never below this instance's own units: Redis may have lost some.
                c.fleet = c.fleet.max(count).max(c.own);
                c.mine = c.mine.saturating_sub(units);
                if ttl {
                    c.ttl = 1;
                } else if units > 0 && count <= units {
                    // This increment created the counter, without an expiry.
                    c.ttl = 2;
                }
            }
        }
        self.tidy();
    }

    /// Whether a flush owes Redis something: units, or an expiry.
    pub(crate) fn owes(&self) -> bool {
        (self.cells.iter()).any(|c| c.unsent > 0 || c.back > 0 || c.ttl == 2)
    }

    /// Sending `units` for `slice` failed: they are sent again by a later flush. (A call that
    /// timed out may have reached Redis: the units are then counted twice there, which can only
    /// deny early, never admit more.)
    pub(crate) fn failed(&mut self, slice: u64, units: i64) {
        if let Some(c) = self.cell_or_new(slice) {
            let n = u32::try_from(units.unsigned_abs()).unwrap_or(u32::MAX);
            if units < 0 {
                c.back = c.back.saturating_add(n);
            } else {
                c.unsent = c.unsent.saturating_add(n);
            }
        }
        self.tidy();
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
        for (k, &count) in counts.iter().enumerate() {
            let slice = first + k as u64;
            let cell = if count > 0 {
                self.cell_or_new(slice)
            } else if self.holds(slice) {
                self.cell(slice)
            } else {
                None
            };
            if let Some(c) = cell {
                let count = count.max(c.own);
                c.fleet = if fresh { count } else { c.fleet.max(count) };
            }
        }
        self.tidy();
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
        spec.slice_at(now_us) >= self.slice.saturating_add(u64::from(self.span))
            || self
                .cells
                .iter()
                .all(|c| c.fleet == 0 && c.mine == 0 && c.kept == 0 && c.back == 0 && c.unsent == 0)
    }

    /// The sub-windows it holds numbers for: what it costs beyond its fixed part.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.cells.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;
    use crate::backend::Outcome;

    fn spec(q: Quota) -> Spec {
        Spec::new(0, "0", q.params("p").unwrap()).unwrap()
    }

    /// The counts as they were kept before #35 (dense: every sub-window of the window, seven
    /// numbers each), unchanged: the oracle the sparse cells must agree with.
    #[allow(dead_code)]
    mod oracle {
        use std::num::NonZeroU32;

        use smallvec::SmallVec;

        use super::super::Spec;
        use crate::backend::QuotaState;
        use crate::backend::window::{self, Code};

        /// One quota's counts for one key.
        #[derive(Debug, Clone)]
        pub(crate) struct Dense {
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

        impl Dense {
            pub(crate) fn new(spec: &Spec) -> Self {
                let zeros = || smallvec::smallvec![0; spec.kept];
                Dense {
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
                let counted =
                    self.own[i].saturating_add(self.mine[i] - self.unsent[i].min(self.mine[i]));
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
            pub(crate) fn read_reply(
                &mut self,
                first: u64,
                counts: &[u32],
                as_of: u64,
                fresh: bool,
            ) {
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
    }

    const ONE: NonZeroU32 = NonZeroU32::MIN;

    #[test]
    fn gcra_has_no_spec() {
        assert!(Spec::new(0, "0", Quota::per_second(5).params("p").unwrap()).is_none());
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

    proptest::proptest! {
        /// Issue 35, finding 4: the sparse cells (only the sub-windows with something in
        /// them) answer every question the dense counts answered, the same to the bit, after
        /// any sequence of admissions, sends, confirmations, failures, refusals, reads and
        /// refunds; and hold no more cells than sub-windows with numbers in them.
        #[test]
        fn the_sparse_counts_agree_with_the_dense_ones(
            quota in 0usize..4,
            ops in proptest::collection::vec((0u8..8, 0u64..2_500, 1u32..6, 0u32..40), 1..150),
        ) {
            use std::time::Duration;
            let q = [
                Quota::per_second(10).fixed_window(),
                Quota::per_second(10).sliding_window().resolution(Duration::from_millis(100)),
                Quota::per_minute(20).sliding_window().resolution(Duration::from_secs(1)),
                Quota::per_hour(50).sliding_window().resolution(Duration::from_millis(3600)),
            ][quota];
            let spec = spec(q);
            let mut c = Counts::new(&spec);
            let mut d = oracle::Dense::new(&spec);
            let mut now = 1_700_000_000_000_000u64;
            let mut sent: Vec<(u64, i64, bool)> = Vec::new();
            for (op, step, cost, n) in ops {
                let cost_nz = NonZeroU32::new(cost).unwrap();
                match op {
                    0 => {
                        now += step * spec.slice_us / 1000;
                        c.advance(spec.slice_at(now));
                        d.advance(spec.slice_at(now));
                    }
                    1 | 2 => {
                        let code = c.code(&spec, now, cost_nz);
                        proptest::prop_assert_eq!(code, d.code(&spec, now, cost_nz));
                        if code == Code::Allowed {
                            c.admit(cost);
                            d.admit(cost);
                        }
                    }
                    3 => {
                        let a = c.take_unsent();
                        proptest::prop_assert_eq!(&a, &d.take_unsent());
                        sent.extend(a);
                    }
                    4 => {
                        // Answer the oldest send: confirmed, failed or refused.
                        if !sent.is_empty() {
                            let (slice, units, ttl) = sent.remove(0);
                            match n % 3 {
                                0 => {
                                    let count = u32::try_from(units.max(0)).unwrap() + n;
                                    c.confirmed(slice, units, count, ttl);
                                    d.confirmed(slice, units, count, ttl);
                                }
                                1 => {
                                    c.failed(slice, units);
                                    d.failed(slice, units);
                                }
                                _ => {
                                    c.refused(slice, units);
                                    d.refused(slice, units);
                                }
                            }
                        }
                    }
                    5 => {
                        let (first, len) = c.read_range();
                        proptest::prop_assert_eq!((first, len), d.read_range());
                        let counts: Vec<u32> =
                            (0..len as u32).map(|k| (k * 7 + n) % (cost * 4)).collect();
                        let fresh = n % 2 == 0;
                        c.read_reply(first, &counts, spec.slice_at(now), fresh);
                        d.read_reply(first, &counts, spec.slice_at(now), fresh);
                    }
                    6 => {
                        let slice = spec.slice_at(now).saturating_sub(u64::from(n % 5));
                        c.refund(slice, cost);
                        d.refund(slice, cost);
                    }
                    _ => {
                        proptest::prop_assert_eq!(
                            c.over_limit(&spec, now),
                            d.over_limit(&spec, now)
                        );
                    }
                }
                for code in [Code::Allowed, Code::Denied] {
                    proptest::prop_assert_eq!(
                        c.state(&spec, code, now, cost_nz, n % 3),
                        d.state(&spec, code, now, cost_nz, n % 3)
                    );
                }
                proptest::prop_assert_eq!(
                    c.own_estimate(&spec, now).to_bits(),
                    d.own_estimate(&spec, now).to_bits()
                );
                proptest::prop_assert_eq!(c.owes(), d.owes());
                proptest::prop_assert_eq!(c.is_idle(&spec, now), d.is_idle(&spec, now));
                proptest::prop_assert_eq!(c.stale(&spec, now), d.stale(&spec, now));
                proptest::prop_assert_eq!(
                    c.read_due(&spec, now, 1_000),
                    d.read_due(&spec, now, 1_000)
                );
                proptest::prop_assert!(c.held() <= spec.kept);
            }
        }
    }

    /// A key seen once holds one sub-window's numbers, at any resolution.
    #[test]
    fn a_key_seen_once_holds_one_sub_window() {
        let s = spec(
            Quota::per_hour(1000)
                .sliding_window()
                .resolution(std::time::Duration::from_millis(3600)),
        );
        let mut c = Counts::new(&s);
        let now = 1_700_000_000_000_000;
        c.advance(s.slice_at(now));
        let (first, n) = c.read_range();
        assert_eq!(n, 1001);
        c.read_reply(first, &vec![0; n], c.slice, true);
        c.admit(1);
        assert_eq!(c.held(), 1);
        assert!(
            std::mem::size_of::<Counts>() <= 128,
            "{}",
            std::mem::size_of::<Counts>()
        );
    }
}
