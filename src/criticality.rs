//! How much a request matters when the service is full, and passing that on to the calls it
//! makes (Google's criticality, propagated from the first request through every call).
//!
//! Three levels: [`Critical`](Criticality::Critical) (a user waits on it),
//! [`Default`](Criticality::Default) and [`Sheddable`](Criticality::Sheddable) (prefetch,
//! batch, retries of background work). An [`AdaptiveLimit`](crate::adaptive::AdaptiveLimit)
//! that is full refuses sheddable requests first, then default ones, and critical ones last:
//! it keeps back for each level the slots the levels above it used lately
//! ([`AdaptiveLayer::criticality_from_header`](crate::adaptive::AdaptiveLayer::criticality_from_header)).
//!
//! - **Inbound**, the adaptive layer reads a request's level from a header (or gRPC metadata,
//!   which is a header) or a closure, and makes it [`Criticality::current`] while the request is
//!   served. **Only from a source you trust**: a header your gateway sets (and strips from what
//!   clients send), or a closure on what you know of the caller. A client that may set its own
//!   level sets it to critical.
//! - **Outbound**, [`PropagateCriticalityLayer`] (tower and tonic clients) and
//!   [`CriticalityMiddleware`](crate::middleware::CriticalityMiddleware) (reqwest) send the
//!   current level in the header, so that the next service sheds the same traffic first; and an
//!   [`Upstreams`](crate::adaptive::Upstreams) limit admits a call at the current level.
//!
//! ```
//! use tollgate::criticality::Criticality;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! assert_eq!("sheddable".parse::<Criticality>(), Ok(Criticality::Sheddable));
//! assert!(Criticality::Critical > Criticality::Default);
//! assert_eq!(Criticality::current(), None);
//! Criticality::Sheddable
//!     .scope(async {
//!         // The calls made here are sheddable.
//!         assert_eq!(Criticality::current(), Some(Criticality::Sheddable));
//!     })
//!     .await;
//! # }
//! ```

use std::future::Future;
use std::task::{Context, Poll};

use http::{HeaderName, HeaderValue, Request};

tokio::task_local! {
    static CURRENT: Criticality;
}

/// How much a request matters when the service is full: sheddable requests are refused first,
/// then default ones, critical ones last. Ordered: `Sheddable < Default < Critical`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Criticality {
    /// Work nobody waits on now (prefetch, batch): refused first.
    Sheddable = 0,
    /// Everything not said otherwise.
    #[default]
    Default = 1,
    /// A user waits on it: refused last.
    Critical = 2,
}

/// The levels, lowest first.
pub(crate) const LEVELS: [Criticality; 3] = [
    Criticality::Sheddable,
    Criticality::Default,
    Criticality::Critical,
];

impl Criticality {
    /// Its name in headers and metrics: `critical`, `default` or `sheddable`.
    pub fn as_str(self) -> &'static str {
        match self {
            Criticality::Sheddable => "sheddable",
            Criticality::Default => "default",
            Criticality::Critical => "critical",
        }
    }

    /// The level a header's value names (see [`FromStr`](std::str::FromStr)), `None` for any
    /// other value.
    pub fn from_header(value: &HeaderValue) -> Option<Self> {
        std::str::from_utf8(value.as_bytes()).ok()?.parse().ok()
    }

    /// The level of the request being served in this task (set by the adaptive layer from a
    /// trusted source, or by [`scope`](Self::scope)), if any. A task spawned from it does not
    /// inherit it: give it the level ([`scope`](Self::scope)) where its calls belong to the
    /// request.
    pub fn current() -> Option<Criticality> {
        CURRENT.try_with(|c| *c).ok()
    }

    /// Runs `work` with this level current.
    pub async fn scope<F: Future>(self, work: F) -> F::Output {
        CURRENT.scope(self, work).await
    }

    /// `work` with `level` current while it is polled (the adaptive layer's inner future).
    pub(crate) fn scoped<F: Future>(
        level: Criticality,
        work: F,
    ) -> tokio::task::futures::TaskLocalFuture<Criticality, F> {
        CURRENT.scope(level, work)
    }

    /// Calls `f` with `level` current (the inner service's `call`).
    pub(crate) fn sync_scoped<R>(level: Criticality, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(level, f)
    }
}

impl std::fmt::Display for Criticality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A value that names no level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownCriticality(String);

impl std::fmt::Display for UnknownCriticality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} is not a criticality: use critical, default or sheddable",
            self.0
        )
    }
}

impl std::error::Error for UnknownCriticality {}

impl std::str::FromStr for Criticality {
    type Err = UnknownCriticality;

