//! What allowances need from the fleet: its size (each instance announces itself, as the exact
//! mode's fallback does), and the keys instances announce once past their allowance, written
//! to and read from one stream, `<prefix>:hot`.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::Value;

use super::Shared;
use crate::backend::remote::Fleet;

/// How often an instance holding keys reads the keys announced since its last read.
pub(super) const POLL_EVERY: Duration = Duration::from_millis(100);

/// The stream keeps about this many announcements (`XADD … MAXLEN ~`): an instance that reads
/// it less often than this many keys are announced misses some (they are then admitted within
/// its allowance until it hears of them again, as keys new to it are).
const STREAM_LEN: u64 = 100_000;

/// Announcements read per call.
const READ_COUNT: usize = 10_000;

/// Announcements waiting to be sent, at most (more, while Redis is away, are dropped: those
/// keys are kept in step here, and announced again a window later if still past their
/// allowances).
pub(super) const MAX_PENDING: usize = 10_000;

/// Announcements per pipeline.
const MARKS_PER_CALL: usize = 1_000;

/// The longest wait before announcements that failed are sent again.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Whether the fleet's count, this instance's announcements, or a read of the others' are due.
pub(super) fn due(s: &Shared) -> bool {
    if s.mode.allowance == 0 {
        return false;
    }
    let now = s.now_ns_mono();
    (now >= s.next_marks_ns.load(Ordering::Relaxed)
        && !s.marks.lock().unwrap_or_else(|e| e.into_inner()).is_empty())
        || (matches!(s.opts.fleet, Fleet::Announced { .. })
            && now >= s.next_count_ns.load(Ordering::Relaxed))
        || (s.keys.load(Ordering::Relaxed) > 0 && now >= s.next_poll_ns.load(Ordering::Relaxed))
}

/// How long until [`due`] may become true by time alone.
pub(super) fn until_due(s: &Shared) -> Duration {
    if s.mode.allowance == 0 {
        return Duration::MAX;
    }
    let now = s.now_ns_mono();
    let count = match s.opts.fleet {
        Fleet::Announced { .. } => s.next_count_ns.load(Ordering::Relaxed),
        Fleet::Size(_) => u64::MAX,
    };
    let poll = if s.keys.load(Ordering::Relaxed) > 0 {
        s.next_poll_ns.load(Ordering::Relaxed)
    } else {
        // Nothing held, nothing to read for: the task looks again within a second.
        u64::MAX
    };
    Duration::from_nanos(count.min(poll).saturating_sub(now))
}

/// Counts the fleet, sends this instance's announcements and reads the others', as far as each
/// is due (`force`: the read and the count whatever their time).
pub(super) async fn exchange(s: &Arc<Shared>, force: bool) {
    if s.mode.allowance == 0 {
        return;
    }
    let now = s.now_ns_mono();
    if let Fleet::Announced { every } = s.opts.fleet
        && (force || now >= s.next_count_ns.load(Ordering::Relaxed))
    {
        s.next_count_ns.store(
            now.saturating_add(u64::try_from(every.as_nanos()).unwrap_or(u64::MAX)),
            Ordering::Relaxed,
        );
        count(s, every).await;
    }
    send_marks(s).await;
    if force
        || (s.keys.load(Ordering::Relaxed) > 0 && now >= s.next_poll_ns.load(Ordering::Relaxed))
    {
        s.next_poll_ns.store(
            now.saturating_add(POLL_EVERY.as_nanos() as u64),
            Ordering::Relaxed,
        );
        poll(s).await;
    }
}

