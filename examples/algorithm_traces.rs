//! Run with: cargo run --example algorithm_traces > target/algorithm-traces.csv
//!
//! The same traffic through the layer under each algorithm, on a clock this program moves (no
//! waiting): one quota of 10 per 10 s as a GCRA bucket (burst 10), a fixed window, and a
//! sliding window. The traffic is a steady 2 requests per second (twice the rate) for 30 s,
//! quiet, then a burst of 10 just before a window edge (49 s) and 10 more on it (50 s).
//!
//! Prints CSV: `algorithm,t_ms,status,remaining,reset_s`, one row per request, as the client saw
//! it (`remaining` and `reset_s` from the `RateLimit` header). `scripts/plot-algorithms.py`
//! draws `docs/algorithms.svg` from it.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use governor::clock::FakeRelativeClock;
use http::{Request, Response};
use http_body_util::Full;
use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, ServiceExt};

/// The request times of the traffic, in milliseconds.
fn traffic() -> Vec<u64> {
    let mut at: Vec<u64> = (0..60).map(|i| i * 500).collect();
    at.extend(std::iter::repeat_n(49_000, 10));
    at.extend(std::iter::repeat_n(50_000, 10));
    at
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ten = Quota::new(10, Duration::from_secs(10));
    println!("algorithm,t_ms,status,remaining,reset_s");
    for (name, quota) in [
        ("gcra", ten),
        ("fixed", ten.fixed_window()),
        ("sliding", ten.sliding_window()),
    ] {
        let clock = FakeRelativeClock::default();
        let layer = RateLimitLayer::builder()
            .key(Global)
            .backend(
                LocalBackend::builder()
                    .clock(clock.clone())
                    .clock_epoch(Duration::ZERO)
                    .build(),
            )
            .policy(Policy::new(name, quota))
            .build()?;
        let svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
        }));
        let mut now = 0;
        for at in traffic() {
            clock.advance(Duration::from_millis(at - now));
            now = at;
            let res = svc.clone().oneshot(Request::new(())).await?;
            let ratelimit = res
                .headers()
                .get("ratelimit")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            let field = |p: &str| {
                ratelimit
                    .split(';')
                    .find_map(|kv| kv.strip_prefix(p))
                    .unwrap_or("")
                    .to_owned()
            };
            println!(
                "{name},{at},{},{},{}",
                res.status().as_u16(),
                field("r="),
                field("t=")
            );
        }
    }
    Ok(())
}
