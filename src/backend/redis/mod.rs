//! The Redis backend (feature `redis`): one limit shared by every instance of an application,
//! on a single Redis server or a Redis Cluster.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::backend::redis::{FailurePolicy, RedisBackend};
//! use tollgate::{Policy, Quota, RateLimitLayer, key::ClientIp};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! // Nothing connects here: this works, and the app starts, even when Redis is down.
//! let backend = RedisBackend::builder()
//!     .url("redis://127.0.0.1:1") // a port where nothing listens
//!     .timeout(Duration::from_millis(50))
//!     .on_failure(FailurePolicy::FailOpen)
//!     .build()?;
//! let layer = RateLimitLayer::builder()
//!     .policy(Policy::new("api", Quota::per_second(5).burst(10)))
//!     .key(ClientIp::new())
//!     .backend(backend.clone())
//!     .build()?;
//! # drop(layer);
//! assert_eq!(backend.stats().decisions, 0);
//! # Ok(()) }
//! ```
//!
//! A decision is one run of a Lua script (`EVALSHA`, loaded again by itself after
//! `SCRIPT FLUSH`, a restart or a failover) that decides every quota of the policy, whatever
//! its [algorithm](crate::quota::Algorithm): GCRA, fixed window or sliding window, mixed freely in one
//! policy. On a single node, concurrent decisions share calls (see [Batching](#batching) below). Connect
//! with
//! [`url`](RedisBackendBuilder::url) (one node), [`cluster_nodes`](RedisBackendBuilder::cluster_nodes)
//! (Redis Cluster), [`sentinel`](RedisBackendBuilder::sentinel) (a primary found through Redis
//! Sentinel), or hand over your own redis-rs
//! [`ConnectionManager`](redis::aio::ConnectionManager) or
//! [`ClusterConnection`](redis::cluster_async::ClusterConnection):
//!
//! ```no_run
//! use std::num::NonZeroU32;
//! use tollgate::backend::{Backend, redis::RedisBackend};
//! use tollgate::{Key, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::builder()
//!     .cluster_nodes(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
//!     .build()?;
//! let policy = Policy::new("api", Quota::per_second(5).burst(10));
//! let prepared = backend.prepare(&policy, &policy.validate()?)?;
//! let decision = backend.decide(&prepared, &Key::from_bytes("alice")?, NonZeroU32::MIN).await?;
//! assert_eq!(decision.quotas()[0].remaining, 9); // on a fresh bucket
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! - **Atomic and shared.** A decision is one script run; Redis runs scripts one at a time, so
//!   concurrent requests from any number of instances never take more than a bucket holds.
//! - **All-or-nothing across quotas.** Every quota of the policy is checked before any is
//!   updated: a denied request takes nothing from any bucket. Its [`Decision`] lists every
//!   quota; those that had room are reported as allowed with the units they still hold.
//! - **Same single-quota semantics as the local backend.** Both run the same algorithms with
//!   the same parameters and build `remaining`, `retry_after` and `reset_after` with the same
//!   arithmetic: GCRA's states come from the same constructors, and the script computes the
//!   windows with the formulas of the local backend's window code, in the same floating-point
//!   operations in the same order, so the numbers agree to the microsecond. One conformance
//!   suite (the redis-cell `CL.THROTTLE` vectors, window boundaries, sliding windows of one and
//!   of twelve sub-windows, among others) runs against both.
//!   Multi-quota policies are all-or-nothing on both (here in one atomic step; there by giving
//!   back what earlier quotas took when a later one refuses). A quota whose values change keeps what its keys used on both, as
//!   the policy's [`OnChange`](crate::quota::OnChange) says (the values are not part of its
//!   Redis key; each value says what it was counted under).
//! - **Exact integer time.** Time comes from Redis `TIME` (never the instances' clocks, which
//!   may disagree) and is kept in integer nanoseconds for GCRA, integer microseconds since the
//!   Unix epoch for windows (so windows start at the same instants as on the local backend):
//!   after one request on a fresh burst-10 bucket, `remaining` is exactly 9. GCRA arithmetic
//!   is exact for buckets that refill within 104 days (burst × period / count); longer ones
//!   may be off by a few nanoseconds.
//! - **Nothing left behind.** A GCRA bucket's key expires when the bucket would be full again,
//!   a fixed window's at the window's end, a sliding window's when all its counts have slid
//!   out of the window.
//! - **Cost larger than the burst** (or a window's limit) is answered
//!   [`NeverFits`](crate::backend::Outcome::NeverFits), with the quota's real state from Redis
//!   (nothing taken), or as an untouched quota when Redis cannot be asked.
//! - **Keys** are `<prefix>:{<policy>:<client key>}:2.<algorithm><quota>`, one string per
//!   quota (stored format 2): the algorithm a letter, the quota its place in the policy or
//!   `-<name>`, so that a changed quota keeps its key and a changed algorithm gets another;
//!   values are binary (Redis's `struct` library, little-endian), so that the script parses
//!   and formats no number as text, and each ends with the values it was counted under and
//!   the format (`<dI4I4B`):
//!
//!   | algorithm | suffix | value |
//!   |---|---|---|
//!   | GCRA | `2.g<quota>` | the theoretical arrival time: unix seconds, nanoseconds (`<I4I4`) |
//!   | fixed window | `2.f<quota>` | window index, count (`<dI4`) |
//!   | sliding window | `2.s<quota>` | newest sub-window index, then the counts, oldest first (`<d`, sub-windows + 1 × `I4`) |
//!
//!   Client keys are escaped so that none can reach another's key, keys are of bounded length,
//!   and all quotas of one decision share one Redis Cluster hash slot (the suffix is outside
//!   the hash tag). For example `tollgate:{api:balice}:2.g0` for the key `alice` under the
//!   policy's first quota, and `tollgate:{api:balice}:2.s-minute` for a sliding-window quota
//!   named `minute`. Keys written by earlier formats (tollgate 0.1's text values, format 1's
//!   values in the key's name) are never read and expire by themselves: see
//!   `docs/redis.md`, "Upgrading".
//!
//! # When Redis fails
//!
//! Every decision is bounded by a [timeout](RedisBackendBuilder::timeout) (100 ms by default),
//! counted from the moment it is asked for. A decision whose call errs or times out is answered
//! by the [`FailurePolicy`]: fall back to a per-instance [`LocalBackend`] holding the same
//! policy at the instance's share (the default), fail open (no limit), or fail closed (the
//! layer answers `503`). After 5 consecutive
//! failed calls (timeouts, connection errors and refused credentials; a batched call counts
//! once, however many requests it carried) a circuit breaker opens: requests stop calling Redis
//! and get the failure policy at once, without waiting for a timeout, while a background task
//! sends `PING` every 500 ms and closes the breaker on the first answer. The connection is made
//! again by the next call or probe after it broke, so shared limiting resumes within about a
//! second of Redis coming back, without restarting anything. [`RedisBackend::stats`] counts
//! decisions and script calls, failed calls and timeouts, fail-open, fail-closed and fallback
//! answers, deny-cache hits and breaker trips, and tells why Redis is failing
//! ([`RedisStats::failing`]).
//!
//! The log has one warning when Redis starts failing, naming the real cause (`connection
//! refused`, `authentication failed`, ...) and what requests get until Redis answers, and one
//! info line when it answers again; nothing per request or per failed call at these levels. A
//! failed connection attempt reports its cause at once (redis-rs does not retry it with a
//! backoff that would outlast the timeout and show only timeouts). Passwords never appear in
//! errors, logs, `Debug` output or [`RedisBackend::endpoint`]: URLs are shown as
//! `redis://user:***@host:6379/0`.
//!
//! A script call is never sent again once Redis may have run it (the script is not idempotent:
//! a second run would charge the request twice). On a Redis Cluster, the backend follows
//! `MOVED` and `ASK` redirections and waits out `TRYAGAIN`, `CLUSTERDOWN` and similar replies,
//! which Redis gives before running anything; after a dropped connection the request gets the
//! failure policy. A [`ClusterConnection`](redis::cluster_async::ClusterConnection) you hand
//! over keeps its own retry settings (see
//! [`cluster_connection`](RedisBackendBuilder::cluster_connection)).
//!
//! On a Redis Cluster there is still one circuit breaker for the whole cluster, counting failed
//! calls in a row whatever node they went to. With one primary out of reach, calls to the
//! others keep succeeding and resetting the count, so the breaker usually stays closed:
//! requests whose keys live on the missing primary each wait for the timeout (or a connection
//! error) and get the failure policy, the others are limited as usual. When failures do come 5
//! in a row (little traffic, or most of it on that primary's slots), the breaker opens for the
//! whole cluster, and requests for healthy primaries get the failure policy too. Its `PING`
//! probe goes to every primary, so it fails as long as one is out of reach; the breaker then
//! closes through the request it lets through every four probe intervals (2 s by default) as a
//! trial, once that request reaches a healthy primary, or when the primary answers again (it
//! is back, or a failover replaced it).
//!
//! The backend needs a Tokio runtime with its time driver (as `#[tokio::main]` sets up): the
//! connections, the timeouts and the probe run on it.
//!
//! What this cannot do: a timed-out decision may still reach Redis and take its units (its
//! call may even succeed for the other decisions it carries, after it gave up); while
//! failing open, limits are not enforced; a fallback to local limits allows up to `n` times the
//! quota with `n` instances, and its buckets know nothing of Redis's (full at a client's first
//! outage; at a later one, what was left at the end of the previous one, refilled since); if
//! Redis loses data (a restart without persistence, a failover before replication), buckets
//! start full again.
//!
//! # Local deny cache
//!
//! Once Redis denied a key with a retry time `T`, the instance answers that key itself until
//! `T`, so a denied client hammering the API costs Redis nothing. This is exact: no request
//! Redis would allow is denied by the cache, and the waits it reports shrink with the time
//! passed as Redis's would (see below for GCRA; for windows, see the next paragraph). Its size
//! is bounded
//! ([`deny_cache_capacity`](RedisBackendBuilder::deny_cache_capacity)), and its entries belong
//! to the prepared policy, so a policy replaced at run time starts with an empty cache.
//!
//! A request of cost `c` passes quota `q` at time `now` exactly when
//! `now ≥ TAT_q + (c − 1)·T_q − τ_q`, where `TAT_q` is the bucket's theoretical arrival time.
//! The script only ever moves a `TAT` later (an allowed request sets it to
//! `max(TAT, now) + c·T`), and an expired key is a `TAT` in the past, which behaves as a fresh
//! bucket. So the earliest time a denied request can pass never moves earlier, whatever other
//! instances do: Redis's `retry_after` is a lower bound that stays valid, and the cache counts
//! it from the moment the call was sent (not later than Redis's own `now`). The only exceptions
//! are outside changes to the keys (deleting them, or Redis losing them), and clocks: the
//! cache times entries on this instance's monotonic clock while Redis decides on its `TIME`,
//! so if Redis's clock steps forward by Δ (NTP, a failover to a node whose clock is ahead) it
//! would allow a denied client up to Δ earlier than the cache. In those cases the cache denies
//! for at most the retry time it had been given.
//!
//! Windows behave the same way. In a fixed window the count only grows until the window's end,
//! which is the `retry_after` Redis gives, for any larger cost too. In a sliding window, with
//! nothing more counted the estimate only falls, and more counts only raise it, so the retry
//! time stays a valid bound; but `remaining` grows at `reset_after` and a larger cost's wait
//! depends on counts that only Redis holds, so a sliding window's denial is cached until its
//! `reset_after` (for a denied request of cost 1 that is its `retry_after`) and answers
//! requests of the same cost only. A larger cost is answered from the cache only when every
//! quota denied, none is a sliding window, and the cost fits every quota.
//!
//! # Batching
//!
//! On a single node, requests queue their decisions for a task of the backend, which sends
//! whatever is queued as one script call (up to 128 decisions) as soon as one of 2 call slots
//! is free: an idle backend sends each decision at once, a busy one pays Redis's per-call cost
//! once per batch. Calls belong to that task, so a request that times out or is dropped affects
//! no other. Each decision keeps its own timeout: a call runs until the last deadline of its
//! decisions, and a decision whose deadline passes first gets its failure policy then. Inside a call the script runs the decisions one after another, each atomic and
//! all-or-nothing on its own; a decision whose keys Redis refuses (a key of the wrong type)
//! fails alone, as a protocol error, before touching any bucket (and does not count toward the
//! circuit breaker, which only counts timeouts and connection failures). Redis Cluster
//! connections do not batch, and [`batching(false)`](RedisBackendBuilder::batching) turns it
//! off for proxies that shard one endpoint.
//!
//! # Testing hook
//!
//! [`RedisBackendBuilder::test_clock`] (hidden from the docs) makes the script use a
//! manually advanced time instead of `TIME`, so that the conformance suite can script time for
//! this backend as it does with governor's `FakeRelativeClock` for the local one. It is passed
//! as one extra script argument; production builders never set it.
//!
//! [`Decision`]: crate::backend::Decision
//! [`LocalBackend`]: crate::backend::LocalBackend

