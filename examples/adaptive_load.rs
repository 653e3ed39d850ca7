//! An open-loop load generator for `examples/adaptive` (issue 46's real-time benchmark).
//!
//! Run with: `cargo run --release --example adaptive_load` (against a server already running:
//! `scripts/bench-adaptive.sh` starts each contender and runs this).
//!
//! Requests leave at a fixed arrival rate, `RATE` per second, whatever the answers do: a
//! request is never held back because an earlier one has not come back (wrk and other
//! closed-loop generators slow down with the server and hide its queue). Each latency is taken
//! from the moment the request was *due*, so a generator that falls behind shows it as latency
//! (and as `lag_ms`), not as a lower rate.
//!
//! Every second it prints a line to stderr, and at the end it writes one CSV row per second to
//! `OUT` and one summary row to `SUMMARY` (each with a header when the file is new):
//! - goodput: 2xx answers within the SLO (`SLO_MS`, default 4 × `SERVICE_MS`);
//! - p50, p99 and mean latency of admitted requests (every answer but a 503; a request that
//!   timed out counts when it was given up, `TIMEOUT_MS` after it left);
//! - rejections (503) and the p99 time to answer one;
//! - `/critical`'s share (`CRITICAL`, a fraction of the requests) and its answers;
//! - the limit, read every 100 ms from `LIMIT_URL` when given (the first number after the word
//!   `limit`: the example's `/limit`, or Envoy's `concurrency_limit` statistic).
//!
//! Events are counted in the second they happen (a request in the second it was due, an answer
//! in the second it came), seconds counted from `ORIGIN_NS` (the server's start, Unix
//! nanoseconds; default now), so they line up with the server's `CAPACITY_SCHEDULE`, which
//! this reads too (with `CAPACITY` and `SERVICE_MS`) to write the capacity of each second. The
//! rows' `t` is the second since the load began (`START` after the origin). The summary's
//! `settled_*` latencies are of the seconds 10 s or more after a change (the load's start or a
//! step of the schedule).
//!
//! Variables: `URL` (`http://127.0.0.1:3000`), `RATE` (800), `START` (1: seconds after the
//! origin to begin), `DURATION` (60 s of sending), `TIMEOUT_MS` (1000), `CRITICAL` (0),
//! `SERVICE_MS` (20), `CAPACITY` (16), `CAPACITY_SCHEDULE`, `SLO_MS`, `LIMIT_URL`, and the
//! labels `LOAD` and `CONTENDER` written in every row.
//!
//! `RAW` (a path; off by default) writes every request too, one CSV row each:
//! `due_s,done_s,latency_ms,outcome,critical` (seconds since the load began; `outcome` one of
//! `ok`, `rejected`, `timeout`, `error`), so that any window's quantiles can be computed
//! exactly (`scripts/phases-adaptive.py`).

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// How a request ended.
#[derive(Clone, Copy, PartialEq)]
enum Outcome {
    /// A 2xx answer, its body read.
    Ok,
    /// A 503: refused by the limit in front of the service.
    Rejected,
    /// No answer within `TIMEOUT_MS`.
    Timeout,
    /// Any other status, or a connection error.
    Error,
}

/// What happened in one second.
#[derive(Default)]
struct Second {
    sent: u64,
    ok: u64,
    good: u64,
    rejected: u64,
    timeouts: u64,
    errors: u64,
    crit_sent: u64,
    crit_ok: u64,
    crit_good: u64,
    /// Latencies of admitted requests (µs): 2xx, errors other than 503, timeouts (when given
    /// up).
    admitted_us: Vec<u32>,
    /// Latencies of 503 answers (µs).
    rejected_us: Vec<u32>,
    /// Latencies of 503 answers from the moment the request left (µs): without the
    /// generator's own lag.
    rejected_sent_us: Vec<u32>,
    /// The limit, each time it was read.
    limits: Vec<u32>,
    /// The most a request left after it was due (µs).
    lag_us: u32,
}

