//! Reading a store's reply: the numbers every store's script or SQL answers per quota, turned
//! into [`QuotaState`]s with the same arithmetic as the local backend.
//!
//! Codes: `0` allowed (units taken), `1` denied, `2` never fits (cost larger than the burst or
//! limit; nothing taken, state as it is), `3` would have allowed but another quota denied
//! (nothing taken, state as it is). GCRA answers `code, TAT after the decision relative to now
//! (ns, 0: full)`; a fixed window `code, count after the decision, µs until the window's end`.
//! Replies are not trusted: numbers are clamped to what the quota allows.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::backend::QuotaState;
use crate::backend::window::{self, Code};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind};

/// A quota's code.
pub(crate) fn code(code: i64) -> Result<Code, BackendError> {
    match code {
        0 | 3 => Ok(Code::Allowed),
        1 => Ok(Code::Denied),
        2 => Ok(Code::NeverFits),
        other => Err(protocol(format!("the store replied unknown code {other}"))),
    }
}

/// A GCRA quota's state from its TAT after the decision, `tat_ns` from now. A denial's wait,
/// until the cost fits, is the TAT less the burst's tolerance for this cost,
/// `TAT + T × (cost − burst)`: the store's own test, computed here (exactly, in integers)
/// rather than sent.
pub(crate) fn gcra(
    index: usize,
    p: &QuotaParams,
    cost: NonZeroU32,
    code: Code,
    tat_ns: u64,
) -> QuotaState {
    let tat_ns = tat_ns.min(longest_tat(p));
    match code {
        Code::Allowed => QuotaState::allowed(index, p, Duration::from_nanos(tat_ns)),
        Code::Denied => {
            let t = u128::from(p.emission_ns);
            let wait = (u128::from(tat_ns) + t * u128::from(cost.get()))
                .saturating_sub(t * u128::from(p.burst.get()));
            let wait = u64::try_from(wait).unwrap_or(u64::MAX);
            QuotaState::denied(index, p, cost, Duration::from_nanos(wait))
        }
        Code::NeverFits => QuotaState::never_fits(index, p, Duration::from_nanos(tat_ns)),
    }
}

/// The wait a reservation's GCRA quota implies, from its TAT after the reservation: it was
/// charged as of the time the request goes on, so that time is the TAT less a full bucket
/// (`TAT − burst × T`), or now.
///
/// At most `max_wait_ns`, the longest the caller accepted: a store can never have reserved
/// more (a reply saying otherwise is not trusted).
pub(crate) fn reservation_wait(p: &QuotaParams, tat_ns: u64, max_wait_ns: u64) -> u64 {
    tat_ns
        .saturating_sub(p.emission_ns.saturating_mul(u64::from(p.burst.get())))
        .min(max_wait_ns)
}

/// The latest TAT a GCRA bucket can have, from now: a full bucket's span past the longest
/// reservation (a day). A reply beyond it is not trusted, and read as that.
fn longest_tat(p: &QuotaParams) -> u64 {
    let full = p.emission_ns.saturating_mul(u64::from(p.burst.get()));
    let day = crate::backend::Mode::Reserve {
        max_wait: Duration::MAX,
    }
    .max_wait_ns();
    full.saturating_add(day)
}

/// A fixed window's state from its count after the decision and the µs until its end.
pub(crate) fn fixed(
    index: usize,
    p: &QuotaParams,
    code: Code,
    window_us: u64,
    count: u64,
    until_end_us: u64,
) -> QuotaState {
    let count = u32::try_from(count).unwrap_or(u32::MAX);
    window::fixed_state(
        index,
        p,
        code,
        count,
        until_end_us.clamp(1, window_us.max(1)),
    )
}

/// A reply's number as a non-negative one (negative numbers are not trusted: zero).
pub(crate) fn nonneg(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A reply that does not fit the policy.
pub(crate) fn protocol(msg: String) -> BackendError {
    BackendError::new(BackendErrorKind::Protocol, msg)
}
