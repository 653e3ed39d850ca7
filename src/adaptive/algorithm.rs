//! The algorithms that move an adaptive limit: [`Algorithm`], [`Gradient`] and [`Aimd`].

use std::time::Duration;

use crate::ConfigError;

/// What a window of samples showed: the algorithm's input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// The mean round-trip time of the window's samples that were not dropped (the whole
    /// window's when every one was).
    pub rtt: Duration,
    /// The fastest sample of the window.
    pub min_rtt: Duration,
    /// The most requests in flight when one of the window's requests started.
    pub max_in_flight: u32,
    /// Samples in the window.
    pub samples: u32,
    /// Of them, dropped: a timeout, an error that signals overload, a 429 or 503 from upstream.
    pub dropped: u32,
}

/// An algorithm that finds a concurrency limit from samples, a window at a time.
///
/// `update` gets the limit now (fractional: an algorithm may move it by less than one) and the
/// window just closed, and returns the new limit. The caller clamps it to `[min, max]` and
/// ignores what is not a finite number, so an algorithm cannot take the limit out of its
/// bounds; it is called by one request at a time (the one that closed the window), never on
/// the path of the others.
pub trait Algorithm: Send + 'static {
    /// The new limit after `window`, from `limit`.
    fn update(&mut self, limit: f64, window: &Window) -> f64;

    /// The round-trip time the algorithm takes for no load, if it keeps one (reported in the
    /// metrics).
    fn baseline(&self) -> Option<Duration> {
        None
    }

    /// Whether the algorithm's settings make sense: called by
    /// [`AdaptiveLimitBuilder::build`](super::AdaptiveLimitBuilder::build), which returns the
    /// error (an option out of range, named). The default accepts any.
    fn check(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}

/// `value` for `option` if `ok`, else the error naming it, the value and `what` it must be.
fn in_range(
    option: &'static str,
    value: f64,
    ok: impl Fn(f64) -> bool,
    what: &str,
) -> Result<(), ConfigError> {
    if value.is_finite() && ok(value) {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            option,
            reason: format!("{value}: {what}"),
        })
    }
}

/// A gradient on latency, in the family of Netflix's Gradient2 and Envoy's
/// `adaptive_concurrency`: the limit follows `baseline / rtt`, where the baseline is what a
/// request costs when nothing queues. The default, for services whose latency shows their
/// load.
///
/// Per window: `gradient = clamp(tolerance × baseline / rtt, 0.5, 1)`. Below 1 (requests queue)
/// the limit moves towards `limit × gradient` (by `smoothing` of the way). At 1, and only when
/// the limit was reached (`max_in_flight ≥ limit / 2`: an app-limited service says nothing of
/// its capacity), it grows by `√limit × headroom`, where the headroom is the share of the
/// tolerance still unused: 1 at the baseline's latency, 0 at `tolerance × baseline`. So the
/// limit climbs fast while nothing queues and comes to rest where the latency is about
/// `tolerance × baseline`: `tolerance − 1` of the capacity waiting, enough that the service
/// never idles while the limit wobbles. A drop counts as a gradient of 0.5.
///
/// Where the known flaws of its ancestors are mended:
/// - the baseline is the fastest window *mean* seen, never one sample, so one lucky fast
///   response cannot poison it (Netflix #37);
/// - headroom is added only while the latency is within the tolerance, and less the nearer it
///   is, so the limit does not drift upward under a modest overload (Gradient2's
///   `+ queueSize` on every update, Netflix PR #134);
/// - the baseline is measured again, without pinning the limit to its minimum (Envoy's bursts
///   of 503s during its minRTT windows): it creeps up by `baseline_creep` a window while
///   nothing queues (the latency in the tolerance's lower half; in the upper half, where the
///   limit rests, a creep would carry the limit up with it), and after `rebase_after` windows
///   with the limit at its floor and the latency still high (a service that became slower per
///   request, not more loaded), the window's latency is the baseline.
#[derive(Debug, Clone)]
pub struct Gradient {
    tolerance: f64,
    smoothing: f64,
    baseline_creep: f64,
    rebase_after: u32,
    min: f64,
    /// The baseline RTT, in seconds (0 until the first window).
    baseline: f64,
    /// Windows in a row at the floor while queueing.
    at_floor: u32,
}

