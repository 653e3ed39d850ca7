//! Rules: priorities, live updates, invalid updates, shadow mode.

mod support;

use std::net::SocketAddr;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use tollgate::key::Header;
use tollgate::rules::{Rule, RuleSet};
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

fn ok_service() -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(|_req: Request<Full<Bytes>>| async {
        Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
    })
}

fn req(method: Method, path: &str, tenant: &str) -> Request<Full<Bytes>> {
    let mut r = Request::builder()
        .method(method)
        .uri(path)
        .header("x-tenant", tenant)
        .body(Full::default())
        .unwrap();
    r.extensions_mut()
        .insert("192.0.2.1:1".parse::<SocketAddr>().unwrap());
    r
}

fn generous(name: &str) -> Policy {
    Policy::new(name, Quota::per_second(1000).burst(1000))
}

async fn status<S>(svc: &mut S) -> u16
where
    S: Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>>,
    S::Error: std::fmt::Debug,
{
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(req(Method::GET, "/", "t"))
        .await
        .unwrap();
    res.status().as_u16()
}

async fn policy_and_q<S>(svc: &mut S, r: Request<Full<Bytes>>) -> (String, u32)
where
    S: Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>>,
    S::Error: std::fmt::Debug,
{
    let res = svc.ready().await.unwrap().call(r).await.unwrap();
    let v = res.headers()["ratelimit-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    let name = v.split('"').nth(1).unwrap().to_owned();
    let q = v
        .split(";q=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (name, q)
}

async fn policy_of<S>(svc: &mut S, r: Request<Full<Bytes>>) -> String
where
    S: Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>>,
    S::Error: std::fmt::Debug,
{
    policy_and_q(svc, r).await.0
}

#[tokio::test]
async fn highest_priority_match_wins() {
    let rules = RuleSet::new(generous("default"))
        .policy(generous("pro"))
        .policy(generous("login"))
        .policy(generous("vip"))
        .policy(generous("writes"))
        .policy(generous("first"))
        .policy(generous("second"))
        .tier("t-pro", "pro")
        .rule(Rule::new(10, "pro").tier("pro"))
        .rule(Rule::new(50, "login").path_prefix("/login"))
        .rule(Rule::new(100, "vip").tenant("t-vip"))
        .rule(
            Rule::new(20, "writes")
                .method(Method::POST)
                .path_prefix("/api"),
        )
        .rule(Rule::new(5, "first").when(|r| r.uri().query() == Some("tie")))
        .rule(Rule::new(5, "second").when(|r| r.uri().query() == Some("tie")));
    let layer = RateLimitLayer::builder()
        .rules(rules)
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    let cases = [
        (Method::GET, "/api", "anyone", "default"),
        (Method::GET, "/api", "t-pro", "pro"),
        (Method::GET, "/login", "t-pro", "login"),
        (Method::GET, "/login", "t-vip", "vip"),
        (Method::POST, "/api/items", "t-pro", "writes"),
        (Method::POST, "/other", "anyone", "default"),
        (Method::GET, "/x?tie", "anyone", "first"),
    ];
    for (method, path, tenant, expected) in cases {
        assert_eq!(
            policy_of(&mut svc, req(method.clone(), path, tenant)).await,
            expected,
            "{method} {path} as {tenant}"
        );
    }
}

/// IP tenants match the keys the IP extractors give: an IPv6 address its /64.
#[tokio::test]
async fn ip_tenants_match_grouped_ipv6_keys() {
    use tollgate::key::ClientIp;
    let from = |peer: &str| {
        let mut r = Request::get("/").body(Full::default()).unwrap();
        r.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        r
    };
    let rules = || {
        RuleSet::new(generous("free"))
            .policy(generous("vip"))
            .policy(generous("net"))
            .rule(Rule::new(10, "vip").tenant("2001:db8::1"))
            .rule(Rule::new(10, "vip").tenant("192.0.2.7"))
            .rule(Rule::new(5, "net").tenant("2001:db8:aa00::"))
    };
    let layer = RateLimitLayer::builder()
        .rules(rules())
        .key(ClientIp::new())
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    for (peer, expected) in [
        ("[2001:db8::1]:1", "vip"),
        // The same /64: the same key, so the same tenant.
        ("[2001:db8::2]:1", "vip"),
        ("[2001:db8:0:1::1]:1", "free"),
        ("192.0.2.7:1", "vip"),
        ("192.0.2.8:1", "free"),
        ("[2001:db8:aa00:ff::1]:1", "free"),
    ] {
        assert_eq!(policy_of(&mut svc, from(peer)).await, expected, "{peer}");
    }
    // Grouped by /56, a client anywhere in 2001:db8:aa00::/56 is that tenant.
    let layer = RateLimitLayer::builder()
        .rules(rules())
        .key(ClientIp::new().ipv6_prefix(56))
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    assert_eq!(
        policy_of(&mut svc, from("[2001:db8:aa00:ff::1]:1")).await,
        "net"
    );
}

#[tokio::test]
async fn invalid_updates_are_rejected_and_the_old_rules_stay() {
    let layer = RateLimitLayer::builder()
        .rules(RuleSet::new(generous("a")))
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let handle = layer.rules_handle().unwrap();
    let mut svc = layer.layer(ok_service());
    let invalid = [
        RuleSet::new(generous("b")).rule(Rule::new(1, "missing")),
        RuleSet::new(Policy::new("b", Quota::per_second(0))),
        RuleSet::new(Policy::new("bad name", Quota::per_second(1))),
    ];
    for set in invalid {
        assert!(handle.replace(set).is_err());
        assert_eq!(policy_of(&mut svc, req(Method::GET, "/", "t")).await, "a");
        assert_eq!(handle.current().default_policy(), "a");
    }
    // A fixed-policy layer has no handle.
    let fixed = RateLimitLayer::builder()
        .policy(generous("x"))
        .build()
        .unwrap();
    assert!(fixed.rules_handle().is_none());
}

#[tokio::test]
async fn raising_a_limit_applies_to_the_next_request_of_a_denied_key() {
    let layer = RateLimitLayer::builder()
        .rules(RuleSet::new(Policy::new("api", Quota::per_hour(1))))
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let handle = layer.rules_handle().unwrap();
    let mut svc = layer.layer(ok_service());
    assert_eq!(status(&mut svc).await, 200);
    assert_eq!(status(&mut svc).await, 429);
    handle
        .replace(RuleSet::new(Policy::new("api", Quota::per_hour(100))))
        .unwrap();
    assert_eq!(status(&mut svc).await, 200);
}

/// Requests racing rule updates see one whole rule set or the other, and none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_updates_under_concurrent_load() {
    // The two sets differ in names *and* quotas, so a request served by the rules of one set
    // and the policies of the other would show a mismatched name and `q`.
    let set = |tag: &str| {
        let q = if tag == "a" { 1000 } else { 2000 };
        let p = |name: String| Policy::new(name, Quota::per_second(q).burst(q));
        RuleSet::new(p(format!("{tag}-default")))
            .policy(p(format!("{tag}-search")))
            .rule(Rule::new(1, format!("{tag}-search")).path_prefix("/search"))
    };
    let layer = RateLimitLayer::builder()
        .rules(set("a"))
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let handle = layer.rules_handle().unwrap();
    let svc = layer.layer(ok_service());
    let flipper = tokio::spawn(async move {
        for i in 0..200 {
            handle
                .replace(set(if i % 2 == 0 { "b" } else { "a" }))
                .unwrap();
            tokio::task::yield_now().await;
        }
    });
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let mut svc = svc.clone();
            tokio::spawn(async move {
                let mut seen = 0;
                for i in 0..500 {
                    let path = if i % 2 == 0 { "/search" } else { "/" };
                    let tenant = format!("w{w}-{i}");
                    let (name, q) = policy_and_q(&mut svc, req(Method::GET, path, &tenant)).await;
                    let expected_suffix = if path == "/search" {
                        "-search"
                    } else {
                        "-default"
                    };
                    assert!(name.ends_with(expected_suffix), "{path} got {name}");
                    match &name[..2] {
                        "a-" => assert_eq!(q, 1000, "{name}"),
                        "b-" => assert_eq!(q, 2000, "{name}"),
                        _ => panic!("{name}"),
                    }
                    seen += 1;
                }
                seen
            })
        })
        .collect();
    let mut total = 0;
    for w in workers {
        total += w.await.unwrap();
    }
    flipper.await.unwrap();
    assert_eq!(total, 2000);
}

