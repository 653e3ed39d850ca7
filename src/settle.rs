//! Settling, the last stage of a request: what the wrapped service's answer says, once it comes.
//!
//! A policy can charge a request by its outcome instead of by its arrival alone:
//!
//! - [`Policy::charge_when`](crate::Policy::charge_when): the request counts only when its
//!   response matches ([`ChargeWhen`]); otherwise the units taken at admission are given back.
//!   Brute-force protection counts failed logins only.
//! - [`Policy::cost_from`](crate::Policy::cost_from): the request costs what its response
//!   reports ([`CostFrom`]: a header, or a [`Charge`] the handler puts in the response's
//!   extensions); the request's cost is taken at admission as an estimate and the difference
//!   settled (more taken, or some given back). A key taken past its limit is in debt, and
//!   refused until it is repaid.
//! - [`Policy::on_cancel`](crate::Policy::on_cancel): what a request is charged when it ends
//!   without a response (its future dropped because the client went away, or the inner
//!   service's error instead of a response).
//!
//! Admission still refuses a key that is at its limit before the inner service runs: a client
//! with five failed logins gets `429` without its password being checked.
//!
//! The settlement is made on the same store as the admission, atomically per bucket: a refund
//! never fills a bucket past full, a debit past empty leaves the key in debt. It is made when
//! the response's head comes back from the inner service (its status, headers and
//! extensions), or, for the rules that read it ([`ChargeWhen::grpc_status`],
//! [`CostFrom::trailer`], [`CostFrom::response_bytes`]), when its body ends; a body dropped
//! before its end (the client went away) is settled by the cancellation rule.
//!
//! Which stores settle: every one (the local backend, Redis, PostgreSQL, MySQL), on every
//! algorithm (a window gives units back only to the window, or sub-window, that counted them),
//! the approximate Redis mode included (its settlements go into the counts it sends: a
//! refund of units Redis already counts is taken off its counter by the next flush).
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response, StatusCode};
//! use tollgate::settle::ChargeWhen;
//! use tollgate::{Policy, Quota, RateLimitLayer, key::Global};
//! use tower::{Layer, Service, ServiceExt};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! // Two failures per hour; successes are free.
//! let layer = RateLimitLayer::builder()
//!     .key(Global)
//!     .policy(Policy::new("login", Quota::per_hour(2)).charge_when(ChargeWhen::status([401])))
//!     .build()
//!     .unwrap();
//! let mut svc = layer.layer(tower::service_fn(|req: Request<&'static str>| async move {
//!     let status = if *req.body() == "right" { StatusCode::OK } else { StatusCode::UNAUTHORIZED };
//!     let mut res = Response::new(http_body_util::Full::<bytes::Bytes>::default());
//!     *res.status_mut() = status;
//!     Ok::<_, Infallible>(res)
//! }));
//! let mut call = async |body| svc.ready().await.unwrap().call(Request::new(body)).await.unwrap().status();
//! for _ in 0..5 {
//!     assert_eq!(call("right").await, StatusCode::OK); // free
//! }
//! assert_eq!(call("wrong").await, StatusCode::UNAUTHORIZED);
//! assert_eq!(call("wrong").await, StatusCode::UNAUTHORIZED);
//! // Two failures: refused before the handler runs, even with the right password.
//! assert_eq!(call("right").await, StatusCode::TOO_MANY_REQUESTS);
//! # });
//! ```

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{HeaderMap, Response};

use crate::backend::{Backend, Decision, Mode};
use crate::body::{BodyGuard, BodyMode, Held};
pub use crate::charge::{Cancelled, Charge, ChargeWhen, CostFrom, ResponseInfo};
use crate::charge::{ChargeRules, End, Taken};
use crate::prepared::Prepared;
use crate::response::{HeaderAdds, add_headers};
use crate::wait::Pauses;
use crate::{BackendError, Key};

/// What a request settles once the wrapped service has answered. A layer and a policy that
/// settle nothing carry none (a `None`, checked once per response).
pub(crate) struct Settle<Bk: Backend> {
    /// An upstream's request to slow down, noted for the key (`obey_retry_after`).
    note: Option<(Key, Arc<Pauses>)>,
    /// The charge by outcome, when the policy settles.
    charge: Option<Charging<Bk>>,
    /// The request's slot in its policy's concurrent quota, when it has one: given back when
    /// the response body ends or is dropped, or when the request ends without a response.
    slot: Option<Slot<Bk>>,
}

