//! How a bucket's limit is split between the streams that report it (Envoy's rate limit quota
//! service, issue 57): max-min fair by demand, in whole tokens per second that add up to the
//! limit.
//!
//! Each stream (one Envoy) reports, per bucket, the requests it allowed and denied over the
//! last few seconds: its demand. The limit is shared out by water-filling: a stream asking for
//! less than an equal share gets what it asks, and what it leaves is split between the others
//! the same way, so that no stream that asks for more than it gets holds less than another
//! (but for the rounding to whole tokens). A stream whose demand is not known yet (a new
//! stream, before its first report with time in it) counts as asking for an equal share: a
//! split that ignored it would hand the known streams everything, and the first Envoy of a
//! fleet the whole limit. When the streams ask for less than the limit in all, what is left is
//! shared equally as headroom, so that the shares always add up to the limit and a stream can
//! grow until the next report.

/// A stream's demand for a bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Demand {
    /// Requests per second (allowed and denied) in its last report.
    Known(f64),
    /// No report with time in it yet.
    Unknown,
}

/// Splits `limit` tokens per second between the streams of `demands`, in their order: shares
/// that add up to `limit` exactly (none without streams), max-min fair by demand (see the
/// module docs), rounded by largest remainder (ties to the earlier stream).
pub(crate) fn split(limit: u32, demands: &[Demand]) -> Vec<u32> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let total = f64::from(limit);
    let equal = total / n as f64;
    // What each stream asks for; an unknown (or unreadable) demand is an equal share.
    let asks: Vec<f64> = (demands.iter())
        .map(|d| match *d {
            Demand::Known(rate) if rate.is_finite() && rate >= 0.0 => rate,
            _ => equal,
        })
        .collect();
    // Water-filling: the smallest asks are met first; the rest share what is left equally.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| asks[a].total_cmp(&asks[b]));
    let mut shares = vec![0.0; n];
    let mut left = total;
    for (done, &i) in order.iter().enumerate() {
        let level = left / (n - done) as f64;
        let give = asks[i].min(level);
        shares[i] = give;
        left -= give;
    }
    // Every ask met with some to spare: headroom, shared equally.
    if left > 0.0 {
        let each = left / n as f64;
        for s in &mut shares {
            *s += each;
        }
    }
    whole(limit, &shares)
}

/// Rounds `shares` (adding up to `limit`, but for floating-point error) to whole tokens that
/// add up to `limit` exactly: each share's floor, then one more token to the largest
/// remainders.
fn whole(limit: u32, shares: &[f64]) -> Vec<u32> {
    let mut out: Vec<u32> = (shares.iter())
        .map(|s| (s.max(0.0).floor() as u64).min(u64::from(limit)) as u32)
        .collect();
    let given: u64 = out.iter().map(|&s| u64::from(s)).sum();
    let mut order: Vec<usize> = (0..shares.len()).collect();
    // Largest remainder first; ties to the earlier stream (a stable sort). Remainders are
    // compared in billionths: equal shares computed along different paths differ in their last
    // bits, which must not decide who gets a token.
    let remainder = |i: usize| ((shares[i] - shares[i].floor()) * 1e9).round() as i64;
    order.sort_by_key(|&i| std::cmp::Reverse(remainder(i)));
    if given <= u64::from(limit) {
        let mut missing = u64::from(limit) - given;
        // More than one round only when error left the floors far below the limit.
        while missing > 0 {
            for &i in &order {
                if missing == 0 {
                    break;
                }
                out[i] += 1;
                missing -= 1;
            }
        }
    } else {
        // Floating-point error past the limit: take back from the smallest remainders.
        let mut extra = given - u64::from(limit);
        while extra > 0 {
            for &i in order.iter().rev() {
                if extra == 0 {
                    break;
                }
                if out[i] > 0 {
                    out[i] -= 1;
                    extra -= 1;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use Demand::{Known, Unknown};
    use proptest::prelude::*;

    #[test]
    fn the_anchor_cases() {
        // One stream: everything.
        assert_eq!(split(1200, &[Known(600.0)]), [1200]);
        // Four equal streams asking for more than the limit: 300 each (Envoy 1.40 measured
        // this split enforced exactly: 300/300/300/300).
        assert_eq!(split(1200, &[Known(600.0); 4]), [300; 4]);
        // 70/10/10/10 of 2x the limit: the small ones get what they ask (240 each), the big
        // one the rest.
        let d = [Known(1680.0), Known(240.0), Known(240.0), Known(240.0)];
        assert_eq!(split(1200, &d), [480, 240, 240, 240]);
        // A new stream beside a busy one: an equal share, not nothing (and the busy one not
        // the whole limit).
        assert_eq!(split(1200, &[Known(1000.0), Unknown]), [600, 600]);
        // Asking less than the limit in all: headroom shared equally.
        assert_eq!(split(100, &[Known(10.0), Known(30.0)]), [40, 60]);
        // Fewer tokens than streams: whole tokens to the largest asks... of equal remainder,
        // the earlier streams.
        assert_eq!(split(2, &[Known(5.0), Known(5.0), Known(5.0)]), [1, 1, 0]);
        assert_eq!(split(0, &[Known(5.0), Unknown]), [0, 0]);
        assert!(split(10, &[]).is_empty());
        // Garbage demand counts as unknown.
        assert_eq!(split(10, &[Known(f64::NAN), Known(-1.0)]), [5, 5]);
    }

    fn demand() -> impl Strategy<Value = Demand> {
        prop_oneof![
            1 => Just(Unknown),
            4 => (0.0f64..5_000.0).prop_map(Known),
        ]
    }

    proptest! {
        /// The shares add up to the limit; a stream that gets less than it asks (by more than
        /// the rounding) holds no less than any other stream (max-min fairness); a stream
        /// asking for at most an equal share gets at least what it asks, rounded down.
        #[test]
        fn shares_add_up_and_are_max_min_fair(
            limit in 0u32..100_000,
            demands in proptest::collection::vec(demand(), 1..40),
        ) {
            let shares = split(limit, &demands);
            prop_assert_eq!(shares.len(), demands.len());
            prop_assert_eq!(shares.iter().map(|&s| u64::from(s)).sum::<u64>(), u64::from(limit));
            let equal = f64::from(limit) / demands.len() as f64;
            let asks: Vec<f64> = demands.iter().map(|d| match d {
                Known(r) => *r,
                Unknown => equal,
            }).collect();
            let max = *shares.iter().max().unwrap();
            for (i, &s) in shares.iter().enumerate() {
                if f64::from(s) + 1.0 < asks[i] {
                    // Short of its ask: no one holds more than one token over it.
                    prop_assert!(max <= s + 1, "{shares:?} for {asks:?}");
                }
                if asks[i] <= equal {
                    // Asking at most an equal share: met, but for the rounding.
                    prop_assert!(f64::from(s) >= asks[i].floor(), "{shares:?} for {asks:?}");
                }
            }
        }
    }
}
