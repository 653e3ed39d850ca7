//! Deadlines that travel: a request's deadline read from `grpc-timeout` (or a header of your
//! choosing), work dropped once its caller has given up, and the time left passed on to the
//! calls the request makes.
//!
//! - **Inbound**, [`DeadlineLayer`]: a request whose deadline has already passed is answered
//!   at once, never started (gRPC `DEADLINE_EXCEEDED`, HTTP `504 Gateway Timeout`, or the
//!   status you choose); one whose deadline passes while it waits (in an adaptive limit's
//!   queue) or runs is dropped then, its future with it, and answered the same way. While it
//!   runs, its [`Deadline`] is in its extensions and is [`Deadline::current`] in its task.
//! - **Outbound**, [`PropagateDeadlineLayer`]: a call made with a deadline (the request's
//!   [`Deadline`] extension, or the current one) sends what is left of it, less a margin, as
//!   `grpc-timeout` (gRPC calls) and in your header, fails without being sent when nothing is
//!   left ([`DeadlineExceeded`]), and fails at the deadline if the answer has not come. The
//!   [retry layer](crate::client::RetryLayer) makes no retry that could not end in time.
//!
//! The header's value is the time left in milliseconds (as Envoy's
//! `x-envoy-expected-rq-timeout-ms`); `grpc-timeout` is gRPC's (`100m`, `2S`, ...). Read only
//! from callers you trust to say how long they wait: a caller can only shorten its own
//! request's time, but a deadline header set by a gateway is better than one from anyone.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tollgate::deadline::{Deadline, DeadlineLayer};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let app: Router = Router::new()
//!     .route("/slow", get(|| async {
//!         // The caller's deadline, for the calls this handler makes.
//!         assert!(Deadline::current().is_some());
//!         tokio::time::sleep(Duration::from_secs(5)).await;
//!         "done"
//!     }))
//!     .layer(DeadlineLayer::new().header(http::HeaderName::from_static("x-request-timeout-ms")));
//! let req = http::Request::get("/slow")
//!     .header("x-request-timeout-ms", "200")
//!     .body(axum::body::Body::empty())
//!     .unwrap();
//! // The caller waits 200 ms: the work is dropped then, and answered 504.
//! let res = app.oneshot(req).await.unwrap();
//! assert_eq!(res.status(), 504);
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tokio::time::Instant;

use crate::body::RateLimitBody;

tokio::task_local! {
    static CURRENT: Deadline;
}

/// The instant by which a caller wants its answer: put in an inbound request's extensions by
/// [`DeadlineLayer`] and current in its task ([`current`](Self::current)); read by
/// [`PropagateDeadlineLayer`] and the retry layer from an outbound request's extensions, or
/// the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Instant);

impl Deadline {
    /// The deadline at `at`.
    pub fn at(at: Instant) -> Self {
        Deadline(at)
    }

    /// The deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        let now = Instant::now();
        Deadline(
            now.checked_add(timeout)
                .unwrap_or(now + Duration::from_secs(86_400 * 365)),
        )
    }

    /// When it is.
    pub fn instant(&self) -> Instant {
        self.0
    }

    /// The time left (zero once it has passed).
    pub fn remaining(&self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    /// Whether it has passed.
    pub fn has_passed(&self) -> bool {
        self.0 <= Instant::now()
    }

    /// The deadline of the request being served in this task ([`DeadlineLayer`], or
    /// [`scope`](Self::scope)), if any. A task spawned from it does not inherit it: give it
    /// the deadline ([`scope`](Self::scope)) where its calls belong to the request.
    pub fn current() -> Option<Deadline> {
        CURRENT.try_with(|d| *d).ok()
    }

    /// Runs `work` with this deadline current, or the current one where that is earlier: a
    /// callee never gets more time than its caller.
    pub async fn scope<F: Future>(self, work: F) -> F::Output {
        let d = Deadline::current().map_or(self, |outer| outer.min(self));
        CURRENT.scope(d, work).await
    }

    /// The deadline an inbound request states now: `grpc-timeout` (when `grpc`), and `header`
    /// (milliseconds left), the earlier of the two; `None` when it states none it may (an
    /// invalid value is none: the request is served as without one).
    pub fn from_headers(
        headers: &http::HeaderMap,
        grpc: bool,
        header: Option<&HeaderName>,
    ) -> Option<Deadline> {
        let from_grpc = grpc
            .then(|| headers.get("grpc-timeout"))
            .flatten()
            .and_then(|v| parse_grpc_timeout(v.to_str().ok()?));
        let from_header = header
            .and_then(|h| headers.get(h))
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_millis);
        let timeout = match (from_grpc, from_header) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(Deadline::after(timeout))
    }
}

