//! Real Redis servers for tests and benches: each starts its own `redis-server` on a free port
//! in a temporary directory (no persistence), and kills it when dropped. Nothing here talks to
//! a Redis that happens to run on the machine.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tollgate::backend::Backend;
use tollgate::{Key, Policy, Quota};

#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
pub mod conformance;
#[cfg(feature = "rls")]
pub mod envoy;
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
pub mod outage;
pub mod proxy;
#[cfg(feature = "metrics")]
pub mod recorded;
#[cfg(feature = "rls")]
pub mod rlqs;
#[cfg(feature = "server")]
pub mod server;
pub mod sql;

/// [`serve`]s `app`, answering its base URL (`http://127.0.0.1:<port>`).
pub async fn serve_app(app: axum::Router) -> String {
    format!("http://{}", serve(app).await)
}

/// Waits (real time, up to 5 s) until `what` holds; panics if it does not.
pub async fn wait_for(what: impl Fn() -> bool) {
    for _ in 0..500 {
        if what() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("not within 5 s");
}

/// Holds a request until `release` gives a permit (used up), or 10 s pass.
pub async fn held_until(release: &tokio::sync::Semaphore) {
    let wait = tokio::time::timeout(std::time::Duration::from_secs(10), release.acquire());
    if let Ok(Ok(permit)) = wait.await {
        permit.forget();
    }
}

/// A cost of `n` units.
pub fn cost(n: u32) -> std::num::NonZeroU32 {
    std::num::NonZeroU32::new(n).unwrap()
}

/// A byte key.
pub fn key(s: &str) -> Key {
    Key::from_bytes(s).unwrap()
}

/// `p` validated and prepared for `b`.
pub fn prepare<B: Backend>(b: &B, p: &Policy) -> B::Policy {
    b.prepare(p, &p.validate().unwrap()).unwrap()
}

/// A quota that does not refill during a test.
pub fn no_refill(burst: u32) -> Quota {
    Quota::per_day(1).burst(burst)
}

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    /// A standalone server on a free port, ready to answer.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A standalone server on a free port with extra `redis-server` arguments, ready to answer.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut server = RedisServer {
            port: free_port(),
            child: None,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "cannot start `redis-server`: install it (Debian: apt-get install redis-server), \
                 or run ./scripts/test.sh, which does",
            );
        self.child = Some(child);
        wait_until(Duration::from_secs(10), || {
            command(self.port, &["PING"])
                .is_some_and(|r| r.starts_with("+PONG") || r.starts_with("-NOAUTH"))
        })
        .unwrap_or_else(|| panic!("redis-server on port {} did not start", self.port));
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the server (SIGKILL: no goodbye to clients).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .arg(sig)
                .arg(child.id().to_string())
                .status();
        }
    }

    /// Starts the server again on the same port, with no data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Sends one command and returns the raw reply.
    pub fn cmd(&self, args: &[&str]) -> String {
        command(self.port, args).unwrap_or_default()
    }

    /// A bulk string reply's bytes (`GET`), binary-safe; `None` for a missing key or another
    /// reply.
    pub fn get_bytes(&self, key: &str) -> Option<Vec<u8>> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(format!("*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n", key.len()).as_bytes())
            .ok()?;
        let mut reply = Vec::new();
        let mut buf = [0; 4096];
        loop {
            let n = s.read(&mut buf).ok()?;
            if n == 0 {
                return None;
            }
            reply.extend_from_slice(&buf[..n]);
            let Some(eol) = reply.windows(2).position(|w| w == b"\r\n") else {
                continue;
            };
            let len: usize = std::str::from_utf8(reply.strip_prefix(b"$")?.get(..eol - 1)?)
                .ok()?
                .parse()
                .ok()?;
            if reply.len() >= eol + 2 + len + 2 {
                return Some(reply[eol + 2..eol + 2 + len].to_vec());
            }
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// A Redis Cluster of three primaries and no replicas.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        Self::start_with_replicas(0)
    }

    /// Three primaries, each with `replicas` replicas (which take over when it fails).
    pub fn start_with_replicas(replicas: usize) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    // Replicas take over however long ago they last heard from their primary
                    // (the tests' replicas are fresh; Redis's default check misjudges them).
                    "--cluster-replica-validity-factor",
                    "0",
                ])
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("cannot run `redis-cli` (Debian: apt-get install redis-tools)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        wait_until(Duration::from_secs(20), || {
            nodes
                .iter()
                .all(|n| n.cmd(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
        })
        .expect("cluster did not become ready");
        RedisCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

/// A port that is free, and whose cluster bus port (+10000) is free too.
pub fn free_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let seed = ((std::process::id() ^ nanos) % 30_000) as u16;
    let _ = NEXT.compare_exchange(0, 20_000 + seed, Ordering::AcqRel, Ordering::Relaxed);
    loop {
        let p = NEXT.fetch_add(1, Ordering::AcqRel);
        let p = if p >= 50_000 { 20_000 + p % 30_000 } else { p };
        if TcpListener::bind(("127.0.0.1", p)).is_ok()
            && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
        {
            return p;
        }
    }
}

