//! The backend: the shared remote engine around the Redis store.

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use smallvec::SmallVec;

use super::clock::{Clock, Time};
use super::conn::Conn;
use super::{failure, script};
use crate::backend::remote::{
    CallError, Job, Memory, Remote, RemoteFuture, RemotePolicy, Store, StoreFailure, TimeSource,
    keys,
};
use crate::backend::{Backend, Decision, Mode, ResetFuture};
use crate::quota::QuotaParams;
use crate::{BackendError, ConfigError, Key, Policy};

/// The Redis backend's counters: a remote backend's, as every remote backend reports them
/// (in [`RemoteStats`](crate::backend::remote::RemoteStats), `decisions` are requests sent to
/// Redis and `calls` the script calls they took).
pub type RedisStats = crate::backend::remote::RemoteStats;

/// A [`Backend`] keeping buckets in Redis or Redis Cluster: one limit shared by every instance
/// of an application. Cheap to clone: clones share connections, breaker and counters.
///
/// See the [module docs](super) for guarantees and failure modes, and
/// [`RedisBackend::builder`] for the options.
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) remote: Remote<RedisStore>,
}

/// The Redis protocol of the backend: the connection, the key prefix, and the script.
pub(crate) struct RedisStore {
    pub(crate) conn: Conn,
    /// Whose clock decisions read.
    pub(crate) clock: Clock,
    /// The key the clock's probes name (`<prefix>:clock`, never read nor written).
    pub(crate) clock_key: String,
    /// Where Redis is, passwords masked: for [`RedisBackend::endpoint`] and `Debug`.
    pub(crate) endpoint: String,
    pub(crate) prefix: String,
    /// Whether decisions also read and write stored format 1's keys (a rolling upgrade from
    /// the release before: `RedisBackendBuilder::upgrade_from_format_1`).
    pub(crate) format_1: bool,
}

impl RedisBackend {
    /// The backend's counters now.
    pub fn stats(&self) -> RedisStats {
        self.remote.stats()
    }

    /// Where the backend connects, with passwords replaced by `***`, for logs: the URL
    /// (`redis://:***@10.0.0.5:6379/0`), the cluster nodes' URLs separated by `, `, or
    /// `connection manager` / `cluster connection` for a connection you handed over.
    pub fn endpoint(&self) -> &str {
        &self.remote.store().endpoint
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let store = self.remote.store();
        f.debug_struct("RedisBackend")
            .field("conn", &store.conn)
            .field("endpoint", &store.endpoint)
            .field("prefix", &store.prefix)
            .field("timeout", &self.remote.timeout())
            .field("on_failure", &self.remote.on_failure())
            .field("stats", &self.stats())
            .finish()
    }
}

/// A policy prepared for the [`RedisBackend`]: its quotas as script arguments, its key prefix,
/// its own deny cache and, with
/// [`FailurePolicy::FallbackLocal`](super::FailurePolicy::FallbackLocal), its local twin.
pub struct RedisPolicy {
    inner: RemotePolicy<RedisStore>,
}

/// What the script needs of a policy, formatted once.
pub(crate) struct Prepared {
    pub(crate) key_prefix: Vec<u8>,
    /// Per quota: `2.<algorithm><quota>`, then `2.b` for blocks (see `keys::quota_keys`).
    pub(crate) key_suffixes: Vec<Box<[u8]>>,
    /// The policy's entry in the script's arguments (`script::policy_args`).
    pub(crate) args: Vec<Vec<u8>>,
    /// Integers per decision in the script's reply (`script::reply_len`).
    pub(crate) reply_len: usize,
    /// Whether the policy blocks keys once refused (`block_for`): the block's key and reply
    /// follow the quotas'.
    pub(crate) blocks: bool,
    /// Stored format 1's suffixes for the same keys, during a rolling upgrade from it
    /// (`keys::format_1_keys`): each decision reads and writes those keys too.
    pub(crate) format_1_suffixes: Option<Vec<Box<[u8]>>>,
    /// The calendar quotas' places in `args`, whose numbers each call writes (see
    /// `script::calendar_args`).
    #[cfg(feature = "calendar")]
    pub(crate) calendars: Vec<(usize, crate::quota::CalendarClock)>,
}

