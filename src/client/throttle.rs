//! Client-side adaptive throttling (Google's SRE book, "Handling Overload"): a client that
//! sees its upstream accept too few of its calls refuses some itself, before sending them.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, StatusCode};

use super::window::Counts;
use crate::ConfigError;

/// Adaptive throttling of the calls to one upstream, shared by every call to it (cheap to
/// clone: clones share the counts).
///
/// Over a sliding window (250 ms by default, see [`DEFAULT_WINDOW`]) it counts the
/// calls whose outcome is known (`requests`: answered, failed, or refused here) and those the
/// upstream accepted (`accepts`), and refuses a new call with probability
///
/// ```text
/// max(0, (requests − K × accepts) / (requests + 1))      K = 2 by default
/// ```
///
/// so that the upstream receives about K times what it accepts, however much more the
/// callers offer: the rest is refused here, at no cost to the upstream. While every call is
/// accepted nothing is refused: `requests − K × accepts` is negative. A call refused here
/// counts as a request not accepted, so the throttle holds while it refuses (counting only
/// the calls sent would let it fall to zero and rise again, in waves).
///
/// Accepted: an answer of the upstream that is not about its load: `2xx`, `3xx`, and `4xx`
/// other than `429`; for gRPC, any status but `RESOURCE_EXHAUSTED`, `UNAVAILABLE`,
/// `DEADLINE_EXCEEDED`, `ABORTED` and `INTERNAL` and `UNKNOWN` ([`accepted`]). Not accepted:
/// `429`, `5xx`, those gRPC codes, a failed call (no answer: refused, reset, timed out) and
/// a call given up before its answer (a [`ThrottleTicket`] dropped).
///
/// A call in flight counts when its answer comes, so a burst of calls at start-up, none
/// answered yet, is never refused.
///
/// ```
/// use tollgate::client::Throttle;
///
/// let throttle = Throttle::new();
/// // The upstream accepts every call: nothing is refused.
/// for _ in 0..100 {
///     let ticket = throttle.admit().expect("never refused while all are accepted");
///     ticket.observe(http::StatusCode::OK, &http::HeaderMap::new());
/// }
/// // Now it refuses every call: soon about half of them are refused here (K = 2:
/// // the upstream sees about twice what it accepts, here 100 accepted in the window).
/// let mut refused = 0;
/// for _ in 0..1000 {
///     match throttle.admit() {
///         Ok(ticket) => ticket.not_accepted(),
///         Err(_) => refused += 1,
///     }
/// }
/// assert!(refused > 500, "{refused}");
/// ```
#[derive(Clone)]
pub struct Throttle {
    inner: Arc<Inner>,
}

struct Inner {
    /// `[requests, accepts]`.
    counts: Counts,
    k: f64,
    window: Duration,
    /// The upstream's name, for metrics.
    name: Arc<str>,
}

impl std::fmt::Debug for Throttle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [requests, accepts] = self.inner.counts.sums();
        f.debug_struct("Throttle")
            .field("name", &self.inner.name)
            .field("k", &self.inner.k)
            .field("window", &self.inner.window)
            .field("requests", &requests)
            .field("accepts", &accepts)
            .finish()
    }
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle::new()
    }
}

/// The window of [`Throttle::new`], 250 ms. Measured with `examples/retry_storm`
/// (BENCHMARKS.md, "Retry storms"): after a spike of 10× the upstream's capacity ended, the
/// clients were back to full goodput in the second second with it; with 500 ms, at 94 % in
/// the second second and full in the third; with 1 s or 2 s, at about 90 % in the fifth;
/// with the SRE book's 2 minutes, at under 20 % throughout the run. Calls refused here count
/// as not accepted, so refusals fade only as calls get through again, and a longer window
/// fades slower. At 10× the upstream received about 2× what it accepted with every window.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(250);

impl Throttle {
    /// K = 2 over a 250-ms window ([`DEFAULT_WINDOW`]).
    pub fn new() -> Self {
        Throttle::builder()
            .build()
            .unwrap_or_else(|_| unreachable!("the defaults are valid"))
    }

    /// Starts configuring a throttle.
    pub fn builder() -> ThrottleBuilder {
        ThrottleBuilder {
            k: 2.0,
            window: DEFAULT_WINDOW,
            name: Arc::from("default"),
        }
    }

    /// Decides a call now: `Ok` with the ticket to report its outcome on, or [`Throttled`]
    /// (counted as a request the upstream did not accept: never sent).
    pub fn admit(&self) -> Result<ThrottleTicket, Throttled> {
        let k = self.inner.k;
        let draw = fastrand::f64();
        let refused = self.inner.counts.with(|[requests, accepts], now| {
            let p = refusal(requests, accepts, k);
            let refused = p > 0.0 && draw < p;
            if refused {
                now[0] = now[0].saturating_add(1);
            }
            refused.then_some(p)
        });
        match refused {
            Some(probability) => {
                crate::metrics::client_throttled(&self.inner.name);
                Err(Throttled { probability })
            }
            None => Ok(ThrottleTicket {
                throttle: Some(self.inner.clone()),
            }),
        }
    }