async fn count(s: &Shared, every: Duration) {
    // On Redis's clock (`TIME` in the script), or this instance's where Redis refuses `TIME`.
    let now_us = s.no_time.load(Ordering::Relaxed).then(|| s.now.us());
    let pipe = super::super::backend::announce_pipe(
        &s.prefix,
        s.fleet_id,
        every.saturating_mul(3),
        now_us,
    );
    let limit = s.opts.timeout.max(Duration::from_millis(250));
    let reply = tokio::time::timeout(limit, s.conn.pipeline(&pipe)).await;
    match reply {
        Ok(Ok(values)) => match super::super::backend::announced(values.first()) {
            Ok(n) => {
                let n = n.max(1);
                let before = s.fleet_size.swap(n, Ordering::Relaxed);
                crate::metrics::fleet_size("redis_approx", n);
                if before != n {
                    tracing::debug!(endpoint = %s.endpoint, "approximate mode: {n} instances (were {before})");
                }
            }
            Err(text) => tracing::debug!(endpoint = %s.endpoint, "approximate mode: {text}"),
        },
        Ok(Err(e)) => {
            if now_us.is_none() && super::super::backend::is_reply(&e) && time_refused(s).await {
                return;
            }
            tracing::debug!(endpoint = %s.endpoint, error = %e, "approximate mode: the fleet's count failed")
        }
        Err(_) => {
            tracing::debug!(endpoint = %s.endpoint, "approximate mode: the fleet's count timed out")
        }
    }
}

/// After an error reply to `TIME` (as a command, or in the fleet's announcement script):
/// whether Redis refuses `TIME` while it runs scripts that read nothing (a script that reads
/// nothing runs, one that reads `TIME` does not, or the command fails). If so the announcements
/// and the stream's first read use this instance's clock from now on, logged once; answers it.
async fn time_refused(s: &Shared) -> bool {
    let key = format!("{}:clock", s.prefix);
    let mut plain = redis::pipe();
    plain.cmd("EVAL").arg("return 1").arg(1).arg(&key);
    if s.conn.pipeline(&plain).await.is_err() {
        return false;
    }
    // One command per pipeline: on a cluster a keyed script and a keyless command go to
    // different nodes.
    let mut script = redis::pipe();
    script
        .cmd("EVAL")
        .arg("return redis.call('TIME')")
        .arg(1)
        .arg(&key);
    let mut command = redis::pipe();
    command.cmd("TIME");
    if s.conn.pipeline(&script).await.is_ok() && s.conn.pipeline(&command).await.is_ok() {
        return false;
    }
    if !s.no_time.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            endpoint = %s.endpoint,
            "approximate mode: Redis refuses TIME; the fleet's announcements and the stream's \
             first read use this instance's clock (its windows always do)"
        );
    }
    true
}

fn stream_key(s: &Shared) -> String {
    format!("{}:hot", s.prefix)
}

