//! Batching: concurrent decisions on a single node share one script call.
//!
//! At most one call is in flight per backend. The request that finds none in flight makes the
//! call itself, at once, with whatever is queued (so an idle backend adds no hop and no wait);
//! requests arriving meanwhile queue up, and when the call returns the queue (up to
//! [`MAX_BATCH`] decisions) goes out as the next call, made by the request that led, or by a
//! task once that request has its own answer. A busy backend therefore pays Redis's per-call
//! cost (parsing, script lookup, the round trip through redis-rs) once per batch instead of
//! once per request. Each decision is still atomic and all-or-nothing on its own: the script
//! runs them one after another inside one call. Redis Cluster calls are not batched (the
//! decisions of one call must share a hash slot).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use redis::RedisResult;
use tokio::sync::oneshot;

use super::backend::{Inner, bump};
use super::script;

/// The most decisions in one call: bounds how long one script call keeps Redis busy.
pub(crate) const MAX_BATCH: usize = 64;

/// One decision waiting for a call.
pub(crate) struct Job {
    pub(crate) keys: Vec<Vec<u8>>,
    pub(crate) cost: u32,
    /// The policy's formatted quota parameters (two per quota).
    pub(crate) args: Arc<[Vec<u8>]>,
    pub(crate) reply: oneshot::Sender<RedisResult<Reply>>,
}

/// One decision's part of a call's reply, shared without copying.
pub(crate) struct Reply {
    all: Arc<[i64]>,
    range: std::ops::Range<usize>,
}

impl Reply {
    /// A whole reply.
    pub(crate) fn whole(all: Vec<i64>) -> Self {
        let range = 0..all.len();
        Reply {
            all: all.into(),
            range,
        }
    }
}

impl std::ops::Deref for Reply {
    type Target = [i64];

    fn deref(&self) -> &[i64] {
        &self.all[self.range.clone()]
    }
}

/// The queue, and whether some request or task is making calls.
#[derive(Default)]
pub(crate) struct Batcher {
    queue: Mutex<Vec<Job>>,
    leading: AtomicBool,
}

impl Batcher {
    /// Runs one decision's script call: queued, and sent by whoever leads; this request leads
    /// when nobody does.
    pub(crate) async fn run(
        inner: &Arc<Inner>,
        keys: Vec<Vec<u8>>,
        cost: u32,
        args: Arc<[Vec<u8>]>,
    ) -> RedisResult<Reply> {
        let (reply, mut answer) = oneshot::channel();
        let batcher = &inner.batcher;
        batcher.lock().push(Job {
            keys,
            cost,
            args,
            reply,
        });
        if !batcher.leading.swap(true, Ordering::SeqCst) {
            // Hands the lead on when this request is done, or dropped (timed out) mid-call.
            let _lead = Lead(inner.clone());
            loop {
                match answer.try_recv() {
                    Ok(result) => return result,
                    Err(oneshot::error::TryRecvError::Closed) => return Err(abandoned()),
                    Err(oneshot::error::TryRecvError::Empty) => {}
                }
                let mut batch = batcher.take();
                if batch.is_empty() {
                    break;
                }
                call(inner, &mut batch).await;
            }
        }
        answer.await.unwrap_or_else(|_| Err(abandoned()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Job>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next batch: up to [`MAX_BATCH`] queued decisions whose requests still wait.
    fn take(&self) -> Vec<Job> {
        let mut queue = self.lock();
        queue.retain(|job| !job.reply.is_closed());
        let n = queue.len().min(MAX_BATCH);
        queue.drain(..n).collect()
    }
}

/// The answer of a decision whose call was given up (it timed out, or its leader was dropped).
fn abandoned() -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Io, "the batched call was abandoned"))
}

/// The lead: while held, its holder makes the calls. Dropping it gives the lead up, and, when
/// decisions still wait, hands it to a task.
struct Lead(Arc<Inner>);

impl Drop for Lead {
    fn drop(&mut self) {
        let batcher = &self.0.batcher;
        batcher.leading.store(false, Ordering::SeqCst);
        // A request that queued after the last batch was taken, and found the lead held,
        // waits for us: take the lead back for it (unless it already took it).
        if !batcher.lock().is_empty() && !batcher.leading.swap(true, Ordering::SeqCst) {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    handle.spawn(lead(Lead(self.0.clone())));
                }
                Err(_) => batcher.leading.store(false, Ordering::SeqCst),
            }
        }
    }
}

/// Makes calls until the queue is empty.
async fn lead(lead: Lead) {
    loop {
        let mut batch = lead.0.batcher.take();
        if batch.is_empty() {
            return;
        }
        call(&lead.0, &mut batch).await;
    }
}

async fn call(inner: &Inner, batch: &mut Vec<Job>) {
    let mut invocation = script::SCRIPT.prepare_invoke();
    match inner.clock.script_time() {
        Some(ns) => invocation.arg(ns),
        None => invocation.arg(""),
    };
    invocation.arg(batch.len());
    for job in batch.iter() {
        invocation
            .key(&job.keys)
            .arg(job.keys.len())
            .arg(job.cost)
            .arg(&*job.args);
    }
    bump(&inner.counters.script_calls);
    // A call may not outlive the timeout: a frozen Redis must not hold the queue.
    let result = match tokio::time::timeout(inner.timeout, inner.conn.invoke(&invocation)).await {
        Ok(result) => result,
        Err(_elapsed) => Err(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the script call timed out",
        ))),
    };
    match result {
        Ok(reply) => {
            let all: Arc<[i64]> = reply.into();
            let mut start = 0;
            for job in batch.drain(..) {
                // A short reply gives the last decisions a short slice: they report a length
                // mismatch as a protocol error.
                let end = (start + 3 * job.keys.len()).min(all.len());
                let _ = job.reply.send(Ok(Reply {
                    all: all.clone(),
                    range: start..end,
                }));
                start = end;
            }
        }
        Err(err) => {
            for job in batch.drain(..) {
                let _ = job.reply.send(Err(err.clone()));
            }
        }
    }
}
