//! Outbound calls made with [reqwest](https://docs.rs/reqwest) (feature `reqwest`): a
//! [`reqwest-middleware`](https://docs.rs/reqwest-middleware) middleware that limits them with a
//! [`Limiter`], waiting for a turn or failing fast, keyed by the URL's host or a closure.
//!
//! ```no_run
//! use std::time::Duration;
//! use tollgate::backend::LocalBackend;
//! use tollgate::limiter::Limiter;
//! use tollgate::middleware::RateLimitMiddleware;
//! use tollgate::{Policy, Quota};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // At most 20 calls per second to each host, waiting up to 5 s for a turn.
//! let limiter = Limiter::new(Policy::new("partners", Quota::per_second(20)), LocalBackend::new())?;
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(RateLimitMiddleware::new(limiter).wait(Duration::from_secs(5)))
//!     .build();
//! let res = client.get("https://api.partner.example/v1/things").send().await?;
//! # drop(res); Ok(()) }
//! ```
//!
//! A call that cannot go on (its turn is further away than the wait, or, failing fast, the
//! bucket is empty) fails with [`reqwest_middleware::Error::Middleware`] holding an
//! [`AcquireError`], before anything is sent:
//! `err.downcast_ref::<AcquireError>()` on the inner error tells when to come back. Waiting is
//! a reservation, as for [`Limiter::acquire`]: callers (and, on a shared backend, processes) go
//! on first come, first served, at the policy's rate.
//!
//! With [`obey_retry_after(true)`](RateLimitMiddleware::obey_retry_after), an upstream's
//! `429` or `503` with `Retry-After` (seconds or an HTTP date), or gRPC's
//! `grpc-retry-pushback-ms`, pauses the call's key, as the layer's
//! [`obey_retry_after`](crate::RateLimitLayerBuilder::obey_retry_after) does: later calls
//! wait out the pause when waiting allows it, and fail with [`AcquireError::Paused`]
//! otherwise, without reaching the upstream.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use http::Extensions;
use reqwest_middleware::{Middleware, Next};

use crate::Key;
use crate::adaptive::{Ask, Upstreams};
use crate::backend::Backend;
use crate::client::{Judged, RetryLayer, RetrySafe, Throttle, Throttled, again_of, drive};
use crate::deadline::Deadline;
use crate::limiter::{AcquireError, Limiter};
use crate::wait::Pauses;

type KeyFn = dyn Fn(&reqwest::Request) -> Option<Key> + Send + Sync;

/// Limits the calls of a reqwest-middleware client; see the [module docs](self).
pub struct RateLimitMiddleware<B: Backend> {
    limiter: Limiter<B>,
    key: Arc<KeyFn>,
    wait: Option<Duration>,
    cost: NonZeroU32,
    /// Keys the upstream asked to slow down, when obeyed.
    pauses: Option<Arc<Pauses>>,
}

impl<B: Backend> Clone for RateLimitMiddleware<B> {
    fn clone(&self) -> Self {
        RateLimitMiddleware {
            limiter: self.limiter.clone(),
            key: self.key.clone(),
            wait: self.wait,
            cost: self.cost,
            pauses: self.pauses.clone(),
        }
    }
}

impl<B: Backend> fmt::Debug for RateLimitMiddleware<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitMiddleware")
            .field("limiter", &self.limiter)
            .field("wait", &self.wait)
            .field("cost", &self.cost)
            .field("obey_retry_after", &self.pauses.is_some())
            .finish_non_exhaustive()
    }
}

/// A call's upstream: its URL's host and port (`api.partner.example:443`).
fn host_port(req: &reqwest::Request) -> Option<String> {
    let url = req.url();
    let host = url.host_str()?;
    let port = url.port_or_known_default().unwrap_or(0);
    Some(format!("{host}:{port}"))
}

/// The key of a call: its upstream ([`host_port`]).
fn host_key(req: &reqwest::Request) -> Option<Key> {
    Key::from_bytes(host_port(req)?).ok()
}

impl<B: Backend> RateLimitMiddleware<B> {
    /// Limits calls with `limiter`, one unit each, keyed by their URL's host and port, failing
    /// fast when the bucket is empty.
    pub fn new(limiter: Limiter<B>) -> Self {
        RateLimitMiddleware {
            limiter,
            key: Arc::new(host_key),
            wait: None,
            cost: NonZeroU32::MIN,
            pauses: None,
        }
    }

    /// Waits up to `max_wait` for a turn instead of failing fast.
    pub fn wait(mut self, max_wait: Duration) -> Self {
        self.wait = Some(max_wait);
        self
    }

    /// Keys calls with `key` instead of their host (`None`: the call is not limited).
    pub fn key(
        mut self,
        key: impl Fn(&reqwest::Request) -> Option<Key> + Send + Sync + 'static,
    ) -> Self {
        self.key = Arc::new(key);
        self
    }