/// Sends the keys announced since the last flush, in pipelines of [`MARKS_PER_CALL`]. On
/// failure what was not sent is kept (up to [`MAX_PENDING`]) and sent again after a backoff;
/// until announcements go through again no key is quiet, and the third failure in a row is
/// logged as a warning (a Redis without streams, before 5.0; a user without `XADD`; a key of
/// another type in the way).
async fn send_marks(s: &Shared) {
    if s.now_ns_mono() < s.next_marks_ns.load(Ordering::Relaxed) {
        return;
    }
    let mut marks = std::mem::take(&mut *s.marks.lock().unwrap_or_else(|e| e.into_inner()));
    if marks.is_empty() {
        return;
    }
    let key = stream_key(s);
    let keep_ms = s.longest_window_us.load(Ordering::Relaxed) / 1000 * 2 + 10_000;
    while !marks.is_empty() {
        let chunk: Vec<_> = marks.drain(..marks.len().min(MARKS_PER_CALL)).collect();
        let mut pipe = redis::pipe();
        for (base, window_us) in &chunk {
            pipe.cmd("XADD")
                .arg(&key)
                .arg("MAXLEN")
                .arg("~")
                .arg(STREAM_LEN)
                .arg("*")
                .arg("b")
                .arg(&base[..])
                .arg("w")
                .arg(*window_us)
                .ignore();
        }
        pipe.cmd("PEXPIRE").arg(&key).arg(keep_ms).ignore();
        match tokio::time::timeout(s.opts.timeout, s.conn.pipeline(&pipe)).await {
            Ok(Ok(_)) => {
                s.announced.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                crate::metrics::approx_announcements("sent", chunk.len() as u64);
                if s.mark_failures.swap(0, Ordering::Relaxed) >= 3 {
                    tracing::info!(endpoint = %s.endpoint, "approximate mode: announcements go through again");
                }
            }
            outcome => {
                let failures = s.mark_failures.fetch_add(1, Ordering::Relaxed) + 1;
                s.stream_ok.store(false, Ordering::Relaxed);
                let backoff = POLL_EVERY
                    .saturating_mul(1 << failures.min(7))
                    .min(MAX_BACKOFF);
                s.next_marks_ns.store(
                    s.now_ns_mono()
                        .saturating_add(u64::try_from(backoff.as_nanos()).unwrap_or(u64::MAX)),
                    Ordering::Relaxed,
                );
                if failures == 3 {
                    let err = match outcome {
                        Ok(Err(e)) => e.to_string(),
                        _ => "timed out".to_owned(),
                    };
                    tracing::warn!(endpoint = %s.endpoint, error = %err,
                        "approximate mode: keys past their allowances cannot be announced \
                         (XADD to the stream <prefix>:hot fails; streams need Redis 5): every \
                         key is kept in step until they can");
                }
                let mut pending = s.marks.lock().unwrap_or_else(|e| e.into_inner());
                let room = MAX_PENDING.saturating_sub(pending.len());
                pending.extend(chunk.into_iter().chain(marks).take(room));
                return;
            }
        }
    }
}

/// Reads the keys announced since the last read, and keeps each in step for its window.
async fn poll(s: &Shared) {
    let now_us = s.now.us();
    let cursor = s.cursor.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let cursor = if cursor.is_empty() {
        // The first read: what was announced in the longest window before, on Redis's clock
        // (the stream's ids are its times; this instance's clock may be off).
        let redis_ms = if s.no_time.load(Ordering::Relaxed) {
            // A Redis without `TIME`: this instance's clock, a second earlier for the skew
            // between the instances' clocks (the read then starts a little further back).
            (now_us / 1000).saturating_sub(1000)
        } else {
            let mut time = redis::pipe();
            time.cmd("TIME");
            let read = tokio::time::timeout(s.opts.timeout, s.conn.pipeline(&time)).await;
            let values = match read {
                Ok(Ok(values)) => values,
                Ok(Err(e)) if super::super::backend::is_reply(&e) => {
                    time_refused(s).await;
                    return;
                }
                _ => return,
            };
            let Some(redis_ms) = redis_ms(values.first()) else {
                return;
            };
            redis_ms
        };
        let back_ms = s.longest_window_us.load(Ordering::Relaxed) / 1000;
        let from = format!("{}-0", redis_ms.saturating_sub(back_ms));
        *s.cursor.lock().unwrap_or_else(|e| e.into_inner()) = from.clone();
        from
    } else {
        cursor
    };
    let mut cmd = redis::cmd("XREAD");
    cmd.arg("COUNT")
        .arg(READ_COUNT)
        .arg("STREAMS")
        .arg(stream_key(s))
        .arg(&cursor);
    let mut pipe = redis::pipe();
    pipe.add_command(cmd);
    let reply = tokio::time::timeout(s.opts.timeout, s.conn.pipeline(&pipe)).await;
    let values = match reply {
        Ok(Ok(values)) => values,
        outcome => {
            s.stream_ok.store(false, Ordering::Relaxed);
            if s.poll_failures.fetch_add(1, Ordering::Relaxed) + 1 == 3 {
                let err = match outcome {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".to_owned(),
                };
                tracing::warn!(endpoint = %s.endpoint, error = %err,
                    "approximate mode: the announced keys cannot be read (XREAD of the stream \
                     <prefix>:hot fails; streams need Redis 5): every key is kept in step \
                     until they can");
            }
            return;
        }
    };
    s.poll_failures.store(0, Ordering::Relaxed);
    // Announcements can be read; and sent, unless the last ones failed.
    s.stream_ok.store(
        s.mark_failures.load(Ordering::Relaxed) == 0,
        Ordering::Relaxed,
    );
    let Some(entries) = values.first().and_then(stream_entries) else {
        return;
    };
    let mut last = None;
    let mut read = 0u64;
    for entry in entries {
        let Some((id, fields)) = entry_parts(entry) else {
            continue;
        };
        last = Some(id);
        let (mut base, mut window_us) = (None, None);
        for (k, v) in fields {
            match k {
                b"b" => base = Some(v),
                b"w" => {
                    window_us = std::str::from_utf8(v)
                        .ok()
                        .and_then(|w| w.parse::<u64>().ok())
                }
                _ => {}
            }
        }
        if let (Some(base), Some(window_us)) = (base, window_us) {
            read += 1;
            let until = now_us.saturating_add(window_us);
            let h = s.hasher.hash_one(base);
            match s.hot.get_mut(&h) {
                Some(mut u) => *u = (*u).max(until),
                None if s.hot_keys.load(Ordering::Relaxed) < s.mode.max_keys
                    && s.hot.insert(h, until).is_none() =>
                {
                    s.hot_keys.fetch_add(1, Ordering::Relaxed);
                }
                None => {}
            }
        }
    }
    if let Some(id) = last {
        *s.cursor.lock().unwrap_or_else(|e| e.into_inner()) = id;
    }
    s.announcements_read.fetch_add(read, Ordering::Relaxed);
    crate::metrics::approx_announcements("read", read);
    if read as usize >= READ_COUNT {
        // More waiting: the next flush reads on.
        s.next_poll_ns.store(0, Ordering::Relaxed);
    }
}

