//! The Redis backend when Redis fails or moves data, and at the edges of its configuration:
//! real `redis-server` processes started by the tests, frozen (SIGSTOP), cut off by a proxy,
//! or resharded.
#![cfg(feature = "redis")]

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::{RedisCluster, RedisServer, cost, key, no_refill, prepare};
use tollgate::backend::Backend;
use tollgate::backend::redis::{FailurePolicy, RedisBackend};
use tollgate::{BackendErrorKind, Policy};

/// The key of the first bucket of `client` under a `no_refill(burst)` policy named `policy`.
fn bucket(policy: &str, client: &str) -> String {
    format!("tollgate:{{{policy}:b{client}}}:2.g0")
}

/// Decides on fresh keys until Redis decides again (bounded): after a freeze, the connection
/// may take a moment to drain what was queued.
async fn until_redis_decides(b: &RedisBackend, p: &<RedisBackend as Backend>::Policy) {
    let started = Instant::now();
    for i in 0.. {
        if let Ok(d) = b.decide(p, &key(&format!("after-{i}")), cost(1)).await
            && d.quotas().len() == 1
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "Redis did not decide again: {:?}",
            b.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A first decision while Redis is up: the backend connects and loads its script.
async fn warm_up(b: &RedisBackend, p: &<RedisBackend as Backend>::Policy) {
    let d = b.decide(p, &key("warm"), cost(1)).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
}

/// The integer in a RESP integer reply (`:42`).
fn int(reply: &str) -> i64 {
    reply.trim().trim_start_matches(':').parse().unwrap()
}

// ---------------------------------------------------------------------------------------------
// Batched calls: one breaker failure per call, one timeout per decision.
// ---------------------------------------------------------------------------------------------

/// Redis freezes while 40 requests are in flight: they share a few script calls, and each
/// failed call is one failure for the breaker (threshold 5), not one per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batched_call_counts_once_for_the_breaker() {
    let server = RedisServer::start();
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(Duration::from_millis(500))
        .on_failure(FailurePolicy::FailClosed)
        .circuit_breaker(5, Duration::from_millis(100))
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let p = Arc::new(prepare(&b, &Policy::new("frozen", no_refill(1000))));
    warm_up(&b, &p).await;
    let warm = b.stats();

    server.pause();
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let (b, p) = (b.clone(), p.clone());
            tokio::spawn(async move { b.decide(&p, &key(&format!("c{i}")), cost(1)).await })
        })
        .collect();
    for t in tasks {
        let err = t.await.unwrap().unwrap_err();
        assert!(
            matches!(
                err.kind(),
                BackendErrorKind::Timeout | BackendErrorKind::Unavailable
            ),
            "{err}"
        );
    }
    let s = b.stats();
    server.resume();

    let calls = s.calls - warm.calls;
    assert_eq!(
        s.fail_closed, 40,
        "every request got the failure policy: {s:?}"
    );
    assert!(
        (1..5).contains(&calls),
        "40 decisions queued at once share a few calls: {s:?}"
    );
    assert_eq!(s.errors, calls, "one error per failed call: {s:?}");
    assert!(s.timeouts <= s.errors, "{s:?}");
    assert!(
        !s.breaker_open && s.breaker_trips == 0,
        "a few failed calls are not 5 failures in a row: {s:?}"
    );
    until_redis_decides(&b, &p).await;
    assert_eq!(b.stats().breaker_trips, 0, "{:?}", b.stats());
}

/// A decision queued while an older one waits for a call shares that call, and still gets its
/// whole timeout: the older one times out at its own deadline, the newer one is decided by
/// Redis, which comes back between the two deadlines.
///
/// The default (single-threaded) test runtime makes the batching deterministic: while this
/// test blocks its thread, the batching task cannot send the older decision alone.
#[tokio::test]
async fn a_decision_sharing_a_call_with_an_older_one_keeps_its_own_timeout() {
    const TIMEOUT: Duration = Duration::from_secs(2);
    let server = RedisServer::start();
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(TIMEOUT)
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("deadlines", no_refill(100)));
    warm_up(&b, &p).await;
    let warm = b.stats();

    server.pause();
    let asked = Instant::now();
    let older = b.decide(&p, &key("older"), cost(1));
    std::thread::sleep(TIMEOUT / 2);
    let newer = b.decide(&p, &key("newer"), cost(1));
    // Deadlines: the older at 2 s, the newer at 3 s; Redis answers again at 2.5 s.
    let thaw = async {
        tokio::time::sleep_until((asked + TIMEOUT * 5 / 4).into()).await;
        server.resume();
    };
    let (older, newer, ()) = tokio::join!(older, newer, thaw);

    let err = older.expect_err("the older decision times out while Redis is frozen");
    assert_eq!(err.kind(), BackendErrorKind::Timeout, "{err}");
    let d = newer.expect("the newer decision waits its own timeout, and Redis answers within it");
    assert!(d.is_allowed());
    assert_eq!(d.quotas().len(), 1, "decided by Redis: {d:?}");
    let s = b.stats();
    assert_eq!(s.calls - warm.calls, 1, "one shared call: {s:?}");
    assert_eq!(
        s.timeouts, 0,
        "the call itself succeeded; the older decision's own timeout is not a failed call: {s:?}"
    );
    assert_eq!(s.fail_closed, 1, "{s:?}");
    // Redis ran both decisions (the older one's answer came too late to be used).
    assert_eq!(
        server
            .cmd(&["EXISTS", &bucket("deadlines", "older")])
            .trim(),
        ":1"
    );
}

