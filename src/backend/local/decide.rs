//! A decision: every quota of the policy in order, all or nothing, on governor's GCRA buckets,
//! the windows and the slots, and the arithmetic they share.

use super::*;

impl<C> LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    /// A decision ([`Mode::Decide`]), taking a slot of every concurrent quota when `hold`
    /// ([`Mode::Hold`]; without it a concurrent quota is only checked).
    #[inline]
    pub(super) fn decide_holding(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        hold: bool,
    ) -> Ready<Result<Decision, BackendError>> {
        ready(Ok(match &policy.blocks {
            None => self.decide_now(policy, key, cost, hold),
            Some(blocks) => self.blocking(policy, blocks, key, cost, true, || {
                self.decide_now(policy, key, cost, hold)
            }),
        }))
    }

    /// A decision (`decide`) on a policy with a penalty: a blocked key is refused until its
    /// block ends (a peek, `starts: false`, says so too); a refusal starts a block, unless the
    /// decision only peeks.
    #[inline(never)]
    pub(super) fn blocking(
        &self,
        policy: &LocalPolicy<C>,
        blocks: &Blocks,
        key: &Key,
        cost: NonZeroU32,
        starts: bool,
        decide: impl FnOnce() -> Decision,
    ) -> Decision {
        let now_us = self.inner.now_us();
        if let Some(left) = blocks.left(key, now_us) {
            return blocked(policy, left);
        }
        let decision = decide();
        if !starts {
            return decision;
        }
        self.penalize(policy, blocks, key, cost, decision, now_us)
    }

    /// `decision`, or a block from `now_us` when it refused the request: not when the request
    /// can never fit (its cost, not its rate, is at fault), nor when the key table is full and
    /// nothing can be evicted to make room for the block.
    fn penalize(
        &self,
        policy: &LocalPolicy<C>,
        blocks: &Blocks,
        key: &Key,
        cost: NonZeroU32,
        decision: Decision,
        now_us: u64,
    ) -> Decision {
        let inner = &self.inner;
        let full = || inner.tracked.load(Ordering::Relaxed) >= inner.max_keys;
        if decision.is_allowed()
            || decision.never_fits()
            || !self.refused_by_a_blocking_quota(policy, &decision, key, cost, now_us)
            || (full() && (!inner.evict(1) || full()))
        {
            return decision;
        }
        blocked(policy, blocks.start(key, now_us))
    }

    /// Whether a quota that blocks (`Quota::block_for`) refuses the request `decision`
    /// refused: the quota that refused it, or another one the decision did not get to (it
    /// stops at the first refusal), asked now. Every quota blocks when the block is the
    /// policy's.
    fn refused_by_a_blocking_quota(
        &self,
        policy: &LocalPolicy<C>,
        decision: &Decision,
        key: &Key,
        cost: NonZeroU32,
        now_us: u64,
    ) -> bool {
        let mask = policy.block_mask;
        let blocks = |i: usize| Policy::blocks_on(mask, i);
        let denied = |s: &QuotaState| matches!(s.outcome, Outcome::Denied { .. });
        if decision
            .quotas()
            .iter()
            .any(|s| denied(s) && blocks(s.index))
        {
            return true;
        }
        (policy.limiters.iter().enumerate())
            .filter(|(i, q)| {
                blocks(*i)
                    && !decision.quotas().iter().any(|s| s.index == *i)
                    && !q.params.is_concurrent()
            })
            .any(|(i, q)| denied(&q.would(i, key, cost, &self.inner, now_us)))
    }

    // Always inlined: a policy without a penalty decides here, from `decide` (where `hold` is
    // known), as before penalties came; the one other caller is the penalty's cold path.
    #[inline(always)]
    fn decide_now(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        hold: bool,
    ) -> Decision {
        if !self.inner.sweeper_started.load(Ordering::Relaxed) {
            // Built outside a runtime: start sweeping from the first request inside one.
            self.start_sweeper();
        }
        // Refusals that need no bucket come first, before any bucket is charged: a request
        // that can never fit, or a new key when the table is full, must not use up the
        // earlier quotas of a multi-quota policy.
        match self.refuse_before_charging(policy, key, cost) {
            None => {}
            Some(Refusal::Deny(refused)) => return Decision::new([refused]),
            // Untracked, so unlimited: a decision without quota states carries no headers.
            Some(Refusal::Allow) => return Decision::new([]),
        }
        let inner = &*self.inner;
        // One reading of the time for every window quota of the decision.
        let now_us = std::cell::OnceCell::new();
        let now_us = || *now_us.get_or_init(|| inner.now_us());
        // Window quotas are this crate's own counters: in a policy of several quotas, a
        // request one of them refuses is refused before any quota is charged. They are then
        // charged last, after the GCRA quotas (which governor cannot test without charging).
        if policy.windows {
            for (index, quota) in policy.limiters.iter().enumerate() {
                if let Counter::Window(store) = &quota.counter {
                    let state = store.check(index, key, now_us(), cost);
                    if state.outcome != Outcome::Allowed {
                        return Decision::new([state]);
                    }
                }
            }
        }
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for &index in &policy.order {
            let Some(quota) = policy.limiters.get(index) else {
                continue;
            };
            let params = &quota.params;
            let state = match &quota.counter {
                Counter::Window(store) => store.decide(index, key, now_us(), cost, hold),
                Counter::Gcra { limiter, start, .. } => match limiter.check_key_n(key, cost) {
                    Ok(Ok(snapshot)) => {
                        // The bucket's new arrival time, as the store just wrote it.
                        let tat = LAST_TAT.get();
                        let mut state =
                            QuotaState::allowed(index, params, until(*start, tat, LAST_NOW.get()));
                        // governor's count is exact; ours may be one more right at a boundary.
                        state.remaining = snapshot.remaining_burst_capacity().min(state.limit);
                        state
                    }
                    Ok(Err(not_until)) => QuotaState::denied(
                        index,
                        params,
                        cost,
                        not_until.wait_time_from(Nanos::from(LAST_NOW.get())),
                    ),
                    Err(_insufficient) => quota.peek(index, key, inner),
                },
            };
            if state.outcome != Outcome::Allowed {
                // All or nothing: what the quotas before this one took goes back.
                if !states.is_empty() {
                    let added = |i: usize| match policy.limiters.get(i) {
                        Some(q) if matches!(q.counter, Counter::Gcra { .. }) => {
                            q.params.emission_ns.saturating_mul(u64::from(cost.get()))
                        }
                        _ => u64::from(cost.get()),
                    };
                    self.undo(policy, key, &states, hold, added, now_us);
                }
                // Reported alone: the states of the quotas before it no longer hold.
                return Decision::new([state]);
            }
            states.push(state);
        }
        // Reported in policy order.
        if policy.windows {
            states.sort_unstable_by_key(|s| s.index);
        }
        Decision::from_states(states)
    }
}

