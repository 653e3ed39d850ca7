//! The Lua script (`gcra.lua`: GCRA, fixed and sliding windows), its arguments, and how its
//! reply becomes a [`Decision`].

use std::num::NonZeroU32;
use std::sync::LazyLock;
use std::time::Duration;

use smallvec::SmallVec;

use crate::BackendError;
use crate::backend::remote::reply::{self, nonneg, protocol};
use crate::backend::window::Code;
use crate::backend::{Decision, Mode, Outcome, QuotaState};
#[cfg(feature = "calendar")]
use crate::quota::CalendarClock;
use crate::quota::{QuotaKind, QuotaParams};

/// The script source, also used by `scripts/bench-redis-ceiling.sh`.
pub(crate) const SOURCE: &str = include_str!("gcra.lua");

/// One script object for the process: redis-rs computes its SHA-1 once, sends `EVALSHA`, and on
/// `NOSCRIPT` (after a restart, a failover or `SCRIPT FLUSH`) loads it and retries once.
pub(crate) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(SOURCE));

/// Integers per quota in the script's arguments.
pub(crate) const PER_QUOTA: usize = 4;

/// Integers per quota in the script's reply: GCRA 2 (code, TAT), fixed window 3 (code, count,
/// time to the window's end), sliding window 4 (code, remaining, reset, retry).
pub(crate) fn reply_len(params: &[QuotaParams]) -> usize {
    params.iter().map(quota_reply_len).sum()
}

fn quota_reply_len(p: &QuotaParams) -> usize {
    match p.kind {
        QuotaKind::Gcra => 2,
        QuotaKind::FixedWindow { .. } => 3,
        #[cfg(feature = "calendar")]
        QuotaKind::Calendar { .. } => 3,
        QuotaKind::SlidingWindow { .. } => 4,
        QuotaKind::Concurrent { .. } => 2,
    }
}

/// The script's code for a decision whose keys Redis refused (the other codes are the shared
/// ones of [`reply`]).
const REFUSED: i64 = 4;

/// A quota's four numbers in the script's arguments: `kind, a, b, c` (see `gcra.lua`).
fn quota_args(p: &QuotaParams) -> [u64; PER_QUOTA] {
    let limit = u64::from(p.burst.get());
    match p.kind {
        QuotaKind::FixedWindow { window_us } => [1, window_us, limit, 0],
        QuotaKind::SlidingWindow { slice_us, slices } => [2, slice_us, limit, u64::from(slices)],
        QuotaKind::Gcra => [0, p.emission_ns, limit, 0],
        QuotaKind::Concurrent { lease_ms } => [3, lease_ms, limit, 0],
        // The boundary and the windows' lengths are the call's (`calendar_args`); the
        // calendar's id rides above the limit's 32 bits.
        #[cfg(feature = "calendar")]
        QuotaKind::Calendar { calendar } => [5, 0, limit | calendar.clock().id() << 32, 0],
    }
}

/// The calendar quotas of a policy's arguments: the position of each one's first number
/// after the kind (in `policy_args`' output), and its calendar.
#[cfg(feature = "calendar")]
pub(crate) fn calendar_slots(params: &[QuotaParams]) -> Vec<(usize, CalendarClock)> {
    (params.iter().enumerate())
        .filter_map(|(i, p)| match p.kind {
            QuotaKind::Calendar { calendar } => Some((2 + PER_QUOTA * i, calendar.clock())),
            _ => None,
        })
        .collect()
}

/// A calendar quota's numbers of a call at `now_us` (`CalendarClock::call_us`): the boundary
/// nearest it (seconds since the epoch), and the lengths of the windows before and
/// after it in seconds, packed `before * 2^26 + after` (each under 2^25). The script picks the
/// window that holds Redis's time (see `gcra.lua`).
#[cfg(feature = "calendar")]
pub(crate) fn calendar_args(calendar: &CalendarClock, now_us: u64) -> (u64, u64) {
    let a = calendar.around_call(now_us);
    (a.boundary_s, a.before_s << 26 | a.after_s)
}

