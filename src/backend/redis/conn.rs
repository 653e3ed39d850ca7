//! Connections: one multiplexed connection to a single node, or a cluster connection.
//!
//! Both kinds are created lazily, on the first call made inside a Tokio runtime, so that
//! building a backend never blocks and never fails because Redis is down. Both pipeline
//! concurrent requests over shared sockets and reconnect by themselves: redis-rs's
//! [`ConnectionManager`] replaces a broken connection (on the next call), and its
//! [`ClusterConnection`] refreshes slots and reconnects to nodes.
//!
//! One failure the connection manager never recovers from: a connection refused at
//! authentication (a wrong password) stays its answer to every later call, even once the
//! password is fixed on the server. A manager the backend made itself is then dropped, and the
//! next call makes a new one.
//!
//! A script call is never sent twice when Redis may have run it: the script is not idempotent,
//! and a second run would charge the request again. The connection manager does not resend
//! failed commands; the cluster client the backend builds has redis-rs's retries turned off,
//! and [`Conn::eval`] retries only on replies that Redis gives before running a script
//! (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::SingleNodeRoutingInfo;
use redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind};

use super::script;

/// Attempts after the first on a Redis Cluster, for replies that prove the script did not run.
const CLUSTER_RETRIES: u32 = 3;

/// The first wait before trying a cluster again after `TRYAGAIN` and the like (doubled each
/// time); the backend's timeout bounds the whole.
const CLUSTER_RETRY_WAIT: Duration = Duration::from_millis(10);

/// Where decisions are sent.
pub(crate) enum Conn {
    Single(Lazy<ConnectionManager, (redis::Client, ConnectionManagerConfig)>),
    Cluster(Lazy<ClusterConnection, (ClusterClient, ClusterConfig)>),
    /// A primary found through Redis Sentinel: asked again whenever the connection is dropped
    /// (the circuit breaker opened, a probe failed), so that after a failover the backend
    /// connects to the promoted replica.
    Sentinel(Box<SentinelConn>),
}

/// The Sentinel client, and the connection to the primary it named last.
pub(crate) struct SentinelConn {
    pub(crate) client: tokio::sync::Mutex<redis::sentinel::SentinelClient>,
    pub(crate) conn: ArcSwapOption<ConnectionManager>,
    pub(crate) config: ConnectionManagerConfig,
}

impl SentinelConn {
    /// The connection to the primary, asking the sentinels for it if there is none.
    async fn get(&self) -> RedisResult<Arc<ConnectionManager>> {
        if let Some(c) = self.conn.load_full() {
            return Ok(c);
        }
        let mut client = self.client.lock().await;
        // Another call may have connected while this one waited for the lock.
        if let Some(c) = self.conn.load_full() {
            return Ok(c);
        }
        let primary = client.async_get_client().await?;
        let made = Arc::new(ConnectionManager::new_lazy_with_config(
            primary,
            self.config.clone(),
        )?);
        self.conn.store(Some(made.clone()));
        Ok(made)
    }
}

/// A connection, or what is needed to make one on first use (and again after
/// [`discard`](Lazy::discard)).
pub(crate) struct Lazy<C, Src> {
    conn: ArcSwapOption<C>,
    source: Option<Src>,
}

impl<C, Src> Lazy<C, Src> {
    pub(crate) fn ready(conn: C) -> Self {
        Lazy {
            conn: ArcSwapOption::from_pointee(conn),
            source: None,
        }
    }

    pub(crate) fn from_source(source: Src) -> Self {
        Lazy {
            conn: ArcSwapOption::empty(),
            source: Some(source),
        }
    }

