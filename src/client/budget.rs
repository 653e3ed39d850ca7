//! Retry budgets: retries that never exceed a share of the calls, as Finagle's and Linkerd's
//! budgets and tower's `TpsBudget` keep them.

use std::sync::Arc;
use std::time::Duration;

use super::window::Counts;
use crate::ConfigError;

/// How many retries the calls to one upstream may make over a window: `ratio` of the first
/// attempts made in it, or `min_per_second` × the window's seconds when that is more (so that
/// a client making few calls can still retry one). Defaults: 10 % over 10 s, at least 1 a
/// second (10 in the window): once a client makes more than 10 calls a second, its retries
/// are at most 10 % of its calls. (Finagle and tower's `TpsBudget` add the minimum to the
/// ratio instead, so their retries exceed the ratio at any rate.) Cheap to clone: clones
/// share the counts.
///
/// Each first attempt [`deposit`](Self::deposit)s; each retry must
/// [`withdraw`](Self::withdraw), which fails when the window's retries would exceed the
/// budget. Both are one step on shared counts: under any interleaving of concurrent calls
/// the retries in a window never exceed `max(minimum, ratio × first attempts)` as they stood
/// when each retry was taken.
///
/// ```
/// use tollgate::client::RetryBudget;
///
/// let budget = RetryBudget::new();
/// for _ in 0..100 {
///     budget.deposit();
/// }
/// // The minimum: 1 a second over 10 s, more than 10 % of 100.
/// let taken = (0..1000).filter(|_| budget.withdraw()).count();
/// assert_eq!(taken, 10);
/// for _ in 0..900 {
///     budget.deposit();
/// }
/// // 10 % of 1 000.
/// let more = (0..1000).filter(|_| budget.withdraw()).count();
/// assert_eq!(taken + more, 100);
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    /// `[first attempts, retries]`.
    counts: Counts,
    ratio: f64,
    reserve: u64,
    window: Duration,
    /// The upstream's name, for metrics.
    name: Arc<str>,
}

impl std::fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [attempts, retries] = self.inner.counts.sums();
        f.debug_struct("RetryBudget")
            .field("name", &self.inner.name)
            .field("ratio", &self.inner.ratio)
            .field("reserve", &self.inner.reserve)
            .field("window", &self.inner.window)
            .field("first_attempts", &attempts)
            .field("retries", &retries)
            .finish()
    }
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget::new()
    }
}

impl RetryBudget {
    /// 10 % of the first attempts over 10 s, at least 1 retry a second.
    pub fn new() -> Self {
        RetryBudget::builder()
            .build()
            .unwrap_or_else(|_| unreachable!("the defaults are valid"))
    }

    /// Starts configuring a budget.
    pub fn builder() -> RetryBudgetBuilder {
        RetryBudgetBuilder {
            ratio: 0.1,
            min_per_second: 1.0,
            window: Duration::from_secs(10),
            name: Arc::from("default"),
        }
    }

    /// A first attempt is made: it adds `ratio` of a retry to the budget.
    pub fn deposit(&self) {
        self.inner.counts.add(1, 0);
    }

    /// Takes a retry from the budget, if there is one left.
    pub fn withdraw(&self) -> bool {
        let (ratio, reserve) = (self.inner.ratio, self.inner.reserve);
        let taken = self.inner.counts.with(|[attempts, retries], now| {
            let allowed = (reserve as f64).max(ratio * attempts as f64);
            if (retries + 1) as f64 <= allowed {
                now[1] = now[1].saturating_add(1);
                true
            } else {
                false
            }
        });
        crate::metrics::client_retry(&self.inner.name, taken);
        taken
    }

    /// Gives back a retry taken and not made (its call was dropped while it waited): counted
    /// off the current slot.
    pub(crate) fn give_back(&self) {
        self.inner
            .counts
            .with(|_, now| now[1] = now[1].saturating_sub(1));
    }

    /// The window's counts now: first attempts, and retries taken.
    pub fn counts(&self) -> (u64, u64) {
        let [attempts, retries] = self.inner.counts.sums();
        (attempts, retries)
    }
}

/// Configures a [`RetryBudget`].
#[derive(Debug, Clone)]
pub struct RetryBudgetBuilder {
    ratio: f64,
    min_per_second: f64,
    window: Duration,
    name: Arc<str>,
}

impl RetryBudgetBuilder {
    /// The upstream's name, the `upstream` label of `tollgate_client_retries_total` (default
    /// `default`). One per upstream: a name per host, never per request.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// Retries per first attempt (default 0.1: 10 %), between 0 and 1000.
    pub fn ratio(mut self, ratio: f64) -> Self {
        self.ratio = ratio;
        self
    }

