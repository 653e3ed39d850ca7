//! Whose clock a Redis decision reads. By default the script reads Redis's own (`TIME`), so
//! that every instance decides on one clock. Some managed services refuse `TIME` inside scripts
//! (it is not deterministic), and a server may have it renamed away; there a decision reads
//! Redis's clock outside the script, or, where `TIME` is refused altogether, the instances'
//! clocks ([`RedisClock`]).

use std::sync::atomic::{AtomicI64, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::conn::Conn;
use crate::backend::remote::TimeSource;

/// Whose clock the Redis backend decides on
/// ([`RedisBackendBuilder::clock`](super::RedisBackendBuilder::clock)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RedisClock {
    /// Redis's, read inside the script; where the server refuses `TIME` in scripts, Redis's
    /// read outside them ([`Synced`](Self::Synced)), and where it refuses `TIME` altogether,
    /// the instances' ([`Instances`](Self::Instances)). Found out on the first decision (or the
    /// warm-up), logged once, shown in [`RemoteStats::time_source`](crate::backend::remote::RemoteStats::time_source).
    #[default]
    Auto,
    /// Redis's, read inside the script (`TIME`): every instance decides on one clock, exactly.
    Script,
    /// Redis's, read by a `TIME` command outside the script when the backend starts and every
    /// 10 seconds after, and kept as an offset from this instance's clock: every instance
    /// decides on Redis's clock to within half a round trip (and the drift of this instance's
    /// clock over 10 seconds).
    Synced,
    /// Each instance's own clock (the system's): the shared limit holds to within the
    /// instances' clock skew. An instance whose clock runs δ ahead of another's sees a fixed
    /// window's edge δ earlier, and a GCRA bucket δ × rate units fuller.
    Instances,
}

/// How often [`RedisClock::Synced`] reads Redis's clock again.
const RESYNC: Duration = Duration::from_secs(10);

const SCRIPT: u8 = 0;
const SYNCED: u8 = 1;
const INSTANCES: u8 = 2;

/// The clock of one backend: the mode in use, and, synced, Redis's offset from this instance.
#[derive(Debug)]
pub(crate) struct Clock {
    auto: bool,
    mode: AtomicU8,
    /// Whether `Auto` has asked Redis whether scripts may read `TIME` (held while asking, so
    /// that calls failing meanwhile wait for the answer).
    probed: tokio::sync::Mutex<bool>,
    /// Redis's clock minus this instance's, in ns.
    offset_ns: AtomicI64,
    /// When the offset was read (this instance's clock, ns since the epoch; 0: never).
    synced_at_ns: AtomicU64,
}

/// A decision's time, as the script's first argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Time {
    /// Redis's `TIME`, read by the script.
    Script,
    /// A time read outside the script (Redis's, synced, or this instance's): `=<ns>`.
    Given(u64),
    /// The test clock's: `<ns>`.
    Test(u64),
}

impl Clock {
    pub(crate) fn new(chosen: RedisClock) -> Self {
        let mode = match chosen {
            RedisClock::Auto | RedisClock::Script => SCRIPT,
            RedisClock::Synced => SYNCED,
            RedisClock::Instances => INSTANCES,
        };
        Clock {
            auto: chosen == RedisClock::Auto,
            mode: AtomicU8::new(mode),
            probed: tokio::sync::Mutex::new(false),
            offset_ns: AtomicI64::new(0),
            synced_at_ns: AtomicU64::new(0),
        }
    }

    /// Where decisions read their time now.
    pub(crate) fn source(&self) -> TimeSource {
        match self.mode.load(Ordering::Relaxed) {
            SCRIPT => TimeSource::Store,
            SYNCED => TimeSource::StoreSynced,
            _ => TimeSource::Instances,
        }
    }

    /// The time of a decision made now, when it needs no round trip (`test`: the test clock's,
    /// which wins); `None` when Redis's clock is to be read again first ([`time`](Self::time)).
    #[inline]
    pub(crate) fn time_now(&self, test: Option<u64>) -> Option<Time> {
        if let Some(ns) = test {
            return Some(Time::Test(ns));
        }
        match self.mode.load(Ordering::Relaxed) {
            SCRIPT => Some(Time::Script),
            SYNCED => {
                let at = self.synced_at_ns.load(Ordering::Relaxed);
                let now = system_ns();
                if at == 0 || now.saturating_sub(at) >= RESYNC.as_nanos() as u64 {
                    return None;
                }
                let offset = self.offset_ns.load(Ordering::Relaxed);
                Some(Time::Given(now.saturating_add_signed(offset)))
            }
            _ => Some(Time::Given(system_ns())),
        }
    }

