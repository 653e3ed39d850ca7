//! The service as tower sees it: readiness, cloning, error types, asynchronous backends.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tollgate::backend::{Backend, Decision, LocalBackend, Mode};
use tollgate::quota::QuotaParams;
use tollgate::{BackendError, BackendErrorKind, ConfigError, Key, Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

/// A backend that answers after a delay, like a remote store, or fails.
#[derive(Clone)]
struct SlowBackend {
    local: LocalBackend,
    delay: Duration,
    fail: bool,
}

impl Backend for SlowBackend {
    type Policy = <LocalBackend as Backend>::Policy;
    type Future = Pin<Box<dyn Future<Output = Result<Decision, BackendError>> + Send>>;

    fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<Self::Policy, ConfigError> {
        self.local.prepare(policy, params)
    }

    fn decide(&self, policy: &Self::Policy, key: &Key, cost: NonZeroU32) -> Self::Future {
        let decision = self.local.decide(policy, key, cost);
        let (delay, fail) = (self.delay, self.fail);
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            if fail {
                return Err(BackendError::from_kind(BackendErrorKind::Timeout));
            }
            decision.await
        })
    }

    fn decide_with(
        &self,
        policy: &Self::Policy,
        key: &Key,
        cost: NonZeroU32,
        mode: Mode,
    ) -> Self::Future {
        let decision = self.local.decide_with(policy, key, cost, mode);
        Box::pin(decision)
    }
}

/// An inner service that insists on `poll_ready` before every `call`, and whose readiness is
/// per clone (like a `Buffer` or a connection pool slot).
#[derive(Default)]
struct Strict {
    ready: bool,
    calls: Arc<AtomicUsize>,
}

/// A clone has not been polled ready: readiness belongs to the instance that was polled.
impl Clone for Strict {
    fn clone(&self) -> Self {
        Strict {
            ready: false,
            calls: self.calls.clone(),
        }
    }
}

#[derive(Debug, PartialEq)]
struct MyError;

impl Service<Request<Full<Bytes>>> for Strict {
    type Response = Response<Full<Bytes>>;
    type Error = MyError;
    type Future = std::future::Ready<Result<Self::Response, MyError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), MyError>> {
        self.ready = true;
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        assert!(self.ready, "called without poll_ready");
        self.ready = false;
        self.calls.fetch_add(1, Ordering::SeqCst);
        if req.uri().path() == "/error" {
            return std::future::ready(Err(MyError));
        }
        std::future::ready(Ok(Response::new(Full::new(Bytes::from_static(b"ok")))))
    }
}

fn request(path: &str) -> Request<Full<Bytes>> {
    let mut req = Request::get(path).body(Full::default()).unwrap();
    req.extensions_mut()
        .insert("192.0.2.1:1234".parse::<SocketAddr>().unwrap());
    req
}

fn assert_send_sync_clone<T: Send + Sync + Clone + 'static>(_: &T) {}

