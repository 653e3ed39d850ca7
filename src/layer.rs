//! The layer and its builder.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tower_layer::Layer;

use crate::admit::Erased;
use crate::admit::{Policies, Shared};
use crate::backend::Backend;
use crate::body::{KeepBody, WrapBody};
use crate::key::{ClientIp, KeyExtractor, OnMissingKey};
use crate::prepared::Prepared;
use crate::response::{HeaderStyle, RejectionBody, Responder};
use crate::rules::{LiveRules, RuleSet, RulesHandle};
use crate::service::RateLimit;
use crate::wait::WaitMode;
use crate::{ConfigError, Policy};

/// Applies rate limiting to a service: see the [crate docs](crate).
///
/// Build one with [`RateLimitLayer::builder`]. Cloning is cheap (one `Arc`), and every service
/// made by one layer shares its buckets.
///
/// `M` says how responses carry their body ([`BodyMode`](crate::body::BodyMode)): by
/// default ([`KeepBody`]) in the inner service's own body type, so that axum and tonic pass
/// them on without boxing them again; [`wrap_body`](Self::wrap_body) switches to
/// [`WrapBody`] for body types tollgate cannot write a rejection in.
///
/// The type has no bounds of its own (as in tower, they are on the impls), so a struct generic
/// over the backend can hold one:
///
/// ```
/// use tollgate::RateLimitLayer;
/// use tollgate::key::ClientIp;
///
/// struct Limits<B> {
///     api: RateLimitLayer<ClientIp, B>,
/// }
/// ```
pub struct RateLimitLayer<K, Bk, M = KeepBody> {
    shared: Erased<K, Bk>,
    mode: PhantomData<fn() -> M>,
}

impl<K, Bk, M> Clone for RateLimitLayer<K, Bk, M> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            shared: self.shared.clone(),
            mode: PhantomData,
        }
    }
}

impl<K, Bk, M> fmt::Debug for RateLimitLayer<K, Bk, M>
where
    K: KeyExtractor + fmt::Debug,
    Bk: Backend + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shared = self.shared.get();
        f.debug_struct("RateLimitLayer")
            .field("key", &shared.key)
            .field("backend", &shared.backend)
            .field("policy", &shared.policies.default_name())
            .finish()
    }
}

impl<K, Bk> RateLimitLayer<K, Bk> {
    /// Answers with [`ResponseBody<B>`](crate::ResponseBody) around the inner service's body
    /// type `B`, instead of `B` itself: for inner services whose body type does not implement
    /// [`RateLimitBody`](crate::body::RateLimitBody) (the compiler says so).
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Empty;
    /// use tollgate::{Policy, Quota, RateLimitLayer, ResponseBody, key::Global};
    /// use tower::{Layer, Service, ServiceExt};
    ///
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// // `Empty` cannot hold a rejection's text: wrap it.
    /// let inner = tower::service_fn(|_req: Request<()>| async {
    ///     Ok::<_, std::convert::Infallible>(Response::new(Empty::<Bytes>::new()))
    /// });
    /// let layer = RateLimitLayer::builder()
    ///     .key(Global)
    ///     .policy(Policy::new("api", Quota::per_second(1)))
    ///     .build()
    ///     .unwrap()
    ///     .wrap_body();
    /// let mut svc = layer.layer(inner);
    /// let res: Response<ResponseBody<Empty<Bytes>>> =
    ///     svc.ready().await.unwrap().call(Request::new(())).await.unwrap();
    /// assert_eq!(res.status(), 200);
    /// let res = svc.ready().await.unwrap().call(Request::new(())).await.unwrap();
    /// assert_eq!(res.status(), 429);
    /// # });
    /// ```
    pub fn wrap_body(self) -> RateLimitLayer<K, Bk, WrapBody> {
        RateLimitLayer {
            shared: self.shared,
            mode: PhantomData,
        }
    }
}

