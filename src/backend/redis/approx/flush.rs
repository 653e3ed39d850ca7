//! The background task: sends queued increments, reads the counts that are due, and sweeps
//! keys whose windows have passed.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use redis::Value;
use smallvec::SmallVec;

use super::{Entry, Increments, PolicyShared, Shared, announce};

/// Keys per pipeline on a single node.
const JOBS_PER_CALL: usize = 256;

/// How often idle keys are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The least time between two sweeps a full key table asks for.
const FORCED_SWEEP_GAP: Duration = Duration::from_millis(100);

/// The task's loop, until the backend is dropped.
pub(super) async fn run(shared: Weak<Shared>, wake: Arc<tokio::sync::Notify>) {
    let mut last_sweep = Instant::now();
    loop {
        let wait = match shared.upgrade() {
            None => return,
            Some(s) if has_work(&s) && s.may_call() => s.mode.flush_every,
            // Redis is not called until the breaker's probe is due: nothing to do before.
            Some(s) if has_work(&s) => s.until_probe().clamp(Duration::from_millis(1), SWEEP_EVERY),
            Some(s) => announce::until_due(&s).clamp(Duration::from_millis(1), SWEEP_EVERY),
        };
        let _ = tokio::time::timeout(wait, wake.notified()).await;
        let Some(mut s) = shared.upgrade() else {
            return;
        };
        if has_work(&s) && s.may_call() {
            // Let more work join the batch, unless enough units are queued already or
            // requests wait for it.
            if s.queued_units.load(Ordering::Relaxed) < s.mode.flush_after
                && s.waiters.load(Ordering::Acquire) == 0
                && !s.urgent.swap(false, Ordering::Relaxed)
            {
                let every = s.mode.flush_every;
                drop(s);
                let _ = tokio::time::timeout(every, wake.notified()).await;
                s = match shared.upgrade() {
                    Some(s) => s,
                    None => return,
                };
            }
            flush(&s, false).await;
        } else if s.waiters.load(Ordering::Acquire) > 0 {
            // The breaker opened under requests waiting for a flush: none will come soon.
            release_waiters(&s);
        }
        let since = last_sweep.elapsed();
        let forced = since >= FORCED_SWEEP_GAP && s.sweep_now.swap(false, Ordering::Relaxed);
        if since >= SWEEP_EVERY || forced {
            if !s.may_call() {
                prune(&s);
            }
            // A sweep walks every key held (a million take tens of milliseconds): off the
            // runtime's threads, so that requests and flushes go on meanwhile; one at a time.
            if !s.sweeping.swap(true, Ordering::AcqRel) {
                let swept = Sweeping(s.clone());
                let run = move || sweep(&swept.0);
                match tokio::runtime::Handle::try_current() {
                    Ok(handle) => drop(handle.spawn_blocking(run)),
                    Err(_) => run(),
                }
            }
            last_sweep = Instant::now();
        }
    }
}

/// Something is queued, or a request waits for a flush (one that began after its units were
/// taken by a flush already under way: an empty flush answers it).
fn has_work(s: &Shared) -> bool {
    s.waiters.load(Ordering::Acquire) > 0
        || !s.dirty.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
        || announce::due(s)
}

/// What one key sends in a flush. A job dropped before its replies were taken in (its call
/// cancelled: a runtime shutting down, a caller's timeout) counts as failed: its units are
/// sent again and its key read again.
struct Job {
    shared: Arc<Shared>,
    done: bool,
    policy: Arc<PolicyShared>,
    entry: Arc<Entry>,
    /// The key's `confirmations` when the job was made.
    seen: u64,
    writes: Increments,
    /// Quota, first sub-window, how many, and the current sub-window of the read.
    reads: SmallVec<[(usize, u64, usize, u64); 1]>,
    /// A block this instance started, to write: until when (µs), and for how long.
    block: Option<(u64, u64)>,
    /// Whether the reads read the key's block too (a policy with `block_for`).
    read_block: bool,
}

/// What a job takes from its key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Take {
    /// Units owed, and the reads due (a flush).
    Due,
    /// A read of every quota, and nothing else (a synchronous decision on a key not read yet).
    Read,
}

