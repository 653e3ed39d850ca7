//! Policies: a name, the quotas a request must all pass, and what a request costs.

use std::fmt;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::quota::QuotaParams;
use crate::{ConfigError, Quota, RequestInfo};

/// A named set of quotas that must all pass, and the cost of a request.
///
/// The name appears in the `RateLimit` and `RateLimit-Policy` response headers and in logs;
/// it also separates buckets: two policies with different names never share state.
///
/// ```
/// use tollgate::{Policy, Quota};
///
/// // 10 per second with bursts of 20, and at most 1000 per hour.
/// let policy = Policy::new("api", Quota::per_second(10).burst(20))
///     .and(Quota::per_hour(1000))
///     // Uploads count five times.
///     .cost_fn(|req| if req.method() == http::Method::POST { 5 } else { 1 });
/// assert_eq!(policy.quotas().len(), 2);
/// ```
#[derive(Clone)]
pub struct Policy {
    name: Arc<str>,
    quotas: SmallVec<[Quota; 2]>,
    cost: Cost,
    shadow: bool,
    shadow_headers: bool,
    /// How requests are settled after their response, when they are.
    settle: Option<Arc<crate::charge::ChargeRules>>,
    /// How long a key is refused once refused (`block_for`).
    block: Option<std::time::Duration>,
    /// Whether units are given back to its keys by other means than its own settlement rules
    /// (a [`Limiter`](crate::limiter::Limiter)'s permits settle).
    given_back: bool,
    /// What live keys keep when the quotas' values change.
    on_change: crate::quota::OnChange,
}

