//! Batching: concurrent decisions share calls to the store.
//!
//! Requests queue their decisions for a task of the backend, which sends whatever is queued as
//! one call (up to [`MAX_BATCH`] decisions) as soon as one of the store's call slots
//! ([`Store::calls_in_flight`]) is free; the calls run inside that task. An idle backend
//! therefore sends each decision at once, and a busy one pays the store's per-call cost
//! (parsing, the script's or statement's lookup, the round trip through the driver) once per
//! batch instead of once per request. Calls belong to that task, not to the requests: a
//! request that gives up (times out, is dropped) affects no other.
//!
//! Every decision keeps its own deadline (the backend's timeout, counted from when it was
//! queued): a call runs until the last deadline of its decisions, and answers each decision
//! whose deadline passes in the meantime with a timeout, so a decision queued just before the
//! call left still gets its whole timeout, and none waits longer than its own. The circuit
//! breaker and the error counters learn from the call once, when it ends, however many
//! decisions it carried; then each decision is finished (deny cache, failure policy) and
//! answered.
//!
//! Each decision is still atomic and all-or-nothing on its own: the store runs them one after
//! another inside one call, and a decision the store refuses fails alone.

use std::future::poll_fn;
use std::pin::pin;
use std::sync::{Arc, Weak};
use std::task::Poll;

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::MAX_BATCH;
use super::inner::{CallOrDecision, Inner, bump};
use super::store::{CallError, Job, Store};
use crate::BackendError;
use crate::backend::Decision;

/// A queued decision and whom to answer.
pub(crate) struct Queued<S: Store> {
    job: Job<S>,
    reply: oneshot::Sender<Result<Decision, BackendError>>,
}

/// The queue to the task that makes the calls; the task is started on first use, and again if
/// its runtime went away.
pub(crate) struct Batcher<S: Store> {
    tx: ArcSwapOption<mpsc::UnboundedSender<Queued<S>>>,
}

impl<S: Store> Default for Batcher<S> {
    fn default() -> Self {
        Batcher {
            tx: ArcSwapOption::empty(),
        }
    }
}

/// The answer a batched decision waits for.
pub(crate) type Answer = oneshot::Receiver<Result<Decision, BackendError>>;

impl<S: Store> Batcher<S> {
    /// Queues one decision for the batching task, which also enforces the backend's timeout
    /// (one timer per call, not one per request). Gives the job back outside a Tokio runtime
    /// (the task could not be started).
    pub(crate) fn submit(&self, inner: &Arc<Inner<S>>, job: Job<S>) -> Result<Answer, Job<S>> {
        let (reply, answer) = oneshot::channel();
        let batcher = self;
        let queued = Queued { job, reply };
        let queued = match batcher.tx.load().as_deref() {
            Some(tx) => match tx.send(queued) {
                Ok(()) => return Ok(answer),
                // The task is gone (its runtime shut down): start another.
                Err(mpsc::error::SendError(queued)) => queued,
            },
            None => queued,
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return Err(queued.job);
        };
        let (tx, rx) = mpsc::unbounded_channel();
        handle.spawn(drive(Arc::downgrade(inner), rx));
        // Cannot fail: the receiver was just made.
        let _ = tx.send(queued);
        batcher.tx.store(Some(Arc::new(tx)));
        Ok(answer)
    }
}

/// A batch: the decisions (as the store reads them) and, in the same order, whom to answer
/// (`None` once answered).
struct Batch<S: Store> {
    jobs: Vec<Job<S>>,
    replies: Vec<Option<oneshot::Sender<Result<Decision, BackendError>>>>,
}

impl<S: Store> Batch<S> {
    fn new() -> Self {
        Batch {
            jobs: Vec::with_capacity(MAX_BATCH),
            replies: Vec::with_capacity(MAX_BATCH),
        }
    }

    /// Whether decision `i` still waits: not answered, and its future not dropped.
    fn waits(&self, i: usize) -> bool {
        self.replies[i].as_ref().is_some_and(|r| !r.is_closed())
    }

    /// Finishes decision `i` with `outcome` and answers it, unless nobody waits for it.
    fn answer(&mut self, inner: &Inner<S>, i: usize, outcome: Result<Decision, CallOrDecision>) {
        if let Some(reply) = self.replies[i].take()
            && !reply.is_closed()
        {
            // The request may still give up before this arrives: nobody to tell then.
            let _ = reply.send(inner.finish(&self.jobs[i], outcome));
        }
    }