pub mod approx;
mod backend;
mod builder;
mod clock;
mod conn;
mod failure;
pub(crate) mod script;
mod tls;

/// The future of a Redis decision (the future of every remote backend).
pub use crate::backend::remote::RemoteFuture as RedisFuture;
/// Why Redis is failing, in [`RedisStats::failing`]: the cause every remote backend reports.
pub use crate::backend::remote::StoreFailure as RedisFailure;
#[doc(hidden)]
pub use crate::backend::remote::TestClock;
/// What requests get while Redis cannot decide: the failure policy of every remote backend.
pub use crate::backend::remote::{FailurePolicy, Fleet};
pub use approx::{ApproxBackend, ApproxFuture, ApproxPolicy, ApproxStats, Approximate};
pub use backend::{RedisBackend, RedisPolicy, RedisStats};
pub use builder::RedisBackendBuilder;
pub use clock::RedisClock;
/// The redis-rs crate this backend speaks through, so that a connection handed to
/// [`connection_manager`](RedisBackendBuilder::connection_manager) or
/// [`cluster_connection`](RedisBackendBuilder::cluster_connection) is of the right version
/// without matching it by hand: `tollgate::backend::redis::redis::aio::ConnectionManager`.
pub use redis;

/// The Lua script the backend runs, for tools that want to load or benchmark it
/// (`scripts/bench-redis-ceiling.sh` runs it with `redis-benchmark`).
pub const SCRIPT_SOURCE: &str = script::SOURCE;
