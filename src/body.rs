//! The response bodies of the rate-limit service.
//!
//! By default ([`KeepBody`]) the service answers with the inner service's own body type, and
//! writes rejections in it through [`RateLimitBody`]: an axum `Router` or a tonic server gets
//! back the body type it gave, which they then pass on without boxing it again. Bodies without
//! a [`RateLimitBody`] impl use [`WrapBody`] (see
//! [`RateLimitLayer::wrap_body`](crate::RateLimitLayer::wrap_body)): responses are then
//! [`ResponseBody<B>`], the inner body or the rejection's.
//!
//! So a layer can wrap a whole axum `Router`, the cheapest place for a limit every route
//! shares, and the result goes straight to `axum::serve`:
//!
//! ```
//! use std::net::SocketAddr;
//!
//! use std::convert::Infallible;
//!
//! use axum::{Router, extract::Request, response::Response, routing::get};
//! use tollgate::{Policy, Quota, RateLimitLayer};
//! use tower::{Layer, Service};
//!
//! fn answers_axum_responses<S: Service<Request, Response = Response, Error = Infallible>>(_: &S) {}
//!
//! // `with_state` turns the handlers into services once, instead of on every request.
//! let router = Router::new().route("/", get(|| async { "ok" })).with_state::<()>(());
//! let layer = RateLimitLayer::builder()
//!     .policy(Policy::new("api", Quota::per_second(10)))
//!     .build()
//!     .unwrap();
//! let app = layer.layer(router);
//! answers_axum_responses(&app); // `Response<axum::body::Body>`, as `axum::serve` wants
//! let make = axum::ServiceExt::<Request>::into_make_service_with_connect_info::<SocketAddr>(app);
//! // axum::serve(listener, make).await?;
//! ```

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a response from [`RateLimit`](crate::RateLimit) built with
    /// [`wrap_body`](crate::RateLimitLayer::wrap_body): the inner service's body, or the
    /// short body of a rejection.
    ///
    /// Its error type is the inner body's: a rejection body cannot fail.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            guard: Option<BodyGuard>,
        },
        Full {
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    /// The body of an answer that passed, as it is: for a service whose body type tollgate
    /// cannot answer a refusal in (a hyper client's `Incoming`, say), mapped into this type
    /// under a layer that may refuse, such as [`AdaptiveLayer`](crate::adaptive::AdaptiveLayer)
    /// on the client side (`ServiceBuilder::new().layer(adaptive).map_response(|r:
    /// Response<Incoming>| r.map(ResponseBody::new))`).
    pub fn new(body: B) -> Self {
        Self::inner(body)
    }

    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { body, guard: None },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { mut body, guard } => {
                let frame = body.as_mut().poll_frame(cx);
                BodyGuard::observe(guard, &frame, body.is_end_stream());
                frame
            }
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { .. } => f.write_str("ResponseBody::Inner"),
            Kind::Full { data } => write!(
                f,
                "ResponseBody::Full({} bytes)",
                data.as_ref().map_or(0, Bytes::len)
            ),
        }
    }
}

/// Unwraps to axum's body without boxing: the inner service's body as it was, or the rejection
/// text. For layers built with [`wrap_body`](crate::RateLimitLayer::wrap_body); by default the
/// layer already answers with axum's body.
#[cfg(feature = "axum")]
impl From<ResponseBody<axum::body::Body>> for axum::body::Body {
    fn from(body: ResponseBody<axum::body::Body>) -> Self {
        match body.kind {
            Kind::Inner { body, guard: None } => body,
            Kind::Inner {
                body,
                guard: Some(guard),
            } => axum::body::Body::new(Guarded::new(body, guard)),
            Kind::Full { data: Some(data) } => axum::body::Body::from(data),
            Kind::Full { data: None } => axum::body::Body::empty(),
        }
    }
}

/// Something a response body holds until it ends: a request's slot in a concurrent quota
/// ([`Quota::concurrent`](crate::Quota::concurrent)), given back when the guard is dropped,
/// and a settlement made when the body ends (a cost reported in a trailer, the bytes sent, a
/// gRPC status).
///
/// [`Guarded`] shows it the body's frames, tells it when the last has been read, and drops it
/// then, or when the body is dropped unfinished (the client went away: the policy's
/// cancellation rule applies).
pub struct BodyGuard(Box<dyn Held>);

/// What a [`BodyGuard`] holds: told of the body's data and trailers as they are read, and of
/// its end; dropped afterwards (or unfinished).
pub(crate) trait Held: Send + Sync {
    /// `n` more bytes of data were read.
    fn data(&mut self, n: u64);
    /// The body's trailers were read.
    fn trailers(&mut self, trailers: &http::HeaderMap);
    /// The body has ended: everything was read.
    fn ended(&mut self);
}

impl BodyGuard {
    pub(crate) fn new(held: impl Held + 'static) -> Self {
        BodyGuard(Box::new(held))
    }

    /// The body is complete as it is (one that cannot hold the guard): whatever waited for its
    /// end is done now, and the guard is dropped. Counted as a body of no bytes: for a body
    /// that holds data, use [`finish_sent`](Self::finish_sent).
    pub fn finish(mut self) {
        self.0.ended();
    }

