//! A fault-injecting TCP proxy for tests: between a client and a server, it forwards bytes,
//! or delays them, stalls, drops or resets connections, loses replies, as told, while running.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does to the traffic now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forwards everything.
    Pass,
    /// Forwards everything, each chunk late by this much.
    Delay(Duration),
    /// Forwards nothing and closes nothing: the path is black-holed. A connection that carried
    /// traffic while stalled stays dead (as a TCP connection whose packets vanish does, until
    /// its keepalive gives up): only new connections work once the fault is gone.
    Stall,
    /// Resets client connections (RST) as soon as they send anything.
    Reset,
    /// Forwards requests to the server, but its replies never come back (half-open); such a
    /// connection stays dead, as with `Stall`.
    HalfOpen,
    /// Forwards requests; after one that holds these bytes (a command's name), resets the
    /// client connection before the reply: the server ran the command, the client saw a broken
    /// connection. Other traffic (a new connection's handshake) passes.
    LoseReplyTo(&'static str),
}

/// A proxy on a free local port in front of `127.0.0.1:<upstream>`.
pub struct FaultProxy {
    pub port: u16,
    fault: Arc<Mutex<Fault>>,
}

impl FaultProxy {
    pub async fn start(upstream: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let fault = Arc::new(Mutex::new(Fault::Pass));
        let shared = fault.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let fault = shared.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    // Every close the proxy makes is a reset (RST), as a broken network's.
                    let _ = client.set_zero_linger();
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    // When either direction ends, both connections are closed.
                    let dead = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    tokio::select! {
                        _ = pump(cr, sw, fault.clone(), dead.clone(), true) => {}
                        _ = pump(sr, cw, fault, dead, false) => {}
                    }
                });
            }
        });
        FaultProxy { port, fault }
    }

    pub fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

/// Copies `from` to `to` as the fault says; `up` is the client-to-server direction.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    fault: Arc<Mutex<Fault>>,
    dead: Arc<std::sync::atomic::AtomicBool>,
    up: bool,
) {
    use std::sync::atomic::Ordering;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let now = *fault.lock().unwrap();
        if dead.load(Ordering::Relaxed) {
            continue;
        }
        match now {
            Fault::Pass => {}
            Fault::Delay(d) => tokio::time::sleep(d).await,
            Fault::Stall => {
                dead.store(true, Ordering::Relaxed);
                continue;
            }
            Fault::HalfOpen if !up => {
                dead.store(true, Ordering::Relaxed);
                continue;
            }
            Fault::HalfOpen => {}
            Fault::Reset if up => return,
            Fault::LoseReplyTo(name)
                if up && buf[..n].windows(name.len()).any(|w| w == name.as_bytes()) =>
            {
                // The server gets the command (and runs it: it reads what was sent before the
                // close); both connections close before its reply can come back.
                let _ = to.write_all(&buf[..n]).await;
                return;
            }
            Fault::Reset | Fault::LoseReplyTo(_) => {}
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
