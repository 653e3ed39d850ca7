//! What kind of failure a redis-rs error is, for the breaker, the stats and the logs.

use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::backend::remote::{CallError, StoreFailure};

/// The kind of failure `err` is.
pub(crate) fn of(err: &RedisError) -> StoreFailure {
    if err.kind() == ErrorKind::AuthenticationFailed
        || matches!(err.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
        // Redis refuses large commands from a client that has not authenticated
        // ("Protocol error: unauthenticated multibulk length") and closes its connection.
        || err.detail().is_some_and(|d| d.contains("unauthenticated"))
    {
        StoreFailure::Authentication
    } else if err.is_timeout() {
        StoreFailure::Timeout
    } else if err.is_connection_refusal() {
        StoreFailure::ConnectionRefused
    } else if matches!(
        err.kind(),
        ErrorKind::ClusterConnectionNotFound
            | ErrorKind::Server(
                ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    // A primary demoted to replica by a failover: another node is the primary now.
                    | ServerErrorKind::ReadOnly
            )
    ) {
        StoreFailure::Unavailable
    } else if err.is_io_error() || err.is_connection_dropped() {
        StoreFailure::Connection
    } else {
        StoreFailure::ErrorReply
    }
}

/// A failed call, classified.
pub(crate) fn call_error(err: &RedisError) -> CallError {
    CallError::new(of(err), err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_told_apart() {
        let io = |kind| RedisError::from(std::io::Error::new(kind, "x"));
        assert_eq!(
            of(&io(std::io::ErrorKind::ConnectionRefused)),
            StoreFailure::ConnectionRefused
        );
        assert_eq!(of(&io(std::io::ErrorKind::TimedOut)), StoreFailure::Timeout);
        assert_eq!(
            of(&io(std::io::ErrorKind::ConnectionReset)),
            StoreFailure::Connection
        );
        let auth = RedisError::from((
            ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        ));
        assert_eq!(of(&auth), StoreFailure::Authentication);
        let other = RedisError::from((ErrorKind::Parse, "bad reply"));
        assert_eq!(of(&other), StoreFailure::ErrorReply);
    }
}
