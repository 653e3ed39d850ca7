//! An open-loop load generator for a fleet of gateways: each target gets its own rate of
//! requests (sent on time whatever the answers), and every second's answers are printed per
//! target, as `second target ok refused failed` lines (ok: 200, refused: 429). Used by
//! `scripts/bench-rlqs.sh` to measure how closely a fleet of Envoys holds a shared limit.
//!
//! ```text
//! TARGETS=http://127.0.0.1:10000@560,http://127.0.0.1:10001@80 DURATION=60 \
//!   HEADER=x-tenant:acme cargo run --release --example fleet_load
//! ```
//!
//! `TARGETS`: `url@rate` (requests a second), comma-separated; `DURATION` in seconds (default 60);
//! `HEADER`: a `name:value` sent with every request (optional).

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What one second's requests to one target got.
#[derive(Default, Clone, Copy)]
struct Counts {
    ok: u64,
    refused: u64,
    failed: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let targets = std::env::var("TARGETS").map_err(|_| "TARGETS: url@rate,... is required")?;
    let seconds: usize = match std::env::var("DURATION") {
        Ok(s) => s.parse().map_err(|e| format!("DURATION {s:?}: {e}"))?,
        Err(_) => 60,
    };
    let header = match std::env::var("HEADER") {
        Ok(h) => {
            let (name, value) = h.split_once(':').ok_or("HEADER: name:value")?;
            Some((name.trim().to_owned(), value.trim().to_owned()))
        }
        Err(_) => None,
    };
    let mut parsed = Vec::new();
    for t in targets.split(',') {
        let (url, rate) = t.rsplit_once('@').ok_or(format!("{t:?}: url@rate"))?;
        let rate: u32 = rate.parse().map_err(|e| format!("{t:?}: rate: {e}"))?;
        if rate == 0 {
            return Err(format!("{t:?}: a rate of at least 1").into());
        }
        parsed.push((url.to_owned(), rate));
    }
    let counts = Arc::new(Mutex::new(vec![
        vec![Counts::default(); seconds];
        parsed.len()
    ]));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let start = tokio::time::Instant::now();
    let mut senders = Vec::new();
    for (i, (url, rate)) in parsed.iter().cloned().enumerate() {
        let (client, counts, header) = (client.clone(), counts.clone(), header.clone());
        senders.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(start, Duration::from_secs(1) / rate);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut inflight = Vec::new();
            for _ in 0..u64::from(rate) * seconds as u64 {
                tick.tick().await;
                let second = (start.elapsed().as_secs() as usize).min(seconds - 1);
                let mut req = client.get(&url);
                if let Some((name, value)) = &header {
                    req = req.header(name, value);
                }
                let counts = counts.clone();
                inflight.push(tokio::spawn(async move {
                    let status = req.send().await.map(|r| r.status().as_u16());
                    let mut counts = counts.lock().unwrap_or_else(|e| e.into_inner());
                    let c = &mut counts[i][second];
                    match status {
                        Ok(200) => c.ok += 1,
                        Ok(429) => c.refused += 1,
                        _ => c.failed += 1,
                    }
                }));
            }
            for f in inflight {
                let _ = f.await;
            }
        }));
    }
    for s in senders {
        s.await?;
    }
    let counts = counts.lock().unwrap_or_else(|e| e.into_inner());
    println!("second target ok refused failed");
    for second in 0..seconds {
        for (i, per_target) in counts.iter().enumerate() {
            let c = per_target[second];
            println!("{second} {i} {} {} {}", c.ok, c.refused, c.failed);
        }
    }
    Ok(())
}