// ---------------------------------------------------------------------------------------------
// Configuration at the edges: nothing panics.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_longest_timeouts_build_and_serve() {
    let server = RedisServer::start();
    for timeout in [Duration::MAX, Duration::from_secs(u64::MAX / 8)] {
        for batching in [true, false] {
            let b = RedisBackend::builder()
                .url(server.url())
                .timeout(timeout)
                .batching(batching)
                .build()
                .unwrap();
            let p = prepare(&b, &Policy::new("long", no_refill(5)));
            let k = key(&format!("{timeout:?}-{batching}"));
            let d = b.decide(&p, &k, cost(1)).await.unwrap();
            assert_eq!(d.quotas()[0].remaining, 4);
        }
        RedisBackend::builder()
            .cluster_nodes([server.url()])
            .timeout(timeout)
            .build()
            .unwrap();
    }
}

/// The breaker opens (its trial time is computed from the probe interval) and answers at once.
#[tokio::test]
async fn the_longest_probe_interval_opens_the_breaker() {
    let server = RedisServer::start();
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(Duration::from_millis(100))
        .circuit_breaker(1, Duration::MAX)
        .on_failure(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("probe", no_refill(5)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    server.pause();
    let d = b.decide(&p, &key("k"), cost(1)).await.unwrap();
    assert!(
        d.is_allowed() && d.quotas().is_empty(),
        "failed open: {d:?}"
    );
    let s = b.stats();
    server.resume();
    assert!(s.breaker_open, "{s:?}");
    assert_eq!(s.breaker_trips, 1);
    // Open: answered without calling Redis.
    b.decide(&p, &key("k"), cost(1)).await.unwrap();
    assert_eq!(b.stats().calls, s.calls);
}

// ---------------------------------------------------------------------------------------------
// Redis Cluster: never run a script twice for one request; follow redirections.
// ---------------------------------------------------------------------------------------------

/// A TCP proxy in front of one Redis node. Once armed, it cuts the connection that carries the
/// next script call right after Redis has answered it, without passing the answer on: the
/// client sees a dropped connection for a script that did run.
struct CuttingProxy {
    port: u16,
    armed: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
}

impl CuttingProxy {
    /// Listens now; connects each client to `upstream`'s port (set later, once the node that
    /// announces this proxy's port has started).
    fn start(upstream: Arc<AtomicU16>) -> CuttingProxy {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicUsize::new(0));
        let (armed2, cuts2) = (armed.clone(), cuts.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let port = upstream.load(Ordering::Acquire);
                let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                let script_sent = Arc::new(AtomicBool::new(false));
                let (mut from, mut to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (armed, sent) = (armed2.clone(), script_sent.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0; 64 * 1024];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        let chunk = &buf[..n];
                        if armed.load(Ordering::Acquire)
                            && chunk.windows(7).any(|w| w.eq_ignore_ascii_case(b"EVALSHA"))
                        {
                            sent.store(true, Ordering::Release);
                        }
                        if to.write_all(chunk).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                });
                let (mut from, mut to) = (server, client);
                let (armed, cuts) = (armed2.clone(), cuts2.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0; 64 * 1024];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        if script_sent.load(Ordering::Acquire)
                            && armed.swap(false, Ordering::AcqRel)
                        {
                            cuts.fetch_add(1, Ordering::AcqRel);
                            break;
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                    let _ = from.shutdown(Shutdown::Both);
                });
            }
        });
        CuttingProxy { port, armed, cuts }
    }
}