impl<K: KeyExtractor, Bk: Backend, M> RateLimitLayer<K, Bk, M> {
    /// A service answering, for the caller's key, the state of this layer's policy without
    /// spending anything, as JSON (GitHub's `GET /rate_limit` shape): see
    /// [`StatusService`](crate::status::StatusService).
    pub fn status_service(&self) -> crate::status::StatusService<K, Bk> {
        crate::status::StatusService::new(self.shared.clone())
    }

    /// The handle that replaces this layer's rules at run time, when it was built with
    /// [`rules`](RateLimitLayerBuilder::rules); `None` for a single fixed policy.
    pub fn rules_handle(&self) -> Option<RulesHandle> {
        match &self.shared.get().policies {
            Policies::Rules(live) => Some(RulesHandle::new(live.clone())),
            Policies::Fixed(_) => None,
        }
    }
}

impl<S, K, Bk, M> Layer<S> for RateLimitLayer<K, Bk, M> {
    type Service = RateLimit<S, K, Bk, M>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_shared(inner, self.shared.clone())
    }
}

#[cfg(feature = "local")]
impl RateLimitLayer<ClientIp, crate::backend::LocalBackend> {
    /// Starts a builder: see [`RateLimitLayerBuilder::new`].
    pub fn builder() -> RateLimitLayerBuilder<ClientIp, Unset> {
        RateLimitLayerBuilder::new()
    }
}

impl RateLimitLayerBuilder<ClientIp, Unset> {
    /// Starts a builder: key [`ClientIp`] with no trusted proxies (the peer address), the
    /// local backend unless [`backend`](Self::backend) picks another, IETF headers, text
    /// rejections, and `400` for requests with no key.
    pub fn new() -> Self {
        RateLimitLayerBuilder {
            key: ClientIp::new(),
            backend: Unset,
            policy: None,
            headers: HeaderStyle::default(),
            body: RejectionBody::default(),
            on_missing_key: OnMissingKey::default(),
            waiting: None,
            obey_retry_after: false,
            decision_ext: false,
        }
    }
}

impl Default for RateLimitLayerBuilder<ClientIp, Unset> {
    fn default() -> Self {
        Self::new()
    }
}

/// Marker for a builder whose backend was not chosen: `build()` uses the
/// [`LocalBackend`](crate::backend::LocalBackend) (feature `local`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unset;

enum Source {
    Fixed(Policy),
    Rules(RuleSet),
}

/// Configures a [`RateLimitLayer`]. Methods take and return the builder by value.
#[must_use = "call `.build()` to get a layer"]
pub struct RateLimitLayerBuilder<K, Bk> {
    key: K,
    backend: Bk,
    policy: Option<Source>,
    headers: HeaderStyle,
    body: RejectionBody,
    on_missing_key: OnMissingKey,
    waiting: Option<(Duration, usize)>,
    obey_retry_after: bool,
    decision_ext: bool,
}

