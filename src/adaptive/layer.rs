//! The inbound layer: [`AdaptiveLayer`] caps the requests in flight in the service it wraps at
//! an [`AdaptiveLimit`], and answers the rest at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response, StatusCode};
use pin_project_lite::pin_project;

use super::{AdaptiveLimit, Ask, Permit};
use crate::RequestInfo;
use crate::body::{BodyGuard, RateLimitBody};
use crate::criticality::Criticality;

/// What of a response counts as a sign of overload (a drop): by default a 503 or a 429 from the
/// service, or a gRPC `UNAVAILABLE` or `RESOURCE_EXHAUSTED` in the response's head. With
/// [`sample_at_body_end`](AdaptiveLayer::sample_at_body_end) it is asked again of the
/// trailers, with the response's status (a gRPC stream ends with its status there).
pub type Overload = Arc<dyn Fn(StatusCode, &http::HeaderMap) -> bool + Send + Sync>;

/// Caps the wrapped service's requests in flight at an [`AdaptiveLimit`], a sibling of
/// [`RateLimitLayer`](crate::RateLimitLayer): a rate limit shares the service between clients,
/// this protects the service itself. Put it inside the rate limit
/// (`.layer(adaptive).layer(rate_limit)` in axum, outermost last), so that a request a quota
/// refuses never takes a slot.
///
/// Over the limit a request is answered at once: `503 Service Unavailable` with `Retry-After`
/// (1 s by default), or for gRPC a trailers-only `UNAVAILABLE` with `grpc-retry-pushback-ms`:
/// the status the service itself gives when it cannot serve, which clients retry, and which a
/// load balancer may send to another replica (a 429 would tell the client it exceeded a quota,
/// which it did not). A sample is the service's time from the call to the response's head
/// ([`sample_at_body_end`](Self::sample_at_body_end) waits for the body's end); a response
/// that shows overload (see [`Overload`]) or an error of the service is a drop; a request
/// cancelled before its answer (its future dropped, its body dropped unfinished) gives its
/// slot back and is no sample.
///
/// ```
/// use axum::{Router, routing::get};
/// use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let limit = AdaptiveLimit::builder().initial(20).range(4, 500).build()?;
/// let app: Router = Router::new()
///     .route("/", get(|| async { "ok" }))
///     .layer(AdaptiveLayer::new(limit));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct AdaptiveLayer {
    limit: AdaptiveLimit,
    /// How long a request over the limit waits for a slot, when the limit queues.
    queue_deadline: Duration,
    retry_after: Duration,
    body_end: bool,
    dry_run: bool,
    overload: Overload,
    partition: Option<PartitionBy>,
    flow: Option<FlowBy>,
    criticality: Option<CriticalityBy>,
}

/// Which partition of the limit a request is in (see
/// [`AdaptiveLimitBuilder::partition`](super::AdaptiveLimitBuilder::partition)): its name, which
/// may be borrowed from the request (a header's value, an extension's field).
pub type PartitionBy =
    Arc<dyn for<'r, 'a> Fn(&'r RequestInfo<'a>) -> Option<&'r str> + Send + Sync>;

/// Which flow a request is of ([`AdaptiveLayer::flow_by`]): its key, which may be borrowed from
/// the request (a tenant header's value, an extension's field).
pub type FlowBy = Arc<dyn for<'r, 'a> Fn(&'r RequestInfo<'a>) -> Option<&'r str> + Send + Sync>;

/// A request's criticality, from a source you trust ([`AdaptiveLayer::criticality_by`]).
pub type CriticalityBy = Arc<dyn Fn(&RequestInfo<'_>) -> Option<Criticality> + Send + Sync>;

impl std::fmt::Debug for AdaptiveLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveLayer")
            .field("limit", &self.limit)
            .field("retry_after", &self.retry_after)
            .field("queue_deadline", &self.queue_deadline)
            .field("body_end", &self.body_end)
            .field("dry_run", &self.dry_run)
            .finish_non_exhaustive()
    }
}