    /// Units each call costs (default 1).
    pub fn cost(mut self, cost: NonZeroU32) -> Self {
        self.cost = cost;
        self
    }

    /// When the upstream answers `429` or `503` with `Retry-After` (seconds or an HTTP date),
    /// or gRPC `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`, the call's key is paused
    /// until then (at most an hour): later calls for it wait out the pause when it is within
    /// the [wait](Self::wait), and otherwise fail at once with [`AcquireError::Paused`],
    /// without reaching the upstream. The same as the layer's
    /// [`obey_retry_after`](crate::RateLimitLayerBuilder::obey_retry_after); clones of the
    /// middleware share the pauses (in memory, at most 65 536 keys at once).
    pub fn obey_retry_after(mut self, on: bool) -> Self {
        self.pauses = on.then(Arc::default);
        self
    }
}

#[async_trait::async_trait]
impl<B: Backend> Middleware for RateLimitMiddleware<B> {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let key = (self.key)(&req);
        if let Some(key) = &key {
            // The upstream asked to slow down for this key: wait out the pause (within the
            // wait), or fail now.
            let mut max_wait = self.wait;
            if let Some(pause) = self.pauses.as_ref().and_then(|p| p.remaining(key)) {
                match max_wait {
                    Some(wait) if pause <= wait => {
                        tokio::time::sleep(pause).await;
                        max_wait = Some(wait - pause);
                    }
                    _ => {
                        let paused = AcquireError::Paused(pause);
                        return Err(reqwest_middleware::Error::middleware(paused));
                    }
                }
            }
            let turn = match max_wait {
                Some(max_wait) => self.limiter.acquire(key, self.cost, max_wait).await,
                None => match self.limiter.check(key, self.cost).await {
                    Ok(d) if d.is_allowed() => Ok(d),
                    Ok(d) if d.never_fits() => Err(AcquireError::NeverFits(d)),
                    Ok(d) => Err(AcquireError::TooLong(d)),
                    Err(err) => Err(AcquireError::Backend(err)),
                },
            };
            turn.map_err(reqwest_middleware::Error::middleware)?;
        }
        let res = next.run(req, extensions).await;
        if let (Some(pauses), Some(key), Ok(res)) = (&self.pauses, &key, &res) {
            pauses.note_answer(key, res.status(), res.headers());
        }
        res
    }
}

/// Adapts how many calls a reqwest-middleware client makes at once to each upstream (its URL's
/// host and port) to what the upstream shows, with an [`Upstreams`]: over an upstream's limit,
/// or while it asked to wait (`Retry-After` on a `429` or `503`), a call fails at once with
/// [`reqwest_middleware::Error::Middleware`] holding a [`Refused`](crate::adaptive::Refused),
/// before anything is sent. A `429`, a `503`, a timeout or a failed connection is a drop; any
/// other answer a sample of the call's latency (to its response's head). Put a retry middleware before it (outside):
/// each attempt is then its own sample. Beside [`RateLimitMiddleware`], which keeps a rate,
/// this keeps the upstream from drowning.
///
/// ```no_run
/// use tollgate::adaptive::{AdaptiveLimit, Upstreams};
/// use tollgate::middleware::AdaptiveMiddleware;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let upstreams = Upstreams::new(|host| AdaptiveLimit::builder().name(host).range(2, 200))?;
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(AdaptiveMiddleware::new(upstreams))
///     .build();
/// let res = client.get("https://api.partner.example/v1/things").send().await?;
/// # drop(res); Ok(()) }
/// ```
#[derive(Clone)]
pub struct AdaptiveMiddleware {
    upstreams: Upstreams,
    flow: Option<OutboundFlow>,
}

/// Which flow an outbound call is of ([`AdaptiveMiddleware::flow_by`]).
type OutboundFlow = Arc<dyn for<'r> Fn(&'r reqwest::Request) -> Option<&'r str> + Send + Sync>;

impl fmt::Debug for AdaptiveMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveMiddleware")
            .field("upstreams", &self.upstreams)
            .field("flow", &self.flow.is_some())
            .finish()
    }
}

impl AdaptiveMiddleware {
    /// Limits each upstream's calls in flight with its limit in `upstreams`, at the current
    /// [criticality](crate::criticality::Criticality).
    pub fn new(upstreams: Upstreams) -> Self {
        AdaptiveMiddleware {
            upstreams,
            flow: None,
        }
    }