#[tokio::test(start_paused = true)]
async fn asynchronous_backend_uses_the_ready_service_and_keeps_errors() {
    let backend = SlowBackend {
        local: LocalBackend::new(),
        delay: Duration::from_millis(5),
        fail: false,
    };
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .policy(Policy::new("p", Quota::per_day(1).burst(2)))
        .build()
        .unwrap();
    let inner = Strict::default();
    let calls = inner.calls.clone();
    let mut svc = layer.layer(inner);
    assert_send_sync_clone(&svc);

    // The inner error type is untouched and errors pass through.
    let err = svc
        .ready()
        .await
        .unwrap()
        .call(request("/error"))
        .await
        .unwrap_err();
    assert_eq!(err, MyError);
    let res = svc.ready().await.unwrap().call(request("/")).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "ok");
    // The third request is rejected as a response, not an error, and never reaches the inner
    // service.
    let res = svc.ready().await.unwrap().call(request("/")).await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn many_in_flight_decisions_on_clones() {
    let backend = SlowBackend {
        local: LocalBackend::new(),
        delay: Duration::from_millis(50),
        fail: false,
    };
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .policy(Policy::new("p", Quota::per_day(1).burst(10)))
        .build()
        .unwrap();
    let svc = layer.layer(Strict::default());
    let futures: Vec<_> = (0..40)
        .map(|_| {
            let mut svc = svc.clone();
            tokio::spawn(async move {
                svc.ready()
                    .await
                    .unwrap()
                    .call(request("/"))
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    let mut ok = 0;
    for f in futures {
        if f.await.unwrap() == 200 {
            ok += 1;
        }
    }
    assert_eq!(ok, 10);
}

#[tokio::test(start_paused = true)]
async fn backend_failure_is_a_503_response() {
    let backend = SlowBackend {
        local: LocalBackend::new(),
        delay: Duration::from_millis(1),
        fail: true,
    };
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .policy(Policy::new("p", Quota::per_second(10)))
        .build()
        .unwrap();
    let mut svc = layer.layer(Strict::default());
    let res = svc.ready().await.unwrap().call(request("/")).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
}

/// Shadow mode never rejects: not on a quota's denial (tests/rules.rs), not when the backend
/// fails, and not when the request has no key.
#[tokio::test(start_paused = true)]
async fn shadow_mode_passes_backend_failures_and_missing_keys() {
    async fn status<Bk: Backend>(backend: Bk, shadow: bool, req: Request<Full<Bytes>>) -> u16 {
        let layer = RateLimitLayer::builder()
            .backend(backend)
            .policy(Policy::new("p", Quota::per_second(10)).shadow(shadow))
            .build()
            .unwrap();
        let mut svc = layer.layer(Strict::default());
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        res.status().as_u16()
    }
    let failing = || SlowBackend {
        local: LocalBackend::new(),
        delay: Duration::from_millis(1),
        fail: true,
    };
    // The peer address is not wired in: the request lacks its key.
    let no_peer = || Request::get("/").body(Full::default()).unwrap();

    assert_eq!(status(failing(), true, request("/")).await, 200);
    assert_eq!(status(failing(), false, request("/")).await, 503);
    assert_eq!(status(LocalBackend::new(), true, no_peer()).await, 200);
    assert_eq!(status(LocalBackend::new(), false, no_peer()).await, 500);
}

#[tokio::test]
async fn works_with_infallible_services_and_any_body() {
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("p", Quota::per_day(1)))
        .build()
        .unwrap();
    let request = || {
        let mut req = Request::new(String::from("body"));
        req.extensions_mut()
            .insert("192.0.2.1:1".parse::<SocketAddr>().unwrap());
        req
    };
    // The inner service's own body type comes back, for passes and rejections alike.
    let svc = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hi"))))
    });
    let mut svc = layer.clone().layer(svc);
    let res: Response<Full<Bytes>> = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "hi");
    let res = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(res.status(), 429);
    let text = res.into_body().collect().await.unwrap().to_bytes();
    assert!(text.starts_with(b"Too Many Requests"), "{text:?}");

    // A body that cannot hold a rejection, wrapped (a new layer: its own buckets).
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("p", Quota::per_day(1)))
        .build()
        .unwrap()
        .wrap_body();
    let svc = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(http_body_util::Empty::<Bytes>::new()))
    });
    let mut svc = layer.layer(svc);
    let res = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(
        res.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .is_empty()
    );
    let res = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(res.status(), 429);
    let text = res.into_body().collect().await.unwrap().to_bytes();
    assert!(text.starts_with(b"Too Many Requests"), "{text:?}");
}

#[test]
fn bad_configuration_is_an_error_not_a_panic() {
    let cases: Vec<(Result<_, ConfigError>, &str)> = vec![
        (
            RateLimitLayer::builder()
                .policy(Policy::new("p", Quota::per_second(0)))
                .build()
                .map(drop),
            "count is zero",
        ),
        (
            RateLimitLayer::builder()
                .policy(Policy::new("p", Quota::per_second(5).burst(0)))
                .build()
                .map(drop),
            "burst is zero",
        ),
        (
            RateLimitLayer::builder()
                .policy(Policy::new("p", Quota::new(5, Duration::ZERO)))
                .build()
                .map(drop),
            "period is zero",
        ),
        (RateLimitLayer::builder().build().map(drop), "no policy"),
        (
            RateLimitLayer::builder()
                .policy(Policy::new("p", Quota::per_second(1)))
                .key(tollgate::key::Header::new("bad header"))
                .build()
                .map(drop),
            "not a valid header name",
        ),
        (
            RateLimitLayer::builder()
                .policy(Policy::new("p", Quota::per_second(1)))
                .on_missing_key(tollgate::OnMissingKey::Reject(http::StatusCode::OK))
                .build()
                .map(drop),
            "not an error status",
        ),
    ];
    for (result, expected) in cases {
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains(expected),
            "{err:?} should mention {expected:?}"
        );
    }
}