/// Redis's `TIME` in ms.
fn redis_ms(v: Option<&Value>) -> Option<u64> {
    let Some(Value::Array(parts)) = v else {
        return None;
    };
    let number = |v: &Value| -> Option<u64> {
        match v {
            Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            Value::Int(n) => u64::try_from(*n).ok(),
            _ => None,
        }
    };
    let (secs, us) = (number(parts.first()?)?, number(parts.get(1)?)?);
    Some(secs.saturating_mul(1000).saturating_add(us / 1000))
}

/// The entries of the one stream in an `XREAD` reply (RESP2 arrays or a RESP3 map); `None` for
/// nothing new.
fn stream_entries(v: &Value) -> Option<&[Value]> {
    let streams = match v {
        Value::Array(streams) => streams.first().and_then(|s| match s {
            Value::Array(pair) if pair.len() == 2 => Some(&pair[1]),
            _ => None,
        }),
        Value::Map(pairs) => pairs.first().map(|(_, entries)| entries),
        _ => None,
    }?;
    match streams {
        Value::Array(entries) => Some(entries),
        _ => None,
    }
}

/// A stream entry's field-value pairs.
type Fields<'a> = Vec<(&'a [u8], &'a [u8])>;

/// An entry's id and its field-value pairs.
fn entry_parts(v: &Value) -> Option<(String, Fields<'_>)> {
    let Value::Array(parts) = v else { return None };
    let [id, fields] = parts.as_slice() else {
        return None;
    };
    let id = match id {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok()?,
        Value::SimpleString(s) => s.clone(),
        _ => return None,
    };
    let flat: Vec<&[u8]> = match fields {
        Value::Array(items) => items
            .iter()
            .filter_map(|i| match i {
                Value::BulkString(b) => Some(&b[..]),
                _ => None,
            })
            .collect(),
        Value::Map(pairs) => pairs
            .iter()
            .flat_map(|(k, v)| [k, v])
            .filter_map(|i| match i {
                Value::BulkString(b) => Some(&b[..]),
                _ => None,
            })
            .collect(),
        _ => return None,
    };
    Some((id, flat.chunks_exact(2).map(|c| (c[0], c[1])).collect()))
}
