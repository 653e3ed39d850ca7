//! An open-loop load generator for fair shedding (issue 60), against `examples/adaptive` or
//! anything in front of it (Envoy's adaptive concurrency filter).
//!
//! Run with: `cargo run --release --example fair_load` (against a server already running:
//! `scripts/bench-fair.sh` starts each contender and runs this).
//!
//! Classes of requests, each with its own `x-tenant` and `x-criticality` headers, leave at
//! Poisson arrivals of a fixed rate, whatever the answers do; each latency is taken from the
//! moment the request was due. Rates are shares of the capacity (`CAPACITY` / `SERVICE_MS`
//! requests per second, 800 by default). `SCENARIO`:
//! - `tenants`: four quiet tenants (`q1`..`q4`) at 0.12 of capacity each, and `noisy` sending
//!   the rest of 3× capacity (2.52, about 20× each quiet one);
//! - `quiet`: the four quiet tenants alone (their latency with no load);
//! - `criticality`: `critical` at 0.3 (tenant `web`), `default` at 0.2 (`api`), and
//!   `sheddable` (`prefetch`) at 0.2, 2.4 (12×) from `SPIKE_FROM` to `SPIKE_TO` seconds
//!   (default the middle third).
//!
//! At the end it prints, per class, the requests sent from `FROM` seconds on (default 10: the
//! limit has settled), the share answered 2xx within the SLO (`SLO_MS`, default 4 ×
//! `SERVICE_MS`), and the p99 of the 2xx answers; and appends them to `SUMMARY`
//! (`contender,scenario,class,sent,good,good_share,p99_ms`) and one row per class and second to
//! `OUT` (`contender,scenario,t,class,sent,good`). Variables: `URL` (`http://127.0.0.1:3000`),
//! `DURATION` (60), `FROM`, `TIMEOUT_MS` (1000), `CONTENDER` (a label).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// A class: its name, headers, and its rate (× capacity) at a second of the run.
struct Class {
    name: &'static str,
    tenant: &'static str,
    criticality: Option<&'static str>,
    rate: Box<dyn Fn(f64) -> f64 + Send + Sync>,
}

fn classes(scenario: &str, duration: f64) -> Result<Vec<Class>, String> {
    let quiet = |name: &'static str| Class {
        name,
        tenant: name,
        criticality: None,
        rate: Box::new(|_| 0.12),
    };
    Ok(match scenario {
        "quiet" => ["q1", "q2", "q3", "q4"].map(quiet).into(),
        "tenants" => {
            let mut c: Vec<Class> = ["q1", "q2", "q3", "q4"].map(quiet).into();
            c.push(Class {
                name: "noisy",
                tenant: "noisy",
                criticality: None,
                rate: Box::new(|_| 3.0 - 4.0 * 0.12),
            });
            c
        }
        "criticality" => {
            let from: f64 = env("SPIKE_FROM", duration / 3.0);
            let to: f64 = env("SPIKE_TO", 2.0 * duration / 3.0);
            vec![
                Class {
                    name: "critical",
                    tenant: "web",
                    criticality: Some("critical"),
                    rate: Box::new(|_| 0.3),
                },
                Class {
                    name: "default",
                    tenant: "api",
                    criticality: Some("default"),
                    rate: Box::new(|_| 0.2),
                },
                Class {
                    name: "sheddable",
                    tenant: "prefetch",
                    criticality: Some("sheddable"),
                    rate: Box::new(move |t| if t >= from && t < to { 2.4 } else { 0.2 }),
                },
            ]
        }
        other => return Err(format!("SCENARIO={other:?}: tenants, quiet or criticality")),
    })
}

/// What a class got: per second (sent, good), and from `FROM` on, totals and 2xx latencies.
#[derive(Default)]
struct Tally {
    seconds: BTreeMap<u64, (u64, u64)>,
    sent: u64,
    good: u64,
    ok_us: Vec<u64>,
}

