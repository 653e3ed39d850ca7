//! Per-request cost of the rate-limit layer, next to its peers, in one run.
//!
//! Run with: `cargo bench --bench layer` (add a filter such as `-- layer/1key` for one group).
//!
//! Every variant wraps the same trivial inner service (`service_fn` answering an empty
//! `Response<axum::body::Body>`; tower_governor requires that body type) and is driven through
//! `poll_ready` + `Service::call` + one poll of the future, with the request built outside the
//! timed part. The quota is so large that nothing is ever denied (checked before measuring):
//!
//! - `bare`: the inner service alone;
//! - `governor`: a minimal hand-written middleware: peer IP from `ConnectInfo`, raw governor
//!   keyed `check_key` (dashmap store), then the inner service;
//! - `tower_governor`: tower_governor 0.8's `GovernorLayer`, peer-IP keyed;
//! - `tollgate`: `RateLimitLayer` with `PeerIp`, default configuration (IETF headers on).
//!
//! Groups: `layer/1key`, `layer/100k_keys` (rotating over 100 000 pre-built peer addresses),
//! `layer_2threads/*` (two threads sharing one limiter; time is per pair of requests),
//! `key` (extraction alone), `backend` (`LocalBackend::decide` vs governor `check_key`),
//! `headers` (the layer with each header style: the difference is the header cost; and
//! `ietf_changing`, where every response's numbers differ, so the header cache never hits).

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use governor::{Quota as GQuota, RateLimiter};
use http::{Request, Response, StatusCode};
use tollgate::backend::{Backend, LocalBackend};
use tollgate::key::{ClientIp, Header, KeyExtractor, PeerIp};
use tollgate::{HeaderStyle, Key, Policy, Quota, RateLimitLayer, RequestInfo};
use tower::{Layer, Service, service_fn};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

/// Raw governor, keyed, on its dashmap store and default clock (as tower_governor uses it).
type GovLimiter = RateLimiter<
    IpAddr,
    governor::state::keyed::DashMapStateStore<IpAddr>,
    governor::clock::DefaultClock,
>;

const MANY_KEYS: usize = 100_000;
/// One unit every nanosecond and a burst of a billion: never denied at benchmark speeds.
const BIG: u32 = 1_000_000_000;

fn addrs(n: usize) -> Vec<SocketAddr> {
    (0..n)
        .map(|i| {
            let i = u32::try_from(i).unwrap();
            SocketAddr::from((Ipv4Addr::from(0x0a00_0000 + i), 40_000))
        })
        .collect()
}

fn request(addr: SocketAddr) -> Request<()> {
    let mut req = Request::new(());
    req.extensions_mut().insert(ConnectInfo(addr));
    req
}

type Inner = tower::util::ServiceFn<
    fn(Request<()>) -> std::future::Ready<Result<Response<Body>, Infallible>>,
>;

fn inner() -> Inner {
    fn ok(_req: Request<()>) -> std::future::Ready<Result<Response<Body>, Infallible>> {
        std::future::ready(Ok(Response::new(Body::empty())))
    }
    service_fn(ok as fn(_) -> _)
}

/// `poll_ready`, `call`, and one poll of the response future: the whole per-request path of a
/// middleware whose inner service answers at once.
fn drive<S>(svc: &mut S, req: Request<()>) -> StatusCode
where
    S: Service<Request<()>, Error = Infallible>,
    S::Response: StatusOf,
{
    let mut cx = Context::from_waker(Waker::noop());
    assert!(svc.poll_ready(&mut cx).is_ready());
    let mut fut = std::pin::pin!(svc.call(req));
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(res)) => res.status_of(),
        _ => unreachable!("every service here answers at once"),
    }
}

trait StatusOf {
    fn status_of(&self) -> StatusCode;
}

impl<B> StatusOf for Response<B> {
    fn status_of(&self) -> StatusCode {
        self.status()
    }
}

/// Raw governor in a minimal middleware: the floor for a keyed in-process limiter.
#[derive(Clone)]
struct Governed<S> {
    inner: S,
    limiter: Arc<GovLimiter>,
}

impl<S> Service<Request<()>> for Governed<S>
where
    S: Service<Request<()>, Response = Response<Body>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = futures_either::Either<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<()>) -> Self::Future {
        let ip = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ci| ci.0.ip());
        match ip.map(|ip| self.limiter.check_key(&ip)) {
            Some(Ok(())) => futures_either::Either::Left(self.inner.call(req)),
            _ => {
                let mut res = Response::new(Body::empty());
                *res.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                futures_either::Either::Right(std::future::ready(Ok(res)))
            }
        }
    }
}

/// A two-armed future without pulling in `futures`.
mod futures_either {
    use std::future::{Future, Ready};
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use axum::body::Body;
    use http::Response;

