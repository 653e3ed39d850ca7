//! End-to-end tests over a real TCP listener with a real HTTP client.

use std::net::SocketAddr;
use std::time::Duration;

use axum::{Router, routing::get};
use tollgate::key::{ClientIp, ForwardedHeader, Header, KeyExtractorExt};
use tollgate::{HeaderStyle, OnMissingKey, Policy, Quota, RateLimitLayer};

/// Serves `app` on a free port, recording peer addresses unless `connect_info` is false.
async fn serve(app: Router, connect_info: bool) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        if connect_info {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap();
        } else {
            axum::serve(listener, app).await.unwrap();
        }
    });
    format!("http://{addr}")
}

fn app(
    layer: RateLimitLayer<impl tollgate::KeyExtractor + Clone, tollgate::backend::LocalBackend>,
) -> Router {
    Router::new()
        .route(
            "/limited",
            get(|| async { "ok" }).post(|| async { "posted" }),
        )
        .route_layer(layer)
        .route("/free", get(|| async { "free" }))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// A quota that does not refill during a test: exactly `burst` requests pass.
fn no_refill(burst: u32) -> Quota {
    Quota::per_day(1).burst(burst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_one_key_allow_exactly_the_burst() {
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(50)))
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    let tasks: Vec<_> = (0..500)
        .map(|_| {
            let client = client.clone();
            let url = format!("{base}/limited");
            tokio::spawn(async move { client.get(url).send().await.unwrap().status().as_u16() })
        })
        .collect();
    let mut ok = 0;
    let mut limited = 0;
    for t in tasks {
        match t.await.unwrap() {
            200 => ok += 1,
            429 => limited += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((ok, limited), (50, 450));
    // Unlimited routes are untouched.
    let res = client.get(format!("{base}/free")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(res.headers().get("ratelimit").is_none());
}

/// Parses `"name";r=R;t=T` items.
fn parse_ratelimit(v: &str) -> Vec<(String, u64, u64)> {
    v.split(", ")
        .map(|item| {
            let mut parts = item.split(';');
            let name = parts.next().unwrap();
            assert!(name.starts_with('"') && name.ends_with('"'), "{item}");
            let mut r = None;
            let mut t = None;
            for p in parts {
                let (k, v) = p.split_once('=').unwrap();
                let v: u64 = v
                    .parse()
                    .unwrap_or_else(|_| panic!("not an integer: {item}"));
                match k {
                    "r" => r = Some(v),
                    "t" => t = Some(v),
                    _ => panic!("unknown parameter in {item}"),
                }
            }
            (name.trim_matches('"').to_owned(), r.unwrap(), t.unwrap())
        })
        .collect()
}

#[tokio::test]
async fn headers_follow_the_ietf_draft_and_retry_after_is_never_zero() {
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", Quota::per_second(5).burst(3)).and(Quota::per_hour(100)))
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    for expected in [2, 1, 0] {
        let res = client.get(format!("{base}/limited")).send().await.unwrap();
        assert_eq!(res.status(), 200);
        let h = res.headers();
        assert_eq!(
            h["ratelimit-policy"],
            r#""api-0";q=3;w=1, "api-1";q=100;w=3600"#
        );
        let items = parse_ratelimit(h["ratelimit"].to_str().unwrap());
        assert_eq!(items[0].0, "api-0");
        assert_eq!(items[0].1, expected);
        assert_eq!(items[1].1, 99 - (2 - expected));
        assert!(items[0].2 >= 1);
        assert!(h.get("retry-after").is_none());
    }
    let res = client.get(format!("{base}/limited")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // The wait is 200 ms: rounded up to a whole second, never 0.
    assert_eq!(retry, 1);
    let items = parse_ratelimit(res.headers()["ratelimit"].to_str().unwrap());
    assert_eq!(
        items.len(),
        1,
        "the local backend stops at the denying quota"
    );
    assert_eq!(items[0].1, 0);
    // The draft: Retry-After should not point earlier than the reset parameter.
    assert!(items[0].2 <= retry, "t={} Retry-After={retry}", items[0].2);
    assert_eq!(res.headers()["content-type"], "text/plain; charset=utf-8");
    assert!(res.text().await.unwrap().starts_with("Too Many Requests"));
}

#[tokio::test]
async fn legacy_and_no_headers() {
    for (style, ietf, legacy) in [
        (HeaderStyle::Legacy, false, true),
        (HeaderStyle::Both, true, true),
        (HeaderStyle::None, false, false),
    ] {
        let layer = RateLimitLayer::builder()
            .policy(Policy::new("api", no_refill(2)))
            .headers(style)
            .build()
            .unwrap();
        let base = serve(app(layer), true).await;
        let res = client()
            .get(format!("{base}/limited"))
            .send()
            .await
            .unwrap();
        let h = res.headers();
        assert_eq!(h.contains_key("ratelimit"), ietf);
        assert_eq!(h.contains_key("x-ratelimit-remaining"), legacy);
        if legacy {
            assert_eq!(h["x-ratelimit-limit"], "2");
            assert_eq!(h["x-ratelimit-remaining"], "1");
        }
    }
}

#[tokio::test]
async fn spoofed_forwarding_headers_from_an_untrusted_peer_stay_limited() {
    // Trusts 10.0.0.0/8 only; the test client connects from 127.0.0.1.
    let key = ClientIp::new().trust_proxies(["10.0.0.0/8"]).unwrap();
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(3)))
        .key(key)
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    let mut statuses = Vec::new();
    for i in 0..6 {
        let res = client
            .get(format!("{base}/limited"))
            .header("x-forwarded-for", format!("203.0.113.{i}"))
            .header("x-real-ip", format!("198.51.100.{i}"))
            .header("forwarded", format!("for=192.0.2.{i}"))
            .send()
            .await
            .unwrap();
        statuses.push(res.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

#[tokio::test]
async fn trusted_proxy_forwarding_headers_pick_the_client() {
    let key = ClientIp::new().trust_proxies(["127.0.0.1/32"]).unwrap();
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(1)))
        .key(key)
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    let get = |xff: &'static str| {
        let client = client.clone();
        let url = format!("{base}/limited");
        async move {
            client
                .get(url)
                .header("x-forwarded-for", xff)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(get("203.0.113.1").await, 200);
    assert_eq!(get("203.0.113.1").await, 429);
    // Another client behind the same proxy has its own bucket...
    assert_eq!(get("203.0.113.2").await, 200);
    // ...and a client cannot escape by prepending addresses: the rightmost untrusted hop counts.
    assert_eq!(get("1.1.1.1, 203.0.113.2").await, 429);
}

#[tokio::test]
async fn several_x_real_ip_lines_cannot_pick_a_fresh_bucket() {
    // The test client is the "proxy" (127.0.0.1), one that appends X-Real-IP rather than
    // replacing it: the client's own line comes first, the proxy's last.
    let key = ClientIp::new()
        .trust_proxies(["127.0.0.1/32"])
        .unwrap()
        .forwarded_header(ForwardedHeader::XRealIp);
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(1)))
        .key(key)
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    let mut statuses = Vec::new();
    for i in 0..3 {
        let res = client
            .get(format!("{base}/limited"))
            .header("x-real-ip", format!("198.51.100.{i}"))
            .header("x-real-ip", "203.0.113.1")
            .send()
            .await
            .unwrap();
        statuses.push(res.status().as_u16());
    }
    // Neither line is believed: all three share the proxy's bucket.
    assert_eq!(statuses, [200, 429, 429]);
    let status = |value: &'static str| {
        let req = client
            .get(format!("{base}/limited"))
            .header("x-real-ip", value);
        async move { req.send().await.unwrap().status().as_u16() }
    };
    // A comma-separated value is not an address either: the proxy's bucket.
    assert_eq!(status("198.51.100.9, 203.0.113.1").await, 429);
    // One line with one address is the client's own bucket.
    assert_eq!(status("203.0.113.1").await, 200);
    assert_eq!(status("203.0.113.1").await, 429);
}

#[tokio::test]
async fn forwarded_obfuscated_ports_keep_ipv4_clients_apart() {
    let key = ClientIp::new()
        .trust_proxies(["127.0.0.1/32"])
        .unwrap()
        .forwarded_header(ForwardedHeader::Forwarded);
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(1)))
        .key(key)
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    let status = |value: &'static str| {
        let req = client
            .get(format!("{base}/limited"))
            .header("forwarded", value);
        async move { req.send().await.unwrap().status().as_u16() }
    };
    // Two clients behind the proxy, each with an obfuscated port: separate buckets.
    assert_eq!(status(r#"for="203.0.113.1:_a1";proto=http"#).await, 200);
    assert_eq!(status(r#"for="203.0.113.2:_b2";proto=http"#).await, 200);
    // The same client on another (obfuscated or numeric) port: its own, used bucket.
    assert_eq!(status(r#"for="203.0.113.1:_c3""#).await, 429);
    assert_eq!(status(r#"for="203.0.113.2:4711""#).await, 429);
    assert_eq!(status(r#"for="[2001:db8::1]:_x""#).await, 200);
    // A malformed port is unreadable: the proxy's bucket, shared.
    assert_eq!(status(r#"for="203.0.113.3:_""#).await, 200);
    assert_eq!(status(r#"for="203.0.113.4:99999""#).await, 429);
}

#[tokio::test]
async fn missing_connect_info_is_a_clear_error_or_allowed_as_configured() {
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(1)))
        .build()
        .unwrap();
    let base = serve(app(layer), false).await;
    let res = client()
        .get(format!("{base}/limited"))
        .send()
        .await
        .unwrap();
    // The server's setup is at fault, not the client: 500, and the explanation only in the
    // server's log.
    assert_eq!(res.status(), 500);
    let body = res.text().await.unwrap();
    assert_eq!(body, "Internal Server Error\n");

    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(1)))
        .on_missing_key(OnMissingKey::Allow)
        .build()
        .unwrap();
    let base = serve(app(layer), false).await;
    for _ in 0..3 {
        let res = client()
            .get(format!("{base}/limited"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        assert!(res.headers().get("ratelimit").is_none());
    }
}

#[tokio::test]
async fn api_key_falls_back_to_client_ip() {
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(1)))
        .key(Header::new("x-api-key").or(ClientIp::new()))
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    let status = |key: Option<&'static str>| {
        let mut req = client.get(format!("{base}/limited"));
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        async move { req.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(status(Some("a")).await, 200);
    assert_eq!(status(Some("a")).await, 429);
    assert_eq!(status(Some("b")).await, 200);
    assert_eq!(status(None).await, 200);
    assert_eq!(status(None).await, 429);
    // Over-long keys are refused (the missing-key status), not silently keyed by the IP.
    let long: &'static str = Box::leak("k".repeat(10_000).into_boxed_str());
    assert_eq!(status(Some(long)).await, 400);
}

#[tokio::test]
async fn problem_json_and_cost_larger_than_burst() {
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("upload", no_refill(3)).cost_fn(|req| {
            if req.method() == http::Method::POST {
                5
            } else {
                1
            }
        }))
        .problem_json()
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    // Cost 5 never fits a burst of 3: 413 without Retry-After, the bucket's real (full)
    // state, and nothing consumed.
    let res = client.post(format!("{base}/limited")).send().await.unwrap();
    assert_eq!(res.status(), 413);
    assert!(res.headers().get("retry-after").is_none());
    assert_eq!(res.headers()["ratelimit"], r#""upload";r=3;t=0"#);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let body = res.text().await.unwrap();
    assert!(body.contains(r#""title":"Payload Too Large""#), "{body}");
    assert!(
        body.contains(r#""detail":"this request costs more"#),
        "{body}"
    );
    assert!(body.contains(r#""violated-policies":["upload"]"#), "{body}");
    for _ in 0..3 {
        assert_eq!(
            client
                .get(format!("{base}/limited"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    }
    let res = client.get(format!("{base}/limited")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    let body = res.text().await.unwrap();
    assert!(body.contains(r#""retry-after":"#), "{body}");
}

/// gRPC requests get a trailers-only `RESOURCE_EXHAUSTED` in their own flavour: gRPC-web
/// requests (a browser client) are answered in gRPC-web, not plain gRPC.
#[tokio::test]
async fn grpc_requests_get_a_trailers_only_resource_exhausted() {
    for content_type in ["application/grpc+proto", "application/grpc-web+proto"] {
        let layer = RateLimitLayer::builder()
            .policy(Policy::new("rpc", no_refill(1)))
            .build()
            .unwrap();
        let base = serve(app(layer), true).await;
        let client = client();
        let send = || {
            client
                .post(format!("{base}/limited"))
                .header("content-type", content_type)
                .send()
        };
        assert_eq!(send().await.unwrap().status(), 200);
        let res = send().await.unwrap();
        // gRPC status travels in a 200 response's headers.
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["grpc-status"], "8");
        assert_eq!(res.headers()["content-type"], content_type);
        assert!(res.headers().contains_key("grpc-message"));
        assert!(res.bytes().await.unwrap().is_empty());
    }
}

#[tokio::test]
async fn custom_rejection_response() {
    let layer = RateLimitLayer::builder()
        .policy(Policy::new("api", no_refill(1)))
        .rejection_response(|r| {
            http::Response::builder()
                .status(r.status)
                .header("content-type", "application/json")
                .body(bytes::Bytes::from(format!(
                    r#"{{"policy":"{}"}}"#,
                    r.policy
                )))
                .unwrap()
        })
        .build()
        .unwrap();
    let base = serve(app(layer), true).await;
    let client = client();
    client.get(format!("{base}/limited")).send().await.unwrap();
    let res = client.get(format!("{base}/limited")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    assert!(res.headers().contains_key("retry-after"));
    assert!(res.headers().contains_key("ratelimit"));
    assert_eq!(res.text().await.unwrap(), r#"{"policy":"api"}"#);
}