    /// The connection, made now if needed. Must be called inside a Tokio runtime (redis-rs
    /// spawns the connection's driver task).
    fn get(&self, make: impl FnOnce(&Src) -> RedisResult<C>) -> RedisResult<Arc<C>> {
        if let Some(c) = self.conn.load_full() {
            return Ok(c);
        }
        let Some(source) = &self.source else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "no connection configured",
            )));
        };
        let made = Arc::new(make(source)?);
        // Two tasks may race here: one connection wins, the other is dropped unused.
        let before = self
            .conn
            .compare_and_swap(&None::<Arc<C>>, Some(made.clone()));
        Ok(match &*before {
            Some(winner) => winner.clone(),
            None => made,
        })
    }

    /// Drops `failed`, a connection that will not recover, if this made it (a connection
    /// handed over is kept): the next call makes a new one.
    fn discard(&self, failed: &Arc<C>) {
        if self.source.is_some() {
            self.conn
                .compare_and_swap(&Some(failed.clone()), None::<Arc<C>>);
        }
    }
}

impl Conn {
    /// Sends an `EVALSHA` of the script, built by the caller; on `NOSCRIPT` loads the script
    /// and sends it again. On a cluster, follows redirections and waits out transient cluster
    /// states (see the module docs); nothing is resent after an error that may have come after
    /// the script ran.
    pub(crate) async fn eval(&self, cmd: &redis::Cmd) -> RedisResult<Vec<i64>> {
        match self {
            Conn::Single(lazy) => {
                let shared = lazy.get(make_single)?;
                let mut c = ConnectionManager::clone(&shared);
                let result = eval_loading(&mut c, cmd).await;
                discard_if_refused(lazy, &shared, &result);
                result
            }
            Conn::Cluster(lazy) => {
                let mut c = ClusterConnection::clone(&*lazy.get(make_cluster)?);
                // Boxed: its redirections and waits make a large future, which would otherwise
                // make every single-node call's future (allocated per batch) as large.
                Box::pin(eval_cluster(&mut c, cmd)).await
            }
            Conn::Sentinel(sentinel) => {
                let mut c = ConnectionManager::clone(&*Box::pin(sentinel.get()).await?);
                eval_loading(&mut c, cmd).await
            }
        }
    }

    /// Drops the connection the backend made (one handed over is kept), so that the next call
    /// makes a new one.
    pub(crate) fn reconnect(&self) {
        match self {
            Conn::Single(lazy) => {
                if let Some(c) = lazy.conn.load_full() {
                    lazy.discard(&c);
                }
            }
            Conn::Cluster(lazy) => {
                if let Some(c) = lazy.conn.load_full() {
                    lazy.discard(&c);
                }
            }
            Conn::Sentinel(sentinel) => sentinel.conn.store(None),
        }
    }

    /// `PING` (on a cluster: every primary), used by the circuit breaker's probe.
    pub(crate) async fn ping(&self) -> RedisResult<()> {
        self.query(&redis::cmd("PING")).await
    }

    /// Sends `pipe`, plain commands (no script), and returns their replies. On a cluster
    /// every key of the pipeline must hash to one slot (the approximate mode sends one
    /// pipeline per client key, whose keys share a hash tag); nothing is retried.
    pub(crate) async fn pipeline(&self, pipe: &redis::Pipeline) -> RedisResult<Vec<redis::Value>> {
        match self {
            Conn::Single(lazy) => {
                let shared = lazy.get(make_single)?;
                let mut c = ConnectionManager::clone(&shared);
                let result = pipe.query_async(&mut c).await;
                discard_if_refused(lazy, &shared, &result);
                result
            }
            Conn::Cluster(lazy) => {
                let mut c = ClusterConnection::clone(&*lazy.get(make_cluster)?);
                pipe.query_async(&mut c).await
            }
            Conn::Sentinel(sentinel) => {
                let mut c = ConnectionManager::clone(&*Box::pin(sentinel.get()).await?);
                pipe.query_async(&mut c).await
            }
        }
    }

    /// `INFO <sections>` of every primary of a cluster: each node's text. (`None` for a
    /// single node or Sentinel: read those with [`pipeline`](Self::pipeline).)
    pub(crate) async fn info_of_primaries(
        &self,
        sections: &[&str],
    ) -> RedisResult<Option<Vec<String>>> {
        let Conn::Cluster(lazy) = self else {
            return Ok(None);
        };
        let mut c = ClusterConnection::clone(&*lazy.get(make_cluster)?);
        let mut info = redis::cmd("INFO");
        for s in sections {
            info.arg(*s);
        }
        // Routed to every primary; the reply maps each node's address to its text.
        let reply: redis::Value = info.query_async(&mut c).await?;
        let texts = match reply {
            redis::Value::Map(nodes) => nodes
                .into_iter()
                .filter_map(|(_, text)| redis::from_redis_value::<String>(text).ok())
                .collect(),
            one => redis::from_redis_value::<String>(one).into_iter().collect(),
        };
        Ok(Some(texts))
    }

