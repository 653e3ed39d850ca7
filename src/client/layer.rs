//! The tower layers: [`ThrottleLayer`] and [`RetryLayer`], for any client that is a tower
//! service of `http` requests (hyper's, tonic's `Channel`, ...).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Method, Request, Response};
use tower_service::Service;

use super::{RetryBudget, Throttle, ThrottleTicket, Throttled};
use crate::deadline::Deadline;

pub use crate::error::BoxError;

/// A tower layer refusing calls by a [`Throttle`]: a call it refuses fails at once with
/// [`Throttled`], never sent; each answer is reported to the throttle.
///
/// ```
/// use tollgate::client::{Throttle, ThrottleLayer, Throttled};
/// use tower::{Service, ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // An upstream that is down: every call answers 503.
/// let upstream = tower::service_fn(|_req: http::Request<()>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::builder().status(503).body(()).unwrap())
/// });
/// let mut client = ServiceBuilder::new()
///     .layer(ThrottleLayer::new(Throttle::new()))
///     .service(upstream);
/// let mut throttled = 0;
/// for _ in 0..200 {
///     let call = client.ready().await.unwrap().call(http::Request::new(()));
///     if let Err(e) = call.await {
///         assert!(e.is::<Throttled>());
///         throttled += 1;
///     }
/// }
/// assert!(throttled > 150, "most calls were never sent: {throttled}");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ThrottleLayer {
    throttle: Throttle,
}

impl ThrottleLayer {
    /// Throttles the calls by `throttle` (share one per upstream).
    pub fn new(throttle: Throttle) -> Self {
        ThrottleLayer { throttle }
    }
}

impl<S> tower_layer::Layer<S> for ThrottleLayer {
    type Service = ThrottleService<S>;

    fn layer(&self, inner: S) -> ThrottleService<S> {
        ThrottleService {
            inner,
            throttle: self.throttle.clone(),
        }
    }
}

/// The service [`ThrottleLayer`] makes.
#[derive(Debug, Clone)]
pub struct ThrottleService<S> {
    inner: S,
    throttle: Throttle,
}

impl<S, B, R> Service<Request<B>> for ThrottleService<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = ThrottleFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        match self.throttle.admit() {
            Ok(ticket) => ThrottleFuture::Sent {
                future: self.inner.call(req),
                ticket: Some(ticket),
            },
            Err(throttled) => ThrottleFuture::Refused {
                throttled: Some(throttled),
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`ThrottleService`].
    #[project = ThrottleProj]
    #[allow(missing_docs)]
    pub enum ThrottleFuture<F> {
        /// Sent: its answer is reported to the throttle.
        Sent { #[pin] future: F, ticket: Option<ThrottleTicket> },
        /// Refused by the throttle, never sent.
        Refused { throttled: Option<Throttled> },
    }
}

impl<F, R, E> Future for ThrottleFuture<F>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            ThrottleProj::Sent { future, ticket } => {
                let out = std::task::ready!(future.poll(cx));
                if let Some(ticket) = ticket.take() {
                    match &out {
                        Ok(res) => {
                            ticket.observe(res.status(), res.headers());
                        }
                        Err(_) => ticket.not_accepted(),
                    }
                }
                Poll::Ready(out.map_err(Into::into))
            }
            ThrottleProj::Refused { throttled } => Poll::Ready(Err(Box::new(
                throttled.take().unwrap_or(Throttled { probability: 1.0 }),
            ))),
        }
    }
}

/// Marks a request as safe to retry whatever its method: insert it in the request's
/// extensions (a gRPC call, all `POST`, that is idempotent; a `POST` with an idempotency
/// key).
#[derive(Debug, Clone, Copy, Default)]
pub struct RetrySafe;

type SafeFn = dyn Fn(&Request<()>) -> bool + Send + Sync;

