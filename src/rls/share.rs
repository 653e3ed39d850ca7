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
//!
//! [`Streams`] holds the streams of every bucket, and answers each report with the stream's
//! share.

/// A stream's demand for a bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Demand {
    /// Requests per second (allowed and denied) in its last report.
    Known(f64),
    /// No report with time in it yet.
    Unknown,
}

impl Demand {
    /// A report's demand: `allowed + denied` requests over `elapsed`. Unknown when no time
    /// elapsed (Envoy's first report of a bucket, sent at its first request, says 0 s).
    pub(crate) fn from_report(allowed: u64, denied: u64, elapsed: std::time::Duration) -> Self {
        let secs = elapsed.as_secs_f64();
        if secs > 0.0 {
            Demand::Known(allowed.saturating_add(denied) as f64 / secs)
        } else {
            Demand::Unknown
        }
    }
}

/// How long a stream's demand for a bucket counts without a new report: past it, the stream
/// is taken to have stopped asking for the bucket (Envoy reports every bucket it holds every
/// 5 s; one that stopped reporting holds an assignment that has expired by then), and its
/// share goes back to the others.
pub(crate) const STALE: std::time::Duration = std::time::Duration::from_secs(30);

/// One stream's place in a bucket's split.
#[derive(Debug, Clone, Copy)]
struct Member {
    stream: u64,
    demand: Demand,
    seen: std::time::Instant,
}

/// The streams that report each bucket, with their last demand: what a bucket's limit is split
/// between. Shared by every stream of a server; reports come every few seconds per stream, so
/// one lock serves them (a split is computed under it, from one consistent view).
#[derive(Default)]
pub(crate) struct Streams<K> {
    buckets: std::sync::Mutex<std::collections::HashMap<K, Vec<Member>>>,
}

impl<K: std::hash::Hash + Eq + Clone> Streams<K> {
    /// Records `stream`'s demand for `bucket` at `now`, as [`report`](Self::report) does,
    /// without a split.
    pub(crate) fn record(&self, bucket: &K, stream: u64, demand: Demand, now: std::time::Instant) {
        self.report(bucket, stream, demand, now, &[], []);
    }

    /// Records `stream`'s demand for `bucket` at `now` (joining it if new; streams not heard
    /// from for [`STALE`] leave it) and returns its share of each of `limits`, split with the
    /// bucket's other streams as they are now, and with `elsewhere`: the demands of the
    /// bucket's streams on other servers, which take their shares of the same limits. The
    /// first limit (a rate) is split max-min fair by demand; each other (a burst) in
    /// proportion to the first's shares, so that a stream holds the same part of each (by
    /// demand alone when the first is 0).
    pub(crate) fn report<const N: usize>(
        &self,
        bucket: &K,
        stream: u64,
        demand: Demand,
        now: std::time::Instant,
        elsewhere: &[Demand],
        limits: [u32; N],
    ) -> [u32; N] {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let streams = buckets.entry(bucket.clone()).or_default();
        streams.retain(|m| m.stream == stream || now.saturating_duration_since(m.seen) < STALE);
        let at = match streams.iter().position(|m| m.stream == stream) {
            Some(at) => {
                streams[at].demand = demand;
                streams[at].seen = now;
                at
            }
            None => {
                streams.push(Member {
                    stream,
                    demand,
                    seen: now,
                });
                streams.len() - 1
            }
        };
        let demands: Vec<Demand> = (streams.iter().map(|m| m.demand))
            .chain(elsewhere.iter().copied())
            .collect();
        let Some(&first) = limits.first() else {
            return limits;
        };
        let shares = split(first, &demands);
        let weights: Vec<f64> = shares.iter().map(|&s| f64::from(s)).collect();
        let mut nth = 0;
        limits.map(|limit| {
            nth += 1;
            if nth == 1 {
                shares[at]
            } else if first == 0 {
                split(limit, &demands)[at]
            } else {
                proportional(limit, &weights)[at]
            }
        })
    }

    #[cfg(test)]
    /// Every stream's share of `limit` for `bucket` now, by stream (with `elsewhere`'s streams
    /// taking theirs, not listed).
    pub(crate) fn shares(&self, bucket: &K, elsewhere: &[Demand], limit: u32) -> Vec<(u64, u32)> {
        let buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let Some(streams) = buckets.get(bucket) else {
            return Vec::new();
        };
        let demands: Vec<Demand> = (streams.iter().map(|m| m.demand))
            .chain(elsewhere.iter().copied())
            .collect();
        (streams.iter().map(|m| m.stream))
            .zip(split(limit, &demands))
            .collect()
    }

    /// The demands of `bucket`'s streams heard from within [`STALE`] of `now`: what this
    /// server tells the others (see [`report`](Self::report)'s `elsewhere`).
    pub(crate) fn demands(&self, bucket: &K, now: std::time::Instant) -> Vec<Demand> {
        let buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        (buckets.get(bucket).into_iter().flatten())
            .filter(|m| now.saturating_duration_since(m.seen) < STALE)
            .map(|m| m.demand)
            .collect()
    }

