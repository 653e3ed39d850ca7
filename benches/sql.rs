//! The SQL backends under concurrent load, against servers this bench starts (PostgreSQL; and
//! MariaDB with `--features mysql`): decisions per second and latency percentiles with 16, 64
//! and 256 concurrent callers, on one hot key and on 10 000 uniform keys, next to the
//! database's own ceiling for the same statement (`pgbench -f` with the function call; as many
//! `mariadb` command-line clients calling the procedure); the
//! denied flood with and without the deny cache; and a flood of distinct keys, with the table's
//! size before and after the sweep.
//!
//! Run with: `cargo bench --bench sql --features "postgres mysql"` (`FLOOD=1000000` for the
//! million-key flood, default 100 000; `SECS=3` per measurement; `ONLY=postgres` or
//! `ONLY=mysql` for one store).

#![allow(missing_docs)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::backend::Backend;
use tollgate::{Key, Policy, Quota};

const ONE: NonZeroU32 = NonZeroU32::MIN;

fn secs() -> Duration {
    let s = std::env::var("SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    Duration::from_secs(s)
}

/// A quota that never denies during the bench.
fn roomy() -> Policy {
    Policy::new("bench", Quota::per_second(1_000_000).burst(1_000_000_000))
}

struct Run {
    per_sec: f64,
    p50_us: u64,
    p99_us: u64,
    errors: u64,
}

/// `callers` tasks deciding in a loop for `secs()`, each on key `k<i>` with `i` uniform over
/// `keys` (one key: always the same).
async fn load<B: Backend + Clone>(b: &B, p: &Arc<B::Policy>, callers: usize, keys: u64) -> Run {
    let until = Instant::now() + secs();
    let mut tasks = Vec::new();
    for c in 0..callers {
        let (b, p) = (b.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0;
            let mut x = c as u64 * 7919 + 1;
            while Instant::now() < until {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let k = Key::from_bytes(format!("k{}", (x >> 33) % keys)).expect("key");
                let t = Instant::now();
                match b.decide(&p, &k, ONE).await {
                    Ok(d) if !d.quotas().is_empty() => lat.push(t.elapsed().as_micros() as u64),
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    let started = Instant::now();
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (lat, e) = t.await.expect("task");
        all.extend(lat);
        errors += e;
    }
    let took = started.elapsed().max(secs());
    all.sort_unstable();
    let pct = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    Run {
        per_sec: all.len() as f64 / took.as_secs_f64(),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        errors,
    }
}

fn row(what: &str, r: &Run) {
    println!(
        "| {what} | {:.0} | {} | {} | {} |",
        r.per_sec, r.p50_us, r.p99_us, r.errors
    );
}

/// "one key" or "N keys".
fn keys_label(keys: u64) -> String {
    if keys == 1 {
        "one key".to_owned()
    } else {
        format!("{keys} keys")
    }
}

/// The backend's decisions per second and latency with 16, 64 and 256 callers, on one key and
/// on 10 000 uniform keys, as a table.
async fn tollgate_table<B: Backend + Clone>(b: &B) {
    println!("| load | decisions/s | p50 µs | p99 µs | failed |\n|---|---|---|---|---|");
    let p = Arc::new(b.prepare(&roomy(), &roomy().validate().unwrap()).unwrap());
    for keys in [1, 10_000] {
        for callers in [16, 64, 256] {
            let r = load(b, &p, callers, keys).await;
            row(
                &format!("tollgate, {}, {callers} callers", keys_label(keys)),
                &r,
            );
        }
    }
}

/// The denied flood: 256 callers on one key that is always denied, with the deny cache on and
/// off.
async fn denied<B: Backend + Clone>(make: impl Fn(usize) -> B) {
    for cache in [65_536, 0] {
        let b = make(cache);
        let p = Arc::new(
            b.prepare(
                &Policy::new("deny", Quota::per_day(1)),
                &Policy::new("deny", Quota::per_day(1)).validate().unwrap(),
            )
            .unwrap(),
        );
        let _ = b.decide(&p, &Key::from_bytes("k0").unwrap(), ONE).await;
        let r = load(&b, &p, 256, 1).await;
        let label = if cache > 0 {
            "denied flood, deny cache on"
        } else {
            "denied flood, deny cache off"
        };
        // Every decision is a denial here: count them all.
        println!(
            "| {label} | {:.0} | {} | {} | – |",
            r.per_sec, r.p50_us, r.p99_us
        );
    }
}

#[cfg(feature = "postgres")]
async fn postgres() {
    use support::sql::PgServer;
    use tollgate::backend::postgres::PostgresBackend;
    let server = PgServer::start();
    let make = |cache: usize| {
        PostgresBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(2))
            .deny_cache_capacity(cache)
            .sweep(None, 1000)
            .build()
            .expect("backend")
    };
    let b = make(0);
    b.migrate().await.expect("migrate");
    println!("\n### PostgreSQL\n");
    tollgate_table(&b).await;
    for keys in [1, 10_000] {
        for callers in [16, 64, 256] {
            let tps = pgbench(&server, callers, keys);
            println!(
                "| pgbench (the function alone), {}, {callers} clients | {tps:.0} | | | |",
                keys_label(keys)
            );
        }
    }
    denied(make).await;
    flood_pg(&server, &b).await;
}

/// `pgbench -f` calling the decide function with one GCRA decision, the same arguments the
/// backend sends, on `keys` keys: the database's own ceiling for the statement. (Colons are
/// `chr(58)`: pgbench reads `:name` as a variable even inside quotes.)
#[cfg(feature = "postgres")]
fn pgbench(server: &support::sql::PgServer, clients: usize, keys: u64) -> f64 {
    let dir = tempfile::tempdir().expect("dir");
    let script = dir.path().join("decide.sql");
    std::fs::write(
        &script,
        format!(
            "\\set k random(0, {})\nSELECT tollgate_buckets_decide(ARRAY[convert_to('tollgate' || chr(58) || '{{bench' || chr(58) || 'b' || CAST(:k AS text) || '}}' || chr(58) || '0g1000x1000000000', 'UTF8')], ARRAY[0,1000,1000000000,0]::bigint[], ARRAY[1,1,0,0]::bigint[], NULL);\n",
            keys - 1
        ),
    )
    .expect("script");
    let bin = std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .and_then(|d| {
            d.flatten()
                .map(|e| e.path().join("bin/pgbench"))
                .find(|p| p.exists())
        })
        .unwrap_or_else(|| "pgbench".into());
    let out = std::process::Command::new(bin)
        .args([
            "-n",
            "-M",
            "prepared",
            "-j",
            "2",
            "-c",
            &clients.to_string(),
            "-T",
            &secs().as_secs().to_string(),
            "-f",
        ])
        .arg(&script)
        .arg(server.url())
        .output()
        .expect("pgbench");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|t| t.parse().ok())
        .unwrap_or(0.0)
}

/// A flood of distinct keys (each decided once, on a quota whose bucket is full again within a
/// millisecond), then the sweep: rows and table size before and after, and how long it took.
#[cfg(feature = "postgres")]
async fn flood_pg(
    server: &support::sql::PgServer,
    b: &tollgate::backend::postgres::PostgresBackend,
) {
    let n: u64 = std::env::var("FLOOD")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    flood(b, n).await;
    let size = || {
        server.psql("SELECT count(*) || ' rows, ' || pg_size_pretty(pg_total_relation_size('tollgate_buckets')) FROM tollgate_buckets")
    };
    println!("table {}", size());
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = Instant::now();
    let swept = b.sweep().await.expect("sweep");
    println!(
        "sweep: {swept} rows in {:.2} s; table {} (the space is reused by later rows; VACUUM returns it)",
        started.elapsed().as_secs_f64(),
        size()
    );
    server.psql("VACUUM tollgate_buckets");
    println!("after VACUUM: {}", size());
}

#[cfg(feature = "mysql")]
async fn mysql() {
    use support::sql::MariaDbServer;
    use tollgate::backend::mysql::MysqlBackend;
    let server = MariaDbServer::start();
    let make = |cache: usize| {
        MysqlBackend::builder()
            .url(server.url())
            .timeout(Duration::from_secs(2))
            .deny_cache_capacity(cache)
            .sweep(None, 1000)
            .build()
            .expect("backend")
    };
    let b = make(0);
    b.migrate().await.expect("migrate");
    println!("\n### MariaDB\n");
    tollgate_table(&b).await;
    for keys in [1, 10_000] {
        for clients in [16, 64, 256] {
            let qps = slap(&server, clients, keys);
            let what = keys_label(keys);
            println!(
                "| mariadb clients (the procedure alone), {what}, {clients} clients | {qps:.0} | | | |"
            );
        }
    }
    denied(make).await;
    let n: u64 = std::env::var("FLOOD")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    flood(&b, n).await;
    let size = || server.sql("SELECT CONCAT(COUNT(*), ' rows') FROM tollgate_buckets");
    println!("table {}", size());
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = Instant::now();
    let swept = b.sweep().await.expect("sweep");
    println!(
        "sweep: {swept} rows in {:.2} s; table {}",
        started.elapsed().as_secs_f64(),
        size()
    );
}

/// `clients` `mariadb` command-line clients at once, each calling the procedure with one
/// GCRA decision per statement, over `keys` keys: the database's own ceiling for the statement,
/// in calls per second.
#[cfg(feature = "mysql")]
fn slap(server: &support::sql::MariaDbServer, clients: usize, keys: u64) -> f64 {
    let per_client = (20_000 / clients as u64).max(100);
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("calls.sql");
    let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    let calls: String = (0..per_client)
        .map(|i| {
            let k = hex(&format!(
                "tollgate:{{bench:bk{}}}:0g1000x1000000000",
                i * 7919 % keys
            ));
            format!("CALL tollgate_buckets_decide('{k};1,0,0|0,1000,1000000000,0,{k}', NULL);\n")
        })
        .collect();
    std::fs::write(&file, calls).expect("calls");
    let url = server.url();
    let port = url
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .unwrap_or("3306")
        .to_owned();
    let started = Instant::now();
    let children: Vec<_> = (0..clients)
        .map(|_| {
            std::process::Command::new("mariadb")
                .args(["-h", "127.0.0.1", "-P", &port, "-u", "root", "test"])
                .stdin(std::fs::File::open(&file).expect("calls"))
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("mariadb client")
        })
        .collect();
    let mut ok = true;
    for mut c in children {
        ok &= c.wait().is_ok_and(|s| s.success());
    }
    let took = started.elapsed().as_secs_f64();
    if !ok {
        eprintln!("a mariadb client failed");
        return 0.0;
    }
    (clients as u64 * per_client) as f64 / took
}

/// `n` distinct keys, each decided once by 64 callers, on a quota whose bucket is full again
/// within a millisecond.
async fn flood<B: Backend + Clone>(b: &B, n: u64) {
    let policy = Policy::new("flood", Quota::per_second(1000).burst(1));
    let p = Arc::new(b.prepare(&policy, &policy.validate().unwrap()).unwrap());
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..64u64 {
        let (b, p) = (b.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = c;
            while i < n {
                let _ = b
                    .decide(&p, &Key::from_bytes(format!("f{i}")).unwrap(), ONE)
                    .await;
                i += 64;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    println!(
        "\nflood of {n} distinct keys: {:.0} decisions/s",
        n as f64 / started.elapsed().as_secs_f64()
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "{} s per measurement; the bench, the database and its clients share the machine's cores",
        secs().as_secs()
    );
    rt.block_on(async {
        let only = std::env::var("ONLY").unwrap_or_default();
        #[cfg(feature = "postgres")]
        if only.is_empty() || only == "postgres" {
            postgres().await;
        }
        #[cfg(feature = "mysql")]
        if only.is_empty() || only == "mysql" {
            mysql().await;
        }
    });
}