    /// Keys each call's flow (the tenant it is made for) for fairness inside its upstream's
    /// limit: near the limit, the calls of the flow holding the most slots are refused first
    /// (see [`AdaptiveLayer::flow_by`](crate::adaptive::AdaptiveLayer::flow_by)).
    ///
    /// ```
    /// use tollgate::adaptive::{AdaptiveLimit, Upstreams};
    /// use tollgate::middleware::AdaptiveMiddleware;
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// let upstreams = Upstreams::new(|host| AdaptiveLimit::builder().name(host))?;
    /// let by_tenant = AdaptiveMiddleware::new(upstreams)
    ///     .flow_by(|req| req.headers().get("x-tenant").and_then(|v| v.to_str().ok()));
    /// # drop(by_tenant); Ok(()) }
    /// ```
    pub fn flow_by(
        mut self,
        by: impl for<'r> Fn(&'r reqwest::Request) -> Option<&'r str> + Send + Sync + 'static,
    ) -> Self {
        self.flow = Some(Arc::new(by));
        self
    }

    /// The limits, per upstream (`host:port`).
    pub fn upstreams(&self) -> &Upstreams {
        &self.upstreams
    }
}

#[async_trait::async_trait]
impl Middleware for AdaptiveMiddleware {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let Some(upstream) = host_port(&req) else {
            return next.run(req, extensions).await;
        };
        let mut ask = Ask::new();
        if let Some(key) = (self.flow.as_ref()).and_then(|by| by(&req)) {
            ask = ask.flow(key);
        }
        // The call's own level (an extension) over the current one.
        if let Some(level) = extensions.get::<crate::criticality::Criticality>() {
            ask = ask.criticality(*level);
        }
        let permit = (self.upstreams.try_acquire_as(&upstream, ask))
            .map_err(reqwest_middleware::Error::middleware)?;
        let res = next.run(req, extensions).await;
        match &res {
            Ok(answer) => {
                permit.observe(answer.status(), answer.headers());
            }
            Err(reqwest_middleware::Error::Reqwest(e)) if e.is_timeout() || e.is_connect() => {
                permit.dropped();
            }
            // Another failure (a redirect loop, a body that would not build): no sample, the
            // slot given back.
            Err(_) => drop(permit),
        }
        res
    }
}

/// Adaptive throttling of a reqwest-middleware client's calls ([`Throttle`]): a call the
/// throttle refuses fails at once with [`reqwest_middleware::Error::Middleware`] holding a
/// [`Throttled`], never sent; each answer (or failure) is reported to it. One throttle per
/// upstream: give each upstream's client its own, or use [`per_host`](Self::per_host).
///
/// ```no_run
/// use tollgate::client::{RetryBudget, RetryLayer, Throttle};
/// use tollgate::middleware::{RetryMiddleware, ThrottleMiddleware};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// // Retries outside the throttle, so that they are throttled too.
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::new(RetryLayer::new(RetryBudget::new())))
///     .with(ThrottleMiddleware::new(Throttle::new()))
///     .build();
/// let res = client.get("https://api.partner.example/v1/things").send().await?;
/// # drop(res); Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct ThrottleMiddleware {
    throttles: PerHost<Throttle>,
}

impl ThrottleMiddleware {
    /// Every call through `throttle` (a client of one upstream).
    pub fn new(throttle: Throttle) -> Self {
        ThrottleMiddleware {
            throttles: PerHost::One(throttle),
        }
    }

    /// A throttle per upstream (the URL's host and port), made by `make` from its name on its
    /// first call; past 1 024 upstreams, the others share one named `other`.
    pub fn per_host(make: impl Fn(&str) -> Throttle + Send + Sync + 'static) -> Self {
        ThrottleMiddleware {
            throttles: PerHost::many(make),
        }
    }
}

#[async_trait::async_trait]
impl Middleware for ThrottleMiddleware {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let throttle = self.throttles.get(&req);
        let ticket = throttle
            .admit()
            .map_err(reqwest_middleware::Error::middleware)?;
        let res = next.run(req, extensions).await;
        match &res {
            Ok(answer) => {
                ticket.observe(answer.status(), answer.headers());
            }
            Err(_) => ticket.not_accepted(),
        }
        res
    }
}

/// Retries of a reqwest-middleware client's calls within a [`RetryBudget`](crate::client::RetryBudget),
/// by the policy of a [`RetryLayer`] (which calls, which answers, backoff and jitter,
/// `Retry-After`, deadlines, the budget: see there). A retry the budget refuses is not made and
/// the caller gets the answer it would have retried. A request whose body cannot be cloned (a
/// stream) is not retried. Mark a call safe to retry whatever its method with
/// `RequestBuilder::with_extension(RetrySafe)`.
#[derive(Clone, Debug)]
pub struct RetryMiddleware {
    policy: RetryLayer,
}

