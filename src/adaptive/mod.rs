//! Concurrency limits that adapt to latency and drops: they protect the service, where a rate
//! limit shares it. [`AdaptiveLayer`] puts one in front of a service (issue 46; priorities and
//! outbound use come next).
//!
//! An [`AdaptiveLimit`] admits a request when fewer than its limit are in flight
//! ([`try_acquire`](AdaptiveLimit::try_acquire)), and learns from how each one ended: its
//! [`Permit`]'s [`success`](Permit::success) is a sample of the round-trip time,
//! [`dropped`](Permit::dropped) a sign of overload (a timeout, an error that means overload, a
//! 429 or 503 from upstream), and a permit dropped without either (a cancelled request) gives
//! its slot back and is no sample. Samples are gathered in windows (at least `min_samples`,
//! and 2 × the last window's RTT long, between 100 ms and 1 s by default: Netflix's
//! `WindowedLimit`), and at each window's end an [`Algorithm`] moves the limit:
//! [`Gradient`] (the default, on latency) or [`Aimd`] (on drops). The limit stays in
//! `[min, max]` whatever the samples.
//!
//! No request waits on a lock: admission is a compare-and-swap on the count in flight, a
//! sample a few atomic adds, and the window is closed by the one request that finds it due and
//! wins a `try_lock` (the others go on).
//!
//! ```
//! use std::time::Duration;
//! use tollgate::adaptive::{AdaptiveLimit, Gradient};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tollgate::ConfigError> {
//! let limit = AdaptiveLimit::builder()
//!     .initial(20)
//!     .range(4, 200)
//!     .gradient(Gradient::new().tolerance(2.0))
//!     .build()?;
//! match limit.try_acquire() {
//!     Some(permit) => {
//!         // ... call the service ...
//!         permit.success();
//!     }
//!     None => { /* over the limit: answer 503 at once */ }
//! }
//! assert_eq!(limit.in_flight(), 0);
//! # Ok(()) }
//! ```

mod algorithm;
mod layer;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use algorithm::{Aimd, Algorithm, Gradient, Window};
pub use layer::{Adaptive, AdaptiveFuture, AdaptiveLayer, Overload};
use tokio::time::Instant;

use crate::ConfigError;

