//! A retry storm, and what stops it: an upstream of fixed capacity, offered more than it can
//! take by a fleet of clients that retry.
//!
//! Run with: `cargo run --release --example retry_storm` (the default features).
//!
//! The upstream has 16 workers of 20 ms each (800 calls a second) and answers `503` at once
//! when every worker is busy. `CLIENTS` clients (default 10), each with its own retry budget
//! and throttle as separate processes would have, are offered `RATE` calls a second in total
//! (default 2 400: 3× the capacity), open loop (calls keep coming whatever the answers), each
//! call retried up to `RETRIES` times (3). `MODE` says how they retry:
//!
//! - `naive`: at once, every time (no backoff, no budget), through tollgate's retry layer;
//! - `tower`: tower's plain `tower::retry::RetryLayer` with a policy of up to `RETRIES`
//!   attempts more on `429`/`5xx`/errors (tower has no backoff or budget unless you write
//!   them);
//! - `budget`: `tollgate::client::RetryLayer` (backoff with jitter, at most 10 % of the calls,
//!   at least 1 a second);
//! - `throttle`: `tollgate::client::ThrottleLayer` under retries with backoff and no budget;
//! - `both`: the retry layer over the throttle.
//!
//! `THROTTLE_WINDOW_MS` (250) is the throttle's window. Each call carries its deadline (the
//! SLO from when it was offered) to the upstream in `x-request-timeout-ms`; with
//! `DEADLINES=on` the upstream enforces it (`tollgate::deadline::DeadlineLayer`: work whose
//! caller has given up is dropped), with `off` (the default) it only counts the work that
//! finished after its caller's deadline (`late`). `QUEUE=on` makes the upstream queue calls
//! for a worker instead of answering `503` (as most servers do): there deadlines matter.
//!
//! `RATE` is a number, or a schedule in the form of `examples/adaptive`'s
//! `CAPACITY_SCHEDULE`: `8000@0s,400@20s` offers 8 000 a second, then 400 from the 20th
//! second (a spike that ends). `SECS` (30) is how long it runs, `SLO_MS` (500) how long a
//! caller waits for its call, retries included: goodput is the calls answered `200` within
//! it. `UPSTREAM_URL` sends the calls to an upstream of your own instead (answering `503`
//! when full, as `examples/adaptive` does), so that its own count of what it received can be
//! compared with the clients' `sent`.
//!
//! Each second it prints what was offered, sent (attempts that left the clients), what the
//! upstream received and accepted, the retries, the calls throttled in the clients, and the
//! goodput; at the end, the totals after the first 2 seconds.
//!
//! ```text
//! $ MODE=naive RATE=8000 cargo run --release --example retry_storm
//! $ MODE=both RATE=8000 cargo run --release --example retry_storm
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tollgate::client::{BoxError, RetryBudget, RetryLayer, Throttle, ThrottleLayer, Throttled};
use tollgate::deadline::{Deadline, DeadlineLayer, PropagateDeadlineLayer};
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt};

type Body = Full<Bytes>;
type Call = BoxCloneService<http::Request<Body>, http::Response<hyper::body::Incoming>, BoxError>;

const WORKERS: usize = 16;
const SERVICE: Duration = Duration::from_millis(20);

#[derive(Default)]
struct Counts {
    offered: AtomicU64,
    tries: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    accepted: AtomicU64,
    throttled: AtomicU64,
    good: AtomicU64,
    /// Work the upstream finished after its caller's deadline.
    late: AtomicU64,
}

