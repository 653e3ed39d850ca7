//! Whether the store answers, as the last call or probe saw it, and why not.
//!
//! Operators hear of a change, not of every request: the backend logs one warning when the
//! store starts failing (or fails for another reason than before), naming the cause and what requests
//! get meanwhile, and one info line when it answers again. Requests answered by the failure
//! policy in between are counted in the stats, not logged one by one.

use std::fmt;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// Why a remote store could not decide, from [`RemoteStats::failing`](super::RemoteStats::failing)
/// (the Redis backend's `RedisStats` is the same struct; there it is also named `RedisFailure`).
///
/// Its `Display` is a short phrase for logs, e.g. `connection refused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreFailure {
    /// Nothing listens at the address (connection refused; for a Unix socket, no such file).
    ConnectionRefused,
    /// The store refused the credentials (a wrong password or user, none given where one is
    /// required), or the user may not run the backend's commands (Redis `NOPERM`, a SQL
    /// permission error).
    Authentication,
    /// No answer within the timeout, or a connection attempt timed out.
    Timeout,
    /// The connection could not be made for another reason (a host name that does not
    /// resolve, an unreachable network) or broke.
    Connection,
    /// The store is there but cannot serve now: a Redis Cluster without a connected node for
    /// the slot (`CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `TRYAGAIN`); a database starting up or
    /// shutting down, or out of connections.
    Unavailable,
    /// The store answered the call with an error (Redis `OOM`, `READONLY`; a SQL error other
    /// than a lost connection) or with a reply that could not be read.
    ErrorReply,
}

impl StoreFailure {
    const ALL: [StoreFailure; 6] = [
        StoreFailure::ConnectionRefused,
        StoreFailure::Authentication,
        StoreFailure::Timeout,
        StoreFailure::Connection,
        StoreFailure::Unavailable,
        StoreFailure::ErrorReply,
    ];

    /// Causes of one class are one state for the logs: a killed Redis first drops the
    /// connection, then refuses the next ones, which is one outage and one warning.
    fn class(self) -> u8 {
        match self {
            StoreFailure::ConnectionRefused | StoreFailure::Connection => 0,
            StoreFailure::Authentication => 1,
            StoreFailure::Timeout => 2,
            StoreFailure::Unavailable => 3,
            StoreFailure::ErrorReply => 4,
        }
    }

    /// Whether this is how failures look rather than why they happen: a timeout, a dropped
    /// connection. A Redis that wants a password closes the connection of a client sending a
    /// large command unauthenticated; a Redis that went away may time out a call before
    /// connections are refused. During a failure with a known reason, these neither replace
    /// it nor make a new warning.
    fn is_symptom(self) -> bool {
        matches!(self, StoreFailure::Timeout | StoreFailure::Connection)
    }

    fn code(self) -> u8 {
        // Cannot fail: `ALL` holds every variant.
        let i = Self::ALL.iter().position(|f| *f == self).unwrap_or(0);
        FAILING + i as u8
    }

    fn from_code(code: u8) -> Option<StoreFailure> {
        Self::ALL
            .get(usize::from(code.checked_sub(FAILING)?))
            .copied()
    }
}

impl fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreFailure::ConnectionRefused => "connection refused",
            StoreFailure::Authentication => "authentication failed",
            StoreFailure::Timeout => "timed out",
            StoreFailure::Connection => "connection lost or failed",
            StoreFailure::Unavailable => "cannot serve now",
            StoreFailure::ErrorReply => "error reply",
        })
    }
}

impl std::error::Error for StoreFailure {}

/// No call or probe has finished yet.
const UNKNOWN: u8 = 0;
/// The last one got the store's answer.
const ANSWERING: u8 = 1;
/// The last one failed: `FAILING + index of the cause`.
const FAILING: u8 = 2;

/// What happened when: transitions are decided by one atomic swap, so that exactly one caller
/// logs each change, however many calls race.
#[derive(Debug)]
pub(crate) struct Health {
    state: AtomicU8,
    /// The failure-policy count when the current failure began, to tell how many requests it
    /// answered meanwhile.
    degraded_at_start: AtomicU64,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            state: AtomicU8::new(UNKNOWN),
            degraded_at_start: AtomicU64::new(0),
        }
    }
}