#[derive(Clone)]
enum Cost {
    Fixed(u32),
    /// The request's `Content-Length`, or `missing` without one.
    ContentLength {
        missing: u32,
    },
    Fn(Arc<dyn Fn(&RequestInfo<'_>) -> u32 + Send + Sync>),
}

impl Policy {
    /// The same policy with each quota (and its place) passed through `f`.
    #[cfg(feature = "calendar")]
    pub(crate) fn map_quotas(&self, f: impl Fn(usize, Quota) -> Quota) -> Policy {
        let mut out = self.clone();
        for (i, q) in out.quotas.iter_mut().enumerate() {
            *q = f(i, *q);
        }
        out
    }

    /// The most quotas one policy may have.
    pub const MAX_QUOTAS: usize = 8;

    /// A policy named `name` with one quota and a cost of 1 per request.
    pub fn new(name: impl Into<Arc<str>>, quota: Quota) -> Self {
        let mut quotas = SmallVec::new();
        quotas.push(quota);
        Policy {
            name: name.into(),
            quotas,
            cost: Cost::Fixed(1),
            shadow: false,
            shadow_headers: false,
            settle: None,
            block: None,
            given_back: false,
            on_change: crate::quota::OnChange::Keep,
        }
    }

    /// This policy with every quota at its share on one of `instances` instances (see
    /// `Quota::share`): what the local fallback enforces while the shared store is down.
    #[cfg(any(
        feature = "redis",
        feature = "postgres",
        feature = "mysql",
        feature = "rls-client"
    ))]
    pub(crate) fn share(&self, instances: u32) -> Policy {
        let mut shared = self.clone();
        for quota in &mut shared.quotas {
            *quota = quota.share(instances);
        }
        shared
    }

    /// Adds a quota that must also pass.
    pub fn and(mut self, quota: Quota) -> Self {
        self.quotas.push(quota);
        self
    }

    /// Every request costs `cost` units (default 1). A cost of 0 lets the request through
    /// without counting it and without rate-limit headers, unless the policy holds slots
    /// ([`Quota::concurrent`]: a slot is one request whatever its cost) or settles after the
    /// response ([`charge_when`](Self::charge_when), [`cost_from`](Self::cost_from)): such a
    /// request is admitted at one unit (a key with nothing left is refused, as for any
    /// request), holds its slot, and gets the unit back when it is settled: it ends up costing
    /// what its response reports, or nothing.
    pub fn cost(mut self, cost: u32) -> Self {
        self.cost = Cost::Fixed(cost);
        self
    }

    /// Each request costs the bytes of its body as its `Content-Length` states them (at most
    /// `u32::MAX`), for a byte quota ([`Quota::bytes`]) on uploads (an HTTP/1 request with no
    /// body, a plain `GET`, costs 0: see [`RequestInfo::content_length`]); a request whose body
    /// has no stated size (chunked, or HTTP/2 without the header) or an invalid one costs
    /// `missing`: choose it knowing that a client can always leave the header out (the
    /// quota's burst, say, or `u32::MAX` to refuse such requests with `413`). A body of 0 bytes
    /// costs nothing, as every cost of 0 (see [`cost`](Self::cost): it still holds a slot of a
    /// concurrent quota). In the config forms: `cost = "content-length or 1048576"`.
    ///
    /// ```
    /// use tollgate::{Policy, Quota, RequestInfo};
    ///
    /// // 100 MB of uploads an hour per key; a body of unstated size counts as 10 MB.
    /// let uploads = Policy::new("uploads", Quota::per_hour(100_000_000).bytes())
    ///     .cost_from_content_length(10_000_000);
    /// let req = http::Request::post("/upload").header("content-length", "2048").body(()).unwrap();
    /// assert_eq!(uploads.cost_of(&RequestInfo::new(&req)), 2048);
    /// let chunked = http::Request::post("/upload")
    ///     .header("transfer-encoding", "chunked")
    ///     .body(())
    ///     .unwrap();
    /// assert_eq!(uploads.cost_of(&RequestInfo::new(&chunked)), 10_000_000);
    /// ```
    pub fn cost_from_content_length(mut self, missing: u32) -> Self {
        self.cost = Cost::ContentLength { missing };
        self
    }

    /// The cost of each request is computed by `f`.
    pub fn cost_fn<F>(mut self, f: F) -> Self
    where
        F: Fn(&RequestInfo<'_>) -> u32 + Send + Sync + 'static,
    {
        self.cost = Cost::Fn(Arc::new(f));
        self
    }

    /// Shadow mode: decisions are made, counted and logged, but requests are never rejected:
    /// not when a quota denies, not when the request has no key (whatever
    /// [`OnMissingKey`](crate::OnMissingKey) says), and not when the backend fails. Use it to
    /// roll out a new limit and watch what it would do.
    ///
    /// Responses carry no rate-limit fields for a shadow policy: a client following the IETF
    /// draft would otherwise back off for a limit that is not enforced. Turn them on with
    /// [`shadow_headers`](Self::shadow_headers).
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// In shadow mode, still send the `RateLimit` fields of allowed requests (off by
    /// default), e.g. to watch them in a staging environment. Would-be denials are let
    /// through without fields either way.
    pub fn shadow_headers(mut self, send: bool) -> Self {
        self.shadow_headers = send;
        self
    }

    /// Counts a request only when its response matches `when`: the units taken at admission
    /// are given back when it does not. A key at its limit is still refused before the inner
    /// service runs.
    ///
    /// ```
    /// use tollgate::settle::ChargeWhen;
    /// use tollgate::{Policy, Quota};
    ///
    /// // 5 failed logins per 15 minutes; successful ones are free.
    /// let login = Policy::new("login", Quota::new(5, std::time::Duration::from_secs(900)))
    ///     .charge_when(ChargeWhen::status([401, 403]));
    /// assert!(login.settles());
    /// ```
    pub fn charge_when(mut self, when: crate::charge::ChargeWhen) -> Self {
        Arc::make_mut(self.settle.get_or_insert_with(Default::default)).when = Some(when);
        self
    }

    /// Charges a request what its response reports (see [`CostFrom`](crate::charge::CostFrom)):
    /// the request's cost is taken at admission as an estimate, and the difference is settled
    /// when the response comes (more taken, or some given back). A key taken past its limit is
    /// in debt, and refused until it is repaid.
    pub fn cost_from(mut self, from: crate::charge::CostFrom) -> Self {
        Arc::make_mut(self.settle.get_or_insert_with(Default::default)).cost = Some(from);
        self
    }

    /// What a settling request is charged when it ends without a response (the client went
    /// away and its future was dropped, or the inner service answered with an error instead of
    /// a response): [`Cancelled::Charge`](crate::charge::Cancelled) (the default) keeps what
    /// was taken at admission, `Refund` gives it back.
    pub fn on_cancel(mut self, cancelled: crate::charge::Cancelled) -> Self {
        Arc::make_mut(self.settle.get_or_insert_with(Default::default)).cancelled = cancelled;
        self
    }

    /// A penalty: once a request of a key is refused by one of the policy's quotas, the key is
    /// refused for `duration` from then, whatever its quotas hold meanwhile (requests during
    /// the block do not extend it). `Retry-After` is the block's end. Every store shares the
    /// block like the quotas' counts (the deny cache answers a blocked key without a store
    /// call). A request that can never fit (a cost larger than a burst) does not start a block.
    ///
    /// Whole milliseconds, from 1 ms to a year; not on a shadow policy (which refuses nothing).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Policy, Quota};
    ///
    /// // 10 a second; a client that goes over is shut out for a minute.
    /// let api = Policy::new("api", Quota::per_second(10)).block_for(Duration::from_secs(60));
    /// assert_eq!(api.block(), Some(Duration::from_secs(60)));
    /// ```
    pub fn block_for(mut self, duration: std::time::Duration) -> Self {
        self.block = Some(duration);
        self
    }

    /// What a live key keeps of what it used when this policy's quotas change values (a
    /// rule swap, a reloaded configuration, another instance running other values): by
    /// default [`OnChange::Keep`](crate::quota::OnChange::Keep), what it used carries over,
    /// at most the new limit. A quota is known by the policy's name and its own name (or its
    /// place in the policy when it has none) and its algorithm: a changed count, period,
    /// burst or resolution converts the key's state; a changed algorithm, a renamed policy or
    /// quota, or a reordered unnamed quota starts afresh. See `docs/algorithms.md`, "When a
    /// quota changes".
    ///
    /// ```
    /// use tollgate::{OnChange, Policy, Quota};
    ///
    /// let daily = Policy::new("daily", Quota::per_day(10_000)).on_change(OnChange::Reset);
    /// assert_eq!(daily.change_strategy(), OnChange::Reset);
    /// ```
    pub fn on_change(mut self, strategy: crate::quota::OnChange) -> Self {
        self.on_change = strategy;
        self
    }

    /// What live keys keep when the quotas change ([`on_change`](Self::on_change)).
    pub fn change_strategy(&self) -> crate::quota::OnChange {
        self.on_change
    }

    /// The penalty, if any: set with [`block_for`](Self::block_for) (started by any quota's
    /// refusal), or with [`Quota::block_for`](crate::Quota::block_for) on some of its quotas
    /// (started by theirs).
    pub fn block(&self) -> Option<std::time::Duration> {
        self.block
            .or_else(|| self.quotas.iter().find_map(|q| q.block()))
    }

    /// Which quotas' refusals start the [block](Self::block): a bit per quota (bit `i` for
    /// quota `i`), 0 for every quota (a block set on the policy).
    pub(crate) fn block_mask(&self) -> u64 {
        if self.block.is_some() {
            return 0;
        }
        (self.quotas.iter().enumerate())
            .filter(|(_, q)| q.block().is_some())
            .fold(0, |m, (i, _)| m | 1 << i)
    }

    /// Whether a refusal by quota `index` starts a block, by the policy's
    /// [`block_mask`](Self::block_mask) `mask`.
    #[cfg_attr(not(any(feature = "local", feature = "redis")), allow(dead_code))]
    pub(crate) fn blocks_on(mask: u64, index: usize) -> bool {
        mask == 0 || (index < 64 && mask & (1 << index) != 0)
    }

    /// Whether requests are settled after their response
    /// ([`charge_when`](Self::charge_when), [`cost_from`](Self::cost_from)).
    pub fn settles(&self) -> bool {
        self.settle
            .as_ref()
            .is_some_and(|r| r.when.is_some() || r.cost.is_some())
    }

    /// Whether units or slots can be given back to the policy's keys after their admission:
    /// it settles after the response (a refund), holds slots (a release), or is a
    /// [`Limiter`](crate::limiter::Limiter)'s, whose permits settle. A shared store's deny
    /// cache then holds only blocks, which nothing given back lifts.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn gives_back(&self) -> bool {
        self.settles() || self.holds_slots() || self.given_back
    }

    /// This policy, marked as one whose keys are given units back by other means than its
    /// settlement rules (see [`gives_back`](Self::gives_back)).
    pub(crate) fn given_back(mut self) -> Self {
        self.given_back = true;
        self
    }

    /// Whether the policy has a concurrent quota ([`Quota::concurrent`](crate::Quota::concurrent)):
    /// its requests hold a slot until their response ends.
    pub fn holds_slots(&self) -> bool {
        self.quotas
            .iter()
            .any(|q| q.algorithm() == crate::quota::Algorithm::Concurrent)
    }

    /// The settlement rules, when the policy settles.
    pub(crate) fn settle_rules(&self) -> Option<&Arc<crate::charge::ChargeRules>> {
        self.settle.as_ref().filter(|_| self.settles())
    }

    /// Whether a shadow policy sends its rate-limit fields (see
    /// [`shadow_headers`](Self::shadow_headers)).
    pub fn sends_shadow_headers(&self) -> bool {
        self.shadow_headers
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The quotas, in the order they are checked.
    pub fn quotas(&self) -> &[Quota] {
        &self.quotas
    }

    /// Whether the policy is in shadow mode.
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// The cost of `req` under this policy.
    pub fn cost_of(&self, req: &RequestInfo<'_>) -> u32 {
        match &self.cost {
            Cost::Fixed(c) => *c,
            Cost::ContentLength { missing } => req
                .content_length()
                .map_or(*missing, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            Cost::Fn(f) => f(req),
        }
    }

    /// Checks the policy and returns its quotas in integer nanoseconds.
    pub fn validate(&self) -> Result<SmallVec<[QuotaParams; 2]>, ConfigError> {
        if !valid_name(&self.name) {
            return Err(ConfigError::InvalidPolicyName {
                name: self.name.to_string(),
            });
        }
        if self.quotas.is_empty() || self.quotas.len() > Self::MAX_QUOTAS {
            return Err(ConfigError::QuotaCount {
                policy: self.name.to_string(),
                count: self.quotas.len(),
            });
        }
        let mut labels = std::collections::HashSet::new();
        for i in 0..self.quotas.len() {
            let label = self.quota_label(i);
            let too_long = self.quotas[i].name_too_long();
            if too_long || !valid_name(&label) || !labels.insert(label.clone()) {
                return Err(ConfigError::Invalid {
                    option: "Quota::named",
                    reason: format!(
                        "policy `{}`: quota name {label:?} is invalid or used twice",
                        self.name
                    ),
                });
            }
        }
        let params: SmallVec<[QuotaParams; 2]> = self
            .quotas
            .iter()
            .map(|q| q.params(&self.name))
            .collect::<Result<_, _>>()?;
        let on_quotas = self.quotas.iter().filter_map(|q| q.block().map(|b| (q, b)));
        for (q, b) in on_quotas.clone() {
            let bad = |reason: String| ConfigError::Invalid {
                option: "Quota::block_for",
                reason: format!("policy `{}`, quota `{q}`: {reason}", self.name),
            };
            if self.block.is_some() {
                return Err(bad(
                    "the policy blocks on every quota's refusal already (`Policy::block_for`): \
                     set the block on the policy or on its quotas, not both"
                        .to_owned(),
                ));
            }
            if q.algorithm() == crate::quota::Algorithm::Concurrent {
                return Err(bad(
                    "a concurrent quota cannot block (its slots come back as requests end): \
                     block on a rate quota, or on the policy"
                        .to_owned(),
                ));
            }
            if let Some((_, other)) = on_quotas.clone().find(|(_, o)| *o != b) {
                return Err(bad(format!(
                    "the quotas of one policy block for the same time: {b:?} here, {other:?} \
                     on another"
                )));
            }
        }
        if let Some(block) = self.block() {
            let option = if self.block.is_some() {
                "Policy::block_for"
            } else {
                "Quota::block_for"
            };
            let bad = |reason: &str| ConfigError::Invalid {
                option,
                reason: format!("policy `{}`: {reason}", self.name),
            };
            if self.shadow {
                return Err(bad(
                    "a shadow policy refuses nothing, so a block would never start; remove \
                     `block_for` or the shadow mode",
                ));
            }
            let ns = block.as_nanos();
            if ns == 0 || !ns.is_multiple_of(1_000_000) {
                return Err(bad(
                    "a block must be a positive whole number of milliseconds",
                ));
            }
            if block > MAX_BLOCK {
                return Err(bad("a block is at most a year"));
            }
        }
        if params.iter().filter(|p| p.is_concurrent()).count() > 1 {
            return Err(ConfigError::Invalid {
                option: "Quota::concurrent",
                reason: format!(
                    "policy `{}` has more than one concurrent quota: a request holds one slot, \
                     so only the smallest would count; keep one",
                    self.name
                ),
            });
        }
        Ok(params)
    }

    /// A quota's identity in its policy, part of its buckets' names in every store: its
    /// own name (`-<name>`), or its place in the policy (`<index>`) when it has none. Its
    /// values (count, period, burst) are not part of it: a changed quota keeps its buckets
    /// (see [`on_change`](Self::on_change)).
    #[cfg_attr(
        not(any(
            feature = "local",
            feature = "redis",
            feature = "postgres",
            feature = "mysql"
        )),
        allow(dead_code)
    )]
    pub(crate) fn quota_id(&self, index: usize) -> String {
        match self.quotas.get(index).and_then(|q| q.name()) {
            Some(n) => format!("-{n}"),
            None => index.to_string(),
        }
    }

    /// The name a quota has in the headers: its own, the policy's (single quota), or
    /// `<policy>-<index>`.
    pub(crate) fn quota_label(&self, index: usize) -> String {
        match self.quotas[index].name() {
            Some(n) => n.to_owned(),
            None if self.quotas.len() == 1 => self.name.to_string(),
            None => format!("{}-{index}", self.name),
        }
    }
}