/// gRPC's `grpc-timeout`: up to 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let value = value.trim();
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `timeout` as a `grpc-timeout` value: whole milliseconds (rounded down, at least 1) while
/// they fit in 8 digits, else seconds, else hours.
pub fn grpc_timeout_value(timeout: Duration) -> HeaderValue {
    let ms = timeout.as_millis().max(1);
    let text = if ms < 100_000_000 {
        format!("{ms}m")
    } else if timeout.as_secs() < 100_000_000 {
        format!("{}S", timeout.as_secs())
    } else {
        format!("{}H", (timeout.as_secs() / 3600).min(99_999_999))
    };
    HeaderValue::try_from(text).unwrap_or_else(|_| HeaderValue::from_static("99999999H"))
}

/// Inbound deadlines (see the [module docs](self)): reads a request's deadline from
/// `grpc-timeout` and, where given, a header of milliseconds; drops the request when its
/// deadline has passed, before it starts or while it waits or runs.
#[derive(Debug, Clone)]
pub struct DeadlineLayer {
    grpc: bool,
    header: Option<HeaderName>,
    status: StatusCode,
}

impl Default for DeadlineLayer {
    fn default() -> Self {
        DeadlineLayer::new()
    }
}

impl DeadlineLayer {
    /// Reads `grpc-timeout`; an HTTP request past its deadline is answered `504`.
    pub fn new() -> Self {
        DeadlineLayer {
            grpc: true,
            header: None,
            status: StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// Also reads the time left, in milliseconds, from this header (e.g.
    /// `x-request-timeout-ms`, or Envoy's `x-envoy-expected-rq-timeout-ms`); with
    /// `grpc-timeout` too, the earlier deadline holds.
    pub fn header(mut self, name: HeaderName) -> Self {
        self.header = Some(name);
        self
    }

    /// Whether `grpc-timeout` is read (default yes).
    pub fn grpc_timeout(mut self, on: bool) -> Self {
        self.grpc = on;
        self
    }

    /// The status an HTTP request past its deadline gets (default `504`; `503` where clients
    /// should read it as "try elsewhere"). gRPC requests get `DEADLINE_EXCEEDED`.
    pub fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }
}

impl<S> tower_layer::Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;

    fn layer(&self, inner: S) -> DeadlineService<S> {
        DeadlineService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`DeadlineLayer`] makes.
#[derive(Debug, Clone)]
pub struct DeadlineService<S> {
    inner: S,
    layer: DeadlineLayer,
}

impl<S, ReqB, ResB> tower_service::Service<Request<ReqB>> for DeadlineService<S>
where
    S: tower_service::Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: RateLimitBody,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = DeadlineFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        let deadline =
            Deadline::from_headers(req.headers(), self.layer.grpc, self.layer.header.as_ref());
        let Some(deadline) = deadline else {
            return DeadlineFuture {
                state: State::Unbounded {
                    future: self.inner.call(req),
                },
            };
        };
        let grpc = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .filter(|v| v.as_bytes().starts_with(b"application/grpc"))
            .cloned();
        if deadline.has_passed() {
            dropped(Stage::BeforeStart);
            return DeadlineFuture {
                state: State::Passed {
                    grpc: Some(grpc),
                    status: self.layer.status,
                },
            };
        }
        // The earlier of this and an enclosing deadline (a layer of the same kind outside).
        let deadline = Deadline::current().map_or(deadline, |outer| outer.min(deadline));
        req.extensions_mut().insert(deadline);
        DeadlineFuture {
            state: State::Running {
                future: CURRENT.scope(deadline, self.inner.call(req)),
                sleep: tokio::time::sleep_until(deadline.instant()),
                grpc: Some(grpc),
                status: self.layer.status,
            },
        }
    }
}

pin_project! {
    /// The future of [`DeadlineService`].
    pub struct DeadlineFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Unbounded { #[pin] future: F },
        Running {
            #[pin]
            future: tokio::task::futures::TaskLocalFuture<Deadline, F>,
            #[pin]
            sleep: tokio::time::Sleep,
            grpc: Option<Option<HeaderValue>>,
            status: StatusCode,
        },
        Passed { grpc: Option<Option<HeaderValue>>, status: StatusCode },
    }
}

