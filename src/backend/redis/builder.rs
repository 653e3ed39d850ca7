//! Configuring a [`RedisBackend`].

use std::fmt;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;

use super::backend::{RedisBackend, RedisStore};
use super::clock::{Clock, RedisClock};
use super::conn::{Conn, Lazy, connect_timeout};
use super::tls;
use crate::ConfigError;
use crate::backend::remote::redact::{self, Secrets};
use crate::backend::remote::{FailurePolicy, MAX_DURATION, Options, Remote, TestClock, keys};

/// Configures a [`RedisBackend`]: where Redis is, and how to behave when it fails. Methods take
/// and return the builder by value.
///
/// | option | default |
/// |---|---|
/// | connection | none: one of [`url`](Self::url), [`cluster_nodes`](Self::cluster_nodes), [`connection_manager`](Self::connection_manager), [`cluster_connection`](Self::cluster_connection) |
/// | [`prefix`](Self::prefix) | `tollgate` |
/// | [`clock`](Self::clock) | [`RedisClock::Auto`]: Redis's `TIME` in the script, or what the server allows |
/// | [`timeout`](Self::timeout) | 100 ms |
/// | [`on_failure`](Self::on_failure) | [`FailurePolicy::FailOpen`] |
/// | [`fleet`](Self::fleet) | announced every second (used by the local fallback only) |
/// | [`circuit_breaker`](Self::circuit_breaker) | open after 5 consecutive failed calls, probe every 500 ms |
/// | [`deny_cache_capacity`](Self::deny_cache_capacity) | 65 536 denials |
#[must_use = "call `.build()` to get a backend"]
#[derive(Clone)]
pub struct RedisBackendBuilder {
    target: Option<Target>,
    prefix: String,
    opts: Options,
    /// PEM: a CA to trust besides the system's, and a client certificate and key.
    tls_ca: Option<Vec<u8>>,
    tls_client: Option<(Vec<u8>, Vec<u8>)>,
    clock: RedisClock,
    format_1: bool,
}

#[derive(Clone)]
enum Target {
    Url(String),
    Cluster(Vec<String>),
    Sentinel { master: String, nodes: Vec<String> },
    Manager(ConnectionManager),
    ClusterConnection(ClusterConnection),
}

impl RedisBackend {
    /// Starts configuring a backend; see [`RedisBackendBuilder`] for the defaults.
    pub fn builder() -> RedisBackendBuilder {
        RedisBackendBuilder {
            target: None,
            prefix: "tollgate".to_owned(),
            opts: Options::default(),
            tls_ca: None,
            tls_client: None,
            clock: RedisClock::Auto,
            format_1: false,
        }
    }
}

