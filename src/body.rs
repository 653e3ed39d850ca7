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
    #[project = BodyProj]
    pub enum ResponseBody<B> {
        /// The inner service's body, untouched.
        Inner {
            /// The inner body.
            #[pin]
            body: B,
        },
        /// A rejection's body.
        Full {
            /// The bytes not yet sent.
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody::Inner { body }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody::Full {
            data: (!data.is_empty()).then_some(data),
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
        match self.project() {
            BodyProj::Inner { body } => body.poll_frame(cx),
            BodyProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Inner { body } => body.is_end_stream(),
            ResponseBody::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Inner { body } => body.size_hint(),
            ResponseBody::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
