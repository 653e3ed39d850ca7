//! Wait mode: the layer holds a request until its policy allows it, instead of answering `429`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How the layer waits (see [`RateLimitLayerBuilder::wait`](crate::RateLimitLayerBuilder::wait)).
#[derive(Debug, Clone)]
pub(crate) struct Waiting {
    pub(crate) max_wait: Duration,
    max_waiters: usize,
    waiters: Arc<AtomicUsize>,
}

impl Waiting {
    pub(crate) fn new(max_wait: Duration, max_waiters: usize) -> Self {
        Waiting {
            max_wait,
            max_waiters,
            waiters: Arc::default(),
        }
    }

    /// A waiter's slot, if one is free: held while the request waits, given back when it goes
    /// on or is dropped.
    pub(crate) fn enter(&self) -> Option<Slot> {
        let mut n = self.waiters.load(Ordering::Relaxed);
        loop {
            if n >= self.max_waiters {
                return None;
            }
            match self
                .waiters
                .compare_exchange_weak(n, n + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Some(Slot(self.waiters.clone())),
                Err(actual) => n = actual,
            }
        }
    }
}

/// One waiting request's place among the waiters.
#[derive(Debug)]
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