impl Job {
    fn of(
        s: &Arc<Shared>,
        policy: Arc<PolicyShared>,
        entry: Arc<Entry>,
        take: Take,
    ) -> Option<Job> {
        let now_us = s.now.us();
        let mut writes = Increments::new();
        let mut reads = SmallVec::new();
        let mut block = None;
        let seen;
        {
            let mut st = entry.lock();
            if take == Take::Due {
                st.queued = false;
            }
            let read_any = take == Take::Read || !st.reading;
            for (spec, c) in policy.specs.iter().zip(st.quotas.iter_mut()) {
                let slice = spec.slice_at(now_us);
                c.advance(slice);
                if take == Take::Due {
                    for (at, units, ttl) in c.take_unsent() {
                        writes.push((spec.index, at, units, ttl));
                    }
                }
                let due = match take {
                    Take::Read => true,
                    // Nothing to learn of a key whose counts have all left the window.
                    Take::Due => {
                        c.read_due(spec, now_us, s.settle_us(spec)) && !c.is_idle(spec, now_us)
                    }
                };
                if read_any && due {
                    let (first, n) = c.read_range();
                    reads.push((spec.index, first, n, slice));
                }
            }
            if !reads.is_empty() {
                st.reading = true;
            }
            if take == Take::Due && st.block_owed {
                if st.blocked_until_us > now_us {
                    block = Some((st.blocked_until_us, st.blocked_until_us - now_us));
                }
                st.block_owed = false;
            }
            seen = st.confirmations;
        }
        let read_block = !reads.is_empty() && policy.block_us > 0;
        (!writes.is_empty() || !reads.is_empty() || block.is_some()).then(|| Job {
            shared: s.clone(),
            done: false,
            policy,
            entry,
            seen,
            writes,
            reads,
            block,
            read_block,
        })
    }

    fn commands(&self, pipe: &mut redis::Pipeline) {
        for &(q, slice, units, ttl) in &self.writes {
            let spec = &self.policy.specs[q];
            let key = self
                .entry
                .redis_key(&self.policy, &self.shared, spec, slice);
            pipe.cmd("INCRBY").arg(&key).arg(units);
            // Once per sub-window and instance (the first increment Redis confirms sets it), and
            // again when an increment finds the counter gone.
            if ttl {
                pipe.cmd("PEXPIRE").arg(&key).arg(spec.ttl_ms()).ignore();
            }
        }
        for &(q, first, n, _) in &self.reads {
            let spec = &self.policy.specs[q];
            let mget = pipe.cmd("MGET");
            for slice in first..first + n as u64 {
                mget.arg(
                    self.entry
                        .redis_key(&self.policy, &self.shared, spec, slice),
                );
            }
        }
        // A block: its end (µs on the instances' clocks), expiring with it; one already there
        // is kept (a block runs its course, it is not extended).
        if let Some((until_us, left_us)) = self.block {
            pipe.cmd("SET")
                .arg(self.entry.block_key(&self.policy, &self.shared))
                .arg(until_us)
                .arg("PX")
                .arg((left_us / 1000).max(1))
                .arg("NX")
                .ignore();
        }
        if self.read_block {
            pipe.cmd("GET")
                .arg(self.entry.block_key(&self.policy, &self.shared));
        }
    }

    fn replies(&self) -> usize {
        self.writes.len() + self.reads.len() + usize::from(self.read_block)
    }