#[cfg(feature = "serde")]
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicySpec {
    name: String,
    quotas: Vec<Quota>,
    #[serde(default = "one", skip_serializing_if = "Option::is_none")]
    cost: Option<CostSpec>,
    #[serde(default)]
    shadow: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    shadow_headers: bool,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::charge::serde_forms::ser_charge_when",
        deserialize_with = "crate::charge::serde_forms::de_charge_when"
    )]
    charge_when: Option<crate::charge::ChargeWhen>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::charge::serde_forms::ser_cost_from",
        deserialize_with = "crate::charge::serde_forms::de_cost_from"
    )]
    cost_from: Option<crate::charge::CostFrom>,
    #[serde(
        default,
        skip_serializing_if = "crate::charge::serde_forms::is_charge",
        serialize_with = "crate::charge::serde_forms::ser_cancelled",
        deserialize_with = "crate::charge::serde_forms::de_cancelled"
    )]
    on_cancel: crate::charge::Cancelled,
    /// `Policy::block_for`, as a duration of the quota syntax (`"15min"`, `"30s"`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::quota::serde_duration::ser",
        deserialize_with = "crate::quota::serde_duration::de"
    )]
    block_for: Option<std::time::Duration>,
    /// `Policy::on_change`: `"keep"`, `"reset"`, `"proportional"` or `"additive"`.
    #[serde(default, skip_serializing_if = "is_keep")]
    on_change: crate::quota::OnChange,
}

