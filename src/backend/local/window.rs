//! The local backend's window counters, one per key, decided with the arithmetic of
//! [`crate::backend::window`].
//!
//! A fixed window's state is its window index and count, packed in one atomic; a sliding
//! window's, the sub-windows it counted in that are still in the window (index and count,
//! one pair inline) behind a mutex held for a few arithmetic operations, never across an
//! await. A key's state is made with its first request; a sliding window's grows by 8 bytes
//! per sub-window the key counts in (allocating past the first), whatever the resolution: a
//! key seen once costs the same at one sub-window or a thousand.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use foldhash::quality::RandomState;

use super::store::Earlier;
use super::{entry, evict_lightest, swap};
use crate::Key;
use crate::backend::QuotaState;
use crate::backend::window::{FixedClock, FixedState, Settlement, SlidingState, in_flight_state};
use crate::quota::{QuotaKind, QuotaParams};

/// The counters of one window quota, by key, counted against the backend's key cap.
pub(super) struct WindowStore {
    counters: Counters,
    tracked: Arc<AtomicUsize>,
    params: QuotaParams,
    /// When it was made, among the backend's stores (see `StoreMap::seq`).
    pub(super) seq: u64,
    /// The store of the quota's earlier values, whose counters move here (converted as the
    /// policy's `OnChange` says) when their keys are first seen here; dropped by the sweep
    /// once it holds nothing. Never for a concurrent quota, whose slots are shared instead.
    pub(super) earlier: arc_swap::ArcSwapOption<Earlier<WindowStore>>,
}

impl super::store::Versioned for WindowStore {
    fn earlier(&self) -> &arc_swap::ArcSwapOption<Earlier<Self>> {
        &self.earlier
    }
}

/// A fixed window's counter is one `AtomicU64` updated by compare-and-swap (as small as a GCRA
/// bucket): the window's index in the high 32 bits (modulo 2^32: a counter is swept long
/// before its window comes round again, 2^32 windows later), its count in the low 32. A
/// sliding window's counts sit behind a mutex, held for a few arithmetic operations.
enum Counters {
    Fixed {
        clock: FixedClock,
        map: DashMap<Key, AtomicU64, RandomState>,
    },
    Sliding {
        slice_us: u64,
        slices: u32,
        map: DashMap<Key, Mutex<SlidingState>, RandomState>,
    },
    /// A concurrent quota's requests in flight per key: a count, up by one at admission and
    /// down by one at release. A count back at zero is swept like a passed window.
    InFlight { map: Arc<SlotMap> },
}

/// A concurrent quota's requests in flight per key, shared by the stores of every version of
/// its values; it gives its entries back to the key cap when the last of them is dropped.
pub(super) struct SlotMap {
    map: DashMap<Key, AtomicU64, RandomState>,
    tracked: Arc<AtomicUsize>,
}

impl std::ops::Deref for SlotMap {
    type Target = DashMap<Key, AtomicU64, RandomState>;

    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl Drop for SlotMap {
    fn drop(&mut self) {
        super::track_sub(&self.tracked, self.map.len());
    }
}

/// The fixed-window state packed in a counter, read at window `now_window`: a counter of
/// another window reads as an earlier one (nothing counted now).
fn unpack(packed: u64, now_window: u64) -> FixedState {
    let window = if packed >> 32 == now_window & 0xFFFF_FFFF {
        now_window
    } else {
        now_window.wrapping_sub(1)
    };
    FixedState {
        window,
        count: packed as u32,
    }
}

/// `key`'s fixed-window state as stored, read at window `now_window` (nothing counted when
/// untracked).
fn stored(map: &DashMap<Key, AtomicU64, RandomState>, key: &Key, now_window: u64) -> FixedState {
    match map.get(key).map_or(0, |c| c.load(Ordering::Acquire)) {
        0 => FixedState::default(),
        packed => unpack(packed, now_window),
    }
}

fn pack(state: FixedState) -> u64 {
    (state.window & 0xFFFF_FFFF) << 32 | u64::from(state.count)
}

impl WindowStore {
    /// A store for a window quota (`None` unless `params.kind` is a window kind).
    pub(super) fn new(params: QuotaParams, tracked: Arc<AtomicUsize>, seq: u64) -> Option<Self> {
        let counters = match params.kind {
            QuotaKind::FixedWindow { .. } => Counters::Fixed {
                clock: FixedClock::of(&params)?,
                map: DashMap::with_hasher(RandomState::default()),
            },
            #[cfg(feature = "calendar")]
            QuotaKind::Calendar { .. } => Counters::Fixed {
                clock: FixedClock::of(&params)?,
                map: DashMap::with_hasher(RandomState::default()),
            },
            QuotaKind::SlidingWindow { slice_us, slices } => Counters::Sliding {
                slice_us,
                slices,
                map: DashMap::with_hasher(RandomState::default()),
            },
            QuotaKind::Concurrent { .. } => Counters::InFlight {
                map: Arc::new(SlotMap {
                    map: DashMap::with_hasher(RandomState::default()),
                    tracked: tracked.clone(),
                }),
            },
            QuotaKind::Gcra => return None,
        };
        Some(WindowStore {
            counters,
            tracked,
            params,
            seq,
            earlier: arc_swap::ArcSwapOption::empty(),
        })
    }

