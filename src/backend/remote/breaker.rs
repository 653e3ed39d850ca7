//! The circuit breaker: stop calling a store that keeps failing, probe it in the background.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Counts consecutive failed calls (a batched call counts once, however many requests it
/// carried); after `threshold` of them the breaker opens and requests no longer call the store
/// (they get the failure policy at once, without paying the timeout). The backend then probes
/// the store every `probe_interval` and closes the breaker on the first answer.
///
/// In case the probe task is gone (its runtime shut down), one request every four probe
/// intervals is also let through as a trial; its success closes the breaker too.
#[derive(Debug)]
pub(crate) struct Breaker {
    /// The store's kind, for metrics.
    kind: &'static str,
    pub(crate) threshold: u32,
    pub(crate) probe_interval: Duration,
    failures: AtomicU32,
    open: AtomicBool,
    trips: AtomicU64,
    /// Clock ns after which one request may try the store while the breaker is open.
    next_trial_ns: AtomicU64,
}

impl Breaker {
    pub(crate) fn new(kind: &'static str, threshold: u32, probe_interval: Duration) -> Self {
        Breaker {
            kind,
            threshold: threshold.max(1),
            probe_interval,
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            trips: AtomicU64::new(0),
            next_trial_ns: AtomicU64::new(0),
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    pub(crate) fn trips(&self) -> u64 {
        self.trips.load(Ordering::Relaxed)
    }

    /// Whether a request should skip the store now: the breaker is open and this is not the
    /// moment for a trial call.
    pub(crate) fn blocks(&self, now_ns: u64) -> bool {
        if !self.is_open() {
            return false;
        }
        let next = self.next_trial_ns.load(Ordering::Relaxed);
        let trial = now_ns >= next
            && self
                .next_trial_ns
                .compare_exchange(
                    next,
                    now_ns.saturating_add(self.trial_gap()),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok();
        !trial
    }

    fn trial_gap(&self) -> u64 {
        // Saturating: the interval is a user setting, and no setting may panic a request.
        u64::try_from(self.probe_interval.saturating_mul(4).as_nanos()).unwrap_or(u64::MAX)
    }

    /// A call succeeded: a trial call closes an open breaker.
    pub(crate) fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 || self.is_open() {
            self.close();
        }
    }

    /// A call failed at `now_ns`. Returns `true` when this failure opened the breaker: the
    /// caller then starts the probe (exactly one caller sees `true` per opening).
    pub(crate) fn failure(&self, now_ns: u64) -> bool {
        let n = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if n >= self.threshold && !self.open.swap(true, Ordering::AcqRel) {
            self.next_trial_ns
                .store(now_ns.saturating_add(self.trial_gap()), Ordering::Relaxed);
            self.trips.fetch_add(1, Ordering::Relaxed);
            crate::metrics::breaker(self.kind, true);
            return true;
        }
        false
    }

    /// The probe got an answer: calls resume.
    pub(crate) fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open.swap(false, Ordering::AcqRel) {
            crate::metrics::breaker(self.kind, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_closes() {
        let b = Breaker::new("redis", 3, Duration::from_millis(500));
        assert!(!b.failure(0));
        b.success();
        assert!(!b.failure(0));
        assert!(!b.failure(0));
        assert!(!b.blocks(0));
        assert!(b.failure(0), "third consecutive failure opens");
        assert!(b.is_open());
        assert!(b.blocks(1));
        assert!(!b.failure(1), "only one caller starts the probe");
        b.close();
        assert!(!b.is_open());
        assert_eq!(b.trips(), 1);
    }

    #[test]
    fn lets_one_trial_through_every_four_probe_intervals() {
        let b = Breaker::new("redis", 1, Duration::from_millis(100));
        assert!(b.failure(0));
        assert!(b.blocks(399_999_999));
        assert!(!b.blocks(400_000_000), "one trial");
        assert!(b.blocks(400_000_001), "only one");
        b.success();
        assert!(!b.is_open(), "a successful trial closes the breaker");
    }

    #[test]
    fn the_longest_probe_interval_does_not_overflow() {
        let b = Breaker::new("redis", 1, Duration::MAX);
        assert!(b.failure(0));
        assert!(
            b.blocks(u64::MAX - 1),
            "no trial before the (saturated) gap"
        );
    }
}