/// The run's seconds, and the totals of `/critical` (whenever its answers came).
struct Stats {
    seconds: Mutex<Vec<Second>>,
    origin: Instant,
    crit_sent: AtomicU64,
    crit_ok: AtomicU64,
    crit_good: AtomicU64,
    /// Every request (`RAW`).
    requests: Option<Mutex<Vec<Request>>>,
}

/// A request: when it was due, when it ended, how, and whether it was `/critical`.
type Request = (Instant, Instant, Outcome, bool);

impl Stats {
    /// Runs `f` on the second `at` falls in (none before the origin or after the last).
    fn at(&self, at: Instant, f: impl FnOnce(&mut Second)) {
        let index = at.saturating_duration_since(self.origin).as_secs() as usize;
        let mut seconds = self.seconds.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(second) = seconds.get_mut(index) {
            f(second);
        }
    }
}

/// `16@0s,8@20s,16@40s`: capacities and when they start (as `examples/adaptive` reads it).
fn schedule(text: &str) -> Vec<(u32, u64)> {
    let mut steps: Vec<(u32, u64)> = (text.split(',').map(str::trim))
        .filter_map(|part| {
            let (c, at) = part.split_once('@')?;
            Some((
                c.trim().parse().ok()?,
                at.trim().strip_suffix('s')?.parse().ok()?,
            ))
        })
        .collect();
    steps.sort_by_key(|(_, at)| *at);
    steps
}

