//! The local backend's window counters: one small mutex-guarded state per key, decided with
//! the arithmetic of [`crate::backend::window`].
//!
//! A fixed window's state is its window index and count; a sliding window's, its newest
//! sub-window index and `slices + 1` counts (stored inline for the default single sub-window).
//! The lock is held for a few arithmetic operations, never across an await; a key's state is
//! created with the key (its first request) and allocates nothing afterwards.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use foldhash::quality::RandomState;

use crate::Key;
use crate::backend::QuotaState;
use crate::backend::window::{FixedState, SlidingState};
use crate::quota::{QuotaKind, QuotaParams};

/// The counters of one window quota, by key, counted against the backend's key cap.
pub(super) struct WindowStore {
    map: DashMap<Key, Mutex<State>, RandomState>,
    tracked: Arc<AtomicUsize>,
    params: QuotaParams,
}

enum State {
    Fixed(FixedState),
    Sliding(SlidingState),
}

impl WindowStore {
    /// A store for a window quota (`params.kind` is a window kind).
    pub(super) fn new(params: QuotaParams, tracked: Arc<AtomicUsize>) -> Self {
        WindowStore {
            map: DashMap::with_hasher(RandomState::default()),
            tracked,
            params,
        }
    }

    fn fresh(&self) -> State {
        match self.params.kind {
            QuotaKind::SlidingWindow { slices, .. } => State::Sliding(SlidingState::new(slices)),
            _ => State::Fixed(FixedState::default()),
        }
    }

    /// Decides a request of `cost` on `key` at `now_us`, counting it when it passes.
    pub(super) fn decide(
        &self,
        index: usize,
        key: &Key,
        now_us: u64,
        cost: NonZeroU32,
    ) -> QuotaState {
        if let Some(state) = self.map.get(key) {
            return self.decide_in(&state, index, now_us, cost);
        }
        match self.map.entry(key.clone()) {
            Entry::Occupied(e) => self.decide_in(e.get(), index, now_us, cost),
            Entry::Vacant(e) => {
                self.tracked.fetch_add(1, Ordering::Relaxed);
                let state = e.insert(Mutex::new(self.fresh()));
                self.decide_in(&state, index, now_us, cost)
            }
        }
    }

    fn decide_in(
        &self,
        state: &Mutex<State>,
        index: usize,
        now_us: u64,
        cost: NonZeroU32,
    ) -> QuotaState {
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        let p = &self.params;
        match (&mut *state, p.kind) {
            (State::Fixed(s), QuotaKind::FixedWindow { window_us }) => {
                s.decide(index, p, window_us, now_us, cost)
            }
            (State::Sliding(s), QuotaKind::SlidingWindow { slice_us, .. }) => {
                s.decide(index, p, slice_us, now_us, cost)
            }
            // A store holds the states of its own kind only.
            _ => QuotaState::never_fits(index, p, std::time::Duration::ZERO),
        }
    }

    /// `key`'s state at `now_us`, changing nothing (a fresh one when untracked).
    pub(super) fn peek(&self, index: usize, key: &Key, now_us: u64) -> QuotaState {
        let p = &self.params;
        let fresh;
        let tracked = self.map.get(key);
        let guard;
        let state = match &tracked {
            Some(state) => {
                guard = state.lock().unwrap_or_else(|p| p.into_inner());
                &*guard
            }
            None => {
                fresh = self.fresh();
                &fresh
            }
        };
        match (state, p.kind) {
            (State::Fixed(s), QuotaKind::FixedWindow { window_us }) => {
                s.peek(index, p, window_us, now_us)
            }
            (State::Sliding(s), QuotaKind::SlidingWindow { slice_us, .. }) => {
                s.peek(index, p, slice_us, now_us)
            }
            _ => QuotaState::never_fits(index, p, std::time::Duration::ZERO),
        }
    }

    /// Whether `key` has a counter here.
    pub(super) fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    /// Drops the counters that hold nothing any more at `now_us` (their windows have passed):
    /// a key's next request starts a fresh one, which is the same.
    pub(super) fn sweep(&self, now_us: u64) {
        let mut removed = 0;
        self.map.retain(|_, state| {
            let state = state.get_mut().unwrap_or_else(|p| p.into_inner());
            let idle = match (&*state, self.params.kind) {
                (State::Fixed(s), QuotaKind::FixedWindow { window_us }) => {
                    s.is_idle(window_us, now_us)
                }
                (State::Sliding(s), QuotaKind::SlidingWindow { slice_us, .. }) => {
                    s.is_idle(slice_us, now_us)
                }
                _ => true,
            };
            removed += usize::from(idle);
            !idle
        });
        self.tracked.fetch_sub(removed, Ordering::Relaxed);
        self.map.shrink_to_fit();
    }
}

impl Drop for WindowStore {
    fn drop(&mut self) {
        self.tracked.fetch_sub(self.map.len(), Ordering::Relaxed);
    }
}