    /// `critical`, `default` or `sheddable`, in any case, spaces around ignored; and Google's
    /// names, `CRITICAL_PLUS` and `CRITICAL` as critical, `SHEDDABLE_PLUS` as default,
    /// `SHEDDABLE` as sheddable.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let is = |name: &str| t.eq_ignore_ascii_case(name);
        if is("critical") || is("critical_plus") {
            Ok(Criticality::Critical)
        } else if is("default") || is("sheddable_plus") {
            Ok(Criticality::Default)
        } else if is("sheddable") {
            Ok(Criticality::Sheddable)
        } else {
            Err(UnknownCriticality(t.chars().take(64).collect()))
        }
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Criticality {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Criticality {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Sends the level of an outbound call in a header: the call's own [`Criticality`] extension,
/// else [`Criticality::current`] (the inbound request's); a call that has the header already
/// keeps it, and one with no level is sent without. For tower and tonic clients.
///
/// ```
/// use http::HeaderName;
/// use tollgate::criticality::{Criticality, PropagateCriticalityLayer};
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let client = ServiceBuilder::new()
///     .layer(PropagateCriticalityLayer::new(HeaderName::from_static("x-criticality")))
///     .service(service_fn(|req: http::Request<()>| async move {
///         // What the next service is sent.
///         let sent = req.headers().get("x-criticality").cloned();
///         Ok::<_, std::convert::Infallible>(http::Response::new(sent))
///     }));
/// let res = Criticality::Sheddable
///     .scope(client.oneshot(http::Request::new(())))
///     .await
///     .unwrap();
/// assert_eq!(res.body().as_ref().unwrap(), "sheddable");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PropagateCriticalityLayer {
    header: HeaderName,
}

impl PropagateCriticalityLayer {
    /// Sends the level in header `name` (e.g. `x-criticality`: the one the next service's
    /// adaptive layer reads).
    pub fn new(name: HeaderName) -> Self {
        PropagateCriticalityLayer { header: name }
    }
}

impl<S> tower_layer::Layer<S> for PropagateCriticalityLayer {
    type Service = PropagateCriticality<S>;

    fn layer(&self, inner: S) -> PropagateCriticality<S> {
        PropagateCriticality {
            inner,
            header: self.header.clone(),
        }
    }
}

/// The service [`PropagateCriticalityLayer`] makes.
#[derive(Debug, Clone)]
pub struct PropagateCriticality<S> {
    inner: S,
    header: HeaderName,
}

impl<S, B> tower_service::Service<Request<B>> for PropagateCriticality<S>
where
    S: tower_service::Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> S::Future {
        let level = req_level(req.extensions());
        set_header(req.headers_mut(), level, &self.header);
        self.inner.call(req)
    }
}

/// The level of an outbound call: its extension, else the current one.
pub(crate) fn req_level(extensions: &http::Extensions) -> Option<Criticality> {
    (extensions.get::<Criticality>().copied()).or_else(Criticality::current)
}

/// Puts `level` in `name`, unless the call says already.
pub(crate) fn set_header(
    headers: &mut http::HeaderMap,
    level: Option<Criticality>,
    name: &HeaderName,
) {
    if let Some(level) = level
        && !headers.contains_key(name)
    {
        headers.insert(name.clone(), HeaderValue::from_static(level.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_in_any_case_and_refuses_the_rest() {
        for (text, level) in [
            ("critical", Criticality::Critical),
            (" CRITICAL_PLUS ", Criticality::Critical),
            ("Default", Criticality::Default),
            ("SHEDDABLE_PLUS", Criticality::Default),
            ("sheddable", Criticality::Sheddable),
        ] {
            assert_eq!(text.parse::<Criticality>(), Ok(level), "{text}");
        }
        for bad in ["", "urgent", "critical!", "0"] {
            let err = bad.parse::<Criticality>().unwrap_err();
            assert!(err.to_string().contains("not a criticality"), "{err}");
        }
        assert_eq!(
            Criticality::from_header(&HeaderValue::from_static("sheddable")),
            Some(Criticality::Sheddable)
        );
        assert_eq!(
            Criticality::from_header(&HeaderValue::from_bytes(b"\xffcritical").unwrap()),
            None
        );
    }

    #[tokio::test]
    async fn a_scope_sets_the_level_and_an_explicit_header_is_kept() {
        let name = HeaderName::from_static("x-criticality");
        let mut headers = http::HeaderMap::new();
        Criticality::Critical
            .scope(async {
                set_header(&mut headers, req_level(&http::Extensions::new()), &name);
            })
            .await;
        assert_eq!(headers[&name], "critical");
        // An outbound call that says its own level keeps it.
        let mut ext = http::Extensions::new();
        ext.insert(Criticality::Sheddable);
        let mut explicit = http::HeaderMap::new();
        explicit.insert(&name, HeaderValue::from_static("default"));
        set_header(&mut explicit, req_level(&ext), &name);
        assert_eq!(explicit[&name], "default");
        // No level: no header.
        let mut none = http::HeaderMap::new();
        set_header(&mut none, req_level(&http::Extensions::new()), &name);
        assert!(none.is_empty());
    }
}
