//! The outage tests every SQL backend shares: the database killed and restarted under each
//! failure policy, frozen, and black-holed; and concurrent decisions over several instances.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::backend::Backend;
use tollgate::backend::remote::{FailurePolicy, Fleet, RemoteStats};
use tollgate::{BackendErrorKind, Policy};

use super::proxy::{Fault, FaultProxy};
use super::{cost, key, no_refill, prepare};

/// The failure tests' decision timeout.
pub const TIMEOUT: Duration = Duration::from_millis(300);

/// A database server a test can kill, restart and freeze.
pub trait Db {
    fn kill(&mut self);
    fn restart(&mut self);
    fn pause(&self);
    fn resume(&self);
}

/// A remote backend as the outage tests see it.
pub trait Remote: Backend + Clone {
    fn stats(&self) -> RemoteStats;
}

/// No request waits much past the timeout.
pub async fn timed<F: Future<Output = T>, T>(f: F) -> T {
    let started = Instant::now();
    let out = f.await;
    assert!(
        started.elapsed() < TIMEOUT + Duration::from_millis(500),
        "waited {:?}",
        started.elapsed()
    );
    out
}

/// `n` concurrent decisions on one key, spread over `backends`; how many were allowed.
pub async fn allowed_of_concurrent<B: Backend + Clone>(
    backends: &[B],
    policy: &Policy,
    n: usize,
) -> usize {
    let prepared: Vec<_> = backends
        .iter()
        .map(|b| Arc::new(prepare(b, policy)))
        .collect();
    let mut tasks = Vec::new();
    for i in 0..n {
        let b = backends[i % backends.len()].clone();
        let p = prepared[i % backends.len()].clone();
        tasks.push(tokio::spawn(async move {
            b.decide(&p, &key("hot"), cost(1))
                .await
                .unwrap()
                .is_allowed()
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += usize::from(t.await.unwrap());
    }
    allowed
}

/// Until `b` decides through its store again (a decision with quota state).
async fn resumes<B: Remote>(b: &B, p: &B::Policy) {
    let started = Instant::now();
    loop {
        let before = b.stats().decisions;
        let d = b.decide(p, &key("k"), cost(1)).await;
        if b.stats().decisions > before && d.is_ok_and(|d| !d.quotas().is_empty()) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "shared limiting did not resume: {:?}",
            b.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The database killed mid-stream and restarted, under each failure policy (`failing` makes a
/// backend with the policy, the [`TIMEOUT`] and a breaker opening after 3 failures): answers
/// within the timeout meanwhile, shared limits again after the restart.
pub async fn killed_and_restarted<B: Remote>(
    server: &mut impl Db,
    failing: impl Fn(FailurePolicy) -> B,
) {
    for on_failure in [
        FailurePolicy::FailOpen,
        FailurePolicy::FailClosed,
        FailurePolicy::FallbackLocal,
    ] {
        let b = failing(on_failure);
        let p = prepare(&b, &Policy::new("outage", no_refill(1000)));
        let k = key("k");
        let d = b.decide(&p, &k, cost(1)).await.unwrap();
        assert_eq!(d.quotas().len(), 1, "{on_failure:?}");

        server.kill();
        for _ in 0..10 {
            let r = timed(b.decide(&p, &k, cost(1))).await;
            match on_failure {
                FailurePolicy::FailOpen => assert!(r.unwrap().quotas().is_empty()),
                FailurePolicy::FailClosed => {
                    let err = r.unwrap_err();
                    assert!(
                        matches!(
                            err.kind(),
                            BackendErrorKind::Unavailable | BackendErrorKind::Timeout
                        ),
                        "{err}"
                    );
                }
                _ => assert_eq!(r.unwrap().quotas().len(), 1, "local fallback"),
            }
        }
        let s = b.stats();
        assert!(s.breaker_open, "{on_failure:?}: {s:?}");
        assert!(s.failing.is_some(), "{s:?}");

        server.restart();
        resumes(&b, &p).await;
        assert!(!b.stats().breaker_open);
    }
}

/// Instances falling back to local limits, as a fleet (`make` builds a backend with the fleet
/// given, [`FailurePolicy::FallbackLocal`], the [`TIMEOUT`] and a breaker opening after 3
/// failures; `size` reads the fleet's size from its stats): announced instances count each
/// other, a stopped one is forgotten, and once the store is killed each admits its share, so
/// that two admit one quota together; a configured size divides without announcing.
pub async fn fleet_shares<B: Backend + Clone>(
    server: &mut impl Db,
    make: impl Fn(Fleet) -> B,
    size: impl Fn(&B) -> u32,
) {
    let announced = Fleet::Announced {
        every: Duration::from_millis(100),
    };
    let policy = Policy::new("fleet", no_refill(10));
    let (a, b) = (make(announced), make(announced));
    let (pa, pb) = (prepare(&a, &policy), prepare(&b, &policy));
    super::eventually("two instances count each other", || {
        size(&a) == 2 && size(&b) == 2
    })
    .await;
    let c = make(announced);
    let pc = prepare(&c, &policy);
    super::eventually("a third is counted", || size(&a) == 3 && size(&c) == 3).await;
    drop((pc, c));
    super::eventually("a stopped instance is forgotten", || {
        size(&a) == 2 && size(&b) == 2
    })
    .await;
    // Both were decided by the store once: their buckets there, and the key's, exist.
    let k = key("k");
    a.decide(&pa, &k, cost(1)).await.unwrap();

    server.kill();
    let mut allowed = [0, 0];
    for (i, (backend, p)) in [(&a, &pa), (&b, &pb)].into_iter().enumerate() {
        for _ in 0..10 {
            let d = timed(backend.decide(p, &k, cost(1))).await.unwrap();
            allowed[i] += usize::from(d.is_allowed());
        }
    }
    assert_eq!(
        allowed,
        [5, 5],
        "each instance its share: one quota together"
    );
    // The count read last is kept while the store is down.
    assert_eq!((size(&a), size(&b)), (2, 2));

    // A configured size: 10 over 3 instances is 4 each (rounded up), without a store.
    let three = make(Fleet::Size(std::num::NonZeroU32::new(3).unwrap()));
    assert_eq!(size(&three), 3);
    let p3 = prepare(&three, &policy);
    let mut allowed = 0;
    for _ in 0..10 {
        allowed += usize::from(
            timed(three.decide(&p3, &k, cost(1)))
                .await
                .unwrap()
                .is_allowed(),
        );
    }
    assert_eq!(allowed, 4);
    // A request the whole quota allows is never too large for a share: costing more than the
    // share's burst of 4, it takes the whole share, once.
    let big = key("big");
    let d = timed(three.decide(&p3, &big, cost(6))).await.unwrap();
    assert!(d.is_allowed() && !d.never_fits(), "{d:?}");
    assert!(
        !timed(three.decide(&p3, &big, cost(1)))
            .await
            .unwrap()
            .is_allowed()
    );
    server.restart();
}

/// A frozen database (connections open, nothing answers) costs each request the timeout at
/// most; `b` fails open.
pub async fn frozen<B: Remote>(server: &impl Db, b: &B) {
    let p = prepare(b, &Policy::new("frozen", no_refill(1000)));
    b.decide(&p, &key("k"), cost(1)).await.unwrap();
    server.pause();
    for _ in 0..5 {
        let d = timed(b.decide(&p, &key("k"), cost(1))).await.unwrap();
        assert!(d.quotas().is_empty());
    }
    server.resume();
}

/// A black-holed path to the database (`b` connects through `proxy` and fails closed): each
/// request costs at most the timeout, and once the path heals the backend decides again.
pub async fn black_holed<B: Remote>(proxy: &FaultProxy, b: &B) {
    let p = prepare(b, &Policy::new("blackhole", no_refill(1000)));
    let k = key("k");
    assert!(b.decide(&p, &k, cost(1)).await.unwrap().is_allowed());
    proxy.set(Fault::Stall);
    for _ in 0..5 {
        let r = timed(b.decide(&p, &k, cost(1))).await;
        assert!(r.is_err(), "{r:?} {:?}", b.stats());
    }
    assert!(b.stats().breaker_open, "{:?}", b.stats());
    proxy.set(Fault::Pass);
    resumes(b, &p).await;
}
