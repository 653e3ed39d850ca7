//! The `tollgate-server` binary, started as a process with the environment a test gives it
//! (on free ports, its log in a temporary directory), killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

/// A running `tollgate-server`.
pub struct ServerProcess {
    child: Option<Child>,
    dir: TempDir,
    /// `http://127.0.0.1:<PORT>`.
    pub http: String,
    pub grpc_port: u16,
    client: reqwest::Client,
}

impl ServerProcess {
    /// Starts the binary with `env` (and nothing else from this process's environment but
    /// `PATH`), on free ports unless `env` names them, bound to 127.0.0.1.
    pub fn start(env: &[(&str, String)]) -> ServerProcess {
        let dir = tempfile::tempdir().unwrap();
        let mut http_port = super::free_port();
        let mut grpc_port = super::free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate-server"));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOST", "127.0.0.1")
            .env("GRPC_HOST", "127.0.0.1");
        for (k, v) in env {
            match *k {
                "PORT" => http_port = v.parse().unwrap(),
                "GRPC_PORT" => grpc_port = v.parse().unwrap(),
                _ => {}
            }
            cmd.env(k, v);
        }
        cmd.env("PORT", http_port.to_string())
            .env("GRPC_PORT", grpc_port.to_string());
        let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("cannot start tollgate-server");
        ServerProcess {
            child: Some(child),
            dir,
            http: format!("http://127.0.0.1:{http_port}"),
            grpc_port,
            client: reqwest::Client::new(),
        }
    }

    /// What the server logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// `GET path`: status and body; `None` while nothing answers.
    pub async fn get(&self, path: &str) -> Option<(u16, String)> {
        let res = self
            .client
            .get(format!("{}{path}", self.http))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        let status = res.status().as_u16();
        Some((status, res.text().await.unwrap_or_default()))
    }

    /// Waits until `/healthcheck` answers as `want` says (30 s at most).
    pub async fn wait_health(&mut self, want: impl Fn(u16, &str) -> bool) -> (u16, String) {
        let start = Instant::now();
        let mut last = None;
        while start.elapsed() < Duration::from_secs(30) {
            if let Some((status, body)) = self.get("/healthcheck").await {
                if want(status, &body) {
                    return (status, body);
                }
                last = Some((status, body));
            }
            if let Some(Ok(Some(exit))) = self.child.as_mut().map(Child::try_wait) {
                panic!("tollgate-server exited ({exit}): {}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "/healthcheck never answered as expected (last {last:?}): {}",
            self.log()
        );
    }

    /// Waits for a 200 `/healthcheck`.
    pub async fn ready(&mut self) -> String {
        self.wait_health(|s, _| s == 200).await.1
    }

    /// `POST /json` with `body`: status and the answer (JSON, or the text as a string).
    pub async fn json(&self, body: &str) -> (u16, serde_json::Value) {
        let res = self
            .client
            .post(format!("{}/json", self.http))
            .body(body.to_owned())
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let text = res.text().await.unwrap();
        let value = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        (status, value)
    }

    /// A gRPC client of the rate limit service.
    pub async fn grpc(&self) -> RateLimitServiceClient<tonic::transport::Channel> {
        RateLimitServiceClient::connect(format!("http://127.0.0.1:{}", self.grpc_port))
            .await
            .unwrap()
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` (`TERM`, `STOP`, `CONT`) to the process.
    pub fn signal(&self, name: &str) {
        let pid = self.child.as_ref().unwrap().id();
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits for the process to exit (within `limit`), letting this test's runtime run (its
    /// clients must see the server's goodbye to close their connections).
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.as_mut()?.try_wait().unwrap() {
                self.child = None;
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