impl<K, Bk> RateLimitLayerBuilder<K, Bk> {
    /// The policy every request is checked against.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(Source::Fixed(policy));
        self
    }

    /// Rules choose the policy per request, and can be replaced while serving through
    /// [`RateLimitLayer::rules_handle`] (see [`rules`](crate::rules)).
    pub fn rules(mut self, rules: RuleSet) -> Self {
        self.policy = Some(Source::Rules(rules));
        self
    }

    /// How requests are keyed (see [`key`](crate::key)).
    pub fn key<K2: KeyExtractor>(self, key: K2) -> RateLimitLayerBuilder<K2, Bk> {
        RateLimitLayerBuilder {
            key,
            backend: self.backend,
            policy: self.policy,
            headers: self.headers,
            body: self.body,
            on_missing_key: self.on_missing_key,
            waiting: self.waiting,
            obey_retry_after: self.obey_retry_after,
            decision_ext: self.decision_ext,
        }
    }

    /// Where buckets live (see [`backend`](crate::backend)).
    pub fn backend<B2: Backend>(self, backend: B2) -> RateLimitLayerBuilder<K, B2> {
        RateLimitLayerBuilder {
            key: self.key,
            backend,
            policy: self.policy,
            headers: self.headers,
            body: self.body,
            on_missing_key: self.on_missing_key,
            waiting: self.waiting,
            obey_retry_after: self.obey_retry_after,
            decision_ext: self.decision_ext,
        }
    }

    /// Puts the decision made for each request it lets through in the request's extensions,
    /// as a [`RateLimitStatus`](crate::RateLimitStatus) (an axum extractor, with the `axum`
    /// feature), for handlers that report the quota in a body or a log line (see
    /// [`status`](crate::status)). Off by default: the status is built and allocated per
    /// request only when asked for.
    pub fn decision_in_extensions(mut self, on: bool) -> Self {
        self.decision_ext = on;
        self
    }

    /// Which rate-limit headers to send (default: IETF).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.headers = style;
        self
    }

    /// Rejections carry an RFC 9457 `application/problem+json` body.
    pub fn problem_json(mut self) -> Self {
        self.body = RejectionBody::ProblemJson;
        self
    }

    /// Rejections are built by `f`; tollgate adds `Retry-After` unless `f` set it, and its
    /// rate-limit headers (legacy ones unless set; IETF ones appended, as list items may span
    /// several fields). gRPC requests still get a gRPC status.
    pub fn rejection_response<F>(mut self, f: F) -> Self
    where
        F: Fn(&crate::Rejection<'_>) -> http::Response<bytes::Bytes> + Send + Sync + 'static,
    {
        self.body = RejectionBody::Custom(Arc::new(f));
        self
    }

    /// Wait mode: instead of answering `429`, hold a request until its policy allows it, for
    /// at most `max_wait`, with at most `max_waiters` requests waiting at once (requests beyond
    /// them are decided at once, as without wait mode). A request whose units would come later
    /// than `max_wait` is rejected at once, as today.
    ///
    /// Waiting is a reservation, not polling ([`Mode::Reserve`](crate::backend::Mode)): the
    /// backend takes the request's units as of the time it will go on and answers that wait;
    /// the layer sleeps once, then calls the inner service. Waiters are served first come,
    /// first served, at exactly the policy's rate, on every backend (for GCRA quotas; a window
    /// quota passes a request only when it has room now). A request first asks for its units
    /// now; only one refused for less than `max_wait` takes one of the `max_waiters` slots and
    /// reserves, so requests that pass at once never hold a slot, on any store (a waiter on a
    /// remote store costs a second round trip). A waiting request holds its request
    /// (headers and the unread body) and a clone of the inner service, and a slot among the
    /// `max_waiters`; its units are spent even if it is dropped while waiting (a client gone,
    /// a timeout), and its slot is given back then.
    ///
    /// For servers, this smooths bursts instead of rejecting them; around a client (a tonic
    /// `Channel`, a hyper-util `Client`), it keeps the calls a program makes to a partner's
    /// rate, shared by every process on a Redis or SQL backend.
    pub fn wait(mut self, max_wait: Duration, max_waiters: usize) -> Self {
        self.waiting = Some((max_wait, max_waiters));
        self
    }

    /// Around a client: when the wrapped service answers `429` or `503` with `Retry-After`
    /// (seconds or an HTTP date), or gRPC `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`,
    /// the request's key is paused until then (at most an hour); and before any refusal, when
    /// an answer's `RateLimit` field ([`fields`](crate::fields)) says a policy has nothing left
    /// (`r=0;t=N`), for those `N` seconds. Further requests for the key wait out the pause in
    /// [wait mode](Self::wait) when it is within the longest wait (and a waiter's place is
    /// free), and are answered `429` with the remaining time otherwise, without reaching the
    /// upstream. Per layer (its clones share the pauses), in memory, for at most 65 536 keys
    /// at once.
    pub fn obey_retry_after(mut self, on: bool) -> Self {
        self.obey_retry_after = on;
        self
    }

    /// What to do with a request that has no key (default: reject with `400`).
    pub fn on_missing_key(mut self, action: OnMissingKey) -> Self {
        self.on_missing_key = action;
        self
    }
}