/// The first number after the word `limit` in `text`.
fn parse_limit(text: &str) -> Option<u32> {
    let at = text.find("limit")? + "limit".len();
    let rest = text[at..].trim_start_matches(|c: char| c == ':' || c.is_whitespace());
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The `q` quantile (nearest rank) of sorted `values`, in ms.
fn quantile_ms(sorted: &[u32], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(f64::from(sorted[rank - 1]) / 1000.0)
}

fn mean_ms(values: &[u32]) -> Option<f64> {
    (!values.is_empty())
        .then(|| values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64 / 1000.0)
}

fn ms(value: Option<f64>) -> String {
    value.map(|v| format!("{v:.2}")).unwrap_or_default()
}

/// Appends `row` to the CSV file `path`, with `header` first when the file is new or empty.
fn append(path: &str, header: &str, rows: &str) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    if file.metadata()?.len() == 0 {
        writeln!(file, "{header}")?;
    }
    file.write_all(rows.as_bytes())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url: String = env("URL", "http://127.0.0.1:3000".to_owned());
    let rate: f64 = env("RATE", 800.0);
    let start: u64 = env("START", 1);
    let duration: u64 = env("DURATION", 60);
    let timeout = Duration::from_millis(env("TIMEOUT_MS", 1000));
    let critical: f64 = env("CRITICAL", 0.0);
    let service_ms: f64 = env("SERVICE_MS", 20.0);
    let slo = Duration::from_secs_f64(env("SLO_MS", 4.0 * service_ms) / 1000.0);
    let capacity: u32 = env("CAPACITY", 16);
    let steps = schedule(&env("CAPACITY_SCHEDULE", String::new()));
    let limit_url: String = env("LIMIT_URL", String::new());
    let (load, contender): (String, String) =
        (env("LOAD", String::new()), env("CONTENDER", String::new()));
    if !(rate > 0.0 && rate.is_finite()) {
        return Err("RATE must be a positive number".into());
    }

    // The origin: the server's start, as an `Instant` of this process.
    let now_unix = SystemTime::now().duration_since(UNIX_EPOCH)?;
    let origin_unix = Duration::from_nanos(env("ORIGIN_NS", now_unix.as_nanos() as u64));
    let now = Instant::now();
    let origin = now
        .checked_sub(now_unix.saturating_sub(origin_unix))
        .unwrap_or(now);
    let (begin, end) = (
        origin + Duration::from_secs(start),
        origin + Duration::from_secs(start + duration),
    );
    let seconds = (start + duration) as usize + timeout.as_secs() as usize + 2;
    let stats = Arc::new(Stats {
        seconds: Mutex::new((0..seconds).map(|_| Second::default()).collect()),
        origin,
        crit_sent: AtomicU64::new(0),
        crit_ok: AtomicU64::new(0),
        crit_good: AtomicU64::new(0),
        requests: std::env::var_os("RAW").map(|_| Mutex::new(Vec::new())),
    });
    let client = Client::new(&url)?;

    // The limit, read every 100 ms while the load runs.
    if !limit_url.is_empty() {
        let (stats, poller) = (stats.clone(), Client::new(&limit_url)?);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(begin.into(), Duration::from_millis(100));
            loop {
                let at = tick.tick().await.into_std();
                if at >= end {
                    break;
                }
                let read = poller.get(poller.path.clone());
                if let Ok(Ok((200, body))) =
                    tokio::time::timeout(Duration::from_millis(500), read).await
                    && let Some(limit) = parse_limit(&String::from_utf8_lossy(&body))
                {
                    stats.at(at, |s| s.limits.push(limit));
                }
            }
        });
    }

    // A line on stderr each second (an answer still on its way may miss its line; the CSV,
    // written at the end, has it).
    let reporter = {
        let stats = stats.clone();
        tokio::spawn(async move {
            for t in start..start + duration {
                let at = origin + Duration::from_millis(t * 1000 + 1100);
                tokio::time::sleep_until(at.into()).await;
                let (line, mut admitted, mut rejected) = {
                    let seconds = stats.seconds.lock().unwrap_or_else(|e| e.into_inner());
                    let s = &seconds[t as usize];
                    let limit = s.limits.last().map_or_else(|| "-".into(), u32::to_string);
                    (
                        format!(
                            "t={t:>3} sent {:>5} good {:>5} rejected {:>5} timeouts {:>5} limit {limit:>4}",
                            s.sent, s.good, s.rejected, s.timeouts
                        ),
                        s.admitted_us.clone(),
                        s.rejected_us.clone(),
                    )
                };
                admitted.sort_unstable();
                rejected.sort_unstable();
                eprintln!(
                    "{line} p50 {:>7} p99 {:>8} ms, rejections p99 {} ms",
                    ms(quantile_ms(&admitted, 0.5)),
                    ms(quantile_ms(&admitted, 0.99)),
                    ms(quantile_ms(&rejected, 0.99)),
                );
            }
        })
    };

    // The arrivals: request `i` is due at `begin + i / rate`. A thread of its own sleeps until
    // each is due (the OS's timers, tens of µs late; tokio's are up to 1 ms late) and hands it
    // to the runtime.
    let runtime = tokio::runtime::Handle::current();
    let context = Arc::new(Context {
        client,
        slo,
        timeout,
        stats: stats.clone(),
    });
    tokio::task::spawn_blocking(move || {
        let (mut i, mut crit_due) = (0u64, 0u64);
        loop {
            let due = begin + Duration::from_secs_f64(i as f64 / rate);
            if due >= end {
                break;
            }
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            // `CRITICAL` of the requests, spread evenly.
            let is_critical = ((i + 1) as f64 * critical).floor() as u64 > crit_due;
            if is_critical {
                crit_due += 1;
                context.stats.crit_sent.fetch_add(1, Ordering::Relaxed);
            }
            let lag = Instant::now().saturating_duration_since(due).as_micros() as u32;
            context.stats.at(due, |s| {
                s.sent += 1;
                s.crit_sent += u64::from(is_critical);
                s.lag_us = s.lag_us.max(lag);
            });
            runtime.spawn(context.clone().request(due, is_critical));
            i += 1;
        }
    })
    .await?;
    // Every request has its answer or its timeout by then.
    tokio::time::sleep_until((end + timeout + Duration::from_millis(300)).into()).await;
    reporter.abort();

    // The capacity (requests at once) of second `t`, and the last change at or before it
    // (the start of the load counts as one).
    let capacity_at = |t: u64| {
        (steps.iter().rev())
            .find(|(_, at)| *at <= t)
            .map_or(capacity, |(c, _)| *c)
    };
    let changed_at = |t: u64| {
        (steps.iter().map(|(_, at)| *at))
            .filter(|at| *at > start && *at <= t)
            .max()
            .unwrap_or(start)
    };
    let mut rows = String::new();
    let (mut all, mut settled) = (Vec::new(), Vec::new());
    let (mut rejected, mut rejected_sent) = (Vec::new(), Vec::new());
    let mut totals = [0u64; 6];
    let mut max_lag = 0u32;
    {
        let mut seconds = stats.seconds.lock().unwrap_or_else(|e| e.into_inner());
        for t in start..start + duration {
            let s = &mut seconds[t as usize];
            s.admitted_us.sort_unstable();
            s.rejected_us.sort_unstable();
            s.rejected_sent_us.sort_unstable();
            all.extend_from_slice(&s.admitted_us);
            if t >= changed_at(t) + 10 {
                settled.extend_from_slice(&s.admitted_us);
            }
            rejected.extend_from_slice(&s.rejected_us);
            rejected_sent.extend_from_slice(&s.rejected_sent_us);
            for (total, n) in totals
                .iter_mut()
                .zip([s.sent, s.ok, s.good, s.rejected, s.timeouts, s.errors])
            {
                *total += n;
            }
            max_lag = max_lag.max(s.lag_us);
            let limits = |f: fn(&[u32]) -> Option<u32>| f(&s.limits).map(|l| l.to_string());
            let _ = writeln!(
                rows,
                "{load},{contender},{},{:.0},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.2}",
                t - start,
                f64::from(capacity_at(t)) * 1000.0 / service_ms,
                s.sent,
                s.ok,
                s.good,
                s.rejected,
                s.timeouts,
                s.errors,
                ms(quantile_ms(&s.admitted_us, 0.5)),
                ms(quantile_ms(&s.admitted_us, 0.99)),
                ms(mean_ms(&s.admitted_us)),
                ms(quantile_ms(&s.rejected_us, 0.99)),
                ms(quantile_ms(&s.rejected_sent_us, 0.99)),
                s.crit_sent,
                s.crit_ok,
                s.crit_good,
                limits(|l| l.last().copied()).unwrap_or_default(),
                limits(|l| l.iter().copied().min()).unwrap_or_default(),
                limits(|l| l.iter().copied().max()).unwrap_or_default(),
                f64::from(s.lag_us) / 1000.0,
            );
        }
    }
    all.sort_unstable();
    settled.sort_unstable();
    rejected.sort_unstable();
    rejected_sent.sort_unstable();
    let out: String = env("OUT", "target/adaptive-load.csv".to_owned());
    append(
        &out,
        "load,contender,t,capacity_rps,sent,ok,good,rejected,timeouts,errors,p50_ms,p99_ms,mean_ms,\
         rej_p99_ms,rej_sent_p99_ms,crit_sent,crit_ok,crit_good,limit,limit_min,limit_max,lag_ms",
        &rows,
    )?;
    let summary: String = env("SUMMARY", "target/adaptive-summary.csv".to_owned());
    let [sent, ok, good, rejected_n, timeouts, errors] = totals;
    append(
        &summary,
        "load,contender,rate,seconds,sent,ok,good,rejected,timeouts,errors,p50_ms,p99_ms,mean_ms,\
         settled_p50_ms,settled_p99_ms,settled_mean_ms,rej_p50_ms,rej_p99_ms,rej_sent_p99_ms,crit_sent,crit_ok,crit_good,max_lag_ms",
        &format!(
            "{load},{contender},{rate},{duration},{sent},{ok},{good},{rejected_n},{timeouts},{errors},{},{},{},{},{},{},{},{},{},{},{},{},{:.2}\n",
            ms(quantile_ms(&all, 0.5)),
            ms(quantile_ms(&all, 0.99)),
            ms(mean_ms(&all)),
            ms(quantile_ms(&settled, 0.5)),
            ms(quantile_ms(&settled, 0.99)),
            ms(mean_ms(&settled)),
            ms(quantile_ms(&rejected, 0.5)),
            ms(quantile_ms(&rejected, 0.99)),
            ms(quantile_ms(&rejected_sent, 0.99)),
            stats.crit_sent.load(Ordering::Relaxed),
            stats.crit_ok.load(Ordering::Relaxed),
            stats.crit_good.load(Ordering::Relaxed),
            f64::from(max_lag) / 1000.0,
        ),
    )?;
    if let (Some(requests), Ok(path)) = (&stats.requests, std::env::var("RAW")) {
        let requests = requests.lock().unwrap_or_else(|e| e.into_inner());
        let secs = |at: Instant| {
            if at >= begin {
                (at - begin).as_secs_f64()
            } else {
                -(begin - at).as_secs_f64()
            }
        };
        let mut text = String::with_capacity(40 * requests.len() + 64);
        text.push_str("due_s,done_s,latency_ms,outcome,critical\n");
        for &(due, done, outcome, critical) in requests.iter() {
            let outcome = match outcome {
                Outcome::Ok => "ok",
                Outcome::Rejected => "rejected",
                Outcome::Timeout => "timeout",
                Outcome::Error => "error",
            };
            let latency = done.saturating_duration_since(due).as_secs_f64() * 1000.0;
            let _ = writeln!(
                text,
                "{:.6},{:.6},{latency:.3},{outcome},{}",
                secs(due),
                secs(done),
                u8::from(critical)
            );
        }
        std::fs::write(&path, text)?;
    }
    eprintln!(
        "{load} {contender}: sent {sent} good {good} rejected {rejected_n} timeouts {timeouts} errors {errors} p99 {} ms (settled {} ms), rejections p99 {} ms ({} from the send), /critical {} of {}",
        ms(quantile_ms(&all, 0.99)),
        ms(quantile_ms(&settled, 0.99)),
        ms(quantile_ms(&rejected, 0.99)),
        ms(quantile_ms(&rejected_sent, 0.99)),
        stats.crit_ok.load(Ordering::Relaxed),
        stats.crit_sent.load(Ordering::Relaxed),
    );
    Ok(())
}