impl AdaptiveLayer {
    /// A layer admitting up to `limit`'s limit at once.
    pub fn new(limit: AdaptiveLimit) -> Self {
        AdaptiveLayer {
            limit,
            queue_deadline: Duration::from_millis(50),
            retry_after: Duration::from_secs(1),
            body_end: false,
            dry_run: false,
            overload: Arc::new(default_overload),
            partition: None,
            flow: None,
            criticality: None,
        }
    }

    /// The `Retry-After` of a refused request (rounded up to whole seconds, at least 1).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// How long a request over the limit waits for a slot when the limit queues
    /// ([`AdaptiveLimitBuilder::queue`](super::AdaptiveLimitBuilder::queue)); 50 ms by
    /// default. Past it, or with the queue full, it is refused as without a queue. The wait is
    /// not part of the request's sample.
    pub fn queue_deadline(mut self, deadline: Duration) -> Self {
        self.queue_deadline = deadline;
        self
    }

    /// A sample ends with the response body's end, not its head (for streamed responses whose
    /// cost is in the body). A body dropped unfinished is no sample. The trailers are read
    /// too: a gRPC stream that ends with `UNAVAILABLE` or `RESOURCE_EXHAUSTED` in them (or
    /// whatever the [`overload`](Self::overload) check finds there, given the response's
    /// status and the trailers) is a drop.
    pub fn sample_at_body_end(mut self, on: bool) -> Self {
        self.body_end = on;
        self
    }

    /// Computes and samples without refusing: a request over the limit goes through, untracked
    /// (no slot, no sample), and the limit moves as it would. To watch what the limit would do
    /// before turning it on.
    pub fn dry_run(mut self, on: bool) -> Self {
        self.dry_run = on;
        self
    }

    /// What of a response (its status and headers) is a sign of overload (a drop).
    pub fn overload(
        mut self,
        is_overload: impl Fn(StatusCode, &http::HeaderMap) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.overload = Arc::new(is_overload);
        self
    }

    /// Puts each request in a partition of the limit by its name (`None`, or a name the limit
    /// was not given: `other`, shed first): by route group, by a tenant's tier from a header,
    /// or anything else the request shows. The name may be borrowed from the request (a
    /// header's value, an extension's field): it is looked up among the limit's partitions (at
    /// most 16, given to its builder or its configuration) while the request is at hand, with
    /// no allocation; any other name is `other`, so a client sending new names each time
    /// adds no partition.
    ///
    /// ```
    /// use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit};
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// let limit = AdaptiveLimit::builder().partition("critical", 0.8).build()?;
    /// let layer = AdaptiveLayer::new(limit)
    ///     .partition_by(|req| req.uri().path().starts_with("/critical").then_some("critical"));
    ///
    /// // A tier from a header your gateway sets (never one a client may choose).
    /// let tiers = AdaptiveLimit::builder().partition("gold", 0.5).partition("silver", 0.3).build()?;
    /// let layer = AdaptiveLayer::new(tiers).partition_by(|req| {
    ///     req.headers().get("x-tier").and_then(|v| v.to_str().ok())
    /// });
    /// # Ok(()) }
    /// ```
    pub fn partition_by(
        mut self,
        by: impl for<'r, 'a> Fn(&'r RequestInfo<'a>) -> Option<&'r str> + Send + Sync + 'static,
    ) -> Self {
        self.partition = Some(Arc::new(by));
        self
    }

    /// Puts each request in the partition its header `name` names ([`partition_by`] reading
    /// the header's value; absent, not text, or not a partition of the limit: `other`). Only
    /// for a header set by a gateway you trust: a client that may set it picks its own
    /// guarantee.
    ///
    /// [`partition_by`]: Self::partition_by
    pub fn partition_by_header(self, name: http::HeaderName) -> Self {
        self.partition_by(header_text(name))
    }

