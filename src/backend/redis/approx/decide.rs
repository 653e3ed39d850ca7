//! Deciding here: a key's counts read against its allowance, the increments queued for the
//! next flush, blocks started, settlements made, and a full table's overflow.

use super::*;

/// Increments a flush sends for one key: quota, sub-window, units (negative for a refund),
/// and whether the counter's expiry is set with them.
pub(super) type Increments = SmallVec<[(usize, u64, i64, bool); 2]>;

impl Shared {
    /// Counts `units` Redis refused to add, and whether to warn of it now: the first time,
    /// then at most once a minute.
    pub(crate) fn refused_units(&self, units: u64) -> bool {
        self.units_refused.fetch_add(units, Ordering::Relaxed);
        (self.refused_warned).now(self.now_ns_mono())
    }

    /// Blocks the key of `entry` from `now_us` for the policy's block: here at once, in Redis
    /// with the next flush (where every instance that reads the key finds it), and announced,
    /// so that the others read it soon.
    pub(super) fn start_block(
        &self,
        policy: &Arc<PolicyShared>,
        entry: &Arc<Entry>,
        st: &mut EntryState,
        now_us: u64,
    ) {
        st.blocked_until_us = now_us.saturating_add(policy.block_us);
        st.block_owed = true;
        if self.mode.allowance > 0 {
            self.mark(policy, entry, st, now_us);
        }
        self.enqueue(policy, entry, st);
    }

    /// Decides from the counts held, counting the units when allowed and queueing them for
    /// the next flush. Returns the decision, and whether it waits for that flush (the
    /// synchronous variant's allowed requests, while Redis answers).
    pub(super) fn decide_here(
        &self,
        policy: &Arc<PolicyShared>,
        entry: &Arc<Entry>,
        cost: NonZeroU32,
        mode: Mode,
    ) -> (Decision, bool) {
        let now_us = self.now.us();
        let sync = self.mode.writes == Writes::Sync && !self.breaker_open();
        let mut st = entry.lock();
        if st.blocked_until_us > now_us {
            return (policy.blocked(st.blocked_until_us - now_us), false);
        }
        let mut codes: SmallVec<[Code; 2]> = SmallVec::new();
        for (spec, c) in policy.specs.iter().zip(st.quotas.iter_mut()) {
            c.advance(spec.slice_at(now_us));
            codes.push(c.code(spec, now_us, cost));
        }
        let allowed = codes.iter().all(|c| *c == Code::Allowed);
        if !allowed && mode != Mode::Peek && policy.blocks(&codes) {
            self.start_block(policy, entry, &mut st, now_us);
            return (policy.blocked(policy.block_us), false);
        }
        let take = mode != Mode::Peek && allowed;
        // A peek answers what the decision would: the state with the request counted.
        let extra = if mode == Mode::Peek && allowed {
            cost.get()
        } else {
            0
        };
        if take {
            for c in st.quotas.iter_mut() {
                c.admit(cost.get());
            }
        }
        let quiet = self.mode.allowance > 0 && self.quiet(policy, entry, &mut st, now_us);
        if take && !quiet {
            self.queue_units(cost);
        }
        let decision = Decision::new(
            policy
                .specs
                .iter()
                .zip(st.quotas.iter())
                .zip(&codes)
                .map(|((spec, c), code)| c.state(spec, *code, now_us, cost, extra)),
        )
        .never_fits_alone();
        if quiet {
            // Within its allowance: nothing to send or read.
            return (decision, false);
        }
        // Near the limit, the others' units matter most: an admission that leaves less than
        // half of a quota sends at once instead of waiting for the batch; and so does a key
        // this instance has not read yet, decided from its own counts until the read returns.
        let near_limit = || {
            decision
                .quotas()
                .iter()
                .any(|q| u64::from(q.remaining) * 2 < u64::from(q.limit))
        };
        let unread = || {
            !st.reading
                && policy
                    .specs
                    .iter()
                    .zip(st.quotas.iter())
                    .any(|(spec, c)| c.stale(spec, now_us))
        };
        let blocked = self.breaker_open();
        if !sync && !blocked && ((take && near_limit()) || unread()) {
            self.urgent.store(true, Ordering::Relaxed);
            self.wake.notify_one();
        }
        let read_due = !st.reading
            && policy
                .specs
                .iter()
                .zip(st.quotas.iter())
                .any(|(spec, c)| c.read_due(spec, now_us, self.settle_us(spec)));
        // Units held back while quiet go with the next flush, whatever this decision did.
        if read_due || take || st.quotas.iter().any(Counts::owes) {
            self.enqueue(policy, entry, &mut st);
        }
        (decision, take && sync)
    }

