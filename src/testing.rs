//! A test kit for apps behind tollgate: time moved by hand, and the rate-limit fields of a
//! response read back. Needs the `testing` feature (a dev-dependency feature:
//! `tollgate = { version = "…", features = ["testing"] }` under `[dev-dependencies]`).
//!
//! - [`ManualClock`] is a clock that stands still until [`advance`](ManualClock::advance)
//!   moves it. [`ManualClock::backend`] builds a [`LocalBackend`] on it: give it to the layer
//!   under test (`.backend(clock.backend())`) and every algorithm of the local backend (GCRA,
//!   fixed and sliding windows, penalties from [`Policy::block_for`](crate::Policy::block_for))
//!   runs on it, so a test reaches a limit, moves past its reset, and checks that requests
//!   are allowed again, without sleeping. Settlements after the response are timed on it too:
//!   a refund goes back to the window its request was admitted in, on this clock.
//! - [`Fields`] reads `RateLimit`, `RateLimit-Policy` and `Retry-After` off a response.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, body::Body, http::Request, routing::get};
//! use tollgate::testing::{Fields, ManualClock};
//! use tollgate::{Policy, Quota, RateLimitLayer, key::Global};
//! use tower::ServiceExt; // oneshot
//!
//! # tokio_test_block_on(async {
//! let clock = ManualClock::new();
//! let limit = RateLimitLayer::builder()
//!     .backend(clock.backend())
//!     .key(Global)
//!     .policy(Policy::new("api", Quota::per_minute(2)))
//!     .build()
//!     .unwrap();
//! let app = Router::new().route("/", get(|| async { "hi" })).layer(limit);
//! let get = || Request::get("/").body(Body::empty()).unwrap();
//!
//! let res = app.clone().oneshot(get()).await.unwrap();
//! assert_eq!(Fields::of(&res).unwrap().remaining(), Some(1));
//! app.clone().oneshot(get()).await.unwrap();
//! let refused = app.clone().oneshot(get()).await.unwrap();
//! assert_eq!(refused.status(), 429);
//! let fields = Fields::of(&refused).unwrap();
//! assert_eq!(fields.retry_after, Some(Duration::from_secs(30)));
//!
//! clock.advance(Duration::from_secs(30)); // no sleep: the limit's time moves, nothing else
//! let res = app.clone().oneshot(get()).await.unwrap();
//! assert_eq!(res.status(), 200);
//! assert_eq!(Fields::of(&res).unwrap().remaining(), Some(0));
//! # });
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
//! # }
//! ```
//!
//! What the clock does not move: waits in wait mode ([`RateLimitLayerBuilder::wait`]) sleep on
//! Tokio's timer (pause and advance that one with `tokio::time::pause` / `tokio::time::advance`,
//! Tokio's `test-util` feature), and the pauses an upstream asks for (`obey_retry_after`,
//! [`Limiter::obey`](crate::limiter::Limiter::obey)) are timed on the system's monotonic clock,
//! which no test moves. A shared store (Redis, SQL) keeps its own time.
//!
//! [`RateLimitLayerBuilder::wait`]: crate::RateLimitLayerBuilder::wait

use std::time::Duration;

use governor::clock::{Clock, FakeRelativeClock};
use governor::nanos::Nanos;

use crate::backend::LocalBackend;
use crate::fields::{FieldError, RateLimit, RateLimitItem, RateLimitPolicy};

/// A clock that moves only when told to, shared by its clones.
///
/// It starts at [`ManualClock::START`] (2025-01-01 00:00:00 UTC), the Unix time the backends
/// built by [`backend`](Self::backend) align their windows to: every window that divides a day
/// (a second, a minute, an hour, a day) starts there, so a test knows where each begins.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    inner: FakeRelativeClock,
}

impl ManualClock {
    /// The Unix time the clock reads at its start: 2025-01-01 00:00:00 UTC.
    pub const START: Duration = Duration::from_secs(1_735_689_600);

    /// A clock at its start.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock (and every backend built on it) `by` on.
    pub fn advance(&self, by: Duration) {
        self.inner.advance(by);
    }

    /// How far the clock has been moved since it was made.
    pub fn elapsed(&self) -> Duration {
        self.inner.now().into()
    }

    /// A local backend on this clock, its windows aligned to [`START`](Self::START). Layers
    /// built on clones of one backend share its buckets, as usual; for other settings, build
    /// one with [`LocalBackend::builder`]`.clock(clock.clone()).clock_epoch(...)`.
    pub fn backend(&self) -> LocalBackend<ManualClock> {
        LocalBackend::builder()
            .clock(self.clone())
            .clock_epoch(Self::START + self.elapsed())
            .build()
    }
}

impl Clock for ManualClock {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        self.inner.now()
    }
}

/// The rate-limit fields of one response, parsed: `RateLimit`, `RateLimit-Policy` (the IETF
/// draft's, see [`crate::fields`]) and `Retry-After`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fields {
    /// The `RateLimit` field, when the response has one.
    pub rate_limit: Option<RateLimit>,
    /// The `RateLimit-Policy` field, when the response has one.
    pub policy: Option<RateLimitPolicy>,
    /// `Retry-After`, in seconds (or an HTTP date, as the time left until it).
    pub retry_after: Option<Duration>,
}

impl Fields {
    /// The fields of `response`. A field present but not valid is an error (a test wants to
    /// know); absent fields are `None`.
    pub fn of<B>(response: &http::Response<B>) -> Result<Self, FieldError> {
        Self::from_headers(response.headers())
    }

    /// The fields in `headers`.
    pub fn from_headers(headers: &http::HeaderMap) -> Result<Self, FieldError> {
        let retry_after = match headers.get(http::header::RETRY_AFTER) {
            None => None,
            Some(_) => Some(crate::wait::retry_after(headers).ok_or_else(|| {
                FieldError("`Retry-After` is neither delay-seconds nor a future HTTP date".into())
            })?),
        };
        Ok(Self {
            rate_limit: RateLimit::from_headers(headers).transpose()?,
            policy: RateLimitPolicy::from_headers(headers).transpose()?,
            retry_after,
        })
    }

    /// Units left (`r`) of the first `RateLimit` item. tollgate sends one item per quota, in
    /// the policy's order (on a refusal, only the quotas that refused): the first is the
    /// policy's first quota; [`item`](Self::item) finds others by name.
    pub fn remaining(&self) -> Option<u64> {
        self.first().map(|item| item.remaining)
    }

    /// Time until more quota is available (`t`) in the first `RateLimit` item.
    pub fn reset(&self) -> Option<Duration> {
        self.first().and_then(|item| item.reset)
    }

    /// The quota (`q`) of the first `RateLimit-Policy` item.
    pub fn quota(&self) -> Option<u64> {
        (self.policy.as_ref()?.items.first()).map(|item| item.quota)
    }

    /// The window (`w`) of the first `RateLimit-Policy` item.
    pub fn window(&self) -> Option<Duration> {
        (self.policy.as_ref()?.items.first()).and_then(|item| item.window)
    }

    /// The `RateLimit` item of the policy named `name`.
    pub fn item(&self, name: &str) -> Option<&RateLimitItem> {
        (self.rate_limit.as_ref()?.items.iter()).find(|item| item.policy == name)
    }

    fn first(&self) -> Option<&RateLimitItem> {
        self.rate_limit.as_ref()?.items.first()
    }
}