impl fmt::Debug for RedisPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPolicy")
            .field(
                "key_prefix",
                &String::from_utf8_lossy(&self.inner.store().key_prefix),
            )
            .field("quotas", &self.inner.params())
            .field("deny_cache_entries", &self.inner.deny_cache_len())
            .finish()
    }
}

impl Backend for RedisBackend {
    type Policy = RedisPolicy;
    type Future = RemoteFuture;

    fn prepare(&self, policy: &Policy, params: &[QuotaParams]) -> Result<RedisPolicy, ConfigError> {
        Ok(RedisPolicy {
            inner: self.remote.prepare(policy, params)?,
        })
    }

    /// The backend's clock: a test clock when one is set.
    fn now_ns(&self) -> u64 {
        self.remote.now_ns()
    }

    /// The test clock's time, or Redis's as last synced ([`RedisClock::Synced`]), else this
    /// instance's wall clock.
    ///
    /// [`RedisClock::Synced`]: super::RedisClock::Synced
    fn unix_time(&self) -> Duration {
        match self.remote.store().clock.time_now(self.remote.test_time()) {
            Some(Time::Given(ns) | Time::Test(ns)) => Duration::from_nanos(ns),
            _ => crate::backend::system_unix_time(),
        }
    }

    /// The server (or cluster) and key prefix, password masked: every backend, in any
    /// process, that names the same store shares its buckets.
    fn store_id(&self) -> Option<String> {
        let store = self.remote.store();
        Some(format!("{} prefix {:?}", store.endpoint, store.prefix))
    }

    /// A cost larger than a burst still goes to Redis (a rare request), so that the answer
    /// reports the bucket's real state; the script takes nothing for it.
    fn decide(&self, policy: &RedisPolicy, key: &Key, cost: NonZeroU32) -> RemoteFuture {
        self.remote.decide(&policy.inner, key, cost, Mode::Decide)
    }

    fn decide_with(
        &self,
        policy: &RedisPolicy,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> RemoteFuture {
        self.remote.decide(&policy.inner, key, cost, mode)
    }

    /// Deletes the key's buckets (one `DEL` of the policy's keys for `key`), but for the slots
    /// of requests still in flight (see [`Backend::reset`]).
    fn reset(&self, policy: &RedisPolicy, key: &Key) -> ResetFuture {
        let p = policy.inner.store();
        let mut base = Vec::new();
        keys::key_base(&p.key_prefix, key, &mut base);
        let mut cmd = redis::cmd("DEL");
        let suffixes = (p.key_suffixes.iter()).filter(|s| !keys::holds_slots(s));
        if suffixes.clone().next().is_none() {
            policy.inner.forget(key);
            return Box::pin(std::future::ready(Ok(())));
        }
        for suffix in suffixes {
            let mut k = base.clone();
            k.extend_from_slice(suffix);
            cmd.arg(k);
        }
        policy.inner.forget(key);
        let remote = self.remote.clone();
        Box::pin(async move {
            let store = remote.store();
            match tokio::time::timeout(remote.timeout(), store.conn.query(&cmd)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(err)) => Err(remote.backend_error(&failure::call_error(&err))),
                Err(_) => Err(BackendError::from_kind(crate::BackendErrorKind::Timeout)),
            }
        })
    }
}

impl Store for RedisStore {
    const KIND: &'static str = "redis";
    const SETTLES: bool = true;
    type Prepared = Prepared;

    fn prepare(&self, policy: &Policy, params: &[QuotaParams]) -> Result<Prepared, ConfigError> {
        let block_us = (policy.block()).map(|b| u64::try_from(b.as_micros()).unwrap_or(u64::MAX));
        Ok(Prepared {
            key_prefix: keys::policy_prefix(&self.prefix, policy.name()),
            key_suffixes: keys::quota_keys(policy, params),
            args: script::policy_args(
                params,
                policy.change_strategy(),
                block_us.map(|us| (us, policy.block_mask())),
            ),
            reply_len: script::reply_len(params) + if block_us.is_some() { 2 } else { 0 },
            blocks: block_us.is_some(),
            format_1_suffixes: self.format_1.then(|| keys::format_1_keys(params, block_us)),
            #[cfg(feature = "calendar")]
            calendars: script::calendar_slots(params),
        })
    }

