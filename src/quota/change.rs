//! What a live key keeps when its quota changes: [`OnChange`], and the arithmetic every store
//! applies (the Redis script and the SQL procedures repeat it, operation for operation).
//!
//! A quota's bucket is named by the store, the policy's name, the quota's name (or its place
//! in the policy when it has none) and its algorithm; its values (count, period, burst,
//! resolution) are not part of the name. Each stored state says which values it was counted
//! under, and a decision under other values first converts it, as the policy's [`OnChange`]
//! says. In units: `used` is what the key has taken and not yet got back (GCRA: its debt over
//! the emission interval; a fixed window: its count; a sliding window: its weighted count),
//! `limit` the burst or the window's limit.

/// What a key keeps of what it used when its quota's values change while it is live (a rule
/// swapped by [`RulesHandle`](crate::rules::RulesHandle) or the admin API, a reloaded
/// configuration, a replaced [`Limiter`](crate::limiter::Limiter) policy, or two instances of a
/// fleet running different values for a while). Set per policy with
/// [`Policy::on_change`](crate::Policy::on_change), or `on_change = "keep"` in a configuration
/// file. The strategies are those of Bucket4j's `TokensInheritanceStrategy`, stated in units
/// used (see `docs/algorithms.md`, "When a quota changes", for what each means per algorithm):
///
/// ```
/// use tollgate::quota::OnChange;
/// use tollgate::{Policy, Quota};
///
/// let free = Policy::new("free", Quota::per_hour(1000)).on_change(OnChange::Proportional);
/// assert_eq!(free.change_strategy(), OnChange::Proportional);
/// assert_eq!("additive".parse::<OnChange>(), Ok(OnChange::Additive));
/// ```
///
/// **A rolling change over a fleet** (instances on one shared store running two versions of a
/// quota for minutes) converts a key's state at calls that alternate between them. A key so
/// converted remembers the values it came from, and a call under those values converts it back
/// as `Keep` does, so each strategy applies once per key and change: two versions in turn admit
/// at most the higher of their limits after the key's first conversion (12 of 10 and 12 a
/// minute asked in turn under `Keep` and `Additive`, the 1 taken before and then 12 under
/// `Reset`, 8 to 12 under `Proportional`, which rounds towards refusing; every shared store,
/// GCRA and windows, tested with two instances). A change back to the values a live key came
/// from converts as `Keep` there too. The local backend swaps atomically: each key is
/// converted once, by the strategy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OnChange {
    /// The units a key used carry over, at most the new limit (the default, as limitador and
    /// envoyproxy/ratelimit count): 5 spent of 1 000 leaves 895 of a new 900.
    #[default]
    Keep,
    /// Every key starts afresh under the new values.
    Reset,
    /// The fraction used carries over: 5 spent of 1 000 is 4.5 of a new 900.
    Proportional,
    /// A raised limit adds the difference to what is left (what was used stays used); a
    /// lowered one keeps what is left, at most the new limit: 5 spent of 1 000 (995 left)
    /// leaves 900 of a new 900.
    Additive,
}

impl OnChange {
    /// The name of the strategy in configuration files: `keep`, `reset`, `proportional`,
    /// `additive`.
    pub const fn as_str(self) -> &'static str {
        match self {
            OnChange::Keep => "keep",
            OnChange::Reset => "reset",
            OnChange::Proportional => "proportional",
            OnChange::Additive => "additive",
        }
    }

    /// The strategy's number in the stores' arguments (the Redis script, the SQL procedures).
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) const fn code(self) -> u8 {
        match self {
            OnChange::Keep => 0,
            OnChange::Reset => 1,
            OnChange::Proportional => 2,
            OnChange::Additive => 3,
        }
    }

    /// The units used under the new limit, from `used` under the old one (both limits at
    /// least 1). The Redis script (`carry`) and the SQL procedures compute the same, in the
    /// same floating-point operations.
    #[cfg_attr(not(any(feature = "local", feature = "redis")), allow(dead_code))]
    pub(crate) fn carry(self, used: f64, old_limit: f64, new_limit: f64) -> f64 {
        let used = if used > 0.0 { used } else { 0.0 };
        let carried = match self {
            OnChange::Keep => used,
            OnChange::Reset => 0.0,
            OnChange::Proportional => used * new_limit / old_limit,
            OnChange::Additive => {
                if new_limit >= old_limit {
                    used
                } else {
                    used - (old_limit - new_limit)
                }
            }
        };
        carried.clamp(0.0, new_limit)
    }

    /// A GCRA bucket's debt (its theoretical arrival time less now, ns) under the new emission
    /// interval and burst, from its debt under the old ones.
    #[cfg_attr(not(feature = "local"), allow(dead_code))]
    pub(crate) fn carry_debt(self, debt_ns: u64, old: (u64, u32), new: (u64, u32)) -> u64 {
        if old == new {
            return debt_ns;
        }
        let used = debt_ns as f64 / old.0 as f64;
        let units = self.carry(used, f64::from(old.1), f64::from(new.1));
        // At most burst * emission: below 100 years of nanoseconds.
        (units * new.0 as f64).floor() as u64
    }
}

impl std::fmt::Display for OnChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OnChange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "keep" => OnChange::Keep,
            "reset" => OnChange::Reset,
            "proportional" => OnChange::Proportional,
            "additive" => OnChange::Additive,
            _ => {
                return Err(format!(
                    "unknown on_change {s:?}: use \"keep\", \"reset\", \"proportional\" or \
                     \"additive\""
                ));
            }
        })
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for OnChange {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for OnChange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::OnChange::*;

    #[test]
    fn strategies_in_units() {
        // 5 used of 1000, changed to 900.
        assert_eq!(Keep.carry(5.0, 1000.0, 900.0), 5.0);
        assert_eq!(Reset.carry(5.0, 1000.0, 900.0), 0.0);
        assert_eq!(Proportional.carry(5.0, 1000.0, 900.0), 4.5);
        assert_eq!(Additive.carry(5.0, 1000.0, 900.0), 0.0);
        // 950 used of 1000, lowered to 900: keep clamps to the new limit, additive keeps the
        // 50 left.
        assert_eq!(Keep.carry(950.0, 1000.0, 900.0), 900.0);
        assert_eq!(Additive.carry(950.0, 1000.0, 900.0), 850.0);
        // Raised to 2000: keep and additive keep what was used, proportional doubles it.
        assert_eq!(Keep.carry(950.0, 1000.0, 2000.0), 950.0);
        assert_eq!(Additive.carry(950.0, 1000.0, 2000.0), 950.0);
        assert_eq!(Proportional.carry(950.0, 1000.0, 2000.0), 1900.0);
    }

    #[test]
    fn debts() {
        // 1000/h (3.6 s each) to 900/h (4 s each), 5 used.
        let d = Keep.carry_debt(
            5 * 3_600_000_000,
            (3_600_000_000, 1000),
            (4_000_000_000, 900),
        );
        assert_eq!(d, 20_000_000_000);
        // Unchanged values keep the debt to the nanosecond.
        assert_eq!(Reset.carry_debt(7, (3, 10), (3, 10)), 7);
        // A debt past the new burst is clamped to a full bucket's worth.
        let d = Keep.carry_debt(10 * 100, (100, 10), (100, 4));
        assert_eq!(d, 400);
    }

    #[test]
    fn names() {
        for s in [Keep, Reset, Proportional, Additive] {
            assert_eq!(s.as_str().parse::<super::OnChange>(), Ok(s));
        }
        assert!(
            "kept"
                .parse::<super::OnChange>()
                .unwrap_err()
                .contains("keep")
        );
    }
}
