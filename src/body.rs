//! The response body type of the rate-limit service.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a response from [`RateLimit`](crate::RateLimit): the inner service's body,
    /// or the short body of a rejection.
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
        },
        Full {
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
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
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
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
/// text. Use it where the layer wraps a whole axum [`Router`](axum::Router) (the cheapest place
/// for it), since `axum::serve` takes services answering `Response<axum::body::Body>`:
///
/// ```
/// use std::net::SocketAddr;
///
/// use axum::{Router, body::Body, extract::Request, routing::get};
/// use tollgate::{Policy, Quota, RateLimitLayer};
/// use tower::{Layer, ServiceExt};
///
/// // `with_state` turns the handlers into services once, instead of on every request.
/// let router = Router::new().route("/", get(|| async { "ok" })).with_state::<()>(());
/// let layer = RateLimitLayer::builder()
///     .policy(Policy::new("api", Quota::per_second(10)))
///     .build()
///     .unwrap();
/// let app = ServiceExt::<Request>::map_response(layer.layer(router), |res| res.map(Body::from));
/// let make = axum::ServiceExt::<Request>::into_make_service_with_connect_info::<SocketAddr>(app);
/// // axum::serve(listener, make).await?;
/// ```
#[cfg(feature = "axum")]
impl From<ResponseBody<axum::body::Body>> for axum::body::Body {
    fn from(body: ResponseBody<axum::body::Body>) -> Self {
        match body.kind {
            Kind::Inner { body } => body,
            Kind::Full { data: Some(data) } => axum::body::Body::from(data),
            Kind::Full { data: None } => axum::body::Body::empty(),
        }
    }
}