/// What every request needs.
struct Context {
    client: Client,
    slo: Duration,
    timeout: Duration,
    stats: Arc<Stats>,
}

impl Context {
    /// Sends one request, due at `due`, and counts how it ended.
    async fn request(self: Arc<Self>, due: Instant, critical: bool) {
        let sent = Instant::now();
        let path = if critical { "/critical" } else { "/" };
        let outcome = match tokio::time::timeout(self.timeout, self.client.get(path)).await {
            Ok(Ok((200..=299, _))) => Outcome::Ok,
            Ok(Ok((503, _))) => Outcome::Rejected,
            Ok(_) => Outcome::Error,
            Err(_) => Outcome::Timeout,
        };
        let done = Instant::now();
        let micros = |d: Duration| d.as_micros().min(u128::from(u32::MAX)) as u32;
        let latency = done.saturating_duration_since(due);
        let good = outcome == Outcome::Ok && latency <= self.slo;
        let stats = &self.stats;
        if let Some(requests) = &stats.requests {
            let mut requests = requests.lock().unwrap_or_else(|e| e.into_inner());
            requests.push((due, done, outcome, critical));
        }
        if critical && outcome == Outcome::Ok {
            stats.crit_ok.fetch_add(1, Ordering::Relaxed);
            (stats.crit_good).fetch_add(u64::from(good), Ordering::Relaxed);
        }
        stats.at(done, |s| {
            match outcome {
                Outcome::Ok => s.ok += 1,
                Outcome::Rejected => s.rejected += 1,
                Outcome::Timeout => s.timeouts += 1,
                Outcome::Error => s.errors += 1,
            }
            s.good += u64::from(good);
            if critical && outcome == Outcome::Ok {
                s.crit_ok += 1;
                s.crit_good += u64::from(good);
            }
            match outcome {
                Outcome::Rejected => {
                    s.rejected_us.push(micros(latency));
                    (s.rejected_sent_us).push(micros(done.saturating_duration_since(sent)));
                }
                // A request timed out counts when it was given up.
                _ => s.admitted_us.push(micros(latency)),
            }
        });
    }
}