#[tokio::test]
async fn shadow_mode_never_rejects_but_records_would_be_denials() {
    let (captured, _guard) = support::Logs::capture();

    for rules in [
        // Per policy...
        RuleSet::new(Policy::new("new-limit", Quota::per_hour(2)).shadow(true)),
        // ...or for the whole rule set.
        RuleSet::new(Policy::new("new-limit", Quota::per_hour(2))).shadow(true),
    ] {
        let layer = RateLimitLayer::builder()
            .rules(rules)
            .key(Header::new("x-tenant"))
            .build()
            .unwrap();
        let mut svc = layer.layer(ok_service());
        for _ in 0..5 {
            let res = svc
                .ready()
                .await
                .unwrap()
                .call(req(Method::GET, "/", "t"))
                .await
                .unwrap();
            assert_eq!(res.status(), 200);
        }
    }
    let logs = captured.text();
    let would = logs.matches("would have been rate limited").count();
    assert_eq!(would, 6, "3 would-be denials per layer:\n{logs}");
    assert!(logs.contains("policy=\"new-limit\""), "{logs}");
}

/// A path prefix matches whole segments: `/login` is not a prefix of `/loginfoo`.
#[tokio::test]
async fn path_prefixes_match_whole_segments() {
    let rules = RuleSet::new(generous("default"))
        .policy(generous("login"))
        .policy(generous("api"))
        .policy(generous("root"))
        .rule(Rule::new(10, "login").path_prefix("/login"))
        .rule(Rule::new(10, "api").path_prefix("/api/"));
    let layer = RateLimitLayer::builder()
        .rules(rules)
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    for (path, expected) in [
        ("/login", "login"),
        ("/login/", "login"),
        ("/login/2fa", "login"),
        ("/login?next=/", "login"),
        ("/loginfoo", "default"),
        ("/log", "default"),
        ("/Login", "default"),
        ("/x/login", "default"),
        // A trailing `/` in the prefix changes nothing.
        ("/api", "api"),
        ("/api/", "api"),
        ("/api/items/7", "api"),
        ("/apix", "default"),
        ("/", "default"),
    ] {
        assert_eq!(
            policy_of(&mut svc, req(Method::GET, path, "t")).await,
            expected,
            "{path}"
        );
    }
    // `/` matches every path.
    let layer = RateLimitLayer::builder()
        .rules(
            RuleSet::new(generous("default"))
                .policy(generous("root"))
                .rule(Rule::new(1, "root").path_prefix("/")),
        )
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    for path in ["/", "/a", "/a/b/"] {
        assert_eq!(
            policy_of(&mut svc, req(Method::GET, path, "t")).await,
            "root",
            "{path}"
        );
    }
}