impl RetryMiddleware {
    /// Retries by `policy`'s rules and budget (share one budget per upstream).
    pub fn new(policy: RetryLayer) -> Self {
        RetryMiddleware { policy }
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let cfg = self.policy.config();
        cfg.budget().deposit();
        let marked = extensions.get::<RetrySafe>().is_some();
        let safe = cfg.safe_for(req.method(), marked, || {
            let mut head = http::Request::new(());
            *head.method_mut() = req.method().clone();
            if let Ok(uri) = req.url().as_str().parse() {
                *head.uri_mut() = uri;
            }
            *head.headers_mut() = req.headers().clone();
            head
        });
        let template = if safe { req.try_clone() } else { None };
        let retries = if template.is_some() {
            cfg.max_retries
        } else {
            0
        };
        let deadline = extensions
            .get::<Deadline>()
            .copied()
            .or_else(Deadline::current);
        // Each attempt runs the rest of the chain with its own copy of the extensions.
        let mut first = Some(req);
        let attempt = || {
            let req = match (first.take(), &template) {
                (Some(req), _) => req,
                (None, Some(t)) => t.try_clone()?,
                (None, None) => return None,
            };
            let (next, mut ext) = (next.clone(), extensions.clone());
            Some(async move { next.run(req, &mut ext).await })
        };
        let judge = |out: &reqwest_middleware::Result<reqwest::Response>| match out {
            Ok(answer) => again_of(answer.status(), answer.headers()),
            Err(reqwest_middleware::Error::Middleware(e)) if e.is::<Throttled>() => Judged::Refused,
            Err(reqwest_middleware::Error::Reqwest(e)) if e.is_connect() || e.is_timeout() => {
                Judged::Again(Duration::ZERO)
            }
            Err(_) => Judged::Final,
        };
        drive(cfg, retries, deadline, attempt, judge, || {
            reqwest_middleware::Error::middleware(std::io::Error::other("no attempt was made"))
        })
        .await
    }
}

/// Sends a call's [`Criticality`](crate::criticality::Criticality) in a header, so that the next service sheds the same traffic
/// first: the call's own (an extension: `RequestBuilder::with_extension`), else
/// [`Criticality::current`](crate::criticality::Criticality::current) (the inbound request's,
/// set by its adaptive layer). A call with the
/// header set already keeps it; one with no level is sent without. See
/// [`tollgate::criticality`](crate::criticality).
///
/// ```no_run
/// use tollgate::middleware::CriticalityMiddleware;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(CriticalityMiddleware::new(http::HeaderName::from_static("x-criticality")))
///     .build();
/// let res = client.get("https://inventory.internal/v1/stock").send().await?;
/// # drop(res); Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CriticalityMiddleware {
    header: http::HeaderName,
}

impl CriticalityMiddleware {
    /// Sends the level in header `name` (the one the next service reads).
    pub fn new(name: http::HeaderName) -> Self {
        CriticalityMiddleware { header: name }
    }
}

#[async_trait::async_trait]
impl Middleware for CriticalityMiddleware {
    async fn handle(
        &self,
        mut req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let level = crate::criticality::req_level(extensions);
        crate::criticality::set_header(req.headers_mut(), level, &self.header);
        next.run(req, extensions).await
    }
}

/// One value for every upstream, or one per upstream (host and port), made on first use.
#[derive(Clone)]
enum PerHost<T> {
    One(T),
    Many(Arc<Many<T>>),
}

struct Many<T> {
    make: Box<dyn Fn(&str) -> T + Send + Sync>,
    map: std::sync::Mutex<std::collections::HashMap<String, T>>,
}

impl<T> fmt::Debug for PerHost<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PerHost::One(_) => f.write_str("One"),
            PerHost::Many(m) => {
                let n = m.map.lock().map_or(0, |m| m.len());
                write!(f, "PerHost({n} upstreams)")
            }
        }
    }
}

/// The most upstreams with a value of their own.
const MAX_HOSTS: usize = 1024;

impl<T: Clone> PerHost<T> {
    fn many(make: impl Fn(&str) -> T + Send + Sync + 'static) -> Self {
        PerHost::Many(Arc::new(Many {
            make: Box::new(make),
            map: std::sync::Mutex::new(std::collections::HashMap::new()),
        }))
    }

    fn get(&self, req: &reqwest::Request) -> T {
        match self {
            PerHost::One(t) => t.clone(),
            PerHost::Many(m) => {
                let host = host_port(req).unwrap_or_else(|| "other".to_owned());
                let mut map = m.map.lock().unwrap_or_else(|e| e.into_inner());
                let host = if map.contains_key(&host) || map.len() < MAX_HOSTS {
                    host
                } else {
                    "other".to_owned()
                };
                map.entry(host)
                    .or_insert_with_key(|name| (m.make)(name))
                    .clone()
            }
        }
    }
}