/// A minimal HTTP/1.1 client for `GET`s to one server over kept-alive connections: a request
/// takes an idle connection (or opens one) and gives it back after a whole answer. Much less
/// work per request than a general client, so the generator takes less of the CPU it shares
/// with the server under test.
struct Client {
    addr: String,
    host: String,
    /// The path of the URL it was made from.
    path: String,
    idle: Mutex<Vec<TcpStream>>,
}

impl Client {
    /// A client for `http://host:port/path`.
    fn new(url: &str) -> Result<Self, String> {
        let rest = (url.strip_prefix("http://")).ok_or_else(|| format!("{url}: not http://"))?;
        let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let addr = if host.contains(':') {
            host.to_owned()
        } else {
            format!("{host}:80")
        };
        Ok(Client {
            addr,
            host: host.to_owned(),
            path: if path.is_empty() { "/" } else { path }.to_owned(),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// `GET path`: the status and the body. A kept-alive connection the server closed is
    /// retried once on a new one.
    async fn get(&self, path: impl AsRef<str>) -> std::io::Result<(u16, Vec<u8>)> {
        let request = format!(
            "GET {} HTTP/1.1\r\nhost: {}\r\n\r\n",
            path.as_ref(),
            self.host
        );
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(stream) = pooled {
            match exchange(stream, request.as_bytes()).await {
                Ok((status, body, Some(stream))) => {
                    self.give_back(stream);
                    return Ok((status, body));
                }
                Ok((status, body, None)) => return Ok((status, body)),
                Err(_) => {} // closed while idle: a new connection below
            }
        }
        let stream = TcpStream::connect(&self.addr).await?;
        stream.set_nodelay(true)?;
        let (status, body, stream) = exchange(stream, request.as_bytes()).await?;
        if let Some(stream) = stream {
            self.give_back(stream);
        }
        Ok((status, body))
    }

    fn give_back(&self, stream: TcpStream) {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(stream);
    }
}

/// Reads more of `stream` into `buf`; the end of the stream is an error (`what`: where).
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>, what: &str) -> std::io::Result<()> {
    if stream.read_buf(buf).await? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("closed {what}"),
        ));
    }
    Ok(())
}

