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
        // Another test process may take the port between the check and the bind: then
        // another one.
        for _ in 0..5 {
            if server.launch() {
                return server;
            }
            server.port = free_port();
        }
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        assert!(
            self.launch(),
            "PostgreSQL on port {} exited at once",
            self.port
        );
    }

    /// Starts the server; false when it exited at once (its port taken meanwhile).
    fn launch(&mut self) -> bool {
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
        let mut exited = false;
        wait_until(Duration::from_secs(20), || {
            exited = exited_early(&mut self.child);
            exited
                || Command::new(pg_bin("pg_isready"))
                    .args(["-q", "-h", "127.0.0.1", "-p", &port])
                    .status()
                    .is_ok_and(|s| s.success())
        })
        .unwrap_or_else(|| panic!("PostgreSQL on port {} did not start", self.port));
        !exited
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

    /// Starts `psql` running `sql` in the background (e.g. a transaction holding a lock).
    pub fn psql_spawn(&self, sql: &str) -> Child {
        Command::new(pg_bin("psql"))
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &self.url(), "-c"])
            .arg(sql)
            .stdout(Stdio::null())
            .spawn()
            .expect("psql")
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

/// One MariaDB server (user `root` without a password, database `test`). As root, `mariadbd`
/// switches to `nobody` itself (`--user`), so that the child is the server.
pub struct MariaDbServer {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl MariaDbServer {
    /// A fresh server on a free port, ready to answer.
    pub fn start() -> MariaDbServer {
        let template = template("tollgate-test-mariadb", |dir| {
            let init = dir.join("init.sql");
            std::fs::write(&init, "CREATE DATABASE IF NOT EXISTS test;\n").unwrap();
            give(&init);
            let out = as_server_user(Path::new("mariadb-install-db"))
                .args([
                    "--no-defaults",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    "--skip-name-resolve",
                    "--innodb-log-file-size=8M",
                ])
                .arg(format!("--extra-file={}", init.display()))
                .arg(format!("--datadir={}", dir.join("data").display()))
                .output()
                .expect(
                    "cannot run `mariadb-install-db`: install MariaDB (Debian: apt-get install \
                     mariadb-server), or run ./scripts/test.sh, which does",
                );
            assert!(
                out.status.success(),
                "mariadb-install-db: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        });
        let dir = copy_data(&template);
        let mut server = MariaDbServer {
            port: free_port(),
            dir,
            child: None,
        };
        // Another test process may take the port between the check and the bind: then
        // another one.
        for _ in 0..5 {
            if server.launch() {
                return server;
            }
            server.port = free_port();
        }
        server.spawn();
        server
    }

    /// `mariadbd`, in `PATH` or where Debian puts it.
    fn mariadbd() -> PathBuf {
        ["/usr/sbin/mariadbd", "/usr/sbin/mysqld"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .unwrap_or_else(|| PathBuf::from("mariadbd"))
    }

    fn spawn(&mut self) {
        assert!(
            self.launch(),
            "MariaDB on port {} exited at once: {}",
            self.port,
            std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
        );
    }

    /// Starts the server; false when it exited at once (its port taken meanwhile).
    fn launch(&mut self) -> bool {
        let d = self.dir.path().to_owned();
        let d = d.as_path();
        let mut command = Command::new(Self::mariadbd());
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", d.join("data").display()))
            .arg(format!("--port={}", self.port))
            .arg(format!("--socket={}", d.join("sock").display()))
            .arg(format!("--pid-file={}", d.join("pid").display()))
            .arg(format!("--log-error={}", d.join("error.log").display()))
            .arg(format!("--tmpdir={}", d.display()))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-log-bin",
                "--skip-name-resolve",
                "--innodb-log-file-size=8M",
                "--innodb-buffer-pool-size=32M",
                // Commits reach the OS at once: they survive a SIGKILL of the server.
                "--innodb-flush-log-at-trx-commit=2",
                "--innodb-doublewrite=0",
                "--max-connections=300",
            ]);
        if is_root() {
            command.arg("--user=nobody");
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start MariaDB's `mariadbd`");
        self.child = Some(child);
        let mut exited = false;
        wait_until(Duration::from_secs(30), || {
            exited = exited_early(&mut self.child);
            exited || self.try_sql("SELECT 1").is_some()
        })
        .unwrap_or_else(|| {
            panic!(
                "MariaDB on port {} did not start: {}",
                self.port,
                std::fs::read_to_string(d.join("error.log")).unwrap_or_default()
            )
        });
        !exited
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    /// Kills the server (SIGKILL: every connection drops, no goodbye), keeping its data.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and data (after crash recovery).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers. Returns once
    /// every thread has stopped: the kernel stops a process's threads one after another, and
    /// a thread not stopped yet may still answer a query.
    pub fn pause(&self) {
        self.signal("-STOP");
        let Some(child) = &self.child else { return };
        let tasks = PathBuf::from(format!("/proc/{}/task", child.id()));
        let stopped = || {
            std::fs::read_dir(&tasks).is_ok_and(|dir| {
                dir.flatten().all(|task| {
                    // `pid (comm) S ...`: the state follows the last `)`.
                    std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
                        stat.rsplit_once(')')
                            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['T', 't']))
                    })
                })
            })
        };
        wait_until(Duration::from_secs(5), stopped).expect("MariaDB did not stop");
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

    fn try_sql(&self, sql: &str) -> Option<String> {
        let out = Command::new("mariadb")
            .args([
                "--no-defaults",
                "-h",
                "127.0.0.1",
                "-P",
                &self.port.to_string(),
                "-u",
                "root",
                "--connect-timeout=2",
                "-N",
                "-B",
                "-e",
            ])
            .arg(sql)
            .arg("test")
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Runs `sql` with the `mariadb` client in database `test`, answering its output (tab
    /// separated, no column names).
    pub fn sql(&self, sql: &str) -> String {
        let out = Command::new("mariadb")
            .args([
                "--no-defaults",
                "-h",
                "127.0.0.1",
                "-P",
                &self.port.to_string(),
                "-u",
                "root",
                "-N",
                "-B",
                "-e",
            ])
            .arg(sql)
            .arg("test")
            .output()
            .expect("mariadb");
        assert!(
            out.status.success(),
            "mariadb {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl super::outage::Db for PgServer {
    fn kill(&mut self) {
        PgServer::kill(self)
    }
    fn restart(&mut self) {
        PgServer::restart(self)
    }
    fn pause(&self) {
        PgServer::pause(self)
    }
    fn resume(&self) {
        PgServer::resume(self)
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl super::outage::Db for MariaDbServer {
    fn kill(&mut self) {
        MariaDbServer::kill(self)
    }
    fn restart(&mut self) {
        MariaDbServer::restart(self)
    }
    fn pause(&self) {
        MariaDbServer::pause(self)
    }
    fn resume(&self) {
        MariaDbServer::resume(self)
    }
}

/// Whether the server process `child` has exited (it cannot serve); it is then forgotten.
fn exited_early(child: &mut Option<std::process::Child>) -> bool {
    let exited = child
        .as_mut()
        .is_some_and(|c| c.try_wait().ok().flatten().is_some());
    if exited {
        *child = None;
    }
    exited
}
