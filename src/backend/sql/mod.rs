//! What the SQL stores share: bucket keys as row keys, the quotas and decisions as arguments,
//! the reply read into decisions, identifiers, and the sweep of expired rows.
//!
//! Both stores keep one row per client key and quota (see `postgres.sql` and `mysql.sql` next
//! to this file for the table, the function or procedure, and why a call is exact under
//! concurrency) and answer a call with the same integers per quota:
//!
//! | algorithm | reply |
//! |---|---|
//! | GCRA | code, TAT after the decision relative to now (ns, 0: full) |
//! | fixed window (and calendar) | code, count after the decision, µs until the window's end |
//! | sliding window | code, µs into the current sub-window, the sub-windows' counts after the decision (oldest first) |
//! | concurrent | code, slots held after the decision |
//! | a policy's block (last) | 1 and the µs left when the key is blocked, else 0, 0 |
//!
//! A sliding window's `remaining` and waits are computed here, from the counts, by the local
//! backend's own window code.

use std::num::NonZeroU32;
use std::time::Duration;

use sha2::{Digest, Sha256};
use smallvec::SmallVec;

mod builder;
mod store;
mod sweep;

pub(crate) use builder::{Config, FromUrl, Target, builder_methods, qualified};
pub(crate) use store::{Dialect, Failed, FleetRows, SqlStore};

use crate::backend::remote::reply::{self, nonneg, protocol};
use crate::backend::remote::{Job, Store, keys};
use crate::backend::window;
use crate::backend::{Decision, Mode, QuotaState};
#[cfg(feature = "calendar")]
use crate::quota::CalendarClock;
use crate::quota::{QuotaKind, QuotaParams};
use crate::{BackendError, Key};

/// The longest row key: longer bucket keys are replaced by a digest (see [`bucket_key`]).
pub(crate) const MAX_KEY: usize = 512;

/// The row key of one quota's bucket: the Redis backend's key (`<prefix>:{<policy>:<client
/// key>}:<quota suffix>`, readable in the table) when it fits in [`MAX_KEY`] bytes, otherwise
/// `<prefix>:#` and the SHA-256 of that key (collision-resistant: no client can pick a key
/// that lands in another's row).
pub(crate) fn bucket_key(base: &[u8], suffix: &[u8], prefix_len: usize, out: &mut Vec<u8>) {
    out.clear();
    if base.len() + suffix.len() <= MAX_KEY {
        out.extend_from_slice(base);
        out.extend_from_slice(suffix);
        return;
    }
    let digest = Sha256::new()
        .chain_update(base)
        .chain_update(suffix)
        .finalize();
    out.extend_from_slice(&base[..prefix_len.min(base.len())]);
    out.extend_from_slice(b":#");
    out.extend_from_slice(&digest);
}

/// What a SQL store needs of a prepared policy.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// `<prefix>:{<policy>:`, before the client key.
    pub(crate) key_prefix: Vec<u8>,
    /// The length of `<prefix>`, kept in digested keys.
    pub(crate) prefix_len: usize,
    pub(crate) key_suffixes: Vec<Box<[u8]>>,
    /// Four numbers per quota: kind, length (ns or µs), limit, sub-windows; a policy that
    /// blocks keys once refused has one more, `4, block µs, 1, mask`, last, with its own key
    /// (`mask`: the quotas whose refusal starts the block, a bit each; 0 for all).
    pub(crate) quotas: Vec<i64>,
    /// Whether the policy blocks keys once refused (`block_for`).
    pub(crate) blocks: bool,
    /// The calendar quotas' places in `quotas` (of their kind) and their calendars: each call
    /// writes their numbers from the instance's time (see [`calendar_args`]).
    #[cfg(feature = "calendar")]
    pub(crate) calendars: Vec<(usize, CalendarClock)>,
}

