//! What a decision would answer now, changing nothing (`Mode::Peek`): the status endpoint's
//! and the handlers' view of a key.

use super::*;

impl<C> LocalBackend<C>
where
    C: Clock + Clone + Send + Sync + 'static,
    C::Instant: Send + Sync,
{
    /// What `decide` would answer now, changing nothing: every quota in order, up to the first
    /// that refuses.
    pub(super) fn peek(&self, policy: &LocalPolicy<C>, key: &Key, cost: NonZeroU32) -> Decision {
        let inner = &*self.inner;
        // As `decide`: a quota the cost can never fit answers alone.
        if let Some((index, quota)) =
            (policy.limiters.iter().enumerate()).find(|(_, quota)| quota.never_fits(cost))
        {
            return Decision::new([quota.peek(index, key, inner)]);
        }
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for (index, quota) in policy.limiters.iter().enumerate() {
            let state = quota.would(index, key, cost, inner, inner.now_us());
            let stop = state.outcome != Outcome::Allowed;
            states.push(state);
            if stop {
                break;
            }
        }
        Decision::from_states(states)
    }

    /// A reservation (see [`Mode::Reserve`]): window quotas must have room now; GCRA quotas
    /// take the cost if it fits within `max_wait`, counted as of the time the request goes on
    /// (the longest wait over them). The waits are worked out first from the buckets as they
    /// are, then each bucket is charged by compare-and-swap, checking its wait again: a
    /// reservation on a bucket another request changed meanwhile waits for it too (and is
    /// refused if that is beyond `max_wait`, what it took from the quotas before given back).
    /// In that race, the quotas charged before the wait grew were charged as of the earlier
    /// time: a request after it may pass them up to that difference early.
    pub(super) fn reserve(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
        max_wait: Duration,
    ) -> Decision {
        match self.refuse_before_charging(policy, key, cost) {
            None => {}
            Some(Refusal::Deny(refused)) => return Decision::new([refused]),
            Some(Refusal::Allow) => return Decision::new([]),
        }
        let inner = &*self.inner;
        let now_us = inner.now_us();
        // A window quota cannot count a request into a window that has not begun: a policy
        // with one reserves only what every quota has now.
        let windows = (policy.limiters.iter()).any(|q| matches!(q.counter, Counter::Window(_)));
        let max_wait = if windows {
            0
        } else {
            Mode::Reserve { max_wait }.max_wait_ns()
        };
        // Windows first: they cannot count into a window that has not begun.
        let mut wait = 0u64;
        for (index, quota) in policy.limiters.iter().enumerate() {
            match &quota.counter {
                Counter::Window(store) => {
                    let state = store.check(index, key, now_us, cost);
                    if state.outcome != Outcome::Allowed {
                        return Decision::new([state]);
                    }
                }
                Counter::Gcra { store, start, .. } => {
                    let now = inner.elapsed_ns();
                    let tat = store.tat(key, now);
                    let rel = until(*start, tat, now);
                    let w = gcra_wait(&quota.params, cost, rel);
                    if w > max_wait {
                        return Decision::new([gcra_state(
                            index,
                            &quota.params,
                            cost,
                            rel,
                            Duration::ZERO,
                        )]);
                    }
                    wait = wait.max(w);
                }
            }
        }
        let mut steps = smallvec::SmallVec::<[(usize, u64); 2]>::new();
        let mut states = smallvec::SmallVec::<[QuotaState; 2]>::new();
        for (index, quota) in policy.limiters.iter().enumerate() {
            let state = match &quota.counter {
                Counter::Window(store) => store.decide(index, key, now_us, cost, false),
                Counter::Gcra { store, start, .. } => {
                    let p = &quota.params;
                    let now = inner.elapsed_ns().saturating_sub(start.as_u64());
                    let step = p.emission_ns.saturating_mul(u64::from(cost.get()));
                    let longest = std::cell::Cell::new(wait);
                    let bucket = store.bucket(key, now.saturating_add(start.as_u64()));
                    let charged = measure(&bucket, |tat| {
                        let tat = tat.map_or(0, |t| t.as_u64());
                        let w = gcra_wait(p, cost, Duration::from_nanos(tat.saturating_sub(now)));
                        let w = w.max(wait);
                        if w > max_wait {
                            return Err(w);
                        }
                        longest.set(w);
                        let next = tat.max(now.saturating_add(w)).saturating_add(step);
                        Ok(((next, next - tat), Nanos::from(next.max(1))))
                    });
                    match charged {
                        Ok((next, added)) => {
                            wait = longest.get();
                            steps.push((index, added));
                            QuotaState::allowed(
                                index,
                                p,
                                Duration::from_nanos(next.saturating_sub(now)),
                            )
                        }
                        Err(w) => QuotaState::denied(index, p, cost, Duration::from_nanos(w)),
                    }
                }
            };
            if state.outcome != Outcome::Allowed {
                // All or nothing: what the quotas before this one took goes back (a bucket
                // what this reservation added to it, its wait included).
                if !states.is_empty() {
                    let added = |i| {
                        let gcra = steps.iter().find(|(at, _)| *at == i);
                        gcra.map_or(u64::from(cost.get()), |s| s.1)
                    };
                    self.undo(policy, key, &states, false, added, || now_us);
                }
                return Decision::new([state]);
            }
            states.push(state);
        }
        Decision::from_states(states).after(Duration::from_nanos(wait))
    }

    /// The state of the first quota that refuses `cost` on `key` without looking at its
    /// bucket: one the cost can never fit (governor's `t * (cost - 1)` would also overflow
    /// for huge costs), or, when the buckets `key` still lacks would not fit in the table,
    /// the first quota lacking one.
    #[inline]
    pub(super) fn refuse_before_charging(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
    ) -> Option<Refusal> {
        let inner = &self.inner;
        let quotas = policy.limiters.len();
        // Only near the cap is it worth looking the key up before charging.
        if cost.get() <= policy.min_burst
            && inner.tracked.load(Ordering::Relaxed).saturating_add(quotas) <= inner.max_keys
        {
            return None;
        }
        self.refuse_before_charging_slow(policy, key, cost)
    }

    /// [`refuse_before_charging`](Self::refuse_before_charging), for a request that can never
    /// fit or a table near its cap.
    #[cold]
    fn refuse_before_charging_slow(
        &self,
        policy: &LocalPolicy<C>,
        key: &Key,
        cost: NonZeroU32,
    ) -> Option<Refusal> {
        if let Some((index, quota)) =
            (policy.limiters.iter().enumerate()).find(|(_, quota)| quota.never_fits(cost))
        {
            return Some(Refusal::Deny(quota.peek(index, key, &self.inner)));
        }
        let inner = &self.inner;
        let quotas = policy.limiters.len();
        if inner.tracked.load(Ordering::Relaxed).saturating_add(quotas) <= inner.max_keys {
            return None;
        }
        let mut lacking =
            (policy.limiters.iter().enumerate()).filter(|(_, quota)| !quota.counter.contains(key));
        let (first, quota) = lacking.next()?;
        let needed = 1 + lacking.count();
        let overflows =
            || inner.tracked.load(Ordering::Relaxed).saturating_add(needed) > inner.max_keys;
        if !overflows() {
            return None;
        }
        inner.sweep_when_full();
        // Other requests evict and insert at the same time: the room one eviction makes may
        // be taken before this request uses it, so try again a few times.
        for _ in 0..4 {
            if !overflows() {
                return None;
            }
            if !inner.evict(needed) && inner.evictable() == 0 {
                break;
            }
        }
        if !overflows() {
            return None;
        }
        inner.count_full_refusal();
        Some(match inner.when_full {
            WhenFull::Deny => Refusal::Deny(QuotaState::denied(
                first,
                &quota.params,
                cost,
                Duration::from_secs(1),
            )),
            WhenFull::Allow => Refusal::Allow,
        })
    }
}

