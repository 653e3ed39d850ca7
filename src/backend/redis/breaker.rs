//! The circuit breaker: stop calling a Redis that keeps failing, probe it in the background.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Counts consecutive failures; after `threshold` of them the breaker opens and requests no
/// longer call Redis (they get the failure policy at once, without paying the timeout). The
/// backend then probes Redis every `probe_interval` and closes the breaker on the first answer.
#[derive(Debug)]
pub(crate) struct Breaker {
    pub(crate) threshold: u32,
    pub(crate) probe_interval: Duration,
    failures: AtomicU32,
    open: AtomicBool,
    trips: AtomicU64,
}

impl Breaker {
    pub(crate) fn new(threshold: u32, probe_interval: Duration) -> Self {
        Breaker {
            threshold: threshold.max(1),
            probe_interval,
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            trips: AtomicU64::new(0),
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    pub(crate) fn trips(&self) -> u64 {
        self.trips.load(Ordering::Relaxed)
    }

    /// A call succeeded.
    pub(crate) fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    /// A call failed. Returns `true` when this failure opened the breaker: the caller then
    /// starts the probe (exactly one caller sees `true` per opening).
    pub(crate) fn failure(&self) -> bool {
        let n = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if n >= self.threshold && !self.open.swap(true, Ordering::AcqRel) {
            self.trips.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// The probe got an answer: calls resume.
    pub(crate) fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.open.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_closes() {
        let b = Breaker::new(3, Duration::from_millis(500));
        assert!(!b.failure());
        b.success();
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.failure(), "third consecutive failure opens");
        assert!(b.is_open());
        assert!(!b.failure(), "only one caller starts the probe");
        b.close();
        assert!(!b.is_open());
        assert_eq!(b.trips(), 1);
    }
}