/// A tower layer that retries calls within a [`RetryBudget`], with backoff and jitter.
///
/// - **Which calls**: those safe to retry: methods that are idempotent (`GET`, `HEAD`,
///   `OPTIONS`, `TRACE`, `PUT`, `DELETE`), a request carrying [`RetrySafe`] in its
///   extensions, or what [`safe`](Self::safe) says.
/// - **Which answers**: `429`, `502`, `503`, `504`; gRPC `UNAVAILABLE`, and
///   `RESOURCE_EXHAUSTED` when it carries a pushback (`grpc-retry-pushback-ms`) of 0 or more;
///   a call that failed without an answer (the inner service's error). Never a call refused
///   by a [`Throttle`] under this layer, nor an answer whose pushback is negative ("do not
///   retry").
/// - **When**: after a backoff with full jitter (a random wait up to `base × 2^(n−1)` before
///   the `n`th retry, at most `max`; by default 25 ms and 1 s), or after the `Retry-After`
///   (or pushback) the answer asks for when that is longer; an answer asking for more than
///   [`max_wait`](Self::max_wait) (10 s) is not retried.
/// - **Not past the deadline**: a call with a [`Deadline`] (in its extensions, or the current
///   one) is not retried when the wait would reach it.
/// - **How many**: at most [`max_retries`](Self::max_retries) (3), each withdrawn from the
///   budget; a retry the budget refuses is not made and the caller gets the answer it would
///   have retried (the original answer: the upstream's answer, or the failure of a call that
///   had none). The first attempt deposits in the budget.
///
/// The request is cloned for each attempt: its body must be `Clone` (`Full<Bytes>`,
/// `String`, ...; for tonic's, put a [`BufferLayer`](super::BufferLayer) above this layer).
/// The answer being retried is held until the next attempt has answered, so that an attempt
/// refused here (throttled) gives the caller the last real answer.
///
/// ```
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::sync::Arc;
/// use tollgate::client::{RetryBudget, RetryLayer};
/// use tower::{Service, ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// // An upstream that answers 503 twice, then 200.
/// let calls = Arc::new(AtomicU32::new(0));
/// let seen = calls.clone();
/// let upstream = tower::service_fn(move |_req: http::Request<String>| {
///     let n = seen.fetch_add(1, Ordering::Relaxed);
///     async move {
///         let status = if n < 2 { 503 } else { 200 };
///         Ok::<_, std::convert::Infallible>(http::Response::builder().status(status).body(()).unwrap())
///     }
/// });
/// let mut client = ServiceBuilder::new()
///     .layer(RetryLayer::new(RetryBudget::new()))
///     .service(upstream);
/// let res = client.ready().await.unwrap().call(http::Request::new(String::new())).await.unwrap();
/// assert_eq!((res.status().as_u16(), calls.load(Ordering::Relaxed)), (200, 3));
/// # }
/// ```
#[derive(Clone)]
pub struct RetryLayer {
    cfg: Arc<RetryRules>,
}

#[derive(Clone)]
pub(crate) struct RetryRules {
    budget: RetryBudget,
    pub(crate) max_retries: u32,
    base: Duration,
    max: Duration,
    max_wait: Duration,
    safe: Option<Arc<SafeFn>>,
}

impl std::fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.cfg;
        f.debug_struct("RetryLayer")
            .field("budget", &c.budget)
            .field("max_retries", &c.max_retries)
            .field("backoff", &(c.base, c.max))
            .field("max_wait", &c.max_wait)
            .field("safe", &c.safe.as_ref().map(|_| "custom"))
            .finish()
    }
}

impl RetryLayer {
    /// Retries within `budget` (share one per upstream), up to 3 times a call.
    pub fn new(budget: RetryBudget) -> Self {
        RetryLayer {
            cfg: Arc::new(RetryRules {
                budget,
                max_retries: 3,
                base: Duration::from_millis(25),
                max: Duration::from_secs(1),
                max_wait: Duration::from_secs(10),
                safe: None,
            }),
        }
    }

    /// Changes this layer's rules (a clone's own copy of them, sharing the budget).
    fn with(mut self, f: impl FnOnce(&mut RetryRules)) -> Self {
        f(Arc::make_mut(&mut self.cfg));
        self
    }

