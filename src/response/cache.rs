//! A per-thread cache of formatted header values.
//!
//! Most responses repeat the `RateLimit` value of the one before: a key well under its limit
//! sees the same `r` (remaining) and `t` (seconds to full) request after request. Formatting
//! the value, validating it and allocating its `HeaderValue` cost about as much as the rest of
//! the decision, so each worker thread keeps the values it made last, and a repeat costs a
//! table lookup and a reference-count increment.
//!
//! The cache is per thread, not shared: a shared value's reference count would be written by
//! every core on every request. For the same reason each thread also keeps its own copy of
//! the static `RateLimit-Policy` value.
//!
//! Entries are keyed by the policy's unique id (never reused, unlike an address) and the exact
//! numbers of the value, so a hit is always byte-for-byte what formatting would produce. The
//! table is small and direct-mapped. A value is kept only when it is seen a second time in a
//! row in its slot: keeping it means sharing it (one more allocation), which only pays when it
//! repeats, so numbers that change with every response cost what they would without a cache.

use std::cell::RefCell;

use http::HeaderValue;

/// The multiplier of the slot hashes (2^64 / the golden ratio).
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;
/// Value slots per thread (a power of two).
const VALUE_SLOTS: usize = 64;
/// `RateLimit-Policy` slots per thread (a power of two).
const POLICY_SLOTS: usize = 16;

/// What a `RateLimit` value is made of: the policy and, for up to two quotas, each quota's
/// index, remaining units and seconds to full. Values of more quotas are not cached.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct ValueKey {
    policy: u64,
    len: u8,
    index: [u8; 2],
    remaining: [u32; 2],
    reset: [u64; 2],
}

impl ValueKey {
    /// The key of a value with `items` as `(index, remaining, reset seconds)`, or `None` when
    /// there are more than two.
    pub(super) fn new(
        policy: u64,
        items: impl ExactSizeIterator<Item = (usize, u32, u64)>,
    ) -> Option<Self> {
        if items.len() > 2 {
            return None;
        }
        let mut key = ValueKey {
            policy,
            len: 0,
            index: [0; 2],
            remaining: [0; 2],
            reset: [0; 2],
        };
        for (i, (index, remaining, reset)) in items.enumerate() {
            let slot = key.index.get_mut(i)?;
            *slot = u8::try_from(index).ok()?;
            key.remaining[i] = remaining;
            key.reset[i] = reset;
            key.len += 1;
        }
        Some(key)
    }

    fn slot(&self) -> usize {
        // A multiply-shift mix: the low bits of `remaining` and `reset` vary the most.
        let mut h = (self.policy ^ u64::from(self.len)).wrapping_mul(MIX);
        for i in 0..2 {
            h = (h ^ u64::from(self.remaining[i]) ^ self.reset[i].rotate_left(32))
                .wrapping_mul(MIX);
        }
        (h >> 58) as usize & (VALUE_SLOTS - 1)
    }
}

struct Cache {
    /// The last key seen in each slot, with its value once it has been seen twice in a row.
    values: [Option<(ValueKey, Option<HeaderValue>)>; VALUE_SLOTS],
    policies: [Option<(u64, HeaderValue)>; POLICY_SLOTS],
}

thread_local! {
    static CACHE: RefCell<Cache> = const {
        RefCell::new(Cache {
            values: [const { None }; VALUE_SLOTS],
            policies: [const { None }; POLICY_SLOTS],
        })
    };
}

/// The `RateLimit` value for `key`, made by `make` on a miss (and kept when the same key was
/// the slot's last). Works without the cache (e.g. while the thread is being torn down) by
/// calling `make`.
pub(super) fn value(
    key: ValueKey,
    make: impl FnOnce() -> Option<HeaderValue>,
) -> Option<HeaderValue> {
    let slot = key.slot();
    let mut make = Some(make);
    let cached = CACHE.try_with(|c| {
        let mut c = c.try_borrow_mut().ok()?;
        let entry = &mut c.values[slot];
        // Seen last time too: keep the value this time.
        let again = match entry {
            Some((k, Some(v))) if *k == key => return Some(v.clone()),
            Some((k, None)) => *k == key,
            _ => false,
        };
        let value = make.take()?()?;
        *entry = Some((key, again.then(|| value.clone())));
        Some(value)
    });
    match (cached, make) {
        (Ok(Some(value)), _) => Some(value),
        // No cache on this thread now: make the value without it.
        (_, Some(make)) => make(),
        // `make` ran and failed.
        (_, None) => None,
    }
}

/// This thread's copy of a policy's `RateLimit-Policy` value `shared`. When two policies
/// share a slot the newer one (ids only grow: after a rules reload, the live one) keeps it and
/// the older uses `shared`, so that two hot policies never evict each other on every request.
pub(super) fn policy(id: u64, shared: &HeaderValue) -> HeaderValue {
    let slot = (id.wrapping_mul(MIX) >> 60) as usize & (POLICY_SLOTS - 1);
    let found = CACHE.try_with(|c| {
        let mut c = c.try_borrow_mut().ok()?;
        match &mut c.policies[slot] {
            Some((k, v)) if *k == id => Some(v.clone()),
            Some((k, _)) if *k > id => None,
            entry => {
                // A copy with its own allocation, so that its reference count is this
                // thread's alone.
                let own = HeaderValue::from_bytes(shared.as_bytes()).ok()?;
                *entry = Some((id, own.clone()));
                Some(own)
            }
        }
    });
    match found {
        Ok(Some(v)) => v,
        _ => shared.clone(),
    }
}