    /// Retries a second allowed however few the calls (default 1), 0 or more.
    pub fn min_per_second(mut self, n: f64) -> Self {
        self.min_per_second = n;
        self
    }

    /// How far back the counts go (default 10 s; at least 100 ms).
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Checks the options.
    pub fn build(self) -> Result<RetryBudget, ConfigError> {
        if !(self.ratio.is_finite() && (0.0..=1000.0).contains(&self.ratio)) {
            return Err(ConfigError::Invalid {
                option: "ratio",
                reason: format!("the ratio must be between 0 and 1000, not {}", self.ratio),
            });
        }
        if !(self.min_per_second.is_finite() && self.min_per_second >= 0.0) {
            return Err(ConfigError::Invalid {
                option: "min_per_second",
                reason: format!(
                    "the retries a second must be 0 or more, not {}",
                    self.min_per_second
                ),
            });
        }
        Counts::check(self.window)?;
        let reserve = (self.min_per_second * self.window.as_secs_f64()).floor() as u64;
        Ok(RetryBudget {
            inner: Arc::new(Inner {
                counts: Counts::new(self.window),
                ratio: self.ratio,
                reserve,
                window: self.window,
                name: self.name,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test(start_paused = true)]
    async fn a_budget_refills_as_old_retries_leave_the_window() {
        let b = RetryBudget::builder().min_per_second(0.0).build().unwrap();
        assert!(!b.withdraw(), "nothing deposited, no reserve");
        for _ in 0..50 {
            b.deposit();
        }
        assert_eq!((0..10).filter(|_| b.withdraw()).count(), 5);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(
            !b.withdraw(),
            "the deposits left the window with the retries"
        );
    }

    #[test]
    fn never_exceeded_under_concurrent_calls() {
        let b = RetryBudget::builder()
            .window(Duration::from_secs(3600))
            .build()
            .unwrap();
        let taken: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let mut taken = 0;
                        for i in 0..10_000 {
                            b.deposit();
                            if i % 3 == 0 && b.withdraw() {
                                taken += 1;
                            }
                        }
                        taken
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        // 80 000 first attempts: 8 000 retries (more than the minimum of 3 600).
        assert!(taken <= 8_000, "{taken}");
        assert_eq!(b.counts(), (80_000, taken as u64));
        assert!(taken >= 7_000, "{taken}: the budget was there to take");
    }

    #[test]
    fn bad_options_are_named() {
        for (b, name) in [
            (RetryBudget::builder().ratio(-1.0), "ratio"),
            (RetryBudget::builder().ratio(f64::NAN), "ratio"),
            (
                RetryBudget::builder().min_per_second(-1.0),
                "min_per_second",
            ),
            (RetryBudget::builder().window(Duration::ZERO), "window"),
        ] {
            let e = b.build().unwrap_err();
            assert!(e.to_string().contains(name), "{e}");
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Deposit,
        Withdraw,
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Deposit),
            3 => Just(Op::Withdraw),
            1 => (1u64..3_000).prop_map(Op::Advance),
        ]
    }

    proptest! {
        /// Whatever the order of first attempts, retries and time: the retries taken in the
        /// last nine tenths of a window never exceed the minimum or the ratio of the first
        /// attempts made in the whole window, whichever is more (the counts leave a slot, a tenth, at a time).
        #[test]
        fn the_budget_is_never_exceeded(ops in proptest::collection::vec(op(), 1..400)) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            rt.block_on(async {
                let window = Duration::from_secs(10);
                let b = RetryBudget::builder()
                    .ratio(0.2)
                    .min_per_second(0.3)
                    .window(window)
                    .build()
                    .unwrap();
                let start = tokio::time::Instant::now();
                let (mut deposits, mut retries) = (Vec::new(), Vec::new());
                for op in ops {
                    let now = start.elapsed();
                    match op {
                        Op::Deposit => {
                            b.deposit();
                            deposits.push(now);
                        }
                        Op::Withdraw => {
                            if b.withdraw() {
                                retries.push(now);
                                let slot = window / 10;
                                let recent = (retries.iter())
                                    .filter(|t| **t + window - slot > now)
                                    .count();
                                let made = (deposits.iter())
                                    .filter(|t| **t + window > now)
                                    .count();
                                let allowed = (3.0f64).max(0.2 * made as f64);
                                prop_assert!(
                                    recent as f64 <= allowed,
                                    "{recent} retries in the window, {made} first attempts"
                                );
                            }
                        }
                        Op::Advance(ms) => {
                            tokio::time::advance(Duration::from_millis(ms)).await;
                        }
                    }
                }
                Ok(())
            })?;
        }
    }
}