    /// Counts `units` queued for the next flush, and wakes the task when they reach
    /// [`flush_after`](Approximate::flush_after).
    fn queue_units(&self, units: NonZeroU32) {
        let units = units.get() as usize;
        let queued = self.queued_units.fetch_add(units, Ordering::Relaxed);
        if queued < self.mode.flush_after && queued + units >= self.mode.flush_after {
            self.wake.notify_one();
        }
    }

    /// A settlement ([`Mode::Refund`], [`Mode::Debit`]) of `units` on the key's counts, as
    /// every store makes it: a debit counts more units into the current sub-window, past the
    /// limit into debt; a refund gives back units this instance counted into the sub-window
    /// of their admission, if it is still in the window. Both go to Redis with the next flush
    /// (a key within its allowance keeps them here, as its admissions). Always allowed; the
    /// states are the quotas' after it.
    pub(super) fn settle_here(
        &self,
        policy: &Arc<PolicyShared>,
        entry: &Arc<Entry>,
        units: NonZeroU32,
        mode: Mode,
    ) -> Decision {
        let now_us = self.now.us();
        let mut st = entry.lock();
        for (spec, c) in policy.specs.iter().zip(st.quotas.iter_mut()) {
            c.advance(spec.slice_at(now_us));
            match mode {
                Mode::Debit => c.admit(units.get()),
                Mode::Refund { admitted_ago } => {
                    let ago = u64::try_from(admitted_ago.as_micros()).unwrap_or(u64::MAX);
                    c.refund(spec.slice_at(now_us.saturating_sub(ago)), units.get());
                }
                _ => {}
            }
        }
        let decision = Decision::new(
            (policy.specs.iter().zip(st.quotas.iter()))
                .map(|(spec, c)| c.state(spec, Code::Allowed, now_us, units, 0)),
        );
        if !st.quiet && st.quotas.iter().any(Counts::owes) {
            if mode == Mode::Debit {
                self.queue_units(units);
            }
            self.enqueue(policy, entry, &mut st);
        }
        decision
    }

    /// This instance's allowance of a quota per key: its part of its share of the limit, 0
    /// while the fleet has not been counted.
    pub(super) fn allowance(&self, spec: &Spec) -> u32 {
        let n = self.fleet_size.load(Ordering::Relaxed);
        if n == 0 || !self.stream_ok.load(Ordering::Relaxed) {
            return 0;
        }
        let part = u64::from(spec.params.burst.get()) * u64::from(self.mode.allowance) / 1000;
        u32::try_from(part / u64::from(n)).unwrap_or(u32::MAX)
    }

    /// Whether the key stays (or becomes) quiet after a decision at `now_us`: within its
    /// allowance on every quota, and not announced. A quiet key that goes past its allowance is
    /// announced (its units are then sent, and its counts read); one another instance announced
    /// is recalled. A key in step becomes quiet again once its announcement has run out (a
    /// window) and its units here are back within the allowance.
    pub(super) fn quiet(
        &self,
        policy: &PolicyShared,
        entry: &Entry,
        st: &mut EntryState,
        now_us: u64,
    ) -> bool {
        st.hot_until_us = self.announced_until(policy, entry, st, now_us);
        let allowances: SmallVec<[u32; 2]> = policy
            .specs
            .iter()
            .map(|spec| self.allowance(spec))
            .collect();
        if allowances.contains(&0) {
            // No allowance (the fleet not counted yet, or a limit smaller than the fleet): kept
            // in step, units held until now sent with the next flush.
            st.quiet = false;
            return false;
        }
        let hot = st.hot_until_us > now_us;
        let within = || {
            (policy.specs.iter().zip(st.quotas.iter()).zip(&allowances))
                .all(|((spec, c), &a)| c.own_estimate(spec, now_us) <= f64::from(a))
        };
        if st.quiet {
            if hot {
                st.quiet = false;
                self.recalled.fetch_add(1, Ordering::Relaxed);
                crate::metrics::approx_allowance("recalled");
            } else if within() {
                return true;
            } else {
                st.quiet = false;
                self.exhausted.fetch_add(1, Ordering::Relaxed);
                crate::metrics::approx_allowance("exhausted");
                self.mark(policy, entry, st, now_us);
            }
            return false;
        }
        if hot || st.queued || st.reading {
            return false;
        }
        if within() {
            st.quiet = true;
            self.granted.fetch_add(1, Ordering::Relaxed);
            crate::metrics::approx_allowance("granted");
            return true;
        }
        // Past its allowance: a key new here whose first request already is, or one still
        // past it a window after it was announced (announced again, so that instances new to
        // it since keep it in step too).
        self.mark(policy, entry, st, now_us);
        false
    }

