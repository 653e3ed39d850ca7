//! [`BufferLayer`]: a request's body read whole before the call, so that the retry layer can
//! send it again (tonic's bodies, streams: any body that cannot be cloned).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full, Limited};
use tower_service::Service;

use crate::error::BoxError;

/// Reads a request's body whole (at most [`max`](Self::new) bytes) and passes the request on
/// with a body that can be cloned (`Full<Bytes>`), for a [`RetryLayer`](super::RetryLayer)
/// above a client whose bodies cannot be: a tonic `Channel`, whose request body is
/// `tonic::body::Body`. Map the body back below the retry layer:
///
/// ```
/// use tollgate::client::{BufferLayer, RetryBudget, RetryLayer};
/// use tower::ServiceBuilder;
///
/// # fn channel() -> tower::util::BoxService<http::Request<tonic::body::Body>, http::Response<tonic::body::Body>, tollgate::client::BoxError> { unimplemented!() }
/// # fn make() {
/// let client = ServiceBuilder::new()
///     .layer(BufferLayer::new(64 * 1024))
///     // gRPC calls are POSTs: say which are safe to retry (here: all of them).
///     .layer(RetryLayer::new(RetryBudget::new()).safe(|_| true))
///     .map_request(|r: http::Request<http_body_util::Full<bytes::Bytes>>| {
///         r.map(tonic::body::Body::new)
///     })
///     .service(channel());
/// # let _ = client; }
/// ```
///
/// A body longer than the maximum fails the call with the limit's error before anything is
/// sent: buffer unary calls, not streams. The body's trailers are not kept.
#[derive(Debug, Clone, Copy)]
pub struct BufferLayer {
    max: usize,
}

impl BufferLayer {
    /// Bodies of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        BufferLayer { max }
    }
}

impl<S> tower_layer::Layer<S> for BufferLayer {
    type Service = Buffered<S>;

    fn layer(&self, inner: S) -> Buffered<S> {
        Buffered {
            inner,
            max: self.max,
        }
    }
}

/// The service [`BufferLayer`] makes.
#[derive(Debug, Clone)]
pub struct Buffered<S> {
    inner: S,
    max: usize,
}

impl<S, B, R> Service<Request<B>> for Buffered<S>
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<R>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<R>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let max = self.max;
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = Limited::new(body, max).collect().await?.to_bytes();
            inner
                .call(Request::from_parts(parts, Full::new(bytes)))
                .await
                .map_err(Into::into)
        })
    }
}