    /// The most retries of one call (default 3).
    pub fn max_retries(self, n: u32) -> Self {
        self.with(|c| c.max_retries = n)
    }

    /// The backoff: the `n`th retry waits a random time up to `base × 2^(n−1)`, at most
    /// `max` (defaults 25 ms and 1 s).
    pub fn backoff(self, base: Duration, max: Duration) -> Self {
        self.with(|c| {
            c.base = base;
            c.max = max.max(base);
        })
    }

    /// The longest `Retry-After` (or gRPC pushback) waited out before a retry (default
    /// 10 s): an answer asking for more is given to the caller.
    pub fn max_wait(self, max: Duration) -> Self {
        self.with(|c| c.max_wait = max)
    }

    /// Which requests are safe to retry, besides the idempotent methods and [`RetrySafe`]:
    /// called with the request's head (its body left out).
    pub fn safe(self, f: impl Fn(&Request<()>) -> bool + Send + Sync + 'static) -> Self {
        self.with(|c| c.safe = Some(Arc::new(f)))
    }

    /// The budget retries are withdrawn from.
    pub fn budget(&self) -> &RetryBudget {
        &self.cfg.budget
    }

    /// The policy, for the reqwest middleware.
    #[cfg_attr(not(feature = "reqwest"), allow(dead_code))]
    pub(crate) fn config(&self) -> &Arc<RetryRules> {
        &self.cfg
    }
}

impl<S> tower_layer::Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}

/// The service [`RetryLayer`] makes.
#[derive(Clone)]
pub struct Retry<S> {
    inner: S,
    cfg: Arc<RetryRules>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Retry<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// What an answer says about retrying it: [`Judged::Again`] after what it asks for, or
/// [`Judged::Final`].
pub(crate) fn again_of(status: http::StatusCode, headers: &http::HeaderMap) -> Judged {
    let asked = crate::wait::answer_wait(status, headers).unwrap_or_default();
    if matches!(status.as_u16(), 429 | 502 | 503 | 504) {
        return Judged::Again(asked);
    }
    let pushback = headers
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    if pushback.is_some_and(|p| p.starts_with('-')) {
        return Judged::Final;
    }
    match headers.get("grpc-status").map(http::HeaderValue::as_bytes) {
        Some(b"14") => Judged::Again(asked),
        Some(b"8") if pushback.is_some() => Judged::Again(asked),
        _ => Judged::Final,
    }
}

fn is_safe(cfg: &RetryRules, parts: &http::request::Parts) -> bool {
    cfg.safe_for(
        &parts.method,
        parts.extensions.get::<RetrySafe>().is_some(),
        || {
            let mut head = Request::new(());
            *head.method_mut() = parts.method.clone();
            *head.uri_mut() = parts.uri.clone();
            *head.headers_mut() = parts.headers.clone();
            head
        },
    )
}

impl RetryRules {
    /// The budget retries are withdrawn from.
    #[cfg_attr(not(feature = "reqwest"), allow(dead_code))]
    pub(crate) fn budget(&self) -> &RetryBudget {
        &self.budget
    }

    /// Whether a request is safe to retry: an idempotent method, `marked` with [`RetrySafe`],
    /// or what the user's check says of its head.
    pub(crate) fn safe_for(
        &self,
        method: &Method,
        marked: bool,
        head: impl FnOnce() -> Request<()>,
    ) -> bool {
        if marked
            || matches!(
                *method,
                Method::GET
                    | Method::HEAD
                    | Method::OPTIONS
                    | Method::TRACE
                    | Method::PUT
                    | Method::DELETE
            )
        {
            return true;
        }
        self.safe.as_ref().is_some_and(|f| f(&head()))
    }

    /// Whether retry `n + 1` is made after attempt `n + 1` asked for `asked`: the wait before
    /// it, withdrawn from the budget; `None` when the budget refuses it or the wait would
    /// reach the deadline.
    pub(crate) fn next(
        &self,
        n: u32,
        asked: Duration,
        deadline: Option<Deadline>,
    ) -> Option<Duration> {
        let wait = self.wait(n + 1, asked);
        if deadline.is_some_and(|d| d.remaining() <= wait) {
            return None;
        }
        self.budget.withdraw().then_some(wait)
    }