    /// Whether this is a Redis Cluster (one pipeline per hash slot).
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Conn::Cluster(_))
    }

    /// Sends `cmd` (a `PING`, a `DEL` of one client's keys) and drops its reply.
    pub(crate) async fn query(&self, cmd: &redis::Cmd) -> RedisResult<()> {
        let ping = cmd;
        match self {
            Conn::Single(lazy) => {
                let shared = lazy.get(make_single)?;
                let mut c = ConnectionManager::clone(&shared);
                let result = ping.query_async::<()>(&mut c).await;
                discard_if_refused(lazy, &shared, &result);
                result
            }
            Conn::Cluster(lazy) => {
                let mut c = ClusterConnection::clone(&*lazy.get(make_cluster)?);
                ping.query_async::<()>(&mut c).await
            }
            Conn::Sentinel(sentinel) => {
                let mut c = ConnectionManager::clone(&*Box::pin(sentinel.get()).await?);
                ping.query_async::<()>(&mut c).await
            }
        }
    }
}

/// A connection manager whose connection was refused at authentication answers every later
/// call with that error (it reconnects only after I/O errors): make a new one next time, so
/// that the backend recovers once the password is right (the circuit breaker keeps this to one
/// attempt per probe interval).
fn discard_if_refused<T, Src>(
    lazy: &Lazy<ConnectionManager, Src>,
    shared: &Arc<ConnectionManager>,
    result: &RedisResult<T>,
) {
    if let Err(err) = result
        && err.kind() == ErrorKind::AuthenticationFailed
    {
        lazy.discard(shared);
    }
}

/// `EVALSHA`; on `NOSCRIPT` (nothing ran) loads the script and sends it again.
async fn eval_loading<C: redis::aio::ConnectionLike>(
    c: &mut C,
    cmd: &redis::Cmd,
) -> RedisResult<Vec<i64>> {
    match cmd.query_async(c).await {
        Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script::SCRIPT.prepare_invoke().load_async(c).await?;
            cmd.query_async(c).await
        }
        result => result,
    }
}

/// What to do after a failed call on a cluster.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Give up: Redis may have run the script, or the error will not go away soon.
    Fail,
    /// Send the script again, routed by slot as usual: after a `MOVED`, which makes redis-rs
    /// refresh its slot map (holding new requests until it has).
    Reroute,
    /// Send the script straight to this node after `ASKING` (an `ASK`: the slot is being
    /// migrated, and only this one command goes to its new node).
    Ask { host: String, port: u16 },
    /// Wait, then route as usual again (a failover or a migration is under way).
    Wait,
}

/// Only errors Redis gives *before* running a command lead to another attempt.
///
/// Not retried: `ClusterConnectionNotFound` and `LOADING`. The first means no node is
/// connected (retrying only delays the failure the circuit breaker needs to see); and when a
/// slot-map refresh fails, redis-rs answers the requests it had already sent with the refresh's
/// error, which is one of the two: the script may have run.
fn next_step(err: &RedisError) -> Next {
    match err.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => Next::Reroute,
        ErrorKind::Server(ServerErrorKind::Ask) => {
            match err
                .redirect_node()
                .and_then(|(node, _slot)| node_address(node))
            {
                Some((host, port)) => Next::Ask { host, port },
                None => Next::Fail,
            }
        }
        ErrorKind::Server(
            ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly,
        ) => Next::Wait,
        _ => Next::Fail,
    }
}