impl<F, ResB, E> Future for DeadlineFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    ResB: RateLimitBody,
{
    type Output = Result<Response<ResB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Unbounded { future } => future.poll(cx),
            StateProj::Running {
                future,
                sleep,
                grpc,
                status,
            } => {
                if let Poll::Ready(out) = future.poll(cx) {
                    return Poll::Ready(out);
                }
                std::task::ready!(sleep.poll(cx));
                // The caller has given up: the work is dropped with this future.
                dropped(Stage::InFlight);
                Poll::Ready(Ok(exceeded(grpc.take().flatten(), *status)))
            }
            StateProj::Passed { grpc, status } => {
                Poll::Ready(Ok(exceeded(grpc.take().flatten(), *status)))
            }
        }
    }
}

/// Where a request was dropped at its deadline.
#[derive(Debug, Clone, Copy)]
enum Stage {
    BeforeStart,
    InFlight,
}

fn dropped(stage: Stage) {
    crate::metrics::deadline_dropped(match stage {
        Stage::BeforeStart => "before_start",
        Stage::InFlight => "in_flight",
    });
}

/// The answer to a request past its deadline.
fn exceeded<B: RateLimitBody>(grpc: Option<HeaderValue>, status: StatusCode) -> Response<B> {
    crate::response::local_answer(
        grpc,
        "4",
        "the caller's deadline passed",
        status,
        "the caller's deadline passed before the request was served\n",
    )
}

/// Outbound deadlines (see the [module docs](self)): passes on the time a call has left.
#[derive(Debug, Clone)]
pub struct PropagateDeadlineLayer {
    header: Option<HeaderName>,
    margin: Duration,
}

impl Default for PropagateDeadlineLayer {
    fn default() -> Self {
        PropagateDeadlineLayer::new()
    }
}

impl PropagateDeadlineLayer {
    /// Sends `grpc-timeout` on gRPC calls, with a margin of 5 ms.
    pub fn new() -> Self {
        PropagateDeadlineLayer {
            header: None,
            margin: Duration::from_millis(5),
        }
    }

    /// Also sends the time left, in milliseconds, in this header (on every call).
    pub fn header(mut self, name: HeaderName) -> Self {
        self.header = Some(name);
        self
    }

    /// What is kept back from the time left (default 5 ms): the callee's answer must travel
    /// back before the caller's deadline.
    pub fn margin(mut self, margin: Duration) -> Self {
        self.margin = margin;
        self
    }
}

impl<S> tower_layer::Layer<S> for PropagateDeadlineLayer {
    type Service = PropagateDeadline<S>;

    fn layer(&self, inner: S) -> PropagateDeadline<S> {
        PropagateDeadline {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`PropagateDeadlineLayer`] makes.
#[derive(Debug, Clone)]
pub struct PropagateDeadline<S> {
    inner: S,
    layer: PropagateDeadlineLayer,
}

/// A call with no time left, not sent; or one whose deadline passed before its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadlineExceeded;

impl std::fmt::Display for DeadlineExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the call's deadline passed")
    }
}

impl std::error::Error for DeadlineExceeded {}