    /// `stream` closed: it leaves `buckets`, returning its shares to the others (at their next
    /// report); a bucket left with no stream is forgotten.
    pub(crate) fn leave<'b>(&self, stream: u64, buckets: impl IntoIterator<Item = &'b K>)
    where
        K: 'b,
    {
        let mut all = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        for bucket in buckets {
            if let Some(streams) = all.get_mut(bucket) {
                streams.retain(|m| m.stream != stream);
                if streams.is_empty() {
                    all.remove(bucket);
                }
            }
        }
    }

    #[cfg(test)]
    /// How many buckets have streams.
    pub(crate) fn len(&self) -> usize {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
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

/// Splits `limit` in proportion to `weights` (not all 0), in whole tokens adding up to it.
fn proportional(limit: u32, weights: &[f64]) -> Vec<u32> {
    let total: f64 = weights.iter().sum();
    let shares: Vec<f64> = (weights.iter())
        .map(|w| f64::from(limit) * w / total)
        .collect();
    whole(limit, &shares)
}

/// Rounds `shares` (adding up to `limit`, but for floating-point error) to whole tokens that
/// add up to `limit` exactly: each share's floor, then one more token to the largest
/// remainders (the property test checks the sum).
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
    // The floors add up to at most the limit (their sum is at most the shares', which is the
    // limit but for error far below a token): the tokens missing go to the largest remainders.
    let missing = u64::from(limit).saturating_sub(given) as usize;
    for &i in order.iter().cycle().take(missing) {
        out[i] += 1;
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

    #[test]
    fn demand_from_a_report() {
        use std::time::Duration;
        assert_eq!(Demand::from_report(1, 0, Duration::ZERO), Unknown);
        assert_eq!(
            Demand::from_report(400, 100, Duration::from_secs(5)),
            Known(100.0)
        );
    }

    /// Streams joining, reporting and leaving one bucket: each report answers the stream's
    /// share of the split as it is; a stream that leaves returns its share, as does one not
    /// heard from for `STALE`; streams on other servers take their shares.
    #[test]
    fn streams_join_report_and_leave() {
        let s = Streams::<&str>::default();
        let t0 = std::time::Instant::now();
        let at = |secs: u64| t0 + std::time::Duration::from_secs(secs);
        assert_eq!(s.report(&"b", 1, Unknown, at(0), &[], [1200]), [1200]);
        // A second stream, demand unknown: half, not nothing.
        assert_eq!(s.report(&"b", 2, Unknown, at(0), &[], [1200]), [600]);
        assert_eq!(s.report(&"b", 1, Known(1000.0), at(5), &[], [1200]), [600]);
        // Asking 1 100 in all: met, and the 100 left shared as headroom; a second limit (a
        // burst) in the same proportion (1/8 of 12: 1.5, the tie's token to the earlier).
        assert_eq!(
            s.report(&"b", 2, Known(100.0), at(5), &[], [1200, 12]),
            [150, 1]
        );
        assert_eq!(
            s.report(&"b", 1, Known(1000.0), at(5), &[], [1200, 12]),
            [1050, 11]
        );
        assert_eq!(s.shares(&"b", &[], 1200), [(1, 1050), (2, 150)]);
        assert_eq!(s.demands(&"b", at(5)), [Known(1000.0), Known(100.0)]);
        // A stream on another server asking as much as stream 1: the three split the limit.
        assert_eq!(
            s.report(&"b", 1, Known(1000.0), at(10), &[Known(1000.0)], [1200]),
            [550]
        );
        s.leave(2, [&"b"]);
        assert_eq!(s.shares(&"b", &[], 1200), [(1, 1200)]);
        // Stream 1 goes quiet: 30 s after its last report, a new stream's report finds it
        // gone, and has the whole limit.
        assert_eq!(s.report(&"b", 3, Unknown, at(39), &[], [1200]), [600]);
        assert_eq!(s.report(&"b", 3, Unknown, at(40), &[], [1200]), [1200]);
        assert!(s.demands(&"b", at(71)).is_empty());
        s.leave(3, [&"b", &"never reported"]);
        assert_eq!(s.len(), 0);
    }

    /// Threads at once, each a stream reporting random demands on many buckets: after each
    /// report, and at the end, the shares of every bucket add up to its limit; when every
    /// stream has left, nothing is held.
    #[test]
    fn under_concurrency_the_shares_add_up() {
        use std::sync::Arc;
        let streams = Arc::new(Streams::<u32>::default());
        let buckets = 50u32;
        let limit = |b: u32| 100 + b * 7;
        let threads: Vec<_> = (0..8u64)
            .map(|stream| {
                let streams = streams.clone();
                std::thread::spawn(move || {
                    let mut x = stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    for _ in 0..2_000 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let b = (x % u64::from(buckets)) as u32;
                        let demand = if x % 5 == 0 {
                            Unknown
                        } else {
                            Known((x >> 20) as f64 % 1_000.0)
                        };
                        let now = std::time::Instant::now();
                        let [share] = streams.report(&b, stream, demand, now, &[], [limit(b)]);
                        assert!(share <= limit(b));
                        let shares = streams.shares(&b, &[], limit(b));
                        let total: u32 = shares.iter().map(|s| s.1).sum();
                        assert_eq!(total, limit(b));
                    }
                    stream
                })
            })
            .collect();
        let done: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for b in 0..buckets {
            let shares = streams.shares(&b, &[], limit(b));
            if !shares.is_empty() {
                assert_eq!(shares.iter().map(|s| s.1).sum::<u32>(), limit(b));
            }
        }
        let all: Vec<u32> = (0..buckets).collect();
        for stream in done {
            streams.leave(stream, &all);
        }
        assert_eq!(streams.len(), 0);
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