impl Default for Gradient {
    /// Tolerance 1.25 (latency may reach 1.25 × the baseline before the limit shrinks, and the
    /// limit rests about there: a quarter of the capacity waiting, room for the spread of a
    /// typical HTTP service; Gradient2's 1.5 gave a longer p99 for no more goodput in an
    /// earlier run of the benchmark of BENCHMARKS.md), smoothing 0.2, creep 0.5 % a window, a new baseline after 5
    /// windows at the floor (Envoy's trigger), floor 1.
    fn default() -> Self {
        Gradient {
            tolerance: 1.25,
            smoothing: 0.2,
            baseline_creep: 0.005,
            rebase_after: 5,
            min: 1.0,
            baseline: 0.0,
            at_floor: 0,
        }
    }
}

impl Gradient {
    /// The default gradient (see [`Default`](#impl-Default-for-Gradient)).
    pub fn new() -> Self {
        Self::default()
    }

    /// How far latency may rise over the baseline before the limit shrinks (at least 1; a
    /// value out of range is refused by the limit's `build()`).
    pub fn tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The share of the way to its target the limit moves down in one window (more than 0,
    /// at most 1; a value out of range is refused by the limit's `build()`).
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.smoothing = smoothing;
        self
    }

    /// The floor the baseline is measured again at (the adaptive limit's `min`; set by the
    /// limit's builder).
    pub(crate) fn floor(mut self, min: u32) -> Self {
        self.min = f64::from(min.max(1));
        self
    }

    /// The baseline RTT found so far (zero before the first window).
    pub fn baseline(&self) -> Duration {
        Duration::from_secs_f64(self.baseline.max(0.0))
    }
}

impl Algorithm for Gradient {
    fn baseline(&self) -> Option<Duration> {
        (self.baseline > 0.0).then(|| Duration::from_secs_f64(self.baseline))
    }

    fn check(&self) -> Result<(), ConfigError> {
        in_range("tolerance", self.tolerance, |v| v >= 1.0, "at least 1")?;
        in_range(
            "smoothing",
            self.smoothing,
            |v| v > 0.0 && v <= 1.0,
            "more than 0, at most 1",
        )
    }

    fn update(&mut self, limit: f64, w: &Window) -> f64 {
        let rtt = w.rtt.as_secs_f64();
        // A window's latency says something only where some of its samples were not drops
        // (a window of drops only has the drops' time, or none).
        let timed = rtt.is_finite() && rtt > 0.0 && w.dropped < w.samples;
        if !timed && w.dropped == 0 {
            return limit;
        }
        if timed && (self.baseline <= 0.0 || rtt < self.baseline) {
            self.baseline = rtt;
        }
        // A drop is a gradient of 0.5, whatever the latency: a window of drops only (an
        // upstream down, every call timing out, a service answering 503 to everything) shrinks
        // the limit as surely as one with a single drop.
        let raw = if timed {
            self.tolerance * self.baseline / rtt
        } else {
            0.5
        };
        let mut gradient = raw.clamp(0.5, 1.0);
        if w.dropped > 0 {
            gradient = 0.5;
        }
        if gradient < 1.0 {
            // Queueing at the floor for long: the service is slower per request, not more
            // loaded. Its latency now is the baseline.
            if limit <= self.min + 0.5 {
                self.at_floor += 1;
                if self.at_floor >= self.rebase_after && w.dropped == 0 {
                    self.baseline = rtt;
                    self.at_floor = 0;
                }
            } else {
                self.at_floor = 0;
            }
            let target = limit * gradient;
            return limit - self.smoothing * (limit - target);
        }
        self.at_floor = 0;
        // The headroom left: 1 when the latency is the baseline's, 0 at the tolerance.
        let headroom = if self.tolerance > 1.0 {
            ((raw - 1.0) / (self.tolerance - 1.0)).clamp(0.0, 1.0)
        } else {
            1.0
        };
        // Nothing queues (the lower half of the tolerance): the baseline may creep up (an old
        // fast window fades), bounded by what is measured now. Not in the upper half, where
        // the limit rests: there a creep would carry the limit up with it.
        if headroom >= 0.5 {
            self.baseline = (self.baseline * (1.0 + self.baseline_creep)).min(rtt);
        }
        if f64::from(w.max_in_flight) * 2.0 >= limit {
            // Growth by the headroom: √limit at the baseline, nothing at the tolerance, so the
            // limit comes to rest below it instead of overshooting by √limit and queueing
            // until it shrinks back.
            limit + limit.sqrt().max(1.0) * headroom
        } else {
            limit
        }
    }
}