/// A small deterministic generator (splitmix64) for the arrivals (`tests/fairness.rs` uses it
/// too).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next number in `[0, 1)`.
    pub(crate) fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn append(path: &str, header: &str, rows: &str) -> std::io::Result<()> {
    let new = !std::path::Path::new(path).exists();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    if new {
        writeln!(f, "{header}")?;
    }
    f.write_all(rows.as_bytes())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url: String = env("URL", "http://127.0.0.1:3000".to_owned());
    let scenario: String = env("SCENARIO", "tenants".to_owned());
    let capacity: f64 = env("CAPACITY", 16.0);
    let service_ms: f64 = env("SERVICE_MS", 20.0);
    let full = capacity * 1000.0 / service_ms;
    let duration: f64 = env("DURATION", 60.0);
    let from: f64 = env("FROM", 10.0);
    let slo = Duration::from_millis(env("SLO_MS", (4.0 * service_ms) as u64));
    let timeout = Duration::from_millis(env("TIMEOUT_MS", 1000));
    let contender: String = env("CONTENDER", "-".to_owned());
    let classes = classes(&scenario, duration)?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .timeout(timeout)
        .build()?;
    let tallies: Arc<Mutex<Vec<Tally>>> = Arc::new(Mutex::new(
        classes.iter().map(|_| Tally::default()).collect(),
    ));
    let start = Instant::now();
    let mut senders = Vec::new();
    for (i, class) in classes.into_iter().enumerate() {
        let (client, tallies, url) = (client.clone(), tallies.clone(), url.clone());
        senders.push(tokio::spawn(async move {
            let mut rng = Rng(i as u64 * 7919 + 1);
            let mut at = 0.0f64;
            let mut calls = Vec::new();
            loop {
                let per_sec = ((class.rate)(at) * full).max(1e-9);
                at += -(1.0 - rng.next()).ln() / per_sec;
                if at >= duration {
                    break;
                }
                let due = start + Duration::from_secs_f64(at);
                tokio::time::sleep_until(due).await;
                let mut req = client.get(&url).header("x-tenant", class.tenant);
                if let Some(level) = class.criticality {
                    req = req.header("x-criticality", level);
                }
                let tallies = tallies.clone();
                calls.push(tokio::spawn(async move {
                    let ok = match req.send().await {
                        Ok(res) => res.status().is_success() && res.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    let took = due.elapsed();
                    let second = at as u64;
                    let good = ok && took <= slo;
                    let mut t = tallies.lock().unwrap();
                    let t = &mut t[i];
                    let s = t.seconds.entry(second).or_default();
                    s.0 += 1;
                    s.1 += u64::from(good);
                    if at >= from {
                        t.sent += 1;
                        t.good += u64::from(good);
                        if ok {
                            t.ok_us.push(took.as_micros() as u64);
                        }
                    }
                }));
            }
            for c in calls {
                let _ = c.await;
            }
            (class.name, i)
        }));
    }
    let mut names = Vec::new();
    for s in senders {
        names.push(s.await?);
    }
    let mut tallies = tallies.lock().unwrap();
    let (mut summary, mut seconds) = (String::new(), String::new());
    for (name, i) in names {
        let t = &mut tallies[i];
        t.ok_us.sort_unstable();
        let p99 = if t.ok_us.is_empty() {
            f64::NAN
        } else {
            let at = ((t.ok_us.len() as f64 * 0.99).ceil() as usize).clamp(1, t.ok_us.len());
            t.ok_us[at - 1] as f64 / 1000.0
        };
        let share = t.good as f64 / t.sent.max(1) as f64;
        eprintln!(
            "{contender} {scenario}: {name}: sent {}, 2xx within the SLO {:.2} %, p99 of 2xx {p99:.1} ms",
            t.sent,
            100.0 * share
        );
        summary.push_str(&format!(
            "{contender},{scenario},{name},{},{},{share:.5},{p99:.2}\n",
            t.sent, t.good
        ));
        for (second, (sent, good)) in &t.seconds {
            seconds.push_str(&format!(
                "{contender},{scenario},{second},{name},{sent},{good}\n"
            ));
        }
    }
    if let Ok(path) = std::env::var("SUMMARY") {
        append(
            &path,
            "contender,scenario,class,sent,good,good_share,p99_ms",
            &summary,
        )?;
    }
    if let Ok(path) = std::env::var("OUT") {
        append(&path, "contender,scenario,t,class,sent,good", &seconds)?;
    }
    Ok(())
}