    pub(crate) enum Either<F> {
        Left(F),
        Right(Ready<Result<Response<Body>, std::convert::Infallible>>),
    }

    impl<F> Future for Either<F>
    where
        F: Future<Output = Result<Response<Body>, std::convert::Infallible>> + Unpin,
    {
        type Output = F::Output;
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            match self.get_mut() {
                Either::Left(f) => Pin::new(f).poll(cx),
                Either::Right(r) => Pin::new(r).poll(cx),
            }
        }
    }
}

fn governor_limiter() -> Arc<GovLimiter> {
    let quota = GQuota::with_period(Duration::from_nanos(1))
        .unwrap()
        .allow_burst(NonZeroU32::new(BIG).unwrap());
    Arc::new(RateLimiter::dashmap(quota))
}

fn tollgate_layer(style: HeaderStyle) -> RateLimitLayer<PeerIp, LocalBackend> {
    RateLimitLayer::builder()
        .policy(Policy::new("bench", Quota::per_second(BIG).burst(BIG)))
        .key(PeerIp::new())
        .headers(style)
        .build()
        .unwrap()
}

/// Runs one variant over `addrs`, rotating, after checking that it allows.
fn bench_service<S>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    mut svc: S,
    addrs: &[SocketAddr],
) where
    S: Service<Request<()>, Error = Infallible>,
    S::Response: StatusOf,
{
    for &a in addrs {
        assert_eq!(
            drive(&mut svc, request(a)),
            StatusCode::OK,
            "{name} denied a request"
        );
    }
    let mut i = 0;
    c.bench_function(name, |b| {
        b.iter_batched(
            || {
                i = (i + 1) % addrs.len();
                request(addrs[i])
            },
            |req| black_box(drive(&mut svc, req)),
            BatchSize::SmallInput,
        )
    });
}

fn layer(c: &mut Criterion) {
    for (group, n) in [("layer/1key", 1), ("layer/100k_keys", MANY_KEYS)] {
        let addrs = addrs(n);
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Elements(1));
        bench_service(&mut g, "bare", inner(), &addrs);
        bench_service(
            &mut g,
            "governor",
            Governed {
                inner: inner(),
                limiter: governor_limiter(),
            },
            &addrs,
        );
        let config = GovernorConfigBuilder::default()
            .per_nanosecond(1)
            .burst_size(BIG)
            .finish()
            .unwrap();
        bench_service(
            &mut g,
            "tower_governor",
            GovernorLayer::new(config).layer(inner()),
            &addrs,
        );
        bench_service(
            &mut g,
            "tollgate",
            tollgate_layer(HeaderStyle::Ietf).layer(inner()),
            &addrs,
        );
        g.finish();
    }
}

/// Two threads, each with its own clone of the service sharing one limiter, each making
/// `iters` requests; the reported time is wall time per pair of requests.
fn two_threads<S>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    svc: S,
    addrs: &Arc<Vec<SocketAddr>>,
) where
    S: Service<Request<()>, Error = Infallible> + Clone + Send + 'static,
    S::Response: StatusOf,
{
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let threads: Vec<_> = (0..2)
                .map(|t| {
                    let mut svc = svc.clone();
                    let addrs = addrs.clone();
                    let barrier = barrier.clone();
                    std::thread::spawn(move || {
                        let reqs: Vec<_> = (0..iters as usize)
                            .map(|i| request(addrs[(i * 2 + t) % addrs.len()]))
                            .collect();
                        barrier.wait();
                        let start = Instant::now();
                        for req in reqs {
                            assert_eq!(drive(&mut svc, req), StatusCode::OK);
                        }
                        start.elapsed()
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .max()
                .unwrap()
        })
    });
}

fn layer_2threads(c: &mut Criterion) {
    for (group, n) in [
        ("layer_2threads/1key", 1),
        ("layer_2threads/100k_keys", MANY_KEYS),
    ] {
        let addrs = Arc::new(addrs(n));
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Elements(2));
        two_threads(&mut g, "bare", inner(), &addrs);
        two_threads(
            &mut g,
            "governor",
            Governed {
                inner: inner(),
                limiter: governor_limiter(),
            },
            &addrs,
        );
        let config = GovernorConfigBuilder::default()
            .per_nanosecond(1)
            .burst_size(BIG)
            .finish()
            .unwrap();
        two_threads(
            &mut g,
            "tower_governor",
            GovernorLayer::new(config).layer(inner()),
            &addrs,
        );
        two_threads(
            &mut g,
            "tollgate",
            tollgate_layer(HeaderStyle::Ietf).layer(inner()),
            &addrs,
        );
        g.finish();
    }
}