/// A one-node cluster reached only through a [`CuttingProxy`] (the node announces the proxy's
/// port). The connection drops after Redis ran the script: the request gets the failure policy,
/// and the script is not sent again (it would take a second unit for one request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_cluster_connection_does_not_run_the_script_twice() {
    let upstream = Arc::new(AtomicU16::new(0));
    let proxy = CuttingProxy::start(upstream.clone());
    let announce = proxy.port.to_string();
    let node = RedisServer::start_with(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-announce-ip",
        "127.0.0.1",
        "--cluster-announce-port",
        &announce,
    ]);
    upstream.store(node.port, Ordering::Release);
    assert!(
        node.cmd(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])
            .starts_with("+OK")
    );
    let started = Instant::now();
    while !node.cmd(&["CLUSTER", "INFO"]).contains("cluster_state:ok") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "cluster not ready"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let b = RedisBackend::builder()
        .cluster_nodes([format!("redis://127.0.0.1:{}", proxy.port)])
        .timeout(Duration::from_secs(2))
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("once", no_refill(10)));
    let k = key("k");
    let d = b.decide(&p, &k, cost(1)).await.unwrap();
    assert_eq!(d.quotas()[0].remaining, 9);

    proxy.armed.store(true, Ordering::Release);
    let cut = b.decide(&p, &k, cost(1)).await;
    assert_eq!(
        proxy.cuts.load(Ordering::Acquire),
        1,
        "the proxy cut a call"
    );
    let err = cut.expect_err("no second run after the dropped connection");
    assert_eq!(err.kind(), BackendErrorKind::Unavailable, "{err}");

    // Redis ran the script once for that request: one unit, not two.
    let started = Instant::now();
    let d = loop {
        match b.decide(&p, &k, cost(1)).await {
            Ok(d) => break d,
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "no reconnection: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(d.quotas()[0].remaining, 7, "{d:?}");
}

/// The node's cluster id.
fn node_id(node: &RedisServer) -> String {
    // A bulk string reply: `$40\r\n<id>\r\n`.
    node.cmd(&["CLUSTER", "MYID"])
        .lines()
        .nth(1)
        .unwrap()
        .trim()
        .to_owned()
}

/// A slot moves to another primary while the backend uses it: `ASK` during the migration and
/// `MOVED` after it are followed by the backend itself (its redis-rs client retries nothing),
/// and the bucket moves with its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_redirections_are_followed() {
    let cluster = RedisCluster::start();
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_secs(2))
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("mig", no_refill(10)));
    let k = key("moving");
    let remaining = async || b.decide(&p, &k, cost(1)).await.unwrap().quotas()[0].remaining;
    assert_eq!(remaining().await, 9);

    let key = bucket("mig", "moving");
    let slot = int(&cluster.nodes[0].cmd(&["CLUSTER", "KEYSLOT", &key])).to_string();
    let source = cluster
        .nodes
        .iter()
        .position(|n| n.cmd(&["EXISTS", &key]).trim() == ":1")
        .expect("one primary holds the bucket");
    let target = (source + 1) % cluster.nodes.len();
    let (src, dst) = (&cluster.nodes[source], &cluster.nodes[target]);
    let (src_id, dst_id) = (node_id(src), node_id(dst));

    // Migration under way, the bucket already moved: the source answers `ASK`.
    let ok = |reply: String| assert!(reply.starts_with("+OK"), "{reply}");
    ok(dst.cmd(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]));
    ok(src.cmd(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]));
    let dst_port = dst.port.to_string();
    ok(src.cmd(&["MIGRATE", "127.0.0.1", &dst_port, &key, "0", "5000"]));
    assert_eq!(
        remaining().await,
        8,
        "followed ASK to the bucket's new node"
    );

    // Migration done: the backend's slot map is stale, the source answers `MOVED`.
    for n in &cluster.nodes {
        ok(n.cmd(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]));
    }
    assert_eq!(remaining().await, 7, "followed MOVED");
    assert_eq!(remaining().await, 6);
    assert_eq!(dst.cmd(&["EXISTS", &key]).trim(), ":1");
    assert_eq!(b.stats().errors, 0, "{:?}", b.stats());
}

/// A cluster with no node left is out of reach like a dead single node: the circuit breaker
/// opens, and requests stop waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_opens_the_circuit_breaker() {
    let mut cluster = RedisCluster::start();
    let b = RedisBackend::builder()
        .cluster_nodes(cluster.urls())
        .timeout(Duration::from_millis(500))
        .on_failure(FailurePolicy::FailClosed)
        .circuit_breaker(5, Duration::from_secs(60))
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("dead-cluster", no_refill(1000)));
    warm_up(&b, &p).await;
    for node in &mut cluster.nodes {
        node.kill();
    }
    for i in 0..30 {
        let err = b
            .decide(&p, &key(&format!("c{i}")), cost(1))
            .await
            .expect_err("no node is left to decide");
        assert_ne!(err.kind(), BackendErrorKind::Protocol, "{err}");
        if b.stats().breaker_open {
            break;
        }
    }
    let s = b.stats();
    assert!(s.breaker_open, "the breaker opened: {s:?}");
    assert_eq!(s.breaker_trips, 1, "{s:?}");
}

