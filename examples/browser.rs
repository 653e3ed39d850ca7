//! A browser page calling a rate-limited API on another origin, reading its quota from the
//! `RateLimit` fields and counting down from `Retry-After` when refused.
//!
//! Run with: `cargo run --example browser`, then open <http://localhost:8080>.
//!
//! - The API listens on `PORT` (default 3000): `GET /api/hello`, limited like the quickstart
//!   (5 per second, bursts of 10, per client IP). CORS allows the origin in `ALLOW_ORIGIN`
//!   (default `http://localhost:8080`; `*` allows any, a comma-separated list several) and
//!   exposes the rate-limit fields, on allowed and refused responses alike.
//! - The page listens on `PAGE_PORT` (default 8080): one HTML page, another origin (another
//!   port), whose script calls the API on the same host name and `PORT`. It shows the quota
//!   left after each call, and a countdown from `Retry-After` once refused. `/?calls=N` makes
//!   `N` calls in a row when the page loads (what the browser test does).
//!
//! The layer order is what makes a `429` readable across origins: CORS outside, the limit
//! inside (see `tollgate::cors`). With the limit outside, the browser would see a network
//! error instead of the `429`.

use std::net::SocketAddr;

use axum::Router;
use axum::http::{HeaderValue, Method};
use axum::response::Html;
use axum::routing::get;
use tollgate::key::ClientIp;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower_http::cors::{AllowOrigin, CorsLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port = env_port("PORT", 3000)?;
    let page_port = env_port("PAGE_PORT", 8080)?;
    let allow_origin =
        std::env::var("ALLOW_ORIGIN").unwrap_or_else(|_| "http://localhost:8080".into());

    let api_listener = tokio::net::TcpListener::bind(("0.0.0.0", port)).await?;
    let page_listener = tokio::net::TcpListener::bind(("0.0.0.0", page_port)).await?;
    println!("API on http://localhost:{port}/api/hello (CORS for {allow_origin})");
    println!("page on http://localhost:{page_port}");
    let api = api(&allow_origin)?;
    let page = page(port);
    tokio::try_join!(
        // The client IP is the TCP peer's, which `ClientIp` reads from the connection info.
        axum::serve(
            api_listener,
            api.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .into_future(),
        axum::serve(page_listener, page).into_future(),
    )?;
    Ok(())
}

fn env_port(name: &str, default: u16) -> Result<u16, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name}={v:?} is not a port number")),
        Err(_) => Ok(default),
    }
}

/// The API: `GET /api/hello`, limited, inside a CORS layer that allows `allow_origin` (`*`, one
/// origin, or several separated by commas).
pub(crate) fn api(allow_origin: &str) -> Result<Router, Box<dyn std::error::Error>> {
    api_on(allow_origin, tollgate::backend::LocalBackend::new())
}

/// The API on `backend` (the tests give it one whose clock stands still).
pub(crate) fn api_on<B: tollgate::backend::Backend>(
    allow_origin: &str,
    backend: B,
) -> Result<Router, Box<dyn std::error::Error>> {
    let origins = if allow_origin.trim() == "*" {
        AllowOrigin::any()
    } else {
        let list = allow_origin
            .split(',')
            .map(|o| HeaderValue::from_str(o.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| format!("ALLOW_ORIGIN={allow_origin:?} is not a list of origins"))?;
        AllowOrigin::list(list)
    };
    let cors = CorsLayer::new()
        .allow_origin(origins)
        .allow_methods([Method::GET])
        .expose_headers(tollgate::cors::EXPOSE_HEADERS);
    let limit = RateLimitLayer::builder()
        .backend(backend)
        .policy(Policy::new("api", Quota::per_second(5).burst(10)))
        .key(ClientIp::new())
        .build()?;
    Ok(Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .layer(limit) // inside: its 429s go out through the CORS layer
        .layer(cors)) // outside: CORS headers on every response; preflights spend nothing
}

/// The page, calling the API on the page's own host name and `api_port`.
pub(crate) fn page(api_port: u16) -> Router {
    let html = PAGE.replace("{{API_PORT}}", &api_port.to_string());
    Router::new().route("/", get(move || async move { Html(html) }))
}

const PAGE: &str = r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>tollgate: a rate-limited API from the browser</title>
<style>
  body { font: 16px/1.5 system-ui, sans-serif; max-width: 40em; margin: 2em auto; }
  #status { font-size: 1.4em; }
  .refused { color: #b00; }
  pre { background: #f4f4f4; padding: .5em; }
</style>
</head>
<body>
<h1>GET /api/hello</h1>
<p id="status">No call yet.</p>
<p><button id="call">Call the API</button></p>
<p>Quota left: <strong id="remaining">?</strong> of <span id="limit">?</span>
   <span id="countdown"></span></p>
<pre id="log"></pre>
<script>
const api = `${location.protocol}//${location.hostname}:{{API_PORT}}/api/hello`;
const $ = (id) => document.getElementById(id);
let timer = null;

// `"api";r=9;t=1` -> { r: 9, t: 1 } (the first item; enough for one policy).
function params(field) {
  const out = {};
  if (!field) return out;
  for (const p of field.split(",")[0].split(";").slice(1)) {
    const [k, v] = p.trim().split("=");
    out[k] = Number(v);
  }
  return out;
}

function countdown(seconds) {
  clearInterval(timer);
  const button = $("call");
  button.disabled = true;
  let left = seconds;
  const show = () => {
    $("countdown").textContent = left > 0 ? `(try again in ${left} s)` : "";
    if (left <= 0) { clearInterval(timer); button.disabled = false; }
    left -= 1;
  };
  show();
  timer = setInterval(show, 1000);
}

async function call() {
  let res;
  try {
    res = await fetch(api);
  } catch (e) {
    // A response without CORS headers (or no response) is all the script can see of a refusal
    // made outside the CORS layer.
    $("status").textContent = "network error";
    $("log").textContent += "network-error\n";
    return;
  }
  const limit = res.headers.get("RateLimit");
  const policy = res.headers.get("RateLimit-Policy");
  const retryAfter = res.headers.get("Retry-After");
  const r = params(limit), q = params(policy);
  $("remaining").textContent = r.r ?? "?";
  $("limit").textContent = q.q ?? "?";
  if (res.status === 429) {
    $("status").textContent = "Too many requests";
    $("status").className = "refused";
    countdown(Number(retryAfter));
  } else {
    $("status").textContent = (await res.text()).trim();
    $("status").className = "";
  }
  // One line per call, for people and for the browser test: status, then each field as the
  // script could read it ("-" when hidden from it).
  $("log").textContent +=
    `${res.status} ratelimit=${limit ?? "-"} policy=${policy ?? "-"} retry-after=${retryAfter ?? "-"}\n`;
}

$("call").addEventListener("click", call);
const calls = Number(new URLSearchParams(location.search).get("calls") ?? 0);
(async () => {
  for (let i = 0; i < calls; i++) await call();
  document.body.dataset.done = "true";
})();
</script>
</body>
</html>
"#;