/// `host:port` of a redirection (an IPv6 host may come in brackets).
fn node_address(node: &str) -> Option<(String, u16)> {
    let (host, port) = node.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().ok()?;
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// A cluster call: redis-rs does not retry (the backend's own client has `retries(0)`), so a
/// dropped connection fails the call instead of running the script a second time.
async fn eval_cluster(c: &mut ClusterConnection, cmd: &redis::Cmd) -> RedisResult<Vec<i64>> {
    let mut result = eval_loading(c, cmd).await;
    let mut wait = CLUSTER_RETRY_WAIT;
    for _ in 0..CLUSTER_RETRIES {
        let Err(err) = &result else { break };
        result = match next_step(err) {
            Next::Fail => break,
            Next::Reroute => eval_loading(c, cmd).await,
            Next::Ask { host, port } => eval_asking(c, cmd, host, port).await,
            Next::Wait => {
                tokio::time::sleep(wait).await;
                wait = wait.saturating_mul(2);
                eval_loading(c, cmd).await
            }
        };
    }
    result
}

/// Runs the script on the node an `ASK` named, after `ASKING`. With `EVAL` and the source
/// rather than `EVALSHA`: a node importing a slot may not have the script yet, and `EVAL`
/// caches it there. (A `MOVED` is rerouted by slot instead: routing by address to a node
/// redis-rs is not connected to makes it rebuild every connection.)
async fn eval_asking(
    c: &mut ClusterConnection,
    cmd: &redis::Cmd,
    host: String,
    port: u16,
) -> RedisResult<Vec<i64>> {
    let route = SingleNodeRoutingInfo::ByAddress { host, port };
    // `ASKING` lets the next command on the same connection reach a slot being imported; a
    // pipeline keeps the two together, and its reply is the script's alone (offset 1, count 1).
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING").add_command(with_source(cmd));
    let value = c
        .route_pipeline(pipe, 1, 1, route)
        .await?
        .pop()
        .ok_or_else(|| RedisError::from((ErrorKind::Parse, "no reply to the script")))?;
    Ok(redis::from_redis_value(value.extract_error()?)?)
}

/// The `EVAL` form of an `EVALSHA` command: the same keys and arguments after the script.
fn with_source(evalsha: &redis::Cmd) -> redis::Cmd {
    let mut eval = redis::cmd("EVAL");
    eval.arg(script::SOURCE);
    // The backend's commands hold plain arguments only (no `SCAN` cursors).
    for arg in evalsha.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = arg {
            eval.arg(bytes);
        }
    }
    eval
}

fn make_single(
    (client, config): &(redis::Client, ConnectionManagerConfig),
) -> RedisResult<ConnectionManager> {
    ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
}

fn make_cluster(
    (client, config): &(ClusterClient, ClusterConfig),
) -> RedisResult<ClusterConnection> {
    Ok(client.get_pending_async_connection_with_config(config.clone()))
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Conn::Single(_) => f.write_str("Single"),
            Conn::Cluster(_) => f.write_str("Cluster"),
            Conn::Sentinel(_) => f.write_str("Sentinel"),
        }
    }
}

/// Connection attempts get more time than a decision (a TLS or cross-zone handshake takes a
/// few round trips), but stay short so that reconnection keeps trying often.
pub(crate) fn connect_timeout(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(5)
        .clamp(Duration::from_millis(250), Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirection_addresses() {
        assert_eq!(
            node_address("127.0.0.1:7001"),
            Some(("127.0.0.1".to_owned(), 7001))
        );
        assert_eq!(node_address("[::1]:7001"), Some(("::1".to_owned(), 7001)));
        assert_eq!(node_address("::1:7001"), Some(("::1".to_owned(), 7001)));
        assert_eq!(node_address(":7001"), None);
        assert_eq!(node_address("host"), None);
    }

    #[test]
    fn the_eval_form_keeps_keys_and_arguments() {
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha
            .arg(script::SCRIPT.get_hash())
            .arg(1)
            .arg("k")
            .arg("");
        let eval = with_source(&evalsha);
        let args: Vec<Vec<u8>> = eval
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => b"<cursor>".to_vec(),
            })
            .collect();
        let expected: [&[u8]; 5] = [b"EVAL", script::SOURCE.as_bytes(), b"1", b"k", b""];
        assert_eq!(args, expected.map(<[u8]>::to_vec));
    }
}
