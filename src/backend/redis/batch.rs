//! Batching: concurrent decisions on a single node share script calls.
//!
//! Requests queue their decisions for a task of the backend, which sends whatever is queued as
//! one call (up to [`MAX_BATCH`] decisions) as soon as one of [`MAX_IN_FLIGHT`] call slots is
//! free; the calls run inside that task. An idle backend therefore sends each decision at once, and a busy one pays Redis's
//! per-call cost (parsing, script lookup, the round trip through redis-rs) once per batch
//! instead of once per request. Calls belong to that task, not to the requests: a request that
//! gives up (times out, is dropped) affects no other. Each decision is still atomic and
//! all-or-nothing on its own: the script runs them one after another inside one call, and a
//! decision whose keys Redis refuses fails alone. Redis Cluster calls are not batched (the
//! decisions of one call must share a hash slot), and batching can be turned off
//! ([`batching`](super::RedisBackendBuilder::batching)) for proxies that shard one endpoint.

use std::future::poll_fn;
use std::sync::{Arc, Weak};
use std::task::Poll;

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::RedisResult;
use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::backend::{Inner, PolicyInner, bump};
use super::{keys, script};
use crate::Key;

/// The most decisions in one call: bounds how long one script call keeps Redis busy.
pub(crate) const MAX_BATCH: usize = 128;

/// Calls in flight at once per backend: while both are busy, decisions queue up into the next
/// batch. Two keep a distant Redis busy (up to 2 × [`MAX_BATCH`] decisions per round trip)
/// while batches stay large; with Redis on the application's own core, 4 slots cost about a
/// quarter more CPU per request than 2 (smaller batches, more switches between the two
/// processes; BENCHMARKS.md), and 1 measured the same as 2.
pub(crate) const MAX_IN_FLIGHT: usize = 2;

/// One decision waiting for a call. Its keys are written straight into the call's command by
/// the batching task: a queued decision holds no formatted strings.
pub(crate) struct Job {
    policy: Arc<PolicyInner>,
    key: Key,
    cost: u32,
    /// When the request gives up: the call carrying it may not outlast the earliest deadline
    /// of its decisions, and a decision still queued at its deadline is answered at once.
    deadline: Instant,
    reply: oneshot::Sender<RedisResult<Reply>>,
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

/// The queue to the task that makes the calls; the task is started on first use, and again if
/// its runtime went away.
#[derive(Default)]
pub(crate) struct Batcher {
    tx: ArcSwapOption<mpsc::UnboundedSender<Job>>,
}

impl Batcher {
    /// Queues one decision for the batching task, which also enforces the backend's timeout
    /// (one timer per call, not one per request). `None` outside a Tokio runtime (the task
    /// could not be started).
    pub(crate) fn submit(
        inner: &Arc<Inner>,
        policy: &Arc<PolicyInner>,
        key: &Key,
        cost: u32,
    ) -> Option<oneshot::Receiver<RedisResult<Reply>>> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            policy: policy.clone(),
            key: key.clone(),
            cost,
            deadline: Instant::now() + inner.timeout,
            reply,
        };
        let batcher = &inner.batcher;
        let job = match batcher.tx.load().as_deref() {
            Some(tx) => match tx.send(job) {
                Ok(()) => return Some(answer),
                // The task is gone (its runtime shut down): start another.
                Err(mpsc::error::SendError(job)) => job,
            },
            None => job,
        };
        let handle = tokio::runtime::Handle::try_current().ok()?;
        let (tx, rx) = mpsc::unbounded_channel();
        handle.spawn(drive(Arc::downgrade(inner), rx));
        // Cannot fail: the receiver was just made.
        let _ = tx.send(job);
        batcher.tx.store(Some(Arc::new(tx)));
        Some(answer)
    }
}

/// The answer of a call that never came (the batching task is gone).
pub(crate) fn abandoned() -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Io, "the batched call was abandoned"))
}

/// A script call that outlasted the backend's timeout.
pub(crate) fn timed_out() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the script call timed out",
    ))
}