    /// The probability a call made now is refused.
    pub fn probability(&self) -> f64 {
        let [requests, accepts] = self.inner.counts.sums();
        refusal(requests, accepts, self.inner.k)
    }

    /// The window's counts now: calls with a known outcome, and those accepted.
    pub fn counts(&self) -> (u64, u64) {
        let [requests, accepts] = self.inner.counts.sums();
        (requests, accepts)
    }
}

/// `max(0, (requests − K × accepts) / (requests + 1))`.
fn refusal(requests: u64, accepts: u64, k: f64) -> f64 {
    let over = requests as f64 - k * accepts as f64;
    if over <= 0.0 {
        0.0
    } else {
        over / (requests as f64 + 1.0)
    }
}

/// Configures a [`Throttle`].
#[derive(Debug, Clone)]
pub struct ThrottleBuilder {
    k: f64,
    window: Duration,
    name: Arc<str>,
}

impl ThrottleBuilder {
    /// The upstream's name, the `upstream` label of `tollgate_client_throttled_total`
    /// (default `default`). One per upstream: a name per host, never per request.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// K: the upstream receives about K times what it accepts (default 2, the SRE book's;
    /// at least 1). Lower refuses sooner and wastes less of the upstream's work on refusals;
    /// higher leaves more room for the upstream to recover by itself.
    pub fn k(mut self, k: f64) -> Self {
        self.k = k;
        self
    }

    /// How far back the counts go (default [`DEFAULT_WINDOW`], 250 ms; at least 100 ms). A
    /// shorter window follows the upstream sooner, both ways; a longer one has more calls to
    /// decide from at low rates.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Checks the options.
    pub fn build(self) -> Result<Throttle, ConfigError> {
        if !(self.k.is_finite() && self.k >= 1.0) {
            return Err(ConfigError::Invalid {
                option: "k",
                reason: format!("K must be a number of at least 1, not {}", self.k),
            });
        }
        Counts::check(self.window)?;
        Ok(Throttle {
            inner: Arc::new(Inner {
                counts: Counts::new(self.window),
                k: self.k,
                window: self.window,
                name: self.name,
            }),
        })
    }
}

/// A call the [`Throttle`] let through: report its outcome with
/// [`observe`](Self::observe), [`accepted`](Self::accepted) or
/// [`not_accepted`](Self::not_accepted). Dropped without one, the call counts as not
/// accepted (given up before an answer: a timeout, a cancellation).
#[derive(Debug)]
#[must_use = "a ticket dropped without an outcome counts as a call not accepted"]
pub struct ThrottleTicket {
    throttle: Option<Arc<Inner>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttle").finish_non_exhaustive()
    }
}

impl ThrottleTicket {
    /// Reports the upstream's answer, accepted or not as [`accepted`] says; returns whether
    /// it was accepted.
    pub fn observe(self, status: StatusCode, headers: &HeaderMap) -> bool {
        let ok = accepted(status, headers);
        self.finish(ok);
        ok
    }

    /// The upstream accepted the call.
    pub fn accepted(self) {
        self.finish(true);
    }

    /// The upstream did not accept the call (refused it for load, failed, or did not answer).
    pub fn not_accepted(self) {
        self.finish(false);
    }

    /// Counts nothing: a call that never reached the upstream after all (cancelled before it
    /// was sent).
    pub(crate) fn forget(mut self) {
        self.throttle = None;
    }

    fn finish(mut self, accepted: bool) {
        if let Some(t) = self.throttle.take() {
            t.counts.add(1, u64::from(accepted));
        }
    }
}

impl Drop for ThrottleTicket {
    fn drop(&mut self) {
        if let Some(t) = self.throttle.take() {
            t.counts.add(1, 0);
        }
    }
}

/// Whether an answer counts as accepted by the upstream (see [`Throttle`]): `1xx`–`4xx` but
/// `429`; for gRPC (a `grpc-status` in the headers: a trailers-only answer, as servers send
/// errors), any code but `RESOURCE_EXHAUSTED` (8), `ABORTED` (10), `INTERNAL` (13),
/// `UNAVAILABLE` (14), `DEADLINE_EXCEEDED` (4) and `UNKNOWN` (2). A gRPC status sent in
/// trailers after a body is not seen here: such a call counts as accepted.
pub fn accepted(status: StatusCode, headers: &HeaderMap) -> bool {
    if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
        return false;
    }
    !matches!(
        headers.get("grpc-status").map(http::HeaderValue::as_bytes),
        Some(b"8" | b"10" | b"13" | b"14" | b"4" | b"2")
    )
}

/// A call refused by a [`Throttle`], never sent: its upstream has lately accepted too few of
/// the calls made to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Throttled {
    pub(crate) probability: f64,
}

impl Throttled {
    /// The probability of refusal the call met.
    pub fn probability(&self) -> f64 {
        self.probability
    }
}

impl std::fmt::Display for Throttled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "throttled by the client: the upstream accepted too few recent calls ({:.0} % of \
             calls refused here)",
            self.probability * 100.0
        )
    }
}

impl std::error::Error for Throttled {}

