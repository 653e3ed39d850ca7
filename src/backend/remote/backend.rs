//! The engine of every remote backend: prepare policies, decide, and degrade as configured when
//! the store fails. A backend is this engine around its [`Store`].

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use super::batch::Batcher;
use super::breaker::Breaker;
use super::clock::Clock;
use super::deny_cache::{Budget, DenyCache};
use super::future::RemoteFuture;
use super::health::Health;
use super::inner::{Counters, FleetSize, Inner, bump};
use super::options::{FailurePolicy, Fleet, Options, RemoteStats};
use super::redact::Secrets;
use super::store::{CallError, Job, PolicyInner, Store, Twin};
use crate::backend::{LocalBackend, Mode};
use crate::quota::{QuotaKind, QuotaParams};
use crate::{BackendError, BackendErrorKind, ConfigError, Key, Policy};

/// The engine around a store. Cheap to clone: clones share the store, breaker and counters.
pub(crate) struct Remote<S: Store> {
    pub(crate) inner: Arc<Inner<S>>,
    /// The queue to the batching task.
    batcher: Arc<Batcher<S>>,
}

impl<S: Store> Clone for Remote<S> {
    fn clone(&self) -> Self {
        Remote {
            inner: self.inner.clone(),
            batcher: self.batcher.clone(),
        }
    }
}

/// A policy prepared for a remote backend: its quotas, the store's part, its own deny cache
/// and, with [`FailurePolicy::FallbackLocal`], its local twin.
pub(crate) struct RemotePolicy<S: Store> {
    pub(crate) inner: Arc<PolicyInner<S>>,
}

impl<S: Store> RemotePolicy<S> {
    /// The policy's quotas.
    pub(crate) fn params(&self) -> &[QuotaParams] {
        &self.inner.params
    }

    /// The store's part.
    pub(crate) fn store(&self) -> &S::Prepared {
        &self.inner.store
    }

    /// Forgets the cached denial of `key` (its buckets were reset).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn forget(&self, key: &Key) {
        self.inner.deny.forget(key);
    }

    /// Denials cached for this policy now.
    pub(crate) fn deny_cache_len(&self) -> usize {
        self.inner.deny.len()
    }
}

impl<S: Store> Remote<S> {
    /// An engine around `store`; `who` names it in logs (passwords masked), `secrets` are
    /// removed from every error text shown.
    pub(crate) fn new(store: S, who: String, secrets: Secrets, opts: Options) -> Self {
        let local = (opts.on_failure == FailurePolicy::FallbackLocal).then(LocalBackend::new);
        if let Fleet::Size(n) = opts.fleet {
            crate::metrics::fleet_size(S::KIND, n.get());
        }
        Remote {
            inner: Arc::new(Inner {
                store,
                who,
                secrets,
                health: Health::default(),
                timeout: opts.timeout,
                on_failure: opts.on_failure,
                breaker: Breaker::new(S::KIND, opts.breaker_threshold, opts.probe_interval),
                budget: Arc::new(Budget {
                    capacity: opts.deny_cache_capacity,
                    used: AtomicUsize::new(0),
                }),
                clock: match opts.test_clock {
                    Some(c) => Clock::Test(c),
                    None => Clock::Real(std::time::Instant::now()),
                },
                local,
                warmed: AtomicBool::new(false),
                refusal_warned: Default::default(),
                memory: Default::default(),
                counters: Counters::default(),
                batching: opts.batching,
                memory_watch: opts.memory_watch,
                fleet: FleetSize::new(opts.fleet, opts.fleet_id),
            }),
            batcher: Arc::default(),
        }
    }

    /// The store.
    pub(crate) fn store(&self) -> &S {
        &self.inner.store
    }

    /// This backend's clock (a test clock when one is set), for [`Backend::now_ns`].
    ///
    /// [`Backend::now_ns`]: crate::backend::Backend::now_ns
    pub(crate) fn now_ns(&self) -> u64 {
        self.inner.clock.now_ns()
    }

    /// The test clock's time, when one is set (Unix nanoseconds, as the store is given it).
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn test_time(&self) -> Option<u64> {
        self.inner.clock.script_time()
    }

