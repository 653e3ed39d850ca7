//! The `Backend` implementation: a policy's windows decided here, its concurrent quotas at
//! the store.

use super::*;

impl ApproxBackend {
    /// The decision of `policy`'s window quotas (all of them but its concurrent ones).
    pub(super) fn windows(
        &self,
        policy: &ApproxPolicy,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> ApproxFuture {
        // No slots in this mode: a release gives back nothing.
        if matches!(mode, Mode::Release { .. }) {
            return ApproxFuture {
                inner: FutureInner::Ready(Some(Decision::new([]))),
            };
        }
        let shared = &self.shared;
        shared.start();
        let p = &policy.inner;
        let now_us = shared.now.us();
        // A decision that may take units keeps the key from the sweep until its windows
        // pass; a peek takes nothing, and leaves the hint as it was.
        let hold = |held: &Held| {
            if mode != Mode::Peek {
                (held.busy_until_us).store(p.idle_at(now_us), Ordering::Relaxed);
            }
            held.entry.clone()
        };
        // Past the cap, a new key is decided through Redis, not held (see `overflow`).
        let mut overflow = false;
        let entry = match p.entries.get(key) {
            Some(held) => hold(&held),
            None if p.held.load(Ordering::Relaxed) >= shared.mode.max_keys => {
                if shared.breaker_open() {
                    return ApproxFuture {
                        inner: FutureInner::Ready(Some(shared.refuse_full(p))),
                    };
                }
                overflow = true;
                shared.overflow(p, key, now_us)
            }
            None => {
                let held = p.entries.entry(key.clone()).or_insert_with(|| {
                    p.held.fetch_add(1, Ordering::Relaxed);
                    crate::metrics::approx_keys(1.0);
                    Held {
                        entry: Arc::new(Entry {
                            key: key.clone(),
                            base: OnceLock::new(),
                            state: Mutex::new(EntryState::new(p)),
                        }),
                        busy_until_us: AtomicU64::new(0),
                    }
                });
                hold(&held)
            }
        };
        if mode.is_settlement() {
            let settled = shared.settle_here(p, &entry, cost, mode);
            return ApproxFuture {
                inner: FutureInner::Ready(Some(settled)),
            };
        }
        let sync = shared.mode.writes == Writes::Sync && !shared.breaker_open();
        // A key that is or may become quiet (within its allowance) decides at once; every
        // other key reads before deciding, as without allowances.
        let stale = || {
            let st = entry.lock();
            !st.quiet
                && !shared.may_be_quiet(p, &entry, &st, now_us)
                && p.specs
                    .iter()
                    .zip(st.quotas.iter())
                    .any(|(spec, c)| c.stale(spec, now_us))
        };
        if ((sync && mode != Mode::Peek) || overflow) && stale() {
            // A key this instance has not read yet, or not since before the last sub-window:
            // its decisions wait for the fleet's counts (each request reads, so that none
            // decides from stale counts while another's read is on its way). A key past the
            // cap also waits for its increment: its next request reads it back.
            let (shared, policy) = (shared.clone(), p.clone());
            return ApproxFuture {
                inner: FutureInner::Waiting(Box::pin(async move {
                    flush::read_now(&shared, &policy, &entry).await;
                    let now_us = shared.now.us();
                    let unread = || {
                        let st = entry.lock();
                        (policy.specs.iter().zip(st.quotas.iter()))
                            .any(|(spec, c)| c.stale(spec, now_us))
                    };
                    if overflow && unread() {
                        // Past the cap, nothing to decide from but Redis's count.
                        return shared.refuse_full(&policy);
                    }
                    let (decision, wait) = shared.decide_here(&policy, &entry, cost, mode);
                    if wait || (overflow && decision.is_allowed()) {
                        shared.flushed().await;
                    }
                    decision
                })),
            };
        }
        let (decision, wait) = shared.decide_here(p, &entry, cost, mode);
        if !wait {
            return ApproxFuture {
                inner: FutureInner::Ready(Some(decision)),
            };
        }
        let shared = shared.clone();
        ApproxFuture {
            inner: FutureInner::Waiting(Box::pin(async move {
                shared.flushed().await;
                decision
            })),
        }
    }
}

impl Backend for ApproxBackend {
    type Policy = ApproxPolicy;
    type Future = ApproxFuture;

    fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<ApproxPolicy, ConfigError> {
        if params.is_empty() {
            return Err(ConfigError::QuotaCount {
                policy: policy.name().to_owned(),
                count: 0,
            });
        }
        if policy.change_strategy() != crate::quota::OnChange::Keep {
            return Err(ConfigError::Invalid {
                option: "Policy::on_change",
                reason: format!(
                    "policy `{}`: the approximate Redis mode keeps the counts the fleet shares \
                     when a limit changes (`on_change = \"keep\"`); `{}` would have every \
                     instance rewrite them",
                    policy.name(),
                    policy.change_strategy()
                ),
            });
        }
        #[cfg(feature = "calendar")]
        if let Some(e) = crate::backend::calendar_unsupported(
            policy,
            params,
            "the approximate Redis mode",
            "it shares a window's counts by its index from the epoch, which a calendar's \
             windows do not have; use Redis in its exact mode, the default",
        ) {
            return Err(e);
        }
        let mut specs = Vec::with_capacity(params.len());
        let mut slots = Vec::new();
        for (i, p) in params.iter().enumerate() {
            if p.is_concurrent() {
                slots.push(i);
                continue;
            }
            let Some(spec) = Spec::new(i, &policy.quota_id(i), *p) else {
                return Err(ConfigError::InvalidQuota {
                    policy: policy.name().to_owned(),
                    quota: Box::new(policy.quotas()[i]),
                    reason: "the approximate Redis mode counts windows: use a fixed or sliding \
                             window (e.g. \"20/2s sliding 100ms\" for \"10/s burst 20\")",
                });
            };
            specs.push(spec);
        }
        let window_us = specs
            .iter()
            .map(|s| {
                s.slice_us
                    .saturating_mul(s.kept.saturating_sub(1).max(1) as u64)
            })
            .max()
            .unwrap_or(0);
        self.shared
            .longest_window_us
            .fetch_max(window_us, Ordering::Relaxed);
        // Another version of this policy whose quotas count in the same counters (the same
        // quotas, window shapes and block, another limit): its keys' counts are this one's.
        let same_counters = |other: &PolicyShared| {
            other.name == policy.name()
                && (other.block_us > 0) == policy.block().is_some()
                && other.specs.len() == specs.len()
                && (other.specs.iter().zip(&specs)).all(|(a, b)| a.suffix == b.suffix)
        };
        let shared_entries = (self
            .shared
            .policies
            .lock()
            .unwrap_or_else(|e| e.into_inner()))
        .iter()
        .filter_map(Weak::upgrade)
        .find(|other| same_counters(other))
        .map(|other| other.entries.clone());
        let inner = Arc::new(PolicyShared {
            name: policy.name().to_owned(),
            specs: specs.into_boxed_slice(),
            window_us,
            key_prefix: keys::policy_prefix(&self.shared.prefix, policy.name()),
            // Many small shards: the sweep holds each shard's lock while it walks it, and
            // requests on that shard wait (8 shards of a million keys held them for tens of
            // milliseconds each).
            entries: shared_entries.unwrap_or_else(|| {
                Arc::new(DashMap::with_hasher_and_shard_amount(
                    RandomState::default(),
                    ENTRY_SHARDS,
                ))
            }),
            held: self.shared.keys.clone(),
            block_us: (policy.block()).map_or(0, |b| {
                u64::try_from(b.as_micros()).unwrap_or(u64::MAX).max(1)
            }),
            block_mask: policy.block_mask(),
            all_params: params.into(),
        });
        let mut policies = self
            .shared
            .policies
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        policies.retain(|p| p.strong_count() > 0);
        policies.push(Arc::downgrade(&inner));
        let slots = if slots.is_empty() {
            None
        } else {
            Some(Arc::new(self.slots(policy, &slots)?))
        };
        Ok(ApproxPolicy { inner, slots })
    }

