//! The `browser` example in a real browser: headless Chromium loads the page from one origin,
//! its script calls the rate-limited API on another, and the test reads back, from the page's
//! DOM, what the script could see: statuses, the `RateLimit` / `RateLimit-Policy` fields and
//! `Retry-After`, on allowed and refused responses.
//!
//! Needs Debian's `chromium` (`./scripts/test.sh` installs it; `CHROMIUM` names another
//! binary).

#[allow(dead_code)]
#[path = "../examples/browser.rs"]
mod example;
mod support;

use std::process::Command;

use axum::Router;
use axum::http::{HeaderValue, Method};
use axum::routing::get;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower_http::cors::CorsLayer;

async fn serve(app: Router) -> u16 {
    support::serve(app).await.port()
}

/// The page's DOM after Chromium loaded `url` and its script ran (`--dump-dom`). Chromium runs
/// in its own process, off the test's runtime, so the servers keep answering it.
async fn load(url: String) -> String {
    tokio::task::spawn_blocking(move || {
        let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "chromium".into());
        let profile = tempfile::tempdir().unwrap();
        let out = Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                // Virtual time waits for the page's fetches, then runs its timers 500 ms on.
                "--virtual-time-budget=500",
                "--dump-dom",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(&url)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `{chromium}` ({e}): install it (Debian: apt-get install \
                     chromium), or run ./scripts/test.sh, which does"
                )
            });
        assert!(out.status.success(), "chromium failed on {url}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    })
    .await
    .unwrap()
}

/// The page's log: one line per call, as its script saw the response.
fn log(dom: &str) -> Vec<String> {
    assert!(
        dom.contains(r#"data-done="true""#),
        "the page's script did not finish: {dom}"
    );
    let start = dom.find(r#"<pre id="log">"#).expect("the page has a log") + 14;
    let end = start + dom[start..].find("</pre>").unwrap();
    dom[start..end]
        .lines()
        .map(|l| l.replace("&quot;", "\""))
        .collect()
}

/// The API on one port, the page on another: two origins. `allow` is the API's
/// `ALLOW_ORIGIN`, given the page's origin.
async fn page_and_api(allow: impl FnOnce(&str) -> String) -> String {
    let page_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let page_origin = format!(
        "http://127.0.0.1:{}",
        page_listener.local_addr().unwrap().port()
    );
    // The bucket's clock stands still: however slowly the browser calls (a busy machine), no
    // unit comes back between calls.
    let backend = tollgate::backend::LocalBackend::builder()
        .clock(governor::clock::FakeRelativeClock::default())
        .build();
    let api_port = serve(example::api_on(&allow(&page_origin), backend).unwrap()).await;
    let page = example::page(api_port);
    tokio::spawn(async move { axum::serve(page_listener, page).await.unwrap() });
    page_origin
}

#[tokio::test(flavor = "multi_thread")]
async fn a_page_on_another_origin_reads_its_quota_and_the_429s_retry_after() {
    let page = page_and_api(|origin| origin.to_string()).await;
    // The bucket's clock stands still: the burst of 10, then 4 refusals, however slow the
    // browser.
    let dom = load(format!("{page}/?calls=14")).await;
    let log = log(&dom);
    assert_eq!(log.len(), 14, "{log:?}");
    // The burst of 10, each answer's remaining quota readable by the script.
    assert_eq!(
        log[0],
        r#"200 ratelimit="api";r=9;t=1 policy="api";q=10;w=2 retry-after=-"#
    );
    // Every answer, allowed or refused, readable by the script; a 429 outside CORS would be
    // a network error here. A refused call's quota is 0, and it says when to try again.
    for line in &log {
        let allowed = line.starts_with(r#"200 ratelimit="api";r="#)
            && line.ends_with(r#";t=1 policy="api";q=10;w=2 retry-after=-"#);
        let refused = line == r#"429 ratelimit="api";r=0;t=1 policy="api";q=10;w=2 retry-after=1"#;
        assert!(allowed || refused, "{line}");
    }
    let first_refusal = log
        .iter()
        .position(|l| l.starts_with("429 "))
        .unwrap_or_else(|| panic!("no call refused: {log:?}"));
    assert_eq!(first_refusal, 10, "{log:?}");
    assert!(log[10..].iter().all(|l| l.starts_with("429 ")), "{log:?}");
    assert!(
        log[first_refusal - 1].contains(r#"ratelimit="api";r=0;"#),
        "{log:?}"
    );
    // What the user sees after a refusal: no quota left, and the countdown from `Retry-After`.
    assert!(
        dom.contains(r#"<strong id="remaining">0</strong>"#),
        "{dom}"
    );
    assert!(dom.contains("Too many requests"), "{dom}");
    assert!(dom.contains("(try again in 1 s)"), "{dom}");
}

#[tokio::test(flavor = "multi_thread")]
async fn any_origin_when_allow_origin_is_a_star() {
    let page = page_and_api(|_| "*".into()).await;
    let log = log(&load(format!("{page}/?calls=14")).await);
    assert!(log[0].starts_with(r#"200 ratelimit="api";r=9;"#), "{log:?}");
    assert!(log.iter().any(|l| l.starts_with("429 ")), "{log:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_origin_not_allowed_reads_nothing() {
    // The browser, not the server, refuses the script the response: the API answers (and
    // counts) every call, but the page sees network errors only.
    let page = page_and_api(|_| "http://localhost:1".into()).await;
    let log = log(&load(format!("{page}/?calls=2")).await);
    assert_eq!(log, ["network-error", "network-error"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_limit_outside_cors_the_page_cannot_see_its_429() {
    // The wrong order, which `tollgate::cors` warns about: allowed answers pass through the
    // CORS layer, refusals never reach it.
    let page_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let page_port = page_listener.local_addr().unwrap().port();
    let cors = CorsLayer::new()
        .allow_origin(HeaderValue::from_str(&format!("http://127.0.0.1:{page_port}")).unwrap())
        .allow_methods([Method::GET])
        .expose_headers(tollgate::cors::EXPOSE_HEADERS);
    let limit = RateLimitLayer::builder()
        .key(Global)
        .policy(Policy::new("api", Quota::per_hour(2)))
        .build()
        .unwrap();
    let api = Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .layer(cors)
        .layer(limit);
    let api_port = serve(api).await;
    let page = example::page(api_port);
    tokio::spawn(async move { axum::serve(page_listener, page).await.unwrap() });
    let log = log(&load(format!("http://127.0.0.1:{page_port}/?calls=3")).await);
    assert!(log[0].starts_with(r#"200 ratelimit="api";r=1;"#), "{log:?}");
    assert!(log[1].starts_with(r#"200 ratelimit="api";r=0;"#), "{log:?}");
    assert_eq!(log[2], "network-error");
}