impl<K: KeyExtractor, Bk: Backend> RateLimitLayerBuilder<K, Bk> {
    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer<K, Bk>, ConfigError> {
        build(self)
    }
}

#[cfg(feature = "local")]
impl<K: KeyExtractor> RateLimitLayerBuilder<K, Unset> {
    /// Checks the configuration and builds the layer on a new
    /// [`LocalBackend`](crate::backend::LocalBackend).
    pub fn build(self) -> Result<RateLimitLayer<K, crate::backend::LocalBackend>, ConfigError> {
        build(self.backend(crate::backend::LocalBackend::new()))
    }
}

fn build<K: KeyExtractor, Bk: Backend>(
    b: RateLimitLayerBuilder<K, Bk>,
) -> Result<RateLimitLayer<K, Bk>, ConfigError> {
    b.key.validate()?;
    if let OnMissingKey::Reject(status) = b.on_missing_key
        && !(status.is_client_error() || status.is_server_error())
    {
        return Err(ConfigError::Invalid {
            option: "on_missing_key",
            reason: format!("{status} is not an error status"),
        });
    }
    let backend = Arc::new(b.backend);
    let store = backend.store_id();
    let (policies, names) = match b.policy.ok_or(ConfigError::MissingPolicy)? {
        Source::Fixed(policy) => {
            let names = vec![buckets_of(&policy)];
            (
                Policies::Fixed(Arc::new(Prepared::new(&*backend, policy)?)),
                names,
            )
        }
        Source::Rules(rules) => {
            let names = rules.policies().iter().map(buckets_of).collect();
            let live = LiveRules::new(backend.clone(), rules)?;
            (Policies::Rules(Arc::new(live)), names)
        }
    };
    let shared = Erased::new(Shared {
        key: b.key,
        backend,
        policies,
        responder: Responder {
            style: b.headers,
            body: b.body,
        },
        on_missing_key: b.on_missing_key,
        wait_mode: b.waiting.map(|(max_wait, n)| WaitMode::new(max_wait, n)),
        pauses: b.obey_retry_after.then(Arc::default),
        decision_ext: b.decision_ext,
    });
    if let Some(store) = store {
        warn_on_shared_names(store, names, &shared);
    }
    Ok(RateLimitLayer {
        mode: PhantomData,
        shared,
    })
}

/// A policy's name, and what identifies its buckets in a store: the name and, per quota, its
/// validated parameters, algorithm included (quota names aside, which only label headers), as
/// the backends identify them.
fn buckets_of(policy: &Policy) -> (String, String) {
    let mut id = policy.name().to_owned();
    for p in policy.validate().iter().flatten() {
        id.push_str(&format!("|{p:?}"));
    }
    (policy.name().to_owned(), id)
}

/// The layers built in this process, by (store, policy name): a name seen in two layers built
/// separately on one store means shared buckets, which is worth a word in the log.
type Registry = HashMap<(String, String), Weak<dyn Send + Sync>>;

/// Warns when another layer, built separately and still alive, uses one of `names` on `store`:
/// the two share those policies' buckets (see "Which layers share buckets" in the crate docs).
fn warn_on_shared_names<K, Bk>(store: String, names: Vec<(String, String)>, layer: &Erased<K, Bk>) {
    static LAYERS: Mutex<Option<Registry>> = Mutex::new(None);
    let mut guard = LAYERS.lock().unwrap_or_else(|p| p.into_inner());
    let layers = guard.get_or_insert_with(HashMap::new);
    layers.retain(|_, w| w.strong_count() > 0);
    for (name, buckets) in names {
        let other = layers.insert((store.clone(), buckets), layer.downgrade());
        if let Some(other) = other.and_then(|w| w.upgrade())
            && !layer.is(&other)
        {
            tracing::warn!(
                policy = %name,
                store = %store,
                "tollgate: two layers built separately use policy {name:?} on one store, so \
                 they share its buckets: a client's requests through either count against one \
                 limit. If that is meant, build the second layer as a clone of the first (no \
                 warning then); if not, give the policies different names"
            );
        }
    }
}