    /// The body is complete as it is and sends `bytes` bytes of data (its exact size, e.g.
    /// from [`Body::size_hint`]): what waits for its end is done now, with those bytes counted
    /// ([`CostFrom::response_bytes`](crate::settle::CostFrom::response_bytes)), and the guard
    /// is dropped.
    pub fn finish_sent(mut self, bytes: u64) {
        self.0.data(bytes);
        self.0.ended();
    }

    /// Shows the guard a frame the body produced (`end`: whether the body has ended with it),
    /// and drops it at the end, or on an error (after which nothing more is read, as for a
    /// body dropped unfinished).
    fn observe<D: bytes::Buf, E>(
        guard: &mut Option<BodyGuard>,
        frame: &Poll<Option<Result<Frame<D>, E>>>,
        end: bool,
    ) {
        let Some(held) = guard.as_mut() else {
            return;
        };
        match frame {
            Poll::Ready(Some(Ok(frame))) => {
                // Trailers are a body's last frame: a server sends them and stops polling.
                let mut end = end;
                if let Some(data) = frame.data_ref() {
                    held.0.data(data.remaining() as u64);
                } else if let Some(trailers) = frame.trailers_ref() {
                    held.0.trailers(trailers);
                    end = true;
                }
                if end {
                    held.0.ended();
                    guard.take();
                }
            }
            Poll::Ready(None) => {
                held.0.ended();
                guard.take();
            }
            Poll::Ready(Some(Err(_))) => {
                guard.take();
            }
            Poll::Pending => {}
        }
    }
}

impl std::fmt::Debug for BodyGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BodyGuard")
    }
}

pin_project! {
    /// A body that holds a [`BodyGuard`] until it ends: its frames are the inner body's, and
    /// the guard is dropped once the inner body has no more (or when this body is dropped).
    /// For [`RateLimitBody::hold`] on a body type of your own.
    pub struct Guarded<B> {
        #[pin]
        body: B,
        guard: Option<BodyGuard>,
    }
}

impl<B: Body> Guarded<B> {
    /// `body`, holding `guard` until it ends. A body that has already ended finishes the
    /// guard at once.
    pub fn new(body: B, guard: BodyGuard) -> Self {
        if body.is_end_stream() {
            guard.finish();
            return Guarded { body, guard: None };
        }
        Guarded {
            body,
            guard: Some(guard),
        }
    }
}

impl<B: Body> Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let mut this = self.project();
        let frame = this.body.as_mut().poll_frame(cx);
        BodyGuard::observe(this.guard, &frame, this.body.is_end_stream());
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> std::fmt::Debug for Guarded<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guarded")
            .field("held", &self.guard.is_some())
            .finish_non_exhaustive()
    }
}

/// A response body type that tollgate can write its rejections in (a short text, or nothing
/// for gRPC), so that the rate-limit service can answer with the inner service's own body type
/// ([`KeepBody`], the default).
///
/// Implemented for axum's body (feature `axum`, on by default), tonic's body (feature
/// `tonic`), http-body-util's `Full<Bytes>`, `BoxBody` and `UnsyncBoxBody`, and
/// [`ResponseBody`]. For any other body (`String`, `Empty`, your own), build the layer with
/// [`wrap_body`](crate::RateLimitLayer::wrap_body), or implement this trait. Without either,
/// the layered service is not a `Service` (and the compiler says which of the two to do):
///
/// ```compile_fail,E0277
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Empty;
/// use tollgate::{Policy, Quota, RateLimitLayer, key::Global};
/// use tower::{Layer, Service};
///
/// fn is_service<S: Service<Request<()>>>(_: &S) {}
///
/// let inner = tower::service_fn(|_req: Request<()>| async {
///     Ok::<_, std::convert::Infallible>(Response::new(Empty::<Bytes>::new()))
/// });
/// let layer = RateLimitLayer::builder()
///     .key(Global)
///     .policy(Policy::new("api", Quota::per_second(1)))
///     .build()
///     .unwrap();
/// is_service(&layer.layer(inner)); // `Empty` cannot hold a rejection
/// ```
#[diagnostic::on_unimplemented(
    message = "tollgate cannot write a rejection in a `{Self}` response body",
    note = "for axum's or tonic's body, enable tollgate's `axum` or `tonic` feature; for any other body, call `.wrap_body()` on the `RateLimitLayer` to answer with `tollgate::ResponseBody<{Self}>`"
)]
pub trait RateLimitBody: Sized {
    /// A body holding `data` (empty for gRPC rejections).
    fn rejection(data: Bytes) -> Self;

    /// This body, holding `guard` until it ends (see [`Guarded`]): how a request's slot in a
    /// concurrent quota is held while its response streams, and a settlement waits for the
    /// body's end. The default [finishes](BodyGuard::finish) the guard at once, as if the
    /// body had ended with its head (no bytes or trailers seen); axum's, tonic's and the
    /// boxed bodies hold it to the end (boxing the body once more).
    fn hold(self, guard: BodyGuard) -> Self {
        guard.finish();
        self
    }
}