fn wait_until(limit: Duration, mut ok: impl FnMut() -> bool) -> Option<()> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if ok() {
            return Some(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// One RESP command over a fresh connection; the reply's raw text.
fn command(port: u16, args: &[&str]) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.write_all(req.as_bytes()).ok()?;
    let mut buf = vec![0; 64 * 1024];
    let n = s.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Log lines written by a `tracing` subscriber into a shared buffer, for tests that check what
/// an operator would read.
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    /// Captures the events of the current thread at `INFO` and above, plain text, until the
    /// returned guard is dropped. Use a current-thread runtime, so that the backend's tasks log
    /// on this thread too.
    pub fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    /// Everything captured so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// The captured lines at `level` (`"WARN"`, `"INFO"`) that mention tollgate.
    pub fn lines(&self, level: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains(level) && l.contains("tollgate"))
            .map(str::to_owned)
            .collect()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A local port where nothing listens (connections are refused).
pub fn closed_port() -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    listener.local_addr().unwrap().port()
}

/// Polls `ok` every 10 ms until it holds, for at most 10 s (without blocking the runtime).
pub async fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Serves `app` on a free local port, recording peer addresses (for `PeerIp` / `ClientIp`).
pub async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

/// Certificates made for a test: a CA, a server certificate for `localhost` and `127.0.0.1`
/// signed by it, and a client certificate signed by it; PEM files in a temporary directory.
pub struct TlsFiles {
    pub dir: TempDir,
    pub ca_pem: String,
    pub client_cert_pem: String,
    pub client_key_pem: String,
}

impl TlsFiles {
    pub fn new() -> TlsFiles {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tollgate test CA");
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let server_key = KeyPair::generate().unwrap();
        let server = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&server_key, &issuer)
            .unwrap();
        let client_key = KeyPair::generate().unwrap();
        let client = CertificateParams::new(vec!["client".to_owned()])
            .unwrap()
            .signed_by(&client_key, &issuer)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("ca.crt", &ca_cert.pem());
        write("server.crt", &server.pem());
        write("server.key", &server_key.serialize_pem());
        TlsFiles {
            ca_pem: ca_cert.pem(),
            client_cert_pem: client.pem(),
            client_key_pem: client_key.serialize_pem(),
            dir,
        }
    }
}

impl RedisServer {
    /// A server listening only with TLS (certificates of `tls`), on a free port; clients must
    /// present a certificate when `auth_clients`. Its `url()` is `rediss://localhost:<port>`.
    pub fn start_tls(tls: &TlsFiles, auth_clients: bool) -> RedisServer {
        Self::start_tls_with(tls, auth_clients, &[])
    }

    /// [`start_tls`](Self::start_tls) with extra `redis-server` arguments.
    pub fn start_tls_with(tls: &TlsFiles, auth_clients: bool, more: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let cert = |name: &str| tls.dir.path().join(name).display().to_string();
        let extra: Vec<String> = [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &cert("server.crt"),
            "--tls-key-file",
            &cert("server.key"),
            "--tls-ca-cert-file",
            &cert("ca.crt"),
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ]
        .iter()
        .chain(more)
        .map(|s| s.to_string())
        .collect();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(&extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start `redis-server`");
        // Ready when the TLS port accepts connections.
        wait_until(Duration::from_secs(10), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        })
        .unwrap_or_else(|| panic!("redis-server (TLS) on port {port} did not start"));
        RedisServer {
            port,
            child: Some(child),
            dir,
            extra,
        }
    }