    /// The time of a decision made now (`test`: the test clock's, which wins), reading Redis's
    /// clock again first when it is due.
    pub(crate) async fn time(&self, conn: &Conn, test: Option<u64>) -> Time {
        if let Some(time) = self.time_now(test) {
            return time;
        }
        // Synced, and Redis's clock is due: read it again. A failed read keeps the last
        // offset (or none): the call that follows tells whether Redis answers.
        let _ = self.sync(conn).await;
        let offset = self.offset_ns.load(Ordering::Relaxed);
        Time::Given(system_ns().saturating_add_signed(offset))
    }

    /// Reads Redis's clock outside a script and keeps its offset from this instance's, taken
    /// at the middle of the round trip. `false` when Redis refused `TIME` (or did not answer).
    async fn sync(&self, conn: &Conn) -> bool {
        let before = system_ns();
        let mut pipe = redis::pipe();
        pipe.cmd("TIME");
        let Ok(values) = conn.pipeline(&pipe).await else {
            return false;
        };
        let after = system_ns();
        let Some(redis_ns) = time_ns(values.first()) else {
            return false;
        };
        let middle = before / 2 + after / 2;
        let offset = i64::try_from(i128::from(redis_ns) - i128::from(middle)).unwrap_or(0);
        self.offset_ns.store(offset, Ordering::Relaxed);
        self.synced_at_ns.store(after.max(1), Ordering::Relaxed);
        true
    }

    /// With [`RedisClock::Auto`], once: whether scripts may read `TIME` (a script that does
    /// nothing else, after one that reads nothing ran), and if not, whether a `TIME` command
    /// may; the mode follows, logged once.
    /// Calls that fail meanwhile wait for the answer, then read the mode again (a call that
    /// failed on `TIME` can be sent again: the script reads the time before it writes
    /// anything). The probes name one key (`key`, never read nor written), as services that
    /// refuse scripts without keys (ElastiCache Serverless) require. `endpoint`: for the log.
    pub(crate) async fn probe(&self, conn: &Conn, endpoint: &str, key: &str) {
        if !self.auto {
            return;
        }
        let mut probed = self.probed.lock().await;
        if *probed {
            return;
        }
        // A script that reads nothing must run first: an error there (a wrong password, a
        // server loading its data) says nothing about TIME; ask again next time.
        let mut plain = redis::pipe();
        plain.cmd("EVAL").arg("return 1").arg(1).arg(key);
        if conn.pipeline(&plain).await.is_err() {
            return;
        }
        let mut pipe = redis::pipe();
        pipe.cmd("EVAL")
            .arg("return redis.call('TIME')")
            .arg(1)
            .arg(key);
        match conn.pipeline(&pipe).await {
            Ok(_) => {
                *probed = true;
                return;
            }
            // Not an answer: ask again next time.
            Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => return,
            Err(_) => {}
        }
        *probed = true;
        if self.sync(conn).await {
            self.mode.store(SYNCED, Ordering::Release);
            tracing::warn!(
                "tollgate: Redis at {endpoint} refuses TIME inside scripts; deciding on its clock \
                 read outside them (TIME every 10 s, within half a round trip)"
            );
        } else {
            self.mode.store(INSTANCES, Ordering::Release);
            tracing::warn!(
                "tollgate: Redis at {endpoint} refuses TIME; deciding on the instances' clocks \
                 (the shared limit holds to within their clock skew)"
            );
        }
        crate::metrics::time_source("redis", self.source().as_str());
    }
}

/// Nanoseconds since the Unix epoch on this instance's clock.
fn system_ns() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
}

/// `TIME`'s reply (seconds, microseconds) in ns.
fn time_ns(value: Option<&redis::Value>) -> Option<u64> {
    let redis::Value::Array(parts) = value? else {
        return None;
    };
    let number = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse::<u64>().ok(),
        redis::Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    };
    let (s, us) = (number(parts.first()?)?, number(parts.get(1)?)?);
    s.checked_mul(1_000_000_000)?.checked_add(us * 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_replies_are_read() {
        let reply = redis::Value::Array(vec![
            redis::Value::BulkString(b"1700000000".to_vec()),
            redis::Value::BulkString(b"250000".to_vec()),
        ]);
        assert_eq!(time_ns(Some(&reply)), Some(1_700_000_000_250_000_000));
        assert_eq!(time_ns(Some(&redis::Value::Nil)), None);
        assert_eq!(time_ns(None), None);
    }

    #[test]
    fn each_choice_starts_in_its_mode() {
        assert_eq!(Clock::new(RedisClock::Auto).source(), TimeSource::Store);
        assert_eq!(Clock::new(RedisClock::Script).source(), TimeSource::Store);
        assert_eq!(
            Clock::new(RedisClock::Synced).source(),
            TimeSource::StoreSynced
        );
        assert_eq!(
            Clock::new(RedisClock::Instances).source(),
            TimeSource::Instances
        );
    }
}