/// A concurrency limit that adapts (see the [module docs](self)). Cheap to clone: clones share
/// the limit.
#[derive(Clone)]
pub struct AdaptiveLimit {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AdaptiveLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveLimit")
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

struct Inner {
    /// The limit in force (the algorithm's, rounded, in `[min, max]`).
    limit: AtomicU32,
    in_flight: AtomicU32,
    min: u32,
    max: u32,
    min_samples: u32,
    min_window: Duration,
    max_window: Duration,
    origin: Instant,
    /// The window being gathered: its end (ns from `origin`), samples, dropped, the sum of the
    /// RTTs not dropped (ns), the fastest (ns), the most in flight at a start.
    window_end: AtomicU64,
    samples: AtomicU32,
    dropped: AtomicU32,
    rtt_sum: AtomicU64,
    rtt_min: AtomicU64,
    max_in_flight: AtomicU32,
    /// The algorithm and the fractional limit, taken by the request that closes a window.
    state: Mutex<State>,
}

struct State {
    algorithm: Box<dyn Algorithm>,
    limit: f64,
}

/// Builds an [`AdaptiveLimit`].
pub struct AdaptiveLimitBuilder {
    initial: u32,
    min: u32,
    max: u32,
    min_samples: u32,
    min_window: Duration,
    max_window: Duration,
    algorithm: Option<Box<dyn Algorithm>>,
    gradient: Option<Gradient>,
}

impl std::fmt::Debug for AdaptiveLimitBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveLimitBuilder")
            .field("initial", &self.initial)
            .field("min", &self.min)
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl AdaptiveLimit {
    /// A builder: initial limit 20, range 1 to 1000, the [`Gradient`], windows of at least 10
    /// samples and between 100 ms and 1 s (twice the last window's RTT).
    pub fn builder() -> AdaptiveLimitBuilder {
        AdaptiveLimitBuilder {
            initial: 20,
            min: 1,
            max: 1000,
            min_samples: 10,
            min_window: Duration::from_millis(100),
            max_window: Duration::from_secs(1),
            algorithm: None,
            gradient: None,
        }
    }

    /// A slot for one request, if fewer than the limit are in flight. The slot is given back
    /// when the permit is ended or dropped.
    pub fn try_acquire(&self) -> Option<Permit> {
        let inner = &self.inner;
        let limit = inner.limit.load(Ordering::Relaxed);
        let mut now = inner.in_flight.load(Ordering::Relaxed);
        loop {
            if now >= limit {
                return None;
            }
            match inner.in_flight.compare_exchange_weak(
                now,
                now + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(actual) => now = actual,
            }
        }
        Some(Permit {
            limit: self.clone(),
            start: Instant::now(),
            in_flight: now + 1,
            ended: false,
        })
    }

    /// The limit now.
    pub fn limit(&self) -> u32 {
        self.inner.limit.load(Ordering::Relaxed)
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> u32 {
        self.inner.in_flight.load(Ordering::Relaxed)
    }

    fn sample(&self, rtt: Duration, in_flight: u32, dropped: bool) {
        let inner = &self.inner;
        let ns = u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX);
        if dropped {
            inner.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            inner.rtt_sum.fetch_add(ns, Ordering::Relaxed);
            inner.rtt_min.fetch_min(ns, Ordering::Relaxed);
        }
        inner.max_in_flight.fetch_max(in_flight, Ordering::Relaxed);
        let samples = inner.samples.fetch_add(1, Ordering::AcqRel) + 1;
        let now = inner.now_ns();
        if samples >= inner.min_samples && now >= inner.window_end.load(Ordering::Relaxed) {
            // One request closes the window; the others go on.
            if let Ok(mut state) = inner.state.try_lock() {
                inner.close(&mut state, now);
            }
        }
    }
}

impl Inner {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Ends the window at `now`: its numbers to the algorithm, the new limit in force, the next
    /// window started.
    fn close(&self, state: &mut State, now: u64) {
        // Checked again under the lock: another request may have closed it.
        if now < self.window_end.load(Ordering::Relaxed) {
            return;
        }
        let samples = self.samples.swap(0, Ordering::AcqRel);
        if samples == 0 {
            return;
        }
        let dropped = self.dropped.swap(0, Ordering::AcqRel).min(samples);
        let sum = self.rtt_sum.swap(0, Ordering::AcqRel);
        let fastest = self.rtt_min.swap(u64::MAX, Ordering::AcqRel);
        let max_in_flight = self.max_in_flight.swap(0, Ordering::AcqRel);
        let timed = samples - dropped;
        let mean = if timed > 0 { sum / u64::from(timed) } else { 0 };
        let window = Window {
            rtt: Duration::from_nanos(mean),
            min_rtt: Duration::from_nanos(if fastest == u64::MAX { 0 } else { fastest }),
            max_in_flight,
            samples,
            dropped,
        };
        let next = state.algorithm.update(state.limit, &window);
        let (min, max) = (f64::from(self.min), f64::from(self.max));
        state.limit = if next.is_finite() {
            next.clamp(min, max)
        } else {
            state.limit
        };
        self.limit
            .store(state.limit.round() as u32, Ordering::Relaxed);
        // The next window: twice this one's RTT, within the bounds.
        let length = (Duration::from_nanos(mean) * 2).clamp(self.min_window, self.max_window);
        let length = u64::try_from(length.as_nanos()).unwrap_or(u64::MAX);
        self.window_end
            .store(now.saturating_add(length), Ordering::Relaxed);
    }
}

impl AdaptiveLimitBuilder {
    /// The limit to start at (clamped to the range).
    pub fn initial(mut self, limit: u32) -> Self {
        self.initial = limit;
        self
    }

