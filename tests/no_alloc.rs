//! The hot path allocates nothing: a request through the layer with the local backend and a
//! rule set (tiers, path and method rules), once its bucket exists and with headers off, makes
//! no heap allocation — policy selection takes no lock and allocates nothing.

use std::alloc::System;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tollgate::key::Header;
use tollgate::rules::{Rule, RuleSet};
use tollgate::{HeaderStyle, Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

// Counts every allocation of the process; the test runs on one thread (a current-thread
// runtime), and nextest gives each test its own process.
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn generous(name: &str) -> Policy {
    Policy::new(name, Quota::per_second(1_000_000).burst(1_000_000))
}

#[test]
fn a_request_with_rules_allocates_nothing() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let rules = RuleSet::new(generous("free"))
            .policy(generous("pro"))
            .policy(generous("writes"))
            .tier("m-1", "pro")
            .rule(Rule::new(10, "pro").tier("pro"))
            .rule(
                Rule::new(20, "writes")
                    .method(Method::POST)
                    .path_prefix("/api"),
            );
        let layer = RateLimitLayer::builder()
            .rules(rules)
            .key(Header::new("x-merchant-id"))
            .headers(HeaderStyle::None)
            .build()
            .unwrap();
        let inner = tower::service_fn(|_req: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let mut svc = layer.layer(inner);
        let requests: Vec<Request<()>> = (0..101)
            .map(|i| {
                let mut r = Request::builder()
                    .method(if i % 2 == 0 {
                        Method::GET
                    } else {
                        Method::POST
                    })
                    .uri("/api/items")
                    .header("x-merchant-id", "m-1")
                    .body(())
                    .unwrap();
                r.extensions_mut()
                    .insert("192.0.2.1:1".parse::<SocketAddr>().unwrap());
                r
            })
            .collect();
        let mut requests = requests.into_iter();
        // The first request creates the bucket (and the runtime warms up).
        let first = requests.next().unwrap();
        svc.ready().await.unwrap().call(first).await.unwrap();
        let second = requests.next().unwrap();
        svc.ready().await.unwrap().call(second).await.unwrap();

        // Three rounds of 33: an allocation per request shows in every round, while a one-off
        // of the process (the allocator counts every thread's) can only spoil one.
        let requests: Vec<_> = requests.collect();
        let mut ok = 0;
        let mut rounds = Vec::new();
        let mut requests = requests.into_iter();
        for _ in 0..3 {
            let region = Region::new(GLOBAL);
            for req in requests.by_ref().take(33) {
                let res = svc.ready().await.unwrap().call(req).await.unwrap();
                ok += usize::from(res.status() == 200);
                drop(res);
            }
            rounds.push(region.change().allocations);
        }
        assert_eq!(ok, 99);
        let least = rounds.iter().min().copied().unwrap_or_default();
        assert_eq!(least, 0, "allocations per round of 33 requests: {rounds:?}");
    });
}
