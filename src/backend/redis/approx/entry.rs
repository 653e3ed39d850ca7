//! A key's entry in its policy's table: the counts it holds here, what it has yet to send,
//! and the clock it reads.

use super::*;

/// A key's entry as its policy's table holds it.
pub(crate) struct Held {
    pub(super) entry: Arc<Entry>,
    /// Until when (µs) the key surely has counts in a window ([`PolicyShared::idle_at`] of
    /// its last decision): a sweep passes it by without reading the entry, which at a million
    /// keys is a cache miss each.
    pub(super) busy_until_us: AtomicU64,
}

/// One key's counts under one policy.
pub(crate) struct Entry {
    pub(super) key: Key,
    /// `<prefix>:{<policy>:<key>}:`, the hash-tagged start of its Redis keys, and its hash (to
    /// look it up among the keys announced by other instances): made the first time the key
    /// is sent, read or looked up among announcements (which a quiet key is only while some
    /// key of the fleet is announced).
    pub(super) base: OnceLock<(Box<[u8]>, u64)>,
    pub(super) state: Mutex<EntryState>,
}

pub(super) struct EntryState {
    pub(super) quotas: SmallVec<[Counts; 1]>,
    /// In the queue of the next flush.
    pub(super) queued: bool,
    /// A read of its counts is on its way.
    pub(super) reading: bool,
    /// Replies to increments taken in so far: a read during which another was taken in may
    /// be older than the counts held (the two calls may have run in either order).
    pub(super) confirmations: u64,
    /// Within its allowance: its units are held back, its counts not read.
    pub(super) quiet: bool,
    /// Until when (µs) the key stays in step: announced by this instance or another.
    pub(super) hot_until_us: u64,
    /// Until when (µs) the key is blocked (`block_for`), as this instance knows: a block it
    /// started, or one it read from Redis.
    pub(super) blocked_until_us: u64,
    /// A block this instance started and has not written to Redis yet.
    pub(super) block_owed: bool,
}

impl EntryState {
    pub(super) fn new(policy: &PolicyShared) -> Self {
        EntryState {
            quotas: policy.specs.iter().map(Counts::new).collect(),
            queued: false,
            reading: false,
            confirmations: 0,
            quiet: false,
            hot_until_us: 0,
            blocked_until_us: 0,
            block_owed: false,
        }
    }
}

impl Entry {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, EntryState> {
        // The state is a few counters updated by arithmetic that does not panic: a poisoned
        // lock still holds usable counts.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hash-tagged start of the key's Redis keys, and its hash.
    pub(super) fn base(&self, policy: &PolicyShared, s: &Shared) -> &(Box<[u8]>, u64) {
        self.base.get_or_init(|| {
            let mut base = Vec::new();
            keys::key_base(&policy.key_prefix, &self.key, &mut base);
            let hash = s.hasher.hash_one(&base[..]);
            (base.into_boxed_slice(), hash)
        })
    }

    /// The Redis key of the key's block (`block_for`): `<prefix>:{<policy>:<key>}:blk`.
    pub(super) fn block_key(&self, policy: &PolicyShared, s: &Shared) -> Vec<u8> {
        let mut k = self.base(policy, s).0.to_vec();
        k.extend_from_slice(b"blk");
        k
    }

    /// The Redis key of quota `spec`'s sub-window `slice`.
    pub(super) fn redis_key(
        &self,
        policy: &PolicyShared,
        s: &Shared,
        spec: &Spec,
        slice: u64,
    ) -> Vec<u8> {
        counter_key(&self.base(policy, s).0, spec, slice)
    }
}

/// The Redis key of quota `spec`'s sub-window `slice` for the key whose keys start with
/// `base` (`<prefix>:{<policy>:<key>}:`).
pub(super) fn counter_key(base: &[u8], spec: &Spec, slice: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(base.len() + spec.suffix.len() + 21);
    k.extend_from_slice(base);
    k.extend_from_slice(&spec.suffix);
    k.push(b':');
    k.extend_from_slice(itoa::Buffer::new().format(slice).as_bytes());
    k
}

/// Time in µs since the Unix epoch.
pub(super) enum Now {
    Real { epoch_us: u64, origin: Instant },
    Test(TestClock),
}

impl Now {
    pub(super) fn us(&self) -> u64 {
        match self {
            Now::Real { epoch_us, origin } => {
                epoch_us + u64::try_from(origin.elapsed().as_micros()).unwrap_or(u64::MAX / 2)
            }
            Now::Test(c) => c.now_ns() / 1000,
        }
    }
}