    /// Takes the replies in, or on failure (`None`) queues the units to be sent again.
    fn apply(mut self, values: Option<&[Value]>) {
        self.done = true;
        let s = &*self.shared;
        let Some(values) = values.filter(|v| v.len() == self.replies()) else {
            self.failed();
            return;
        };
        let (w, r) = values.split_at(self.writes.len());
        let (r, blocked) = r.split_at(self.reads.len());
        let reads: Option<Vec<SmallVec<[u32; 4]>>> = r
            .iter()
            .zip(&self.reads)
            .map(|(v, &(_, _, n, _))| match v {
                Value::Array(items) if items.len() == n => items.iter().map(count).collect(),
                _ => None,
            })
            .collect();
        let mut st = self.entry.lock();
        if !self.reads.is_empty() {
            st.reading = false;
        }
        // A read replaces the counts held only if no other call's increments were taken in
        // since it was made (its own go before it in the same pipeline).
        let fresh = st.confirmations == self.seen;
        let mut refused = 0u64;
        let (mut written, mut units_sent) = (0u64, 0u64);
        for (&(q, slice, units, ttl), v) in self.writes.iter().zip(w) {
            match count(v) {
                Some(count) => {
                    st.quotas[q].confirmed(slice, units, count, ttl);
                    let sent = u64::try_from(units).unwrap_or(0);
                    s.units_sent.fetch_add(sent, Ordering::Relaxed);
                    written += 1;
                    units_sent += sent;
                }
                // Redis refused this one command (its memory full, a key of another type in
                // the way): sending it again would fail the same way, and a whole batch must
                // not be resent. The units stay counted here.
                None => {
                    st.quotas[q].refused(slice, units);
                    refused += u64::try_from(units).unwrap_or(0);
                }
            }
        }
        if !self.writes.is_empty() {
            st.confirmations += 1;
        }
        let reads_ok = reads.is_some();
        // Another instance's block (or this one's), as Redis has it.
        if let Some(until) = blocked
            .first()
            .and_then(|v| redis::from_redis_value_ref(v).ok())
        {
            let until: u64 = until;
            st.blocked_until_us = st.blocked_until_us.max(until);
        }
        if let Some(reads) = reads {
            for (&(q, first, _, as_of), fleet) in self.reads.iter().zip(reads) {
                st.quotas[q].read_reply(first, &fleet, as_of, fresh);
            }
            if !self.reads.is_empty() {
                s.reads.fetch_add(1, Ordering::Relaxed);
            }
        }
        let keys_read = u64::from(!self.reads.is_empty() && reads_ok);
        crate::metrics::approx_synced(written, units_sent, keys_read);
        if written > 0 || keys_read > 0 {
            let now_us = s.now.us();
            let over: u64 = self
                .policy
                .specs
                .iter()
                .zip(st.quotas.iter_mut())
                .map(|(spec, c)| u64::from(c.over_limit(spec, now_us)))
                .sum();
            crate::metrics::approx_over_limit(over);
        }
        if st.quotas.iter().any(|c| c.owes()) {
            s.enqueue(&self.policy, &self.entry, &mut st);
        }
        drop(st);
        if refused > 0 && s.refused_units(refused) {
            tracing::warn!(
                policy = %self.policy.name,
                "approximate mode: Redis refused an increment (its memory full? a key of \
                 another type in the way?); its units are counted here only (at most one \
                 warning a minute; `stats().units_refused` counts them)"
            );
        }
    }

    /// The call failed, or never ran: the units go back to be sent again, and the key is read
    /// again.
    fn failed(&mut self) {
        self.done = true;
        let mut st = self.entry.lock();
        if !self.reads.is_empty() {
            st.reading = false;
        }
        for &(q, slice, units, _) in &self.writes {
            st.quotas[q].failed(slice, units);
        }
        if self.block.is_some() {
            st.block_owed = true;
        }
        self.shared.enqueue(&self.policy, &self.entry, &mut st);
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.done {
            self.failed();
        }
    }
}

/// A counter's value in a reply: an integer, a number in a string, or nothing (zero).
fn count(v: &Value) -> Option<u32> {
    let n: Option<i64> = redis::from_redis_value_ref(v).ok()?;
    Some(u32::try_from(n.unwrap_or(0).max(0)).unwrap_or(u32::MAX))
}

/// Sends what is queued and reads what is due. `force` ignores an open circuit breaker.
pub(super) async fn flush(s: &Arc<Shared>, force: bool) {
    if !force && !s.may_call() {
        release_waiters(s);
        return;
    }
    // One at a time, so that flushes are answered in the order they began.
    let _one = s.flushing.lock().await;
    let seq = s.flushes_started.fetch_add(1, Ordering::SeqCst) + 1;
    // Before the queue is taken: units queued meanwhile count towards the next batch.
    s.queued_units.store(0, Ordering::Relaxed);
    let queued = std::mem::take(&mut *s.dirty.lock().unwrap_or_else(|e| e.into_inner()));
    let jobs: Vec<Job> = queued
        .into_iter()
        .filter_map(|(p, e)| Job::of(s, p, e, Take::Due))
        .collect();
    send(s, jobs).await;
    s.flushed.send_modify(|done| *done = (*done).max(seq));
    announce::exchange(s, force).await;
}

/// Lets requests waiting for a flush go on without one (Redis is not being called): their
/// units stay queued for when it is.
fn release_waiters(s: &Shared) {
    if s.waiters.load(Ordering::Acquire) > 0 {
        let seq = s.flushes_started.fetch_add(1, Ordering::SeqCst) + 1;
        s.flushed.send_modify(|done| *done = (*done).max(seq));
    }
}

/// While Redis is not called, drops from the queue the keys whose counts have all left their
/// windows (nothing of theirs matters any more), so that the sweep can forget them.
fn prune(s: &Shared) {
    let now_us = s.now.us();
    // Out of the queue's lock while entries are locked: decisions lock an entry, then the
    // queue (to queue it), and the opposite order here could deadlock with them.
    let mut queued = std::mem::take(&mut *s.dirty.lock().unwrap_or_else(|e| e.into_inner()));
    queued.retain(|(p, e)| {
        let mut st = e.lock();
        let idle = p.specs.iter().zip(st.quotas.iter_mut()).all(|(spec, c)| {
            c.advance(spec.slice_at(now_us));
            c.is_idle(spec, now_us) && !c.owes()
        });
        if idle {
            st.queued = false;
        }
        !idle
    });
    s.dirty
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .append(&mut queued);
}