/// A change worth a log line.
pub(crate) enum Change {
    /// The store failed, and did not fail for this reason just before (`again`: it was failing for
    /// another reason).
    Failing { again: bool },
    /// The store answers again after failing; `degraded` requests got the failure policy meanwhile.
    Recovered { degraded: u64 },
}

impl Health {
    /// Why the store is failing now, if it is.
    pub(crate) fn failing(&self) -> Option<StoreFailure> {
        StoreFailure::from_code(self.state.load(Ordering::Relaxed))
    }

    /// A call or probe got the store's answer. `degraded` is the failure-policy count now.
    pub(crate) fn answered(&self, degraded: u64) -> Option<Change> {
        // The common case, once per call: one load, no write.
        if self.state.load(Ordering::Relaxed) == ANSWERING {
            return None;
        }
        let before = self.state.swap(ANSWERING, Ordering::AcqRel);
        (before >= FAILING).then(|| Change::Recovered {
            degraded: degraded.saturating_sub(self.degraded_at_start.load(Ordering::Relaxed)),
        })
    }

    /// A call or probe failed with `cause`. `degraded` is the failure-policy count now.
    ///
    /// Reports a change when the store was answering, or when it was failing and `cause` is a new
    /// reason (not a symptom, and of another class than the cause before). A symptom never
    /// replaces a reason: the stats keep telling why.
    pub(crate) fn failed(&self, cause: StoreFailure, degraded: u64) -> Option<Change> {
        let now = cause.code();
        let mut before = self.state.load(Ordering::Relaxed);
        loop {
            let was = StoreFailure::from_code(before);
            if was.is_some_and(|was| was == cause || (cause.is_symptom() && !was.is_symptom())) {
                return None;
            }
            match self
                .state
                .compare_exchange_weak(before, now, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return match was {
                        None => {
                            self.degraded_at_start.store(degraded, Ordering::Relaxed);
                            Some(Change::Failing { again: false })
                        }
                        Some(was) if was.class() == cause.class() || cause.is_symptom() => None,
                        Some(_) => Some(Change::Failing { again: true }),
                    };
                }
                Err(actual) => before = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_change_is_reported_once() {
        let h = Health::default();
        assert!(h.answered(0).is_none(), "a first answer is no change");
        assert!(matches!(
            h.failed(StoreFailure::ConnectionRefused, 10),
            Some(Change::Failing { again: false })
        ));
        assert!(h.failed(StoreFailure::ConnectionRefused, 11).is_none());
        assert_eq!(h.failing(), Some(StoreFailure::ConnectionRefused));
        assert!(h.failed(StoreFailure::Connection, 11).is_none());
        assert!(h.failed(StoreFailure::Timeout, 11).is_none());
        assert_eq!(
            h.failing(),
            Some(StoreFailure::ConnectionRefused),
            "a symptom does not replace the reason"
        );
        assert!(matches!(
            h.failed(StoreFailure::Authentication, 12),
            Some(Change::Failing { again: true })
        ));
        assert!(matches!(
            h.answered(15),
            Some(Change::Recovered { degraded: 5 })
        ));
        assert!(h.answered(15).is_none());
        assert_eq!(h.failing(), None);

        // A killed Redis: the connection drops, then connections are refused. One outage.
        assert!(h.failed(StoreFailure::Connection, 20).is_some());
        assert!(h.failed(StoreFailure::ConnectionRefused, 21).is_none());
        assert_eq!(h.failing(), Some(StoreFailure::ConnectionRefused));
        assert!(h.answered(22).is_some());
        // Timeouts, then the reason: a new warning, as it tells more.
        assert!(h.failed(StoreFailure::Timeout, 30).is_some());
        assert!(h.failed(StoreFailure::Connection, 30).is_none());
        assert!(matches!(
            h.failed(StoreFailure::Authentication, 30),
            Some(Change::Failing { again: true })
        ));
    }

    #[test]
    fn every_cause_round_trips() {
        for f in StoreFailure::ALL {
            assert_eq!(StoreFailure::from_code(f.code()), Some(f));
        }
        assert_eq!(StoreFailure::from_code(UNKNOWN), None);
        assert_eq!(StoreFailure::from_code(ANSWERING), None);
        assert_eq!(StoreFailure::from_code(u8::MAX), None);
    }
}