/// A policy's entry in the script's arguments, formatted once in `prepare()`: the number of
/// quotas, then four numbers per quota; a policy that blocks keys once refused has one more,
/// `4 block 1 mask` (the block's length in µs, and the quotas whose refusal starts it: a bit
/// each, 0 for all), last.
pub(crate) fn policy_args(
    params: &[QuotaParams],
    on_change: crate::quota::OnChange,
    block: Option<(u64, u64)>,
) -> Vec<Vec<u8>> {
    let block = block.map(|(us, mask)| [4, us, 1, mask]);
    // The kind carries the strategy times 8.
    let strategy = 8 * u64::from(on_change.code());
    std::iter::once((params.len() + usize::from(block.is_some())) as u64)
        .chain(params.iter().flat_map(|p| {
            let mut args = quota_args(p);
            args[0] += strategy;
            args
        }))
        .chain(block.into_iter().flatten())
        .map(|n| hex(n).as_bytes().to_vec())
        .collect()
}

/// A number as the script's arguments write it: lowercase hexadecimal, which the script parses
/// with `strtoul` (decimal would go through `strtod`, several times dearer in Redis's CPU).
pub(crate) fn hex(n: u64) -> Hex {
    let mut buf = [0; 16];
    let mut i = buf.len();
    let mut n = n;
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[(n & 15) as usize];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    Hex { buf, start: i }
}

/// A formatted [`hex`] number, on the stack.
pub(crate) struct Hex {
    buf: [u8; 16],
    start: usize,
}