impl Prepared {
    pub(crate) fn new(prefix: &str, policy: &crate::Policy, params: &[QuotaParams]) -> Self {
        let block_us = (policy.block()).map(|b| i64::try_from(b.as_micros()).unwrap_or(i64::MAX));
        // Stored format 2, as on Redis: rows named by each quota's identity, `2.b` the block's.
        let key_suffixes = keys::quota_keys(policy, params);
        // A rate quota's kind (calendars' too) carries the policy's OnChange strategy times 8.
        let strategy = 8 * i64::from(policy.change_strategy().code());
        let mut quotas: Vec<i64> = (params.iter())
            .flat_map(|p| {
                let mut args = quota_args(p);
                if args[0] <= 2 || args[0] == 5 {
                    args[0] += strategy;
                }
                args
            })
            .collect();
        if let Some(us) = block_us {
            // The quotas whose refusal starts the block: a bit each (at most 8), 0 for all.
            quotas.extend([4, us, 1, policy.block_mask() as i64]);
        }
        Prepared {
            key_prefix: keys::policy_prefix(prefix, policy.name()),
            prefix_len: prefix.len(),
            key_suffixes,
            quotas,
            blocks: block_us.is_some(),
            #[cfg(feature = "calendar")]
            calendars: (params.iter().enumerate())
                .filter_map(|(i, p)| match p.kind {
                    QuotaKind::Calendar { calendar } => Some((4 * i, calendar.clock())),
                    _ => None,
                })
                .collect(),
        }
    }
}

/// A quota's four numbers: kind (0 GCRA, 1 fixed, 2 sliding, 3 concurrent, 5 calendar), its
/// length (GCRA: emission interval in ns; windows: µs; calendar: see [`calendar_args`]), its
/// limit, its sub-windows.
fn quota_args(p: &QuotaParams) -> [i64; 4] {
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let limit = i64::from(p.burst.get());
    match p.kind {
        QuotaKind::Gcra => [0, int(p.emission_ns), limit, 0],
        QuotaKind::FixedWindow { window_us } => [1, int(window_us), limit, 0],
        QuotaKind::SlidingWindow { slice_us, slices } => [2, int(slice_us), limit, slices.into()],
        QuotaKind::Concurrent { lease_ms } => [3, int(lease_ms), limit, 0],
        // The boundary and the windows' lengths are the call's (`calendar_args`, written by
        // `Args::of`); until then the calendar's id alone, at a boundary 0.
        #[cfg(feature = "calendar")]
        QuotaKind::Calendar { calendar } => [5, int(calendar.clock().id()), limit, 0],
    }
}

/// A calendar quota's second and fourth numbers for a call at `now_us` on the instance's clock
/// (the test clock's time when one is set): the boundary nearest it in seconds since the epoch
/// and the calendar's id (20 bits), packed `boundary * 2^20 + id`; and the lengths in seconds of
/// the windows before and after the boundary, packed `before * 2^32 + after`. The store picks
/// the one of the two windows that holds its own time (see `postgres.sql`, `mysql.sql`), so
/// that the instance's and the store's clocks may differ by up to half a window (see
/// `CalendarClock::around_call`).
#[cfg(feature = "calendar")]
pub(crate) fn calendar_args(calendar: &CalendarClock, now_us: u64) -> (i64, i64) {
    let a = calendar.around_call(now_us);
    // Boundaries under 2^32 s and lengths under 2^25 s: the packed numbers stay under 2^63.
    let boundary = a.boundary_s.min((1 << 32) - 1);
    (
        (boundary << 20 | calendar.id()) as i64,
        (a.before_s << 32 | a.after_s) as i64,
    )
}

/// A call's arguments: the row keys (one per quota of every decision), four numbers per key
/// (a calendar quota's written from the instance's time, see [`calendar_args`]), and per
/// decision its number of keys, its cost, and its mode as `arg, op` ([`Mode::op_arg`]; a store
/// that does not settle gets only ops 0 and 1: 0 a decision, `arg` a reservation's longest
/// wait in ns, 1 a peek).
#[derive(Debug, Default)]
pub(crate) struct Args {
    pub(crate) keys: Vec<Vec<u8>>,
    pub(crate) quotas: Vec<i64>,
    pub(crate) decisions: Vec<i64>,
}