    /// The timeout of a decision.
    pub(crate) fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// A `BackendError` for a failed call, passwords removed.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn backend_error(&self, err: &CallError) -> BackendError {
        self.inner.backend_error(err)
    }

    /// The failure policy.
    pub(crate) fn on_failure(&self) -> FailurePolicy {
        self.inner.on_failure
    }

    /// The counters now.
    pub(crate) fn stats(&self) -> RemoteStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteStats {
            decisions: get(&c.decisions),
            calls: get(&c.calls),
            errors: get(&c.errors),
            timeouts: get(&c.timeouts),
            fail_open: get(&c.fail_open),
            fail_closed: get(&c.fail_closed),
            fallback_local: get(&c.fallback_local),
            deny_cache_hits: get(&c.deny_cache_hits),
            deny_cache_entries: self.inner.budget.used.load(Ordering::Relaxed),
            fleet_size: self.inner.fleet.get(),
            breaker_open: self.inner.breaker.is_open(),
            breaker_trips: self.inner.breaker.trips(),
            failing: self.inner.health.failing(),
            time_source: self.store().time_source(),
            memory_used: get(&self.inner.memory.used),
            memory_max: get(&self.inner.memory.max),
            evicted_keys: get(&self.inner.memory.evicted),
        }
    }

    /// Prepares `policy`: the store's part, a deny cache, and the local twin for the fallback.
    /// Starts connecting in the background (once) so that the first request does not pay for
    /// the connection.
    pub(crate) fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<RemotePolicy<S>, ConfigError> {
        if (policy.settles() || policy.holds_slots() || policy.block().is_some()) && !S::SETTLES {
            return Err(crate::backend::unsupported(
                policy,
                &format!("the {} backend", S::KIND),
            ));
        }
        if params.is_empty() {
            return Err(ConfigError::QuotaCount {
                policy: policy.name().to_owned(),
                count: 0,
            });
        }
        let local = match &self.inner.local {
            Some(local) => Some(Twin::new(local, policy, self.inner.fleet.get())?),
            None => None,
        };
        let store = self.inner.store.prepare(policy, params)?;
        self.warm_up();
        Ok(RemotePolicy {
            inner: Arc::new(PolicyInner {
                params: params.iter().copied().collect(),
                store,
                deny: DenyCache::new(self.inner.budget.clone(), policy.gives_back()),
                deny_hits: crate::metrics::DenyCacheHits::new(policy.name()),
                local,
            }),
        })
    }

    /// Decides a request: from the deny cache, by the failure policy while the breaker is
    /// open, or by the store (batched when it can be).
    pub(crate) fn decide(
        &self,
        policy: &RemotePolicy<S>,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> RemoteFuture {
        if mode.is_settlement() && !S::SETTLES {
            return RemoteFuture::ready(Err(BackendError::new(
                BackendErrorKind::Protocol,
                format!(
                    "the {} backend does not settle requests after their response yet",
                    S::KIND
                ),
            )));
        }
        let p = &policy.inner;
        let inner = &self.inner;
        let now_ns = inner.clock.now_ns();
        // A window quota cannot count a request into a window that has not begun: a policy
        // with one reserves only what every quota has now.
        let mode = match mode {
            Mode::Reserve { .. } if p.params.iter().any(|q| q.kind != QuotaKind::Gcra) => {
                Mode::Reserve {
                    max_wait: std::time::Duration::ZERO,
                }
            }
            mode => mode,
        };
        // A settlement is made whatever a cached denial says; one that gives units or a slot
        // back makes the denial stale at once.
        if mode.is_settlement() {
            if mode != Mode::Debit {
                p.deny.forget(key);
            }
            // A slot the local fallback gave while the store was failing is given back there
            // (a release on a key the fallback holds no slot of gives back nothing; one that
            // does gives one back, which may be another request's over a failover).
            if let (Mode::Release { .. }, Some(local), Some(twin)) =
                (mode, &self.inner.local, &p.local)
            {
                // In memory: made at once.
                let twin = twin.current();
                let released =
                    crate::backend::Backend::decide_with(local, &twin.local, key, cost, mode);
                drop(released.into_inner());
            }
        // A cached denial answers a reservation too when its wait is longer than the caller
        // accepts: the store's own wait is at least as long (see the deny cache).
        } else if let Some(decision) = p.deny.get(key, cost, now_ns, &p.params)
            && decision.retry_after().is_none_or(|wait| {
                u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX) > mode.max_wait_ns()
            })
        {
            bump(&inner.counters.deny_cache_hits);
            p.deny_hits.hit();
            return RemoteFuture::ready(Ok(decision));
        }
        if inner.breaker.blocks(now_ns) {
            let err = match inner.health.failing() {
                Some(cause) => BackendError::new(
                    BackendErrorKind::Unavailable,
                    format!("circuit breaker open; {} failing: {cause}", S::KIND),
                ),
                None => BackendError::new(BackendErrorKind::Unavailable, "circuit breaker open"),
            };
            return RemoteFuture::ready(inner.degrade(p, key, cost, mode, err));
        }
        bump(&inner.counters.decisions);
        let now = tokio::time::Instant::now();
        let job = Job {
            policy: p.clone(),
            key: key.clone(),
            cost,
            mode,
            sent_ns: now_ns,
            // The builders cap the timeout at an hour, so this cannot overflow; were it to,
            // an immediate timeout is better than a panic.
            deadline: now.checked_add(inner.timeout).unwrap_or(now),
        };
        // Batched: the decision joins the batching task's queue now, and the future only waits
        // for its answer: nothing boxed.
        let job = if inner.batching && inner.store.can_batch() {
            match self.batcher.submit(inner, job) {
                Ok(answer) => return RemoteFuture::batched(answer),
                Err(job) => job,
            }
        } else {
            job
        };
        let inner = inner.clone();
        RemoteFuture::call(Box::pin(async move {
            let jobs = [job];
            let outcome = inner.call_alone(&jobs).await;
            inner.finish(&jobs[0], outcome)
        }))
    }

    /// Starts connecting in the background, once, when called inside a Tokio runtime.
    fn warm_up(&self) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.inner.warmed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let (Fleet::Announced { every }, Some(_)) = (self.inner.fleet.fleet, &self.inner.local) {
            handle.spawn(announce(Arc::downgrade(&self.inner), every));
        }
        if let Some(every) = self.inner.memory_watch {
            handle.spawn(super::inner::watch_memory(
                Arc::downgrade(&self.inner),
                every,
            ));
        }
        let weak = Arc::downgrade(&self.inner);
        handle.spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            // Long enough for the driver to report why it could not connect (refused, a wrong
            // password), rather than this timeout hiding the cause.
            let limit = inner.store.warm_up_timeout(inner.timeout);
            let result = tokio::time::timeout(limit, inner.store.ping()).await;
            match result.unwrap_or_else(|_elapsed| Err(CallError::timed_out())) {
                Ok(()) => inner.answered(),
                Err(err) => inner.failed(&err),
            }
        });
    }
}