/// What waits for the end of a response's body: a charge whose rules read it, and a slot of a
/// concurrent quota. At the end the charge settles; dropped before, it settles by its policy's
/// cancellation rule; the slot is given back either way.
struct Tail<Bk: Backend> {
    charge: Option<Charging<Bk>>,
    /// Held for its drop, which gives the slot back.
    _slot: Option<Slot<Bk>>,
    end: End,
}

impl<Bk: Backend> Held for Tail<Bk> {
    fn data(&mut self, n: u64) {
        self.end.bytes = self.end.bytes.saturating_add(n);
    }

    fn trailers(&mut self, trailers: &HeaderMap) {
        if let Some(charge) = &self.charge {
            charge.rules.trailers(&mut self.end, trailers);
        }
    }

    fn ended(&mut self) {
        if let Some(mut charge) = self.charge.take() {
            charge.settle_at_end(&self.end);
        }
    }
}

/// Where a request's settlements go: its key's buckets under its policy, on the layer's
/// backend.
struct Target<Bk: Backend> {
    backend: Arc<Bk>,
    prepared: Arc<Prepared<Bk::Policy>>,
    key: Key,
}

impl<Bk: Backend> Target<Bk> {
    fn new(backend: &Arc<Bk>, prepared: &Arc<Prepared<Bk::Policy>>, key: &Key) -> Self {
        Target {
            backend: backend.clone(),
            prepared: prepared.clone(),
            key: key.clone(),
        }
    }

    /// A refund of units taken at `admitted`, on the backend's clock.
    fn refund_of(&self, admitted: u64) -> Mode {
        refund_at(&*self.backend, admitted)
    }

    /// Makes the settlement (`units`, `mode`) on the store.
    fn send(&self, units: NonZeroU32, mode: Mode) {
        let prepared = &self.prepared;
        let name = prepared.policy.name();
        send(
            &*self.backend,
            &prepared.backend,
            name,
            &self.key,
            units,
            mode,
        );
    }
}

/// A request's slot in a concurrent quota, given back when dropped (once taken).
struct Slot<Bk: Backend> {
    target: Target<Bk>,
    /// The request's lease id ([`Mode::Hold`]).
    lease: u64,
    /// Whether the slot was taken (the request admitted): only then is there one to give back.
    taken: bool,
}

impl<Bk: Backend> Drop for Slot<Bk> {
    fn drop(&mut self) {
        if self.taken {
            let release = Mode::Release { lease: self.lease };
            self.target.send(NonZeroU32::MIN, release);
        }
    }
}

/// A request's admission, to be settled by its policy's rules.
struct Charging<Bk: Backend> {
    target: Target<Bk>,
    rules: Arc<ChargeRules>,
    taken: Taken,
    /// Set once the request was admitted (its units taken), to when, on the backend's clock
    /// ([`Backend::now_ns`]): only then is there anything to settle, by its response or, if
    /// it never comes, by the cancellation rule.
    admitted: Option<u64>,
}

impl<Bk: Backend> Settle<Bk> {
    /// What a request on `key` under `policy` settles: nothing (`None`) unless the layer obeys
    /// the wrapped service's requests to slow down, or the request is decided (`taken`: what
    /// it takes; `None` for a free request) under a policy that settles or holds slots.
    #[inline]
    pub(crate) fn new(
        backend: &Arc<Bk>,
        pauses: Option<&Arc<Pauses>>,
        prepared: &Arc<Prepared<Bk::Policy>>,
        taken: Option<Taken>,
        key: &Key,
    ) -> Option<Box<Self>> {
        let rules = |taken: Taken| match prepared.policy.settle_rules() {
            Some(rules) => Some(rules),
            // A request of cost 0 admitted at one unit gives it back (to the quotas that count
            // units: a policy of slots alone has none).
            None if taken.cost == 0
                && prepared.quota_units.iter().any(|(p, _)| !p.is_concurrent()) =>
            {
                Some(ChargeRules::give_back_the_unit())
            }
            None => None,
        };
        let charged = taken.and_then(|taken| Some((rules(taken)?, taken)));
        let holds = taken.is_some() && prepared.holds_slots;
        if pauses.is_none() && charged.is_none() && !holds {
            return None;
        }
        let slot = holds.then(|| Slot {
            target: Target::new(backend, prepared, key),
            lease: crate::backend::next_lease(),
            taken: false,
        });
        let charge = charged.map(|(rules, taken)| Charging {
            target: Target::new(backend, prepared, key),
            rules: rules.clone(),
            taken,
            admitted: None,
        });
        let note = pauses.map(|p| (key.clone(), p.clone()));
        Some(Box::new(Settle { note, charge, slot }))
    }