    /// Whether a key not quiet may become so at this decision: allowances on for every quota,
    /// and the key not announced.
    pub(super) fn may_be_quiet(
        &self,
        policy: &PolicyShared,
        entry: &Entry,
        st: &EntryState,
        now_us: u64,
    ) -> bool {
        self.mode.allowance > 0
            && policy.specs.iter().all(|spec| self.allowance(spec) > 0)
            && self.announced_until(policy, entry, st, now_us) <= now_us
    }

    /// Until when (µs) the key is kept in step: as this instance last knew, or, once that has
    /// passed, as the announcements read since say.
    fn announced_until(
        &self,
        policy: &PolicyShared,
        entry: &Entry,
        st: &EntryState,
        now_us: u64,
    ) -> u64 {
        if st.hot_until_us > now_us || self.hot_keys.load(Ordering::Relaxed) == 0 {
            return st.hot_until_us;
        }
        self.hot
            .get(&entry.base(policy, self).1)
            .map_or(st.hot_until_us, |until| st.hot_until_us.max(*until))
    }

    /// Announces the key with the next flush, and keeps it in step for its policy's longest
    /// window.
    fn mark(&self, policy: &PolicyShared, entry: &Entry, st: &mut EntryState, now_us: u64) {
        st.hot_until_us = now_us.saturating_add(policy.window_us);
        let base = entry.base(policy, self).0.clone();
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded while Redis is away: a key left out is still kept in step here, and the
        // others hear of it when it is announced again (a window later).
        if marks.len() < announce::MAX_PENDING {
            marks.push((base, policy.window_us));
        }
        drop(marks);
        self.urgent.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// The counts of a new key for a request that found `max_keys` held, made for this request
    /// alone and not kept: the key is kept in step (never quiet: its units go to Redis with
    /// the next flush, whatever its allowance), read before the decision and, when allowed,
    /// its increment waited for, so that it is limited by Redis's count as the synchronous
    /// variant limits any key: a flood of new keys neither keeps new clients out nor lets them
    /// through unlimited, and costs a round trip per request past the cap. A sweep starts, to
    /// make room.
    #[cold]
    pub(super) fn overflow(&self, policy: &PolicyShared, key: &Key, now_us: u64) -> Arc<Entry> {
        self.overflowed.fetch_add(1, Ordering::Relaxed);
        if self.full_warned.now(self.now_ns_mono()) {
            tracing::warn!(
                max_keys = self.mode.max_keys,
                "approximate mode: key table full; requests on new keys are decided through \
                 Redis, a round trip each, until a sweep makes room (at most one warning a \
                 minute; raise `max_keys`)"
            );
        }
        if !self.sweep_now.swap(true, Ordering::Relaxed) {
            self.wake.notify_one();
        }
        let mut st = EntryState::new(policy);
        st.hot_until_us = now_us.saturating_add(policy.window_us);
        Arc::new(Entry {
            key: key.clone(),
            base: OnceLock::new(),
            state: Mutex::new(st),
        })
    }

    /// The answer to a request on a new key while `max_keys` are held and Redis cannot be
    /// asked (the circuit breaker open, or the read failed): denied for a second on every
    /// quota, and a sweep now.
    pub(super) fn refuse_full(&self, policy: &PolicyShared) -> Decision {
        if self
            .refused_full
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(100_000)
        {
            tracing::warn!(
                max_keys = self.mode.max_keys,
                "approximate mode: key table full, requests on new keys are denied"
            );
        }
        if !self.sweep_now.swap(true, Ordering::Relaxed) {
            self.wake.notify_one();
        }
        let second = std::time::Duration::from_secs(1);
        Decision::new(policy.specs.iter().map(|spec| crate::backend::QuotaState {
            index: spec.index,
            outcome: crate::backend::Outcome::Denied {
                retry_after: second,
            },
            limit: spec.params.burst.get(),
            remaining: 0,
            reset_after: second,
        }))
    }

    /// Waits (at most the timeout) until a flush that began after this call has been
    /// answered: the units just queued were sent with it, coalesced with those of every
    /// request queued meanwhile (one `INCRBY` per key and sub-window).
    pub(super) async fn flushed(&self) {
        let mut done = self.flushed.subscribe();
        // SeqCst, with the flush's increment: the units queued before this load are either
        // taken by a flush counted in `started`, or by a later one.
        let started = self.flushes_started.load(Ordering::SeqCst);
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(&self.waiters);
        self.wake.notify_one();
        let _ = tokio::time::timeout(self.opts.timeout, done.wait_for(|&d| d > started)).await;
    }
}