/// Announces this instance every `every` and keeps the count ([`Fleet::Announced`]), until the
/// backend is dropped. A failed announcement keeps the last count.
async fn announce<S: Store>(inner: std::sync::Weak<Inner<S>>, every: Duration) {
    let ttl = every.saturating_mul(3);
    // Failures in a row: the third is logged as a warning (once, until one succeeds), since
    // the fleet's size then stays what it was (1 before any count) and the fallback's share
    // with it: a store that refuses the announcement (a user without the commands or rights)
    // must not go unnoticed.
    let mut failures = 0u32;
    loop {
        let Some(this) = inner.upgrade() else { return };
        let limit = this.store.warm_up_timeout(this.timeout);
        let fleet = &this.fleet;
        match tokio::time::timeout(limit, this.store.announce(fleet.id, ttl)).await {
            Ok(Ok(n)) => {
                if failures >= 3 {
                    tracing::info!("tollgate: {} counts this instance's fleet again", this.who);
                }
                failures = 0;
                let before = fleet.size.swap(n.max(1), Ordering::Relaxed);
                crate::metrics::fleet_size(S::KIND, n.max(1));
                if before != n.max(1) {
                    tracing::debug!(
                        "tollgate: {} instances share {} (were {before})",
                        n.max(1),
                        this.who
                    );
                }
            }
            outcome => {
                failures = failures.saturating_add(1);
                let err = match outcome {
                    Ok(Err(err)) => this.secrets.scrub(&err.text).into_owned(),
                    _ => "the call timed out".to_owned(),
                };
                if failures == 3 {
                    tracing::warn!(
                        error = %err,
                        "tollgate: {} cannot count this instance's fleet (the local fallback \
                         keeps a share of {} instance(s) until it can)",
                        this.who,
                        fleet.get()
                    );
                } else {
                    tracing::trace!(error = %err, "tollgate: announcing this instance failed");
                }
            }
        }
        drop(this);
        tokio::time::sleep(every).await;
    }
}

impl<S: Store> fmt::Debug for Remote<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remote")
            .field("store", &self.inner.who)
            .field("timeout", &self.inner.timeout)
            .field("on_failure", &self.inner.on_failure)
            .field("stats", &self.stats())
            .finish()
    }
}