    /// The wait before retry `n` (1-based): full jitter over the backoff, at least what the
    /// answer asked for.
    fn wait(&self, n: u32, asked: Duration) -> Duration {
        let cap = (self.base)
            .saturating_mul(1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX))
            .min(self.max);
        cap.mul_f64(fastrand::f64()).max(asked)
    }
}

impl<S, B, R> Service<Request<B>> for Retry<S>
where
    S: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Clone + Send + 'static,
    R: Send + 'static,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<R>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The ready service answers the first attempt; a clone waits for the next one's turn.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        Box::pin(async move {
            cfg.budget.deposit();
            let (parts, body) = req.into_parts();
            let retries = if is_safe(&cfg, &parts) {
                cfg.max_retries
            } else {
                0
            };
            let req = Request::from_parts(parts, body);
            // The call's deadline, if it has one: no retry that could not end before it.
            let deadline = req
                .extensions()
                .get::<Deadline>()
                .copied()
                .or_else(Deadline::current);
            // The first attempt sends the request itself (its extensions whole); retries send
            // copies of it, each on a clone of the service made ready again.
            let template = (retries > 0).then(|| (clone_request(&req), inner.clone()));
            let mut first = Some((req, inner));
            let attempt = move || {
                let (req, mut svc) = match (first.take(), &template) {
                    (Some(first), _) => first,
                    (None, Some((req, svc))) => (clone_request(req), svc.clone()),
                    (None, None) => return None,
                };
                Some(async move {
                    std::future::poll_fn(|cx| svc.poll_ready(cx))
                        .await
                        .map_err(Into::into)?;
                    svc.call(req).await.map_err(Into::into)
                })
            };
            let judge = |out: &Result<Response<R>, BoxError>| match out {
                Ok(res) => again_of(res.status(), res.headers()),
                Err(e) if e.is::<Throttled>() => Judged::Refused,
                Err(_) => Judged::Again(Duration::ZERO),
            };
            drive(&cfg, retries, deadline, attempt, judge, || {
                BoxError::from("no attempt was made")
            })
            .await
        })
    }
}

/// What an attempt's outcome means for the call.
#[derive(Debug, PartialEq)]
pub(crate) enum Judged {
    /// The caller's answer.
    Final,
    /// Worth another attempt, after at least this long.
    Again(Duration),
    /// Refused in this client (throttled): the caller gets the last real outcome.
    Refused,
}

/// The retry loop, for any protocol: runs `attempt()`s while `judge` says another may help,
/// the call has retries left, the answer's wait is within `max_wait`, the deadline allows the
/// wait and the budget gives a retry. The caller gets the outcome that was not retried: the
/// last attempt's, or the last real one when an attempt was refused in this client.
pub(crate) async fn drive<T, E, F, Fut>(
    rules: &RetryRules,
    retries: u32,
    deadline: Option<Deadline>,
    mut attempt: impl FnMut() -> Option<Fut>,
    judge: impl Fn(&Result<T, E>) -> Judged,
    none: F,
) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
    F: FnOnce() -> E,
{
    let mut last = None;
    let mut n = 0u32;
    while let Some(future) = attempt() {
        let out = future.await;
        let asked = match judge(&out) {
            Judged::Again(asked) if n < retries && asked <= rules.max_wait => asked,
            Judged::Refused => return last.unwrap_or(out),
            Judged::Final | Judged::Again(_) => return out,
        };
        last = Some(out);
        let Some(wait) = rules.next(n, asked, deadline) else {
            break;
        };
        // Dropped while it waits, the call gives its retry back: it was never made.
        let withdrawn = Withdrawn(Some(&rules.budget));
        tokio::time::sleep(wait).await;
        withdrawn.made();
        n += 1;
    }
    last.unwrap_or_else(|| Err(none()))
}

/// A retry withdrawn from the budget and not made yet: given back if dropped.
struct Withdrawn<'a>(Option<&'a RetryBudget>);

