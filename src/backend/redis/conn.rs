//! Connections: one multiplexed connection to a single node, or a cluster connection.
//!
//! Both kinds are created lazily, on the first call made inside a Tokio runtime, so that
//! building a backend never blocks and never fails because Redis is down. Both pipeline
//! concurrent requests over shared sockets and reconnect by themselves: redis-rs's
//! [`ConnectionManager`] replaces a broken connection in the background, and its
//! [`ClusterConnection`] refreshes slots and reconnects to nodes.

use std::fmt;
use std::sync::OnceLock;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{RedisResult, ScriptInvocation};

/// Where decisions are sent.
pub(crate) enum Conn {
    Single(Lazy<ConnectionManager, (redis::Client, ConnectionManagerConfig)>),
    Cluster(Lazy<ClusterConnection, (ClusterClient, ClusterConfig)>),
}

/// A connection, or what is needed to make one on first use.
pub(crate) struct Lazy<C, Src> {
    conn: OnceLock<C>,
    source: Option<Src>,
}

impl<C, Src> Lazy<C, Src> {
    pub(crate) fn ready(conn: C) -> Self {
        let cell = OnceLock::new();
        let _ = cell.set(conn);
        Lazy {
            conn: cell,
            source: None,
        }
    }

    pub(crate) fn from_source(source: Src) -> Self {
        Lazy {
            conn: OnceLock::new(),
            source: Some(source),
        }
    }
}

impl<C: Clone, Src> Lazy<C, Src> {
    /// The connection, made now if needed. Must be called inside a Tokio runtime (redis-rs
    /// spawns the connection's driver task).
    fn get(&self, make: impl FnOnce(&Src) -> RedisResult<C>) -> RedisResult<C> {
        if let Some(c) = self.conn.get() {
            return Ok(c.clone());
        }
        let Some(source) = &self.source else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "no connection configured",
            )));
        };
        let made = make(source)?;
        // Two tasks may race here: one connection wins, the other is dropped unused.
        let _ = self.conn.set(made);
        self.conn.get().cloned().ok_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::Client, "connection lost its cell"))
        })
    }
}

impl Conn {
    /// Runs the script with `invocation`'s keys and arguments.
    pub(crate) async fn invoke(&self, invocation: &ScriptInvocation<'_>) -> RedisResult<Vec<i64>> {
        match self {
            Conn::Single(lazy) => {
                let mut c = lazy.get(make_single)?;
                invocation.invoke_async(&mut c).await
            }
            Conn::Cluster(lazy) => {
                let mut c = lazy.get(make_cluster)?;
                invocation.invoke_async(&mut c).await
            }
        }
    }

    /// Sends an `EVALSHA` of the script, built by the caller, to a single node; on `NOSCRIPT`
    /// loads the script and sends it again.
    pub(crate) async fn eval(&self, cmd: &redis::Cmd) -> RedisResult<Vec<i64>> {
        let Conn::Single(lazy) = self else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "batched calls need a single-node connection",
            )));
        };
        let mut c = lazy.get(make_single)?;
        match cmd.query_async(&mut c).await {
            Err(err)
                if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                super::script::SCRIPT
                    .prepare_invoke()
                    .load_async(&mut c)
                    .await?;
                cmd.query_async(&mut c).await
            }
            result => result,
        }
    }

    /// `PING` (on a cluster: every primary), used by the circuit breaker's probe.
    pub(crate) async fn ping(&self) -> RedisResult<()> {
        let ping = redis::cmd("PING");
        match self {
            Conn::Single(lazy) => {
                let mut c = lazy.get(make_single)?;
                ping.query_async::<()>(&mut c).await
            }
            Conn::Cluster(lazy) => {
                let mut c = lazy.get(make_cluster)?;
                ping.query_async::<()>(&mut c).await
            }
        }
    }
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
        }
    }
}