    /// Keys each request's flow (a tenant, a client, an API key) for fairness inside the limit:
    /// while the limit has room nobody is refused; near it, requests of the flow holding the
    /// most slots are refused first, so that one flow sending ten times its usual load takes
    /// the slots it can get without taking the others' (see
    /// [`flow_headroom`](super::AdaptiveLimitBuilder::flow_headroom)). The key may be borrowed
    /// from the request; it is hashed into one of the limit's lanes, never stored and never a
    /// metric label. `None`: no fairness for that request.
    ///
    /// ```
    /// use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit};
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// let layer = AdaptiveLayer::new(AdaptiveLimit::builder().build()?)
    ///     .flow_by(|req| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
    /// # Ok(()) }
    /// ```
    pub fn flow_by(
        mut self,
        by: impl for<'r, 'a> Fn(&'r RequestInfo<'a>) -> Option<&'r str> + Send + Sync + 'static,
    ) -> Self {
        self.flow = Some(Arc::new(by));
        self
    }

    /// Keys each request's flow by header `name`'s value ([`flow_by`](Self::flow_by)): a
    /// tenant header, say. Absent or not text: no fairness for that request.
    pub fn flow_by_header(self, name: http::HeaderName) -> Self {
        self.flow_by(header_text(name))
    }

    /// Sets each request's [`Criticality`] by `by` (`None`: default): when the limit is full,
    /// sheddable requests are refused first, then default ones, critical ones last, each level
    /// keeping back the slots the levels above it used lately. The level is
    /// [`Criticality::current`] while the inner service handles the request (its call and its
    /// future, to the response's head), for the calls it makes
    /// ([`PropagateCriticalityLayer`](crate::criticality::PropagateCriticalityLayer),
    /// [`CriticalityMiddleware`](crate::middleware::CriticalityMiddleware), an
    /// [`Upstreams`](super::Upstreams) limit). Set it from what you trust: a client that may
    /// choose its level chooses critical.
    pub fn criticality_by(
        mut self,
        by: impl Fn(&RequestInfo<'_>) -> Option<Criticality> + Send + Sync + 'static,
    ) -> Self {
        self.criticality = Some(Arc::new(by));
        self
    }

    /// Reads each request's [`Criticality`] from header (or gRPC metadata) `name`: `critical`,
    /// `default` or `sheddable` (absent or anything else: default). **Only a header your gateway
    /// sets**, and strips from what clients send: a client that sets its own header raises its
    /// own level.
    ///
    /// ```
    /// use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit};
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// // Behind a gateway that sets x-criticality and x-tenant (and drops clients' own).
    /// let layer = AdaptiveLayer::new(AdaptiveLimit::builder().build()?)
    ///     .criticality_from_header(http::HeaderName::from_static("x-criticality"))
    ///     .flow_by_header(http::HeaderName::from_static("x-tenant"));
    /// # Ok(()) }
    /// ```
    pub fn criticality_from_header(self, name: http::HeaderName) -> Self {
        self.criticality_by(move |req| req.headers().get(&name).and_then(Criticality::from_header))
    }

    /// The limit this layer admits against.
    pub fn limit(&self) -> &AdaptiveLimit {
        &self.limit
    }
}

/// A request's header `name` as text (absent or not text: `None`), borrowed from the request.
fn header_text(
    name: http::HeaderName,
) -> impl for<'r, 'a> Fn(&'r RequestInfo<'a>) -> Option<&'r str> + Send + Sync + 'static {
    move |req| req.headers().get(&name).and_then(|v| v.to_str().ok())
}

pub(super) fn default_overload(status: StatusCode, headers: &http::HeaderMap) -> bool {
    if matches!(
        status,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
    ) {
        return true;
    }
    // gRPC: UNAVAILABLE (14) or RESOURCE_EXHAUSTED (8) in a trailers-only answer.
    matches!(
        headers.get("grpc-status").map(HeaderValue::as_bytes),
        Some(b"14" | b"8")
    )
}

impl<S> tower_layer::Layer<S> for AdaptiveLayer {
    type Service = Adaptive<S>;

