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

    /// Whether the algorithm is probing: the limit it set is a measurement, not its estimate
    /// (the gradient's probe of the baseline). Its windows then last twice the last window's
    /// mean RTT without the shortest length's floor (still `min_samples` long), so that a probe
    /// costs as little time as it needs. The default: never.
    fn probing(&self) -> bool {
        false
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
///   request, not more loaded), the window's latency is the baseline;
/// - a baseline found while requests already queued (a limit that starts above the capacity
///   under load: a replica restarted into a busy fleet, or a capacity that fell) is found
///   again by a **probe**: now and then, while the limit is reached, the limit is halved for
///   two windows (one for the requests over it to drain, one measured), and a measured
///   latency under nine tenths of the baseline is the new baseline; then the limit goes back,
///   in one step, to where the latency before the probe says it should be with it. Probes
///   start 5 windows after the limit is first reached and come at four times the interval
///   each time one finds nothing, up to every 512 windows (51 s with 100 ms windows, about
///   8 minutes for a service of half a second); one that finds a lower baseline brings the
///   next back to 5 windows. A probe costs half the limit for two windows, the first (the
///   drain) short, the second (measured) whole, so that its mean is of enough samples; Envoy pins
///   the limit to its minimum for its minRTT windows instead.
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
    /// The probe of the baseline: where it stands, and the windows between probes now.
    probe: Probe,
    probe_every: u32,
}

/// Where a probe of the baseline stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Probe {
    /// This many windows with the limit reached before the next probe.
    Idle(u32),
    /// The limit halved, the requests over it draining: the limit to put back after, and the
    /// latency at it (seconds).
    Draining(f64, f64),
    /// The window measured at the halved limit: the limit to put back after, and the latency
    /// at it.
    Measuring(f64, f64),
}