    /// A concurrent quota's store for changed values (`params`), holding the slots `other`
    /// holds: requests in flight keep their slots, and give them back here or there alike.
    pub(super) fn sharing_slots(&self, params: QuotaParams, seq: u64) -> Option<Self> {
        let Counters::InFlight { map } = &self.counters else {
            return None;
        };
        Some(WindowStore {
            counters: Counters::InFlight { map: map.clone() },
            tracked: self.tracked.clone(),
            params,
            seq,
            earlier: arc_swap::ArcSwapOption::empty(),
        })
    }

    /// The values this store counts under.
    pub(super) fn params(&self) -> &QuotaParams {
        &self.params
    }

    /// The stores of the quota's earlier values, latest first.
    pub(super) fn earlier_stores(&self) -> Vec<Arc<WindowStore>> {
        super::store::earlier_stores(self)
    }

    /// Whether a store of the quota's earlier values holds a counter of `key`.
    pub(super) fn earlier_holds(&self, key: &Key) -> bool {
        let earlier = self.earlier.load();
        earlier
            .as_ref()
            .is_some_and(|e| e.from.contains(key) || e.from.earlier_holds(key))
    }

    /// The units `key` used at `now_us` under the quota's earlier values (taken from their
    /// store), converted to this store's limit.
    fn inherit(&self, key: &Key, now_us: u64) -> f64 {
        let earlier = self.earlier.load();
        let Some(e) = earlier.as_ref() else {
            return 0.0;
        };
        let used = e.from.take(key, now_us);
        if used <= 0.0 {
            return 0.0;
        }
        let (from, to) = (e.from.params.burst.get(), self.params.burst.get());
        e.on_change.carry(used, f64::from(from), f64::from(to))
    }

    /// Removes `key`'s counter and returns the units it holds at `now_us` (a fixed window:
    /// its count, when its window is the current one; a sliding window: its estimate).
    fn take(&self, key: &Key, now_us: u64) -> f64 {
        let taken = match &self.counters {
            Counters::Fixed { clock, map } => map.remove(key).map(|(_, c)| {
                super::track_sub(&self.tracked, 1);
                let now_window = clock.at(now_us).index;
                let state = unpack(c.into_inner(), now_window);
                if state.window == now_window {
                    f64::from(state.count)
                } else {
                    0.0
                }
            }),
            Counters::Sliding { slice_us, map, .. } => map.remove(key).map(|(_, s)| {
                super::track_sub(&self.tracked, sliding_units(&s));
                let state = s.into_inner().unwrap_or_else(|p| p.into_inner());
                state.used(*slice_us, now_us)
            }),
            Counters::InFlight { .. } => Some(0.0),
        };
        taken.unwrap_or_else(|| self.inherit(key, now_us))
    }

    /// A fixed window's packed counter for a key first seen here at `now_us`.
    fn fresh_fixed(&self, key: &Key, now_us: u64, clock: FixedClock) -> AtomicU64 {
        let count = self.inherit(key, now_us).ceil() as u32;
        AtomicU64::new(if count == 0 {
            0
        } else {
            pack(FixedState {
                window: clock.at(now_us).index,
                count,
            })
        })
    }

    /// A sliding window's state for a key first seen here at `now_us`.
    fn fresh_sliding(
        &self,
        key: &Key,
        now_us: u64,
        slice_us: u64,
        slices: u32,
    ) -> Mutex<SlidingState> {
        let count = self.inherit(key, now_us).ceil() as u32;
        Mutex::new(SlidingState::carried(slices, slice_us, now_us, count))
    }