/// Sends the queued decisions, a batch per call, at most [`MAX_IN_FLIGHT`] calls at a time,
/// until the backend is dropped. The calls run inside this task (no task per call).
async fn drive(inner: Weak<Inner>, mut rx: mpsc::UnboundedReceiver<Job>) {
    let mut calls = FuturesUnordered::new();
    let mut batch = Vec::with_capacity(MAX_BATCH);
    // Batches come back empty from their calls and are used again: no allocation per call.
    let mut spare: Vec<Vec<Job>> = Vec::with_capacity(MAX_IN_FLIGHT);
    loop {
        // Wait for queued decisions while a call slot is free, finishing calls meanwhile.
        let open = poll_fn(|cx| {
            while let Poll::Ready(Some(done)) = calls.poll_next_unpin(cx) {
                spare.push(done);
            }
            if calls.len() < MAX_IN_FLIGHT
                && let Poll::Ready(n) = rx.poll_recv_many(cx, &mut batch, MAX_BATCH)
            {
                return Poll::Ready(n > 0);
            }
            Poll::Pending
        })
        .await;
        let inner = match inner.upgrade() {
            Some(inner) if open => inner,
            // The backend is gone: let the calls in flight answer their requests, then stop.
            _ => {
                while calls.next().await.is_some() {}
                return;
            }
        };
        // Requests that gave up need no call; those whose deadline passed while queued behind
        // busy calls get their timeout now.
        let now = Instant::now();
        for job in batch.extract_if(.., |job| job.reply.is_closed() || job.deadline <= now) {
            let _ = job.reply.send(Err(timed_out()));
        }
        if batch.is_empty() {
            continue;
        }
        let next = spare.pop().unwrap_or_else(|| Vec::with_capacity(MAX_BATCH));
        let mut jobs = std::mem::replace(&mut batch, next);
        calls.push(async move {
            call(&inner, &mut jobs).await;
            jobs
        });
    }
}

/// The `EVALSHA` command for a batch, written in one buffer sized up front: the keys of every
/// decision, then each distinct policy's quotas once, then each decision's policy and cost
/// (see `gcra.lua`).
fn command(inner: &Inner, batch: &[Job]) -> redis::Cmd {
    // The batch's distinct policies (usually one or two), and each decision's, 1-based.
    let mut policies: SmallVec<[&PolicyInner; 4]> = SmallVec::new();
    let mut of_job: SmallVec<[usize; MAX_BATCH]> = SmallVec::new();
    for job in batch {
        let p = &*job.policy;
        let i = match policies.iter().position(|q| std::ptr::eq(*q, p)) {
            Some(i) => i,
            None => {
                policies.push(p);
                policies.len() - 1
            }
        };
        of_job.push(i + 1);
    }
    let nkeys: usize = batch.iter().map(|j| j.policy.key_suffixes.len()).sum();
    let policy_args: usize = policies.iter().map(|p| p.args.len()).sum();
    let nargs = 6 + nkeys + policy_args + 2 * batch.len();
    let mut cmd = redis::Cmd::with_capacity(nargs, 64 + nkeys * 96 + nargs * 12);
    cmd.arg("EVALSHA").arg(script::SCRIPT.get_hash()).arg(nkeys);
    let mut base = Vec::with_capacity(128);
    let mut key = Vec::with_capacity(160);
    for job in batch {
        keys::key_base(&job.policy.key_prefix, &job.key, &mut base);
        for suffix in &job.policy.key_suffixes {
            key.clear();
            key.extend_from_slice(&base);
            key.extend_from_slice(suffix);
            cmd.arg(&key[..]);
        }
    }
    match inner.clock.script_time() {
        Some(ns) => cmd.arg(ns),
        None => cmd.arg(""),
    };
    cmd.arg(policies.len());
    for p in &policies {
        cmd.arg(&p.args);
    }
    cmd.arg(batch.len());
    for (job, policy) in batch.iter().zip(&of_job) {
        cmd.arg(*policy).arg(job.cost);
    }
    cmd
}

async fn call(inner: &Inner, batch: &mut Vec<Job>) {
    let cmd = command(inner, batch);
    // The call may not outlast the first deadline of its decisions: a frozen Redis must not
    // hold requests past the timeout.
    let deadline = batch
        .iter()
        .map(|job| job.deadline)
        .min()
        .unwrap_or_else(Instant::now);
    bump(&inner.counters.script_calls);
    let result = match tokio::time::timeout_at(deadline, inner.conn.eval(&cmd)).await {
        Ok(result) => result,
        Err(_elapsed) => Err(timed_out()),
    };
    match result {
        Ok(reply) => {
            let all: Arc<[i64]> = reply.into();
            let mut start = 0;
            for job in batch.drain(..) {
                // A short reply gives the last decisions a short slice: they report a length
                // mismatch as a protocol error.
                let end = (start + 3 * job.policy.key_suffixes.len()).min(all.len());
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
