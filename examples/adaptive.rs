//! An adaptive concurrency limit in front of a service of limited capacity.
//!
//! Run with: `cargo run --example adaptive` (the default features).
//!
//! The handler simulates a backend that serves `CAPACITY` requests at once (default 16), each
//! taking `SERVICE_MS` (default 20) ± 50 %; the rest wait in line inside the handler, as a real
//! backend's requests queue, so latency grows with overload. `CAPACITY_SCHEDULE` changes the
//! capacity over time from the start (`16@0s,8@20s,16@40s`). `LIMIT` chooses what protects it:
//! `adaptive` (the default: `tollgate::adaptive`, a gradient on latency), `static` (a fixed cap
//! at `CAPACITY`) or `none`. `PORT` (default 3000).
//!
//! Route `/` is ordinary traffic; `/critical` is a partition guaranteed half the limit once it
//! is reached (`CRITICAL_SHARE` sets another share), so under overload it is kept while `/` is
//! shed. Over the limit: `503` with `Retry-After: 1`.
//!
//! Fair shedding (issue 60): a request's flow is its `x-tenant` header (any string), and its
//! criticality its `x-criticality` header (`critical`, `default` or `sheddable`). The example
//! trusts both **as headers a gateway sets** (and strips from what clients send): a client that
//! could set `x-criticality` itself would call everything critical. When the limit is full,
//! sheddable requests are refused first, and the tenant holding the most slots before the
//! others. `FAIR=off` reads neither (whoever comes when the slots are gone is refused).
//! `QUEUE=on` gives the limit a short queue (64 waiting, LIFO, `QUEUE_MS` 30 ms at most), fair
//! between levels and tenants too. `TOLERANCE` sets the gradient's tolerance (the latency over
//! the baseline it lets the service's own queue add; 1.25 by default).
//!
//! ```text
//! $ cargo run --example adaptive &
//! $ curl -i localhost:3000/           # 200 after about 20 ms
//! $ curl -i -H 'x-tenant: acme' -H 'x-criticality: sheddable' localhost:3000/
//! $ curl -s localhost:3000/limit      # the limit now, in flight, and per partition
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use http::HeaderName;
use tokio::sync::Semaphore;
use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit, Gradient, QueueOrder};

/// The example's settings, from the environment.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) capacity: u32,
    pub(crate) service_ms: u64,
    /// `(capacity, from)`, in order of time.
    pub(crate) schedule: Vec<(u32, Duration)>,
    pub(crate) limit: String,
    /// The share of the limit `/critical` is guaranteed (`CRITICAL_SHARE`, default 0.5).
    pub(crate) critical_share: f64,
    /// Flows by `x-tenant` and criticality from `x-criticality` (`FAIR`, default on).
    pub(crate) fair: bool,
    /// A short queue's longest wait (`QUEUE=on`; `QUEUE_MS`, default 30), none by default.
    pub(crate) queue: Option<Duration>,
    /// The gradient's tolerance (`TOLERANCE`; its default, 1.25, unless given).
    pub(crate) tolerance: Option<f64>,
}

impl Settings {
    pub(crate) fn from_env() -> Result<Self, String> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The settings from variables that `var` looks up.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let number = |name: &str, default: u64| -> Result<u64, String> {
            match var(name) {
                Some(v) => v
                    .trim()
                    .parse()
                    .map_err(|_| format!("{name}={v:?} is not a whole number")),
                None => Ok(default),
            }
        };
        let capacity = u32::try_from(number("CAPACITY", 16)?)
            .ok()
            .filter(|c| *c > 0)
            .ok_or("CAPACITY must be at least 1")?;
        let schedule = match var("CAPACITY_SCHEDULE") {
            Some(text) => schedule(&text)?,
            None => Vec::new(),
        };
        let limit = var("LIMIT").unwrap_or_else(|| "adaptive".into());
        if !["adaptive", "static", "none"].contains(&limit.as_str()) {
            return Err(format!("LIMIT={limit:?}: use adaptive, static or none"));
        }
        let critical_share = match var("CRITICAL_SHARE") {
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0 && *s <= 1.0)
                .ok_or_else(|| format!("CRITICAL_SHARE={v:?}: a share of the limit, in (0, 1]"))?,
            None => 0.5,
        };
        let switch = |name: &str, default: bool| match var(name).as_deref().map(str::trim) {
            None => Ok(default),
            Some("on" | "1" | "true") => Ok(true),
            Some("off" | "0" | "false") => Ok(false),
            Some(other) => Err(format!("{name}={other:?}: on or off")),
        };
        let fair = switch("FAIR", true)?;
        let queue = switch("QUEUE", false)?
            .then(|| number("QUEUE_MS", 30).map(Duration::from_millis))
            .transpose()?;
        let tolerance = match var("TOLERANCE") {
            Some(v) => Some(
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|t| *t >= 1.0)
                    .ok_or_else(|| {
                        format!("TOLERANCE={v:?}: the gradient's tolerance, at least 1")
                    })?,
            ),
            None => None,
        };
        Ok(Settings {
            tolerance,
            capacity,
            service_ms: number("SERVICE_MS", 20)?,
            schedule,
            limit,
            critical_share,
            fair,
            queue,
        })
    }
}