    /// Moves `key`'s counter here from the quota's earlier values' store, when it has none
    /// here yet and one there, so that reads see what it used.
    fn adopt(&self, key: &Key, now_us: u64) {
        if self.earlier.load().is_none() || self.contains(key) || !self.earlier_holds(key) {
            return;
        }
        match &self.counters {
            Counters::Fixed { clock, map } => {
                entry(map, key, &self.tracked, || {
                    self.fresh_fixed(key, now_us, *clock)
                });
            }
            Counters::Sliding {
                slice_us,
                slices,
                map,
            } => {
                entry(map, key, &self.tracked, || {
                    self.fresh_sliding(key, now_us, *slice_us, *slices)
                });
            }
            Counters::InFlight { .. } => {}
        }
    }

    /// Drops the counters of the earlier stores that hold nothing at `now_us`, and the stores
    /// once empty.
    fn sweep_earlier(&self, now_us: u64) {
        let earlier = self.earlier.load();
        let Some(e) = earlier.as_ref() else {
            return;
        };
        e.from.sweep(now_us);
        if e.from.len() == 0 && e.from.earlier.load().is_none() {
            self.earlier.store(None);
        }
    }

    /// Decides a request of `cost` on `key` at `now_us`, counting it when it passes (a
    /// concurrent quota takes a slot only when `hold`; otherwise it is only checked).
    pub(super) fn decide(
        &self,
        index: usize,
        key: &Key,
        now_us: u64,
        cost: NonZeroU32,
        hold: bool,
    ) -> QuotaState {
        let p = &self.params;
        match &self.counters {
            Counters::Fixed { clock, map } => {
                let counter = entry(map, key, &self.tracked, || {
                    self.fresh_fixed(key, now_us, *clock)
                });
                let at = clock.at(now_us);
                swap(&counter, |packed| {
                    let mut state = unpack(packed, at.index);
                    let decided = state.decide(index, p, at, now_us, cost);
                    (decided, pack(state))
                })
            }
            Counters::Sliding {
                slice_us,
                slices,
                map,
            } => {
                let state = entry(map, key, &self.tracked, || {
                    self.fresh_sliding(key, now_us, *slice_us, *slices)
                });
                let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
                let decided = state.decide(index, p, *slice_us, now_us, cost);
                self.recharge(&mut state);
                decided
            }
            Counters::InFlight { .. } if !hold => self.check(index, key, now_us, cost),
            // One slot per request, whatever its cost.
            Counters::InFlight { map } => {
                let held = entry(map, key, &self.tracked, || AtomicU64::new(0));
                let slots = u64::from(p.burst.get());
                swap(&held, |held| {
                    if held < slots {
                        (in_flight_state(index, p, held + 1, true), held + 1)
                    } else {
                        (in_flight_state(index, p, held, false), held)
                    }
                })
            }
        }
    }

    /// Gives back the slot of a request on `key` that has ended (a concurrent quota; a window
    /// has nothing to give back). Never below zero: a slot given back twice is not counted
    /// twice.
    pub(super) fn release(&self, index: usize, key: &Key) -> Option<QuotaState> {
        let Counters::InFlight { map } = &self.counters else {
            return None;
        };
        let p = &self.params;
        let held = map.get(key)?;
        Some(swap(&held, |held| {
            let next = held.saturating_sub(1);
            (in_flight_state(index, p, next, true), next)
        }))
    }

    /// Settles `key`'s counter at `now_us` (see [`Settlement`]). A refund on a key without a
    /// counter has nothing to give back and makes none.
    pub(super) fn settle(
        &self,
        index: usize,
        key: &Key,
        now_us: u64,
        settlement: Settlement,
    ) -> QuotaState {
        self.adopt(key, now_us);
        let p = &self.params;
        let refund = matches!(settlement, Settlement::Refund { .. });
        match &self.counters {
            Counters::Fixed { clock, map } => {
                let at = clock.at(now_us);
                let settle = |packed: u64| {
                    let mut state = match packed {
                        0 => FixedState::default(),
                        packed => unpack(packed, at.index),
                    };
                    let settled = state.settle(index, p, at, now_us, settlement);
                    (settled, pack(state))
                };
                let counter = match map.get(key) {
                    Some(counter) => counter,
                    None if refund => return settle(0).0,
                    None => entry(map, key, &self.tracked, || AtomicU64::new(0)),
                };
                swap(&counter, settle)
            }
            Counters::Sliding {
                slice_us,
                slices,
                map,
            } => {
                let state = match map.get(key) {
                    Some(state) => state,
                    None if refund => {
                        let mut empty = SlidingState::new(*slices);
                        return empty.settle(index, p, *slice_us, now_us, settlement);
                    }
                    None => entry(map, key, &self.tracked, || {
                        Mutex::new(SlidingState::new(*slices))
                    }),
                };
                let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
                let settled = state.settle(index, p, *slice_us, now_us, settlement);
                self.recharge(&mut state);
                settled
            }
            // Slots are given back by `release`, never by a charge's settlement.
            Counters::InFlight { .. } => self.peek(index, key, now_us),
        }
    }