    fn layer(&self, inner: S) -> Adaptive<S> {
        Adaptive {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`AdaptiveLayer`] makes.
#[derive(Clone, Debug)]
pub struct Adaptive<S> {
    inner: S,
    layer: AdaptiveLayer,
}

impl<S, ReqB, ResB> tower_service::Service<Request<ReqB>> for Adaptive<S>
where
    S: tower_service::Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    ReqB: Send + 'static,
    ResB: RateLimitBody + Send + 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = AdaptiveFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let layer = &self.layer;
        let limit = &layer.limit;
        // Who asks, found while the request (which its names may borrow) is at hand.
        let info = RequestInfo::new(&req);
        let level = (layer.criticality.as_ref()).map(|by| by(&info).unwrap_or_default());
        let mut ask = Ask::new();
        if let Some(name) = (layer.partition.as_ref()).and_then(|by| by(&info)) {
            ask = ask.partition(name);
        }
        if let Some(level) = level {
            ask = ask.criticality(level);
        }
        if let Some(key) = (layer.flow.as_ref()).and_then(|by| by(&info)) {
            ask = ask.flow(key);
        }
        let claim = limit.claim(ask);
        let permit = if limit.queues() && !layer.dry_run {
            // A free slot, or the line (a refusal is counted once, when it ends the wait).
            match limit.take(claim) {
                Ok(p) => Some(p),
                Err(_) => {
                    let (limit, deadline) = (limit.clone(), layer.queue_deadline);
                    let wait =
                        Box::pin(async move { limit.acquire_waiting(claim, deadline).await });
                    let grpc = grpc_of(&req);
                    let mut inner = crate::call::take_ready(&mut self.inner);
                    return AdaptiveFuture {
                        state: State::Waiting {
                            wait,
                            call: Some(Box::new(move || Scoped::call(level, || inner.call(req)))),
                            grpc,
                            retry_after: layer.retry_after,
                            body_end: layer.body_end,
                            overload: layer.overload.clone(),
                        },
                    };
                }
            }
        } else {
            limit.acquire_at(claim)
        };
        if permit.is_none() && !layer.dry_run {
            return AdaptiveFuture {
                state: State::Refused {
                    grpc: grpc_of(&req),
                    retry_after: layer.retry_after,
                },
            };
        }
        let (body_end, overload) = (layer.body_end, layer.overload.clone());
        let inner = &mut self.inner;
        AdaptiveFuture {
            state: State::Called {
                future: Scoped::call(level, || inner.call(req)),
                permit,
                body_end,
                overload,
            },
        }
    }
}

pin_project! {
    /// The inner service's future, with the request's criticality current while it runs when
    /// the layer sets one.
    #[project = ScopedProj]
    enum Scoped<F> {
        Plain { #[pin] future: F },
        Level { #[pin] future: tokio::task::futures::TaskLocalFuture<Criticality, F> },
    }
}

impl<F: Future> Scoped<F> {
    /// Calls the inner service with `level` current (the call and its future), if any.
    fn call(level: Option<Criticality>, call: impl FnOnce() -> F) -> Self {
        match level {
            None => Scoped::Plain { future: call() },
            Some(level) => Scoped::Level {
                future: Criticality::scoped(level, Criticality::sync_scoped(level, call)),
            },
        }
    }
}

impl<F: Future> Future for Scoped<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self.project() {
            ScopedProj::Plain { future } => future.poll(cx),
            ScopedProj::Level { future } => future.poll(cx),
        }
    }
}

/// The request's `content-type` when it is gRPC's (its refusal is then gRPC's).
fn grpc_of<B>(req: &Request<B>) -> Option<HeaderValue> {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .filter(|v| v.as_bytes().starts_with(b"application/grpc"))
        .cloned()
}

/// A request waiting in the limit's queue: the wait, then its call.
type Waiter = Pin<Box<dyn Future<Output = Option<Permit>> + Send>>;

pin_project! {
    /// The future of [`Adaptive`]: the inner service's, holding the request's slot; or a
    /// refusal.
    pub struct AdaptiveFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Refused {
            grpc: Option<HeaderValue>,
            retry_after: Duration,
        },
        Waiting {
            wait: Waiter,
            call: Option<Box<dyn FnOnce() -> Scoped<F> + Send>>,
            grpc: Option<HeaderValue>,
            retry_after: Duration,
            body_end: bool,
            overload: Overload,
        },
        Called {
            #[pin]
            future: Scoped<F>,
            permit: Option<Permit>,
            body_end: bool,
            overload: Overload,
        },
    }
}

