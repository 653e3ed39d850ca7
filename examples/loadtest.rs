//! Run with: `cargo run --release --example loadtest --features redis > target/loadtest.csv`
//! (`SHAPES`, `ALGORITHMS`, `BACKENDS` narrow it down; `RUN_SECONDS` sets each run's length,
//! default 8; `REDIS_URL` points at a Redis, default `redis://127.0.0.1:6379`, used by the `redis`
//! backend).
//!
//! A load test that shows the limiter over time: for each traffic shape, algorithm and backend,
//! a real axum server with tollgate on a free port, driven over TCP in real time by a client
//! that sends at the shape's rate, and the responses counted per 100 ms. The quota is 20 per
//! second (GCRA with a burst of 20; a fixed or a sliding window of 20 per second), per
//! client (`x-key`).
//!
//! Shapes: `under` (a steady 10/s), `over` (a steady 40/s), `burst` (5/s, then 60 requests at
//! once at 3 s, then 5/s), `ramp` (0 to 60/s over the run), `many_keys` (50 clients at 30/s
//! each: 1 500/s in all).
//!
//! Prints CSV: `shape,algorithm,backend,t_ms,allowed,denied,limit_per_s` (one row per 100 ms
//! with responses; `limit_per_s` is the quota times the clients).
//! `scripts/plot-loadtest.py` draws `docs/loadtest.svg` from it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use tollgate::backend::{Backend, LocalBackend};
use tollgate::key::Header;
use tollgate::{Policy, Quota, RateLimitLayer};

const LIMIT: u32 = 20;

/// Requests per second wanted at `t` seconds into a run of `len` seconds, and how many clients
/// share them.
fn rate(shape: &str, t: f64, len: f64) -> (f64, usize) {
    match shape {
        "under" => (10.0, 1),
        "over" => (40.0, 1),
        "burst" => (5.0, 1),
        "ramp" => (60.0 * t / len, 1),
        "many_keys" => (1500.0, 50),
        _ => (0.0, 1),
    }
}

async fn serve<Bk: Backend>(backend: Bk, quota: Quota) -> SocketAddr {
    let limit = RateLimitLayer::builder()
        .key(Header::new("x-key"))
        .backend(backend)
        .policy(Policy::new("load", quota))
        .build()
        .expect("valid policy");
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(limit);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// Drives `addr` with `shape` for `len`; returns (allowed, denied) per 100 ms.
async fn drive(addr: SocketAddr, shape: &str, len: Duration) -> BTreeMap<u64, (u32, u32)> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .expect("client");
    let counts: Arc<Mutex<BTreeMap<u64, (u32, u32)>>> = Arc::default();
    let start = Instant::now();
    let mut sent = 0f64;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let mut burst_done = false;
    let mut tasks = Vec::new();
    while start.elapsed() < len {
        tick.tick().await;
        let t = start.elapsed().as_secs_f64();
        let (per_s, clients) = rate(shape, t, len.as_secs_f64());
        // Requests due by now at the shape's rate, sent since the last tick.
        let mut due = 0;
        sent += per_s * 0.005;
        while sent >= 1.0 {
            sent -= 1.0;
            due += 1;
        }
        if shape == "burst" && !burst_done && t >= 3.0 {
            burst_done = true;
            due += 60;
        }
        for _ in 0..due {
            let key = format!("client-{}", tasks.len() % clients);
            let (client, counts) = (client.clone(), counts.clone());
            tasks.push(tokio::spawn(async move {
                let at = start.elapsed().as_millis() as u64 / 100 * 100;
                let res = client
                    .get(format!("http://{addr}/"))
                    .header("x-key", key)
                    .send()
                    .await;
                let ok = matches!(&res, Ok(r) if r.status() == 200);
                let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
                let e = c.entry(at).or_default();
                if ok {
                    e.0 += 1;
                } else {
                    e.1 += 1;
                }
            }));
        }
    }
    for task in tasks {
        let _ = task.await;
    }
    counts.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

fn list(var: &str, all: &[&'static str]) -> Vec<&'static str> {
    match std::env::var(var) {
        Ok(v) => all
            .iter()
            .copied()
            .filter(|a| v.split(',').any(|w| w == *a))
            .collect(),
        Err(_) => all.to_vec(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let len = Duration::from_secs(
        std::env::var("RUN_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(8),
    );
    let shapes = list("SHAPES", &["under", "over", "burst", "ramp", "many_keys"]);
    let algorithms = list("ALGORITHMS", &["gcra", "fixed", "sliding"]);
    let backends = list("BACKENDS", &["local", "redis"]);
    println!("shape,algorithm,backend,t_ms,allowed,denied,limit_per_s");
    for shape in &shapes {
        for algorithm in &algorithms {
            let quota = match *algorithm {
                "fixed" => Quota::per_second(LIMIT).fixed_window(),
                "sliding" => Quota::per_second(LIMIT).sliding_window(),
                _ => Quota::per_second(LIMIT),
            };
            for backend in &backends {
                let addr = match *backend {
                    "redis" => redis_server(quota, shape, algorithm).await?,
                    _ => serve(LocalBackend::new(), quota).await,
                };
                let counts = drive(addr, shape, len).await;
                let limit = LIMIT as usize * rate(shape, 0.0, 1.0).1;
                for (t, (allowed, denied)) in counts {
                    println!("{shape},{algorithm},{backend},{t},{allowed},{denied},{limit}");
                }
                eprintln!("done: {shape} {algorithm} {backend}");
            }
        }
    }
    Ok(())
}

#[cfg(feature = "redis")]
async fn redis_server(
    quota: Quota,
    shape: &str,
    algorithm: &str,
) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    // A prefix per run, so that runs never share buckets.
    let prefix = format!(
        "loadtest-{shape}-{algorithm}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    );
    let backend = tollgate::backend::redis::RedisBackend::builder()
        .url(url)
        .prefix(prefix)
        .build()?;
    Ok(serve(backend, quota).await)
}

#[cfg(not(feature = "redis"))]
async fn redis_server(
    _quota: Quota,
    _shape: &str,
    _algorithm: &str,
) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    Err("the redis backend needs `--features redis` (or BACKENDS=local)".into())
}