/// The wait of a request of `cost` on a GCRA bucket whose theoretical arrival time is `tat`
/// from now: it fits when `tat + T × (cost − burst) ≤ 0` (the Redis script's test).
pub(super) fn gcra_wait(p: &QuotaParams, cost: NonZeroU32, tat: Duration) -> u64 {
    let t = u128::from(p.emission_ns);
    let tat = tat.as_nanos();
    let w = (tat + t * u128::from(cost.get())).saturating_sub(t * u128::from(p.burst.get()));
    u64::try_from(w).unwrap_or(u64::MAX)
}

/// Replaces `cell`'s value with the one `f` makes of it, atomically (compare-and-swap, again
/// if another thread changed it meanwhile); returns what `f` returned with it. Nothing is
/// written when the value stays the same.
pub(super) fn swap<R>(cell: &AtomicU64, mut f: impl FnMut(u64) -> (R, u64)) -> R {
    let mut prev = cell.load(Ordering::Acquire);
    loop {
        let (result, next) = f(prev);
        if next == prev {
            return result;
        }
        match cell.compare_exchange_weak(prev, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return result,
            Err(actual) => prev = actual,
        }
    }
}

/// `key`'s entry in `map`, made (and counted in `tracked`) on its first request.
pub(super) fn entry<'a, V>(
    map: &'a DashMap<Key, V, RandomState>,
    key: &Key,
    tracked: &AtomicUsize,
    fresh: impl FnOnce() -> V,
) -> dashmap::mapref::one::Ref<'a, Key, V> {
    if let Some(v) = map.get(key) {
        return v;
    }
    match map.entry(key.clone()) {
        Entry::Occupied(e) => e.into_ref().downgrade(),
        Entry::Vacant(e) => {
            track_add(tracked, 1);
            e.insert(fresh()).downgrade()
        }
    }
}

/// What a decision of `cost` on a GCRA bucket whose theoretical arrival time is `tat` from now
/// would answer: allowed (the TAT after it), or denied with its wait.
pub(super) fn gcra_state(
    index: usize,
    p: &QuotaParams,
    cost: NonZeroU32,
    tat: Duration,
    _: Duration,
) -> QuotaState {
    let w = gcra_wait(p, cost, tat);
    if w == 0 {
        let step = Duration::from_nanos(p.emission_ns.saturating_mul(u64::from(cost.get())));
        QuotaState::allowed(index, p, tat.saturating_add(step))
    } else {
        QuotaState::denied(index, p, cost, Duration::from_nanos(w))
    }
}

/// How far from `now` (nanoseconds since the backend's origin) a theoretical arrival time `tat`
/// (governor's nanoseconds since the limiter's `start`) lies: zero when passed.
pub(super) fn until(start: Nanos, tat: u64, now: u64) -> Duration {
    let elapsed = now.saturating_sub(start.as_u64());
    Duration::from_nanos(tat.saturating_sub(elapsed))
}