impl RedisBackendBuilder {
    /// A single Redis server, e.g. `redis://127.0.0.1:6379` or `redis://:password@host/2`
    /// (`redis+unix:///path` for a Unix socket). One multiplexed connection carries every
    /// decision and is re-established when it breaks.
    ///
    /// The password is never shown: errors, logs, `Debug` and
    /// [`RedisBackend::endpoint`] print the URL as `redis://:***@host/2`.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.target = Some(Target::Url(url.into()));
        self
    }

    /// A Redis Cluster, from the URLs of some of its nodes (the others are discovered).
    ///
    /// The backend's cluster client resends nothing after a dropped connection (Redis may have
    /// run the script already, and running it twice would charge the request twice); it
    /// follows `MOVED` and `ASK` redirections and waits out `TRYAGAIN`, `CLUSTERDOWN` and
    /// similar replies, which Redis gives before running anything, within the
    /// [timeout](Self::timeout).
    pub fn cluster_nodes<I, S>(mut self, nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.target = Some(Target::Cluster(nodes.into_iter().map(Into::into).collect()));
        self
    }

    /// A primary found through Redis Sentinel: `master` is the name the sentinels monitor it
    /// by, `sentinels` the URLs of some sentinels (`redis://10.0.0.1:26379`). The backend asks
    /// them for the primary when it connects, and again whenever it drops its connection (the
    /// circuit breaker opened, a probe failed): after a failover, shared limiting resumes on the
    /// promoted replica (see docs/redis.md for the time it takes). A password in the sentinels'
    /// URLs is used for the primary too.
    pub fn sentinel<I, S>(mut self, master: impl Into<String>, sentinels: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.target = Some(Target::Sentinel {
            master: master.into(),
            nodes: sentinels.into_iter().map(Into::into).collect(),
        });
        self
    }

    /// A connection you made, shared with the rest of your application. Its own timeouts and
    /// reconnection settings apply; [`timeout`](Self::timeout) still bounds every call.
    pub fn connection_manager(mut self, conn: ConnectionManager) -> Self {
        self.target = Some(Target::Manager(conn));
        self
    }

    /// A cluster connection you made, shared with the rest of your application.
    ///
    /// Its client's retry settings apply, and redis-rs retries by default (16 times), including
    /// after a dropped connection, when Redis may already have run the script: a request may
    /// then be charged twice. Build the `ClusterClient` with `.retries(0)` to avoid that; the
    /// backend then follows redirections itself, as with [`cluster_nodes`](Self::cluster_nodes).
    pub fn cluster_connection(mut self, conn: ClusterConnection) -> Self {
        self.target = Some(Target::ClusterConnection(conn));
        self
    }

    /// TLS (`rediss://` URLs and cluster nodes, feature `redis-tls`): a CA certificate (PEM) to
    /// trust besides the system's roots, e.g. a managed service's or your own.
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_ca = Some(pem.into());
        self
    }

    /// TLS (feature `redis-tls`): a client certificate and its private key (PEM), for servers
    /// that require clients to authenticate with one (`tls-auth-clients yes`).
    pub fn tls_client_cert(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls_client = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// The first part of every key (default `tollgate`): 1 to 64 visible ASCII characters,
    /// without `{` or `}`. Keys are
    /// `<prefix>:{<policy>:<client key>}:<quota index>:<emission interval in ns>x<burst>`
    /// (see the [module docs](super#guarantees)).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Whose clock decisions read (default [`RedisClock::Auto`]: Redis's, inside the script,
    /// unless the server refuses `TIME` there; see [`RedisClock`] for what each choice
    /// guarantees). Choose [`Synced`](RedisClock::Synced) or [`Instances`](RedisClock::Instances)
    /// for a managed service known to refuse `TIME` in scripts, to skip finding out.
    pub fn clock(mut self, clock: RedisClock) -> Self {
        self.clock = clock;
        self
    }

    /// How long one decision may wait for Redis (default 100 ms, at least 1 ms, at most an
    /// hour) before the [failure policy](Self::on_failure) answers instead, counted from the
    /// moment it is asked for. A call that timed out may still reach Redis and take its units.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.opts.timeout = timeout.clamp(Duration::from_millis(1), MAX_DURATION);
        self
    }

    /// What requests get while Redis cannot decide, or refuses to count (its memory full):
    /// by default [`FailurePolicy::FallbackLocal`], each instance at its share of every quota,
    /// so that a failing or full Redis never means no limit.
    pub fn on_failure(mut self, policy: FailurePolicy) -> Self {
        self.opts.on_failure = policy;
        self
    }

    /// How many instances share Redis, for the local fallback's share of each quota (default:
    /// [announced](crate::backend::remote::Fleet::Announced) every second, in `<prefix>:fleet`).
    pub fn fleet(mut self, fleet: crate::backend::remote::Fleet) -> Self {
        self.opts.fleet = fleet.bounded();
        self
    }

    /// After `consecutive_failures` failed calls in a row (at least 1), stop calling Redis and
    /// apply the failure policy at once; probe Redis with `PING` every `probe_interval` (at
    /// least 10 ms, at most an hour) and resume on the first answer.
    ///
    /// A call is one script call: on a single node, concurrent decisions share calls, and a
    /// failed call counts once however many requests it carried. Timeouts and connection
    /// errors count; errors Redis answers with (a refused key) do not. There is one breaker per
    /// backend, also on a Redis Cluster: see the [module docs](super#when-redis-fails).
    pub fn circuit_breaker(mut self, consecutive_failures: u32, probe_interval: Duration) -> Self {
        self.opts.breaker_threshold = consecutive_failures.max(1);
        self.opts.probe_interval = probe_interval.clamp(Duration::from_millis(10), MAX_DURATION);
        self
    }

    /// The most denials kept in the local deny cache, over all policies (default 65 536);
    /// `0` turns the cache off.
    pub fn deny_cache_capacity(mut self, capacity: usize) -> Self {
        self.opts.deny_cache_capacity = capacity;
        self
    }

    /// Whether concurrent decisions share script calls on a single node (default `true`; see
    /// the [module docs](super#batching)). Turn it off behind a proxy that shards one endpoint
    /// over several Redis nodes (decisions of different clients live in different slots).
    /// Redis Cluster connections never batch.
    pub fn batching(mut self, on: bool) -> Self {
        self.opts.batching = on;
        self
    }

    /// How often the backend reads Redis's memory (`INFO memory` and `INFO stats`; default
    /// every 10 s, `None` for never): its use and `maxmemory` and the keys it evicted, in
    /// [`RedisBackend::stats`] and the metrics `tollgate_store_memory_used_bytes`,
    /// `tollgate_store_memory_max_bytes` and `tollgate_store_evicted_keys_total`, with a
    /// warning when Redis evicts keys (rate limits' counts lost), when its `maxmemory-policy`
    /// evicts at all, and when it is at 90 % of its memory under `noeviction`. Needs the
    /// `INFO` command (an ACL user without it: said once, not watched). On a Redis Cluster
    /// every primary is read, and the fullest one reported (by the share of its `maxmemory`
    /// it uses), with the keys all of them evicted and the warnings of any of them. The
    /// [approximate mode](super::approx) watches the same way (in
    /// [`ApproxStats`](super::ApproxStats)).
    pub fn watch_memory(mut self, every: Option<Duration>) -> Self {
        self.opts.memory_watch = every.map(|d| d.clamp(Duration::from_millis(10), MAX_DURATION));
        self
    }

    /// During a rolling upgrade from the release before this one (stored format 1, whose
    /// keys named a quota's values, `…:0g200000000x10`): every decision also reads the key
    /// format 1 gives its quota (for the quota's values now), and takes its state when it
    /// exists, and writes it beside its own; so instances of both releases keep one limit
    /// while they run side by side. Off by default: it costs one more key per quota in every
    /// call. Turn it on for the rollout, and off once no instance of the old release runs
    /// (format 1's keys then expire by themselves). Requests in flight (`Quota::concurrent`)
    /// are not shared with the old release during the rollout: its slots and this release's
    /// are counted apart. See `docs/redis.md`, "Upgrading".
    pub fn upgrade_from_format_1(mut self, on: bool) -> Self {
        self.format_1 = on;
        self
    }

    /// **Tests only.** Makes the script use `clock`'s time instead of Redis `TIME`, and the
    /// deny cache use it instead of the monotonic clock, so that a test can script time as
    /// with governor's `FakeRelativeClock`. Keys still expire on Redis's real clock.
    #[doc(hidden)]
    pub fn test_clock(mut self, clock: TestClock) -> Self {
        self.opts.test_clock = Some(clock);
        self
    }

    /// Checks the options and builds the backend. Nothing is connected yet, so this neither
    /// blocks nor fails when Redis is down: connections are made in the background from the
    /// first prepared policy (or the first decision) on, inside the Tokio runtime.
    pub fn build(self) -> Result<RedisBackend, ConfigError> {
        let clock = Clock::new(self.clock);
        let format_1 = self.format_1;
        let c = self.connect()?;
        let store = RedisStore {
            conn: c.conn,
            clock,
            clock_key: format!("{}:clock", c.prefix),
            endpoint: c.endpoint,
            prefix: c.prefix,
            format_1,
        };
        Ok(RedisBackend {
            remote: Remote::new(store, c.who, c.secrets, c.opts),
        })
    }

    /// Builds the [approximate mode](super::approx): decisions made in this process from counts
    /// kept in step with Redis, as `mode` says. The connection, [`prefix`](Self::prefix),
    /// [`timeout`](Self::timeout) and [`circuit_breaker`](Self::circuit_breaker) options apply;
    /// the failure policy and the deny cache do not (the mode decides locally whatever Redis
    /// does, and denies without Redis anyway).
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build).
    pub fn build_approximate(
        self,
        mode: super::approx::Approximate,
    ) -> Result<super::approx::ApproxBackend, ConfigError> {
        // The exact backend a policy's concurrent quotas are decided by, with a connection of
        // its own (made when a policy first uses it).
        // One member of the fleet's announcements for both: the process is one instance.
        let mut this = self;
        this.opts.fleet_id = Some(crate::backend::next_lease());
        let exact = this.clone().build()?;
        let c = this.connect()?;
        Ok(super::approx::ApproxBackend::new(
            c.conn, c.endpoint, c.prefix, c.opts, mode, exact,
        ))
    }

    fn connect(self) -> Result<Connected, ConfigError> {
        keys::validate_prefix(&self.prefix)?;
        let (endpoint, who, secrets) = describe(self.target.as_ref());
        let conn = match self.target {
            None => {
                return Err(ConfigError::Invalid {
                    option: "connection",
                    reason: "no Redis configured: call `url(..)`, `cluster_nodes(..)`, \
                             `connection_manager(..)` or `cluster_connection(..)`"
                        .to_owned(),
                });
            }
            Some(Target::Url(url)) => {
                let tls = tls::certificates(&[url.as_str()], self.tls_ca, self.tls_client)?;
                let client = tls::client(url.as_str(), tls).map_err(|e| ConfigError::Invalid {
                    option: "url",
                    reason: format!("{endpoint:?}: {}", secrets.scrub(&e.to_string())),
                })?;
                Conn::Single(Lazy::from_source((
                    client,
                    manager_config(self.opts.timeout),
                )))
            }
            Some(Target::Cluster(nodes)) => {
                if nodes.is_empty() {
                    return Err(ConfigError::Invalid {
                        option: "cluster_nodes",
                        reason: "no node URL given".to_owned(),
                    });
                }
                // No retries inside redis-rs: it would also resend a script after a dropped
                // connection, when Redis may already have run it, charging the request twice
                // (the script is not idempotent). The backend retries by itself only the
                // replies that prove the script did not run: redirections and cluster state
                // errors (see `conn::eval_cluster`).
                let urls: Vec<&str> = nodes.iter().map(String::as_str).collect();
                let tls = tls::certificates(&urls, self.tls_ca, self.tls_client)?;
                let client = tls::cluster(ClusterClient::builder(urls).retries(0), tls)
                    .build()
                    .map_err(|e| ConfigError::Invalid {
                        option: "cluster_nodes",
                        reason: format!("[{endpoint}]: {}", secrets.scrub(&e.to_string())),
                    })?;
                let config = ClusterConfig::new()
                    .set_connection_timeout(connect_timeout(self.opts.timeout))
                    .set_response_timeout(self.opts.timeout.max(Duration::from_millis(250)));
                Conn::Cluster(Lazy::from_source((client, config)))
            }
            Some(Target::Sentinel { master, nodes }) => {
                let invalid = |reason: String| ConfigError::Invalid {
                    option: "sentinel",
                    reason,
                };
                if nodes.is_empty() {
                    return Err(invalid("no sentinel URL given".to_owned()));
                }
                let node_info = sentinel_node_info(&nodes[0]);
                let client = redis::sentinel::SentinelClient::build(
                    nodes.iter().map(String::as_str).collect(),
                    master,
                    node_info,
                    redis::sentinel::SentinelServerType::Master,
                )
                .map_err(|e| invalid(format!("[{endpoint}]: {}", secrets.scrub(&e.to_string()))))?;
                Conn::Sentinel(Box::new(super::conn::SentinelConn {
                    client: tokio::sync::Mutex::new(client),
                    conn: Default::default(),
                    config: manager_config(self.opts.timeout),
                }))
            }
            Some(Target::Manager(c)) => Conn::Single(Lazy::ready(c)),
            Some(Target::ClusterConnection(c)) => Conn::Cluster(Lazy::ready(c)),
        };
        Ok(Connected {
            conn,
            endpoint,
            who,
            secrets,
            prefix: self.prefix,
            opts: self.opts,
        })
    }
}