/// The windows before the first probe, and after one that found a lower baseline.
const PROBE_FIRST: u32 = 5;
/// The most windows between probes.
const PROBE_MOST: u32 = 512;
/// A probe's latency under this share of the baseline is the new baseline.
const PROBE_FOUND: f64 = 0.9;

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
            probe: Probe::Idle(PROBE_FIRST),
            probe_every: PROBE_FIRST,
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

    fn probing(&self) -> bool {
        // Only the window that drains is short: the one measured has the usual length, enough
        // samples that its mean is not a lucky few.
        matches!(self.probe, Probe::Draining(..))
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
        match self.probe {
            Probe::Idle(_) => {}
            Probe::Draining(restore, before) => {
                self.probe = Probe::Measuring(restore, before);
                return limit;
            }
            Probe::Measuring(restore, before) => {
                let clean = timed && w.dropped == 0;
                let found = clean && rtt < self.baseline * PROBE_FOUND;
                self.probe_every = if found {
                    PROBE_FIRST
                } else {
                    (self.probe_every * 4).min(PROBE_MOST)
                };
                self.probe = Probe::Idle(self.probe_every);
                if !found {
                    // A little faster is still the fastest window mean: the baseline.
                    if clean && rtt < self.baseline {
                        self.baseline = rtt;
                    }
                    return restore.max(limit);
                }
                // The baseline was found while requests queued: the limit goes back to where
                // the latency before the probe says it should be with the new baseline, in one
                // step (the probe measured it; no smoothing needed).
                self.baseline = rtt;
                let gradient = (self.tolerance * rtt / before).clamp(0.5, 1.0);
                return (restore * gradient).max(limit);
            }
        }
        if !timed && w.dropped == 0 {
            return limit;
        }
        // The limit is reached, nothing dropped: time for a probe of the baseline? Not at the
        // floor, nor before there is a baseline.
        if let Probe::Idle(left) = self.probe
            && timed
            && w.dropped == 0
            && self.baseline > 0.0
            && f64::from(w.max_in_flight) * 2.0 >= limit
            && limit * 0.5 >= self.min
        {
            if left <= 1 {
                self.probe = Probe::Draining(limit, rtt);
                return limit * 0.5;
            }
            self.probe = Probe::Idle(left - 1);
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

    #[test]
    fn a_window_of_drops_only_is_a_gradient_of_one_half() {
        let mut g = Gradient::new();
        // No sample was timed (every one dropped): the mean RTT is the drops' or none.
        let drops = Window {
            rtt: Duration::ZERO,
            min_rtt: Duration::ZERO,
            max_in_flight: 50,
            samples: 10,
            dropped: 10,
        };
        assert!((g.update(50.0, &drops) - 45.0).abs() < 1e-9);
        let slow = Window {
            rtt: Duration::from_secs(1),
            ..drops
        };
        assert!((g.update(45.0, &slow) - 40.5).abs() < 1e-9);
        // The drops' time is not a baseline.
        assert_eq!(g.baseline(), Duration::ZERO);
        // An empty window (no sample) says nothing.
        let empty = Window {
            samples: 0,
            dropped: 0,
            ..drops
        };
        assert_eq!(g.update(40.0, &empty), 40.0);
    }

    #[test]
    fn a_probe_halves_the_limit_for_two_windows_and_finds_a_queued_baseline() {
        let mut g = Gradient::new();
        // The first window: 40 ms at a limit of 16, reached. The baseline is 40 ms, but
        // requests already queued.
        assert_eq!(g.update(16.0, &window(40, 16, 0)), 20.0);
        assert!(!g.probing());
        let mut limit = 20.0;
        for _ in 0..PROBE_FIRST - 1 {
            limit = g.update(limit, &window(50, 20, 0));
            assert!(!g.probing());
        }
        let before = limit;
        // The fifth window with the limit reached starts the probe: half the limit.
        let probe = g.update(limit, &window(50, 20, 0));
        assert!((probe - before / 2.0).abs() < 1e-9, "{probe} of {before}");
        assert!(g.probing());
        // A window draining the requests over it: unchanged, whatever its latency.
        assert_eq!(g.update(probe, &window(45, 20, 0)), probe);
        // The window measured: 20 ms, under 0.9 of the baseline: the baseline, and the limit
        // back at once to where the latency before (50 ms) says: 1.25 × 20 / 50 of it.
        let back = g.update(probe, &window(20, 10, 0));
        assert!((back - before * 0.5).abs() < 1e-9, "{back}");
        assert_eq!(g.baseline(), Duration::from_millis(20));
        assert!(!g.probing());
        assert_eq!(g.probe, Probe::Idle(PROBE_FIRST));

        // A probe that finds nothing: the limit put back, the next after four times the windows.
        let mut limit = back;
        for _ in 0..PROBE_FIRST {
            limit = g.update(limit, &window(25, 20, 0));
        }
        assert!(g.probing());
        let restore = limit * 2.0;
        g.update(limit, &window(25, 20, 0));
        assert_eq!(g.update(limit, &window(20, 10, 0)), restore);
        assert_eq!(g.probe, Probe::Idle(PROBE_FIRST * 4));
        // Not while app-limited: the count waits.
        g.update(restore, &window(20, 2, 0));
        assert_eq!(g.probe, Probe::Idle(PROBE_FIRST * 4));
    }

    #[test]
    fn settings_out_of_range_are_refused_by_check() {
        for (g, word) in [
            (Gradient::new().tolerance(0.5), "tolerance"),
            (Gradient::new().tolerance(f64::NAN), "tolerance"),
            (Gradient::new().smoothing(0.0), "smoothing"),
            (Gradient::new().smoothing(1.5), "smoothing"),
        ] {
            let e = g.check().unwrap_err().to_string();
            assert!(e.contains(word), "{e}");
        }
        for (a, word) in [
            (Aimd::new().backoff(1.0), "backoff"),
            (Aimd::new().backoff(f64::INFINITY), "backoff"),
            (Aimd::new().increase(0.0), "increase"),
        ] {
            let e = a.check().unwrap_err().to_string();
            assert!(e.contains(word), "{e}");
        }
        assert!(
            Gradient::new()
                .tolerance(1.0)
                .smoothing(1.0)
                .check()
                .is_ok()
        );
        assert!(Aimd::new().backoff(0.5).increase(0.1).check().is_ok());
    }
}