impl<C: Clock> PreparedQuota<C> {
    /// Whether a request of `cost` can never pass this quota: it exceeds the burst (a
    /// concurrent quota takes one slot whatever the cost).
    #[inline]
    pub(super) fn never_fits(&self, cost: NonZeroU32) -> bool {
        cost > self.params.burst && !self.params.is_concurrent()
    }

    /// The state of `key`'s bucket or window for a request that can never fit it, read
    /// without changing anything.
    /// What this quota would say of `cost` now (windows at `now_us`), changing nothing.
    pub(super) fn would(
        &self,
        index: usize,
        key: &Key,
        cost: NonZeroU32,
        inner: &Inner<C>,
        now_us: u64,
    ) -> QuotaState {
        match &self.counter {
            Counter::Window(store) => store.would(index, key, now_us, cost),
            Counter::Gcra { store, start, .. } => {
                let now = inner.elapsed_ns();
                let tat = store.tat(key, now);
                let rel = until(*start, tat, now);
                gcra_state(index, &self.params, cost, rel, Duration::ZERO)
            }
        }
    }

    pub(super) fn peek(&self, index: usize, key: &Key, inner: &Inner<C>) -> QuotaState {
        match &self.counter {
            Counter::Gcra { store, start, .. } => {
                let now = inner.elapsed_ns();
                let tat = store.tat(key, now);
                QuotaState::never_fits(index, &self.params, until(*start, tat, now))
            }
            Counter::Window(store) => store.peek(index, key, inner.now_us()),
        }
    }
}