/// What every Redis mode is built from.
struct Connected {
    conn: Conn,
    endpoint: String,
    who: String,
    secrets: Secrets,
    prefix: String,
    opts: Options,
}

/// Where a target is, passwords masked (for `RedisBackend::endpoint`), the same in a phrase for
/// logs, and the passwords to remove from error texts.
fn describe(target: Option<&Target>) -> (String, String, Secrets) {
    match target {
        None => (String::new(), "Redis".to_owned(), Secrets::default()),
        Some(Target::Url(url)) => {
            let shown = redact::url(url);
            let who = format!("Redis at {shown}");
            (shown, who, Secrets::of([url.as_str()]))
        }
        Some(Target::Cluster(nodes)) => {
            let shown = nodes
                .iter()
                .map(|n| redact::url(n))
                .collect::<Vec<_>>()
                .join(", ");
            let who = format!("Redis Cluster at {shown}");
            (shown, who, Secrets::of(nodes.iter().map(String::as_str)))
        }
        Some(Target::Sentinel { master, nodes }) => {
            let shown = nodes
                .iter()
                .map(|n| redact::url(n))
                .collect::<Vec<_>>()
                .join(", ");
            let who = format!("Redis primary {master:?} through Sentinel at {shown}");
            (
                format!("sentinel {master} at {shown}"),
                who,
                Secrets::of(nodes.iter().map(String::as_str)),
            )
        }
        Some(Target::Manager(_)) => (
            "connection manager".to_owned(),
            "Redis (through the connection manager given)".to_owned(),
            Secrets::default(),
        ),
        Some(Target::ClusterConnection(_)) => (
            "cluster connection".to_owned(),
            "Redis Cluster (through the cluster connection given)".to_owned(),
            Secrets::default(),
        ),
    }
}