    /// The range the limit stays in, `min` at least 1.
    pub fn range(mut self, min: u32, max: u32) -> Self {
        self.min = min;
        self.max = max;
        self
    }

    /// The algorithm that moves the limit ([`Gradient`] by default).
    pub fn algorithm(mut self, algorithm: impl Algorithm) -> Self {
        self.algorithm = Some(Box::new(algorithm));
        self.gradient = None;
        self
    }

    /// The default algorithm, [`Gradient`], with these settings (its floor is the range's
    /// minimum).
    pub fn gradient(mut self, gradient: Gradient) -> Self {
        self.gradient = Some(gradient);
        self.algorithm = None;
        self
    }

    /// The fewest samples a window needs before it closes (at least 1).
    pub fn min_samples(mut self, samples: u32) -> Self {
        self.min_samples = samples;
        self
    }

    /// The shortest and longest a window lasts (it is twice the last window's RTT between).
    pub fn window(mut self, min: Duration, max: Duration) -> Self {
        self.min_window = min;
        self.max_window = max;
        self
    }

    /// The limit, or what is wrong with its settings.
    pub fn build(self) -> Result<AdaptiveLimit, ConfigError> {
        let bad = |option: &'static str, reason: String| ConfigError::Invalid { option, reason };
        if self.min == 0 || self.min > self.max {
            return Err(bad(
                "range",
                format!(
                    "{}..{}: the minimum must be at least 1 and at most the maximum",
                    self.min, self.max
                ),
            ));
        }
        if self.min_samples == 0 {
            return Err(bad("min_samples", "0: a window needs a sample".into()));
        }
        if self.min_window.is_zero() || self.min_window > self.max_window {
            return Err(bad(
                "window",
                format!(
                    "{:?}..{:?}: the shortest must be more than 0 and at most the longest",
                    self.min_window, self.max_window
                ),
            ));
        }
        let algorithm = match self.algorithm {
            Some(a) => a,
            None => Box::new(self.gradient.unwrap_or_default().floor(self.min)),
        };
        let initial = self.initial.clamp(self.min, self.max);
        let min_window = u64::try_from(self.min_window.as_nanos()).unwrap_or(u64::MAX);
        Ok(AdaptiveLimit {
            inner: Arc::new(Inner {
                limit: AtomicU32::new(initial),
                in_flight: AtomicU32::new(0),
                min: self.min,
                max: self.max,
                min_samples: self.min_samples,
                min_window: self.min_window,
                max_window: self.max_window,
                origin: Instant::now(),
                window_end: AtomicU64::new(min_window),
                samples: AtomicU32::new(0),
                dropped: AtomicU32::new(0),
                rtt_sum: AtomicU64::new(0),
                rtt_min: AtomicU64::new(u64::MAX),
                max_in_flight: AtomicU32::new(0),
                state: Mutex::new(State {
                    algorithm,
                    limit: f64::from(initial),
                }),
            }),
        })
    }
}

/// One admitted request's slot. End it with [`success`](Self::success) (a sample of its
/// round-trip time) or [`dropped`](Self::dropped) (a sign of overload); dropped without
/// either (the request was cancelled, or failed before any real work), it gives its slot back
/// and is no sample.
#[derive(Debug)]
#[must_use = "a permit holds a slot until it is ended or dropped"]
pub struct Permit {
    limit: AdaptiveLimit,
    start: Instant,
    in_flight: u32,
    ended: bool,
}

impl Permit {
    /// The request succeeded: its time since admission is a sample.
    pub fn success(mut self) {
        self.end(false);
    }

    /// The request showed overload (a timeout, an overload error, a 429 or 503 upstream).
    pub fn dropped(mut self) {
        self.end(true);
    }

    /// Requests in flight when this one was admitted, itself included.
    pub fn in_flight_at_start(&self) -> u32 {
        self.in_flight
    }

    fn end(&mut self, dropped: bool) {
        self.ended = true;
        self.limit.inner.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.limit
            .sample(self.start.elapsed(), self.in_flight, dropped);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.ended {
            self.limit.inner.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