    async fn call(
        &self,
        jobs: &[Job<Self>],
        now_ns: Option<u64>,
    ) -> Result<Vec<Result<Decision, BackendError>>, CallError> {
        let time = match self.clock.time_now(now_ns) {
            Some(time) => time,
            None => self.clock.time(&self.conn, now_ns).await,
        };
        let reply = match self.conn.eval(&command(jobs, time)).await {
            Ok(reply) => reply,
            // An error reply may be a server that refuses `TIME` in scripts: asked once, and
            // the call sent again on the clock found (the script reads the time before it
            // writes anything, so the failed call took nothing). Out of line: the common
            // call's future stays small.
            Err(e) if time == Time::Script && is_reply(&e) => {
                Box::pin(self.after_refusal(jobs, now_ns, e)).await?
            }
            Err(e) => return Err(failure::call_error(&e)),
        };
        // One integer more than the decisions take, -1: Redis refused the call's writes (its
        // memory full), so nothing was taken. A decision that would have taken something
        // fails (the failure policy answers it); a refusal stands, as it took nothing.
        let expected: usize = jobs.iter().map(|j| j.prepared().reply_len).sum();
        let unwritten = reply.len() == expected + 1 && reply.last() == Some(&-1);
        // A short reply gives the last decisions a short slice: they report a length mismatch
        // as a protocol error.
        let mut start = 0;
        Ok(jobs
            .iter()
            .map(|job| {
                let end = (start + job.prepared().reply_len).min(reply.len());
                let part = &reply[start..end];
                start = end;
                let p = job.prepared();
                let decision = script::decision(part, job.params(), job.cost, job.mode, p.blocks);
                match decision {
                    Ok(d) if unwritten && takes(&d, job.mode) => Err(BackendError::new(
                        crate::BackendErrorKind::Unavailable,
                        "Redis refused to write (its memory is full: maxmemory with \
                         noeviction?); nothing was taken",
                    )),
                    other => other,
                }
            })
            .collect())
    }

    /// `PING`; the first that Redis answers also finds out, with [`RedisClock::Auto`], whether
    /// scripts may read `TIME`.
    async fn ping(&self) -> Result<(), CallError> {
        self.conn
            .ping()
            .await
            .map_err(|e| failure::call_error(&e))?;
        self.clock
            .probe(&self.conn, &self.endpoint, &self.clock_key)
            .await;
        Ok(())
    }

    fn time_source(&self) -> TimeSource {
        self.clock.source()
    }

    /// One script on one key, `<prefix>:fleet` ([`announce_pipe`]).
    async fn announce(&self, id: u64, ttl: Duration) -> Result<u32, CallError> {
        let now_us = match self.clock.time(&self.conn, None).await {
            Time::Given(ns) | Time::Test(ns) => Some(ns / 1000),
            Time::Script => None,
        };
        let pipe = announce_pipe(&self.prefix, id, ttl, now_us);
        let reply = (self.conn.pipeline(&pipe).await).map_err(|e| failure::call_error(&e))?;
        announced(reply.first()).map_err(|text| CallError::new(StoreFailure::ErrorReply, text))
    }

    async fn memory(&self) -> Result<Option<Memory>, CallError> {
        read_memory(&self.conn).await.map(Some)
    }

    fn can_batch(&self) -> bool {
        matches!(self.conn, Conn::Single(_) | Conn::Sentinel(_))
    }

    fn reconnect(&self) {
        self.conn.reconnect();
    }

    /// Two keep a distant Redis busy (up to 2 × 128 decisions per round trip) while batches
    /// stay large; with Redis on the application's own core, 4 slots cost about a quarter more
    /// CPU per request than 2 (smaller batches, more switches between the two processes;
    /// BENCHMARKS.md), and 1 measured the same as 2.
    fn calls_in_flight(&self) -> usize {
        2
    }

    /// The warm-up connection may take longer than a decision's timeout (a TLS or cluster
    /// handshake); nothing waits for it. It gets a connection attempt and a `PING`'s time, so
    /// that redis-rs's own error (refused, a wrong password, its connection timeout) comes
    /// first.
    fn warm_up_timeout(&self, timeout: Duration) -> Duration {
        super::conn::connect_timeout(timeout)
            .saturating_add(timeout.max(Duration::from_millis(250)))
    }
}