/// The primary's credentials and database, from the first sentinel URL (sentinels and the
/// primary usually share a password), when it has any.
fn sentinel_node_info(url: &str) -> Option<redis::sentinel::SentinelNodeConnectionInfo> {
    use redis::IntoConnectionInfo;
    let info = url.into_connection_info().ok()?;
    Some(
        redis::sentinel::SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(info.redis_settings().clone()),
    )
}

/// One connection attempt at a time, no retries inside redis-rs: a failed attempt reports its
/// cause (refused, a wrong password) to the call or probe that waits for it at once, instead of
/// retrying with backoff until the call times out and hides the cause. Reconnecting is driven
/// from outside: the next call after a broken connection starts a new attempt, and once the
/// circuit breaker is open, its probe does every probe interval, so shared limiting resumes
/// within about a probe interval of Redis coming back.
fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout(timeout)))
        .set_response_timeout(Some(timeout.max(Duration::from_millis(250))))
        .set_number_of_retries(0)
}

impl fmt::Debug for RedisBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // URLs may hold passwords: shown masked.
        let target = match &self.target {
            None => "none".to_owned(),
            Some(target) => describe(Some(target)).0,
        };
        f.debug_struct("RedisBackendBuilder")
            .field("target", &target)
            .field("prefix", &self.prefix)
            .field("timeout", &self.opts.timeout)
            .field("on_failure", &self.opts.on_failure)
            .field("breaker_threshold", &self.opts.breaker_threshold)
            .field("probe_interval", &self.opts.probe_interval)
            .field("deny_cache_capacity", &self.opts.deny_cache_capacity)
            .finish()
    }
}
