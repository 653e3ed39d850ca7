//! Time as the backend sees it locally (for the deny cache), and the test-only fixed clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A manually advanced clock for tests, shared by the store (which then decides at its time instead
/// of `TIME`) and the deny cache. Not part of the public API: see
/// `test_clock` on the remote backends' builders (hidden from the docs).
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct TestClock {
    ns: Arc<AtomicU64>,
}

impl TestClock {
    /// A clock at an arbitrary fixed start (about 11.6 days after the Unix epoch, so that
    /// nanosecond times stay exact in the script's double-precision numbers).
    pub fn new() -> Self {
        TestClock {
            ns: Arc::new(AtomicU64::new(1_000_000_000_000_000)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.ns.fetch_add(by, Ordering::AcqRel);
    }

    /// The clock's time in nanoseconds.
    pub fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::Acquire)
    }
}

impl Default for TestClock {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Clock {
    Real(Instant),
    Test(TestClock),
}

impl Clock {
    /// Monotonic nanoseconds on this clock.
    pub(crate) fn now_ns(&self) -> u64 {
        match self {
            Clock::Real(origin) => u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Clock::Test(c) => c.now_ns(),
        }
    }

    /// The fixed time to pass to the script, if any.
    pub(crate) fn script_time(&self) -> Option<u64> {
        match self {
            Clock::Real(_) => None,
            Clock::Test(c) => Some(c.now_ns()),
        }
    }
}