#[cfg(feature = "axum")]
impl RateLimitBody for axum::body::Body {
    fn rejection(data: Bytes) -> Self {
        axum::body::Body::from(data)
    }

    fn hold(self, guard: BodyGuard) -> Self {
        axum::body::Body::new(Guarded::new(self, guard))
    }
}

#[cfg(feature = "tonic")]
impl RateLimitBody for tonic::body::Body {
    fn rejection(data: Bytes) -> Self {
        tonic::body::Body::new(http_body_util::Full::new(data))
    }

    fn hold(self, guard: BodyGuard) -> Self {
        tonic::body::Body::new(Guarded::new(self, guard))
    }
}

impl RateLimitBody for http_body_util::Full<Bytes> {
    fn rejection(data: Bytes) -> Self {
        http_body_util::Full::new(data)
    }

    /// A full body cannot hold the guard: it is finished at once, with the body's bytes
    /// counted (a full body's size is exact).
    fn hold(self, guard: BodyGuard) -> Self {
        guard.finish_sent(Body::size_hint(&self).exact().unwrap_or(0));
        self
    }
}

impl<E: 'static> RateLimitBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn rejection(data: Bytes) -> Self {
        use http_body_util::BodyExt;
        http_body_util::Full::new(data)
            .map_err(|never| match never {})
            .boxed()
    }

    fn hold(self, guard: BodyGuard) -> Self {
        use http_body_util::BodyExt;
        Guarded::new(self, guard).boxed()
    }
}

impl<E: 'static> RateLimitBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn rejection(data: Bytes) -> Self {
        use http_body_util::BodyExt;
        http_body_util::Full::new(data)
            .map_err(|never| match never {})
            .boxed_unsync()
    }

    fn hold(self, guard: BodyGuard) -> Self {
        use http_body_util::BodyExt;
        Guarded::new(self, guard).boxed_unsync()
    }
}

impl<B: Body> RateLimitBody for ResponseBody<B> {
    fn rejection(data: Bytes) -> Self {
        ResponseBody::full(data)
    }

    fn hold(self, guard: BodyGuard) -> Self {
        match self.kind {
            Kind::Inner { body, guard: None } => {
                let guard = if body.is_end_stream() {
                    guard.finish();
                    None
                } else {
                    Some(guard)
                };
                ResponseBody {
                    kind: Kind::Inner { body, guard },
                }
            }
            // A rejection, or a body already holding a guard: nothing to hold it for.
            kind => ResponseBody { kind },
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::KeepBody {}
    impl Sealed for super::WrapBody {}
}

/// How the rate-limit service answers with bodies: [`KeepBody`] or [`WrapBody`]. Sealed.
pub trait BodyMode<B>: sealed::Sealed {
    /// The body type of the service's responses when the inner service answers with `B`.
    type Body;
    /// The body of a response of the inner service.
    #[doc(hidden)]
    fn pass(body: B) -> Self::Body;
    /// The body of a rejection.
    #[doc(hidden)]
    fn reject(data: Bytes) -> Self::Body;
    /// A response of the inner service, with its body as [`pass`](Self::pass) makes it.
    #[doc(hidden)]
    #[inline]
    fn pass_response(res: http::Response<B>) -> http::Response<Self::Body>
    where
        Self: Sized,
    {
        res.map(Self::pass)
    }
    /// A response of the inner service whose body holds `guard` until it ends.
    #[doc(hidden)]
    fn hold(res: http::Response<B>, guard: BodyGuard) -> http::Response<Self::Body>;
}

/// Responses keep the inner service's body type, which must implement [`RateLimitBody`]. The
/// default.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeepBody;

/// Responses have a [`ResponseBody<B>`] around the inner service's body type `B`, which can be
/// any body. See [`RateLimitLayer::wrap_body`](crate::RateLimitLayer::wrap_body).
#[derive(Debug, Clone, Copy, Default)]
pub struct WrapBody;

impl<B: RateLimitBody> BodyMode<B> for KeepBody {
    type Body = B;

    fn pass(body: B) -> B {
        body
    }

    fn reject(data: Bytes) -> B {
        B::rejection(data)
    }

    /// The response as it is: not taken apart and put together again.
    #[inline]
    fn pass_response(res: http::Response<B>) -> http::Response<B> {
        res
    }

    fn hold(res: http::Response<B>, guard: BodyGuard) -> http::Response<B> {
        res.map(|body| body.hold(guard))
    }
}

impl<B: Body> BodyMode<B> for WrapBody {
    type Body = ResponseBody<B>;

    fn pass(body: B) -> ResponseBody<B> {
        ResponseBody::inner(body)
    }

    fn reject(data: Bytes) -> ResponseBody<B> {
        ResponseBody::full(data)
    }

    /// A body already at its end (an empty one, which a server may drop unpolled) finishes the
    /// guard at once: it has ended, not been cancelled.
    fn hold(res: http::Response<B>, guard: BodyGuard) -> http::Response<ResponseBody<B>> {
        res.map(|body| ResponseBody::inner(body).hold(guard))
    }
}
