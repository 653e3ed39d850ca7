//! A policy's concurrent quotas in the approximate mode: decided at the store by the exact
//! backend, once the policy's windows, decided here, allow the request (see the
//! [module docs](super#concurrent-quotas)).

use std::num::NonZeroU32;
use std::sync::Arc;

use smallvec::SmallVec;

use super::{ApproxBackend, ApproxFuture, ApproxPolicy, PolicyShared};
use crate::backend::{Backend, Decision, Mode, QuotaState};
use crate::{BackendError, ConfigError, Key, Policy};

/// A policy's concurrent quotas, as a policy of their own on the exact backend: a slot cannot
/// be approximate (see the [module docs](super#concurrent-quotas)).
pub(super) struct Slots {
    pub(super) backend: crate::backend::redis::RedisBackend,
    pub(super) policy: <crate::backend::redis::RedisBackend as Backend>::Policy,
    /// Each of its quotas' place in the whole policy.
    index: Box<[usize]>,
}

impl Slots {
    /// `decision` of the slots' policy, its quotas numbered as in the whole policy.
    pub(super) fn renumber(&self, decision: Decision) -> SmallVec<[QuotaState; 2]> {
        (decision.quotas().iter())
            .map(|q| {
                let mut q = *q;
                q.index = self.index.get(q.index).copied().unwrap_or(q.index);
                q
            })
            .collect()
    }
}

impl ApproxBackend {
    /// The concurrent quotas `index` of `policy`, prepared on the exact backend.
    pub(super) fn slots(&self, policy: &Policy, index: &[usize]) -> Result<Slots, ConfigError> {
        let backend = self.shared.exact.clone();
        let quotas = index.iter().map(|&i| policy.quotas()[i]);
        let mut quotas = quotas.peekable();
        let first = quotas.next().ok_or_else(|| ConfigError::QuotaCount {
            policy: policy.name().to_owned(),
            count: 0,
        })?;
        let slot_policy = quotas.fold(Policy::new(policy.name(), first), Policy::and);
        let params = slot_policy.validate()?;
        Ok(Slots {
            policy: backend.prepare(&slot_policy, &params)?,
            backend,
            index: index.into(),
        })
    }

    /// A decision on a policy with concurrent quotas, once its windows (`windows`) have
    /// answered: when they allow it, the slots are asked at the store (checked, or taken for
    /// [`Mode::Hold`]); when a slot refuses, what the windows took is given back and the
    /// refusal is the slot's (a block starts if that quota blocks). All or nothing, as on
    /// every store, but in two steps: between them another request may see the window units
    /// taken (and be refused for it), never the other way round.
    pub(super) async fn with_slots(
        &self,
        windows: ApproxFuture,
        policy: &ApproxPolicy,
        slots: &Slots,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> Result<Decision, BackendError> {
        let w = windows.await?;
        if !w.is_allowed() {
            return Ok(w);
        }
        let slot_mode = match mode {
            Mode::Reserve { .. } => Mode::Decide,
            other => other,
        };
        let took = matches!(
            mode,
            Mode::Decide | Mode::Hold { .. } | Mode::Reserve { .. }
        );
        let give_back = || async {
            if took {
                let back = Mode::Refund {
                    admitted_ago: std::time::Duration::ZERO,
                };
                let _ = self.windows(policy, key, cost, back).await;
            }
        };
        let d = match slots
            .backend
            .decide_with(&slots.policy, key, cost, slot_mode)
            .await
        {
            Ok(d) => d,
            Err(e) => {
                give_back().await;
                return Err(e);
            }
        };
        let states = slots.renumber(d);
        let refused = states
            .iter()
            .any(|q| !matches!(q.outcome, crate::backend::Outcome::Allowed));
        // A peek reports every quota up to the one that refuses; a decision refused by a slot
        // reports that slot alone.
        if refused && mode != Mode::Peek {
            give_back().await;
            if let Some(left_us) = self.block_on_slots(&policy.inner, key, &states) {
                return Ok(policy.inner.blocked(left_us));
            }
            return Ok(Decision::new(states));
        }
        let mut all: SmallVec<[QuotaState; 2]> = w.quotas().iter().cloned().collect();
        all.extend(states);
        all.sort_unstable_by_key(|q| q.index);
        Ok(Decision::from_states(all))
    }

    /// Blocks `key` when a concurrent quota that blocks refused it (`states`): as a window's
    /// refusal does (see `decide_here`). Returns the block's length in µs, if it started one.
    fn block_on_slots(
        &self,
        p: &Arc<PolicyShared>,
        key: &Key,
        states: &[QuotaState],
    ) -> Option<u64> {
        let blocks = states.iter().any(|q| {
            matches!(q.outcome, crate::backend::Outcome::Denied { .. }) && p.blocks_on(q.index)
        });
        if !blocks {
            return None;
        }
        let entry = p.entries.get(key)?.entry.clone();
        let mut st = entry.lock();
        self.shared
            .start_block(p, &entry, &mut st, self.shared.now.us());
        Some(p.block_us)
    }
}