    fn decide(&self, policy: &ApproxPolicy, key: &Key, cost: NonZeroU32) -> ApproxFuture {
        self.decide_with(policy, key, cost, Mode::Decide)
    }

    /// Window quotas reserve nothing ahead: [`Mode::Reserve`] is answered as
    /// [`Mode::Decide`] (a denial's `retry_after` tells when to ask again). A policy's
    /// concurrent quotas are decided by the exact backend once its windows allow the request
    /// (see the [module docs](super#concurrent-quotas)).
    fn decide_with(
        &self,
        policy: &ApproxPolicy,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> ApproxFuture {
        match (&policy.slots, mode) {
            (None, _) | (Some(_), Mode::Refund { .. } | Mode::Debit) => {
                self.windows(policy, key, cost, mode)
            }
            (Some(slots), Mode::Release { .. }) => {
                let (slots, key) = (slots.clone(), key.clone());
                ApproxFuture::slots(async move {
                    let d = slots.backend.decide_with(&slots.policy, &key, cost, mode);
                    Ok(Decision::new(slots.renumber(d.await?)))
                })
            }
            (Some(slots), _) => {
                let windows = self.windows(policy, key, cost, mode);
                let (this, policy, slots, key) =
                    (self.clone(), policy.clone(), slots.clone(), key.clone());
                ApproxFuture::slots(async move {
                    this.with_slots(windows, &policy, &slots, &key, cost, mode)
                        .await
                })
            }
        }
    }

    /// Clears the key's counters in Redis and forgets its local counts, including units not
    /// sent yet. Other instances learn of it at their next read of the key (their own
    /// confirmed units stay counted).
    fn reset(&self, policy: &ApproxPolicy, key: &Key) -> ResetFuture {
        let shared = self.shared.clone();
        let p = policy.inner.clone();
        let key = key.clone();
        Box::pin(async move {
            // Forgotten here first, with the units it had not sent (a flush already under way
            // may still land its own after the reset).
            if let Some((_, old)) = p.entries.remove(&key) {
                p.held.fetch_sub(1, Ordering::Relaxed);
                crate::metrics::approx_keys(-1.0);
                let mut st = old.entry.lock();
                st.quotas = p.specs.iter().map(Counts::new).collect();
            }
            let mut base = Vec::new();
            keys::key_base(&p.key_prefix, &key, &mut base);
            // The current sub-window's counter is set to zero rather than deleted, so that it
            // keeps an expiry (instances set one with their first increment in a sub-window).
            let now_us = shared.now.us();
            let mut pipe = redis::pipe();
            for spec in p.specs.iter() {
                let newest = spec.slice_at(now_us);
                let older = newest.saturating_sub(spec.kept as u64)..newest;
                if !older.is_empty() {
                    let del = pipe.cmd("DEL").ignore();
                    for slice in older {
                        del.arg(counter_key(&base, spec, slice));
                    }
                }
                pipe.cmd("SET")
                    .arg(counter_key(&base, spec, newest))
                    .arg(0)
                    .arg("PX")
                    .arg(spec.ttl_ms())
                    .ignore();
            }
            if p.block_us > 0 {
                // The key's block goes too, as on every store.
                let mut blk = base.clone();
                blk.extend_from_slice(b"blk");
                pipe.cmd("DEL").arg(blk).ignore();
            }
            match tokio::time::timeout(shared.opts.timeout, shared.conn.pipeline(&pipe)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(BackendError::new(BackendErrorKind::Unavailable, e)),
                Err(_) => Err(BackendError::from_kind(BackendErrorKind::Timeout)),
            }
        })
    }

    fn store_id(&self) -> Option<String> {
        Some(format!(
            "{} prefix {:?} (approximate)",
            self.shared.endpoint, self.shared.prefix
        ))
    }
}