impl<F, ResB, E> Future for AdaptiveFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    ResB: RateLimitBody + Send + 'static,
{
    type Output = Result<Response<ResB>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let StateProj::Waiting {
            wait,
            call,
            grpc,
            retry_after,
            body_end,
            overload,
        } = self.as_mut().project().state.project()
        {
            let permit = std::task::ready!(wait.as_mut().poll(cx));
            let next = match (permit, call.take()) {
                (Some(permit), Some(call)) => State::Called {
                    future: call(),
                    permit: Some(permit),
                    body_end: *body_end,
                    overload: overload.clone(),
                },
                _ => State::Refused {
                    grpc: grpc.take(),
                    retry_after: *retry_after,
                },
            };
            self.as_mut().project().state.set(next);
        }
        match self.project().state.project() {
            StateProj::Waiting { .. } => Poll::Pending,
            StateProj::Refused { grpc, retry_after } => {
                Poll::Ready(Ok(refusal(grpc.take(), *retry_after)))
            }
            StateProj::Called {
                future,
                permit,
                body_end,
                overload,
            } => {
                let result = std::task::ready!(future.poll(cx));
                let Some(permit) = permit.take() else {
                    // Dry run, over the limit: untracked.
                    return Poll::Ready(result);
                };
                Poll::Ready(match result {
                    // Classified in place: the response is not taken apart.
                    Ok(res) => {
                        if overload(res.status(), res.headers()) {
                            permit.dropped();
                            Ok(res)
                        } else if *body_end {
                            let guard = BodyGuard::new(AtBodyEnd {
                                permit: Some(permit),
                                status: res.status(),
                                overload: overload.clone(),
                                dropped: false,
                            });
                            Ok(res.map(|body| body.hold(guard)))
                        } else {
                            permit.success();
                            Ok(res)
                        }
                    }
                    Err(e) => {
                        permit.dropped();
                        Err(e)
                    }
                })
            }
        }
    }
}

/// A permit held until the response body's end: a sample then (a drop where the trailers
/// show overload); dropped unfinished, none.
struct AtBodyEnd {
    permit: Option<Permit>,
    status: StatusCode,
    overload: Overload,
    /// Whether the trailers showed overload.
    dropped: bool,
}

impl crate::body::Held for AtBodyEnd {
    fn data(&mut self, _n: u64) {}

    fn trailers(&mut self, trailers: &http::HeaderMap) {
        self.dropped |= (self.overload)(self.status, trailers);
    }

    fn ended(&mut self) {
        if let Some(permit) = self.permit.take() {
            if self.dropped {
                permit.dropped();
            } else {
                permit.success();
            }
        }
    }
}

/// The answer to a request over the limit.
fn refusal<B: RateLimitBody>(grpc: Option<HeaderValue>, retry_after: Duration) -> Response<B> {
    let is_grpc = grpc.is_some();
    let mut res = crate::response::local_answer(
        grpc,
        "14",
        "concurrency limit reached",
        StatusCode::SERVICE_UNAVAILABLE,
        "service busy: concurrency limit reached\n",
    );
    let h = res.headers_mut();
    if is_grpc {
        let ms = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
        h.insert("grpc-retry-pushback-ms", HeaderValue::from(ms));
    } else {
        let secs = crate::response::ceil_secs(retry_after).max(1);
        h.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}