    /// The earliest deadline of the decisions still waiting.
    fn next_deadline(&self) -> Option<Instant> {
        (0..self.jobs.len())
            .filter(|&i| self.waits(i))
            .map(|i| self.jobs[i].deadline)
            .min()
    }
}

/// Sends the queued decisions, a batch per call, at most `calls_in_flight` calls at a time,
/// until the backend is dropped. The calls run inside this task (no task per call).
async fn drive<S: Store>(inner: Weak<Inner<S>>, mut rx: mpsc::UnboundedReceiver<Queued<S>>) {
    let mut calls = FuturesUnordered::new();
    let mut queued = Vec::with_capacity(MAX_BATCH);
    let slots = inner
        .upgrade()
        .map_or(1, |inner| inner.store.calls_in_flight().max(1));
    // Batches come back empty from their calls and are used again: no allocation per call.
    let mut spare: Vec<Batch<S>> = Vec::with_capacity(slots);
    loop {
        // Wait for queued decisions while a call slot is free, finishing calls meanwhile.
        let open = poll_fn(|cx| {
            while let Poll::Ready(Some(done)) = calls.poll_next_unpin(cx) {
                spare.push(done);
            }
            if calls.len() < slots
                && let Poll::Ready(n) = rx.poll_recv_many(cx, &mut queued, MAX_BATCH)
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
        // busy calls get their timeout now. They never reached the store, so the breaker does
        // not hear of them (the calls that kept the slots busy report their own outcome).
        let now = Instant::now();
        let mut batch = spare.pop().unwrap_or_else(Batch::new);
        for Queued { job, reply } in queued.drain(..) {
            if reply.is_closed() {
                continue;
            }
            if job.deadline <= now {
                let timed_out = Err(CallOrDecision::Call(CallError::timed_out()));
                let _ = reply.send(inner.finish(&job, timed_out));
                continue;
            }
            batch.jobs.push(job);
            batch.replies.push(Some(reply));
        }
        if batch.jobs.is_empty() {
            spare.push(batch);
            continue;
        }
        calls.push(async move {
            call(&inner, &mut batch).await;
            batch.jobs.clear();
            batch.replies.clear();
            batch
        });
    }
}

/// Runs one batch's call and answers its decisions: each at its own deadline if the call is
/// still running then, all the others with the call's outcome. The outcome is reported to the
/// breaker and the counters once.
async fn call<S: Store>(inner: &Arc<Inner<S>>, batch: &mut Batch<S>) {
    // Every request gave up while the batch formed: no call (and no failure to count).
    if batch.next_deadline().is_none() {
        return;
    }
    bump(&inner.counters.calls);
    let view = batch;
    let outcome = {
        let mut call = pin!(inner.store.call(&view.jobs, inner.clock.script_time()));
        // One timer per call, set to the earliest deadline of the decisions still waiting: a
        // frozen store holds no request past its own timeout, and the call lasts as long as
        // the request that came last may wait.
        let first = view.next_deadline().unwrap_or_else(Instant::now);
        let mut timer = pin!(tokio::time::sleep_until(first));
        loop {
            let answered = poll_fn(|cx| {
                if let Poll::Ready(result) = call.as_mut().poll(cx) {
                    return Poll::Ready(Some(result));
                }
                timer.as_mut().poll(cx).map(|()| None)
            })
            .await;
            if let Some(result) = answered {
                break result;
            }
            let now = Instant::now();
            for i in 0..view.replies.len() {
                if view.replies[i].is_some() && view.jobs[i].deadline <= now {
                    // Answered now, finished with the shared view of the jobs the call reads.
                    if let Some(reply) = view.replies[i].take()
                        && !reply.is_closed()
                    {
                        let timed_out = Err(CallOrDecision::Call(CallError::timed_out()));
                        let _ = reply.send(inner.finish(&view.jobs[i], timed_out));
                    }
                }
            }
            match view.next_deadline() {
                Some(next) => timer.as_mut().reset(next),
                // Every decision got its timeout: the call has failed.
                None => break Err(CallError::timed_out()),
            }
        }
    };
    match &outcome {
        Ok(_) => inner.call_answered(),
        Err(err) => inner.call_failed(err, view.jobs.len()),
    }
    let n = view.jobs.len();
    for (i, answer) in inner.split(outcome, n).into_iter().enumerate() {
        view.answer(inner, i, answer);
    }
}