impl RedisStore {
    /// A call Redis answered with an error while scripts read `TIME`: finds out whether the
    /// server refuses it ([`Clock::probe`]), and if the clock changed, sends the call again.
    #[cold]
    async fn after_refusal(
        &self,
        jobs: &[Job<Self>],
        now_ns: Option<u64>,
        error: redis::RedisError,
    ) -> Result<Vec<i64>, CallError> {
        self.clock
            .probe(&self.conn, &self.endpoint, &self.clock_key)
            .await;
        let time = self.clock.time(&self.conn, now_ns).await;
        if time == Time::Script {
            return Err(failure::call_error(&error));
        }
        (self.conn.eval(&command(jobs, time)).await).map_err(|e| failure::call_error(&e))
    }
}

/// Whether Redis answered with an error (rather than not answering).
pub(crate) fn is_reply(e: &redis::RedisError) -> bool {
    !(e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal())
}

/// Whether a decision (in `mode`) writes what it decided: an admission, a settlement. A
/// refusal and a peek write nothing (a refusal that starts a block does, but is a refusal
/// whether or not the block is written).
fn takes(decision: &Decision, mode: Mode) -> bool {
    mode != Mode::Peek && (decision.is_allowed() || mode.is_settlement())
}

/// The `EVALSHA` command for a batch, written in one buffer sized up front: the keys of every
/// decision, then each distinct policy's quotas once, then the decisions' policies and costs,
/// in runs (see `gcra.lua`).
fn command(batch: &[Job<RedisStore>], time: Time) -> redis::Cmd {
    // The batch's distinct policies (usually one or two), and each decision's, 1-based.
    let mut policies: SmallVec<[&Prepared; 4]> = SmallVec::new();
    let mut of_job: SmallVec<[usize; 128]> = SmallVec::new();
    for job in batch {
        let p = job.prepared();
        let i = match policies.iter().position(|q| std::ptr::eq(*q, p)) {
            Some(i) => i,
            None => {
                policies.push(p);
                policies.len() - 1
            }
        };
        of_job.push(i + 1);
    }
    let mut nkeys: usize = batch.iter().map(|j| j.prepared().key_suffixes.len()).sum();
    // During a rolling upgrade from format 1, its keys follow, one per key (see `gcra.lua`).
    let format_1 = batch
        .iter()
        .all(|j| j.prepared().format_1_suffixes.is_some());
    if format_1 {
        nkeys *= 2;
    }
    let policy_args: usize = policies.iter().map(|p| p.args.len()).sum();
    let runs = script::runs(
        batch
            .iter()
            .zip(&of_job)
            .map(|(job, p)| (*p, job.cost.get(), job.mode)),
    );
    let nargs = 7 + nkeys + policy_args + 5 * runs.len();
    let mut cmd = redis::Cmd::with_capacity(nargs, 64 + nkeys * 96 + nargs * 12);
    cmd.arg("EVALSHA").arg(script::SCRIPT.get_hash()).arg(nkeys);
    let mut base = Vec::with_capacity(128);
    let mut key = Vec::with_capacity(160);
    for job in batch {
        let p = job.prepared();
        keys::key_base(&p.key_prefix, &job.key, &mut base);
        for suffix in &p.key_suffixes {
            key.clear();
            key.extend_from_slice(&base);
            key.extend_from_slice(suffix);
            cmd.arg(&key[..]);
        }
    }
    if format_1 {
        for job in batch {
            let p = job.prepared();
            keys::key_base(&p.key_prefix, &job.key, &mut base);
            for suffix in p.format_1_suffixes.iter().flatten() {
                key.clear();
                key.extend_from_slice(&base);
                key.extend_from_slice(suffix);
                cmd.arg(&key[..]);
            }
        }
    }
    match time {
        Time::Script => cmd.arg(""),
        Time::Given(ns) => cmd.arg(format!("={ns}")),
        Time::Test(ns) => cmd.arg(ns),
    };
    cmd.arg(script::hex(policies.len() as u64).as_bytes());
    for p in &policies {
        #[cfg(feature = "calendar")]
        if !p.calendars.is_empty() {
            // The windows around the instance's time, Redis's time picking one of them.
            let now_us = crate::quota::CalendarClock::call_us(match time {
                Time::Given(ns) | Time::Test(ns) => Some(ns),
                Time::Script => None,
            });
            // Only a calendar policy's arguments are copied, to be written anew.
            let mut args = p.args.clone();
            for (at, calendar) in &p.calendars {
                let (boundary, lengths) = script::calendar_args(calendar, now_us);
                args[*at] = script::hex(boundary).as_bytes().to_vec();
                args[*at + 2] = script::hex(lengths).as_bytes().to_vec();
            }
            cmd.arg(&args);
            continue;
        }
        cmd.arg(&p.args);
    }
    cmd.arg(script::hex(runs.len() as u64).as_bytes());
    for run in &runs {
        for n in run {
            cmd.arg(script::hex(*n).as_bytes());
        }
    }
    if format_1 {
        cmd.arg("L");
    }
    cmd
}