    /// The lease id the request holds its slot under, when its policy has a concurrent
    /// quota: admission decides with [`Mode::Hold`].
    #[inline]
    pub(crate) fn lease(settle: &Option<Box<Self>>) -> Option<u64> {
        settle.as_ref()?.slot.as_ref().map(|s| s.lease)
    }

    /// The request was admitted: from now on it is settled by its response, or by the
    /// cancellation rule if none comes.
    #[inline]
    pub(crate) fn arm(settle: &mut Option<Box<Self>>) {
        let Some(settle) = settle.as_mut() else {
            return;
        };
        if let Some(charge) = &mut settle.charge {
            charge.admitted = Some(charge.target.backend.now_ns());
        }
        if let Some(slot) = &mut settle.slot {
            slot.taken = true;
        }
    }
}

impl<Bk: Backend> Charging<Bk> {
    /// Settles as `res` says.
    fn settle(&mut self, res: &ResponseInfo<'_>) {
        let Some(admitted) = self.admitted.take() else {
            return;
        };
        let refund = self.target.refund_of(admitted);
        if let Some((mode, units)) = self.rules.settlement(self.taken, res, refund) {
            self.target.send(units, mode);
        }
    }

    /// Settles as the end of the response's body says.
    fn settle_at_end(&mut self, end: &End) {
        let Some(admitted) = self.admitted.take() else {
            return;
        };
        let refund = self.target.refund_of(admitted);
        if let Some((mode, units)) = self.rules.settlement_at_end(self.taken, end, refund) {
            self.target.send(units, mode);
        }
    }
}

/// Makes a settlement on the store: at once for an in-memory store, else in a task of its own,
/// returned (the layer's response does not wait for it; the store's timeout bounds it; a
/// caller that must see it made awaits the task, and one dropped meanwhile leaves it running).
pub(crate) fn send<Bk: Backend>(
    backend: &Bk,
    policy: &Bk::Policy,
    name: &str,
    key: &Key,
    units: NonZeroU32,
    mode: Mode,
) -> Option<tokio::task::JoinHandle<()>> {
    let mut settled = backend.decide_with(policy, key, units, mode);
    match Pin::new(&mut settled).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(_)) => None,
        Poll::Ready(Err(error)) => {
            tracing::debug!(policy = name, %error, ?mode, "settlement failed");
            None
        }
        Poll::Pending => match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let name = name.to_owned();
                Some(runtime.spawn(async move {
                    if let Err(error) = settled.await {
                        tracing::debug!(policy = name, %error, ?mode, "settlement failed");
                    }
                }))
            }
            Err(_) => {
                tracing::debug!(policy = name, ?mode, "settlement dropped: no runtime");
                None
            }
        },
    }
}

/// Whether a decision took anything for its request (units, a slot): an allowed decision with
/// quota states. One without them let the request through untracked (a store failing open, a
/// key the local backend's full table does not track).
pub(crate) fn took(result: &Result<Decision, BackendError>) -> bool {
    matches!(result, Ok(d) if d.is_allowed() && !d.quotas().is_empty())
}

/// Sees through a decision whose request went away while the store was still making it: the
/// store may still take units or a slot for it, so it is awaited in a task of its own and
/// `undo` is given what it answered, to give back what it took. Without a Tokio runtime
/// (a decision dropped at the runtime's shutdown) it cannot be awaited: what it takes stays
/// taken until its lease ends, and a debug line says so.
pub(crate) fn see_through<F, U>(decision: F, undo: U)
where
    F: Future<Output = Result<Decision, BackendError>> + Send + Unpin + 'static,
    U: FnOnce(Result<Decision, BackendError>) + Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move { undo(decision.await) });
        }
        Err(_) => tracing::debug!("a decision in flight dropped without a runtime: not undone"),
    }
}