impl Args {
    /// The arguments of `jobs`, a calendar's numbers from the instance's time: the test
    /// clock's, `now_ns`, when one is set, otherwise the system's wall clock.
    pub(crate) fn of<S: Store<Prepared = Prepared>>(jobs: &[Job<S>], now_ns: Option<u64>) -> Self {
        #[cfg(not(feature = "calendar"))]
        let _ = now_ns;
        #[cfg(feature = "calendar")]
        let mut now_us = None;
        let mut args = Args::default();
        let mut base = Vec::with_capacity(128);
        for job in jobs {
            let p = job.prepared();
            keys::key_base(&p.key_prefix, &job.key, &mut base);
            for suffix in &p.key_suffixes {
                let mut key = Vec::with_capacity(base.len() + suffix.len());
                bucket_key(&base, suffix, p.prefix_len, &mut key);
                args.keys.push(key);
            }
            #[cfg(feature = "calendar")]
            let at = args.quotas.len();
            args.quotas.extend_from_slice(&p.quotas);
            #[cfg(feature = "calendar")]
            for (i, calendar) in &p.calendars {
                // Read once per call: every calendar of the call from the same time.
                let now_us = *now_us.get_or_insert_with(|| CalendarClock::call_us(now_ns));
                let (boundary, lengths) = calendar_args(calendar, now_us);
                args.quotas[at + i + 1] = boundary;
                args.quotas[at + i + 3] = lengths;
            }
            let (arg, op) = match job.mode {
                // A store that does not settle holds no slots: a plain decision.
                Mode::Hold { .. } if !S::SETTLES => (0, 0),
                mode => mode.op_arg(),
            };
            args.decisions.extend([
                p.key_suffixes.len() as i64,
                i64::from(job.cost.get()),
                // A lease id's 64 bits as they are (the store compares them, nothing more).
                arg as i64,
                op as i64,
            ]);
        }
        args
    }
}

/// The row keys of `key` under a prepared policy (to reset a client).
pub(crate) fn row_keys(p: &Prepared, key: &Key) -> Vec<Vec<u8>> {
    let mut base = Vec::new();
    keys::key_base(&p.key_prefix, key, &mut base);
    p.key_suffixes
        .iter()
        .map(|suffix| {
            let mut k = Vec::new();
            bucket_key(&base, suffix, p.prefix_len, &mut k);
            k
        })
        .collect()
}

/// The rows `reset` deletes: every one of `key` under the policy's quotas but the slots of
/// requests still in flight (see [`Backend::reset`](crate::backend::Backend::reset)).
pub(crate) fn reset_keys(p: &Prepared, key: &Key) -> Vec<Vec<u8>> {
    let keys = row_keys(p, key).into_iter().zip(&p.key_suffixes);
    keys.filter(|(_, suffix)| !keys::holds_slots(suffix))
        .map(|(k, _)| k)
        .collect()
}

/// Reads a call's reply, decision after decision. A reply too short for a decision fails that
/// decision (and the ones after it) as a protocol error.
pub(crate) fn decisions<S: Store<Prepared = Prepared>>(
    reply: &[i64],
    jobs: &[Job<S>],
) -> Vec<Result<Decision, BackendError>> {
    decode_all(
        reply,
        jobs.iter()
            .map(|j| (j.params(), j.cost, j.mode, j.prepared().blocks)),
    )
}

/// The decisions of a reply, from each decision's quotas, cost and mode.
fn decode_all<'a>(
    reply: &[i64],
    items: impl IntoIterator<Item = (&'a [QuotaParams], NonZeroU32, Mode, bool)>,
) -> Vec<Result<Decision, BackendError>> {
    let items: Vec<_> = items.into_iter().collect();
    let mut at = 0;
    let mut out = Vec::with_capacity(items.len());
    for (params, cost, mode, blocks) in &items {
        let d = decision(reply, &mut at, params, *cost, *mode, *blocks);
        if let Err(err) = &d {
            // Where the next decision starts is unknown now: it and the rest fail too.
            let err = clone_error(err);
            out.push(d);
            while out.len() < items.len() {
                out.push(Err(clone_error(&err)));
            }
            return out;
        }
        out.push(d);
    }
    if at != reply.len() {
        // More numbers than the decisions: the reply does not belong to this call.
        let err = protocol(format!(
            "the store replied {} integers, expected {at}",
            reply.len()
        ));
        return items.iter().map(|_| Err(clone_error(&err))).collect();
    }
    out
}

fn clone_error(err: &BackendError) -> BackendError {
    BackendError::new(err.kind(), err.to_string())
}