/// `16@0s,8@20s,16@40s`: capacities and when they start.
fn schedule(text: &str) -> Result<Vec<(u32, Duration)>, String> {
    let mut steps = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("CAPACITY_SCHEDULE: {part:?} is not <capacity>@<seconds>s");
        let (c, at) = part.split_once('@').ok_or_else(bad)?;
        let c: u32 = c.trim().parse().map_err(|_| bad())?;
        let at: u64 = (at.trim().strip_suffix('s').ok_or_else(bad)?)
            .parse()
            .map_err(|_| bad())?;
        if c == 0 {
            return Err(format!("CAPACITY_SCHEDULE: {part:?}: a capacity of 0"));
        }
        steps.push((c, Duration::from_secs(at)));
    }
    steps.sort_by_key(|(_, at)| *at);
    Ok(steps)
}

/// The simulated backend: workers, and the service time's spread.
struct Backend {
    workers: Arc<Semaphore>,
    service_ms: u64,
    seed: AtomicU64,
}

impl Backend {
    async fn serve(&self) {
        let _worker = self.workers.acquire().await;
        // ± 50 %, from a counter through a multiply-xorshift (no randomness needed).
        let n = self
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let mixed = (n ^ (n >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let spread = 0.5 + (mixed >> 11) as f64 / (1u64 << 53) as f64;
        let us = (self.service_ms as f64 * 1000.0 * spread) as u64;
        tokio::time::sleep(Duration::from_micros(us)).await;
    }
}

/// The app: the simulated service behind the limit the settings choose, and the limit (none
/// for `LIMIT=none`).
pub(crate) fn app(settings: &Settings) -> Result<(Router, Option<AdaptiveLimit>), String> {
    let backend = Arc::new(Backend {
        workers: Arc::new(Semaphore::new(settings.capacity as usize)),
        service_ms: settings.service_ms,
        seed: AtomicU64::new(1),
    });
    // The capacity over time: workers taken away or given back at each step.
    if !settings.schedule.is_empty() {
        let (workers, schedule, mut now) = (
            backend.workers.clone(),
            settings.schedule.clone(),
            settings.capacity,
        );
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            for (capacity, at) in schedule {
                tokio::time::sleep_until(start + at).await;
                if capacity > now {
                    workers.add_permits((capacity - now) as usize);
                } else if capacity < now
                    && let Ok(p) = workers.acquire_many(now - capacity).await
                {
                    p.forget();
                }
                now = capacity;
            }
        });
    }
    let limit = match settings.limit.as_str() {
        "none" => None,
        kind => {
            let builder = AdaptiveLimit::builder().partition("critical", settings.critical_share);
            let builder = match settings.queue {
                Some(_) => builder.queue(64, QueueOrder::Lifo),
                None => builder,
            };
            let builder = if kind == "static" {
                builder
                    .initial(settings.capacity)
                    .range(settings.capacity, settings.capacity)
            } else {
                let gradient = match settings.tolerance {
                    Some(t) => Gradient::new().tolerance(t),
                    None => Gradient::new(),
                };
                (builder.initial(settings.capacity.min(10)).range(2, 1000)).gradient(gradient)
            };
            Some(builder.build().map_err(|e| e.to_string())?)
        }
    };
    let handler = |State(backend): State<Arc<Backend>>| async move {
        backend.serve().await;
        "ok\n"
    };
    let mut app = Router::new()
        .route("/", get(handler))
        .route("/critical", get(handler))
        .with_state(backend);
    if let Some(limit) = &limit {
        let mut layer = AdaptiveLayer::new(limit.clone())
            .partition_by(|req| (req.uri().path() == "/critical").then_some("critical"));
        if settings.fair {
            // Headers the gateway in front sets: trusted here, never from a client directly.
            layer = layer
                .flow_by_header(HeaderName::from_static("x-tenant"))
                .criticality_from_header(HeaderName::from_static("x-criticality"));
        }
        if let Some(wait) = settings.queue {
            layer = layer.queue_deadline(wait);
        }
        app = app.layer(layer);
        let seen = limit.clone();
        app = app.route(
            "/limit",
            get(move || async move {
                let parts: Vec<String> = (seen.partitions().iter())
                    .map(|p| {
                        format!(
                            "{}: in flight {}, admitted {}, rejected {}",
                            p.name, p.in_flight, p.admitted, p.rejected
                        )
                    })
                    .collect();
                let levels: Vec<String> = (seen.levels().iter())
                    .map(|l| {
                        format!(
                            "{}: in flight {}, admitted {}, rejected {} ({} over their share)",
                            l.criticality, l.in_flight, l.admitted, l.rejected, l.over_share
                        )
                    })
                    .collect();
                format!(
                    "limit {}, in flight {}\n{}\n{}\n",
                    seen.limit(),
                    seen.in_flight(),
                    parts.join("\n"),
                    levels.join("\n")
                )
            }),
        );
    }
    Ok((app, limit))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let settings = Settings::from_env()?;
    let (app, _) = app(&settings)?;
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("0.0.0.0:{port}")).await?;
    println!(
        "listening on http://{} (capacity {}, {} ms, limit {}, fair {}, queue {:?})",
        listener.local_addr()?,
        settings.capacity,
        settings.service_ms,
        settings.limit,
        settings.fair,
        settings.queue
    );
    axum::serve(listener, app).await?;
    Ok(())
}