/// Writes `request` on `stream` and reads one answer: its status, its body, and the stream
/// back unless the server said it closes it.
async fn exchange(
    mut stream: TcpStream,
    request: &[u8],
) -> std::io::Result<(u16, Vec<u8>, Option<TcpStream>)> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    stream.write_all(request).await?;
    let mut buf = Vec::with_capacity(512);
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        fill(&mut stream, &mut buf, "before an answer").await?;
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("head not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status: u16 = (lines.next().and_then(|l| l.split(' ').nth(1)))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status"))?;
    let (mut length, mut chunked, mut close) = (None, false, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        match name.as_str() {
            "content-length" => length = value.parse::<usize>().ok(),
            "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
            "connection" => close = value.eq_ignore_ascii_case("close"),
            _ => {}
        }
    }
    let mut rest = buf.split_off(head_end);
    let body = if chunked {
        // Chunks: a size line, the data, CRLF; a size of 0 (and its CRLF) ends them.
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(at) = rest.windows(2).position(|w| w == b"\r\n") {
                    break at;
                }
                fill(&mut stream, &mut rest, "in a chunk").await?;
            };
            let size_text = std::str::from_utf8(&rest[..line_end]).map_err(|_| bad("chunk"))?;
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("chunk size"))?;
            let need = line_end + 2 + size + 2;
            while rest.len() < need {
                fill(&mut stream, &mut rest, "in a chunk").await?;
            }
            body.extend_from_slice(&rest[line_end + 2..line_end + 2 + size]);
            rest.drain(..need);
            if size == 0 {
                break body;
            }
        }
    } else if let Some(length) = length {
        while rest.len() < length {
            fill(&mut stream, &mut rest, "in the body").await?;
        }
        rest.truncate(length);
        rest
    } else {
        // No length: the body runs to the connection's end.
        stream.read_to_end(&mut rest).await?;
        return Ok((status, rest, None));
    };
    Ok((status, body, (!close).then_some(stream)))
}