    /// Whether `key`'s counter would pass a request of `cost` at `now_us`, changing nothing and
    /// allocating nothing: the outcome is [`decide`](Self::decide)'s, and so is the state of a
    /// refusal (a sliding window's allowed state is the one before counting the request: see
    /// [`would`](Self::would)).
    pub(super) fn check(
        &self,
        index: usize,
        key: &Key,
        now_us: u64,
        cost: NonZeroU32,
    ) -> QuotaState {
        self.adopt(key, now_us);
        let p = &self.params;
        match &self.counters {
            Counters::Fixed { clock, map } => {
                let at = clock.at(now_us);
                let mut state = stored(map, key, at.index);
                state.decide(index, p, at, now_us, cost)
            }
            Counters::Sliding {
                slice_us,
                slices,
                map,
            } => match map.get(key) {
                Some(state) => {
                    let state = state.lock().unwrap_or_else(|p| p.into_inner());
                    state.check(index, p, *slice_us, now_us, cost)
                }
                None => (SlidingState::new(*slices)).check(index, p, *slice_us, now_us, cost),
            },
            // Checked, not taken: the slots free now.
            Counters::InFlight { map } => {
                let held = map.get(key).map_or(0, |h| h.load(Ordering::Acquire));
                in_flight_state(index, p, held, held < u64::from(p.burst.get()))
            }
        }
    }

    /// What deciding a request of `cost` on `key` at `now_us` would answer, changing nothing:
    /// when it would pass, the state after counting it, as [`decide`](Self::decide) reports.
    pub(super) fn would(
        &self,
        index: usize,
        key: &Key,
        now_us: u64,
        cost: NonZeroU32,
    ) -> QuotaState {
        self.adopt(key, now_us);
        let p = &self.params;
        match &self.counters {
            Counters::Fixed { .. } | Counters::InFlight { .. } => {
                self.check(index, key, now_us, cost)
            }
            Counters::Sliding {
                slice_us,
                slices,
                map,
            } => {
                let mut state = match map.get(key) {
                    Some(state) => state.lock().unwrap_or_else(|p| p.into_inner()).clone(),
                    None => SlidingState::new(*slices),
                };
                state.decide(index, p, *slice_us, now_us, cost)
            }
        }
    }

    /// `key`'s state at `now_us`, changing nothing (a fresh one when untracked).
    pub(super) fn peek(&self, index: usize, key: &Key, now_us: u64) -> QuotaState {
        self.adopt(key, now_us);
        let p = &self.params;
        match &self.counters {
            Counters::Fixed { clock, map } => {
                let at = clock.at(now_us);
                (stored(map, key, at.index)).peek(index, p, at, now_us)
            }
            Counters::Sliding {
                slice_us,
                slices,
                map,
            } => match map.get(key) {
                Some(state) => {
                    let state = state.lock().unwrap_or_else(|p| p.into_inner());
                    state.peek(index, p, *slice_us, now_us)
                }
                None => (SlidingState::new(*slices)).peek(index, p, *slice_us, now_us),
            },
            Counters::InFlight { map } => {
                let held = map.get(key).map_or(0, |h| h.load(Ordering::Acquire));
                in_flight_state(index, p, held, true)
            }
        }
    }

    /// Whether `key` has a counter here.
    pub(super) fn contains(&self, key: &Key) -> bool {
        match &self.counters {
            Counters::Fixed { map, .. } => map.contains_key(key),
            Counters::InFlight { map } => map.contains_key(key),
            Counters::Sliding { map, .. } => map.contains_key(key),
        }
    }

    /// Forgets `key`'s counters, here and under the quota's earlier values. Requests in
    /// flight are not forgotten: they still run, and give their slots back when they end.
    pub(super) fn remove(&self, key: &Key) {
        let forget = |store: &WindowStore| {
            let removed = match &store.counters {
                Counters::Fixed { map, .. } => map.remove(key).map(|_| 1),
                Counters::InFlight { .. } => None,
                Counters::Sliding { map, .. } => map.remove(key).map(|(_, s)| sliding_units(&s)),
            };
            super::track_sub(&store.tracked, removed.unwrap_or(0));
        };
        forget(self);
        for store in self.earlier_stores() {
            forget(&store);
        }
    }