/// Redis stops answering between a request's admission and its settlement: the response goes
/// out at once all the same (the settlement is sent in the background), the settlement times
/// out within the store's timeout (counted as a timeout; not retried), nothing panics, and the
/// next requests are decided by Redis again once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_redis_cannot_make_does_not_hold_the_response() {
    use axum::{Router, routing::get};
    use tollgate::settle::ChargeWhen;
    let server = Arc::new(RedisServer::start());
    let backend = RedisBackend::builder()
        .url(server.url())
        .timeout(Duration::from_millis(1000))
        .build()
        .unwrap();
    let limit = tollgate::RateLimitLayer::builder()
        .key(tollgate::key::Global)
        .backend(backend.clone())
        // Every answer but a 401 is refunded: each 200 sends a settlement.
        .policy(Policy::new("settling", no_refill(10)).charge_when(ChargeWhen::status([401])))
        .build()
        .unwrap();
    let freeze = Arc::new(AtomicBool::new(false));
    let app = Router::new()
        .route(
            "/",
            get({
                let (server, freeze) = (server.clone(), freeze.clone());
                // Freezes Redis (when asked) after the admission, before the settlement.
                move || async move {
                    if freeze.swap(false, Ordering::SeqCst) {
                        server.pause();
                    }
                    "ok"
                }
            }),
        )
        .route_layer(limit);
    let base = format!("http://{}", support::serve(app).await);
    let client = reqwest::Client::new();
    let ratelimit =
        |res: &reqwest::Response| res.headers()["ratelimit"].to_str().unwrap().to_owned();
    // Admitted and refunded: the bucket stays full.
    for _ in 0..2 {
        let res = client.get(&base).send().await.unwrap();
        assert_eq!(ratelimit(&res), "\"settling\";r=9;t=86400");
    }
    let timeouts = backend.stats().timeouts;
    freeze.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let res = client.get(&base).send().await.unwrap();
    assert_eq!(
        res.status(),
        200,
        "the response does not wait for its settlement"
    );
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "answered before the settlement's timeout: {:?}",
        started.elapsed()
    );
    // The settlement times out in the background, within the store's timeout.
    let waited = Instant::now();
    while backend.stats().timeouts == timeouts {
        assert!(
            waited.elapsed() < Duration::from_secs(5),
            "{:?}",
            backend.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.resume();
    until_redis_decides(
        &backend,
        &prepare(&backend, &Policy::new("other", no_refill(1))),
    )
    .await;
    // The refund timed out, so its outcome is unknown, as a timed-out decision's: lost (the
    // unit stays taken), or made when Redis ran what it had received. Either way, one of them.
    let res = client.get(&base).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let now = ratelimit(&res);
    assert!(
        ["\"settling\";r=8;t=86400", "\"settling\";r=9;t=86400"].contains(&now.as_str()),
        "{now}"
    );
}

/// A Redis whose memory is full (`maxmemory`, `noeviction`) refuses the script's writes. Before,
/// that failed the whole batched call, so that a key already refused (a refusal writes
/// nothing) was answered by the failure policy with the others, and fail-open let it through.
/// Now the refusal stands; only the decisions that would have taken something fail.
#[tokio::test]
async fn a_full_redis_keeps_refusing_what_it_refused() {
    use tollgate::backend::DecidedBy;
    let server =
        RedisServer::start_with(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]);
    let b = RedisBackend::builder()
        .url(server.url())
        .timeout(Duration::from_secs(5))
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("full", no_refill(1)));
    let victim = key("victim");
    assert!(b.decide(&p, &victim, cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&p, &victim, cost(1)).await.unwrap().is_allowed());
    // Full: any memory in use is more than the limit now.
    let reply = server.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    assert!(reply.contains("OK"), "{reply}");
    let reply = server.cmd(&["SET", "junk", "x"]);
    assert!(reply.contains("OOM"), "writes are refused: {reply}");
    // Frozen, so that the decisions queue and go in batches: a fresh key's (a write) with the
    // refused key's.
    server.pause();
    let decide = |k: &'static str| {
        let (b, p) = (&b, &p);
        async move { b.decide(p, &key(k), cost(1)).await.unwrap() }
    };
    let all = futures_util::future::join_all(["f1", "f2", "victim", "fresh", "f3"].map(decide));
    let resume = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        server.resume();
    };
    let (decisions, ()) = tokio::join!(all, resume);
    let victim = &decisions[2];
    assert!(
        !victim.is_allowed(),
        "the refused key stays refused: {victim:?}"
    );
    assert_eq!(victim.made_by(), DecidedBy::Store, "{victim:?}");
    // A fresh key needed a write Redis refused: the failure policy answered it, by default
    // the local fallback (a full Redis is not no limit).
    let fresh = &decisions[3];
    assert_eq!(fresh.made_by(), DecidedBy::FallbackLocal, "{fresh:?}");
}