impl<S, B, R> tower_service::Service<Request<B>> for PropagateDeadline<S>
where
    S: tower_service::Service<Request<B>, Response = Response<R>>,
    S::Error: Into<crate::error::BoxError>,
    S::Future: Send + 'static,
    R: Send + 'static,
{
    type Response = Response<R>;
    type Error = crate::error::BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<R>, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let deadline = req
            .extensions()
            .get::<Deadline>()
            .copied()
            .or_else(Deadline::current);
        let Some(deadline) = deadline else {
            let future = self.inner.call(req);
            return Box::pin(async move { future.await.map_err(Into::into) });
        };
        let left = deadline.remaining().saturating_sub(self.layer.margin);
        if left.is_zero() {
            return Box::pin(std::future::ready(Err(DeadlineExceeded.into())));
        }
        let grpc = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let h = req.headers_mut();
        if grpc {
            h.insert("grpc-timeout", grpc_timeout_value(left));
        }
        if let Some(name) = &self.layer.header {
            let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
            h.insert(name.clone(), HeaderValue::from(ms));
        }
        let future = self.inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout_at(deadline.instant(), future).await {
                Ok(out) => out.map_err(Into::into),
                Err(_) => Err(DeadlineExceeded.into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_and_written() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5u"), Some(Duration::from_micros(5)));
        for bad in [
            "",
            "m",
            "100",
            "123456789m",
            "-1m",
            "1x",
            "1.5S",
            "99999999999H",
        ] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
        assert_eq!(grpc_timeout_value(Duration::from_millis(250)), "250m");
        assert_eq!(grpc_timeout_value(Duration::from_micros(10)), "1m");
        assert_eq!(grpc_timeout_value(Duration::from_secs(200_000)), "200000S");
        let back = parse_grpc_timeout(
            grpc_timeout_value(Duration::from_secs(1 << 40))
                .to_str()
                .unwrap(),
        );
        assert!(back.is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn the_earlier_deadline_holds() {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-timeout", "2S".parse().unwrap());
        let name = HeaderName::from_static("x-request-timeout-ms");
        h.insert(name.clone(), "500".parse().unwrap());
        let d = Deadline::from_headers(&h, true, Some(&name)).unwrap();
        assert_eq!(d.remaining(), Duration::from_millis(500));
        let d = Deadline::from_headers(&h, true, None).unwrap();
        assert_eq!(d.remaining(), Duration::from_secs(2));
        assert!(Deadline::from_headers(&h, false, None).is_none());
        // A scope inside a scope never gets more time.
        Deadline::after(Duration::from_millis(100))
            .scope(async {
                Deadline::after(Duration::from_secs(10))
                    .scope(async {
                        let left = Deadline::current().unwrap().remaining();
                        assert_eq!(left, Duration::from_millis(100));
                    })
                    .await;
            })
            .await;
        assert!(Deadline::current().is_none());
    }
}

/// Deadlines' settings in a configuration file (feature `serde`), for both directions;
/// checked when read (an unknown field is an error naming it) and when built (a wrong value is
/// an error naming the field).
///
/// ```toml
/// header = "x-request-timeout-ms"   # milliseconds left, read inbound and sent outbound
/// grpc_timeout = true               # read grpc-timeout inbound
/// status = 504                      # an HTTP request past its deadline (503 or 504)
/// margin = "5ms"                    # kept back from the time passed on
/// ```
///
/// ```
/// use tollgate::deadline::DeadlineConfig;
///
/// let config: DeadlineConfig = toml::from_str("header = \"x-request-timeout-ms\"\nstatus = 503").unwrap();
/// let inbound = config.layer().unwrap();
/// let outbound = config.propagate().unwrap();
/// let bad: DeadlineConfig = toml::from_str("status = 200").unwrap();
/// assert!(bad.layer().unwrap_err().to_string().contains("status"));
/// let bad: DeadlineConfig = toml::from_str("header = \"no spaces\"").unwrap();
/// assert!(bad.propagate().unwrap_err().to_string().contains("header"));
/// ```
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeadlineConfig {
    /// The header of milliseconds left (none by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Whether `grpc-timeout` is read inbound (yes by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_timeout: Option<bool>,
    /// The status of an HTTP request past its deadline: 503 or 504 (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// What is kept back from the time passed on (`"5ms"` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<String>,
}

#[cfg(feature = "serde")]
impl DeadlineConfig {
    fn header_name(&self) -> Result<Option<HeaderName>, crate::ConfigError> {
        (self.header.as_deref())
            .map(|h| {
                HeaderName::try_from(h).map_err(|e| crate::ConfigError::Invalid {
                    option: "header",
                    reason: format!("{h:?} is not a header name: {e}"),
                })
            })
            .transpose()
    }

    /// The inbound layer these settings describe, or the first setting that is wrong, named.
    pub fn layer(&self) -> Result<DeadlineLayer, crate::ConfigError> {
        let mut layer = DeadlineLayer::new();
        if let Some(h) = self.header_name()? {
            layer = layer.header(h);
        }
        if let Some(on) = self.grpc_timeout {
            layer = layer.grpc_timeout(on);
        }
        if let Some(code) = self.status {
            let status = match code {
                503 => StatusCode::SERVICE_UNAVAILABLE,
                504 => StatusCode::GATEWAY_TIMEOUT,
                other => {
                    return Err(crate::ConfigError::Invalid {
                        option: "status",
                        reason: format!("{other} is neither 503 nor 504"),
                    });
                }
            };
            layer = layer.status(status);
        }
        Ok(layer)
    }

    /// The outbound layer these settings describe, or the first setting that is wrong, named.
    pub fn propagate(&self) -> Result<PropagateDeadlineLayer, crate::ConfigError> {
        let mut layer = PropagateDeadlineLayer::new();
        if let Some(h) = self.header_name()? {
            layer = layer.header(h);
        }
        if let Some(m) = &self.margin {
            let margin = crate::quota::config_duration("margin", m)?;
            layer = layer.margin(margin);
        }
        Ok(layer)
    }
}
