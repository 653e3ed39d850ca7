//! What an approximate backend's clones share: the connection, the policies' tables, the
//! breaker, the counters, and the background tasks (flush, announcements, memory watch).

use super::*;

pub(crate) struct Shared {
    pub(super) conn: Conn,
    pub(super) endpoint: String,
    pub(super) prefix: String,
    pub(super) opts: Options,
    pub(super) mode: Approximate,
    pub(super) now: Now,
    /// Entries with something to send or read, for the next flush.
    pub(super) dirty: Mutex<Vec<(Arc<PolicyShared>, Arc<Entry>)>>,
    /// Units queued since the last flush.
    pub(super) queued_units: AtomicUsize,
    pub(super) wake: Arc<tokio::sync::Notify>,
    pub(super) policies: Mutex<Vec<Weak<PolicyShared>>>,
    pub(super) started: AtomicBool,
    /// Flushes begun, and (watched by waiting requests) the newest one answered.
    pub(super) flushes_started: AtomicU64,
    pub(super) flushed: tokio::sync::watch::Sender<u64>,
    /// Synchronous requests waiting for a flush: the task then sends at once.
    pub(super) waiters: AtomicUsize,
    /// One flush at a time (the task's, or [`ApproxBackend::flush`]): flushes are answered in
    /// the order they began, which waiting requests rely on.
    pub(super) flushing: tokio::sync::Mutex<()>,
    /// An admission left a quota near its limit: the task sends at once.
    pub(super) urgent: AtomicBool,
    /// Keys held (all policies), requests refused because there were `max_keys`, and whether
    /// the task should sweep at once.
    pub(super) keys: Arc<AtomicUsize>,
    /// Redis's memory as the watch last read it (see `RedisBackendBuilder::watch_memory`).
    pub(super) memory: MemoryState,
    /// The exact backend that decides concurrent quotas (its connection made when a policy
    /// first uses it).
    pub(super) exact: super::super::RedisBackend,
    pub(super) refused_full: AtomicU64,
    /// Requests on new keys decided through Redis because `max_keys` were held, and the
    /// warning of it.
    pub(super) overflowed: AtomicU64,
    pub(super) full_warned: OnceAMinute,
    pub(super) sweep_now: AtomicBool,
    /// A sweep runs (on a blocking thread).
    pub(super) sweeping: AtomicBool,
    /// The memory watch has been started (once: it outlives a restarted flush task).
    pub(super) memory_watched: AtomicBool,
    // The circuit breaker, on the monotonic clock.
    pub(super) origin: Instant,
    pub(super) failures: AtomicU32,
    pub(super) open_until_ns: AtomicU64,
    pub(super) trips: AtomicU64,
    // Counters.
    pub(super) calls: AtomicU64,
    pub(super) failed_calls: AtomicU64,
    pub(super) units_sent: AtomicU64,
    pub(super) units_refused: AtomicU64,
    /// The warning of refused units, at most once a minute.
    pub(super) refused_warned: OnceAMinute,
    pub(super) reads: AtomicU64,
    // Allowances.
    /// The fleet's size as counted (0: not yet), and this instance's id in the count.
    pub(super) fleet_size: AtomicU32,
    pub(super) fleet_id: u64,
    /// When the next announcement of this instance and poll of the announced keys are due
    /// (monotonic ns).
    pub(super) next_count_ns: AtomicU64,
    pub(super) next_poll_ns: AtomicU64,
    /// Keys announced by any instance (`base` hashed), until when they stay in step (µs).
    pub(super) hot: DashMap<u64, u64, RandomState>,
    pub(super) hot_keys: AtomicUsize,
    pub(super) hasher: RandomState,
    /// Keys this instance announces with the next flush: `base`, window (µs).
    pub(super) marks: Mutex<Vec<(Box<[u8]>, u64)>>,
    /// The last announcement read (a stream id), empty before the first poll.
    pub(super) cursor: Mutex<String>,
    /// Whether announcements work: the last read of the stream succeeded and the last
    /// announcement sent did not fail. Without them no key is quiet (an instance could not
    /// tell the others to send theirs).
    pub(super) stream_ok: AtomicBool,
    /// Announcements failed in a row, and when they may be sent again (monotonic ns).
    pub(super) mark_failures: AtomicU32,
    /// Reads of the announcements failed in a row.
    pub(super) poll_failures: AtomicU32,
    pub(super) next_marks_ns: AtomicU64,
    /// The longest window of the policies prepared, in µs.
    pub(super) longest_window_us: AtomicU64,
    pub(super) granted: AtomicU64,
    pub(super) exhausted: AtomicU64,
    pub(super) recalled: AtomicU64,
    pub(super) announced: AtomicU64,
    pub(super) announcements_read: AtomicU64,
    /// Whether Redis refused `TIME` (in the fleet's announcement script, or as a command): the
    /// announcements and the first read of the stream then use this instance's clock.
    pub(super) no_time: std::sync::atomic::AtomicBool,
}