/// One decision's quotas from `reply[*at..]`, moving `at` past them.
fn decision(
    reply: &[i64],
    at: &mut usize,
    params: &[QuotaParams],
    cost: NonZeroU32,
    mode: Mode,
    blocks: bool,
) -> Result<Decision, BackendError> {
    let mut states = SmallVec::<[QuotaState; 2]>::new();
    let mut wait = 0;
    for (index, p) in params.iter().enumerate() {
        let len = match p.kind {
            QuotaKind::Gcra => 2,
            QuotaKind::FixedWindow { .. } => 3,
            #[cfg(feature = "calendar")]
            QuotaKind::Calendar { .. } => 3,
            QuotaKind::SlidingWindow { slices, .. } => 3 + slices as usize,
            QuotaKind::Concurrent { .. } => 2,
        };
        let Some(r) = reply.get(*at..*at + len) else {
            *at = reply.len() + 1;
            return Err(protocol(format!(
                "the store's reply is too short ({} integers)",
                reply.len()
            )));
        };
        *at += len;
        let code = reply::code(r[0])?;
        if matches!(mode, Mode::Reserve { .. }) && r[0] == 0 && p.kind == QuotaKind::Gcra {
            wait = wait.max(reply::reservation_wait(p, nonneg(r[1]), mode.max_wait_ns()));
        }
        states.push(match p.kind {
            QuotaKind::Gcra => reply::gcra(index, p, cost, code, nonneg(r[1])),
            QuotaKind::FixedWindow { window_us } => {
                reply::fixed(index, p, code, window_us, nonneg(r[1]), nonneg(r[2]))
            }
            #[cfg(feature = "calendar")]
            QuotaKind::Calendar { calendar } => {
                let longest = calendar.longest_us();
                reply::fixed(index, p, code, longest, nonneg(r[1]), nonneg(r[2]))
            }
            QuotaKind::SlidingWindow { slice_us, .. } => {
                let into = nonneg(r[1]).min(slice_us.saturating_sub(1));
                let counts: SmallVec<[u32; 16]> = r[2..]
                    .iter()
                    .map(|&c| u32::try_from(nonneg(c)).unwrap_or(u32::MAX))
                    .collect();
                window::sliding_state(index, p, code, &counts, slice_us, into, cost)
            }
            QuotaKind::Concurrent { .. } => {
                window::in_flight_state(index, p, nonneg(r[1]), code != window::Code::Denied)
            }
        });
    }
    // The block, last: `1, µs left` when the key is blocked (before this decision, or from
    // it), `0, 0` otherwise. Settlements are made whatever the block.
    if blocks {
        let Some(&[code, left]) = reply.get(*at..*at + 2) else {
            *at = reply.len() + 1;
            return Err(protocol(format!(
                "the store's reply is too short ({} integers)",
                reply.len()
            )));
        };
        *at += 2;
        if code == 1 && !mode.is_settlement() {
            return Ok(Decision::blocked(
                params,
                Duration::from_micros(nonneg(left)),
            ));
        }
    }
    let decision = Decision::new(states).never_fits_alone();
    Ok(if decision.is_allowed() {
        decision.after(Duration::from_nanos(wait))
    } else {
        decision
    })
}

