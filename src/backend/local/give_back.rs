//! Giving back what a refused decision took from the quotas before the one that refused it, so
//! that a refused request takes nothing.

use super::*;

impl<C> LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    /// Gives back what a decision took from the quotas of `charged` (their states, allowed)
    /// before a later quota refused it, so that a refused request takes nothing: units back to
    /// every GCRA bucket and window (into the window they were counted in), and the slot of a
    /// concurrent quota when the decision held one. Each give-back is an atomic step of its
    /// own: a request racing this one may see the units taken for the few instructions between
    /// the charge and the give-back (and be refused for it), never the other way round.
    #[cold]
    #[inline(never)]
    pub(super) fn undo(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        charged: &[QuotaState],
        hold: bool,
        added: impl Fn(usize) -> u64,
        now_us: impl Fn() -> u64,
    ) {
        for state in charged {
            let Some(quota) = policy.limiters.get(state.index) else {
                continue;
            };
            match &quota.counter {
                Counter::Gcra { store, start, .. } => {
                    let at = self.inner.elapsed_ns().saturating_sub(start.as_u64());
                    give_back(store, key, added(state.index), at);
                }
                Counter::Window(store) if quota.params.is_concurrent() => {
                    if hold {
                        store.release(state.index, key);
                    }
                }
                Counter::Window(store) => {
                    let now_us = now_us();
                    let refund = Settlement::Refund {
                        units: u32::try_from(added(state.index)).unwrap_or(u32::MAX),
                        admitted_us: now_us,
                    };
                    store.settle(state.index, key, now_us, refund);
                }
            }
        }
    }

    /// A request's end ([`Mode::Release`]): its slot back in every concurrent quota of `policy`.
    pub(super) fn release(&self, policy: &LocalPolicy<C>, key: &Key) -> Decision {
        let states = policy.limiters.iter().enumerate();
        Decision::new(states.filter_map(|(index, quota)| match &quota.counter {
            Counter::Window(store) => store.release(index, key),
            Counter::Gcra { .. } => None,
        }))
    }

    /// A settlement ([`Mode::Refund`] or [`Mode::Debit`]) of `cost` units on every quota of
    /// `policy` that counts units (not requests in flight, whose state is reported as it is).
    pub(super) fn settle(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> Decision {
        let inner = &*self.inner;
        let now = inner.elapsed_ns();
        let now_us = inner.us_at(now);
        let admitted_ago = match mode {
            Mode::Refund { admitted_ago } => Some(admitted_ago),
            _ => None,
        };
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for (index, quota) in policy.limiters.iter().enumerate() {
            let p = &quota.params;
            let state = match &quota.counter {
                Counter::Window(store) => {
                    let settlement = match admitted_ago {
                        Some(ago) => Settlement::Refund {
                            units: cost.get(),
                            admitted_us: now_us
                                .saturating_sub(u64::try_from(ago.as_micros()).unwrap_or(u64::MAX)),
                        },
                        None => Settlement::Debit(cost.get()),
                    };
                    store.settle(index, key, now_us, settlement)
                }
                Counter::Gcra { store, start, .. } => {
                    let step = p.emission_ns.saturating_mul(u64::from(cost.get()));
                    // The limiter's time, never later than governor's (see `start`).
                    let at = now.saturating_sub(start.as_u64());
                    let settled = match admitted_ago {
                        // A key without a bucket is full: nothing to give back. A bucket
                        // never fills past full (an arrival time before now).
                        Some(_) => give_back(store, key, step, at),
                        None => {
                            let tat = store.bucket(key, now);
                            swap(&tat, |tat| {
                                let next = tat.max(at).saturating_add(step);
                                (next, next)
                            })
                        }
                    };
                    QuotaState::allowed(index, p, until(*start, settled, now))
                }
            };
            states.push(state);
        }
        Decision::from_states(states)
    }
}

/// Takes `step` nanoseconds off `key`'s GCRA arrival time, never below `at` (the limiter's
/// time now: a bucket never fills past full); returns the arrival time after it. A key without
/// a bucket is full: nothing to give back.
pub(super) fn give_back(store: &StoreMap, key: &Key, step: u64, at: u64) -> u64 {
    let now = at.saturating_add(store.start.load(Ordering::Relaxed));
    store.get(key, now).map_or(0, |tat| {
        swap(&tat, |tat| {
            let next = tat.saturating_sub(step).max(at);
            (next, next)
        })
    })
}