/// A decision that undoes what it took when dropped before it lands (see [`see_through`]).
pub(crate) struct Landing<F, U>
where
    F: Future<Output = Result<Decision, BackendError>> + Send + Unpin + 'static,
    U: FnOnce(Result<Decision, BackendError>) + Send + Unpin + 'static,
{
    decision: Option<F>,
    undo: Option<U>,
}

impl<F, U> Landing<F, U>
where
    F: Future<Output = Result<Decision, BackendError>> + Send + Unpin + 'static,
    U: FnOnce(Result<Decision, BackendError>) + Send + Unpin + 'static,
{
    pub(crate) fn new(decision: F, undo: U) -> Self {
        Landing {
            decision: Some(decision),
            undo: Some(undo),
        }
    }
}

impl<F, U> Future for Landing<F, U>
where
    F: Future<Output = Result<Decision, BackendError>> + Send + Unpin + 'static,
    U: FnOnce(Result<Decision, BackendError>) + Send + Unpin + 'static,
{
    type Output = Result<Decision, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(decision) = self.decision.as_mut() else {
            return Poll::Pending;
        };
        let result = std::task::ready!(Pin::new(decision).poll(cx));
        // Landed: the caller has it, nothing to undo.
        self.decision = None;
        self.undo = None;
        Poll::Ready(result)
    }
}

impl<F, U> Drop for Landing<F, U>
where
    F: Future<Output = Result<Decision, BackendError>> + Send + Unpin + 'static,
    U: FnOnce(Result<Decision, BackendError>) + Send + Unpin + 'static,
{
    fn drop(&mut self) {
        if let (Some(decision), Some(undo)) = (self.decision.take(), self.undo.take()) {
            see_through(decision, undo);
        }
    }
}

impl<Bk: Backend> Drop for Charging<Bk> {
    /// A request admitted and never answered (its future dropped) is settled by its policy's
    /// cancellation rule.
    fn drop(&mut self) {
        if let Some(admitted) = self.admitted
            && self.rules.cancelled == Cancelled::Refund
        {
            self.target
                .send(self.taken.units, self.target.refund_of(admitted));
        }
    }
}

/// A refund of units taken at `admitted` (on the backend's clock, [`Backend::now_ns`]).
pub(crate) fn refund_at<Bk: Backend>(backend: &Bk, admitted: u64) -> Mode {
    Mode::Refund {
        admitted_ago: Duration::from_nanos(backend.now_ns().saturating_sub(admitted)),
    }
}

/// The wrapped service's response, settled, in the layer's body type, with the fields admission
/// decided.
#[inline]
pub(crate) fn settle<B, M: BodyMode<B>, Bk: Backend>(
    res: Response<B>,
    adds: Option<HeaderAdds>,
    settle: Option<Box<Settle<Bk>>>,
) -> Response<M::Body> {
    if let Some((key, pauses)) = settle.as_ref().and_then(|s| s.note.as_ref()) {
        pauses.note(key, &res);
    }
    let (charge, slot) = match settle {
        Some(mut s) => (s.charge.take(), s.slot.take().filter(|s| s.taken)),
        None => (None, None),
    };
    // A charge that waits for the body's end goes with the body, as does a slot: given back
    // when it ends or is dropped.
    let charge = match charge {
        Some(mut charge) if !charge.rules.needs_end() => {
            charge.settle(&ResponseInfo::new(&res));
            None
        }
        Some(charge) if charge.admitted.is_some() => {
            let end = charge.rules.head(&ResponseInfo::new(&res));
            Some((charge, end))
        }
        _ => None,
    };
    let mut res = if charge.is_none() && slot.is_none() {
        M::pass_response(res)
    } else {
        let (charge, end) = charge.map_or((None, End::default()), |(c, e)| (Some(c), e));
        M::hold(
            res,
            BodyGuard::new(Tail {
                charge,
                _slot: slot,
                end,
            }),
        )
    };
    if let Some(adds) = adds {
        add_headers(res.headers_mut(), adds);
    }
    res
}