/// The announcement of instance `id` (both Redis modes): one script on one key,
/// `<prefix>:fleet`, a sorted set of instance ids scored by when their announcement expires
/// (µs on Redis's clock), which drops the expired ones and counts those left.
pub(crate) fn announce_pipe(
    prefix: &str,
    id: u64,
    ttl: Duration,
    now_us: Option<u64>,
) -> redis::Pipeline {
    // Effects replication (a write after TIME) must be asked for before Redis 5. The time is
    // the caller's (ARGV[3], µs) on a Redis that refuses TIME in scripts.
    const ANNOUNCE: &str = "if redis.replicate_commands then pcall(redis.replicate_commands) end \
        local now = tonumber(ARGV[3]) \
        if now == nil then \
          local t = redis.call('TIME') \
          now = tonumber(t[1]) * 1000000 + tonumber(t[2]) \
        end \
        local ttl = tonumber(ARGV[2]) \
        redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) \
        redis.call('ZADD', KEYS[1], now + ttl, ARGV[1]) \
        redis.call('PEXPIRE', KEYS[1], math.ceil(ttl / 1000)) \
        return redis.call('ZCARD', KEYS[1])";
    let mut pipe = redis::pipe();
    pipe.cmd("EVAL")
        .arg(ANNOUNCE)
        .arg(1)
        .arg(format!("{prefix}:fleet"))
        .arg(format!("{id:016x}"))
        .arg(u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX))
        .arg(now_us.map_or(String::new(), |us| us.to_string()));
    pipe
}

/// The fleet's count in the reply to [`announce_pipe`].
pub(crate) fn announced(reply: Option<&redis::Value>) -> Result<u32, String> {
    match reply {
        Some(redis::Value::Int(n)) => Ok(u32::try_from(*n).unwrap_or(u32::MAX)),
        other => Err(format!("the fleet's count is not an integer: {other:?}")),
    }
}

/// `INFO memory` and `INFO stats` of the server (a single node, or Sentinel's primary), or of
/// every primary of a cluster, reported as the fullest of them with the keys they all evicted
/// ([`Memory::fullest`]). The approximate mode reads its Redis the same way.
pub(super) async fn read_memory(conn: &Conn) -> Result<Memory, CallError> {
    let no_memory = || CallError::new(StoreFailure::ErrorReply, "INFO without used_memory");
    let nodes = (conn.info_of_primaries(&["memory", "stats"]).await)
        .map_err(|e| failure::call_error(&e))?;
    if let Some(nodes) = nodes {
        let nodes = nodes.iter().filter_map(|t| Memory::from_info([t.as_str()]));
        return Memory::fullest(nodes).ok_or_else(no_memory);
    }
    let mut pipe = redis::pipe();
    pipe.cmd("INFO").arg("memory").cmd("INFO").arg("stats");
    let reply = (conn.pipeline(&pipe).await).map_err(|e| failure::call_error(&e))?;
    let texts: Vec<String> = reply
        .iter()
        .filter_map(|v| redis::from_redis_value_ref::<String>(v).ok())
        .collect();
    Memory::from_info(texts.iter().map(String::as_str)).ok_or_else(no_memory)
}