impl Withdrawn<'_> {
    fn made(mut self) {
        self.0 = None;
    }
}

impl Drop for Withdrawn<'_> {
    fn drop(&mut self) {
        if let Some(budget) = self.0 {
            budget.give_back();
        }
    }
}

fn clone_request<B: Clone>(req: &Request<B>) -> Request<B> {
    let mut out = Request::new(req.body().clone());
    *out.method_mut() = req.method().clone();
    *out.uri_mut() = req.uri().clone();
    *out.version_mut() = req.version();
    *out.headers_mut() = req.headers().clone();
    *out.extensions_mut() = req.extensions().clone();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_answers_are_retried() {
        let h = |pairs: &[(&'static str, &str)]| {
            let mut h = http::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, v.parse().unwrap());
            }
            h
        };
        let s = |c| http::StatusCode::from_u16(c).unwrap();
        assert_eq!(again_of(s(200), &h(&[])), Judged::Final);
        assert_eq!(again_of(s(500), &h(&[])), Judged::Final);
        assert_eq!(again_of(s(503), &h(&[])), Judged::Again(Duration::ZERO));
        assert_eq!(
            again_of(s(429), &h(&[("retry-after", "2")])),
            Judged::Again(Duration::from_secs(2))
        );
        assert_eq!(
            again_of(s(200), &h(&[("grpc-status", "14")])),
            Judged::Again(Duration::ZERO)
        );
        assert_eq!(again_of(s(200), &h(&[("grpc-status", "8")])), Judged::Final);
        assert_eq!(
            again_of(
                s(200),
                &h(&[("grpc-status", "8"), ("grpc-retry-pushback-ms", "300")])
            ),
            Judged::Again(Duration::from_millis(300))
        );
        assert_eq!(
            again_of(
                s(200),
                &h(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")])
            ),
            Judged::Final
        );
    }

    /// A call dropped while it waits for its retry gives the retry back to the budget: it was
    /// never made.
    #[tokio::test(start_paused = true)]
    async fn a_call_dropped_during_its_backoff_gives_its_retry_back() {
        use tower::ServiceExt;
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let seen = sent.clone();
        let upstream = tower::service_fn(move |_req: Request<()>| {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async {
                Ok::<_, std::convert::Infallible>(
                    Response::builder()
                        .status(503)
                        .header("retry-after", "2")
                        .body(())
                        .unwrap(),
                )
            }
        });
        let budget = RetryBudget::new();
        let client = tower_layer::Layer::layer(&RetryLayer::new(budget.clone()), upstream);
        let call = client.oneshot(Request::new(()));
        // The caller gives up after 500 ms: the retry waits 2 s for the `Retry-After`.
        let gave_up = tokio::time::timeout(Duration::from_millis(500), call).await;
        assert!(gave_up.is_err());
        assert_eq!(sent.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(budget.counts(), (1, 0), "the retry was given back");
    }

    #[test]
    fn a_cloned_layer_is_configured_on_its_own() {
        let a = RetryLayer::new(RetryBudget::new()).max_retries(2);
        let b = a.clone().max_retries(5).safe(|_| true);
        assert_eq!((a.cfg.max_retries, b.cfg.max_retries), (2, 5));
        assert!(a.cfg.safe.is_none() && b.cfg.safe.is_some());
    }

    #[test]
    fn backoff_grows_with_full_jitter_and_a_cap() {
        let l = RetryLayer::new(RetryBudget::new());
        for _ in 0..200 {
            assert!(l.cfg.wait(1, Duration::ZERO) <= Duration::from_millis(25));
            assert!(l.cfg.wait(3, Duration::ZERO) <= Duration::from_millis(100));
            assert!(l.cfg.wait(40, Duration::ZERO) <= Duration::from_secs(1));
            assert!(l.cfg.wait(1, Duration::from_secs(2)) == Duration::from_secs(2));
        }
        let spread: std::collections::HashSet<_> =
            (0..50).map(|_| l.cfg.wait(3, Duration::ZERO)).collect();
        assert!(spread.len() > 40, "jittered");
    }
}
