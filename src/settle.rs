//! Settling, the last stage of a request: what the wrapped service's answer says, once it comes,
//! and the fields admission decided, added to it.
//!
//! Today a request settles one thing: with
//! [`obey_retry_after`](crate::RateLimitLayerBuilder::obey_retry_after), an answer asking to
//! slow down pauses the request's key. A layer that settles nothing carries no [`Settle`] at
//! all (a `None`, checked once per response).

use std::sync::Arc;

use http::Response;

use crate::Key;
use crate::admit::Shared;
use crate::backend::Backend;
use crate::body::BodyMode;
use crate::response::{HeaderAdds, add_headers};
use crate::wait::Pauses;

/// What a request settles once the wrapped service has answered.
pub(crate) struct Settle {
    key: Key,
    /// Keys the wrapped service asked to slow down.
    pauses: Arc<Pauses>,
}

impl Settle {
    /// What a request on `key` settles under `shared`'s configuration: nothing (`None`) unless
    /// the layer obeys the wrapped service's requests to slow down and the request has a key.
    #[inline]
    pub(crate) fn new<K, Bk: Backend>(
        shared: &Shared<K, Bk>,
        key: Option<Key>,
    ) -> Option<Box<Self>> {
        let pauses = shared.pauses.as_ref()?;
        Some(Box::new(Settle {
            key: key?,
            pauses: pauses.clone(),
        }))
    }
}

/// The wrapped service's response, settled, in the layer's body type, with the fields admission
/// decided.
#[inline]
pub(crate) fn settle<B, M: BodyMode<B>>(
    res: Response<B>,
    adds: Option<HeaderAdds>,
    settle: Option<Box<Settle>>,
) -> Response<M::Body> {
    if let Some(settle) = settle {
        settle.pauses.note(&settle.key, &res);
    }
    let mut res = res.map(M::pass);
    if let Some(adds) = adds {
        add_headers(res.headers_mut(), adds);
    }
    res
}
