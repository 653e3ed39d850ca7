//! Batching: concurrent decisions on a single node share script calls.
//!
//! Requests queue their decisions for a task of the backend, which sends whatever is queued as
//! one call (up to [`MAX_BATCH`] decisions) as soon as one of [`MAX_IN_FLIGHT`] call slots is
//! free; the calls run inside that task. An idle backend therefore sends each decision at once,
//! and a busy one pays Redis's per-call cost (parsing, script lookup, the round trip through
//! redis-rs) once per batch instead of once per request. Calls belong to that task, not to the
//! requests: a request that gives up (times out, is dropped) affects no other.
//!
//! Every decision keeps its own deadline (the backend's timeout, counted from when it was
//! queued): a call runs until the last deadline of its decisions, and answers each decision
//! whose deadline passes in the meantime with a timeout, so a decision queued just before the
//! call left still gets its whole timeout, and none waits longer than its own. The circuit
//! breaker and the error counters learn from the call once, when it ends, however many
//! decisions it carried.
//!
//! Each decision is still atomic and all-or-nothing on its own: the script runs them one after
//! another inside one call, and a decision whose keys Redis refuses fails alone. Redis Cluster
//! calls are not batched (the decisions of one call must share a hash slot), and batching can
//! be turned off ([`batching`](super::RedisBackendBuilder::batching)) for proxies that shard
//! one endpoint.

use std::future::poll_fn;
use std::pin::pin;
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
    /// When the request gives up: a decision still queued at its deadline is answered at once,
    /// one in a call at its deadline even if the call goes on for later decisions.
    deadline: Instant,
    /// Taken when the decision is answered.
    reply: Option<oneshot::Sender<RedisResult<Reply>>>,
}

impl Job {
    /// Answers the decision, unless it already was.
    fn answer(&mut self, result: RedisResult<Reply>) {
        if let Some(reply) = self.reply.take() {
            // The request may have given up (its future dropped): nobody to tell.
            let _ = reply.send(result);
        }
    }

    /// Whether the request stopped waiting: it was answered, or its future was dropped.
    fn gave_up(&self) -> bool {
        self.reply.as_ref().is_none_or(|r| r.is_closed())
    }
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
        let now = Instant::now();
        let job = Job {
            policy: policy.clone(),
            key: key.clone(),
            cost,
            // The builder caps the timeout at an hour, so this cannot overflow; were it to,
            // an immediate timeout is better than a panic.
            deadline: now.checked_add(inner.timeout).unwrap_or(now),
            reply: Some(reply),
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
        // busy calls get their timeout now. They never reached Redis, so the breaker does not
        // hear of them (the calls that kept the slots busy report their own outcome).
        let now = Instant::now();
        for mut job in batch.extract_if(.., |job| job.gave_up() || job.deadline <= now) {
            job.answer(Err(timed_out()));
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
/// decision, then each distinct policy's quotas once, then the decisions' policies and costs,
/// in runs (see `gcra.lua`).
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
    let runs = script::runs(batch.iter().zip(&of_job).map(|(job, p)| (*p, job.cost)));
    let nargs = 6 + nkeys + policy_args + 3 * runs.len();
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
    cmd.arg(script::hex(policies.len() as u64).as_bytes());
    for p in &policies {
        cmd.arg(&p.args);
    }
    cmd.arg(script::hex(runs.len() as u64).as_bytes());
    for run in &runs {
        for n in run {
            cmd.arg(script::hex(*n).as_bytes());
        }
    }
    cmd
}

/// Runs one batch's call and answers its decisions: each at its own deadline if the call is
/// still running then, all the others with the call's outcome. The outcome is reported to the
/// breaker and the counters once.
async fn call(inner: &Arc<Inner>, batch: &mut Vec<Job>) {
    let cmd = command(inner, batch);
    bump(&inner.counters.script_calls);
    let mut eval = pin!(inner.conn.eval(&cmd));
    // One timer per call, set to the earliest deadline of the decisions still waiting: a frozen
    // Redis holds no request past its own timeout, and the call lasts as long as the request
    // that came last may wait.
    let first = next_deadline(batch).unwrap_or_else(Instant::now);
    let mut timer = pin!(tokio::time::sleep_until(first));
    let result = loop {
        let answered = poll_fn(|cx| {
            if let Poll::Ready(result) = eval.as_mut().poll(cx) {
                return Poll::Ready(Some(result));
            }
            timer.as_mut().poll(cx).map(|()| None)
        })
        .await;
        if let Some(result) = answered {
            break result;
        }
        let now = Instant::now();
        for job in batch.iter_mut().filter(|job| job.deadline <= now) {
            job.answer(Err(timed_out()));
        }
        match next_deadline(batch) {
            Some(next) => timer.as_mut().reset(next),
            // Every decision got its timeout: the call has failed.
            None => break Err(timed_out()),
        }
    };
    match &result {
        Ok(_) => inner.call_answered(),
        Err(err) => inner.call_failed(err, batch.len()),
    }
    match result {
        Ok(reply) => {
            let all: Arc<[i64]> = reply.into();
            let mut start = 0;
            // Decisions answered already (timed out) still own their part of the reply: the
            // offsets of the others depend on it.
            for mut job in batch.drain(..) {
                // A short reply gives the last decisions a short slice: they report a length
                // mismatch as a protocol error.
                let end = (start + job.policy.reply_len).min(all.len());
                job.answer(Ok(Reply {
                    all: all.clone(),
                    range: start..end,
                }));
                start = end;
            }
        }
        Err(err) => {
            for mut job in batch.drain(..) {
                job.answer(Err(err.clone()));
            }
        }
    }
}

/// The earliest deadline of the decisions of `batch` not answered yet.
fn next_deadline(batch: &[Job]) -> Option<Instant> {
    batch
        .iter()
        .filter(|job| job.reply.is_some())
        .map(|job| job.deadline)
        .min()
}
