//! Wait mode: the layer holds a request until its policy allows it, instead of answering `429`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How the layer waits (see [`RateLimitLayerBuilder::wait`](crate::RateLimitLayerBuilder::wait)).
#[derive(Debug, Clone)]
pub(crate) struct WaitMode {
    pub(crate) max_wait: Duration,
    max_waiters: usize,
    waiters: Arc<AtomicUsize>,
}

impl WaitMode {
    pub(crate) fn new(max_wait: Duration, max_waiters: usize) -> Self {
        WaitMode {
            max_wait,
            max_waiters,
            waiters: Arc::default(),
        }
    }

    /// A waiter's place, if one is free: held while the request waits, given back when it goes
    /// on or is dropped.
    pub(crate) fn enter(&self) -> Option<Place> {
        let mut n = self.waiters.load(Ordering::Relaxed);
        loop {
            if n >= self.max_waiters {
                return None;
            }
            match self
                .waiters
                .compare_exchange_weak(n, n + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Some(Place(self.waiters.clone())),
                Err(actual) => n = actual,
            }
        }
    }
}

impl WaitMode {
    /// Whether a request refused now waits for its units instead, and if so a waiter's place
    /// for it and the longest wait: its policy can reserve (`reserves`: GCRA quotas only), the
    /// store refused it (not a failure, not a cost above a burst) for at most the longest
    /// wait, and a place is free. (Shadow policies never wait: callers do not ask for them.)
    pub(crate) fn after_refusal(
        &self,
        reserves: bool,
        result: &Result<crate::backend::Decision, crate::BackendError>,
    ) -> Option<(Place, Duration)> {
        if !reserves {
            return None;
        }
        // `None` when allowed, or when the cost can never fit.
        let wait = result.as_ref().ok()?.retry_after()?;
        if wait > self.max_wait {
            return None;
        }
        Some((self.enter()?, self.max_wait))
    }
}