    /// The TLS URL of a server started with [`start_tls`](Self::start_tls).
    pub fn tls_url(&self) -> String {
        format!("rediss://localhost:{}", self.port)
    }
}

/// Redis Sentinel processes watching one primary under the name `mymaster`.
pub struct Sentinels {
    pub ports: Vec<u16>,
    children: Vec<Child>,
    _dirs: Vec<TempDir>,
}

impl Sentinels {
    /// `n` sentinels watching the primary on `primary_port` (quorum 2), declaring it down
    /// after 1 s without answers.
    pub fn start(primary_port: u16, n: usize) -> Sentinels {
        let (mut ports, mut children, mut dirs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..n {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = free_port();
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor mymaster 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds mymaster 1000\n\
                     sentinel failover-timeout mymaster 5000\n\
                     sentinel parallel-syncs mymaster 1\n",
                    dir.path().display()
                ),
            )
            .unwrap();
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("cannot start `redis-server --sentinel`");
            wait_until(Duration::from_secs(10), || {
                command(port, &["PING"]).is_some_and(|r| r.starts_with("+PONG"))
            })
            .unwrap_or_else(|| panic!("sentinel on port {port} did not start"));
            ports.push(port);
            children.push(child);
            dirs.push(dir);
        }
        Sentinels {
            ports,
            children,
            _dirs: dirs,
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }
}

impl Drop for Sentinels {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(feature = "redis")]
impl outage::Db for RedisServer {
    fn kill(&mut self) {
        RedisServer::kill(self)
    }
    fn restart(&mut self) {
        RedisServer::restart(self)
    }
    fn pause(&self) {
        RedisServer::pause(self)
    }
    fn resume(&self) {
        RedisServer::resume(self)
    }
}

/// A rate limit service's descriptor of `key=value` entries.
#[cfg(feature = "rls")]
pub fn rls_descriptor(
    entries: &[(&str, &str)],
) -> tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
    use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        RateLimitDescriptor, rate_limit_descriptor::Entry,
    };
    RateLimitDescriptor {
        entries: (entries.iter())
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

/// One descriptor of `key=value` entries, `hits` 1.
#[cfg(feature = "rls")]
pub fn request(
    domain: &str,
    entries: &[(&str, &str)],
) -> tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![rls_descriptor(entries)],
        hits_addend: 1,
    }
}

/// A rate limit service client of `127.0.0.1:port`.
#[cfg(feature = "rls")]
pub async fn rls_client(
    port: u16,
) -> tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<tonic::transport::Channel>{
    use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap()
}

/// Asks once: the overall code's name and the first status's `limit_remaining`.
#[cfg(feature = "rls")]
pub async fn ask(
    client: &mut tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    entries: &[(&str, &str)],
) -> (String, u32) {
    let r = client
        .should_rate_limit(request(domain, entries))
        .await
        .unwrap()
        .into_inner();
    (
        r.overall_code().as_str_name().to_owned(),
        r.statuses.first().map_or(0, |s| s.limit_remaining),
    )
}

/// Calls the gRPC method `path` of `127.0.0.1:port` with a message that is no message of the
/// method's (its field 1 with the wrong wire type), as a client stream; the status it ends
/// with.
#[cfg(feature = "rls")]
pub async fn grpc_garbage(port: u16, path: &'static str) -> tonic::Code {
    #[derive(Clone, PartialEq, prost::Message)]
    struct Garbage {
        #[prost(uint64, tag = "1")]
        x: u64,
    }
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<Garbage, Garbage>::default();
    let sent = tokio_stream::iter(vec![Garbage { x: 7 }]);
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    match grpc.streaming(tonic::Request::new(sent), path, codec).await {
        Err(status) => status.code(),
        Ok(answers) => {
            let mut answers = answers.into_inner();
            loop {
                match answers.message().await {
                    Err(status) => return status.code(),
                    Ok(None) => return tonic::Code::Ok,
                    Ok(Some(_)) => {}
                }
            }
        }
    }
}