/// Additive increase, multiplicative decrease, for signals that are drops rather than
/// latency (an upstream that answers 429 or 503, times out, or fails when overloaded): a window
/// with a drop multiplies the limit by `backoff`; one without, where the limit was reached
/// (`max_in_flight ≥ limit / 2`), adds `increase`.
#[derive(Debug, Clone)]
pub struct Aimd {
    backoff: f64,
    increase: f64,
}

impl Default for Aimd {
    /// Back off to 0.9 of the limit, grow by 1 (Netflix's AIMD, Vector's 0.9).
    fn default() -> Self {
        Aimd {
            backoff: 0.9,
            increase: 1.0,
        }
    }
}

impl Aimd {
    /// The default AIMD (see [`Default`](#impl-Default-for-Aimd)).
    pub fn new() -> Self {
        Self::default()
    }

    /// What a window with a drop multiplies the limit by (0.5 to 0.99; a value out of range
    /// is refused by the limit's `build()`).
    pub fn backoff(mut self, ratio: f64) -> Self {
        self.backoff = ratio;
        self
    }

    /// What a window without a drop adds, when the limit was reached (more than 0; a value
    /// out of range is refused by the limit's `build()`).
    pub fn increase(mut self, by: f64) -> Self {
        self.increase = by;
        self
    }
}

impl Algorithm for Aimd {
    fn check(&self) -> Result<(), ConfigError> {
        in_range(
            "backoff",
            self.backoff,
            |v| (0.5..=0.99).contains(&v),
            "from 0.5 to 0.99",
        )?;
        in_range("increase", self.increase, |v| v > 0.0, "more than 0")
    }

    fn update(&mut self, limit: f64, w: &Window) -> f64 {
        if w.dropped > 0 {
            limit * self.backoff
        } else if f64::from(w.max_in_flight) * 2.0 >= limit {
            limit + self.increase
        } else {
            limit
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(ms: u64, in_flight: u32, dropped: u32) -> Window {
        Window {
            rtt: Duration::from_millis(ms),
            min_rtt: Duration::from_millis(ms),
            max_in_flight: in_flight,
            samples: 10,
            dropped,
        }
    }

    #[test]
    fn aimd_backs_off_on_drops_and_grows_when_the_limit_is_reached() {
        let mut a = Aimd::new();
        assert_eq!(a.update(20.0, &window(10, 20, 1)), 18.0);
        assert_eq!(a.update(20.0, &window(10, 10, 0)), 21.0);
        // App-limited: no growth.
        assert_eq!(a.update(20.0, &window(10, 9, 0)), 20.0);
    }

    #[test]
    fn the_gradient_grows_without_queueing_and_shrinks_with_it() {
        let mut g = Gradient::new();
        // The first window sets the baseline: no queueing, the limit was reached.
        assert_eq!(g.update(16.0, &window(20, 16, 0)), 20.0);
        // Latency within the tolerance: still growing, by the headroom left (1.25 × 20 / 24
        // is 1/24 over 1, a sixth of the tolerance's quarter).
        let up = g.update(16.0, &window(24, 16, 0));
        assert!((up - (16.0 + 4.0 / 6.0)).abs() < 1e-9, "{up}");
        // At the tolerance: no growth, no shrinking.
        let mut at = Gradient::new();
        at.update(16.0, &window(20, 16, 0));
        assert_eq!(at.update(16.0, &window(25, 16, 0)), 16.0);
        // In the tolerance's upper half the baseline stays; in its lower half (nothing
        // queues) it creeps up 0.5 %, to 20.1 ms.
        assert!((g.baseline().as_secs_f64() - 0.020).abs() < 1e-9);
        g.update(16.0, &window(21, 16, 0));
        // Twice it: a gradient of 1.25 × 20.1 / 40, a fifth of the way there.
        assert!((g.baseline().as_secs_f64() - 0.0201).abs() < 1e-9);
        let down = g.update(16.0, &window(40, 16, 0));
        let expect = 16.0 - 0.2 * (16.0 - 16.0 * 1.25 * 20.1 / 40.0);
        assert!((down - expect).abs() < 1e-9, "{down}");
        // A drop: a gradient of 0.5.
        let down = g.update(16.0, &window(20, 16, 1));
        assert!((down - 14.4).abs() < 1e-9, "{down}");
        // App-limited: no growth.
        assert_eq!(g.update(16.0, &window(20, 7, 0)), 16.0);
    }
}