impl Shared {
    pub(super) fn now_ns_mono(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The time a key's counts must be into a sub-window before they are read again.
    pub(super) fn settle_us(&self, spec: &Spec) -> u64 {
        let mut settle = self.opts.timeout;
        if self.mode.writes == Writes::Async {
            settle += self.mode.flush_every;
        }
        u64::try_from(settle.as_micros())
            .unwrap_or(u64::MAX)
            .min(spec.slice_us / 2)
    }

    pub(super) fn breaker_open(&self) -> bool {
        self.failures.load(Ordering::Relaxed) >= self.opts.breaker_threshold
    }

    /// Whether the background task may call Redis now: the breaker is closed, or its probe is
    /// due.
    pub(super) fn may_call(&self) -> bool {
        !self.breaker_open() || self.now_ns_mono() >= self.open_until_ns.load(Ordering::Relaxed)
    }

    /// How long until the breaker's probe is due (zero if it is, or the breaker is closed).
    pub(super) fn until_probe(&self) -> Duration {
        let at = self.open_until_ns.load(Ordering::Relaxed);
        Duration::from_nanos(at.saturating_sub(self.now_ns_mono()))
    }

    pub(super) fn call_ok(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        crate::metrics::approx_call(true);
        if self.failures.swap(0, Ordering::Relaxed) >= self.opts.breaker_threshold {
            tracing::info!(endpoint = %self.endpoint, "Redis answers again: approximate counts resume syncing");
        }
    }

    pub(super) fn call_failed(&self, err: &dyn fmt::Display) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.failed_calls.fetch_add(1, Ordering::Relaxed);
        crate::metrics::approx_call(false);
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= self.opts.breaker_threshold {
            let probe = u64::try_from(self.opts.probe_interval.as_nanos()).unwrap_or(u64::MAX);
            self.open_until_ns
                .store(self.now_ns_mono().saturating_add(probe), Ordering::Relaxed);
            // A connection that stopped answering may never recover by itself.
            self.conn.reconnect();
            if failures == self.opts.breaker_threshold {
                self.trips.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(endpoint = %self.endpoint, error = %err,
                    "Redis failing: approximate mode decides from local counts until it answers");
            }
        }
    }

    /// Queues `entry` for the next flush, unless it is already queued.
    pub(super) fn enqueue(
        &self,
        policy: &Arc<PolicyShared>,
        entry: &Arc<Entry>,
        st: &mut EntryState,
    ) {
        if st.queued {
            return;
        }
        st.queued = true;
        let first = {
            let mut dirty = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
            dirty.push((policy.clone(), entry.clone()));
            dirty.len() == 1
        };
        if first {
            self.wake.notify_one();
        }
    }

    pub(super) fn start(self: &Arc<Self>) {
        if self.started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self
            .started
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // If the task ends (its runtime shut down), the next decision starts another.
            let restart = Restart(Arc::downgrade(self));
            let wake = self.wake.clone();
            handle.spawn(async move {
                let restart = restart;
                flush::run(restart.0.clone(), wake).await;
            });
            if let Some(every) = self.opts.memory_watch
                && !self.memory_watched.swap(true, Ordering::Relaxed)
            {
                handle.spawn(watch_memory(Arc::downgrade(self), every));
            }
        }
    }
}

/// Reads Redis's memory every `every` until the backend is dropped, as the exact backend does
/// (see `RedisBackendBuilder::watch_memory`).
pub(super) async fn watch_memory(shared: Weak<Shared>, every: Duration) {
    // If the task ends (its runtime shut down), the next decision starts another.
    struct Unwatched(pub(super) Weak<Shared>);
    impl Drop for Unwatched {
        fn drop(&mut self) {
            if let Some(s) = self.0.upgrade() {
                s.memory_watched.store(false, Ordering::Relaxed);
            }
        }
    }
    let _unwatched = Unwatched(shared.clone());
    let mut watch = MemoryWatch::default();
    loop {
        tokio::time::sleep(every).await;
        let Some(s) = shared.upgrade() else { return };
        let wait = s.opts.timeout.max(Duration::from_secs(1));
        match tokio::time::timeout(wait, super::super::backend::read_memory(&s.conn)).await {
            Ok(Ok(memory)) => watch.seen(&memory, &s.memory, "redis", "Redis (approximate mode)"),
            Ok(Err(err)) => watch.unreadable(&err.text, "Redis (approximate mode)"),
            Err(_elapsed) => {}
        }
    }
}

/// Marks the background task as gone when it ends, however it ends.
struct Restart(pub(super) Weak<Shared>);

impl Drop for Restart {
    fn drop(&mut self) {
        if let Some(s) = self.0.upgrade() {
            s.started.store(false, Ordering::Release);
        }
    }
}

/// Counts a synchronous request waiting for a flush, until it is done or dropped.
pub(super) struct Waiting<'a>(pub(super) &'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