// A probability is never NaN.
impl Eq for Throttled {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_formula() {
        assert_eq!(refusal(0, 0, 2.0), 0.0);
        assert_eq!(refusal(10, 10, 2.0), 0.0);
        assert_eq!(refusal(10, 5, 2.0), 0.0);
        assert!((refusal(99, 10, 2.0) - 0.79).abs() < 1e-9);
        assert!((refusal(1000, 0, 2.0) - 1000.0 / 1001.0).abs() < 1e-9);
    }

    #[tokio::test(start_paused = true)]
    async fn the_upstream_sees_about_k_times_what_it_accepts() {
        let t = Throttle::new();
        // An upstream that can take 100 calls a second (a bucket of 10 filling at 0.1 a ms),
        // offered 1 000 a second for 10 s.
        let (mut sent, mut accepted_n, mut tokens) = (0u64, 0u64, 10.0f64);
        for _ in 0..10_000 {
            tokens = (tokens + 0.1).min(10.0);
            if let Ok(ticket) = t.admit() {
                sent += 1;
                if tokens >= 1.0 {
                    tokens -= 1.0;
                    accepted_n += 1;
                    ticket.accepted();
                } else {
                    ticket.not_accepted();
                }
            }
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        let ratio = sent as f64 / accepted_n as f64;
        assert!(
            (1.5..=2.5).contains(&ratio),
            "sent {sent} accepted {accepted_n}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_are_forgotten_a_window_after_the_upstream_recovers() {
        let t = Throttle::new();
        for _ in 0..1000 {
            if let Ok(ticket) = t.admit() {
                ticket.not_accepted();
            }
        }
        assert!(t.probability() > 0.9);
        tokio::time::advance(DEFAULT_WINDOW).await;
        assert_eq!(t.probability(), 0.0);
    }

    #[test]
    fn in_flight_calls_do_not_count_until_answered() {
        let t = Throttle::new();
        let tickets: Vec<_> = (0..1000).map(|_| t.admit().unwrap()).collect();
        assert_eq!(t.counts(), (0, 0));
        for ticket in tickets {
            ticket.accepted();
        }
        assert_eq!(t.counts(), (1000, 1000));
        // Dropped: not accepted.
        drop(t.admit().unwrap());
        assert_eq!(t.counts(), (1001, 1000));
    }

    /// Threads deciding and answering at once on one throttle: no count is lost, and while
    /// every call is accepted none is refused.
    #[test]
    fn counts_hold_under_concurrent_calls() {
        let t = Throttle::builder()
            .window(Duration::from_secs(3600))
            .build()
            .unwrap();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..5_000 {
                        t.admit().expect("never refused").accepted();
                    }
                });
            }
        });
        assert_eq!(t.counts(), (40_000, 40_000));
        assert_eq!(t.probability(), 0.0);
    }

    #[test]
    fn what_counts_as_accepted() {
        let h = HeaderMap::new();
        for code in [200, 204, 301, 400, 404, 409] {
            assert!(accepted(StatusCode::from_u16(code).unwrap(), &h), "{code}");
        }
        for code in [429, 500, 502, 503, 504] {
            assert!(!accepted(StatusCode::from_u16(code).unwrap(), &h), "{code}");
        }
        let grpc = |code: &str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-status", code.parse().unwrap());
            accepted(StatusCode::OK, &h)
        };
        assert!(grpc("0") && grpc("5") && grpc("3") && grpc("7"));
        assert!(!grpc("8") && !grpc("14") && !grpc("4"));
    }

    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Call,
        Answer(usize),
        Advance(u64),
    }

    proptest! {
        /// However calls start, overlap and end, and time passes: while the upstream accepts
        /// every call it answers, the throttle refuses none (calls in flight count only when
        /// answered, so a burst at start-up is never refused).
        #[test]
        fn never_refuses_while_every_call_is_accepted(
            ops in proptest::collection::vec(
                prop_oneof![
                    4 => Just(Op::Call),
                    3 => (0usize..64).prop_map(Op::Answer),
                    1 => (1u64..400).prop_map(Op::Advance),
                ],
                1..500,
            )
        ) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            rt.block_on(async {
                let t = Throttle::new();
                let mut in_flight = Vec::new();
                for op in ops {
                    match op {
                        Op::Call => match t.admit() {
                            Ok(ticket) => in_flight.push(ticket),
                            Err(e) => prop_assert!(false, "refused: {}", e),
                        },
                        Op::Answer(i) if !in_flight.is_empty() => {
                            let ticket = in_flight.swap_remove(i % in_flight.len());
                            ticket.accepted();
                        }
                        Op::Answer(_) => {}
                        Op::Advance(ms) => {
                            tokio::time::advance(Duration::from_millis(ms)).await;
                        }
                    }
                }
                for ticket in in_flight {
                    ticket.accepted();
                }
                prop_assert_eq!(t.probability(), 0.0);
                Ok(())
            })?;
        }
    }

    #[test]
    fn bad_options_are_named() {
        let e = Throttle::builder().k(0.5).build().unwrap_err();
        assert!(e.to_string().contains("k"), "{e}");
        let e = Throttle::builder()
            .window(Duration::ZERO)
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
    }
}