/// axum answers HEAD with the GET handler: a GET limit must count HEAD requests too, or
/// they bypass it. Served over TCP, as a client would see it.
#[tokio::test]
async fn get_rules_cover_head_requests_over_http() {
    use axum::Router;
    use axum::routing::get;

    let rules = RuleSet::new(generous("default"))
        .policy(Policy::new("export", Quota::per_hour(1)))
        .rule(
            Rule::new(10, "export")
                .method(Method::GET)
                .path_prefix("/export"),
        );
    let limit = RateLimitLayer::builder()
        .rules(rules)
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/export",
            get(|| async { "expensive\n" }).post(|| async { "posted\n" }),
        )
        .layer(limit);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/export");
    let send = |method: reqwest::Method, tenant: &'static str| {
        client
            .request(method, &url)
            .header("x-tenant", tenant)
            .send()
    };

    // The handler runs for HEAD: the request counts against the GET rule...
    let res = send(reqwest::Method::HEAD, "a").await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(
        res.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .starts_with(r#""export";q=1;"#),
        "{:?}",
        res.headers()
    );
    // ...so neither GET nor HEAD gets a second one this hour.
    assert_eq!(send(reqwest::Method::GET, "a").await.unwrap().status(), 429);
    assert_eq!(
        send(reqwest::Method::HEAD, "a").await.unwrap().status(),
        429
    );
    // The other way round too.
    assert_eq!(send(reqwest::Method::GET, "b").await.unwrap().status(), 200);
    assert_eq!(
        send(reqwest::Method::HEAD, "b").await.unwrap().status(),
        429
    );
    // Other methods stay outside the rule.
    assert_eq!(
        send(reqwest::Method::POST, "a").await.unwrap().status(),
        200
    );
}