    /// Evicts about an eighth of the counters (`needed` at least), the least used (see
    /// [`evict_lightest`]); a concurrent quota's are never evicted: a request in flight gives
    /// its slot back to its counter. Returns how many it evicted.
    pub(super) fn evict(&self, needed: usize, now_us: u64) -> usize {
        let evicted = match &self.counters {
            Counters::Fixed { clock, map } => {
                let now_window = clock.at(now_us).index;
                let weight = |packed: u64| {
                    let state = unpack(packed, now_window);
                    if state.window == now_window {
                        u64::from(state.count)
                    } else {
                        0
                    }
                };
                let shared = |c: &AtomicU64| weight(c.load(Ordering::Relaxed));
                evict_lightest(map, needed, shared, |c| (weight(*c.get_mut()), 1))
            }
            Counters::Sliding { map, .. } => {
                let shared =
                    |s: &Mutex<SlidingState>| s.lock().unwrap_or_else(|p| p.into_inner()).total();
                let exclusive = |s: &mut Mutex<SlidingState>| {
                    let s = s.get_mut().unwrap_or_else(|p| p.into_inner());
                    (s.total(), 1 + s.charged as usize)
                };
                evict_lightest(map, needed, shared, exclusive)
            }
            Counters::InFlight { .. } => 0,
        };
        super::track_sub(&self.tracked, evicted);
        evicted
    }

    /// Counts what a sliding window's counts take of the key cap now (see
    /// [`SlidingState::cap_units`]), after a change to them.
    fn recharge(&self, state: &mut SlidingState) {
        let units = state.cap_units();
        if units > state.charged {
            super::track_add(&self.tracked, (units - state.charged) as usize);
        } else if units < state.charged {
            super::track_sub(&self.tracked, (state.charged - units) as usize);
        }
        state.charged = units;
    }

    /// Whether this is a concurrent quota's (whose counters are never evicted).
    pub(super) fn holds_slots(&self) -> bool {
        matches!(self.counters, Counters::InFlight { .. })
    }

    pub(super) fn len(&self) -> usize {
        match &self.counters {
            Counters::Fixed { map, .. } => map.len(),
            Counters::InFlight { map } => map.len(),
            Counters::Sliding { map, .. } => map.len(),
        }
    }

    /// Drops the counters that hold nothing any more at `now_us` (their windows have passed):
    /// a key's next request starts a fresh one, which is the same.
    pub(super) fn sweep(&self, now_us: u64) {
        let mut removed = 0;
        match &self.counters {
            Counters::Fixed { clock, map } => {
                let at = clock.at(now_us);
                map.retain(|_, c| {
                    let idle = unpack(*c.get_mut(), at.index).is_idle(at);
                    removed += usize::from(idle);
                    !idle
                });
                map.shrink_to_fit();
            }
            Counters::Sliding { slice_us, map, .. } => {
                map.retain(|_, state| {
                    let state = state.get_mut().unwrap_or_else(|p| p.into_inner());
                    let idle = state.is_idle(*slice_us, now_us);
                    if idle {
                        removed += 1 + state.charged as usize;
                    }
                    !idle
                });
                map.shrink_to_fit();
            }
            // Under the map's write lock: no request holds the entry while it is checked.
            Counters::InFlight { map } => {
                map.retain(|_, held| {
                    let idle = *held.get_mut() == 0;
                    removed += usize::from(idle);
                    !idle
                });
                map.shrink_to_fit();
            }
        }
        super::track_sub(&self.tracked, removed);
        self.sweep_earlier(now_us);
    }
}

impl Drop for WindowStore {
    fn drop(&mut self) {
        let units = match &mut self.counters {
            Counters::Sliding { map, .. } => map.iter().map(|e| sliding_units(e.value())).sum(),
            // Counted by the slot map, shared by the quota's versions, when it goes.
            Counters::InFlight { .. } => 0,
            _ => self.len(),
        };
        super::track_sub(&self.tracked, units);
    }
}

/// What a sliding window's entry takes of the key cap: itself, and its counts.
fn sliding_units(state: &Mutex<SlidingState>) -> usize {
    1 + state.lock().unwrap_or_else(|p| p.into_inner()).charged as usize
}