/// One waiting request's place among the waiters.
#[derive(Debug)]
pub(crate) struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Keys the wrapped service asked to slow down (`429`/`503` with `Retry-After`, gRPC
/// `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`), and until when (see
/// [`RateLimitLayerBuilder::obey_retry_after`](crate::RateLimitLayerBuilder::obey_retry_after)).
#[derive(Debug, Default)]
pub(crate) struct Pauses {
    map: std::sync::Mutex<std::collections::HashMap<crate::Key, std::time::Instant>>,
    /// Whether any pause was ever noted: until one is, asking takes no lock.
    noted: std::sync::atomic::AtomicBool,
}

/// The most keys paused at once: beyond, expired pauses are dropped, and new ones ignored.
const MAX_PAUSED: usize = 65_536;

/// The longest pause taken from an upstream's answer.
const MAX_PAUSE: Duration = Duration::from_secs(3600);

impl Pauses {
    /// How long `key` is still paused, if it is.
    pub(crate) fn remaining(&self, key: &crate::Key) -> Option<Duration> {
        if !self.noted.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let until = *map.get(key)?;
        let now = std::time::Instant::now();
        if until > now {
            Some(until - now)
        } else {
            map.remove(key);
            None
        }
    }

    /// Reads the wrapped service's answer for `key`: a request to slow down pauses it.
    pub(crate) fn note<B>(&self, key: &crate::Key, res: &http::Response<B>) {
        self.note_answer(key, res.status(), res.headers());
    }

    /// Reads an answer for `key` given as its status and headers (a reqwest response).
    pub(crate) fn note_answer(
        &self,
        key: &crate::Key,
        status: http::StatusCode,
        headers: &http::HeaderMap,
    ) {
        let Some(wait) = answer_wait(status, headers) else {
            return;
        };
        let until = std::time::Instant::now() + wait.min(MAX_PAUSE);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_PAUSED && !map.contains_key(key) {
            let now = std::time::Instant::now();
            map.retain(|_, until| *until > now);
            if map.len() >= MAX_PAUSED {
                return;
            }
        }
        self.noted.store(true, std::sync::atomic::Ordering::Relaxed);
        let entry = map.entry(key.clone()).or_insert(until);
        *entry = (*entry).max(until);
    }
}

/// How long an answer asks its caller to wait: `Retry-After` (seconds or an HTTP date) on a
/// `429` or `503`, or gRPC's `grpc-retry-pushback-ms` on a `RESOURCE_EXHAUSTED` answered
/// trailers-only (a negative pushback, "do not retry", pauses nothing).
#[cfg(any(test, fuzzing))]
pub(crate) fn upstream_wait<B>(res: &http::Response<B>) -> Option<Duration> {
    answer_wait(res.status(), res.headers())
}

/// [`upstream_wait`] of an answer given as its status and headers.
pub(crate) fn answer_wait(status: http::StatusCode, headers: &http::HeaderMap) -> Option<Duration> {
    if (status == http::StatusCode::TOO_MANY_REQUESTS
        || status == http::StatusCode::SERVICE_UNAVAILABLE)
        && let Some(wait) = retry_after(headers)
    {
        return Some(wait);
    }
    if headers.get("grpc-status").and_then(|v| v.to_str().ok()) == Some("8")
        && let Some(ms) = headers.get("grpc-retry-pushback-ms")
    {
        return ms
            .to_str()
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
            .map(Duration::from_millis);
    }
    // Before any refusal: the server's `RateLimit` field (or, without one, the older
    // `X-RateLimit-Remaining` and `-Reset`) says a policy has nothing left until its reset.
    // An invalid field is no request to wait.
    let field = crate::fields::RateLimit::from_headers(headers)
        .or_else(|| crate::fields::RateLimit::from_legacy_headers(headers))?;
    field.ok()?.wait()
}

/// `Retry-After`, in seconds or as an HTTP date.
pub(crate) fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    date.duration_since(std::time::SystemTime::now()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(status: u16, headers: &[(&str, &str)]) -> http::Response<()> {
        let mut b = http::Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn upstream_waits_are_read_from_the_answers_that_carry_them() {
        let secs = Duration::from_secs;
        assert_eq!(
            upstream_wait(&res(429, &[("retry-after", "3")])),
            Some(secs(3))
        );
        assert_eq!(
            upstream_wait(&res(503, &[("retry-after", " 1 ")])),
            Some(secs(1))
        );
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + secs(30));
        let d = upstream_wait(&res(503, &[("retry-after", &later)])).unwrap();
        assert!(d > secs(28) && d <= secs(30), "{d:?}");
        let past = httpdate::fmt_http_date(std::time::SystemTime::now() - secs(30));
        assert_eq!(upstream_wait(&res(503, &[("retry-after", &past)])), None);
        let grpc = [("grpc-status", "8"), ("grpc-retry-pushback-ms", "250")];
        assert_eq!(
            upstream_wait(&res(200, &grpc)),
            Some(Duration::from_millis(250))
        );
        let stop = [("grpc-status", "8"), ("grpc-retry-pushback-ms", "-1")];
        assert_eq!(upstream_wait(&res(200, &stop)), None);
        for none in [
            res(200, &[("retry-after", "3")]),
            res(429, &[]),
            res(429, &[("retry-after", "soon")]),
            res(500, &[("retry-after", "3")]),
        ] {
            assert_eq!(upstream_wait(&none), None);
        }
    }

    /// A client paces itself from the server's `RateLimit` field before it is refused: a policy
    /// with nothing left (`r=0`) pauses the key until its `t`; `Retry-After` on a refusal
    /// comes first; an invalid field is no request to wait.
    #[test]
    fn the_ratelimit_field_paces_before_a_refusal() {
        let secs = Duration::from_secs;
        let empty = [("ratelimit", r#""api";r=0;t=7"#)];
        assert_eq!(upstream_wait(&res(200, &empty)), Some(secs(7)));
        let two = [("ratelimit", r#""a";r=3;t=1, "b";r=0;t=40"#)];
        assert_eq!(upstream_wait(&res(200, &two)), Some(secs(40)));
        let refused = [("retry-after", "2"), ("ratelimit", r#""api";r=0;t=7"#)];
        assert_eq!(upstream_wait(&res(429, &refused)), Some(secs(2)));
        let refused_without = [("ratelimit", r#""api";r=0;t=7"#)];
        assert_eq!(upstream_wait(&res(429, &refused_without)), Some(secs(7)));
        for none in [
            [("ratelimit", r#""api";r=5;t=7"#)],
            [("ratelimit", r#""api";r=0"#)],
            [("ratelimit", r#""api";r=0;t=0"#)],
            [("ratelimit", "not a field")],
        ] {
            assert_eq!(upstream_wait(&res(200, &none)), None, "{none:?}");
        }
        let legacy = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "9")];
        assert_eq!(upstream_wait(&res(200, &legacy)), Some(secs(9)));
    }
}