/// Typos are errors from `build()` and from the rules handle, and an update with one leaves
/// the old rules in force.
#[tokio::test]
async fn typos_are_rejected_by_build_and_by_the_handle() {
    let typos = || {
        let base = || {
            RuleSet::new(generous("a"))
                .policy(generous("b"))
                .tier("t-pro", "pro")
        };
        [
            (
                base().rule(Rule::new(1, "b").method(Method::from_bytes(b"PSOT").unwrap())),
                "method \"PSOT\"",
            ),
            (base().rule(Rule::new(2, "b").tier("por")), "tier \"por\""),
            (
                base().rule(Rule::new(3, "b").path_prefix("login")),
                "path_prefix \"login\"",
            ),
        ]
    };
    for (i, (set, expected)) in typos().into_iter().enumerate() {
        let err = RateLimitLayer::builder()
            .rules(set)
            .key(Header::new("x-tenant"))
            .build()
            .unwrap_err()
            .to_string();
        let rule = format!("rules[0] (priority {})", i + 1);
        assert!(err.contains(&rule) && err.contains(expected), "{err}");
    }
    let layer = RateLimitLayer::builder()
        .rules(RuleSet::new(generous("a")))
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let handle = layer.rules_handle().unwrap();
    let mut svc = layer.layer(ok_service());
    for (set, expected) in typos() {
        let err = handle.replace(set).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
        assert_eq!(policy_of(&mut svc, req(Method::GET, "/", "t")).await, "a");
        assert!(handle.current().rules().is_empty());
    }
}

/// An extension method is accepted once declared, and matched exactly.
#[tokio::test]
async fn declared_extension_methods_match() {
    let layer = RateLimitLayer::builder()
        .rules(RuleSet::new(generous("a")))
        .key(Header::new("x-tenant"))
        .build()
        .unwrap();
    let handle = layer.rules_handle().unwrap();
    let mut svc = layer.layer(ok_service());
    let purge = Method::from_bytes(b"PURGE").unwrap();
    handle
        .replace(
            RuleSet::new(generous("a"))
                .policy(generous("b"))
                .extension_method(purge.clone())
                .rule(Rule::new(1, "b").method(purge.clone())),
        )
        .unwrap();
    assert_eq!(policy_of(&mut svc, req(purge, "/", "t")).await, "b");
    assert_eq!(policy_of(&mut svc, req(Method::GET, "/", "t")).await, "a");
    // Methods are case-sensitive: `purge` is another method.
    let lower = Method::from_bytes(b"purge").unwrap();
    assert_eq!(policy_of(&mut svc, req(lower, "/", "t")).await, "a");
}

/// Tenants and tiers name keys of the first branch of an `or` chain only: a client cannot claim
/// a tenant's policy (a premium tier) by sending its name where the fallback reads.
#[tokio::test]
async fn a_fallback_key_never_claims_a_tenants_policy() {
    use tollgate::key::{Extension, KeyExtractorExt};
    let rules = RuleSet::new(generous("free"))
        .policy(generous("gold"))
        .tier("alice", "gold")
        .rule(Rule::new(5, "gold").tier("gold"));
    let layer = RateLimitLayer::builder()
        .rules(rules)
        .key(Extension::<String>::new().or(Header::new("x-api-key")))
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    let mut user = req(Method::GET, "/", "");
    user.extensions_mut().insert("alice".to_owned());
    assert_eq!(policy_of(&mut svc, user).await, "gold");
    let mut anonymous = req(Method::GET, "/", "");
    anonymous
        .headers_mut()
        .insert("x-api-key", "alice".parse().unwrap());
    assert_eq!(policy_of(&mut svc, anonymous).await, "free");
}