impl Counts {
    fn take(&self) -> [u64; 8] {
        [
            &self.offered,
            &self.sent,
            &self.received,
            &self.accepted,
            &self.tries,
            &self.throttled,
            &self.good,
            &self.late,
        ]
        .map(|c| c.swap(0, Ordering::Relaxed))
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn number(name: &str, default: &str) -> Result<u64, String> {
    let v = env_or(name, default);
    v.trim()
        .parse()
        .map_err(|_| format!("{name}={v:?} is not a whole number"))
}

/// `RATE`: one number, or `rate@secs,rate@secs`.
fn schedule(text: &str) -> Result<Vec<(u64, Duration)>, String> {
    let bad = || format!("RATE={text:?}: a number, or rate@start pairs such as 8000@0s,400@20s");
    if let Ok(rate) = text.trim().parse::<u64>() {
        return Ok(vec![(rate, Duration::ZERO)]);
    }
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (rate, at) = part.split_once('@').ok_or_else(bad)?;
        let rate = rate.trim().parse().map_err(|_| bad())?;
        let at: u64 = at.trim().trim_end_matches('s').parse().map_err(|_| bad())?;
        out.push((rate, Duration::from_secs(at)));
    }
    if out.is_empty() {
        return Err(bad());
    }
    out.sort_by_key(|(_, at)| *at);
    Ok(out)
}

const DEADLINE_HEADER: http::HeaderName = http::HeaderName::from_static("x-request-timeout-ms");

/// The upstream: `WORKERS` at once, each call `SERVICE` long, `503` at once when full; with
/// `deadlines`, a call is dropped when its caller's deadline passes.
async fn upstream(counts: Arc<Counts>, deadlines: bool, queue: bool) -> Result<String, BoxError> {
    let workers = Arc::new(Semaphore::new(WORKERS));
    let app = Router::new()
        .route(
            "/",
            get(
                |State((workers, counts, queue)): State<(Arc<Semaphore>, Arc<Counts>, bool)>,
                 headers: http::HeaderMap| async move {
                    counts.received.fetch_add(1, Ordering::Relaxed);
                    let caller_deadline =
                        Deadline::from_headers(&headers, false, Some(&DEADLINE_HEADER));
                    let worker = if queue {
                        workers.acquire().await.ok()
                    } else {
                        workers.try_acquire().ok()
                    };
                    let Some(_worker) = worker else {
                        return http::StatusCode::SERVICE_UNAVAILABLE;
                    };
                    tokio::time::sleep(SERVICE).await;
                    counts.accepted.fetch_add(1, Ordering::Relaxed);
                    if caller_deadline.is_some_and(|d| d.has_passed()) {
                        counts.late.fetch_add(1, Ordering::Relaxed);
                    }
                    http::StatusCode::OK
                },
            ),
        )
        .with_state((workers, counts, queue));
    let app = if deadlines {
        app.layer(DeadlineLayer::new().header(DEADLINE_HEADER))
    } else {
        app
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

/// tower's plain retry: up to `n` more attempts of a call answered `429`, `502`, `503`,
/// `504` or failed, at once.
#[derive(Clone)]
struct Attempts(u32);

impl<R, E> tower::retry::Policy<http::Request<Body>, http::Response<R>, E> for Attempts {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _req: &mut http::Request<Body>,
        result: &mut Result<http::Response<R>, E>,
    ) -> Option<Self::Future> {
        let again = match result {
            Ok(res) => matches!(res.status().as_u16(), 429 | 502 | 503 | 504),
            Err(_) => true,
        };
        (again && self.0 > 0).then(|| {
            self.0 -= 1;
            std::future::ready(())
        })
    }

    fn clone_request(&mut self, req: &http::Request<Body>) -> Option<http::Request<Body>> {
        let mut out = http::Request::new(req.body().clone());
        *out.method_mut() = req.method().clone();
        *out.uri_mut() = req.uri().clone();
        *out.headers_mut() = req.headers().clone();
        *out.extensions_mut() = req.extensions().clone();
        Some(out)
    }
}

/// One client's stack for `mode`.
fn client(mode: &str, retries: u32, counts: &Arc<Counts>) -> Result<Call, BoxError> {
    let http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http::<Body>();
    let sent = counts.clone();
    // Every attempt carries the time its call has left.
    let http = ServiceBuilder::new()
        .map_request(move |r: http::Request<Body>| {
            sent.sent.fetch_add(1, Ordering::Relaxed);
            r
        })
        .layer(PropagateDeadlineLayer::new().header(DEADLINE_HEADER))
        .service(http.map_err(BoxError::from));
    let tries = counts.clone();
    let count_tries = move |r: http::Request<Body>| {
        tries.tries.fetch_add(1, Ordering::Relaxed);
        r
    };
    // No budget: a ratio no traffic reaches.
    let unlimited = || {
        RetryBudget::builder()
            .ratio(1000.0)
            .min_per_second(1e9)
            .build()
    };
    let backoff = (Duration::from_millis(25), Duration::from_secs(1));
    let window = Duration::from_millis(number("THROTTLE_WINDOW_MS", "250")?);
    let throttle = Throttle::builder().window(window);
    let throttle = || throttle.clone().build().map(ThrottleLayer::new);
    Ok(match mode {
        "naive" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(
                    RetryLayer::new(unlimited()?)
                        .max_retries(retries)
                        .backoff(Duration::ZERO, Duration::ZERO),
                )
                .map_request(count_tries)
                .service(http),
        ),
        "budget" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(RetryLayer::new(RetryBudget::new()).max_retries(retries))
                .map_request(count_tries)
                .service(http),
        ),
        "throttle" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(
                    RetryLayer::new(unlimited()?)
                        .max_retries(retries)
                        .backoff(backoff.0, backoff.1),
                )
                .map_request(count_tries)
                .layer(throttle()?)
                .service(http),
        ),
        "both" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(RetryLayer::new(RetryBudget::new()).max_retries(retries))
                .map_request(count_tries)
                .layer(throttle()?)
                .service(http),
        ),
        "tower" => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(tower::retry::RetryLayer::new(Attempts(retries)))
                .map_request(count_tries)
                .service(http),
        ),
        other => {
            return Err(format!("MODE={other:?}: naive, tower, budget, throttle or both").into());
        }
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mode = env_or("MODE", "both");
    let rates = schedule(&env_or("RATE", "2400"))?;
    let retries = u32::try_from(number("RETRIES", "3")?)?;
    let secs = number("SECS", "30")?;
    let slo = Duration::from_millis(number("SLO_MS", "500")?);
    let n_clients = number("CLIENTS", "10")?.max(1);
    let on_off = |name: &str| match env_or(name, "off").as_str() {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("{name}={other:?}: on or off")),
    };
    let (deadlines, queue) = (on_off("DEADLINES")?, on_off("QUEUE")?);
    let counts = Arc::new(Counts::default());
    let (url, own) = match std::env::var("UPSTREAM_URL") {
        Ok(url) => (url, false),
        Err(_) => (upstream(counts.clone(), deadlines, queue).await?, true),
    };
    let clients = (0..n_clients)
        .map(|_| client(&mode, retries, &counts))
        .collect::<Result<Vec<_>, _>>()?;
    println!(
        "mode {mode}, rate {rates:?}, {n_clients} clients, {retries} retries, SLO {slo:?}, \
         deadlines {}, queue {}, upstream {url} ({})",
        if deadlines { "on" } else { "off" },
        if queue { "on" } else { "off" },
        if own {
            format!(
                "{WORKERS} workers x {SERVICE:?}: {} a second",
                WORKERS as u64 * 1000 / 20
            )
        } else {
            "external: its own counts are not seen here".into()
        }
    );
    println!("sec offered sent received accepted retried throttled goodput");

    // The load: open loop, in 1-ms ticks, each call on its own task.
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let load = {
        let counts = counts.clone();
        let url = url.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let (mut owed, mut next) = (0.0f64, 0usize);
            let mut last = start;
            while Instant::now() < end {
                let now = tick.tick().await;
                let elapsed = now.saturating_duration_since(start);
                let rate = rates
                    .iter()
                    .rev()
                    .find(|(_, at)| *at <= elapsed)
                    .map_or(0, |(r, _)| *r);
                owed += rate as f64 * now.saturating_duration_since(last).as_secs_f64();
                last = now;
                while owed >= 1.0 {
                    owed -= 1.0;
                    let client = clients[next % clients.len()].clone();
                    next += 1;
                    let counts = counts.clone();
                    let req = http::Request::get(&url).body(Body::default());
                    tokio::spawn(async move {
                        counts.offered.fetch_add(1, Ordering::Relaxed);
                        let Ok(mut req) = req else { return };
                        req.extensions_mut().insert(Deadline::after(slo));
                        match tokio::time::timeout(slo, client.oneshot(req)).await {
                            Ok(Ok(res)) if res.status() == http::StatusCode::OK => {
                                counts.good.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(Err(e)) if e.is::<Throttled>() => {
                                counts.throttled.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {}
                        }
                    });
                }
            }
        })
    };

    let mut totals = [0u64; 8];
    let mut every =
        tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    for sec in 1..=secs {
        every.tick().await;
        let took = counts.take();
        let [
            offered,
            sent,
            received,
            accepted,
            tries,
            throttled,
            good,
            _late,
        ] = took;
        let retried = tries.saturating_sub(offered);
        println!(
            "{sec:>3} {offered:>7} {sent:>4} {received:>8} {accepted:>8} {retried:>7} {throttled:>9} {good:>7}"
        );
        if sec > 2 {
            for (t, v) in totals.iter_mut().zip(took) {
                *t += v;
            }
        }
    }
    load.await?;
    let [
        offered,
        sent,
        received,
        accepted,
        tries,
        throttled,
        good,
        late,
    ] = totals;
    let per = |a: u64, b: u64| a as f64 / b.max(1) as f64;
    let after = secs.saturating_sub(2).max(1);
    println!(
        "after 2 s: offered {}/s, sent {}/s, received/accepted {:.2}, retries {:.1} % of calls, \
         throttled {:.1} %, goodput {}/s ({:.0} % of capacity), work finished after its \
         caller's deadline {:.2} %",
        offered / after,
        sent / after,
        per(received, accepted),
        100.0 * per(tries.saturating_sub(offered), offered),
        100.0 * per(throttled, offered),
        good / after,
        100.0 * per(good / after, WORKERS as u64 * 1000 / 20),
        100.0 * per(late, accepted),
    );
    Ok(())
}