fn key_extraction(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    let peer = SocketAddr::from(([203, 0, 113, 9], 40_000));
    let proxy = SocketAddr::from(([10, 0, 0, 1], 40_000));

    let plain = request(peer);
    let key = ClientIp::new();
    g.bench_function("client_ip", |b| {
        b.iter(|| black_box(key.extract(&RequestInfo::new(black_box(&plain)))))
    });

    let key = PeerIp::new();
    g.bench_function("peer_ip", |b| {
        b.iter(|| black_box(key.extract(&RequestInfo::new(black_box(&plain)))))
    });

    // Through two trusted hops: walks X-Forwarded-For right to left.
    let mut proxied = request(proxy);
    proxied.headers_mut().insert(
        "x-forwarded-for",
        "198.51.100.7, 203.0.113.9, 10.1.2.3".parse().unwrap(),
    );
    let key = ClientIp::new().trust_proxies(["10.0.0.0/8"]).unwrap();
    assert_eq!(
        key.extract(&RequestInfo::new(&proxied)).unwrap(),
        Key::ip("203.0.113.9".parse().unwrap())
    );
    g.bench_function("client_ip_trusted_xff", |b| {
        b.iter(|| black_box(key.extract(&RequestInfo::new(black_box(&proxied)))))
    });

    // Trusted proxies configured, but the peer is not one of them: headers are skipped.
    let mut spoofed = request(peer);
    spoofed
        .headers_mut()
        .insert("x-forwarded-for", "1.2.3.4".parse().unwrap());
    g.bench_function("client_ip_untrusted_peer_xff", |b| {
        b.iter(|| black_box(key.extract(&RequestInfo::new(black_box(&spoofed)))))
    });

    let mut with_header = request(peer);
    with_header
        .headers_mut()
        .insert("x-key", "k-0123456789abcdef".parse().unwrap());
    let key = Header::new("x-key");
    g.bench_function("header", |b| {
        b.iter(|| black_box(key.extract(&RequestInfo::new(black_box(&with_header)))))
    });
    g.finish();
}

fn backend(c: &mut Criterion) {
    let one = NonZeroU32::MIN;
    for (group, n) in [("backend/1key", 1), ("backend/100k_keys", MANY_KEYS)] {
        let ips: Vec<IpAddr> = addrs(n).iter().map(SocketAddr::ip).collect();
        let keys: Vec<Key> = ips.iter().map(|ip| Key::ip(*ip)).collect();
        let mut g = c.benchmark_group(group);

        let limiter = governor_limiter();
        let mut i = 0;
        g.bench_function("governor_check_key", |b| {
            b.iter(|| {
                i = (i + 1) % ips.len();
                black_box(limiter.check_key(&ips[i]).is_ok())
            })
        });

        // The runtime is only needed for the backend's sweeper task.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let backend = LocalBackend::new();
        // The same decision under each algorithm, with a limit never reached.
        for (name, quota) in [
            ("local_decide", Quota::per_second(BIG).burst(BIG)),
            ("local_decide_fixed", Quota::per_second(BIG).fixed_window()),
            (
                "local_decide_sliding",
                Quota::per_second(BIG).sliding_window(),
            ),
            (
                "local_decide_sliding_12",
                Quota::per_minute(BIG)
                    .sliding_window()
                    .resolution(Duration::from_secs(5)),
            ),
        ] {
            let policy = Policy::new(name, quota);
            let prepared = backend
                .prepare(&policy, &policy.validate().unwrap())
                .unwrap();
            let mut i = 0;
            g.bench_function(name, |b| {
                b.iter(|| {
                    i = (i + 1) % keys.len();
                    let decision = backend
                        .decide(&prepared, &keys[i], one)
                        .into_inner()
                        .unwrap();
                    black_box(decision.is_allowed())
                })
            });
        }
        g.finish();
    }
}

/// The layer with each header style, one key: the differences are the cost of the headers.
fn headers(c: &mut Criterion) {
    let addrs = addrs(1);
    let mut g = c.benchmark_group("headers");
    for (name, style) in [
        ("none", HeaderStyle::None),
        ("ietf", HeaderStyle::Ietf),
        ("legacy", HeaderStyle::Legacy),
        ("both", HeaderStyle::Both),
    ] {
        bench_service(&mut g, name, tollgate_layer(style).layer(inner()), &addrs);
    }
    // Every request leaves a different `remaining` (the bucket only drains): the per-thread
    // cache of `RateLimit` values never hits, so this is the formatting cost.
    let draining = RateLimitLayer::builder()
        .policy(Policy::new("bench", Quota::per_second(1).burst(BIG)))
        .key(PeerIp::new())
        .build()
        .unwrap();
    bench_service(&mut g, "ietf_changing", draining.layer(inner()), &addrs);
    g.finish();
}

criterion_group!(
    benches,
    layer,
    layer_2threads,
    key_extraction,
    backend,
    headers
);
criterion_main!(benches);