#[cfg(feature = "serde")]
fn is_keep(s: &crate::quota::OnChange) -> bool {
    *s == crate::quota::OnChange::Keep
}

#[cfg(feature = "serde")]
fn one() -> Option<CostSpec> {
    Some(CostSpec::Fixed(1))
}

/// A policy's cost in the config forms: a number, or `"content-length or N"`.
#[cfg(feature = "serde")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CostSpec {
    Fixed(u32),
    ContentLength { missing: u32 },
}

#[cfg(feature = "serde")]
impl serde::Serialize for CostSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            CostSpec::Fixed(n) => s.serialize_u32(*n),
            CostSpec::ContentLength { missing } => {
                s.serialize_str(&format!("content-length or {missing}"))
            }
        }
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for CostSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = CostSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a cost: a number of units (0 to 4294967295), or \"content-length or N\" \
                     (N: what a request that states no Content-Length costs)",
                )
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<CostSpec, E> {
                u32::try_from(n)
                    .map(CostSpec::Fixed)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(n), &self))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<CostSpec, E> {
                u32::try_from(n)
                    .map(CostSpec::Fixed)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(n), &self))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<CostSpec, E> {
                let words: Vec<&str> = s.split_whitespace().collect();
                match words.as_slice() {
                    ["content-length", "or", n] => n
                        .parse()
                        .map(|missing| CostSpec::ContentLength { missing })
                        .map_err(|_| E::invalid_value(serde::de::Unexpected::Str(s), &self)),
                    ["content-length"] => Err(E::custom(
                        "`cost = \"content-length\"` needs what a request without a \
                         Content-Length costs: write \"content-length or N\"",
                    )),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(s), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Serialized as `{ name, quotas = ["5/s burst 10", { rate = "1000/h", name = "hourly" }, ...],
/// cost, shadow }`, with the settlement rules when there are (`charge_when`, `cost_from`,
/// `on_cancel`: see [`settle`](crate::settle)): a quota with a name is a table. A cost computed
/// by a closure cannot be serialized and is left out; a `charge_when` predicate is an error.
#[cfg(feature = "serde")]
impl serde::Serialize for Policy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        PolicySpec {
            name: self.name.to_string(),
            quotas: self.quotas.to_vec(),
            cost: match self.cost {
                Cost::Fixed(c) => Some(CostSpec::Fixed(c)),
                Cost::ContentLength { missing } => Some(CostSpec::ContentLength { missing }),
                Cost::Fn(_) => None,
            },
            shadow: self.shadow,
            shadow_headers: self.shadow_headers,
            charge_when: self.settle.as_ref().and_then(|r| r.when.clone()),
            cost_from: self.settle.as_ref().and_then(|r| r.cost.clone()),
            on_cancel: self
                .settle
                .as_ref()
                .map(|r| r.cancelled)
                .unwrap_or_default(),
            block_for: self.block,
            on_change: self.on_change,
        }
        .serialize(s)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Policy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let spec = PolicySpec::deserialize(d)?;
        if spec.charge_when.is_none()
            && spec.cost_from.is_none()
            && spec.on_cancel != crate::charge::Cancelled::Charge
        {
            return Err(serde::de::Error::custom(format!(
                "policy `{}`: `on_cancel` applies to policies that settle (with `charge_when` \
                 or `cost_from`), and this one does not",
                spec.name
            )));
        }
        Ok(Policy {
            name: spec.name.into(),
            quotas: spec.quotas.into_iter().collect(),
            cost: match spec.cost {
                None => Cost::Fixed(1),
                Some(CostSpec::Fixed(n)) => Cost::Fixed(n),
                Some(CostSpec::ContentLength { missing }) => Cost::ContentLength { missing },
            },
            shadow: spec.shadow,
            shadow_headers: spec.shadow_headers,
            settle: (spec.charge_when.is_some() || spec.cost_from.is_some()).then(|| {
                Arc::new(crate::charge::ChargeRules {
                    when: spec.charge_when,
                    cost: spec.cost_from,
                    cancelled: spec.on_cancel,
                })
            }),
            block: spec.block_for,
            given_back: false,
            on_change: spec.on_change,
        })
    }
}

/// The longest block (`Policy::block_for`).
const MAX_BLOCK: std::time::Duration = std::time::Duration::from_secs(365 * 86_400);

/// The longest policy name.
pub(crate) const MAX_NAME_LEN: usize = 64;

/// Whether `c` may be in a policy name: visible ASCII but `"` and `\`.
pub(crate) fn name_char(c: char) -> bool {
    c.is_ascii_graphic() && c != '"' && c != '\\'
}

/// 1 to 64 visible ASCII characters without `"` or `\`: safe in a header string and in JSON.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && name.chars().all(name_char)
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.name)
            .field("quotas", &self.quotas)
            .field(
                "cost",
                &match &self.cost {
                    Cost::Fixed(c) => c.to_string(),
                    Cost::ContentLength { missing } => format!("content-length or {missing}"),
                    Cost::Fn(_) => "<fn>".to_owned(),
                },
            )
            .field("shadow", &self.shadow)
            .field("settle", &self.settle_rules())
            .field("block", &self.block)
            .field("on_change", &self.on_change)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_on_quotas_are_checked() {
        use std::time::Duration;
        let hour = Duration::from_secs(3600);
        let ok = Policy::new("p", Quota::per_second(10))
            .and(Quota::per_day(1000).block_for(hour))
            .and(Quota::per_hour(100).fixed_window().block_for(hour));
        ok.validate().unwrap();
        assert_eq!((ok.block(), ok.block_mask()), (Some(hour), 0b110));
        let on_policy = Policy::new("p", Quota::per_second(10)).block_for(hour);
        assert_eq!(on_policy.block_mask(), 0);
        let bad = [
            (
                Policy::new("p", Quota::per_second(10).block_for(hour)).block_for(hour),
                "not both",
            ),
            (
                Policy::new("p", Quota::per_second(10).block_for(hour))
                    .and(Quota::per_day(10).block_for(Duration::from_secs(60))),
                "the same time",
            ),
            (
                Policy::new("p", Quota::per_second(10)).and(Quota::concurrent(2).block_for(hour)),
                "concurrent",
            ),
            (
                Policy::new(
                    "p",
                    Quota::per_second(10).block_for(Duration::from_micros(1500)),
                ),
                "whole number of milliseconds",
            ),
            (
                Policy::new("p", Quota::per_second(10).block_for(hour)).shadow(true),
                "shadow",
            ),
        ];
        for (policy, why) in bad {
            let err = policy.validate().unwrap_err().to_string();
            assert!(err.contains(why), "{policy:?}: {err}");
        }
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "has space", "quo\"te", &"x".repeat(65)] {
            assert!(matches!(
                Policy::new(bad, Quota::per_second(1)).validate(),
                Err(ConfigError::InvalidPolicyName { .. })
            ));
        }
        assert!(
            Policy::new("api.v1-login", Quota::per_second(1))
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn too_many_quotas() {
        let mut p = Policy::new("p", Quota::per_second(1));
        for _ in 0..Policy::MAX_QUOTAS {
            p = p.and(Quota::per_hour(10));
        }
        assert!(matches!(
            p.validate(),
            Err(ConfigError::QuotaCount { count: 9, .. })
        ));
    }
}

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn quota_names_are_checked() {
        let bad = Policy::new("p", Quota::per_second(1).named("a\"b"));
        assert!(bad.validate().is_err());
        let twice =
            Policy::new("p", Quota::per_second(1).named("x")).and(Quota::per_hour(9).named("x"));
        assert!(twice.validate().is_err());
        let ok = Policy::new("p", Quota::per_second(1).named("burst"))
            .and(Quota::per_hour(9).named("hourly"));
        assert!(ok.validate().is_ok());
    }
}