impl Hex {
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

/// The decisions of a call, in the script's arguments: runs of consecutive decisions with the
/// same policy (1-based, in the call's list), cost and mode, as `count policy cost arg op`,
/// so that a busy call on one policy (the usual case) carries five numbers, not four per
/// decision. `op` and `arg` (see `gcra.lua`): 0 a decision, `arg` a reservation's longest wait
/// in ns (0 for a decision); 1 a peek; 2 a decision holding a slot under the lease id `arg`;
/// 3 a refund of units taken `arg` µs ago; 4 a debit; 5 the release of the lease `arg`.
pub(crate) fn runs(
    decisions: impl IntoIterator<Item = (usize, u32, Mode)>,
) -> SmallVec<[[u64; 5]; 4]> {
    let mut runs: SmallVec<[[u64; 5]; 4]> = SmallVec::new();
    for (policy, cost, mode) in decisions {
        let (arg, op) = mode.op_arg();
        let run = [1, policy as u64, u64::from(cost), arg, op];
        match runs.last_mut() {
            Some(last) if last[1..] == run[1..] => last[0] += 1,
            _ => runs.push(run),
        }
    }
    runs
}

/// Turns the script's reply (2 to 4 integers per quota, see [`reply_len`]) into a decision,
/// with the same arithmetic as the local backend. The reply is not trusted: its length is
/// checked, and its numbers are clamped to what the quota allows.
pub(crate) fn decision(
    reply: &[i64],
    params: &[QuotaParams],
    cost: NonZeroU32,
    mode: Mode,
    blocks: bool,
) -> Result<Decision, BackendError> {
    let expected = reply_len(params) + if blocks { 2 } else { 0 };
    if reply.len() != expected {
        return Err(protocol(format!(
            "script replied {} integers, expected {expected}",
            reply.len(),
        )));
    }
    let mut states = SmallVec::<[QuotaState; 2]>::new();
    let mut at = 0;
    let mut wait = 0;
    for (index, p) in params.iter().enumerate() {
        let r = &reply[at..at + quota_reply_len(p)];
        at += r.len();
        let n = |i: usize| r.get(i).copied().map_or(0, nonneg);
        states.push(state(index, p, cost, r[0], n(1), n(2), n(3))?);
        if matches!(mode, Mode::Reserve { .. }) && r[0] == 0 && p.kind == QuotaKind::Gcra {
            wait = wait.max(reply::reservation_wait(p, n(1), mode.max_wait_ns()));
        }
    }
    // The block, last: `1, µs left` when the key is blocked (before this decision, or from
    // it), `0, 0` otherwise. Settlements are made whatever the block.
    if blocks && reply.get(at) == Some(&1) && !mode.is_settlement() {
        let left = reply.get(at + 1).copied().map_or(0, nonneg);
        return Ok(Decision::blocked(params, Duration::from_micros(left)));
    }
    let decision = Decision::new(states).never_fits_alone();
    Ok(if decision.is_allowed() {
        decision.after(Duration::from_nanos(wait))
    } else {
        decision
    })
}

fn state(
    index: usize,
    p: &QuotaParams,
    cost: NonZeroU32,
    code: i64,
    x: u64,
    y: u64,
    z: u64,
) -> Result<QuotaState, BackendError> {
    if code == REFUSED {
        return Err(protocol(
            "Redis refused a key of this decision (is another program writing under the prefix?)"
                .to_owned(),
        ));
    }
    let code = reply::code(code)?;
    Ok(match p.kind {
        // `code, count after the decision, µs until the window's end`.
        QuotaKind::FixedWindow { window_us } => reply::fixed(index, p, code, window_us, x, y),
        // The same, in the calendar's window.
        #[cfg(feature = "calendar")]
        QuotaKind::Calendar { calendar } => {
            reply::fixed(index, p, code, calendar.longest_us(), x, y)
        }
        // `code, remaining, reset (µs), retry (µs)`, computed by the script with window.rs's
        // formulas (it alone has the counts). No wait is longer than the window and one more
        // sub-window.
        QuotaKind::SlidingWindow { slice_us, slices } => {
            let longest = slice_us.saturating_mul(u64::from(slices) + 1);
            let limit = p.burst.get();
            QuotaState {
                index,
                outcome: match code {
                    Code::Allowed => Outcome::Allowed,
                    Code::NeverFits => Outcome::NeverFits,
                    Code::Denied => Outcome::Denied {
                        retry_after: Duration::from_micros(z.min(longest)),
                    },
                },
                limit,
                remaining: u32::try_from(x).unwrap_or(u32::MAX).min(limit),
                reset_after: Duration::from_micros(y.min(longest)),
            }
        }
        // `code, TAT after the decision (ns from now)`.
        QuotaKind::Gcra => reply::gcra(index, p, cost, code, x),
        // `code, slots held after the decision`.
        QuotaKind::Concurrent { .. } => {
            crate::backend::window::in_flight_state(index, p, x, code != Code::Denied)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(per_second: u64, burst: u32) -> QuotaParams {
        QuotaParams::gcra(1_000_000_000 / per_second, NonZeroU32::new(burst).unwrap())
    }

    #[test]
    fn one_request_on_a_fresh_bucket_leaves_burst_minus_one() {
        let p = [params(5, 10)];
        let d = decision(&[0, 200_000_000], &p, NonZeroU32::MIN, Mode::Decide, false).unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.quotas()[0].remaining, 9);
        assert_eq!(d.quotas()[0].reset_after, Duration::from_millis(200));
    }

    #[test]
    fn denied_remaining_counts_what_is_there() {
        // Burst 5 at 1/s, cost 5, three units missing: the TAT is 3 s ahead.
        let p = [params(1, 5)];
        let cost = NonZeroU32::new(5).unwrap();
        let d = decision(&[1, 3_000_000_000], &p, cost, Mode::Decide, false).unwrap();
        assert_eq!(d.retry_after(), Some(Duration::from_secs(3)));
        assert_eq!(d.quotas()[0].remaining, 2);
        // The next unit is back in a second (`t`); the request fits in three.
        assert_eq!(d.quotas()[0].reset_after, Duration::from_secs(1));
    }

    #[test]
    fn malformed_replies_are_protocol_errors() {
        let p = [params(1, 5)];
        for reply in [&[0][..], &[9, 0][..], &[][..], &[0, 0, 0][..]] {
            let err = decision(reply, &p, NonZeroU32::MIN, Mode::Decide, false).unwrap_err();
            assert_eq!(err.kind(), crate::BackendErrorKind::Protocol);
        }
    }

    fn window(q: crate::Quota) -> QuotaParams {
        q.params("p").unwrap()
    }

    #[test]
    fn window_arguments_and_replies() {
        let fixed = window(crate::Quota::per_minute(10).fixed_window());
        let sliding = window(
            crate::Quota::per_minute(100)
                .sliding_window()
                .resolution(Duration::from_secs(5)),
        );
        let gcra = params(5, 10);
        let args: Vec<String> =
            policy_args(&[gcra, fixed, sliding], crate::quota::OnChange::Keep, None)
                .into_iter()
                .map(|a| String::from_utf8(a).unwrap())
                .collect();
        // Hexadecimal: 200 000 000 ns, 60 000 000 us, 5 000 000 us.
        let expected = "3 0 bebc200 a 0 1 3938700 a 0 2 4c4b40 64 c";
        assert_eq!(args.join(" "), expected);

        // The fixed window denies (its count is full, 20 s to its end); the others had room.
        let reply = [3, 400_000_000, 1, 10, 20_000_000, 3, 60, 1_500_000, 0];
        let d = decision(
            &reply,
            &[gcra, fixed, sliding],
            NonZeroU32::MIN,
            Mode::Decide,
            false,
        )
        .unwrap();
        assert_eq!(d.retry_after(), Some(Duration::from_secs(20)));
        let q = d.quotas();
        assert_eq!((q[0].outcome, q[0].remaining), (Outcome::Allowed, 8));
        assert_eq!(
            (q[1].remaining, q[1].reset_after),
            (0, Duration::from_secs(20))
        );
        assert_eq!(q[2].outcome, Outcome::Allowed);
        assert_eq!(
            (q[2].remaining, q[2].reset_after),
            (60, Duration::from_millis(1500))
        );
    }

    #[test]
    fn untrusted_window_replies_are_clamped() {
        let fixed = window(crate::Quota::per_minute(10).fixed_window());
        let sliding = window(crate::Quota::per_second(10).sliding_window());
        let reply = [1, i64::MAX, i64::MAX, 1, i64::MAX, -1, i64::MAX];
        let d = decision(
            &reply,
            &[fixed, sliding],
            NonZeroU32::MIN,
            Mode::Decide,
            false,
        )
        .unwrap();
        let q = d.quotas();
        assert_eq!(q[0].remaining, 0);
        assert_eq!(q[0].reset_after, Duration::from_secs(60));
        assert_eq!(q[1].remaining, 10);
        assert_eq!(q[1].reset_after, Duration::ZERO);
        // No wait beyond the window and one more sub-window.
        assert_eq!(d.retry_after(), Some(Duration::from_secs(60)));
        let Outcome::Denied { retry_after } = q[1].outcome else {
            panic!("{q:?}")
        };
        assert_eq!(retry_after, Duration::from_secs(2));
    }

    #[test]
    fn numbers_in_hexadecimal_and_decisions_in_runs() {
        for n in [0, 1, 15, 16, 255, 1_000_000_007, u64::MAX] {
            let h = hex(n);
            assert_eq!(h.as_bytes(), format!("{n:x}").as_bytes());
        }
        let d = Mode::Decide;
        let r = runs([
            (1, 1, d),
            (1, 1, d),
            (1, 1, d),
            (2, 1, d),
            (1, 1, d),
            (1, 5, d),
            (1, 5, d),
        ]);
        assert_eq!(
            &r[..],
            [
                [3, 1, 1, 0, 0],
                [1, 2, 1, 0, 0],
                [1, 1, 1, 0, 0],
                [2, 1, 5, 0, 0]
            ]
        );
        let reserve = Mode::Reserve {
            max_wait: Duration::from_millis(1),
        };
        let r = runs([(1, 1, reserve), (1, 1, Mode::Peek), (1, 1, Mode::Peek)]);
        assert_eq!(&r[..], [[1, 1, 1, 1_000_000, 0], [2, 1, 1, 0, 1]]);
        assert!(runs([]).is_empty());
    }
}
