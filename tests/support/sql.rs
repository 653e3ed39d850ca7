//! Real PostgreSQL and MariaDB servers for tests and benches, each on a free port in its own
//! temporary directory, killed when dropped; nothing here talks to a server that happens to
//! run on the machine. PostgreSQL refuses to run as root: as root, the servers run as
//! `nobody`.
//!
//! The data directory of a fresh server is initialized once per machine (a template in the
//! temporary directory, made by the first test that needs it) and copied for each server,
//! which takes milliseconds instead of the seconds of `initdb`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use super::{free_port, wait_until};

/// Whether this process runs as root (the servers then run as `nobody`).
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program` as the servers' user: itself, or through `runuser -u nobody` as root.
fn as_server_user(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "nobody", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// Makes `path` the servers' user's (as root), so that they may write there.
fn give(path: &Path) {
    if is_root() {
        let ok = Command::new("chown")
            .args(["-R", "nobody"])
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "chown nobody {}", path.display());
    }
}

/// The newest installed PostgreSQL's binary `name` (Debian keeps them out of `PATH`).
fn pg_bin(name: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin").join(name))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| PathBuf::from(name))
}

/// A template made once per machine (and user) at `name` in the temporary directory, by
/// `make(dir)`; concurrent tests race to make it, one wins the rename.
fn template(name: &str, make: impl FnOnce(&Path)) -> PathBuf {
    let path = std::env::temp_dir().join(name);
    if path.join("ready").exists() {
        return path;
    }
    let tmp = tempfile::Builder::new()
        .prefix(&format!("{name}-making-"))
        .tempdir()
        .expect("temp dir");
    give(tmp.path());
    make(tmp.path());
    std::fs::write(tmp.path().join("ready"), b"").unwrap();
    let made = tmp.keep();
    if std::fs::rename(&made, &path).is_err() {
        // Another test made it first.
        let _ = std::fs::remove_dir_all(&made);
    }
    path
}

/// A copy of `template/data` in a fresh directory owned by the servers' user.
fn copy_data(template: &Path) -> TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let ok = Command::new("cp")
        .arg("-a")
        .arg(template.join("data"))
        .arg(dir.path())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "copy of {}", template.display());
    give(dir.path());
    dir
}

/// One PostgreSQL server (user `postgres`, trust authentication, database `postgres`).
pub struct PgServer {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl PgServer {
    /// A fresh server on a free port, ready to answer.
    pub fn start() -> PgServer {
        let template = template("tollgate-test-pg15", |dir| {
            let out = as_server_user(&pg_bin("initdb"))
                .args([
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "--no-sync",
                    "-E",
                    "UTF8",
                    "-D",
                ])
                .arg(dir.join("data"))
                .output()
                .expect(
                    "cannot run PostgreSQL's `initdb`: install PostgreSQL (Debian: apt-get \
                     install postgresql), or run ./scripts/test.sh, which does",
                );
            assert!(
                out.status.success(),
                "initdb: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        });
        let dir = copy_data(&template);
        let mut server = PgServer {
            port: free_port(),
            dir,
            child: None,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let child = as_server_user(&pg_bin("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=300",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start PostgreSQL's `postgres`");
        self.child = Some(child);
        let port = self.port.to_string();
        wait_until(Duration::from_secs(20), || {
            Command::new(pg_bin("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &port])
                .status()
                .is_ok_and(|s| s.success())
        })
        .unwrap_or_else(|| panic!("PostgreSQL on port {} did not start", self.port));
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`: every connection drops, no
    /// goodbye), keeping its data.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = as_server_user(&pg_bin("pg_ctl"))
                .args(["stop", "-m", "immediate", "-w", "-D"])
                .arg(self.dir.path().join("data"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and data (after crash recovery).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Freezes the server (SIGSTOP to the postmaster and its processes): connections stay
    /// open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(child) = &self.child {
            let pid = child.id().to_string();
            // The postmaster (runuser's child) and every process under it.
            let _ = Command::new("pkill").args([sig, "-P", &pid]).status();
            let _ = Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "for p in $(pgrep -P {pid}); do pkill {sig} -P $p; kill {sig} $p; done"
                ))
                .status();
        }
    }

    /// Runs `sql` with `psql`, answering its output (unaligned, tuples only).
    pub fn psql(&self, sql: &str) -> String {
        let out = Command::new(pg_bin("psql"))
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &self.url(),
                "-c",
            ])
            .arg(sql)
            .output()
            .expect("psql");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}