/// Reads a key's counts now (a synchronous decision on a key not read yet). The call runs on
/// its own task: a request dropped meanwhile does not leave the key's read half done.
pub(super) async fn read_now(s: &Arc<Shared>, policy: &Arc<PolicyShared>, entry: &Arc<Entry>) {
    if let Some(job) = Job::of(s, policy.clone(), entry.clone(), Take::Read) {
        let s = s.clone();
        let _ = tokio::spawn(async move { send(&s, vec![job]).await }).await;
    }
}

/// Sends jobs, in pipelines of many keys on a single node, one per key on a cluster (whose
/// keys must share a slot), all at once.
async fn send(s: &Shared, jobs: Vec<Job>) {
    if jobs.is_empty() {
        return;
    }
    let per_call = if s.conn.is_cluster() {
        1
    } else {
        JOBS_PER_CALL
    };
    let mut groups: Vec<Vec<Job>> = Vec::new();
    let mut jobs = jobs.into_iter().peekable();
    while jobs.peek().is_some() {
        groups.push(jobs.by_ref().take(per_call).collect());
    }
    futures_util::future::join_all(groups.into_iter().map(|group| call(s, group))).await;
}

async fn call(s: &Shared, jobs: Vec<Job>) {
    let mut pipe = redis::pipe();
    // A command Redis refuses fails alone (its reply is an error value), not the whole call.
    pipe.ignore_errors();
    for job in &jobs {
        job.commands(&mut pipe);
    }
    let reply = tokio::time::timeout(s.opts.timeout, s.conn.pipeline(&pipe)).await;
    let expected: usize = jobs.iter().map(Job::replies).sum();
    match reply {
        Ok(Ok(values)) if values.len() == expected => {
            s.call_ok();
            let mut at = 0;
            for job in jobs {
                let n = job.replies();
                job.apply(Some(&values[at..at + n]));
                at += n;
            }
        }
        other => {
            let err = match other {
                Err(_) => "timed out".to_owned(),
                Ok(Err(e)) => e.to_string(),
                Ok(Ok(v)) => format!("{} replies for {expected} commands", v.len()),
            };
            s.call_failed(&err);
            for job in jobs {
                job.apply(None);
            }
        }
    }
}

/// Marks a sweep as over when dropped: after it ran, or if its runtime shut down before it
/// could run (the next runtime's task sweeps again).
struct Sweeping(Arc<Shared>);

impl Drop for Sweeping {
    fn drop(&mut self) {
        self.0.sweeping.store(false, Ordering::Release);
    }
}

/// Forgets keys whose counts have all left their windows and that owe Redis nothing.
fn sweep(s: &Shared) {
    let now_us = s.now.us();
    let policies: Vec<Arc<PolicyShared>> = s
        .policies
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let mut removed = 0;
    for p in policies {
        p.entries.retain(|_, held| {
            if held.busy_until_us.load(Ordering::Relaxed) > now_us {
                return true; // decided on too recently to be idle
            }
            let e = &held.entry;
            if Arc::strong_count(e) > 1 {
                return true; // a decision or a flush holds it
            }
            let keep = match e.state.try_lock() {
                Ok(st) => busy(&p, &st, now_us),
                Err(std::sync::TryLockError::Poisoned(st)) => busy(&p, &st.into_inner(), now_us),
                Err(std::sync::TryLockError::WouldBlock) => true,
            };
            removed += usize::from(!keep);
            keep
        });
    }
    s.keys.fetch_sub(removed, Ordering::Relaxed);
    crate::metrics::approx_keys(-(removed as f64));
    if s.hot_keys.load(Ordering::Relaxed) > 0 {
        let mut gone = 0;
        s.hot.retain(|_, until| {
            let keep = *until > now_us;
            gone += usize::from(!keep);
            keep
        });
        s.hot_keys.fetch_sub(gone, Ordering::Relaxed);
    }
}

/// Whether an entry still matters: queued, being read, blocked, or with counts in their
/// windows.
fn busy(p: &PolicyShared, st: &super::EntryState, now_us: u64) -> bool {
    st.queued
        || st.reading
        || st.blocked_until_us > now_us
        || !p
            .specs
            .iter()
            .zip(st.quotas.iter())
            .all(|(spec, c)| c.is_idle(spec, now_us))
}