/// A SQL backend's public types on a [`SqlStore`] of `$dialect`: the backend and its prepared
/// policy (their docs given), their `Debug`, the backend's
/// [`Backend`](crate::backend::Backend) implementation, and its migration, sweep, reset,
/// conflict, endpoint and stats methods (the docs that differ per database given).
macro_rules! sql_backend {
    (
        $(#[$backend_doc:meta])* $backend:ident,
        $(#[$policy_doc:meta])* $policy:ident,
        $dialect:ty;
        $(#[$migrate:meta])* migrate;
        $(#[$sql:meta])* migration_sql;
        $(#[$conflicts:meta])* conflicts_retried;
        $(#[$endpoint:meta])* endpoint;
    ) => {
        $(#[$backend_doc])*
        #[derive(Clone)]
        pub struct $backend {
            remote: $crate::backend::remote::Remote<$crate::backend::sql::SqlStore<$dialect>>,
        }

        $(#[$policy_doc])*
        pub struct $policy {
            inner: $crate::backend::remote::RemotePolicy<$crate::backend::sql::SqlStore<$dialect>>,
        }

        impl $backend {
            $(#[$migrate])*
            pub async fn migrate(&self) -> Result<(), $crate::BackendError> {
                self.remote.store().migrate().await
            }

            $(#[$sql])*
            pub fn migration_sql(&self) -> String {
                self.remote.store().migration()
            }

            $(#[$conflicts])*
            pub fn conflicts_retried(&self) -> u64 {
                self.remote.store().conflicts_retried()
            }

            $(#[$endpoint])*
            pub fn endpoint(&self) -> &str {
                &self.remote.store().endpoint
            }
        }

        impl std::fmt::Debug for $policy {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($policy))
                    .field("quotas", &self.inner.params())
                    .field("deny_cache_entries", &self.inner.deny_cache_len())
                    .finish()
            }
        }

        impl std::fmt::Debug for $backend {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let store = self.remote.store();
                f.debug_struct(stringify!($backend))
                    .field("endpoint", &store.endpoint)
                    .field("table", &store.table())
                    .field("prefix", &store.prefix)
                    .field("timeout", &self.remote.timeout())
                    .field("on_failure", &self.remote.on_failure())
                    .field("stats", &self.stats())
                    .finish()
            }
        }

        impl $backend {
            /// Deletes expired rows now (as the background sweep does), answering how many.
            pub async fn sweep(&self) -> Result<u64, $crate::BackendError> {
                self.remote.store().sweeper.sweep(u32::MAX).await
            }

            /// Rows deleted by sweeps so far.
            pub fn swept(&self) -> u64 {
                self.remote.store().sweeper.swept()
            }

            /// Forgets `key`'s buckets under `policy`: its next request finds them full (an
            /// operator forgiving a client). Answers how many rows were deleted.
            pub async fn reset(
                &self,
                policy: &$policy,
                key: &$crate::Key,
            ) -> Result<u64, $crate::BackendError> {
                policy.inner.forget(key);
                self.remote.store().reset(policy.inner.store(), key).await
            }

            /// The backend's counters now.
            pub fn stats(&self) -> $crate::backend::remote::RemoteStats {
                self.remote.stats()
            }
        }

        impl $crate::backend::Backend for $backend {
            type Policy = $policy;
            type Future = $crate::backend::remote::RemoteFuture;

            fn prepare(
                &self,
                policy: &$crate::Policy,
                params: &[$crate::quota::QuotaParams],
            ) -> Result<$policy, $crate::ConfigError> {
                Ok($policy {
                    inner: self.remote.prepare(policy, params)?,
                })
            }

            fn decide(
                &self,
                policy: &$policy,
                key: &$crate::Key,
                cost: std::num::NonZeroU32,
            ) -> Self::Future {
                self.remote
                    .decide(&policy.inner, key, cost, $crate::backend::Mode::Decide)
            }

            fn decide_with(
                &self,
                policy: &$policy,
                key: &$crate::Key,
                cost: std::num::NonZeroU32,
                mode: $crate::backend::Mode,
            ) -> Self::Future {
                self.remote.decide(&policy.inner, key, cost, mode)
            }

            /// Deletes the key's rows, as the backend's own `reset`.
            fn reset(&self, policy: &$policy, key: &$crate::Key) -> $crate::backend::ResetFuture {
                policy.inner.forget(key);
                let (remote, shared) = (self.remote.clone(), policy.inner.inner.clone());
                let key = key.clone();
                Box::pin(async move { remote.store().reset(&shared.store, &key).await.map(drop) })
            }

            /// The backend's clock: a test clock when one is set.
            fn now_ns(&self) -> u64 {
                self.remote.now_ns()
            }

            /// The test clock's time when one is set (the one calendar windows are counted
            /// on), else the system's.
            fn unix_time(&self) -> std::time::Duration {
                (self.remote.test_time())
                    .map_or_else($crate::backend::system_unix_time, std::time::Duration::from_nanos)
            }

            /// The database and table, password left out: backends naming the same share
            /// buckets.
            fn store_id(&self) -> Option<String> {
                let store = self.remote.store();
                Some(format!(
                    "{} table {} prefix {:?}",
                    store.endpoint,
                    store.table(),
                    store.prefix
                ))
            }
        }
    };
}
pub(crate) use sql_backend;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_keys_are_digested_and_short_ones_kept() {
        let mut out = Vec::new();
        bucket_key(b"tg:{api:bx}:", b"0g1x1", 2, &mut out);
        assert_eq!(out, b"tg:{api:bx}:0g1x1");
        let long = vec![b'a'; 600];
        bucket_key(&long, b"0g1x1", 2, &mut out);
        assert_eq!(out.len(), 2 + 2 + 32);
        assert_eq!(&out[..4], b"aa:#");
        let mut other = Vec::new();
        bucket_key(&long, b"0g1x2", 2, &mut other);
        assert_ne!(out, other);
    }

    /// A calendar quota's numbers: the boundary nearest the instance's time with the
    /// calendar's id, the windows on each side, the policy's strategy in the kind.
    #[cfg(feature = "calendar")]
    #[test]
    fn a_calendars_numbers_are_the_windows_around_the_instances_time() {
        let quota: crate::Quota = "2/day tz America/New_York".parse().unwrap();
        let params = [quota.params("daily").unwrap()];
        let QuotaKind::Calendar { calendar } = params[0].kind else {
            panic!("{params:?}")
        };
        let clock = calendar.clock();
        let id = i64::try_from(clock.id()).unwrap();
        let policy = crate::Policy::new("daily", quota).on_change(crate::OnChange::Reset);
        let p = Prepared::new("tg", &policy, &params);
        assert_eq!(p.quotas, [5 + 8, id, 2, 0]);
        assert_eq!(p.calendars, [(0, clock)]);
        // 9 March 2026, 00:00 in New York (04:00 UTC), after a day of 23 hours (DST began).
        let mar_9: i64 = 1_773_028_800;
        let args = |s: i64| calendar_args(&clock, u64::try_from(s).unwrap() * 1_000_000);
        for near in [mar_9 - 11 * 3600, mar_9 - 1, mar_9, mar_9 + 11 * 3600] {
            assert_eq!(args(near), (mar_9 << 20 | id, (23 * 3600) << 32 | 86_400));
        }
        // Nearer the next midnight, the windows around it.
        assert_eq!(
            args(mar_9 + 13 * 3600),
            ((mar_9 + 86_400) << 20 | id, 86_400 << 32 | 86_400)
        );
    }

    #[test]
    fn a_bad_decision_fails_the_rest_of_the_reply() {
        let gcra = QuotaParams::gcra(200_000_000, NonZeroU32::new(10).unwrap());
        let one = (&[gcra][..], NonZeroU32::MIN, Mode::Decide, false);
        // An unknown code in the first: where the second starts is unknown, it fails too.
        let out = decode_all(&[9, 0, 0, 0], [one, one]);
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(Result::is_err));
        let out = decode_all(&[0, 0, 0, 200_000_000], [one, one]);
        assert!(out.iter().all(Result::is_ok));
        // A reply longer than its decisions belongs to another call.
        let out = decode_all(&[0, 0, 0, 0, 0], [one, one]);
        assert!(out.iter().all(Result::is_err));
    }

    #[test]
    fn replies_are_read_per_algorithm_and_checked() {
        let gcra = QuotaParams::gcra(200_000_000, NonZeroU32::new(10).unwrap());
        let sliding = crate::Quota::per_second(10)
            .sliding_window()
            .params("p")
            .unwrap();
        let params = [gcra, sliding];
        let mut at = 0;
        // GCRA allowed (one unit used); sliding: 100 ms into a 1 s sub-window, counts 4 and 1.
        let reply = [0, 200_000_000, 0, 100_000, 4, 1];
        let d = decision(
            &reply,
            &mut at,
            &params,
            NonZeroU32::MIN,
            Mode::Decide,
            false,
        )
        .unwrap();
        assert_eq!(at, reply.len());
        assert_eq!(d.quotas()[0].remaining, 9);
        // E = 4 × 0.9 + 1 = 4.6: 5 more fit.
        assert_eq!(d.quotas()[1].remaining, 5);
        let mut at = 0;
        assert!(
            decision(
                &reply[..5],
                &mut at,
                &params,
                NonZeroU32::MIN,
                Mode::Decide,
                false
            )
            .is_err()
        );
        let mut at = 0;
        assert!(
            decision(
                &[7, 0],
                &mut at,
                &[gcra],
                NonZeroU32::MIN,
                Mode::Decide,
                false
            )
            .is_err()
        );
    }
}
