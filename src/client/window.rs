//! Two counts over a sliding window of time, in slots: what the throttle (requests, accepts)
//! and the retry budget (first attempts, retries) decide from.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How many slots a window is cut into: counts leave the window a slot at a time, so the
/// window is exact to a tenth.
const SLOTS: usize = 10;

/// Two counts (`[0]` and `[1]`) per slot, over the last [`SLOTS`] slots. One lock held for a
/// few additions per call: a call to an upstream costs far more, and each decision reads and
/// writes the counts as one step, so concurrent calls never decide on the same counts.
pub(crate) struct Counts {
    origin: Instant,
    slot_ns: u64,
    slots: Mutex<[Slot; SLOTS]>,
}

#[derive(Clone, Copy, Default)]
struct Slot {
    /// The slot's number since the origin (its counts belong to it alone).
    epoch: u64,
    counts: [u64; 2],
}

impl Counts {
    /// Counts over `window` (at least 10 ns: a slot is at least a nanosecond).
    pub(crate) fn new(window: Duration) -> Self {
        let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        Counts {
            origin: Instant::now(),
            slot_ns: (ns / SLOTS as u64).max(1),
            slots: Mutex::new([Slot::default(); SLOTS]),
        }
    }

    /// Runs `f` with the window's sums now and the current slot's counts to add to, as one
    /// step.
    pub(crate) fn with<R>(&self, f: impl FnOnce([u64; 2], &mut [u64; 2]) -> R) -> R {
        let now_ns = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // Epochs start at 1, so that the zeroed slots of a new window count for nothing.
        let epoch = now_ns / self.slot_ns + 1;
        // A panic elsewhere cannot leave the counts half-written: each step is additions.
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut sums = [0u64; 2];
        for s in slots.iter() {
            if s.epoch + (SLOTS as u64) > epoch && s.epoch <= epoch {
                sums[0] = sums[0].saturating_add(s.counts[0]);
                sums[1] = sums[1].saturating_add(s.counts[1]);
            }
        }
        let slot = &mut slots[(epoch % SLOTS as u64) as usize];
        if slot.epoch != epoch {
            // Counted for the window that has gone past: no longer in the sums either.
            *slot = Slot {
                epoch,
                counts: [0; 2],
            };
        }
        f(sums, &mut slot.counts)
    }

    /// A window's length checked: at least 100 ms, for slots of at least 10 ms.
    pub(crate) fn check(window: Duration) -> Result<(), crate::ConfigError> {
        if window < Duration::from_millis(100) {
            return Err(crate::ConfigError::Invalid {
                option: "window",
                reason: format!("the window must be at least 100 ms, not {window:?}"),
            });
        }
        Ok(())
    }

    /// Adds to the current slot.
    pub(crate) fn add(&self, a: u64, b: u64) {
        self.with(|_, c| {
            c[0] = c[0].saturating_add(a);
            c[1] = c[1].saturating_add(b);
        });
    }

    /// The window's sums now.
    pub(crate) fn sums(&self) -> [u64; 2] {
        self.with(|sums, _| sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn counts_leave_the_window_a_slot_at_a_time() {
        let c = Counts::new(Duration::from_secs(10));
        c.add(5, 1);
        tokio::time::advance(Duration::from_secs(4)).await;
        c.add(3, 0);
        assert_eq!(c.sums(), [8, 1]);
        // The first slot's counts are 10 s old: gone; the second's stay.
        tokio::time::advance(Duration::from_millis(6_100)).await;
        assert_eq!(c.sums(), [3, 0]);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(c.sums(), [0, 0]);
        // A slot reused a window later starts from nothing.
        c.add(1, 1);
        assert_eq!(c.sums(), [1, 1]);
        tokio::time::advance(Duration::from_secs(100)).await;
        assert_eq!(c.sums(), [0, 0]);
    }
}
